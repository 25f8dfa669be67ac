//! `lbbsp data fetch`: puts a data set's files into the data folder, verified against the manifest.
//!
//! Each file is skipped when already present with the right sha256, otherwise copied from a local
//! mirror (a folder laid out like the data folder) or downloaded with the `curl` (else `wget`)
//! command-line tool from the manifest's URLs in order. Every new file is first written to a
//! temporary name in its destination folder, checked, then renamed into place, so the final path
//! never holds a partial or unverified file.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::data::manifest::{self, DatasetSpec, FileSpec};
use crate::error::{Error, Result};

/// What [`fetch`] did for one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchAction {
    /// Already present with the right checksum.
    Skipped,
    /// Copied from this mirror file.
    Copied { from: PathBuf },
    /// Downloaded from this URL.
    Downloaded { url: String },
}

/// One file handled by [`fetch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchedFile {
    /// Final location under the data folder.
    pub path: PathBuf,
    pub action: FetchAction,
}

/// The outcome of [`fetch`], one entry per file of the data set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchReport {
    pub dataset: String,
    pub files: Vec<FetchedFile>,
}

impl fmt::Display for FetchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}: {} files verified", self.dataset, self.files.len())?;
        for file in &self.files {
            let what = match &file.action {
                FetchAction::Skipped => "already present".to_string(),
                FetchAction::Copied { from } => format!("copied from {}", from.display()),
                FetchAction::Downloaded { url } => format!("downloaded from {url}"),
            };
            writeln!(f, "  {}: {what}", file.path.display())?;
        }
        Ok(())
    }
}

/// Fetches every file of the data set `name` into `data_dir`, from `mirror` when given (no network
/// then), else from the manifest's URLs.
pub fn fetch(name: &str, data_dir: &Path, mirror: Option<&Path>) -> Result<FetchReport> {
    fetch_spec(manifest::spec(name)?, data_dir, mirror)
}

/// [`fetch`] for a data set description that need not come from the embedded manifest.
pub fn fetch_spec(spec: &DatasetSpec, data_dir: &Path, mirror: Option<&Path>) -> Result<FetchReport> {
    let mut files = Vec::with_capacity(spec.files.len());
    for file in &spec.files {
        let dest = data_dir.join(&file.path);
        if dest.is_file() && manifest::sha256_file(&dest)? == file.sha256 {
            files.push(FetchedFile { path: dest, action: FetchAction::Skipped });
            continue;
        }
        let dir = dest.parent().unwrap_or(data_dir);
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let tmp = TempFile::new(&dest);
        let action = match mirror {
            Some(mirror) => copy_from_mirror(spec, file, mirror, &tmp.path)?,
            None => download(spec, file, &tmp.path)?,
        };
        tmp.persist(&dest)?;
        files.push(FetchedFile { path: dest, action });
    }
    Ok(FetchReport { dataset: spec.name.clone(), files })
}

/// What to do when no source delivered a file.
fn advice(name: &str) -> String {
    format!(
        "this machine seems to have no internet; copy the files from a machine that has them, or run \
         `lbbsp data fetch {name} --mirror DIR` with a folder laid out like datasets/ (e.g. a shared \
         mirror), or point --data-dir/LBBSP_DATA at such a folder"
    )
}

fn copy_from_mirror(spec: &DatasetSpec, file: &FileSpec, mirror: &Path, tmp: &Path) -> Result<FetchAction> {
    let fail = |msg: String| Error::Fetch { dataset: spec.name.clone(), msg };
    let src = mirror.join(&file.path);
    if !src.is_file() {
        return Err(fail(format!(
            "the mirror {} has no {} (looked for {}); copy that file into the mirror from a machine \
             that has it, use a mirror folder laid out like datasets/ (e.g. the shared mirror), or \
             run `lbbsp data fetch {}` without --mirror on a machine with internet",
            mirror.display(),
            file.path,
            src.display(),
            spec.name
        )));
    }
    std::fs::copy(&src, tmp).map_err(|e| Error::io(&src, e))?;
    let actual = manifest::sha256_file(tmp)?;
    if actual != file.sha256 {
        return Err(fail(format!(
            "the mirror copy {} has sha256 {actual}, expected {}: the mirror is corrupt or holds \
             another version; replace it with a good copy",
            src.display(),
            file.sha256
        )));
    }
    Ok(FetchAction::Copied { from: src })
}

fn download(spec: &DatasetSpec, file: &FileSpec, tmp: &Path) -> Result<FetchAction> {
    let mut tried = Vec::new();
    for url in &file.urls {
        match run_downloader(url, tmp) {
            Ok(tool) => {
                let actual = manifest::sha256_file(tmp)?;
                if actual == file.sha256 {
                    return Ok(FetchAction::Downloaded { url: url.clone() });
                }
                tried.push(format!("{url}: {tool} got a file with sha256 {actual}, expected {}", file.sha256));
            }
            Err(why) => tried.push(format!("{url}: {why}")),
        }
    }
    if tried.is_empty() {
        tried.push("(the manifest lists no URL)".into());
    }
    Err(Error::Fetch {
        dataset: spec.name.clone(),
        msg: format!("no source delivered {}; tried:\n  {}\n{}", file.path, tried.join("\n  "), advice(&spec.name)),
    })
}

/// Downloads `url` to `out` with curl, or wget when curl is not installed; returns the tool used.
fn run_downloader(url: &str, out: &Path) -> std::result::Result<&'static str, String> {
    let mut curl = Command::new("curl");
    curl.args(["--fail", "--silent", "--show-error", "--location", "--connect-timeout", "20"])
        .args(["--retry", "2", "--speed-limit", "1024", "--speed-time", "60", "--output"])
        .arg(out)
        .arg(url);
    match run(curl, "curl") {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        other => return other.map(|()| "curl").map_err(|e| e.to_string()),
    }
    let mut wget = Command::new("wget");
    wget.args(["--quiet", "--timeout=20", "--tries=2", "-O"]).arg(out).arg(url);
    match run(wget, "wget") {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err("neither curl nor wget is installed".into()),
        other => other.map(|()| "wget").map_err(|e| e.to_string()),
    }
}

/// Runs a download tool; a non-zero exit becomes an error carrying the tool's last stderr line.
fn run(mut cmd: Command, tool: &str) -> io::Result<()> {
    let out = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).output()?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message");
    Err(io::Error::other(format!("{tool} failed ({}): {}", out.status, last.trim())))
}

/// A temporary file next to its destination, removed on drop unless renamed into place.
struct TempFile {
    path: PathBuf,
}

impl TempFile {
    fn new(dest: &Path) -> TempFile {
        let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        TempFile { path: dest.with_file_name(format!(".{name}.part-{}", std::process::id())) }
    }

    /// Atomically renames the file to `dest`.
    fn persist(self, dest: &Path) -> Result<()> {
        std::fs::rename(&self.path, dest).map_err(|e| Error::io(dest, e))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        // After a successful `persist` the file is gone and this fails harmlessly.
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::idx::tests::scratch;

    fn toy_spec(sum: &str, urls: &str) -> DatasetSpec {
        let text = format!(
            "[toy]\nformat = \"csv\"\nclasses = 2\nsample_shape = [1]\n[[toy.files]]\nrole = \"all\"\n\
             path = \"toy/toy.csv\"\nbytes = 8\nsha256 = \"{sum}\"\nurls = [{urls}]\n"
        );
        manifest::parse(&text).unwrap().remove("toy").unwrap()
    }

    #[test]
    fn copies_from_mirror_then_skips() {
        let root = scratch("fetch-mirror");
        let (mirror, data) = (root.join("mirror"), root.join("data"));
        std::fs::create_dir_all(mirror.join("toy")).unwrap();
        std::fs::write(mirror.join("toy/toy.csv"), "1,0\n2,1\n").unwrap();
        let spec = toy_spec(&manifest::sha256_file(&mirror.join("toy/toy.csv")).unwrap(), "");
        let first = fetch_spec(&spec, &data, Some(&mirror)).unwrap();
        assert!(matches!(first.files[0].action, FetchAction::Copied { .. }), "{first}");
        let again = fetch_spec(&spec, &data, Some(&mirror)).unwrap();
        assert_eq!(again.files[0].action, FetchAction::Skipped);
        assert_eq!(std::fs::read_dir(data.join("toy")).unwrap().count(), 1, "no temporary left");
        std::fs::remove_dir_all(&root).ok();
    }

    #[test]
    fn bad_mirror_copy_or_failed_download_leaves_nothing() {
        let root = scratch("fetch-fail");
        let (mirror, data) = (root.join("mirror"), root.join("data"));
        std::fs::create_dir_all(mirror.join("toy")).unwrap();
        std::fs::write(mirror.join("toy/toy.csv"), "1,0\n2,1\n").unwrap();
        let spec = toy_spec(&"0".repeat(64), "\"http://127.0.0.1:9/toy.csv\"");
        let m = fetch_spec(&spec, &data, Some(&mirror)).unwrap_err().to_string();
        assert!(m.contains("toy.csv") && m.contains("corrupt"), "{m}");
        let m = fetch_spec(&spec, &data, None).unwrap_err().to_string();
        assert!(m.contains("http://127.0.0.1:9/toy.csv") && m.contains("no internet") && m.contains("--mirror"), "{m}");
        assert_eq!(std::fs::read_dir(data.join("toy")).unwrap().count(), 0, "nothing left behind");
        std::fs::remove_dir_all(&root).ok();
    }
}

//! The data-set manifest, `datasets/manifest.toml`: for every data set its format, shape, classes,
//! files, checksums and download mirrors.
//!
//! The manifest is compiled into the binary with `include_str!`, so `lbbsp` finds it from any working
//! directory. Data files live in a separate data folder (`--data-dir` or `LBBSP_DATA`) at the relative
//! paths the manifest gives; [`verify`] checks them against the pinned sha256 before anything is read.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

const MANIFEST_TOML: &str = include_str!("../../datasets/manifest.toml");

/// On-disk format of a data set's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// IDX images and labels (MNIST layout), raw or gzip.
    Idx,
    /// LIBSVM/svmlight sparse text, 1-based feature indices.
    Libsvm,
    /// Numeric CSV without header, label in the last column, raw or gzip.
    Csv,
}

/// What a file holds within its data set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    TrainImages,
    TrainLabels,
    TestImages,
    TestLabels,
    /// Training split of a text format (features and labels together).
    Train,
    /// Test split of a text format.
    Test,
    /// The whole data set in one file, split by the recipe's `data.test_fraction`.
    All,
}

/// One file of a data set.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSpec {
    pub role: Role,
    /// Path relative to the data folder, `/`-separated (e.g. `mnist/train-images-idx3-ubyte.gz`).
    pub path: String,
    /// Exact size in bytes.
    pub bytes: u64,
    /// Lowercase hex sha256 of the file as stored (compressed, if it is compressed).
    pub sha256: String,
    /// Download locations, tried in order.
    pub urls: Vec<String>,
}

/// One data set of the manifest.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSpec {
    /// The table name (`mnist`, `a9a`, ...), filled in after parsing.
    #[serde(skip)]
    pub name: String,
    /// One line for humans: origin, license, sizes.
    #[serde(default)]
    pub description: String,
    pub format: Format,
    /// Number of classes; every label is in `0..classes`.
    pub classes: usize,
    /// Shape of one sample, e.g. `[1, 28, 28]` or `[123]`.
    pub sample_shape: Vec<usize>,
    /// LIBSVM only: the feature count, fixed here because it cannot be inferred from a split.
    #[serde(default)]
    pub features: Option<usize>,
    /// LIBSVM only: label token (e.g. `"+1"`) to class index.
    #[serde(default)]
    pub labels: BTreeMap<String, u32>,
    pub files: Vec<FileSpec>,
}

/// All data sets, by name.
pub type Manifest = BTreeMap<String, DatasetSpec>;

impl DatasetSpec {
    /// Features per sample (the product of `sample_shape`).
    pub fn dim(&self) -> usize {
        self.sample_shape.iter().product()
    }

    /// The file with `role`, if the data set has one.
    pub fn file(&self, role: Role) -> Option<&FileSpec> {
        self.files.iter().find(|f| f.role == role)
    }

    /// Where the file with `role` lives under `data_dir`.
    pub fn path_of(&self, role: Role, data_dir: &Path) -> Result<PathBuf> {
        self.file(role).map(|f| data_dir.join(&f.path)).ok_or_else(|| {
            Error::config(format!("manifest.{}.files", self.name), format!("no file with role {role:?}"))
        })
    }
}

/// Parses and checks a manifest text (the embedded one is [`manifest`]).
pub fn parse(text: &str) -> Result<Manifest> {
    let mut m: Manifest = toml::from_str(text).map_err(|e| Error::config("manifest", e.to_string()))?;
    for (name, spec) in m.iter_mut() {
        spec.name = name.clone();
        validate(spec).map_err(|msg| Error::config(format!("manifest.{name}"), msg))?;
    }
    Ok(m)
}

/// The manifest compiled into the binary, parsed once.
pub fn manifest() -> Result<&'static Manifest> {
    static PARSED: OnceLock<std::result::Result<Manifest, String>> = OnceLock::new();
    PARSED
        .get_or_init(|| parse(MANIFEST_TOML).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|msg| Error::config("manifest", msg.clone()))
}

/// The names of all data sets in the manifest, sorted.
pub fn names() -> Result<Vec<&'static str>> {
    Ok(manifest()?.keys().map(String::as_str).collect())
}

/// The data set called `name`; an unknown name is a `data.dataset` error that lists the known ones.
pub fn spec(name: &str) -> Result<&'static DatasetSpec> {
    let m = manifest()?;
    m.get(name).ok_or_else(|| {
        let known: Vec<&str> = m.keys().map(String::as_str).collect();
        Error::config("data.dataset", format!("unknown data set `{name}`; known data sets: {}", known.join(", ")))
    })
}

/// Checks that every file of `spec` exists under `data_dir` and has the manifest's sha256.
pub fn verify(spec: &DatasetSpec, data_dir: &Path) -> Result<()> {
    for f in &spec.files {
        let path = data_dir.join(&f.path);
        if !path.is_file() {
            return Err(Error::MissingData { path, dataset: spec.name.clone() });
        }
        let actual = sha256_file(&path)?;
        if actual != f.sha256 {
            return Err(Error::Checksum { path, dataset: spec.name.clone(), expected: f.sha256.clone(), actual });
        }
    }
    Ok(())
}

/// Lowercase hex sha256 of a file, read in 1 MiB blocks.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::io(path, e)),
        };
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Lowercase hexadecimal of `bytes`.
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Consistency rules a serde shape cannot express.
fn validate(spec: &DatasetSpec) -> std::result::Result<(), String> {
    if spec.classes < 2 {
        return Err(format!("`classes` is {}, need at least 2", spec.classes));
    }
    if spec.sample_shape.is_empty() || spec.sample_shape.contains(&0) {
        return Err(format!("`sample_shape` {:?} has no or zero dimensions", spec.sample_shape));
    }
    let mut roles: Vec<Role> = spec.files.iter().map(|f| f.role).collect();
    for f in &spec.files {
        let hex_ok = f.sha256.len() == 64 && f.sha256.bytes().all(|b| b"0123456789abcdef".contains(&b));
        if !hex_ok {
            return Err(format!("{}: `sha256` must be 64 lowercase hex digits", f.path));
        }
        let rel = Path::new(&f.path);
        if f.path.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(format!("{}: `path` must be relative, without `..`", f.path));
        }
    }
    roles.sort();
    let wanted: &[&[Role]] = match spec.format {
        Format::Idx => &[&[Role::TrainImages, Role::TrainLabels, Role::TestImages, Role::TestLabels]],
        Format::Libsvm => &[&[Role::Train, Role::Test]],
        Format::Csv => &[&[Role::Train, Role::Test], &[Role::All]],
    };
    if !wanted.contains(&roles.as_slice()) {
        return Err(format!("file roles {roles:?} do not fit format {:?}; want one of {wanted:?}", spec.format));
    }
    if spec.format == Format::Idx && spec.sample_shape.len() != 3 {
        return Err(format!("IDX images need `sample_shape = [1, rows, cols]`, not {:?}", spec.sample_shape));
    }
    match (spec.format, spec.features) {
        (Format::Libsvm, Some(f)) if f == spec.dim() => {}
        (Format::Libsvm, f) => {
            return Err(format!(
                "`features` ({f:?}) must be set and equal the product of `sample_shape` {:?}",
                spec.sample_shape
            ))
        }
        (_, Some(_)) => return Err("`features` is for the libsvm format only".into()),
        (_, None) => {}
    }
    if (spec.format == Format::Libsvm) == spec.labels.is_empty() {
        return Err("`labels` (token -> class) is required for libsvm and allowed for nothing else".into());
    }
    if let Some((tok, c)) = spec.labels.iter().find(|(_, &c)| c as usize >= spec.classes) {
        return Err(format!("label `{tok}` maps to class {c}, beyond `classes` = {}", spec.classes));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_manifest_parses_and_has_the_four_sets() {
        assert_eq!(names().unwrap(), vec!["a9a", "digits", "fashion-mnist", "mnist"]);
        let a9a = spec("a9a").unwrap();
        assert_eq!((a9a.format, a9a.features, a9a.classes), (Format::Libsvm, Some(123), 2));
        assert_eq!(a9a.labels["+1"], 1);
        let mnist = spec("mnist").unwrap();
        assert_eq!(mnist.sample_shape, vec![1, 28, 28]);
        assert_eq!(mnist.file(Role::TestLabels).unwrap().bytes, 4542);
        assert!(mnist.files.iter().all(|f| f.urls.len() == 2));
    }

    #[test]
    fn unknown_name_is_a_config_error_listing_the_known_ones() {
        let msg = spec("cifar").unwrap_err().to_string();
        assert!(msg.contains("data.dataset") && msg.contains("cifar"), "{msg}");
        assert!(msg.contains("mnist") && msg.contains("a9a"), "{msg}");
    }

    #[test]
    fn unknown_fields_and_bad_entries_are_rejected() {
        let good = "[t]\nformat = \"csv\"\nclasses = 2\nsample_shape = [2]\n[[t.files]]\nrole = \"all\"\npath = \"t/t.csv\"\nbytes = 1\nsha256 = \"".to_string()
            + &"0".repeat(64)
            + "\"\nurls = []\n";
        assert!(parse(&good).is_ok());
        let extra = good.replace("classes = 2", "classes = 2\ncolour = 1");
        assert!(parse(&extra).unwrap_err().to_string().contains("colour"));
        let bad_role = good.replace("\"all\"", "\"train\"");
        assert!(parse(&bad_role).unwrap_err().to_string().contains("roles"));
        let escape = good.replace("t/t.csv", "../t.csv");
        assert!(parse(&escape).unwrap_err().to_string().contains("relative"));
    }

    #[test]
    fn sha256_and_verify_on_a_small_file() {
        let dir = crate::data::idx::tests::scratch("manifest-verify");
        std::fs::create_dir_all(dir.join("t")).unwrap();
        std::fs::write(dir.join("t/abc.csv"), b"abc").unwrap();
        let sum = sha256_file(&dir.join("t/abc.csv")).unwrap();
        assert_eq!(sum, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        let mut spec = parse(&format!(
            "[t]\nformat = \"csv\"\nclasses = 2\nsample_shape = [2]\n[[t.files]]\nrole = \"all\"\npath = \"t/abc.csv\"\nbytes = 3\nsha256 = \"{sum}\"\nurls = []\n"
        ))
        .unwrap()
        .remove("t")
        .unwrap();
        verify(&spec, &dir).unwrap();
        spec.files[0].sha256 = "0".repeat(64);
        let msg = verify(&spec, &dir).unwrap_err().to_string();
        assert!(msg.contains("abc.csv") && msg.contains("lbbsp data fetch t"), "{msg}");
        spec.files[0].path = "t/gone.csv".into();
        let msg = verify(&spec, &dir).unwrap_err().to_string();
        assert!(msg.contains("gone.csv") && msg.contains("missing"), "{msg}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

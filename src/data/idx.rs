//! IDX files, the MNIST container format, raw or gzip-compressed.
//!
//! Layout: a big-endian `u32` magic (`2051` for 3-d `u8` image arrays, `2049` for 1-d `u8` label
//! arrays), one big-endian `u32` per dimension, then the bytes row-major. The gzip detection here
//! ([`open`]) is shared with the text readers.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

use flate2::read::GzDecoder;

use crate::error::{Error, Result};

/// Magic number of an IDX file of `u8` images (`n × rows × cols`).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an IDX file of `u8` labels (`n`).
pub const LABELS_MAGIC: u32 = 0x0000_0801;

/// A data file opened for reading, decompressed on the fly when it is gzip.
pub struct Input {
    pub reader: Box<dyn BufRead>,
    /// Whether the bytes pass through a gzip decoder.
    pub gzip: bool,
}

impl Input {
    /// Turns a read error into a typed one: a gzip decoder's errors mean a damaged file, other
    /// errors are I/O. `line` is the text line being read, if any.
    pub fn read_error(&self, path: &Path, line: Option<usize>, e: io::Error) -> Error {
        let at = line.map(|l| format!("line {l}: ")).unwrap_or_default();
        if self.gzip {
            Error::data(path, format!("{at}corrupted or truncated gzip stream: {e}"))
        } else if e.kind() == io::ErrorKind::InvalidData {
            Error::data(path, format!("{at}{e}"))
        } else {
            Error::io(path, e)
        }
    }

    /// Calls `f(text, at)` for every line of a text file; `at(msg)` makes an error naming the file
    /// and the line. Read errors (a damaged gzip stream) and non-UTF-8 lines are typed errors too.
    pub fn for_each_line(
        &mut self,
        path: &Path,
        mut f: impl FnMut(&str, &dyn Fn(String) -> Error) -> Result<()>,
    ) -> Result<()> {
        let mut line = Vec::new();
        let mut lineno = 0usize;
        loop {
            line.clear();
            match self.reader.read_until(b'\n', &mut line) {
                Ok(0) => return Ok(()),
                Ok(_) => lineno += 1,
                Err(e) => return Err(self.read_error(path, Some(lineno + 1), e)),
            }
            let at = |msg: String| Error::data(path, format!("line {lineno}: {msg}"));
            let text = std::str::from_utf8(&line).map_err(|_| at("not UTF-8 text".into()))?;
            f(text, &at)?;
        }
    }
}

/// Opens `path`, through a gzip decoder when the name ends in `.gz` or the file starts with the
/// gzip magic `1f 8b`.
pub fn open(path: &Path) -> Result<Input> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut raw = BufReader::with_capacity(1 << 20, file);
    let head = raw.fill_buf().map_err(|e| Error::io(path, e))?;
    let gzip = head.starts_with(&[0x1f, 0x8b]) || path.extension().is_some_and(|e| e == "gz");
    let reader: Box<dyn BufRead> =
        if gzip { Box::new(BufReader::with_capacity(1 << 20, GzDecoder::new(raw))) } else { Box::new(raw) };
    Ok(Input { reader, gzip })
}

/// The whole (decompressed) content of `path`.
fn read_all(path: &Path) -> Result<Vec<u8>> {
    let mut input = open(path)?;
    let mut data = Vec::new();
    if let Err(e) = input.reader.read_to_end(&mut data) {
        return Err(input.read_error(path, None, e));
    }
    Ok(data)
}

/// Checks the header of an IDX array of `u8` with `ndims` dimensions and returns the dimensions.
fn header(path: &Path, data: &[u8], magic: u32, ndims: usize) -> Result<Vec<usize>> {
    let kind = if magic == IMAGES_MAGIC { "images" } else { "labels" };
    let hlen = 4 + 4 * ndims;
    let too_short =
        || Error::data(path, format!("{} bytes is too short for an IDX {kind} header ({hlen} bytes)", data.len()));
    if data.len() < 4 {
        return Err(too_short());
    }
    let word = |i: usize| u32::from_be_bytes([data[4 * i], data[4 * i + 1], data[4 * i + 2], data[4 * i + 3]]);
    let found = word(0);
    if found != magic {
        let hint = match found {
            IMAGES_MAGIC => " (this is an IDX images file)",
            LABELS_MAGIC => " (this is an IDX labels file)",
            _ => "",
        };
        return Err(Error::data(
            path,
            format!(
                "wrong IDX magic number {found} (0x{found:08x}){hint}; expected {magic} (0x{magic:08x}) for IDX {kind}"
            ),
        ));
    }
    if data.len() < hlen {
        return Err(too_short());
    }
    let dims: Vec<usize> = (1..=ndims).map(|i| word(i) as usize).collect();
    if dims.contains(&0) {
        return Err(Error::data(path, format!("IDX {kind} header has a zero dimension: {dims:?}")));
    }
    let body = data.len() - hlen;
    let expected = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    if expected != Some(body) {
        let shape = dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x");
        return Err(Error::data(
            path,
            format!(
                "header says {} {kind} ({shape} = {} bytes) but the file holds {body} bytes after its {hlen}-byte header",
                dims[0],
                expected.map_or("too many".to_string(), |e| e.to_string()),
            ),
        ));
    }
    Ok(dims)
}

/// Reads an IDX images file: `(count, rows, cols, pixels)` with `count × rows × cols` bytes row-major.
pub fn read_images(path: &Path) -> Result<(usize, usize, usize, Vec<u8>)> {
    let mut data = read_all(path)?;
    let dims = header(path, &data, IMAGES_MAGIC, 3)?;
    data.drain(..16);
    Ok((dims[0], dims[1], dims[2], data))
}

/// Reads an IDX labels file: one byte per sample.
pub fn read_labels(path: &Path) -> Result<Vec<u8>> {
    let mut data = read_all(path)?;
    header(path, &data, LABELS_MAGIC, 1)?;
    data.drain(..8);
    Ok(data)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Write;
    use std::path::PathBuf;

    /// A fresh, empty scratch folder unique to this process and `tag`.
    pub(crate) fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lbbsp-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    pub(crate) fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(bytes).unwrap();
        enc.finish().unwrap()
    }

    fn idx(magic: u32, dims: &[u32], body: &[u8]) -> Vec<u8> {
        let mut v = magic.to_be_bytes().to_vec();
        for d in dims {
            v.extend(d.to_be_bytes());
        }
        v.extend(body);
        v
    }

    fn err(r: Result<impl std::fmt::Debug>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn reads_raw_and_gzip_images_and_labels() {
        let dir = scratch("idx-ok");
        let px: Vec<u8> = (0..2 * 2 * 3).collect();
        let images = idx(IMAGES_MAGIC, &[2, 2, 3], &px);
        std::fs::write(dir.join("im.idx"), &images).unwrap();
        std::fs::write(dir.join("im.idx.gz"), gzip(&images)).unwrap();
        // gzip detected by magic even without the .gz suffix
        std::fs::write(dir.join("im-gz-noext"), gzip(&images)).unwrap();
        for name in ["im.idx", "im.idx.gz", "im-gz-noext"] {
            assert_eq!(read_images(&dir.join(name)).unwrap(), (2, 2, 3, px.clone()), "{name}");
        }
        std::fs::write(dir.join("lb.gz"), gzip(&idx(LABELS_MAGIC, &[3], &[7, 0, 9]))).unwrap();
        assert_eq!(read_labels(&dir.join("lb.gz")).unwrap(), vec![7, 0, 9]);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn damaged_files_give_errors_naming_the_file() {
        let dir = scratch("idx-bad");
        let images = idx(IMAGES_MAGIC, &[4, 5, 5], &[1; 100]);
        let gz = gzip(&images);
        let p = dir.join("trunc-images.gz");
        std::fs::write(&p, &gz[..gz.len() / 2]).unwrap();
        let m = err(read_images(&p));
        assert!(m.contains("trunc-images.gz") && m.contains("corrupted or truncated gzip"), "{m}");

        let p = dir.join("labels-as-images");
        std::fs::write(&p, idx(LABELS_MAGIC, &[3], &[1, 2, 3])).unwrap();
        let m = err(read_images(&p));
        assert!(m.contains("labels-as-images") && m.contains("2049") && m.contains("expected 2051"), "{m}");
        let m = err(read_labels(&dir.join("trunc-images.gz")));
        assert!(m.contains("trunc-images.gz"), "{m}");

        let p = dir.join("short-body");
        std::fs::write(&p, idx(IMAGES_MAGIC, &[4, 5, 5], &[1; 99])).unwrap();
        let m = err(read_images(&p));
        assert!(m.contains("short-body") && m.contains("100") && m.contains("99"), "{m}");

        let p = dir.join("long-labels");
        std::fs::write(&p, idx(LABELS_MAGIC, &[2], &[1, 2, 3])).unwrap();
        let m = err(read_labels(&p));
        assert!(m.contains("long-labels") && m.contains("says 2") && m.contains("holds 3"), "{m}");

        let p = dir.join("zero-dim");
        std::fs::write(&p, idx(IMAGES_MAGIC, &[0, 5, 5], &[])).unwrap();
        assert!(err(read_images(&p)).contains("zero dimension"));

        let p = dir.join("tiny");
        std::fs::write(&p, [0u8, 0, 8]).unwrap();
        assert!(err(read_labels(&p)).contains("too short"));

        let p = dir.join("not-gzip.gz");
        std::fs::write(&p, images).unwrap();
        assert!(err(read_images(&p)).contains("not-gzip.gz"));
        assert!(err(read_images(&dir.join("absent"))).contains("absent"));
        std::fs::remove_dir_all(&dir).ok();
    }
}

//! IDX files, the MNIST container format, raw or gzip-compressed.
//!
//! Layout: a big-endian `u32` magic (`2051` for 3-d `u8` image arrays, `2049` for 1-d `u8` label
//! arrays), one big-endian `u32` per dimension, then the bytes row-major. The gzip detection here
//! ([`open`], and [`from_bytes`] for content already in memory) is shared with the text readers.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

use flate2::read::MultiGzDecoder;

use crate::error::{Error, Result};

/// Magic number of an IDX file of `u8` images (`n × rows × cols`).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an IDX file of `u8` labels (`n`).
pub const LABELS_MAGIC: u32 = 0x0000_0801;

/// A data file opened for reading, decompressed on the fly when it is gzip.
pub struct Input<'a> {
    pub reader: Box<dyn BufRead + 'a>,
    /// Whether the bytes pass through a gzip decoder.
    pub gzip: bool,
    /// How many bytes `reader` holds, when that is known before reading (a plain file or buffer):
    /// a header's claimed size is then checked before its body is read.
    pub len: Option<u64>,
}

impl Input<'_> {
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

    /// Fills `buf` from the start of the stream; fewer bytes only at its end. Returns the count.
    fn read_up_to(&mut self, path: &Path, buf: &mut [u8]) -> Result<usize> {
        let mut got = 0;
        while got < buf.len() {
            match self.reader.read(&mut buf[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.read_error(path, None, e)),
            }
        }
        Ok(got)
    }
}

/// Opens `path`, through a gzip decoder when the name ends in `.gz` or the file starts with the
/// gzip magic `1f 8b`.
pub fn open(path: &Path) -> Result<Input<'static>> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let size = file.metadata().ok().filter(|m| m.is_file()).map(|m| m.len());
    wrap(BufReader::with_capacity(1 << 20, file), path, size, 1 << 20)
}

/// The content of a data file already in memory, read like [`open`] reads the file: `path` names
/// it in errors, and a `.gz` name means gzip as it does for a file.
pub fn from_bytes<'a>(bytes: &'a [u8], path: &Path) -> Result<Input<'a>> {
    wrap(bytes, path, Some(bytes.len() as u64), 64 << 10)
}

/// `raw` (holding `size` bytes, if known), through a gzip decoder (with a `buffer`-byte output
/// buffer) when it starts with the gzip magic or `path` ends in `.gz`.
fn wrap<'a, R: BufRead + 'a>(mut raw: R, path: &Path, size: Option<u64>, buffer: usize) -> Result<Input<'a>> {
    let head = raw.fill_buf().map_err(|e| Error::io(path, e))?;
    let gzip = head.starts_with(&[0x1f, 0x8b]) || path.extension().is_some_and(|e| e == "gz");
    Ok(if gzip {
        // Every member, as `gzip -d` reads them: a file of concatenated members (`cat a.gz b.gz`)
        // is one stream, not its first part.
        Input { reader: Box::new(BufReader::with_capacity(buffer, MultiGzDecoder::new(raw))), gzip, len: None }
    } else {
        Input { reader: Box::new(raw), gzip, len: size }
    })
}

/// Reads an IDX array of `u8` with `ndims` dimensions: its dimensions and its bytes. The header is
/// checked before the body is read, and the body is read only as far as the header says (plus one
/// byte, to tell a longer file), so a damaged header claiming a huge array allocates nothing for it.
fn read_array(input: &mut Input<'_>, path: &Path, magic: u32, ndims: usize) -> Result<(Vec<usize>, Vec<u8>)> {
    let kind = if magic == IMAGES_MAGIC { "images" } else { "labels" };
    let hlen = 4 + 4 * ndims;
    let mut head = [0u8; 4 + 4 * 3];
    let got = input.read_up_to(path, &mut head[..hlen])?;
    let too_short = || Error::data(path, format!("{got} bytes is too short for an IDX {kind} header ({hlen} bytes)"));
    if got < 4 {
        return Err(too_short());
    }
    let word = |i: usize| u32::from_be_bytes([head[4 * i], head[4 * i + 1], head[4 * i + 2], head[4 * i + 3]]);
    check_magic(path, word(0), magic, kind)?;
    if got < hlen {
        return Err(too_short());
    }
    let dims: Vec<usize> = (1..=ndims).map(|i| word(i) as usize).collect();
    if dims.contains(&0) {
        return Err(Error::data(path, format!("IDX {kind} header has a zero dimension: {dims:?}")));
    }
    let shape = dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x");
    let Some(expected) = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)) else {
        return Err(Error::data(
            path,
            format!("header says {} {kind} ({shape}), more bytes than memory can hold: the header is damaged", dims[0]),
        ));
    };
    let mismatch = |holds: String| {
        let n = dims[0];
        Error::data(
            path,
            format!("header says {n} {kind} ({shape} = {expected} bytes) but the file holds {holds} bytes after its {hlen}-byte header"),
        )
    };
    if let Some(len) = input.len {
        let body = len.saturating_sub(hlen as u64);
        if body != expected as u64 {
            return Err(mismatch(body.to_string()));
        }
    }
    // Sized by the data actually read when its length is not known (gzip), never by the header.
    let mut body = Vec::with_capacity(if input.len.is_some() { expected } else { 0 });
    if let Err(e) = input.reader.by_ref().take(expected as u64 + 1).read_to_end(&mut body) {
        return Err(input.read_error(path, None, e));
    }
    match body.len() {
        n if n < expected => Err(mismatch(n.to_string())),
        n if n > expected => Err(mismatch(format!("more than {expected}"))),
        _ => Ok((dims, body)),
    }
}

/// Refuses a file whose IDX magic number is not `magic`, saying what it is when it is the other kind.
fn check_magic(path: &Path, found: u32, magic: u32, kind: &str) -> Result<()> {
    if found == magic {
        return Ok(());
    }
    let hint = match found {
        IMAGES_MAGIC => " (this is an IDX images file)",
        LABELS_MAGIC => " (this is an IDX labels file)",
        _ => "",
    };
    Err(Error::data(
        path,
        format!(
            "wrong IDX magic number {found} (0x{found:08x}){hint}; expected {magic} (0x{magic:08x}) for IDX {kind}"
        ),
    ))
}

/// Reads an IDX images file: `(count, rows, cols, pixels)` with `count × rows × cols` bytes row-major.
pub fn read_images(path: &Path) -> Result<(usize, usize, usize, Vec<u8>)> {
    images(&mut open(path)?, path)
}

/// [`read_images`] of a file's content already in memory; `path` names it in errors.
pub fn parse_images(bytes: &[u8], path: &Path) -> Result<(usize, usize, usize, Vec<u8>)> {
    images(&mut from_bytes(bytes, path)?, path)
}

fn images(input: &mut Input<'_>, path: &Path) -> Result<(usize, usize, usize, Vec<u8>)> {
    let (dims, pixels) = read_array(input, path, IMAGES_MAGIC, 3)?;
    Ok((dims[0], dims[1], dims[2], pixels))
}

/// Reads an IDX labels file: one byte per sample.
pub fn read_labels(path: &Path) -> Result<Vec<u8>> {
    Ok(read_array(&mut open(path)?, path, LABELS_MAGIC, 1)?.1)
}

/// [`read_labels`] of a file's content already in memory; `path` names it in errors.
pub fn parse_labels(bytes: &[u8], path: &Path) -> Result<Vec<u8>> {
    Ok(read_array(&mut from_bytes(bytes, path)?, path, LABELS_MAGIC, 1)?.1)
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

    /// The in-memory readers are the file readers: same results, same errors.
    #[test]
    fn bytes_read_like_files() {
        let dir = scratch("idx-bytes");
        let images = idx(IMAGES_MAGIC, &[2, 2, 3], &[5; 12]);
        for (name, bytes) in
            [("im", images.clone()), ("im.gz", gzip(&images)), ("cut.gz", gzip(&images)[..20].to_vec())]
        {
            let p = dir.join(name);
            std::fs::write(&p, &bytes).unwrap();
            assert_eq!(format!("{:?}", parse_images(&bytes, &p)), format!("{:?}", read_images(&p)), "{name}");
        }
        let labels = idx(LABELS_MAGIC, &[3], &[1, 2, 3]);
        let gz = gzip(&labels);
        assert_eq!(parse_labels(&gz, Path::new("lb")).unwrap(), [1, 2, 3]);
        // All the labels decompress, but the stream's checksum trailer is cut: still refused.
        let m = err(parse_labels(&gz[..gz.len() - 4], Path::new("lb-cut")));
        assert!(m.contains("lb-cut") && m.contains("corrupted or truncated gzip"), "{m}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A header claiming far more than the file holds is refused from the header and the real
    /// length alone; one whose product overflows says so; a gzip stream is read no further than
    /// the header's size plus one byte.
    #[test]
    fn huge_headers_are_refused_before_reading_the_body() {
        let path = Path::new("huge-images");
        // 10^6 x 10^3 x 10^3 = 10^12 bytes claimed, 4 present.
        let claim = idx(IMAGES_MAGIC, &[1_000_000, 1_000, 1_000], &[1, 2, 3, 4]);
        let m = err(parse_images(&claim, path));
        assert!(m.contains("huge-images") && m.contains("1000000000000 bytes") && m.contains("holds 4 bytes"), "{m}");
        let m = err(parse_images(&gzip(&claim), path));
        assert!(m.contains("1000000000000 bytes") && m.contains("holds 4 bytes"), "{m}");
        let m = err(parse_images(&idx(IMAGES_MAGIC, &[u32::MAX; 3], &[1]), path));
        assert!(m.contains("more bytes than memory can hold"), "{m}");
        let m = err(parse_labels(&gzip(&idx(LABELS_MAGIC, &[2], &[0; 1000])), Path::new("long.gz")));
        assert!(m.contains("long.gz") && m.contains("says 2") && m.contains("holds more than 2 bytes"), "{m}");
        let m = err(parse_labels(&[0, 0, 8, 1, 0, 0], Path::new("short")));
        assert!(m.contains("6 bytes is too short for an IDX labels header (8 bytes)"), "{m}");
    }
}

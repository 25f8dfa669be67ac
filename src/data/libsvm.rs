//! LIBSVM/svmlight sparse text, read into dense rows.
//!
//! One sample per line: `<label> <index>:<value> ...` with 1-based indices. `#` starts a comment,
//! `qid:` tokens are ignored, blank lines are skipped. The feature count is given by the caller (the
//! manifest's `features`), because a split need not use the highest index: a9a.t never uses
//! feature 123.

use std::collections::BTreeMap;
use std::path::Path;

use crate::data::idx;
use crate::error::Result;

/// Reads `path` (raw or gzip) into `n × features` dense features and `n` class labels, mapping
/// label tokens through `label_map` (exact text first, then numeric value, so `1` finds `"+1"`).
pub fn read(path: &Path, features: usize, label_map: &BTreeMap<String, u32>) -> Result<(Vec<f32>, Vec<u32>)> {
    read_input(idx::open(path)?, path, features, label_map)
}

/// [`read`] of a file's content already in memory; `path` names it in errors.
pub fn parse(
    bytes: &[u8],
    path: &Path,
    features: usize,
    label_map: &BTreeMap<String, u32>,
) -> Result<(Vec<f32>, Vec<u32>)> {
    read_input(idx::from_bytes(bytes, path)?, path, features, label_map)
}

fn read_input(
    mut input: idx::Input<'_>,
    path: &Path,
    features: usize,
    label_map: &BTreeMap<String, u32>,
) -> Result<(Vec<f32>, Vec<u32>)> {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    input.for_each_line(path, |text, at| {
        let text = text.split('#').next().unwrap_or_default();
        let mut tokens = text.split_ascii_whitespace();
        let Some(label) = tokens.next() else {
            return Ok(());
        };
        let class = lookup(label, label_map).ok_or_else(|| {
            let known: Vec<&str> = label_map.keys().map(String::as_str).collect();
            at(format!("unknown label `{label}`; the manifest's `labels` knows {}", known.join(", ")))
        })?;
        let row = x.len();
        x.resize(row + features, 0.0);
        for tok in tokens {
            let malformed = || at(format!("malformed token `{tok}`, expected `index:value`"));
            let (i, v) = tok.split_once(':').ok_or_else(malformed)?;
            if i == "qid" {
                continue;
            }
            let i: usize = i.parse().map_err(|_| malformed())?;
            let v: f32 = v.parse().ok().filter(|v: &f32| v.is_finite()).ok_or_else(malformed)?;
            if i == 0 {
                return Err(at(format!("feature index 0 in `{tok}`; indices are 1-based")));
            }
            if i > features {
                return Err(at(format!(
                    "feature index {i} in `{tok}` is beyond the declared feature count {features}; \
                     raise `features` (and `sample_shape`) in the manifest or recipe"
                )));
            }
            x[row + i - 1] = v;
        }
        y.push(class);
        Ok(())
    })?;
    Ok((x, y))
}

/// The class of a label token: exact text, else the same number (`1` and `+1.0` match `"+1"`).
fn lookup(token: &str, label_map: &BTreeMap<String, u32>) -> Option<u32> {
    if let Some(&c) = label_map.get(token) {
        return Some(c);
    }
    let value: f64 = token.parse().ok()?;
    label_map.iter().find(|(k, _)| k.parse::<f64>().ok() == Some(value)).map(|(_, &c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::idx::tests::{gzip, scratch};

    fn labels() -> BTreeMap<String, u32> {
        [("-1".to_string(), 0), ("+1".to_string(), 1)].into()
    }

    #[test]
    fn parses_sparse_lines_into_dense_rows() {
        let dir = scratch("libsvm-ok");
        let text = "+1 1:1 3:0.5 \n-1 2:2 # comment\n1 qid:4 4:-1\n-1\n\n\n";
        for (name, bytes) in [("s.txt", text.as_bytes().to_vec()), ("s.gz", gzip(text.as_bytes()))] {
            let p = dir.join(name);
            std::fs::write(&p, bytes).unwrap();
            let (x, y) = read(&p, 4, &labels()).unwrap();
            assert_eq!(y, vec![1, 0, 1, 0]);
            #[rustfmt::skip]
            assert_eq!(x, vec![1.0, 0.0, 0.5, 0.0,  0.0, 2.0, 0.0, 0.0,  0.0, 0.0, 0.0, -1.0,  0.0, 0.0, 0.0, 0.0]);
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn errors_name_the_file_and_line() {
        let dir = scratch("libsvm-bad");
        let cases = [
            ("bad-value", "+1 1:1\n-1 3:x\n", "line 2", "`3:x`"),
            ("no-colon", "+1 1:1\n+1 1:1\n-1 abc\n", "line 3", "`abc`"),
            ("bad-index", "+1 a:1\n", "line 1", "`a:1`"),
            ("index-zero", "+1 0:1\n", "line 1", "1-based"),
            ("too-far", "-1 1:1\n+1 5:1\n", "line 2", "`features`"),
            ("unknown-label", "+1 1:1\n2 1:1\n", "line 2", "unknown label `2`"),
        ];
        for (name, text, line, what) in cases {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            let m = read(&p, 4, &labels()).unwrap_err().to_string();
            assert!(m.contains(name) && m.contains(line) && m.contains(what), "{m}");
        }
        let p = dir.join("cut.gz");
        let gz = gzip("+1 1:1 2:1 3:1\n".repeat(200).as_bytes());
        std::fs::write(&p, &gz[..gz.len() / 2]).unwrap();
        let m = read(&p, 4, &labels()).unwrap_err().to_string();
        assert!(m.contains("cut.gz") && m.contains("gzip") && m.contains("line"), "{m}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The in-memory reader is the file reader; indices past any feature count are refused.
    #[test]
    fn bytes_read_like_files_and_huge_indices_are_refused() {
        let (x, y) = parse(gzip(b"+1 2:1\n").as_slice(), Path::new("s.gz"), 2, &labels()).unwrap();
        assert_eq!((x, y), (vec![0.0, 1.0], vec![1]));
        for tok in ["1000000000000:1", "18446744073709551616:1"] {
            let m =
                parse(format!("+1 {tok}\n").as_bytes(), Path::new("huge.txt"), 4, &labels()).unwrap_err().to_string();
            assert!(m.contains("huge.txt") && m.contains("line 1") && m.contains(tok), "{m}");
        }
    }
}

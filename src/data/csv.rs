//! Numeric CSV without header, raw or gzip: `feature_count` numbers, then an integer class label.
//!
//! This is the layout of scikit-learn's `digits.csv.gz`. Fields may carry surrounding spaces; blank
//! lines are skipped.

use std::path::Path;

use crate::data::idx;
use crate::error::Result;

/// Reads `path` (raw or gzip, detected like IDX) into `n × feature_count` features and `n` labels.
pub fn read(path: &Path, feature_count: usize) -> Result<(Vec<f32>, Vec<u32>)> {
    read_input(idx::open(path)?, path, feature_count)
}

/// [`read`] of a file's content already in memory; `path` names it in errors.
pub fn parse(bytes: &[u8], path: &Path, feature_count: usize) -> Result<(Vec<f32>, Vec<u32>)> {
    read_input(idx::from_bytes(bytes, path)?, path, feature_count)
}

fn read_input(mut input: idx::Input<'_>, path: &Path, feature_count: usize) -> Result<(Vec<f32>, Vec<u32>)> {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    input.for_each_line(path, |text, at| {
        let text = text.trim();
        if text.is_empty() {
            return Ok(());
        }
        // Counted before anything is parsed or stored, without collecting: a line of a million
        // commas costs no more memory than the line itself.
        let columns = text.split(',').count();
        if columns != feature_count + 1 {
            return Err(at(format!(
                "expected {} columns ({feature_count} features and a label), found {columns}",
                feature_count + 1
            )));
        }
        let mut fields = text.split(',').map(str::trim);
        for (col, field) in fields.by_ref().take(feature_count).enumerate() {
            let v: f32 = field
                .parse()
                .ok()
                .filter(|v: &f32| v.is_finite())
                .ok_or_else(|| at(format!("column {}: `{field}` is not a finite number", col + 1)))?;
            x.push(v);
        }
        let label = fields.next().unwrap_or_default();
        y.push(parse_label(label).map_err(|why| at(format!("column {}: label `{label}` {why}", feature_count + 1)))?);
        Ok(())
    })?;
    Ok((x, y))
}

/// A class label: a non-negative integer, written `3` or `3.0`.
fn parse_label(s: &str) -> std::result::Result<u32, &'static str> {
    if let Ok(v) = s.parse::<u32>() {
        return Ok(v);
    }
    match s.parse::<f64>() {
        Err(_) => Err("is not a number"),
        Ok(v) if v < 0.0 => Err("is negative; labels are class indices 0, 1, ..."),
        Ok(v) if v.fract() != 0.0 || !v.is_finite() => Err("is not an integer"),
        Ok(v) if v > u32::MAX as f64 => Err("is too large"),
        Ok(v) => Ok(v as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::idx::tests::{gzip, scratch};

    #[test]
    fn parses_raw_and_gzip() {
        let dir = scratch("csv-ok");
        let text = "0,1.5,2\n 3 , 4 ,1.0\r\n\n";
        for (name, bytes) in [("d.csv", text.as_bytes().to_vec()), ("d.csv.gz", gzip(text.as_bytes()))] {
            let p = dir.join(name);
            std::fs::write(&p, bytes).unwrap();
            assert_eq!(read(&p, 2).unwrap(), (vec![0.0, 1.5, 3.0, 4.0], vec![2, 1]), "{name}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_file_of_concatenated_gzip_members_is_read_whole() {
        let bytes = [gzip(b"0,1.5,2\n"), gzip(b"3,4,1\n")].concat();
        let got = parse(&bytes, Path::new("two-members.csv.gz"), 2).unwrap();
        assert_eq!(got, (vec![0.0, 1.5, 3.0, 4.0], vec![2, 1]));
    }

    #[test]
    fn errors_name_the_file_and_line() {
        let dir = scratch("csv-bad");
        let cases = [
            ("columns.csv", "1,2,0\n1,2\n", "line 2", "expected 3 columns"),
            ("nan.csv", "1,2,0\n1,2,0\n1,x,0\n", "line 3", "`x` is not a finite number"),
            ("negative.csv", "1,2,-1\n", "line 1", "negative"),
            ("fraction.csv", "1,2,0\n1,2,0.5\n", "line 2", "not an integer"),
            ("word.csv", "1,2,cat\n", "line 1", "not a number"),
        ];
        for (name, text, line, what) in cases {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            let m = read(&p, 2).unwrap_err().to_string();
            assert!(m.contains(name) && m.contains(line) && m.contains(what), "{m}");
        }
        let p = dir.join("cut.csv.gz");
        let gz = gzip("1,2,3\n".repeat(500).as_bytes());
        std::fs::write(&p, &gz[..gz.len() / 2]).unwrap();
        let m = read(&p, 2).unwrap_err().to_string();
        assert!(m.contains("cut.csv.gz") && m.contains("corrupted or truncated gzip"), "{m}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The in-memory reader is the file reader; a line of many columns is refused by its count.
    #[test]
    fn bytes_read_like_files_and_wide_lines_are_counted() {
        let text = "0,1.5,2\n 3 , 4 ,1.0\r\n\n";
        assert_eq!(parse(text.as_bytes(), Path::new("d.csv"), 2).unwrap(), (vec![0.0, 1.5, 3.0, 4.0], vec![2, 1]));
        let wide = "0,".repeat(100_000);
        let m = parse(wide.as_bytes(), Path::new("wide.csv"), 2).unwrap_err().to_string();
        assert!(
            m.contains("wide.csv")
                && m.contains("line 1")
                && m.contains("expected 3 columns")
                && m.contains("found 100001"),
            "{m}"
        );
    }
}

//! The real data sets, from the folder in `LBBSP_DATA` (default: the shared mirror next to the
//! crate): sizes and labels as published, damaged copies caught with the file named, and fetching
//! from a local mirror.

use std::path::{Path, PathBuf};

use anyhow::Result;
use lbbsp::data::dataset::{DataConfig, Splits, Standardize};
use lbbsp::data::fetch::{self, FetchAction};
use lbbsp::data::load;
use lbbsp::data::{idx, manifest};

fn data_dir() -> PathBuf {
    std::env::var_os("LBBSP_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/datasets")))
}

/// A fresh, empty scratch folder unique to this process and `tag`.
fn scratch(tag: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("lbbsp-it-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn load(name: &str, scale: f32, test_fraction: Option<f32>) -> Result<Splits> {
    let cfg = DataConfig { dataset: name.into(), scale, standardize: Standardize::None, test_fraction, split_seed: 0 };
    Ok(load::load(&cfg, &data_dir())?)
}

fn class_counts(y: &[u32], classes: usize) -> Vec<usize> {
    let mut c = vec![0; classes];
    for &l in y {
        c[l as usize] += 1;
    }
    c
}

fn check_images(s: &Splits, first_train: u32, first_test: u32) {
    assert_eq!((s.train.len(), s.test.len()), (60000, 10000));
    assert_eq!(s.train.sample_shape, vec![1, 28, 28]);
    assert_eq!(s.train.x.len(), 60000 * 784);
    assert_eq!((s.train.y[0], s.test.y[0]), (first_train, first_test));
    assert!(class_counts(&s.train.y, 10).iter().all(|&c| c > 5000));
    let (lo, hi) = s.train.x.iter().fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
    assert_eq!((lo, hi), (0.0, 1.0), "pixels 0..255 divided by scale 255");
}

#[test]
fn mnist_has_60000_train_and_10000_test_images() -> Result<()> {
    check_images(&load("mnist", 255.0, None)?, 5, 7);
    Ok(())
}

#[test]
fn fashion_mnist_has_60000_train_and_10000_test_images() -> Result<()> {
    let s = load("fashion-mnist", 255.0, None)?;
    check_images(&s, 9, 9);
    assert_eq!(class_counts(&s.train.y, 10), vec![6000; 10]);
    Ok(())
}

#[test]
fn a9a_has_123_features_even_in_the_test_split() -> Result<()> {
    let s = load("a9a", 1.0, None)?;
    assert_eq!((s.train.len(), s.test.len()), (32561, 16281));
    assert_eq!((s.train.dim(), s.test.dim()), (123, 123));
    assert_eq!(class_counts(&s.train.y, 2), vec![24720, 7841]);
    assert_eq!(class_counts(&s.test.y, 2), vec![12435, 3846]);
    assert!(s.test.x.chunks_exact(123).all(|r| r[122] == 0.0), "a9a.t never uses feature 123");
    assert!(s.train.x.chunks_exact(123).any(|r| r[122] == 1.0));
    Ok(())
}

#[test]
fn digits_is_split_by_test_fraction() -> Result<()> {
    let s = load("digits", 16.0, Some(0.2))?;
    assert_eq!(s.train.len() + s.test.len(), 1797);
    assert_eq!(s.test.len(), 359); // round(1797 × 0.2)
    assert_eq!(s.train.dim(), 64);
    assert!(s.train.x.iter().chain(&s.test.x).all(|v| (0.0..=1.0).contains(v)));
    let m = load("digits", 16.0, None).unwrap_err().to_string();
    assert!(m.contains("data.test_fraction"), "{m}");
    Ok(())
}

#[test]
fn truncated_gzip_names_the_file() -> Result<()> {
    let dir = scratch("truncated")?;
    let bytes = std::fs::read(data_dir().join("mnist/t10k-images-idx3-ubyte.gz"))?;
    let cut = dir.join("t10k-images-idx3-ubyte.gz");
    std::fs::write(&cut, &bytes[..bytes.len() / 2])?;
    let m = idx::read_images(&cut).unwrap_err().to_string();
    assert!(m.contains(&cut.display().to_string()), "{m}");
    assert!(m.contains("corrupted or truncated gzip stream"), "{m}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn corrupted_copy_fails_the_checksum_with_the_fetch_fix() -> Result<()> {
    let dir = scratch("corrupt")?;
    let rel = "sklearn-digits/digits.csv.gz";
    let mut bytes = std::fs::read(data_dir().join(rel))?;
    bytes[1000] ^= 0x40;
    std::fs::create_dir_all(dir.join("sklearn-digits"))?;
    std::fs::write(dir.join(rel), bytes)?;
    let cfg = DataConfig {
        dataset: "digits".into(),
        scale: 16.0,
        standardize: Standardize::None,
        test_fraction: Some(0.2),
        split_seed: 0,
    };
    let m = load::load(&cfg, &dir).unwrap_err().to_string();
    assert!(m.contains("digits.csv.gz") && m.contains("checksum"), "{m}");
    assert!(m.contains("lbbsp data fetch digits"), "{m}");
    std::fs::remove_dir_all(&dir)?;
    let m = load::load(&cfg, &dir).unwrap_err().to_string();
    assert!(m.contains("missing data file") && m.contains("digits.csv.gz"), "{m}");
    Ok(())
}

#[test]
fn fetch_from_mirror_copies_verifies_then_skips() -> Result<()> {
    let dir = scratch("fetch")?;
    for name in manifest::names()? {
        let first = fetch::fetch(name, &dir, Some(&data_dir()))?;
        assert!(first.files.iter().all(|f| matches!(f.action, FetchAction::Copied { .. })), "{first}");
        manifest::verify(manifest::spec(name)?, &dir)?;
        let again = fetch::fetch(name, &dir, Some(&data_dir()))?;
        assert!(again.files.iter().all(|f| f.action == FetchAction::Skipped), "{again}");
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn mirror_without_the_file_says_what_to_do() -> Result<()> {
    let root = scratch("fetch-partial")?;
    let (mirror, dest) = (root.join("mirror"), root.join("data"));
    let rel = "mnist/train-labels-idx1-ubyte.gz";
    std::fs::create_dir_all(mirror.join("mnist"))?;
    std::fs::copy(data_dir().join(rel), mirror.join(rel))?;
    let m = fetch::fetch("mnist", &dest, Some(&mirror)).unwrap_err().to_string();
    assert!(m.contains("mnist/train-images-idx3-ubyte.gz"), "{m}");
    assert!(m.contains("copy that file into the mirror") && m.contains("without --mirror"), "{m}");
    let left: Vec<_> = std::fs::read_dir(dest.join("mnist"))?.collect::<std::io::Result<_>>()?;
    assert!(left.is_empty(), "no partial file left: {left:?}");
    std::fs::remove_dir_all(&root)?;
    Ok(())
}

#[test]
fn unknown_data_set_lists_the_known_ones() {
    let m = fetch::fetch("cifar-10", Path::new("unused"), None).unwrap_err().to_string();
    assert!(m.contains("data.dataset") && m.contains("fashion-mnist"), "{m}");
}

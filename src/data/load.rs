//! Loading a data set named in the manifest (checksums verified, split, normalised), and the
//! synthetic `random-mnist` of the benchmarks.

use crate::data::dataset::{DataConfig, Dataset, Normalizer, Splits};
use crate::data::manifest::{DatasetSpec, Format, Role};
use crate::data::{csv, idx, libsvm, manifest, rng};
use crate::error::{Error, Result};
use rayon::prelude::*;
use std::path::Path;

/// Loads the data set `cfg.dataset` from `data_dir`, verified against the manifest's checksums,
/// as train and test splits normalised with statistics of the training split.
///
/// IDX images keep their raw `0..255` values before `cfg.scale`; LIBSVM rows are dense with the
/// manifest's feature count; a data set shipped as one file is split by `cfg.test_fraction` with the
/// permutation stream `[cfg.split_seed, 0x5eed]` (test = its first `round(n × fraction)` entries).
pub fn load(cfg: &DataConfig, data_dir: &Path) -> Result<Splits> {
    if !(cfg.scale.is_finite() && cfg.scale > 0.0) {
        return Err(Error::config(
            "data.scale",
            format!("{} must be a positive number, e.g. 255 for 8-bit images", cfg.scale),
        ));
    }
    let (mut train, mut test) = if cfg.dataset == RANDOM_MNIST {
        if cfg.test_fraction.is_some() {
            return Err(Error::config(
                "data.test_fraction",
                format!("`{RANDOM_MNIST}` makes its own test split; remove `test_fraction` from [data]"),
            ));
        }
        let s = random_mnist();
        (s.train, s.test)
    } else {
        load_files(cfg, data_dir)?
    };
    let norm = Normalizer::fit(cfg, &train);
    norm.apply(&mut train);
    norm.apply(&mut test);
    Ok(Splits { train, test })
}

/// The raw train and test splits of a manifest data set, checksums verified.
fn load_files(cfg: &DataConfig, data_dir: &Path) -> Result<(Dataset, Dataset)> {
    let spec = manifest::spec(&cfg.dataset)?;
    manifest::verify(spec, data_dir)?;
    let single_file = spec.file(Role::All).is_some();
    if cfg.test_fraction.is_some() && !single_file {
        return Err(Error::config(
            "data.test_fraction",
            format!("`{}` ships its own test split; remove `test_fraction` from [data]", spec.name),
        ));
    }
    Ok(match spec.format {
        Format::Idx => (
            load_idx(spec, data_dir, Role::TrainImages, Role::TrainLabels)?,
            load_idx(spec, data_dir, Role::TestImages, Role::TestLabels)?,
        ),
        Format::Libsvm => {
            let features = spec.features.unwrap_or_else(|| spec.dim());
            let read = |role| -> Result<Dataset> {
                let path = spec.path_of(role, data_dir)?;
                let (x, y) = libsvm::read(&path, features, &spec.labels)?;
                labelled(spec, &path, x, y)
            };
            (read(Role::Train)?, read(Role::Test)?)
        }
        Format::Csv => {
            let read = |role| -> Result<Dataset> {
                let path = spec.path_of(role, data_dir)?;
                let (x, y) = csv::read(&path, spec.dim())?;
                labelled(spec, &path, x, y)
            };
            if single_file {
                split_by_fraction(cfg, &spec.name, read(Role::All)?)?
            } else {
                (read(Role::Train)?, read(Role::Test)?)
            }
        }
    })
}

/// The synthetic data set of the benchmark recipes: `dataset = "random-mnist"` in `[data]`.
pub const RANDOM_MNIST: &str = "random-mnist";
/// Sample shape and class count of [`RANDOM_MNIST`] (those of MNIST).
pub const RANDOM_MNIST_SHAPE: [usize; 3] = [1, 28, 28];
pub const RANDOM_MNIST_CLASSES: usize = 10;

/// `random-mnist`: 60,000 training and 1,000 test samples shaped like MNIST, pixels uniform in
/// `[0, 1)`, labels uniform in `0..10`, all from a fixed seed. No files and no checksum: it exists
/// to time training on exactly the data the peer benchmarks use (`../shared/peers`), not to learn.
pub fn random_mnist() -> Splits {
    Splits { train: random_images(60_000, 0), test: random_images(1_000, 1) }
}

/// `n` random images; sample `i` of split `split` is drawn from the stream `[0x7261_6e64, split, i]`,
/// so the data does not depend on the thread count.
fn random_images(n: usize, split: u64) -> Dataset {
    let d: usize = RANDOM_MNIST_SHAPE.iter().product();
    let mut x = feature_buffer(n * d);
    x.resize(n * d, 0.0);
    let mut y = vec![0u32; n];
    x.par_chunks_mut(d).zip(y.par_iter_mut()).enumerate().for_each(|(i, (row, label))| {
        let mut r = rng::Rng::from_keys(&[0x7261_6e64, split, i as u64]);
        row.iter_mut().for_each(|v| *v = r.next_f32());
        *label = r.below(RANDOM_MNIST_CLASSES) as u32;
    });
    Dataset { x, y, sample_shape: RANDOM_MNIST_SHAPE.to_vec(), classes: RANDOM_MNIST_CLASSES }
}

/// One IDX split: images as `f32` in `0..=255` with shape `[1, rows, cols]`, checked against the labels.
fn load_idx(spec: &DatasetSpec, data_dir: &Path, images: Role, labels: Role) -> Result<Dataset> {
    let (ipath, lpath) = (spec.path_of(images, data_dir)?, spec.path_of(labels, data_dir)?);
    let (n, rows, cols, pixels) = idx::read_images(&ipath)?;
    let y: Vec<u32> = idx::read_labels(&lpath)?.into_iter().map(u32::from).collect();
    if n != y.len() {
        return Err(Error::data(
            &ipath,
            format!("holds {n} images but {} holds {} labels; one of the two files is wrong", lpath.display(), y.len()),
        ));
    }
    if spec.sample_shape != [1, rows, cols] {
        return Err(Error::data(
            &ipath,
            format!("images are {rows}x{cols} but the manifest's sample_shape is {:?}", spec.sample_shape),
        ));
    }
    let mut x = feature_buffer(pixels.len());
    x.extend(pixels.into_iter().map(f32::from));
    labelled(spec, &ipath, x, y)
}

/// An empty buffer with room for `len` features, backed by transparent huge pages where the kernel
/// offers them (`madvise(MADV_HUGEPAGE)` before the first touch; Linux, best effort). A training
/// batch gathers rows from all over the data set, and with 4 KB pages nearly every row costs a TLB
/// miss whose page walk itself misses the caches; 2 MB pages make most of those walks hits.
fn feature_buffer(len: usize) -> Vec<f32> {
    let x: Vec<f32> = Vec::with_capacity(len);
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let (start, end) = (x.as_ptr() as usize, x.as_ptr() as usize + len * std::mem::size_of::<f32>());
        let (lo, hi) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
        if hi > lo {
            // SAFETY: advice only, on pages inside this allocation that nothing has touched yet.
            unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
        }
    }
    x
}

/// Wraps parsed rows as a data set after checking every label is below the class count.
fn labelled(spec: &DatasetSpec, path: &Path, x: Vec<f32>, y: Vec<u32>) -> Result<Dataset> {
    if y.is_empty() {
        return Err(Error::data(path, "holds no samples"));
    }
    if let Some((i, &c)) = y.iter().enumerate().find(|(_, &c)| c as usize >= spec.classes) {
        return Err(Error::data(
            path,
            format!(
                "sample {i} has label {c}, but `{}` has {} classes (0..{})",
                spec.name,
                spec.classes,
                spec.classes - 1
            ),
        ));
    }
    Ok(Dataset { x, y, sample_shape: spec.sample_shape.clone(), classes: spec.classes })
}

/// Splits a one-file data set: test = the first `round(n × test_fraction)` samples of the permutation
/// `[split_seed, 0x5eed]`, train = the rest; both keep ascending original order.
fn split_by_fraction(cfg: &DataConfig, name: &str, all: Dataset) -> Result<(Dataset, Dataset)> {
    let Some(fraction) = cfg.test_fraction else {
        return Err(Error::config(
            "data.test_fraction",
            format!("`{name}` ships as one file, so the recipe must say how much to hold out for testing: add e.g. `test_fraction = 0.2` to [data]"),
        ));
    };
    let n = all.len();
    let n_test = (n as f64 * fraction as f64).round();
    if !(fraction > 0.0 && fraction < 1.0) || n_test < 1.0 || n_test >= n as f64 {
        return Err(Error::config(
            "data.test_fraction",
            format!("{fraction} must be in (0, 1) and leave both splits non-empty ({n} samples)"),
        ));
    }
    let perm = rng::permutation(n, &[cfg.split_seed, 0x5eed]);
    let (mut test_idx, mut train_idx) = (perm[..n_test as usize].to_vec(), perm[n_test as usize..].to_vec());
    test_idx.sort_unstable();
    train_idx.sort_unstable();
    Ok((all.subset(&train_idx), all.subset(&test_idx)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::dataset::Standardize;

    fn cfg(test_fraction: Option<f32>) -> DataConfig {
        DataConfig {
            dataset: "digits".into(),
            scale: 1.0,
            standardize: Standardize::None,
            test_fraction,
            split_seed: 3,
        }
    }

    fn numbered(n: usize) -> Dataset {
        Dataset {
            x: (0..n).map(|i| i as f32).collect(),
            y: (0..n).map(|i| (i % 2) as u32).collect(),
            sample_shape: vec![1],
            classes: 2,
        }
    }

    #[test]
    fn fraction_split_is_a_sorted_partition_keyed_by_split_seed() {
        let (train, test) = split_by_fraction(&cfg(Some(0.25)), "toy", numbered(10)).unwrap();
        assert_eq!((train.len(), test.len()), (7, 3)); // round(2.5) = 3
        let mut all: Vec<f32> = train.x.iter().chain(&test.x).copied().collect();
        assert!(train.x.windows(2).all(|w| w[0] < w[1]) && test.x.windows(2).all(|w| w[0] < w[1]));
        all.sort_by(f32::total_cmp);
        assert_eq!(all, (0..10).map(|i| i as f32).collect::<Vec<_>>());
        let perm = rng::permutation(10, &[3, 0x5eed]);
        let mut want: Vec<f32> = perm[..3].iter().map(|&i| i as f32).collect();
        want.sort_by(f32::total_cmp);
        assert_eq!(test.x, want);
    }

    #[test]
    fn fraction_is_required_and_bounded() {
        let m = split_by_fraction(&cfg(None), "digits", numbered(10)).unwrap_err().to_string();
        assert!(m.contains("data.test_fraction") && m.contains("test_fraction = 0.2"), "{m}");
        for bad in [0.0, 1.0, 0.01, f32::NAN] {
            assert!(split_by_fraction(&cfg(Some(bad)), "toy", numbered(10)).is_err(), "{bad}");
        }
    }

    #[test]
    fn idx_image_and_label_counts_must_agree() {
        let dir = std::env::temp_dir().join(format!("lbbsp-load-idx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let header = |magic: u32, dims: &[u32]| -> Vec<u8> {
            std::iter::once(magic).chain(dims.iter().copied()).flat_map(u32::to_be_bytes).collect()
        };
        let mut images = header(idx::IMAGES_MAGIC, &[3, 2, 2]);
        images.extend([0u8; 12]);
        let mut labels = header(idx::LABELS_MAGIC, &[2]);
        labels.extend([1u8, 0]);
        std::fs::write(dir.join("im"), images).unwrap();
        std::fs::write(dir.join("lb"), labels).unwrap();
        let mut toml = "[t]\nformat = \"idx\"\nclasses = 2\nsample_shape = [1, 2, 2]\n".to_string();
        for (role, path) in
            [("train-images", "im"), ("train-labels", "lb"), ("test-images", "im"), ("test-labels", "lb")]
        {
            toml += &format!(
                "[[t.files]]\nrole = \"{role}\"\npath = \"{path}\"\nbytes = 0\nsha256 = \"{}\"\nurls = []\n",
                "0".repeat(64)
            );
        }
        let spec = manifest::parse(&toml).unwrap().remove("t").unwrap();
        let m = load_idx(&spec, &dir, Role::TrainImages, Role::TrainLabels).unwrap_err().to_string();
        assert!(m.contains("im") && m.contains("lb") && m.contains("3 images") && m.contains("2 labels"), "{m}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn random_mnist_is_fixed_uniform_and_needs_no_files() {
        let c = DataConfig { dataset: RANDOM_MNIST.into(), ..cfg(None) };
        let s = load(&c, Path::new("/nonexistent")).unwrap();
        assert_eq!((s.train.len(), s.test.len(), s.train.dim()), (60_000, 1_000, 784));
        assert!(s.train.x.iter().all(|v| (0.0..1.0).contains(v)));
        let mean = s.train.x.iter().map(|&v| v as f64).sum::<f64>() / s.train.x.len() as f64;
        assert!((mean - 0.5).abs() < 1e-3, "{mean}");
        let mut counts = [0usize; 10];
        s.train.y.iter().for_each(|&c| counts[c as usize] += 1);
        assert!(counts.iter().all(|&k| (5_500..6_500).contains(&k)), "{counts:?}");
        assert_eq!(s.train, random_mnist().train, "same data every time");
        assert_ne!(s.train.row(0), s.test.row(0));
        let e = load(&DataConfig { test_fraction: Some(0.1), ..c }, Path::new("/x")).unwrap_err().to_string();
        assert!(e.contains("data.test_fraction"), "{e}");
    }

    #[test]
    fn unknown_data_set_and_bad_scale_are_config_errors() {
        let mut c = cfg(None);
        c.dataset = "nope".into();
        let m = load(&c, Path::new("/nonexistent")).unwrap_err().to_string();
        assert!(m.contains("data.dataset") && m.contains("digits"), "{m}");
        c.scale = 0.0;
        assert!(load(&c, Path::new("/nonexistent")).unwrap_err().to_string().contains("data.scale"));
    }
}

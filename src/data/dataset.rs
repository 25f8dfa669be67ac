//! In-memory datasets: dense `f32` features, `u32` class labels, and the recipe's `[data]` section.
//!
//! Every sample is a row of `dim()` floats (images are flattened row-major, channel first), so a
//! mini-batch is gathered by copying rows named by the epoch permutation straight into the model's
//! input buffer.

use serde::{Deserialize, Serialize};

/// The `[data]` section of a recipe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Name of the data set in `datasets/manifest.toml` (`mnist`, `fashion-mnist`, `a9a`, `digits`).
    pub dataset: String,
    /// Raw feature values are divided by this (255 for 8-bit images, 16 for digits).
    #[serde(default = "one")]
    pub scale: f32,
    /// Standardisation applied after scaling, with statistics of the training split only.
    #[serde(default)]
    pub standardize: Standardize,
    /// For data sets shipped as one file (digits): the fraction held out as the test split.
    #[serde(default)]
    pub test_fraction: Option<f32>,
    /// Seed of the held-out split permutation (independent of the training seed).
    #[serde(default)]
    pub split_seed: u64,
}

fn one() -> f32 {
    1.0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Standardize {
    /// Leave scaled values as they are.
    #[default]
    None,
    /// Subtract one mean and divide by one standard deviation over all training features.
    Global,
    /// Per feature mean and standard deviation (features with zero variance are only centred).
    PerFeature,
}

/// A labelled data set held in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// `len() × dim()` features, row-major.
    pub x: Vec<f32>,
    /// One class label per sample, in `0..classes`.
    pub y: Vec<u32>,
    /// Shape of one sample, e.g. `[1, 28, 28]` or `[123]`.
    pub sample_shape: Vec<usize>,
    pub classes: usize,
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.y.len()
    }
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }
    /// Features per sample.
    pub fn dim(&self) -> usize {
        self.sample_shape.iter().product()
    }
    pub fn row(&self, i: usize) -> &[f32] {
        let d = self.dim();
        &self.x[i * d..(i + 1) * d]
    }

    /// Copies the samples `idx` into `x` (`idx.len() × dim()`) and their labels into `y`.
    pub fn gather_into(&self, idx: &[usize], x: &mut [f32], y: &mut [u32]) {
        let d = self.dim();
        assert!(x.len() >= idx.len() * d && y.len() >= idx.len());
        // Rows come from all over the data set (memory-bound), so the copy runs on the step's team.
        let rows = GATHER_ROWS_PER_TASK;
        crate::kernels::team::zip_chunks_mut([&mut x[..idx.len() * d]], (rows * d).max(1), &|t, [xs]| {
            for (row, &i) in xs.chunks_exact_mut(d).zip(&idx[t * rows..]) {
                row.copy_from_slice(self.row(i));
            }
        });
        for (y, &i) in y.iter_mut().zip(idx) {
            *y = self.y[i];
        }
    }

    /// The samples `idx` as a new data set.
    pub fn subset(&self, idx: &[usize]) -> Dataset {
        let d = self.dim();
        let mut x = vec![0.0; idx.len() * d];
        let mut y = vec![0; idx.len()];
        self.gather_into(idx, &mut x, &mut y);
        Dataset { x, y, sample_shape: self.sample_shape.clone(), classes: self.classes }
    }
}

/// Samples per team task when gathering a batch.
const GATHER_ROWS_PER_TASK: usize = 16;

/// Training and test splits of one data set.
#[derive(Debug, Clone)]
pub struct Splits {
    pub train: Dataset,
    pub test: Dataset,
}

/// Per-feature affine map `x -> (x / scale - mean) / std` fitted on the training split.
#[derive(Debug, Clone, PartialEq)]
pub struct Normalizer {
    pub scale: f32,
    pub mean: Vec<f32>,
    pub inv_std: Vec<f32>,
}

impl Normalizer {
    /// Fits the map described by `cfg` on `train` (statistics in f64).
    pub fn fit(cfg: &DataConfig, train: &Dataset) -> Normalizer {
        let d = train.dim();
        let n = train.len().max(1) as f64;
        let s = cfg.scale as f64;
        let (mean, inv_std) = match cfg.standardize {
            Standardize::None => (vec![0.0; d], vec![1.0; d]),
            Standardize::Global => {
                let (mut sum, mut sq) = (0.0f64, 0.0f64);
                for &v in &train.x {
                    let v = v as f64 / s;
                    sum += v;
                    sq += v * v;
                }
                let cnt = (train.x.len().max(1)) as f64;
                let m = sum / cnt;
                let sd = (sq / cnt - m * m).max(0.0).sqrt();
                let inv = if sd > 1e-12 { 1.0 / sd } else { 1.0 };
                (vec![m as f32; d], vec![inv as f32; d])
            }
            Standardize::PerFeature => {
                let mut sum = vec![0.0f64; d];
                let mut sq = vec![0.0f64; d];
                for row in train.x.chunks_exact(d) {
                    for j in 0..d {
                        let v = row[j] as f64 / s;
                        sum[j] += v;
                        sq[j] += v * v;
                    }
                }
                let mut mean = vec![0.0f32; d];
                let mut inv = vec![1.0f32; d];
                for j in 0..d {
                    let m = sum[j] / n;
                    let sd = (sq[j] / n - m * m).max(0.0).sqrt();
                    mean[j] = m as f32;
                    inv[j] = if sd > 1e-6 { (1.0 / sd) as f32 } else { 1.0 };
                }
                (mean, inv)
            }
        };
        Normalizer { scale: cfg.scale, mean, inv_std }
    }

    pub fn apply(&self, data: &mut Dataset) {
        let d = data.dim();
        let inv_scale = 1.0 / self.scale;
        for row in data.x.chunks_exact_mut(d) {
            for ((v, m), is) in row.iter_mut().zip(&self.mean).zip(&self.inv_std) {
                *v = (*v * inv_scale - m) * is;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> Dataset {
        Dataset { x: vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0], y: vec![0, 1, 0], sample_shape: vec![2], classes: 2 }
    }

    #[test]
    fn per_feature_standardisation_gives_zero_mean_unit_variance() {
        let cfg = DataConfig {
            dataset: "toy".into(),
            scale: 2.0,
            standardize: Standardize::PerFeature,
            test_fraction: None,
            split_seed: 0,
        };
        let mut d = toy();
        let norm = Normalizer::fit(&cfg, &d);
        norm.apply(&mut d);
        for j in 0..2 {
            let col: Vec<f32> = (0..3).map(|i| d.x[i * 2 + j]).collect();
            let m: f32 = col.iter().sum::<f32>() / 3.0;
            let v: f32 = col.iter().map(|c| (c - m) * (c - m)).sum::<f32>() / 3.0;
            assert!(m.abs() < 1e-6 && (v - 1.0).abs() < 1e-5, "{m} {v}");
        }
    }

    #[test]
    fn gather_copies_rows_and_labels() {
        let d = toy();
        let mut x = vec![0.0; 4];
        let mut y = vec![9; 2];
        d.gather_into(&[2, 0], &mut x, &mut y);
        assert_eq!(x, vec![8.0, 10.0, 0.0, 2.0]);
        assert_eq!(y, vec![0, 0]);
    }
}

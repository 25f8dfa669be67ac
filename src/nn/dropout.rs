//! Inverted dropout with masks keyed by the sample, not by the rank or row that processes it.
//!
//! In training, feature `j` of the sample with dataset index `id` is kept with probability `1 − p`
//! and scaled by `1/(1 − p)` (so evaluation is the identity). Its keep/drop draw is the `j`-th
//! number of the stream
//!
//! ```text
//!     Rng::from_keys(&[seed, epoch, id, layer_key])
//! ```
//!
//! so whichever rank, and whichever row of its slice, gets the sample under any balancing, the mask
//! is the same, and a 1-rank and a 3-rank run follow the same trajectory. `layer_key` is the layer's
//! index in `model.layers`; for a layer nested in a block it is derived from its path (see
//! [`crate::nn::model`]).

use crate::data::rng::Rng;
use crate::kernels::grow;
use crate::kernels::team;
use crate::nn::layers::{batch_back, batch_of, rows, rows_mut, Grads, Io, Layer, Pass, SAMPLES_PER_TASK};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut2};

/// `y = x ⊙ m / (1 − p)` with `m_j ~ Bernoulli(1 − p)` in training, `y = x` in evaluation; shape
/// preserved (`B×D → B×D`, any per-sample shape).
#[derive(Debug, Clone)]
pub struct Dropout {
    /// Drop probability, in `[0, 1)`.
    pub p: f32,
    pub shape: Vec<usize>,
    /// Distinguishes this layer's masks from other dropout layers'.
    pub layer_key: u64,
    /// `b × D` multipliers (`0` or `1/(1 − p)`) of the last training pass.
    mask: Vec<f32>,
    /// Whether the last forward pass was in training mode (the mask is only valid then).
    masked: bool,
}

impl Dropout {
    pub fn new(p: f32, shape: Vec<usize>, layer_key: u64) -> Dropout {
        assert!((0.0..1.0).contains(&p), "dropout: p = {p} is not in [0, 1)");
        Dropout { p, shape, layer_key, mask: Vec::new(), masked: false }
    }
    fn features(&self) -> usize {
        self.shape.iter().product()
    }
}

impl Layer for Dropout {
    fn kind(&self) -> &'static str {
        "dropout"
    }
    fn out_shape(&self) -> Vec<usize> {
        self.shape.clone()
    }
    /// `x: B×D → y: B×D`.
    fn forward(&mut self, _p: ArrayView1<f32>, x: ArrayView2<f32>, y: ArrayViewMut2<f32>, pass: &Pass) {
        let d = self.features();
        let b = batch_of("dropout", &x, &y, d, d);
        let (x, y) = (rows(x), rows_mut(y));
        assert_eq!(pass.sample_ids.len(), b, "dropout: one sample id per row");
        self.masked = pass.mode.train && self.p > 0.0;
        if !self.masked {
            y[..b * d].copy_from_slice(&x[..b * d]);
            return;
        }
        grow(&mut self.mask, b * d);
        let (p, keep_scale, key) = (self.p, 1.0 / (1.0 - self.p), self.layer_key);
        let m = pass.mode;
        let per = SAMPLES_PER_TASK;
        team::zip_chunks_mut([&mut y[..b * d], &mut self.mask[..b * d]], per * d, &|t, [y, mask]| {
            let rows = y.chunks_exact_mut(d).zip(mask.chunks_exact_mut(d));
            let inputs = x[t * per * d..].chunks_exact(d).zip(&pass.sample_ids[t * per..]);
            for ((y, mask), (x, &id)) in rows.zip(inputs) {
                let mut rng = Rng::from_keys(&[m.seed, m.epoch, id as u64, key]);
                for ((y, mask), &x) in y.iter_mut().zip(mask.iter_mut()).zip(x) {
                    *mask = if rng.next_f32() < p { 0.0 } else { keep_scale };
                    *y = x * *mask;
                }
            }
        });
    }
    /// `∂x = ∂y ⊙ m / (1 − p)` (the identity after an evaluation pass).
    fn backward(&mut self, _p: ArrayView1<f32>, io: Io, dy: ArrayView2<f32>, Grads { dx, .. }: Grads) {
        let b = batch_back("dropout", &io, &dy, &dx);
        let Some(dx) = dx else { return };
        let (dx, dy) = (rows_mut(dx), rows(dy));
        let n = b * self.features();
        if !self.masked {
            dx[..n].copy_from_slice(&dy[..n]);
            return;
        }
        let (mask, c) = (&self.mask[..n], SAMPLES_PER_TASK * self.features());
        team::zip_chunks_mut([&mut dx[..n]], c, &|t, [dx]| {
            dx.iter_mut().zip(&dy[t * c..]).zip(&mask[t * c..]).for_each(|((dx, &dy), &m)| *dx = dy * m);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::layers::Mode;
    use crate::nn::layers::OnSlices;

    fn run(d: &mut Dropout, ids: &[usize], train: bool) -> Vec<f32> {
        let x = vec![1.0; ids.len() * 1000];
        let mut y = vec![0.0; x.len()];
        let mode = Mode { train, seed: 3, epoch: 1 };
        d.fwd(&[], &x, &mut y, ids.len(), &Pass { mode, sample_ids: ids });
        y
    }

    #[test]
    fn mask_follows_the_sample_not_the_row() {
        let mut d = Dropout::new(0.3, vec![1000], 2);
        let a = run(&mut d, &[10, 11, 12], true);
        let b = run(&mut d, &[12, 10], true);
        assert_eq!(a[2000..3000], b[..1000]);
        assert_eq!(a[..1000], b[1000..]);
        assert_ne!(a[..1000], a[1000..2000]);
        let kept = a.iter().filter(|&&v| v > 0.0).count() as f32 / a.len() as f32;
        assert!((kept - 0.7).abs() < 0.03, "kept {kept}");
        assert!(a.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.7).abs() < 1e-6));
    }

    #[test]
    fn identity_in_evaluation() {
        let mut d = Dropout::new(0.5, vec![1000], 0);
        assert!(run(&mut d, &[1, 2], false).iter().all(|&v| v == 1.0));
    }
}

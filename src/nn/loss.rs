//! Losses fused with their output non-linearity, numerically stable, returning per-batch *sums*.
//!
//! A rank's contribution to the global gradient is `Σ_{its samples} ∂ℓ/∂θ / B`, so the loss writes
//! `∂ℓ_j/∂z_j · scale` with `scale = 1/B` (the global batch), never `1/b_i` (its own slice).

use crate::nn::layers::{rows, rows_mut};
use ndarray::{ArrayView2, ArrayViewMut2};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Loss {
    /// Softmax over `C` logits + cross-entropy with the integer label.
    SoftmaxCrossEntropy,
    /// One logit `z`, `p = σ(z)`, binary cross-entropy with label 0/1.
    Logistic,
}

/// Sums over a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossStats {
    pub loss_sum: f64,
    pub correct: usize,
}

impl Loss {
    /// Number of logits the model must output for `classes` classes.
    pub fn outputs(&self, classes: usize) -> usize {
        match self {
            Loss::SoftmaxCrossEntropy => classes,
            Loss::Logistic => 1,
        }
    }

    /// Loss sum and correct count over the `b` rows of `logits` (`b × width`) against their
    /// `labels`; when `dlogits` (`b × width`) is given, writes `scale · ∂ℓ_j/∂z_j` into it.
    pub fn evaluate(
        &self,
        logits: ArrayView2<f32>,
        labels: &[u32],
        scale: f32,
        dlogits: Option<ArrayViewMut2<f32>>,
    ) -> LossStats {
        let (b, width) = logits.dim();
        assert_eq!(labels.len(), b, "loss: one label per row of logits");
        assert!(dlogits.as_ref().is_none_or(|d| d.dim() == (b, width)), "loss: dlogits are not b×width");
        let mut st = LossStats::default();
        let (logits, mut grad) = (rows(logits), dlogits.map(rows_mut));
        for (j, (z, &y)) in logits.chunks_exact(width).zip(labels).enumerate() {
            let y = y as usize;
            match self {
                Loss::SoftmaxCrossEntropy => {
                    let (mut arg, mut max) = (0, f32::NEG_INFINITY);
                    for (c, &v) in z.iter().enumerate() {
                        if v > max {
                            max = v;
                            arg = c;
                        }
                    }
                    let sum: f32 = z.iter().map(|&v| (v - max).exp()).sum();
                    let log_sum = sum.ln();
                    st.loss_sum += (log_sum - (z[y] - max)) as f64;
                    st.correct += (arg == y) as usize;
                    if let Some(g) = grad.as_deref_mut() {
                        let inv = scale / sum;
                        let gz = &mut g[j * width..(j + 1) * width];
                        for (gv, &v) in gz.iter_mut().zip(z) {
                            *gv = (v - max).exp() * inv;
                        }
                        gz[y] -= scale;
                    }
                }
                Loss::Logistic => {
                    let z = z[0];
                    let t = y as f32;
                    // softplus(z) − t·z, written to avoid overflow for large |z|
                    st.loss_sum += (z.max(0.0) - z * t + (-z.abs()).exp().ln_1p()) as f64;
                    st.correct += ((z > 0.0) == (y == 1)) as usize;
                    if let Some(g) = grad.as_deref_mut() {
                        let p = if z >= 0.0 { 1.0 / (1.0 + (-z).exp()) } else { z.exp() / (1.0 + z.exp()) };
                        g[j] = (p - t) * scale;
                    }
                }
            }
        }
        st
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(loss: Loss, logits: &[f32], labels: &[u32], width: usize, g: Option<&mut [f32]>) -> LossStats {
        eval_scaled(loss, logits, labels, width, 1.0, g)
    }

    fn eval_scaled(
        loss: Loss,
        z: &[f32],
        labels: &[u32],
        width: usize,
        scale: f32,
        g: Option<&mut [f32]>,
    ) -> LossStats {
        let z = ArrayView2::from_shape((labels.len(), width), z).unwrap();
        let g = g.map(|g| ArrayViewMut2::from_shape((labels.len(), width), g).unwrap());
        loss.evaluate(z, labels, scale, g)
    }

    fn check_grad(loss: Loss, logits: &[f32], labels: &[u32], width: usize) {
        let mut g = vec![0.0; logits.len()];
        eval(loss, logits, labels, width, Some(&mut g));
        let eps = 1e-2f32;
        for i in 0..logits.len() {
            let mut zp = logits.to_vec();
            zp[i] += eps;
            let mut zm = logits.to_vec();
            zm[i] -= eps;
            let fd = (eval(loss, &zp, labels, width, None).loss_sum - eval(loss, &zm, labels, width, None).loss_sum)
                / (2.0 * eps as f64);
            assert!((fd - g[i] as f64).abs() < 1e-3, "{loss:?} dz[{i}]: fd {fd} vs {}", g[i]);
        }
    }

    #[test]
    fn softmax_cross_entropy_gradient_matches_finite_differences() {
        check_grad(Loss::SoftmaxCrossEntropy, &[0.3, -1.2, 2.0, 0.0, 0.5, 0.5], &[2, 0], 3);
    }

    #[test]
    fn logistic_gradient_matches_finite_differences() {
        check_grad(Loss::Logistic, &[0.3, -1.7, 4.0], &[1, 0, 0], 1);
    }

    #[test]
    fn extreme_logits_stay_finite() {
        let st = eval(Loss::SoftmaxCrossEntropy, &[1000.0, -1000.0], &[1], 2, None);
        assert!((st.loss_sum - 2000.0).abs() < 1e-3);
        let st = eval(Loss::Logistic, &[-500.0, 500.0], &[1, 0], 1, None);
        assert!((st.loss_sum - 1000.0).abs() < 1e-3, "{}", st.loss_sum);
        let mut g = vec![0.0; 2];
        eval_scaled(Loss::Logistic, &[-500.0, 500.0], &[1, 0], 1, 0.5, Some(&mut g));
        assert_eq!(g, vec![-0.5, 0.5]);
    }

    #[test]
    fn scale_is_applied_to_gradients_not_to_the_loss_sum() {
        let mut g1 = vec![0.0; 3];
        let mut g2 = vec![0.0; 3];
        let a = eval(Loss::SoftmaxCrossEntropy, &[0.1, 0.2, 0.3], &[1], 3, Some(&mut g1));
        let b = eval_scaled(Loss::SoftmaxCrossEntropy, &[0.1, 0.2, 0.3], &[1], 3, 0.25, Some(&mut g2));
        assert_eq!(a.loss_sum, b.loss_sum);
        for (x, y) in g1.iter().zip(&g2) {
            assert!((x * 0.25 - y).abs() < 1e-7);
        }
    }
}

//! Gradient-norm clipping (`optimizer.clip_grad_norm`), on a whole gradient or on the blocks the
//! ranks own after a reduce-scatter.

use crate::dist::comm::Communicator;

/// Scales `grads` in place so that their global L2 norm is at most `max_norm`; returns the norm
/// before clipping.
///
/// As `torch.nn.utils.clip_grad_norm_`: the factor is `max_norm / (norm + 1e-6)` when below 1. The
/// norm is summed sequentially in f64, so every rank, holding the same allreduced gradient, computes
/// the same factor.
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f32) -> f32 {
    let norm = squares(grads).sqrt() as f32;
    scale_to(grads, norm, max_norm)
}

/// [`clip_grad_norm`] of a gradient held in blocks, one per rank (after a reduce-scatter): each
/// rank sums its block's squares in f64, one allreduce adds them, and every rank scales its block by
/// the same factor. With one rank it is [`clip_grad_norm`], bit for bit.
pub fn clip_grad_norm_blocks(block: &mut [f32], max_norm: f32, comm: &dyn Communicator) -> f32 {
    let mut total = [0.0f64];
    comm.all_reduce_sum_f64_into(&[squares(block)], &mut total);
    scale_to(block, total[0].sqrt() as f32, max_norm)
}

fn squares(g: &[f32]) -> f64 {
    g.iter().map(|&g| g as f64 * g as f64).sum()
}

fn scale_to(grads: &mut [f32], norm: f32, max_norm: f32) -> f32 {
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        grads.iter_mut().for_each(|g| *g *= coef);
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32]) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 2e-6, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let mut g = vec![3.0f32, 4.0];
        assert_eq!(clip_grad_norm(&mut g, 1.0), 5.0);
        close(&g, &[0.6, 0.8]);
        let mut small = vec![0.3f32, 0.4];
        assert!((clip_grad_norm(&mut small, 1.0) - 0.5).abs() < 1e-7);
        assert_eq!(small, [0.3, 0.4], "a gradient within the norm is left alone");
    }

    #[test]
    fn clipping_blocks_on_one_rank_is_clipping() {
        let g: Vec<f32> = (0..100).map(|i| i as f32 * 0.3 - 7.0).collect();
        let (mut a, mut b) = (g.clone(), g);
        assert_eq!(clip_grad_norm(&mut a, 1.0), clip_grad_norm_blocks(&mut b, 1.0, &crate::dist::comm::Solo));
        assert_eq!(a, b);
    }
}

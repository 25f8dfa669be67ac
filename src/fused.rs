//! Momentum SGD applied inside the backward pass, for a single process.
//!
//! With one rank there is nothing to sum, so each layer's parameters can take their SGD step as soon
//! as their gradient is formed, instead of a separate pass over the flat buffers after the backward
//! pass (what PyTorch calls running the optimizer in backward). A fully
//! connected layer goes further: its weight gradient `dyᵀ·x` never reaches memory, the GEMM's
//! register tiles update momentum and weights where they would have stored the gradient. Per step
//! that removes the gradient's write and read and the separate pass's traffic over the weights and
//! momentum (W1: 2.1 MB of parameters, the update reads and writes them once instead of twice).
//!
//! The arithmetic is [`crate::optim::Sgd`]'s, operation for operation (`g ← g + wd·θ`,
//! `v ← μ·v + g`, `θ ← θ − lr·v`, or `θ ← θ − lr·(g + μ·v)` with Nesterov; no fused
//! multiply-adds), so the parameters come out bit-identical to a backward pass followed by
//! [`crate::optim::Optimizer::step`]. Clipping needs the whole gradient's norm and several ranks need
//! the summed gradient, so those keep the separate step, as do plain SGD and Adam
//! ([`SgdStep::for_run`] decides).

use crate::optim::Optimizer;
use crate::team;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m512, __mmask16, _mm512_add_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_mul_ps, _mm512_set1_ps,
    _mm512_sub_ps,
};

/// Parameters per team task of [`SgdStep::apply`].
const CHUNK: usize = 1 << 14;

/// One momentum-SGD step's constants: `g ← g + wd·θ; v ← μ·v + g; θ ← θ − lr·(nesterov ? g + μ·v : v)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdStep {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
}

impl SgdStep {
    /// The step to take in backward for `opt` at learning rate `lr` and `opt`'s velocity buffer, when
    /// it can be: one rank, SGD with momentum, no gradient clipping. The step is
    /// counted on `opt` here. `None`: the caller runs the separate step.
    pub fn for_run(opt: &mut Optimizer, world: usize, clip: Option<f32>, lr: f32) -> Option<(SgdStep, &mut [f32])> {
        match opt {
            Optimizer::Sgd(s) if world == 1 && clip.is_none() && s.momentum > 0.0 => {
                s.step += 1;
                let step = SgdStep { lr, momentum: s.momentum, weight_decay: s.weight_decay, nesterov: s.nesterov };
                Some((step, &mut s.velocity))
            }
            _ => None,
        }
    }

    /// Applies the step to parameters `p` with gradient `g` and velocity `v` (same lengths), in
    /// chunks over the [`team`] (element-wise: the same bits as one loop; the Nesterov choice is
    /// hoisted out of the loop so each one vectorises). [`crate::optim::Sgd`]'s step is this.
    pub fn apply(&self, p: &mut [f32], g: &[f32], v: &mut [f32]) {
        assert!(p.len() == g.len() && p.len() == v.len(), "sgd step: parameter, gradient and velocity lengths");
        let SgdStep { lr, momentum: mu, weight_decay: wd, nesterov } = *self;
        team::zip_chunks_mut([p, v], CHUNK, &|i, [ps, vs]| {
            let it = ps.iter_mut().zip(&g[i * CHUNK..]).zip(vs.iter_mut());
            if nesterov {
                for ((p, &g), v) in it {
                    let g = g + wd * *p;
                    *v = mu * *v + g;
                    *p -= lr * (g + mu * *v);
                }
            } else {
                for ((p, &g), v) in it {
                    let g = g + wd * *p;
                    *v = mu * *v + g;
                    *p -= lr * *v;
                }
            }
        });
    }

    /// [`SgdStep::apply`] on the lanes of `mask` at `p` and `v`, with gradient `g`: the same
    /// operations in the same order (no fused multiply-adds), so the same bits. A GEMM's register
    /// tile calls it where it would have stored the gradient.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; the masked lanes at `p` and `v` must be valid for writes.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) unsafe fn apply16(&self, p: *mut f32, v: *mut f32, mask: __mmask16, g: __m512) {
        let (lr, mu, wd) = (_mm512_set1_ps(self.lr), _mm512_set1_ps(self.momentum), _mm512_set1_ps(self.weight_decay));
        let theta = _mm512_maskz_loadu_ps(mask, p);
        let vel = _mm512_maskz_loadu_ps(mask, v);
        let g = _mm512_add_ps(g, _mm512_mul_ps(wd, theta));
        let vel = _mm512_add_ps(_mm512_mul_ps(mu, vel), g);
        let dir = if self.nesterov { _mm512_add_ps(g, _mm512_mul_ps(mu, vel)) } else { vel };
        let theta = _mm512_sub_ps(theta, _mm512_mul_ps(lr, dir));
        _mm512_mask_storeu_ps(v, mask, vel);
        _mm512_mask_storeu_ps(p, mask, theta);
    }
}

/// Where a finished tile of the product goes when it is a gradient (see [`crate::gemm::gemm_sgd`]): pointers to
/// the parameters and velocity at the block's first element, laid out like `C` (same row stride).
#[derive(Clone, Copy)]
pub(crate) struct Update {
    pub(crate) p: *mut f32,
    pub(crate) v: *mut f32,
    pub(crate) step: SgdStep,
}
// SAFETY: like the GEMM's pointer to C, handed to team tasks that touch disjoint blocks only.
unsafe impl Send for Update {}
unsafe impl Sync for Update {}

impl Update {
    /// The same update `off` elements further on.
    ///
    /// # Safety
    /// `off` must stay inside the parameter and velocity buffers.
    pub(crate) unsafe fn at(self, off: usize) -> Update {
        Update { p: self.p.add(off), v: self.v.add(off), ..self }
    }
}

/// Applies `upd` to a block of `m` rows of `n` whose gradient is in `c` (row stride `ldc`).
///
/// # Safety
/// The block must be inside `c` and inside the update's buffers, touched by no one else.
pub(crate) unsafe fn apply_rows(upd: Option<Update>, c: *const f32, ldc: usize, m: usize, n: usize) {
    let Some(u) = upd else { return };
    for r in 0..m {
        let u = u.at(r * ldc);
        let g = std::slice::from_raw_parts(c.add(r * ldc), n);
        u.step.apply(std::slice::from_raw_parts_mut(u.p, n), g, std::slice::from_raw_parts_mut(u.v, n));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::{gemm, gemm_sgd, Trans};
    use crate::rng::Rng;

    fn random(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.uniform(1.0)).collect()
    }

    /// The weight-gradient product with the step in its tiles gives the bits of the product
    /// followed by the step: one and several depth blocks (k > 256), edge tiles, weight decay.
    #[test]
    fn gemm_sgd_matches_gemm_then_step() {
        let mut rng = Rng::from_keys(&[11]);
        let shapes = [(1, 1, 1, 0.0), (13, 45, 7, 0.0), (40, 70, 128, 1e-3), (30, 50, 600, 0.0), (512, 784, 128, 0.0)];
        for (i, &(m, n, k, wd)) in shapes.iter().enumerate() {
            let nesterov = i % 2 == 1;
            let (a, b) = (random(&mut rng, k * m), random(&mut rng, k * n));
            let (p0, v0) = (random(&mut rng, m * n), random(&mut rng, m * n));
            let step = SgdStep { lr: 0.05, momentum: 0.9, weight_decay: wd, nesterov };
            let mut g = vec![0.0; m * n];
            gemm(Trans::T, Trans::N, m, n, k, 1.0, &a, &b, 0.0, &mut g);
            let (mut p1, mut v1) = (p0.clone(), v0.clone());
            step.apply(&mut p1, &g, &mut v1);
            let (mut p2, mut v2, mut scratch) = (p0.clone(), v0.clone(), vec![f32::NAN; m * n]);
            gemm_sgd(Trans::T, Trans::N, (m, n, k), &a, &b, &mut scratch, &mut p2, &mut v2, step);
            assert!(p1 == p2 && v1 == v2, "{m}×{n}×{k} (Nesterov {nesterov}): parameters or velocity differ");
        }
    }
}

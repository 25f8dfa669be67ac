//! Group normalisation (Wu & He, 2018) with per-sample statistics.
//!
//! The `C` channels of a sample are split into `G` groups of `C/G` consecutive channels; each group is
//! normalised by its own mean and variance over its `C/G · H·W` values, then each channel gets an
//! affine map:
//!
//! ```text
//!     x̂ = (x − μ_{n,g}) / √(σ²_{n,g} + ε),    y = γ_c · x̂ + β_c        (ε = 1e-5, as PyTorch)
//! ```
//!
//! The statistics come from one sample only, so a rank's outputs never depend on how the global
//! batch was split across ranks or rows. This is why the shipped recipes use GroupNorm and not
//! BatchNorm, whose statistics over a rank's slice would change with the balancer's batch sizes (and
//! whose exact global-batch statistics would cost an extra allreduce per layer and iteration).
//! With `G = 1` this is LayerNorm over `C×H×W` with per-channel affine, with `G = C` InstanceNorm.

use crate::data::rng::Rng;
use crate::kernels::grow;
use crate::kernels::team;
use crate::kernels::team::Pieces;
use crate::nn::layers::{
    batch_back, batch_of, flat, flat_mut, rows, rows_mut, Grads, Io, Layer, Pass, SAMPLES_PER_TASK,
};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2};

pub const EPS: f32 = 1e-5;

/// `B×C×H×W → B×C×H×W` (any per-sample shape `[C, ...]`). Parameters: `weight [C]` (γ, init 1),
/// `bias [C]` (β, init 0).
#[derive(Debug, Clone)]
pub struct GroupNorm {
    pub groups: usize,
    /// Per-sample shape `[C, ...]`.
    pub shape: Vec<usize>,
    /// `b × G` means and reciprocal standard deviations of the last forward pass.
    mean: Vec<f32>,
    rstd: Vec<f32>,
    /// `b × 2C`: each sample's contribution to `∂γ` and `∂β`, summed in sample order afterwards.
    partials: Vec<f32>,
}

impl GroupNorm {
    /// Panics unless `groups` divides the channel count (the model builder checks first).
    pub fn new(groups: usize, shape: Vec<usize>) -> GroupNorm {
        assert!(
            groups >= 1 && !shape.is_empty() && shape[0].is_multiple_of(groups),
            "group-norm: {groups} groups do not divide shape {shape:?}"
        );
        GroupNorm { groups, shape, mean: Vec::new(), rstd: Vec::new(), partials: Vec::new() }
    }
    fn channels(&self) -> usize {
        self.shape[0]
    }
    /// Values per channel (`H·W`).
    fn area(&self) -> usize {
        self.shape[1..].iter().product()
    }
}

impl Layer for GroupNorm {
    fn kind(&self) -> &'static str {
        "group-norm"
    }
    fn out_shape(&self) -> Vec<usize> {
        self.shape.clone()
    }
    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        vec![("weight".into(), vec![self.channels()]), ("bias".into(), vec![self.channels()])]
    }
    fn init(&self, p: ArrayViewMut1<f32>, _rng: &mut Rng) {
        let (gamma, beta) = flat_mut(p).split_at_mut(self.channels());
        gamma.fill(1.0);
        beta.fill(0.0);
    }
    /// `x: B×C×H×W → y: B×C×H×W`.
    fn forward(&mut self, p: ArrayView1<f32>, x: ArrayView2<f32>, y: ArrayViewMut2<f32>, _pass: &Pass) {
        let (c, area, groups) = (self.channels(), self.area(), self.groups);
        let d = c * area;
        let glen = d / groups;
        let b = batch_of("group-norm", &x, &y, d, d);
        assert_eq!(p.len(), 2 * c, "group-norm: parameter slice");
        let (p, x, y) = (flat(p), rows(x), rows_mut(y));
        let (gamma, beta) = p.split_at(c);
        grow(&mut self.mean, b * groups);
        grow(&mut self.rstd, b * groups);
        let per = SAMPLES_PER_TASK;
        let ys = Pieces::new(&mut y[..b * d], per * d);
        let means = Pieces::new(&mut self.mean[..b * groups], per * groups);
        let rstds = Pieces::new(&mut self.rstd[..b * groups], per * groups);
        team::run(b.div_ceil(per), &|t| {
            // SAFETY: `run` runs task `t` once, and only task `t` takes pieces `t`.
            let (y, means, rstds) = unsafe { (ys.take(t), means.take(t), rstds.take(t)) };
            let samples = y.chunks_exact_mut(d).zip(x[t * per * d..].chunks_exact(d));
            for ((y, x), (mean, rstd)) in
                samples.zip(means.chunks_exact_mut(groups).zip(rstds.chunks_exact_mut(groups)))
            {
                for (g, (yg, xg)) in y.chunks_exact_mut(glen).zip(x.chunks_exact(glen)).enumerate() {
                    let mu = xg.iter().sum::<f32>() / glen as f32;
                    let var = xg.iter().map(|&v| (v - mu) * (v - mu)).sum::<f32>() / glen as f32;
                    let r = 1.0 / (var + EPS).sqrt();
                    (mean[g], rstd[g]) = (mu, r);
                    let ch0 = g * (c / groups);
                    for (k, (yc, xc)) in yg.chunks_exact_mut(area).zip(xg.chunks_exact(area)).enumerate() {
                        let (scale, shift) = (gamma[ch0 + k] * r, beta[ch0 + k] - gamma[ch0 + k] * r * mu);
                        yc.iter_mut().zip(xc).for_each(|(y, &x)| *y = x * scale + shift);
                    }
                }
            }
        });
    }
    /// With `∂x̂ = γ·∂y` and means over the group:
    /// `∂x = rstd · (∂x̂ − mean(∂x̂) − x̂ · mean(∂x̂ ⊙ x̂))`, `∂γ_c = Σ ∂y ⊙ x̂`, `∂β_c = Σ ∂y`.
    fn backward(&mut self, p: ArrayView1<f32>, io: Io, dy: ArrayView2<f32>, Grads { g, dx }: Grads) {
        let b = batch_back("group-norm", &io, &dy, &dx);
        let (p, g, x_all, dy, dx) = (flat(p), flat_mut(g), rows(io.x), rows(dy), dx.map(rows_mut));
        let (c, area, groups) = (self.channels(), self.area(), self.groups);
        let (d, cpg) = (c * area, c / groups);
        assert_eq!(g.len(), 2 * c, "group-norm: gradient slice");
        assert!(self.mean.len() >= b * groups, "group-norm: backward before forward");
        let gamma = &p[..c];
        grow(&mut self.partials, b * 2 * c);
        let (mean, rstd) = (&self.mean[..b * groups], &self.rstd[..b * groups]);
        // Per sample: ∂γ, ∂β contributions, and ∂x when asked.
        let per_sample = |n: usize, part: &mut [f32], dx: Option<&mut [f32]>| {
            let (x, dy) = (&x_all[n * d..(n + 1) * d], &dy[n * d..(n + 1) * d]);
            let (dgamma, dbeta) = part.split_at_mut(c);
            for ch in 0..c {
                let (mu, r) = (mean[n * groups + ch / cpg], rstd[n * groups + ch / cpg]);
                let (xc, dyc) = (&x[ch * area..(ch + 1) * area], &dy[ch * area..(ch + 1) * area]);
                dgamma[ch] = xc.iter().zip(dyc).map(|(&x, &d)| d * (x - mu) * r).sum();
                dbeta[ch] = dyc.iter().sum();
            }
            let Some(dx) = dx else { return };
            let glen = (cpg * area) as f32;
            for grp in 0..groups {
                let (mu, r) = (mean[n * groups + grp], rstd[n * groups + grp]);
                let chans = grp * cpg..(grp + 1) * cpg;
                // mean(∂x̂) and mean(∂x̂ ⊙ x̂) from the per-channel sums above.
                let m1 = chans.clone().map(|ch| gamma[ch] * dbeta[ch]).sum::<f32>() / glen;
                let m2 = chans.clone().map(|ch| gamma[ch] * dgamma[ch]).sum::<f32>() / glen;
                for ch in chans {
                    let span = ch * area..(ch + 1) * area;
                    for ((dx, &x), &d) in dx[span.clone()].iter_mut().zip(&x[span.clone()]).zip(&dy[span]) {
                        *dx = r * (gamma[ch] * d - m1 - (x - mu) * r * m2);
                    }
                }
            }
        };
        let per = SAMPLES_PER_TASK;
        let parts = Pieces::new(&mut self.partials[..b * 2 * c], per * 2 * c);
        let dxs = dx.map(|dx| Pieces::new(&mut dx[..b * d], per * d));
        team::run(b.div_ceil(per), &|t| {
            // SAFETY: `run` runs task `t` once, and only task `t` takes pieces `t`.
            let (parts, dx) = unsafe { (parts.take(t), dxs.as_ref().map(|dx| dx.take(t))) };
            let first = t * per;
            match dx {
                Some(dx) => parts
                    .chunks_exact_mut(2 * c)
                    .zip(dx.chunks_exact_mut(d))
                    .enumerate()
                    .for_each(|(n, (part, dx))| per_sample(first + n, part, Some(dx))),
                None => {
                    parts.chunks_exact_mut(2 * c).enumerate().for_each(|(n, part)| per_sample(first + n, part, None))
                }
            }
        });
        let parts = &self.partials[..b * 2 * c];
        g.fill(0.0);
        for part in parts.chunks_exact(2 * c) {
            g.iter_mut().zip(part).for_each(|(s, v)| *s += v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::layers::Mode;
    use crate::nn::layers::OnSlices;

    #[test]
    fn groups_are_standardised_per_sample() {
        let mut gn = GroupNorm::new(2, vec![4, 3]);
        let mut p = vec![0.0; 8];
        gn.init(ndarray::ArrayViewMut1::from(&mut p[..]), &mut Rng::from_keys(&[0]));
        let x: Vec<f32> = (0..24).map(|v| (v * v % 7) as f32).collect();
        let mut y = vec![0.0; 24];
        let pass = Pass { mode: Mode { train: true, seed: 0, epoch: 0 }, sample_ids: &[0, 1] };
        gn.fwd(&p, &x, &mut y, 2, &pass);
        for grp in y.chunks_exact(6) {
            let mu = grp.iter().sum::<f32>() / 6.0;
            let var = grp.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / 6.0;
            assert!(mu.abs() < 1e-5 && (var - 1.0).abs() < 1e-3, "mean {mu} var {var}");
        }
        // The second sample alone gives the same output: no cross-sample statistics.
        let mut y1 = vec![0.0; 12];
        gn.fwd(&p, &x[12..], &mut y1, 1, &Pass { sample_ids: &[1], ..pass });
        assert_eq!(y1, y[12..]);
    }
}

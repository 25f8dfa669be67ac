//! Spatial pooling over `B×C×H×W` rows: max and average windows, and global average.
//!
//! Windows have no padding; `H' = (H − kernel)/stride + 1` (likewise `W'`), so trailing rows and
//! columns that no full window covers are dropped, as in PyTorch. Every layer works per sample, on
//! the `team` in tasks of [`SAMPLES_PER_TASK`] samples.

use crate::kernels::grow;
use crate::kernels::team;
use crate::kernels::team::Pieces;
use crate::nn::conv::out_len;
use crate::nn::layers::{batch_back, batch_of, rows, rows_mut, Grads, Io, Layer, Pass, SAMPLES_PER_TASK};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut2};
use std::hint::select_unpredictable;

/// Shape of a square pooling window sweep over `[C, H, W]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub input: [usize; 3],
    pub kernel: usize,
    pub stride: usize,
    out_hw: [usize; 2],
}

impl Window {
    /// Panics if the window does not fit the input (the model builder checks first).
    pub fn new(input: [usize; 3], kernel: usize, stride: usize) -> Window {
        match (out_len(input[1], kernel, stride, 0), out_len(input[2], kernel, stride, 0)) {
            (Some(oh), Some(ow)) => Window { input, kernel, stride, out_hw: [oh, ow] },
            _ => panic!("pool: kernel {kernel} stride {stride} does not fit input {input:?}"),
        }
    }
    fn in_len(&self) -> usize {
        self.input.iter().product()
    }
    fn out_len(&self) -> usize {
        self.input[0] * self.out_hw[0] * self.out_hw[1]
    }
    fn out_shape(&self) -> Vec<usize> {
        vec![self.input[0], self.out_hw[0], self.out_hw[1]]
    }
    /// Calls `f(output index, input offset of its window's top-left corner)` for every output of
    /// one sample.
    fn for_each(&self, mut f: impl FnMut(usize, usize)) {
        let [c_in, h, w] = self.input;
        let [oh, ow] = self.out_hw;
        let s = self.stride;
        for c in 0..c_in {
            for oy in 0..oh {
                for ox in 0..ow {
                    f((c * oh + oy) * ow + ox, c * h * w + oy * s * w + ox * s);
                }
            }
        }
    }
    /// Max over every window of one sample (`x: C×H×W → y: C×H'×W'`) and the input offset of its
    /// first maximum in row-major window order, branch-free, so the compares of random data cost no
    /// mispredictions.
    fn max(&self, x: &[f32], y: &mut [f32], arg: &mut [u32]) {
        let [c_in, h, w] = self.input;
        let [oh, ow] = self.out_hw;
        let (k, s) = (self.kernel, self.stride);
        let rows = y.chunks_exact_mut(ow).zip(arg.chunks_exact_mut(ow));
        for (r, (y, arg)) in rows.enumerate().take(c_in * oh) {
            let base = (r / oh) * h * w + (r % oh) * s * w;
            for (ox, (y, a)) in y.iter_mut().zip(arg.iter_mut()).enumerate() {
                let corner = base + ox * s;
                let (mut best, mut at) = (x[corner], corner);
                for ki in 0..k {
                    let row = corner + ki * w;
                    for (i, &v) in x[row..row + k].iter().enumerate() {
                        let better = v > best;
                        best = select_unpredictable(better, v, best);
                        at = select_unpredictable(better, row + i, at);
                    }
                }
                (*y, *a) = (best, at as u32);
            }
        }
    }
    /// Offsets of the `k` rows (each `k` wide) of the window whose top-left corner is `base`.
    fn rows(&self, base: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
        let (k, w) = (self.kernel, self.input[2]);
        (0..k).map(move |i| base + i * w..base + i * w + k)
    }
}

/// What a window pools to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    /// The window's maximum; the gradient goes to its (first) winning input.
    Max,
    /// The window's mean.
    Mean,
}

/// Pooling over each `k×k` window: `B×C×H×W → B×C×H'×W'`. Max pooling caches the winning input
/// index of every output (the first one on ties) and routes the gradient there.
#[derive(Debug, Clone)]
pub struct Pool2d {
    pub window: Window,
    pub reduce: Reduce,
    /// `b × C·H'·W'` input offsets (within the sample) of the maxima of the last forward pass.
    argmax: Vec<u32>,
}

impl Pool2d {
    pub fn new(reduce: Reduce, input: [usize; 3], kernel: usize, stride: usize) -> Pool2d {
        Pool2d { window: Window::new(input, kernel, stride), reduce, argmax: Vec::new() }
    }

    /// `y = max over the window`, each output's winner kept.
    fn max(&mut self, x: &[f32], y: &mut [f32], b: usize) {
        let win = self.window;
        let (il, ol, per) = (win.in_len(), win.out_len(), SAMPLES_PER_TASK);
        grow(&mut self.argmax, b * ol);
        let (ys, args) = (Pieces::new(&mut y[..b * ol], per * ol), Pieces::new(&mut self.argmax[..b * ol], per * ol));
        team::run(b.div_ceil(per), &|t| {
            // SAFETY: `run` runs task `t` once, and only task `t` takes pieces `t`.
            let (y, arg) = unsafe { (ys.take(t), args.take(t)) };
            let x = &x[t * per * il..][..y.len() / ol * il];
            let rows = y.chunks_exact_mut(ol).zip(arg.chunks_exact_mut(ol));
            rows.zip(x.chunks_exact(il)).for_each(|((y, arg), x)| win.max(x, y, arg));
        });
    }

    /// `∂x[argmax] += ∂y`, zero elsewhere.
    fn max_back(&self, dy: &[f32], dx: &mut [f32], b: usize) {
        let (il, ol, per) = (self.window.in_len(), self.window.out_len(), SAMPLES_PER_TASK);
        assert!(self.argmax.len() >= b * ol, "max-pool2d: backward before forward");
        let argmax = &self.argmax[..b * ol];
        team::zip_chunks_mut([&mut dx[..b * il]], per * il, &|t, [dx]| {
            let (dy, arg) = (&dy[t * per * ol..], &argmax[t * per * ol..]);
            for ((dx, dy), arg) in dx.chunks_exact_mut(il).zip(dy.chunks_exact(ol)).zip(arg.chunks_exact(ol)) {
                dx.fill(0.0);
                for (&d, &a) in dy.iter().zip(arg) {
                    dx[a as usize] += d;
                }
            }
        });
    }

    /// `y = (1/k²) Σ window`.
    fn mean(&self, x: &[f32], y: &mut [f32], b: usize) {
        let win = self.window;
        let (il, ol, per) = (win.in_len(), win.out_len(), SAMPLES_PER_TASK);
        let scale = 1.0 / (win.kernel * win.kernel) as f32;
        team::zip_chunks_mut([&mut y[..b * ol]], per * ol, &|t, [y]| {
            for (y, x) in y.chunks_exact_mut(ol).zip(x[t * per * il..].chunks_exact(il)) {
                win.for_each(|o, base| y[o] = win.rows(base).map(|r| x[r].iter().sum::<f32>()).sum::<f32>() * scale);
            }
        });
    }

    /// `∂x[i] = Σ_{windows ∋ i} ∂y / k²`.
    fn mean_back(&self, dy: &[f32], dx: &mut [f32], b: usize) {
        let win = self.window;
        let (il, ol, per) = (win.in_len(), win.out_len(), SAMPLES_PER_TASK);
        let scale = 1.0 / (win.kernel * win.kernel) as f32;
        team::zip_chunks_mut([&mut dx[..b * il]], per * il, &|t, [dx]| {
            for (dx, dy) in dx.chunks_exact_mut(il).zip(dy[t * per * ol..].chunks_exact(ol)) {
                dx.fill(0.0);
                win.for_each(|o, base| {
                    let d = dy[o] * scale;
                    win.rows(base).for_each(|r| dx[r].iter_mut().for_each(|v| *v += d));
                });
            }
        });
    }
}

impl Layer for Pool2d {
    fn kind(&self) -> &'static str {
        match self.reduce {
            Reduce::Max => "max-pool2d",
            Reduce::Mean => "avg-pool2d",
        }
    }
    fn out_shape(&self) -> Vec<usize> {
        self.window.out_shape()
    }
    /// `x: B×C×H×W → y: B×C×H'×W'`.
    fn forward(&mut self, _p: ArrayView1<f32>, x: ArrayView2<f32>, y: ArrayViewMut2<f32>, _pass: &Pass) {
        let b = batch_of(self.kind(), &x, &y, self.window.in_len(), self.window.out_len());
        match self.reduce {
            Reduce::Max => self.max(rows(x), rows_mut(y), b),
            Reduce::Mean => self.mean(rows(x), rows_mut(y), b),
        }
    }
    fn backward(&mut self, _p: ArrayView1<f32>, io: Io, dy: ArrayView2<f32>, Grads { dx, .. }: Grads) {
        let b = batch_back(self.kind(), &io, &dy, &dx);
        let Some(dx) = dx else { return };
        match self.reduce {
            Reduce::Max => self.max_back(rows(dy), rows_mut(dx), b),
            Reduce::Mean => self.mean_back(rows(dy), rows_mut(dx), b),
        }
    }
}

/// Mean over all positions of each channel: `B×C×H×W → B×C`.
#[derive(Debug, Clone)]
pub struct GlobalAvgPool {
    /// Input sample shape `[C, H, W]` (or `[C, ...]`: everything after the channel is averaged).
    pub input: Vec<usize>,
}

impl GlobalAvgPool {
    fn channels_and_area(&self) -> (usize, usize) {
        (self.input[0], self.input[1..].iter().product())
    }
}

impl Layer for GlobalAvgPool {
    fn kind(&self) -> &'static str {
        "global-avg-pool"
    }
    fn out_shape(&self) -> Vec<usize> {
        vec![self.input[0]]
    }
    /// `x: B×C×H×W → y: B×C`, `y = mean over H×W`.
    fn forward(&mut self, _p: ArrayView1<f32>, x: ArrayView2<f32>, y: ArrayViewMut2<f32>, _pass: &Pass) {
        let (c, area) = self.channels_and_area();
        let b = batch_of("global-avg-pool", &x, &y, c * area, c);
        let (x, y) = (rows(x), rows_mut(y));
        let scale = 1.0 / area as f32;
        for (y, plane) in y[..b * c].iter_mut().zip(x[..b * c * area].chunks_exact(area)) {
            *y = plane.iter().sum::<f32>() * scale;
        }
    }
    /// `∂x = ∂y / (H·W)` broadcast over each channel's positions.
    fn backward(&mut self, _p: ArrayView1<f32>, io: Io, dy: ArrayView2<f32>, Grads { dx, .. }: Grads) {
        let b = batch_back("global-avg-pool", &io, &dy, &dx);
        let Some(dx) = dx else { return };
        let (c, area) = self.channels_and_area();
        let scale = 1.0 / area as f32;
        for (&d, plane) in rows(dy)[..b * c].iter().zip(rows_mut(dx)[..b * c * area].chunks_exact_mut(area)) {
            plane.fill(d * scale);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::layers::Mode;
    use crate::nn::layers::OnSlices;

    fn pass() -> Pass<'static> {
        Pass { mode: Mode { train: false, seed: 0, epoch: 0 }, sample_ids: &[0] }
    }

    #[test]
    fn max_and_average_of_a_known_image() {
        // One channel, 4×5; 2×2 windows, stride 2 → 2×2 output (last column dropped).
        let x: Vec<f32> = (0..20).map(|v| v as f32).collect();
        let mut mp = Pool2d::new(Reduce::Max, [1, 4, 5], 2, 2);
        let mut y = vec![0.0; 4];
        mp.fwd(&[], &x, &mut y, 1, &pass());
        assert_eq!(y, [6.0, 8.0, 16.0, 18.0]);
        let mut ap = Pool2d::new(Reduce::Mean, [1, 4, 5], 2, 2);
        ap.fwd(&[], &x, &mut y, 1, &pass());
        assert_eq!(y, [3.0, 5.0, 13.0, 15.0]);
        let mut dx = vec![9.0; 20];
        mp.bwd(&[], &mut [], &x, &y, &[1.0, 2.0, 3.0, 4.0], Some(&mut dx), 1);
        assert_eq!(dx.iter().sum::<f32>(), 10.0);
        assert_eq!((dx[6], dx[8], dx[16], dx[18]), (1.0, 2.0, 3.0, 4.0));
        let mut gp = GlobalAvgPool { input: vec![2, 2, 5] };
        let mut y = vec![0.0; 2];
        gp.fwd(&[], &x, &mut y, 1, &pass());
        assert_eq!(y, [4.5, 14.5]);
    }

    /// Max pooling of random data (with ties) against a direct search, for overlapping, exact and
    /// gapped windows over batches spanning several tasks; the gradient goes to the first
    /// maximum in row-major window order.
    #[test]
    fn max_pool_matches_a_direct_search() {
        let mut rng = crate::data::rng::Rng::from_keys(&[4]);
        for (input, k, s) in [([2, 7, 6], 3, 2), ([3, 8, 8], 2, 2), ([1, 9, 7], 2, 3)] {
            let mut mp = Pool2d::new(Reduce::Max, input, k, s);
            let (il, ol, b) = (mp.window.in_len(), mp.window.out_len(), 11);
            // Values on a coarse grid, so windows often hold equal maxima.
            let x: Vec<f32> = (0..b * il).map(|_| (rng.uniform(4.0)).round()).collect();
            let mut y = vec![f32::NAN; b * ol];
            let ids: Vec<usize> = (0..b).collect();
            mp.fwd(&[], &x, &mut y, b, &Pass { mode: Mode { train: false, seed: 0, epoch: 0 }, sample_ids: &ids });
            let dy: Vec<f32> = (0..b * ol).map(|i| i as f32 + 1.0).collect();
            let mut dx = vec![f32::NAN; b * il];
            mp.bwd(&[], &mut [], &x, &y, &dy, Some(&mut dx), b);
            let mut want_dx = vec![0.0; b * il];
            for n in 0..b {
                mp.window.for_each(|o, base| {
                    let at =
                        mp.window
                            .rows(base)
                            .flatten()
                            .fold(base, |at, i| if x[n * il + i] > x[n * il + at] { i } else { at });
                    assert_eq!(y[n * ol + o], x[n * il + at], "{input:?} k{k} s{s}: sample {n} output {o}");
                    want_dx[n * il + at] += dy[n * ol + o];
                });
            }
            assert_eq!(dx, want_dx, "{input:?} k{k} s{s}: gradient");
        }
    }
}

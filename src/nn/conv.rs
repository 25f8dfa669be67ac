//! 2-D convolution, on the `team` in tasks of [`SAMPLES_PER_TASK`] samples.
//!
//! Stride-1 convolutions (every one of LeNet-5's, the 3×3 ones of the residual recipes) run
//! directly on the padded planes, without unrolling them: see `crate::kernels::correlate`, whose register
//! tiles keep a few output planes in AVX-512 registers per tap. That beats unrolling when channels
//! are few (LeNet's first layer has `C·k·k = 25` and `O = 6`, where an im2col matrix is 25 times
//! the input and a GEMM spends its time packing it).
//!
//! Strided convolutions use im2col + GEMM. A task unrolls its `S` samples (`C×H×W` each) into one column matrix `col` (`Ckk × S·H'W'`,
//! `Ckk = C·k·k`) whose column `n·H'W' + p` holds the receptive field of output pixel `p` of sample
//! `n` (zeros where it overhangs the padding). Then, with `∂Y` gathered into the same
//! channel-major layout (`O × S·H'W'`),
//!
//! ```text
//!     forward   Y   (O × S·H'W')   = W (O × Ckk) · col (Ckk × S·H'W') + bias
//!     backward  ∂W  (O × Ckk)      = Σ_tasks ∂Y · colᵀ
//!               ∂bias (O)          = Σ_tasks Σ_columns ∂Y
//!               ∂col (Ckk × S·H'W') = Wᵀ · ∂Y,   ∂x = col2im(∂col)
//! ```
//!
//! so every GEMM of a task spans all its samples' pixels (`S·H'W'` columns or a reduction that
//! long) rather than one sample's. Rows of `Y` are copied out to each sample's channel-first
//! output with the bias added. Each task owns its scratch (columns, `Y`/`∂Y`, `∂col`, its `∂W`
//! partial) in buffers the layer keeps, so a steady-state step allocates nothing. The backward pass
//! recomputes the columns rather than keeping `b` of them from the forward pass (hundreds of MB at
//! batch 256 for a 16-channel 28×28 layer, and a recomputed matrix is still in cache when the GEMMs
//! read it). `∂W` is summed per task, then the task partials are added in order, so the result
//! depends on the batch only, never on the number of threads.

use crate::data::rng::Rng;
use crate::kernels::correlate::{Direct, Scratch};
use crate::kernels::gemm::{gemm, Trans};
use crate::kernels::grow;
use crate::kernels::team::{self, Pieces};
use crate::nn::layers::{
    batch_back, batch_of, flat, flat_mut, rows, rows_mut, Grads, Io, Layer, Pass, SAMPLES_PER_TASK,
};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2};

/// Output side length of a convolution or pooling window sweep, `None` if the window does not fit.
pub fn out_len(input: usize, kernel: usize, stride: usize, padding: usize) -> Option<usize> {
    let padded = input + 2 * padding;
    (kernel >= 1 && stride >= 1 && kernel <= padded).then(|| (padded - kernel) / stride + 1)
}

/// Cross-correlation with square `kernel`, as PyTorch's `Conv2d`:
/// `B×C×H×W → B×O×H'×W'` with `H' = (H + 2·padding − kernel)/stride + 1` (likewise `W'`).
/// Parameters: `weight [O, C, k, k]`, `bias [O]`.
#[derive(Debug, Clone)]
pub struct Conv2d {
    /// Input sample shape `[C, H, W]`.
    pub input: [usize; 3],
    pub out_channels: usize,
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
    out_hw: [usize; 2],
    /// Per task: the im2col matrix of its samples (`Ckk × S·H'W'`).
    cols: Vec<f32>,
    /// Per task: `Y` in the forward pass, `∂Y` in the backward pass (`O × S·H'W'`).
    outs: Vec<f32>,
    /// Per task: `∂col` (`Ckk × S·H'W'`).
    dcols: Vec<f32>,
    /// Per task: `∂W` (`O × Ckk`) then `∂bias` (`O`) over its samples.
    partials: Vec<f32>,
    /// Stride 1: the direct convolution, with per-task buffers and the taps of the current weights.
    direct: Option<Direct>,
    scratch: Vec<Scratch>,
    /// The current weights rearranged for the direct convolution's tiles.
    weights: Vec<f32>,
}

/// One task's share of a batch: its samples' rows of the layer input and output (or their
/// gradients), and its scratch.
struct Task<'a> {
    /// Samples in this task (`SAMPLES_PER_TASK`, fewer in the last).
    s: usize,
    x: &'a [f32],
    col: &'a mut [f32],
    out: &'a mut [f32],
}

impl Conv2d {
    /// Panics if the kernel does not fit the padded input (the model builder checks first).
    pub fn new(input: [usize; 3], out_channels: usize, kernel: usize, stride: usize, padding: usize) -> Conv2d {
        let oh = out_len(input[1], kernel, stride, padding);
        let ow = out_len(input[2], kernel, stride, padding);
        let (Some(oh), Some(ow)) = (oh, ow) else {
            panic!("conv2d: kernel {kernel} stride {stride} padding {padding} does not fit input {input:?}");
        };
        assert!(out_channels >= 1 && input[0] >= 1, "conv2d: zero channels");
        Conv2d {
            input,
            out_channels,
            kernel,
            stride,
            padding,
            out_hw: [oh, ow],
            cols: Vec::new(),
            outs: Vec::new(),
            dcols: Vec::new(),
            partials: Vec::new(),
            direct: (stride == 1).then(|| Direct::new(input, out_channels, kernel, padding)),
            scratch: Vec::new(),
            weights: Vec::new(),
        }
    }

    /// Rows of the im2col matrix, `C·k·k` (also the fan-in).
    fn ckk(&self) -> usize {
        self.input[0] * self.kernel * self.kernel
    }
    /// Output pixels per channel, `H'·W'`.
    fn pixels(&self) -> usize {
        self.out_hw[0] * self.out_hw[1]
    }
    fn in_len(&self) -> usize {
        self.input.iter().product()
    }

    /// Unrolls the samples `x` (`S × C×H×W`) into `col` (`Ckk × S·H'W'`).
    fn im2col(&self, x: &[f32], col: &mut [f32]) {
        let [c_in, h, w] = self.input;
        let [oh, ow] = self.out_hw;
        let (k, s, pad) = (self.kernel, self.stride, self.padding as isize);
        let (pix, in_len) = (oh * ow, self.in_len());
        let ld = col.len() / self.ckk();
        for (n, x) in x.chunks_exact(in_len).enumerate() {
            for c in 0..c_in {
                let plane = &x[c * h * w..(c + 1) * h * w];
                for ki in 0..k {
                    for kj in 0..k {
                        let row = &mut col[((c * k + ki) * k + kj) * ld + n * pix..][..pix];
                        let (lo, hi) = valid(ow, s, kj as isize - pad, w);
                        for (oy, out) in row.chunks_exact_mut(ow).enumerate() {
                            let iy = (oy * s + ki) as isize - pad;
                            if iy < 0 || iy >= h as isize {
                                out.fill(0.0);
                                continue;
                            }
                            let src = &plane[iy as usize * w..][..w];
                            out[..lo].fill(0.0);
                            out[hi..].fill(0.0);
                            let x0 = ((lo * s + kj) as isize - pad) as usize;
                            if s == 1 {
                                copy_short(&mut out[lo..hi], &src[x0..x0 + (hi - lo)]);
                            } else {
                                for (j, o) in out[lo..hi].iter_mut().enumerate() {
                                    *o = src[x0 + j * s];
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Adds `dcol` (`Ckk × S·H'W'`) back onto the input positions it came from: `dx = col2im(dcol)`
    /// for the `S` samples of `dx`.
    fn col2im(&self, dcol: &[f32], dx: &mut [f32]) {
        let [c_in, h, w] = self.input;
        let [oh, ow] = self.out_hw;
        let (k, s, pad) = (self.kernel, self.stride, self.padding as isize);
        let (pix, in_len) = (oh * ow, self.in_len());
        let ld = dcol.len() / self.ckk();
        dx.fill(0.0);
        for (n, dx) in dx.chunks_exact_mut(in_len).enumerate() {
            for c in 0..c_in {
                let plane = &mut dx[c * h * w..(c + 1) * h * w];
                for ki in 0..k {
                    for kj in 0..k {
                        let row = &dcol[((c * k + ki) * k + kj) * ld + n * pix..][..pix];
                        let (lo, hi) = valid(ow, s, kj as isize - pad, w);
                        for (oy, d) in row.chunks_exact(ow).enumerate() {
                            let iy = (oy * s + ki) as isize - pad;
                            if iy < 0 || iy >= h as isize {
                                continue;
                            }
                            let dst = &mut plane[iy as usize * w..][..w];
                            let x0 = ((lo * s + kj) as isize - pad) as usize;
                            if s == 1 {
                                dst[x0..x0 + (hi - lo)].iter_mut().zip(&d[lo..hi]).for_each(|(t, &v)| *t += v);
                            } else {
                                for (j, &v) in d[lo..hi].iter().enumerate() {
                                    dst[x0 + j * s] += v;
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// `g = Σ_tasks partial`, added in task order: the same sum whatever the number of threads.
    fn sum_partials(&self, g: &mut [f32], tasks: usize) {
        let part = g.len();
        g.copy_from_slice(&self.partials[..part]);
        for acc in self.partials[part..tasks * part].chunks_exact(part) {
            g.iter_mut().zip(acc).for_each(|(s, v)| *s += v);
        }
    }

    /// Stride 1: each task runs its samples through the direct convolution.
    fn forward_direct(&mut self, d: &Direct, (w, bias): (&[f32], &[f32]), x: &[f32], y: &mut [f32]) {
        let (per, in_len, out_len) = (SAMPLES_PER_TASK, self.in_len(), self.out_channels * self.pixels());
        let tasks = x.len().div_ceil(per * in_len);
        if self.scratch.len() < tasks {
            self.scratch.resize_with(tasks, Scratch::default);
        }
        d.forward_weights(w, &mut self.weights);
        let weights = &self.weights;
        let (scratch, ys) = (Pieces::new(&mut self.scratch[..tasks], 1), Pieces::new(y, per * out_len));
        team::run(tasks, &|t| {
            // SAFETY: `run` runs task `t` once, and only task `t` takes pieces `t`.
            let (s, y) = unsafe { (&mut scratch.take(t)[0], ys.take(t)) };
            let x = &x[t * per * in_len..][..y.len() / out_len * in_len];
            d.reserve(s, 1, false);
            for (x, y) in x.chunks_exact(in_len).zip(y.chunks_exact_mut(out_len)) {
                d.forward(s, weights, bias, x, y);
            }
        });
    }

    /// Stride 1: each task sums its samples' `∂W`, `∂bias` into its partial and writes their `∂x`.
    fn backward_direct(&mut self, d: &Direct, w: &[f32], (x, dy): (&[f32], &[f32]), dx: Option<&mut [f32]>) {
        let (o, ckk, pix, in_len) = (self.out_channels, self.ckk(), self.pixels(), self.in_len());
        let (per, part) = (SAMPLES_PER_TASK, o * ckk + o);
        let tasks = x.len().div_ceil(per * in_len);
        if self.scratch.len() < tasks {
            self.scratch.resize_with(tasks, Scratch::default);
        }
        let want_dx = dx.is_some();
        if want_dx {
            d.backward_weights(w, &mut self.weights);
        }
        let weights = &self.weights[..];
        let scratch = Pieces::new(&mut self.scratch[..tasks], 1);
        let accs = Pieces::new(&mut self.partials[..tasks * part], part);
        let dxs = dx.map(|dx| Pieces::new(dx, per * in_len));
        team::run(tasks, &|t| {
            // SAFETY: `run` runs task `t` once, and only task `t` takes pieces `t`.
            let (s, acc, dx) = unsafe { (&mut scratch.take(t)[0], accs.take(t), dxs.as_ref().map(|d| d.take(t))) };
            let x = &x[t * per * in_len..x.len().min((t + 1) * per * in_len)];
            let dy = &dy[t * per * o * pix..][..x.len() / in_len * o * pix];
            d.reserve(s, per, want_dx);
            d.backward(s, weights, (x, dy), dx, acc);
        });
    }

    /// Splits a batch of `b` samples into tasks over the layer's scratch, sized here.
    fn tasks<'a>(&self, x: &'a [f32], b: usize, cols: &'a mut Vec<f32>, outs: &'a mut Vec<f32>) -> Tasks<'a> {
        let (ckk, o, pix, in_len) = (self.ckk(), self.out_channels, self.pixels(), self.in_len());
        let per = SAMPLES_PER_TASK;
        let tasks = b.div_ceil(per);
        grow(cols, tasks * ckk * per * pix);
        grow(outs, tasks * o * per * pix);
        Tasks {
            x: &x[..b * in_len],
            in_len,
            cols: Pieces::new(&mut cols[..tasks * ckk * per * pix], ckk * per * pix),
            outs: Pieces::new(&mut outs[..tasks * o * per * pix], o * per * pix),
        }
    }
}

/// A batch cut into [`Task`]s, one per task of a [`team::run`].
struct Tasks<'a> {
    x: &'a [f32],
    in_len: usize,
    cols: Pieces<'a, f32>,
    outs: Pieces<'a, f32>,
}

impl Tasks<'_> {
    fn count(&self) -> usize {
        self.x.len().div_ceil(SAMPLES_PER_TASK * self.in_len)
    }
    /// Task `t`'s samples and scratch.
    ///
    /// # Safety
    /// At most one call per `t` while `self` lives (as [`team::run`] runs each task once).
    unsafe fn take(&self, t: usize) -> Task<'_> {
        let per = SAMPLES_PER_TASK * self.in_len;
        let x = &self.x[t * per..self.x.len().min((t + 1) * per)];
        let s = x.len() / self.in_len;
        // SAFETY: forwarded from the caller.
        let (col, out) = unsafe { (self.cols.take(t), self.outs.take(t)) };
        let (col_len, out_len) = (col.len() / SAMPLES_PER_TASK * s, out.len() / SAMPLES_PER_TASK * s);
        Task { s, x, col: &mut col[..col_len], out: &mut out[..out_len] }
    }
}

/// `dst = src` for short rows: fixed-width chunks the compiler turns into vector moves, instead of
/// a `memcpy` call per row.
#[inline(always)]
fn copy_short(dst: &mut [f32], src: &[f32]) {
    let mut d = dst.chunks_exact_mut(8);
    let mut s = src.chunks_exact(8);
    for (d, s) in (&mut d).zip(&mut s) {
        let v: [f32; 8] = s.try_into().expect("chunk of 8");
        d.copy_from_slice(&v);
    }
    d.into_remainder().iter_mut().zip(s.remainder()).for_each(|(d, &s)| *d = s);
}

/// The range `lo..hi` of output positions `o < n_out` whose input `o·stride + offset` is in `0..n_in`.
fn valid(n_out: usize, stride: usize, offset: isize, n_in: usize) -> (usize, usize) {
    let s = stride as isize;
    let lo = if offset >= 0 { 0 } else { (-offset + s - 1) / s };
    let room = n_in as isize - offset;
    let hi = if room <= 0 { 0 } else { (room - 1) / s + 1 };
    let hi = (hi as usize).min(n_out);
    ((lo as usize).min(hi), hi)
}

impl Layer for Conv2d {
    fn kind(&self) -> &'static str {
        "conv2d"
    }
    fn out_shape(&self) -> Vec<usize> {
        vec![self.out_channels, self.out_hw[0], self.out_hw[1]]
    }
    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let [c, k] = [self.input[0], self.kernel];
        vec![("weight".into(), vec![self.out_channels, c, k, k]), ("bias".into(), vec![self.out_channels])]
    }
    /// PyTorch's default (kaiming-uniform with `a = √5`): weight and bias uniform in `±1/√(C·k·k)`.
    fn init(&self, mut p: ArrayViewMut1<f32>, rng: &mut Rng) {
        let bound = 1.0 / (self.ckk() as f32).sqrt();
        p.iter_mut().for_each(|v| *v = rng.uniform(bound));
    }
    /// `x: B×C×H×W → y: B×O×H'×W'`.
    fn forward(&mut self, p: ArrayView1<f32>, x: ArrayView2<f32>, y: ArrayViewMut2<f32>, _pass: &Pass) {
        let (o, ckk, pix, in_len) = (self.out_channels, self.ckk(), self.pixels(), self.in_len());
        let b = batch_of("conv2d", &x, &y, in_len, o * pix);
        assert_eq!(p.len(), o * ckk + o, "conv2d: parameter slice");
        let (p, x, y) = (flat(p), rows(x), rows_mut(y));
        let (w, bias) = p.split_at(o * ckk);
        if let Some(d) = self.direct.take() {
            self.forward_direct(&d, (w, bias), &x[..b * in_len], &mut y[..b * o * pix]);
            self.direct = Some(d);
            return;
        }
        let (mut cols, mut outs) = (std::mem::take(&mut self.cols), std::mem::take(&mut self.outs));
        let tasks = self.tasks(x, b, &mut cols, &mut outs);
        let ys = Pieces::new(&mut y[..b * o * pix], SAMPLES_PER_TASK * o * pix);
        team::run(tasks.count(), &|t| {
            // SAFETY: `run` runs task `t` once, and only task `t` takes pieces `t`.
            let (t, y) = unsafe { (tasks.take(t), ys.take(t)) };
            self.im2col(t.x, t.col);
            gemm(Trans::N, Trans::N, o, t.s * pix, ckk, 1.0, w, t.col, 0.0, t.out);
            // Row `c` of Y holds channel `c` of every sample: copy each out with the bias added.
            for (c, (row, &bb)) in t.out.chunks_exact(t.s * pix).zip(bias).enumerate() {
                for (n, src) in row.chunks_exact(pix).enumerate() {
                    let dst = &mut y[(n * o + c) * pix..][..pix];
                    dst.iter_mut().zip(src).for_each(|(d, &v)| *d = v + bb);
                }
            }
        });
        (self.cols, self.outs) = (cols, outs);
    }
    /// `∂W = Σ ∂Y·colᵀ`, `∂bias = Σ ∂Y`, `∂x = col2im(Wᵀ·∂Y)`.
    fn backward(&mut self, p: ArrayView1<f32>, io: Io, dy: ArrayView2<f32>, Grads { g, dx }: Grads) {
        let b = batch_back("conv2d", &io, &dy, &dx);
        let (o, ckk, pix, in_len) = (self.out_channels, self.ckk(), self.pixels(), self.in_len());
        assert_eq!(g.len(), o * ckk + o, "conv2d: gradient slice");
        let (p, g, x, dy, dx) = (flat(p), flat_mut(g), rows(io.x), rows(dy), dx.map(rows_mut));
        let w = &p[..o * ckk];
        let (per, tasks, part) = (SAMPLES_PER_TASK, b.div_ceil(SAMPLES_PER_TASK), o * ckk + o);
        grow(&mut self.partials, tasks * part);
        if let Some(d) = self.direct.take() {
            self.backward_direct(&d, w, (&x[..b * in_len], &dy[..b * o * pix]), dx.map(|dx| &mut dx[..b * in_len]));
            self.direct = Some(d);
            return self.sum_partials(g, tasks);
        }
        let want_dx = dx.is_some();
        if want_dx {
            grow(&mut self.dcols, tasks * ckk * per * pix);
        }
        let (mut cols, mut outs) = (std::mem::take(&mut self.cols), std::mem::take(&mut self.outs));
        let (mut dcols, mut partials) = (std::mem::take(&mut self.dcols), std::mem::take(&mut self.partials));
        // One task: its samples' ∂W, ∂bias partial (the columns are recomputed, which is cheaper
        // than keeping b of them), and their ∂x when asked.
        let task = |t: Task, acc: &mut [f32], dy: &[f32], dcol: &mut [f32], dx: Option<&mut [f32]>| {
            let cols_n = t.s * pix;
            // Gather ∂Y channel-major: row c holds channel c of every sample.
            for (n, dy) in dy.chunks_exact(o * pix).enumerate() {
                for (c, src) in dy.chunks_exact(pix).enumerate() {
                    copy_short(&mut t.out[c * cols_n + n * pix..][..pix], src);
                }
            }
            self.im2col(t.x, t.col);
            let (gw, gb) = acc.split_at_mut(o * ckk);
            gemm(Trans::N, Trans::T, o, ckk, cols_n, 1.0, t.out, t.col, 0.0, gw);
            for (s, row) in gb.iter_mut().zip(t.out.chunks_exact(cols_n)) {
                *s = row.iter().sum::<f32>();
            }
            if let Some(dx) = dx {
                let dcol = &mut dcol[..ckk * cols_n];
                gemm(Trans::T, Trans::N, ckk, cols_n, o, 1.0, w, t.out, 0.0, dcol);
                self.col2im(dcol, dx);
            }
        };
        let split = self.tasks(x, b, &mut cols, &mut outs);
        let accs = Pieces::new(&mut partials[..tasks * part], part);
        let dcol_pieces = Pieces::new(&mut dcols[..if want_dx { tasks * ckk * per * pix } else { 0 }], ckk * per * pix);
        let dxs = dx.map(|dx| Pieces::new(&mut dx[..b * in_len], per * in_len));
        team::run(tasks, &|t| {
            let dy = &dy[t * per * o * pix..b.min((t + 1) * per) * o * pix];
            // SAFETY: `run` runs task `t` once, and only task `t` takes pieces `t`.
            unsafe {
                match &dxs {
                    Some(dxs) => task(split.take(t), accs.take(t), dy, dcol_pieces.take(t), Some(dxs.take(t))),
                    None => task(split.take(t), accs.take(t), dy, &mut [], None),
                }
            }
        });
        (self.cols, self.outs, self.dcols, self.partials) = (cols, outs, dcols, partials);
        self.sum_partials(g, tasks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::layers::OnSlices;

    /// Every `(sample offset in x, weight index, output index)` triple of a direct convolution of
    /// one sample, padding taps left out.
    fn taps(c: &Conv2d, mut f: impl FnMut(usize, usize, usize)) {
        let [ci, h, w] = c.input;
        let [oh, ow] = c.out_hw;
        let (k, s, pad) = (c.kernel, c.stride, c.padding as isize);
        for o in 0..c.out_channels {
            for oy in 0..oh {
                for ox in 0..ow {
                    for ch in 0..ci {
                        for ki in 0..k {
                            for kj in 0..k {
                                let (iy, ix) = ((oy * s + ki) as isize - pad, (ox * s + kj) as isize - pad);
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                                    let xi = (ch * h + iy as usize) * w + ix as usize;
                                    f(xi, ((o * ci + ch) * k + ki) * k + kj, (o * oh + oy) * ow + ox);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Forward and backward over batches of 3 (one partial task) and 11 (a full task and a
    /// partial one) against direct loops, for several strides and paddings.
    #[test]
    fn matches_direct_convolution_for_strides_and_paddings() {
        let mut rng = Rng::from_keys(&[5]);
        for &(input, o, k, s, pad) in &[
            ([1, 6, 6], 2, 3, 1, 0),
            ([2, 7, 5], 3, 3, 2, 1),
            ([3, 5, 5], 2, 5, 1, 2),
            ([2, 4, 4], 3, 1, 2, 0),
            ([1, 3, 3], 1, 4, 3, 2),
            ([1, 12, 12], 6, 5, 1, 0),
        ] {
            for b in [3, 11] {
                let mut c = Conv2d::new(input, o, k, s, pad);
                let (ckk, il) = (c.ckk(), c.in_len());
                let ol: usize = c.out_shape().iter().product();
                let mut p = vec![0.0; o * ckk + o];
                c.init(ndarray::ArrayViewMut1::from(&mut p[..]), &mut rng);
                let x: Vec<f32> = (0..b * il).map(|_| rng.uniform(1.0)).collect();
                let dy: Vec<f32> = (0..b * ol).map(|_| rng.uniform(1.0)).collect();
                let ids: Vec<usize> = (0..b).collect();
                let pass = Pass { mode: crate::nn::layers::Mode { train: false, seed: 0, epoch: 0 }, sample_ids: &ids };
                let mut y = vec![f32::NAN; b * ol];
                let (mut g, mut dx) = (vec![f32::NAN; p.len()], vec![f32::NAN; b * il]);
                // A first pass over a full last task leaves stale values in every scratch buffer,
                // which the checked pass (a short last task) must not pick up.
                let (b0, x0, dy0) = (
                    b.next_multiple_of(SAMPLES_PER_TASK),
                    vec![7.0; b.next_multiple_of(SAMPLES_PER_TASK) * il],
                    vec![5.0; b.next_multiple_of(SAMPLES_PER_TASK) * ol],
                );
                let (mut y0, mut dx0) = (vec![0.0; b0 * ol], vec![0.0; b0 * il]);
                c.fwd(&p, &x0, &mut y0, b0, &pass);
                c.bwd(&p, &mut g, &x0, &y0, &dy0, Some(&mut dx0), b0);
                c.fwd(&p, &x, &mut y, b, &pass);
                c.bwd(&p, &mut g, &x, &y, &dy, Some(&mut dx), b);
                // Direct loops, in f64.
                let mut want_y: Vec<f64> = (0..b * ol).map(|i| p[o * ckk + (i % ol) / c.pixels()] as f64).collect();
                let mut want_g = vec![0.0f64; p.len()];
                let mut want_dx = vec![0.0f64; b * il];
                for n in 0..b {
                    taps(&c, |xi, wi, yi| {
                        let (xi, yi) = (n * il + xi, n * ol + yi);
                        want_y[yi] += (p[wi] * x[xi]) as f64;
                        want_g[wi] += (dy[yi] * x[xi]) as f64;
                        want_dx[xi] += (dy[yi] * p[wi]) as f64;
                    });
                    for (i, &d) in dy[n * ol..(n + 1) * ol].iter().enumerate() {
                        want_g[o * ckk + i / c.pixels()] += d as f64;
                    }
                }
                for (what, got, want) in [("y", &y, &want_y), ("∂p", &g, &want_g), ("∂x", &dx, &want_dx)] {
                    for (a, w) in got.iter().zip(want.iter()) {
                        assert!((*a as f64 - w).abs() < 1e-4, "{input:?} k{k} s{s} p{pad} b{b} {what}: {a} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn output_sizes() {
        assert_eq!(out_len(28, 5, 1, 2), Some(28));
        assert_eq!(out_len(14, 5, 1, 0), Some(10));
        assert_eq!(out_len(28, 2, 2, 0), Some(14));
        assert_eq!(out_len(7, 1, 2, 0), Some(4));
        assert_eq!(out_len(3, 5, 1, 0), None);
        assert_eq!(out_len(3, 5, 1, 1), Some(1));
    }
}

//! 2-D convolution by im2col + GEMM, rayon over the samples of a batch.
//!
//! Per sample, `im2col` unrolls the `C×H×W` input into a `(C·k·k) × (H'·W')` matrix whose column
//! `p` holds the receptive field of output pixel `p` (zeros where it overhangs the padding). Then
//!
//! ```text
//!     forward   y_n   (O × H'W')   = W (O × Ckk) · col_n (Ckk × H'W') + bias
//!     backward  ∂W    (O × Ckk)    = Σ_n ∂y_n · col_nᵀ
//!               ∂bias (O)          = Σ_n Σ_p ∂y_n[·, p]
//!               ∂col_n (Ckk × H'W') = Wᵀ · ∂y_n,   ∂x_n = col2im(∂col_n)
//! ```
//!
//! `y_n` lands directly in channel-first layout, so no transpose is needed. Work is split into
//! tasks of [`SAMPLES_PER_TASK`] samples run by rayon, each with its own scratch column matrix; the
//! backward pass recomputes the columns rather than keeping `b` of them from the forward pass
//! (hundreds of MB at batch 256 for a 16-channel 28×28 layer, and a recomputed matrix is still
//! in cache when the GEMMs read it). `∂W` is summed per task, then the task partials are added in
//! order, so the result depends on the batch only, never on the number of threads.

use crate::gemm::{gemm, Trans};
use crate::layers::{grow, Io, Layer, Pass, SAMPLES_PER_TASK};
use crate::rng::Rng;
use rayon::prelude::*;

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
    /// Per task of [`SAMPLES_PER_TASK`] samples: scratch im2col matrix (`Ckk × H'W'`).
    cols: Vec<f32>,
    /// Per task: `∂W` (`O × Ckk`) then `∂bias` (`O`) over its samples.
    partials: Vec<f32>,
    /// Per task: scratch `∂col` (`Ckk × H'W'`).
    dcols: Vec<f32>,
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
            partials: Vec::new(),
            dcols: Vec::new(),
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

    /// Unrolls one sample `x` (`C×H×W`) into `col` (`Ckk × H'W'`).
    fn im2col(&self, x: &[f32], col: &mut [f32]) {
        let [c_in, h, w] = self.input;
        let [oh, ow] = self.out_hw;
        let (k, s, pad) = (self.kernel, self.stride, self.padding as isize);
        for c in 0..c_in {
            let plane = &x[c * h * w..(c + 1) * h * w];
            for ki in 0..k {
                for kj in 0..k {
                    let row = &mut col[((c * k + ki) * k + kj) * oh * ow..][..oh * ow];
                    let (lo, hi) = valid(ow, s, kj as isize - pad, w);
                    for oy in 0..oh {
                        let out = &mut row[oy * ow..(oy + 1) * ow];
                        let iy = (oy * s + ki) as isize - pad;
                        if iy < 0 || iy >= h as isize {
                            out.fill(0.0);
                            continue;
                        }
                        let src = &plane[iy as usize * w..][..w];
                        out[..lo].fill(0.0);
                        out[hi..].fill(0.0);
                        let x0 = (lo * s + kj) as isize - pad;
                        if s == 1 {
                            out[lo..hi].copy_from_slice(&src[x0 as usize..x0 as usize + (hi - lo)]);
                        } else {
                            for (j, o) in out[lo..hi].iter_mut().enumerate() {
                                *o = src[x0 as usize + j * s];
                            }
                        }
                    }
                }
            }
        }
    }

    /// Adds `dcol` (`Ckk × H'W'`) back onto the input positions it came from: `dx = col2im(dcol)`.
    fn col2im(&self, dcol: &[f32], dx: &mut [f32]) {
        let [c_in, h, w] = self.input;
        let [oh, ow] = self.out_hw;
        let (k, s, pad) = (self.kernel, self.stride, self.padding as isize);
        dx.fill(0.0);
        for c in 0..c_in {
            let plane = &mut dx[c * h * w..(c + 1) * h * w];
            for ki in 0..k {
                for kj in 0..k {
                    let row = &dcol[((c * k + ki) * k + kj) * oh * ow..][..oh * ow];
                    let (lo, hi) = valid(ow, s, kj as isize - pad, w);
                    for oy in 0..oh {
                        let iy = (oy * s + ki) as isize - pad;
                        if iy < 0 || iy >= h as isize {
                            continue;
                        }
                        let dst = &mut plane[iy as usize * w..][..w];
                        let x0 = ((lo * s + kj) as isize - pad) as usize;
                        for (j, &v) in row[oy * ow + lo..oy * ow + hi].iter().enumerate() {
                            dst[x0 + j * s] += v;
                        }
                    }
                }
            }
        }
    }
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
    fn init(&self, p: &mut [f32], rng: &mut Rng) {
        let bound = 1.0 / (self.ckk() as f32).sqrt();
        p.iter_mut().for_each(|v| *v = rng.uniform(bound));
    }
    /// `x: B×C×H×W → y: B×O×H'×W'`.
    fn forward(&mut self, p: &[f32], x: &[f32], y: &mut [f32], b: usize, _pass: &Pass) {
        let (o, ckk, pix, in_len) = (self.out_channels, self.ckk(), self.pixels(), self.in_len());
        assert_eq!(p.len(), o * ckk + o, "conv2d: parameter slice");
        assert!(x.len() >= b * in_len && y.len() >= b * o * pix, "conv2d: batch buffers too small");
        let (w, bias) = p.split_at(o * ckk);
        let tasks = b.div_ceil(SAMPLES_PER_TASK);
        grow(&mut self.cols, tasks * ckk * pix);
        let mut cols = std::mem::take(&mut self.cols);
        let this = &*self;
        y[..b * o * pix]
            .par_chunks_mut(SAMPLES_PER_TASK * o * pix)
            .zip(x[..b * in_len].par_chunks(SAMPLES_PER_TASK * in_len))
            .zip(cols.par_chunks_mut(ckk * pix))
            .for_each(|((y, x), col)| {
                for (y, x) in y.chunks_exact_mut(o * pix).zip(x.chunks_exact(in_len)) {
                    this.im2col(x, col);
                    gemm(Trans::N, Trans::N, o, pix, ckk, 1.0, w, col, 0.0, y);
                    for (row, &bb) in y.chunks_exact_mut(pix).zip(bias) {
                        row.iter_mut().for_each(|v| *v += bb);
                    }
                }
            });
        self.cols = cols;
    }
    /// `∂W = Σ_n ∂y_n·col_nᵀ`, `∂bias = Σ ∂y`, `∂x_n = col2im(Wᵀ·∂y_n)`.
    fn backward(&mut self, p: &[f32], g: &mut [f32], io: Io, dy: &[f32], dx: Option<&mut [f32]>) {
        let b = io.b;
        let (o, ckk, pix, in_len) = (self.out_channels, self.ckk(), self.pixels(), self.in_len());
        assert_eq!(g.len(), o * ckk + o, "conv2d: gradient slice");
        assert!(dy.len() >= b * o * pix && io.x.len() >= b * in_len, "conv2d: batch buffers too small");
        let (dy, x, w) = (&dy[..b * o * pix], &io.x[..b * in_len], &p[..o * ckk]);
        let tasks = b.div_ceil(SAMPLES_PER_TASK);
        let part = o * ckk + o;
        grow(&mut self.partials, tasks * part);
        grow(&mut self.cols, tasks * ckk * pix);
        let want_dx = dx.is_some();
        if want_dx {
            grow(&mut self.dcols, tasks * ckk * pix);
        }
        let mut cols = std::mem::take(&mut self.cols);
        let mut dcols = std::mem::take(&mut self.dcols);
        let mut partials = std::mem::take(&mut self.partials);
        let this = &*self;
        // One task: its samples' ∂W, ∂bias partial (the columns are recomputed, which is cheaper
        // than keeping b of them), and their ∂x when asked.
        let task =
            |acc: &mut [f32], dy: &[f32], x: &[f32], col: &mut [f32], dcol: &mut [f32], mut dx: Option<&mut [f32]>| {
                let (gw, gb) = acc.split_at_mut(o * ckk);
                gb.fill(0.0);
                for (n, (dy, x)) in dy.chunks_exact(o * pix).zip(x.chunks_exact(in_len)).enumerate() {
                    this.im2col(x, col);
                    let beta = if n == 0 { 0.0 } else { 1.0 };
                    gemm(Trans::N, Trans::T, o, ckk, pix, 1.0, dy, col, beta, gw);
                    for (s, row) in gb.iter_mut().zip(dy.chunks_exact(pix)) {
                        *s += row.iter().sum::<f32>();
                    }
                    if let Some(dx) = dx.as_deref_mut() {
                        gemm(Trans::T, Trans::N, ckk, pix, o, 1.0, w, dy, 0.0, dcol);
                        this.col2im(dcol, &mut dx[n * in_len..(n + 1) * in_len]);
                    }
                }
            };
        let tasks_iter = partials[..tasks * part]
            .par_chunks_mut(part)
            .zip(dy.par_chunks(SAMPLES_PER_TASK * o * pix))
            .zip(x.par_chunks(SAMPLES_PER_TASK * in_len))
            .zip(cols.par_chunks_mut(ckk * pix));
        match dx {
            Some(dx) => tasks_iter
                .zip(dcols.par_chunks_mut(ckk * pix))
                .zip(dx[..b * in_len].par_chunks_mut(SAMPLES_PER_TASK * in_len))
                .for_each(|(((((acc, dy), x), col), dcol), dx)| task(acc, dy, x, col, dcol, Some(dx))),
            None => tasks_iter.for_each(|(((acc, dy), x), col)| task(acc, dy, x, col, &mut [], None)),
        }
        // Task partials added in order: the same sum whatever the number of threads.
        g.copy_from_slice(&partials[..part]);
        for acc in partials[part..tasks * part].chunks_exact(part) {
            g.iter_mut().zip(acc).for_each(|(s, v)| *s += v);
        }
        (self.cols, self.dcols, self.partials) = (cols, dcols, partials);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Direct 7-loop convolution of one sample.
    fn naive(c: &Conv2d, p: &[f32], x: &[f32]) -> Vec<f32> {
        let [ci, h, w] = c.input;
        let [oh, ow] = c.out_hw;
        let (k, s, pad) = (c.kernel, c.stride, c.padding as isize);
        let mut y = vec![0.0; c.out_channels * oh * ow];
        for o in 0..c.out_channels {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = p[c.out_channels * c.ckk() + o];
                    for ch in 0..ci {
                        for ki in 0..k {
                            for kj in 0..k {
                                let (iy, ix) = ((oy * s + ki) as isize - pad, (ox * s + kj) as isize - pad);
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                                    acc += p[((o * ci + ch) * k + ki) * k + kj]
                                        * x[(ch * h + iy as usize) * w + ix as usize];
                                }
                            }
                        }
                    }
                    y[(o * oh + oy) * ow + ox] = acc;
                }
            }
        }
        y
    }

    #[test]
    fn matches_direct_convolution_for_strides_and_paddings() {
        let mut rng = Rng::from_keys(&[5]);
        for &(input, o, k, s, pad) in &[
            ([1, 6, 6], 2, 3, 1, 0),
            ([2, 7, 5], 3, 3, 2, 1),
            ([3, 5, 5], 2, 5, 1, 2),
            ([2, 4, 4], 3, 1, 2, 0),
            ([1, 3, 3], 1, 4, 3, 2),
        ] {
            let mut c = Conv2d::new(input, o, k, s, pad);
            let mut p = vec![0.0; o * c.ckk() + o];
            c.init(&mut p, &mut rng);
            let b = 3;
            let x: Vec<f32> = (0..b * c.in_len()).map(|_| rng.uniform(1.0)).collect();
            let out_len: usize = c.out_shape().iter().product();
            let mut y = vec![f32::NAN; b * out_len];
            let pass = Pass { mode: crate::layers::Mode { train: false, seed: 0, epoch: 0 }, sample_ids: &[0, 1, 2] };
            c.forward(&p, &x, &mut y, b, &pass);
            for n in 0..b {
                let want = naive(&c, &p, &x[n * c.in_len()..(n + 1) * c.in_len()]);
                for (a, w) in y[n * out_len..(n + 1) * out_len].iter().zip(&want) {
                    assert!((a - w).abs() < 1e-5, "{input:?} k{k} s{s} p{pad}: {a} vs {w}");
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

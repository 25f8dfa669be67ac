//! Layers as explicit forward/backward pairs over row-major mini-batches.
//!
//! A mini-batch is `b` rows of per-sample features. A layer maps `B×D_in → B×D_out`; it reads its
//! parameters from its slice `p` of the model's flat parameter buffer and writes parameter gradients
//! into the matching slice `g` of the flat gradient buffer (overwriting: every parameter is used by
//! exactly one layer). The model owns the activation buffers and hands each layer its input `x` and
//! output `y`; layers that need more than that keep an explicit cache of their own.
//!
//! Images stay rows too: a sample of shape `[C, H, W]` is `C·H·W` floats, channel first (NCHW), so
//! `B×C×H×W` is a `B × (C·H·W)` matrix and every layer knows its per-sample input shape. This file
//! holds the element-wise and fully connected layers; [`crate::nn::conv`], [`crate::nn::pool`],
//! [`crate::nn::norm`], [`crate::nn::dropout`] and [`crate::nn::residual`] hold the rest.

use crate::data::rng::Rng;
use crate::kernels::gemm::{gemm, Trans};
use crate::kernels::team;
use ndarray::{ArrayView2, ArrayViewMut2, Zip};

/// How a batch is run: training or evaluation, and the keys of per-sample randomness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mode {
    pub train: bool,
    pub seed: u64,
    pub epoch: u64,
}

/// What a layer knows about a pass besides the data.
#[derive(Debug, Clone, Copy)]
pub struct Pass<'a> {
    pub mode: Mode,
    /// Dataset index of every row in the batch, so per-sample randomness (dropout) depends on the
    /// sample, not on which rank or row position processes it.
    pub sample_ids: &'a [usize],
}

/// A layer's input and output for one batch of `b` rows.
#[derive(Debug, Clone, Copy)]
pub struct Io<'a> {
    pub x: &'a [f32],
    pub y: &'a [f32],
    pub b: usize,
}

pub trait Layer: Send {
    /// Short kind name, used in parameter names and messages.
    fn kind(&self) -> &'static str;
    /// Shape of one output sample.
    fn out_shape(&self) -> Vec<usize>;
    /// Named parameter tensors, in flat-buffer order (e.g. `weight [out,in]`, `bias [out]`; a block
    /// of layers names its inner tensors with dots, `body.0.weight`).
    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        Vec::new()
    }
    /// Writes initial parameters into `p` from the stream `rng`.
    fn init(&self, _p: &mut [f32], _rng: &mut Rng) {}
    /// `x: b×D_in → y: b×D_out`.
    fn forward(&mut self, p: &[f32], x: &[f32], y: &mut [f32], b: usize, pass: &Pass);
    /// Given `dy = ∂L/∂y`, writes `∂L/∂p` into `g` and, when asked, `∂L/∂x` into `dx`.
    fn backward(&mut self, p: &[f32], g: &mut [f32], io: Io, dy: &[f32], dx: Option<&mut [f32]>);
    /// True for a layer whose output is its input, reshaped (its forward and backward copy): a
    /// chain then skips it and hands the layer above the input's buffer itself.
    fn is_reshape(&self) -> bool {
        false
    }
}

fn view2(s: &[f32], rows: usize, cols: usize) -> ArrayView2<'_, f32> {
    ArrayView2::from_shape((rows, cols), &s[..rows * cols]).expect("row-major view")
}
fn view2_mut(s: &mut [f32], rows: usize, cols: usize) -> ArrayViewMut2<'_, f32> {
    ArrayViewMut2::from_shape((rows, cols), &mut s[..rows * cols]).expect("row-major view")
}

/// Fully connected: `y = x·Wᵀ + bias`, `W: out×in` (PyTorch layout), `B×in → B×out`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub inp: usize,
    pub out: usize,
}

impl Layer for Linear {
    fn kind(&self) -> &'static str {
        "linear"
    }
    fn out_shape(&self) -> Vec<usize> {
        vec![self.out]
    }
    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        vec![("weight".into(), vec![self.out, self.inp]), ("bias".into(), vec![self.out])]
    }
    /// PyTorch's default: weight and bias uniform in `±1/√in`.
    fn init(&self, p: &mut [f32], rng: &mut Rng) {
        let bound = 1.0 / (self.inp as f32).sqrt();
        p.iter_mut().for_each(|v| *v = rng.uniform(bound));
    }
    fn forward(&mut self, p: &[f32], x: &[f32], y: &mut [f32], b: usize, _pass: &Pass) {
        let (w, bias) = p.split_at(self.out * self.inp);
        let y = &mut y[..b * self.out];
        gemm(Trans::N, Trans::T, b, self.out, self.inp, 1.0, &x[..b * self.inp], w, 0.0, y);
        for row in y.chunks_exact_mut(self.out) {
            row.iter_mut().zip(bias).for_each(|(v, bb)| *v += bb);
        }
    }
    fn backward(&mut self, p: &[f32], g: &mut [f32], io: Io, dy: &[f32], dx: Option<&mut [f32]>) {
        let b = io.b;
        let dy = &dy[..b * self.out];
        let (gw, gb) = g.split_at_mut(self.out * self.inp);
        // dW (out×in) = dyᵀ (out×b) · x (b×in)
        gemm(Trans::T, Trans::N, self.out, self.inp, b, 1.0, dy, &io.x[..b * self.inp], 0.0, gw);
        column_sums(dy, gb);
        if let Some(dx) = dx {
            // dx (b×in) = dy (b×out) · W (out×in)
            let w = &p[..self.out * self.inp];
            gemm(Trans::N, Trans::N, b, self.inp, self.out, 1.0, dy, w, 0.0, &mut dx[..b * self.inp]);
        }
    }
}

/// A bias gradient: `out[j] = Σ_rows dy[row][j]`, rows of `out.len()`.
fn column_sums(dy: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for row in dy.chunks_exact(out.len()) {
        out.iter_mut().zip(row).for_each(|(s, v)| *s += v);
    }
}

/// Element-wise `max(x, 0)`; shape preserved.
#[derive(Debug, Clone)]
pub struct Relu {
    pub shape: Vec<usize>,
}

impl Layer for Relu {
    fn kind(&self) -> &'static str {
        "relu"
    }
    fn out_shape(&self) -> Vec<usize> {
        self.shape.clone()
    }
    fn forward(&mut self, _p: &[f32], x: &[f32], y: &mut [f32], b: usize, _pass: &Pass) {
        let n = b * self.shape.iter().product::<usize>();
        let c = ELEMENTWISE_CHUNK;
        team::zip_chunks_mut([&mut y[..n]], c, &|i, [y]| {
            y.iter_mut().zip(&x[i * c..]).for_each(|(y, &x)| *y = x.max(0.0));
        });
    }
    fn backward(&mut self, _p: &[f32], _g: &mut [f32], io: Io, dy: &[f32], dx: Option<&mut [f32]>) {
        if let Some(dx) = dx {
            let n = io.b * self.shape.iter().product::<usize>();
            let c = ELEMENTWISE_CHUNK;
            team::zip_chunks_mut([&mut dx[..n]], c, &|i, [dx]| {
                for ((dx, &dy), &y) in dx.iter_mut().zip(&dy[i * c..]).zip(&io.y[i * c..]) {
                    *dx = if y > 0.0 { dy } else { 0.0 };
                }
            });
        }
    }
}

/// Element-wise `tanh(x)`; shape preserved.
#[derive(Debug, Clone)]
pub struct Tanh {
    pub shape: Vec<usize>,
}

impl Layer for Tanh {
    fn kind(&self) -> &'static str {
        "tanh"
    }
    fn out_shape(&self) -> Vec<usize> {
        self.shape.clone()
    }
    fn forward(&mut self, _p: &[f32], x: &[f32], y: &mut [f32], b: usize, _pass: &Pass) {
        let d = self.shape.iter().product::<usize>();
        Zip::from(view2_mut(y, b, d)).and(view2(x, b, d)).for_each(|y, &x| *y = x.tanh());
    }
    fn backward(&mut self, _p: &[f32], _g: &mut [f32], io: Io, dy: &[f32], dx: Option<&mut [f32]>) {
        if let Some(dx) = dx {
            let d = self.shape.iter().product::<usize>();
            Zip::from(view2_mut(dx, io.b, d))
                .and(view2(dy, io.b, d))
                .and(view2(io.y, io.b, d))
                .for_each(|dx, &dy, &y| *dx = dy * (1.0 - y * y));
        }
    }
}

/// Element-wise SiLU (swish), `x·σ(x)`; shape preserved. Smooth, unlike relu: a rounding-level
/// change of its input moves its output and derivative by as little, with no kink to cross, so
/// networks built on it keep float-rounding differences (e.g. between two splits of a batch) small.
#[derive(Debug, Clone)]
pub struct Silu {
    pub shape: Vec<usize>,
}

/// Elements per team task of the element-wise layers (the inner loops vectorise).
const ELEMENTWISE_CHUNK: usize = 1 << 14;

impl Layer for Silu {
    fn kind(&self) -> &'static str {
        "silu"
    }
    fn out_shape(&self) -> Vec<usize> {
        self.shape.clone()
    }
    fn forward(&mut self, _p: &[f32], x: &[f32], y: &mut [f32], b: usize, _pass: &Pass) {
        let n = b * self.shape.iter().product::<usize>();
        let c = ELEMENTWISE_CHUNK;
        team::zip_chunks_mut([&mut y[..n]], c, &|i, [y]| {
            y.iter_mut().zip(&x[i * c..]).for_each(|(y, &x)| *y = x * sigmoid(x));
        });
    }
    /// `∂x = ∂y · σ(x)·(1 + x·(1 − σ(x)))`.
    fn backward(&mut self, _p: &[f32], _g: &mut [f32], io: Io, dy: &[f32], dx: Option<&mut [f32]>) {
        if let Some(dx) = dx {
            let n = io.b * self.shape.iter().product::<usize>();
            let c = ELEMENTWISE_CHUNK;
            team::zip_chunks_mut([&mut dx[..n]], c, &|i, [dx]| {
                for ((dx, &dy), &x) in dx.iter_mut().zip(&dy[i * c..]).zip(&io.x[i * c..]) {
                    let s = sigmoid(x);
                    *dx = dy * s * (1.0 + x * (1.0 - s));
                }
            });
        }
    }
}

/// `1 / (1 + e^(−x))` with [`exp`].
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `e^x` in branch-free f32 arithmetic that vectorises (unlike libm's `expf`): `x = n·ln 2 + r`
/// with `|r| ≤ ln2/2`, a degree-6 Taylor polynomial for `e^r`, and `2^n` built in the exponent
/// bits. Relative error below 3e-7 on `[−87, 88]`; the input is clamped to that range (so `e^x`
/// saturates at about `1.7e38` and bottoms out at about `1.6e-38` instead of reaching ∞ or 0).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E).round();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Reshapes `B×C×H×W` (any per-sample shape) to `B×(C·H·W)`; the data are already row-major.
#[derive(Debug, Clone)]
pub struct Flatten {
    pub features: usize,
}

impl Layer for Flatten {
    fn kind(&self) -> &'static str {
        "flatten"
    }
    fn is_reshape(&self) -> bool {
        true
    }
    fn out_shape(&self) -> Vec<usize> {
        vec![self.features]
    }
    fn forward(&mut self, _p: &[f32], x: &[f32], y: &mut [f32], b: usize, _pass: &Pass) {
        let n = b * self.features;
        y[..n].copy_from_slice(&x[..n]);
    }
    fn backward(&mut self, _p: &[f32], _g: &mut [f32], io: Io, dy: &[f32], dx: Option<&mut [f32]>) {
        if let Some(dx) = dx {
            let n = io.b * self.features;
            dx[..n].copy_from_slice(&dy[..n]);
        }
    }
}

/// Samples per team task in the per-sample layers (convolution, pooling, normalisation, dropout):
/// enough work per task to cover the hand-over, and fixed, so a convolution's weight gradient
/// (summed per task, then over tasks in order) does not depend on the number of threads.
pub const SAMPLES_PER_TASK: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate_over_its_range() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            worst = worst.max(((exp(x) as f64) - want).abs() / want);
        }
        assert!(worst < 3e-7, "worst relative error {worst:.2e}");
        assert_eq!((exp(-1000.0) > 0.0, exp(1000.0).is_finite()), (true, true));
        assert!(sigmoid(-1000.0) < 1e-37 && sigmoid(1000.0) == 1.0);
    }
}

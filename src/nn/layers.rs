//! Layers as explicit forward/backward pairs over ndarray views of row-major mini-batches.
//!
//! A mini-batch is an `ArrayView2` of `b` rows of per-sample features. A layer maps `B×D_in →
//! B×D_out`:
//!
//! ```text
//!     forward   (p, x)      → y             p: its parameters, x: B×D_in, y: B×D_out
//!     backward  (p, x, y, ∂y) → (∂p, ∂x)    ∂x only when asked
//! ```
//!
//! `p` is the layer's part of the model's flat parameter buffer and `∂p` the matching part of the
//! flat gradient buffer (overwritten: every parameter is used by exactly one layer), both as 1-D
//! views. The model owns the activation buffers and hands each layer its input and output; layers
//! that need more than that keep an explicit cache of their own. The kernels keep their slice and
//! stride entry points: a layer takes the views' row-major slices ([`rows`], [`rows_mut`]) and
//! feeds them in, so the views cost only a shape check.
//!
//! Images stay rows too: a sample of shape `[C, H, W]` is `C·H·W` floats, channel first (NCHW), so
//! `B×C×H×W` is a `B × (C·H·W)` matrix and every layer knows its per-sample input shape. This file
//! holds the element-wise and fully connected layers; [`crate::nn::conv`], [`crate::nn::pool`],
//! [`crate::nn::norm`], [`crate::nn::dropout`] and [`crate::nn::residual`] hold the rest.

use crate::data::rng::Rng;
use crate::kernels::gemm::{gemm, Trans};
use crate::kernels::team;
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2};
use std::marker::PhantomData;

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

/// The forward pass that a backward pass differentiates: its input `x: B×D_in` and output
/// `y: B×D_out`.
#[derive(Debug, Clone, Copy)]
pub struct Io<'a> {
    pub x: ArrayView2<'a, f32>,
    pub y: ArrayView2<'a, f32>,
}

/// What a backward pass writes: `∂L/∂p` into `g`, the layer's part of the flat gradient buffer
/// (overwritten), and `∂L/∂x: B×D_in` into `dx` when the layer below needs it.
#[derive(Debug)]
pub struct Grads<'a> {
    pub g: ArrayViewMut1<'a, f32>,
    pub dx: Option<ArrayViewMut2<'a, f32>>,
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
    fn init(&self, _p: ArrayViewMut1<f32>, _rng: &mut Rng) {}
    /// `x: B×D_in → y: B×D_out`, with parameters `p`.
    fn forward(&mut self, p: ArrayView1<f32>, x: ArrayView2<f32>, y: ArrayViewMut2<f32>, pass: &Pass);
    /// Given the forward pass `io` and `dy = ∂L/∂y`, writes `∂L/∂p` and, when asked, `∂L/∂x`
    /// into `grads`.
    fn backward(&mut self, p: ArrayView1<f32>, io: Io, dy: ArrayView2<f32>, grads: Grads);
    /// True for a layer whose output is its input, reshaped (its forward and backward copy): a
    /// chain then skips it and hands the layer above the input's buffer itself.
    fn is_reshape(&self) -> bool {
        false
    }
}

/// The row-major floats behind a batch, for the kernels' slice entry points. Every batch the chain
/// hands out is one contiguous buffer, so this is a check, not a copy.
pub fn rows<'a>(v: ArrayView2<'a, f32>) -> &'a [f32] {
    v.to_slice().expect("a batch view is row-major and contiguous")
}
/// [`rows`] for an output.
pub fn rows_mut<'a>(v: ArrayViewMut2<'a, f32>) -> &'a mut [f32] {
    v.into_slice().expect("a batch view is row-major and contiguous")
}
/// The floats of a layer's parameters (or gradients): a contiguous part of the flat buffer.
pub fn flat<'a>(v: ArrayView1<'a, f32>) -> &'a [f32] {
    v.to_slice().expect("a parameter view is contiguous")
}
/// [`flat`] for a gradient.
pub fn flat_mut<'a>(v: ArrayViewMut1<'a, f32>) -> &'a mut [f32] {
    v.into_slice().expect("a parameter view is contiguous")
}

/// Asserts a forward pass's shapes (`x: b×d_in`, `y: b×d_out`) once at a layer's entry, and
/// returns `b`.
pub fn batch_of(kind: &str, x: &ArrayView2<f32>, y: &ArrayViewMut2<f32>, d_in: usize, d_out: usize) -> usize {
    let b = x.nrows();
    assert!(
        x.ncols() == d_in && y.dim() == (b, d_out),
        "{kind}: input {:?} and output {:?} for {d_in} → {d_out} features",
        x.dim(),
        y.dim()
    );
    b
}

/// Asserts a backward pass's shapes against its forward pass, and returns `b`.
pub fn batch_back(kind: &str, io: &Io, dy: &ArrayView2<f32>, dx: &Option<ArrayViewMut2<f32>>) -> usize {
    let b = io.x.nrows();
    assert!(
        io.y.nrows() == b && dy.dim() == io.y.dim() && dx.as_ref().is_none_or(|dx| dx.dim() == io.x.dim()),
        "{kind}: backward shapes x {:?}, y {:?}, dy {:?}",
        io.x.dim(),
        io.y.dim(),
        dy.dim()
    );
    b
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
    fn init(&self, mut p: ArrayViewMut1<f32>, rng: &mut Rng) {
        let bound = 1.0 / (self.inp as f32).sqrt();
        p.iter_mut().for_each(|v| *v = rng.uniform(bound));
    }
    fn forward(&mut self, p: ArrayView1<f32>, x: ArrayView2<f32>, y: ArrayViewMut2<f32>, _pass: &Pass) {
        let b = batch_of("linear", &x, &y, self.inp, self.out);
        let (w, bias) = flat(p).split_at(self.out * self.inp);
        let y = rows_mut(y);
        gemm(Trans::N, Trans::T, b, self.out, self.inp, 1.0, rows(x), w, 0.0, y);
        for row in y.chunks_exact_mut(self.out) {
            row.iter_mut().zip(bias).for_each(|(v, bb)| *v += bb);
        }
    }
    fn backward(&mut self, p: ArrayView1<f32>, io: Io, dy: ArrayView2<f32>, Grads { g, dx }: Grads) {
        let b = batch_back("linear", &io, &dy, &dx);
        let dy = rows(dy);
        let (gw, gb) = flat_mut(g).split_at_mut(self.out * self.inp);
        // dW (out×in) = dyᵀ (out×b) · x (b×in)
        gemm(Trans::T, Trans::N, self.out, self.inp, b, 1.0, dy, rows(io.x), 0.0, gw);
        column_sums(dy, gb);
        if let Some(dx) = dx {
            // dx (b×in) = dy (b×out) · W (out×in)
            let w = &flat(p)[..self.out * self.inp];
            gemm(Trans::N, Trans::N, b, self.inp, self.out, 1.0, dy, w, 0.0, rows_mut(dx));
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

/// A function applied to every element, and its derivative: what makes an element-wise layer.
pub trait Activation: Send + Sync + 'static {
    const KIND: &'static str;
    /// Whether `f'` is read from the forward pass's output `y` (else from its input `x`): the
    /// backward pass then streams one of them, not both.
    const FROM_OUTPUT: bool;
    /// `y = f(x)`.
    fn f(x: f32) -> f32;
    /// `∂x = ∂y · f'(x)`, given `y` if [`Activation::FROM_OUTPUT`], else `x`.
    fn df(dy: f32, v: f32) -> f32;
}

/// An element-wise layer, `B×D → B×D` with any per-sample shape: `y = f(x)`, `∂x = ∂y · f'(x)`.
#[derive(Debug, Clone)]
pub struct Elementwise<F> {
    pub shape: Vec<usize>,
    f: PhantomData<F>,
}

impl<F> Elementwise<F> {
    pub fn new(shape: Vec<usize>) -> Elementwise<F> {
        Elementwise { shape, f: PhantomData }
    }
}

/// `max(x, 0)`.
#[derive(Debug, Clone)]
pub struct Relu;
/// `tanh(x)`.
#[derive(Debug, Clone)]
pub struct Tanh;
/// SiLU (swish), `x·σ(x)`. Smooth, unlike relu: a rounding-level change of its input moves its
/// output and derivative by as little, with no kink to cross, so networks built on it keep
/// float-rounding differences (e.g. between two splits of a batch) small.
#[derive(Debug, Clone)]
pub struct Silu;

impl Activation for Relu {
    const KIND: &'static str = "relu";
    const FROM_OUTPUT: bool = true;
    fn f(x: f32) -> f32 {
        x.max(0.0)
    }
    fn df(dy: f32, y: f32) -> f32 {
        if y > 0.0 {
            dy
        } else {
            0.0
        }
    }
}

impl Activation for Tanh {
    const KIND: &'static str = "tanh";
    const FROM_OUTPUT: bool = true;
    fn f(x: f32) -> f32 {
        x.tanh()
    }
    fn df(dy: f32, y: f32) -> f32 {
        dy * (1.0 - y * y)
    }
}

impl Activation for Silu {
    const KIND: &'static str = "silu";
    const FROM_OUTPUT: bool = false;
    fn f(x: f32) -> f32 {
        x * sigmoid(x)
    }
    /// `∂x = ∂y · σ(x)·(1 + x·(1 − σ(x)))`.
    fn df(dy: f32, x: f32) -> f32 {
        let s = sigmoid(x);
        dy * s * (1.0 + x * (1.0 - s))
    }
}

/// Elements per team task of the element-wise layers (the inner loops vectorise).
const ELEMENTWISE_CHUNK: usize = 1 << 14;

impl<F: Activation> Layer for Elementwise<F> {
    fn kind(&self) -> &'static str {
        F::KIND
    }
    fn out_shape(&self) -> Vec<usize> {
        self.shape.clone()
    }
    fn forward(&mut self, _p: ArrayView1<f32>, x: ArrayView2<f32>, y: ArrayViewMut2<f32>, _pass: &Pass) {
        let d = self.shape.iter().product();
        batch_of(F::KIND, &x, &y, d, d);
        let (x, c) = (rows(x), ELEMENTWISE_CHUNK);
        team::zip_chunks_mut([rows_mut(y)], c, &|i, [y]| {
            y.iter_mut().zip(&x[i * c..]).for_each(|(y, &x)| *y = F::f(x));
        });
    }
    fn backward(&mut self, _p: ArrayView1<f32>, io: Io, dy: ArrayView2<f32>, Grads { dx, .. }: Grads) {
        batch_back(F::KIND, &io, &dy, &dx);
        let Some(dx) = dx else { return };
        let v = rows(if F::FROM_OUTPUT { io.y } else { io.x });
        let (dy, c) = (rows(dy), ELEMENTWISE_CHUNK);
        team::zip_chunks_mut([rows_mut(dx)], c, &|i, [dx]| {
            for ((dx, &dy), &v) in dx.iter_mut().zip(&dy[i * c..]).zip(&v[i * c..]) {
                *dx = F::df(dy, v);
            }
        });
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
    fn forward(&mut self, _p: ArrayView1<f32>, x: ArrayView2<f32>, mut y: ArrayViewMut2<f32>, _pass: &Pass) {
        batch_of("flatten", &x, &y, self.features, self.features);
        y.assign(&x);
    }
    fn backward(&mut self, _p: ArrayView1<f32>, io: Io, dy: ArrayView2<f32>, Grads { dx, .. }: Grads) {
        batch_back("flatten", &io, &dy, &dx);
        if let Some(mut dx) = dx {
            dx.assign(&dy);
        }
    }
}

/// Samples per team task in the per-sample layers (convolution, pooling, normalisation, dropout):
/// enough work per task to cover the hand-over, and fixed, so a convolution's weight gradient
/// (summed per task, then over tasks in order) does not depend on the number of threads.
pub const SAMPLES_PER_TASK: usize = 8;

/// Runs a layer on plain buffers of `b` rows (for unit tests written against known values).
#[cfg(test)]
pub(crate) trait OnSlices {
    fn fwd(&mut self, p: &[f32], x: &[f32], y: &mut [f32], b: usize, pass: &Pass);
    #[allow(clippy::too_many_arguments)]
    fn bwd(&mut self, p: &[f32], g: &mut [f32], x: &[f32], y: &[f32], dy: &[f32], dx: Option<&mut [f32]>, b: usize);
}

#[cfg(test)]
impl<L: Layer + ?Sized> OnSlices for L {
    fn fwd(&mut self, p: &[f32], x: &[f32], y: &mut [f32], b: usize, pass: &Pass) {
        let (d_in, d_out) = (x.len() / b, y.len() / b);
        let x = ArrayView2::from_shape((b, d_in), x).unwrap();
        self.forward(p.into(), x, ArrayViewMut2::from_shape((b, d_out), y).unwrap(), pass);
    }
    fn bwd(&mut self, p: &[f32], g: &mut [f32], x: &[f32], y: &[f32], dy: &[f32], dx: Option<&mut [f32]>, b: usize) {
        let (d_in, d_out) = (x.len() / b, y.len() / b);
        let io =
            Io { x: ArrayView2::from_shape((b, d_in), x).unwrap(), y: ArrayView2::from_shape((b, d_out), y).unwrap() };
        let dy = ArrayView2::from_shape((b, d_out), dy).unwrap();
        let dx = dx.map(|dx| ArrayViewMut2::from_shape((b, d_in), dx).unwrap());
        self.backward(p.into(), io, dy, Grads { g: g.into(), dx });
    }
}

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

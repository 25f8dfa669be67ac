//! Layers as explicit forward/backward pairs over row-major mini-batches.
//!
//! A mini-batch is `b` rows of per-sample features. A layer maps `B×D_in → B×D_out`; it reads its
//! parameters from its slice `p` of the model's flat parameter buffer and writes parameter gradients
//! into the matching slice `g` of the flat gradient buffer (overwriting: every parameter is used by
//! exactly one layer). The model owns the activation buffers and hands each layer its input `x` and
//! output `y`; layers that need more than that keep an explicit cache of their own.

use crate::gemm::{gemm, Trans};
use crate::rng::Rng;
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
    /// Named parameter tensors, in flat-buffer order (e.g. `weight [out,in]`, `bias [out]`).
    fn param_shapes(&self) -> Vec<(&'static str, Vec<usize>)> {
        Vec::new()
    }
    /// Writes initial parameters into `p` from the stream `rng`.
    fn init(&self, _p: &mut [f32], _rng: &mut Rng) {}
    /// `x: b×D_in → y: b×D_out`.
    fn forward(&mut self, p: &[f32], x: &[f32], y: &mut [f32], b: usize, pass: &Pass);
    /// Given `dy = ∂L/∂y`, writes `∂L/∂p` into `g` and, when asked, `∂L/∂x` into `dx`.
    fn backward(&mut self, p: &[f32], g: &mut [f32], io: Io, dy: &[f32], dx: Option<&mut [f32]>);
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
    fn param_shapes(&self) -> Vec<(&'static str, Vec<usize>)> {
        vec![("weight", vec![self.out, self.inp]), ("bias", vec![self.out])]
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
        // dbias = column sums of dy
        gb.fill(0.0);
        for row in dy.chunks_exact(self.out) {
            gb.iter_mut().zip(row).for_each(|(s, v)| *s += v);
        }
        if let Some(dx) = dx {
            // dx (b×in) = dy (b×out) · W (out×in)
            let w = &p[..self.out * self.inp];
            gemm(Trans::N, Trans::N, b, self.inp, self.out, 1.0, dy, w, 0.0, &mut dx[..b * self.inp]);
        }
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
        y[..n].iter_mut().zip(&x[..n]).for_each(|(y, &x)| *y = x.max(0.0));
    }
    fn backward(&mut self, _p: &[f32], _g: &mut [f32], io: Io, dy: &[f32], dx: Option<&mut [f32]>) {
        if let Some(dx) = dx {
            let n = io.b * self.shape.iter().product::<usize>();
            for ((dx, &dy), &y) in dx[..n].iter_mut().zip(&dy[..n]).zip(&io.y[..n]) {
                *dx = if y > 0.0 { dy } else { 0.0 };
            }
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

/// Reshapes `B×C×H×W` (any per-sample shape) to `B×(C·H·W)`; the data are already row-major.
#[derive(Debug, Clone)]
pub struct Flatten {
    pub features: usize,
}

impl Layer for Flatten {
    fn kind(&self) -> &'static str {
        "flatten"
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

//! A chain of layers applied in order, with the activation buffers between them.
//!
//! The model is one chain over the whole flat parameter buffer; a residual block holds two (its body
//! and its shortcut) over its own slice. A chain's parameters are its layers' parameters
//! concatenated in order, so nesting keeps the model's single flat buffer and its table the only
//! source of truth: a nested tensor is just a sub-slice, named with dots (`body.0.weight`).

use crate::data::rng::Rng;
use crate::nn::layers::{Grads, Io, Layer, Pass};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2};
use std::ops::Range;

/// `b` rows of `d` floats at the start of `buf`, as a batch view.
fn batch(buf: &[f32], b: usize, d: usize) -> ArrayView2<'_, f32> {
    ArrayView2::from_shape((b, d), &buf[..b * d]).expect("an activation buffer holds its batch")
}
fn batch_mut(buf: &mut [f32], b: usize, d: usize) -> ArrayViewMut2<'_, f32> {
    ArrayViewMut2::from_shape((b, d), &mut buf[..b * d]).expect("an activation buffer holds its batch")
}

pub struct Chain {
    layers: Vec<Box<dyn Layer>>,
    /// Each layer's range in the chain's parameter slice.
    ranges: Vec<Range<usize>>,
    /// Per-sample shape at each boundary: `shapes[0]` is the input, `shapes[n]` the output.
    shapes: Vec<Vec<usize>>,
    /// `acts[i]`: output of layer `i` (`capacity × |shapes[i + 1]|`); empty for a layer that only
    /// reshapes (see `home`).
    acts: Vec<Vec<f32>>,
    /// `dacts[i]`: `∂L/∂acts[i]` for `i < n − 1` (the last layer's comes from the caller).
    dacts: Vec<Vec<f32>>,
    /// Where layer `i`'s output lives: `Some(j)` in `acts[j]` (and its gradient in `dacts[j]`),
    /// `None` in the chain's input. A layer whose output is its input reshaped
    /// ([`Layer::is_reshape`], below the last layer) is never run: it lives where its input lives.
    home: Vec<Option<usize>>,
    capacity: usize,
}

impl Chain {
    /// Chains `layers` (each built for the previous one's output shape) on inputs of `input_shape`.
    pub fn new(input_shape: &[usize], layers: Vec<Box<dyn Layer>>) -> Chain {
        let mut shapes = vec![input_shape.to_vec()];
        let mut ranges = Vec::with_capacity(layers.len());
        let mut home = Vec::with_capacity(layers.len());
        let mut at = 0;
        for (i, l) in layers.iter().enumerate() {
            let n: usize = l.param_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
            ranges.push(at..at + n);
            at += n;
            shapes.push(l.out_shape());
            let aliased = l.is_reshape() && i + 1 < layers.len();
            home.push(if aliased { i.checked_sub(1).and_then(|j| home[j]) } else { Some(i) });
        }
        Chain { layers, ranges, shapes, acts: Vec::new(), dacts: Vec::new(), home, capacity: 0 }
    }

    pub fn len(&self) -> usize {
        self.layers.len()
    }
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
    pub fn input_shape(&self) -> &[usize] {
        &self.shapes[0]
    }
    pub fn out_shape(&self) -> &[usize] {
        self.shapes.last().expect("the input boundary")
    }
    /// Features per sample at the output.
    pub fn out_len(&self) -> usize {
        self.out_shape().iter().product()
    }
    /// Scalars of parameters of all layers.
    pub fn n_params(&self) -> usize {
        self.ranges.last().map_or(0, |r| r.end)
    }

    /// Named tensors of all layers in flat order: `{i}.{name}` for layer `i`.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            out.extend(l.param_shapes().into_iter().map(|(name, s)| (format!("{i}.{name}"), s)));
        }
        out
    }

    /// Initialises layer `i`'s parameters in `p` from the stream `stream(i)`.
    pub fn init(&self, mut p: ArrayViewMut1<f32>, mut stream: impl FnMut(usize) -> Rng) {
        for (i, l) in self.layers.iter().enumerate() {
            l.init(p.slice_mut(ndarray::s![self.ranges[i].clone()]), &mut stream(i));
        }
    }

    /// Features per sample at boundary `i` (`0` the input).
    fn width(&self, i: usize) -> usize {
        self.shapes[i].iter().product()
    }

    /// Sizes the activation buffers for batches of up to `cap` rows (only grows).
    pub fn reserve(&mut self, cap: usize) {
        if cap <= self.capacity {
            return;
        }
        self.capacity = cap;
        let n = self.layers.len();
        let home = &self.home;
        let zeros = |(i, s): (usize, &Vec<usize>)| match home[i] == Some(i) {
            true => vec![0.0; s.iter().product::<usize>() * cap],
            false => Vec::new(),
        };
        self.acts = self.shapes[1..].iter().enumerate().map(zeros).collect();
        self.dacts = self.shapes[1..n.max(1)].iter().enumerate().map(zeros).collect();
    }

    /// Output of the last forward pass, `b × out_len` (the chain must not be empty).
    pub fn output(&self, b: usize) -> ArrayView2<'_, f32> {
        batch(self.acts.last().expect("a non-empty chain"), b, self.out_len())
    }

    /// `x: b × |input| →` [`Chain::output`]; `p` is the chain's part of the parameters.
    pub fn forward(&mut self, p: ArrayView1<f32>, x: ArrayView2<f32>, pass: &Pass) {
        let b = x.nrows();
        assert!(!self.is_empty() && b <= self.capacity, "chain: empty, or batch {b} above capacity {}", self.capacity);
        assert_eq!((p.len(), x.ncols()), (self.n_params(), self.width(0)), "chain: parameters or input width");
        for i in 0..self.layers.len() {
            if self.home[i] != Some(i) {
                continue;
            }
            let (w_in, w_out) = (self.width(i), self.width(i + 1));
            let (done, rest) = self.acts.split_at_mut(i);
            let input = match i.checked_sub(1).and_then(|j| self.home[j]) {
                None => x,
                Some(j) => batch(&done[j], b, w_in),
            };
            let y = batch_mut(&mut rest[0], b, w_out);
            self.layers[i].forward(p.slice(ndarray::s![self.ranges[i].clone()]), input, y, pass);
        }
    }

    /// Backward through all layers from `dy = ∂L/∂output`: writes the parameter gradients into `g`
    /// (the chain's part of the gradients) and, when asked, `∂L/∂x` into `dx`. `x` is the input of
    /// the forward pass just run.
    pub fn backward(
        &mut self,
        p: ArrayView1<f32>,
        x: ArrayView2<f32>,
        dy: ArrayView2<f32>,
        mut g: ArrayViewMut1<f32>,
        mut dx: Option<ArrayViewMut2<f32>>,
    ) {
        let (n, b) = (self.layers.len(), x.nrows());
        assert!(n > 0 && g.len() == self.n_params(), "chain: empty, or wrong gradient slice");
        assert_eq!(dy.dim(), (b, self.out_len()), "chain: output gradient");
        // Without a requested `dx`, nothing below the first layer with parameters needs a gradient:
        // that layer skips its input gradient (for W1 a third of the work) and those below are skipped.
        let lowest = if dx.is_some() { 0 } else { self.ranges.iter().position(|r| !r.is_empty()).unwrap_or(n) };
        for i in (lowest..n).rev() {
            if self.home[i] != Some(i) {
                continue;
            }
            let below_home = i.checked_sub(1).and_then(|j| self.home[j]);
            let (w_in, w_out) = (self.width(i), self.width(i + 1));
            let io =
                Io { x: below_home.map_or(x, |j| batch(&self.acts[j], b, w_in)), y: batch(&self.acts[i], b, w_out) };
            let (below, here) = self.dacts.split_at_mut(i);
            let dy_i = if i == n - 1 { dy } else { batch(&here[0], b, w_out) };
            let dx_i = match below_home {
                _ if i > 0 && i == lowest => None,
                None => dx.take(),
                Some(j) => Some(batch_mut(&mut below[j], b, w_in)),
            };
            let r = self.ranges[i].clone();
            let (p_i, g_i) = (p.slice(ndarray::s![r.clone()]), g.slice_mut(ndarray::s![r]));
            self.layers[i].backward(p_i, io, dy_i, Grads { g: g_i, dx: dx_i });
        }
    }
}

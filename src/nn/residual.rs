//! Residual block (He et al., 2016): `y = f(x) + s(x)`.
//!
//! `f` (the body) is a chain of layers; `s` (the shortcut) is the identity or a chain of its own,
//! typically a strided 1×1 convolution (with a norm) when the body changes the shape. The activation
//! after the sum is not part of the block: a recipe follows it with `{ type = "relu" }`.
//!
//! ```text
//!     forward   y = f(x) + s(x)                        B×C×H×W → B×C'×H'×W'
//!     backward  ∂x = f'ᵀ(∂y) + s'ᵀ(∂y)                 (s'ᵀ(∂y) = ∂y for the identity)
//! ```
//!
//! Parameters are the body's then the shortcut's, inside the block's slice of the model's flat
//! buffer, named `body.{j}.{name}` and `shortcut.{j}.{name}` (in a model: `layers.3.body.0.weight`).

use crate::data::rng::Rng;
use crate::kernels::grow;
use crate::nn::chain::Chain;
use crate::nn::layers::{batch_back, batch_of, Grads, Io, Layer, Pass};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2, Axis};

pub struct Residual {
    pub body: Chain,
    /// Empty: the identity.
    pub shortcut: Chain,
    /// Scratch `∂L/∂x` through the shortcut, `b × |input|`.
    dx_short: Vec<f32>,
}

impl Residual {
    /// Panics unless the body and the shortcut map the same input to the same output shape (the
    /// model builder checks first).
    pub fn new(body: Chain, shortcut: Chain) -> Residual {
        let short_out = if shortcut.is_empty() { body.input_shape() } else { shortcut.out_shape() };
        assert!(!body.is_empty(), "residual: empty body");
        assert_eq!(body.input_shape(), shortcut.input_shape(), "residual: body and shortcut inputs differ");
        assert_eq!(body.out_shape(), short_out, "residual: body and shortcut outputs differ");
        Residual { body, shortcut, dx_short: Vec::new() }
    }
    fn in_len(&self) -> usize {
        self.body.input_shape().iter().product()
    }
}

impl Layer for Residual {
    fn kind(&self) -> &'static str {
        "residual"
    }
    fn out_shape(&self) -> Vec<usize> {
        self.body.out_shape().to_vec()
    }
    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let body = self.body.param_shapes().into_iter().map(|(n, s)| (format!("body.{n}"), s));
        let short = self.shortcut.param_shapes().into_iter().map(|(n, s)| (format!("shortcut.{n}"), s));
        body.chain(short).collect()
    }
    /// Each inner layer from its own stream, derived from the block's.
    fn init(&self, mut p: ArrayViewMut1<f32>, rng: &mut Rng) {
        let base = rng.next_u64();
        let (pb, ps) = p.view_mut().split_at(Axis(0), self.body.n_params());
        self.body.init(pb, |j| Rng::from_keys(&[base, 0, j as u64]));
        self.shortcut.init(ps, |j| Rng::from_keys(&[base, 1, j as u64]));
    }
    /// `x: B×C×H×W → y = f(x) + s(x): B×C'×H'×W'`.
    fn forward(&mut self, p: ArrayView1<f32>, x: ArrayView2<f32>, mut y: ArrayViewMut2<f32>, pass: &Pass) {
        let (il, ol) = (self.in_len(), self.body.out_len());
        let b = batch_of("residual", &x, &y, il, ol);
        let (pb, ps) = p.split_at(Axis(0), self.body.n_params());
        self.body.reserve(b);
        self.body.forward(pb, x, pass);
        y.assign(&self.body.output(b));
        let short = if self.shortcut.is_empty() {
            x
        } else {
            self.shortcut.reserve(b);
            self.shortcut.forward(ps, x, pass);
            self.shortcut.output(b)
        };
        y += &short;
    }
    /// `∂x = f'ᵀ(∂y) + s'ᵀ(∂y)`; parameter gradients of both branches.
    fn backward(&mut self, p: ArrayView1<f32>, io: Io, dy: ArrayView2<f32>, Grads { g, dx }: Grads) {
        let b = batch_back("residual", &io, &dy, &dx);
        let split = self.body.n_params();
        let (pb, ps) = p.split_at(Axis(0), split);
        let (gb, gs) = g.split_at(Axis(0), split);
        match dx {
            None => {
                self.body.backward(pb, io.x, dy, gb, None);
                if !self.shortcut.is_empty() {
                    self.shortcut.backward(ps, io.x, dy, gs, None);
                }
            }
            Some(mut dx) => {
                self.body.backward(pb, io.x, dy, gb, Some(dx.view_mut()));
                if self.shortcut.is_empty() {
                    dx += &dy;
                } else {
                    let il = self.in_len();
                    grow(&mut self.dx_short, b * il);
                    let mut through =
                        ArrayViewMut2::from_shape((b, il), &mut self.dx_short[..b * il]).expect("b × input");
                    self.shortcut.backward(ps, io.x, dy, gs, Some(through.view_mut()));
                    dx += &through;
                }
            }
        }
    }
}

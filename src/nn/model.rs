//! A sequential model over one flat parameter buffer and one flat gradient buffer.
//!
//! The model owns every activation buffer, sized once for its batch capacity, so a training step
//! allocates nothing: the trainer gathers a batch into [`Model::input_mut`], then
//! [`Model::forward_backward`] runs the layers' forward passes, the fused loss and the backward
//! passes in reverse, leaving `Σ_j ∂ℓ_j/∂θ · scale` in [`Model::grads`].
//!
//! Users see ndarray: [`Model::param`], [`Model::param_mut`] and [`Model::grad`] lend one tensor by
//! name as a view into the flat buffers, [`Model::params_named`] all of them, the batch goes in
//! through [`Model::input_mut`] (`b × sample shape`) and the logits come out of [`Model::logits`]
//! (`b × classes`). [`Model::save_safetensors`] and [`Model::load_safetensors`] write and read the
//! parameters under the same names.
//!
//! A recipe's `[model] layers` list is built here into a [`Chain`] of layers, checking every shape
//! first: an impossible recipe (a kernel larger than its input, channels not divisible into groups,
//! a residual body whose output does not match its shortcut) is an [`Error::Config`] naming the
//! field, e.g. `model.layers[3].layers[1].kernel`, never a panic.

use crate::data::rng::{mix64, Rng};
use crate::error::{Error, Result};
use crate::nn::chain::Chain;
use crate::nn::conv::{out_len, Conv2d};
use crate::nn::dropout::Dropout;
use crate::nn::layers::{Elementwise, Flatten, Layer, Linear, Mode, Pass, Relu, Silu, Tanh};
use crate::nn::loss::{Loss, LossStats};
use crate::nn::norm::GroupNorm;
use crate::nn::params::ParamTable;
use crate::nn::pool::{GlobalAvgPool, Pool2d, Reduce};
use crate::nn::residual::Residual;
use crate::nn::trainable::Trainable;
use ndarray::{ArrayView1, ArrayView2, ArrayViewD, ArrayViewMut1, ArrayViewMut2, ArrayViewMutD, Dimension, IxDyn};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One layer of a recipe's `[model] layers` list (`{ type = "conv2d", out_channels = 6, kernel = 5 }`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum LayerSpec {
    /// Fully connected, `B×in → B×out`; needs a flat input.
    Linear {
        out: usize,
    },
    Relu,
    Tanh,
    /// `x·σ(x)`, a smooth relu.
    Silu,
    /// `B×C×H×W → B×(C·H·W)`.
    Flatten,
    /// `B×C×H×W → B×O×H'×W'`, square kernel, `H' = (H + 2·padding − kernel)/stride + 1`.
    Conv2d {
        out_channels: usize,
        kernel: usize,
        #[serde(default = "one")]
        stride: usize,
        #[serde(default)]
        padding: usize,
    },
    /// Max over `kernel×kernel` windows, `stride` defaulting to `kernel`; no padding.
    MaxPool2d {
        kernel: usize,
        stride: Option<usize>,
    },
    /// Mean over `kernel×kernel` windows, `stride` defaulting to `kernel`; no padding.
    AvgPool2d {
        kernel: usize,
        stride: Option<usize>,
    },
    /// `B×C×H×W → B×C`: mean over the positions of each channel.
    GlobalAvgPool,
    /// Inverted dropout with drop probability `p`, masks keyed by `(seed, epoch, sample, layer)`.
    Dropout {
        p: f32,
    },
    /// Per-sample normalisation over `groups` groups of channels, affine per channel.
    GroupNorm {
        groups: usize,
    },
    /// `y = f(x) + s(x)`: `layers` is the body `f`; `shortcut` is `s`, the identity when empty.
    Residual {
        layers: Vec<LayerSpec>,
        #[serde(default)]
        shortcut: Vec<LayerSpec>,
    },
}

fn one() -> usize {
    1
}

/// The recipe's `[model]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub layers: Vec<LayerSpec>,
    pub loss: Loss,
}

/// Builds `specs` into a chain on inputs of `shape`. `field` is the recipe path of the list
/// (`model.layers`) and `path` the list's position in the model (empty at the top), from which
/// dropout layers derive their keys.
fn build(specs: &[LayerSpec], input: &[usize], field: &str, path: &[u64]) -> Result<Chain> {
    let mut shape = input.to_vec();
    let mut layers: Vec<Box<dyn Layer>> = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let at = format!("{field}[{i}]");
        let mut here = path.to_vec();
        here.push(i as u64);
        let layer = build_one(spec, &shape, &at, &here)?;
        shape = layer.out_shape();
        if shape.contains(&0) {
            return Err(Error::config(at, format!("outputs the empty shape {shape:?}")));
        }
        layers.push(layer);
    }
    Ok(Chain::new(input, layers))
}

/// The key of a dropout layer's mask stream: its index for a top-level layer, a hash of its path
/// (`[outer index, branch (0 body, 1 shortcut), inner index, …]`) for a nested one.
fn layer_key(path: &[u64]) -> u64 {
    match path {
        [i] => *i,
        _ => path.iter().fold(0x6E65_7374u64, |h, &k| mix64(h ^ mix64(k))),
    }
}

/// `[C, H, W]` or a config error naming `at`.
fn image(kind: &str, shape: &[usize], at: &str) -> Result<[usize; 3]> {
    match *shape {
        [c, h, w] => Ok([c, h, w]),
        _ => Err(Error::config(at, format!("{kind} needs input of shape [C, H, W] but gets {shape:?}"))),
    }
}

fn at_least_one(v: usize, field: String) -> Result<()> {
    if v == 0 {
        return Err(Error::config(field, "must be at least 1"));
    }
    Ok(())
}

/// Checks that a `kernel×kernel` window with `stride` and `padding` fits `[C, H, W]`.
fn window_fits(kind: &str, input: [usize; 3], kernel: usize, stride: usize, padding: usize, at: &str) -> Result<()> {
    at_least_one(kernel, format!("{at}.kernel"))?;
    at_least_one(stride, format!("{at}.stride"))?;
    let [_, h, w] = input;
    if out_len(h, kernel, stride, padding).is_none() || out_len(w, kernel, stride, padding).is_none() {
        return Err(Error::config(
            format!("{at}.kernel"),
            format!("{kind} kernel {kernel} is larger than its input {h}×{w} (plus 2×padding {padding})"),
        ));
    }
    Ok(())
}

fn build_one(spec: &LayerSpec, shape: &[usize], at: &str, path: &[u64]) -> Result<Box<dyn Layer>> {
    let feat: usize = shape.iter().product();
    Ok(match spec {
        LayerSpec::Linear { out } => {
            if shape.len() != 1 {
                return Err(Error::config(
                    at,
                    format!("linear needs flat input but gets shape {shape:?}; add {{ type = \"flatten\" }} before it"),
                ));
            }
            at_least_one(*out, format!("{at}.out"))?;
            Box::new(Linear { inp: feat, out: *out })
        }
        LayerSpec::Relu => Box::new(Elementwise::<Relu>::new(shape.to_vec())),
        LayerSpec::Silu => Box::new(Elementwise::<Silu>::new(shape.to_vec())),
        LayerSpec::Tanh => Box::new(Elementwise::<Tanh>::new(shape.to_vec())),
        LayerSpec::Flatten => Box::new(Flatten { features: feat }),
        LayerSpec::Conv2d { out_channels, kernel, stride, padding } => {
            let input = image("conv2d", shape, at)?;
            at_least_one(*out_channels, format!("{at}.out_channels"))?;
            window_fits("conv2d", input, *kernel, *stride, *padding, at)?;
            Box::new(Conv2d::new(input, *out_channels, *kernel, *stride, *padding))
        }
        LayerSpec::MaxPool2d { kernel, stride } | LayerSpec::AvgPool2d { kernel, stride } => {
            let max = matches!(spec, LayerSpec::MaxPool2d { .. });
            let kind = if max { "max-pool2d" } else { "avg-pool2d" };
            let input = image(kind, shape, at)?;
            let stride = stride.unwrap_or(*kernel);
            window_fits(kind, input, *kernel, stride, 0, at)?;
            if max {
                Box::new(Pool2d::new(Reduce::Max, input, *kernel, stride))
            } else {
                Box::new(Pool2d::new(Reduce::Mean, input, *kernel, stride))
            }
        }
        LayerSpec::GlobalAvgPool => {
            if shape.len() < 2 {
                return Err(Error::config(at, format!("global-avg-pool needs input [C, H, W] but gets {shape:?}")));
            }
            Box::new(GlobalAvgPool { input: shape.to_vec() })
        }
        LayerSpec::Dropout { p } => {
            if !(0.0..1.0).contains(p) {
                return Err(Error::config(format!("{at}.p"), format!("must be in [0, 1), got {p}")));
            }
            Box::new(Dropout::new(*p, shape.to_vec(), layer_key(path)))
        }
        LayerSpec::GroupNorm { groups } => {
            at_least_one(*groups, format!("{at}.groups"))?;
            let c = shape[0];
            if shape.len() < 2 || !c.is_multiple_of(*groups) {
                return Err(Error::config(
                    format!("{at}.groups"),
                    format!("group-norm needs input [C, H, W] with C divisible by groups, but gets {shape:?} and {groups} groups"),
                ));
            }
            Box::new(GroupNorm::new(*groups, shape.to_vec()))
        }
        LayerSpec::Residual { layers, shortcut } => Box::new(residual(layers, shortcut, shape, at, path)?),
    })
}

/// A residual block: its body and shortcut built on `shape`, their output shapes checked equal.
fn residual(layers: &[LayerSpec], shortcut: &[LayerSpec], shape: &[usize], at: &str, path: &[u64]) -> Result<Residual> {
    if layers.is_empty() {
        return Err(Error::config(format!("{at}.layers"), "a residual body needs at least one layer"));
    }
    let branch = |k: u64| [path, &[k]].concat();
    let body = build(layers, shape, &format!("{at}.layers"), &branch(0))?;
    let short = build(shortcut, shape, &format!("{at}.shortcut"), &branch(1))?;
    let short_out = if short.is_empty() { shape } else { short.out_shape() };
    if body.out_shape() != short_out {
        return Err(Error::config(
            at,
            format!(
                "the residual body outputs {:?} but the shortcut gives {short_out:?}; give the block a \
                 `shortcut` that matches, e.g. [{{ type = \"conv2d\", out_channels = {}, kernel = 1, stride = 2 }}]",
                body.out_shape(),
                body.out_shape()[0]
            ),
        ));
    }
    Ok(Residual::new(body, short))
}

pub struct Model {
    pub table: ParamTable,
    /// All parameters, laid out by `table`.
    pub params: Vec<f32>,
    /// `∂L/∂params` of the last backward pass, same layout.
    pub grads: Vec<f32>,
    pub loss: Loss,
    chain: Chain,
    /// `capacity × input_dim` input rows.
    input: Vec<f32>,
    /// `capacity × output_dim`: `scale · ∂ℓ/∂logits` from the loss.
    dlogits: Vec<f32>,
    labels: Vec<u32>,
    ids: Vec<usize>,
    capacity: usize,
    classes: usize,
}

impl Model {
    /// Builds the layers for samples of `sample_shape`, checks the output width against the loss,
    /// and initialises parameters deterministically from `seed` (layer `i` from stream
    /// `[seed, 0x1417, i]`; a block derives its inner layers' streams from its own).
    pub fn new(spec: &ModelSpec, sample_shape: &[usize], classes: usize, seed: u64) -> Result<Model> {
        if spec.layers.is_empty() {
            return Err(Error::config("model.layers", "needs at least one layer"));
        }
        let chain = build(&spec.layers, sample_shape, "model.layers", &[])?;
        let want = spec.loss.outputs(classes);
        if chain.out_shape() != [want] {
            return Err(Error::config(
                "model.layers",
                format!(
                    "the last layer outputs shape {:?} but loss {:?} on {classes} classes needs [{want}]",
                    chain.out_shape(),
                    spec.loss
                ),
            ));
        }
        let mut table = ParamTable::default();
        for (name, shape) in chain.param_shapes() {
            table.push(format!("layers.{name}"), &shape);
        }
        debug_assert_eq!(table.len(), chain.n_params());
        let mut params = vec![0.0; table.len()];
        chain.init(ArrayViewMut1::from(&mut params[..]), |i| Rng::from_keys(&[seed, 0x1417, i as u64]));
        let grads = vec![0.0; table.len()];
        let mut m = Model {
            table,
            params,
            grads,
            loss: spec.loss,
            chain,
            input: Vec::new(),
            dlogits: Vec::new(),
            labels: Vec::new(),
            ids: Vec::new(),
            capacity: 0,
            classes,
        };
        m.set_capacity(1);
        Ok(m)
    }

    /// Sizes the activation buffers for batches of up to `cap` rows (only grows).
    pub fn set_capacity(&mut self, cap: usize) {
        if cap <= self.capacity {
            return;
        }
        self.capacity = cap;
        self.chain.reserve(cap);
        self.input = vec![0.0; self.input_dim() * cap];
        self.dlogits = vec![0.0; self.output_dim() * cap];
        self.labels = vec![0; cap];
        self.ids = vec![0; cap];
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn input_dim(&self) -> usize {
        self.chain.input_shape().iter().product()
    }
    pub fn output_dim(&self) -> usize {
        self.chain.out_len()
    }

    /// Buffers for a batch of `b` samples: the inputs as a `b × sample shape` view (`b×C×H×W` for
    /// images, `b×D` for feature vectors), in standard layout so that `as_slice_mut` gives its rows;
    /// the labels; and the samples' dataset indices (keys of per-sample randomness such as dropout).
    pub fn input_mut(&mut self, b: usize) -> (ArrayViewMutD<'_, f32>, &mut [u32], &mut [usize]) {
        assert!(b <= self.capacity, "batch {b} exceeds model capacity {}", self.capacity);
        let sample = self.chain.input_shape();
        // Built in place rather than collected: an `IxDyn` of up to four axes lives inline, which
        // keeps the training step free of allocations (tests/alloc.rs).
        let mut shape = IxDyn::zeros(1 + sample.len());
        shape[0] = b;
        shape.slice_mut()[1..].copy_from_slice(sample);
        let d = self.input_dim();
        let x = ArrayViewMutD::from_shape(shape, &mut self.input[..b * d]).expect("b rows of the input's shape");
        (x, &mut self.labels[..b], &mut self.ids[..b])
    }

    /// Logits of the last forward pass (`b × output_dim`).
    pub fn logits(&self, b: usize) -> ArrayView2<'_, f32> {
        self.chain.output(b)
    }

    /// Parameter `name` (as listed in [`Model::table`], e.g. `layers.1.weight`) as a view of its
    /// shape into [`Model::params`].
    pub fn param(&self, name: &str) -> Result<ArrayViewD<'_, f32>> {
        self.table.view(&self.params, name)
    }

    /// Parameter `name` as a mutable view: writes change the model.
    pub fn param_mut(&mut self, name: &str) -> Result<ArrayViewMutD<'_, f32>> {
        self.table.view_mut(&mut self.params, name)
    }

    /// The gradient of parameter `name` from the last backward pass, shaped like the parameter.
    pub fn grad(&self, name: &str) -> Result<ArrayViewD<'_, f32>> {
        self.table.view(&self.grads, name)
    }

    /// Every parameter with its name, in table order.
    pub fn params_named(&self) -> impl Iterator<Item = (&str, ArrayViewD<'_, f32>)> {
        self.table.views(&self.params)
    }

    /// Every parameter with its name, mutably (to initialise or edit them by name).
    pub fn params_named_mut(&mut self) -> impl Iterator<Item = (&str, ArrayViewMutD<'_, f32>)> {
        self.table.views_mut(&mut self.params)
    }

    /// Every parameter's gradient with the parameter's name, in table order.
    pub fn grads_named(&self) -> impl Iterator<Item = (&str, ArrayViewD<'_, f32>)> {
        self.table.views(&self.grads)
    }

    /// Writes the parameters as the safetensors file `path`, one F32 tensor per parameter under its
    /// name (the format of a checkpoint's `model.safetensors`).
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        self.table.write_safetensors(path.as_ref(), &[("", &self.params)])
    }

    /// Reads the parameters from the safetensors file `path`. The file must hold exactly this
    /// model's tensors by name, as F32 in their shapes; otherwise the model is left unchanged and
    /// the error names the file, the tensor and what is wrong.
    pub fn load_safetensors(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let params = self.table.read_safetensors(path.as_ref(), &[""])?.remove(0);
        self.params.copy_from_slice(&params);
        Ok(())
    }

    fn forward_layers(&mut self, b: usize, mode: Mode) {
        assert!(b <= self.capacity, "batch {b} exceeds model capacity {}", self.capacity);
        let (x, pass) = (rows_of(&self.input, b, self.input_dim()), Pass { mode, sample_ids: &self.ids[..b] });
        self.chain.forward(ArrayView1::from(&self.params[..]), x, &pass);
    }

    /// Forward pass over the `b` rows in the input buffers; returns the loss sum and correct count.
    pub fn forward(&mut self, b: usize, mode: Mode) -> LossStats {
        self.forward_layers(b, mode);
        self.loss.evaluate(self.chain.output(b), &self.labels[..b], 1.0, None)
    }

    /// Forward and backward over `b` rows: `grads = scale · Σ_rows ∂ℓ/∂θ`.
    ///
    /// With `b == 0` (a rank given no samples this iteration) the gradient is zero.
    pub fn forward_backward(&mut self, b: usize, scale: f32, mode: Mode) -> LossStats {
        if b == 0 {
            self.grads.fill(0.0);
            return LossStats::default();
        }
        self.forward_layers(b, mode);
        let w = self.output_dim();
        let mut dlogits = ArrayViewMut2::from_shape((b, w), &mut self.dlogits[..b * w]).expect("b × classes");
        let stats = self.loss.evaluate(self.chain.output(b), &self.labels[..b], scale, Some(dlogits.view_mut()));
        let (p, x) =
            (ArrayView1::from(&self.params[..]), rows_of(&self.input, b, self.chain.input_shape().iter().product()));
        self.chain.backward(p, x, dlogits.view(), ArrayViewMut1::from(&mut self.grads[..]), None);
        stats
    }
}

/// What `Run` needs of a model: the methods above.
impl Trainable for Model {
    fn table(&self) -> &ParamTable {
        &self.table
    }
    fn params(&self) -> &[f32] {
        &self.params
    }
    fn grads(&self) -> &[f32] {
        &self.grads
    }
    fn buffers_mut(&mut self) -> (&ParamTable, &mut Vec<f32>, &mut Vec<f32>) {
        (&self.table, &mut self.params, &mut self.grads)
    }
    fn sample_shape(&self) -> &[usize] {
        self.chain.input_shape()
    }
    fn classes(&self) -> usize {
        self.classes
    }
    fn capacity(&self) -> usize {
        self.capacity
    }
    fn set_capacity(&mut self, cap: usize) {
        Model::set_capacity(self, cap)
    }
    fn input_mut(&mut self, b: usize) -> (ArrayViewMutD<'_, f32>, &mut [u32], &mut [usize]) {
        Model::input_mut(self, b)
    }
    fn forward_backward(&mut self, b: usize, scale: f32, mode: Mode) -> LossStats {
        Model::forward_backward(self, b, scale, mode)
    }
    fn forward(&mut self, b: usize, mode: Mode) -> LossStats {
        Model::forward(self, b, mode)
    }
    fn logits(&self, b: usize) -> ArrayView2<'_, f32> {
        Model::logits(self, b)
    }
}

/// The first `b` rows of `d` floats of a row-major buffer, as a batch.
fn rows_of(buf: &[f32], b: usize, d: usize) -> ArrayView2<'_, f32> {
    ArrayView2::from_shape((b, d), &buf[..b * d]).expect("the buffer holds its batch")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mlp() -> ModelSpec {
        ModelSpec {
            layers: vec![
                LayerSpec::Flatten,
                LayerSpec::Linear { out: 5 },
                LayerSpec::Tanh,
                LayerSpec::Linear { out: 3 },
            ],
            loss: Loss::SoftmaxCrossEntropy,
        }
    }

    #[test]
    fn table_names_and_sizes() {
        let m = Model::new(&mlp(), &[1, 2, 2], 3, 1).unwrap();
        let names: Vec<_> = m.table.entries().iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["layers.1.weight", "layers.1.bias", "layers.3.weight", "layers.3.bias"]);
        assert_eq!(m.params.len(), 5 * 4 + 5 + 3 * 5 + 3);
    }

    #[test]
    fn parameters_and_gradients_are_views_of_the_flat_buffers_by_name() {
        let mut m = Model::new(&mlp(), &[1, 2, 2], 3, 1).unwrap();
        let e = m.table.get("layers.3.weight").unwrap().clone();
        let w = m.param("layers.3.weight").unwrap();
        assert_eq!(w.shape(), [3, 5]);
        assert_eq!(w[[2, 1]], m.params[e.offset + 2 * 5 + 1]);
        m.param_mut("layers.3.bias").unwrap()[[1]] = 0.75;
        assert_eq!(m.params[e.offset + 15 + 1], 0.75);
        m.grads[e.offset + 7] = 2.5;
        assert_eq!(m.grad("layers.3.weight").unwrap()[[1, 2]], 2.5);
        let err = m.param("layers.2.weight").unwrap_err().to_string();
        assert!(err.contains("`layers.2.weight`") && err.contains("`layers.1.weight` [5, 4]"), "{err}");
        assert!(m.grad("nope").is_err() && m.param_mut("").is_err());
    }

    #[test]
    fn named_iteration_gives_every_tensor_in_table_order() {
        let mut m = Model::new(&mlp(), &[1, 2, 2], 3, 1).unwrap();
        for (name, mut g) in m.table.views_mut(&mut m.grads) {
            g.fill(if name.ends_with("bias") { 1.0 } else { 0.0 });
        }
        let params: Vec<(&str, Vec<usize>)> = m.params_named().map(|(n, v)| (n, v.shape().to_vec())).collect();
        let grads: Vec<(&str, f32)> = m.grads_named().map(|(n, g)| (n, g.sum())).collect();
        assert_eq!(
            params,
            [
                ("layers.1.weight", vec![5, 4]),
                ("layers.1.bias", vec![5]),
                ("layers.3.weight", vec![3, 5]),
                ("layers.3.bias", vec![3])
            ]
        );
        assert_eq!(
            grads,
            [("layers.1.weight", 0.0), ("layers.1.bias", 5.0), ("layers.3.weight", 0.0), ("layers.3.bias", 3.0)]
        );
        for (_, mut p) in m.params_named_mut() {
            p.fill(0.0);
        }
        assert!(m.params.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn a_batch_goes_in_by_sample_shape_and_logits_come_out_b_by_classes() {
        let mut m = Model::new(&mlp(), &[1, 2, 2], 3, 1).unwrap();
        m.set_capacity(4);
        let (mut x, y, _) = m.input_mut(2);
        assert_eq!(x.shape(), [2, 1, 2, 2]);
        x.slice_mut(ndarray::s![1, .., .., ..]).fill(1.0);
        y.copy_from_slice(&[0, 2]);
        assert_eq!(m.input[..8], [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
        let stats = m.forward(2, Mode { train: false, seed: 0, epoch: 0 });
        let logits = m.logits(2);
        assert_eq!(logits.dim(), (2, 3));
        // Row 0 saw zeros: its logits are the last layer's bias after tanh(first bias).
        let vector = |name: &str| m.param(name).unwrap().into_dimensionality::<ndarray::Ix1>().unwrap();
        let w = m.param("layers.3.weight").unwrap().into_dimensionality::<ndarray::Ix2>().unwrap();
        let want = w.dot(&vector("layers.1.bias").mapv(f32::tanh)) + vector("layers.3.bias");
        for (got, want) in logits.row(0).iter().zip(&want) {
            assert!((got - want).abs() < 1e-6, "{logits} vs {want}");
        }
        let loss = |r: usize| {
            let row = logits.row(r);
            let lse = row.mapv(|v| (v as f64).exp()).sum().ln();
            lse - row[[0, 2][r]] as f64
        };
        assert!((stats.loss_sum - loss(0) - loss(1)).abs() < 1e-5, "{stats:?}");
    }

    #[test]
    fn safetensors_round_trip_by_name_and_refuse_another_model() {
        let dir = std::env::temp_dir().join(format!("lbbsp-model-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mlp.safetensors");
        let mut a = Model::new(&mlp(), &[1, 2, 2], 3, 1).unwrap();
        a.param_mut("layers.3.bias").unwrap().fill(0.25);
        a.save_safetensors(&path).unwrap();
        let mut b = Model::new(&mlp(), &[1, 2, 2], 3, 2).unwrap();
        assert_ne!(a.params, b.params);
        b.load_safetensors(&path).unwrap();
        assert_eq!(a.params, b.params);
        // Wider first layer: same names, another shape; the model stays as it was.
        let mut wide = Model::new(&mlp(), &[1, 3, 2], 3, 1).unwrap();
        let before = wide.params.clone();
        let e = wide.load_safetensors(&path).unwrap_err().to_string();
        assert!(e.contains("mlp.safetensors") && e.contains("`layers.1.weight` has shape [5, 4]"), "{e}");
        assert_eq!(wide.params, before);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn wrong_output_width_names_the_field() {
        let err = Model::new(&mlp(), &[4], 10, 1).err().unwrap().to_string();
        assert!(err.contains("model.layers") && err.contains("[10]"), "{err}");
    }

    #[test]
    fn initialisation_is_deterministic_in_the_seed() {
        let a = Model::new(&mlp(), &[4], 3, 7).unwrap();
        let b = Model::new(&mlp(), &[4], 3, 7).unwrap();
        let c = Model::new(&mlp(), &[4], 3, 8).unwrap();
        assert_eq!(a.params, b.params);
        assert_ne!(a.params, c.params);
    }

    fn parse(layers: &str) -> ModelSpec {
        toml::from_str(&format!("loss = \"softmax-cross-entropy\"\nlayers = {layers}"))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    const RESNETISH: &str = r#"[
        { type = "conv2d", out_channels = 4, kernel = 3, padding = 1 },
        { type = "residual", layers = [
            { type = "conv2d", out_channels = 8, kernel = 3, stride = 2, padding = 1 },
            { type = "group-norm", groups = 2 },
            { type = "dropout", p = 0.1 },
        ], shortcut = [{ type = "conv2d", out_channels = 8, kernel = 1, stride = 2 }] },
        { type = "relu" },
        { type = "max-pool2d", kernel = 1 },
        { type = "global-avg-pool" },
        { type = "linear", out = 3 },
    ]"#;

    #[test]
    fn nested_parameters_have_dotted_names_in_one_flat_buffer() {
        let m = Model::new(&parse(RESNETISH), &[1, 6, 6], 3, 1).unwrap();
        let names: Vec<_> = m.table.entries().iter().map(|e| (e.name.as_str(), e.shape.clone())).collect();
        assert_eq!(
            names,
            [
                ("layers.0.weight", vec![4, 1, 3, 3]),
                ("layers.0.bias", vec![4]),
                ("layers.1.body.0.weight", vec![8, 4, 3, 3]),
                ("layers.1.body.0.bias", vec![8]),
                ("layers.1.body.1.weight", vec![8]),
                ("layers.1.body.1.bias", vec![8]),
                ("layers.1.shortcut.0.weight", vec![8, 4, 1, 1]),
                ("layers.1.shortcut.0.bias", vec![8]),
                ("layers.5.weight", vec![3, 8]),
                ("layers.5.bias", vec![3]),
            ]
        );
        assert_eq!(m.params.len(), m.table.len());
        // GroupNorm starts at γ = 1, β = 0.
        let gamma = m.table.get("layers.1.body.1.weight").unwrap().range();
        assert!(m.params[gamma].iter().all(|&v| v == 1.0));
    }

    #[test]
    fn layer_specs_round_trip_through_toml() {
        let spec = parse(RESNETISH);
        let text = toml::to_string(&spec).unwrap();
        assert_eq!(toml::from_str::<ModelSpec>(&text).unwrap(), spec);
        let conv = &parse(r#"[{ type = "conv2d", out_channels = 2, kernel = 3 }]"#).layers[0];
        assert_eq!(*conv, LayerSpec::Conv2d { out_channels: 2, kernel: 3, stride: 1, padding: 0 });
        let bad = toml::from_str::<ModelSpec>("loss = \"softmax-cross-entropy\"\nlayers = [{ type = \"conv2d\", out_channels = 2, kernel = 3, dilation = 2 }]");
        assert!(bad.unwrap_err().to_string().contains("dilation"));
    }

    #[test]
    fn impossible_shapes_are_config_errors_naming_the_field() {
        let err = |layers: &str, shape: &[usize]| {
            Model::new(&parse(layers), shape, 3, 1).err().expect("an error").to_string()
        };
        let e = err(
            r#"[{ type = "conv2d", out_channels = 2, kernel = 5 }, { type = "flatten" }, { type = "linear", out = 3 }]"#,
            &[1, 3, 3],
        );
        assert!(e.contains("model.layers[0].kernel") && e.contains("larger"), "{e}");
        let e = err(
            r#"[{ type = "max-pool2d", kernel = 4 }, { type = "flatten" }, { type = "linear", out = 3 }]"#,
            &[1, 3, 3],
        );
        assert!(e.contains("model.layers[0].kernel"), "{e}");
        let e = err(r#"[{ type = "conv2d", out_channels = 2, kernel = 3 }]"#, &[9]);
        assert!(e.contains("model.layers[0]") && e.contains("[C, H, W]"), "{e}");
        let e = err(
            r#"[{ type = "group-norm", groups = 4 }, { type = "flatten" }, { type = "linear", out = 3 }]"#,
            &[6, 2, 2],
        );
        assert!(e.contains("model.layers[0].groups") && e.contains("divisible"), "{e}");
        let e = err(r#"[{ type = "dropout", p = 1.0 }, { type = "linear", out = 3 }]"#, &[4]);
        assert!(e.contains("model.layers[0].p"), "{e}");
        let e = err(r#"[{ type = "conv2d", out_channels = 2, kernel = 1, stride = 0 }]"#, &[1, 3, 3]);
        assert!(e.contains("model.layers[0].stride"), "{e}");
        let nested = r#"[{ type = "residual", layers = [{ type = "conv2d", out_channels = 1, kernel = 9 }] }]"#;
        let e = err(nested, &[1, 3, 3]);
        assert!(e.contains("model.layers[0].layers[0].kernel"), "{e}");
        let mismatch = r#"[{ type = "residual", layers = [{ type = "conv2d", out_channels = 2, kernel = 3, stride = 2, padding = 1 }] }]"#;
        let e = err(mismatch, &[1, 4, 4]);
        assert!(e.contains("model.layers[0]") && e.contains("shortcut") && e.contains("[2, 2, 2]"), "{e}");
    }

    #[test]
    fn dropout_keys_are_the_index_at_the_top_and_distinct_when_nested() {
        assert_eq!(layer_key(&[4]), 4);
        assert_ne!(layer_key(&[1, 0, 2]), layer_key(&[1, 1, 2]));
        assert_ne!(layer_key(&[1, 0, 2]), layer_key(&[2, 0, 1]));
    }
}

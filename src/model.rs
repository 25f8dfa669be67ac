//! A sequential model over one flat parameter buffer and one flat gradient buffer.
//!
//! The model owns every activation buffer, sized once for its batch capacity, so a training step
//! allocates nothing: the trainer gathers a batch into [`Model::input_mut`], then
//! [`Model::forward_backward`] runs the layers' forward passes, the fused loss and the backward
//! passes in reverse, leaving `Σ_j ∂ℓ_j/∂θ · scale` in [`Model::grads`].

use crate::error::{Error, Result};
use crate::layers::{Flatten, Io, Layer, Linear, Mode, Pass, Relu, Tanh};
use crate::loss::{Loss, LossStats};
use crate::params::ParamTable;
use crate::rng::Rng;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// One layer of a recipe's `[model] layers` list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum LayerSpec {
    Linear { out: usize },
    Relu,
    Tanh,
    Flatten,
}

/// The recipe's `[model]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub layers: Vec<LayerSpec>,
    pub loss: Loss,
}

pub struct Model {
    pub table: ParamTable,
    /// All parameters, laid out by `table`.
    pub params: Vec<f32>,
    /// `∂L/∂params` of the last backward pass, same layout.
    pub grads: Vec<f32>,
    pub loss: Loss,
    layers: Vec<Box<dyn Layer>>,
    ranges: Vec<Range<usize>>,
    /// Features per sample at each layer boundary; `dims[0]` is the input.
    dims: Vec<usize>,
    acts: Vec<Vec<f32>>,
    dacts: Vec<Vec<f32>>,
    labels: Vec<u32>,
    ids: Vec<usize>,
    capacity: usize,
}

impl Model {
    /// Builds the layers for samples of `sample_shape`, checks the output width against the loss,
    /// and initialises parameters deterministically from `seed` (tensor `k` from stream `[seed, k]`).
    pub fn new(spec: &ModelSpec, sample_shape: &[usize], classes: usize, seed: u64) -> Result<Model> {
        let mut shape = sample_shape.to_vec();
        let mut layers: Vec<Box<dyn Layer>> = Vec::new();
        for (i, l) in spec.layers.iter().enumerate() {
            let feat: usize = shape.iter().product();
            let layer: Box<dyn Layer> = match l {
                LayerSpec::Linear { out } => {
                    if shape.len() != 1 {
                        return Err(Error::config(
                            format!("model.layers[{i}]"),
                            format!("linear needs flat input but gets shape {shape:?}; add {{ type = \"flatten\" }} before it"),
                        ));
                    }
                    if *out == 0 {
                        return Err(Error::config(format!("model.layers[{i}].out"), "must be at least 1"));
                    }
                    Box::new(Linear { inp: feat, out: *out })
                }
                LayerSpec::Relu => Box::new(Relu { shape: shape.clone() }),
                LayerSpec::Tanh => Box::new(Tanh { shape: shape.clone() }),
                LayerSpec::Flatten => Box::new(Flatten { features: feat }),
            };
            shape = layer.out_shape();
            layers.push(layer);
        }
        let want = spec.loss.outputs(classes);
        if shape != [want] {
            return Err(Error::config(
                "model.layers",
                format!("the last layer outputs shape {shape:?} but loss {:?} on {classes} classes needs [{want}]", spec.loss),
            ));
        }
        let mut table = ParamTable::default();
        let mut ranges = Vec::new();
        let mut dims = vec![sample_shape.iter().product()];
        for (i, l) in layers.iter().enumerate() {
            let start = table.len();
            for (name, sh) in l.param_shapes() {
                table.push(format!("layers.{i}.{name}"), &sh);
            }
            ranges.push(start..table.len());
            dims.push(l.out_shape().iter().product());
        }
        let mut params = vec![0.0; table.len()];
        for (i, l) in layers.iter().enumerate() {
            let mut rng = Rng::from_keys(&[seed, 0x1417, i as u64]);
            l.init(&mut params[ranges[i].clone()], &mut rng);
        }
        let grads = vec![0.0; table.len()];
        let mut m = Model {
            table,
            params,
            grads,
            loss: spec.loss,
            layers,
            ranges,
            dims,
            acts: Vec::new(),
            dacts: Vec::new(),
            labels: Vec::new(),
            ids: Vec::new(),
            capacity: 0,
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
        self.acts = self.dims.iter().map(|d| vec![0.0; d * cap]).collect();
        self.dacts = self.dims.iter().map(|d| vec![0.0; d * cap]).collect();
        self.labels = vec![0; cap];
        self.ids = vec![0; cap];
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn input_dim(&self) -> usize {
        self.dims[0]
    }
    pub fn output_dim(&self) -> usize {
        *self.dims.last().expect("at least the input boundary")
    }

    /// Buffers for a batch of `b` rows: inputs (`b × input_dim`), labels and dataset indices.
    pub fn input_mut(&mut self, b: usize) -> (&mut [f32], &mut [u32], &mut [usize]) {
        assert!(b <= self.capacity, "batch {b} exceeds model capacity {}", self.capacity);
        let d = self.dims[0];
        (&mut self.acts[0][..b * d], &mut self.labels[..b], &mut self.ids[..b])
    }

    /// Logits of the last forward pass (`b × output_dim`).
    pub fn logits(&self, b: usize) -> &[f32] {
        &self.acts[self.layers.len()][..b * self.output_dim()]
    }

    fn forward_layers(&mut self, b: usize, mode: Mode) {
        assert!(b <= self.capacity, "batch {b} exceeds model capacity {}", self.capacity);
        let pass = Pass {
            mode,
            sample_ids: &self.ids[..b],
        };
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let (lo, hi) = self.acts.split_at_mut(i + 1);
            layer.forward(&self.params[self.ranges[i].clone()], &lo[i], &mut hi[0], b, &pass);
        }
    }

    /// Forward pass over the `b` rows in the input buffers; returns the loss sum and correct count.
    pub fn forward(&mut self, b: usize, mode: Mode) -> LossStats {
        self.forward_layers(b, mode);
        let w = self.output_dim();
        self.loss.evaluate(self.logits(b), &self.labels[..b], w, 1.0, None)
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
        let n = self.layers.len();
        let w = self.output_dim();
        let stats = self.loss.evaluate(&self.acts[n][..b * w], &self.labels[..b], w, scale, Some(&mut self.dacts[n]));
        for i in (0..n).rev() {
            let (dlo, dhi) = self.dacts.split_at_mut(i + 1);
            let io = Io {
                x: &self.acts[i],
                y: &self.acts[i + 1],
                b,
            };
            let dx = if i > 0 { Some(&mut dlo[i][..]) } else { None };
            let r = self.ranges[i].clone();
            self.layers[i].backward(&self.params[r.clone()], &mut self.grads[r], io, &dhi[0], dx);
        }
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mlp() -> ModelSpec {
        ModelSpec {
            layers: vec![LayerSpec::Flatten, LayerSpec::Linear { out: 5 }, LayerSpec::Tanh, LayerSpec::Linear { out: 3 }],
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
}

//! What a training run needs of a model: [`Trainable`]. The crate's [`Model`](crate::nn::model::Model)
//! is one; a model written in the user's own crate can be another, and then trains under
//! [`Run`](crate::train::Run) like a recipe's: data-parallel over MPI, balanced by LB-BSP,
//! checkpointed and resumed under its own parameter names.
//!
//! The model keeps its parameters in one flat buffer and their gradients in another, laid out by a
//! [`ParamTable`] (`{name, shape, offset}`), so that the run's one allreduce, one optimizer loop and
//! one checkpoint slice cover every tensor. Everything else a user sees is ndarray: the batch goes
//! in through [`Trainable::input_mut`] as a `b × sample shape` view, the logits come out of
//! [`Trainable::logits`] as `b × outputs`, and any parameter or gradient is lent by name as an
//! `ArrayViewD` ([`Trainable::param`], [`Trainable::grad`]), a default method over the table.
//!
//! A training step calls, in order: [`Trainable::input_mut`] (the data gatherer fills the rows,
//! labels and sample ids), [`Trainable::forward_backward`] with `scale = 1/B` (`B` the global
//! batch, not this rank's slice), then the distributed step reads [`Trainable::buffers_mut`].

use crate::error::Result;
use crate::nn::layers::Mode;
use crate::nn::loss::LossStats;
use crate::nn::params::ParamTable;
use ndarray::{ArrayView2, ArrayViewD, ArrayViewMutD};
use std::path::Path;

/// A model that [`Run`](crate::train::Run) can train: flat parameter and gradient buffers laid out
/// by a [`ParamTable`], input buffers for a batch of up to [`Trainable::capacity`] samples, and a
/// forward/backward pass over them. Implement the required methods; the by-name views and the
/// safetensors files follow from the table.
pub trait Trainable {
    /// Name, shape and offset of every parameter tensor in the flat buffers.
    fn table(&self) -> &ParamTable;

    /// All parameters, laid out by [`Trainable::table`].
    fn params(&self) -> &[f32];

    /// `∂L/∂params` of the last [`Trainable::forward_backward`], laid out like the parameters.
    fn grads(&self) -> &[f32];

    /// The table with both flat buffers, `(table, params, grads)`, the buffers mutable at once: the
    /// distributed step updates the parameters from the gradients it has summed in place. They are
    /// `Vec`s because the step appends every rank's statistics to them for its one collective and
    /// truncates them back (their capacity is kept from the first step on).
    fn buffers_mut(&mut self) -> (&ParamTable, &mut Vec<f32>, &mut Vec<f32>);

    /// The shape of one input sample (`[C, H, W]` for images, `[D]` for feature vectors). The
    /// gatherer writes each sample's values in row-major order, so a data set whose samples have
    /// as many values fits, whatever their shape.
    fn sample_shape(&self) -> &[usize];

    /// How many classes the labels range over (`0..classes`).
    fn classes(&self) -> usize;

    /// The largest batch the input buffers hold.
    fn capacity(&self) -> usize;

    /// Sizes the buffers for batches of up to `cap` samples. A model that cannot grow may leave
    /// its capacity as it is: [`Run::with_model`](crate::train::Run::with_model) then says the
    /// run needs more.
    fn set_capacity(&mut self, cap: usize);

    /// Buffers for a batch of `b` samples, to be filled before a pass: the inputs as a
    /// `b × sample shape` view in standard layout (`as_slice_mut` gives its rows), the labels, and
    /// the samples' indices in the data set (keys of per-sample randomness such as dropout masks).
    fn input_mut(&mut self, b: usize) -> (ArrayViewMutD<'_, f32>, &mut [u32], &mut [usize]);

    /// Forward and backward over the `b` samples in the input buffers: writes
    /// `grads = scale · Σ_samples ∂ℓ/∂θ` (overwriting them; zero for `b == 0`) and returns the
    /// loss sum and correct count over the batch.
    fn forward_backward(&mut self, b: usize, scale: f32, mode: Mode) -> LossStats;

    /// Forward over the `b` samples in the input buffers, for evaluation: the loss sum and correct
    /// count.
    fn forward(&mut self, b: usize, mode: Mode) -> LossStats;

    /// The logits of the last forward pass, `b × outputs`.
    fn logits(&self, b: usize) -> ArrayView2<'_, f32>;

    /// All parameters, mutably (to load or initialise them).
    fn params_mut(&mut self) -> &mut [f32] {
        self.buffers_mut().1
    }

    /// Parameter `name` as a view of its shape into [`Trainable::params`]; an unknown name is an
    /// error listing the model's parameters.
    fn param(&self, name: &str) -> Result<ArrayViewD<'_, f32>> {
        self.table().view(self.params(), name)
    }

    /// Parameter `name` as a mutable view: writes change the model.
    fn param_mut(&mut self, name: &str) -> Result<ArrayViewMutD<'_, f32>> {
        let (table, params, _) = self.buffers_mut();
        table.view_mut(params, name)
    }

    /// The gradient of parameter `name`, shaped like the parameter.
    fn grad(&self, name: &str) -> Result<ArrayViewD<'_, f32>> {
        self.table().view(self.grads(), name)
    }

    /// Every parameter with its name, in table order.
    fn params_named(&self) -> impl Iterator<Item = (&str, ArrayViewD<'_, f32>)> {
        self.table().views(self.params())
    }

    /// Writes the parameters as the safetensors file `path`, one F32 tensor per parameter under its
    /// name (the format of a checkpoint's `model.safetensors`).
    fn save_safetensors(&self, path: &Path) -> Result<()> {
        self.table().write_safetensors(path, &[("", self.params())])
    }

    /// Reads the parameters from the safetensors file `path`, which must hold exactly this model's
    /// tensors by name, as F32 in their shapes; otherwise the model is left unchanged and the error
    /// names the file, the tensor and what is wrong.
    fn load_safetensors(&mut self, path: &Path) -> Result<()> {
        let (table, params, _) = self.buffers_mut();
        let read = table.read_safetensors(path, &[""])?.remove(0);
        params.copy_from_slice(&read);
        Ok(())
    }
}

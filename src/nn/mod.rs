//! Models as chains of layers, each a forward/backward pair over ndarray views of row-major
//! mini-batches ([`layers::Layer`]), with their parameters and gradients in one flat buffer each,
//! lent by name as views ([`params`]). [`Trainable`] is what a training run needs of a model: the
//! crate's [`model::Model`] implements it, and so can a model of your own.

pub mod chain;
pub mod conv;
pub mod dropout;
pub mod layers;
pub mod loss;
pub mod model;
pub mod norm;
pub mod params;
pub mod pool;
pub mod residual;
pub mod trainable;

pub use trainable::Trainable;

//! Models as chains of layers, each a forward/backward pair over row-major mini-batches, with their
//! parameters and gradients in one flat buffer each ([`params`]).

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

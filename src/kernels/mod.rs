//! The compute kernels: the GEMM and its packing, the fully connected layer's dot-product kernel,
//! the direct convolution's register tiles, the thread team that runs them, and the instruction-set
//! tiers they are compiled for ([`isa`]). They know nothing of layers, optimizers or ranks.

pub(crate) mod correlate;
pub(crate) mod dot;
pub mod gemm;
pub mod isa;
pub(crate) mod pack;
pub(crate) mod team;

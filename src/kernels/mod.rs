//! The compute kernels: the GEMM and its packing, the fully connected layer's dot-product kernel,
//! the direct convolution's register tiles, the thread team that runs them, and the instruction-set
//! tiers they are compiled for ([`isa`]). They know nothing of layers, optimizers or ranks.

pub mod alloc;
pub(crate) mod correlate;
pub(crate) mod dot;
pub mod gemm;
pub mod isa;
pub(crate) mod team;

/// Grows a cache to at least `n` elements (never shrinks, so a steady-state step allocates nothing
/// once the largest batch has been seen).
pub(crate) fn grow<T: Clone + Default>(cache: &mut Vec<T>, n: usize) {
    if cache.len() < n {
        cache.resize(n, T::default());
    }
}

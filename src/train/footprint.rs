//! The bytes a training run must hold, to compare with what it takes: [`Footprint`] counts the data
//! set, parameters, gradients, optimizer state and the model's activations; [`peak_rss`] reads what
//! the process used.

use crate::data::dataset::Splits;
use crate::error::{Error, Result};
use crate::nn::model::Model;
use crate::train::optim::Optimizer;
use crate::train::recipe::Recipe;
use std::path::Path;

/// Bytes a training run must hold on one rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Footprint {
    /// Train and test features and labels.
    pub dataset: u64,
    pub params: u64,
    /// The local gradient and the allreduced one.
    pub grads: u64,
    pub optimizer: u64,
    /// Everything else the model allocates for its batch capacity: input rows, activations and their
    /// gradients, layer caches (measured on the heap, not derived from shapes).
    pub activations: u64,
}

impl Footprint {
    /// Measures the run of `recipe` on `data` over `world` ranks: builds the model the trainer
    /// builds, with the same batch capacity, and counts the heap bytes it takes.
    pub fn measure(recipe: &Recipe, data: &Splits, world: usize) -> Result<Footprint> {
        let bytes = |d: &crate::data::dataset::Dataset| (d.x.len() * 4 + d.y.len() * 4) as u64;
        let balancer = crate::balance::Balancer::new(&recipe.balance, recipe.train.global_batch, world)?;
        let before = heap_in_use();
        let mut model = Model::new(&recipe.model, &data.train.sample_shape, data.train.classes, recipe.train.seed)?;
        // As in `train`: room for the largest slice, and for evaluation batches.
        model.set_capacity(balancer.bounds().iter().map(|b| b.1).max().unwrap_or(1).max(256));
        let model_bytes = heap_in_use().saturating_sub(before);
        let n = model.params.len() as u64 * 4;
        let optimizer = Optimizer::new(&recipe.optimizer, model.params.len());
        Ok(Footprint {
            dataset: bytes(&data.train) + bytes(&data.test),
            params: n,
            grads: 2 * n,
            optimizer: optimizer.buffers().iter().map(|(_, b)| b.len() as u64 * 4).sum(),
            activations: model_bytes.saturating_sub(2 * n),
        })
    }

    pub fn total(&self) -> u64 {
        self.dataset + self.params + self.grads + self.optimizer + self.activations
    }
}

/// Heap bytes in use (glibc's `mallinfo2`: small blocks in all arenas plus mmapped ones).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn heap_in_use() -> u64 {
    // SAFETY: mallinfo2 only reads the allocator's statistics.
    let m = unsafe { libc::mallinfo2() };
    (m.uordblks + m.hblkhd) as u64
}

/// Heap bytes in use: unknown without glibc, so the activations of a [`Footprint`] read as 0.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn heap_in_use() -> u64 {
    0
}

/// Peak resident set size of this process so far (`VmHWM` of `/proc/self/status`), in bytes.
pub fn peak_rss() -> Result<u64> {
    let path = Path::new("/proc/self/status");
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let kb = text
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .ok_or_else(|| Error::data(path, "no readable VmHWM line"))?;
    Ok(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_rss_grows_with_touched_memory() {
        let before = peak_rss().unwrap();
        let v = vec![1u8; 64 << 20];
        std::hint::black_box(&v);
        assert!(peak_rss().unwrap() >= before.max(64 << 20), "64 MiB touched");
    }
}

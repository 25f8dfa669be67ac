//! # lbbsp: data-parallel CPU training with load-balanced bulk synchronous parallel
//!
//! Data-parallel training runs `N` ranks (MPI processes) that each compute the gradient of a slice
//! of a global batch of `B` samples and then sum the gradients with an allreduce. Under plain BSP
//! every rank gets `B/N` samples, so when one node is shared with other jobs and its rank slows
//! down, every rank waits for it at every allreduce.
//!
//! LB-BSP (Chen et al., "Semi-dynamic load balancing", SoCC'20) re-sizes the slices at iteration
//! boundaries instead. The gradient allreduce also carries every rank's batch size `b_i` and compute
//! time `t_i` of the iteration, so they become known to all ranks; each rank's speed is modelled by
//! a linear regression
//!
//! ```text
//!     t_i(b) ≈ α_i + β_i · b        (weighted least squares with exponential forgetting)
//! ```
//!
//! and the next iteration's sizes solve
//!
//! ```text
//!     minimise max_i t_i(b_i)   subject to   Σ_i b_i = B,   b_min ≤ b_i ≤ b_max_i,   b_i integer,
//! ```
//!
//! i.e. all unconstrained ranks are predicted to finish at the same time `T`, with
//! `b_i = (T − α_i)/β_i`. The global batch stays fixed and the gradient stays exact: rank `i`
//! contributes `Σ_{j ∈ slice_i} ∇ℓ_j / B` and the allreduce-sum gives `(1/B) Σ_{j ∈ batch} ∇ℓ_j`,
//! exactly the mean over the same `B` samples plain BSP would use. Only who computes which sample
//! changes, so a loss trajectory is the same (to float rounding) on 1, 2 or 3 ranks, balanced or not.
//!
//! ## Using the pieces from your own loop
//!
//! The CLI (`lbbsp train`) is one user of the library; yours can be another
//! (`examples/custom_loop.rs` is a complete one, `examples/replay.rs` replays a run's metrics
//! through the balancer). The public API:
//!
//! - the LB-BSP core: [`balance::Balancer`] (with [`BalanceConfig`], the [`Policy`] trait, [`PolicyKind`], [`Observation`]),
//!   [`shard::EpochPlan`], [`shard::slice_for`] and [`shard::rescale`] (the sharder),
//!   [`profile::CpuSampler`] (the profiler);
//! - ranks: [`dist::comm::Communicator`] with [`Solo`], [`Local`] (threads, for tests) and `Mpi`
//!   (rsmpi; feature `mpi`, default), and [`dist::sync::GradSync`], the weighted gradient allreduce
//!   carrying every rank's stats ([`dist::sync::RankStats`]);
//! - the run: [`train::Run`] (whose [`train::Run::step`] is one iteration, advancing the run's
//!   progress), [`train::train`], the [`Recipe`], [`Optimizer`], checkpoints
//!   ([`train::checkpoint`]) and metrics ([`train::metrics`]);
//! - models: [`nn`] (layers as forward/backward pairs, [`Model`], the [`nn::Trainable`] trait) and
//!   data: [`data`] (the manifest, readers, [`Dataset`]);
//! - kernels: [`kernels::gemm::gemm`] and the instruction-set tier ([`Isa`], [`IsaChoice`]); the
//!   packing, dot-product and convolution tiles and the thread team are internal.
//!
//! ## Models in ndarray
//!
//! A [`Model`] keeps its parameters in one flat buffer (one allreduce, one optimizer loop) and lends
//! them by name as ndarray views, without copying; a batch goes in as a view of the samples' shape
//! and the logits come out as an `ArrayView2`:
//!
//! ```
//! use lbbsp::nn::{layers::Mode, loss::Loss, model::{LayerSpec, Model, ModelSpec}};
//!
//! let layers = vec![LayerSpec::Flatten, LayerSpec::Linear { out: 10 }];
//! let mut model = Model::new(&ModelSpec { layers, loss: Loss::SoftmaxCrossEntropy }, &[1, 28, 28], 10, 7)?;
//! assert_eq!(model.param("layers.1.weight")?.shape(), [10, 784]);
//! model.param_mut("layers.1.bias")?.fill(0.1);
//! for (name, p) in model.params_named() {
//!     println!("{name} {:?}", p.shape());
//! }
//! model.set_capacity(32);
//! let (mut x, labels, _ids) = model.input_mut(32); // x: 32×1×28×28
//! x.fill(0.5);
//! labels.fill(3);
//! let stats = model.forward(32, Mode { train: false, seed: 0, epoch: 0 });
//! let logits = model.logits(32); // 32×10
//! println!("loss {:.3}, first row {}", stats.loss_sum / 32.0, logits.row(0));
//! model.save_safetensors(std::env::temp_dir().join("lbbsp-doc.safetensors"))?; // loads by the same names
//! # Ok::<(), lbbsp::Error>(())
//! ```
//!
//! ## Your own model
//!
//! [`train::Run`] asks of its model only what [`nn::Trainable`] names: a [`nn::params::ParamTable`]
//! over flat parameter and gradient buffers, input buffers for a batch, forward/backward with the
//! `1/B` weight, forward for evaluation, and capacity. [`Model`] is one; a model of your own trains
//! through [`train::Run::with_model`], data-parallel under `mpirun` with LB-BSP, and checkpoints
//! under its own parameter names (`examples/custom_model.rs`: a two-layer perceptron in ndarray,
//! resumed bit for bit and written as safetensors):
//!
//! ```no_run
//! # use lbbsp::{nn::Trainable, train::{Run, RunOptions}, Solo};
//! # fn go<M: Trainable>(my_model: M, data: &lbbsp::Splits) -> lbbsp::Result<()> {
//! let recipe = lbbsp::train::recipe::resolve("digits-mlp", &["balance.policy=\"lbbsp\"".into()])?;
//! let mut run = Run::with_model(my_model, &recipe, data, &Solo, &RunOptions::default())?;
//! let plan = run.epoch_plan();
//! run.step(plan.batch(0))?; // the recipe's data, optimizer and balancer; its [model] is ignored
//! for (name, p) in run.model().params_named() {
//!     println!("{name} {:?}", p.shape()); // your names, as ndarray views
//! }
//! # Ok(())
//! # }
//! ```

pub mod balance;
pub mod data;
pub mod dist;
pub mod error;
pub mod kernels;
pub mod nn;
pub mod profile;
pub mod shard;
pub mod sim;
pub mod train;

pub use balance::{BalanceConfig, Balancer, Observation, Policy, PolicyKind};
pub use data::dataset::{Dataset, Splits};
pub use dist::comm::{Communicator, Local, Solo};
#[cfg(feature = "mpi")]
pub use dist::mpi::Mpi;
pub use error::{Error, Result};
pub use kernels::alloc::CacheAligned;
pub use kernels::isa::{Isa, IsaChoice};
pub use nn::model::Model;
pub use nn::trainable::Trainable;
pub use shard::{slice_for, EpochPlan};
pub use train::checkpoint::{Checkpoint, Progress, TrainingState};
pub use train::optim::{Optimizer, OptimizerConfig};
pub use train::recipe::Recipe;
pub use train::{train, RunOptions, Slowdown};

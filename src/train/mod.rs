//! The training loop: BSP and LB-BSP are one loop with a policy value.
//!
//! Per iteration, on every rank:
//! 1. take this rank's slice of the global batch (sizes from the [`Balancer`]),
//! 2. forward + backward: local gradient `Σ_{j ∈ slice} ∇ℓ_j / B` (timed: compute),
//! 3. **the distributed step** ([`GradSync`]): an allreduce-sum of
//!    `[local gradient | stats slots]`, done as its two halves around the optimizer. The gradient
//!    part of the sum is the exact mean gradient of the global batch, whatever the split; the stats
//!    part is an all-gather of every rank's `(b_i, compute_i, loss, …)`, since each rank writes only
//!    its own slot and zeros elsewhere. The reduce-scatter leaves each rank the summed gradient of
//!    its block of the parameters; it updates that block (after optional gradient-norm clipping,
//!    with the norm summed over ranks) and the all-gather shares the updated parameters and the
//!    stats. The time splits into waiting for the slowest rank and transfer
//!    ([`SyncTime`]),
//! 4. the balancer, fed the same gathered stats on every rank, computes the same next split
//!    everywhere (no broadcast needed).
//!
//! Given the parameters, the optimizer state, the position in the epoch permutation and the balancer
//! state, the loop is deterministic, so a run resumed from a [`checkpoint`] ends with
//! the same weights as one that never stopped (bit for bit at a fixed split, as under `bsp`).

pub mod aids;
pub mod checkpoint;
pub mod consistency;
pub mod footprint;
pub mod metrics;
pub mod optim;
pub mod recipe;
pub mod stop;

pub use aids::Slowdown;

use crate::balance::{Balancer, Observation, Policy};
use crate::data::dataset::{Dataset, Splits};
use crate::dist::comm::{share_outcome, Communicator};
use crate::dist::sync::{GradSync, RankStats, SyncTime};
use crate::dist::watchdog::Phase;
use crate::error::{Error, Result};
use crate::nn::layers::Mode;
use crate::nn::model::Model;
use crate::nn::trainable::Trainable;
use crate::profile::CpuSampler;
use crate::shard::{equal_split, slice_for, EpochPlan};
use crate::train::aids::{check_slowdowns, stretch, Replay};
use crate::train::checkpoint::{Progress, Snapshot};
use crate::train::metrics::{EvalResult, IterRecord, JsonlWriter, StragglerTally, Summary};
use crate::train::optim::Optimizer;
use crate::train::recipe::Recipe;
use crate::train::stop::StopSignal;
use std::path::PathBuf;
use std::time::Instant;

/// Where results go and how a run is observed.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Per-iteration JSONL records (written by rank 0).
    pub metrics: Option<PathBuf>,
    /// Show the progress bar and per-epoch lines on rank 0.
    pub progress: bool,
    /// Write checkpoints into this folder (rank 0): every `checkpoint_every` iterations, and after
    /// the last iteration of the run.
    pub checkpoint_dir: Option<PathBuf>,
    pub checkpoint_every: Option<usize>,
    /// Keep only the newest this many checkpoints in `checkpoint_dir` (all when unset).
    pub keep: Option<usize>,
    /// Where the run starts: afresh, from a checkpoint, or from the newest in `checkpoint_dir`.
    pub resume: Resume,
}

/// Where a run starts.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Resume {
    /// From the recipe's initial parameters. The checkpoint folder must hold no checkpoint.
    #[default]
    Fresh,
    /// From a checkpoint: a folder of checkpoints (its newest valid one) or one `step-<n>` folder.
    From(PathBuf),
    /// From the newest valid checkpoint in [`RunOptions::checkpoint_dir`] when it holds any, else
    /// afresh: one command serves a job's first start and every restart after a preemption.
    Auto,
}

impl Resume {
    /// The checkpoint to continue from: rank 0 looks into the checkpoint folder for
    /// [`Resume::Auto`] and tells the others, so all ranks start alike.
    fn source(&self, comm: &dyn Communicator, checkpoint_dir: Option<&std::path::Path>) -> Result<Option<PathBuf>> {
        match (self, checkpoint_dir) {
            (Resume::Fresh, _) => Ok(None),
            (Resume::From(p), _) => Ok(Some(p.clone())),
            (Resume::Auto, None) => {
                Err(Error::config("--resume auto", "needs a checkpoint folder (--checkpoint-dir DIR) to look in"))
            }
            (Resume::Auto, Some(dir)) => {
                let found = if comm.rank() == 0 { checkpoint::list(dir).map(|l| !l.is_empty()) } else { Ok(false) };
                let flag = [f64::from(u8::from(*found.as_ref().unwrap_or(&false)))];
                share_outcome(comm, 0, found.map(|_| ()))?;
                let mut any = [0.0];
                comm.all_reduce_sum_f64_into(&flag, &mut any);
                Ok((any[0] > 0.0).then(|| dir.to_path_buf()))
            }
        }
    }
}

/// One rank's part of a training run: the model, its optimizer, the gradient sync and the
/// balancer, and where the run stands ([`Progress`], what a checkpoint records).
///
/// A run keeps its own progress: [`Run::step`] and [`Run::end_epoch`] advance it, so a loop of
/// them is a whole run, and a run resumed from a checkpoint written between any two steps
/// ([`Run::save`]) continues where it stood. On every rank, with `run` from [`Run::new`]:
///
/// ```no_run
/// # fn epochs(run: &mut lbbsp::train::Run, epochs: usize) -> lbbsp::Result<()> {
/// while run.progress().epoch < epochs {
///     let plan = run.epoch_plan();
///     for t in run.progress().batch_in_epoch..plan.iterations() {
///         let record = run.step(plan.batch(t))?;
///         println!("iteration {}: loss {}", record.iter, record.loss);
///     }
///     run.end_epoch();
/// }
/// # Ok(())
/// # }
/// ```
///
/// [`train`] is this loop with a stop at [`Run::total_iters`], a stop signal, checkpoints, the
/// metrics file and the progress bar.
///
/// The model is the recipe's ([`Run::new`]) or any [`Trainable`] of your own
/// ([`Run::with_model`]); `examples/custom_model.rs` trains one under `mpirun` with LB-BSP.
pub struct Run<'a, M: Trainable = Model> {
    recipe: &'a Recipe,
    data: &'a Splits,
    comm: &'a dyn Communicator,
    model: M,
    opt: Optimizer,
    balancer: Balancer,
    sync: GradSync,
    sampler: CpuSampler,
    replay: Option<Replay>,
    obs: Vec<Observation>,
    /// This rank's wait and transfer in its last collective: they travel with the next one.
    last_sync: SyncTime,
    /// This process's CPU share over its last iteration, compute and collective.
    last_run_share: f64,
    /// The wall seconds that share was measured over.
    last_run_s: f64,
    /// Seconds the balancer's last step took here.
    last_balance_s: f64,
    progress: Progress,
    /// Whether the run continues from a checkpoint.
    resumed: bool,
    /// Global batches per epoch, and in the planned run (the learning-rate schedule spans it).
    iters_per_epoch: usize,
    planned: usize,
    /// Where this run stops (`train.max_iters`, else the planned run).
    total_iters: usize,
}

impl<'a> Run<'a> {
    /// Builds the model (rank 0's initial parameters on every rank), the optimizer and the
    /// balancer of `recipe`, or restores them from the checkpoint `opts.resume` names.
    pub fn new(recipe: &'a Recipe, data: &'a Splits, comm: &'a dyn Communicator, opts: &RunOptions) -> Result<Run<'a>> {
        let seed = recipe.train.seed;
        Run::start(recipe, data, comm, opts, || {
            Model::new(&recipe.model, &data.train.sample_shape, data.train.classes, seed)
        })
    }
}

impl<'a, M: Trainable> Run<'a, M> {
    /// [`Run::new`] with your own model in place of the recipe's `[model]` section, which is then
    /// ignored: everything else (data, optimizer, balancer, the distributed step, checkpoints) is
    /// the recipe's. Rank 0's initial parameters become every rank's; a checkpoint that
    /// `opts.resume` names must hold this model's tensors, by name and shape.
    ///
    /// A model that does not fit the run is an [`Error::ModelMismatch`] naming what differs: its
    /// input size against the training set's samples, its classes against the data set's, its
    /// capacity (after [`Trainable::set_capacity`]) against the largest slice a rank may get.
    pub fn with_model(
        model: M,
        recipe: &'a Recipe,
        data: &'a Splits,
        comm: &'a dyn Communicator,
        opts: &RunOptions,
    ) -> Result<Run<'a, M>> {
        Run::start(recipe, data, comm, opts, || {
            let set = &data.train;
            let (have, want) = (model.sample_shape(), &set.sample_shape);
            if have.iter().product::<usize>() != want.iter().product::<usize>() {
                return Err(Error::ModelMismatch {
                    what: "input size",
                    model: format!("{} values per sample (shape {have:?})", have.iter().product::<usize>()),
                    run: format!("the training set's samples have {} (shape {want:?})", want.iter().product::<usize>()),
                });
            }
            if model.classes() != set.classes {
                return Err(Error::ModelMismatch {
                    what: "class count",
                    model: model.classes().to_string(),
                    run: format!("the training set's labels range over {} classes", set.classes),
                });
            }
            Ok(model)
        })
    }

    /// Starts a run on the model `build` returns, called once the ranks are known to be launched
    /// alike (so that a model that fails to build fails on every rank).
    fn start(
        recipe: &'a Recipe,
        data: &'a Splits,
        comm: &'a dyn Communicator,
        opts: &RunOptions,
        build: impl FnOnce() -> Result<M>,
    ) -> Result<Run<'a, M>> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let cfg = &recipe.train;
        comm.note(0, Phase::Start);
        let mut balancer = Balancer::new(&recipe.balance, cfg.global_batch, world)?;
        consistency::check(comm, recipe, data)?;
        let mut model = build()?;
        let largest_slice = balancer.bounds().iter().map(|b| b.1).max().unwrap_or(1);
        model.set_capacity(largest_slice.max(256));
        if model.capacity() < largest_slice {
            return Err(Error::ModelMismatch {
                what: "capacity",
                model: format!("{} samples", model.capacity()),
                run: format!("a rank's slice may hold up to {largest_slice} (the balancer's upper bound)"),
            });
        }
        comm.broadcast_into(0, model.params_mut());
        let mut opt = Optimizer::new(&recipe.optimizer, model.params().len());
        check_slowdowns(&recipe.runtime.slowdown, world)?;
        let resume = opts.resume.source(comm, opts.checkpoint_dir.as_deref())?;
        if let (Some(dir), None, 0) = (&opts.checkpoint_dir, &resume, rank) {
            checkpoint::check_fresh(dir)?;
        }
        let progress = match &resume {
            None => Progress::default(),
            Some(src) => {
                let r = checkpoint::resume(src, comm, recipe, &mut model, &mut opt)?;
                balancer = continued_balancer(balancer, &r, rank == 0);
                r.state.progress
            }
        };
        let replay = match &recipe.balance.replay {
            Some(path) => Some(Replay::read(path, world, cfg.global_batch)?),
            None => None,
        };
        let iters_per_epoch = data.train.len().div_ceil(cfg.global_batch);
        // The schedule spans the planned run whatever `max_iters` stops it at, and wherever it resumes.
        let planned = iters_per_epoch * cfg.epochs;
        Ok(Run {
            recipe,
            data,
            comm,
            sync: GradSync::new(model.params().len(), world),
            model,
            opt,
            balancer,
            sampler: if comm.owns_process() { CpuSampler::new() } else { CpuSampler::of_thread() },
            replay,
            obs: Vec::with_capacity(world),
            last_sync: SyncTime::default(),
            last_run_share: 0.0,
            last_run_s: 0.0,
            last_balance_s: 0.0,
            progress,
            resumed: resume.is_some(),
            iters_per_epoch,
            planned,
            total_iters: cfg.max_iters.map_or(planned, |m| m.min(planned)),
        })
    }

    /// The model, with the parameters as of the last step (the same on every rank).
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The model, to change: what changes must change alike on every rank.
    pub fn model_mut(&mut self) -> &mut M {
        &mut self.model
    }

    /// The optimizer. Its state is current only on this rank's block of the parameters between
    /// checkpoints (each rank updates its own block).
    pub fn optimizer(&self) -> &Optimizer {
        &self.opt
    }

    /// The balancer, which has observed every step so far.
    pub fn balancer(&self) -> &Balancer {
        &self.balancer
    }

    /// Where the run stands: what a checkpoint records and a resumed run continues from.
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// The iteration this run stops before: `train.max_iters`, else every epoch's batches.
    pub fn total_iters(&self) -> usize {
        self.total_iters
    }

    /// The global batches of the current epoch (`progress().epoch`), the same on every rank:
    /// [`Run::step`] takes them in order from `progress().batch_in_epoch`.
    pub fn epoch_plan(&self) -> EpochPlan {
        let cfg = &self.recipe.train;
        EpochPlan::new(self.data.train.len(), cfg.global_batch, cfg.seed, self.progress.epoch as u64)
    }

    /// One iteration on `batch`, the next global batch of [`Run::epoch_plan`]: this rank computes
    /// its slice's share of the gradient, the ranks take the distributed step, the balancer
    /// observes every rank's size and time, and the progress moves past the batch. Returns the
    /// iteration's record without its wait and transfer columns: those are known once the
    /// collective is over and travel with the next iteration's (see [`Run::late_columns`]).
    ///
    /// A batch of no samples, of more than `train.global_batch` or with a sample id past the
    /// training set is an error.
    pub fn step(&mut self, batch: &[usize]) -> Result<IterRecord> {
        self.check_batch(batch)?;
        let (rank, iter, epoch) = (self.comm.rank(), self.progress.step, self.progress.epoch);
        let t_iter = Instant::now();
        let unix_s =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        // This rank's slice: the balancer's split of B (the short last batch of an epoch keeps its
        // shares within the bounds), or the replayed one.
        let sizes = match &self.replay {
            Some(r) => r.sizes(iter, batch.len())?,
            None => self.balancer.split(batch.len()),
        };
        let slice = &batch[slice_for(&sizes, rank)];
        self.comm.note(iter, Phase::Compute);
        let lr = self.recipe.optimizer.lr_at(iter, self.iters_per_epoch, self.planned);

        // Compute: this rank's gradient *sum* over its slice, weighted by 1/B, so that the sum over
        // ranks is the mean over the global batch whatever the split.
        self.sampler.mark();
        let (t0, cpu0) = (Instant::now(), crate::profile::process_cpu_s());
        let (mut x, y, ids) = self.model.input_mut(slice.len());
        self.data.train.gather_into(slice, x.as_slice_mut().expect("the model's input is row-major"), y);
        ids.copy_from_slice(slice);
        let mode = Mode { train: true, seed: self.recipe.train.seed, epoch: epoch as u64 };
        let local = self.model.forward_backward(slice.len(), 1.0 / batch.len() as f32, mode);
        stretch(&self.recipe.runtime.slowdown, rank, iter, t0.elapsed());
        // Timed by the sample's interval, which ends after its read of the CPU clock: a CPU quota
        // that the compute spent freezes the rank there, and the compute's time, share and frozen
        // seconds then describe the same seconds. Timed before the sample, a quota's 1 ms freeze
        // fell outside a 1 ms compute that its share and waits still counted, and the rank looked
        // twice as fast per CPU second as it was.
        let cpu = self.sampler.sample();
        let compute_s = cpu.wall_s;
        let mine = RankStats {
            batch: slice.len(),
            compute_s,
            loss_sum: local.loss_sum,
            interference_s: cpu.interference_s,
            cpu_share: cpu.cpu_share,
            preemptions: cpu.preemptions,
            frozen_s: cpu.frozen_s,
            // Thread ranks share one process's counters: no measure of their own.
            prev_run_share: if self.comm.owns_process() { self.last_run_share } else { 0.0 },
            prev_run_s: self.last_run_s,
            prev_balance_s: self.last_balance_s,
            prev_sync: self.last_sync,
            stop: stop::received().map_or(0, StopSignal::number),
        };

        self.comm.note(iter, Phase::Sync);
        let took = self.distributed_step(&mine, lr); // ---- the distributed step ----
        self.last_sync = took;
        self.last_run_s = t0.elapsed().as_secs_f64();
        self.last_run_share = (crate::profile::process_cpu_s() - cpu0) / self.last_run_s.max(1e-9);

        // Every rank feeds the balancer the same gathered (b_i, t_i): the same next split everywhere.
        self.sync.observations_into(self.threads_per_rank(), &mut self.obs);
        let balancing = Instant::now();
        self.balancer.observe(&self.obs);
        self.last_balance_s = balancing.elapsed().as_secs_f64();
        let rec = self.record(iter, epoch, (unix_s, t_iter.elapsed().as_secs_f64()), lr, sizes);
        self.advance(rec.loss);
        Ok(rec)
    }

    fn check_batch(&self, batch: &[usize]) -> Result<()> {
        let (n, b) = (self.data.train.len(), self.recipe.train.global_batch);
        let why = if batch.is_empty() || batch.len() > b {
            format!("has {} samples, and a global batch has 1 to train.global_batch = {b}", batch.len())
        } else if let Some(id) = batch.iter().find(|&&id| id >= n) {
            format!("names sample {id}, and the training set has {n}")
        } else {
            return Ok(());
        };
        Err(Error::config("Run::step's batch", format!("{why}: take the batches of Run::epoch_plan")))
    }

    /// Moves the progress past the iteration just taken, of global-batch loss `loss`.
    fn advance(&mut self, loss: f64) {
        let p = &mut self.progress;
        if p.batch_in_epoch == 0 {
            p.epoch_loss = (0.0, 0);
        }
        p.epoch_loss.0 += loss;
        p.epoch_loss.1 += 1;
        p.step += 1;
        p.batch_in_epoch += 1;
    }

    /// Ends the current epoch: the balancer's end-of-epoch step, then the evaluation on the test
    /// split when one is due (every `train.eval_every_epochs` epochs, and after the last), which
    /// it returns; the next step starts the next epoch. Every rank takes part.
    pub fn end_epoch(&mut self) -> Option<EvalResult> {
        let epoch = self.progress.epoch;
        self.balancer.end_epoch();
        let (done, cfg) = (epoch + 1, &self.recipe.train);
        let due = done.is_multiple_of(cfg.eval_every_epochs) || done == cfg.epochs;
        let ev = due.then(|| self.evaluate(epoch));
        self.progress.epoch = done;
        self.progress.batch_in_epoch = 0;
        ev
    }

    /// The stop signal that a rank had received by its last [`Run::step`] (the first rank's that
    /// had), the same on every rank: the run should stop here.
    pub fn stop_signal(&self) -> Option<StopSignal> {
        self.sync.stats.iter().find_map(|s| StopSignal::from_number(s.stop))
    }

    /// Every rank's wait and transfer seconds in the collective of the iteration before the last
    /// [`Run::step`], as gathered with that step's stats.
    pub fn late_columns(&self) -> (Vec<f64>, Vec<f64>) {
        self.sync.stats.iter().map(|s| (s.prev_sync.wait_s, s.prev_sync.comm_s)).unzip()
    }

    /// Every rank's wait and transfer seconds in the last iteration's collective: one small
    /// all-gather, for the last record of a run (every rank calls it).
    pub fn last_columns(&self) -> (Vec<f64>, Vec<f64>) {
        let world = self.comm.world_size();
        let mut all = vec![0.0; 2 * world];
        self.comm.all_gather_into(&[self.last_sync.wait_s, self.last_sync.comm_s], &mut all);
        all.chunks_exact(2).map(|c| (c[0], c[1])).unzip()
    }

    /// Rayon threads of this rank: the recipe's, else the pool's.
    fn threads_per_rank(&self) -> usize {
        self.recipe.runtime.threads.unwrap_or_else(rayon::current_num_threads)
    }

    /// **The distributed step**: the weighted gradient allreduce, cut in its two halves around the
    /// optimizer. Each rank contributed its gradient sum / B, so the sum over ranks is the exact
    /// mean over the global batch. The reduce-scatter leaves each rank that sum on its own block of
    /// the parameters (every rank's stats riding along); it updates only that block (after
    /// clipping, with the norm summed over ranks), and the all-gather hands the updated blocks to
    /// all ranks: an allreduce's bytes, 1/world of the optimizer's work each (ZeRO stage 1). Fast
    /// ranks block until the slowest arrives: [`SyncTime`] splits wait from transfer.
    fn distributed_step(&mut self, mine: &RankStats, lr: f32) -> SyncTime {
        let (_, params, grads) = self.model.buffers_mut();
        let block = self.sync.reduce_scatter(self.comm, grads, mine);
        if let Some(max_norm) = self.recipe.optimizer.clip_grad_norm {
            self.sync.clip_grad_norm(self.comm, &mut grads[block.clone()], max_norm);
        }
        self.opt.step_block(params, grads, lr, block);
        self.sync.all_gather(self.comm, params)
    }

    /// The record of iteration `iter` from the gathered stats.
    fn record(
        &self,
        iter: usize,
        epoch: usize,
        (unix_s, iter_s): (f64, f64),
        lr: f32,
        batch_sizes: Vec<usize>,
    ) -> IterRecord {
        let stats = &self.sync.stats;
        let global_batch: usize = batch_sizes.iter().sum();
        IterRecord {
            iter,
            unix_s,
            epoch,
            loss: stats.iter().map(|s| s.loss_sum).sum::<f64>() / global_batch as f64,
            lr,
            global_batch,
            batch_sizes,
            compute_s: stats.iter().map(|s| s.compute_s).collect(),
            wait_s: Vec::new(),
            comm_s: Vec::new(),
            interference_s: stats.iter().map(|s| s.interference_s).collect(),
            cpu_share: stats.iter().map(|s| s.cpu_share).collect(),
            preemptions: stats.iter().map(|s| s.preemptions).collect(),
            frozen_s: stats.iter().map(|s| s.frozen_s).collect(),
            run_share: stats.iter().map(|s| s.prev_run_share).collect(),
            balance_s: stats.iter().map(|s| s.prev_balance_s).collect(),
            iter_s,
            samples_per_s: global_batch as f64 / iter_s,
        }
    }

    /// Loss and accuracy of the current parameters on the test split, recorded in the progress'
    /// evaluations as `epoch`'s (every rank takes part).
    pub fn evaluate(&mut self, epoch: usize) -> EvalResult {
        self.comm.note(self.progress.step, Phase::Evaluate);
        let ev = evaluate(&mut self.model, &self.data.test, self.comm, epoch);
        self.progress.evals.push(ev);
        ev
    }

    /// Writes a checkpoint of where the run stands into `dir` (rank 0), then keeps only the newest
    /// `keep` there. Every rank takes part: the optimizer's state is current only on each rank's own
    /// block until gathered, and rank 0's outcome is every rank's.
    pub fn save(&mut self, dir: &std::path::Path, keep: Option<usize>) -> Result<()> {
        self.comm.note(self.progress.step, Phase::Checkpoint);
        for (_, buf) in self.opt.buffers_mut() {
            let n = buf.len();
            self.comm.all_gather_blocks(buf, n);
        }
        let outcome = if self.comm.rank() == 0 { self.write_checkpoint(dir, keep) } else { Ok(()) };
        share_outcome(self.comm, 0, outcome)
    }

    fn write_checkpoint(&self, dir: &std::path::Path, keep: Option<usize>) -> Result<()> {
        let snap = Snapshot {
            table: self.model.table(),
            params: self.model.params(),
            optimizer: &self.opt,
            balancer: &self.balancer,
            progress: &self.progress,
            recipe: self.recipe,
            world_size: self.comm.world_size(),
        };
        checkpoint::save(dir, &snap)?;
        keep.map_or(Ok(()), |k| checkpoint::keep_newest(dir, k))
    }
}

/// Trains `recipe` on `data` over `comm`; returns the same summary on every rank.
///
/// A stop signal of `runtime.stop_signals` (handled while this runs, where `comm` owns the
/// process) ends it after the iteration that every rank learns of it in, with a checkpoint where
/// there is a checkpoint folder: [`Error::Preempted`] on every rank.
pub fn train(recipe: &Recipe, data: &Splits, comm: &dyn Communicator, opts: &RunOptions) -> Result<Summary> {
    let _handlers = match comm.owns_process() {
        true => Some(stop::Handlers::install(&recipe.runtime.stop_signals)?),
        false => None,
    };
    let mut run = Run::new(recipe, data, comm, opts)?;
    let mut out = Outputs::new(&run, opts)?;
    let (start, started) = (run.progress().step, Instant::now());
    let mut tally = Tally::default();
    // (iteration, loss, lr) of a non-finite loss: the same on every rank (the loss is summed from the
    // gathered stats), so all ranks stop together.
    let mut diverged: Option<(usize, f64, f32)> = None;
    let mut stopped: Option<StopSignal> = None;
    'epochs: while run.progress().epoch < recipe.train.epochs {
        let plan = run.epoch_plan();
        for t in run.progress().batch_in_epoch..plan.iterations() {
            if run.progress().step >= run.total_iters() {
                break 'epochs;
            }
            let rec = run.step(plan.batch(t))?;
            tally.add(&rec);
            let finite = rec.loss.is_finite();
            if !finite {
                diverged = Some((rec.iter, rec.loss, rec.lr));
            }
            out.iteration(rec, run.late_columns())?;
            if !finite {
                break 'epochs;
            }
            out.checkpoint_if_due(&mut run)?;
            stopped = run.stop_signal();
            if stopped.is_some() {
                break 'epochs;
            }
        }
        let epoch = run.progress().epoch;
        if let Some(ev) = run.end_epoch() {
            out.epoch_line(&run, epoch, &ev);
        }
    }
    out.bar.finish_and_clear();
    out.last_record(run.last_columns())?;
    if diverged.is_none() && run.progress().step > start {
        out.final_checkpoint(&mut run)?;
    }
    if let Some((iter, loss, lr)) = diverged {
        return Err(Error::Diverged { iter, loss, lr });
    }
    if let Some(signal) = stopped {
        let saved = match &out.checkpoint_dir {
            Some(dir) => format!(
                "its checkpoint is {}; continue with --resume auto (or --resume {})",
                checkpoint::step_dir(dir, run.progress().step).display(),
                dir.display()
            ),
            None => "no checkpoint was written (no --checkpoint-dir)".to_string(),
        };
        return Err(Error::Preempted { signal: signal.to_string(), iterations: run.progress().step, saved });
    }
    Ok(summary(&mut run, &tally, started))
}

/// What a run's summary needs of its records, kept instead of them.
#[derive(Default)]
struct Tally {
    samples: usize,
    train_s: f64,
    final_loss: Option<f64>,
    stragglers: StragglerTally,
}

impl Tally {
    fn add(&mut self, rec: &IterRecord) {
        self.samples += rec.global_batch;
        self.train_s += rec.iter_s;
        self.final_loss = Some(rec.loss);
        self.stragglers.add(rec);
    }
}

/// The summary of a finished run, after its final evaluation (if the last epoch had none).
fn summary(run: &mut Run, tally: &Tally, started: Instant) -> Summary {
    let epochs_run = run.progress().epoch;
    if run.progress().evals.last().is_none_or(|e| e.epoch + 1 != epochs_run) {
        run.evaluate(epochs_run.saturating_sub(1));
    }
    let progress = run.progress();
    let last = *progress.evals.last().expect("evaluated at least once");
    let (loss_sum, n) = progress.epoch_loss;
    Summary {
        recipe: run.recipe.name.clone(),
        policy: run.recipe.balance.policy,
        isa: crate::kernels::isa::Isa::active(),
        world_size: run.comm.world_size(),
        threads_per_rank: run.threads_per_rank(),
        iterations: progress.step,
        epochs: epochs_run,
        test_accuracy: last.accuracy,
        test_loss: last.loss,
        final_loss: tally.final_loss.unwrap_or(f64::NAN),
        last_epoch_loss: loss_sum / n.max(1) as f64,
        wall_s: started.elapsed().as_secs_f64(),
        samples_per_s: tally.samples as f64 / tally.train_s.max(1e-9),
        evals: progress.evals.clone(),
        stragglers: tally.stragglers.report(),
    }
}

/// What a run shows and writes around its iterations: the progress bar and per-epoch lines,
/// checkpoints and the metrics file (rank 0 writes; every rank takes part in checkpoints).
struct Outputs {
    bar: indicatif::ProgressBar,
    progress: bool,
    rank0: bool,
    metrics: Option<JsonlWriter>,
    /// The last iteration's record, written once its wait and transfer columns arrive.
    pending: Option<IterRecord>,
    checkpoint_dir: Option<PathBuf>,
    checkpoint_every: Option<usize>,
    keep: Option<usize>,
    last_saved: Option<usize>,
}

impl Outputs {
    fn new(run: &Run, opts: &RunOptions) -> Result<Outputs> {
        let rank0 = run.comm.rank() == 0;
        let bar = progress_bar(rank0 && opts.progress, run.total_iters());
        bar.set_position(run.progress().step.min(run.total_iters()) as u64);
        let metrics = match (&opts.metrics, rank0, run.resumed) {
            (Some(p), true, false) => Some(JsonlWriter::streaming(p)?),
            (Some(p), true, true) => Some(JsonlWriter::resume_records(p, run.progress().step)?),
            _ => None,
        };
        Ok(Outputs {
            bar,
            progress: opts.progress,
            rank0,
            metrics,
            pending: None,
            checkpoint_dir: opts.checkpoint_dir.clone(),
            checkpoint_every: opts.checkpoint_every,
            keep: opts.keep,
            last_saved: None,
        })
    }

    /// Shows `rec`, and writes the record before it now that its late columns (`wait_s`, `comm_s`
    /// of every rank) have come with `rec`'s stats.
    fn iteration(&mut self, rec: IterRecord, late: (Vec<f64>, Vec<f64>)) -> Result<()> {
        self.bar.set_position(rec.iter as u64 + 1);
        if !self.bar.is_hidden() {
            self.bar.set_message(format!(
                "loss {:.4}  {:.0} samples/s  b={:?}",
                rec.loss, rec.samples_per_s, rec.batch_sizes
            ));
        }
        let done = self.pending.replace(rec);
        self.write(done, late)
    }

    /// Writes the run's last record, with `last` its late columns.
    fn last_record(&mut self, last: (Vec<f64>, Vec<f64>)) -> Result<()> {
        let done = self.pending.take();
        self.write(done, last)
    }

    fn write(&mut self, rec: Option<IterRecord>, (wait_s, comm_s): (Vec<f64>, Vec<f64>)) -> Result<()> {
        match (rec, self.metrics.as_mut()) {
            (Some(rec), Some(w)) => w.write(&IterRecord { wait_s, comm_s, ..rec }),
            _ => Ok(()),
        }
    }

    fn checkpoint_if_due(&mut self, run: &mut Run) -> Result<()> {
        if self.checkpoint_every.is_some_and(|k| run.progress().step.is_multiple_of(k)) {
            self.save(run)?;
        }
        Ok(())
    }

    /// The checkpoint after the last iteration, unless the last one written is it.
    fn final_checkpoint(&mut self, run: &mut Run) -> Result<()> {
        if self.last_saved != Some(run.progress().step) {
            self.save(run)?;
        }
        Ok(())
    }

    fn save(&mut self, run: &mut Run) -> Result<()> {
        if let Some(dir) = &self.checkpoint_dir {
            run.save(dir, self.keep)?;
            self.last_saved = Some(run.progress().step);
        }
        Ok(())
    }

    /// The line of `epoch`, just ended with the evaluation `ev`.
    fn epoch_line(&self, run: &Run, epoch: usize, ev: &EvalResult) {
        if !(self.rank0 && self.progress) {
            return;
        }
        let (sum, n) = run.progress().epoch_loss;
        let line = format!(
            "epoch {}/{}: train loss {:.4}  test loss {:.4}  test accuracy {:.2}%",
            epoch + 1,
            run.recipe.train.epochs,
            sum / n.max(1) as f64,
            ev.loss,
            100.0 * ev.accuracy
        );
        if self.bar.is_hidden() {
            eprintln!("{line}");
        } else {
            self.bar.println(line);
        }
    }
}

/// Loss and accuracy on `test`, each rank taking a contiguous shard, reduced over ranks.
pub fn evaluate<M: Trainable + ?Sized>(
    model: &mut M,
    test: &Dataset,
    comm: &dyn Communicator,
    epoch: usize,
) -> EvalResult {
    let shard = slice_for(&equal_split(test.len(), comm.world_size()), comm.rank());
    let idx: Vec<usize> = shard.collect();
    let mode = Mode { train: false, seed: 0, epoch: epoch as u64 };
    let mut sums = [0.0f64; 3];
    for chunk in idx.chunks(model.capacity()) {
        let (mut x, y, ids) = model.input_mut(chunk.len());
        test.gather_into(chunk, x.as_slice_mut().expect("the model's input is row-major"), y);
        ids.copy_from_slice(chunk);
        let st = model.forward(chunk.len(), mode);
        sums[0] += st.loss_sum;
        sums[1] += st.correct as f64;
        sums[2] += chunk.len() as f64;
    }
    let mut tot = [0.0f64; 3];
    comm.all_reduce_sum_f64_into(&sums, &mut tot);
    EvalResult { epoch, loss: tot[0] / tot[2].max(1.0), accuracy: tot[1] / tot[2].max(1.0), samples: tot[2] as usize }
}

/// The checkpoint's balancer when it was written on as many ranks with the same settings, else
/// `fresh` (the equal split), saying so on rank 0.
fn continued_balancer(fresh: Balancer, r: &checkpoint::Resumed, rank0: bool) -> Balancer {
    // The global batch: the sum of any split of it.
    let total = |sizes: &[usize]| sizes.iter().sum::<usize>();
    let saved = &r.state.balancer;
    let world = fresh.sizes().len();
    let why = if r.state.world_size != world {
        format!("was written on {} rank(s), this run has {world}", r.state.world_size)
    } else if saved.config() != fresh.config() || total(saved.sizes()) != total(fresh.sizes()) {
        "was written with other [balance] settings".to_string()
    } else {
        return saved.clone();
    };
    if rank0 {
        eprintln!("lbbsp: {} {why}: the balancer restarts from the equal split", r.dir.display());
    }
    fresh
}

fn progress_bar(show: bool, total: usize) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}")
            .expect("valid template"),
    );
    bar
}

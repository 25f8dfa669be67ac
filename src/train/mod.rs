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
//!    ([`SyncTime`](crate::dist::sync::SyncTime)),
//! 4. the balancer, fed the same gathered stats on every rank, computes the same next split
//!    everywhere (no broadcast needed).
//!
//! Given the parameters, the optimizer state, the position in the epoch permutation and the balancer
//! state, the loop is deterministic, so a run resumed from a [`checkpoint`] ends with
//! the same weights as one that never stopped (bit for bit at a fixed split, as under `bsp`).

pub mod checkpoint;
pub mod footprint;
pub mod metrics;
pub mod optim;
pub mod recipe;

use crate::balance::{Balancer, Observation};
use crate::data::dataset::{Dataset, Splits};
use crate::dist::comm::Communicator;
use crate::dist::sync::{GradSync, RankStats};
use crate::error::{Error, Result};
use crate::nn::layers::Mode;
use crate::nn::model::Model;
use crate::profile::CpuSampler;
use crate::shard::{equal_split, rescale, slice_for, EpochPlan};
use crate::train::checkpoint::{Progress, Snapshot};
use crate::train::metrics::{straggler_report, EvalResult, IterRecord, JsonlWriter, Summary};
use crate::train::optim::Optimizer;
use crate::train::recipe::Recipe;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Test aid: stretch one rank's compute time by `factor` from iteration `from_iter` on (it waits
/// `(factor − 1) ×` its measured compute time), to make a deterministic straggler.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slowdown {
    pub rank: usize,
    pub factor: f64,
    pub from_iter: usize,
}

/// Where results go and how a run is observed.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Per-iteration JSONL records (written by rank 0).
    pub metrics: Option<PathBuf>,
    /// Rayon threads per rank (for the summary).
    pub threads: usize,
    /// Show the progress bar and per-epoch lines on rank 0.
    pub progress: bool,
    pub slowdowns: Vec<Slowdown>,
    /// Write checkpoints into this folder (rank 0): every `checkpoint_every` iterations, and after
    /// the last iteration of the run.
    pub checkpoint_dir: Option<PathBuf>,
    pub checkpoint_every: Option<usize>,
    /// Continue from a checkpoint: a folder of checkpoints (its newest valid one) or one `step-<n>`
    /// folder.
    pub resume: Option<PathBuf>,
}

/// Trains `recipe` on `data` over `comm`; returns the same summary on every rank.
pub fn train(recipe: &Recipe, data: &Splits, comm: &dyn Communicator, opts: &RunOptions) -> Result<Summary> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let cfg = &recipe.train;
    let mut balancer = Balancer::new(&recipe.balance, cfg.global_batch, world)?;
    let mut model = Model::new(&recipe.model, &data.train.sample_shape, data.train.classes, cfg.seed)?;
    model.set_capacity(balancer.bounds.iter().map(|b| b.1).max().unwrap_or(1).max(256));
    comm.broadcast_into(0, &mut model.params);
    let mut sync = GradSync::new(model.params.len(), world);
    let mut opt = Optimizer::new(&recipe.optimizer, model.params.len());
    if let (Some(dir), None, 0) = (&opts.checkpoint_dir, &opts.resume, rank) {
        checkpoint::check_fresh(dir)?;
    }
    let start = match &opts.resume {
        None => Progress::default(),
        Some(src) => {
            let r = checkpoint::resume(src, comm, recipe, &mut model, &mut opt)?;
            balancer = continued_balancer(balancer, &r, rank == 0);
            r.state.progress
        }
    };

    let n = data.train.len();
    let iters_per_epoch = n.div_ceil(cfg.global_batch);
    // The schedule spans the planned run whatever `max_iters` stops it at, and wherever it resumes.
    let planned = iters_per_epoch * cfg.epochs;
    let total_iters = cfg.max_iters.map_or(planned, |m| m.min(planned));
    let bar = progress_bar(rank == 0 && opts.progress, total_iters);
    bar.set_position(start.step.min(total_iters) as u64);
    let mut last_saved = None;
    // Every rank takes part (the optimizer's state is current only on each rank's own block until
    // gathered); rank 0 writes.
    let save = |progress: &Progress, model: &Model, opt: &mut Optimizer, balancer: &Balancer| -> Result<()> {
        if opts.checkpoint_dir.is_none() {
            return Ok(());
        }
        for (_, buf) in opt.buffers_mut() {
            let n = buf.len();
            comm.all_gather_blocks(buf, n);
        }
        match (&opts.checkpoint_dir, rank) {
            (Some(dir), 0) => {
                let snap = Snapshot {
                    table: &model.table,
                    params: &model.params,
                    optimizer: opt,
                    balancer,
                    progress,
                    recipe,
                    world_size: world,
                };
                checkpoint::save(dir, &snap).map(|_| ())
            }
            _ => Ok(()),
        }
    };
    let mut metrics = match (&opts.metrics, rank) {
        (Some(p), 0) => Some(JsonlWriter::create(p)?),
        _ => None,
    };

    let mut records: Vec<IterRecord> = Vec::with_capacity(total_iters.saturating_sub(start.step));
    let mut evals = start.evals.clone();
    let mut sampler = CpuSampler::new();
    let (mut iter, mut train_s, mut epochs_run) = (start.step, 0.0f64, start.epoch);
    let mut epoch_loss = start.epoch_loss;
    // Where the next iteration is: (epoch, global batches of it done).
    let mut pos = (start.epoch, start.batch_in_epoch);
    let started = Instant::now();

    let replayed = match &recipe.balance.replay {
        Some(path) => Some(Replay::read(path, world, cfg.global_batch)?),
        None => None,
    };
    let mut obs: Vec<Observation> = Vec::with_capacity(world);
    // (iteration, loss, lr) of a non-finite loss: the same on every rank (the loss is summed from the
    // gathered stats), so all ranks stop together.
    let mut diverged: Option<(usize, f64, f32)> = None;
    'epochs: for epoch in start.epoch..cfg.epochs {
        let plan = EpochPlan::new(n, cfg.global_batch, cfg.seed, epoch as u64);
        let first = if epoch == start.epoch { start.batch_in_epoch } else { 0 };
        if first == 0 {
            epoch_loss = (0.0, 0);
        }
        for t in first..plan.iterations() {
            if iter >= total_iters {
                break 'epochs;
            }
            let t_iter = Instant::now();
            let unix_s =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
            let batch = plan.batch(t);
            // The balancer's split of B; the short last batch of an epoch keeps its proportions.
            let sizes = match &replayed {
                Some(r) => r.sizes(iter, batch.len())?,
                None => rescale(balancer.sizes(), batch.len()),
            };
            let slice = &batch[slice_for(&sizes, rank)];
            let mode = Mode { train: true, seed: cfg.seed, epoch: epoch as u64 };

            let lr = recipe.optimizer.lr_at(iter, iters_per_epoch, planned);
            let clip = recipe.optimizer.clip_grad_norm;

            // Compute: this rank's share of Σ_j ∇ℓ_j / B.
            let t0 = Instant::now();
            let (x, y, ids) = model.input_mut(slice.len());
            data.train.gather_into(slice, x, y);
            ids.copy_from_slice(slice);
            let scale = 1.0 / batch.len() as f32;
            let local = model.forward_backward(slice.len(), scale, mode);
            stretch(&opts.slowdowns, rank, iter, t0.elapsed());
            let compute_s = t0.elapsed().as_secs_f64();
            let cpu = sampler.sample();
            let mine = RankStats {
                batch: slice.len(),
                compute_s,
                loss_sum: local.loss_sum,
                interference_s: cpu.interference_s,
                cpu_share: cpu.cpu_share,
            };

            // ---- The distributed step: the weighted gradient allreduce, cut in its two halves
            // around the optimizer. Each rank contributed its gradient *sum* / B, so the sum over
            // ranks is the exact mean over the global batch. The reduce-scatter leaves each rank
            // that sum on its own block of the parameters (with every rank's stats riding along);
            // it updates only that block, and the all-gather hands the updated blocks to all
            // ranks: an allreduce's bytes, 1/world of the optimizer's work each (ZeRO stage 1).
            // Fast ranks block until the slowest arrives: the time is split into wait (for the
            // slowest rank's compute) and transfer, see `SyncTime`. ----
            let block = sync.reduce_scatter(comm, &mut model.grads, &mine);
            if let Some(max_norm) = clip {
                sync.clip_grad_norm(comm, &mut model.grads[block.clone()], max_norm);
            }
            opt.step_block(&mut model.params, &model.grads, lr, block);
            let took = sync.all_gather(comm, &mut model.params);
            obs.clear();
            obs.extend(sync.stats.iter().map(|s| Observation { batch: s.batch, compute_s: s.compute_s }));
            balancer.observe(&obs);

            let iter_s = t_iter.elapsed().as_secs_f64();
            train_s += iter_s;
            let loss = sync.stats.iter().map(|s| s.loss_sum).sum::<f64>() / batch.len() as f64;
            if !loss.is_finite() {
                diverged = Some((iter, loss, lr));
            }
            epoch_loss.0 += loss;
            epoch_loss.1 += 1;
            records.push(IterRecord {
                iter,
                unix_s,
                epoch,
                loss,
                lr,
                global_batch: batch.len(),
                batch_sizes: sizes.clone(),
                compute_s: sync.stats.iter().map(|s| s.compute_s).collect(),
                wait_s: vec![took.wait_s],
                comm_s: vec![took.comm_s],
                interference_s: sync.stats.iter().map(|s| s.interference_s).collect(),
                cpu_share: sync.stats.iter().map(|s| s.cpu_share).collect(),
                iter_s,
                samples_per_s: batch.len() as f64 / iter_s,
            });
            bar.set_position(iter as u64 + 1);
            if !bar.is_hidden() {
                bar.set_message(format!("loss {loss:.4}  {:.0} samples/s  b={sizes:?}", batch.len() as f64 / iter_s));
            }
            if diverged.is_some() {
                break 'epochs;
            }
            iter += 1;
            pos = (epoch, t + 1);
            if opts.checkpoint_every.is_some_and(|k| iter % k == 0) {
                save(&progress_at(iter, pos, epoch_loss, &evals), &model, &mut opt, &balancer)?;
                last_saved = Some(iter);
            }
        }
        balancer.end_epoch();
        epochs_run = epoch + 1;
        if epochs_run % cfg.eval_every_epochs == 0 || epochs_run == cfg.epochs {
            let ev = evaluate(&mut model, &data.test, comm, epoch);
            if rank == 0 && opts.progress {
                let line = format!(
                    "epoch {epochs_run}/{}: train loss {:.4}  test loss {:.4}  test accuracy {:.2}%",
                    cfg.epochs,
                    epoch_loss.0 / epoch_loss.1.max(1) as f64,
                    ev.loss,
                    100.0 * ev.accuracy
                );
                if bar.is_hidden() {
                    eprintln!("{line}");
                } else {
                    bar.println(line);
                }
            }
            evals.push(ev);
        }
        pos = (epoch + 1, 0);
    }
    bar.finish_and_clear();
    if diverged.is_none() && iter > start.step && last_saved != Some(iter) {
        save(&progress_at(iter, pos, epoch_loss, &evals), &model, &mut opt, &balancer)?;
    }

    // Wait and transfer times are per rank but only known after the iteration's collective, so
    // they are gathered once at the end (one collective, not one per iteration).
    fill_late_columns(&mut records, comm);
    if let Some(w) = metrics.as_mut() {
        for r in &records {
            w.write(r)?;
        }
        w.flush()?;
    }
    if let Some((iter, loss, lr)) = diverged {
        return Err(Error::Diverged { iter, loss, lr });
    }
    if evals.last().is_none_or(|e| e.epoch + 1 != epochs_run) {
        evals.push(evaluate(&mut model, &data.test, comm, epochs_run.saturating_sub(1)));
    }
    let last = *evals.last().expect("evaluated at least once");
    let samples: usize = records.iter().map(|r| r.global_batch).sum();
    Ok(Summary {
        recipe: recipe.name.clone(),
        policy: recipe.balance.policy.name().into(),
        isa: crate::kernels::isa::Isa::active().name().into(),
        world_size: world,
        threads_per_rank: opts.threads,
        iterations: iter,
        epochs: epochs_run,
        test_accuracy: last.accuracy,
        test_loss: last.loss,
        final_loss: records.last().map_or(f64::NAN, |r| r.loss),
        last_epoch_loss: epoch_loss.0 / epoch_loss.1.max(1) as f64,
        wall_s: started.elapsed().as_secs_f64(),
        samples_per_s: samples as f64 / train_s.max(1e-9),
        evals,
        stragglers: straggler_report(&records),
    })
}

/// The batch sizes of an earlier run (`balance.replay`), by iteration.
struct Replay {
    path: PathBuf,
    sizes: Vec<Vec<usize>>,
}

impl Replay {
    fn read(path: &std::path::Path, world: usize, global_batch: usize) -> Result<Replay> {
        let records = crate::train::metrics::read_records(path)?;
        let mut sizes = Vec::with_capacity(records.len());
        for (i, r) in records.iter().enumerate() {
            if r.iter != i {
                let msg = format!(
                    "record {} is iteration {}: the file must hold iterations 0, 1, 2, … in order",
                    i + 1,
                    r.iter
                );
                return Err(Error::data(path, msg));
            }
            if r.batch_sizes.len() != world || r.global_batch > global_batch {
                let msg = format!(
                    "iteration {i} split B = {} over {} rank(s); this run has B = {global_batch} on {world} rank(s)                      (balance.replay needs a run of the same recipe on as many ranks)",
                    r.global_batch,
                    r.batch_sizes.len()
                );
                return Err(Error::data(path, msg));
            }
            sizes.push(r.batch_sizes.clone());
        }
        Ok(Replay { path: path.to_path_buf(), sizes })
    }

    /// The sizes of iteration `iter`, whose batch holds `batch` samples.
    fn sizes(&self, iter: usize, batch: usize) -> Result<Vec<usize>> {
        match self.sizes.get(iter) {
            Some(s) if s.iter().sum::<usize>() == batch => Ok(s.clone()),
            Some(s) => Err(Error::data(
                &self.path,
                format!("iteration {iter} split {} samples, this run's batch has {batch}", s.iter().sum::<usize>()),
            )),
            None => Err(Error::data(
                &self.path,
                format!(
                    "holds {} iterations, this run reached iteration {iter}: replay a run at least as long",
                    self.sizes.len()
                ),
            )),
        }
    }
}

/// Loss and accuracy on `test`, each rank taking a contiguous shard, reduced over ranks.
pub fn evaluate(model: &mut Model, test: &Dataset, comm: &dyn Communicator, epoch: usize) -> EvalResult {
    let shard = slice_for(&equal_split(test.len(), comm.world_size()), comm.rank());
    let idx: Vec<usize> = shard.collect();
    let mode = Mode { train: false, seed: 0, epoch: epoch as u64 };
    let mut sums = [0.0f64; 3];
    for chunk in idx.chunks(model.capacity()) {
        let (x, y, ids) = model.input_mut(chunk.len());
        test.gather_into(chunk, x, y);
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
    let saved = &r.state.balancer;
    let world = fresh.sizes().len();
    let why = if r.state.world_size != world {
        format!("was written on {} rank(s), this run has {world}", r.state.world_size)
    } else if saved.cfg != fresh.cfg || saved.global_batch != fresh.global_batch {
        "was written with other [balance] settings".to_string()
    } else {
        return saved.clone();
    };
    if rank0 {
        eprintln!("lbbsp: {} {why}: the balancer restarts from the equal split", r.dir.display());
    }
    fresh
}

fn progress_at(
    step: usize,
    (epoch, batch_in_epoch): (usize, usize),
    epoch_loss: (f64, usize),
    evals: &[EvalResult],
) -> Progress {
    Progress { step, epoch, batch_in_epoch, epoch_loss, evals: evals.to_vec() }
}

/// Replaces each record's one-element `wait_s`/`comm_s` (this rank's) with the per-rank arrays.
fn fill_late_columns(records: &mut [IterRecord], comm: &dyn Communicator) {
    let world = comm.world_size();
    let mine: Vec<f64> = records.iter().flat_map(|r| [r.wait_s[0], r.comm_s[0]]).collect();
    let mut all = vec![0.0; mine.len() * world];
    comm.all_gather_into(&mine, &mut all);
    let per_rank = mine.len();
    for (i, r) in records.iter_mut().enumerate() {
        r.wait_s = (0..world).map(|k| all[k * per_rank + 2 * i]).collect();
        r.comm_s = (0..world).map(|k| all[k * per_rank + 2 * i + 1]).collect();
    }
}

fn stretch(slowdowns: &[Slowdown], rank: usize, iter: usize, took: Duration) {
    for s in slowdowns {
        if s.rank == rank && iter >= s.from_iter && s.factor > 1.0 {
            // Sleep most of the extra time (freeing the core, as a rank descheduled by a co-located
            // job would), then spin to the deadline: waking an idle (virtual) CPU can take a
            // millisecond or more, a fixed cost the factor does not ask for.
            let deadline = Instant::now() + took.mul_f64(s.factor - 1.0);
            if let Some(nap) = deadline.checked_duration_since(Instant::now() + Duration::from_millis(2)) {
                std::thread::sleep(nap);
            }
            while Instant::now() < deadline {
                std::hint::spin_loop();
            }
        }
    }
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

//! Your own training loop with lbbsp's pieces: the communicator, the sharder, the profiler, the
//! one-collective gradient sync and the balancer, without the CLI. Least-squares regression on
//! synthetic data, gradients by hand.
//!
//!     cargo build --release --example custom_loop
//!     mpirun -n 2 target/release/examples/custom_loop          # or run it alone: one rank
//!
//! Rank 1 is made artificially slower (it does its work twice), so LB-BSP gives it fewer samples.
//! The iteration follows `lbbsp::train::Run::step`, the CLI's: slice, compute, the distributed step,
//! the balancer's observation.

use lbbsp::balance::{BalanceConfig, Balancer, Observation, Policy, PolicyKind};
use lbbsp::data::rng::Rng;
use lbbsp::dist::comm::Communicator;
use lbbsp::dist::mpi::Mpi;
use lbbsp::dist::sync::{GradSync, RankStats};
use lbbsp::profile::CpuSampler;
use lbbsp::shard::{slice_for, EpochPlan};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let comm = Mpi::init()?;
    let (rank, world) = (comm.rank(), comm.world_size());

    // Synthetic data y = x·w* + noise, the same on every rank (seeded).
    let (n, d, global_batch) = (20_000, 32, 256);
    let mut rng = Rng::from_keys(&[7]);
    let w_true: Vec<f32> = (0..d).map(|_| rng.uniform(1.0)).collect();
    let x: Vec<f32> = (0..n * d).map(|_| rng.uniform(1.0)).collect();
    let y: Vec<f32> =
        x.chunks(d).map(|r| r.iter().zip(&w_true).map(|(a, b)| a * b).sum::<f32>() + 0.01 * rng.normal()).collect();

    let mut w = vec![0.0f32; d];
    comm.broadcast_into(0, &mut w); // everyone starts from rank 0's parameters
    let cfg = BalanceConfig { policy: PolicyKind::Lbbsp, ..Default::default() };
    let mut balancer = Balancer::new(&cfg, global_batch, world)?;
    let mut cpu = CpuSampler::new();
    let mut local_grad = vec![0.0f32; d];
    let mut sync = GradSync::new(d, world);
    let mut obs: Vec<Observation> = Vec::with_capacity(world);
    let mut last_balance_s = 0.0;

    for epoch in 0..3 {
        let plan = EpochPlan::new(n, global_batch, 1, epoch);
        for t in 0..plan.iterations() {
            // This rank's slice: the balancer's split of B.
            let batch = plan.batch(t);
            let sizes = balancer.split(batch.len());
            let mine = &batch[slice_for(&sizes, rank)];

            // Compute: this rank's gradient *sum* over its slice, weighted by 1/B, and its loss sum.
            cpu.mark();
            let repeats = if rank == 1 { 2 } else { 1 }; // a pretend straggler
            let mut loss_sum = 0.0f64;
            for _ in 0..repeats {
                local_grad.fill(0.0);
                loss_sum = 0.0;
                for &i in mine {
                    let xi = &x[i * d..(i + 1) * d];
                    let err = xi.iter().zip(&w).map(|(a, b)| a * b).sum::<f32>() - y[i];
                    for (g, a) in local_grad.iter_mut().zip(xi) {
                        *g += err * a / batch.len() as f32;
                    }
                    loss_sum += 0.5 * (err * err) as f64;
                }
            }
            let s = cpu.sample();
            let stats = RankStats {
                batch: mine.len(),
                // The sample's interval: a CPU quota's freeze that the compute ran into lands in it.
                compute_s: s.wall_s,
                loss_sum,
                interference_s: s.interference_s,
                cpu_share: s.cpu_share,
                preemptions: s.preemptions,
                frozen_s: s.frozen_s,
                // What its balancer's last step took: how often a decision is worth its time.
                prev_balance_s: last_balance_s,
                ..RankStats::default()
            };

            // ---- The distributed step ----: Σ_ranks (gradient sum / B) = the exact mean gradient
            // of the batch, and in the same allreduce every rank learns every rank's stats.
            sync.all_reduce(&comm, &mut local_grad, &stats);
            for (wi, g) in w.iter_mut().zip(sync.grad()) {
                *wi -= 0.5 * g;
            }
            // Every rank feeds the balancer the same gathered (b_i, t_i): the same next split
            // everywhere. `Run::step` builds its observations with this same call: the CPU
            // measures are the whole process's, and the balancer compares ranks per core, so they
            // are divided by the threads the rank computes on (1: this loop runs on one thread; a
            // loop on a rayon pool passes the pool's size).
            sync.observations_into(1, &mut obs);
            let balancing = Instant::now();
            balancer.observe(&obs);
            last_balance_s = balancing.elapsed().as_secs_f64();
            if rank == 0 && t == plan.iterations() - 1 {
                let loss = sync.stats.iter().map(|s| s.loss_sum).sum::<f64>() / batch.len() as f64;
                println!(
                    "epoch {epoch}: loss {loss:.5}  sizes {:?}  cpu share {:.2}  interference {:.3} s",
                    balancer.sizes(),
                    s.cpu_share,
                    s.interference_s
                );
            }
        }
    }
    let err: f32 = w.iter().zip(&w_true).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    if rank == 0 {
        println!("max |w − w*| = {err:.4}");
    }
    anyhow::ensure!(err < 0.05, "did not converge: max |w − w*| = {err}");
    Ok(())
}

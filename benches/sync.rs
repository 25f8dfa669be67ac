//! Cost of lbbsp's per-iteration synchronisation against a bare `MPI_Allreduce` of the same gradient.
//! Run it under MPI (alone it is one rank, and every collective is a copy):
//!
//!     scripts/bench_sync.sh                  # mpirun -n 2, one rank per core
//!
//! For the gradients of the shipped W1 MLP (mnist-mlp) and LeNet-5 (mnist-lenet5) it interleaves
//! repetitions of
//! - `bare`:   rsmpi `all_reduce_into` of the gradient (MPI_Allreduce, sum, f32), nothing else;
//! - `lbbsp`:  the training loop's whole synchronisation, [`GradSync::reduce_scatter`] then
//!   [`GradSync::all_gather`] of the parameters (gradient and every rank's stats, stats decoded,
//!   wait/transfer split; the optimizer step between them is not timed);
//! - `allreduce`: [`GradSync::all_reduce`], the same as one allreduce (the ring from 16 KB on) for a
//!   loop that updates every parameter on every rank;
//!
//! with a barrier before each call and the order rotated every repetition, so each measures its
//! collective from a common start. A repetition's time is the slowest rank's; the table shows
//! medians and 10th percentiles (the quiet-machine cost) and their ratios to `bare` (the target is
//! `lbbsp / bare ≤ 1.1`). `REPS` sets the count.

use lbbsp::dist::comm::Communicator;
use lbbsp::dist::mpi::Mpi;
use lbbsp::dist::slowest_sorted;
use lbbsp::dist::sync::{GradSync, RankStats};
use lbbsp::nn::model::Model;
use mpi::collective::SystemOperation;
use mpi::traits::CommunicatorCollectives;
use std::hint::black_box;
use std::time::Instant;

const METHODS: [&str; 3] = ["bare", "lbbsp", "allreduce"];

fn main() -> anyhow::Result<()> {
    let comm = Mpi::init()?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let reps: usize = std::env::var("REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(400);
    if rank == 0 {
        println!("{world} rank(s), {reps} repetitions each, interleaved; times are the slowest rank's");
        println!(
            "{:<14} {:>9} {:>11} {:>11} {:>11} {:>12} {:>10}",
            "gradient", "floats", "bare", "lbbsp", "allreduce", "lbbsp/bare", "allr/bare"
        );
    }
    for name in ["mnist-mlp", "mnist-lenet5"] {
        let recipe = lbbsp::train::recipe::resolve(name, &[])?;
        let n = Model::new(&recipe.model, &[1, 28, 28], 10, recipe.train.seed)?.params.len();
        let times = measure(&comm, n, reps);
        // Per method, the slowest rank's time of each repetition, sorted.
        let sorted: Vec<Vec<f64>> = (0..METHODS.len())
            .map(|m| {
                let mine: Vec<f64> = (0..reps).map(|i| times[i * METHODS.len() + m]).collect();
                slowest_sorted(&comm, &mine)
            })
            .collect();
        if rank == 0 {
            let med: Vec<f64> = sorted.iter().map(|v| v[v.len() / 2]).collect();
            // The 10th percentile: the cost on a quiet machine.
            let p10: Vec<f64> = sorted.iter().map(|v| v[v.len() / 10]).collect();
            let row = |label: &str, size: String, t: &[f64]| {
                let us = |x: f64| 1e6 * x;
                println!(
                    "{label:<14} {size:>9} {:>8.1} µs {:>8.1} µs {:>8.1} µs {:>12.3} {:>10.3}",
                    us(t[0]),
                    us(t[1]),
                    us(t[2]),
                    t[1] / t[0],
                    t[2] / t[0]
                );
            };
            row(name, n.to_string(), &med);
            row("  10th pct", String::new(), &p10);
        }
    }
    Ok(())
}

/// Seconds of each method in each repetition, `[rep][method]` flattened.
fn measure(comm: &Mpi, n: usize, reps: usize) -> Vec<f64> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let fresh: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 1e-3 + rank as f32).collect();
    let mut grads = fresh.clone();
    let mut params = vec![0.5f32; n];
    let mut summed = vec![0.0f32; n];
    // Each method has its own `GradSync`, as a loop would.
    let (mut sharded, mut whole) = (GradSync::new(n, world), GradSync::new(n, world));
    let mine = RankStats {
        batch: 64,
        compute_s: 1e-3,
        loss_sum: 140.0,
        interference_s: 0.0,
        cpu_share: 1.0,
        ..Default::default()
    };
    let mut times = vec![0.0f64; reps * METHODS.len()];
    let mut run = |m: usize, grads: &mut Vec<f32>| match m {
        0 => comm.world().all_reduce_into(&grads[..], &mut summed[..], SystemOperation::sum()),
        1 => {
            black_box(sharded.reduce_scatter(comm, grads, &mine));
            black_box(sharded.all_gather(comm, &mut params));
        }
        _ => {
            black_box(whole.all_reduce(comm, grads, &mine));
        }
    };
    // Warm up: first-touch of the buffers, MPI's connection setup, the tails' one-time growth.
    for _ in 0..20 {
        for m in 0..METHODS.len() {
            run(m, &mut grads);
        }
    }
    for i in 0..reps {
        for k in 0..METHODS.len() {
            let m = (i + k) % METHODS.len();
            // The reduce-scatter sums in place: every method starts from the same gradient.
            grads.copy_from_slice(&fresh);
            comm.barrier();
            let t = Instant::now();
            run(m, &mut grads);
            times[i * METHODS.len() + m] = t.elapsed().as_secs_f64();
        }
    }
    black_box((&grads, &params));
    times
}

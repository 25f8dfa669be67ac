//! `lbbsp bench`: the numbers a user compares with other frameworks.
//!
//! - Throughput of the real training loop ([`lbbsp::train::train`]: sharder, balancer, communicator,
//!   optimizer) on the two peer workloads, W1 (`models/bench-w1.toml`) and W2 (`bench-w2.toml`), on
//!   [`random-mnist`](lbbsp::data::load::random_mnist). Samples/s is `Σ B / Σ t_iter` over iterations
//!   `warmup..iters` from the loop's per-iteration wall times, as the peers time iterations 20–200;
//!   data generation and the final evaluation are not counted.
//! - Memory: the peak resident set (`VmHWM`) of the run against the bytes it must hold
//!   ([`Footprint`](lbbsp::train::footprint::Footprint): data set, parameters, gradients, optimizer state, activations).
//! - GEMM: GFLOP/s of [`lbbsp::kernels::gemm::gemm`] on 2048³ and on the layer shapes of W1.
//! - Allreduce: the [`ring`](lbbsp::dist::ring) against `MPI_Allreduce` on the same buffers, results
//!   checked ([`allreduce`]).

use lbbsp::data::rng::Rng;
use lbbsp::dist::comm::Communicator;
use lbbsp::dist::mpi::{Allreduce, Mpi};
use lbbsp::error::{Error, Result};
use lbbsp::kernels::gemm::{gemm, Trans};
use lbbsp::train::metrics::IterRecord;
use std::time::Instant;

/// A peer workload: its shipped recipe and the name the peer scripts give it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// MLP 784-512-256-10, batch 128.
    W1,
    /// LeNet-5 without padding, batch 64.
    W2,
}

impl Workload {
    pub fn recipe(self) -> &'static str {
        match self {
            Workload::W1 => "bench-w1",
            Workload::W2 => "bench-w2",
        }
    }
    /// `model=` in the peers' RESULT lines.
    pub fn model(self) -> &'static str {
        match self {
            Workload::W1 => "mlp",
            Workload::W2 => "cnn",
        }
    }
}

/// Global samples per second over `records[warmup..]` (`Σ B / Σ t_iter`), and the last loss.
pub fn throughput(records: &[IterRecord], warmup: usize) -> Result<(f64, f64)> {
    let timed = records.get(warmup..).filter(|t| !t.is_empty()).ok_or_else(|| {
        Error::config("bench", format!("{} iterations leave none to time after {warmup} of warm-up", records.len()))
    })?;
    let samples: usize = timed.iter().map(|r| r.global_batch).sum();
    let secs: f64 = timed.iter().map(|r| r.iter_s).sum();
    Ok((samples as f64 / secs, timed.last().map_or(f64::NAN, |r| r.loss)))
}

/// One GEMM shape: `C (m×n) = op(A) · op(B)`.
#[derive(Debug, Clone, Copy)]
pub struct GemmCase {
    pub name: &'static str,
    pub ta: Trans,
    pub tb: Trans,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// 2048³, then the products of W1's two large layers (batch 128): forward `x·Wᵀ`, weight gradient
/// `dyᵀ·x`, input gradient `dy·W`.
pub fn gemm_cases() -> Vec<GemmCase> {
    let case = |name, ta, tb, m, n, k| GemmCase { name, ta, tb, m, n, k };
    vec![
        case("square-2048", Trans::N, Trans::N, 2048, 2048, 2048),
        case("fc1-fwd", Trans::N, Trans::T, 128, 512, 784),
        case("fc1-dw", Trans::T, Trans::N, 512, 784, 128),
        case("fc1-dx", Trans::N, Trans::N, 128, 784, 512),
        case("fc2-fwd", Trans::N, Trans::T, 128, 256, 512),
        case("fc2-dw", Trans::T, Trans::N, 256, 512, 128),
        case("fc2-dx", Trans::N, Trans::N, 128, 512, 256),
    ]
}

/// Median and best GFLOP/s of `reps` timed samples of `c`, each long enough (≥ 20 ms, repeating
/// the product) to time reliably, after a warm-up.
pub fn gemm_gflops(c: &GemmCase, reps: usize) -> (f64, f64) {
    let mut rng = Rng::from_keys(&[0x6765_6d6d]);
    let mut fill = |len: usize| (0..len).map(|_| rng.next_f32()).collect::<Vec<f32>>();
    let (a, b, mut out) = (fill(c.m * c.k), fill(c.k * c.n), vec![0.0f32; c.m * c.n]);
    let flops = 2.0 * (c.m * c.n * c.k) as f64;
    let mut run = |times: usize| {
        let t = Instant::now();
        for _ in 0..times {
            gemm(c.ta, c.tb, c.m, c.n, c.k, 1.0, &a, &b, 0.0, &mut out);
        }
        t.elapsed().as_secs_f64()
    };
    let once = run(3) / 3.0;
    let inner = ((0.02 / once.max(1e-9)).ceil() as usize).max(1);
    let mut rates: Vec<f64> = (0..reps.max(1)).map(|_| flops * inner as f64 / run(inner) / 1e9).collect();
    rates.sort_by(f64::total_cmp);
    (rates[rates.len() / 2], rates[rates.len() - 1])
}

/// One buffer size of [`allreduce`]: median seconds of each algorithm (the slowest rank's).
#[derive(Debug, Clone, Copy)]
pub struct AllreduceRow {
    pub floats: usize,
    pub mpi_s: f64,
    pub ring_s: f64,
    /// Through the shared window (ranks on several nodes: the ring again).
    pub shm_s: f64,
}

impl AllreduceRow {
    /// The median of algorithm `a`.
    pub fn seconds(&self, a: Allreduce) -> f64 {
        match a {
            Allreduce::Mpi => self.mpi_s,
            Allreduce::Ring => self.ring_s,
            Allreduce::Shared => self.shm_s,
        }
    }
}

/// Times `MPI_Allreduce`, the ring and the shared window (each of the last two from
/// the ring's minimum of 4096 floats on) on each size, interleaved in rotating order, `reps`
/// times after a warm-up, a barrier before each call.
/// The buffers hold small integers, whose sums are exact in any order: each result, and that of the
/// reduce-scatter + all-gather pair the training loop uses, is checked against the closed form on
/// every rank; a wrong sum is an error naming the size.
pub fn allreduce(comm: &Mpi, sizes: &[usize], reps: usize) -> Result<Vec<AllreduceRow>> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut rows = Vec::with_capacity(sizes.len());
    for &n in sizes {
        let value = |r: usize, i: usize| ((i * 7 + r * 13) % 101) as f32;
        let send: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
        let want: Vec<f32> = (0..n).map(|i| (0..world).map(|r| value(r, i)).sum()).collect();
        let mut recv = vec![0.0f32; n];
        const ALGOS: [Allreduce; 3] = [Allreduce::Mpi, Allreduce::Ring, Allreduce::Shared];
        let mut times = ALGOS.map(|_| Vec::with_capacity(reps));
        for rep in 0..reps + 3 {
            for k in 0..ALGOS.len() {
                let which = (rep + k) % ALGOS.len();
                let algo = ALGOS[which];
                recv.fill(f32::NAN);
                comm.barrier();
                let t = Instant::now();
                comm.all_reduce_sum_with(algo, &send, &mut recv);
                let took = t.elapsed().as_secs_f64();
                if recv != want {
                    return Err(Error::Comm(format!(
                        "allreduce of {n} floats ({algo:?}) gave a wrong sum on rank {rank}"
                    )));
                }
                if rep >= 3 {
                    times[which].push(took);
                }
            }
        }
        let med = times.map(|t| {
            let slowest = lbbsp::dist::slowest_sorted(comm, &t);
            slowest.get(slowest.len() / 2).copied().unwrap_or(f64::NAN)
        });
        // The training loop's halves, in place, with a tail on the last block: the same sum.
        recv.copy_from_slice(&send);
        let split = n - n / 10;
        comm.reduce_scatter_sum(&mut recv, split);
        comm.all_gather_blocks(&mut recv, split);
        if recv != want {
            return Err(Error::Comm(format!(
                "reduce-scatter + all-gather of {n} floats gave a wrong sum on rank {rank}"
            )));
        }
        rows.push(AllreduceRow { floats: n, mpi_s: med[0], ring_s: med[1], shm_s: med[2] });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(global_batch: usize, iter_s: f64, loss: f64) -> IterRecord {
        IterRecord {
            iter: 0,
            unix_s: 0.0,
            epoch: 0,
            loss,
            lr: 0.05,
            global_batch,
            batch_sizes: vec![global_batch],
            compute_s: vec![iter_s],
            wait_s: vec![0.0],
            comm_s: vec![0.0],
            interference_s: vec![0.0],
            cpu_share: vec![1.0],
            preemptions: Vec::new(),
            frozen_s: Vec::new(),
            run_share: Vec::new(),
            balance_s: Vec::new(),
            iter_s,
            samples_per_s: global_batch as f64 / iter_s,
        }
    }

    #[test]
    fn throughput_skips_the_warm_up_and_weights_by_time() {
        let r = [rec(128, 10.0, 9.0), rec(128, 0.5, 2.0), rec(64, 0.25, 1.5)];
        let (sps, loss) = throughput(&r, 1).unwrap();
        assert!((sps - 192.0 / 0.75).abs() < 1e-9, "{sps}");
        assert_eq!(loss, 1.5);
        assert!(throughput(&r, 3).unwrap_err().to_string().contains("warm-up"));
    }
}

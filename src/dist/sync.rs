//! The per-iteration synchronisation: one collective carries both the gradient and the stats.
//!
//! Every iteration each rank needs (a) the sum of all local gradients and (b) every rank's
//! `(b_i, compute_i, loss, …)` for the balancer and the metrics. Two collectives would mean two
//! synchronisation points, each a chance to be descheduled on a busy machine, so [`GradSync`]
//! does both in one allreduce-sum of the buffer
//!
//! ```text
//! [ local gradient (P floats) | slot of rank 0 | slot of rank 1 | … ]   (STATS_SLOTS floats a slot)
//! ```
//!
//! where each rank writes its stats into its own slot and zeros into the others'. Summing adds only
//! zeros to a slot's values, `x + 0 = x`, so the tail of the result is an exact all-gather. The
//! stats are f64 (seconds, loss sums): each travels as its 64 bits split into three integers below
//! 2²², which f32 holds exactly, so every rank decodes bit for bit the f64 the owner sent.
//!
//! The training loop uses the sum in its two halves ([`GradSync::reduce_scatter`], then
//! [`GradSync::all_gather`] of the updated parameters): the stats are summed with the gradient's
//! last block and travel back to every rank with the parameters' all-gather. That is two
//! synchronisation points (three with gradient clipping, whose norm needs one more small
//! allreduce), but it leaves each rank `1/world` of the optimizer's work.

use crate::balance::Observation;
use crate::dist::clip::{clip_grad_norm, clip_grad_norm_blocks};
use crate::dist::comm::{my_block, Communicator};
use std::ops::Range;
use std::time::Instant;

/// One rank's statistics of an iteration.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankStats {
    /// Samples this rank processed.
    pub batch: usize,
    /// Seconds of gather + forward + backward (waiting excluded).
    pub compute_s: f64,
    /// `Σ_{j ∈ slice} ℓ_j`.
    pub loss_sum: f64,
    /// CPU seconds other processes used on this rank's cores during the iteration.
    pub interference_s: f64,
    /// This process's CPU time over the iteration's wall time.
    pub cpu_share: f64,
    /// Times this process was descheduled while computing (see [`crate::profile::process_preemptions`]).
    pub preemptions: f64,
    /// Seconds this process's threads waited to run while computing (see
    /// [`crate::profile::CpuSample::frozen_s`]).
    pub frozen_s: f64,
    /// This process's CPU time over the wall time of its previous iteration, compute and collective
    /// (0 before the first): it rides on the next iteration, as `prev_sync` does.
    pub prev_run_share: f64,
    /// The wall seconds of that previous iteration, over which `prev_run_share` was measured.
    pub prev_run_s: f64,
    /// Seconds this rank's balancer took over its previous step (0 before the first), riding on the
    /// next iteration alike.
    pub prev_balance_s: f64,
    /// This rank's [`SyncTime`] of its previous iteration. It is known only once that iteration's
    /// collective has ended, so it rides on the next one: the metrics' wait and transfer columns
    /// trail by one iteration instead of costing a collective of their own.
    pub prev_sync: SyncTime,
    /// The stop signal this rank has received (its number; 0: none), see [`crate::train::stop`]:
    /// riding here, it reaches every rank in the same gathered stats.
    pub stop: i32,
}

/// 64-bit words in a [`RankStats`].
const WORDS: usize = 13;
/// f32 slots a 64-bit word travels in: 22 + 21 + 21 bits.
const SLOTS_PER_WORD: usize = 3;
/// f32 slots of one rank's stats in the synchronised buffer.
pub const STATS_SLOTS: usize = WORDS * SLOTS_PER_WORD;
const LOW21: u64 = (1 << 21) - 1;

impl RankStats {
    fn words(&self) -> [u64; WORDS] {
        [
            self.batch as u64,
            self.compute_s.to_bits(),
            self.loss_sum.to_bits(),
            self.interference_s.to_bits(),
            self.cpu_share.to_bits(),
            self.preemptions.to_bits(),
            self.frozen_s.to_bits(),
            self.prev_run_share.to_bits(),
            self.prev_balance_s.to_bits(),
            self.prev_sync.wait_s.to_bits(),
            self.prev_sync.comm_s.to_bits(),
            self.prev_run_s.to_bits(),
            self.stop as u32 as u64,
        ]
    }

    /// Writes the stats into `slot` (`STATS_SLOTS` floats), each value as exact small integers.
    fn encode(&self, slot: &mut [f32]) {
        for (w, out) in self.words().into_iter().zip(slot.chunks_exact_mut(SLOTS_PER_WORD)) {
            out[0] = (w >> 42) as f32;
            out[1] = ((w >> 21) & LOW21) as f32;
            out[2] = (w & LOW21) as f32;
        }
    }

    fn decode(slot: &[f32]) -> RankStats {
        let mut w = [0u64; WORDS];
        for (w, s) in w.iter_mut().zip(slot.chunks_exact(SLOTS_PER_WORD)) {
            *w = ((s[0] as u64) << 42) | ((s[1] as u64) << 21) | s[2] as u64;
        }
        RankStats {
            batch: w[0] as usize,
            compute_s: f64::from_bits(w[1]),
            loss_sum: f64::from_bits(w[2]),
            interference_s: f64::from_bits(w[3]),
            cpu_share: f64::from_bits(w[4]),
            preemptions: f64::from_bits(w[5]),
            frozen_s: f64::from_bits(w[6]),
            prev_run_share: f64::from_bits(w[7]),
            prev_balance_s: f64::from_bits(w[8]),
            prev_sync: SyncTime { wait_s: f64::from_bits(w[9]), comm_s: f64::from_bits(w[10]) },
            prev_run_s: f64::from_bits(w[11]),
            stop: w[12] as u32 as i32,
        }
    }
}

/// How this rank's time in the collective divides.
///
/// One collective cannot tell waiting from moving bytes, so the wait is inferred from the gathered
/// compute times: this rank waited for the slowest rank to finish computing,
/// `wait_i = max_j compute_j − compute_i`, clamped to `[0, collective seconds]`, and the rest of the
/// collective is transfer. (Ranks start computing at slightly different moments, so it is an
/// estimate; `wait + transfer` is exactly the measured collective.)
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SyncTime {
    pub wait_s: f64,
    pub comm_s: f64,
}

/// The buffers of the per-iteration synchronisation, sized once for `params` floats and `world`
/// ranks; a step allocates nothing.
pub struct GradSync {
    params: usize,
    /// `[Σ_ranks gradient | every rank's stats slot]` after [`GradSync::all_reduce`]; the sharded
    /// path uses only its stats tail (the gradient part stays untouched, unpaged memory).
    summed: Vec<f32>,
    /// Every rank's stats in rank order, after [`GradSync::all_reduce`] or
    /// [`GradSync::all_gather`].
    pub stats: Vec<RankStats>,
    /// Seconds of the last [`GradSync::reduce_scatter`].
    scatter_s: f64,
    /// Whether the last [`GradSync::reduce_scatter`] left only this rank's block summed (else the
    /// whole gradient and stats are summed everywhere and [`GradSync::all_gather`] moves nothing).
    scattered: bool,
}

impl GradSync {
    pub fn new(params: usize, world: usize) -> GradSync {
        // Zeroed pages: the sharded path touches only the stats tail of `summed`.
        GradSync {
            params,
            summed: vec![0.0; params + world * STATS_SLOTS],
            stats: vec![RankStats::default(); world],
            scatter_s: 0.0,
            scattered: false,
        }
    }

    /// The distributed step: one allreduce-sum of `[grads | stats slots]`, with `mine` in this
    /// rank's slot. Afterwards [`GradSync::grad`] is `Σ_ranks grads` and `stats` holds every rank's
    /// stats exactly as sent; `grads` has its `params` length again, and its values are spent: the
    /// next backward pass overwrites them.
    ///
    /// The slots are appended to `grads` itself (the send buffer must be contiguous) and truncated
    /// off again: the first call grows its capacity once, later calls neither allocate nor copy.
    /// With one rank the sum is `grads` itself, so the two buffers are swapped instead of copied
    /// (`grads` then holds the previous step's sum).
    pub fn all_reduce(&mut self, comm: &dyn Communicator, grads: &mut Vec<f32>, mine: &RankStats) -> SyncTime {
        self.append_stats(comm, grads, mine);
        let t = Instant::now();
        if comm.world_size() == 1 {
            std::mem::swap(grads, &mut self.summed);
        } else {
            comm.all_reduce_sum_into(grads, &mut self.summed);
        }
        let sync_s = t.elapsed().as_secs_f64();

        grads.truncate(self.params);
        Self::decode_stats(&mut self.stats, &self.summed[self.params..]);
        self.split_time(comm.rank(), sync_s)
    }

    /// The sharded distributed step, first half: a reduce-scatter of `[grads | stats slots]`, with
    /// `mine` in this rank's slot. Returns this rank's block of the gradient; `grads[block]` is then
    /// `Σ_ranks grads` there (the rest of `grads` is spent). When the communicator sums whole
    /// buffers instead ([`Communicator::scatters`]: one rank, or small buffers on MPI), the block is
    /// the whole gradient and the all-gather moves nothing. Update those parameters only
    /// ([`Optimizer::step_block`](crate::train::optim::Optimizer::step_block)), then call
    /// [`GradSync::all_gather`]. The bytes moved are an allreduce's, but each rank does `1/world`
    /// of the optimizer's work. Allocates only on the first call.
    pub fn reduce_scatter(&mut self, comm: &dyn Communicator, grads: &mut Vec<f32>, mine: &RankStats) -> Range<usize> {
        self.append_stats(comm, grads, mine);
        let t = Instant::now();
        comm.reduce_scatter_sum(grads, self.params);
        self.scatter_s = t.elapsed().as_secs_f64();
        self.scattered = comm.scatters(grads.len());
        // Sharded, the summed stats are in the last rank's block: keep them for the gather.
        let block = if self.scattered { my_block(comm, grads.len(), self.params) } else { 0..grads.len() };
        let tail = block.start.max(self.params)..block.end.max(self.params);
        self.summed[tail.clone()].copy_from_slice(&grads[tail]);
        grads.truncate(self.params);
        block.start.min(self.params)..block.end.min(self.params)
    }

    /// Clips the gradient after [`GradSync::reduce_scatter`] to a global L2 norm of `max_norm`
    /// (`block` is this rank's block of it, as returned): the norm is summed over the ranks' blocks
    /// when the gradient is spread over them, and taken on the block alone when every rank holds all
    /// of it. Returns the norm before clipping.
    pub fn clip_grad_norm(&self, comm: &dyn Communicator, block: &mut [f32], max_norm: f32) -> f32 {
        if self.scattered {
            clip_grad_norm_blocks(block, max_norm, comm)
        } else {
            clip_grad_norm(block, max_norm)
        }
    }

    /// The sharded distributed step, second half: every rank's block of `params` (just updated by
    /// its optimizer) goes to all ranks, and the stats with it; `stats` then holds every rank's.
    /// Returns the wait/transfer split of both halves together.
    pub fn all_gather(&mut self, comm: &dyn Communicator, params: &mut Vec<f32>) -> SyncTime {
        assert_eq!(params.len(), self.params, "parameter length");
        if !self.scattered {
            // Every rank summed everything and updated every parameter.
            Self::decode_stats(&mut self.stats, &self.summed[self.params..]);
            return self.split_time(comm.rank(), self.scatter_s);
        }
        let len = self.summed.len();
        params.reserve_exact(len - self.params);
        params.extend_from_slice(&self.summed[self.params..]);
        let t = Instant::now();
        comm.all_gather_blocks(params, self.params);
        let sync_s = self.scatter_s + t.elapsed().as_secs_f64();
        Self::decode_stats(&mut self.stats, &params[self.params..]);
        params.truncate(self.params);
        self.split_time(comm.rank(), sync_s)
    }

    /// Appends the stats slots to `grads`, `mine` in this rank's and zeros elsewhere.
    fn append_stats(&self, comm: &dyn Communicator, grads: &mut Vec<f32>, mine: &RankStats) {
        let world = comm.world_size();
        assert_eq!(grads.len(), self.params, "gradient length");
        assert_eq!(
            self.stats.len(),
            world,
            "GradSync built for {} ranks, the communicator has {world}",
            self.stats.len()
        );
        grads.reserve_exact(world * STATS_SLOTS);
        grads.resize(self.params + world * STATS_SLOTS, 0.0);
        mine.encode(&mut grads[self.params + comm.rank() * STATS_SLOTS..][..STATS_SLOTS]);
    }

    fn decode_stats(stats: &mut [RankStats], tail: &[f32]) {
        for (s, slot) in stats.iter_mut().zip(tail.chunks_exact(STATS_SLOTS)) {
            *s = RankStats::decode(slot);
        }
    }

    /// Splits `sync_s` into waiting for the slowest rank's compute and transfer.
    fn split_time(&self, rank: usize, sync_s: f64) -> SyncTime {
        let slowest = self.stats.iter().map(|s| s.compute_s).fold(0.0, f64::max);
        let wait_s = (slowest - self.stats[rank].compute_s).clamp(0.0, sync_s);
        SyncTime { wait_s, comm_s: sync_s - wait_s }
    }

    /// The summed gradient of the last [`GradSync::all_reduce`].
    pub fn grad(&self) -> &[f32] {
        &self.summed[..self.params]
    }
    pub fn grad_mut(&mut self) -> &mut [f32] {
        &mut self.summed[..self.params]
    }

    /// What the balancer sees of every rank's last iteration, in rank order, from the gathered
    /// `stats` (into `out`, cleared first): the same on every rank, so every rank's balancer makes
    /// the same next split. The CPU measures are the process's, over the `threads` it computes on;
    /// they go to the balancer per core (divided by `threads`), since it compares ranks by their
    /// share of one core whatever their thread counts.
    pub fn observations_into(&self, threads: usize, out: &mut Vec<Observation>) {
        let threads = threads.max(1) as f64;
        out.clear();
        out.extend(self.stats.iter().map(|s| Observation {
            batch: s.batch,
            compute_s: s.compute_s,
            cpu_share: s.cpu_share / threads,
            preemptions: s.preemptions,
            frozen_s: s.frozen_s / threads,
            run_share: s.prev_run_share / threads,
            run_s: s.prev_run_s,
            transfer_s: s.prev_sync.comm_s,
            balance_s: s.prev_balance_s,
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::comm::{Local, Solo};

    fn stats_of(rank: usize) -> RankStats {
        RankStats {
            batch: 40 + rank,
            compute_s: 0.1 + rank as f64 * 1e-3,
            loss_sum: std::f64::consts::PI * (rank as f64 + 1.0) * 1e5 + 1.0 / 3.0,
            interference_s: if rank == 1 { -0.0 } else { 1e-300 },
            cpu_share: f64::MAX / (rank as f64 + 1.0),
            preemptions: 3.0 * rank as f64,
            frozen_s: 1e-4 * (rank as f64 + 0.5),
            prev_run_share: 0.5 / (rank as f64 + 1.0),
            prev_run_s: 3e-3 * (rank as f64 + 1.0),
            prev_balance_s: 2e-5 * (rank as f64 + 0.25),
            prev_sync: SyncTime { wait_s: 1e-3 * rank as f64, comm_s: f64::MIN_POSITIVE },
            stop: if rank == 2 { libc::SIGTERM } else { 0 },
        }
    }

    #[test]
    fn one_allreduce_sums_gradients_and_gathers_stats_bit_for_bit() {
        let handles: Vec<_> = Local::group(3)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let r = c.rank();
                    let mut grads = vec![r as f32, 1.0, 0.5 * r as f32];
                    let mut sync = GradSync::new(3, 3);
                    let took = sync.all_reduce(&c, &mut grads, &stats_of(r));
                    assert_eq!(grads.len(), 3, "gradient length restored");
                    (sync.grad().to_vec(), sync.stats.clone(), took)
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let (grad, stats, took) = h.join().unwrap();
            assert_eq!(grad, vec![3.0, 3.0, 1.5]);
            for (k, s) in stats.iter().enumerate() {
                let want = stats_of(k);
                assert_eq!(s.batch, want.batch);
                for (a, b) in [
                    (s.compute_s, want.compute_s),
                    (s.loss_sum, want.loss_sum),
                    (s.interference_s, want.interference_s),
                    (s.cpu_share, want.cpu_share),
                    (s.preemptions, want.preemptions),
                    (s.frozen_s, want.frozen_s),
                    (s.prev_run_share, want.prev_run_share),
                    (s.prev_run_s, want.prev_run_s),
                    (s.prev_balance_s, want.prev_balance_s),
                    (s.prev_sync.wait_s, want.prev_sync.wait_s),
                    (s.prev_sync.comm_s, want.prev_sync.comm_s),
                ] {
                    assert_eq!(a.to_bits(), b.to_bits(), "rank {k}'s stats as seen by rank {r}");
                }
            }
            // Rank 2 computed longest, so it waited for nobody; the others at most for the gap.
            let gap = stats_of(2).compute_s - stats_of(r).compute_s;
            assert!(took.wait_s >= 0.0 && took.wait_s <= gap && took.comm_s >= 0.0, "{took:?}");
            if r == 2 {
                assert_eq!(took.wait_s, 0.0);
            }
        }
    }

    #[test]
    fn scatter_update_gather_equals_allreduce_then_update() {
        // 3 ranks, 40 parameters: each rank doubles its block of the summed gradient into the
        // parameters; after the gather every rank holds the full result and everyone's stats.
        let handles: Vec<_> = Local::group(3)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let r = c.rank();
                    let mut grads: Vec<f32> = (0..40).map(|i| (i * (r + 1)) as f32).collect();
                    let mut params = vec![1.0f32; 40];
                    let mut sync = GradSync::new(40, 3);
                    for _ in 0..2 {
                        let block = sync.reduce_scatter(&c, &mut grads, &stats_of(r));
                        assert_eq!(grads.len(), 40, "gradient length restored");
                        for i in block {
                            params[i] += 2.0 * grads[i];
                        }
                        sync.all_gather(&c, &mut params);
                        assert_eq!(params.len(), 40, "parameter length restored");
                        grads = (0..40).map(|i| (i * (r + 1)) as f32).collect();
                    }
                    (params, sync.stats.clone())
                })
            })
            .collect();
        for h in handles {
            let (params, stats) = h.join().unwrap();
            let want: Vec<f32> = (0..40).map(|i| 1.0 + 2.0 * 2.0 * (6 * i) as f32).collect();
            assert_eq!(params, want);
            assert_eq!(stats, (0..3).map(stats_of).collect::<Vec<_>>());
        }
    }

    #[test]
    fn one_rank_sharded_step_covers_the_whole_gradient_and_moves_nothing() {
        let mut sync = GradSync::new(3, 1);
        let (mut grads, mut params) = (vec![1.0f32, 2.0, 3.0], vec![0.5f32; 3]);
        for _ in 0..2 {
            let block = sync.reduce_scatter(&Solo, &mut grads, &stats_of(0));
            assert_eq!((block, &grads[..]), (0..3, &[1.0f32, 2.0, 3.0][..]));
            sync.all_gather(&Solo, &mut params);
            assert_eq!((&params[..], &sync.stats[..]), (&[0.5f32; 3][..], &[stats_of(0)][..]));
        }
    }

    #[test]
    fn one_rank_swaps_instead_of_copying_and_allocates_once() {
        let mut sync = GradSync::new(2, 1);
        let mut grads = vec![1.0, 2.0];
        let took = sync.all_reduce(&Solo, &mut grads, &stats_of(0));
        assert_eq!((took.wait_s, sync.grad()), (0.0, &[1.0f32, 2.0][..]));
        assert_eq!(sync.stats, vec![stats_of(0)]);
        // The next steps ping-pong between the two buffers, each already big enough.
        let buffers = [grads.as_ptr(), sync.grad().as_ptr()];
        for step in 0..3 {
            grads.copy_from_slice(&[3.0 + step as f32, 4.0]);
            sync.all_reduce(&Solo, &mut grads, &stats_of(0));
            assert_eq!(sync.grad(), &[3.0 + step as f32, 4.0][..]);
            assert_eq!(grads.len(), 2);
            assert!(buffers.contains(&grads.as_ptr()) && buffers.contains(&sync.grad().as_ptr()));
        }
    }
}

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

use crate::comm::Communicator;
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
}

/// 64-bit words in a [`RankStats`].
const WORDS: usize = 5;
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
    /// `[Σ_ranks gradient | every rank's stats slot]` after [`GradSync::all_reduce`].
    summed: Vec<f32>,
    /// Every rank's stats in rank order, after [`GradSync::all_reduce`].
    pub stats: Vec<RankStats>,
}

impl GradSync {
    pub fn new(params: usize, world: usize) -> GradSync {
        GradSync { params, summed: vec![0.0; params + world * STATS_SLOTS], stats: vec![RankStats::default(); world] }
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
        let (rank, world) = (comm.rank(), comm.world_size());
        assert_eq!(grads.len(), self.params, "gradient length");
        assert_eq!(
            self.stats.len(),
            world,
            "GradSync built for {} ranks, the communicator has {world}",
            self.stats.len()
        );
        grads.reserve_exact(world * STATS_SLOTS);
        grads.resize(self.params + world * STATS_SLOTS, 0.0);
        mine.encode(&mut grads[self.params + rank * STATS_SLOTS..][..STATS_SLOTS]);

        let t = Instant::now();
        if world == 1 {
            std::mem::swap(grads, &mut self.summed);
        } else {
            comm.all_reduce_sum_into(grads, &mut self.summed);
        }
        let sync_s = t.elapsed().as_secs_f64();

        grads.truncate(self.params);
        for (s, slot) in self.stats.iter_mut().zip(self.summed[self.params..].chunks_exact(STATS_SLOTS)) {
            *s = RankStats::decode(slot);
        }
        let slowest = self.stats.iter().map(|s| s.compute_s).fold(0.0, f64::max);
        let wait_s = (slowest - mine.compute_s).clamp(0.0, sync_s);
        SyncTime { wait_s, comm_s: sync_s - wait_s }
    }

    /// The summed gradient of the last [`GradSync::all_reduce`].
    pub fn grad(&self) -> &[f32] {
        &self.summed[..self.params]
    }
    pub fn grad_mut(&mut self) -> &mut [f32] {
        &mut self.summed[..self.params]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Local, Solo};

    fn stats_of(rank: usize) -> RankStats {
        RankStats {
            batch: 40 + rank,
            compute_s: 0.1 + rank as f64 * 1e-3,
            loss_sum: std::f64::consts::PI * (rank as f64 + 1.0) * 1e5 + 1.0 / 3.0,
            interference_s: if rank == 1 { -0.0 } else { 1e-300 },
            cpu_share: f64::MAX / (rank as f64 + 1.0),
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

//! Ring allreduce of large f32 buffers, built on MPI point-to-point (`MPI_Sendrecv`).
//!
//! The buffer is cut into one chunk per rank. A **reduce-scatter** passes partial sums around the
//! ring (`world − 1` steps: each rank sends one chunk to the next rank, receives another from the
//! previous one and adds its own contribution), after which rank `r` holds the complete sum of
//! chunk `r + 1`. An **all-gather** then passes the finished chunks around the ring (`world − 1`
//! more steps). Each rank sends and receives `2·(world − 1)/world` of the buffer, the bandwidth
//! optimum (Patarasuk & Yuan 2009; Baidu's and Horovod's allreduce).
//!
//! Why not `MPI_Allreduce`: on one node Open MPI 4.1 moves a large message point to point with one
//! kernel copy (CMA), but its allreduce pipelines the buffer through small shared-memory fragments.
//! For W1's 2.1 MB gradient on two ranks the ring takes about a third of `MPI_Allreduce`'s time
//! (`lbbsp comm-check` and `scripts/bench_sync.sh` measure both). Small buffers stay with
//! `MPI_Allreduce`, whose latency-bound algorithms need fewer steps (on two ranks of this machine the
//! ring still took half its time at 16 KB, so the cut is there: `lbbsp bench allreduce`).
//!
//! Every element of the result is summed once, by one rank, and copied to the others, so all ranks
//! hold the same bits; the summation order is fixed by the ring, so runs are deterministic.

use std::ops::Range;

/// Buffers of at least this many floats take the ring (smaller ones: `MPI_Allreduce`).
pub const RING_MIN_FLOATS: usize = 4096;

/// Chunk `c` of `n` floats cut into `world` near-equal chunks.
pub fn chunk(n: usize, world: usize, c: usize) -> Range<usize> {
    c * n / world..(c + 1) * n / world
}

/// `recv = Σ_ranks send` by the ring; `sendrecv(out, into)` sends `out` to rank `rank + 1` and
/// receives `into.len()` floats from rank `rank − 1` (both mod `world`), as one `MPI_Sendrecv`.
/// `tmp` holds a received partial sum; it grows once to a chunk's size.
pub fn all_reduce_sum(
    rank: usize,
    world: usize,
    send: &[f32],
    recv: &mut [f32],
    tmp: &mut Vec<f32>,
    mut sendrecv: impl FnMut(&[f32], &mut [f32]),
) {
    let n = send.len();
    assert_eq!(recv.len(), n, "allreduce: receive buffer length");
    if world == 1 {
        recv.copy_from_slice(send);
        return;
    }
    let at = |c: usize| chunk(n, world, c % world);
    let longest = n.div_ceil(world);
    if tmp.len() < longest {
        tmp.resize(longest, 0.0);
    }
    // Reduce-scatter: at step s, send chunk r − s (own data at s = 0, a partial sum after), receive
    // chunk r − s − 1 and add this rank's part. After world − 1 steps chunk r + 1 is complete here.
    for s in 0..world - 1 {
        let (out, into) = (at(rank + world - s), at(rank + 2 * world - s - 1));
        let part = &mut tmp[..into.len()];
        sendrecv(if s == 0 { &send[out] } else { &recv[out] }, part);
        for ((r, &mine), &theirs) in recv[into.clone()].iter_mut().zip(&send[into]).zip(part.iter()) {
            *r = mine + theirs;
        }
    }
    // All-gather: pass the complete chunks on; each received chunk is the next one sent.
    for s in 0..world - 1 {
        let (out, into) = (at(rank + 1 + world - s), at(rank + world - s));
        let (src, dst) = disjoint(recv, out, into);
        sendrecv(src, dst);
    }
}

/// `(&buf[a], &mut buf[b])` for non-overlapping ranges.
fn disjoint(buf: &mut [f32], a: Range<usize>, b: Range<usize>) -> (&[f32], &mut [f32]) {
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.len()])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.len()], &mut lo[b])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{channel, Receiver, Sender};

    /// Runs the ring on `world` threads joined by channels; returns every rank's result.
    fn ring(world: usize, inputs: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
        let (txs, rxs): (Vec<Sender<Vec<f32>>>, Vec<Receiver<Vec<f32>>>) = (0..world).map(|_| channel()).unzip();
        let handles: Vec<_> = rxs
            .into_iter()
            .zip(inputs)
            .enumerate()
            .map(|(rank, (rx, send))| {
                // Rank r sends into r + 1's channel and receives from its own.
                let next = txs[(rank + 1) % world].clone();
                std::thread::spawn(move || {
                    let mut recv = vec![f32::NAN; send.len()];
                    let mut tmp = Vec::new();
                    all_reduce_sum(rank, world, &send, &mut recv, &mut tmp, |out, into| {
                        next.send(out.to_vec()).unwrap();
                        let got = rx.recv().unwrap();
                        assert_eq!(got.len(), into.len(), "rank {rank}: sender and receiver agree on the chunk");
                        into.copy_from_slice(&got);
                    });
                    recv
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_gets_the_exact_sum_for_any_size_and_world() {
        for world in 1..=5usize {
            for n in [0, 1, 3, world.saturating_sub(1), 7, 64, 1000, 1001] {
                // Integers: every summation order gives the exact sum.
                let inputs: Vec<Vec<f32>> =
                    (0..world).map(|r| (0..n).map(|i| ((i * 7 + r * 13) % 101) as f32).collect()).collect();
                let want: Vec<f32> = (0..n).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
                for (r, got) in ring(world, inputs).into_iter().enumerate() {
                    assert_eq!(got, want, "world {world}, n {n}, rank {r}");
                }
            }
        }
    }

    #[test]
    fn all_ranks_hold_the_same_bits_with_rounding() {
        // Values whose sum depends on the order: the ranks must still agree bit for bit.
        let world = 4;
        let inputs: Vec<Vec<f32>> =
            (0..world).map(|r| (0..999).map(|i| 1.0 / (1.0 + i as f32 + 0.37 * r as f32) * 1e3f32.powi(r as i32 % 3)).collect()).collect();
        let out = ring(world, inputs);
        for r in 1..world {
            assert!(out[r].iter().zip(&out[0]).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {r} differs from rank 0");
        }
    }

    #[test]
    fn chunks_tile_the_buffer() {
        for (n, world) in [(10, 3), (2, 5), (0, 2), (535_848, 2)] {
            let mut next = 0;
            for c in 0..world {
                let r = chunk(n, world, c);
                assert_eq!(r.start, next);
                next = r.end;
            }
            assert_eq!(next, n);
        }
    }
}

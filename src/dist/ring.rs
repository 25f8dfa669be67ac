//! Ring allreduce of large f32 buffers, built on MPI point-to-point (`MPI_Sendrecv`): the path
//! across nodes (on one node the default is the shared window of [`crate::dist::shm`], which sums in the
//! same order).
//!
//! The buffer is cut into one chunk per rank. A **reduce-scatter** passes partial sums around the
//! ring (`world − 1` steps: each rank sends one chunk to the next rank, receives another from the
//! previous one and adds its own contribution), after which rank `r` holds the complete sum of
//! chunk `r`. An **all-gather** then passes the finished chunks around the ring (`world − 1`
//! more steps). Each rank sends and receives `2·(world − 1)/world` of the buffer, the bandwidth
//! optimum (Patarasuk & Yuan 2009; Baidu's and Horovod's allreduce).
//!
//! Why not `MPI_Allreduce`: on one node Open MPI 4.1 moves a large message point to point with one
//! kernel copy (CMA), but its allreduce pipelines the buffer through small shared-memory fragments.
//! For W1's 2.1 MB gradient on two ranks the ring takes 0.8–0.9× `MPI_Allreduce`'s time on a quiet
//! machine and about a third when memory bandwidth is contended (`lbbsp bench allreduce` and
//! `scripts/bench_sync.sh` measure both). Small buffers stay with
//! `MPI_Allreduce`, whose latency-bound algorithms need fewer steps (on two ranks of this machine the
//! ring still took half its time at 16 KB, so the cut is there: `lbbsp bench allreduce`).
//!
//! Every element of the result is summed once, by one rank, and copied to the others, so all ranks
//! hold the same bits; the summation order is fixed by the ring, so runs are deterministic.
//!
//! The two halves are also used on their own: the training loop reduce-scatters the gradient,
//! updates only the parameters of the block it owns, and all-gathers the parameters (a sharded
//! optimizer step, as ZeRO stage 1), which moves the same bytes as the allreduce but leaves each
//! rank `1/world` of the update.

use std::ops::Range;

/// Buffers of at least this many floats take the ring (smaller ones: `MPI_Allreduce`).
pub const RING_MIN_FLOATS: usize = 4096;

/// Chunk `c` of `n` floats cut into `world` near-equal chunks.
pub fn chunk(n: usize, world: usize, c: usize) -> Range<usize> {
    c * n / world..(c + 1) * n / world
}

/// Block `c` of a buffer of `len` floats whose first `split` are cut into `world` chunks
/// ([`chunk`]); the last block also takes the tail `split..len`. Rank `c` owns block `c` in
/// [`reduce_scatter`] and [`all_gather`].
pub fn block(len: usize, split: usize, world: usize, c: usize) -> Range<usize> {
    let r = chunk(split, world, c);
    if c + 1 == world {
        r.start..len
    } else {
        r
    }
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
    assert_eq!(recv.len(), send.len(), "allreduce: receive buffer length");
    if world == 1 {
        recv.copy_from_slice(send);
        return;
    }
    let n = send.len();
    reduce_scatter_from(rank, world, Some(send), recv, n, tmp, &mut sendrecv);
    all_gather(rank, world, recv, n, &mut sendrecv);
}

/// Reduce-scatter in place: afterwards `buf[block(len, split, world, rank)]` holds the sum over
/// ranks of that block (the rest of `buf` holds partial sums).
pub fn reduce_scatter(
    rank: usize,
    world: usize,
    buf: &mut [f32],
    split: usize,
    tmp: &mut Vec<f32>,
    mut sendrecv: impl FnMut(&[f32], &mut [f32]),
) {
    reduce_scatter_from(rank, world, None, buf, split, tmp, &mut sendrecv);
}

/// The reduce-scatter, reading this rank's contributions from `send` (or from `buf` itself) and
/// accumulating into `buf`. At step `s` rank `r` sends block `r − s − 1` (its own data at `s = 0`,
/// a partial sum after) and receives block `r − s − 2`, adding its own part; after `world − 1` steps
/// block `r` is complete. Every sum is `own + received`, the same order in place or not.
fn reduce_scatter_from(
    rank: usize,
    world: usize,
    send: Option<&[f32]>,
    buf: &mut [f32],
    split: usize,
    tmp: &mut Vec<f32>,
    sendrecv: &mut impl FnMut(&[f32], &mut [f32]),
) {
    let len = buf.len();
    let at = |c: usize| block(len, split, world, c % world);
    let longest = (0..world).map(|c| at(c).len()).max().unwrap_or(0);
    if tmp.len() < longest {
        tmp.resize(longest, 0.0);
    }
    for s in 0..world - 1 {
        let (out, into) = (at(rank + 2 * world - 1 - s), at(rank + 2 * world - 2 - s));
        let part = &mut tmp[..into.len()];
        match send {
            Some(own) if s == 0 => sendrecv(&own[out], part),
            _ => sendrecv(&buf[out], part),
        }
        match send {
            Some(own) => {
                for ((b, &mine), &theirs) in buf[into.clone()].iter_mut().zip(&own[into]).zip(part.iter()) {
                    *b = mine + theirs;
                }
            }
            None => {
                for (b, &theirs) in buf[into].iter_mut().zip(part.iter()) {
                    *b += theirs;
                }
            }
        }
    }
}

/// All-gather in place: rank `r`'s block `block(len, split, world, r)` of `buf` is copied to every
/// rank. At step `s` rank `r` passes on block `r − s` and receives block `r − s − 1`.
pub fn all_gather(
    rank: usize,
    world: usize,
    buf: &mut [f32],
    split: usize,
    mut sendrecv: impl FnMut(&[f32], &mut [f32]),
) {
    let len = buf.len();
    let at = |c: usize| block(len, split, world, c % world);
    for s in 0..world.saturating_sub(1) {
        let (out, into) = (at(rank + world - s), at(rank + 2 * world - s - 1));
        let (src, dst) = disjoint(buf, out, into);
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
    use std::sync::mpsc::channel;

    type SendRecv<'a> = dyn FnMut(&[f32], &mut [f32]) + 'a;

    /// Runs `f(rank, input, sendrecv)` on `world` threads joined in a ring by channels.
    fn on_threads(
        world: usize,
        inputs: Vec<Vec<f32>>,
        f: impl Fn(usize, Vec<f32>, &mut SendRecv) -> Vec<f32> + Send + Sync + Copy + 'static,
    ) -> Vec<Vec<f32>> {
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..world).map(|_| channel::<Vec<f32>>()).unzip();
        let handles: Vec<_> = rxs
            .into_iter()
            .zip(inputs)
            .enumerate()
            .map(|(rank, (rx, input))| {
                // Rank r sends into r + 1's channel and receives from its own.
                let next = txs[(rank + 1) % world].clone();
                std::thread::spawn(move || {
                    let mut sendrecv = |out: &[f32], into: &mut [f32]| {
                        next.send(out.to_vec()).unwrap();
                        let got = rx.recv().unwrap();
                        assert_eq!(got.len(), into.len(), "rank {rank}: sender and receiver agree on the block");
                        into.copy_from_slice(&got);
                    };
                    f(rank, input, &mut sendrecv)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn ring(world: usize, inputs: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
        on_threads(world, inputs, move |rank, send, sendrecv| {
            let mut recv = vec![f32::NAN; send.len()];
            all_reduce_sum(rank, world, &send, &mut recv, &mut Vec::new(), sendrecv);
            recv
        })
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
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| (0..999).map(|i| 1.0 / (1.0 + i as f32 + 0.37 * r as f32) * 1e3f32.powi(r as i32 % 3)).collect())
            .collect();
        let out = ring(world, inputs);
        for r in 1..world {
            assert!(
                out[r].iter().zip(&out[0]).all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {r} differs from rank 0"
            );
        }
    }

    #[test]
    fn reduce_scatter_then_all_gather_is_an_allreduce_with_a_tail_on_the_last_block() {
        for world in 1..=4usize {
            for (len, split) in [(10, 7), (100, 100), (3, 0), (50, 45)] {
                let inputs: Vec<Vec<f32>> =
                    (0..world).map(|r| (0..len).map(|i| ((i * 5 + r * 3) % 17) as f32).collect()).collect();
                let want: Vec<f32> = (0..len).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
                let out = on_threads(world, inputs, move |rank, mut buf, sendrecv| {
                    let mut tmp = Vec::new();
                    reduce_scatter(rank, world, &mut buf, split, &mut tmp, &mut *sendrecv);
                    let mine = block(len, split, world, rank);
                    let summed = buf[mine.clone()].to_vec();
                    // Only the owned block is summed; poison the rest to prove the gather fills it.
                    buf.iter_mut().enumerate().filter(|(i, _)| !mine.contains(i)).for_each(|(_, b)| *b = f32::NAN);
                    all_gather(rank, world, &mut buf, split, &mut *sendrecv);
                    assert_eq!(buf[mine], summed[..]);
                    buf
                });
                for (r, got) in out.into_iter().enumerate() {
                    assert_eq!(got, want, "world {world}, len {len}, split {split}, rank {r}");
                }
            }
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

//! The communicator: collectives in MPI vocabulary. [`Communicator`] is what the training loop
//! calls; [`Solo`] is the one-rank communicator of a plain run; [`Local`] runs several ranks as
//! threads of one process, for fast tests and simulations of the same code paths. The MPI one,
//! `Mpi` (rsmpi), is in [`crate::dist::mpi`] behind the `mpi` feature.

use crate::dist::ring;
use crate::error::{Error, Result};
use std::sync::{Arc, Barrier, Mutex};

/// Collective operations every rank calls in the same order.
pub trait Communicator {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Ranks sharing this node (used to size the per-rank thread pool).
    fn local_size(&self) -> usize;
    /// Whether this rank has its process to itself, so that the process's CPU clock and
    /// preemption count are its own (thread ranks share theirs).
    fn owns_process(&self) -> bool {
        true
    }
    /// What this rank is doing, for its flight record: a [`Watched`](crate::dist::watchdog::Watched)
    /// communicator keeps it and names it when a collective hangs; others ignore it.
    fn note(&self, _iter: usize, _phase: Phase) {}
    fn barrier(&self);
    /// `recv = Σ_ranks send`, element-wise.
    fn all_reduce_sum_into(&self, send: &[f32], recv: &mut [f32]);
    /// `recv = Σ_ranks send` in f64 (metrics, evaluation counts).
    fn all_reduce_sum_f64_into(&self, send: &[f64], recv: &mut [f64]);
    /// Overwrites `buf` on every rank with `root`'s copy.
    fn broadcast_into(&self, root: usize, buf: &mut [f32]);
    /// `recv[r·n..(r+1)·n] = send of rank r`, with `n = send.len()`.
    fn all_gather_into(&self, send: &[f64], recv: &mut [f64]);
    /// Reduce-scatter in place: afterwards this rank's block of `buf`,
    /// `ring::block(buf.len(), split, world, rank)`, holds `Σ_ranks` of that block; the rest of
    /// `buf` is spent. With [`Communicator::all_gather_blocks`] it is an allreduce.
    fn reduce_scatter_sum(&self, buf: &mut [f32], split: usize);
    /// All-gather in place: every rank's block of `buf` (as in [`Communicator::reduce_scatter_sum`])
    /// is copied to all ranks.
    fn all_gather_blocks(&self, buf: &mut [f32], split: usize);
    /// Whether [`Communicator::reduce_scatter_sum`] of a `len`-float buffer leaves only this rank's
    /// block summed. When false it sums the whole buffer on every rank (one rank, or an
    /// `MPI_Allreduce` below the ring's size), so every rank can update every parameter and no
    /// all-gather is needed ([`GradSync`](crate::dist::sync::GradSync) then skips it).
    fn scatters(&self, len: usize) -> bool;
}

/// What the training loop is doing, for a rank's flight record ([`Communicator::note`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Start = 0,
    Compute = 1,
    Sync = 2,
    Evaluate = 3,
    Checkpoint = 4,
}

impl Phase {
    /// The name of the phase whose code (`phase as u64`) a record holds.
    pub fn name_of(code: u64) -> &'static str {
        ["start-up", "compute", "gradient sync", "evaluation", "checkpoint"].get(code as usize).unwrap_or(&"?")
    }
}

/// This rank's block of a `len`-float buffer cut at `split` (see `ring::block`).
pub fn my_block(comm: &dyn Communicator, len: usize, split: usize) -> std::ops::Range<usize> {
    ring::block(len, split, comm.world_size(), comm.rank())
}

/// Sends `bytes` from `root` to every rank (a collective; the others' `bytes` are ignored). The
/// communicator moves f32s: the length goes as two 20-bit halves and every byte as one f32, both
/// exact.
pub fn broadcast_bytes(comm: &dyn Communicator, root: usize, bytes: Vec<u8>) -> Vec<u8> {
    let n = bytes.len();
    let mut len = [(n & 0xF_FFFF) as f32, (n >> 20) as f32];
    comm.broadcast_into(root, &mut len);
    let n = len[0] as usize | (len[1] as usize) << 20;
    let mut buf: Vec<f32> = if comm.rank() == root { bytes.iter().map(|&b| b as f32).collect() } else { vec![0.0; n] };
    comm.broadcast_into(root, &mut buf);
    buf.iter().map(|&f| f as u8).collect()
}

/// Makes `root`'s outcome everyone's (a collective): when `root` failed, every rank returns
/// [`Error::OnRank`] with its message, so an error on one rank (rank 0 writing a checkpoint onto a
/// full disk, say) stops all ranks at the same point instead of leaving them in the next collective.
pub fn share_outcome(comm: &dyn Communicator, root: usize, outcome: Result<()>) -> Result<()> {
    let msg = match (&outcome, comm.rank() == root) {
        (Err(e), true) => e.to_string().into_bytes(),
        _ => Vec::new(),
    };
    let msg = broadcast_bytes(comm, root, msg);
    if msg.is_empty() {
        Ok(())
    } else {
        Err(Error::OnRank { rank: root, msg: String::from_utf8_lossy(&msg).into_owned() })
    }
}

/// The one-rank communicator: every collective is a copy.
#[derive(Debug, Default, Clone, Copy)]
pub struct Solo;

impl Communicator for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn local_size(&self) -> usize {
        1
    }
    fn barrier(&self) {}
    fn all_reduce_sum_into(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn all_reduce_sum_f64_into(&self, send: &[f64], recv: &mut [f64]) {
        recv.copy_from_slice(send);
    }
    fn broadcast_into(&self, _root: usize, _buf: &mut [f32]) {}
    fn all_gather_into(&self, send: &[f64], recv: &mut [f64]) {
        recv.copy_from_slice(send);
    }
    fn reduce_scatter_sum(&self, _buf: &mut [f32], _split: usize) {}
    fn all_gather_blocks(&self, _buf: &mut [f32], _split: usize) {}
    fn scatters(&self, _len: usize) -> bool {
        false
    }
}

/// The allreduce a run asks for (`runtime.allreduce`, `--allreduce`, `LBBSP_ALLREDUCE`): `auto`
/// takes the shared window when every rank is on one node, else the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllreduceChoice {
    #[default]
    Auto,
    Shm,
    Ring,
    Mpi,
}

impl AllreduceChoice {
    pub const NAMES: &'static str = "auto (shm on one node, else ring), shm (MPI-3 shared window), ring \
                                     (MPI_Sendrecv) or mpi (one MPI_Allreduce)";
}

impl std::str::FromStr for AllreduceChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<AllreduceChoice> {
        Ok(match s {
            "auto" => AllreduceChoice::Auto,
            "shm" => AllreduceChoice::Shm,
            "ring" => AllreduceChoice::Ring,
            "mpi" => AllreduceChoice::Mpi,
            _ => {
                return Err(Error::config(
                    "allreduce",
                    format!("unknown allreduce {s:?}: use {}", AllreduceChoice::NAMES),
                ))
            }
        })
    }
}

/// Ranks as threads of one process, sharing memory; sums run in rank order, so results are
/// deterministic. Build a group with [`Local::group`] and move one member into each thread.
pub struct Local {
    rank: usize,
    shared: Arc<LocalShared>,
}

struct LocalShared {
    size: usize,
    barrier: Barrier,
    slots: Mutex<Vec<Vec<f64>>>,
}

impl Local {
    /// `n` connected communicators, rank `i` at index `i`.
    pub fn group(n: usize) -> Vec<Local> {
        let shared =
            Arc::new(LocalShared { size: n, barrier: Barrier::new(n), slots: Mutex::new(vec![Vec::new(); n]) });
        (0..n).map(|rank| Local { rank, shared: shared.clone() }).collect()
    }

    /// Publishes `data`, waits for every rank, lets `read` see all slots in rank order, waits again.
    fn exchange(&self, data: impl Iterator<Item = f64>, read: impl FnOnce(&[Vec<f64>])) {
        {
            let mut slots = self.shared.slots.lock().expect("local communicator poisoned");
            slots[self.rank].clear();
            slots[self.rank].extend(data);
        }
        self.shared.barrier.wait();
        {
            let slots = self.shared.slots.lock().expect("local communicator poisoned");
            read(&slots);
        }
        self.shared.barrier.wait();
    }
}

impl Communicator for Local {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.size
    }
    fn local_size(&self) -> usize {
        self.shared.size
    }
    fn owns_process(&self) -> bool {
        self.shared.size == 1
    }
    fn barrier(&self) {
        self.shared.barrier.wait();
    }
    fn all_reduce_sum_into(&self, send: &[f32], recv: &mut [f32]) {
        self.exchange(send.iter().map(|&v| v as f64), |slots| {
            for (i, r) in recv.iter_mut().enumerate() {
                // Accumulate in f32, rank by rank, like an MPI reduction of f32 buffers.
                *r = slots.iter().fold(0.0f32, |acc, s| acc + s[i] as f32);
            }
        });
    }
    fn all_reduce_sum_f64_into(&self, send: &[f64], recv: &mut [f64]) {
        self.exchange(send.iter().copied(), |slots| {
            for (i, r) in recv.iter_mut().enumerate() {
                *r = slots.iter().map(|s| s[i]).sum();
            }
        });
    }
    fn broadcast_into(&self, root: usize, buf: &mut [f32]) {
        let mine: Vec<f64> = if self.rank == root { buf.iter().map(|&v| v as f64).collect() } else { Vec::new() };
        self.exchange(mine.into_iter(), |slots| {
            for (b, &v) in buf.iter_mut().zip(&slots[root]) {
                *b = v as f32;
            }
        });
    }
    fn all_gather_into(&self, send: &[f64], recv: &mut [f64]) {
        self.exchange(send.iter().copied(), |slots| {
            for (chunk, s) in recv.chunks_exact_mut(send.len().max(1)).zip(slots) {
                chunk.copy_from_slice(s);
            }
        });
    }
    fn reduce_scatter_sum(&self, buf: &mut [f32], split: usize) {
        let mine = my_block(self, buf.len(), split);
        let data: Vec<f64> = buf.iter().map(|&v| v as f64).collect();
        self.exchange(data.into_iter(), |slots| {
            for i in mine {
                buf[i] = slots.iter().fold(0.0f32, |acc, s| acc + s[i] as f32);
            }
        });
    }
    fn all_gather_blocks(&self, buf: &mut [f32], split: usize) {
        let (len, world) = (buf.len(), self.world_size());
        let data: Vec<f64> = buf.iter().map(|&v| v as f64).collect();
        self.exchange(data.into_iter(), |slots| {
            for (c, s) in slots.iter().enumerate() {
                for i in ring::block(len, split, world, c) {
                    buf[i] = s[i] as f32;
                }
            }
        });
    }
    fn scatters(&self, _len: usize) -> bool {
        self.world_size() > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_group_collectives() {
        let handles: Vec<_> = Local::group(3)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let r = c.rank() as f32;
                    let mut sum = vec![0.0f32; 2];
                    c.all_reduce_sum_into(&[r, 1.0], &mut sum);
                    let mut b = vec![r; 2];
                    c.broadcast_into(1, &mut b);
                    let mut g = vec![0.0; 6];
                    c.all_gather_into(&[r as f64, 10.0 * r as f64], &mut g);
                    (sum, b, g)
                })
            })
            .collect();
        for h in handles {
            let (sum, b, g) = h.join().unwrap();
            assert_eq!(sum, vec![3.0, 3.0]);
            assert_eq!(b, vec![1.0, 1.0]);
            assert_eq!(g, vec![0.0, 0.0, 1.0, 10.0, 2.0, 20.0]);
        }
    }

    #[test]
    fn bytes_cross_the_local_communicator_from_any_root() {
        let group = Local::group(3);
        let out: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = group
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let mine = if c.rank() == 1 { (0..=255u8).cycle().take(70_000).collect() } else { Vec::new() };
                        broadcast_bytes(c, 1, mine)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for o in &out {
            assert_eq!(o.len(), 70_000);
            assert!(o.iter().enumerate().all(|(i, &b)| b == (i % 256) as u8));
        }
    }
}

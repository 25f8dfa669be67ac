//! The communicator: collectives in MPI vocabulary, with rsmpi behind it.
//!
//! Launching and transport are MPI's job (`mpirun`/`srun` start the ranks, rsmpi carries the
//! collectives; large sums go through an MPI-3 shared window on one node, [`crate::dist::shm`], or a ring
//! of `MPI_Sendrecv` across nodes, [`crate::dist::ring`]). [`Mpi`] owns the MPI environment (initialised
//! on creation, finalised on drop); [`Solo`] is the one-rank communicator of a plain run; [`Local`]
//! runs several ranks as threads of one process, for fast tests and simulations of the same code
//! paths.

use crate::dist::ring;
use crate::dist::shm::NodeWindow;
use crate::error::{Error, Result};
use mpi::collective::SystemOperation;
use mpi::point_to_point::send_receive_into;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives as _, Root as _};
use std::cell::{Cell, RefCell};
use std::sync::{Arc, Barrier, Mutex};

/// Collective operations every rank calls in the same order.
pub trait Communicator {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Ranks sharing this node (used to size the per-rank thread pool).
    fn local_size(&self) -> usize;
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
    /// [`ring::block`]`(buf.len(), split, world, rank)`, holds `Σ_ranks` of that block; the rest of
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

/// This rank's block of a `len`-float buffer cut at `split` (see [`ring::block`]).
pub fn my_block(comm: &dyn Communicator, len: usize, split: usize) -> std::ops::Range<usize> {
    ring::block(len, split, comm.world_size(), comm.rank())
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

/// How [`Mpi`] sums large f32 buffers (the gradient), from [`ring::RING_MIN_FLOATS`] floats on;
/// smaller ones always take `MPI_Allreduce`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allreduce {
    /// Through an MPI-3 shared-memory window ([`crate::dist::shm`]): the default when every rank runs on
    /// one node.
    Shared,
    /// The [`ring`] on `MPI_Sendrecv`: the default across nodes.
    Ring,
    /// `MPI_Allreduce` for every sum; the training loop then updates every parameter on every rank
    /// (no reduce-scatter / all-gather halves).
    Mpi,
}

/// MPI world communicator. Creating it initialises MPI (funneled: only the main thread calls MPI,
/// rayon workers never do); dropping it finalises MPI.
pub struct Mpi {
    /// The shared window of [`Allreduce::Shared`], allocated (and grown) by the first collective
    /// that needs it; dropped before the communicators below.
    window: RefCell<Option<NodeWindow>>,
    /// Set when allocating the window failed on some rank: every rank then takes the ring.
    window_failed: Cell<bool>,
    world: SimpleCommunicator,
    /// The ranks of this node (`MPI_COMM_TYPE_SHARED`).
    node: SimpleCommunicator,
    allreduce: Allreduce,
    /// The ring's receive buffer for one chunk, sized on first use.
    ring_tmp: RefCell<Vec<f32>>,
    // Declared last so the communicators above are dropped before MPI_Finalize.
    _universe: mpi::environment::Universe,
}

impl Mpi {
    /// Initialises MPI. Works both under `mpirun`/`srun` and as a singleton (one rank) without them.
    pub fn init() -> Result<Mpi> {
        let (universe, _level) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            .ok_or_else(|| Error::Comm("MPI was already initialised in this process".into()))?;
        let world = universe.world();
        let node = world.split_shared(world.rank());
        // Every rank computes the same: a rank's node holds all ranks on every rank or on none.
        let one_node = node.size() == world.size();
        let allreduce = match std::env::var("LBBSP_ALLREDUCE").as_deref() {
            Err(_) | Ok("auto") if one_node => Allreduce::Shared,
            Err(_) | Ok("auto") | Ok("ring") => Allreduce::Ring,
            Ok("shm") if one_node => Allreduce::Shared,
            Ok("shm") => {
                return Err(Error::Comm(format!(
                    "LBBSP_ALLREDUCE=shm needs every rank on one node, but this node runs {} of {} ranks; \
                     use `auto` (the default) or `ring`",
                    node.size(),
                    world.size()
                )))
            }
            Ok("mpi") => Allreduce::Mpi,
            Ok(other) => {
                return Err(Error::Comm(format!(
                    "LBBSP_ALLREDUCE={other:?}: unknown allreduce; use `auto` (the default: `shm` when every \
                     rank is on one node, else `ring`), `shm`, `ring` or `mpi` (MPI_Allreduce)"
                )))
            }
        };
        Ok(Mpi {
            window: RefCell::default(),
            window_failed: Cell::new(false),
            world,
            node,
            allreduce,
            ring_tmp: RefCell::default(),
            _universe: universe,
        })
    }

    /// Chooses the algorithm of the sums (every rank must choose the same). [`Mpi::init`] takes it
    /// from `LBBSP_ALLREDUCE`: `auto` (the default), `shm`, `ring` or `mpi`. [`Allreduce::Shared`]
    /// on ranks of several nodes falls back to the ring.
    pub fn set_allreduce(&mut self, a: Allreduce) {
        self.allreduce = a;
    }

    /// The algorithm in use for large sums.
    pub fn allreduce(&self) -> Allreduce {
        self.allreduce
    }
}

impl Allreduce {
    /// Its `LBBSP_ALLREDUCE` value.
    pub fn name(self) -> &'static str {
        match self {
            Allreduce::Shared => "shm",
            Allreduce::Ring => "ring",
            Allreduce::Mpi => "mpi",
        }
    }
}

/// How one sum runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// `MPI_Allreduce` of the whole buffer (or a copy on one rank).
    Whole,
    Ring,
    Shared,
}

impl Mpi {
    /// The rsmpi world communicator, for calls beyond the [`Communicator`] trait (benchmarks).
    pub fn world(&self) -> &SimpleCommunicator {
        &self.world
    }

    /// `recv = Σ_ranks send` by algorithm `a` (every rank must pass the same): [`Allreduce::Ring`]
    /// for buffers of at least [`ring::RING_MIN_FLOATS`] floats, `MPI_Allreduce` otherwise.
    pub fn all_reduce_sum_with(&self, a: Allreduce, send: &[f32], recv: &mut [f32]) {
        let (rank, world) = (self.rank(), self.world_size());
        match self.path(a, send.len()) {
            Path::Ring => {
                ring::all_reduce_sum(rank, world, send, recv, &mut self.ring_tmp.borrow_mut(), self.ring_sendrecv())
            }
            Path::Shared => {
                assert_eq!(recv.len(), send.len(), "allreduce: receive buffer length");
                recv.copy_from_slice(send);
                let mut window = self.window.borrow_mut();
                let w = window.as_mut().expect("path() allocated the window");
                w.reduce_scatter(&self.node, recv, send.len());
                w.all_gather(&self.node, recv, send.len());
            }
            Path::Whole => self.world.all_reduce_into(send, recv, SystemOperation::sum()),
        }
    }

    /// How algorithm `a` sums a `len`-float buffer (collective: it may allocate the shared window).
    fn path(&self, a: Allreduce, len: usize) -> Path {
        if self.sums_whole(a, len) {
            return Path::Whole;
        }
        if a == Allreduce::Ring || self.window_failed.get() || self.node.size() != self.world.size() {
            return Path::Ring;
        }
        let mut window = self.window.borrow_mut();
        if window.as_ref().is_none_or(|w| w.capacity() < len) {
            // Every rank sums the same lengths, so all of them get here together. Both steps are
            // agreed on by all ranks: allocating is collective, and so is the choice of path.
            *window = None;
            let room = crate::dist::shm::room(self.world_size() * NodeWindow::bytes(len));
            let got = match self.everyone(room.is_ok()) {
                true => NodeWindow::allocate(&self.node, len),
                false => Err(room.err().unwrap_or_else(|| Error::Comm("another rank lacks room for it".into()))),
            };
            let all = self.everyone(got.is_ok());
            match got {
                Ok(w) if all => *window = Some(w),
                got => {
                    let why = match got {
                        Err(e) => e.to_string(),
                        Ok(w) => {
                            // Not freed: MPI_Win_free is collective over ranks some of which hold none.
                            std::mem::forget(w);
                            "another rank could not allocate it".into()
                        }
                    };
                    self.window_failed.set(true);
                    if self.rank() == 0 {
                        eprintln!(
                            "lbbsp: no shared-memory window of {len} floats on this node ({why}); summing on the \
                             ring instead (LBBSP_ALLREDUCE=ring chooses it outright)"
                        );
                    }
                    return Path::Ring;
                }
            }
        }
        Path::Shared
    }

    /// Whether algorithm `a` sums a `len`-float buffer whole (`MPI_Allreduce`, or nothing on one
    /// rank) rather than in a reduce-scatter and an all-gather (local: allocates nothing).
    fn sums_whole(&self, a: Allreduce, len: usize) -> bool {
        a == Allreduce::Mpi || self.world_size() == 1 || len < ring::RING_MIN_FLOATS
    }

    /// Whether `ok` holds on every rank (collective).
    fn everyone(&self, ok: bool) -> bool {
        let mut all = 0i32;
        self.world.all_reduce_into(&(ok as i32), &mut all, SystemOperation::min());
        all == 1
    }

    /// The ring's step: send to the next rank, receive from the previous one (`MPI_Sendrecv`).
    fn ring_sendrecv(&self) -> impl FnMut(&[f32], &mut [f32]) + '_ {
        let (rank, world) = (self.rank(), self.world_size());
        let next = self.world.process_at_rank(((rank + 1) % world) as i32);
        let prev = self.world.process_at_rank(((rank + world - 1) % world) as i32);
        move |out, into| {
            send_receive_into(out, &next, into, &prev);
        }
    }

    /// Ends every rank of the job (`MPI_Abort`), for errors that leave other ranks blocked.
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

impl Communicator for Mpi {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }
    fn world_size(&self) -> usize {
        self.world.size() as usize
    }
    fn local_size(&self) -> usize {
        self.node.size() as usize
    }
    fn barrier(&self) {
        self.world.barrier();
    }
    fn all_reduce_sum_into(&self, send: &[f32], recv: &mut [f32]) {
        self.all_reduce_sum_with(self.allreduce, send, recv);
    }
    fn all_reduce_sum_f64_into(&self, send: &[f64], recv: &mut [f64]) {
        self.world.all_reduce_into(send, recv, SystemOperation::sum());
    }
    fn broadcast_into(&self, root: usize, buf: &mut [f32]) {
        self.world.process_at_rank(root as i32).broadcast_into(buf);
    }
    fn all_gather_into(&self, send: &[f64], recv: &mut [f64]) {
        self.world.all_gather_into(send, recv);
    }
    fn reduce_scatter_sum(&self, buf: &mut [f32], split: usize) {
        let (rank, world) = (self.rank(), self.world_size());
        let mut tmp = self.ring_tmp.borrow_mut();
        match self.path(self.allreduce, buf.len()) {
            Path::Shared => {
                self.window.borrow_mut().as_mut().expect("allocated").reduce_scatter(&self.node, buf, split)
            }
            Path::Ring => ring::reduce_scatter(rank, world, buf, split, &mut tmp, self.ring_sendrecv()),
            Path::Whole if world > 1 => {
                // MPI_Allreduce of a copy (`tmp` grows once): every block is summed (`scatters` is false).
                tmp.clear();
                tmp.extend_from_slice(buf);
                self.world.all_reduce_into(&tmp[..], buf, SystemOperation::sum());
            }
            Path::Whole => {}
        }
    }
    fn all_gather_blocks(&self, buf: &mut [f32], split: usize) {
        let (rank, world) = (self.rank(), self.world_size());
        match self.path(self.allreduce, buf.len()) {
            Path::Shared => self.window.borrow_mut().as_mut().expect("allocated").all_gather(&self.node, buf, split),
            Path::Ring => ring::all_gather(rank, world, buf, split, self.ring_sendrecv()),
            Path::Whole if world > 1 => self.gather_whole(buf, split),
            Path::Whole => {}
        }
    }
    fn scatters(&self, len: usize) -> bool {
        !self.sums_whole(self.allreduce, len)
    }
}

impl Mpi {
    /// `MPI_Allgatherv` of every rank's block of `buf`: not on the training step's path (the sum
    /// is not scattered there); a checkpoint's gather.
    fn gather_whole(&self, buf: &mut [f32], split: usize) {
        let (rank, world) = (self.rank(), self.world_size());
        let blocks: Vec<_> = (0..world).map(|c| ring::block(buf.len(), split, world, c)).collect();
        let counts: Vec<i32> = blocks.iter().map(|b| b.len() as i32).collect();
        let displs: Vec<i32> = blocks.iter().map(|b| b.start as i32).collect();
        let mine = buf[blocks[rank].clone()].to_vec();
        let mut parts = mpi::datatype::PartitionMut::new(buf, counts, displs);
        self.world.all_gather_varcount_into(&mine[..], &mut parts);
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
}

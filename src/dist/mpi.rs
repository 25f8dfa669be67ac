//! The MPI communicator (rsmpi): launching and transport are MPI's job (`mpirun`/`srun` start the
//! ranks, rsmpi carries the collectives); large sums go through an MPI-3 shared window on one node
//! (`crate::dist::shm`) or a ring of `MPI_Sendrecv` across nodes (`crate::dist::ring`).
//! [`Mpi`] owns the MPI environment: initialised on creation, finalised on drop.

use crate::dist::comm::{AllreduceChoice, Communicator};
use crate::dist::ring;
use crate::dist::shm::NodeWindow;
use crate::error::{Error, Result};
use ::mpi::collective::SystemOperation;
use ::mpi::point_to_point::send_receive_into;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::{Communicator as _, CommunicatorCollectives as _, Root as _};
use std::cell::{Cell, RefCell};

/// How [`Mpi`] sums large f32 buffers (the gradient), from `ring::RING_MIN_FLOATS` floats on;
/// smaller ones always take `MPI_Allreduce`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allreduce {
    /// Through an MPI-3 shared-memory window (`crate::dist::shm`): the default when every rank runs on
    /// one node.
    Shared,
    /// The `ring` on `MPI_Sendrecv`: the default across nodes.
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
    /// Every rank on this node (so on one node).
    one_node: bool,
    allreduce: Allreduce,
    /// The ring's receive buffer for one chunk, sized on first use.
    ring_tmp: RefCell<Vec<f32>>,
    // Declared last so the communicators above are dropped before MPI_Finalize.
    _universe: ::mpi::environment::Universe,
}

impl Mpi {
    /// Initialises MPI. Works both under `mpirun`/`srun` and as a singleton (one rank) without them.
    pub fn init() -> Result<Mpi> {
        let (universe, _level) = ::mpi::initialize_with_threading(::mpi::Threading::Funneled)
            .ok_or_else(|| Error::Comm("MPI was already initialised in this process".into()))?;
        let world = universe.world();
        let node = world.split_shared(world.rank());
        // Every rank computes the same: a rank's node holds all ranks on every rank or on none.
        let one_node = node.size() == world.size();
        Ok(Mpi {
            window: RefCell::default(),
            window_failed: Cell::new(false),
            world,
            node,
            one_node,
            allreduce: if one_node { Allreduce::Shared } else { Allreduce::Ring },
            ring_tmp: RefCell::default(),
            _universe: universe,
        })
    }

    /// Sets the algorithm of the sums (every rank must set the same). [`Mpi::init`] starts with
    /// `auto`'s. [`Allreduce::Shared`] on ranks of several nodes falls back to the ring.
    pub fn set_allreduce(&mut self, a: Allreduce) {
        self.allreduce = a;
    }

    /// Sets the algorithm a run asks for; `shm` is refused when the ranks span several nodes.
    pub fn choose_allreduce(&mut self, choice: AllreduceChoice) -> Result<Allreduce> {
        let a = match choice {
            AllreduceChoice::Auto if self.one_node => Allreduce::Shared,
            AllreduceChoice::Auto | AllreduceChoice::Ring => Allreduce::Ring,
            AllreduceChoice::Shm if self.one_node => Allreduce::Shared,
            AllreduceChoice::Shm => {
                return Err(Error::config(
                    "runtime.allreduce",
                    format!(
                        "shm needs every rank on one node, but this node runs {} of {} ranks; use auto or ring",
                        self.node.size(),
                        self.world.size()
                    ),
                ))
            }
            AllreduceChoice::Mpi => Allreduce::Mpi,
        };
        self.allreduce = a;
        Ok(a)
    }

    /// The algorithm in use for large sums.
    pub fn allreduce(&self) -> Allreduce {
        self.allreduce
    }
}

impl Allreduce {
    /// The choice that asks for it.
    pub fn choice(self) -> AllreduceChoice {
        match self {
            Allreduce::Shared => AllreduceChoice::Shm,
            Allreduce::Ring => AllreduceChoice::Ring,
            Allreduce::Mpi => AllreduceChoice::Mpi,
        }
    }

    /// Its name in `runtime.allreduce`.
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
    /// for buffers of at least `ring::RING_MIN_FLOATS` floats, `MPI_Allreduce` otherwise.
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
                             ring instead (`--allreduce ring` or `runtime.allreduce = \"ring\"` chooses it outright)"
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
        let mut parts = ::mpi::datatype::PartitionMut::new(buf, counts, displs);
        self.world.all_gather_varcount_into(&mine[..], &mut parts);
    }
}

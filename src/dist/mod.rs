//! Ranks and their collectives: the [`comm::Communicator`] (MPI through rsmpi, threads, or one
//! process), the ring and the node-shared window it sums through, gradient-norm clipping across
//! ranks, and [`sync::GradSync`], the weighted gradient allreduce that carries every rank's stats.

pub(crate) mod clip;
pub mod comm;
#[cfg(feature = "mpi")]
pub mod mpi;
// The ring's collectives run over MPI's send-receive; without MPI only its block layout is used.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) mod ring;
#[cfg(feature = "mpi")]
pub(crate) mod shm;
pub mod sync;
pub mod watchdog;

use comm::Communicator;

/// The slowest rank's time of each of a series of collective calls, sorted ascending: every rank
/// passes its own seconds of the same calls (a collective: all ranks call it) and gets the result.
pub fn slowest_sorted(comm: &dyn Communicator, times: &[f64]) -> Vec<f64> {
    let world = comm.world_size();
    let mut all = vec![0.0f64; times.len() * world];
    comm.all_gather_into(times, &mut all);
    let mut slowest: Vec<f64> =
        (0..times.len()).map(|i| (0..world).map(|r| all[r * times.len() + i]).fold(0.0, f64::max)).collect();
    slowest.sort_by(f64::total_cmp);
    slowest
}

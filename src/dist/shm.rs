//! Reduce-scatter and all-gather through an MPI-3 shared-memory window, for ranks on one node.
//!
//! When every rank runs on the same node (`MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)` holds them
//! all), `MPI_Win_allocate_shared` gives each rank a segment that the others can load from and
//! store to directly. A collective then is: write what the others need into my segment, one
//! `MPI_Barrier` (with `MPI_Win_sync` on both sides, the MPI-3 unified-model pattern), read what I
//! need from theirs. For W1's 2.1 MB gradient on two ranks a reduce-scatter is a 1 MB copy, a
//! barrier and a 1 MB add, with no message protocol and no kernel copy; the
//! [`ring`](crate::dist::ring) on `MPI_Sendrecv` pays Open MPI's rendezvous and a CMA copy per step.
//! Plain loads and stores also keep working when the host's memory system is contended, where the
//! ring's kernel copies stall (`lbbsp bench allreduce` compares the window, the ring and
//! `MPI_Allreduce`).
//!
//! Each rank's segment holds two outboxes of the buffer's length, used alternately by successive
//! collectives: the writes of call `k + 2` cannot race the reads of call `k`, since every rank
//! finished reading call `k` before it entered the barrier of call `k + 1`. So one barrier per
//! collective suffices for any sequence of calls.
//!
//! Blocks and summation order are the ring's ([`ring::block`](crate::dist::ring::block); block `c` is
//! summed as `g_c + (… + (g_{c+2} + g_{c+1}))`), so a run gives the same bits on either path.

use crate::dist::ring::block;
use crate::error::{Error, Result};
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives as _};
use std::os::raw::{c_int, c_void};

/// A shared window of `world` segments, each two outboxes of `cap` floats.
pub struct NodeWindow {
    win: ffi::MPI_Win,
    /// Segment base of each rank, mapped into this process.
    bases: Vec<*mut f32>,
    cap: usize,
    /// Which outbox the next collective uses.
    parity: usize,
}

impl NodeWindow {
    /// Allocates the window on `node` (collective over `node`, whose ranks must all call it with
    /// the same `cap`), each rank's segment ready for direct loads and stores.
    pub fn allocate(node: &SimpleCommunicator, cap: usize) -> Result<NodeWindow> {
        let bytes = Self::bytes(cap);
        let fail = |what: &str, code: c_int| {
            Error::Comm(format!(
                "{what} failed (code {code}) for a {bytes}-byte shared window; \
                 pass `--allreduce ring` to sum over MPI_Sendrecv instead"
            ))
        };
        let mut win: ffi::MPI_Win = unsafe { std::mem::zeroed() };
        let mut base: *mut f32 = std::ptr::null_mut();
        // SAFETY: plain MPI-3 calls on a valid communicator; the out-pointers are live locals.
        let code = unsafe {
            ffi::MPI_Win_allocate_shared(
                bytes as ffi::MPI_Aint,
                std::mem::size_of::<f32>() as c_int,
                ffi::RSMPI_INFO_NULL,
                node.as_raw(),
                (&mut base as *mut *mut f32).cast::<c_void>(),
                &mut win,
            )
        };
        if code != 0 {
            return Err(fail("MPI_Win_allocate_shared", code));
        }
        let mut bases = Vec::with_capacity(node.size() as usize);
        for r in 0..node.size() {
            let (mut size, mut unit, mut ptr): (ffi::MPI_Aint, c_int, *mut f32) = (0, 0, std::ptr::null_mut());
            // SAFETY: `win` was just allocated on `node`; `r` is one of its ranks.
            let code = unsafe {
                ffi::MPI_Win_shared_query(win, r, &mut size, &mut unit, (&mut ptr as *mut *mut f32).cast::<c_void>())
            };
            if code != 0 || (size as usize) < bytes {
                return Err(fail("MPI_Win_shared_query", code));
            }
            bases.push(ptr);
        }
        // One passive-target epoch for the window's life: loads and stores are then legal at any
        // time, ordered by MPI_Win_sync + barrier.
        // SAFETY: valid window; assert 0 (no hints).
        let code = unsafe { ffi::MPI_Win_lock_all(0, win) };
        if code != 0 {
            return Err(fail("MPI_Win_lock_all", code));
        }
        Ok(NodeWindow { win, bases, cap, parity: 0 })
    }

    /// Bytes of one rank's segment for outboxes of `cap` floats.
    pub fn bytes(cap: usize) -> usize {
        2 * cap * std::mem::size_of::<f32>()
    }

    /// Floats each outbox holds.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Outbox of `rank` for the current collective, `len ≤ cap` floats.
    fn outbox(&self, rank: usize) -> *mut f32 {
        // SAFETY: the segment holds 2·cap floats.
        unsafe { self.bases[rank].add(self.parity * self.cap) }
    }

    /// Makes this rank's stores visible to the others and theirs to this one: `MPI_Win_sync`,
    /// barrier, `MPI_Win_sync`.
    fn exchange(&self, node: &SimpleCommunicator) {
        // SAFETY: valid window inside its lock_all epoch.
        unsafe { ffi::MPI_Win_sync(self.win) };
        node.barrier();
        unsafe { ffi::MPI_Win_sync(self.win) };
    }

    fn flip(&mut self) {
        self.parity ^= 1;
    }

    /// Reduce-scatter in place, as [`ring::reduce_scatter`](crate::dist::ring::reduce_scatter): this
    /// rank's block of `buf` ends up holding the sum over ranks, in the ring's order.
    pub fn reduce_scatter(&mut self, node: &SimpleCommunicator, buf: &mut [f32], split: usize) {
        let (rank, world, len) = (node.rank() as usize, node.size() as usize, buf.len());
        assert!(len <= self.cap, "shared window of {} floats for {len}", self.cap);
        let mine = self.outbox(rank);
        for c in (0..world).filter(|&c| c != rank) {
            let b = block(len, split, world, c);
            // SAFETY: my outbox, block `b` within `cap`; no rank reads it before the barrier.
            unsafe { publish(&buf[b.clone()], mine.add(b.start)) };
        }
        self.exchange(node);
        let b = block(len, split, world, rank);
        // The others' copies of my block, from rank + 1 around to rank − 1 (the ring's order).
        let theirs = |k: usize| {
            let src = self.outbox((rank + 1 + k) % world);
            // SAFETY: that rank wrote this block before the barrier and leaves it alone until
            // after the next one (the other outbox is used in between).
            unsafe { std::slice::from_raw_parts(src.add(b.start), b.len()) }
        };
        sum_into(&mut buf[b.clone()], world - 1, theirs);
        self.flip();
    }

    /// All-gather in place, as [`ring::all_gather`](crate::dist::ring::all_gather).
    pub fn all_gather(&mut self, node: &SimpleCommunicator, buf: &mut [f32], split: usize) {
        let (rank, world, len) = (node.rank() as usize, node.size() as usize, buf.len());
        assert!(len <= self.cap, "shared window of {} floats for {len}", self.cap);
        let b = block(len, split, world, rank);
        // SAFETY: as in `reduce_scatter`.
        unsafe { publish(&buf[b.clone()], self.outbox(rank).add(b.start)) };
        self.exchange(node);
        for c in (0..world).filter(|&c| c != rank) {
            let b = block(len, split, world, c);
            // SAFETY: rank `c` wrote its block of its outbox before the barrier.
            unsafe { std::ptr::copy_nonoverlapping(self.outbox(c).add(b.start), buf[b.clone()].as_mut_ptr(), b.len()) };
        }
        self.flip();
    }
}

/// Checks that the file system behind Open MPI's shared windows (`OMPI_MCA_osc_sm_backing_directory`,
/// by default `/dev/shm`) has `bytes` free. The window is a file there, mapped by every rank; a
/// container's small `/dev/shm` (Docker's default is 64 MB) would otherwise end the job with a bus
/// error when the pages are first touched, and a missing directory makes Open MPI abort the job (its
/// error handler on a failed `MPI_Win_allocate_shared` cannot return: the other ranks would wait in
/// it forever). Checked first, either falls back to the ring.
pub fn room(bytes: usize) -> Result<()> {
    let dir = std::env::var("OMPI_MCA_osc_sm_backing_directory").unwrap_or_else(|_| "/dev/shm".into());
    let unreadable = || Error::Comm(format!("cannot read the free space of {dir}"));
    let path = std::ffi::CString::new(dir.clone()).map_err(|_| unreadable())?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a live out-struct.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return Err(unreadable());
    }
    let free = st.f_bavail as u128 * st.f_frsize as u128;
    // Room for the window and as much again for whatever else shares the directory.
    if free < 2 * bytes as u128 {
        return Err(Error::Comm(format!(
            "{dir} has {} MB free, the window needs {} MB; enlarge it (e.g. `docker run --shm-size=1g`) or set \
             OMPI_MCA_osc_sm_backing_directory to a larger local directory",
            free >> 20,
            bytes.div_ceil(1 << 20)
        )));
    }
    Ok(())
}

/// Copies `src` to `dst` (in this rank's outbox) with non-temporal stores: the lines go to memory
/// without being read for ownership first. The other rank read these lines two collectives ago
/// and may still hold them; a plain copy (`memcpy`) must invalidate each one in its cache first,
/// a cost that varies several-fold with where the lines are (on virtual CPUs most of all), while
/// streaming stores cost the same every time.
///
/// # Safety
/// `dst` is valid for `src.len()` floats and no other rank reads them until the next barrier.
unsafe fn publish(src: &[f32], dst: *mut f32) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_loadu_ps, _mm_sfence, _mm_stream_ps};
        let n = src.len();
        // Scalar stores up to a 16-byte boundary, then 4 floats per streaming store.
        let head = ((16 - dst as usize % 16) % 16 / 4).min(n);
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
        let mut i = head;
        while i + 4 <= n {
            _mm_stream_ps(dst.add(i), _mm_loadu_ps(src.as_ptr().add(i)));
            i += 4;
        }
        std::ptr::copy_nonoverlapping(src.as_ptr().add(i), dst.add(i), n - i);
        // Streaming stores are weakly ordered: drain them before the barrier publishes them.
        _mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
}

/// `own[i] = own[i] + (… + (theirs(1)[i] + theirs(0)[i]))` over `n` others: the ring's order of
/// additions, so the bits match [`ring::reduce_scatter`](crate::dist::ring::reduce_scatter).
fn sum_into<'a>(own: &mut [f32], n: usize, theirs: impl Fn(usize) -> &'a [f32]) {
    if n == 1 {
        own.iter_mut().zip(theirs(0)).for_each(|(o, &t)| *o += t);
        return;
    }
    const STEP: usize = 256;
    let mut acc = [0.0f32; STEP];
    for start in (0..own.len()).step_by(STEP) {
        let end = (start + STEP).min(own.len());
        let acc = &mut acc[..end - start];
        acc.copy_from_slice(&theirs(0)[start..end]);
        for k in 1..n {
            acc.iter_mut().zip(&theirs(k)[start..end]).for_each(|(a, &t)| *a += t);
        }
        own[start..end].iter_mut().zip(acc.iter()).for_each(|(o, &a)| *o += a);
    }
}

impl Drop for NodeWindow {
    fn drop(&mut self) {
        // SAFETY: ends the epoch opened in `allocate` and frees the window (collective: every rank
        // drops its communicator at the end of the job, as it calls MPI_Finalize).
        unsafe {
            ffi::MPI_Win_unlock_all(self.win);
            ffi::MPI_Win_free(&mut self.win);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_names_the_directory_and_the_fix() {
        assert!(room(0).is_ok());
        let err = room(1 << 60).unwrap_err().to_string();
        assert!(err.contains("/dev/shm") && err.contains("--shm-size") && err.contains("MB free"), "{err}");
    }
}

//! A fixed team of helper threads for fine-grained fork-join inside one training step.
//!
//! A step of a small model is a few dozen short parallel regions (each GEMM, each layer's
//! per-sample or element-wise loop, the optimizer update) with serial work in between; all of them
//! run here, not on rayon, so no second set of threads competes with the team for the cores. A
//! pool whose idle threads go to sleep pays a wake-up per region, and on a virtual machine a
//! sleeping vCPU takes tens of microseconds to wake. The team's helpers instead spin for `SPIN`
//! (300 µs) after each job before parking, as BLAS libraries' threads do, so back-to-back regions
//! hand over in well under a microsecond. The team has `rayon::current_num_threads() − 1` helpers
//! (read at first use; none with one thread per rank) and runs one job at a time: a caller that
//! finds it busy (say a GEMM inside a task of a per-sample layer) runs its tasks itself.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long an idle helper keeps spinning before it parks.
const SPIN: Duration = Duration::from_micros(300);

type Job = dyn Fn(usize) + Sync;

/// The job being run and the handshake with each helper.
///
/// Protocol: the caller (holding `Team::lock`) writes `job` and `tasks`, resets `next`, then posts the
/// job's generation to every helper's `go`; a helper that sees a new `go` runs tasks and stores that
/// generation into its `ack`. The caller returns only after every helper acked, so no helper ever
/// touches a job's fields once its caller moved on, and the next caller writes them only then.
struct Shared {
    job: std::cell::UnsafeCell<&'static Job>,
    tasks: std::cell::UnsafeCell<usize>,
    next: AtomicUsize,
    go: Vec<AtomicUsize>,
    ack: Vec<AtomicUsize>,
    parked: Vec<AtomicBool>,
    /// Set by a helper whose task panicked (it still acks); the caller then panics too.
    panicked: AtomicBool,
}

// SAFETY: `job` and `tasks` are written only by the caller holding `Team::lock` while every helper has
// acked the previous job, and read by helpers only between an Acquire of a new `go` and their `ack`.
unsafe impl Sync for Shared {}

struct Team {
    shared: &'static Shared,
    helpers: Vec<Thread>,
    /// Held by the caller of the running job; holds the last generation posted.
    lock: Mutex<usize>,
}

fn team() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let n = rayon::current_num_threads().saturating_sub(1);
        let zeros = || (0..n).map(|_| AtomicUsize::new(0)).collect::<Vec<_>>();
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            job: std::cell::UnsafeCell::new(&|_| {}),
            tasks: std::cell::UnsafeCell::new(0),
            next: AtomicUsize::new(0),
            go: zeros(),
            ack: zeros(),
            parked: (0..n).map(|_| AtomicBool::new(false)).collect(),
            panicked: AtomicBool::new(false),
        }));
        let helpers = (0..n)
            .map(|i| {
                std::thread::Builder::new()
                    .name(format!("lbbsp-team-{i}"))
                    .spawn(move || helper(shared, i))
                    .expect("spawn a team thread")
                    .thread()
                    .clone()
            })
            .collect();
        Team { shared, helpers, lock: Mutex::new(0) }
    })
}

thread_local! {
    /// Set on the team's helper threads.
    static HELPER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is one of the team's helpers (a kernel called from inside a team task).
pub(crate) fn is_helper() -> bool {
    HELPER.get()
}

/// Threads a [`run`] can use: the caller plus the team's helpers.
pub fn size() -> usize {
    team().helpers.len() + 1
}

/// Runs `f(0..tasks)` on the caller and the team's helpers; returns when all tasks are done.
/// The caller runs task 0; the others are taken in order by whichever thread is free. With the team
/// busy, the caller runs them all.
pub fn run(tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    let t = team();
    // A task that panicked on the caller left the lock poisoned but the team consistent (the
    // caller waited for every ack while unwinding), so a poisoned lock is taken as is.
    let guard = match t.lock.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    };
    let mut generation = match guard {
        Some(g) if !t.helpers.is_empty() && tasks > 1 => g,
        // Released first, so a GEMM inside one of these tasks can still use the helpers.
        other => {
            drop(other);
            return (0..tasks).for_each(f);
        }
    };
    let s = t.shared;
    // SAFETY: the lifetime is erased only for this call: `run` returns after every helper acked this
    // job, and helpers use it only before their ack.
    let job: &'static Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Job>(f) };
    // SAFETY: we hold the lock and every helper acked the previous job (see `Shared`).
    unsafe {
        *s.job.get() = job;
        *s.tasks.get() = tasks;
    }
    // Task 0 is the caller's: a GEMM split into one block per thread then gives the caller the same
    // block in every pass (see `gemm::Prefer`); helpers start at task 1 and anyone takes what is left.
    s.next.store(1, Ordering::Relaxed);
    *generation += 1;
    let g = *generation;
    for (i, h) in t.helpers.iter().enumerate() {
        s.go[i].store(g, Ordering::SeqCst);
        if s.parked[i].load(Ordering::SeqCst) {
            h.unpark();
        }
    }
    // Waits for every helper's ack when dropped: also if a task panics on this thread, so `f` is not
    // freed under a helper still running it.
    let _acks = Acks { s, g };
    job(0);
    work(s, job, tasks);
    drop(_acks);
    if s.panicked.swap(false, Ordering::AcqRel) {
        panic!("a task panicked on a team thread");
    }
}

/// Runs `f(i, chunks)` for every `i`, in parallel on the team, where `chunks[k]` is the `i`-th
/// `chunk`-long piece of `bufs[k]` (the last piece may be shorter); the buffers must have one length.
/// Element-wise work gives the same bits as one loop over everything, whatever the team size.
///
/// Used for the element-wise parts of a step (optimizer updates, activations, batch gathering), so
/// they run on the same two threads as the GEMMs instead of waking a second pool whose threads
/// would compete with the team's spinning helpers for the cores.
pub fn zip_chunks_mut<T: Send, const M: usize>(
    bufs: [&mut [T]; M],
    chunk: usize,
    f: &(dyn Fn(usize, [&mut [T]; M]) + Sync),
) {
    let n = bufs.first().map_or(0, |b| b.len());
    assert!(bufs.iter().all(|b| b.len() == n), "zip_chunks_mut: buffers of different lengths");
    let pieces = bufs.map(|b| Pieces::new(b, chunk));
    // SAFETY: task `i` runs exactly once (see `run`), so each piece is taken once.
    run(n.div_ceil(chunk), &|i| f(i, std::array::from_fn(|k| unsafe { pieces[k].take(i) })));
}

/// A mutable buffer cut into consecutive `piece`-long pieces (the last may be shorter), each taken
/// by one task of a [`run`]: the pieces of one `&mut [T]` for tasks on several threads.
pub(crate) struct Pieces<'a, T> {
    ptr: *mut T,
    len: usize,
    piece: usize,
    _buf: PhantomData<&'a mut [T]>,
}

// SAFETY: a `Pieces` only hands out disjoint sub-slices of `Send` data, each once (see `take`).
unsafe impl<T: Send> Sync for Pieces<'_, T> {}

impl<'a, T> Pieces<'a, T> {
    pub(crate) fn new(buf: &'a mut [T], piece: usize) -> Pieces<'a, T> {
        assert!(piece > 0, "pieces: empty pieces");
        Pieces { ptr: buf.as_mut_ptr(), len: buf.len(), piece, _buf: PhantomData }
    }
    /// Piece `i`: elements `i·piece .. min((i + 1)·piece, len)`. Panics past the end.
    ///
    /// # Safety
    /// At most one call per `i` while `self` lives: the pieces of different `i` are disjoint, so
    /// the slices handed out never alias.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn take(&self, i: usize) -> &mut [T] {
        let at = i * self.piece;
        assert!(at < self.len || (at == 0 && self.len == 0), "pieces: piece {i} past the end");
        // SAFETY: `at..at + len` is inside the buffer, mutably borrowed for `'a`, and (by the
        // caller's contract) no other live slice from `take` overlaps it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), self.piece.min(self.len - at)) }
    }
}

struct Acks {
    s: &'static Shared,
    g: usize,
}

impl Drop for Acks {
    fn drop(&mut self) {
        for a in &self.s.ack {
            while a.load(Ordering::Acquire) != self.g {
                std::hint::spin_loop();
            }
        }
    }
}

/// Takes and runs tasks of the current job until none are left.
fn work(s: &Shared, job: &Job, tasks: usize) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= tasks {
            return;
        }
        job(i);
    }
}

fn helper(s: &'static Shared, me: usize) {
    HELPER.set(true);
    let mut seen = 0;
    loop {
        let since = Instant::now();
        let mut spins = 0u32;
        while s.go[me].load(Ordering::Acquire) == seen {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && since.elapsed() > SPIN {
                s.parked[me].store(true, Ordering::SeqCst);
                // A job posted before the flag was visible is caught by this re-check.
                if s.go[me].load(Ordering::SeqCst) == seen {
                    std::thread::park_timeout(Duration::from_millis(50));
                }
                s.parked[me].store(false, Ordering::SeqCst);
            }
            std::hint::spin_loop();
        }
        seen = s.go[me].load(Ordering::Acquire);
        // SAFETY: posted before `go` (Release/SeqCst store, Acquire load above); unchanged until we ack.
        let (job, tasks) = unsafe { (*s.job.get(), *s.tasks.get()) };
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(s, job, tasks)));
        if run.is_err() {
            s.panicked.store(true, Ordering::Release);
        }
        s.ack[me].store(seen, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once() {
        for tasks in [0, 1, 2, 7, 64] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..200 {
                run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
            }
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 200), "{tasks} tasks");
        }
    }

    #[test]
    fn zip_chunks_cover_every_element_once_in_matching_pieces() {
        for (n, chunk) in [(0, 4), (1, 4), (10, 3), (64, 8), (100_000, 1 << 15)] {
            let mut a: Vec<u64> = vec![0; n];
            let mut b: Vec<u64> = (0..n as u64).collect();
            zip_chunks_mut([&mut a, &mut b], chunk, &|i, [a, b]| {
                assert_eq!(a.len(), b.len());
                assert!(a.len() == chunk || (i + 1) * chunk >= n);
                for (x, y) in a.iter_mut().zip(b.iter_mut()) {
                    *x += 1 + (i * chunk) as u64;
                    *y *= 2;
                }
            });
            for k in 0..n {
                assert_eq!(a[k], 1 + (k / chunk * chunk) as u64, "n {n} chunk {chunk} element {k}");
                assert_eq!(b[k], 2 * k as u64);
            }
        }
    }

    #[test]
    fn a_panicking_task_panics_the_caller_and_the_team_keeps_working() {
        let r = std::panic::catch_unwind(|| {
            run(8, &|i| {
                if i == 5 {
                    panic!("task 5");
                }
            })
        });
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        run(8, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn concurrent_callers_each_get_their_tasks_done() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for _ in 0..3 {
                sc.spawn(|| {
                    for _ in 0..100 {
                        run(5, &|_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 3 * 100 * 5);
    }
}

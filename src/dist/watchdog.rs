//! The watchdog: no rank waits forever in a collective.
//!
//! A peer that is stopped, swapped out for good or stuck in a loop never reaches the next
//! collective, and MPI's blocking calls have no timeout: without help the others wait for ever.
//! [`Watched`] wraps a [`Communicator`] and keeps a *flight record* of this rank (the idea of
//! PyTorch's NCCL flight recorder): how many collectives it entered, which one it is in and since
//! when, and what the training loop last said it was doing (iteration and [`Phase`]). The record
//! is a small file mapped shared (`$TMPDIR/lbbsp-flight-<job>/rank-<r>`), so every rank of the node
//! reads it as it is now, and the main thread only stores a few atomics per collective. A thread
//! checks it: when this rank has been inside one collective for longer than the timeout, it reads
//! every record it can see, prints which ranks did not arrive, what each was last doing and whether
//! its process is stopped or gone, and ends the process with [`EXIT_TIMEOUT`]. `mpirun` then takes
//! the rest of the job down, so every rank that can still act exits non-zero. A rank on another
//! node has no record here: its own watchdog reports on it.

use crate::dist::comm::Communicator;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The exit status of a rank whose watchdog fired.
pub const EXIT_TIMEOUT: i32 = 3;

pub use crate::dist::comm::Phase;

/// The collectives a record can be in (0: none).
const COLLECTIVES: [&str; 8] = [
    "none",
    "barrier",
    "allreduce",
    "allreduce (f64)",
    "broadcast",
    "all-gather",
    "reduce-scatter",
    "all-gather of blocks",
];

/// Words of a record.
const MAGIC: u64 = 0x6c62_6273_7066_6c31; // "lbbspfl1"
const WORDS: usize = 7;

/// One rank's flight record: words in a file mapped shared, so the main thread's stores are what
/// the other ranks of the node read, at once (word 0 is [`MAGIC`]).
struct Record {
    words: *const AtomicU64,
    file: PathBuf,
}

// SAFETY: the mapping is only reached through atomics, and lives until `Record` is dropped.
unsafe impl Send for Record {}
unsafe impl Sync for Record {}

/// Word indices of a record.
const SEQ: usize = 1; // collectives entered so far
const COLLECTIVE: usize = 2; // the one it is in (an index of `COLLECTIVES`), 0 when in none
const ITER: usize = 3;
const PHASE: usize = 4;
const SINCE_MS: usize = 5; // unix milliseconds of the last change of `COLLECTIVE`
const PID: usize = 6;

impl Record {
    /// Creates `file` (replacing one of that name) and maps it.
    fn create(file: &Path) -> Result<Record> {
        use std::os::fd::AsRawFd;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(file)
            .map_err(|e| Error::io(file, e))?;
        f.set_len(8 * WORDS as u64).map_err(|e| Error::io(file, e))?;
        // SAFETY: a fresh shared mapping of the whole (8·WORDS-byte) file; the fd may close after.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8 * WORDS,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io(file, std::io::Error::last_os_error()));
        }
        let r = Record { words: ptr as *const AtomicU64, file: file.to_path_buf() };
        r.word(PID).store(std::process::id() as u64, Ordering::Relaxed);
        r.word(SINCE_MS).store(now_ms(), Ordering::Relaxed);
        r.word(0).store(MAGIC, Ordering::Release);
        Ok(r)
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < WORDS);
        // SAFETY: in bounds of the mapping, page-aligned so 8-aligned, alive while `self` is.
        unsafe { &*self.words.add(i) }
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            seq: self.word(SEQ).load(Ordering::Acquire),
            collective: self.word(COLLECTIVE).load(Ordering::Acquire),
            iter: self.word(ITER).load(Ordering::Relaxed),
            phase: self.word(PHASE).load(Ordering::Relaxed),
            since_ms: self.word(SINCE_MS).load(Ordering::Acquire),
            pid: self.word(PID).load(Ordering::Relaxed),
        }
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `create`, unused after this.
        unsafe { libc::munmap(self.words as *mut libc::c_void, 8 * WORDS) };
        std::fs::remove_file(&self.file).ok();
        if let Some(dir) = self.file.parent() {
            std::fs::remove_dir(dir).ok(); // fails while other ranks' records are in it
        }
    }
}

/// A record as read back (this rank's own, or another's from its file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    pub seq: u64,
    pub collective: u64,
    pub iter: u64,
    pub phase: u64,
    pub since_ms: u64,
    pub pid: u64,
}

impl Snapshot {
    #[cfg(test)]
    fn to_bytes(self) -> Vec<u8> {
        [MAGIC, self.seq, self.collective, self.iter, self.phase, self.since_ms, self.pid]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect()
    }

    fn from_bytes(b: &[u8]) -> Option<Snapshot> {
        if b.len() != 8 * WORDS {
            return None;
        }
        let w: Vec<u64> = b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        (w[0] == MAGIC).then(|| Snapshot {
            seq: w[1],
            collective: w[2],
            iter: w[3],
            phase: w[4],
            since_ms: w[5],
            pid: w[6],
        })
    }

    /// Whether the rank of this record has not reached the collective of `me` yet.
    fn behind(&self, me: &Snapshot) -> bool {
        self.seq < me.seq
    }

    /// `rank`'s line of a report, relative to the waiting rank's `me`.
    fn describe(&self, rank: usize, me: &Snapshot, now_ms: u64) -> String {
        let ago = now_ms.saturating_sub(self.since_ms) as f64 / 1e3;
        let doing = format!("iteration {}, {}", self.iter, Phase::name_of(self.phase));
        let place = if self.collective == 0 {
            format!("outside any collective for {ago:.1} s")
        } else {
            format!("in {} for {ago:.1} s", COLLECTIVES[self.collective as usize % COLLECTIVES.len()])
        };
        if self.behind(me) {
            let behind = me.seq - self.seq;
            format!(
                "rank {rank}: did NOT arrive: at {doing}, {place}, {behind} collective(s) behind (pid {})",
                self.pid
            )
        } else {
            // Level: in this collective too, or out of it already (a broadcast's root leaves early).
            format!("rank {rank}: arrived: {doing}, {place} (pid {})", self.pid)
        }
    }
}

/// The flight record in `file` (`rank-<r>` of a job's record folder), if it holds one: what that
/// rank is doing now, or was when it died.
pub fn read_record(file: &Path) -> Option<Snapshot> {
    std::fs::read(file).ok().and_then(|b| Snapshot::from_bytes(&b))
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// What the watchdog found when it fired: this rank's record and a line per rank.
#[derive(Debug, Clone)]
pub struct Report {
    pub rank: usize,
    pub waited_s: f64,
    pub lines: Vec<String>,
    /// The ranks whose records show they did not reach this rank's collective.
    pub missing: Vec<usize>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "lbbsp watchdog: rank {} has waited {:.1} s in a collective (runtime.collective_timeout_s); \
             {}. Flight records:",
            self.rank,
            self.waited_s,
            match self.missing.as_slice() {
                [] => "every rank visible from this node arrived; a rank on another node may not have".to_string(),
                m => format!("rank(s) {m:?} did not arrive"),
            }
        )?;
        for l in &self.lines {
            writeln!(f, "  {l}")?;
        }
        write!(f, "every rank that can still act exits with status {EXIT_TIMEOUT}")
    }
}

/// What a fired watchdog does with its report: by default print it and end the process.
pub type OnTimeout = Box<dyn Fn(&Report) + Send>;

/// The default [`OnTimeout`]: the report on stderr, then `_exit` (not `exit`: the main thread is
/// inside MPI, whose exit handlers may wait on it).
pub fn exit_on_timeout() -> OnTimeout {
    Box::new(|report| {
        eprintln!("{report}");
        // SAFETY: _exit ends the process at once; nothing of this process is used after it.
        unsafe { libc::_exit(EXIT_TIMEOUT) }
    })
}

/// A [`Communicator`] with a flight record and a watchdog (see the module's doc). Every rank
/// creates it at the same point: [`Watched::new`] is a collective.
pub struct Watched<'a> {
    inner: &'a dyn Communicator,
    record: Arc<Record>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl<'a> Watched<'a> {
    /// Wraps `inner` and starts the watchdog: a collective that lasts longer than `timeout_s` fires
    /// it (0: never; the record is kept all the same). The records go to a folder of the system's
    /// temporary directory named by rank 0 for this job.
    pub fn new(inner: &'a dyn Communicator, timeout_s: f64, on_timeout: OnTimeout) -> Result<Watched<'a>> {
        let dir = std::env::temp_dir().join(format!("lbbsp-flight-{:x}", job_key(inner)));
        Watched::in_dir(inner, &dir, timeout_s, on_timeout)
    }

    /// [`Watched::new`] with the records in `dir`.
    pub fn in_dir(
        inner: &'a dyn Communicator,
        dir: &Path,
        timeout_s: f64,
        on_timeout: OnTimeout,
    ) -> Result<Watched<'a>> {
        check_timeout(timeout_s)?;
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let file = dir.join(format!("rank-{}", inner.rank()));
        let record = Arc::new(Record::create(&file)?);
        let stop = Arc::new(AtomicBool::new(false));
        let dog = Dog {
            record: record.clone(),
            stop: stop.clone(),
            dir: dir.to_path_buf(),
            rank: inner.rank(),
            world: inner.world_size(),
            timeout_ms: (timeout_s * 1e3) as u64,
            on_timeout,
        };
        let thread = std::thread::Builder::new()
            .name("lbbsp-watchdog".into())
            .spawn(move || dog.run())
            .map_err(|e| Error::Comm(format!("starting the watchdog thread: {e}")))?;
        Ok(Watched { inner, record, stop, thread: Some(thread) })
    }

    fn enter(&self, collective: usize) {
        self.record.word(SEQ).fetch_add(1, Ordering::AcqRel);
        self.record.word(SINCE_MS).store(now_ms(), Ordering::Release);
        self.record.word(COLLECTIVE).store(collective as u64, Ordering::Release);
    }

    fn leave(&self) {
        self.record.word(COLLECTIVE).store(0, Ordering::Release);
        self.record.word(SINCE_MS).store(now_ms(), Ordering::Release);
    }

    fn watch<T>(&self, collective: usize, f: impl FnOnce() -> T) -> T {
        self.enter(collective);
        let out = f();
        self.leave();
        out
    }
}

impl Drop for Watched<'_> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            t.join().ok();
        }
        // The record's file (and the folder, by the last rank out) goes with `self.record`.
    }
}

/// Refuses a timeout that is not a number of seconds ≥ 0, naming its setting.
pub fn check_timeout(timeout_s: f64) -> Result<()> {
    if timeout_s >= 0.0 && timeout_s.is_finite() {
        return Ok(());
    }
    Err(Error::config(
        "runtime.collective_timeout_s",
        format!("{timeout_s} is not a number of seconds ≥ 0 (0 turns the watchdog off)"),
    ))
}

/// A key for this job's record folder, the same on every rank: rank 0's pid and clock.
fn job_key(comm: &dyn Communicator) -> u64 {
    let mine = (std::process::id() as u64) << 20 ^ now_ms() & 0xF_FFFF;
    // Four 16-bit pieces, each exact in an f32.
    let mut words: Vec<f32> = (0..4).map(|i| ((mine >> (16 * i)) & 0xFFFF) as f32).collect();
    comm.broadcast_into(0, &mut words);
    words.iter().enumerate().fold(0, |k, (i, &w)| k | (w as u64) << (16 * i))
}

/// The watchdog's thread.
struct Dog {
    record: Arc<Record>,
    stop: Arc<AtomicBool>,
    dir: PathBuf,
    rank: usize,
    world: usize,
    timeout_ms: u64,
    on_timeout: OnTimeout,
}

impl Dog {
    fn run(self) {
        // Poll often enough to fire within a tenth of the timeout past it.
        let poll = Duration::from_millis((self.timeout_ms / 10).clamp(20, 1000));
        let mut fired = false;
        // When this process was itself stopped, its wait so far is its own doing: count from
        // when it woke up (a poll that overslept by seconds).
        let (mut last_poll, mut woke_ms) = (std::time::Instant::now(), 0);
        while !self.stop.load(Ordering::Acquire) {
            std::thread::park_timeout(poll);
            if last_poll.elapsed() > 4 * poll + Duration::from_secs(1) {
                woke_ms = now_ms();
            }
            last_poll = std::time::Instant::now();
            let me = self.record.snapshot();
            let waited = now_ms().saturating_sub(me.since_ms.max(woke_ms));
            if !fired && self.timeout_ms > 0 && me.collective != 0 && waited > self.timeout_ms {
                (self.on_timeout)(&self.report(&me, waited));
                fired = true;
            }
        }
    }

    fn report(&self, me: &Snapshot, waited_ms: u64) -> Report {
        let now = now_ms();
        let mut lines = Vec::with_capacity(self.world);
        let mut missing = Vec::new();
        for r in 0..self.world {
            let snap = if r == self.rank { Some(*me) } else { read_record(&self.dir.join(format!("rank-{r}"))) };
            match snap {
                Some(s) => {
                    if s.behind(me) {
                        missing.push(r);
                    }
                    let state = if r == self.rank { " (this rank)".to_string() } else { process_state(s.pid) };
                    lines.push(s.describe(r, me, now) + &state);
                }
                None => lines
                    .push(format!("rank {r}: no flight record on this node (another node?): its own watchdog reports")),
            }
        }
        Report { rank: self.rank, waited_s: waited_ms as f64 / 1e3, lines, missing }
    }
}

/// What the kernel says of process `pid` on this node, when it is not plainly running or waiting:
/// a stopped rank is in the same collective as the others and only its state tells it apart.
fn process_state(pid: u64) -> String {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => match stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()) {
            Some('T') | Some('t') => ", its process is STOPPED (SIGSTOP or a debugger)".to_string(),
            Some('Z') | Some('X') => ", its process has ended".to_string(),
            _ => String::new(),
        },
        Err(_) => ", its process is gone".to_string(),
    }
}

impl Communicator for Watched<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn local_size(&self) -> usize {
        self.inner.local_size()
    }
    fn owns_process(&self) -> bool {
        self.inner.owns_process()
    }
    fn note(&self, iter: usize, phase: Phase) {
        self.record.word(ITER).store(iter as u64, Ordering::Relaxed);
        self.record.word(PHASE).store(phase as u64, Ordering::Relaxed);
    }
    fn barrier(&self) {
        self.watch(1, || self.inner.barrier())
    }
    fn all_reduce_sum_into(&self, send: &[f32], recv: &mut [f32]) {
        self.watch(2, || self.inner.all_reduce_sum_into(send, recv))
    }
    fn all_reduce_sum_f64_into(&self, send: &[f64], recv: &mut [f64]) {
        self.watch(3, || self.inner.all_reduce_sum_f64_into(send, recv))
    }
    fn broadcast_into(&self, root: usize, buf: &mut [f32]) {
        self.watch(4, || self.inner.broadcast_into(root, buf))
    }
    fn all_gather_into(&self, send: &[f64], recv: &mut [f64]) {
        self.watch(5, || self.inner.all_gather_into(send, recv))
    }
    fn reduce_scatter_sum(&self, buf: &mut [f32], split: usize) {
        self.watch(6, || self.inner.reduce_scatter_sum(buf, split))
    }
    fn all_gather_blocks(&self, buf: &mut [f32], split: usize) {
        self.watch(7, || self.inner.all_gather_blocks(buf, split))
    }
    fn scatters(&self, len: usize) -> bool {
        self.inner.scatters(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::comm::Local;
    use std::sync::Mutex;

    #[test]
    fn a_rank_that_does_not_arrive_is_named_with_what_it_was_doing() {
        let dir = std::env::temp_dir().join(format!("lbbsp-watchdog-test-{}", std::process::id()));
        let reports: Arc<Mutex<Vec<Report>>> = Arc::default();
        let handles: Vec<_> = Local::group(3)
            .into_iter()
            .map(|c| {
                let (dir, reports) = (dir.clone(), reports.clone());
                std::thread::spawn(move || {
                    let sink = reports.clone();
                    let w = Watched::in_dir(&c, &dir, 0.3, Box::new(move |r| sink.lock().unwrap().push(r.clone())))
                        .unwrap();
                    w.note(7, Phase::Compute);
                    w.barrier();
                    // Rank 2 computes for 1.5 s (five timeouts) before the next collective.
                    if w.rank() == 2 {
                        std::thread::sleep(Duration::from_millis(1500));
                    }
                    w.note(7, Phase::Sync);
                    let mut out = [0.0f32];
                    w.all_reduce_sum_into(&[1.0], &mut out);
                    out[0]
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 3.0, "the collective completes once rank 2 arrives");
        }
        let reports = reports.lock().unwrap();
        // Ranks 0 and 1 fired once each; rank 2 never waited.
        let mut fired: Vec<usize> = reports.iter().map(|r| r.rank).collect();
        fired.sort();
        assert_eq!(fired, vec![0, 1], "{reports:#?}");
        for r in reports.iter() {
            assert_eq!(r.missing, vec![2], "{r}");
            let text = r.to_string();
            assert!(text.contains("rank 2: did NOT arrive: at iteration 7, compute"), "{text}");
            assert!(text.contains("rank 0: arrived: iteration 7, gradient sync, in allreduce"), "{text}");
        }
        assert!(!dir.exists(), "the last rank out removes the records' folder");
    }

    #[test]
    fn records_round_trip_and_foreign_files_are_ignored() {
        let s = Snapshot { seq: 9, collective: 5, iter: 41, phase: 2, since_ms: 1_700_000_000_000, pid: 4242 };
        assert_eq!(Snapshot::from_bytes(&s.to_bytes()), Some(s));
        assert_eq!(Snapshot::from_bytes(b"not a record"), None);
        let mut b = s.to_bytes();
        b[0] ^= 1;
        assert_eq!(Snapshot::from_bytes(&b), None);
    }

    #[test]
    fn a_bad_timeout_is_refused_by_its_setting() {
        let c = Local::group(1).remove(0);
        let e = Watched::in_dir(&c, &std::env::temp_dir(), f64::NAN, exit_on_timeout()).err().unwrap();
        assert!(e.to_string().contains("runtime.collective_timeout_s"), "{e}");
    }
}

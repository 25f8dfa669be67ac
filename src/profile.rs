//! Per-iteration profiling: wall clocks for compute, waiting and transfer, and an interference
//! sample read from `/proc`.
//!
//! Interference is the CPU time that *other* processes used on the cores this rank may run on
//! (its affinity mask; every core when unpinned) during the iteration:
//! `Σ_{cores} busy(core) − own CPU time`. `/proc/stat` counts in clock ticks (usually 10 ms), so a
//! single iteration's sample is coarse; averaged over a few iterations it tracks a co-located job well.
//! For the same reason it is re-read at most once per tick: the kernel formats every core's and
//! every interrupt's counters on each read (tens of µs, a visible share of a short iteration), and a shorter
//! iteration could not see a change anyway. An iteration that ends within a tick of the last read
//! reports 0 and the next read reports everything since, so sums over iterations are unchanged.
//! The rank's own CPU share is its process CPU time (all threads, nanosecond clock) over wall time.
//!
//! Time off the CPU is either waited for (a sleep, a page from disk, a slowed node's stall) or
//! taken (another job's turn on the core, a CPU quota's throttle). Only the second comes in
//! windows that do not scale with the work, so the sampler measures it on its own: the threads'
//! run-queue waits (`run_delay` in `/proc/self/task/*/schedstat`, which counts throttled time too).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// CPU time of this process, all threads (seconds).
pub fn process_cpu_s() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid pointer we pass.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Times this process's threads were descheduled while runnable (`ru_nivcsw`): each slice lost
/// to another job or each freeze by a CPU quota counts once, so frozen seconds over this count are
/// the length of one freeze.
pub fn process_preemptions() -> f64 {
    // SAFETY: getrusage writes one rusage into the valid pointer we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    ru.ru_nivcsw as f64
}

/// The run-queue waits of this process's threads: seconds each was runnable but not running, from
/// the second field of `/proc/self/task/TID/schedstat`. The files stay open and are read in place
/// (no allocation once listed); the list of threads is renewed at most once a second, at a
/// [`RunWaits::mark`], so a thread that starts later counts from then on.
#[derive(Debug, Default)]
struct RunWaits {
    /// Per thread: its file and its wait at the last mark.
    tasks: Vec<(File, u64)>,
    listed: Option<Instant>,
    /// Off for ranks that are threads of one process: the process's threads are not theirs.
    off: bool,
}

impl RunWaits {
    /// A thread's wait in nanoseconds (None once the thread is gone or the kernel has no
    /// `schedstat`).
    fn read(file: &File) -> Option<u64> {
        let mut buf = [0u8; 96];
        let n = file.read_at(&mut buf, 0).ok()?;
        let text = std::str::from_utf8(&buf[..n]).ok()?;
        text.split_whitespace().nth(1)?.parse().ok()
    }

    /// Starts an interval: renews the list of threads when a second has passed, and notes every
    /// thread's wait.
    fn mark(&mut self) {
        if self.off {
            return;
        }
        if self.listed.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            self.listed = Some(Instant::now());
            self.tasks.clear();
            if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
                let files = dir.flatten().filter_map(|e| File::open(e.path().join("schedstat")).ok());
                self.tasks.extend(files.map(|f| (f, 0)));
            }
        }
        for (f, at) in &mut self.tasks {
            *at = Self::read(f).unwrap_or(u64::MAX);
        }
    }

    /// Seconds the threads waited since the last mark (None without a measure).
    fn since_mark(&self) -> Option<f64> {
        let mut ns = 0u64;
        let mut any = false;
        for (f, at) in &self.tasks {
            if let (Some(now), true) = (Self::read(f), *at != u64::MAX) {
                ns += now.saturating_sub(*at);
                any = true;
            }
        }
        any.then_some(ns as f64 * 1e-9)
    }
}

/// Cores this process may run on, from `/proc/self/status` (`Cpus_allowed_list`, e.g. `0-3,8`).
pub fn allowed_cores() -> Vec<usize> {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let list = text.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap_or("").trim();
    parse_cpu_list(list)
}

/// Parses a kernel CPU list such as `0-3,8,10-11`.
pub fn parse_cpu_list(list: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.parse::<usize>().ok()),
        }
    }
    out
}

fn ticks_per_s() -> f64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Busy seconds (everything but idle and iowait) of the given cores since boot, from the text of a
/// `/proc/stat`.
pub fn busy_s_from(stat: &str, cores: &[usize], ticks: f64) -> f64 {
    let mut total = 0u64;
    for line in stat.lines() {
        let Some(rest) = line.strip_prefix("cpu") else { continue };
        let mut fields = rest.split_whitespace();
        let Some(Ok(id)) = fields.next().map(str::parse::<usize>) else { continue };
        if !cores.contains(&id) {
            continue;
        }
        // user nice system idle iowait irq softirq steal guest guest_nice; guest time is already in user.
        let busy = fields.take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4);
        total += busy.map(|(_, f)| f.parse::<u64>().unwrap_or(0)).sum::<u64>();
    }
    total as f64 / ticks
}

/// A running sample of interference and own CPU share.
///
/// Keeps `/proc/stat` open and reads it into a reused buffer, so a sample per iteration allocates
/// nothing once the buffer has grown.
#[derive(Debug)]
pub struct CpuSampler {
    cores: Vec<usize>,
    /// Wall clock, own CPU time and preemptions at the last sample (for the CPU share).
    wall: Instant,
    own: f64,
    preempted: f64,
    waits: RunWaits,
    /// Busy time of the cores, own CPU time and wall clock at the last read of `/proc/stat`.
    busy: f64,
    own_at_read: f64,
    read_at: Instant,
    /// Seconds of one `/proc/stat` tick.
    tick_s: f64,
    reads: u64,
    stat: Option<std::fs::File>,
    text: String,
}

/// What a [`CpuSampler`] saw since its last reset.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuSample {
    /// CPU seconds used by other processes on this rank's cores.
    pub interference_s: f64,
    /// This process's CPU seconds divided by wall seconds.
    pub cpu_share: f64,
    /// Times the process was descheduled while runnable ([`process_preemptions`]).
    pub preemptions: f64,
    /// Seconds the process's threads waited to run while runnable since [`CpuSampler::mark`]
    /// (summed over threads; 0 without a mark or a measure): the frozen part of the time off the
    /// CPU, where a sleep is not.
    pub frozen_s: f64,
    /// Wall seconds of the interval, ending after the CPU clock's read. That read is where a
    /// CPU quota spent by work without system calls takes effect (the kernel accounts the run
    /// time there and throttles on the way back), so a freeze the work ran into falls inside the
    /// interval, alike for the CPU share, the waits and this.
    pub wall_s: f64,
}

impl CpuSampler {
    /// A sampler of this process: its CPU share, preemptions and threads' run-queue waits.
    pub fn new() -> CpuSampler {
        Self::with_waits(true)
    }

    /// A sampler for a rank that is one thread of a process holding others: the process's counters
    /// are every rank's, so it reports no CPU share (1), preemptions or waits of its own (only the
    /// interference on its cores).
    pub fn of_thread() -> CpuSampler {
        Self::with_waits(false)
    }

    fn with_waits(waits: bool) -> CpuSampler {
        let stat = std::fs::File::open("/proc/stat").ok();
        let now = Instant::now();
        let mut s = CpuSampler {
            cores: allowed_cores(),
            wall: now,
            own: 0.0,
            preempted: process_preemptions(),
            waits: RunWaits { off: !waits, ..RunWaits::default() },
            busy: 0.0,
            own_at_read: 0.0,
            read_at: now,
            tick_s: 1.0 / ticks_per_s(),
            reads: 0,
            stat,
            text: String::new(),
        };
        (s.busy, s.own) = (s.read_busy(), process_cpu_s());
        s.own_at_read = s.own;
        s
    }

    /// [`busy_s_from`] of the open `/proc/stat`, re-read (0 where there is none).
    fn read_busy(&mut self) -> f64 {
        use std::io::{Read, Seek, SeekFrom};
        self.reads += 1;
        self.text.clear();
        if let Some(f) = self.stat.as_mut() {
            if f.seek(SeekFrom::Start(0)).and_then(|_| f.read_to_string(&mut self.text)).is_err() {
                self.text.clear();
            }
        }
        busy_s_from(&self.text, &self.cores, ticks_per_s())
    }

    /// Starts the CPU share's interval here, so that the next sample's share covers what follows
    /// only (the interference's interval goes on from its last read of `/proc/stat`).
    pub fn mark(&mut self) {
        self.waits.mark();
        (self.own, self.wall, self.preempted) = (process_cpu_s(), Instant::now(), process_preemptions());
    }

    /// The sample since the previous call (or creation, or [`CpuSampler::mark`]), and starts a new one.
    /// `/proc/stat` is read only when a tick has passed since its last read (see the module docs).
    pub fn sample(&mut self) -> CpuSample {
        let (own, wall) = (process_cpu_s(), Instant::now());
        let dt = wall.duration_since(self.wall).as_secs_f64();
        let mut interference_s = 0.0;
        if wall.duration_since(self.read_at).as_secs_f64() >= self.tick_s {
            let busy = self.read_busy();
            interference_s = (busy - self.busy - (own - self.own_at_read)).max(0.0);
            (self.busy, self.own_at_read, self.read_at) = (busy, own, wall);
        }
        let preempted = process_preemptions();
        // Without a measure of the waits, preemptions cannot be told from sleeps: none are counted.
        let frozen_s = self.waits.since_mark();
        let s = CpuSample {
            interference_s,
            cpu_share: if self.waits.off {
                1.0
            } else if dt > 0.0 {
                (own - self.own) / dt
            } else {
                0.0
            },
            preemptions: if frozen_s.is_some() { preempted - self.preempted } else { 0.0 },
            frozen_s: frozen_s.unwrap_or(0.0),
            wall_s: dt,
        };
        (self.own, self.wall, self.preempted) = (own, wall, preempted);
        s
    }
}

impl Default for CpuSampler {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_and_stat_parse() {
        assert_eq!(parse_cpu_list("0-2,5, 7-8"), vec![0, 1, 2, 5, 7, 8]);
        let stat = "cpu  10 0 10 100 0 0 0 0 0 0\ncpu0 4 1 5 50 7 0 0 0 0 0\ncpu1 6 0 4 50 0 0 2 0 0 0\nintr 1\n";
        assert_eq!(busy_s_from(stat, &[0], 100.0), 0.10);
        assert_eq!(busy_s_from(stat, &[0, 1], 100.0), 0.22);
    }

    #[test]
    fn own_cpu_time_advances_while_busy() {
        let mut s = CpuSampler::new();
        let t = Instant::now();
        let mut x = 0u64;
        while t.elapsed().as_millis() < 50 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let smp = s.sample();
        assert!(smp.cpu_share > 0.5, "{smp:?}");
    }

    /// A sleep is time off the CPU that no one took: it is not frozen. Time another thread of ours
    /// takes on the one core we are allowed is.
    #[test]
    fn waits_tell_a_sleep_from_a_freeze() {
        let spin = |ms: u128| {
            let t = Instant::now();
            let mut x = 0u64;
            while t.elapsed().as_millis() < ms {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
            std::hint::black_box(x);
        };
        if !std::path::Path::new("/proc/thread-self/schedstat").exists() {
            return;
        }
        // This thread's waits alone: the harness runs other tests in threads of this process,
        // and on a loaded host their waits would count.
        let mut s = CpuSampler::new();
        s.waits.tasks = File::open("/proc/thread-self/schedstat").into_iter().map(|f| (f, 0)).collect();
        s.waits.listed = Some(Instant::now());
        s.mark();
        std::thread::sleep(Duration::from_millis(60));
        let slept = s.sample();
        assert!(slept.frozen_s < 0.02, "a 60 ms sleep counted as {:.3} s frozen", slept.frozen_s);
        // Two spinning threads pinned to one core take turns: each waits for the other.
        // SAFETY: sched_setaffinity reads the set we pass; 0 is this thread.
        let pin = || unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(allowed_cores().first().copied().unwrap_or(0), &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        };
        let other = std::thread::spawn(move || {
            pin();
            spin(300)
        });
        std::thread::sleep(Duration::from_millis(20));
        s.waits.listed = None;
        s.mark();
        pin();
        spin(200);
        let shared = s.sample();
        other.join().unwrap();
        assert!(shared.frozen_s > 0.05, "two threads on one core for 200 ms: {shared:?}");
    }

    #[test]
    fn stat_is_read_at_most_once_per_tick() {
        let mut s = CpuSampler::new();
        let t = Instant::now();
        for _ in 0..2000 {
            s.sample();
        }
        let ticks = t.elapsed().as_secs_f64() / s.tick_s;
        // One read at creation, then at most one per tick that passed.
        assert!((s.reads as f64) <= ticks + 2.0, "{} reads of /proc/stat in {ticks:.1} ticks", s.reads);
        let before = s.reads;
        std::thread::sleep(std::time::Duration::from_secs_f64(1.5 * s.tick_s));
        s.sample();
        assert_eq!(s.reads, before + 1, "a sample a tick later reads /proc/stat again");
    }

    #[test]
    fn rereading_the_open_stat_file_sees_time_pass() {
        let mut s = CpuSampler::new();
        let first = s.read_busy();
        let t = Instant::now();
        let mut x = 0u64;
        while t.elapsed().as_millis() < 100 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        assert!(first > 0.0 && s.read_busy() > first, "busy time did not advance from {first}");
    }
}

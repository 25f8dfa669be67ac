//! `lbbsp interfere`: a co-located CPU burner that plays the other tenant of a shared node.
//!
//! One burner thread per listed core (or several, `--threads-per-core`) is pinned to its core and,
//! in every 10 ms slice, spins for `load × 10 ms` and sleeps for the rest. The load follows a
//! [`Pattern`]: constant, a square wave (`--on` seconds at `--load`, `--off` seconds idle), or a
//! trace file of `time_s load` lines. It runs for `--duration` seconds, or until it is stopped
//! (SIGINT, SIGTERM or SIGKILL all end it: it holds no state worth flushing).
//!
//! The trainer sees the burner as interference (`interference_s` in the metrics) and, under LB-BSP,
//! shifts samples away from the ranks pinned to the burnt cores.

use lbbsp::error::{Error, Result};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Length of one duty-cycle slice.
const SLICE: Duration = Duration::from_millis(10);

/// Burn CPU on some cores following a load pattern, beside a training job.
#[derive(clap::Args, Debug, Clone)]
pub struct InterfereArgs {
    /// Cores to burn, kernel cpu-list syntax (`1`, `0-1,3`) [default: every core this process may use].
    #[arg(long, value_name = "LIST")]
    pub cores: Option<String>,
    /// Busy fraction of each 10 ms slice, in [0, 1] (constant and square patterns).
    #[arg(long, value_name = "F", default_value_t = 1.0)]
    pub load: f64,
    /// How the load varies over time.
    #[arg(long, value_enum, default_value_t = PatternKind::Constant)]
    pub pattern: PatternKind,
    /// Square pattern: seconds at `--load` in each period.
    #[arg(long, value_name = "SECONDS")]
    pub on: Option<f64>,
    /// Square pattern: idle seconds in each period.
    #[arg(long, value_name = "SECONDS")]
    pub off: Option<f64>,
    /// Trace pattern: text file of `time_s load` lines (piecewise constant, `#` starts a comment).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Trace pattern: restart the trace at its last time stamp instead of holding its last load.
    #[arg(long = "loop")]
    pub loop_trace: bool,
    /// Stop after this many seconds [default: run until killed].
    #[arg(long, value_name = "SECONDS")]
    pub duration: Option<f64>,
    /// Burner threads pinned to each listed core.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub threads_per_core: usize,
}

/// The `--pattern` choices.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatternKind {
    Constant,
    Square,
    Trace,
}

/// A load (busy fraction in [0, 1]) as a function of seconds since start; see [`load_at`].
#[derive(Debug, Clone, PartialEq)]
pub enum Pattern {
    /// The same load all the time.
    Constant { load: f64 },
    /// `load` for `on_s` seconds, then 0 for `off_s` seconds, repeated; starts with the on phase.
    Square { load: f64, on_s: f64, off_s: f64 },
    /// Piecewise constant: from `points[k].0` seconds on, the load is `points[k].1`; 0 before the
    /// first time stamp. Times strictly increase. With `looped`, time wraps at the last time stamp
    /// (so that line only marks the period's end); without, the last load holds forever.
    Trace { path: PathBuf, points: Vec<(f64, f64)>, looped: bool },
}

impl Pattern {
    /// Builds and checks the pattern the arguments describe; reads the trace file if there is one.
    pub fn from_args(args: &InterfereArgs) -> Result<Pattern> {
        let load = args.load;
        if !(0.0..=1.0).contains(&load) {
            return Err(Error::config("--load", format!("{load} is outside [0, 1]")));
        }
        match args.pattern {
            PatternKind::Constant => Ok(Pattern::Constant { load }),
            PatternKind::Square => {
                let on_s = positive_seconds("--on", args.on)?;
                let off_s = positive_seconds("--off", args.off)?;
                Ok(Pattern::Square { load, on_s, off_s })
            }
            PatternKind::Trace => {
                let path = args
                    .trace
                    .clone()
                    .ok_or_else(|| Error::config("--trace", "the trace pattern needs --trace FILE"))?;
                let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
                let points = parse_trace(&path, &text)?;
                Ok(Pattern::Trace { path, points, looped: args.loop_trace })
            }
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pattern::Constant { load } => write!(f, "constant load {load:.2}"),
            Pattern::Square { load, on_s, off_s } => {
                write!(f, "square wave: load {load:.2} for {on_s} s, idle {off_s} s")
            }
            Pattern::Trace { path, points, looped } => {
                let end = points.last().map_or(0.0, |p| p.0);
                let then = if *looped { "looped" } else { "then holding the last load" };
                write!(f, "trace {} ({} steps over {end} s, {then})", path.display(), points.len())
            }
        }
    }
}

/// The busy fraction `pattern` asks for `t` seconds after start.
pub fn load_at(pattern: &Pattern, t: f64) -> f64 {
    match pattern {
        Pattern::Constant { load } => *load,
        Pattern::Square { load, on_s, off_s } => {
            if t.rem_euclid(on_s + off_s) < *on_s {
                *load
            } else {
                0.0
            }
        }
        Pattern::Trace { points, looped, .. } => {
            let period = points.last().map_or(0.0, |p| p.0);
            let t = if *looped && period > 0.0 { t.rem_euclid(period) } else { t };
            // Index of the first point strictly after t; the one before it is in force.
            let k = points.partition_point(|p| p.0 <= t);
            if k == 0 {
                0.0
            } else {
                points[k - 1].1
            }
        }
    }
}

/// Parses a trace's text: one `time_s load` pair per line, blank lines and `#` comments skipped.
/// Errors name `path` and the line.
pub fn parse_trace(path: &Path, text: &str) -> Result<Vec<(f64, f64)>> {
    let mut points: Vec<(f64, f64)> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |msg: String| Error::data(path, format!("line {}: {msg}", i + 1));
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [t, load] = fields[..] else {
            return Err(bad(format!("expected `time_s load`, found `{line}`")));
        };
        let t: f64 = t.parse().map_err(|_| bad(format!("time `{t}` is not a number")))?;
        let load: f64 = load.parse().map_err(|_| bad(format!("load `{load}` is not a number")))?;
        if !(t.is_finite() && t >= 0.0) {
            return Err(bad(format!("time {t} must be a finite number of seconds ≥ 0")));
        }
        if !(0.0..=1.0).contains(&load) {
            return Err(bad(format!("load {load} is outside [0, 1]")));
        }
        if let Some(&(prev, _)) = points.last() {
            if t <= prev {
                return Err(bad(format!("time {t} does not come after the previous line's {prev}")));
            }
        }
        points.push((t, load));
    }
    if points.is_empty() {
        return Err(Error::data(path, "no `time_s load` lines"));
    }
    Ok(points)
}

/// Parses and checks `--cores` against a machine with `n_cpus` cores; sorted, without repeats.
pub fn parse_cores(list: &str, n_cpus: usize) -> Result<Vec<usize>> {
    let bad = |msg: String| Error::config("--cores", msg);
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        match (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
            (Ok(a), Ok(b)) if a <= b => {}
            _ => return Err(bad(format!("`{part}` is not a core or a range like `0-3`"))),
        }
    }
    let mut cores = lbbsp::profile::parse_cpu_list(list);
    cores.sort_unstable();
    cores.dedup();
    if cores.is_empty() {
        return Err(bad("the core list is empty".into()));
    }
    if let Some(&c) = cores.iter().find(|&&c| c >= n_cpus) {
        let last = n_cpus - 1;
        return Err(bad(format!("core {c} does not exist: this machine has cores 0-{last}")));
    }
    Ok(cores)
}

/// Runs the burner threads until `--duration` passes (or forever), after printing what it does.
pub fn run(args: &InterfereArgs) -> Result<()> {
    let pattern = Arc::new(Pattern::from_args(args)?);
    let cores = match &args.cores {
        Some(list) => parse_cores(list, online_cpus())?,
        None => default_cores(),
    };
    if args.threads_per_core == 0 {
        return Err(Error::config("--threads-per-core", "must be at least 1"));
    }
    let duration = match args.duration {
        Some(d) => Some(Duration::from_secs_f64(positive_seconds("--duration", Some(d))?)),
        None => None,
    };
    let n_threads = cores.len() * args.threads_per_core;
    let until = duration.map_or("until killed".into(), |d| format!("for {} s", d.as_secs_f64()));
    eprintln!("lbbsp interfere: {n_threads} burner thread(s) on core(s) {cores:?}, {pattern}, {until}");

    let stop = Arc::new(AtomicBool::new(false));
    let (pinned_tx, pinned_rx) = mpsc::channel();
    let start = Instant::now();
    let mut handles = Vec::new();
    for &core in cores.iter().flat_map(|c| std::iter::repeat_n(c, args.threads_per_core)) {
        let (pattern, stop, pinned_tx) = (pattern.clone(), stop.clone(), pinned_tx.clone());
        handles.push(std::thread::spawn(move || {
            let pinned = pin_to_core(core);
            let ok = pinned.is_ok();
            let _ = pinned_tx.send(pinned);
            if ok {
                burn(&pattern, start, duration, &stop);
            }
        }));
    }
    drop(pinned_tx);
    // Every thread reports its pinning once; on a failure stop them all.
    let mut result = Ok(());
    for pinned in pinned_rx.iter().take(n_threads) {
        if let Err(e) = pinned {
            stop.store(true, Ordering::Relaxed);
            result = result.and(Err(e));
        }
    }
    for h in handles {
        let _ = h.join();
    }
    result
}

/// Every 10 ms slice: spin for `load × 10 ms`, sleep to the slice's end; until `duration` or `stop`.
fn burn(pattern: &Pattern, start: Instant, duration: Option<Duration>, stop: &AtomicBool) {
    let mut slice_start = Instant::now();
    loop {
        let elapsed = slice_start.duration_since(start);
        if stop.load(Ordering::Relaxed) || duration.is_some_and(|d| elapsed >= d) {
            return;
        }
        let busy = SLICE.mul_f64(load_at(pattern, elapsed.as_secs_f64()));
        spin_until(slice_start + busy);
        let next = slice_start + SLICE;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
        slice_start = next.max(now);
    }
}

/// Integer arithmetic the optimiser can't remove, until `deadline`.
fn spin_until(deadline: Instant) {
    let mut x = 1u64;
    while Instant::now() < deadline {
        for _ in 0..256 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }
    std::hint::black_box(x);
}

/// Pins the calling thread to `core`.
fn pin_to_core(core: usize) -> Result<()> {
    // SAFETY: cpu_set_t is plain bits; CPU_ZERO/CPU_SET write inside the set we own (CPU_SET
    // ignores out-of-range cores), and sched_setaffinity reads `size_of` bytes from it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(Error::config("--cores", format!("cannot pin to core {core}: {e}")));
    }
    Ok(())
}

/// Cores the kernel has online.
fn online_cpus() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 {
        n as usize
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

/// Every core this process may run on (its affinity mask), or all online cores if unknown.
fn default_cores() -> Vec<usize> {
    let cores = lbbsp::profile::allowed_cores();
    if cores.is_empty() {
        (0..online_cpus()).collect()
    } else {
        cores
    }
}

fn positive_seconds(field: &str, value: Option<f64>) -> Result<f64> {
    match value {
        Some(s) if s.is_finite() && s > 0.0 => Ok(s),
        Some(s) => Err(Error::config(field, format!("{s} is not a positive number of seconds"))),
        None => Err(Error::config(field, "the square pattern needs --on and --off SECONDS")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: InterfereArgs,
    }

    /// Parses a space-separated argument string as clap would.
    fn args(argv: &str) -> InterfereArgs {
        let argv = std::iter::once("interfere").chain(argv.split_whitespace());
        Cli::try_parse_from(argv).unwrap().args
    }

    /// The field a config error names.
    fn field<T: fmt::Debug>(r: Result<T>) -> String {
        match r {
            Err(Error::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn constant_and_square_loads() {
        let c = Pattern::from_args(&args("--load 0.3")).unwrap();
        assert_eq!(c, Pattern::Constant { load: 0.3 });
        assert_eq!((load_at(&c, 0.0), load_at(&c, 1e6)), (0.3, 0.3));
        let s = Pattern::from_args(&args("--pattern square --on 2 --off 1")).unwrap();
        let at = [0.0, 1.9, 2.0, 2.9, 3.0, 4.5, 5.5, 3001.5].map(|t| load_at(&s, t));
        assert_eq!(at, [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]);
    }

    #[test]
    fn trace_is_piecewise_constant_holds_or_loops() {
        let text = "# time load\n\n1 0.5\n2.5 1   # full\n4 0\n";
        let points = parse_trace(Path::new("t.txt"), text).unwrap();
        assert_eq!(points, vec![(1.0, 0.5), (2.5, 1.0), (4.0, 0.0)]);
        let (path, looped) = ("t.txt".into(), false);
        let mut p = Pattern::Trace { path, points, looped };
        let at = |p: &Pattern| [0.5, 1.0, 2.4, 2.5, 3.9, 4.0, 100.0, 5.0].map(|t| load_at(p, t));
        assert_eq!(at(&p), [0.0, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0, 0.0]);
        if let Pattern::Trace { looped, .. } = &mut p {
            *looped = true;
        }
        // Period 4 s: 100 s ≡ 0 s, 5 s ≡ 1 s.
        assert_eq!(at(&p), [0.0, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0, 0.5]);
    }

    #[test]
    fn trace_errors_name_file_and_line() {
        let path = Path::new("/x/trace.txt");
        for (text, what) in [
            ("0 0.5\n1 half\n", "line 2: load `half` is not a number"),
            ("# c\n0 1.5\n", "line 2: load 1.5 is outside [0, 1]"),
            ("0 0.5\n\n3 0.1 9\n", "line 3: expected `time_s load`"),
            ("2 0.5\n1 0.1\n", "line 2: time 1 does not come after"),
            ("-1 0.5\n", "line 1: time -1 must be"),
            ("# only a comment\n", "no `time_s load` lines"),
        ] {
            let msg = parse_trace(path, text).unwrap_err().to_string();
            assert!(msg.starts_with(&format!("/x/trace.txt: {what}")), "{msg}");
        }
        let missing = args("--pattern trace --trace /nonexistent/tr.txt");
        let msg = Pattern::from_args(&missing).unwrap_err().to_string();
        assert!(msg.contains("/nonexistent/tr.txt"), "{msg}");
    }

    #[test]
    fn trace_file_is_read() {
        let path = std::env::temp_dir().join(format!("lbbsp-trace-{}.txt", std::process::id()));
        std::fs::write(&path, "0 0.2\n10 0.8\n").unwrap();
        let argv = format!("--pattern trace --loop --trace {}", path.display());
        let p = Pattern::from_args(&args(&argv));
        std::fs::remove_file(&path).unwrap();
        let p = p.unwrap();
        assert_eq!([5.0, 10.0, 15.0].map(|t| load_at(&p, t)), [0.2, 0.2, 0.2]);
        assert!(p.to_string().contains("looped"));
    }

    #[test]
    fn bad_arguments_are_config_errors() {
        for (argv, name) in [
            ("--load 1.5", "--load"),
            ("--load NaN", "--load"),
            ("--pattern square --off 1", "--on"),
            ("--pattern square --on 1 --off 0", "--off"),
            ("--pattern trace", "--trace"),
        ] {
            assert_eq!(field(Pattern::from_args(&args(argv))), name, "{argv}");
        }
        assert_eq!(field(run(&args("--threads-per-core 0 --cores 0"))), "--threads-per-core");
        assert_eq!(field(run(&args("--duration=-1 --cores 0"))), "--duration");
        assert_eq!(field(run(&args("--cores 0,99999"))), "--cores");
    }

    #[test]
    fn core_lists() {
        assert_eq!(parse_cores("0-1,3", 4).unwrap(), vec![0, 1, 3]);
        assert_eq!(parse_cores("1, 1,0", 2).unwrap(), vec![0, 1]);
        for (list, what) in
            [("", "empty"), (" , ", "empty"), ("x", "`x`"), ("3-1", "`3-1`"), ("0,2", "core 2 does not exist")]
        {
            let e = parse_cores(list, 2);
            assert!(format!("{e:?}").contains(what), "{list:?}: {e:?}");
            assert_eq!(field(e), "--cores");
        }
    }

    #[test]
    fn short_run_burns_then_returns() {
        let (t, cpu0) = (Instant::now(), lbbsp::profile::process_cpu_s());
        run(&args("--cores 0 --load 0.5 --duration 0.2")).unwrap();
        let (wall, cpu) = (t.elapsed().as_secs_f64(), lbbsp::profile::process_cpu_s() - cpu0);
        assert!((0.2..1.0).contains(&wall), "wall {wall}");
        // Half of 0.2 s, give or take scheduling; other tests may add a little CPU of their own.
        assert!(cpu > 0.05, "cpu {cpu}");
    }
}

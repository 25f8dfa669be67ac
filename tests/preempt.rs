//! The mpirun tier's preemption schedule: a stop signal (SIGTERM) to one rank of a 3-rank job at
//! compute, inside the gradient sync and during rank 0's checkpoint write (timed by its flight
//! record, `lbbsp::dist::watchdog`), SIGUSR1 to `mpirun` (which passes it to every rank), and a
//! second signal during the stop's own checkpoint. A stopped job must end within 2 iterations and
//! one checkpoint write with status 75, and `--resume auto` must end bitwise equal to an
//! uninterrupted run under bsp, its metrics holding every iteration once.

mod common;
use common::*;
use lbbsp::dist::watchdog::{Phase, Snapshot};
use lbbsp::train::stop::PREEMPTED_STATUS;
use std::path::Path;
use std::time::{Duration, Instant};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const ITERS: usize = 300;

/// mnist-mlp under bsp for `ITERS` iterations, a checkpoint every 100 into `ck`, continuing from
/// the newest there (`--resume auto`).
fn args<'a>(ck: &'a str, metrics: &'a str, summary: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "mnist-mlp",
        "-q",
        "--threads",
        "1",
        "--set",
        "train.epochs=2",
        "--set",
        "train.max_iters=300",
        "--set",
        "balance.policy=bsp",
        "--checkpoint-every",
        "100",
        "--checkpoint-dir",
        ck,
        "--resume",
        "auto",
        "--metrics",
        metrics,
        "--summary",
        summary,
    ]
}

/// Whom a signal goes to.
#[derive(Clone, Copy)]
enum To {
    /// The watched rank's process.
    Watched,
    /// `mpirun`, which passes SIGUSR1 and SIGUSR2 on to every rank.
    Mpirun,
}

/// A further signal, and when it goes: a condition on the watched rank's record at the first
/// signal and now.
type Then<'a> = (i32, &'a dyn Fn(&Snapshot, &Snapshot) -> bool);

/// How a signalled job ended.
struct Stopped {
    status: Option<i32>,
    stderr: String,
    /// Rank `watch`'s record when the first signal went.
    at: Snapshot,
    exit_after: Duration,
}

/// Starts 3 ranks of `args`, waits until rank `watch`'s flight record satisfies `when`, sends
/// `signal` to `to`, then each of `more` (signal, condition on `watch`'s record) in turn, and waits
/// for the job to end (at most 60 s).
fn stop_when(
    watch: usize,
    to: To,
    signal: i32,
    args: &[&str],
    when: impl Fn(&Snapshot) -> bool,
    more: &[Then],
) -> Stopped {
    let tmp = scratch(&format!("flight-{watch}-{signal}"));
    let _guard = mpi_lock();
    let mut child = command(3, "none", &[("TMPDIR", s(&tmp))], args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    let started = Instant::now();
    let wait_for = |cond: &dyn Fn(&Snapshot) -> bool, child: &mut std::process::Child| loop {
        assert!(started.elapsed() < Duration::from_secs(120), "rank {watch}'s record never matched");
        assert!(child.try_wait().unwrap().is_none(), "the job ended before the signal");
        match flight_record(&tmp, watch) {
            Some(r) if cond(&r) => break r,
            _ => std::thread::sleep(Duration::from_micros(100)),
        }
    };
    let at = wait_for(&when, &mut child);
    let pid = match to {
        To::Watched => at.pid as i32,
        To::Mpirun => child.id() as i32,
    };
    // SAFETY: a plain kill(2) of a pid of this job.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "signalling pid {pid}");
    let signalled = Instant::now();
    for (sig, cond) in more {
        let then = wait_for(&|r: &Snapshot| cond(&at, r), &mut child);
        // SAFETY: as above, the watched rank's own pid.
        assert_eq!(unsafe { libc::kill(then.pid as i32, *sig) }, 0);
    }
    let out = wait_for_exit(child, signalled);
    let exit_after = signalled.elapsed();
    Stopped { status: out.status.code(), stderr: String::from_utf8_lossy(&out.stderr).into_owned(), at, exit_after }
}

/// An iteration in `lo..hi`, different at each run (printed with the case).
fn random_iter(lo: u64, hi: u64) -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    lo + u64::from(nanos) % (hi - lo)
}

fn weights(ck: &Path) -> Vec<u8> {
    std::fs::read(ck.join(format!("step-{ITERS}")).join("model.safetensors")).unwrap()
}

/// Runs `args` again (`--resume auto`) and checks the result against the uninterrupted run's
/// weights `full`: bitwise, every iteration once in the metrics and the summary.
fn resumes_bitwise(dir: &Path, full: &[u8]) {
    let (ck, m, sum) = (dir.join("ck"), dir.join("m.jsonl"), dir.join("summary.json"));
    let out = lbbsp_ok(3, &args(s(&ck), s(&m), s(&sum)));
    assert!(String::from_utf8_lossy(&out.stderr).contains("resuming from"), "--resume auto did not resume");
    assert!(weights(&ck) == full, "resumed weights differ from the uninterrupted run's");
    let iters: Vec<usize> = lbbsp::train::metrics::read_records(&m).unwrap().iter().map(|r| r.iter).collect();
    assert_eq!(iters, (0..ITERS).collect::<Vec<_>>(), "the metrics file holds each iteration once");
    assert_eq!(summary(&sum).iterations, ITERS, "the summary counts every iteration once");
}

fn uninterrupted(name: &str) -> Vec<u8> {
    let dir = scratch(&format!("{name}-full"));
    let (ck, m, sum) = (dir.join("ck"), dir.join("m.jsonl"), dir.join("summary.json"));
    let out = lbbsp_ok(3, &args(s(&ck), s(&m), s(&sum)));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("resuming"), "an empty folder starts afresh");
    weights(&ck)
}

/// The stop's checkpoint: the newest one, at most 2 iterations after the one the signal found
/// under way (`iter` counts iterations done: the one under way in compute or sync, the next one
/// during a checkpoint write).
fn stopped_in_time(k: &Stopped, ck: &Path, what: &str) -> usize {
    assert_eq!(k.status, Some(PREEMPTED_STATUS), "{what}: status {:?}, stderr:\n{}", k.status, k.stderr);
    assert!(k.stderr.contains("stopped by SIG"), "{what}: no report in:\n{}", k.stderr);
    let steps = whole_checkpoints(ck, "mnist-mlp");
    let stop = steps[0];
    let under_way = k.at.iter as usize;
    assert!(
        (under_way + 1..=under_way + 2).contains(&stop),
        "{what}: signal in iteration {under_way}, stopped at {stop}"
    );
    let records = lbbsp::train::metrics::read_records(&ck.with_file_name("m.jsonl")).unwrap();
    let iters: Vec<usize> = records.iter().map(|r| r.iter).collect();
    assert_eq!(iters, (0..stop).collect::<Vec<_>>(), "{what}: the metrics hold every iteration up to the stop once");
    report(&format!(
        "{what}: signal in iteration {under_way}, checkpoint step-{stop}, status {PREEMPTED_STATUS} {:.0} ms after the signal",
        k.exit_after.as_secs_f64() * 1e3
    ));
    stop
}

#[test]
fn sigterm_to_one_rank_stops_all_with_a_checkpoint_and_resume_auto_is_bitwise() {
    let full = uninterrupted("preempt-rank");
    let (a, b) = (random_iter(110, 290), random_iter(110, 290));
    let at_compute = move |r: &Snapshot| r.iter >= a && r.phase == Phase::Compute as u64;
    let in_sync = move |r: &Snapshot| r.iter >= b && r.phase == Phase::Sync as u64 && r.collective != 0;
    // After the optimizer's gathers, in rank 0's write itself.
    let writing = |r: &Snapshot| r.iter >= 200 && r.phase == Phase::Checkpoint as u64 && r.collective == 0;
    type When<'a> = &'a dyn Fn(&Snapshot) -> bool;
    let cases: [(&str, usize, To, When); 3] = [
        ("SIGTERM to rank 2 at compute", 2, To::Watched, &at_compute),
        ("SIGTERM to rank 1 inside the sync", 1, To::Watched, &in_sync),
        ("SIGTERM to rank 0 writing a checkpoint", 0, To::Watched, &writing),
    ];
    for (what, watch, to, when) in cases {
        let dir = scratch(&format!("preempt-{watch}"));
        let (ck, m, sum) = (dir.join("ck"), dir.join("m.jsonl"), dir.join("summary.json"));
        let k = stop_when(watch, to, libc::SIGTERM, &args(s(&ck), s(&m), s(&sum)), when, &[]);
        stopped_in_time(&k, &ck, what);
        resumes_bitwise(&dir, &full);
    }
}

#[test]
fn sigusr1_to_mpirun_reaches_every_rank() {
    let full = uninterrupted("preempt-mpirun");
    let dir = scratch("preempt-mpirun");
    let (ck, m, sum) = (dir.join("ck"), dir.join("m.jsonl"), dir.join("summary.json"));
    let at = |r: &Snapshot| r.iter >= 150;
    let k = stop_when(0, To::Mpirun, libc::SIGUSR1, &args(s(&ck), s(&m), s(&sum)), at, &[]);
    stopped_in_time(&k, &ck, "SIGUSR1 to mpirun");
    assert!(k.stderr.contains("stopped by SIGUSR1"), "{}", k.stderr);
    resumes_bitwise(&dir, &full);
}

/// A second signal while the stop's checkpoint is being written exits at once: the checkpoint
/// before it stays whole and the run resumes from it.
#[test]
fn a_second_signal_during_the_stops_checkpoint_exits_at_once_and_leaves_the_one_before_whole() {
    let full = uninterrupted("preempt-twice");
    let dir = scratch("preempt-twice");
    let (ck, m, sum) = (dir.join("ck"), dir.join("m.jsonl"), dir.join("summary.json"));
    let first = |r: &Snapshot| r.iter >= 150 && r.phase == Phase::Compute as u64;
    let writing_the_stop =
        |at: &Snapshot, r: &Snapshot| r.iter > at.iter && r.phase == Phase::Checkpoint as u64 && r.collective == 0;
    let k = stop_when(
        0,
        To::Watched,
        libc::SIGTERM,
        &args(s(&ck), s(&m), s(&sum)),
        first,
        &[(libc::SIGTERM, &writing_the_stop)],
    );
    assert_eq!(k.status, Some(128 + libc::SIGTERM), "status {:?}, stderr:\n{}", k.status, k.stderr);
    assert!(k.stderr.contains("a second stop signal"), "{}", k.stderr);
    let steps = whole_checkpoints(&ck, "mnist-mlp");
    assert!(steps.contains(&100), "the checkpoint before the stop's is gone: {steps:?}");
    report(&format!(
        "second SIGTERM during the stop's checkpoint: exit {:.0} ms after the first, checkpoints {steps:?}",
        k.exit_after.as_secs_f64() * 1e3
    ));
    resumes_bitwise(&dir, &full);
}

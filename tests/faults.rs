//! The mpirun tier's kill schedule: a rank SIGKILLed at compute, inside the gradient sync and
//! during rank 0's checkpoint write (timed by its flight record, `lbbsp::dist::watchdog`), and a
//! rank SIGSTOPped. Each job must end within 30 s naming the lost rank, keep the metrics it wrote,
//! never show a half-written checkpoint, and resume: bitwise equal to an uninterrupted run with the
//! same checkpoint schedule on the same ranks (under `lbbsp`, on the same splits), and along its
//! loss trajectory (1e-4) on another number of ranks.

mod common;
use common::*;
use lbbsp::dist::watchdog::{Phase, Snapshot};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const ITERS: usize = 300;

/// mnist-mlp for `ITERS` iterations (two epochs planned, so the schedule spans past them), a
/// checkpoint every 100 into `ck`, or resuming from it.
fn args<'a>(policy: &'a str, ck: &'a str, metrics: &'a str, resume: bool) -> Vec<&'a str> {
    let policy = if policy == "bsp" { "balance.policy=bsp" } else { "balance.policy=lbbsp" };
    let ck_flag = if resume { "--resume" } else { "--checkpoint-dir" };
    vec![
        "train",
        "mnist-mlp",
        "-q",
        "--threads",
        "1",
        "--set",
        "train.epochs=2",
        "--set",
        MAX_ITERS,
        "--set",
        policy,
        "--checkpoint-every",
        "100",
        "--metrics",
        metrics,
        ck_flag,
        ck,
    ]
}

const MAX_ITERS: &str = "train.max_iters=300";

/// How a killed job ended.
struct Killed {
    stderr: String,
    /// The victim's record when it was killed.
    at: Snapshot,
    exit_after: Duration,
}

/// Starts `ranks` ranks of `args`, waits until rank `victim`'s flight record satisfies `when`,
/// sends it `signal`, and waits for the job to end (at most 60 s).
fn signal_when(ranks: usize, victim: usize, signal: i32, args: &[&str], when: impl Fn(&Snapshot) -> bool) -> Killed {
    let tmp = scratch(&format!("flight-{victim}-{signal}"));
    let _guard = mpi_lock();
    let mut child = command(ranks, "none", &[("TMPDIR", s(&tmp))], args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    let started = Instant::now();
    let at = loop {
        assert!(started.elapsed() < Duration::from_secs(120), "rank {victim}'s record never matched");
        assert!(child.try_wait().unwrap().is_none(), "the job ended before the kill");
        let record = flight_record(&tmp, victim);
        match record {
            Some(r) if when(&r) => break r,
            _ => std::thread::sleep(Duration::from_micros(100)),
        }
    };
    // SAFETY: a plain kill(2) of the victim's pid, read from its own record.
    assert_eq!(unsafe { libc::kill(at.pid as i32, signal) }, 0, "signalling pid {}", at.pid);
    let killed = Instant::now();
    let out = wait_for_exit(child, killed);
    let exit_after = killed.elapsed();
    assert!(!out.status.success(), "a job that lost a rank must fail");
    Killed { stderr: String::from_utf8_lossy(&out.stderr).into_owned(), at, exit_after }
}

fn after(iter: u64, phase: Phase) -> impl Fn(&Snapshot) -> bool {
    move |r| r.iter >= iter && r.phase == phase as u64
}

fn uninterrupted(dir: &Path, ranks: usize, policy: &str) -> (PathBuf, PathBuf) {
    let (ck, m) = (dir.join("full-ck"), dir.join("full.jsonl"));
    lbbsp_ok(ranks, &args(policy, s(&ck), s(&m), false));
    (ck, m)
}

fn assert_killed_report(k: &Killed, victim: usize) {
    assert!(k.exit_after < Duration::from_secs(30), "ended {:?} after the kill", k.exit_after);
    // Open MPI names the rank (its PID it gives as 0).
    let named = format!("process rank {victim} with PID");
    assert!(k.stderr.contains(&named) && k.stderr.contains("signal 9"), "no `{named}` in:\n{}", k.stderr);
}

/// Resumes `ck` on `ranks` ranks up to `ITERS` and returns the resumed run's metrics.
fn resume(ck: &Path, m: &Path, ranks: usize, policy: &str) {
    lbbsp_ok(ranks, &args(policy, s(ck), s(m), true));
}

fn weights(ck: &Path) -> Vec<u8> {
    std::fs::read(ck.join(format!("step-{ITERS}")).join("model.safetensors")).unwrap()
}

#[test]
fn sigkill_at_compute_and_resume_is_bitwise_under_bsp() {
    let dir = scratch("kill-compute");
    let (full_ck, _) = uninterrupted(&dir, 2, "bsp");
    let (ck, m) = (dir.join("ck"), dir.join("m.jsonl"));
    let k = signal_when(2, 1, libc::SIGKILL, &args("bsp", s(&ck), s(&m), false), after(150, Phase::Compute));
    assert_killed_report(&k, 1);
    // Streamed metrics survive: every iteration up to the one before the kill's.
    let lines = lbbsp::train::metrics::read_records(&m).unwrap().len();
    assert!(lines as u64 >= k.at.iter.saturating_sub(1), "{lines} records survive a kill at iteration {}", k.at.iter);
    assert_eq!(whole_checkpoints(&ck, "mnist-mlp"), [100]);
    resume(&ck, &m, 2, "bsp");
    assert!(weights(&ck) == weights(&full_ck), "resumed weights differ from the uninterrupted run's");
    let records = lbbsp::train::metrics::read_records(&m).unwrap();
    let iters: Vec<usize> = records.iter().map(|r| r.iter).collect();
    assert_eq!(iters, (0..ITERS).collect::<Vec<_>>(), "the metrics file holds each iteration once");
    report(&format!(
        "kill at compute (iteration {}): job ended {:?} after, {lines} records kept",
        k.at.iter, k.exit_after
    ));
}

#[test]
fn sigkill_inside_the_sync_of_3_ranks_and_resume_on_2_follows_the_trajectory() {
    let dir = scratch("kill-sync");
    let (_, full_m) = uninterrupted(&dir, 3, "bsp");
    let (ck, m) = (dir.join("ck"), dir.join("m.jsonl"));
    let in_sync = |r: &Snapshot| r.iter >= 150 && r.phase == Phase::Sync as u64 && r.collective != 0;
    let k = signal_when(3, 2, libc::SIGKILL, &args("bsp", s(&ck), s(&m), false), in_sync);
    assert_killed_report(&k, 2);
    resume(&ck, &m, 2, "bsp");
    let d = max_rel_diff(&losses(&full_m), &losses(&m), ITERS);
    assert!(d <= 1e-4, "resumed on 2 ranks, the loss differs by {d:.2e} relative from 3 ranks uninterrupted");
    report(&format!(
        "kill in sync (iteration {}): ended {:?} after; resumed on 2 ranks: loss within {d:.2e}",
        k.at.iter, k.exit_after
    ));
}

/// Under lbbsp the splits follow measured times, so no two runs share them, and rounding that
/// depends on the split makes two uninterrupted runs drift apart by ~1e-3 within 150 iterations.
/// The reference is therefore the uninterrupted run *on the resumed run's splits*
/// (`balance.replay` of its metrics): equal weights show that the checkpoint restored everything
/// the splits do not decide.
#[test]
fn sigkill_of_rank_0_writing_a_checkpoint_leaves_only_whole_ones_and_lbbsp_resumes_bitwise() {
    let dir = scratch("kill-checkpoint");
    let (ck, m) = (dir.join("ck"), dir.join("m.jsonl"));
    // After the optimizer's gathers, in the write itself.
    let writing = |r: &Snapshot| r.iter >= 200 && r.phase == Phase::Checkpoint as u64 && r.collective == 0;
    let k = signal_when(2, 0, libc::SIGKILL, &args("lbbsp", s(&ck), s(&m), false), writing);
    assert_killed_report(&k, 0);
    let steps = whole_checkpoints(&ck, "mnist-mlp");
    assert!(steps == [100] || steps == [200, 100], "{steps:?}");
    resume(&ck, &m, 2, "lbbsp");
    let (full_ck, full_m) = (dir.join("full-ck"), dir.join("full.jsonl"));
    let replay = format!("balance.replay={}", s(&m));
    let mut argv = args("lbbsp", s(&full_ck), s(&full_m), false);
    argv.extend(["--set", &replay]);
    lbbsp_ok(2, &argv);
    assert!(weights(&ck) == weights(&full_ck), "resumed weights differ from the uninterrupted run on the same splits");
    report(&format!(
        "kill in checkpoint write at {}: ended {:?} after, checkpoints {steps:?}",
        k.at.iter, k.exit_after
    ));
}

/// A stopped rank hangs no one for good: the watchdog ends the job and names it.
#[test]
fn sigstop_of_a_rank_is_reported_by_the_watchdog() {
    let dir = scratch("stop");
    let m = dir.join("m.jsonl");
    let argv =
        ["train", "mnist-mlp", "-q", "--threads", "1", "--set", "runtime.collective_timeout_s=5", "--metrics", s(&m)];
    let k = signal_when(2, 1, libc::SIGSTOP, &argv, |r| r.iter >= 50);
    assert!(k.exit_after < Duration::from_secs(30), "ended {:?} after the stop", k.exit_after);
    let named = format!("pid {}), its process is STOPPED", k.at.pid);
    assert!(k.stderr.contains("lbbsp watchdog: rank 0 has waited") && k.stderr.contains(&named), "{}", k.stderr);
    report(&format!("SIGSTOP with a 5 s timeout: the job ended {:?} after", k.exit_after));
}

//! A rank under a CPU quota (cgroup `cpu`: v1 `cpu.cfs_quota_us`, v2 `cpu.max`), as a container's
//! CPU limit makes a slower node: the compute time it reports, its CPU share and its frozen seconds
//! describe the same seconds. Compute without system calls overruns the quota, and the kernel
//! freezes the rank at its next system call, which is the CPU clock's read that ends the compute's
//! sample. A compute time taken before that read left the freeze out while the share and the
//! frozen seconds counted it, and the balancer saw the rank twice as fast per CPU second as it was
//! (under a 2 ms quota at B = 128, lbbsp kept the equal split and lost to bsp). Needs a writable
//! `cpu` controller (root); says SKIPPED without one.

mod common;
use common::*;

use lbbsp::train::metrics::read_records;
use std::path::{Path, PathBuf};

/// A cgroup with a CPU quota, removed on drop (once its processes have exited).
struct Quota {
    dir: PathBuf,
}

impl Quota {
    /// A group under the root of the hierarchy that has the `cpu` controller, limited to `quota_us`
    /// of every `period_us`; None where no such hierarchy is writable.
    fn new(quota_us: u64, period_us: u64) -> Option<Quota> {
        let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
        let name = format!("lbbsp-test-{}", std::process::id());
        let root = |kind: &str, has_cpu: &dyn Fn(&[&str]) -> bool| {
            mounts
                .lines()
                .map(|l| l.split_whitespace().collect::<Vec<_>>())
                .find_map(|f| (f.len() > 3 && f[2] == kind && has_cpu(&f)).then(|| PathBuf::from(f[1])))
        };
        if let Some(v1) = root("cgroup", &|f| f[3].split(',').any(|o| o == "cpu")) {
            let dir = v1.join(&name);
            if std::fs::create_dir(&dir).is_ok() {
                let q = Quota { dir };
                let set = |file: &str, v: String| std::fs::write(q.dir.join(file), v).is_ok();
                if set("cpu.cfs_quota_us", "-1".into())
                    && set("cpu.cfs_period_us", period_us.to_string())
                    && set("cpu.cfs_quota_us", quota_us.to_string())
                {
                    return Some(q);
                }
            }
        }
        let v2 = root("cgroup2", &|_| true)?;
        let controllers = std::fs::read_to_string(v2.join("cgroup.controllers")).ok()?;
        if !controllers.split_whitespace().any(|c| c == "cpu") {
            return None;
        }
        let _ = std::fs::write(v2.join("cgroup.subtree_control"), "+cpu");
        let dir = v2.join(&name);
        std::fs::create_dir(&dir).ok()?;
        let q = Quota { dir };
        std::fs::write(q.dir.join("cpu.max"), format!("{quota_us} {period_us}")).ok()?;
        Some(q)
    }

    fn add(&self, pid: u32) -> bool {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).is_ok()
    }
}

impl Drop for Quota {
    fn drop(&mut self) {
        // The group's processes have been waited for; the kernel may take a moment to let it go.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        eprintln!("warning: could not remove {}", self.dir.display());
    }
}

/// The median of `x` (NaN when empty).
fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    x.get(x.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One process of mnist-mlp at B = 32, one thread, under a quota of three of its iterations'
/// compute in every six (measured first without the quota, so that a host twice as fast or slow
/// still gives both kinds): some iterations run within the quota and some are frozen at the end
/// of their compute. Their CPU seconds per sample, from the reported time and share, must agree;
/// with the freeze outside the reported time, a frozen iteration's came out at a quarter.
#[test]
fn a_rank_under_a_quota_reports_its_freezes_within_its_compute() {
    let dir = scratch("quota");
    let _guard = mpi_lock();
    let free = dir.join("free.jsonl");
    let status = mnist_mlp_at_32(200, &free).status().expect("start lbbsp");
    assert!(status.success(), "lbbsp without a quota failed: {status}");
    let compute: Vec<f64> = read_records(&free).unwrap().iter().skip(50).map(|r| r.compute_s[0]).collect();
    // The kernel's least quota is 1 ms.
    let quota_us = ((3e6 * median(compute)) as u64).max(1_000);
    let Some(quota) = Quota::new(quota_us, 2 * quota_us) else {
        eprintln!("SKIPPED: no writable cgroup cpu controller (v1 cpu.cfs_quota_us or v2 cpu.max); run as root");
        return;
    };
    let m = dir.join("m.jsonl");
    let mut cmd = mnist_mlp_at_32(600, &m);
    let mut child = cmd.spawn().expect("start lbbsp");
    let joined = quota.add(child.id());
    let status = child.wait().expect("wait for lbbsp");
    assert!(joined, "could not move lbbsp into {}", quota.dir.display());
    assert!(status.success(), "{cmd:?} failed: {status}");
    let (frozen, running) = per_sample_cpu(&m);
    let (nf, nr) = (frozen.len(), running.len());
    assert!(nf >= 30 && nr >= 30, "too few iterations of a kind to compare: {nf} frozen, {nr} not");
    let ratio = median(frozen) / median(running);
    eprintln!(
        "CPU seconds per sample, frozen iterations over unfrozen: {ratio:.3} ({nf} frozen, {nr} not; \
         quota {quota_us} us of {} us)",
        2 * quota_us
    );
    assert!(
        (0.75..1.33).contains(&ratio),
        "a frozen iteration's CPU seconds per sample are {ratio:.2} of an unfrozen one's ({nf} frozen, {nr} not): \
         the reported compute time and the CPU share describe different intervals"
    );
}

/// One process of mnist-mlp, one thread, B = 32, for `iters` iterations.
fn mnist_mlp_at_32(iters: u32, metrics: &Path) -> std::process::Command {
    let iters = format!("train.max_iters={iters}");
    let set = ["--set", &iters, "--set", "train.global_batch=32", "--metrics", metrics.to_str().unwrap()];
    command(0, "none", &[], &[&["train", "mnist-mlp", "-q", "--threads", "1"][..], &set].concat())
}

/// CPU seconds per sample (`compute_s · cpu_share / batch`) of the iterations after the first 50,
/// split into those frozen for at least 0.3 ms and those not frozen at all.
fn per_sample_cpu(metrics: &Path) -> (Vec<f64>, Vec<f64>) {
    let (mut frozen, mut running) = (Vec::new(), Vec::new());
    for r in read_records(metrics).unwrap().iter().skip(50) {
        let cpu = r.compute_s[0] * r.cpu_share[0] / r.batch_sizes[0] as f64;
        match r.frozen_s[0] {
            f if f >= 3e-4 => frozen.push(cpu),
            0.0 => running.push(cpu),
            _ => {}
        }
    }
    (frozen, running)
}

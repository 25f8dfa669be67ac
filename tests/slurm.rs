//! Under a real one-node Slurm cluster (`scripts/slurm/local_cluster.sh`: munge, slurmctld and
//! slurmd from Debian's packages, with a generated slurm.conf), started and stopped here:
//! 1. `srun -n 2 --mpi=pmix lbbsp train digits-mlp` follows a one-process run within 1e-4 (run
//!    first, with case 4);
//! 2. the shipped job script (`scripts/slurm/train.sbatch`, run as it is, with its paths from the
//!    environment) is sent `scancel --signal=TERM` mid-run: it checkpoints and exits with 75; after
//!    `scontrol requeue` it resumes on its own and ends bitwise equal to an uninterrupted run;
//! 3. the same, requeued onto 1 task instead of 2, follows the 2-rank trajectory within 1e-4;
//! 4. `mpirun` inside an `sbatch -n 2` allocation starts 2 ranks that follow one process.
//!
//! Where the daemons cannot start (not root, Slurm not installed), it says SKIPPED and why.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A running one-node cluster, stopped when dropped.
struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
}

impl Cluster {
    fn start() -> Result<Cluster, String> {
        let dir = scratch("slurm-cluster");
        let out = Command::new(repo().join("scripts/slurm/local_cluster.sh"))
            .args(["start", s(&dir)])
            .output()
            .map_err(|e| format!("cannot run scripts/slurm/local_cluster.sh: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        Ok(Cluster { conf: dir.join("slurm.conf"), dir })
    }

    /// A Slurm client command of this cluster, with the data folder in its environment (which
    /// srun and sbatch pass on to the job).
    fn cmd(&self, program: &str, args: &[&str]) -> Command {
        let mut c = Command::new(program);
        c.args(args).env("SLURM_CONF", &self.conf).env("LBBSP_DATA", data_dir());
        // For mpirun inside a job, as root in CI.
        c.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        c
    }

    fn run(&self, program: &str, args: &[&str]) -> String {
        let out = self.cmd(program, args).output().unwrap_or_else(|e| panic!("{program}: {e}"));
        assert!(
            out.status.success(),
            "{program} {args:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The job's `JobState` and `ExitCode` (as `scontrol show job` prints them).
    fn job(&self, id: &str) -> (String, String) {
        let text = self.run("scontrol", &["show", "job", id]);
        let field =
            |k: &str| text.split_whitespace().find_map(|w| w.strip_prefix(k)).map(str::to_string).unwrap_or_default();
        (field("JobState="), field("ExitCode="))
    }

    /// Waits (at most `limit`) until job `id` is in one of `states`; returns its exit code.
    fn wait_for(&self, id: &str, states: &[&str], limit: Duration) -> String {
        let t = Instant::now();
        loop {
            let (state, code) = self.job(id);
            if states.contains(&state.as_str()) {
                return code;
            }
            assert!(t.elapsed() < limit, "job {id} still {state} after {limit:?}; logs in {}", self.dir.display());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Submits the shipped job script with `ntasks` tasks, its run folder `run_dir`.
    fn submit(&self, run_dir: &Path, ntasks: usize, args: &[&str]) -> String {
        let log = run_dir.with_extension("out");
        let n = ntasks.to_string();
        let script = repo().join("scripts/slurm/train.sbatch");
        let mut argv = vec!["--parsable", "-n", &n, "-o", s(&log), s(&script)];
        argv.extend(args);
        let mut c = self.cmd("sbatch", &argv);
        c.env("RUN_DIR", run_dir).env("LBBSP", bin());
        let out = c.output().expect("sbatch");
        assert!(out.status.success(), "sbatch: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let script = repo().join("scripts/slurm/local_cluster.sh");
        Command::new(script).args(["stop", s(&self.dir)]).status().ok();
    }
}

fn now_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// The recipe of the requeue cases: mnist-mlp under bsp, 600 iterations.
const JOB: [&str; 7] =
    ["mnist-mlp", "--set", "train.max_iters=600", "--set", "train.epochs=2", "--set", "balance.policy=bsp"];
const ITERS: usize = 600;

/// Waits until `run_dir`'s metrics hold `n` records, then sends the job its preemption signal and
/// waits for it to end; returns the seconds from signal to exit and the stop's checkpoint step.
fn preempt(c: &Cluster, id: &str, run_dir: &Path, n: usize) -> (f64, usize) {
    let m = run_dir.join("metrics.jsonl");
    let t = Instant::now();
    while std::fs::read_to_string(&m).map_or(0, |t| t.lines().count()) < n {
        assert!(t.elapsed() < Duration::from_secs(120), "job {id} wrote no {n} records; see {}", m.display());
        std::thread::sleep(Duration::from_millis(10));
    }
    let signalled = Instant::now();
    c.run("scancel", &["--signal=TERM", id]);
    let code = c.wait_for(id, &["FAILED", "COMPLETED"], Duration::from_secs(60));
    let took = signalled.elapsed().as_secs_f64();
    assert_eq!(code, "75:0", "the preempted job's exit code; log:\n{}", log(run_dir));
    let newest = lbbsp::train::checkpoint::list(&run_dir.join("checkpoints")).unwrap();
    let stop = newest.first().expect("the stop's checkpoint").0;
    assert!((n..ITERS).contains(&stop), "stopped at {stop}, after the signal at {n} records");
    (took, stop)
}

fn log(run_dir: &Path) -> String {
    std::fs::read_to_string(run_dir.with_extension("out")).unwrap_or_default()
}

/// Requeues job `id` (with `ntasks` tasks when given) and waits for it to finish; returns the
/// seconds from the requeue to the start of iteration `stop`, the first resumed one.
fn requeue_and_finish(c: &Cluster, id: &str, run_dir: &Path, ntasks: Option<usize>, stop: usize) -> f64 {
    let requeued = now_s();
    match ntasks {
        None => c.run("scontrol", &["requeue", id]),
        Some(n) => {
            c.run("scontrol", &["requeuehold", id]);
            c.run("scontrol", &["update", &format!("JobId={id}"), &format!("NumTasks={n}")]);
            c.run("scontrol", &["release", id])
        }
    };
    // The requeued job becomes eligible once its previous run's credential has expired
    // (`cred_expire`, 10 s in the test cluster's slurm.conf): starting it sooner makes slurmd refuse
    // it ("Job credential revoked").
    let code = c.wait_for(id, &["COMPLETED", "FAILED"], Duration::from_secs(180));
    assert_eq!(code, "0:0", "the requeued job failed; log:\n{}", log(run_dir));
    let records = lbbsp::train::metrics::read_records(&run_dir.join("metrics.jsonl")).unwrap();
    let iters: Vec<usize> = records.iter().map(|r| r.iter).collect();
    assert_eq!(iters, (0..ITERS).collect::<Vec<_>>(), "the metrics hold each iteration once");
    let sum = summary(&run_dir.join("summary.json"));
    assert_eq!(sum.iterations, ITERS, "the summary counts every iteration once");
    let from = format!("resuming from {}", run_dir.join(format!("checkpoints/step-{stop}")).display());
    assert!(log(run_dir).contains(&from), "no `{from}` in the log:\n{}", log(run_dir));
    records[stop].unix_s - requeued
}

#[test]
fn srun_and_a_preempted_requeued_job_script() {
    let cluster = match Cluster::start() {
        Ok(c) => c,
        Err(why) => {
            report(&format!("SKIPPED: no Slurm cluster could start here: {why}"));
            return;
        }
    };
    let dir = scratch("slurm");
    let _guard = mpi_lock();

    // 1. srun through PMIx against one process.
    let (m1, m2) = (dir.join("one.jsonl"), dir.join("srun.jsonl"));
    let out = Command::new(bin())
        .args(["train", "digits-mlp", "-q", "--metrics", s(&m1)])
        .env("LBBSP_DATA", data_dir())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let t = Instant::now();
    cluster.run("srun", &["-n", "2", "--mpi=pmix", bin(), "train", "digits-mlp", "-q", "--metrics", s(&m2)]);
    let n = losses(&m1).len();
    let d = max_rel_diff(&losses(&m1), &losses(&m2), n);
    assert!(d <= 1e-4, "srun -n 2 follows one process within {d:.2e} relative, not 1e-4");
    report(&format!(
        "srun -n 2 --mpi=pmix digits-mlp: {n} iterations in {:.1} s, loss within {d:.1e} of one process",
        t.elapsed().as_secs_f64()
    ));

    // Threads per rank follow --cpus-per-task: 1 here, where the node's 2 cores would give 2.
    let one = dir.join("threads.json");
    cluster
        .run("srun", &["-n", "1", "-c", "1", "--mpi=pmix", bin(), "train", "digits-mlp", "-q", "--summary", s(&one)]);
    assert_eq!(summary(&one).threads_per_rank, 1, "srun -c 1 gives each rank 1 thread (SLURM_CPUS_PER_TASK)");

    // mpirun inside an sbatch allocation: Open MPI reads it and starts its 2 ranks.
    let (m3, s3) = (dir.join("mpirun.jsonl"), dir.join("mpirun.json"));
    let wrap = format!("mpirun {} train digits-mlp -q --metrics {} --summary {}", bin(), s(&m3), s(&s3));
    let log = dir.join("mpirun.out");
    let id = cluster.run("sbatch", &["--parsable", "-n", "2", "-o", s(&log), "--wrap", &wrap]).trim().to_string();
    let code = cluster.wait_for(&id, &["COMPLETED", "FAILED"], Duration::from_secs(120));
    assert_eq!(code, "0:0", "mpirun inside sbatch failed:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
    assert_eq!(summary(&s3).world_size, 2, "mpirun took the allocation's 2 tasks");
    let d = max_rel_diff(&losses(&m1), &losses(&m3), n);
    assert!(d <= 1e-4, "mpirun inside sbatch follows one process within {d:.2e} relative, not 1e-4");
    report(&format!("mpirun inside sbatch -n 2 digits-mlp: loss within {d:.1e} of one process"));

    // The uninterrupted reference: the job's own command line, on 2 tasks.
    let reference = dir.join("reference");
    let mut argv = vec!["-n", "2", "-c", "1", "--mpi=pmix", bin(), "train"];
    argv.extend(JOB);
    let (ref_m, ref_ck) = (reference.join("metrics.jsonl"), reference.join("checkpoints"));
    argv.extend(["-q", "--checkpoint-dir", s(&ref_ck), "--metrics", s(&ref_m)]);
    cluster.run("srun", &argv);
    let final_weights = |ck: &Path| std::fs::read(ck.join(format!("step-{ITERS}/model.safetensors"))).unwrap();

    // 2. Preempted, requeued, resumed on its own: bitwise.
    let run = dir.join("job");
    let id = cluster.submit(&run, 2, &JOB);
    let (to_exit, stop) = preempt(&cluster, &id, &run, 200);
    let to_resume = requeue_and_finish(&cluster, &id, &run, None, stop);
    assert!(final_weights(&run.join("checkpoints")) == final_weights(&ref_ck), "the requeued job's weights differ");
    assert_eq!(summary(&run.join("summary.json")).threads_per_rank, 1, "threads from --cpus-per-task");
    report(&format!(
        "job script, SIGTERM → exit 75: {to_exit:.2} s; requeue → first resumed iteration: {to_resume:.2} s; bitwise"
    ));

    // 3. Requeued onto 1 task.
    let run = dir.join("job-fewer");
    let id = cluster.submit(&run, 2, &JOB);
    let (to_exit, stop) = preempt(&cluster, &id, &run, 200);
    let to_resume = requeue_and_finish(&cluster, &id, &run, Some(1), stop);
    assert_eq!(summary(&run.join("summary.json")).world_size, 1, "the requeued job ran on 1 task");
    let d = max_rel_diff(&losses(&ref_m), &losses(&run.join("metrics.jsonl")), ITERS);
    assert!(d <= 1e-4, "requeued on 1 task, the loss differs from 2 tasks by {d:.2e} relative");
    report(&format!(
        "requeue 2 → 1 task: SIGTERM → exit 75: {to_exit:.2} s; requeue → first resumed iteration: {to_resume:.2} s; \
         loss within {d:.1e} of 2 tasks"
    ));
}

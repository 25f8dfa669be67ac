//! Shared helpers of the integration tests: where the data are, and running the `lbbsp` binary
//! standalone or under real `mpirun`.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Mutex;

/// The data folder: `LBBSP_DATA`, else `../shared/datasets` beside the checkout.
pub fn data_dir() -> PathBuf {
    std::env::var_os("LBBSP_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/datasets")))
}

pub fn bin() -> &'static str {
    // Without the mpi feature there is no binary: the tests that need it say so when they run.
    match option_env!("CARGO_BIN_EXE_lbbsp") {
        Some(path) => path,
        None => panic!("the lbbsp binary: build with the mpi feature"),
    }
}

/// Rank `rank`'s flight record (`lbbsp::dist::watchdog`) in a job started with `TMPDIR=tmp`.
pub fn flight_record(tmp: &std::path::Path, rank: usize) -> Option<lbbsp::dist::watchdog::Snapshot> {
    let dir =
        std::fs::read_dir(tmp).ok()?.flatten().find(|e| e.file_name().to_string_lossy().starts_with("lbbsp-flight"))?;
    lbbsp::dist::watchdog::read_record(&dir.path().join(format!("rank-{rank}")))
}

/// Waits for `child` to end, at most 60 s after `since` (when it was signalled); kills it and
/// panics after that.
pub fn wait_for_exit(mut child: std::process::Child, since: std::time::Instant) -> Output {
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if since.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().ok();
            panic!("the job did not end within 60 s of the signal");
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Every `step-<n>` folder left in `ck` is a whole checkpoint of `recipe` (`lbbsp eval` verifies
/// every digest); returns their steps, newest first.
pub fn whole_checkpoints(ck: &std::path::Path, recipe: &str) -> Vec<usize> {
    let steps = lbbsp::train::checkpoint::list(ck).unwrap();
    for (_, dir) in &steps {
        lbbsp::train::checkpoint::read_state(dir).unwrap_or_else(|e| panic!("half-written checkpoint: {e}"));
        lbbsp_ok(0, &["eval", recipe, "--weights", dir.to_str().unwrap()]);
    }
    steps.into_iter().map(|s| s.0).collect()
}

/// Prints a test's measurement (a time, a distance), and appends it to the file
/// `LBBSP_TEST_REPORT` names, if set: `scripts/test.sh` prints that file at the end, where cargo's
/// capture of passing tests' output would hide the lines.
pub fn report(line: &str) {
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("LBBSP_TEST_REPORT") {
        use std::io::Write;
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&path);
        if let Ok(mut f) = file {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// A fresh scratch folder for one test.
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lbbsp-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

// Runs share two cores; one multi-rank job at a time keeps timings sane.
static MPI_LOCK: Mutex<()> = Mutex::new(());

/// `mpirun -n ranks lbbsp args...` (or the plain binary when `ranks == 0`), with the data folder set.
/// Panics loudly when `mpirun` is missing: this tier must not silently pass.
pub fn lbbsp(ranks: usize, args: &[&str]) -> Output {
    launch(ranks, "none", &[], args)
}

/// [`lbbsp`] with extra environment variables (passed to every rank).
pub fn lbbsp_env(ranks: usize, env: &[(&str, &str)], args: &[&str]) -> Output {
    launch(ranks, "none", env, args)
}

/// Like [`lbbsp`] with every rank pinned to a core, round robin (ranks share cores when there
/// are more ranks than cores), so that which ranks contend is fixed for the whole run.
pub fn lbbsp_pinned(ranks: usize, args: &[&str]) -> Output {
    expect_success(launch(ranks, "core:overload-allowed", &[], args), ranks, args)
}

fn launch(ranks: usize, bind: &str, env: &[(&str, &str)], args: &[&str]) -> Output {
    let _guard = mpi_lock();
    let mut cmd = command(ranks, bind, env, args);
    cmd.output().unwrap_or_else(|e| panic!("cannot start {:?} (is OpenMPI installed?): {e}", cmd.get_program()))
}

/// Holds the one-multi-rank-job-at-a-time lock (for tests that start jobs themselves).
pub fn mpi_lock() -> std::sync::MutexGuard<'static, ()> {
    MPI_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The command of [`lbbsp_env`] (unpinned), to start as a child: `mpirun -n ranks lbbsp args...`,
/// or the plain binary when `ranks == 0`.
pub fn command(ranks: usize, bind: &str, env: &[(&str, &str)], args: &[&str]) -> Command {
    let mut cmd = if ranks == 0 {
        Command::new(bin())
    } else {
        let mut c = Command::new("mpirun");
        c.args(["-n", &ranks.to_string(), "--oversubscribe", "--map-by", "core", "--bind-to", bind, bin()]);
        c
    };
    cmd.args(args)
        .env("LBBSP_DATA", data_dir())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        // Ranks waiting in a collective yield their core (essential when ranks outnumber cores).
        .env("OMPI_MCA_mpi_yield_when_idle", "1")
        .envs(env.iter().copied());
    cmd
}

/// Runs and asserts success, printing both streams on failure.
pub fn lbbsp_ok(ranks: usize, args: &[&str]) -> Output {
    expect_success(lbbsp(ranks, args), ranks, args)
}

/// [`lbbsp_env`], asserting success.
pub fn lbbsp_env_ok(ranks: usize, env: &[(&str, &str)], args: &[&str]) -> Output {
    expect_success(lbbsp_env(ranks, env, args), ranks, args)
}

fn expect_success(out: Output, ranks: usize, args: &[&str]) -> Output {
    assert!(
        out.status.success(),
        "lbbsp {args:?} on {ranks} rank(s) failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The `loss` column of a metrics file.
pub fn losses(path: &std::path::Path) -> Vec<f64> {
    lbbsp::train::metrics::read_records(path).unwrap().iter().map(|r| r.loss).collect()
}

pub fn summary(path: &std::path::Path) -> lbbsp::train::metrics::Summary {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Largest relative difference between two loss trajectories over their first `n` entries.
pub fn max_rel_diff(a: &[f64], b: &[f64], n: usize) -> f64 {
    assert!(a.len() >= n && b.len() >= n, "trajectories shorter than {n}: {} and {}", a.len(), b.len());
    a[..n].iter().zip(&b[..n]).map(|(x, y)| (x - y).abs() / x.abs().max(1e-12)).fold(0.0, f64::max)
}

/// `n` random MNIST-shaped samples (pixels uniform in [0, 1), labels 0..9), fixed seed.
pub fn images(n: usize) -> lbbsp::data::dataset::Dataset {
    let mut rng = lbbsp::data::rng::Rng::from_keys(&[7]);
    lbbsp::data::dataset::Dataset {
        x: (0..n * 784).map(|_| rng.next_f32()).collect(),
        y: (0..n).map(|_| rng.below(10) as u32).collect(),
        sample_shape: lbbsp::data::load::RANDOM_MNIST_SHAPE.to_vec(),
        classes: 10,
    }
}

/// Fixes the tier this test process runs its in-process kernels on, and returns it: `LBBSP_ISA`
/// when set (as `scripts/test.sh` sets it to run a test file on each tier), else the best. Call it
/// before a test's first kernel (the tier is fixed by the first kernel call of the process).
pub fn tier() -> lbbsp::Isa {
    let choice = match std::env::var("LBBSP_ISA") {
        Ok(v) => v.parse().unwrap_or_else(|e| panic!("LBBSP_ISA={v}: {e}")),
        Err(_) => lbbsp::IsaChoice::Auto,
    };
    lbbsp::Isa::select(choice).unwrap_or_else(|e| panic!("LBBSP_ISA: {e}"))
}

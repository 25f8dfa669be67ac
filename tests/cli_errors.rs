//! Bad input through the command line: a clear message naming the file or field, a non-zero exit
//! code, and no panic.

mod common;
use common::*;
use std::path::Path;

fn fails_with(args: &[&str], data_dir: Option<&Path>, needles: &[&str]) {
    let mut cmd = std::process::Command::new(bin());
    cmd.args(args).env("LBBSP_DATA", data_dir.map_or_else(common::data_dir, Path::to_path_buf));
    let out = cmd.output().expect("run lbbsp");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail; stderr:\n{err}");
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: message lacks `{n}`:\n{err}");
    }
}

/// A copy of the digits data set in a scratch folder, for damaging.
fn digits_copy(name: &str) -> std::path::PathBuf {
    let dir = scratch(name);
    std::fs::create_dir_all(dir.join("sklearn-digits")).unwrap();
    std::fs::copy(data_dir().join("sklearn-digits/digits.csv.gz"), dir.join("sklearn-digits/digits.csv.gz")).unwrap();
    dir
}

#[test]
fn unknown_recipe_key_is_named() {
    let dir = scratch("badkey");
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/models/digits-mlp.toml")).unwrap();
    let p = dir.join("r.toml");
    std::fs::write(&p, text.replace("global_batch", "global_bach")).unwrap();
    fails_with(&["train", p.to_str().unwrap()], None, &["r.toml", "global_bach"]);
    fails_with(&["train", "digits-mlp", "--set", "optimizer.momentun=0.5"], None, &["momentun"]);
}

#[test]
fn impossible_batch_is_explained() {
    fails_with(&["train", "digits-mlp", "--set", "train.global_batch=0"], None, &["train.global_batch"]);
    fails_with(&["train", "digits-mlp", "--set", "balance.b_max=10"], None, &["balance.b_max"]);
    fails_with(&["train", "digits-mlp", "--set", "balance.b_min=0"], None, &["balance.b_min"]);
    // A setting of the balancer before its rebuild is named, with the ones there are.
    fails_with(&["train", "digits-mlp", "--set", "balance.dead_band=0.1"], None, &["dead_band", "warmup_iters"]);
}

#[test]
fn missing_data_file_says_how_to_fetch() {
    let dir = scratch("missing");
    fails_with(&["train", "digits-mlp"], Some(&dir), &["digits.csv.gz", "lbbsp data fetch digits"]);
}

#[test]
fn truncated_gzip_is_refused_naming_the_file() {
    let dir = digits_copy("trunc");
    let f = dir.join("sklearn-digits/digits.csv.gz");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    fails_with(&["train", "digits-mlp"], Some(&dir), &["digits.csv.gz"]);
}

#[test]
fn corrupted_file_is_refused_naming_the_file() {
    let dir = digits_copy("corrupt");
    let f = dir.join("sklearn-digits/digits.csv.gz");
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&f, &bytes).unwrap();
    fails_with(&["train", "digits-mlp"], Some(&dir), &["digits.csv.gz", "checksum"]);
}

#[test]
fn unknown_recipe_and_data_set_names() {
    fails_with(&["train", "no-such-recipe"], None, &["no-such-recipe", "mnist-mlp"]);
    fails_with(&["data", "verify", "cifar"], None, &["cifar", "mnist"]);
}

#[test]
fn bad_resume_and_stop_settings() {
    fails_with(&["train", "digits-mlp", "--resume", "auto"], None, &["--resume auto needs --checkpoint-dir"]);
    fails_with(&["train", "digits-mlp", "--set", "runtime.stop_signals=[\"KILL\"]"], None, &["`KILL`", "USR1"]);
    let mut cmd = std::process::Command::new(bin());
    cmd.args(["train", "digits-mlp", "--set", "train.max_iters=1"]).env("LBBSP_DATA", data_dir());
    let out = cmd.env("SLURM_CPUS_PER_TASK", "two").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("SLURM_CPUS_PER_TASK=\"two\""), "{err}");
}

#[test]
fn bad_slowdown_argument() {
    fails_with(&["train", "digits-mlp", "--slowdown", "1-3"], None, &["RANK:FACTOR"]);
    fails_with(&["train", "digits-mlp", "--slowdown", "5:2.0"], None, &["rank 5"]);
}

#[test]
fn fetch_from_mirror_then_verify() {
    let dir = scratch("fetch");
    let out = lbbsp_ok(
        0,
        &["data", "fetch", "digits", "--data-dir", dir.to_str().unwrap(), "--mirror", data_dir().to_str().unwrap()],
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("digits"));
    lbbsp_ok(0, &["data", "verify", "digits", "--data-dir", dir.to_str().unwrap()]);
}

/// A loss that turns NaN stops the run with the fix named, the metrics up to it written.
#[test]
fn diverging_training_stops_naming_the_fix_and_keeps_the_metrics() {
    let dir = scratch("diverge");
    let m = dir.join("m.jsonl");
    let args = ["train", "digits-mlp", "-q", "--set", "optimizer.lr=1e4", "--metrics", m.to_str().unwrap()];
    fails_with(&args, None, &["diverged at iteration", "optimizer.lr", "optimizer.clip_grad_norm"]);
    let records = lbbsp::train::metrics::read_records(&m).unwrap();
    let last = records.last().expect("the iterations up to the divergence are in the metrics");
    assert!(!last.loss.is_finite(), "the last record is the diverged iteration: {}", last.loss);
    assert!(records[..records.len() - 1].iter().all(|r| r.loss.is_finite()));
}

/// `lbbsp simulate` runs a shipped scenario, a file and the suite; it writes JSON and per-policy
/// records that `lbbsp plot` draws, and names a scenario it cannot find.
#[test]
fn simulate_runs_scenarios_and_names_a_missing_one() {
    let dir = scratch("simulate");
    let (json, metrics) = (dir.join("r.json"), dir.join("m"));
    let out = lbbsp_ok(
        0,
        &[
            "simulate",
            "steady-hog",
            "--ranks",
            "8",
            "--json",
            json.to_str().unwrap(),
            "--metrics",
            metrics.to_str().unwrap(),
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("steady-hog: 8 ranks") && text.contains("late-oracle"), "{text}");
    let r: lbbsp::sim::SimResult = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!((r.ranks, r.policies.len()), (8, lbbsp::sim::SimPolicy::ALL.len()));
    let lbbsp_rec = lbbsp::train::metrics::read_records(&metrics.join("lbbsp.jsonl")).unwrap();
    assert_eq!((lbbsp_rec.len(), lbbsp_rec[0].batch_sizes.len()), (1000, 8));
    lbbsp_ok(0, &["plot", metrics.join("bsp.jsonl").to_str().unwrap(), "-o", dir.join("p.svg").to_str().unwrap()]);
    let suite = lbbsp_ok(0, &["simulate", "--suite", "--suite-ranks", "4", "--iterations", "30"]);
    // One row per scenario, and a measured one's at its own size too.
    let shipped = lbbsp::sim::scenario::SHIPPED.iter().map(|(n, _)| lbbsp::sim::scenario::resolve(n).unwrap());
    let rows: usize = shipped.map(|s| 1 + usize::from(s.measured() && s.ranks != 4)).sum();
    assert_eq!(String::from_utf8_lossy(&suite.stdout).lines().count(), 1 + rows);
    fails_with(&["simulate", "no-such-scenario"], None, &["no-such-scenario", "steady-hog"]);
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "name = \"b\"\nranks = 2\niterations = 5\nbatch_per_rank = 4\n[compute]\nalpha_s = 0.0\nbeta_s = -1.0\n",
    )
    .unwrap();
    fails_with(&["simulate", bad.to_str().unwrap()], None, &["bad.toml", "compute.beta_s"]);
}

/// `lbbsp simulate --calibrate RUN.jsonl` prints a scenario that replays the run, which `lbbsp
/// simulate` then runs; a run the simulator cannot replay is named with the reason.
#[test]
fn simulate_calibrates_a_replay_of_a_recorded_run() {
    use lbbsp::train::metrics::{IterRecord, JsonlWriter};
    let dir = scratch("calibrate");
    let run = dir.join("run.jsonl");
    let mut w = JsonlWriter::create(&run).unwrap();
    for t in 0..20 {
        let slow = if t >= 10 { 2.0 } else { 1.0 };
        let mut r = IterRecord::timed(t, vec![64, 64], vec![0.064, 0.064 * slow]);
        (r.cpu_share, r.iter_s) = (vec![1.0, 1.0 / slow], r.iter_s + 0.001);
        w.write(&r).unwrap();
    }
    w.flush().unwrap();
    let out = lbbsp_ok(0, &["simulate", "--calibrate", run.to_str().unwrap()]);
    let scenario_path = dir.join("replay.toml");
    std::fs::write(&scenario_path, &out.stdout).unwrap();
    let s = lbbsp::sim::Scenario::load(&scenario_path).unwrap();
    assert_eq!((s.ranks, s.iterations, s.batch_per_rank), (2, 20, 64), "{s:?}");
    assert!((s.comm.fixed_s - 0.001).abs() < 1e-12, "{s:?}");
    let json = dir.join("replay.json");
    lbbsp_ok(0, &["simulate", scenario_path.to_str().unwrap(), "--json", json.to_str().unwrap()]);
    let r: lbbsp::sim::SimResult = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // bsp: 10 iterations of 0.064 s and 10 of 0.128 s, each with 1 ms after the compute.
    let bsp = r.get(lbbsp::sim::SimPolicy::Bsp).unwrap().mean_iter_s;
    assert!((bsp - (0.096 + 0.001)).abs() < 1e-9, "{bsp}");
    let odd = dir.join("odd.jsonl");
    let mut w = JsonlWriter::create(&odd).unwrap();
    w.write(&IterRecord::timed(0, vec![2, 1], vec![0.1, 0.1])).unwrap();
    w.flush().unwrap();
    fails_with(&["simulate", "--calibrate", odd.to_str().unwrap()], None, &["odd.jsonl", "does not split evenly"]);
}

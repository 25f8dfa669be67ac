//! Checkpoints under real `mpirun -n 2`: bitwise resume, damaged checkpoints refused by name with
//! the previous one still usable, `lbbsp eval` of a written checkpoint, and the weights loaded in
//! Python's `safetensors` package reproducing lbbsp's test accuracy with a numpy forward pass.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Runs `args` three ways on `ranks` ranks (0: one plain process) — straight through to `iters`;
/// stopped at `stop`; resumed to `iters` — and asserts that both end with byte-identical weights and
/// optimizer buffers.
fn resume_is_bitwise(name: &str, ranks: usize, args: &[&str], stop: usize, iters: usize) {
    let dir = scratch(name);
    let (a, b) = (dir.join("a"), dir.join("b"));
    let with = |extra: &[&str]| -> Vec<String> { args.iter().chain(extra).map(|x| x.to_string()).collect() };
    let run = |v: Vec<String>| lbbsp_ok(ranks, &v.iter().map(String::as_str).collect::<Vec<_>>());
    let full = format!("train.max_iters={iters}");
    run(with(&["-q", "--set", &full, "--checkpoint-dir", s(&a)]));
    run(with(&[
        "-q",
        "--set",
        &format!("train.max_iters={stop}"),
        "--checkpoint-dir",
        s(&b),
        "--checkpoint-every",
        "100",
    ]));
    let m = dir.join("resumed.jsonl");
    let resumed =
        run(with(&["-q", "--set", &full, "--resume", s(&b), "--checkpoint-every", "100", "--metrics", s(&m)]));
    let records = lbbsp::train::metrics::read_records(&m).unwrap();
    assert_eq!((records.len(), records[0].iter), (iters - stop, stop), "the resumed run continues at iteration {stop}");
    let from = format!("resuming from {}", s(&b.join(format!("step-{stop}"))));
    assert!(stderr(&resumed).contains(&from), "expected `{from}` in:\n{}", stderr(&resumed));
    let last = format!("step-{iters}");
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let (x, y) = (a.join(&last).join(file), b.join(&last).join(file));
        assert!(
            bytes(&x) == bytes(&y),
            "{} and {} differ: the resumed run is not bitwise identical",
            x.display(),
            y.display()
        );
    }
}

/// mnist-mlp (SGD, Nesterov, cosine schedule over 2 planned epochs), stopped mid-epoch and resumed
/// across the epoch boundary (469 iterations per epoch).
#[test]
fn resume_is_bitwise_identical_sgd_mnist_2_ranks() {
    resume_is_bitwise("bitwise-sgd", 2, &["train", "mnist-mlp", "--set", "train.epochs=2"], 250, 600);
}

/// One process with momentum SGD takes the step inside backward (`lbbsp::fused`): the momentum
/// buffer and step count it keeps there are what the checkpoint saves and restores.
#[test]
fn resume_is_bitwise_identical_sgd_in_backward_digits_1_process() {
    resume_is_bitwise("bitwise-sgd-fused", 0, &["train", "digits-mlp"], 130, 400);
}

/// digits-mlp under AdamW with gradient clipping (moment buffers and the step count restored).
#[test]
fn resume_is_bitwise_identical_adamw_clipped_digits_2_ranks() {
    let args = [
        "train",
        "digits-mlp",
        "--set",
        "optimizer.kind=adamw",
        "--set",
        "optimizer.momentum=0",
        "--set",
        "optimizer.lr=0.002",
        "--set",
        "optimizer.weight_decay=0.01",
        "--set",
        "optimizer.clip_grad_norm=0.5",
    ];
    resume_is_bitwise("bitwise-adamw", 2, &args, 130, 400);
}

/// Two checkpoints of a short digits-mlp run on 2 ranks, in `dir/ck`.
fn two_checkpoints(dir: &Path) -> PathBuf {
    let ck = dir.join("ck");
    lbbsp_ok(
        2,
        &[
            "train",
            "digits-mlp",
            "-q",
            "--set",
            "train.max_iters=40",
            "--checkpoint-dir",
            s(&ck),
            "--checkpoint-every",
            "20",
        ],
    );
    assert!(ck.join("step-20/state.json").is_file() && ck.join("step-40/model.safetensors").is_file());
    ck
}

fn fails_naming(ranks: usize, args: &[&str], needles: &[&str]) -> String {
    let out = lbbsp(ranks, args);
    let err = stderr(&out);
    assert!(!out.status.success(), "{args:?} should fail:\n{err}");
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: message lacks `{n}`:\n{err}");
    }
    err
}

#[test]
fn damaged_checkpoint_is_refused_by_name_and_the_previous_one_is_used() {
    let dir = scratch("damaged");
    let ck = two_checkpoints(&dir);
    let newest = ck.join("step-40");
    let model = newest.join("model.safetensors");
    let good = bytes(&model);

    // Truncated: refused when named explicitly, on one rank and on two.
    std::fs::write(&model, &good[..good.len() / 2]).unwrap();
    for ranks in [0, 2] {
        fails_naming(ranks, &["train", "digits-mlp", "-q", "--resume", s(&newest)], &[s(&model), "truncated"]);
    }
    // Same length, one flipped bit: caught by the digest.
    let mut flipped = good.clone();
    let k = flipped.len() - 3;
    flipped[k] ^= 0x10;
    std::fs::write(&model, &flipped).unwrap();
    fails_naming(2, &["train", "digits-mlp", "-q", "--resume", s(&newest)], &[s(&model), "sha256"]);
    fails_naming(0, &["eval", "digits-mlp", "--weights", s(&model)], &[s(&model), "sha256"]);
    // A garbled state file.
    let state = newest.join("state.json");
    let state_text = std::fs::read_to_string(&state).unwrap();
    std::fs::write(&model, &good).unwrap();
    std::fs::write(&state, &state_text[..state_text.len() / 3]).unwrap();
    fails_naming(2, &["train", "digits-mlp", "-q", "--resume", s(&newest)], &[s(&state)]);
    std::fs::write(&state, &state_text).unwrap();
    // A damaged optimizer file, then resuming from the folder: warning naming step-40, step-20 used,
    // and the run rewrites a valid step-40.
    let opt = newest.join("optimizer.safetensors");
    let opt_good = bytes(&opt);
    std::fs::write(&opt, &opt_good[..100]).unwrap();
    let out = lbbsp_ok(
        2,
        &["train", "digits-mlp", "-q", "--set", "train.max_iters=60", "--resume", s(&ck), "--checkpoint-every", "20"],
    );
    let err = stderr(&out);
    assert!(err.contains(&format!("warning: skipping checkpoint {}", s(&newest))) && err.contains(s(&opt)), "{err}");
    assert!(err.contains(&format!("resuming from {}", s(&ck.join("step-20")))), "{err}");
    assert_eq!(bytes(&opt), opt_good, "the rewritten step-40 equals the one damaged (same run, bitwise)");
    assert!(ck.join("step-60/model.safetensors").is_file());
}

#[test]
fn resume_refuses_another_recipe_and_fresh_runs_refuse_a_used_folder() {
    let dir = scratch("refuse");
    let ck = two_checkpoints(&dir);
    fails_naming(
        2,
        &["train", "digits-mlp", "-q", "--set", "train.seed=9", "--resume", s(&ck)],
        &["state.json", "train.seed"],
    );
    fails_naming(0, &["train", "mnist-mlp", "-q", "--resume", s(&ck)], &["state.json", "data"]);
    fails_naming(2, &["train", "digits-mlp", "-q", "--checkpoint-dir", s(&ck)], &[s(&ck), "step-40", "--resume"]);
    fails_naming(0, &["train", "digits-mlp", "-q", "--checkpoint-every", "5"], &["--checkpoint-dir"]);
    let missing = dir.join("nothing-here");
    fails_naming(0, &["train", "digits-mlp", "-q", "--resume", s(&missing)], &[s(&missing)]);
}

/// Resuming on 3 ranks from a 2-rank checkpoint works, with the balancer back at the equal split.
#[test]
fn resume_on_another_world_size_resets_the_balancer() {
    let dir = scratch("world");
    let ck = two_checkpoints(&dir);
    let m = dir.join("m.jsonl");
    let out = lbbsp_ok(
        3,
        &["train", "digits-mlp", "-q", "--set", "train.max_iters=50", "--resume", s(&ck), "--metrics", s(&m)],
    );
    assert!(stderr(&out).contains("restarts from the equal split"), "{}", stderr(&out));
    let records = lbbsp::train::metrics::read_records(&m).unwrap();
    assert_eq!((records.len(), records[0].iter), (10, 40));
    assert_eq!(records[0].batch_sizes.len(), 3);
}

/// Under `lbbsp`, a resumed run continues with the checkpoint's batch sizes (not the equal split).
#[test]
fn lbbsp_resume_continues_the_balancers_sizes() {
    let dir = scratch("lbbsp");
    let ck = dir.join("ck");
    let common = ["train", "mnist-mlp", "-q", "--set", "balance.policy=lbbsp", "--slowdown", "1:3.0@0"];
    let first: Vec<&str> =
        common.iter().copied().chain(["--set", "train.max_iters=40", "--checkpoint-dir", s(&ck)]).collect();
    lbbsp_ok(2, &first);
    let state: serde_json::Value = serde_json::from_slice(&bytes(&ck.join("step-40/state.json"))).unwrap();
    // The split that plays next.
    use lbbsp::balance::Policy;
    let balancer: lbbsp::balance::Balancer = serde_json::from_value(state["balancer"].clone()).unwrap();
    let saved = balancer.sizes().to_vec();
    assert_ne!(saved, [64, 64], "the slowed rank should have been given less by iteration 40");
    let m = dir.join("m.jsonl");
    let second: Vec<&str> =
        common.iter().copied().chain(["--set", "train.max_iters=45", "--resume", s(&ck), "--metrics", s(&m)]).collect();
    lbbsp_ok(2, &second);
    let records = lbbsp::train::metrics::read_records(&m).unwrap();
    assert_eq!(records[0].iter, 40);
    assert_eq!(records[0].batch_sizes, saved);
}

/// `lbbsp eval` of the end-of-run checkpoint gives the summary's test accuracy, on 1 and 2 ranks.
#[test]
fn eval_of_a_checkpoint_reproduces_the_summary() {
    let dir = scratch("eval");
    let (ck, sum) = (dir.join("ck"), dir.join("s.json"));
    lbbsp_ok(
        2,
        &["train", "digits-mlp", "-q", "--set", "train.epochs=3", "--checkpoint-dir", s(&ck), "--summary", s(&sum)],
    );
    let summary = summary(&sum);
    let step = ck.join(format!("step-{}", summary.iterations));
    for (ranks, weights) in [(0, step.join("model.safetensors")), (2, step.clone())] {
        let e = dir.join(format!("eval{ranks}.json"));
        let out = lbbsp_ok(ranks, &["eval", "digits-mlp", "--weights", s(&weights), "--summary", s(&e)]);
        let v: serde_json::Value = serde_json::from_slice(&bytes(&e)).unwrap();
        assert_eq!(
            v["test_accuracy"].as_f64().unwrap(),
            summary.test_accuracy,
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let line = format!("test accuracy {:.2}%", 100.0 * summary.test_accuracy);
        assert!(String::from_utf8_lossy(&out.stdout).contains(&line));
    }
}

/// A Python venv under target/ with the pinned numpy and safetensors from PyPI. Fails loudly when
/// Python, venv or PyPI is unavailable: this check must not silently pass.
fn python_venv() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let req = root.join("tests/python/requirements.txt");
    let venv = root.join("target/python-venv");
    let py = venv.join("bin/python");
    let stamp = venv.join("lbbsp-requirements.txt");
    if std::fs::read(&stamp).ok() == Some(bytes(&req)) && py.exists() {
        return py;
    }
    let run = |cmd: &mut Command, what: &str| {
        let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot start {:?}: {e}", cmd.get_program()));
        assert!(
            out.status.success(),
            "{what} failed (needs python3 with venv, e.g. apt-get install python3-venv, and access to PyPI):\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let _ = std::fs::remove_dir_all(&venv);
    run(Command::new("python3").args(["-m", "venv", s(&venv)]), "python3 -m venv");
    run(
        Command::new(&py).args(["-m", "pip", "install", "--disable-pip-version-check", "-q", "-r", s(&req)]),
        "pip install from PyPI",
    );
    std::fs::copy(&req, &stamp).unwrap();
    py
}

/// Acceptance: an lbbsp safetensors file loads in Python's `safetensors` (numpy API) with the
/// expected names and shapes, and a numpy forward pass of mnist-mlp from it gives lbbsp's accuracy.
#[test]
fn python_safetensors_loads_weights_and_reproduces_accuracy() {
    let py = python_venv();
    let dir = scratch("python");
    let (ck, sum) = (dir.join("ck"), dir.join("s.json"));
    lbbsp_ok(
        2,
        &["train", "mnist-mlp", "-q", "--set", "train.epochs=1", "--checkpoint-dir", s(&ck), "--summary", s(&sum)],
    );
    let summary = summary(&sum);
    let weights = ck.join(format!("step-{}/model.safetensors", summary.iterations));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/check_safetensors.py");
    let acc = format!("{}", summary.test_accuracy);
    let out = Command::new(&py)
        .args([script, "--weights", s(&weights), "--data", s(&data_dir()), "--expected-accuracy", &acc])
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "check_safetensors.py failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
}

//! The mpirun tier: real `mpirun -n 2` and `-n 3 --oversubscribe` runs of the binary.

mod common;
use common::*;

/// Loss per iteration of 2 and 3 ranks equals the 1-rank run (same seed) within 1e-4 relative.
#[test]
fn split_invariance_digits_1_2_3_ranks() {
    let dir = scratch("split");
    let mut trajectories = Vec::new();
    for ranks in [0, 2, 3] {
        let m = dir.join(format!("m{ranks}.jsonl"));
        lbbsp_ok(
            ranks,
            &["train", "digits-mlp", "-q", "--set", "train.max_iters=100", "--metrics", m.to_str().unwrap()],
        );
        let records = lbbsp::train::metrics::read_records(&m).unwrap();
        assert_eq!(records.len(), 100);
        assert_eq!(records[0].batch_sizes.len(), ranks.max(1));
        trajectories.push(losses(&m));
    }
    for (k, t) in trajectories.iter().enumerate().skip(1) {
        let d = max_rel_diff(&trajectories[0], t, 100);
        assert!(d <= 1e-4, "run {k}: loss differs from 1 rank by {d:.2e} relative");
    }
}

#[test]
fn digits_mlp_accuracy_under_mpirun() {
    let dir = scratch("digits");
    let s = dir.join("s.json");
    lbbsp_ok(2, &["train", "digits-mlp", "-q", "--summary", s.to_str().unwrap()]);
    let sum = summary(&s);
    assert_eq!(sum.world_size, 2);
    assert!(sum.test_accuracy >= 0.96, "digits-mlp test accuracy {:.4}", sum.test_accuracy);
    assert!(dir.join("s.recipe.toml").exists(), "resolved recipe is written next to the summary");
}

#[test]
fn a9a_logreg_accuracy_under_mpirun() {
    let dir = scratch("a9a");
    let s = dir.join("s.json");
    lbbsp_ok(2, &["train", "a9a-logreg", "-q", "--summary", s.to_str().unwrap()]);
    let sum = summary(&s);
    assert!(sum.test_accuracy >= 0.845, "a9a-logreg test accuracy {:.4}", sum.test_accuracy);
}

#[test]
fn mnist_mlp_accuracy_in_three_epochs_under_mpirun() {
    let dir = scratch("mnist");
    let s = dir.join("s.json");
    let m = dir.join("m.jsonl");
    lbbsp_ok(2, &["train", "mnist-mlp", "-q", "--summary", s.to_str().unwrap(), "--metrics", m.to_str().unwrap()]);
    let sum = summary(&s);
    assert_eq!(sum.epochs, 3);
    assert!(sum.test_accuracy >= 0.975, "mnist-mlp test accuracy {:.4}", sum.test_accuracy);
    let records = lbbsp::train::metrics::read_records(&m).unwrap();
    assert_eq!(records.len(), sum.iterations);
    let used: usize = records.iter().filter(|r| r.epoch == 0).map(|r| r.global_batch).sum();
    assert_eq!(used, 60_000, "every sample once per epoch");
    for r in &records {
        assert_eq!(r.batch_sizes.iter().sum::<usize>(), r.global_batch);
        assert_eq!(r.compute_s.len(), 2);
        assert_eq!(r.comm_s.len(), 2);
    }
}

/// A failure on the ranks ends the whole job with a message, not a hang or a panic.
#[test]
fn impossible_batch_fails_cleanly_under_mpirun() {
    let out = lbbsp(3, &["train", "digits-mlp", "-q", "--set", "train.global_batch=2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("train.global_batch") && err.contains("3 ranks"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// A diverging run stops on every rank at the same iteration (the loss is summed from the gathered
/// stats), with the fix named and the metrics up to it written, not a hang.
#[test]
fn diverging_training_stops_every_rank_under_mpirun() {
    let dir = scratch("diverge-mpi");
    let m = dir.join("m.jsonl");
    let out = lbbsp(2, &["train", "digits-mlp", "-q", "--set", "optimizer.lr=1e4", "--metrics", m.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("diverged at iteration") && err.contains("optimizer.lr"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let records = lbbsp::train::metrics::read_records(&m).unwrap();
    assert!(records.last().is_some_and(|r| !r.loss.is_finite() && r.batch_sizes.len() == 2), "{records:?}");
}

/// MPI_Allreduce, the ring and the shared window, and the loop's reduce-scatter + all-gather (on the
/// window: growing it twice), give exact sums on 2 and 3 ranks (`lbbsp bench allreduce` checks every
/// result and fails on a wrong one).
#[test]
fn allreduce_and_its_halves_are_exact_on_2_and_3_ranks() {
    for ranks in [2, 3] {
        let out = lbbsp_ok(ranks, &["bench", "allreduce", "--reps", "2"]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(text.matches("RESULT allreduce").count(), 3, "{text}");
        assert!(text.contains(&format!("ranks={ranks} floats=535818")), "{text}");
    }
}

/// The sharded step through the shared window (the default on one node), over the ring, and one
/// MPI_Allreduce with a full update on every rank (`LBBSP_ALLREDUCE=mpi`) train identically: on two
/// ranks each sum is `a + b` whichever way and the update is element-wise, so the loss trajectories
/// agree bit for bit. On three ranks the window sums in the ring's order, so those two still agree
/// bit for bit (MPI_Allreduce's order is its own). A wrong setting is refused by name.
#[test]
fn shm_ring_and_mpi_allreduce_train_identically_and_a_bad_setting_is_named() {
    let dir = scratch("allreduce-setting");
    let run = |ranks: usize, algo: &str, clip: &str| {
        let m = dir.join(format!("{ranks}-{algo}-{clip}.jsonl"));
        let mut args = vec!["train", "mnist-mlp", "-q", "--set", "train.max_iters=40"];
        let clip_set = format!("optimizer.clip_grad_norm={clip}");
        if clip != "none" {
            args.extend(["--set", &clip_set]);
        }
        args.extend(["--metrics", m.to_str().unwrap()]);
        lbbsp_env_ok(ranks, &[("LBBSP_ALLREDUCE", algo)], &args);
        losses(&m)
    };
    // Without and with gradient clipping (0.05 clips every step: its norm is summed over the ranks'
    // blocks on the window and the ring, over the whole gradient with MPI_Allreduce).
    for clip in ["none", "0.05"] {
        let shm = run(2, "shm", clip);
        assert_eq!(shm.len(), 40);
        for algo in ["ring", "mpi"] {
            assert_eq!(shm, run(2, algo, clip), "2 ranks: shm and {algo} trajectories differ (clip {clip})");
        }
    }
    assert_eq!(run(3, "shm", "none"), run(3, "ring", "none"), "3 ranks: shm and ring trajectories differ");
    // No room for the window (here: its directory is missing): the ranks agree to take the ring,
    // say so, and train the same.
    let m = dir.join("no-room.jsonl");
    let out = lbbsp_env_ok(
        2,
        &[("OMPI_MCA_osc_sm_backing_directory", "/nonexistent-lbbsp-shm")],
        &["train", "mnist-mlp", "-q", "--set", "train.max_iters=40", "--metrics", m.to_str().unwrap()],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent-lbbsp-shm") && err.contains("on the ring"), "{err}");
    assert_eq!(losses(&m), run(2, "ring", "none"), "the fallback trains as the ring");
    let out = lbbsp_env(2, &[("LBBSP_ALLREDUCE", "tree")], &["train", "digits-mlp", "-q"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("LBBSP_ALLREDUCE") && err.contains("shm"), "{err}");
}

/// Every setting that changes a run is in the resolved recipe written next to its results: the
/// `[runtime]` section holds the tier, thread count and allreduce the run used (`auto` resolved,
/// flags and environment over the recipe), and training from that file alone, with neither,
/// gives the same losses bit for bit. And `balance.replay` takes an `lbbsp` run's splits from its
/// metrics file, reproducing its losses exactly.
#[test]
fn the_resolved_recipe_reproduces_a_run() {
    let dir = scratch("resolved-runtime");
    let (m1, s1) = (dir.join("first.jsonl"), dir.join("first.json"));
    let base = ["train", "digits-mlp", "-q", "--set", "train.max_iters=60", "--set", "balance.policy=lbbsp"];
    let mut args = base.to_vec();
    args.extend(["--slowdown", "1:3.0@10", "--threads", "1", "--metrics", m1.to_str().unwrap()]);
    args.extend(["--summary", s1.to_str().unwrap()]);
    lbbsp_env_ok(3, &[("LBBSP_ALLREDUCE", "mpi")], &args);
    let resolved = dir.join("first.recipe.toml");
    let text = std::fs::read_to_string(&resolved).unwrap();
    let recipe: toml::Value = toml::from_str(&text).unwrap();
    let runtime = &recipe["runtime"];
    assert_eq!(runtime["allreduce"].as_str(), Some("mpi"), "{text}");
    assert_eq!(runtime["threads"].as_integer(), Some(1), "{text}");
    assert_eq!(runtime["isa"].as_str(), Some(lbbsp::Isa::best().name()), "{text}");

    // The same run from the resolved recipe, its splits replayed from the first run's metrics.
    let m2 = dir.join("second.jsonl");
    let replay = format!("balance.replay={}", m1.display());
    let second = ["train", resolved.to_str().unwrap(), "-q", "--set", &replay, "--metrics", m2.to_str().unwrap()];
    lbbsp_ok(3, &second);
    assert_eq!(losses(&m1), losses(&m2), "the resolved recipe did not reproduce the run");
    let r2 = lbbsp::train::metrics::read_records(&m2).unwrap();
    assert!(r2.iter().any(|r| r.batch_sizes[1] < 20), "the replayed splits shed rank 1's work");

    // A replay that does not fit the run is refused by name.
    let out = lbbsp(2, &["train", resolved.to_str().unwrap(), "-q", "--set", &replay]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("first.jsonl") && err.contains("on 2 rank(s)"), "{err}");
}

//! The model zoo under real `mpirun`: split invariance of the convolutional recipes (with dropout
//! and GroupNorm) under LB-BSP re-splitting, and the accuracy of the LeNet-5 recipes.
//!
//! `fashion-resnet` takes longer to train than CI allows; `scripts/zoo_accuracy.sh` checks its
//! accuracy (and the others') from `--summary`.

mod common;
use common::*;

/// Loss per iteration of `recipe` on 1 rank and on 3 ranks under `lbbsp` with rank 1 slowed 3× from
/// iteration 5 (so the balancer re-splits the batch), equal within 1e-4 relative over 50 iterations.
fn split_invariance(recipe: &str) {
    let dir = scratch(&format!("zoo-split-{recipe}"));
    let run = |ranks: usize, extra: &[&str]| {
        let m = dir.join(format!("m{ranks}.jsonl"));
        let mut args = vec!["train", recipe, "-q", "--set", "train.max_iters=50", "--metrics", m.to_str().unwrap()];
        args.extend_from_slice(extra);
        lbbsp_ok(ranks, &args);
        lbbsp::train::metrics::read_records(&m).unwrap()
    };
    let solo = run(0, &[]);
    let three = run(3, &["--set", "balance.policy=lbbsp", "--slowdown", "1:3.0@5"]);
    assert_eq!((solo.len(), three.len()), (50, 50));
    let resplit = three.iter().any(|r| r.batch_sizes != three[0].batch_sizes);
    assert!(resplit, "{recipe}: the balancer never changed the split, so the test proves nothing");
    let a: Vec<f64> = solo.iter().map(|r| r.loss).collect();
    let b: Vec<f64> = three.iter().map(|r| r.loss).collect();
    let d = max_rel_diff(&a, &b, 50);
    eprintln!("{recipe}: 1 rank vs 3 ranks under lbbsp: max relative loss difference {d:.2e}");
    assert!(d <= 1e-4, "{recipe}: 3 ranks under lbbsp differ from 1 rank by {d:.2e} relative");
}

#[test]
fn split_invariance_mnist_lenet5() {
    split_invariance("mnist-lenet5");
}

/// Has dropout: masks follow the sample, whichever rank and row process it.
#[test]
fn split_invariance_fashion_lenet5() {
    split_invariance("fashion-lenet5");
}

/// Has GroupNorm and residual blocks: per-sample statistics, whatever the split.
#[test]
fn split_invariance_fashion_resnet() {
    split_invariance("fashion-resnet");
}

/// Trains `recipe` in full on 2 ranks and checks its test accuracy against `target`.
fn accuracy(recipe: &str, target: f64) {
    let dir = scratch(&format!("zoo-acc-{recipe}"));
    let s = dir.join("s.json");
    lbbsp_ok(2, &["train", recipe, "-q", "--summary", s.to_str().unwrap()]);
    let sum = summary(&s);
    eprintln!("{recipe}: test accuracy {:.4} (target {target}) in {:.0} s", sum.test_accuracy, sum.wall_s);
    assert_eq!(sum.world_size, 2);
    assert!(
        sum.test_accuracy >= target,
        "{recipe}: test accuracy {:.4} is below the target {target}",
        sum.test_accuracy
    );
}

#[test]
fn mnist_lenet5_accuracy_under_mpirun() {
    accuracy("mnist-lenet5", 0.990);
}

#[test]
fn fashion_lenet5_accuracy_under_mpirun() {
    accuracy("fashion-lenet5", 0.895);
}

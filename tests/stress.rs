//! The mpirun tier's stress cases, bounded in time: 8 ranks on the machine's cores
//! (`--oversubscribe`), a rank slowed 20×, and a rank whose speed alternates every iteration. In
//! each, under `lbbsp`, every iteration's split sums to B within the bounds and training reaches
//! the loss of a plain run, and the balancer's oscillation is measured; it is bounded where
//! nothing alternates (docs/reliability.md, "Stress"). An alternating rank is anticipated, which
//! reverses the split at every iteration: a change of split costs no time (the model's buffers
//! hold the largest batch), so reversals there are not bounded for their own sake (issue 27).
//!
//! Oscillation is counted as *reversals* ([`lbbsp::sim::Reversals`]): iterations where a
//! rank's batch moved by at least 2% of B one way and then at least 2% of B the other way at the
//! next move. A balancer that chased an alternating rank would reverse at every iteration (100 per
//! 100); smaller moves are the noise's and are not counted.

mod common;
use common::*;
use lbbsp::sim::Reversals;
use lbbsp::train::metrics::{read_records, IterRecord};

/// Reversals of the split per 100 iterations, the worst rank's (see the module's doc).
fn reversals_per_100(records: &[IterRecord]) -> f64 {
    let mut r = Reversals::new(records[0].global_batch, records[0].batch_sizes.len());
    records.iter().for_each(|rec| r.record(&rec.batch_sizes));
    r.per_100()
}

/// Trains mnist-mlp for one epoch on `ranks` ranks with `extra` settings and checks the split of
/// every iteration, the reversals and the loss against `reference` (the last-epoch mean loss of a
/// plain run). Returns (reversals per 100 iterations, last-epoch loss).
fn stress(name: &str, ranks: usize, extra: &[&str], reference: f64) -> (f64, f64) {
    let dir = scratch(name);
    let (m, sum) = (dir.join("m.jsonl"), dir.join("s.json"));
    let mut args = vec!["train", "mnist-mlp", "-q", "--threads", "1", "--set", "train.epochs=1"];
    args.extend([
        "--set",
        "balance.policy=lbbsp",
        "--metrics",
        m.to_str().unwrap(),
        "--summary",
        sum.to_str().unwrap(),
    ]);
    args.extend(extra);
    lbbsp_ok(ranks, &args);
    let records = read_records(&m).unwrap();
    assert_eq!(records.len(), 469, "one epoch of MNIST at B = 128");
    for r in &records {
        assert_eq!(r.batch_sizes.iter().sum::<usize>(), r.global_batch, "iteration {}: {:?}", r.iter, r.batch_sizes);
        assert!(r.batch_sizes.iter().all(|&b| (1..=128).contains(&b)), "iteration {}: {:?}", r.iter, r.batch_sizes);
    }
    let rev = reversals_per_100(&records);
    let loss = summary(&sum).last_epoch_loss;
    assert!(
        (loss - reference).abs() <= 0.01 * reference,
        "{name}: last-epoch loss {loss:.4}, a plain run's {reference:.4}"
    );
    eprintln!("{name}: {rev:.1} reversals per 100 iterations, last-epoch loss {loss:.4} (plain run {reference:.4})");
    (rev, loss)
}

/// The last-epoch loss of one plain process on the same recipe.
fn plain_loss() -> f64 {
    let dir = scratch("stress-plain");
    let sum = dir.join("s.json");
    lbbsp_ok(0, &["train", "mnist-mlp", "-q", "--set", "train.epochs=1", "--summary", sum.to_str().unwrap()]);
    summary(&sum).last_epoch_loss
}

#[test]
fn stress_cases_keep_the_split_whole_and_the_loss_right() {
    let reference = plain_loss();
    let (rev, _) = stress("stress-slowed-20x", 2, &["--slowdown", "1:20"], reference);
    assert!(rev <= 10.0, "slowed 20×: {rev:.1} reversals of the split per 100 iterations");
    // The alternating rank is anticipated: the split turns with it, the sizes stay whole and the
    // loss right (checked in `stress`).
    stress("stress-alternating", 2, &["--slowdown", "1:4@0%2"], reference);
    // 8 ranks on 2 cores: a rank that keeps or loses a core for a few iterations is followed (and
    // the split turns at each end); a gain the model cannot tell from its own noise does not move
    // the split, so it does not follow the scheduler from iteration to iteration.
    let (rev, _) = stress("stress-8-ranks", 8, &[], reference);
    assert!(rev <= 20.0, "8 ranks on 2 cores: {rev:.1} reversals of the split per 100 iterations");
}

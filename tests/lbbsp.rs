//! LB-BSP under real `mpirun`: a slowed rank gets its equal-time share quickly and keeps it, the
//! loss trajectory is unchanged by re-splitting, and final accuracy matches BSP.

mod common;
use common::*;
use lbbsp::balance::{equalize, Line};
use lbbsp::metrics::{read_records, IterRecord};

/// Ordinary least squares `t = α + β·b` of one rank over `records`.
fn fit(records: &[IterRecord], rank: usize) -> Line {
    let n = records.len() as f64;
    let (mut sb, mut st, mut sbb, mut sbt) = (0.0, 0.0, 0.0, 0.0);
    for r in records {
        let (b, t) = (r.batch_sizes[rank] as f64, r.compute_s[rank]);
        sb += b;
        st += t;
        sbb += b * b;
        sbt += b * t;
    }
    let det = n * sbb - sb * sb;
    if det.abs() < 1e-9 * n * sbb {
        return Line { alpha: 0.0, beta: st / sb };
    }
    let beta = (n * sbt - sb * st) / det;
    let alpha = (st - beta * sb) / n;
    if alpha < 0.0 || beta <= 0.0 {
        Line { alpha: 0.0, beta: st / sb }
    } else {
        Line { alpha, beta }
    }
}

fn slowed_rank_reaches_its_share(ranks: usize) {
    let dir = scratch(&format!("share{ranks}"));
    let m = dir.join("m.jsonl");
    let m_s = m.to_str().unwrap();
    let out = lbbsp_ok(
        ranks,
        &["train", "mnist-mlp", "-q", "--set", "train.max_iters=90", "--set", "balance.policy=lbbsp", "--slowdown", "1:3.0@30", "--metrics", m_s],
    );
    let records = read_records(&m).unwrap();
    let settled = &records[35..];
    // The equal-time share: the split that equalises each rank's compute-time line fitted, in
    // hindsight, on the iterations after the slowdown.
    let lines: Vec<Line> = (0..ranks).map(|r| fit(settled, r)).collect();
    let share = equalize(&lines, 128, &vec![(1, 128); ranks])[1] as f64;
    let sizes: Vec<usize> = records.iter().map(|r| r.batch_sizes[1]).collect();
    let off: Vec<usize> = settled.iter().map(|r| r.batch_sizes[1]).filter(|&b| (b as f64 - share).abs() > 0.15 * share).collect();
    assert!(
        off.is_empty(),
        "{ranks} ranks: rank 1's size left 15% of its equal-time share {share} after iteration 35: {sizes:?}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(sizes[29] as f64 > 1.3 * share, "sizes must move after the slowdown: {sizes:?}");
}

#[test]
fn slowed_rank_reaches_its_share_2_ranks() {
    slowed_rank_reaches_its_share(2);
}

#[test]
fn slowed_rank_reaches_its_share_3_ranks() {
    slowed_rank_reaches_its_share(3);
}

/// Re-splitting changes who computes which sample, never the global batch or the gradient.
#[test]
fn lbbsp_with_slowdown_keeps_the_one_rank_trajectory() {
    let dir = scratch("lbsplit");
    let m1 = dir.join("m1.jsonl");
    let m3 = dir.join("m3.jsonl");
    lbbsp_ok(0, &["train", "digits-mlp", "-q", "--set", "train.max_iters=100", "--metrics", m1.to_str().unwrap()]);
    lbbsp_ok(
        3,
        &["train", "digits-mlp", "-q", "--set", "train.max_iters=100", "--set", "balance.policy=lbbsp", "--slowdown", "1:4.0@10", "--metrics", m3.to_str().unwrap()],
    );
    let r3 = read_records(&m3).unwrap();
    let moved = r3.iter().filter(|r| r.batch_sizes != r3[0].batch_sizes).count();
    assert!(moved > 50, "sizes should change under the slowdown; only {moved} iterations differ from the first split");
    for r in &r3 {
        assert_eq!(r.batch_sizes.iter().sum::<usize>(), r.global_batch, "Σ b_i = B at iteration {}", r.iter);
    }
    // digits: 1,438 training samples, B = 64 → 22 full batches and one of 30 per epoch.
    let epoch0: usize = r3.iter().filter(|r| r.epoch == 0).map(|r| r.global_batch).sum();
    assert_eq!(epoch0, 1438, "every sample exactly once per epoch");
    let d = max_rel_diff(&losses(&m1), &losses(&m3), 100);
    assert!(d <= 1e-4, "loss trajectory differs from 1 rank by {d:.2e} relative");
}

/// Same epochs, same final accuracy (within 0.3 points) whether balanced or not.
#[test]
fn mnist_accuracy_lbbsp_equals_bsp() {
    let dir = scratch("acc");
    let mut acc = Vec::new();
    for (policy, slow) in [("bsp", None), ("lbbsp", Some("1:2.0@0"))] {
        let s = dir.join(format!("{policy}.json"));
        let set = format!("balance.policy={policy}");
        let mut args = vec!["train", "mnist-mlp", "-q", "--set", &set, "--summary", s.to_str().unwrap()];
        if let Some(sd) = slow {
            args.extend(["--slowdown", sd]);
        }
        lbbsp_ok(2, &args);
        acc.push(summary(&s).test_accuracy);
    }
    assert!((acc[0] - acc[1]).abs() <= 0.003, "bsp {:.4} vs lbbsp {:.4}", acc[0], acc[1]);
}

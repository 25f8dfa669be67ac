//! LB-BSP under real `mpirun`: a slowed rank gets its equal-time share quickly and keeps it, the
//! loss trajectory is unchanged by re-splitting, and final accuracy matches BSP.

mod common;
use common::*;

use lbbsp::metrics::read_records;

/// With `--slowdown 1:3.0@30`, rank 1's size is within 15% of its equal-time share from iteration
/// 35 on. Ranks are pinned to cores round robin (with 3 ranks on 2 cores, ranks 0 and 2 share one).
/// The global batch is 2048 so that per-sample work dominates fixed per-iteration costs and
/// iterations are long compared with the kernel's scheduling slice. The share at iteration t is
/// `b_t · (1/s_1) / Σ_j (1/s_j)` with `s_j` rank j's measured seconds per sample in that iteration.
/// This machine's speed also jumps by itself for a few iterations at a time (shared host), which no
/// balancer can foresee, so each iteration's deviation is the median over the 7 around it (the
/// first and last 7 from iteration 35 on at the two ends).
///
/// Such a jump can still outlast the window, or, just before iteration 30, delay the confirmation
/// of the slowdown, so a run whose sizes move late or leave the band is repeated once (before the
/// balancer held back a speed burst that coincides with a size change, about one first run in four
/// left the band, and one run in ~15 failed both; on a noisy day with the outlier band at 25%, 5 of
/// 24 first runs and 2 repeats; at 15%, 1 of 24 and none):
/// the claim is that the balancer holds the share, and a second independent run holding it shows
/// that, while a balancer that does not hold it fails both.
fn slowed_rank_reaches_its_share(ranks: usize) {
    let first = share_run(ranks, "a");
    let Err(why) = first else { return };
    eprintln!("first run left the band, repeating once:\n{why}");
    if let Err(why) = share_run(ranks, "b") {
        panic!("{why}");
    }
}

/// One run of [`slowed_rank_reaches_its_share`]: `Err` names the iterations off the share.
fn share_run(ranks: usize, attempt: &str) -> Result<(), String> {
    let dir = scratch(&format!("share{ranks}{attempt}"));
    let m = dir.join("m.jsonl");
    let args = [
        "train",
        "mnist-mlp",
        "-q",
        "--set",
        "train.max_iters=80",
        "--set",
        "train.global_batch=2048",
        "--set",
        "balance.policy=lbbsp",
        "--slowdown",
        "1:3.0@30",
        "--metrics",
        m.to_str().unwrap(),
    ];
    let out = lbbsp_pinned(ranks, &args);
    let records = read_records(&m).unwrap();
    let sizes: Vec<usize> = records.iter().map(|r| r.batch_sizes[1]).collect();
    assert!(records.iter().all(|r| r.batch_sizes.iter().sum::<usize>() == r.global_batch));
    // A VM speed jump just before the slowdown can delay its confirmation too: same once-repeat.
    if sizes[34] as f64 > 0.7 * sizes[28] as f64 {
        return Err(format!("{ranks} ranks: sizes must move after the slowdown by iteration 34: {sizes:?}"));
    }
    let deviation: Vec<f64> = records
        .iter()
        .map(|r| {
            let rate: Vec<f64> = (0..ranks).map(|k| r.batch_sizes[k] as f64 / r.compute_s[k]).collect();
            let share = r.global_batch as f64 * rate[1] / rate.iter().sum::<f64>();
            (r.batch_sizes[1] as f64 - share).abs() / share
        })
        .collect();
    let mut off = Vec::new();
    for t in 35..records.len() {
        // The 7 iterations around t, shifted inside 35.. at both ends (not cut to 4 there).
        let lo = t.saturating_sub(3).clamp(35, records.len().saturating_sub(7).max(35));
        let mut w = deviation[lo..(lo + 7).min(records.len())].to_vec();
        w.sort_by(f64::total_cmp);
        if w[w.len() / 2] > 0.15 {
            off.push((t, sizes[t], (100.0 * deviation[t]).round()));
        }
    }
    if off.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{ranks} ranks: rank 1's size left 15% of its equal-time share after iteration 35 (iteration, size, % off): {off:?}\nsizes: {sizes:?}\n{}",
        String::from_utf8_lossy(&out.stderr)
    ))
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
        &[
            "train",
            "digits-mlp",
            "-q",
            "--set",
            "train.max_iters=100",
            "--set",
            "balance.policy=lbbsp",
            "--slowdown",
            "1:4.0@10",
            "--metrics",
            m3.to_str().unwrap(),
        ],
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

//! Instruction-set tiers end to end: every tier the CPU can run trains the same trajectory, keeps
//! split invariance, and is named in the run header and summary; a tier it cannot run is refused.
//!
//! The kernels' own numerics are unit tests that loop over the tiers (`src/gemm.rs`,
//! `src/correlate.rs`); the gradient checks and the allocation test run in-process on one tier, so
//! `scripts/test.sh` runs them again with `LBBSP_ISA` set to each further tier.

mod common;
use common::*;
use lbbsp::Isa;

fn run(
    isa: Isa,
    ranks: usize,
    recipe: &str,
    iters: usize,
    extra: &[&str],
) -> (Vec<f64>, lbbsp::train::metrics::Summary) {
    let dir = scratch(&format!("isa-{recipe}-{isa}-{ranks}-{}", extra.len()));
    let (m, s) = (dir.join("m.jsonl"), dir.join("s.json"));
    let iters = format!("train.max_iters={iters}");
    let mut args = vec!["--isa", isa.name(), "train", recipe, "-q", "--set", &iters];
    args.extend_from_slice(&["--metrics", m.to_str().unwrap(), "--summary", s.to_str().unwrap()]);
    args.extend_from_slice(extra);
    lbbsp_ok(ranks, &args);
    (losses(&m), summary(&s))
}

/// The same recipe on every tier: the loss per iteration agrees within 1e-4 relative over 100
/// iterations, for a fully connected and a convolutional model; the tiers with FMA give the same
/// bits, the portable one (separate multiplies and adds) differs by rounding.
#[test]
fn every_tier_follows_the_same_loss_trajectory() {
    for recipe in ["mnist-mlp", "mnist-lenet5"] {
        let tiers = Isa::available();
        let (best, s) = run(tiers[0], 0, recipe, 100, &[]);
        assert_eq!((best.len(), s.isa), (100, tiers[0]));
        for &isa in &tiers[1..] {
            let (other, s) = run(isa, 0, recipe, 100, &[]);
            assert_eq!(s.isa, isa, "the summary names the tier in use");
            let d = max_rel_diff(&best, &other, 100);
            eprintln!("{recipe}: {isa} vs {}: max relative loss difference {d:.2e}", tiers[0]);
            assert!(d <= 1e-4, "{recipe}: the {isa} tier differs from {} by {d:.2e} relative", tiers[0]);
            if isa != Isa::Portable {
                // The FMA tiers compute the same operations in the same order (docs/kernels.md).
                assert!(best == other, "{recipe}: the {isa} and {} tiers should give the same bits", tiers[0]);
            }
        }
    }
}

/// Split invariance holds on every tier, not only the best one: 1 rank against 2 ranks under
/// `lbbsp` with rank 1 slowed (so the split changes), on a convolutional recipe.
#[test]
fn split_invariance_on_every_tier() {
    for isa in Isa::available() {
        let (solo, _) = run(isa, 0, "mnist-lenet5", 40, &[]);
        let (two, s) = run(isa, 2, "mnist-lenet5", 40, &["--set", "balance.policy=lbbsp", "--slowdown", "1:3.0@5"]);
        assert_eq!((s.world_size, s.isa), (2, isa));
        let d = max_rel_diff(&solo, &two, 40);
        eprintln!("{isa}: 1 rank vs 2 ranks under lbbsp: max relative loss difference {d:.2e}");
        assert!(d <= 1e-4, "{isa}: 2 ranks differ from 1 rank by {d:.2e} relative");
    }
}

/// The header names the tier; an unknown tier, or one this CPU lacks, is refused with the choices.
#[test]
fn the_tier_is_named_and_a_wrong_one_refused() {
    let out = lbbsp(0, &["--isa", "portable", "train", "digits-mlp", "--set", "train.max_iters=2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("kernels portable"), "{err}");
    let out = lbbsp(0, &["--isa", "avx3", "isa"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("auto, avx512, avx2 or portable"), "{err}");
    for isa in Isa::ALL.into_iter().filter(|t| !t.supported()) {
        let out = lbbsp(0, &["--isa", isa.name(), "isa"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("cannot run the") && err.contains(isa.name()), "{err}");
    }
    let out = lbbsp(0, &["isa"]);
    let text = String::from_utf8_lossy(&out.stdout);
    // Without --isa: LBBSP_ISA if the test runs under it, else the best tier.
    assert!(text.contains(&format!("active={}", tier())), "{text}");
}

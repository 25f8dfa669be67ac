//! Property tests of the balancer: the split (10,000 random cases), and the balancer's behaviour
//! under a step change and under noise, on a fixed seed so that CI is reproducible. The rebuilt
//! balancer still fails rare random cases of the second: under ±30% noise with 2× spikes on 2
//! ranks, a rank held below half of its (noisy) share for 6 iterations while the model is young
//! (seed 1137863819130187142, α = 2.6 ms, iterations 9–14); issue 27 records it.

use lbbsp::balance::{equalize, predicted_max, BalanceConfig, Balancer, Line, Observation, Policy, PolicyKind};
use lbbsp::shard::equal_split;
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

/// A random problem: lines with positive slopes, bounds and a feasible total.
fn problem() -> impl Strategy<Value = (Vec<Line>, usize, Vec<(usize, usize)>)> {
    (1usize..40).prop_flat_map(|n| {
        (
            prop::collection::vec((0.0f64..0.01, 1e-6f64..1e-2), n),
            prop::collection::vec((1usize..8, 0usize..600), n),
            0.0f64..=1.0,
        )
            .prop_map(|(ab, lohi, frac)| {
                let lines: Vec<Line> = ab.into_iter().map(|(alpha, beta)| Line { alpha, beta }).collect();
                let bounds: Vec<(usize, usize)> = lohi.into_iter().map(|(lo, extra)| (lo, lo + extra)).collect();
                let lo: usize = bounds.iter().map(|b| b.0).sum();
                let hi: usize = bounds.iter().map(|b| b.1).sum();
                let total = lo + ((hi - lo) as f64 * frac).round() as usize;
                (lines, total, bounds)
            })
    })
}

/// The best predicted slowest time of any integer split (exact, by bisection on T over integers).
fn optimum(lines: &[Line], total: usize, bounds: &[(usize, usize)]) -> f64 {
    // Largest b_i with t_i(b) ≤ T, for the smallest T at which the sum reaches `total`.
    let fits = |t: f64| -> usize {
        lines
            .iter()
            .zip(bounds)
            .map(|(l, &(lo, hi))| {
                if l.at(lo) > t {
                    return 0;
                }
                (((t - l.alpha) / l.beta).floor().max(lo as f64) as usize).min(hi)
            })
            .sum()
    };
    let mut cands: Vec<f64> = Vec::new();
    for (l, &(lo, hi)) in lines.iter().zip(bounds) {
        cands.push(l.at(lo));
        cands.push(l.at(hi));
    }
    let (mut a, mut b) =
        (cands.iter().cloned().fold(f64::INFINITY, f64::min), cands.iter().cloned().fold(0.0, f64::max));
    for _ in 0..200 {
        let m = 0.5 * (a + b);
        if lines.iter().zip(bounds).all(|(l, &(lo, _))| l.at(lo) <= m) && fits(m) >= total {
            b = m;
        } else {
            a = m;
        }
    }
    b
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, rng_seed: RngSeed::Fixed(0x1bb5), ..ProptestConfig::default() })]

    #[test]
    fn sum_bounds_determinism_and_quality((lines, total, bounds) in problem()) {
        let sizes = equalize(&lines, total, &bounds);
        prop_assert_eq!(sizes.iter().sum::<usize>(), total);
        for (b, &(lo, hi)) in sizes.iter().zip(&bounds) {
            prop_assert!(lo <= *b && *b <= hi);
        }
        prop_assert_eq!(&sizes, &equalize(&lines, total, &bounds));
        // Never worse than the best integer split (so never worse than the equal split, when that is
        // feasible), up to float noise.
        let got = predicted_max(&lines, &sizes);
        let best = optimum(&lines, total, &bounds);
        prop_assert!(got <= best * (1.0 + 1e-9) + 1e-12, "got {} best {}", got, best);
        let eq = equal_split(total, lines.len());
        if eq.iter().zip(&bounds).all(|(b, &(lo, hi))| lo <= *b && *b <= hi) {
            prop_assert!(got <= predicted_max(&lines, &eq) * (1.0 + 1e-9) + 1e-12);
        }
    }

    /// A rank slows down by a factor: sizes move towards the new equilibrium and settle without
    /// oscillating. When the slowdown stretches fixed and per-sample costs alike (CPU contention),
    /// they settle within 5 iterations; when only per-sample costs grow, within 12.
    #[test]
    fn step_change_converges_without_oscillation(
        alpha_scales in any::<bool>(),
        n in 2usize..9,
        slow in 0usize..8,
        factor in 1.5f64..6.0,
        b_total in 64usize..1024,
        noise_seed in any::<u64>(),
    ) {
        let slow = slow % n;
        let cfg = BalanceConfig { policy: PolicyKind::Lbbsp, ..Default::default() };
        // Shares of a handful of samples are dominated by integer rounding; keep ≥ 16 per rank.
        prop_assume!(b_total >= 16 * n);
        let mut bal = Balancer::new(&cfg, b_total, n).unwrap();
        let mut rng = lbbsp::data::rng::Rng::from_keys(&[noise_seed]);
        let per_sample = 1e-4;
        let mut history = Vec::new();
        for it in 0..60 {
            let obs: Vec<Observation> = bal
                .sizes()
                .iter()
                .enumerate()
                .map(|(r, &b)| {
                    let f = if r == slow && it >= 20 { factor } else { 1.0 };
                    // 2% multiplicative noise plus a fixed 0.2 ms overhead.
                    let noise = 1.0 + 0.02 * (rng.next_f64() * 2.0 - 1.0);
                    let alpha = if alpha_scales { 2e-4 * f } else { 2e-4 };
                    Observation::new(b, (alpha + per_sample * f * b as f64) * noise)
                })
                .collect();
            bal.observe(&obs);
            history.push(bal.sizes()[slow]);
        }
        // Equal-time share of the slow rank under the true model.
        let f = |r: usize| if r == slow { factor } else { 1.0 };
        let lines: Vec<Line> = (0..n)
            .map(|r| Line { alpha: if alpha_scales { 2e-4 * f(r) } else { 2e-4 }, beta: per_sample * f(r) })
            .collect();
        let target = equalize(&lines, b_total, bal.bounds())[slow] as f64;
        let after = &history[if alpha_scales { 25 } else { 32 }..];
        for &b in after {
            prop_assert!((b as f64 - target).abs() <= 0.15 * target + 2.0, "size {} target {} history {:?}", b, target, history);
        }
        // No oscillation: once settled, moves larger than jitter change direction at most once.
        // The split is re-planned every iteration from levels that carry a share of each
        // iteration's 2% noise, so it moves by a few samples either way (which costs no time);
        // jitter is three samples or 5% of the target.
        let jitter = (0.05 * target).max(3.0);
        let mut turns = 0;
        let mut last_dir = 0i64;
        for w in after.windows(2) {
            let step = w[1] as f64 - w[0] as f64;
            if step.abs() > jitter {
                let d = step.signum() as i64;
                if last_dir != 0 && d != last_dir { turns += 1; }
                last_dir = d;
            }
        }
        prop_assert!(turns <= 1, "oscillates: {:?}", history);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, rng_seed: RngSeed::Fixed(0x1bb5), ..ProptestConfig::default() })]

    /// The starvation seen in a CI run (2 ranks, B = 2048, rank 1 slowed 3× from iteration 30
    /// while another job installed packages on the host): rank 1's batch went 1295 … 615 307 153
    /// 76 38 19 9 4 2 and stayed at 2 for 35 iterations, its equal-time share being about 750.
    /// Reconstructed: rank 1 the faster before (its share ≈ 1295), then 3× slower; both ranks'
    /// times noisy by ±30%, with 2× spikes on one iteration in ten; a fixed cost up to 5 ms; with
    /// or without the interference signal. As on the simulator's scoreboard, no rank's batch may
    /// stay below half of its equal-time share of that iteration (by its true speed then) for
    /// more than 5 iterations in a row. The previous balancer (held outliers and confirmation)
    /// failed the cases pinned in balance_props.proptest-regressions: noise left the fast rank's
    /// line flat, and the slowed rank fell to 34 of its share of 627.
    #[test]
    fn a_slowed_rank_among_noisy_ones_is_never_starved(seed in any::<u64>(), signal in any::<bool>(), alpha_ms in 0.0f64..5.0) {
        let b_total = 2048;
        let cfg = BalanceConfig { policy: PolicyKind::Lbbsp, ..Default::default() };
        let mut bal = Balancer::new(&cfg, b_total, 2).unwrap();
        let mut rng = lbbsp::data::rng::Rng::from_keys(&[seed]);
        let mut low_run = [0usize; 2];
        for it in 0..120 {
            // This iteration's true lines: rank 0 1.7× slower per sample than rank 1 (1295 of 2048
            // to rank 1), rank 1 3× slower from iteration 30 (fixed cost included), the noise.
            let lines: Vec<Line> = (0..2)
                .map(|r| {
                    let slow = if r == 1 && it >= 30 { 3.0 } else { 1.0 };
                    let beta = if r == 0 { 1.7e-5 } else { 1e-5 * slow };
                    let spike = if rng.next_f64() < 0.1 { 2.0 } else { 1.0 };
                    let f = (1.0 + 0.3 * (2.0 * rng.next_f64() - 1.0)) * spike;
                    Line { alpha: alpha_ms * 1e-3 * if r == 1 { slow } else { 1.0 } * f, beta: beta * f }
                })
                .collect();
            let share = equalize(&lines, b_total, bal.bounds());
            for r in 0..2 {
                low_run[r] = if (bal.sizes()[r] as f64) < 0.5 * share[r] as f64 { low_run[r] + 1 } else { 0 };
                prop_assert!(low_run[r] <= 5, "rank {} starved at iteration {}: {:?} vs share {:?}", r, it, bal.sizes(), share);
            }
            // The slowdown sleeps: with the signal, the slowed rank reports a third of its core.
            let obs: Vec<Observation> = bal
                .sizes()
                .iter()
                .enumerate()
                .map(|(r, &b)| Observation {
                    batch: b,
                    compute_s: lines[r].at(b),
                    cpu_share: if signal && r == 1 && it >= 30 { 1.0 / 3.0 } else { 1.0 },
                    preemptions: 0.0,
                    frozen_s: 0.0,
                    run_share: 0.0,
                    run_s: 0.0,
                    transfer_s: 0.0,
                    balance_s: 0.0,
                })
                .collect();
            bal.observe(&obs);
            prop_assert_eq!(bal.sizes().iter().sum::<usize>(), b_total);
        }
    }
}

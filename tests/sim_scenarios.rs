//! The balancer's tight claims, on the simulator (what a real run on a shared host cannot show
//! without retries): the run of `tests/lbbsp.rs` (B = 2048, rank 1 slowed 3× from iteration 30)
//! with the cost line of mnist-mlp, 5% noise, with and without the interference signal.

use lbbsp::balance::BalanceConfig;
use lbbsp::sim::{simulate, Scenario, SimPolicy};
use lbbsp::train::metrics::IterRecord;
use std::path::Path;

fn slowed_rank(ranks: usize, signal: bool) -> Scenario {
    let text = format!(
        r#"name = "slowed-rank"
ranks = {ranks}
iterations = 80
batch_per_rank = {}
[compute]
alpha_s = 0.0005
beta_s = 1.5e-5
noise = 0.05
[[interference]]
kind = "steady"
ranks = [1]
factor = 3.0
from = 30
signal = {signal}
"#,
        2048 / ranks
    );
    Scenario::parse(&text, Path::new("slowed-rank.toml")).unwrap()
}

/// Each iteration's (lbbsp, Bayes oracle) size of rank 1: the Bayes oracle splits a steady cluster
/// by the true, noise-free lines, each rank's equal-time share.
fn sizes_of_rank_1(s: &Scenario, ranks: usize) -> Vec<(usize, usize)> {
    let (mut lb, mut or) = (Vec::new(), Vec::new());
    let mut keep = |p: SimPolicy, r: IterRecord| match p {
        SimPolicy::Lbbsp => lb.push(r.batch_sizes[1]),
        SimPolicy::BayesOracle => or.push(r.batch_sizes[1]),
        _ => {}
    };
    simulate(s, ranks, &BalanceConfig::default(), Some(&mut keep)).unwrap();
    lb.into_iter().zip(or).collect()
}

/// Within 2 iterations of the slowdown rank 1 is within 15% of its equal-time share (the Bayes
/// oracle's size for it), and stays there to the end; the iteration time is within 10% of the
/// oracle's within 3 (the first lift any rank shows is taken to last; whether it does, the next
/// iteration tells, and the split is hedged on it meanwhile); the cluster runs within 5% of the
/// Bayes oracle overall.
#[test]
fn a_slowed_rank_reaches_its_share_within_two_iterations_and_keeps_it() {
    for ranks in [2, 3] {
        for signal in [true, false] {
            let s = slowed_rank(ranks, signal);
            let sizes = sizes_of_rank_1(&s, ranks);
            let off: Vec<(usize, usize, usize)> = (32..sizes.len())
                .filter(|&t| (sizes[t].0 as f64 - sizes[t].1 as f64).abs() > 0.15 * sizes[t].1 as f64)
                .map(|t| (t, sizes[t].0, sizes[t].1))
                .collect();
            assert!(
                off.is_empty(),
                "{ranks} ranks, signal {signal}: (iteration, lbbsp, Bayes oracle) off by > 15%: {off:?}"
            );
            let r = simulate(&s, ranks, &BalanceConfig::default(), None).unwrap();
            let lb = r.get(SimPolicy::Lbbsp).unwrap();
            let vs_bayes = lb.samples_per_s / r.get(SimPolicy::BayesOracle).unwrap().samples_per_s;
            assert!(vs_bayes > 0.95 && lb.longest_starved == 0, "{ranks} ranks, signal {signal}: {lb:?}");
            assert!(lb.recovery.iter().all(|&k| k <= 3), "{ranks} ranks, signal {signal}: recovery {:?}", lb.recovery);
        }
    }
}

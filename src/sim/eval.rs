//! Evaluation that separates effects from noise: a scenario run over many seeds, each policy's
//! throughput as a ratio to bsp's, proportional-epoch's, the oracle's and the Bayes oracle's,
//! paired by seed (every policy of a seed meets the same cluster), with a bootstrap 95% interval
//! of the mean ratio.

use super::{simulate, Scenario, SimPolicy, SimResult};
use crate::balance::BalanceConfig;
use crate::data::rng::Rng;
use crate::error::Result;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Resamples of the bootstrap.
const RESAMPLES: usize = 4000;

/// A mean and its 95% interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    pub mean: f64,
    pub lo: f64,
    pub hi: f64,
}

impl Interval {
    /// The percentile bootstrap of the mean of `xs` (the 2.5% and 97.5% points of the means of
    /// resamples with replacement), seeded so that a report is reproducible. One value: no width.
    pub fn of_mean(xs: &[f64]) -> Interval {
        let n = xs.len();
        let mean = xs.iter().sum::<f64>() / n.max(1) as f64;
        if n < 2 {
            return Interval { mean, lo: mean, hi: mean };
        }
        let mut rng = Rng::from_keys(&[0xb007, n as u64]);
        let mut means: Vec<f64> =
            (0..RESAMPLES).map(|_| (0..n).map(|_| xs[rng.below(n)]).sum::<f64>() / n as f64).collect();
        means.sort_by(f64::total_cmp);
        let at = |q: f64| means[((q * RESAMPLES as f64) as usize).min(RESAMPLES - 1)];
        Interval { mean, lo: at(0.025), hi: at(0.975) }
    }

    /// Whether the whole interval lies below `other`'s.
    pub fn below(&self, other: &Interval) -> bool {
        self.hi < other.lo
    }
}

impl std::fmt::Display for Interval {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.3} [{:.3}, {:.3}]", self.mean, self.lo, self.hi)
    }
}

/// One policy over the seeds of a scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicySummary {
    pub policy: SimPolicy,
    pub vs_oracle: Interval,
    pub vs_bsp: Interval,
    pub vs_proportional: Interval,
    pub vs_bayes: Interval,
    /// The longest starvation of any seed.
    pub longest_starved: usize,
    pub reversals_per_100: f64,
}

/// Every policy over the seeds of a scenario at one size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub scenario: String,
    pub ranks: usize,
    pub seeds: usize,
    pub policies: Vec<PolicySummary>,
}

impl Summary {
    pub fn get(&self, p: SimPolicy) -> &PolicySummary {
        self.policies.iter().find(|x| x.policy == p).expect("every policy runs")
    }
}

/// `scenario` at `ranks` ranks once per seed (its own seed replaced), in parallel.
pub fn run_seeds(scenario: &Scenario, ranks: usize, cfg: &BalanceConfig, seeds: &[u64]) -> Result<Vec<SimResult>> {
    seeds.par_iter().map(|&seed| simulate(&Scenario { seed, ..scenario.clone() }, ranks, cfg, None)).collect()
}

/// Seeds `0..n` offset by a scenario's own (so that one seed is the scenario as shipped).
pub fn seeds_from(first: u64, n: usize) -> Vec<u64> {
    (0..n as u64).map(|k| first.wrapping_add(k)).collect()
}

/// The per-policy intervals of one scenario's runs (one per seed, or one per scenario of a
/// family: then `scenario` names the family).
pub fn summarise(scenario: &str, results: &[SimResult]) -> Summary {
    let rate = |r: &SimResult, p| r.get(p).expect("every policy runs").samples_per_s;
    let policies = SimPolicy::ALL
        .iter()
        .map(|&p| {
            let ratio = |q| results.iter().map(|r| rate(r, p) / rate(r, q)).collect::<Vec<_>>();
            let per = results.iter().map(|r| r.get(p).expect("every policy runs"));
            PolicySummary {
                policy: p,
                vs_oracle: Interval::of_mean(&ratio(SimPolicy::Oracle)),
                vs_bsp: Interval::of_mean(&ratio(SimPolicy::Bsp)),
                vs_proportional: Interval::of_mean(&ratio(SimPolicy::ProportionalEpoch)),
                vs_bayes: Interval::of_mean(&ratio(SimPolicy::BayesOracle)),
                longest_starved: per.clone().map(|x| x.longest_starved).max().unwrap_or(0),
                reversals_per_100: per.map(|x| x.reversals_per_100).sum::<f64>() / results.len().max(1) as f64,
            }
        })
        .collect();
    Summary {
        scenario: scenario.to_string(),
        ranks: results.first().map_or(0, |r| r.ranks),
        seeds: results.len(),
        policies,
    }
}

/// lbbsp's throughput over a baseline's (an earlier `--json` of the same runs), paired by
/// scenario, size and seed; `None` when the baseline holds none of these runs.
pub fn against_baseline(results: &[SimResult], baseline: &[SimResult]) -> Option<Interval> {
    let lb = |r: &SimResult| r.get(SimPolicy::Lbbsp).map(|x| x.samples_per_s);
    let ratios: Vec<f64> = results
        .iter()
        .filter_map(|r| {
            let old = baseline.iter().find(|b| b.scenario == r.scenario && b.ranks == r.ranks && b.seed == r.seed)?;
            Some(lb(r)? / lb(old)?)
        })
        .collect();
    (!ratios.is_empty()).then(|| Interval::of_mean(&ratios))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bootstrap_interval_covers_the_mean_and_narrows_with_more_seeds() {
        let mut rng = Rng::from_keys(&[1]);
        let draw = |n: usize, rng: &mut Rng| (0..n).map(|_| 1.0 + 0.1 * rng.normal() as f64).collect::<Vec<_>>();
        let small = Interval::of_mean(&draw(10, &mut rng));
        let large = Interval::of_mean(&draw(400, &mut rng));
        assert!(small.lo < small.mean && small.mean < small.hi, "{small}");
        assert!(large.hi - large.lo < 0.5 * (small.hi - small.lo), "{small} vs {large}");
        // The true mean 1 within the interval of 400 draws (σ/√n = 0.005: the interval is ±0.01).
        assert!(large.lo < 1.0 && 1.0 < large.hi, "{large}");
        assert_eq!(Interval::of_mean(&[2.0]), Interval { mean: 2.0, lo: 2.0, hi: 2.0 });
        assert!(Interval { mean: 1.0, lo: 0.9, hi: 0.95 }.below(&Interval { mean: 1.0, lo: 0.96, hi: 1.1 }));
    }
}

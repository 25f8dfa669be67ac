//! A family of randomised scenarios, for evaluation on cases nobody tuned for: each seed draws a
//! cluster (static speeds, cost line, noise, batch) and up to two interference processes of any
//! kind, with their rates, factors and lengths, whether the ranks' CPU shares show them, and
//! whether a random process's changes fall within iterations or at their starts.
//!
//! Two disjoint seed ranges: [`Family::Tune`] for developing the balancer, [`Family::HeldOut`] for
//! reporting only (`lbbsp simulate --family held-out`), never looked at while tuning.

use super::scenario::{Comm, CommAlgorithm, Compute, Interference, Scenario, Speeds, Targets};
use crate::data::rng::Rng;
use serde::{Deserialize, Serialize};

/// Which seeds of the family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    Tune,
    HeldOut,
}

impl Family {
    /// The `k`-th seed of the family.
    pub fn seed(self, k: usize) -> u64 {
        match self {
            Family::Tune => k as u64,
            Family::HeldOut => (1 << 40) + k as u64,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Family::Tune => "tune",
            Family::HeldOut => "held-out",
        }
    }
}

/// Iterations of a generated scenario.
pub const ITERATIONS: usize = 600;

/// A draw log-uniform in `[lo, hi]` from the uniform draws `u`.
fn log_u(u: &mut dyn FnMut(f64, f64) -> f64, lo: f64, hi: f64) -> f64 {
    (u(lo.ln(), hi.ln())).exp()
}

/// One interference process of any kind, drawn from `u`: its ranks, factor, kind and the kind's
/// rates or lengths; `within` for a chain's or an episode's changes.
fn process(u: &mut dyn FnMut(f64, f64) -> f64, within: bool) -> Interference {
    let on = Targets {
        fraction: (u(0.0, 1.0) < 0.7).then(|| log_u(u, 0.02, 1.0)),
        count: None,
        ranks: Vec::new(),
        signal: (u(0.0, 1.0) < 0.25).then_some(false),
    };
    let factor = log_u(u, 1.15, 4.0);
    match (u(0.0, 7.0) as usize).min(6) {
        0 => {
            let from = u(0.0, 0.8 * ITERATIONS as f64) as usize;
            let until = (u(0.0, 1.0) < 0.5).then(|| from + log_u(u, 5.0, ITERATIONS as f64) as usize);
            Interference::Steady { on, factor, from, until }
        }
        1 => Interference::Square {
            on,
            factor,
            on_iters: log_u(u, 1.0, 120.0) as usize,
            off_iters: log_u(u, 1.0, 120.0) as usize,
            from: u(0.0, 100.0) as usize,
        },
        2 => Interference::Markov { on, factor, p_on: log_u(u, 0.002, 0.5), p_off: log_u(u, 0.02, 1.0), within },
        3 => {
            let low = log_u(u, 1.1, 2.0);
            Interference::FailSlow {
                on,
                rate: log_u(u, 1e-4, 2e-2),
                mean_iters: log_u(u, 2.0, 500.0),
                factor_low: low,
                factor_high: low * log_u(u, 1.0, 3.0),
                within,
            }
        }
        4 => {
            let period_s = log_u(u, 1e-3, 0.1);
            Interference::Quota { on: Targets { signal: None, ..on }, quota_s: period_s * u(0.2, 0.8), period_s }
        }
        _ => Interference::Hog {
            on: Targets { signal: None, ..on },
            slice_s: log_u(u, 5e-4, 1.2e-2),
            on_s: None,
            off_s: None,
        },
    }
}

/// The scenario of `seed`, at `ranks` ranks.
pub fn generate(seed: u64, ranks: usize) -> Scenario {
    let mut g = Rng::from_keys(&[0xfa_0017, seed]);
    let mut u = |lo: f64, hi: f64| lo + (hi - lo) * g.next_f64();
    let speeds = match u(0.0, 1.0) {
        x if x < 0.5 => Speeds::Equal,
        x if x < 0.8 => Speeds::Uniform { low: u(0.5, 1.0), high: u(1.0, 1.6) },
        _ => Speeds::TwoClass { fraction: u(0.05, 0.5), factor: u(1.2, 3.0) },
    };
    let compute = Compute {
        alpha_s: log_u(&mut u, 1e-4, 3e-3),
        beta_s: log_u(&mut u, 3e-6, 6e-5),
        noise: u(0.005, 0.08),
        noise_memory: 0.0,
        freeze_cost_s: 0.0,
        speeds,
    };
    let batch_per_rank = [32, 64, 128, 256, 1024][(u(0.0, 5.0) as usize).min(4)];
    let processes = (u(0.0, 3.0) as usize).min(2);
    let mut interference = Vec::new();
    // Whether a chain's or an episode's changes fall within iterations: from draws of their own,
    // so that the rest of a seed's scenario is what it was before they were drawn.
    let mut w = Rng::from_keys(&[0xfa_0017, seed, 0x717]);
    for _ in 0..processes {
        let within = w.next_f64() < 0.5;
        interference.push(process(&mut u, within));
    }
    Scenario {
        name: format!("family-{seed}"),
        description: String::new(),
        ranks,
        iterations: ITERATIONS,
        batch_per_rank,
        epoch_iters: 100,
        seed,
        compute,
        comm: Comm {
            algorithm: if u(0.0, 1.0) < 0.5 { CommAlgorithm::Ring } else { CommAlgorithm::Tree },
            ..Comm::default()
        },
        interference,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn generated_scenarios_are_valid_and_reproducible() {
        for k in 0..200 {
            let s = generate(Family::HeldOut.seed(k), 16);
            assert_eq!(s, generate(Family::HeldOut.seed(k), 16));
            let text = toml::to_string(&s).unwrap();
            let back = Scenario::parse(&text, Path::new("family.toml")).unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert_eq!(back.interference.len(), s.interference.len());
        }
        assert_ne!(generate(Family::Tune.seed(0), 16), generate(Family::HeldOut.seed(0), 16));
    }
}

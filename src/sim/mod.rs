//! The cluster simulator: the balancing policies on a simulated cluster of up to tens of
//! thousands of ranks, driven by a [`Scenario`] (`lbbsp simulate`).
//!
//! Every iteration, each policy splits the global batch; each rank's compute time follows from
//! its true cost line at that iteration (see [`scenario`]) and its noise draw; the iteration lasts
//! as long as the slowest rank plus the allreduce's α-β cost, and the policy then observes every
//! rank's (size, time), as the trainer's ranks do. `lbbsp` and `proportional-epoch` are the
//! trainer's own [`Balancer`]; the `oracle` splits by the true lines of the iteration itself, the
//! `late-oracle` by those of the iteration before (the best any balancer can do from timings
//! alone: it learns each change exactly, one iteration late). All policies run in lock step on the
//! same cluster, so they see the same slowdowns and the same noise.

pub mod calibrate;
pub mod eval;
pub mod family;
pub mod reversals;
pub mod scenario;

pub use scenario::{Cluster, Scenario};

use crate::balance::model::off_cpu_s;
use crate::balance::{equalize, equalize_by, BalanceConfig, Balancer, Cost, Line, Observation, Policy, PolicyKind};
use crate::error::Result;
use crate::shard::equal_split;
use crate::train::metrics::IterRecord;
pub use reversals::Reversals;
use scenario::Slices;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// A policy of the simulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SimPolicy {
    Bsp,
    Lbbsp,
    ProportionalEpoch,
    /// Splits by the true speeds of the iteration it splits.
    Oracle,
    /// Splits by the true speeds of the iteration before.
    LateOracle,
    /// Knows each process's law and each rank's state one iteration late, and splits for the
    /// smallest expected slowest time among its candidates: the reference of a policy that learns
    /// from timings.
    BayesOracle,
}

impl SimPolicy {
    pub const ALL: [SimPolicy; 6] = [
        SimPolicy::Bsp,
        SimPolicy::ProportionalEpoch,
        SimPolicy::Lbbsp,
        SimPolicy::LateOracle,
        SimPolicy::BayesOracle,
        SimPolicy::Oracle,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SimPolicy::Bsp => "bsp",
            SimPolicy::Lbbsp => "lbbsp",
            SimPolicy::ProportionalEpoch => "proportional-epoch",
            SimPolicy::Oracle => "oracle",
            SimPolicy::LateOracle => "late-oracle",
            SimPolicy::BayesOracle => "bayes-oracle",
        }
    }
}

/// One policy's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyResult {
    pub policy: SimPolicy,
    /// Samples per second: `B · iterations / Σ iteration time`.
    pub samples_per_s: f64,
    pub mean_iter_s: f64,
    pub p99_iter_s: f64,
    /// Σ over ranks and iterations of the time a rank waited for the slowest, over `N · Σ compute
    /// span` (communication excluded).
    pub idle_fraction: f64,
    /// Throughput over the oracle's.
    pub vs_oracle: f64,
    /// Iterations after each isolated change of speed (one followed by at least 10 unchanged
    /// iterations) until the iteration time is within 10% of the oracle's.
    pub recovery: Vec<usize>,
    /// The longest run of iterations in which some rank was starved: its compute at its batch took
    /// less than half of its compute at its equal-time share, both by its true, noise-free line
    /// (the share by those lines; under slices, the least of its share in the iteration, by where
    /// the clock falls in the windows, and its share at the average speed).
    pub longest_starved: usize,
    /// How much the split oscillated: the worst rank's reversals per 100 iterations
    /// ([`Reversals`]).
    #[serde(default)]
    pub reversals_per_100: f64,
}

/// A simulation's results, one per policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimResult {
    pub scenario: String,
    #[serde(default)]
    pub seed: u64,
    pub ranks: usize,
    pub iterations: usize,
    pub global_batch: usize,
    /// Seconds of one allreduce by the scenario's cost model.
    pub comm_s: f64,
    pub policies: Vec<PolicyResult>,
}

impl SimResult {
    pub fn get(&self, p: SimPolicy) -> Option<&PolicyResult> {
        self.policies.iter().find(|r| r.policy == p)
    }
}

/// A rank's true cost in one iteration, at a policy's clock: its line (CPU seconds) and, under a
/// slice-granular process, the wall time that CPU takes from `start`.
#[derive(Debug, Clone, Copy)]
struct Timed {
    line: Line,
    slices: Option<Slices>,
    start: f64,
}

impl Cost for Timed {
    fn at_f(&self, b: f64) -> f64 {
        let cpu = self.line.at_f(b);
        self.slices.map_or(cpu, |s| s.wall(self.start, cpu))
    }

    fn size_at(&self, t: f64) -> f64 {
        self.line.size_at(self.slices.map_or(t, |s| s.work_within(self.start, t)))
    }

    fn rate_at(&self, t: f64) -> f64 {
        match self.slices {
            Some(s) if !s.running(self.start + t) => 0.0,
            _ => 1.0 / self.line.beta,
        }
    }
}

/// What a policy keeps between iterations.
struct Track {
    policy: SimPolicy,
    split: Box<dyn Split>,
    /// The split this iteration runs: the policy's own moves on once it has observed the iteration.
    sizes: Vec<usize>,
    times: Vec<f64>,
    /// Each rank's wall seconds of compute, and their stretch over its CPU seconds (1 but under a
    /// slice-granular process).
    compute: Vec<f64>,
    stretch: Vec<f64>,
    /// Each rank's CPU seconds of compute: its work and the refills of its freezes
    /// (`compute.freeze_cost_s`), which its CPU clock counts.
    spent: Vec<f64>,
    /// Each rank's freezes in its compute (0 but under a slice-granular process), and its CPU
    /// share over the whole iteration before (0, no measure, but under one).
    freezes: Vec<f64>,
    run_share: Vec<f64>,
    /// The seconds of the iteration those shares are over.
    run_s: f64,
    /// The wall clock at the start of the iteration: slice-granular processes act on it.
    clock: f64,
    idle: f64,
    span: f64,
    starved_run: Vec<usize>,
    longest_starved: usize,
    reversals: Reversals,
}

/// What every track sees of one iteration of the cluster.
struct Iteration<'a> {
    lines: &'a [Line],
    noise: &'a [f64],
    slices: &'a [Option<Slices>],
}

/// What the oracles know of an iteration.
struct Known<'a> {
    t: usize,
    /// The clairvoyant oracle's split.
    oracle: &'a [usize],
    /// The true lines of the iteration and of the one before, and the static ones.
    lines: &'a [Line],
    before: &'a [Line],
    base: &'a [Line],
    /// Each rank's law of its slowdown ([`Cluster::predict`]) and the noise's deviation.
    atoms: &'a [Vec<(f64, f64)>],
    sigma: f64,
}

/// Runs every policy of [`SimPolicy::ALL`] on `scenario` at `ranks` ranks, the balancing policies
/// with `cfg` (its `policy` is set per run). `record`, when given, receives every iteration's
/// record of every policy (for `lbbsp plot`).
pub fn simulate(
    scenario: &Scenario,
    ranks: usize,
    cfg: &BalanceConfig,
    mut record: Option<&mut dyn FnMut(SimPolicy, IterRecord)>,
) -> Result<SimResult> {
    let n = ranks;
    let big_b = scenario.global_batch(n);
    let mut cluster = Cluster::new(scenario, n)?;
    let bounds = cfg.bounds(big_b, n)?;
    let comm_s = scenario.comm.seconds(n);
    let transfer = scenario.comm.transfer_s.unwrap_or(comm_s);
    let mut tracks: Vec<Track> =
        SimPolicy::ALL.iter().map(|&p| Track::new(p, cfg, big_b, n, scenario.iterations)).collect::<Result<_>>()?;
    let (alpha, beta, sigma) = (scenario.compute.alpha_s, scenario.compute.beta_s, scenario.compute.noise);
    let base: Vec<Line> = cluster.speeds.iter().map(|s| Line { alpha, beta: s * beta }).collect();
    let mut lines = base.clone();
    let mut before: Vec<Line> = Vec::new();
    let mut changed = Vec::with_capacity(scenario.iterations);
    let mut noise = vec![1.0; n];
    let memory = scenario.compute.noise_memory;
    let mut drift = vec![0.0f64; n];
    let mut obs = vec![Observation::new(0, 0.0); n];
    let mut share = vec![1.0; n];
    let mut atoms = vec![Vec::new(); n];
    let slices = cluster.slices.clone();
    for t in 0..scenario.iterations {
        cluster.predict(t, &mut atoms);
        cluster.step(t);
        for (i, l) in lines.iter_mut().enumerate() {
            *l = base[i].scaled(cluster.factor[i]);
            let z = cluster.noise(i, t);
            drift[i] = if t == 0 { z } else { remembered(drift[i], z, memory) };
            noise[i] = (1.0 + sigma * drift[i]).max(0.05);
            share[i] = cluster.share(i);
        }
        changed.push(t > 0 && lines != before);
        let it = Iteration { lines: &lines, noise: &noise, slices: &slices };
        let oracle_clock = tracks.iter().find(|tr| tr.policy == SimPolicy::Oracle).map_or(0.0, |tr| tr.clock);
        // The oracle knows the iteration's noise too: it is the bound of any split.
        let noisy: Vec<Line> = lines.iter().zip(&noise).map(|(l, &e)| l.scaled(e)).collect();
        let oracle = equalize_by(&timed(&noisy, &slices, oracle_clock), big_b, &bounds);
        let average = average_shares(&lines, &slices, big_b, &bounds);
        let cpu_share: Vec<f64> = if record.is_some() { share.clone() } else { Vec::new() };
        let known = Known { t, oracle: &oracle, lines: &lines, before: &before, base: &base, atoms: &atoms, sigma };
        for tr in &mut tracks {
            tr.choose(&known, &slices, &bounds);
            let share_of_time = starvation_shares(&lines, &slices, &average, tr.clock, &bounds);
            let slowest = tr.compute(&it, &share_of_time);
            let collective = collective_s(&slices, tr.clock + slowest, comm_s);
            tr.reversals.record(&tr.sizes);
            tr.times.push(slowest + collective);
            let took = slowest + collective;
            let whole = run_shares(&slices, &share, tr.clock, took);
            tr.clock += took;
            let seen = tr.reported(&cluster.measured);
            tr.observe(&mut obs, &share, &seen, transfer, (t + 1) % scenario.epoch_iters == 0);
            (tr.run_share, tr.run_s) = (whole, took);
            if let Some(rec) = record.as_mut() {
                let mut r = IterRecord::timed(t, tr.sizes.clone(), tr.compute.clone());
                r.iter_s = slowest + collective;
                r.comm_s = vec![collective; n];
                r.cpu_share = cpu_share.iter().enumerate().map(|(i, &s)| tr.shown(i, s)).collect();
                r.preemptions = seen.iter().map(|s| s[0]).collect();
                r.frozen_s = tr.compute.iter().zip(&r.cpu_share).map(|(&c, &s)| off_cpu_s(c, s)).collect();
                r.run_share = seen.iter().map(|s| s[1]).collect();
                rec(tr.policy, r);
            }
        }
        before.clone_from(&lines);
    }
    Ok(summarise(scenario, n, big_b, comm_s, &tracks, &changed))
}

/// The next draw of a noise of correlation `memory` from one iteration to the next (a first-order
/// autoregression): `prev` the last draw, `z` a fresh standard normal; the draws stay standard
/// normal, and with no memory the draw is `z` itself.
fn remembered(prev: f64, z: f64, memory: f64) -> f64 {
    memory * prev + (1.0 - memory * memory).sqrt() * z
}

/// Each rank's CPU share over an iteration of `took` seconds from clock `start`: under slices, its
/// windows' share times what its other processes leave it (`share`, as a process's CPU over wall
/// seconds counts both), else 0 (no measure).
fn run_shares(slices: &[Option<Slices>], share: &[f64], start: f64, took: f64) -> Vec<f64> {
    let each = slices.iter().zip(share);
    each.map(|(s, &share)| s.map_or(0.0, |s| share * s.cpu_within(start, took) / took)).collect()
}

/// The allreduce's wall seconds from clock `start`: `comm_s`, or longer where a rank under slices
/// is frozen. Every rank takes part in it, and a waiting rank spends its CPU (it busy-polls), so a
/// quota or a hog freezes it as readily there as in its compute: a split that lets the rank finish
/// before its freeze only moves the freeze into the collective.
fn collective_s(slices: &[Option<Slices>], start: f64, comm_s: f64) -> f64 {
    let cpu = comm_s.max(1e-6);
    slices.iter().flatten().map(|s| s.wall(start, cpu)).fold(comm_s, f64::max)
}

/// Each rank's cost at a policy's clock.
fn timed(lines: &[Line], slices: &[Option<Slices>], start: f64) -> Vec<Timed> {
    lines.iter().zip(slices).map(|(&line, &slices)| Timed { line, slices, start }).collect()
}

/// Every rank's equal-time share by its true, noise-free line, a rank under slices at its average
/// speed (its share of what it sustains over its windows).
fn average_shares(lines: &[Line], slices: &[Option<Slices>], total: usize, bounds: &[(usize, usize)]) -> Vec<usize> {
    let average: Vec<Line> =
        lines.iter().zip(slices).map(|(l, s)| s.map_or(*l, |s| l.scaled(s.average_stretch()))).collect();
    equalize(&average, total, bounds)
}

/// The equal-time shares starvation is measured against ([`PolicyResult::longest_starved`]). Under
/// slices a rank has two, and each alone counts an optimal plan of the other kind as starving: at
/// the policy's own `clock`, where a rank a slice freezes for the whole iteration has almost
/// nothing, a plan that spreads a long quota period's CPU over its iterations keeps the rank at
/// its `average` share while its windows allow it more; at the average speed, the Bayes oracle's
/// almost nothing to a rank about to freeze would starve it. So a rank's share is the least.
fn starvation_shares<'a>(
    lines: &[Line],
    slices: &[Option<Slices>],
    average: &'a [usize],
    clock: f64,
    bounds: &[(usize, usize)],
) -> Cow<'a, [usize]> {
    if slices.iter().all(Option::is_none) {
        return Cow::Borrowed(average);
    }
    let now = equalize_by(&timed(lines, slices, clock), average.iter().sum(), bounds);
    Cow::Owned(now.iter().zip(average).map(|(&a, &b)| a.min(b)).collect())
}

/// Whether a rank of true line `line` is starved at `size` against its equal-time `share`: in time,
/// since where a fixed cost dominates, a share of a few samples moves the rank's time by
/// microseconds, and half of it in samples is no shortfall of work.
fn starved(line: &Line, size: usize, share: usize) -> bool {
    line.at(size) < 0.5 * line.at(share)
}

/// What the Bayes oracle knows of the next iteration.
struct Law<'a> {
    /// Per rank, the probability and factor of each slowdown its processes may bring.
    atoms: &'a [Vec<(f64, f64)>],
    /// The noise's relative deviation.
    sigma: f64,
    /// Each rank's stretch of wall over CPU time in the iteration before (slice-granular processes).
    stretch: &'a [f64],
}

/// The factor a rank is planned at, from its law's atoms.
type Plan<'a> = &'a dyn Fn(&[(f64, f64)]) -> f64;

/// How the Bayes oracle plans a rank under a slice-granular process.
#[derive(Clone, Copy, PartialEq)]
enum Sliced {
    /// Its windows as they are.
    Exact,
    /// At its average speed, away from the edges of its windows.
    Average,
    /// Stretched as in the iteration before.
    Last,
}

/// The Bayes oracle's split: each rank's slowdown follows its law ([`Law`]: per rank, probability
/// and factor of its `base` cost), and the split minimises the expected slowest time over a family
/// of candidates: every rank planned at the same quantile of its own law (the median up to the
/// worst case), or at its mean; under slice-granular processes, each with those ranks planned at
/// their windows, at their average speed, or stretched as last time ([`Sliced`]). One quantile for
/// all is the hedge against the onsets to come. The noise, alike for every split of smooth costs,
/// counts where a window's edge makes it matter: at the ranks under slices.
fn bayes_split(base: &[Timed], law: &Law, total: usize, bounds: &[(usize, usize)]) -> Vec<usize> {
    let sigma = law.sigma;
    let sliced = base.iter().any(|c| c.slices.is_some());
    if !sliced && law.atoms.iter().all(|a| a.len() == 1) {
        let known: Vec<Timed> =
            base.iter().zip(law.atoms).map(|(c, a)| Timed { line: c.line.scaled(a[0].1), ..*c }).collect();
        return equalize_by(&known, total, bounds);
    }
    // Each rank's atoms by factor once, for the quantiles of every plan.
    let sorted: Vec<Vec<(f64, f64)>> = law
        .atoms
        .iter()
        .map(|a| {
            let mut a = a.clone();
            a.sort_by(|x, y| x.1.total_cmp(&y.1));
            a
        })
        .collect();
    let atoms = &sorted[..];
    let scaled = |f: Plan, how: Sliced| -> Vec<Timed> {
        base.iter()
            .zip(atoms)
            .zip(law.stretch)
            .map(|((c, a), &last)| match (c.slices, how) {
                (Some(s), Sliced::Average) => {
                    Timed { line: c.line.scaled(f(a) * s.average_stretch()), slices: None, ..*c }
                }
                (Some(_), Sliced::Last) => Timed { line: c.line.scaled(f(a) * last), slices: None, ..*c },
                _ => Timed { line: c.line.scaled(f(a)), ..*c },
            })
            .collect()
    };
    let mut candidates: Vec<Vec<usize>> = Vec::new();
    let mean = |a: &[(f64, f64)]| a.iter().map(|x| x.0 * x.1).sum::<f64>();
    let quantiles: [Plan; 7] = [
        &mean,
        &|a| quantile(a, 0.5),
        &|a| quantile(a, 0.8),
        &|a| quantile(a, 0.9),
        &|a| quantile(a, 0.95),
        &|a| quantile(a, 0.99),
        &|a| quantile(a, 1.0),
    ];
    for f in quantiles {
        for how in [Sliced::Exact, Sliced::Average, Sliced::Last].into_iter().take(if sliced { 3 } else { 1 }) {
            let sizes = equalize_by(&scaled(f, how), total, bounds);
            if !candidates.contains(&sizes) {
                candidates.push(sizes);
            }
        }
    }
    // Three-point Gauss–Hermite quadrature of the noise at the ranks under slices.
    let spread = [(1.0 / 6.0, 1.0 - 3f64.sqrt() * sigma), (2.0 / 3.0, 1.0), (1.0 / 6.0, 1.0 + 3f64.sqrt() * sigma)];
    let noisy: Vec<Vec<(f64, f64)>> = base
        .iter()
        .zip(atoms)
        .map(|(c, a)| match c.slices {
            Some(_) if sigma > 0.0 => {
                a.iter().flat_map(|&(p, f)| spread.iter().map(move |&(q, e)| (p * q, f * e))).collect()
            }
            _ => a.clone(),
        })
        .collect();
    let mut best = (f64::INFINITY, 0);
    for (k, sizes) in candidates.iter().enumerate() {
        let e = expected_max(base, &noisy, sizes);
        if e < best.0 {
            best = (e, k);
        }
    }
    candidates.swap_remove(best.1)
}

/// The smallest factor whose probability of not being exceeded is at least `q`, of atoms sorted by
/// factor.
fn quantile(sorted: &[(f64, f64)], q: f64) -> f64 {
    let mut p = 0.0;
    for &(w, f) in sorted {
        p += w;
        if p >= q - 1e-12 {
            return f;
        }
    }
    sorted.last().map_or(1.0, |a| a.1)
}

/// `E[max_i t_i]` for independent ranks whose times are two-or-more-valued: `Σ_k T_k·(P(max ≤
/// T_k) − P(max ≤ T_{k−1}))` over the sorted atoms, `P(max ≤ T) = Π_i F_i(T)`.
fn expected_max(base: &[Timed], atoms: &[Vec<(f64, f64)>], sizes: &[usize]) -> f64 {
    let mut points: Vec<(f64, usize, f64)> = Vec::with_capacity(2 * base.len());
    for (i, (c, a)) in base.iter().zip(atoms).enumerate() {
        for &(p, f) in a {
            points.push((Timed { line: c.line.scaled(f), ..*c }.at_f(sizes[i] as f64), i, p));
        }
    }
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut cdf = vec![0.0f64; base.len()];
    let (mut zeros, mut log_sum, mut before, mut e) = (base.len(), 0.0f64, 0.0f64, 0.0f64);
    for &(t, i, p) in &points {
        let old = cdf[i];
        let new = (old + p).min(1.0);
        if old > 0.0 {
            log_sum -= old.ln();
        } else {
            zeros -= 1;
        }
        log_sum += new.ln();
        cdf[i] = new;
        let now = if zeros == 0 { log_sum.exp() } else { 0.0 };
        e += t * (now - before);
        before = now;
    }
    e
}

/// What an oracle is told of the iteration it splits, and of the run so far at its own clock.
struct Truth<'a> {
    known: &'a Known<'a>,
    slices: &'a [Option<Slices>],
    bounds: &'a [(usize, usize)],
    clock: f64,
    /// Each rank's stretch of wall over CPU time in the iteration before.
    stretch: &'a [f64],
}

/// A policy of the simulator: the trainer's [`Policy`], which learns from the gathered
/// observations, or an oracle, which is told the truth before it splits.
trait Split: Policy {
    /// Whether it learns from observations (an oracle ignores them).
    fn learns(&self) -> bool {
        true
    }
    /// Takes what it is told of the iteration before it splits it (nothing for a learning policy).
    fn foresee(&mut self, _truth: &Truth) {}
}

/// bsp, proportional-epoch and lbbsp: the trainer's balancer (bsp's split never moves, so it
/// is fed nothing).
impl Split for Balancer {
    fn learns(&self) -> bool {
        self.config().policy != PolicyKind::Bsp
    }
}

/// What an oracle knows when it splits an iteration (see [`SimPolicy`]).
#[derive(Debug, Clone, Copy)]
enum Knows {
    /// The true speeds of the iteration it splits.
    Now,
    /// The speeds a timing of the iteration before shows.
    Before,
    /// Each process's law and each rank's state one iteration late.
    Laws,
}

/// An oracle: the split of what it is told, learning nothing from the observations.
struct Oracle {
    knows: Knows,
    sizes: Vec<usize>,
}

impl Policy for Oracle {
    fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    fn observe(&mut self, _obs: &[Observation]) {}
}

impl Split for Oracle {
    fn learns(&self) -> bool {
        false
    }

    fn foresee(&mut self, truth: &Truth) {
        let (k, total) = (truth.known, self.sizes.iter().sum());
        match self.knows {
            Knows::Now => self.sizes.copy_from_slice(k.oracle),
            Knows::Before => {
                // The lines of the iteration before, stretched as that iteration's wall times were.
                let seen: Vec<Line> = if k.t == 0 {
                    k.lines.to_vec()
                } else {
                    k.before.iter().zip(truth.stretch).map(|(l, &s)| l.scaled(s)).collect()
                };
                self.sizes = equalize(&seen, total, truth.bounds);
            }
            Knows::Laws => {
                let law = Law { atoms: k.atoms, sigma: k.sigma, stretch: truth.stretch };
                self.sizes = bayes_split(&timed(k.base, truth.slices, truth.clock), &law, total, truth.bounds);
            }
        }
    }
}

impl Track {
    fn new(policy: SimPolicy, cfg: &BalanceConfig, big_b: usize, n: usize, iterations: usize) -> Result<Track> {
        let learned = |kind| Balancer::new(&BalanceConfig { policy: kind, ..cfg.clone() }, big_b, n);
        let told = |knows| Box::new(Oracle { knows, sizes: equal_split(big_b, n) });
        let split: Box<dyn Split> = match policy {
            SimPolicy::Bsp => Box::new(learned(PolicyKind::Bsp)?),
            SimPolicy::Lbbsp => Box::new(learned(PolicyKind::Lbbsp)?),
            SimPolicy::ProportionalEpoch => Box::new(learned(PolicyKind::ProportionalEpoch)?),
            SimPolicy::Oracle => told(Knows::Now),
            SimPolicy::LateOracle => told(Knows::Before),
            SimPolicy::BayesOracle => told(Knows::Laws),
        };
        Ok(Track {
            policy,
            split,
            sizes: equal_split(big_b, n),
            times: Vec::with_capacity(iterations),
            compute: vec![0.0; n],
            stretch: vec![1.0; n],
            spent: vec![0.0; n],
            freezes: vec![0.0; n],
            run_share: vec![0.0; n],
            run_s: 0.0,
            clock: 0.0,
            idle: 0.0,
            span: 0.0,
            starved_run: vec![0; n],
            longest_starved: 0,
            reversals: Reversals::new(big_b, n),
        })
    }

    /// Sets the split of the iteration: the policy's own, after an oracle is told what it knows.
    fn choose(&mut self, known: &Known, slices: &[Option<Slices>], bounds: &[(usize, usize)]) {
        let truth = Truth { known, slices, bounds, clock: self.clock, stretch: &self.stretch };
        self.split.foresee(&truth);
        self.sizes.copy_from_slice(self.split.sizes());
    }

    /// Every rank's compute time at the current sizes, the idle and starvation accounting against
    /// the equal-time split; returns the slowest time.
    fn compute(&mut self, it: &Iteration, equal_time: &[usize]) -> f64 {
        let mut slowest = 0.0f64;
        for (i, &share) in equal_time.iter().enumerate() {
            let cpu = it.lines[i].at(self.sizes[i]) * it.noise[i];
            // A rank frozen when the collective returns starts its compute when it next runs: a
            // frozen process cannot read its clock, so the wait is its collective's, and its
            // compute, the freezes counted in it, and its stretch begin after it.
            let (wait, compute, freezes) = match it.slices[i] {
                Some(s) => {
                    let wait = s.until_running(self.clock);
                    let compute = s.wall(self.clock + wait, cpu);
                    (wait, compute, s.freezes(self.clock + wait, compute))
                }
                None => (0.0, cpu, 0.0),
            };
            let refill = it.slices[i].map_or(0.0, |s| s.refill_s * freezes);
            (self.compute[i], self.freezes[i], self.spent[i]) = (compute, freezes, cpu + refill);
            self.stretch[i] = if cpu > 0.0 { self.compute[i] / cpu } else { 1.0 };
            slowest = slowest.max(wait + self.compute[i]);
            let starved = starved(&it.lines[i], self.sizes[i], share);
            self.starved_run[i] = if starved { self.starved_run[i] + 1 } else { 0 };
            self.longest_starved = self.longest_starved.max(self.starved_run[i]);
        }
        self.idle += self.compute.iter().map(|c| slowest - c).sum::<f64>();
        self.span += slowest * it.lines.len() as f64;
        slowest
    }

    /// The CPU share rank `i` reports of its compute, the others' processes leaving it `share`: its
    /// CPU seconds (refills included) over its wall seconds.
    fn shown(&self, i: usize, share: f64) -> f64 {
        share / if self.spent[i] > 0.0 { self.compute[i] / self.spent[i] } else { 1.0 }
    }

    /// What each rank reports of its freezes, its preemptions and its share over the iteration
    /// before: its slices', else a measured run's.
    fn reported(&self, measured: &[[f64; 3]]) -> Vec<[f64; 3]> {
        let pick = |own: f64, run: f64| if own > 0.0 { own } else { run };
        // A measured share is over the measured iteration's seconds where recorded.
        let seconds = |i: usize, m: &[f64; 3]| if self.run_share[i] > 0.0 || m[2] <= 0.0 { self.run_s } else { m[2] };
        let each = measured.iter().enumerate();
        each.map(|(i, m)| [pick(self.freezes[i], m[0]), pick(self.run_share[i], m[1]), seconds(i, m)]).collect()
    }

    /// A balancing policy observes the iteration (and the end of an epoch): each rank's wall
    /// time, and the CPU share it had (what the processes left it, less the frozen time).
    fn observe(&mut self, obs: &mut [Observation], share: &[f64], seen: &[[f64; 3]], transfer: f64, epoch_end: bool) {
        if !self.split.learns() {
            return;
        }
        for (i, o) in obs.iter_mut().enumerate() {
            *o = Observation {
                batch: self.sizes[i],
                compute_s: self.compute[i],
                cpu_share: self.shown(i, share[i]),
                preemptions: seen[i][0],
                // Every second a simulated rank is off the CPU, a process took.
                frozen_s: off_cpu_s(self.compute[i], self.shown(i, share[i])),
                run_share: seen[i][1],
                run_s: seen[i][2],
                transfer_s: transfer,
                // A simulated decision takes no time.
                balance_s: 0.0,
            };
        }
        self.split.observe(obs);
        if epoch_end {
            self.split.end_epoch();
        }
    }
}

/// The per-policy figures of finished tracks.
fn summarise(
    scenario: &Scenario,
    n: usize,
    big_b: usize,
    comm_s: f64,
    tracks: &[Track],
    changed: &[bool],
) -> SimResult {
    let oracle_times = &tracks.iter().find(|t| t.policy == SimPolicy::Oracle).expect("the oracle runs").times;
    let rate = |times: &[f64]| big_b as f64 * times.len() as f64 / times.iter().sum::<f64>();
    let oracle_rate = rate(oracle_times);
    let events = isolated_changes(changed, 10);
    let policies = tracks
        .iter()
        .map(|tr| {
            let mut sorted = tr.times.clone();
            sorted.sort_by(f64::total_cmp);
            let p99 = sorted[((sorted.len() as f64 * 0.99).ceil() as usize).clamp(1, sorted.len()) - 1];
            let recovery = events
                .iter()
                .map(|&(t, gap)| (0..gap).find(|&k| tr.times[t + k] <= 1.1 * oracle_times[t + k]).unwrap_or(gap))
                .collect();
            PolicyResult {
                policy: tr.policy,
                samples_per_s: rate(&tr.times),
                mean_iter_s: tr.times.iter().sum::<f64>() / tr.times.len() as f64,
                p99_iter_s: p99,
                idle_fraction: if tr.span > 0.0 { tr.idle / tr.span } else { 0.0 },
                vs_oracle: rate(&tr.times) / oracle_rate,
                recovery,
                longest_starved: tr.longest_starved,
                reversals_per_100: tr.reversals.per_100(),
            }
        })
        .collect();
    SimResult {
        scenario: scenario.name.clone(),
        seed: scenario.seed,
        ranks: n,
        iterations: scenario.iterations,
        global_batch: big_b,
        comm_s,
        policies,
    }
}

/// Iterations at which the speeds changed and then held for at least `min_gap` iterations, with
/// the number of iterations until the next change (or the end).
fn isolated_changes(changed: &[bool], min_gap: usize) -> Vec<(usize, usize)> {
    let at: Vec<usize> = (0..changed.len()).filter(|&t| changed[t]).collect();
    at.iter()
        .enumerate()
        .map(|(k, &t)| (t, at.get(k + 1).copied().unwrap_or(changed.len()) - t))
        .filter(|&(_, gap)| gap >= min_gap)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::scenario::{Comm, CommAlgorithm};
    use std::path::Path;

    /// Two ranks, no noise, no fixed cost, rank 0 three times slower, free communication.
    fn two_ranks(extra: &str) -> Scenario {
        let text = format!(
            r#"name = "two"
ranks = 2
iterations = 40
batch_per_rank = 128
[compute]
alpha_s = 0.0
beta_s = 0.001
speeds = {{ kind = "two-class", fraction = 0.5, factor = 3.0 }}
[comm]
latency_s = 0.0
bytes = 0.0
{extra}"#
        );
        Scenario::parse(&text, Path::new("two.toml")).unwrap()
    }

    #[test]
    fn remembered_noise_keeps_its_deviation_and_has_its_memory() {
        let mut rng = crate::data::rng::Rng::from_keys(&[7]);
        let z: Vec<f64> = (0..40_000).map(|_| rng.normal() as f64).collect();
        assert_eq!(remembered(0.7, z[0], 0.0), z[0]);
        for memory in [0.3, 0.65, 0.9] {
            let mut x = vec![z[0]];
            for &z in &z[1..] {
                x.push(remembered(x[x.len() - 1], z, memory));
            }
            let var = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
            let lag = x.windows(2).map(|w| w[0] * w[1]).sum::<f64>() / (x.len() - 1) as f64 / var;
            assert!((var.sqrt() - 1.0).abs() < 0.05 && (lag - memory).abs() < 0.03, "{memory}: {var} {lag}");
        }
    }

    #[test]
    fn hand_computed_two_rank_cluster() {
        let r = simulate(&two_ranks(""), 2, &BalanceConfig::default(), None).unwrap();
        let (bsp, oracle) = (r.get(SimPolicy::Bsp).unwrap(), r.get(SimPolicy::Oracle).unwrap());
        // BSP: 128 samples each, rank 0 takes 3 ms × 128 = 0.384 s while rank 1 takes 0.128 s.
        assert!((bsp.mean_iter_s - 0.384).abs() < 1e-12, "{}", bsp.mean_iter_s);
        assert!((bsp.idle_fraction - 1.0 / 3.0).abs() < 1e-12);
        // The oracle: 3·b0 = b1 with b0 + b1 = 256, so 64 and 192, both 0.192 s.
        assert!((oracle.mean_iter_s - 0.192).abs() < 1e-12, "{}", oracle.mean_iter_s);
        assert!((bsp.vs_oracle - 0.5).abs() < 1e-12 && oracle.idle_fraction.abs() < 1e-12);
        assert_eq!(r.get(SimPolicy::LateOracle).unwrap().mean_iter_s, oracle.mean_iter_s, "nothing changes");
        assert!((oracle.samples_per_s - 256.0 / 0.192).abs() < 1e-6);
        // lbbsp learns the split from the timings (the balancer's own code, fed every record).
        let mut last = Vec::new();
        let mut keep = |p: SimPolicy, rec: IterRecord| {
            if p == SimPolicy::Lbbsp {
                last = rec.batch_sizes;
            }
        };
        let mut s = two_ranks("");
        s.iterations = 100;
        simulate(&s, 2, &BalanceConfig::default(), Some(&mut keep)).unwrap();
        assert!(last[0].abs_diff(64) <= 2 && last[0] + last[1] == 256, "{last:?}");
    }

    #[test]
    fn a_change_is_seen_late_by_the_late_oracle_only() {
        // Rank 1 becomes 3× slower at iteration 20: both ranks then run at the same speed.
        let s = two_ranks("[[interference]]\nkind = \"steady\"\nranks = [1]\nfactor = 3.0\nfrom = 20\n");
        let r = simulate(&s, 2, &BalanceConfig::default(), None).unwrap();
        let (late, oracle) = (r.get(SimPolicy::LateOracle).unwrap(), r.get(SimPolicy::Oracle).unwrap());
        // Oracle: 0.192 s before, then 128 each at 3 ms = 0.384 s. The late oracle keeps 64/192 for
        // iteration 20: rank 1 takes 192 × 3 ms = 0.576 s once.
        let want = (20.0 * 0.192 + 20.0 * 0.384) / 40.0;
        assert!((oracle.mean_iter_s - want).abs() < 1e-12, "{}", oracle.mean_iter_s);
        assert!((late.mean_iter_s - (want + (0.576 - 0.384) / 40.0)).abs() < 1e-12, "{}", late.mean_iter_s);
        assert_eq!((late.recovery.clone(), oracle.recovery.clone()), (vec![1], vec![0]));
    }

    /// A quota that freezes ranks in windows about as long as an iteration (`quota-short`): where
    /// a window falls in the next iteration is not known, and the long-run share that
    /// proportional-epoch learns beats every plan of the next iteration alone. lbbsp has that plan
    /// among its candidates (above a floor that keeps the rank from starving) and gains beyond it.
    #[test]
    fn lbbsp_plans_the_long_run_share_of_a_rank_frozen_in_short_windows() {
        let s = crate::sim::scenario::resolve("quota-short").unwrap();
        let r = simulate(&s, 16, &BalanceConfig::default(), None).unwrap();
        let (lb, prop) = (r.get(SimPolicy::Lbbsp).unwrap(), r.get(SimPolicy::ProportionalEpoch).unwrap());
        assert!(lb.samples_per_s > 1.05 * prop.samples_per_s && lb.longest_starved <= 5, "{lb:?} {prop:?}");
    }

    /// Every rank preempted at random (3× slower in half the iterations, independently): the equal
    /// split is the best, and the young model's first moves chase the noise. They must not cost
    /// more than 0.1% over ten seeds; a move is held back once moves have fallen short of the
    /// gains they expected over the equal split at the same speeds.
    #[test]
    fn lbbsp_keeps_bsp_where_every_rank_is_preempted_at_random() {
        let mut s = crate::sim::scenario::resolve("oversubscribed").unwrap();
        let mut ratios = Vec::new();
        for seed in 13..23 {
            s.seed = seed;
            let r = simulate(&s, 16, &BalanceConfig::default(), None).unwrap();
            ratios.push(r.get(SimPolicy::Lbbsp).unwrap().samples_per_s / r.get(SimPolicy::Bsp).unwrap().samples_per_s);
        }
        assert!(ratios.iter().sum::<f64>() / 10.0 > 0.999, "lbbsp / bsp by seed: {ratios:?}");
    }

    /// Noise alone at scale: among thousands of ranks some per-rank fits come out degenerate from
    /// sizes that barely moved; lbbsp must still stay with the Bayes oracle (which, with nothing but
    /// noise, splits by the true lines) and starve nobody.
    #[test]
    fn lbbsp_keeps_up_with_the_bayes_oracle_under_noise_at_scale() {
        let mut s = crate::sim::scenario::resolve("quiet").unwrap();
        s.iterations = 300;
        let r = simulate(&s, 3000, &BalanceConfig::default(), None).unwrap();
        let (lb, bayes) = (r.get(SimPolicy::Lbbsp).unwrap(), r.get(SimPolicy::BayesOracle).unwrap());
        assert!(lb.samples_per_s > 0.99 * bayes.samples_per_s && lb.longest_starved == 0, "{lb:?}");
        // (The p99 holds the probing iterations of the start; degenerate fits made it 7×.)
        assert!(lb.p99_iter_s < 1.3 * bayes.p99_iter_s, "{lb:?}");
    }

    /// Slice-granular interference: a CPU quota of half a core acts on wall-clock seconds. With a
    /// period shorter than an iteration (2 ms against 3–5 ms) the rank runs at about half speed
    /// every iteration, and balancing pays; with a 100 ms period it runs at full speed for 50 ms
    /// (about ten iterations) and is then frozen for 50, and no split of the next iteration can
    /// tell which, so balancing gains nothing (both as measured on real runs).
    #[test]
    fn a_quota_acts_in_slices_of_wall_time() {
        let quota = |period: f64| {
            let text = format!(
                "name = \"quota\"\nranks = 2\niterations = 1500\nbatch_per_rank = 64\n[compute]\nalpha_s = 0.0003\n\
                 beta_s = 3.0e-5\nnoise = 0.03\n[comm]\nfixed_s = 0.0003\n[[interference]]\nkind = \"quota\"\n\
                 ranks = [1]\nquota_s = {}\nperiod_s = {period}\n",
                period / 2.0
            );
            let r =
                simulate(&Scenario::parse(&text, Path::new("quota.toml")).unwrap(), 2, &BalanceConfig::default(), None);
            let r = r.unwrap();
            let rate = |p| r.get(p).unwrap().samples_per_s;
            (rate(SimPolicy::Lbbsp) / rate(SimPolicy::Bsp), rate(SimPolicy::Bsp))
        };
        let ((short, bsp_short), (long, bsp_long)) = (quota(0.002), quota(0.1));
        assert!(short > 1.25, "2 ms period: lbbsp/bsp {short}");
        assert!((0.95..1.05).contains(&long), "100 ms period: lbbsp/bsp {long}");
        // Either way the quota costs bsp about half of the rank's speed on average.
        assert!((bsp_short / bsp_long - 1.0).abs() < 0.15, "{bsp_short} {bsp_long}");
        // The windows: 1 ms of every 2 ms from phase 0; 1.5 ms of CPU from t = 0.5 ms runs 0.5 ms,
        // waits 1 ms, runs 1 ms: done at 3 ms, 2.5 ms later.
        let s = Slices { run_s: 0.001, period_s: 0.002, phase_s: 0.0, bursts: None, refill_s: 0.0 };
        assert!((s.wall(0.0005, 0.0015) - 0.0025).abs() < 1e-12, "{}", s.wall(0.0005, 0.0015));
        assert!((s.cpu_within(0.0005, 0.0025) - 0.0015).abs() < 1e-12);
        assert!(s.running(0.0005) && !s.running(0.0015));
    }

    /// A freeze costs the rank `freeze_cost_s` of CPU on resuming, which can meet a freeze of its
    /// own: the wall time is the least fixed point, the work within it is the CPU less the refills,
    /// and a rank that always runs does `run − refill` of work a period.
    #[test]
    fn a_freeze_costs_its_refill_in_cpu() {
        let s = Slices { run_s: 0.001, period_s: 0.002, phase_s: 0.0, bursts: None, refill_s: 0.0003 };
        // 1.5 ms of work from 0: 1 ms, a freeze, then 0.5 ms and the 0.3 ms refill: done at 2.8 ms.
        assert!((s.wall(0.0, 0.0015) - 0.0028).abs() < 1e-12, "{}", s.wall(0.0, 0.0015));
        assert!(
            (s.work_within(0.0, 0.0028) - 0.0015).abs() < 1e-12 && (s.cpu_within(0.0, 0.0028) - 0.0018).abs() < 1e-12
        );
        // 1.8 ms: its refill runs it into a second freeze, whose refill it pays too: 2.4 ms of CPU.
        assert!((s.wall(0.0, 0.0018) - 0.0044).abs() < 1e-12, "{}", s.wall(0.0, 0.0018));
        assert!((s.average_stretch() - 0.002 / 0.0007).abs() < 1e-12);
        // A scenario whose refill would take most of a window is refused, naming the key.
        let text = "name = \"q\"\nranks = 2\niterations = 10\nbatch_per_rank = 8\n[compute]\nalpha_s = 0.0\n\
                    beta_s = 1e-5\nfreeze_cost_s = 0.0006\n[[interference]]\nkind = \"quota\"\nranks = [1]\n\
                    quota_s = 0.001\nperiod_s = 0.002\n";
        let e = Scenario::parse(text, std::path::Path::new("q.toml")).unwrap_err().to_string();
        assert!(e.contains("compute.freeze_cost_s"), "{e}");
    }

    /// A rank frozen when its collective returns computes from its next window: the trainer's
    /// clock starts when the process runs, so it reports no freeze and its CPU time, while the
    /// iteration lasts the wait as well. Counting the wait in the compute made a rank that a
    /// collective left frozen look slowed in proportion to its work, and it learned the tail of a
    /// freeze as a window's length.
    #[test]
    fn a_rank_frozen_at_the_start_computes_from_its_next_window() {
        let cfg = BalanceConfig::default();
        let mut tr = Track::new(SimPolicy::Bsp, &cfg, 128, 2, 1).unwrap();
        let lines = [Line { alpha: 0.0, beta: 1e-5 }; 2];
        let slices = [None, Some(Slices { run_s: 0.001, period_s: 0.002, phase_s: 0.0, bursts: None, refill_s: 0.0 })];
        // At 1.5 ms rank 1 is frozen until 2 ms; its 0.64 ms of CPU then runs in one window.
        tr.clock = 0.0015;
        let it = Iteration { lines: &lines, noise: &[1.0; 2], slices: &slices };
        let slowest = tr.compute(&it, &[64, 64]);
        assert!((tr.compute[1] - 0.00064).abs() < 1e-12 && tr.freezes[1] == 0.0, "{:?} {:?}", tr.compute, tr.freezes);
        assert!((slowest - 0.00114).abs() < 1e-9 && (tr.stretch[1] - 1.0).abs() < 1e-9, "{slowest}");
    }

    /// A rank's share of the whole iteration is what a process's CPU over wall seconds counts:
    /// its windows' share times what its other processes leave it. Its windows' share alone made a
    /// rank both frozen in windows and slowed alike look only as slow as its windows.
    #[test]
    fn a_rank_in_windows_and_slowed_alike_reports_both_in_its_share() {
        let s = two_ranks(
            "[[interference]]\nkind = \"quota\"\nranks = [1]\nquota_s = 0.001\nperiod_s = 0.002\n\
             [[interference]]\nkind = \"steady\"\nranks = [1]\nfactor = 2.0\n",
        );
        let mut shares = Vec::new();
        let mut keep = |p: SimPolicy, rec: IterRecord| {
            if p == SimPolicy::Bsp && rec.iter > 0 {
                shares.push((rec.run_share[0], rec.run_share[1]));
            }
        };
        simulate(&s, 2, &BalanceConfig::default(), Some(&mut keep)).unwrap();
        assert!(!shares.is_empty());
        for (r0, r1) in shares {
            // Rank 0 has no windows (no measure); rank 1 runs half the wall clock at half its speed.
            assert!(r0 == 0.0 && (r1 - 0.25).abs() < 0.01, "{r0} {r1}");
        }
    }

    /// Starvation is in time, and under slices against the lesser of a rank's two shares.
    #[test]
    fn starvation_is_a_shortfall_of_work_against_both_shares() {
        // A fixed cost of 1 ms: 1 sample against a share of 3 is 9 µs short, no starvation; with
        // no fixed cost the same split is.
        let fixed = Line { alpha: 1e-3, beta: 4.7e-6 };
        assert!(!starved(&fixed, 1, 3) && starved(&Line { alpha: 0.0, ..fixed }, 1, 3));
        assert!(starved(&fixed, 1, 1000) && !starved(&fixed, 600, 1000));
        // Rank 1 runs 1 ms of every 2 ms: its average speed is half. At the start of its running
        // window its share at the clock is more than that; where it is frozen, less.
        let line = Line { alpha: 0.0, beta: 1e-6 };
        let slices = [None, Some(Slices { run_s: 0.001, period_s: 0.002, phase_s: 0.0, bursts: None, refill_s: 0.0 })];
        let bounds = [(1, 256), (1, 256)];
        let average = average_shares(&[line; 2], &slices, 256, &bounds);
        assert!(average[1].abs_diff(85) <= 1, "{average:?}");
        let running = equalize_by(&timed(&[line; 2], &slices, 0.0), 256, &bounds);
        let frozen = equalize_by(&timed(&[line; 2], &slices, 0.0015), 256, &bounds);
        assert!(running[1] > average[1] && frozen[1] < average[1], "{running:?} {frozen:?}");
        let least = |clock| starvation_shares(&[line; 2], &slices, &average, clock, &bounds)[1];
        assert_eq!((least(0.0), least(0.0015)), (average[1], frozen[1]));
        // With no slices, the share is the lines'.
        assert_eq!(*starvation_shares(&[line; 2], &[None, None], &[100, 156], 0.0, &bounds), [100, 156]);
    }

    /// A bursty hog's windows against a brute-force walk of the wall clock in 10 µs steps: the CPU
    /// it allows, the time a demand of CPU takes, and the freezes it counts.
    #[test]
    fn a_bursty_hogs_windows_match_a_walk_of_the_clock() {
        let bursts = Some(scenario::Bursts { on_s: 0.0237, cycle_s: 0.05 });
        let s = Slices { run_s: 0.003, period_s: 0.006, phase_s: 0.0171, bursts, refill_s: 0.0 };
        let dt = 1e-5;
        let mut rng = crate::data::rng::Rng::from_keys(&[7]);
        let dt: f64 = dt;
        for _ in 0..200 {
            let start = (0.2 * rng.next_f64() / dt).round() * dt;
            let wall = (0.12 * rng.next_f64() / dt).round() * dt;
            let steps = (wall / dt).round() as usize;
            let run = |j: usize| s.running(start + (j as f64 + 0.5) * dt);
            let cpu = (0..steps).filter(|&j| run(j)).count() as f64 * dt;
            assert!((s.cpu_within(start, wall) - cpu).abs() < 2.5 * dt, "{start} {wall}: {cpu}");
            let stops = (1..steps).filter(|&j| run(j - 1) && !run(j)).count() + usize::from(!run(0));
            assert!((s.freezes(start, wall) - stops as f64).abs() <= 1.0, "{start} {wall}: {stops}");
            if cpu > 0.0 {
                assert!((s.cpu_within(start, s.wall(start, cpu)) - cpu).abs() < 1e-9, "{start} {cpu}");
                assert!(s.wall(start, cpu) <= wall + 2.5 * dt, "{start} {cpu}: {} > {wall}", s.wall(start, cpu));
            }
        }
        // A burst of 23.7 ms gives 3 whole turns of 3 ms and a fourth, 12 ms; the 26.3 ms after it
        // are the rank's: 38.3 ms of CPU in every 50.
        assert!((s.cpu_within(0.0, 0.05) - 0.0383).abs() < 1e-12, "{}", s.cpu_within(0.0, 0.05));
        assert!((s.average_stretch() - 0.05 / 0.0383).abs() < 1e-12);
    }

    #[test]
    fn alpha_beta_allreduce_costs() {
        let c = |algorithm| Comm {
            algorithm,
            latency_s: 1e-6,
            bandwidth_bytes_per_s: 1e9,
            bytes: 4e6,
            fixed_s: 0.0,
            transfer_s: None,
        };
        // Ring: 2(N−1) steps of bytes/N; tree: 2⌈log2 N⌉ steps of the whole buffer.
        assert!((c(CommAlgorithm::Ring).seconds(4) - 6.0 * (1e-6 + 1e-3)).abs() < 1e-15);
        assert!((c(CommAlgorithm::Tree).seconds(4) - 4.0 * (1e-6 + 4e-3)).abs() < 1e-15);
        assert!((c(CommAlgorithm::Tree).seconds(5) - 6.0 * (1e-6 + 4e-3)).abs() < 1e-15);
        assert_eq!(c(CommAlgorithm::Ring).seconds(1), 0.0);
        // The fixed cost is paid on top, by one rank too.
        let fixed = Comm { fixed_s: 2e-3, ..c(CommAlgorithm::Ring) };
        assert!((fixed.seconds(4) - (6.0 * (1e-6 + 1e-3) + 2e-3)).abs() < 1e-15 && fixed.seconds(1) == 2e-3);
    }

    #[test]
    fn processes_act_on_their_ranks_and_iterations() {
        let s = two_ranks(
            "[[interference]]\nkind = \"square\"\nranks = [0]\nfactor = 2.0\non_iters = 2\noff_iters = 3\nfrom = 1\n",
        );
        let mut c = Cluster::new(&s, 2).unwrap();
        let on: Vec<bool> = (0..9)
            .map(|t| {
                c.step(t);
                assert_eq!(c.factor[1], 1.0);
                c.factor[0] == 2.0
            })
            .collect();
        assert_eq!(on, [false, true, true, false, false, false, true, true, false]);
        let bursty = two_ranks("[[interference]]\nkind = \"markov\"\nfactor = 2.0\np_on = 0.2\np_off = 0.5\n");
        let (mut a, mut b) = (Cluster::new(&bursty, 2).unwrap(), Cluster::new(&bursty, 2).unwrap());
        let mut on_iters = 0;
        for t in 0..2000 {
            a.step(t);
            b.step(t);
            assert_eq!(a.factor, b.factor, "keyed draws: the same cluster every time");
            on_iters += a.factor.iter().filter(|&&f| f > 1.0).count();
        }
        // Stationary on-fraction p_on / (p_on + p_off) = 2/7 of 4000 rank-iterations.
        assert!((on_iters as f64 / 4000.0 - 2.0 / 7.0).abs() < 0.05, "{on_iters}");
        // Changes within iterations: the iterations of a change are partly slowed, the slowdown
        // over time the same.
        let within =
            two_ranks("[[interference]]\nkind = \"markov\"\nfactor = 2.0\np_on = 0.2\np_off = 0.5\nwithin = true\n");
        let mut c = Cluster::new(&within, 2).unwrap();
        let (mut excess, mut partial) = (0.0, 0);
        for t in 0..2000 {
            c.step(t);
            excess += c.factor.iter().map(|f| f - 1.0).sum::<f64>();
            partial += c.factor.iter().filter(|&&f| f > 1.0 && f < 2.0).count();
        }
        assert!((excess / 4000.0 - 2.0 / 7.0).abs() < 0.05 && partial > 500, "{excess} {partial}");
    }

    /// A measured run drives the cluster: each rank's compute time over the run's uncontended line
    /// at its size (here 10 ms + 1 ms per sample; rank 1's contended iterations, at a CPU share of
    /// 0.5, stay out of the fit), ranks past the trace's world following rank `i mod world`, the
    /// trace repeating past its end. The sizes change every iteration: a ratio of seconds per
    /// sample would read the fixed cost as changes of speed (rank 0 would alternate 1 and 1.14).
    #[test]
    fn a_trace_replays_each_ranks_measured_slowdown() {
        let dir = std::env::temp_dir().join(format!("lbbsp-sim-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("run.jsonl");
        let mut w = crate::train::metrics::JsonlWriter::create(&path).unwrap();
        let line = |b: usize| 0.010 + 0.001 * b as f64;
        for t in 0..10 {
            // Rank 1 shares its core, twice as slow, from iteration 5 on.
            let (b0, slow) = (if t % 2 == 0 { 64 } else { 32 }, if t >= 5 { 2.0 } else { 1.0 });
            let mut r = IterRecord::timed(t, vec![b0, 96 - b0], vec![line(b0), slow * line(96 - b0)]);
            r.cpu_share = vec![1.0, 1.0 / slow];
            w.write(&r).unwrap();
        }
        w.flush().unwrap();
        let text = format!("[[interference]]\nkind = \"trace\"\npath = {:?}\n", path.display().to_string());
        let mut c = Cluster::new(&two_ranks(&text), 4).unwrap();
        for t in 0..15 {
            c.step(t);
            let f1 = if t % 10 >= 5 { 2.0 } else { 1.0 };
            let want = [1.0, f1, 1.0, f1];
            assert!(c.factor.iter().zip(want).all(|(f, w)| (f - w).abs() < 1e-9), "iteration {t}: {:?}", c.factor);
            // The ranks report the recorded CPU shares, as the trainer's balancer saw them.
            assert!((0..4).all(|i| (c.share(i) - 1.0 / want[i]).abs() < 1e-12), "iteration {t}");
        }
        // At another seed the replay starts at another point of the run (seed 1: iteration 9 of
        // its 10), and the Bayes oracle, which expects a replayed rank to stay as it was, reads
        // the run from there too.
        let mut other = two_ranks(&text);
        other.seed = 1;
        let mut c = Cluster::new(&other, 2).unwrap();
        let mut atoms = vec![Vec::new(); 2];
        for t in 0..15 {
            c.predict(t, &mut atoms);
            c.step(t);
            let f1 = |t: usize| if (t + 9) % 10 >= 5 { 2.0 } else { 1.0 };
            assert!((c.factor[1] - f1(t)).abs() < 1e-9, "iteration {t}: {:?}", c.factor);
            assert!((atoms[1][0].1 - f1(t.max(1) - 1)).abs() < 1e-9, "iteration {t}: {:?}", atoms[1]);
        }
        let missing = two_ranks("[[interference]]\nkind = \"trace\"\npath = \"/nonexistent/run.jsonl\"\n");
        let e = Cluster::new(&missing, 2).err().expect("a missing trace is an error").to_string();
        assert!(e.contains("/nonexistent/run.jsonl"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn bad_scenarios_name_the_field() {
        for (bad, want) in [
            ("ranks = 2\n", "missing field `name`"),
            ("name = \"x\"\nranks = 0\niterations = 1\nbatch_per_rank = 1\n[compute]\nalpha_s = 0.0\nbeta_s = 1.0\n", "`ranks`"),
            (
                "name = \"x\"\nranks = 2\niterations = 1\nbatch_per_rank = 1\n[compute]\nalpha_s = 0.0\nbeta_s = 1.0\n[[interference]]\nkind = \"steady\"\nfactor = 0.5\n",
                "interference[0]",
            ),
            (
                "name = \"x\"\nranks = 2\niterations = 1\nbatch_per_rank = 1\n[compute]\nalpha_s = 0.0\nbeta_s = 1.0\n[[interference]]\nkind = \"hog\"\nranks = [1]\nslice_s = 0.003\non_s = 0.3\n",
                "both on_s and off_s",
            ),
        ] {
            let e = Scenario::parse(bad, Path::new("bad.toml")).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("bad.toml"), "{e}");
        }
    }

    #[test]
    fn shipped_scenarios_parse() {
        for (name, text) in crate::sim::scenario::SHIPPED {
            let s = Scenario::parse(text, Path::new(name)).unwrap();
            assert_eq!(s.name, *name);
        }
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        let files = std::fs::read_dir(dir)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "toml"))
            .count();
        assert_eq!(files, crate::sim::scenario::SHIPPED.len(), "every scenario in scenarios/ is shipped");
    }
}

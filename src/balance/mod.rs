//! The LB-BSP balancer: one probabilistic model of every rank's next compute time ([`model`]),
//! and one decision, the split of the global batch with the smallest expected slowest time under
//! it ([`Balancer::observe`]). A pure function of the gathered observations, so every rank
//! computes the same split without a broadcast; its state is part of a checkpoint. The equations
//! and the evidence for each part: `docs/balancer.md`.

pub mod model;
pub mod split;

pub use split::{equalize, equalize_by, predicted_max, Cost, Line};

use crate::data::rng::Rng;
use crate::error::{Error, Result};
use crate::shard::equal_split;
use model::{Freezes, RankModel, Shape};
use serde::{Deserialize, Serialize};

/// Which policy splits the batch (`balance.policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// Plain BSP: the equal split, never changed.
    #[default]
    Bsp,
    /// LB-BSP: re-split before the allreduce (every iteration, or as often as a decision is worth
    /// its time).
    Lbbsp,
    /// Re-split once per epoch in proportion to each rank's throughput over the last epoch.
    ProportionalEpoch,
}

impl PolicyKind {
    /// The name the recipe uses (`balance.policy`).
    pub fn name(self) -> &'static str {
        ["bsp", "lbbsp", "proportional-epoch"][self as usize]
    }
}

/// What a policy sees of one rank's iteration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Observation {
    pub batch: usize,
    /// Seconds of forward + backward, waiting excluded.
    pub compute_s: f64,
    /// The share of its cores' time the rank had while computing (1 when it has no measure).
    pub cpu_share: f64,
    /// Times the rank was descheduled while computing (0 when it has no measure).
    pub preemptions: f64,
    /// Seconds of its compute the rank was runnable but not running (another job's turn, a CPU
    /// quota's throttle; not a sleep): over `preemptions`, the length of one freeze.
    pub frozen_s: f64,
    /// The share of wall time the rank ran in its previous iteration, compute and collective (0
    /// when it has no measure).
    pub run_share: f64,
    /// Seconds of that previous iteration, over which `run_share` was measured (0 when it has no
    /// measure): the shares are averaged over wall time.
    pub run_s: f64,
    /// Seconds of its previous collective spent moving data rather than waiting for slower ranks
    /// (0 when it has no measure).
    pub transfer_s: f64,
    /// Seconds the rank's previous balancing step took, its decision included (0 when it has no
    /// measure): what a decision costs, which decides how often one is worth taking.
    pub balance_s: f64,
}

impl Observation {
    /// An observation without a CPU share measure.
    pub fn new(batch: usize, compute_s: f64) -> Observation {
        Observation { batch, compute_s, cpu_share: 1.0, ..Default::default() }
    }
}

/// A policy that splits the global batch among the ranks: the trainer's and the simulator's.
pub trait Policy {
    /// The split of the next full global batch.
    fn sizes(&self) -> &[usize];
    /// Learns every rank's iteration (the same gathered observations on every rank).
    fn observe(&mut self, obs: &[Observation]);
    /// Marks an epoch boundary.
    fn end_epoch(&mut self) {}
}

/// The recipe's `[balance]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BalanceConfig {
    pub policy: PolicyKind,
    /// Smallest batch a rank may get.
    pub b_min: usize,
    /// Largest batch a rank may get (e.g. a memory cap); `None` means B.
    pub b_max: Option<usize>,
    /// Iterations at the start whose timings are ignored (cold caches, lazy page faults).
    pub warmup_iters: usize,
    /// A metrics file (`lbbsp train --metrics`) of an earlier run whose per-iteration batch sizes
    /// this run uses instead of the policy's. A balanced split follows the timings of its run, so
    /// this is how an `lbbsp` run is reproduced bit for bit: same recipe, same world size, the
    /// first run's sizes. The policy still observes every iteration (its state is what it would be).
    pub replay: Option<std::path::PathBuf>,
}

impl Default for BalanceConfig {
    fn default() -> Self {
        BalanceConfig { policy: PolicyKind::Bsp, b_min: 1, b_max: None, warmup_iters: 5, replay: None }
    }
}

impl BalanceConfig {
    /// Checks the values that do not depend on the world size.
    pub fn validate(&self) -> Result<()> {
        let (why, lo) = ("must be at least 1 (a rank with no samples has no speed to measure)", self.b_min);
        match self.b_max {
            _ if lo == 0 => Err(Error::config("balance.b_min", why)),
            Some(hi) if hi < lo => Err(Error::config("balance.b_max", format!("{hi} is below balance.b_min = {lo}"))),
            _ => Ok(()),
        }
    }

    /// Per-rank bounds for `world` ranks, or an error naming the fix when no split of `B` exists.
    pub fn bounds(&self, global_batch: usize, world: usize) -> Result<Vec<(usize, usize)>> {
        let (hi, lo, least) = (self.b_max.unwrap_or(global_batch).min(global_batch), self.b_min, self.b_min * world);
        if global_batch < least {
            let why = format!(
                "B = {global_batch} cannot give each of the {world} ranks at least balance.b_min = {lo} \
                 samples; raise train.global_batch to at least {least} or run fewer ranks"
            );
            return Err(Error::config("train.global_batch", why));
        }
        let why = format!("{world} ranks × b_max {hi} < B = {global_batch}; raise balance.b_max or run more ranks");
        (hi * world >= global_batch).then(|| vec![(lo, hi); world]).ok_or_else(|| Error::config("balance.b_max", why))
    }
}

/// Estimates `x_i` of variances `v_i` shrunk towards their mean by the share of their spread that
/// the variances explain (normal-means empirical Bayes). Two or fewer are kept.
fn shrunk(x: &[f64], v: &[f64]) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let spread = x.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    let keep = if spread > 0.0 && x.len() > 2 { 1.0 - (v.iter().sum::<f64>() / n / spread).min(1.0) } else { 1.0 };
    x.iter().map(|&x| mean + keep * (x - mean)).collect()
}

/// The common-shock rate `q`: a shock comes with probability `q` and in it each rank at risk begins
/// a lift with probability `p_i/q`, so that some onset comes in `q·(1 − Π(1 − p_i/q))` of the
/// iterations; `q` makes that the share `some` seen (1, independence, where that is no rarer).
fn shock_rate(p: &[f64], some: f64) -> f64 {
    let any = |q: f64| q * (1.0 - p.iter().map(|&p| 1.0 - (p / q).min(1.0)).product::<f64>());
    let lowest = p.iter().copied().fold(0.0, f64::max);
    if any(1.0) <= some || lowest <= 0.0 {
        return 1.0;
    }
    let (mut lo, mut hi) = (lowest.max(some), 1.0);
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        (lo, hi) = if any(mid) < some { (mid, hi) } else { (lo, mid) };
    }
    hi
}

/// Each rank's rate of a transition from its forgotten `(hits, of)` counts: its posterior mean
/// under two classes of rates fitted by EM to `h ~ Poisson(r·of)` (jobs visit some ranks and not
/// others), with Jeffreys' pooled rate as their prior.
fn shrunk_rates(counts: impl Iterator<Item = (f64, f64)>) -> Vec<f64> {
    let counts: Vec<(f64, f64)> = counts.collect();
    let (hits, of) = counts.iter().fold((0.0, 0.0), |a, c| (a.0 + c.0, a.1 + c.1));
    if of < 1.0 {
        // No evidence yet: a lift first seen is expected to last, an onset not to come.
        return vec![0.0; counts.len()];
    }
    let pooled = (hits + 0.5) / (of + 1.0);
    let clamp = |r: f64| r.clamp(1e-6, 1.0);
    let (mut lo, mut hi, mut share): (f64, f64, f64) = (clamp(0.5 * pooled), clamp(2.0 * pooled), 0.5);
    let mut high = vec![0.5; counts.len()];
    for _ in 0..EM_STEPS {
        for (p, &(h, o)) in high.iter_mut().zip(&counts) {
            let log_ratio = h * (hi / lo).ln() - (hi - lo) * o + (share / (1.0 - share)).ln();
            *p = 1.0 / (1.0 + (-log_ratio).exp());
        }
        let sum = |w: &dyn Fn(f64) -> f64| {
            counts.iter().zip(&high).fold((0.0, 0.0), |a, (&(h, o), &p)| (a.0 + w(p) * h, a.1 + w(p) * o))
        };
        let ((h1, o1), (h0, o0)) = (sum(&|p| p), sum(&|p| 1.0 - p));
        (hi, lo) = (clamp((h1 + pooled) / (o1 + 1.0)), clamp((h0 + pooled) / (o0 + 1.0)));
        share = (high.iter().sum::<f64>() / counts.len().max(1) as f64).clamp(1e-3, 1.0 - 1e-3);
    }
    high.iter().map(|p| p * hi + (1.0 - p) * lo).collect()
}

/// Steps of the rates' expectation–maximisation.
const EM_STEPS: usize = 20;

/// A candidate replaces the best only for a mean gain above this many standard errors and this
/// share of the slowest time: alike ranks' levels differ by their noise, and a split fitted to
/// that difference loses what it expects to win.
const SIGNIFICANCE: f64 = 2.0;
const MIN_GAIN: f64 = 0.005;

/// Forgetting of the splits' overruns (about fifty decisions, each scored by the iteration after
/// it), and the prior weight of none.
const SURPRISE_FORGETTING: f64 = 0.98;
const SURPRISE_PRIOR: f64 = 2.0;

/// A hedge gives no rank less than this share of the mean plan's size for it (the model's
/// equal-time share; below half of that a rank is starved).
const FLOOR: f64 = 0.6;

/// Draws per decision: fewer above 2,048 ranks (16 at the least), so that a step takes a few
/// milliseconds (the slowest of thousands of ranks varies less from draw to draw).
fn draws_for(n: usize) -> usize {
    (64 * 2048 / n.max(1)).clamp(16, 64)
}

/// Phases of the windows each draw is averaged over (where some rank freezes in windows).
const PHASES: usize = 4;

/// The common quantiles the hedges plan at, with the standard normal's quantile at each.
const QUANTILES: [(f64, f64); 5] = [(0.5, 0.0), (0.75, 0.6745), (0.9, 1.2816), (0.97, 1.8808), (0.99, 2.3263)];

/// The balancer of one run: bsp, proportional-epoch or lbbsp (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
// A checkpoint from before a field was added has none: it starts from its default.
#[serde(default)]
pub struct Balancer {
    cfg: BalanceConfig,
    global_batch: usize,
    bounds: Vec<(usize, usize)>,
    sizes: Vec<usize>,
    ranks: Vec<RankModel>,
    freezes: Vec<Freezes>,
    shape: Shape,
    /// Observations seen, the warm-up's included.
    seen: usize,
    /// Per rank, samples and seconds of the epoch so far (proportional-epoch).
    epoch_totals: Vec<(f64, f64)>,
    /// The log-sizes of the last onsets of any rank (a ring): what an onset does.
    onsets: Vec<f64>,
    next_onset: usize,
    /// Forgotten sums of the onsets' squared deviations from their shock's median lift, and of
    /// their count: how far one rank's onset is from a shock's.
    onset_spread: [f64; 2],
    /// Forgotten sums over iterations of the probability that some rank's lift begins, if the
    /// ranks' onsets were independent, and of whether one did.
    shocks: [f64; 2],
    /// That probability for the next iteration.
    independent: f64,
    /// The expected slowest time of the split the last decision chose, and whether that split was
    /// a move (not the equal split).
    chosen: Option<(f64, bool)>,
    /// The equal split's expected slowest time at that decision: a move is scored against what
    /// the equal split would have taken at the speeds the iteration had.
    equal_expected: f64,
    /// For the equal split and for moves: forgotten sums of the slowest times, of what was expected
    /// of them, and of the iterations scored.
    overruns: [[f64; 3]; 2],
    /// The collective's own transfer: the least of the iterations' shortest transfers of any rank,
    /// forgotten by growing [`TRANSFER_CREEP`] an iteration (one that a freeze stretched is longer).
    transfer: f64,
    /// What a decision costs: the least of the slowest rank's balancing steps that decided,
    /// forgotten as the transfer is.
    cost: f64,
    /// Whether the last step decided, and the slowest seconds and the iterations since one did.
    since: (bool, f64, usize),
    /// Every rank's log time per sample in the iteration of the last decision.
    decided_at: Vec<f64>,
}

/// A rank's predictive law of its next log time per sample: its regimes' (probability, level), the
/// onset's or the end's second and a second lift's third, and its noise's deviation.
type Law = ([(f64, f64); 3], f64);

/// A law's expected time per sample, `E[e^x]`: its regimes' mean with the noise's lognormal
/// factor.
fn mean_time((atoms, sigma): &Law) -> f64 {
    atoms.iter().map(|(p, x)| p * x.exp()).sum::<f64>() * (0.5 * sigma * sigma).exp()
}

/// One drawn iteration's seconds: every rank's time `x·(ρ + b)`; at a rank that freezes in windows
/// (`L > 0`), its CPU part `a` of it runs from the drawn phase `u` of its windows and every window
/// met adds `L`; then the collective needs every such rank running for its `transfer` seconds (it
/// busy-polls while it waits, so a quota or a hog freezes it there as well): it waits for a
/// frozen rank's window, and a window that closes before the transfer is done adds a freeze. The
/// transfer itself, the same for every split, is left out.
fn iteration(row: &[f64], phases: &[f64], sizes: &[usize], rho: f64, windows: &[(f64, f64)], transfer: f64) -> f64 {
    let mut end = 0.0f64;
    for (((x, &b), &(length, a)), &u) in row.iter().zip(sizes).zip(windows).zip(phases) {
        let t = x * (rho + b as f64);
        end = end.max(if length > 0.0 && a < 1.0 { t * a + length * (u + t * (1.0 - a) / length).floor() } else { t });
    }
    let mut stall = 0.0f64;
    for (&(length, a), &u) in windows.iter().zip(phases) {
        if length > 0.0 && a < 1.0 {
            // `%` is a library call, many times slower than this.
            let (running, at) = (length * a / (1.0 - a), u * length * a / (1.0 - a) + end);
            let at = at - (running + length) * (at / (running + length)).floor();
            let (wait, at) = if at >= running { (running + length - at, 0.0) } else { (0.0, at) };
            stall = stall.max(wait + length * (((at + transfer) / running).ceil() - 1.0).max(0.0));
        }
    }
    end + stall
}

/// The phases a decision averages each draw over: [`PHASES`] where the spread that some rank's
/// windows `(L, a)` give a draw exceeds its noise in time (`σ_i` of its `t_i` seconds), else one.
/// The drawn phase moves a draw by a whole window with the chance `p` that the iteration meets
/// one (`t·(1 − a)/L` windows on average, at most ½ for the bound), a spread of `L·√(p(1 − p))`,
/// compared with the noise as a share of `t`.
fn phases(windows: &[(f64, f64)], laws: &[Law], sizes: &[usize], rho: f64) -> usize {
    let chance = |(length, a): (f64, f64), t: f64| (t * (1.0 - a) / length).min(0.5);
    let time = |law: &Law, b: usize| mean_time(law) * (rho + b as f64);
    let relative = |w: (f64, f64), t: f64| w.0 / t * (chance(w, t) - chance(w, t).powi(2)).sqrt();
    let noisier = |((&w, law), &b): ((&(f64, f64), &Law), &usize)| relative(w, time(law, b)) > law.1;
    [1, PHASES][usize::from(windows.iter().zip(laws).zip(sizes).any(noisier))]
}

/// The line of `x` seconds per sample with the shared fixed part `ρ`.
fn per_sample_line(x: f64, rho: f64) -> Line {
    Line { alpha: x * rho, beta: x }
}

/// How fast the transfer's and the decision cost's least values are forgotten: 1% an iteration.
const TRANSFER_CREEP: f64 = 1.01;

/// Where no rank changed regime, a decision waits until the iterations since the last one have
/// lasted its cost over this share: deciding costs time on every rank (tens of microseconds at
/// two ranks, against an iteration of a millisecond or two), while a split learned under steady
/// speeds stays right for many iterations.
const DECISION_SHARE: f64 = 0.001;

/// Where a rank's speed moved, a decision is taken at once, but its cost is held to this share:
/// where ranks outnumber cores, every iteration moves some rank's speed, and a decision on every
/// rank at every iteration takes the cores the training needs.
const MOVED_SHARE: f64 = 0.01;

/// `least` grown by [`TRANSFER_CREEP`], or `x` where that is less (`least` 0: none yet; `x` not a
/// positive number: no measure).
fn least_creeping(least: f64, x: f64) -> f64 {
    let creep = if least > 0.0 { least * TRANSFER_CREEP } else { f64::INFINITY };
    Some(x).filter(|x| *x > 0.0 && x.is_finite()).map_or(least, |x| x.min(creep))
}

/// Shocks whose lifts are kept, pooled over the ranks.
const ONSETS_KEPT: usize = 32;

impl Balancer {
    /// Starts from the equal split; fails with a clear message when no split respects the bounds.
    pub fn new(cfg: &BalanceConfig, global_batch: usize, world: usize) -> Result<Balancer> {
        cfg.validate()?;
        Ok(Balancer {
            cfg: cfg.clone(),
            global_batch,
            bounds: cfg.bounds(global_batch, world)?,
            sizes: equal_split(global_batch, world),
            ranks: vec![RankModel::default(); world],
            freezes: vec![Freezes::default(); world],
            shape: Shape::new(global_batch, world),
            epoch_totals: vec![(0.0, 0.0); world],
            ..Default::default()
        })
    }

    pub fn config(&self) -> &BalanceConfig {
        &self.cfg
    }

    /// Every rank's `(lowest, highest)` batch size.
    pub fn bounds(&self) -> &[(usize, usize)] {
        &self.bounds
    }

    /// The split of a global batch of `total` samples: [`Policy::sizes`] for a full batch; for the
    /// short last batch of an epoch, the same shares above every rank's lower bound, so that the
    /// bounds hold there too.
    pub fn split(&self, total: usize) -> Vec<usize> {
        let lows: Vec<usize> = self.bounds.iter().map(|b| b.0).collect();
        crate::shard::rescale_above(&self.sizes, total, &lows)
    }

    /// Each rank's expected compute time as a line in its batch, under the model (for display and
    /// debugging; the decision uses the whole distribution).
    pub fn expected_lines(&self) -> Vec<Line> {
        let rho = self.shape.rho();
        self.laws(1).iter().map(|law| per_sample_line(mean_time(law), rho)).collect()
    }

    /// Each rank's base level, and its current lift where it has one, shrunk by [`shrunk`] (alike
    /// ranks keep an equal split instead of following each level's noise).
    fn levels(&self) -> (Vec<f64>, Vec<Option<f64>>) {
        let raw: Vec<f64> = self.ranks.iter().map(RankModel::base).collect();
        let var: Vec<f64> = self.ranks.iter().map(|r| r.noise() * r.noise() * model::BASE_WEIGHT).collect();
        let bases = shrunk(&raw, &var);
        let lifted = self.ranks.iter().filter_map(|r| Some((r.lift()?, r.noise() * r.noise() * model::LIFT_WEIGHT)));
        let (raw, var): (Vec<f64>, Vec<f64>) = lifted.unzip();
        let mut lifts = shrunk(&raw, &var).into_iter();
        (bases, self.ranks.iter().map(|r| r.lift().and_then(|_| lifts.next())).collect())
    }

    /// Each rank's predictive law of its log time per sample over the next `horizon` iterations
    /// (its regimes and noise): the regimes' probabilities are their mean over those iterations
    /// under the two-state chain of onsets `p` and ends `q`, `P_j(lifted) = π + (s − π)·λ^j` with
    /// `π = p/(p+q)`, `λ = 1 − p − q` and `s` 1 if lifted now, else 0. The levels are learned at
    /// full running ([`model::running_share`]); the laws give a rank's time at its windows' share.
    fn laws(&self, horizon: i32) -> Vec<Law> {
        let rates = |k: usize| shrunk_rates(self.ranks.iter().map(RankModel::counts).map(|c| (c[k + 1], c[k])));
        let [on, off, rise, fall] = [0, 2, 4, 6].map(rates);
        let (jumps, (mut bases, lifts)) = (self.jumps(), self.levels());
        bases.iter_mut().zip(&self.freezes).for_each(|(b, f)| *b -= model::running_share(f.windows()).ln());
        // The mean over the horizon of the chance of the upper state of a two-state chain of
        // onsets `p` and ends `q`, in it now or not.
        let upper = |p: f64, q: f64, now: bool| {
            let (s, lambda, pi) = (p + q, 1.0 - p - q, p / (p + q).max(1e-12));
            let mean = if s > 1e-9 { lambda * (1.0 - lambda.powi(horizon)) / (f64::from(horizon) * s) } else { 1.0 };
            pi + (f64::from(u8::from(now)) - pi) * mean
        };
        let atoms = |i: usize, r: &RankModel| {
            let (b, (second, up), p) = (bases[i], r.second(), upper(on[i], off[i], lifts[i].is_some()));
            let high = p * upper(rise[i], fall[i], up);
            match lifts[i] {
                Some(l) => [(p - high, b + l), (1.0 - p, b), (high, b + l + second)],
                None => [(1.0 - p, b), (p, b + jumps[i]), (0.0, b)],
            }
        };
        self.ranks.iter().enumerate().map(|(i, r)| (atoms(i, r), r.noise())).collect()
    }

    /// Each rank's lift at an onset: its own onsets' mean shrunk towards the last shocks' median.
    fn jumps(&self) -> Vec<f64> {
        let median = self.median_onset();
        let n = self.onsets.len().max(1) as f64;
        // One onset's spread about the median: its shock's about the median and its own about its
        // shock's. Where a shock slows many ranks, its median hides the second, and a rank's own
        // few onsets (a first one at a level that was not its base) went unshrunk.
        let within = self.onset_spread[0] / self.onset_spread[1].max(1e-300);
        let spread = self.onsets.iter().map(|j| (j - median) * (j - median)).sum::<f64>() / n + within;
        let own = |r: &RankModel| Some(r.jump()).filter(|j| j.1 >= 1.0).map_or((median, 0.0), |(j, c)| (j, spread / c));
        let (own, var): (Vec<f64>, Vec<f64>) = self.ranks.iter().map(own).unzip();
        shrunk(&own, &var)
    }

    /// The median lift of the onsets kept (0 before any).
    fn median_onset(&self) -> f64 {
        let mut sorted = self.onsets.clone();
        sorted.sort_by(f64::total_cmp);
        sorted.get(sorted.len() / 2).copied().unwrap_or(0.0)
    }

    /// [`draws_for`] rows of every rank's next time per sample `e^x`, from one stream keyed by the
    /// iteration (the same on every rank): a lifted rank's regime by its law, an onset by the
    /// common shock with a lift drawn from the last shocks', and the noise. Also returns the
    /// probability of some onset were onsets independent.
    fn draws(&self, laws: &[Law], windows: &[(f64, f64)]) -> (Vec<f64>, Vec<f64>, f64) {
        let n = self.ranks.len();
        let median = self.median_onset();
        let at_risk = self.at_risk(laws);
        // The past iterations had `clustering` times the onsets that independence predicted.
        let independent = 1.0 - at_risk.iter().map(|p| 1.0 - p).product::<f64>();
        let clustering = ((self.shocks[1] + 1.0) / (self.shocks[0] + 1.0)).min(1.0);
        let shock = shock_rate(&at_risk, clustering * independent);
        let mut rng = Rng::from_keys(&[0xba1a, self.seen as u64]);
        let mut level = vec![0.0f64; n * draws_for(n)];
        let mut phase = vec![0.0f64; level.len()];
        for (row, phases) in level.chunks_mut(n).zip(phase.chunks_mut(n)) {
            let shocked = rng.next_f64() < shock;
            let jump = if self.onsets.is_empty() { 0.0 } else { self.onsets[rng.below(self.onsets.len())] - median };
            for (i, ((atoms, sigma), r)) in laws.iter().zip(&self.ranks).enumerate() {
                let x = if r.lift().is_some() {
                    let u = rng.next_f64();
                    atoms[usize::from(u >= atoms[0].0) + usize::from(u >= atoms[0].0 + atoms[1].0)].1
                } else if shocked && rng.next_f64() * shock < atoms[1].0 {
                    atoms[1].1 + jump
                } else {
                    atoms[0].1
                };
                row[i] = (x + sigma * rng.normal() as f64).exp();
                phases[i] = if windows[i].0 > 0.0 { rng.next_f64() } else { 0.0 };
            }
        }
        (level, phase, independent)
    }

    /// The unlifted ranks' probabilities of an onset under `laws`.
    fn at_risk(&self, laws: &[Law]) -> Vec<f64> {
        laws.iter().zip(&self.ranks).filter(|(_, r)| r.lift().is_none()).map(|(l, _)| l.0[1].0).collect()
    }

    /// The candidates: the equal split, then [`equalize`]'s split of the laws planned at their means,
    /// and above [`FLOOR`] of that plan, at each common quantile and at their long-run wall time (a
    /// freezing rank's mean over its running share, which is what proportional-epoch learns: the
    /// draws' phases are unknown, and over them it can beat a plan of the next iteration alone).
    /// From the laws, not the draws: a plan fitted to the draws it is judged on would win by their
    /// sampling noise.
    fn candidates(&self, laws: &[Law], rho: f64, windows: &[(f64, f64)]) -> Vec<Vec<usize>> {
        let line = |x: f64| per_sample_line(x, rho);
        let mut plans: Vec<Vec<Line>> = vec![Vec::with_capacity(laws.len()); 2 + QUANTILES.len()];
        for (law @ (atoms, sigma), w) in laws.iter().zip(windows) {
            let expected = mean_time(law);
            plans[0].push(line(expected));
            plans[1 + QUANTILES.len()].push(line(expected / model::running_share(*w)));
            let mut sorted = *atoms;
            sorted.sort_by(|a, b| a.1.total_cmp(&b.1));
            // At `q`, the lowest level whose regimes and those below it are at least that likely.
            let at = |q: f64| (0..3).find(|&k| sorted[..=k].iter().map(|a| a.0).sum::<f64>() >= q).unwrap_or(2);
            for (k, (q, z)) in QUANTILES.iter().enumerate() {
                plans[k + 1].push(line((sorted[at(*q)].1 + sigma * z).exp()));
            }
        }
        let mut candidates = vec![equal_split(self.global_batch, laws.len())];
        let mean = equalize(&plans[0], self.global_batch, &self.bounds);
        let floor = |(lo, hi): (usize, usize), m: usize| (lo.max((FLOOR * m as f64).ceil() as usize).min(hi), hi);
        let floored: Vec<(usize, usize)> = self.bounds.iter().zip(&mean).map(|(&b, &m)| floor(b, m)).collect();
        let planned = std::iter::once(mean).chain(plans[1..].iter().map(|p| equalize(p, self.global_batch, &floored)));
        planned.for_each(|sizes| candidates.extend((!candidates.contains(&sizes)).then_some(sizes)));
        candidates
    }

    /// The decision: in order, a candidate replaces the best so far (the equal split first) only
    /// for a gain over the same draws above [`SIGNIFICANCE`] standard errors and [`MIN_GAIN`].
    /// Also returns the probability of some onset were onsets independent.
    fn decide(&mut self, horizon: i32) -> (Vec<usize>, f64) {
        let (rho, n, transfer) = (self.shape.rho(), self.ranks.len(), self.transfer);
        let laws = self.laws(horizon);
        let windows: Vec<(f64, f64)> = self.freezes.iter().map(Freezes::windows).collect();
        let (level, phase, mut independent) = self.draws(&laws, &windows);
        if horizon > 1 {
            // The shocks are counted per iteration.
            independent = 1.0 - self.at_risk(&self.laws(1)).iter().map(|p| 1.0 - p).product::<f64>();
        }
        let mut candidates = self.candidates(&laws, rho, &windows);
        // Each draw's time is its mean over PHASES phases of the windows, rotated by the drawn
        // ones: a window met or missed moves one draw by a whole window, and that spread, not
        // the gain, would decide the significance test. Only where the spread that some rank's
        // windows give a draw exceeds its noise in time: a quiet host's own preemptions (up to a
        // few hundred microseconds, met in one iteration of fifty) add less than the noise, and
        // averaging them would only multiply the decision's cost.
        let m = phases(&windows, &laws, &self.sizes, rho);
        let turn = move |j: usize| move |u: &f64| (u + j as f64 / m as f64).fract();
        let turned: Vec<f64> = phase.chunks(n).flat_map(|u| (0..m).flat_map(move |j| u.iter().map(turn(j)))).collect();
        let slowest = |sizes: &[usize]| -> Vec<f64> {
            let each = turned.chunks(n).enumerate().map(|(k, u)| (&level[k / m * n..][..n], u));
            let each: Vec<f64> = each.map(|(x, u)| iteration(x, u, sizes, rho, &windows, transfer)).collect();
            each.chunks(m).map(|c| c.iter().sum::<f64>() / m as f64).collect()
        };
        let equal = slowest(&candidates[0]);
        let mut best = (equal.clone(), 0);
        for (k, c) in candidates.iter().enumerate().skip(1) {
            let times = slowest(c);
            let gains: Vec<f64> = best.0.iter().zip(&times).map(|(a, b)| a - b).collect();
            let m = gains.len() as f64;
            let mean = gains.iter().sum::<f64>() / m;
            let var = gains.iter().map(|g| (g - mean) * (g - mean)).sum::<f64>() / (m - 1.0);
            let floor = MIN_GAIN * best.0.iter().sum::<f64>() / m;
            if mean > floor && mean * mean > SIGNIFICANCE * SIGNIFICANCE * var / m {
                best = (times, k);
            }
        }
        // The winner's curse: the best of several estimates is their most optimistic one, so a
        // move realises less than it expects. Its gain counts only beyond how much more than the
        // equal split's (scored beside it at the same speeds) its iterations have overrun what
        // was expected of them, in time: a mean of logs would read a rank slow in every other
        // iteration as a gain (Jensen). Each kind's ratio is shrunk towards both kinds' pooled
        // one, not to none: the expectation and the slowest compute time it is scored by differ
        // by the collective's stall, alike for both kinds.
        let (mean, [o0, o1]) = (|v: &[f64]| v.iter().sum::<f64>() / v.len() as f64, self.overruns);
        let (t_eq, t_best) = (mean(&equal), mean(&best.0));
        let (pooled, per) = ((o0[0] + o1[0]) / (o0[1] + o1[1]).max(1e-300), (o0[1] + o1[1]) / (o0[2] + o1[2]).max(1.0));
        let ratio = |o: [f64; 3]| (o[0] + SURPRISE_PRIOR * pooled * per) / (o[1] + SURPRISE_PRIOR * per).max(1e-300);
        let overrun = if per > 0.0 { (ratio(o1) / ratio(o0)).ln().max(0.0) } else { 0.0 };
        let moved = best.1 != 0 && (t_eq / t_best).ln() - overrun > MIN_GAIN;
        self.chosen = Some(if moved { (t_best, true) } else { (t_eq, false) });
        self.equal_expected = t_eq;
        (candidates.swap_remove(if moved { best.1 } else { 0 }), independent)
    }

    /// Scores the last decision by the iteration after it: the split that ran by `slowest`, the
    /// most of `times` (at the sizes of `obs`); beside a move, the equal split by its slowest at
    /// each rank's speed of the same iteration, so that both kinds meet the same speeds.
    fn surprised(&mut self, obs: &[Observation], times: &[f64], slowest: f64, rho: f64) {
        // Each decision is scored once, by the iteration right after it.
        if let Some((expected, moved)) = self.chosen.take().filter(|_| slowest > 0.0 && slowest.is_finite()) {
            self.overruns.iter_mut().flatten().for_each(|x| *x *= SURPRISE_FORGETTING);
            let mut score = |k: usize, t: f64, e: f64| (0..3).for_each(|j| self.overruns[k][j] += [t, e, 1.0][j]);
            // Under freezes in windows too: the line misprices where a compute ends in them, but
            // without a score there the moves of a run frozen everywhere are never checked.
            if moved && self.equal_expected > 0.0 {
                let equal = equal_split(self.global_batch, obs.len()).into_iter().zip(obs.iter().zip(times));
                let equal = equal.map(|(e, (o, t))| t * (rho + e as f64) / (rho + o.batch as f64)).fold(0.0, f64::max);
                if equal.is_finite() {
                    score(0, equal, self.equal_expected);
                }
            }
            score(usize::from(moved), slowest, expected);
        }
    }
}

impl Policy for Balancer {
    fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Records every rank's measurements of the iteration just computed and, under `lbbsp`, picks
    /// the split of the next iteration. Called on every rank with the same (gathered) input.
    fn observe(&mut self, obs: &[Observation]) {
        assert_eq!(obs.len(), self.sizes.len(), "one observation per rank");
        self.seen += 1;
        // The short last batch of an epoch is left out: its sizes are not the ones being tuned.
        let full = obs.iter().map(|o| o.batch).sum::<usize>() == self.global_batch;
        if self.seen <= self.cfg.warmup_iters || !full {
            self.since.0 = false;
            return;
        }
        match self.cfg.policy {
            PolicyKind::Bsp => {}
            PolicyKind::ProportionalEpoch => {
                let totals = obs.iter().zip(self.epoch_totals.iter_mut());
                totals.for_each(|(o, tot)| *tot = (tot.0 + o.batch as f64, tot.1 + o.compute_s));
            }
            PolicyKind::Lbbsp => {
                let cpu: Vec<_> =
                    obs.iter().map(|o| (o.batch as f64, o.compute_s * o.cpu_share.clamp(1e-3, 1.0))).collect();
                let before = self.shape.rho();
                self.shape.observe(&cpu);
                let rho = self.shape.rho();
                if rho != before {
                    self.ranks.iter_mut().for_each(|r| r.reshape(before, rho));
                }
                self.shocks[0] = model::COUNT_FORGETTING * self.shocks[0] + self.independent;
                self.shocks[1] *= model::COUNT_FORGETTING;
                // A checkpoint from before freezes were measured has none.
                self.freezes.resize(self.ranks.len(), Freezes::default());
                let times: Vec<f64> = self.freezes.iter_mut().zip(obs).map(|(f, o)| f.observe(o)).collect();
                let shortest = obs.iter().map(|o| o.transfer_s).filter(|t| *t > 0.0).fold(f64::INFINITY, f64::min);
                self.transfer = least_creeping(self.transfer, shortest);
                // The cost of a decision is that of a step that took one.
                let cost = obs.iter().map(|o| o.balance_s).fold(0.0, f64::max);
                self.cost = if self.since.0 { least_creeping(self.cost, cost) } else { self.cost };
                let slowest = times.iter().copied().fold(0.0, f64::max);
                self.surprised(obs, &times, slowest, rho);
                let observed = self.ranks.iter_mut().zip(obs).zip(times.iter().zip(&self.freezes));
                let learned = observed
                    .filter_map(|((r, o), (t, f))| r.observe(o.batch, t * model::running_share(f.windows()), rho));
                let mut jumps: Vec<f64> = learned.collect();
                // One lift per shock, the median of its onsets: ranks that a shock slows together
                // are one event, not many.
                if let Some(mid) = (!jumps.is_empty()).then_some(jumps.len() / 2) {
                    let jump = *jumps.select_nth_unstable_by(mid, f64::total_cmp).1;
                    let (spread, kept) =
                        (jumps.iter().map(|d| (d - jump) * (d - jump)).sum::<f64>(), jumps.len() as f64);
                    self.onset_spread =
                        [0, 1].map(|k| self.onset_spread[k] * model::COUNT_FORGETTING + [spread, kept][k]);
                    // A ring of ONSETS_KEPT: it grows by one until full, then overwrites its oldest.
                    self.onsets.resize(self.onsets.len().max(self.next_onset + 1), jump);
                    (self.onsets[self.next_onset], self.next_onset) = (jump, (self.next_onset + 1) % ONSETS_KEPT);
                }
                self.shocks[1] += f64::from(u8::from(!jumps.is_empty()));
                // A rank whose time per sample moved since the last decision by what makes a lift.
                let x: Vec<f64> = obs.iter().zip(&times).map(|(o, t)| (t / (rho + o.batch as f64)).ln()).collect();
                let moved = |(r, (a, b)): (&RankModel, (&f64, &f64))| (a - b).abs() > r.threshold();
                let changed = self.ranks.iter().zip(x.iter().zip(&self.decided_at)).any(moved);
                let slowest = slowest + self.transfer;
                self.since = (self.since.0, self.since.1 + slowest, self.since.2 + 1);
                // A young model holds a split for at most half its age: its first splits are the
                // least informed, and the first costs measured the most inflated (cold code).
                let young = 2 * self.since.2 >= self.seen - self.cfg.warmup_iters;
                let share = if changed { MOVED_SHARE } else { DECISION_SHARE };
                let due = young || self.since.1 * share >= self.cost;
                // One iteration tells a rank's speed but not whether it lasts: the split moves
                // from the second on.
                self.since.0 = self.seen > self.cfg.warmup_iters + 1 && due;
                if self.since.0 {
                    // The split stays in play until the next decision is due, unless a rank's
                    // regime changes first: whole iterations, as a power of λ < 0 (a rank whose
                    // onsets and ends are each likelier than not alternates) has no fractional one.
                    // `max` before `min`, not `clamp`: a ratio with no number plans for one.
                    #[allow(clippy::manual_clamp)]
                    let horizon = (self.cost / (DECISION_SHARE * slowest)).round().max(1.0).min(1e9) as i32;
                    (self.sizes, self.independent) = self.decide(horizon);
                    (self.since.1, self.since.2, self.decided_at) = (0.0, 0, x);
                }
            }
        }
    }

    /// Under `proportional-epoch`, re-splits by the last epoch's throughput.
    fn end_epoch(&mut self) {
        if self.cfg.policy == PolicyKind::ProportionalEpoch
            && self.epoch_totals.iter().all(|&(b, t)| b > 0.0 && t > 0.0)
        {
            let lines: Vec<Line> = self.epoch_totals.iter().map(|&(b, t)| Line { alpha: 0.0, beta: t / b }).collect();
            self.sizes = equalize(&lines, self.global_batch, &self.bounds);
        }
        self.epoch_totals.iter_mut().for_each(|t| *t = (0.0, 0.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lbbsp(b: usize, n: usize) -> Balancer {
        Balancer::new(&BalanceConfig { policy: PolicyKind::Lbbsp, ..Default::default() }, b, n).unwrap()
    }

    #[test]
    fn policy_names_are_the_recipes() {
        for kind in [PolicyKind::Bsp, PolicyKind::Lbbsp, PolicyKind::ProportionalEpoch] {
            assert_eq!(serde_json::to_value(kind).unwrap().as_str(), Some(kind.name()));
        }
    }

    #[test]
    fn impossible_bounds_name_the_field() {
        let cfg = BalanceConfig::default();
        let e = Balancer::new(&cfg, 2, 3).unwrap_err().to_string();
        assert!(e.contains("train.global_batch") && e.contains("3 ranks"), "{e}");
        let cfg = BalanceConfig { b_max: Some(10), ..Default::default() };
        let e = Balancer::new(&cfg, 64, 3).unwrap_err().to_string();
        assert!(e.contains("balance.b_max"), "{e}");
    }

    /// Feeds `bal` 30 iterations in which rank `i` computes `b` samples in `time(i, b)` seconds.
    fn fed(bal: &mut Balancer, time: impl Fn(usize, usize) -> f64) {
        for _ in 0..30 {
            let obs: Vec<Observation> =
                bal.sizes().iter().enumerate().map(|(i, &b)| Observation::new(b, time(i, b))).collect();
            bal.observe(&obs);
        }
    }

    /// Feeds `bal` 300 iterations in which rank `i` computes `b` samples at iteration `k` in
    /// `time(k, i, b)` seconds, each step reporting the previous one's cost: `decision_s` where it
    /// decided, 1 µs where not. Returns whether each step decided.
    fn decisions(bal: &mut Balancer, decision_s: f64, mut time: impl FnMut(usize, usize, usize) -> f64) -> Vec<bool> {
        let (mut decided, mut cost) = (Vec::new(), 0.0);
        for k in 0..300 {
            let obs: Vec<Observation> = (0..bal.sizes().len())
                .map(|i| Observation {
                    balance_s: cost,
                    ..Observation::new(bal.sizes()[i], time(k, i, bal.sizes()[i]))
                })
                .collect();
            bal.observe(&obs);
            cost = if bal.since.0 { decision_s } else { 1e-6 };
            decided.push(bal.since.0);
        }
        decided
    }

    /// A quiet host's own preemptions (0.14 ms, 0.14% of the time, in 2 ms iterations of 5% noise)
    /// are not averaged over phases: they cost a decision four times its draws' time for a
    /// spread a tenth of the noise's. A quota's windows and a 100 ms quota's rare long ones are.
    #[test]
    fn only_windows_that_spread_a_draw_beyond_its_noise_are_averaged_over_phases() {
        // 64 samples at 31.25 µs each: 2 ms, with 5% noise.
        let law: Law = ([(1.0, (31.25e-6f64).ln() - 0.05 * 0.05 / 2.0), (0.0, 0.0), (0.0, 0.0)], 0.05);
        let decide = |windows: &[(f64, f64)]| phases(windows, &[law, law], &[64, 64], 0.0);
        assert_eq!(decide(&[(0.14e-3, 0.9986), (0.05e-3, 0.9989)]), 1);
        for window in [(1e-3, 0.5), (50e-3, 0.5), (4e-3, 0.7)] {
            assert_eq!(decide(&[(0.0, 1.0), window]), PHASES, "{window:?}");
        }
        // Windows no rank meets: none.
        assert_eq!(decide(&[(0.0, 1.0), (0.0, 1.0)]), 1);
    }

    #[test]
    fn decisions_are_spaced_by_their_cost_and_taken_at_once_on_a_change() {
        // Two ranks of ~1 ms iterations with ±2% noise; a decision costs 20 µs, so under steady
        // speeds one is due every ~20 ms; from iteration 200 rank 0 is three times slower.
        let mut bal = lbbsp(128, 2);
        let mut rng = Rng::from_keys(&[5]);
        let decided = decisions(&mut bal, 2e-5, |k, i, b| {
            let slow = if i == 0 && k >= 200 { 3.0 } else { 1.0 };
            slow * (1e-4 + 1.4e-5 * b as f64) * (1.0 + 0.02 * rng.normal() as f64)
        });
        let steady = decided[20..200].iter().filter(|d| **d).count();
        assert!((6..=20).contains(&steady), "{steady} decisions in 180 steady iterations");
        assert!(decided[200], "no decision at the change");
        assert!(bal.sizes()[0] < 50, "{:?}", bal.sizes());
    }

    /// Where some rank's speed moves at every iteration (ranks outnumbering cores), decisions
    /// still cost at most [`MOVED_SHARE`] of the time: here 10% of an iteration each, so at most
    /// one in ten iterations decides.
    #[test]
    fn speeds_that_move_every_iteration_do_not_decide_every_iteration() {
        let mut bal = lbbsp(128, 2);
        let decided = decisions(&mut bal, 1e-4, |k, i, b| {
            let slow = if i == 0 && k % 2 == 1 { 1.5 } else { 1.0 };
            slow * (1e-4 + 7e-6 * b as f64)
        });
        let n = decided[100..].iter().filter(|d| **d).count();
        assert!(n <= 20, "{n} decisions in 200 iterations");
    }

    #[test]
    fn a_slower_rank_gets_its_equal_time_share() {
        let mut bal = lbbsp(256, 2);
        fed(&mut bal, |i, b| (1.0 + 2.0 * i as f64) * (1e-4 + 1e-5 * b as f64));
        // 3× slower with the fixed cost (10 samples' worth) stretched alike: 3·(10 + b₁) = 10 + b₀.
        assert!(bal.sizes()[1].abs_diff(59) <= 2, "{:?}", bal.sizes());
    }

    /// A move goes ahead only for the gain it expects beyond how much more moves than the equal
    /// split have overrun their expected slowest time: a model whose moves overran by 10% keeps
    /// the equal split against a rank 5% slower.
    #[test]
    fn moves_that_overran_their_expectations_are_held_back() {
        let mut bal = lbbsp(256, 2);
        fed(&mut bal, |i, b| (1.0 + 0.05 * i as f64) * 1e-5 * b as f64);
        assert!(bal.sizes()[1] < 126, "a rank 5% slower sheds samples: {:?}", bal.sizes());
        bal.overruns = [[20.0, 20.0, 20.0], [22.0, 20.0, 20.0]];
        assert_eq!(bal.decide(1).0, vec![128, 128]);
        bal.overruns = [[22.0, 20.0, 20.0]; 2];
        assert_ne!(bal.decide(1).0, vec![128, 128], "overruns alike for both leave the move");
        // The equal split's iterations ran at half what was expected (a stall the expectation has
        // and the scored time has not), and no move was ever scored: that offset is the moves'
        // best guess too, so it holds back no first move.
        bal.overruns = [[10.0, 20.0, 20.0], [0.0; 3]];
        assert_ne!(bal.decide(1).0, vec![128, 128], "an offset seen on the equal split alone leaves the move");
    }

    /// Overruns are of the time, not of its logarithm: where the slowest rank is slow in every
    /// other iteration, the equal split's times are right on average, and the mean of their logs
    /// would read them as faster than expected (by Jensen's inequality), holding back moves.
    /// Each move scores the equal split too, at the speeds its iteration had.
    #[test]
    fn a_move_is_scored_beside_the_equal_split_by_their_times() {
        let mut bal = lbbsp(256, 2);
        // Rank 0 takes 0.5 s at 192 samples; rank 1, at 64, 0.25 s or 0.75 s (0.5 s or 1.5 s at 128).
        for t1 in [0.25, 0.75].repeat(10) {
            (bal.chosen, bal.equal_expected) = (Some((0.625, true)), 1.0);
            bal.surprised(&[Observation::new(192, 0.5), Observation::new(64, t1)], &[0.5, t1], t1.max(0.5), 0.0);
        }
        let [o0, o1] = bal.overruns;
        assert!((o0[0] / o0[1] - 1.0).abs() < 0.01 && (o1[0] / o1[1] - 1.0).abs() < 0.01, "{o0:?} {o1:?}");
        assert!((o0[2] - o1[2]).abs() < 1e-9, "each move scores both kinds once: {o0:?} {o1:?}");
    }

    /// Alike ranks with ±4% noise keep the equal split: no candidate is expected faster by more
    /// than the ranks' own errors tell.
    #[test]
    fn alike_noisy_ranks_keep_the_equal_split() {
        let mut bal = lbbsp(1024, 16);
        let mut rng = Rng::from_keys(&[7]);
        let mut moved = 0;
        for _ in 0..200 {
            let obs: Vec<Observation> = bal
                .sizes()
                .iter()
                .map(|&b| Observation::new(b, (1e-4 + 1e-5 * b as f64) * (1.0 + 0.04 * (2.0 * rng.next_f64() - 1.0))))
                .collect();
            bal.observe(&obs);
            let (lo, hi) = (bal.sizes().iter().min().unwrap(), bal.sizes().iter().max().unwrap());
            moved += usize::from(*hi as f64 > 1.1 * *lo as f64);
        }
        assert!(moved <= 10, "{moved} of 200 splits more than 10% apart: {:?}", bal.sizes());
    }

    /// A rank slowed 4× every other iteration is anticipated: it gets its slow share before its
    /// slow iterations and its equal share before its fast ones, never the other way round.
    #[test]
    fn an_alternating_rank_is_anticipated() {
        let mut bal = lbbsp(512, 4);
        let mut history = Vec::new();
        for k in 0..120 {
            let obs: Vec<Observation> = bal
                .sizes()
                .iter()
                .enumerate()
                .map(|(i, &b)| {
                    let f = if i == 0 && k % 2 == 0 { 4.0 } else { 1.0 };
                    Observation {
                        batch: b,
                        compute_s: f * 1e-5 * b as f64,
                        cpu_share: 1.0 / f,
                        preemptions: 0.0,
                        frozen_s: 0.0,
                        run_share: 0.0,
                        run_s: 0.0,
                        transfer_s: 0.0,
                        balance_s: 0.0,
                    }
                })
                .collect();
            bal.observe(&obs);
            history.push(bal.sizes()[0]);
        }
        // `history[k]` is the size of iteration k + 1: fast after an even k.
        for (k, &b) in history.iter().enumerate().skip(20) {
            let slow_next = k % 2 == 1;
            assert!(if slow_next { b <= 48 } else { b >= 120 }, "iteration {}: {b} ({history:?})", k + 1);
        }
    }

    /// A rank 4× slower in every other iteration, with a fixed cost of a quarter of the equal share
    /// (the stress test's measured case): the shape cannot be told from its sizes while every
    /// iteration changes its speed, and a shape of 0 would read its fewer samples as slower ones.
    #[test]
    fn an_alternating_rank_with_a_fixed_cost_keeps_half_its_share() {
        let mut bal = lbbsp(128, 2);
        let (mut rng, mut run, mut longest) = (Rng::from_keys(&[7]), 0, 0);
        for k in 0..400 {
            let f = |i: usize| if i == 1 && k % 2 == 0 { 4.0 } else { 1.0 };
            let obs: Vec<Observation> = (0..2)
                .map(|i| {
                    let b = bal.sizes()[i];
                    let t = f(i) * 2.4e-5 * (15.0 + b as f64) * (1.0 + 0.05 * rng.normal() as f64);
                    Observation { cpu_share: 0.6f64.powf(f(i).log(4.0)), ..Observation::new(b, t) }
                })
                .collect();
            // The equal-time share of rank 1 at this iteration's speeds: (15 + b1)·f = 15 + b0.
            let share = (143.0 - 15.0 * f(1)) / (1.0 + f(1));
            run = if (bal.sizes()[1] as f64) < 0.5 * share { run + 1 } else { 0 };
            longest = longest.max(run);
            bal.observe(&obs);
        }
        assert!(longest <= 5, "rank 1 below half its share for {longest} iterations");
    }

    /// A rank slower every other iteration has onsets and ends each likelier than not (`λ < 0`):
    /// its laws over any horizon are numbers. With a fractional horizon they were NaN, and its
    /// draws and plans with them.
    #[test]
    fn an_alternating_rank_has_laws_over_every_horizon() {
        let mut bal = lbbsp(256, 2);
        for k in 0..60 {
            let time = |i: usize, b: usize| (if i == 0 && k % 2 == 0 { 3.0 } else { 1.0 }) * 1e-5 * b as f64;
            let obs: Vec<Observation> =
                bal.sizes().iter().enumerate().map(|(i, &b)| Observation::new(b, time(i, b))).collect();
            bal.observe(&obs);
        }
        let [_, on, lifted, off, ..] = bal.ranks[0].counts();
        assert!(on > 0.0 && off > 0.5 * lifted, "{:?}", bal.ranks[0].counts());
        for h in [1, 2, 3, 7, 20, 1000] {
            let laws = bal.laws(h);
            assert!(laws.iter().all(|l| mean_time(l).is_finite()), "horizon {h}: {laws:?}");
        }
    }

    /// Two ranks, rank 1 under a CPU quota of `run` in every `period` seconds, busy-polling in the
    /// collective as MPI does: every rank's (size, wall seconds of compute) and the iteration's
    /// end on a shared clock. Returns rank 1's sizes.
    fn under_quota(run: f64, period: f64, global: usize, iterations: usize) -> Vec<usize> {
        under_quota_from(0.0, (run, period), global, iterations, |_| {})
    }

    /// [`under_quota`] from second `from` of the shared clock on, `watch` seeing the balancer after
    /// every iteration.
    fn under_quota_from(
        from: f64,
        (run, period): (f64, f64),
        global: usize,
        iterations: usize,
        mut watch: impl FnMut(&Balancer),
    ) -> Vec<usize> {
        let mut bal = lbbsp(global, 2);
        let running = |x: f64| x < from || x % period < run;
        let (mut clock, mut sizes, mut whole, mut last) = (0.0f64, Vec::new(), 0.0, 0.0);
        let tick = 1e-5;
        for _ in 0..iterations {
            let [b0, b1] = [bal.sizes()[0], bal.sizes()[1]];
            let cpu = |b: usize| 1e-4 + 1e-5 * b as f64;
            // Rank 1 runs only in its windows; count its freezes.
            let (mut t, mut done, mut freezes, mut was) = (clock, 0.0, 0.0, true);
            while done < cpu(b1) {
                let on = running(t);
                freezes += f64::from(u8::from(was && !on));
                was = on;
                done += if on { tick } else { 0.0 };
                t += tick;
            }
            let wall1 = t - clock;
            let mut end = clock + wall1.max(cpu(b0));
            while !running(end) {
                end += tick;
            }
            end += 1e-4;
            let obs = [
                Observation::new(b0, cpu(b0)),
                Observation {
                    batch: b1,
                    compute_s: wall1,
                    cpu_share: cpu(b1) / wall1,
                    preemptions: freezes,
                    frozen_s: wall1 - cpu(b1),
                    run_share: whole,
                    run_s: last,
                    transfer_s: 0.0,
                    balance_s: 0.0,
                },
            ];
            // The share over this iteration, which the next one reports.
            let steps = ((end - clock) / tick) as usize;
            whole = (0..steps).filter(|k| running(clock + *k as f64 * tick)).count() as f64 / steps as f64;
            (clock, last) = (end, end - clock);
            bal.observe(&obs);
            watch(&bal);
            sizes.push(bal.sizes()[1]);
        }
        sizes
    }

    /// A freeze far longer than an iteration (a 100 ms quota period at 1 ms iterations) lands in
    /// the collective whatever the split: the split stays equal, and the rank never starves.
    #[test]
    fn a_rank_frozen_in_long_windows_keeps_its_share() {
        let sizes = under_quota(0.05, 0.1, 128, 600);
        let equal = sizes[50..].iter().filter(|&&b| b.abs_diff(64) <= 4).count();
        assert!(equal * 10 >= 9 * 550 && sizes[50..].iter().all(|&b| b >= 32), "{equal} of 550: {sizes:?}");
    }

    /// A quota that begins after the rank's speed was learned (a 10 ms window every 20 ms at
    /// iterations of about 1 ms): learned as wall times, the windows once known made every later
    /// iteration read as a lift over the level learned before them (lifted in all of the last
    /// 400). Learned at full running, the rank is lifted only where a freeze fell in its compute
    /// (33).
    #[test]
    fn windows_learned_late_are_no_lasting_lift() {
        let mut lifted = Vec::new();
        under_quota_from(0.1, (0.01, 0.02), 128, 800, |bal| lifted.push(bal.ranks[1].lift().is_some()));
        let late = lifted[400..].iter().filter(|&&l| l).count();
        assert!(late <= 80, "lifted in {late} of the last 400 iterations");
    }

    /// The CI failure of `lbbsp_with_slowdown_keeps_the_one_rank_trajectory`, rebuilt: three ranks
    /// on two busy cores, where Open MPI yields the CPU while it waits, so a rank runs 2% of an
    /// 8 ms iteration (its 50-250 us of compute, at full speed) and every transfer lasts 6 ms.
    /// Rank 1 is 4x slower from iteration 10 and meets a 25 us preemption now and then. Read as
    /// windows of 25 us every 0.5 us of running, these made a stall of a second that hid the
    /// slowdown: the split stayed equal.
    #[test]
    fn a_collective_that_yields_its_cpu_does_not_hide_a_slow_rank() {
        let mut bal = lbbsp(64, 3);
        let mut sizes = Vec::new();
        for it in 0..100 {
            let obs: Vec<Observation> = (0..3)
                .map(|r| {
                    let b = bal.sizes()[r];
                    let cpu = (1.0 + 3.0 * f64::from(u8::from(r == 1 && it >= 10))) * 4e-6 * b as f64;
                    let frozen = if r == 1 && it % 7 == 3 { 25e-6 } else { 0.0 };
                    Observation {
                        batch: b,
                        compute_s: cpu + frozen,
                        cpu_share: cpu / (cpu + frozen),
                        preemptions: f64::from(u8::from(frozen > 0.0)),
                        frozen_s: frozen,
                        run_share: 0.02,
                        run_s: 6e-3,
                        transfer_s: 6e-3,
                        balance_s: 5e-6,
                    }
                })
                .collect();
            bal.observe(&obs);
            sizes.push(bal.sizes()[1]);
        }
        // Rank 1's equal-time share is 64/9, about 7.
        assert!(sizes[30..].iter().all(|&b| b <= 12), "{sizes:?}");
    }

    /// Freezes far shorter than an iteration (a 2 ms quota period at 20 ms iterations) make the rank
    /// half as fast: it gets about a third of the batch.
    #[test]
    fn a_rank_frozen_in_short_windows_gets_its_equal_time_share() {
        let sizes = under_quota(0.001, 0.002, 2048, 60);
        let b = sizes[59];
        assert!((600..=760).contains(&b), "{sizes:?}");
    }
}

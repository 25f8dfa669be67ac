//! The LB-BSP balancer: per-rank linear models of compute time, and the batch split that makes all
//! ranks finish together.
//!
//! Each rank `i` is modelled as `t_i(b) = α_i + β_i·b`, fitted online by least squares with
//! exponential forgetting over the observed `(b_i, t_i)` of past iterations, in two layers: the
//! slope `β_i` from a slowly forgotten history (λ_s), because only iterations in which `b_i` differed
//! tell anything about it; the level (the prediction at the recent sizes) from a quickly forgotten
//! one (λ). Named mechanisms, each with the case that needs it (docs/balancer.md):
//! - **probing**: the first iterations after the warm-up try sizes ±25% around the equal split, so
//!   the fixed cost is measured early;
//! - **the interference signal**: times are put on each rank's own CPU clock (`t·cpu_share`) and the
//!   next one is predicted at the share reported last, so a co-located job is no surprise;
//! - **change detection**: a two-sided CUSUM on `ln(t/predicted)`; below its threshold an
//!   observation is learned with its deviation clipped, past it the rank's speed changed and its
//!   history is rescaled by the excursion's mean deviation (contention stretches fixed and
//!   per-sample costs alike). A large deviation (`jump`) passes the threshold at once;
//! - **shape at a new size**: in an iteration whose size moved, a deviation within `detect` is the
//!   line's shape, learned whole and kept from the detector;
//! - **the pooled shape**: from 16 ranks on, the ranks share the median fixed-cost share `α/β`;
//! - **shrinking alike ranks**: each rank's speed is pulled towards the cluster's by the share of
//!   their spread that the levels' noise explains, so alike ranks keep an equal split;
//! - **the risk plan**: excursions from each rank's base speed (onsets, and whether lifts stay) are
//!   counted, and the split is planned for the smallest expected slowest time: the ranks at risk of
//!   an onset hedged at the typical onset's factor, a fresh lift planned at its base where lifts end
//!   at once.
//!
//! Given the planned lines, [`equalize`] chooses integer sizes with `Σ b_i = B` and `lo_i ≤ b_i ≤
//! hi_i` that minimise the predicted slowest time: the continuous optimum sets every unconstrained
//! rank to the same finishing time `T` (Newton's steps within a bisection's bracket), and rounding
//! hands the leftover samples one by one to the ranks whose predicted time grows least. A dead-band keeps the current split unless the new
//! one is predicted to be faster by more than a set fraction, so noise does not make sizes oscillate.
//!
//! Everything here is a pure function of its inputs, so every rank, fed the same gathered
//! observations, computes bit-identical sizes without a broadcast (f64 arithmetic in a fixed order;
//! Rust never contracts it into FMAs behind our back).

use crate::error::{Error, Result};
use crate::shard::equal_split;
use serde::{Deserialize, Serialize};
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// How batch sizes are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Plain BSP: equal split, never changes.
    #[default]
    Bsp,
    /// LB-BSP: re-fit and re-split before every allreduce.
    Lbbsp,
    /// Re-split once per epoch in proportion to each rank's throughput over the last epoch.
    ProportionalEpoch,
}

impl Policy {
    /// The name the recipe uses (`balance.policy`).
    pub fn name(self) -> &'static str {
        match self {
            Policy::Bsp => "bsp",
            Policy::Lbbsp => "lbbsp",
            Policy::ProportionalEpoch => "proportional-epoch",
        }
    }
}

/// The recipe's `[balance]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BalanceConfig {
    pub policy: Policy,
    /// Smallest batch a rank may get.
    pub b_min: usize,
    /// Largest batch a rank may get (e.g. a memory cap); `None` means B.
    pub b_max: Option<usize>,
    /// Forgetting factor λ of the level of the fits (weight of an observation `k` iterations old is λ^k).
    pub forgetting: f64,
    /// Forgetting factor λ_s of the slope of the fits (closer to 1: the slope is learned from the
    /// iterations in which sizes differed, which may be long ago).
    pub slope_forgetting: f64,
    /// The smallest relative change of a rank's speed the change detector looks for: its CUSUM's
    /// reference is half of it, `ln(1 + detect)/2` (see [`RankFit::observe_with`]).
    pub detect: f64,
    /// Keep the current split unless the new one is predicted faster by more than this fraction.
    pub dead_band: f64,
    /// The planned split plays only while its mean lead over the steadier alternatives
    /// ([`Steady`]) is this many deviations of that lead from one iteration to the next: where the
    /// candidates differ mostly by noise, the split that moves less plays.
    pub planned_lead: f64,
    /// The alternative in play stays unless the other is faster by more than this fraction.
    pub alternative_hold: f64,
    /// The planned splits' mean split moves only where some rank's mean has moved by more than
    /// this many standard errors of that mean (a planned split that swings swings its mean too).
    pub mean_hold: f64,
    /// A time this far from the prediction (`t/p > 1 + jump` or `p/t > 1 + jump`) is a change of
    /// speed at once: the detector's threshold is `ln(1 + jump) − ln(1 + detect)/2`. Every
    /// iteration spent waiting costs the whole cluster, while a one-off spike adopted costs one
    /// mis-split iteration (the trade-off on the simulator's suite: docs/simulator.md).
    pub jump: f64,
    /// Whether the ranks' CPU shares (the interference signal) enter the model: times are put on
    /// each rank's own CPU clock, and the next is predicted at the share reported last.
    pub signal: bool,
    /// Iterations at the start whose timings are ignored (cold caches, lazy page faults).
    pub warmup_iters: usize,
    /// Iterations after the warm-up in which `lbbsp` alternates sizes by ±`probe_amplitude`, so
    /// that each rank's fixed cost α is measured before it matters.
    pub probe_iters: usize,
    /// Relative size change of the probing iterations.
    pub probe_amplitude: f64,
    /// A metrics file (`lbbsp train --metrics`) of an earlier run whose per-iteration batch sizes
    /// this run uses instead of the policy's. A balanced split follows the timings of its run, so
    /// this is how an `lbbsp` run is reproduced bit for bit: same recipe, same world size, the
    /// first run's sizes. The policy still observes every iteration (its state is what it would be).
    pub replay: Option<std::path::PathBuf>,
}

impl Default for BalanceConfig {
    fn default() -> Self {
        BalanceConfig {
            policy: Policy::Bsp,
            b_min: 1,
            b_max: None,
            forgetting: 0.9,
            slope_forgetting: 0.995,
            // A co-located job often slows a rank by 15–25%: such a change must be detected.
            detect: 0.15,
            dead_band: 0.002,
            planned_lead: 0.4,
            alternative_hold: 0.01,
            mean_hold: 1.0,
            jump: 0.6,
            signal: true,
            warmup_iters: 5,
            probe_iters: 6,
            probe_amplitude: 0.25,
            replay: None,
        }
    }
}

impl BalanceConfig {
    /// Checks values that do not depend on the world size.
    pub fn validate(&self, global_batch: usize) -> Result<()> {
        if !(self.detect > 0.0 && self.detect.is_finite()) {
            return Err(Error::config("balance.detect", "must be > 0 (the smallest change of speed to detect)"));
        }
        if !(self.jump > self.detect && self.jump.is_finite()) {
            return Err(Error::config(
                "balance.jump",
                format!("must be above balance.detect = {} (a jump is a change too large to wait for)", self.detect),
            ));
        }
        if self.b_min == 0 {
            return Err(Error::config(
                "balance.b_min",
                "must be at least 1 (a rank with no samples has no speed to measure)",
            ));
        }
        if let Some(hi) = self.b_max {
            if hi < self.b_min {
                return Err(Error::config("balance.b_max", format!("{hi} is below balance.b_min = {}", self.b_min)));
            }
        }
        if !(self.forgetting > 0.0 && self.forgetting <= 1.0) {
            return Err(Error::config("balance.forgetting", "must be in (0, 1]"));
        }
        if !(self.slope_forgetting > 0.0 && self.slope_forgetting <= 1.0) {
            return Err(Error::config("balance.slope_forgetting", "must be in (0, 1]"));
        }
        if !(0.0..1.0).contains(&self.dead_band) {
            return Err(Error::config("balance.dead_band", "must be in [0, 1)"));
        }
        if !(self.planned_lead >= 0.0 && self.planned_lead.is_finite()) {
            return Err(Error::config("balance.planned_lead", "must be a finite number ≥ 0 (0: the mean lead alone)"));
        }
        if !(0.0..1.0).contains(&self.alternative_hold) {
            return Err(Error::config("balance.alternative_hold", "must be in [0, 1)"));
        }
        if !(self.mean_hold >= 0.0 && self.mean_hold.is_finite()) {
            return Err(Error::config(
                "balance.mean_hold",
                "must be a finite number of standard errors ≥ 0 (0: no hold)",
            ));
        }
        if !(0.0..1.0).contains(&self.probe_amplitude) {
            return Err(Error::config("balance.probe_amplitude", "must be in [0, 1)"));
        }
        let _ = global_batch;
        Ok(())
    }

    /// Per-rank bounds for `world` ranks, or an error naming the fix when no split of `B` exists.
    pub fn bounds(&self, global_batch: usize, world: usize) -> Result<Vec<(usize, usize)>> {
        let hi = self.b_max.unwrap_or(global_batch).min(global_batch);
        if global_batch < self.b_min * world {
            return Err(Error::config(
                "train.global_batch",
                format!(
                    "B = {global_batch} cannot give each of the {world} ranks at least balance.b_min = {} samples; \
                     raise train.global_batch to at least {} or run fewer ranks",
                    self.b_min,
                    self.b_min * world
                ),
            ));
        }
        if hi * world < global_batch {
            return Err(Error::config(
                "balance.b_max",
                format!("{world} ranks × b_max {hi} < B = {global_batch}; raise balance.b_max or run more ranks"),
            ));
        }
        Ok(vec![(self.b_min, hi); world])
    }
}

/// A fitted compute-time line `t(b) = alpha + beta·b` (seconds).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Line {
    pub alpha: f64,
    pub beta: f64,
}

impl Line {
    pub fn at(&self, b: usize) -> f64 {
        self.at_f(b as f64)
    }

    pub fn at_f(&self, b: f64) -> f64 {
        self.alpha + self.beta * b
    }

    /// The (fractional) size this line computes in `t` seconds.
    pub fn size_at(&self, t: f64) -> f64 {
        (t - self.alpha) / self.beta
    }

    /// The line `m` times slower: fixed and per-sample costs stretched alike.
    pub fn scaled(&self, m: f64) -> Line {
        Line { alpha: self.alpha * m, beta: self.beta * m }
    }
}

/// Exponentially weighted sums of `(b, t)` pairs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
struct Sums {
    w: f64,
    b: f64,
    t: f64,
    bb: f64,
    bt: f64,
}

impl Sums {
    fn add(&mut self, lambda: f64, b: f64, t: f64, w: f64) {
        for s in [&mut self.w, &mut self.b, &mut self.t, &mut self.bb, &mut self.bt] {
            *s *= lambda;
        }
        self.w += w;
        self.b += w * b;
        self.t += w * t;
        self.bb += w * b * b;
        self.bt += w * b * t;
    }
    /// Least-squares slope, if the sizes varied enough to tell one.
    fn slope(&self) -> Option<f64> {
        let var = self.w * self.bb - self.b * self.b;
        (var > 1e-9 * self.w * self.bb).then(|| (self.w * self.bt - self.b * self.t) / var)
    }
}

/// One side (`sign` +1: slower, −1: faster) of a two-sided CUSUM of the log-deviations `x =
/// ln(t / predicted)`: `g` accumulates `sign·x − k` while it stays positive. The reference is the
/// prediction when the excursion began (`drift` is how far the level has moved since), so the
/// clipped learning of the excursion's observations does not hide a change from the detector. The
/// excursion's mean deviation is the size of the change once `g` passes the threshold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
struct Cusum {
    g: f64,
    sum: f64,
    n: u32,
    drift: f64,
}

impl Cusum {
    fn add(&mut self, sign: f64, x: f64, k: f64) {
        let x = x + self.drift;
        self.g += sign * x - k;
        if self.g <= 0.0 {
            *self = Cusum::default();
        } else {
            self.sum += x;
            self.n += 1;
        }
    }

    fn open(&self) -> bool {
        self.n > 0
    }

    /// The level's log-move `d` since the last observation, while the excursion is open.
    fn moved(&mut self, d: f64) {
        if self.open() {
            self.drift += d;
        }
    }

    /// How much to rescale the current level by: the excursion's mean deviation from its
    /// reference, less what the level has moved since.
    fn change(&self) -> f64 {
        (self.sum / self.n.max(1) as f64 - self.drift).exp()
    }
}

/// Online model of one rank's compute time (see the module docs): the level, a point `(b̄, t̄)` on
/// the rank's current line; the slope, from slowly forgotten sums; the change detector.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RankFit {
    fast: Sums,
    slow: Sums,
    up: Cusum,
    down: Cusum,
    /// The CPU share the rank reported last (1 when it reports none): its next time is predicted
    /// at that share.
    share: f64,
    /// Size of the previous observation.
    last_b: f64,
    /// Observations the current excursion has lasted beyond its onset.
    age: u32,
    /// The rank's own onset rate: the mean of `[onset]` over its observations that began at its base
    /// speed, forgotten with `slope_forgetting`, in two counts that share the observations out:
    /// one picks the ranks at risk and the other measures their risk (see [`Balancer::plan`]).
    onsets: [Forgotten; 2],
    /// Observations so far, which decide the count an observation goes to.
    observed: u64,
    /// The mean square of the log-deviations `x` fed to the detector (each within ±ln(1 + detect),
    /// so that spikes and changes do not count), forgotten with `slope_forgetting`: the rank's
    /// noise, from which the noise of its level follows ([`RankFit::level_noise`]).
    noise: Forgotten,
    /// How far the detector's alarms have lifted the rank above its base speed, `ln(level/base)`
    /// (0 at its base): an excursion the risk model ([`Risk`]) asks the fate of.
    lift: f64,
}

/// An exponentially forgotten mean, `Σ λ^k·x_k / Σ λ^k` over observations `k` old.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
struct Forgotten {
    w: f64,
    sum: f64,
}

impl Forgotten {
    fn add(&mut self, lambda: f64, x: f64) {
        (self.w, self.sum) = (lambda * self.w + 1.0, lambda * self.sum + x);
    }

    /// The mean, 0 before any observation.
    fn mean(&self) -> f64 {
        if self.w > 0.0 {
            self.sum / self.w
        } else {
            0.0
        }
    }
}

/// What one observation told about a rank's excursion from its base speed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Excursion {
    /// At its base speed before and after.
    None,
    /// An alarm, or a fall of its CPU share, lifted a rank at its base speed by this log-factor.
    Onset(f64),
    /// A rank lifted before is still lifted, by `lift`; `old` if it already was the iteration
    /// before (its onset is not the last observation).
    Stayed { lift: f64, old: bool },
    /// A rank lifted before is back at its base speed.
    Ended { old: bool },
}

impl RankFit {
    /// The current fit (at a CPU share of 1), or `None` before any observation.
    pub fn line(&self) -> Option<Line> {
        let (b_mean, t_mean) = self.level()?;
        Some(self.own_line().unwrap_or(Line { alpha: 0.0, beta: (t_mean / b_mean).max(1e-12) }))
    }

    /// Mean size and time of the recent (quickly forgotten) observations.
    fn level(&self) -> Option<(f64, f64)> {
        let f = &self.fast;
        (f.w > 0.0 && f.b > 0.0 && f.t > 0.0).then(|| (f.b / f.w, f.t / f.w))
    }

    /// The two-parameter line through the level with the slowly forgotten slope, once that slope is
    /// known and leaves a fixed cost `α ≥ 0`.
    fn own_line(&self) -> Option<Line> {
        let (b_mean, t_mean) = self.level()?;
        let beta = self.slow.slope().filter(|b| *b > 0.0 && b.is_finite())?;
        let alpha = t_mean - beta * b_mean;
        (alpha >= 0.0).then_some(Line { alpha, beta })
    }

    /// The rank's own fixed cost in samples' worth, `α/β`, once its slope is known.
    fn shape(&self) -> Option<f64> {
        self.own_line().map(|l| l.alpha / l.beta)
    }

    /// The line through the rank's recent level (mean size and time) whose fixed cost is `rho`
    /// samples' worth: `t = β·(ρ + b)`. With a shape shared by all ranks, each rank has one
    /// parameter left, its speed, which noisy sizes that barely moved cannot make degenerate.
    pub fn line_with(&self, rho: Option<f64>) -> Option<Line> {
        let Some(rho) = rho else { return self.line() };
        let (b_mean, t_mean) = self.level()?;
        let beta = t_mean / (rho + b_mean);
        Some(Line { alpha: rho * beta, beta: beta.max(1e-12) })
    }

    /// The predicted line of the next iteration: [`RankFit::line_with`] at the last reported CPU
    /// share (a rank given half its core takes twice as long).
    pub fn next_line(&self, rho: Option<f64>) -> Option<Line> {
        let s = self.share();
        self.line_with(rho).map(|l| Line { alpha: l.alpha / s, beta: l.beta / s })
    }

    /// The CPU share the rank reported last (1 before any report).
    fn share(&self) -> f64 {
        if self.share > 0.0 {
            self.share
        } else {
            1.0
        }
    }

    /// Adds `(b, u)` to the level's and the slope's sums, each with its forgetting.
    fn learn(&mut self, cfg: &BalanceConfig, b: f64, u: f64) {
        self.fast.add(cfg.forgetting, b, u, 1.0);
        self.slow.add(cfg.slope_forgetting, b, u, 1.0);
    }

    /// Feeds one observation of `t` seconds at `b` samples, the rank having had all of its CPU.
    pub fn observe(&mut self, b: usize, t: f64, cfg: &BalanceConfig) {
        self.observe_with(b, t, 1.0, cfg, None);
    }

    /// How much slower than its base speed the rank's next iteration is predicted, as a log
    /// factor: the lift of the detector's alarms, and the CPU share co-located jobs left it.
    pub fn excess(&self) -> f64 {
        self.lift - self.share().ln()
    }

    /// Whether the rank is on an excursion: predicted slower than its base by more than the
    /// smallest change the detector looks for.
    fn lifted(&self, cfg: &BalanceConfig) -> bool {
        self.excess() > cfg.detect.ln_1p()
    }

    /// The variance of the log of the rank's level from noise alone ([`forgotten_mean_variance`]
    /// of the log-deviations' mean square).
    pub fn level_noise(&self, cfg: &BalanceConfig) -> f64 {
        forgotten_mean_variance(self.noise.mean(), cfg.forgetting)
    }

    /// Whether the rank is on an excursion that has lasted beyond its onset.
    fn lifted_long(&self, cfg: &BalanceConfig) -> bool {
        self.lifted(cfg) && self.age > 0
    }

    /// The excursion an observation leaves, given whether the rank was lifted before it (and for
    /// how long), and counts its age.
    fn excursion(&mut self, was: bool, cfg: &BalanceConfig) -> Excursion {
        let old = self.age > 0;
        let e = match (was, self.lifted(cfg)) {
            (false, false) => Excursion::None,
            (false, true) => Excursion::Onset(self.excess()),
            (true, true) => Excursion::Stayed { lift: self.excess(), old },
            (true, false) => Excursion::Ended { old },
        };
        self.age = if matches!(e, Excursion::Stayed { .. }) { self.age + 1 } else { 0 };
        if !was {
            // Shared out by the fractional part of n·(golden ratio), which follows no period: with
            // alternating counts, onsets that recur every even number of iterations all fall in one.
            let which = (self.observed as f64 * 0.618_033_988_749_895).fract() < 0.5;
            self.onsets[which as usize].add(cfg.slope_forgetting, matches!(e, Excursion::Onset(_)) as u8 as f64);
        }
        self.observed += 1;
        e
    }

    /// Feeds one observation: `t` seconds at `b` samples with a CPU share `share` ∈ (0, 1], the
    /// line predicted with the shared shape `rho` (see [`RankFit::line_with`]).
    ///
    /// The time is first put on the rank's own CPU clock, `u = t·share`: what co-located jobs take
    /// is then no surprise, and the next prediction divides by the share reported last. Then, with
    /// `x = ln(u / predicted)`:
    /// - in an iteration whose size moved by more than 10%, an `x` within `ln(1 + detect)` is the
    ///   line's shape showing: learned whole, and kept from the change detector;
    /// - otherwise `x` feeds a two-sided CUSUM with reference `k = ln(1 + detect)/2` and threshold
    ///   `h = ln(1 + jump) − k`. Below the threshold, the observation is learned with its deviation
    ///   clipped to `±detect/2`, so noise and one-off spikes move the fit little (before the slope
    ///   is known, nothing predicts the shape, and it is learned whole). Past it, the rank's speed
    ///   changed: the history is rescaled by the excursion's mean deviation (which scales α and β
    ///   alike: contention stretches both) and learning goes on from the new speed. A deviation of
    ///   `1 + jump` alarms at once, a change of `1 + detect` within a few iterations (`h/(x − k)`),
    ///   and noise that changes sign restarts the sums.
    ///
    /// Alarms also move the rank's lift above its base speed; what that did is returned.
    pub fn observe_with(&mut self, b: usize, t: f64, share: f64, cfg: &BalanceConfig, rho: Option<f64>) -> Excursion {
        let was = self.lifted(cfg);
        if b == 0 || !(t.is_finite() && t > 0.0) {
            return self.excursion(was, cfg);
        }
        self.share = if share.is_finite() { share.clamp(MIN_SHARE, 1.0) } else { 1.0 };
        let (b, u) = (b as f64, t * self.share);
        let moved = (b - self.last_b).abs() > 0.1 * self.last_b;
        self.last_b = b;
        let Some(line) = self.line_with(rho) else {
            self.learn(cfg, b, u);
            return self.excursion(was, cfg);
        };
        let predicted = line.at_f(b).max(1e-12);
        let x = (u / predicted).ln();
        let k = 0.5 * cfg.detect.ln_1p();
        let alarm = if moved && x.abs() <= cfg.detect.ln_1p() {
            // At a new size, a surprise within the smallest change of speed worth detecting is
            // the line's shape showing: learned whole, and no evidence of a change of speed.
            self.learn(cfg, b, u);
            false
        } else {
            self.detect(cfg, b, u, predicted, x, rho)
        };
        // The lift follows the level while the rank is lifted, so an excursion that fades without
        // an alarm ends too; at its base, only an alarm lifts it.
        if alarm || self.lift > 0.0 {
            if let Some(now) = self.line_with(rho) {
                self.lift = (self.lift + (now.at_f(b).max(1e-12) / predicted).ln()).max(0.0);
            }
            // Back within the detector's reference of the base speed is back at it.
            if self.lift <= k {
                self.lift = 0.0;
            }
        }
        self.excursion(was, cfg)
    }

    /// The change detector's part of [`RankFit::observe_with`]: feeds `x` to the CUSUM and learns
    /// `(b, u)`, rescaled on an alarm or clipped below it. Returns whether it alarmed.
    fn detect(&mut self, cfg: &BalanceConfig, b: f64, u: f64, predicted: f64, x: f64, rho: Option<f64>) -> bool {
        let k = 0.5 * cfg.detect.ln_1p();
        let h = cfg.jump.ln_1p() - k;
        let c = x.clamp(-cfg.detect.ln_1p(), cfg.detect.ln_1p());
        self.noise.add(cfg.slope_forgetting, c * c);
        self.up.add(1.0, x, k);
        self.down.add(-1.0, x, k);
        if let Some(side) = [self.up, self.down].into_iter().find(|c| c.g > h) {
            let r = side.change();
            for s in [&mut self.fast, &mut self.slow] {
                s.t *= r;
                s.bt *= r;
            }
            (self.up, self.down) = (Cusum::default(), Cusum::default());
            self.learn(cfg, b, u);
            return true;
        }
        let learned = if self.slow.slope().is_none() {
            u
        } else {
            // Clipped in proportion, symmetrically: a clip in the log would bias the level up.
            let c = 0.5 * cfg.detect;
            predicted * (1.0 + (u / predicted - 1.0).clamp(-c, c))
        };
        self.learn(cfg, b, learned);
        if self.up.open() || self.down.open() {
            if let Some(now) = self.line_with(rho) {
                let d = (now.at_f(b).max(1e-12) / predicted).ln();
                self.up.moved(d);
                self.down.moved(d);
            }
        }
        false
    }
}

/// The smallest CPU share taken from a report: below it a rank is all but stopped, and a time
/// divided by it is no longer a prediction.
const MIN_SHARE: f64 = 0.05;

/// One rank's measurements of one iteration.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    pub batch: usize,
    /// Seconds of forward + backward of the rank's slice (waiting excluded).
    pub compute_s: f64,
    /// The fraction of its cores' time the rank had while computing, in (0, 1] (1 when unknown):
    /// the interference signal.
    pub cpu_share: f64,
}

impl Observation {
    /// An observation with no interference signal.
    pub fn new(batch: usize, compute_s: f64) -> Observation {
        Observation { batch, compute_s, cpu_share: 1.0 }
    }
}

/// The balancer's whole state (part of a checkpoint).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Balancer {
    pub cfg: BalanceConfig,
    pub global_batch: usize,
    pub bounds: Vec<(usize, usize)>,
    pub sizes: Vec<usize>,
    pub fits: Vec<RankFit>,
    /// Iterations observed so far.
    pub seen: usize,
    /// Per-rank `(Σ b, Σ t)` of the current epoch (for `proportional-epoch`).
    pub epoch_totals: Vec<(f64, f64)>,
    /// The shared shape ([`pooled_shape`]) averaged over iterations with the slope's forgetting:
    /// `(Σ λ_s^k·ρ_k, Σ λ_s^k)`. One iteration's median moves with the noise of a few ranks; the
    /// shape itself changes only when the model or the hardware does.
    #[serde(default)]
    pub shape: (f64, f64),
    /// What excursions from base speeds have done lately (the risk model).
    #[serde(default)]
    pub risk: Risk,
    /// The two alternatives to the planned split, and the scores that choose which one plays
    /// (see [`Steady`]); `lbbsp` only.
    #[serde(default)]
    pub steady: Steady,
}

/// Two more candidate splits for `lbbsp`, which do not follow the last iterations: the split
/// that equalises every rank's long-run time per sample (its sizes and times summed, forgotten with
/// `slope_forgetting`), and the planned splits' own recent mean (forgotten with `forgetting`).
///
/// The planned split follows what the last iterations predict. Where they predict nothing,
/// because every rank's speed is drawn afresh each iteration (8 ranks on 2 cores) or alternates,
/// following them is slower than the long-run split or the planned splits' mean, and the scores
/// show it. Each iteration all three are scored on the times the ranks took, as if each had been
/// played (each rank's time moved along its own line to the candidate's size): the log of the
/// slowest rank's time under each alternative less that under the planned split, averaged with
/// `forgetting`. The planned split plays only while its mean lead over the better alternative is
/// `balance.planned_lead` deviations of that lead from one iteration to the next: a planned split
/// level with the alternatives on average moves far more than they do, and turns with each turn of
/// the noise (8 ranks on 2 cores, where a rank keeps or loses a core for a few iterations).
/// - The planned split gives way when its lead falls below that level less the hysteresis (the
///   dead-band and two standard errors of the mean).
/// - It comes back when its lead passes the level and the hysteresis, so a run of lucky iterations
///   of a split that chases noise does not bring it back; or at once when the alternative in play
///   was slower by a jump (`balance.jump`) beyond three of its deviations so far, a change of
///   speed, which the alternatives follow late.
/// - Of the two alternatives, the one in play stays unless the other is faster by
///   `balance.alternative_hold`: alike on average, they would otherwise take turns in phase with a
///   rank that alternates.
/// - The mean split moves only where some rank's mean has moved by more than
///   `balance.mean_hold` standard errors of it: the mean of a planned split that swings every
///   iteration swings with the same period, by less.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Steady {
    /// The long-run split (empty before the first observation that counts) and its sums: per
    /// rank, the forgotten `(Σ b, Σ t)`.
    pub sizes: Vec<usize>,
    pub totals: Vec<(f64, f64)>,
    /// The planned splits' forgotten mean, and that mean as a split of B.
    pub mean: Vec<f64>,
    pub mean_sizes: Vec<usize>,
    /// The planned splits' forgotten mean square, per rank (the mean's standard error).
    #[serde(default)]
    pub mean_squares: Vec<f64>,
    /// For the long-run and the mean split, the forgotten sums of `d` and `d²`, `d` the log of its
    /// slowest rank's time less the planned split's; then the forgotten `Σ w` and `Σ w²` (the
    /// weights' effective count is `(Σ w)²/Σ w²`).
    pub scores: [(f64, f64); 2],
    pub weights: (f64, f64),
    /// The candidate in play: 0 planned, 1 long-run, 2 mean.
    pub play: usize,
    /// Per alternative, its last `d` and the forgotten `(Σ w, Σ w·(d − d_before)²/2)`.
    #[serde(default)]
    pub last: [f64; 2],
    #[serde(default)]
    pub jitter: [(f64, f64); 2],
}

/// The risk model: how often, in an iteration, some rank at its base speed is lifted (an onset)
/// and by how much, and how often some lifted rank stays lifted, apart for fresh lifts (their onset
/// the iteration before) and old ones: a one-off spike ends at once, a hog stays, and a lift that
/// has lasted is likelier to last. Pooled over the ranks and forgotten with `slope_forgetting`.
/// Counted per iteration rather than per rank, so that onsets that come together (a square wave)
/// count once, and the largest is the one that sets the time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Risk {
    /// Over iterations that began with a rank at its base speed: `(Σ w, Σ w·[an onset],
    /// Σ w·[an onset]·largest onset lift)`.
    onset: (f64, f64, f64),
    /// The same over iterations that began with a fresh lift, for "one stayed".
    fresh: (f64, f64, f64),
    /// The same over iterations that began with an old lift.
    old: (f64, f64, f64),
}

/// Forgets `s` by `lambda` and adds an iteration in which the event `hit` (the largest lift with
/// it) happened or not.
fn count(s: &mut (f64, f64, f64), lambda: f64, hit: Option<f64>) {
    *s = (lambda * s.0 + 1.0, lambda * s.1, lambda * s.2);
    if let Some(l) = hit {
        s.1 += 1.0;
        s.2 += l;
    }
}

impl Risk {
    /// Records one iteration's excursions.
    fn record(&mut self, lambda: f64, events: impl Iterator<Item = Excursion>) {
        // Per kind of rank: whether any began the iteration so, and the largest lift of the event.
        let mut seen = [(false, None::<f64>); 3];
        let mut hit = |k: usize, lift: Option<f64>| {
            seen[k].0 = true;
            if let Some(l) = lift {
                seen[k].1 = Some(seen[k].1.map_or(l, |m: f64| m.max(l)));
            }
        };
        for e in events {
            match e {
                Excursion::None => hit(0, None),
                Excursion::Onset(l) => hit(0, Some(l)),
                Excursion::Stayed { lift, old } => hit(1 + old as usize, Some(lift)),
                Excursion::Ended { old } => hit(1 + old as usize, None),
            }
        }
        for (s, (began, event)) in [&mut self.onset, &mut self.fresh, &mut self.old].into_iter().zip(seen) {
            if began {
                count(s, lambda, event);
            }
        }
    }

    /// The probability that some rank at its base speed has an onset next iteration, and the log
    /// factor of the largest (0 before any was seen).
    fn onset(&self) -> (f64, f64) {
        let (w, n, l) = self.onset;
        if n > 0.0 {
            (n / w, l / n)
        } else {
            (0.0, 0.0)
        }
    }

    /// The probability that some lifted rank (fresh or old) stays lifted next iteration, and the log
    /// factor of the largest that stays (`None` before any stayed). Before lifts were seen to end
    /// or stay, they are taken to stay, as the detector assumes: one iteration's worth of prior.
    fn stay(&self, old: bool) -> (f64, Option<f64>) {
        let (w, n, l) = if old { self.old } else { self.fresh };
        ((n + 1.0) / (w + 1.0), (n > 0.0).then(|| l / n))
    }
}

/// The multiples of the pool's onset rate that split the base ranks into risk levels.
const RISK_LEVELS: [f64; 5] = [0.5, 1.0, 2.0, 4.0, 8.0];

/// Sums over a group of base ranks (see [`Balancer::plan`]).
#[derive(Debug, Clone, Copy, Default)]
struct Group {
    /// Σ 1/β.
    speed: f64,
    /// Σ w and Σ onsets of the measuring count.
    seen: f64,
    onsets: f64,
    ranks: f64,
}

impl Group {
    fn add(self, o: &Group) -> Group {
        Group {
            speed: self.speed + o.speed,
            seen: self.seen + o.seen,
            onsets: self.onsets + o.onsets,
            ranks: self.ranks + o.ranks,
        }
    }
}

/// The lifted ranks of one kind (see [`Balancer::plan`]).
#[derive(Debug, Clone, Copy)]
struct Lifted {
    any: bool,
    /// Σ 1/β at the current speed, and at the base.
    speed_now: f64,
    speed_base: f64,
    /// The probability that one stays lifted, and the largest factor that stays.
    p_stay: f64,
    stay: f64,
    /// e^-(mean lift): where they stand if all are back at their base.
    back: f64,
}

impl Balancer {
    /// Starts from the equal split; fails with a clear message when no split respects the bounds.
    pub fn new(cfg: &BalanceConfig, global_batch: usize, world: usize) -> Result<Balancer> {
        cfg.validate(global_batch)?;
        let bounds = cfg.bounds(global_batch, world)?;
        Ok(Balancer {
            cfg: cfg.clone(),
            global_batch,
            bounds,
            sizes: equal_split(global_batch, world),
            fits: vec![RankFit::default(); world],
            seen: 0,
            epoch_totals: vec![(0.0, 0.0); world],
            shape: (0.0, 0.0),
            risk: Risk::default(),
            steady: Steady::default(),
        })
    }

    /// The shared shape in use, once any rank's slope is known.
    pub fn shape(&self) -> Option<f64> {
        (self.shape.1 > 0.0).then(|| self.shape.0 / self.shape.1)
    }

    /// The split of the next full global batch.
    pub fn sizes(&self) -> &[usize] {
        match self.steady.play {
            1 => &self.steady.sizes,
            2 => &self.steady.mean_sizes,
            _ => &self.sizes,
        }
    }

    /// The split of a global batch of `total` samples: [`Balancer::sizes`] for a full batch; for the
    /// short last batch of an epoch, the same shares above every rank's lower bound, so that the
    /// bounds hold there too.
    pub fn split(&self, total: usize) -> Vec<usize> {
        let lows: Vec<usize> = self.bounds.iter().map(|b| b.0).collect();
        crate::shard::rescale_above(self.sizes(), total, &lows)
    }

    /// Records every rank's measurements of the iteration just computed and, under `lbbsp`, picks
    /// the split of the next iteration. Called on every rank with the same (gathered) input.
    pub fn observe(&mut self, obs: &[Observation]) {
        assert_eq!(obs.len(), self.sizes.len(), "one observation per rank");
        self.seen += 1;
        // The short last batch of an epoch is left out: its sizes are not the ones being tuned.
        let full = obs.iter().map(|o| o.batch).sum::<usize>() == self.global_batch;
        if self.seen <= self.cfg.warmup_iters || !full {
            return;
        }
        for (o, tot) in obs.iter().zip(self.epoch_totals.iter_mut()) {
            tot.0 += o.batch as f64;
            tot.1 += o.compute_s;
        }
        // `proportional-epoch` splits by the epoch's totals alone: fits would be work nobody reads.
        if self.cfg.policy == Policy::ProportionalEpoch {
            return;
        }
        let rho = self.shape();
        let cfg = &self.cfg;
        let events = self.fits.iter_mut().zip(obs).map(|(fit, o)| {
            let share = if cfg.signal { o.cpu_share } else { 1.0 };
            fit.observe_with(o.batch, o.compute_s, share, cfg, rho)
        });
        self.risk.record(cfg.slope_forgetting, events);
        if let Some(m) = pooled_shape(&self.fits) {
            let l = self.cfg.slope_forgetting;
            self.shape = (l * self.shape.0 + m, l * self.shape.1 + 1.0);
        }
        if self.cfg.policy == Policy::Lbbsp && self.seen < self.cfg.warmup_iters + self.cfg.probe_iters {
            self.sizes = self.probe(self.seen);
        } else if self.cfg.policy == Policy::Lbbsp {
            self.choose_split(obs);
            // While an alternative plays, the planned split moves from the one played, a step of
            // the balancer from where the cluster is: planned from splits nobody ran, its steps
            // would go unchecked. Coming back, it moves on from its own last step.
            if self.steady.play > 0 {
                for (b, o) in self.sizes.iter_mut().zip(obs) {
                    *b = o.batch;
                }
            }
            let rho = self.shape();
            let lines: Option<Vec<Line>> = self.fits.iter().map(|f| f.next_line(rho)).collect();
            if let Some(lines) = lines {
                let lines = self.shrink(lines);
                let plan = self.plan(&lines);
                let planned: Vec<Line> = lines.iter().zip(&plan).map(|(l, &m)| l.scaled(m)).collect();
                self.adopt(&planned);
            }
        }
    }

    /// Scores the candidate splits of the iteration just observed on its times and chooses the one
    /// to play next; then moves the long-run and the mean split ([`Steady`]).
    fn choose_split(&mut self, obs: &[Observation]) {
        let rho = self.shape();
        let lines: Option<Vec<Line>> = self.fits.iter().map(|f| f.line_with(rho)).collect();
        let (l, band) = (self.cfg.forgetting, -(1.0 - self.cfg.dead_band).ln());
        let st = &mut self.steady;
        if let (Some(lines), false) = (lines, st.sizes.is_empty() || st.mean_sizes.is_empty()) {
            // The slowest time of a candidate: each rank's time moved along its line to the
            // candidate's size.
            let slowest = |c: &[usize]| {
                obs.iter()
                    .zip(&lines)
                    .zip(c)
                    .map(|((o, l), &b)| o.compute_s * l.at(b) / l.at(o.batch).max(1e-300))
                    .fold(0.0, f64::max)
            };
            let planned = slowest(&self.sizes).ln();
            let (before, w_before) = (st.scores, st.weights.0);
            let mut now = [0.0; 2];
            let cands = [&st.sizes, &st.mean_sizes];
            for k in 0..2 {
                let d = slowest(cands[k]).ln() - planned;
                if d.is_finite() {
                    let s = st.scores[k];
                    st.scores[k] = (l * s.0 + d, l * s.1 + d * d);
                    if w_before > 0.0 {
                        let (j, step) = (st.jitter[k], d - st.last[k]);
                        st.jitter[k] = (l * j.0 + 1.0, l * j.1 + 0.5 * step * step);
                    }
                    st.last[k] = d;
                    now[k] = d;
                }
            }
            st.weights = (l * st.weights.0 + 1.0, l * l * st.weights.1 + 1.0);
            // Against each alternative: the planned split's mean lead (the mean `d`); the lead it
            // needs to play, `planned_lead` deviations of `d` from one iteration to the next (half
            // the mean squared step: a change of speed moves `d` once and is not noise); and the
            // hysteresis about that, the dead-band and two standard errors of the mean.
            let (w, w2) = st.weights;
            let against = |k: usize| {
                let (jw, j) = st.jitter[k];
                let noise = if jw > 0.0 { (j / jw).sqrt() } else { 0.0 };
                (st.scores[k].0 / w, self.cfg.planned_lead * noise, band + 2.0 * noise * (w2.sqrt() / w))
            };
            let (a, b) = (against(0), against(1));
            // The alternative in play stays unless the other leads it by `alternative_hold`: two
            // alike alternatives otherwise take turns in phase with a rank that alternates.
            let hold = -(1.0 - self.cfg.alternative_hold).ln();
            let better = match st.play {
                1 if a.0 <= b.0 + hold => 1,
                2 if b.0 <= a.0 + hold => 2,
                _ if a.0 <= b.0 => 1,
                _ => 2,
            };
            let (alt, (ahead, needed, margin)) = if better == 1 { (1, a) } else { (2, b) };
            // The planned split comes back at once when the alternative in play was slower by a
            // jump this iteration, and by more than three of its deviations so far: a change of
            // speed, which the alternatives follow late (where such losses are the usual noise,
            // as on 8 ranks sharing 2 cores, they are not one).
            let jumped = st.play > 0 && w_before > 0.0 && {
                let (mean, sd) = moments(before[st.play - 1], w_before);
                let d = now[st.play - 1];
                d > self.cfg.jump.ln_1p() && d > mean + 3.0 * sd
            };
            st.play = match st.play {
                0 if ahead < needed - margin => alt,
                0 => 0,
                _ if jumped || ahead > needed + margin => 0,
                _ => alt,
            };
        }
        self.move_alternatives(obs);
    }

    /// Adds the iteration to the long-run totals and the planned splits' mean, and re-splits both.
    fn move_alternatives(&mut self, obs: &[Observation]) {
        let st = &mut self.steady;
        if st.totals.len() != obs.len() {
            st.totals = vec![(0.0, 0.0); obs.len()];
            st.mean = self.sizes.iter().map(|&b| b as f64).collect();
        }
        let ls = self.cfg.slope_forgetting;
        for (tot, o) in st.totals.iter_mut().zip(obs) {
            *tot = (ls * tot.0 + o.batch as f64, ls * tot.1 + o.compute_s);
        }
        let f = self.cfg.forgetting;
        if st.mean_squares.len() != st.mean.len() {
            st.mean_squares = st.mean.iter().map(|m| m * m).collect();
        }
        for ((m, q), &b) in st.mean.iter_mut().zip(st.mean_squares.iter_mut()).zip(&self.sizes) {
            *m = f * *m + (1.0 - f) * b as f64;
            *q = f * *q + (1.0 - f) * (b * b) as f64;
        }
        if st.totals.iter().all(|&(b, t)| b > 0.0 && t > 0.0) {
            let long: Vec<Line> = st.totals.iter().map(|&(b, t)| Line { alpha: 0.0, beta: t / b }).collect();
            st.sizes = equalize(&long, self.global_batch, &self.bounds);
        }
        // Sizes in proportion to the mean: the lines of ranks that take `mean_i` samples per second.
        let by_mean: Vec<Line> = st.mean.iter().map(|&m| Line { alpha: 0.0, beta: 1.0 / m.max(1e-9) }).collect();
        let moved = equalize(&by_mean, self.global_batch, &self.bounds);
        // The mean split moves only where some rank's mean has moved by more than `mean_hold`
        // standard errors of that mean: a planned split that swings every iteration swings its
        // mean too, by less but with the same period (with forgetting λ, a swing of ±A every
        // other iteration leaves ±A·(1 − λ)/(1 + λ) in the mean, always within its standard
        // error A·√((1 − λ)/(1 + λ))).
        let k = self.cfg.mean_hold;
        let within = |(i, (&new, &old)): (usize, (&usize, &usize))| {
            let (m, q) = (st.mean[i], st.mean_squares[i]);
            let se = forgotten_mean_variance((q - m * m).max(0.0), f).sqrt();
            (new as f64 - old as f64).abs() <= k * se
        };
        if st.mean_sizes.len() != moved.len() || !moved.iter().zip(&st.mean_sizes).enumerate().all(within) {
            st.mean_sizes = moved;
        }
    }

    /// The equal split with every other rank moved up or down by the probe amplitude (alternating
    /// with `k`), re-summed to B; the equal split if that would break a bound.
    fn probe(&self, k: usize) -> Vec<usize> {
        let base = equal_split(self.global_batch, self.sizes.len());
        let raw: Vec<usize> = base
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                let d = (b as f64 * self.cfg.probe_amplitude).round() as usize;
                if (i + k).is_multiple_of(2) {
                    b + d
                } else {
                    b.saturating_sub(d)
                }
            })
            .collect();
        let probe = crate::shard::rescale(&raw, self.global_batch);
        if probe.iter().zip(&self.bounds).all(|(b, &(lo, hi))| lo <= *b && *b <= hi) {
            probe
        } else {
            base
        }
    }

    /// Marks an epoch boundary; under `proportional-epoch`, re-splits by last epoch's throughput.
    pub fn end_epoch(&mut self) {
        if self.cfg.policy == Policy::ProportionalEpoch && self.epoch_totals.iter().all(|&(b, t)| b > 0.0 && t > 0.0) {
            let lines: Vec<Line> = self.epoch_totals.iter().map(|&(b, t)| Line { alpha: 0.0, beta: t / b }).collect();
            self.sizes = equalize(&lines, self.global_batch, &self.bounds);
        }
        self.epoch_totals.iter_mut().for_each(|t| *t = (0.0, 0.0));
    }

    /// The predicted lines with each rank's speed shrunk towards the cluster's by the share of the
    /// spread of the ranks' speeds that their levels' noise explains (James–Stein): in a cluster
    /// of alike ranks the split then stays equal instead of following each level's noise, and
    /// where the ranks differ by more than their noise it moves them little. The speed is the log of
    /// the predicted time at the equal share, `ℓ_i`; with `v` the mean noise variance of the levels
    /// and `s²` the variance of the `ℓ_i` over the ranks, each becomes `ℓ̄ + (1 − min(1, v/s²))·(ℓ_i − ℓ̄)`.
    fn shrink(&self, lines: Vec<Line>) -> Vec<Line> {
        let n = lines.len() as f64;
        let at = self.global_batch as f64 / n;
        let logs: Vec<f64> = lines.iter().map(|l| l.at_f(at).max(1e-300).ln()).collect();
        let mean = logs.iter().sum::<f64>() / n;
        let spread = logs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        let noise = self.fits.iter().map(|f| f.level_noise(&self.cfg)).sum::<f64>() / n;
        if !(spread > 0.0 && noise > 0.0) || lines.len() < 2 {
            return lines;
        }
        let keep = 1.0 - (noise / spread).min(1.0);
        lines.iter().zip(&logs).map(|(l, &x)| l.scaled(((mean + keep * (x - mean)) - x).exp())).collect()
    }

    /// The factor each rank's predicted line is planned at: the plan with the smallest expected
    /// slowest time under the risk model ([`Risk`] and each rank's own onsets).
    /// - Ranks at their base speed are planned at it (1), or hedged at the typical onset's factor
    ///   `F` (at most 2): none, all, or those whose own onset rate is above a multiple (8, 4, 2, 1, ½) of the
    ///   pool's.
    /// - A freshly lifted rank is planned at its current speed or at its base (`e^-excess`).
    /// - A rank lifted for longer is planned at its current speed.
    ///
    /// A plan `m` gives the iteration `T_m·E[max]`, with `T_m ∝ 1/Σ 1/(m_i·β_i)` (the finishing
    /// time of the planned lines), and the max over the slowest actual-over-planned ratio of each
    /// group of ranks, each two-valued: unhedged `F` if one of them has an onset (else 1), hedged 1
    /// (else `1/F`), fresh lifts 1 or `e^excess` if one stays (else `e^-excess` or 1), old lifts
    /// likewise at their current speed.
    ///
    /// A group's probability of some onset is Poisson, its count times its pooled onset rate, but
    /// never above the observed frequency of iterations with any onset (onsets that come together,
    /// as in a square wave, are one event). The ranks are picked by one of their two alternating
    /// onset counts and the group's rate is measured by the other: picked and measured by the same
    /// count, the ranks that happened to have more onsets look riskier than they are, and a
    /// cluster whose ranks are all alike (spikes, bursts on every rank) is hedged in part for
    /// nothing.
    ///
    /// Hedging pays where onsets are all but certain each iteration (many ranks, short bursts: the
    /// ranks at risk are planned at their slowed speed, and none is given work that an onset would
    /// make the straggler); planning a fresh lift at its base pays where lifts end at once (one-off
    /// spikes). Without excursions it is the plan at the predicted speeds.
    fn plan(&self, lines: &[Line]) -> Vec<f64> {
        let cfg = &self.cfg;
        let (p_any, f_on) = self.risk.onset();
        let kind = |f: &RankFit| {
            if !f.lifted(cfg) {
                0
            } else if f.lifted_long(cfg) {
                2
            } else {
                1
            }
        };
        let kinds: Vec<usize> = self.fits.iter().map(kind).collect();
        if p_any == 0.0 && kinds.iter().all(|&k| k == 0) {
            return vec![1.0; self.fits.len()];
        }
        let f_on = f_on.exp();
        let (levels, group) = self.risk_levels(lines, &kinds);
        let sum = |r: std::ops::Range<usize>| group[r].iter().fold(Group::default(), |a, g| a.add(g));
        // The probability of some onset among a group of base ranks. The group's rate is shrunk
        // towards the pool's by one expected onset's worth of prior, so that a group of one or two
        // ranks with an onset or two is not taken for a risky one.
        let all = sum(0..group.len());
        let pooled = if all.seen > 0.0 { all.onsets / all.seen } else { 0.0 };
        let some = |g: &Group| {
            let mean = if pooled > 0.0 { g.ranks * (g.onsets + 1.0) / (g.seen + 1.0 / pooled) } else { 0.0 };
            (1.0 - (-mean).exp()).min(p_any)
        };
        let (fresh, old) = (self.lifted_kind(lines, &kinds, 1), self.lifted_kind(lines, &kinds, 2));
        // A hedge plans a rank at most 2× slower, so that it never leaves a rank below half of its
        // predicted share (what the scoreboard counts as starving).
        let hedge = f_on.min(2.0);
        // A plan: base ranks of level ≥ `from` hedged (`from` past the top: none), fresh lifts at base.
        let top = group.len();
        let expected = |from: usize, at_base: bool| {
            let (hedged, unhedged) = (sum(from..top), sum(0..from));
            let capacity = hedged.speed / hedge
                + unhedged.speed
                + if at_base { fresh.speed_base } else { fresh.speed_now }
                + old.speed_now;
            // Each group present: its slowest ratio without and with its event, and the event's chance.
            let vars = [
                (unhedged.ranks > 0.0).then_some((1.0, f_on, some(&unhedged))),
                (hedged.ranks > 0.0).then_some((1.0 / hedge, f_on / hedge, some(&hedged))),
                fresh.any.then_some(if at_base {
                    (1.0, fresh.stay, fresh.p_stay)
                } else {
                    (fresh.back, 1.0, fresh.p_stay)
                }),
                old.any.then_some((old.back, 1.0, old.p_stay)),
            ];
            expected_max(&vars.into_iter().flatten().collect::<Vec<_>>()) / capacity
        };
        // The plan at the predicted speeds stays unless another is expected faster by the dead-band.
        let mut best = (expected(top, false) * (1.0 - cfg.dead_band), top, false);
        for from in (0..=top).rev() {
            for at_base in [false, true] {
                let e = expected(from, at_base);
                if e < best.0 {
                    best = (e, from, at_base);
                }
            }
        }
        let (_, from, at_base) = best;
        self.fits
            .iter()
            .zip(kinds.iter().zip(&levels))
            .map(|(f, (&kd, &lv))| match kd {
                0 if lv >= from => hedge,
                1 if at_base => (-f.excess()).exp(),
                _ => 1.0,
            })
            .collect()
    }

    /// The base ranks (kind 0) by risk level, and the sums of each level: level `j ≥ 1` if a rank's
    /// picking rate is above `RISK_LEVELS[j − 1]` times the pool's. The sums take the measuring
    /// count (see [`Balancer::plan`]).
    fn risk_levels(&self, lines: &[Line], kinds: &[usize]) -> (Vec<usize>, [Group; RISK_LEVELS.len() + 1]) {
        let pick = |f: &RankFit| f.onsets[0].mean();
        let (w, n) = self
            .fits
            .iter()
            .zip(kinds)
            .filter(|(_, &k)| k == 0)
            .fold((0.0, 0.0), |(w, n), (f, _)| (w + f.onsets[0].w, n + f.onsets[0].sum));
        let pool = if w > 0.0 { n / w } else { 0.0 };
        let level =
            |f: &RankFit| if pool > 0.0 { RISK_LEVELS.iter().filter(|&&m| pick(f) > m * pool).count() } else { 0 };
        let levels: Vec<usize> = self.fits.iter().map(level).collect();
        let mut group = [Group::default(); RISK_LEVELS.len() + 1];
        for ((f, l), (&kd, &lv)) in self.fits.iter().zip(lines).zip(kinds.iter().zip(&levels)) {
            if kd == 0 {
                let one = Group { speed: 1.0 / l.beta, seen: f.onsets[1].w, onsets: f.onsets[1].sum, ranks: 1.0 };
                group[lv] = group[lv].add(&one);
            }
        }
        (levels, group)
    }

    /// What the plan needs to know of the lifted ranks of one kind (1 fresh, 2 old).
    fn lifted_kind(&self, lines: &[Line], kinds: &[usize], k: usize) -> Lifted {
        let (mut now, mut base, mut count, mut total, mut max) = (0.0, 0.0, 0usize, 0.0, 0.0f64);
        for ((f, l), _) in self.fits.iter().zip(lines).zip(kinds).filter(|(_, &kd)| kd == k) {
            now += 1.0 / l.beta;
            base += f.excess().exp() / l.beta;
            count += 1;
            total += f.excess();
            max = max.max(f.excess());
        }
        let (p_stay, stay) = self.risk.stay(k == 2);
        Lifted {
            any: count > 0,
            speed_now: now,
            speed_base: base,
            p_stay,
            stay: stay.unwrap_or(max).exp(),
            back: (-total / count.max(1) as f64).exp(),
        }
    }

    /// Takes the equalised split of the planned lines unless it beats the current one by less than
    /// the dead-band. A trust region bounds every rank's step: a size at most halves or doubles per
    /// iteration (the fits are only reliable near sizes already seen), so a large change takes a
    /// few steps.
    fn adopt(&mut self, planned: &[Line]) {
        let trust: Vec<(usize, usize)> =
            self.sizes.iter().zip(&self.bounds).map(|(&b, &(lo, hi))| ((b / 2).max(lo), (2 * b + 1).min(hi))).collect();
        let proposal = equalize(planned, self.global_batch, &trust);
        let now = predicted_max(planned, &self.sizes);
        let new = predicted_max(planned, &proposal);
        if new < now * (1.0 - self.cfg.dead_band) {
            self.sizes = proposal;
        }
    }
}

/// The variance of an exponentially weighted mean with forgetting λ of observations of variance
/// σ², in the long run: σ²·(1 − λ)/(1 + λ).
fn forgotten_mean_variance(variance: f64, lambda: f64) -> f64 {
    variance * (1.0 - lambda) / (1.0 + lambda)
}

/// The mean and standard deviation of forgotten sums `(Σ w·x, Σ w·x²)` of total weight `w > 0`.
fn moments((sum, squares): (f64, f64), w: f64) -> (f64, f64) {
    let mean = sum / w;
    (mean, (squares / w - mean * mean).max(0.0).sqrt())
}

/// The expected largest of independent two-valued variables, each `(low, high, P(high))`.
fn expected_max(vars: &[(f64, f64, f64)]) -> f64 {
    (0..1usize << vars.len())
        .map(|pick| {
            vars.iter().enumerate().fold((1.0, f64::NEG_INFINITY), |(p, m), (j, &(lo, hi, ph))| {
                if pick >> j & 1 == 1 {
                    (p * ph, m.max(hi))
                } else {
                    (p * (1.0 - ph), m.max(lo))
                }
            })
        })
        .map(|(p, m)| if p > 0.0 { p * m } else { 0.0 })
        .sum()
}

/// Ranks with a known shape from which the shape is pooled. A handful of ranks each see their own
/// sizes vary enough to fit their own line, and the median of a handful moves with each one's
/// noise (sizes wobble and undershoot after a step change, as the property tests of 2–8 ranks
/// show); thousands of fits have a tail of degenerate ones, which the pool removes (the
/// simulator's `quiet` scenario at 10,000 ranks: docs/simulator.md).
pub const POOL_FROM: usize = 16;

/// The fixed cost, in samples' worth, that the ranks share: the median of the shapes `α_i/β_i` of
/// the ranks whose slope is known. Ranks run the same model, and contention stretches fixed and
/// per-sample costs alike, so the shape is common to all; pooled over many ranks it is well
/// determined even where each rank's own slope is not.
///
/// `None` below [`POOL_FROM`] ranks with a known shape: each rank then keeps its own line.
pub fn pooled_shape(fits: &[RankFit]) -> Option<f64> {
    if fits.len() < POOL_FROM {
        return None;
    }
    let mut shapes: Vec<f64> = fits.iter().filter_map(RankFit::shape).collect();
    if shapes.len() < POOL_FROM {
        return None;
    }
    let mid = shapes.len() / 2;
    let (_, m, _) = shapes.select_nth_unstable_by(mid, f64::total_cmp);
    Some(*m)
}

/// The slowest predicted time of a split.
pub fn predicted_max(lines: &[Line], sizes: &[usize]) -> f64 {
    lines.iter().zip(sizes).map(|(l, &b)| l.at(b)).fold(f64::NEG_INFINITY, f64::max)
}

/// A rank's compute time as a function of its batch: increasing in `b`.
pub trait Cost {
    /// Seconds to compute `b` samples.
    fn at_f(&self, b: f64) -> f64;
    /// The (fractional) size computed in `t` seconds: the inverse of [`Cost::at_f`].
    fn size_at(&self, t: f64) -> f64;
    /// Samples per second at `t` seconds (the slope of [`Cost::size_at`]; 0 where it is flat).
    fn rate_at(&self, t: f64) -> f64;
}

impl Cost for Line {
    fn at_f(&self, b: f64) -> f64 {
        Line::at_f(self, b)
    }

    fn size_at(&self, t: f64) -> f64 {
        Line::size_at(self, t)
    }

    fn rate_at(&self, _t: f64) -> f64 {
        1.0 / self.beta
    }
}

/// Integer sizes with `Σ b_i = total` and `bounds[i].0 ≤ b_i ≤ bounds[i].1` that minimise the
/// predicted slowest time (up to one sample of rounding per rank). Requires `Σ lo ≤ total ≤ Σ hi`
/// and `beta > 0` on every line.
pub fn equalize(lines: &[Line], total: usize, bounds: &[(usize, usize)]) -> Vec<usize> {
    equalize_by(lines, total, bounds)
}

/// [`equalize`] for any increasing costs.
pub fn equalize_by<C: Cost>(lines: &[C], total: usize, bounds: &[(usize, usize)]) -> Vec<usize> {
    let n = lines.len();
    assert_eq!(bounds.len(), n);
    let lo_sum: usize = bounds.iter().map(|b| b.0).sum();
    let hi_sum: usize = bounds.iter().map(|b| b.1).sum();
    assert!(lo_sum <= total && total <= hi_sum, "no split of {total} within the bounds");
    let t_lo = finishing_time(lines, total, bounds);
    let at = |t: f64, i: usize| lines[i].size_at(t).clamp(bounds[i].0 as f64, bounds[i].1 as f64);
    let mut sizes: Vec<usize> =
        (0..n).map(|i| (at(t_lo, i).floor() as usize).clamp(bounds[i].0, bounds[i].1)).collect();
    // Floors lose < 1 per rank, so at most n samples remain (more only where a cost's inverse is
    // flat). They go one at a time to the rank whose predicted time after taking one more is
    // smallest (ties to the lower rank): for increasing per-rank costs this greedy fill reaches
    // the optimal integer max. Usually each of those ranks takes one: the `left` smallest
    // next-sample times are then found by selection, and the heap is needed only when some rank's
    // second sample would come before them.
    let mut left = total.saturating_sub(sizes.iter().sum::<usize>());
    if left == 0 {
        return sizes;
    }
    let key = |i: usize, s: usize| (OrdF64(lines[i].at_f((s + 1) as f64)), i);
    let mut next: Vec<(OrdF64, usize)> = (0..n).filter(|&i| sizes[i] < bounds[i].1).map(|i| key(i, sizes[i])).collect();
    if left <= next.len() {
        let (chosen, pivot, _) = next.select_nth_unstable(left - 1);
        let pivot = *pivot;
        let second_later =
            chosen.iter().chain([&pivot]).all(|&(_, i)| sizes[i] + 1 >= bounds[i].1 || key(i, sizes[i] + 1) > pivot);
        if second_later {
            for &(_, i) in chosen.iter().chain([&pivot]) {
                sizes[i] += 1;
            }
            return sizes;
        }
    }
    let mut heap: BinaryHeap<Reverse<(OrdF64, usize)>> = next.into_iter().map(Reverse).collect();
    while left > 0 {
        let Reverse((_, i)) = heap.pop().expect("Σ hi ≥ total leaves a rank with room");
        sizes[i] += 1;
        left -= 1;
        if sizes[i] < bounds[i].1 {
            heap.push(Reverse(key(i, sizes[i])));
        }
    }
    sizes
}

/// The continuous optimum's finishing time, from below: a `T` whose sizes `b_i(T) = clamp((T −
/// α_i)/β_i, lo_i, hi_i)` sum to less than `total` by at most a sample (or within a relative 1e-9
/// of the optimum).
fn finishing_time<C: Cost>(lines: &[C], total: usize, bounds: &[(usize, usize)]) -> f64 {
    // Continuous sizes at finishing time T: b_i(T) = clamp(size_at_i(T), lo_i, hi_i), monotone in
    // T (piecewise linear for lines). Returns Σ b_i(T) and its slope over the unclamped ranks.
    let sum_at = |t: f64| {
        let (mut sum, mut slope) = (0.0, 0.0);
        for (l, &(lo, hi)) in lines.iter().zip(bounds) {
            let raw = l.size_at(t);
            if raw <= lo as f64 {
                sum += lo as f64;
            } else if raw >= hi as f64 {
                sum += hi as f64;
            } else {
                sum += raw;
                slope += l.rate_at(t);
            }
        }
        (sum, slope)
    };
    let (mut t_lo, mut t_hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for (l, b) in lines.iter().zip(bounds) {
        t_lo = t_lo.min(l.at_f(b.0 as f64));
        t_hi = t_hi.max(l.at_f(b.1 as f64));
    }
    // Newton's steps aimed half a sample short of B land on a time just below the optimum once the
    // clamped set is right (the sum is linear between its kinks); a step outside the bracket
    // bisects instead. Done once the sum is within a sample of B from below, or the bracket is a
    // relative 1e-9 wide (sizes then move by far less than a sample).
    let target = total as f64;
    let mut t = t_lo;
    for _ in 0..100 {
        let (sum, slope) = sum_at(t);
        if sum < target {
            t_lo = t_lo.max(t);
            if sum >= target - 1.0 {
                break;
            }
        } else {
            t_hi = t_hi.min(t);
        }
        if t_hi - t_lo <= 1e-9 * t_hi.abs() {
            break;
        }
        let newton = t + (target - 0.5 - sum) / slope;
        t = if slope > 0.0 && newton > t_lo && newton < t_hi { newton } else { 0.5 * (t_lo + t_hi) };
        if t <= t_lo || t >= t_hi {
            break;
        }
    }
    t_lo
}

/// Total order on f64 for the heap.
#[derive(Debug, Clone, Copy, PartialEq)]
struct OrdF64(f64);

impl Eq for OrdF64 {}
impl PartialOrd for OrdF64 {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for OrdF64 {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// How much a run's split oscillates, counted as *reversals*: a rank's batch moving by at least 2%
/// of B (or a quarter of the equal share, where that is less: at scale 2% of B is many shares)
/// one way and then as much the other way at its next such move. Smaller moves are the
/// dead-band's and the rounding's and are not counted. A balancer that chased a rank
/// alternating its speed every iteration would reverse at every iteration (100 per 100).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reversals {
    /// The move that counts, in samples, at least one.
    big: f64,
    last: Vec<usize>,
    /// Per rank: the sign of its last counted move (0 before one), and its reversals.
    sign: Vec<i8>,
    count: Vec<usize>,
    iterations: usize,
}

impl Reversals {
    pub fn new(global_batch: usize, world: usize) -> Reversals {
        let b = global_batch as f64;
        Reversals { big: (0.02 * b).min(0.25 * b / world.max(1) as f64).max(1.0), ..Reversals::default() }
    }

    /// Counts one iteration's split.
    pub fn record(&mut self, sizes: &[usize]) {
        self.iterations += 1;
        if self.last.len() != sizes.len() {
            self.sign = vec![0; sizes.len()];
            self.count = vec![0; sizes.len()];
        } else {
            for (i, (&b, &a)) in sizes.iter().zip(&self.last).enumerate() {
                let d = b as f64 - a as f64;
                if d.abs() >= self.big {
                    let s = if d > 0.0 { 1 } else { -1 };
                    self.count[i] += (self.sign[i] == -s) as usize;
                    self.sign[i] = s;
                }
            }
        }
        self.last.clear();
        self.last.extend_from_slice(sizes);
    }

    /// The worst rank's reversals per 100 iterations recorded.
    pub fn per_100(&self) -> f64 {
        let worst = self.count.iter().copied().max().unwrap_or(0);
        if self.iterations == 0 {
            0.0
        } else {
            100.0 * worst as f64 / self.iterations as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reversals_count_a_big_move_undone_at_the_next_big_move() {
        // B = 100: moves of 2 or more count; the 1-sample wobble does not.
        let mut r = Reversals::new(100, 2);
        for s in [[50, 50], [53, 47], [54, 46], [51, 49], [51, 49], [50, 50], [52, 48], [60, 40]] {
            r.record(&s);
        }
        // +3, (+1), -3: one reversal; (-1), +2: a second; +8 goes on the same way.
        assert_eq!(r.count, [2, 2]);
        assert_eq!(r.per_100(), 25.0);
        assert_eq!(Reversals::new(10, 2).big, 1.0);
        assert_eq!(Reversals::new(65536, 256).big, 64.0);
        assert_eq!(Reversals::new(100, 2).per_100(), 0.0);
    }

    #[test]
    fn equal_lines_give_equal_split() {
        let l = vec![Line { alpha: 0.0, beta: 1.0 }; 3];
        assert_eq!(equalize(&l, 10, &[(1, 10); 3]), vec![4, 3, 3]);
    }

    #[test]
    fn three_times_slower_rank_gets_a_quarter() {
        let l = [Line { alpha: 0.0, beta: 1.0 }, Line { alpha: 0.0, beta: 3.0 }];
        assert_eq!(equalize(&l, 128, &[(1, 128); 2]), vec![96, 32]);
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

    #[test]
    fn fit_recovers_a_line() {
        let cfg = BalanceConfig { forgetting: 1.0, slope_forgetting: 1.0, ..Default::default() };
        let mut f = RankFit::default();
        for b in [10, 20, 30, 40, 25] {
            f.observe(b, 0.5 + 0.1 * b as f64, &cfg);
        }
        let l = f.line().unwrap();
        assert!((l.alpha - 0.5).abs() < 1e-9 && (l.beta - 0.1).abs() < 1e-9, "{l:?}");
    }

    /// The shared shape is the median of the ranks' own `α/β`; a rank's line with it passes through
    /// the rank's recent level whatever its own slope.
    #[test]
    fn pooled_shape_is_the_median_and_lines_keep_each_ranks_level() {
        let cfg = BalanceConfig::default();
        let mut fits = vec![RankFit::default(); 3];
        for (k, f) in fits.iter_mut().enumerate() {
            let alpha = [0.2, 0.3, 0.5][k];
            for b in [100, 200, 300, 400, 250] {
                f.observe(b, alpha + 0.01 * b as f64, &cfg);
            }
        }
        // A rank whose size never moved has no shape of its own.
        let mut flat = RankFit::default();
        (0..5).for_each(|_| flat.observe(32, 0.64, &cfg));
        assert_eq!(pooled_shape(&fits), None, "three ranks are too few to pool");
        let mut many: Vec<RankFit> = fits.iter().cycle().take(3 * POOL_FROM).cloned().collect();
        many.push(flat);
        let rho = pooled_shape(&many).unwrap();
        assert!((rho - 30.0).abs() < 0.5, "median of 20, 30, 50 samples' worth: {rho}");
        let l = many.last().unwrap().line_with(Some(rho)).unwrap();
        assert!((l.at(32) - 0.64).abs() < 1e-9 && (l.alpha / l.beta - rho).abs() < 1e-9, "{l:?}");
    }

    fn steady(f: &mut RankFit, cfg: &BalanceConfig) {
        (0..8).for_each(|_| f.observe(64, 0.064, cfg));
    }

    /// Within the jump, one slow iteration moves the level by at most the clip (`k`); three in a
    /// row of 1.3× are a change, adopted at their mean; beyond the jump, at once.
    #[test]
    fn a_spike_moves_the_level_little_a_change_is_detected_and_a_jump_adopted_at_once() {
        let cfg = BalanceConfig::default();
        let k = 0.5 * cfg.detect.ln_1p();
        let mut f = RankFit::default();
        steady(&mut f, &cfg);
        f.observe(64, 0.0832, &cfg);
        let t = f.line().unwrap().at(64);
        assert!(t > 0.064 && t < 0.064 * k.exp(), "one spike: {t}");
        // Three ordinary iterations end the excursion.
        (0..3).for_each(|_| f.observe(64, 0.064, &cfg));
        f.observe(64, 0.0832, &cfg);
        f.observe(64, 0.0832, &cfg);
        assert!(f.line().unwrap().at(64) < 0.075, "not yet a change: {:?}", f.line());
        f.observe(64, 0.0832, &cfg);
        assert!((f.line().unwrap().at(64) / 0.0832 - 1.0).abs() < 0.02, "{:?}", f.line());
        f.observe(64, 3.0 * 0.0832, &cfg);
        assert!((f.line().unwrap().at(64) / (3.0 * 0.0832) - 1.0).abs() < 0.01, "a 3× jump: {:?}", f.line());
    }

    /// A persistent 20% slowdown (a typical co-located job) is detected within `h/(x − k)` = 4
    /// iterations, and a 20% speed-up alike.
    #[test]
    fn a_moderate_persistent_change_is_adopted_within_four_iterations() {
        let cfg = BalanceConfig::default();
        for factor in [1.2, 1.0 / 1.2] {
            let mut f = RankFit::default();
            steady(&mut f, &cfg);
            (0..4).for_each(|_| f.observe(64, 0.064 * factor, &cfg));
            let t = f.line().unwrap().at(64);
            assert!((t / (0.064 * factor) - 1.0).abs() < 0.02, "predicts {t} s after 4 iterations at {factor}×");
        }
    }

    /// Noise that changes sign restarts the sums: ±10% alternating for 200 iterations never alarms,
    /// and the level stays at the mean.
    #[test]
    fn symmetric_noise_never_alarms() {
        let cfg = BalanceConfig::default();
        let mut f = RankFit::default();
        steady(&mut f, &cfg);
        for i in 0..200 {
            f.observe(64, 0.064 * if i % 2 == 0 { 1.1 } else { 0.9 }, &cfg);
            assert!(f.up.g < 0.1 && f.down.g < 0.1, "iteration {i}: {:?} {:?}", f.up, f.down);
        }
        assert!((f.line().unwrap().at(64) / 0.064 - 1.0).abs() < 0.02, "{:?}", f.line());
    }

    /// The interference signal: a rank given half its core takes twice as long, which is no
    /// surprise to the model (its own CPU clock is unchanged) and is predicted at once.
    #[test]
    fn a_reported_cpu_share_is_predicted_at_once() {
        let cfg = BalanceConfig::default();
        let mut f = RankFit::default();
        steady(&mut f, &cfg);
        f.observe_with(64, 0.128, 0.5, &cfg, None);
        assert!((f.next_line(None).unwrap().at(64) - 0.128).abs() < 1e-9, "{:?}", f.next_line(None));
        assert!((f.line().unwrap().at(64) - 0.064).abs() < 1e-9, "the CPU-clock line is unchanged");
        assert_eq!((f.up.g, f.down.g), (0.0, 0.0), "no alarm");
    }

    #[test]
    fn a_speed_change_together_with_a_size_change_is_held_not_read_as_shape() {
        let cfg = BalanceConfig::default();
        let mut f = RankFit::default();
        // The slope is known: sizes varied, 0.1 ms per sample, no fixed cost.
        for b in [400, 500, 600, 500, 400, 500, 600, 500] {
            f.observe(b, 1e-4 * b as f64, &cfg);
        }
        // The size halves just as the rank's speed falls by 1.4× (a job starts on its core).
        // Read as shape, that would make α most of the time and hand the rank far too many samples.
        // Clipped, it moves the line by at most detect/2 at that size.
        f.observe(250, 1.4e-4 * 250.0, &cfg);
        let l = f.line().unwrap();
        assert!(l.alpha < 0.1 * l.at(250) && l.at(250) < 0.025 * 1.08, "read as shape: {l:?}");
        // Confirmed like any other change of speed.
        f.observe(250, 0.035, &cfg);
        f.observe(250, 0.035, &cfg);
        let l = f.line().unwrap();
        assert!(l.alpha < 0.1 * l.at(250) && (l.at(250) - 0.035).abs() < 1e-3, "not adopted: {l:?}");
        // Halved speed with halved size (2×, beyond the jump): a change of speed at once.
        let mut g = RankFit::default();
        for b in [400, 500, 600, 500, 400, 500, 600, 500] {
            g.observe(b, 1e-4 * b as f64, &cfg);
        }
        g.observe(250, 2e-4 * 250.0, &cfg);
        let l = g.line().unwrap();
        assert!(l.alpha < 1e-3 && (l.at(250) - 0.05).abs() < 1e-3, "not a change of speed: {l:?}");
        // Before the slope is known, a surprise after a move is still learned as shape.
        let mut f = RankFit::default();
        for _ in 0..4 {
            f.observe(500, 0.05, &cfg);
        }
        f.observe(250, 0.04, &cfg);
        assert!(f.line().unwrap().alpha > 0.02, "a first size change teaches the fixed cost: {:?}", f.line());
    }

    /// Runs `iters` iterations of `n` ranks with equal speeds, a rank's CPU share halved while
    /// `slowed(t, rank)`, and returns the balancer and the sizes after each iteration.
    fn run(n: usize, iters: usize, slowed: impl Fn(usize, usize) -> bool) -> (Balancer, Vec<Vec<usize>>) {
        let cfg = BalanceConfig { policy: Policy::Lbbsp, ..Default::default() };
        let mut bal = Balancer::new(&cfg, 256 * n, n).unwrap();
        let mut history = Vec::new();
        for t in 0..iters {
            let obs: Vec<Observation> = bal
                .sizes()
                .iter()
                .enumerate()
                .map(|(r, &b)| {
                    let share = if slowed(t, r) { 0.5 } else { 1.0 };
                    Observation { batch: b, compute_s: (1e-4 + 1e-5 * b as f64) / share, cpu_share: share }
                })
                .collect();
            bal.observe(&obs);
            history.push(bal.sizes().to_vec());
        }
        (bal, history)
    }

    #[test]
    fn where_an_onset_is_certain_every_iteration_every_rank_is_planned_at_its_slowed_speed() {
        // 64 ranks, each slowed 2× for 3 of every 16 iterations, 4 onsets in every iteration:
        // planned at their predicted speeds, the ranks just slowed would get half and an onset
        // among the others would set every iteration's time. Hedged, the split stays equal.
        let (_, history) = run(64, 200, |t, r| (t + r) % 16 < 3);
        for sizes in &history[150..] {
            let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(*hi as f64 <= 1.05 * *lo as f64, "not hedged: {sizes:?}");
        }
    }

    #[test]
    fn a_one_off_spike_is_planned_past_once_spikes_are_seen_to_end_and_a_lasting_lift_is_not() {
        // 16 ranks, one of them slowed for a single iteration every 10: once the spikes have been
        // seen to end, the spiked rank keeps its size.
        let spike = |t: usize, r: usize| t.is_multiple_of(10) && r == (t / 10) % 16;
        let (_, history) = run(16, 600, spike);
        for t in (500..600).step_by(10) {
            let r = (t / 10) % 16;
            assert!(history[t][r] >= 240, "reacted to the spike at {t}: {:?}", history[t]);
        }
        // A lasting slowdown (rank 3 from iteration 600 on) is planned for from its second
        // iteration: the rank's share halves.
        let (_, history) = run(16, 610, |t, r| spike(t, r) || (t >= 600 && r == 3));
        assert!(history[603][3] < 160, "the lasting lift is ignored: {:?}", &history[598..]);
    }

    #[test]
    fn only_the_ranks_at_risk_are_hedged() {
        // 64 ranks, a quarter of them slowed 2× for 2 of every 8 iterations (2 onsets in every
        // iteration), the others never: those at risk are planned at their slowed speed, the
        // others at their own, so a safe rank takes twice an endangered one's work.
        let (_, history) = run(64, 400, |t, r| r < 16 && (t + r) % 8 < 2);
        for sizes in &history[350..] {
            let risky = sizes[..16].iter().max().unwrap();
            let safe = sizes[16..].iter().min().unwrap();
            assert!((*risky as f64) < 0.6 * *safe as f64, "hedged alike: {sizes:?}");
        }
    }

    #[test]
    fn alike_ranks_keep_an_equal_split_through_their_noise() {
        // 16 ranks of one speed, each time ±4% noise: without shrinking, the split follows each
        // level's noise (sizes spread by several percent); shrunk, it stays within a sample or two.
        let cfg = BalanceConfig { policy: Policy::Lbbsp, ..Default::default() };
        let (n, b) = (16, 256 * 16);
        let mut bal = Balancer::new(&cfg, b, n).unwrap();
        let mut rng = crate::data::rng::Rng::from_keys(&[42]);
        let mut worst: f64 = 1.0;
        for t in 0..300 {
            let obs: Vec<Observation> = bal
                .sizes()
                .iter()
                .map(|&b| Observation::new(b, (1e-4 + 1e-5 * b as f64) * (1.0 + 0.04 * (2.0 * rng.next_f64() - 1.0))))
                .collect();
            bal.observe(&obs);
            if t >= 100 {
                let (lo, hi) = (*bal.sizes().iter().min().unwrap(), *bal.sizes().iter().max().unwrap());
                worst = worst.max(hi as f64 / lo as f64);
            }
        }
        assert!(worst < 1.02, "the split follows the noise: max/min {worst:.3}");
    }

    #[test]
    fn the_mean_split_holds_still_while_the_planned_split_swings() {
        // A planned split swinging ±27 of 128 every iteration: its mean (forgetting 0.9) swings by
        // ±1.4 with the same period, which moves the unheld mean split every iteration; held, the
        // mean split stays put once the mean has settled.
        let moves = |mean_hold: f64| {
            let cfg = BalanceConfig { policy: Policy::Lbbsp, mean_hold, ..Default::default() };
            let mut bal = Balancer::new(&cfg, 128, 2).unwrap();
            let obs = [Observation::new(64, 0.01), Observation::new(64, 0.01)];
            let mut last = Vec::new();
            let mut moves = 0;
            for t in 0..200 {
                bal.sizes = if t % 2 == 0 { vec![91, 37] } else { vec![37, 91] };
                bal.move_alternatives(&obs);
                if t >= 100 && bal.steady.mean_sizes != last {
                    moves += 1;
                }
                last = bal.steady.mean_sizes.clone();
            }
            moves
        };
        assert_eq!(moves(1.0), 0);
        assert!(moves(0.0) >= 90, "unheld, the mean split moved only {} times", moves(0.0));
    }
}

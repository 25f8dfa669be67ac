//! The model of a rank: `b` samples take `t = e^{x}·(ρ + b)` seconds, `ρ` the cost curve's
//! fixed part shared by the ranks ([`Shape`]) and `x` the rank's log time per sample, in two
//! regimes:
//!
//! ```text
//!     base:    x = β_i + ε,           lifted:  x = β_i + L + ε,        ε ~ N(0, σ_i²)
//!     P(base → lifted) = p_on,i,       P(lifted → base) = p_off,i
//! ```
//!
//! `β_i` smooths the base iterations (a steady-state Kalman filter); an iteration more than
//! `max(10%, 3σ_i)` above it is lifted. While lifted, a second job's lift on the first is a regime
//! of its own, with its own chain of rises and falls: a rank under two jobs has four speeds.
//! Transitions are counted with forgetting; the balancer pools the ranks' rates, levels and lifts
//! by empirical Bayes (`docs/balancer.md`).

use serde::{Deserialize, Serialize};

/// The smallest lift (10%): below it, the noise of a quiet rank.
const MIN_LIFT: f64 = 0.0953;

/// A lift is at least this many deviations of the base's noise.
const LIFT_DEVIATIONS: f64 = 3.0;

/// Gains of the base level's smoothing (about ten iterations) and of a lift's while it lasts.
const BASE_GAIN: f64 = 0.1;
const LIFT_GAIN: f64 = 0.5;

/// The variance of a lift's and the base's level over the noise's: exponential smoothing of gain
/// `K` averages the noise down to `K/(2 − K)` of it.
pub const LIFT_WEIGHT: f64 = LIFT_GAIN / (2.0 - LIFT_GAIN);
pub const BASE_WEIGHT: f64 = BASE_GAIN / (2.0 - BASE_GAIN);

/// Forgetting of the noise's variance and of the transition counts (about a hundred iterations).
const NOISE_FORGETTING: f64 = 0.95;
pub const COUNT_FORGETTING: f64 = 0.998;

/// The noise's variance before any is measured: about ±3%.
const PRIOR_NOISE: f64 = 1e-3;

/// Forgetting of the shape's errors (only iterations in which sizes moved tell about it).
const SHAPE_FORGETTING: f64 = 0.999;

/// Gain of each candidate shape's level of a rank (as the base's).
const SHAPE_GAIN: f64 = 0.1;

/// A prediction error beyond this under every value is a change of speed, not shape.
const SHAPE_CLIP: f64 = 0.2;

/// Terms' worth of prior for the variance of the shape's errors.
const SHAPE_PRIOR_TERMS: f64 = 8.0;

/// Standard errors by which a value's errors must beat the one in use's to replace it: the best
/// of 21 alternatives at a one-sided 5% (Bonferroni: 2.8).
const SHAPE_SIGNIFICANCE: f64 = 3.0;

/// Ranks the shared shape is fitted on: all up to this many, else an even sample.
const SHAPE_RANKS: usize = 256;

/// The fixed part `ρ = α/β` in samples' worth, shared by the ranks, chosen from a geometric grid
/// by one-step prediction error: for each value `g`, each rank's level of `ln(c/(g + b))` on its
/// CPU clock `c` is smoothed as the base is, and `g` scores the forgotten squared, clipped errors
/// with which the level before the last iteration predicted the next (a level that holds the last
/// iteration's noise credits small values with the balancer's reaction to it).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Shape {
    grid: Vec<f64>,
    errors: Vec<f64>,
    /// Per fitted rank, its current regime's and its other regime's levels: per grid value, the
    /// level before the regime's last iteration and after it (empty until its first), and whether
    /// the level before holds more than that iteration alone. A checkpoint from before the regimes
    /// has none, and relearns them in two iterations.
    regimes: Vec<[(Vec<[f64; 2]>, bool); 2]>,
    stride: usize,
    /// The grid value in use.
    chosen: usize,
    /// The forgotten count of the errors' terms.
    terms: f64,
    /// Per grid value, forgotten sums of the chosen value's squared error less its own, and of
    /// that difference's square (cleared when the chosen value changes).
    against: Vec<[f64; 2]>,
}

impl Shape {
    pub fn new(global_batch: usize, world: usize) -> Shape {
        let share = global_batch as f64 / world.max(1) as f64;
        let grid: Vec<f64> = std::iter::once(0.0).chain((-12..=8).map(|k| share * 2f64.powf(k as f64 / 2.0))).collect();
        Shape { errors: vec![0.0; grid.len()], grid, stride: world.div_ceil(SHAPE_RANKS).max(1), ..Shape::default() }
    }

    /// `ρ`: the grid value of least error (0, proportional, until one is told apart).
    pub fn rho(&self) -> f64 {
        self.grid.get(self.chosen).copied().unwrap_or(0.0)
    }

    /// Learns an iteration's sizes and CPU seconds, one pair per rank.
    pub fn observe(&mut self, iteration: &[(f64, f64)]) {
        self.errors.iter_mut().chain(self.against.iter_mut().flatten()).for_each(|e| *e *= SHAPE_FORGETTING);
        self.terms *= SHAPE_FORGETTING;
        self.regimes.resize(iteration.len().div_ceil(self.stride), Default::default());
        let fitted = self.regimes.iter_mut().zip(iteration.iter().step_by(self.stride));
        for (regimes, &(b, cpu)) in fitted.filter(|(_, &(b, c))| b > 0.0 && c > 0.0 && c.is_finite()) {
            let xs: Vec<f64> = self.grid.iter().map(|g| (cpu / (g + b)).ln()).collect();
            // A change of speed that no value explains (a job came or went, a rank slowed in every
            // other iteration) swaps in the levels of the other regime, or starts them afresh and
            // keeps the old ones as that regime: catching up would read as shape.
            let explains = |levels: &[[f64; 2]]| levels.iter().zip(&xs).any(|(l, x)| (x - l[1]).abs() <= SHAPE_CLIP);
            if !explains(&regimes[0].0) {
                regimes.swap(0, 1);
                if !explains(&regimes[0].0) {
                    regimes[0] = (xs.iter().map(|&x| [x, x]).collect(), false);
                    continue;
                }
            }
            let (levels, lagged) = &mut regimes[0];
            let squares: Vec<f64> =
                levels.iter().zip(&xs).map(|(l, x)| (x - l[0]).abs().min(SHAPE_CLIP).powi(2)).collect();
            levels.iter_mut().zip(&xs).for_each(|(l, x)| *l = [l[1], l[1] + SHAPE_GAIN * (x - l[1])]);
            if *lagged {
                let (chosen, against) = (squares[self.chosen], &mut self.against);
                against.resize(squares.len(), [0.0; 2]);
                for ((e, a), s) in self.errors.iter_mut().zip(against.iter_mut()).zip(&squares) {
                    *e += s;
                    *a = [a[0] + (chosen - s), a[1] + (chosen - s) * (chosen - s)];
                }
                self.terms += 1.0;
            }
            *lagged = true;
        }
        // A value replaces the one in use only for a likelihood ratio of e² (Gaussian errors, one
        // term's variance their least mean square with a prior of SHAPE_PRIOR_TERMS terms of 10%: a
        // few terms fitted by the best of 22 values look exact), and only when its errors beat that
        // one's by SHAPE_SIGNIFICANCE standard errors of their paired differences (a Diebold–Mariano
        // test). That spread is the errors' own: a stretch of lucky iterations under heavy-tailed
        // noise, or one term at the clip, decides neither alone.
        let best = (0..self.grid.len()).min_by(|&a, &b| self.errors[a].total_cmp(&self.errors[b])).unwrap_or(0);
        let s2 = (self.errors[best] + SHAPE_PRIOR_TERMS * 0.01) / (self.terms + SHAPE_PRIOR_TERMS);
        let likelier = (self.errors[self.chosen] - self.errors[best]) / (2.0 * s2) > 2.0;
        if likelier && self.against.get(best).is_some_and(|[d, d2]| *d > SHAPE_SIGNIFICANCE * d2.sqrt()) {
            (self.chosen, self.against) = (best, vec![[0.0; 2]; self.grid.len()]);
        }
    }
}

/// Forgetting of a rank's freeze length (about twenty iterations) and of its running share (about
/// a hundred: several periods of a quota).
const FREEZE_FORGETTING: f64 = 0.95;
const RUN_FORGETTING: f64 = 0.99;

/// How a rank is frozen, from its frozen seconds `f` (at most `t·(1 − share)`) and its preemptions `N`: the
/// length `L` of one freeze (`f/N`, averaged over frozen seconds) and the share `a` of wall time it
/// runs. A rank that busy-polls in the collective is frozen on the wall clock whatever its batch:
/// in windows of `L` every `L·a/(1 − a)` of running. No preemptions counted (no measure, or a
/// slowdown that is not a freeze): `L = 0`, and the model is the multiplicative one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Freezes {
    /// Forgotten sums of `f²/N` and `f`.
    frozen: [f64; 2],
    /// Forgotten sums of the running share's terms and weights: the share over whole iterations
    /// where measured, else CPU over wall seconds of the compute. A rank that busy-polls is frozen
    /// in its wait as in its compute, so only the whole iteration tells its share: over the compute
    /// alone, a rank whose small batch meets its freeze every time would look ever slower.
    run: [f64; 2],
    /// Forgotten sums of the compute's CPU seconds and its wall seconds: its own running share.
    /// Both shares are at most the windows' share: over the compute, a small batch that meets its
    /// freeze every time runs less; over the whole iteration, a collective that yields the CPU
    /// while it waits (Open MPI on oversubscribed cores) runs less, in the yields and not in the
    /// windows. The windows' share is their greater.
    compute: [f64; 2],
    /// Forgotten sums of the squared deviation of an iteration's frozen seconds per CPU second from
    /// their long-run expectation `1/a − 1`, and of the weights.
    spread: [f64; 2],
}

impl Freezes {
    /// Learns an iteration: its `compute_s` wall seconds at its CPU share, frozen for `frozen_s` of
    /// them in `preemptions` freezes, and its share `run_share` over the whole iteration before (0
    /// without a measure), which lasted `run_s` seconds: shares are averaged over wall time, as a
    /// quota counts them (a busy-polling rank runs whole short iterations and then waits out one
    /// long freeze; the iterations' mean share made its windows ten times rarer than they are).
    /// Only frozen seconds make windows: time the rank slept (a stall that scales with its work)
    /// is left to the rank's speed. Returns the iteration's time to learn
    /// (`smoothed`, below), shrunk by the spread of the iterations before it: counted in its
    /// own shrinkage, a rank's first freeze would tell by its very size that the rate moves.
    pub fn observe(&mut self, o: &super::Observation) -> f64 {
        // `w`: the share over the whole iteration before, which lasted `s` seconds.
        let (t, share, n, (w, s)) = (o.compute_s, o.cpu_share, o.preemptions, (o.run_share, o.run_s));
        if !(t > 0.0 && t.is_finite() && share.is_finite()) {
            return t;
        }
        let (c, f) = cpu_and_frozen(o);
        let (term, weight) = if w > 0.0 && s > 0.0 && (w * s).is_finite() { (w.min(1.0) * s, s) } else { (c, t) };
        self.run = [RUN_FORGETTING * self.run[0] + term, RUN_FORGETTING * self.run[1] + weight];
        self.compute = [RUN_FORGETTING * self.compute[0] + c, RUN_FORGETTING * self.compute[1] + t];
        let (f2, f1) = if n >= 1.0 && f > 0.0 { (f * f / n, f) } else { (0.0, 0.0) };
        self.frozen = [FREEZE_FORGETTING * self.frozen[0] + f2, FREEZE_FORGETTING * self.frozen[1] + f1];
        let (learned, d) = (self.smoothed(o), f / c - (1.0 / self.windows().1 - 1.0));
        self.spread = [RUN_FORGETTING * self.spread[0] + d * d, RUN_FORGETTING * self.spread[1] + 1.0];
        learned
    }

    /// `(L, a)`: one freeze's length (0 before any) and the running share.
    pub fn windows(&self) -> (f64, f64) {
        let length = if self.frozen[1] > 0.0 { self.frozen[0] / self.frozen[1] } else { 0.0 };
        let share = |[x, w]: [f64; 2]| if w > 0.0 { x / w } else { 0.0 };
        (length, if self.run[1] > 0.0 { share(self.run).max(share(self.compute)).clamp(1e-3, 1.0) } else { 1.0 })
    }

    /// The time to learn of an iteration: its frozen seconds `f` shrunk towards their long-run
    /// expectation `c·(1/a − 1)` (`c` its CPU seconds), `t̃ = t + k·(c·(1/a − 1) − f)`. The weight
    /// is that of one freeze against the work, `L/(L + c)`: a 50 ms freeze of a 1 ms iteration is
    /// one draw of the windows' phase, and read as a speed it would shrink the rank's batch for
    /// nothing. It is capped by the share of the frozen rate's observed spread that the phase
    /// explains: the phase moves an iteration's frozen seconds per CPU second by one window at
    /// most, a variance of at most `(L/c)²/4`, and a spread beyond that is the rate itself moving
    /// (a job that comes and goes), whose freezes are learned as they are, not as the long-run
    /// share (normal-means empirical Bayes, as for the levels).
    ///
    /// Private: after [`Freezes::observe`] it would count the iteration in its own spread, which is
    /// what `observe` returns the learned time to avoid.
    fn smoothed(&self, o: &super::Observation) -> f64 {
        let (t, (length, a), (c, f)) = (o.compute_s, self.windows(), cpu_and_frozen(o));
        if length <= 0.0 || !c.is_finite() || c <= 0.0 {
            return t;
        }
        let phase = (length / c).powi(2) / 4.0;
        let spread = if self.spread[1] > 0.0 { self.spread[0] / self.spread[1] } else { 0.0 };
        let k = (length / (length + c)).min(if spread > phase { phase / spread } else { 1.0 });
        t + k * (c * (1.0 / a - 1.0) - f)
    }
}

/// The share a rank runs at under its windows `(L, a)` ([`Freezes::windows`]): `a` where it freezes
/// in windows, else 1. A rank's levels are learned at full running (its time times this), and its
/// laws give them back at this share: learned as wall times, a level learned before the windows
/// were known (or at another share) no longer matched the smoothed times after, and every
/// iteration read as a lift that never ended. It is also what a freezing rank's long-run plan
/// divides its mean time by.
pub fn running_share((length, a): (f64, f64)) -> f64 {
    Some(a).filter(|_| length > 0.0).unwrap_or(1.0)
}

/// An iteration's CPU seconds and its frozen seconds, these at most its time off the CPU.
fn cpu_and_frozen(o: &super::Observation) -> (f64, f64) {
    let c = o.compute_s * o.cpu_share.clamp(1e-3, 1.0);
    (c, if o.frozen_s.is_finite() { o.frozen_s.clamp(0.0, o.compute_s - c) } else { 0.0 })
}

/// Seconds off the CPU of `compute_s` at `cpu_share`: a rank's frozen seconds where every one of
/// them was taken by another process (the simulator's ranks, files from before waits were measured).
pub fn off_cpu_s(compute_s: f64, cpu_share: f64) -> f64 {
    compute_s * (1.0 - cpu_share).max(0.0)
}

/// One rank's model (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RankModel {
    started: bool,
    base: f64,
    /// Forgotten variance of the base iterations about the base level.
    noise: f64,
    /// The size the base was learned at (smoothed alike): a new shape moves the level by what it
    /// makes of that size.
    base_size: f64,
    /// The current lift's level and the size it was learned at, while lifted.
    lifted: Option<(f64, f64)>,
    /// The mean lift of the rank's onsets.
    jump: f64,
    /// Forgotten counts: base iterations and onsets after them, lifted iterations and ends after
    /// them.
    counts: [f64; 4],
    /// While lifted, a second lift on the first (a second job): its level and size while it lasts,
    /// the mean rise of its onsets above the first, and forgotten counts as `counts` (iterations at
    /// the first lift and rises after them, iterations above it and falls after them).
    upper: Option<(f64, f64)>,
    rise: f64,
    stacked: [f64; 4],
    /// Iterations lifted so far: the onset's is partly lifted, and the next one above it is the
    /// lift's own level, not a second lift.
    lifted_for: u32,
}

/// What an observation did to a rank: the lift of an onset, if one began.
pub type Onset = Option<f64>;

impl RankModel {
    /// The base level `β_i`.
    pub fn base(&self) -> f64 {
        self.base
    }

    /// The noise's deviation `σ_i`.
    pub fn noise(&self) -> f64 {
        self.noise.sqrt()
    }

    /// How far above the base a lift begins: `max(10%, 3σ_i)` in log time.
    pub fn threshold(&self) -> f64 {
        MIN_LIFT.max(LIFT_DEVIATIONS * self.noise.sqrt())
    }

    /// The current lift above the base, while lifted.
    pub fn lift(&self) -> Option<f64> {
        self.lifted.map(|(l, _)| l - self.base)
    }

    /// The mean lift of the rank's onsets (the last ten weigh most), and how many it has had
    /// (forgotten).
    pub fn jump(&self) -> (f64, f64) {
        (self.jump, self.counts[1])
    }

    /// Forgotten counts: base iterations, onsets, lifted iterations, ends; then the same of a second
    /// lift on the first: iterations at the first, rises, iterations at the second, falls.
    pub fn counts(&self) -> [f64; 8] {
        std::array::from_fn(|k| if k < 4 { self.counts[k] } else { self.stacked[k - 4] })
    }

    /// The second lift's rise above the first: its own while it lasts, else the mean of its
    /// onsets' (none: 0); and whether it lasts.
    pub fn second(&self) -> (f64, bool) {
        (self.upper.map_or(self.rise, |(h, _)| h - self.lifted.map_or(0.0, |l| l.0)), self.upper.is_some())
    }

    /// Moves the levels to a new shape, `ρ` from `before`: what it makes of the same times at the
    /// sizes they were learned at, so that a new shape is not read as every rank changing speed.
    pub fn reshape(&mut self, before: f64, rho: f64) {
        // The same time at the size `at` a level was learned at: `e^x·(before + at) = e^{x'}·(rho + at)`.
        let reshaped = |at: f64| ((before + at) / (rho + at)).ln();
        self.base += reshaped(self.base_size);
        for (l, b) in self.lifted.iter_mut().chain(self.upper.iter_mut()) {
            *l += reshaped(*b);
        }
    }

    /// Learns an iteration: `b` samples in `t` seconds, with the shared shape `rho`.
    pub fn observe(&mut self, b: usize, t: f64, rho: f64) -> Onset {
        let b = b as f64;
        if !(t > 0.0 && t.is_finite() && b > 0.0) {
            return None;
        }
        let x = (t / (rho + b)).ln();
        if !self.started {
            *self = RankModel { started: true, base: x, noise: PRIOR_NOISE, base_size: b, ..RankModel::default() };
            return None;
        }
        let d = x - self.base;
        let lifted = d > self.threshold();
        self.counts.iter_mut().for_each(|c| *c *= COUNT_FORGETTING);
        self.counts[2 * usize::from(self.lifted.is_some())] += 1.0;
        let smooth = |(l, s): (f64, f64)| (l + LIFT_GAIN * (x - l), s + LIFT_GAIN * (b - s));
        if let (true, Some((l, s))) = (lifted, self.lifted) {
            let (up, above) = (self.upper.is_some(), x - l > self.threshold());
            self.lifted_for = self.lifted_for.saturating_add(1);
            self.stacked.iter_mut().for_each(|c| *c *= COUNT_FORGETTING);
            self.stacked[2 * usize::from(up)] += 1.0;
            // At a second lift: nearer its level than the first's; or, from the first, a rise by
            // more than a lift and than half the rank's rises.
            let high = self.upper.map_or(above && x - l > 0.5 * self.rise, |h| 2.0 * (x - l) > h.0 - l);
            if above && self.lifted_for < 2 {
                // The onset's iteration was partly lifted: this one is the lift, and its onset's.
                (self.jump, self.lifted) = (self.jump + (x - l) / self.counts[1].clamp(1.0, 10.0), Some((x, b)));
            } else if high && !up {
                self.stacked[1] += 1.0;
                self.rise += (x - l - self.rise) / self.stacked[1].min(10.0);
                self.upper = Some((x, b));
            } else if high {
                self.upper = self.upper.map(smooth);
            } else {
                self.stacked[3] += f64::from(u8::from(up));
                (self.lifted, self.upper) = (Some(smooth((l, s))), None);
            }
        } else if lifted {
            self.counts[1] += 1.0;
            self.jump += (d - self.jump) / self.counts[1].min(10.0);
            (self.lifted, self.lifted_for) = (Some((x, b)), 0);
            return Some(d);
        } else {
            self.counts[3] += f64::from(u8::from(self.lifted.is_some()));
            (self.lifted, self.upper) = (None, None);
            // Faster than the base by twice what makes a lift: a job there from the start has
            // left, and the base moves at once (within that, it may be the noise's tail).
            if d < -2.0 * self.threshold() {
                (self.base, self.base_size) = (x, b);
            } else {
                self.noise = NOISE_FORGETTING * self.noise + (1.0 - NOISE_FORGETTING) * d * d;
                self.base += BASE_GAIN * d;
                self.base_size += BASE_GAIN * (b - self.base_size);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lift_is_told_from_noise_and_its_ends_are_counted() {
        let mut m = RankModel::default();
        for k in 0..200 {
            // ±2% noise, and 2× for 3 of every 10 iterations.
            let noise = if k % 2 == 0 { 1.02 } else { 0.98 };
            let f = if k % 10 >= 7 { 2.0 } else { 1.0 };
            m.observe(100, f * noise * 0.01, 0.0);
        }
        assert!((m.base() - (1e-4f64).ln()).abs() < 0.02, "{}", m.base());
        let [base, on, lifted, off, ..] = m.counts();
        // Onsets once in seven base iterations, ends once in three lifted ones.
        assert!((on / base - 1.0 / 7.0).abs() < 0.03 && (off / lifted - 1.0 / 3.0).abs() < 0.05, "{:?}", m.counts());
        assert!(m.noise() < 0.03, "{}", m.noise());
    }

    /// A rank under two jobs has four speeds: the model keeps the second job's lift on the first as
    /// a regime of its own (with two regimes, the iterations under both only moved the lifted
    /// level, and the second job's onsets while the first ran were never expected). The first
    /// job's onset falls within an iteration, and that partial iteration is no second lift.
    #[test]
    fn a_second_lift_on_the_first_is_a_regime_of_its_own() {
        let mut m = RankModel::default();
        let mut rises = 0;
        for k in 0..400usize {
            // Quiet for 10, then a first job (3×) whose onset iteration is half lifted (2×) and
            // which stays for 30, under which a second job (3.5×) comes for 4 of every 10.
            let (cycle, noise) = (k % 40, if k % 2 == 0 { 1.01 } else { 0.99 });
            let f = match cycle {
                0..10 => 1.0,
                10 => 2.0,
                c if (c - 11) % 10 >= 6 => 3.0 * 3.5,
                _ => 3.0,
            };
            let before = m.counts()[5];
            m.observe(100, f * noise * 1e-2, 0.0);
            rises += usize::from(m.counts()[5] > before);
        }
        let (rise, _) = m.second();
        // Three rises a cycle (none at the partial onset), each 3.5× on the first job.
        assert_eq!(rises, 30, "{:?}", m.counts());
        assert!((rise - 3.5f64.ln()).abs() < 0.05, "{rise}");
        assert!((m.jump().0 - 3f64.ln()).abs() < 0.05, "{:?}", m.jump());
    }

    #[test]
    fn a_rank_that_gets_faster_moves_its_base_at_once() {
        let mut m = RankModel::default();
        for k in 0..40 {
            m.observe(100, if k < 20 { 0.02 } else { 0.01 }, 0.0);
        }
        assert!((m.base() - (1e-4f64).ln()).abs() < 1e-9 && m.lift().is_none(), "{}", m.base());
    }

    #[test]
    fn a_freeze_longer_than_the_work_is_learned_as_its_share_and_a_short_one_as_it_is() {
        // 1 ms of CPU an iteration. Coarse: a 50 ms freeze once in 40 iterations (a 100 ms quota
        // period's). Fine: 10 freezes of 1 ms in each 20 ms iteration (a 2 ms period's).
        let (mut coarse, mut fine) = (Freezes::default(), Freezes::default());
        let mut learned = Vec::new();
        let frozen = |t: f64, share: f64, n: f64| super::super::Observation {
            cpu_share: share,
            preemptions: n,
            frozen_s: t * (1.0 - share),
            ..super::super::Observation::new(1, t)
        };
        let mut slept = Freezes::default();
        let asleep = super::super::Observation { frozen_s: 1e-5, ..frozen(0.03, 1.0 / 3.0, 1.0) };
        for k in 0..400 {
            let (t, share, n) = if k % 40 == 39 { (0.051, 0.001 / 0.051, 1.0) } else { (0.001, 1.0, 0.0) };
            coarse.observe(&frozen(t, share, n));
            learned.push(coarse.smoothed(&frozen(t, share, n)));
            fine.observe(&frozen(0.02, 0.5, 10.0));
            // A rank that sleeps two thirds of its compute, preempted now and then: no windows.
            slept.observe(&asleep);
        }
        assert!(slept.windows().0 < 2e-5 && (slept.smoothed(&asleep) - 0.03).abs() < 1e-6, "{:?}", slept.windows());
        // A collective that yields the CPU while it waits runs 2% of the iteration, its compute
        // all of its own: the windows' share is the compute's.
        let mut yielding = Freezes::default();
        for k in 0..400 {
            let (t, share) = if k % 7 == 3 { (125e-6, 0.8) } else { (100e-6, 1.0) };
            let o = frozen(t, share, f64::from(u8::from(k % 7 == 3)));
            yielding.observe(&super::super::Observation { run_share: 0.02, run_s: 0.01, ..o });
        }
        assert!(yielding.windows().1 > 0.95, "{:?}", yielding.windows());
        let (length, a) = coarse.windows();
        assert!((length - 0.05).abs() < 1e-9 && (a - 40.0 / 90.0).abs() < 0.05, "{length} {a}");
        let (lo, hi) = learned[100..].iter().fold((f64::MAX, 0.0f64), |(l, h), &t| (l.min(t), h.max(t)));
        // Raw, 1 to 51 ms; learned, within 2× (the share moves over the quota's cycle).
        assert!(hi / lo < 2.2 && lo > 0.0015, "{lo} {hi}");
        assert!((fine.windows().0 - 0.001).abs() < 1e-9);
        assert!((fine.smoothed(&frozen(0.02, 0.5, 10.0)) - 0.02).abs() < 1e-12);
        // The rate moves: 1 ms windows that a hog takes in bursts of 5 to 15 iterations, half its
        // CPU while there. A burst is learned as it is once the spread tells it is no phase.
        let mut bursty = Freezes::default();
        let mut seen = Vec::new();
        for k in 0..400usize {
            let on = (k / 10) % 2 == 1;
            let o = if on { frozen(0.02, 0.5, 10.0) } else { frozen(0.01, 1.0, 0.0) };
            bursty.observe(&o);
            seen.push(bursty.smoothed(&o) / o.compute_s);
        }
        let worst = seen[100..].iter().fold(0.0f64, |w, r| w.max((r - 1.0).abs()));
        assert!(worst < 0.05, "bursts learned {:.1}% away from their times", 100.0 * worst);
    }

    /// A rank that busy-polls under a 50% quota of a 100 ms period runs its whole 2 ms iterations
    /// until the quota is spent, then waits 50 ms in one: its share is that of the wall time, 0.5,
    /// not the iterations' mean share (0.96, which made its windows ten times rarer than they are).
    #[test]
    fn the_running_share_is_over_wall_time() {
        let mut f = Freezes::default();
        // The share over the iteration before rides on this one's observation.
        let o = |t: f64, share: f64, n: f64, (run_share, run_s): (f64, f64)| super::super::Observation {
            cpu_share: share,
            preemptions: n,
            frozen_s: t * (1.0 - share),
            run_share,
            run_s,
            ..super::super::Observation::new(64, t)
        };
        let mut before = (0.0, 0.0);
        for k in 0..2000 {
            let (t, share, n) = if k % 26 == 25 { (0.052, 0.002 / 0.052, 1.0) } else { (0.002, 1.0, 0.0) };
            f.observe(&o(t, share, n, before));
            before = (share, t);
        }
        let (length, a) = f.windows();
        // Forgotten over ~100 iterations, the share moves a little over the quota's cycle.
        assert!((length - 0.05).abs() < 1e-6 && (0.45..0.6).contains(&a), "{length} {a}");
    }

    /// A rank's first freeze, 50 ms in two windows of a 1 ms compute, is one draw of the windows'
    /// phase: the rank is not learned as fifty times slower (counted in its own spread, it was
    /// learned as 32 ms).
    #[test]
    fn a_first_freeze_is_not_learned_as_a_speed() {
        let mut f = Freezes::default();
        let o = |t: f64, n: f64| super::super::Observation {
            cpu_share: 1e-3 / t,
            preemptions: n,
            frozen_s: t - 1e-3,
            run_share: 0.999,
            run_s: 1e-3,
            ..super::super::Observation::new(64, t)
        };
        for _ in 0..5 {
            f.observe(&o(1e-3, 0.0));
        }
        let learned = f.observe(&o(51e-3, 2.0));
        assert!(learned < 4e-3, "learned as {:.1} ms", learned * 1e3);
    }

    #[test]
    fn the_shape_is_learned_from_varied_sizes_whatever_the_speed() {
        let mut shape = Shape::new(80, 1);
        // 1 ms fixed + 0.1 ms per sample (ρ = 10 samples, on the grid of an equal share of 80:
        // 80·2^{-3}); a speed that changes halfway does not bend it.
        let line = |b: usize| 1e-3 + 1e-4 * b as f64;
        for k in 0..40 {
            let b = if k % 2 == 0 { 60 } else { 100 };
            let f = if k < 20 { 1.0 } else { 1.7 };
            shape.observe(&[(b as f64, f * line(b))]);
        }
        assert!((shape.rho() - 10.0).abs() < 1e-6, "{}", shape.rho());
    }

    /// Evidence from one iteration does not move `ρ`, however large: the first move of a balancer
    /// two iterations old under 30% noise once read as a flat line (`ρ` at the grid's top), whose
    /// extreme splits starved a rank (balance_props' pinned cases).
    #[test]
    fn one_iteration_of_moved_sizes_does_not_move_the_shape() {
        let mut shape = Shape::new(2048, 2);
        for _ in 0..3 {
            shape.observe(&[(1024.0, 0.017), (1024.0, 0.010)]);
        }
        // Both ranks took as long as before with 240 samples moved (noise): a flat line explains it.
        shape.observe(&[(784.0, 0.017), (1264.0, 0.010)]);
        assert_eq!(shape.rho(), 0.0);
        // The same evidence iteration after iteration does.
        for k in 0..20 {
            let (b0, b1) = if k % 2 == 0 { (1024.0, 1024.0) } else { (784.0, 1264.0) };
            shape.observe(&[(b0, 0.017), (b1, 0.010 * (16384.0 + b1) / (16384.0 + 1024.0))]);
        }
        assert!(shape.rho() > 2048.0, "{}", shape.rho());
    }
}

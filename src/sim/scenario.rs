//! Scenarios: a cluster of ranks, their compute and communication costs, and what interferes with
//! them, as a TOML file (the shipped ones are in `scenarios/`, see `scenarios/README.md`).
//!
//! Rank `i` computes a batch of `b` samples at iteration `t` in
//! `f_i(t) · (α + s_i·β·b) · (1 + σ·ε_i(t))` seconds: `s_i` is its static speed (a draw from
//! `[compute].speeds`), `f_i(t)` the product of the slowdowns of the interference processes
//! acting on it then (≥ 1, but for a trace's: against its run's average uncontended line, see
//! [`calibrate`](super::calibrate)), `ε_i(t)` a standard normal draw. Contention stretches fixed and per-sample
//! costs alike, so `f` multiplies both. Every draw is keyed by (seed, process, rank, iteration),
//! so every policy of a run sees the same cluster.

use crate::balance::Line;
use crate::data::rng::{mix64, Rng};
use crate::error::{Error, Result};
use crate::train::metrics::IterRecord;
use crate::train::recipe::{shipped, Source};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A scenario file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Ranks when the command line does not say (`--ranks`).
    pub ranks: usize,
    pub iterations: usize,
    /// The global batch is `batch_per_rank × ranks`, so a scenario scales with the cluster.
    pub batch_per_rank: usize,
    /// Iterations per epoch, for `proportional-epoch`.
    #[serde(default = "default_epoch")]
    pub epoch_iters: usize,
    #[serde(default)]
    pub seed: u64,
    pub compute: Compute,
    #[serde(default)]
    pub comm: Comm,
    #[serde(default)]
    pub interference: Vec<Interference>,
}

fn default_epoch() -> usize {
    100
}

/// `[compute]`: the per-rank cost line and its noise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compute {
    /// Fixed seconds per iteration (α).
    pub alpha_s: f64,
    /// Seconds per sample (β) of a rank of speed 1.
    pub beta_s: f64,
    /// Relative standard deviation σ of a compute time.
    #[serde(default)]
    pub noise: f64,
    /// The noise's correlation from one iteration to the next, in `[0, 1)`: a shared host's
    /// slowness drifts, and a drift the last iteration shows is one a policy can follow, where
    /// independent noise of the same size is not. Each rank's draw is `ε(t) = φ·ε(t−1) + √(1 − φ²)·z(t)`, so `noise` stays
    /// its deviation. The Bayes oracle takes the noise as independent.
    #[serde(default)]
    pub noise_memory: f64,
    /// CPU seconds a rank spends on resuming from each freeze of a slice-granular process (a quota
    /// or a hog), beyond its work (resuming refills its caches, for one). It is CPU time: the rank's CPU clock
    /// and share count it. A rank under a quota whose every compute meets a freeze has a fixed
    /// cost of its own, and a small batch costs it more per sample than its slope.
    #[serde(default)]
    pub freeze_cost_s: f64,
    /// Static per-rank multipliers of β.
    #[serde(default)]
    pub speeds: Speeds,
}

/// How static per-rank speeds are drawn (a multiplier of β: 2 is twice as slow).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Speeds {
    #[default]
    Equal,
    /// Uniform in `[low, high]`.
    Uniform { low: f64, high: f64 },
    /// A `fraction` of the ranks (the first ones) `factor` times slower.
    TwoClass { fraction: f64, factor: f64 },
}

/// `[comm]`: what every iteration pays after its slowest rank's compute: the α-β cost of the
/// gradient allreduce, plus `fixed_s`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Comm {
    pub algorithm: CommAlgorithm,
    /// Seconds per message (α).
    pub latency_s: f64,
    /// Bytes per second of a link (1/β).
    pub bandwidth_bytes_per_s: f64,
    /// The gradient's bytes.
    pub bytes: f64,
    /// Seconds every iteration pays besides the allreduce, whatever the ranks and sizes (the
    /// optimizer step, the balancer, bookkeeping). A calibrated replay (`lbbsp simulate
    /// --calibrate`) puts all it measured after the slowest rank's compute here.
    pub fixed_s: f64,
    /// Seconds each rank reports of its collective's transfer, which the balancer takes for the
    /// collective's own; unset, the allreduce's and `fixed_s`. A calibrated replay sets the least
    /// transfer its run recorded, so that its balancer is told what the recorded one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_s: Option<f64>,
}

impl Default for Comm {
    fn default() -> Self {
        Comm {
            algorithm: CommAlgorithm::Ring,
            latency_s: 5e-6,
            bandwidth_bytes_per_s: 1e10,
            bytes: 2.1e6,
            fixed_s: 0.0,
            transfer_s: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CommAlgorithm {
    /// Reduce-scatter + all-gather around a ring: `2(N−1)` steps of `bytes/N` each.
    Ring,
    /// Reduce and broadcast down a binary tree: `2·⌈log2 N⌉` steps of the whole buffer.
    Tree,
}

impl Comm {
    /// Seconds an iteration pays after its slowest rank's compute on `n` ranks: one allreduce
    /// (none on one rank) and `fixed_s`.
    pub fn seconds(&self, n: usize) -> f64 {
        self.allreduce_s(n) + self.fixed_s
    }

    /// Seconds of one allreduce over `n` ranks.
    pub fn allreduce_s(&self, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let per_byte = 1.0 / self.bandwidth_bytes_per_s;
        match self.algorithm {
            CommAlgorithm::Ring => {
                let steps = 2.0 * (n - 1) as f64;
                steps * (self.latency_s + self.bytes / n as f64 * per_byte)
            }
            CommAlgorithm::Tree => {
                let steps = 2.0 * (usize::BITS - (n - 1).leading_zeros()) as f64;
                steps * (self.latency_s + self.bytes * per_byte)
            }
        }
    }
}

/// Which ranks a process acts on: the first `count`, or the first `fraction` of them (at least
/// one), or the listed ones.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Targets {
    pub fraction: Option<f64>,
    pub count: Option<usize>,
    pub ranks: Vec<usize>,
    /// Whether the process shows in the CPU share its ranks report (the interference signal):
    /// unset, a co-located job does (steady, square, markov) and slow hardware does not
    /// (fail-slow: a throttled or failing part takes no CPU time from the rank).
    pub signal: Option<bool>,
}

impl Targets {
    fn select(&self, n: usize) -> Vec<usize> {
        if !self.ranks.is_empty() {
            return self.ranks.iter().copied().filter(|&r| r < n).collect();
        }
        let k = match (self.count, self.fraction) {
            (Some(c), _) => c.min(n),
            (None, Some(f)) => ((f * n as f64).round() as usize).clamp(1, n),
            (None, None) => n,
        };
        // Spread over the ranks (every n/k-th), so that a fraction of a small cluster is not all
        // the low ranks.
        (0..k).map(|j| j * n / k).collect()
    }
}

/// One interference process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Interference {
    /// A co-located job from iteration `from` to `until` (exclusive; unset: the end).
    Steady {
        #[serde(flatten)]
        on: Targets,
        factor: f64,
        #[serde(default)]
        from: usize,
        until: Option<usize>,
    },
    /// On/off with a fixed period: `on` iterations slowed, `off` iterations not, from `from`.
    Square {
        #[serde(flatten)]
        on: Targets,
        factor: f64,
        on_iters: usize,
        off_iters: usize,
        #[serde(default)]
        from: usize,
    },
    /// A two-state Markov chain per rank: off → on with probability `p_on` per iteration, on →
    /// off with `p_off` (mean burst `1/p_off` iterations). With `within`, each change falls at a
    /// uniform point of its iteration's work ([`switched`]), as a job's start and end do in wall
    /// time; without, at the iteration's start.
    Markov {
        #[serde(flatten)]
        on: Targets,
        factor: f64,
        p_on: f64,
        p_off: f64,
        #[serde(default)]
        within: bool,
    },
    /// Fail-slow episodes: each targeted rank starts one with probability `rate` per iteration,
    /// lasting an exponential number of iterations of mean `mean_iters`, at a slowdown uniform in
    /// `[factor_low, factor_high]`. `within` as for [`Interference::Markov`].
    FailSlow {
        #[serde(flatten)]
        on: Targets,
        rate: f64,
        mean_iters: f64,
        factor_low: f64,
        factor_high: f64,
        #[serde(default)]
        within: bool,
    },
    /// A measured run: the per-iteration JSONL of `lbbsp train --metrics`. Rank `i` of the
    /// scenario follows rank `i mod world` of the trace, its slowdown at iteration `t` being its
    /// compute time then over the run's uncontended line at its batch size (one line for all
    /// ranks, [`calibrate::trace_line`](super::calibrate::trace_line)) and its CPU share the one
    /// the rank reported; the trace repeats past its end.
    Trace { path: PathBuf },
    /// A measured run written into the scenario (`lbbsp simulate --calibrate RUN --inline`), so it
    /// stands alone: per rank of the run, its slowdown each iteration and, optionally, the CPU
    /// share it reported (1 where absent). Rank `i` follows rank `i mod` their count, repeating
    /// past the end, as a `trace` does.
    Series {
        factors: PerRank,
        #[serde(default)]
        shares: PerRank,
        /// Per rank of the run, its preemptions, its share over whole iterations and the seconds
        /// of the iteration that share is over, as recorded (absent: none recorded).
        #[serde(default)]
        preemptions: PerRank,
        #[serde(default)]
        run_shares: PerRank,
        #[serde(default)]
        run_seconds: PerRank,
    },
    /// A CPU quota, as a container's limit makes one (the cgroup `cpu` controller): the rank runs
    /// at most `quota_s` of every `period_s` seconds of wall time and is frozen for the rest of the
    /// period once it has spent it. Slice-granular: it acts on seconds, not iterations, so an
    /// iteration shorter than the period is either untouched or frozen for most of a period.
    Quota {
        #[serde(flatten)]
        on: Targets,
        quota_s: f64,
        period_s: f64,
    },
    /// A CPU hog sharing the rank's core: the scheduler gives the core to each in turns of
    /// `slice_s` seconds, so the rank gets half of it, in whole slices. With `on_s` and `off_s`, a
    /// bursty job: the hog runs `on_s` of every `on_s + off_s` seconds of wall time (each rank at
    /// its own phase) and the rank has its core to itself in between. A job's bursts follow the
    /// wall clock, not the iterations: a policy whose iterations are faster meets them in more of
    /// its iterations.
    Hog {
        #[serde(flatten)]
        on: Targets,
        slice_s: f64,
        #[serde(default)]
        on_s: Option<f64>,
        #[serde(default)]
        off_s: Option<f64>,
    },
}

/// When a rank may run under a slice-granular process ([`Interference::Quota`],
/// [`Interference::Hog`]): `run_s` of every `period_s` seconds of wall time, the windows shifted by
/// `phase_s`. A rank is always runnable (it busy-polls while it waits for the others, as the
/// trainer's ranks do with one rank per core), so it runs in every window, whatever it computes.
/// With `bursts`, the windows hold only within a burst, and the rank runs freely outside one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slices {
    pub run_s: f64,
    pub period_s: f64,
    pub phase_s: f64,
    pub bursts: Option<Bursts>,
    /// CPU seconds each freeze costs the rank on resuming (`compute.freeze_cost_s`).
    pub refill_s: f64,
}

/// Bursts of a slice-granular process: `on_s` of every `cycle_s` seconds of wall time, each burst's
/// windows starting with the rank running at its onset (`phase_s` then shifts the bursts).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bursts {
    pub on_s: f64,
    pub cycle_s: f64,
}

impl Bursts {
    /// The whole cycles before time `y`, and the seconds into the one it falls in.
    fn cycles(&self, y: f64) -> (f64, f64) {
        let k = (y / self.cycle_s).floor();
        (k, y - k * self.cycle_s)
    }
}

impl Slices {
    /// CPU seconds the windows allow in their first `u` seconds.
    fn windows_cpu(&self, u: f64) -> f64 {
        let k = (u / self.period_s).floor();
        k * self.run_s + (u - k * self.period_s).min(self.run_s)
    }

    /// The first time at which the windows have allowed `cpu` seconds (> 0).
    fn windows_wall(&self, cpu: f64) -> f64 {
        // The window in which the cumulative CPU reaches cpu: the first k with (k + 1)·run ≥ cpu
        // (a rounding above a window's end must not skip the freeze after it).
        let k = (cpu / self.run_s * (1.0 - 1e-12)).ceil() - 1.0;
        k * self.period_s + (cpu - k * self.run_s)
    }

    /// Off-windows that begin in the windows' first `u` seconds (−1 before the first one).
    fn windows_off_starts(&self, u: f64) -> f64 {
        ((u - self.run_s) / self.period_s).floor()
    }

    /// A burst's CPU seconds and off-windows, and a whole cycle's CPU seconds.
    fn burst_totals(&self, b: Bursts) -> (f64, f64, f64) {
        let in_burst = self.windows_cpu(b.on_s);
        let offs = ((b.on_s - self.run_s) / self.period_s).ceil().max(0.0);
        (in_burst, offs, in_burst + b.cycle_s - b.on_s)
    }

    /// CPU seconds the rank may have had from clock 0 to wall clock `x`.
    fn available(&self, x: f64) -> f64 {
        let y = x + self.phase_s;
        let Some(b) = self.bursts else { return self.windows_cpu(y) };
        let (in_burst, _, cycle) = self.burst_totals(b);
        let (k, r) = b.cycles(y);
        k * cycle + if r < b.on_s { self.windows_cpu(r) } else { in_burst + r - b.on_s }
    }

    /// Wall seconds from clock `start` until the rank has done `work` CPU seconds of work, each
    /// freeze met (the one it starts in too) costing it `refill_s` more: the least fixed point of
    /// `cpu = work + refill·freezes(wall(cpu))`, reached from below (each refill can meet another
    /// freeze; a refill as long as a window never ends, and the rank is validated against that).
    pub fn wall(&self, start: f64, work: f64) -> f64 {
        let mut cpu = work;
        let mut wall = self.reached(start, cpu);
        if self.refill_s > 0.0 && work > 0.0 {
            for _ in 0..64 {
                let next = work + self.refill_s * self.freezes(start, wall);
                if next <= cpu {
                    break;
                }
                (cpu, wall) = (next, self.reached(start, next));
            }
        }
        wall
    }

    /// CPU seconds of work the rank may do within `wall` seconds from clock `start`: its windows'
    /// CPU less the refills of the freezes met.
    pub fn work_within(&self, start: f64, wall: f64) -> f64 {
        (self.cpu_within(start, wall) - self.refill_s * self.freezes(start, wall)).max(0.0)
    }

    /// Wall seconds from clock `start` until the rank has had `cpu` seconds of CPU.
    fn reached(&self, start: f64, cpu: f64) -> f64 {
        if cpu <= 0.0 {
            return 0.0;
        }
        let v = self.available(start) + cpu;
        let y = match self.bursts {
            None => self.windows_wall(v),
            Some(b) => {
                let (in_burst, _, cycle) = self.burst_totals(b);
                let k = (v / cycle).floor();
                let rem = v - k * cycle;
                k * b.cycle_s
                    + match rem {
                        r if r <= 0.0 => 0.0,
                        // A rounding above the burst's CPU must not skip the freeze that ends it.
                        r if r <= in_burst + 1e-12 * cycle => self.windows_wall(r.min(in_burst)),
                        r => b.on_s + r - in_burst,
                    }
            }
        };
        (y - self.phase_s - start).max(cpu)
    }

    /// Off-windows that begin up to wall clock `x` (from a fixed origin).
    fn off_starts(&self, x: f64) -> f64 {
        let y = x + self.phase_s;
        let Some(b) = self.bursts else { return self.windows_off_starts(y) };
        let (_, offs, _) = self.burst_totals(b);
        let (k, r) = b.cycles(y);
        k * offs + if r < b.on_s { self.windows_off_starts(r) + 1.0 } else { offs }
    }

    /// How many times the rank is frozen in `wall` seconds from clock `start` (the trainer's
    /// preemption count): the off-windows that begin inside, and the one it starts in.
    pub fn freezes(&self, start: f64, wall: f64) -> f64 {
        let inside = (self.off_starts(start + wall) - self.off_starts(start)).max(0.0);
        inside + f64::from(u8::from(!self.running(start)))
    }

    /// CPU seconds the rank may have within `wall` seconds from clock `start`.
    pub fn cpu_within(&self, start: f64, wall: f64) -> f64 {
        (self.available(start + wall) - self.available(start)).max(0.0)
    }

    /// How many times longer than its work the rank takes on average: `period / run`, or a
    /// cycle's seconds over its CPU seconds, each freeze's refill taken from the CPU.
    pub fn average_stretch(&self) -> f64 {
        // A rank that always runs meets one freeze a period and spends its refill in the window.
        match self.bursts {
            None => self.period_s / (self.run_s - self.refill_s),
            Some(b) => {
                let (_, offs, cycle) = self.burst_totals(b);
                b.cycle_s / (cycle - offs * self.refill_s)
            }
        }
    }

    /// Wall seconds from clock `x` until the rank may run (0 while it may).
    pub fn until_running(&self, x: f64) -> f64 {
        if self.running(x) {
            return 0.0;
        }
        // The wall time of a CPU slice far shorter than any window, less that slice.
        let slice = 1e-9 * self.run_s;
        self.reached(x, slice) - slice
    }

    /// Whether the rank may run at wall clock `x`.
    pub fn running(&self, x: f64) -> bool {
        let mut y = x + self.phase_s;
        if let Some(b) = self.bursts {
            y = b.cycles(y).1;
            if y >= b.on_s {
                return true;
            }
        }
        y - (y / self.period_s).floor() * self.period_s < self.run_s
    }
}

/// The slowdown of an iteration in which a random process goes from `from` to `to`: it changes at a
/// point uniform in the iteration's work (`w` done at `from`), as a co-located job starts or ends
/// at any time, not at an iteration's start; the iteration of an onset is partly slowed, and the
/// one of an end partly still slow.
fn switched(from: f64, to: f64, w: f64) -> f64 {
    if from == to {
        to
    } else {
        w * from + (1.0 - w) * to
    }
}

/// The atoms of a switch from `from` to `to` with probability `p`: [`switched`] at the midpoints of
/// the quarters of the work where the switch falls `within` the iteration, else `to`.
fn switches(p: f64, from: f64, to: f64, within: bool) -> impl Iterator<Item = (f64, f64)> {
    let k = if from == to || !within { 1 } else { 4 };
    let w = move |q: u8| if within { (f64::from(q) + 0.5) / f64::from(k) } else { 0.0 };
    (0..k).map(move |q| (p / f64::from(k), switched(from, to, w(q))))
}

/// The law of two independent factors' product.
fn combine(atoms: &mut Vec<(f64, f64)>, other: &[(f64, f64)]) {
    if let [(_, f)] = other {
        atoms.iter_mut().for_each(|a| a.1 *= f);
        return;
    }
    let before = std::mem::take(atoms);
    for &(p, f) in &before {
        atoms.extend(other.iter().filter(|a| a.0 > 0.0).map(|&(q, g)| (p * q, f * g)));
    }
}

/// Sets the slices of a slice-granular process's ranks, each with its own phase (keyed draws) of
/// the windows or, with bursts, of the bursts.
fn sliced(slices: &mut [Option<Slices>], on: &Targets, window: (f64, f64), bursts: Option<Bursts>, key: (u64, usize)) {
    let ((run_s, period_s), (seed, k)) = (window, key);
    for r in on.select(slices.len()) {
        let phase_s =
            bursts.map_or(period_s, |b| b.cycle_s) * Rng::from_keys(&[seed, k as u64, r as u64, 0x511ce]).next_f64();
        slices[r] = Some(Slices { run_s, period_s, phase_s, bursts, refill_s: 0.0 });
    }
}

/// The slowdowns of one iteration, and the interference signal each rank reports for it.
pub struct Cluster {
    seed: u64,
    /// Static speed of every rank (β multiplier).
    pub speeds: Vec<f64>,
    processes: Vec<Process>,
    /// Whether each process shows in the CPU share.
    visible: Vec<bool>,
    /// `f_i` of the current iteration.
    pub factor: Vec<f64>,
    /// The part of `f_i` the ranks' CPU shares do not show.
    hidden: Vec<f64>,
    /// Each rank's preemptions, share over the whole iteration before and that iteration's
    /// seconds where a measured run recorded them (0, no measure, elsewhere).
    pub measured: Vec<[f64; 3]>,
    /// Each rank's slice-granular process, if any: it acts on wall-clock seconds, so the
    /// simulator applies it per policy, at that policy's own clock.
    pub slices: Vec<Option<Slices>>,
}

enum Process {
    Window {
        ranks: Vec<usize>,
        factor: f64,
        active: Box<dyn Fn(usize) -> bool>,
    },
    Markov {
        ranks: Vec<usize>,
        factor: f64,
        p_on: f64,
        p_off: f64,
        on: Vec<bool>,
        within: bool,
    },
    FailSlow {
        ranks: Vec<usize>,
        rate: f64,
        mean: f64,
        low: f64,
        high: f64,
        within: bool,
        /// Iterations left in the episode and its factor (1 outside one).
        left: Vec<(usize, f64)>,
    },
    /// A slice-granular process: nothing per iteration (see [`Cluster::slices`]).
    Sliced,
    /// Per rank and iteration: the recorded slowdown, the CPU share the rank reported, and its
    /// preemptions and share over the whole iteration (empty where the run did not record them);
    /// and the iteration of the run the replay starts at.
    Trace {
        factors: Vec<Vec<f64>>,
        shares: Vec<Vec<f64>>,
        freezes: [PerRank; 3],
        start: usize,
    },
}

impl Scenario {
    /// Reads a scenario file; a relative trace path is relative to the file's folder.
    pub fn load(path: &Path) -> Result<Scenario> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let mut s = Scenario::parse(&text, path)?;
        let base = path.parent().unwrap_or(Path::new("."));
        for p in &mut s.interference {
            if let Interference::Trace { path } = p {
                if path.is_relative() {
                    *path = base.join(&*path);
                }
            }
        }
        Ok(s)
    }

    /// Parses and validates scenario text; `path` only names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Scenario> {
        let err = |msg: String| Error::data(path, msg);
        let s: Scenario = toml::from_str(text).map_err(|e| err(e.to_string()))?;
        let positive = [
            ("ranks", s.ranks as f64),
            ("iterations", s.iterations as f64),
            ("batch_per_rank", s.batch_per_rank as f64),
            ("epoch_iters", s.epoch_iters as f64),
            ("compute.beta_s", s.compute.beta_s),
            ("comm.bandwidth_bytes_per_s", s.comm.bandwidth_bytes_per_s),
        ];
        if let Some((k, v)) = positive.iter().find(|(_, v)| !(*v > 0.0 && v.is_finite())) {
            return Err(err(format!("`{k}` must be positive, got {v}")));
        }
        if !(s.compute.alpha_s >= 0.0 && s.compute.noise >= 0.0 && s.compute.noise < 0.5) {
            return Err(err("`compute.alpha_s` must be ≥ 0 and `compute.noise` in [0, 0.5)".into()));
        }
        if !(0.0..1.0).contains(&s.compute.noise_memory) {
            return Err(err(format!("`compute.noise_memory` must be in [0, 1), got {}", s.compute.noise_memory)));
        }
        if !(s.compute.freeze_cost_s >= 0.0 && s.compute.freeze_cost_s.is_finite()) {
            return Err(err(format!(
                "`compute.freeze_cost_s` must be a finite number of seconds ≥ 0, got {}",
                s.compute.freeze_cost_s
            )));
        }
        if let Some(t) = s.comm.transfer_s.filter(|t| !(*t >= 0.0 && t.is_finite())) {
            return Err(err(format!("`comm.transfer_s` must be a finite number of seconds ≥ 0, got {t}")));
        }
        if !(s.comm.fixed_s >= 0.0 && s.comm.fixed_s.is_finite()) {
            return Err(err(format!("`comm.fixed_s` must be a finite number of seconds ≥ 0, got {}", s.comm.fixed_s)));
        }
        for (k, p) in s.interference.iter().enumerate() {
            p.validate().map_err(|m| err(format!("`interference[{k}]`: {m}")))?;
            // A refill as long as the window the rank resumes in would take all of it, every time.
            let window = match p {
                Interference::Quota { quota_s, .. } => *quota_s,
                Interference::Hog { slice_s, .. } => *slice_s,
                _ => f64::INFINITY,
            };
            if s.compute.freeze_cost_s >= 0.5 * window {
                return Err(err(format!(
                    "`compute.freeze_cost_s` ({} s) must be under half of `interference[{k}]`'s running window ({window} s)",
                    s.compute.freeze_cost_s
                )));
            }
        }
        Ok(s)
    }

    /// Whether some interference is a measured run (`trace` or `series`).
    pub fn measured(&self) -> bool {
        self.interference.iter().any(|p| matches!(p, Interference::Trace { .. } | Interference::Series { .. }))
    }

    /// The global batch at `n` ranks.
    pub fn global_batch(&self, n: usize) -> usize {
        self.batch_per_rank * n
    }
}

impl Interference {
    fn validate(&self) -> std::result::Result<(), String> {
        let factor_ok = |f: f64| f >= 1.0 && f.is_finite();
        let prob_ok = |p: f64| (0.0..=1.0).contains(&p);
        match self {
            Interference::Steady { factor, .. } | Interference::Square { factor, .. } if !factor_ok(*factor) => {
                Err(format!("factor must be ≥ 1, got {factor}"))
            }
            Interference::Square { on_iters: 0, .. } => Err("on_iters must be at least 1".into()),
            Interference::Markov { factor, p_on, p_off, .. } => {
                match (factor_ok(*factor), prob_ok(*p_on), prob_ok(*p_off)) {
                    (true, true, true) if *p_off > 0.0 => Ok(()),
                    _ => Err("factor must be ≥ 1, p_on in [0, 1] and p_off in (0, 1]".into()),
                }
            }
            Interference::FailSlow { rate, mean_iters, factor_low, factor_high, .. } => {
                if prob_ok(*rate) && *mean_iters >= 1.0 && factor_ok(*factor_low) && factor_high >= factor_low {
                    Ok(())
                } else {
                    Err("rate in [0, 1], mean_iters ≥ 1 and 1 ≤ factor_low ≤ factor_high".into())
                }
            }
            Interference::Series { factors, shares, preemptions, run_shares, run_seconds } => {
                let ranks_ok = |v: &PerRank| v.iter().all(|r| !r.is_empty());
                if factors.is_empty()
                    || ![shares, preemptions, run_shares, run_seconds, factors].into_iter().all(ranks_ok)
                {
                    Err("factors needs at least one rank, and every rank of factors, shares, preemptions, \
                         run_shares and run_seconds at least one iteration"
                        .into())
                } else if let Some(x) = run_seconds.iter().flatten().find(|x| !(**x >= 0.0 && x.is_finite())) {
                    Err(format!("run_seconds must be seconds of 0 or more (0: not measured), got {x}"))
                } else if let Some(x) = preemptions.iter().flatten().find(|x| !(**x >= 0.0 && x.is_finite())) {
                    Err(format!("preemptions must be counts of 0 or more, got {x}"))
                } else if let Some(x) = run_shares.iter().flatten().find(|x| !(**x >= 0.0 && **x <= 1.0)) {
                    Err(format!("run_shares must be CPU shares in [0, 1] (0: not measured), got {x}"))
                } else if let Some(f) = factors.iter().flatten().find(|f| !(**f > 0.0 && f.is_finite())) {
                    Err(format!("factors must be positive slowdowns, got {f}"))
                } else if let Some(x) = shares.iter().flatten().find(|x| !(**x > 0.0 && **x <= 1.0)) {
                    Err(format!("shares must be CPU shares in (0, 1], got {x}"))
                } else {
                    Ok(())
                }
            }
            Interference::Quota { quota_s, period_s, .. } => {
                if *period_s > 0.0 && period_s.is_finite() && *quota_s > 0.0 && quota_s <= period_s {
                    Ok(())
                } else {
                    Err(format!("quota_s must be in (0, period_s] and period_s > 0, got {quota_s} of {period_s}"))
                }
            }
            Interference::Hog { slice_s, .. } if !(*slice_s > 0.0 && slice_s.is_finite()) => {
                Err(format!("slice_s must be a positive number of seconds, got {slice_s}"))
            }
            Interference::Hog { on_s, off_s, .. } if on_s.is_some() != off_s.is_some() => {
                Err("a bursty hog needs both on_s and off_s (seconds on and off), or neither for a steady one".into())
            }
            Interference::Hog { on_s: Some(on), off_s: Some(off), .. }
                if !(*on > 0.0 && on.is_finite() && *off > 0.0 && off.is_finite()) =>
            {
                Err(format!("on_s and off_s must be positive numbers of seconds, got {on} and {off}"))
            }
            _ => Ok(()),
        }
    }
}

/// Values by rank, then by iteration.
pub(crate) type PerRank = Vec<Vec<f64>>;

/// The slowdowns and CPU shares of a measured run's file ([`slowdowns`] against its own
/// [`trace_line`](super::calibrate::trace_line)).
fn trace_factors(path: &Path) -> Result<(PerRank, PerRank, [PerRank; 3])> {
    let records: Vec<IterRecord> = crate::train::metrics::read_records(path)?;
    if records.first().is_none_or(|r| r.batch_sizes.is_empty()) {
        return Err(Error::data(path, "holds no iterations: record one with `lbbsp train --metrics FILE`"));
    }
    let (factors, shares) = slowdowns(&records, &super::calibrate::trace_line(&records));
    Ok((factors, shares, freezes(&records)))
}

/// Per rank of a measured run, by iteration: its preemptions, its share over the whole iteration
/// before, and that iteration's seconds (each empty where the run did not record them).
pub(crate) fn freezes(records: &[IterRecord]) -> [PerRank; 3] {
    let world = records.first().map_or(0, |r| r.batch_sizes.len());
    let column = |get: &dyn Fn(&IterRecord) -> &Vec<f64>, most: f64| -> PerRank {
        if records.iter().any(|r| get(r).len() != world) {
            return Vec::new();
        }
        (0..world).map(|k| records.iter().map(|r| get(r)[k].clamp(0.0, most)).collect()).collect()
    };
    // Shares as the CPU shares are replayed: of one core, at most 1.
    let shares = column(&|r| &r.run_share, 1.0);
    let before = |t: usize| crate::train::metrics::seconds_before(records, t);
    let seconds = if shares.is_empty() { Vec::new() } else { vec![(0..records.len()).map(before).collect()] };
    [column(&|r| &r.preemptions, f64::MAX), shares, seconds]
}

/// Per-rank slowdowns of a measured run, by iteration: each rank's compute time over `line` (the
/// run's uncontended line) at its batch size (1 where it timed nothing). Against one line, not a
/// ratio of seconds per sample: with a fixed cost a rank's time per sample falls as its batch
/// grows, which is no change of speed. Second, the CPU share each rank reported (in (0, 1]).
pub(crate) fn slowdowns(records: &[IterRecord], line: &Line) -> (PerRank, PerRank) {
    let world = records.first().map_or(0, |r| r.batch_sizes.len());
    let factor = |r: &IterRecord, k: usize| match (r.batch_sizes.get(k), r.compute_s.get(k)) {
        (Some(&b), Some(&c)) if b > 0 && c > 0.0 => c / line.at(b),
        _ => 1.0,
    };
    let share = |r: &IterRecord, k: usize| match r.cpu_share.get(k) {
        Some(&s) if s > 0.0 && s.is_finite() => s.min(1.0),
        _ => 1.0,
    };
    let per_rank = |f: &dyn Fn(&IterRecord, usize) -> f64| -> PerRank {
        (0..world).map(|k| records.iter().map(|r| f(r, k)).collect()).collect()
    };
    (per_rank(&factor), per_rank(&share))
}

impl Process {
    /// The process of a scenario's interference `p` at `slices.len()` ranks; a slice-granular one
    /// sets its ranks' slices instead. `(seed, k)` key its phases.
    fn of(p: &Interference, slices: &mut [Option<Slices>], (seed, k): (u64, usize)) -> Result<Process> {
        let n = slices.len();
        Ok(match p {
            Interference::Steady { on, factor, from, until } => {
                let (from, until) = (*from, until.unwrap_or(usize::MAX));
                Process::Window {
                    ranks: on.select(n),
                    factor: *factor,
                    active: Box::new(move |t| from <= t && t < until),
                }
            }
            Interference::Square { on, factor, on_iters, off_iters, from } => {
                let (from, on_i, period) = (*from, *on_iters, on_iters + off_iters);
                Process::Window {
                    ranks: on.select(n),
                    factor: *factor,
                    active: Box::new(move |t| t >= from && (t - from) % period < on_i),
                }
            }
            Interference::Markov { on, factor, p_on, p_off, within } => {
                let ranks = on.select(n);
                let k = ranks.len();
                let on = vec![false; k];
                Process::Markov { ranks, factor: *factor, p_on: *p_on, p_off: *p_off, on, within: *within }
            }
            Interference::FailSlow { on, rate, mean_iters, factor_low, factor_high, within } => {
                let ranks = on.select(n);
                let k = ranks.len();
                Process::FailSlow {
                    ranks,
                    rate: *rate,
                    mean: *mean_iters,
                    low: *factor_low,
                    high: *factor_high,
                    within: *within,
                    left: vec![(0, 1.0); k],
                }
            }
            Interference::Trace { path } => {
                let (factors, shares, freezes) = trace_factors(path)?;
                Process::Trace { start: replay_start(seed, &factors), factors, shares, freezes }
            }
            Interference::Series { factors, shares, preemptions, run_shares, run_seconds } => Process::Trace {
                start: replay_start(seed, factors),
                factors: factors.clone(),
                shares: if shares.is_empty() { vec![vec![1.0]] } else { shares.clone() },
                freezes: [preemptions.clone(), run_shares.clone(), run_seconds.clone()],
            },
            Interference::Quota { on, quota_s, period_s } => {
                sliced(slices, on, (*quota_s, *period_s), None, (seed, k));
                Process::Sliced
            }
            Interference::Hog { on, slice_s, on_s, off_s } => {
                let bursts = on_s.zip(*off_s).map(|(on_s, off_s)| Bursts { on_s, cycle_s: on_s + off_s });
                sliced(slices, on, (*slice_s, 2.0 * slice_s), bursts, (seed, k));
                Process::Sliced
            }
        })
    }
}

/// Where a replayed run starts: its first iteration at the scenario's own seed 0, and at another
/// seed a point of the run drawn by it. One run replayed from its start gives every seed the same
/// iterations, and so an interval of no width about a result that a policy's slightest change moves
/// by percents (a decision taken or not at one iteration changes every one after it); drawn
/// starting points replay the same measured process from other points of it.
fn replay_start(seed: u64, factors: &[Vec<f64>]) -> usize {
    let len = factors.iter().map(Vec::len).max().unwrap_or(0).max(1);
    // Fibonacci hashing: seed 0 keeps its start, consecutive seeds spread over the run.
    ((seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % len as u64) as usize
}

impl Cluster {
    /// The cluster of `scenario` at `n` ranks, before its first iteration.
    pub fn new(scenario: &Scenario, n: usize) -> Result<Cluster> {
        let seed = scenario.seed;
        let mut rng = Rng::from_keys(&[seed, 0x5eed]);
        let speeds = (0..n)
            .map(|i| match scenario.compute.speeds {
                Speeds::Equal => 1.0,
                Speeds::Uniform { low, high } => low + (high - low) * rng.next_f64(),
                Speeds::TwoClass { fraction, factor } => {
                    if (i as f64) < fraction * n as f64 {
                        factor
                    } else {
                        1.0
                    }
                }
            })
            .collect();
        let mut processes = Vec::new();
        let mut visible = Vec::new();
        let mut slices = vec![None; n];
        for p in &scenario.interference {
            visible.push(match p {
                Interference::Steady { on, .. } | Interference::Square { on, .. } | Interference::Markov { on, .. } => {
                    on.signal.unwrap_or(true)
                }
                Interference::FailSlow { on, .. } => on.signal.unwrap_or(false),
                Interference::Trace { .. } | Interference::Series { .. } => false,
                // The rank's CPU share shows the frozen part of its wall time (the simulator's).
                Interference::Quota { .. } | Interference::Hog { .. } => true,
            });
            let process = Process::of(p, &mut slices, (seed, processes.len()))?;
            processes.push(process);
        }
        slices.iter_mut().flatten().for_each(|s| s.refill_s = scenario.compute.freeze_cost_s);
        Ok(Cluster {
            seed,
            speeds,
            processes,
            visible,
            factor: vec![1.0; n],
            hidden: vec![1.0; n],
            measured: vec![[0.0; 3]; n],
            slices,
        })
    }

    /// Advances every process to iteration `t` and sets [`Cluster::factor`].
    pub fn step(&mut self, t: usize) {
        self.factor.iter_mut().for_each(|f| *f = 1.0);
        self.hidden.iter_mut().for_each(|f| *f = 1.0);
        self.measured.iter_mut().for_each(|m| *m = [0.0; 3]);
        let n = self.factor.len();
        let (factors, hidden, measured) = (&mut self.factor, &mut self.hidden, &mut self.measured);
        for (k, p) in self.processes.iter_mut().enumerate() {
            let key = |r: usize| Rng::from_keys(&[self.seed, k as u64, r as u64, t as u64]);
            let visible = self.visible[k];
            let mut slow = |r: usize, f: f64| {
                factors[r] *= f;
                if !visible {
                    hidden[r] *= f;
                }
            };
            match p {
                Process::Window { ranks, factor, active } => {
                    if active(t) {
                        ranks.iter().for_each(|&r| slow(r, *factor));
                    }
                }
                Process::Markov { ranks, factor, p_on, p_off, on, within } => {
                    for (j, &r) in ranks.iter().enumerate() {
                        let mut g = key(r);
                        let (was, u) = (on[j], g.next_f64());
                        on[j] = if was { u >= *p_off } else { u < *p_on };
                        let at = |s: bool| if s { *factor } else { 1.0 };
                        slow(r, if *within { switched(at(was), at(on[j]), g.next_f64()) } else { at(on[j]) });
                    }
                }
                Process::FailSlow { ranks, rate, mean, low, high, left, within } => {
                    for (j, &r) in ranks.iter().enumerate() {
                        let mut g = key(r);
                        let was = left[j].1;
                        if left[j].0 == 0 && g.next_f64() < *rate {
                            let len = (-(1.0 - g.next_f64()).ln() * *mean).ceil().max(1.0) as usize;
                            left[j] = (len, *low + (*high - *low) * g.next_f64());
                        }
                        if left[j].0 > 0 {
                            left[j].0 -= 1;
                        } else {
                            left[j].1 = 1.0;
                        }
                        slow(r, if *within { switched(was, left[j].1, g.next_f64()) } else { left[j].1 });
                    }
                }
                Process::Sliced => {}
                // A recorded run shows the CPU share its ranks reported, as the trainer's balancer saw it.
                Process::Trace { factors: series, shares, freezes, start } => {
                    let t = t + *start;
                    for r in 0..n {
                        let (f, s) = (&series[r % series.len()], &shares[r % shares.len()]);
                        let (f, s) = (f[t % f.len()], s[t % s.len()]);
                        factors[r] *= f;
                        hidden[r] *= f * s;
                        for (m, column) in measured[r].iter_mut().zip(freezes.iter()) {
                            if let Some(x) = column.get(r % column.len().max(1)).and_then(|x| x.get(t % x.len().max(1)))
                            {
                                *m = *x;
                            }
                        }
                    }
                }
            }
        }
    }

    /// The law of every rank's slowdown `f_i(t)` given each process's state after iteration `t − 1`
    /// (call it before [`Cluster::step`]`(t)`), as atoms (probability, factor), for the Bayes
    /// oracle. A process's law is what its scenario says: a window's schedule is known, a Markov
    /// chain turns with its probabilities, a fail-slow episode ends with the hazard of its
    /// exponential length and begins with its rate (at the quartiles' midpoints of its factors).
    /// A measured run has no law: its rank is expected to stay as it was (as the late oracle does).
    pub fn predict(&self, t: usize, atoms: &mut [Vec<(f64, f64)>]) {
        for a in atoms.iter_mut() {
            a.clear();
            a.push((1.0, 1.0));
        }
        let mut law = Vec::with_capacity(8);
        for p in &self.processes {
            match p {
                Process::Window { ranks, factor, active } => {
                    if active(t) {
                        ranks.iter().for_each(|&r| atoms[r].iter_mut().for_each(|a| a.1 *= factor));
                    }
                }
                Process::Markov { ranks, factor, p_on, p_off, on, within } => {
                    for (j, &r) in ranks.iter().enumerate() {
                        let (now, p) = if on[j] { (*factor, *p_off) } else { (1.0, *p_on) };
                        law.clear();
                        law.push((1.0 - p, now));
                        law.extend(switches(p, now, if on[j] { 1.0 } else { *factor }, *within));
                        law.retain(|a| a.0 > 0.0);
                        combine(&mut atoms[r], &law);
                    }
                }
                Process::FailSlow { ranks, rate, mean, low, high, left, within } => {
                    for (j, &r) in ranks.iter().enumerate() {
                        let now = left[j].1;
                        let stay = if now > 1.0 { (-1.0 / mean).exp() } else { 0.0 };
                        law.clear();
                        law.push((stay, now));
                        let (end, onset) = ((1.0 - stay) * (1.0 - rate), (1.0 - stay) * rate);
                        law.extend(switches(end, now, 1.0, *within));
                        for q in 0..4 {
                            let f = low + (high - low) * (q as f64 + 0.5) / 4.0;
                            law.extend(switches(onset / 4.0, now, f, *within));
                        }
                        law.retain(|a| a.0 > 0.0);
                        combine(&mut atoms[r], &law);
                    }
                }
                Process::Trace { factors: series, start, .. } => {
                    let before = (t + start).saturating_sub(1);
                    for (r, a) in atoms.iter_mut().enumerate() {
                        let f = &series[r % series.len()];
                        a.iter_mut().for_each(|x| x.1 *= f[before % f.len()]);
                    }
                }
                Process::Sliced => {}
            }
        }
    }

    /// The CPU share rank `i` reports for the current iteration: what the visible processes leave
    /// it (a co-located job that makes it `f` times slower leaves it `1/f` of its core).
    pub fn share(&self, i: usize) -> f64 {
        self.hidden[i] / self.factor[i]
    }

    /// The noise draw `ε_i(t)` (standard normal) of rank `i` at iteration `t`.
    pub fn noise(&self, i: usize, t: usize) -> f64 {
        Rng::from_keys(&[mix64(self.seed ^ 0x6e_6f69_7365), i as u64, t as u64]).normal() as f64
    }
}

/// The scenarios shipped in `scenarios/`, embedded so that `lbbsp simulate steady-hog` works from
/// any folder.
pub const SHIPPED: &[(&str, &str)] = shipped!("scenarios": "quiet", "heterogeneous", "steady-hog", "square-wave", "bursty", "co-located", "fail-slow", "spikes", "oversubscribed", "oversubscribed-lasting", "alternating", "alternating-measured", "quota-long", "quota-short", "hog-short");

/// A scenario file, or the name of a shipped one.
pub fn resolve(name_or_path: &str) -> Result<Scenario> {
    match Source::of(name_or_path, "scenarios", SHIPPED) {
        Source::File(path) => Scenario::load(path),
        Source::Shipped { path, text } => Scenario::parse(text, &path),
        Source::Unknown => Err(Error::config(
            "scenario",
            format!(
                "{name_or_path:?} is neither a file nor a shipped scenario ({})",
                SHIPPED.iter().map(|s| s.0).collect::<Vec<_>>().join(", ")
            ),
        )),
    }
}

//! Calibration: the cost model of a recorded run (`lbbsp train --metrics`), so that the simulator
//! can replay it and be checked against it (`lbbsp simulate --calibrate RUN.jsonl`,
//! `scripts/validate_sim.sh`).
//!
//! From the per-iteration records it derives:
//! - the compute line `t(b) = α + β·b`, by least squares pooled over the rank-iterations in which
//!   the rank had its core to itself (a CPU share of at least [`UNCONTENDED_SHARE`]; all of them if
//!   none did). One line for all ranks, so that a rank that is slower throughout (a shared core, a
//!   co-located job that never leaves) shows as slower in the trace instead of being its own
//!   reference. When the sizes barely varied (an equal split) the fixed cost cannot be told from
//!   the per-sample one and the line is proportional, `α = 0`;
//! - the cost outside compute, `fixed_s`: the mean over iterations of `iter_s − max_i compute_i`,
//!   everything an iteration pays after its slowest rank's compute (the allreduce, the optimizer
//!   step, the balancer, the bookkeeping).
//!
//! The `trace` interference takes its per-rank slowdowns against the same line
//! ([`trace_line`]): `f_i(t) = compute_i(t) / (α + β·b_i(t))`. A scenario whose `[compute]` is that
//! line, with equal speeds and no noise ([`Calibration::scenario`]), therefore computes at the
//! recorded sizes exactly the recorded times, and at other sizes the recorded slowdown stretches
//! the line's fixed and per-sample costs alike. A ratio of per-sample times would not: with a
//! fixed cost, a rank whose batch grows looks faster per sample.

use crate::balance::Line;
use crate::error::{Error, Result};
use crate::sim::scenario::{slowdowns, Comm, Compute, Interference, PerRank, Scenario, Speeds};
use crate::train::metrics::{read_records, IterRecord};
use std::path::{Path, PathBuf};

/// A rank-iteration with at least this CPU share (its CPU time over the iteration's wall time) had
/// its core to itself.
pub const UNCONTENDED_SHARE: f64 = 0.9;

/// Below this spread of the sizes (standard deviation over mean) the fit is proportional: an equal
/// split tells nothing about the fixed cost.
const MIN_SIZE_SPREAD: f64 = 0.02;

/// The cost model of a recorded run.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    /// The recorded metrics file.
    pub path: PathBuf,
    pub world: usize,
    pub global_batch: usize,
    pub iterations: usize,
    /// Iterations of the run's first epoch (all of them if it has one).
    pub epoch_iters: usize,
    /// The compute line of a rank that has its core to itself ([`trace_line`]).
    pub line: Line,
    /// Mean seconds of an iteration after its slowest rank's compute.
    pub fixed_s: f64,
    /// The least transfer any rank recorded of a collective (None where none did).
    pub transfer_s: Option<f64>,
    /// Rank-iterations the line was fitted on, and whether they were the uncontended ones.
    pub fitted_on: usize,
    pub uncontended: bool,
    /// Per rank and iteration, the slowdowns over `line` and the CPU shares reported (what a
    /// `trace` of the file replays; written out by `--inline`).
    pub slowdowns: (PerRank, PerRank),
    /// Per rank, by iteration: its preemptions and its share over whole iterations (empty where the
    /// run did not record them).
    pub freezes: [PerRank; 3],
}

/// The compute line of a run's uncontended rank-iterations (see the module docs), the number of
/// rank-iterations it was fitted on, and whether those were uncontended ones. `None` when no rank
/// timed a positive batch.
pub fn fit_line(records: &[IterRecord]) -> Option<(Line, usize, bool)> {
    let pairs = |min_share: f64| -> Vec<(f64, f64)> {
        records
            .iter()
            .flat_map(|r| {
                (0..r.batch_sizes.len()).filter_map(move |k| {
                    let (b, c) = (r.batch_sizes[k], r.compute_s.get(k).copied().unwrap_or(0.0));
                    let share = r.cpu_share.get(k).copied().unwrap_or(1.0);
                    (b > 0 && c > 0.0 && share >= min_share).then_some((b as f64, c))
                })
            })
            .collect()
    };
    let quiet = pairs(UNCONTENDED_SHARE);
    let (pts, uncontended) = if quiet.is_empty() { (pairs(f64::NEG_INFINITY), false) } else { (quiet, true) };
    if pts.is_empty() {
        return None;
    }
    let n = pts.len() as f64;
    let (mb, mc) = (pts.iter().map(|p| p.0).sum::<f64>() / n, pts.iter().map(|p| p.1).sum::<f64>() / n);
    let sbb = pts.iter().map(|p| (p.0 - mb).powi(2)).sum::<f64>();
    let sbc = pts.iter().map(|p| (p.0 - mb) * (p.1 - mc)).sum::<f64>();
    let proportional = Line { alpha: 0.0, beta: mc / mb };
    let line = if (sbb / n).sqrt() < MIN_SIZE_SPREAD * mb {
        proportional
    } else {
        let beta = sbc / sbb;
        let alpha = mc - beta * mb;
        // A negative fixed cost or no slope is no cost line (noise, or sizes chosen from the times).
        if alpha >= 0.0 && beta > 0.0 {
            Line { alpha, beta }
        } else {
            proportional
        }
    };
    Some((line, pts.len(), uncontended))
}

/// The line a trace's slowdowns are taken against: [`fit_line`], or one second per sample when no
/// rank timed anything (every slowdown is then 1).
pub fn trace_line(records: &[IterRecord]) -> Line {
    fit_line(records).map_or(Line { alpha: 0.0, beta: 1.0 }, |f| f.0)
}

/// Reads a recorded run and derives its cost model. Errors name the file: no iterations, an
/// iteration with another global batch (an epoch's short last batch: the simulator's global batch
/// is the same every iteration), or a global batch that does not split evenly over the ranks (the
/// simulator's is `batch_per_rank × ranks`).
pub fn calibrate(path: &Path) -> Result<Calibration> {
    let records = read_records(path)?;
    let first = records
        .first()
        .ok_or_else(|| Error::data(path, "holds no iterations: record one with `lbbsp train --metrics FILE`"))?;
    let (world, global_batch) = (first.batch_sizes.len(), first.global_batch);
    if world == 0 || global_batch % world != 0 {
        return Err(Error::data(
            path,
            format!(
                "global batch {global_batch} does not split evenly over {world} rank(s): the simulator's global batch is \
                 batch_per_rank × ranks"
            ),
        ));
    }
    if let Some(r) = records.iter().find(|r| r.global_batch != global_batch || r.batch_sizes.len() != world) {
        return Err(Error::data(
            path,
            format!(
                "iteration {} has a global batch of {} on {} rank(s), the first {global_batch} on {world}: record with a \
                 `train.global_batch` that divides the training set, so that no epoch ends on a short batch",
                r.iter,
                r.global_batch,
                r.batch_sizes.len()
            ),
        ));
    }
    let (line, fitted_on, uncontended) = fit_line(&records)
        .ok_or_else(|| Error::data(path, "no rank timed a positive batch: there is no compute line to fit"))?;
    let outside = records.iter().map(|r| r.iter_s - r.compute_s.iter().copied().fold(0.0, f64::max));
    let fixed_s = (outside.sum::<f64>() / records.len() as f64).max(0.0);
    let least =
        records.iter().flat_map(|r| r.comm_s.iter().copied()).filter(|t| *t > 0.0).fold(f64::INFINITY, f64::min);
    let epoch_iters = records.iter().take_while(|r| r.epoch == first.epoch).count();
    Ok(Calibration {
        // The scenario names the trace from wherever it is written.
        path: std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
        world,
        global_batch,
        iterations: records.len(),
        epoch_iters,
        line,
        fixed_s,
        transfer_s: least.is_finite().then_some(least),
        fitted_on,
        uncontended,
        slowdowns: slowdowns(&records, &line),
        freezes: super::scenario::freezes(&records),
    })
}

impl Calibration {
    /// The scenario that replays the run: its ranks, iterations and global batch, the calibrated
    /// line with equal speeds and no noise (the trace holds the measured noise), the cost outside
    /// compute as `[comm] fixed_s` (the allreduce's α-β model off: the measured cost holds the
    /// transfer), and the run itself as a `trace` interference; or, `inline`, as a `series` of the
    /// trace's slowdowns and CPU shares (to 4 decimals), a scenario that needs no other file.
    pub fn scenario(&self, inline: bool) -> Scenario {
        let stem = self.path.file_stem().map_or("run".into(), |s| s.to_string_lossy().into_owned());
        let interference = if inline {
            let round = |v: PerRank| -> PerRank {
                v.into_iter().map(|r| r.into_iter().map(|x| (x * 1e4).round() / 1e4).collect()).collect()
            };
            let (factors, shares) = self.slowdowns.clone();
            let [preemptions, run_shares, run_seconds] = self.freezes.clone();
            Interference::Series {
                factors: round(factors),
                shares: round(shares),
                preemptions,
                run_shares: round(run_shares),
                run_seconds,
            }
        } else {
            Interference::Trace { path: self.path.clone() }
        };
        Scenario {
            name: stem,
            description: format!("replay of {} (lbbsp simulate --calibrate)", self.path.display()),
            ranks: self.world,
            iterations: self.iterations,
            batch_per_rank: self.global_batch / self.world,
            epoch_iters: self.epoch_iters.max(1),
            seed: 0,
            compute: Compute {
                alpha_s: self.line.alpha,
                beta_s: self.line.beta,
                noise: 0.0,
                noise_memory: 0.0,
                freeze_cost_s: 0.0,
                speeds: Speeds::Equal,
            },
            comm: Comm {
                latency_s: 0.0,
                bytes: 0.0,
                fixed_s: self.fixed_s,
                transfer_s: self.transfer_s,
                ..Comm::default()
            },
            interference: vec![interference],
        }
    }

    /// [`Calibration::scenario`] as TOML, with a header saying what was fitted on what.
    pub fn scenario_toml(&self, inline: bool) -> String {
        let how = if self.uncontended { "uncontended" } else { "all (none was uncontended)" };
        let body = toml::to_string(&self.scenario(inline)).expect("a scenario always serialises");
        format!(
            "# Replays {} ({} ranks, {} iterations, B = {}): the compute line fitted on {} {how} rank-iterations,\n\
             # fixed_s the mean seconds of an iteration after its slowest rank's compute.\n{body}",
            self.path.display(),
            self.world,
            self.iterations,
            self.global_batch,
            self.fitted_on
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::BalanceConfig;
    use crate::sim::{simulate, SimPolicy};
    use crate::train::metrics::JsonlWriter;

    /// A record of `sizes` computed in `compute` seconds at CPU shares `share`, `outside` seconds
    /// after the slowest.
    fn rec(t: usize, sizes: Vec<usize>, compute: Vec<f64>, share: Vec<f64>, outside: f64) -> IterRecord {
        let mut r = IterRecord::timed(t, sizes, compute);
        r.iter_s += outside;
        r.cpu_share = share;
        r
    }

    fn write(name: &str, records: &[IterRecord]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lbbsp-calibrate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        let mut w = JsonlWriter::create(&path).unwrap();
        records.iter().for_each(|r| w.write(r).unwrap());
        w.flush().unwrap();
        path
    }

    /// Two ranks splitting 256 samples unevenly, on the line 10 ms + 1 ms/sample; rank 1 shares
    /// its core (CPU share 0.5, twice as slow) from iteration 10 on.
    fn uneven_run() -> Vec<IterRecord> {
        (0..30)
            .map(|t| {
                let b0 = 96 + 16 * (t % 5);
                let slow = if t >= 10 { 2.0 } else { 1.0 };
                let c = |b: usize| 0.010 + 0.001 * b as f64;
                let share = vec![1.0, 1.0 / slow];
                rec(t, vec![b0, 256 - b0], vec![c(b0), slow * c(256 - b0)], share, 0.003)
            })
            .collect()
    }

    #[test]
    fn the_line_is_fitted_on_uncontended_iterations() {
        let path = write("uneven.jsonl", &uneven_run());
        let cal = calibrate(&path).unwrap();
        assert!((cal.line.alpha - 0.010).abs() < 1e-9 && (cal.line.beta - 0.001).abs() < 1e-12, "{:?}", cal.line);
        // 30 of rank 0 and 10 of rank 1; the contended 20 are left out.
        assert_eq!((cal.fitted_on, cal.uncontended), (40, true));
        assert!((cal.fixed_s - 0.003).abs() < 1e-12, "{}", cal.fixed_s);
        assert_eq!((cal.world, cal.global_batch, cal.iterations, cal.epoch_iters), (2, 256, 30, 30));
        // Taken against this line, rank 1's slowdown is 2 whatever its size (a per-sample ratio
        // would mix in the fixed cost: 1.16 to 1.30 between its sizes here).
        let (records, line) = (uneven_run(), cal.line);
        for r in &records[10..] {
            assert!((r.compute_s[1] / line.at(r.batch_sizes[1]) - 2.0).abs() < 1e-9);
        }
    }

    #[test]
    fn an_equal_split_gives_a_proportional_line_and_all_contended_runs_fit_on_everything() {
        // Every rank-iteration contended: the fit falls back on all of them.
        let records: Vec<IterRecord> =
            (0..8).map(|t| rec(t, vec![100, 100], vec![0.2, 0.3 + 0.01 * t as f64], vec![0.6, 0.6], 0.0)).collect();
        let (line, n, uncontended) = fit_line(&records).unwrap();
        assert_eq!((line.alpha, n, uncontended), (0.0, 16, false));
        let mean = (8.0 * 0.2 + (0..8).map(|t| 0.3 + 0.01 * t as f64).sum::<f64>()) / 16.0;
        assert!((line.beta - mean / 100.0).abs() < 1e-15, "{line:?}");
        assert_eq!(fit_line(&[]), None);
    }

    /// The calibrated scenario of a recorded bsp run, through TOML and the simulator: its bsp
    /// iterations take what the recorded ones did (the recorded compute at the recorded sizes, then
    /// the cost outside compute).
    #[test]
    fn a_calibrated_scenario_replays_its_run() {
        let records = uneven_run();
        let bsp: Vec<IterRecord> = records
            .iter()
            .map(|r| {
                let slow = r.compute_s[1] / (0.010 + 0.001 * r.batch_sizes[1] as f64);
                let c = 0.010 + 0.001 * 128.0;
                let mut out = rec(r.iter, vec![128, 128], vec![c, slow * c], r.cpu_share.clone(), 0.0);
                out.iter_s += 0.002 + 0.001 * (r.iter % 3) as f64;
                out
            })
            .collect();
        let path = write("bsp.jsonl", &bsp);
        let cal = calibrate(&path).unwrap();
        let measured = bsp.iter().map(|r| r.iter_s).sum::<f64>() / bsp.len() as f64;
        // Inline, the slowdowns are rounded to 4 decimals: within 1e-4 of the run.
        for (inline, within) in [(false, 1e-12), (true, 1e-4)] {
            let text = cal.scenario_toml(inline);
            let scenario = Scenario::parse(&text, Path::new("replay.toml")).unwrap();
            assert_eq!(scenario, cal.scenario(inline));
            let r = simulate(&scenario, 2, &BalanceConfig::default(), None).unwrap();
            let simulated = r.get(SimPolicy::Bsp).unwrap().mean_iter_s;
            assert!((simulated / measured - 1.0).abs() < within, "inline {inline}: {simulated} vs {measured}");
        }
    }

    /// An lbbsp run under a quota of short windows (the simulator's, recorded as the trainer
    /// records one: preemptions and whole-iteration shares included), replayed through its
    /// calibrated scenario: the replayed balancer sees what the recorded one saw and takes the same
    /// splits.
    #[test]
    fn a_replayed_run_under_freezes_takes_the_recorded_splits() {
        let scenario = crate::sim::scenario::resolve("quota-short").unwrap();
        let cfg = BalanceConfig { policy: crate::balance::PolicyKind::Lbbsp, ..Default::default() };
        let mut recorded = Vec::new();
        let mut keep = |p: SimPolicy, r: IterRecord| {
            if p == SimPolicy::Lbbsp {
                recorded.push(r);
            }
        };
        simulate(&Scenario { iterations: 300, ..scenario }, 2, &cfg, Some(&mut keep)).unwrap();
        assert!(recorded.iter().any(|r| r.preemptions.iter().any(|&n| n > 0.0)));
        let path = write("frozen.jsonl", &recorded);
        let replay = calibrate(&path).unwrap().scenario(false);
        let mut replayed = Vec::new();
        let mut keep = |p: SimPolicy, r: IterRecord| {
            if p == SimPolicy::Lbbsp {
                replayed.push(r.batch_sizes);
            }
        };
        simulate(&replay, 2, &cfg, Some(&mut keep)).unwrap();
        let same = recorded.iter().zip(&replayed).filter(|(a, b)| a.batch_sizes == **b).count();
        assert!(same >= 295, "{same} of 300 splits as recorded");
    }

    #[test]
    fn errors_name_the_file_and_what_is_wrong() {
        let mut records = uneven_run();
        records[7].global_batch = 200;
        let short = write("short.jsonl", &records);
        let odd = write("odd.jsonl", &[rec(0, vec![2, 1], vec![0.1; 2], vec![1.0; 2], 0.0)]);
        let empty = write("empty.jsonl", &[]);
        for (path, want) in [
            (&short, "iteration 7 has a global batch of 200 on 2 rank(s), the first 256"),
            (&empty, "holds no iterations"),
            (&odd, "global batch 3 does not split evenly over 2 rank(s)"),
        ] {
            let e = calibrate(path).unwrap_err().to_string();
            assert!(e.starts_with(&path.display().to_string()) && e.contains(want), "{e}");
        }
    }
}

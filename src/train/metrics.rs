//! Machine-readable output: one JSON object per iteration (JSONL) and one summary per run.
//!
//! Rank 0 writes both, from per-rank values that every rank contributes to each iteration's
//! collective (the stats slots of [`GradSync`](crate::dist::sync::GradSync)), so the arrays are indexed by
//! rank.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One training iteration, as seen by all ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IterRecord {
    pub iter: usize,
    /// Wall-clock start of the iteration on rank 0, seconds since the UNIX epoch.
    pub unix_s: f64,
    pub epoch: usize,
    /// Mean training loss over the global batch (JSON has no NaN: a diverged iteration's loss is
    /// written as `null` and read back as NaN).
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    pub lr: f32,
    /// Samples in the global batch (B, or fewer on an epoch's last iteration).
    pub global_batch: usize,
    /// Per rank: samples processed.
    pub batch_sizes: Vec<usize>,
    /// Per rank: seconds of gather + forward + backward of its slice.
    pub compute_s: Vec<f64>,
    /// Per rank: seconds of the iteration's collective spent waiting for slower ranks. Waiting and
    /// transfer happen inside one collective, so this is inferred: `max_j compute_j − compute_i`,
    /// clamped to `[0, collective seconds]` (see [`SyncTime`](crate::dist::sync::SyncTime)).
    pub wait_s: Vec<f64>,
    /// Per rank: the rest of the collective's seconds (transfer): `wait_s + comm_s` is the measured
    /// duration of the gradient + stats allreduce.
    pub comm_s: Vec<f64>,
    /// Per rank: CPU seconds other processes used on this rank's cores during the iteration.
    pub interference_s: Vec<f64>,
    /// Per rank: this process's CPU time over the iteration's wall time (1.0 = one full core).
    pub cpu_share: Vec<f64>,
    /// Per rank: times the process was descheduled while computing (absent in older files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preemptions: Vec<f64>,
    /// Per rank: seconds its threads waited to run while computing (runnable, not running; absent
    /// in older files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frozen_s: Vec<f64>,
    /// Per rank: the CPU share over the whole previous iteration, compute and collective (absent in
    /// older files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub run_share: Vec<f64>,
    /// Per rank: seconds its balancer's step of the previous iteration took (absent in older
    /// files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub balance_s: Vec<f64>,
    /// Wall seconds of the iteration on rank 0.
    pub iter_s: f64,
    /// `global_batch / iter_s`.
    pub samples_per_s: f64,
}

/// Reads a number that serde_json wrote as `null` because it was NaN or infinite, as NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Evaluation on the test split.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EvalResult {
    pub epoch: usize,
    pub loss: f64,
    pub accuracy: f64,
    pub samples: usize,
}

/// Per-rank straggler statistics of a run.
///
/// "Waiting on rank k" in an iteration where k is the slowest is `t_k − mean of the other ranks'
/// times`: how long the average other rank sat idle at the allreduce because of k.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StragglerReport {
    /// Per rank: mean compute seconds per iteration.
    pub mean_compute_s: Vec<f64>,
    /// Per rank: fraction of iterations in which it was the slowest.
    pub slowest_fraction: Vec<f64>,
    /// Per rank: seconds plain BSP (equal split) would have waited on it in this run, estimated from
    /// each rank's measured seconds per sample in every iteration.
    pub bsp_wait_s: Vec<f64>,
    /// Per rank: seconds this run actually waited on it.
    pub actual_wait_s: Vec<f64>,
}

impl std::fmt::Display for StragglerReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "rank  mean compute   slowest   BSP would wait on it   this run waited on it")?;
        for r in 0..self.mean_compute_s.len() {
            writeln!(
                f,
                "{r:>4}  {:>9.2} ms  {:>6.1} %  {:>18.3} s  {:>21.3} s",
                1e3 * self.mean_compute_s[r],
                100.0 * self.slowest_fraction[r],
                self.bsp_wait_s[r],
                self.actual_wait_s[r]
            )?;
        }
        Ok(())
    }
}

/// The end-of-run summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub recipe: String,
    /// Written as the recipe spells it (`proportional-epoch`).
    pub policy: crate::balance::PolicyKind,
    /// The kernels' instruction-set tier, by its name (`avx2`).
    pub isa: crate::kernels::isa::Isa,
    pub world_size: usize,
    pub threads_per_rank: usize,
    pub iterations: usize,
    pub epochs: usize,
    pub test_accuracy: f64,
    pub test_loss: f64,
    /// Loss of the last iteration.
    pub final_loss: f64,
    /// Mean loss over the last epoch's iterations.
    pub last_epoch_loss: f64,
    pub wall_s: f64,
    /// Training samples per second over the whole run (evaluation excluded).
    pub samples_per_s: f64,
    pub evals: Vec<EvalResult>,
    pub stragglers: StragglerReport,
}

/// A JSONL file written line by line.
pub struct JsonlWriter {
    path: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
    line: Vec<u8>,
}

impl JsonlWriter {
    /// A new file (replacing one of that name), written through a buffer: for files written in one go.
    pub fn create(path: &Path) -> Result<JsonlWriter> {
        let f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        Ok(JsonlWriter::new(path, f, 1 << 16))
    }

    /// A new file written as it goes: every line is one `write` to the file, so `tail -f` sees it
    /// at once and a killed process has lost nothing it wrote (the page cache keeps it).
    pub fn streaming(path: &Path) -> Result<JsonlWriter> {
        let f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        Ok(JsonlWriter::new(path, f, 0))
    }

    /// [`JsonlWriter::streaming`] that continues the per-iteration records of a resumed run: the
    /// records of iterations before `next_iter` stay, later ones (written by the run that stopped
    /// after its checkpoint) and a torn last line go, as the resumed run writes them anew.
    pub fn resume_records(path: &Path, next_iter: usize) -> Result<JsonlWriter> {
        #[derive(Deserialize)]
        struct Head {
            iter: usize,
        }
        let kept: String = match std::fs::read_to_string(path) {
            Ok(text) => text
                .lines()
                .filter(|l| serde_json::from_str::<Head>(l).is_ok_and(|h| h.iter < next_iter))
                .flat_map(|l| [l, "\n"])
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(Error::io(path, e)),
        };
        // Rewritten beside and renamed over: a crash now leaves the old file or the new one.
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&tmp, kept).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
        let f = std::fs::OpenOptions::new().append(true).open(path).map_err(|e| Error::io(path, e))?;
        Ok(JsonlWriter::new(path, f, 0))
    }

    fn new(path: &Path, f: std::fs::File, buffer: usize) -> JsonlWriter {
        JsonlWriter { path: path.to_path_buf(), out: std::io::BufWriter::with_capacity(buffer, f), line: Vec::new() }
    }

    /// Writes `rec` as one line, in one piece (a streaming writer's lines are never torn by a
    /// flush between their halves).
    pub fn write<T: Serialize>(&mut self, rec: &T) -> Result<()> {
        self.line.clear();
        serde_json::to_writer(&mut self.line, rec)
            .map_err(|e| Error::Output { path: self.path.clone(), msg: e.to_string() })?;
        self.line.push(b'\n');
        self.out.write_all(&self.line).map_err(|e| Error::io(&self.path, e))
    }
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(|e| Error::io(&self.path, e))
    }
}

/// Writes `value` as pretty JSON to `path`.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Error::Output { path: path.to_path_buf(), msg: e.to_string() })?;
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}

/// The seconds a record's `run_share` was measured over: each rank's share rides on the record
/// after its iteration, so it is about the record before's `iter_s` (rank 0's wall time; 0 for the
/// first record, which has no share).
pub fn seconds_before(records: &[IterRecord], t: usize) -> f64 {
    t.checked_sub(1).map_or(0.0, |p| records[p].iter_s.max(0.0))
}

/// Reads a JSONL metrics file.
pub fn read_records(path: &Path) -> Result<Vec<IterRecord>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| Error::data(path, format!("line {}: {e}", i + 1))))
        .collect()
}

/// Straggler statistics from a run's records.
pub fn straggler_report(records: &[IterRecord]) -> StragglerReport {
    let mut tally = StragglerTally::default();
    records.iter().for_each(|r| tally.add(r));
    tally.report()
}

/// The sums behind a [`StragglerReport`], added to one record at a time: a run keeps this, not its
/// records, so its memory stays flat however long it runs.
#[derive(Debug, Clone, Default)]
pub struct StragglerTally {
    iterations: usize,
    compute_s: Vec<f64>,
    slowest: Vec<usize>,
    bsp_wait_s: Vec<f64>,
    actual_wait_s: Vec<f64>,
}

impl StragglerTally {
    pub fn add(&mut self, r: &IterRecord) {
        let world = r.batch_sizes.len();
        if self.iterations == 0 {
            *self = StragglerTally {
                iterations: 0,
                compute_s: vec![0.0; world],
                slowest: vec![0; world],
                bsp_wait_s: vec![0.0; world],
                actual_wait_s: vec![0.0; world],
            };
        }
        self.iterations += 1;
        if let Some((k, wait)) = straggler(&r.compute_s) {
            self.slowest[k] += 1;
            self.actual_wait_s[k] += wait;
        }
        // Under an equal split each rank would take B/N · (its seconds per sample).
        let b_eq = r.global_batch as f64 / world as f64;
        let eq: Vec<f64> = r
            .compute_s
            .iter()
            .zip(&r.batch_sizes)
            .map(|(&c, &b)| if b > 0 { c / b as f64 * b_eq } else { 0.0 })
            .collect();
        if let Some((k, wait)) = straggler(&eq) {
            self.bsp_wait_s[k] += wait;
        }
        for (m, c) in self.compute_s.iter_mut().zip(&r.compute_s) {
            *m += c;
        }
    }

    pub fn report(&self) -> StragglerReport {
        let n = self.iterations.max(1) as f64;
        StragglerReport {
            mean_compute_s: self.compute_s.iter().map(|c| c / n).collect(),
            slowest_fraction: self.slowest.iter().map(|&k| k as f64 / n).collect(),
            bsp_wait_s: self.bsp_wait_s.clone(),
            actual_wait_s: self.actual_wait_s.clone(),
        }
    }
}

/// The slowest rank and how long the others wait on it on average.
fn straggler(times: &[f64]) -> Option<(usize, f64)> {
    if times.len() < 2 {
        return None;
    }
    let k = (0..times.len()).max_by(|&a, &b| times[a].total_cmp(&times[b]))?;
    let others = (times.iter().sum::<f64>() - times[k]) / (times.len() - 1) as f64;
    Some((k, times[k] - others))
}

impl IterRecord {
    /// The record of an iteration known only by its split and each rank's compute time (a
    /// simulated or reconstructed one): every rank waits for the slowest, nothing else is timed,
    /// and the loss and learning rate are 0.
    pub fn timed(iter: usize, batch_sizes: Vec<usize>, compute_s: Vec<f64>) -> IterRecord {
        let n = batch_sizes.len();
        let slowest = compute_s.iter().copied().fold(0.0, f64::max);
        let global_batch = batch_sizes.iter().sum();
        IterRecord {
            iter,
            unix_s: 0.0,
            epoch: 0,
            loss: 0.0,
            lr: 0.0,
            global_batch,
            batch_sizes,
            wait_s: compute_s.iter().map(|c| slowest - c).collect(),
            compute_s,
            comm_s: vec![0.0; n],
            interference_s: vec![0.0; n],
            cpu_share: vec![1.0; n],
            preemptions: Vec::new(),
            frozen_s: Vec::new(),
            run_share: Vec::new(),
            balance_s: Vec::new(),
            iter_s: slowest,
            samples_per_s: if slowest > 0.0 { global_batch as f64 / slowest } else { 0.0 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn straggler_report_attributes_waiting() {
        // Rank 1 is 3× slower per sample; this run already gave it a quarter of the batch.
        let r = straggler_report(&[
            IterRecord::timed(0, vec![96, 32], vec![0.097, 0.096]),
            IterRecord::timed(1, vec![96, 32], vec![0.090, 0.100]),
        ]);
        assert_eq!(r.slowest_fraction, vec![0.5, 0.5]);
        assert!((r.actual_wait_s[0] - 0.001).abs() < 1e-12 && (r.actual_wait_s[1] - 0.010).abs() < 1e-12);
        // Equal split (64 each): rank 0 would take 0.097/96·64, rank 1 0.096/32·64 = 0.192, then 0.06 and 0.2.
        let want = (0.192 - 0.097 / 96.0 * 64.0) + (0.2 - 0.06);
        assert!((r.bsp_wait_s[1] - want).abs() < 1e-9 && r.bsp_wait_s[0] == 0.0, "{:?}", r.bsp_wait_s);
    }
}

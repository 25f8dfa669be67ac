//! Machine-readable output: one JSON object per iteration (JSONL) and one summary per run.
//!
//! Rank 0 writes both, from per-rank values that every rank contributes to the small stats
//! collective of each iteration, so the arrays are indexed by rank.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One training iteration, as seen by all ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IterRecord {
    pub iter: usize,
    pub epoch: usize,
    /// Mean training loss over the global batch.
    pub loss: f64,
    pub lr: f32,
    /// Samples in the global batch (B, or fewer on an epoch's last iteration).
    pub global_batch: usize,
    /// Per rank: samples processed.
    pub batch_sizes: Vec<usize>,
    /// Per rank: seconds of gather + forward + backward of its slice.
    pub compute_s: Vec<f64>,
    /// Per rank: seconds spent waiting for slower ranks before the allreduce.
    pub wait_s: Vec<f64>,
    /// Per rank: seconds in the gradient allreduce (transfer).
    pub comm_s: Vec<f64>,
    /// Per rank: CPU seconds other processes used on this rank's cores during the iteration.
    pub interference_s: Vec<f64>,
    /// Per rank: this process's CPU time over the iteration's wall time (1.0 = one full core).
    pub cpu_share: Vec<f64>,
    /// Wall seconds of the iteration on rank 0.
    pub iter_s: f64,
    /// `global_batch / iter_s`.
    pub samples_per_s: f64,
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StragglerReport {
    /// Per rank: mean compute seconds per iteration.
    pub mean_compute_s: Vec<f64>,
    /// Per rank: fraction of iterations in which it was the slowest.
    pub slowest_fraction: Vec<f64>,
    /// Seconds plain BSP (equal split) would have spent waiting on the slowest rank in this run,
    /// estimated from each rank's per-iteration throughput.
    pub bsp_wait_estimate_s: f64,
    /// Seconds this run actually spent waiting (sum over iterations of max − mean compute).
    pub actual_wait_s: f64,
}

/// The end-of-run summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub recipe: String,
    pub policy: String,
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
}

impl JsonlWriter {
    pub fn create(path: &Path) -> Result<JsonlWriter> {
        let f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        Ok(JsonlWriter {
            path: path.to_path_buf(),
            out: std::io::BufWriter::new(f),
        })
    }
    pub fn write<T: Serialize>(&mut self, rec: &T) -> Result<()> {
        let line = serde_json::to_string(rec).map_err(|e| Error::Output {
            path: self.path.clone(),
            msg: e.to_string(),
        })?;
        writeln!(self.out, "{line}").map_err(|e| Error::io(&self.path, e))
    }
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(|e| Error::io(&self.path, e))
    }
}

/// Writes `value` as pretty JSON to `path`.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::Output {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })?;
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
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
    let world = records.first().map_or(0, |r| r.batch_sizes.len());
    let n = records.len().max(1) as f64;
    let mut mean = vec![0.0; world];
    let mut slowest = vec![0.0; world];
    let (mut bsp_wait, mut actual_wait) = (0.0, 0.0);
    for r in records {
        let max = r.compute_s.iter().cloned().fold(0.0, f64::max);
        let avg = r.compute_s.iter().sum::<f64>() / world as f64;
        actual_wait += max - avg;
        if let Some(i) = r.compute_s.iter().position(|&c| c == max) {
            slowest[i] += 1.0 / n;
        }
        // Under an equal split each rank would take b_eq · (its seconds per sample).
        let b_eq = r.global_batch as f64 / world as f64;
        let eq: Vec<f64> = r
            .compute_s
            .iter()
            .zip(&r.batch_sizes)
            .map(|(&c, &b)| if b > 0 { c / b as f64 * b_eq } else { 0.0 })
            .collect();
        let eq_max = eq.iter().cloned().fold(0.0, f64::max);
        bsp_wait += eq_max - eq.iter().sum::<f64>() / world as f64;
        for (m, c) in mean.iter_mut().zip(&r.compute_s) {
            *m += c / n;
        }
    }
    StragglerReport {
        mean_compute_s: mean,
        slowest_fraction: slowest,
        bsp_wait_estimate_s: bsp_wait,
        actual_wait_s: actual_wait,
    }
}

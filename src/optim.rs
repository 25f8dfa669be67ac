//! Optimizers and learning-rate schedules over the flat parameter buffer.
//!
//! Every rank holds the same allreduced gradient and runs the same step, so parameters stay identical
//! everywhere without a second broadcast.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// The recipe's `[optimizer]` section: SGD with optional (Nesterov) momentum and L2 weight decay,
/// with PyTorch's semantics (`dampening = 0`, velocity starts at the first gradient).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    pub kind: OptimizerKind,
    /// Peak learning rate (after warm-up).
    pub lr: f32,
    #[serde(default)]
    pub momentum: f32,
    #[serde(default)]
    pub nesterov: bool,
    #[serde(default)]
    pub weight_decay: f32,
    #[serde(default)]
    pub schedule: Schedule,
    /// Iterations of linear warm-up from `lr / warmup_iters` to `lr`.
    #[serde(default)]
    pub warmup_iters: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerKind {
    Sgd,
}

/// Learning-rate decay after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Schedule {
    #[default]
    Constant,
    /// Multiply by `gamma` every `every_epochs` epochs.
    Step { every_epochs: usize, gamma: f32 },
    /// Half-cosine from `lr` down to `lr · min_factor` at the last iteration.
    Cosine {
        #[serde(default)]
        min_factor: f32,
    },
}

impl OptimizerConfig {
    /// Rejects impossible values, naming the field.
    pub fn validate(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(Error::config("optimizer.lr", format!("must be a positive number, got {}", self.lr)));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(Error::config("optimizer.momentum", format!("must be in [0, 1), got {}", self.momentum)));
        }
        if self.nesterov && self.momentum == 0.0 {
            return Err(Error::config("optimizer.nesterov", "Nesterov momentum needs optimizer.momentum > 0"));
        }
        if self.weight_decay < 0.0 {
            return Err(Error::config("optimizer.weight_decay", "must be ≥ 0"));
        }
        if let Schedule::Step { every_epochs: 0, .. } = self.schedule {
            return Err(Error::config("optimizer.schedule.every_epochs", "must be at least 1"));
        }
        Ok(())
    }

    /// Learning rate at iteration `iter` (0-based) of a run of `total` iterations.
    pub fn lr_at(&self, iter: usize, iters_per_epoch: usize, total: usize) -> f32 {
        if iter < self.warmup_iters {
            return self.lr * (iter + 1) as f32 / self.warmup_iters as f32;
        }
        match self.schedule {
            Schedule::Constant => self.lr,
            Schedule::Step { every_epochs, gamma } => {
                let epoch = iter / iters_per_epoch.max(1);
                self.lr * gamma.powi((epoch / every_epochs) as i32)
            }
            Schedule::Cosine { min_factor } => {
                let span = total.saturating_sub(self.warmup_iters).max(1) as f32;
                let t = ((iter - self.warmup_iters) as f32 / span).min(1.0);
                let f = min_factor + (1.0 - min_factor) * 0.5 * (1.0 + (std::f32::consts::PI * t).cos());
                self.lr * f
            }
        }
    }
}

/// SGD state: one velocity buffer laid out like the parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sgd {
    pub momentum: f32,
    pub nesterov: bool,
    pub weight_decay: f32,
    pub velocity: Vec<f32>,
}

impl Sgd {
    pub fn new(cfg: &OptimizerConfig, n: usize) -> Sgd {
        Sgd {
            momentum: cfg.momentum,
            nesterov: cfg.nesterov,
            weight_decay: cfg.weight_decay,
            velocity: if cfg.momentum > 0.0 { vec![0.0; n] } else { Vec::new() },
        }
    }

    /// One step: `g ← g + wd·θ; v ← μ·v + g; θ ← θ − lr·(nesterov ? g + μ·v : v)`.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) {
        assert_eq!(params.len(), grads.len());
        let (mu, wd) = (self.momentum, self.weight_decay);
        if self.velocity.is_empty() {
            for (p, &g) in params.iter_mut().zip(grads) {
                *p -= lr * (g + wd * *p);
            }
            return;
        }
        let nesterov = self.nesterov;
        for ((p, &g), v) in params.iter_mut().zip(grads).zip(self.velocity.iter_mut()) {
            let g = g + wd * *p;
            *v = mu * *v + g;
            let d = if nesterov { g + mu * *v } else { *v };
            *p -= lr * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(momentum: f32, nesterov: bool, weight_decay: f32) -> OptimizerConfig {
        OptimizerConfig {
            kind: OptimizerKind::Sgd,
            lr: 0.1,
            momentum,
            nesterov,
            weight_decay,
            schedule: Schedule::Constant,
            warmup_iters: 0,
        }
    }

    // Golden values: three steps on p = [1.0, -2.0, 0.5] with gradients g_t = [0.1, 0.2, -0.3] * (t + 1),
    // lr 0.1, produced by this script, which is PyTorch's documented torch.optim.SGD update
    // (dampening 0; buffer initialised to the first gradient, which equals 0.9·0 + g):
    //
    //   import numpy as np
    //   def run(mu, nesterov, wd):
    //       p = np.array([1.0, -2.0, 0.5], np.float32); v = np.zeros(3, np.float32)
    //       for t in range(3):
    //           g = np.array([0.1, 0.2, -0.3], np.float32) * (t + 1) + wd * p
    //           v = mu * v + g
    //           p = p - 0.1 * ((g + mu * v) if nesterov else v)
    //       return p
    //   for a in [(0, False, 0), (0.9, False, 0), (0.9, True, 0), (0.9, True, 0.01)]:
    //       print(a, [f"{x:.7f}" for x in run(*a)])
    //
    // (0, False, 0) ['0.9400001', '-2.1199999', '0.6799999']
    // (0.9, False, 0) ['0.9049000', '-2.1902001', '0.7853000']
    // (0.9, True, 0) ['0.8544100', '-2.2911801', '0.9367700']
    // (0.9, True, 0.01) ['0.8465500', '-2.2747595', '0.9322271']
    fn run(c: &OptimizerConfig) -> Vec<f32> {
        let mut p = vec![1.0f32, -2.0, 0.5];
        let mut opt = Sgd::new(c, 3);
        for t in 0..3 {
            let g: Vec<f32> = [0.1f32, 0.2, -0.3].iter().map(|x| x * (t + 1) as f32).collect();
            opt.step(&mut p, &g, c.lr);
        }
        p
    }

    fn close(a: &[f32], b: &[f32]) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 2e-6, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn sgd_matches_golden_values() {
        close(&run(&cfg(0.0, false, 0.0)), &[0.9400001, -2.1199999, 0.6799999]);
        close(&run(&cfg(0.9, false, 0.0)), &[0.9049, -2.1902001, 0.7853]);
        close(&run(&cfg(0.9, true, 0.0)), &[0.85441, -2.2911801, 0.93677]);
        close(&run(&cfg(0.9, true, 0.01)), &[0.84655, -2.2747595, 0.9322271]);
    }

    #[test]
    fn schedules() {
        let mut c = cfg(0.9, false, 0.0);
        c.lr = 1.0;
        c.warmup_iters = 4;
        assert_eq!(c.lr_at(0, 10, 100), 0.25);
        assert_eq!(c.lr_at(3, 10, 100), 1.0);
        c.schedule = Schedule::Cosine { min_factor: 0.0 };
        assert_eq!(c.lr_at(4, 10, 100), 1.0);
        assert!(c.lr_at(99, 10, 100) < 0.01);
        assert!((c.lr_at(52, 10, 100) - 0.5).abs() < 1e-6);
        c.warmup_iters = 0;
        c.schedule = Schedule::Step { every_epochs: 2, gamma: 0.1 };
        assert_eq!(c.lr_at(19, 10, 100), 1.0);
        assert!((c.lr_at(20, 10, 100) - 0.1).abs() < 1e-7);
    }

    #[test]
    fn impossible_values_name_their_field() {
        let mut c = cfg(1.5, false, 0.0);
        assert!(c.validate().unwrap_err().to_string().contains("optimizer.momentum"));
        c.momentum = 0.0;
        c.nesterov = true;
        assert!(c.validate().unwrap_err().to_string().contains("optimizer.nesterov"));
    }
}

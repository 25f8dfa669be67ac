//! Optimizers, gradient-norm clipping and learning-rate schedules over the flat parameter buffer.
//!
//! Every rank holds the same allreduced gradient and runs the same step, so parameters stay identical
//! everywhere without a second broadcast. The update rules are PyTorch's (`torch.optim.SGD`, `Adam`,
//! `AdamW`, `torch.nn.utils.clip_grad_norm_`), so a recipe's hyperparameters mean what they mean there.

pub use crate::dist::clip::{clip_grad_norm, clip_grad_norm_blocks};
use crate::error::{Error, Result};
use crate::kernels::team;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Parameters per team task in the element-wise optimizer updates.
const CHUNK: usize = 1 << 15;

/// The recipe's `[optimizer]` section.
///
/// `momentum` and `nesterov` belong to SGD; `betas` and `eps` to Adam and AdamW (defaults
/// `[0.9, 0.999]` and `1e-8`). Setting one for an optimizer it does not belong to is an error
/// naming the field. `weight_decay` is L2 added to the gradient for `sgd` and `adam`, and the
/// decoupled `θ ← θ − lr·wd·θ` for `adamw`.
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
    /// Adam's decay rates of the first and second moment estimates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub betas: Option<[f32; 2]>,
    /// Adam's term added to the denominator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<f32>,
    /// Scale the allreduced gradient down to this global L2 norm when it is larger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_grad_norm: Option<f32>,
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
    Adam,
    #[serde(rename = "adamw")]
    AdamW,
}

impl OptimizerKind {
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
        }
    }
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

/// Adam's defaults, as in PyTorch.
pub const DEFAULT_BETAS: [f32; 2] = [0.9, 0.999];
pub const DEFAULT_EPS: f32 = 1e-8;

impl OptimizerConfig {
    /// SGD at a constant learning rate `lr` with `momentum` (0 for plain SGD), nothing else: for a
    /// loop written by hand; adjust the other fields with struct update syntax.
    pub fn sgd(lr: f32, momentum: f32) -> OptimizerConfig {
        OptimizerConfig {
            kind: OptimizerKind::Sgd,
            lr,
            momentum,
            nesterov: false,
            weight_decay: 0.0,
            betas: None,
            eps: None,
            clip_grad_norm: None,
            schedule: Schedule::Constant,
            warmup_iters: 0,
        }
    }

    /// Rejects impossible values and settings of another optimizer, naming the field.
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
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(Error::config("optimizer.weight_decay", format!("must be ≥ 0, got {}", self.weight_decay)));
        }
        if let Some(c) = self.clip_grad_norm {
            if !(c.is_finite() && c > 0.0) {
                return Err(Error::config("optimizer.clip_grad_norm", format!("must be a positive number, got {c}")));
            }
        }
        if let Schedule::Step { every_epochs: 0, .. } = self.schedule {
            return Err(Error::config("optimizer.schedule.every_epochs", "must be at least 1"));
        }
        let kind = self.kind.name();
        match self.kind {
            OptimizerKind::Sgd => {
                let adam_only = [("optimizer.betas", self.betas.is_some()), ("optimizer.eps", self.eps.is_some())];
                if let Some((field, _)) = adam_only.iter().find(|f| f.1) {
                    return Err(Error::config(*field, "applies to kind = \"adam\" or \"adamw\" only, not \"sgd\""));
                }
            }
            OptimizerKind::Adam | OptimizerKind::AdamW => {
                if self.momentum != 0.0 {
                    return Err(Error::config(
                        "optimizer.momentum",
                        format!("applies to kind = \"sgd\" only; {kind}'s moment decay rates are optimizer.betas"),
                    ));
                }
                if self.nesterov {
                    return Err(Error::config(
                        "optimizer.nesterov",
                        format!("applies to kind = \"sgd\" only, not \"{kind}\""),
                    ));
                }
                let [b1, b2] = self.betas();
                if !((0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2)) {
                    return Err(Error::config("optimizer.betas", format!("both must be in [0, 1), got [{b1}, {b2}]")));
                }
                let eps = self.eps();
                if !(eps.is_finite() && eps > 0.0) {
                    return Err(Error::config("optimizer.eps", format!("must be a positive number, got {eps}")));
                }
            }
        }
        Ok(())
    }

    /// `betas`, or Adam's default `[0.9, 0.999]`.
    pub fn betas(&self) -> [f32; 2] {
        self.betas.unwrap_or(DEFAULT_BETAS)
    }

    /// `eps`, or Adam's default `1e-8`.
    pub fn eps(&self) -> f32 {
        self.eps.unwrap_or(DEFAULT_EPS)
    }

    /// Learning rate at iteration `iter` (0-based) of a run of `total` iterations.
    ///
    /// `total` is the planned length (`epochs ×` iterations per epoch), never `train.max_iters`, so
    /// stopping early or resuming does not change the schedule.
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

/// The optimizer a recipe asks for, with its state.
///
/// The state is the step count plus per-parameter buffers laid out like the parameters;
/// [`Optimizer::buffers`] names them as PyTorch does (`momentum_buffer`, `exp_avg`, `exp_avg_sq`),
/// which is how a checkpoint stores them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Optimizer {
    Sgd(Sgd),
    Adam(Adam),
}

/// The scalar part of an optimizer's state (its buffers are stored as tensors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OptimizerState {
    pub kind: OptimizerKind,
    /// Steps taken.
    pub step: u64,
}

impl Optimizer {
    /// A fresh optimizer for `n` parameters (zero buffers, step 0).
    pub fn new(cfg: &OptimizerConfig, n: usize) -> Optimizer {
        match cfg.kind {
            OptimizerKind::Sgd => Optimizer::Sgd(Sgd::new(cfg, n)),
            OptimizerKind::Adam | OptimizerKind::AdamW => Optimizer::Adam(Adam::new(cfg, n)),
        }
    }

    /// One update of `params` from the (allreduced, possibly clipped) `grads`.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) {
        self.step_block(params, grads, lr, 0..params.len());
    }

    /// One update of `params[block]` from `grads[block]`, leaving the other parameters and their
    /// state alone; the step count advances once. A sharded step: each rank updates the block it
    /// owns after a reduce-scatter, and an all-gather shares the result (see `train`). Element-wise,
    /// so the block gets the same bits as in a full step.
    pub fn step_block(&mut self, params: &mut [f32], grads: &[f32], lr: f32, block: Range<usize>) {
        assert_eq!(params.len(), grads.len(), "parameters and gradients");
        match self {
            Optimizer::Sgd(o) => o.step(&mut params[block.clone()], &grads[block.clone()], lr, block),
            Optimizer::Adam(o) => o.step(&mut params[block.clone()], &grads[block.clone()], lr, block),
        }
    }

    pub fn kind(&self) -> OptimizerKind {
        match self {
            Optimizer::Sgd(_) => OptimizerKind::Sgd,
            Optimizer::Adam(a) if a.decoupled => OptimizerKind::AdamW,
            Optimizer::Adam(_) => OptimizerKind::Adam,
        }
    }

    pub fn state(&self) -> OptimizerState {
        let step = match self {
            Optimizer::Sgd(o) => o.step,
            Optimizer::Adam(o) => o.step,
        };
        OptimizerState { kind: self.kind(), step }
    }

    /// Sets the step count (the buffers are restored through [`Optimizer::buffers_mut`]).
    pub fn set_step(&mut self, step: u64) {
        match self {
            Optimizer::Sgd(o) => o.step = step,
            Optimizer::Adam(o) => o.step = step,
        }
    }

    /// The per-parameter buffers, by name, each as long as the parameters (none for plain SGD).
    pub fn buffers(&self) -> Vec<(&'static str, &[f32])> {
        match self {
            Optimizer::Sgd(o) if o.velocity.is_empty() => Vec::new(),
            Optimizer::Sgd(o) => vec![("momentum_buffer", &o.velocity)],
            Optimizer::Adam(o) => vec![("exp_avg", &o.exp_avg), ("exp_avg_sq", &o.exp_avg_sq)],
        }
    }

    pub fn buffers_mut(&mut self) -> Vec<(&'static str, &mut [f32])> {
        match self {
            Optimizer::Sgd(o) if o.velocity.is_empty() => Vec::new(),
            Optimizer::Sgd(o) => vec![("momentum_buffer", &mut o.velocity)],
            Optimizer::Adam(o) => vec![("exp_avg", &mut o.exp_avg), ("exp_avg_sq", &mut o.exp_avg_sq)],
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
    /// Steps taken.
    #[serde(default)]
    pub step: u64,
}

impl Sgd {
    pub fn new(cfg: &OptimizerConfig, n: usize) -> Sgd {
        Sgd {
            momentum: cfg.momentum,
            nesterov: cfg.nesterov,
            weight_decay: cfg.weight_decay,
            velocity: if cfg.momentum > 0.0 { vec![0.0; n] } else { Vec::new() },
            step: 0,
        }
    }

    /// One step of the parameters `params` = block `block` of all:
    /// `g ← g + wd·θ; v ← μ·v + g; θ ← θ − lr·(nesterov ? g + μ·v : v)`.
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32, block: Range<usize>) {
        assert_eq!(params.len(), grads.len());
        self.step += 1;
        let (mu, wd) = (self.momentum, self.weight_decay);
        if self.velocity.is_empty() {
            team::zip_chunks_mut([params], CHUNK, &|i, [ps]| {
                for (p, &g) in ps.iter_mut().zip(&grads[i * CHUNK..]) {
                    *p -= lr * (g + wd * *p);
                }
            });
            return;
        }
        // The Nesterov choice is hoisted out of the loop so that each one vectorises; the chunks
        // are element-wise, so they give the bits of one loop.
        let nesterov = self.nesterov;
        team::zip_chunks_mut([params, &mut self.velocity[block]], CHUNK, &|i, [ps, vs]| {
            let it = ps.iter_mut().zip(&grads[i * CHUNK..]).zip(vs.iter_mut());
            if nesterov {
                for ((p, &g), v) in it {
                    let g = g + wd * *p;
                    *v = mu * *v + g;
                    *p -= lr * (g + mu * *v);
                }
            } else {
                for ((p, &g), v) in it {
                    let g = g + wd * *p;
                    *v = mu * *v + g;
                    *p -= lr * *v;
                }
            }
        });
    }
}

/// Adam and AdamW state: first and second moment estimates laid out like the parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Adam {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// AdamW: weight decay applied to the parameters, not added to the gradient.
    pub decoupled: bool,
    /// Steps taken (`t` of the bias corrections).
    pub step: u64,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

impl Adam {
    pub fn new(cfg: &OptimizerConfig, n: usize) -> Adam {
        let [beta1, beta2] = cfg.betas();
        Adam {
            beta1,
            beta2,
            eps: cfg.eps(),
            weight_decay: cfg.weight_decay,
            decoupled: cfg.kind == OptimizerKind::AdamW,
            step: 0,
            exp_avg: vec![0.0; n],
            exp_avg_sq: vec![0.0; n],
        }
    }

    /// One step, with `t` the step count after increment:
    ///
    /// ```text
    /// AdamW: θ ← θ·(1 − lr·wd)          Adam: g ← g + wd·θ
    /// m ← β₁·m + (1 − β₁)·g             v ← β₂·v + (1 − β₂)·g²
    /// θ ← θ − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)
    /// ```
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32, block: Range<usize>) {
        assert_eq!(params.len(), grads.len());
        assert_eq!(params.len(), block.len());
        self.step += 1;
        let t = self.step as f64;
        let (b1, b2, eps, wd) = (self.beta1, self.beta2, self.eps, self.weight_decay);
        // Scalars in f64 as PyTorch computes them (Python floats), then used in f32.
        let step_size = (lr as f64 / (1.0 - (b1 as f64).powf(t))) as f32;
        let bc2_sqrt = (1.0 - (b2 as f64).powf(t)).sqrt() as f32;
        let (decay, l2) = if self.decoupled { (1.0 - lr * wd, 0.0) } else { (1.0, wd) };
        let moments = [params, &mut self.exp_avg[block.clone()], &mut self.exp_avg_sq[block]];
        team::zip_chunks_mut(moments, CHUNK, &|i, [ps, ms, vs]| {
            for ((p, &g), (m, v)) in ps.iter_mut().zip(&grads[i * CHUNK..]).zip(ms.iter_mut().zip(vs.iter_mut())) {
                *p *= decay;
                let g = g + l2 * *p;
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                *p -= step_size * *m / (v.sqrt() / bc2_sqrt + eps);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(momentum: f32, nesterov: bool, weight_decay: f32) -> OptimizerConfig {
        OptimizerConfig { nesterov, weight_decay, ..OptimizerConfig::sgd(0.1, momentum) }
    }

    fn adam(kind: OptimizerKind, betas: [f32; 2], eps: f32, weight_decay: f32) -> OptimizerConfig {
        OptimizerConfig { kind, betas: Some(betas), eps: Some(eps), ..cfg(0.0, false, weight_decay) }
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
        let mut opt = Optimizer::new(c, 3);
        for t in 0..3 {
            let g: Vec<f32> = [0.1f32, 0.2, -0.3].iter().map(|x| x * (t + 1) as f32).collect();
            opt.step(&mut p, &g, c.lr);
        }
        assert_eq!(opt.state().step, 3);
        p
    }

    fn close(a: &[f32], b: &[f32]) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 2e-6, "{a:?} vs {b:?}");
        }
    }

    #[test]
    // 0.7853 is the script's output, not π/4; the digits are the script's as printed.
    #[allow(clippy::approx_constant, clippy::excessive_precision)]
    fn sgd_matches_golden_values() {
        close(&run(&cfg(0.0, false, 0.0)), &[0.9400001, -2.1199999, 0.6799999]);
        close(&run(&cfg(0.9, false, 0.0)), &[0.9049, -2.1902001, 0.7853]);
        close(&run(&cfg(0.9, true, 0.0)), &[0.85441, -2.2911801, 0.93677]);
        close(&run(&cfg(0.9, true, 0.01)), &[0.84655, -2.2747595, 0.9322271]);
    }

    // Golden values: the same three steps under Adam / AdamW, from this script, which is PyTorch's
    // documented torch.optim.Adam / AdamW update (amsgrad off; AdamW decays θ before the moments):
    //
    //   import numpy as np
    //   def run(b1, b2, eps, wd, decoupled):
    //       p = np.array([1.0, -2.0, 0.5], np.float32)
    //       m = np.zeros(3, np.float32); v = np.zeros(3, np.float32)
    //       lr = 0.1
    //       for t in range(1, 4):
    //           g = np.array([0.1, 0.2, -0.3], np.float32) * t
    //           if decoupled:
    //               p = p * np.float32(1 - lr * wd)
    //           else:
    //               g = g + np.float32(wd) * p
    //           m = np.float32(b1) * m + np.float32(1 - b1) * g
    //           v = np.float32(b2) * v + np.float32(1 - b2) * g * g
    //           bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    //           p = p - np.float32(lr / bc1) * m / (np.sqrt(v) / np.float32(np.sqrt(bc2)) + np.float32(eps))
    //       return p
    //   for a in [(0.9, 0.999, 1e-8, 0.0, False), (0.9, 0.999, 1e-8, 0.1, False),
    //             (0.9, 0.999, 1e-8, 0.1, True), (0.5, 0.9, 0.1, 0.0, False)]:
    //       print(a, [f"{x:.7f}" for x in run(*a)])
    //
    // (0.9, 0.999, 1e-08, 0.0, False) ['0.7076817', '-2.2923183', '0.7923183']
    // (0.9, 0.999, 1e-08, 0.1, False) ['0.7016783', '-2.1574416', '0.7906695']
    // (0.9, 0.999, 1e-08, 0.1, True) ['0.6809359', '-2.2299614', '0.7745126']
    // (0.5, 0.9, 0.1, 0.0, False) ['0.8107263', '-2.2349477', '0.7558911']
    #[test]
    fn adam_matches_golden_values() {
        use OptimizerKind::Adam;
        close(&run(&adam(Adam, [0.9, 0.999], 1e-8, 0.0)), &[0.7076817, -2.2923183, 0.7923183]);
        close(&run(&adam(Adam, [0.9, 0.999], 1e-8, 0.1)), &[0.7016783, -2.1574416, 0.7906695]);
        close(&run(&adam(Adam, [0.5, 0.9], 0.1, 0.0)), &[0.8107263, -2.2349477, 0.7558911]);
    }

    #[test]
    fn adamw_matches_golden_values() {
        close(&run(&adam(OptimizerKind::AdamW, [0.9, 0.999], 1e-8, 0.1)), &[0.6809359, -2.2299614, 0.7745126]);
    }

    #[test]
    fn adam_defaults_are_pytorchs() {
        let mut c = adam(OptimizerKind::Adam, [0.9, 0.999], 1e-8, 0.0);
        let explicit = run(&c);
        (c.betas, c.eps) = (None, None);
        assert_eq!(run(&c), explicit);
    }

    #[test]
    fn blocks_updated_one_by_one_equal_one_full_step() {
        for c in [cfg(0.9, true, 0.01), cfg(0.0, false, 0.0), adam(OptimizerKind::AdamW, [0.9, 0.99], 1e-8, 0.1)] {
            let n = 1000;
            let p0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let (mut full, mut blocks) = (Optimizer::new(&c, n), Optimizer::new(&c, n));
            let (mut pf, mut pb) = (p0.clone(), p0);
            for t in 0..3 {
                let g: Vec<f32> = (0..n).map(|i| ((i + t) as f32 * 0.11).cos()).collect();
                full.step(&mut pf, &g, 0.1);
                // Three "ranks" update their blocks, as after a reduce-scatter; the gather is implicit
                // (one shared buffer). Each block advances the count; one step is one increment.
                for (k, r) in [0..300, 300..301, 301..n].into_iter().enumerate() {
                    let before = blocks.state().step;
                    blocks.step_block(&mut pb, &g, 0.1, r);
                    if k < 2 {
                        blocks.set_step(before);
                    }
                }
                assert!(pf.iter().zip(&pb).all(|(a, b)| a.to_bits() == b.to_bits()), "{:?} step {t}", c.kind);
            }
            assert_eq!(full, blocks);
        }
    }

    #[test]
    fn state_round_trips_through_buffers() {
        let c = adam(OptimizerKind::AdamW, [0.9, 0.999], 1e-8, 0.1);
        let mut a = Optimizer::new(&c, 3);
        let mut p = vec![1.0f32, -2.0, 0.5];
        a.step(&mut p, &[0.1, 0.2, -0.3], 0.1);
        let mut b = Optimizer::new(&c, 3);
        b.set_step(a.state().step);
        for ((na, src), (nb, dst)) in a.buffers().into_iter().zip(b.buffers_mut()) {
            assert_eq!(na, nb);
            dst.copy_from_slice(src);
        }
        assert_eq!(a, b);
        assert_eq!(b.state(), OptimizerState { kind: OptimizerKind::AdamW, step: 1 });
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
        let fails = |c: &OptimizerConfig, field: &str| {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        };
        let mut c = cfg(1.5, false, 0.0);
        fails(&c, "optimizer.momentum");
        c.momentum = 0.0;
        c.nesterov = true;
        fails(&c, "optimizer.nesterov");
        fails(&OptimizerConfig { betas: Some([0.9, 0.99]), ..cfg(0.0, false, 0.0) }, "optimizer.betas");
        fails(&OptimizerConfig { eps: Some(1e-6), ..cfg(0.0, false, 0.0) }, "optimizer.eps");
        fails(&OptimizerConfig { clip_grad_norm: Some(0.0), ..cfg(0.0, false, 0.0) }, "optimizer.clip_grad_norm");
        let a = adam(OptimizerKind::Adam, [0.9, 0.999], 1e-8, 0.0);
        a.validate().unwrap();
        fails(&OptimizerConfig { momentum: 0.9, ..a.clone() }, "optimizer.momentum");
        fails(&OptimizerConfig { betas: Some([0.9, 1.0]), ..a.clone() }, "optimizer.betas");
        fails(&OptimizerConfig { eps: Some(0.0), ..a.clone() }, "optimizer.eps");
        fails(&OptimizerConfig { weight_decay: -1.0, ..a }, "optimizer.weight_decay");
    }

    #[test]
    fn kinds_parse_from_toml() {
        for (text, kind) in
            [("sgd", OptimizerKind::Sgd), ("adam", OptimizerKind::Adam), ("adamw", OptimizerKind::AdamW)]
        {
            let c: OptimizerConfig = toml::from_str(&format!("kind = \"{text}\"\nlr = 0.001")).unwrap();
            assert_eq!(c.kind, kind);
            assert_eq!(Optimizer::new(&c, 1).kind(), kind);
        }
        let c: OptimizerConfig =
            toml::from_str("kind = \"adamw\"\nlr = 0.001\nbetas = [0.8, 0.99]\neps = 1e-6").unwrap();
        assert_eq!((c.betas(), c.eps()), ([0.8, 0.99], 1e-6));
    }
}

//! Momentum SGD taken inside the backward pass (`Model::forward_backward_step`, what one process
//! trains with) gives the same bits as the backward pass followed by the optimizer's step.

mod common;
use common::*;
use lbbsp::fused::SgdStep;
use lbbsp::layers::Mode;
use lbbsp::loss::Loss;
use lbbsp::model::{LayerSpec, ModelSpec};
use lbbsp::optim::{Optimizer, OptimizerConfig, OptimizerKind};
use lbbsp::rng::Rng;
use lbbsp::Model;

fn sgd(weight_decay: f32) -> OptimizerConfig {
    OptimizerConfig { weight_decay, ..OptimizerConfig::sgd(0.05, 0.9) }
}

/// Three steps of both ways from the same start, on batches of `sizes`; parameters and momentum must
/// match bit for bit after each.
fn same_bits(spec: ModelSpec, shape: &[usize], classes: usize, cfg: &OptimizerConfig, sizes: &[usize]) {
    let mut separate = Model::new(&spec, shape, classes, 7).unwrap();
    let mut fused = Model::new(&spec, shape, classes, 7).unwrap();
    let cap = *sizes.iter().max().unwrap();
    separate.set_capacity(cap);
    fused.set_capacity(cap);
    let (mut opt_a, mut opt_b) = (Optimizer::new(cfg, separate.params.len()), Optimizer::new(cfg, fused.params.len()));
    let dim: usize = shape.iter().product();
    let mut rng = Rng::from_keys(&[5]);
    for (it, &b) in sizes.iter().enumerate() {
        let x: Vec<f32> = (0..b * dim).map(|_| rng.uniform(1.0)).collect();
        let y: Vec<u32> = (0..b).map(|i| ((i * 7 + it) % classes) as u32).collect();
        let mode = Mode { train: true, seed: 3, epoch: it as u64 };
        for m in [&mut separate, &mut fused] {
            let (xs, ys, ids) = m.input_mut(b);
            xs.copy_from_slice(&x);
            ys.copy_from_slice(&y);
            ids.iter_mut().enumerate().for_each(|(i, v)| *v = 100 * it + i);
        }
        let scale = 1.0 / b as f32;
        let la = separate.forward_backward(b, scale, mode);
        opt_a.step(&mut separate.params, &separate.grads, cfg.lr);
        let (step, velocity) = SgdStep::for_run(&mut opt_b, 1, None, cfg.lr).expect("SGD with momentum fuses");
        let lb = fused.forward_backward_step(b, scale, mode, velocity, step);
        assert_eq!(la.loss_sum.to_bits(), lb.loss_sum.to_bits(), "step {it}: loss");
        assert!(separate.params == fused.params, "step {it}: parameters differ");
        assert_eq!(opt_a, opt_b, "step {it}: optimizer state (momentum, step count) differs");
    }
}

#[test]
fn mlp_with_and_without_weight_decay_and_a_batch_past_one_depth_block() {
    let spec = ModelSpec {
        layers: vec![
            LayerSpec::Flatten,
            LayerSpec::Linear { out: 40 },
            LayerSpec::Relu,
            LayerSpec::Linear { out: 24 },
            LayerSpec::Tanh,
            LayerSpec::Linear { out: 10 },
        ],
        loss: Loss::SoftmaxCrossEntropy,
    };
    same_bits(spec.clone(), &[1, 7, 9], 10, &sgd(0.0), &[32, 300, 5, 0]);
    same_bits(spec.clone(), &[1, 7, 9], 10, &sgd(5e-4), &[17, 64, 1]);
    same_bits(spec, &[1, 7, 9], 10, &OptimizerConfig { nesterov: true, ..sgd(5e-4) }, &[40, 280]);
}

/// Convolutions, normalisation and residual blocks take the default path (backward, then the
/// step on the layer's slice); dropout's randomness must not be disturbed.
#[test]
fn conv_residual_net_takes_the_default_path_with_the_same_bits() {
    let conv = |out_channels, kernel, padding| LayerSpec::Conv2d { out_channels, kernel, stride: 1, padding };
    let spec = ModelSpec {
        layers: vec![
            conv(4, 3, 1),
            LayerSpec::GroupNorm { groups: 2 },
            LayerSpec::Relu,
            LayerSpec::Residual {
                layers: vec![conv(4, 3, 1), LayerSpec::GroupNorm { groups: 2 }, LayerSpec::Relu, conv(4, 3, 1)],
                shortcut: vec![],
            },
            LayerSpec::MaxPool2d { kernel: 2, stride: None },
            LayerSpec::Dropout { p: 0.25 },
            LayerSpec::Flatten,
            LayerSpec::Linear { out: 5 },
        ],
        loss: Loss::SoftmaxCrossEntropy,
    };
    same_bits(spec, &[2, 8, 8], 5, &sgd(1e-3), &[9, 16, 3]);
}

#[test]
fn only_one_rank_momentum_sgd_without_clipping_fuses() {
    let mut opt = Optimizer::new(&sgd(0.0), 4);
    assert!(SgdStep::for_run(&mut opt, 2, None, 0.1).is_none(), "several ranks sum first");
    assert!(SgdStep::for_run(&mut opt, 1, Some(1.0), 0.1).is_none(), "clipping needs the whole gradient");
    let mut nesterov = Optimizer::new(&OptimizerConfig { nesterov: true, ..sgd(0.0) }, 4);
    assert!(SgdStep::for_run(&mut nesterov, 1, None, 0.1).is_some_and(|(s, _)| s.nesterov));
    let mut plain = Optimizer::new(&OptimizerConfig { momentum: 0.0, ..sgd(0.0) }, 4);
    assert!(SgdStep::for_run(&mut plain, 1, None, 0.1).is_none());
    let mut adam = Optimizer::new(&OptimizerConfig { kind: OptimizerKind::Adam, momentum: 0.0, ..sgd(0.0) }, 4);
    assert!(SgdStep::for_run(&mut adam, 1, None, 0.1).is_none());
    assert_eq!(opt.state().step, 0, "declined: not counted");
    assert!(SgdStep::for_run(&mut opt, 1, None, 0.1).is_some());
    assert_eq!(opt.state().step, 1);
}

/// The training loop end to end on every tier: one process takes the step inside backward; a
/// clipping bound no gradient reaches sends the same run down the separate step. Losses and saved
/// weights must match bit for bit.
#[test]
fn train_loop_with_the_step_in_backward_or_after_it_agrees_bitwise_on_every_tier() {
    for isa in lbbsp::Isa::available() {
        let run = |name: &str, extra: &[&str]| {
            let dir = scratch(&format!("fused-{isa}-{name}"));
            let m = dir.join("m.jsonl");
            let mut args = vec!["--isa", isa.name(), "train", "digits-mlp", "-q", "--set", "train.max_iters=60"];
            args.extend_from_slice(extra);
            args.extend_from_slice(&["--metrics", m.to_str().unwrap(), "--checkpoint-dir", dir.to_str().unwrap()]);
            lbbsp_ok(0, &args);
            let losses: Vec<u64> = lbbsp::metrics::read_records(&m).unwrap().iter().map(|r| r.loss.to_bits()).collect();
            (losses, std::fs::read(dir.join("step-60").join("model.safetensors")).unwrap())
        };
        let in_backward = run("in-backward", &[]);
        let separate = run("separate", &["--set", "optimizer.clip_grad_norm=1e30"]);
        assert_eq!(in_backward.0.len(), 60);
        assert!(in_backward.0 == separate.0, "{isa}: losses differ");
        assert!(in_backward.1 == separate.1, "{isa}: saved weights differ");
    }
}

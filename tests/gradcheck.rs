//! Finite-difference gradient checks: every layer, and whole models through the fused losses, on the
//! kernels' tier `LBBSP_ISA` names (the best one when unset; `scripts/test.sh` runs this file on
//! every tier the CPU has).

mod common;

use lbbsp::data::rng::Rng;
use lbbsp::nn::chain::Chain;
use lbbsp::nn::conv::Conv2d;
use lbbsp::nn::dropout::Dropout;
use lbbsp::nn::layers::{Elementwise, Flatten, Grads, Io, Layer, Linear, Mode, Pass, Relu, Silu, Tanh};
use lbbsp::nn::loss::Loss;
use lbbsp::nn::model::{LayerSpec, Model, ModelSpec};
use lbbsp::nn::norm::GroupNorm;
use lbbsp::nn::pool::{GlobalAvgPool, Pool2d, Reduce};
use lbbsp::nn::residual::Residual;
use ndarray::{Array1, Array2};

const MODE: Mode = Mode { train: true, seed: 0, epoch: 0 };

/// Loss `Σ r ⊙ y(x, p)` in f64 from an f32 forward pass.
fn projected(layer: &mut dyn Layer, p: &Array1<f32>, x: &Array2<f32>, r: &Array2<f32>) -> f64 {
    common::tier();
    let mut y = Array2::zeros(r.dim());
    let ids: Vec<usize> = (0..x.nrows()).collect();
    layer.forward(p.view(), x.view(), y.view_mut(), &Pass { mode: MODE, sample_ids: &ids });
    y.iter().zip(r).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// Checks `∂/∂p` and `∂/∂x` of `layer` at a random point against central differences.
fn check(layer: &mut dyn Layer, in_len: usize, b: usize, keep_away_from_zero: bool) {
    let mut rng = Rng::from_keys(&[42, in_len as u64]);
    let x: Vec<f32> = (0..b * in_len)
        .map(|_| {
            let v = rng.uniform(1.0);
            if keep_away_from_zero && v.abs() < 0.1 {
                v.signum() * 0.1 + v
            } else {
                v
            }
        })
        .collect();
    check_at(layer, &x, b);
}

/// Like [`check`] at the input `x` (`b` rows).
fn check_at(layer: &mut dyn Layer, x: &[f32], b: usize) {
    common::tier();
    let in_len = x.len() / b;
    let mut rng = Rng::from_keys(&[43, in_len as u64]);
    let out_len: usize = layer.out_shape().iter().product();
    let n_params: usize = layer.param_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    let mut p = Array1::zeros(n_params);
    layer.init(p.view_mut(), &mut rng);
    // Move parameters off their initial values (GroupNorm starts at exactly γ = 1, β = 0).
    p.iter_mut().for_each(|v| *v += rng.uniform(0.3));
    let x = Array2::from_shape_vec((b, in_len), x.to_vec()).unwrap();
    let r = Array2::from_shape_fn((b, out_len), |_| rng.uniform(1.0));
    let mut y = Array2::zeros((b, out_len));
    let ids: Vec<usize> = (0..b).collect();
    layer.forward(p.view(), x.view(), y.view_mut(), &Pass { mode: MODE, sample_ids: &ids });
    // Backward overwrites its outputs: start them at NaN.
    let mut g = Array1::from_elem(n_params, f32::NAN);
    let mut dx = Array2::from_elem((b, in_len), f32::NAN);
    let grads = Grads { g: g.view_mut(), dx: Some(dx.view_mut()) };
    layer.backward(p.view(), Io { x: x.view(), y: y.view() }, r.view(), grads);
    let (g, dx) = (g.as_slice().unwrap(), dx.as_slice().unwrap());

    let eps = 1e-2f32;
    let mut worst = 0.0f64;
    for i in 0..n_params {
        let (mut pp, mut pm) = (p.clone(), p.clone());
        pp[i] += eps;
        pm[i] -= eps;
        let fd = (projected(layer, &pp, &x, &r) - projected(layer, &pm, &x, &r)) / (2.0 * eps as f64);
        let err = (fd - g[i] as f64).abs() / (1.0 + fd.abs());
        worst = worst.max(err);
        assert!(err < 2e-3, "{} param {i}: finite difference {fd} vs backward {}", layer.kind(), g[i]);
    }
    for (i, &dxi) in dx.iter().enumerate() {
        let (mut xp, mut xm) = (x.clone(), x.clone());
        xp.as_slice_mut().unwrap()[i] += eps;
        xm.as_slice_mut().unwrap()[i] -= eps;
        let fd = (projected(layer, &p, &xp, &r) - projected(layer, &p, &xm, &r)) / (2.0 * eps as f64);
        let err = (fd - dxi as f64).abs() / (1.0 + fd.abs());
        worst = worst.max(err);
        assert!(err < 2e-3, "{} input {i}: finite difference {fd} vs backward {dxi}", layer.kind());
    }
    eprintln!("{}: worst relative error {worst:.2e}", layer.kind());
}

#[test]
fn checks_run_on_the_tier_asked_for() {
    eprintln!("gradient checks on the {} tier", common::tier());
}

#[test]
fn linear() {
    check(&mut Linear { inp: 7, out: 5 }, 7, 4, false);
}

#[test]
fn relu() {
    check(&mut Elementwise::<Relu>::new(vec![2, 3]), 6, 3, true);
}

#[test]
fn tanh() {
    check(&mut Elementwise::<Tanh>::new(vec![6]), 6, 3, false);
}

#[test]
fn silu() {
    check(&mut Elementwise::<Silu>::new(vec![2, 5]), 10, 3, false);
}

#[test]
fn flatten() {
    check(&mut Flatten { features: 12 }, 12, 2, false);
}

#[test]
fn conv2d_stride_one_padding() {
    check(&mut Conv2d::new([2, 5, 5], 3, 3, 1, 1), 50, 3, false);
}

#[test]
fn conv2d_stride_two_no_padding() {
    check(&mut Conv2d::new([3, 7, 6], 2, 3, 2, 0), 126, 2, false);
}

#[test]
fn conv2d_one_by_one_strided_and_large_kernel() {
    check(&mut Conv2d::new([4, 5, 5], 3, 1, 2, 0), 100, 2, false);
    check(&mut Conv2d::new([1, 4, 4], 2, 5, 1, 2), 16, 2, false);
}

/// Distinct inputs at least 0.05 apart, so a ±1e-2 step never changes which input wins a window.
fn separated(n: usize, key: u64) -> Vec<f32> {
    lbbsp::data::rng::permutation(n, &[key]).into_iter().map(|k| k as f32 * 0.05 - n as f32 * 0.025).collect()
}

#[test]
fn max_pool2d() {
    check_at(&mut Pool2d::new(Reduce::Max, [2, 6, 5], 2, 2), &separated(2 * 60, 1), 2);
    check_at(&mut Pool2d::new(Reduce::Max, [1, 5, 5], 3, 1), &separated(2 * 25, 2), 2);
}

#[test]
fn avg_pool2d() {
    check(&mut Pool2d::new(Reduce::Mean, [2, 6, 5], 2, 2), 60, 2, false);
    check(&mut Pool2d::new(Reduce::Mean, [1, 5, 5], 3, 1), 25, 2, false);
}

#[test]
fn global_avg_pool() {
    check(&mut GlobalAvgPool { input: vec![3, 4, 2] }, 24, 2, false);
}

/// Training mode, with the same `Pass` for every evaluation, so the mask is fixed.
#[test]
fn dropout_with_a_fixed_mask() {
    let mut d = Dropout::new(0.4, vec![3, 2, 2], 5);
    check(&mut d, 12, 3, false);
}

#[test]
fn group_norm() {
    check(&mut GroupNorm::new(2, vec![4, 3, 3]), 36, 3, false);
    check(&mut GroupNorm::new(1, vec![3, 2, 2]), 12, 2, false);
    check(&mut GroupNorm::new(3, vec![3, 5]), 15, 2, false);
}

/// A block with a projection shortcut (strided 1×1 conv + norm) and one with the identity.
#[test]
fn residual_block() {
    let body: Vec<Box<dyn Layer>> = vec![
        Box::new(Conv2d::new([2, 5, 5], 4, 3, 2, 1)),
        Box::new(GroupNorm::new(2, vec![4, 3, 3])),
        Box::new(Elementwise::<Tanh>::new(vec![4, 3, 3])),
        Box::new(Conv2d::new([4, 3, 3], 4, 3, 1, 1)),
    ];
    let shortcut: Vec<Box<dyn Layer>> =
        vec![Box::new(Conv2d::new([2, 5, 5], 4, 1, 2, 0)), Box::new(GroupNorm::new(2, vec![4, 3, 3]))];
    let mut block = Residual::new(Chain::new(&[2, 5, 5], body), Chain::new(&[2, 5, 5], shortcut));
    check(&mut block, 50, 3, false);
    let body: Vec<Box<dyn Layer>> =
        vec![Box::new(Conv2d::new([3, 4, 4], 3, 3, 1, 1)), Box::new(Elementwise::<Tanh>::new(vec![3, 4, 4]))];
    let mut block = Residual::new(Chain::new(&[3, 4, 4], body), Chain::new(&[3, 4, 4], Vec::new()));
    check(&mut block, 48, 2, false);
}

/// The whole model: `grads` from `forward_backward` against finite differences of the mean loss.
fn check_model(spec: ModelSpec, in_shape: &[usize], classes: usize, b: usize) {
    common::tier();
    let mut m = Model::new(&spec, in_shape, classes, 3).unwrap();
    m.set_capacity(b);
    let mut rng = Rng::from_keys(&[9]);
    {
        let (mut x, y, ids) = m.input_mut(b);
        x.iter_mut().for_each(|v| *v = rng.uniform(1.0));
        y.iter_mut().for_each(|v| *v = rng.below(classes) as u32);
        ids.iter_mut().enumerate().for_each(|(i, v)| *v = i);
    }
    let scale = 1.0 / b as f32;
    m.forward_backward(b, scale, MODE);
    let grads = m.grads.clone();
    let eps = 1e-2f32;
    for i in (0..m.params.len()).step_by(7) {
        let orig = m.params[i];
        m.params[i] = orig + eps;
        let lp = m.forward(b, MODE).loss_sum;
        m.params[i] = orig - eps;
        let lm = m.forward(b, MODE).loss_sum;
        m.params[i] = orig;
        let fd = (lp - lm) / (2.0 * eps as f64) / b as f64;
        let err = (fd - grads[i] as f64).abs() / (1e-2 + fd.abs());
        assert!(err < 2e-2, "param {i} ({fd} vs {})", grads[i]);
    }
}

#[test]
fn mlp_with_softmax_cross_entropy() {
    let spec = ModelSpec {
        layers: vec![LayerSpec::Flatten, LayerSpec::Linear { out: 8 }, LayerSpec::Tanh, LayerSpec::Linear { out: 4 }],
        loss: Loss::SoftmaxCrossEntropy,
    };
    check_model(spec, &[1, 3, 3], 4, 5);
}

#[test]
fn logistic_regression() {
    let spec = ModelSpec { layers: vec![LayerSpec::Linear { out: 1 }], loss: Loss::Logistic };
    check_model(spec, &[6], 2, 5);
}

/// conv → group-norm → tanh → max-pool → dropout → conv → tanh → avg-pool → flatten → linear.
/// (Smooth activations: a ±1e-2 step in an early weight moves every later pre-activation, and a
/// relu kink crossed by the step would spoil the difference quotient; relu has its own check.)
#[test]
fn tiny_conv_net() {
    let spec = ModelSpec {
        layers: vec![
            LayerSpec::Conv2d { out_channels: 4, kernel: 3, stride: 1, padding: 1 },
            LayerSpec::GroupNorm { groups: 2 },
            LayerSpec::Tanh,
            LayerSpec::MaxPool2d { kernel: 2, stride: None },
            LayerSpec::Dropout { p: 0.25 },
            LayerSpec::Conv2d { out_channels: 3, kernel: 2, stride: 1, padding: 0 },
            LayerSpec::Tanh,
            LayerSpec::AvgPool2d { kernel: 2, stride: Some(1) },
            LayerSpec::Flatten,
            LayerSpec::Linear { out: 3 },
        ],
        loss: Loss::SoftmaxCrossEntropy,
    };
    check_model(spec, &[2, 6, 6], 3, 4);
}

/// stem conv → two residual blocks (identity, then projection) → global average pool → linear.
#[test]
fn tiny_residual_net() {
    let conv = |out_channels, kernel, stride, padding| LayerSpec::Conv2d { out_channels, kernel, stride, padding };
    let spec = ModelSpec {
        layers: vec![
            conv(4, 3, 1, 1),
            LayerSpec::GroupNorm { groups: 2 },
            LayerSpec::Tanh,
            LayerSpec::Residual {
                layers: vec![conv(4, 3, 1, 1), LayerSpec::GroupNorm { groups: 2 }, LayerSpec::Tanh, conv(4, 3, 1, 1)],
                shortcut: vec![],
            },
            LayerSpec::Tanh,
            LayerSpec::Residual {
                layers: vec![conv(6, 3, 2, 1), LayerSpec::GroupNorm { groups: 3 }, LayerSpec::Tanh, conv(6, 3, 1, 1)],
                shortcut: vec![conv(6, 1, 2, 0)],
            },
            LayerSpec::Silu,
            LayerSpec::Dropout { p: 0.2 },
            LayerSpec::GlobalAvgPool,
            LayerSpec::Linear { out: 3 },
        ],
        loss: Loss::SoftmaxCrossEntropy,
    };
    check_model(spec, &[1, 6, 6], 3, 3);
}

//! Finite-difference gradient checks: every layer, and whole models through the fused losses.

use lbbsp::layers::{Flatten, Io, Layer, Linear, Mode, Pass, Relu, Tanh};
use lbbsp::loss::Loss;
use lbbsp::model::{LayerSpec, Model, ModelSpec};
use lbbsp::rng::Rng;

const MODE: Mode = Mode {
    train: true,
    seed: 0,
    epoch: 0,
};

/// Loss `Σ r ⊙ y(x, p)` in f64 from an f32 forward pass.
fn projected(layer: &mut dyn Layer, p: &[f32], x: &[f32], r: &[f32], b: usize) -> f64 {
    let mut y = vec![0.0; r.len()];
    let ids: Vec<usize> = (0..b).collect();
    let pass = Pass { mode: MODE, sample_ids: &ids };
    layer.forward(p, x, &mut y, b, &pass);
    y.iter().zip(r).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// Checks `∂/∂p` and `∂/∂x` of `layer` at a random point against central differences.
fn check(layer: &mut dyn Layer, in_len: usize, b: usize, keep_away_from_zero: bool) {
    let mut rng = Rng::from_keys(&[42, in_len as u64]);
    let out_len: usize = layer.out_shape().iter().product();
    let n_params: usize = layer.param_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    let mut p = vec![0.0; n_params];
    layer.init(&mut p, &mut rng);
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
    let r: Vec<f32> = (0..b * out_len).map(|_| rng.uniform(1.0)).collect();
    let mut y = vec![0.0; b * out_len];
    let ids: Vec<usize> = (0..b).collect();
    layer.forward(&p, &x, &mut y, b, &Pass { mode: MODE, sample_ids: &ids });
    let mut g = vec![0.0; n_params];
    let mut dx = vec![0.0; b * in_len];
    layer.backward(&p, &mut g, Io { x: &x, y: &y, b }, &r, Some(&mut dx));

    let eps = 1e-2f32;
    let mut worst = 0.0f64;
    for i in 0..n_params {
        let (mut pp, mut pm) = (p.clone(), p.clone());
        pp[i] += eps;
        pm[i] -= eps;
        let fd = (projected(layer, &pp, &x, &r, b) - projected(layer, &pm, &x, &r, b)) / (2.0 * eps as f64);
        let err = (fd - g[i] as f64).abs() / (1.0 + fd.abs());
        worst = worst.max(err);
        assert!(err < 2e-3, "{} param {i}: finite difference {fd} vs backward {}", layer.kind(), g[i]);
    }
    for i in 0..x.len() {
        let (mut xp, mut xm) = (x.clone(), x.clone());
        xp[i] += eps;
        xm[i] -= eps;
        let fd = (projected(layer, &p, &xp, &r, b) - projected(layer, &p, &xm, &r, b)) / (2.0 * eps as f64);
        let err = (fd - dx[i] as f64).abs() / (1.0 + fd.abs());
        worst = worst.max(err);
        assert!(err < 2e-3, "{} input {i}: finite difference {fd} vs backward {}", layer.kind(), dx[i]);
    }
    eprintln!("{}: worst relative error {worst:.2e}", layer.kind());
}

#[test]
fn linear() {
    check(&mut Linear { inp: 7, out: 5 }, 7, 4, false);
}

#[test]
fn relu() {
    check(&mut Relu { shape: vec![2, 3] }, 6, 3, true);
}

#[test]
fn tanh() {
    check(&mut Tanh { shape: vec![6] }, 6, 3, false);
}

#[test]
fn flatten() {
    check(&mut Flatten { features: 12 }, 12, 2, false);
}

/// The whole model: `grads` from `forward_backward` against finite differences of the mean loss.
fn check_model(spec: ModelSpec, in_shape: &[usize], classes: usize, b: usize) {
    let mut m = Model::new(&spec, in_shape, classes, 3).unwrap();
    m.set_capacity(b);
    let mut rng = Rng::from_keys(&[9]);
    {
        let (x, y, ids) = m.input_mut(b);
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
        layers: vec![
            LayerSpec::Flatten,
            LayerSpec::Linear { out: 8 },
            LayerSpec::Tanh,
            LayerSpec::Linear { out: 4 },
        ],
        loss: Loss::SoftmaxCrossEntropy,
    };
    check_model(spec, &[1, 3, 3], 4, 5);
}

#[test]
fn logistic_regression() {
    let spec = ModelSpec {
        layers: vec![LayerSpec::Linear { out: 1 }],
        loss: Loss::Logistic,
    };
    check_model(spec, &[6], 2, 5);
}

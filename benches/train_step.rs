//! One training step (forward + backward + SGD) of the reference models, in samples/s.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use lbbsp::layers::Mode;
use lbbsp::model::Model;
use lbbsp::optim::Sgd;
use lbbsp::recipe::resolve;
use lbbsp::rng::Rng;
use std::hint::black_box;

/// A model of `recipe` with a random MNIST-shaped batch of `b` loaded, and its optimizer.
fn setup(recipe: &str, shape: &[usize], classes: usize, b: usize) -> (Model, Sgd, f32) {
    let r = resolve(recipe, &[]).expect("shipped recipe");
    let mut m = Model::new(&r.model, shape, classes, 1).expect("model");
    m.set_capacity(b);
    let mut rng = Rng::from_keys(&[1]);
    let (x, y, ids) = m.input_mut(b);
    x.iter_mut().for_each(|v| *v = rng.uniform(1.0));
    y.iter_mut().for_each(|v| *v = rng.below(classes) as u32);
    ids.iter_mut().enumerate().for_each(|(i, v)| *v = i);
    let opt = Sgd::new(&r.optimizer, m.params.len());
    (m, opt, r.optimizer.lr)
}

fn train_step(c: &mut Criterion) {
    let mode = Mode { train: true, seed: 1, epoch: 0 };
    let mut g = c.benchmark_group("train_step");
    for &b in &[128usize] {
        let (mut m, mut opt, lr) = setup("mnist-mlp", &[1, 28, 28], 10, b);
        let mut grads = vec![0.0; m.params.len()];
        g.throughput(Throughput::Elements(b as u64));
        g.bench_with_input(BenchmarkId::new("mnist-mlp", b), &b, |bench, &b| {
            bench.iter(|| {
                let st = m.forward_backward(b, 1.0 / b as f32, mode);
                grads.copy_from_slice(&m.grads);
                opt.step(&mut m.params, &grads, lr);
                black_box(st.loss_sum)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, train_step);
criterion_main!(benches);

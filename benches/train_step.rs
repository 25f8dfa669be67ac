//! One training step (forward + backward + SGD) of the two peer workloads, in samples/s:
//! W1 is the `mnist-mlp` recipe at batch 128; W2 is the peers' LeNet-5 (no padding, plain SGD with
//! momentum, see `/work/shared/peers/README.md`) at batch 64.

/// The binary's allocator, so that operands sit as they do in a training run.
#[global_allocator]
static ALLOC: lbbsp::CacheAligned = lbbsp::CacheAligned;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use lbbsp::data::rng::Rng;
use lbbsp::nn::layers::Mode;
use lbbsp::nn::model::{Model, ModelSpec};
use lbbsp::train::optim::{Optimizer, OptimizerConfig};
use lbbsp::train::recipe::resolve;
use std::hint::black_box;

/// W2 exactly as the peers build it: unpadded LeNet-5, SGD lr 0.05 momentum 0.9.
const W2_MODEL: &str = r#"
loss = "softmax-cross-entropy"
layers = [
    { type = "conv2d", out_channels = 6, kernel = 5 },
    { type = "relu" },
    { type = "max-pool2d", kernel = 2 },
    { type = "conv2d", out_channels = 16, kernel = 5 },
    { type = "relu" },
    { type = "max-pool2d", kernel = 2 },
    { type = "flatten" },
    { type = "linear", out = 120 },
    { type = "relu" },
    { type = "linear", out = 84 },
    { type = "relu" },
    { type = "linear", out = 10 },
]"#;
const W2_OPTIMIZER: &str = r#"kind = "sgd"
lr = 0.05
momentum = 0.9"#;

/// A model of `spec` with a random MNIST-shaped batch of `b` loaded, and its optimizer.
fn setup(spec: &ModelSpec, opt: &OptimizerConfig, b: usize) -> (Model, Optimizer, f32) {
    let classes = 10;
    let mut m = Model::new(spec, &[1, 28, 28], classes, 1).expect("model");
    m.set_capacity(b);
    let mut rng = Rng::from_keys(&[1]);
    let (mut x, y, ids) = m.input_mut(b);
    x.iter_mut().for_each(|v| *v = rng.uniform(1.0));
    y.iter_mut().for_each(|v| *v = rng.below(classes) as u32);
    ids.iter_mut().enumerate().for_each(|(i, v)| *v = i);
    let sgd = Optimizer::new(opt, m.params.len());
    (m, sgd, opt.lr)
}

fn train_step(c: &mut Criterion) {
    let mode = Mode { train: true, seed: 1, epoch: 0 };
    let mlp = resolve("mnist-mlp", &[]).expect("shipped recipe");
    let lenet: ModelSpec = toml::from_str(W2_MODEL).expect("W2 model");
    let sgd: OptimizerConfig = toml::from_str(W2_OPTIMIZER).expect("W2 optimizer");
    let workloads = [("w1-mnist-mlp", &mlp.model, &mlp.optimizer, 128), ("w2-lenet5", &lenet, &sgd, 64)];
    let mut g = c.benchmark_group("train_step");
    for (name, spec, opt, b) in workloads {
        let (mut m, mut opt, lr) = setup(spec, opt, b);
        g.throughput(Throughput::Elements(b as u64));
        g.bench_with_input(BenchmarkId::new(name, b), &b, |bench, &b| {
            bench.iter(|| {
                let st = m.forward_backward(b, 1.0 / b as f32, mode);
                opt.step(&mut m.params, &m.grads, lr);
                black_box(st.loss_sum)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, train_step);
criterion_main!(benches);

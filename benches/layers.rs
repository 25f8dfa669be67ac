//! Forward + backward of each layer at the shapes of W2 (the peers' unpadded LeNet-5 on 28×28
//! MNIST, batch 64), W1's two large linear layers, the other element-wise layers, and the
//! GroupNorm/residual shapes of `fashion-resnet`, in samples/s. Every case computes the input
//! gradient except the first layers of W1 and W2 ("no dx"), for which the model never asks for it.

/// The binary's allocator, so that operands sit as they do in a training run.
#[global_allocator]
static ALLOC: lbbsp::CacheAligned = lbbsp::CacheAligned;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use lbbsp::data::rng::Rng;
use lbbsp::nn::chain::Chain;
use lbbsp::nn::conv::Conv2d;
use lbbsp::nn::dropout::Dropout;
use lbbsp::nn::layers::{Elementwise, Grads, Io, Layer, Linear, Mode, Pass, Relu, Silu, Tanh};
use lbbsp::nn::norm::GroupNorm;
use lbbsp::nn::pool::{GlobalAvgPool, Pool2d, Reduce};
use lbbsp::nn::residual::Residual;
use ndarray::{Array1, Array2};
use std::hint::black_box;

const BATCH: usize = 64;

/// Buffers of one layer at batch `BATCH`, with random parameters, input and output gradient.
struct Bench {
    layer: Box<dyn Layer>,
    p: Array1<f32>,
    g: Array1<f32>,
    x: Array2<f32>,
    y: Array2<f32>,
    dy: Array2<f32>,
    /// `None` for a first layer, whose input gradient nobody needs.
    dx: Option<Array2<f32>>,
    ids: Vec<usize>,
}

impl Bench {
    fn new(layer: Box<dyn Layer>, input: &[usize], first: bool) -> Bench {
        let mut rng = Rng::from_keys(&[11]);
        let n_params: usize = layer.param_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        let mut p = Array1::zeros(n_params);
        layer.init(p.view_mut(), &mut rng);
        let (il, ol) = (input.iter().product::<usize>(), layer.out_shape().iter().product::<usize>());
        Bench {
            layer,
            p,
            g: Array1::zeros(n_params),
            x: Array2::from_shape_fn((BATCH, il), |_| rng.uniform(1.0)),
            y: Array2::zeros((BATCH, ol)),
            dy: Array2::from_shape_fn((BATCH, ol), |_| rng.uniform(1.0)),
            dx: (!first).then(|| Array2::zeros((BATCH, il))),
            ids: (0..BATCH).collect(),
        }
    }

    fn step(&mut self) {
        let mode = Mode { train: true, seed: 1, epoch: 0 };
        let pass = Pass { mode, sample_ids: &self.ids };
        self.layer.forward(self.p.view(), self.x.view(), self.y.view_mut(), &pass);
        let io = Io { x: self.x.view(), y: self.y.view() };
        let grads = Grads { g: self.g.view_mut(), dx: self.dx.as_mut().map(|d| d.view_mut()) };
        self.layer.backward(self.p.view(), io, self.dy.view(), grads);
        black_box((&self.g, &self.dx));
    }
}

fn layers(c: &mut Criterion) {
    let conv = |input: [usize; 3], out, k, s, pad| Box::new(Conv2d::new(input, out, k, s, pad)) as Box<dyn Layer>;
    let block = || {
        let body: Vec<Box<dyn Layer>> = vec![
            conv([16, 14, 14], 16, 3, 1, 1),
            Box::new(GroupNorm::new(4, vec![16, 14, 14])),
            Box::new(Elementwise::<Relu>::new(vec![16, 14, 14])),
            conv([16, 14, 14], 16, 3, 1, 1),
            Box::new(GroupNorm::new(4, vec![16, 14, 14])),
        ];
        Box::new(Residual::new(Chain::new(&[16, 14, 14], body), Chain::new(&[16, 14, 14], Vec::new())))
            as Box<dyn Layer>
    };
    let cases: Vec<(&str, Box<dyn Layer>, Vec<usize>)> = vec![
        ("conv1 1x28x28 -> 6 k5 (no dx)", conv([1, 28, 28], 6, 5, 1, 0), vec![1, 28, 28]),
        ("relu 6x24x24", Box::new(Elementwise::<Relu>::new(vec![6, 24, 24])), vec![6, 24, 24]),
        ("max-pool 6x24x24 k2", Box::new(Pool2d::new(Reduce::Max, [6, 24, 24], 2, 2)), vec![6, 24, 24]),
        ("conv2 6x12x12 -> 16 k5", conv([6, 12, 12], 16, 5, 1, 0), vec![6, 12, 12]),
        ("relu 16x8x8", Box::new(Elementwise::<Relu>::new(vec![16, 8, 8])), vec![16, 8, 8]),
        ("max-pool 16x8x8 k2", Box::new(Pool2d::new(Reduce::Max, [16, 8, 8], 2, 2)), vec![16, 8, 8]),
        ("linear 256 -> 120", Box::new(Linear { inp: 256, out: 120 }), vec![256]),
        ("conv 1x28x28 -> 6 k5 p2", conv([1, 28, 28], 6, 5, 1, 2), vec![1, 28, 28]),
        ("avg-pool 16x10x10 k2", Box::new(Pool2d::new(Reduce::Mean, [16, 10, 10], 2, 2)), vec![16, 10, 10]),
        ("linear 784 -> 512 (W1 fc1, no dx)", Box::new(Linear { inp: 784, out: 512 }), vec![784]),
        ("linear 512 -> 256 (W1 fc2)", Box::new(Linear { inp: 512, out: 256 }), vec![512]),
        ("tanh 512", Box::new(Elementwise::<Tanh>::new(vec![512])), vec![512]),
        ("silu 16x14x14", Box::new(Elementwise::<Silu>::new(vec![16, 14, 14])), vec![16, 14, 14]),
        ("dropout 0.5 x 400", Box::new(Dropout::new(0.5, vec![400], 3)), vec![400]),
        ("global-avg-pool 16x10x10", Box::new(GlobalAvgPool { input: vec![16, 10, 10] }), vec![16, 10, 10]),
        ("group-norm 16x14x14 g4", Box::new(GroupNorm::new(4, vec![16, 14, 14])), vec![16, 14, 14]),
        ("residual 16x14x14 (2 conv3x3 + 2 gn)", block(), vec![16, 14, 14]),
    ];
    let mut g = c.benchmark_group("layer_forward_backward");
    g.throughput(Throughput::Elements(BATCH as u64));
    for (name, layer, input) in cases {
        let mut b = Bench::new(layer, &input, name.ends_with("(no dx)"));
        g.bench_function(BenchmarkId::new(name, BATCH), |bench| bench.iter(|| b.step()));
    }
    g.finish();
}

criterion_group!(benches, layers);
criterion_main!(benches);

//! GEMM throughput (GFLOP/s) of `lbbsp::kernels::gemm` on every tier this CPU can run (the benchmark id
//! names it), on 2048³ and on the layer shapes of W1 (MLP 784-512-256-10, batch 128): forward
//! `x·Wᵀ`, weight gradient `dyᵀ·x`, input gradient `dy·W`. The comparison with OpenBLAS is
//! `scripts/bench_peers.sh` (numpy on the same shapes, in the same run).

/// The binary's allocator, so that operands sit as they do in a training run.
#[global_allocator]
static ALLOC: lbbsp::CacheAligned = lbbsp::CacheAligned;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use lbbsp::kernels::gemm::{gemm_on, Trans};
use lbbsp::Isa;
use std::hint::black_box;

struct Case {
    name: &'static str,
    ta: Trans,
    tb: Trans,
    m: usize,
    n: usize,
    k: usize,
}

fn cases() -> Vec<Case> {
    vec![
        Case { name: "square-2048", ta: Trans::N, tb: Trans::N, m: 2048, n: 2048, k: 2048 },
        Case { name: "fwd-128x784x512", ta: Trans::N, tb: Trans::T, m: 128, n: 512, k: 784 },
        Case { name: "dw-512x784x128", ta: Trans::T, tb: Trans::N, m: 512, n: 784, k: 128 },
        Case { name: "dx-128x512x784", ta: Trans::N, tb: Trans::N, m: 128, n: 784, k: 512 },
    ]
}

fn bench(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("gemm");
    g.sample_size(10);
    for c in cases() {
        let a = vec![0.5f32; c.m * c.k];
        let b = vec![0.25f32; c.k * c.n];
        let mut out = vec![0.0f32; c.m * c.n];
        g.throughput(Throughput::Elements((2 * c.m * c.n * c.k) as u64));
        for isa in Isa::available() {
            g.bench_function(BenchmarkId::new(format!("lbbsp-{isa}"), c.name), |bn| {
                bn.iter(|| {
                    gemm_on(isa, (c.ta, c.tb), (c.m, c.n, c.k), 1.0, black_box(&a), black_box(&b), 0.0, &mut out)
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! One balancing step (every rank's model updated, the candidate splits drawn and judged) at 2, 8, 64,
//! 1,024 and 10,000 ranks.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use lbbsp::balance::{BalanceConfig, Balancer, Observation, Policy, PolicyKind};
use lbbsp::data::rng::Rng;
use std::hint::black_box;

fn balance_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("balance_step");
    for &ranks in &[2usize, 8, 64, 1024, 10_000] {
        let cfg = BalanceConfig { policy: PolicyKind::Lbbsp, ..Default::default() };
        let global = 64 * ranks;
        let mut bal = Balancer::new(&cfg, global, ranks).unwrap();
        let mut rng = Rng::from_keys(&[ranks as u64]);
        let speed: Vec<f64> = (0..ranks).map(|_| 1e-4 * (1.0 + 3.0 * rng.next_f64())).collect();
        // Warm the fits so the step benchmarked is a steady-state one.
        let observe = |bal: &Balancer, rng: &mut Rng| -> Vec<Observation> {
            bal.sizes()
                .iter()
                .zip(&speed)
                .map(|(&b, s)| Observation::new(b, (1e-4 + s * b as f64) * (1.0 + 0.02 * rng.next_f64())))
                .collect()
        };
        for _ in 0..10 {
            let o = observe(&bal, &mut rng);
            bal.observe(&o);
        }
        let obs = observe(&bal, &mut rng);
        g.bench_with_input(BenchmarkId::from_parameter(ranks), &ranks, |b, _| {
            b.iter(|| {
                let mut state = bal.clone();
                state.observe(black_box(&obs));
                black_box(state.sizes()[0])
            })
        });
    }
    g.finish();
}

criterion_group!(benches, balance_step);
criterion_main!(benches);

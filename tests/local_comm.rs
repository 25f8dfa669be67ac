//! The in-process backend: three ranks as threads (`comm::Local`) follow the one-rank loss
//! trajectory, balanced or not. A fast check of the same code paths the mpirun tier runs.

mod common;
use lbbsp::dist::comm::{Local, Solo};
use lbbsp::{RunOptions, Slowdown};
use std::sync::Arc;

fn losses(path: &std::path::Path) -> Vec<f64> {
    lbbsp::train::metrics::read_records(path).unwrap().iter().map(|r| r.loss).collect()
}

#[test]
fn three_thread_ranks_match_one_rank() {
    // One thread per rank, as the mpirun tier pins them: the kernels' helper team is one per
    // process, and thread ranks sharing its helpers would wait on each other's preemptions.
    let _ = rayon::ThreadPoolBuilder::new().num_threads(1).build_global();
    let dir = common::scratch("local");
    let recipe =
        lbbsp::train::recipe::resolve("digits-mlp", &["train.max_iters=60".into(), "balance.policy=lbbsp".into()])
            .unwrap();
    let data = Arc::new(lbbsp::data::load::load(&recipe.data, &common::data_dir()).unwrap());
    let solo = dir.join("solo.jsonl");
    let opts = RunOptions { metrics: Some(solo.clone()), ..Default::default() };
    lbbsp::train(&recipe, &data, &Solo, &opts).unwrap();

    let local = dir.join("local.jsonl");
    let handles: Vec<_> = Local::group(3)
        .into_iter()
        .map(|comm| {
            let (recipe, data, local) = (recipe.clone(), data.clone(), local.clone());
            std::thread::spawn(move || {
                let opts = RunOptions { metrics: Some(local), ..Default::default() };
                let mut recipe = recipe;
                recipe.runtime.slowdown = vec![Slowdown { rank: 1, factor: 4.0, from_iter: 10, every: 1 }];
                lbbsp::train(&recipe, &data, &comm, &opts).map(|s| s.test_accuracy)
            })
        })
        .collect();
    let acc: Vec<f64> = handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
    assert!(acc.windows(2).all(|w| w[0] == w[1]), "every rank reports the same evaluation: {acc:?}");
    let records = lbbsp::train::metrics::read_records(&local).unwrap();
    let late = &records[40..];
    let mean1 = late.iter().map(|r| r.batch_sizes[1]).sum::<usize>() as f64 / late.len() as f64;
    assert!(mean1 < 64.0 / 3.0 * 0.8, "the slowed thread rank should carry less than a third: {mean1}");
    let (a, b) = (losses(&solo), losses(&local));
    assert_eq!(a.len(), 60);
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs() / x.abs()).fold(0.0, f64::max);
    assert!(worst <= 1e-4, "3 thread ranks differ from 1 rank by {worst:.2e} relative");
}

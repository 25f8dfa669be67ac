//! Memory: a steady-state training step allocates nothing, and the bytes a run
//! must hold are measured, not guessed.
//!
//! A counting global allocator counts the allocations made on the test's thread and on rayon's
//! workers, so the harness's own threads do not disturb the count. (The GEMM's team helpers,
//! `lbbsp::kernels::team`, are not counted: they size their packing buffers once when they start and run
//! only GEMM blocks, the same code the counted threads run.) A
//! step is the library's part of an iteration of [`lbbsp::train::train`]: gather a batch into the
//! model's input buffers, `forward_backward`, the gradient allreduce (`Solo`) and the optimizer step.
//! `LBBSP_ALLOC_THREADS` sets the pool size (default 2), to compare one worker with two;
//! `LBBSP_ISA` the kernels' tier (`scripts/test.sh` runs this file on every tier the CPU has).
//!
//! Called from outside the pool, as the trainer's main thread calls them, every parallel loop is a
//! job pushed on rayon's global injector queue (crossbeam's `Injector`), which allocates one block
//! per 63 jobs pushed. That is rayon's, not lbbsp's, so the steps are counted twice: inside the pool
//! (`install`), where lbbsp's code must allocate nothing at all, and from outside it, where every
//! allocation must be an injector block (recognised by its backtrace).

mod common;

use common::images;
use lbbsp::dist::comm::Solo;
use lbbsp::dist::sync::{GradSync, RankStats};
use lbbsp::nn::layers::Mode;
use lbbsp::{Model, Optimizer};
use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, Once};

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);
/// Allocations whose backtrace shows rayon's injector queue, while [`TRACE`] is on.
static INJECTOR: AtomicUsize = AtomicUsize::new(0);
/// While on, every counted allocation's backtrace is taken and classified.
static TRACE: AtomicBool = AtomicBool::new(false);
/// The first backtraces of allocations that are not the injector's, for the failure message.
static OTHERS: Mutex<Vec<String>> = Mutex::new(Vec::new());

thread_local! {
    /// Set on the threads whose allocations count: the test thread and the rayon workers.
    static COUNTED: Cell<bool> = const { Cell::new(false) };
    /// Set while this thread takes a backtrace (whose own allocations do not count).
    static TRACING: Cell<bool> = const { Cell::new(false) };
}

fn count() {
    let on = COUNTED.try_with(Cell::get).unwrap_or(false) && !TRACING.try_with(Cell::get).unwrap_or(true);
    if !on {
        return;
    }
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    if TRACE.load(Ordering::Relaxed) {
        TRACING.with(|t| t.set(true));
        let bt = std::backtrace::Backtrace::force_capture().to_string();
        if bt.contains("Injector<T>::push") && bt.contains("Registry::inject") {
            INJECTOR.fetch_add(1, Ordering::Relaxed);
        } else {
            let mut others = OTHERS.lock().unwrap_or_else(|e| e.into_inner());
            others.push(bt);
            if others.len() == 3 {
                // Enough to show where; the counts still tell the rest.
                TRACE.store(false, Ordering::Relaxed);
            }
        }
        TRACING.with(|t| t.set(false));
    }
}

// SAFETY: every call is forwarded unchanged to the binary's allocator (lbbsp::CacheAligned);
// counting does not touch the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        lbbsp::CacheAligned.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        lbbsp::CacheAligned.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        lbbsp::CacheAligned.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        lbbsp::CacheAligned.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// One test at a time: the counters are global, and the heap measurement of the footprint test sees
/// every thread.
static SERIAL: Mutex<()> = Mutex::new(());

fn threads() -> usize {
    std::env::var("LBBSP_ALLOC_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2)
}

/// The global pool (used by calls from outside any pool), its workers counted.
fn start_global_pool() {
    static START: Once = Once::new();
    START.call_once(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads())
            .start_handler(|_| COUNTED.with(|c| c.set(true)))
            .build_global()
            .expect("the global pool is built once");
    });
}

/// Where a step's parallel loops start from.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Caller {
    /// A worker of a pool (`install`): jobs go on the worker's own deque.
    InsidePool,
    /// The test thread, like the trainer's main thread: jobs go through the global injector.
    OutsidePool,
}

/// Counts of what `steps` training steps of `recipe` allocate after `warmup` steps:
/// `(all, injector blocks, first other backtraces)`.
fn step_allocations(recipe: &str, caller: Caller, warmup: usize, steps: usize) -> (usize, usize, Vec<String>) {
    common::tier();
    let recipe = lbbsp::train::recipe::resolve(recipe, &[]).unwrap();
    let b = recipe.train.global_batch;
    let data = images(4 * b);
    let mut model = Model::new(&recipe.model, &lbbsp::data::load::RANDOM_MNIST_SHAPE, 10, 1).unwrap();
    model.set_capacity(256);
    let mut opt = Optimizer::new(&recipe.optimizer, model.params.len());
    let order: Vec<usize> = (0..data.len()).rev().collect();
    let comm = Solo;
    let mut sync = GradSync::new(model.params.len(), 1);
    let mut step = |i: usize| {
        let slice = &order[(i % 4) * b..(i % 4 + 1) * b];
        let (mut x, y, ids) = model.input_mut(b);
        data.gather_into(slice, x.as_slice_mut().expect("the model's input is row-major"), y);
        ids.copy_from_slice(slice);
        let mode = Mode { train: true, seed: 1, epoch: 0 };
        let stats = model.forward_backward(b, 1.0 / b as f32, mode);
        // The training loop's distributed step, as `train` runs it.
        let mine = RankStats { batch: b, compute_s: 1e-3, loss_sum: stats.loss_sum, ..Default::default() };
        let block = sync.reduce_scatter(&comm, &mut model.grads, &mine);
        opt.step_block(&mut model.params, &model.grads, 0.05, block);
        sync.all_gather(&comm, &mut model.params);
        stats.loss_sum
    };
    let mut run = || {
        COUNTED.with(|c| c.set(true));
        for i in 0..warmup {
            step(i);
        }
        OTHERS.lock().unwrap().clear();
        let (before, injector) = (ALLOCS.load(Ordering::SeqCst), INJECTOR.load(Ordering::SeqCst));
        TRACE.store(true, Ordering::SeqCst);
        let loss: f64 = (warmup..warmup + steps).map(&mut step).sum();
        TRACE.store(false, Ordering::SeqCst);
        let counts = (ALLOCS.load(Ordering::SeqCst) - before, INJECTOR.load(Ordering::SeqCst) - injector);
        COUNTED.with(|c| c.set(false));
        assert!(loss.is_finite() && loss > 0.0, "the steps ran: loss sum {loss}");
        counts
    };
    let (all, injector) = match caller {
        Caller::OutsidePool => {
            start_global_pool();
            run()
        }
        Caller::InsidePool => rayon::ThreadPoolBuilder::new()
            .num_threads(threads())
            .start_handler(|_| COUNTED.with(|c| c.set(true)))
            .build()
            .unwrap()
            .install(run),
    };
    (all, injector, OTHERS.lock().unwrap().drain(..).collect())
}

/// lbbsp's code (layers, GEMM, loss, allreduce, optimizer) allocates nothing in a steady-state step.
#[test]
fn steady_state_steps_allocate_nothing() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for recipe in ["bench-w1", "bench-w2"] {
        let (all, _, others) = step_allocations(recipe, Caller::InsidePool, 3, 20);
        let isa = common::tier();
        eprintln!(
            "{recipe} ({isa} tier): {all} allocations in 20 steps inside a pool of {} \
             thread(s)",
            threads()
        );
        assert!(
            all == 0,
            "{recipe} ({isa} tier): {all} allocations in 20 steady-state steps; the \
             first:\n{}",
            others.join("\n----\n")
        );
    }
}

/// Called as the trainer calls it (from outside the pool), a step allocates nothing but rayon's
/// injector blocks, one per 63 jobs: a few per 20 steps.
#[test]
fn outside_the_pool_only_rayons_injector_allocates() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for recipe in ["bench-w1", "bench-w2"] {
        let (all, injector, others) = step_allocations(recipe, Caller::OutsidePool, 3, 20);
        eprintln!(
            "{recipe}: {all} allocations in 20 steps from outside a pool of {} thread(s), {injector} of them \
             rayon injector blocks",
            threads()
        );
        assert!(
            all == injector,
            "{recipe}: {} allocations besides rayon's injector in 20 steps; the first:\n{}",
            all - injector,
            others.join("\n----\n")
        );
    }
}

/// The counter sees allocations on the counted threads, including the pool's workers, so the zero
/// above means something.
#[test]
fn the_counter_sees_allocations_on_workers() {
    use rayon::prelude::*;
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    start_global_pool();
    COUNTED.with(|c| c.set(true));
    let before = ALLOCS.load(Ordering::SeqCst);
    let lens: usize = (0..64usize).into_par_iter().map(|i| std::hint::black_box(vec![1u8; i + 1]).len()).sum();
    let made = ALLOCS.load(Ordering::SeqCst) - before;
    COUNTED.with(|c| c.set(false));
    assert_eq!(lens, (1..=64).sum::<usize>());
    assert!(made >= 64, "64 vectors allocated, {made} counted");
}

/// Target 6 on a real run: the peak resident set of `lbbsp bench w1` (60,000 samples, 25
/// iterations, evaluation included) stays within 1.25× the bytes it must hold, and the RESULT line
/// the comparison script parses is there.
#[test]
#[cfg(feature = "mpi")]
fn w1_run_peak_rss_is_within_a_quarter_of_what_it_holds() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lbbsp"))
        .args(["bench", "w1", "--iters", "25", "--warmup", "5", "--threads", "2"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let result = text.lines().find(|l| l.starts_with("RESULT peer=lbbsp model=mlp world=1 ")).expect("a RESULT line");
    assert!(result.contains(" batch=128 ") && result.contains(" samples_per_s="), "{result}");
    let memory = text.lines().find(|l| l.starts_with("MEMORY ")).expect("a MEMORY line");
    let field = |k: &str| -> f64 {
        let v = memory.split_whitespace().find_map(|f| f.strip_prefix(k)).unwrap_or_else(|| panic!("{k} in {memory}"));
        v.parse().unwrap()
    };
    let (peak, needed) = (field("peak_rss_mb="), field("needed_mb="));
    assert!(needed > 190.0, "the data set alone is 191.5 MB: {memory}");
    assert!(peak <= 1.25 * needed, "peak RSS {peak} MB is above 1.25 × {needed} MB: {memory}");
}

//! Fuzzing the readers of files that come from outside: IDX images and labels, LIBSVM, CSV, the
//! recipe parser, and a checkpoint's `state.json`, `model.safetensors` and `optimizer.safetensors`.
//!
//! cargo-fuzz needs a nightly toolchain, so this is a plain integration test with its own
//! deterministic mutator. Each target starts from small valid inputs built here (a checkpoint is
//! written by `checkpoint::save` itself) and runs `LBBSP_FUZZ_EXECS` executions (a short default
//! for CI). Execution `i` of a target is a pure function of the target and `i`: seed inputs
//! verbatim, mutated (bit flips, random bytes, insertions, deletions, truncation, splicing,
//! duplicated ranges, interesting integers in header fields and in place of decimal numbers),
//! gzip-wrapped after mutation for the readers that take gzip, or random bytes.
//!
//! Every execution must return (`Ok`, or an error naming the file; a recipe may also name the
//! field at fault) without panicking, within [`SLOW`]; a [`HANG`] aborts the process with the
//! input. A counting global allocator records the largest single allocation request of each
//! execution and aborts, printing the input, on any request above [`ALLOC_LIMIT`]: a header
//! claiming 10^12 items must be refused before anything is allocated for them.
//!
//! Full run (figures in docs/fuzzing.md):
//! `LBBSP_FUZZ_EXECS=10000000 cargo test --release --no-default-features --test fuzz -- --nocapture`.
//! `LBBSP_FUZZ_REPLAY=I cargo test --test fuzz TARGET -- --nocapture` runs execution `I` alone
//! and prints its input and outcome.

use lbbsp::balance::{BalanceConfig, Balancer, Observation, Policy, PolicyKind};
use lbbsp::data::{csv, idx, libsvm};
use lbbsp::nn::params::ParamTable;
use lbbsp::train::checkpoint::{self, Progress, Snapshot};
use lbbsp::train::recipe::{self, Recipe};
use lbbsp::{Error, Optimizer};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The largest single allocation any reader may request for one fuzzed input (at most
/// [`MAX_INPUT`] bytes): far above what such an input needs, far below what a header can claim.
const ALLOC_LIMIT: usize = 256 << 20;
/// Fuzzed inputs are cut to this length.
const MAX_INPUT: usize = 64 << 10;
/// An execution slower than this fails the target.
const SLOW: Duration = Duration::from_secs(1);
/// An execution still running after this is a hang: the watchdog prints the input and aborts.
const HANG: Duration = Duration::from_secs(10);
/// Executions per target when `LBBSP_FUZZ_EXECS` is unset (the CI budget).
const DEFAULT_EXECS: u64 = 20_000;

// ---- The allocator: the largest request of each execution ----

struct Tracking;

thread_local! {
    /// Whether this thread is running an execution (only then are requests recorded).
    static ON: Cell<bool> = const { Cell::new(false) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
    /// The execution running on this thread, for the report of a request over the limit.
    static CURRENT: Cell<(&'static str, u64, *const u8, usize)> =
        const { Cell::new(("", 0, std::ptr::null(), 0)) };
}

fn note(size: usize) {
    if !ON.try_with(Cell::get).unwrap_or(false) {
        return;
    }
    let _ = PEAK.try_with(|p| p.set(p.get().max(size)));
    if size > ALLOC_LIMIT {
        // The report allocates: it must not come back here.
        ON.with(|on| on.set(false));
        let (target, exec, ptr, len) = CURRENT.with(Cell::get);
        // SAFETY: `ptr, len` is the input slice, alive while its execution runs (see `execute`).
        let input = unsafe { std::slice::from_raw_parts(ptr, len) };
        // Straight to the process's stderr: the test harness's capture dies with the process.
        let _ = writeln!(
            std::io::stderr(),
            "fuzz {target}: exec {exec} requested a single allocation of {size} bytes (limit {ALLOC_LIMIT}); \
             input {}",
            hex(input)
        );
        std::process::abort();
    }
}

// SAFETY: every request goes to `System` unchanged; `note` only reads and writes thread-locals.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

/// `bytes` as hex, the first 512 only (the length says how many there are).
fn hex(bytes: &[u8]) -> String {
    let shown: String = bytes.iter().take(512).map(|b| format!("{b:02x}")).collect();
    let more = if bytes.len() > 512 { "..." } else { "" };
    format!("({} bytes, hex): {shown}{more}", bytes.len())
}

// ---- Deterministic randomness ----

/// xorshift64*, seeded through splitmix64.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng((z ^ (z >> 31)) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// The seed of a target's random streams: FNV-1a of its name.
fn name_seed(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

// ---- Mutations ----

const INTERESTING: [u64; 24] = [
    0,
    1,
    2,
    3,
    7,
    8,
    0x7f,
    0x80,
    0xff,
    0x100,
    0xffff,
    0x1_0000,
    2049,
    2051,
    100_000_000,
    100_000_001,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1_000_000_000,
    1_000_000_000_000,
    i64::MAX as u64,
    u64::MAX,
];

const NUMBERS: [&str; 30] = [
    "0",
    "1",
    "-1",
    "2",
    "255",
    "256",
    "65535",
    "2147483647",
    "-2147483648",
    "4294967295",
    "4294967296",
    "1000000000",
    "1000000000000",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999999999",
    "1e12",
    "1e308",
    "1e309",
    "-1e309",
    "1e-400",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "-0",
    "0.5",
    "+1",
    "0x10",
];

const TOKENS: [&[u8]; 28] = [
    b"\n",
    b"\r\n",
    b",",
    b":",
    b" ",
    b"\t",
    b"#",
    b"qid:",
    b"=",
    b"[",
    b"]",
    b"{",
    b"}",
    b"\"",
    b"'",
    b".",
    b"-",
    b"e",
    b"\\",
    b"\0",
    b"\xef\xbb\xbf",
    b"\xc3\xa9",
    b"[[",
    b"]]",
    b"\"\"\"",
    b"true",
    b"null",
    b"\x1f\x8b",
];

/// A binary header field where interesting integers go: offset, width, big-endian.
#[derive(Clone, Copy)]
struct Field(usize, usize, bool);

fn put_int(data: &mut Vec<u8>, Field(at, width, be): Field, value: u64) {
    let bytes = if be { value.to_be_bytes() } else { value.to_le_bytes() };
    let bytes = if be { &bytes[8 - width..] } else { &bytes[..width] };
    if data.len() < at + width {
        data.resize(at + width, 0);
    }
    data[at..at + width].copy_from_slice(bytes);
}

/// A random range `a..b` of `data` of at most `max` bytes.
fn range(rng: &mut Rng, len: usize, max: usize) -> (usize, usize) {
    let a = rng.below(len + 1);
    (a, (a + 1 + rng.below(max)).min(len))
}

/// Replaces one run of decimal digits (with its sign) by an interesting number: the run at or after
/// a random position, wrapping round (no list of runs: inputs are kilobytes, executions millions).
fn replace_number(rng: &mut Rng, data: &mut Vec<u8>) {
    let n = data.len();
    let from = rng.below(n);
    let Some(mut a) = (from..n).chain(0..from).find(|&i| data[i].is_ascii_digit()) else {
        return;
    };
    while a > 0 && data[a - 1].is_ascii_digit() {
        a -= 1;
    }
    let mut b = a;
    while b < n && (data[b].is_ascii_digit() || data[b] == b'.') {
        b += 1;
    }
    if a > 0 && matches!(data[a - 1], b'-' | b'+') {
        a -= 1;
    }
    data.splice(a..b, rng.pick(&NUMBERS).bytes());
}

/// One mutation of `data`; `seeds` are spliced from, `fields` take interesting integers.
fn mutate_once(rng: &mut Rng, data: &mut Vec<u8>, seeds: &[Vec<u8>], fields: &[Field]) {
    let len = data.len();
    match rng.below(12) {
        0 if len > 0 => {
            let i = rng.below(len);
            data[i] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let i = rng.below(len);
            data[i] = rng.next() as u8;
        }
        2 => {
            let n = 1 + rng.below(16);
            let at = rng.below(len + 1);
            data.splice(at..at, rng.bytes(n));
        }
        3 => {
            let (a, b) = range(rng, len, 32);
            data.drain(a..b);
        }
        4 => data.truncate(rng.below(len + 1)),
        5 => {
            // A duplicated range, a few times over: repeated lines, records, tensors.
            let (a, b) = range(rng, len, 256);
            let copy = data[a..b].repeat(1 + rng.below(4));
            let at = rng.below(len + 1);
            data.splice(at..at, copy);
        }
        6 => {
            let other = rng.pick(seeds);
            let (at, from) = (rng.below(len + 1), rng.below(other.len() + 1));
            data.truncate(at);
            data.extend_from_slice(&other[from..]);
        }
        7 | 8 => {
            let field = if fields.is_empty() || rng.below(4) == 0 {
                Field(rng.below(len + 1), *rng.pick(&[1, 2, 4, 8]), rng.below(2) == 0)
            } else {
                *rng.pick(fields)
            };
            let value = if rng.below(4) == 0 { rng.next() } else { *rng.pick(&INTERESTING) };
            put_int(data, field, value);
        }
        9 | 10 => replace_number(rng, data),
        _ => {
            let at = rng.below(len + 1);
            data.splice(at..at, rng.pick(&TOKENS).iter().copied());
        }
    }
}

/// Random bytes, text-like bytes, or gzip-looking bytes.
fn random_input(rng: &mut Rng) -> Vec<u8> {
    let n = rng.below(600);
    match rng.below(3) {
        0 => rng.bytes(n),
        1 => {
            const TEXT: &[u8] = b"0123456789+-.:,# \n\r\teE[]{}=\"'abnq_xyz";
            (0..n).map(|_| *rng.pick(TEXT)).collect()
        }
        _ => {
            let mut v = vec![0x1f, 0x8b, 8, rng.next() as u8];
            v.extend(rng.bytes(n));
            v
        }
    }
}

/// Input number `exec` of `target`.
fn input(target: &Target, exec: u64) -> Vec<u8> {
    let mut rng = Rng::new(name_seed(target.name) ^ exec.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut data = match rng.below(32) {
        0 | 1 => random_input(&mut rng),
        2 => rng.pick(&target.seeds).clone(),
        _ => {
            let mut data = rng.pick(&target.seeds).clone();
            // Mostly a few mutations (a near miss reaches deep), sometimes many.
            let ops = if rng.below(8) == 0 { 1 + rng.below(32) } else { 1 + rng.below(4) };
            for _ in 0..ops {
                mutate_once(&mut rng, &mut data, &target.seeds, &target.fields);
            }
            data
        }
    };
    data.truncate(MAX_INPUT);
    if target.gzip && rng.below(8) == 0 {
        data = gzip(&data);
    }
    data
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).expect("writing to memory");
    enc.finish().expect("writing to memory")
}

// ---- Targets and the harness ----

type Run = Box<dyn Fn(&[u8]) -> lbbsp::Result<()> + Send + Sync>;

struct Target {
    name: &'static str,
    /// Valid inputs: each is accepted as it is.
    seeds: Vec<Vec<u8>>,
    /// Binary header fields of the format.
    fields: Vec<Field>,
    /// Whether the reader takes gzip (then some mutated inputs are compressed after mutating).
    gzip: bool,
    /// Where the input is written before each execution, for the readers that take a path only.
    file: Option<PathBuf>,
    /// The scratch folder of `file`, removed with the target.
    scratch: Option<PathBuf>,
    /// Text every refusal must contain: the path of the file.
    names: String,
    /// Whether a refusal may be a configuration error naming a field instead (recipes).
    config_errors: bool,
    run: Run,
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(d) = &self.scratch {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// What one execution did.
struct Exec {
    outcome: std::result::Result<std::result::Result<(), Error>, String>,
    peak: usize,
    time: Duration,
}

/// The state of a fuzzing run the watchdog sees.
struct Watched {
    exec: AtomicU64,
    /// Nanoseconds since `base` when the running execution started, 0 between executions.
    started: AtomicU64,
    base: Instant,
    input: Mutex<Vec<u8>>,
    done: AtomicBool,
}

fn execute(target: &Target, exec: u64, data: &[u8]) -> Exec {
    if let Some(file) = &target.file {
        std::fs::write(file, data).expect("writing the fuzz input file");
    }
    CURRENT.with(|c| c.set((target.name, exec, data.as_ptr(), data.len())));
    PEAK.with(|p| p.set(0));
    let start = Instant::now();
    ON.with(|on| on.set(true));
    let outcome = catch_unwind(AssertUnwindSafe(|| (target.run)(data)));
    ON.with(|on| on.set(false));
    let time = start.elapsed();
    let outcome = outcome.map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default()
    });
    Exec { outcome, peak: PEAK.with(Cell::get), time }
}

/// Why the outcome of an execution is a failure, if it is one.
fn failure(target: &Target, exec: &Exec) -> Option<String> {
    match &exec.outcome {
        Err(panic) => Some(format!("panicked: {panic}")),
        Ok(_) if exec.time > SLOW => Some(format!("took {:?} (limit {SLOW:?})", exec.time)),
        Ok(Err(Error::Config { .. })) if target.config_errors => None,
        Ok(Err(e)) if !e.to_string().contains(&target.names) => Some(format!("error does not name the file: {e}")),
        Ok(_) => None,
    }
}

#[derive(Default)]
struct Stats {
    execs: u64,
    accepted: u64,
    refused: u64,
    peak: (usize, u64),
    slowest: (Duration, u64),
}

fn watchdog(name: &str, w: &Watched) {
    while !w.done.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
        let started = w.started.load(Ordering::Relaxed);
        if started != 0 && (w.base.elapsed().as_nanos() as u64).saturating_sub(started) > HANG.as_nanos() as u64 {
            let input = w.input.lock().unwrap_or_else(|e| e.into_inner());
            let _ = writeln!(
                std::io::stderr(),
                "fuzz {name}: exec {} still running after {HANG:?} (a hang); input {}",
                w.exec.load(Ordering::Relaxed),
                hex(&input)
            );
            std::process::abort();
        }
    }
}

/// Runs executions `0..execs` of `target`, stopping at the first failure.
fn campaign(target: &Target, execs: u64, w: &Watched) -> std::result::Result<Stats, String> {
    let mut stats = Stats::default();
    for i in 0..execs {
        let data = input(target, i);
        w.input.lock().unwrap_or_else(|e| e.into_inner()).clone_from(&data);
        w.exec.store(i, Ordering::Relaxed);
        w.started.store(w.base.elapsed().as_nanos() as u64 + 1, Ordering::Relaxed);
        let exec = execute(target, i, &data);
        w.started.store(0, Ordering::Relaxed);
        if let Some(why) = failure(target, &exec) {
            return Err(format!(
                "fuzz {}: exec {i} {why}\ninput {}\nreplay: LBBSP_FUZZ_REPLAY={i} cargo test --test fuzz {} -- --nocapture",
                target.name,
                hex(&data),
                target.name.replace('-', "_")
            ));
        }
        stats.execs += 1;
        match exec.outcome {
            Ok(Ok(())) => stats.accepted += 1,
            _ => stats.refused += 1,
        }
        if exec.peak > stats.peak.0 {
            stats.peak = (exec.peak, i);
        }
        if exec.time > stats.slowest.0 {
            stats.slowest = (exec.time, i);
        }
    }
    Ok(stats)
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(v.trim().replace('_', "").parse().unwrap_or_else(|_| panic!("{name}={v}: expected a whole number")))
}

fn size(bytes: usize) -> String {
    match bytes {
        b if b < 1 << 10 => format!("{b} B"),
        b if b < 1 << 20 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{:.1} MiB", b as f64 / (1 << 20) as f64),
    }
}

/// Fuzzes `target` with the budget of `LBBSP_FUZZ_EXECS` (or replays one execution) and prints
/// the figures; panics on the first failing execution.
fn fuzz(target: Target) {
    for (k, seed) in target.seeds.iter().enumerate() {
        let exec = execute(&target, u64::MAX, seed);
        assert!(matches!(exec.outcome, Ok(Ok(()))), "{}: seed {k} is not accepted: {:?}", target.name, exec.outcome);
    }
    if let Some(i) = env_u64("LBBSP_FUZZ_REPLAY") {
        let data = input(&target, i);
        let exec = execute(&target, i, &data);
        println!("fuzz {} exec {i}: input {}\n  outcome {:?}", target.name, hex(&data), exec.outcome);
        if let Some(why) = failure(&target, &exec) {
            panic!("fuzz {}: exec {i} {why}", target.name);
        }
        return;
    }
    let execs = env_u64("LBBSP_FUZZ_EXECS").unwrap_or(DEFAULT_EXECS);
    let w = Watched {
        exec: AtomicU64::new(0),
        started: AtomicU64::new(0),
        base: Instant::now(),
        input: Mutex::new(Vec::new()),
        done: AtomicBool::new(false),
    };
    let start = Instant::now();
    /// Stops the watchdog however the campaign ends (a panic of the harness included).
    struct Done<'a>(&'a AtomicBool);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let result = std::thread::scope(|s| {
        s.spawn(|| watchdog(target.name, &w));
        let _done = Done(&w.done);
        campaign(&target, execs, &w)
    });
    let stats = result.unwrap_or_else(|e| panic!("{e}"));
    let secs = start.elapsed().as_secs_f64();
    println!(
        "fuzz {:<20} {} execs in {secs:.1} s ({:.0}/s); accepted {}, refused {}; largest allocation {} (exec {}); \
         slowest exec {:.2} ms (exec {})",
        target.name,
        stats.execs,
        stats.execs as f64 / secs,
        stats.accepted,
        stats.refused,
        size(stats.peak.0),
        stats.peak.1,
        stats.slowest.0.as_secs_f64() * 1e3,
        stats.slowest.1
    );
    assert_eq!(stats.execs, execs);
}

// ---- Seeds ----

fn idx_file(magic: u32, dims: &[u32], body: &[u8]) -> Vec<u8> {
    let mut v = magic.to_be_bytes().to_vec();
    dims.iter().for_each(|d| v.extend(d.to_be_bytes()));
    v.extend(body);
    v
}

fn images_seeds() -> Vec<Vec<u8>> {
    let px = |n: usize| (0..n).map(|i| (i * 37 % 256) as u8).collect::<Vec<u8>>();
    let small = idx_file(idx::IMAGES_MAGIC, &[3, 4, 5], &px(60));
    let mnist_like = idx_file(idx::IMAGES_MAGIC, &[2, 28, 28], &px(2 * 28 * 28));
    vec![small.clone(), gzip(&small), idx_file(idx::IMAGES_MAGIC, &[1, 1, 1], &[7]), gzip(&mnist_like)]
}

fn labels_seeds() -> Vec<Vec<u8>> {
    let small = idx_file(idx::LABELS_MAGIC, &[3], &[7, 0, 9]);
    vec![small.clone(), gzip(&small), idx_file(idx::LABELS_MAGIC, &[10], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9])]
}

const IDX_FIELDS: [Field; 5] =
    [Field(0, 4, true), Field(4, 4, true), Field(8, 4, true), Field(12, 4, true), Field(4, 8, true)];

const LIBSVM_FEATURES: usize = 8;
const CSV_FEATURES: usize = 4;

fn text_seeds(texts: &[&str]) -> Vec<Vec<u8>> {
    let mut seeds: Vec<Vec<u8>> = texts.iter().map(|t| t.as_bytes().to_vec()).collect();
    seeds.push(gzip(texts[0].as_bytes()));
    seeds
}

fn fuzz_path(name: &str) -> PathBuf {
    PathBuf::from(format!("fuzz-input/{name}"))
}

/// A fresh scratch folder in memory (`/dev/shm` when there is one).
fn scratch(name: &str) -> PathBuf {
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    // Unique per call: tests running at the same time build the same targets.
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let k = CALLS.fetch_add(1, Ordering::Relaxed);
    let d = base.join(format!("lbbsp-fuzz-{}-{name}-{k}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("creating the scratch folder");
    d
}

/// A checkpoint of a small Adam-trained model written by `checkpoint::save` into `root`: its
/// folder, the parameter table and the optimizer's buffer names.
fn checkpoint_fixture(root: &Path) -> (PathBuf, ParamTable, Vec<&'static str>) {
    let sets = ["optimizer.kind=\"adam\"", "optimizer.momentum=0.0", "optimizer.nesterov=false"];
    let recipe = recipe::resolve("digits-mlp", &sets.map(String::from)).expect("the digits recipe");
    let mut table = ParamTable::default();
    table.push("layers.1.weight", &[3, 4]);
    table.push("layers.1.bias", &[3]);
    let params: Vec<f32> = (0..table.len()).map(|i| i as f32 * 0.25 - 1.0).collect();
    let mut opt = Optimizer::new(&recipe.optimizer, table.len());
    let grads: Vec<f32> = (0..table.len()).map(|i| (i as f32).sin()).collect();
    opt.step(&mut params.clone(), &grads, 0.01);
    let cfg = BalanceConfig { policy: PolicyKind::Lbbsp, ..BalanceConfig::default() };
    let mut balancer = Balancer::new(&cfg, 64, 2).expect("a balancer");
    for k in 0..12 {
        let sizes = balancer.sizes().to_vec();
        let obs: Vec<Observation> = sizes
            .iter()
            .enumerate()
            .map(|(r, &b)| Observation::new(b, 0.01 + 1e-4 * b as f64 * (1 + r + k % 3) as f64))
            .collect();
        balancer.observe(&obs);
    }
    let progress = Progress { step: 12, epoch: 1, batch_in_epoch: 2, epoch_loss: (1.5, 2), ..Progress::default() };
    let snap = Snapshot {
        table: &table,
        params: &params,
        optimizer: &opt,
        balancer: &balancer,
        progress: &progress,
        recipe: &recipe,
        world_size: 2,
    };
    let dir = checkpoint::save(root, &snap).expect("writing the checkpoint");
    let names = opt.buffers().iter().map(|b| b.0).collect();
    (dir, table, names)
}

/// The table under which `optimizer.safetensors` reads as one flat buffer: its tensors
/// `<buffer>.<parameter>`, buffer by buffer.
fn optimizer_table(table: &ParamTable, names: &[&str]) -> ParamTable {
    let mut t = ParamTable::default();
    for n in names {
        for e in table.entries() {
            t.push(format!("{n}.{}", e.name), &e.shape);
        }
    }
    t
}

/// A target reading a safetensors file alone in a folder (no `state.json`, so no digest).
fn safetensors_target(name: &'static str, seed: Vec<u8>, table: ParamTable) -> Target {
    let dir = scratch(name);
    let file = dir.join("weights.safetensors");
    let path = file.clone();
    Target {
        name,
        seeds: vec![seed],
        fields: vec![Field(0, 8, false)],
        gzip: false,
        file: Some(file.clone()),
        scratch: Some(dir),
        names: file.display().to_string(),
        config_errors: false,
        run: Box::new(move |_| checkpoint::read_weights(&path, &table).map(drop)),
    }
}

// ---- The targets ----

fn images_target() -> Target {
    idx_target("idx-images", "train-images-idx3-ubyte", images_seeds(), |b, p| idx::parse_images(b, p).map(drop))
}

fn labels_target() -> Target {
    idx_target("idx-labels", "train-labels-idx1-ubyte", labels_seeds(), |b, p| idx::parse_labels(b, p).map(drop))
}

/// An IDX reader's target: `parse` on the input, as the file `file` of the fuzzing folder.
fn idx_target(
    name: &'static str,
    file: &str,
    seeds: Vec<Vec<u8>>,
    parse: fn(&[u8], &Path) -> lbbsp::Result<()>,
) -> Target {
    let path = fuzz_path(file);
    Target {
        name,
        seeds,
        fields: IDX_FIELDS.to_vec(),
        gzip: true,
        file: None,
        scratch: None,
        names: path.display().to_string(),
        config_errors: false,
        run: Box::new(move |b| parse(b, &path)),
    }
}

fn libsvm_labels() -> BTreeMap<String, u32> {
    [("-1".to_string(), 0), ("+1".to_string(), 1)].into()
}

fn libsvm_target() -> Target {
    let path = fuzz_path("a9a.t");
    let labels = libsvm_labels();
    Target {
        name: "libsvm",
        seeds: text_seeds(&[
            "+1 1:1 3:0.5 \n-1 2:2 # comment\n1 qid:4 4:-1\n-1\n\n",
            "-1 3:1 6:1 8:1\n+1 1:0.25 2:-3e-2 5:1e3\n",
            "+1 8:1\r\n",
        ]),
        fields: Vec::new(),
        gzip: true,
        file: None,
        scratch: None,
        names: path.display().to_string(),
        config_errors: false,
        run: Box::new(move |b| libsvm::parse(b, &path, LIBSVM_FEATURES, &labels).map(drop)),
    }
}

fn csv_target() -> Target {
    let path = fuzz_path("digits.csv");
    Target {
        name: "csv",
        seeds: text_seeds(&["0,1.5,2,3,1\n 3 , 4 ,1.0,0,2\r\n\n", "1,2,3,4,0.0\n", "16,0,0,7.5,9\n0,0,0,0,0\n"]),
        fields: Vec::new(),
        gzip: true,
        file: None,
        scratch: None,
        names: path.display().to_string(),
        config_errors: false,
        run: Box::new(move |b| csv::parse(b, &path, CSV_FEATURES).map(drop)),
    }
}

/// A recipe and its overrides: the leading `#set KEY=VALUE` lines (comments to TOML) are `--set`s.
fn parse_recipe(bytes: &[u8], path: &Path) -> lbbsp::Result<()> {
    let text = String::from_utf8_lossy(bytes);
    let sets: Vec<String> = text.lines().map_while(|l| l.strip_prefix("#set ")).map(str::to_string).collect();
    Recipe::parse(&text, path, &sets).map(drop)
}

fn recipe_target() -> Target {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("models/")
        .map(|e| e.expect("models/ entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    let mut seeds: Vec<Vec<u8>> = files.iter().map(|p| std::fs::read(p).expect("a recipe")).collect();
    let digits = std::fs::read_to_string(dir.join("digits-mlp.toml")).expect("models/digits-mlp.toml");
    seeds.push(
        format!("#set train.epochs=7\n#set balance.policy=lbbsp\n#set runtime.slowdown=[\"1:2@3\"]\n{digits}")
            .into_bytes(),
    );
    let path = fuzz_path("recipe.toml");
    Target {
        name: "recipe",
        seeds,
        fields: Vec::new(),
        gzip: false,
        file: None,
        scratch: None,
        names: path.display().to_string(),
        config_errors: true,
        run: Box::new(move |b| parse_recipe(b, &path)),
    }
}

fn state_target() -> Target {
    let root = scratch("state");
    let (dir, table, names) = checkpoint_fixture(&root);
    let file = dir.join(checkpoint::STATE_FILE);
    let seed = std::fs::read(&file).expect("state.json");
    Target {
        name: "checkpoint-state",
        seeds: vec![seed],
        fields: Vec::new(),
        gzip: false,
        file: Some(file),
        scratch: Some(root),
        names: dir.display().to_string(),
        config_errors: false,
        run: Box::new(move |_| checkpoint::load(&dir, &table, &names).map(drop)),
    }
}

fn model_target() -> Target {
    let root = scratch("model-src");
    let (dir, table, _) = checkpoint_fixture(&root);
    let seed = std::fs::read(dir.join(checkpoint::MODEL_FILE)).expect("model.safetensors");
    let _ = std::fs::remove_dir_all(root);
    safetensors_target("checkpoint-model", seed, table)
}

fn optimizer_target() -> Target {
    let root = scratch("optimizer-src");
    let (dir, table, names) = checkpoint_fixture(&root);
    let seed = std::fs::read(dir.join(checkpoint::OPTIMIZER_FILE)).expect("optimizer.safetensors");
    let _ = std::fs::remove_dir_all(root);
    safetensors_target("checkpoint-optimizer", seed, optimizer_table(&table, &names))
}

#[test]
fn idx_images() {
    fuzz(images_target());
}

#[test]
fn idx_labels() {
    fuzz(labels_target());
}

#[test]
fn libsvm() {
    fuzz(libsvm_target());
}

#[test]
fn csv() {
    fuzz(csv_target());
}

#[test]
fn recipe() {
    fuzz(recipe_target());
}

#[test]
fn checkpoint_state() {
    fuzz(state_target());
}

#[test]
fn checkpoint_model() {
    fuzz(model_target());
}

#[test]
fn checkpoint_optimizer() {
    fuzz(optimizer_target());
}

// ---- Explicit huge claims ----

/// `data` with every run of decimal digits from byte `from` on replaced by `with`.
fn every_number(data: &[u8], from: usize, with: &str) -> Vec<u8> {
    let mut out = data[..from].to_vec();
    let mut i = from;
    while i < data.len() {
        if data[i].is_ascii_digit() {
            while i < data.len() && data[i].is_ascii_digit() {
                i += 1;
            }
            out.extend(with.bytes());
        } else {
            out.push(data[i]);
            i += 1;
        }
    }
    out
}

/// A safetensors file: an 8-byte little-endian header length (`claimed`, else the real one), the
/// JSON header, then `body` bytes.
fn safetensors(header: &str, claimed: Option<u64>, body: usize) -> Vec<u8> {
    let mut v = claimed.unwrap_or(header.len() as u64).to_le_bytes().to_vec();
    v.extend(header.bytes());
    v.resize(v.len() + body, 0);
    v
}

fn weights_header(shape: &str, end: &str) -> String {
    format!(
        "{{\"layers.1.bias\":{{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}},\
         \"layers.1.weight\":{{\"dtype\":\"F32\",\"shape\":[{shape}],\"data_offsets\":[12,{end}]}}}}"
    )
}

/// Runs `data` through `target`: it must not panic, must be refused when `refuse`, and must not
/// allocate more than a small multiple of its own size, whatever it claims.
fn claim(target: &Target, what: &str, data: &[u8], refuse: bool) {
    let exec = execute(target, 0, data);
    let bound = (1 << 20) + 4 * data.len();
    assert!(exec.peak <= bound, "{} {what}: allocated {} bytes at once (bound {bound})", target.name, exec.peak);
    if let Some(why) = failure(target, &exec) {
        panic!("{} {what}: {why}", target.name);
    }
    assert!(!(refuse && matches!(exec.outcome, Ok(Ok(())))), "{} {what}: accepted", target.name);
}

#[test]
fn huge_claims_are_refused_before_allocating() {
    let px = [1u8; 60];
    let images = images_target();
    // IDX dimensions are u32: 10^12 items is 10^6 x 10^3 x 10^3; u32::MAX^3 overflows usize.
    for (what, dims) in [("10^12 bytes", [1_000_000, 1_000, 1_000]), ("10^8 bytes", [10_000, 100, 100])] {
        let file = idx_file(idx::IMAGES_MAGIC, &dims, &px);
        claim(&images, what, &file, true);
        claim(&images, &format!("{what}, gzip"), &gzip(&file), true);
    }
    claim(&images, "u32::MAX^3 bytes", &idx_file(idx::IMAGES_MAGIC, &[u32::MAX; 3], &px), true);
    let labels = labels_target();
    let file = idx_file(idx::LABELS_MAGIC, &[u32::MAX], &[1, 2, 3]);
    claim(&labels, "u32::MAX labels", &file, true);
    claim(&labels, "u32::MAX labels, gzip", &gzip(&file), true);

    let libsvm = libsvm_target();
    for line in ["+1 1000000000000:1\n", "+1 18446744073709551616:1\n", "-1 4294967297:0.5\n", "-1 8:1e39\n"] {
        claim(&libsvm, line.trim(), line.as_bytes(), true);
    }
    let csv = csv_target();
    claim(&csv, "label 10^12", b"1,2,3,4,1000000000000\n", true);
    claim(&csv, "10^5 columns", "0,".repeat(100_000).as_bytes(), true);
    claim(&csv, "value 1e39", b"1e39,0,0,0,1\n", true);

    let model = model_target();
    let real = weights_header("3,4", "60");
    for (what, claimed) in [("10^12", 1_000_000_000_000), ("u64::MAX", u64::MAX), ("100 MB + 1", 100_000_001)] {
        claim(&model, &format!("header length {what}"), &safetensors(&real, Some(claimed), 60), true);
    }
    let huge = weights_header("1000000000000,1000000000000", "60");
    claim(&model, "shape 10^12 x 10^12", &safetensors(&huge, None, 60), true);
    let huge = weights_header("1000000,1000000", "4000000000012");
    claim(&model, "shape 10^6 x 10^6, offsets to 4*10^12", &safetensors(&huge, None, 60), true);
    let seed = &model.seeds[0];
    claim(&model, "every number 10^12", &every_number(seed, 8, "1000000000000"), true);

    let state = state_target();
    let seed = state.seeds[0].clone();
    claim(&state, "every number 10^12", &every_number(&seed, 0, "1000000000000"), true);
    claim(&state, "every number 1e400", &every_number(&seed, 0, "1e400"), true);

    let recipe = recipe_target();
    for seed in &recipe.seeds {
        claim(&recipe, "every number 10^12", &every_number(seed, 0, "1000000000000"), false);
    }
}

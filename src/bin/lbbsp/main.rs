//! The `lbbsp` command line: train recipes (standalone or under `mpirun`), evaluate saved weights,
//! manage data sets.

mod bench;

/// Large blocks on cache lines, for the kernels' loads (`lbbsp::kernels::alloc`).
#[global_allocator]
static ALLOC: lbbsp::CacheAligned = lbbsp::CacheAligned;

mod interfere;
mod plot;
mod simulate;

use anyhow::{bail, Context, Result};
use bench::Workload;
use clap::{Parser, Subcommand};
use lbbsp::dist::comm::{AllreduceChoice, Communicator};
use lbbsp::dist::mpi::Mpi;
use lbbsp::dist::watchdog::{exit_on_timeout, Watched};
use lbbsp::train::footprint::Footprint;
use lbbsp::train::metrics::write_json;
use lbbsp::train::recipe::RuntimeConfig;
use lbbsp::train::{Resume, RunOptions, Slowdown};
use std::path::{Path, PathBuf};

/// Data-parallel CPU training over MPI with load-balanced bulk synchronous parallel (LB-BSP).
#[derive(Parser)]
#[command(
    version,
    about,
    after_help = "Environment:
  LBBSP_DATA       where the data sets are (same as --data-dir)
  LBBSP_ALLREDUCE  how ranks sum the gradient (same as --allreduce)
  LBBSP_ISA        the kernels' instruction-set tier (same as --isa)

--isa, --allreduce and --threads override the recipe's [runtime] section; the resolved recipe
written next to a result holds the values the run used."
)]
struct Cli {
    /// Instruction-set tier of the compute kernels: auto (the best this CPU has), avx512, avx2 or
    /// portable. A lower tier than auto picks reproduces or compares another host's kernels
    /// [default: the recipe's runtime.isa, else auto].
    #[arg(long, global = true, env = "LBBSP_ISA", value_parser = parse_isa)]
    isa: Option<lbbsp::IsaChoice>,
    /// How ranks sum the gradient: auto (shm when every rank is on one node, else ring), shm (MPI-3
    /// shared window), ring (MPI_Sendrecv) or mpi (one MPI_Allreduce) [default: the recipe's
    /// runtime.allreduce, else auto].
    #[arg(long, global = true, env = "LBBSP_ALLREDUCE", value_parser = parse_allreduce)]
    allreduce: Option<AllreduceChoice>,
    #[command(subcommand)]
    cmd: Cmd,
}

/// What the command line says of a recipe's `[runtime]` section.
#[derive(Clone, Copy)]
struct RuntimeFlags {
    isa: Option<lbbsp::IsaChoice>,
    allreduce: Option<AllreduceChoice>,
    threads: Option<usize>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train a recipe: one rank standalone, N ranks under `mpirun -n N lbbsp train ...`.
    Train(TrainArgs),
    /// Report the test accuracy of saved weights under a recipe (one rank, or sharded under mpirun).
    Eval(EvalArgs),
    /// Burn CPU on some cores following a load pattern: a co-located job for experiments.
    Interfere(crate::interfere::InterfereArgs),
    /// Plot per-iteration metrics (JSONL) of one or more runs to an SVG.
    Plot(crate::plot::PlotArgs),
    /// Run the balancing policies on a simulated cluster (a scenario of scenarios/, or --suite).
    Simulate(crate::simulate::SimulateArgs),
    /// Time the training loop on a peer workload, or the GEMM; prints `RESULT` lines (see
    /// scripts/bench_peers.sh, which compares them with PyTorch, TensorFlow, JAX and numpy).
    Bench(BenchArgs),
    /// Print this CPU's model, the kernels' tier in use and every tier it can run
    /// (`cpu=… active=… available=…`, one line).
    Isa,
    /// Download, copy or verify data sets.
    Data {
        #[command(subcommand)]
        cmd: DataCmd,
    },
}

#[derive(clap::Args)]
struct DataDir {
    /// Folder holding the data sets (laid out like `datasets/manifest.toml` says).
    #[arg(long, env = "LBBSP_DATA", default_value = "data")]
    data_dir: PathBuf,
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Recipe file, or the name of a shipped recipe in models/ (e.g. digits-mlp, mnist-mlp).
    recipe: String,
    #[command(flatten)]
    data: DataDir,
    /// Override a recipe field, e.g. `--set train.epochs=1 --set balance.policy=lbbsp`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Write one JSON object per iteration to this file (JSONL).
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Write the end-of-run summary (JSON) to this file.
    #[arg(long)]
    summary: Option<PathBuf>,
    /// Rayon threads per rank [default: SLURM_CPUS_PER_TASK under Slurm, else cores on the node ÷
    /// ranks on the node].
    #[arg(long)]
    threads: Option<usize>,
    /// Test aid: stretch RANK's compute time by FACTOR from iteration ITER on (default 0).
    #[arg(long, value_name = "RANK:FACTOR[@ITER]", value_parser = parse_slowdown)]
    slowdown: Vec<Slowdown>,
    /// No progress bar or per-epoch lines.
    #[arg(long, short)]
    quiet: bool,
    /// Write checkpoints (from rank 0) into DIR/step-<iter>/: model.safetensors (the weights, named
    /// as in the model), optimizer.safetensors and state.json. One is written after the last
    /// iteration, and every --checkpoint-every iterations. DIR must not hold checkpoints of an
    /// earlier run (continue that one with --resume).
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Also write a checkpoint every N iterations (needs --checkpoint-dir or --resume).
    #[arg(long, value_name = "N", value_parser = parse_every)]
    checkpoint_every: Option<usize>,
    /// Keep only the newest N checkpoints in the checkpoint folder, removing older ones after each
    /// write (all are kept by default).
    #[arg(long, value_name = "N", value_parser = parse_every)]
    keep: Option<usize>,
    /// Continue from the newest valid checkpoint in DIR (damaged newer ones are skipped with a
    /// warning), or from DIR itself if it is one step-<iter> folder (which must be valid). The recipe
    /// must have the same data, model, global batch, seed and optimizer kind; with another world
    /// size the balancer restarts from the equal split. New checkpoints go into the same folder
    /// unless --checkpoint-dir says otherwise. `--resume auto` continues from the newest checkpoint
    /// in --checkpoint-dir when there is one and starts afresh when there is none, so one job
    /// script serves the first start and every requeue (a folder named auto: `./auto`).
    #[arg(long, value_name = "DIR|auto", value_parser = parse_resume)]
    resume: Option<lbbsp::train::Resume>,
}

#[derive(clap::Args)]
struct EvalArgs {
    /// Recipe file, or the name of a shipped recipe: gives the model and the data set.
    recipe: String,
    #[command(flatten)]
    data: DataDir,
    /// Override a recipe field.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// The weights: a safetensors file with the model's tensor names and shapes (such as a
    /// checkpoint's model.safetensors), or a checkpoint's step-<iter> folder.
    #[arg(long, value_name = "FILE")]
    weights: PathBuf,
    /// Rayon threads per rank [default: SLURM_CPUS_PER_TASK under Slurm, else cores on the node ÷
    /// ranks on the node].
    #[arg(long)]
    threads: Option<usize>,
    /// Also write the result (JSON: test_accuracy, test_loss, samples, correct) to this file.
    #[arg(long)]
    summary: Option<PathBuf>,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// w1: MLP 784-512-256-10, batch 128 (recipe bench-w1); w2: LeNet-5, batch 64 (bench-w2); both
    /// on random MNIST-shaped data, one rank or N under `mpirun -n N`. gemm: GFLOP/s of the GEMM on
    /// 2048³ and on W1's layer shapes. allreduce (under mpirun): lbbsp's allreduce against
    /// MPI_Allreduce on 16 KB to 2.1 MB (W1's gradient) buffers, results checked.
    what: BenchWhat,
    /// Training iterations to run.
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// Iterations left out of the timing at the start.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Rayon threads per rank [default: SLURM_CPUS_PER_TASK under Slurm, else cores on the node ÷
    /// ranks on the node].
    #[arg(long)]
    threads: Option<usize>,
    /// gemm: timed samples per shape (their median and best are printed); allreduce: timed calls
    /// per size and algorithm.
    #[arg(long, default_value_t = 15)]
    reps: usize,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum BenchWhat {
    W1,
    W2,
    Gemm,
    Allreduce,
}

#[derive(Subcommand)]
enum DataCmd {
    /// Fetch a data set's canonical files into the data folder, verifying checksums.
    Fetch {
        /// Data set name (mnist, fashion-mnist, a9a, digits), or `all`.
        name: String,
        #[command(flatten)]
        data: DataDir,
        /// Copy from this local mirror folder instead of downloading.
        #[arg(long)]
        mirror: Option<PathBuf>,
    },
    /// Check that a data set's files are present with the right checksums.
    Verify {
        name: String,
        #[command(flatten)]
        data: DataDir,
    },
}

fn parse_every(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("`{s}`: expected a number of iterations, at least 1")),
    }
}

fn parse_resume(s: &str) -> std::result::Result<lbbsp::train::Resume, String> {
    Ok(match s {
        "auto" => lbbsp::train::Resume::Auto,
        "" => return Err("expected a checkpoint folder, or `auto`".into()),
        dir => lbbsp::train::Resume::From(PathBuf::from(dir)),
    })
}

fn parse_slowdown(s: &str) -> std::result::Result<Slowdown, String> {
    s.parse().map_err(|e: lbbsp::Error| match e {
        lbbsp::Error::Config { msg, .. } => msg,
        other => other.to_string(),
    })
}

fn parse_isa(s: &str) -> std::result::Result<lbbsp::IsaChoice, String> {
    s.parse().map_err(|e: lbbsp::Error| e.to_string())
}

fn parse_allreduce(s: &str) -> std::result::Result<AllreduceChoice, String> {
    s.parse().map_err(|_| format!("unknown allreduce (--allreduce / LBBSP_ALLREDUCE): use {}", AllreduceChoice::NAMES))
}

fn main() {
    let cli = Cli::parse();
    let recipe_based = matches!(
        &cli.cmd,
        Cmd::Train(_) | Cmd::Eval(_) | Cmd::Bench(BenchArgs { what: BenchWhat::W1 | BenchWhat::W2, .. })
    );
    // Commands with a recipe take the tier from it (with --isa over it) in `start_runtime`.
    if !recipe_based {
        if let Err(e) = lbbsp::Isa::select(cli.isa.unwrap_or_default()) {
            eprintln!("error: --isa: {e}");
            std::process::exit(2);
        }
    }
    let flags = |threads| RuntimeFlags { isa: cli.isa, allreduce: cli.allreduce, threads };
    let result = match cli.cmd {
        Cmd::Train(args) => on_ranks(|comm| train_on(comm, &args, flags(args.threads))),
        Cmd::Eval(args) => on_ranks(|comm| eval_on(comm, &args, flags(args.threads))),
        Cmd::Bench(args) => match args.what {
            BenchWhat::W1 => on_ranks(|comm| bench_on(comm, &args, Workload::W1, flags(args.threads))),
            BenchWhat::W2 => on_ranks(|comm| bench_on(comm, &args, Workload::W2, flags(args.threads))),
            BenchWhat::Gemm => bench_gemm(&args),
            BenchWhat::Allreduce => on_ranks(|comm| bench_allreduce(comm, &args)),
        },
        Cmd::Data { cmd } => run_data(cmd),
        Cmd::Isa => {
            let names: Vec<&str> = lbbsp::Isa::available().iter().map(|t| t.name()).collect();
            println!(
                "cpu={:?} active={} available={}",
                lbbsp::kernels::isa::cpu_model(),
                lbbsp::Isa::active(),
                names.join(",")
            );
            Ok(())
        }
        Cmd::Interfere(args) => crate::interfere::run(&args).map_err(Into::into),
        Cmd::Plot(args) => crate::plot::run(&args).map_err(Into::into),
        Cmd::Simulate(args) => crate::simulate::run(&args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Runs `f` on every rank of the MPI job (one rank standalone).
fn on_ranks(f: impl FnOnce(&mut Mpi) -> Result<()>) -> Result<()> {
    let mut comm = Mpi::init()?;
    let result = f(&mut comm);
    if let Err(e) = &result {
        let lib = e.downcast_ref::<lbbsp::error::Error>();
        let collective = lib.is_some_and(|e| e.is_collective());
        if collective {
            // Every rank has the same verdict and rank 0 reports it, before MPI_Finalize: the
            // other ranks leave after it with the same status, and mpirun then ends the job, so a
            // report written after MPI would race with that end and could be lost.
            let preempted = matches!(lib, Some(lbbsp::error::Error::Preempted { .. }));
            if comm.rank() == 0 {
                eprintln!("{}: {e:#}", if preempted { "lbbsp" } else { "error" });
            }
            drop(comm);
            std::process::exit(if preempted { lbbsp::train::stop::PREEMPTED_STATUS } else { 1 });
        }
        if !collective && comm.world_size() > 1 {
            // Other ranks may be blocked in a collective: take the whole job down with a message.
            eprintln!("error on rank {}: {e:#}", comm.rank());
            comm.abort(1);
        }
    }
    result
}

fn train_on(comm: &mut Mpi, args: &TrainArgs, flags: RuntimeFlags) -> Result<()> {
    let mut recipe = lbbsp::train::recipe::resolve(&args.recipe, &args.set)?;
    recipe.runtime.slowdown.extend(&args.slowdown);
    for (flag, given) in [("--checkpoint-every", args.checkpoint_every), ("--keep", args.keep)] {
        if given.is_some() && args.checkpoint_dir.is_none() && !matches!(args.resume, Some(Resume::From(_))) {
            bail!("{flag} needs --checkpoint-dir DIR (or --resume DIR) to say where checkpoints go");
        }
    }
    if args.resume == Some(Resume::Auto) && args.checkpoint_dir.is_none() {
        bail!("--resume auto needs --checkpoint-dir DIR: the folder to continue from, and to write checkpoints into");
    }
    let threads = start_runtime(comm, &mut recipe.runtime, flags)?;
    let watched = Watched::new(&*comm, recipe.runtime.collective_timeout_s, exit_on_timeout())?;
    let comm: &dyn Communicator = &watched;
    // Fail on the recipe/bounds before spending time on data.
    lbbsp::Balancer::new(&recipe.balance, recipe.train.global_batch, comm.world_size())?;
    lbbsp::train::aids::check_slowdowns(&recipe.runtime.slowdown, comm.world_size())?;
    let data = lbbsp::data::load::load(&recipe.data, &args.data.data_dir)?;
    let rank0 = comm.rank() == 0;
    if rank0 && !args.quiet {
        eprintln!(
            "lbbsp: {} on {} rank(s) × {threads} thread(s), kernels {}, policy {}, B = {}, {} train / {} test samples",
            recipe.name,
            comm.world_size(),
            lbbsp::Isa::active(),
            recipe.balance.policy.name(),
            recipe.train.global_batch,
            data.train.len(),
            data.test.len()
        );
    }
    for out in [&args.metrics, &args.summary].into_iter().flatten() {
        if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        if rank0 {
            let resolved = resolved_path(out);
            std::fs::write(&resolved, recipe.to_toml()).with_context(|| format!("writing {}", resolved.display()))?;
        }
    }
    let opts = RunOptions {
        metrics: args.metrics.clone(),
        progress: !args.quiet,
        checkpoint_dir: args.checkpoint_dir.clone().or_else(|| match &args.resume {
            Some(Resume::From(dir)) => Some(lbbsp::train::checkpoint::root_of(dir)),
            _ => None,
        }),
        checkpoint_every: args.checkpoint_every,
        keep: args.keep,
        resume: args.resume.clone().unwrap_or_default(),
    };
    let summary = lbbsp::train(&recipe, &data, comm, &opts)?;
    if rank0 {
        if let Some(p) = &args.summary {
            write_json(p, &summary)?;
        }
        println!(
            "{}: test accuracy {:.2}% after {} iterations on {} rank(s), {:.0} samples/s, {:.1} s",
            recipe.name,
            100.0 * summary.test_accuracy,
            summary.iterations,
            summary.world_size,
            summary.samples_per_s,
            summary.wall_s
        );
        if comm.world_size() > 1 && !args.quiet {
            print!("straggler report ({} policy):\n{}", summary.policy.name(), summary.stragglers);
        }
    }
    Ok(())
}

/// Trains `w` for `--iters` iterations through the real loop and prints, on rank 0, its throughput
/// over the iterations after `--warmup` and its peak memory against what it must hold.
fn bench_on(comm: &mut Mpi, args: &BenchArgs, w: Workload, flags: RuntimeFlags) -> Result<()> {
    if args.warmup >= args.iters {
        bail!("--warmup {} leaves no iteration of --iters {} to time", args.warmup, args.iters);
    }
    // Enough epochs for any --iters (an epoch has at least one iteration).
    let set = [format!("train.max_iters={}", args.iters), format!("train.epochs={}", args.iters)];
    let mut recipe = lbbsp::train::recipe::resolve(w.recipe(), &set)?;
    let threads = start_runtime(comm, &mut recipe.runtime, flags)?;
    let watched = Watched::new(&*comm, recipe.runtime.collective_timeout_s, exit_on_timeout())?;
    let comm: &dyn Communicator = &watched;
    let data = lbbsp::data::load::load(&recipe.data, Path::new("."))?;
    let metrics = std::env::temp_dir().join(format!("lbbsp-bench-{}.jsonl", std::process::id()));
    let opts = RunOptions { metrics: Some(metrics.clone()), ..RunOptions::default() };
    lbbsp::train(&recipe, &data, comm, &opts)?;
    let peak = lbbsp::train::footprint::peak_rss()?;
    if comm.rank() != 0 {
        return Ok(());
    }
    let records = lbbsp::train::metrics::read_records(&metrics);
    std::fs::remove_file(&metrics).ok();
    let (samples_per_s, final_loss) = crate::bench::throughput(&records?, args.warmup)?;
    println!(
        "RESULT peer=lbbsp model={} world={} threads_per_rank={threads} isa={} batch={} \
         samples_per_s={samples_per_s:.1} final_loss={final_loss:.4}",
        w.model(),
        comm.world_size(),
        lbbsp::Isa::active(),
        recipe.train.global_batch
    );
    let f = Footprint::measure(&recipe, &data, comm.world_size())?;
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "MEMORY rank=0 peak_rss_mb={:.1} needed_mb={:.1} ratio={:.3} dataset_mb={:.1} params_mb={:.2} grads_mb={:.2} \
         optimizer_mb={:.2} activations_mb={:.2}",
        mb(peak),
        mb(f.total()),
        peak as f64 / f.total() as f64,
        mb(f.dataset),
        mb(f.params),
        mb(f.grads),
        mb(f.optimizer),
        mb(f.activations)
    );
    Ok(())
}

/// Prints the GFLOP/s of `lbbsp::kernels::gemm` on each of [`crate::bench::gemm_cases`] (one process).
fn bench_gemm(args: &BenchArgs) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = args.threads.unwrap_or(cores);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().context("starting the rayon thread pool")?;
    for c in crate::bench::gemm_cases() {
        let (median, best) = crate::bench::gemm_gflops(&c, args.reps);
        println!(
            "RESULT gemm=lbbsp shape={} m={} n={} k={} ta={:?} tb={:?} threads={threads} isa={} \
             gflops_median={median:.1} gflops_best={best:.1}",
            c.name,
            c.m,
            c.n,
            c.k,
            c.ta,
            c.tb,
            lbbsp::Isa::active()
        );
    }
    Ok(())
}

fn bench_allreduce(comm: &Mpi, args: &BenchArgs) -> Result<()> {
    let rows = crate::bench::allreduce(comm, &[4096, 61_706, 535_818], args.reps)?;
    if comm.rank() == 0 {
        let algo = comm.allreduce();
        let name = algo.name();
        for r in rows {
            println!(
                "RESULT allreduce ranks={} floats={} mpi_us={:.1} ring_us={:.1} shm_us={:.1} lbbsp={name} \
                 lbbsp_us={:.1} lbbsp_over_mpi={:.3}",
                comm.world_size(),
                r.floats,
                1e6 * r.mpi_s,
                1e6 * r.ring_s,
                1e6 * r.shm_s,
                1e6 * r.seconds(algo),
                r.seconds(algo) / r.mpi_s
            );
        }
    }
    Ok(())
}

/// Sets up what the recipe's `[runtime]` section says, with the command line's flags over it: the
/// kernels' tier, the global rayon pool (by default the node's cores shared among its ranks) and
/// the allreduce. Rewrites `runtime` to the values in use (`auto` resolved), so that the resolved
/// recipe written next to a result reproduces it; returns the thread count.
fn start_runtime(comm: &mut Mpi, runtime: &mut RuntimeConfig, flags: RuntimeFlags) -> Result<usize> {
    let isa = lbbsp::Isa::select(flags.isa.unwrap_or(runtime.isa)).context("runtime.isa / --isa")?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = match (flags.threads.or(runtime.threads), slurm_cpus_per_task()?) {
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) => (cores / comm.local_size().max(1)).max(1),
    };
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().context("starting the rayon thread pool")?;
    let allreduce = comm.choose_allreduce(flags.allreduce.unwrap_or(runtime.allreduce))?;
    runtime.isa = lbbsp::IsaChoice::Exactly(isa);
    runtime.threads = Some(threads);
    runtime.allreduce = allreduce.choice();
    Ok(threads)
}

/// The CPUs Slurm gave each task (`srun --cpus-per-task`, `sbatch -c`), when it says.
fn slurm_cpus_per_task() -> Result<Option<usize>> {
    match std::env::var("SLURM_CPUS_PER_TASK") {
        Err(_) => Ok(None),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n >= 1 => Ok(Some(n)),
            _ => bail!("SLURM_CPUS_PER_TASK={v:?} is not a count of CPUs: unset it, or pass --threads N"),
        },
    }
}

fn eval_on(comm: &mut Mpi, args: &EvalArgs, flags: RuntimeFlags) -> Result<()> {
    let mut recipe = lbbsp::train::recipe::resolve(&args.recipe, &args.set)?;
    start_runtime(comm, &mut recipe.runtime, flags)?;
    let comm = &*comm;
    let data = lbbsp::data::load::load(&recipe.data, &args.data.data_dir)?;
    let mut model = lbbsp::Model::new(&recipe.model, &data.train.sample_shape, data.train.classes, recipe.train.seed)?;
    if comm.rank() == 0 {
        model.params = lbbsp::train::checkpoint::read_weights(&args.weights, &model.table)?;
    }
    comm.broadcast_into(0, &mut model.params);
    // Batches as large as training's (the same rows per gemm call where the shards allow).
    model.set_capacity(recipe.train.global_batch.max(256));
    let ev = lbbsp::train::evaluate(&mut model, &data.test, comm, 0);
    if comm.rank() == 0 {
        let correct = (ev.accuracy * ev.samples as f64).round() as usize;
        println!(
            "{}: test accuracy {:.2}% ({correct}/{} correct), test loss {:.4}, weights {}",
            recipe.name,
            100.0 * ev.accuracy,
            ev.samples,
            ev.loss,
            args.weights.display()
        );
        if let Some(p) = &args.summary {
            let out = serde_json::json!({
                "recipe": recipe.name,
                "weights": args.weights,
                "test_accuracy": ev.accuracy,
                "test_loss": ev.loss,
                "samples": ev.samples,
                "correct": correct,
            });
            write_json(p, &out)?;
        }
    }
    Ok(())
}

/// `runs/x/summary.json` → `runs/x/summary.recipe.toml`: the resolved recipe next to a result.
fn resolved_path(out: &Path) -> PathBuf {
    let stem = out.file_stem().map_or("run".into(), |s| s.to_string_lossy().into_owned());
    out.with_file_name(format!("{stem}.recipe.toml"))
}

fn run_data(cmd: DataCmd) -> Result<()> {
    match cmd {
        DataCmd::Fetch { name, data, mirror } => {
            let names: Vec<String> = if name == "all" {
                lbbsp::data::manifest::names()?.into_iter().map(String::from).collect()
            } else {
                vec![name]
            };
            for n in names {
                let report = lbbsp::data::fetch::fetch(&n, &data.data_dir, mirror.as_deref())?;
                println!("{n}: {report}");
            }
        }
        DataCmd::Verify { name, data } => {
            let spec = lbbsp::data::manifest::spec(&name)?;
            lbbsp::data::manifest::verify(spec, &data.data_dir)?;
            println!("{name}: all files present, checksums match");
        }
    }
    Ok(())
}

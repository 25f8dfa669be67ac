//! The `lbbsp` command line: train recipes (standalone or under `mpirun`), manage data sets.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use lbbsp::comm::{Communicator, Mpi};
use lbbsp::metrics::write_json;
use lbbsp::train::{RunOptions, Slowdown};
use std::path::{Path, PathBuf};

/// Data-parallel CPU training over MPI with load-balanced bulk synchronous parallel (LB-BSP).
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train a recipe: one rank standalone, N ranks under `mpirun -n N lbbsp train ...`.
    Train(TrainArgs),
    /// Burn CPU on some cores following a load pattern: a co-located job for experiments.
    Interfere(lbbsp::interfere::InterfereArgs),
    /// Plot per-iteration metrics (JSONL) of one or more runs to an SVG.
    Plot(lbbsp::plot::PlotArgs),
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
    /// Recipe file, or the name of a shipped recipe (digits-mlp, mnist-mlp, a9a-logreg).
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
    /// Rayon threads per rank [default: cores on the node ÷ ranks on the node].
    #[arg(long)]
    threads: Option<usize>,
    /// Test aid: stretch RANK's compute time by FACTOR from iteration ITER on (default 0).
    #[arg(long, value_name = "RANK:FACTOR[@ITER]", value_parser = parse_slowdown)]
    slowdown: Vec<Slowdown>,
    /// No progress bar or per-epoch lines.
    #[arg(long, short)]
    quiet: bool,
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

fn parse_slowdown(s: &str) -> std::result::Result<Slowdown, String> {
    let err = || format!("`{s}`: expected RANK:FACTOR[@ITER], e.g. 1:3.0@30");
    let (rank, rest) = s.split_once(':').ok_or_else(err)?;
    let (factor, from) = rest.split_once('@').unwrap_or((rest, "0"));
    let sd = Slowdown {
        rank: rank.parse().map_err(|_| err())?,
        factor: factor.parse().map_err(|_| err())?,
        from_iter: from.parse().map_err(|_| err())?,
    };
    if !(sd.factor >= 1.0 && sd.factor.is_finite()) {
        return Err(format!("`{s}`: FACTOR must be ≥ 1"));
    }
    Ok(sd)
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Train(args) => run_train(args),
        Cmd::Data { cmd } => run_data(cmd),
        Cmd::Interfere(args) => lbbsp::interfere::run(&args).map_err(Into::into),
        Cmd::Plot(args) => lbbsp::plot::run(&args).map_err(Into::into),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run_train(args: TrainArgs) -> Result<()> {
    let comm = Mpi::init()?;
    let result = train_on(&comm, &args);
    if let Err(e) = &result {
        if comm.world_size() > 1 {
            // Other ranks may be blocked in a collective: take the whole job down with a message.
            eprintln!("error on rank {}: {e:#}", comm.rank());
            comm.abort(1);
        }
    }
    result
}

fn train_on(comm: &Mpi, args: &TrainArgs) -> Result<()> {
    let recipe = lbbsp::recipe::resolve(&args.recipe, &args.set)?;
    for s in &args.slowdown {
        if s.rank >= comm.world_size() {
            bail!("--slowdown {}:…: rank {} does not exist in a world of {}", s.rank, s.rank, comm.world_size());
        }
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = args.threads.unwrap_or((cores / comm.local_size().max(1)).max(1));
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().context("starting the rayon thread pool")?;
    // Fail on the recipe/bounds before spending time on data.
    lbbsp::Balancer::new(&recipe.balance, recipe.train.global_batch, comm.world_size())?;
    let data = lbbsp::dataset::load(&recipe.data, &args.data.data_dir)?;
    let rank0 = comm.rank() == 0;
    if rank0 && !args.quiet {
        eprintln!(
            "lbbsp: {} on {} rank(s) × {threads} thread(s), policy {:?}, B = {}, {} train / {} test samples",
            recipe.name,
            comm.world_size(),
            recipe.balance.policy,
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
        threads,
        progress: !args.quiet,
        slowdowns: args.slowdown.clone(),
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
            eprint!("straggler report ({} policy):\n{}", summary.policy, summary.stragglers);
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
            let names: Vec<String> = if name == "all" { lbbsp::manifest::names()?.into_iter().map(String::from).collect() } else { vec![name] };
            for n in names {
                let report = lbbsp::fetch::fetch(&n, &data.data_dir, mirror.as_deref())?;
                println!("{n}: {report}");
            }
        }
        DataCmd::Verify { name, data } => {
            let spec = lbbsp::manifest::spec(&name)?;
            lbbsp::manifest::verify(spec, &data.data_dir)?;
            println!("{name}: all files present, checksums match");
        }
    }
    Ok(())
}

//! `lbbsp simulate`: the balancing policies on a simulated cluster (see [`lbbsp::sim`]).

use anyhow::{bail, Context, Result};
use lbbsp::sim::eval::{against_baseline, run_seeds, seeds_from, summarise, Summary};
use lbbsp::sim::family::{generate, Family};
use lbbsp::sim::scenario::{resolve, SHIPPED};
use lbbsp::sim::{simulate, SimPolicy, SimResult};
use lbbsp::train::metrics::{write_json, JsonlWriter};
use lbbsp::BalanceConfig;
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct SimulateArgs {
    /// Scenario file, or the name of a shipped one in scenarios/ (quiet, heterogeneous,
    /// steady-hog, square-wave, bursty, co-located, fail-slow, spikes).
    scenario: Option<String>,
    /// Ranks [default: the scenario's].
    #[arg(long)]
    ranks: Option<usize>,
    /// Iterations [default: the scenario's].
    #[arg(long)]
    iterations: Option<usize>,
    /// Run every shipped scenario at each of --suite-ranks (a measured one at its own size too) and
    /// print one scoreboard.
    #[arg(long, conflicts_with = "scenario")]
    suite: bool,
    /// Cluster sizes of the suite and the family.
    #[arg(long, value_delimiter = ',', default_value = "16,256,10000")]
    suite_ranks: Vec<usize>,
    /// Run each scenario of the suite over this many seeds (its own and the next ones) and print
    /// each policy's mean throughput ratio with a bootstrap 95% interval, paired by seed.
    #[arg(long, default_value_t = 1)]
    seeds: usize,
    /// Run --seeds randomised scenarios of a family at each of --suite-ranks instead of the
    /// shipped ones: `tune` (for developing) or `held-out` (for reporting only).
    #[arg(long, value_enum, conflicts_with_all = ["scenario", "suite"])]
    family: Option<Family>,
    /// With --family: start at the family's K-th scenario, so that a later evaluation uses seeds
    /// an earlier one never saw.
    #[arg(long, value_name = "K", default_value_t = 0, requires = "family")]
    first_seed: usize,
    /// With --suite or --family: compare lbbsp with an earlier `--json` of the same runs (same
    /// seeds), paired by scenario, size and seed.
    #[arg(long, value_name = "FILE.json")]
    baseline: Option<PathBuf>,
    /// Write the results (JSON) to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write each policy's per-iteration records into DIR/<policy>.jsonl (for `lbbsp plot`).
    #[arg(long, value_name = "DIR")]
    metrics: Option<PathBuf>,
    /// Override a balancer setting, `balance.KEY=VALUE` (repeatable), e.g. `balance.warmup_iters=10`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Print a scenario that replays a recorded run (`lbbsp train --metrics FILE`): its ranks,
    /// iterations and global batch, the compute line of its uncontended iterations, the seconds
    /// it spent after each iteration's slowest compute, and the run as a trace interference.
    #[arg(long, value_name = "RUN.jsonl", conflicts_with_all = ["scenario", "suite"])]
    calibrate: Option<PathBuf>,
    /// Print the scenario (TOML) instead of running it: with `family-SEED`, a family's scenario.
    #[arg(long)]
    print: bool,
    /// With --calibrate: write the run's slowdowns into the scenario (a `series` interference), so
    /// that it needs no other file.
    #[arg(long, requires = "calibrate")]
    inline: bool,
}

pub fn run(args: &SimulateArgs) -> Result<()> {
    if let Some(run) = &args.calibrate {
        print!("{}", lbbsp::sim::calibrate::calibrate(run)?.scenario_toml(args.inline));
        return Ok(());
    }
    let cfg: BalanceConfig = lbbsp::train::recipe::balance_with(&args.set)?;
    if args.suite || args.family.is_some() {
        return suite(args, &cfg);
    }
    let Some(name) = &args.scenario else { bail!("name a scenario (file or shipped name), or pass --suite") };
    let mut scenario = match name.strip_prefix("family-").and_then(|k| k.parse::<u64>().ok()) {
        Some(seed) => generate(seed, args.ranks.unwrap_or(16)),
        None => resolve(name)?,
    };
    if args.print {
        print!("{}", toml::to_string(&scenario)?);
        return Ok(());
    }
    if let Some(i) = args.iterations {
        scenario.iterations = i;
    }
    let ranks = args.ranks.unwrap_or(scenario.ranks);
    if args.seeds > 1 {
        // Over seeds: the suite's row for this one scenario.
        print_header(false);
        let results = run_seeds(&scenario, ranks, &cfg, &seeds_from(scenario.seed, args.seeds))?;
        print_row(&summarise(&scenario.name, &results), &results, None);
        if let Some(p) = &args.json {
            write_json(p, &results)?;
        }
        return Ok(());
    }
    let mut writers = BTreeMap::new();
    if let Some(dir) = &args.metrics {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for p in SimPolicy::ALL {
            writers.insert(p.name(), JsonlWriter::create(&dir.join(format!("{}.jsonl", p.name())))?);
        }
    }
    let mut failed = None;
    let mut write = |p: SimPolicy, r| {
        if let Some(w) = writers.get_mut(p.name()) {
            if let Err(e) = w.write(&r) {
                failed.get_or_insert(e);
            }
        }
    };
    let started = Instant::now();
    let result = simulate(&scenario, ranks, &cfg, args.metrics.as_ref().map(|_| &mut write as &mut dyn FnMut(_, _)))?;
    let took = started.elapsed().as_secs_f64();
    if let Some(e) = failed {
        return Err(e.into());
    }
    for w in writers.values_mut() {
        w.flush()?;
    }
    print_result(&result, took);
    if let Some(p) = &args.json {
        write_json(p, &result)?;
    }
    Ok(())
}

fn print_result(r: &SimResult, took: f64) {
    println!(
        "{}: {} ranks, B = {}, {} iterations, allreduce {:.3} ms ({took:.2} s to simulate)",
        r.scenario,
        r.ranks,
        r.global_batch,
        r.iterations,
        1e3 * r.comm_s
    );
    println!(
        "{:<20} {:>12} {:>9} {:>9} {:>6} {:>9} {:>14} {:>9} {:>8}",
        "policy", "samples/s", "mean ms", "p99 ms", "idle", "vs oracle", "recovery max", "starved", "rev/100"
    );
    for p in &r.policies {
        let rec = p.recovery.iter().max().map_or("-".to_string(), |m| format!("{m} ({} ch.)", p.recovery.len()));
        println!(
            "{:<20} {:>12.0} {:>9.3} {:>9.3} {:>5.1}% {:>9.3} {:>14} {:>9} {:>8.1}",
            p.policy.name(),
            p.samples_per_s,
            1e3 * p.mean_iter_s,
            1e3 * p.p99_iter_s,
            100.0 * p.idle_fraction,
            p.vs_oracle,
            rec,
            p.longest_starved,
            p.reversals_per_100
        );
    }
}

/// Every shipped scenario at every suite size (a measured one at its own too), or a family's
/// scenarios: one row each, every policy's mean throughput over the oracle's, lbbsp's over bsp's,
/// proportional-epoch's and the Bayes oracle's with their 95% intervals over the seeds, its
/// longest starvation and reversals per 100 iterations, and against a baseline.
fn suite(args: &SimulateArgs, cfg: &BalanceConfig) -> Result<()> {
    let baseline: Option<Vec<SimResult>> = match &args.baseline {
        Some(p) => Some(
            serde_json::from_str(&std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?)
                .with_context(|| format!("{}: not the --json of `lbbsp simulate --suite`", p.display()))?,
        ),
        None => None,
    };
    print_header(baseline.is_some());
    let mut all = Vec::new();
    let mut worst = Vec::new();
    let mut row = |name: &str, results: Vec<SimResult>| {
        let s = summarise(name, &results);
        print_row(&s, &results, baseline.as_deref());
        all.extend(results);
    };
    if let Some(family) = args.family {
        for &ranks in &args.suite_ranks {
            let results = (args.first_seed..args.first_seed + args.seeds)
                .into_par_iter()
                .map(|k| {
                    let mut scenario = generate(family.seed(k), ranks);
                    if let Some(i) = args.iterations {
                        scenario.iterations = i;
                    }
                    simulate(&scenario, ranks, cfg, None)
                })
                .collect::<lbbsp::Result<Vec<_>>>()?;
            worst.extend(results.iter().filter_map(flagged));
            row(&format!("family {}", family.name()), results);
        }
    } else {
        for (name, _) in SHIPPED {
            let mut scenario = resolve(name)?;
            if let Some(i) = args.iterations {
                scenario.iterations = i;
            }
            // A measured scenario at its own size too: it means most at the size it was measured at.
            let own = (scenario.measured() && !args.suite_ranks.contains(&scenario.ranks)).then_some(scenario.ranks);
            for ranks in own.into_iter().chain(args.suite_ranks.iter().copied()) {
                row(name, run_seeds(&scenario, ranks, cfg, &seeds_from(scenario.seed, args.seeds))?);
            }
        }
    }
    if !worst.is_empty() {
        println!("\nscenarios of the family where lbbsp loses to bsp or proportional-epoch by more than 1%, or starves a rank for more than 5 iterations:");
        for w in &worst {
            println!("  {w}");
        }
    }
    if let Some(p) = &args.json {
        write_json(p, &all)?;
    }
    Ok(())
}

/// A line on a family's scenario where lbbsp loses to bsp or proportional-epoch by more than 1%,
/// or starves a rank for more than 5 iterations.
fn flagged(r: &SimResult) -> Option<String> {
    let get = |p| r.get(p).expect("every policy runs");
    let lb = get(SimPolicy::Lbbsp);
    let (vs_bsp, vs_prop) = (
        lb.samples_per_s / get(SimPolicy::Bsp).samples_per_s,
        lb.samples_per_s / get(SimPolicy::ProportionalEpoch).samples_per_s,
    );
    (vs_bsp < 0.99 || vs_prop < 0.99 || lb.longest_starved > 5).then(|| {
        format!(
            "{} at {} ranks: lbbsp/bsp {vs_bsp:.3}, lbbsp/prop-ep {vs_prop:.3}, lbbsp/bayes {:.3}, starved {}",
            r.scenario,
            r.ranks,
            lb.samples_per_s / get(SimPolicy::BayesOracle).samples_per_s,
            lb.longest_starved
        )
    })
}

/// The scoreboard's header.
fn print_header(baseline: bool) {
    println!(
        "{:<22} {:>6} {:>5} {:>6} {:>7} {:>6} {:>6} {:>6} {:>22} {:>22} {:>22} {:>5} {:>6}{}",
        "scenario",
        "ranks",
        "seeds",
        "bsp",
        "prop-ep",
        "lbbsp",
        "late",
        "bayes",
        "lbbsp/bsp",
        "lbbsp/prop-ep",
        "lbbsp/bayes",
        "starv",
        "rev",
        if baseline { format!(" {:>22}", "lbbsp/baseline") } else { String::new() }
    );
}

/// One row of the scoreboard.
fn print_row(s: &Summary, results: &[SimResult], baseline: Option<&[SimResult]>) {
    let of = |p| s.get(p).vs_oracle.mean;
    let lb = s.get(SimPolicy::Lbbsp);
    let base = baseline.map(|b| against_baseline(results, b).map_or("-".to_string(), |i| i.to_string()));
    println!(
        "{:<22} {:>6} {:>5} {:>6.3} {:>7.3} {:>6.3} {:>6.3} {:>6.3} {:>22} {:>22} {:>22} {:>5} {:>6.1}{}",
        s.scenario,
        s.ranks,
        s.seeds,
        of(SimPolicy::Bsp),
        of(SimPolicy::ProportionalEpoch),
        of(SimPolicy::Lbbsp),
        of(SimPolicy::LateOracle),
        of(SimPolicy::BayesOracle),
        lb.vs_bsp.to_string(),
        lb.vs_proportional.to_string(),
        lb.vs_bayes.to_string(),
        lb.longest_starved,
        lb.reversals_per_100,
        base.map_or(String::new(), |b| format!(" {b:>22}"))
    );
}

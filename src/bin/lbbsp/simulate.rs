//! `lbbsp simulate`: the balancing policies on a simulated cluster (see [`lbbsp::sim`]).

use anyhow::{bail, Context, Result};
use lbbsp::sim::scenario::{resolve, SHIPPED};
use lbbsp::sim::{simulate, SimPolicy, SimResult};
use lbbsp::train::metrics::{write_json, JsonlWriter};
use lbbsp::BalanceConfig;
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
    /// Cluster sizes of the suite.
    #[arg(long, value_delimiter = ',', default_value = "16,256,10000")]
    suite_ranks: Vec<usize>,
    /// Write the results (JSON) to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write each policy's per-iteration records into DIR/<policy>.jsonl (for `lbbsp plot`).
    #[arg(long, value_name = "DIR")]
    metrics: Option<PathBuf>,
    /// Override a balancer setting, `balance.KEY=VALUE` (repeatable), e.g. `balance.signal=false`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Print a scenario that replays a recorded run (`lbbsp train --metrics FILE`): its ranks,
    /// iterations and global batch, the compute line of its uncontended iterations, the seconds
    /// it spent after each iteration's slowest compute, and the run as a trace interference.
    #[arg(long, value_name = "RUN.jsonl", conflicts_with_all = ["scenario", "suite"])]
    calibrate: Option<PathBuf>,
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
    if args.suite {
        return suite(args, &cfg);
    }
    let Some(name) = &args.scenario else { bail!("name a scenario (file or shipped name), or pass --suite") };
    let mut scenario = resolve(name)?;
    if let Some(i) = args.iterations {
        scenario.iterations = i;
    }
    let ranks = args.ranks.unwrap_or(scenario.ranks);
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

/// Every shipped scenario at every suite size (a measured one at its own too): one row each,
/// throughput as a fraction of the oracle's per policy, lbbsp's worst recovery, longest
/// starvation and reversals per 100 iterations.
fn suite(args: &SimulateArgs, cfg: &BalanceConfig) -> Result<()> {
    println!(
        "{:<22} {:>6} {:>7} {:>9} {:>7} {:>9} {:>7} {:>12} {:>9} {:>8} {:>7}",
        "scenario",
        "ranks",
        "bsp",
        "prop-ep",
        "lbbsp",
        "late-orc",
        "oracle",
        "lbbsp rec.",
        "starved",
        "rev/100",
        "sim s"
    );
    let mut all = Vec::new();
    for (name, _) in SHIPPED {
        let mut scenario = resolve(name)?;
        if let Some(i) = args.iterations {
            scenario.iterations = i;
        }
        // A measured scenario at its own size too: it means most at the size it was measured at.
        let own = (scenario.measured() && !args.suite_ranks.contains(&scenario.ranks)).then_some(scenario.ranks);
        for ranks in own.into_iter().chain(args.suite_ranks.iter().copied()) {
            let started = Instant::now();
            let r = simulate(&scenario, ranks, cfg, None)?;
            let took = started.elapsed().as_secs_f64();
            let of = |p| r.get(p).map_or(f64::NAN, |x| x.vs_oracle);
            let lb = r.get(SimPolicy::Lbbsp).expect("lbbsp runs");
            println!(
                "{:<22} {:>6} {:>7.3} {:>9.3} {:>7.3} {:>9.3} {:>7.3} {:>12} {:>9} {:>8.1} {:>7.2}",
                name,
                ranks,
                of(SimPolicy::Bsp),
                of(SimPolicy::ProportionalEpoch),
                of(SimPolicy::Lbbsp),
                of(SimPolicy::LateOracle),
                1.0,
                lb.recovery.iter().max().map_or("-".into(), |m| m.to_string()),
                lb.longest_starved,
                lb.reversals_per_100,
                took
            );
            all.push(r);
        }
    }
    if let Some(p) = &args.json {
        write_json(p, &all)?;
    }
    Ok(())
}

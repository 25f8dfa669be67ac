//! Replays a metrics file through the balancer and prints each rank's expected line per iteration (debugging aid).
use lbbsp::balance::model::off_cpu_s;
use lbbsp::balance::{BalanceConfig, Balancer, Observation, Policy, PolicyKind};

fn main() -> anyhow::Result<()> {
    let path = std::env::args().nth(1).expect("metrics.jsonl");
    let recs = lbbsp::train::metrics::read_records(std::path::Path::new(&path))?;
    let world = recs[0].batch_sizes.len();
    let cfg = BalanceConfig { policy: PolicyKind::Lbbsp, ..Default::default() };
    let mut bal = Balancer::new(&cfg, recs[0].global_batch, world)?;
    for (i, r) in recs.iter().enumerate() {
        let obs: Vec<Observation> = (0..world)
            .map(|k| Observation {
                batch: r.batch_sizes[k],
                compute_s: r.compute_s[k],
                cpu_share: r.cpu_share.get(k).copied().unwrap_or(1.0),
                preemptions: r.preemptions.get(k).copied().unwrap_or(0.0),
                // Files from before the waits were measured: every second off the CPU was frozen.
                frozen_s: r
                    .frozen_s
                    .get(k)
                    .copied()
                    .unwrap_or_else(|| off_cpu_s(r.compute_s[k], r.cpu_share.get(k).copied().unwrap_or(1.0))),
                run_share: r.run_share.get(k).copied().unwrap_or(0.0),
                run_s: lbbsp::train::metrics::seconds_before(&recs, i),
                // A record's transfers are its own collective's; the trainer's balancer is told
                // them one iteration late, with the next iteration's observations.
                transfer_s: i.checked_sub(1).and_then(|j| recs[j].comm_s.get(k)).copied().unwrap_or(0.0),
                balance_s: r.balance_s.get(k).copied().unwrap_or(0.0),
            })
            .collect();
        bal.observe(&obs);
        let lines: Vec<String> =
            bal.expected_lines().iter().map(|l| format!("a={:.2}ms b={:.4}ms", l.alpha * 1e3, l.beta * 1e3)).collect();
        println!(
            "{} {:?} {:?} -> {:?} {:?}",
            r.iter,
            r.batch_sizes,
            r.compute_s.iter().map(|c| (c * 1e4).round() / 10.0).collect::<Vec<_>>(),
            bal.sizes(),
            lines
        );
    }
    Ok(())
}

#!/usr/bin/env python3
"""The simulator against the paired real runs of scripts/bench_interference.sh: for each condition,
a 2-rank scenario from that condition's own measurements, and the simulated lbbsp/bsp ratio (the
mean over seeds, and the seeds' 2.5-97.5% range) beside the real median paired ratio and its
bootstrap interval; "within" when the simulated mean lies in the real interval.

    python3 scripts/validate_interference.py RUNS_DIR [RUNS_DIR ...] [--seeds 20]

Each RUNS_DIR holds a bench's runs.tsv, summary.json and metrics files (one folder may hold several
conditions). What the scenario takes from the runs, per condition:
- the compute line of rank 0, which nothing slows: least squares of its compute seconds on its
  batch over every run's iterations past the warm-up (the lbbsp runs vary the size);
- the noise: the relative deviation of rank 0's times about that line within each run (about the
  run's own median: a run that is slower throughout moves its pair's ratio, not the iterations'
  noise), the median absolute deviation scaled to a standard deviation, so that the host's hiccups
  do not count as noise; and its memory, the median over runs of the lag-1 autocorrelation of
  those deviations (a shared host's slowness drifts: a drift the last iteration shows is one a
  policy follows, where independent noise of the same size is not);
- `comm.fixed_s`: the median of `iter_s − max_i compute_i` over the iterations in which no rank was
  frozen (no frozen seconds in its compute, and a share of the whole iteration of at least 0.99,
  which the next record's `run_share` carries): the simulator adds
  a freeze in the collective itself, and a median over frozen iterations counted it twice (the 2 ms
  quota's 1.69 ms against 0.51 ms unfrozen and the quiet runs' 0.49 ms). Where the series ran the
  quiet condition at the same batch, every condition takes the quiet runs' (a hog's slice that falls
  between two iterations is seen by neither measure). A condition with fewer than 20 unfrozen
  iterations (at B = 2048 a quota or a hog freezes rank 1 in every one) takes those of the series'
  other conditions at its batch, pooled, or, with none, all of its own iterations;
- the interference, from the condition's definition: a `quota` of 1 ms in 2 ms or 50 ms in 100 ms
  on rank 1; a `hog` on rank 1 whose slice is the length of one freeze measured in hog-128's bsp
  runs (rank 1's frozen seconds over its preemptions, weighted by frozen seconds); in runs recorded
  before preemptions were, the slice (of a grid) at which the simulated bsp iteration matches the
  real bsp runs' median of hog-128; the bursty job as that hog in bursts of wall time, on and off
  for the mean of its 0.1-0.55 s phases: a chain in iterations (at the rate those phases make at
  the bsp runs' iteration time) put half of every policy's iterations in bursts, where on the wall
  clock bsp spends a third of its iterations in them, its slow ones being twice as long.
The ratio predicted is never fitted.
"""
import contextlib
import functools
import json
import os
import statistics as st
import subprocess
import sys
import tempfile

WARMUP = 20
# Iterations without a freeze that the collective's fixed cost needs (else it is taken from the
# series' other conditions at the same batch, and without those over all of its own).
MIN_UNFROZEN = 20
BIN = os.path.abspath(os.environ.get("LBBSP_BIN", "target/release/lbbsp"))


def records(path):
    return [json.loads(line) for line in open(path) if line.strip()]


@functools.lru_cache(maxsize=None)
def run_records(path):
    """A real run's records, read once: each condition's measures read the same files."""
    return records(path)


def conditions(dirs):
    """{condition: {"dir", "batch", "runs": [(policy, file)], "summary": the summary's entry}}."""
    out = {}
    for d in dirs:
        summary = json.load(open(os.path.join(d, "summary.json")))
        for line in list(open(os.path.join(d, "runs.tsv")))[1:]:
            f = line.rstrip("\n").split("\t")
            cond, batch, policy, name = f[0], int(f[1]), f[6], f[7]
            c = out.setdefault(cond, {"dir": d, "batch": batch, "runs": [], "summary": summary["conditions"].get(cond)})
            c["runs"].append((policy, os.path.join(d, name)))
    return out


def measure(c):
    """Rank 0's line and noise, the fixed cost, the iterations and bsp's median iteration seconds."""
    pts, fixed, unfrozen, bsp_iter, iters, run_of = [], [], [], [], 0, []
    for run, (policy, path) in enumerate(c["runs"]):
        every = run_records(path)
        iters = max(iters, len(every))
        for k, r in enumerate(every[WARMUP:], WARMUP):
            if sum(r["batch_sizes"]) != r["global_batch"]:
                continue
            pts.append((r["batch_sizes"][0], r["compute_s"][0]))
            run_of.append(run)
            fixed.append(r["iter_s"] - max(r["compute_s"]))
            # The simulator freezes a rank in the collective itself (a quota's or a hog's windows):
            # the fixed cost is the collective's own, from iterations in which no rank was frozen,
            # in its compute (its frozen seconds) or anywhere in it (the share over the whole
            # iteration, which the next record carries).
            after = every[k + 1] if k + 1 < len(every) else {}
            if not any(r.get("frozen_s") or [0.0]) and min(after.get("run_share") or [0.0]) >= 0.99:
                unfrozen.append(fixed[-1])
            if policy == "bsp":
                bsp_iter.append(r["iter_s"])
    n = len(pts)
    mb, mt = sum(b for b, _ in pts) / n, sum(t for _, t in pts) / n
    var = sum((b - mb) ** 2 for b, _ in pts)
    beta = sum((b - mb) * (t - mt) for b, t in pts) / var if var > 0 else mt / mb
    alpha = mt - beta * mb
    if not (beta > 0 and alpha >= 0):
        # The sizes did not vary enough against the host's noise to tell a fixed cost: proportional.
        alpha, beta = 0.0, mt / mb
    rel = [t / (alpha + beta * b) - 1 for b, t in pts]
    runs = {}
    for e, run in zip(rel, run_of):
        runs.setdefault(run, []).append(e)
    within, memory = [], []
    for x in runs.values():
        centre = st.median(x)
        x = [e - centre for e in x]
        within += x
        mean = sum(x) / len(x)
        var = sum((e - mean) ** 2 for e in x)
        if len(x) > 2 and var > 0:
            memory.append(sum((x[i] - mean) * (x[i + 1] - mean) for i in range(len(x) - 1)) / var)
    noise = min(0.45, 1.4826 * st.median([abs(e) for e in within]))
    memory = min(0.95, max(0.0, st.median(memory))) if memory else 0.0
    fixed = unfrozen if len(unfrozen) >= MIN_UNFROZEN else fixed
    return {"alpha": alpha, "beta": beta, "noise": noise, "memory": memory, "fixed": max(0.0, st.median(fixed)),
            "iterations": iters, "bsp_iter": st.median(bsp_iter) if bsp_iter else None,
            "unfrozen": unfrozen}


def pool_fixed(conds, measured):
    """The collective's own cost does not depend on what slows a rank. Where the series ran the
    quiet condition at the same global batch, every other condition takes the fixed cost of its
    unfrozen iterations: a hog's slice can fall between two iterations, before the compute's clock
    starts, where neither the compute's frozen seconds nor the whole iteration's share sees it, and
    the collective then waits for it (hog-128's "unfrozen" iterations: 4.05 ms after the slowest
    compute, quiet-128's 0.90 ms; the simulator's hog adds the slice again). Otherwise a condition
    with too few unfrozen iterations (a 2 ms quota or a hog at B = 2048 freezes rank 1 in every one)
    takes those of the series' other conditions at its global batch, pooled: the median over its
    own frozen iterations counts their freezes in the collective twice."""
    for name, m in measured.items():
        batch = conds[name]["batch"]
        enough = lambda o: o != name and conds[o]["batch"] == batch and len(measured[o]["unfrozen"]) >= MIN_UNFROZEN
        donors = [o for o in measured if enough(o) and o.startswith("quiet")]
        if not donors:
            if len(m["unfrozen"]) >= MIN_UNFROZEN:
                continue
            donors = [o for o in measured if enough(o)]
        if donors:
            m["fixed"] = max(0.0, st.median([x for o in donors for x in measured[o]["unfrozen"]]))
            print(f"{name}: the fixed cost ({1e3 * m['fixed']:.2f} ms) is that of the unfrozen iterations "
                  f"at B = {batch} of " + ", ".join(donors))


def freeze_length(c):
    """Rank 1's freeze in bsp's runs: its frozen seconds per preemption, weighted by frozen seconds
    (None without a preemption counted)."""
    frozen = [0.0, 0.0]
    for policy, path in c["runs"]:
        for r in run_records(path)[WARMUP:] if policy == "bsp" else []:
            f = r["compute_s"][1] * (1.0 - min(1.0, r["cpu_share"][1]))
            n = (r.get("preemptions") or [0.0, 0.0])[1]
            if n >= 1 and f > 0:
                frozen = [frozen[0] + f * f / n, frozen[1] + f]
    return frozen[0] / frozen[1] if frozen[1] > 0 else None


def throttle_length(c):
    """One throttle of rank 1's quota group in bsp's runs, from the group's own counters
    (`cpu.stat`: throttled seconds over throttled periods; None where the series did not record
    them). The kernel's own figure: rank 1's off-CPU seconds per preemption, the fallback, read
    longer than its throttles where both are known. bsp's own runs only, at the equal split: a
    split held by replay (kind "st") is bsp's too."""
    runs = [r for r in ((c["summary"] or {}).get("runs") or []) if r.get("policy") == "bsp" and r.get("kind") != "st"]
    n = sum(r.get("nr_throttled") or 0 for r in runs)
    return sum(r.get("throttled_us") or 0 for r in runs) / n * 1e-6 if n else None


def freeze_cost(c):
    """CPU seconds a freeze costs rank 1 on resuming, from the bsp runs (both ranks at the same size):
    its mean CPU seconds of compute beyond rank 0's, per freeze met (None where it meets fewer than
    one a compute on average: the ranks' difference is then noise, not refills)."""
    cpu, freezes = [0.0, 0.0], []
    # bsp's own runs, not a split held by replay.
    equal = lambda r: r["batch_sizes"][0] == r["batch_sizes"][1]
    for policy, path in c["runs"]:
        for r in filter(equal, run_records(path)[WARMUP:]) if policy == "bsp" else []:
            for i in (0, 1):
                cpu[i] += r["compute_s"][i] * min(1.0, r["cpu_share"][i])
            freezes.append((r.get("preemptions") or [0.0, 0.0])[1])
    if not freezes or st.mean(freezes) < 1.0:
        return None
    return max(0.0, (cpu[1] - cpu[0]) / len(freezes) / st.mean(freezes))


def scenario(name, c, m, interference, refill=0.0):
    return f"""name = "{name}"
ranks = 2
iterations = {m["iterations"]}
batch_per_rank = {c["batch"] // 2}
epoch_iters = 1000000
[compute]
alpha_s = {m["alpha"]:.9f}
beta_s = {m["beta"]:.12f}
noise = {m["noise"]:.4f}
noise_memory = {m["memory"]:.3f}
freeze_cost_s = {refill:.9f}
[comm]
latency_s = 0.0
bytes = 0.0
fixed_s = {m["fixed"]:.9f}
{interference}"""


@contextlib.contextmanager
def simulated(text, *args):
    """Runs `lbbsp simulate` on a scenario's TOML with `args`; yields the folder it ran in."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s.toml")
        open(path, "w").write(text)
        subprocess.run([BIN, "simulate", path, *args], check=True, stdout=subprocess.DEVNULL, cwd=tmp)
        yield tmp


def simulate(text, seeds):
    """(per-seed lbbsp/bsp ratios, bsp's mean iteration seconds) of a scenario."""
    with simulated(text, "--seeds", str(seeds), "--json", "r.json") as tmp:
        runs = json.load(open(os.path.join(tmp, "r.json")))
    get = lambda r, p: next(x for x in r["policies"] if x["policy"] == p)
    ratios = [get(r, "lbbsp")["samples_per_s"] / get(r, "bsp")["samples_per_s"] for r in runs]
    return ratios, st.mean(get(r, "bsp")["mean_iter_s"] for r in runs)


def simulated_slowdown(text):
    """Rank 1's over rank 0's compute seconds per sample in the scenario's bsp run (one seed)."""
    with simulated(text, "--metrics", ".") as tmp:
        recs = records(os.path.join(tmp, "bsp.jsonl"))[WARMUP:]
    comp = [sum(r["compute_s"][i] for r in recs) / sum(r["batch_sizes"][i] for r in recs) for i in (0, 1)]
    return comp[1] / comp[0]


def main():
    args = sys.argv[1:]
    seeds = 20
    if "--seeds" in args:
        k = args.index("--seeds")
        seeds = int(args[k + 1])
        del args[k:k + 2]
    conds = conditions(args)
    measured = {name: measure(c) for name, c in conds.items()}
    pool_fixed(conds, measured)
    hog = 'kind = "hog"\nranks = [1]\nslice_s = {}\n'
    slice_s = None
    if "hog-128" in conds:
        slice_s = freeze_length(conds["hog-128"])
    if slice_s:
        print(f"hog slice measured in hog-128's bsp runs (frozen seconds per preemption): {1e3 * slice_s:.2f} ms")
    elif "hog-128" in conds:
        m = measured["hog-128"]
        grid = [0.5e-3, 1e-3, 1.5e-3, 2e-3, 3e-3, 4e-3, 6e-3, 8e-3, 12e-3]
        fits = []
        for s in grid:
            _, bsp = simulate(scenario("hog-fit", conds["hog-128"], m, "[[interference]]\n" + hog.format(s)), 4)
            fits.append((abs(bsp / m["bsp_iter"] - 1), s))
        slice_s = min(fits)[1]
        print(f"hog slice fitted on hog-128's bsp iteration time: {1e3 * slice_s:g} ms")
    # A freeze's refill: the condition's own where rank 1 meets freezes in most computes, else the
    # mean of the series' conditions of the same kind (a quota, or a hog steady or bursty) that
    # measure one, else none.
    kind = lambda name: "quota" if name.startswith("quota") else "hog" if name.startswith(("hog", "bursty")) else None
    own = {name: freeze_cost(c) for name, c in conds.items() if kind(name)}
    refills = {}
    for name in own:
        alike = [v for o, v in own.items() if kind(o) == kind(name) and v is not None]
        refills[name] = own[name] if own[name] is not None else (st.mean(alike) if alike else 0.0)
        where = "" if own[name] is not None else " (the series' other conditions of its kind)" if alike else " (none measured)"
        print(f"{name}: a freeze costs rank 1 {1e3 * refills[name]:.3f} ms of CPU{where}")
    # A quota: half of every period, as set; but the kernel may enforce it in longer stretches than
    # its period (its bandwidth slice is 5 ms), so the windows are as long as rank 1's group was
    # throttled at a time in bsp's runs, else as the freezes rank 1 met there.
    windows = {}
    for name, c in conds.items():
        if name.startswith("quota"):
            throttled, frozen = throttle_length(c), freeze_length(c)
            windows[name] = throttled or frozen or (0.001 if name.startswith("quota2ms") else 0.05)
            how = "throttled" if throttled else "frozen"
            print(f"{name}: rank 1 {how} {1e3 * windows[name]:.2f} ms at a time in bsp's runs")
    print(f"{'condition':<16} {'real lbbsp/bsp (median, 95% CI)':>34} {'simulated (mean, seeds 2.5-97.5%)':>30}  within")
    for name, c in conds.items():
        m = measured[name]
        refill = refills.get(name, 0.0)
        if name.startswith("quota"):
            window = windows[name]
            p = f'kind = "quota"\nranks = [1]\nquota_s = {window:.6f}\nperiod_s = {2 * window:.6f}\n'
        elif name.startswith("hog"):
            if slice_s is None:
                print(f"{name:<16} no hog-128 runs to fit the hog's slice on")
                continue
            p = hog.format(slice_s)
        elif name.startswith("bursty"):
            if slice_s is None:
                print(f"{name:<16} no hog-128 runs to measure the hog's slice on")
                continue
            # The job's phases are uniform in 0.1-0.55 s: on and off for their mean, 0.325 s, of
            # wall time, so that each policy meets the bursts at its own clock.
            p = hog.format(slice_s) + "on_s = 0.325\noff_s = 0.325\n"
        else:
            p = None
        text = scenario(name, c, m, "[[interference]]\n" + p if p else "", refill)
        # A throttled or preempted rank computes slower than its share of the CPU alone makes it
        # (its caches refilled after every freeze): rank 1's measured slowdown in the bsp runs,
        # beyond what the simulator's windows give, as a hidden steady factor.
        real_slowdown = (c["summary"] or {}).get("bsp_s1_over_s0_median")
        if real_slowdown and name.startswith(("quota", "hog")):
            extra = real_slowdown / simulated_slowdown(text)
            if extra > 1.0:
                p += f'[[interference]]\nkind = "steady"\nranks = [1]\nsignal = false\nfactor = {extra:.4f}\n'
                text = scenario(name, c, m, "[[interference]]\n" + p, refill)
        ratios, _ = simulate(text, seeds)
        mean = st.mean(ratios)
        q = sorted(ratios)
        lo, hi = q[max(0, int(0.025 * len(q)))], q[min(len(q) - 1, int(0.975 * len(q)))]
        real = c["summary"]["ab"] if c["summary"] else None
        if real is None:
            print(f"{name:<16} {'(no summary)':>34} {mean:>12.3f} [{lo:.3f}, {hi:.3f}]")
            continue
        rm, (rlo, rhi) = real["median"], real["ci"]
        within = rlo <= mean <= rhi
        print(f"{name:<16} {rm:>14.3f} [{rlo:.3f}, {rhi:.3f}]      {mean:>12.3f} [{lo:.3f}, {hi:.3f}]  "
              f"{'yes' if within else 'NO'}")


if __name__ == "__main__":
    main()

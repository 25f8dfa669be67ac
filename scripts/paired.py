#!/usr/bin/env python3
"""The analysis of scripts/bench_interference.sh: paired ratios, bootstrap intervals, the empirical
oracle and starvation, from the runs listed in OUT/runs.tsv and their metrics JSONL files.

    python3 scripts/paired.py runs/bench-interference [SEED]

Prints one row per condition and writes OUT/summary.json.
"""
import json
import os
import random
import statistics as st
import subprocess
import sys
import time

WARMUP = 20  # iterations left out of every run: warm-up and lbbsp's probes
RESAMPLES = 4000


def targets(cond, c):
    """(text, verdict) of the balancer issue's target for a condition; verdict None: no target."""
    m, (lo, hi) = c["ab"]["median"], c["ab"]["ci"]
    if cond == "quota2ms-128":
        return ">= 1.35x", m >= 1.35
    if cond == "quota2ms-2048":
        return ">= 1.40x, >= 0.90 of oracle", m >= 1.40 and c["oracle"]["median"] >= 0.90
    if cond == "hog-2048":
        return ">= 1.35x", m >= 1.35
    if cond == "bursty-2048":
        return ">= 1.15x, CI low > 1.0", m >= 1.15 and lo > 1.0
    if cond in ("quiet-128", "quota100ms-128"):
        return "CI high >= 1.0", hi >= 1.0
    return "validation only", None


def speeds(recs):
    """Each record with every rank's seconds per sample in it; a rank given no samples keeps its
    last measured speed (None before it has one)."""
    last = [None] * len(recs[0]["batch_sizes"])
    for r in recs:
        for i, (b, c) in enumerate(zip(r["batch_sizes"], r["compute_s"])):
            if b > 0 and c > 0:
                last[i] = c / b
        yield r, list(last)


def effective(recs):
    """Per record, every rank's seconds per sample of CPU over the share of the whole iteration it
    could run (its CPU over wall seconds, compute and collective, which the next record carries),
    or its wall seconds per sample where that is not recorded. A rank under a quota whose freeze
    falls in the collective computes at full speed yet finishes an iteration only when it has run
    again: its equal-time share is by this speed, not by its compute's."""
    for n, r in enumerate(recs):
        nxt = recs[n + 1].get("run_share", []) if n + 1 < len(recs) else []
        out = []
        for i, (b, c) in enumerate(zip(r["batch_sizes"], r["compute_s"])):
            a = nxt[i] if i < len(nxt) else 0.0
            share = r.get("cpu_share", [1.0] * len(r["batch_sizes"]))[i]
            out.append(None if not (b > 0 and c > 0) else (c * min(share, 1.0) / b / min(a, 1.0) if a > 0.05 else c / b))
        yield out


def longest_starved(recs, speeds_of):
    """The longest run of iterations in which a rank's batch stayed below half of its equal-time
    share by the given speeds (a rank's last known speed where it had no samples)."""
    last = [None] * len(recs[0]["batch_sizes"])
    run, worst = [0] * len(last), 0
    for r, s in zip(recs, speeds_of(recs)):
        last = [x if x is not None else l for x, l in zip(s, last)]
        known = [i for i, x in enumerate(last) if x is not None]
        rate = sum(1 / last[i] for i in known)
        for i in known:
            share = r["global_batch"] * (1 / last[i]) / rate
            run[i] = run[i] + 1 if r["batch_sizes"][i] < 0.5 * share else 0
            worst = max(worst, run[i])
    return worst


def analyse_run(path):
    recs = [json.loads(line) for line in open(path) if line.strip()]
    if len(recs) <= WARMUP:
        sys.exit(f"{path}: {len(recs)} iterations, need more than the {WARMUP} warm-up ones")
    samples = iter_s = oracle_s = late_s = late_wall = 0.0
    before = None
    comp = [0.0, 0.0]
    batch = [0, 0]
    for n, (r, s) in enumerate(speeds(recs)):
        known = [i for i, x in enumerate(s) if x is not None]
        rate = sum(1 / s[i] for i in known)
        if n < WARMUP:
            continue
        samples += r["global_batch"]
        iter_s += r["iter_s"]
        # The oracle splits the batch so that every rank computes for the same time at its
        # measured speed, and keeps the run's own communication and overhead.
        overhead = r["iter_s"] - max(r["compute_s"])
        oracle_s += r["global_batch"] / rate + overhead
        # The late oracle splits by the speeds of the iteration before, as a policy that learns
        # from timings at best can without foreseeing change, and meets this iteration's speeds.
        if before is not None and len(known) == len(s):
            late = [r["global_batch"] * (1 / before[i]) / sum(1 / x for x in before) for i in known]
            took = max(b * s[i] for b, i in zip(late, known)) + overhead
        else:
            took = r["iter_s"]
        late_s += took
        # The same, weighted by this run's wall time instead of its iterations: interference that
        # comes and goes on the wall clock (a bursty job) would have met a faster policy in more of
        # its iterations, and counting the run's own iterations over-weights the fast ones.
        late_wall += r["iter_s"] * r["global_batch"] / took
        before = list(s) if len(known) == len(s) else None
        for i in range(min(2, len(r["compute_s"]))):
            comp[i] += r["compute_s"][i]
            batch[i] += r["batch_sizes"][i]
    slow = (comp[1] / batch[1]) / (comp[0] / batch[0]) if all(batch) and comp[0] > 0 else None
    return {"throughput": samples / iter_s, "oracle_throughput": samples / oracle_s,
            "late_oracle_throughput": samples / late_s, "late_oracle_wall_throughput": late_wall / iter_s,
            "s1_over_s0": slow, "starvation": longest_starved(recs, effective),
            "starvation_by_compute": longest_starved(recs, lambda rs: (s for _, s in speeds(rs))),
            "iterations": len(recs)}


def median_ci(xs, rng):
    """Median and percentile-bootstrap 95% interval of the median."""
    if not xs:
        return {"median": None, "ci": [None, None]}
    meds = sorted(st.median(rng.choices(xs, k=len(xs))) for _ in range(RESAMPLES))
    q = lambda p: meds[round(p * (RESAMPLES - 1))]
    return {"median": st.median(xs), "ci": [q(0.025), q(0.975)]}


def host():
    cpu = open("/proc/cpuinfo").read()
    model = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("model name")), "?")
    isa = sorted({f for f in ("avx512f", "avx2") if f" {f} " in cpu.replace("\n", " ")})
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    return {"model": model, "isa": isa, "cores": os.cpu_count(), "kernel": os.uname().release,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": commit}


def main():
    out = sys.argv[1]
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    rng = random.Random(seed)
    with open(f"{out}/runs.tsv") as f:
        head = f.readline().rstrip("\n").split("\t")
        rows = [dict(zip(head, l.rstrip("\n").split("\t"))) for l in f if l.strip()]
    skipped = {}
    if os.path.exists(f"{out}/skipped.tsv"):
        for l in open(f"{out}/skipped.tsv"):
            if l.strip():
                c, why = l.rstrip("\n").split("\t", 1)
                skipped[c] = why
    order = []
    for r in rows:
        if r["condition"] not in order:
            order.append(r["condition"])
    summary = {"host": host(), "seed": seed, "warmup_iterations": WARMUP, "bootstrap_resamples": RESAMPLES,
               "conditions": {c: {"skipped": why} for c, why in skipped.items()}}
    worst, worst_compute = (-1, ""), (-1, "")
    print()
    print("mnist-mlp, 2 ranks pinned one per core, rank 1 slowed; samples/s after the first "
          f"{WARMUP} iterations; medians [bootstrap 95%]")
    print(f"{'condition':<15} {'B':>5} {'pairs':>5} {'bsp/s':>7} {'lbbsp/s':>7}  {'lbbsp/bsp (A/B)':<20} "
          f"{'bsp-y/bsp-x (A/A)':<20} {'lbbsp/oracle':<20} {'s1/s0':>5} {'thrott':>6}  target")
    for cond in order:
        runs = [r for r in rows if r["condition"] == cond]
        for r in runs:
            r.update(analyse_run(f"{out}/{r['file']}"))
            for key in ("batch", "pair", "position", "nr_periods", "nr_throttled", "throttled_us"):
                r[key] = int(r[key])
            if r["policy"] == "lbbsp":
                worst = max(worst, (r["starvation"], r["file"]))
                worst_compute = max(worst_compute, (r["starvation_by_compute"], r["file"]))
        by = {(r["kind"], r["pair"], r["label"]): r for r in runs}
        pairs = sorted({r["pair"] for r in runs})
        ab = [by[("ab", k, "lbbsp")]["throughput"] / by[("ab", k, "bsp")]["throughput"] for k in pairs]
        aa = [by[("aa", k, "bspy")]["throughput"] / by[("aa", k, "bspx")]["throughput"] for k in pairs]
        lb = [r for r in runs if r["label"] == "lbbsp"]
        bs = [r for r in runs if r["label"] == "bsp"]
        oracle = [r["throughput"] / r["oracle_throughput"] for r in lb]
        # On bsp runs, where every rank is timed at the same size every iteration: what the two
        # oracles would have made of the same run, over what bsp made of it.
        ideal = [r["oracle_throughput"] / r["throughput"] for r in bs]
        late = [r["late_oracle_throughput"] / r["throughput"] for r in bs]
        late_wall = [r["late_oracle_wall_throughput"] / r["throughput"] for r in bs]
        # On lbbsp's runs: its throughput over the late oracle's on the same iterations, the best a
        # policy that learns from timings reaches without foreseeing change.
        own_late = [r["throughput"] / r["late_oracle_throughput"] for r in lb]
        periods = sum(r["nr_periods"] for r in runs)
        c = {"batch": runs[0]["batch"], "pairs": len(pairs),
             "ab_ratios": ab, "aa_ratios": aa, "ab": median_ci(ab, rng), "aa": median_ci(aa, rng),
             "oracle_ratios": oracle, "oracle": median_ci(oracle, rng),
             "bsp_oracle": median_ci(ideal, rng), "bsp_late_oracle": median_ci(late, rng),
             "bsp_late_oracle_wall": median_ci(late_wall, rng), "lbbsp_over_own_late_oracle": median_ci(own_late, rng),
             "bsp_throughput_median": st.median(r["throughput"] for r in bs),
             "lbbsp_throughput_median": st.median(r["throughput"] for r in lb),
             "bsp_s1_over_s0_median": st.median(r["s1_over_s0"] for r in bs if r["s1_over_s0"] is not None),
             "throttled_fraction": sum(r["nr_throttled"] for r in runs) / periods if periods else None,
             "throttled_s": sum(r["throttled_us"] for r in runs) / 1e6,
             "runs": [{k: r[k] for k in ("file", "policy", "kind", "pair", "position", "label", "throughput",
                                         "oracle_throughput", "late_oracle_throughput", "late_oracle_wall_throughput",
                                         "s1_over_s0", "starvation",
                                         "starvation_by_compute", "iterations",
                                         "nr_periods", "nr_throttled", "throttled_us")} for r in runs]}
        # Held splits (STATIC): each one's throughput over its pair's bsp run.
        held = sorted({r["label"] for r in runs if r["kind"] == "st"})
        c["static"] = {l[len("static-"):]: median_ci([by[("st", k, l)]["throughput"] / by[("ab", k, "bsp")]["throughput"]
                                                      for k in pairs if ("st", k, l) in by], rng) for l in held}
        # CANDIDATE: another lbbsp build against this one, pair by pair.
        cd = [by[("cd", k, "candidate")]["throughput"] / by[("cd", k, "current")]["throughput"]
              for k in pairs if ("cd", k, "candidate") in by and ("cd", k, "current") in by]
        if cd:
            c["cd_ratios"], c["cd"] = cd, median_ci(cd, rng)
        text, ok = targets(cond, c)
        c["target"], c["target_met"] = text, ok
        summary["conditions"][cond] = c
        iv = lambda d: f"{d['median']:.3f} [{d['ci'][0]:.3f}, {d['ci'][1]:.3f}]"
        thr = f"{100 * c['throttled_fraction']:5.1f}%" if c["throttled_fraction"] is not None else "-"
        verdict = "" if ok is None else ("  ok" if ok else "  MISS")
        print(f"{cond:<15} {c['batch']:>5} {len(pairs):>5} {c['bsp_throughput_median']:>7.0f} "
              f"{c['lbbsp_throughput_median']:>7.0f}  {iv(c['ab']):<20} {iv(c['aa']):<20} {iv(c['oracle']):<20} "
              f"{c['bsp_s1_over_s0_median']:>5.2f} {thr:>6}  {text}{verdict}")
        print(f"    on bsp's runs, over bsp: the empirical oracle {iv(c['bsp_oracle'])}, "
              f"the oracle one iteration late {iv(c['bsp_late_oracle'])} (wall-weighted {iv(c['bsp_late_oracle_wall'])})")
        print(f"    on lbbsp's runs, lbbsp over the oracle one iteration late: {iv(c['lbbsp_over_own_late_oracle'])}")
        if "cd" in c:
            print(f"    the candidate lbbsp over this build's (C/D): {iv(c['cd'])}")
        if c["static"]:
            print("    split held all run, rank 1's share of B, over bsp: "
                  + "; ".join(f"{share} {iv(d)}" for share, d in c["static"].items()))
    for cond, why in skipped.items():
        print(f"SKIPPED: {cond}: {why}")
    print("s1/s0: rank 1's over rank 0's seconds per sample in the bsp runs; thrott: share of the quota "
          "group's periods that were throttled")
    if worst[0] >= 0:
        print(f"longest run below half the equal-time share, every lbbsp run: {worst[0]} iterations ({worst[1]}); "
              f"by the compute's speed alone: {worst_compute[0]} ({worst_compute[1]})")
        summary["starvation"] = {"iterations": worst[0], "file": worst[1],
                                 "by_compute": {"iterations": worst_compute[0], "file": worst_compute[1]}}
    with open(f"{out}/summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    print(f"summary: {out}/summary.json")


if __name__ == "__main__":
    main()

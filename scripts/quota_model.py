#!/usr/bin/env python3
"""Two ranks under BSP with rank 1 in a CPU quota (Q ms of CPU in every P ms), iterated with the
period's phase carried from one iteration to the next: the mean iteration time for each of rank 1's
shares of B. Two readings of the quota:
- windows: rank 1 runs in [kP, kP + Q) of every period, whatever it does (a rank that busy-polls
  spends its quota while it waits);
- budget: rank 1 spends its quota on its work only (compute, update, the collective's own CPU) and
  is frozen once it has spent Q in the current period.
docs/balancer.md compares both with the real held splits of quota2ms-128.

    python3 scripts/quota_model.py [--period 2] [--quota 1] [--s0 25.6e-3] [--s1 26e-3] [--batch 128]
"""
import argparse
import random


def mean_iteration(b1, a, budget, seed=1, iterations=3000, warmup=100):
    rng = random.Random(seed)
    used = {}

    def work(t, need):
        """Wall time at which rank 1 has had `need` ms of CPU from t."""
        while need > 1e-12:
            k = int(t // a.period)
            if budget:
                left = a.quota - used.get(k, 0.0)
            else:
                left = max(0.0, a.quota - (t - k * a.period))
            if left <= 1e-12:
                t = (k + 1) * a.period
                continue
            run = min(need, left, (k + 1) * a.period - t)
            used[k] = used.get(k, 0.0) + run
            t, need = t + run, need - run
        return t

    s = total = 0.0
    for i in range(iterations):
        w0 = (a.batch - b1) * a.s0 * (1 + a.noise * rng.gauss(0, 1)) + a.update
        w1 = b1 * a.s1 * (1 + a.noise * rng.gauss(0, 1)) + a.update
        start = max(s + w0, work(s, w1))
        end = max(work(start, a.comm), start + a.comm)
        if i >= warmup:
            total += end - s
        s = end
    return total / (iterations - warmup)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--period", type=float, default=2.0, help="ms")
    p.add_argument("--quota", type=float, default=1.0, help="ms of CPU per period")
    p.add_argument("--s0", type=float, default=25.6e-3, help="rank 0's ms per sample")
    p.add_argument("--s1", type=float, default=26e-3, help="rank 1's ms of CPU per sample")
    p.add_argument("--update", type=float, default=0.25, help="ms of CPU per iteration outside the compute")
    p.add_argument("--comm", type=float, default=0.25, help="ms of the collective, both ranks running")
    p.add_argument("--noise", type=float, default=0.05, help="relative deviation of the compute")
    p.add_argument("--batch", type=int, default=128)
    a = p.parse_args()
    print(f"{'b1':>4} {'windows ms':>11} {'budget ms':>10}")
    for b1 in range(8, a.batch // 2 + 1, 4):
        print(f"{b1:>4} {mean_iteration(b1, a, False):>11.2f} {mean_iteration(b1, a, True):>10.2f}")


if __name__ == "__main__":
    main()

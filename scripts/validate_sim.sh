#!/usr/bin/env bash
# The simulator against real runs (docs/simulator.md, "Validation"), in one go on a 2-core machine:
#   1. records mnist-mlp on 2 ranks (pinned one per core) and 3 ranks (oversubscribed, unpinned),
#      bsp and lbbsp each, under `lbbsp interfere` on core 1: steady, a square wave and a load
#      trace;
#   2. replays each run in the simulator: `lbbsp simulate --calibrate RUN.jsonl` writes a scenario
#      with the run's compute line, its cost outside compute and the run as a `trace`
#      interference, and `lbbsp simulate` runs the simulator's own policies on it;
#   3. prints measured against simulated mean iteration time per run and policy, and fails if a
#      ratio is outside [0.95, 1.05]. Cross-replays (the bsp run's trace driving the simulated
#      lbbsp and the reverse, against the real run of the other policy) are printed but not gated:
#      they compare two runs, and a steady bsp run recorded twice shows how far two runs differ.
#   ITERS=300 BATCH=2400 PERIOD=2 scripts/validate_sim.sh
# BATCH must divide MNIST's 60,000 training samples (no short last batch, which the simulator
# does not have) and split evenly over 2 and 3 ranks.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
iters="${ITERS:-300}"; batch="${BATCH:-2400}"; period="${PERIOD:-2}"
out="runs/validate-sim"; mkdir -p "$out"
cargo build --release --locked -q
bin=target/release/lbbsp
echo "validate_sim: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2

# A load trace for `lbbsp interfere --pattern trace --loop`: idle, full, half, idle, every 8 s.
cat >"$out/load.trace" <<'EOF'
# time_s load
0 0
2 1
4 0.5
6 0
8 0
EOF

hog=""
stop_hog() { if [ -n "$hog" ]; then kill "$hog" 2>/dev/null || true; wait "$hog" 2>/dev/null || true; hog=""; fi; }
trap stop_hog EXIT

record() {  # record RANKS PATTERN POLICY [SUFFIX]: one training run under the pattern on core 1
  local n=$1 pattern=$2 policy=$3 name="$1r-$2-$3${4:-}" mpi args
  case $pattern in
    steady) args=() ;;
    square) args=(--pattern square --on "$period" --off "$period") ;;
    trace) args=(--pattern trace --trace "$out/load.trace" --loop) ;;
  esac
  if [ "$n" -eq 2 ]; then
    # One rank per core; waiting ranks poll instead of yielding their core to the hog.
    mpi=(env OMPI_MCA_mpi_yield_when_idle=0 mpirun -n 2 --map-by core --bind-to core)
  else
    # More ranks than cores: unpinned, and a waiting rank yields.
    mpi=(env OMPI_MCA_mpi_yield_when_idle=1 mpirun -n "$n" --oversubscribe --bind-to none)
  fi
  "$bin" interfere --cores 1 "${args[@]}" 2>/dev/null & hog=$!
  sleep 0.3
  "${mpi[@]}" "$bin" train mnist-mlp -q --threads 1 --metrics "$out/$name.jsonl" --summary "$out/$name.json" \
    --set "balance.policy=$policy" --set "train.max_iters=$iters" --set "train.global_batch=$batch" \
    --set train.epochs=1000 --set train.eval_every_epochs=1000 >/dev/null
  stop_hog
  "$bin" simulate --calibrate "$out/$name.jsonl" >"$out/$name.toml"
  "$bin" simulate "$out/$name.toml" --json "$out/$name.sim.json" >/dev/null
  echo "validate_sim: $name recorded and replayed" >&2
}

start=$(date +%s)
for n in 2 3; do
  for pattern in steady square trace; do
    for policy in bsp lbbsp; do record "$n" "$pattern" "$policy"; done
  done
  # The same run again: how far apart two runs are, the floor of a cross-replay.
  record "$n" steady bsp -again
done
echo "validate_sim: $(( $(date +%s) - start )) s" >&2

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def measured(name):
    recs = [json.loads(l) for l in open(f"{out}/{name}.jsonl") if l.strip()]
    return sum(r["iter_s"] for r in recs) / len(recs)
def simulated(name, policy):
    sim = json.load(open(f"{out}/{name}.sim.json"))
    return next(p["mean_iter_s"] for p in sim["policies"] if p["policy"] == policy)
rows, failed = [], []
for n in (2, 3):
    for pattern in ("steady", "square", "trace"):
        run = f"{n}r-{pattern}"
        for policy, trace in (("bsp", "bsp"), ("lbbsp", "lbbsp"), ("lbbsp", "bsp"), ("bsp", "lbbsp")):
            m, s = measured(f"{run}-{policy}"), simulated(f"{run}-{trace}", policy)
            gated = policy == trace
            rows.append((run, policy if gated else f"{policy} ({trace} trace)", m, s, s / m, gated))
            if gated and not 0.95 <= s / m <= 1.05:
                failed.append(f"{run} {policy}")
print(f"{'run':<10} {'policy':<18} {'measured s':>10} {'simulated s':>11} {'ratio':>6}")
for run, policy, m, s, r, gated in rows:
    print(f"{run:<10} {policy:<18} {m:>10.4f} {s:>11.4f} {r:>6.3f}{'' if gated else '  (cross-replay, not gated)'}")
for n in (2, 3):
    a, b = measured(f"{n}r-steady-bsp"), measured(f"{n}r-steady-bsp-again")
    print(f"run to run: {n}r-steady bsp twice, {a:.4f} s then {b:.4f} s ({b / a:.3f})")
if failed:
    sys.exit(f"validate_sim: simulated/measured outside [0.95, 1.05] for {', '.join(failed)}")
print("validate_sim: every replay within 5% of the measured mean iteration time")
PY

#!/usr/bin/env bash
# LB-BSP against BSP under co-located interference, as a paired measurement: mnist-mlp on 2 ranks
# pinned one per core (rank 1 on core 1), with rank 1 slowed in one of these conditions:
#   quota2ms-128    rank 1's process under a 50% CPU quota, 1 ms of every 2 ms (cgroup cpu), B = 128
#   quota2ms-2048   the same, B = 2048
#   quota100ms-128  a 50% quota at a 100 ms period (50 ms of every 100 ms), B = 128
#   hog-2048        a steady CPU hog on core 1 (`lbbsp interfere --cores 1`), B = 2048
#   bursty-2048     a bursty job on core 1: a seeded random trace of 0.1-0.55 s on, 0.1-0.55 s off,
#                   looped, B = 2048
#   quiet-128       nothing interferes, B = 128
#   hog-128         a steady hog, B = 128 (validation of the simulator only, no target)
# Each condition runs PAIRS A/B pairs (bsp, lbbsp) and as many A/A pairs (bsp-x, bsp-y), the two
# kinds interleaved and each pair's run order drawn from a RNG seeded by SEED and the condition, so
# that the host's drift hits both sides alike and the schedule is reproducible. An interferer is
# started with each run, so that every run meets its pattern from the start. The A/A pairs measure
# the noise floor of the paired ratio on this host.
# Throughput per run is Σ B / Σ iteration time over the iterations after the first 20 (warm-up and
# lbbsp's probes). scripts/paired.py prints per condition the median paired ratio with a bootstrap
# 95% interval (A/B and A/A), lbbsp's throughput over the empirical oracle (each iteration split
# by the ranks' measured speeds in it), the longest starvation of any lbbsp run and the targets of
# the balancer issue, and writes runs/bench-interference/summary.json. The per-run metrics JSONL
# files stay in runs/bench-interference/ for `lbbsp simulate --calibrate RUN.jsonl`.
# The quota conditions need a writable cgroup cpu controller (v1 cpu.cfs_quota_us or v2 cpu.max,
# i.e. root); without one they are reported SKIPPED and the others still run.
#   PAIRS=10 scripts/bench_interference.sh
#   CONDITIONS=quota2ms-128 PAIRS=3 ITERS_SMALL=300 scripts/bench_interference.sh
# Environment: OUT (the folder, runs/bench-interference), CONDITIONS (names above, default all),
# PAIRS (10), SEED (1), ITERS_SMALL
# (iterations at B < 1024, 1500), ITERS_LARGE (at B >= 1024, 300), BUILD=0 to skip the cargo build,
# STATIC (rank 1's shares of B, e.g. "0.2 0.25 0.33", default none): in each pair, after its A/B and
# A/A blocks, one run per share that holds that split all run long (bsp with `balance.replay`), and
# paired.py prints each one's ratio to the pair's bsp run: the best split held in hindsight, which a
# balancer that found and kept it would match.
# CANDIDATE (another build of lbbsp, e.g. a balancer change built into another target folder): in
# each pair, a third block of two lbbsp runs, this build's and the candidate's, in random order;
# paired.py prints the candidate's throughput over this build's (C/D) with its interval, so that
# two balancers are compared within one series, as the A/A pairs measure the floor.
set -euo pipefail
# mpirun's entry for each rank of a quota condition: rank 1 writes its own PID into the group
# and exec keeps that PID, so the group holds rank 1's process (and the threads it starts) and
# nothing else.
if [ "${1:-}" = "--rank-entry" ]; then
  procs=$2; shift 2
  if [ "${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-}}" = 1 ]; then echo $$ >"$procs"; fi
  exec "$@"
fi
self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

all="quota2ms-128 quota2ms-2048 quota100ms-128 hog-2048 bursty-2048 quiet-128 hog-128"
conditions="${CONDITIONS:-$all}"
pairs="${PAIRS:-10}"; seed="${SEED:-1}"
iters_small="${ITERS_SMALL:-1500}"; iters_large="${ITERS_LARGE:-300}"
for c in $conditions; do
  case " $all " in *" $c "*) ;; *) echo "unknown condition '$c' (known: $all)" >&2; exit 2 ;; esac
done
for share in ${STATIC:-}; do
  if ! python3 -c 'import sys; x = float(sys.argv[1]); sys.exit(not 0 < x < 1)' "$share" 2>/dev/null; then
    echo "STATIC: '$share' is not a share of the batch strictly between 0 and 1 (e.g. STATIC=\"0.25 0.33\")" >&2; exit 2
  fi
done
echo "host: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
echo "isa: $(grep -o 'avx512f\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "cores: $(nproc); kernel $(uname -r); $(date -Is); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
out="${OUT:-runs/bench-interference}"; rm -rf "$out"; mkdir -p "$out"
if [ "${BUILD:-1}" != 0 ]; then cargo build --release --locked -q; fi
bin=target/release/lbbsp
candidate="${CANDIDATE:-}"
if [ -n "$candidate" ] && [ ! -x "$candidate" ]; then
  echo "CANDIDATE: '$candidate' is not an executable lbbsp build (build one with CARGO_TARGET_DIR=... cargo build --release)" >&2
  exit 2
fi
# One rank per core: waiting ranks poll instead of yielding their core to the interference.
export OMPI_MCA_mpi_yield_when_idle=0

run_pid=""; hog_pid=""; cg_dir=""; cg_kind=""
cleanup() {
  local left
  set +e
  if [ -n "$run_pid" ]; then kill "$run_pid" 2>/dev/null; wait "$run_pid" 2>/dev/null; fi
  if [ -n "$hog_pid" ]; then kill "$hog_pid" 2>/dev/null; wait "$hog_pid" 2>/dev/null; fi
  if [ -n "$cg_dir" ] && [ -d "$cg_dir" ]; then
    # Only rank 1 of this script's own runs can be in the group: one still there outlived mpirun.
    for _ in $(seq 50); do
      left=$(cat "$cg_dir/cgroup.procs" 2>/dev/null)
      [ -z "$left" ] && break
      # shellcheck disable=SC2086
      kill $left 2>/dev/null; sleep 0.1
    done
    rmdir "$cg_dir" 2>/dev/null || echo "warning: could not remove $cg_dir" >&2
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The quota group, directly under the root of the hierarchy that has the cpu controller. On v2,
# +cpu stays enabled in the root's subtree_control afterwards: turning it off again would drop
# the cpu limits of any other group that started using it meanwhile.
cg_setup() {
  local name root
  name="lbbsp-bench-$$-$(date +%s)"
  root=$(awk '$3 == "cgroup" && $4 ~ /(^|,)cpu(,|$)/ { print $2; exit }' /proc/mounts)
  if [ -n "$root" ] && mkdir "$root/$name" 2>/dev/null; then
    if { echo -1 >"$root/$name/cpu.cfs_quota_us"; } 2>/dev/null; then
      cg_kind=v1; cg_dir="$root/$name"; return 0
    fi
    rmdir "$root/$name"
  fi
  root=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
  if [ -n "$root" ] && grep -qw cpu "$root/cgroup.controllers" 2>/dev/null; then
    grep -qw cpu "$root/cgroup.subtree_control" || { echo +cpu >"$root/cgroup.subtree_control"; } 2>/dev/null || true
    if mkdir "$root/$name" 2>/dev/null; then
      if [ -f "$root/$name/cpu.max" ] && { echo max >"$root/$name/cpu.max"; } 2>/dev/null; then
        cg_kind=v2; cg_dir="$root/$name"; return 0
      fi
      rmdir "$root/$name"
    fi
  fi
  return 1
}
cg_limit() {  # cg_limit QUOTA_US PERIOD_US
  if [ "$cg_kind" = v1 ]; then
    # Lift the quota first: the kernel rejects a period that the current quota does not fit.
    echo -1 >"$cg_dir/cpu.cfs_quota_us"; echo "$2" >"$cg_dir/cpu.cfs_period_us"; echo "$1" >"$cg_dir/cpu.cfs_quota_us"
  else
    echo "$1 $2" >"$cg_dir/cpu.max"
  fi
}
cg_stat() {  # periods, throttled periods, throttled µs so far (v1 counts ns, v2 µs)
  if [ -z "$cg_dir" ] || [ "$quota_us" -eq 0 ]; then echo "0 0 0"; return; fi
  awk '$1 == "nr_periods" { p = $2 } $1 == "nr_throttled" { n = $2 }
       $1 == "throttled_time" { t = $2 / 1000 } $1 == "throttled_usec" { t = $2 }
       END { printf "%d %d %d\n", p, n, t }' "$cg_dir/cpu.stat"
}
case " $conditions " in
  *" quota"*)
    if cg_setup; then echo "quota group: cgroup $cg_kind, $cg_dir"; else echo "quota group: none writable"; fi ;;
esac

# Bursts of 0.1-0.55 s on, 0.1-0.55 s off from a seeded random trace, looped.
python3 - "$out/bursts.trace" "$seed" <<'PY'
import random, sys
random.seed(int(sys.argv[2]))
t, lines = 0.0, []
while t < 600:
    lines.append(f"{t:.3f} 1"); t += random.uniform(0.1, 0.55)
    lines.append(f"{t:.3f} 0"); t += random.uniform(0.1, 0.55)
lines.append(f"{t:.3f} 0")
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
PY

printf 'condition\tbatch\tkind\tpair\tposition\tlabel\tpolicy\tfile\tnr_periods\tnr_throttled\tthrottled_us\n' >"$out/runs.tsv"
: >"$out/skipped.tsv"
run_one() {  # run_one CONDITION BATCH KIND PAIR POSITION LABEL
  local cond=$1 batch=$2 kind=$3 k=$4 pos=$5 label=$6 policy=bsp name iters p0 n0 t0 p1 n1 t1 held=()
  local exe=$bin
  case $label in lbbsp | current) policy=lbbsp ;; candidate) policy=lbbsp; exe=$candidate ;; esac
  name="$cond-p$(printf %02d "$k")-$kind-$label"
  iters=$iters_small; [ "$batch" -ge 1024 ] && iters=$iters_large
  if [ "$kind" = st ]; then held=(--set "balance.replay=$out/$cond-$label.replay.jsonl"); fi
  local entry=()
  [ "$quota_us" -gt 0 ] && entry=(bash "$self" --rank-entry "$cg_dir/cgroup.procs")
  read -r p0 n0 t0 <<<"$(cg_stat)"
  if [ ${#interfere[@]} -gt 0 ]; then "$bin" interfere --cores 1 "${interfere[@]}" >/dev/null 2>&1 & hog_pid=$!; fi
  mpirun -n 2 --map-by core --bind-to core "${entry[@]}" "$exe" train mnist-mlp -q --threads 1 \
    --set "train.max_iters=$iters" --set train.epochs=1000 --set train.eval_every_epochs=1000 \
    --set "train.global_batch=$batch" --set "balance.policy=$policy" "${held[@]}" --metrics "$out/$name.jsonl" >/dev/null &
  run_pid=$!; wait "$run_pid"; run_pid=""
  if [ -n "$hog_pid" ]; then kill "$hog_pid" 2>/dev/null || true; wait "$hog_pid" 2>/dev/null || true; hog_pid=""; fi
  read -r p1 n1 t1 <<<"$(cg_stat)"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$cond" "$batch" "$kind" "$k" "$pos" "$label" "$policy" \
    "$name.jsonl" $((p1 - p0)) $((n1 - n0)) $((t1 - t0)) >>"$out/runs.tsv"
}

index=0
for cond in $all; do
  index=$((index + 1))
  case " $conditions " in *" $cond "*) ;; *) continue ;; esac
  quota_us=0; period_us=0; interfere=()
  case $cond in
    quota2ms-128) batch=128; quota_us=1000; period_us=2000 ;;
    quota2ms-2048) batch=2048; quota_us=1000; period_us=2000 ;;
    quota100ms-128) batch=128; quota_us=50000; period_us=100000 ;;
    hog-2048) batch=2048; interfere=(--load 1) ;;
    bursty-2048) batch=2048; interfere=(--pattern trace --trace "$out/bursts.trace" --loop) ;;
    quiet-128) batch=128 ;;
    hog-128) batch=128; interfere=(--load 1) ;;
  esac
  if [ "$quota_us" -gt 0 ]; then
    if [ -z "$cg_dir" ]; then
      reason="no writable cgroup cpu controller (v1 cpu.cfs_quota_us or v2 cpu.max)"
      echo "SKIPPED: $cond: $reason"
      printf '%s\t%s\n' "$cond" "$reason" >>"$out/skipped.tsv"
      continue
    fi
    cg_limit "$quota_us" "$period_us"
  fi
  echo "running $cond: $pairs A/B and $pairs A/A pairs" >&2
  # Seeded per condition, so that a condition's schedule does not depend on which others run.
  RANDOM=$((seed * 100 + index))
  for k in $(seq "$pairs"); do
    blocks=(ab aa); if ((RANDOM % 2)); then blocks=(aa ab); fi
    if [ -n "$candidate" ]; then
      blocks+=(cd); r=$((RANDOM % 3)); blocks=("${blocks[@]:r}" "${blocks[@]:0:r}")
    fi
    for kind in "${blocks[@]}"; do
      case $kind in ab) labels=(bsp lbbsp) ;; aa) labels=(bspx bspy) ;; cd) labels=(current candidate) ;; esac
      if ((RANDOM % 2)); then labels=("${labels[1]}" "${labels[0]}"); fi
      run_one "$cond" "$batch" "$kind" "$k" 1 "${labels[0]}"
      run_one "$cond" "$batch" "$kind" "$k" 2 "${labels[1]}"
    done
    position=0
    for share in $(printf '%s\n' ${STATIC:-} | shuf --random-source=<(yes "$seed$k")); do
      label="static-$share"; position=$((position + 1))
      # The held split, iteration by iteration (an epoch's short last batch too), from the sizes of
      # the pair's bsp run: rank 1 gets `share` of each batch.
      [ -f "$out/$cond-$label.replay.jsonl" ] || python3 -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); b = r["global_batch"]; x = min(max(round(float(sys.argv[2]) * b), 1), b - 1)
    print(json.dumps({**r, "batch_sizes": [b - x, x]}))' "$out/$cond-p$(printf %02d "$k")-ab-bsp.jsonl" "$share" \
        >"$out/$cond-$label.replay.jsonl"
      run_one "$cond" "$batch" st "$k" "$position" "$label"
    done
  done
done

python3 "$(dirname "$self")/paired.py" "$out" "$seed"

#!/usr/bin/env bash
# Shows that a change kept behaviour: the loss trajectories of this checkout and of BASE (a git
# revision) are bitwise equal, on this host and tier.
#
#   scripts/same_trajectory.sh BASE        e.g. scripts/same_trajectory.sh 66316ae
#
# Runs, each on both builds and on every kernel tier this CPU has (`lbbsp isa`; TIERS="avx2"
# narrows it):
#   every shipped recipe in models/, 1 rank (40 iterations; digits-mlp 200);
#   digits-mlp, 3 ranks under mpirun, policy lbbsp with rank 1 slowed 3× from iteration 20 (200
#     iterations). A balanced split follows the run's timings, so this checkout replays BASE's
#     batch sizes (`balance.replay`) and must then give BASE's losses exactly.
# BASE is built in a worktree under target/same-trajectory (its own target folder, reused) by
# scripts/build_base.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: scripts/same_trajectory.sh BASE_REVISION}
data=${LBBSP_DATA:-../shared/datasets}
work=target/same-trajectory
scripts/build_base.sh "$base" "$work"
old=$work/target/release/lbbsp
new=target/release/lbbsp
mpi=(mpirun -n 3 --oversubscribe)
common=(--data-dir "$data" -q)

compare() {  # NAME BASE.jsonl NEW.jsonl
  python3 - "$@" <<'EOF'
import json, sys
name, a, b = sys.argv[1:4]
ra = [json.loads(l) for l in open(a) if l.strip()]
rb = [json.loads(l) for l in open(b) if l.strip()]
bad = [i for i, (x, y) in enumerate(zip(ra, rb)) if x["loss"] != y["loss"] or x["batch_sizes"] != y["batch_sizes"]]
if len(ra) != len(rb) or bad or not ra:
    first = bad[0] if bad else min(len(ra), len(rb))
    print(f"same_trajectory: {name}: DIFFERENT ({len(ra)} vs {len(rb)} iterations; first difference at {first})")
    sys.exit(1)
print(f"same_trajectory: {name}: {len(ra)} iterations, losses and batch sizes bitwise equal")
EOF
}

status=0
run_both() {  # NAME LAUNCH... -- ARGS...
  local name=$1; shift
  local launch=()
  while [ "$1" != "--" ]; do launch+=("$1"); shift; done
  shift
  "${launch[@]}" "$old" train "$@" "${common[@]}" --metrics "$work/$name.base.jsonl"
  local extra=()
  case $name in digits-mlp-3-ranks*) extra=(--set "balance.replay=$work/$name.base.jsonl") ;; esac
  "${launch[@]}" "$new" train "$@" "${extra[@]}" "${common[@]}" --metrics "$work/$name.new.jsonl"
  compare "$name" "$work/$name.base.jsonl" "$work/$name.new.jsonl" || status=1
}

tiers=${TIERS:-$("$new" isa | sed -n 's/.*available=//p' | tr , ' ')}
for isa in $tiers; do
  export LBBSP_ISA=$isa
  for recipe in models/*.toml; do
    r=$(basename "$recipe" .toml)
    iters=40
    [ "$r" = digits-mlp ] && iters=200
    run_both "$r-1-rank-$isa" -- "$recipe" --set balance.policy=lbbsp --set train.max_iters=$iters
  done
  run_both "digits-mlp-3-ranks-$isa" "${mpi[@]}" -- digits-mlp --threads 1 --set balance.policy=lbbsp \
    --set train.max_iters=200 --slowdown 1:3@20
done
exit $status

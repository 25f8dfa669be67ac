#!/usr/bin/env bash
# Gradient synchronisation cost under mpirun: lbbsp's one-collective sync (gradient + stats) against
# a bare MPI_Allreduce of the same buffer, for the W1 MLP and LeNet-5 gradients (benches/sync.rs).
#   RANKS=2 REPS=400 scripts/bench_sync.sh
# Two ranks on the 2-core reference machine: one per core, bound, polling while they wait.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
ranks="${RANKS:-2}"
bin=$(cargo bench --locked --bench sync --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "sync" and m.get("executable"):
        print(m["executable"])')
REPS="${REPS:-400}" mpirun -n "$ranks" --map-by core --bind-to core -x REPS "$bin"

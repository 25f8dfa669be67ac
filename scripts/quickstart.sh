#!/usr/bin/env bash
# The main job: build lbbsp and train mnist-mlp data-parallel on 2 MPI ranks (BSP), ending with the
# test accuracy. Extra arguments go to `lbbsp train` (e.g. --set balance.policy=lbbsp).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
ranks="${RANKS:-2}"
cargo build --release --locked
./target/release/lbbsp data fetch mnist   # verifies checksums; downloads only what is missing
mkdir -p runs
mpirun -n "$ranks" ./target/release/lbbsp train mnist-mlp --summary runs/mnist-mlp.summary.json \
  --metrics runs/mnist-mlp.metrics.jsonl "$@"

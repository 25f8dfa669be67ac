#!/usr/bin/env bash
# Installs what is missing and runs the whole test suite: unit tests, integration tests, the
# mpirun tier (real `mpirun -n 2` and `-n 3 --oversubscribe`), examples and benches (compiled and
# run once in test mode).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cargo run --release --locked -q -- data fetch all   # verify checksums; download what is missing
cargo test --release --locked --all-targets
cargo build --release --locked --examples
mpirun -n 2 ./target/release/examples/custom_loop

#!/usr/bin/env bash
# Installs what is missing and runs the whole test suite: unit tests, integration tests, the
# mpirun tier (real `mpirun -n 2` and `-n 3 --oversubscribe`), examples and benches (compiled and
# run once in test mode).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cargo run --release --locked -q -- data fetch all   # verify checksums; download what is missing
cargo test --release --locked --all-targets
# Kernel numerics loop over the tiers inside the unit tests, and tests/isa.rs trains on each; the
# in-process gradient checks and allocation test run once more on every further tier this CPU has.
set -- $(./target/release/lbbsp isa | sed -n 's/.*available=//p' | tr , ' ')
shift   # the best tier, which the run above used
for isa in "$@"; do
  echo "test: gradient checks and allocation test on the $isa tier" >&2
  LBBSP_ISA=$isa cargo test --release --locked -q --test gradcheck --test alloc
done
cargo build --release --locked --examples
mpirun -n 2 ./target/release/examples/custom_loop

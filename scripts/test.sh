#!/usr/bin/env bash
# Installs what is missing and runs the whole test suite: the library without MPI, unit tests,
# integration tests, the mpirun tier (real `mpirun -n 2` and `-n 3 --oversubscribe`), examples and
# benches (compiled and run once in test mode).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The library without MPI (no OpenMPI or libclang needed): its single-process tests run first, on a
# fresh machine before set-up installs either (after it, where set-up must install Rust too).
without_mpi() { cargo test --release --locked --no-default-features; }
if command -v cargo >/dev/null 2>&1; then without_mpi; tested=1; fi
source scripts/setup.sh
[ -n "${tested:-}" ] || without_mpi
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

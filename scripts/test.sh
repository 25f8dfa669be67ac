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
# The mpirun and Slurm tiers' measurements (times from a signal to exit and from a requeue to the
# first resumed iteration, kills, two hosts), printed after the run.
export LBBSP_TEST_REPORT="${TMPDIR:-/tmp}/lbbsp-test-report-$$.txt"
rm -f "$LBBSP_TEST_REPORT"
cargo test --release --locked --all-targets
echo "test: measurements of the mpirun and Slurm tiers:" >&2
cat "$LBBSP_TEST_REPORT" >&2 || true
rm -f "$LBBSP_TEST_REPORT"
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
# A model defined in the example's own code, trained by Run under LB-BSP, resumed bit for bit from its
# checkpoint; its safetensors file read back in Python under the example's names.
out="${TMPDIR:-/tmp}/lbbsp-custom-model-$$"
mpirun -n 2 ./target/release/examples/custom_model --out "$out"
python3 tests/python/read_safetensors.py "$out/custom_model.safetensors" \
  hidden.weight=32,64 hidden.bias=32 out.weight=10,32 out.bias=10
rm -rf "$out"

#!/usr/bin/env bash
# Builds `lbbsp` of BASE (a git revision) in a worktree WORK/base with its own target folder
# WORK/target (reused between calls), and of this checkout: the two binaries that a comparison
# against a base revision runs (scripts/same_trajectory.sh, scripts/bench_ab.sh).
#
#   scripts/build_base.sh BASE WORK     → WORK/target/release/lbbsp and target/release/lbbsp
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: scripts/build_base.sh BASE_REVISION WORK_DIR}
work=${2:?usage: scripts/build_base.sh BASE_REVISION WORK_DIR}
mkdir -p "$work"
rev=$(git rev-parse --verify "$base^{commit}")
if [ ! -d "$work/base" ]; then
  git worktree add -f --detach "$work/base" "$rev" >/dev/null
else
  git -C "$work/base" checkout -q --detach "$rev"
fi
echo "$(basename "$work"): building $rev and this checkout" >&2
(cd "$work/base" && CARGO_TARGET_DIR=../target cargo build --release -q --bin lbbsp)
cargo build --release -q --bin lbbsp

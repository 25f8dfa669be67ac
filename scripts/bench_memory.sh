#!/usr/bin/env bash
# Memory stays flat over a long run: peak RSS of a short and a 200× longer digits-mlp run (one
# process, per-iteration metrics streamed to a file), in one go, and their ratio.
#   scripts/bench_memory.sh            (SHORT=100 LONG=20000 to change the lengths)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
short="${SHORT:-100}"; long="${LONG:-20000}"
cargo build --release --locked -q
out="runs/bench-memory"; mkdir -p "$out"
peak_kb() {  # peak_kb ITERS: the run's peak resident set, KiB
  /usr/bin/time -f %M target/release/lbbsp train digits-mlp -q --threads 1 --set train.epochs=100000 \
    --set train.eval_every_epochs=100000 --set "train.max_iters=$1" --metrics "$out/m$1.jsonl" 2>&1 >/dev/null | tail -1
}
a=$(peak_kb "$short"); b=$(peak_kb "$long")
echo "bench_memory: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "peak RSS: $short iterations $a KiB, $long iterations $b KiB ($(wc -l <"$out/m$long.jsonl") records written), ratio $(python3 -c "print(f'{$b / $a:.3f}')")"

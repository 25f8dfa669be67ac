#!/usr/bin/env bash
# lbbsp against the frameworks a user would pick instead, back to back on this machine, as ratios.
#   W1 = MLP 784-512-256-10 (batch 128), W2 = LeNet-5 without padding (batch 64), SGD lr 0.05
#   momentum 0.9 on 60,000 random MNIST-shaped samples, samples/s over iterations 20-200:
#   - lbbsp in one process with 2 threads, and under `mpirun -n 2` with 1 thread per rank (global
#     batch split across the ranks), through the real training loop (`lbbsp bench w1|w2`);
#   - the peers of ../shared/peers (numpy by hand, PyTorch, PyTorch DDP over gloo on 2 ranks, JAX,
#     TensorFlow; each makes its own venv under $PEER_VENVS, default /tmp, the first time);
#   - GEMM GFLOP/s of lbbsp (`lbbsp bench gemm`) against numpy's OpenBLAS on 2048^3 and on W1's
#     layer shapes; peak memory of the lbbsp runs against what they must hold.
# Prints a markdown table of medians over ROUNDS rounds (each round runs everything once, in turn),
# then every round's own ratios with their median.
#   scripts/bench_peers.sh                          # everything, 1 round
#   ROUNDS=5 PEERS="numpy torch" scripts/bench_peers.sh
#   ISA=avx2 scripts/bench_peers.sh                 # lbbsp's AVX2 tier against peers held to AVX2
# PEERS is a subset of "numpy torch torch-ddp jax tf" (numpy includes the GEMM reference).
# ISA (default auto: each side's best for this CPU) = avx2 forces lbbsp's AVX2 tier and holds the
# peers to AVX2: OpenBLAS's Haswell kernels (OPENBLAS_CORETYPE), oneDNN (ONEDNN_MAX_CPU_ISA, for
# PyTorch's convolutions and TensorFlow), MKL (MKL_ENABLE_INSTRUCTIONS, PyTorch's GEMM on Intel) and
# XLA's code generation (--xla_cpu_max_isa, JAX). The header says which comparison a table is.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" 2>/dev/null
peers_dir="${PEERS_DIR:-../shared/peers}"
peers="${PEERS:-numpy torch torch-ddp jax tf}"
rounds="${ROUNDS:-1}"
out="runs/bench-peers"; rm -rf "$out"; mkdir -p "$out"
cargo build --release --locked -q
isa="${ISA:-auto}"
bin="target/release/lbbsp --isa $isa"
has() { [[ " $peers " == *" $1 "* ]]; }
numpy_py="${PEER_VENVS:-/tmp}/lbbsp-peer-numpy/bin/python"
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
case "$isa" in
  auto) held="peers on their own best code paths for this CPU" ;;
  avx2)
    # ../shared/peers/run lets OpenBLAS detect the core, so numpy runs from its venv directly.
    export ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 XLA_FLAGS="--xla_cpu_max_isa=AVX2"
    held="peers held to AVX2 (OPENBLAS_CORETYPE=Haswell, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2, XLA_FLAGS=--xla_cpu_max_isa=AVX2)" ;;
  *) echo "bench_peers: ISA=$isa: use auto or avx2" >&2; exit 2 ;;
esac
# run_numpy SCRIPT: a numpy benchmark on the OpenBLAS kernels the comparison asks for.
run_numpy() {
  [ -x "$numpy_py" ] || "$peers_dir/run" numpy mlp >/dev/null 2>&1 || true   # makes the venv once
  if [ "$isa" = avx2 ]; then OPENBLAS_CORETYPE=Haswell "$numpy_py" "$@"; else "$numpy_py" "$@"; fi
}

# record KEY < OUTPUT: appends the samples_per_s / gflops_median of each RESULT line to $out/KEY,
# and `ROUND VALUE` to $out/KEY.rounds (for the per-round ratios).
record() {
  local key=$1 text
  text=$(cat)
  echo "$text" >>"$out/log"
  local v
  v=$(echo "$text" | grep '^RESULT' | grep -o -E '(samples_per_s|gflops_median)=[0-9.]+' | head -1 | cut -d= -f2 || true)
  if [ -n "$v" ]; then
    echo "$v" >>"$out/$key"
    echo "${round:-1} $v" >>"$out/$key.rounds"
  else
    echo "bench_peers: $key gave no RESULT (see $out/log)" >&2
  fi
}
# One RESULT line per GEMM shape: $out/gemm-WHO-SHAPE.
record_gemm() {
  local who=$1
  tee -a "$out/log" | grep '^RESULT gemm=' | while read -r line; do
    local shape v
    shape=$(echo "$line" | grep -o 'shape=[^ ]*' | cut -d= -f2)
    v=$(echo "$line" | grep -o 'gflops_median=[0-9.]*' | cut -d= -f2)
    echo "$v" >>"$out/gemm-$who-${shape:-square-2048}"
  done
}

run_lbbsp() {
  for w in w1 w2; do
    $bin bench "$w" --threads 2 2>&1 | tee -a "$out/memory" | record "lbbsp-$w" || true
    mpirun -n 2 $bin bench "$w" --threads 1 2>&1 | record "lbbsp2-$w" || true
  done
}
run_peers() {
  for m in mlp cnn; do
    local w
    w=$([ $m = mlp ] && echo w1 || echo w2)
    if has numpy && [ $m = mlp ]; then run_numpy "$peers_dir/bench_numpy.py" 2>&1 | record "numpy-$w" || true; fi
    if has torch; then "$peers_dir/run" torch $m 2>&1 | record "torch-$w" || true; fi
    if has torch-ddp; then "$peers_dir/run" torch-ddp $m 2>&1 | record "torch-ddp-$w" || true; fi
    if has jax; then "$peers_dir/run" jax $m 2>&1 | record "jax-$w" || true; fi
    if has tf; then "$peers_dir/run" tf $m 2>&1 | record "tf-$w" || true; fi
  done
}

for round in $(seq "$rounds"); do
  echo "bench_peers: round $round/$rounds" >&2
  # lbbsp first in odd rounds, last in even ones: the host's slow phases last minutes, so a fixed
  # order would hand them to the same side every round.
  if [ $((round % 2)) = 1 ]; then run_lbbsp; run_peers; else run_peers; run_lbbsp; fi
  $bin bench gemm 2>&1 | record_gemm lbbsp || true
  if has numpy; then
    run_numpy "$peers_dir/gemm_numpy.py" 2>&1 | record_gemm numpy || true
    run_numpy scripts/gemm_numpy_shapes.py 2>&1 | record_gemm numpy || true
  fi
done

# median KEY: the median of $out/KEY, or empty.
median() {
  [ -s "$out/$1" ] || return 0
  sort -g "$out/$1" | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
num() { if [ -n "$1" ]; then printf "%'.0f" "$1"; else printf '–'; fi; }
ratio() { if [ -n "$1" ] && [ -n "$2" ]; then awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f×", a / b }'; else printf '–'; fi; }

cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
flags=$(grep -o -w 'avx512f\|avx2\|fma' /proc/cpuinfo | sort -u | tr '\n' ' ')
tier=$($bin isa | sed -n 's/.*active=\([a-z0-9]*\).*/\1/p')
echo
echo "$(date -u +%Y-%m-%d), $cpu ($flags), $(nproc) cores; lbbsp kernels: $tier tier; $held; medians of $rounds round(s); samples/s"
echo
echo "| workload | lbbsp (1 process, 2 threads) | lbbsp (mpirun -n 2, 1 thread each) | numpy | torch | torch-ddp (2 ranks) | jax | tf | lbbsp / best peer | 2-rank lbbsp / torch-ddp | 2-rank / 1-process |"
echo "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
for w in w1 w2; do
  l=$(median lbbsp-$w); l2=$(median lbbsp2-$w)
  best=""; row=""
  for p in numpy torch torch-ddp jax tf; do
    v=$(median $p-$w)
    row+=" $(num "$v") |"
    if [ -n "$v" ] && [ "$p" != torch-ddp ]; then
      best=$(awk -v a="$v" -v b="${best:-0}" 'BEGIN { print (a > b) ? a : b }')
    fi
  done
  name=$([ $w = w1 ] && echo "W1 MLP, B=128" || echo "W2 LeNet-5, B=64")
  echo "| $name | $(num "$l") | $(num "$l2") |$row $(ratio "$l" "$best") | $(ratio "$l2" "$(median torch-ddp-$w)") | $(ratio "$l2" "$l") |"
done
# Per round: each round's runs are minutes apart at most, so their ratios suffer least from the
# machine's drift. at KEY ROUND: that round's value, or empty.
at() { [ -s "$out/$1.rounds" ] && awk -v r="$2" '$1 == r { print $2 }' "$out/$1.rounds" | head -1 || true; }
echo
echo "| per round | lbbsp / best peer | 2-rank lbbsp / torch-ddp | 2-rank / 1-process |"
echo "|---|---|---|---|"
for w in w1 w2; do
  cols=("" "" "")
  for r in $(seq "$rounds"); do
    l=$(at lbbsp-$w "$r"); l2=$(at lbbsp2-$w "$r"); best=""
    for p in numpy torch jax tf; do
      v=$(at $p-$w "$r")
      [ -n "$v" ] && best=$(awk -v a="$v" -v b="${best:-0}" 'BEGIN { print (a > b) ? a : b }')
    done
    cols[0]+="$(ratio "$l" "$best") "; cols[1]+="$(ratio "$l2" "$(at torch-ddp-$w "$r")") "; cols[2]+="$(ratio "$l2" "$l") "
  done
  med() { tr ' ' '\n' | tr -d '×' | { grep -v -e '^$' -e '–' || true; } | sort -g | awk '{ v[NR] = $1 } END { if (NR) printf " (median %.2f×)", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
  row=""
  for c in 0 1 2; do row+=" ${cols[$c]% }$(echo "${cols[$c]}" | med) |"; done
  echo "| $([ $w = w1 ] && echo W1 || echo W2) |$row"
done
echo
echo "| GEMM (GFLOP/s) | lbbsp | OpenBLAS (numpy) | lbbsp % of OpenBLAS |"
echo "|---|--:|--:|--:|"
for s in square-2048 fc1-fwd fc1-dw fc1-dx fc2-fwd fc2-dw fc2-dx; do
  l=$(median gemm-lbbsp-$s); n=$(median gemm-numpy-$s)
  pct=$( [ -n "$l" ] && [ -n "$n" ] && awk -v a="$l" -v b="$n" 'BEGIN { printf "%.0f%%", 100 * a / b }' || printf '–')
  echo "| $s | $(num "$l") | $(num "$n") | $pct |"
done
echo
echo "| memory (1 process, last round) | peak RSS | dataset + params + grads + optimizer + activations | ratio |"
echo "|---|--:|--:|--:|"
grep '^RESULT peer=lbbsp\|^MEMORY' "$out/memory" | tail -4 | paste - - | while read -r line; do
  model=$(echo "$line" | grep -o 'model=[a-z]*' | cut -d= -f2)
  get() { echo "$line" | grep -o "$1=[0-9.]*" | cut -d= -f2; }
  echo "| $([ "$model" = mlp ] && echo W1 || echo W2) | $(get peak_rss_mb) MB | $(get needed_mb) MB | $(get ratio) |"
done

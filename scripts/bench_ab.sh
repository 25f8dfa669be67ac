#!/usr/bin/env bash
# Is this checkout as fast as BASE (a git revision) on W1 and W2? Interleaved rounds of
# `lbbsp bench w1` and `lbbsp bench w2` on both builds, the order random within each round, and an
# A/A pair (BASE against BASE) per round for the noise floor. Prints, per workload, the median
# ratio this/BASE over the rounds with its range and a bootstrap 95% interval, beside the A/A's.
#
#   scripts/bench_ab.sh BASE [ROUNDS]        e.g. scripts/bench_ab.sh 4e6a862 10
#
# WORKLOADS="w2" times one of them. A speed claim from it holds only for the host it names; run it with nothing else busy.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: scripts/bench_ab.sh BASE_REVISION [ROUNDS]}
rounds=${2:-10}
iters=${ITERS:-2000}
work=target/bench-ab
scripts/build_base.sh "$base" "$work"
cp "$work/target/release/lbbsp" "$work/lbbsp-base"
cp target/release/lbbsp "$work/lbbsp-new"
echo "bench_ab: host $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(grep -o 'avx512f\|avx2' /proc/cpuinfo | sort -u | xargs)" >&2
out=$work/results.tsv
: >"$out"
speed() {  # BIN WORKLOAD -> samples/s
  "$work/lbbsp-$1" bench "$2" --iters "$iters" 2>/dev/null | sed -n 's/^RESULT .*samples_per_s=\([0-9.]*\).*/\1/p'
}
for r in $(seq 1 "$rounds"); do
  for w in ${WORKLOADS:-w1 w2}; do
    # This build, BASE, and BASE again (the A/A pair), in a random order.
    for who in $(printf '%s\n' new base base2 | shuf); do
      echo -e "$r\t$w\t$who\t$(speed "${who%2}" "$w")" >>"$out"
    done
  done
  echo "bench_ab: round $r of $rounds done" >&2
done
python3 - "$out" <<'EOF'
import random, statistics as st, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
by = {}
for r, w, who, v in rows:
    by.setdefault(w, {}).setdefault(r, {})[who] = float(v)
def boot(xs, n=4000):
    rng = random.Random(1)
    meds = sorted(st.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n)]
for w, rs in sorted(by.items()):
    ab = [v["new"] / v["base"] for v in rs.values()]
    aa = [v["base2"] / v["base"] for v in rs.values()]
    base = st.median(v["base"] for v in rs.values())
    for name, xs in (("this/base", ab), ("A/A base/base", aa)):
        lo, hi = boot(xs)
        print(f"{w} {name}: median {st.median(xs):.3f} [{lo:.3f}, {hi:.3f}] range {min(xs):.3f}-{max(xs):.3f} over {len(xs)} rounds (base {base:.0f} samples/s)")
EOF

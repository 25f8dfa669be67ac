#!/usr/bin/env bash
# Trains the model-zoo recipes in full under `mpirun -n $RANKS` (default 2) and checks each one's
# test accuracy, read from its `--summary`, against its target. Prints one line per recipe and
# exits non-zero if any misses. Too long for CI (fashion-resnet alone takes about 12 minutes on a
# 2-core machine); CI's tests/zoo.rs checks the two LeNet-5 recipes.
#
#   scripts/zoo_accuracy.sh                     # all three
#   scripts/zoo_accuracy.sh fashion-resnet      # some of them
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
ranks="${RANKS:-2}"
declare -A target=([mnist-lenet5]=0.990 [fashion-lenet5]=0.895 [fashion-resnet]=0.915)
recipes=("$@")
[ ${#recipes[@]} -gt 0 ] || recipes=(mnist-lenet5 fashion-lenet5 fashion-resnet)

cargo build --release --locked -q
mkdir -p runs
failed=0
for r in "${recipes[@]}"; do
  want="${target[$r]:?unknown zoo recipe $r (known: ${!target[*]})}"
  ./target/release/lbbsp data fetch "$(sed -n 's/^dataset = "\(.*\)"/\1/p' "models/$r.toml")" >/dev/null
  mpirun -n "$ranks" ./target/release/lbbsp train "$r" -q --summary "runs/zoo-$r.summary.json"
  acc=$(sed -n 's/^ *"test_accuracy": *\([0-9.eE+-]*\),*$/\1/p' "runs/zoo-$r.summary.json")
  wall=$(sed -n 's/^ *"wall_s": *\([0-9.eE+-]*\),*$/\1/p' "runs/zoo-$r.summary.json")
  if awk -v a="$acc" -v t="$want" 'BEGIN { exit !(a >= t) }'; then verdict=ok; else verdict=MISS; failed=1; fi
  printf '%-16s test accuracy %.2f%%  target %.1f%%  %4.0f s on %s rank(s)  %s\n' \
    "$r" "$(awk -v a="$acc" 'BEGIN { print 100 * a }')" "$(awk -v t="$want" 'BEGIN { print 100 * t }')" \
    "$wall" "$ranks" "$verdict"
done
exit $failed

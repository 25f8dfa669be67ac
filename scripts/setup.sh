#!/usr/bin/env bash
# Sourced by quickstart.sh and test.sh: installs what is missing (OpenMPI, libclang, Slurm and
# munge, a Rust toolchain) and points LBBSP_DATA at the data sets, fetching them where there is internet.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 || missing+=(openmpi-bin libopenmpi-dev)
# mpi-sys runs bindgen, which loads libclang.so or libclang-N.so (never libclang-cpp, which many
# images ship with their LLVM) and needs clang's builtin headers (stddef.h) next to it.
have_libclang() {
  if [ -n "${LIBCLANG_PATH:-}" ]; then
    compgen -G "$LIBCLANG_PATH/libclang.so*" >/dev/null || compgen -G "$LIBCLANG_PATH/libclang-[0-9]*.so*" >/dev/null
    return
  fi
  ldconfig -p 2>/dev/null | grep -Eq '/libclang(-[0-9.]+)?\.so[0-9.]*$' || return 1
  compgen -G '/usr/lib/llvm-*/lib/clang/*/include/stddef.h' >/dev/null
}
have_libclang || missing+=(libclang-dev)
command -v cc >/dev/null 2>&1 || missing+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
command -v curl >/dev/null 2>&1 || missing+=(curl)
# tests/slurm.rs starts a one-node Slurm cluster (scripts/slurm/local_cluster.sh).
for tool in srun sbatch slurmctld slurmd; do command -v "$tool" >/dev/null 2>&1 || { missing+=(slurm-wlm); break; }; done
command -v munged >/dev/null 2>&1 || missing+=(munge)
# tests/multihost.rs makes two "hosts" as network namespaces (`ip netns`).
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  sudo_if_needed apt-get update -qq
  DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null 2>&1; then
  [ -x "$HOME/.cargo/bin/cargo" ] || { echo "setup: installing Rust with rustup" >&2; curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal; }
  export PATH="$HOME/.cargo/bin:$PATH"
fi

# OpenMPI refuses to run as root unless told; CI runs as root.
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# More ranks than cores is fine for tests on small machines.
export OMPI_MCA_rmaps_base_oversubscribe=1

# Data: LBBSP_DATA if set; else a local mirror beside the checkout; else download into ./data.
if [ -z "${LBBSP_DATA:-}" ]; then
  if [ -f "$repo/../shared/datasets/SHA256SUMS" ]; then
    export LBBSP_DATA="$(cd "$repo/../shared/datasets" && pwd)"
  else
    export LBBSP_DATA="$repo/data"
  fi
fi
echo "setup: data sets in $LBBSP_DATA" >&2

#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for trying the job script and for tests/slurm.rs:
#
#   scripts/slurm/local_cluster.sh start DIR   # prints `export SLURM_CONF=DIR/slurm.conf`
#   scripts/slurm/local_cluster.sh stop DIR
#
# munged, slurmctld and slurmd run from Debian's packages (slurm-wlm, munge) as root, without
# systemd, with their key, state, spool, logs and a generated slurm.conf in DIR. The node declares
# this host's CPUs and memory (`slurmd -C`); the ports are 6817/6818 plus an offset from DIR's
# name so that two clusters on one host do not collide.
set -euo pipefail
cmd="${1:?usage: local_cluster.sh start|stop DIR}"
dir="$(mkdir -p "${2:?usage: local_cluster.sh start|stop DIR}" && cd "$2" && pwd)"

stop() {
  local pids=()
  for daemon in slurmd slurmctld munged; do
    if [ -f "$dir/run/$daemon.pid" ]; then
      pids+=("$(cat "$dir/run/$daemon.pid")")
      kill "${pids[-1]}" 2>/dev/null || true
      rm -f "$dir/run/$daemon.pid"
    fi
  done
  # slurmctld saves its state before it exits: wait for all (at most 10 s).
  for _ in $(seq 100); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" -eq 0 ] && return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "local_cluster.sh: unknown command $cmd (start or stop)" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "local_cluster.sh: the daemons need root (slurmd runs jobs as their users)" >&2; exit 3; }
for tool in munged slurmctld slurmd sinfo; do
  command -v "$tool" >/dev/null || { echo "local_cluster.sh: $tool missing: apt-get install slurm-wlm munge" >&2; exit 3; }
done

mkdir -p "$dir"/{state,spool,munge,log,run}
chmod 700 "$dir/munge"
[ -f "$dir/munge/munge.key" ] || { head -c 1024 /dev/urandom >"$dir/munge/munge.key"; chmod 600 "$dir/munge/munge.key"; }
offset=$(( $(printf '%s' "$dir" | cksum | cut -d' ' -f1) % 1000 * 2 ))
host="$(hostname -s)"
node="$(slurmd -C | head -1 | sed 's/ UpTime=.*//')"
cat >"$dir/slurm.conf" <<CONF
ClusterName=lbbsp
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits out the credential lifetime of its previous run before it may start again
# (slurmd refuses it as "Job credential revoked" until then): 10 s here instead of 120.
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=$((16817 + offset))
SlurmdPort=$((16818 + offset))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
stop
munged --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" --pid-file="$dir/run/munged.pid" \
  --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munge.seed" --force
export SLURM_CONF="$dir/slurm.conf"
slurmctld
slurmd
for _ in $(seq 100); do
  if sinfo -h -o %t 2>/dev/null | grep -q idle; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.1
done
echo "local_cluster.sh: the node did not come up within 10 s; logs in $dir/log" >&2
tail -5 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
stop
exit 1

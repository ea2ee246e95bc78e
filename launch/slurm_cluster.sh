#!/usr/bin/env bash
# A real single-node Slurm cluster (slurmctld + slurmd + munged) living entirely in one folder,
# for tests and for trying the sbatch path on a workstation.
#   bash launch/slurm_cluster.sh install          # apt-get slurm-wlm and munge (needs root)
#   bash launch/slurm_cluster.sh start DIR        # writes DIR/slurm.conf, starts the daemons
#   export SLURM_CONF=DIR/slurm.conf; sbatch ...  # use it
#   bash launch/slurm_cluster.sh stop DIR         # stops exactly the daemons it started (pid files)
# Every daemon gets its own socket, spool, state and pid file under DIR, so nothing else on the
# machine is touched and stop never kills by name.  KillWait=5: a requeued job's Ray processes linger
# after SIGTERM until Slurm's SIGKILL, and the job waits in COMPLETING that long before it can restart
# (30 s of every requeue drill with Slurm's default; the driver has checkpointed on USR1 before then).
set -euo pipefail
cmd="${1:?usage: slurm_cluster.sh install|start DIR|stop DIR}"

case "$cmd" in
install)
  if command -v slurmctld >/dev/null && command -v munged >/dev/null; then exit 0; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurm-wlm munge >/dev/null
  ;;
start)
  dir="$(realpath -m "${2:?start needs a DIR}")"
  mkdir -p "$dir"/{state,spool,log,munge}
  chmod 700 "$dir/munge"
  if [ ! -f "$dir/munge/munge.key" ]; then
    head -c 1024 /dev/urandom > "$dir/munge/munge.key"
    chmod 400 "$dir/munge/munge.key"
  fi
  /usr/sbin/munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.sock" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
  host="$(hostname -s)"
  cpus="$(nproc)"
  mem_mb=$(( $(awk '/MemAvailable/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))
  port_base=$(( 20000 + RANDOM % 20000 ))
  cat > "$dir/slurm.conf" <<CONF
ClusterName=megatronrl
SlurmctldHost=$host
SlurmctldPort=$port_base
SlurmdPort=$((port_base + 1))
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
SchedulerParameters=defer_batch
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
  export SLURM_CONF="$dir/slurm.conf"
  /usr/sbin/slurmctld -f "$SLURM_CONF"
  /usr/sbin/slurmd -f "$SLURM_CONF"
  for _ in $(seq 1 60); do
    if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      echo "slurm up: SLURM_CONF=$SLURM_CONF"; exit 0
    fi
    sleep 1
  done
  echo "slurm did not become ready; see $dir/log" >&2
  exit 1
  ;;
stop)
  dir="$(realpath -m "${2:?stop needs a DIR}")"
  if [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
    # Jobs first (this cluster's jobs are all ours), so slurmd can clean up their processes.
    export SLURM_CONF="$dir/slurm.conf"
    jobs="$(squeue -h -o %i 2>/dev/null || true)"
    if [ -n "$jobs" ]; then
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 1 60); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 1; done
    fi
  fi
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    if [ -f "$pidfile" ]; then
      pid="$(cat "$pidfile")"
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$pidfile"
    fi
  done
  ;;
*)
  echo "unknown command $cmd" >&2; exit 2 ;;
esac

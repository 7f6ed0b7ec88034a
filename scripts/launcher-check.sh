#!/usr/bin/env bash
# The same 4-rank job (build/bin/gradsync_consumer: an allreduce checked on every rank, started
# with no gradsync variables but the job's id, token and daemon) under a real single-node Slurm
# (Debian's slurmctld and slurmd, started here), under Open MPI's mpirun, and with torchrun's
# variables; then each with inconsistent variables, which must fail with a clear error.
# docs/launchers.md. Needs root (slurmd) and apt-get for the packages; about 1-2 minutes.
#   scripts/launcher-check.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
bin=$build/bin
say() { echo "launcher-check: $*"; }
die() { echo "launcher-check: FAILED: $*" >&2; exit 1; }
[ -x "$bin/gradsync_consumer" ] || die "$bin/gradsync_consumer missing (cmake --build $build --target gradsync_consumer gradsyncd gradsync-coordinator)"

need=()
for p in slurmd slurmctld slurm-client munge openmpi-bin; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

work=$(mktemp -d /tmp/gradsync-launchers.XXXXXX)
chmod 0755 "$work"
pids=()
started_munge=0
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ "$started_munge" = 1 ] && [ -s /run/munge/munged.pid ]; then kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# Coordinator and daemon (what gradsyncd.service runs), in a scratch directory, with the node
# credential the coordinator requires (coordinator/authz.h).
export GRADSYNC_CLUSTER_SECRET
GRADSYNC_CLUSTER_SECRET=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
"$bin/gradsync-coordinator" --listen 127.0.0.1:0 --port-file "$work/port" >"$work/coordinator.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$work/port" ] && break; sleep 0.1; done
[ -s "$work/port" ] || die "coordinator did not start: $(cat "$work/coordinator.log")"
mkdir -m 0750 "$work/run"
"$bin/gradsyncd" --coordinator "127.0.0.1:$(cat "$work/port")" --socket "$work/run/gradsyncd.sock" \
  --ready-file "$work/ready" >"$work/daemon.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -e "$work/ready" ] && break; sleep 0.1; done
[ -e "$work/ready" ] || die "gradsyncd did not start: $(cat "$work/daemon.log")"
export GRADSYNC_DAEMON=$work/run/gradsyncd.sock GRADSYNC_JOB_TOKEN=launcher-check GRADSYNC_JOIN_TIMEOUT_MS=20000
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GRADSYNC_LAUNCHER
consumer=$(realpath "$bin/gradsync_consumer")

expect_ok() {  # NAME OUTPUT_FILE
  local n
  n=$(grep -c "allreduce ok" "$2" || true)
  [ "$n" = 4 ] || { cat "$2"; die "$1: $n of 4 ranks ok"; }
  say "$1: 4 of 4 ranks ok"
  grep "allreduce ok" "$2" | sort | sed 's/^/    /'
}
expect_error() {  # NAME OUTPUT_FILE PATTERN
  grep -q -- "$3" "$2" || { cat "$2"; die "$1: no error matching '$3'"; }
  say "$1: refused as it should be:"
  grep -m1 -- "$3" "$2" | sed 's/^/    /'
}

# --- Slurm: slurmctld + slurmd on this node -------------------------------------------------
host=$(hostname -s)
mkdir -p "$work/slurm/state" "$work/slurm/spool"
cat >"$work/slurm/slurm.conf" <<EOF
ClusterName=gradsynccheck
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=${SLURMD_PORT:-16818}
AuthType=auth/munge
StateSaveLocation=$work/slurm/state
SlurmdSpoolDir=$work/slurm/spool
SlurmctldPidFile=$work/slurm/slurmctld.pid
SlurmdPidFile=$work/slurm/slurmd.pid
SlurmctldLogFile=$work/slurm/slurmctld.log
SlurmdLogFile=$work/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$host CPUs=4 State=UNKNOWN
PartitionName=check Nodes=ALL Default=YES MaxTime=10 State=UP
EOF
export SLURM_CONF=$work/slurm/slurm.conf
if ! pgrep -x munged >/dev/null; then
  mkdir -p /run/munge && chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged || die "munged did not start"
  started_munge=1
fi
slurmctld -D -f "$SLURM_CONF" >"$work/slurm/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" >"$work/slurm/slurmd.out" 2>&1 &
pids+=($!)
for _ in $(seq 150); do sinfo -h -o %T 2>/dev/null | grep -q idle && break; sleep 0.2; done
sinfo -h -o %T 2>/dev/null | grep -q idle || die "slurm did not come up: $(tail -5 "$work/slurm/slurmctld.log" "$work/slurm/slurmd.log" 2>&1)"
say "slurm up: $(sinfo -h -o '%P %D %T %c')"

GRADSYNC_JOB_ID=srun-ok timeout 90 srun -n 4 -t 2 "$consumer" >"$work/srun.out" 2>&1 || true
expect_ok "srun -n 4" "$work/srun.out"
GRADSYNC_JOB_ID=srun-bad RANK=0 WORLD_SIZE=4 timeout 90 srun -n 4 -t 2 "$consumer" >"$work/srun-bad.out" 2>&1 || true
expect_error "srun -n 4 with a stale RANK=0 WORLD_SIZE=4" "$work/srun-bad.out" "disagree on the rank"

# --- Open MPI ---------------------------------------------------------------------------------
unset SLURM_CONF
mpi=(mpirun --allow-run-as-root --oversubscribe -n 4 -x GRADSYNC_DAEMON -x GRADSYNC_JOB_TOKEN -x GRADSYNC_JOB_ID)
GRADSYNC_JOB_ID=mpirun-ok timeout 90 "${mpi[@]}" "$consumer" >"$work/mpirun.out" 2>&1 || true
expect_ok "mpirun -n 4" "$work/mpirun.out"
GRADSYNC_JOB_ID=mpirun-bad timeout 90 "${mpi[@]}" -x RANK=1 -x WORLD_SIZE=4 "$consumer" >"$work/mpirun-bad.out" 2>&1 || true
expect_error "mpirun -n 4 with a stale RANK=1 WORLD_SIZE=4" "$work/mpirun-bad.out" "disagree on the rank"

# --- torchrun's variables ---------------------------------------------------------------------
torchrun_style() {  # JOB EXTRA_ENV...
  local job=$1 r ranks=()
  shift
  for r in 0 1 2 3; do
    env GRADSYNC_JOB_ID="$job" RANK=$r WORLD_SIZE=4 LOCAL_RANK=$r LOCAL_WORLD_SIZE=4 "$@" timeout 60 "$consumer" &
    ranks+=($!)
  done
  wait "${ranks[@]}" || true  # only the ranks: the coordinator and daemons run on
}
torchrun_style torchrun-ok >"$work/torchrun.out" 2>&1 || true
expect_ok "RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE" "$work/torchrun.out"
torchrun_style torchrun-bad LOCAL_WORLD_SIZE=2 >"$work/torchrun-bad.out" 2>&1 || true
expect_error "torchrun variables with LOCAL_WORLD_SIZE=2 for LOCAL_RANK 0-3" "$work/torchrun-bad.out" "outside its node's ranks"
say "ok"

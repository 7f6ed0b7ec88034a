#!/usr/bin/env bash
# Runs ON the GPU machine (2 GPUs), from the repository root, over the bundle that
# `scripts/gpu-run.sh gpu_worker gradsyncd gradsync-coordinator gradsyncrun gradsync-bench`
# packed; gradsync beside NCCL in the same processes, on the same buffers:
#
#   bash scripts/bench-gpu.sh [ipc|staged|all] [extra gradsync-bench flags]
#
#   ipc     one node, NGPUS ranks (default 2, one per GPU), gradsync's CUDA IPC path vs NCCL (NVLink)
#   staged  two gradsyncd as two nodes on loopback TCP, one GPU each: gradsync's host-staged
#           path vs NCCL forced onto sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
#           NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo). On a machine with one GPU both "nodes"
#           use GPU 0, and NCCL_HOSTID differs per rank so that NCCL too sees two hosts (it
#           refuses two ranks on one GPU of one host).
# Environment for staged: GRADSYNC_* (rings, slots, ...) reach both daemons and ranks.
# Tables go to $OUT/bench-gpu-*.txt and are printed at the end. NCCL_NVLS_ENABLE=0 always.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
bin=$PWD/bundle/bin
# Multi-node jobs need a job token (gradsyncrun refuses one without): a random one per run,
# passed to every node through the environment, never on a command line.
export GRADSYNC_JOB_TOKEN=${GRADSYNC_JOB_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
export LD_LIBRARY_PATH=$PWD/bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
what=${1:-all}
shift || true
range=${BENCH_RANGE:--b 8 -e 1G -f 2}
common="--device cuda $range -w 5 -n 20 $*"

ipc() {
  # shellcheck disable=SC2086
  timeout 300 "$bin/gradsyncrun" --standalone --no-prefix --timeout-s 280 -n "${NGPUS:-2}" \
      "$bin/gradsync-bench" $common > "$OUT/bench-gpu-ipc.txt" 2> "$OUT/bench-gpu-ipc.err"
  echo "ipc: exit $?"
}

staged() {
  local tmp pid port i dev ngpus pids=() dest job=gpu-staged-$RANDOM
  ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "${ngpus:-0}" -ge 2 ] || echo "staged: ${ngpus:-0} GPU(s): both nodes on GPU 0, NCCL_HOSTID per rank"
  tmp=$(mktemp -d)
  "$bin/gradsync-coordinator" --listen 127.0.0.1:0 --port-file "$tmp/port" 2> "$OUT/coordinator.err" &
  pid=$!
  for _ in $(seq 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
  port=$(cat "$tmp/port")
  for i in 0 1; do
    dest=$OUT/bench-gpu-staged.txt
    [ "$i" = 1 ] && dest=/dev/null
    dev=$i
    [ "${ngpus:-0}" -ge 2 ] || dev=0
    # shellcheck disable=SC2086
    GRADSYNC_DEVICE=$dev NCCL_HOSTID=gradsync-bench-node$i NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo \
      timeout 400 "$bin/gradsyncrun" --coordinator "127.0.0.1:$port" --nnodes 2 --node-rank "$i" -n 1 \
        --job-id "$job" --node-name "n$i" --no-prefix --timeout-s 380 "$bin/gradsync-bench" $common \
        > "$dest" 2> "$OUT/bench-gpu-staged.n$i.err" &
    pids+=($!)
  done
  local rc=0
  for i in "${pids[@]}"; do wait "$i" || rc=1; done
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  rm -rf "$tmp"
  echo "staged: exit $rc"
}

case "$what" in
  ipc) ipc ;;
  staged) staged ;;
  all) ipc; staged ;;
  *) echo "usage: bench-gpu.sh [ipc|staged|all] [flags]" >&2; exit 2 ;;
esac
for f in "$OUT"/bench-gpu-*.txt; do echo "== $f"; cat "$f"; done

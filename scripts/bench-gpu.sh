#!/usr/bin/env bash
# Runs ON the GPU machine (2 GPUs), from the repository root, over the bundle that
# `scripts/gpu-run.sh gpu_worker gradsyncd gradsync-coordinator gradsyncrun gradsync-bench`
# packed; gradsync beside NCCL in the same processes, on the same buffers:
#
#   bash scripts/bench-gpu.sh [ipc|staged|all] [extra gradsync-bench flags]
#
#   ipc     one node, NGPUS ranks (default 2, one per GPU), gradsync's CUDA IPC path vs NCCL (NVLink)
#   staged  NODES gradsyncd (default 2) as nodes on loopback TCP, PER_NODE ranks each
#           (default 1), GPU (node * PER_NODE + local) mod the GPU count: gradsync's
#           multi-node GPU path (the step channels over TCP peers, GRADSYNC_GPU_STAGED=1 for
#           the host-staged schedule; with PER_NODE >= 2 their allreduce may be hierarchical,
#           as the cost model chooses: GRADSYNC_ALGO=hierarchical forces it,
#           GRADSYNC_GPU_HIERARCHICAL=0 leaves it out) vs NCCL
#           forced onto sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket
#           NCCL_SOCKET_IFNAME=lo). Ranks that share a GPU get an NCCL_HOSTID per node so that
#           NCCL too sees separate hosts (it refuses two ranks on one GPU of one host).
#           Shapes for the machines of 2, 4 and 8 GPUs: NODES=2 PER_NODE=1|2|4, NODES=4 PER_NODE=2.
# Environment for staged: GRADSYNC_* (rings, slots, ...) reach every daemon and rank. For ipc,
# GRADSYNC_ALGO picks the one-node protocol of every call: unset, the kernels by size (low-latency
# lines, one-shot, two-shot from 3 ranks and 1 MiB); oneshot or twoshot, that kernel; ring or
# tree, the planner's ring or trees through the step runner over CUDA IPC (docs/architecture.md);
# GRADSYNC_GPU_NODE_STEPS=1 puts every call on the step runner (its cost model's choice).
# Tables go to $OUT/bench-gpu-*.txt and are printed at the end. NCCL_NVLS_ENABLE=0 always.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
bin=$PWD/bundle/bin
# Multi-node jobs need a job token (gradsyncrun refuses one without): a random one per run,
# passed to every node through the environment, never on a command line.
export GRADSYNC_JOB_TOKEN=${GRADSYNC_JOB_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
# The coordinator started here and its daemons share a cluster secret (coordinator/authz.h).
export GRADSYNC_CLUSTER_SECRET=${GRADSYNC_CLUSTER_SECRET:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
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
  local nodes=${NODES:-2} per=${PER_NODE:-1}
  ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  ngpus=${ngpus:-0}
  ((ngpus >= 1)) || { echo "staged: no GPU"; return 1; }
  ((ngpus >= nodes * per)) || echo "staged: ${nodes}x${per} ranks on $ngpus GPU(s): ranks share GPUs, NCCL_HOSTID per node"
  tmp=$(mktemp -d)
  "$bin/gradsync-coordinator" --listen 127.0.0.1:0 --port-file "$tmp/port" 2> "$OUT/coordinator.err" &
  pid=$!
  for _ in $(seq 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
  port=$(cat "$tmp/port")
  for ((i = 0; i < nodes; i++)); do
    dest=$OUT/bench-gpu-staged-${nodes}x${per}.txt
    [ "$i" = 0 ] || dest=/dev/null
    # Each node's ranks take the node's first GPU + their LOCAL_RANK (mod the GPU count).
    dev=$(( (i * per) % ngpus ))
    # shellcheck disable=SC2086,SC2016
    BENCH_GPU_BASE=$dev BENCH_GPUS=$ngpus \
      NCCL_HOSTID=gradsync-bench-node$i NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo \
      timeout 400 "$bin/gradsyncrun" --start-daemon --coordinator "127.0.0.1:$port" --nnodes "$nodes" --node-rank "$i" -n "$per" \
        --job-id "$job" --node-name "n$i" --no-prefix --timeout-s 380 \
        sh -c 'GRADSYNC_DEVICE=$(( (BENCH_GPU_BASE + LOCAL_RANK) % BENCH_GPUS )) exec "$0" "$@"' \
        "$bin/gradsync-bench" $common \
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

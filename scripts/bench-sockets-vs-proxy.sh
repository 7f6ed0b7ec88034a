#!/bin/bash
# Rank sockets (the default) beside the daemons' TCP proxy (GRADSYNC_PROXY_TCP=1): two gradsyncd
# as two nodes on loopback, 2 nodes x 1 rank, two rounds in alternation:
#   (a) host tensors; (b) GPU tensors on the host-staged path, both ranks on GPU 0.
# Runs from the repository root over bundle/ (scripts/gpu-run.sh gradsync-bench gradsyncrun) on
# the GPU machine; on a machine without a GPU, SKIP_GPU=1 runs (a) only over build/bin.
#   bash scripts/bench-sockets-vs-proxy.sh        (tables on stdout, raw output under $OUT)
# GRADSYNC_* settings (GRADSYNC_NRINGS=16, ...) reach both daemons and ranks.
# (a) host tensors, 2 nodes x 1 rank; (b) GPU tensors, host-staged path, both ranks on GPU 0.
export NCCL_NVLS_ENABLE=0
if [ "${SKIP_GPU:-0}" = 1 ]; then bin=$PWD/${GRADSYNC_BUILD_DIR:-build}/bin
else export LD_LIBRARY_PATH=$PWD/bundle/lib; bin=$PWD/bundle/bin; fi
# GRADSYNC_BIN_DIR: the binaries to run instead (SKIP_GPU=1 over bundle/bin on the GPU machine).
bin=${GRADSYNC_BIN_DIR:-$bin}
# Multi-node jobs need a job token (gradsyncrun refuses one without): a random one per run,
# passed to every node through the environment, never on a command line.
export GRADSYNC_JOB_TOKEN=${GRADSYNC_JOB_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
# The coordinator started here and its daemons share a cluster secret (coordinator/authz.h).
export GRADSYNC_CLUSTER_SECRET=${GRADSYNC_CLUSTER_SECRET:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
OUT=${OUT:-$PWD/bench-out/sockets-vs-proxy}; mkdir -p "$OUT"
two() {  # label, env, bench args
  local label=$1 envs=$2; shift 2
  local tmp=$(mktemp -d) job=j$RANDOM
  $bin/gradsync-coordinator --listen 127.0.0.1:0 --port-file $tmp/port 2>/dev/null &
  local cp=$!
  for _ in $(seq 100); do [ -s $tmp/port ] && break; sleep 0.1; done
  local pids=()
  for i in 0 1; do
    env $envs GRADSYNC_DEVICE=0 timeout 300 $bin/gradsyncrun --start-daemon --coordinator 127.0.0.1:$(cat $tmp/port) --nnodes 2 --node-rank $i -n 1 \
      --job-id $job --node-name n$i --no-prefix --timeout-s 280 $bin/gradsync-bench "$@" > $tmp/out$i 2> $OUT/$label.n$i.err &
    pids+=($!)
  done
  wait "${pids[@]}"; kill $cp; wait $cp 2>/dev/null
  cp $tmp/out0 $OUT/$label.txt
  # size, time (us), busbw: the host table has a root column, the GPU one has not
  echo "== $label"; grep -E "^ +[0-9]" $tmp/out0 | awk '{ if ($5 == "-1") printf "%12s %10s %8s\n", $1, $6, $8; else printf "%12s %10s %8s\n", $1, $5, $7 }'
}
nproc
for round in 1 2; do
  two host-sockets-r$round "GRADSYNC_PROXY_TCP=0" -b 64K -e 256M -f 4 -n 20 -w 5 -d float -o sum -c 1 --inplace 0
  two host-proxy-r$round "GRADSYNC_PROXY_TCP=1" -b 64K -e 256M -f 4 -n 20 -w 5 -d float -o sum -c 1 --inplace 0
  [ "${SKIP_GPU:-0}" = 1 ] && continue
  two gpu-sockets-r$round "GRADSYNC_PROXY_TCP=0" --device cuda --nccl 0 -b 64K -e 256M -f 4 -n 20 -w 5 -d float -o sum -c 1 --inplace 0
  two gpu-proxy-r$round "GRADSYNC_PROXY_TCP=1" --device cuda --nccl 0 -b 64K -e 256M -f 4 -n 20 -w 5 -d float -o sum -c 1 --inplace 0
done
grep -h "data path" $OUT/*.err | sed 's/.*data path/data path/' | sort | uniq -c

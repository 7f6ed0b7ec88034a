#!/usr/bin/env bash
# Runs ON the GPU machine, from the repository root: a build of main before a change (the
# bundle in bundle-old/, from scripts/gpu-run.sh or bundle-deps) against the build after it
# (bundle/), on one node, in one device call:
#
#   bash scripts/bench-gpu-old-new.sh
#
# 1. Processes sharing the GPU (scripts/bench-gpu-ab.sh, NGPUS ranks, default 2, from 1 MiB to
#    1 GiB, --nccl 0): gradsync-bench old against new, each through its own gradsyncrun and
#    gradsyncd. OLD_ENV / NEW_ENV set variables for one side.
# 2. Ranks as threads, gated (scripts/bench-node-steps.sh: the GPU's time alone), at RANKS
#    (default "2 8"): the old node_gpu_test's column OLD_COL (default kernels) against the new
#    one's NEW_COL (default steps-auto), 32 B to 16 MiB.
# SKIP_AB=1 / SKIP_THREADS=1 leave a part out. Logs under $OUT; the tables last.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0)) s] $*"; }
nvidia-smi -L 2>&1 | head -1
for f in bundle-old/bin/gradsync-bench bundle-old/bin/node_gpu_test bundle/bin/gradsync-bench bundle/bin/node_gpu_test; do
  [ -x "$f" ] || { echo "bench-gpu-old-new: $f is missing"; exit 2; }
done
if [ -z "${SKIP_AB:-}" ]; then
  mkdir -p "$OUT/ab"
  OUT=$OUT/ab ROUNDS=${ROUNDS:-1} BENCH_RANGE=${BENCH_RANGE:--b 1M -e 1G -f 4} OLD_BIN=$PWD/bundle-old/bin \
    timeout "${AB_TIMEOUT:-290}" bash scripts/bench-gpu-ab.sh bundle-old/bin/gradsync-bench bundle/bin/gradsync-bench \
    --nccl 0 >"$OUT/ab/summary.txt" 2>&1
  el "processes sharing the GPU: exit $?"
fi
if [ -z "${SKIP_THREADS:-}" ]; then
  cp bundle-old/bin/node_gpu_test bundle/bin/node_gpu_test_old
  mkdir -p "$OUT/threads"
  OUT=$OUT/threads RANKS=${RANKS:-2 8} BINS="node_gpu_test_old node_gpu_test" NODE_BENCH_GATE=1 \
    NODE_BENCH_COLS=${OLD_COL:-kernels},${NEW_COL:-steps-auto} \
    NODE_BENCH_SIZES=${NODE_BENCH_SIZES:-32,65536,262144,1048576,4194304,16777216} BENCH_TIMEOUT=${BENCH_TIMEOUT:-100} \
    timeout "${THREADS_TIMEOUT:-280}" bash scripts/bench-node-steps.sh >"$OUT/threads/summary.txt" 2>&1
  el "ranks as threads: exit $?"
fi
if [ -z "${SKIP_AB:-}" ]; then
  echo "== processes sharing the GPU: old lines, then new (size, then gradsync's columns)"
  grep -E '^ +[0-9]+ ' "$OUT/ab/ab-old-1.txt" | head -8 | cut -c1-100
  grep -E '^ +[0-9]+ ' "$OUT/ab/ab-new-1.txt" | head -8 | cut -c1-100
fi
if [ -z "${SKIP_THREADS:-}" ]; then
  echo "== ranks as threads, gated"
  grep -v '^$' "$OUT/threads/summary.txt" | tail -40
fi

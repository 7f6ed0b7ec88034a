#!/usr/bin/env bash
# Runs ON the GPU machine, from the repository root, over a bundle (bundle/bin, bundle/lib) of
# node_gpu_test, gradsync-bench, gradsyncrun, gradsyncd, gradsync-coordinator and gpu_worker:
# the one-node step channels beside the node kernels, in one device call.
#
#   bash scripts/bench-step-window.sh
#
# 1. Two processes sharing GPU 0 (scripts/bench-gpu-ab.sh, 1 MiB-1 GiB, --nccl 0): the node
#    kernels ("old") against the steps ("new") with A the default 4 slots, B 64 slots (the
#    window one-shot runs ahead of a peer that is not running), C 64 slots with absolute
#    counts (GRADSYNC_GPU_STEP_ABSOLUTE=1: consecutive calls take consecutive slots, where
#    relative counts start every call at slot 0 and wait for the previous call's reader).
# 2. Ranks as threads, gated (scripts/bench-node-steps.sh, 1x2 and 1x8, 32 B-16 MiB): kernels
#    against steps-auto, with the default blocks (d) and 64 blocks of 32 KiB (w).
# 3. node_gpu_test with every one-node call on the steps (GRADSYNC_GPU_NODE_STEPS=1;
#    NODE_FILTER narrows it, SKIP_NODE_TEST=1 leaves it out).
# Logs under $OUT; the tables last.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0)) s] $*"; }
nvidia-smi -L 2>&1 | head -1
bench=bundle/bin/gradsync-bench
steps="GRADSYNC_GPU_NODE_STEPS=1"
wide="GRADSYNC_GDR_SLOTS=64 GRADSYNC_GPU_MEMORY_MAX=1024"
for v in "A $steps" "B $steps $wide" "C $steps $wide GRADSYNC_GPU_STEP_ABSOLUTE=1"; do
  tag=${v%% *}
  mkdir -p "$OUT/ab-$tag"
  OUT=$OUT/ab-$tag ROUNDS=1 BENCH_RANGE="-b 1M -e 1G -f 4" NEW_ENV="${v#* }" timeout 290 \
    bash scripts/bench-gpu-ab.sh "$bench" "$bench" --nccl 0 >"$OUT/ab-$tag/summary.txt" 2>&1
  el "shared GPU $tag (${v#* }): exit $?"
done
for v in "d" "w GRADSYNC_GPU_STEP_BLOCKS=64 GRADSYNC_GPU_STEP_BLOCK_BYTES=32768"; do
  tag=${v%% *}
  mkdir -p "$OUT/nb-$tag"
  # shellcheck disable=SC2086
  env ${v#"$tag"} OUT="$OUT/nb-$tag" RANKS="2 8" NODE_BENCH_GATE=1 NODE_BENCH_COLS=kernels,steps-auto \
    NODE_BENCH_SIZES=32,65536,262144,1048576,4194304,16777216 BENCH_TIMEOUT=100 timeout 230 \
    bash scripts/bench-node-steps.sh >"$OUT/nb-$tag/summary.txt" 2>&1
  el "threads $tag: exit $?"
done
if [ -z "${SKIP_NODE_TEST:-}" ]; then
  GRADSYNC_GPU_NODE_STEPS=1 timeout 200 bundle/bin/node_gpu_test --gtest_filter="${NODE_FILTER:-*}" >"$OUT/node_gpu_test.log" 2>&1
  el "node_gpu_test on the steps: exit $?, $(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/node_gpu_test.log" | head -1)"
  grep -E '^\[  FAILED  \]' "$OUT/node_gpu_test.log" | head -5
fi
for tag in A B C; do
  echo "== shared GPU $tag: node kernels, then steps"
  grep -E '^ +[0-9]+ ' "$OUT/ab-$tag/ab-old-1.txt" | head -8 | cut -c1-100
  grep -E '^ +[0-9]+ ' "$OUT/ab-$tag/ab-new-1.txt" | head -8 | cut -c1-100
done
for tag in d w; do
  echo "== threads $tag"
  tail -30 "$OUT/nb-$tag/summary.txt" | grep -v '^$'
done

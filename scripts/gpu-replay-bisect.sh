#!/usr/bin/env bash
# Runs ON the GPU machine: the one-node step replay test (node_gpu_test,
# OneNodeStepReplay, ring) on several builds and settings, each bounded, to find what makes it
# hang. Each line: the build, the settings, and the test's exit (124: still running at the bound).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/bundle/lib NCCL_NVLS_ENABLE=0
f=${REPLAY_FILTER:-Algos/OneNodeStepReplay.RepeatedCallsOnOneBufferAreExact/ring}
t=${REPLAY_TIMEOUT:-25}
i=0
one() {
  local bin=$1; shift
  i=$((i + 1))
  env "$@" timeout "$t" "$bin" --gtest_filter="$f" >"$OUT/replay-$i.log" 2>&1
  echo "$i $bin ${*:-defaults}: exit $? $(grep -cE '^\[       OK \]' "$OUT/replay-$i.log") ok"
}
for spec in "$@"; do
  # shellcheck disable=SC2086
  one $spec
done

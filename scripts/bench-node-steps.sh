#!/usr/bin/env bash
# Runs ON the GPU machine, from the repository root, over the bundle scripts/gpu-run.sh made:
# one node's ranks as threads sharing GPU 0, the node kernels beside the step channels'
# algorithms and protocols (tests/verbs/node_gpu_test.cc, OneNodeBench.DISABLED_$TEST):
#
#   bash scripts/bench-node-steps.sh
#   BINS="node_gpu_test_old node_gpu_test" NODE_BENCH_GATE=1 bash scripts/bench-node-steps.sh
#
# TESTS: the benches (default LowLatencyBesideBulk; OneShotBesideTwoShot takes
# NODE_BENCH_PROTOS); RANKS: ranks per run, space-separated (default 8); BINS: node_gpu_test
# binaries in bundle/bin, run in turn (say a build of main before a change beside the new one);
# BENCH_TIMEOUT: seconds per run (default 240; below the 120 s op timeout a hang is killed
# before it names what it waited for; past it, cuda-gdb, where installed, writes every host
# thread's stack and the resident kernels to $OUT/bench-*-hang.txt before the kill, within
# HANG_DUMP_TIMEOUT seconds, default 90).
# NODE_BENCH_SIZES=262144,1048576,... (bytes) replaces LowLatencyBesideBulk's sizes (8n B to 1 MiB).
# NODE_BENCH_GATE=1 holds every rank's stream until all have queued their calls (the GPU's
# time alone). Logs go to $OUT/bench-*.log (a second run into the same $OUT adds -run2,
# -run3, ...); the tables are printed last, one per binary.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
nvidia-smi -L 2>&1 | head -1
logs=()
for test in ${TESTS:-LowLatencyBesideBulk}; do
  for ranks in ${RANKS:-8}; do
    for bin in ${BINS:-node_gpu_test}; do
      base="$OUT/bench-$bin-$test-$ranks${NODE_BENCH_GATE:+-gated}" log="$base.log"
      for ((k = 2; k < 100; ++k)); do [ -e "$log" ] || break; log="$base-run$k.log"; done
      t0=$(date +%s)
      NODE_BENCH_RANKS=$ranks "bundle/bin/$bin" \
        --gtest_also_run_disabled_tests --gtest_filter="OneNodeBench.DISABLED_$test" >"$log" 2>&1 &
      pid=$! rc=
      while kill -0 $pid 2>/dev/null && (( $(date +%s) - t0 < ${BENCH_TIMEOUT:-240} )); do sleep 0.5; done
      if kill -0 $pid 2>/dev/null; then
        # Past its time: every host thread's stack and the kernels still resident, then kill.
        if command -v cuda-gdb >/dev/null; then
          timeout -k 5 "${HANG_DUMP_TIMEOUT:-90}" cuda-gdb -batch -p $pid -ex 'set pagination off' -ex 'thread apply all bt 24' \
            -ex 'info cuda kernels' -ex detach >"${log%.log}-hang.txt" 2>&1
          echo "bench-node-steps: $bin hung; stacks in $(basename "${log%.log}")-hang.txt"
        fi
        kill -9 $pid 2>/dev/null
      fi
      wait $pid; rc=$?
      echo "bench-node-steps: $bin $test x$ranks exit $rc in $(( $(date +%s) - t0 )) s"
      logs+=("$log")
    done
  done
done
for log in "${logs[@]}"; do
  echo "== $(basename "$log" .log)"
  grep -E '^#|^  +[0-9]+ ' "$log"
done

#!/usr/bin/env bash
# Runs ON the GPU machine, from the repository root, over the bundle scripts/gpu-run.sh made:
#
#   bash scripts/gpu-remote.sh
#
# Runs nvidia-smi -L, then every bundle/bin/*_test binary, then (where compute-sanitizer
# exists) each again under compute-sanitizer memcheck on a representative subset, and prints
# a short table last. Logs go under $OUT (the device tool brings that folder back; at most 8
# files come back, so more than 7 logs are packed into one gpu-logs.tar.gz).
#
# Environment: GPU_TEST_TIMEOUT (seconds per binary, default 150), MEMCHECK=0 (skip the
# sanitizer), MEMCHECK_ONLY (the binaries to run under it, space-separated; default all), MEMCHECK_TIMEOUT (seconds per binary, default 120), MEMCHECK_FILTER (gtest filter
# of the memcheck run; default per binary below), GTEST_FILTER (the plain run's filter).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# NVLink multicast stays off on these machines (it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
test_timeout=${GPU_TEST_TIMEOUT:-150}
mc_timeout=${MEMCHECK_TIMEOUT:-120}
sanitizer=/usr/local/cuda/bin/compute-sanitizer
[ -x "$sanitizer" ] || sanitizer=$(command -v compute-sanitizer || true)

nvidia-smi -L 2>&1 | tee "$OUT/nvidia-smi.txt"
uname -r

# The memcheck subset of a binary: every kernel shape (16-bit float conversions, 8-bit
# integers with division, float64, copy widths, grid-stride sweeps) without the full matrix.
memcheck_filter() {
  case "$1" in
    cuda_reduce_test)
      local r=All/GpuReduce.*
      echo "$r/Float16Avg:$r/BFloat16Max:$r/Float32Sum:$r/Float64Min:$r/Int8Max:$r/UInt8Prod:$r/Int32Avg:$r/Int64Min:All/GpuFinishAvg.*/BFloat16:All/GpuFinishAvg.*/Int8:Floats/GpuArithmeticNaN.*:GpuCopy.*:GpuLaunch.*:GpuReduceLarge.*" ;;
    node_gpu_test)
      # Every one-node protocol and collective at 3 ranks (two-shot forced) and 4 (defaults).
      echo 'Shapes/OneNode.*/x3_TwoShot:Shapes/OneNode.*/x4_OneShot' ;;
    *) echo '*' ;;
  esac
}

# Counts from a gtest log: "passed failed skipped".
counts() {
  local p f s
  p=$(grep -oE '^\[  PASSED  \] [0-9]+' "$1" | grep -oE '[0-9]+$' | tail -1)
  f=$(grep -oE '^\[  FAILED  \] [0-9]+ test' "$1" | grep -oE '[0-9]+' | tail -1)
  s=$(grep -oE '^\[  SKIPPED \] [0-9]+ test' "$1" | grep -oE '[0-9]+' | tail -1)
  echo "${p:-0} ${f:-0} ${s:-0}"
}

rows=()
status=0
for bin in bundle/bin/*_test; do
  [ -x "$bin" ] || continue
  name=$(basename "$bin")
  log="$OUT/$name.log"
  t0=$(date +%s%N)
  timeout -k 10 "$test_timeout" "$bin" --gtest_filter="${GTEST_FILTER:-*}" >"$log" 2>&1
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  read -r p f s < <(counts "$log")
  grep -E '^\[  FAILED  \]' "$log" | head -20
  rows+=("$(printf '%-22s %-9s %5s %6s %7s %4s %8s' "$name" plain "$p" "$f" "$s" "$rc" "$secs")")
  ((rc == 0)) || status=1

  # MEMCHECK_ONLY: a space-separated list of the binaries to run under memcheck (default all).
  in_memcheck=1
  [ -n "${MEMCHECK_ONLY:-}" ] && [[ " $MEMCHECK_ONLY " != *" $name "* ]] && in_memcheck=0
  if ((in_memcheck == 0)); then
    :
  elif [ "${MEMCHECK:-1}" != 0 ] && [ -n "$sanitizer" ]; then
    mlog="$OUT/$name.memcheck.log"
    t0=$(date +%s%N)
    timeout -k 10 "$mc_timeout" "$sanitizer" --tool memcheck --leak-check no --error-exitcode 99 \
      "$bin" --gtest_filter="${MEMCHECK_FILTER:-$(memcheck_filter "$name")}" >"$mlog" 2>&1
    rc=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
    read -r p f s < <(counts "$mlog")
    summary=$(grep -E '^========= ERROR SUMMARY' "$mlog" | tail -1)
    rows+=("$(printf '%-22s %-9s %5s %6s %7s %4s %8s  %s' "$name" memcheck "$p" "$f" "$s" "$rc" "$secs" "${summary#========= }")")
    ((rc == 0)) || status=1
  elif [ "${MEMCHECK:-1}" != 0 ]; then
    rows+=("$(printf '%-22s %-9s  compute-sanitizer not found' "$name" memcheck)")
  fi
done

# At most 8 files come back: pack the logs when there are more.
nfiles=$(find "$OUT" -maxdepth 1 -type f | wc -l)
if ((nfiles > 7)); then
  (cd "$OUT" && tar -czf gpu-logs.tar.gz --remove-files ./*.log ./*.txt 2>/dev/null)
fi

{
  echo
  printf '%-22s %-9s %5s %6s %7s %4s %8s\n' binary run passed failed skipped rc seconds
  printf '%s\n' "${rows[@]}"
  echo "overall: $([ $status = 0 ] && echo PASS || echo FAIL)"
} | tee "$OUT/summary.txt"
exit $status

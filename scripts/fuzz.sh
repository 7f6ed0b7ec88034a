#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/*_fuzz.cc) with clang, ASan and UBSan into build-fuzz,
# then runs each for SECONDS (default 10) on its seeds (fuzz/corpus/NAME) plus what earlier
# runs found (build-fuzz/corpus/NAME), one target at a time, at nice 19. Prints one line per
# target: executions, coverage, features, crashes. Exits 1 when a target crashed (the input
# is left in build-fuzz/NAME-crash-*).
#
#   scripts/fuzz.sh [SECONDS] [NAME...]    NAME: framing trainer_request hello rank_socket_frames verbs_slot
#   scripts/fuzz.sh --build                 builds them and runs nothing (scripts/setup.sh)
# GRADSYNC_FUZZ_BUILD_DIR: where (default build-fuzz; CTest fuzz_short uses build/fuzz-clang).
set -euo pipefail
cd "$(dirname "$0")/.."
build_only=0
if [ "${1:-}" = --build ]; then
  build_only=1
  shift
fi
secs=${1:-10}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(framing trainer_request hello rank_socket_frames verbs_slot)
build=${GRADSYNC_FUZZ_BUILD_DIR:-build-fuzz}

if ! command -v clang++ >/dev/null; then
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends clang
fi
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DGRADSYNC_FUZZ=ON -DGRADSYNC_SANITIZE=address,undefined -DGRADSYNC_WITH_CUDA=OFF -DGRADSYNC_BUILD_TESTS=OFF \
  "${launcher[@]}" >/dev/null
nice cmake --build "$build" -j "${GRADSYNC_JOBS:-2}" --target "${targets[@]/%/_fuzz}" >/dev/null
((build_only)) && exit 0

failed=0
for t in "${targets[@]}"; do
  mkdir -p "$build/corpus/$t"
  log="$build/$t.log"
  set +e
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 nice -n 19 "$build/bin/${t}_fuzz" \
    -max_total_time="$secs" -max_len=61440 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$build/$t-" "$build/corpus/$t" "fuzz/corpus/$t" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  crashes=$( (ls "$build/$t-"crash-* "$build/$t-"leak-* "$build/$t-"timeout-* 2>/dev/null || true) | wc -l)
  printf 'fuzz %-20s %4ss  execs %-10s cov %-6s ft %-6s exit %s  crashes %s\n' "$t" "$secs" "${execs:-?}" "${cov:-?}" \
    "${ft:-?}" "$rc" "$crashes"
  if [ "$rc" -ne 0 ]; then
    failed=1
    tail -40 "$log"
  fi
done
exit "$failed"

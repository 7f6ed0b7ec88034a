#!/usr/bin/env bash
# Builds the unit and integration tests with AddressSanitizer and UndefinedBehaviorSanitizer
# (gcc, -O1) into build-asan, without CUDA, and runs them at nice 19, then the coordinator's
# load generator at 1,024 nodes (GRADSYNC_ASAN_LOADGEN=0: not). Extra arguments go to ctest
# (e.g. -R Flood). Exit status: ctest's, or 1 where the load generator failed or a process left
# a sanitizer report.
# A full build is about 140 objects: give it a machine that is not shared (docs/security.md,
# "Sanitizers").
set -euo pipefail
cd "$(dirname "$0")/.."
build=${GRADSYNC_ASAN_BUILD_DIR:-build-asan}
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" -DGRADSYNC_SANITIZE=address,undefined \
  -DGRADSYNC_WITH_CUDA=OFF "${launcher[@]}" >/dev/null
# GRADSYNC_ASAN_TARGETS: build only these (and what they need), then pass ctest a -R for them.
targets=()
[ -n "${GRADSYNC_ASAN_TARGETS:-}" ] && targets=(--target ${GRADSYNC_ASAN_TARGETS})
nice -n 19 cmake --build "$build" -j "${GRADSYNC_JOBS:-2}" "${targets[@]}" >/dev/null
# detect_leaks=0: processes the tests kill (SIGKILL) or that exit with _exit leave no report;
# leaks are not what this run is for. halt_on_error: the first report fails the test.
# Reports of child processes: the integration tests' daemons, coordinator and workers write
# into a directory the harness deletes, and a test does not always notice a child that died
# after its part was done. So their directories are kept in a TMPDIR of this run and searched
# for reports afterwards, and ASan writes each process's report to a file of its own under it
# (log_path; gcc's UBSan beside ASan ignores log_path and prints to the process's stderr, which
# is in those directories). The run fails when a report is found, whatever ctest said.
tmp=$(mktemp -d /tmp/gradsync-asan.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export TMPDIR=$tmp GRADSYNC_KEEP_TEST_DIR=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path=$tmp/asan}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# Left out of ctest:
# - torch_ddp_gradsync loads the instrumented extension into an uninstrumented python, which
#   ASan's runtime does not allow (it must come first in the process; not tried here);
# - coordinator_scale_1024x8 bounds time, and its 1,024 simulated nodes register more slowly
#   than their 5 s lease under ASan on a shared 2-core machine (7.7 s: nodes are declared lost).
#   The same shape runs below with a 30 s lease and the fan-out steps, without a time bound.
# - with GRADSYNC_ASAN_TARGETS, package_install_check and train_mlp_libtorch_4_ranks, which need
#   what only the whole build makes (libgradsync.so to install, the LibTorch example).
# GRADSYNC_ASAN_EXCLUDE: more tests to leave out (a ctest -E regex).
exclude='torch_ddp_gradsync|coordinator_scale_1024x8'
[ -n "${GRADSYNC_ASAN_TARGETS:-}" ] && exclude="$exclude|package_install_check|train_mlp_libtorch_4_ranks"
[ -n "${GRADSYNC_ASAN_EXCLUDE:-}" ] && exclude="$exclude|$GRADSYNC_ASAN_EXCLUDE"
rc=0
nice -n 19 ctest --test-dir "$build" --output-on-failure --timeout 900 -L 'unit|integration' -E "$exclude" -j 1 "$@" || rc=$?
if [ -x "$build/bin/gradsync-loadgen" ] && [ "${GRADSYNC_ASAN_LOADGEN:-1}" != 0 ]; then
  echo "asan-tests: gradsync-loadgen --nodes 1024 --ranks 8 --lease-ms 30000 --fanout"
  if nice -n 19 "$build/bin/gradsync-loadgen" --nodes 1024 --ranks 8 --lease-ms 30000 --fanout >"$tmp/loadgen.log" 2>&1; then
    grep -v '^[0-9]\{4\}-' "$tmp/loadgen.log" || true  # its summary, without the coordinator's log lines
  else
    echo "asan-tests: gradsync-loadgen failed:"; tail -20 "$tmp/loadgen.log"; rc=1
  fi
fi
found=$(grep -rlE -D skip 'runtime error:|ERROR: AddressSanitizer|SUMMARY: (Address|UndefinedBehavior)Sanitizer' "$tmp" || true)
if [ -n "$found" ]; then
  for f in $found; do echo "== $f"; grep -A30 -E 'runtime error:|ERROR: AddressSanitizer' "$f" | head -40; done
  echo "asan-tests: sanitizer reports above; the test directories stay in $tmp" >&2
  trap - EXIT
  [ "$rc" -ne 0 ] || rc=1
fi
exit "$rc"

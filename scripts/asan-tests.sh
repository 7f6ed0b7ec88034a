#!/usr/bin/env bash
# Builds the unit and integration tests with AddressSanitizer and UndefinedBehaviorSanitizer
# (gcc, -O1) into build-asan, without CUDA, and runs them at nice 19. Extra arguments go to
# ctest (e.g. -R Flood). Exit status: ctest's. A full build is about 140 objects: give it a
# machine that is not shared (docs/security.md, "Sanitizers").
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
nice cmake --build "$build" -j "${GRADSYNC_JOBS:-2}" "${targets[@]}" >/dev/null
# detect_leaks=0: processes the tests kill (SIGKILL) or that exit with _exit leave no report;
# leaks are not what this run is for. halt_on_error: the first report fails the test.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:halt_on_error=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# torch_ddp_gradsync loads the instrumented extension into an uninstrumented python, which
# ASan's runtime does not allow (it must come first in the process; not tried here): left out.
nice -n 19 ctest --test-dir "$build" --output-on-failure --timeout 900 -L 'unit|integration' -E torch_ddp_gradsync -j 1 "$@"

#!/usr/bin/env bash
# Sets up, builds and runs every test (unit tests with ranks as threads; integration tests
# that start the real coordinator and daemons as processes on loopback). GPU tests skip
# themselves on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
build=${GRADSYNC_BUILD_DIR:-build}
# --timeout: no test may hang CI; each test also carries its own timeout.
ctest --test-dir "$build" --output-on-failure --timeout 600 -j "${GRADSYNC_TEST_JOBS:-2}" "$@"

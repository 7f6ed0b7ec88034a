#!/usr/bin/env bash
# Sets up, builds and runs the main job: a data-parallel training loop with 4 ranks under
# gradsyncrun --standalone (an embedded coordinator and daemon on this machine).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
build=${GRADSYNC_BUILD_DIR:-build}
exec "$build/bin/gradsyncrun" --standalone -n "${NPROC:-4}" "$build/bin/train_logreg" "$@"

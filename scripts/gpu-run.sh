#!/usr/bin/env bash
# Builds the GPU tests here (no GPU needed) and packs them for the borrowed GPU machine.
#
#   scripts/gpu-run.sh [TARGET_OR_FILE...]
#
# - configures build-gpu/ (RelWithDebInfo, -DGRADSYNC_WITH_CUDA=ON; GRADSYNC_GPU_BUILD_DIR
#   overrides) and builds every tests/gpu/*_test.cc binary plus the extra arguments: a name
#   is a CMake target whose binary lands in build-gpu/bin/, a path is an existing file;
# - packs them with /work/shared/tools/bundle-deps into bundle/ (git-ignored: /bundle*/),
#   binaries stripped of debug info so that the carried tree stays under 64 MiB;
# - prints the device `run` call that runs scripts/gpu-remote.sh there.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
build=${GRADSYNC_GPU_BUILD_DIR:-build-gpu}
bundle=bundle
bundler=${GRADSYNC_BUNDLE_DEPS:-/work/shared/tools/bundle-deps}
gen=()
command -v ninja >/dev/null && [ ! -f "$build/CMakeCache.txt" ] && gen=(-G Ninja)

mkdir -p "$build"
cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADSYNC_WITH_CUDA=ON \
  >"$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }

tests=()
for src in tests/gpu/*_test.cc tests/gpu/*_test.cu; do
  [ -e "$src" ] || continue
  name=$(basename "$src"); tests+=("${name%.*}")
done
((${#tests[@]})) || { echo "gpu-run: no tests/gpu/*_test.cc" >&2; exit 1; }
# The processes the GPU tests start (coordinator, daemons, rank workers).
targets=("${tests[@]}" gradsync-coordinator gradsyncd gpu_worker)
files=()
for arg in "$@"; do
  if [ -f "$arg" ]; then files+=("$arg"); else targets+=("$arg"); fi
done

start=$(date +%s)
cmake --build "$build" --target "${targets[@]}" -j "${GRADSYNC_BUILD_JOBS:-$(nproc)}"
echo "gpu-run: built ${targets[*]} in $(( $(date +%s) - start )) s"

bins=()
for t in "${targets[@]}"; do bins+=("$build/bin/$t"); done
bins+=("${files[@]}")
rm -rf "$bundle"
"$bundler" "$bundle" "${bins[@]}"
strip --strip-debug "$bundle"/bin/* "$bundle"/lib/* 2>/dev/null || true
size=$(du -sb "$bundle" | cut -f1)
echo "gpu-run: $bundle/ is $((size / 1024)) KiB ($(ls "$bundle/bin" | tr '\n' ' '))"
if ((size > 56 * 1024 * 1024)); then
  echo "gpu-run: WARNING: bundle over 56 MiB; with the tree it may pass the 64 MiB carry limit" >&2
fi

cat <<EOF

Run on the GPU machine with the device tool (one GPU is enough for these tests):
  run(kind="nvidia-h200", carry=["$bundle"], timeout_s=300,
      command="bash scripts/gpu-remote.sh")
Environment for that command: GPU_TEST_TIMEOUT (s, per binary, default 150),
MEMCHECK=0 to skip compute-sanitizer, MEMCHECK_FILTER (gtest filter for the memcheck run),
GTEST_FILTER (for the plain run). Logs come back under \$OUT; the table is printed last.
EOF

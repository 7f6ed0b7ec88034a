#!/usr/bin/env bash
# Builds the Debian packages gradsync and gradsync-dev (CPack; docs/packaging.md) into
# ${GRADSYNC_PACKAGE_DIR:-build-package}/. CUDA kernels, where nvcc is found, for sm_80, 86, 89,
# 90, 100 and compute_100 PTX (GRADSYNC_CUDA_ARCHS overrides; every architecture is a full
# compile of each kernel unit). GRADSYNC_WITH_CUDA=OFF builds host-only packages.
set -euo pipefail
cd "$(dirname "$0")/.."
GRADSYNC_BUILD_DIR=${GRADSYNC_PACKAGE_DIR:-build-package}
archs=${GRADSYNC_CUDA_ARCHS:-"80-real;86-real;89-real;90-real;100-real;100-virtual"}
export GRADSYNC_BUILD_DIR GRADSYNC_FUZZ_BUILD=0
# setup.sh installs the build dependencies, configures and builds. Not packaged, so not built:
# the tests, and the LibTorch example and torch extension (minutes of compile each).
GRADSYNC_CMAKE_ARGS="-DCMAKE_INSTALL_PREFIX=/usr -DGRADSYNC_BUILD_TESTS=OFF -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON \
  -DGRADSYNC_CUDA_ARCHS=$archs \
  -DGRADSYNC_WITH_CUDA=${GRADSYNC_WITH_CUDA:-AUTO} ${GRADSYNC_CMAKE_ARGS:-}" ./scripts/setup.sh
command -v dpkg-shlibdeps >/dev/null || apt-get install -y -qq dpkg-dev >/dev/null
rm -rf "$GRADSYNC_BUILD_DIR/_CPack_Packages"  # no stale staging from an interrupted run
(cd "$GRADSYNC_BUILD_DIR" && cpack -G DEB >cpack.log 2>&1) || { tail -30 "$GRADSYNC_BUILD_DIR/cpack.log"; exit 1; }
for deb in "$GRADSYNC_BUILD_DIR"/gradsync*.deb; do
  echo "== $deb"
  dpkg-deb --field "$deb" Package Version Depends
done

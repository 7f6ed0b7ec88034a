#!/usr/bin/env bash
# Installs the Debian 12 packages gradsync builds with, when missing, then configures and
# builds into ./build. Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev
          protobuf-compiler libspdlog-dev libgtest-dev libgmock-dev libibverbs-dev
          # the daemon protocol inside libgradsync.so without libprotobuf (client/daemon_wire.h):
          # nanopb's generator and its static runtime (docs/packaging.md)
          nanopb libnanopb-dev
          # deploy/ manifest check (tests/deploy/check_manifests.py)
          python3-yaml
          # /metrics of gradsyncd and the coordinator (docs/observability.md)
          libcivetweb-dev
          # LibTorch (examples/train_mlp_libtorch.cc) and torch for /usr/bin/python3 with the
          # headers its extensions build with (integrations/torch): about 1 min 45 s to install
          # on the 2-core VM (178 packages), docs/training-loop.md.
          libtorch-dev python3-torch python3-dev pybind11-dev
          # libFuzzer and its sanitizers for the fuzz targets (scripts/fuzz.sh, CTest fuzz_short)
          clang
          # etcd 3.4 for the coordinator's --store tests (coordinator_store_test,
          # coordinator_takeover_test start their own on free ports)
          etcd-server
          # `ip netns` for the network faults of scripts/chaos.sh (CTest chaos_network_short,
          # which also needs root and skips without); nft for its data cut (kind datacut) and
          # data_connection_test's silent peer
          iproute2 nftables)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

build=${GRADSYNC_BUILD_DIR:-build}
jobs=${GRADSYNC_JOBS:-$(nproc)}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo ${GRADSYNC_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$jobs"
# The libFuzzer targets (clang, ASan+UBSan) for CTest's fuzz_short: a dozen runtime files
# (GRADSYNC_FUZZ_BUILD=0 skips them: scripts/package.sh, which builds no tests).
if [ "${GRADSYNC_FUZZ_BUILD:-1}" != 0 ]; then
  GRADSYNC_JOBS=$jobs GRADSYNC_FUZZ_BUILD_DIR="$build/fuzz-clang" ./scripts/fuzz.sh --build
fi

#!/usr/bin/env bash
# Checks gradsync as a user gets it: an out-of-tree trainer (examples/consumer) built against
# the installed library with find_package and, separately, with pkg-config; neither link line
# names gRPC or protobuf, and neither libgradsync.so's DT_NEEDED nor the consumer's `ldd` shows
# them (the daemon's frames go through nanopb inside libgradsync.so: docs/packaging.md); a
# 2-rank allreduce through an installed gradsync-coordinator and gradsyncd started with the
# units' command lines.
#
#   scripts/package-check.sh prefix BUILD_DIR   cmake --install BUILD_DIR into a scratch prefix
#                                               (the CTest package_install_check; ~1 min)
#   scripts/package-check.sh chroot DEB_DIR     a fresh Debian 12 chroot (debootstrap), then
#                                               apt-get install ./gradsync_*.deb ./gradsync-dev_*.deb
#                                               (needs root and the network; ~10 min;
#                                               GRADSYNC_CHROOT_BASE=DIR copies a debootstrap'ed
#                                               tree instead of making one)
#   scripts/package-check.sh installed PREFIX   the check itself, against PREFIX (used by both)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)

say() { echo "package-check: $*"; }
die() { echo "package-check: FAILED: $*" >&2; exit 1; }

# The check against an installed prefix; runs where cmake, a C++ compiler and pkg-config are.
installed() {
  local prefix=$1 work pids=()
  work=$(mktemp -d "${TMPDIR:-/tmp}/gradsync-consumer.XXXXXX")
  cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
  trap cleanup EXIT
  local libdir
  libdir=$(dirname "$(find "$prefix" -name 'libgradsync.so' -path '*/lib*' | head -1)")
  [ -f "$libdir/libgradsync.so" ] || die "no libgradsync.so under $prefix"

  say "headers: $(cd "$prefix/include" && find gradsync -type f | sort | tr '\n' ' ')"
  local stray
  if [ "$prefix" = /usr ]; then  # the packages' headers, among the system's
    stray=$(dpkg -L gradsync gradsync-dev | grep '^/usr/include/.*\.' | grep -v '^/usr/include/gradsync/[a-z_]*\.h$' | head -5 || true)
  else
    stray=$(cd "$prefix/include" && find . -type f ! -path './gradsync/*.h' | head -5)
  fi
  [ -z "$stray" ] || die "files other than the public headers under $prefix/include: $stray"
  say "SONAME: $(objdump -p "$libdir/libgradsync.so" | awk '/SONAME/{print $2}')"
  say "libgradsync.so NEEDED: $(objdump -p "$libdir/libgradsync.so" | awk '/NEEDED/{print $2}' | tr '\n' ' ')"
  ! objdump -p "$libdir/libgradsync.so" | grep -Eq 'NEEDED.*(grpc|protobuf)' || die "libgradsync.so needs gRPC or protobuf"

  export CMAKE_PREFIX_PATH=$prefix PKG_CONFIG_PATH=$libdir/pkgconfig
  cp -r "$here/examples/consumer" "$work/src"
  say "find_package build"
  cmake -S "$work/src" -B "$work/cmake" >"$work/cmake.log" 2>&1 || { cat "$work/cmake.log"; die "cmake (find_package)"; }
  cmake --build "$work/cmake" >>"$work/cmake.log" 2>&1 || { cat "$work/cmake.log"; die "build (find_package)"; }
  say "pkg-config build ($(pkg-config --libs --cflags gradsync))"
  cmake -S "$work/src" -B "$work/pc" -DUSE_PKG_CONFIG=ON >"$work/pc.log" 2>&1 || { cat "$work/pc.log"; die "cmake (pkg-config)"; }
  cmake --build "$work/pc" >>"$work/pc.log" 2>&1 || { cat "$work/pc.log"; die "build (pkg-config)"; }
  local link
  for b in cmake pc; do
    link=$(find "$work/$b" -name link.txt | xargs cat)
    if grep -Eq 'grpc|protobuf' <<<"$link"; then die "the $b link line names gRPC or protobuf: $link"; fi
  done
  export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  say "ldd consumer:"
  ldd "$work/pc/consumer" | sed 's/^/    /'
  for b in cmake pc; do
    if ldd "$work/$b/consumer" | grep -Eq 'grpc|protobuf'; then die "ldd of the $b consumer shows gRPC or protobuf"; fi
  done

  # The services' command lines (packaging/systemd/*.service), in a scratch runtime directory;
  # with GRADSYNC_CHECK_USERS=1 (the chroot) as the units run them: coordinator and daemon as
  # user gradsync in /run/gradsync (0750), the ranks as another user in group gradsync.
  local run=$work/run bin=$prefix/bin as_daemon=() as_trainer=()
  mkdir -m 0750 "$run"
  if [ "${GRADSYNC_CHECK_USERS:-0}" = 1 ]; then
    run=/run/gradsync
    install -d -m 0750 -o gradsync -g gradsync "$run"
    getent passwd trainer >/dev/null || useradd --create-home --groups gradsync trainer
    chmod 0755 "$work"
    as_daemon=(runuser -u gradsync --)
    as_trainer=(runuser -u trainer --)
    say "daemon as $(id gradsync); ranks as $(id trainer)"
  fi
  # The node credential the coordinator requires (coordinator/authz.h), as the units pass it.
  local secret=$work/cluster-secret
  head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$secret"
  chmod 0600 "$secret"
  if [ "${GRADSYNC_CHECK_USERS:-0}" = 1 ]; then chown gradsync:gradsync "$secret"; fi
  "${as_daemon[@]}" "$bin/gradsync-coordinator" --cluster-secret-file "$secret" --listen 127.0.0.1:0 --port-file "$run/port" >"$work/coordinator.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do [ -s "$run/port" ] && break; sleep 0.1; done
  [ -s "$run/port" ] || { cat "$work/coordinator.log"; die "coordinator did not start"; }
  "${as_daemon[@]}" "$bin/gradsyncd" --cluster-secret-file "$secret" --coordinator "127.0.0.1:$(cat "$run/port")" --socket "$run/gradsyncd.sock" \
    --ready-file "$run/ready" >"$work/daemon.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do [ -e "$run/ready" ] && break; sleep 0.1; done
  [ -e "$run/ready" ] || { cat "$work/daemon.log"; die "gradsyncd did not start"; }
  say "socket: $(ls -l "$run/gradsyncd.sock")"
  for exe in "$work/cmake/consumer" "$work/pc/consumer"; do
    say "2 ranks of $exe through the installed gradsyncd"
    "${as_trainer[@]}" env GRADSYNC_JOB_TOKEN=package-check LD_LIBRARY_PATH="$LD_LIBRARY_PATH" timeout 60 \
      "$bin/gradsyncrun" --daemon "$run/gradsyncd.sock" --job-id "check-$(basename "$(dirname "$exe")")" -n 2 "$exe" \
      || { cat "$work/daemon.log"; die "the 2-rank job failed"; }
  done
  cleanup
  trap - EXIT
  rm -rf "$work"
  say "ok"
}

prefix_mode() {
  local build=$1 prefix
  prefix=$(mktemp -d "${TMPDIR:-/tmp}/gradsync-prefix.XXXXXX")
  cmake --install "$build" --prefix "$prefix" >/dev/null
  installed "$prefix"
  rm -rf "$prefix"
}

root=""  # chroot_mode's tree; global for the EXIT trap
chroot_mode() {
  local debs
  debs=$(cd "$1" && pwd)
  [ "$(id -u)" = 0 ] || die "chroot mode needs root"
  command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
  root=$(mktemp -d /var/tmp/gradsync-chroot.XXXXXX)
  if [ -n "${GRADSYNC_CHROOT_BASE:-}" ]; then  # a fresh debootstrap made earlier, copied
    say "copying the fresh Debian 12 tree $GRADSYNC_CHROOT_BASE to $root"
    cp -a "$GRADSYNC_CHROOT_BASE/." "$root/"
  else
    say "debootstrap bookworm into $root"
    debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >"$root.log" 2>&1 \
      || { tail -20 "$root.log"; die "debootstrap"; }
  fi
  mount -t proc proc "$root/proc"
  mount --bind /dev "$root/dev"
  trap 'umount "$root/dev" "$root/proc" 2>/dev/null || true; echo "package-check: the chroot stays in $root" >&2' EXIT
  mkdir -p "$root/debs" "$root/gradsync/scripts" "$root/gradsync/examples"
  cp "$debs"/gradsync*.deb "$root/debs/"
  cp "$here/scripts/package-check.sh" "$root/gradsync/scripts/"
  cp -r "$here/examples/consumer" "$root/gradsync/examples/"
  say "apt-get install the packages and a compiler in the chroot"
  chroot "$root" bash -c 'export DEBIAN_FRONTEND=noninteractive; apt-get update -qq &&
    apt-get install -y -qq --no-install-recommends /debs/gradsync_*.deb /debs/gradsync-dev_*.deb \
      cmake g++ make pkg-config binutils >/tmp/apt.log 2>&1 || { tail -30 /tmp/apt.log; exit 1; }
    dpkg -l "gradsync*" | tail -2' || die "apt-get install in the chroot"
  chroot "$root" env GRADSYNC_CHECK_USERS=1 /gradsync/scripts/package-check.sh installed /usr
  umount "$root/dev" "$root/proc"
  trap - EXIT
  rm -rf "$root" "$root.log"
}

case "${1:-}" in
  prefix) prefix_mode "${2:?BUILD_DIR}" ;;
  chroot) chroot_mode "${2:?DEB_DIR}" ;;
  installed) installed "${2:?PREFIX}" ;;
  *) sed -n '2,13p' "$0"; exit 2 ;;
esac

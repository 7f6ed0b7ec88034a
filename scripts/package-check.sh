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
#   scripts/package-check.sh nspawn DEB_DIR     the same tree with systemd, booted by systemd-nspawn
#                                               --boot: the packaged units started by systemctl, the
#                                               ranks through their socket (needs root, the network,
#                                               systemd-container)
#   scripts/package-check.sh cuda DEB_DIR       the CUDA packages in a fresh Debian 12 tree, installed
#                                               by dpkg with cuda-cudart-13-0 ignored (NVIDIA's apt
#                                               repository has it); the installed library's
#                                               fatbinaries must hold ELF sm_80, 86, 89, 90, 100 and PTX
#   scripts/package-check.sh installed PREFIX   the check itself, against PREFIX (used by all three)
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
  if [ "$prefix" = /usr ]; then  # the units' settings files, where the units read them
    local unit f conf
    for unit in $(dpkg -L gradsync | grep '/systemd/system/.*\.service$'); do
      for f in $(sed -n 's/^EnvironmentFile=-\{0,1\}//p' "$unit"); do
        [ -f "$f" ] || die "$f, the EnvironmentFile of $unit, is not installed (the package has: $(dpkg -L gradsync | grep /default/ | tr '\n' ' '))"
        if dpkg-query -W -f='${Conffiles}\n' gradsync | grep -q "^ $f "; then conf=yes; else conf=no; fi
        say "$(basename "$unit") reads $f (a conffile: $conf)"
      done
    done
  fi
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

  # Coordinator and daemon: with GRADSYNC_CHECK_SYSTEMD=1 (the nspawn mode) the packaged units,
  # started by systemctl; otherwise the units' command lines (packaging/systemd/*.service), in a
  # scratch runtime directory, or with GRADSYNC_CHECK_USERS=1 (the chroot) as the units run them:
  # as user gradsync in /run/gradsync (0750). With either variable the ranks run as another user,
  # in group gradsync.
  local run=$work/run bin=$prefix/bin as_trainer=() daemon_log=(cat "$work/daemon.log")
  mkdir -m 0750 "$run"
  if [ "${GRADSYNC_CHECK_USERS:-0}" = 1 ] || [ "${GRADSYNC_CHECK_SYSTEMD:-0}" = 1 ]; then
    run=/run/gradsync
    getent passwd trainer >/dev/null || useradd --create-home --groups gradsync trainer
    chmod 0755 "$work"
    as_trainer=(runuser -u trainer --)
    say "ranks as $(id trainer)"
  fi
  if [ "${GRADSYNC_CHECK_SYSTEMD:-0}" = 1 ]; then
    daemon_log=(journalctl --no-pager -n 60 -u gradsync-coordinator -u gradsyncd)
    start_units
  else
    start_by_hand
  fi
  say "socket: $(ls -l "$run/gradsyncd.sock")"
  for exe in "$work/cmake/consumer" "$work/pc/consumer"; do
    say "2 ranks of $exe through the installed gradsyncd"
    "${as_trainer[@]}" env GRADSYNC_JOB_TOKEN=package-check LD_LIBRARY_PATH="$LD_LIBRARY_PATH" timeout 60 \
      "$bin/gradsyncrun" --daemon "$run/gradsyncd.sock" --job-id "check-$(basename "$(dirname "$exe")")" -n 2 "$exe" \
      || { "${daemon_log[@]}"; die "the 2-rank job failed"; }
  done
  cleanup
  trap - EXIT
  rm -rf "$work"
  say "ok"
}

# installed()'s coordinator and daemon, started here with the units' command lines (its $work,
# $run, $bin and $pids).
start_by_hand() {
  local as_daemon=()
  if [ "${GRADSYNC_CHECK_USERS:-0}" = 1 ]; then
    install -d -m 0750 -o gradsync -g gradsync "$run"
    as_daemon=(runuser -u gradsync --)
    say "daemon as $(id gradsync)"
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
}

# The packaged units under the running systemd, with their /etc/default files and the cluster
# secret postinst made (installed()'s $run).
start_units() {
  local units=(gradsync-coordinator.service gradsyncd.service)
  say "systemctl start ${units[*]}"
  systemctl start "${units[@]}" \
    || { systemctl status --no-pager "${units[@]}" || true; "${daemon_log[@]}"; die "systemctl start"; }
  for _ in $(seq 100); do [ -S "$run/gradsyncd.sock" ] && break; sleep 0.1; done
  [ -S "$run/gradsyncd.sock" ] \
    || { systemctl status --no-pager "${units[@]}" || true; "${daemon_log[@]}"; die "gradsyncd.service made no socket in 10 s"; }
  systemctl status --no-pager "${units[@]}" | sed 's/^/    /' || true
  local u pid
  for u in "${units[@]}"; do
    pid=$(systemctl show -p MainPID --value "$u")
    say "$u: $(systemctl is-active "$u"), main process $(ps -o user=,group=,args= -p "$pid")"
  done
  pid=$(systemctl show -p MainPID --value gradsyncd.service)
  say "gradsyncd's flight recorder directory: $(tr '\0' '\n' <"/proc/$pid/environ" | grep '^LOGS_DIRECTORY=' || echo none),"\
    "$(ls -ld /var/log/gradsync 2>&1)"
}

prefix_mode() {
  local build=$1 prefix
  prefix=$(mktemp -d "${TMPDIR:-/tmp}/gradsync-prefix.XXXXXX")
  cmake --install "$build" --prefix "$prefix" >/dev/null
  installed "$prefix"
  rm -rf "$prefix"
}

root=""  # the fresh tree of chroot_mode and nspawn_mode; global for the EXIT trap
# A fresh Debian 12 tree in $root with both packages, a compiler and the extra packages given
# installed by apt, and this check and examples/consumer in /gradsync; /proc and /dev mounted.
# A fresh Debian 12 tree in $root (debootstrap, or a copy of GRADSYNC_CHROOT_BASE), /proc and
# /dev mounted, DEB_DIR's packages in /debs and the consumer example in /gradsync.
fresh_tree() {
  local debs
  debs=$(cd "$1" && pwd)
  shift
  [ "$(id -u)" = 0 ] || die "the chroot and nspawn modes need root"
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
}

# fresh_tree, then the packages, a compiler and "$@" by apt.
fresh_debian() {
  fresh_tree "$@"
  shift
  say "apt-get install the packages and a compiler${*:+ and $*} in the chroot"
  chroot "$root" bash -c 'export DEBIAN_FRONTEND=noninteractive; apt-get update -qq &&
    apt-get install -y -q --no-install-recommends /debs/gradsync_*.deb /debs/gradsync-dev_*.deb \
      cmake g++ make pkg-config binutils "$@" >/tmp/apt.log 2>&1 || { tail -30 /tmp/apt.log; exit 1; }
    dpkg -l "gradsync*" | tail -2
    dpkg-query -W -f="\${Package} Depends: \${Depends}\n" gradsync gradsync-dev' bash "$@" \
    || die "apt-get install in the chroot"
}

chroot_mode() {
  fresh_debian "$1"
  chroot "$root" env GRADSYNC_CHECK_USERS=1 /gradsync/scripts/package-check.sh installed /usr
  umount "$root/dev" "$root/proc"
  trap - EXIT
  rm -rf "$root" "$root.log"
}

# The CUDA packages' kernels as a user installs them. Their cuda-cudart-13-0 comes from NVIDIA's
# apt repository, which a plain Debian 12 tree lacks: every other dependency is installed by
# apt, the packages by dpkg with that one ignored. Then the installed library's fatbinaries are
# listed (cuobjdump where the CUDA toolkit has it, else scripts/fatbin-list.py).
cuda_mode() {
  fresh_tree "$1"
  say "apt-get install the dependencies but cuda-cudart-13-0, then dpkg -i the packages"
  chroot "$root" bash -c 'export DEBIAN_FRONTEND=noninteractive; apt-get update -qq &&
    deps=$(dpkg-deb -f /debs/gradsync_*.deb Depends | tr "," "\n" | sed "s/(.*//; s/ //g" | grep -v "^cuda-cudart") &&
    apt-get install -y -q --no-install-recommends $deps >/tmp/apt.log 2>&1 || { tail -30 /tmp/apt.log; exit 1; }
    dpkg -i --ignore-depends=cuda-cudart-13-0 /debs/gradsync_*.deb /debs/gradsync-dev_*.deb >/tmp/dpkg.log 2>&1 ||
      { tail -30 /tmp/dpkg.log; exit 1; }
    dpkg -l "gradsync*" | tail -2' || die "installing the CUDA packages"
  local lib list
  lib=$(chroot "$root" dpkg -L gradsync | grep "/libgradsync\.so\.[0-9]*\.[0-9]*\.[0-9]*$") || die "no libgradsync.so in the package"
  say "installed $lib, sha256 $(sha256sum "$root$lib" | cut -c1-16)"
  if command -v cuobjdump >/dev/null; then
    list=$( (cuobjdump --list-elf "$root$lib"; cuobjdump --list-ptx "$root$lib") | sed -n 's/.*\.\(sm_[0-9]*\)\.\(cubin\|ptx\)$/\2 \1/p' | sort | uniq -c)
  else
    list=$(python3 "$here/scripts/fatbin-list.py" "$root$lib")
  fi
  echo "$list"
  umount "$root/dev" "$root/proc"
  trap - EXIT
  rm -rf "$root"
  for arch in 80 86 89 90 100; do
    grep -Eq "(ELF|cubin) sm_$arch\b" <<<"$list" || die "no ELF for sm_$arch in the installed library"
  done
  grep -Eiq "ptx" <<<"$list" || die "no PTX in the installed library"
  say "ok"
}

# The fresh tree with systemd as its init, booted in a container: `systemctl start` of the
# packaged units, the 2-rank check through them, `systemd-analyze security` of both.
nspawn_mode() {
  command -v systemd-nspawn >/dev/null || apt-get install -y -qq systemd-container >/dev/null
  fresh_debian "$1" systemd systemd-sysv dbus procps
  umount "$root/dev" "$root/proc"
  # The drop-ins of GRADSYNC_UNIT_DROPIN_DIR (NAME.service.d/*.conf), e.g. the limits of a host
  # that cannot raise them (docs/packaging.md).
  if [ -n "${GRADSYNC_UNIT_DROPIN_DIR:-}" ]; then
    cp -r "$GRADSYNC_UNIT_DROPIN_DIR/." "$root/etc/systemd/system/"
    say "unit drop-ins: $(cd "$GRADSYNC_UNIT_DROPIN_DIR" && find . -name '*.conf' | sort | tr '\n' ' ')"
  fi
  local log=$root.boot.log nspawn leader="" state="" status=0
  say "systemd-nspawn --boot (console log: $log)"
  # --keep-unit --register=no: no scope or machined through the host's systemd, so that it also
  # boots where systemd is not PID 1 (without them: "Failed to open system bus").
  systemd-nspawn --boot --directory="$root" --machine="$(basename "$root" | tr -c 'a-zA-Z0-9\n' -)" \
    --keep-unit --register=no --private-network --console=pipe </dev/null >"$log" 2>&1 &
  nspawn=$!
  trap 'kill "$nspawn" 2>/dev/null || true; echo "package-check: the tree stays in $root, the boot log in $log" >&2' EXIT
  # The container's init: the nspawn process's child whose command is systemd.
  for _ in $(seq 300); do
    for pid in $(ps -o pid= --ppid "$nspawn"); do
      [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = systemd ] && leader=$pid
    done
    [ -n "$leader" ] && break
    kill -0 "$nspawn" 2>/dev/null || { tail -30 "$log"; die "systemd-nspawn exited"; }
    sleep 0.1
  done
  [ -n "$leader" ] || { tail -30 "$log"; die "no systemd in the container after 30 s"; }
  local inside=(nsenter --target "$leader" --all env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8)
  # Until its manager answers (before that systemctl cannot connect) and the boot is over (it
  # mounts /tmp on the way).
  for _ in $(seq 240); do
    state=$(timeout 120 "${inside[@]}" systemctl is-system-running --wait 2>/dev/null || true)
    case "$state" in running|degraded|maintenance|stopping) break ;; esac
    sleep 0.5
  done
  say "the container booted (init pid $leader on the host): systemctl is-system-running: $state"
  case "$state" in
    running) ;;
    degraded) "${inside[@]}" systemctl --failed --no-pager || true ;;
    *) tail -30 "$log"; die "the container's systemd did not finish booting in 120 s" ;;
  esac
  "${inside[@]}" env GRADSYNC_CHECK_SYSTEMD=1 /gradsync/scripts/package-check.sh installed /usr || status=$?
  if [ "$status" = 0 ]; then
    say "systemd-analyze security: what is left open, and the exposure (0-10, lower is tighter):"
    "${inside[@]}" systemd-analyze security --no-pager gradsyncd.service gradsync-coordinator.service \
      | grep -E '^(✗|→)' | sed 's/^/    /' || true
  fi
  kill "$nspawn"  # nspawn asks the container's systemd to power off
  for _ in $(seq 300); do kill -0 "$nspawn" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$nspawn" 2>/dev/null && { kill -KILL "$nspawn"; die "the container did not power off in 30 s"; }
  wait "$nspawn" || true
  trap - EXIT
  [ "$status" = 0 ] || { echo "package-check: the tree stays in $root, the boot log in $log" >&2; exit "$status"; }
  rm -rf "$root" "$root.log" "$log"
}

case "${1:-}" in
  prefix) prefix_mode "${2:?BUILD_DIR}" ;;
  chroot) chroot_mode "${2:?DEB_DIR}" ;;
  nspawn) nspawn_mode "${2:?DEB_DIR}" ;;
  cuda) cuda_mode "${2:?DEB_DIR}" ;;
  installed) installed "${2:?PREFIX}" ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac

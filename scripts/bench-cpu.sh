#!/usr/bin/env bash
# gradsync against the CPU anchors (Gloo ring and Open MPI, /work/shared/anchors/cpu), float32
# sum allreduce, 1 KiB to 256 MiB, all measured in one sitting on this machine, because only
# ratios measured side by side mean anything:
#   (a) one node, 2 and 4 ranks             (gradsyncrun --standalone; MPI ratio against shm)
#   (b) two nodes (two gradsyncd over loopback TCP) x 1 and x 2 ranks   (MPI ratio against tcp)
# A small shared machine is noisy (one busy neighbour halves a 2-core run), so everything runs
# in ROUNDS interleaved rounds and the tables show per-size medians over the rounds. Raw logs
# go to OUT_DIR (*.rR.txt per round); the merged tables go to stdout and OUT_DIR/summary.md.
#
#   scripts/bench-cpu.sh [OUT_DIR]          (default bench-out/)
#
# Environment: GRADSYNC_BUILD_DIR (default build), GRADSYNC_ANCHORS (the anchors' run.sh,
# default ../shared/anchors/cpu/run.sh beside the repository), ROUNDS (default 3: about
# 5 minutes on 2 cores).
set -euo pipefail
mkdir -p "${1:-bench-out}"
out=$(cd "${1:-bench-out}" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
build=${GRADSYNC_BUILD_DIR:-build}
# Multi-node jobs need a job token (gradsyncrun refuses one without): a random one per run,
# passed to every node through the environment, never on a command line.
export GRADSYNC_JOB_TOKEN=${GRADSYNC_JOB_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
# The coordinator started here and its daemons share a cluster secret (coordinator/authz.h).
export GRADSYNC_CLUSTER_SECRET=${GRADSYNC_CLUSTER_SECRET:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
anchors=${GRADSYNC_ANCHORS:-$repo/../shared/anchors/cpu/run.sh}
[ -x "$anchors" ] || { echo "bench-cpu: anchors script $anchors not found (set GRADSYNC_ANCHORS)" >&2; exit 2; }
rounds=${ROUNDS:-3}

# --- packages the anchors build with, installed like scripts/setup.sh does -----------------
missing=()
for p in libgloo-dev libopenmpi-dev openmpi-bin; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "bench-cpu: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# --- gradsync ----------------------------------------------------------------------------------
[ -f "$build/CMakeCache.txt" ] || GRADSYNC_BUILD_DIR=$build scripts/setup.sh
cmake --build "$build" -j "$(nproc)" --target gradsync-bench gradsyncrun gradsyncd gradsync-coordinator >/dev/null
bin=$(cd "$build/bin" && pwd)

# The anchors time 50 calls below 16 MiB and 5 from 16 MiB up (plus 2, median); gradsync-bench
# times as many, out-of-place like them, after 5 (2 for the large sizes) warm-up calls, and
# takes the slowest rank's figure (the anchors take rank 0's).
passes=("-b 1K -e 4M -f 4 -n 50 -w 5" "-b 16M -e 256M -f 4 -n 5 -w 2")
# TIMING=median (default): gradsync-bench times like the anchors, each call after a barrier and
# the median call; TIMING=mean: nccl-tests' mean of back-to-back calls, where one preempted
# call counts against gradsync.
common="-d float -o sum -c 1 --inplace 0 --timing ${TIMING:-median}"
failed=0

one_node() {  # N R: N ranks on one node, round R
  local log=$out/gradsync-1node-$1.r$2.txt p
  : > "$log"
  for p in "${passes[@]}"; do
    # shellcheck disable=SC2086
    "$bin/gradsyncrun" --standalone --no-prefix --timeout-s 600 -n "$1" "$bin/gradsync-bench" $p $common \
        >> "$log" 2>> "$out/gradsync-1node-$1.r$2.err" || { echo "bench-cpu: one node x $1 failed: see $log" >&2; failed=1; }
  done
}

two_nodes() {  # K R: K ranks on each of 2 nodes (a gradsyncrun with its own gradsyncd each), round R
  local log=$out/gradsync-2node-x$1.r$2.txt tmp pid port i p dest
  : > "$log"
  tmp=$(mktemp -d)
  "$bin/gradsync-coordinator" --listen 127.0.0.1:0 --port-file "$tmp/port" 2>> "$out/coordinator.err" &
  pid=$!
  for _ in $(seq 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
  port=$(cat "$tmp/port")
  for p in "${passes[@]}"; do
    local pids=() job=bench-x$1-$RANDOM
    for i in 0 1; do
      dest=$log  # node 0 holds rank 0, which prints the table
      [ "$i" = 1 ] && dest=/dev/null
      # shellcheck disable=SC2086
      "$bin/gradsyncrun" --start-daemon --coordinator "127.0.0.1:$port" --nnodes 2 --node-rank "$i" -n "$1" \
          --job-id "$job" --node-name "n$i" --no-prefix --timeout-s 600 "$bin/gradsync-bench" $p $common \
          >> "$dest" 2>> "$out/gradsync-2node-x$1.r$2.n$i.err" &
      pids+=($!)
    done
    for i in "${pids[@]}"; do wait "$i" || { echo "bench-cpu: two nodes x $1 failed: see $log" >&2; failed=1; }; done
  done
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true
  rm -rf "$tmp"
}

load_start=$(cut -d' ' -f1-3 /proc/loadavg)
for r in $(seq "$rounds"); do
  echo "bench-cpu: round $r of $rounds"
  for n in 2 4; do
    "$anchors" "$n" > "$out/anchors-$n.r$r.txt" 2>&1 || { echo "bench-cpu: anchors $n failed" >&2; failed=1; }
  done
  one_node 2 "$r"; one_node 4 "$r"; two_nodes 1 "$r"; two_nodes 2 "$r"
done
load_end=$(cut -d' ' -f1-3 /proc/loadavg)

# --- merge -------------------------------------------------------------------------------------
{
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p' | head -1)," \
       "load average $load_start at the start, $load_end at the end; medians of $rounds rounds"
  python3 - "$out" "$rounds" <<'PY'
import re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])

def read(path):
    try:
        return open(path, errors="replace").readlines()
    except OSError:
        return []

def busbw(size, time_us, n):  # from the time: the printed GB/s have too few digits
    return size / time_us / 1e3 * 2 * (n - 1) / n

def anchors(n, r):
    """{peer: {bytes: busbw}} from the anchors' run.sh output (median time per size)."""
    res, cur = {}, None
    for line in read(f"{out}/anchors-{n}.r{r}.txt"):
        if line.startswith("# gloo"): cur = "gloo"
        elif line.startswith("# open mpi, tcp"): cur = "mpi_tcp"
        elif line.startswith("# open mpi, shared"): cur = "mpi_shm"
        m = re.match(r"^\s*(\d+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s*$", line)
        if m and cur: res.setdefault(cur, {})[int(m[1])] = busbw(int(m[1]), float(m[2]), n)
    return res

def gradsync(path):
    """{bytes: busbw} of the out-of-place group of gradsync-bench's table."""
    res, n = {}, 0
    for line in read(path):
        m = re.search(r"nranks (\d+)", line)
        if m: n = int(m[1])
        f = line.split()
        if n and len(f) >= 9 and f[0].isdigit() and f[5] != "FAILED":
            res[int(f[0])] = busbw(int(f[0]), float(f[5]), n)
    return res

def median(series, b):
    v = [s[b] for s in series if b in s]
    return statistics.median(v) if v else None

def human(b): return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
def cell(v, fmt): return "-" if v is None else format(v, fmt)
def ratio(a, b): return None if a is None or not b else a / b

configs = [("one node, 2 ranks", "gradsync-1node-2", 2, "mpi_shm"),
           ("one node, 4 ranks", "gradsync-1node-4", 4, "mpi_shm"),
           ("2 nodes x 1 rank (2 ranks, loopback TCP)", "gradsync-2node-x1", 2, "mpi_tcp"),
           ("2 nodes x 2 ranks (4 ranks, loopback TCP)", "gradsync-2node-x2", 4, "mpi_tcp")]
for title, log, n, mpi in configs:
    g = [gradsync(f"{out}/{log}.r{r}.txt") for r in range(1, rounds + 1)]
    a = [anchors(n, r) for r in range(1, rounds + 1)]
    peer = {k: [x.get(k, {}) for x in a] for k in ("gloo", "mpi_tcp", "mpi_shm")}
    print(f"\n### {title}: busbw in GB/s; MPI ratio against {mpi[4:]}\n")
    print("| bytes | gradsync | Gloo | MPI tcp | MPI shm | vs Gloo | vs MPI |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    miss_gloo, miss_mpi = [], []
    for b in sorted(set().union(*g, *peer["gloo"])):
        gb, m = median(g, b), {k: median(v, b) for k, v in peer.items()}
        rg, rm = ratio(gb, m["gloo"]), ratio(gb, m[mpi])
        if rg is None or rg < 1.5: miss_gloo.append(human(b))
        if b >= 64 << 10 and (rm is None or rm < 1.0): miss_mpi.append(human(b))
        print(f"| {human(b)} | {cell(gb, '.3f')} | {cell(m['gloo'], '.3f')} | {cell(m['mpi_tcp'], '.3f')} | "
              f"{cell(m['mpi_shm'], '.3f')} | {cell(rg, '.2f')} | {cell(rm, '.2f')} |")
    print(f"\n>= 1.5x Gloo at every size: {'met' if not miss_gloo else 'NOT met at ' + ', '.join(miss_gloo)}.  "
          f">= 1.0x MPI {mpi[4:]} from 64 KiB: {'met' if not miss_mpi else 'NOT met at ' + ', '.join(miss_mpi)}.")
PY
} | tee "$out/summary.md"
exit $failed

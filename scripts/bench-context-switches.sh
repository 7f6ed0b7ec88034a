#!/usr/bin/env bash
# What bounds N ranks on a machine with fewer cores: time and context switches per allreduce of
# one size, gradsync (gradsyncrun --standalone, gradsync-bench) beside Open MPI over shared
# memory, each run twice (CALLS and 2 x CALLS calls) so that start-up cancels out of the
# difference. Uses getrusage of the children (python3), no perf.
#
#   scripts/bench-context-switches.sh [RANKS] [BYTES] [CALLS]     (default 4 65536 2000)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
n=${1:-4}; bytes=${2:-65536}; calls=${3:-2000}
build=${GRADSYNC_BUILD_DIR:-$repo/build}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/one_size.cc" <<'CC'
#include <mpi.h>
#include <cstdlib>
#include <vector>
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const int calls = std::atoi(argv[2]);  // argv: BYTES CALLS
  const int count = std::atoi(argv[1]) / 4;
  std::vector<float> a(count, 1.0f), b(count);
  for (int i = 0; i < 20 + calls; ++i) MPI_Allreduce(a.data(), b.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Finalize();
}
CC
mpicxx -O2 -o "$tmp/one_size" "$tmp/one_size.cc"
cat > "$tmp/rusage.py" <<'PY'
import resource, subprocess, sys, time
t0 = time.time()
subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print(time.time() - t0, r.ru_utime + r.ru_stime, r.ru_nvcsw + r.ru_nivcsw)
PY
measure() {  # label, then a command taking the number of calls as its last word
  local label=$1; shift
  read -r w1 c1 s1 < <(python3 "$tmp/rusage.py" "$@" "$calls")
  read -r w2 c2 s2 < <(python3 "$tmp/rusage.py" "$@" "$((2 * calls))")
  awk -v l="$label" -v n="$calls" -v w1="$w1" -v w2="$w2" -v c1="$c1" -v c2="$c2" -v s1="$s1" -v s2="$s2" \
    'BEGIN { printf "%-28s %8.1f us/call  %6.1f us CPU/call  %6.1f context switches/call\n", l,
             (w2 - w1) / n * 1e6, (c2 - c1) / n * 1e6, (s2 - s1) / n }'
}
echo "# $n ranks, $bytes bytes, $(nproc) cores, differences between $calls and $((2 * calls)) calls"
bench() { "$build/bin/gradsyncrun" --standalone --no-prefix --timeout-s 300 -n "$n" "$build/bin/gradsync-bench" \
            -b "$bytes" -e "$bytes" -w 20 -c 0 --inplace 0 -d float -o sum -n "$1"; }
export -f bench; export build n bytes
measure "gradsync (shared memory)" bash -c 'bench "$0"'
measure "Open MPI (shared memory)" mpirun --allow-run-as-root --oversubscribe -np "$n" "$tmp/one_size" "$bytes"

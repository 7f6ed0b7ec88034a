#!/usr/bin/env bash
# The coordinator at scale (issue 18, docs/benchmarks.md "The coordinator at scale"):
# gradsync-loadgen plays N nodes x K ranks against a real gradsync-coordinator, default
# settings. Prints one markdown row per shape: the median of RUNS runs of the rendezvous, the
# coordinator's and the load generator's CPU over it, the peer-table bytes and memory.
#   SHAPES="64x8 256x8" RUNS=3 scripts/bench-coordinator.sh [build dir]
# Then, unless SKIP_EXTRAS=1: idle CPU and failure fan-out at 2,048 nodes. LOG_DIR=DIR keeps
# every run's whole output there (SHAPE-RUN.txt).
set -euo pipefail
build=${1:-build}
loadgen="$build/bin/gradsync-loadgen"
runs=${RUNS:-3}
shapes=${SHAPES:-"64x8 256x8 1024x8 2048x8 1024x1 2048x1 4096x1 6144x8 16384x8 16x4096"}
echo "# $(date -u +%FT%TZ) $(uptime | sed 's/.*load/load/')"
echo "| ranks (nodes x ranks per node) | rendezvous, median of $runs | runs | coordinator CPU | loadgen CPU | peer-table bytes per node | coordinator RSS per node / per rank |"
echo "|---|---|---|---|---|---|---|"
for shape in $shapes; do
  nodes=${shape%x*}; per=${shape#*x}
  times=(); line=""
  for ((i = 0; i < runs; i++)); do
    out=$(nice -n -5 "$loadgen" --nodes "$nodes" --ranks "$per" 2>/dev/null || true)
    if [[ -n "${LOG_DIR:-}" ]]; then printf '%s\n' "$out" >"$LOG_DIR/$shape-$i.txt"; fi
    t=$(sed -n 's/^rendezvous: \([0-9.]*\) s.*/\1/p' <<<"$out")
    times+=("${t:-FAIL}")
    if [[ -n "$t" ]]; then line="$out"; fi
  done
  med=$(printf '%s\n' "${times[@]}" | { grep -v FAIL || true; } | sort -g | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print "FAIL"}')
  cpu=$(sed -n 's/^rendezvous: [0-9.]* s; coordinator \([0-9.]* s CPU ([0-9]*% of a core)\), loadgen \(.*\)$/\1|\2/p' <<<"$line")
  bytes=$(sed -n 's/.*, \([0-9]*\) per node)$/\1/p' <<<"$line")
  node_kib=$(sed -n 's/.*(\([0-9.]*\) KiB per node).*/\1/p' <<<"$line")
  rank_kib=$(sed -n 's/.*(\([0-9.]*\) KiB per rank.*/\1/p' <<<"$line")
  printf '| %s (%s x %s) | %s s | %s | %s | %s | %s | %s KiB / %s KiB |\n' "$((nodes * per))" "$nodes" "$per" "$med" \
    "${times[*]}" "${cpu%%|*}" "${cpu#*|}" "${bytes:-?}" "${node_kib:-?}" "${rank_kib:-?}"
done
if [[ "${SKIP_EXTRAS:-0}" != 1 ]]; then
  echo
  echo "## 2,048 idle nodes for 20 s, then a rendezvous and the failure fan-out"
  nice -n -5 "$loadgen" --nodes 2048 --ranks 8 --idle-s 20 --fanout 2>/dev/null | grep -v '^\['
fi

#!/bin/bash
# The daemon's default ring count beside explicit ones: two gradsyncd as two nodes on loopback,
# 2 nodes x 1 rank, host tensors, float32 sum allreduce out of place, ROUNDS rounds in
# alternation (default 2). "default" sets no GRADSYNC_NRINGS (each gradsyncd chooses from its
# cores and logs why); the others set it on both nodes.
#   bash scripts/bench-rings.sh                   (tables on stdout, raw output under $OUT)
#   RINGS="1 2 4 8 16" bash scripts/bench-rings.sh   (the counts to set beside the default)
# Binaries from ${GRADSYNC_BUILD_DIR:-build}/bin, or GRADSYNC_BIN_DIR (bundle/bin on the GPU machine).
set -uo pipefail
# The coordinator started here and its daemons share a cluster secret (coordinator/authz.h).
export GRADSYNC_CLUSTER_SECRET=${GRADSYNC_CLUSTER_SECRET:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
# A multi-node job needs a job token, the same on both nodes (docs/security.md).
export GRADSYNC_JOB_TOKEN=${GRADSYNC_JOB_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
bin=${GRADSYNC_BIN_DIR:-$PWD/${GRADSYNC_BUILD_DIR:-build}/bin}
OUT=${OUT:-$PWD/bench-out/rings}; mkdir -p "$OUT"
rings=${RINGS:-1 2 4}
args=(-b ${BEGIN:-1M} -e ${END:-64M} -f 4 -n ${ITERS:-10} -w 3 -d float -o sum -c 1 --inplace 0)
two() {  # label, then GRADSYNC_NRINGS or "" for the default
  local label=$1 nrings=$2 tmp job=j$RANDOM cp i pids=()
  tmp=$(mktemp -d)
  "$bin/gradsync-coordinator" --listen 127.0.0.1:0 --port-file "$tmp/port" 2>/dev/null &
  cp=$!
  for _ in $(seq 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
  for i in 0 1; do
    env ${nrings:+GRADSYNC_NRINGS=$nrings} timeout 600 "$bin/gradsyncrun" --start-daemon --coordinator "127.0.0.1:$(cat "$tmp/port")" \
      --nnodes 2 --node-rank $i -n 1 --job-id "$job" --node-name n$i --no-prefix --timeout-s 580 \
      "$bin/gradsync-bench" "${args[@]}" > "$tmp/out$i" 2> "$OUT/$label.n$i.err" &
    pids+=($!)
  done
  wait "${pids[@]}"; kill "$cp"; wait "$cp" 2>/dev/null
  cp "$tmp/out0" "$OUT/$label.txt"; rm -rf "$tmp"
  echo "== $label: $(grep -ho 'rings: [^;]*' "$OUT/$label".n0.err | head -1)"
  # size, time (us), busbw (GB/s) of the out-of-place columns
  grep -E "^ +[0-9]" "$OUT/$label.txt" | awk '{ printf "%12s %10s %8s\n", $1, $6, $8 }'
}
echo "$(nproc) cpus, load $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "${ROUNDS:-2}"); do
  two "default-r$round" ""
  for r in $rings; do two "rings$r-r$round" "$r"; done
done

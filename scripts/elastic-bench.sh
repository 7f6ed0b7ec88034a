#!/bin/bash
# Elastic shrink and grow figures (docs/reliability.md, "Elastic"): examples/train_logreg_elastic
# with the last rank killed (SIGKILL) at step 20 and its replacement admitted at step 30.
#   scripts/elastic-bench.sh [BUILD_DIR]     env: SIZES="4 8 16" RUNS=2 TWO_NODES=1
# One node per size under `gradsyncrun --standalone`, then (TWO_NODES=1) 2 nodes x 2 ranks:
# a coordinator and one gradsyncrun --start-daemon per node on loopback (rank sockets), the
# replacement started by the dead rank's node. Prints one line per run; logs stay in a
# temporary directory (printed). Not in CI (tens of seconds at 16 ranks on 2 cores).
set -u
build=${1:-build}
sizes=${SIZES:-"4 8 16"}
runs=${RUNS:-2}
bin=$build/bin
out=$(mktemp -d /tmp/elastic-bench.XXXXXX)
args=(--steps 40 --kill-step 20 --grow-step 30)
export GRADSYNC_TUNE=0

# The figures of one run's log: each survivor's shrink, the release of the old generation,
# the first call in the new one, each member's grow, and how many ranks ended OK.
summarize() {
  local log=$1
  local shrink release first grow ok
  shrink=$(grep -ho "generation 2, in [0-9]* ms" "$log" | awk '{print $4}' | sort -n | sed -n '1p;$p' | paste -sd-)
  release=$(grep -ho "old generation released in [0-9]* ms)" "$log" | awk '{print $5}' | sort -n | tail -1)
  first=$(grep -ho "first allreduce of generation 2 took [0-9.]* ms" "$log" | awk '{print $(NF-1)}')
  grow=$(grep -ho "grow: generation 3 ready: .* in [0-9]* ms" "$log" | awk '{print $(NF-1)}' | sort -n | sed -n '1p;$p' | paste -sd-)
  ok=$(grep -c "OK: rank" "$log")
  echo "shrink ${shrink} ms, release up to ${release:-?} ms, first call ${first:-?} ms, grow ${grow} ms, ${ok} ranks OK"
}

for n in $sizes; do
  for i in $(seq 1 "$runs"); do
    log=$out/n$n.$i.log
    "$bin/gradsyncrun" --standalone -n "$n" --replace-failed 1 --timeout-s 200 "$bin/train_logreg_elastic" "${args[@]}" \
      >"$log" 2>&1
    echo "1 node x $n, run $i: rc=$? $(summarize "$log") (load $(cut -d' ' -f1 /proc/loadavg))"
  done
done

if [ "${TWO_NODES:-1}" = 1 ]; then
  head -c 32 /dev/urandom | base64 >"$out/secret"
  head -c 16 /dev/urandom | base64 >"$out/token"
  chmod 600 "$out/secret" "$out/token"
  "$bin/gradsync-coordinator" --listen 127.0.0.1:0 --port-file "$out/port" --cluster-secret-file "$out/secret" \
    >"$out/coordinator.log" 2>&1 &
  coord=$!
  for _ in $(seq 50); do [ -s "$out/port" ] && break; sleep 0.1; done
  port=$(cat "$out/port")
  pids=()
  for node in 0 1; do
    "$bin/gradsyncrun" --coordinator "127.0.0.1:$port" --nnodes 2 --node-rank $node -n 2 --start-daemon \
      --node-name "n$node" --cluster-secret-file "$out/secret" --token-file "$out/token" --job-id elastic-2x2 \
      --replace-failed 1 --timeout-s 100 "$bin/train_logreg_elastic" "${args[@]}" >"$out/2x2.node$node.log" 2>&1 &
    pids+=($!)
  done
  rcs=""
  for p in "${pids[@]}"; do wait "$p"; rcs="$rcs $?"; done
  kill "$coord" 2>/dev/null
  wait "$coord" 2>/dev/null
  cat "$out"/2x2.node*.log >"$out/2x2.log"
  echo "2 nodes x 2: rc=${rcs# } $(summarize "$out/2x2.log")"
fi
echo "logs: $out"

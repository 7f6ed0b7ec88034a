#!/usr/bin/env bash
# Chaos trials (issue 17): kill -9 of a trainer or a daemon, and SIGSTOP of a trainer, in the
# middle of allreduces, on a coordinator and daemons on loopback (each daemon one "node").
# Each trial checks: every surviving trainer ends with an error within the limit (no hang),
# the error names the culprit (a killed trainer's rank; for a daemon, a rank of its node or
# its connection), no trainer process is left, the daemons that were not killed are alive,
# their open descriptors did not grow, and they run a checked job right after (no wrong
# result). A killed daemon is restarted for the next trial.
#
#   scripts/chaos.sh [--trials N] [--build DIR] [--proxy-tcp] [--placements "2x1 2x2 3x2"]
#                    [--kinds "trainer daemon stop"] [--sizes "2 262144 4194304"]
# Prints one line per trial and a summary; exits 1 if any trial failed. Figures for
# docs/reliability.md: `scripts/chaos.sh --trials 500`.
set -uo pipefail
cd "$(dirname "$0")/.."

trials=20
build=build
daemon_flags=()
placements="2x1 2x2 3x2"
kinds="trainer daemon stop"
sizes="2 262144 4194304"  # floats: 8 B, 1 MiB, 16 MiB
while (($#)); do
  case "$1" in
    --trials) trials=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --proxy-tcp) daemon_flags+=(--proxy-tcp); shift ;;
    --placements) placements=$2; shift 2 ;;
    --kinds) kinds=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    *) echo "usage: $0 [--trials N] [--build DIR] [--proxy-tcp] [--placements P] [--kinds K] [--sizes S]" >&2; exit 2 ;;
  esac
done
bin=$(cd "$build/bin" && pwd) || { echo "chaos: no $build/bin (build first)" >&2; exit 2; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/gradsync-chaos-XXXXXX")
export GRADSYNC_CLUSTER_SECRET=chaos-cluster-secret GRADSYNC_OPERATOR_TOKEN=chaos-operator
coordinator_pid=""
declare -a dpids=()
declare -a rpids=()

cleanup() {
  for p in "${rpids[@]}" "${dpids[@]}" $coordinator_pid; do
    [ -n "$p" ] && kill -9 "$p" 2>/dev/null
  done
  wait 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT

now_ms() { date +%s%3N; }

# Waits (up to $2 s) for file $1 to exist.
wait_file() {
  local end=$(( $(now_ms) + $2 * 1000 ))
  while [ ! -s "$1" ]; do
    (( $(now_ms) > end )) && return 1
    sleep 0.02
  done
}

start_daemon() {  # index
  local i=$1
  rm -f "$dir/d$i.ready"
  "$bin/gradsyncd" --coordinator "127.0.0.1:$port" --socket "$dir/d$i.sock" --node-name "node$i" \
    --data-listen 127.0.0.1 --ready-file "$dir/d$i.ready" "${daemon_flags[@]}" >>"$dir/d$i.log" 2>&1 &
  dpids[$i]=$!
  wait_file "$dir/d$i.ready" 20 || { echo "chaos: gradsyncd $i did not start" >&2; exit 2; }
}

start_cluster() {  # daemons
  "$bin/gradsync-coordinator" --listen 127.0.0.1:0 --port-file "$dir/port" --lease-ms 2000 >>"$dir/coordinator.log" 2>&1 &
  coordinator_pid=$!
  wait_file "$dir/port" 20 || { echo "chaos: coordinator did not start" >&2; exit 2; }
  port=$(cat "$dir/port")
  for ((i = 0; i < $1; i++)); do start_daemon "$i"; done
}

stop_cluster() {
  for p in "${dpids[@]}" $coordinator_pid; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  dpids=(); coordinator_pid=""; rm -f "$dir/port"
}

# Starts WORLD ranks over NODES daemons (ranks in order, PER per node) running `$@`.
spawn_ranks() {  # job nodes per -- args...
  local job=$1 nodes=$2 per=$3; shift 4
  rpids=()
  local world=$((nodes * per)) r=0
  for ((d = 0; d < nodes; d++)); do
    for ((l = 0; l < per; l++)); do
      RANK=$r WORLD_SIZE=$world LOCAL_RANK=$l LOCAL_WORLD_SIZE=$per GRADSYNC_DAEMON="$dir/d$d.sock" \
        GRADSYNC_JOB_ID=$job GRADSYNC_JOB_TOKEN=chaos GRADSYNC_JOIN_TIMEOUT_MS=30000 \
        GRADSYNC_OP_TIMEOUT_MS=${op_timeout_ms:-60000} GRADSYNC_TUNE=0 "$bin/allreduce_worker" "$@" >"$dir/r$r.log" 2>&1 &
      rpids[$r]=$!
      r=$((r + 1))
    done
  done
}

fd_count() { ls "/proc/$1/fd" 2>/dev/null | wc -l; }

pass=0
fail=0
worst_ms=0
declare -A worst_by_kind=()
log_fail() { echo "FAIL trial $1: $2"; fail=$((fail + 1)); }

read -r -a placement_list <<<"$placements"
read -r -a kind_list <<<"$kinds"
read -r -a size_list <<<"$sizes"
current=""
for ((t = 0; t < trials; t++)); do
  placement=${placement_list[$((t % ${#placement_list[@]}))]}
  kind=${kind_list[$(((t / ${#placement_list[@]}) % ${#kind_list[@]}))]}
  size=${size_list[$((RANDOM % ${#size_list[@]}))]}
  nodes=${placement%x*}
  per=${placement#*x}
  world=$((nodes * per))
  if [ "$current" != "$placement" ]; then
    stop_cluster
    start_cluster "$nodes"
    current=$placement
  fi
  declare -a fds_before=()
  for ((d = 0; d < nodes; d++)); do fds_before[$d]=$(fd_count "${dpids[$d]}"); done
  job="chaos-$t"
  # A stopped rank is found by the op timeout: 3 s there, 60 s (never reached) otherwise.
  op_timeout_ms=60000
  [ "$kind" = stop ] && op_timeout_ms=3000
  spawn_ranks "$job" "$nodes" "$per" -- loop "$size" 1000000
  # Every rank in its loop, then a random moment in it.
  ok=1
  for ((r = 0; r < world; r++)); do
    end=$(( $(now_ms) + 60000 ))
    until grep -q LOOPING "$dir/r$r.log" 2>/dev/null; do
      if (( $(now_ms) > end )) || ! kill -0 "${rpids[$r]}" 2>/dev/null; then ok=0; break; fi
      sleep 0.02
    done
  done
  if ((ok == 0)); then
    log_fail "$t" "$placement $kind: a rank never started looping ($(cat "$dir"/r*.log | grep -v LOOPING | head -2 | tr '\n' ' '))"
    for p in "${rpids[@]}"; do kill -9 "$p" 2>/dev/null; done
    wait "${rpids[@]}" 2>/dev/null
    continue
  fi
  sleep "0.$((RANDOM % 5))"
  victim=$((RANDOM % world))
  victim_node=$((victim / per))
  start=$(now_ms)
  case $kind in
    trainer) kill -9 "${rpids[$victim]}" ;;
    stop) kill -STOP "${rpids[$victim]}" ;;
    daemon) kill -9 "${dpids[$victim_node]}" ;;
  esac
  # Survivors: every rank but the victim (trainer, stop) or, for a daemon, every rank.
  limit_ms=1000
  [ "$kind" = stop ] && limit_ms=4500  # the op timeout (3 s), then the abort
  declare -a exit_ms=()
  for ((r = 0; r < world; r++)); do
    if [ "$kind" != daemon ] && ((r == victim)); then continue; fi
    end=$((start + limit_ms + 5000))
    while kill -0 "${rpids[$r]}" 2>/dev/null && (( $(now_ms) < end )); do sleep 0.005; done
    if kill -0 "${rpids[$r]}" 2>/dev/null; then
      log_fail "$t" "$placement $kind victim $victim: rank $r still running $((limit_ms + 5000)) ms after (hang)"
      ok=0
      continue
    fi
    exit_ms[$r]=$(( $(now_ms) - start ))
  done
  [ "$kind" = stop ] && kill -9 "${rpids[$victim]}" 2>/dev/null
  for p in "${rpids[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait "${rpids[@]}" 2>/dev/null
  trial_worst=0
  for ((r = 0; r < world; r++)); do
    [ -z "${exit_ms[$r]:-}" ] && continue
    line=$(grep -m1 "FAILED" "$dir/r$r.log")
    ms=${exit_ms[$r]}
    ((ms > trial_worst)) && trial_worst=$ms
    if [ -z "$line" ]; then
      log_fail "$t" "$placement $kind victim $victim: rank $r ended without an error ($(tail -1 "$dir/r$r.log"))"; ok=0; continue
    fi
    if ((ms > limit_ms)); then log_fail "$t" "$placement $kind: rank $r took $ms ms: $line"; ok=0; fi
    case $kind in
      trainer)
        grep -qE "rank $victim\b" <<<"$line" || { log_fail "$t" "$placement trainer $victim: rank $r names another culprit: $line"; ok=0; } ;;
      daemon)
        # A rank of the dead daemon's node, or its own lost daemon connection.
        named=0
        for ((v = victim_node * per; v < (victim_node + 1) * per; v++)); do grep -qE "rank $v\b" <<<"$line" && named=1; done
        grep -q "lost the connection to gradsyncd\|node node$victim_node\b" <<<"$line" && named=1
        ((named)) || { log_fail "$t" "$placement daemon of node $victim_node: rank $r names no rank of it: $line"; ok=0; } ;;
      stop)
        grep -q "not known\|rank $victim\b" <<<"$line" || { log_fail "$t" "$placement stop $victim: rank $r: $line"; ok=0; } ;;
    esac
  done
  if [ "$kind" = daemon ]; then
    wait "${dpids[$victim_node]}" 2>/dev/null
    start_daemon "$victim_node"
    fds_before[$victim_node]=$(fd_count "${dpids[$victim_node]}")
  fi
  # The daemons serve a checked job; then their descriptors are back where they were.
  op_timeout_ms=60000
  spawn_ranks "check-$t" "$nodes" "$per" -- check 0,1,1000,262144
  for ((r = 0; r < world; r++)); do
    if ! timeout 60 tail --pid="${rpids[$r]}" -f /dev/null; then log_fail "$t" "check job rank $r hung"; ok=0; fi
  done
  wait "${rpids[@]}" 2>/dev/null
  for ((r = 0; r < world; r++)); do
    grep -q PASS "$dir/r$r.log" || { log_fail "$t" "$placement: the next job failed on rank $r: $(grep -v ok "$dir/r$r.log" | head -2 | tr '\n' ' ')"; ok=0; }
  done
  sleep 0.3
  for ((d = 0; d < nodes; d++)); do
    kill -0 "${dpids[$d]}" 2>/dev/null || { log_fail "$t" "gradsyncd $d died"; ok=0; start_daemon "$d"; continue; }
    after=$(fd_count "${dpids[$d]}")
    # A little slack: a gRPC connection to the coordinator may come and go.
    if ((after > fds_before[d] + 2)); then log_fail "$t" "gradsyncd $d holds $after descriptors, $((fds_before[d])) before the trial"; ok=0; fi
  done
  leftover=$(pgrep -f "$bin/allreduce_worker" | wc -l)
  ((leftover > 0)) && { log_fail "$t" "$leftover trainer processes left"; ok=0; }
  ((ok)) && pass=$((pass + 1))
  key="$kind"
  ((trial_worst > ${worst_by_kind[$key]:-0})) && worst_by_kind[$key]=$trial_worst
  echo "trial $t: $placement $kind victim $victim size $((size * 4)) B: slowest survivor $trial_worst ms $([ "$ok" = 1 ] && echo ok || echo FAILED)"
done
echo "chaos: $pass of $trials trials passed; slowest survivor by kind:$(for k in "${!worst_by_kind[@]}"; do printf ' %s %s ms' "$k" "${worst_by_kind[$k]}"; done)"
((fail == 0))

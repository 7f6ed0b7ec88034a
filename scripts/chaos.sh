#!/usr/bin/env bash
# Chaos trials (issue 17) on a coordinator and one gradsyncd per "node", every process on this
# machine. Each trial starts a job of `allreduce_worker loop` ranks (every result checked) and
# does one of these kinds at a random moment:
#   trainer      kill -9 of a trainer: every survivor fails within 1 s naming that rank
#   daemon       kill -9 of a gradsyncd: every rank fails within 1 s naming a rank of that node
#                or its lost daemon connection
#   stop         SIGSTOP of a trainer (op timeout 3 s): every other rank fails within 4.5 s
#                naming it or saying the rank at fault is not known
#   coordinator  kill -9 of the coordinator. In memory (the default): the job goes on while it
#                is down (every rank makes progress); started again on its port after 1.5-3.5 s,
#                it has lost the job, and every rank fails within lease + 1 s of its return
#                naming that ("forgotten by the coordinator ... restarted"). With --store etcd
#                (an etcd and two coordinators): the leader is killed, the job goes on through
#                the takeover, the killed one comes back as the standby, and `gradsyncctl abort`
#                through the new leader ends every rank within 1 s
#   pause        SIGSTOP of a gradsyncd for --pause-s (20), SIGCONT: every rank ends with a named
#                error within 2 s of the resume; a pause shorter than the lease: the job goes on
#   brief        SIGSTOP of a trainer or a gradsyncd (at random) for 200 ms to half the lease,
#                SIGCONT: the job goes on (no rank ends, every rank makes progress after the
#                resume, every result right). Half: the coordinator's lease runs from the last
#                heartbeat it read, up to a third of the lease before the pause began
#   partition    (namespaces) a node's links go down for --partition-s (5) and come back: the
#                other nodes' ranks end with a named error within the lease + 2 s of the cut,
#                the cut node's within 5 s of the heal (TCP's retransmission backoff), or before
#                it, as for `cut`, when the partition outlasts the lease by a second or so
#   cut          (namespaces) a partition that never heals (the links come back only once every
#                rank has ended, for the next job): every rank ends within the lease + 2 s of
#                the cut, the other nodes' naming the cut node or one of its ranks, the cut
#                node's own saying their gradsyncd is cut off
#   datacut      (namespaces, nft) the data path of a node alone is black-holed (nftables drops
#                every packet on its data link; the coordinator stays reachable), never healed
#                while the job runs: every rank ends within 8 s of the cut (a data connection's
#                keepalive gives up after about 5 s, common/tcp_socket.h), with an error naming
#                a connection across the cut and saying which side is at fault is not known
#   lossy        (namespaces) 5% loss and 50 ms delay on every data packet between nodes: the
#                job (--lossy-iters allreduces, every result checked) passes
#                (partition and lossy trials take their sizes from --net-sizes: the relay is slow)
# Every trial also checks: no wrong result (silent corruption), no trainer left, a checked job
# passes right after on the same daemons (a killed daemon is restarted first), and then the
# daemons not killed are alive with no more descriptors than before the trial (2 of slack) and
# no more threads than after the trial before (4 of slack).
#
#   scripts/chaos.sh [--trials N] [--build DIR] [--proxy-tcp] [--placements "2x1 2x2 3x2"]
#                    [--kinds "trainer daemon stop coordinator pause brief partition cut datacut lossy"]
#                    [--sizes "2 262144 4194304"] [--store etcd] [--lease-ms 2000]
#                    [--pause-s 20] [--partition-s 5] [--lossy-iters 10] [--net-sizes "2 1024 65536"]
#                    [--netns]
# `partition` and `lossy` (or --netns) run each node in a network namespace of its own
# (scripts/chaos-net.sh); they need root, and are skipped with a message (exit 0 when nothing
# else ran) where namespaces cannot be made. Prints one line per trial and a summary; exits 1
# if any trial failed. CHAOS_VERBOSE=1 prints every survivor's error; CHAOS_KEEP=1 keeps the logs.
set -uo pipefail
cd "$(dirname "$0")/.."

trials=20
build=build
daemon_flags=()
placements="2x1 2x2 3x2"
kinds="trainer daemon stop"
sizes="2 262144 4194304"  # floats: 8 B, 1 MiB, 16 MiB
store=memory
lease_ms=2000
pause_s=20
partition_s=5
lossy_iters=10
net_sizes="2 1024 65536"  # floats: 8 B, 4 KiB, 256 KiB (through lossy_link; 5% loss and 100 ms round trips)
use_netns=0
while (($#)); do
  case "$1" in
    --trials) trials=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --proxy-tcp) daemon_flags+=(--proxy-tcp); shift ;;
    --placements) placements=$2; shift 2 ;;
    --kinds) kinds=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --store) store=$2; shift 2 ;;
    --lease-ms) lease_ms=$2; shift 2 ;;
    --pause-s) pause_s=$2; shift 2 ;;
    --partition-s) partition_s=$2; shift 2 ;;
    --lossy-iters) lossy_iters=$2; shift 2 ;;
    --net-sizes) net_sizes=$2; shift 2 ;;
    --netns) use_netns=1; shift ;;
    *) sed -n '/^#   scripts/,/^#  *\[--netns\]/p' "$0" >&2; exit 2 ;;
  esac
done
case $store in memory|etcd) ;; *) echo "chaos: --store memory|etcd" >&2; exit 2 ;; esac
bin=$(cd "$build/bin" && pwd) || { echo "chaos: no $build/bin (build first)" >&2; exit 2; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/gradsync-chaos-XXXXXX")
export GRADSYNC_CLUSTER_SECRET=chaos-cluster-secret GRADSYNC_OPERATOR_TOKEN=chaos-operator
source scripts/chaos-net.sh

read -r -a placement_list <<<"$placements"
read -r -a kind_list <<<"$kinds"
read -r -a size_list <<<"$sizes"
read -r -a net_size_list <<<"$net_sizes"
for k in "${kind_list[@]}"; do
  case $k in
    trainer|daemon|stop|coordinator|pause|brief) ;;
    partition|lossy|cut|datacut) use_netns=1 ;;
    *) echo "chaos: unknown kind $k" >&2; exit 2 ;;
  esac
done
if ((use_netns)); then
  why=$(net_unavailable)
  [ -z "$why" ] && [[ " ${kind_list[*]} " == *" datacut "* ]] && ! command -v nft >/dev/null &&
    why="no nft (nftables: scripts/setup.sh installs it)"
  if [ -n "$why" ]; then
    echo "chaos: SKIPPED network namespaces: $why; the trials of kinds partition, cut, datacut and lossy are not run"
    kept=()
    for k in "${kind_list[@]}"; do case $k in partition|lossy|cut|datacut) ;; *) kept+=("$k") ;; esac; done
    ((${#kept[@]})) || { rm -rf "$dir"; exit 0; }
    kind_list=("${kept[@]}")
    use_netns=0
  else
    export GRADSYNC_INSECURE=1  # plaintext gRPC between namespaces (never off this machine)
  fi
fi
((use_netns)) && [ ! -x "$bin/lossy_link" ] && { echo "chaos: no $bin/lossy_link (build it)" >&2; exit 2; }
[ "$store" = etcd ] && [ ! -x /usr/bin/etcd ] && { echo "chaos: --store etcd needs /usr/bin/etcd (etcd-server)" >&2; exit 2; }

declare -a cpids=()   # coordinators (one in memory; two on etcd)
declare -a cports=()
declare -a dpids=()
declare -a rpids=()
etcd_pid=""
leader=0

cleanup() {
  for p in "${rpids[@]}" "${dpids[@]}" "${cpids[@]}" $etcd_pid; do
    [ -n "$p" ] && kill -9 "$p" 2>/dev/null
  done
  ((use_netns)) && net_down  # before `wait`, which would wait for the relay too
  wait 2>/dev/null
  if [ -n "${CHAOS_KEEP:-}" ]; then echo "chaos: logs kept in $dir"; else rm -rf "$dir"; fi
}
trap cleanup EXIT

now_ms() { date +%s%3N; }

# Waits (up to $2 s) for file $1 to exist and not be empty.
wait_file() {
  local end=$(( $(now_ms) + $2 * 1000 ))
  while [ ! -s "$1" ]; do
    (( $(now_ms) > end )) && return 1
    sleep 0.02
  done
}
# Waits (up to $3 ms) for file $1 to hold a line matching $2 after its first $4 lines (0).
wait_line() {
  local end=$(( $(now_ms) + $3 )) skip=$((${4:-0} + 1))
  until tail -n "+$skip" "$1" 2>/dev/null | grep -q "$2"; do
    (( $(now_ms) > end )) && return 1
    sleep 0.02
  done
}
# Sets node_prefix to what runs a command in node $1's namespace (nothing without namespaces);
# `ip netns exec` execs the command, so $! is the command's own pid.
node_prefix=()
set_node_prefix() { node_prefix=(); ((use_netns)) && node_prefix=(ip netns exec "$(net_ns "$1")"); }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

listen_host() { ((use_netns)) && echo 0.0.0.0 || echo 127.0.0.1; }

start_coordinator() {  # index (0 or 1)
  local i=$1 args=(--lease-ms "$lease_ms")
  [ "$store" = etcd ] && args+=(--store "etcd://127.0.0.1:$etcd_port/chaos" --election-ttl-s 2)
  "$bin/gradsync-coordinator" --listen "$(listen_host):${cports[$i]}" "${args[@]}" >>"$dir/c$i.log" 2>&1 &
  cpids[$i]=$!
}

# The coordinator addresses node i's daemon is given.
coordinator_list() {
  local host=127.0.0.1 out="" c
  ((use_netns)) && host=$(net_coordinator_host "$1")
  for c in "${!cports[@]}"; do out+="${out:+,}$host:${cports[$c]}"; done
  echo "$out"
}

start_daemon() {  # index
  local i=$1 data=127.0.0.1
  ((use_netns)) && data=$(net_data_host "$i")
  rm -f "$dir/d$i.ready"
  set_node_prefix "$i"
  "${node_prefix[@]}" "$bin/gradsyncd" --coordinator "$(coordinator_list "$i")" --socket "$dir/d$i.sock" --node-name "node$i" \
    --data-listen "$data" --data-host "$data" --ready-file "$dir/d$i.ready" "${daemon_flags[@]}" >>"$dir/d$i.log" 2>&1 &
  dpids[$i]=$!
  wait_file "$dir/d$i.ready" 20 || { echo "chaos: gradsyncd $i did not start: $(tail -3 "$dir/d$i.log")" >&2; exit 2; }
}

start_cluster() {  # daemons
  if ((use_netns)); then net_up "$1" "$bin/lossy_link" "$dir" || { echo "chaos: could not set up namespaces" >&2; exit 2; }; fi
  if [ "$store" = etcd ]; then
    etcd_port=$(free_port)
    local peer_port; peer_port=$(free_port)
    rm -rf "$dir/etcd"
    local skip; skip=$(lines_of "$dir/etcd.log")
    /usr/bin/etcd --name chaos --data-dir "$dir/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
      --advertise-client-urls "http://127.0.0.1:$etcd_port" --listen-peer-urls "http://127.0.0.1:$peer_port" \
      --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" --initial-cluster "chaos=http://127.0.0.1:$peer_port" \
      >>"$dir/etcd.log" 2>&1 &
    etcd_pid=$!
    wait_line "$dir/etcd.log" "ready to serve client requests" 20000 "$skip" || { echo "chaos: etcd did not start" >&2; exit 2; }
    cports=("$(free_port)" "$(free_port)")
    skip=$(lines_of "$dir/c0.log")
    start_coordinator 0
    wait_line "$dir/c0.log" "serving as the leader" 20000 "$skip" || { echo "chaos: coordinator 0 did not lead" >&2; exit 2; }
    skip=$(lines_of "$dir/c1.log")
    start_coordinator 1
    wait_line "$dir/c1.log" "standing by" 20000 "$skip" || { echo "chaos: coordinator 1 did not stand by" >&2; exit 2; }
    leader=0
  else
    cports=("$(free_port)")
    local skip; skip=$(lines_of "$dir/c0.log")
    start_coordinator 0
    wait_line "$dir/c0.log" "listening on" 20000 "$skip" || { echo "chaos: coordinator did not start: $(tail -3 "$dir/c0.log")" >&2; exit 2; }
  fi
  for ((i = 0; i < $1; i++)); do start_daemon "$i"; done
}

stop_cluster() {
  for p in "${dpids[@]}" "${cpids[@]}" $etcd_pid; do kill -9 "$p" 2>/dev/null; done
  ((use_netns)) && net_down  # before `wait`, which would wait for the relay too
  wait 2>/dev/null
  dpids=(); cpids=(); etcd_pid=""
}

# Starts WORLD ranks over NODES daemons (ranks in order, PER per node) running `$@`.
spawn_ranks() {  # job nodes per -- args...
  local job=$1 nodes=$2 per=$3; shift 4
  rpids=()
  local world=$((nodes * per)) r=0
  for ((d = 0; d < nodes; d++)); do
    set_node_prefix "$d"
    for ((l = 0; l < per; l++)); do
      RANK=$r WORLD_SIZE=$world LOCAL_RANK=$l LOCAL_WORLD_SIZE=$per GRADSYNC_DAEMON="$dir/d$d.sock" \
        GRADSYNC_JOB_ID=$job GRADSYNC_JOB_TOKEN=chaos GRADSYNC_JOIN_TIMEOUT_MS=30000 \
        GRADSYNC_OP_TIMEOUT_MS=${op_timeout_ms:-60000} GRADSYNC_TUNE=0 \
        "${node_prefix[@]}" "$bin/allreduce_worker" "$@" >"$dir/r$r.log" 2>&1 &
      rpids[$r]=$!
      r=$((r + 1))
    done
  done
}

lines_of() { cat "$1" 2>/dev/null | wc -l; }
fd_count() { ls "/proc/$1/fd" 2>/dev/null | wc -l; }
thread_count() { ls "/proc/$1/task" 2>/dev/null | wc -l; }
iters_of() { grep -c "^ITER" "$dir/r$1.log" 2>/dev/null; }
all_alive() { local p; for p in "${rpids[@]}"; do kill -0 "$p" 2>/dev/null || return 1; done; }

pass=0
fail=0
wrong=0
hangs=0
declare -A worst_by_kind=() trials_by_kind=() passed_by_kind=() times_by_kind=()
log_fail() { echo "FAIL trial $1: $2"; fail=$((fail + 1)); ok=0; }

# Until $1 (ms), notes in exit_at[r] when each rank that ends does so.
poll_exits() {
  local r
  while (( $(now_ms) < $1 )); do
    for ((r = 0; r < world; r++)); do
      [ -z "${exit_at[$r]:-}" ] && { ! kill -0 "${rpids[$r]}" 2>/dev/null || grep -q "^FAILED" "$dir/r$r.log"; } &&
        exit_at[$r]=$(now_ms)
    done
    sleep 0.01
  done
}
# When rank $1 ended: its failed call's return ("FAILED after .. ms (at EPOCH_MS)"), else its exit
# (a rank whose daemon is paused prints its error at once but exits only once leave() returns).
ended_at() {
  local at; at=$(sed -n 's/^FAILED after [0-9]* ms (at \([0-9]*\)).*/\1/p' "$dir/r$1.log" | head -1)
  echo "${at:-${exit_at[$1]}}"
}
# ", node D's ranks ended A-B ms after it began$2" for the ranks that ended, by node.
exits_since() {
  local d r out="" lo hi
  for ((d = 0; d < nodes; d++)); do
    lo=""; hi=""
    for ((r = d * per; r < (d + 1) * per; r++)); do
      [ -z "${exit_at[$r]:-}" ] && continue
      local ms=$(( $(ended_at "$r") - $1 ))
      [ -z "$lo" ] || ((ms < lo)) && lo=$ms
      [ -z "$hi" ] || ((ms > hi)) && hi=$ms
    done
    [ -n "$lo" ] && out+="; node $d's ranks ended $lo-$hi ms after it began"
  done
  [ -n "$out" ] && echo "$out$2"
}

# Cuts the victim's node off and counts from when the cut is in place: `ip` waits for the
# kernel's rtnl lock, which namespaces being torn down (here or by anyone else) hold for long
# (the cut once took 8.7 s); a rank that failed before that is still counted from the command.
cut_took=""
cut_node() {
  net_cut "$victim_node"
  local took=$(( $(now_ms) - start ))
  cut_took=""
  ((took > 100)) && cut_took=" (the cut took $took ms)"
  start=$(now_ms)
}

# How long rank $1 may take to end, from $start.
limit_of() { [ -n "$victim_limit_ms" ] && (( $1 / per == victim_node )) && echo "$victim_limit_ms" || echo "$limit_ms"; }

# The reason in an error line: what follows the last "...) failed: ", without the reporting
# rank's own "job=J [gen=G: ]rank R (host H): " (so that a rank never matches itself).
reason_of() { sed -E 's/^.*\) failed: //; s/^job=[^ ]+ (gen=[0-9]+: )?//; s/^rank [0-9]+ \(host [^)]*\): //' <<<"$1"; }

# What rank $1's reason must contain, by kind (the culprit, or what ended the job).
named_pattern() {
  # A paused or cut-off node's own ranks: their daemon forgot, or a rank elsewhere told them
  # the job's abort over a socket (naming this node, as below), or they lost their connection
  # to a rank elsewhere, which exited when the job was aborted there (the documented guess);
  # cut off past the lease, their daemon found that itself.
  local victim_ours="" cut_off="gradsyncd on [^ ]+ \\(data [^)]*\\) is cut off"
  if [ "$kind" = pause ] || [ "$kind" = partition ]; then
    (( $1 / per == victim_node )) && victim_ours="forgotten by the coordinator|lost its connection to rank|TCP connection (to|from) rank|$cut_off|"
  fi
  # A node cut off for good hears nothing from elsewhere: its own daemon must find out.
  [ "$kind" = cut ] && (( $1 / per == victim_node )) && { echo "$cut_off"; return; }
  echo -n "$victim_ours"
  case $kind in
    trainer) echo "rank $victim\b" ;;
    daemon)
      local v p="lost the connection to gradsyncd|node node$victim_node\b"
      for ((v = victim_node * per; v < (victim_node + 1) * per; v++)); do p+="|rank $v\b"; done
      echo "$p" ;;
    stop) echo "not known|rank $victim\b" ;;
    coordinator) [ "$store" = etcd ] && echo "aborted by an operator" || echo "forgotten by the coordinator" ;;
    # The other nodes' ranks: the node lost at the coordinator, or a rank of it.
    pause|partition|cut)
      local v p="node node$victim_node\b"
      for ((v = victim_node * per; v < (victim_node + 1) * per; v++)); do p+="|rank $v\b"; done
      echo "$p" ;;
  esac
}

# Whether error line $1 of a data cut names a silent connection across the cut and says that
# which side is at fault is not known. Over rank sockets the line names both ends ("rank X
# (host h): the TCP connection to|from rank Y"): one on the cut node, one elsewhere. Through
# the proxy it names the peer rank the reporting daemon lost ("connection from|to rank Y"),
# and the reporting node is not in the text (every host here is this machine).
across_the_cut() {
  grep -q "answered nothing for" <<<"$1" && grep -q "which side is at fault is not known" <<<"$1" || return 1
  local pair x y
  pair=$(sed -nE 's/.*rank ([0-9]+) \(host [^)]*\): the TCP connection (to|from) rank ([0-9]+) .*/\1 \3/p' <<<"$1" | head -1)
  if [ -n "$pair" ]; then
    read -r x y <<<"$pair"
    (( x / per != y / per && (x / per == victim_node || y / per == victim_node) ))
    return
  fi
  grep -qE "connection (to|from) rank [0-9]+ " <<<"$1"
}

trials_run=0
current=""
for ((t = 0; t < trials; t++)); do
  # Placements in blocks (a new cluster for each), kinds in turn within a block.
  placement=${placement_list[$((t * ${#placement_list[@]} / trials))]}
  kind=${kind_list[$((t % ${#kind_list[@]}))]}
  size=${size_list[$((RANDOM % ${#size_list[@]}))]}
  nodes=${placement%x*}
  per=${placement#*x}
  world=$((nodes * per))
  if [ "$current" != "$placement" ]; then
    stop_cluster
    start_cluster "$nodes"
    current=$placement
    declare -a threads_after=()
  fi
  trials_run=$((trials_run + 1))
  ok=1
  declare -a fds_before=()
  for ((d = 0; d < nodes; d++)); do fds_before[$d]=$(fd_count "${dpids[$d]}"); done
  job="chaos-$t"
  # A stopped rank is found by the op timeout: 3 s there, 60 s (never reached) otherwise.
  op_timeout_ms=60000
  [ "$kind" = stop ] && op_timeout_ms=3000
  iters=1000000
  case $kind in lossy|partition|cut|datacut) size=${net_size_list[$((RANDOM % ${#net_size_list[@]}))]} ;; esac
  if [ "$kind" = lossy ]; then
    iters=$lossy_iters
    net_impair
  fi
  spawn_ranks "$job" "$nodes" "$per" -- loop "$size" "$iters"
  start=$(now_ms)
  victim=$((RANDOM % world))
  victim_node=$((victim / per))
  detail=""
  declare -a exit_ms=() exit_at=()
  if [ "$kind" = lossy ]; then
    # The job must pass through the loss and delay; each rank checked every result.
    limit_ms=180000
    for ((r = 0; r < world; r++)); do
      if ! timeout $((limit_ms / 1000)) tail --pid="${rpids[$r]}" -f /dev/null; then
        log_fail "$t" "$placement lossy: rank $r still running after $((limit_ms / 1000)) s (hang)"; hangs=$((hangs + 1))
      fi
    done
    net_clear
    wait "${rpids[@]}" 2>/dev/null
    for ((r = 0; r < world; r++)); do
      grep -q "^PASS" "$dir/r$r.log" || log_fail "$t" "$placement lossy size $((size * 4)) B: rank $r: $(grep -v '^ITER\|^LOOPING\|^JOINED' "$dir/r$r.log" | head -2 | tr '\n' ' ')"
    done
    trial_worst=$(( $(now_ms) - start ))
    detail="$lossy_iters allreduces in $trial_worst ms"
  else
    # Every rank in its loop, then a random moment in it.
    for ((r = 0; r < world; r++)); do
      if ! wait_line "$dir/r$r.log" LOOPING 60000; then
        log_fail "$t" "$placement $kind: rank $r never started looping ($(grep -v LOOPING "$dir/r$r.log" | head -2 | tr '\n' ' '))"
        break
      fi
    done
    if ((ok == 0)); then
      for p in "${rpids[@]}"; do kill -9 "$p" 2>/dev/null; done
      wait "${rpids[@]}" 2>/dev/null
      continue
    fi
    sleep "0.$((RANDOM % 5))"
    start=$(now_ms)
    limit_ms=1000
    victim_limit_ms=""     # another limit for the victim node's ranks
    survivors_of_victim=0  # the victim's own rank is not checked (trainer, stop)
    goes_on=0              # the job must go on (no rank may end) instead of failing
    case $kind in
      trainer) kill -9 "${rpids[$victim]}"; survivors_of_victim=1 ;;
      stop) kill -STOP "${rpids[$victim]}"; survivors_of_victim=1; limit_ms=4500 ;;  # op timeout 3 s, then the abort
      daemon) kill -9 "${dpids[$victim_node]}" ;;
      coordinator)
        declare -a before=()
        for ((r = 0; r < world; r++)); do before[$r]=$(iters_of "$r"); done
        killed=$leader
        other=$((1 - leader))
        other_lines=$(lines_of "$dir/c$other.log")
        killed_lines=$(lines_of "$dir/c$killed.log")
        kill -9 "${cpids[$leader]}"; wait "${cpids[$leader]}" 2>/dev/null
        if [ "$store" = etcd ]; then
          # The standby takes over within the election TTL (2 s) + ~0.7 s; the job never notices.
          if wait_line "$dir/c$other.log" "serving as the leader" 5000 "$other_lines"; then
            detail="takeover after $(( $(now_ms) - start )) ms"
          else
            log_fail "$t" "coordinator $other did not take over within 5 s"
          fi
          leader=$other
          sleep 1
        else
          outage=$((1500 + RANDOM % 2000))
          sleep "$((outage / 1000)).$(printf %03d $((outage % 1000)))"
          detail="down $outage ms"
        fi
        # While it was down (or changing hands) the job went on: no rank ended, each progressed.
        for ((r = 0; r < world; r++)); do
          kill -0 "${rpids[$r]}" 2>/dev/null || log_fail "$t" "$placement coordinator kill: rank $r ended while the coordinator was down: $(grep -m1 'FAILED\|WRONG' "$dir/r$r.log")"
          (( $(iters_of "$r") > before[r] )) || log_fail "$t" "$placement coordinator kill: rank $r made no progress while the coordinator was down"
        done
        start_coordinator "$killed"
        if [ "$store" = etcd ]; then
          # Back as the standby; then the operator ends the job through the new leader.
          wait_line "$dir/c$killed.log" "standing by" 20000 "$killed_lines" || log_fail "$t" "the restarted coordinator did not stand by"
          start=$(now_ms)
          "$bin/gradsyncctl" --coordinator "$(coordinator_list 0)" abort "$job" --reason "chaos trial $t" >>"$dir/ctl.log" 2>&1 ||
            log_fail "$t" "gradsyncctl abort through the new leader failed: $(tail -1 "$dir/ctl.log")"
        else
          # In memory: the coordinator that comes back has lost the job; the daemons hear so on
          # their next heartbeat (a third of the lease) and end it.
          declare -a reg_lines=()
          for ((d = 0; d < nodes; d++)); do reg_lines[$d]=$(lines_of "$dir/d$d.log"); done
          wait_line "$dir/c$killed.log" "listening on" 20000 "$killed_lines" || log_fail "$t" "the coordinator did not start again"
          start=$(now_ms)
          limit_ms=$((lease_ms + 1000))
        fi ;;
      pause)
        kill -STOP "${dpids[$victim_node]}"
        poll_exits $((start + pause_s * 1000))
        kill -CONT "${dpids[$victim_node]}"
        detail="paused ${pause_s} s$(exits_since "$start" " before the resume")"
        start=$(now_ms)  # every rank ends within 2 s of the resume
        limit_ms=2000
        ((pause_s * 1000 < lease_ms)) && goes_on=1 ;;
      partition)
        # From the cut: the other nodes' ranks end within the lease + 2 s (the coordinator
        # drops the node a lease after its last heartbeat, which may be late on a loaded machine); the cut node's within 5 s of the heal (its daemon finds itself
        # forgotten, or its sockets are reset, once TCP's retransmission backoff tries again).
        cut_lines=$(lines_of "$dir/d$victim_node.log")
        cut_node
        poll_exits $((start + partition_s * 1000))
        net_heal "$victim_node"
        detail="node $victim_node cut off ${partition_s} s$cut_took$(exits_since "$start" " before the heal")"
        limit_ms=$((lease_ms + 2000))
        victim_limit_ms=$((partition_s * 1000 + 5000)) ;;
      cut)
        # Never healed while the job runs: the other nodes' ranks as for a partition; the cut
        # node's once its gradsyncd has found that neither the coordinator (for longer than the
        # lease) nor the job's peer daemons answer.
        cut_lines=$(lines_of "$dir/d$victim_node.log")
        cut_node
        detail="node $victim_node cut off$cut_took"
        limit_ms=$((lease_ms + 2000)) ;;
      datacut)
        # Only the victim node's data link drops; heartbeats and events still flow. The ranks
        # at the two ends of a connection across the cut find it silent (keepalive, about 5 s),
        # the first to fail ends the job through its daemon and the coordinator.
        net_datacut "$victim_node" || log_fail "$t" "nft could not cut node $victim_node's data link"
        detail="node $victim_node's data path cut"
        limit_ms=8000 ;;
      brief)
        # A trainer or a daemon stopped well within the lease: nothing may notice.
        declare -a before=()
        pause_ms=$((200 + RANDOM % (lease_ms / 2 - 200 + 1)))
        if ((RANDOM % 2)); then stopped=${dpids[$victim_node]}; what="gradsyncd of node $victim_node"
        else stopped=${rpids[$victim]}; what="rank $victim"; fi
        kill -STOP "$stopped"
        sleep "$((pause_ms / 1000)).$(printf %03d $((pause_ms % 1000)))"
        kill -CONT "$stopped"
        for ((r = 0; r < world; r++)); do before[$r]=$(iters_of "$r"); done
        detail="$what stopped $pause_ms ms"
        goes_on=1 ;;
    esac
    if ((goes_on)); then
      sleep 2
      all_alive || log_fail "$t" "$placement $kind: a rank ended although the pause was within the lease: $(grep -h -m1 FAILED "$dir"/r*.log | head -1)"
      if [ "$kind" = brief ]; then
        for ((r = 0; r < world; r++)); do
          (( $(iters_of "$r") > before[r] )) || log_fail "$t" "$placement brief: rank $r made no progress in the 2 s after the resume"
        done
      fi
      limit_ms=0
    fi
    for ((r = 0; r < world; r++)); do
      ((goes_on)) && break
      if ((survivors_of_victim)) && ((r == victim)); then continue; fi
      if [ -n "${exit_at[$r]:-}" ]; then exit_ms[$r]=$(( $(ended_at "$r") - start )); continue; fi
      end=$((start + $(limit_of "$r") + 5000))
      while kill -0 "${rpids[$r]}" 2>/dev/null && (( $(now_ms) < end )); do sleep 0.005; done
      if kill -0 "${rpids[$r]}" 2>/dev/null; then
        log_fail "$t" "$placement $kind victim $victim: rank $r still running $(( $(limit_of "$r") + 5000)) ms after (hang)"
        hangs=$((hangs + 1))
        continue
      fi
      exit_at[$r]=$(now_ms)
      exit_ms[$r]=$(( $(ended_at "$r") - start ))
    done
    [ "$kind" = stop ] && kill -9 "${rpids[$victim]}" 2>/dev/null
    [ "$kind" = cut ] && net_heal "$victim_node"  # for the next job
    [ "$kind" = datacut ] && net_dataheal "$victim_node"
    if [ "$kind" = coordinator ] && [ "$store" = memory ]; then
      # The next job once every daemon is registered again: a daemon whose gRPC channel is still
      # in its reconnect backoff (up to 250 ms after the coordinator is back) fails a join at once
      # ("unreachable"), while the ranks may all have ended already, told by another node's.
      for ((d = 0; d < nodes; d++)); do
        wait_line "$dir/d$d.log" "registered with coordinator" 10000 "${reg_lines[$d]}" ||
          log_fail "$t" "gradsyncd $d did not register again within 10 s of the coordinator's return"
      done
    fi
    if [ "$kind" = cut ] || [ "$kind" = partition ]; then
      # The next job once the cut node's daemon is back at the coordinator (which forgot it: it
      # registers again); a join before that would find the coordinator unreachable.
      wait_line "$dir/d$victim_node.log" "registered with coordinator" 10000 "$cut_lines" ||
        log_fail "$t" "gradsyncd $victim_node did not register again within 10 s of the heal"
    fi
    for p in "${rpids[@]}"; do kill -9 "$p" 2>/dev/null; done
    wait "${rpids[@]}" 2>/dev/null
    trial_worst=0
    for ((r = 0; r < world; r++)); do
      [ -z "${exit_ms[$r]:-}" ] && continue
      line=$(grep -m1 "FAILED" "$dir/r$r.log")
      ms=${exit_ms[$r]}
      ((ms > trial_worst)) && trial_worst=$ms
      [ -n "${CHAOS_VERBOSE:-}" ] && echo "  rank $r after $ms ms: ${line:-(no error)}"
      if [ -z "$line" ]; then
        log_fail "$t" "$placement $kind victim $victim: rank $r ended without an error ($(tail -1 "$dir/r$r.log"))"; continue
      fi
      (( ms > $(limit_of "$r") )) && log_fail "$t" "$placement $kind: rank $r took $ms ms: $line"
      if [ "$kind" = datacut ]; then
        across_the_cut "$line" || log_fail "$t" "$placement datacut node $victim_node: rank $r does not name a connection across the cut: $line"
        continue
      fi
      grep -qE "$(named_pattern "$r")" <<<"$(reason_of "$line")" || log_fail "$t" "$placement $kind victim $victim (node $victim_node): rank $r names another culprit: $line"
    done
  fi
  n_wrong=$(cat "$dir"/r*.log | grep -c "^WRONG")
  ((n_wrong)) && { wrong=$((wrong + n_wrong)); log_fail "$t" "$n_wrong wrong results: $(grep -h -m1 '^WRONG' "$dir"/r*.log | head -1)"; }
  if [ "$kind" = daemon ]; then
    wait "${dpids[$victim_node]}" 2>/dev/null
    start_daemon "$victim_node"
    fds_before[$victim_node]=$(fd_count "${dpids[$victim_node]}")
    threads_after[$victim_node]=""  # a new process: its threads are compared from the next trial on
  fi
  # The daemons serve a checked job; then their descriptors and threads are back where they were.
  op_timeout_ms=60000
  spawn_ranks "check-$t" "$nodes" "$per" -- check 0,1,1000,262144
  for ((r = 0; r < world; r++)); do
    if ! timeout 60 tail --pid="${rpids[$r]}" -f /dev/null; then log_fail "$t" "check job rank $r hung"; hangs=$((hangs + 1)); fi
  done
  for p in "${rpids[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait "${rpids[@]}" 2>/dev/null
  for ((r = 0; r < world; r++)); do
    grep -q PASS "$dir/r$r.log" || log_fail "$t" "$placement: the next job failed on rank $r: $(grep -v ok "$dir/r$r.log" | head -2 | tr '\n' ' ')"
    grep -q "^count=.*: element" "$dir/r$r.log" && wrong=$((wrong + 1))
  done
  sleep 0.3
  for ((d = 0; d < nodes; d++)); do
    kill -0 "${dpids[$d]}" 2>/dev/null || { log_fail "$t" "gradsyncd $d died"; start_daemon "$d"; threads_after[$d]=""; continue; }
    after=$(fd_count "${dpids[$d]}")
    # A little slack: a gRPC connection to the coordinator may come and go.
    ((after > fds_before[d] + 2)) && log_fail "$t" "gradsyncd $d holds $after descriptors, $((fds_before[d])) before the trial"
    # Threads: against the count after the previous trial's checked job, both taken at the same
    # point (gradsyncd keeps idle connection threads for 10 s, so a count taken before any job
    # is lower); the first trial on a daemon only records it.
    after=$(thread_count "${dpids[$d]}")
    [ -n "${threads_after[$d]:-}" ] && ((after > threads_after[d] + 4)) &&
      log_fail "$t" "gradsyncd $d runs $after threads, $((threads_after[d])) after the trial before"
    threads_after[$d]=$after
  done
  for ((r = 0; r < world; r++)); do
    kill -0 "${rpids[$r]}" 2>/dev/null && log_fail "$t" "trainer $r (pid ${rpids[$r]}) is left"
  done
  ((ok)) && pass=$((pass + 1)) && passed_by_kind[$kind]=$(( ${passed_by_kind[$kind]:-0} + 1 ))
  trials_by_kind[$kind]=$(( ${trials_by_kind[$kind]:-0} + 1 ))
  ((trial_worst > ${worst_by_kind[$kind]:-0})) && worst_by_kind[$kind]=$trial_worst
  times_by_kind[$kind]+=" $trial_worst"
  echo "trial $t: $placement $kind victim $victim size $((size * 4)) B${detail:+ ($detail)}: slowest $trial_worst ms $([ "$ok" = 1 ] && echo ok || echo FAILED)"
done
echo "chaos: $pass of $trials_run trials passed ($([ ${#daemon_flags[@]} -gt 0 ] && echo proxy || echo rank sockets), store $store); wrong results $wrong; hangs $hangs"
for k in "${!trials_by_kind[@]}"; do
  # The median of the trials' slowest survivors (the lower middle one of an even count).
  median=$(tr ' ' '\n' <<<"${times_by_kind[$k]}" | grep . | sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}')
  echo "chaos:   $k: ${passed_by_kind[$k]:-0} of ${trials_by_kind[$k]} passed; slowest survivor median ${median:-0} ms, max ${worst_by_kind[$k]:-0} ms"
done
((fail == 0))

# Network namespaces for scripts/chaos.sh (sourced; needs root, `ip` and /dev/net/tun).
#
# Node i runs in namespace ${net_prefix}n$i with two links:
#   - control: a veth pair to the root namespace (10.77.i.1 there, 10.77.i.2 in the node), over
#     which the node's gradsyncd reaches the coordinator (which runs in the root namespace);
#   - data: a TUN device ${net_prefix}t$i with 10.78.0.(i+1)/24, all of them served by one
#     `lossy_link` process (tests/integration/lossy_link.cc), which forwards packets between the
#     nodes and, while impaired (SIGUSR1; SIGUSR2 clears), delays every packet by
#     $net_delay_ms and drops $net_loss_percent of them. `tc netem` would do this, but the
#     kernel here has no netem (nor fq, nor gact); nftables could drop but not delay.
# A partition cuts a node's two links (`ip link set down`) and heals them later; a data cut
# (net_datacut, needs nft) drops the node's data link alone.

net_prefix="gsc$$"
net_delay_ms=${net_delay_ms:-50}
net_loss_percent=${net_loss_percent:-5}
net_nodes=0
net_relay_pid=""

# Prints why namespaces cannot be used here, or nothing when they can.
net_unavailable() {
  [ "$(id -u)" -eq 0 ] || { echo "not root"; return; }
  command -v ip >/dev/null || { echo "no 'ip' command (iproute2)"; return; }
  [ -c /dev/net/tun ] || { echo "no /dev/net/tun"; return; }
  ip netns add "${net_prefix}probe" 2>/dev/null || { echo "'ip netns add' failed (no CAP_SYS_ADMIN/CAP_NET_ADMIN?)"; return; }
  ip netns del "${net_prefix}probe"
}

net_ns() { echo "${net_prefix}n$1"; }

# Brings up namespaces and links for N nodes and the relay. Returns 1 on failure.
net_up() {  # nodes relay-binary log-dir
  local n=$1 relay=$2 logdir=$3 i ns
  net_nodes=$n
  local devs=()
  for ((i = 0; i < n; i++)); do
    ns=$(net_ns "$i")
    ip netns add "$ns" || return 1
    ip -n "$ns" link set lo up
    ip link add "${net_prefix}v$i" type veth peer name c0 netns "$ns" || return 1
    ip addr add "10.77.$i.1/24" dev "${net_prefix}v$i"
    ip link set "${net_prefix}v$i" up
    ip -n "$ns" addr add "10.77.$i.2/24" dev c0
    ip -n "$ns" link set c0 up
    devs+=("${net_prefix}t$i")
  done
  rm -f "$logdir/relay.ready"
  "$relay" --ready-file "$logdir/relay.ready" --delay-ms "$net_delay_ms" --loss-percent "$net_loss_percent" \
    "${devs[@]}" >>"$logdir/relay.log" 2>&1 &
  net_relay_pid=$!
  local end=$(( $(date +%s) + 10 ))
  until [ -s "$logdir/relay.ready" ]; do
    (( $(date +%s) > end )) || ! kill -0 "$net_relay_pid" 2>/dev/null && { cat "$logdir/relay.log" >&2; return 1; }
    sleep 0.02
  done
  for ((i = 0; i < n; i++)); do
    ns=$(net_ns "$i")
    ip link set "${net_prefix}t$i" netns "$ns" || return 1
    ip -n "$ns" addr add "10.78.0.$((i + 1))/24" dev "${net_prefix}t$i"
    ip -n "$ns" link set "${net_prefix}t$i" up
  done
}

net_down() {
  local i
  [ -n "$net_relay_pid" ] && { kill "$net_relay_pid" 2>/dev/null; wait "$net_relay_pid" 2>/dev/null; }
  net_relay_pid=""
  # The root ends of the veth pairs first: a namespace is destroyed in the background, and a
  # pair left for a moment made the next net_up's `ip link add` fail ("File exists").
  for ((i = 0; i < net_nodes; i++)); do ip link del "${net_prefix}v$i" 2>/dev/null; ip netns del "$(net_ns "$i")" 2>/dev/null; done
  net_nodes=0
}

# Cuts node i off (control and data links down), or heals it. The data link first: each `ip`
# waits for the kernel's rtnl lock, once for seconds, and a data link that outlived the control
# link carried the coordinator's verdict on the node to its ranks from the other nodes.
net_cut() { ip -n "$(net_ns "$1")" link set "${net_prefix}t$1" down; ip -n "$(net_ns "$1")" link set c0 down; }
net_heal() { ip -n "$(net_ns "$1")" link set c0 up; ip -n "$(net_ns "$1")" link set "${net_prefix}t$1" up; }

# Cuts node i's data path alone, or heals it: nftables in its namespace drops every packet in
# and out of its TUN device (the data link), while the control link to the coordinator stays
# up. The nodes still reach the coordinator; their data connections are black-holed (no reset,
# no ICMP), as a firewall that starts dropping or a dead switch port between them would.
net_datacut() {
  ip netns exec "$(net_ns "$1")" nft "add table inet gsdatacut; \
    add chain inet gsdatacut in { type filter hook input priority 0; }; \
    add chain inet gsdatacut out { type filter hook output priority 0; }; \
    add rule inet gsdatacut in iifname ${net_prefix}t$1 drop; \
    add rule inet gsdatacut out oifname ${net_prefix}t$1 drop"
}
net_dataheal() { ip netns exec "$(net_ns "$1")" nft delete table inet gsdatacut 2>/dev/null; }

# Loss and delay on every data packet between nodes: on / off.
net_impair() { kill -USR1 "$net_relay_pid"; }
net_clear() { kill -USR2 "$net_relay_pid"; }

# The address node i's gradsyncd uses for the coordinator and for its data port.
net_coordinator_host() { echo "10.77.$1.1"; }
net_data_host() { echo "10.78.0.$(($1 + 1))"; }

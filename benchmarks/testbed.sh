#!/usr/bin/env bash
# Emulated multi-node cluster on one machine (the recipe is in benchmarks/README.md, "The emulated cluster"):
# one network namespace per node (paro-n0 .. paro-n{K-1}), one more (paro-sw) holding a Linux bridge as the
# switch, a veth pair per node (veth-n<i> inside the node with 10.77.0.<i+1>/24, veth-s<i> on the bridge),
# MTU 9000 everywhere, lo up, and tc tbf on both ends of every veth so that both directions are shaped.
#
#   testbed.sh up NODES RATE      e.g. `testbed.sh up 2 1gbit` (RATE as tc writes it: 1gbit, 200mbit, ...)
#   testbed.sh down               removes exactly the namespaces `up` created (recorded in a state file)
#   testbed.sh exec NODE CMD...   runs CMD inside node NODE (an index, sw, or a name such as paro-n1)
#   testbed.sh status             lists the namespaces, addresses and qdiscs of the testbed
#   testbed.sh check              opens a TCP connection from every node to node 0 (needs python3)
#
# Environment: PARO_TB_MTU (9000), PARO_TB_BURST (256kb), PARO_TB_LATENCY (5ms), PARO_TB_STATE (state file).
# Nothing is created outside the namespaces: the veth ends are created directly inside them.
set -euo pipefail

PREFIX=paro
SW="${PREFIX}-sw"
BRIDGE=br0
SUBNET=10.77.0
MTU="${PARO_TB_MTU:-9000}"
BURST="${PARO_TB_BURST:-256kb}"
LATENCY="${PARO_TB_LATENCY:-5ms}"
STATE="${PARO_TB_STATE:-/run/paro-testbed.state}"

die() {
    echo "testbed.sh: $*" >&2
    exit 1
}

usage() {
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}

need_root() {
    if [[ "$(id -u)" -ne 0 ]]; then
        die "must run as root (it creates network namespaces, veth pairs and tc qdiscs); you are uid $(id -u)." \
            "Without root, run the benchmark on plain localhost: python3 benchmarks/collectives.py --no-testbed ..."
    fi
    command -v ip >/dev/null || die "'ip' (iproute2) not found"
    command -v tc >/dev/null || die "'tc' (iproute2) not found"
}

node_name() { echo "${PREFIX}-n$1"; }

# lo up (ranks of a node talk over it), and no IPv6 (router/neighbour solicitations would add stray bytes
# to the counters that benchmarks read).
quiet_ns() {
    ip -n "$1" link set lo up
    ip netns exec "$1" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 || true
}

# Names recorded by `up`, one per line; `down` deletes exactly these.
recorded() { [[ -f "$STATE" ]] && cat "$STATE" || true; }

cmd_down() {
    need_root
    local ns existing
    existing="$(ip netns list | awk '{print $1}')"
    if [[ ! -f "$STATE" ]]; then
        echo "testbed.sh: no state file $STATE: nothing recorded to remove" >&2
        return 0
    fi
    # Nodes first, then the switch (deleting a namespace destroys the veth pairs it holds).
    while read -r ns; do
        [[ -n "$ns" ]] || continue
        if grep -qx "$ns" <<<"$existing"; then
            ip netns del "$ns" || echo "testbed.sh: could not delete namespace $ns" >&2
        fi
    done < <(recorded | tac)
    rm -f "$STATE"
    echo "testbed.sh: down"
}

cmd_up() {
    [[ $# -eq 2 ]] || usage
    local k="$1" rate="$2" i ns addr
    [[ "$k" =~ ^[0-9]+$ && "$k" -ge 1 && "$k" -le 200 ]] || die "NODES must be an integer in 1..200, got '$k'"
    [[ "$rate" =~ ^[0-9.]+[a-zA-Z]*$ ]] || die "RATE must look like 1gbit or 200mbit, got '$rate'"
    need_root
    [[ ! -e "$STATE" ]] || die "a testbed seems to be up already ($STATE exists); run 'testbed.sh down' first"
    local existing
    existing="$(ip netns list | awk '{print $1}')"
    for ns in "$SW" $(for ((i = 0; i < k; i++)); do node_name "$i"; done); do
        if grep -qx "$ns" <<<"$existing"; then
            die "namespace $ns exists already and was not created by this script's state; remove it first"
        fi
    done

    mkdir -p "$(dirname "$STATE")"
    : >"$STATE"
    # Undo a partial setup if any step fails.
    trap 'echo "testbed.sh: setup failed; removing what was created" >&2; cmd_down >/dev/null 2>&1 || true' ERR

    ip netns add "$SW"
    echo "$SW" >>"$STATE"
    quiet_ns "$SW"
    ip -n "$SW" link add "$BRIDGE" type bridge
    ip -n "$SW" link set "$BRIDGE" mtu "$MTU"
    ip -n "$SW" link set "$BRIDGE" up

    for ((i = 0; i < k; i++)); do
        ns="$(node_name "$i")"
        addr="${SUBNET}.$((i + 1))"
        ip netns add "$ns"
        echo "$ns" >>"$STATE"
        quiet_ns "$ns"
        ip link add "veth-n$i" netns "$ns" mtu "$MTU" type veth peer name "veth-s$i" netns "$SW" mtu "$MTU"
        ip -n "$ns" addr add "${addr}/24" dev "veth-n$i"
        ip -n "$ns" link set "veth-n$i" up
        ip -n "$SW" link set "veth-s$i" master "$BRIDGE"
        ip -n "$SW" link set "veth-s$i" up
        # node -> switch on the node's end, switch -> node on the bridge port
        ip netns exec "$ns" tc qdisc add dev "veth-n$i" root tbf rate "$rate" burst "$BURST" latency "$LATENCY"
        ip netns exec "$SW" tc qdisc add dev "veth-s$i" root tbf rate "$rate" burst "$BURST" latency "$LATENCY"
    done
    trap - ERR
    echo "testbed.sh: up: $k nodes ${SUBNET}.1..${SUBNET}.$k (veth-n<i>), rate $rate burst $BURST latency $LATENCY," \
        "mtu $MTU"
}

resolve_node() {
    local n="$1"
    if [[ "$n" =~ ^[0-9]+$ ]]; then
        node_name "$n"
    elif [[ "$n" == sw ]]; then
        echo "$SW"
    else
        echo "$n"
    fi
}

cmd_exec() {
    [[ $# -ge 2 ]] || usage
    need_root
    local ns
    ns="$(resolve_node "$1")"
    shift
    ip netns list | awk '{print $1}' | grep -qx "$ns" || die "no namespace $ns (is the testbed up?)"
    exec ip netns exec "$ns" "$@"
}

cmd_status() {
    need_root
    local ns
    echo "state file: $STATE"
    recorded | sed 's/^/  recorded: /'
    for ns in $(ip netns list | awk '{print $1}' | grep "^${PREFIX}-" || true); do
        echo "== $ns"
        ip -n "$ns" -br addr
        ip netns exec "$ns" tc qdisc show | grep -v noqueue || true
    done
}

cmd_check() {
    need_root
    command -v python3 >/dev/null || die "python3 not found"
    local nodes i ns
    nodes="$(recorded | grep -c "^${PREFIX}-n" || true)"
    [[ "$nodes" -ge 1 ]] || die "the testbed is not up"
    local port=29399
    ip netns exec "$(node_name 0)" python3 -c "
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('${SUBNET}.1', $port)); s.listen(); s.settimeout(10)
for _ in range($nodes):
    c, _ = s.accept(); c.sendall(b'ok'); c.close()
" &
    local server=$!
    sleep 0.3
    for ((i = 0; i < nodes; i++)); do
        ns="$(node_name "$i")"
        ip netns exec "$ns" python3 -c "
import socket
c = socket.create_connection(('${SUBNET}.1', $port), timeout=5)
assert c.recv(2) == b'ok'
" || die "$ns cannot reach ${SUBNET}.1"
        echo "$ns -> ${SUBNET}.1: ok"
    done
    wait "$server"
}

main() {
    [[ $# -ge 1 ]] || usage
    local cmd="$1"
    shift
    case "$cmd" in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    exec) cmd_exec "$@" ;;
    status) cmd_status ;;
    check) cmd_check ;;
    -h | --help | help) usage ;;
    *) die "unknown command '$cmd' (up, down, exec, status, check)" ;;
    esac
}

main "$@"

# lab.sh: a network lab of Linux network namespaces, sourced by tests and
# benchmarks (bash). Every host is a namespace of its own, joined to one
# bridge in a "switch" namespace by a veth pair; addresses come from
# 10.77.0.0/16 and exist only inside the lab's namespaces, so nothing the lab
# does reaches the machine's own network, and labs running side by side (they
# are named hmlab<PID>-...) never see each other.
#
#   . tests/netlab/lab.sh
#   lab_require            # exit 77 with a reason unless root, netns, tc, nft
#   lab_up 4               # hosts h1..h4 at 10.77.1.1 .. 10.77.1.4 (lab_addr h2)
#   lab_cap h1 100mbit     # egress cap of h1 (tc tbf); any tc rate: 1gbit, 20mbit
#   lab_loss h2 5          # the switch drops 5% of what h2 sends (nftables)
#   lab_nat h4             # h4 moves behind a masquerading router: it can dial
#                          # out, nobody can dial it (its address: 10.77.104.2)
#   lab_rtt h1 h2 20       # round trips of 20 ms between h1's and h2's daemons:
#                          # each holds what it sends to the other 10 ms
#                          # (TestDelay); call it before lab_hivemindd
#   lab_exec h1 cmd ...    # run cmd in h1's namespace (foreground)
#   lab_spawn h1 NAME cmd ...  # run cmd in h1 in the background, output in
#                          # $LAB_DIR/NAME.log, pid in $LAB_DIR/NAME.pid
#   lab_hivemindd h1 [flags...]  # a hivemindd on h1 listening on its address,
#                          # state and control socket in $LAB_DIR/h1; waits
#                          # until its control socket answers
#   lab_ctl h1 args ...    # hivemindctl -s <h1's socket> args ...
#   lab_peer h1            # h1's daemon's PEERID@HOST:PORT
#   lab_down               # kill everything in the namespaces, delete them
#
# lab_up installs an EXIT trap that calls lab_down (and INT/TERM/HUP traps
# that exit), so the lab goes away on any exit, failed or not; a caller with
# cleanup of its own defines lab_cleanup_hook, which lab_down calls first.
# Processes are stopped by namespace (ip netns pids), so every daemon started
# inside the lab dies with it, however it was started. A lab left behind by a
# SIGKILLed shell (its PID gone) is removed by the next lab_up.
#
# Environment: HM_BUILDDIR (the build tree, for lab_hivemindd and lab_ctl;
# default: the current directory), HM_NETLAB_SKIP=1 (lab_require skips), LAB_KEEP=1 (keep $LAB_DIR, the logs and
# state, after lab_down).
#
# Latency is not made here: netem is not in every kernel. The daemon delays
# what it sends itself (TestDelayMs for everyone, TestDelay per address:
# test-only options, hivemindd.conf(5)); lab_rtt writes the latter.

LAB_ID="hmlab$$"
LAB_N=0
LAB_DIR=
LAB_UP=0
LAB_NET=10.77

lab_log() { printf 'netlab: %s\n' "$*" >&2; }
lab_die() { printf 'netlab: %s\n' "$*" >&2; exit 1; }

# Exits 77 (automake's SKIP) with a clear reason when the lab cannot run
# here: not root, no `ip netns`, or a missing tool the caller asks for
# (lab_require tc nft).
lab_require() {
    local tool
    if [ -n "${HM_NETLAB_SKIP:-}" ]; then
        echo "SKIP: HM_NETLAB_SKIP is set (CI runs the lab in the plain build only)"
        exit 77
    fi
    if [ "$(id -u)" != 0 ]; then
        echo "SKIP: the network lab needs root (network namespaces, veth, tc, nftables)"
        exit 77
    fi
    if ! command -v ip >/dev/null 2>&1; then
        echo "SKIP: the network lab needs ip (Debian: iproute2)"
        exit 77
    fi
    for tool in "$@"; do
        if ! command -v "$tool" >/dev/null 2>&1; then
            case $tool in
                nft) echo "SKIP: the network lab needs nft (Debian: nftables)" ;;
                tc) echo "SKIP: the network lab needs tc (Debian: iproute2)" ;;
                *) echo "SKIP: the network lab needs $tool" ;;
            esac
            exit 77
        fi
    done
    local p="${LAB_ID}-probe" why=
    if ! ip netns add "$p" 2>/dev/null; then
        echo "SKIP: network namespaces are not available here (ip netns add failed)"
        exit 77
    fi
    # What the lab builds, tried once in a namespace of its own: a kernel
    # without veth, bridges, tbf or nftables' netdev ingress is a skip with
    # its reason, not a failure half-way through a test.
    if ! ip -n "$p" link add name pa type veth peer name pb 2>/dev/null; then
        why="veth pairs cannot be made (no veth in the kernel?)"
    elif ! ip -n "$p" link add name pbr type bridge 2>/dev/null; then
        why="bridges cannot be made (no bridge in the kernel?)"
    else
        ip -n "$p" link set pa up
        if command -v tc >/dev/null 2>&1 &&
            ! tc -n "$p" qdisc add dev pa root tbf rate 1mbit burst 65536 latency 100ms 2>/dev/null; then
            for tool in "$@"; do
                [ "$tool" = tc ] && why="tc tbf does not work here (sch_tbf missing?)"
            done
        fi
        if command -v nft >/dev/null 2>&1 && [ -z "$why" ] &&
            ! printf 'table netdev p { chain c { type filter hook ingress device "pa" priority 0; numgen random mod 100 lt 1 drop; }; }\n' |
            ip netns exec "$p" nft -f - 2>/dev/null; then
            for tool in "$@"; do
                [ "$tool" = nft ] && why="nftables' netdev ingress or numgen does not work here"
            done
        fi
    fi
    ip netns del "$p" 2>/dev/null
    if [ -n "$why" ]; then
        echo "SKIP: the network lab cannot run here: $why"
        exit 77
    fi
    return 0
}

lab_ns() {
    case $1 in
        sw) echo "${LAB_ID}-sw" ;;
        h[0-9]*) echo "${LAB_ID}-$1" ;;
        r[0-9]*) echo "${LAB_ID}-$1" ;;
        *) lab_die "no host '$1' in this lab" ;;
    esac
}

# The host's index: h3 -> 3.
lab_idx() {
    local i=${1#h}
    case $i in
        '' | *[!0-9]*) lab_die "not a host name: '$1' (h1..h$LAB_N)" ;;
    esac
    [ "$i" -ge 1 ] && [ "$i" -le "$LAB_N" ] || lab_die "no host $1 (the lab has h1..h$LAB_N)"
    echo "$i"
}

# The address other hosts reach (or, behind NAT, cannot reach) the host at.
lab_addr() {
    local i
    i=$(lab_idx "$1")
    if [ -e "$LAB_DIR/$1.nat" ]; then
        echo "$LAB_NET.$((100 + i)).2"
    else
        echo "$LAB_NET.1.$i"
    fi
}

# Removes the namespaces of labs whose shell is gone (SIGKILL skips traps).
lab_reap() {
    local ns pid
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^hmlab[0-9]*-' || true); do
        pid=${ns#hmlab}
        pid=${pid%%-*}
        if ! kill -0 "$pid" 2>/dev/null; then
            lab_ns_kill "$ns"
            ip netns del "$ns" 2>/dev/null || true
        fi
    done
}

# Stops every process in a namespace: SIGTERM, a grace period, SIGKILL.
lab_ns_kill() {
    local ns=$1 pids t
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] || return 0
    kill -TERM $pids 2>/dev/null || true
    for t in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [ -n "$pids" ] || return 0
        sleep 0.25
    done
    kill -KILL $pids 2>/dev/null || true
    sleep 0.1
}

lab_up() {
    local n=$1 i ns sw
    case $n in
        '' | *[!0-9]*) lab_die "usage: lab_up N (1 to 60 hosts)" ;;
    esac
    [ "$n" -ge 1 ] && [ "$n" -le 60 ] || lab_die "usage: lab_up N (1 to 60 hosts)"
    [ "$LAB_UP" = 0 ] || lab_die "lab_up: a lab is already up in this shell"
    lab_reap
    LAB_DIR=$(mktemp -d "${TMPDIR:-/tmp}/${LAB_ID}.XXXXXX") || lab_die "mktemp failed"
    LAB_N=$n
    LAB_UP=1
    trap 'lab_down' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    trap 'exit 129' HUP

    sw=$(lab_ns sw)
    ip netns add "$sw" || lab_die "ip netns add $sw failed"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    for i in $(seq 1 "$n"); do
        ns=$(lab_ns "h$i")
        ip netns add "$ns" || lab_die "ip netns add $ns failed"
        ip -n "$ns" link set lo up
        # Both ends are made inside the lab's namespaces: no name ever
        # appears in the machine's own namespace, where it could clash.
        ip -n "$sw" link add "h$i" type veth peer name eth0 netns "$ns" ||
            lab_die "veth for h$i failed"
        ip -n "$sw" link set "h$i" master br0 up
        ip -n "$ns" addr add "$LAB_NET.1.$i/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
    lab_wait_links
}

# Waits until the hosts' addresses are usable (duplicate address detection
# and the bridge's port states settle in well under a second).
lab_wait_links() {
    local t i ok
    for t in $(seq 1 50); do
        ok=1
        for i in $(seq 1 "$LAB_N"); do
            if ip -n "$(lab_ns "h$i")" addr show dev eth0 2>/dev/null | grep -q tentative; then
                ok=0
            fi
        done
        [ "$ok" = 1 ] && return 0
        sleep 0.1
    done
}

lab_exec() {
    local h=$1
    shift
    ip netns exec "$(lab_ns "$h")" "$@"
}

# Runs a command in the background in a host's namespace; its output goes
# to $LAB_DIR/NAME.log and its pid to $LAB_DIR/NAME.pid.
lab_spawn() {
    local h=$1 name=$2 ns
    shift 2
    ns=$(lab_ns "$h")
    ip netns exec "$ns" "$@" >"$LAB_DIR/$name.log" 2>&1 &
    echo $! >"$LAB_DIR/$name.pid"
}

# Egress cap of a host's link, with tc tbf. The bucket holds at least 4 ms
# of traffic and 64 KiB, so that segmentation offload's 64 KiB packets pass
# and the timer granularity does not cap the rate below what was asked.
lab_cap() {
    local h=$1 rate=$2 ns bps burst
    ns=$(lab_ns "$h")
    bps=$(lab_rate_bps "$rate") || lab_die "lab_cap: bad rate '$rate' (e.g. 100mbit, 1gbit)"
    burst=$((bps / 8 / 250))
    [ "$burst" -ge 65536 ] || burst=65536
    tc -n "$ns" qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 100ms ||
        lab_die "lab_cap $h $rate: tc failed"
}

# Bits per second of a tc rate: 100mbit, 1gbit, 500kbit, 64000bit.
lab_rate_bps() {
    local r=$1 num unit
    num=${r%%[!0-9]*}
    unit=${r#"$num"}
    [ -n "$num" ] || return 1
    case $unit in
        bit | '') echo "$num" ;;
        kbit) echo $((num * 1000)) ;;
        mbit) echo $((num * 1000000)) ;;
        gbit) echo $((num * 1000000000)) ;;
        *) return 1 ;;
    esac
}

# Loss on what a host sends: the switch drops PCT% of the frames arriving
# from the host's port at random (nftables numgen, netdev ingress of the
# switch-side veth). The host itself sees nothing: its send calls succeed,
# as on a lossy link. Calling it again replaces the rate; 0 removes it.
lab_loss() {
    local h=$1 pct=$2 sw port
    case $pct in
        '' | *[!0-9]*) lab_die "lab_loss: PCT must be an integer 0..100" ;;
    esac
    [ "$pct" -le 100 ] || lab_die "lab_loss: PCT must be an integer 0..100"
    sw=$(lab_ns sw)
    port=$(lab_port "$h")
    ip netns exec "$sw" nft delete table netdev "loss_$port" 2>/dev/null || true
    [ "$pct" -gt 0 ] || return 0
    ip netns exec "$sw" nft -f - <<EOF || lab_die "lab_loss $h $pct: nft failed"
table netdev loss_$port {
    chain arriving {
        type filter hook ingress device "$port" priority 0; policy accept;
        numgen random mod 100 lt $pct drop
    }
}
EOF
}

# The host's port on the switch: hN, or rN once it is behind NAT.
lab_port() {
    local i
    i=$(lab_idx "$1")
    if [ -e "$LAB_DIR/$1.nat" ]; then
        echo "r$i"
    else
        echo "h$i"
    fi
}

# Puts a host behind NAT: its link to the switch is replaced by a router
# namespace rN (10.77.1.(100+N) on the switch) and a private link,
# 10.77.(100+N).0/24, to the host at .2. The router masquerades what the
# host sends (nftables) and forwards nothing inbound that the host did not
# start, so the host can dial everyone and nobody can dial it. Call it
# before starting the host's daemons; an earlier lab_cap or lab_loss of the
# host is lost (call them again: they then apply to the router's side).
lab_nat() {
    local h=$1 i ns sw r lan
    i=$(lab_idx "$h")
    [ "$i" -le 60 ] || lab_die "lab_nat: host index over 60"
    [ ! -e "$LAB_DIR/$h.nat" ] || return 0
    ns=$(lab_ns "$h")
    sw=$(lab_ns sw)
    r=$(lab_ns "r$i")
    lan="$LAB_NET.$((100 + i))"
    ip -n "$sw" link del "h$i" 2>/dev/null || true
    ip netns add "$r" || lab_die "ip netns add $r failed"
    ip -n "$r" link set lo up
    ip -n "$sw" link add "r$i" type veth peer name wan netns "$r" || lab_die "veth r$i failed"
    ip -n "$sw" link set "r$i" master br0 up
    ip -n "$r" addr add "$LAB_NET.1.$((100 + i))/24" dev wan
    ip -n "$r" link set wan up
    ip -n "$r" link add lan type veth peer name eth0 netns "$ns" || lab_die "veth lan$i failed"
    ip -n "$r" addr add "$lan.1/24" dev lan
    ip -n "$r" link set lan up
    ip -n "$ns" addr add "$lan.2/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" route add default via "$lan.1"
    ip netns exec "$r" sysctl -qw net.ipv4.ip_forward=1
    ip netns exec "$r" nft -f - <<EOF || lab_die "lab_nat $h: nft failed"
table ip nat {
    chain post {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan" masquerade
    }
}
table ip filter {
    chain routed {
        type filter hook forward priority 0; policy drop;
        iifname "lan" oifname "wan" accept
        iifname "wan" oifname "lan" ct state established,related accept
    }
    chain arriving {
        type filter hook input priority 0; policy accept;
        iifname "wan" ct state established,related accept
        iifname "wan" drop
    }
}
EOF
    : >"$LAB_DIR/$h.nat"
    lab_wait_links
}

# Round trips of MS milliseconds (even) between two hosts' daemons: each
# holds what it sends to the other's address MS/2 ms (TestDelay, given by
# lab_hivemindd). Pairs without one have no delay, unless the daemon's
# flags give --test-delay-ms. Call it after lab_nat and before the daemons
# start.
lab_rtt() {
    local a=$1 b=$2 ms=$3
    case $ms in
        '' | *[!0-9]*) lab_die "lab_rtt: MS must be an even whole number" ;;
    esac
    [ $((ms % 2)) = 0 ] && [ "$ms" -le 20000 ] || lab_die "lab_rtt: MS must be even, at most 20000"
    [ "$a" != "$b" ] || lab_die "lab_rtt: two different hosts"
    echo "$(lab_seen_addr "$b")=$((ms / 2))" >>"$LAB_DIR/$a.delay"
    echo "$(lab_seen_addr "$a")=$((ms / 2))" >>"$LAB_DIR/$b.delay"
}

# The address the other hosts see a host's traffic come from: its own, or
# its router's behind NAT.
lab_seen_addr() {
    local i
    i=$(lab_idx "$1")
    if [ -e "$LAB_DIR/$1.nat" ]; then
        echo "$LAB_NET.1.$((100 + i))"
    else
        echo "$LAB_NET.1.$i"
    fi
}

lab_builddir() { echo "${HM_BUILDDIR:-$PWD}"; }

# Starts a hivemindd on a host, listening on the host's address (port
# 31400 unless the flags say otherwise), with its state and control socket
# in $LAB_DIR/HOST, its log in $LAB_DIR/HOST.log; returns once its control
# socket answers `info` (fails after 20 s).
lab_hivemindd() {
    local h=$1 dir bin t
    shift
    dir="$LAB_DIR/$h"
    bin="$(lab_builddir)/src/hivemindd"
    [ -x "$bin" ] || lab_die "$bin is not built"
    mkdir -p "$dir"
    # lab_rtt's delays come first, so the caller's own --test-delay wins.
    if [ -s "$LAB_DIR/$h.delay" ]; then
        set -- --test-delay "$(paste -sd, "$LAB_DIR/$h.delay")" "$@"
    fi
    lab_spawn "$h" "$h" "$bin" --listen "$(lab_addr "$h"):31400" --state-dir "$dir" \
        --control-socket "$dir/control.sock" "$@"
    for t in $(seq 1 200); do
        if [ -S "$dir/control.sock" ] && lab_ctl "$h" info >/dev/null 2>&1; then
            return 0
        fi
        if ! kill -0 "$(cat "$LAB_DIR/$h.pid")" 2>/dev/null; then
            lab_log "hivemindd on $h exited; its log:"
            cat "$LAB_DIR/$h.log" >&2
            return 1
        fi
        sleep 0.1
    done
    lab_log "hivemindd on $h did not answer within 20 s; its log:"
    cat "$LAB_DIR/$h.log" >&2
    return 1
}

# hivemindctl on a host's daemon. The control socket is a Unix socket in
# $LAB_DIR, so the command need not run in the namespace.
lab_ctl() {
    local h=$1
    shift
    "$(lab_builddir)/src/hivemindctl" -s "$LAB_DIR/$h/control.sock" "$@"
}

# The PEERID@HOST:PORT of a host's daemon.
lab_peer() {
    lab_ctl "$1" --json info | sed -n 's/.*"address":"\([^"]*\)".*/\1/p'
}

lab_down() {
    local i ns
    [ "$LAB_UP" = 1 ] || return 0
    LAB_UP=0
    if declare -F lab_cleanup_hook >/dev/null; then
        lab_cleanup_hook || true
    fi
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${LAB_ID}-" || true); do
        lab_ns_kill "$ns"
    done
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${LAB_ID}-" || true); do
        ip netns del "$ns" 2>/dev/null || true
    done
    if [ -n "$LAB_DIR" ] && [ "${LAB_KEEP:-0}" != 1 ]; then
        rm -rf "$LAB_DIR"
    elif [ -n "$LAB_DIR" ]; then
        lab_log "kept $LAB_DIR"
    fi
    trap - EXIT INT TERM HUP
    return 0
}

#!/usr/bin/env bash
# quickstart.sh: sets hivemindd up on a fresh Debian 12 machine and runs it.
#
#   contrib/quickstart.sh demo [--short]   build, then run a local swarm
#   contrib/quickstart.sh test             build, then run the test suite
#
# Both commands first check the Debian packages the build needs. As root the
# missing ones are installed with apt-get; otherwise the exact command to run
# is printed and the script stops. Then the tree is bootstrapped (autoreconf)
# when needed, configured in build/ (reused once configured) and built.
#
# The demo starts four hivemindd on 127.0.0.1 (free ports, throwaway state
# directories and control sockets), chains them together through their
# printed addresses, waits until every node sees the other three and shows
# what hivemindctl reports. Without --short it then watches the peer table
# for a while, freezes one node with SIGSTOP until the others drop it after
# missed pings, thaws it and waits for it to rejoin. Every daemon is stopped
# with SIGTERM (one with `hivemindctl shutdown`) and must exit with status 0.
#
# Environment: HM_BUILD_DIR (default: build/ in the repository),
# HM_CONFIGURE_ARGS (extra ./configure arguments, used on first configure).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${HM_BUILD_DIR:-$ROOT/build}"

PACKAGES=(
    build-essential make autoconf automake libtool pkg-config
    libuv1-dev libsodium-dev libmsgpack-dev libopenblas-dev libcriterion-dev libjansson-dev
    procps iproute2
)

say() { printf '\n==> %s\n' "$*"; }
die() { printf 'quickstart: %s\n' "$*" >&2; exit 1; }

usage() {
    cat <<EOF
usage: $0 demo [--short]   build hivemindd and run a local four-node swarm
       $0 test             build hivemindd and run the test suite (make check)
EOF
}

# ---- setup ----------------------------------------------------------------

check_packages() {
    local missing=() p status
    if ! command -v dpkg-query >/dev/null 2>&1; then
        say "not a Debian system: make sure these (or their equivalents) are installed:"
        printf '    %s\n' "${PACKAGES[*]}"
        return 0
    fi
    for p in "${PACKAGES[@]}"; do
        status="$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)"
        [ "$status" = installed ] || missing+=("$p")
    done
    if [ "${#missing[@]}" -eq 0 ]; then
        say "all build packages are installed"
        return 0
    fi
    if [ "$(id -u)" -eq 0 ]; then
        say "installing: ${missing[*]}"
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
        return 0
    fi
    printf 'quickstart: these packages are missing: %s\n' "${missing[*]}" >&2
    printf 'install them with:\n\n    sudo apt-get install -y %s\n\nthen run this again.\n' \
        "${missing[*]}" >&2
    exit 1
}

build() {
    cd "$ROOT"
    if [ ! -x configure ] || [ configure.ac -nt configure ] || [ Makefile.am -nt configure ] \
        || [ ! -f Makefile.in ] || [ Makefile.am -nt Makefile.in ]; then
        say "autoreconf -fi"
        autoreconf -fi
    fi
    if [ -f "$ROOT/config.status" ] && [ "$BUILD" != "$ROOT" ]; then
        die "the source tree itself is configured; run 'make distclean' in $ROOT first"
    fi
    mkdir -p "$BUILD"
    cd "$BUILD"
    if [ ! -f Makefile ]; then
        say "configure (in $BUILD)"
        # Word splitting of HM_CONFIGURE_ARGS is wanted: it holds several arguments.
        # shellcheck disable=SC2086
        "$ROOT/configure" ${HM_CONFIGURE_ARGS:-}
    fi
    say "make -j$(nproc)"
    make -j"$(nproc)"
}

# ---- test -----------------------------------------------------------------

run_tests() {
    cd "$BUILD"
    say "make check"
    if make -j"$(nproc)" check; then
        say "all tests passed"
        return 0
    fi
    # test-suite.log gathers the logs of the tests that failed.
    if [ -f test-suite.log ]; then
        say "test-suite.log"
        cat test-suite.log
    fi
    die "make check failed"
}

# ---- demo -----------------------------------------------------------------

NODES=4
PING_INTERVAL=2
DEMO_DIR=""
PIDS=()
ADDRS=()
IDS=()
HIVEMINDD=""
HIVEMINDCTL=""

# True while pid runs; a child that exited but was not reaped yet is a
# zombie, which kill -0 would still report as alive.
is_running() {
    local state
    state="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
    [[ "$state" != Z* ]]
}

cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do
        [ -n "$pid" ] || continue
        if is_running "$pid"; then
            kill -CONT "$pid" 2>/dev/null || true
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    for pid in "${PIDS[@]}"; do
        [ -n "$pid" ] || continue
        for _ in $(seq 50); do
            is_running "$pid" || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    done
    if [ -n "$DEMO_DIR" ] && [ -d "$DEMO_DIR" ]; then
        rm -rf "$DEMO_DIR"
    fi
}

# Shows the end of every node's log, so that a failed demo explains itself.
show_logs() {
    local i
    for ((i = 1; i <= NODES; i++)); do
        [ -f "$DEMO_DIR/n$i/stderr" ] || continue
        printf '\n--- node %d log (last 20 lines) ---\n' "$i" >&2
        tail -n 20 "$DEMO_DIR/n$i/stderr" >&2 || true
    done
}

fail() {
    printf '\nquickstart: demo failed: %s\n' "$*" >&2
    show_logs
    exit 1
}

ctl() {
    local i="$1"
    shift
    "$HIVEMINDCTL" -s "$DEMO_DIR/n$i/control.sock" --timeout 5 "$@"
}

start_node() {
    local i="$1" peers="$2" dir line=""
    dir="$DEMO_DIR/n$i"
    mkdir -m 0700 "$dir"
    local args=(--listen 127.0.0.1:0 --state-dir "$dir" --control-socket "$dir/control.sock"
                --swarm quickstart --ping-interval "$PING_INTERVAL" --log-level info)
    [ -z "$peers" ] || args+=(--initial-peers "$peers")
    "$HIVEMINDD" "${args[@]}" >"$dir/stdout" 2>"$dir/stderr" &
    PIDS[i]=$!
    # The first line of stdout is the node's address, PEERID@HOST:PORT; it is
    # complete once the newline is there.
    for _ in $(seq 100); do
        if [ "$(wc -l <"$dir/stdout")" -ge 1 ]; then
            line="$(head -n 1 "$dir/stdout")"
            break
        fi
        is_running "${PIDS[i]}" || fail "node $i exited at start"
        sleep 0.1
    done
    [[ "$line" =~ ^([a-z2-7]{52})@127\.0\.0\.1:[0-9]+$ ]] \
        || fail "node $i printed '$line' instead of its address"
    ADDRS[i]="$line"
    IDS[i]="${BASH_REMATCH[1]}"
    # The control socket is up once it answers.
    for _ in $(seq 50); do
        ctl "$i" info >/dev/null 2>&1 && break
        sleep 0.1
    done
    ctl "$i" info >/dev/null || fail "node $i does not answer on its control socket"
    printf 'node %d: pid %d, %s\n' "$i" "${PIDS[i]}" "$line"
}

# Counts how many of the nodes listed after the first argument appear in
# node i's peer table.
count_seen() {
    local i="$1" out n=0 j
    shift
    out="$(ctl "$i" --json peers 2>/dev/null)" || { echo 0; return; }
    for j in "$@"; do
        if grep -qF "${IDS[j]}" <<<"$out"; then n=$((n + 1)); fi
    done
    echo "$n"
}

others() {
    local i="$1" j
    for ((j = 1; j <= NODES; j++)); do [ "$j" -eq "$i" ] || printf '%d ' "$j"; done
}

wait_mesh() {
    local deadline=$((SECONDS + $1)) i ok
    while :; do
        ok=1
        for ((i = 1; i <= NODES; i++)); do
            # shellcheck disable=SC2046
            [ "$(count_seen "$i" $(others "$i"))" -eq $((NODES - 1)) ] || ok=0
        done
        [ "$ok" -eq 0 ] || return 0
        [ "$SECONDS" -lt "$deadline" ] || return 1
        sleep 0.5
    done
}

show_metrics() {
    local i="$1" out
    out="$(ctl "$i" metrics)" || fail "hivemindctl metrics failed on node $i"
    grep -E '^hivemindd_(peers|connections|received_bytes_total|sent_bytes_total|handshakes_total|rpc_calls_total|rpc_latency_seconds_count|dht_routing_table_contacts|dht_records)' \
        <<<"$out" || true
}

# Waits up to 15 s for node i to exit (killing it after that), reaps it and
# prints its exit status; returns that status.
reap_node() {
    local i="$1" j pid rc=0
    pid="${PIDS[i]}"
    for ((j = 0; j < 150; j++)); do
        is_running "$pid" || break
        sleep 0.1
    done
    if is_running "$pid"; then
        printf 'node %d did not exit within 15 s; killing it\n' "$i"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" || rc=$?
    PIDS[i]=""
    printf 'node %d exited with status %d\n' "$i" "$rc"
    return "$rc"
}

# SIGTERMs every node still running and checks each exits with status 0. A
# node that is already draining is not signalled again: a second SIGTERM
# during the drain kills hivemindd on purpose.
stop_all() {
    local i failed=0
    say "stopping the nodes with SIGTERM"
    for ((i = 1; i <= NODES; i++)); do
        [ -z "${PIDS[i]}" ] || kill -TERM "${PIDS[i]}" 2>/dev/null || true
    done
    for ((i = 1; i <= NODES; i++)); do
        [ -n "${PIDS[i]}" ] || continue
        reap_node "$i" || failed=1
    done
    [ "$failed" -eq 0 ] || fail "a node did not exit cleanly"
}

# Writes COUNT copies of the little-endian float32 whose bytes are given as
# printf escapes, e.g. '\x00\x00\x80\x3f' for 1.0.
write_floats() {
    local bytes="$1" count="$2" out="$3" k
    for ((k = 0; k < count; k++)); do printf '%b' "$bytes"; done > "$out"
}

# Every node averages a 4 KiB tensor (node i holds the value i everywhere)
# in one group through the swarm; each must end with the mean, 2.5.
average_demo() {
    local i pids=() f rc=0
    local -a values=('\x00\x00\x80\x3f' '\x00\x00\x00\x40' '\x00\x00\x40\x40' '\x00\x00\x80\x40')
    say "averaging: node i holds a tensor of 1024 values equal to i; all $NODES average it"
    for ((i = 1; i <= NODES; i++)); do
        f="$DEMO_DIR/n$i/params"
        write_floats "${values[i - 1]}" 1024 "$f.in"
        "$HIVEMINDCTL" -s "$DEMO_DIR/n$i/control.sock" average quickstart/params \
            --in "$f.in" --out "$f.out" --target-group-size "$NODES" --min-group-size 2 \
            --matchmaking-time 3 --timeout 20 --round-timeout 20 > "$f.report" 2>&1 &
        pids+=($!)
    done
    for ((i = 1; i <= NODES; i++)); do
        wait "${pids[i - 1]}" || rc=1
    done
    echo "node 1's report:"
    cat "$DEMO_DIR/n1/params.report"
    [ "$rc" -eq 0 ] || { cat "$DEMO_DIR"/n*/params.report; fail "an averaging round failed"; }
    for ((i = 1; i <= NODES; i++)); do
        f="$DEMO_DIR/n$i/params.out"
        od -An -tf4 -v "$f" | tr -s ' ' '\n' | grep -v '^$' | sort -u | grep -qx '2.5' \
            || fail "node $i did not end with the mean 2.5"
        [ "$(od -An -tf4 -v "$f" | tr -s ' ' '\n' | grep -v '^$' | sort -u | wc -l)" -eq 1 ] \
            || fail "node $i holds values other than the mean"
    done
    echo "every node now holds 2.5, the mean of 1, 2, 3 and 4"
    say "node 1: hivemindctl averaging"
    ctl 1 averaging || fail "hivemindctl averaging failed on node 1"
}

demo() {
    local short="$1" i j peers t0 n
    HIVEMINDD="$BUILD/src/hivemindd"
    HIVEMINDCTL="$BUILD/src/hivemindctl"
    if [ ! -x "$HIVEMINDD" ] || [ ! -x "$HIVEMINDCTL" ]; then
        die "hivemindd and hivemindctl were not built"
    fi

    DEMO_DIR="$(mktemp -d "${TMPDIR:-/tmp}/hivemindd-demo.XXXXXX")"
    trap cleanup EXIT
    trap 'exit 130' INT TERM

    say "starting $NODES nodes on 127.0.0.1 (swarm 'quickstart', ping every ${PING_INTERVAL}s)"
    # Node 1 is the bootstrap node and the only address the others are
    # given: they find each other through the DHT, and a node adds every
    # peer it hears from to its peer table.
    peers=""
    for ((i = 1; i <= NODES; i++)); do
        start_node "$i" "$peers"
        peers="${ADDRS[1]}"
    done

    say "waiting until every node sees the other $((NODES - 1))"
    wait_mesh 30 || fail "the nodes did not find each other within 30 s"
    echo "all $NODES nodes see each other"
    # One ping round measures RTTs and opens the stream connections.
    sleep $((PING_INTERVAL + 1))

    for ((i = 1; i <= NODES; i++)); do
        say "node $i: hivemindctl info"
        ctl "$i" info || fail "hivemindctl info failed on node $i"
        say "node $i: hivemindctl peers"
        ctl "$i" peers || fail "hivemindctl peers failed on node $i"
    done
    say "node 1: hivemindctl metrics (excerpt)"
    show_metrics 1

    say "DHT: node 2 stores a record, node $NODES reads it"
    ctl 2 dht put quickstart/greeting "hello from node 2" --ttl 600 \
        || fail "hivemindctl dht put failed on node 2"
    ctl "$NODES" dht get quickstart/greeting || fail "node $NODES could not read the record"
    ctl "$NODES" dht get quickstart/greeting | grep -q "hello from node 2" \
        || fail "node $NODES read a different value"
    say "node $NODES: hivemindctl dht info"
    ctl "$NODES" dht info || fail "hivemindctl dht info failed on node $NODES"

    average_demo

    if [ "$short" -eq 0 ]; then
        say "watching node 1's peer table for 30 s (RTTs come from datagram pings)"
        for ((j = 1; j <= 6; j++)); do
            sleep 5
            printf -- '--- after %d s ---\n' $((j * 5))
            ctl 1 peers || fail "hivemindctl peers failed on node 1"
        done

        say "freezing node $NODES with SIGSTOP: the others drop it after missed pings"
        kill -STOP "${PIDS[NODES]}"
        t0=$SECONDS
        while :; do
            n=0
            for ((i = 1; i < NODES; i++)); do
                n=$((n + $(count_seen "$i" "$NODES")))
            done
            [ "$n" -ne 0 ] || break
            [ $((SECONDS - t0)) -lt 90 ] || fail "node $NODES was still listed after 90 s"
            sleep 1
        done
        echo "nodes 1-$((NODES - 1)) dropped node $NODES after $((SECONDS - t0)) s"
        ctl 1 peers || fail "hivemindctl peers failed on node 1"

        say "thawing node $NODES with SIGCONT: its pings bring it back"
        kill -CONT "${PIDS[NODES]}"
        wait_mesh 60 || fail "node $NODES did not rejoin within 60 s"
        echo "node $NODES is back in every peer table"
        ctl 1 peers || fail "hivemindctl peers failed on node 1"
        say "node 1: hivemindctl metrics (excerpt)"
        show_metrics 1

        say "stopping node $NODES with hivemindctl shutdown"
        ctl "$NODES" shutdown || fail "hivemindctl shutdown failed on node $NODES"
        reap_node "$NODES" || fail "node $NODES did not exit cleanly after hivemindctl shutdown"
    fi

    stop_all
    say "demo finished: all nodes exited with status 0"
}

# ---- main -----------------------------------------------------------------

main() {
    local cmd="${1:-}" short=0
    case "$cmd" in
    demo)
        shift
        case "${1:-}" in
        "") ;;
        --short) short=1 ;;
        *) usage >&2; exit 64 ;;
        esac
        check_packages
        build
        demo "$short"
        ;;
    test)
        [ $# -eq 1 ] || { usage >&2; exit 64; }
        check_packages
        build
        run_tests
        ;;
    -h | --help)
        usage
        ;;
    *)
        usage >&2
        exit 64
        ;;
    esac
}

main "$@"

#!/bin/bash
# netlab_relay_test.sh: circuit relays across real network namespaces
# (tests/netlab/lab.sh, src/net/relay.h). Four hosts on one bridge:
#  - h1 (bootstrap) and h4 serve as relays (Relay yes);
#  - h2 sits behind a masquerading NAT, hosts expert ffn.0.0 and names
#    h1, then h4 in RelayVia; its dial-backs fail, so it reserves with h1
#    and declares its expert at h1's address;
#  - h3, a trainer (to which h2 may not open TCP itself, so that nothing
#    but a relay carries the call), calls the expert through h1: the output equals the one
#    h2 computes for itself on the same input, byte for byte, and tcpdump
#    on h1's interface finds no plaintext of the input's distinctive bytes
#    nor of the output (while a plaintext datagram with the same bytes,
#    the control, is found);
#  - h2 shares a 4 MiB state; h3 loads it, through h1 (h1 relays at least
#    its size), byte for byte the same;
#  - h1 dies: h2 moves to h4, declares its expert there, and h3 calls it
#    through h4, within 20 s of the kill (the figures are printed); h4 goes
#    silent too (SIGSTOP): h2 says it has no relay, in info and its log,
#    within 20 s.
# Skips (77) where the lab cannot run (not root, no namespaces, no nft,
# no tcpdump).
#
# Environment: HM_BUILDDIR (default: the current directory), HM_SRCDIR
# (default: this script's source tree).

set -eu

srcdir=${HM_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
export HM_BUILDDIR=${HM_BUILDDIR:-$PWD}
if [ ! -r "$srcdir/tests/netlab/lab.sh" ]; then
    echo "SKIP: tests/netlab/lab.sh is not in this tree"
    exit 77
fi
# shellcheck source=tests/netlab/lab.sh
. "$srcdir/tests/netlab/lab.sh"
lab_require nft
if ! command -v tcpdump >/dev/null 2>&1; then
    echo "SKIP: tcpdump is not installed"
    exit 77
fi
PY=/usr/bin/python3

fail() {
    echo "FAIL: $*" >&2
    for h in h1 h2 h3 h4; do
        if [ -e "$LAB_DIR/$h.log" ]; then
            echo "---- $h.log (last 30 lines)" >&2
            tail -n 30 "$LAB_DIR/$h.log" >&2
        fi
    done
    exit 1
}

# A field of `hivemindctl --json info` (a.b for a nested one), as Python prints it.
info_field() {
    lab_ctl "$1" --json info 2>/dev/null |
        "$PY" -c 'import json,sys
v = json.load(sys.stdin)["result"]
for k in sys.argv[1].split("."):
    v = v.get(k) if isinstance(v, dict) else None
print(v)' "$2" || echo "?"
}

wait_field() {
    local h=$1 key=$2 want=$3 secs=$4 t v
    for t in $(seq 1 $((secs * 5))); do
        v=$(info_field "$h" "$key")
        [ "$v" = "$want" ] && return 0
        sleep 0.2
    done
    return 1
}

# Calls ffn.0.0 from h3 until it answers while declared at $1; output in $2.
call_via() {
    local want=$1 out=$2 t hosts
    for t in $(seq 1 90); do
        hosts=$(lab_ctl h3 --json experts list ffn 2>/dev/null |
            "$PY" -c 'import json,sys; print(" ".join(e["host"] for e in json.load(sys.stdin)["result"].get("swarm", [])))' ||
            true)
        if [ "$hosts" = "$want" ] &&
            lab_ctl h3 experts call ffn.0.0 --in "$x" --out "$out" --timeout 10 >/dev/null 2>&1; then
            return 0
        fi
        sleep 1
    done
    echo "the expert is declared at: ${hosts:-nothing}" >&2
    return 1
}

lab_up 4
lab_nat h2
# A NAT'd node dials out to the peers it pings, and a caller reuses such a
# connection: h2 is kept from opening TCP to h3, so that h3's calls must
# come in through a relay (DHT datagrams still flow both ways).
lab_exec h2 nft -f - <<EOF || fail "cannot firewall h2"
table inet hmrelaytest {
    chain out {
        type filter hook output priority 0; policy accept;
        ip daddr $(lab_addr h3) tcp dport 31400 drop
    }
}
EOF

common=(--ping-interval 1 --log-level debug)
lab_hivemindd h1 "${common[@]}" --relay || fail "h1 did not start"
h1=$(lab_peer h1)
lab_hivemindd h4 "${common[@]}" --relay --initial-peers "$h1" || fail "h4 did not start"
h4=$(lab_peer h4)
lab_hivemindd h3 "${common[@]}" --initial-peers "$h1,$h4" || fail "h3 did not start"
lab_hivemindd h2 "${common[@]}" --initial-peers "$h1,$h4" --relay-via "$h1,$h4" \
    --host-experts ffn.0.0 --expert-dim 8 || fail "h2 did not start"
h2id=$(info_field h2 peer_id)

# ---- h2 finds nobody reaches it and reserves with the first relay ----
wait_field h2 relay.state reserved 120 ||
    fail "h2 has no relay: reachable $(info_field h2 reachable), $(info_field h2 relay.reason)"
want1="$h2id@$(lab_addr h1):31400"
[ "$(info_field h2 relay.address)" = "$want1" ] ||
    fail "h2's relayed address is $(info_field h2 relay.address), not $want1"
[ "$(info_field h2 reachable)" = False ] || fail "h2 reports reachable $(info_field h2 reachable)"
grep -q "reachable through the relay" "$LAB_DIR/h2.log" || fail "h2's log does not name its relay"
echo "ok: h2 behind NAT reserved with h1: $want1"

# ---- a call through the relay equals h2's own computation, and h1 sees no plaintext ----
x="$LAB_DIR/x.f32"
# 64 samples of width 8, each 16-byte group the same ASCII (finite floats).
"$PY" -c 'import sys; open(sys.argv[1],"wb").write(b"TENSORPATTERN42!" * 128)' "$x"
pcap="$LAB_DIR/h1.pcap"
lab_spawn h1 tcpdump tcpdump -i eth0 -U -s 0 -w "$pcap"
for t in $(seq 1 50); do
    [ -s "$pcap" ] && break
    sleep 0.1
done
sleep 1
call_via "$want1" "$LAB_DIR/y_relayed.f32" || fail "h3 could not call h2's expert through h1"
[ "$(stat -c %s "$LAB_DIR/y_relayed.f32")" = 2048 ] || fail "the relayed output is not 2048 bytes"
# The control: the same bytes in a plaintext datagram to h1 must show in the capture.
lab_exec h3 "$PY" -c 'import socket,sys; s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.sendto(b"CONTROL:" + b"TENSORPATTERN42!" * 4, (sys.argv[1], 9))' \
    "$(lab_addr h1)"
sleep 1
kill "$(cat "$LAB_DIR/tcpdump.pid")" 2>/dev/null || true
sleep 0.5
# h2 computes the same expert on the same input itself (a call to its own key never leaves it).
lab_ctl h2 experts call ffn.0.0 --in "$x" --out "$LAB_DIR/y_local.f32" --timeout 10 >/dev/null ||
    fail "h2 could not run its own expert"
cmp -s "$LAB_DIR/y_relayed.f32" "$LAB_DIR/y_local.f32" ||
    fail "the output through the relay differs from h2's own computation"
relayed=$(info_field h1 relay.bytes_relayed)
[ "$relayed" -gt 4096 ] 2>/dev/null || fail "h1 relayed only $relayed bytes"
"$PY" - "$pcap" "$LAB_DIR/y_relayed.f32" <<'PY' || fail "plaintext in h1's capture"
import sys
cap = open(sys.argv[1], "rb").read()
y = open(sys.argv[2], "rb").read()
c = cap.count(b"CONTROL:TENSORPATTERN42!")
assert c >= 1, "the control datagram is not in the capture"
# Each copy of the control (the datagram, and the ICMP error quoting it) holds the pattern 4 times.
n = cap.count(b"TENSORPATTERN42!")
assert n == 4 * c, "the input pattern shows %d times, %d of them the control's" % (n, 4 * c)
for off in range(0, len(y) - 16, 256):
    assert y[off:off + 16] not in cap, "output bytes at %d are in the capture" % off
print("capture: %d bytes, no plaintext of the input or the output" % len(cap))
PY
echo "ok: h3 called ffn.0.0 through h1 ($relayed bytes relayed); output equals h2's own; h1 saw only ciphertext"
# Every relay budget reports what it refused, and the relay its work.
metrics=$(lab_ctl h1 metrics)
for k in RelayMaxReservations RelayReservationsPerOrigin RelayMaxCircuits RelayCircuitsPerOrigin \
    RelayMaxMiB RelayRate RelayCircuitLifetime; do
    grep -q "hivemindd_limit_refused_total{limit=\"$k\"}" <<<"$metrics" ||
        fail "h1's metrics have no refusal counter for $k"
done
grep -q "^hivemindd_relay_reservations 1$" <<<"$metrics" || fail "h1's metrics do not count h2's reservation"

# ---- state served through the relay: h2 shares, h3 (a newcomer to it) loads ----
st="$LAB_DIR/state.f32"
"$PY" -c 'import numpy as np, sys
np.random.default_rng(7).standard_normal(1 << 20, dtype=np.float32).tofile(sys.argv[1])' "$st"
before=$(info_field h1 relay.bytes_relayed)
lab_ctl h2 state share lab.state --step 7 --in "$st" >/dev/null || fail "h2 could not share its state"
for t in $(seq 1 100); do
    sinfo=$(lab_ctl h2 state info lab.state 2>/dev/null || true)
    grep -q "ready: yes" <<<"$sinfo" && ! grep -q "declared: 0 " <<<"$sinfo" && break
    sleep 0.2
done
grep -q "ready: yes" <<<"$sinfo" && ! grep -q "declared: 0 " <<<"$sinfo" ||
    fail "h2 did not declare its state: $sinfo"
loaded=$(lab_ctl h3 state load lab.state --out "$LAB_DIR/state_loaded.f32" --min-agree 1 \
    --timeout 60 2>&1) || fail "h3 could not load h2's state: $loaded"
grep -q "loaded 'lab.state' at step 7" <<<"$loaded" || fail "h3's load says: $loaded"
grep -q "$h2id" <<<"$loaded" || fail "h3 did not load from h2: $loaded"
cmp -s "$st" "$LAB_DIR/state_loaded.f32" || fail "the state h3 loaded differs from h2's"
after=$(info_field h1 relay.bytes_relayed)
[ $((after - before)) -ge $((4 << 20)) ] ||
    fail "h1 relayed only $((after - before)) bytes of the 4 MiB state"
echo "ok: h3 loaded h2's 4 MiB state through h1 ($((after - before)) bytes relayed), byte-identical"

# ---- h1 dies: h2 moves to h4 and is called there, within FAILOVER_MAX s ----
# (the connection to the relay closing starts the move at once: a dial's
# time to find h1 gone, one reservation at h4, one declaration round)
FAILOVER_MAX=20
ms_now() { date +%s%3N; }
t_kill=$(ms_now)
kill "$(cat "$LAB_DIR/h1.pid")"
want4="$h2id@$(lab_addr h4):31400"
wait_field h2 relay.address "$want4" 60 ||
    fail "h2 did not move to h4: $(info_field h2 relay.state), $(info_field h2 relay.reason)"
t_moved=$(ms_now)
call_via "$want4" "$LAB_DIR/y_relayed4.f32" || fail "h3 could not call h2's expert through h4"
t_called=$(ms_now)
cmp -s "$LAB_DIR/y_relayed4.f32" "$LAB_DIR/y_local.f32" ||
    fail "the output through h4 differs from h2's own computation"
moved_s=$(awk -v a="$t_kill" -v b="$t_moved" 'BEGIN { printf "%.1f", (b - a) / 1000 }')
called_s=$(awk -v a="$t_kill" -v b="$t_called" 'BEGIN { printf "%.1f", (b - a) / 1000 }')
echo "ok: h1 died; h2 failed over to h4 ($(info_field h2 relay.failovers) failovers) and h3 called it there"
echo "failover: reserved at h4 $moved_s s after h1's kill, h3's call through h4 answered at $called_s s"
[ $((t_called - t_kill)) -lt $((FAILOVER_MAX * 1000)) ] ||
    fail "failover took $called_s s end to end, over the ${FAILOVER_MAX} s bound"

# ---- h4 goes silent too (SIGSTOP: no reset, no close, its connections stay
# open): h2 notices at its next refresh, whose call times out, and says it
# has no relay ----
t_kill=$(ms_now)
kill -STOP "$(cat "$LAB_DIR/h4.pid")"
wait_field h2 relay.state none 60 || fail "h2 still reports $(info_field h2 relay.state)"
none_s=$(awk -v a="$t_kill" -v b="$(ms_now)" 'BEGIN { printf "%.1f", (b - a) / 1000 }')
kill -TERM "$(cat "$LAB_DIR/h4.pid")"
kill -CONT "$(cat "$LAB_DIR/h4.pid")"
echo "failover: with h4 silent too, h2 said it has no relay $none_s s after h4 stopped"
awk -v s="$none_s" -v m="$FAILOVER_MAX" 'BEGIN { exit !(s < m) }' ||
    fail "h2 took $none_s s to say it has no relay, over the ${FAILOVER_MAX} s bound"
reason=$(info_field h2 relay.reason)
case $reason in
    "no relay: all 2 RelayVia relays failed"*) ;;
    *) fail "h2 does not say it has no relay: $reason" ;;
esac
grep -q "no relay: all 2 RelayVia relays failed" "$LAB_DIR/h2.log" || fail "h2's log does not say it has no relay"
echo "ok: with both relays dead h2 says: $reason"
# The relays exited on SIGTERM; under sanitizers their logs hold any report.
for h in h1 h4; do
    for t in $(seq 1 50); do
        kill -0 "$(cat "$LAB_DIR/$h.pid")" 2>/dev/null || break
        sleep 0.2
    done
    if grep -q "AddressSanitizer\|LeakSanitizer\|runtime error" "$LAB_DIR/$h.log"; then
        fail "a sanitizer report in $h's log"
    fi
done
echo "PASS: netlab_relay_test"

#!/bin/bash
# netlab_announce_test.sh: the declared address across real network
# namespaces (tests/netlab/lab.sh). Four hosts on one bridge, h4 behind a
# masquerading NAT:
#  - h2 listens on 0.0.0.0; the others observe it at 10.77.1.2:31400, one
#    dials it back, and it declares that (never 0.0.0.0): its expert record
#    carries it and a trainer on h3 calls the expert there;
#  - h4 can dial everyone and nobody can dial it: its dial-backs fail from
#    two origins, it declares nothing, reports itself unreachable and
#    switches to client mode, in info and in its log;
#  - h5, told to announce 127.0.0.1, declares nothing once it knows peers
#    off loopback;
#  - h4 (NAT'd, a client), h2 (on 0.0.0.0) and h1 average a vector together
#    and all get the exact mean.
# Skips (77) where the lab cannot run (not root, no namespaces, no nft).
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

fail() {
    echo "FAIL: $*" >&2
    for h in h1 h2 h3 h4 h5; do
        if [ -e "$LAB_DIR/$h.log" ]; then
            echo "---- $h.log (last 30 lines)" >&2
            tail -n 30 "$LAB_DIR/$h.log" >&2
        fi
    done
    exit 1
}

# A field of `hivemindctl --json info` on a host, as Python prints it
# (strings bare, true/false/None).
info_field() {
    lab_ctl "$1" --json info 2>/dev/null |
        /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["result"].get(sys.argv[1]))' "$2" ||
        echo "?"
}

# Polls until the field is the wanted value, for at most $4 seconds.
wait_field() {
    local h=$1 key=$2 want=$3 secs=$4 t v
    for t in $(seq 1 $((secs * 5))); do
        v=$(info_field "$h" "$key")
        [ "$v" = "$want" ] && return 0
        sleep 0.2
    done
    return 1
}

lab_up 5
lab_nat h4

common=(--ping-interval 1 --log-level debug)
lab_hivemindd h1 "${common[@]}" || fail "h1 did not start"
h1=$(lab_peer h1)
lab_hivemindd h3 "${common[@]}" --initial-peers "$h1" || fail "h3 did not start"
h3=$(lab_peer h3)
lab_hivemindd h4 "${common[@]}" --initial-peers "$h1,$h3" || fail "h4 did not start"
lab_hivemindd h2 "${common[@]}" --listen 0.0.0.0:31400 --initial-peers "$h1,$h3" \
    --host-experts ffn.0.0 --expert-dim 8 || fail "h2 did not start"

lab_hivemindd h5 "${common[@]}" --announce 127.0.0.1:31400 --initial-peers "$h1" ||
    fail "h5 did not start"

# ---- h2, on 0.0.0.0, is declared where the others dial it ----
want="$(lab_addr h2):31400"
wait_field h2 reachable True 60 ||
    fail "h2 never confirmed its address: $(info_field h2 reach_reason)"
[ "$(info_field h2 announce)" = "$want" ] ||
    fail "h2 declares $(info_field h2 announce), not $want"
[ "$(info_field h2 announce_source)" = observed ] ||
    fail "h2's address came from $(info_field h2 announce_source), not from observation"
echo "ok: h2 on 0.0.0.0 declares $want ($(info_field h2 reach_reason))"

x="$LAB_DIR/x.f32"
y="$LAB_DIR/y.f32"
/usr/bin/python3 -c 'import struct,sys; open(sys.argv[1],"wb").write(struct.pack("<16f",*[i/16 for i in range(16)]))' "$x"
called=0
for t in $(seq 1 60); do
    hosts=$(lab_ctl h3 --json experts list ffn 2>/dev/null |
        /usr/bin/python3 -c 'import json,sys; print(" ".join(e["host"] for e in json.load(sys.stdin)["result"].get("swarm", [])))' ||
        true)
    case $hosts in
        *0.0.0.0*) fail "h3 sees ffn.0.0 declared at $hosts" ;;
    esac
    if [ -n "$hosts" ] && lab_ctl h3 experts call ffn.0.0 --in "$x" --out "$y" --timeout 10 >/dev/null 2>&1; then
        called=1
        break
    fi
    sleep 1
done
[ "$called" = 1 ] || fail "h3 could not call h2's expert (declared at: ${hosts:-nothing})"
case $hosts in
    *"@$want"*) ;;
    *) fail "h2's expert is declared at $hosts, not $want" ;;
esac
[ "$(stat -c %s "$y")" = 64 ] || fail "the expert's output is $(stat -c %s "$y") bytes, not 64"
echo "ok: h3 called ffn.0.0 on h2 at $want"

# ---- h4, behind NAT, finds out nobody reaches it ----
wait_field h4 client_mode True 90 ||
    fail "h4 is not in client mode: reachable $(info_field h4 reachable), $(info_field h4 reach_reason)"
[ "$(info_field h4 reachable)" = False ] || fail "h4 reports reachable $(info_field h4 reachable)"
[ "$(info_field h4 client_mode_auto)" = True ] || fail "h4's client mode was not its own doing"
[ "$(info_field h4 announce)" = None ] || fail "h4 still declares $(info_field h4 announce)"
reason=$(info_field h4 reach_reason)
case $reason in
    *dial-back*) ;;
    *) fail "h4's reason does not name the dial-back: $reason" ;;
esac
grep -q "client mode" "$LAB_DIR/h4.log" || fail "h4's log does not say it switched to client mode"
echo "ok: h4 behind NAT: unreachable, client mode ($reason)"

# ---- h5 never declares loopback to hosts off loopback ----
wait_field h5 announce None 30 || fail "h5 declares $(info_field h5 announce) to peers off loopback"
case $(info_field h5 reach_reason) in
    *loopback*) ;;
    *) fail "h5 does not say why it declares nothing: $(info_field h5 reach_reason)" ;;
esac
echo "ok: h5 declares nothing rather than 127.0.0.1 ($(info_field h5 reach_reason))"

# ---- the three average: the NAT'd client and the 0.0.0.0 host included ----
for h in h1 h2 h4; do
    v=$(case $h in h1) echo 1 ;; h2) echo 2 ;; h4) echo 6 ;; esac)
    /usr/bin/python3 -c 'import struct,sys; open(sys.argv[1],"wb").write(struct.pack("<4096f",*[float(sys.argv[2])]*4096))' \
        "$LAB_DIR/in.$h" "$v"
done
pids=()
for h in h1 h2 h4; do
    lab_ctl "$h" --json average lab.announce --in "$LAB_DIR/in.$h" --out "$LAB_DIR/out.$h" \
        --target-group-size 3 --min-group-size 3 --timeout 60 --matchmaking-time 5 \
        >"$LAB_DIR/avg.$h.json" 2>&1 &
    pids+=($!)
done
for i in 0 1 2; do
    wait "${pids[$i]}" || true
done
for h in h1 h2 h4; do
    /usr/bin/python3 - "$LAB_DIR/out.$h" <<'PY' || fail "$h's average: $(cat "$LAB_DIR/avg.$h.json")"
import struct, sys
b = open(sys.argv[1], "rb").read()
v = struct.unpack("<%df" % (len(b) // 4), b)
assert len(v) == 4096, len(v)
assert all(abs(x - 3.0) < 1e-5 for x in v), v[:4]
PY
done
echo "ok: h1, h2 (0.0.0.0) and h4 (NAT'd client) averaged to the exact mean 3"
echo "PASS: netlab_announce_test"

#!/usr/bin/env bash
# netlab_delay_test.sh: per-address one-way delays (TestDelay, a test-only
# option) across the network lab (tests/netlab/lab.sh). Three hosts with
# different round trips between each pair, set with lab_rtt:
#   h1-h2 20 ms, h1-h3 200 ms, h2-h3 100 ms.
# Every daemon's peer table (`hivemindctl peers`, datagram ping round
# trips, 1 s apart) must show each pair's own round trip: at least the
# configured one (the delays are held before sending, so nothing is
# faster) and not far above it (a loaded machine adds a little).
# Skips (exit 77) unless root with network namespaces, and /usr/bin/python3.
if [ -z "${BASH_VERSION:-}" ]; then
    exec bash "$0" "$@"
fi
set -euo pipefail

srcdir=${HM_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
HM_BUILDDIR=${HM_BUILDDIR:-$PWD}
export HM_BUILDDIR
PY=/usr/bin/python3

. "$srcdir/tests/netlab/lab.sh"
lab_require
if ! [ -x "$PY" ]; then
    echo "SKIP: $PY not found (it reads the JSON replies)"
    exit 77
fi
for f in "$HM_BUILDDIR/src/hivemindd" "$HM_BUILDDIR/src/hivemindctl"; do
    [ -x "$f" ] || { echo "ERROR: $f is not built" >&2; exit 99; }
done

fail() {
    echo "FAIL: $*" >&2
    for h in h1 h2 h3; do
        echo "---- log of $h (last 20 lines)" >&2
        tail -n 20 "$LAB_DIR/$h.log" >&2 2>/dev/null || true
    done
    exit 1
}

lab_up 3
lab_rtt h1 h2 20
lab_rtt h1 h3 200
lab_rtt h2 h3 100
lab_hivemindd h1 --ping-interval 1 || fail "h1 did not start"
boot=$(lab_peer h1)
lab_hivemindd h2 --ping-interval 1 --initial-peers "$boot" || fail "h2 did not start"
lab_hivemindd h3 --ping-interval 1 --initial-peers "$boot" || fail "h3 did not start"
grep -q "TestDelay 10.77.1.2=10,10.77.1.3=100" "$LAB_DIR/h1.log" ||
    fail "h1 does not log its test delays"

# host peer-host expected-rtt: the peer's smoothed round trip as h sees it,
# once the daemons have pinged each other for 6 s.
started=$SECONDS
want() {
    local h=$1 p=$2 ms=$3 t got=
    for t in $(seq 1 40); do
        got=$(lab_ctl "$h" --json peers | "$PY" -c 'import json, sys
for p in json.load(sys.stdin)["result"]["peers"]:
    if p["address"] and p["address"].startswith(sys.argv[1] + ":") and p["rtt_ms"] is not None:
        print(p["rtt_ms"])' "$(lab_addr "$p")")
        [ -n "$got" ] && [ $((SECONDS - started)) -ge 6 ] && break
        sleep 1
    done
    [ -n "$got" ] || fail "$h has no round trip to $p"
    "$PY" -c 'import sys
got, ms = float(sys.argv[1]), float(sys.argv[2])
# At least the configured round trip (less 0.5 ms: clock reads); at most
# 1.3 times it plus 25 ms: the machine is shared.
sys.exit(0 if ms - 0.5 <= got <= 1.3 * ms + 25 else 1)' "$got" "$ms" ||
        fail "$h sees $p at $got ms, not about $ms ms"
    echo "ok: $h -> $p: $got ms (configured $ms ms)"
}
want h1 h2 20
want h2 h1 20
want h1 h3 200
want h3 h1 200
want h2 h3 100
want h3 h2 100
echo "PASS: netlab_delay_test"

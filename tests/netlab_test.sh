#!/usr/bin/env bash
# netlab_test.sh: hivemindd across a network of namespaces (tests/netlab/
# lab.sh): four hosts on a bridge, each daemon on its own 10.77.1.x address
# and holding what it sends for 25 ms (TestDelayMs), so every round trip
# takes 50 ms or more.
#   1. The hosts join through one bootstrap host (h1) only, and every
#      daemon's peer table ends up holding the three others.
#   2. With the switch dropping 5% of every host's frames, the four average
#      a vector through `hivemindctl average` in one group of four, and
#      every output equals, bit for bit, the mean this script computes
#      (the inputs are integers, so the float32 mean is exact in any order).
#   3. Under the same loss and delay, 200 DHT records are put through one
#      host and read back through another: at least 99% of the gets return
#      the value that was put.
# Skips (exit 77) unless root with network namespaces, tc and nft, and
# /usr/bin/python3 (it writes the vectors and checks the replies).
# make check runs it with /bin/sh: it is a bash script (lab.sh is bash).
if [ -z "${BASH_VERSION:-}" ]; then
    exec bash "$0" "$@"
fi
set -euo pipefail

srcdir=${HM_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
HM_BUILDDIR=${HM_BUILDDIR:-$PWD}
export HM_BUILDDIR
PY=/usr/bin/python3

. "$srcdir/tests/netlab/lab.sh"
lab_require tc nft
if ! [ -x "$PY" ]; then
    echo "SKIP: $PY not found (it writes the test vectors and reads the JSON replies)"
    exit 77
fi
for f in "$HM_BUILDDIR/src/hivemindd" "$HM_BUILDDIR/src/hivemindctl"; do
    [ -x "$f" ] || { echo "ERROR: $f is not built" >&2; exit 99; }
done

N=4
START=$SECONDS
fail() {
    echo "FAIL: $*" >&2
    LAB_KEEP=1
    exit 1
}
step() { echo "== $* (+$((SECONDS - START)) s)"; }

lab_up $N
# A failed run keeps the daemons' logs for the test's log.
lab_cleanup_hook() {
    if [ "${LAB_KEEP:-0}" = 1 ]; then
        for h in $(seq 1 $N); do
            echo "---- log of h$h ----"
            tail -n 40 "$LAB_DIR/h$h.log" 2>/dev/null || true
        done
    fi
}

# ---- 1. discovery through one bootstrap host
step "four hosts join through h1"
lab_hivemindd h1 --test-delay-ms 25 --ping-interval 2
BOOT=$(lab_peer h1)
[ -n "$BOOT" ] || fail "no address from h1's info"
case $BOOT in
    *@10.77.1.1:31400) ;;
    *) fail "h1 declares $BOOT, not its lab address 10.77.1.1:31400" ;;
esac
for i in $(seq 2 $N); do
    lab_hivemindd "h$i" --test-delay-ms 25 --ping-interval 2 --initial-peers "$BOOT"
done

# The peer addresses a daemon's table holds, one a line.
peer_addrs() {
    lab_ctl "$1" --json peers |
        "$PY" -c 'import json,sys; [print(p["address"]) for p in json.load(sys.stdin)["result"]["peers"]]'
}
ok=0
for t in $(seq 1 120); do
    ok=1
    for i in $(seq 1 $N); do
        addrs=$(peer_addrs "h$i" || true)
        for j in $(seq 1 $N); do
            [ "$i" = "$j" ] && continue
            grep -qx "10.77.1.$j:31400" <<<"$addrs" || ok=0
        done
    done
    [ "$ok" = 1 ] && break
    sleep 0.5
done
if [ "$ok" != 1 ]; then
    for i in $(seq 1 $N); do echo "h$i knows:"; peer_addrs "h$i" || true; done
    fail "the hosts did not all find each other through h1 within 60 s"
fi
echo "every host knows the other $((N - 1)) after $((SECONDS - START)) s"

# ---- 2. exact averaging under 5% loss
for i in $(seq 1 $N); do
    lab_loss "h$i" 5
done
step "averaging 1 MiB across $N hosts under 5% loss"
"$PY" - "$LAB_DIR" $N <<'EOF'
import random, struct, sys
d, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(14)
elems = 1 << 18
vecs = [[rng.randint(-1000, 1000) for _ in range(elems)] for _ in range(n)]
for i, v in enumerate(vecs):
    with open(f"{d}/in{i + 1}.f32", "wb") as f:
        f.write(struct.pack(f"<{elems}f", *v))
# Integers, so the float32 mean is exact whatever the order of the sums.
mean = [sum(c) / n for c in zip(*vecs)]
with open(f"{d}/mean.f32", "wb") as f:
    f.write(struct.pack(f"<{elems}f", *mean))
EOF
for i in $(seq 1 $N); do
    lab_ctl "h$i" --json --timeout 60 average netlab.exact --in "$LAB_DIR/in$i.f32" \
        --out "$LAB_DIR/out$i.f32" --target-group-size $N --min-group-size $N \
        --matchmaking-time 10 --round-timeout 60 >"$LAB_DIR/avg$i.json" 2>&1 &
    echo $! >"$LAB_DIR/avg$i.pid"
done
for i in $(seq 1 $N); do
    wait "$(cat "$LAB_DIR/avg$i.pid")" || fail "h$i: average failed: $(cat "$LAB_DIR/avg$i.json")"
done
for i in $(seq 1 $N); do
    "$PY" - "$LAB_DIR" "$i" $N <<'EOF' || fail "h$i: the average is not the exact mean"
import json, sys
d, i, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = json.load(open(f"{d}/avg{i}.json"))["result"]
if r["group_size"] != n:
    sys.exit(f"group of {r['group_size']}, not {n}")
for s in r["spans"]:
    if s["count"] and (sorted(s["contributors"]) != list(range(n)) or s["partial"]):
        sys.exit(f"span at {s['offset']} averaged over {s['contributors']}, partial {s['partial']}")
got = open(f"{d}/out{i}.f32", "rb").read()
want = open(f"{d}/mean.f32", "rb").read()
if got != want:
    sys.exit(f"output of {len(got)} bytes differs from the mean ({len(want)} bytes)")
print(f"h{i}: exact mean of {n}, all-reduce {r['allreduce_s']:.2f} s")
EOF
done

# ---- 3. the DHT under 5% loss and 50 ms round trips
KEYS=200
WORKERS=8
step "$KEYS DHT puts and gets under 5% loss and 50 ms round trips"
# Worker w handles keys w, w+WORKERS, ...: put through one host, get
# through the next, so every get crosses the lab.
dht_worker() {
    local w=$1 k put get v
    for k in $(seq "$w" $WORKERS $((KEYS - 1))); do
        put=h$((k % N + 1))
        get=h$(((k + 1) % N + 1))
        lab_ctl "$put" --timeout 30 dht put "netlab.key.$k" "value-$k-$$" >/dev/null 2>&1 ||
            echo "put $k failed"
    done
    for k in $(seq "$w" $WORKERS $((KEYS - 1))); do
        get=h$(((k + 1) % N + 1))
        v=$(lab_ctl "$get" --json --timeout 30 dht get "netlab.key.$k" 2>/dev/null || true)
        if grep -q "\"value\":\"value-$k-$$\"" <<<"$v"; then
            echo "get $k ok"
        else
            echo "get $k failed: $v"
        fi
    done
}
for w in $(seq 0 $((WORKERS - 1))); do
    dht_worker "$w" >"$LAB_DIR/dht$w.txt" &
    echo $! >"$LAB_DIR/dht$w.pid"
done
for w in $(seq 0 $((WORKERS - 1))); do
    wait "$(cat "$LAB_DIR/dht$w.pid")"
done
cat "$LAB_DIR"/dht*.txt >"$LAB_DIR/dht.txt"
puts_failed=$(grep -c '^put .* failed' "$LAB_DIR/dht.txt" || true)
gets_ok=$(grep -c '^get .* ok' "$LAB_DIR/dht.txt" || true)
echo "DHT: $gets_ok of $KEYS gets returned the value ($puts_failed puts failed)"
grep 'failed' "$LAB_DIR/dht.txt" | head -n 5 || true
[ "$gets_ok" -ge $((KEYS * 99 / 100)) ] || fail "only $gets_ok of $KEYS gets succeeded (need 99%)"

step "done"
exit 0

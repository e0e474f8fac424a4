#!/usr/bin/env bash
# netlab_test.sh: hivemindd across a network of namespaces (tests/netlab/
# lab.sh): four hosts on a bridge, each daemon on its own 10.77.1.x address
# and holding what it sends for 25 ms (TestDelayMs), so every round trip
# takes 50 ms or more.
#   0. The lab itself, on a fifth host behind NAT: it can connect out (and
#      is seen at its router's address), nobody can connect to it or to its
#      router, and its egress cap holds.
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

lab_up $((N + 1))
# A failed run keeps the daemons' logs for the test's log.
lab_cleanup_hook() {
    if [ "${LAB_KEEP:-0}" = 1 ]; then
        echo "---- the lab's own checks ----"
        cat "$LAB_DIR"/srv*.log 2>/dev/null || true
        for h in $(seq 1 $N); do
            echo "---- log of h$h ----"
            tail -n 40 "$LAB_DIR/h$h.log" 2>/dev/null || true
        done
    fi
}

# ---- 0. the lab: NAT and an egress cap, on h5 (no daemon)
NAT=h$((N + 1))
ROUTER=10.77.1.$((100 + N + 1))
step "the lab: $NAT behind NAT, capped at 20 Mbit/s"
lab_nat $NAT
lab_cap $NAT 20mbit
# serve.py ADDR: one TCP connection on ADDR:5000, what it received.
cat >"$LAB_DIR/serve.py" <<'PY'
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5000))
s.listen(4)
s.settimeout(30)
c, peer = s.accept()
n, t0 = 0, time.time()
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b)
print(f"from {peer[0]}: {n} bytes, {n * 8 / (time.time() - t0) / 1e6:.1f} Mbit/s", flush=True)
PY
# send.py ADDR: sends to ADDR:5000 for 2 s; fails when it cannot connect.
cat >"$LAB_DIR/send.py" <<'PY'
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5000), timeout=3)
buf, t = b"x" * 65536, time.time()
while time.time() - t < 2:
    c.sendall(buf)
c.close()
PY
lab_spawn h1 srv1 "$PY" "$LAB_DIR/serve.py" 10.77.1.1
lab_spawn $NAT srvnat "$PY" "$LAB_DIR/serve.py" "$(lab_addr $NAT)"
sleep 0.5
lab_exec $NAT "$PY" "$LAB_DIR/send.py" 10.77.1.1 || fail "the NAT'd host cannot connect out to h1"
for t in $(seq 1 40); do
    grep -q bytes "$LAB_DIR/srv1.log" 2>/dev/null && break
    sleep 0.25
done
echo "h1 got $(cat "$LAB_DIR/srv1.log")"
grep -q "^from $ROUTER:" "$LAB_DIR/srv1.log" ||
    fail "h1 did not see the NAT'd host's traffic from its router's address $ROUTER"
# 20 Mbit/s, less what TCP's headers and a loaded machine take off it.
"$PY" -c 'import re, sys
r = float(re.search(r"([0-9.]+) Mbit/s", open(sys.argv[1]).read()).group(1))
sys.exit(0 if 12 <= r <= 21 else f"{r} Mbit/s through a 20 Mbit/s cap")' "$LAB_DIR/srv1.log" ||
    fail "the egress cap does not hold"
for dst in "$(lab_addr $NAT)" "$ROUTER"; do
    if lab_exec h1 "$PY" "$LAB_DIR/send.py" "$dst" 2>/dev/null; then
        fail "h1 connected to $dst, behind NAT"
    fi
done
if grep -q bytes "$LAB_DIR/srvnat.log" 2>/dev/null; then
    fail "the NAT'd host accepted a connection"
fi
echo "the NAT'd host dials out and cannot be dialled"

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

#!/usr/bin/env bash
# netlab_train.sh: Fashion-MNIST across the network lab (tests/netlab/lab.sh):
# N hosts in network namespaces, each with a tc tbf egress cap of RATE and a
# hivemindd that holds what it sends for DELAY ms (TestDelayMs: RATE and
# 2 x DELAY round trips), one trainer per host (bench/fmnist_modes.py: the
# same 784-128-10 MLP, AdamW, batch 64, its own shard) attached to its
# host's daemon, trained for SECONDS in each mode:
#
#   periodic      parameters averaged in the background every 50 steps
#   collab        the collaborative optimizer (hivemindd.Optimizer)
#   diloco        DiLoCo, pseudo-gradients on the wire as float32
#   diloco-8bit   DiLoCo, 8-bit pseudo-gradients
#
# and, for reference, one process alone (solo, no network). Prints trainer
# 0's test accuracy at each mark, its steps and its rounds (done / failed).
#
#   bench/netlab_train.sh [BUILDDIR]      (as root)
#
# Environment: HOSTS (default 2), RATE (default 100mbit), DELAY (one-way ms,
# default 25), TRAIN_SECONDS (default 60), MODES (default "solo periodic collab
# diloco diloco-8bit"). The trainers run outside the lab and reach their
# daemons through the control sockets and shared memory, as trainers on
# those hosts would; only daemon-to-daemon traffic crosses the lab's links.
set -euo pipefail

SRCDIR=$(cd "$(dirname "$0")/.." && pwd)
HM_BUILDDIR=$(cd "${1:-$SRCDIR/build}" && pwd)
export HM_BUILDDIR
HOSTS=${HOSTS:-2}
RATE=${RATE:-100mbit}
DELAY=${DELAY:-25}
SECONDS_=${TRAIN_SECONDS:-60}
MODES=${MODES:-"solo periodic collab diloco diloco-8bit"}
PY=/usr/bin/python3
TRAIN="$SRCDIR/bench/fmnist_modes.py"
export HIVEMIND_LIB="$HM_BUILDDIR/lib/.libs/libhivemind.so" PYTHONPATH="$SRCDIR/contrib/python"
export OPENBLAS_NUM_THREADS=1

. "$SRCDIR/tests/netlab/lab.sh"
lab_require tc
OUT=$(mktemp -d "${TMPDIR:-/tmp}/netlab_train.XXXXXX")

echo "Fashion-MNIST across the network lab: $HOSTS hosts, $RATE egress each," \
    "$((2 * DELAY)) ms round trips, $SECONDS_ s per mode; logs in $OUT"
echo "machine: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for mode in $MODES; do
    case $mode in
    solo)
        "$PY" "$TRAIN" --mode solo --time-limit "$SECONDS_" > "$OUT/solo.t0.log"
        continue ;;
    periodic) flags=(--mode periodic) ;;
    collab) flags=(--mode collab) ;;
    diloco) flags=(--mode diloco --compression none) ;;
    diloco-8bit) flags=(--mode diloco --compression 8bit) ;;
    *) echo "$0: unknown mode $mode" >&2; exit 64 ;;
    esac
    lab_up "$HOSTS"
    for i in $(seq 1 "$HOSTS"); do
        lab_cap "h$i" "$RATE"
    done
    lab_hivemindd h1 --test-delay-ms "$DELAY"
    boot=$(lab_peer h1)
    for i in $(seq 2 "$HOSTS"); do
        lab_hivemindd "h$i" --test-delay-ms "$DELAY" --initial-peers "$boot"
    done
    sleep 3 # the routing tables fill
    pids=()
    for i in $(seq 1 "$HOSTS"); do
        "$PY" "$TRAIN" --socket "$LAB_DIR/h$i/control.sock" --shard "$((i - 1))/$HOSTS" \
            --peers "$HOSTS" --run-id "lab.$mode" --time-limit "$SECONDS_" "${flags[@]}" \
            > "$OUT/$mode.t$((i - 1)).log" 2> "$OUT/$mode.t$((i - 1)).err" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || echo "$mode: a trainer failed (see $OUT)" >&2; done
    lab_down
done

"$PY" - "$OUT" "$SECONDS_" "$HOSTS" $MODES <<'PY'
import re, sys
out, secs, n, modes = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4:]
marks = [m for m in (10, 20, 30, 45, 60, 90, 120, 180, 300) if m <= secs]
names = {"solo": "1 process (no network)", "periodic": "periodic averaging x%s" % n,
         "collab": "collaborative optimizer x%s" % n, "diloco": "DiLoCo x%s" % n,
         "diloco-8bit": "DiLoCo, 8-bit x%s" % n}
def curve(path):
    pts, done = [], "-"
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return pts, done
    for line in lines:
        m = re.match(r"t ([0-9.]+) step (\d+) acc ([0-9.]+)", line)
        if m:
            pts.append((float(m.group(1)), int(m.group(2)), float(m.group(3))))
        m = re.match(r"done steps \d+ rounds (\d+) failed (\d+)", line)
        if m:
            done = "%s / %s" % m.groups()
    return pts, done
def at(pts, t):
    best = None
    for p in pts:
        if p[0] <= t + 0.5:
            best = p
    return "%.3f" % best[2] if best else "-"
print()
print("| run (trainer 0) | " + " | ".join("%d s" % m for m in marks) + " | steps | rounds / failed |")
print("| --- |" + " --- |" * (len(marks) + 2))
for mode in modes:
    pts, done = curve("%s/%s.t0.log" % (out, mode))
    print("| %s | %s | %d | %s |" % (names[mode], " | ".join(at(pts, m) for m in marks),
                                     pts[-1][1] if pts else 0, done if mode != "solo" else "-"))
PY

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

echo
"$PY" "$SRCDIR/bench/fmnist_table.py" "$OUT" "$SECONDS_" "$HOSTS" $MODES

#!/usr/bin/env bash
# stalled_trainer.sh: the example trainer's step rate with one of two
# expert hosts SIGSTOPped, against its healthy rate in the same run.
#
#   HM_BUILDDIR=build bash bench/stalled_trainer.sh [HEALTHY_S] [STALLED_S] [trainer options...]
#
# A bootstrap hivemindd, two expert hosts splitting ffn.[0:4].[0:4] by
# columns (as contrib/quickstart.sh demo), and two trainers, each on its own
# hivemindd, with the demo's options (k_best 4, k_min 1, --timeout 3,
# --timeout-after-k-min 0.3, --find-every 100) and no averaging, so that
# only the expert calls set the pace. After HEALTHY_S seconds (default 40)
# host e2 (the experts ffn.*.2-3) is SIGSTOPped for STALLED_S seconds
# (default 60). Extra arguments go to both trainers (e.g. --routing batch,
# --switch).
#
# Printed per trainer: its step rate (steps over time) while healthy
# (from 5 s to the stop) and once the stop's first timeouts have passed
# (from 5 s to $WINDOW s, default 35, after the stop: the host's DHT
# declarations outlive it by up to a minute, and while they do, every
# lookup offers its experts again) and their ratio (target >= 0.8);
# the same for the median of the per-interval rates (train lines every 25
# steps), which hides a rare long interval; the steps it skipped and the
# longest interval while stopped. The daemon's back-off of the host shows as the trainers'
# silent= count. Only figures are printed; the exit status is 1 only when
# something could not be measured.
set -euo pipefail

# analyze DIR STOP_AT: the figures of a run kept with HM_KEEP=1.
analyze() {
    local dir="$1" stop_at="$2" n status=0
for n in t1 t2; do
    grep -q '^done ' "$dir/$n/out" || { echo "$n: no done line"; tail -5 "$dir/$n/err"; status=1; continue; }
    # The trainer's t counts from its first step, shortly after it started:
    # the stop's time in its clock is at most stop_at.
    awk -v stop="$stop_at" -v name="$n" -v win="${WINDOW:-35}" '
        function med(a, n,   i, j, t) {
            for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j > 0 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
            return n == 0 ? 0 : (n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2)
        }
        /^train / {
            for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
            t = v["t"] + 0; s = v["step"] + 0
            if (pt != "" && t > pt) {
                r = (s - ps) / (t - pt)
                if (t < stop - 1 && pt > 5) { h[++nh] = r; if (h0 == "") { h0 = pt; hs0 = ps } h1 = t; hs1 = s }
                else if (pt >= stop + 5 && t <= stop + win) { st[++ns] = r; if (t - pt > mx) mx = t - pt; if (s0 == "") { s0 = pt; ss0 = ps } s1 = t; ss1 = s }
            }
            pt = t; ps = s; failed = v["failed"]; sil = v["silent"] > sil ? v["silent"] : sil
        }
        END {
            mh = med(h, nh); ms = med(st, ns)
            rh = h1 > h0 ? (hs1 - hs0) / (h1 - h0) : 0; rs = s1 > s0 ? (ss1 - ss0) / (s1 - s0) : 0
            printf("%s: steps/s over the phase: healthy %.1f, stalled %.1f, ratio %.2f (target >= 0.8); median interval: healthy %.1f (%d), stalled %.1f (%d), ratio %.2f; skipped %s steps, longest stalled interval %.2f s, silent at most %d\n", name, rh, rs, rh > 0 ? rs / rh : 0, mh, nh, ms, ns, mh > 0 ? ms / mh : 0, failed, mx, sil)
        }' "$dir/$n/out"
done
return $status
}

if [ "${1:-}" = "--analyze" ]; then
    analyze "$2" "$3"
    exit $?
fi

HEALTHY=${1:-40}
STALLED=${2:-60}
shift 2 2>/dev/null || shift $#
BUILD="$(cd "${HM_BUILDDIR:-build}" && pwd)"
HIVEMINDD="$BUILD/src/hivemindd"
HIVEMINDCTL="$BUILD/src/hivemindctl"
TRAINER="${HM_TRAINER:-$BUILD/contrib/examples/trainer}"  # HM_TRAINER: another build's
DATA_DIR="${HM_DATA_DIR:-/usr/share/datasets/fashion-mnist}"
DIR="$(mktemp -d "${TMPDIR:-/tmp}/stalled.XXXXXX")"
export OPENBLAS_NUM_THREADS=1
declare -A PID=() ADDR=()
TPIDS=()

cleanup() {
    local p
    for p in "${TPIDS[@]}" "${PID[@]}"; do
        kill -CONT "$p" 2>/dev/null || true
        kill -TERM "$p" 2>/dev/null || true
    done
    sleep 1
    for p in "${TPIDS[@]}" "${PID[@]}"; do
        kill -KILL "$p" 2>/dev/null || true
    done
    [ -n "${HM_KEEP:-}" ] || rm -rf "$DIR"
}
trap cleanup EXIT

die() { echo "stalled_trainer: $*" >&2; exit 1; }

start_daemon() {
    local n="$1" line=""
    shift
    mkdir -m 0700 "$DIR/$n"
    "$HIVEMINDD" --listen 127.0.0.1:0 --state-dir "$DIR/$n" --control-socket "$DIR/$n/control.sock" \
        --swarm stalled --log-level info "$@" >"$DIR/$n/stdout" 2>"$DIR/$n/stderr" &
    PID[$n]=$!
    for _ in $(seq 100); do
        if [ "$( { wc -l <"$DIR/$n/stdout"; } 2>/dev/null || echo 0)" -ge 1 ]; then
            line="$(head -n 1 "$DIR/$n/stdout")"
            break
        fi
        sleep 0.1
    done
    [ -n "$line" ] || die "hivemindd $n printed no address"
    ADDR[$n]="$line"
    for _ in $(seq 50); do
        "$HIVEMINDCTL" -s "$DIR/$n/control.sock" info >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "hivemindd $n does not answer"
}

seen() {
    "$HIVEMINDCTL" -s "$DIR/$1/control.sock" --timeout 5 experts list ffn 2>/dev/null \
        | grep -cE '^ *ffn\.[0-9]+\.[0-9]+' || true
}

start_daemon boot
start_daemon e1 --initial-peers "${ADDR[boot]}" --host-experts 'ffn.[0:4].[0:2]' --expert-dim 64
start_daemon e2 --initial-peers "${ADDR[boot]}" --host-experts 'ffn.[0:4].[2:4]' --expert-dim 64
start_daemon t1 --initial-peers "${ADDR[boot]}"
start_daemon t2 --initial-peers "${ADDR[boot]}"
for _ in $(seq 60); do
    [ "$(seen t1)" -ge 16 ] && [ "$(seen t2)" -ge 16 ] && break
    sleep 1
done
[ "$(seen t1)" -ge 16 ] || die "the 16 experts were not declared within 60 s"

args=(--steps 0 --time-limit $((HEALTHY + STALLED + 5)) --dim 64 --experts 4x4 --k-best 4
      --k-min 1 --timeout 3 --timeout-after-k-min 0.3 --find-every 100 --average-every 0
      --eval-every 0 --print-every 25 "$@")
echo "trainer ${args[*]}"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for n in t1 t2; do
    "$TRAINER" --socket "$DIR/$n/control.sock" --data "$DATA_DIR" "${args[@]}" --seed "${n#t}" \
        >"$DIR/$n/out" 2>"$DIR/$n/err" &
    TPIDS+=($!)
done
start=$(date +%s.%N)
sleep "$HEALTHY"
kill -STOP "${PID[e2]}"
stop_at=$(awk -v s="$start" -v n="$(date +%s.%N)" 'BEGIN { printf "%.2f", n - s }')
echo "t=${stop_at} s: SIGSTOP e2 (experts ffn.*.2-3)"
sleep "$STALLED"
for p in "${TPIDS[@]}"; do
    wait "$p" || true
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"

analyze "$DIR" "$stop_at"

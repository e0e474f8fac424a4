#!/usr/bin/env bash
# netlab_allreduce.sh: hivemindd's all-reduce across the network lab
# (tests/netlab/lab.sh): N hosts in network namespaces on a bridge, each
# with a tc tbf egress cap of B, average M bytes of float32 through
# `hivemindctl average` in one group of N. Each case is timed by the
# slowest member's allreduce_s (matchmaking not included), the median over
# RUNS rounds, and set against the bandwidth floor of a butterfly
# all-reduce, 2(N-1)/N x M / B (with 8-bit compression, against its own
# floor, the same with M/4).
#
#   bench/netlab_allreduce.sh [BUILDDIR]      (as root)
#
# Environment: HOSTS (default "4 8"), SIZES (MiB, default "16 64"), RATES
# (tc rates, default "100mbit 1gbit"), COMPRESSION (default "none 8bit"),
# RUNS (default 3), SKIP (cases to leave out, "N:MiB:RATE:COMP" words, e.g.
# "8:64:100mbit:none").
set -euo pipefail

SRCDIR=$(cd "$(dirname "$0")/.." && pwd)
HM_BUILDDIR=$(cd "${1:-$SRCDIR/build}" && pwd)
export HM_BUILDDIR
HOSTS=${HOSTS:-"4 8"}
SIZES=${SIZES:-"16 64"}
RATES=${RATES:-"100mbit 1gbit"}
COMPRESSION=${COMPRESSION:-"none 8bit"}
RUNS=${RUNS:-3}
SKIP=${SKIP:-}
PY=/usr/bin/python3

. "$SRCDIR/tests/netlab/lab.sh"
lab_require tc
[ -x "$PY" ] || { echo "$0: needs $PY (with numpy)" >&2; exit 1; }

echo "all-reduce across the network lab: N hosts on a bridge, tc tbf egress cap B per host"
echo "time: the slowest member's allreduce_s, median of $RUNS rounds; floor 2(N-1)/N x M / B"
echo "(8bit: M/4); machine: $(nproc) CPUs, kernel $(uname -r)"
echo
printf '%-3s %-5s %-8s %-5s %9s %9s %7s %s\n' N MiB rate comp "median s" "floor s" ratio runs
status=0
for n in $HOSTS; do
    lab_up "$n"
    for mb in $SIZES; do
        "$PY" -c 'import numpy as np, sys
np.random.default_rng(1).standard_normal(int(sys.argv[1]) << 18, dtype=np.float32).tofile(sys.argv[2])' \
            "$mb" "$LAB_DIR/in$mb.f32"
    done
    lab_hivemindd h1
    boot=$(lab_peer h1)
    for i in $(seq 2 "$n"); do
        lab_hivemindd "h$i" --initial-peers "$boot"
    done
    sleep 2
    round=0
    for rate in $RATES; do
        for i in $(seq 1 "$n"); do
            lab_cap "h$i" "$rate"
        done
        bps=$(lab_rate_bps "$rate")
        for mb in $SIZES; do
            for comp in $COMPRESSION; do
                case " $SKIP " in
                    *" $n:$mb:$rate:$comp "*)
                        printf '%-3s %-5s %-8s %-5s %9s\n' "$n" "$mb" "$rate" "$comp" skipped
                        continue
                        ;;
                esac
                times=""
                for run in $(seq 1 "$RUNS"); do
                    round=$((round + 1))
                    for i in $(seq 1 "$n"); do
                        lab_ctl "h$i" --json --timeout 60 average "bench.$round" \
                            --in "$LAB_DIR/in$mb.f32" --out "$LAB_DIR/out$i.f32" \
                            --target-group-size "$n" --min-group-size "$n" \
                            --matchmaking-time 20 --round-timeout 300 --compression "$comp" \
                            >"$LAB_DIR/r$i.json" 2>&1 &
                        echo $! >"$LAB_DIR/r$i.pid"
                    done
                    ok=1
                    for i in $(seq 1 "$n"); do
                        wait "$(cat "$LAB_DIR/r$i.pid")" || ok=0
                    done
                    if [ "$ok" != 1 ]; then
                        echo "$0: N=$n $mb MiB $rate $comp run $run failed:" >&2
                        cat "$LAB_DIR"/r*.json >&2
                        status=1
                        continue
                    fi
                    t=$(cat "$LAB_DIR"/r*.json | "$PY" -c 'import json, sys
print(max(json.loads(l)["result"]["allreduce_s"] for l in sys.stdin if l.strip()))')
                    times="$times $t"
                done
                "$PY" - "$n" "$mb" "$rate" "$bps" "$comp" $times <<'EOF'
import statistics, sys
n, mb, rate, bps, comp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
times = [float(x) for x in sys.argv[6:]]
m = mb * 2**20 / (4 if comp == "8bit" else 1)
floor = 2 * (n - 1) / n * m / (bps / 8)
if times:
    med = statistics.median(times)
    print(f"{n:<3} {mb:<5} {rate:<8} {comp:<5} {med:9.3f} {floor:9.3f} {med / floor:6.2f}x "
          + " ".join(f"{t:.3f}" for t in times), flush=True)
else:
    print(f"{n:<3} {mb:<5} {rate:<8} {comp:<5} {'FAILED':>9} {floor:9.3f}", flush=True)
EOF
            done
        done
    done
    lab_down
done
exit $status

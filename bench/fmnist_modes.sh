#!/bin/sh
# fmnist_modes.sh: Fashion-MNIST test accuracy over wall time, the same
# model (bench/fmnist_modes.py: 784-128-10 MLP, AdamW, batch 64) trained
# by one process, then by N trainers (each on its own hivemindd on
# 127.0.0.1 and its own shard) in each of three ways: periodic parameter
# averaging, the collaborative optimizer (hivemindd.Optimizer), DiLoCo.
# Keeps each run's log under $OUT (default: a temporary directory) and
# prints a table of every run's trainer-0 accuracy at the last evaluation
# before each mark.
#
#   HM_BUILDDIR=build sh bench/fmnist_modes.sh [SECONDS] [N]
#
# Extra flags per mode: $SOLO_FLAGS $PERIODIC_FLAGS $COLLAB_FLAGS
# $DILOCO_FLAGS (e.g. COLLAB_FLAGS="--target-batch-size 2048").
# $MODES picks the runs (default: "solo periodic collab local diloco";
# local is the collaborative optimizer with --use-local-updates).

set -eu
secs=${1:-60}
n=${2:-2}
here=$(cd "$(dirname "$0")" && pwd)
build=${HM_BUILDDIR:-build}
build=$(cd "$build" && pwd)
out=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/modesbench.XXXXXX")}
mkdir -p "$out"
export HIVEMIND_LIB="$build/lib/.libs/libhivemind.so" PYTHONPATH="$here/../contrib/python"
export OPENBLAS_NUM_THREADS=1
py=${HM_PYTHON:-/usr/bin/python3}
train="$here/fmnist_modes.py"
modes=${MODES:-solo periodic collab local diloco}
pids=
cleanup() { for p in $pids; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM

for mode in $modes; do
	case $mode in
	solo)
		echo "solo: $out/solo.t0.log"
		"$py" "$train" --mode solo --time-limit "$secs" ${SOLO_FLAGS:-} > "$out/solo.t0.log"
		continue ;;
	periodic) flags="--mode periodic ${PERIODIC_FLAGS:-}" ;;
	collab) flags="--mode collab ${COLLAB_FLAGS:-}" ;;
	local) flags="--mode collab --use-local-updates ${COLLAB_FLAGS:-}" ;;
	diloco) flags="--mode diloco ${DILOCO_FLAGS:-}" ;;
	*) echo "unknown mode $mode" >&2; exit 2 ;;
	esac
	pids=
	first=
	i=0
	while [ "$i" -lt "$n" ]; do
		d="$out/$mode.d$i"
		mkdir -p "$d"
		if [ -z "$first" ]; then
			"$build/src/hivemindd" --listen 127.0.0.1:0 --state-dir "$d" \
				--control-socket "$d/ctl.sock" > "$d/out" 2> "$d/err" &
		else
			"$build/src/hivemindd" --listen 127.0.0.1:0 --state-dir "$d" \
				--control-socket "$d/ctl.sock" --initial-peers "$first" > "$d/out" 2> "$d/err" &
		fi
		pids="$pids $!"
		while ! [ -s "$d/out" ] || ! [ -S "$d/ctl.sock" ]; do sleep 0.1; done
		[ -n "$first" ] || first=$(head -n 1 "$d/out")
		i=$((i + 1))
	done
	sleep 3 # the routing tables fill
	echo "$mode x$n: $out/$mode.t*.log"
	tp=
	i=0
	while [ "$i" -lt "$n" ]; do
		"$py" "$train" --socket "$out/$mode.d$i/ctl.sock" --shard "$i/$n" --peers "$n" \
			--run-id "bench.$mode" --time-limit "$secs" $flags > "$out/$mode.t$i.log" \
			2> "$out/$mode.t$i.err" &
		tp="$tp $!"
		i=$((i + 1))
	done
	for p in $tp; do wait "$p"; done
	cleanup
	for p in $pids; do wait "$p" 2>/dev/null || true; done
	pids=
done

"$py" "$here/fmnist_table.py" "$out" "$secs" "$n" $modes

#!/bin/sh
# diloco_bench.sh: Fashion-MNIST test accuracy over wall time, one process
# (train_diloco.py --solo) against DiLoCo with N trainers, each on its own
# hivemindd on 127.0.0.1 and its own shard of the training set. Prints
# each run's log under $OUT (default: a temporary directory) and a table
# of the accuracy of the model at the last evaluation before each mark.
#
#   HM_BUILDDIR=build sh contrib/python/examples/diloco_bench.sh [SECONDS] [N...]
#
# Extra train_diloco.py flags go in $TRAIN_FLAGS (e.g. "--inner-steps 100").

set -eu
secs=${1:-60}
[ $# -gt 0 ] && shift
peers=${*:-2 4}
here=$(cd "$(dirname "$0")" && pwd)
build=${HM_BUILDDIR:-build}
build=$(cd "$build" && pwd)
out=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/dilocobench.XXXXXX")}
mkdir -p "$out"
export HIVEMIND_LIB="$build/lib/.libs/libhivemind.so" PYTHONPATH="$here/.."
py=${HM_PYTHON:-/usr/bin/python3}
train="$here/train_diloco.py"
flags="--time-limit $secs --steps 1000000 --eval-samples 10000 ${TRAIN_FLAGS:-}"
pids=
cleanup() { for p in $pids; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM

echo "solo: $out/solo.log"
"$py" "$train" --solo $flags > "$out/solo.log"

for n in $peers; do
	pids=
	first=
	i=0
	while [ "$i" -lt "$n" ]; do
		d="$out/n$n.d$i"
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
	echo "diloco x$n: $out/n$n.t*.log"
	tp=
	i=0
	while [ "$i" -lt "$n" ]; do
		"$py" "$train" --socket "$out/n$n.d$i/ctl.sock" --shard "$i/$n" --peers "$n" \
			--run-id "bench.n$n" $flags > "$out/n$n.t$i.log" &
		tp="$tp $!"
		i=$((i + 1))
	done
	for p in $tp; do wait "$p"; done
	cleanup
	for p in $pids; do wait "$p" 2>/dev/null || true; done
	pids=
done

"$py" - "$out" "$secs" $peers <<'PY'
import re, sys
out, secs, peers = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
marks = [m for m in (10, 20, 30, 45, 60, 90, 120, 180, 300) if m <= secs]
def curve(path):
    pts = []
    for line in open(path):
        m = re.search(r"\bt ([0-9.]+) step (\d+) acc ([0-9.]+)", line)
        if m:
            pts.append((float(m.group(1)), int(m.group(2)), float(m.group(3))))
    return pts
def at(pts, t):
    best = None
    for p in pts:
        if p[0] <= t:
            best = p
    return "%.3f" % best[2] if best else "-"
rows = [("1 process", curve("%s/solo.log" % out))]
for n in peers:
    rows.append(("DiLoCo x%s (trainer 0)" % n, curve("%s/n%s.t0.log" % (out, n))))
print("| run | " + " | ".join("%d s" % m for m in marks) + " | inner steps (trainer 0) |")
print("| --- |" + " --- |" * (len(marks) + 1))
for name, pts in rows:
    print("| %s | %s | %d |" % (name, " | ".join(at(pts, m) for m in marks),
                                  pts[-1][1] if pts else 0))
PY

#!/usr/bin/env bash
# dht_vs_opendht.sh: the DHT side by side with OpenDHT 2.4 in one run.
#
#   bench/dht_vs_opendht.sh BUILDDIR [RUNS]
#
# Runs, RUNS times (default 3) and alternating, bench_dht --only latency
# (32 hivemindd processes and an in-process client node) and
# bench/opendht_bench.py (32 OpenDHT nodes and a client node, Debian's
# python3-opendht), each with 200 puts, 200 gets, then 30% of the nodes
# killed and 200 more gets 8 at a time. Prints each run's figures, then the
# medians of both and the ratios (OpenDHT / hivemindd: above 1 means
# hivemindd is faster). Everything stays on 127.0.0.1. Not a test.
set -euo pipefail

builddir=${1:?usage: $0 BUILDDIR [RUNS]}
runs=${2:-3}
here=$(cd "$(dirname "$0")" && pwd)
builddir=$(cd "$builddir" && pwd)
py=/usr/bin/python3
$py -c 'import opendht' 2>/dev/null || {
    echo "$0: python3-opendht is not installed (apt-get install python3-opendht)" >&2
    exit 77
}
out=$(mktemp -d "${TMPDIR:-/tmp}/dht_vs_opendht.XXXXXX")
trap 'rm -rf "$out"' EXIT

for i in $(seq 1 "$runs"); do
    (cd "$builddir" && ./bench/bench_dht --only latency --nodes 32 --ops 200 --churn 30) \
        > "$out/hm.$i" 2>&1 || { cat "$out/hm.$i"; exit 1; }
    $py "$here/opendht_bench.py" --nodes 32 --ops 200 --churn 30 > "$out/od.$i" 2>&1 ||
        { cat "$out/od.$i"; exit 1; }
    for s in hm od; do
        printf '%s run %d: ' "$([ $s = hm ] && echo hivemindd || echo OpenDHT)" "$i"
        grep -E '^(get|put|get after churn) latency|ok:|^UDP datagrams dropped' "$out/$s.$i" | tr -s ' ' | paste -sd';' -
    done
done

# field LABEL STAT FILE...: the median over FILEs of STAT (p50|p95) on the LABEL line.
field() {
    local label=$1 stat=$2
    shift 2
    for f in "$@"; do
        grep -E "^$label latency" "$f" | sed -E "s/.* $stat +([0-9.]+) ms.*/\1/"
    done | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'
}
okcount() { # LABEL FILE...: the smallest success count
    local label=$1
    shift
    for f in "$@"; do grep -E "^$label ok:" "$f" | awk '{print $(NF >= 0 ? 0 : 0)}' | grep -oE '[0-9]+ of [0-9]+' | head -1; done | sort -n | head -1
}
echo
echo "medians of $runs runs (ms); ratio = OpenDHT / hivemindd"
printf '%-22s %10s %10s %8s\n' "" hivemindd OpenDHT ratio
for label in put get "get after churn"; do
    for stat in p50 p95; do
        h=$(field "$label" $stat "$out"/hm.*)
        o=$(field "$label" $stat "$out"/od.*)
        printf '%-22s %10s %10s %8s\n' "$label $stat" "$h" "$o" "$(awk -v h="$h" -v o="$o" 'BEGIN {printf "%.2f", o / h}')"
    done
done
echo "fewest gets found (hivemindd): $(okcount gets "$out"/hm.*), after churn: $(okcount 'gets after churn' "$out"/hm.*)"
echo "fewest gets found (OpenDHT):   $(okcount gets "$out"/od.*), after churn: $(okcount 'gets after churn' "$out"/od.*)"

#!/bin/bash
# relay_call.sh: expert call latency direct versus through a relay, in the
# network lab (tests/netlab/lab.sh). h1 is a relay (and the bootstrap), h2
# sits behind a NAT and hosts ffn.0.0 through h1, h4 hosts ffn.1.0 with the
# same shape directly, h3 calls both in turn with `hivemindctl experts
# call` (which looks the expert up in the DHT each time, on both paths) and
# prints the median of each and their ratio, measured in the same run.
#
# Usage: bench/relay_call.sh [CALLS] [BATCH] [DIM]   (default 30 256 64)
# Environment: HM_BUILDDIR (default: the current directory), HM_SRCDIR.
# Needs root (network namespaces); exits 77 otherwise.

set -eu

calls=${1:-30}
batch=${2:-256}
dim=${3:-64}
srcdir=${HM_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
export HM_BUILDDIR=${HM_BUILDDIR:-$PWD}
# shellcheck source=tests/netlab/lab.sh
. "$srcdir/tests/netlab/lab.sh"
lab_require nft
PY=/usr/bin/python3

info_field() {
    lab_ctl "$1" --json info 2>/dev/null |
        "$PY" -c 'import json,sys
v = json.load(sys.stdin)["result"]
for k in sys.argv[1].split("."):
    v = v.get(k) if isinstance(v, dict) else None
print(v)' "$2" || echo "?"
}

lab_up 4
lab_nat h2
# As in tests/netlab_relay_test.sh: h2 may not dial h3, so h3's calls to it go through h1.
lab_exec h2 nft -f - <<EOF
table inet hmrelaybench {
    chain out {
        type filter hook output priority 0; policy accept;
        ip daddr $(lab_addr h3) tcp dport 31400 drop
    }
}
EOF
common=(--ping-interval 1 --expert-dim "$dim")
lab_hivemindd h1 "${common[@]}" --relay
h1=$(lab_peer h1)
lab_hivemindd h4 "${common[@]}" --initial-peers "$h1" --host-experts ffn.1.0
h4=$(lab_peer h4)
lab_hivemindd h3 "${common[@]}" --initial-peers "$h1,$h4"
lab_hivemindd h2 "${common[@]}" --initial-peers "$h1,$h4" --relay-via "$h1" --host-experts ffn.0.0
for t in $(seq 1 600); do
    [ "$(info_field h2 relay.state)" = reserved ] && break
    sleep 0.2
done
[ "$(info_field h2 relay.state)" = reserved ] || lab_die "h2 did not reserve with h1"

x="$LAB_DIR/x.f32"
"$PY" -c 'import struct,sys; b,d=int(sys.argv[2]),int(sys.argv[3]); open(sys.argv[1],"wb").write(struct.pack("<%df"%(b*d),*[((i*37)%101)/101.0 for i in range(b*d)]))' \
    "$x" "$batch" "$dim"
# Both experts answer once before timing (connections up, records found).
for uid in ffn.0.0 ffn.1.0; do
    for t in $(seq 1 60); do
        lab_ctl h3 experts call "$uid" --in "$x" --out "$LAB_DIR/y" --timeout 10 >/dev/null 2>&1 && break
        sleep 1
    done
done
before=$(info_field h1 relay.bytes_relayed)

one() {
    local t0 t1
    t0=$(date +%s%N)
    lab_ctl h3 experts call "$1" --in "$x" --out "$LAB_DIR/y" --timeout 10 >/dev/null ||
        lab_die "a call of $1 failed"
    t1=$(date +%s%N)
    echo $(((t1 - t0) / 1000))
}
: >"$LAB_DIR/direct.us"
: >"$LAB_DIR/relayed.us"
for i in $(seq 1 "$calls"); do
    one ffn.1.0 >>"$LAB_DIR/direct.us"
    one ffn.0.0 >>"$LAB_DIR/relayed.us"
done
after=$(info_field h1 relay.bytes_relayed)
"$PY" - "$LAB_DIR/direct.us" "$LAB_DIR/relayed.us" "$calls" "$batch" "$dim" "$before" "$after" <<'PY'
import statistics, sys
d = [int(x) / 1000.0 for x in open(sys.argv[1])]
r = [int(x) / 1000.0 for x in open(sys.argv[2])]
calls, batch, dim = sys.argv[3:6]
before, after = int(sys.argv[6]), int(sys.argv[7])
md, mr = statistics.median(d), statistics.median(r)
print("expert call, %s calls each, batch %s x dim %s (%d KiB in, as much out)" %
      (calls, batch, dim, int(batch) * int(dim) * 4 // 1024))
print("  direct  median %.2f ms (min %.2f, max %.2f)" % (md, min(d), max(d)))
print("  relayed median %.2f ms (min %.2f, max %.2f)" % (mr, min(r), max(r)))
print("  relayed / direct: %.2f; the relay carried %d bytes" % (mr / md, after - before))
PY

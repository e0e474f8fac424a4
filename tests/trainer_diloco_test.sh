#!/usr/bin/env bash
# trainer_diloco_test.sh: the example trainer (contrib/examples/trainer) in
# DiLoCo mode with real daemons on 127.0.0.1: an expert host that is also
# the bootstrap node, and two trainers, each on a hivemindd of its own,
# training Fashion-MNIST with --diloco for a short run. Checks what a user
# of DiLoCo relies on:
#   - both trainers take outer steps and exit with status 0;
#   - after an outer step that both averaged in one group of two (and every
#     one before it was such), both hold bit-identical parameters (the
#     outer ones: same start, same averaged pseudo-gradient, same Nesterov
#     step), as their params= sums show;
#   - the final test accuracy is far above chance (0.1), which parameters
#     whose averaging or outer step were broken do not reach;
#   - the option errors are clear and exit with status 64.
# Skips (77) when the dataset or the trainer is missing.
#
#   HM_SRCDIR=.. HM_BUILDDIR=. bash ../tests/trainer_diloco_test.sh
# make check runs it with sh.
if [ -z "${BASH_VERSION:-}" ]; then
    exec bash "$0" "$@"
fi
set -euo pipefail

BUILD="$(cd "${HM_BUILDDIR:-.}" && pwd)"
DATA="${HM_DATA_DIR:-/usr/share/datasets/fashion-mnist}"
HIVEMINDD="$BUILD/src/hivemindd"
HIVEMINDCTL="$BUILD/src/hivemindctl"
TRAINER="$BUILD/contrib/examples/trainer"
SECS="${HM_DILOCO_TEST_SECS:-40}"
# Three 40 s runs on the loaded 2-core build machine (one under ASan) ended
# at 0.866 to 0.876, with 59 to 67 outer rounds; chance is 0.10.
ACC_FLOOR=0.6

for f in "$HIVEMINDD" "$HIVEMINDCTL" "$TRAINER"; do
    if [ ! -x "$f" ]; then
        echo "SKIP: $f is not built"
        exit 77
    fi
done
if [ ! -d "$DATA" ]; then
    echo "SKIP: no Fashion-MNIST in $DATA (package dataset-fashion-mnist)"
    exit 77
fi

export OPENBLAS_NUM_THREADS=1
DIR="$(mktemp -d "${TMPDIR:-/tmp}/diloco-test.XXXXXX")"
PIDS=()
cleanup() {
    local p
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    if [ "${FAILED:-0}" -eq 0 ]; then rm -rf "$DIR"; else echo "logs kept in $DIR"; fi
}
trap cleanup EXIT
FAILED=0
fail() {
    echo "FAIL: $*"
    FAILED=1
    local f
    for f in "$DIR"/*/stderr "$DIR"/*/trainer.out "$DIR"/*/trainer.err; do
        [ -s "$f" ] || continue
        echo "--- $f (last 10 lines)"
        tail -n 10 "$f"
    done
    exit 1
}

# The option errors: exit 64 with a sentence, before any connection.
for bad in "--diloco --inner-steps 0" "--diloco --outer-lr 0" "--diloco --outer-lr 11" \
           "--diloco --outer-momentum 1" "--diloco --compression zip" \
           "--diloco --collaborative" "--inner-steps 10"; do
    rc=0
    # shellcheck disable=SC2086
    "$TRAINER" --socket "$DIR/none.sock" $bad >/dev/null 2>"$DIR/usage.err" || rc=$?
    [ "$rc" -eq 64 ] || fail "trainer $bad exited with $rc, not 64"
    [ -s "$DIR/usage.err" ] || fail "trainer $bad said nothing"
done
"$TRAINER" --help >"$DIR/help.out"
grep -q -- '--outer-momentum' "$DIR/help.out" || fail "--help does not list --outer-momentum"

# start_daemon NAME [args]: prints nothing; sets ADDR to its address.
start_daemon() {
    local n="$1" line=""
    shift
    mkdir -m 0700 "$DIR/$n"
    : >"$DIR/$n/stdout" # read below before the daemon's shell may have opened it
    "$HIVEMINDD" --listen 127.0.0.1:0 --state-dir "$DIR/$n" --control-socket "$DIR/$n/ctl.sock" \
        --log-level info "$@" >"$DIR/$n/stdout" 2>"$DIR/$n/stderr" &
    PIDS+=($!)
    for _ in $(seq 100); do
        [ "$(wc -l <"$DIR/$n/stdout")" -ge 1 ] && line="$(head -n 1 "$DIR/$n/stdout")" && break
        sleep 0.1
    done
    [ -n "$line" ] || fail "hivemindd $n printed no address"
    for _ in $(seq 50); do
        "$HIVEMINDCTL" -s "$DIR/$n/ctl.sock" info >/dev/null 2>&1 && break
        sleep 0.1
    done
    ADDR="$line"
}

start_daemon host --host-experts 'ffn.[0:2].[0:2]' --expert-dim 32
boot="$ADDR"
start_daemon t1 --initial-peers "$boot"
start_daemon t2 --initial-peers "$boot"
t0=$SECONDS
until [ "$("$HIVEMINDCTL" -s "$DIR/t1/ctl.sock" experts list ffn 2>/dev/null \
            | grep -cE '^ *ffn\.[0-9]+\.[0-9]+')" -ge 4 ] &&
      [ "$("$HIVEMINDCTL" -s "$DIR/t2/ctl.sock" experts list ffn 2>/dev/null \
            | grep -cE '^ *ffn\.[0-9]+\.[0-9]+')" -ge 4 ]; do
    [ $((SECONDS - t0)) -lt 60 ] || fail "the 4 experts were not found within 60 s"
    sleep 1
done

TPIDS=()
for i in 1 2; do
    "$TRAINER" --socket "$DIR/t$i/ctl.sock" --data "$DATA" --steps 0 --time-limit "$SECS" \
        --dim 32 --experts 2x2 --k-best 2 --k-min 1 --timeout 3 --timeout-after-k-min 0.3 \
        --eval-every 0 --print-every 100 --seed "$i" --group-size 2 \
        --diloco --inner-steps 40 --outer-lr 0.7 --outer-momentum 0.9 \
        --matchmaking-time 2 --averaging-timeout 20 \
        >"$DIR/t$i/trainer.out" 2>"$DIR/t$i/trainer.err" &
    TPIDS+=($!)
    PIDS+=($!)
done
for i in 1 2; do
    rc=0
    wait "${TPIDS[i - 1]}" || rc=$?
    [ "$rc" -eq 0 ] || fail "trainer t$i exited with status $rc"
done

for i in 1 2; do
    grep -q '^config .*mode=diloco' "$DIR/t$i/trainer.out" || fail "t$i did not train with DiLoCo"
    n="$(grep -c '^outer ' "$DIR/t$i/trainer.out" || true)"
    [ "$n" -ge 3 ] || fail "trainer t$i took $n outer steps (want >= 3)"
done

# round -> "status group params" of each trainer.
field() { tr ' ' '\n' | sed -n "s/^$1=//p"; }
declare -A S1=() S2=()
while read -r line; do
    r="$(field round <<<"$line")"
    S1[$r]="$(field status <<<"$line") $(field group <<<"$line") $(field params <<<"$line")"
done < <(grep '^outer ' "$DIR/t1/trainer.out")
while read -r line; do
    r="$(field round <<<"$line")"
    S2[$r]="$(field status <<<"$line") $(field group <<<"$line") $(field params <<<"$line")"
done < <(grep '^outer ' "$DIR/t2/trainer.out")
checked=0
for ((r = 0; ; r++)); do
    [ -n "${S1[$r]:-}" ] && [ -n "${S2[$r]:-}" ] || break
    read -r st1 g1 p1 <<<"${S1[$r]}"
    read -r st2 g2 p2 <<<"${S2[$r]}"
    # Identical only while every round so far was averaged by both together.
    [ "$st1" = ok ] && [ "$st2" = ok ] && [ "$g1" = 2 ] && [ "$g2" = 2 ] || break
    [ "$p1" = "$p2" ] || fail "after outer round $r, averaged by both, t1 holds $p1 and t2 $p2"
    checked=$((checked + 1))
done
[ "$checked" -ge 1 ] || fail "no outer round was averaged by both trainers together: ${S1[0]:-none} / ${S2[0]:-none}"
echo "ok: identical parameters after $checked outer rounds averaged by both"

for i in 1 2; do
    acc="$(grep '^done ' "$DIR/t$i/trainer.out" | field acc)"
    awk -v a="${acc:-0}" -v f="$ACC_FLOOR" 'BEGIN { exit !(a >= f) }' \
        || fail "trainer t$i ended at test accuracy ${acc:-none} < $ACC_FLOOR"
    echo "ok: t$i final test accuracy $acc >= $ACC_FLOOR," \
        "$(grep -c '^outer .*status=ok' "$DIR/t$i/trainer.out") of" \
        "$(grep -c '^outer ' "$DIR/t$i/trainer.out") outer rounds averaged"
done

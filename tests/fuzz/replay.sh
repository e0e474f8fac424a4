#!/bin/sh
# replay.sh: the `make check` fuzz test. Runs each fuzz target (built with
# the standalone driver) over its seed corpus and then over FUZZ_RUNS
# deterministic mutations of it, and fails if any target crashes, trips a
# sanitizer or times out.
#
# Environment: HM_BUILDDIR and HM_SRCDIR (set by `make check`; default to
# the current directory and this script's source tree), FUZZ_RUNS (default
# 20000), FUZZ_SEED (default 1), HM_FUZZ_TARGETS (default: every target).
# It writes nothing into the source tree, so it runs from a read-only srcdir
# as under `make distcheck`; a crashing input is saved in the build tree.

set -u

srcdir=${HM_SRCDIR:-$(cd "$(dirname "$0")/../.." && pwd)}
builddir=${HM_BUILDDIR:-$(pwd)}
runs=${FUZZ_RUNS:-20000}
seed=${FUZZ_SEED:-1}
targets=${HM_FUZZ_TARGETS:-"fuzz_wire fuzz_dgram fuzz_handshake fuzz_control fuzz_dht_record fuzz_dht_proto fuzz_avg_codec fuzz_allreduce fuzz_matchmaking fuzz_moe_proto fuzz_moe_checkpoint fuzz_state fuzz_client fuzz_idx fuzz_diloco_state fuzz_progress fuzz_reach fuzz_config fuzz_rpc_head"}
# -- http --
[ -n "${HM_FUZZ_TARGETS:-}" ] || targets="$targets fuzz_status_rec"
# -- relay --
[ -n "${HM_FUZZ_TARGETS:-}" ] || targets="$targets fuzz_relay"
# -- optimizer state --
[ -n "${HM_FUZZ_TARGETS:-}" ] || targets="$targets fuzz_opt_state"
# -- netlab delays --
[ -n "${HM_FUZZ_TARGETS:-}" ] || targets="$targets fuzz_delay_rules"

failed=0
passed=0
for t in $targets; do
    bin="$builddir/tests/fuzz/$t"
    corpus="$srcdir/tests/fuzz/corpus/$t"
    if [ ! -x "$bin" ]; then
        echo "FAIL: $t: $bin was not built"
        failed=$((failed + 1))
        continue
    fi
    set -- "-runs=$runs" "-seed=$seed" "-artifact_prefix=$builddir/tests/fuzz/"
    # A target without a seed corpus still runs on random inputs.
    if [ -d "$corpus" ]; then
        set -- "$@" "$corpus"
    fi
    if "$bin" "$@"; then
        echo "PASS: $t"
        passed=$((passed + 1))
    else
        rc=$?
        echo "FAIL: $t (exit $rc); rerun: $bin $*"
        failed=$((failed + 1))
    fi
done

echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]

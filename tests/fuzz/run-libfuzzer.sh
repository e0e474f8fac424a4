#!/bin/sh
# run-libfuzzer.sh: coverage-guided fuzzing for CI. Builds every fuzz target
# with clang's libFuzzer, ASan and UBSan, runs each for SECONDS on a scratch
# copy of its seed corpus, and exits non-zero if any target crashes, leaks,
# times out or fails to build.
#
#   tests/fuzz/run-libfuzzer.sh BUILDDIR [SECONDS]
#
# BUILDDIR is a configured build tree (for config.h); the fuzzers are built
# in BUILDDIR/tests/fuzz/libfuzzer/ and crash inputs are left there, their
# paths printed. SECONDS defaults to 60 per target. The source tree is found
# from this script's location and is never written to. Targets run one
# after another in HM_FUZZ_JOBS lanes side by side (default: the number of
# cores), each in one process. Environment: CC (default clang),
# HM_FUZZ_TARGETS (default: every target), HM_FUZZ_JOBS.

set -u

usage() {
    echo "usage: $0 BUILDDIR [SECONDS]" >&2
    exit 64
}

[ $# -ge 1 ] && [ $# -le 2 ] || usage
builddir=$(cd "$1" && pwd) || usage
seconds=${2:-60}
case $seconds in
    '' | *[!0-9]*) usage ;;
esac
srcdir=$(cd "$(dirname "$0")/../.." && pwd)
cc=${CC:-clang}
jobs=${HM_FUZZ_JOBS:-$(nproc)}
case $jobs in
    '' | *[!0-9]* | 0) echo "$0: HM_FUZZ_JOBS must be a positive number" >&2; exit 64 ;;
esac

if [ ! -f "$builddir/config.h" ]; then
    echo "$0: $builddir has no config.h; run configure there first" >&2
    exit 64
fi

# The targets and the modules each links, as Makefile.am lists them.
all_targets=$(make -s --no-print-directory -C "$builddir" fuzz-targets | sed 's|tests/fuzz/||g') || exit 1
targets=${HM_FUZZ_TARGETS:-$all_targets}

sources_for() {
    case " $all_targets " in
        *" $1 "*) ;;
        *) return 1 ;;
    esac
    # Every .c the target links but its own file and the standalone driver
    # (libFuzzer brings its own main).
    make -s --no-print-directory -C "$builddir" fuzz-sources FUZZ_TARGET="$1" | tr ' ' '\n' |
        grep '\.c$' | grep -v '^tests/fuzz/'
}

pkgs="libuv libsodium libcrypto msgpack jansson openblas zlib"
dep_cflags=$(pkg-config --cflags $pkgs) || exit 1
dep_libs=$(pkg-config --libs $pkgs) || exit 1

outdir="$builddir/tests/fuzz/libfuzzer"
mkdir -p "$outdir" || exit 1
scratch=$(mktemp -d "${TMPDIR:-/tmp}/hm-libfuzzer.XXXXXX") || exit 1
trap 'rm -rf "$scratch"' EXIT
# An interrupt also stops the lanes and the fuzzers running in them.
lanes=""
stop_lanes() {
    for l in $lanes; do
        pkill -TERM -P "$l" 2>/dev/null
        kill -TERM "$l" 2>/dev/null
    done
}
trap 'stop_lanes; exit 130' INT TERM

# one TARGET: build and run one target; prints its report and ends with a
# PASS: or FAIL: line.
one() {
    t=$1
    if ! mods=$(sources_for "$t"); then
        echo "FAIL: $t: unknown fuzz target"
        return
    fi
    srcs="$srcdir/tests/fuzz/$t.c"
    for m in $mods; do
        srcs="$srcs $srcdir/$m"
    done
    bin="$outdir/$t"
    echo "== building $t"
    # shellcheck disable=SC2086 # the source and flag lists are meant to split
    if ! "$cc" -std=gnu11 -g -O1 -fsanitize=fuzzer,address,undefined \
        -fno-sanitize-recover=undefined -fno-omit-frame-pointer \
        -I "$builddir" -I "$srcdir" $dep_cflags \
        -o "$bin" $srcs $dep_libs -lm 2>&1; then
        echo "FAIL: $t: build failed"
        return
    fi

    # libFuzzer adds what it finds to the corpus directory, so it gets a copy.
    work="$scratch/$t"
    mkdir -p "$work/corpus" "$outdir/$t-artifacts"
    if [ -d "$srcdir/tests/fuzz/corpus/$t" ]; then
        cp "$srcdir/tests/fuzz/corpus/$t"/* "$work/corpus/" 2>/dev/null
        chmod -R u+w "$work/corpus"
    fi
    rm -f "$outdir/$t-artifacts"/*
    echo "== running $t for $seconds s"
    if (cd "$work" && "$bin" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=2048 \
        -max_len=65536 -print_final_stats=1 \
        -artifact_prefix="$outdir/$t-artifacts/" "$work/corpus" >"$work/log" 2>&1); then
        tail -n 3 "$work/log"
        echo "PASS: $t"
    else
        tail -n 60 "$work/log"
        found=0
        for a in "$outdir/$t-artifacts"/*; do
            [ -f "$a" ] || continue
            echo "      crashing input saved as $a"
            echo "      reproduce: $bin $a"
            found=1
        done
        [ $found -eq 1 ] || echo "      libFuzzer failed without leaving an input"
        echo "FAIL: $t"
    fi
}

# The targets are dealt round-robin into JOBS lanes that run side by side,
# each target after the one before it in its lane; every target still gets
# its full SECONDS on one core.
i=0
for t in $targets; do
    lane=$((i % jobs))
    echo "$t" >>"$scratch/lane$lane"
    i=$((i + 1))
done
lane=0
while [ $lane -lt $jobs ]; do
    if [ -f "$scratch/lane$lane" ]; then
        (while read -r t; do one "$t" >"$scratch/$t.out" 2>&1 </dev/null; done <"$scratch/lane$lane") &
        lanes="$lanes $!"
    fi
    lane=$((lane + 1))
done
wait

failed=0
passed=0
for t in $targets; do
    cat "$scratch/$t.out"
    case $(tail -n 1 "$scratch/$t.out") in
        "PASS: $t") passed=$((passed + 1)) ;;
        *) failed=$((failed + 1)) ;;
    esac
done

echo "libfuzzer: $passed passed, $failed failed"
[ "$failed" -eq 0 ]

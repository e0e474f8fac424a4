#!/bin/sh
# allreduce_vs_mpi.sh: hivemindd's butterfly all-reduce (bench_allreduce,
# encrypted streams on 127.0.0.1) next to OpenMPI's MPI_Allreduce over TCP
# on loopback, in the same run, for 2, 4 and 8 peers and 4, 16 and 64 MiB of
# float32 per peer. Prints both medians, the ratio (MPI time / ours: above 1
# means hivemindd is faster) and the peak resident memory per peer against
# the tensor size.
#
#   bench/allreduce_vs_mpi.sh BUILDDIR
#
# BUILDDIR holds the built tree (bench/bench_allreduce). MPI is optional:
# bench/mpi_allreduce.c is compiled here with mpicc into a temporary
# directory; without mpicc or mpirun only our figures are printed.
# Environment: RUNS (measured rounds per case, default 5), PEERS (default
# "2 4 8"), SIZES (MiB, or KiB with a k suffix as in "64k"; default
# "4 16 64"), COMPRESSION (default none).
# MPI runs with the ob1 messaging layer and only the tcp and self
# transports, restricted to the loopback interface, so that neither side
# uses shared memory.
set -eu

if [ $# -ne 1 ]; then
    echo "usage: $0 BUILDDIR" >&2
    exit 64
fi
BUILD=$1
SRCDIR=$(cd "$(dirname "$0")/.." && pwd)
OURS=$BUILD/bench/bench_allreduce
RUNS=${RUNS:-5}
PEERS=${PEERS:-"2 4 8"}
SIZES=${SIZES:-"4 16 64"}
COMPRESSION=${COMPRESSION:-none}

if [ ! -x "$OURS" ]; then
    echo "$0: $OURS not found: build it first (make bench/bench_allreduce)" >&2
    exit 1
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/allreduce_vs_mpi.XXXXXX")
trap 'rm -rf "$TMP"' EXIT INT TERM

HAVE_MPI=0
if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then
    if mpicc -O2 -o "$TMP/mpi_allreduce" "$SRCDIR/bench/mpi_allreduce.c" -lm; then
        HAVE_MPI=1
    else
        echo "$0: mpicc failed to build bench/mpi_allreduce.c: MPI figures skipped" >&2
    fi
else
    echo "$0: mpicc or mpirun not found (Debian: apt-get install openmpi-bin libopenmpi-dev):" \
        "MPI figures skipped" >&2
fi

# Reads key=value from a RESULT line.
field() {
    echo "$1" | tr ' ' '\n' | sed -n "s/^$2=//p"
}

NPROC=$(nproc 2>/dev/null || echo "?")
echo "all-reduce of float32, $RUNS rounds after a warm-up, medians of the slowest peer's time"
echo "hivemindd: bench_allreduce, encrypted streams on 127.0.0.1, compression $COMPRESSION"
if [ "$HAVE_MPI" = 1 ]; then
    echo "MPI: $(mpirun --version 2>/dev/null | head -n 1), mpirun --mca pml ob1 --mca btl tcp,self" \
        "--mca btl_tcp_if_include lo"
fi
echo "machine: $NPROC CPUs; every peer is a process, so more peers than CPUs oversubscribe" \
    "the machine for both systems alike"
echo
printf '%-6s %-6s %10s %10s %8s %10s %10s %s\n' peers size "ours s" "MPI s" "MPI/ours" \
    "mem ours" "mem MPI" note
status=0
for n in $PEERS; do
    for mb in $SIZES; do
        note=""
        if [ "$NPROC" != "?" ] && [ "$n" -gt "$NPROC" ]; then
            note="oversubscribed ($n processes on $NPROC CPUs)"
        fi
        case $mb in
        *k) size_flag="--kb ${mb%k}" ;;
        *) size_flag="--mb $mb" ;;
        esac
        # shellcheck disable=SC2086 # size_flag is two words on purpose
        if ! out=$("$OURS" --peers "$n" $size_flag --runs "$RUNS" --compression "$COMPRESSION" \
            2>"$TMP/ours.err"); then
            status=1
            echo "$0: bench_allreduce --peers $n $size_flag failed:" >&2
            cat "$TMP/ours.err" >&2
        fi
        res=$(echo "$out" | grep '^RESULT' || true)
        ours=$(field "$res" median_s)
        ours_mem=$(field "$res" peak_ratio)
        mpi="-"
        mpi_mem="-"
        ratio="-"
        if [ "$HAVE_MPI" = 1 ]; then
            if mout=$(mpirun --oversubscribe --allow-run-as-root --mca pml ob1 \
                --mca btl tcp,self --mca btl_tcp_if_include lo -np "$n" \
                "$TMP/mpi_allreduce" $size_flag --runs "$RUNS" 2>"$TMP/mpi.err"); then
                mres=$(echo "$mout" | grep '^RESULT' || true)
                mpi=$(field "$mres" median_s)
                mpi_mem=$(field "$mres" peak_ratio)
            else
                echo "$0: mpirun -np $n mpi_allreduce $size_flag failed:" >&2
                cat "$TMP/mpi.err" >&2
            fi
        fi
        if [ -n "$ours" ] && [ -n "$mpi" ] && [ "$mpi" != "-" ]; then
            ratio=$(awk -v a="$mpi" -v b="$ours" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')
        fi
        [ -n "$ours" ] || ours="FAILED"
        [ -n "$ours_mem" ] && ours_mem="${ours_mem}x" || ours_mem="-"
        [ "$mpi_mem" = "-" ] || mpi_mem="${mpi_mem}x"
        printf '%-6s %-6s %10s %10s %8s %10s %10s %s\n' "$n" "$mb" "$ours" "$mpi" "$ratio" \
            "$ours_mem" "$mpi_mem" "$note"
    done
done
echo
echo "MPI/ours above 1: hivemindd is faster. mem: peak resident memory per peer (VmHWM, the"
echo "largest peer) / tensor size, process baseline included; target under 3x at every size."
exit $status

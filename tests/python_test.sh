#!/bin/sh
# python_test.sh: runs the Python binding's tests (contrib/python/tests)
# with /usr/bin/python3 against the build tree: the binding loads the
# tree's libhivemind.so and the tests start their own hivemindd processes
# from it on 127.0.0.1, in a temporary directory removed at the end.
# Skips (exit 77) when /usr/bin/python3, numpy or torch is missing.
# HM_PYTHON overrides the interpreter.

PY=${HM_PYTHON:-/usr/bin/python3}
if ! [ -x "$PY" ]; then
	echo "SKIP: $PY not found"
	exit 77
fi
if ! "$PY" -c 'import numpy, torch' >/dev/null 2>&1; then
	echo "SKIP: $PY lacks numpy or torch (Debian: python3-numpy python3-torch)"
	exit 77
fi

srcdir=${HM_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
builddir=${HM_BUILDDIR:-$(pwd)}
lib="$builddir/lib/.libs/libhivemind.so"
for f in "$lib" "$builddir/src/hivemindd"; do
	if ! [ -e "$f" ]; then
		echo "ERROR: $f is not built" >&2
		exit 99
	fi
done

# A library built with ASan only loads into an interpreter that has the
# ASan runtime first; Python's own allocations are not ours to check.
preload=
if command -v readelf >/dev/null 2>&1 && readelf -d "$lib" | grep -q 'libasan'; then
	preload=$(${CC:-gcc} -print-file-name=libasan.so 2>/dev/null)
	if ! [ -f "$preload" ]; then
		echo "SKIP: $lib is built with ASan and the ASan runtime is not found"
		exit 77
	fi
	ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0
	export ASAN_OPTIONS
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/hmpy.XXXXXX") || exit 99
trap 'rm -rf "$tmp"' EXIT
trap 'exit 1' INT TERM

HIVEMIND_LIB=$lib HM_BUILDDIR=$builddir TMPDIR=$tmp PYTHONDONTWRITEBYTECODE=1 \
	PYTHONPATH="$srcdir/contrib/python:$srcdir/contrib/python/tests" \
	LD_PRELOAD=${preload:-$LD_PRELOAD} \
	"$PY" -m unittest discover -s "$srcdir/contrib/python/tests" -t "$srcdir/contrib/python/tests" -v

#!/usr/bin/env bash
# demo_test.sh: runs the README's training demo (contrib/quickstart.sh demo
# --short) against an existing build: a swarm of real hivemindd processes on
# 127.0.0.1 trains the Fashion-MNIST example, survives a killed trainer and
# a stopped expert host, takes in a newcomer that loads the swarm's state,
# and must reach the accuracy floors and exit cleanly. Exit status 77 (skip)
# when the dataset or the example trainers are missing.
#
#   tests/demo_test.sh [BUILD_DIR]     (default: the current directory)
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$(cd "${1:-.}" && pwd)"
DATA="${HM_DATA_DIR:-/usr/share/datasets/fashion-mnist}"

for f in src/hivemindd src/hivemindctl contrib/examples/trainer contrib/examples/train_local; do
    if [ ! -x "$BUILD/$f" ]; then
        echo "demo_test: $BUILD/$f is not built (make contrib/examples/trainer" \
             "contrib/examples/train_local); skipping"
        exit 77
    fi
done
if [ ! -d "$DATA" ]; then
    echo "demo_test: no Fashion-MNIST in $DATA (package dataset-fashion-mnist); skipping"
    exit 77
fi

HM_NO_SETUP=1 HM_BUILD_DIR="$BUILD" HM_DATA_DIR="$DATA" \
    bash "$SRC/contrib/quickstart.sh" baseline --short
HM_NO_SETUP=1 HM_BUILD_DIR="$BUILD" HM_DATA_DIR="$DATA" \
    bash "$SRC/contrib/quickstart.sh" demo --short

#!/usr/bin/env bash
# quickstart.sh: sets hivemindd up on a fresh Debian 12 machine and runs it.
#
#   contrib/quickstart.sh demo [--short] [--no-failures] [--mode MODE]
#                                   build, then train a model with a local swarm
#   contrib/quickstart.sh baseline [--short]
#                                   build, then train the same model in one process
#   contrib/quickstart.sh test      build, then run the test suite
#
# Every command first checks the Debian packages the build needs. As root the
# missing ones are installed with apt-get; otherwise the exact command to run
# is printed and the script stops. Then the tree is bootstrapped (autoreconf)
# when needed, configured in build/ (reused once configured) and built.
#
# The demo trains the example mixture-of-experts classifier on Fashion-MNIST
# (contrib/examples/README.md) with a swarm on 127.0.0.1: a bootstrap
# hivemindd, two expert hosts that split the grid ffn.[0:4].[0:4] between
# them, and three trainers, each attached to a hivemindd of its own, that
# call the experts and average their own parameters in the background.
# Part-way it SIGKILLs one trainer and SIGSTOPs one expert host (SIGCONT
# later): the others keep training. Then a newcomer joins, downloads the
# swarm's state from the trainers (state.share / state.load) and starts
# from it. It prints test accuracy over time per trainer, the averaging
# rounds, the failures, the newcomer's accuracy after loading, and stops
# everything with SIGTERM: every process must exit with status 0 (except
# the trainer killed on purpose). --short is the CI version (about two
# minutes) and checks an accuracy floor, that the failures happened and were
# survived, that the newcomer started far above chance and that every
# process exited cleanly; any failed check makes the exit status 1.
# --no-failures runs the same swarm without the kill, the stop and the
# newcomer (for comparison). --mode picks how the trainers combine their
# work: periodic (the default: local steps, the parameters averaged in the
# background every 50 steps), collaborative (the collaborative optimizer:
# gradients accumulated to a swarm-wide batch of 1,024 samples, averaged,
# then one step) or diloco (DiLoCo: 50 local steps, then the averaged
# pseudo-gradient's outer Nesterov step; the newcomer loads the run's outer
# state). `baseline` trains the same model in one process
# (train_local) for the same time; the full demo runs it first.
#
# Environment: HM_BUILD_DIR (default: build/ in the repository),
# HM_CONFIGURE_ARGS (extra ./configure arguments, used on first configure),
# HM_NO_SETUP=1 (demo and baseline: skip the package check and the build and
# use what HM_BUILD_DIR holds, as tests/demo_test.sh does), HM_DATA_DIR
# (Fashion-MNIST, default /usr/share/datasets/fashion-mnist), HM_KEEP_DEMO=1
# (keep the demo's directory of logs and state; a failed --short keeps it).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${HM_BUILD_DIR:-$ROOT/build}"

PACKAGES=(
    build-essential make autoconf automake libtool pkg-config
    libuv1-dev libsodium-dev libmsgpack-dev libopenblas-dev libcriterion-dev libjansson-dev
    libssl-dev
    procps iproute2 zlib1g-dev dataset-fashion-mnist python3-numpy python3-torch
    libmicrohttpd-dev
    tcpdump
)

say() { printf '\n==> %s\n' "$*"; }
die() { printf 'quickstart: %s\n' "$*" >&2; exit 1; }

usage() {
    cat <<EOF
usage: $0 demo [--short] [--no-failures] [--mode periodic|collaborative|diloco]
                    build hivemindd and train a model with a local swarm; the
                    mode is how the trainers combine their work (default
                    periodic: parameter averaging every 50 steps;
                    collaborative: the collaborative optimizer; diloco: DiLoCo)
       $0 baseline [--short]
                    build and train the same model in one process, no swarm
       $0 test      build hivemindd and run the test suite (make check)
EOF
}

# ---- setup ----------------------------------------------------------------

check_packages() {
    local missing=() p status
    if ! command -v dpkg-query >/dev/null 2>&1; then
        say "not a Debian system: make sure these (or their equivalents) are installed:"
        printf '    %s\n' "${PACKAGES[*]}"
        return 0
    fi
    for p in "${PACKAGES[@]}"; do
        status="$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)"
        [ "$status" = installed ] || missing+=("$p")
    done
    if [ "${#missing[@]}" -eq 0 ]; then
        say "all build packages are installed"
        return 0
    fi
    if [ "$(id -u)" -eq 0 ]; then
        say "installing: ${missing[*]}"
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
        return 0
    fi
    printf 'quickstart: these packages are missing: %s\n' "${missing[*]}" >&2
    printf 'install them with:\n\n    sudo apt-get install -y %s\n\nthen run this again.\n' \
        "${missing[*]}" >&2
    exit 1
}

build() {
    cd "$ROOT"
    if [ ! -x configure ] || [ configure.ac -nt configure ] || [ Makefile.am -nt configure ] \
        || [ ! -f Makefile.in ] || [ Makefile.am -nt Makefile.in ]; then
        say "autoreconf -fi"
        autoreconf -fi
    fi
    if [ -f "$ROOT/config.status" ] && [ "$BUILD" != "$ROOT" ]; then
        die "the source tree itself is configured; run 'make distclean' in $ROOT first"
    fi
    mkdir -p "$BUILD"
    cd "$BUILD"
    if [ ! -f Makefile ]; then
        say "configure (in $BUILD)"
        # Word splitting of HM_CONFIGURE_ARGS is wanted: it holds several arguments.
        # shellcheck disable=SC2086
        "$ROOT/configure" ${HM_CONFIGURE_ARGS:-}
    fi
    say "make -j$(nproc)"
    # This builds the example trainers too (noinst_PROGRAMS in Makefile.am).
    make -j"$(nproc)"
}

# ---- test -----------------------------------------------------------------

run_tests() {
    cd "$BUILD"
    say "make check"
    if make -j"$(nproc)" check; then
        say "all tests passed"
        return 0
    fi
    # test-suite.log gathers the logs of the tests that failed.
    if [ -f test-suite.log ]; then
        say "test-suite.log"
        cat test-suite.log
    fi
    die "make check failed"
}

# ---- demo -----------------------------------------------------------------

# The swarm. Every name is a hivemindd with a directory $DEMO_DIR/NAME that
# holds its state, control socket and logs; t1..t4 also run a trainer.
DIM=64                     # the trainers' --dim and the experts' --expert-dim
GRID='ffn.[0:4].[0:4]'
HOST_GRIDS=('ffn.[0:4].[0:2]' 'ffn.[0:4].[2:4]')
DEMO_DIR=""
HIVEMINDD=""
HIVEMINDCTL=""
TRAINER=""
TRAIN_LOCAL=""
DATA_DIR="${HM_DATA_DIR:-/usr/share/datasets/fashion-mnist}"
declare -A DPID=()         # name -> hivemindd pid
declare -A TPID=()         # name -> trainer pid
declare -A ADDR=()         # name -> PEERID@HOST:PORT
declare -A KILLED=()       # trainers killed on purpose
CHECKS_FAILED=0
# The checks of --short. Five short runs on a loaded 2-core machine ended
# at a test accuracy of 0.845 to 0.863 (the baseline's 20 s: 0.858-0.859); a
# swarm whose experts do not answer or whose averaging corrupts the
# parameters stays near chance (0.10). A newcomer that loaded the swarm's
# state measured 0.823 to 0.840 before its first step; one that started
# from scratch would be at chance.
ACC_FLOOR=0.7
NEWCOMER_FLOOR=0.6

# True while pid runs; a child that exited but was not reaped yet is a
# zombie, which kill -0 would still report as alive.
is_running() {
    local state
    state="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
    [[ "$state" != Z* ]]
}

cleanup() {
    local pid
    for pid in "${TPID[@]}" "${DPID[@]}"; do
        [ -n "$pid" ] || continue
        if is_running "$pid"; then
            kill -CONT "$pid" 2>/dev/null || true
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    for pid in "${TPID[@]}" "${DPID[@]}"; do
        [ -n "$pid" ] || continue
        for _ in $(seq 50); do
            is_running "$pid" || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    done
    if [ -n "$DEMO_DIR" ] && [ -d "$DEMO_DIR" ] && [ -z "${HM_KEEP_DEMO:-}" ]; then
        rm -rf "$DEMO_DIR"
    fi
}

# Shows the end of every log, so that a failed demo explains itself.
show_logs() {
    local f
    for f in "$DEMO_DIR"/*/stderr "$DEMO_DIR"/*/trainer.err "$DEMO_DIR"/*/trainer.out; do
        [ -s "$f" ] || continue
        printf '\n--- %s (last 15 lines) ---\n' "${f#"$DEMO_DIR"/}" >&2
        tail -n 15 "$f" >&2 || true
    done
}

fail() {
    printf '\nquickstart: demo failed: %s\n' "$*" >&2
    show_logs
    exit 1
}

# A failed check of --short: noted, reported, and the exit status becomes 1.
check() {
    local what="$1"
    shift
    if "$@"; then
        printf '  ok      %s\n' "$what"
    else
        printf '  FAILED  %s\n' "$what"
        CHECKS_FAILED=1
    fi
}

ctl() {
    local n="$1"
    shift
    "$HIVEMINDCTL" -s "$DEMO_DIR/$n/control.sock" --timeout 5 "$@"
}

# start_daemon NAME [hivemindd arguments...]: starts it, waits for its
# address and its control socket.
start_daemon() {
    local n="$1" dir line=""
    shift
    dir="$DEMO_DIR/$n"
    mkdir -m 0700 "$dir"
    "$HIVEMINDD" --listen 127.0.0.1:0 --state-dir "$dir" --control-socket "$dir/control.sock" \
        --swarm quickstart --log-level info "$@" >"$dir/stdout" 2>"$dir/stderr" &
    DPID[$n]=$!
    # The first line of stdout is the node's address, complete once the
    # newline is there.
    for _ in $(seq 100); do
        if [ "$(wc -l <"$dir/stdout")" -ge 1 ]; then
            line="$(head -n 1 "$dir/stdout")"
            break
        fi
        is_running "${DPID[$n]}" || fail "hivemindd $n exited at start"
        sleep 0.1
    done
    [[ "$line" =~ ^[a-z2-7]{52}@127\.0\.0\.1:[0-9]+$ ]] \
        || fail "hivemindd $n printed '$line' instead of its address"
    ADDR[$n]="$line"
    for _ in $(seq 50); do
        ctl "$n" info >/dev/null 2>&1 && break
        sleep 0.1
    done
    ctl "$n" info >/dev/null || fail "hivemindd $n does not answer on its control socket"
    printf '%-4s hivemindd pid %-7d %s\n' "$n" "${DPID[$n]}" "$line"
}

# start_trainer NAME [trainer arguments...]: the trainer of node NAME.
start_trainer() {
    local n="$1"
    shift
    "$TRAINER" --socket "$DEMO_DIR/$n/control.sock" --data "$DATA_DIR" "$@" \
        >"$DEMO_DIR/$n/trainer.out" 2>"$DEMO_DIR/$n/trainer.err" &
    TPID[$n]=$!
    printf '%-4s trainer   pid %d\n' "$n" "${TPID[$n]}"
}

# The value of KEY= in the last line of FILE that starts with WORD.
last_field() {
    local file="$1" word="$2" key="$3"
    { grep "^$word " "$file" 2>/dev/null || true; } | tail -n 1 | tr ' ' '\n' \
        | sed -n "s/^$key=//p"
}

# Number of experts node NAME finds in the DHT under ffn.
experts_seen() {
    ctl "$1" experts list ffn 2>/dev/null | grep -cE '^ *ffn\.[0-9]+\.[0-9]+' || true
}

# Waits up to 15 s for pid to exit (killing it after that), reaps it and
# prints its exit status; returns that status.
reap() {
    local what="$1" pid="$2" j rc=0
    for ((j = 0; j < 150; j++)); do
        is_running "$pid" || break
        sleep 0.1
    done
    if is_running "$pid"; then
        printf '%s did not exit within 15 s; killing it\n' "$what"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" || rc=$?
    printf '  %-16s exited with status %d\n' "$what" "$rc"
    return "$rc"
}

# Prints "t acc" pairs of a trainer's eval lines and its done line.
acc_series() {
    local f="$1"
    awk '/^(eval|done) / { t = ""; a = ""; s = "";
            for (i = 2; i <= NF; i++) { split($i, kv, "=");
                if (kv[1] == "t") t = kv[2]; if (kv[1] == "acc") a = kv[2];
                if (kv[1] == "step") s = kv[2] }
            printf "%s@%s(%s) ", a, t, s }' "$f"
}

# Sleeps until SECONDS - t0 reaches the first argument (no time left: no sleep).
sleep_until() {
    local left=$(($1 - (SECONDS - t0)))
    [ "$left" -le 0 ] || sleep "$left"
}

# Awk's float comparison, for shell conditions: ge A B is A >= B.
ge() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 >= b + 0) }'; }

baseline() {
    local short="$1" secs=150 eval_every=300 out final
    TRAIN_LOCAL="$BUILD/contrib/examples/train_local"
    [ -x "$TRAIN_LOCAL" ] || die "contrib/examples/train_local was not built"
    [ -d "$DATA_DIR" ] || die "no Fashion-MNIST in $DATA_DIR (package dataset-fashion-mnist)"
    [ "$short" -eq 0 ] || { secs=20; eval_every=150; }
    # One thread, as each trainer of the demo; and OpenBLAS's threads
    # would take SIGTERM, which train_local blocks only in its own thread.
    export OPENBLAS_NUM_THREADS=1
    say "baseline: the same model trained in one process for ${secs} s (experts in-process)"
    echo "train_local --steps 0 --time-limit $secs --eval-every $eval_every"
    out="$("$TRAIN_LOCAL" --data "$DATA_DIR" --steps 0 --time-limit "$secs" \
        --eval-every "$eval_every")" || die "train_local failed"
    grep -E '^(config|eval|done)' <<<"$out"
    final="$(grep '^done ' <<<"$out" | tr ' ' '\n' | sed -n 's/^acc=//p')"
    if [ "$short" -eq 1 ]; then
        ge "${final:-0}" "$ACC_FLOOR" || die "baseline: final accuracy ${final:-none} < $ACC_FLOOR"
        echo "baseline: final accuracy $final >= $ACC_FLOOR"
    fi
}

demo() {
    local short="$1" failures="$2" mode="$3" n i t0 secs kill_at stop_at cont_at join_at
    local -a tr_args=() mode_args=() step_at_fail=()
    local round_word
    local rc final eval_every
    HIVEMINDD="$BUILD/src/hivemindd"
    HIVEMINDCTL="$BUILD/src/hivemindctl"
    TRAINER="$BUILD/contrib/examples/trainer"
    for f in "$HIVEMINDD" "$HIVEMINDCTL" "$TRAINER"; do
        [ -x "$f" ] || die "$f was not built"
    done
    [ -d "$DATA_DIR" ] || die "no Fashion-MNIST in $DATA_DIR (package dataset-fashion-mnist)"

    # Timeline in seconds after the trainers start: how long they train,
    # when a trainer is killed and an expert host stopped, when the host is
    # resumed and when the newcomer joins.
    if [ "$short" -eq 1 ]; then
        secs=60 kill_at=15 stop_at=15 join_at=25 cont_at=40 eval_every=150
    else
        secs=150 kill_at=45 stop_at=45 join_at=70 cont_at=100 eval_every=300
    fi

    # Seven daemons and four trainers share the machine's cores: OpenBLAS
    # threads would only fight over them. (In the trainers they would also
    # take SIGTERM, which the trainers block only in their own threads.)
    export OPENBLAS_NUM_THREADS=1
    DEMO_DIR="$(mktemp -d "${TMPDIR:-/tmp}/hivemindd-demo.XXXXXX")"
    trap cleanup EXIT
    trap 'exit 130' INT TERM

    say "starting the swarm 'quickstart' on 127.0.0.1"
    start_daemon boot
    for i in "${!HOST_GRIDS[@]}"; do
        start_daemon "e$((i + 1))" --initial-peers "${ADDR[boot]}" \
            --host-experts "${HOST_GRIDS[i]}" --expert-dim "$DIM" --checkpoint-interval 30
    done
    for n in t1 t2 t3; do
        start_daemon "$n" --initial-peers "${ADDR[boot]}"
    done

    say "DHT: t1 stores a record, t3 reads it"
    ctl t1 dht put quickstart/greeting "hello from t1" --ttl 600 >/dev/null \
        || fail "hivemindctl dht put failed on t1"
    ctl t3 dht get quickstart/greeting | grep -q "hello from t1" \
        || fail "t3 could not read t1's record"
    echo "t3 read t1's record"

    say "waiting until the trainers' daemons find all 16 experts of $GRID"
    t0=$SECONDS
    while [ "$(experts_seen t1)" -lt 16 ] || [ "$(experts_seen t3)" -lt 16 ]; do
        [ $((SECONDS - t0)) -lt 60 ] || fail "the experts were not declared within 60 s"
        sleep 1
    done
    ctl t1 experts list ffn | head -n 8
    echo "... all 16 found after $((SECONDS - t0)) s"

    # Every trainer: the grid, k_best 4 of 16 experts with k_min 1 (so a
    # stopped host's experts are waited for at most --timeout-after-k-min
    # once one expert answered), its parameters averaged every 50 steps in
    # groups of up to 3, and shared every 50 steps for newcomers.
    # -- quickstart modes -- How the trainers combine their work, and the
    # line each round prints (checked below).
    case "$mode" in
    periodic)
        mode_args=(--average-every 50 --share-every 50)
        round_word=avg ;;
    collaborative)
        # An epoch of 1,024 samples is about 5 steps per trainer; matchmaking
        # starts 2 s before its estimated end.
        mode_args=(--collaborative --target-batch-size 1024 --matchmaking-time 2
                   --averaging-timeout 10 --share-every 50)
        round_word=epoch ;;
    diloco)
        # The newcomer's --load-state loads the outer state that DiLoCo
        # shares after every outer step.
        mode_args=(--diloco --inner-steps 50 --matchmaking-time 2 --averaging-timeout 10)
        round_word=outer ;;
    esac
    tr_args=(--steps 0 --time-limit 3600 --dim "$DIM" --experts 4x4 --k-best 4 --k-min 1 --timeout 3
             --timeout-after-k-min 0.3 --find-every 100 --group-size 3 "${mode_args[@]}"
             --eval-every "$eval_every" --print-every 50)
    say "starting 3 trainers, mode $mode (trainer ${tr_args[*]})"
    for i in 1 2 3; do
        start_trainer "t$i" "${tr_args[@]}" --seed "$i"
    done
    t0=$SECONDS

    if [ "$failures" -eq 1 ]; then
        sleep_until "$kill_at"
        say "t=$((SECONDS - t0)) s: SIGKILL trainer t3, SIGSTOP expert host e2 (experts ffn.*.2-3)"
        for n in t1 t2; do
            step_at_fail[${n#t}]="$(last_field "$DEMO_DIR/$n/trainer.out" train step)"
        done
        kill -KILL "${TPID[t3]}"
        wait "${TPID[t3]}" 2>/dev/null || true
        unset 'TPID[t3]'
        KILLED[t3]=1
        kill -STOP "${DPID[e2]}"
        echo "t1 at step ${step_at_fail[1]:-0}, t2 at step ${step_at_fail[2]:-0}"

        sleep_until "$join_at"
        say "t=$((SECONDS - t0)) s: a newcomer t4 joins and loads the swarm's state"
        start_daemon t4 --initial-peers "${ADDR[boot]}"
        start_trainer t4 "${tr_args[@]}" --seed 4 --load-state --load-timeout 30
        for _ in $(seq 600); do
            grep -q '^load ' "$DEMO_DIR/t4/trainer.out" && break
            is_running "${TPID[t4]}" || break
            sleep 0.1
        done
        grep '^load ' "$DEMO_DIR/t4/trainer.out" || echo "(t4 printed no load line yet)"

        sleep_until "$cont_at"
        say "t=$((SECONDS - t0)) s: SIGCONT expert host e2"
        kill -CONT "${DPID[e2]}"
    fi

    while [ $((SECONDS - t0)) -lt "$secs" ]; do
        sleep 10
        printf 't=%3d s:' $((SECONDS - t0))
        for n in t1 t2 t3 t4; do
            [ -n "${TPID[$n]:-}" ] || continue
            printf '  %s step=%s loss=%s' "$n" \
                "$(last_field "$DEMO_DIR/$n/trainer.out" train step)" \
                "$(last_field "$DEMO_DIR/$n/trainer.out" train loss)"
        done
        printf '\n'
    done

    say "t=$((SECONDS - t0)) s: stopping the trainers with SIGTERM (each evaluates once more)"
    for n in "${!TPID[@]}"; do kill -TERM "${TPID[$n]}" 2>/dev/null || true; done
    declare -A TRC=()
    for n in $(printf '%s\n' "${!TPID[@]}" | sort); do
        rc=0
        # The final evaluation calls the experts for the whole test set.
        for _ in $(seq 600); do is_running "${TPID[$n]}" || break; sleep 0.1; done
        reap "trainer $n" "${TPID[$n]}" || rc=$?
        unset 'TPID[$n]'
        TRC[$n]=$rc
    done
    say "stopping the daemons with SIGTERM"
    for n in "${!DPID[@]}"; do kill -TERM "${DPID[$n]}" 2>/dev/null || true; done
    declare -A DRC=()
    for n in $(printf '%s\n' "${!DPID[@]}" | sort); do
        rc=0
        reap "hivemindd $n" "${DPID[$n]}" || rc=$?
        unset 'DPID[$n]'
        DRC[$n]=$rc
    done
    echo "the expert hosts checkpointed the experts that trained (and again on shutdown):"
    for n in "${!HOST_GRIDS[@]}"; do
        printf '  e%d: %s experts checkpointed in %s\n' $((n + 1)) \
            "$(find "$DEMO_DIR/e$((n + 1))/experts" -name '*.ckpt' -type f 2>/dev/null | wc -l)" \
            "$DEMO_DIR/e$((n + 1))/experts"
    done

    say "summary"
    echo "test accuracy over time, per trainer (accuracy@seconds since its first step (step)):"
    for n in t1 t2 t3 t4; do
        [ -f "$DEMO_DIR/$n/trainer.out" ] || continue
        printf '  %s%s: %s\n' "$n" "${KILLED[$n]:+ (killed at ${kill_at} s)}" \
            "$(acc_series "$DEMO_DIR/$n/trainer.out")"
        [ "$n" != t4 ] || printf '      (t4 joined at %s s)\n' "$join_at"
    done
    echo "averaging rounds, steps skipped (no expert answered), most experts left out at once:"
    for n in t1 t2 t3 t4; do
        [ -f "$DEMO_DIR/$n/trainer.out" ] || continue
        printf '  %s: %d rounds ok, %d failed; %s steps skipped; %s experts left out as silent\n' \
            "$n" \
            "$(grep -c "^$round_word .*status=ok" "$DEMO_DIR/$n/trainer.out" || true)" \
            "$(grep "^$round_word " "$DEMO_DIR/$n/trainer.out" | grep -vc 'status=ok' || true)" \
            "$(last_field "$DEMO_DIR/$n/trainer.out" "done" failed | grep . || echo '?')" \
            "$(grep '^train ' "$DEMO_DIR/$n/trainer.out" | sed -n 's/.*silent=//p' | sort -n \
               | tail -n 1 | grep . || echo 0)"
    done
    if [ "$failures" -eq 1 ]; then
        echo "failures injected: trainer t3 SIGKILLed at ${kill_at} s; expert host e2 SIGSTOPped" \
             "from ${stop_at} s to ${cont_at} s"
        printf '  after them: t1 went from step %s to %s, t2 from step %s to %s\n' \
            "${step_at_fail[1]:-0}" "$(last_field "$DEMO_DIR/t1/trainer.out" "done" step)" \
            "${step_at_fail[2]:-0}" "$(last_field "$DEMO_DIR/t2/trainer.out" "done" step)"
        printf '  newcomer t4 joined at %s s: %s\n' "$join_at" \
            "$(grep '^load ' "$DEMO_DIR/t4/trainer.out" || echo 'no load line')"
    fi

    say "checks"
    for n in $(printf '%s\n' "${!TRC[@]}" | sort); do
        check "trainer $n exited with status 0" [ "${TRC[$n]}" -eq 0 ]
    done
    for n in $(printf '%s\n' "${!DRC[@]}" | sort); do
        check "hivemindd $n exited with status 0" [ "${DRC[$n]}" -eq 0 ]
    done
    for n in t1 t2; do
        final="$(last_field "$DEMO_DIR/$n/trainer.out" "done" acc)"
        check "trainer $n's final test accuracy ${final:-none} >= $ACC_FLOOR" ge "${final:-0}" "$ACC_FLOOR"
    done
    for n in t1 t2; do
        check "trainer $n averaged with the others (an ok '$round_word' round)" \
            grep -q "^$round_word .*status=ok" "$DEMO_DIR/$n/trainer.out"
    done
    if [ "$failures" -eq 1 ]; then
        for i in 1 2; do
            check "trainer t$i kept training after the failures (step ${step_at_fail[i]:-0} -> $(last_field "$DEMO_DIR/t$i/trainer.out" "done" step))" \
                ge "$(last_field "$DEMO_DIR/t$i/trainer.out" "done" step)" $((${step_at_fail[i]:-0} + 100))
        done
        final="$(last_field "$DEMO_DIR/t4/trainer.out" load acc)"
        check "newcomer t4 loaded the swarm's state: accuracy ${final:-none} right after loading >= $NEWCOMER_FLOOR" \
            ge "${final:-0}" "$NEWCOMER_FLOOR"
        check "newcomer t4 loaded it (status ok)" \
            [ "$(last_field "$DEMO_DIR/t4/trainer.out" load status)" = ok ]
        if [ "$mode" = collaborative ]; then
            # The survivors and the newcomer stay in one swarm epoch after a
            # trainer died: the newcomer's epochs end averaged with theirs.
            check "newcomer t4 averaged with the others (an ok '$round_word' round)" \
                grep -q "^$round_word .*status=ok" "$DEMO_DIR/t4/trainer.out"
        fi
    fi
    if [ "$CHECKS_FAILED" -ne 0 ]; then
        if [ "$short" -eq 1 ]; then
            HM_KEEP_DEMO=1
            fail "a check failed (logs kept in $DEMO_DIR)"
        fi
        echo "(a check failed; only --short makes that fatal)"
    fi
    say "demo finished"
}

# ---- main -----------------------------------------------------------------

main() {
    local cmd="${1:-}" short=0 failures=1 mode=periodic arg
    case "$cmd" in
    demo | baseline)
        shift
        while [ $# -gt 0 ]; do
            arg="$1"
            shift
            case "$arg" in
            --short) short=1 ;;
            --no-failures) [ "$cmd" = demo ] || { usage >&2; exit 64; }; failures=0 ;;
            --mode | --mode=*)
                [ "$cmd" = demo ] || { usage >&2; exit 64; }
                if [ "$arg" = --mode ]; then
                    [ $# -gt 0 ] || { echo "quickstart: --mode needs a value" >&2; exit 64; }
                    mode="$1"
                    shift
                else
                    mode="${arg#--mode=}"
                fi
                case "$mode" in
                periodic | collaborative | diloco) ;;
                *) echo "quickstart: --mode '$mode': periodic, collaborative or diloco" >&2
                   exit 64 ;;
                esac
                ;;
            *) usage >&2; exit 64 ;;
            esac
        done
        if [ -z "${HM_NO_SETUP:-}" ]; then
            check_packages
            build
        fi
        if [ "$cmd" = baseline ]; then
            baseline "$short"
            return
        fi
        # The full demo first shows what one process reaches alone.
        [ "$short" -eq 1 ] || baseline 0
        demo "$short" "$failures" "$mode"
        ;;
    test)
        [ $# -eq 1 ] || { usage >&2; exit 64; }
        check_packages
        build
        run_tests
        ;;
    -h | --help)
        usage
        ;;
    *)
        usage >&2
        exit 64
        ;;
    esac
}

main "$@"

#!/usr/bin/env bash
# swarm_view_test.sh: the swarm as a person sees it. A real swarm of five
# hivemindd processes on 127.0.0.1 (four host experts of the grid "tg");
# the first serves HTTP. Then:
#   - `hivemindctl top` runs in a tmux pane of 80 columns, and capture-pane
#     must show all five nodes up and the eight experts, and q must end it;
#   - headless Chromium (playwright-core) loads the page from the first
#     node: it must list the five nodes and the eight experts with their
#     hosts, and when one node is killed, mark that node down and count
#     4 up of 5 without a reload. HM_SCREENSHOT=FILE saves the page.
# Each part skips, with its reason, when its tool is missing (tmux; node,
# chromium and playwright-core: HM_NODE_PATH names a node_modules holding
# it); exit 77 when both are skipped.
#
#   HM_SRCDIR=.. HM_BUILDDIR=. bash ../tests/swarm_view_test.sh
set -euo pipefail

SRC="${HM_SRCDIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
BUILD="${HM_BUILDDIR:-.}"
BUILD="$(cd "$BUILD" && pwd)"
D="$BUILD/src/hivemindd"
C="$BUILD/src/hivemindctl"
for f in "$D" "$C"; do
    [ -x "$f" ] || { echo "swarm_view_test: $f is not built; skipping"; exit 77; }
done

have_tmux=1
command -v tmux >/dev/null 2>&1 || { have_tmux=0; echo "swarm_view_test: no tmux: skipping the top part"; }
have_browser=1
CHROMIUM="${HM_CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}"
if ! command -v node >/dev/null 2>&1; then
    have_browser=0; echo "swarm_view_test: no node: skipping the browser part"
elif [ -z "$CHROMIUM" ]; then
    have_browser=0; echo "swarm_view_test: no chromium: skipping the browser part"
else
    export NODE_PATH="${HM_NODE_PATH:-}${HM_NODE_PATH:+:}$BUILD/node_modules:$SRC/node_modules"
    if ! node -e 'require.resolve("playwright-core")' >/dev/null 2>&1; then
        have_browser=0
        echo "swarm_view_test: no playwright-core (npm install --prefix DIR playwright-core;" \
             "HM_NODE_PATH=DIR/node_modules): skipping the browser part"
    fi
fi
[ $have_tmux = 1 ] || [ $have_browser = 1 ] || exit 77

T="$(mktemp -d /tmp/hm-swarmview.XXXXXX)"
TMUX_SESSION="hm-top-$$"
PIDS=()
cleanup() {
    [ $have_tmux = 1 ] && tmux kill-session -t "$TMUX_SESSION" >/dev/null 2>&1 || true
    for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$T"
}
trap cleanup EXIT

start() { # name, extra flags...
    local n=$1
    shift
    "$D" --listen 127.0.0.1:0 --state-dir "$T/$n" --control-socket "$T/$n.sock" \
        --ping-interval 1 "$@" >"$T/$n.out" 2>"$T/$n.err" &
    PIDS+=($!)
    for _ in $(seq 100); do
        [ -s "$T/$n.out" ] && return 0
        sleep 0.1
    done
    echo "swarm_view_test: $n did not start:"; cat "$T/$n.err"; exit 1
}

start n0 --http-listen 127.0.0.1:0 --status-grids tg
FIRST="$(head -n 1 "$T/n0.out")"
for i in 1 2 3 4; do
    start "n$i" --initial-peers "$FIRST" --host-experts "tg.[0:2].[$i:$((i + 1))]" --expert-dim 8
done
VICTIM_PID="${PIDS[3]}"                      # n3
VICTIM_ID="$(head -n 1 "$T/n3.out" | cut -d@ -f1)"
HTTP="$("$C" -s "$T/n0.sock" --json info | sed -n 's/.*"http":"\([^"]*\)".*/\1/p')"
[ -n "$HTTP" ] || { echo "swarm_view_test: no HTTP address in info"; exit 1; }

# Every summary in the DHT and every expert declared: the swarm is ready.
for _ in $(seq 120); do
    s="$("$C" -s "$T/n0.sock" status 2>/dev/null || true)"
    ups="$(grep -c ' up ' <<<"$s" || true)"
    xs="$(grep -c '^tg\.' <<<"$s" || true)"
    [ "$ups" -ge 5 ] && [ "$xs" -ge 8 ] && break
    sleep 0.5
done
[ "$ups" -ge 5 ] && [ "$xs" -ge 8 ] || { echo "swarm_view_test: the swarm did not form:"; echo "$s"; exit 1; }

# /metrics is valid Prometheus text (promtool of the prometheus package).
if command -v promtool >/dev/null 2>&1 && command -v curl >/dev/null 2>&1; then
    curl -sf "http://$HTTP/metrics" >"$T/metrics.txt"
    grep -q '^hivemindd_expert_forward_requests_total{uid="tg.0.1"}' "$T/metrics.txt" ||
        grep -q '^process_open_fds ' "$T/metrics.txt" ||
        { echo "swarm_view_test: /metrics lacks its families"; exit 1; }
    if ! promtool check metrics <"$T/metrics.txt" >"$T/promtool.out" 2>&1; then
        echo "swarm_view_test: promtool check metrics failed:"; cat "$T/promtool.out"; exit 1
    fi
    echo "swarm_view_test: promtool check metrics: ok"
else
    echo "swarm_view_test: no promtool or curl: skipping the metrics lint"
fi

if [ $have_tmux = 1 ]; then
    # The pane runs top in the foreground (its pid written first), then
    # records the terminal's mode once top is gone: raw mode must be undone.
    top_pane() { # name
        tmux new-session -d -s "$TMUX_SESSION" -x 80 -y 40 \
            "bash -c 'echo \$\$ >$T/top.pid; exec $C -s $T/n0.sock top'; echo TOP-EXIT \$? >$T/$1.exit; stty -a >$T/$1.stty; sleep 30"
    }
    tty_restored() { # name
        for _ in $(seq 50); do [ -s "$T/$1.stty" ] && break; sleep 0.1; done
        tr ' ;' '\n\n' <"$T/$1.stty" | grep -qx icanon && tr ' ;' '\n\n' <"$T/$1.stty" | grep -qx echo
    }
    top_pane q
    ok=0
    for _ in $(seq 50); do
        pane="$(tmux capture-pane -p -t "$TMUX_SESSION")"
        if [ "$(grep -c ' up ' <<<"$pane")" -ge 5 ] && [ "$(grep -c '^tg\.' <<<"$pane")" -ge 8 ] &&
            grep -q 'nodes 5 up of 5' <<<"$pane"; then
            ok=1
            break
        fi
        sleep 0.2
    done
    [ $ok = 1 ] || { echo "swarm_view_test: top did not show the swarm:"; echo "$pane"; exit 1; }
    # Nothing wider than 80 columns.
    if awk 'length > 80 { bad = 1 } END { exit !bad }' <<<"$pane"; then
        echo "swarm_view_test: top drew past 80 columns"; exit 1
    fi
    tmux send-keys -t "$TMUX_SESSION" q
    tty_restored q || { echo "swarm_view_test: the terminal stayed raw after q:"; cat "$T/q.stty" 2>/dev/null; exit 1; }
    grep -q 'TOP-EXIT 0' "$T/q.exit" || { echo "swarm_view_test: top did not exit 0 on q:"; cat "$T/q.exit"; exit 1; }
    tmux kill-session -t "$TMUX_SESSION"
    # SIGTERM: the mode is restored too, and top dies of the signal.
    rm -f "$T/top.pid"
    top_pane term
    for _ in $(seq 50); do
        [ -s "$T/top.pid" ] && tmux capture-pane -p -t "$TMUX_SESSION" | grep -q 'nodes 5 up of 5' && break
        sleep 0.2
    done
    kill -TERM "$(cat "$T/top.pid")"
    tty_restored term || { echo "swarm_view_test: the terminal stayed raw after SIGTERM:"; cat "$T/term.stty" 2>/dev/null; exit 1; }
    grep -q 'TOP-EXIT 143' "$T/term.exit" || { echo "swarm_view_test: top did not die of SIGTERM:"; cat "$T/term.exit"; exit 1; }
    tmux kill-session -t "$TMUX_SESSION"
    echo "swarm_view_test: top shows the swarm in 80 columns; q and SIGTERM restore the terminal"
fi

if [ $have_browser = 1 ]; then
    HM_URL="http://$HTTP/" HM_VICTIM_PID="$VICTIM_PID" HM_VICTIM_ID="$VICTIM_ID" \
        HM_CHROMIUM="$CHROMIUM" timeout 60 node "$SRC/tests/swarm_page.js"
fi

# Every node still running stops cleanly (exit 0; under ASan, no report).
for i in "${!PIDS[@]}"; do
    p=${PIDS[$i]}
    [ "$p" = "$VICTIM_PID" ] && [ $have_browser = 1 ] && continue
    kill -TERM "$p"
    rc=0
    wait "$p" || rc=$?
    if [ $rc -ne 0 ]; then
        echo "swarm_view_test: n$i exited $rc on SIGTERM:"; tail -40 "$T/n$i.err"; exit 1
    fi
done
PIDS=()
echo "swarm_view_test: ok"

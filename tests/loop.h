/*
 * loop: running a libuv loop in tests until a condition holds. Each test
 * binary that drives in-process nodes includes it once.
 */
#ifndef HM_TEST_LOOP_H
#define HM_TEST_LOOP_H

#include <criterion/criterion.h>
#include <signal.h>
#include <uv.h>

#include "src/node/node.h"
#include "src/base/util.h"

typedef int (*hm_test_pred)(void *ud);

static inline void hm_test_on_tick(uv_timer_t *t) { HM_UNUSED(t); }

/*
 * Runs the loop until pred(ud) holds or timeout_ms passes and returns
 * pred's last value. A short timer wakes the loop, so that a predicate
 * about time, or one no I/O event changes, is still checked.
 */
static inline int hm_test_run_until(uv_loop_t *loop, hm_test_pred pred, void *ud,
                                    uint64_t timeout_ms)
{
    uint64_t end = hm_now_ms() + timeout_ms;
    while (!pred(ud) && hm_now_ms() < end) {
        uv_timer_t t;
        uv_timer_init(loop, &t);
        uv_timer_start(&t, hm_test_on_tick, 10, 0);
        uv_run(loop, UV_RUN_ONCE);
        uv_close((uv_handle_t *)&t, NULL);
        uv_run(loop, UV_RUN_NOWAIT);
    }
    return pred(ud);
}

/*
 * A node for in-process swarms listening on `listen` ("HOST:PORT"), joining
 * through peer (an address, or NULL for the first node), pinging every
 * ping_ms. Swarm nodes share addresses, so the DHT's per-address rate limit
 * is lifted: the tests would otherwise measure the limiter, not the
 * protocol.
 */
static inline hm_node *hm_test_make_node_on(uv_loop_t *loop, const char *swarm, const char *listen,
                                            const char *peer, uint64_t ping_ms)
{
    hm_node_options o = {0};
    const char *peers[1] = {peer};
    /* As node.h says, the process must ignore SIGPIPE: a peer that closes
     * while a write is in flight would otherwise kill the test. */
    signal(SIGPIPE, SIG_IGN);
    o.listen = listen;
    o.swarm = swarm;
    o.ping_interval_ms = ping_ms;
    o.dht.rate_per_s = 1e6;
    o.dht.rate_burst = 1e6;
    if (peer != NULL) {
        o.initial_peers = peers;
        o.n_initial_peers = 1;
    }
    hm_node *n = NULL;
    char err[256] = "";
    int r = hm_node_new(loop, &o, &n, err, sizeof(err));
    cr_assert_eq(r, 0, "hm_node_new: %s", err);
    return n;
}

/* The same on 127.0.0.1, pinging every second. */
static inline hm_node *hm_test_make_node(uv_loop_t *loop, const char *swarm, const char *peer)
{
    return hm_test_make_node_on(loop, swarm, "127.0.0.1:0", peer, 1000);
}

#endif

/*
 * loop: running a libuv loop in tests until a condition holds. Each test
 * binary that drives in-process nodes includes it once.
 */
#ifndef HM_TEST_LOOP_H
#define HM_TEST_LOOP_H

#include <uv.h>

#include "util.h"

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

#endif

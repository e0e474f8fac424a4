/*
 * test_moe_client: the expert client against real expert servers on
 * in-process nodes over 127.0.0.1: lookup, beam search over a sparse grid,
 * forward/backward checked against the experts' own math (an ffn loaded
 * from the server's checkpoint), k_min / timeout semantics with a stalled
 * node and a closed one, hostile replies, cancellation, freeing with calls
 * in flight, the mixture's softmax, and which owner's declaration of a uid
 * is believed (a day-long or a newcomer's declaration does not take a held
 * uid; an allow-list; a holder that leaves passes the uid on), servers'
 * refusals reaching the caller with their reason, stalled hosts
 * skipped for a back-off, then probed, and per-sample routing (every
 * sample's brute-force top k from one batched walk, one request per
 * expert with its rows, outputs and gradients per slot equal to the
 * experts' own math, k_min per sample, the routed mixture).
 */
#include "config.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/checkpoint.h"
#include "moe/client.h"
#include "moe/ffn.h"
#include "tests/helpers.h"
#include "tests/loop.h"
#include "moe/proto.h"
#include "moe/server.h"
#include "src/base/util.h"
#include "src/base/wire.h"

#define SWARM "moe-client-test"
#define DIM 16
#define HIDDEN 32
#define MAXN 5

typedef struct swarm {
    uv_loop_t loop;
    size_t n;
    hm_node *nodes[MAXN];
    hm_moe_server *servers[MAXN];
    char dirs[MAXN][64];
    hm_moe_client *client; /* on nodes[0], which hosts nothing */
    int closed;
} swarm;

static int never(void *ud)
{
    HM_UNUSED(ud);
    return 0;
}

static void run_for(uv_loop_t *loop, uint64_t ms) { hm_test_run_until(loop, never, NULL, ms); }

static int dht_ready(void *ud)
{
    swarm *sw = ud;
    for (size_t i = 0; i < sw->n; i++)
        if (hm_rt_size(hm_dht_routing(hm_node_dht(sw->nodes[i]))) < sw->n - 1)
            return 0;
    return 1;
}

static void swarm_start(swarm *sw, size_t n)
{
    char addr[256];
    memset(sw, 0, sizeof(*sw));
    /* As in hivemindd: nodes here close connections to each other, and a
     * write to a peer that just closed must fail with EPIPE, not kill the
     * process. */
    signal(SIGPIPE, SIG_IGN);
    hm_log_set_level(getenv("HM_TEST_DEBUG") != NULL ? HM_LOG_DEBUG : HM_LOG_ERROR);
    cr_assert_eq(uv_loop_init(&sw->loop), 0);
    sw->n = n;
    for (size_t i = 0; i < n; i++) {
        sw->nodes[i] = hm_test_make_node(&sw->loop, SWARM, i == 0 ? NULL : addr);
        if (i == 0)
            cr_assert_eq(hm_node_address(sw->nodes[0], addr, sizeof(addr)), 0);
    }
    cr_assert(hm_test_run_until(&sw->loop, dht_ready, sw, 10000), "the DHT did not come up");
    cr_assert_eq(hm_moe_client_new(sw->nodes[0], &sw->client), 0);
}

static hm_ffn_config expert_cfg(void)
{
    hm_ffn_config c = {0};
    c.dim = DIM;
    c.hidden = HIDDEN;
    c.optimizer = HM_FFN_SGD;
    /* A step this small leaves every parameter as it was (to well below
     * the tolerances here), so that the checkpoint written after a
     * backward call still describes the expert that answered it. */
    c.lr = 1e-30;
    c.seed = 7;
    return c;
}

/* Starts an expert server on node i (with a state directory) hosting the
 * given patterns. */
static void host(swarm *sw, size_t i, const char *const *patterns, size_t n_patterns)
{
    char err[256] = "";
    hm_ffn_config cfg = expert_cfg();
    if (sw->servers[i] == NULL) {
        hm_moe_server_opts o = {0};
        cr_assert_eq(hm_test_mkdtemp(sw->dirs[i], sizeof(sw->dirs[i]), "moecl"), 0);
        o.state_dir = sw->dirs[i];
        o.workers = 1;
        o.batch_wait_ms = 1;
        cr_assert_eq(hm_moe_server_new(sw->nodes[i], &o, &sw->servers[i]), 0);
    }
    for (size_t p = 0; p < n_patterns; p++) {
        size_t added = 0;
        int r = hm_moe_server_host(sw->servers[i], patterns[p], "ffn", &cfg, &added, err,
                                   sizeof(err));
        cr_assert_eq(r, 0, "host %s: %s", patterns[p], err);
    }
}

static void on_closed(void *ud) { ++*(int *)ud; }

static int count_is(void *ud) { return ((int *)ud)[0] >= ((int *)ud)[1]; }

/* Closes node i's server and the node itself (a peer that goes away). */
static void close_node(swarm *sw, size_t i)
{
    int cnt[2] = {0, 0};
    if (sw->servers[i] != NULL) {
        hm_moe_server_close(sw->servers[i], 0, on_closed, cnt);
        sw->servers[i] = NULL;
        cnt[1]++;
    }
    hm_node_close(sw->nodes[i], on_closed, cnt);
    cnt[1]++;
    sw->nodes[i] = NULL;
    cr_assert(hm_test_run_until(&sw->loop, count_is, cnt, 10000), "node %zu did not close", i);
}

static void set_stall(swarm *sw, size_t i, int stall)
{
    hm_transport_faults f = {0};
    f.stall = stall;
    hm_transport_set_faults(hm_rpc_transport(hm_node_rpc(sw->nodes[i])), &f);
}

static void swarm_stop(swarm *sw)
{
    if (sw->client != NULL)
        hm_moe_client_free(sw->client);
    for (size_t i = 0; i < sw->n; i++) {
        if (sw->nodes[i] != NULL) {
            set_stall(sw, i, 0);
            close_node(sw, i);
        }
        if (sw->dirs[i][0] != '\0')
            hm_test_rmtree(sw->dirs[i]);
    }
    uv_run(&sw->loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&sw->loop), 0, "handles left open after close");
}

/* ------------------------------------------------------------ callbacks */

typedef struct findres {
    int calls;
    int status;
    hm_moe_expert ex[HM_MOE_MAX_K];
    size_t n;
} findres;

static void on_find(void *ud, int status, const hm_moe_expert *ex, size_t n)
{
    findres *f = ud;
    f->calls++;
    f->status = status;
    f->n = n;
    cr_assert_leq(n, (size_t)HM_MOE_MAX_K);
    if (n > 0)
        memcpy(f->ex, ex, n * sizeof(*ex));
}

static int find_done(void *ud) { return ((findres *)ud)->calls > 0; }

typedef struct callres {
    int calls;
    int status;
    size_t k;
    uint8_t answered[HM_MOE_MAX_K];
    size_t n_answered;
    uint64_t start_ms, done_ms;
} callres;

static void on_call(void *ud, int status, const uint8_t *answered, size_t n_answered)
{
    callres *c = ud;
    c->calls++;
    c->status = status;
    c->n_answered = n_answered;
    c->done_ms = hm_now_ms();
    cr_assert_not_null(answered);
    memcpy(c->answered, answered, c->k);
    size_t cnt = 0;
    for (size_t e = 0; e < c->k; e++)
        cnt += answered[e] != 0;
    cr_assert_eq(cnt, n_answered);
}

static int call_done(void *ud) { return ((callres *)ud)->calls > 0; }

/* Looks a uid up until the declaration has reached the DHT. */
static hm_moe_expert lookup_wait(swarm *sw, const char *uid)
{
    uint64_t end = hm_now_ms() + 15000;
    findres f;
    do {
        memset(&f, 0, sizeof(f));
        cr_assert_eq(hm_moe_lookup(sw->client, uid, 2000, on_find, &f), 0);
        cr_assert_eq(f.calls, 0, "the callback fired inside hm_moe_lookup");
        cr_assert(hm_test_run_until(&sw->loop, find_done, &f, 5000));
        if (f.status == 0)
            break;
        run_for(&sw->loop, 200);
    } while (hm_now_ms() < end);
    cr_assert_eq(f.status, 0, "lookup %s: %s", uid, hm_strerror(f.status));
    cr_assert_eq(f.n, 1u);
    cr_assert_str_eq(f.ex[0].uid, uid);
    return f.ex[0];
}

/* HOST:PORT of node i. */
static void host_port(swarm *sw, size_t i, char *buf, size_t len)
{
    char a[256];
    cr_assert_eq(hm_node_address(sw->nodes[i], a, sizeof(a)), 0);
    const char *at = strchr(a, '@');
    cr_assert_not_null(at);
    snprintf(buf, len, "%s", at + 1);
}

/* An ffn with node i's expert uid as its server has it (from a checkpoint
 * written now). */
static hm_ffn *load_expert(swarm *sw, size_t i, const char *uid)
{
    char path[512];
    uint8_t *buf = NULL;
    size_t len = 0;
    hm_ffn *f = NULL;
    snprintf(path, sizeof(path), "%s/experts/%s.ckpt", sw->dirs[i], uid);
    cr_assert_eq(hm_ckpt_read(path, (size_t)1 << 26, &buf, &len, NULL), 0, "no checkpoint %s",
                 path);
    hm_ffn_config cfg = expert_cfg();
    cr_assert_eq(hm_ffn_load(buf, len, &cfg, &f), 0);
    free(buf);
    return f;
}

static void fill(float *v, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        v[i] = (float)sin(0.37 * (double)(i + 1) * (seed + 1)) * 1.5f;
}

static void assert_close(const float *a, const float *b, size_t n, double tol, const char *what)
{
    for (size_t i = 0; i < n; i++)
        cr_assert(fabs((double)a[i] - (double)b[i]) <= tol * (1.0 + fabs((double)b[i])),
                  "%s[%zu]: %g vs %g", what, i, (double)a[i], (double)b[i]);
}

/* ---------------------------------------------------------------- tests */

Test(moe_client, lookup_finds_hosted_and_enoent)
{
    swarm sw;
    swarm_start(&sw, 3);
    const char *pats[] = {"ffn.[0:2].[0:2]"};
    host(&sw, 1, pats, 1);

    hm_moe_expert ex = lookup_wait(&sw, "ffn.1.0");
    char hp[128];
    host_port(&sw, 1, hp, sizeof(hp));
    cr_assert_str_eq(ex.addr_str, hp);
    cr_assert_eq(memcmp(ex.pk, hm_node_identity(sw.nodes[1])->pk, HM_PK_BYTES), 0);
    struct sockaddr_storage want;
    cr_assert_eq(hm_parse_hostport(hp, &want), 0);
    cr_assert(hm_addr_equal((const struct sockaddr *)&ex.addr, (const struct sockaddr *)&want));

    /* Inside the grid but not hosted, and outside it: both absent. */
    const char *absent[] = {"ffn.1.3", "ffn.7.7"};
    for (size_t i = 0; i < 2; i++) {
        findres f = {0};
        cr_assert_eq(hm_moe_lookup(sw.client, absent[i], 3000, on_find, &f), 0);
        cr_assert(hm_test_run_until(&sw.loop, find_done, &f, 6000));
        cr_assert_eq(f.calls, 1);
        cr_assert_eq(f.status, -ENOENT, "%s: %s", absent[i], hm_strerror(f.status));
        cr_assert_eq(f.n, 0u);
    }
    findres f = {0};
    cr_assert_eq(hm_moe_lookup(sw.client, "not a uid", 1000, on_find, &f), -EINVAL);
    cr_assert_eq(hm_moe_lookup(sw.client, "ffn", 1000, on_find, &f), -EINVAL);
    run_for(&sw.loop, 50);
    cr_assert_eq(f.calls, 0);
    swarm_stop(&sw);
}

/* The sparse grid of the beam search test: ffn.[0:4].[0:4] without
 * ffn.0.3, ffn.1.0, ffn.2.2 and ffn.3.0 / ffn.3.1, across three nodes. */
static const char *const grid_node1[] = {"ffn.0.[0:3]", "ffn.1.[1:3]"};
static const char *const grid_node2[] = {"ffn.1.3", "ffn.2.[0:2]", "ffn.2.3"};
static const char *const grid_node3[] = {"ffn.3.[2:4]"};

static int grid_hosted(unsigned i, unsigned j)
{
    if (i == 0)
        return j != 3;
    if (i == 1)
        return j != 0;
    if (i == 2)
        return j != 2;
    return j >= 2;
}

typedef struct scored {
    char uid[32];
    double s;
} scored;

static int scored_cmp(const void *a, const void *b)
{
    const scored *x = a, *y = b;
    return x->s < y->s ? 1 : x->s > y->s ? -1 : 0;
}

/* The expected top k: every hosted uid with j < cols, by summed score. */
static size_t expect_top(const double *s0, const double *s1, unsigned cols, size_t k,
                         scored *out)
{
    scored all[16];
    size_t n = 0;
    for (unsigned i = 0; i < 4; i++)
        for (unsigned j = 0; j < cols; j++)
            if (grid_hosted(i, j)) {
                snprintf(all[n].uid, sizeof(all[n].uid), "ffn.%u.%u", i, j);
                all[n].s = s0[i] + s1[j];
                n++;
            }
    qsort(all, n, sizeof(*all), scored_cmp);
    n = HM_MIN(n, k);
    memcpy(out, all, n * sizeof(*out));
    return n;
}

static void beam(swarm *sw, const double *s0, const double *s1, size_t cols, size_t k,
                 size_t beam_size, findres *f)
{
    const double *scores[2] = {s0, s1};
    size_t sizes[2] = {4, cols};
    memset(f, 0, sizeof(*f));
    cr_assert_eq(hm_moe_beam_search(sw->client, "ffn", scores, sizes, 2, k, beam_size, 5000,
                                    on_find, f),
                 0);
    cr_assert_eq(f->calls, 0, "the callback fired inside hm_moe_beam_search");
    cr_assert(hm_test_run_until(&sw->loop, find_done, f, 10000));
    cr_assert_eq(f->calls, 1);
}

static void assert_top(swarm *sw, const findres *f, const scored *want, size_t n_want)
{
    cr_assert_eq(f->status, 0, "beam search: %s", hm_strerror(f->status));
    cr_assert_eq(f->n, n_want);
    for (size_t e = 0; e < n_want; e++) {
        cr_assert_str_eq(f->ex[e].uid, want[e].uid, "rank %zu", e);
        cr_assert_float_eq(f->ex[e].score, want[e].s, 1e-9);
        unsigned i = (unsigned)(f->ex[e].uid[4] - '0');
        unsigned j = (unsigned)(f->ex[e].uid[6] - '0');
        size_t owner = i == 0 || (i == 1 && j < 3) ? 1 : i == 3 ? 3 : 2;
        char hp[128];
        host_port(sw, owner, hp, sizeof(hp));
        cr_assert_str_eq(f->ex[e].addr_str, hp, "%s", f->ex[e].uid);
        cr_assert_eq(memcmp(f->ex[e].pk, hm_node_identity(sw->nodes[owner])->pk, HM_PK_BYTES),
                     0);
    }
}

Test(moe_client, beam_search_sparse_grid)
{
    swarm sw;
    swarm_start(&sw, 4);
    host(&sw, 1, (const char *const *)grid_node1, HM_ARRAY_LEN(grid_node1));
    host(&sw, 2, (const char *const *)grid_node2, HM_ARRAY_LEN(grid_node2));
    host(&sw, 3, (const char *const *)grid_node3, HM_ARRAY_LEN(grid_node3));

    /* Distinct sums; the best row (3) and column (3) each miss some
     * experts, so the best prefix alone does not give the answer. */
    const double s0[4] = {0.5, -1.25, 0.0625, 2.0};
    const double s1[4] = {1.0, 0.375, -0.75, 3.0};
    scored want[16];
    findres f;

    /* Wait for every declaration (11 experts) to be visible. */
    uint64_t end = hm_now_ms() + 20000;
    do {
        beam(&sw, s0, s1, 4, 16, 4, &f);
        if (f.status == 0 && f.n == 11)
            break;
        run_for(&sw.loop, 300);
    } while (hm_now_ms() < end);
    size_t nw = expect_top(s0, s1, 4, 16, want);
    cr_assert_eq(nw, 11u);
    assert_top(&sw, &f, want, nw);

    /* Top 3 with a beam as wide as the grid: exactly the best three. */
    beam(&sw, s0, s1, 4, 3, 4, &f);
    nw = expect_top(s0, s1, 4, 3, want);
    assert_top(&sw, &f, want, nw);

    /* Other scores: the order follows them. */
    const double t0[4] = {-3.0, 1.5, 0.25, 0.125};
    const double t1[4] = {0.5, 2.5, -0.5, -2.0};
    beam(&sw, t0, t1, 4, 5, 4, &f);
    nw = expect_top(t0, t1, 4, 5, want);
    assert_top(&sw, &f, want, nw);

    /* A grid narrower than what is declared: column 3 is ignored. */
    beam(&sw, s0, s1, 3, 4, 4, &f);
    nw = expect_top(s0, s1, 3, 4, want);
    assert_top(&sw, &f, want, nw);
    for (size_t e = 0; e < f.n; e++)
        cr_assert_neq(f.ex[e].uid[6], '3');

    /* No such grid at all. */
    const double *sc[2] = {s0, s1};
    size_t sizes[2] = {4, 4};
    memset(&f, 0, sizeof(f));
    cr_assert_eq(hm_moe_beam_search(sw.client, "nope", sc, sizes, 2, 3, 0, 3000, on_find, &f),
                 0);
    cr_assert(hm_test_run_until(&sw.loop, find_done, &f, 6000));
    cr_assert_eq(f.status, -ENOENT);
    cr_assert_eq(f.n, 0u);

    /* Bad arguments fail at once and never call back. */
    double bad[4] = {0, NAN, 0, 0};
    const double *badsc[2] = {s0, bad};
    cr_assert_eq(hm_moe_beam_search(sw.client, "ffn", badsc, sizes, 2, 3, 0, 1000, on_find, &f),
                 -EINVAL);
    cr_assert_eq(hm_moe_beam_search(sw.client, "ffn", sc, sizes, 0, 3, 0, 1000, on_find, &f),
                 -EINVAL);
    cr_assert_eq(hm_moe_beam_search(sw.client, "ffn", sc, sizes, 2, 0, 0, 1000, on_find, &f),
                 -EINVAL);
    cr_assert_eq(hm_moe_beam_search(sw.client, "f.n", sc, sizes, 2, 3, 0, 1000, on_find, &f),
                 -EINVAL);
    swarm_stop(&sw);
}

static const char *const fb_uids[4] = {"ffn.0.0", "ffn.0.1", "ffn.1.0", "ffn.1.1"};

Test(moe_client, forward_and_backward_match_experts)
{
    swarm sw;
    swarm_start(&sw, 3);
    const char *p1[] = {"ffn.0.[0:2]"};
    const char *p2[] = {"ffn.1.[0:2]"};
    host(&sw, 1, p1, 1);
    host(&sw, 2, p2, 1);
    hm_moe_expert ex[4];
    for (size_t e = 0; e < 4; e++)
        ex[e] = lookup_wait(&sw, fb_uids[e]);

    enum { B = 3 };
    float x[B * DIM], y[4 * B * DIM], gy[4 * B * DIM], gx[4 * B * DIM];
    fill(x, B * DIM, 1);
    fill(gy, 4 * B * DIM, 2);
    for (size_t i = 0; i < 4 * B * DIM; i++)
        y[i] = gx[i] = NAN;

    hm_moe_call_opts o = {.k_min = 4, .timeout_ms = 10000, .timeout_after_k_min_ms = 0};
    callres c = {.k = 4};
    uint64_t id = 0;
    cr_assert_eq(hm_moe_forward(sw.client, ex, 4, x, B, DIM, y, &o, on_call, &c, &id), 0);
    cr_assert_eq(c.calls, 0);
    cr_assert(hm_test_run_until(&sw.loop, call_done, &c, 12000));
    cr_assert_eq(c.status, 0, "forward: %s", hm_strerror(c.status));
    cr_assert_eq(c.n_answered, 4u);

    callres cb = {.k = 4};
    cr_assert_eq(hm_moe_backward(sw.client, ex, 4, x, gy, B, DIM, gx, &o, on_call, &cb, &id), 0);
    cr_assert_eq(cb.calls, 0);
    cr_assert(hm_test_run_until(&sw.loop, call_done, &cb, 12000));
    cr_assert_eq(cb.status, 0, "backward: %s", hm_strerror(cb.status));
    cr_assert_eq(cb.n_answered, 4u);
    run_for(&sw.loop, 100);
    cr_assert_eq(c.calls, 1);
    cr_assert_eq(cb.calls, 1);

    /* Each block is what that expert computes: compare with the expert
     * itself, read back from its server's checkpoint. */
    cr_assert_eq(hm_moe_server_checkpoint(sw.servers[1]), 0);
    cr_assert_eq(hm_moe_server_checkpoint(sw.servers[2]), 0);
    for (size_t e = 0; e < 4; e++) {
        hm_ffn *f = load_expert(&sw, e < 2 ? 1 : 2, fb_uids[e]);
        float ly[B * DIM], lgx[B * DIM];
        cr_assert_eq(hm_ffn_forward(f, x, B, ly), 0);
        cr_assert_eq(hm_ffn_grad(f, x, gy + e * B * DIM, B, lgx, NULL), 0);
        assert_close(y + e * B * DIM, ly, B * DIM, 1e-4, fb_uids[e]);
        assert_close(gx + e * B * DIM, lgx, B * DIM, 1e-4, fb_uids[e]);
        hm_ffn_free(f);
    }
    /* The experts differ, so a block in the wrong place would show. */
    cr_assert_neq(memcmp(y, y + B * DIM, sizeof(float) * B * DIM), 0);

    /* Bad sizes or options: -EINVAL and no callback. */
    callres bad = {.k = 4};
    hm_moe_call_opts o0 = o;
    o0.k_min = 5;
    cr_assert_eq(hm_moe_forward(sw.client, ex, 4, x, B, DIM, y, &o0, on_call, &bad, NULL),
                 -EINVAL);
    o0.k_min = 0;
    cr_assert_eq(hm_moe_forward(sw.client, ex, 4, x, B, DIM, y, &o0, on_call, &bad, NULL),
                 -EINVAL);
    cr_assert_eq(hm_moe_forward(sw.client, ex, 0, x, B, DIM, y, &o, on_call, &bad, NULL),
                 -EINVAL);
    cr_assert_eq(hm_moe_forward(sw.client, ex, 4, x, 0, DIM, y, &o, on_call, &bad, NULL),
                 -EINVAL);
    cr_assert_eq(hm_moe_backward(sw.client, ex, 4, x, NULL, B, DIM, gx, &o, on_call, &bad, NULL),
                 -EINVAL);
    /*
     * Over the protocol's caps: -EMSGSIZE up front (nothing is read from
     * the buffers), never a send that fails and reports a timeout. 4096 x
     * 4096 makes a backward frame of 128 MiB, over the transport's frame.
     */
    cr_assert_eq(hm_moe_forward(sw.client, ex, 4, x, HM_MOE_MAX_BATCH + 1, DIM, y, &o, on_call,
                                &bad, NULL),
                 -EMSGSIZE);
    cr_assert_eq(hm_moe_forward(sw.client, ex, 4, x, 1, HM_MOE_MAX_DIM + 1, y, &o, on_call, &bad,
                                NULL),
                 -EMSGSIZE);
    cr_assert_eq(hm_moe_backward(sw.client, ex, 4, x, gy, 4096, 4096, gx, &o, on_call, &bad, NULL),
                 -EMSGSIZE);
    cr_assert_lt(2 * HM_MOE_MAX_ELEMS * sizeof(float), (size_t)80 << 20);
    run_for(&sw.loop, 50);
    cr_assert_eq(bad.calls, 0);
    swarm_stop(&sw);
}

Test(moe_client, stragglers_k_min_and_timeout)
{
    swarm sw;
    swarm_start(&sw, 4);
    const char *p1[] = {"ffn.0.[0:2]"};
    const char *p2[] = {"ffn.1.0"};
    const char *p3[] = {"ffn.2.0"};
    host(&sw, 1, p1, 1);
    host(&sw, 2, p2, 1);
    host(&sw, 3, p3, 1);
    const char *uids[4] = {"ffn.0.0", "ffn.0.1", "ffn.1.0", "ffn.2.0"};
    hm_moe_expert ex[4];
    for (size_t e = 0; e < 4; e++)
        ex[e] = lookup_wait(&sw, uids[e]);

    /* Node 2 stops reading and writing (like a SIGSTOPped process); node 3
     * goes away entirely. */
    set_stall(&sw, 2, 1);
    close_node(&sw, 3);

    enum { B = 2 };
    float x[B * DIM], y[4 * B * DIM];
    fill(x, B * DIM, 3);

    /* k_min 2: the two live experts answer, then timeout_after_k_min. */
    hm_moe_call_opts o = {.k_min = 2, .timeout_ms = 20000, .timeout_after_k_min_ms = 400};
    callres c = {.k = 4, .start_ms = hm_now_ms()};
    cr_assert_eq(hm_moe_forward(sw.client, ex, 4, x, B, DIM, y, &o, on_call, &c, NULL), 0);
    cr_assert(hm_test_run_until(&sw.loop, call_done, &c, 25000));
    cr_assert_eq(c.status, 0, "%s", hm_strerror(c.status));
    cr_assert_eq(c.n_answered, 2u);
    cr_assert(c.answered[0] && c.answered[1] && !c.answered[2] && !c.answered[3]);
    uint64_t took = c.done_ms - c.start_ms;
    cr_assert_geq(took, 400u, "finished %" PRIu64 " ms in, before timeout_after_k_min", took);
    cr_assert_lt(took, 400u + 5000u, "took %" PRIu64 " ms", took);
    for (size_t i = 0; i < 2 * B * DIM; i++)
        cr_assert(isfinite(y[i]));

    /* k_min 3: only two can answer, so it fails at the timeout. */
    o.k_min = 3;
    o.timeout_ms = 1500;
    callres c3 = {.k = 4, .start_ms = hm_now_ms()};
    cr_assert_eq(hm_moe_forward(sw.client, ex, 4, x, B, DIM, y, &o, on_call, &c3, NULL), 0);
    cr_assert(hm_test_run_until(&sw.loop, call_done, &c3, 15000));
    cr_assert_eq(c3.status, -ETIMEDOUT, "%s", hm_strerror(c3.status));
    cr_assert_eq(c3.n_answered, 2u);
    took = c3.done_ms - c3.start_ms;
    cr_assert_geq(took, 1490u, "took %" PRIu64 " ms", took);
    cr_assert_lt(took, 1500u + 5000u, "took %" PRIu64 " ms", took);
    run_for(&sw.loop, 100);
    cr_assert_eq(c.calls, 1);
    cr_assert_eq(c3.calls, 1);
    swarm_stop(&sw);
}

/* A hostile peer: answers "moe.fwd" with garbage, a wrong shape or NaN,
 * by the uid asked for. */
static void hostile_fwd(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                        const struct sockaddr *from, const uint8_t *body, size_t len)
{
    HM_UNUSED(ud);
    HM_UNUSED(peer_pk);
    HM_UNUSED(from);
    hm_moe_req q;
    if (hm_moe_decode_req(body, len, 0, &q) != 0) {
        hm_rpc_respond(req, -EINVAL, NULL, 0);
        return;
    }
    size_t rows = q.batch, n = q.batch * q.dim;
    float *t = calloc(n + q.dim, sizeof(float));
    cr_assert_not_null(t);
    hm_wire_wr w;
    hm_wire_wr_init_dynamic(&w, 1 << 20);
    if (strcmp(q.uid, "junk.0.0") == 0) {
        static const uint8_t junk[] = {0x93, 0x01, 0xc0, 0xa1, 'y'};
        hm_rpc_respond(req, 0, junk, sizeof(junk));
    } else if (strcmp(q.uid, "error.0.0") == 0) {
        hm_rpc_respond(req, -EPROTO, NULL, 0);
    } else {
        if (strcmp(q.uid, "shape.0.0") == 0)
            rows++;
        else
            t[n / 2] = NAN;
        hm_moe_encode_out(&w, 0, t, rows, q.dim);
        cr_assert_eq(hm_wire_wr_error(&w), 0);
        hm_rpc_respond(req, 0, w.buf, w.len);
    }
    hm_wire_wr_free(&w);
    free(t);
}

Test(moe_client, hostile_replies_do_not_count)
{
    swarm sw;
    swarm_start(&sw, 3);
    const char *p1[] = {"ffn.0.0"};
    host(&sw, 1, p1, 1);
    cr_assert_eq(hm_rpc_register(hm_node_rpc(sw.nodes[2]), HM_MOE_METHOD_FWD, hostile_fwd, NULL),
                 0);
    hm_moe_expert ex[5];
    ex[0] = lookup_wait(&sw, "ffn.0.0");
    const char *bad[] = {"junk.0.0", "shape.0.0", "nan.0.0", "error.0.0"};
    char hp[128];
    host_port(&sw, 2, hp, sizeof(hp));
    for (size_t e = 1; e < 5; e++) {
        memset(&ex[e], 0, sizeof(ex[e]));
        snprintf(ex[e].uid, sizeof(ex[e].uid), "%s", bad[e - 1]);
        memcpy(ex[e].pk, hm_node_identity(sw.nodes[2])->pk, HM_PK_BYTES);
        cr_assert_eq(hm_strlcpy(ex[e].addr_str, hp, sizeof(ex[e].addr_str)), 0);
        cr_assert_eq(hm_parse_hostport(hp, &ex[e].addr), 0);
    }

    enum { B = 2 };
    float x[B * DIM], y[5 * B * DIM];
    fill(x, B * DIM, 4);
    hm_moe_call_opts o = {.k_min = 1, .timeout_ms = 20000, .timeout_after_k_min_ms = 10000};
    callres c = {.k = 5, .start_ms = hm_now_ms()};
    cr_assert_eq(hm_moe_forward(sw.client, ex, 5, x, B, DIM, y, &o, on_call, &c, NULL), 0);
    cr_assert(hm_test_run_until(&sw.loop, call_done, &c, 25000));
    /* Every expert replied, so it ends without waiting for either timer. */
    cr_assert_eq(c.status, 0, "%s", hm_strerror(c.status));
    cr_assert_eq(c.n_answered, 1u);
    cr_assert(c.answered[0]);
    cr_assert_lt(c.done_ms - c.start_ms, 8000u);
    for (size_t i = 0; i < B * DIM; i++)
        cr_assert(isfinite(y[i]));

    /* Needing two answers fails: the hostile ones are not answers. */
    o.k_min = 2;
    callres c2 = {.k = 5, .start_ms = hm_now_ms()};
    cr_assert_eq(hm_moe_forward(sw.client, ex, 5, x, B, DIM, y, &o, on_call, &c2, NULL), 0);
    cr_assert(hm_test_run_until(&sw.loop, call_done, &c2, 25000));
    cr_assert_eq(c2.status, -ETIMEDOUT);
    cr_assert_eq(c2.n_answered, 1u);
    cr_assert_lt(c2.done_ms - c2.start_ms, 8000u);
    swarm_stop(&sw);
}

Test(moe_client, combine_softmax_over_answered)
{
    /* k = 3, batch = 2, dim = 2. */
    const float y[3 * 2 * 2] = {
        1, 2, 3, 4,      /* expert 0: rows b0, b1 */
        100, 100, 9, 9,  /* expert 1 (did not answer) */
        -1, 0.5f, 2, -2, /* expert 2 */
    };
    const float logits[2 * 3] = {1, 5, 3, 1000, 0, 1001};
    const uint8_t answered[3] = {1, 0, 1};
    float out[4], w[6];
    cr_assert_eq(hm_moe_combine(y, logits, answered, 3, 2, 2, out, w), 0);

    /* Row 0: softmax of (1, 3) over experts 0 and 2. */
    double w0 = 1.0 / (1.0 + exp(2.0)), w2 = exp(2.0) / (1.0 + exp(2.0));
    cr_assert_float_eq(w[0], w0, 1e-6);
    cr_assert_float_eq(w[1], 0.0, 0);
    cr_assert_float_eq(w[2], w2, 1e-6);
    cr_assert_float_eq(out[0], w0 * 1 + w2 * -1, 1e-5);
    cr_assert_float_eq(out[1], w0 * 2 + w2 * 0.5, 1e-5);
    /* Row 1: logits 1000 and 1001 must not overflow. */
    double v0 = 1.0 / (1.0 + exp(1.0)), v2 = exp(1.0) / (1.0 + exp(1.0));
    cr_assert_float_eq(w[3], v0, 1e-6);
    cr_assert_float_eq(w[4], 0.0, 0);
    cr_assert_float_eq(w[5], v2, 1e-6);
    cr_assert_float_eq(out[2], v0 * 3 + v2 * 2, 1e-5);
    cr_assert_float_eq(out[3], v0 * 4 + v2 * -2, 1e-5);

    /* One answered: weight 1, output its row. Without weights_out too. */
    const uint8_t only1[3] = {0, 1, 0};
    cr_assert_eq(hm_moe_combine(y, logits, only1, 3, 2, 2, out, NULL), 0);
    cr_assert_float_eq(out[0], 100, 1e-5);
    cr_assert_float_eq(out[3], 9, 1e-5);

    const uint8_t none[3] = {0, 0, 0};
    cr_assert_eq(hm_moe_combine(y, logits, none, 3, 2, 2, out, w), -EINVAL);
}

Test(moe_client, cancel_fires_once)
{
    swarm sw;
    swarm_start(&sw, 2);
    const char *p1[] = {"ffn.0.0"};
    host(&sw, 1, p1, 1);
    hm_moe_expert ex = lookup_wait(&sw, "ffn.0.0");
    set_stall(&sw, 1, 1);

    enum { B = 1 };
    float x[B * DIM], y[B * DIM];
    fill(x, B * DIM, 5);
    hm_moe_call_opts o = {.k_min = 1, .timeout_ms = 10000, .timeout_after_k_min_ms = 0};
    callres c = {.k = 1};
    uint64_t id = 0;
    cr_assert_eq(hm_moe_forward(sw.client, &ex, 1, x, B, DIM, y, &o, on_call, &c, &id), 0);
    run_for(&sw.loop, 200);
    cr_assert_eq(c.calls, 0);
    cr_assert_eq(hm_moe_cancel(sw.client, id), 0);
    cr_assert_eq(c.calls, 1);
    cr_assert_eq(c.status, -ECANCELED);
    cr_assert_eq(c.n_answered, 0u);
    cr_assert_eq(hm_moe_cancel(sw.client, id), -ENOENT);
    run_for(&sw.loop, 300);
    cr_assert_eq(c.calls, 1);

    /* An expert that cannot even be called (no address): the call still
     * reports once, and not from inside hm_moe_forward. */
    hm_moe_expert nowhere = ex;
    memset(&nowhere.addr, 0, sizeof(nowhere.addr));
    uint8_t other_pk[HM_PK_BYTES];
    memset(other_pk, 0x5a, sizeof(other_pk));
    memcpy(nowhere.pk, other_pk, HM_PK_BYTES);
    callres cn = {.k = 1};
    cr_assert_eq(hm_moe_forward(sw.client, &nowhere, 1, x, B, DIM, y, &o, on_call, &cn, NULL),
                 0);
    cr_assert_eq(cn.calls, 0);
    cr_assert(hm_test_run_until(&sw.loop, call_done, &cn, 15000));
    cr_assert_eq(cn.calls, 1);
    cr_assert_eq(cn.status, -ETIMEDOUT);
    swarm_stop(&sw);
}

Test(moe_client, free_with_calls_in_flight)
{
    swarm sw;
    swarm_start(&sw, 3);
    const char *p1[] = {"ffn.0.[0:2]"};
    host(&sw, 1, p1, 1);
    hm_moe_expert ex[2] = {lookup_wait(&sw, "ffn.0.0"), lookup_wait(&sw, "ffn.0.1")};

    /* Node 2 stalls: lookups that ask it wait for their DHT timeouts. */
    set_stall(&sw, 1, 1);
    set_stall(&sw, 2, 1);
    enum { B = 2 };
    float x[B * DIM], y1[2 * B * DIM], y2[2 * B * DIM], gy[2 * B * DIM], gx[2 * B * DIM];
    fill(x, B * DIM, 6);
    fill(gy, 2 * B * DIM, 7);
    hm_moe_call_opts o = {.k_min = 1, .timeout_ms = 10000, .timeout_after_k_min_ms = 0};
    callres c[3] = {{.k = 2}, {.k = 2}, {.k = 2}};
    cr_assert_eq(hm_moe_forward(sw.client, ex, 2, x, B, DIM, y1, &o, on_call, &c[0], NULL), 0);
    cr_assert_eq(hm_moe_forward(sw.client, ex, 2, x, B, DIM, y2, &o, on_call, &c[1], NULL), 0);
    cr_assert_eq(hm_moe_backward(sw.client, ex, 2, x, gy, B, DIM, gx, &o, on_call, &c[2], NULL),
                 0);
    findres fl = {0}, fb = {0};
    cr_assert_eq(hm_moe_lookup(sw.client, "ffn.0.1", 5000, on_find, &fl), 0);
    const double s[2] = {0.5, 0.25};
    const double *sc[2] = {s, s};
    size_t sizes[2] = {2, 2};
    cr_assert_eq(hm_moe_beam_search(sw.client, "ffn", sc, sizes, 2, 2, 0, 5000, on_find, &fb),
                 0);
    run_for(&sw.loop, 100);
    for (size_t i = 0; i < 3; i++)
        cr_assert_eq(c[i].calls, 0);

    hm_moe_client_free(sw.client);
    sw.client = NULL;
    for (size_t i = 0; i < 3; i++) {
        cr_assert_eq(c[i].calls, 1, "call %zu", i);
        cr_assert_eq(c[i].status, -ECANCELED);
    }
    cr_assert_eq(fl.calls, 1);
    cr_assert_eq(fl.status, -ECANCELED);
    cr_assert_eq(fb.calls, 1);
    cr_assert_eq(fb.status, -ECANCELED);
    /* The DHT operations end later and must find nothing to call. */
    set_stall(&sw, 1, 0);
    set_stall(&sw, 2, 0);
    run_for(&sw.loop, 1500);
    for (size_t i = 0; i < 3; i++)
        cr_assert_eq(c[i].calls, 1);
    cr_assert_eq(fl.calls, 1);
    cr_assert_eq(fb.calls, 1);
    swarm_stop(&sw);
}

/* A node that closes under calls in flight ends them with -ECANCELED, not a timeout. */
Test(moe_client, node_close_cancels_calls)
{
    swarm sw;
    swarm_start(&sw, 2);
    const char *p1[] = {"ffn.0.0"};
    host(&sw, 1, p1, 1);
    hm_moe_expert ex = lookup_wait(&sw, "ffn.0.0");

    set_stall(&sw, 1, 1);
    enum { B = 2 };
    float x[B * DIM], y[B * DIM];
    fill(x, B * DIM, 9);
    hm_moe_call_opts o = {.k_min = 1, .timeout_ms = 10000, .timeout_after_k_min_ms = 0};
    callres c = {.k = 1};
    cr_assert_eq(hm_moe_forward(sw.client, &ex, 1, x, B, DIM, y, &o, on_call, &c, NULL), 0);
    run_for(&sw.loop, 100);
    cr_assert_eq(c.calls, 0);
    close_node(&sw, 0);
    cr_assert_eq(c.calls, 1);
    cr_assert_eq(c.status, -ECANCELED, "status %s", hm_strerror(c.status));
    hm_moe_client_free(sw.client);
    sw.client = NULL;
    set_stall(&sw, 1, 0);
    swarm_stop(&sw);
}

/* ------------------------------------------------ who may serve a uid */

typedef struct putres {
    int done, status;
} putres;

static void on_put_done(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    putres *p = ud;
    HM_UNUSED(stored);
    HM_UNUSED(info);
    p->done = 1;
    p->status = status;
}

static int put_done(void *ud) { return ((putres *)ud)->done; }

/* Node i declares uid (and its grid prefixes) as its own, under its own
 * owner subkey, with ttl_s: what any member can sign. */
static void declare_as(swarm *sw, size_t i, const char *uid, double ttl_s)
{
    char marker[HM_DHT_OWNER_MARKER_LEN + 1], hp[128], key[HM_MOE_UID_MAX + 2];
    uint8_t value[256], sk[HM_DHT_SUBKEY_MAX];
    hm_moe_uid u;
    putres p;
    hm_dht_owner_marker(hm_node_identity(sw->nodes[i])->pk, marker);
    host_port(sw, i, hp, sizeof(hp));
    cr_assert_eq(hm_moe_uid_parse(uid, strlen(uid), &u), 0);
    int vl = hm_moe_encode_expert_value(value, sizeof(value), hp, "ffn", DIM);
    cr_assert_gt(vl, 0);
    memset(&p, 0, sizeof(p));
    cr_assert_eq(hm_node_dht_put(sw->nodes[i], (const uint8_t *)uid, strlen(uid),
                                 (const uint8_t *)marker, strlen(marker), 1, value, (size_t)vl,
                                 ttl_s, 3000, on_put_done, &p),
                 0);
    cr_assert(hm_test_run_until(&sw->loop, put_done, &p, 6000));
    cr_assert_eq(p.status, 0, "put %s: %s", uid, hm_strerror(p.status));
    for (unsigned l = 0; l < u.ndims; l++) {
        cr_assert_gt(hm_moe_uid_prefix(&u, l, key, sizeof(key)), 0);
        int skl = snprintf((char *)sk, sizeof(sk), "%u%s", (unsigned)u.coords[l], marker);
        vl = hm_moe_encode_prefix_value(value, sizeof(value), uid, hp);
        cr_assert_gt(vl, 0);
        memset(&p, 0, sizeof(p));
        cr_assert_eq(hm_node_dht_put(sw->nodes[i], (const uint8_t *)key, strlen(key), sk,
                                     (size_t)skl, 1, value, (size_t)vl, ttl_s, 3000,
                                     on_put_done, &p),
                     0);
        cr_assert(hm_test_run_until(&sw->loop, put_done, &p, 6000));
        cr_assert_eq(p.status, 0, "put %s: %s", key, hm_strerror(p.status));
    }
}

static hm_moe_expert lookup_once(swarm *sw, hm_moe_client *c, const char *uid, int *status)
{
    findres f = {0};
    cr_assert_eq(hm_moe_lookup(c, uid, 3000, on_find, &f), 0);
    cr_assert(hm_test_run_until(&sw->loop, find_done, &f, 6000));
    *status = f.status;
    return f.ex[0];
}

static int is_node(swarm *sw, const hm_moe_expert *ex, size_t i)
{
    return memcmp(ex->pk, hm_node_identity(sw->nodes[i])->pk, HM_PK_BYTES) == 0;
}

/* The single beam search result for uid "ffn.1.0" in a 2x2 grid. */
static hm_moe_expert beam_for_1_0(swarm *sw)
{
    double s0[2] = {0, 1}, s1[2] = {1, 0};
    const double *scores[2] = {s0, s1};
    size_t sizes[2] = {2, 2};
    findres f = {0};
    cr_assert_eq(hm_moe_beam_search(sw->client, "ffn", scores, sizes, 2, 1, 2, 5000, on_find,
                                    &f),
                 0);
    cr_assert(hm_test_run_until(&sw->loop, find_done, &f, 10000));
    cr_assert_eq(f.status, 0, "beam search: %s", hm_strerror(f.status));
    cr_assert_eq(f.n, 1u);
    cr_assert_str_eq(f.ex[0].uid, "ffn.1.0");
    return f.ex[0];
}

typedef struct limits {
    uint64_t ttl, allow, holder;
} limits;

static void on_limit(void *ud, const char *kw, uint64_t n)
{
    limits *l = ud;
    if (strcmp(kw, "ExpertRecordMaxTtl") == 0)
        l->ttl = n;
    else if (strcmp(kw, "ExpertHostsFile") == 0)
        l->allow = n;
    else if (strcmp(kw, "ExpertOneHolder") == 0)
        l->holder = n;
}

/*
 * Node 1 hosts ffn.[0:2].[0:2]; node 2 signs ffn.1.0 (and its prefixes)
 * under its own key, first for a day, then for two minutes (fresher than
 * the host's 60 s declarations). The client keeps taking ffn.1.0 from
 * node 1, by lookup and by beam search; with any_holder (the freshest of
 * any owner, the old rule) it would go to node 2. Once node 1 leaves and
 * withdraws, the name passes to the live declaration left.
 */
Test(moe_client, a_newcomer_owner_does_not_take_a_held_uid)
{
    swarm sw;
    int st;
    limits lim = {0};
    swarm_start(&sw, 3);
    const char *pats[] = {"ffn.[0:2].[0:2]"};
    host(&sw, 1, pats, 1);
    hm_moe_expert ex = lookup_wait(&sw, "ffn.1.0");
    cr_assert(is_node(&sw, &ex, 1));
    ex = beam_for_1_0(&sw);
    cr_assert(is_node(&sw, &ex, 1));

    /* A day-long declaration is not believed at all. */
    declare_as(&sw, 2, "ffn.1.0", 86000);
    ex = lookup_once(&sw, sw.client, "ffn.1.0", &st);
    cr_assert_eq(st, 0);
    cr_assert(is_node(&sw, &ex, 1), "a day-long declaration took ffn.1.0 over");
    hm_moe_client_limits(sw.client, on_limit, &lim);
    cr_assert_geq(lim.ttl, 1);

    /* A short, fresher one is passed over for the live holder. */
    declare_as(&sw, 2, "ffn.1.0", 120);
    ex = lookup_once(&sw, sw.client, "ffn.1.0", &st);
    cr_assert_eq(st, 0);
    cr_assert(is_node(&sw, &ex, 1), "a newcomer took ffn.1.0 over");
    ex = beam_for_1_0(&sw);
    cr_assert(is_node(&sw, &ex, 1), "a newcomer took ffn.1.0 over in the beam search");
    hm_moe_client_limits(sw.client, on_limit, &lim);
    cr_assert_geq(lim.holder, 2);

    /* The old rule, freshest of any owner, would have handed it over. */
    hm_moe_client *open_c = NULL;
    cr_assert_eq(hm_moe_client_new(sw.nodes[0], &open_c), 0);
    hm_moe_client_policy any = {.any_holder = 1};
    cr_assert_eq(hm_moe_client_set_policy(open_c, &any), 0);
    ex = lookup_once(&sw, open_c, "ffn.1.0", &st);
    cr_assert_eq(st, 0);
    cr_assert(is_node(&sw, &ex, 2));

    /* A fresh reader with an allow-list for the grid takes node 1 only. */
    char rule[256], id[HM_PEER_ID_LEN + 1];
    hm_peer_id_encode(hm_node_identity(sw.nodes[1])->pk, id);
    snprintf(rule, sizeof(rule), "# the grid's hosts\nffn. %s\n", id);
    hm_moe_allow *allow = NULL;
    char err[256];
    cr_assert_eq(hm_moe_allow_parse(rule, strlen(rule), &allow, err, sizeof(err)), 0, "%s", err);
    hm_moe_client *listed = NULL;
    cr_assert_eq(hm_moe_client_new(sw.nodes[0], &listed), 0);
    hm_moe_client_policy pol = {.allow = allow};
    cr_assert_eq(hm_moe_client_set_policy(listed, &pol), 0);
    ex = lookup_once(&sw, listed, "ffn.1.0", &st);
    cr_assert_eq(st, 0);
    cr_assert(is_node(&sw, &ex, 1), "the allow-list let node 2 serve ffn.1.0");
    memset(&lim, 0, sizeof(lim));
    hm_moe_client_limits(listed, on_limit, &lim);
    cr_assert_geq(lim.allow, 1);
    hm_moe_client_free(listed);
    hm_moe_allow_free(allow);
    hm_moe_client_free(open_c);

    /* The holder leaves and withdraws: the name is not stuck on it. */
    int closed[2] = {0, 1};
    hm_moe_server_close(sw.servers[1], 1, on_closed, closed);
    sw.servers[1] = NULL;
    cr_assert(hm_test_run_until(&sw.loop, count_is, closed, 10000), "the server did not close");
    ex = lookup_once(&sw, sw.client, "ffn.1.0", &st);
    cr_assert_eq(st, 0, "ffn.1.0 after its holder left: %s", hm_strerror(st));
    cr_assert(is_node(&sw, &ex, 2));
    swarm_stop(&sw);
}

/* ------------------------------------------- refusals and stalled hosts */

static hm_moe_call_error call_errs[HM_MOE_MAX_K];

/* One forward on k experts with errors_out; returns its result. */
static callres forward_once(swarm *sw, const hm_moe_expert *ex, size_t k, size_t dim,
                            const hm_moe_call_opts *o0)
{
    enum { B = 2 };
    float x[B * HM_MOE_MAX_K * DIM], y[HM_MOE_MAX_K * B * DIM * 2];
    cr_assert_leq(dim, 2u * DIM);
    fill(x, B * dim, 5);
    hm_moe_call_opts o = *o0;
    o.errors_out = call_errs;
    memset(call_errs, 0x55, sizeof(call_errs)); /* filled by the call, whatever was there */
    callres c = {.k = k, .start_ms = hm_now_ms()};
    cr_assert_eq(hm_moe_forward(sw->client, ex, k, x, B, dim, y, &o, on_call, &c, NULL), 0);
    cr_assert(hm_test_run_until(&sw->loop, call_done, &c, 40000), "the call never ended");
    cr_assert_eq(c.calls, 1);
    for (size_t e = 0; e < k; e++)
        cr_assert_eq(call_errs[e].status == 0, c.answered[e] != 0, "expert %zu: status %d", e,
                     call_errs[e].status);
    return c;
}

/*
 * A call the server refuses ends with the server's code and words as soon
 * as the refusal arrives, not as a timeout: a wrong width names the
 * expert's width, an unknown uid says so; with k_min met the call succeeds
 * and errors_out still says why the refused expert did not answer.
 */
Test(moe_client, refusals_carry_the_servers_reason)
{
    swarm sw;
    swarm_start(&sw, 2);
    const char *pats[] = {"ffn.0.[0:2]"};
    host(&sw, 1, pats, 1);
    hm_moe_expert ex[2];
    ex[0] = lookup_wait(&sw, "ffn.0.0");
    ex[1] = ex[0];
    snprintf(ex[1].uid, sizeof(ex[1].uid), "ffn.0.9");
    /* The timeout is far longer than a refusal takes, so that an answer
     * in time cannot be a timeout in disguise. */
    hm_moe_call_opts o = {.k_min = 1, .timeout_ms = 30000, .timeout_after_k_min_ms = 30000};

    callres c = forward_once(&sw, ex, 1, 8, &o);
    cr_assert_eq(c.status, -EPROTO, "wrong width: %s", hm_strerror(c.status));
    cr_assert_eq(call_errs[0].status, -EPROTO);
    cr_assert(strstr(call_errs[0].msg, "ffn.0.0 takes inputs of width 16, not 8") != NULL,
              "reason: '%s'", call_errs[0].msg);
    cr_assert_lt(c.done_ms - c.start_ms, 5000u, "the refusal took %" PRIu64 " ms",
                 c.done_ms - c.start_ms);

    c = forward_once(&sw, &ex[1], 1, DIM, &o);
    cr_assert_eq(c.status, -ENOENT, "unknown uid: %s", hm_strerror(c.status));
    cr_assert(strstr(call_errs[0].msg, "no expert ffn.0.9") != NULL, "reason: '%s'",
              call_errs[0].msg);

    /* Both wanted: the refusal fails the call with its own code. */
    o.k_min = 2;
    c = forward_once(&sw, ex, 2, DIM, &o);
    cr_assert_eq(c.status, -ENOENT, "%s", hm_strerror(c.status));
    cr_assert_eq(c.n_answered, 1u);
    cr_assert_eq(call_errs[0].status, 0);
    cr_assert_eq(call_errs[0].msg[0], '\0');
    /* One is enough: success, and the other's reason is kept. */
    o.k_min = 1;
    c = forward_once(&sw, ex, 2, DIM, &o);
    cr_assert_eq(c.status, 0, "%s", hm_strerror(c.status));
    cr_assert(c.answered[0] && !c.answered[1]);
    cr_assert_eq(call_errs[1].status, -ENOENT);
    cr_assert_lt(c.done_ms - c.start_ms, 5000u, "waited %" PRIu64 " ms for a refused expert",
                 c.done_ms - c.start_ms);
    swarm_stop(&sw);
}

static size_t count_status(size_t k, int status)
{
    size_t n = 0;
    for (size_t e = 0; e < k; e++)
        n += call_errs[e].status == status;
    return n;
}

/*
 * A host that stalls one call is skipped by the next ones (none of them
 * waits for it), beam searches rank it last, and after its back-off one
 * call probes it: answered, it is in good standing again; stalled again,
 * its back-off doubles.
 */
Test(moe_client, stalled_host_is_skipped_then_probed)
{
    swarm sw;
    swarm_start(&sw, 3);
    hm_moe_client_policy pol = {.backoff_ms = 4000, .backoff_max_ms = 20000};
    cr_assert_eq(hm_moe_client_set_policy(sw.client, &pol), 0);
    hm_moe_client_policy bad = {.backoff_ms = 2000, .backoff_max_ms = 1000};
    cr_assert_eq(hm_moe_client_set_policy(sw.client, &bad), -EINVAL);
    const char *p1[] = {"ffn.0.0"}, *p2[] = {"ffn.1.0"};
    host(&sw, 1, p1, 1);
    host(&sw, 2, p2, 1);
    hm_moe_expert ex[2] = {lookup_wait(&sw, "ffn.0.0"), lookup_wait(&sw, "ffn.1.0")};
    hm_moe_call_opts o = {.k_min = 1, .timeout_ms = 20000, .timeout_after_k_min_ms = 300};
    hm_moe_backoff_stats st;

    callres c = forward_once(&sw, ex, 2, DIM, &o);
    cr_assert_eq(c.n_answered, 2u, "both hosts should answer while healthy");
    hm_moe_client_backoff_stats(sw.client, &st);
    cr_assert_eq(st.stalls, 0u);

    set_stall(&sw, 1, 1);
    c = forward_once(&sw, ex, 2, DIM, &o);
    cr_assert_eq(c.status, 0);
    cr_assert(!c.answered[0] && c.answered[1]);
    cr_assert_eq(call_errs[0].status, -ETIMEDOUT, "the stalled expert: %d", call_errs[0].status);
    hm_moe_client_backoff_stats(sw.client, &st);
    cr_assert_eq(st.stalls, 1u);
    cr_assert_eq(st.hosts, 1u);

    /* Beam search: the backed-off host's expert scores higher, but comes last. */
    double s0[2] = {1.0, 0.0}, s1[1] = {0.0};
    const double *scores[2] = {s0, s1};
    size_t sizes[2] = {2, 1};
    for (size_t kb = 1; kb <= 2; kb++) {
        findres f = {0};
        cr_assert_eq(hm_moe_beam_search(sw.client, "ffn", scores, sizes, 2, kb, 2, 5000, on_find,
                                        &f),
                     0);
        cr_assert(hm_test_run_until(&sw.loop, find_done, &f, 8000));
        cr_assert_eq(f.status, 0, "%s", hm_strerror(f.status));
        cr_assert_eq(f.n, kb);
        cr_assert_str_eq(f.ex[0].uid, "ffn.1.0", "k_best %zu: %s first", kb, f.ex[0].uid);
        if (kb == 2)
            cr_assert_str_eq(f.ex[1].uid, "ffn.0.0");
    }

    /* The next calls do not wait for it: it is not even called. */
    size_t waited = 0;
    for (int i = 0; i < 8; i++) {
        c = forward_once(&sw, ex, 2, DIM, &o);
        cr_assert_eq(c.status, 0);
        cr_assert(c.answered[1]);
        waited += count_status(2, -ETIMEDOUT);
        cr_assert_eq(call_errs[0].status, -EAGAIN, "call %d: %d", i, call_errs[0].status);
    }
    cr_assert_eq(waited, 0u, "%zu calls waited for the backed-off host", waited);
    hm_moe_client_backoff_stats(sw.client, &st);
    cr_assert_eq(st.stalls, 1u);
    cr_assert_eq(st.skipped, 8u);
    hm_moe_backoff_host hs[4];
    cr_assert_eq(hm_moe_client_backoffs(sw.client, hs, 4), 1u);
    cr_assert_eq(memcmp(hs[0].pk, ex[0].pk, HM_PK_BYTES), 0);
    cr_assert_eq(hs[0].period_ms, 4000u);

    /* With k_min 2 it cannot be done without it: the host is called. */
    hm_moe_call_opts o2 = o;
    o2.k_min = 2;
    o2.timeout_ms = 800;
    c = forward_once(&sw, ex, 2, DIM, &o2);
    cr_assert_eq(c.status, -ETIMEDOUT, "%s", hm_strerror(c.status));
    cr_assert_eq(call_errs[0].status, -ETIMEDOUT);

    /* Back again: once the back-off has run out, a probe finds it. */
    set_stall(&sw, 1, 0);
    run_for(&sw.loop, 4300);
    c = forward_once(&sw, ex, 2, DIM, &o);
    cr_assert_eq(c.n_answered, 2u, "the host was not used again: %d", call_errs[0].status);
    hm_moe_client_backoff_stats(sw.client, &st);
    cr_assert_eq(st.recovered, 1u);
    cr_assert_eq(st.hosts, 0u);
    c = forward_once(&sw, ex, 2, DIM, &o);
    cr_assert_eq(c.n_answered, 2u);

    /* Stalled twice in a row: the second back-off is twice the first. */
    set_stall(&sw, 1, 1);
    c = forward_once(&sw, ex, 2, DIM, &o);
    cr_assert_eq(call_errs[0].status, -ETIMEDOUT);
    run_for(&sw.loop, 4300);
    c = forward_once(&sw, ex, 2, DIM, &o);
    cr_assert_eq(call_errs[0].status, -ETIMEDOUT, "the probe: %d", call_errs[0].status);
    cr_assert_eq(hm_moe_client_backoffs(sw.client, hs, 4), 1u);
    cr_assert_eq(hs[0].period_ms, 8000u);
    cr_assert_eq(hs[0].stalls, 2u);
    set_stall(&sw, 1, 0);
    swarm_stop(&sw);
}

/*
 * Uids as Hivemind takes them: a grid name with spaces, '/', ',' and
 * non-ASCII characters over six dimensions, and "transformer::encoder.N".
 * Declared, found by beam search (exactly the brute-force top k, with the
 * name given with or without Hivemind's trailing dot), called, and
 * checkpointed under a file name that stays inside experts/.
 */
#define HM_NAME "\xe4\xb8\x93\xe5\xae\xb6 net/x,y" /* 专家 net/x,y */

Test(moe_client, hivemind_uids_six_dimensions)
{
    swarm sw;
    swarm_start(&sw, 3);
    const char *p1[] = {HM_NAME ".[0:2].1.[0:2].0.[0:2].[0:2]"};
    const char *p2[] = {"transformer::encoder.[0:3]"};
    host(&sw, 1, p1, 1);
    host(&sw, 2, p2, 1);

    enum { ND = 6 };
    static const size_t sizes[ND] = {2, 3, 2, 1, 2, 2};
    static const double sc[ND][3] = {{0.5, -0.25}, {0.0, 1.0, 3.0}, {-1.0, 0.125},
                                     {0.0},       {2.0, -0.5},     {0.0625, 0.75}};
    const double *scores[ND];
    for (size_t d = 0; d < ND; d++)
        scores[d] = sc[d];
    /* Brute force over the hosted experts (d1 = 1, d3 = 0), best first. */
    struct {
        unsigned c[ND];
        double s;
    } all[16], tmp;
    size_t n = 0;
    for (unsigned a = 0; a < 2; a++)
        for (unsigned b = 0; b < 2; b++)
            for (unsigned e = 0; e < 2; e++)
                for (unsigned f = 0; f < 2; f++) {
                    unsigned c[ND] = {a, 1, b, 0, e, f};
                    memcpy(all[n].c, c, sizeof(c));
                    all[n].s = 0;
                    for (size_t d = 0; d < ND; d++)
                        all[n].s += sc[d][c[d]];
                    n++;
                }
    for (size_t i = 0; i < n; i++)
        for (size_t j = i + 1; j < n; j++)
            if (all[j].s > all[i].s) {
                tmp = all[i];
                all[i] = all[j];
                all[j] = tmp;
            }

    findres f;
    uint64_t end = hm_now_ms() + 20000;
    do {
        memset(&f, 0, sizeof(f));
        cr_assert_eq(hm_moe_beam_search(sw.client, HM_NAME, scores, sizes, ND, 16, 16, 5000,
                                        on_find, &f),
                     0);
        cr_assert(hm_test_run_until(&sw.loop, find_done, &f, 10000));
        if (f.status == 0 && f.n == 16)
            break;
        run_for(&sw.loop, 300);
    } while (hm_now_ms() < end);
    cr_assert_eq(f.status, 0, "beam search: %s", hm_strerror(f.status));
    cr_assert_eq(f.n, 16u, "found %zu of the 16 experts", f.n);
    for (size_t k = 0; k < 4; k++) {
        char want[HM_MOE_UID_MAX + 1];
        snprintf(want, sizeof(want), HM_NAME ".%u.%u.%u.%u.%u.%u", all[k].c[0], all[k].c[1],
                 all[k].c[2], all[k].c[3], all[k].c[4], all[k].c[5]);
        cr_assert_str_eq(f.ex[k].uid, want, "rank %zu", k);
        cr_assert_float_eq(f.ex[k].score, all[k].s, 1e-9);
    }
    /* Top 4 with a narrow beam and Hivemind's "NAME." form: the same four. */
    findres g;
    memset(&g, 0, sizeof(g));
    cr_assert_eq(hm_moe_beam_search(sw.client, HM_NAME ".", scores, sizes, ND, 4, 8, 5000,
                                    on_find, &g),
                 0);
    cr_assert(hm_test_run_until(&sw.loop, find_done, &g, 10000));
    cr_assert_eq(g.status, 0);
    cr_assert_eq(g.n, 4u);
    for (size_t k = 0; k < 4; k++)
        cr_assert_str_eq(g.ex[k].uid, f.ex[k].uid, "rank %zu", k);
    /* Seventeen dimensions, or a name with a dot or a control character: refused. */
    const double *many[17];
    size_t many_sizes[17];
    for (size_t d = 0; d < 17; d++) {
        many[d] = sc[0];
        many_sizes[d] = 1;
    }
    cr_assert_eq(hm_moe_beam_search(sw.client, "g", many, many_sizes, 17, 4, 0, 1000, on_find,
                                    &g),
                 -EINVAL);
    cr_assert_eq(hm_moe_beam_search(sw.client, "a\tb", scores, sizes, ND, 4, 0, 1000, on_find,
                                    &g),
                 -EINVAL);

    /* transformer::encoder.2 is found and answers a call. */
    hm_moe_expert ex = lookup_wait(&sw, "transformer::encoder.2");
    hm_moe_call_opts o = {.k_min = 1, .timeout_ms = 5000};
    callres c = forward_once(&sw, &ex, 1, DIM, &o);
    cr_assert_eq(c.status, 0, "%s: %s", hm_strerror(c.status), call_errs[0].msg);

    /* Checkpoints: the name's other bytes as %XX, inside experts/. */
    cr_assert_eq(hm_moe_server_checkpoint(sw.servers[1]), 0);
    cr_assert_eq(hm_moe_server_checkpoint(sw.servers[2]), 0);
    char path[512];
    struct stat st;
    snprintf(path, sizeof(path), "%s/experts/%%E4%%B8%%93%%E5%%AE%%B6%%20net%%2Fx%%2Cy.1.1.0.0.1.1"
             ".ckpt", sw.dirs[1]);
    cr_assert_eq(stat(path, &st), 0, "no %s", path);
    snprintf(path, sizeof(path), "%s/experts/transformer%%3A%%3Aencoder.2.ckpt", sw.dirs[2]);
    cr_assert_eq(stat(path, &st), 0, "no %s", path);
    swarm_stop(&sw);
}

/* ------------------------------------------------- per-sample routing */

typedef struct routeres {
    int calls;
    int status;
    hm_moe_expert ex[64];
    size_t n;
    int32_t routes[64 * 8];
    size_t batch, k_best;
} routeres;

static void on_route(void *ud, int status, const hm_moe_expert *ex, size_t n,
                     const int32_t *routes, size_t batch, size_t k_best)
{
    routeres *r = ud;
    r->calls++;
    r->status = status;
    r->n = n;
    r->batch = batch;
    r->k_best = k_best;
    cr_assert_leq(n, 64u);
    cr_assert_leq(batch * k_best, 64u * 8u);
    if (n > 0)
        memcpy(r->ex, ex, n * sizeof(*ex));
    if (routes != NULL)
        memcpy(r->routes, routes, batch * k_best * sizeof(int32_t));
}

static int route_done(void *ud) { return ((routeres *)ud)->calls > 0; }

static void route(swarm *sw, const float *scores, size_t batch, size_t k, size_t beam_size,
                  routeres *r)
{
    size_t sizes[2] = {4, 4};
    memset(r, 0, sizeof(*r));
    cr_assert_eq(hm_moe_route(sw->client, "ffn", scores, batch, sizes, 2, k, beam_size, 5000,
                              on_route, r),
                 0);
    cr_assert_eq(r->calls, 0, "the callback fired inside hm_moe_route");
    cr_assert(hm_test_run_until(&sw->loop, route_done, r, 10000));
    cr_assert_eq(r->calls, 1);
}

/* Whether every sample's route is its own brute-force top k over the grid. */
static int routes_exact(const routeres *r, const float *scores, size_t batch, size_t k,
                        int report)
{
    if (r->status != 0)
        return 0;
    for (size_t b = 0; b < batch; b++) {
        double s0[4], s1[4];
        scored want[16];
        for (int i = 0; i < 4; i++) {
            s0[i] = scores[b * 8 + (size_t)i];
            s1[i] = scores[b * 8 + 4 + (size_t)i];
        }
        size_t nw = expect_top(s0, s1, 4, k, want);
        for (size_t j = 0; j < k; j++) {
            int32_t e = r->routes[b * k + j];
            int ok = j < nw ? e >= 0 && (size_t)e < r->n && strcmp(r->ex[e].uid, want[j].uid) == 0
                            : e == -1;
            if (!ok) {
                if (report)
                    cr_assert_fail("sample %zu rank %zu: %s, want %s", b, j,
                                   e >= 0 ? r->ex[e].uid : "none", j < nw ? want[j].uid : "none");
                return 0;
            }
        }
    }
    return 1;
}

static uint64_t requests_of(swarm *sw, size_t node, const char *uid, int backward)
{
    hm_moe_hosted h[16];
    size_t n = HM_MIN(hm_moe_server_list(sw->servers[node], h, 16), (size_t)16);
    for (size_t i = 0; i < n; i++)
        if (strcmp(h[i].uid, uid) == 0)
            return backward ? h[i].bwd_requests : h[i].fwd_requests;
    cr_assert_fail("%s is not hosted on node %zu", uid, node);
    return 0;
}

static size_t owner_of(const char *uid)
{
    unsigned i = (unsigned)(uid[4] - '0'), j = (unsigned)(uid[6] - '0');
    return i == 0 || (i == 1 && j < 3) ? 1 : i == 3 ? 3 : 2;
}

Test(moe_client, routed_per_sample_matches_brute_force_and_local_experts)
{
    swarm sw;
    swarm_start(&sw, 4);
    host(&sw, 1, (const char *const *)grid_node1, HM_ARRAY_LEN(grid_node1));
    host(&sw, 2, (const char *const *)grid_node2, HM_ARRAY_LEN(grid_node2));
    host(&sw, 3, (const char *const *)grid_node3, HM_ARRAY_LEN(grid_node3));

    /* Each sample its own scores (4 + 4 per row), distinct sums. */
    enum { B = 7, K = 3, S = 8 };
    float scores[B * S];
    for (size_t i = 0; i < B * S; i++)
        scores[i] = (float)(sin(1.7 * (double)i + 0.3) * 2.0 + 0.001 * (double)i);
    routeres r;
    uint64_t end = hm_now_ms() + 20000;
    do {
        route(&sw, scores, B, K, 4, &r);
        if (routes_exact(&r, scores, B, K, 0))
            break;
        run_for(&sw.loop, 300);
    } while (hm_now_ms() < end);
    routes_exact(&r, scores, B, K, 1);
    /* The samples do not all want the same experts, or this would be the
     * per-batch case. */
    cr_assert_gt(r.n, (size_t)K, "only %zu distinct experts", r.n);
    for (size_t e = 0; e < r.n; e++) {
        size_t owner = owner_of(r.ex[e].uid);
        cr_assert_eq(memcmp(r.ex[e].pk, hm_node_identity(sw.nodes[owner])->pk, HM_PK_BYTES), 0);
    }
    /* A beam of 1 is still per sample: a sample's best row first. */
    routeres r1;
    route(&sw, scores, B, 1, 4, &r1);
    routes_exact(&r1, scores, B, 1, 1);

    /* Forward and backward: one request per expert, holding its rows. */
    float x[B * DIM], y[B * K * DIM], gy[B * K * DIM], gx[B * K * DIM];
    fill(x, B * DIM, 4);
    fill(gy, B * K * DIM, 5);
    for (size_t i = 0; i < B * K * DIM; i++)
        y[i] = gx[i] = NAN;
    uint64_t fwd_before[64], bwd_before[64];
    for (size_t e = 0; e < r.n; e++) {
        fwd_before[e] = requests_of(&sw, owner_of(r.ex[e].uid), r.ex[e].uid, 0);
        bwd_before[e] = requests_of(&sw, owner_of(r.ex[e].uid), r.ex[e].uid, 1);
    }
    hm_moe_call_opts o = {.k_min = K, .timeout_ms = 10000, .timeout_after_k_min_ms = 0};
    callres c = {.k = r.n};
    cr_assert_eq(hm_moe_forward_routed(sw.client, r.ex, r.n, r.routes, K, x, B, DIM, y, &o,
                                       on_call, &c, NULL),
                 0);
    cr_assert_eq(c.calls, 0);
    cr_assert(hm_test_run_until(&sw.loop, call_done, &c, 12000));
    cr_assert_eq(c.status, 0, "forward: %s", hm_strerror(c.status));
    cr_assert_eq(c.n_answered, r.n);
    callres cb = {.k = r.n};
    cr_assert_eq(hm_moe_backward_routed(sw.client, r.ex, r.n, r.routes, K, x, gy, B, DIM, gx, &o,
                                        on_call, &cb, NULL),
                 0);
    cr_assert(hm_test_run_until(&sw.loop, call_done, &cb, 12000));
    cr_assert_eq(cb.status, 0, "backward: %s", hm_strerror(cb.status));
    for (size_t e = 0; e < r.n; e++) {
        size_t owner = owner_of(r.ex[e].uid);
        cr_assert_eq(requests_of(&sw, owner, r.ex[e].uid, 0), fwd_before[e] + 1, "%s",
                     r.ex[e].uid);
        cr_assert_eq(requests_of(&sw, owner, r.ex[e].uid, 1), bwd_before[e] + 1, "%s",
                     r.ex[e].uid);
    }
    /* Slot j of sample b is its expert's own output on x[b], and its
     * gradient for gy[b][j]. */
    for (size_t s = 1; s <= 3; s++)
        cr_assert_eq(hm_moe_server_checkpoint(sw.servers[s]), 0);
    for (size_t b = 0; b < B; b++) {
        for (size_t j = 0; j < K; j++) {
            const hm_moe_expert *ex = &r.ex[r.routes[b * K + j]];
            hm_ffn *f = load_expert(&sw, owner_of(ex->uid), ex->uid);
            float ly[DIM], lgx[DIM];
            cr_assert_eq(hm_ffn_forward(f, x + b * DIM, 1, ly), 0);
            cr_assert_eq(hm_ffn_grad(f, x + b * DIM, gy + (b * K + j) * DIM, 1, lgx, NULL), 0);
            assert_close(y + (b * K + j) * DIM, ly, DIM, 1e-4, ex->uid);
            assert_close(gx + (b * K + j) * DIM, lgx, DIM, 1e-4, ex->uid);
            hm_ffn_free(f);
        }
    }

    /* The mixture per sample: softmax over the sample's answered slots. */
    float logits[B * K], mix[B * DIM], w[B * K];
    uint8_t ans[64];
    fill(logits, B * K, 6);
    memset(ans, 1, sizeof(ans));
    ans[r.routes[0]] = 0; /* sample 0's best expert did not answer */
    cr_assert_eq(hm_moe_combine_routed(y, logits, r.routes, ans, r.n, B, K, DIM, mix, w), 0);
    for (size_t b = 0; b < B; b++) {
        double mx = -INFINITY, sum = 0, ww[K];
        for (size_t j = 0; j < K; j++)
            if (ans[r.routes[b * K + j]])
                mx = fmax(mx, logits[b * K + j]);
        for (size_t j = 0; j < K; j++) {
            ww[j] = ans[r.routes[b * K + j]] ? exp(logits[b * K + j] - mx) : 0;
            sum += ww[j];
        }
        for (size_t i = 0; i < DIM; i++) {
            double want = 0;
            for (size_t j = 0; j < K; j++)
                want += ww[j] / sum * y[(b * K + j) * DIM + i];
            cr_assert_float_eq(mix[b * DIM + i], want, 1e-5);
        }
    }
    cr_assert_float_eq(w[0], 0.0, 0.0);

    /*
     * k_min per sample. Node 3 (ffn.3.*) stalls. With k_min K every sample
     * routed there lacks an answer: a timeout. With k_min 1 every sample
     * still has one (node 3 hosts two experts, K is 3): success after
     * timeout_after_k_min, node 3's slots left as they were.
     */
    int uses3 = 0;
    for (size_t i = 0; i < B * K; i++)
        uses3 |= owner_of(r.ex[r.routes[i]].uid) == 3;
    cr_assert(uses3, "no sample is routed to node 3");
    set_stall(&sw, 3, 1);
    o.timeout_ms = 1500;
    callres ct = {.k = r.n};
    cr_assert_eq(hm_moe_forward_routed(sw.client, r.ex, r.n, r.routes, K, x, B, DIM, y, &o,
                                       on_call, &ct, NULL),
                 0);
    cr_assert(hm_test_run_until(&sw.loop, call_done, &ct, 10000));
    cr_assert_eq(ct.status, -ETIMEDOUT, "%s", hm_strerror(ct.status));
    int both = 0;
    for (size_t b = 0; b < B; b++) {
        size_t on3 = 0;
        for (size_t j = 0; j < K; j++)
            on3 += owner_of(r.ex[r.routes[b * K + j]].uid) == 3;
        both |= on3 == 2;
    }
    /* A per-batch k_min of 2 could hold while this sample has one answer. */
    cr_assert(both, "no sample has both of node 3's experts");
    for (size_t i = 0; i < B * K * DIM; i++)
        y[i] = NAN;
    o.k_min = 1;
    o.timeout_ms = 20000;
    o.timeout_after_k_min_ms = 300;
    callres c2 = {.k = r.n, .start_ms = hm_now_ms()};
    cr_assert_eq(hm_moe_forward_routed(sw.client, r.ex, r.n, r.routes, K, x, B, DIM, y, &o,
                                       on_call, &c2, NULL),
                 0);
    cr_assert(hm_test_run_until(&sw.loop, call_done, &c2, 25000));
    cr_assert_eq(c2.status, 0, "%s", hm_strerror(c2.status));
    cr_assert_lt(c2.done_ms - c2.start_ms, 10000u);
    for (size_t b = 0; b < B; b++)
        for (size_t j = 0; j < K; j++) {
            int32_t e = r.routes[b * K + j];
            int on3 = owner_of(r.ex[e].uid) == 3;
            cr_assert_eq(c2.answered[e], !on3, "%s", r.ex[e].uid);
            cr_assert_eq(isnan(y[(b * K + j) * DIM]) != 0, on3, "sample %zu slot %zu", b, j);
        }
    set_stall(&sw, 3, 0);

    /* Bad routes: -EINVAL at the start, no callback. */
    int32_t bad[B * K];
    memcpy(bad, r.routes, sizeof(bad));
    bad[4] = (int32_t)r.n;
    callres cbad = {.k = r.n};
    cr_assert_eq(hm_moe_forward_routed(sw.client, r.ex, r.n, bad, K, x, B, DIM, y, &o, on_call,
                                       &cbad, NULL),
                 -EINVAL);
    o.k_min = K + 1;
    cr_assert_eq(hm_moe_forward_routed(sw.client, r.ex, r.n, r.routes, K, x, B, DIM, y, &o,
                                       on_call, &cbad, NULL),
                 -EINVAL);
    run_for(&sw.loop, 50);
    cr_assert_eq(cbad.calls, 0);
    swarm_stop(&sw);
}

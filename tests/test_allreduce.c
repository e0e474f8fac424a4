/*
 * Tests for the butterfly all-reduce: 2 to 8 real hm_rpc nodes in one
 * process on one libuv loop, on 127.0.0.1 with kernel-chosen ports. They
 * check the layout, that every member gets the weighted average within
 * 1e-6 relative (uneven bandwidths, client-mode members, sizes not
 * divisible by the group size, several chunks per span), fp16 and 8-bit
 * within their documented bounds, that a member that never starts is left
 * out and the rest finish in time with the average over themselves, that a
 * reducer stalled mid-round has its span reassigned and every survivor's
 * result is the weighted average over the survivors exactly,
 * that a member sending NaN or a vector of the wrong size is left out
 * without touching the others' result, that a reducer crashing mid-round
 * (its parts already in averages others handed out) is undone everywhere
 * so every span is over the survivors exactly (also with chunks reduced on
 * workers, and for a reducer that cancels its round instead), and that
 * parts sent before a member started are retried until it does.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "averaging/allreduce.h"
#include "averaging/codec.h"
#include "src/base/crypto.h"
#include "src/net/rpc.h"
#include "src/net/transport.h"
#include "src/base/util.h"

#define MAXN 8

static uv_loop_t loop;
static uint8_t swarm[HM_SWARM_ID_BYTES];

typedef struct tnode {
    hm_identity id;
    hm_rpc *rpc;
    hm_ar_ctx *ctx;
    struct sockaddr_storage addr;
    float *data;  /* averaged in place */
    float *orig;  /* what it started with */
    double weight;
    hm_ar_round *round;
    int done;
    hm_ar_report rep;
    uint64_t done_ms;
} tnode;

static tnode nodes[MAXN];
static int n_nodes;

static void setup(void)
{
    /*
     * As in hivemindd (src/node/node.h): a write to a peer that has just
     * closed (the crashed reducer below) must not kill the process.
     */
    signal(SIGPIPE, SIG_IGN);
    hm_log_set_level(getenv("HM_TEST_DEBUG") != NULL ? HM_LOG_DEBUG : HM_LOG_ERROR);
    cr_assert_eq(hm_crypto_init(), 0);
    cr_assert_eq(uv_loop_init(&loop), 0);
    hm_swarm_id("allreduce-test", NULL, 0, swarm);
    memset(nodes, 0, sizeof(nodes));
    n_nodes = 0;
}

static void on_tick(uv_timer_t *t) { HM_UNUSED(t); }

static int count_done(void)
{
    int c = 0;
    for (int i = 0; i < n_nodes; i++)
        c += nodes[i].done;
    return c;
}

/* Runs the loop until `target` nodes are done or max_ms passes. */
static int run_until_done(int target, uint64_t max_ms)
{
    uint64_t end = hm_now_ms() + max_ms;
    uv_timer_t tick;
    uv_timer_init(&loop, &tick);
    uv_timer_start(&tick, on_tick, 5, 5);
    while (count_done() < target && hm_now_ms() < end)
        uv_run(&loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&tick, NULL);
    uv_run(&loop, UV_RUN_NOWAIT);
    return count_done() >= target;
}

static void run_for(uint64_t ms) { run_until_done(MAXN + 1, ms); }

static void on_closed(void *ud) { (*(int *)ud)++; }

static void nodes_start(int n)
{
    n_nodes = n;
    for (int i = 0; i < n; i++) {
        tnode *t = &nodes[i];
        hm_transport_config cfg = {.listen = "127.0.0.1:0"};
        cr_assert_eq(hm_identity_generate(&t->id), 0);
        cr_assert_eq(hm_rpc_new(&loop, &t->id, swarm, &cfg, NULL, &t->rpc), 0);
        cr_assert_eq(hm_transport_local_addr(hm_rpc_transport(t->rpc), &t->addr), 0);
        cr_assert_eq(hm_ar_ctx_new(&loop, t->rpc, &t->id, &t->ctx), 0);
    }
}

static void nodes_stop(void)
{
    int closed = 0;
    for (int i = 0; i < n_nodes; i++) {
        if (nodes[i].rpc == NULL) { /* crashed earlier, already closed */
            closed += 2;
            continue;
        }
        hm_ar_ctx_close(nodes[i].ctx, on_closed, &closed);
        hm_rpc_close(nodes[i].rpc, on_closed, &closed);
    }
    uint64_t end = hm_now_ms() + 3000;
    while (closed < 2 * n_nodes && hm_now_ms() < end)
        uv_run(&loop, UV_RUN_ONCE);
    cr_assert_eq(closed, 2 * n_nodes, "contexts, rpc and transports close");
    for (int i = 0; i < n_nodes; i++) {
        free(nodes[i].data);
        free(nodes[i].orig);
        hm_identity_wipe(&nodes[i].id);
    }
    uv_run(&loop, UV_RUN_NOWAIT);
    cr_expect_eq(uv_loop_close(&loop), 0, "every handle is closed at the end");
}

static void make_group(hm_avg_group *g, int n, const double *bw, uint8_t tag)
{
    memset(g, 0, sizeof(*g));
    memset(g->group_id, tag, sizeof(g->group_id));
    g->n = (size_t)n;
    for (int i = 0; i < n; i++) {
        memcpy(g->members[i].pk, nodes[i].id.pk, HM_PK_BYTES);
        g->members[i].addr = nodes[i].addr;
        g->members[i].bandwidth = bw[i];
    }
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / (double)(1ull << 53);
}

static void fill(int i, size_t n, double weight)
{
    tnode *t = &nodes[i];
    t->data = malloc(n * sizeof(float));
    t->orig = malloc(n * sizeof(float));
    for (size_t k = 0; k < n; k++)
        t->data[k] = t->orig[k] = (float)(rnd() * 4.0 - 2.0 + i);
    t->weight = weight;
}

static void done_cb(void *ud, const hm_ar_report *rep)
{
    tnode *t = ud;
    t->done++;
    t->rep = *rep;
    t->done_ms = hm_now_ms();
}

static void start(int i, const hm_avg_group *g0, size_t n, const hm_ar_config *cfg)
{
    hm_avg_group g = *g0;
    g.self = (size_t)i;
    cr_assert_eq(hm_ar_start(nodes[i].ctx, &g, nodes[i].data, n, nodes[i].weight, cfg, done_cb,
                             &nodes[i], &nodes[i].round),
                 0);
}

/* Weighted average over the members in mask, element k. */
static double expect(uint64_t mask, size_t k)
{
    double s = 0, w = 0;
    for (int j = 0; j < n_nodes; j++)
        if (mask & (1ull << j)) {
            s += nodes[j].weight * nodes[j].orig[k];
            w += nodes[j].weight;
        }
    return s / w;
}

static void check_close(const float *got, uint64_t mask, size_t from, size_t to, double rel,
                        double abs_tol, int who)
{
    for (size_t k = from; k < to; k++) {
        double e = expect(mask, k);
        double tol = rel * fabs(e) + abs_tol;
        if (fabs(got[k] - e) > tol)
            cr_assert_fail("node %d element %zu: got %.9g, expected %.9g over mask %#llx", who, k,
                           (double)got[k], e, (unsigned long long)mask);
    }
}

/* Every span of node i is the weighted average over `mask`, and its report says so. */
static void check_exact(int i, uint64_t mask)
{
    tnode *t = &nodes[i];
    for (size_t s = 0; s < t->rep.n_spans; s++) {
        const hm_ar_span_report *sp = &t->rep.spans[s];
        if (sp->count == 0)
            continue;
        cr_assert_eq(sp->chunks_local, 0, "node %d span %zu fully averaged", i, s);
        cr_assert_eq(sp->contributors, mask, "node %d span %zu contributors %#llx", i, s,
                     (unsigned long long)sp->contributors);
        cr_assert_eq(sp->partial, 0);
        check_close(t->data, mask, sp->offset, sp->offset + sp->count, 1e-6, 1e-9, i);
    }
}

static const double bw8[MAXN] = {100, 0, 250, 60, 80, 0, 1000, 33};

TestSuite(allreduce, .init = setup, .timeout = 60);

Test(allreduce, layout_is_proportional_and_covers_everything)
{
    hm_avg_group g;
    size_t off[MAXN], cnt[MAXN];
    nodes_start(0);
    memset(&g, 0, sizeof(g));
    g.n = 4;
    double bw[4] = {100, 0, 300, 100};
    for (int i = 0; i < 4; i++)
        g.members[i].bandwidth = bw[i];
    cr_assert_eq(hm_ar_layout(&g, 1000003, off, cnt), 0);
    size_t pos = 0;
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(off[i], pos);
        pos += cnt[i];
    }
    cr_assert_eq(pos, 1000003);
    cr_assert_eq(cnt[1], 0, "a client reduces nothing");
    /* 300 is clamped to twice the median bandwidth (100): twice member 0's span. */
    cr_assert(cnt[2] + 2 >= 2 * cnt[0] && cnt[2] <= 2 * cnt[0] + 2, "%zu vs %zu", cnt[2], cnt[0]);
    /* Without the bound (a factor that never bites) the layout is proportional. */
    cr_assert_eq(hm_ar_layout_bounded(&g, 1000003, 1e9, off, cnt), 0);
    cr_assert(cnt[2] + 3 >= 3 * cnt[0] && cnt[2] <= 3 * cnt[0] + 3);
    for (int i = 0; i < 4; i++)
        g.members[i].bandwidth = 0;
    cr_assert_eq(hm_ar_layout(&g, 10, off, cnt), -EHOSTUNREACH);
    g.members[0].bandwidth = NAN;
    cr_assert_eq(hm_ar_layout(&g, 10, off, cnt), -EHOSTUNREACH);
    g.members[3].bandwidth = 1;
    cr_assert_eq(hm_ar_layout(&g, 10, off, cnt), 0);
    cr_assert_eq(cnt[3], 10);
    nodes_stop();
}

/* Averaging workers per node for exact_round (0: chunks finalized on the loop). */
static unsigned round_workers;

static void exact_round(int n, size_t len, size_t chunk, size_t window)
{
    hm_avg_group g;
    hm_ar_config cfg = {.round_timeout_ms = 20000, .chunk_elems = chunk, .window = window};
    nodes_start(n);
    for (int i = 0; i < n && round_workers > 0; i++)
        cr_assert_eq(hm_ar_set_workers(nodes[i].ctx, round_workers), 0);
    double bw[MAXN];
    for (int i = 0; i < n; i++) {
        bw[i] = bw8[i];
        fill(i, len, 1.0 + 3.0 * rnd());
    }
    if (n == 2)
        bw[1] = 0; /* pairwise with one client: the other reduces everything */
    make_group(&g, n, bw, (uint8_t)(0x10 + n));
    uint64_t t0 = hm_now_ms();
    for (int i = 0; i < n; i++)
        start(i, &g, len, &cfg);
    cr_assert(run_until_done(n, 20000), "every member finishes");
    uint64_t all = (n == 64) ? ~0ull : (1ull << n) - 1;
    for (int i = 0; i < n; i++) {
        cr_assert_eq(nodes[i].rep.status, 0, "node %d status %d", i, nodes[i].rep.status);
        cr_assert_eq(nodes[i].rep.group_size, (size_t)n);
        for (int j = 0; j < n; j++)
            cr_assert_eq(nodes[i].rep.reason[j], HM_AR_IN);
        check_exact(i, all);
        if (n > 1)
            cr_assert(nodes[i].rep.bytes_sent > 0 && nodes[i].rep.bytes_received > 0);
        for (size_t s = 0; s < nodes[i].rep.n_spans; s++) {
            const hm_ar_span_report *sp = &nodes[i].rep.spans[s];
            cr_assert_eq(sp->count == 0, bw[s] == 0, "spans follow bandwidth");
            if (sp->count > 0)
                cr_assert_eq(sp->final_reducer, (int)s);
        }
    }
    cr_log_info("%d members, %zu floats: %llu ms", n, len,
                (unsigned long long)(hm_now_ms() - t0));
    nodes_stop();
}

Test(allreduce, two_members_one_client) { exact_round(2, 10007, 1000, 4); }
Test(allreduce, three_members) { exact_round(3, 50001, 4096, 8); }

/* Chunks reduced and encoded on worker threads: the same exact average. */
Test(allreduce, four_members_on_workers)
{
    round_workers = 2;
    exact_round(4, 300007, 4096, 8);
}
Test(allreduce, five_members_one_chunk_each) { exact_round(5, 997, 131072, 8); }
Test(allreduce, eight_members_many_chunks) { exact_round(8, 300007, 8192, 8); }
Test(allreduce, one_member) { exact_round(1, 1234, 100, 2); }

Test(allreduce, fp16_and_8bit_within_bounds)
{
    for (int comp = HM_AVG_COMP_FP16; comp <= HM_AVG_COMP_UINT8; comp++) {
        hm_avg_group g;
        hm_ar_config cfg = {.round_timeout_ms = 10000, .chunk_elems = 2048, .compression = comp};
        size_t len = 20001;
        if (comp != HM_AVG_COMP_FP16)
            setup(); /* the first pass runs on the suite's setup */
        nodes_start(4);
        double bw[4] = {1, 1, 2, 0};
        for (int i = 0; i < 4; i++)
            fill(i, len, 1.0 + i);
        make_group(&g, 4, bw, (uint8_t)(0x30 + comp));
        for (int i = 0; i < 4; i++)
            start(i, &g, len, &cfg);
        cr_assert(run_until_done(4, 10000));
        for (int i = 0; i < 4; i++) {
            cr_assert_eq(nodes[i].rep.status, 0);
            /*
             * Values lie in [-2, 5]. fp16: every part and the reply are
             * within 2^-11 relative (|x| <= 5, so 2.5e-3 absolute each way).
             * 8-bit: half a step of the chunk's range (at most 7/510 each
             * way). Our own contribution never goes through the codec.
             */
            double tol = comp == HM_AVG_COMP_FP16 ? 2 * 5.0 / 2048 : 2 * 7.0 / 510 + 1e-5;
            check_close(nodes[i].data, 0xf, 0, len, 0, tol, i);
        }
        nodes_stop();
    }
}

static double gauss(void)
{
    double u = rnd(), v = rnd();
    if (u < 1e-300)
        u = 1e-300;
    return sqrt(-2.0 * log(u)) * cos(2.0 * M_PI * v);
}

/* torch.linspace(a, b, n) ** 0.5, in float32 as torch computes it. */
static void sqrt_linspace(float *x, size_t n, float a, float b)
{
    float step = (b - a) / (float)(n - 1);
    for (size_t i = 0; i < n; i++)
        x[i] = sqrtf(a + step * (float)i);
}

typedef struct prec {
    double mse[MAXN][2];  /* per node, per tensor */
    double maxabs[MAXN][2];
    float orig0[2000], data0[2000]; /* member 0's input and result */
    double mean[2000];              /* the exact mean */
} prec;

/*
 * One round over Hivemind's test_allreduce_compression data: every member
 * holds two tensors of 1000 values, sqrt(linspace(...)) (members close to
 * each other, as parameters of one model are) and randn(1000); member 0
 * has sqrt(linspace(0, 500)), member 1 sqrt(linspace(300, 800)), further
 * members linspaces in between. Records each member's mean square and
 * largest error per tensor against the exact mean.
 */
static void hivemind_round(int n, const double *bw, int comp, prec *out)
{
    const size_t T = 1000, len = 2 * T;
    hm_avg_group g;
    hm_ar_config cfg = {.round_timeout_ms = 10000, .compression = comp};
    nodes_start(n);
    for (int i = 0; i < n; i++) {
        tnode *t = &nodes[i];
        t->data = malloc(len * sizeof(float));
        t->orig = malloc(len * sizeof(float));
        float lo = (float)(300.0 * i / (n - 1)), hi = lo + 500.0f;
        sqrt_linspace(t->orig, T, lo, hi);
        for (size_t k = 0; k < T; k++)
            t->orig[T + k] = (float)gauss();
        memcpy(t->data, t->orig, len * sizeof(float));
        t->weight = 1.0;
    }
    make_group(&g, n, bw, (uint8_t)(0x38 + comp + 4 * n));
    for (int i = 0; i < n; i++)
        start(i, &g, len, &cfg);
    cr_assert(run_until_done(n, 10000));
    uint64_t all = (1ull << n) - 1;
    for (int i = 0; i < n; i++) {
        cr_assert_eq(nodes[i].rep.status, 0, "node %d: %d", i, nodes[i].rep.status);
        for (int k = 0; k < 2; k++) {
            double se = 0, mx = 0;
            for (size_t e = k * T; e < (k + 1) * T; e++) {
                double d = (double)nodes[i].data[e] - expect(all, e);
                se += d * d;
                mx = HM_MAX(mx, fabs(d));
            }
            out->mse[i][k] = se / (double)T;
            out->maxabs[i][k] = mx;
        }
    }
    for (size_t e = 0; e < len; e++)
        out->mean[e] = expect(all, e);
    memcpy(out->orig0, nodes[0].orig, sizeof(out->orig0));
    memcpy(out->data0, nodes[0].data, sizeof(out->data0));
    nodes_stop();
}

static void hivemind_case(int n, const double *bw, const char *what)
{
    static const char *names[] = {"none", "fp16", "8-bit"};
    for (int comp = HM_AVG_COMP_FP16; comp <= HM_AVG_COMP_UINT8; comp++) {
        prec p;
        setup();
        hivemind_round(n, bw, comp, &p);
        for (int i = 0; i < n; i++)
            for (int k = 0; k < 2; k++) {
                cr_log_info("%s, %s: member %d tensor %d: mean square error %.3g, largest %.3g",
                            what, names[comp], i, k, p.mse[i][k], p.maxabs[i][k]);
                /*
                 * Hivemind's own bounds on this data (its
                 * test_allreduce_compression): fp16 within 1e-5 mean square,
                 * 8 bits within 1e-2; and above 0, or nothing was rounded.
                 */
                cr_assert_gt(p.mse[i][k], 0, "compression was applied");
                if (comp == HM_AVG_COMP_FP16)
                    cr_assert_leq(p.mse[i][k], 1e-5, "%s fp16 member %d tensor %d: %.3g", what, i,
                                  k, p.mse[i][k]);
                else
                    cr_assert_leq(p.mse[i][k], 1e-2, "%s 8-bit member %d tensor %d: %.3g", what,
                                  i, k, p.mse[i][k]);
            }
        /*
         * A member whose whole vector another reduced (the reducer's own
         * part is exact) has its own rounding taken out and only the
         * difference's rounding left: with fp16, element by element, half
         * an ulp of the difference from the mean (2^-11 of it), not of
         * the value (the old answer, the average rounded, was off by up to
         * half an ulp of 28 on top of the member's own rounding).
         */
        if (bw[0] == 0 && comp == HM_AVG_COMP_FP16) {
            for (size_t e = 0; e < 2000; e++) {
                double m = p.mean[e];
                double d = fabs(m - (double)p.orig0[e]);
                double err = fabs((double)p.data0[e] - m);
                cr_assert_leq(err, d * (1.0 / 2048) * 1.01 + 1e-6,
                              "client fp16 element %zu: error %.3g, difference %.3g", e, err, d);
            }
        }
        /*
         * The same with 8 bits: the client's error is the rounding of the
         * difference alone, a step of the difference's range (one chunk
         * here), so its mean square is about step^2 / 12; the old answer
         * rounded the average, whose range (-3 to 28) is about 3 times
         * larger, on top of the client's own rounding.
         */
        if (bw[0] == 0 && comp == HM_AVG_COMP_UINT8) {
            double lo = INFINITY, hi = -INFINITY, se = 0;
            for (size_t e = 0; e < 2000; e++) {
                double d = p.mean[e] - (double)p.orig0[e];
                lo = HM_MIN(lo, d);
                hi = HM_MAX(hi, d);
                se += ((double)p.data0[e] - p.mean[e]) * ((double)p.data0[e] - p.mean[e]);
            }
            double step = (hi - lo) / 255.0;
            cr_assert_leq(se / 2000, 2.0 * step * step / 12.0, "client 8-bit: %.3g vs step %.3g",
                          se / 2000, step);
        }
    }
}

/* Hivemind's case: a client and a reducer (its test runs averager 1 in client mode). */
Test(allreduce, compressed_pair_with_client_keeps_hivemind_precision)
{
    static const double bw[2] = {0, 1};
    hivemind_case(2, bw, "client+reducer");
}

Test(allreduce, compressed_pair_keeps_hivemind_precision)
{
    static const double bw[2] = {1, 1};
    hivemind_case(2, bw, "pair");
}

Test(allreduce, compressed_four_keep_hivemind_precision)
{
    static const double bw[4] = {1, 1, 1, 1};
    hivemind_case(4, bw, "four");
}

/* A member that never starts its round (it never sends, and answers "not ready"). */
static void absent_member(int absent, double absent_bw)
{
    hm_avg_group g;
    hm_ar_config cfg = {.round_timeout_ms = 3000, .chunk_elems = 4096};
    size_t len = 30011;
    nodes_start(4);
    double bw[4] = {100, 200, 0, 150};
    bw[absent] = absent_bw;
    for (int i = 0; i < 4; i++)
        fill(i, len, 1.0 + i);
    make_group(&g, 4, bw, (uint8_t)(0x40 + absent));
    uint64_t t0 = hm_now_ms();
    for (int i = 0; i < 4; i++)
        if (i != absent)
            start(i, &g, len, &cfg);
    cr_assert(run_until_done(3, 5000));
    uint64_t live = 0xfull & ~(1ull << absent);
    for (int i = 0; i < 4; i++) {
        if (i == absent)
            continue;
        cr_assert_leq(nodes[i].done_ms - t0, cfg.round_timeout_ms + 1000,
                      "finished within the round timeout + 1 s");
        cr_assert_eq(nodes[i].rep.status, 0, "node %d: %d", i, nodes[i].rep.status);
        cr_assert_eq(nodes[i].rep.reason[absent], absent_bw > 0 ? HM_AR_DEAD : HM_AR_LATE,
                     "node %d says %d", i, nodes[i].rep.reason[absent]);
        check_exact(i, live);
        if (absent_bw > 0) {
            int fr = nodes[i].rep.spans[absent].final_reducer;
            cr_assert(fr >= 0 && fr != absent && bw[fr] > 0, "span reassigned to a reducer");
        }
    }
    nodes_stop();
}

Test(allreduce, absent_reducer_is_left_out) { absent_member(3, 150); }
Test(allreduce, absent_client_is_left_out) { absent_member(2, 0); }

/* Runs the loop until node i has put at least `bytes` on the wire. */
static void run_until_sent(int i, uint64_t bytes, uint64_t max_ms)
{
    uint64_t end = hm_now_ms() + max_ms;
    hm_transport_stats st;
    for (;;) {
        hm_transport_get_stats(hm_rpc_transport(nodes[i].rpc), &st);
        if (st.bytes_out >= bytes || hm_now_ms() >= end)
            break;
        uv_run(&loop, UV_RUN_ONCE);
    }
}

static void stalled_reducer(int mid)
{
    hm_avg_group g;
    hm_ar_config cfg = {.round_timeout_ms = 4000, .chunk_elems = 2048, .window = 4};
    size_t len = mid ? 400009 : 40009;
    const int victim = 1;
    nodes_start(5);
    double bw[5] = {100, 300, 100, 0, 120};
    for (int i = 0; i < 5; i++)
        fill(i, len, 0.5 + i);
    make_group(&g, 5, bw, (uint8_t)(0x50 + mid));
    uint64_t t0 = hm_now_ms();
    for (int i = 0; i < 5; i++)
        start(i, &g, len, &cfg);
    /* Stalled after it started: right away, or once it has sent some parts. */
    if (mid)
        run_until_sent(victim, 200000, 2000);
    hm_transport_faults f = {.stall = 1};
    hm_transport_set_faults(hm_rpc_transport(nodes[victim].rpc), &f);
    /* The survivors, and maybe the stalled member, which finds itself alone. */
    uint64_t end = hm_now_ms() + 6000;
    for (;;) {
        int d = 0;
        for (int i = 0; i < 5; i++)
            d += i != victim && nodes[i].done;
        if (d == 4 || hm_now_ms() > end)
            break;
        run_for(5);
    }

    uint64_t live = 0x1full & ~(1ull << victim);
    for (int i = 0; i < 5; i++) {
        if (i == victim)
            continue;
        tnode *t = &nodes[i];
        cr_assert_leq(t->done_ms - t0, cfg.round_timeout_ms + 1000);
        cr_assert_eq(t->rep.status, 0, "node %d: %d", i, t->rep.status);
        cr_assert_eq(t->rep.reason[victim], HM_AR_DEAD);
        const hm_ar_span_report *vs = &t->rep.spans[victim];
        cr_assert(vs->final_reducer >= 0 && vs->final_reducer != victim);
        cr_assert_eq(vs->chunks_local, 0);
        cr_assert_eq(vs->contributors, live, "the dead reducer's span is over the survivors");
        for (size_t s = 0; s < t->rep.n_spans; s++) {
            const hm_ar_span_report *sp = &t->rep.spans[s];
            if (sp->count == 0)
                continue;
            cr_assert_eq(sp->chunks_local, 0);
            /*
             * Even when the victim's parts were already in averages that
             * other reducers had handed out, those chunks are averaged again
             * without it: every span is over the survivors exactly.
             */
            cr_assert_eq(sp->contributors, live, "node %d span %zu: %#llx", i, s,
                         (unsigned long long)sp->contributors);
            cr_assert_eq(sp->partial, 0);
            /* Whoever is in each chunk, the survivors agree on every value. */
            for (int o = 0; o < 5; o++)
                if (o != victim && o != i)
                    cr_assert_eq(memcmp(t->data + sp->offset, nodes[o].data + sp->offset,
                                        sp->count * sizeof(float)),
                                 0, "nodes %d and %d agree on span %zu", i, o, s);
            if (sp->partial == 0)
                check_close(t->data, sp->contributors, sp->offset, sp->offset + sp->count, 1e-6,
                            1e-9, i);
        }
        check_exact(i, live);
    }
    /* The stalled member gives up by its own deadline, knowing it averaged with nobody. */
    cr_assert(run_until_done(5, 3000));
    cr_assert_neq(nodes[victim].rep.status, 0, "the cut-off member says so");
    f.stall = 0;
    hm_transport_set_faults(hm_rpc_transport(nodes[victim].rpc), &f);
    nodes_stop();
}

Test(allreduce, reducer_stalled_at_start_is_replaced) { stalled_reducer(0); }
Test(allreduce, reducer_stalled_mid_round_is_replaced) { stalled_reducer(1); }

/*
 * A reducer that crashes while it reduces its span: the others' parts have
 * reached it, and its own parts are already in averages the other reducers
 * handed out. Its connections close (as when its process is killed), and
 * the survivors undo every average that holds it: every span of every
 * survivor is the weighted average over the survivors exactly, and they all
 * hold the same values. With crash 0 it leaves by hm_ar_cancel instead and
 * its rpc stays up, so that its refusals (the calls it held, the parts sent
 * to it afterwards) reach the others: they must read them as the reducer
 * gone, not as their own lateness. workers: each node's averaging workers.
 */
static void lost_reducer(unsigned workers, int crash)
{
    hm_avg_group g;
    hm_ar_config cfg = {.round_timeout_ms = 5000, .chunk_elems = 2048, .window = 4};
    size_t len = 600011;
    const int victim = 2;
    nodes_start(4);
    for (int i = 0; i < 4 && workers > 0; i++)
        cr_assert_eq(hm_ar_set_workers(nodes[i].ctx, workers), 0);
    double bw[4] = {100, 100, 100, 100};
    for (int i = 0; i < 4; i++)
        fill(i, len, 0.5 + i);
    make_group(&g, 4, bw, 0x5c);
    uint64_t t0 = hm_now_ms();
    for (int i = 0; i < 4; i++)
        start(i, &g, len, &cfg);
    /* Well into the round: parts in both directions, chunks finalized everywhere. */
    run_until_sent(victim, 400000, 3000);
    hm_transport_stats st;
    hm_transport_get_stats(hm_rpc_transport(nodes[victim].rpc), &st);
    cr_assert_gt(st.bytes_in, 100000, "others' parts reached the victim");
    cr_assert_eq(nodes[victim].done, 0, "the victim was still reducing");
    int crashed = 0;
    if (crash) {
        hm_ar_ctx_close(nodes[victim].ctx, on_closed, &crashed);
        hm_rpc_close(nodes[victim].rpc, on_closed, &crashed);
        nodes[victim].ctx = NULL;
        nodes[victim].rpc = NULL;
    } else {
        hm_ar_cancel(nodes[victim].round);
    }
    cr_assert(run_until_done(4, cfg.round_timeout_ms + 2000));
    if (crash)
        cr_assert_eq(crashed, 2);
    else
        cr_assert_eq(nodes[victim].rep.status, -ECANCELED);

    uint64_t live = 0xfull & ~(1ull << victim);
    for (int i = 0; i < 4; i++) {
        if (i == victim)
            continue;
        tnode *t = &nodes[i];
        cr_assert_leq(t->done_ms - t0, cfg.round_timeout_ms + 1000);
        cr_assert_eq(t->rep.status, 0, "node %d: %d", i, t->rep.status);
        cr_assert_eq(t->rep.reason[victim], HM_AR_DEAD);
        cr_assert_neq(t->rep.spans[victim].final_reducer, victim);
        check_exact(i, live);
        for (int o = 0; o < 4; o++)
            if (o != victim && o != i)
                cr_assert_eq(memcmp(t->data, nodes[o].data, len * sizeof(float)), 0,
                             "nodes %d and %d agree", i, o);
    }
    nodes_stop();
}

Test(allreduce, reducer_crashed_mid_round_is_undone_everywhere) { lost_reducer(0, 1); }

/* The same crash with chunks reduced and encoded on workers: jobs are out when it lands. */
Test(allreduce, reducer_crashed_mid_round_on_workers) { lost_reducer(2, 1); }

/* A reducer that cancels its round mid-way is gone for the round (-ESHUTDOWN), like a crash. */
Test(allreduce, reducer_cancelled_mid_round_is_undone_everywhere) { lost_reducer(0, 0); }
Test(allreduce, reducer_cancelled_mid_round_on_workers) { lost_reducer(2, 0); }

static void part_reply_cb(void *ud, int status, const uint8_t *body, size_t len)
{
    HM_UNUSED(body);
    HM_UNUSED(len);
    int *st = ud;
    *st = status;
}

Test(allreduce, nan_sender_is_left_out)
{
    hm_avg_group g;
    hm_ar_config cfg = {.round_timeout_ms = 4000, .chunk_elems = 4096};
    size_t len = 20011;
    const int bad = 3;
    nodes_start(4);
    double bw[4] = {100, 100, 50, 100};
    for (int i = 0; i < 4; i++)
        fill(i, len, 1.0 + i);
    make_group(&g, 4, bw, 0x60);
    for (int i = 0; i < 4; i++)
        if (i != bad)
            start(i, &g, len, &cfg);
    run_for(30);

    /* Member 3 sends, by hand, a chunk holding a NaN to the reducer of span 0. */
    size_t off[4], cnt[4];
    cr_assert_eq(hm_ar_layout(&g, len, off, cnt), 0);
    size_t c = HM_MIN(cfg.chunk_elems, cnt[0]);
    uint8_t *chunk = malloc(HM_AVG_CHUNK_HEADER + c * 4);
    float *vals = malloc(c * 4);
    for (size_t k = 0; k < c; k++)
        vals[k] = 1.0f;
    size_t clen;
    cr_assert_eq(hm_avg_chunk_encode(HM_AVG_COMP_NONE, vals, c, chunk, HM_AVG_CHUNK_HEADER + c * 4,
                                     &clen),
                 0);
    float nan = NAN;
    memcpy(chunk + HM_AVG_CHUNK_HEADER + 4 * 7, &nan, 4);
    hm_ar_part_msg m = {.sender = bad, .n_total = len, .span = 0, .chunk = 0,
                        .kind = HM_AR_DATA, .weight = 1.0, .data = chunk, .data_len = clen};
    memcpy(m.group_id, g.group_id, sizeof(m.group_id));
    hm_wire_wr w;
    hm_wire_wr_init_dynamic(&w, 1 << 20);
    hm_ar_part_encode(&w, &m);
    size_t blen;
    uint8_t *body = hm_wire_wr_steal(&w, &blen);
    int st = 1;
    cr_assert_eq(hm_rpc_call(nodes[bad].rpc, nodes[0].id.pk, (struct sockaddr *)&nodes[0].addr,
                             HM_AR_PART_METHOD, body, blen, HM_RPC_STREAM, 2000, part_reply_cb,
                             &st, NULL),
                 0);
    free(body);
    free(chunk);
    free(vals);

    cr_assert(run_until_done(3, 6000));
    cr_assert_eq(st, -EDOM, "the NaN part is refused");
    for (int i = 0; i < 4; i++) {
        if (i == bad)
            continue;
        cr_assert_eq(nodes[i].rep.status, 0);
        cr_assert_eq(nodes[i].rep.reason[bad], HM_AR_BAD, "node %d: %d", i,
                     nodes[i].rep.reason[bad]);
        check_exact(i, 0x7);
    }
    nodes_stop();
}

/*
 * Member `quit` of three leaves its round early: with cancel, its caller
 * cancels it as it begins; otherwise its caller says the input was checked
 * (input_checked, as the averager does) but passes a NaN in the span it
 * reduces itself, so hm_ar_start skips its pass over the vector and the
 * chunk is refused when it is reduced (the round ends -EDOM) and the NaN
 * reaches no one. Either way it says farewell: the others undo it and
 * average without it, exact, well before their part timeout (1.2 s here)
 * would have found it late.
 */
static void quitting_member(int cancel)
{
    hm_avg_group g;
    hm_ar_config cfg = {.round_timeout_ms = 6000, .chunk_elems = 4096};
    hm_ar_config checked = cfg;
    checked.input_checked = 1;
    size_t len = 30011;
    const int quit = cancel ? 1 : 2;
    nodes_start(3);
    double bw[3] = {100, 100, 100};
    for (int i = 0; i < 3; i++)
        fill(i, len, 1.0 + i);
    make_group(&g, 3, bw, (uint8_t)(0x61 + cancel));
    size_t off[3], cnt[3];
    cr_assert_eq(hm_ar_layout(&g, len, off, cnt), 0);
    if (!cancel)
        nodes[quit].data[off[quit] + cnt[quit] / 2] = NAN;
    uint64_t t0 = hm_now_ms();
    for (int i = 0; i < 3; i++)
        start(i, &g, len, i == quit && !cancel ? &checked : &cfg);
    if (cancel)
        hm_ar_cancel(nodes[quit].round);
    cr_assert(run_until_done(3, 15000), "every member finishes");
    cr_assert_eq(nodes[quit].rep.status, cancel ? -ECANCELED : -EDOM, "status %d",
                 nodes[quit].rep.status);
    for (int i = 0; i < 3; i++) {
        cr_assert(hm_avg_all_finite(nodes[i].data, i == quit && !cancel ? off[quit] : len),
                  "node %d holds no NaN", i);
        if (i == quit)
            continue;
        cr_assert_eq(nodes[i].rep.status, 0, "node %d status %d", i, nodes[i].rep.status);
        cr_assert_eq(nodes[i].rep.reason[quit], HM_AR_DEAD, "node %d says %d", i,
                     nodes[i].rep.reason[quit]);
        cr_assert_lt(nodes[i].done_ms - t0, 1000, "node %d finished in %llu ms", i,
                     (unsigned long long)(nodes[i].done_ms - t0));
        check_exact(i, 0x7u & ~(1u << quit));
    }
    nodes_stop();
}

Test(allreduce, a_member_that_quits_says_farewell_and_is_undone) { quitting_member(0); }
Test(allreduce, a_cancelled_member_says_farewell_and_is_undone) { quitting_member(1); }

Test(allreduce, wrong_size_member_is_left_out)
{
    hm_avg_group g;
    hm_ar_config cfg = {.round_timeout_ms = 4000, .chunk_elems = 4096};
    size_t len = 20011;
    const int bad = 2;
    nodes_start(4);
    double bw[4] = {100, 100, 100, 0};
    for (int i = 0; i < 4; i++)
        fill(i, len + 7, 1.0 + i);
    make_group(&g, 4, bw, 0x61);
    for (int i = 0; i < 4; i++)
        start(i, &g, i == bad ? len + 7 : len, &cfg);
    cr_assert(run_until_done(4, 6000));
    cr_assert_neq(nodes[bad].rep.status, 0, "the odd one out knows");
    for (int i = 0; i < 4; i++) {
        if (i == bad)
            continue;
        cr_assert_eq(nodes[i].rep.status, 0, "node %d: %d", i, nodes[i].rep.status);
        cr_assert_eq(nodes[i].rep.reason[bad], HM_AR_BAD);
        check_exact(i, 0xb);
    }
    nodes_stop();
}

Test(allreduce, early_parts_wait_for_a_late_starter)
{
    hm_avg_group g;
    hm_ar_config cfg = {.round_timeout_ms = 5000, .chunk_elems = 3000};
    size_t len = 17001;
    nodes_start(3);
    double bw[3] = {100, 100, 100};
    for (int i = 0; i < 3; i++)
        fill(i, len, 1.0 + i);
    make_group(&g, 3, bw, 0x70);
    start(0, &g, len, &cfg);
    start(1, &g, len, &cfg);
    run_for(300);
    cr_assert_eq(count_done(), 0);
    start(2, &g, len, &cfg);
    cr_assert(run_until_done(3, 5000));
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(nodes[i].rep.status, 0);
        check_exact(i, 0x7);
    }
    nodes_stop();
}

/* ---- bounds on what members declare (allreduce.h, "Bounds") ---- */

Test(allreduce, weight_cap_is_a_factor_of_the_lower_median)
{
    double a[4] = {1, 1, 1, 1e30};
    cr_assert_eq(hm_ar_weight_cap(a, 4, 4.0), 4.0);
    double b[3] = {0, 0, 2.5}; /* zero weights are not in the median */
    cr_assert_eq(hm_ar_weight_cap(b, 3, 4.0), 10.0);
    double c[2] = {3, 1}; /* two members: the smaller, so neither outweighs the other by more */
    cr_assert_eq(hm_ar_weight_cap(c, 2, 1.0), 1.0);
    double d[3] = {0, 0, 0};
    cr_assert_eq(hm_ar_weight_cap(d, 3, 4.0), 0.0);
    double e[3] = {1.7e308, 1.7e308, 1}; /* a majority of huge weights: no cap, no trap */
    cr_assert(isinf(hm_ar_weight_cap(e, 3, 4.0)));
    hm_ar_limit_cfg lim;
    hm_ar_limit_defaults(&lim);
    cr_assert_eq(lim.weight_factor, 4.0);
    cr_assert_eq(lim.clip_weight_factor, 1.0);
    cr_assert_eq(lim.bandwidth_factor, 2.0);
}

Test(allreduce, layout_bounds_a_huge_bandwidth)
{
    hm_avg_group g;
    size_t off[MAXN], cnt[MAXN];
    memset(&g, 0, sizeof(g));
    g.n = 4;
    double bw[4] = {1e8, 1e12, 1e8, 1e8};
    for (int i = 0; i < 4; i++)
        g.members[i].bandwidth = bw[i];
    size_t n = 1000000;
    cr_assert_eq(hm_ar_layout(&g, n, off, cnt), 0);
    /* Clamped to 2 x 1e8: 2 / 5 of the vector, not 99.99%. */
    cr_assert(cnt[1] <= n * 2 / 5 + 1 && cnt[1] + 1 >= n * 2 / 5, "%zu", cnt[1]);
    cr_assert_eq(hm_ar_layout_bounded(&g, n, 1e9, off, cnt), 0);
    cr_assert_gt(cnt[1], n * 999 / 1000, "unbounded, it takes nearly everything");
}

static uint64_t limit_seen[3];
static void limit_emit(void *ud, const char *kw, uint64_t v)
{
    HM_UNUSED(ud);
    if (strcmp(kw, "AverageWeightFactor") == 0)
        limit_seen[0] = v;
    else if (strcmp(kw, "AverageClipWeightFactor") == 0)
        limit_seen[1] = v;
    else if (strcmp(kw, "AverageBandwidthFactor") == 0)
        limit_seen[2] = v;
}

/*
 * A member declaring weight 1.7e308 (finite, so it passes the decoder) and
 * a bandwidth of 1e12: the round ends for everyone, every result is the
 * average with that weight clamped to 4 x the median (1), and nothing is
 * NaN or infinite.
 */
Test(allreduce, huge_weight_and_bandwidth_are_clamped_not_fatal)
{
    hm_avg_group g;
    hm_ar_config cfg = {.round_timeout_ms = 20000, .chunk_elems = 1000};
    size_t len = 20011;
    nodes_start(4);
    double bw[4] = {100, 100, 100, 1e12};
    for (int i = 0; i < 4; i++)
        fill(i, len, i == 3 ? 1.7e308 : 1.0);
    make_group(&g, 4, bw, 0x7e);
    hm_ar_limit_cfg bad = {.weight_factor = 0.5, .clip_weight_factor = 1, .bandwidth_factor = 2};
    cr_assert_eq(hm_ar_set_limits(nodes[0].ctx, &bad), -EINVAL);
    bad.weight_factor = NAN;
    cr_assert_eq(hm_ar_set_limits(nodes[0].ctx, &bad), -EINVAL);
    for (int i = 0; i < 4; i++)
        start(i, &g, len, &cfg);
    cr_assert(run_until_done(4, 20000), "every member finishes");
    nodes[3].weight = 4.0; /* what the reducers count */
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(nodes[i].rep.status, 0, "node %d status %d", i, nodes[i].rep.status);
        cr_assert(hm_avg_all_finite(nodes[i].data, len));
        check_exact(i, 0xf);
        cr_assert_leq(nodes[i].rep.spans[3].count, len * 2 / 5 + 1);
    }
    memset(limit_seen, 0, sizeof(limit_seen));
    hm_ar_limits(nodes[0].ctx, limit_emit, NULL);
    cr_assert_gt(limit_seen[0], 0, "node 0 clamped the weight of its chunks");
    cr_assert_eq(limit_seen[1], 0);
    cr_assert_eq(hm_ar_bandwidths_clamped(nodes[0].ctx), 1, "one bandwidth clamped in one round");
    nodes_stop();
}

Test(allreduce, bad_arguments_and_cancel)
{
    hm_avg_group g;
    float x[4] = {1, 2, 3, NAN};
    nodes_start(2);
    double bw[2] = {1, 1};
    make_group(&g, 2, bw, 0x80);
    g.self = 0;
    cr_assert_eq(hm_ar_start(nodes[0].ctx, &g, x, 4, 1.0, NULL, done_cb, &nodes[0], NULL), -EDOM);
    cr_assert_eq(hm_ar_start(nodes[0].ctx, &g, x, 3, -1.0, NULL, done_cb, &nodes[0], NULL),
                 -EINVAL);
    g.self = 1; /* not our key */
    cr_assert_eq(hm_ar_start(nodes[0].ctx, &g, x, 3, 1.0, NULL, done_cb, &nodes[0], NULL),
                 -EINVAL);
    g.self = 0;
    cr_assert_eq(hm_ar_start(nodes[0].ctx, &g, x, 3, 1.0, NULL, done_cb, &nodes[0],
                             &nodes[0].round),
                 0);
    cr_assert_eq(hm_ar_start(nodes[0].ctx, &g, x, 3, 1.0, NULL, done_cb, &nodes[0], NULL),
                 -EALREADY);
    hm_ar_cancel(nodes[0].round);
    cr_assert(run_until_done(1, 1000));
    cr_assert_eq(nodes[0].rep.status, -ECANCELED);
    cr_assert_eq(x[0], 1.0f);
    nodes_stop();
}

/* The view message carries the end-of-round "done" flag; the 6-element form (no flag) is a notice. */
Test(allreduce, view_message_done_flag_round_trips)
{
    uint8_t buf[256];
    hm_wire_wr w;
    hm_ar_dead_msg m = {.sender = 3, .n_total = 1000, .dead_mask = 0x8, .bad_mask = 0x2}, m2;
    memset(m.group_id, 0x7a, sizeof(m.group_id));
    for (uint32_t done = 0; done <= 1; done++) {
        m.done = done;
        hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
        hm_ar_dead_encode(&w, &m);
        cr_assert_eq(hm_wire_wr_error(&w), 0);
        cr_assert_eq(hm_ar_dead_decode(buf, w.len, &m2), 0);
        cr_assert_eq(m2.done, done);
        cr_assert_eq(m2.sender, 3);
        cr_assert_eq(m2.dead_mask, 0x8);
        cr_assert_eq(m2.bad_mask, 0x2);
    }
    /* Without the seventh element: array header 0x97 becomes 0x96, last byte dropped. */
    cr_assert_eq(buf[0], 0x97);
    buf[0] = 0x96;
    cr_assert_eq(hm_ar_dead_decode(buf, w.len - 1, &m2), 0);
    cr_assert_eq(m2.done, 0);
    /* A flag other than 0 or 1 is refused. */
    buf[0] = 0x97;
    buf[w.len - 1] = 0x02;
    cr_assert_eq(hm_ar_dead_decode(buf, w.len, &m2), -EPROTO);
}

/*
 * The bandwidth bound a leader applies before announcing a group and every
 * follower checks (group.h): after clamping, the group passes under the
 * leader's factor and under any looser one; a stricter follower refuses it
 * instead of splitting the vector differently; an unclamped claim of 1e12
 * is refused by everyone.
 */
Test(allreduce, group_bandwidth_bound_is_clamped_by_the_leader_and_checked_by_followers)
{
    hm_avg_group g;
    memset(&g, 0, sizeof(g));
    g.n = 4;
    g.members[0].bandwidth = 100;
    g.members[1].bandwidth = 100;
    g.members[2].bandwidth = 120;
    g.members[3].bandwidth = 1e12;
    cr_assert_not(hm_avg_bandwidths_bounded(&g, 2.0), "an unclamped 1e12 is refused");
    hm_avg_group strict = g;
    cr_assert_eq(hm_avg_clamp_bandwidths(&g, 2.0), 1);
    cr_assert_float_eq(g.members[3].bandwidth, 200.0, 1e-9, "2 x the lower median, 100");
    cr_assert(hm_avg_bandwidths_bounded(&g, 2.0), "a clamped group passes its own factor");
    cr_assert(hm_avg_bandwidths_bounded(&g, 3.0), "and any looser one");
    cr_assert_not(hm_avg_bandwidths_bounded(&g, 1.5), "a stricter follower refuses it");
    cr_assert_eq(hm_avg_clamp_bandwidths(&g, 2.0), 0, "clamping twice changes nothing");
    strict.members[2].bandwidth = -1;
    cr_assert_not(hm_avg_bandwidths_bounded(&strict, 2.0), "a negative bandwidth is refused");
    hm_avg_clamp_bandwidths(&strict, 2.0);
    cr_assert_float_eq(strict.members[2].bandwidth, 0.0, 0, "and clamped to 0");
}

static void status_cb(void *ud, int status, const uint8_t *body, size_t len)
{
    HM_UNUSED(body);
    HM_UNUSED(len);
    *(int *)ud = status == 0 ? 1 : status;
}

/*
 * Version 2 of the messages (allreduce.h): a reply carries its form and the
 * sender's share; a version 1 message is refused, and the log names both
 * versions and the peer, so that its operator knows to upgrade.
 */
Test(allreduce, version_1_messages_are_refused_and_named)
{
    uint8_t buf[256], chunk[64];
    hm_wire_wr w;
    size_t clen;
    float vals[4] = {1, 2, 3, 4};
    cr_assert_eq(hm_avg_chunk_encode(HM_AVG_COMP_FP16, vals, 4, chunk, sizeof(chunk), &clen), 0);

    /* Replies round-trip form and share; a share outside [0, 1] or a bodiless difference is refused. */
    hm_ar_reply_msg rm = {.contrib_mask = 3, .data = chunk, .data_len = clen,
                          .form = HM_AR_FORM_DELTA, .share = 0.25}, rm2;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_ar_reply_encode(&w, &rm);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    cr_assert_eq(hm_ar_reply_decode(buf, w.len, 16, &rm2), 0);
    cr_assert_eq(rm2.form, HM_AR_FORM_DELTA);
    cr_assert_eq(rm2.share, 0.25);
    cr_assert_eq(hm_ar_msg_version(buf, w.len), 2);
    buf[1] = 1; /* the same reply under version 1 */
    cr_assert_eq(hm_ar_reply_decode(buf, w.len, 16, &rm2), -EPROTO);
    cr_assert_eq(hm_ar_msg_version(buf, w.len), 1);
    static const double bad_share[] = {-0.1, 1.5, NAN};
    for (size_t i = 0; i < 3; i++) {
        rm.share = bad_share[i];
        hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
        hm_ar_reply_encode(&w, &rm);
        cr_assert_eq(hm_ar_reply_decode(buf, w.len, 16, &rm2), -EPROTO, "share %g", rm.share);
    }
    rm.share = 0;
    rm.data = NULL;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_ar_reply_encode(&w, &rm);
    cr_assert_eq(hm_ar_reply_decode(buf, w.len, 16, &rm2), -EPROTO, "a difference needs data");

    /* A version 1 part sent to a node: refused, and logged as a peer to upgrade. */
    char path[] = "/tmp/test_allreduce_log.XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    unlink(path);
    fflush(stderr);
    int saved = dup(2);
    cr_assert_eq(dup2(fd, 2), 2);
    hm_log_set_level(HM_LOG_WARN);
    nodes_start(2);
    hm_ar_part_msg pm = {.sender = 1, .n_total = 4, .span = 0, .chunk = 0, .kind = HM_AR_DATA,
                         .weight = 1.0, .data = chunk, .data_len = clen};
    memset(pm.group_id, 0x61, sizeof(pm.group_id));
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_ar_part_encode(&w, &pm);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    cr_assert_eq(buf[1], HM_AR_VERSION);
    buf[1] = 1;
    int got = 0;
    uint64_t call_id;
    cr_assert_eq(hm_rpc_call(nodes[1].rpc, nodes[0].id.pk, (const struct sockaddr *)&nodes[0].addr,
                             HM_AR_PART_METHOD, buf, w.len, HM_RPC_STREAM, 5000, status_cb, &got,
                             &call_id),
                 0);
    uint64_t end = hm_now_ms() + 5000;
    while (got == 0 && hm_now_ms() < end)
        run_for(10);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    cr_assert_eq(got, -EPROTO, "refused: %d", got);
    char log[4096] = {0};
    cr_assert_geq(pread(fd, log, sizeof(log) - 1, 0), 0);
    close(fd);
    cr_assert(strstr(log, "protocol version 1") != NULL && strstr(log, "127.0.0.1") != NULL &&
                  strstr(log, "averaging version 2 only") != NULL,
              "no warning naming both versions: %s", log);
    nodes_stop();
}

static uint64_t early_seen[2];
static void early_emit(void *ud, const char *kw, uint64_t v)
{
    HM_UNUSED(ud);
    if (strcmp(kw, "AverageEarlyPartsMiB") == 0)
        early_seen[0] = v;
    else if (strcmp(kw, "AverageEarlyPartsOriginMiB") == 0)
        early_seen[1] = v;
}

/*
 * One pair where member 1 starts 300 ms after member 0, with the given
 * bounds on early parts at member 1 (0: the defaults). Returns member 0's
 * bytes sent; both end with the exact mean.
 */
static uint64_t late_pair(size_t early_bytes, size_t early_origin_bytes, uint64_t counts[2])
{
    hm_avg_group g;
    hm_ar_config cfg = {.round_timeout_ms = 5000, .chunk_elems = 4096};
    size_t len = 20000;
    double bw[2] = {1, 1};
    setup();
    nodes_start(2);
    if (early_bytes != 0) {
        hm_ar_limit_cfg lim;
        hm_ar_limit_defaults(&lim);
        lim.early_bytes = early_bytes == SIZE_MAX ? 0 : early_bytes;
        lim.early_origin_bytes = early_origin_bytes;
        cr_assert_eq(hm_ar_set_limits(nodes[1].ctx, &lim), 0);
    }
    for (int i = 0; i < 2; i++)
        fill(i, len, 1.0);
    make_group(&g, 2, bw, 0x7c);
    start(0, &g, len, &cfg);
    run_for(300);
    cr_assert_eq(count_done(), 0);
    start(1, &g, len, &cfg);
    cr_assert(run_until_done(2, 5000));
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(nodes[i].rep.status, 0, "node %d: %d", i, nodes[i].rep.status);
        check_exact(i, 0x3);
    }
    uint64_t sent = nodes[0].rep.bytes_sent;
    memset(early_seen, 0, sizeof(early_seen));
    hm_ar_limits(nodes[1].ctx, early_emit, NULL);
    counts[0] = early_seen[0];
    counts[1] = early_seen[1];
    nodes_stop();
    return sent;
}

/*
 * Parts that reach a member before it starts the round are held and
 * answered once it does (allreduce.h, "Early parts"): each goes once.
 * Without holding (bound 0) they are refused and sent again and again
 * with backoff; past the per-origin bound they are refused and counted,
 * and the round still ends exact.
 */
Test(allreduce, early_parts_are_held_and_bounded)
{
    uint64_t held[2], refused[2], capped[2];
    uint64_t sent_held = late_pair(0, 0, held);
    uint64_t sent_refused = late_pair(SIZE_MAX, 0, refused);
    uint64_t sent_capped = late_pair((size_t)64 << 20, 1024, capped);
    cr_log_info("member 0 sent %llu bytes with early parts held, %llu refused, %llu capped",
                (unsigned long long)sent_held, (unsigned long long)sent_refused,
                (unsigned long long)sent_capped);
    cr_assert_eq(held[0] + held[1], 0, "nothing refused while held");
    cr_assert_lt(2 * sent_held, sent_refused, "held parts are not sent again");
    cr_assert_gt(capped[1], 0, "the per-origin bound refused and counted");
    cr_assert_lt(2 * sent_held, sent_capped);
}

/*
 * With the default chunk size a vector of at most 1 MiB goes as one chunk
 * per span, one round trip each (a client leaves the other member all of
 * it, 2^18 elements, several default chunks' worth); one element more is
 * cut into chunks as before.
 */
Test(allreduce, small_vectors_go_as_one_chunk_per_span)
{
    static const size_t lens[2] = {(size_t)1 << 18, ((size_t)1 << 18) + 1};
    hm_ar_config dflt = {0};
    hm_ar_config_defaults(&dflt);
    const size_t chunks[2] = {1, (lens[1] + dflt.chunk_elems - 1) / dflt.chunk_elems};
    cr_assert_gt(chunks[1], 1);
    for (int c = 0; c < 2; c++) {
        hm_avg_group g;
        hm_ar_config cfg = {.round_timeout_ms = 10000};
        double bw[2] = {1, 0};
        if (c > 0)
            setup();
        nodes_start(2);
        for (int i = 0; i < 2; i++)
            fill(i, lens[c], 1.0 + i);
        make_group(&g, 2, bw, (uint8_t)(0x7d + c));
        for (int i = 0; i < 2; i++)
            start(i, &g, lens[c], &cfg);
        cr_assert(run_until_done(2, 10000));
        for (int i = 0; i < 2; i++) {
            cr_assert_eq(nodes[i].rep.status, 0);
            cr_assert_eq(nodes[i].rep.spans[0].n_chunks, chunks[c], "%zu elements: %zu chunks",
                         lens[c], nodes[i].rep.spans[0].n_chunks);
            check_exact(i, 0x3);
        }
        nodes_stop();
    }
}

/*
 * Tests for the averager: real nodes on 127.0.0.1 in one process and one
 * loop, bootstrapped to each other, each with its own averager, average
 * known vectors with known weights through matchmaking and the all-reduce
 * exactly as a trainer's rounds would. They check that 2 to 8 peers get the
 * weighted average within 1e-6 relative, fp16 and 8-bit within codec.h's
 * bounds, that consecutive rounds on the same averagers each come out
 * right and land in the history, that group bits move on per prefix
 * (Moshpit: the next round meets other partners), and the call's own
 * contract: bad arguments are refused without a callback, the callback
 * never fires from inside the call, and a cancelled round ends once.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "averaging/averager.h"
#include "averaging/codec.h"
#include "src/node/node.h"
#include "tests/loop.h"
#include "src/base/util.h"

#define MAX_PEERS 8

typedef struct tpeer {
    hm_node *node;
    hm_averager *av;
    float *data, *orig;
    size_t n;
    double weight;
    int calls, status;
    hm_avg_report rep;
} tpeer;

typedef struct swarm {
    uv_loop_t loop;
    tpeer p[MAX_PEERS];
    size_t n;
} swarm;

static int run_until(uv_loop_t *loop, hm_test_pred pred, void *ud, uint64_t timeout_ms)
{
    return hm_test_run_until(loop, pred, ud, timeout_ms);
}

static hm_node *make_node(uv_loop_t *loop, const char *peer)
{
    return hm_test_make_node(loop, "averager-test", peer);
}

static int dht_ready(void *ud)
{
    swarm *sw = ud;
    size_t need = HM_MIN(sw->n - 1, (size_t)6);
    for (size_t i = 0; i < sw->n; i++)
        if (hm_rt_size(hm_dht_routing(hm_node_dht(sw->p[i].node))) < need)
            return 0;
    return 1;
}

static void swarm_start(swarm *sw, size_t n)
{
    char addr[256];
    memset(sw, 0, sizeof(*sw));
    hm_log_set_level(getenv("HM_TEST_DEBUG") != NULL ? HM_LOG_DEBUG : HM_LOG_ERROR);
    cr_assert_eq(hm_crypto_init(), 0);
    cr_assert_eq(uv_loop_init(&sw->loop), 0);
    sw->n = n;
    for (size_t i = 0; i < n; i++) {
        sw->p[i].node = make_node(&sw->loop, i == 0 ? NULL : addr);
        if (i == 0)
            cr_assert_eq(hm_node_address(sw->p[0].node, addr, sizeof(addr)), 0);
        cr_assert_eq(hm_averager_new(sw->p[i].node, &sw->p[i].av), 0);
    }
    cr_assert(run_until(&sw->loop, dht_ready, sw, 10000), "the DHT did not come up");
}

static void swarm_stop(swarm *sw)
{
    for (size_t i = 0; i < sw->n; i++) {
        hm_averager_close(sw->p[i].av, NULL, NULL);
        hm_node_close(sw->p[i].node, NULL, NULL);
    }
    uv_run(&sw->loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&sw->loop), 0, "handles left open after close");
    for (size_t i = 0; i < sw->n; i++) {
        free(sw->p[i].data);
        free(sw->p[i].orig);
    }
}

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static double rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / (double)(1ull << 53);
}

/* Gives every peer a fresh vector of n elements and a weight. */
static void fill_all(swarm *sw, size_t n)
{
    for (size_t i = 0; i < sw->n; i++) {
        tpeer *p = &sw->p[i];
        free(p->data);
        free(p->orig);
        p->n = n;
        p->data = malloc(n * sizeof(float) + 1);
        p->orig = malloc(n * sizeof(float) + 1);
        cr_assert(p->data != NULL && p->orig != NULL);
        for (size_t k = 0; k < n; k++)
            p->data[k] = p->orig[k] = (float)(rnd() * 4.0 - 2.0 + (double)i);
        p->weight = 1.0 + (double)i * 0.75;
        p->calls = 0;
        p->status = 1;
    }
}

static void on_done(void *ud, int status, const hm_avg_report *rep)
{
    tpeer *p = ud;
    p->calls++;
    p->status = status;
    p->rep = *rep;
}

static int all_done(void *ud)
{
    swarm *sw = ud;
    for (size_t i = 0; i < sw->n; i++)
        if (sw->p[i].calls == 0)
            return 0;
    return 1;
}

static hm_avg_opts opts_of(const char *prefix, unsigned target, int comp)
{
    hm_avg_opts o = {0};
    o.prefix = prefix;
    o.target_group_size = target;
    o.min_group_size = target;
    o.matchmaking_timeout_ms = 15000;
    o.matchmaking_time_ms = 2000;
    o.request_timeout_ms = 1000;
    o.round_timeout_ms = 10000;
    o.compression = comp;
    o.chunk_elems = 1000; /* several chunks per span */
    return o;
}

/* Starts a round on every peer at once and runs them to the end. */
static void round_all(swarm *sw, const char *prefix, int comp)
{
    for (size_t i = 0; i < sw->n; i++) {
        tpeer *p = &sw->p[i];
        hm_avg_opts o = opts_of(prefix, (unsigned)sw->n, comp);
        o.weight = p->weight;
        cr_assert_eq(hm_averager_round(p->av, &o, p->data, p->n, on_done, p, NULL), 0);
        cr_assert_eq(p->calls, 0, "the callback fired from inside the call");
    }
    cr_assert(run_until(&sw->loop, all_done, sw, 30000), "rounds did not end");
    for (size_t i = 0; i < sw->n; i++) {
        cr_assert_eq(sw->p[i].calls, 1);
        cr_assert_eq(sw->p[i].status, 0, "peer %zu: %s (stage %d)", i,
                     hm_strerror(sw->p[i].status), sw->p[i].rep.stage);
    }
}

/* Which peer has this public key. */
static size_t peer_of(swarm *sw, const uint8_t *pk)
{
    for (size_t i = 0; i < sw->n; i++)
        if (memcmp(hm_node_identity(sw->p[i].node)->pk, pk, HM_PK_BYTES) == 0)
            return i;
    cr_assert_fail("unknown member");
    return 0;
}

/*
 * Every element of every peer is the weighted average over all peers, to
 * within rel * |average| + abs_tol + per_x * (sum_j w_j |x_j|) / W, and
 * every report names the whole group in every span.
 */
static void check_average(swarm *sw, double rel, double abs_tol, double per_x)
{
    for (size_t i = 0; i < sw->n; i++) {
        const tpeer *p = &sw->p[i];
        const hm_avg_report *r = &p->rep;
        cr_assert_eq(r->stage, HM_AVG_STAGE_ALLREDUCE);
        cr_assert_eq(r->group.n, sw->n, "peer %zu: group of %zu", i, r->group.n);
        cr_assert_eq(peer_of(sw, r->group.members[r->group.self].pk), i);
        cr_assert_eq(r->ar.status, 0);
        uint64_t all = sw->n == 64 ? ~0ull : (1ull << sw->n) - 1;
        for (size_t s = 0; s < r->ar.n_spans; s++)
            if (r->ar.spans[s].count > 0)
                cr_assert_eq(r->ar.spans[s].contributors, all, "peer %zu span %zu", i, s);
        for (size_t m = 0; m < r->group.n; m++)
            cr_assert_eq(r->ar.reason[m], HM_AR_IN);
        cr_assert_gt(r->ar.bytes_sent, 0);
        cr_assert_gt(r->ar.bytes_received, 0);
        cr_assert_eq(r->n_elems, p->n);
        cr_assert(r->duration_s >= r->matchmaking_s);
        for (size_t k = 0; k < p->n; k++) {
            double s = 0, w = 0, sabs = 0;
            for (size_t j = 0; j < sw->n; j++) {
                s += sw->p[j].weight * sw->p[j].orig[k];
                sabs += sw->p[j].weight * fabs(sw->p[j].orig[k]);
                w += sw->p[j].weight;
            }
            double e = s / w;
            double tol = rel * fabs(e) + abs_tol + per_x * sabs / w;
            if (fabs(p->data[k] - e) > tol)
                cr_assert_fail("peer %zu element %zu: got %.9g, expected %.9g (tol %.3g)", i, k,
                               (double)p->data[k], e, tol);
        }
    }
}

static void exact_with(size_t n_peers, size_t n_elems)
{
    swarm sw;
    swarm_start(&sw, n_peers);
    fill_all(&sw, n_elems);
    round_all(&sw, "exact", HM_AVG_COMP_NONE);
    check_average(&sw, 1e-6, 0, 0);
    swarm_stop(&sw);
}

Test(averager, two_peers_exact, .timeout = 40) { exact_with(2, 4097); }
Test(averager, five_peers_exact, .timeout = 40) { exact_with(5, 10007); }
Test(averager, eight_peers_exact, .timeout = 60) { exact_with(8, 20011); }

Test(averager, fp16_within_its_bound, .timeout = 40)
{
    swarm sw;
    swarm_start(&sw, 4);
    fill_all(&sw, 5003);
    round_all(&sw, "half", HM_AVG_COMP_FP16);
    /*
     * Each input is rounded to fp16 once on its way to the reducer (at most
     * 2^-11 of its magnitude, so 2^-11 * sum w|x| / W over the average) and
     * the average once on its way back (2^-11 of it); no value here is
     * below fp16's normal range except by chance, which 2^-24 absolute covers.
     */
    check_average(&sw, 0x1p-11 + 1e-6, 0x1p-24, 0x1p-11);
    /* And the rounding is really there: fp16 does not come back exact. */
    int differs = 0;
    for (size_t k = 0; k < sw.p[0].n && !differs; k++) {
        double s = 0, w = 0;
        for (size_t j = 0; j < sw.n; j++) {
            s += sw.p[j].weight * sw.p[j].orig[k];
            w += sw.p[j].weight;
        }
        differs = fabs(sw.p[0].data[k] - s / w) > 1e-6 * fabs(s / w);
    }
    cr_assert(differs, "fp16 results are exact: compression was not applied");
    swarm_stop(&sw);
}

Test(averager, uint8_within_its_bound, .timeout = 40)
{
    swarm sw;
    swarm_start(&sw, 3);
    fill_all(&sw, 6007);
    round_all(&sw, "eight-bit", HM_AVG_COMP_UINT8);
    /*
     * codec.h: half a step of the chunk's range, (max - min) / 510, plus
     * float rounding, once for each input and once for the result. Every
     * input lies in [-2, 2 + n - 1], so each chunk's range is at most 4 +
     * n - 1, and the averages' range is no wider.
     */
    double range = 4.0 + (double)(sw.n - 1);
    check_average(&sw, 1e-6, 2.0 * range / 510.0 + 1e-5, 0);
    swarm_stop(&sw);
}

Test(averager, consecutive_rounds_reuse_the_averager, .timeout = 60)
{
    swarm sw;
    swarm_start(&sw, 3);
    for (int round = 1; round <= 3; round++) {
        fill_all(&sw, 3001 + (size_t)round * 100);
        round_all(&sw, "again", HM_AVG_COMP_NONE);
        check_average(&sw, 1e-6, 0, 0);
        for (size_t i = 0; i < sw.n; i++)
            cr_assert_eq(sw.p[i].rep.round, (uint64_t)round);
    }
    /* The history holds the three rounds, newest first. */
    hm_avg_report *hist = calloc(HM_AVERAGER_HISTORY, sizeof(*hist));
    cr_assert_not_null(hist);
    cr_assert_eq(hm_averager_history(sw.p[1].av, hist, HM_AVERAGER_HISTORY), 3);
    for (size_t k = 0; k < 3; k++) {
        cr_assert_eq(hist[k].round, 3 - k);
        cr_assert_eq(hist[k].status, 0);
        cr_assert_str_eq(hist[k].prefix, "again");
        cr_assert_eq(hist[k].group.n, 3);
        cr_assert_eq(hist[k].n_elems, 3001 + (3 - k) * 100);
    }
    cr_assert_eq(hm_averager_active(sw.p[1].av, NULL, 0), 0);
    free(hist);
    swarm_stop(&sw);
}

/*
 * Moshpit: four peers under one-bit group keys in pairs. After a round, the
 * two members of each pair move to different bits, so the next round pairs
 * each peer with someone from the other pair.
 */
Test(averager, group_bits_move_on_between_rounds, .timeout = 60)
{
    swarm sw;
    swarm_start(&sw, 4);
    const char *bits0[4] = {"0", "0", "1", "1"};
    size_t partner[2][4];
    char next0[4][HM_MM_BITS_MAX + 1];
    for (int round = 0; round < 2; round++) {
        fill_all(&sw, 1000);
        for (size_t i = 0; i < sw.n; i++) {
            hm_avg_opts o = opts_of("moshpit", 2, HM_AVG_COMP_NONE);
            o.group_bits = bits0[i];
            o.weight = sw.p[i].weight;
            cr_assert_eq(hm_averager_round(sw.p[i].av, &o, sw.p[i].data, 1000, on_done, &sw.p[i],
                                           NULL),
                         0);
        }
        cr_assert(run_until(&sw.loop, all_done, &sw, 30000), "round %d did not end", round);
        for (size_t i = 0; i < sw.n; i++) {
            const hm_avg_report *r = &sw.p[i].rep;
            cr_assert_eq(sw.p[i].status, 0, "round %d peer %zu: %s", round, i,
                         hm_strerror(sw.p[i].status));
            cr_assert_eq(r->group.n, 2);
            partner[round][i] = peer_of(&sw, r->group.members[1 - r->group.self].pk);
            /* The first round uses the given bits, the second the group's next bits. */
            if (round == 0) {
                cr_assert_str_eq(r->group_bits, bits0[i]);
                hm_strlcpy(next0[i], r->group.next_bits, sizeof(next0[i]));
            } else {
                cr_assert_str_eq(r->group_bits, next0[i]);
            }
            cr_assert_eq(strlen(r->group.next_bits), 1);
            /* The result is the average of the pair. */
            size_t j = partner[round][i];
            for (size_t k = 0; k < 1000; k++) {
                double e = (sw.p[i].weight * sw.p[i].orig[k] + sw.p[j].weight * sw.p[j].orig[k]) /
                           (sw.p[i].weight + sw.p[j].weight);
                cr_assert(fabs(sw.p[i].data[k] - e) <= 1e-6 * fabs(e) + 1e-12);
            }
        }
        if (round == 0) {
            /* The two members of a pair land under different bits. */
            for (size_t i = 0; i < sw.n; i++)
                cr_assert_str_neq(sw.p[i].rep.group.next_bits,
                                  sw.p[partner[0][i]].rep.group.next_bits);
        }
    }
    for (size_t i = 0; i < sw.n; i++) {
        cr_assert_neq(partner[1][i], partner[0][i], "peer %zu met the same partner twice", i);
    }
    swarm_stop(&sw);
}

Test(averager, refusals_and_cancel, .timeout = 30)
{
    swarm sw;
    swarm_start(&sw, 2);
    fill_all(&sw, 100);
    tpeer *p = &sw.p[0];
    hm_avg_opts o = opts_of("refuse", 2, HM_AVG_COMP_NONE);
    o.weight = 1;

    hm_avg_opts bad = o;
    bad.prefix = "";
    cr_assert_eq(hm_averager_round(p->av, &bad, p->data, p->n, on_done, p, NULL), -EINVAL);
    bad = o;
    bad.weight = NAN;
    cr_assert_eq(hm_averager_round(p->av, &bad, p->data, p->n, on_done, p, NULL), -EINVAL);
    bad = o;
    bad.weight = -1;
    cr_assert_eq(hm_averager_round(p->av, &bad, p->data, p->n, on_done, p, NULL), -EINVAL);
    bad = o;
    bad.compression = 7;
    cr_assert_eq(hm_averager_round(p->av, &bad, p->data, p->n, on_done, p, NULL), -EINVAL);
    bad = o;
    bad.group_bits = "012";
    cr_assert_eq(hm_averager_round(p->av, &bad, p->data, p->n, on_done, p, NULL), -EINVAL);
    bad = o;
    bad.min_group_size = 3;
    cr_assert_eq(hm_averager_round(p->av, &bad, p->data, p->n, on_done, p, NULL), -EINVAL);
    p->data[5] = INFINITY;
    cr_assert_eq(hm_averager_round(p->av, &o, p->data, p->n, on_done, p, NULL), -EDOM);
    p->data[5] = p->orig[5];

    uint64_t id = 0;
    cr_assert_eq(hm_averager_round(p->av, &o, p->data, p->n, on_done, p, &id), 0);
    cr_assert_eq(id, 1);
    /* One round per group key at a time. */
    cr_assert_eq(hm_averager_round(p->av, &o, p->data, p->n, on_done, p, NULL), -EBUSY);
    hm_avg_active act[4];
    cr_assert_eq(hm_averager_active(p->av, act, 4), 1);
    cr_assert_eq(act[0].round, 1);
    cr_assert_eq(act[0].stage, HM_AVG_STAGE_MATCHMAKING);
    cr_assert_str_eq(act[0].prefix, "refuse");
    cr_assert_eq(hm_averager_cancel(p->av, 99), -ENOENT);
    cr_assert_eq(hm_averager_cancel(p->av, id), 0);
    run_until(&sw.loop, all_done, &sw, 200);
    cr_assert_eq(p->calls, 1);
    cr_assert_eq(p->status, -ECANCELED);
    cr_assert_eq(p->rep.stage, HM_AVG_STAGE_MATCHMAKING);
    /* The vector is untouched. */
    cr_assert_eq(memcmp(p->data, p->orig, p->n * sizeof(float)), 0);

    /* A round still looking when the averager closes ends with -ECANCELED. */
    p->calls = 0;
    cr_assert_eq(hm_averager_round(p->av, &o, p->data, p->n, on_done, p, NULL), 0);
    hm_averager_close(p->av, NULL, NULL);
    cr_assert_eq(p->calls, 1);
    cr_assert_eq(p->status, -ECANCELED);
    hm_node_close(p->node, NULL, NULL);
    hm_averager_close(sw.p[1].av, NULL, NULL);
    hm_node_close(sw.p[1].node, NULL, NULL);
    uv_run(&sw.loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&sw.loop), 0);
    for (size_t i = 0; i < sw.n; i++) {
        free(sw.p[i].data);
        free(sw.p[i].orig);
    }
}

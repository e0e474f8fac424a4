/*
 * test_diloco: DiLoCo in libhivemind (hivemind.h, "DiLoCo") against real
 * hivemindd processes on 127.0.0.1.
 *
 *   - outer_steps: three trainers, one per daemon, each in a thread of its
 *     own, take H = 2 inner "steps" (a per-trainer deterministic change)
 *     and two outer rounds. Every round averages in one group of three,
 *     and after each one every trainer's parameters and momentum equal a
 *     reference computed here: the mean pseudo-gradient, then
 *     torch.optim.SGD(nesterov=True)'s update (lr 0.7, momentum 0.9).
 *     Then a newcomer on a fourth daemon loads the outer state (round 2,
 *     the outer parameters and the momentum, bit for bit) from the peers;
 *     and a trainer left at round 0 misses it ("no_group") and catches up
 *     with the run's round-2 state.
 *   - missed_round: a trainer alone (min_group_size 2) misses its round
 *     ("no_group"), applies its own pseudo-gradient, and says so; its next
 *     round is round 1 (no newer state to catch up with).
 *   - bad_options: options out of range are refused with a sentence.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "lib/hivemind.h"
#include "tests/proc.h"

#define N_TRAINERS 3
#define N_PARAMS 1000
#define H 2
#define ROUNDS 2

static void setup(void) { hm_proc_setup("diloco"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(diloco, .init = setup, .fini = teardown, .timeout = 180);

static hmc *connect_to(struct node *n)
{
    hmc *h = NULL;
    char err[256] = "";
    cr_assert_eq(hmc_connect_timeout(n->sock, 30000, &h, err, sizeof(err)), 0, "connect: %s",
                 err);
    return h;
}

static void wait_known(struct node *nodes, size_t n)
{
    long deadline = hm_test_now_ms() + 30000;
    size_t ready = 0;
    while (ready < n && hm_test_now_ms() < deadline) {
        ready = 0;
        for (size_t i = 0; i < n; i++)
            ready += node_rt_size(&nodes[i]) >= (long)(n - 1);
        if (ready < n)
            usleep(200000);
    }
    cr_assert_eq(ready, n, "only %zu of %zu daemons know the others", ready, n);
}

/* The initial parameters every trainer starts from (DiLoCo's assumption). */
static float init_value(size_t i) { return (float)sin((double)i * 0.37) * 0.5f; }

/* Trainer t's inner step s of round r: a change of its own. */
static float inner_delta(int t, int r, int s, size_t i)
{
    return 0.01f * (float)(t + 1) * (float)cos((double)(i + 7 * s + 13 * r) * 0.11 + t);
}

typedef struct trainer {
    int t;
    hmc *h;
    hmc_diloco *d;
    float params[N_PARAMS];
    /* What each round left: parameters and momentum. */
    float after[ROUNDS][N_PARAMS];
    float mom_after[ROUNDS][N_PARAMS];
    hmc_diloco_report rep[ROUNDS];
    int steps_returned[ROUNDS * H];
    int failed;
    char why[256];
} trainer;

static void *run_trainer(void *arg)
{
    trainer *tr = arg;
    for (int r = 0; r < ROUNDS; r++) {
        for (int s = 0; s < H; s++) {
            for (size_t i = 0; i < N_PARAMS; i++)
                tr->params[i] += inner_delta(tr->t, r, s, i);
            hmc_diloco_report rep;
            int rc = hmc_diloco_step(tr->d, tr->params, &rep);
            tr->steps_returned[r * H + s] = rc;
            if (rc == 1)
                tr->rep[r] = rep;
            if (rc < 0) {
                tr->failed = 1;
                snprintf(tr->why, sizeof(tr->why), "step: %d", rc);
                return NULL;
            }
        }
        memcpy(tr->after[r], tr->params, sizeof(tr->params));
        memcpy(tr->mom_after[r], hmc_diloco_momentum(tr->d), sizeof(tr->params));
    }
    return NULL;
}

static void opts_for_group(hmc_diloco_opts *o, const char *run)
{
    hmc_diloco_opts_init(o);
    o->run_id = run;
    o->inner_steps = H;
    o->target_group_size = N_TRAINERS;
    o->min_group_size = N_TRAINERS;
    o->timeout_s = 60;
    o->matchmaking_time_s = 10;
    o->round_timeout_s = 60;
    o->load_timeout_s = 5;
}

Test(diloco, outer_steps)
{
    struct node nodes[N_TRAINERS + 1];
    start_node(&nodes[0], "d0", NULL, NULL);
    for (int i = 1; i <= N_TRAINERS; i++) {
        char name[8];
        snprintf(name, sizeof(name), "d%d", i);
        start_node(&nodes[i], name, NULL, "--initial-peers", nodes[0].addr, NULL);
    }
    wait_known(nodes, N_TRAINERS + 1);

    static trainer trs[N_TRAINERS];
    hmc_diloco_opts o;
    opts_for_group(&o, "dtest");
    for (int t = 0; t < N_TRAINERS; t++) {
        trainer *tr = &trs[t];
        memset(tr, 0, sizeof(*tr));
        tr->t = t;
        tr->h = connect_to(&nodes[t]);
        cr_assert_eq(hmc_diloco_open(tr->h, &o, N_PARAMS, &tr->d), 0, "open: %s",
                     hmc_last_error(tr->h));
        for (size_t i = 0; i < N_PARAMS; i++)
            tr->params[i] = init_value(i);
        /* Nobody shares a state yet: every trainer starts from its own. */
        o.load_state = 0;
        hmc_diloco_report rep;
        cr_assert_eq(hmc_diloco_begin(tr->d, tr->params, &rep), 0);
        cr_assert_eq(rep.loaded, 0);
        cr_assert_eq(rep.round, 0);
        cr_assert_eq(rep.shared, 1, "state.share: %s %s", rep.code, rep.error);
        cr_assert_eq(hmc_diloco_begin(tr->d, tr->params, NULL), -EINVAL, "begun twice");
    }
    pthread_t th[N_TRAINERS];
    for (int t = 0; t < N_TRAINERS; t++)
        cr_assert_eq(pthread_create(&th[t], NULL, run_trainer, &trs[t]), 0);
    for (int t = 0; t < N_TRAINERS; t++)
        pthread_join(th[t], NULL);
    for (int t = 0; t < N_TRAINERS; t++)
        cr_assert(!trs[t].failed, "trainer %d: %s", t, trs[t].why);

    /* The reference, in float32 as torch computes it. */
    float outer[N_PARAMS], buf[N_PARAMS];
    for (size_t i = 0; i < N_PARAMS; i++)
        outer[i] = init_value(i);
    const float lr = 0.7f, m = 0.9f;
    for (int r = 0; r < ROUNDS; r++) {
        for (size_t i = 0; i < N_PARAMS; i++) {
            /* The trainers' parameters before the outer step. */
            double acc = 0;
            for (int t = 0; t < N_TRAINERS; t++) {
                float p = outer[i];
                for (int s = 0; s < H; s++)
                    p += inner_delta(t, r, s, i);
                acc += (double)(outer[i] - p);
            }
            float g = (float)(acc / N_TRAINERS);
            buf[i] = r == 0 ? g : buf[i] * m + g;
            float step = g + m * buf[i];
            outer[i] = outer[i] + -lr * step;
        }
        for (int t = 0; t < N_TRAINERS; t++) {
            trainer *tr = &trs[t];
            cr_assert_eq(tr->steps_returned[r * H], 0, "an outer step before H inner steps");
            cr_assert_eq(tr->steps_returned[r * H + H - 1], 1, "no outer step after H");
            cr_assert_eq(tr->rep[r].round, (uint64_t)r);
            cr_assert_eq(tr->rep[r].averaged, 1, "trainer %d round %d not averaged: %s %s", t,
                         r, tr->rep[r].code, tr->rep[r].error);
            cr_assert_eq(tr->rep[r].group_size, N_TRAINERS);
            cr_assert_eq(tr->rep[r].shared, 1);
            for (size_t i = 0; i < N_PARAMS; i++) {
                cr_assert(fabsf(tr->after[r][i] - outer[i]) <= 1e-6f,
                          "trainer %d round %d param %zu: %.9g, reference %.9g", t, r, i,
                          tr->after[r][i], outer[i]);
                cr_assert(fabsf(tr->mom_after[r][i] - buf[i]) <= 1e-6f,
                          "trainer %d round %d momentum %zu: %.9g, reference %.9g", t, r, i,
                          tr->mom_after[r][i], buf[i]);
            }
        }
    }
    for (int t = 0; t < N_TRAINERS; t++)
        cr_assert_eq(hmc_diloco_round(trs[t].d), ROUNDS);

    /* A newcomer on the fourth daemon loads the outer state of round 2. */
    hmc *h = connect_to(&nodes[N_TRAINERS]);
    hmc_diloco *d;
    opts_for_group(&o, "dtest");
    o.load_timeout_s = 30;
    cr_assert_eq(hmc_diloco_open(h, &o, N_PARAMS, &d), 0);
    static float fresh[N_PARAMS];
    for (size_t i = 0; i < N_PARAMS; i++)
        fresh[i] = 100.0f;
    hmc_diloco_report rep;
    cr_assert_eq(hmc_diloco_begin(d, fresh, &rep), 0);
    cr_assert_eq(rep.loaded, 1, "no state loaded: %s %s", rep.code, rep.error);
    cr_assert_eq(rep.round, ROUNDS);
    cr_assert_eq(hmc_diloco_round(d), ROUNDS);
    cr_assert_eq(memcmp(fresh, hmc_diloco_outer_params(trs[0].d), sizeof(fresh)), 0,
                 "the newcomer's parameters are not the outer parameters");
    cr_assert_eq(memcmp(hmc_diloco_momentum(d), hmc_diloco_momentum(trs[0].d), sizeof(fresh)),
                 0, "the newcomer's momentum is not the peers'");
    hmc_diloco_close(d);

    /* A trainer left behind at round 0 misses it (the others are at round
     * 2), applies its own step, and catches up with the run's state. */
    opts_for_group(&o, "dtest");
    o.load_state = 0;
    o.inner_steps = 1;
    o.min_group_size = 2;
    o.timeout_s = 2;
    o.matchmaking_time_s = 1;
    o.load_timeout_s = 30;
    cr_assert_eq(hmc_diloco_open(h, &o, N_PARAMS, &d), 0);
    for (size_t i = 0; i < N_PARAMS; i++)
        fresh[i] = init_value(i);
    cr_assert_eq(hmc_diloco_begin(d, fresh, &rep), 0);
    cr_assert_eq(rep.round, 0);
    fresh[0] += 1.0f;
    cr_assert_eq(hmc_diloco_step(d, fresh, &rep), 1);
    cr_assert_eq(rep.averaged, 0);
    cr_assert_str_eq(rep.code, "no_group", "%s %s", rep.code, rep.error);
    cr_assert_eq(rep.caught_up, 1, "the laggard did not catch up");
    cr_assert_eq(hmc_diloco_round(d), ROUNDS);
    cr_assert_eq(memcmp(fresh, hmc_diloco_outer_params(trs[0].d), sizeof(fresh)), 0,
                 "the laggard's parameters are not the run's outer parameters");
    cr_assert_eq(memcmp(hmc_diloco_momentum(d), hmc_diloco_momentum(trs[0].d), sizeof(fresh)),
                 0);
    hmc_diloco_close(d);
    hmc_close(h);
    for (int t = 0; t < N_TRAINERS; t++) {
        hmc_diloco_close(trs[t].d);
        hmc_close(trs[t].h);
    }
}

Test(diloco, missed_round)
{
    struct node n;
    start_node(&n, "alone", NULL, NULL);
    hmc *h = connect_to(&n);
    hmc_diloco_opts o;
    hmc_diloco_opts_init(&o);
    o.run_id = "dmiss";
    o.inner_steps = 1;
    o.min_group_size = 2;
    o.target_group_size = 2;
    o.timeout_s = 1.0;
    o.matchmaking_time_s = 0.5;
    o.load_timeout_s = 2;
    hmc_diloco *d;
    cr_assert_eq(hmc_diloco_open(h, &o, 4, &d), 0);
    float p[4] = {1, 2, 3, 4};
    hmc_diloco_report rep;
    cr_assert_eq(hmc_diloco_begin(d, p, &rep), 0);
    cr_assert_eq(rep.loaded, 0);
    cr_assert_str_eq(rep.code, "not_found", "a lone newcomer: %s %s", rep.code, rep.error);
    float q[4] = {0.5f, 2.5f, 3, 3};
    float want[4];
    for (int i = 0; i < 4; i++) {
        float g = p[i] - q[i];
        want[i] = p[i] + -0.7f * (g + 0.9f * g);
    }
    cr_assert_eq(hmc_diloco_step(d, q, &rep), 1);
    cr_assert_eq(rep.averaged, 0);
    cr_assert_eq(rep.group_size, 0);
    cr_assert_eq(rep.status, -EREMOTEIO);
    cr_assert_str_eq(rep.code, "no_group", "%s %s", rep.code, rep.error);
    cr_assert_eq(rep.round, 0);
    cr_assert_eq(rep.caught_up, 0, "caught up with its own older state");
    for (int i = 0; i < 4; i++)
        cr_assert(fabsf(q[i] - want[i]) <= 1e-6f, "param %d: %g, own update %g", i, q[i],
                  want[i]);
    cr_assert_eq(hmc_diloco_round(d), 1);
    float bad[4] = {1, NAN, 0, 0};
    cr_assert_eq(hmc_diloco_outer_step(d, bad, &rep), -EDOM);
    cr_assert_eq(hmc_diloco_round(d), 1, "a refused step counted");
    hmc_diloco_close(d);
    hmc_close(h);
}

Test(diloco, bad_options)
{
    struct node n;
    start_node(&n, "opts", NULL, NULL);
    hmc *h = connect_to(&n);
    hmc_diloco_opts o;
    hmc_diloco *d = (hmc_diloco *)1;
    hmc_diloco_opts_init(&o);
    cr_assert_eq(hmc_diloco_open(h, &o, 4, &d), -EINVAL);
    cr_assert_null(d);
    cr_assert(strstr(hmc_last_error(h), "run_id") != NULL, "%s", hmc_last_error(h));
    o.run_id = "x";
    o.outer_momentum = 1.0;
    cr_assert_eq(hmc_diloco_open(h, &o, 4, &d), -EINVAL);
    cr_assert(strstr(hmc_last_error(h), "outer_momentum") != NULL);
    o.outer_momentum = 0.9;
    o.compression = "zip";
    cr_assert_eq(hmc_diloco_open(h, &o, 4, &d), -EINVAL);
    o.compression = "8bit";
    o.inner_steps = 0;
    cr_assert_eq(hmc_diloco_open(h, &o, 4, &d), -EINVAL);
    o.inner_steps = 3;
    cr_assert_eq(hmc_diloco_open(h, &o, 0, &d), -EINVAL);
    cr_assert_eq(hmc_diloco_open(h, &o, 4, &d), 0);
    float p[4] = {0};
    cr_assert_eq(hmc_diloco_step(d, p, NULL), -EINVAL, "a step before begin");
    hmc_diloco_close(d);
    hmc_close(h);
}

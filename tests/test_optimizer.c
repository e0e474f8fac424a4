/*
 * test_optimizer: the collaborative optimizer of libhivemind (hmc_opt_*)
 * with three trainers, threads of this process, each attached to a
 * hivemindd of its own on 127.0.0.1. Each trainer's gradients are known
 * (a different vector per trainer) and its batch size differs, so the
 * test can check that an epoch ends only once the trainers' summed
 * samples reached the target, and that the gradients every trainer steps
 * on are the sample-weighted mean of the three.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "lib/hivemind.h"
#include "tests/proc.h"

#define N_TRAINERS 3
#define N_PARAMS 1000
/* With about 100 samples/s in all, about 6 s of training; one trainer alone would need 12 s or more. */
#define TARGET 600

static void setup(void) { hm_proc_setup("opt"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(optimizer, .init = setup, .fini = teardown, .timeout = 150);

static void start_swarm(struct node *nodes, size_t n)
{
    char name[16];
    start_node(&nodes[0], "n0", NULL, NULL);
    for (size_t i = 1; i < n; i++) {
        snprintf(name, sizeof(name), "n%zu", i);
        start_node(&nodes[i], name, NULL, "--initial-peers", nodes[0].addr, NULL);
    }
    long deadline = hm_test_now_ms() + 20000;
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

static const uint64_t batch[N_TRAINERS] = {2, 3, 5};
/* Samples all trainers had handed to hmc_opt_step in epoch 0, as they went. */
static atomic_ullong given0;

typedef struct trainer {
    int i;
    struct node *node;
    float params[N_PARAMS];
    float stepped[N_PARAMS]; /* the gradients of the first local step */
    int n_steps_called;
    hmc_opt_report end;      /* the report of the call that ended epoch 0 */
    unsigned long long given_at_end; /* given0 when epoch 0 ended here */
    int err;
    char msg[512];
    uint64_t target;
    double mm_s, avg_timeout_s;
    long end_call_ms;        /* how long the call that ended epoch 0 took */
    int pause_us;            /* between steps */
    int group;               /* target_group_size; 0: N_TRAINERS */
    const char *run;         /* NULL: "optrun" */
} trainer;

static float grad_of(int i, size_t k) { return (float)(i + 1) + (float)k * 0.001f * (float)(i + 2); }

static void local_step(void *ud, float *params, const float *grads, size_t n)
{
    trainer *t = ud;
    if (t->n_steps_called++ == 0)
        memcpy(t->stepped, grads, n * sizeof(float));
    for (size_t k = 0; k < n; k++)
        params[k] -= 0.1f * grads[k];
}

static void *train(void *arg)
{
    trainer *t = arg;
    hmc *h = NULL;
    hmc_opt *o = NULL;
    char err[256];
    float g[N_PARAMS];
    for (size_t k = 0; k < N_PARAMS; k++)
        g[k] = grad_of(t->i, k);
    if ((t->err = hmc_connect(t->node->sock, &h, err, sizeof(err))) != 0) {
        snprintf(t->msg, sizeof(t->msg), "connect: %s", err);
        return NULL;
    }
    hmc_set_timeout(h, 60000);
    hmc_opt_opts oo;
    hmc_opt_opts_init(&oo);
    oo.run_id = t->run != NULL ? t->run : "optrun";
    oo.target_batch_size = t->target;
    oo.batch_size_per_step = batch[t->i];
    oo.matchmaking_time_s = t->mm_s;
    oo.averaging_timeout_s = t->avg_timeout_s;
    oo.target_group_size = t->group > 0 ? t->group : N_TRAINERS;
    oo.step = local_step;
    oo.step_ud = t;
    if ((t->err = hmc_opt_open(h, &oo, N_PARAMS, &o)) != 0) {
        snprintf(t->msg, sizeof(t->msg), "open: %s", hmc_last_error(h));
        hmc_close(h);
        return NULL;
    }
    long deadline = hm_test_now_ms() + 90000;
    while (hmc_opt_local_epoch(o) == 0 && hm_test_now_ms() < deadline) {
        hmc_opt_report rep;
        atomic_fetch_add(&given0, batch[t->i]);
        unsigned long long before = atomic_load(&given0);
        long call_start = hm_test_now_ms();
        if ((t->err = hmc_opt_step(o, g, 0, t->params, &rep)) != 0) {
            snprintf(t->msg, sizeof(t->msg), "step: %s", hmc_last_error(h));
            break;
        }
        if (rep.epoch_ended) {
            t->end = rep;
            t->given_at_end = before;
            t->end_call_ms = hm_test_now_ms() - call_start;
        }
        usleep(t->pause_us);
    }
    if (hmc_opt_local_epoch(o) == 0 && t->err == 0) {
        t->err = -ETIMEDOUT;
        snprintf(t->msg, sizeof(t->msg), "epoch 0 never ended");
    }
    hmc_opt_close(o);
    hmc_close(h);
    return NULL;
}

Test(optimizer, three_trainers_step_on_the_sample_weighted_mean)
{
    struct node nodes[N_TRAINERS];
    trainer *t = calloc(N_TRAINERS, sizeof(*t));
    pthread_t th[N_TRAINERS];
    cr_assert_not_null(t);
    start_swarm(nodes, N_TRAINERS);
    for (int i = 0; i < N_TRAINERS; i++) {
        t[i].i = i;
        t[i].node = &nodes[i];
        t[i].target = TARGET;
        t[i].mm_s = 6;
        t[i].avg_timeout_s = 10;
        t[i].pause_us = 100000;
        cr_assert_eq(pthread_create(&th[i], NULL, train, &t[i]), 0);
    }
    for (int i = 0; i < N_TRAINERS; i++)
        pthread_join(th[i], NULL);
    uint64_t total = 0;
    for (int i = 0; i < N_TRAINERS; i++) {
        cr_assert_eq(t[i].err, 0, "trainer %d: %s", i, t[i].msg);
        cr_assert(t[i].end.epoch_ended, "trainer %d: no epoch end seen", i);
        cr_assert_eq(t[i].n_steps_called, 1, "trainer %d: %d local steps", i, t[i].n_steps_called);
        cr_assert(t[i].end.averaged, "trainer %d stepped on its own gradients: %s", i,
                  t[i].end.error);
        cr_assert_eq(t[i].end.group_size, N_TRAINERS, "trainer %d: a group of %d", i,
                     t[i].end.group_size);
        cr_assert_eq(t[i].end.samples % batch[i], 0);
        total += t[i].end.samples;
    }
    /* Not before: the samples the three accumulated in epoch 0 (each stops
     * at its own end, and the first end makes the others end) reach the
     * target, and every sample handed over was in the average. */
    cr_log_info("epoch 0 ended at %llu samples: %llu, %llu, %llu", (unsigned long long)total,
                (unsigned long long)t[0].end.samples, (unsigned long long)t[1].end.samples,
                (unsigned long long)t[2].end.samples);
    cr_assert(total >= TARGET, "epoch 0 ended at %llu samples, before the target %d",
              (unsigned long long)total, TARGET);
    /* The swarm's sum ended it, not one trainer's own count, and soon after
     * the target (the records' lag is about 1.5 s, some 150 samples). */
    for (int i = 0; i < N_TRAINERS; i++)
        cr_assert(t[i].end.samples < TARGET, "trainer %d reached the target alone (%llu)", i,
                  (unsigned long long)t[i].end.samples);
    cr_assert(total < TARGET + 500, "epoch 0 ended late, at %llu samples",
              (unsigned long long)total);
    cr_assert_eq(total, (uint64_t)atomic_load(&given0), "samples handed over in epoch 0: %llu, "
                 "averaged: %llu", (unsigned long long)atomic_load(&given0),
                 (unsigned long long)total);
    for (int i = 0; i < N_TRAINERS; i++) {
        for (size_t k = 0; k < N_PARAMS; k++) {
            double want = 0;
            for (int j = 0; j < N_TRAINERS; j++)
                want += (double)t[j].end.samples * grad_of(j, k);
            want /= (double)total;
            cr_assert(fabs(t[i].stepped[k] - want) <= 1e-4 * fabs(want) + 1e-5,
                      "trainer %d, element %zu: %.7g, the weighted mean is %.7g", i, k,
                      t[i].stepped[k], want);
        }
    }
    free(t);
}

/* -- scheduled rounds -- */

/*
 * Matchmaking starts matchmaking_time before the epoch's estimated end.
 * The group target is 16 and the swarm 3, so a group found only at the
 * end would cost the leader's whole matchmaking time (4 s) after the
 * target was reached; scheduled ahead, the group is ready when the
 * samples are in, and the call that ends the epoch only runs the
 * all-reduce. The weight given at the release is what counts: the step
 * is still on the sample-weighted mean.
 */
Test(optimizer, matchmaking_starts_before_the_epoch_ends)
{
    struct node nodes[N_TRAINERS];
    trainer *t = calloc(N_TRAINERS, sizeof(*t));
    pthread_t th[N_TRAINERS];
    const double mm_s = 4;
    cr_assert_not_null(t);
    atomic_store(&given0, 0);
    start_swarm(nodes, N_TRAINERS);
    for (int i = 0; i < N_TRAINERS; i++) {
        t[i].i = i;
        t[i].node = &nodes[i];
        t[i].target = TARGET;
        t[i].mm_s = mm_s;
        t[i].avg_timeout_s = 10;
        t[i].pause_us = 100000;
        t[i].group = 16;
        t[i].run = "schedrun";
        cr_assert_eq(pthread_create(&th[i], NULL, train, &t[i]), 0);
    }
    for (int i = 0; i < N_TRAINERS; i++)
        pthread_join(th[i], NULL);
    uint64_t total = 0;
    for (int i = 0; i < N_TRAINERS; i++) {
        cr_assert_eq(t[i].err, 0, "trainer %d: %s", i, t[i].msg);
        cr_assert(t[i].end.epoch_ended, "trainer %d: no epoch end seen", i);
        cr_log_info("trainer %d: round matched %.2f s before the end, the end took %ld ms "
                    "(group %d)", i, t[i].end.matchmaking_lead_s, t[i].end_call_ms,
                    t[i].end.group_size);
        cr_assert(t[i].end.averaged, "trainer %d stepped on its own gradients: %s", i,
                  t[i].end.error);
        cr_assert_eq(t[i].end.group_size, N_TRAINERS);
        cr_assert(t[i].end.scheduled, "trainer %d: the round was not matched ahead", i);
        /* Began before the end, by about the matchmaking time. */
        cr_assert(t[i].end.matchmaking_lead_s >= 1.0 &&
                      t[i].end.matchmaking_lead_s <= mm_s + 4.0,
                  "trainer %d: matched %.2f s before the end", i, t[i].end.matchmaking_lead_s);
        /* An ordinary round would have looked for the group for mm_s now. */
        cr_assert(t[i].end_call_ms < (long)(mm_s * 1000), "trainer %d: the end took %ld ms", i,
                  t[i].end_call_ms);
        total += t[i].end.samples;
    }
    cr_assert(total >= TARGET);
    cr_assert_eq(total, (uint64_t)atomic_load(&given0));
    for (int i = 0; i < N_TRAINERS; i++) {
        for (size_t k = 0; k < N_PARAMS; k++) {
            double want = 0;
            for (int j = 0; j < N_TRAINERS; j++)
                want += (double)t[j].end.samples * grad_of(j, k);
            want /= (double)total;
            cr_assert(fabs(t[i].stepped[k] - want) <= 1e-4 * fabs(want) + 1e-5,
                      "trainer %d, element %zu: %.7g, the weighted mean is %.7g", i, k,
                      t[i].stepped[k], want);
        }
    }
    free(t);
}

/*
 * The daemon's held rounds under the optimizer's schedule: two rounds
 * started with "hold" find their group, the data written after they
 * started and the weights given to average.go are what is averaged; a
 * round never released fails once its hold times out; average.go with
 * nothing held is not_found, and "hold" on files is refused.
 */
Test(optimizer, held_rounds_average_what_the_release_gives)
{
    struct node nodes[2];
    hmc *h[2];
    hmc_buf *b[2];
    hmc_round *rd[2];
    char err[256], *res = NULL;
    const size_t n = 5000;
    const double w[2] = {1, 3};
    start_swarm(nodes, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(hmc_connect(nodes[i].sock, &h[i], err, sizeof(err)), 0, "%s", err);
        cr_assert_eq(hmc_buf_alloc(h[i], n * sizeof(float), &b[i]), 0);
        hmc_avg_opts ao;
        hmc_avg_opts_init(&ao);
        ao.prefix = "held.grad.0";
        ao.weight = 100; /* replaced by the release's */
        ao.timeout_s = 10;
        ao.matchmaking_time_s = 1;
        ao.target_group_size = 2;
        ao.extra_json = "{\"hold\":true,\"hold_timeout\":20}";
        cr_assert_eq(hmc_average_start(h[i], b[i], 0, n, &ao, &rd[i]), 0, "%s",
                     hmc_last_error(h[i]));
    }
    /* The group forms meanwhile; the data is written only now. */
    sleep(2);
    for (int i = 0; i < 2; i++) {
        cr_assert(!hmc_round_done(rd[i]), "round %d ended while held", i);
        float *d = hmc_buf_data(b[i]);
        for (size_t k = 0; k < n; k++)
            d[k] = (float)(i + 1) * 10.0f + (float)k * 0.01f;
    }
    for (int i = 0; i < 2; i++)
        cr_assert_eq(hmc_average_go(h[i], "held.grad.0", w[i]), 0, "%s", hmc_last_error(h[i]));
    for (int i = 0; i < 2; i++) {
        char *json = NULL;
        cr_assert_eq(hmc_round_wait(rd[i], -1, &json), 0, "round %d: %s", i,
                     hmc_round_error(rd[i]));
        cr_assert_not_null(strstr(json, "\"group_size\":2"), "%s", json);
        hmc_free_string(json);
        const float *d = hmc_buf_data(b[i]);
        for (size_t k = 0; k < n; k++) {
            double want = (w[0] * (10.0 + k * 0.01) + w[1] * (20.0 + k * 0.01)) / (w[0] + w[1]);
            cr_assert(fabs(d[k] - want) < 1e-3, "daemon %d, element %zu: %.6g, want %.6g", i, k,
                      d[k], want);
        }
        hmc_round_free(rd[i]);
    }
    /* Nothing held now. */
    cr_assert_eq(hmc_average_go(h[0], "held.grad.0", 1), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h[0]), "not_found");
    /* Held and never released: the hold times out, the others' round with it. */
    for (int i = 0; i < 2; i++) {
        hmc_avg_opts ao;
        hmc_avg_opts_init(&ao);
        ao.prefix = "held.grad.1";
        ao.timeout_s = 10;
        ao.matchmaking_time_s = 1;
        ao.target_group_size = 2;
        ao.extra_json = "{\"hold\":true,\"hold_timeout\":1}";
        cr_assert_eq(hmc_average_start(h[i], b[i], 0, n, &ao, &rd[i]), 0);
    }
    long t0 = hm_test_now_ms();
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(hmc_round_wait(rd[i], -1, NULL), -EREMOTEIO);
        cr_assert_str_eq(hmc_round_error_code(rd[i]), "timeout", "%s", hmc_round_error(rd[i]));
        hmc_round_free(rd[i]);
    }
    cr_assert(hm_test_now_ms() - t0 < 10000, "the held rounds lasted %ld ms",
              hm_test_now_ms() - t0);
    /* Files are read before a round starts: hold makes no sense there. */
    cr_assert_eq(hmc_request(h[0], "average", "{\"prefix\":\"x\",\"in\":\"/tmp/a\","
                             "\"out\":\"/tmp/b\",\"hold\":true}", &res), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h[0]), "bad_args");
    for (int i = 0; i < 2; i++) {
        hmc_buf_free(b[i]);
        hmc_close(h[i]);
    }
}

/*
 * A trainer SIGKILLed mid-epoch (a child process that reported and then
 * dies) holds the two others up by no more than the matchmaking time and
 * the averaging timeout: they end the epoch, average between themselves
 * (or fall back to their own gradients), and step.
 */
Test(optimizer, a_killed_trainer_holds_the_others_up_within_the_timeouts)
{
    struct node nodes[N_TRAINERS];
    trainer *t = calloc(N_TRAINERS, sizeof(*t));
    pthread_t th[N_TRAINERS];
    cr_assert_not_null(t);
    start_swarm(nodes, N_TRAINERS);
    const double mm_s = 3, avg_timeout_s = 5;
    for (int i = 0; i < N_TRAINERS; i++) {
        t[i].i = i;
        t[i].node = &nodes[i];
        t[i].target = 600;
        t[i].mm_s = mm_s;
        t[i].avg_timeout_s = avg_timeout_s;
        t[i].pause_us = 100000; /* about 100 samples/s in all: the target takes 6 s */
    }
    /* The victim: trainer 2 in a child process of its own. */
    pid_t victim = fork();
    cr_assert(victim >= 0);
    if (victim == 0) {
        train(&t[2]);
        _exit(0);
    }
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, train, &t[i]), 0);
    /* Once the victim's report is in the swarm, and well before the target. */
    hmc *h;
    char err[256];
    cr_assert_eq(hmc_connect(nodes[0].sock, &h, err, sizeof(err)), 0, "%s", err);
    long deadline = hm_test_now_ms() + 20000;
    int seen = 0;
    while (!seen && hm_test_now_ms() < deadline) {
        hmc_progress p;
        cr_assert_eq(hmc_progress_get(h, "optrun", 0, &p, NULL), 0);
        seen = p.n_peers == 3 && p.samples > 0 && p.samples < 400;
        if (!seen)
            usleep(100000);
    }
    cr_assert(seen, "the three trainers never showed in the progress");
    cr_assert_eq(kill(victim, SIGKILL), 0);
    waitpid(victim, NULL, 0);
    hmc_close(h);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(t[i].err, 0, "trainer %d: %s", i, t[i].msg);
        cr_assert(t[i].end.epoch_ended);
        cr_assert_eq(t[i].n_steps_called, 1);
        cr_assert(t[i].end.averaged || t[i].end.local_fallback);
        if (t[i].end.averaged)
            cr_assert(t[i].end.group_size == 2, "trainer %d: a group of %d with a dead member", i,
                      t[i].end.group_size);
        cr_log_info("trainer %d: the epoch's end took %ld ms (%s, group %d)", i, t[i].end_call_ms,
                    t[i].end.averaged ? "averaged" : "local", t[i].end.group_size);
        cr_assert(t[i].end_call_ms <= (long)((mm_s + avg_timeout_s) * 1000) + 3000,
                  "trainer %d was held up %ld ms", i, t[i].end_call_ms);
    }
    free(t);
}

/*
 * A late peer: two trainers that share their state after each epoch run
 * ahead with an Adam-like local optimizer (its moments are the named
 * statistics "exp_avg,exp_avg_sq"); a third starts at epoch 0, is more
 * than one epoch behind, and must discard its gradients, jump to the
 * swarm's epoch and load what a donor had there: the parameters, the
 * moments and the epoch.
 */
#define MAX_EPOCHS 64
typedef struct adam {
    float m[N_PARAMS], v[N_PARAMS];
} adam;

static void adam_step(void *ud, float *params, const float *grads, size_t n)
{
    adam *a = ud;
    for (size_t k = 0; k < n; k++) {
        a->m[k] = 0.9f * a->m[k] + 0.1f * grads[k];
        a->v[k] = 0.999f * a->v[k] + 0.001f * grads[k] * grads[k];
        params[k] -= 0.01f * a->m[k] / (sqrtf(a->v[k]) + 1e-8f);
    }
}

static void adam_get(void *ud, float *stats, size_t n)
{
    adam *a = ud;
    cr_assert_eq(n, 2 * N_PARAMS);
    memcpy(stats, a->m, sizeof(a->m));
    memcpy(stats + N_PARAMS, a->v, sizeof(a->v));
}

static void adam_set(void *ud, const float *stats, size_t n)
{
    adam *a = ud;
    cr_assert_eq(n, 2 * N_PARAMS);
    memcpy(a->m, stats, sizeof(a->m));
    memcpy(a->v, stats + N_PARAMS, sizeof(a->v));
}

typedef struct donor {
    struct node *node;
    int i;
    adam st;
    float params[N_PARAMS];
    float snap[MAX_EPOCHS][N_PARAMS]; /* the parameters at each epoch reached */
    adam snap_st[MAX_EPOCHS];         /* and the moments */
    int have[MAX_EPOCHS];
    atomic_int *stop;
    int err;
    char msg[256];
} donor;

static void plain_step(void *ud, float *params, const float *grads, size_t n)
{
    (void)ud;
    for (size_t k = 0; k < n; k++)
        params[k] -= 0.1f * grads[k];
}

static hmc_opt *open_sharing(hmc *h, int i, adam *st)
{
    hmc_opt *o = NULL;
    hmc_opt_opts oo;
    hmc_opt_opts_init(&oo);
    oo.run_id = "laterun";
    oo.target_batch_size = 60;
    oo.batch_size_per_step = batch[i];
    oo.matchmaking_time_s = 3;
    oo.averaging_timeout_s = 10;
    oo.target_group_size = 2;
    oo.share_state = 1;
    oo.load_timeout_s = 20;
    oo.step = adam_step;
    oo.step_ud = st;
    oo.n_stats = 2 * N_PARAMS;
    oo.stat_names = "exp_avg,exp_avg_sq";
    oo.stats_get = adam_get;
    oo.stats_set = adam_set;
    cr_assert_eq(hmc_opt_open(h, &oo, N_PARAMS, &o), 0, "open: %s", hmc_last_error(h));
    return o;
}

static void *donate(void *arg)
{
    donor *t = arg;
    hmc *h = NULL;
    char err[256];
    float g[N_PARAMS];
    for (size_t k = 0; k < N_PARAMS; k++)
        g[k] = grad_of(t->i, k);
    if ((t->err = hmc_connect(t->node->sock, &h, err, sizeof(err))) != 0)
        return NULL;
    hmc_set_timeout(h, 60000);
    hmc_opt *o = open_sharing(h, t->i, &t->st);
    long deadline = hm_test_now_ms() + 90000;
    while (!atomic_load(t->stop) && hm_test_now_ms() < deadline) {
        hmc_opt_report rep;
        if ((t->err = hmc_opt_step(o, g, 0, t->params, &rep)) != 0) {
            snprintf(t->msg, sizeof(t->msg), "step: %s", hmc_last_error(h));
            break;
        }
        /* What the call shared: the state right after the epoch's step. */
        if (rep.epoch_ended && rep.epoch < MAX_EPOCHS) {
            memcpy(t->snap[rep.epoch], t->params, sizeof(t->params));
            t->snap_st[rep.epoch] = t->st;
            t->have[rep.epoch] = 1;
        }
        usleep(20000);
    }
    hmc_opt_close(o);
    hmc_close(h);
    return NULL;
}

Test(optimizer, a_late_peer_catches_up_through_a_state_load)
{
    struct node nodes[N_TRAINERS];
    donor *d = calloc(2, sizeof(*d));
    adam *st = calloc(1, sizeof(*st));
    pthread_t th[2];
    atomic_int stop = 0;
    cr_assert_not_null(d);
    cr_assert_not_null(st);
    start_swarm(nodes, N_TRAINERS);
    for (int i = 0; i < 2; i++) {
        d[i].node = &nodes[i];
        d[i].i = i;
        d[i].stop = &stop;
        cr_assert_eq(pthread_create(&th[i], NULL, donate, &d[i]), 0);
    }
    hmc *h;
    char err[256];
    cr_assert_eq(hmc_connect(nodes[2].sock, &h, err, sizeof(err)), 0, "%s", err);
    hmc_set_timeout(h, 60000);
    long deadline = hm_test_now_ms() + 60000;
    hmc_progress p = {0};
    while (p.global_epoch < 3 && hm_test_now_ms() < deadline) {
        cr_assert_eq(hmc_progress_get(h, "laterun", 0, &p, NULL), 0);
        usleep(200000);
    }
    cr_assert_geq(p.global_epoch, 3, "the swarm never reached epoch 3");
    hmc_opt *o = open_sharing(h, 2, st);
    float params[N_PARAMS] = {0}, g[N_PARAMS];
    for (size_t k = 0; k < N_PARAMS; k++)
        g[k] = 1000.0f; /* gradients the late peer must discard */
    hmc_opt_report rep;
    cr_assert_eq(hmc_opt_step(o, g, 0, params, &rep), 0, "%s", hmc_last_error(h));
    atomic_store(&stop, 1);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    cr_assert(rep.caught_up, "the late peer did not catch up (epoch %llu, global %llu)",
              (unsigned long long)rep.epoch, (unsigned long long)rep.global_epoch);
    cr_assert(!rep.epoch_ended, "the late peer stepped on its own gradients");
    cr_assert(rep.state_loaded, "no state was loaded");
    cr_assert_geq(rep.epoch, 3);
    cr_assert_eq(hmc_opt_local_epoch(o), rep.epoch);
    cr_assert(rep.epoch < MAX_EPOCHS);
    /* The parameters and the moments are those a donor had at that epoch. */
    int match = 0;
    for (int i = 0; i < 2; i++)
        if (d[i].have[rep.epoch] &&
            memcmp(d[i].snap[rep.epoch], params, sizeof(params)) == 0 &&
            memcmp(&d[i].snap_st[rep.epoch], st, sizeof(*st)) == 0)
            match = 1;
    cr_assert(match, "the loaded state (%g, m %g, v %g ...) is no donor's at epoch %llu",
              params[0], st->m[0], st->v[0], (unsigned long long)rep.epoch);
    cr_assert(st->m[0] != 0 && st->v[0] != 0, "the moments were not loaded");
    for (int i = 0; i < 2; i++)
        cr_assert_eq(d[i].err, 0, "donor %d: %s", i, d[i].msg);
    hmc_opt_close(o);
    hmc_close(h);
    free(st);
    free(d);
}

/*
 * A late peer already in a group: trainer L has matched its epoch-0 round
 * ahead of the end (the swarm's records, from two reporting daemons, put
 * the end within the matchmaking time) with a plain participant P on
 * another daemon. Then the swarm's epoch jumps to 2: L is more than an
 * epoch behind, discards its gradients and takes part in that round with
 * weight 0 rather than leave P to time it out. P's result is then its own
 * vector exactly: L helped average and contributed nothing.
 */
Test(optimizer, a_late_peer_joins_its_round_with_weight_0)
{
    struct node nodes[3];
    hmc *rh[2], *h, *ph;
    hmc_buf *pb;
    hmc_round *pr = NULL;
    char err[256];
    const size_t pn = N_PARAMS;
    start_swarm(nodes, 3);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(hmc_connect(nodes[i + 1].sock, &rh[i], err, sizeof(err)), 0, "%s", err);
        cr_assert_eq(hmc_progress_report(rh[i], "tagrun", 0, 400, 100.0, 0), 0);
    }
    cr_assert_eq(hmc_connect(nodes[0].sock, &h, err, sizeof(err)), 0, "%s", err);
    hmc_set_timeout(h, 60000);
    hmc_opt *o = NULL;
    hmc_opt_opts oo;
    hmc_opt_opts_init(&oo);
    oo.run_id = "tagrun";
    oo.target_batch_size = 1000;
    oo.batch_size_per_step = 2;
    oo.matchmaking_time_s = 3;
    oo.averaging_timeout_s = 30;
    oo.target_group_size = 2;
    oo.step = plain_step;
    cr_assert_eq(hmc_opt_open(h, &oo, N_PARAMS, &o), 0, "%s", hmc_last_error(h));
    float params[N_PARAMS] = {0}, g[N_PARAMS];
    for (size_t k = 0; k < N_PARAMS; k++)
        g[k] = 7.0f;
    hmc_opt_report rep;
    memset(&rep, 0, sizeof(rep));
    long deadline = hm_test_now_ms() + 30000;
    while (!rep.scheduled && hm_test_now_ms() < deadline) {
        cr_assert_eq(hmc_opt_step(o, g, 0, params, &rep), 0, "%s", hmc_last_error(h));
        cr_assert(!rep.epoch_ended);
        usleep(100000);
    }
    cr_assert(rep.scheduled, "L never matched its round ahead");
    /* P: a plain round under L's round name. */
    cr_assert_eq(hmc_connect(nodes[1].sock, &ph, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(hmc_buf_alloc(ph, pn * sizeof(float), &pb), 0);
    float *pd = hmc_buf_data(pb);
    for (size_t k = 0; k < pn; k++)
        pd[k] = 1.0f + (float)k * 0.5f;
    hmc_avg_opts ao;
    hmc_avg_opts_init(&ao);
    ao.prefix = "tagrun.grad.0";
    ao.weight = 1;
    ao.timeout_s = 20;
    ao.matchmaking_time_s = 3;
    ao.round_timeout_s = 30;
    ao.target_group_size = 2;
    cr_assert_eq(hmc_average_start(ph, pb, 0, pn, &ao, &pr), 0, "%s", hmc_last_error(ph));
    sleep(1);
    /* The swarm moves two epochs on. */
    for (int i = 0; i < 2; i++)
        cr_assert_eq(hmc_progress_report(rh[i], "tagrun", 2, 0, 100.0, 0), 0);
    deadline = hm_test_now_ms() + 30000;
    while (!rep.caught_up && hm_test_now_ms() < deadline) {
        cr_assert_eq(hmc_opt_step(o, g, 0, params, &rep), 0, "%s", hmc_last_error(h));
        cr_assert(!rep.epoch_ended, "L stepped on its own gradients");
        usleep(100000);
    }
    cr_assert(rep.caught_up, "L never found itself behind");
    cr_assert_eq(rep.epoch, 2);
    cr_assert(rep.tagged_along, "L left its group instead of joining with weight 0");
    cr_assert_eq(rep.tagged_along_group, 2);
    char *json = NULL;
    cr_assert_eq(hmc_round_wait(pr, -1, &json), 0, "P: %s", hmc_round_error(pr));
    cr_assert_not_null(strstr(json, "\"group_size\":2"), "%s", json);
    hmc_free_string(json);
    for (size_t k = 0; k < pn; k++)
        cr_assert(pd[k] == 1.0f + (float)k * 0.5f, "element %zu: %.7g, P's own is %.7g", k,
                  pd[k], 1.0f + (float)k * 0.5f);
    /* L's gradients went nowhere: its parameters never moved. */
    for (size_t k = 0; k < N_PARAMS; k++)
        cr_assert(params[k] == 0.0f);
    hmc_round_free(pr);
    hmc_buf_free(pb);
    hmc_close(ph);
    hmc_opt_close(o);
    hmc_close(h);
    for (int i = 0; i < 2; i++)
        hmc_close(rh[i]);
}

/*
 * average_state_every 1: two trainers that start from different
 * parameters step on the same averaged gradients and then average their
 * parameters, so both end epoch 0 with the mean of their stepped
 * parameters.
 */
typedef struct st_trainer {
    struct node *node;
    int i;
    float params[N_PARAMS];
    hmc_opt_report end;
    int err;
    char msg[256];
} st_trainer;

static void *train_state(void *arg)
{
    st_trainer *t = arg;
    hmc *h = NULL;
    hmc_opt *o = NULL;
    char err[256];
    float g[N_PARAMS];
    for (size_t k = 0; k < N_PARAMS; k++) {
        g[k] = 1.0f; /* the same everywhere: the mean gradient is 1 */
        t->params[k] = (float)(t->i * 10) + (float)k * 0.01f;
    }
    if ((t->err = hmc_connect(t->node->sock, &h, err, sizeof(err))) != 0)
        return NULL;
    hmc_set_timeout(h, 60000);
    hmc_opt_opts oo;
    hmc_opt_opts_init(&oo);
    oo.run_id = "staterun";
    oo.target_batch_size = 100;
    oo.batch_size_per_step = batch[t->i];
    oo.matchmaking_time_s = 4;
    oo.averaging_timeout_s = 10;
    oo.target_group_size = 2;
    oo.average_state_every = 1;
    oo.step = plain_step;
    if ((t->err = hmc_opt_open(h, &oo, N_PARAMS, &o)) != 0) {
        snprintf(t->msg, sizeof(t->msg), "open: %s", hmc_last_error(h));
        hmc_close(h);
        return NULL;
    }
    long deadline = hm_test_now_ms() + 60000;
    while (hmc_opt_local_epoch(o) == 0 && hm_test_now_ms() < deadline) {
        hmc_opt_report rep;
        if ((t->err = hmc_opt_step(o, g, 0, t->params, &rep)) != 0) {
            snprintf(t->msg, sizeof(t->msg), "step: %s", hmc_last_error(h));
            break;
        }
        if (rep.epoch_ended)
            t->end = rep;
        usleep(50000);
    }
    hmc_opt_close(o);
    hmc_close(h);
    return NULL;
}

Test(optimizer, average_state_every_averages_the_parameters_after_the_step)
{
    struct node nodes[2];
    st_trainer t[2];
    pthread_t th[2];
    memset(t, 0, sizeof(t));
    start_swarm(nodes, 2);
    for (int i = 0; i < 2; i++) {
        t[i].node = &nodes[i];
        t[i].i = i;
        cr_assert_eq(pthread_create(&th[i], NULL, train_state, &t[i]), 0);
    }
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(t[i].err, 0, "trainer %d: %s", i, t[i].msg);
        cr_assert(t[i].end.epoch_ended && t[i].end.averaged, "trainer %d: %s", i, t[i].end.error);
        cr_assert(t[i].end.state_averaged, "trainer %d did not average its parameters", i);
    }
    for (size_t k = 0; k < N_PARAMS; k++) {
        /* Each stepped by -0.1 on the mean gradient 1, then the mean of 0 and 10. */
        double want = 5.0 + (double)k * 0.01 - 0.1;
        for (int i = 0; i < 2; i++)
            cr_assert(fabs(t[i].params[k] - want) < 1e-4, "trainer %d, element %zu: %.7g, want %.7g",
                      i, k, t[i].params[k], want);
    }
}

/* -- delayed and local-update tests -- */

/*
 * Two trainers with delay_step or local_updates: the calls of each, the
 * parameters after the one that ended epoch 0, and those after the one
 * that ran epoch 0's delayed step.
 */
typedef struct dl_trainer {
    struct node *node;
    int i, delay, local;
    float start[N_PARAMS], params[N_PARAMS];
    float at_end[N_PARAMS];  /* after the call that ended epoch 0 */
    hmc_opt_report end;      /* that call's report */
    hmc_opt_report applied;  /* delay: the report of the call that stepped on epoch 0 */
    int calls_in_epoch0;     /* local: the calls of epoch 0, each a local step */
    int steps_seen;          /* local: reports with stepped before the end */
    float at_apply[N_PARAMS]; /* local: after the call that applied the state average */
    hmc_opt_report apply;    /* that call's report */
    int calls_after_end;     /* local: calls after the end, up to and with that one */
    int err;
    char msg[256];
} dl_trainer;

static void *train_dl(void *arg)
{
    dl_trainer *t = arg;
    hmc *h = NULL;
    hmc_opt *o = NULL;
    char err[256];
    float g[N_PARAMS];
    for (size_t k = 0; k < N_PARAMS; k++) {
        g[k] = t->local ? 1.0f : grad_of(t->i, k);
        t->params[k] = t->start[k] = (float)(t->i * 10) + (float)k * 0.01f;
    }
    if ((t->err = hmc_connect(t->node->sock, &h, err, sizeof(err))) != 0)
        return NULL;
    hmc_set_timeout(h, 60000);
    hmc_opt_opts oo;
    hmc_opt_opts_init(&oo);
    oo.run_id = t->delay ? (t->local ? "bglocalrun" : "delayrun") : "localrun";
    oo.target_batch_size = 100;
    oo.batch_size_per_step = batch[t->i];
    oo.matchmaking_time_s = 4;
    oo.averaging_timeout_s = 10;
    oo.target_group_size = 2;
    oo.delay_step = t->delay;
    oo.local_updates = t->local;
    oo.step = plain_step;
    if ((t->err = hmc_opt_open(h, &oo, N_PARAMS, &o)) != 0) {
        snprintf(t->msg, sizeof(t->msg), "open: %s", hmc_last_error(h));
        hmc_close(h);
        return NULL;
    }
    long deadline = hm_test_now_ms() + 60000;
    int done = 0;
    while (!done && hm_test_now_ms() < deadline) {
        hmc_opt_report rep;
        if ((t->err = hmc_opt_step(o, g, 0, t->params, &rep)) != 0) {
            snprintf(t->msg, sizeof(t->msg), "step: %s", hmc_last_error(h));
            break;
        }
        if (!t->end.epoch_ended) {
            t->calls_in_epoch0++;
            t->steps_seen += rep.stepped && !rep.epoch_ended;
        }
        if (rep.epoch_ended && !t->end.epoch_ended) {
            t->end = rep;
            memcpy(t->at_end, t->params, sizeof(t->params));
        }
        if (t->delay && !t->local && rep.stepped && rep.stepped_epoch == 0) {
            t->applied = rep;
            done = 1;
        }
        if (t->local && t->end.epoch_ended && !rep.epoch_ended) {
            t->calls_after_end++;
            if (rep.state_averaged) {
                t->apply = rep;
                memcpy(t->at_apply, t->params, sizeof(t->params));
                done = 1;
            }
        }
        usleep(50000);
    }
    if (!done && t->err == 0) {
        t->err = -ETIMEDOUT;
        snprintf(t->msg, sizeof(t->msg), "epoch 0 never ended or was never stepped on");
    }
    hmc_opt_close(o);
    hmc_close(h);
    return NULL;
}

static void run_dl(dl_trainer *t, int delay, int local)
{
    struct node nodes[2];
    pthread_t th[2];
    start_swarm(nodes, 2);
    for (int i = 0; i < 2; i++) {
        t[i].node = &nodes[i];
        t[i].i = i;
        t[i].delay = delay;
        t[i].local = local;
        cr_assert_eq(pthread_create(&th[i], NULL, train_dl, &t[i]), 0);
    }
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(t[i].err, 0, "trainer %d: %s", i, t[i].msg);
}

/*
 * delay_step: the call that ends epoch 0 leaves the parameters as they
 * are and returns with the round pending; a later call steps on the
 * sample-weighted mean of epoch 0's gradients.
 */
Test(optimizer, delay_step_steps_on_the_average_one_epoch_late)
{
    dl_trainer *t = calloc(2, sizeof(*t));
    cr_assert_not_null(t);
    run_dl(t, 1, 0);
    double s0 = (double)t[0].end.samples, s1 = (double)t[1].end.samples;
    cr_assert(s0 + s1 >= 100, "epoch 0 ended at %g samples", s0 + s1);
    for (int i = 0; i < 2; i++) {
        cr_assert(!t[i].end.stepped, "trainer %d stepped in the call that ended the epoch", i);
        cr_assert(memcmp(t[i].at_end, t[i].start, sizeof(t[i].start)) == 0,
                  "trainer %d: the parameters moved at the epoch's end", i);
        cr_assert(t[i].applied.averaged, "trainer %d: %s", i, t[i].applied.error);
        cr_assert_eq(t[i].applied.group_size, 2);
        cr_assert(!t[i].applied.epoch_ended || t[i].applied.epoch >= 2);
        for (size_t k = 0; k < N_PARAMS; k++) {
            double mean = (s0 * grad_of(0, k) + s1 * grad_of(1, k)) / (s0 + s1);
            double want = t[i].start[k] - 0.1 * mean;
            cr_assert(fabs(t[i].params[k] - want) < 1e-4,
                      "trainer %d, element %zu: %.7g, want %.7g", i, k, t[i].params[k], want);
        }
    }
    free(t);
}

/*
 * local_updates: every call steps on its own gradients (1 everywhere, so
 * the parameters fall by 0.1 a call). At epoch 0's end the state average
 * starts in the background from the parameters there, the local steps go
 * on, and the call that finds it over applies the delta rule: both hold
 * the mean of their epoch-end parameters minus their own steps since,
 * the local progress made while the round ran kept.
 */
Test(optimizer, local_updates_step_every_call_and_average_by_the_delta_rule)
{
    dl_trainer *t = calloc(2, sizeof(*t));
    cr_assert_not_null(t);
    run_dl(t, 0, 1);
    for (int i = 0; i < 2; i++) {
        cr_assert(t[i].end.epoch_ended && t[i].end.stepped);
        cr_assert_eq(t[i].steps_seen, t[i].calls_in_epoch0 - 1,
                     "trainer %d: %d local steps in %d calls", i, t[i].steps_seen,
                     t[i].calls_in_epoch0);
        cr_assert(t[i].end.state_started, "trainer %d started no state average", i);
        cr_assert(!t[i].end.state_averaged, "trainer %d averaged in the foreground", i);
        cr_assert(t[i].apply.state_averaged && t[i].apply.stepped && !t[i].apply.state_pending);
        cr_assert_geq(t[i].calls_after_end, 1);
        cr_log_info("trainer %d: %d calls in epoch 0, the average applied %d calls later", i,
                    t[i].calls_in_epoch0, t[i].calls_after_end);
    }
    for (size_t k = 0; k < N_PARAMS; k++) {
        double mean = 0;
        for (int i = 0; i < 2; i++) {
            /* Nothing was averaged at the end itself. */
            double end_i = t[i].start[k] - 0.1 * t[i].calls_in_epoch0;
            cr_assert(fabs(t[i].at_end[k] - end_i) < 1e-3, "trainer %d, element %zu: %.7g at "
                      "the end, want %.7g", i, k, t[i].at_end[k], end_i);
            mean += 0.5 * t[i].at_end[k];
        }
        for (int i = 0; i < 2; i++) {
            double want = mean - 0.1 * t[i].calls_after_end;
            cr_assert(fabs(t[i].at_apply[k] - want) < 1e-3,
                      "trainer %d, element %zu: %.7g, want %.7g", i, k, t[i].at_apply[k], want);
        }
    }
    free(t);
}

/*
 * delay_step with local_updates (Hivemind's delay_optimizer_step with
 * use_local_updates): each call's local step runs on a thread of its own,
 * on the optimizer's copy of the parameters, and the next call hands its
 * result to the caller's: after call k the parameters hold k - 1 steps
 * (SGD lr 0.1 on gradients of 1: start - 0.1 (k - 1)), the caller's array
 * is never the one stepped, and close waits for a step still running.
 */
struct bg_probe {
    pthread_t caller;
    const float *callers_params;
    atomic_int calls, on_caller, on_callers_array;
};

static void bg_probe_step(void *ud, float *params, const float *grads, size_t n)
{
    struct bg_probe *p = ud;
    atomic_fetch_add(&p->calls, 1);
    if (pthread_equal(pthread_self(), p->caller))
        atomic_fetch_add(&p->on_caller, 1);
    if (params == p->callers_params)
        atomic_fetch_add(&p->on_callers_array, 1);
    usleep(20000); /* long enough that the caller would see a race */
    for (size_t i = 0; i < n; i++)
        params[i] -= 0.1f * grads[i];
}

Test(optimizer, delay_step_with_local_updates_steps_in_the_background_one_call_late)
{
    struct node n;
    struct bg_probe probe;
    char err[256];
    hmc *h = NULL;
    hmc_opt *o = NULL;
    hmc_opt_opts oo;
    hmc_opt_report rep;
    static float params[N_PARAMS], grads[N_PARAMS];
    memset(&probe, 0, sizeof(probe));
    probe.caller = pthread_self();
    probe.callers_params = params;
    for (size_t k = 0; k < N_PARAMS; k++) {
        params[k] = (float)k * 0.01f;
        grads[k] = 1.0f;
    }
    start_node(&n, "n0", NULL, NULL);
    cr_assert_eq(hmc_connect(n.sock, &h, err, sizeof(err)), 0, "%s", err);
    hmc_opt_opts_init(&oo);
    oo.run_id = "bgsteps";
    oo.target_batch_size = 100000; /* no epoch ends: the steps alone */
    oo.step = bg_probe_step;
    oo.step_ud = &probe;
    oo.delay_step = 1;
    oo.local_updates = 1;
    cr_assert_eq(hmc_opt_open(h, &oo, N_PARAMS, &o), 0, "%s", hmc_last_error(h));
    for (int call = 1; call <= 5; call++) {
        cr_assert_eq(hmc_opt_step(o, grads, 1, params, &rep), 0, "call %d: %s", call,
                     hmc_last_error(h));
        cr_assert_eq(rep.stepped, call > 1, "call %d stepped %d", call, rep.stepped);
        cr_assert(rep.pending, "call %d left no step running", call);
        for (size_t k = 0; k < N_PARAMS; k++) {
            float want = (float)k * 0.01f - 0.1f * (float)(call - 1);
            cr_assert(fabsf(params[k] - want) < 1e-4f, "call %d, element %zu: %.7g, want %.7g",
                      call, k, params[k], want);
        }
    }
    hmc_opt_close(o); /* the fifth step still runs: waited for, its result dropped */
    cr_assert_eq(atomic_load(&probe.calls), 5);
    cr_assert_eq(atomic_load(&probe.on_caller), 0, "a step ran on the caller's thread");
    cr_assert_eq(atomic_load(&probe.on_callers_array), 0, "a step ran on the caller's array");
    hmc_close(h);
}

/*
 * delay_step with local_updates between two trainers: the same delta rule
 * as local_updates alone, with every local step landing one call late. At
 * epoch 0's end a trainer holds the steps of all its calls but the last
 * (start - 0.1 (calls - 1)), the state average starts from there, and the
 * call that applies it leaves the mean of those minus the steps that
 * landed since, one per call after the end.
 */
Test(optimizer, delay_step_with_local_updates_average_by_the_delta_rule)
{
    dl_trainer *t = calloc(2, sizeof(*t));
    cr_assert_not_null(t);
    run_dl(t, 1, 1);
    for (int i = 0; i < 2; i++) {
        cr_assert(t[i].end.epoch_ended && t[i].end.stepped && t[i].end.pending);
        cr_assert_eq(t[i].steps_seen, t[i].calls_in_epoch0 - 2,
                     "trainer %d: %d steps landed in %d calls", i, t[i].steps_seen,
                     t[i].calls_in_epoch0);
        cr_assert(t[i].end.state_started, "trainer %d started no state average", i);
        cr_assert(t[i].apply.state_averaged && t[i].apply.stepped);
    }
    for (size_t k = 0; k < N_PARAMS; k++) {
        double mean = 0;
        for (int i = 0; i < 2; i++) {
            double end_i = t[i].start[k] - 0.1 * (t[i].calls_in_epoch0 - 1);
            cr_assert(fabs(t[i].at_end[k] - end_i) < 1e-3, "trainer %d, element %zu: %.7g at "
                      "the end, want %.7g", i, k, t[i].at_end[k], end_i);
            mean += 0.5 * t[i].at_end[k];
        }
        for (int i = 0; i < 2; i++) {
            double want = mean - 0.1 * t[i].calls_after_end;
            cr_assert(fabs(t[i].at_apply[k] - want) < 1e-3,
                      "trainer %d, element %zu: %.7g, want %.7g", i, k, t[i].at_apply[k], want);
        }
    }
    free(t);
}

/* -- ahead of the swarm -- */
typedef struct runner {
    struct node *node;
    int id;
    int stop_epoch;          /* step until our local epoch reaches it */
    int pause_epoch;         /* at this epoch wait for go (0: never) */
    atomic_int go;
    int err;
    char msg[512];
    atomic_int epoch;        /* the local epoch, as it goes */
    atomic_int *other_epoch; /* the other trainer's, NULL while there is none */
    int held;                /* calls that reported held_ahead */
    int ends_ahead;          /* epochs we ended while past the other trainer's epoch */
    hmc_opt_report last_end; /* the last epoch end's report */
} runner;

static void *run_epochs(void *arg)
{
    runner *r = arg;
    hmc *h = NULL;
    hmc_opt *o = NULL;
    char err[256];
    static float params[2][N_PARAMS];
    float g[N_PARAMS];
    for (size_t k = 0; k < N_PARAMS; k++)
        g[k] = 1.0f + (float)r->id;
    if ((r->err = hmc_connect(r->node->sock, &h, err, sizeof(err))) != 0) {
        snprintf(r->msg, sizeof(r->msg), "connect: %s", err);
        return NULL;
    }
    hmc_set_timeout(h, 60000);
    hmc_opt_opts oo;
    hmc_opt_opts_init(&oo);
    oo.run_id = "aheadrun";
    oo.target_batch_size = 40;
    oo.batch_size_per_step = 10;
    oo.matchmaking_time_s = 1;
    oo.averaging_timeout_s = 60; /* the hold would outlast the test */
    oo.target_group_size = 2;
    oo.step = plain_step;
    if ((r->err = hmc_opt_open(h, &oo, N_PARAMS, &o)) != 0) {
        snprintf(r->msg, sizeof(r->msg), "open: %s", hmc_last_error(h));
        hmc_close(h);
        return NULL;
    }
    long deadline = hm_test_now_ms() + 60000;
    while ((int)hmc_opt_local_epoch(o) < r->stop_epoch && hm_test_now_ms() < deadline) {
        hmc_opt_report rep;
        int before = (int)hmc_opt_local_epoch(o);
        if (r->pause_epoch > 0 && before == r->pause_epoch && !atomic_load(&r->go)) {
            usleep(20000);
            continue;
        }
        if ((r->err = hmc_opt_step(o, g, 0, params[r->id], &rep)) != 0) {
            snprintf(r->msg, sizeof(r->msg), "step: %s", hmc_last_error(h));
            break;
        }
        r->held += rep.held_ahead;
        if (rep.epoch_ended) {
            r->last_end = rep;
            if (r->other_epoch != NULL && before > atomic_load(r->other_epoch))
                r->ends_ahead++;
        }
        atomic_store(&r->epoch, (int)hmc_opt_local_epoch(o));
        usleep(50000);
    }
    if ((int)hmc_opt_local_epoch(o) < r->stop_epoch && r->err == 0) {
        r->err = -ETIMEDOUT;
        snprintf(r->msg, sizeof(r->msg), "trainer %d reached epoch %d only", r->id,
                 (int)hmc_opt_local_epoch(o));
    }
    hmc_opt_close(o);
    hmc_close(h);
    return NULL;
}

/*
 * With two trainers, the majority epoch is the lower one. A trainer past
 * it used to end every epoch on its own samples, so the two never met
 * again. Now the leader holds its epoch's end (accumulating) until the
 * other reaches its epoch, and the two then end it together, averaged.
 */
Test(optimizer, a_trainer_ahead_of_the_swarm_waits_for_it)
{
    struct node nodes[2];
    start_swarm(nodes, 2);
    runner a = {.node = &nodes[0], .id = 0, .stop_epoch = 4, .pause_epoch = 2};
    pthread_t ta, tb;
    /* Alone, A ends epochs 0 and 1 on its own samples, then pauses at 2. */
    cr_assert_eq(pthread_create(&ta, NULL, run_epochs, &a), 0);
    long deadline = hm_test_now_ms() + 30000;
    while (atomic_load(&a.epoch) < 2 && hm_test_now_ms() < deadline)
        usleep(20000);
    cr_assert_eq(atomic_load(&a.epoch), 2, "A alone reached epoch %d (%s)",
                 atomic_load(&a.epoch), a.msg);
    /* Then B joins at epoch 0 and A goes on, two epochs ahead. */
    runner b = {.node = &nodes[1], .id = 1, .stop_epoch = 4, .other_epoch = &a.epoch};
    a.other_epoch = &b.epoch;
    cr_assert_eq(pthread_create(&tb, NULL, run_epochs, &b), 0);
    usleep(1500000); /* B's first report is out and read */
    atomic_store(&a.go, 1);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    cr_assert_eq(a.err, 0, "%s (held %d; B at %d: %s, last end global %llu group %d)", a.msg,
                 a.held, atomic_load(&b.epoch), b.msg,
                 (unsigned long long)b.last_end.global_epoch, b.last_end.group_size);
    cr_assert_eq(b.err, 0, "%s", b.msg);
    cr_assert_gt(a.held, 0, "the leader never held its epoch's end");
    cr_assert_eq(a.ends_ahead, 0, "the leader ended %d epochs past the other trainer's",
                 a.ends_ahead);
    cr_assert(a.last_end.averaged && a.last_end.group_size == 2,
              "the leader's last epoch was not averaged with the other (group %d: %s)",
              a.last_end.group_size, a.last_end.error);
    cr_assert(b.last_end.averaged && b.last_end.group_size == 2,
              "the other's last epoch was not averaged (group %d: %s)", b.last_end.group_size,
              b.last_end.error);
}

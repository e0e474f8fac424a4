/*
 * test_hostile_progress: the swarm-progress gap of docs/security.md
 * ("Swarm progress records") against real hivemindd processes. Three
 * honest trainers report from their own origins (127.0.0.1, 127.0.0.3 and
 * 127.0.0.4, each daemon with --progress-cap-loopback, so that loopback
 * addresses count as origins the way public ones do); the attacker, in a
 * child of the test process, runs 32 nodes on 127.0.0.2 (one origin, 32
 * identities built with hivemindd's own libraries) that publish signed,
 * well-formed progress records: 16 at the honest epoch claiming 2^40
 * samples and 10^7 samples/s each, 16 at epoch 2^53 - 1.
 *
 * Asserted: before the attack every honest daemon sums the honest samples
 * exactly (600 at epoch 5); during it, every honest daemon counts the
 * attacker's records (35 trainers, 4 origins) but keeps the global epoch at
 * 5, counts the attacker's origin at most ProgressOriginFactor (4) times the
 * median origin's 200 samples, so 1400 samples (of a 10,000 target: the
 * epoch does not end) and no throughput, and reports the refusals as
 * limit metrics. A daemon with the defence switched off
 * (--progress-epoch-origins 1 --progress-origin-factor 0, loopback
 * uncapped) reads the same DHT and takes the attacker's epoch: the attack
 * is real.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>

#include "lib/hivemind.h"
#include "src/daemon/progress.h"
#include "src/base/origin.h"
#include "tests/hostile.h"
#include "tests/proc.h"

static void setup(void) { hm_proc_setup("hostileprog"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(hostile_progress, .init = setup, .fini = teardown, .timeout = 180);

#define RUN "hrun"
#define N_ATTACKERS 32
#define TARGET 10000

static long jint(const json_t *o, const char *k)
{
    return (long)json_integer_value(json_object_get(o, k));
}

/* The run's aggregate as one daemon sees it (hivemindctl progress). */
static json_t *progress(struct node *n)
{
    int rc;
    json_t *j = ctl_json(n, &rc, "progress", RUN, "--target", "10000", NULL);
    cr_assert_eq(rc, 0, "hivemindctl progress failed");
    json_t *res = json_incref(json_object_get(j, "result"));
    json_decref(j);
    cr_assert_not_null(res);
    return res;
}

/* The value of one metric line of `hivemindctl metrics`, or -1. */
static double metric(struct node *n, const char *name)
{
    char *out, *err;
    double v = -1;
    if (ctl(n->sock, "metrics", 0, &out, &err) == 0) {
        size_t nl = strlen(name);
        for (char *p = out; p != NULL && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
            if (strncmp(p, name, nl) == 0 && p[nl] == ' ') {
                v = strtod(p + nl + 1, NULL);
                break;
            }
        }
    }
    free(out);
    free(err);
    return v;
}

/* ---- the attacker's process ---- */

typedef struct attacker {
    uv_loop_t loop;
    uv_timer_t tick;
    hm_node *nodes[N_ATTACKERS];
    char marker[N_ATTACKERS][HM_DHT_OWNER_MARKER_LEN + 1];
    int all_ahead; /* every identity at epoch 2^53 - 1 (else every other one) */
} attacker;

static void atk_put_done(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    HM_UNUSED(ud);
    HM_UNUSED(status);
    HM_UNUSED(stored);
    HM_UNUSED(info);
}

/* Every identity (re)publishes its record, stamped now, with its own address. */
static void atk_publish(uv_timer_t *t)
{
    attacker *a = t->data;
    for (size_t i = 0; i < N_ATTACKERS; i++) {
        hm_progress_rec r = {
            .epoch = i % 2 == 0 && !a->all_ahead ? 5 : HM_PROGRESS_MAX_EPOCH,
            .samples = HM_PROGRESS_MAX_SAMPLES,
            .sps = HM_PROGRESS_MAX_SPS,
            .time = (double)hm_node_dht_now_ms(a->nodes[i]) / 1000.0,
        };
        char full[160];
        uint8_t value[HM_PROGRESS_VALUE_MAX];
        size_t len;
        hm_node_address(a->nodes[i], full, sizeof(full));
        hm_strlcpy(r.addr, strchr(full, '@') + 1, sizeof(r.addr));
        if (hm_progress_encode(&r, value, sizeof(value), &len) < 0)
            _exit(3);
        hm_node_dht_put(a->nodes[i], (const uint8_t *)RUN ".progress", strlen(RUN ".progress"),
                        (const uint8_t *)a->marker[i], strlen(a->marker[i]), 1, value, len, 60,
                        5000, atk_put_done, NULL);
    }
}

/*
 * Forks the attacker; it runs until the test kills it (at teardown at the
 * latest). Its identities are spread over the n_ips addresses of ips.
 */
static pid_t attacker_start_on(struct node *via, const char *const *ips, size_t n_ips,
                               int all_ahead)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid > 0) {
        cr_assert(n_children < MAX_CHILDREN);
        children[n_children++] = pid;
        return pid;
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent)
        _exit(127);
    hm_log_set_level(HM_LOG_ERROR);
    static attacker a;
    uv_loop_init(&a.loop);
    a.all_ahead = all_ahead;
    for (size_t i = 0; i < N_ATTACKERS; i++) {
        a.nodes[i] = hm_hostile_node(&a.loop, ips[i % n_ips], via->addr);
        hm_dht_owner_marker(hm_node_identity(a.nodes[i])->pk, a.marker[i]);
    }
    /* Joined first, then published every 5 s (the records live 60 s). */
    hm_hostile_run_for(&a.loop, 3000);
    uv_timer_init(&a.loop, &a.tick);
    a.tick.data = &a;
    uv_timer_start(&a.tick, atk_publish, 0, 5000);
    uv_run(&a.loop, UV_RUN_DEFAULT);
    _exit(0);
}

static pid_t attacker_start(struct node *via)
{
    static const char *const one[] = {"127.0.0.2"};
    return attacker_start_on(via, one, 1, 0);
}

/* ---- the honest side ---- */

static hmc *report(struct node *n, long samples)
{
    hmc *h;
    char err[256], args[256];
    char *res = NULL;
    cr_assert_eq(hmc_connect(n->sock, &h, err, sizeof(err)), 0, "connect: %s", err);
    snprintf(args, sizeof(args), "{\"run\":\"" RUN "\",\"epoch\":5,\"samples\":%ld,"
             "\"samples_per_second\":0}", samples);
    cr_assert_eq(hmc_request(h, "progress.report", args, &res), 0, "%s", hmc_last_error(h));
    hmc_free_string(res);
    return h;
}

/* Polls every daemon of nodes until each sees want_peers trainers over want_origins origins. */
static int wait_counted(struct node *nodes, size_t n, long want_peers, long want_origins,
                        int timeout_ms)
{
    long deadline = hm_test_now_ms() + timeout_ms;
    for (;;) {
        size_t ok = 0;
        for (size_t i = 0; i < n; i++) {
            json_t *j = progress(&nodes[i]);
            ok += jint(j, "n_peers") == want_peers && jint(j, "n_origins") == want_origins;
            json_decref(j);
        }
        if (ok == n)
            return 1;
        if (hm_test_now_ms() > deadline)
            return 0;
        usleep(500000);
    }
}

Test(hostile_progress, one_origin_of_identities_neither_ends_an_epoch_nor_moves_it)
{
    struct node hon[3], open;
    start_node(&hon[0], "h0", NULL, "--progress-cap-loopback", NULL);
    start_node(&hon[1], "h1", NULL, "--listen", "127.0.0.3:0", "--progress-cap-loopback",
               "--initial-peers", hon[0].addr, NULL);
    start_node(&hon[2], "h2", NULL, "--listen", "127.0.0.4:0", "--progress-cap-loopback",
               "--initial-peers", hon[0].addr, NULL);
    /* The defence off: one origin's vote moves the epoch, nothing is clamped. */
    start_node(&open, "open", NULL, "--listen", "127.0.0.5:0", "--progress-epoch-origins", "1",
               "--progress-origin-factor", "0", "--progress-epoch-majority=no",
               "--initial-peers", hon[0].addr, NULL);
    hmc *h[3] = {report(&hon[0], 100), report(&hon[1], 200), report(&hon[2], 300)};

    /* Honest trainers on their own origins aggregate exactly. */
    cr_assert(wait_counted(hon, 3, 3, 3, 30000), "the honest daemons never saw 3 trainers on 3 "
              "origins");
    for (int i = 0; i < 3; i++) {
        json_t *j = progress(&hon[i]);
        cr_assert_eq(jint(j, "global_epoch"), 5, "h%d: global epoch %ld", i,
                     jint(j, "global_epoch"));
        cr_assert_eq(jint(j, "samples"), 600, "h%d: %ld samples", i, jint(j, "samples"));
        json_decref(j);
    }

    attacker_start(&hon[0]);
    cr_assert(wait_counted(hon, 3, 3 + N_ATTACKERS, 4, 60000),
              "the honest daemons never counted the attacker's %d records on one origin",
              N_ATTACKERS);
    /* Several reads while the attack goes on: every one holds. */
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 3; i++) {
            json_t *j = progress(&hon[i]);
            cr_assert_eq(jint(j, "global_epoch"), 5, "h%d: the attacker moved the global epoch "
                         "to %ld", i, jint(j, "global_epoch"));
            /* 600 honest + 4 x the median origin's 200. */
            cr_assert_eq(jint(j, "samples"), 1400, "h%d: %ld samples", i, jint(j, "samples"));
            cr_assert(jint(j, "samples") < TARGET, "the attacker ended the epoch");
            cr_assert_eq(json_number_value(json_object_get(j, "samples_per_second")), 0.0,
                         "h%d: the attacker's throughput counted", i);
            cr_assert(json_is_null(json_object_get(j, "eta_s")), "h%d: an eta without honest "
                      "throughput", i);
            cr_assert_geq(jint(j, "held_back"), 1, "h%d", i);
            cr_assert_geq(jint(j, "clamped"), 1, "h%d", i);
            json_decref(j);
        }
        usleep(1500000);
    }
    for (int i = 0; i < 3; i++) {
        cr_assert_gt(metric(&hon[i], "hivemindd_limit_refused_total{limit=\"ProgressEpochOrigins\"}"),
                     0, "h%d", i);
        cr_assert_gt(metric(&hon[i], "hivemindd_limit_refused_total{limit=\"ProgressOriginFactor\"}"),
                     0, "h%d", i);
    }

    /* Without the defence the same records take the swarm. */
    long deadline = hm_test_now_ms() + 30000;
    long epoch = 0;
    while (epoch != (long)HM_PROGRESS_MAX_EPOCH && hm_test_now_ms() < deadline) {
        json_t *j = progress(&open);
        epoch = jint(j, "global_epoch");
        json_decref(j);
        if (epoch != (long)HM_PROGRESS_MAX_EPOCH)
            usleep(500000);
    }
    cr_assert_eq(epoch, (long)HM_PROGRESS_MAX_EPOCH, "the undefended daemon's epoch is %ld",
                 epoch);
    for (int i = 0; i < 3; i++)
        hmc_close(h[i]);
}

/* -- progress majority test -- */
/*
 * An attacker on two origins (127.0.0.2 and 127.0.0.6, 16 identities each,
 * every one at epoch 2^53 - 1) against three honest origins at epoch 5:
 * ProgressEpochOrigins (2) alone lets two origins move the epoch, which a
 * daemon with --progress-epoch-majority=no shows; with the majority rule
 * (the default) the epoch needs three of the five origins, and every
 * honest daemon keeps epoch 5 and its 600 samples.
 */
Test(hostile_progress, two_origins_of_identities_do_not_move_the_epoch)
{
    struct node hon[3], open;
    start_node(&hon[0], "h0", NULL, "--progress-cap-loopback", NULL);
    start_node(&hon[1], "h1", NULL, "--listen", "127.0.0.3:0", "--progress-cap-loopback",
               "--initial-peers", hon[0].addr, NULL);
    start_node(&hon[2], "h2", NULL, "--listen", "127.0.0.4:0", "--progress-cap-loopback",
               "--initial-peers", hon[0].addr, NULL);
    /* The ProgressEpochOrigins rule alone, as before the majority rule. */
    start_node(&open, "open", NULL, "--listen", "127.0.0.5:0", "--progress-cap-loopback",
               "--progress-epoch-majority=no", "--initial-peers", hon[0].addr, NULL);
    hmc *h[3] = {report(&hon[0], 100), report(&hon[1], 200), report(&hon[2], 300)};
    cr_assert(wait_counted(hon, 3, 3, 3, 30000), "the honest daemons never saw 3 trainers on 3 "
              "origins");

    static const char *const two[] = {"127.0.0.2", "127.0.0.6"};
    attacker_start_on(&hon[0], two, 2, 1);
    struct node all[4] = {hon[0], hon[1], hon[2], open};
    cr_assert(wait_counted(all, 4, 3 + N_ATTACKERS, 5, 60000),
              "the daemons never counted the attacker's %d records on two origins", N_ATTACKERS);
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 3; i++) {
            json_t *j = progress(&hon[i]);
            cr_assert_eq(jint(j, "global_epoch"), 5, "h%d: two attacker origins moved the "
                         "global epoch to %ld", i, jint(j, "global_epoch"));
            cr_assert_eq(jint(j, "samples"), 600, "h%d: %ld samples", i, jint(j, "samples"));
            cr_assert_eq(jint(j, "held_back"), 2, "h%d: %ld origins held back", i,
                         jint(j, "held_back"));
            json_decref(j);
        }
        usleep(1500000);
    }
    for (int i = 0; i < 3; i++)
        cr_assert_gt(metric(&hon[i], "hivemindd_limit_refused_total{limit=\"ProgressEpochOrigins\"}"),
                     0, "h%d", i);
    /* Without the majority rule the two origins take the swarm's epoch. */
    json_t *j = progress(&open);
    cr_assert_eq(jint(j, "global_epoch"), (long)HM_PROGRESS_MAX_EPOCH,
                 "the daemon without the majority rule reads epoch %ld",
                 jint(j, "global_epoch"));
    json_decref(j);
    for (int i = 0; i < 3; i++)
        hmc_close(h[i]);
}

/*
 * test_hostile_avg: attack cases 8 and 9 of docs/security.md against real
 * hivemindd processes. The honest daemons run on 127.0.0.1; the attacker
 * is a hivemindd of its own on 127.0.0.2 (and 127.0.0.4), asked over its
 * own control socket to declare what a hostile member would: it controls
 * its daemon, so that is exactly what it could send.
 *
 * Averaging (case 8): three honest members average a vector of 1.0 with
 * weight 1, the attacker a vector of 3.0, in one group of four.
 *   - weight 1e30, plain mean: every honest result is the bounded mean
 *     (3 + 4 x 3) / 7 = 15/7 (the attacker's weight clamped to
 *     AverageWeightFactor 4 times the median), not 3.0;
 *   - weight 1.7e308: the same finite result (without the bound the
 *     accumulator overflows and the round yields NaN or fails);
 *   - centered_clip with tau 1 and weight 1e30: every honest result within
 *     1.0 +- 0.5;
 *   - bandwidth 1e12 (weight 1): the attacker's span is at most
 *     AverageBandwidthFactor 2 / (2 + 3) of the vector, and the honest
 *     result is the exact mean 1.5.
 * State (case 9): honest donors on 127.0.0.1 and 127.0.0.3 share step 100;
 * two attacker identities on 127.0.0.2 share step 999999; a newcomer with
 * min_agree 2 loads step 100. Then attackers on two origins (127.0.0.2 and
 * 127.0.0.4) share step 999999, and a newcomer with StateTrustedDonors
 * naming the honest donors loads step 100 from them alone. Last, the two
 * attacker daemons on 127.0.0.2 declare step 999999 and leave, and
 * datagrams under their keys come from 127.0.0.9 and 127.0.0.10 (the
 * sources a spoofer would forge; these endpoints never answer the
 * newcomer's pings), so that its peer table holds them at two origins,
 * unverified: a newcomer with min_agree 2 still loads step 100, since only
 * verified entries, or the declared address once proven, give a donor its
 * origin.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <string.h>

#include <sys/prctl.h>

#include "lib/hivemind.h"
#include "src/base/crypto.h"
#include "src/base/util.h"
#include "src/net/rpc.h"
#include "tests/proc.h"

#define N_HONEST 3
#define N_ELEMS 20000

static void setup(void) { hm_proc_setup("hostavg"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(hostile_avg, .init = setup, .fini = teardown, .timeout = 120);

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

/* nodes[0..N_HONEST) honest on 127.0.0.1, nodes[N_HONEST] the attacker on 127.0.0.2. */
static void start_group(struct node *nodes)
{
    start_node(&nodes[0], "h0", NULL, NULL);
    start_node(&nodes[1], "h1", NULL, "--initial-peers", nodes[0].addr, NULL);
    start_node(&nodes[2], "h2", NULL, "--initial-peers", nodes[0].addr, NULL);
    start_node(&nodes[3], "att", NULL, "--listen", "127.0.0.2:0", "--initial-peers",
               nodes[0].addr, NULL);
    wait_known(nodes, N_HONEST + 1);
}

typedef struct member {
    hmc *h;
    hmc_buf *b;
    hmc_round *round;
    char *report;
} member;

/*
 * One round of the four: the honest ones with 1.0 and weight 1, the
 * attacker with 3.0 and the given weight and extra arguments (aggregate
 * etc. go to everyone). Fills m[] with the finished rounds.
 */
static void run_round_n(struct node *nodes, member *m, int n_att, int target, int min,
                        double timeout_s, int att_delay_ms, const char *prefix,
                        double att_weight, const char *all_extra, const char *att_extra)
{
    int n = N_HONEST + n_att;
    for (int i = 0; i < n; i++) {
        m[i].h = connect_to(&nodes[i]);
        cr_assert_eq(hmc_buf_alloc(m[i].h, N_ELEMS * sizeof(float), &m[i].b), 0);
        float *x = hmc_buf_data(m[i].b);
        for (size_t k = 0; k < N_ELEMS; k++)
            x[k] = i < N_HONEST ? 1.0f : 3.0f;
    }
    for (int i = 0; i < n; i++) {
        if (i == N_HONEST && att_delay_ms > 0)
            usleep((useconds_t)att_delay_ms * 1000);
        hmc_avg_opts o;
        hmc_avg_opts_init(&o);
        o.prefix = prefix;
        o.weight = i < N_HONEST ? 1.0 : att_weight;
        o.target_group_size = (unsigned)target;
        o.min_group_size = (unsigned)min;
        o.timeout_s = timeout_s;
        o.round_timeout_s = 10;
        o.matchmaking_time_s = 3;
        o.extra_json = i < N_HONEST ? all_extra : att_extra;
        cr_assert_eq(hmc_average_start(m[i].h, m[i].b, 0, N_ELEMS, &o, &m[i].round), 0,
                     "start %d: %s", i, hmc_last_error(m[i].h));
    }
    for (int i = 0; i < n; i++) {
        m[i].report = NULL;
        /* Attackers left out of every group would search until their
         * timeout: their outcome does not matter, only the honest ones'. */
        int wait_ms = i < N_HONEST ? (int)(timeout_s * 1000) + 20000 : (n_att > 1 ? 0 : 40000);
        int rc = hmc_round_wait(m[i].round, wait_ms, &m[i].report);
        if (i < N_HONEST)
            cr_assert_eq(rc, 0, "honest member %d: %d %s", i, rc, hmc_round_error(m[i].round));
        else if (rc == -EAGAIN)
            m[i].report = NULL;
    }
}

static void run_round(struct node *nodes, member *m, const char *prefix, double att_weight,
                      const char *all_extra, const char *att_extra)
{
    run_round_n(nodes, m, 1, 4, 4, 20, 0, prefix, att_weight, all_extra, att_extra);
}

static void free_round_n(member *m, int n)
{
    for (int i = 0; i < n; i++) {
        hmc_round_free(m[i].round);
        hmc_free_string(m[i].report);
        hmc_buf_free(m[i].b);
        hmc_close(m[i].h);
    }
}

static void free_round(member *m) { free_round_n(m, N_HONEST + 1); }

/* Every honest element within tol of want; returns the worst deviation. */
static double check_honest(member *m, double want, double tol)
{
    double worst = 0;
    for (int i = 0; i < N_HONEST; i++) {
        const float *x = hmc_buf_data(m[i].b);
        for (size_t k = 0; k < N_ELEMS; k++) {
            double d = fabs((double)x[k] - want);
            if (!(d <= worst))
                worst = isnan(d) ? INFINITY : d;
        }
    }
    cr_log_info("honest results: worst deviation from %.6f is %g", want, worst);
    cr_assert(worst <= tol, "an honest result is %g away from %.6f (bound %g)", worst, want, tol);
    return worst;
}

/* hivemindd_limit_refused_total{limit="kw"} of a daemon. */
static long long limit_count(struct node *n, const char *kw)
{
    hmc *h = connect_to(n);
    char *out = NULL;
    long long v = -1;
    cr_assert_eq(hmc_request(h, "metrics", NULL, &out), 0);
    json_t *j = json_loads(out, 0, NULL);
    const char *text = json_string_value(json_object_get(j, "text"));
    char pat[128];
    snprintf(pat, sizeof(pat), "hivemindd_limit_refused_total{limit=\"%s\"} ", kw);
    const char *p = text != NULL ? strstr(text, pat) : NULL;
    if (p != NULL)
        v = atoll(p + strlen(pat));
    json_decref(j);
    hmc_free_string(out);
    hmc_close(h);
    return v;
}

Test(hostile_avg, weight_1e30_is_clamped_in_the_mean)
{
    struct node nodes[N_HONEST + 1];
    member m[N_HONEST + 1];
    start_group(nodes);
    run_round(nodes, m, "hw30", 1e30, NULL, NULL);
    /* The attacker's weight counts 4 x the median (1): (3 x 1.0 + 4 x 3.0) / 7. */
    check_honest(m, 15.0 / 7.0, 1e-5);
    cr_assert_gt(limit_count(&nodes[0], "AverageWeightFactor"), 0);
    free_round(m);
}

Test(hostile_avg, weight_1_7e308_does_not_overflow_the_round)
{
    struct node nodes[N_HONEST + 1];
    member m[N_HONEST + 1];
    start_group(nodes);
    run_round(nodes, m, "hw308", 1.7e308, NULL, NULL);
    check_honest(m, 15.0 / 7.0, 1e-5);
    free_round(m);
}

Test(hostile_avg, centered_clip_holds_its_bound_against_weight_1e30)
{
    struct node nodes[N_HONEST + 1];
    member m[N_HONEST + 1];
    static const char *clip = "{\"aggregate\": \"centered_clip\", \"clip_tau\": 1}";
    start_group(nodes);
    run_round(nodes, m, "hclip", 1e30, clip, clip);
    check_honest(m, 1.0, 0.5);
    cr_assert_gt(limit_count(&nodes[1], "AverageClipWeightFactor"), 0);
    free_round(m);
}

Test(hostile_avg, bandwidth_1e12_reduces_a_bounded_share)
{
    struct node nodes[N_HONEST + 1];
    member m[N_HONEST + 1];
    start_group(nodes);
    run_round(nodes, m, "hbw", 1.0, NULL, "{\"bandwidth\": 1e12}");
    /* Honest weights and the attacker's alike: the exact mean of 1, 1, 1 and 3. */
    check_honest(m, 1.5, 1e-6);
    for (int i = 0; i < N_HONEST; i++) {
        json_t *rep = json_loads(m[i].report, 0, NULL);
        cr_assert_not_null(rep);
        const json_t *members = json_object_get(rep, "members");
        const json_t *spans = json_object_get(rep, "spans");
        size_t j;
        const json_t *mem;
        int att = -1;
        json_array_foreach(members, j, mem) {
            const char *id = json_string_value(json_object_get(mem, "peer_id"));
            if (id != NULL && strcmp(id, nodes[N_HONEST].id) == 0)
                att = (int)j;
        }
        cr_assert_geq(att, 0, "the attacker is in the group");
        long long cnt = json_integer_value(
            json_object_get(json_array_get(spans, (size_t)att), "count"));
        /* Clamped to 2 x the median bandwidth: 2 / (1 + 1 + 1 + 2) of the vector. */
        cr_log_info("the attacker reduces %lld of %d elements", cnt, N_ELEMS);
        cr_assert_leq(cnt, (long long)N_ELEMS * 2 / 5 + 1, "the attacker reduces %lld of %d",
                      cnt, N_ELEMS);
        json_decref(rep);
    }
    /* The leader (whichever member it was: the attacker's daemon, too, runs
     * hivemindd) clamped the declared bandwidth before the group began. */
    long long clamped = 0;
    for (int i = 0; i <= N_HONEST; i++)
        clamped += limit_count(&nodes[i], "AverageBandwidthFactor");
    cr_assert_gt(clamped, 0);
    free_round(m);
}

/* ---------------------------------------------------------------- state */

#define STATE_ELEMS 8192

/* Shares a state of STATE_ELEMS floats, all `fill`, at step under "run". */
static void share_state(struct node *n, uint64_t step, float fill)
{
    hmc *h = connect_to(n);
    hmc_buf *b;
    cr_assert_eq(hmc_buf_alloc(h, STATE_ELEMS * sizeof(float), &b), 0);
    float *x = hmc_buf_data(b);
    for (size_t k = 0; k < STATE_ELEMS; k++)
        x[k] = fill;
    char args[256];
    snprintf(args, sizeof(args),
             "{\"prefix\": \"run\", \"step\": %llu, \"data\": {\"shm\": %llu, \"elems\": %d}}",
             (unsigned long long)step, (unsigned long long)hmc_buf_id(b), STATE_ELEMS);
    char *out = NULL;
    cr_assert_eq(hmc_request(h, "state.share", args, &out), 0, "state.share: %s",
                 hmc_last_error(h));
    hmc_free_string(out);
    hmc_buf_free(b); /* the daemon copied the bytes */
    hmc_close(h);
}

/* Waits until the state is served and declared. */
static void wait_declared(struct node *n)
{
    hmc *h = connect_to(n);
    long deadline = hm_test_now_ms() + 15000;
    int ok = 0;
    while (!ok && hm_test_now_ms() < deadline) {
        char *out = NULL;
        if (hmc_request(h, "state.info", "{\"prefix\": \"run\"}", &out) == 0) {
            json_t *j = json_loads(out, 0, NULL);
            ok = json_is_true(json_object_get(j, "ready")) &&
                 json_integer_value(json_object_get(j, "declared")) > 0;
            json_decref(j);
        }
        hmc_free_string(out);
        if (!ok)
            usleep(100000);
    }
    hmc_close(h);
    cr_assert(ok, "the state was not declared");
}

/* state.load on n with min_agree 2; returns the report (the caller frees) and checks the bytes. */
static json_t *load_state(struct node *n, float want)
{
    hmc *h = connect_to(n);
    hmc_buf *b;
    cr_assert_eq(hmc_buf_alloc(h, STATE_ELEMS * sizeof(float), &b), 0);
    char args[256];
    snprintf(args, sizeof(args),
             "{\"prefix\": \"run\", \"min_agree\": 2, \"timeout\": 20, "
             "\"data\": {\"shm\": %llu, \"elems\": %d}}",
             (unsigned long long)hmc_buf_id(b), STATE_ELEMS);
    char *out = NULL;
    int rc = hmc_call(h, "state.load", args, 30000, &out, NULL);
    cr_assert_eq(rc, 0, "state.load: %d %s", rc, hmc_last_error(h));
    json_t *rep = json_loads(out, 0, NULL);
    hmc_free_string(out);
    const float *x = hmc_buf_data(b);
    for (size_t k = 0; k < STATE_ELEMS; k++)
        cr_assert_eq(x[k], want, "element %zu is %g, not the honest %g", k, x[k], want);
    hmc_buf_free(b);
    hmc_close(h);
    return rep;
}

static int donors_only(const json_t *rep, struct node *a, struct node *b)
{
    size_t i;
    const json_t *d;
    json_array_foreach(json_object_get(rep, "donors"), i, d) {
        const char *id = json_string_value(json_object_get(d, "peer"));
        if (id == NULL || (strcmp(id, a->id) != 0 && strcmp(id, b->id) != 0))
            return 0;
    }
    return json_array_size(json_object_get(rep, "donors")) > 0;
}

Test(hostile_avg, state_capture_by_identities_on_one_origin)
{
    struct node hon[2], att[2], newcomer;
    start_node(&hon[0], "d0", NULL, NULL);
    start_node(&hon[1], "d1", NULL, "--listen", "127.0.0.3:0", "--initial-peers", hon[0].addr,
               NULL);
    start_node(&att[0], "a0", NULL, "--listen", "127.0.0.2:0", "--initial-peers", hon[0].addr,
               NULL);
    start_node(&att[1], "a1", NULL, "--listen", "127.0.0.2:0", "--initial-peers", hon[0].addr,
               NULL);
    start_node(&newcomer, "new", NULL, "--initial-peers", hon[0].addr, NULL);
    struct node all[5] = {hon[0], hon[1], att[0], att[1], newcomer};
    wait_known(all, 5);
    share_state(&hon[0], 100, 1.0f);
    share_state(&hon[1], 100, 1.0f);
    share_state(&att[0], 999999, 3.0f);
    share_state(&att[1], 999999, 3.0f);
    for (int i = 0; i < 2; i++) {
        wait_declared(&hon[i]);
        wait_declared(&att[i]);
    }
    json_t *rep = load_state(&newcomer, 1.0f);
    cr_assert_eq(json_integer_value(json_object_get(rep, "step")), 100);
    cr_assert(donors_only(rep, &hon[0], &hon[1]), "a donor outside the honest two was used");
    json_decref(rep);
    cr_assert_gt(limit_count(&newcomer, "StateDonorsPerOrigin"), 0);
}

Test(hostile_avg, state_trusted_donors_alone_are_used)
{
    struct node hon[2], att[2], newcomer;
    start_node(&hon[0], "d0", NULL, NULL);
    start_node(&hon[1], "d1", NULL, "--listen", "127.0.0.3:0", "--initial-peers", hon[0].addr,
               NULL);
    /* Attackers on two origins: a vote by origins alone would go their way. */
    start_node(&att[0], "a0", NULL, "--listen", "127.0.0.2:0", "--initial-peers", hon[0].addr,
               NULL);
    start_node(&att[1], "a1", NULL, "--listen", "127.0.0.4:0", "--initial-peers", hon[0].addr,
               NULL);
    char trusted[160];
    snprintf(trusted, sizeof(trusted), "%s,%s", hon[0].id, hon[1].id);
    start_node(&newcomer, "new", NULL, "--initial-peers", hon[0].addr, "--state-trusted-donors",
               trusted, NULL);
    struct node all[5] = {hon[0], hon[1], att[0], att[1], newcomer};
    wait_known(all, 5);
    share_state(&hon[0], 100, 1.0f);
    share_state(&hon[1], 100, 1.0f);
    share_state(&att[0], 999999, 3.0f);
    share_state(&att[1], 999999, 3.0f);
    for (int i = 0; i < 2; i++) {
        wait_declared(&hon[i]);
        wait_declared(&att[i]);
    }
    json_t *rep = load_state(&newcomer, 1.0f);
    cr_assert_eq(json_integer_value(json_object_get(rep, "step")), 100);
    cr_assert(donors_only(rep, &hon[0], &hon[1]), "an untrusted donor was used");
    json_decref(rep);
    cr_assert_gt(limit_count(&newcomer, "StateTrustedDonors"), 0);
}

/* ---- the spoofer: datagrams under the attacker daemons' keys from other addresses ---- */

static void spoof_reply(void *ud, int status, const uint8_t *body, size_t len)
{
    (void)ud;
    (void)status;
    (void)body;
    (void)len;
}

static void spoof_tick(uv_timer_t *t) { (void)t; }

/*
 * Forks a process that, under the identity of each daemon of keys_of (read
 * from its state directory), sends the victim a datagram every 5 ms from
 * ips[i]: the victim's peer table then holds that key at ips[i]. The
 * endpoints serve no "node.ping", so the victim's pings there fail and the
 * entries stay unverified, as a forged source's would.
 */
static void spoof_start(struct node *keys_of, const char *const *ips, size_t n, struct node *victim)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid > 0) {
        cr_assert(n_children < MAX_CHILDREN);
        children[n_children++] = pid;
        return;
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent)
        _exit(127);
    hm_log_set_level(HM_LOG_ERROR);
    static uv_loop_t loop;
    static hm_rpc *rpc[4];
    static char listen[4][64];
    uint8_t vpk[HM_PK_BYTES], swarm[HM_SWARM_ID_BYTES];
    struct sockaddr_storage vsa;
    const char *at = strchr(victim->addr, '@');
    if (at == NULL || hm_base32_decode(victim->addr, (size_t)(at - victim->addr), vpk,
                                       HM_PK_BYTES) != HM_PK_BYTES ||
        hm_parse_hostport(at + 1, &vsa) != 0)
        _exit(2);
    uv_loop_init(&loop);
    hm_swarm_id("default", NULL, 0, swarm);
    for (size_t i = 0; i < n && i < 4; i++) {
        char path[600], err[256];
        hm_identity id;
        snprintf(path, sizeof(path), "%s/identity.key", keys_of[i].dir);
        if (hm_identity_load_or_create(path, &id, err, sizeof(err)) != 0)
            _exit(3);
        snprintf(listen[i], sizeof(listen[i]), "%s:0", ips[i]);
        hm_transport_config cfg = {0};
        cfg.listen = listen[i];
        if (hm_rpc_new(&loop, &id, swarm, &cfg, NULL, &rpc[i]) != 0)
            _exit(4);
    }
    uv_timer_t tick;
    uv_timer_init(&loop, &tick);
    uv_timer_start(&tick, spoof_tick, 5, 5);
    static const uint8_t empty_map = 0x80;
    for (;;) {
        for (size_t i = 0; i < n && i < 4; i++)
            hm_rpc_call(rpc[i], vpk, (const struct sockaddr *)&vsa, "node.ping", &empty_map, 1,
                        HM_RPC_DGRAM, 1000, spoof_reply, NULL, NULL);
        uint64_t end = hm_now_ms() + 5;
        while (hm_now_ms() < end)
            uv_run(&loop, UV_RUN_ONCE);
    }
}

/* Whether n's peer table shows peer id at an address on ip, unverified. */
static int peer_unverified_at(struct node *n, const char *id, const char *ip)
{
    int rc, found = 0;
    json_t *j = ctl_json(n, &rc, "peers", NULL);
    size_t i;
    const json_t *p;
    json_array_foreach(json_object_get(json_object_get(j, "result"), "peers"), i, p) {
        const char *pid = json_string_value(json_object_get(p, "peer_id"));
        const char *addr = json_string_value(json_object_get(p, "address"));
        if (pid != NULL && addr != NULL && strcmp(pid, id) == 0 &&
            strncmp(addr, ip, strlen(ip)) == 0 && addr[strlen(ip)] == ':' &&
            !json_is_true(json_object_get(p, "verified")))
            found = 1;
    }
    json_decref(j);
    return found;
}

Test(hostile_avg, state_spoofed_peer_table_addresses_do_not_vote)
{
    struct node hon[2], att[2], newcomer;
    static const char *const spoof_ips[2] = {"127.0.0.9", "127.0.0.10"};
    start_node(&hon[0], "d0", NULL, NULL);
    start_node(&hon[1], "d1", NULL, "--listen", "127.0.0.3:0", "--initial-peers", hon[0].addr,
               NULL);
    start_node(&att[0], "a0", NULL, "--listen", "127.0.0.2:0", "--initial-peers", hon[0].addr,
               NULL);
    start_node(&att[1], "a1", NULL, "--listen", "127.0.0.2:0", "--initial-peers", hon[0].addr,
               NULL);
    start_node(&newcomer, "new", NULL, "--initial-peers", hon[0].addr, NULL);
    struct node all[5] = {hon[0], hon[1], att[0], att[1], newcomer};
    wait_known(all, 5);
    share_state(&hon[0], 100, 1.0f);
    share_state(&hon[1], 100, 1.0f);
    share_state(&att[0], 999999, 3.0f);
    share_state(&att[1], 999999, 3.0f);
    for (int i = 0; i < 2; i++) {
        wait_declared(&hon[i]);
        wait_declared(&att[i]);
    }
    /* The attacker's daemons leave (their declarations stay stored in the
     * DHT until they expire); only the forged sources speak for their keys. */
    stop_node(&att[0]);
    stop_node(&att[1]);
    spoof_start(att, spoof_ips, 2, &newcomer);
    /* The newcomer's table holds both attacker keys at the spoofed addresses. */
    long deadline = hm_test_now_ms() + 15000;
    int moved = 0;
    while (!moved && hm_test_now_ms() < deadline) {
        moved = peer_unverified_at(&newcomer, att[0].id, spoof_ips[0]) &&
                peer_unverified_at(&newcomer, att[1].id, spoof_ips[1]);
        if (!moved)
            usleep(50000);
    }
    cr_assert(moved, "the spoofed datagrams did not move the attackers in the peer table");
    json_t *rep = load_state(&newcomer, 1.0f);
    cr_assert_eq(json_integer_value(json_object_get(rep, "step")), 100);
    /* The attackers' declarations were read, and gave no vote. */
    cr_assert_eq(json_integer_value(json_object_get(rep, "declared")), 4);
    cr_assert(donors_only(rep, &hon[0], &hon[1]), "a donor outside the honest two was used");
    json_decref(rep);
}

/*
 * Identities are free: three attacker daemons on one origin (127.0.0.2)
 * with weight 1e30 would hold half of a six-member group's clipped weight,
 * where CenteredClip's bound no longer holds. With AverageMembersPerOrigin
 * 1 (and loopback capped, the honest daemons on addresses of their own, as
 * hosts of their own would be), a group holds at most one of them: honest
 * results stay within 1.0 +- 0.5.
 */
Test(hostile_avg, one_origin_gets_one_member_of_a_group)
{
    enum { N_ATT = 3 };
    struct node nodes[N_HONEST + N_ATT];
    member m[N_HONEST + N_ATT];
    static const char *clip = "{\"aggregate\": \"centered_clip\", \"clip_tau\": 1}";
    static const char *const honest_ip[N_HONEST] = {"127.0.0.1:0", "127.0.0.3:0", "127.0.0.4:0"};
    char name[16];
    for (int i = 0; i < N_HONEST; i++) {
        snprintf(name, sizeof(name), "h%d", i);
        if (i == 0)
            start_node(&nodes[i], name, NULL, "--listen", honest_ip[i], "--average-cap-loopback",
                       NULL);
        else
            start_node(&nodes[i], name, NULL, "--listen", honest_ip[i], "--average-cap-loopback",
                       "--initial-peers", nodes[0].addr, NULL);
    }
    for (int i = 0; i < N_ATT; i++) {
        snprintf(name, sizeof(name), "att%d", i);
        /* The attacker's own daemons admit their kin. */
        start_node(&nodes[N_HONEST + i], name, NULL, "--listen", "127.0.0.2:0",
                   "--average-members-per-origin", "0", "--initial-peers", nodes[0].addr, NULL);
    }
    wait_known(nodes, N_HONEST + N_ATT);
    /* The attackers ask to join the honest daemons' groups: they start a
     * second later, so an honest daemon leads. (An attacker daemon that leads
     * seats its kin, and the honest followers refuse that group when it
     * begins and look again, which can take several matchmaking periods:
     * the search may take long.) */
    run_round_n(nodes, m, N_ATT, N_HONEST + N_ATT, N_HONEST, 60, 1000, "horg", 1e30, clip, clip);
    check_honest(m, 1.0, 0.5);
    for (int i = 0; i < N_HONEST; i++) {
        json_t *rep = json_loads(m[i].report, 0, NULL);
        cr_assert_not_null(rep);
        const json_t *members = json_object_get(rep, "members");
        size_t j, from_att = 0;
        const json_t *mem;
        json_array_foreach(members, j, mem) {
            const char *id = json_string_value(json_object_get(mem, "peer_id"));
            for (int a = 0; a < N_ATT; a++)
                if (id != NULL && strcmp(id, nodes[N_HONEST + a].id) == 0)
                    from_att++;
        }
        cr_assert_leq(from_att, 1, "honest member %d's group held %zu members of 127.0.0.2", i,
                      from_att);
        json_decref(rep);
    }
    long long refused = 0;
    for (int i = 0; i < N_HONEST; i++)
        refused += limit_count(&nodes[i], "AverageMembersPerOrigin");
    cr_assert_gt(refused, 0, "the honest daemons refused the origin's extra members");
    free_round_n(m, N_HONEST + N_ATT);
}

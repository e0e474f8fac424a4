/*
 * test_hostile_moe: attack cases 5 and 10 of docs/security.md against real
 * hivemindd processes. The honest host and trainers run on 127.0.0.1; the
 * attacker runs in a child process of this test, from 127.0.0.2 (another
 * origin), with hivemindd's own libraries and fresh identities.
 *
 *  - queue flood (case 5): four attacker identities keep ffn.1 (dim 512)
 *    busy with forward requests of batch 4096, four in flight each, far
 *    more than its queue holds. Honest 8x512 calls from a trainer daemon,
 *    made while the flood runs, must return within their 10 s timeout;
 *    the flood must be real (the attacker got answers and was refused).
 *  - takeover (case 10): two attacker nodes sign ffn.1 (and its grid
 *    prefix entry) under their own keys, one for a day and one for two
 *    minutes refreshed every few seconds, and answer moe.fwd with their
 *    own output. A trainer that has used ffn.1 keeps calling the honest
 *    host and gets the honest output; a trainer started during the attack
 *    with an ExpertHostsFile naming the host does too; after the attacker
 *    leaves, calls keep working.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>

#include "dht/record.h"
#include "lib/hivemind.h"
#include "moe/proto.h"
#include "tests/hostile.h"
#include "tests/loop.h"
#include "tests/proc.h"

static void setup(void) { hm_proc_setup("hmoe"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(hostile_moe, .init = setup, .fini = teardown, .timeout = 120);

static hmc *attach(struct node *n)
{
    hmc *h = NULL;
    char err[256] = "";
    int r = hmc_connect(n->sock, &h, err, sizeof(err));
    cr_assert_eq(r, 0, "hmc_connect %s: %s", n->sock, err);
    hmc_set_timeout(h, 30000);
    return h;
}

static void fill(float *x, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        x[i] = (float)((seed >> 8) & 0xffff) / 65536.0f - 0.5f;
    }
}

/* Beam search over the one-dimensional grid ffn.[0:2] for ffn.1 (scores
 * prefer it), until it is found; returns its peer (PEERID@HOST:PORT). */
static void find_ffn1(hmc *h, hmc_expert *out, int timeout_ms)
{
    double scores[2] = {0.0, 1.0};
    size_t sizes[1] = {2}, n = 0;
    long deadline = hm_test_now_ms() + timeout_ms;
    do {
        n = 0;
        int r = hmc_experts_find(h, "ffn", scores, sizes, 1, 1, 5.0, out, 1, &n, NULL);
        if (r == 0 && n == 1 && strcmp(out->uid, "ffn.1") == 0)
            return;
        usleep(200000);
    } while (hm_test_now_ms() < deadline);
    cr_assert_fail("ffn.1 was not found (%zu results)", n);
}

static int peer_is(const hmc_expert *e, const struct node *n)
{
    return strncmp(e->peer, n->id, strlen(n->id)) == 0 && e->peer[strlen(n->id)] == '@';
}

/* The child's end: runs body, then exits without running the parent's
 * teardown (atexit handlers, Criterion's reporting). */
static pid_t fork_attacker(void (*body)(const char *arg, const char *dir), const char *arg,
                           const char *dir)
{
    fflush(NULL);
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0) {
        body(arg, dir);
        _exit(0);
    }
    children[n_children++] = pid;
    return pid;
}

static char *read_small(const char *path)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return NULL;
    char *b = calloc(1, 4096);
    if (b != NULL)
        fread(b, 1, 4095, f);
    fclose(f);
    return b;
}

/* Writes text to path atomically (the parent polls for it). */
static void write_file(const char *dir, const char *name, const char *text)
{
    char tmp[512], path[512];
    snprintf(tmp, sizeof(tmp), "%s/%s.tmp", dir, name);
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(tmp, "w");
    if (f == NULL)
        _exit(3);
    fputs(text, f);
    fclose(f);
    rename(tmp, path);
}

static char *wait_file(const char *dir, const char *name, int timeout_ms)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    long deadline = hm_test_now_ms() + timeout_ms;
    do {
        char *t = read_small(path);
        if (t != NULL)
            return t;
        usleep(50000);
    } while (hm_test_now_ms() < deadline);
    return NULL;
}

/* ---------------------------------------------------------- queue flood */

#define FLOOD_IDS 4
#define FLOOD_INFLIGHT 4
#define FLOOD_BATCH 4096
#define FLOOD_DIM 512
#define FLOOD_MAX_MS 40000

typedef struct flood_ep {
    hm_rpc *rpc;
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage sa;
} flood_ep;

typedef struct flood {
    flood_ep ep[FLOOD_IDS];
    uint8_t *body;
    size_t len;
    uint64_t ok, busy, other, sent;
    int stop;
} flood;

typedef struct flood_slot {
    flood *fl;
    flood_ep *ep;
} flood_slot;

static void flood_send(flood_slot *s);

static void on_flood(void *ud, int status, const uint8_t *body, size_t len)
{
    flood_slot *s = ud;
    (void)body;
    (void)len;
    if (status == 0)
        s->fl->ok++;
    else if (status == -ENOBUFS)
        s->fl->busy++;
    else
        s->fl->other++;
    if (!s->fl->stop)
        flood_send(s);
}

static void flood_send(flood_slot *s)
{
    if (hm_rpc_call(s->ep->rpc, s->ep->pk, (const struct sockaddr *)&s->ep->sa, HM_MOE_METHOD_FWD,
                    s->fl->body, s->fl->len, HM_RPC_STREAM, 60000, on_flood, s, NULL) == 0)
        s->fl->sent++;
}

static void flood_body(const char *host_addr, const char *dir)
{
    uv_loop_t loop;
    static flood fl;
    static flood_slot slots[FLOOD_IDS * FLOOD_INFLIGHT];
    uv_loop_init(&loop);
    hm_log_set_level(HM_LOG_ERROR);
    float *x = malloc(sizeof(float) * FLOOD_BATCH * FLOOD_DIM);
    fill(x, (size_t)FLOOD_BATCH * FLOOD_DIM, 99);
    hm_wire_wr w;
    hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
    hm_moe_encode_fwd(&w, "ffn.1", x, FLOOD_BATCH, FLOOD_DIM);
    fl.body = hm_wire_wr_steal(&w, &fl.len);
    if (fl.body == NULL)
        _exit(2);
    for (int i = 0; i < FLOOD_IDS; i++) {
        fl.ep[i].rpc = hm_hostile_rpc(&loop, "127.0.0.2", NULL, NULL);
        hm_hostile_parse_peer(host_addr, fl.ep[i].pk, &fl.ep[i].sa);
    }
    write_file(dir, "flood.started", "1\n");
    for (int i = 0; i < FLOOD_IDS * FLOOD_INFLIGHT; i++) {
        slots[i].fl = &fl;
        slots[i].ep = &fl.ep[i % FLOOD_IDS];
        flood_send(&slots[i]);
    }
    /* Until the test has made its honest calls (or a bound, should it die). */
    char stop[512];
    snprintf(stop, sizeof(stop), "%s/flood.stop", dir);
    uint64_t end = hm_now_ms() + FLOOD_MAX_MS;
    while (access(stop, F_OK) != 0 && hm_now_ms() < end)
        hm_hostile_run_for(&loop, 100);
    fl.stop = 1;
    char out[256];
    snprintf(out, sizeof(out), "%llu %llu %llu %llu\n", (unsigned long long)fl.sent,
             (unsigned long long)fl.ok, (unsigned long long)fl.busy,
             (unsigned long long)fl.other);
    write_file(dir, "flood.result", out);
    _exit(0);
}

Test(hostile_moe, queue_flood_from_one_origin_leaves_honest_calls_served)
{
    struct node host, tr;
    start_node(&host, "host", NULL, "--host-experts", "ffn.[0:2]", "--expert-dim", "512", NULL);
    start_node(&tr, "trainer", NULL, "--initial-peers", host.addr, NULL);
    hmc *h = attach(&tr);
    hmc_expert ex;
    find_ffn1(h, &ex, 20000);
    cr_assert(peer_is(&ex, &host));

    enum { B = 8, D = FLOOD_DIM };
    hmc_buf *xb, *yb;
    cr_assert_eq(hmc_buf_alloc(h, B * D * sizeof(float), &xb), 0, "%s", hmc_last_error(h));
    cr_assert_eq(hmc_buf_alloc(h, B * D * sizeof(float), &yb), 0, "%s", hmc_last_error(h));
    fill(hmc_buf_data(xb), B * D, 5);
    int answered[1];
    size_t n_ans = 0;
    long t0 = hm_test_now_ms();
    cr_assert_eq(hmc_experts_forward(h, &ex, 1, xb, 0, yb, 0, B, D, 1, 10.0, 10.0, answered,
                                     &n_ans),
                 0, "forward before the flood: %s", hmc_last_error(h));
    long before_ms = hm_test_now_ms() - t0;

    fork_attacker(flood_body, host.addr, tmpdir);
    char *st = wait_file(tmpdir, "flood.started", 10000);
    cr_assert_not_null(st, "the attacker did not start");
    free(st);
    /* Let the flood fill the queue first. */
    usleep(2500000);
    long worst = 0;
    for (int i = 0; i < 3; i++) {
        n_ans = 0;
        t0 = hm_test_now_ms();
        int r = hmc_experts_forward(h, &ex, 1, xb, 0, yb, 0, B, D, 1, 10.0, 10.0, answered,
                                    &n_ans);
        long ms = hm_test_now_ms() - t0;
        cr_assert_eq(r, 0, "honest call %d during the flood failed after %ld ms: %s", i, ms,
                     hmc_last_error(h));
        cr_assert_eq(n_ans, 1);
        cr_assert_lt(ms, 10000, "honest call %d took %ld ms", i, ms);
        worst = ms > worst ? ms : worst;
        usleep(300000);
    }
    /* Still flooding when the last honest call returned. */
    char stop[512];
    snprintf(stop, sizeof(stop), "%s/flood.stop", tmpdir);
    FILE *sf = fopen(stop, "w");
    cr_assert_not_null(sf);
    fclose(sf);
    char *res = wait_file(tmpdir, "flood.result", 30000);
    cr_assert_not_null(res, "the attacker did not finish");
    unsigned long long sent, ok, busy, other;
    cr_assert_eq(sscanf(res, "%llu %llu %llu %llu", &sent, &ok, &busy, &other), 4, "%s", res);
    free(res);
    fprintf(stderr,
            "queue flood: honest 8x512 call %ld ms before, worst %ld ms during; attacker sent "
            "%llu, answered %llu, refused busy %llu, other %llu\n",
            before_ms, worst, sent, ok, busy, other);
    /* The flood was real: it kept the expert computing and its queue full. */
    cr_assert_geq(ok, 1, "the attacker got %llu answers", ok);
    cr_assert_geq(busy, 4, "the attacker was refused %llu times: the queue never filled", busy);

    char *out, *err;
    cr_assert_eq(ctl(host.sock, "metrics", 0, &out, &err), 0, "metrics: %s", err);
    const char *m = strstr(out, "hivemindd_limit_refused_total{limit=\"ExpertMaxQueued\"} ");
    cr_assert_not_null(m, "%s", out);
    unsigned long long refused = 0;
    cr_assert_eq(sscanf(strchr(m, '}') + 2, "%llu", &refused), 1);
    cr_assert_geq(refused, busy, "the metric counts %llu, the attacker saw %llu refusals", refused,
                  busy);
    free(out);
    free(err);
    hmc_buf_free(xb);
    hmc_buf_free(yb);
    hmc_close(h);
}

/* ---------------------------------------------------------- takeover */

/* The attacker's expert: any input gives 42s. */
static void on_evil_fwd(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                        const struct sockaddr *from, const uint8_t *body, size_t len)
{
    hm_moe_req mr;
    (void)ud;
    (void)peer_pk;
    (void)from;
    if (hm_moe_decode_req(body, len, 0, &mr) != 0) {
        hm_rpc_respond(req, -EINVAL, NULL, 0);
        return;
    }
    size_t n = mr.batch * mr.dim;
    float *y = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        y[i] = 42.0f;
    hm_wire_wr w;
    hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
    hm_moe_encode_out(&w, 0, y, mr.batch, mr.dim);
    size_t ol = 0;
    uint8_t *o = hm_wire_wr_steal(&w, &ol);
    hm_rpc_respond(req, 0, o, ol);
    free(o);
    free(y);
}

typedef struct evil {
    hm_node *node;
    int puts_out, puts_ok;
} evil;

static void on_evil_put(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    evil *e = ud;
    (void)stored;
    (void)info;
    e->puts_out--;
    e->puts_ok += status == 0;
}

/* Declares ffn.1 and its prefix entry under e's own key, for ttl_s. */
static void evil_declare(evil *e, double ttl_s)
{
    char marker[HM_DHT_OWNER_MARKER_LEN + 1], a[256], sk[HM_DHT_SUBKEY_MAX];
    uint8_t v[256];
    hm_dht_owner_marker(hm_node_identity(e->node)->pk, marker);
    hm_node_address(e->node, a, sizeof(a));
    const char *hp = strchr(a, '@') + 1;
    int vl = hm_moe_encode_expert_value(v, sizeof(v), hp, "ffn", 16);
    if (vl > 0 && hm_node_dht_put(e->node, (const uint8_t *)"ffn.1", 5, (const uint8_t *)marker,
                                  strlen(marker), 1, v, (size_t)vl, ttl_s, 3000, on_evil_put,
                                  e) == 0)
        e->puts_out++;
    int skl = snprintf(sk, sizeof(sk), "1%s", marker);
    vl = hm_moe_encode_prefix_value(v, sizeof(v), "ffn.1", hp);
    if (vl > 0 && hm_node_dht_put(e->node, (const uint8_t *)"ffn.", 4, (const uint8_t *)sk,
                                  (size_t)skl, 1, v, (size_t)vl, ttl_s, 3000, on_evil_put,
                                  e) == 0)
        e->puts_out++;
}

static void takeover_body(const char *host_addr, const char *dir)
{
    uv_loop_t loop;
    static evil day, fresh;
    char ids[256];
    uv_loop_init(&loop);
    hm_log_set_level(HM_LOG_ERROR);
    day.node = hm_hostile_node(&loop, "127.0.0.2", host_addr);
    fresh.node = hm_hostile_node(&loop, "127.0.0.2", host_addr);
    hm_rpc_register(hm_node_rpc(day.node), HM_MOE_METHOD_FWD, on_evil_fwd, NULL);
    hm_rpc_register(hm_node_rpc(fresh.node), HM_MOE_METHOD_FWD, on_evil_fwd, NULL);
    hm_hostile_run_for(&loop, 1500); /* find the swarm */
    int announced = 0;
    for (;;) {
        /* A day-long declaration once; a two-minute one refreshed every 2 s,
         * always fresher than the host's 60 s declarations. */
        if (!announced)
            evil_declare(&day, 86000);
        evil_declare(&fresh, 120);
        hm_hostile_run_for(&loop, 2000);
        if (!announced && day.puts_ok >= 2 && fresh.puts_ok >= 2) {
            char ida[HM_PEER_ID_LEN + 1], idb[HM_PEER_ID_LEN + 1];
            hm_peer_id_encode(hm_node_identity(day.node)->pk, ida);
            hm_peer_id_encode(hm_node_identity(fresh.node)->pk, idb);
            snprintf(ids, sizeof(ids), "%s %s\n", ida, idb);
            write_file(dir, "evil.ids", ids);
            announced = 1;
        }
    }
}

/* Whether `dht get KEY` from n lists every one of the ids. */
static int dht_lists(struct node *n, const char *key, const char *id1, const char *id2)
{
    char *argv[] = {bin_ctl, "-s", n->sock, "--json", "dht", "get", (char *)key, NULL};
    char *out, *err;
    int rc = run_prog(bin_ctl, argv, &out, &err);
    int found = rc == 0 && strstr(out, id1) != NULL && strstr(out, id2) != NULL;
    free(out);
    free(err);
    return found;
}

static void forward16(hmc *h, const hmc_expert *ex, float *y_out)
{
    enum { B = 4, D = 16 };
    hmc_buf *xb, *yb;
    cr_assert_eq(hmc_buf_alloc(h, B * D * sizeof(float), &xb), 0, "%s", hmc_last_error(h));
    cr_assert_eq(hmc_buf_alloc(h, B * D * sizeof(float), &yb), 0, "%s", hmc_last_error(h));
    fill(hmc_buf_data(xb), B * D, 17);
    int answered[1];
    size_t n_ans = 0;
    cr_assert_eq(hmc_experts_forward(h, ex, 1, xb, 0, yb, 0, B, D, 1, 10.0, 10.0, answered,
                                     &n_ans),
                 0, "forward: %s", hmc_last_error(h));
    cr_assert_eq(n_ans, 1);
    memcpy(y_out, hmc_buf_data(yb), B * D * sizeof(float));
    hmc_buf_free(xb);
    hmc_buf_free(yb);
}

Test(hostile_moe, takeover_of_a_held_uid_fails)
{
    struct node host, tr, listed;
    float y0[64], y[64];
    start_node(&host, "host", NULL, "--host-experts", "ffn.[0:2]", "--expert-dim", "16", NULL);
    start_node(&tr, "trainer", NULL, "--initial-peers", host.addr, NULL);
    hmc *h = attach(&tr);
    hmc_expert ex;
    find_ffn1(h, &ex, 20000);
    cr_assert(peer_is(&ex, &host));
    forward16(h, &ex, y0);

    pid_t att = fork_attacker(takeover_body, host.addr, tmpdir);
    char *ids = wait_file(tmpdir, "evil.ids", 20000);
    cr_assert_not_null(ids, "the attacker's declarations were not stored");
    char id1[HM_PEER_ID_LEN + 1], id2[HM_PEER_ID_LEN + 1];
    cr_assert_eq(sscanf(ids, "%52s %52s", id1, id2), 2);
    free(ids);
    /* The attack is real: the trainer's DHT holds both forged declarations. */
    long deadline = hm_test_now_ms() + 10000;
    while (!dht_lists(&tr, "ffn.1", id1, id2) && hm_test_now_ms() < deadline)
        usleep(200000);
    cr_assert(dht_lists(&tr, "ffn.1", id1, id2), "the forged declarations are not in the DHT");

    /* The trainer that used ffn.1 keeps the honest host and output. */
    for (int i = 0; i < 3; i++) {
        find_ffn1(h, &ex, 10000);
        cr_assert(peer_is(&ex, &host), "ffn.1 was taken over: %s", ex.peer);
        forward16(h, &ex, y);
        cr_assert_eq(memcmp(y, y0, sizeof(y)), 0, "the output is not the honest one");
        usleep(300000);
    }

    /* A trainer started now, with the grid's host listed, takes it too. */
    char path[256], line[256];
    snprintf(path, sizeof(path), "%s/expert-hosts", tmpdir);
    snprintf(line, sizeof(line), "# the hosts of grid ffn\nffn. %s\n", host.id);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(line, f);
    fclose(f);
    start_node(&listed, "listed", NULL, "--initial-peers", host.addr, "--expert-hosts-file", path,
               NULL);
    hmc *h2 = attach(&listed);
    hmc_expert ex2;
    find_ffn1(h2, &ex2, 20000);
    cr_assert(peer_is(&ex2, &host), "the allow-listed trainer took %s", ex2.peer);
    forward16(h2, &ex2, y);
    cr_assert_eq(memcmp(y, y0, sizeof(y)), 0);

    char *out, *err;
    cr_assert_eq(ctl(tr.sock, "metrics", 0, &out, &err), 0, "metrics: %s", err);
    cr_assert(strstr(out, "limit=\"ExpertOneHolder\"} 0") == NULL, "%s", out);
    cr_assert(strstr(out, "limit=\"ExpertRecordMaxTtl\"} 0") == NULL, "%s", out);
    free(out);
    free(err);

    /* The attacker leaves: its day-long record stays in the DHT, and ffn.1
     * still works for both trainers. */
    kill(att, SIGKILL);
    waitpid(att, NULL, 0);
    forget_child(att);
    find_ffn1(h, &ex, 10000);
    cr_assert(peer_is(&ex, &host));
    forward16(h, &ex, y);
    cr_assert_eq(memcmp(y, y0, sizeof(y)), 0);
    find_ffn1(h2, &ex2, 10000);
    cr_assert(peer_is(&ex2, &host));
    hmc_close(h2);
    hmc_close(h);
}

/* ---------------------------------------------------------- first look */
/* -- held since test -- */

/* held_s of the owner's declaration of key, as n's `dht get` reads it; -2 if absent. */
static long held_of(struct node *n, const char *key, const char *owner_id)
{
    int rc;
    long held = -2;
    json_t *j = ctl_json(n, &rc, "dht", "get", key, NULL);
    json_t *vals = json_object_get(json_object_get(j, "result"), "values");
    size_t i;
    json_t *v;
    json_array_foreach(vals, i, v) {
        const char *sk = json_string_value(json_object_get(v, "subkey"));
        if (sk != NULL && strstr(sk, owner_id) != NULL) {
            json_t *h = json_object_get(v, "held_s");
            held = json_is_integer(h) ? (long)json_integer_value(h) : -1;
        }
    }
    json_decref(j);
    return held;
}

/*
 * A trainer that never used ffn.1 looks it up for the first time while an
 * attacker's declaration, fresher than the host's and refreshed every 2 s,
 * is live. The DHT's replicas on 127.0.0.1, .3 and .4 (and the attacker's
 * own two nodes on .2) remember since when they hold each owner's
 * declaration; the newcomer on 127.0.0.5 takes the owner they have held
 * longest: the honest host, and its exact output. Before the replicas kept
 * these times, a first look took the freshest declaration: the attacker's.
 */
Test(hostile_moe, a_first_look_takes_the_longest_holder)
{
    struct node s1, s2, host, ref, fresh;
    float y0[64], y[64];
    start_node(&s1, "s1", NULL, "--listen", "127.0.0.3:0", NULL);
    start_node(&s2, "s2", NULL, "--listen", "127.0.0.4:0", "--initial-peers", s1.addr, NULL);
    start_node(&host, "host", NULL, "--host-experts", "ffn.[0:2]", "--expert-dim", "16",
               "--initial-peers", s1.addr, NULL);
    /* The honest output, read through another daemon before the attack. */
    start_node(&ref, "ref", NULL, "--initial-peers", s2.addr, NULL);
    hmc *h = attach(&ref);
    hmc_expert ex;
    find_ffn1(h, &ex, 30000);
    cr_assert(peer_is(&ex, &host));
    forward16(h, &ex, y0);
    hmc_close(h);
    /* The host holds the name a while before anyone else declares it. */
    long deadline = hm_test_now_ms() + 20000;
    while (held_of(&s2, "ffn.1", host.id) < 4 && hm_test_now_ms() < deadline)
        usleep(500000);
    cr_assert_geq(held_of(&s2, "ffn.1", host.id), 4, "the replicas never held the host's "
                  "declaration for 4 s");

    fork_attacker(takeover_body, s1.addr, tmpdir);
    char *ids = wait_file(tmpdir, "evil.ids", 20000);
    cr_assert_not_null(ids, "the attacker's declarations were not stored");
    char id1[HM_PEER_ID_LEN + 1], id2[HM_PEER_ID_LEN + 1];
    cr_assert_eq(sscanf(ids, "%52s %52s", id1, id2), 2);
    free(ids);
    deadline = hm_test_now_ms() + 10000;
    while (!dht_lists(&s2, "ffn.1", id1, id2) && hm_test_now_ms() < deadline)
        usleep(200000);
    cr_assert(dht_lists(&s2, "ffn.1", id1, id2), "the forged declarations are not in the DHT");
    usleep(2500000); /* a few refreshes of the attacker's fresher declaration */

    /* A trainer that never used ffn.1, on an origin of its own. */
    start_node(&fresh, "fresh", NULL, "--listen", "127.0.0.5:0", "--initial-peers", s1.addr,
               NULL);
    long hh = held_of(&fresh, "ffn.1", host.id), ha = held_of(&fresh, "ffn.1", id2);
    fprintf(stderr, "first look: the replicas held the host's ffn.1 for %ld s, the "
            "attacker's for %ld s\n", hh, ha);
    cr_assert_gt(hh, ha, "the host's declaration is not the longer held (%ld s, %ld s)", hh,
                 ha);
    h = attach(&fresh);
    for (int i = 0; i < 3; i++) {
        find_ffn1(h, &ex, 10000);
        cr_assert(peer_is(&ex, &host), "a first look took ffn.1 from %s", ex.peer);
        forward16(h, &ex, y);
        cr_assert_eq(memcmp(y, y0, sizeof(y)), 0, "the output is not the honest host's");
        usleep(300000);
    }
    char *out, *err;
    cr_assert_eq(ctl(fresh.sock, "metrics", 0, &out, &err), 0, "metrics: %s", err);
    cr_assert(strstr(out, "limit=\"ExpertOneHolder\"} 0") == NULL, "%s", out);
    free(out);
    free(err);
    hmc_close(h);
}

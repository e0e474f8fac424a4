/*
 * test_hostile_dht: attack cases 4 and 6 of docs/security.md against real
 * hivemindd processes, the honest ones on 127.0.0.1 and the attacker, in
 * a child of the test process, on 127.0.0.2 and 127.0.0.3 (two origins)
 * under many fresh identities, each its own rpc endpoint (so each stays
 * under the per-address request rate).
 *
 *   storage: the attacker fills three daemons' stores with 8-byte keys at
 *     the largest TTL, and goes on; while it does, honest `hivemindctl dht
 *     put` and `dht get` succeed, because a full store evicts from the
 *     heaviest origin.
 *   peer table: the attacker's identities all answer pings and fill the
 *     victim's peer table; while they do, the honest peers known before
 *     stay in it, a newcomer from 127.0.0.1 still gets a place, and five
 *     honest stream probes (a fresh identity each, a new connection each)
 *     are answered within 1 s, because the victim pings only a bounded
 *     number of peers over streams.
 *
 * The victims run with small tables (--dht-store-entries,
 * --peer-table-size, --max-connections) so that the attack is fast; the
 * defences are the same at the defaults.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <signal.h>
#include <sodium.h>
#include <string.h>
#include <sys/prctl.h>

#include "dht/proto.h"
#include "tests/hostile.h"
#include "tests/proc.h"

static void setup(void) { hm_proc_setup("hostiledht"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(hostile_dht, .init = setup, .fini = teardown, .timeout = 120);

static const char *const attack_ips[2] = {"127.0.0.2", "127.0.0.3"};

/* ---- hivemindctl ---- */

static long dht_info(struct node *n, const char *field)
{
    int rc;
    json_t *j = ctl_json(n, &rc, "dht", "info", NULL);
    long v = -1;
    json_t *res = json_object_get(j, "result");
    if (strcmp(field, "rt") == 0)
        v = (long)json_integer_value(json_object_get(json_object_get(res, "routing_table"), "size"));
    else
        v = (long)json_integer_value(json_object_get(res, field));
    json_decref(j);
    return v;
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

#define MAX_IDS 512

typedef struct atk_id {
    struct attacker *a;
    hm_rpc *rpc;
    uint8_t token[4][HM_DHT_TOKEN_MAX];
    size_t token_len[4];
} atk_id;

typedef struct attacker {
    uv_loop_t loop;
    uv_timer_t tick;
    atk_id ids[MAX_IDS];
    size_t n_ids;
    size_t n_victims;
    uint8_t vpk[4][HM_PK_BYTES];
    struct sockaddr_storage vsa[4];
    int store_flood;  /* STORE 8-byte keys with the largest TTL */
    uint64_t next_tid, ticks;
    hm_dht_msg msg;
} attacker;

static void atk_on_dgram(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                         const uint8_t *body, size_t len)
{
    atk_id *id = ud;
    attacker *a = id->a;
    HM_UNUSED(from);
    for (size_t v = 0; v < a->n_victims; v++) {
        if (memcmp(pk, a->vpk[v], HM_PK_BYTES) != 0)
            continue;
        if (hm_dht_msg_decode(body, len, &a->msg) == 0 && a->msg.type == HM_DHT_MSG_PONG &&
            a->msg.token != NULL && a->msg.token_len <= HM_DHT_TOKEN_MAX) {
            memcpy(id->token[v], a->msg.token, a->msg.token_len);
            id->token_len[v] = a->msg.token_len;
        }
    }
}

/* The attacker answers the victim's pings, so its identities look as alive
 * (and as verified) as honest peers. */
static void atk_on_ping(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                        const struct sockaddr *from, const uint8_t *body, size_t len)
{
    HM_UNUSED(ud);
    HM_UNUSED(peer_pk);
    HM_UNUSED(from);
    HM_UNUSED(body);
    HM_UNUSED(len);
    static const uint8_t empty_map = 0x80;
    hm_rpc_respond(req, 0, &empty_map, 1);
}

static void atk_send(attacker *a, atk_id *id, size_t v, int type)
{
    hm_dht_msg *m = &a->msg;
    uint8_t buf[HM_DHT_PROTO_MAX_SIZE], key[8], val[8] = "flood!!";
    size_t len;

    memset(m, 0, offsetof(hm_dht_msg, records));
    m->type = type;
    m->tid = (uint32_t)++a->next_tid;
    m->flags = HM_DHT_FLAG_CLIENT;
    m->token = id->token_len[v] > 0 ? id->token[v] : NULL;
    m->token_len = id->token_len[v];
    if (type == HM_DHT_MSG_STORE) {
        randombytes_buf(key, sizeof(key));
        m->record.key = key;
        m->record.key_len = sizeof(key);
        m->record.value = val;
        m->record.value_len = sizeof(val);
        m->record.expiration = (double)hm_wall_us() / 1e6 + 86400.0;
    }
    if (hm_dht_msg_encode(m, id->token_len[v] > 0 ? 0 : 96, buf, sizeof(buf), &len) == 0)
        hm_rpc_send_oneway(id->rpc, a->vpk[v], (const struct sockaddr *)&a->vsa[v],
                           HM_RPC_CHANNEL_DHT, buf, len);
}

/* Every 20 ms: each identity without a token asks every victim for one (a
 * PING, every 0.5 s); in the storage flood each identity with a token
 * STOREs one fresh key to each victim (50/s per identity and victim, under
 * the 200/s each address may send). In the peer-table flood every identity
 * PINGs the victim once a second, which keeps it in the table. */
static void atk_tick(uv_timer_t *t)
{
    attacker *a = t->data;
    a->ticks++;
    for (size_t i = 0; i < a->n_ids; i++) {
        atk_id *id = &a->ids[i];
        for (size_t v = 0; v < a->n_victims; v++) {
            if (id->token_len[v] == 0 || !a->store_flood) {
                if ((a->ticks + i) % (a->store_flood ? 25 : 50) == 0)
                    atk_send(a, id, v, HM_DHT_MSG_PING);
            } else {
                atk_send(a, id, v, HM_DHT_MSG_STORE);
            }
        }
    }
}

/* Forks the attacker: n_ids identities split over the two attack origins.
 * It runs until the test kills it (at teardown at the latest). */
static pid_t attacker_start(struct node *victims, size_t n_victims, size_t n_ids, int store_flood)
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
    static attacker a;
    uv_loop_init(&a.loop);
    a.n_victims = n_victims;
    a.store_flood = store_flood;
    for (size_t v = 0; v < n_victims; v++)
        hm_hostile_parse_peer(victims[v].addr, a.vpk[v], &a.vsa[v]);
    hm_transport_config tc = {.dgram_peers = 16};
    for (size_t i = 0; i < n_ids && i < MAX_IDS; i++) {
        atk_id *id = &a.ids[a.n_ids++];
        id->a = &a;
        id->rpc = hm_hostile_rpc(&a.loop, attack_ips[i % 2], NULL, &tc);
        hm_rpc_register_oneway(id->rpc, HM_RPC_CHANNEL_DHT, atk_on_dgram, id);
        hm_rpc_register(id->rpc, "node.ping", atk_on_ping, id);
    }
    uv_timer_init(&a.loop, &a.tick);
    a.tick.data = &a;
    uv_timer_start(&a.tick, atk_tick, 20, 20);
    uv_run(&a.loop, UV_RUN_DEFAULT);
    _exit(0);
}

/* ---- case 4: DHT storage ---- */

#define STORE_ENTRIES "1000"

static int honest_put(struct node *n, const char *key, const char *value, long *stored)
{
    int rc;
    json_t *j = ctl_json(n, &rc, "dht", "put", key, value, "--ttl", "600", NULL);
    *stored = rc == 0 ? (long)json_integer_value(json_object_get(json_object_get(j, "result"),
                                                                 "stored"))
                      : -1;
    json_decref(j);
    return rc;
}

static char *honest_get(struct node *n, const char *key)
{
    int rc;
    json_t *j = ctl_json(n, &rc, "dht", "get", key, NULL);
    char *v = NULL;
    const json_t *values = json_object_get(json_object_get(j, "result"), "values");
    if (rc == 0 && json_array_size(values) > 0) {
        const char *s = json_string_value(json_object_get(json_array_get(values, 0), "value"));
        if (s != NULL)
            v = strdup(s);
    }
    json_decref(j);
    return v;
}

Test(hostile_dht, storage_flood_from_two_origins_leaves_room_for_honest_puts)
{
    struct node v[3];
    /* Half the store per origin, so that the two attack origins fill it
     * exactly: the honest puts then need the eviction, not only the share. */
    start_node(&v[0], "v0", NULL, "--dht-store-entries", STORE_ENTRIES,
               "--dht-store-origin-share", "50", NULL);
    for (int i = 1; i < 3; i++) {
        char name[8];
        snprintf(name, sizeof(name), "v%d", i);
        start_node(&v[i], name, NULL, "--dht-store-entries", STORE_ENTRIES,
                   "--dht-store-origin-share", "50", "--initial-peers", v[0].addr, NULL);
    }
    long deadline = hm_test_now_ms() + 20000;
    while (hm_test_now_ms() < deadline &&
           (dht_info(&v[0], "rt") < 2 || dht_info(&v[1], "rt") < 2 || dht_info(&v[2], "rt") < 2))
        usleep(200000);
    cr_assert(dht_info(&v[0], "rt") >= 2 && dht_info(&v[1], "rt") >= 2 &&
              dht_info(&v[2], "rt") >= 2, "the honest nodes did not find each other");
    long rss0[3];
    for (int i = 0; i < 3; i++)
        rss0[i] = hm_hostile_rss_kib(v[i].pid);

    /* 32 identities, 16 on each attack origin. */
    attacker_start(v, 3, 32, 1);

    /* The flood fills all three stores. */
    deadline = hm_test_now_ms() + 40000;
    long rec[3] = {0};
    while (hm_test_now_ms() < deadline) {
        for (int i = 0; i < 3; i++)
            rec[i] = dht_info(&v[i], "records");
        if (rec[0] >= 1000 && rec[1] >= 1000 && rec[2] >= 1000)
            break;
        usleep(300000);
    }
    cr_assert(rec[0] >= 1000 && rec[1] >= 1000 && rec[2] >= 1000,
              "the flood did not fill the stores: %ld %ld %ld records", rec[0], rec[1], rec[2]);

    /* While it goes on, honest puts are stored by both other nodes and read back. */
    for (int k = 0; k < 5; k++) {
        char key[32], val[32];
        long stored = 0;
        snprintf(key, sizeof(key), "honest-key-%d", k);
        snprintf(val, sizeof(val), "honest-value-%d", k);
        cr_assert_eq(honest_put(&v[k % 3], key, val, &stored), 0, "dht put %s failed", key);
        cr_assert_geq(stored, 2, "dht put %s: %ld replicas", key, stored);
        char *got = honest_get(&v[(k + 1) % 3], key);
        cr_assert_not_null(got, "dht get %s found nothing", key);
        cr_assert_str_eq(got, val);
        free(got);
    }
    /* The attack was still running, and was refused and evicted rather than admitted. */
    for (int i = 0; i < 3; i++) {
        cr_assert_leq(dht_info(&v[i], "records"), 1000);
        cr_assert_gt(metric(&v[i], "hivemindd_limit_refused_total{limit=\"DhtStoreEntries\"}") +
                         metric(&v[i],
                                "hivemindd_limit_refused_total{limit=\"DhtStoreOriginShare\"}"),
                     100);
        long rss = hm_hostile_rss_kib(v[i].pid);
        cr_assert_lt(rss - rss0[i], 64 * 1024, "v%d grew by %ld KiB", i, rss - rss0[i]);
    }
    double evicted = 0;
    for (int i = 0; i < 3; i++)
        evicted += metric(&v[i], "hivemindd_dht_store_evicted_total");
    cr_log_info("storage: records %ld %ld %ld, %.0f flood entries evicted for honest puts",
                rec[0], rec[1], rec[2], evicted);
    cr_assert_geq(evicted, 5, "honest puts evicted only %.0f flood entries", evicted);
}

/* ---- case 6: the peer table ---- */

typedef struct probe {
    int done, status;
    uint64_t ms;
} probe;

static void on_probe(void *ud, int status, const uint8_t *body, size_t len)
{
    probe *p = ud;
    HM_UNUSED(body);
    HM_UNUSED(len);
    p->done = 1;
    p->status = status;
}

Test(hostile_dht, peer_table_flood_keeps_honest_peers_and_probes)
{
    struct node v, h[2];
    /* A table of 100 and 64 connections: 300 attacker identities (150 per
     * origin) would fill the table, and stream pings to all of them would
     * take every connection. */
    start_node(&v, "victim", NULL, "--peer-table-size", "100", "--max-connections", "64", NULL);
    for (int i = 0; i < 2; i++) {
        char name[8];
        snprintf(name, sizeof(name), "h%d", i);
        start_node(&h[i], name, NULL, "--initial-peers", v.addr, NULL);
    }
    long deadline = hm_test_now_ms() + 15000;
    while (hm_test_now_ms() < deadline && !(peers_show(&v, h[0].id) && peers_show(&v, h[1].id)))
        usleep(200000);
    cr_assert(peers_show(&v, h[0].id) && peers_show(&v, h[1].id));
    /* A few ping rounds, so the honest peers are verified. */
    usleep(2500000);

    attacker_start(&v, 1, 300, 0);
    deadline = hm_test_now_ms() + 40000;
    double peers = 0;
    while (hm_test_now_ms() < deadline && (peers = metric(&v, "hivemindd_peers")) < 100)
        usleep(300000);
    cr_assert_geq(peers, 100, "the flood did not fill the peer table (%.0f peers)", peers);
    /* Let the victim ping the table a few rounds (1 s each) with the flood in it. */
    usleep(3000000);

    /* The honest peers are still in the table. */
    cr_assert(peers_show(&v, h[0].id), "h0 was pushed out of the table");
    cr_assert(peers_show(&v, h[1].id), "h1 was pushed out of the table");

    /* Five honest probes: a fresh identity on 127.0.0.1 each, a new
     * connection each, a node.ping over it answered within 1 s. */
    uint8_t vpk[HM_PK_BYTES];
    struct sockaddr_storage vsa;
    hm_hostile_parse_peer(v.addr, vpk, &vsa);
    uv_loop_t loop;
    uv_loop_init(&loop);
    int ok = 0;
    char ids[5][HM_PEER_ID_LEN + 1];
    hm_rpc *probes[5];
    for (int i = 0; i < 5; i++) {
        hm_identity pid;
        probes[i] = hm_hostile_rpc(&loop, "127.0.0.1", &pid, NULL);
        memcpy(ids[i], pid.peer_id, sizeof(ids[i]));
        probe p = {0};
        uint64_t t0 = hm_now_ms();
        static const uint8_t empty_map = 0x80;
        cr_assert_eq(hm_rpc_call(probes[i], vpk, (const struct sockaddr *)&vsa, "node.ping",
                                 &empty_map, 1, HM_RPC_STREAM, 3000, on_probe, &p, NULL),
                     0);
        while (!p.done && hm_now_ms() < t0 + 4000)
            uv_run(&loop, UV_RUN_ONCE);
        p.ms = hm_now_ms() - t0;
        if (p.done && p.status == 0 && p.ms < 1000)
            ok++;
        else
            cr_log_warn("probe %d: status %d after %llu ms", i, p.status,
                        (unsigned long long)p.ms);
    }
    cr_assert_eq(ok, 5, "%d of 5 honest probes answered within 1 s", ok);
    /* The probes came from the honest origin, so they got places in the full table. */
    hm_hostile_run_for(&loop, 300);
    int placed = 0;
    for (int i = 0; i < 5; i++)
        placed += peers_show(&v, ids[i]);
    cr_assert_geq(placed, 4, "only %d of 5 honest newcomers got a place", placed);
    /* The flood was turned away (its origins at their cap, or among the
     * heaviest in a full table) rather than admitted. */
    double refused = metric(&v, "hivemindd_limit_refused_total{limit=\"PeerTableOriginCap\"}") +
                     metric(&v, "hivemindd_limit_refused_total{limit=\"PeerTableSize\"}");
    cr_log_info("peer table: %.0f peers, %.0f newcomers refused, %.0f evicted, %d probes ok",
                metric(&v, "hivemindd_peers"), refused,
                metric(&v, "hivemindd_peers_evicted_total"), ok);
    cr_assert_gt(refused, 100);
    for (int i = 0; i < 5; i++)
        hm_rpc_close(probes[i], NULL, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_loop_close(&loop);
}

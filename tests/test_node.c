/*
 * Tests for node: peers find each other from an initial address, measure
 * round-trip times, drop a peer that stops answering and take it back when
 * it returns, keep swarms apart, and export metrics.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "src/node/node.h"
#include "tests/loop.h"
#include "src/base/util.h"

static int run_until(uv_loop_t *loop, hm_test_pred pred, void *ud, uint64_t timeout_ms)
{
    return hm_test_run_until(loop, pred, ud, timeout_ms);
}

static hm_node *make_node(uv_loop_t *loop, const char *swarm, const char *peer,
                          uint64_t ping_ms)
{
    hm_node_options o = {0};
    const char *peers[1] = {peer};
    o.listen = "127.0.0.1:0";
    o.swarm = swarm;
    o.ping_interval_ms = ping_ms;
    o.max_ping_failures = 2;
    if (peer != NULL) {
        o.initial_peers = peers;
        o.n_initial_peers = 1;
    }
    hm_node *n = NULL;
    char err[256] = "";
    int r = hm_node_new(loop, &o, &n, err, sizeof(err));
    cr_assert_eq(r, 0, "hm_node_new: %s", err);
    return n;
}

static int knows(hm_node *a, hm_node *b)
{
    hm_peer_info info[16];
    size_t n = hm_node_peers(a, info, 16);
    for (size_t i = 0; i < n && i < 16; i++)
        if (memcmp(info[i].pk, hm_node_identity(b)->pk, HM_PK_BYTES) == 0)
            return 1;
    return 0;
}

static int rtt_known(hm_node *a, hm_node *b)
{
    hm_peer_info info[16];
    size_t n = hm_node_peers(a, info, 16);
    for (size_t i = 0; i < n && i < 16; i++)
        if (memcmp(info[i].pk, hm_node_identity(b)->pk, HM_PK_BYTES) == 0)
            return info[i].rtt_ms >= 0 && info[i].connected;
    return 0;
}

typedef struct pair {
    hm_node *a, *b;
} pair;

static int both_know(void *ud)
{
    pair *p = ud;
    return knows(p->a, p->b) && knows(p->b, p->a);
}

static int both_rtt(void *ud)
{
    pair *p = ud;
    return rtt_known(p->a, p->b) && rtt_known(p->b, p->a);
}

static int a_forgot_b(void *ud)
{
    pair *p = ud;
    return !knows(p->a, p->b);
}

static void close_all(uv_loop_t *loop, hm_node **nodes, size_t n)
{
    for (size_t i = 0; i < n; i++)
        hm_node_close(nodes[i], NULL, NULL);
    uv_run(loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(loop), 0, "handles left open after close");
}

Test(node, peers_find_each_other_and_measure_rtt, .timeout = 20)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_node *a = make_node(&loop, "t", NULL, 200);
    char addr[256];
    cr_assert_eq(hm_node_address(a, addr, sizeof(addr)), 0);
    cr_assert(strncmp(addr, hm_node_identity(a)->peer_id, HM_PEER_ID_LEN) == 0);
    cr_assert_eq(addr[HM_PEER_ID_LEN], '@');
    hm_node *b = make_node(&loop, "t", addr, 200);

    pair p = {a, b};
    cr_assert(run_until(&loop, both_know, &p, 5000), "nodes did not find each other");
    cr_assert(run_until(&loop, both_rtt, &p, 5000), "rtt or connection missing");

    hm_peer_info info[4];
    cr_assert_eq(hm_node_peers(b, info, 4), 1);
    cr_assert_str_eq(info[0].peer_id, hm_node_identity(a)->peer_id);
    cr_assert(info[0].rtt_ms < 1000.0);
    /* b learned a's listening address, which is the one it was given. */
    char got[HM_ADDRSTRLEN];
    hm_format_addr((struct sockaddr *)&info[0].addr, got, sizeof(got));
    cr_assert_str_eq(got, strchr(addr, '@') + 1);

    char *m = hm_node_metrics(a);
    cr_assert_not_null(m);
    cr_assert_not_null(strstr(m, "\nhivemindd_peers 1\n"), "%s", m);
    cr_assert_not_null(strstr(m, "hivemindd_connections "));
    cr_assert_not_null(strstr(m, "hivemindd_rpc_calls_total{method=\"node.ping\",result=\"ok\"} "));
    cr_assert_not_null(strstr(m, "hivemindd_rpc_served_total{method=\"node.ping\"} "));
    cr_assert_not_null(
        strstr(m, "hivemindd_rpc_latency_seconds_bucket{method=\"node.ping\",le=\"+Inf\"} "));
    cr_assert_not_null(strstr(m, "# TYPE hivemindd_rpc_latency_seconds histogram"));
    /* Counters that moved must not read zero. */
    cr_assert_null(strstr(m, "\nhivemindd_sent_bytes_total 0\n"));
    free(m);

    hm_node *nodes[] = {a, b};
    close_all(&loop, nodes, 2);
}

Test(node, other_swarm_never_becomes_a_peer, .timeout = 20)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_node *a = make_node(&loop, "alpha", NULL, 200);
    char addr[256];
    cr_assert_eq(hm_node_address(a, addr, sizeof(addr)), 0);
    hm_node *b = make_node(&loop, "beta", addr, 200);
    hm_node *c = make_node(&loop, "alpha", addr, 200);

    pair ac = {a, c};
    cr_assert(run_until(&loop, both_know, &ac, 5000));
    /* Give b's pings several rounds to (fail to) get through. */
    pair ab = {a, b};
    run_until(&loop, both_know, &ab, 1500);
    cr_assert(!knows(a, b), "a node of another swarm entered the peer table");
    cr_assert(!knows(b, a));

    hm_node *nodes[] = {a, b, c};
    close_all(&loop, nodes, 3);
}

Test(node, silent_peer_is_dropped_and_taken_back, .timeout = 30)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_node *a = make_node(&loop, "t", NULL, 200);
    char addr[256];
    cr_assert_eq(hm_node_address(a, addr, sizeof(addr)), 0);
    hm_node *b = make_node(&loop, "t", addr, 200);
    pair p = {a, b};
    cr_assert(run_until(&loop, both_know, &p, 5000));

    /* b stops answering entirely, as a SIGSTOPped process would. */
    hm_transport_faults f = {0};
    f.stall = 1;
    hm_transport_set_faults(hm_rpc_transport(hm_node_rpc(b)), &f);
    cr_assert(run_until(&loop, a_forgot_b, &p, 8000), "a kept a silent peer");

    /* b resumes; its own pings to a (its initial peer) bring it back. */
    f.stall = 0;
    hm_transport_set_faults(hm_rpc_transport(hm_node_rpc(b)), &f);
    cr_assert(run_until(&loop, both_know, &p, 8000), "a did not take b back");

    hm_node *nodes[] = {a, b};
    close_all(&loop, nodes, 2);
}

Test(node, bad_initial_peer_is_refused)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_node_options o = {0};
    const char *peers[] = {"not-an-address"};
    o.initial_peers = peers;
    o.n_initial_peers = 1;
    hm_node *n = NULL;
    char err[256] = "";
    cr_assert_eq(hm_node_new(&loop, &o, &n, err, sizeof(err)), -EINVAL);
    cr_assert_null(n);
    cr_assert_not_null(strstr(err, "PEERID@HOST:PORT"), "%s", err);
    cr_assert_eq(uv_loop_close(&loop), 0);
}

/* ---- the peer table against many identities from few origins ---- */

static hm_node *make_node_at(uv_loop_t *loop, const char *ip, const char *peer, size_t max_peers,
                             size_t per_origin)
{
    static char listen[64][32];
    static unsigned next;
    char *l = listen[next++ % 64];
    snprintf(l, 32, "%s:0", ip);
    hm_node_options o = {0};
    const char *peers[1] = {peer};
    o.listen = l;
    o.swarm = "t";
    o.ping_interval_ms = 200;
    o.max_peers = max_peers;
    o.max_peers_per_origin = per_origin;
    if (peer != NULL) {
        o.initial_peers = peers;
        o.n_initial_peers = 1;
    }
    hm_node *n = NULL;
    char err[256] = "";
    cr_assert_eq(hm_node_new(loop, &o, &n, err, sizeof(err)), 0, "hm_node_new on %s: %s", ip, err);
    return n;
}

static int never(void *ud)
{
    (void)ud;
    return 0;
}

typedef struct table_goal {
    hm_node *victim;
    size_t peers;
    hm_node *must_know;
} table_goal;

static int table_reaches(void *ud)
{
    table_goal *g = ud;
    hm_peer_info info[16];
    if (hm_node_peers(g->victim, info, 16) < g->peers)
        return 0;
    return g->must_know == NULL || knows(g->victim, g->must_know);
}

/* Places of one origin in n's table. */
static size_t places_of(hm_node *n, const char *ip)
{
    hm_peer_info info[16];
    size_t total = hm_node_peers(n, info, 16), k = 0;
    char a[HM_ADDRSTRLEN];
    for (size_t i = 0; i < total && i < 16; i++)
        if (hm_format_addr((struct sockaddr *)&info[i].addr, a, sizeof(a)) == 0 &&
            strncmp(a, ip, strlen(ip)) == 0 && a[strlen(ip)] == ':')
            k++;
    return k;
}

Test(node, peer_table_counts_origins_and_evicts_from_the_heaviest, .timeout = 30)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    /* A table of 8, at most 3 places per origin. */
    hm_node *v = make_node_at(&loop, "127.0.0.1", NULL, 8, 3);
    char addr[256];
    cr_assert_eq(hm_node_address(v, addr, sizeof(addr)), 0);
    hm_node *all[32];
    size_t n_all = 0;
    all[n_all++] = v;
    hm_node *honest[2];
    for (int i = 0; i < 2; i++)
        all[n_all++] = honest[i] = make_node_at(&loop, "127.0.0.1", addr, 0, 0);
    table_goal g = {v, 2, NULL};
    cr_assert(run_until(&loop, table_reaches, &g, 5000), "the honest peers did not join");

    /* Six identities on each of two attack origins: each origin gets 3 places. */
    for (int i = 0; i < 6; i++) {
        all[n_all++] = make_node_at(&loop, "127.0.0.2", addr, 0, 0);
        all[n_all++] = make_node_at(&loop, "127.0.0.3", addr, 0, 0);
    }
    g.peers = 8;
    cr_assert(run_until(&loop, table_reaches, &g, 5000), "the flood did not fill the table");
    run_until(&loop, never, NULL, 1000);
    cr_assert_eq(places_of(v, "127.0.0.2"), 3);
    cr_assert_eq(places_of(v, "127.0.0.3"), 3);
    /* The honest peers known before stay. */
    cr_assert(knows(v, honest[0]) && knows(v, honest[1]));

    /* A newcomer from a new origin gets a place in the full table, at an
     * attack origin's expense. */
    hm_node *late = make_node_at(&loop, "127.0.0.4", addr, 0, 0);
    all[n_all++] = late;
    g.must_know = late;
    cr_assert(run_until(&loop, table_reaches, &g, 5000), "the newcomer got no place");
    cr_assert_eq(places_of(v, "127.0.0.2") + places_of(v, "127.0.0.3"), 5);
    cr_assert(knows(v, honest[0]) && knows(v, honest[1]));

    char *m = hm_node_metrics(v);
    cr_assert_not_null(strstr(m, "\nhivemindd_peers_evicted_total 1\n"), "%s", m);
    free(m);
    close_all(&loop, all, n_all);
}

/* ---- the declared address through the switch to an observed one ---- */

typedef struct watch_addr {
    hm_node *n;
    int lost;        /* hm_node_announce failed once it had succeeded */
    int had;         /* it succeeded */
    int observed_ok; /* reach says: observed, and confirmed */
} watch_addr;

static int observed_and_confirmed(void *ud)
{
    watch_addr *w = ud;
    struct sockaddr_storage a;
    hm_node_reach_info ri;
    if (hm_node_announce(w->n, &a) == 0)
        w->had = 1;
    else if (w->had)
        w->lost = 1;
    if (hm_node_reach(w->n, &ri) == 0 && strcmp(ri.source, "observed") == 0 &&
        ri.reachable == HM_REACH_YES)
        w->observed_ok = 1;
    return w->observed_ok;
}

/*
 * A node on 127.0.0.5 declares its listen address from the start; when two
 * peers of other origins agree that they see that same address, the source
 * becomes "observed" and a dial-back confirms it. The address stays
 * declared all along: it was not withdrawn for the dial-back's time (a
 * search starting in that window found no address and averaged as a
 * client).
 */
Test(node, the_listen_address_stays_declared_when_peers_observe_it, .timeout = 30)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_node *a = make_node_at(&loop, "127.0.0.2", NULL, 0, 0);
    char addr[256];
    cr_assert_eq(hm_node_address(a, addr, sizeof(addr)), 0);
    hm_node *b = make_node_at(&loop, "127.0.0.3", addr, 0, 0);
    hm_node *n = make_node_at(&loop, "127.0.0.5", addr, 0, 0);
    watch_addr w = {n, 0, 0, 0};
    cr_assert(run_until(&loop, observed_and_confirmed, &w, 20000),
              "the address never became observed and confirmed");
    cr_assert(w.had);
    cr_assert(!w.lost, "the declared address was withdrawn while its observation was checked");
    hm_node *all[] = {n, b, a};
    close_all(&loop, all, 3);
}

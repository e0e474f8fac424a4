/*
 * Tests for matchmaking: real nodes on 127.0.0.1 in one process and one
 * loop, bootstrapped to each other so that their DHT works, find groups
 * the way a trainer's averaging rounds do: pairs, a full group of four,
 * min_group_size at the deadline, sixteen peers contending for groups of
 * four (every one of them ends in exactly one group), the codec's messages,
 * prefixes and group bits that keep swarms apart, followers whose leader
 * vanishes, and peers that start as clients for want of an address and
 * lead once they have one. Every assertion is over what the callbacks of
 * all peers reported, since the guarantee is about agreement between peers.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "averaging/matchmaking.h"
#include "src/node/node.h"
#include "tests/loop.h"
#include "src/base/util.h"

#define MAX_PEERS 16

typedef struct tpeer {
    hm_node *node;
    hm_mm *mm;
    uint64_t search;
    int done, calls, status;
    hm_avg_group g;
    uint64_t started_ms, done_ms;
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

static int never(void *ud)
{
    HM_UNUSED(ud);
    return 0;
}

static void run_for(uv_loop_t *loop, uint64_t ms) { run_until(loop, never, NULL, ms); }

static hm_node *make_node(uv_loop_t *loop, const char *peer)
{
    return hm_test_make_node(loop, "mm-test", peer);
}

static int dht_ready(void *ud)
{
    swarm *sw = ud;
    size_t need = HM_MIN(sw->n - 1, (size_t)6);
    for (size_t i = 0; i < sw->n; i++)
        if (sw->p[i].node != NULL && hm_rt_size(hm_dht_routing(hm_node_dht(sw->p[i].node))) < need)
            return 0;
    return 1;
}

/* n nodes, all bootstrapped from the first, each with a matchmaker. */
static void swarm_start(swarm *sw, size_t n)
{
    char addr[256];
    memset(sw, 0, sizeof(*sw));
    hm_log_set_level(getenv("HM_TEST_DEBUG") != NULL ? HM_LOG_DEBUG : HM_LOG_ERROR);
    cr_assert_eq(uv_loop_init(&sw->loop), 0);
    sw->n = n;
    for (size_t i = 0; i < n; i++) {
        sw->p[i].node = make_node(&sw->loop, i == 0 ? NULL : addr);
        if (i == 0)
            cr_assert_eq(hm_node_address(sw->p[0].node, addr, sizeof(addr)), 0);
        cr_assert_eq(hm_mm_new(sw->p[i].node, &sw->p[i].mm), 0);
    }
    cr_assert(run_until(&sw->loop, dht_ready, sw, 10000), "the DHT did not come up");
}

static void swarm_stop(swarm *sw)
{
    for (size_t i = 0; i < sw->n; i++) {
        if (sw->p[i].mm != NULL)
            hm_mm_free(sw->p[i].mm);
        if (sw->p[i].node != NULL)
            hm_node_close(sw->p[i].node, NULL, NULL);
    }
    uv_run(&sw->loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&sw->loop), 0, "handles left open after close");
}

static void on_group(void *ud, int status, const hm_avg_group *g)
{
    tpeer *p = ud;
    p->calls++;
    p->done = 1;
    p->status = status;
    p->done_ms = hm_now_ms();
    if (status == 0) {
        cr_assert_not_null(g);
        p->g = *g;
    } else {
        cr_assert_null(g);
    }
}

static hm_mm_config cfg_of(const char *prefix, const char *bits, unsigned target, unsigned min,
                           uint64_t mm_ms)
{
    hm_mm_config c = {0};
    c.prefix = prefix;
    c.group_bits = bits;
    c.target_group_size = target;
    c.min_group_size = min;
    c.min_matchmaking_ms = mm_ms;
    c.request_timeout_ms = 1000;
    c.bandwidth = 1e8;
    return c;
}

static void start(tpeer *p, const hm_mm_config *c, uint64_t timeout_ms)
{
    p->started_ms = hm_now_ms();
    cr_assert_eq(hm_mm_find_group(p->mm, c, timeout_ms, on_group, p, &p->search), 0);
    /* Never from inside the call. */
    cr_assert_eq(p->calls, 0);
}

typedef struct range {
    swarm *sw;
    size_t from, to;
} range;

static int all_done(void *ud)
{
    range *r = ud;
    for (size_t i = r->from; i < r->to; i++)
        if (!r->sw->p[i].done)
            return 0;
    return 1;
}

static const uint8_t *pk_of(const tpeer *p) { return hm_node_identity(p->node)->pk; }

static int same_group(const hm_avg_group *a, const hm_avg_group *b)
{
    if (memcmp(a->group_id, b->group_id, HM_AVG_GROUP_ID_BYTES) != 0 || a->n != b->n)
        return 0;
    for (size_t i = 0; i < a->n; i++) {
        if (memcmp(a->members[i].pk, b->members[i].pk, HM_PK_BYTES) != 0 ||
            !hm_addr_equal((const struct sockaddr *)&a->members[i].addr,
                           (const struct sockaddr *)&b->members[i].addr) ||
            a->members[i].bandwidth != b->members[i].bandwidth)
            return 0;
    }
    return 1;
}

static tpeer *peer_by_pk(swarm *sw, const uint8_t *pk)
{
    for (size_t i = 0; i < sw->n; i++)
        if (sw->p[i].node != NULL && memcmp(pk_of(&sw->p[i]), pk, HM_PK_BYTES) == 0)
            return &sw->p[i];
    return NULL;
}

/*
 * The guarantees over peers [from, to) that succeeded: each one's own entry
 * is at its self index with its real address, every member named in a
 * group reported exactly that group (id, members, order), groups are no
 * larger than max_n. Returns the number of distinct groups.
 */
static size_t check_groups(swarm *sw, size_t from, size_t to, size_t max_n)
{
    size_t groups = 0;
    for (size_t i = from; i < to; i++) {
        tpeer *p = &sw->p[i];
        cr_assert_eq(p->calls, 1, "peer %zu: %d callbacks", i, p->calls);
        if (p->status != 0)
            continue;
        const hm_avg_group *g = &p->g;
        cr_assert(g->n >= 1 && g->n <= max_n, "peer %zu: group of %zu", i, g->n);
        cr_assert(g->self < g->n);
        cr_assert_eq(memcmp(g->members[g->self].pk, pk_of(p), HM_PK_BYTES), 0);
        struct sockaddr_storage local;
        cr_assert_eq(hm_transport_local_addr(hm_rpc_transport(hm_node_rpc(p->node)), &local), 0);
        cr_assert(hm_addr_equal((const struct sockaddr *)&local,
                                (const struct sockaddr *)&g->members[g->self].addr));
        int first = 1;
        for (size_t k = 0; k < g->n; k++) {
            tpeer *q = peer_by_pk(sw, g->members[k].pk);
            cr_assert_not_null(q, "peer %zu: unknown member %zu", i, k);
            size_t qi = (size_t)(q - sw->p);
            cr_assert(qi >= from && qi < to, "peer %zu grouped with outsider %zu", i, qi);
            cr_assert_eq(q->status, 0, "peer %zu lists %zu, which failed (%d)", i, qi, q->status);
            cr_assert(same_group(g, &q->g), "peers %zu and %zu disagree on their group", i, qi);
            cr_assert_eq(q->g.self, k);
            if (qi < i)
                first = 0;
        }
        groups += first;
    }
    return groups;
}

Test(matchmaking, two_peers_form_a_pair, .timeout = 30)
{
    swarm sw;
    swarm_start(&sw, 2);
    hm_mm_config c = cfg_of("model.params", "0110", 2, 2, 1000);
    c.bandwidth = 1e8;
    start(&sw.p[0], &c, 8000);
    c.bandwidth = 5e7;
    start(&sw.p[1], &c, 8000);
    range r = {&sw, 0, 2};
    cr_assert(run_until(&sw.loop, all_done, &r, 10000));
    cr_assert_eq(sw.p[0].status, 0, "%s", hm_strerror(sw.p[0].status));
    cr_assert_eq(sw.p[1].status, 0, "%s", hm_strerror(sw.p[1].status));
    cr_assert_eq(check_groups(&sw, 0, 2, 2), 1);
    const hm_avg_group *g = &sw.p[0].g;
    cr_assert_eq(g->n, 2);
    /* Declared bandwidths reach the group. */
    for (size_t k = 0; k < 2; k++) {
        tpeer *q = peer_by_pk(&sw, g->members[k].pk);
        cr_assert_eq(g->members[k].bandwidth, q == &sw.p[0] ? 1e8 : 5e7);
    }
    /* Moshpit: both shift in one bit, and the two partners differ in it. */
    cr_assert_eq(strlen(sw.p[0].g.next_bits), 4);
    cr_assert_eq(strncmp(sw.p[0].g.next_bits, "110", 3), 0, "%s", sw.p[0].g.next_bits);
    cr_assert_eq(strncmp(sw.p[1].g.next_bits, "110", 3), 0, "%s", sw.p[1].g.next_bits);
    cr_assert_neq(sw.p[0].g.next_bits[3], sw.p[1].g.next_bits[3]);
    swarm_stop(&sw);
}

Test(matchmaking, four_peers_fill_a_group_of_four, .timeout = 30)
{
    swarm sw;
    swarm_start(&sw, 4);
    hm_mm_config c = cfg_of("four", NULL, 4, 2, 1500);
    for (size_t i = 0; i < 4; i++)
        start(&sw.p[i], &c, 10000);
    range r = {&sw, 0, 4};
    cr_assert(run_until(&sw.loop, all_done, &r, 12000));
    for (size_t i = 0; i < 4; i++)
        cr_assert_eq(sw.p[i].status, 0, "peer %zu: %s", i, hm_strerror(sw.p[i].status));
    cr_assert_eq(check_groups(&sw, 0, 4, 4), 1);
    cr_assert_eq(sw.p[0].g.n, 4);
    /* Without group bits, the key never changes. */
    cr_assert_str_eq(sw.p[0].g.next_bits, "");
    swarm_stop(&sw);
}

Test(matchmaking, min_group_size_at_the_deadline, .timeout = 30)
{
    swarm sw;
    swarm_start(&sw, 2);
    /* Alone with min 2: every attempt disbands, then the timeout. */
    hm_mm_config c = cfg_of("lonely", NULL, 4, 2, 300);
    start(&sw.p[0], &c, 1200);
    /* Alone with min 1: a group of one at the first deadline. */
    hm_mm_config c1 = cfg_of("alone", NULL, 4, 1, 500);
    start(&sw.p[1], &c1, 5000);
    range r = {&sw, 0, 2};
    cr_assert(run_until(&sw.loop, all_done, &r, 8000));
    cr_assert_eq(sw.p[0].calls, 1);
    cr_assert_eq(sw.p[0].status, -ETIMEDOUT, "%s", hm_strerror(sw.p[0].status));
    uint64_t took = sw.p[0].done_ms - sw.p[0].started_ms;
    cr_assert(took >= 1150 && took <= 1700, "timed out after %llu ms", (unsigned long long)took);
    cr_assert_eq(sw.p[1].status, 0, "%s", hm_strerror(sw.p[1].status));
    cr_assert_eq(sw.p[1].g.n, 1);
    cr_assert_eq(sw.p[1].g.self, 0);
    took = sw.p[1].done_ms - sw.p[1].started_ms;
    cr_assert(took >= 450 && took <= 1500, "formed after %llu ms", (unsigned long long)took);
    swarm_stop(&sw);
}

Test(matchmaking, sixteen_contending_peers_form_groups_of_at_most_four, .timeout = 40)
{
    swarm sw;
    swarm_start(&sw, 16);
    hm_mm_config c = cfg_of("contended", NULL, 4, 2, 1500);
    for (size_t i = 0; i < 16; i++)
        start(&sw.p[i], &c, 6000);
    range r = {&sw, 0, 16};
    cr_assert(run_until(&sw.loop, all_done, &r, 8000));
    size_t ok = 0, members = 0, groups = check_groups(&sw, 0, 16, 4);
    for (size_t i = 0; i < 16; i++) {
        if (getenv("HM_TEST_DEBUG") != NULL)
            fprintf(stderr, "peer %zu %.8s: status %d, group %02x n %zu after %llu ms\n", i,
                    hm_node_identity(sw.p[i].node)->peer_id, sw.p[i].status,
                    sw.p[i].g.group_id[0], sw.p[i].g.n,
                    (unsigned long long)(sw.p[i].done_ms - sw.p[i].started_ms));
        if (sw.p[i].status == 0)
            ok++;
        else
            cr_assert_eq(sw.p[i].status, -ETIMEDOUT);
    }
    for (size_t i = 0; i < 16; i++)
        if (sw.p[i].status == 0 && sw.p[i].g.self == 0)
            members += sw.p[i].g.n;
    /* Every peer that succeeded is in exactly one group. */
    cr_assert_eq(members, ok);
    /*
     * Every peer ends in a group: a peer whose key is earlier than the
     * last leaders' and that nobody joined asks those leaders itself near
     * its deadline, and a leader about to begin takes it (matchmaking.h).
     */
    cr_assert_eq(ok, 16, "%zu of 16 peers found a group", ok);
    cr_assert(groups >= 4, "%zu groups", groups);
    swarm_stop(&sw);
}

Test(matchmaking, prefixes_and_group_bits_never_mix, .timeout = 30)
{
    swarm sw;
    swarm_start(&sw, 6);
    hm_mm_config ca = cfg_of("alpha", NULL, 4, 2, 1000);
    hm_mm_config cb0 = cfg_of("beta", "0", 4, 2, 1000);
    hm_mm_config cb1 = cfg_of("beta", "1", 4, 2, 1000);
    start(&sw.p[0], &ca, 8000);
    start(&sw.p[1], &cb0, 8000);
    start(&sw.p[2], &cb1, 8000);
    start(&sw.p[3], &ca, 8000);
    start(&sw.p[4], &cb0, 8000);
    start(&sw.p[5], &cb1, 8000);
    range r = {&sw, 0, 6};
    cr_assert(run_until(&sw.loop, all_done, &r, 10000));
    cr_assert_eq(check_groups(&sw, 0, 6, 4), 3);
    for (size_t i = 0; i < 6; i++) {
        cr_assert_eq(sw.p[i].status, 0, "peer %zu: %s", i, hm_strerror(sw.p[i].status));
        cr_assert_eq(sw.p[i].g.n, 2);
        /* Peers i and i + 3 share a key, and only they. */
        tpeer *other = peer_by_pk(&sw, sw.p[i].g.members[1 - sw.p[i].g.self].pk);
        cr_assert_eq(other, &sw.p[(i + 3) % 6]);
    }
    swarm_stop(&sw);
}

typedef struct follow_state {
    swarm *sw;
    const uint8_t *leader_pk;
} follow_state;

static int all_follow_leader(void *ud)
{
    follow_state *f = ud;
    for (size_t i = 1; i < 4; i++) {
        hm_mm_info info;
        if (hm_mm_search_info(f->sw->p[i].mm, f->sw->p[i].search, &info) < 0)
            return 0;
        if (info.phase != HM_MM_FOLLOWING || memcmp(info.leader_pk, f->leader_pk, HM_PK_BYTES))
            return 0;
    }
    hm_mm_info info;
    return hm_mm_search_info(f->sw->p[0].mm, f->sw->p[0].search, &info) == 0 && info.waiting == 3;
}

Test(matchmaking, followers_regroup_when_their_leader_vanishes, .timeout = 40)
{
    swarm sw;
    swarm_start(&sw, 5);
    /* Peer 4 only serves the DHT. Peer 0 starts first, so it has the
     * earliest deadline and leads; a target of 8 keeps it waiting. */
    hm_mm_config c = cfg_of("vanish", NULL, 8, 2, 2000);
    start(&sw.p[0], &c, 10000);
    run_for(&sw.loop, 300);
    for (size_t i = 1; i < 4; i++)
        start(&sw.p[i], &c, 10000);
    uint8_t leader_pk[HM_PK_BYTES];
    memcpy(leader_pk, pk_of(&sw.p[0]), HM_PK_BYTES);
    follow_state fs = {&sw, leader_pk};
    cr_assert(run_until(&sw.loop, all_follow_leader, &fs, 1500),
              "the followers did not all join the first peer");
    hm_mm_info info;
    cr_assert_eq(hm_mm_search_info(sw.p[0].mm, sw.p[0].search, &info), 0);
    cr_assert_eq(info.waiting, 3);

    /* The leader's process goes away: its node closes with no goodbye. */
    hm_node_close(sw.p[0].node, NULL, NULL);
    hm_mm_free(sw.p[0].mm);
    sw.p[0].mm = NULL;
    sw.p[0].node = NULL;
    cr_assert_eq(sw.p[0].calls, 1);
    cr_assert_eq(sw.p[0].status, -ECANCELED);

    range r = {&sw, 1, 4};
    cr_assert(run_until(&sw.loop, all_done, &r, 12000));
    for (size_t i = 1; i < 4; i++) {
        cr_assert_eq(sw.p[i].status, 0, "peer %zu: %s", i, hm_strerror(sw.p[i].status));
        cr_assert(sw.p[i].done_ms < sw.p[i].started_ms + 10000);
    }
    cr_assert_eq(check_groups(&sw, 1, 4, 8), 1);
    cr_assert_eq(sw.p[1].g.n, 3);
    swarm_stop(&sw);
}

/* A node of the test swarm listening on listen ("HOST:PORT"). */
static hm_node *make_node_on(uv_loop_t *loop, const char *listen, const char *peer)
{
    return hm_test_make_node_on(loop, "mm-test", listen, peer, 500);
}

static int pair_done(void *ud)
{
    tpeer *p = ud;
    return p[0].done && p[1].done;
}

/*
 * A search that starts while its node has no address others can dial (here
 * the node listens on 0.0.0.0, and peers of two origins have not yet
 * observed it at 127.0.0.1 nor dialled it back) averages as a client only
 * until the node has one. Two such peers meet, led by one that became a
 * full peer (in the group at its dialable address, with its bandwidth).
 * Were they clients for the whole search, neither would declare nor lead,
 * and both would time out: the netlab benchmark's round in which every
 * member failed with no_group had started just as each daemon's listen
 * address gave way to the same address observed, not declared until its
 * dial-back a moment later.
 */
Test(matchmaking, a_client_for_want_of_an_address_leads_once_it_has_one, .timeout = 40)
{
    uv_loop_t loop;
    char boot[256];
    hm_log_set_level(getenv("HM_TEST_DEBUG") != NULL ? HM_LOG_DEBUG : HM_LOG_ERROR);
    cr_assert_eq(uv_loop_init(&loop), 0);
    /* Two origins of their own (127.0.0.2, 127.0.0.3) that only observe and dial back. */
    hm_node *h1 = make_node_on(&loop, "127.0.0.2:0", NULL);
    cr_assert_eq(hm_node_address(h1, boot, sizeof(boot)), 0);
    hm_node *h2 = make_node_on(&loop, "127.0.0.3:0", boot);
    tpeer w[2];
    memset(w, 0, sizeof(w));
    hm_mm_config c = cfg_of("unconfirmed", NULL, 2, 2, 1000);
    for (size_t i = 0; i < 2; i++) {
        struct sockaddr_storage ann;
        w[i].node = make_node_on(&loop, "0.0.0.0:0", boot);
        cr_assert_eq(hm_mm_new(w[i].node, &w[i].mm), 0);
        cr_assert(hm_node_announce(w[i].node, &ann) < 0, "an address before any observation");
        start(&w[i], &c, 12000);
    }
    cr_assert(run_until(&loop, pair_done, w, 15000));
    size_t full = 0;
    for (size_t i = 0; i < 2; i++) {
        tpeer *p = &w[i];
        struct sockaddr_storage ann;
        cr_assert_eq(p->calls, 1);
        cr_assert_eq(p->status, 0, "peer %zu: %s", i, hm_strerror(p->status));
        cr_assert_eq(p->g.n, 2);
        cr_assert(same_group(&p->g, &w[1 - i].g), "the two disagree on their group");
        const hm_avg_member *me = &p->g.members[p->g.self];
        cr_assert_eq(memcmp(me->pk, pk_of(p), HM_PK_BYTES), 0);
        /* The leader is a full member: at the address it declares, with its
         * bandwidth. The other may have joined it still a client (bandwidth 0). */
        if (me->bandwidth == 0)
            continue;
        cr_assert_eq(me->bandwidth, 1e8);
        cr_assert_eq(hm_node_announce(p->node, &ann), 0);
        cr_assert(hm_addr_equal((const struct sockaddr *)&ann, (const struct sockaddr *)&me->addr),
                  "peer %zu is in the group at an address it does not declare", i);
        full++;
    }
    cr_assert_geq(full, 1, "no member became a full peer");
    for (size_t i = 0; i < 2; i++) {
        hm_mm_free(w[i].mm);
        hm_node_close(w[i].node, NULL, NULL);
    }
    hm_node_close(h2, NULL, NULL);
    hm_node_close(h1, NULL, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&loop), 0, "handles left open after close");
}

/* ---- the codec and the pure helpers ---- */

Test(matchmaking, group_keys_and_bits)
{
    char key[HM_MM_KEY_MAX + 1];
    cr_assert_eq(hm_mm_group_key("p", "01", key, sizeof(key)), 6);
    cr_assert_str_eq(key, "p.0b01");
    cr_assert_eq(hm_mm_group_key("p", NULL, key, sizeof(key)), 4);
    cr_assert_eq(hm_mm_group_key("p", "012", key, sizeof(key)), -EINVAL);
    cr_assert_eq(hm_mm_group_key("", "", key, sizeof(key)), -EINVAL);
    cr_assert_eq(hm_mm_group_key("x[owner:y", "", key, sizeof(key)), -EINVAL);
    cr_assert_eq(hm_mm_group_key("p", "01", key, 4), -EMSGSIZE);

    /* Eight members of a group of eight: eight distinct 3-bit buckets. */
    uint8_t id[HM_AVG_GROUP_ID_BYTES] = {7};
    char seen[8][HM_MM_BITS_MAX + 1];
    for (size_t i = 0; i < 8; i++) {
        hm_mm_next_bits("10101", id, i, 8, 8, seen[i]);
        cr_assert_eq(strlen(seen[i]), 5);
        cr_assert_eq(strncmp(seen[i], "01", 2), 0, "%s", seen[i]);
        for (size_t k = 0; k < i; k++)
            cr_assert_str_neq(seen[i], seen[k]);
        char again[HM_MM_BITS_MAX + 1];
        hm_mm_next_bits("10101", id, i, 8, 8, again);
        cr_assert_str_eq(again, seen[i]);
    }
}

Test(matchmaking, messages_round_trip_and_bad_ones_are_refused)
{
    uint8_t buf[HM_MM_WIRE_MAX];
    hm_wire_wr w;

    hm_mm_join j = {.bandwidth = 12.5, .client = 1, .deadline_ms = 1700000000123ull};
    memcpy(j.key, "k.0b1", 5);
    j.key_len = 5;
    cr_assert_eq(hm_parse_hostport("127.0.0.1:4000", &j.addr), 0);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_mm_encode_join(&w, &j);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    hm_mm_join j2;
    cr_assert_eq(hm_mm_decode_join(buf, w.len, &j2), 0);
    cr_assert_eq(j2.key_len, 5);
    cr_assert_eq(memcmp(j2.key, "k.0b1", 5), 0);
    cr_assert_eq(j2.bandwidth, 12.5);
    cr_assert_eq(j2.client, 1);
    cr_assert_eq(j2.deadline_ms, 1700000000123ull);
    cr_assert(hm_addr_equal((struct sockaddr *)&j.addr, (struct sockaddr *)&j2.addr));
    /* Truncated, trailing bytes, another version: all refused. */
    cr_assert_lt(hm_mm_decode_join(buf, w.len - 1, &j2), 0);
    buf[w.len] = 0xc0;
    cr_assert_lt(hm_mm_decode_join(buf, w.len + 1, &j2), 0);
    buf[1] = 1;
    cr_assert_eq(hm_mm_decode_join(buf, w.len, &j2), -EPROTO);
    cr_assert_eq(hm_mm_msg_version(buf, w.len), 1);

    /* A negative bandwidth is refused. */
    j.bandwidth = -1;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_mm_encode_join(&w, &j);
    cr_assert_eq(hm_mm_decode_join(buf, w.len, &j2), -EPROTO);

    /* A wait round-trips, and so does the flag of a follower that leaves. */
    hm_mm_wait wt = {.key_len = 5, .leave = 0}, wt2;
    memcpy(wt.key, "k.0b1", 5);
    for (int leave = 0; leave <= 1; leave++) {
        wt.leave = leave;
        hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
        hm_mm_encode_wait(&w, &wt);
        cr_assert_eq(hm_wire_wr_error(&w), 0);
        cr_assert_eq(hm_mm_decode_wait(buf, w.len, &wt2), 0);
        cr_assert_eq(wt2.leave, leave);
        cr_assert_eq(wt2.key_len, 5);
    }
    /* The flag must be a boolean. */
    buf[w.len - 1] = 0x01;
    cr_assert_eq(hm_mm_decode_wait(buf, w.len, &wt2), -EPROTO);

    /* A full BEGIN round-trips; a duplicated member is refused. */
    hm_mm_reply r = {.code = HM_MM_BEGIN};
    r.group.n = HM_AVG_MAX_GROUP;
    for (size_t i = 0; i < r.group.n; i++) {
        r.group.members[i].pk[0] = (uint8_t)i;
        r.group.members[i].pk[1] = 0xaa;
        r.group.members[i].bandwidth = (double)i;
        cr_assert_eq(hm_parse_hostport("[::1]:65535", &r.group.members[i].addr), 0);
    }
    r.group.group_id[5] = 9;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_mm_encode_reply(&w, &r);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    hm_mm_reply *r2 = malloc(sizeof(*r2));
    cr_assert_eq(hm_mm_decode_reply(buf, w.len, r2), 0);
    cr_assert_eq(r2->code, HM_MM_BEGIN);
    cr_assert_eq(r2->group.n, HM_AVG_MAX_GROUP);
    cr_assert_eq(r2->group.group_id[5], 9);
    cr_assert_eq(r2->group.members[63].bandwidth, 63.0);
    r.group.members[7].pk[0] = 3;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_mm_encode_reply(&w, &r);
    cr_assert_eq(hm_mm_decode_reply(buf, w.len, r2), -EPROTO);

    /* A redirect carries its leader; an unknown code is refused. */
    hm_mm_reply red = {.code = HM_MM_REDIRECT, .has_leader = 1, .deadline_ms = 42};
    red.leader_pk[0] = 1;
    cr_assert_eq(hm_parse_hostport("10.0.0.1:9", &red.leader_addr), 0);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_mm_encode_reply(&w, &red);
    cr_assert_eq(hm_mm_decode_reply(buf, w.len, r2), 0);
    cr_assert_eq(r2->code, HM_MM_REDIRECT);
    cr_assert(r2->has_leader);
    cr_assert_eq(r2->deadline_ms, 42);
    const uint8_t bad[] = {0x91, 0x07};
    cr_assert_eq(hm_mm_decode_reply(bad, sizeof(bad), r2), -EPROTO);
    free(r2);

    hm_mm_decl d = {.bandwidth = 1, .deadline_ms = 5, .looking = 1};
    cr_assert_eq(hm_parse_hostport("127.0.0.1:1", &d.addr), 0);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_mm_encode_decl(&w, &d);
    hm_mm_decl d2;
    cr_assert_eq(hm_mm_decode_decl(buf, w.len, &d2), 0);
    cr_assert_eq(d2.looking, 1);
    cr_assert_eq(d2.deadline_ms, 5);
}

typedef struct rawcall {
    int done, status;
} rawcall;

static void on_raw(void *ud, int status, const uint8_t *body, size_t len)
{
    HM_UNUSED(body);
    HM_UNUSED(len);
    rawcall *c = ud;
    c->done = 1;
    c->status = status;
}

static int raw_done(void *ud) { return ((rawcall *)ud)->done; }

/*
 * A node of matchmaking version 1 (an older hivemindd, averaging version 1)
 * cannot average with us: its join and wait are refused as of another
 * version, counted, and never let into a group, while a join of our version
 * from the same peer is taken.
 */
Test(matchmaking, a_peer_of_another_version_is_refused_by_name, .timeout = 30)
{
    swarm sw;
    swarm_start(&sw, 2);
    hm_mm_config c = cfg_of("ver", "", 2, 2, 5000);
    start(&sw.p[0], &c, 8000);
    char key[HM_MM_KEY_MAX + 1];
    cr_assert_gt(hm_mm_group_key("ver", "", key, sizeof(key)), 0);
    struct sockaddr_storage to, from;
    cr_assert_eq(hm_transport_local_addr(hm_rpc_transport(hm_node_rpc(sw.p[0].node)), &to), 0);
    cr_assert_eq(hm_transport_local_addr(hm_rpc_transport(hm_node_rpc(sw.p[1].node)), &from), 0);
    hm_mm_join j = {.key_len = strlen(key), .bandwidth = 1e8, .deadline_ms = hm_now_ms() + 60000};
    memcpy(j.key, key, j.key_len);
    memcpy(&j.addr, &from, sizeof(from));
    uint8_t buf[512];
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_mm_encode_join(&w, &j);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    cr_assert_eq(buf[1], 2, "joins are of matchmaking version 2");
    buf[1] = 1;
    hm_mm_wait wt = {.key_len = j.key_len};
    memcpy(wt.key, key, j.key_len);
    uint8_t wbuf[256];
    hm_wire_wr ww;
    hm_wire_wr_init_fixed(&ww, wbuf, sizeof(wbuf));
    hm_mm_encode_wait(&ww, &wt);
    wbuf[1] = 1;
    const char *methods[2] = {"avg.mm.join", "avg.mm.wait"};
    const uint8_t *bodies[2] = {buf, wbuf};
    size_t lens[2] = {w.len, ww.len};
    for (int i = 0; i < 2; i++) {
        rawcall rc = {0};
        cr_assert_eq(hm_rpc_call(hm_node_rpc(sw.p[1].node), pk_of(&sw.p[0]),
                                 (const struct sockaddr *)&to, methods[i], bodies[i], lens[i],
                                 HM_RPC_STREAM,
                                 5000, on_raw, &rc, NULL), 0);
        cr_assert(run_until(&sw.loop, raw_done, &rc, 6000));
        cr_assert_eq(rc.status, -EPROTONOSUPPORT, "%s of version 1: %d", methods[i], rc.status);
        cr_assert_eq(hm_mm_old_version(sw.p[0].mm), (uint64_t)i + 1);
    }
    /* The same peer at our version is taken: the search ends in a pair. */
    start(&sw.p[1], &c, 8000);
    range all = {&sw, 0, 2};
    cr_assert(run_until(&sw.loop, all_done, &all, 10000));
    cr_assert_eq(sw.p[0].status, 0);
    cr_assert_eq(sw.p[0].g.n, 2);
    cr_assert_eq(hm_mm_old_version(sw.p[0].mm), 2);
    swarm_stop(&sw);
}

Test(matchmaking, bad_configs_are_refused)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_node *n = make_node(&loop, NULL);
    hm_mm *mm;
    cr_assert_eq(hm_mm_new(n, &mm), 0);
    hm_mm *again;
    cr_assert_eq(hm_mm_new(n, &again), -EEXIST);
    tpeer p = {0};
    hm_mm_config c = cfg_of("x", NULL, HM_AVG_MAX_GROUP + 1, 2, 100);
    cr_assert_eq(hm_mm_find_group(mm, &c, 1000, on_group, &p, NULL), -EINVAL);
    c = cfg_of("x", NULL, 2, 3, 100);
    cr_assert_eq(hm_mm_find_group(mm, &c, 1000, on_group, &p, NULL), -EINVAL);
    c = cfg_of("x", "2", 2, 2, 100);
    cr_assert_eq(hm_mm_find_group(mm, &c, 1000, on_group, &p, NULL), -EINVAL);
    c = cfg_of("x", NULL, 2, 2, 100);
    cr_assert_eq(hm_mm_find_group(mm, &c, 0, on_group, &p, NULL), -EINVAL);
    uint64_t id;
    cr_assert_eq(hm_mm_find_group(mm, &c, 5000, on_group, &p, &id), 0);
    tpeer p2 = {0};
    cr_assert_eq(hm_mm_find_group(mm, &c, 5000, on_group, &p2, NULL), -EBUSY);
    cr_assert_eq(hm_mm_cancel(mm, id), 0);
    cr_assert_eq(p.calls, 1);
    cr_assert_eq(p.status, -ECANCELED);
    cr_assert_eq(hm_mm_cancel(mm, id), -ENOENT);
    /* Freeing ends what still runs, exactly once. */
    cr_assert_eq(hm_mm_find_group(mm, &c, 5000, on_group, &p2, NULL), 0);
    hm_mm_free(mm);
    cr_assert_eq(p2.calls, 1);
    cr_assert_eq(p2.status, -ECANCELED);
    /* The handlers are gone with it: a new matchmaker can take them. */
    cr_assert_eq(hm_mm_new(n, &mm), 0);
    hm_mm_free(mm);
    hm_node_close(n, NULL, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&loop), 0);
}

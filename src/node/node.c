/*
 * node: one hivemindd node (see node.h). It owns the identity, the rpc layer
 * (and through it the transport), the peer table, the list of bootstrap
 * peers and the ping timer. Everything runs on the loop thread.
 */
#include "config.h"

#include "src/node/node.h"

#include <errno.h>
#include <netinet/in.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "src/base/hmap.h"
#include "src/base/origin.h"
#include "src/base/util.h"
#include "src/base/wire.h"
#include "src/node/reach.h"
#include "dht/record.h"

#define MOD "node"
#define PING_METHOD "node.ping"

typedef struct bootstrap {
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr;
    uint64_t next_try_ms;  /* monotonic */
    uint64_t backoff_ms;
    int pinging;
    unsigned fails;        /* pings unanswered since the last answer */
    uint64_t last_warn_ms; /* monotonic; 0: not warned since the last answer */
} bootstrap;

typedef struct peer {
    hm_hmap_node by_pk; /* in hm_node.by_pk, keyed by info.pk */
    hm_peer_info info;
    int addr_known;          /* a datagram told us its listen address */
    int verified;            /* it answered one of our datagram pings at that address */
    uint64_t first_seen_ms;  /* monotonic */
    hm_origin org;           /* counted in hm_node.origins */
    int ping_dgram_pending;  /* a datagram ping is in flight */
    int ping_stream_pending; /* a stream ping is in flight */
} peer;

struct hm_node {
    uv_loop_t *loop;
    hm_identity id;
    char swarm[65];
    uint8_t swarm_id[HM_SWARM_ID_BYTES];
    hm_rpc *rpc;
    uv_timer_t ping_timer;
    uint64_t started_ms;
    uint64_t ping_interval_ms;
    uint64_t ping_timeout_ms;
    unsigned max_ping_failures;

    /*
     * The peer table: a dense array (removal moves the last entry into the
     * hole) and a keyed map over it, so that the lookup every authenticated
     * message makes costs the same with 4,096 peers as with four, and keys
     * ground to collide do not make it longer.
     */
    peer *peers;
    size_t n_peers, max_peers;
    hm_hmap by_pk;
    /* Peers per network origin (v[0]), so that identities minted on one
     * host cannot take the table: see peer_touch. */
    hm_origin_tab origins;
    size_t max_peers_per_origin;
    unsigned max_stream_pings;
    uint64_t refused_origin, refused_full, evicted;
    uint64_t stream_pings_skipped; /* verified peers past max_stream_pings, per round */
    size_t n_verified;             /* peers with verified set */

    hm_dht *dht;
    uv_timer_t dht_timer;
    uint64_t dht_epoch_ms;  /* wall clock at start, UNIX ms */
    uint64_t mono_epoch_ms; /* monotonic clock at start */
    bootstrap boot[HM_NODE_MAX_INITIAL_PEERS];
    size_t n_boot;

    uint64_t pings_outstanding; /* callbacks still to fire; freed contexts */
    int closing;
    void (*close_cb)(void *ud);
    void *close_ud;
    uint32_t jitter_state;

    /* The declared address and reachability (reach.h). */
    hm_reach *reach;
    int cfg_client_mode;  /* ClientMode from the operator */
    int auto_client_mode; /* nobody reaches us: client mode by ourselves */
    /* Relays (relay.h): serving, and reserving with RelayVia while unreachable. */
    hm_relay *relay;
    int relay_forced;     /* hm_node_relay_set_active(1) */
    uint64_t relay_adv_ms;      /* our last advertisement as a relay (0: none) */
    char relay_adv_addr[HM_ADDRSTRLEN];
    uint64_t relay_find_ms;     /* our last read of the advertised relays */
    int relay_find_inflight;
    struct addr_watch {         /* -- relay failover -- hm_node_watch_address */
        void (*cb)(void *ud);
        void *ud;
    } addr_watch[HM_NODE_ADDR_WATCHERS];
};

typedef struct ping_ctx {
    hm_node *node;
    uint8_t pk[HM_PK_BYTES];
    uint64_t sent_us;
    int via_stream;
    int bootstrap_idx; /* >= 0 for a ping to a bootstrap entry */
} ping_ctx;

static peer *peer_find(hm_node *n, const uint8_t pk[HM_PK_BYTES])
{
    return hm_hmap_entry(hm_hmap_find(&n->by_pk, pk, HM_PK_BYTES), peer, by_pk);
}

static void origin_count(hm_node *n, const hm_origin *o, int delta)
{
    hm_origin_ent *e = hm_origin_tab_get(&n->origins, o, delta > 0);
    if (e == NULL)
        return;
    e->v[0] = delta > 0 ? e->v[0] + 1 : (e->v[0] > 0 ? e->v[0] - 1 : 0);
    hm_origin_tab_release(&n->origins, e);
}

static uint64_t origin_peers(hm_node *n, const hm_origin *o)
{
    hm_origin_ent *e = hm_origin_tab_get(&n->origins, o, 0);
    return e != NULL ? e->v[0] : 0;
}

static void peer_set_verified(hm_node *n, peer *p, int v)
{
    if (p->verified == v)
        return;
    p->verified = v;
    if (v)
        n->n_verified++;
    else
        n->n_verified--;
}

static void peer_remove(hm_node *n, peer *p)
{
    peer *last = &n->peers[n->n_peers - 1];
    if (n->reach != NULL)
        hm_reach_forget(n->reach, p->info.pk);
    peer_set_verified(n, p, 0);
    origin_count(n, &p->org, -1);
    hm_hmap_remove(&n->by_pk, &p->by_pk);
    if (p != last) {
        /* The map points into the entry, so the moved one is filed again. */
        hm_hmap_remove(&n->by_pk, &last->by_pk);
        *p = *last;
        hm_hmap_insert(&n->by_pk, &p->by_pk, p->info.pk, HM_PK_BYTES);
    }
    n->n_peers--;
}

/*
 * The table is full and a newcomer from origin o asks for a place: the
 * heaviest origin gives one up if it holds more than o will, its newest
 * unverified peer first, else its newest one, so that long-lived verified
 * peers stay. Returns 1 when a place was freed. O(peers).
 */
static int peer_evict_for(hm_node *n, const hm_origin *o)
{
    hm_origin_ent *h = hm_origin_tab_heaviest(&n->origins, 0);
    if (h == NULL || hm_origin_eq(&h->o, o) || h->v[0] <= origin_peers(n, o) + 1)
        return 0;
    peer *victim = NULL;
    for (size_t i = 0; i < n->n_peers; i++) {
        peer *p = &n->peers[i];
        if (!hm_origin_eq(&p->org, &h->o))
            continue;
        if (victim == NULL || (!p->verified && victim->verified) ||
            (p->verified == victim->verified && p->first_seen_ms > victim->first_seen_ms))
            victim = p;
    }
    if (victim == NULL)
        return 0;
    hm_debug(MOD, "peer %s evicted: its origin holds the most places", victim->info.peer_id);
    peer_remove(n, victim);
    n->evicted++;
    return 1;
}

/*
 * Adds or refreshes a peer. Identities are free, so places are counted by
 * network origin (src/base/origin.h): an origin holds at most
 * max_peers_per_origin of them, and a full table makes room for a lighter
 * origin at the heaviest one's expense (peer_evict_for); a newcomer from an
 * origin already among the heaviest is turned away, and the peers we know
 * stay.
 */
static peer *peer_touch(hm_node *n, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                        int via_stream)
{
    if (memcmp(pk, n->id.pk, HM_PK_BYTES) == 0)
        return NULL;
    hm_origin o;
    hm_origin_of(from, &o);
    peer *p = peer_find(n, pk);
    if (p == NULL) {
        if (origin_peers(n, &o) >= n->max_peers_per_origin) {
            n->refused_origin++;
            return NULL;
        }
        if (n->n_peers >= n->max_peers && !peer_evict_for(n, &o)) {
            n->refused_full++;
            return NULL;
        }
        if (hm_origin_tab_get(&n->origins, &o, 1) == NULL) {
            n->refused_full++;
            return NULL;
        }
        p = &n->peers[n->n_peers++];
        memset(p, 0, sizeof(*p));
        memcpy(p->info.pk, pk, HM_PK_BYTES);
        hm_peer_id_encode(pk, p->info.peer_id);
        p->info.rtt_ms = -1.0;
        p->first_seen_ms = hm_now_ms();
        p->org = o;
        origin_count(n, &o, 1);
        hm_hmap_insert(&n->by_pk, &p->by_pk, p->info.pk, HM_PK_BYTES);
        char a[HM_ADDRSTRLEN];
        hm_format_addr(from, a, sizeof(a));
        hm_info(MOD, "new peer %s from %s%s", p->info.peer_id, a, via_stream ? " (stream)" : "");
    } else if (from != NULL && !via_stream && !hm_origin_eq(&p->org, &o)) {
        /* A peer that moved is counted at its new origin, if there is room
         * there; otherwise it keeps its old place and address until there is.
         * Only datagrams move it: a stream may come through a relay
         * (src/net/relay.h), from the relay's address, not the peer's. */
        if (origin_peers(n, &o) >= n->max_peers_per_origin ||
            hm_origin_tab_get(&n->origins, &o, 1) == NULL) {
            p->info.last_seen_ms = hm_now_ms();
            return p;
        }
        origin_count(n, &p->org, -1);
        origin_count(n, &o, 1);
        p->org = o;
        peer_set_verified(n, p, 0);
    }
    p->info.last_seen_ms = hm_now_ms();
    p->info.failures = 0;
    /* A stream's source port is ephemeral; only datagrams come from the
     * peer's listening port. */
    if (!via_stream && from != NULL) {
        /* Verified means it answered us at this address. */
        if (p->addr_known && !hm_addr_equal((const struct sockaddr *)&p->info.addr, from))
            peer_set_verified(n, p, 0);
        memcpy(&p->info.addr, from, hm_addr_len(from));
        p->addr_known = 1;
    }
    return p;
}

static void on_seen(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                    int via_stream)
{
    hm_node *n = ud;
    if (n->closing)
        return;
    peer_touch(n, pk, from, via_stream);
}

static void on_ping_request(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                            const struct sockaddr *from, const uint8_t *body, size_t len)
{
    hm_node *n = ud;
    HM_UNUSED(n);
    HM_UNUSED(peer_pk);
    HM_UNUSED(body);
    HM_UNUSED(len);
    /* The reply tells the caller the address we see it at (useful behind NAT)
     * and our clock, for diagnosing skew that would break datagram windows. */
    uint8_t buf[128];
    char addr[HM_ADDRSTRLEN];
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_map(&w, 2);
    hm_wire_wr_cstr(&w, "observed");
    if (from != NULL && hm_format_addr(from, addr, sizeof(addr)) == 0)
        hm_wire_wr_cstr(&w, addr);
    else
        hm_wire_wr_nil(&w);
    hm_wire_wr_cstr(&w, "time_us");
    hm_wire_wr_uint(&w, hm_wall_us());
    if (hm_wire_wr_error(&w) != 0) {
        hm_rpc_respond(req, -EMSGSIZE, NULL, 0);
        return;
    }
    hm_rpc_respond(req, 0, w.buf, w.len);
}

static void maybe_finish_close(hm_node *n);
static void on_reach_mode(void *ud, int client_mode, const char *reason);
static void on_relay_change(void *ud); /* -- relay failover -- */

static int send_ping(hm_node *n, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                     int via_stream, int bootstrap_idx);

static void on_ping_reply(void *ud, int status, const uint8_t *body, size_t len)
{
    ping_ctx *c = ud;
    hm_node *n = c->node;
    n->pings_outstanding--;
    if (n->closing) {
        free(c);
        maybe_finish_close(n);
        return;
    }
    if (c->bootstrap_idx >= 0 && (size_t)c->bootstrap_idx < n->n_boot) {
        bootstrap *b = &n->boot[c->bootstrap_idx];
        b->pinging = 0;
        char id[HM_PEER_ID_LEN + 1];
        hm_peer_id_encode(b->pk, id);
        if (status == 0) {
            b->backoff_ms = n->ping_interval_ms;
            if (b->last_warn_ms != 0)
                hm_info(MOD, "initial peer %s answers now", id);
            b->fails = 0;
            b->last_warn_ms = 0;
        } else {
            hm_debug(MOD, "initial peer %s did not answer: %s", id, hm_strerror(status));
            /*
             * An initial peer that never answers is what a wrong address,
             * a firewall, another swarm name or another swarm key look
             * like from here (datagrams of another swarm fail to open and
             * are dropped without a reply). Say so at the default level,
             * once a minute at most.
             */
            uint64_t now = hm_now_ms();
            if (++b->fails >= 2 && (b->last_warn_ms == 0 || now - b->last_warn_ms >= 60000)) {
                char addr[HM_ADDRSTRLEN];
                if (hm_format_addr((const struct sockaddr *)&b->addr, addr, sizeof(addr)) != 0)
                    hm_strlcpy(addr, "?", sizeof(addr));
                hm_warn(MOD, "initial peer %s at %s has not answered %u pings (%s): check that it "
                        "runs and listens there, that this host can reach it, and that both "
                        "nodes use the swarm '%s' and the same swarm key", id, addr, b->fails,
                        hm_strerror(status), n->swarm);
                b->last_warn_ms = now;
            }
            b->backoff_ms = HM_MIN(b->backoff_ms * 2, 60000u);
        }
        b->next_try_ms = hm_now_ms() + b->backoff_ms;
    }
    peer *p = peer_find(n, c->pk);
    if (p != NULL) {
        if (c->via_stream)
            p->ping_stream_pending = 0;
        else
            p->ping_dgram_pending = 0;
        if (status == 0) {
            double rtt = (double)(hm_now_us() - c->sent_us) / 1000.0;
            /* Datagram pings measure the round trip; stream pings include
             * queueing behind bulk transfers, so they only prove liveness. */
            if (!c->via_stream) {
                p->info.rtt_ms = p->info.rtt_ms < 0 ? rtt : 0.8 * p->info.rtt_ms + 0.2 * rtt;
                int first = !p->verified;
                peer_set_verified(n, p, 1);
                /* Where it saw our datagram come from: a vote for our address. */
                struct sockaddr_storage seen;
                if (p->addr_known && n->reach != NULL &&
                    hm_reach_parse_ping_reply(body, len, &seen) == 0)
                    hm_reach_observed(n->reach, p->info.pk, (const struct sockaddr *)&p->info.addr,
                                      (const struct sockaddr *)&seen);
                /*
                 * A peer verified now gets its first stream ping now, while
                 * the verified peers still fit max_stream_pings, rather than
                 * a ping interval later: the connection is set up when the
                 * peer joins, as before, not in a burst at the next round.
                 */
                if (first && n->n_verified <= n->max_stream_pings && !p->ping_stream_pending &&
                    p->addr_known &&
                    send_ping(n, p->info.pk, (const struct sockaddr *)&p->info.addr, 1, -1) == 0)
                    p->ping_stream_pending = 1;
            }
        } else if (!c->via_stream && (status == -ETIMEDOUT || status == -ECONNREFUSED)) {
            p->info.failures++;
            if (p->info.failures >= n->max_ping_failures) {
                hm_info(MOD, "peer %s dropped after %u missed pings", p->info.peer_id,
                        p->info.failures);
                peer_remove(n, p);
            }
        }
    }
    free(c);
}

static int send_ping(hm_node *n, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                     int via_stream, int bootstrap_idx)
{
    ping_ctx *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return -ENOMEM;
    c->node = n;
    memcpy(c->pk, pk, HM_PK_BYTES);
    c->sent_us = hm_now_us();
    c->via_stream = via_stream;
    c->bootstrap_idx = bootstrap_idx;
    static const uint8_t empty_map = 0x80;
    int r = hm_rpc_call(n->rpc, pk, to, PING_METHOD, &empty_map, 1,
                        via_stream ? HM_RPC_STREAM : HM_RPC_DGRAM, n->ping_timeout_ms,
                        on_ping_reply, c, NULL);
    if (r < 0) {
        free(c);
        return r;
    }
    n->pings_outstanding++;
    return 0;
}

static uint64_t jitter(hm_node *n, uint64_t base_ms)
{
    /* xorshift: timers of many nodes started together must not stay in step. */
    uint32_t x = n->jitter_state;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    n->jitter_state = x;
    uint64_t spread = base_ms / 5; /* +-10% */
    if (spread == 0)
        return base_ms;
    return base_ms - spread / 2 + (x % spread);
}

static void dht_rearm(hm_node *n, uint64_t next_ms);

/*
 * A DHT whose routing table has (nearly) emptied, after a network outage or
 * a long stop of this process, rejoins through the peers the node knows.
 */
static void dht_rejoin_if_lonely(hm_node *n)
{
    if (n->dht == NULL)
        return;
    size_t known = hm_rt_size(hm_dht_routing(n->dht));
    if (known >= 3 || known >= n->n_peers + n->n_boot)
        return;
    uint64_t now = hm_node_dht_now_ms(n);
    for (size_t i = 0; i < n->n_boot; i++)
        hm_dht_bootstrap(n->dht, n->boot[i].pk, (const struct sockaddr *)&n->boot[i].addr, now);
    for (size_t i = 0; i < n->n_peers && i < 16; i++)
        if (n->peers[i].addr_known)
            hm_dht_bootstrap(n->dht, n->peers[i].info.pk,
                             (const struct sockaddr *)&n->peers[i].info.addr, now);
    dht_rearm(n, now);
}

typedef struct ping_rank {
    uint64_t first_seen_ms;
    size_t idx;
} ping_rank;

static int cmp_first_seen(const void *a, const void *b)
{
    const ping_rank *pa = a, *pb = b;
    return (pa->first_seen_ms > pb->first_seen_ms) - (pa->first_seen_ms < pb->first_seen_ms);
}

static void ping_round(hm_node *n)
{
    uint64_t now = hm_now_ms();
    dht_rejoin_if_lonely(n);
    for (size_t i = 0; i < n->n_boot; i++) {
        bootstrap *b = &n->boot[i];
        if (b->pinging || now < b->next_try_ms)
            continue;
        /* A bootstrap peer already in the table is pinged as a peer. */
        if (peer_find(n, b->pk) != NULL) {
            b->next_try_ms = now + n->ping_interval_ms;
            continue;
        }
        if (send_ping(n, b->pk, (const struct sockaddr *)&b->addr, 0, (int)i) == 0)
            b->pinging = 1;
        else
            b->next_try_ms = now + b->backoff_ms;
    }
    /*
     * Every peer gets a datagram ping; a stream ping, which opens a
     * connection, goes only to the max_stream_pings verified peers known
     * longest, so that a table full of fresh identities cannot make us
     * dial every one of them and spend our connections.
     */
    ping_rank *order = malloc(sizeof(*order) * (n->n_peers ? n->n_peers : 1));
    size_t n_order = 0;
    for (size_t i = 0; i < n->n_peers; i++) {
        peer *p = &n->peers[i];
        if (!p->addr_known)
            continue;
        const struct sockaddr *to = (const struct sockaddr *)&p->info.addr;
        if (!p->ping_dgram_pending && send_ping(n, p->info.pk, to, 0, -1) == 0)
            p->ping_dgram_pending = 1;
        if (p->verified && order != NULL)
            order[n_order++] = (ping_rank){p->first_seen_ms, i};
    }
    if (order == NULL)
        return;
    qsort(order, n_order, sizeof(*order), cmp_first_seen);
    if (n_order > n->max_stream_pings)
        n->stream_pings_skipped += n_order - n->max_stream_pings;
    for (size_t j = 0; j < n_order && j < n->max_stream_pings; j++) {
        peer *p = &n->peers[order[j].idx];
        if (!p->ping_stream_pending &&
            send_ping(n, p->info.pk, (const struct sockaddr *)&p->info.addr, 1, -1) == 0)
            p->ping_stream_pending = 1;
    }
    free(order);
}

/*
 * Whether to hold a relay reservation: when told to, or while dial-backs
 * say nobody reaches us; and once holding one, until a dial-back succeeds.
 * Peers leaving can turn "unreachable" into "unknown" (too few origins to
 * judge), which is no reason to give the relay up.
 */
static void relay_sync(hm_node *n)
{
    if (n->relay == NULL || n->reach == NULL || n->cfg_client_mode)
        return;
    hm_reach_status rs;
    hm_reach_get_status(n->reach, &rs);
    int want = n->relay_forced || rs.reachable == HM_REACH_NO ||
               (hm_relay_client_active(n->relay) && rs.reachable != HM_REACH_YES);
    hm_relay_client_set_active(n->relay, want);
}

/*
 * Relays in the DHT: a relay with an address others dial signs a record
 * under RELAY_DHT_KEY, its owner marker as the subkey and its HOST:PORT as
 * the value; a node that needs a relay and has no RelayVia reads them.
 */
#define RELAY_DHT_KEY "hivemindd.relays"
#define RELAY_ADV_TTL_S 300.0
#define RELAY_ADV_EVERY_MS 120000u
#define RELAY_FIND_EVERY_MS 5000u

static void relay_adv_cb(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    hm_node *n = ud;
    HM_UNUSED(stored);
    HM_UNUSED(info);
    if (status < 0 && !n->closing)
        n->relay_adv_ms = 0; /* try again next round */
}

static void relay_advertise(hm_node *n)
{
    hm_relay_status st;
    struct sockaddr_storage ss;
    char a[HM_ADDRSTRLEN], marker[HM_DHT_OWNER_MARKER_LEN + 1];
    hm_relay_get_status(n->relay, &st);
    if (!st.serving || hm_reach_declared(n->reach, &ss) != 0 ||
        hm_format_addr((const struct sockaddr *)&ss, a, sizeof(a)) != 0)
        return;
    uint64_t now = hm_now_ms();
    if (n->relay_adv_ms != 0 && now - n->relay_adv_ms < RELAY_ADV_EVERY_MS &&
        strcmp(a, n->relay_adv_addr) == 0)
        return;
    hm_dht_owner_marker(n->id.pk, marker);
    if (hm_node_dht_put(n, (const uint8_t *)RELAY_DHT_KEY, strlen(RELAY_DHT_KEY),
                        (const uint8_t *)marker, strlen(marker), 1, (const uint8_t *)a, strlen(a),
                        RELAY_ADV_TTL_S, 10000, relay_adv_cb, n) == 0) {
        n->relay_adv_ms = now;
        hm_strlcpy(n->relay_adv_addr, a, sizeof(n->relay_adv_addr));
    }
}

static void relay_found_cb(void *ud, int status, const hm_dht_value *values, size_t nv,
                           const hm_dht_lookup_info *info)
{
    hm_node *n = ud;
    hm_relay_via found[HM_RELAY_MAX_VIA];
    size_t k = 0;
    HM_UNUSED(info);
    n->relay_find_inflight = 0;
    if (n->closing || n->relay == NULL || status < 0)
        return;
    for (size_t i = 0; i < nv && k < HM_RELAY_MAX_VIA; i++) {
        const hm_dht_record *rec = &values[i].rec;
        char a[HM_ADDRSTRLEN];
        /* Signed by its owner, naming a dialable numeric HOST:PORT, and not us. */
        if (!rec->has_subkey || hm_dht_record_verify(rec, n->swarm_id, found[k].pk) != 1 ||
            memcmp(found[k].pk, n->id.pk, HM_PK_BYTES) == 0 || rec->value_len == 0 ||
            rec->value_len >= sizeof(a))
            continue;
        memcpy(a, rec->value, rec->value_len);
        a[rec->value_len] = '\0';
        if (hm_parse_hostport(a, &found[k].addr) != 0 || hm_addr_dialable(&found[k].addr) != 0)
            continue;
        /*
         * One relay per network origin: identities are free, so a host
         * advertising under many keys gets one place of the eight, and a
         * key claiming someone else's address fails its handshake there.
         */
        hm_origin o, p;
        hm_origin_of((const struct sockaddr *)&found[k].addr, &o);
        int dup = 0;
        for (size_t j = 0; j < k && !dup; j++) {
            hm_origin_of((const struct sockaddr *)&found[j].addr, &p);
            dup = hm_origin_eq(&o, &p);
        }
        if (!dup)
            k++;
    }
    if (k > 0 && hm_relay_set_found(n->relay, found, k))
        hm_info(MOD, "found %zu relays advertised in the DHT", k);
}

static void relay_find(hm_node *n)
{
    hm_relay_status st;
    hm_relay_get_status(n->relay, &st);
    uint64_t now = hm_now_ms();
    if (hm_relay_configured(n->relay) || !hm_relay_client_active(n->relay) ||
        st.state != HM_RELAY_NONE || n->relay_find_inflight ||
        (n->relay_find_ms != 0 && now - n->relay_find_ms < RELAY_FIND_EVERY_MS))
        return;
    n->relay_find_ms = now;
    if (hm_node_dht_get(n, (const uint8_t *)RELAY_DHT_KEY, strlen(RELAY_DHT_KEY), 10000,
                        relay_found_cb, n) == 0)
        n->relay_find_inflight = 1;
}

static void on_ping_timer(uv_timer_t *t)
{
    hm_node *n = t->data;
    ping_round(n);
    relay_sync(n);
    if (n->relay != NULL) {
        relay_advertise(n);
        relay_find(n);
    }
    uv_timer_start(&n->ping_timer, on_ping_timer, jitter(n, n->ping_interval_ms), 0);
}

/* ---- DHT glue ---- */

uint64_t hm_node_dht_now_ms(const hm_node *n)
{
    return n->dht_epoch_ms + (hm_now_ms() - n->mono_epoch_ms);
}

static void on_dht_timer(uv_timer_t *t);

static void dht_rearm(hm_node *n, uint64_t next_ms)
{
    if (n->closing || n->dht == NULL)
        return;
    uint64_t now = hm_node_dht_now_ms(n);
    uint64_t wait = next_ms > now ? next_ms - now : 0;
    wait = HM_MAX(HM_MIN(wait, 1000u), 1u);
    uv_timer_start(&n->dht_timer, on_dht_timer, wait, 0);
}

static void on_dht_timer(uv_timer_t *t)
{
    hm_node *n = t->data;
    dht_rearm(n, hm_dht_periodic(n->dht, hm_node_dht_now_ms(n)));
}

static void on_dht_datagram(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                            const uint8_t *body, size_t len)
{
    hm_node *n = ud;
    if (n->closing || n->dht == NULL)
        return;
    uint64_t now = hm_node_dht_now_ms(n);
    hm_dht_input(n->dht, pk, from, body, len, now);
    /* Input may have started requests with earlier deadlines. */
    dht_rearm(n, hm_dht_periodic(n->dht, now));
}

static int dht_send(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                    const uint8_t *msg, size_t len)
{
    hm_node *n = ud;
    return hm_rpc_send_oneway(n->rpc, pk, to, HM_RPC_CHANNEL_DHT, msg, len);
}

static void dht_random(void *ud, void *buf, size_t len)
{
    HM_UNUSED(ud);
    randombytes_buf(buf, len);
}

hm_dht *hm_node_dht(hm_node *n) { return n->dht; }

int hm_node_dht_get(hm_node *n, const uint8_t *key, size_t key_len, uint64_t timeout_ms,
                    hm_dht_get_cb cb, void *ud)
{
    if (n->closing)
        return -ECANCELED;
    uint64_t now = hm_node_dht_now_ms(n);
    int r = hm_dht_get(n->dht, key, key_len, now, timeout_ms, cb, ud, NULL);
    /* The core runs from the timer, so the callback never fires inside
     * this call. */
    if (r == 0)
        dht_rearm(n, now);
    return r;
}

int hm_node_dht_get_many(hm_node *n, const uint8_t *const *keys, const size_t *key_lens,
                         size_t n_keys, uint64_t timeout_ms, hm_dht_get_many_cb cb, void *ud)
{
    if (n->closing)
        return -ECANCELED;
    uint64_t now = hm_node_dht_now_ms(n);
    int r = hm_dht_get_many(n->dht, keys, key_lens, n_keys, now, timeout_ms, cb, ud);
    if (r == 0)
        dht_rearm(n, now);
    return r;
}

int hm_node_dht_put(hm_node *n, const uint8_t *key, size_t key_len, const uint8_t *subkey,
                    size_t subkey_len, int has_subkey, const uint8_t *value, size_t value_len,
                    double ttl_s, uint64_t timeout_ms, hm_dht_put_cb cb, void *ud)
{
    if (n->closing)
        return -ECANCELED;
    uint64_t now = hm_node_dht_now_ms(n);
    double expiration = (double)now / 1000.0 + ttl_s;
    int r = hm_dht_put(n->dht, key, key_len, subkey, subkey_len, has_subkey, value, value_len,
                       expiration, now, timeout_ms, cb, ud, NULL);
    if (r == 0)
        dht_rearm(n, now);
    return r;
}

int hm_node_add_peer(hm_node *n, const char *addr)
{
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage sa;
    if (hm_peer_addr_parse(addr, pk, &sa) != 0)
        return -EINVAL;
    if (memcmp(pk, n->id.pk, HM_PK_BYTES) == 0)
        return -EINVAL;
    size_t i;
    for (i = 0; i < n->n_boot; i++)
        if (memcmp(n->boot[i].pk, pk, HM_PK_BYTES) == 0)
            break;
    if (i == n->n_boot) {
        if (n->n_boot >= HM_NODE_MAX_INITIAL_PEERS)
            return -ENOBUFS;
        n->n_boot++;
    }
    bootstrap *b = &n->boot[i];
    memcpy(b->pk, pk, HM_PK_BYTES);
    memcpy(&b->addr, &sa, sizeof(sa));
    b->backoff_ms = HM_MAX(n->ping_interval_ms / 4, 250u);
    b->next_try_ms = 0;
    if (!b->pinging && send_ping(n, pk, (const struct sockaddr *)&sa, 0, (int)i) == 0)
        b->pinging = 1;
    if (n->dht != NULL) {
        uint64_t now = hm_node_dht_now_ms(n);
        int r = hm_dht_bootstrap(n->dht, pk, (const struct sockaddr *)&sa, now);
        if (r < 0)
            hm_warn(MOD, "DHT bootstrap from %s failed: %s", addr, hm_strerror(r));
        dht_rearm(n, now);
    }
    return 0;
}

/* For the dial-back (reach.h): pk answered our datagram ping at from's IP. */
static int peer_verified_at(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from)
{
    hm_node *n = ud;
    peer *p = peer_find(n, pk);
    if (p == NULL || !p->verified || !p->addr_known)
        return 0;
    struct sockaddr_storage a = p->info.addr, b;
    memcpy(&b, from, hm_addr_len(from));
    /* Ports aside: the request may come from any port of that host. */
    if (a.ss_family == AF_INET && b.ss_family == AF_INET) {
        ((struct sockaddr_in *)&a)->sin_port = ((struct sockaddr_in *)&b)->sin_port;
    } else if (a.ss_family == AF_INET6 && b.ss_family == AF_INET6) {
        ((struct sockaddr_in6 *)&a)->sin6_port = ((struct sockaddr_in6 *)&b)->sin6_port;
    } else {
        return 0;
    }
    return hm_addr_equal((const struct sockaddr *)&a, (const struct sockaddr *)&b);
}

int hm_node_new(uv_loop_t *loop, const hm_node_options *opts, hm_node **out, char *err,
                size_t errlen)
{
    int r;
    hm_node *n = calloc(1, sizeof(*n));
    if (n == NULL) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    n->loop = loop;
    /* Initial peers are checked before anything is started, so that a typo
     * fails cleanly with nothing to tear down. */
    if (opts->n_initial_peers > HM_NODE_MAX_INITIAL_PEERS) {
        snprintf(err, errlen, "at most %d initial peers", HM_NODE_MAX_INITIAL_PEERS);
        free(n);
        return -EINVAL;
    }
    for (size_t i = 0; i < opts->n_initial_peers; i++) {
        uint8_t pk[HM_PK_BYTES];
        struct sockaddr_storage sa;
        if (hm_peer_addr_parse(opts->initial_peers[i], pk, &sa) != 0) {
            snprintf(err, errlen, "bad initial peer '%s': expected PEERID@HOST:PORT",
                     opts->initial_peers[i]);
            free(n);
            return -EINVAL;
        }
    }
    hm_reach_config rcfg = opts->reach;
    if (opts->announce != NULL && opts->announce[0] != '\0') {
        if (hm_parse_hostport(opts->announce, &rcfg.announce) != 0 ||
            hm_addr_dialable(&rcfg.announce) != 0) {
            snprintf(err, errlen,
                     "bad announce address '%s': expected a dialable numeric HOST:PORT (not "
                     "0.0.0.0, ::, or port 0)", opts->announce);
            free(n);
            return -EINVAL;
        }
        rcfg.has_announce = 1;
    }
    rcfg.peer_verified = peer_verified_at;
    rcfg.peer_verified_ud = n;
    n->cfg_client_mode = opts->client_mode;
    n->started_ms = hm_now_ms();
    n->ping_interval_ms = opts->ping_interval_ms ? opts->ping_interval_ms : 15000;
    n->ping_timeout_ms = HM_MAX(HM_MIN(n->ping_interval_ms, 5000u), 500u);
    n->max_ping_failures = opts->max_ping_failures ? opts->max_ping_failures : 4;
    n->max_peers = opts->max_peers ? opts->max_peers : 4096;
    n->max_peers_per_origin = opts->max_peers_per_origin ? opts->max_peers_per_origin : 64;
    n->max_stream_pings = opts->max_stream_pings ? opts->max_stream_pings : 32;
    n->peers = calloc(n->max_peers, sizeof(*n->peers));
    if (n->peers == NULL || hm_hmap_init(&n->by_pk, n->max_peers, n->max_peers) < 0 ||
        hm_origin_tab_init(&n->origins, n->max_peers) < 0) {
        snprintf(err, errlen, "out of memory");
        r = -ENOMEM;
        goto fail;
    }

    r = hm_crypto_init();
    if (r < 0) {
        snprintf(err, errlen, "libsodium failed to initialise");
        goto fail;
    }
    const char *swarm = opts->swarm ? opts->swarm : "default";
    if (strlen(swarm) == 0 || hm_strlcpy(n->swarm, swarm, sizeof(n->swarm)) != 0) {
        snprintf(err, errlen, "swarm name must be 1 to %zu characters", sizeof(n->swarm) - 1);
        r = -EINVAL;
        goto fail;
    }
    hm_swarm_id(n->swarm, opts->swarm_key, opts->swarm_key ? 32 : 0, n->swarm_id);

    if (opts->state_dir != NULL) {
        char path[PATH_MAX];
        if (snprintf(path, sizeof(path), "%s/identity.key", opts->state_dir) >= (int)sizeof(path)) {
            snprintf(err, errlen, "state directory path too long");
            r = -ENAMETOOLONG;
            goto fail;
        }
        r = hm_identity_load_or_create(path, &n->id, err, errlen);
        if (r < 0)
            goto fail;
    } else {
        r = hm_identity_generate(&n->id);
        if (r < 0) {
            snprintf(err, errlen, "cannot generate an identity");
            goto fail;
        }
    }
    n->jitter_state = (uint32_t)n->id.node_id[0] << 24 | (uint32_t)n->id.node_id[1] << 16 |
                      (uint32_t)n->id.node_id[2] << 8 | n->id.node_id[3] | 1u;

    hm_transport_config tcfg = opts->transport;
    tcfg.listen = opts->listen ? opts->listen : "127.0.0.1:0";
    r = hm_rpc_new(loop, &n->id, n->swarm_id, &tcfg, &opts->rpc, &n->rpc);
    if (r < 0) {
        snprintf(err, errlen, "cannot listen on %s: %s", tcfg.listen, hm_strerror(r));
        goto fail;
    }
    hm_rpc_set_seen_cb(n->rpc, on_seen, n);
    r = hm_rpc_register(n->rpc, PING_METHOD, on_ping_request, n);
    if (r < 0) {
        snprintf(err, errlen, "cannot register the ping handler: %s", hm_strerror(r));
        goto fail_rpc;
    }
    r = hm_reach_new(loop, n->rpc, &rcfg, on_reach_mode, n, &n->reach);
    if (r < 0) {
        snprintf(err, errlen, "cannot start the reachability check: %s", hm_strerror(r));
        goto fail_rpc;
    }

    r = hm_relay_new(loop, n->rpc, &n->id, &opts->relay, &n->relay);
    if (r < 0) {
        snprintf(err, errlen, "cannot start the relay: %s", hm_strerror(r));
        goto fail_rpc;
    }
    hm_relay_set_notify(n->relay, on_relay_change, n);

    uv_timer_init(loop, &n->ping_timer);
    n->ping_timer.data = n;
    uv_timer_init(loop, &n->dht_timer);
    n->dht_timer.data = n;
    n->dht_epoch_ms = hm_wall_us() / 1000u;
    n->mono_epoch_ms = hm_now_ms();
    hm_dht_config dcfg = opts->dht;
    dcfg.client_mode = opts->client_mode;
    /* A contact dropped for missing replies is most often a peer that
     * paused or lost its network for a while: a short first ban lets it
     * back soon after it returns, and repeat offenders still back off. */
    if (dcfg.rt.ban_base_ms == 0)
        dcfg.rt.ban_base_ms = 5000;
    hm_dht_io io = {.ud = n, .send = dht_send, .random = dht_random};
    r = hm_dht_new(&n->id, n->swarm_id, &dcfg, &io, hm_node_dht_now_ms(n), &n->dht);
    if (r < 0) {
        snprintf(err, errlen, "cannot start the DHT: %s", hm_strerror(r));
        hm_node_close(n, NULL, NULL);
        return r;
    }
    r = hm_rpc_register_oneway(n->rpc, HM_RPC_CHANNEL_DHT, on_dht_datagram, n);
    if (r < 0) {
        snprintf(err, errlen, "cannot register the DHT channel: %s", hm_strerror(r));
        hm_node_close(n, NULL, NULL);
        return r;
    }
    dht_rearm(n, hm_node_dht_now_ms(n));
    for (size_t i = 0; i < opts->n_initial_peers; i++) {
        /* Our own address among the initial peers (a shared config file)
         * is skipped rather than refused. */
        if (hm_node_add_peer(n, opts->initial_peers[i]) < 0)
            hm_warn(MOD, "initial peer '%s' skipped: it is this node", opts->initial_peers[i]);
    }
    uv_timer_start(&n->ping_timer, on_ping_timer, jitter(n, n->ping_interval_ms), 0);

    char addr[HM_PEER_ID_LEN + HM_ADDRSTRLEN + 2];
    hm_node_address(n, addr, sizeof(addr));
    hm_info(MOD, "node %s in swarm '%s'%s", addr, n->swarm,
            opts->swarm_key ? " (private)" : "");
    hm_reach_status rs;
    hm_reach_get_status(n->reach, &rs);
    if (!rs.declared)
        hm_info(MOD, "declaring no address yet: %s", rs.reason);
    *out = n;
    return 0;

fail_rpc:
    if (n->relay != NULL)
        hm_relay_free(n->relay, NULL, NULL);
    if (n->reach != NULL)
        hm_reach_free(n->reach, NULL, NULL);
    hm_rpc_close(n->rpc, NULL, NULL);
fail:
    hm_identity_wipe(&n->id);
    hm_hmap_free(&n->by_pk);
    hm_origin_tab_free(&n->origins);
    free(n->peers);
    free(n);
    return r;
}

const hm_identity *hm_node_identity(const hm_node *n) { return &n->id; }
const char *hm_node_swarm(const hm_node *n) { return n->swarm; }
uint64_t hm_node_uptime_ms(const hm_node *n) { return hm_now_ms() - n->started_ms; }
hm_rpc *hm_node_rpc(hm_node *n) { return n->rpc; }
uv_loop_t *hm_node_loop(hm_node *n) { return n->loop; }

static void on_reach_mode(void *ud, int client_mode, const char *reason)
{
    hm_node *n = ud;
    n->auto_client_mode = client_mode;
    if (n->cfg_client_mode)
        return;
    /* Unreachable: a relay (RelayVia) keeps us hosting; reachable again: direct. */
    relay_sync(n);
    /* Serving DHT requests needs peers that can send them to us. */
    if (n->dht != NULL)
        hm_dht_set_client_mode(n->dht, client_mode);
    if (client_mode)
        hm_warn(MOD, "client mode: %s", reason);
    else
        hm_info(MOD, "server mode again: %s", reason);
}

/* -- relay failover -- */
static void on_relay_change(void *ud)
{
    hm_node *n = ud;
    /* A copy: a callback may unwatch. */
    struct addr_watch w[HM_NODE_ADDR_WATCHERS];
    memcpy(w, n->addr_watch, sizeof(w));
    for (size_t i = 0; i < HM_NODE_ADDR_WATCHERS && !n->closing; i++)
        if (w[i].cb != NULL)
            w[i].cb(w[i].ud);
}

int hm_node_watch_address(hm_node *n, void (*cb)(void *ud), void *ud)
{
    for (size_t i = 0; i < HM_NODE_ADDR_WATCHERS; i++)
        if (n->addr_watch[i].cb == NULL) {
            n->addr_watch[i].cb = cb;
            n->addr_watch[i].ud = ud;
            return 0;
        }
    return -ENOSPC;
}

void hm_node_unwatch_address(hm_node *n, void (*cb)(void *ud), void *ud)
{
    for (size_t i = 0; i < HM_NODE_ADDR_WATCHERS; i++)
        if (n->addr_watch[i].cb == cb && n->addr_watch[i].ud == ud)
            n->addr_watch[i].cb = NULL;
}

int hm_node_announce(hm_node *n, struct sockaddr_storage *out)
{
    if (n->reach == NULL)
        return -ECANCELED;
    /*
     * Nobody dials us (or the operator said so), but a relay holds a
     * reservation for us: declare the relay.
     */
    if (n->relay != NULL && hm_relay_declared(n->relay, out) == 0)
        return 0;
    return hm_reach_declared(n->reach, out);
}

void hm_node_relay(hm_node *n, hm_relay_status *out)
{
    memset(out, 0, sizeof(*out));
    out->state_name = "off";
    out->via_index = -1;
    if (n->relay != NULL)
        hm_relay_get_status(n->relay, out);
}

void hm_node_relay_set_active(hm_node *n, int active)
{
    if (n->relay == NULL)
        return;
    n->relay_forced = active;
    relay_sync(n);
}

int hm_node_reach(hm_node *n, hm_node_reach_info *out)
{
    memset(out, 0, sizeof(*out));
    if (n->reach == NULL)
        return -ECANCELED;
    hm_reach_status rs;
    hm_reach_get_status(n->reach, &rs);
    out->reachable = rs.reachable;
    hm_strlcpy(out->source, rs.source, sizeof(out->source));
    out->declared = rs.declared;
    out->addr = rs.addr;
    hm_strlcpy(out->reason, rs.reason, sizeof(out->reason));
    out->client_mode = n->cfg_client_mode || n->auto_client_mode;
    out->auto_client_mode = n->auto_client_mode && !n->cfg_client_mode;
    out->dialbacks_ok = rs.dialbacks_ok;
    out->dialbacks_failed = rs.dialbacks_failed;
    out->dialbacks_served = rs.dialbacks_served;
    return 0;
}

int hm_node_address(const hm_node *n, char *buf, size_t len)
{
    struct sockaddr_storage sa;
    char a[HM_ADDRSTRLEN];
    int r = n->reach != NULL ? hm_reach_declared(n->reach, &sa) : -ECANCELED;
    if (r < 0)
        r = hm_transport_local_addr(hm_rpc_transport(n->rpc), &sa);
    if (r < 0)
        return r;
    r = hm_format_addr((const struct sockaddr *)&sa, a, sizeof(a));
    if (r < 0)
        return r;
    int w = snprintf(buf, len, "%s@%s", n->id.peer_id, a);
    return (w < 0 || (size_t)w >= len) ? -EMSGSIZE : 0;
}

int hm_node_peer_get(hm_node *n, const uint8_t pk[HM_PK_BYTES], hm_peer_info *out)
{
    peer *p = peer_find(n, pk);
    if (p == NULL)
        return -ENOENT;
    *out = p->info;
    out->connected = hm_transport_connected(hm_rpc_transport(n->rpc), pk);
    out->verified = p->verified;
    if (!p->addr_known)
        memset(&out->addr, 0, sizeof(out->addr));
    return 0;
}

size_t hm_node_peers(const hm_node *n, hm_peer_info *out, size_t max)
{
    hm_transport *t = hm_rpc_transport(n->rpc);
    for (size_t i = 0; i < n->n_peers && i < max; i++) {
        out[i] = n->peers[i].info;
        out[i].connected = hm_transport_connected(t, n->peers[i].info.pk);
        out[i].verified = n->peers[i].verified;
        if (!n->peers[i].addr_known)
            memset(&out[i].addr, 0, sizeof(out[i].addr));
    }
    return n->n_peers;
}

/* ---- metrics ---- */

static void metric_head(hm_strbuf *b, const char *name, const char *type, const char *help)
{
    hm_strbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void metric_u64(hm_strbuf *b, const char *name, const char *type, const char *help,
                       uint64_t v)
{
    metric_head(b, name, type, help);
    hm_strbuf_printf(b, "%s %llu\n", name, (unsigned long long)v);
}

/* Method names are printable ASCII (the rpc layer checks); quotes and
 * backslashes still need escaping in label values. */
static void label_escape(const char *in, char *out, size_t cap)
{
    size_t o = 0;
    for (; *in && o + 3 < cap; in++) {
        if (*in == '"' || *in == '\\')
            out[o++] = '\\';
        out[o++] = *in;
    }
    out[o] = '\0';
}

typedef struct metrics_pass {
    hm_strbuf *b;
    int which;
} metrics_pass;

static void metrics_method(void *ud, const hm_rpc_method_stats *s)
{
    metrics_pass *mp = ud;
    hm_strbuf *b = mp->b;
    char m[2 * HM_RPC_METHOD_MAX + 4];
    label_escape(s->method, m, sizeof(m));
    if (mp->which == 0) {
        static const char *const results[] = {"ok", "error", "timeout", "cancelled"};
        const uint64_t v[] = {s->ok, s->error, s->timeout, s->cancelled};
        for (size_t i = 0; i < 4; i++)
            hm_strbuf_printf(b, "hivemindd_rpc_calls_total{method=\"%s\",result=\"%s\"} %llu\n",
                             m, results[i], (unsigned long long)v[i]);
    } else if (mp->which == 1) {
        hm_strbuf_printf(b, "hivemindd_rpc_served_total{method=\"%s\"} %llu\n", m,
                         (unsigned long long)s->served);
    } else {
        uint64_t cum = 0;
        for (size_t i = 0; i < HM_RPC_LAT_BUCKETS; i++) {
            cum += s->lat_buckets[i];
            hm_strbuf_printf(b,
                             "hivemindd_rpc_latency_seconds_bucket{method=\"%s\",le=\"%g\"} %llu\n",
                             m, hm_rpc_latency_bounds_s[i], (unsigned long long)cum);
        }
        cum += s->lat_buckets[HM_RPC_LAT_BUCKETS];
        hm_strbuf_printf(b, "hivemindd_rpc_latency_seconds_bucket{method=\"%s\",le=\"+Inf\"} %llu\n",
                         m, (unsigned long long)cum);
        hm_strbuf_printf(b, "hivemindd_rpc_latency_seconds_sum{method=\"%s\"} %.6f\n", m,
                         s->lat_sum_s);
        hm_strbuf_printf(b, "hivemindd_rpc_latency_seconds_count{method=\"%s\"} %llu\n", m,
                         (unsigned long long)cum);
    }
}

char *hm_node_metrics(hm_node *n)
{
    hm_strbuf b = {0};
    hm_transport_stats st;
    hm_transport_get_stats(hm_rpc_transport(n->rpc), &st);

    metric_head(&b, "hivemindd_build_info", "gauge", "Version of this hivemindd.");
    hm_strbuf_printf(&b, "hivemindd_build_info{version=\"%s\"} 1\n", PACKAGE_VERSION);
    metric_head(&b, "hivemindd_uptime_seconds", "gauge", "Seconds since the node started.");
    hm_strbuf_printf(&b, "hivemindd_uptime_seconds %.3f\n",
                     (double)hm_node_uptime_ms(n) / 1000.0);
    metric_u64(&b, "hivemindd_peers", "gauge", "Peers in the peer table.", n->n_peers);
    if (n->reach != NULL) {
        hm_reach_status rs;
        hm_reach_get_status(n->reach, &rs);
        metric_head(&b, "hivemindd_reachable", "gauge",
                    "1: a peer dialled us back; 0: nobody can; -1: not known yet.");
        hm_strbuf_printf(&b, "hivemindd_reachable %d\n",
                         rs.reachable == HM_REACH_YES ? 1 : rs.reachable == HM_REACH_NO ? 0 : -1);
        metric_u64(&b, "hivemindd_announce_declared", "gauge",
                   "1 when the node declares an address others can dial.", (uint64_t)rs.declared);
        metric_head(&b, "hivemindd_dialbacks_total", "counter",
                    "Answers to our dial-back requests, by result.");
        hm_strbuf_printf(&b, "hivemindd_dialbacks_total{result=\"reached\"} %llu\n",
                         (unsigned long long)rs.dialbacks_ok);
        hm_strbuf_printf(&b, "hivemindd_dialbacks_total{result=\"failed\"} %llu\n",
                         (unsigned long long)rs.dialbacks_failed);
        metric_u64(&b, "hivemindd_dialbacks_served_total", "counter",
                   "Dial-back probes this node ran for others.", rs.dialbacks_served);
    }
    /* -- relay metrics -- */
    if (n->relay != NULL) {
        hm_relay_status rl;
        hm_relay_get_status(n->relay, &rl);
        metric_u64(&b, "hivemindd_relay_reserved", "gauge",
                   "1 while a relay holds a reservation for this node (RelayVia).",
                   (uint64_t)(rl.state == HM_RELAY_RESERVED));
        metric_u64(&b, "hivemindd_relay_failovers_total", "counter",
                   "Moves to the next RelayVia relay.", rl.failovers);
        metric_u64(&b, "hivemindd_relay_reservations", "gauge",
                   "Peers this node relays for (Relay yes).", rl.reservations);
        metric_u64(&b, "hivemindd_relay_circuits", "gauge",
                   "Relayed connections open through this node.", rl.circuits);
        metric_u64(&b, "hivemindd_relay_bytes_total", "counter",
                   "Bytes this node copied for relayed connections, both ways.", rl.bytes_relayed);
        metric_u64(&b, "hivemindd_relay_dialler_refused_total", "counter",
                   "Relayed connections refused by the inbound admission rules at this node.",
                   rl.refused_dialler_origin);
        metric_u64(&b, "hivemindd_relay_dialler_not_taken_total", "counter",
                   "Relayed diallers' addresses not believed (relay found in the DHT, or an "
                   "address more local than the relay's): charged to the relay's address.",
                   rl.dialler_not_taken);
    }
    metric_u64(&b, "hivemindd_peers_evicted_total", "counter",
               "Peers of the heaviest origin evicted from a full table for a newcomer.",
               n->evicted);
    metric_u64(&b, "hivemindd_connections", "gauge", "Open stream connections.", st.connections);
    metric_u64(&b, "hivemindd_messages_handed_over_total", "counter",
               "Queued messages moved to the peer's other connection when one closed.",
               st.handed_over);
    metric_u64(&b, "hivemindd_messages_handover_dropped_total", "counter",
               "Queued messages of a closed connection that the other one had no room for.",
               st.handover_dropped);
    metric_u64(&b, "hivemindd_connections_retired_total", "counter",
               "Duplicate connections closed gracefully: writes finished, both sides shut.",
               st.retired);
    metric_u64(&b, "hivemindd_connection_retires_expired_total", "counter",
               "Retired connections whose peer did not finish within 5 s, closed.",
               st.drain_expired);
    metric_u64(&b, "hivemindd_queued_bytes", "gauge", "Bytes queued for sending, all peers.",
               st.queued_bytes);
    metric_u64(&b, "hivemindd_received_bytes_total", "counter",
               "Bytes received on the wire (UDP and TCP).", st.bytes_in);
    metric_u64(&b, "hivemindd_sent_bytes_total", "counter", "Bytes sent on the wire (UDP and TCP).",
               st.bytes_out);
    metric_u64(&b, "hivemindd_datagrams_received_total", "counter",
               "Authenticated datagrams received.", st.dgrams_in);
    metric_u64(&b, "hivemindd_datagrams_sent_total", "counter", "Datagrams sent.", st.dgrams_out);
    metric_u64(&b, "hivemindd_datagrams_rejected_total", "counter",
               "Datagrams rejected (bad MAC, replay, stale, malformed).", st.dgrams_rejected);
    metric_u64(&b, "hivemindd_stream_messages_received_total", "counter",
               "Complete stream messages received.", st.messages_in);
    metric_u64(&b, "hivemindd_stream_messages_sent_total", "counter", "Stream messages sent.",
               st.messages_out);
    metric_head(&b, "hivemindd_handshakes_total", "counter", "Stream handshakes by result.");
    hm_strbuf_printf(&b, "hivemindd_handshakes_total{result=\"ok\"} %llu\n",
                     (unsigned long long)st.handshakes_ok);
    hm_strbuf_printf(&b, "hivemindd_handshakes_total{result=\"failed\"} %llu\n",
                     (unsigned long long)st.handshakes_failed);

    if (n->dht != NULL) {
        hm_dht_stats ds;
        hm_dht_get_stats(n->dht, &ds);
        metric_u64(&b, "hivemindd_dht_routing_table_contacts", "gauge",
                   "Live contacts in the DHT routing table.", ds.rt_size);
        metric_u64(&b, "hivemindd_dht_routing_table_depth", "gauge",
                   "Depth (prefix bits) of the deepest routing-table bucket.", ds.rt_depth);
        metric_u64(&b, "hivemindd_dht_records", "gauge", "Records this node stores for the DHT.",
                   ds.records);
        metric_u64(&b, "hivemindd_dht_record_bytes", "gauge",
                   "Bytes charged to the records this node stores.", ds.record_bytes);
        metric_u64(&b, "hivemindd_dht_lookups_active", "gauge", "DHT lookups in progress.",
                   ds.lookups_active);
        metric_u64(&b, "hivemindd_dht_requests_sent_total", "counter", "DHT requests sent.",
                   ds.requests_sent);
        metric_u64(&b, "hivemindd_dht_requests_received_total", "counter",
                   "DHT requests received.", ds.requests_received);
        metric_u64(&b, "hivemindd_dht_request_timeouts_total", "counter",
                   "DHT requests that got no reply in time.", ds.timeouts);
        metric_u64(&b, "hivemindd_dht_rate_limited_total", "counter",
                   "DHT requests dropped by the per-address rate limit.", ds.rate_limited);
        metric_u64(&b, "hivemindd_dht_store_evicted_total", "counter",
                   "Stored DHT entries of the heaviest origin ended to make room.",
                   ds.store_evicted);
        metric_u64(&b, "hivemindd_dht_bad_messages_total", "counter",
                   "DHT messages that failed to decode or were unexpected.", ds.bad_messages);
        metric_head(&b, "hivemindd_dht_operations_total", "counter",
                    "DHT gets and puts by result.");
        hm_strbuf_printf(&b, "hivemindd_dht_operations_total{op=\"get\",result=\"ok\"} %llu\n",
                         (unsigned long long)ds.gets_ok);
        hm_strbuf_printf(&b, "hivemindd_dht_operations_total{op=\"get\",result=\"failed\"} %llu\n",
                         (unsigned long long)ds.gets_failed);
        hm_strbuf_printf(&b, "hivemindd_dht_operations_total{op=\"put\",result=\"ok\"} %llu\n",
                         (unsigned long long)ds.puts_ok);
        hm_strbuf_printf(&b, "hivemindd_dht_operations_total{op=\"put\",result=\"failed\"} %llu\n",
                         (unsigned long long)ds.puts_failed);
    }

    metrics_pass mp = {&b, 0};
    metric_head(&b, "hivemindd_rpc_calls_total", "counter", "Outbound RPC calls by method and result.");
    hm_rpc_foreach_stats(n->rpc, metrics_method, &mp);
    mp.which = 1;
    metric_head(&b, "hivemindd_rpc_served_total", "counter", "Inbound RPC requests answered.");
    hm_rpc_foreach_stats(n->rpc, metrics_method, &mp);
    mp.which = 2;
    metric_head(&b, "hivemindd_rpc_latency_seconds", "histogram",
                "Latency of successful outbound RPC calls.");
    hm_rpc_foreach_stats(n->rpc, metrics_method, &mp);
    return hm_strbuf_finish(&b);
}

void hm_node_limits(hm_node *n, hm_limit_emit_fn emit, void *ud)
{
    hm_transport_limits(hm_rpc_transport(n->rpc), emit, ud);
    if (n->dht != NULL)
        hm_dht_limits(n->dht, emit, ud);
    emit(ud, "PeerTableOriginCap", n->refused_origin);
    emit(ud, "PeerTableSize", n->refused_full);
    emit(ud, "PingStreamPeers", n->stream_pings_skipped);
    if (n->reach != NULL)
        hm_reach_limits(n->reach, emit, ud);
    if (n->relay != NULL)
        hm_relay_limits(n->relay, emit, ud);
}

/* ---- shutdown ---- */

static void maybe_finish_close(hm_node *n)
{
    /* The rpc layer is gone (its close callback ran) and every ping context
     * has been handed back: only then is the node's memory released. */
    if (n->closing != 2 || n->pings_outstanding > 0)
        return;
    void (*cb)(void *) = n->close_cb;
    void *ud = n->close_ud;
    hm_identity_wipe(&n->id);
    hm_hmap_free(&n->by_pk);
    hm_origin_tab_free(&n->origins);
    free(n->peers);
    free(n);
    if (cb != NULL)
        cb(ud);
}

static void on_timer_closed(uv_handle_t *h)
{
    hm_node *n = h->data;
    n->closing = 2;
    maybe_finish_close(n);
}

static void on_dht_timer_closed(uv_handle_t *h)
{
    hm_node *n = h->data;
    uv_close((uv_handle_t *)&n->ping_timer, on_timer_closed);
}

static void on_reach_freed(void *ud)
{
    hm_node *n = ud;
    uv_close((uv_handle_t *)&n->dht_timer, on_dht_timer_closed);
}

static void on_rpc_closed(void *ud);

static void on_relay_freed(void *ud)
{
    on_rpc_closed(ud);
}

static void on_rpc_closed(void *ud)
{
    hm_node *n = ud;
    n->rpc = NULL;
    /* Every relay call has returned by now: the relay can go, then the rest. */
    if (n->relay != NULL) {
        hm_relay *rl = n->relay;
        n->relay = NULL;
        hm_relay_free(rl, on_relay_freed, n);
        return;
    }
    /* Every dial-back callback has fired by now: the reach state can go. */
    if (n->reach != NULL) {
        hm_reach *r = n->reach;
        n->reach = NULL;
        hm_reach_free(r, on_reach_freed, n);
        return;
    }
    uv_close((uv_handle_t *)&n->dht_timer, on_dht_timer_closed);
}

void hm_node_close(hm_node *n, void (*cb)(void *ud), void *ud)
{
    if (n->closing)
        return;
    n->closing = 1;
    n->close_cb = cb;
    n->close_ud = ud;
    uv_timer_stop(&n->ping_timer);
    uv_timer_stop(&n->dht_timer);
    if (n->reach != NULL)
        hm_reach_stop(n->reach);
    if (n->relay != NULL)
        hm_relay_stop(n->relay);
    hm_info(MOD, "closing node %s", n->id.peer_id);
    /* Pending DHT operations end with -ECANCELED before the transport goes. */
    if (n->dht != NULL) {
        hm_dht_free(n->dht);
        n->dht = NULL;
    }
    hm_rpc_close(n->rpc, on_rpc_closed, n);
}

/*
 * dht_sim: runs thousands of DHT cores (dht/dht.h) in one process on a
 * simulated network with virtual time, and measures what the swarm does:
 * bootstrap time, routing table size and depth, get success, hops,
 * messages and latency per lookup, and memory per node.
 *
 * The cores run unchanged: each honest node is an hm_dht whose send
 * function puts the datagram into this program's event queue, to be
 * delivered to the destination core after the configured latency (plus
 * jitter) unless it is lost, or the destination is dead. There are no
 * sockets, no threads and no wall clock: a binary min-heap of events
 * ordered by (virtual time, insertion number) drives everything, and every
 * random choice (identities, network loss and delay, the workload, the
 * cores' own random bytes) comes from seeded generators, so a run is a
 * pure function of its options.
 *
 * Malicious nodes are not cores. They answer PING, claim to have stored
 * every STORE, never return a value, and answer FIND_NODE and GET with
 * contacts of other malicious nodes (the ones closest to the target, so
 * that a lookup that trusts them is led into a colluding cluster), or with
 * contacts that do not exist (--malicious-mode random). They join like
 * everyone else, by asking their way towards their own id, so honest
 * nodes put them in their routing tables.
 *
 * Addresses: node i listens on port PORT_BASE + i, which is how the
 * simulated network routes a datagram; by default on 10.x.y.z (a private
 * range, exempt from the routing table's subnet limits), with --public on
 * a public-looking address in its own /24 (malicious nodes packed 16 to a
 * /24, as cheap Sybils would be), so that the subnet limits take part.
 *
 * See docs/dht-simulation.md for how to run it and what the figures mean.
 * The program owns all of its state through one `sim` object; it exits 0
 * when the run completed (whatever the figures), 64 on a usage error and
 * 1 when the simulation could not run.
 */
#include "config.h"

#include "dht/dht.h"
#include "dht/proto.h"
#include "src/base/util.h"

#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <malloc.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PORT_BASE 1024u
#define MAX_NODES (65535u - PORT_BASE)
/* The DHT clock is UNIX time: virtual time starts at a fixed instant. */
#define T0_MS UINT64_C(1700000000000)
#define SAMPLE_MS 1000u
#define SETTLE_WINDOW 10u
/* A malicious node stops asking its way in after this many requests. */
#define MAL_JOIN_QUERIES 48u
/* Requests a malicious node sends carry a pad so that replies come whole. */
#define MAL_PAD_TO 1000u
#define VALUE_MIN 16u
#define VALUE_MAX 200u
#define KEY_MAX 48u

/* ---------------------------------------------------------------- PRNG */

/* xoshiro256** seeded through splitmix64 (Blackman and Vigna). */
typedef struct rng {
    uint64_t s[4];
} rng;

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Separate streams keep, say, the workload the same when only the network's
 * randomness changes (another loss rate draws differently). */
static void rng_seed(rng *r, uint64_t seed, uint64_t stream)
{
    uint64_t x = seed ^ (stream * 0xd1342543de82ef95ull);
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&x);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t rng_next(rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

static double rng_unit(rng *r)
{
    return (double)(rng_next(r) >> 11) * 0x1.0p-53;
}

/* Uniform in [0, n); n > 0. Lemire's multiply-shift, bias below 2^-32 for our n. */
static uint64_t rng_below(rng *r, uint64_t n)
{
    return (uint64_t)(((unsigned __int128)rng_next(r) * n) >> 64);
}

static void rng_fill(rng *r, void *buf, size_t len)
{
    uint8_t *p = buf;
    while (len > 0) {
        uint64_t v = rng_next(r);
        size_t n = len < 8 ? len : 8;
        memcpy(p, &v, n);
        p += n;
        len -= n;
    }
}

/* ------------------------------------------------------------- options */

enum { MAL_CLOSEST = 0, MAL_RANDOM = 1 };

typedef struct sim_opts {
    unsigned nodes;
    double churn;
    double loss;
    uint64_t latency_ms;
    uint64_t jitter_ms;
    double malicious;
    int mal_mode;
    uint64_t seed;
    unsigned lookups;
    unsigned disjoint;
    unsigned k;
    unsigned alpha;
    unsigned bootstrap_peers;
    uint64_t join_interval_ms;
    uint64_t op_interval_ms;
    uint64_t op_timeout_ms;
    uint64_t max_settle_ms;
    uint64_t churn_delay_ms;
    int public_addrs;
    int baseline;
    int verbose;
} sim_opts;

/* ---------------------------------------------------------------- state */

enum { NODE_HONEST = 0, NODE_MALICIOUS = 1 };

typedef struct sim sim;

typedef struct sim_node {
    sim *s;
    uint32_t index;
    uint8_t kind;
    uint8_t alive;
    uint8_t joined;
    uint8_t join_pending;
    hm_identity id;
    struct sockaddr_in addr;
    hm_dht *dht;          /* honest nodes only */
    uint64_t wake_at;     /* the pending wakeup event's time; UINT64_MAX when none */
    uint64_t join_start_ms;
    size_t join_target;
    /* Malicious nodes: the peers already asked while joining, and tids. */
    uint32_t m_tid;
    uint32_t m_nasked;
    uint32_t m_asked[MAL_JOIN_QUERIES];
} sim_node;

enum { EV_DELIVER, EV_WAKE, EV_JOIN, EV_PUT, EV_GET, EV_SAMPLE };

typedef struct sim_event {
    uint64_t t;
    uint64_t seq; /* insertion order: equal times run first come, first served */
    uint32_t type;
    uint32_t node; /* destination, or the node concerned */
    uint32_t src;  /* sender of a delivery; op index for EV_PUT / EV_GET */
    uint32_t len;
    uint8_t *data;
} sim_event;

typedef struct sim_op {
    sim *s;
    uint32_t putter, getter;
    uint8_t key[KEY_MAX];
    size_t key_len;
    uint8_t value[VALUE_MAX];
    size_t value_len;
    int put_done, put_status;
    unsigned stored;
    hm_dht_lookup_info put_info;
    int get_started, get_done, get_status;
    int get_outcome; /* GET_* below */
    uint64_t get_start_ms, get_end_ms;
    hm_dht_lookup_info get_info;
} sim_op;

enum { GET_OK = 0, GET_ERROR, GET_NOT_FOUND, GET_WRONG_VALUE };

struct sim {
    sim_opts o;
    uint64_t now;
    uint64_t seq;
    rng r_ident, r_net, r_node, r_work;
    uint8_t swarm_id[HM_SWARM_ID_BYTES];

    sim_node *nodes;
    unsigned n_nodes, n_malicious;
    uint32_t *mal; /* indices of the malicious nodes */

    sim_event *heap;
    size_t heap_len, heap_cap;
    size_t payload_bytes; /* bytes of datagrams in flight */

    sim_op *ops;
    unsigned puts_done, gets_done;

    /* Join and settling. */
    unsigned n_joined;
    uint64_t last_join_ms;
    uint64_t settled_ms;
    int settled;
    uint64_t sample_sum[SETTLE_WINDOW];
    unsigned n_samples;
    uint64_t *join_ms;
    unsigned n_join_ms;

    /* Network counters. */
    uint64_t dgrams_sent, dgrams_lost, dgrams_dead, dgrams_unroutable, dgrams_delivered;
    uint64_t bytes_sent;
    uint64_t mal_requests_answered;

    hm_dht_msg scratch; /* for the malicious nodes (large: keep it off the stack) */
};

/* --------------------------------------------------------- event queue */

static int ev_less(const sim_event *a, const sim_event *b)
{
    return a->t < b->t || (a->t == b->t && a->seq < b->seq);
}

static int heap_push(sim *s, sim_event ev)
{
    if (s->heap_len == s->heap_cap) {
        size_t cap = s->heap_cap ? s->heap_cap * 2 : 4096;
        sim_event *h = realloc(s->heap, cap * sizeof(*h));
        if (!h)
            return -ENOMEM;
        s->heap = h;
        s->heap_cap = cap;
    }
    ev.seq = s->seq++;
    size_t i = s->heap_len++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!ev_less(&ev, &s->heap[p]))
            break;
        s->heap[i] = s->heap[p];
        i = p;
    }
    s->heap[i] = ev;
    return 0;
}

static sim_event heap_pop(sim *s)
{
    sim_event top = s->heap[0];
    sim_event last = s->heap[--s->heap_len];
    size_t i = 0, n = s->heap_len;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && ev_less(&s->heap[c + 1], &s->heap[c]))
            c++;
        if (!ev_less(&s->heap[c], &last))
            break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n > 0)
        s->heap[i] = last;
    return top;
}

static void schedule(sim *s, uint64_t t, uint32_t type, uint32_t node, uint32_t arg)
{
    sim_event ev = {.t = t, .type = type, .node = node, .src = arg};
    if (heap_push(s, ev) < 0) {
        fprintf(stderr, "dht_sim: out of memory for the event queue\n");
        exit(1);
    }
}

/* ------------------------------------------------------------- network */

static sim_node *node_by_addr(sim *s, const struct sockaddr *to, const uint8_t pk[HM_PK_BYTES])
{
    if (to->sa_family != AF_INET)
        return NULL;
    const struct sockaddr_in *a = (const struct sockaddr_in *)to;
    unsigned port = ntohs(a->sin_port);
    if (port < PORT_BASE || port - PORT_BASE >= s->n_nodes)
        return NULL;
    sim_node *n = &s->nodes[port - PORT_BASE];
    /* The real transport authenticates every datagram to the key the
     * sender expects, so a wrong key at a right address goes nowhere. */
    if (n->addr.sin_addr.s_addr != a->sin_addr.s_addr || memcmp(n->id.pk, pk, HM_PK_BYTES) != 0)
        return NULL;
    return n;
}

static int net_send(sim *s, sim_node *from, const uint8_t pk[HM_PK_BYTES],
                    const struct sockaddr *to, const uint8_t *msg, size_t len)
{
    if (len > HM_DHT_PROTO_MAX_SIZE)
        return -EMSGSIZE;
    if (!from->alive)
        return 0;
    s->dgrams_sent++;
    s->bytes_sent += len;
    sim_node *dst = node_by_addr(s, to, pk);
    if (!dst) {
        s->dgrams_unroutable++;
        return 0;
    }
    if (s->o.loss > 0 && rng_unit(&s->r_net) < s->o.loss) {
        s->dgrams_lost++;
        return 0;
    }
    uint64_t delay = s->o.latency_ms;
    if (s->o.jitter_ms > 0)
        delay += rng_below(&s->r_net, s->o.jitter_ms + 1);
    if (delay == 0)
        delay = 1;
    uint8_t *copy = malloc(len ? len : 1);
    if (!copy)
        return -ENOMEM;
    memcpy(copy, msg, len);
    sim_event ev = {.t = s->now + delay,
                    .type = EV_DELIVER,
                    .node = dst->index,
                    .src = from->index,
                    .len = (uint32_t)len,
                    .data = copy};
    if (heap_push(s, ev) < 0) {
        free(copy);
        return -ENOMEM;
    }
    s->payload_bytes += len;
    return 0;
}

static int io_send(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                   const uint8_t *msg, size_t len)
{
    sim_node *n = ud;
    return net_send(n->s, n, pk, to, msg, len);
}

static void io_random(void *ud, void *buf, size_t len)
{
    sim_node *n = ud;
    rng_fill(&n->s->r_node, buf, len);
}

/* ------------------------------------------------------ honest nodes */

/*
 * Gives the core its turn: hm_dht_periodic runs what is due and names the
 * next time it wants to be called, which becomes this node's one pending
 * wakeup. Called after every event that reached the core (a datagram, a
 * bootstrap, a get or put), because such an event can start a request
 * whose timeout falls before the previously announced deadline.
 */
static void node_turn(sim *s, sim_node *n)
{
    uint64_t next = hm_dht_periodic(n->dht, s->now);
    if (next <= s->now)
        next = s->now + 1;
    if (next != n->wake_at) {
        n->wake_at = next;
        schedule(s, next, EV_WAKE, n->index, 0);
    }
}

static void join_check(sim *s, sim_node *n)
{
    if (!n->join_pending)
        return;
    if (hm_rt_size(hm_dht_routing(n->dht)) >= n->join_target) {
        n->join_pending = 0;
        s->join_ms[s->n_join_ms++] = s->now - n->join_start_ms;
    }
}

/* --------------------------------------------------- malicious nodes */

static void mal_send(sim *s, sim_node *m, const sim_node *to, const hm_dht_msg *msg, size_t pad)
{
    uint8_t buf[HM_DHT_PROTO_MAX_SIZE];
    size_t len = 0;
    if (hm_dht_msg_encode(msg, pad, buf, sizeof(buf), &len) < 0)
        return;
    net_send(s, m, to->id.pk, (const struct sockaddr *)&to->addr, buf, len);
}

static void mal_ask(sim *s, sim_node *m, const sim_node *to)
{
    if (m->m_nasked >= MAL_JOIN_QUERIES || to == m)
        return;
    for (uint32_t i = 0; i < m->m_nasked; i++)
        if (m->m_asked[i] == to->index)
            return;
    m->m_asked[m->m_nasked++] = to->index;
    hm_dht_msg *q = &s->scratch;
    memset(q, 0, sizeof(*q));
    q->type = HM_DHT_MSG_FIND_NODE;
    q->tid = ++m->m_tid;
    memcpy(q->target, m->id.node_id, HM_RT_ID_BYTES);
    mal_send(s, m, to, q, MAL_PAD_TO);
}

static void contact_of(const sim_node *n, hm_rt_contact *c)
{
    memset(c, 0, sizeof(*c));
    memcpy(c->id, n->id.node_id, HM_RT_ID_BYTES);
    memcpy(c->pk, n->id.pk, HM_PK_BYTES);
    memcpy(&c->addr, &n->addr, sizeof(n->addr));
}

/*
 * The colluding answer: the joined, live malicious nodes closest to target
 * (other than the one answering and the one asking), at most k.
 */
static size_t mal_contacts(sim *s, const sim_node *self, const sim_node *asker,
                           const uint8_t target[HM_RT_ID_BYTES], hm_rt_contact *out, size_t cap)
{
    size_t n = 0;
    if (s->o.mal_mode == MAL_RANDOM) {
        for (n = 0; n < cap; n++) {
            hm_rt_contact *c = &out[n];
            memset(c, 0, sizeof(*c));
            rng_fill(&s->r_net, c->pk, HM_PK_BYTES);
            hm_node_id_from_pk(c->pk, c->id);
            struct sockaddr_in *a = (struct sockaddr_in *)&c->addr;
            a->sin_family = AF_INET;
            a->sin_addr.s_addr = htonl(0x0afe0000u | (uint32_t)rng_below(&s->r_net, 65536));
            /* A port no simulated node listens on. */
            a->sin_port = htons((uint16_t)(PORT_BASE + s->n_nodes + rng_below(&s->r_net, 1000)));
        }
        return n;
    }
    const sim_node *best[HM_DHT_PROTO_MAX_CONTACTS];
    for (unsigned i = 0; i < s->n_malicious; i++) {
        const sim_node *c = &s->nodes[s->mal[i]];
        if (c == self || c == asker || !c->joined || !c->alive)
            continue;
        /* Insertion into a sorted array of at most cap: cap is small. */
        size_t j = n < cap ? n++ : cap;
        while (j > 0 && hm_rt_distance_cmp(target, c->id.node_id, best[j - 1]->id.node_id) < 0) {
            if (j < cap)
                best[j] = best[j - 1];
            j--;
        }
        if (j < cap)
            best[j] = c;
    }
    for (size_t i = 0; i < n; i++)
        contact_of(best[i], &out[i]);
    return n;
}

static void mal_input(sim *s, sim_node *m, sim_node *from, const uint8_t *data, size_t len)
{
    hm_dht_msg *msg = &s->scratch;
    if (hm_dht_msg_decode(data, len, msg) < 0)
        return;
    if (!hm_dht_msg_is_request(msg->type)) {
        /* Replies to our own join: ask our way towards our own id. */
        if (msg->type == HM_DHT_MSG_NODES || msg->type == HM_DHT_MSG_VALUE) {
            size_t nc = msg->n_contacts;
            uint32_t idx[HM_DHT_PROTO_MAX_CONTACTS];
            size_t ni = 0;
            for (size_t i = 0; i < nc; i++) {
                sim_node *c = node_by_addr(s, (const struct sockaddr *)&msg->contacts[i].addr,
                                           msg->contacts[i].pk);
                if (c)
                    idx[ni++] = c->index;
            }
            for (size_t i = 0; i < ni; i++)
                mal_ask(s, m, &s->nodes[idx[i]]);
        }
        return;
    }
    int type = msg->type;
    uint32_t tid = msg->tid;
    uint8_t target[HM_RT_ID_BYTES];
    memcpy(target, msg->target, sizeof(target));
    hm_dht_msg *r = msg;
    memset(r, 0, sizeof(*r));
    uint8_t token[HM_DHT_TOKEN_BYTES];
    rng_fill(&s->r_net, token, sizeof(token));
    r->type = type + HM_DHT_MSG_REPLY;
    r->tid = tid;
    r->token = token;
    r->token_len = sizeof(token);
    size_t k = s->o.k < HM_DHT_PROTO_MAX_CONTACTS ? s->o.k : HM_DHT_PROTO_MAX_CONTACTS;
    switch (type) {
    case HM_DHT_MSG_FIND_NODE:
    case HM_DHT_MSG_GET:
        r->n_contacts = mal_contacts(s, m, from, target, r->contacts, k);
        break;
    case HM_DHT_MSG_STORE:
        r->status = 0; /* claims it stored the record, and drops it */
        break;
    default:
        break;
    }
    s->mal_requests_answered++;
    mal_send(s, m, from, r, 0);
}

/* ----------------------------------------------------------- workload */

static void put_cb(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    sim_op *op = ud;
    if (op->put_done)
        return;
    op->put_done = 1;
    op->put_status = status;
    op->stored = stored;
    if (info)
        op->put_info = *info;
    op->s->puts_done++;
}

static void get_cb(void *ud, int status, const hm_dht_value *values, size_t n,
                   const hm_dht_lookup_info *info)
{
    sim_op *op = ud;
    if (op->get_done)
        return;
    op->get_done = 1;
    op->get_status = status;
    op->get_end_ms = op->s->now;
    if (info)
        op->get_info = *info;
    if (status < 0)
        op->get_outcome = GET_ERROR;
    else if (n == 0)
        op->get_outcome = GET_NOT_FOUND;
    else if (values[0].rec.value_len == op->value_len &&
             memcmp(values[0].rec.value, op->value, op->value_len) == 0 &&
             !values[0].rec.has_subkey)
        op->get_outcome = GET_OK;
    else
        op->get_outcome = GET_WRONG_VALUE;
    op->s->gets_done++;
}

static uint32_t random_live_honest(sim *s, uint32_t not_this)
{
    for (;;) {
        uint32_t i = (uint32_t)rng_below(&s->r_work, s->n_nodes);
        const sim_node *n = &s->nodes[i];
        if (n->kind == NODE_HONEST && n->alive && n->joined && i != not_this)
            return i;
    }
}

static void start_put(sim *s, uint32_t opi)
{
    sim_op *op = &s->ops[opi];
    op->putter = random_live_honest(s, UINT32_MAX);
    sim_node *n = &s->nodes[op->putter];
    double exp = (double)(s->now / 1000) + 3600.0;
    int rc = hm_dht_put(n->dht, op->key, op->key_len, NULL, 0, 0, op->value, op->value_len, exp,
                        s->now, s->o.op_timeout_ms, put_cb, op, NULL);
    if (rc < 0) {
        op->put_done = 1;
        op->put_status = rc;
        s->puts_done++;
    }
    node_turn(s, n);
}

static void start_get(sim *s, uint32_t opi)
{
    sim_op *op = &s->ops[opi];
    op->getter = random_live_honest(s, op->putter);
    sim_node *n = &s->nodes[op->getter];
    op->get_started = 1;
    op->get_start_ms = s->now;
    int rc = hm_dht_get(n->dht, op->key, op->key_len, s->now, s->o.op_timeout_ms, get_cb, op, NULL);
    if (rc < 0) {
        op->get_done = 1;
        op->get_status = rc;
        op->get_outcome = GET_ERROR;
        op->get_end_ms = s->now;
        s->gets_done++;
    }
    node_turn(s, n);
}

/* ------------------------------------------------------------- joining */

static void do_join(sim *s, sim_node *n)
{
    n->joined = 1;
    s->n_joined++;
    s->last_join_ms = s->now;
    if (n->index == 0)
        return; /* the first node has nobody to ask */
    /* Bootstrap peers: distinct random nodes among those already joined
     * (nodes join in index order). */
    uint32_t peers[16];
    unsigned want = s->o.bootstrap_peers < n->index ? s->o.bootstrap_peers : n->index;
    if (want > 16)
        want = 16;
    unsigned np = 0;
    while (np < want) {
        uint32_t p = (uint32_t)rng_below(&s->r_work, n->index);
        int dup = 0;
        for (unsigned j = 0; j < np; j++)
            dup |= peers[j] == p;
        if (!dup)
            peers[np++] = p;
    }
    if (n->kind == NODE_MALICIOUS) {
        for (unsigned j = 0; j < np; j++)
            mal_ask(s, n, &s->nodes[peers[j]]);
        return;
    }
    n->join_start_ms = s->now;
    n->join_target = n->index < s->o.k ? n->index : s->o.k;
    n->join_pending = 1;
    for (unsigned j = 0; j < np; j++) {
        const sim_node *p = &s->nodes[peers[j]];
        int rc = hm_dht_bootstrap(n->dht, p->id.pk, (const struct sockaddr *)&p->addr, s->now);
        if (rc < 0 && s->o.verbose)
            fprintf(stderr, "dht_sim: node %u: bootstrap: %s\n", n->index, hm_strerror(rc));
    }
    node_turn(s, n);
}

/*
 * Once a second of virtual time: has the swarm settled? It has when every
 * node has joined, the last join is SETTLE_WINDOW seconds old, and the
 * total size of the routing tables grew by less than 0.2% over that window.
 */
static void sample(sim *s)
{
    uint64_t sum = 0;
    for (unsigned i = 0; i < s->n_nodes; i++) {
        const sim_node *n = &s->nodes[i];
        if (n->kind == NODE_HONEST && n->joined && n->alive)
            sum += hm_rt_size(hm_dht_routing(n->dht));
    }
    uint64_t old = s->sample_sum[s->n_samples % SETTLE_WINDOW];
    s->sample_sum[s->n_samples % SETTLE_WINDOW] = sum;
    s->n_samples++;
    if (s->settled || s->n_joined < s->n_nodes)
        return;
    uint64_t since = s->now - s->last_join_ms;
    if (since >= SETTLE_WINDOW * SAMPLE_MS && s->n_samples > SETTLE_WINDOW &&
        (sum - (old < sum ? old : sum)) * 500 <= sum) {
        s->settled = 1;
        s->settled_ms = s->now;
    } else if (since >= s->o.max_settle_ms) {
        s->settled = 1;
        s->settled_ms = s->now;
        fprintf(stderr, "dht_sim: routing tables still growing after %" PRIu64 " ms; going on\n",
                s->o.max_settle_ms);
    }
}

/* ---------------------------------------------------------------- loop */

static void dispatch(sim *s, sim_event *ev)
{
    sim_node *n = &s->nodes[ev->node];
    switch (ev->type) {
    case EV_DELIVER: {
        s->payload_bytes -= ev->len;
        if (!n->alive) {
            s->dgrams_dead++;
            break;
        }
        s->dgrams_delivered++;
        sim_node *from = &s->nodes[ev->src];
        if (n->kind == NODE_MALICIOUS) {
            mal_input(s, n, from, ev->data, ev->len);
        } else {
            hm_dht_input(n->dht, from->id.pk, (const struct sockaddr *)&from->addr, ev->data,
                         ev->len, s->now);
            join_check(s, n);
            node_turn(s, n);
        }
        break;
    }
    case EV_WAKE:
        /* Only the latest wakeup of a node counts; earlier ones are stale. */
        if (!n->alive || n->kind != NODE_HONEST || n->wake_at != ev->t)
            break;
        n->wake_at = UINT64_MAX;
        node_turn(s, n);
        join_check(s, n);
        break;
    case EV_JOIN:
        do_join(s, n);
        break;
    case EV_PUT:
        start_put(s, ev->src);
        break;
    case EV_GET:
        start_get(s, ev->src);
        break;
    case EV_SAMPLE:
        sample(s);
        if (!s->settled)
            schedule(s, s->now + SAMPLE_MS, EV_SAMPLE, 0, 0);
        break;
    }
    free(ev->data);
}

/* Runs events until done(s), the queue empties, or virtual time passes until. */
static void run(sim *s, int (*done)(const sim *), uint64_t until)
{
    while (s->heap_len > 0 && !done(s)) {
        if (s->heap[0].t > until)
            break;
        sim_event ev = heap_pop(s);
        s->now = ev.t;
        dispatch(s, &ev);
    }
}

static int is_settled(const sim *s)
{
    return s->settled;
}

static int puts_finished(const sim *s)
{
    return s->puts_done >= s->o.lookups;
}

static int gets_finished(const sim *s)
{
    return s->gets_done >= s->o.lookups;
}

static int never(const sim *s)
{
    (void)s;
    return 0;
}

/* ------------------------------------------------------------ figures */

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of a sorted array. */
static uint64_t pct(const uint64_t *v, size_t n, double p)
{
    if (n == 0)
        return 0;
    size_t r = (size_t)ceil(p / 100.0 * (double)n);
    if (r < 1)
        r = 1;
    if (r > n)
        r = n;
    return v[r - 1];
}

static double mean(const uint64_t *v, size_t n)
{
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += (double)v[i];
    return n ? sum / (double)n : 0;
}

static size_t heap_bytes(void)
{
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
}

static double wall_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---------------------------------------------------------------- main */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: dht_sim [--nodes N] [--churn FRAC] [--loss FRAC] [--latency MS[:JITTER]]\n"
            "               [--malicious FRAC] [--malicious-mode closest|random] [--seed S]\n"
            "               [--lookups L] [--disjoint-paths D] [--k K] [--alpha A]\n"
            "               [--bootstrap-peers B] [--join-interval MS] [--op-interval MS]\n"
            "               [--op-timeout MS] [--max-settle MS] [--churn-delay MS]\n"
            "               [--public] [--baseline] [--verbose]\n"
            "Simulates N DHT nodes on a virtual network and prints what the swarm did.\n");
}

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-')
        return -EINVAL;
    *out = v;
    return 0;
}

static int parse_frac(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= 0.0 && v <= 1.0))
        return -EINVAL;
    *out = v;
    return 0;
}

static int parse_latency(const char *s, uint64_t *lat, uint64_t *jit)
{
    char buf[64];
    if (hm_strlcpy(buf, s, sizeof(buf)) < 0)
        return -EINVAL;
    char *colon = strchr(buf, ':');
    *jit = 0;
    if (colon) {
        *colon = 0;
        if (parse_u64(colon + 1, jit) < 0 || *jit > 600000)
            return -EINVAL;
    }
    if (parse_u64(buf, lat) < 0 || *lat > 600000)
        return -EINVAL;
    return 0;
}

static int parse_opts(int argc, char **argv, sim_opts *o)
{
    enum {
        O_NODES = 256, O_CHURN, O_LOSS, O_LATENCY, O_MAL, O_MALMODE, O_SEED, O_LOOKUPS, O_DISJ,
        O_K, O_ALPHA, O_BOOT, O_JOINIV, O_OPIV, O_OPTO, O_SETTLE, O_CHURNDELAY, O_PUBLIC, O_BASELINE, O_VERB,
        O_HELP
    };
    static const struct option lo[] = {
        {"nodes", required_argument, 0, O_NODES},
        {"churn", required_argument, 0, O_CHURN},
        {"loss", required_argument, 0, O_LOSS},
        {"latency", required_argument, 0, O_LATENCY},
        {"malicious", required_argument, 0, O_MAL},
        {"malicious-mode", required_argument, 0, O_MALMODE},
        {"seed", required_argument, 0, O_SEED},
        {"lookups", required_argument, 0, O_LOOKUPS},
        {"disjoint-paths", required_argument, 0, O_DISJ},
        {"k", required_argument, 0, O_K},
        {"alpha", required_argument, 0, O_ALPHA},
        {"bootstrap-peers", required_argument, 0, O_BOOT},
        {"join-interval", required_argument, 0, O_JOINIV},
        {"op-interval", required_argument, 0, O_OPIV},
        {"op-timeout", required_argument, 0, O_OPTO},
        {"max-settle", required_argument, 0, O_SETTLE},
        {"churn-delay", required_argument, 0, O_CHURNDELAY},
        {"public", no_argument, 0, O_PUBLIC},
        {"baseline", no_argument, 0, O_BASELINE},
        {"verbose", no_argument, 0, O_VERB},
        {"help", no_argument, 0, O_HELP},
        {0, 0, 0, 0},
    };
    *o = (sim_opts){
        .nodes = 1000,
        .latency_ms = 50,
        .jitter_ms = 20,
        .seed = 1,
        .lookups = 1000,
        .disjoint = 1,
        .k = 20,
        .alpha = 3,
        .bootstrap_peers = 3,
        .join_interval_ms = 20,
        .op_interval_ms = 5,
        .op_timeout_ms = 30000,
        .max_settle_ms = 600000,
    };
    int c;
    uint64_t v;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        int bad = 0;
        switch (c) {
        case O_NODES:
            bad = parse_u64(optarg, &v) < 0 || v < 2 || v > MAX_NODES;
            o->nodes = (unsigned)v;
            break;
        case O_CHURN:
            bad = parse_frac(optarg, &o->churn) < 0 || o->churn >= 1.0;
            break;
        case O_LOSS:
            bad = parse_frac(optarg, &o->loss) < 0 || o->loss >= 1.0;
            break;
        case O_LATENCY:
            bad = parse_latency(optarg, &o->latency_ms, &o->jitter_ms) < 0;
            break;
        case O_MAL:
            bad = parse_frac(optarg, &o->malicious) < 0 || o->malicious >= 1.0;
            break;
        case O_MALMODE:
            if (strcmp(optarg, "closest") == 0)
                o->mal_mode = MAL_CLOSEST;
            else if (strcmp(optarg, "random") == 0)
                o->mal_mode = MAL_RANDOM;
            else
                bad = 1;
            break;
        case O_SEED:
            bad = parse_u64(optarg, &o->seed) < 0;
            break;
        case O_LOOKUPS:
            bad = parse_u64(optarg, &v) < 0 || v < 1 || v > 1000000;
            o->lookups = (unsigned)v;
            break;
        case O_DISJ:
            bad = parse_u64(optarg, &v) < 0 || v < 1 || v > 16;
            o->disjoint = (unsigned)v;
            break;
        case O_K:
            bad = parse_u64(optarg, &v) < 0 || v < 1 || v > HM_RT_MAX_K;
            o->k = (unsigned)v;
            break;
        case O_ALPHA:
            bad = parse_u64(optarg, &v) < 0 || v < 1 || v > 64;
            o->alpha = (unsigned)v;
            break;
        case O_BOOT:
            bad = parse_u64(optarg, &v) < 0 || v < 1 || v > 16;
            o->bootstrap_peers = (unsigned)v;
            break;
        case O_JOINIV:
            bad = parse_u64(optarg, &o->join_interval_ms) < 0 || o->join_interval_ms > 60000;
            break;
        case O_OPIV:
            bad = parse_u64(optarg, &o->op_interval_ms) < 0 || o->op_interval_ms > 60000;
            break;
        case O_OPTO:
            bad = parse_u64(optarg, &o->op_timeout_ms) < 0 || o->op_timeout_ms < 1 ||
                  o->op_timeout_ms > 3600000;
            break;
        case O_SETTLE:
            bad = parse_u64(optarg, &o->max_settle_ms) < 0 || o->max_settle_ms > 86400000;
            break;
        case O_CHURNDELAY:
            bad = parse_u64(optarg, &o->churn_delay_ms) < 0 || o->churn_delay_ms > 86400000;
            break;
        case O_PUBLIC:
            o->public_addrs = 1;
            break;
        case O_BASELINE:
            o->baseline = 1;
            break;
        case O_VERB:
            o->verbose = 1;
            break;
        case 'h':
        case O_HELP:
            usage(stdout);
            exit(0);
        default:
            return -EINVAL;
        }
        if (bad) {
            fprintf(stderr, "dht_sim: bad value for an option: %s\n", optarg ? optarg : "");
            return -EINVAL;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "dht_sim: unexpected argument %s\n", argv[optind]);
        return -EINVAL;
    }
    return 0;
}

/* Node i's address (see the file comment). m is its ordinal among the
 * malicious nodes, or -1 for an honest node. */
static void make_addr(const sim_opts *o, uint32_t i, long m, struct sockaddr_in *a)
{
    memset(a, 0, sizeof(*a));
    a->sin_family = AF_INET;
    a->sin_port = htons((uint16_t)(PORT_BASE + i));
    uint32_t ip;
    if (!o->public_addrs)
        ip = 0x0a000000u | ((i + 1) & 0xffffffu); /* 10.x.y.z */
    else if (m < 0)
        ip = (0x17u << 24) + ((i + 1) << 8) + 1; /* 23.x.y.1, one node per /24 */
    else
        ip = (0x2du << 24) + (((uint32_t)m / 16 + 1) << 8) + (uint32_t)m % 16 + 1; /* 45.x.y.z */
    a->sin_addr.s_addr = htonl(ip);
}

static int sim_setup(sim *s)
{
    const sim_opts *o = &s->o;
    s->n_nodes = o->nodes;
    rng_seed(&s->r_ident, o->seed, 1);
    rng_seed(&s->r_net, o->seed, 2);
    rng_seed(&s->r_node, o->seed, 3);
    rng_seed(&s->r_work, o->seed, 4);
    hm_swarm_id("dht-sim", NULL, 0, s->swarm_id);
    s->now = T0_MS;

    s->nodes = calloc(s->n_nodes, sizeof(*s->nodes));
    s->mal = calloc(s->n_nodes, sizeof(*s->mal));
    s->join_ms = calloc(s->n_nodes, sizeof(*s->join_ms));
    if (!s->nodes || !s->mal || !s->join_ms)
        return -ENOMEM;

    /* Which nodes are malicious: a random subset, never node 0 (the first
     * to join, which everyone's bootstrap leads back to). */
    unsigned want_mal = (unsigned)llround(o->malicious * s->n_nodes);
    if (want_mal > s->n_nodes - 1)
        want_mal = s->n_nodes - 1;
    while (s->n_malicious < want_mal) {
        uint32_t i = 1 + (uint32_t)rng_below(&s->r_ident, s->n_nodes - 1);
        if (s->nodes[i].kind == NODE_MALICIOUS)
            continue;
        s->nodes[i].kind = NODE_MALICIOUS;
        s->n_malicious++;
    }
    long m = 0;
    for (uint32_t i = 0; i < s->n_nodes; i++) {
        sim_node *n = &s->nodes[i];
        n->s = s;
        n->index = i;
        n->alive = 1;
        n->wake_at = UINT64_MAX;
        uint8_t seed[32];
        rng_fill(&s->r_ident, seed, sizeof(seed));
        int rc = hm_identity_from_seed(seed, &n->id);
        if (rc < 0)
            return rc;
        if (n->kind == NODE_MALICIOUS) {
            s->mal[m] = i;
            make_addr(o, i, m++, &n->addr);
        } else {
            make_addr(o, i, -1, &n->addr);
        }
    }
    return 0;
}

static int sim_create_cores(sim *s)
{
    hm_dht_config cfg;
    hm_dht_config_default(&cfg);
    cfg.k = s->o.k;
    cfg.rt.k = s->o.k;
    cfg.alpha = s->o.alpha;
    cfg.disjoint_paths = s->o.disjoint;
    for (uint32_t i = 0; i < s->n_nodes; i++) {
        sim_node *n = &s->nodes[i];
        if (n->kind != NODE_HONEST)
            continue;
        hm_dht_io io = {.ud = n, .send = io_send, .random = io_random};
        int rc = hm_dht_new(&n->id, s->swarm_id, &cfg, &io, s->now, &n->dht);
        if (rc < 0) {
            fprintf(stderr, "dht_sim: hm_dht_new: %s\n", hm_strerror(rc));
            return rc;
        }
    }
    return 0;
}

static void sim_free(sim *s)
{
    /* Freeing a core fires its pending callbacks with -ECANCELED; the
     * operations are all finished or abandoned by now, and their
     * callbacks ignore a second call. */
    if (s->nodes)
        for (uint32_t i = 0; i < s->n_nodes; i++)
            if (s->nodes[i].dht)
                hm_dht_free(s->nodes[i].dht);
    for (size_t i = 0; i < s->heap_len; i++)
        free(s->heap[i].data);
    free(s->heap);
    free(s->nodes);
    free(s->mal);
    free(s->join_ms);
}

typedef struct rt_figures {
    double size_mean, depth_mean;
    uint64_t size_min, size_p50, depth_min, depth_p50, depth_max;
    size_t under_k; /* tables with fewer than k contacts: isolated or eclipsed nodes */
} rt_figures;

static int rt_measure(sim *s, rt_figures *f)
{
    uint64_t *sz = calloc(s->n_nodes, sizeof(*sz));
    uint64_t *dp = calloc(s->n_nodes, sizeof(*dp));
    if (!sz || !dp) {
        free(sz);
        free(dp);
        return -ENOMEM;
    }
    size_t n = 0;
    f->under_k = 0;
    for (uint32_t i = 0; i < s->n_nodes; i++) {
        const sim_node *nd = &s->nodes[i];
        if (nd->kind != NODE_HONEST || !nd->alive)
            continue;
        hm_dht_stats st;
        hm_dht_get_stats(nd->dht, &st);
        sz[n] = st.rt_size;
        dp[n] = st.rt_depth;
        f->under_k += st.rt_size < s->o.k;
        n++;
    }
    qsort(sz, n, sizeof(*sz), cmp_u64);
    qsort(dp, n, sizeof(*dp), cmp_u64);
    f->size_mean = mean(sz, n);
    f->depth_mean = mean(dp, n);
    f->size_min = n ? sz[0] : 0;
    f->depth_min = n ? dp[0] : 0;
    f->depth_max = n ? dp[n - 1] : 0;
    f->size_p50 = pct(sz, n, 50);
    f->depth_p50 = pct(dp, n, 50);
    free(sz);
    free(dp);
    return 0;
}

/*
 * One round of the workload: L puts of fresh random keys from random live
 * honest nodes; then, if kill_frac > 0, that fraction of the live honest
 * nodes dies without warning (they stop sending and receiving, and what
 * they stored is gone); then a get of every key from another random live
 * honest node. Prints the round's figures under "[round NAME]".
 */
static int sim_round(sim *s, unsigned round, const char *name, double kill_frac)
{
    const sim_opts *o = &s->o;
    int result = -ENOMEM;
    uint64_t *hops = calloc(o->lookups, sizeof(*hops));
    uint64_t *reqs = calloc(o->lookups, sizeof(*reqs));
    uint64_t *lat = calloc(o->lookups, sizeof(*lat));
    uint64_t *put_hops = calloc(o->lookups, sizeof(*put_hops));
    s->ops = calloc(o->lookups, sizeof(*s->ops));
    if (!hops || !reqs || !lat || !put_hops || !s->ops)
        goto out;
    s->puts_done = s->gets_done = 0;

    for (uint32_t i = 0; i < o->lookups; i++) {
        sim_op *op = &s->ops[i];
        op->s = s;
        op->key_len = (size_t)snprintf((char *)op->key, sizeof(op->key),
                                       "sim/%" PRIu64 "/%u/key/%" PRIu32, o->seed, round, i);
        op->value_len = VALUE_MIN + rng_below(&s->r_work, VALUE_MAX - VALUE_MIN + 1);
        rng_fill(&s->r_work, op->value, op->value_len);
        schedule(s, s->now + 1 + (uint64_t)i * o->op_interval_ms, EV_PUT, 0, i);
    }
    uint64_t sent0 = s->dgrams_sent, t0 = s->now;
    run(s, puts_finished, UINT64_MAX);
    uint64_t put_phase_ms = s->now - t0, put_dgrams = s->dgrams_sent - sent0;

    unsigned live = 0, killed = 0;
    for (uint32_t i = 0; i < s->n_nodes; i++)
        live += s->nodes[i].kind == NODE_HONEST && s->nodes[i].alive;
    unsigned want_kill = (unsigned)llround(kill_frac * live);
    if (want_kill > live - 2)
        want_kill = live - 2; /* someone has to be left to get from */
    while (killed < want_kill) {
        sim_node *n = &s->nodes[rng_below(&s->r_work, s->n_nodes)];
        if (n->kind != NODE_HONEST || !n->alive)
            continue;
        n->alive = 0;
        killed++;
    }
    if (killed > 0 && o->churn_delay_ms > 0)
        run(s, never, s->now + o->churn_delay_ms);

    for (uint32_t i = 0; i < o->lookups; i++)
        schedule(s, s->now + 1 + (uint64_t)i * o->op_interval_ms, EV_GET, 0, i);
    sent0 = s->dgrams_sent;
    t0 = s->now;
    run(s, gets_finished, UINT64_MAX);
    uint64_t get_phase_ms = s->now - t0, get_dgrams = s->dgrams_sent - sent0;

    unsigned puts_ok = 0, get_ok = 0, get_err = 0, get_nf = 0, get_wrong = 0, gets_started = 0;
    uint64_t stored_sum = 0;
    size_t n_ok = 0, n_req = 0, n_put = 0;
    for (uint32_t i = 0; i < o->lookups; i++) {
        const sim_op *op = &s->ops[i];
        if (op->put_done && op->put_status != 0 && o->verbose)
            fprintf(stderr, "dht_sim: put %u from node %u: %s (stored %u)\n", i, op->putter,
                    hm_strerror(op->put_status), op->stored);
        if (op->put_done && op->put_status == 0) {
            puts_ok++;
            stored_sum += op->stored;
            put_hops[n_put++] = op->put_info.hops;
        }
        if (!op->get_started)
            continue;
        gets_started++;
        reqs[n_req++] = op->get_info.requests;
        if (op->get_outcome != GET_OK && o->verbose)
            fprintf(stderr, "dht_sim: get %u from node %u: outcome %d status %s\n", i,
                    op->getter, op->get_outcome, hm_strerror(op->get_status));
        switch (op->get_outcome) {
        case GET_OK:
            get_ok++;
            hops[n_ok] = op->get_info.hops;
            lat[n_ok] = op->get_end_ms - op->get_start_ms;
            n_ok++;
            break;
        case GET_ERROR:
            get_err++;
            break;
        case GET_NOT_FOUND:
            get_nf++;
            break;
        default:
            get_wrong++;
            break;
        }
    }
    qsort(hops, n_ok, sizeof(*hops), cmp_u64);
    qsort(lat, n_ok, sizeof(*lat), cmp_u64);
    qsort(reqs, n_req, sizeof(*reqs), cmp_u64);
    qsort(put_hops, n_put, sizeof(*put_hops), cmp_u64);

    printf("[round %s]\n", name);
    printf("killed                %u of %u live honest nodes\n", killed, live);
    printf("put_success_pct       %.2f (%u/%u)\n", 100.0 * puts_ok / o->lookups, puts_ok,
           o->lookups);
    printf("put_replicas_mean     %.2f\n", puts_ok ? (double)stored_sum / puts_ok : 0.0);
    printf("put_hops_p50          %" PRIu64 "\n", pct(put_hops, n_put, 50));
    printf("get_success_pct       %.2f (%u/%u; %u errors, %u not found, %u wrong value)\n",
           gets_started ? 100.0 * get_ok / gets_started : 0.0, get_ok, gets_started, get_err,
           get_nf, get_wrong);
    printf("hops_p50              %" PRIu64 "\n", pct(hops, n_ok, 50));
    printf("hops_p95              %" PRIu64 "\n", pct(hops, n_ok, 95));
    printf("msgs_per_lookup_mean  %.1f\n", mean(reqs, n_req));
    printf("msgs_per_lookup_p95   %" PRIu64 "\n", pct(reqs, n_req, 95));
    printf("dgrams_per_get        %.1f\n", gets_started ? (double)get_dgrams / gets_started : 0.0);
    printf("latency_p50_ms        %" PRIu64 "\n", pct(lat, n_ok, 50));
    printf("latency_p95_ms        %" PRIu64 "\n", pct(lat, n_ok, 95));
    printf("dgrams_puts           %" PRIu64 " (%" PRIu64 " virtual ms)\n", put_dgrams,
           put_phase_ms);
    printf("dgrams_gets           %" PRIu64 " (%" PRIu64 " virtual ms)\n", get_dgrams,
           get_phase_ms);
    fflush(stdout);
    result = 0;
out:
    free(hops);
    free(reqs);
    free(lat);
    free(put_hops);
    free(s->ops);
    s->ops = NULL;
    return result;
}

/* The cores' own counters, summed over the honest nodes (dead ones too). */
static void print_core_totals(const sim *s)
{
    hm_dht_stats t = {0};
    for (uint32_t i = 0; i < s->n_nodes; i++) {
        if (!s->nodes[i].dht)
            continue;
        hm_dht_stats st;
        hm_dht_get_stats(s->nodes[i].dht, &st);
        t.records += st.records;
        t.requests_sent += st.requests_sent;
        t.requests_received += st.requests_received;
        t.replies_received += st.replies_received;
        t.timeouts += st.timeouts;
        t.rate_limited += st.rate_limited;
        t.bad_messages += st.bad_messages;
        t.lookups_done += st.lookups_done;
    }
    printf("core_records          %zu\n", t.records);
    printf("core_requests         %" PRIu64 " sent, %" PRIu64 " received, %" PRIu64
           " replies, %" PRIu64 " timeouts\n",
           t.requests_sent, t.requests_received, t.replies_received, t.timeouts);
    printf("core_refused          %" PRIu64 " rate-limited, %" PRIu64 " bad messages\n",
           t.rate_limited, t.bad_messages);
    printf("core_lookups_done     %" PRIu64 "\n", t.lookups_done);
}

int main(int argc, char **argv)
{
    int result = 1;
    sim *s = calloc(1, sizeof(*s));
    if (!s) {
        fprintf(stderr, "dht_sim: out of memory\n");
        return 1;
    }
    if (parse_opts(argc, argv, &s->o) < 0) {
        usage(stderr);
        free(s);
        return 64;
    }
    const sim_opts *o = &s->o;
    double wall0 = wall_s();
    hm_log_set_level(o->verbose ? HM_LOG_INFO : HM_LOG_ERROR);
    if (hm_crypto_init() < 0) {
        fprintf(stderr, "dht_sim: libsodium failed to initialize\n");
        goto out;
    }
    int rc = sim_setup(s);
    if (rc < 0) {
        fprintf(stderr, "dht_sim: setup: %s\n", hm_strerror(rc));
        goto out;
    }
    unsigned n_honest = s->n_nodes - s->n_malicious;

    /* Memory of the cores: what the allocator holds before and after
     * creating them (and, later, once their tables and stores have
     * filled), less what the simulator itself holds in its queue. */
    size_t mem0 = heap_bytes();
    if (sim_create_cores(s) < 0)
        goto out;
    size_t mem_new = heap_bytes() - mem0;

    /* Phase 1: staggered joins, then virtual time until the tables settle. */
    for (uint32_t i = 0; i < s->n_nodes; i++)
        schedule(s, T0_MS + (uint64_t)i * o->join_interval_ms, EV_JOIN, i, 0);
    schedule(s, T0_MS + SAMPLE_MS, EV_SAMPLE, 0, 0);
    run(s, is_settled, UINT64_MAX);
    if (!s->settled) {
        fprintf(stderr, "dht_sim: the event queue ran dry before the swarm settled\n");
        goto out;
    }
    uint64_t bootstrap_ms = s->settled_ms - T0_MS;
    uint64_t join_end_ms = s->last_join_ms - T0_MS;
    size_t mem_settled = heap_bytes() - mem0 - s->heap_cap * sizeof(sim_event) - s->payload_bytes;
    rt_figures rt;
    if (rt_measure(s, &rt) < 0)
        goto out;
    qsort(s->join_ms, s->n_join_ms, sizeof(*s->join_ms), cmp_u64);
    unsigned join_incomplete = 0;
    for (uint32_t i = 0; i < s->n_nodes; i++)
        join_incomplete += s->nodes[i].join_pending;

    printf("# dht_sim --nodes %u --churn %.3f --loss %.3f --latency %" PRIu64 ":%" PRIu64
           " --malicious %.3f --malicious-mode %s --seed %" PRIu64 " --lookups %u"
           " --disjoint-paths %u --k %u --alpha %u%s%s\n",
           o->nodes, o->churn, o->loss, o->latency_ms, o->jitter_ms, o->malicious,
           o->mal_mode == MAL_RANDOM ? "random" : "closest", o->seed, o->lookups, o->disjoint,
           o->k, o->alpha, o->public_addrs ? " --public" : "", o->baseline ? " --baseline" : "");
    printf("nodes                 %u (honest %u, malicious %u)\n", s->n_nodes, n_honest,
           s->n_malicious);
    printf("joins_end_ms          %" PRIu64 "\n", join_end_ms);
    printf("bootstrap_ms          %" PRIu64 "\n", bootstrap_ms);
    printf("join_p50_ms           %" PRIu64 "\n", pct(s->join_ms, s->n_join_ms, 50));
    printf("join_p95_ms           %" PRIu64 "\n", pct(s->join_ms, s->n_join_ms, 95));
    printf("join_incomplete       %u\n", join_incomplete);
    printf("rt_size_mean          %.1f\n", rt.size_mean);
    printf("rt_size_min           %" PRIu64 "\n", rt.size_min);
    printf("rt_size_p50           %" PRIu64 "\n", rt.size_p50);
    printf("rt_under_k            %zu\n", rt.under_k);
    printf("rt_depth_mean         %.2f\n", rt.depth_mean);
    printf("rt_depth_min          %" PRIu64 "\n", rt.depth_min);
    printf("rt_depth_p50          %" PRIu64 "\n", rt.depth_p50);
    printf("rt_depth_max          %" PRIu64 "\n", rt.depth_max);
    printf("mem_per_node_new      %zu\n", n_honest ? mem_new / n_honest : 0);
    printf("mem_per_node_bytes    %zu\n", n_honest ? mem_settled / n_honest : 0);
    printf("dgrams_join           %" PRIu64 "\n", s->dgrams_sent);
    fflush(stdout);

    /* The rounds: with --baseline, one on the intact swarm first. */
    unsigned round = 0;
    if (o->churn == 0 || o->baseline) {
        if (sim_round(s, round++, "intact", 0) < 0)
            goto out;
    }
    if (o->churn > 0) {
        if (sim_round(s, round++, "churn", o->churn) < 0)
            goto out;
    }

    printf("[end]\n");
    printf("dgrams_total          %" PRIu64 " (lost %" PRIu64 ", to dead %" PRIu64
           ", unroutable %" PRIu64 ")\n",
           s->dgrams_sent, s->dgrams_lost, s->dgrams_dead, s->dgrams_unroutable);
    printf("malicious_answers     %" PRIu64 "\n", s->mal_requests_answered);
    print_core_totals(s);
    printf("wall_s                %.2f\n", wall_s() - wall0);
    fflush(stdout);
    result = 0;
out:
    sim_free(s);
    free(s);
    return result;
}

/*
 * test_dht: the DHT protocol core (dht/dht.c) and its codec (dht/proto.c),
 * on a tiny in-process network: N hm_dht instances whose sends go through
 * one queue with a fixed latency and a virtual clock, delivered to the
 * target's hm_dht_input. Nodes can be made dead (their datagrams dropped),
 * and a test can inject datagrams of its own from an outside address, as an
 * attacker or a misbehaving peer would. The full-scale simulator is
 * tests/sim/dht_sim; this file checks the behaviour one relies on.
 */
#include "config.h"

#include "dht/dht.h"
#include "dht/proto.h"
#include "src/base/util.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXN 64
#define LATENCY_MS 10
#define T0 (UINT64_C(1700000000) * 1000)

struct pkt {
    int from;                    /* node index, or -1 for an injected datagram */
    int to;                      /* node index, or -1 for the outside address */
    uint8_t pk[HM_PK_BYTES];     /* sender */
    struct sockaddr_in from_addr;
    struct sockaddr_in to_addr;
    uint64_t at;
    size_t len;
    uint8_t data[HM_DHT_PROTO_MAX_SIZE];
};

struct tnet;

struct tnode {
    struct tnet *net;
    int idx;
    hm_identity id;
    hm_dht *d;
    struct sockaddr_in addr;
    int dead;
    uint64_t rng;
    uint64_t next;
};

/* What went out to the outside address (the test's own endpoint). */
struct outside {
    size_t n;
    size_t lens[4096];
    uint8_t last[HM_DHT_PROTO_MAX_SIZE];
    size_t last_len;
};

struct tnet {
    struct tnode nodes[MAXN];
    int n;
    struct pkt *q;
    size_t qhead, qlen, qcap;
    uint64_t now;
    struct sockaddr_in outside_addr;
    struct outside out;
    /* Every request with no token, and the largest reply it got. */
    size_t amp_violations;
    uint64_t delivered;
    /* -- churn -- With lossy set, the first copy of every GET from node
     * lose_from to node lose_to is lost (its transaction id noted); a
     * second copy of the same request gets through. */
    int lossy, lose_from, lose_to;
    uint32_t lost_tids[64];
    size_t n_lost;
    uint64_t to_dead; /* datagrams sent to dead nodes */
};

static uint64_t xorshift(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static void t_random(void *ud, void *buf, size_t len)
{
    struct tnode *tn = ud;
    uint8_t *p = buf;
    for (size_t i = 0; i < len; i++)
        p[i] = (uint8_t)(xorshift(&tn->rng) >> 24);
}

static int addr_eq(const struct sockaddr_in *a, const struct sockaddr *b)
{
    const struct sockaddr_in *bb = (const struct sockaddr_in *)b;
    return b->sa_family == AF_INET && a->sin_port == bb->sin_port &&
           a->sin_addr.s_addr == bb->sin_addr.s_addr;
}

static struct pkt *q_push(struct tnet *net)
{
    if (net->qhead + net->qlen == net->qcap) {
        if (net->qhead > 0) {
            memmove(net->q, net->q + net->qhead, net->qlen * sizeof(*net->q));
            net->qhead = 0;
        } else {
            net->qcap = net->qcap ? net->qcap * 2 : 256;
            net->q = realloc(net->q, net->qcap * sizeof(*net->q));
            cr_assert(net->q != NULL);
        }
    }
    return &net->q[net->qhead + net->qlen++];
}

static int t_send(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                  const uint8_t *msg, size_t len)
{
    struct tnode *tn = ud;
    struct tnet *net = tn->net;
    struct pkt *p;
    int target = -2;

    (void)pk;
    cr_assert(len <= HM_DHT_PROTO_MAX_SIZE, "a node sent %zu bytes", len);
    if (addr_eq(&net->outside_addr, to)) {
        target = -1;
    } else {
        for (int i = 0; i < net->n; i++)
            if (addr_eq(&net->nodes[i].addr, to))
                target = i;
    }
    if (target == -2)
        return 0; /* nobody there: the datagram is lost */
    p = q_push(net);
    p->from = tn->idx;
    p->to = target;
    memcpy(p->pk, tn->id.pk, HM_PK_BYTES);
    p->from_addr = tn->addr;
    p->at = net->now + LATENCY_MS;
    p->len = len;
    memcpy(p->data, msg, len);
    return 0;
}

static void node_init(struct tnet *net, int i, const hm_dht_config *cfg)
{
    struct tnode *tn = &net->nodes[i];
    uint8_t seed[32] = {0};
    hm_dht_io io = {.ud = tn, .send = t_send, .random = t_random};
    uint8_t swarm[HM_SWARM_ID_BYTES];

    hm_swarm_id("test", NULL, 0, swarm);
    tn->net = net;
    tn->idx = i;
    seed[0] = (uint8_t)i;
    seed[1] = (uint8_t)(i >> 8);
    seed[2] = 0x5a;
    cr_assert_eq(hm_identity_from_seed(seed, &tn->id), 0);
    tn->rng = 0x9e3779b97f4a7c15ull ^ ((uint64_t)i * 0x100000001b3ull);
    tn->addr.sin_family = AF_INET;
    tn->addr.sin_addr.s_addr = htonl(0x0a000001u + (uint32_t)i);
    tn->addr.sin_port = htons((uint16_t)(4000 + i));
    cr_assert_eq(hm_dht_new(&tn->id, swarm, cfg, &io, net->now, &tn->d), 0);
    tn->next = net->now;
}

static struct tnet *net_new(int n, const hm_dht_config *cfg)
{
    struct tnet *net = calloc(1, sizeof(*net));

    cr_assert(net != NULL);
    hm_crypto_init();
    net->now = T0;
    net->n = n;
    net->outside_addr.sin_family = AF_INET;
    net->outside_addr.sin_addr.s_addr = htonl(0xc0a80063u); /* 192.168.0.99 */
    net->outside_addr.sin_port = htons(9999);
    for (int i = 0; i < n; i++)
        node_init(net, i, cfg);
    return net;
}

static void net_free(struct tnet *net)
{
    for (int i = 0; i < net->n; i++)
        hm_dht_free(net->nodes[i].d);
    free(net->q);
    free(net);
}

static void deliver(struct tnet *net, struct pkt *p)
{
    if (p->to == -1) {
        if (net->out.n < HM_ARRAY_LEN(net->out.lens))
            net->out.lens[net->out.n] = p->len;
        net->out.n++;
        memcpy(net->out.last, p->data, p->len);
        net->out.last_len = p->len;
        return;
    }
    struct tnode *tn = &net->nodes[p->to];
    if (tn->dead)
        net->to_dead++;
    if (tn->dead || (p->from >= 0 && net->nodes[p->from].dead))
        return;
    if (net->lossy && p->from == net->lose_from && p->to == net->lose_to) {
        hm_dht_msg q;
        if (hm_dht_msg_decode(p->data, p->len, &q) == 0 && q.type == HM_DHT_MSG_GET) {
            size_t i = 0;
            while (i < net->n_lost && net->lost_tids[i] != q.tid)
                i++;
            if (i == net->n_lost && i < HM_ARRAY_LEN(net->lost_tids)) {
                net->lost_tids[net->n_lost++] = q.tid;
                return;
            }
        }
    }
    net->delivered++;
    hm_dht_input(tn->d, p->pk, (const struct sockaddr *)&p->from_addr, p->data, p->len, net->now);
    tn->next = hm_dht_periodic(tn->d, net->now);
}

/* Runs the network for ms of virtual time, or until *stop becomes nonzero. */
static void net_run(struct tnet *net, uint64_t ms, const int *stop)
{
    uint64_t end = net->now + ms;

    while (net->now <= end && !(stop && *stop)) {
        uint64_t next = end + 1;
        while (net->qlen > 0 && net->q[net->qhead].at <= net->now) {
            struct pkt p = net->q[net->qhead];
            net->qhead++;
            net->qlen--;
            deliver(net, &p);
            if (stop && *stop)
                return;
        }
        for (int i = 0; i < net->n; i++) {
            struct tnode *tn = &net->nodes[i];
            if (tn->d == NULL || tn->dead)
                continue;
            if (tn->next <= net->now)
                tn->next = hm_dht_periodic(tn->d, net->now);
            if (tn->next < next)
                next = tn->next;
        }
        if (net->qlen > 0 && net->q[net->qhead].at < next)
            next = net->q[net->qhead].at;
        net->now = next > net->now ? next : net->now + 1;
    }
}

/* Injects a datagram into node `to` as if sent from the outside address with key pk. */
static void inject(struct tnet *net, int to, const uint8_t pk[HM_PK_BYTES],
                   const struct sockaddr_in *from, const uint8_t *msg, size_t len)
{
    struct pkt *p = q_push(net);
    p->from = -1;
    p->to = to;
    memcpy(p->pk, pk, HM_PK_BYTES);
    p->from_addr = *from;
    p->at = net->now;
    p->len = len;
    memcpy(p->data, msg, len);
}

static struct tnet *bootstrapped(int n, const hm_dht_config *cfg)
{
    struct tnet *net = net_new(n, cfg);

    for (int i = 1; i < n; i++)
        cr_assert_eq(hm_dht_bootstrap(net->nodes[i].d, net->nodes[0].id.pk,
                                      (const struct sockaddr *)&net->nodes[0].addr, net->now),
                     0);
    net_run(net, 20000, NULL);
    return net;
}

/* ---- operation results ---- */

#define MAXV 16
struct get_res {
    int calls;
    int status;
    size_t n;
    uint8_t values[MAXV][64];
    size_t value_lens[MAXV];
    uint8_t subkeys[MAXV][HM_DHT_SUBKEY_MAX];
    size_t subkey_lens[MAXV];
    int has_subkey[MAXV];
    uint64_t seq[MAXV];
    int64_t held[MAXV];
    hm_dht_lookup_info info;
};

static void get_cb(void *ud, int status, const hm_dht_value *v, size_t n,
                   const hm_dht_lookup_info *info)
{
    struct get_res *r = ud;
    r->calls++;
    r->status = status;
    r->n = n;
    r->info = *info;
    for (size_t i = 0; i < n && i < MAXV; i++) {
        cr_assert(v[i].rec.value_len <= 64);
        memcpy(r->values[i], v[i].rec.value, v[i].rec.value_len);
        r->value_lens[i] = v[i].rec.value_len;
        r->has_subkey[i] = v[i].rec.has_subkey;
        r->seq[i] = v[i].rec.seq;
        r->held[i] = v[i].held_s;
        if (v[i].rec.has_subkey) {
            cr_assert(v[i].rec.subkey_len <= HM_DHT_SUBKEY_MAX);
            memcpy(r->subkeys[i], v[i].rec.subkey, v[i].rec.subkey_len);
            r->subkey_lens[i] = v[i].rec.subkey_len;
        }
    }
}

struct put_res {
    int calls;
    int status;
    unsigned stored;
    hm_dht_lookup_info info;
};

static void put_cb(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    struct put_res *r = ud;
    r->calls++;
    r->status = status;
    r->stored = stored;
    r->info = *info;
}

static double now_s(const struct tnet *net) { return (double)net->now / 1000.0; }

static void do_put(struct tnet *net, int node, const char *key, const char *subkey,
                   const char *value, double exp, struct put_res *pr)
{
    memset(pr, 0, sizeof(*pr));
    cr_assert_eq(hm_dht_put(net->nodes[node].d, (const uint8_t *)key, strlen(key),
                            (const uint8_t *)subkey, subkey ? strlen(subkey) : 0, subkey != NULL,
                            (const uint8_t *)value, strlen(value), exp, net->now, 10000, put_cb,
                            pr, NULL),
                 0);
    cr_assert_eq(pr->calls, 0, "a callback fired inside hm_dht_put");
    net->nodes[node].next = net->now; /* new requests: new deadlines */
    net_run(net, 15000, &pr->calls);
    cr_assert_eq(pr->calls, 1);
}

static void do_get(struct tnet *net, int node, const char *key, struct get_res *gr)
{
    memset(gr, 0, sizeof(*gr));
    cr_assert_eq(hm_dht_get(net->nodes[node].d, (const uint8_t *)key, strlen(key), net->now,
                            10000, get_cb, gr, NULL),
                 0);
    cr_assert_eq(gr->calls, 0, "a callback fired inside hm_dht_get");
    net->nodes[node].next = net->now;
    net_run(net, 15000, &gr->calls);
    cr_assert_eq(gr->calls, 1);
}

static int value_is(const struct get_res *g, size_t i, const char *s)
{
    return g->value_lens[i] == strlen(s) && memcmp(g->values[i], s, strlen(s)) == 0;
}

/* ---- codec ---- */

Test(dht_proto, roundtrip_every_message)
{
    hm_dht_msg m, d;
    uint8_t buf[HM_DHT_PROTO_MAX_SIZE], tok[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    size_t len;
    hm_identity id;
    uint8_t seed[32] = {7};

    hm_crypto_init();
    hm_identity_from_seed(seed, &id);

    /* FIND_NODE, no token, padded. */
    memset(&m, 0, sizeof(m));
    m.type = HM_DHT_MSG_FIND_NODE;
    m.tid = 0xdeadbeef;
    m.flags = HM_DHT_FLAG_CLIENT;
    memset(m.target, 0xab, sizeof(m.target));
    cr_assert_eq(hm_dht_msg_encode(&m, 0, buf, sizeof(buf), &len), 0);
    size_t plain = len;
    cr_assert_eq(hm_dht_msg_decode(buf, len, &d), 0);
    cr_assert_eq(d.type, HM_DHT_MSG_FIND_NODE);
    cr_assert_eq(d.tid, 0xdeadbeef);
    cr_assert_eq(d.flags, HM_DHT_FLAG_CLIENT);
    cr_assert_null(d.token);
    cr_assert_eq(memcmp(d.target, m.target, 32), 0);
    for (size_t pad = plain; pad < 1100; pad += 37) {
        cr_assert_eq(hm_dht_msg_encode(&m, pad, buf, sizeof(buf), &len), 0);
        cr_assert(len >= pad && len <= pad + 1, "pad %zu gave %zu", pad, len);
        cr_assert_eq(hm_dht_msg_decode(buf, len, &d), 0);
    }

    /* NODES with IPv4 and IPv6 contacts. */
    memset(&m, 0, sizeof(m));
    m.type = HM_DHT_MSG_NODES;
    m.tid = 5;
    m.token = tok;
    m.token_len = 8;
    m.n_contacts = 2;
    memcpy(m.contacts[0].pk, id.pk, 32);
    struct sockaddr_in *a4 = (struct sockaddr_in *)&m.contacts[0].addr;
    a4->sin_family = AF_INET;
    a4->sin_port = htons(1234);
    a4->sin_addr.s_addr = htonl(0x01020304);
    memcpy(m.contacts[1].pk, id.pk, 32);
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&m.contacts[1].addr;
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(80);
    a6->sin6_addr.s6_addr[15] = 1;
    cr_assert_eq(hm_dht_msg_encode(&m, 0, buf, sizeof(buf), &len), 0);
    cr_assert_eq(hm_dht_msg_decode(buf, len, &d), 0);
    cr_assert_eq(d.n_contacts, 2);
    cr_assert_eq(memcmp(d.contacts[0].id, id.node_id, 32), 0);
    cr_assert(hm_addr_equal((struct sockaddr *)&d.contacts[0].addr,
                            (struct sockaddr *)&m.contacts[0].addr));
    cr_assert(hm_addr_equal((struct sockaddr *)&d.contacts[1].addr,
                            (struct sockaddr *)&m.contacts[1].addr));
    cr_assert_eq(d.token_len, 8);

    /* VALUE with two records and more = 1; STORE; STORED. */
    memset(&m, 0, sizeof(m));
    m.type = HM_DHT_MSG_VALUE;
    m.token = tok;
    m.token_len = 8;
    m.n_records = 2;
    m.more = 1;
    for (int i = 0; i < 2; i++) {
        m.records[i].key = (const uint8_t *)"k";
        m.records[i].key_len = 1;
        m.records[i].has_subkey = 1;
        m.records[i].subkey = (const uint8_t *)(i ? "b" : "a");
        m.records[i].subkey_len = 1;
        m.records[i].value = (const uint8_t *)"vv";
        m.records[i].value_len = 2;
        m.records[i].expiration = 1e9 + i;
    }
    cr_assert_eq(hm_dht_msg_encode(&m, 0, buf, sizeof(buf), &len), 0);
    cr_assert_eq(hm_dht_msg_decode(buf, len, &d), 0);
    cr_assert_eq(d.n_records, 2);
    cr_assert_eq(d.more, 1);
    cr_assert_eq(d.records[1].subkey[0], 'b');
    cr_assert_eq(d.records[1].expiration, 1e9 + 1);

    memset(&m, 0, sizeof(m));
    m.type = HM_DHT_MSG_STORE;
    m.token = tok;
    m.token_len = 8;
    m.record.key = (const uint8_t *)"key";
    m.record.key_len = 3;
    m.record.value = (const uint8_t *)"";
    m.record.expiration = 5;
    cr_assert_eq(hm_dht_msg_encode(&m, 300, buf, sizeof(buf), &len), 0);
    cr_assert_eq(hm_dht_msg_decode(buf, len, &d), 0);
    cr_assert_eq(d.record.key_len, 3);
    cr_assert(d.pad_len > 0);
    m.token = NULL; /* a STORE needs a token */
    cr_assert_eq(hm_dht_msg_encode(&m, 0, buf, sizeof(buf), &len), -EINVAL);

    /* -- held since -- the same VALUE with its held array; without, none. */
    cr_assert_eq(d.has_held, 0);
    memset(&m, 0, sizeof(m));
    m.type = HM_DHT_MSG_VALUE;
    m.token = tok;
    m.token_len = 8;
    m.n_records = 2;
    for (int i = 0; i < 2; i++) {
        m.records[i].key = (const uint8_t *)"k";
        m.records[i].key_len = 1;
        m.records[i].value = (const uint8_t *)"vv";
        m.records[i].value_len = 2;
        m.records[i].expiration = 1e9;
    }
    m.records[1].has_subkey = 1;
    m.records[1].subkey = (const uint8_t *)"s";
    m.records[1].subkey_len = 1;
    m.has_held = 1;
    m.held[0] = 7;
    m.held[1] = UINT32_MAX;
    cr_assert_eq(hm_dht_msg_encode(&m, 0, buf, sizeof(buf), &len), 0);
    cr_assert_eq(hm_dht_msg_decode(buf, len, &d), 0);
    cr_assert_eq(d.has_held, 1);
    cr_assert_eq(d.held[0], 7);
    cr_assert_eq(d.held[1], UINT32_MAX);

    memset(&m, 0, sizeof(m));
    m.type = HM_DHT_MSG_STORED;
    m.token = tok;
    m.token_len = 8;
    m.status = -EDQUOT;
    cr_assert_eq(hm_dht_msg_encode(&m, 0, buf, sizeof(buf), &len), 0);
    cr_assert_eq(hm_dht_msg_decode(buf, len, &d), 0);
    cr_assert_eq(d.status, -EDQUOT);
}

Test(dht_proto, refuses_malformed)
{
    /* Each of these is one msgpack object the decoder must refuse. */
    static const struct {
        const char *hex;
        int err;
    } bad[] = {
        {"90", -EPROTO},                         /* [] */
        {"94000000c0c0", -EINVAL},               /* trailing byte */
        {"94050000c0", -EPROTO},                 /* unknown type 5 */
        {"94100000c0", -EPROTO},                 /* PONG without token */
        {"94000000c4020102", -EPROTO},           /* token of 2 bytes */
        {"94010000c0", -EPROTO},                 /* FIND_NODE missing target */
        {"9400cf000000010000000000c0", -EPROTO}, /* tid beyond 32 bits */
        {"95000000c0c0", -EPROTO},               /* PING with a nil pad */
        {"95100000c4080000000000000000c400", -EPROTO}, /* PONG with a pad */
        {"91919191", -EMSGSIZE},                 /* too deep */
        {"dc0001", -EINVAL},                     /* truncated */
        /* -- held since -- VALUE's held array: one uint32 per record exactly */
        {"98120000c4080000000000000000" "90c29091" "01", -EPROTO}, /* 1 held, 0 records */
        {"98120000c4080000000000000000" "90c290c0", -EPROTO},      /* held nil */
        {"99120000c4080000000000000000" "90c2909090", -EPROTO},    /* a ninth element */
        {"98100000c4080000000000000000" "90909090", -EPROTO},      /* PONG with eight */
    };
    hm_dht_msg d;
    uint8_t buf[64];

    for (size_t i = 0; i < HM_ARRAY_LEN(bad); i++) {
        size_t n = strlen(bad[i].hex) / 2;
        cr_assert_eq(hm_hex_decode(bad[i].hex, n * 2, buf, n), 0);
        cr_expect_eq(hm_dht_msg_decode(buf, n, &d), bad[i].err, "case %zu (%s)", i, bad[i].hex);
    }
    /* A valid PING decodes. */
    cr_assert_eq(hm_hex_decode("94000000c0", 10, buf, 5), 0);
    cr_assert_eq(hm_dht_msg_decode(buf, 5, &d), 0);
    /* So do an empty VALUE with an empty held array and one without. */
    cr_assert_eq(hm_hex_decode("98120000c4080000000000000000" "90c29090", 36, buf, 18), 0);
    cr_assert_eq(hm_dht_msg_decode(buf, 18, &d), 0);
    cr_assert_eq(d.has_held, 1);
    cr_assert_eq(hm_hex_decode("97120000c4080000000000000000" "90c290", 34, buf, 17), 0);
    cr_assert_eq(hm_dht_msg_decode(buf, 17, &d), 0);
    cr_assert_eq(d.has_held, 0);

    /* More contacts than allowed. */
    {
        uint8_t big[HM_DHT_PROTO_MAX_SIZE];
        hm_wire_wr w;
        uint8_t pk[32] = {0}, a[6] = {1, 2, 3, 4, 0, 80}, tok[8] = {0};
        size_t len;
        hm_wire_wr_init_fixed(&w, big, sizeof(big));
        hm_wire_wr_array(&w, 5);
        hm_wire_wr_uint(&w, HM_DHT_MSG_NODES);
        hm_wire_wr_uint(&w, 1);
        hm_wire_wr_uint(&w, 0);
        hm_wire_wr_bin(&w, tok, 8);
        hm_wire_wr_array(&w, HM_DHT_PROTO_MAX_CONTACTS + 1);
        for (int i = 0; i < HM_DHT_PROTO_MAX_CONTACTS + 1 && w.err == 0; i++) {
            hm_wire_wr_array(&w, 2);
            hm_wire_wr_bin(&w, pk, 32);
            hm_wire_wr_bin(&w, a, 6);
        }
        if (w.err == 0) {
            len = w.len;
            cr_assert_neq(hm_dht_msg_decode(big, len, &d), 0);
        }
    }
}

/* ---- the core on the test network ---- */

Test(dht, bootstrap_fills_tables_and_keeps_replies_small)
{
    struct tnet *net = bootstrapped(50, NULL);
    size_t total = 0, minsize = SIZE_MAX;

    for (int i = 0; i < net->n; i++) {
        hm_dht_stats st;
        hm_dht_get_stats(net->nodes[i].d, &st);
        total += st.rt_size;
        if (st.rt_size < minsize)
            minsize = st.rt_size;
        cr_expect_eq(st.rate_limited, 0, "node %d rate-limited honest traffic", i);
        cr_expect_eq(st.bad_messages, 0, "node %d saw bad messages", i);
    }
    /* 49 peers; with k = 20 and relaxed splitting a table holds most of them. */
    cr_assert_geq(minsize, 20, "smallest table %zu", minsize);
    cr_assert_geq(total / (size_t)net->n, 30, "average table %zu", total / (size_t)net->n);
    net_free(net);
}

/*
 * Watches every request without a token and the reply to it (matched by
 * sender, receiver and tid): the reply must be no larger than the request.
 */
Test(dht, replies_to_unverified_addresses_are_never_larger)
{
    struct tnet *net = net_new(30, NULL);
    size_t checked = 0, violations = 0;
    struct seen {
        int from, to;
        uint32_t tid;
        size_t len;
    } *reqs = calloc(200000, sizeof(*reqs));
    size_t nreqs = 0;
    uint64_t end;

    for (int i = 1; i < net->n; i++)
        hm_dht_bootstrap(net->nodes[i].d, net->nodes[0].id.pk,
                         (const struct sockaddr *)&net->nodes[0].addr, net->now);
    /* Step the network by hand, looking at each datagram before delivery. */
    end = net->now + 10000;
    while (net->now < end) {
        while (net->qlen > 0 && net->q[net->qhead].at <= net->now) {
            struct pkt p = net->q[net->qhead];
            hm_dht_msg m;
            net->qhead++;
            net->qlen--;
            cr_assert_eq(hm_dht_msg_decode(p.data, p.len, &m), 0);
            if (hm_dht_msg_is_request(m.type)) {
                if (m.token == NULL && nreqs < 200000)
                    reqs[nreqs++] = (struct seen){p.from, p.to, m.tid, p.len};
            } else {
                for (size_t i = 0; i < nreqs; i++)
                    if (reqs[i].tid == m.tid && reqs[i].from == p.to && reqs[i].to == p.from) {
                        checked++;
                        if (p.len > reqs[i].len)
                            violations++;
                    }
            }
            deliver(net, &p);
        }
        for (int i = 0; i < net->n; i++)
            if (net->nodes[i].next <= net->now)
                net->nodes[i].next = hm_dht_periodic(net->nodes[i].d, net->now);
        net->now++;
    }
    cr_assert_gt(checked, 50, "only %zu first-contact exchanges seen", checked);
    cr_assert_eq(violations, 0);

    /* An unpadded first-contact FIND_NODE gets a reply no larger, however many contacts exist. */
    {
        hm_dht_msg m;
        uint8_t buf[256], pk[32];
        size_t len;
        memset(&m, 0, sizeof(m));
        m.type = HM_DHT_MSG_FIND_NODE;
        m.tid = 77;
        memset(pk, 0x42, sizeof(pk));
        hm_node_id_from_pk(pk, m.target);
        cr_assert_eq(hm_dht_msg_encode(&m, 0, buf, sizeof(buf), &len), 0);
        net->out.n = 0;
        inject(net, 0, pk, &net->outside_addr, buf, len);
        net_run(net, 100, NULL);
        cr_assert_eq(net->out.n, 1);
        cr_assert_leq(net->out.lens[0], len);
        cr_assert_eq(hm_dht_msg_decode(net->out.last, net->out.last_len, &m), 0);
        cr_assert_eq(m.type, HM_DHT_MSG_NODES);
        cr_assert_not_null(m.token);
    }
    free(reqs);
    net_free(net);
}

Test(dht, get_after_put_from_another_node)
{
    struct tnet *net = bootstrapped(40, NULL);
    struct put_res pr;
    struct get_res gr;

    do_put(net, 5, "hello", NULL, "world", now_s(net) + 600, &pr);
    cr_assert_eq(pr.status, 0);
    cr_assert_eq(pr.stored, 5);
    do_get(net, 31, "hello", &gr);
    cr_assert_eq(gr.status, 0);
    cr_assert_eq(gr.n, 1);
    cr_assert(value_is(&gr, 0, "world"));
    cr_assert_geq(gr.info.hops, 1);
    cr_assert_gt(gr.info.requests, 0);

    /* A key nobody stored: status 0, nothing. */
    do_get(net, 12, "nothing here", &gr);
    cr_assert_eq(gr.status, 0);
    cr_assert_eq(gr.n, 0);
    net_free(net);
}

Test(dht, later_expiration_wins_across_replicas)
{
    struct tnet *net = bootstrapped(40, NULL);
    struct put_res pr;
    struct get_res gr;
    double t = now_s(net);

    do_put(net, 3, "k", NULL, "early", t + 100, &pr);
    cr_assert_eq(pr.status, 0);
    do_put(net, 7, "k", NULL, "late", t + 300, &pr);
    cr_assert_eq(pr.status, 0);
    /* Every replica already holds a later one: refused as stale. */
    do_put(net, 9, "k", NULL, "middle", t + 200, &pr);
    cr_assert_eq(pr.stored, 0);
    cr_assert_eq(pr.status, -ESTALE);
    do_get(net, 20, "k", &gr);
    cr_assert_eq(gr.status, 0);
    cr_assert_eq(gr.n, 1);
    cr_assert(value_is(&gr, 0, "late"));
    net_free(net);
}

Test(dht, subkeys_merge_into_a_dictionary)
{
    struct tnet *net = bootstrapped(40, NULL);
    struct put_res pr;
    struct get_res gr;
    double t = now_s(net);
    const char *subs[] = {"alpha", "beta", "gamma", "delta"};
    int seen[4] = {0};

    for (int i = 0; i < 4; i++) {
        do_put(net, 2 + 5 * i, "group", subs[i], subs[i], t + 500, &pr);
        cr_assert_eq(pr.status, 0, "put %d: %d", i, pr.status);
    }
    do_get(net, 33, "group", &gr);
    cr_assert_eq(gr.status, 0);
    cr_assert_eq(gr.n, 4);
    for (size_t i = 0; i < gr.n; i++) {
        cr_assert(gr.has_subkey[i]);
        for (int j = 0; j < 4; j++)
            if (gr.subkey_lens[i] == strlen(subs[j]) &&
                memcmp(gr.subkeys[i], subs[j], strlen(subs[j])) == 0 && value_is(&gr, i, subs[j]))
                seen[j]++;
    }
    for (int j = 0; j < 4; j++)
        cr_assert_eq(seen[j], 1, "subkey %s seen %d times", subs[j], seen[j]);
    net_free(net);
}

Test(dht, owned_records_only_the_owner_updates)
{
    struct tnet *net = bootstrapped(40, NULL);
    struct put_res pr;
    struct get_res gr;
    double t = now_s(net);
    char key[128], marker[HM_DHT_OWNER_MARKER_LEN + 1];
    uint64_t seq1;

    hm_dht_owner_marker(net->nodes[4].id.pk, marker);
    snprintf(key, sizeof(key), "profile%s", marker);

    do_put(net, 4, key, NULL, "v1", t + 600, &pr);
    cr_assert_eq(pr.status, 0);
    cr_assert_geq(pr.stored, 1);
    do_get(net, 25, key, &gr);
    cr_assert_eq(gr.n, 1);
    cr_assert(value_is(&gr, 0, "v1"));
    seq1 = gr.seq[0];

    /* Another node cannot sign for the owner: every replica refuses. */
    do_put(net, 11, key, NULL, "forged", t + 900, &pr);
    cr_assert_eq(pr.stored, 0);
    cr_assert_eq(pr.status, -EBADMSG);
    do_get(net, 26, key, &gr);
    cr_assert(value_is(&gr, 0, "v1"));

    /* The owner updates with a higher seq, even with an earlier expiration. */
    net_run(net, 5, NULL);
    do_put(net, 4, key, NULL, "v2", t + 400, &pr);
    cr_assert_eq(pr.status, 0);
    do_get(net, 27, key, &gr);
    cr_assert_eq(gr.n, 1);
    cr_assert(value_is(&gr, 0, "v2"));
    cr_assert_gt(gr.seq[0], seq1);
    net_free(net);
}

/*
 * A malicious replica answers the GET with a record that claims a higher
 * seq under a forged signature: the getter must not take it.
 */
Test(dht, forged_record_in_a_reply_does_not_win)
{
    struct tnet *net = bootstrapped(30, NULL);
    struct put_res pr;
    struct get_res gr;
    double t = now_s(net);
    char key[128], marker[HM_DHT_OWNER_MARKER_LEN + 1];
    uint8_t buf[HM_DHT_PROTO_MAX_SIZE], sig[64];
    hm_dht_msg m;
    size_t len;
    int requests = 0;

    hm_dht_owner_marker(net->nodes[3].id.pk, marker);
    snprintf(key, sizeof(key), "cfg%s", marker);
    do_put(net, 3, key, NULL, "honest", t + 600, &pr);
    cr_assert_eq(pr.status, 0);

    /* Node 9 starts a get; we answer each of its GETs in place of the target with a forgery. */
    memset(&gr, 0, sizeof(gr));
    cr_assert_eq(hm_dht_get(net->nodes[9].d, (const uint8_t *)key, strlen(key), net->now, 10000,
                            get_cb, &gr, NULL),
                 0);
    net->nodes[9].next = net->now;
    memset(sig, 0x11, sizeof(sig));
    for (size_t i = 0; i < net->qlen; i++) {
        struct pkt *p = &net->q[net->qhead + i];
        hm_dht_msg q;
        uint8_t tok[8] = {9, 9, 9, 9, 9, 9, 9, 9};
        if (p->from != 9 || hm_dht_msg_decode(p->data, p->len, &q) < 0 || q.type != HM_DHT_MSG_GET)
            continue;
        memset(&m, 0, sizeof(m));
        m.type = HM_DHT_MSG_VALUE;
        m.tid = q.tid;
        m.token = tok;
        m.token_len = 8;
        m.n_records = 1;
        m.records[0].key = (const uint8_t *)key;
        m.records[0].key_len = strlen(key);
        m.records[0].value = (const uint8_t *)"evil";
        m.records[0].value_len = 4;
        m.records[0].expiration = t + 700;
        m.records[0].seq = UINT64_MAX;
        m.records[0].sig = sig;
        cr_assert_eq(hm_dht_msg_encode(&m, 0, buf, sizeof(buf), &len), 0);
        /* Sent from the right peer (its key and address), arriving before the real reply. */
        inject(net, 9, net->nodes[p->to].id.pk, &net->nodes[p->to].addr, buf, len);
        requests++;
    }
    cr_assert_gt(requests, 0);
    net_run(net, 15000, &gr.calls);
    cr_assert_eq(gr.calls, 1);
    cr_assert_eq(gr.status, 0);
    cr_assert_eq(gr.n, 1);
    cr_assert(value_is(&gr, 0, "honest"));
    net_free(net);
}

Test(dht, lookup_survives_dead_nodes)
{
    hm_dht_config cfg;
    struct tnet *net;
    struct put_res pr;
    struct get_res gr;
    uint8_t kid[32];
    hm_rt_contact closest[6];
    size_t n;

    hm_dht_config_default(&cfg);
    cfg.request_timeout_ms = 300;
    net = bootstrapped(40, &cfg);
    do_put(net, 1, "survivor", NULL, "still here", now_s(net) + 600, &pr);
    cr_assert_eq(pr.status, 0);
    cr_assert_eq(pr.stored, 5);

    /* Kill the three nodes closest to the key, and a few others. */
    hm_dht_key_id((const uint8_t *)"survivor", 8, kid);
    n = hm_rt_closest(hm_dht_routing(net->nodes[1].d), kid, 3, closest, 0);
    cr_assert_eq(n, 3);
    for (size_t i = 0; i < n; i++)
        for (int j = 0; j < net->n; j++)
            if (memcmp(net->nodes[j].id.pk, closest[i].pk, 32) == 0)
                net->nodes[j].dead = 1;
    for (int j = 30; j < 36; j++)
        net->nodes[j].dead = 1;
    cr_assert(!net->nodes[20].dead);
    do_get(net, 20, "survivor", &gr);
    cr_assert_eq(gr.status, 0);
    cr_assert_eq(gr.n, 1);
    cr_assert(value_is(&gr, 0, "still here"));
    cr_assert_gt(gr.info.timeouts, 0);
    net_free(net);
}

Test(dht, a_dead_contact_costs_one_adaptive_timeout)
{
    /* Round trips of 20 ms teach the node a timeout far below the 1 s
     * ceiling; dead contacts among the key's closest then cost the get one
     * such timeout (past it they hold neither a slot nor, with enough other
     * answers, the lookup's end), not the fixed timeout and its second try. */
    hm_dht_config cfg;
    struct tnet *net;
    struct put_res pr;
    struct get_res gr;
    uint8_t kid[32];
    hm_rt_contact closest[4];

    hm_dht_config_default(&cfg);
    net = bootstrapped(40, &cfg);
    do_put(net, 1, "churned", NULL, "kept", now_s(net) + 600, &pr);
    cr_assert_eq(pr.stored, 5);
    hm_dht_key_id((const uint8_t *)"churned", 7, kid);
    size_t n = hm_rt_closest(hm_dht_routing(net->nodes[20].d), kid, 4, closest, 0);
    cr_assert_eq(n, 4);
    for (size_t i = 0; i < n; i++)
        for (int j = 0; j < net->n; j++)
            if (j != 20 && memcmp(net->nodes[j].id.pk, closest[i].pk, 32) == 0)
                net->nodes[j].dead = 1;
    uint64_t t0 = net->now;
    do_get(net, 20, "churned", &gr);
    uint64_t took = net->now - t0;
    cr_assert_eq(gr.status, 0);
    cr_assert(gr.n == 1 && value_is(&gr, 0, "kept"));
    cr_assert_gt(gr.info.timeouts, 0, "the dead contacts were asked");
    cr_assert_lt(took, cfg.request_timeout_ms, "the get took %llu ms of virtual time (%u requests, %u timeouts)",
                 (unsigned long long)took, gr.info.requests, gr.info.timeouts);
    net_free(net);
}

/* -- churn -- */
Test(dht, a_lost_request_of_a_finished_lookup_costs_no_live_contact)
{
    /* Three gets at once each ask the key's closest node, whose first copy
     * of every request is lost (a burst of replies overflowing a buffer
     * does that). The gets finish without it, before the fixed timeout;
     * the requests are still sent a second time, which it answers, so the
     * live contact stays in the table. Counted as three failures in a row,
     * they would remove and blacklist it, and with it a replica. */
    hm_dht_config cfg;
    struct tnet *net;
    struct put_res pr;
    struct get_res gr[3];
    uint8_t kid[32];
    hm_rt_contact closest[1];
    const int x = 20;
    int y = -1;

    hm_dht_config_default(&cfg);
    net = bootstrapped(40, &cfg);
    do_put(net, 1, "lossy", NULL, "kept", now_s(net) + 600, &pr);
    cr_assert_eq(pr.stored, 5);
    hm_dht_key_id((const uint8_t *)"lossy", 5, kid);
    cr_assert_eq(hm_rt_closest(hm_dht_routing(net->nodes[x].d), kid, 1, closest, 0), 1);
    for (int j = 0; j < net->n; j++)
        if (memcmp(net->nodes[j].id.pk, closest[0].pk, 32) == 0)
            y = j;
    cr_assert(y >= 0 && y != x);
    cr_assert_eq(hm_rt_find(hm_dht_routing(net->nodes[x].d), closest[0].id, NULL), 0);
    net->lossy = 1;
    net->lose_from = x;
    net->lose_to = y;

    uint64_t t0 = net->now;
    int calls = 0;
    memset(gr, 0, sizeof(gr));
    for (int i = 0; i < 3; i++)
        cr_assert_eq(hm_dht_get(net->nodes[x].d, (const uint8_t *)"lossy", 5, net->now, 10000,
                                get_cb, &gr[i], NULL),
                     0);
    net->nodes[x].next = net->now;
    while (calls < 3 && net->now < t0 + 15000) {
        net_run(net, 10, NULL);
        calls = gr[0].calls + gr[1].calls + gr[2].calls;
    }
    cr_assert_eq(calls, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(gr[i].status, 0);
        cr_assert(gr[i].n == 1 && value_is(&gr[i], 0, "kept"), "get %d found the value", i);
    }
    uint64_t took = net->now - t0;
    cr_assert_eq(net->n_lost, 3, "each get asked the closest node once");
    cr_assert_lt(took, cfg.request_timeout_ms, "the gets did not wait for it (%llu ms)",
                 (unsigned long long)took);
    /* Past both tries of every request. */
    net_run(net, 3 * cfg.request_timeout_ms, NULL);
    cr_assert_eq(net->n_lost, 3);
    cr_assert_eq(hm_rt_find(hm_dht_routing(net->nodes[x].d), closest[0].id, NULL), 0,
                 "the live contact is still in the table");
    cr_assert(!hm_rt_is_banned(hm_dht_routing(net->nodes[x].d), closest[0].id, net->now));
    net_free(net);
}

Test(dht, a_get_that_found_the_value_does_not_wait_for_suspects)
{
    /* The first get after the key's closest nodes died waits for them
     * until its adaptive timeout, which makes them suspects. The next get
     * asks them again (other nodes still list them) but, once it has found
     * the value and num_replicas answers, finishes without them: before
     * any adaptive timeout could pass (request_timeout_min_ms of virtual
     * time). A get that finds nothing still waits for them. */
    hm_dht_config cfg;
    struct tnet *net;
    struct put_res pr;
    struct get_res gr;
    uint8_t kid[32];
    hm_rt_contact closest[4];
    const int x = 20;

    hm_dht_config_default(&cfg);
    net = bootstrapped(40, &cfg);
    do_put(net, 1, "churned", NULL, "kept", now_s(net) + 600, &pr);
    cr_assert_eq(pr.stored, 5);
    hm_dht_key_id((const uint8_t *)"churned", 7, kid);
    size_t n = hm_rt_closest(hm_dht_routing(net->nodes[x].d), kid, 4, closest, 0);
    cr_assert_eq(n, 4);
    for (size_t i = 0; i < n; i++)
        for (int j = 0; j < net->n; j++)
            if (j != x && memcmp(net->nodes[j].id.pk, closest[i].pk, 32) == 0)
                net->nodes[j].dead = 1;

    uint64_t t0 = net->now;
    do_get(net, x, "churned", &gr);
    cr_assert(gr.status == 0 && gr.n == 1 && value_is(&gr, 0, "kept"));
    cr_assert_gt(gr.info.timeouts, 0, "the first get met the dead nodes");
    cr_assert_geq(net->now - t0, cfg.request_timeout_min_ms, "and waited for them");

    uint64_t dead0 = net->to_dead;
    t0 = net->now;
    do_get(net, x, "churned", &gr);
    uint64_t took = net->now - t0;
    cr_assert_eq(gr.status, 0);
    cr_assert(gr.n == 1 && value_is(&gr, 0, "kept"), "the value is found");
    cr_assert_gt(net->to_dead, dead0, "the suspects were asked");
    cr_assert_lt(took, cfg.request_timeout_min_ms,
                 "the get took %llu ms of virtual time (%u requests)", (unsigned long long)took,
                 gr.info.requests);

    /* A key nobody holds, with a dead node among its closest: the get
     * waits for the suspects, since one of them might hold it. */
    char absent[32];
    int found_key = 0;
    for (int k = 0; k < 1000 && !found_key; k++) {
        hm_rt_contact c3[3];
        snprintf(absent, sizeof(absent), "absent-%d", k);
        hm_dht_key_id((const uint8_t *)absent, strlen(absent), kid);
        size_t m = hm_rt_closest(hm_dht_routing(net->nodes[x].d), kid, 3, c3, 0);
        for (size_t i = 0; i < m; i++)
            for (size_t j = 0; j < n; j++)
                found_key |= memcmp(c3[i].id, closest[j].id, HM_RT_ID_BYTES) == 0;
    }
    cr_assert(found_key);
    t0 = net->now;
    do_get(net, x, absent, &gr);
    cr_assert_eq(gr.status, 0);
    cr_assert_eq(gr.n, 0);
    cr_assert_geq(net->now - t0, cfg.request_timeout_min_ms, "it waited for the suspects");
    net_free(net);
}
/* -- end churn -- */

Test(dht, disjoint_paths_lookup_works)
{
    hm_dht_config cfg;
    struct tnet *net;
    struct put_res pr;
    struct get_res gr;

    hm_dht_config_default(&cfg);
    cfg.disjoint_paths = 3;
    net = bootstrapped(40, &cfg);
    do_put(net, 6, "paths", NULL, "three", now_s(net) + 600, &pr);
    cr_assert_eq(pr.status, 0);
    cr_assert_geq(pr.stored, 3);
    do_get(net, 16, "paths", &gr);
    cr_assert_eq(gr.n, 1);
    cr_assert(value_is(&gr, 0, "three"));
    net_free(net);
}

static size_t make_ping(uint32_t tid, const uint8_t *tok, uint8_t *buf, size_t cap)
{
    hm_dht_msg m;
    size_t len;
    memset(&m, 0, sizeof(m));
    m.type = HM_DHT_MSG_PING;
    m.tid = tid;
    m.token = tok;
    m.token_len = tok ? 8 : 0;
    cr_assert_eq(hm_dht_msg_encode(&m, 64, buf, cap, &len), 0);
    return len;
}

Test(dht, rate_limit_throttles_a_flood_but_not_others)
{
    hm_dht_config cfg;
    struct tnet *net;
    uint8_t buf[128], pk[32];
    struct sockaddr_in other;
    size_t len, flood_replies;
    hm_dht_stats st;

    hm_dht_config_default(&cfg);
    cfg.rate_per_s = 50;
    cfg.rate_burst = 100;
    cfg.rate_ban_ms = 10000;
    net = net_new(2, &cfg);
    memset(pk, 0x33, sizeof(pk));

    /* 1000 pings in one second from one address. */
    for (int i = 0; i < 1000; i++) {
        len = make_ping((uint32_t)i, NULL, buf, sizeof(buf));
        inject(net, 0, pk, &net->outside_addr, buf, len);
        if (i % 100 == 99)
            net_run(net, 100, NULL);
    }
    net_run(net, 50, NULL);
    flood_replies = net->out.n;
    cr_assert_geq(flood_replies, 100, "the burst should be served (%zu)", flood_replies);
    cr_assert_leq(flood_replies, 160, "the flood got %zu replies", flood_replies);
    hm_dht_get_stats(net->nodes[0].d, &st);
    cr_assert_geq(st.rate_limited, 1000 - 160);

    /* Another address is still answered. */
    other = net->outside_addr;
    other.sin_addr.s_addr = htonl(0xc0a80064u);
    len = make_ping(5000, NULL, buf, sizeof(buf));
    inject(net, 0, pk, &other, buf, len);
    net_run(net, 50, NULL);
    /* The reply goes to `other`, which is nobody in this network: count it by node 0's stats. */
    hm_dht_stats st2;
    hm_dht_get_stats(net->nodes[0].d, &st2);
    cr_assert_eq(st2.requests_received, st.requests_received + 1);

    /* The flooder kept going past a burst of excess: it is banned even after refilling time. */
    net_run(net, 3000, NULL);
    net->out.n = 0;
    len = make_ping(6000, NULL, buf, sizeof(buf));
    inject(net, 0, pk, &net->outside_addr, buf, len);
    net_run(net, 50, NULL);
    cr_assert_eq(net->out.n, 0, "a banned address was answered");
    /* After the ban it is served again. */
    net_run(net, 10000, NULL);
    len = make_ping(6001, NULL, buf, sizeof(buf));
    inject(net, 0, pk, &net->outside_addr, buf, len);
    net_run(net, 50, NULL);
    cr_assert_eq(net->out.n, 1);
    net_free(net);
}

static size_t make_store(uint32_t tid, const uint8_t *tok, const char *key, const char *val,
                         double exp, uint8_t *buf, size_t cap)
{
    hm_dht_msg m;
    size_t len;
    memset(&m, 0, sizeof(m));
    m.type = HM_DHT_MSG_STORE;
    m.tid = tid;
    m.token = tok;
    m.token_len = 8;
    m.record.key = (const uint8_t *)key;
    m.record.key_len = strlen(key);
    m.record.value = (const uint8_t *)val;
    m.record.value_len = strlen(val);
    m.record.expiration = exp;
    cr_assert_eq(hm_dht_msg_encode(&m, 0, buf, cap, &len), 0);
    return len;
}

Test(dht, store_needs_a_valid_token)
{
    struct tnet *net = net_new(1, NULL);
    uint8_t buf[512], pk[32], fake[8] = {1, 2, 3, 4, 5, 6, 7, 8}, tok[8];
    hm_dht_msg m;
    size_t len;
    hm_dht_stats st;
    struct sockaddr_in other;

    memset(pk, 0x44, sizeof(pk));
    len = make_store(1, fake, "x", "y", now_s(net) + 60, buf, sizeof(buf));
    inject(net, 0, pk, &net->outside_addr, buf, len);
    net_run(net, 50, NULL);
    cr_assert_eq(net->out.n, 1);
    cr_assert_eq(hm_dht_msg_decode(net->out.last, net->out.last_len, &m), 0);
    cr_assert_eq(m.type, HM_DHT_MSG_STORED);
    cr_assert_eq(m.status, -EACCES);
    hm_dht_get_stats(net->nodes[0].d, &st);
    cr_assert_eq(st.records, 0);

    /* The token from a PONG makes it valid, for this key and address only. */
    len = make_ping(2, NULL, buf, sizeof(buf));
    inject(net, 0, pk, &net->outside_addr, buf, len);
    net_run(net, 50, NULL);
    cr_assert_eq(hm_dht_msg_decode(net->out.last, net->out.last_len, &m), 0);
    cr_assert_eq(m.type, HM_DHT_MSG_PONG);
    cr_assert_eq(m.token_len, 8);
    memcpy(tok, m.token, 8);

    other = net->outside_addr;
    other.sin_port = htons(10000);
    len = make_store(3, tok, "x", "y", now_s(net) + 60, buf, sizeof(buf));
    inject(net, 0, pk, &other, buf, len); /* same key, other address */
    net_run(net, 50, NULL);
    hm_dht_get_stats(net->nodes[0].d, &st);
    cr_assert_eq(st.records, 0);

    len = make_store(4, tok, "x", "y", now_s(net) + 60, buf, sizeof(buf));
    inject(net, 0, pk, &net->outside_addr, buf, len);
    net_run(net, 50, NULL);
    cr_assert_eq(hm_dht_msg_decode(net->out.last, net->out.last_len, &m), 0);
    cr_assert_eq(m.type, HM_DHT_MSG_STORED);
    cr_assert_eq(m.status, 0);
    hm_dht_get_stats(net->nodes[0].d, &st);
    cr_assert_eq(st.records, 1);

    /* Still valid after one secret rotation (5 minutes), not after two. */
    net_run(net, 6 * 60 * 1000, NULL);
    len = make_store(5, tok, "x2", "y", now_s(net) + 60, buf, sizeof(buf));
    inject(net, 0, pk, &net->outside_addr, buf, len);
    net_run(net, 50, NULL);
    cr_assert_eq(hm_dht_msg_decode(net->out.last, net->out.last_len, &m), 0);
    cr_assert_eq(m.status, 0);
    net_run(net, 6 * 60 * 1000, NULL);
    len = make_store(6, tok, "x3", "y", now_s(net) + 60, buf, sizeof(buf));
    inject(net, 0, pk, &net->outside_addr, buf, len);
    net_run(net, 50, NULL);
    cr_assert_eq(hm_dht_msg_decode(net->out.last, net->out.last_len, &m), 0);
    cr_assert_eq(m.status, -EACCES);
    net_free(net);
}

Test(dht, unsolicited_replies_are_ignored)
{
    struct tnet *net = net_new(2, NULL);
    uint8_t buf[512], tok[8] = {0};
    hm_dht_msg m;
    size_t len;
    hm_dht_stats st0, st1;
    hm_identity evil;
    uint8_t seed[32] = {0xee};

    hm_identity_from_seed(seed, &evil);
    hm_dht_get_stats(net->nodes[0].d, &st0);
    /* A PONG nobody asked for, from a stranger. */
    memset(&m, 0, sizeof(m));
    m.type = HM_DHT_MSG_PONG;
    m.tid = 1234;
    m.token = tok;
    m.token_len = 8;
    cr_assert_eq(hm_dht_msg_encode(&m, 0, buf, sizeof(buf), &len), 0);
    inject(net, 0, evil.pk, &net->outside_addr, buf, len);
    net_run(net, 50, NULL);
    cr_assert_eq(hm_rt_size(hm_dht_routing(net->nodes[0].d)), 0);

    /* Node 0 pings node 1; a third party answers with the right tid first: ignored. */
    cr_assert_eq(hm_dht_bootstrap(net->nodes[0].d, net->nodes[1].id.pk,
                                  (const struct sockaddr *)&net->nodes[1].addr, net->now),
                 0);
    cr_assert_eq(net->qlen, 1);
    cr_assert_eq(hm_dht_msg_decode(net->q[net->qhead].data, net->q[net->qhead].len, &m), 0);
    m.type = HM_DHT_MSG_PONG;
    m.token = tok;
    m.token_len = 8;
    m.pad_len = 0;
    cr_assert_eq(hm_dht_msg_encode(&m, 0, buf, sizeof(buf), &len), 0);
    inject(net, 0, evil.pk, &net->outside_addr, buf, len);
    net_run(net, 200, NULL);
    hm_dht_get_stats(net->nodes[0].d, &st1);
    cr_assert_eq(st1.bad_messages, st0.bad_messages + 2);
    cr_assert_geq(st1.replies_received, 1); /* node 1's real PONG, then its lookup replies */
    cr_assert_eq(hm_rt_find(hm_dht_routing(net->nodes[0].d), evil.node_id, NULL), -ENOENT);
    cr_assert_eq(hm_rt_find(hm_dht_routing(net->nodes[0].d), net->nodes[1].id.node_id, NULL), 0);
    net_free(net);
}

Test(dht, client_mode_queries_but_is_invisible)
{
    hm_dht_config cfg;
    struct tnet *net = bootstrapped(20, NULL);
    struct tnode *c;
    struct put_res pr;
    struct get_res gr;
    uint8_t buf[128], pk[32];
    size_t len;

    /* Add a client-mode node 20. */
    hm_dht_config_default(&cfg);
    cfg.client_mode = 1;
    net->n = 21;
    node_init(net, 20, &cfg);
    c = &net->nodes[20];
    cr_assert_eq(hm_dht_bootstrap(c->d, net->nodes[0].id.pk,
                                  (const struct sockaddr *)&net->nodes[0].addr, net->now),
                 0);
    net_run(net, 10000, NULL);
    cr_assert_geq(hm_rt_size(hm_dht_routing(c->d)), 10);

    do_put(net, 20, "from-client", NULL, "hi", now_s(net) + 300, &pr);
    cr_assert_eq(pr.status, 0);
    do_get(net, 20, "from-client", &gr);
    cr_assert_eq(gr.n, 1);
    do_get(net, 7, "from-client", &gr);
    cr_assert_eq(gr.n, 1);
    cr_assert(value_is(&gr, 0, "hi"));

    for (int i = 0; i < 20; i++)
        cr_assert_eq(hm_rt_find(hm_dht_routing(net->nodes[i].d), c->id.node_id, NULL), -ENOENT,
                     "client node in node %d's table", i);
    /* It answers nothing. */
    memset(pk, 0x55, sizeof(pk));
    net->out.n = 0;
    len = make_ping(1, NULL, buf, sizeof(buf));
    inject(net, 20, pk, &net->outside_addr, buf, len);
    net_run(net, 100, NULL);
    cr_assert_eq(net->out.n, 0);
    net_free(net);
}

Test(dht, cancel_and_free_fire_exactly_once)
{
    struct tnet *net = bootstrapped(10, NULL);
    struct get_res g1, g2;
    struct put_res p1;
    uint64_t op;

    memset(&g1, 0, sizeof(g1));
    cr_assert_eq(hm_dht_get(net->nodes[3].d, (const uint8_t *)"a", 1, net->now, 5000, get_cb, &g1,
                            &op),
                 0);
    cr_assert_eq(g1.calls, 0);
    cr_assert_eq(hm_dht_cancel(net->nodes[3].d, op), 0);
    cr_assert_eq(g1.calls, 1);
    cr_assert_eq(g1.status, -ECANCELED);
    cr_assert_eq(hm_dht_cancel(net->nodes[3].d, op), -ENOENT);
    net_run(net, 6000, NULL);
    cr_assert_eq(g1.calls, 1);

    memset(&g2, 0, sizeof(g2));
    memset(&p1, 0, sizeof(p1));
    cr_assert_eq(hm_dht_get(net->nodes[4].d, (const uint8_t *)"b", 1, net->now, 5000, get_cb, &g2,
                            NULL),
                 0);
    cr_assert_eq(hm_dht_put(net->nodes[4].d, (const uint8_t *)"c", 1, NULL, 0, 0,
                            (const uint8_t *)"v", 1, now_s(net) + 100, net->now, 5000, put_cb, &p1,
                            NULL),
                 0);
    net_run(net, 15, NULL); /* partway */
    hm_dht_free(net->nodes[4].d);
    net->nodes[4].d = NULL;
    net->nodes[4].dead = 1;
    cr_assert_eq(g2.calls, 1);
    cr_assert_eq(g2.status, -ECANCELED);
    cr_assert_eq(p1.calls, 1);
    cr_assert_eq(p1.status, -ECANCELED);
    net_run(net, 6000, NULL);
    cr_assert_eq(g2.calls, 1);
    cr_assert_eq(p1.calls, 1);
    net_free(net);
}

Test(dht, immediate_failure_is_deferred)
{
    struct tnet *net = net_new(1, NULL);
    struct get_res g;
    struct put_res p;

    memset(&g, 0, sizeof(g));
    memset(&p, 0, sizeof(p));
    /* An empty table: nothing to ask. */
    cr_assert_eq(hm_dht_get(net->nodes[0].d, (const uint8_t *)"k", 1, net->now, 1000, get_cb, &g,
                            NULL),
                 0);
    cr_assert_eq(hm_dht_put(net->nodes[0].d, (const uint8_t *)"k", 1, NULL, 0, 0,
                            (const uint8_t *)"v", 1, now_s(net) + 10, net->now, 1000, put_cb, &p,
                            NULL),
                 0);
    cr_assert_eq(g.calls, 0);
    cr_assert_eq(p.calls, 0);
    cr_assert_eq(hm_dht_periodic(net->nodes[0].d, net->now) >= net->now, 1);
    /* Alone, the node is the swarm: the key is absent, the put is kept
     * here (lone_node_is_a_swarm). */
    cr_assert_eq(g.calls, 1);
    cr_assert_eq(g.status, 0);
    cr_assert_eq(g.n, 0);
    cr_assert_eq(p.calls, 1);
    cr_assert_eq(p.status, 0);
    /* Synchronous refusals fire nothing. */
    cr_assert_eq(hm_dht_put(net->nodes[0].d, (const uint8_t *)"k", 1, NULL, 0, 0,
                            (const uint8_t *)"v", 1, now_s(net) - 1, net->now, 1000, put_cb, &p,
                            NULL),
                 -ETIME);
    hm_dht_periodic(net->nodes[0].d, net->now);
    cr_assert_eq(p.calls, 1);
    net_free(net);
}

/*
 * A node with nobody in its table keeps what it puts and finds it again:
 * plain values and dictionary subkeys (as expert declarations are), and a
 * key it never stored reads as absent, not as an unreachable swarm.
 */
Test(dht, lone_node_is_a_swarm)
{
    struct tnet *net = net_new(1, NULL);
    hm_dht *d = net->nodes[0].d;
    struct get_res g;
    struct put_res p;

    memset(&p, 0, sizeof(p));
    cr_assert_eq(hm_dht_put(d, (const uint8_t *)"plain", 5, NULL, 0, 0, (const uint8_t *)"v1", 2,
                            now_s(net) + 60, net->now, 1000, put_cb, &p, NULL),
                 0);
    hm_dht_periodic(d, net->now);
    cr_assert_eq(p.calls, 1);
    cr_assert_eq(p.status, 0, "lone put: %d", p.status);
    cr_assert_eq(p.stored, 1);
    for (int i = 0; i < 2; i++) {
        char sk[8];
        snprintf(sk, sizeof(sk), "s%d", i);
        memset(&p, 0, sizeof(p));
        cr_assert_eq(hm_dht_put(d, (const uint8_t *)"dict", 4, (const uint8_t *)sk, 2, 1,
                                (const uint8_t *)sk, 2, now_s(net) + 60, net->now, 1000, put_cb,
                                &p, NULL),
                     0);
        hm_dht_periodic(d, net->now);
        cr_assert_eq(p.status, 0);
    }

    memset(&g, 0, sizeof(g));
    cr_assert_eq(hm_dht_get(d, (const uint8_t *)"plain", 5, net->now, 1000, get_cb, &g, NULL), 0);
    hm_dht_periodic(d, net->now);
    cr_assert_eq(g.calls, 1);
    cr_assert_eq(g.status, 0);
    cr_assert_eq(g.n, 1);
    cr_assert_eq(g.value_lens[0], 2);
    cr_assert_eq(memcmp(g.values[0], "v1", 2), 0);

    memset(&g, 0, sizeof(g));
    cr_assert_eq(hm_dht_get(d, (const uint8_t *)"dict", 4, net->now, 1000, get_cb, &g, NULL), 0);
    hm_dht_periodic(d, net->now);
    cr_assert_eq(g.status, 0);
    cr_assert_eq(g.n, 2, "the dictionary has %zu of 2 subkeys", g.n);

    memset(&g, 0, sizeof(g));
    cr_assert_eq(hm_dht_get(d, (const uint8_t *)"absent", 6, net->now, 1000, get_cb, &g, NULL), 0);
    hm_dht_periodic(d, net->now);
    cr_assert_eq(g.status, 0);
    cr_assert_eq(g.n, 0);
    net_free(net);
}

Test(dht, garbage_input_is_counted_and_harmless)
{
    struct tnet *net = bootstrapped(5, NULL);
    uint8_t buf[1300], pk[32], nid[32];
    uint64_t s = 12345;
    hm_dht_stats st;

    memset(pk, 0x66, sizeof(pk));
    for (int i = 0; i < 2000; i++) {
        size_t len = (size_t)(xorshift(&s) % sizeof(buf));
        for (size_t j = 0; j < len; j++)
            buf[j] = (uint8_t)xorshift(&s);
        if (len > 1)
            buf[0] = (uint8_t)(0x94 + (i % 4));
        hm_dht_input(net->nodes[0].d, pk, (const struct sockaddr *)&net->outside_addr, buf, len,
                     net->now);
    }
    hm_dht_get_stats(net->nodes[0].d, &st);
    cr_assert_gt(st.bad_messages + st.rate_limited, 1900);
    hm_node_id_from_pk(pk, nid);
    cr_assert_eq(hm_rt_find(hm_dht_routing(net->nodes[0].d), nid, NULL), -ENOENT);
    net_free(net);
}

struct many_res {
    int calls;
    size_t n_keys;
    int status[8];
    size_t n[8];
    char first[8][64];
};

static void many_cb(void *ud, const hm_dht_many_result *res, size_t n_keys)
{
    struct many_res *r = ud;
    r->calls++;
    r->n_keys = n_keys;
    for (size_t i = 0; i < n_keys && i < 8; i++) {
        r->status[i] = res[i].status;
        r->n[i] = res[i].n;
        if (res[i].n > 0) {
            size_t l = HM_MIN(res[i].values[0].rec.value_len, sizeof(r->first[i]) - 1);
            memcpy(r->first[i], res[i].values[0].rec.value, l);
            r->first[i][l] = '\0';
        }
    }
}

Test(dht, get_many_answers_every_key_once_in_order)
{
    hm_dht_config cfg;
    hm_dht_config_default(&cfg);
    /* Two lookup slots for eight keys: the batch must queue and still finish. */
    cfg.max_lookups = 2;
    struct tnet *net = bootstrapped(30, &cfg);
    struct put_res pr;
    const char *names[6] = {"k0", "k1", "k2", "k3", "k4", "k5"};
    for (int i = 0; i < 6; i++) {
        char v[16];
        snprintf(v, sizeof(v), "value-%d", i);
        do_put(net, 3 + i, names[i], NULL, v, now_s(net) + 600, &pr);
        cr_assert_eq(pr.status, 0);
    }
    const uint8_t *keys[8];
    size_t lens[8];
    for (int i = 0; i < 6; i++) {
        keys[i] = (const uint8_t *)names[i];
        lens[i] = 2;
    }
    keys[6] = (const uint8_t *)"missing-a";
    lens[6] = 9;
    keys[7] = (const uint8_t *)"missing-b";
    lens[7] = 9;

    struct many_res mr = {0};
    hm_dht *d = net->nodes[20].d;
    cr_assert_eq(hm_dht_get_many(d, keys, lens, 8, net->now, 10000, many_cb, &mr), 0);
    cr_assert_eq(mr.calls, 0, "the callback fired inside hm_dht_get_many");
    net->nodes[20].next = net->now;
    net_run(net, 15000, &mr.calls);
    cr_assert_eq(mr.calls, 1);
    cr_assert_eq(mr.n_keys, 8);
    for (int i = 0; i < 6; i++) {
        char v[16];
        snprintf(v, sizeof(v), "value-%d", i);
        cr_assert_eq(mr.status[i], 0);
        cr_assert_eq(mr.n[i], 1, "key %d", i);
        cr_assert_str_eq(mr.first[i], v, "results come back in the order of the keys");
    }
    cr_assert_eq(mr.status[6], 0);
    cr_assert_eq(mr.n[6], 0);
    cr_assert_eq(mr.n[7], 0);

    /* Bounds and arguments. */
    cr_assert_eq(hm_dht_get_many(d, keys, lens, 0, net->now, 1000, many_cb, &mr), -EINVAL);
    cr_assert_eq(hm_dht_get_many(d, keys, lens, HM_DHT_MANY_MAX + 1, net->now, 1000, many_cb, &mr),
                 -EMSGSIZE);

    /* A batch pending at free ends once, with every key cancelled or answered. */
    struct many_res late = {0};
    cr_assert_eq(hm_dht_get_many(d, keys, lens, 8, net->now, 10000, many_cb, &late), 0);
    net->nodes[20].d = NULL;
    hm_dht_free(d);
    cr_assert_eq(late.calls, 1);
    for (int i = 0; i < 8; i++)
        cr_assert_eq(late.status[i], -ECANCELED);
    net_free(net);
}

/* -- held since test -- */
/* The index in g of the value whose subkey is sub, or -1. */
static int find_sub(const struct get_res *g, const char *sub)
{
    for (size_t i = 0; i < g->n && i < MAXV; i++)
        if (g->has_subkey[i] && g->subkey_lens[i] == strlen(sub) &&
            memcmp(g->subkeys[i], sub, strlen(sub)) == 0)
            return (int)i;
    return -1;
}

/*
 * Two owners declare one name 60 s apart, the later with the longer
 * expiration. A reader's get says how long the replicas have held each:
 * the first owner's for about 60 s more. A replica that lies, answering
 * in place of one of them with the later owner's (validly signed) record
 * held for 2^32 - 1 s and without the first owner's, does not change the
 * order: it is one origin of several, and the reader takes the median.
 */
Test(dht, held_times_order_owners_and_one_forging_replica_does_not_decide)
{
    struct tnet *net = bootstrapped(30, NULL);
    struct put_res pr;
    struct get_res gr;
    char ma[HM_DHT_OWNER_MARKER_LEN + 1], mb[HM_DHT_OWNER_MARKER_LEN + 1];
    double t = now_s(net);

    hm_dht_owner_marker(net->nodes[3].id.pk, ma);
    hm_dht_owner_marker(net->nodes[8].id.pk, mb);
    do_put(net, 3, "ffn.1", ma, "A", t + 600, &pr);
    cr_assert_eq(pr.status, 0);
    cr_assert_geq(pr.stored, 3);
    net_run(net, 60000, NULL);
    do_put(net, 8, "ffn.1", mb, "B", now_s(net) + 900, &pr);
    cr_assert_eq(pr.status, 0);
    net_run(net, 5000, NULL);

    do_get(net, 20, "ffn.1", &gr);
    cr_assert_eq(gr.n, 2);
    int a = find_sub(&gr, ma), b = find_sub(&gr, mb);
    cr_assert(a >= 0 && b >= 0);
    cr_assert_geq(gr.held[a], 60, "the first owner's held %lld s", (long long)gr.held[a]);
    cr_assert_leq(gr.held[b], 10, "the later owner's held %lld s", (long long)gr.held[b]);

    /* The forger answers node 21's first GET in place of its target. */
    uint8_t sig[HM_DHT_SIG_BYTES], buf[HM_DHT_PROTO_MAX_SIZE], swarm[HM_SWARM_ID_BYTES];
    hm_dht_record fb = {.key = (const uint8_t *)"ffn.1", .key_len = 5, .has_subkey = 1,
                        .subkey = (const uint8_t *)mb, .subkey_len = strlen(mb),
                        .value = (const uint8_t *)"B", .value_len = 1,
                        .expiration = now_s(net) + 800, .seq = 1};
    hm_swarm_id("test", NULL, 0, swarm);
    cr_assert_eq(hm_dht_record_sign(&fb, &net->nodes[8].id, swarm, now_s(net), 86400, sig), 0);
    fb.sig = sig;
    memset(&gr, 0, sizeof(gr));
    cr_assert_eq(hm_dht_get(net->nodes[21].d, (const uint8_t *)"ffn.1", 5, net->now, 10000,
                            get_cb, &gr, NULL),
                 0);
    net->nodes[21].next = net->now;
    int forged = 0;
    for (size_t i = 0; i < net->qlen && !forged; i++) {
        struct pkt *p = &net->q[net->qhead + i];
        hm_dht_msg q, m;
        uint8_t tok[8] = {9, 9, 9, 9, 9, 9, 9, 9};
        size_t len;
        if (p->from != 21 || hm_dht_msg_decode(p->data, p->len, &q) < 0 ||
            q.type != HM_DHT_MSG_GET)
            continue;
        cr_assert(q.flags & HM_DHT_FLAG_HELD, "a GET that does not ask for held times");
        memset(&m, 0, sizeof(m));
        m.type = HM_DHT_MSG_VALUE;
        m.tid = q.tid;
        m.token = tok;
        m.token_len = 8;
        m.n_records = 1;
        m.records[0] = fb;
        m.has_held = 1;
        m.held[0] = UINT32_MAX;
        cr_assert_eq(hm_dht_msg_encode(&m, 0, buf, sizeof(buf), &len), 0);
        inject(net, 21, net->nodes[p->to].id.pk, &net->nodes[p->to].addr, buf, len);
        forged = 1;
    }
    cr_assert(forged);
    net_run(net, 15000, &gr.calls);
    cr_assert_eq(gr.calls, 1);
    cr_assert_eq(gr.n, 2);
    a = find_sub(&gr, ma);
    b = find_sub(&gr, mb);
    cr_assert(a >= 0 && b >= 0);
    fprintf(stderr, "held times with one forging replica: first owner %lld s, later %lld s\n",
            (long long)gr.held[a], (long long)gr.held[b]);
    cr_assert_gt(gr.held[a], gr.held[b], "the forger decided: %lld s against %lld s",
                 (long long)gr.held[a], (long long)gr.held[b]);
    cr_assert_leq(gr.held[b], 30);
    net_free(net);
}

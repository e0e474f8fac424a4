/*
 * fuzz_dht_proto: the DHT message decoder and the DHT core's input path
 * against arbitrary bytes. Each input is used three ways, against a fresh
 * node so that an input behaves the same whatever ran before it:
 *   1. decoded by hm_dht_msg_decode; whatever decodes must encode again and
 *      decode to the same message (an oracle: a mismatch aborts);
 *   2. fed to hm_dht_input of a node that has three peers in its routing
 *      table and a get in flight to them, as if one of those peers sent it;
 *   3. when it decodes as a reply, re-sent with the transaction id of the
 *      node's outstanding GET to that peer, so that records and contacts
 *      reach the lookup and record-checking code.
 * The node is then run past every timeout and freed; the get's callback
 * must have fired exactly once. The seed corpus holds one valid message of
 * every type, and a VALUE with held times and a GET that asks for them.
 */
#include "config.h"

#include "dht/dht.h"
#include "dht/proto.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_NOW (UINT64_C(1700000000) * 1000)
#define NPEERS 3

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                            \
    do {                                                                                       \
        if (!(cond))                                                                           \
            abort();                                                                           \
    } while (0)

struct fixture {
    int ready;
    hm_identity node, peers[NPEERS];
    struct sockaddr_in node_addr, peer_addr[NPEERS];
    uint8_t swarm[HM_SWARM_ID_BYTES];
};
static struct fixture fx;

/* What the node under test sent, per run. */
struct run {
    uint64_t rng;
    uint32_t get_tid[NPEERS];
    int get_sent[NPEERS];
    int get_calls;
};

static void fixture_init(void)
{
    uint8_t seed[32];

    if (fx.ready)
        return;
    if (hm_crypto_init() < 0)
        abort();
    memset(seed, 0xd1, sizeof(seed));
    CHECK(hm_identity_from_seed(seed, &fx.node) == 0);
    for (int i = 0; i < NPEERS; i++) {
        memset(seed, 0xe0 + i, sizeof(seed));
        CHECK(hm_identity_from_seed(seed, &fx.peers[i]) == 0);
        fx.peer_addr[i].sin_family = AF_INET;
        fx.peer_addr[i].sin_addr.s_addr = htonl(0x0a000002u + (uint32_t)i);
        fx.peer_addr[i].sin_port = htons(5000);
    }
    hm_swarm_id("fuzz", NULL, 0, fx.swarm);
    fx.ready = 1;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fixture_init();
    return 0;
}

static void f_random(void *ud, void *buf, size_t len)
{
    struct run *r = ud;
    uint8_t *p = buf;
    for (size_t i = 0; i < len; i++) {
        r->rng ^= r->rng << 13;
        r->rng ^= r->rng >> 7;
        r->rng ^= r->rng << 17;
        p[i] = (uint8_t)(r->rng >> 32);
    }
}

static int f_send(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                  const uint8_t *msg, size_t len)
{
    struct run *r = ud;
    hm_dht_msg m;

    (void)to;
    CHECK(len <= HM_DHT_PROTO_MAX_SIZE);
    /* Everything the node sends must be a message it can decode itself. */
    CHECK(hm_dht_msg_decode(msg, len, &m) == 0);
    if (m.type == HM_DHT_MSG_GET)
        for (int i = 0; i < NPEERS; i++)
            if (memcmp(pk, fx.peers[i].pk, HM_PK_BYTES) == 0)
            {
                r->get_tid[i] = m.tid;
                r->get_sent[i] = 1;
            }
    return 0;
}

static void f_get_cb(void *ud, int status, const hm_dht_value *values, size_t n,
                     const hm_dht_lookup_info *info)
{
    struct run *r = ud;
    (void)status;
    (void)info;
    for (size_t i = 0; i < n; i++)
        CHECK(values[i].rec.key_len == 4 && memcmp(values[i].rec.key, "fuzz", 4) == 0);
    r->get_calls++;
}

/* The decoder's oracle: decode, encode, decode again; both decodings agree. */
static void check_roundtrip(const uint8_t *data, size_t size, hm_dht_msg *m, int *is_reply)
{
    static hm_dht_msg again;
    static uint8_t buf[4096];
    size_t len;

    *is_reply = 0;
    if (hm_dht_msg_decode(data, size, m) != 0)
        return;
    CHECK(hm_dht_msg_encode(m, 0, buf, sizeof(buf), &len) == 0);
    *is_reply = !hm_dht_msg_is_request(m->type);
    /* Integers written as floats by the sender's choice can grow a full datagram past the cap. */
    if (len > HM_DHT_PROTO_MAX_SIZE)
        return;
    CHECK(hm_dht_msg_decode(buf, len, &again) == 0);
    CHECK(again.type == m->type && again.tid == m->tid && again.flags == m->flags);
    CHECK(again.token_len == m->token_len && again.n_records == m->n_records &&
          again.n_contacts == m->n_contacts && again.more == m->more &&
          again.status == m->status && again.has_cursor == m->has_cursor);
    for (size_t i = 0; i < m->n_contacts; i++)
        CHECK(memcmp(again.contacts[i].id, m->contacts[i].id, HM_RT_ID_BYTES) == 0);
    /* -- held since -- */
    CHECK(again.has_held == m->has_held);
    for (size_t i = 0; m->has_held && i < m->n_records; i++)
        CHECK(again.held[i] == m->held[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static hm_dht_msg m;
    static uint8_t buf[4096];
    hm_dht_config cfg;
    hm_dht_io io;
    hm_dht *d = NULL;
    struct run r;
    size_t len;
    int is_reply;
    uint64_t now = FUZZ_NOW;

    fixture_init();
    check_roundtrip(data, size, &m, &is_reply);

    memset(&r, 0, sizeof(r));
    r.rng = 0x243f6a8885a308d3ull;
    io.ud = &r;
    io.send = f_send;
    io.random = f_random;
    hm_dht_config_default(&cfg);
    CHECK(hm_dht_new(&fx.node, fx.swarm, &cfg, &io, now, &d) == 0);

    /* Three peers introduce themselves with PINGs, then the node looks up "fuzz". */
    for (int i = 0; i < NPEERS; i++) {
        hm_dht_msg p;
        memset(&p, 0, sizeof(p));
        p.type = HM_DHT_MSG_PING;
        p.tid = (uint32_t)i;
        CHECK(hm_dht_msg_encode(&p, 64, buf, sizeof(buf), &len) == 0);
        hm_dht_input(d, fx.peers[i].pk, (const struct sockaddr *)&fx.peer_addr[i], buf, len, now);
    }
    CHECK(hm_dht_get(d, (const uint8_t *)"fuzz", 4, now, 5000, f_get_cb, &r, NULL) == 0);
    for (int i = 0; i < NPEERS; i++)
        CHECK(r.get_sent[i]);

    /* 2. The raw input from peer 0. */
    hm_dht_input(d, fx.peers[0].pk, (const struct sockaddr *)&fx.peer_addr[0], data, size, now);

    /* 3. As a reply to the node's GET to peer 1. */
    if (is_reply) {
        m.tid = r.get_tid[1];
        if (hm_dht_msg_encode(&m, 0, buf, sizeof(buf), &len) == 0 && len <= HM_DHT_PROTO_MAX_SIZE)
            hm_dht_input(d, fx.peers[1].pk, (const struct sockaddr *)&fx.peer_addr[1], buf, len,
                         now + 1);
    }

    /* Past every timeout: the get ends, exactly once. */
    for (int i = 0; i < 20 && r.get_calls == 0; i++) {
        now += 1000;
        hm_dht_periodic(d, now);
    }
    CHECK(r.get_calls == 1);
    hm_dht_free(d);
    CHECK(r.get_calls == 1);
    return 0;
}

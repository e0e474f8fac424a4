/*
 * dht: the sans-I/O Kademlia core of one node (see dht.h for the contract).
 * It owns the routing table, the record store, the outstanding requests,
 * the lookups in flight, the per-address rate limiter, the tokens other
 * peers gave us and the secrets of the tokens we give. Everything it sends
 * goes through io->send; everything it learns comes from hm_dht_input; time
 * comes from its callers.
 *
 * Re-entrancy. io->send must not call back into this node (the node and the
 * simulator queue deliveries). Callbacks of finished operations are queued
 * and fired at the end of hm_dht_input and hm_dht_periodic, after the node's
 * state is consistent, so a callback may start, cancel or inspect
 * operations; it must not free the node.
 */
#include "config.h"

#include "dht/dht.h"

#include "dht/proto.h"
#include "src/base/hmap.h"
#include "src/base/util.h"

#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>

#define MOD "dht"

/* Most lookup paths one operation runs side by side. */
#define MAX_PATHS 8
/* Pages fetched from one node for one dictionary. */
#define MAX_PAGES 16
/* Distinct records (plain value or subkeys) one get collects. */
#define MAX_HELD 512
/* Records of a get result cached at the closest node that lacked them. */
#define MAX_CACHE_RECORDS 8
/* Outstanding requests of the whole node. */
#define MAX_REQS 4096
/* The token secrets rotate this often; tokens of the previous secret stay valid. */
#define SECRET_ROTATE_MS (5ull * 60 * 1000)
/* How long we trust a token a peer gave us (a little under one rotation). */
#define PEER_TOKEN_MS (4ull * 60 * 1000)
#define SWEEP_MS (60ull * 1000)
/* Bounds of the tables keyed by peer or address. */
#define MAX_PEER_TOKENS 2048
#define MAX_RATE_ENTRIES 4096
/* Padding of a first-contact PING: enough for the PONG. */
#define PING_PAD 48
/* Refresh lookups started by one periodic call. */
#define MAX_REFRESH_PER_CALL 4

/* ---- small keyed tables with LRU eviction ---- */

/*
 * A table of fixed-size entries under byte keys (at most 32 bytes, chosen by
 * peers: their keys and addresses), found through an hmap so nobody can aim
 * keys at one chain, with a hard bound on entries and least-recently-used
 * eviction past it. Memory grows with use, so an idle node in a 10,000-node
 * simulation costs little.
 */
struct lent {
    hm_hmap_node node;
    TAILQ_ENTRY(lent) lru; /* oldest first */
    uint8_t klen;
    uint8_t key[32];
    /* payload follows, aligned by the pointers above */
};

struct ltab {
    hm_hmap map;
    TAILQ_HEAD(, lent) lru;
    size_t max, psize;
};

static void *lent_payload(struct lent *e) { return (void *)(e + 1); }

static void ltab_remove(struct ltab *t, struct lent *e)
{
    hm_hmap_remove(&t->map, &e->node);
    TAILQ_REMOVE(&t->lru, e, lru);
    free(e);
}

static int ltab_init(struct ltab *t, size_t max, size_t psize)
{
    memset(t, 0, sizeof(*t));
    t->max = max;
    t->psize = psize;
    TAILQ_INIT(&t->lru);
    return hm_hmap_init(&t->map, 16, max);
}

static void ltab_free(struct ltab *t)
{
    struct lent *e;

    while ((e = TAILQ_FIRST(&t->lru)) != NULL)
        ltab_remove(t, e);
    hm_hmap_free(&t->map);
}

/*
 * Finds key; with create, makes a zeroed entry when missing (evicting the
 * least recently used one at the bound). Marks the entry used. NULL when
 * missing (or out of memory).
 */
static void *ltab_get(struct ltab *t, const uint8_t *key, size_t klen, int create)
{
    struct lent *e = hm_hmap_entry(hm_hmap_find(&t->map, key, klen), struct lent, node);

    if (e != NULL) {
        TAILQ_REMOVE(&t->lru, e, lru);
        TAILQ_INSERT_TAIL(&t->lru, e, lru);
        return lent_payload(e);
    }
    if (!create)
        return NULL;
    if (hm_hmap_count(&t->map) >= t->max && !TAILQ_EMPTY(&t->lru))
        ltab_remove(t, TAILQ_FIRST(&t->lru));
    e = calloc(1, sizeof(*e) + t->psize);
    if (e == NULL)
        return NULL;
    e->klen = (uint8_t)klen;
    memcpy(e->key, key, klen);
    hm_hmap_insert(&t->map, &e->node, e->key, e->klen);
    TAILQ_INSERT_TAIL(&t->lru, e, lru);
    return lent_payload(e);
}

/* ---- state ---- */

struct rate {
    int init;
    double tokens;
    double excess;
    uint64_t last_ms;
    uint64_t banned_until;
};

struct peer_token {
    uint8_t addr[18];
    uint8_t alen;
    uint8_t tlen;
    uint8_t token[HM_DHT_TOKEN_MAX];
    uint64_t got_ms;
};

/*
 * C_SLOW: its request passed its adaptive timeout (it still lives, and is
 * sent a second time, on the fixed request timeout). A slow candidate holds
 * no slot of the path's alpha, nor the lookup's end once num_replicas
 * others answered: the lookup asks the next candidate at once and finishes
 * without it, but a late answer still counts while the lookup runs. So a
 * contact that died costs a lookup one adaptive timeout, not the two tries
 * of the fixed one; a path with fewer answers (a small swarm) still waits.
 * C_SUSPECT: asked while a suspect (its last request timed out): waited for
 * until its adaptive timeout, but without a slot of alpha, and by a get
 * only until it has found the value and num_replicas answers.
 */
enum cand_state { C_NEW, C_INFLIGHT, C_ANSWERED, C_FAILED, C_SLOW, C_SUSPECT };

#define SUSPECTS_MAX 256
#define SUSPECT_MS 60000

struct cand {
    hm_rt_contact c;
    uint8_t state;
    uint8_t has_value;
    uint8_t pages;
    uint16_t hops;
};

struct lpath {
    struct cand *c;
    size_t n;
    unsigned inflight;
    int done;
    /*
     * The last reply brought nothing closer than what the path knew: as
     * in the Kademlia paper, the path then asks all of the k closest it
     * has not asked yet at once instead of alpha at a time.
     */
    int stalled;
};

/* A record copied out of a datagram, with the bytes it points to. */
struct held {
    hm_dht_record rec;
    uint8_t *buf;
    uint8_t source_pk[HM_PK_BYTES];
    int64_t held_s; /* get_many's copies: the value's held_s */
};

/*
 * -- held since -- The replicas of a get that told held times (dht.h,
 * hm_dht_value.held_s), and what each said: a replica is a node that
 * answered with records of the key (this node's own store is one), at the
 * origin of the address it answered from. At most HELD_REPS replicas and
 * HELD_OBS observations per get; those past them are not counted.
 */
#define HELD_REPS 64
#define HELD_OBS 4096
struct held_rep {
    uint8_t pk[HM_PK_BYTES];
    hm_origin org;
};
struct held_obs {
    uint16_t held; /* index in op->held */
    uint16_t rep;  /* index in op->reps */
    uint32_t secs;
};

enum op_kind { OP_FIND, OP_GET, OP_PUT };
enum op_phase { PH_LOOKUP, PH_STORE, PH_DONE };

struct op {
    TAILQ_ENTRY(op) link; /* in d->ops while active, then in d->done */
    uint64_t id;
    int kind;
    int phase;
    int join; /* our own bootstrap lookup: refresh the far buckets after it */
    int status;
    uint8_t target[HM_RT_ID_BYTES];
    uint64_t start_ms, deadline_ms;
    hm_dht_get_cb get_cb;
    hm_dht_put_cb put_cb;
    void *ud;
    unsigned npaths;
    struct lpath paths[MAX_PATHS];
    hm_dht_lookup_info info;
    /* get */
    uint8_t *key;
    size_t key_len;
    struct held *held;
    size_t nheld;
    int found;
    /* -- held since -- */
    struct held_rep *reps;
    size_t n_reps;
    struct held_obs *obs;
    size_t n_obs;
    /* put */
    struct held put;
    unsigned stored, store_pending;
    int store_err, store_timeouts;
};

enum req_purpose { P_LOOKUP, P_STORE, P_DETACHED, P_BOOT };

struct req {
    uint32_t tid;
    uint8_t type;
    uint8_t purpose;
    uint8_t path;
    uint64_t op_id;
    uint8_t pk[HM_PK_BYTES];
    uint8_t id[HM_RT_ID_BYTES];
    struct sockaddr_storage addr;
    uint64_t sent_ms, deadline_ms;
    /* The adaptive timeout: at soft_ms a lookup stops waiting for this
     * request (C_SLOW, a suspect); the request itself lives, and is sent a
     * second time, on the fixed request_timeout_ms (deadline_ms). */
    uint64_t soft_ms;
    int slowed;
    /* The datagram body of a lookup or store request, kept to send it once
     * more at its first timeout (NULL: no second try). */
    uint8_t *pkt;
    size_t pkt_len;
    int resent;
    uint16_t cursor_len;
    uint8_t cursor[HM_DHT_SUBKEY_MAX];
};

struct hm_dht {
    hm_identity id;
    uint8_t swarm_id[HM_SWARM_ID_BYTES];
    hm_dht_config cfg;
    hm_dht_io io;
    hm_rt *rt;
    hm_dht_store *store;

    uint8_t secret[32], prev_secret[32];
    uint64_t rotate_at, sweep_at;
    /* Round-trip estimate over every reply (RFC 6298), for the timeouts. */
    double srtt_ms, rttvar_ms;
    int have_rtt;
    /*
     * Contacts whose last request timed out, until they answer or
     * SUSPECT_MS pass: a lookup still asks one, but as a slow candidate
     * from the start, so that a node that died costs the first lookup that
     * meets it one timeout and the lookups after it nothing (they learn of
     * it again from every reply that lists it). Oldest replaced first.
     */
    struct suspect {
        uint8_t id[HM_RT_ID_BYTES];
        uint64_t until_ms;
    } suspects[SUSPECTS_MAX];
    size_t suspects_next;
    uint64_t probe_at; /* next sweep for contacts with a failure pending */
    int probing;       /* some contact may have a failure pending */

    struct req *reqs;
    size_t nreqs, reqs_cap;

    TAILQ_HEAD(op_list, op) ops; /* active, newest first */
    struct op_list done;         /* finished, callback not fired yet, in order */
    size_t nops;
    uint64_t next_op_id;
    uint64_t last_seq;

    struct ltab rates;
    struct ltab tokens;

    hm_dht_stats st;
    uint64_t now_ms; /* the latest time the owner gave us */
    LIST_HEAD(, many) many; /* get_many batches waiting for lookup slots */
    /* Scratch for encoding and decoding, kept off the stack. */
    hm_dht_msg msg_in, msg_out;
    /* Large enough for a full VALUE plus HM_DHT_PROTO_MAX_CONTACTS IPv6 contacts. */
    uint8_t out_buf[4096];
};

static double secs(uint64_t ms) { return (double)ms / 1000.0; }

static uint32_t rand_u32(hm_dht *d)
{
    uint32_t v;
    d->io.random(d->io.ud, &v, sizeof(v));
    return v;
}

void hm_dht_config_default(hm_dht_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->k = 20;
    cfg->alpha = 3;
    cfg->disjoint_paths = 1;
    cfg->num_replicas = 5;
    cfg->request_timeout_ms = 1000;
    cfg->request_timeout_min_ms = 200;
    cfg->max_lookups = 64;
    cfg->max_datagram = HM_DGRAM_MAX_PAYLOAD - 16;
    cfg->rate_per_s = 200;
    cfg->rate_burst = 400;
    cfg->rate_ban_ms = 60000;
    hm_rt_config_default(&cfg->rt);
    hm_dht_store_config_default(&cfg->store);
}

/* ---- addresses and tokens ---- */

/* Compact address form (proto.h's), with IPv4-mapped IPv6 read as IPv4. */
static size_t addr_compact(const struct sockaddr *sa, uint8_t out[18])
{
    if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a6 = (const struct sockaddr_in6 *)sa;
        if (IN6_IS_ADDR_V4MAPPED(&a6->sin6_addr)) {
            memcpy(out, a6->sin6_addr.s6_addr + 12, 4);
            memcpy(out + 4, &a6->sin6_port, 2);
            return 6;
        }
    }
    return hm_dht_addr_encode(sa, out);
}

/*
 * The rate limiter's key for an address: the IPv4 address, or the /64 of
 * an IPv6 one (what one host usually controls). Loopback addresses are
 * keyed with their port, so a swarm of local processes (tests, a laptop
 * demo) is limited per process rather than as one host.
 */
static size_t rate_key(const struct sockaddr *sa, uint8_t out[19])
{
    uint8_t a[18];
    size_t n = addr_compact(sa, a);

    if (n == 6) {
        out[0] = 4;
        if (a[0] == 127) {
            memcpy(out + 1, a, 6);
            return 7;
        }
        memcpy(out + 1, a, 4);
        return 5;
    }
    if (n == 18) {
        static const uint8_t lo[16] = {[15] = 1};
        out[0] = 6;
        if (memcmp(a, lo, 16) == 0) {
            memcpy(out + 1, a, 18);
            return 19;
        }
        memcpy(out + 1, a, 8);
        return 9;
    }
    return 0;
}

static void token_make(const uint8_t secret[32], const uint8_t pk[HM_PK_BYTES],
                       const struct sockaddr *sa, uint8_t out[HM_DHT_TOKEN_BYTES])
{
    crypto_generichash_state s;
    uint8_t a[18], h[crypto_generichash_BYTES_MIN];
    size_t n = addr_compact(sa, a);

    crypto_generichash_init(&s, secret, 32, sizeof(h));
    crypto_generichash_update(&s, pk, HM_PK_BYTES);
    crypto_generichash_update(&s, a, n);
    crypto_generichash_final(&s, h, sizeof(h));
    memcpy(out, h, HM_DHT_TOKEN_BYTES);
}

static int token_valid(const hm_dht *d, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *sa,
                       const uint8_t *tok, size_t len)
{
    uint8_t t[HM_DHT_TOKEN_BYTES];

    if (tok == NULL || len != HM_DHT_TOKEN_BYTES)
        return 0;
    token_make(d->secret, pk, sa, t);
    if (sodium_memcmp(t, tok, sizeof(t)) == 0)
        return 1;
    token_make(d->prev_secret, pk, sa, t);
    return sodium_memcmp(t, tok, sizeof(t)) == 0;
}

/* Remembers the token a peer gave us for our address as it sees it. */
static void peer_token_put(hm_dht *d, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                           const uint8_t *tok, size_t len, uint64_t now_ms)
{
    struct peer_token *pt;

    if (tok == NULL || len > HM_DHT_TOKEN_MAX)
        return;
    pt = ltab_get(&d->tokens, pk, HM_PK_BYTES, 1);
    if (pt == NULL)
        return;
    pt->alen = (uint8_t)addr_compact(from, pt->addr);
    memcpy(pt->token, tok, len);
    pt->tlen = (uint8_t)len;
    pt->got_ms = now_ms;
}

/* The token pk gave us at address to, if still fresh; its length or 0. */
static size_t peer_token_get(hm_dht *d, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                             uint64_t now_ms, uint8_t out[HM_DHT_TOKEN_MAX])
{
    struct peer_token *pt = ltab_get(&d->tokens, pk, HM_PK_BYTES, 0);
    uint8_t a[18];
    size_t n;

    if (pt == NULL || now_ms - pt->got_ms > PEER_TOKEN_MS || now_ms < pt->got_ms)
        return 0;
    n = addr_compact(to, a);
    if (n != pt->alen || memcmp(a, pt->addr, n) != 0)
        return 0;
    memcpy(out, pt->token, pt->tlen);
    return pt->tlen;
}

/*
 * Token bucket per address. Returns 1 when the request may be served.
 * An address that goes on sending after its bucket ran dry accumulates
 * excess; once the excess exceeds a burst's worth it is banned for
 * rate_ban_ms, and everything it sends meanwhile is dropped unread.
 */
static int rate_allow(hm_dht *d, const struct sockaddr *from, uint64_t now_ms)
{
    uint8_t key[19];
    size_t klen = rate_key(from, key);
    struct rate *r;
    double dt;

    if (klen == 0)
        return 0;
    r = ltab_get(&d->rates, key, klen, 1);
    if (r == NULL)
        return 0; /* out of memory: shed load rather than serve unmetered */
    if (!r->init) {
        r->init = 1;
        r->tokens = d->cfg.rate_burst;
        r->last_ms = now_ms;
    }
    if (now_ms > r->last_ms) {
        dt = secs(now_ms - r->last_ms);
        r->tokens = HM_MIN(d->cfg.rate_burst, r->tokens + dt * d->cfg.rate_per_s);
        r->excess = HM_MAX(0.0, r->excess - dt * d->cfg.rate_per_s);
        r->last_ms = now_ms;
    }
    if (r->banned_until > now_ms)
        return 0;
    if (r->tokens >= 1.0) {
        r->tokens -= 1.0;
        return 1;
    }
    r->excess += 1.0;
    if (r->excess > d->cfg.rate_burst) {
        r->banned_until = now_ms + d->cfg.rate_ban_ms;
        r->excess = 0;
        hm_debug(MOD, "address banned for %llu ms after sustained excess",
                 (unsigned long long)d->cfg.rate_ban_ms);
    }
    return 0;
}

/* ---- outstanding requests ---- */

static struct req *req_find(hm_dht *d, uint32_t tid)
{
    for (size_t i = 0; i < d->nreqs; i++)
        if (d->reqs[i].tid == tid)
            return &d->reqs[i];
    return NULL;
}

static int req_pending_to(const hm_dht *d, const uint8_t id[HM_RT_ID_BYTES], int type)
{
    for (size_t i = 0; i < d->nreqs; i++)
        if (d->reqs[i].type == type && memcmp(d->reqs[i].id, id, HM_RT_ID_BYTES) == 0)
            return 1;
    return 0;
}

static void req_remove(hm_dht *d, struct req *r)
{
    size_t i = (size_t)(r - d->reqs);
    free(r->pkt);
    d->reqs[i] = d->reqs[--d->nreqs];
}

static struct suspect *suspect_find(hm_dht *d, const uint8_t id[HM_RT_ID_BYTES], uint64_t now_ms)
{
    for (size_t i = 0; i < SUSPECTS_MAX; i++)
        if (d->suspects[i].until_ms > now_ms &&
            memcmp(d->suspects[i].id, id, HM_RT_ID_BYTES) == 0)
            return &d->suspects[i];
    return NULL;
}

static void suspect_add(hm_dht *d, const uint8_t id[HM_RT_ID_BYTES], uint64_t now_ms)
{
    struct suspect *s = suspect_find(d, id, now_ms);
    if (s == NULL) {
        s = &d->suspects[d->suspects_next];
        d->suspects_next = (d->suspects_next + 1) % SUSPECTS_MAX;
        memcpy(s->id, id, HM_RT_ID_BYTES);
    }
    s->until_ms = now_ms + SUSPECT_MS;
}

static void suspect_clear(hm_dht *d, const uint8_t id[HM_RT_ID_BYTES], uint64_t now_ms)
{
    struct suspect *s = suspect_find(d, id, now_ms);
    if (s != NULL)
        s->until_ms = 0;
}

/* Folds one measured round trip into the estimate (RFC 6298, 2.2 and 2.3). */
static void rtt_sample(hm_dht *d, uint64_t rtt_ms)
{
    double r = (double)rtt_ms;
    if (!d->have_rtt) {
        d->srtt_ms = r;
        d->rttvar_ms = r / 2;
        d->have_rtt = 1;
        return;
    }
    d->rttvar_ms = 0.75 * d->rttvar_ms + 0.25 * fabs(d->srtt_ms - r);
    d->srtt_ms = 0.875 * d->srtt_ms + 0.125 * r;
}

/* The timeout of a first request to a contact whose own RTT is rtt_ms (0: unknown). */
static uint64_t request_timeout(const hm_dht *d, uint32_t rtt_ms)
{
    uint64_t lo = HM_MIN(d->cfg.request_timeout_min_ms, d->cfg.request_timeout_ms);
    if (!d->have_rtt)
        return d->cfg.request_timeout_ms;
    double t = HM_MAX(d->srtt_ms + 4 * d->rttvar_ms, 2.0 * rtt_ms);
    uint64_t ms = t >= (double)d->cfg.request_timeout_ms ? d->cfg.request_timeout_ms
                                                         : (uint64_t)ceil(t);
    return HM_MAX(ms, lo);
}

/*
 * Builds and sends a request m (type, and its body fields) to contact c,
 * and records it. The token is the one c gave us, if any; without one the
 * request is padded so that c may answer it in full. Returns 0 or a
 * negative error (nothing recorded then).
 */
static int send_request(hm_dht *d, hm_dht_msg *m, const hm_rt_contact *c, int purpose,
                        uint64_t op_id, unsigned path, uint64_t now_ms)
{
    uint8_t tok[HM_DHT_TOKEN_MAX];
    size_t tlen, len, pad = 0;
    struct req *r;
    int result;

    if (memcmp(c->pk, d->id.pk, HM_PK_BYTES) == 0)
        return -EINVAL;
    if (d->nreqs >= MAX_REQS)
        return -ENOBUFS;
    if (d->nreqs == d->reqs_cap) {
        size_t ncap = d->reqs_cap ? d->reqs_cap * 2 : 16;
        struct req *nr = realloc(d->reqs, ncap * sizeof(*nr));
        if (nr == NULL)
            return -ENOMEM;
        d->reqs = nr;
        d->reqs_cap = ncap;
    }
    do {
        m->tid = rand_u32(d);
    } while (req_find(d, m->tid) != NULL);
    m->flags = d->cfg.client_mode ? HM_DHT_FLAG_CLIENT : 0;
    if (m->type == HM_DHT_MSG_GET)
        m->flags |= HM_DHT_FLAG_HELD; /* -- held since -- */
    tlen = peer_token_get(d, c->pk, (const struct sockaddr *)&c->addr, now_ms, tok);
    if (tlen > 0) {
        m->token = tok;
        m->token_len = tlen;
    } else if (m->type == HM_DHT_MSG_STORE) {
        /* A STORE without a token would only be refused. */
        return -EACCES;
    } else {
        m->token = NULL;
        m->token_len = 0;
        pad = m->type == HM_DHT_MSG_PING ? PING_PAD : d->cfg.max_datagram;
    }
    if ((result = hm_dht_msg_encode(m, pad, d->out_buf, d->cfg.max_datagram, &len)) < 0)
        return result;
    if ((result = d->io.send(d->io.ud, c->pk, (const struct sockaddr *)&c->addr, d->out_buf,
                             len)) < 0)
        return result;
    r = &d->reqs[d->nreqs++];
    memset(r, 0, offsetof(struct req, cursor));
    r->tid = m->tid;
    r->type = (uint8_t)m->type;
    r->purpose = (uint8_t)purpose;
    r->path = (uint8_t)path;
    r->op_id = op_id;
    memcpy(r->pk, c->pk, HM_PK_BYTES);
    memcpy(r->id, c->id, HM_RT_ID_BYTES);
    r->addr = c->addr;
    r->sent_ms = now_ms;
    r->soft_ms = now_ms + request_timeout(d, c->rtt_ms);
    r->deadline_ms = now_ms + d->cfg.request_timeout_ms;
    /* One lost datagram of a lossy link must not cost a lookup its
     * contact, nor mark the contact failing (lookups skip those until a
     * probe clears them): requests of operations are sent a second time
     * at their first timeout. Without memory for the copy there is no
     * second try, which is what a lost datagram would give anyway. */
    if ((purpose == P_LOOKUP || purpose == P_STORE) && (r->pkt = malloc(len)) != NULL) {
        memcpy(r->pkt, d->out_buf, len);
        r->pkt_len = len;
    }
    if (m->type == HM_DHT_MSG_GET && m->has_cursor) {
        r->cursor_len = (uint16_t)m->cursor_len;
        memcpy(r->cursor, m->cursor, m->cursor_len);
    }
    d->st.requests_sent++;
    return 0;
}

static int send_ping(hm_dht *d, const hm_rt_contact *c, int purpose, uint64_t now_ms)
{
    hm_dht_msg *m = &d->msg_out;

    memset(m, 0, offsetof(hm_dht_msg, records));
    m->type = HM_DHT_MSG_PING;
    return send_request(d, m, c, purpose, 0, 0, now_ms);
}

/* ---- operations ---- */

static struct op *op_find_active(hm_dht *d, uint64_t id)
{
    struct op *o;

    TAILQ_FOREACH(o, &d->ops, link)
        if (o->id == id)
            return o;
    return NULL;
}

static void held_free(struct held *h)
{
    free(h->buf);
    h->buf = NULL;
}

static void op_free(struct op *o)
{
    for (unsigned p = 0; p < o->npaths; p++)
        free(o->paths[p].c);
    for (size_t i = 0; i < o->nheld; i++)
        held_free(&o->held[i]);
    free(o->held);
    free(o->reps);
    free(o->obs);
    held_free(&o->put);
    free(o->key);
    free(o);
}

/* Copies r (and the bytes it points to) into h. */
static int held_copy(struct held *h, const hm_dht_record *r, const uint8_t src_pk[HM_PK_BYTES])
{
    size_t sk = r->has_subkey ? r->subkey_len : 0;
    size_t n = r->key_len + sk + r->value_len + (r->sig ? HM_DHT_SIG_BYTES : 0);
    uint8_t *buf = malloc(n ? n : 1), *p;

    if (buf == NULL)
        return -ENOMEM;
    p = buf;
    h->rec = *r;
    memcpy(p, r->key, r->key_len);
    h->rec.key = p;
    p += r->key_len;
    if (r->has_subkey) {
        if (sk)
            memcpy(p, r->subkey, sk);
        h->rec.subkey = p;
        p += sk;
    } else {
        h->rec.subkey = NULL;
        h->rec.subkey_len = 0;
    }
    if (r->value_len)
        memcpy(p, r->value, r->value_len);
    h->rec.value = p;
    p += r->value_len;
    if (r->sig) {
        memcpy(p, r->sig, HM_DHT_SIG_BYTES);
        h->rec.sig = p;
    }
    h->buf = buf;
    if (src_pk)
        memcpy(h->source_pk, src_pk, HM_PK_BYTES);
    return 0;
}

/* Moves an operation from the active list to the queue of callbacks to fire. */
static void op_finish(hm_dht *d, struct op *o, int status, uint64_t now_ms)
{
    if (o->phase == PH_DONE)
        return;
    o->phase = PH_DONE;
    o->status = status;
    o->info.duration_ms = now_ms >= o->start_ms ? now_ms - o->start_ms : 0;
    TAILQ_REMOVE(&d->ops, o, link);
    d->nops--;
    TAILQ_INSERT_TAIL(&d->done, o, link);
    d->st.lookups_done++;
}

/* -- held since -- */
static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static uint32_t lower_median_u32(uint32_t *v, size_t n)
{
    qsort(v, n, sizeof(*v), cmp_u32);
    return v[(n - 1) / 2];
}

/*
 * How long the replicas have held held entry h (dht.h): per origin the
 * lower median over its replicas (0 where one did not hold it), then the
 * lower median over the origins; -1 when no replica told. tab is the
 * replicas x entries matrix of what they said, scratch has room for
 * n_reps values twice.
 */
static int64_t held_vote(const struct op *o, const uint32_t *tab, size_t h, uint32_t *scratch)
{
    uint32_t *per_org = scratch, *vals = scratch + o->n_reps;
    size_t n_org = 0;

    if (o->n_reps == 0)
        return -1;
    for (size_t r = 0; r < o->n_reps; r++) {
        size_t first = 0, nv = 0;
        while (first < r && !hm_origin_eq(&o->reps[first].org, &o->reps[r].org))
            first++;
        if (first < r)
            continue; /* this origin was counted at its first replica */
        for (size_t q = r; q < o->n_reps; q++)
            if (hm_origin_eq(&o->reps[q].org, &o->reps[r].org))
                vals[nv++] = tab[q * o->nheld + h];
        per_org[n_org++] = lower_median_u32(vals, nv);
    }
    return (int64_t)lower_median_u32(per_org, n_org);
}

/* Fills vals[i].held_s for the n values of a result built from o. */
static void held_fill(const struct op *o, hm_dht_value *vals, size_t n)
{
    uint32_t *tab = NULL, *scratch = NULL;

    for (size_t i = 0; i < n; i++)
        vals[i].held_s = -1;
    if (o->n_reps == 0 || o->nheld == 0)
        return;
    tab = calloc(o->n_reps * o->nheld, sizeof(*tab));
    scratch = calloc(2 * o->n_reps, sizeof(*scratch));
    if (tab == NULL || scratch == NULL)
        goto out; /* unknown, as from older replicas */
    for (size_t i = 0; i < o->n_obs; i++)
        tab[(size_t)o->obs[i].rep * o->nheld + o->obs[i].held] = o->obs[i].secs;
    for (size_t i = 0; i < n; i++) {
        /* vals point into o->held: their index is where they point. */
        for (size_t h = 0; h < o->nheld; h++)
            if (vals[i].rec.key == o->held[h].rec.key) {
                vals[i].held_s = held_vote(o, tab, h, scratch);
                break;
            }
    }
out:
    free(tab);
    free(scratch);
}

/* The replica index of the node pk at address from, added when new; -1 when full. */
static int held_rep(struct op *o, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from)
{
    for (size_t i = 0; i < o->n_reps; i++)
        if (memcmp(o->reps[i].pk, pk, HM_PK_BYTES) == 0)
            return (int)i;
    if (o->n_reps >= HELD_REPS)
        return -1;
    if (o->reps == NULL && (o->reps = calloc(HELD_REPS, sizeof(*o->reps))) == NULL)
        return -1;
    memcpy(o->reps[o->n_reps].pk, pk, HM_PK_BYTES);
    hm_origin_of(from, &o->reps[o->n_reps].org);
    return (int)o->n_reps++;
}

/* Notes that replica rep said held entry h was held secs seconds. */
static void held_note(struct op *o, int rep, int h, uint32_t secs)
{
    if (rep < 0 || h < 0 || o->n_obs >= HELD_OBS)
        return;
    for (size_t i = 0; i < o->n_obs; i++)
        if (o->obs[i].rep == rep && o->obs[i].held == h)
            return; /* the first word of a replica on an entry stands */
    if (o->n_obs % 64 == 0) {
        struct held_obs *no = realloc(o->obs, (o->n_obs + 64) * sizeof(*no));
        if (no == NULL)
            return;
        o->obs = no;
    }
    o->obs[o->n_obs++] = (struct held_obs){.held = (uint16_t)h, .rep = (uint16_t)rep,
                                           .secs = secs};
}

static size_t get_result_records(struct op *o, double now_s, hm_dht_value *vals);

/* The get result, with the replicas' held times. */
static size_t get_result(struct op *o, double now_s, hm_dht_value *vals)
{
    size_t n = get_result_records(o, now_s, vals);
    held_fill(o, vals, n);
    return n;
}

/*
 * Builds the get result: the plain value, or the live subkeys of the
 * dictionary, whichever expires later (Hivemind's rule).
 */
static size_t get_result_records(struct op *o, double now_s, hm_dht_value *vals)
{
    const struct held *plain = NULL;
    double dict_exp = 0;
    size_t n = 0;

    for (size_t i = 0; i < o->nheld; i++) {
        const struct held *h = &o->held[i];
        if (h->rec.expiration <= now_s)
            continue;
        if (!h->rec.has_subkey)
            plain = h;
        else if (h->rec.expiration > dict_exp)
            dict_exp = h->rec.expiration;
    }
    if (plain && plain->rec.expiration > dict_exp) {
        vals[0].rec = plain->rec;
        memcpy(vals[0].source_pk, plain->source_pk, HM_PK_BYTES);
        return 1;
    }
    for (size_t i = 0; i < o->nheld; i++) {
        const struct held *h = &o->held[i];
        if (!h->rec.has_subkey || h->rec.expiration <= now_s)
            continue;
        vals[n].rec = h->rec;
        memcpy(vals[n].source_pk, h->source_pk, HM_PK_BYTES);
        n++;
    }
    return n;
}

static void fire(hm_dht *d, struct op *o, int status, uint64_t now_ms)
{
    if (o->kind == OP_GET && o->get_cb) {
        hm_dht_value *vals = NULL;
        size_t n = 0;

        if (status == 0 && o->nheld > 0) {
            vals = calloc(o->nheld, sizeof(*vals));
            if (vals == NULL)
                status = -ENOMEM;
            else
                n = get_result(o, secs(now_ms), vals);
        }
        if (status == 0)
            d->st.gets_ok++;
        else
            d->st.gets_failed++;
        o->get_cb(o->ud, status, vals, n, &o->info);
        free(vals);
    } else if (o->kind == OP_PUT && o->put_cb) {
        if (status == 0)
            d->st.puts_ok++;
        else
            d->st.puts_failed++;
        o->put_cb(o->ud, status, status == 0 ? o->stored : 0, &o->info);
    }
}

/* Fires the queued callbacks, one at a time, so that each may start or cancel others. */
static void flush_done(hm_dht *d, uint64_t now_ms)
{
    struct op *o;

    while ((o = TAILQ_FIRST(&d->done)) != NULL) {
        TAILQ_REMOVE(&d->done, o, link);
        fire(d, o, o->status, now_ms);
        op_free(o);
    }
}

static int cand_known(const struct op *o, const uint8_t id[HM_RT_ID_BYTES])
{
    for (unsigned p = 0; p < o->npaths; p++)
        for (size_t i = 0; i < o->paths[p].n; i++)
            if (memcmp(o->paths[p].c[i].c.id, id, HM_RT_ID_BYTES) == 0)
                return 1;
    return 0;
}

static size_t cand_cap(const hm_dht *d) { return 3 * (size_t)d->cfg.k; }

/*
 * Adds a contact to path p, kept ordered by distance to the target and
 * bounded. A contact already on any path is not added again, which is
 * what keeps disjoint paths disjoint.
 */
static void cand_add(hm_dht *d, struct op *o, unsigned p, const hm_rt_contact *c, unsigned hops,
                     uint64_t now_ms)
{
    struct lpath *lp = &o->paths[p];
    size_t cap = cand_cap(d), pos;

    if (memcmp(c->id, d->id.node_id, HM_RT_ID_BYTES) == 0 || cand_known(o, c->id) ||
        hm_rt_is_banned(d->rt, c->id, now_ms))
        return;
    if (c->addr.ss_family != AF_INET && c->addr.ss_family != AF_INET6)
        return;
    for (pos = 0; pos < lp->n; pos++)
        if (hm_rt_distance_cmp(o->target, c->id, lp->c[pos].c.id) < 0)
            break;
    if (lp->n == cap) {
        /* Drop the farthest contact not yet asked, if it is farther than the newcomer. */
        size_t victim = cap;
        for (size_t i = cap; i-- > pos;)
            if (lp->c[i].state == C_NEW || lp->c[i].state == C_FAILED) {
                victim = i;
                break;
            }
        if (victim == cap)
            return;
        memmove(&lp->c[victim], &lp->c[victim + 1], (lp->n - victim - 1) * sizeof(*lp->c));
        lp->n--;
    }
    memmove(&lp->c[pos + 1], &lp->c[pos], (lp->n - pos) * sizeof(*lp->c));
    memset(&lp->c[pos], 0, sizeof(lp->c[pos]));
    memcpy(lp->c[pos].c.id, c->id, HM_RT_ID_BYTES);
    memcpy(lp->c[pos].c.pk, c->pk, HM_PK_BYTES);
    lp->c[pos].c.addr = c->addr;
    lp->c[pos].state = C_NEW;
    lp->c[pos].hops = (uint16_t)(hops > 0xffff ? 0xffff : hops);
    lp->n++;
}

static struct cand *cand_find(struct op *o, unsigned p, const uint8_t id[HM_RT_ID_BYTES])
{
    if (p >= o->npaths)
        return NULL;
    for (size_t i = 0; i < o->paths[p].n; i++)
        if (memcmp(o->paths[p].c[i].c.id, id, HM_RT_ID_BYTES) == 0)
            return &o->paths[p].c[i];
    return NULL;
}

static int send_lookup_request(hm_dht *d, struct op *o, unsigned p, struct cand *c,
                               const uint8_t *cursor, size_t cursor_len, int has_cursor,
                               uint64_t now_ms)
{
    hm_dht_msg *m = &d->msg_out;
    int result;

    memset(m, 0, offsetof(hm_dht_msg, records));
    m->type = o->kind == OP_GET ? HM_DHT_MSG_GET : HM_DHT_MSG_FIND_NODE;
    memcpy(m->target, o->target, HM_RT_ID_BYTES);
    m->cursor = cursor;
    m->cursor_len = cursor_len;
    m->has_cursor = has_cursor;
    result = send_request(d, m, &c->c, P_LOOKUP, o->id, p, now_ms);
    if (result == 0)
        o->info.requests++;
    return result;
}

static void store_phase(hm_dht *d, struct op *o, uint64_t now_ms);
static void lookup_done(hm_dht *d, struct op *o, uint64_t now_ms);

/*
 * Advances every path of a lookup: sends requests to the closest contacts
 * not asked yet, alpha at a time per path, and marks a path done once the
 * k closest contacts that did not fail have answered. When every path is
 * done the lookup is.
 */
static void lookup_step(hm_dht *d, struct op *o, uint64_t now_ms)
{
    unsigned all_done = 1;

    if (o->phase != PH_LOOKUP)
        return;
    for (unsigned p = 0; p < o->npaths; p++) {
        struct lpath *lp = &o->paths[p];
        size_t answered = 0;
        int pending = 0, slow = 0, suspect = 0;

        if (lp->done)
            continue;
        for (size_t i = 0; i < lp->n && answered < d->cfg.k; i++) {
            struct cand *c = &lp->c[i];
            if (c->state == C_ANSWERED) {
                answered++;
            } else if (c->state == C_SLOW) {
                slow = 1;
            } else if (c->state == C_INFLIGHT) {
                pending = 1;
            } else if (c->state == C_SUSPECT) {
                suspect = 1;
            } else if (c->state == C_NEW) {
                if (lp->inflight >= (lp->stalled ? d->cfg.k : d->cfg.alpha)) {
                    pending = 1;
                    continue;
                }
                if (send_lookup_request(d, o, p, c, NULL, 0, 0, now_ms) == 0) {
                    if (suspect_find(d, c->c.id, now_ms) != NULL) {
                        /* Waited for until its adaptive timeout, but
                         * without a slot of alpha: the next is asked too. */
                        c->state = C_SUSPECT;
                        suspect = 1;
                        continue;
                    } else {
                        c->state = C_INFLIGHT;
                        lp->inflight++;
                    }
                } else {
                    c->state = C_FAILED;
                }
                pending = 1;
            }
        }
        /* Slow candidates hold the end only of a path with fewer answers
         * than a put stores replicas: then one of them may be the one that
         * holds the value (a small swarm, a busy peer). */
        if (slow && answered < d->cfg.num_replicas)
            pending = 1;
        /* -- churn -- Suspects (their last request timed out, nothing
         * answered since) hold the end of a get until it has found the
         * value and as many answers as a put stores replicas, every other
         * candidate among the k closest having answered or failed: after
         * churn a get then costs the dead nodes nothing, and one that has
         * not found the value still waits for them (it may be theirs). */
        if (suspect && !(o->kind == OP_GET && o->found && answered >= d->cfg.num_replicas))
            pending = 1;
        if (!pending)
            lp->done = 1;
        else
            all_done = 0;
    }
    if (all_done)
        lookup_done(d, o, now_ms);
}

/* Contacts of all paths that answered, nearest first, at most n. */
static size_t answered_closest(const hm_dht *d, struct op *o, struct cand **out, size_t n,
                               int without_value)
{
    size_t m = 0;

    for (unsigned p = 0; p < o->npaths; p++)
        for (size_t i = 0; i < o->paths[p].n; i++) {
            struct cand *c = &o->paths[p].c[i];
            size_t pos;
            if (c->state != C_ANSWERED || (without_value && c->has_value))
                continue;
            for (pos = 0; pos < m; pos++)
                if (hm_rt_distance_cmp(o->target, c->c.id, out[pos]->c.id) < 0)
                    break;
            if (pos >= n)
                continue;
            if (m == n)
                m--;
            memmove(&out[pos + 1], &out[pos], (m - pos) * sizeof(*out));
            out[pos] = c;
            m++;
        }
    (void)d;
    return m;
}

static void send_store(hm_dht *d, struct op *o, struct cand *c, const hm_dht_record *r,
                       int purpose, uint64_t now_ms)
{
    hm_dht_msg *m = &d->msg_out;

    memset(m, 0, offsetof(hm_dht_msg, records));
    m->type = HM_DHT_MSG_STORE;
    m->record = *r;
    if (send_request(d, m, &c->c, purpose, o ? o->id : 0, 0, now_ms) == 0 && o) {
        o->info.requests++;
        if (purpose == P_STORE)
            o->store_pending++;
    }
}

/* Caches a get's result at the closest node on the path that did not return it. */
static void cache_result(hm_dht *d, struct op *o, uint64_t now_ms)
{
    struct cand *best[1];
    hm_dht_value *vals;
    size_t n;

    if (o->nheld == 0 || answered_closest(d, o, best, 1, 1) == 0)
        return;
    vals = calloc(o->nheld, sizeof(*vals));
    if (vals == NULL)
        return;
    n = get_result(o, secs(now_ms), vals);
    for (size_t i = 0; i < n && i < MAX_CACHE_RECORDS; i++)
        send_store(d, NULL, best[0], &vals[i].rec, P_DETACHED, now_ms);
    free(vals);
}

static int start_find(hm_dht *d, const uint8_t target[HM_RT_ID_BYTES], int join, uint64_t now_ms);

/*
 * After joining through our own id, look up a random id in every bucket
 * but our own (Kademlia's join: the far buckets fill from the lookups).
 */
static void join_refresh(hm_dht *d, uint64_t now_ms)
{
    size_t nb = hm_rt_bucket_count(d->rt);

    for (size_t i = 0; i < nb && d->nops < d->cfg.max_lookups; i++) {
        hm_rt_bucket_info bi;
        uint8_t t[HM_RT_ID_BYTES];

        if (hm_rt_bucket_get(d->rt, i, &bi) < 0)
            continue;
        if (hm_rt_common_prefix(bi.prefix, d->id.node_id) >= bi.depth)
            continue;
        d->io.random(d->io.ud, t, sizeof(t));
        for (unsigned b = 0; b < bi.depth; b++) {
            uint8_t mask = (uint8_t)(0x80 >> (b % 8));
            t[b / 8] = (uint8_t)((t[b / 8] & ~mask) | (bi.prefix[b / 8] & mask));
        }
        start_find(d, t, 0, now_ms);
    }
}

/* Whether the operation found nobody to ask: no contact in the table, no
 * request sent, nothing timed out. */
static int dht_alone(const hm_dht *d, const struct op *o)
{
    return o->info.requests == 0 && o->info.timeouts == 0 && hm_rt_size(d->rt) == 0;
}

static void lookup_done(hm_dht *d, struct op *o, uint64_t now_ms)
{
    for (unsigned p = 0; p < o->npaths; p++)
        for (size_t i = 0; i < o->paths[p].n; i++)
            if (o->paths[p].c[i].state == C_ANSWERED && o->paths[p].c[i].hops > o->info.hops &&
                !o->found)
                o->info.hops = o->paths[p].c[i].hops;
    hm_rt_touch(d->rt, o->target, now_ms);
    switch (o->kind) {
    case OP_FIND: {
        int join = o->join;
        op_finish(d, o, 0, now_ms);
        if (join)
            join_refresh(d, now_ms);
        break;
    }
    case OP_GET: {
        struct cand *any[1];
        int status = 0;
        /* A lone node (no contact at all, nobody asked) is the whole
         * swarm: its own store, read when the get began, is the answer,
         * and a key it does not hold is absent, not unreachable. */
        if (o->nheld == 0 && answered_closest(d, o, any, 1, 0) == 0 && !dht_alone(d, o))
            status = o->info.timeouts ? -ETIMEDOUT : -EHOSTUNREACH;
        if (o->nheld > 0)
            cache_result(d, o, now_ms);
        op_finish(d, o, status, now_ms);
        break;
    }
    case OP_PUT:
        store_phase(d, o, now_ms);
        break;
    }
}

static void store_check_done(hm_dht *d, struct op *o, uint64_t now_ms)
{
    int status;

    if (o->phase != PH_STORE || o->store_pending > 0)
        return;
    if (o->stored > 0)
        status = 0;
    else if (o->store_err)
        status = o->store_err;
    else if (o->store_timeouts || o->info.timeouts)
        status = -ETIMEDOUT;
    else
        status = -EHOSTUNREACH;
    op_finish(d, o, status, now_ms);
}

static void store_phase(hm_dht *d, struct op *o, uint64_t now_ms)
{
    struct cand *targets[64];
    size_t n = answered_closest(d, o, targets, HM_MIN(d->cfg.num_replicas, 64u), 0);

    o->phase = PH_STORE;
    if (n == 0 && dht_alone(d, o)) {
        /* Alone, this node is the closest replica there is: it keeps the
         * record itself, so that its own gets (its experts' declarations
         * above all) find it. The owner's refreshes reach peers that join
         * later. */
        int r = hm_dht_store_put(d->store, &o->put.rec, d->id.node_id, secs(now_ms));
        if (r == 0)
            o->stored++;
        else
            o->store_err = r;
    }
    for (size_t i = 0; i < n; i++)
        send_store(d, o, targets[i], &o->put.rec, P_STORE, now_ms);
    store_check_done(d, o, now_ms);
}

static struct op *op_new(hm_dht *d, int kind, const uint8_t target[HM_RT_ID_BYTES],
                         uint64_t now_ms, uint64_t timeout_ms)
{
    struct op *o = calloc(1, sizeof(*o));
    unsigned np = d->cfg.disjoint_paths;

    if (o == NULL)
        return NULL;
    o->id = ++d->next_op_id;
    o->kind = kind;
    o->phase = PH_LOOKUP;
    memcpy(o->target, target, HM_RT_ID_BYTES);
    o->start_ms = now_ms;
    o->deadline_ms = now_ms + timeout_ms;
    o->npaths = np;
    for (unsigned p = 0; p < np; p++) {
        o->paths[p].c = calloc(cand_cap(d), sizeof(struct cand));
        if (o->paths[p].c == NULL) {
            op_free(o);
            return NULL;
        }
    }
    return o;
}

/* Seeds the paths from our table (round robin, so each path starts near the target) and starts. */
static void op_start(hm_dht *d, struct op *o, uint64_t now_ms)
{
    size_t want = HM_MIN(cand_cap(d), (size_t)d->cfg.k * o->npaths);
    hm_rt_contact *cs = calloc(want, sizeof(*cs));
    size_t n = 0;

    TAILQ_INSERT_HEAD(&d->ops, o, link);
    d->nops++;
    if (cs != NULL) {
        n = hm_rt_closest(d->rt, o->target, want, cs, HM_RT_SKIP_FAILING);
        if (n < o->npaths)
            n = hm_rt_closest(d->rt, o->target, want, cs, 0);
        for (size_t i = 0; i < n; i++)
            cand_add(d, o, (unsigned)(i % o->npaths), &cs[i], 1, now_ms);
        free(cs);
    }
    lookup_step(d, o, now_ms);
}

static int start_find(hm_dht *d, const uint8_t target[HM_RT_ID_BYTES], int join, uint64_t now_ms)
{
    struct op *o;

    if (d->nops >= d->cfg.max_lookups)
        return -ENOBUFS;
    o = op_new(d, OP_FIND, target, now_ms, d->cfg.request_timeout_ms * 30);
    if (o == NULL)
        return -ENOMEM;
    o->join = join;
    op_start(d, o, now_ms);
    return 0;
}

/* ---- get: collecting records ---- */

/*
 * Offers a record a node returned to a get. Records of another key,
 * expired ones, and any whose owner's signature does not verify are
 * dropped, so a forged record cannot win. Per slot (the plain value or one
 * subkey) the freshest stays: for owned records the highest seq, otherwise
 * the latest expiration. Returns the index of the held entry of r's slot
 * (whether r replaced it or not), or -1 (dropped, no room).
 */
static int get_offer(hm_dht *d, struct op *o, const hm_dht_record *r,
                     const uint8_t src_pk[HM_PK_BYTES], double now_s)
{
    hm_dht_record rec = *r;
    struct held *h = NULL;
    int owned;

    if (rec.key_len != o->key_len || memcmp(rec.key, o->key, o->key_len) != 0 ||
        !(rec.expiration > now_s)) {
        d->st.bad_messages++;
        return -1;
    }
    owned = hm_dht_record_verify(&rec, d->swarm_id, NULL);
    if (owned < 0) {
        d->st.bad_messages++;
        return -1;
    }
    if (!owned)
        rec.sig = NULL;
    for (size_t i = 0; i < o->nheld; i++) {
        const hm_dht_record *x = &o->held[i].rec;
        if (x->has_subkey == rec.has_subkey &&
            (!rec.has_subkey || (x->subkey_len == rec.subkey_len &&
                                 memcmp(x->subkey, rec.subkey, rec.subkey_len) == 0))) {
            h = &o->held[i];
            break;
        }
    }
    if (h != NULL) {
        int newer = owned ? rec.seq > h->rec.seq : rec.expiration > h->rec.expiration;
        struct held tmp;
        int at = (int)(h - o->held);
        if (!newer)
            return at;
        if (held_copy(&tmp, &rec, src_pk) < 0)
            return at;
        held_free(h);
        *h = tmp;
        return at;
    }
    if (o->nheld >= MAX_HELD)
        return -1;
    if (o->nheld % 16 == 0) {
        struct held *nh = realloc(o->held, (o->nheld + 16) * sizeof(*nh));
        if (nh == NULL)
            return -1;
        o->held = nh;
    }
    if (held_copy(&o->held[o->nheld], &rec, src_pk) == 0)
        return (int)o->nheld++;
    return -1;
}

/* ---- handling replies ---- */

static void on_reply_lookup(hm_dht *d, struct op *o, const struct req *r, const hm_dht_msg *m,
                            uint64_t now_ms)
{
    struct cand *c = cand_find(o, r->path, r->id);
    struct lpath *lp = r->path < o->npaths ? &o->paths[r->path] : NULL;
    unsigned hops = c ? c->hops : 1;

    if (o->phase != PH_LOOKUP || lp == NULL)
        return;
    if (m->type == HM_DHT_MSG_VALUE && o->kind == OP_GET) {
        /* -- held since -- a replica that told held times votes with them */
        int rep = m->has_held && m->n_records > 0
                      ? held_rep(o, r->pk, (const struct sockaddr *)&r->addr)
                      : -1;
        for (size_t i = 0; i < m->n_records; i++) {
            int h = get_offer(d, o, &m->records[i], r->pk, secs(now_ms));
            if (rep >= 0)
                held_note(o, rep, h, m->held[i]);
        }
        if (m->n_records > 0 && c != NULL) {
            c->has_value = 1;
            if (!o->found) {
                o->found = 1;
                o->info.hops = hops;
            }
        }
        /* Follow the dictionary's pages on the node that has them, up to a bound. */
        if (m->more && c != NULL &&
            (c->state == C_INFLIGHT || c->state == C_SLOW || c->state == C_SUSPECT) &&
            c->pages + 1 < MAX_PAGES) {
            const hm_dht_record *last = &m->records[m->n_records - 1];
            if (last->has_subkey) {
                uint8_t cur[HM_DHT_SUBKEY_MAX];
                memcpy(cur, last->subkey, last->subkey_len);
                c->pages++;
                if (send_lookup_request(d, o, r->path, c, cur, last->subkey_len, 1, now_ms) == 0)
                    goto contacts; /* still in flight */
            }
        }
    }
    if (c != NULL && c->state == C_INFLIGHT) {
        c->state = C_ANSWERED;
        if (lp->inflight)
            lp->inflight--;
    } else if (c != NULL && (c->state == C_SLOW || c->state == C_SUSPECT)) {
        c->state = C_ANSWERED; /* held no slot; a slow one late, but in time */
    }
contacts:
    if (lp->n > 0) {
        uint8_t head[HM_RT_ID_BYTES];
        memcpy(head, lp->c[0].c.id, HM_RT_ID_BYTES);
        for (size_t i = 0; i < m->n_contacts; i++)
            cand_add(d, o, r->path, &m->contacts[i], hops + 1, now_ms);
        lp->stalled = memcmp(head, lp->c[0].c.id, HM_RT_ID_BYTES) == 0;
    } else {
        for (size_t i = 0; i < m->n_contacts; i++)
            cand_add(d, o, r->path, &m->contacts[i], hops + 1, now_ms);
    }
    lookup_step(d, o, now_ms);
}

static void on_fail_lookup(hm_dht *d, struct op *o, const struct req *r, uint64_t now_ms)
{
    struct cand *c = cand_find(o, r->path, r->id);

    if (o->phase != PH_LOOKUP)
        return;
    if (c != NULL && c->state == C_INFLIGHT) {
        c->state = C_FAILED;
        if (o->paths[r->path].inflight)
            o->paths[r->path].inflight--;
    } else if (c != NULL && (c->state == C_SLOW || c->state == C_SUSPECT)) {
        c->state = C_FAILED; /* it held no slot */
    }
    lookup_step(d, o, now_ms);
}

/* A lookup request passed its first timeout and was sent again (C_SLOW). */
static void on_slow_lookup(hm_dht *d, struct op *o, const struct req *r, uint64_t now_ms)
{
    struct cand *c = cand_find(o, r->path, r->id);

    suspect_add(d, r->id, now_ms);
    o->info.timeouts++; /* counted once, at the first timeout */
    if (o->phase != PH_LOOKUP || c == NULL ||
        (c->state != C_INFLIGHT && c->state != C_SUSPECT))
        return;
    if (c->state == C_INFLIGHT && o->paths[r->path].inflight)
        o->paths[r->path].inflight--;
    c->state = C_SLOW;
    lookup_step(d, o, now_ms);
}

static void observe(hm_dht *d, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                    uint32_t rtt_ms, uint64_t now_ms)
{
    hm_rt_contact c, evict;
    socklen_t alen = hm_addr_len(from);

    memset(&c, 0, sizeof(c));
    memcpy(c.pk, pk, HM_PK_BYTES);
    hm_node_id_from_pk(pk, c.id);
    if (alen == 0 || alen > sizeof(c.addr))
        return;
    memcpy(&c.addr, from, alen);
    c.rtt_ms = rtt_ms;
    if (hm_rt_observe(d->rt, &c, now_ms, &evict) == HM_RT_CACHED &&
        !req_pending_to(d, evict.id, HM_DHT_MSG_PING))
        send_ping(d, &evict, P_DETACHED, now_ms); /* Kademlia keeps the old contact if it answers. */
}

static void on_reply(hm_dht *d, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                     const hm_dht_msg *m, uint64_t now_ms)
{
    struct req *r = req_find(d, m->tid);
    struct req rq;
    struct op *o;

    /* Only the peer we asked, with the type we asked for, before the timeout. */
    if (r == NULL || memcmp(r->pk, pk, HM_PK_BYTES) != 0 ||
        m->type != r->type + HM_DHT_MSG_REPLY) {
        d->st.bad_messages++;
        return;
    }
    rq = *r;
    req_remove(d, r);
    d->st.replies_received++;
    /* Karn's rule: a reply to a request sent twice says nothing of the RTT. */
    if (!rq.resent && now_ms >= rq.sent_ms)
        rtt_sample(d, now_ms - rq.sent_ms);
    suspect_clear(d, rq.id, now_ms);
    if (!(m->flags & HM_DHT_FLAG_CLIENT))
        observe(d, pk, from, (uint32_t)HM_MIN(now_ms - rq.sent_ms, (uint64_t)UINT32_MAX),
                now_ms);
    peer_token_put(d, pk, from, m->token, m->token_len, now_ms);

    if (rq.purpose == P_BOOT) {
        start_find(d, d->id.node_id, 1, now_ms);
        return;
    }
    if (rq.op_id == 0 || (o = op_find_active(d, rq.op_id)) == NULL)
        return;
    if (rq.purpose == P_LOOKUP) {
        on_reply_lookup(d, o, &rq, m, now_ms);
    } else if (rq.purpose == P_STORE && o->phase == PH_STORE) {
        if (o->store_pending)
            o->store_pending--;
        if (m->status == 0)
            o->stored++;
        else
            o->store_err = m->status;
        store_check_done(d, o, now_ms);
    }
}

static void on_timeout(hm_dht *d, const struct req *r, uint64_t now_ms)
{
    struct op *o;

    d->st.timeouts++;
    suspect_add(d, r->id, now_ms);
    if (hm_rt_fail(d->rt, r->id, now_ms) == 0)
        d->probing = 1;
    if (r->op_id == 0 || (o = op_find_active(d, r->op_id)) == NULL)
        return;
    if (!(r->slowed && r->purpose == P_LOOKUP))
        o->info.timeouts++;
    if (r->purpose == P_LOOKUP) {
        on_fail_lookup(d, o, r, now_ms);
    } else if (r->purpose == P_STORE && o->phase == PH_STORE) {
        if (o->store_pending)
            o->store_pending--;
        o->store_timeouts++;
        store_check_done(d, o, now_ms);
    }
}

/*
 * Lookups skip contacts with a failure pending, so without this nothing
 * would ever settle them: a contact that stopped answering would keep its
 * slot forever, and one that came back would stay shunned. Each sweep pings
 * every such contact (one ping in flight each); an answer clears the
 * failure, max_failures timeouts remove it.
 */
typedef struct probe_walk {
    hm_dht *d;
    uint64_t now_ms;
    unsigned sent;
    unsigned failing;
} probe_walk;

#define PROBE_MAX_PER_SWEEP 32

static int probe_one(void *arg, const hm_rt_contact *c)
{
    probe_walk *w = arg;
    if (c->failures == 0)
        return 0;
    w->failing++;
    if (req_pending_to(w->d, c->id, HM_DHT_MSG_PING))
        return 0;
    if (send_ping(w->d, c, P_DETACHED, w->now_ms) == 0)
        w->sent++;
    return w->sent >= PROBE_MAX_PER_SWEEP;
}

static void probe_failing(hm_dht *d, uint64_t now_ms)
{
    probe_walk w = {d, now_ms, 0, 0};
    if (!d->probing || now_ms < d->probe_at)
        return;
    d->probe_at = now_ms + d->cfg.request_timeout_ms;
    /* The table must not change inside the walk: send_ping only records
     * the request, and failures are counted later, at the timeout. */
    hm_rt_foreach(d->rt, probe_one, &w);
    /* Quiet until the next timeout marks a contact again. */
    if (w.failing == 0)
        d->probing = 0;
}

/* ---- serving requests ---- */

/*
 * Encodes reply m, fitting as many of its contacts as the budget allows
 * (contacts are the only part that shrinks), and sends it.
 */
static void send_reply(hm_dht *d, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                       hm_dht_msg *m, size_t budget)
{
    size_t len;

    /* The scratch buffer holds any reply in full, so one pass tells how much to cut. */
    if (hm_dht_msg_encode(m, 0, d->out_buf, sizeof(d->out_buf), &len) < 0)
        return;
    if (len > budget) {
        while (m->n_contacts > 0 && len > budget) {
            m->n_contacts--;
            len -= hm_dht_contact_encoded_size(
                (const struct sockaddr *)&m->contacts[m->n_contacts].addr);
        }
        /* The contacts array's header may have shrunk too; encode for real within budget. */
        while (hm_dht_msg_encode(m, 0, d->out_buf, budget, &len) < 0) {
            if (m->n_contacts == 0)
                return;
            m->n_contacts--;
        }
    }
    d->io.send(d->io.ud, pk, to, d->out_buf, len);
}

/* Upper bound of the reply envelope without records and contacts. */
#define REPLY_ENVELOPE 40

static void serve(hm_dht *d, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                  const hm_dht_msg *q, size_t req_len, uint64_t now_ms)
{
    hm_dht_msg *m = &d->msg_out;
    uint8_t tok[HM_DHT_TOKEN_BYTES];
    int verified = token_valid(d, pk, from, q->token, q->token_len);
    /* Anti-amplification: an unverified address gets no more bytes than it sent. */
    size_t budget = verified ? d->cfg.max_datagram : HM_MIN(req_len, d->cfg.max_datagram);
    uint8_t nid[HM_NODE_ID_BYTES];
    hm_origin org;

    token_make(d->secret, pk, from, tok);
    memset(m, 0, offsetof(hm_dht_msg, records));
    m->n_contacts = 0;
    m->type = q->type + HM_DHT_MSG_REPLY;
    m->tid = q->tid;
    m->token = tok;
    m->token_len = sizeof(tok);

    switch (q->type) {
    case HM_DHT_MSG_PING:
        break;
    case HM_DHT_MSG_FIND_NODE:
        m->n_contacts = hm_rt_closest(d->rt, q->target, HM_MIN(d->cfg.k, (unsigned)HM_DHT_PROTO_MAX_CONTACTS),
                                      m->contacts, HM_RT_SKIP_FAILING);
        break;
    case HM_DHT_MSG_GET: {
        hm_dht_get_result res;
        size_t room = budget > REPLY_ENVELOPE ? budget - REPLY_ENVELOPE : 0;
        int want_held = (q->flags & HM_DHT_FLAG_HELD) != 0;
        int result = hm_dht_store_get_held(d->store, q->target, secs(now_ms),
                                           q->has_cursor ? q->cursor : NULL, q->cursor_len, room,
                                           m->records, want_held ? m->held : NULL,
                                           HM_DHT_PROTO_MAX_RECORDS, &res);
        if (result == 0 && want_held && res.n > 0) {
            /* -- held since -- the held array must fit beside the records:
             * a shorter page is a prefix, so its array is no longer. */
            size_t used = 0, extra = 3;
            for (size_t i = 0; i < res.n; i++) {
                used += hm_dht_record_encoded_size(&m->records[i]);
                extra += m->held[i] < 128 ? 1 : m->held[i] < 256 ? 2 : m->held[i] < 65536 ? 3 : 5;
            }
            if (used + extra > room)
                result = hm_dht_store_get_held(d->store, q->target, secs(now_ms),
                                               q->has_cursor ? q->cursor : NULL, q->cursor_len,
                                               room > extra ? room - extra : 0, m->records,
                                               m->held, HM_DHT_PROTO_MAX_RECORDS, &res);
        }
        if (result == 0) {
            m->n_records = res.n;
            m->more = res.n > 0 && res.more;
            m->has_held = want_held;
        }
        if (!m->more)
            m->n_contacts = hm_rt_closest(d->rt, q->target,
                                          HM_MIN(d->cfg.k, (unsigned)HM_DHT_PROTO_MAX_CONTACTS),
                                          m->contacts, HM_RT_SKIP_FAILING);
        break;
    }
    case HM_DHT_MSG_STORE:
        if (!verified) {
            m->status = -EACCES;
            break;
        }
        hm_node_id_from_pk(pk, nid);
        /* The store charges the request's origin as well as its identity:
         * identities are free, addresses are not (store.h). */
        hm_origin_of(from, &org);
        m->status = hm_dht_store_put_from(d->store, &q->record, nid, &org, secs(now_ms));
        if (m->status < -4095 || m->status > 0)
            m->status = -EINVAL;
        break;
    default:
        return;
    }
    send_reply(d, pk, from, m, budget);
}

/* ---- public entry points ---- */

void hm_dht_input(hm_dht *d, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                  const uint8_t *msg, size_t len, uint64_t now_ms)
{
    hm_dht_msg *m = &d->msg_in;
    int request;

    if (len < 2 || len > HM_DHT_PROTO_MAX_SIZE || memcmp(pk, d->id.pk, HM_PK_BYTES) == 0) {
        d->st.bad_messages++;
        goto out;
    }
    /*
     * Cap, filter, rate-limit, then parse. The type is the array's first
     * element: a positive fixint right after a fixarray header. Requests
     * are metered per address before they are decoded; replies need no
     * meter, since only those we asked for are accepted.
     */
    request = (msg[0] & 0xf0) == 0x90 && msg[1] < HM_DHT_MSG_REPLY;
    if (request) {
        if (d->cfg.client_mode)
            goto out; /* client mode answers nothing */
        if (!rate_allow(d, from, now_ms)) {
            d->st.rate_limited++;
            goto out;
        }
    }
    if (hm_dht_msg_decode(msg, len, m) < 0 || hm_dht_msg_is_request(m->type) != request) {
        d->st.bad_messages++;
        goto out;
    }
    if (request) {
        d->st.requests_received++;
        if (!(m->flags & HM_DHT_FLAG_CLIENT))
            observe(d, pk, from, 0, now_ms);
        serve(d, pk, from, m, len, now_ms);
    } else {
        on_reply(d, pk, from, m, now_ms);
    }
out:
    flush_done(d, now_ms);
}

static void many_pump(hm_dht *d);

uint64_t hm_dht_periodic(hm_dht *d, uint64_t now_ms)
{
    uint64_t next;
    unsigned refreshes = 0;

    /* Request timeouts. Handling one may send others, so restart the scan after each. */
    for (size_t i = 0; i < d->nreqs;) {
        struct req *q = &d->reqs[i];
        struct op *qo;
        if (!q->slowed && q->soft_ms <= now_ms) {
            /* Past its adaptive timeout: the lookup goes on without it. A
             * busy peer still has until deadline_ms (and a second try), so
             * only dead or lost ones cost it anything. */
            q->slowed = 1;
            if (q->purpose == P_LOOKUP && (qo = op_find_active(d, q->op_id)) != NULL) {
                struct req copy = *q;
                on_slow_lookup(d, qo, &copy, now_ms);
                i = 0; /* the step may have sent requests */
                continue;
            }
            suspect_add(d, q->id, now_ms);
        }
        if (q->deadline_ms <= now_ms) {
            /* The second try goes out whether or not its operation still
             * runs: a lookup that finished without this contact (it was
             * slow, others answered) would otherwise count one lost
             * datagram as the contact's failure, and a burst of lost
             * replies would drop live contacts from the table, and with
             * them the values they hold. */
            if (q->pkt != NULL && !q->resent) {
                q->resent = 1;
                q->deadline_ms = now_ms + d->cfg.request_timeout_ms;
                if (d->io.send(d->io.ud, q->pk, (const struct sockaddr *)&q->addr, q->pkt,
                               q->pkt_len) == 0) {
                    i++;
                    continue;
                }
            }
            struct req r = d->reqs[i];
            req_remove(d, &d->reqs[i]);
            on_timeout(d, &r, now_ms);
            i = 0;
            continue;
        }
        i++;
    }
    /* Operation deadlines: a get returns what it found, a put what it stored. */
    struct op *o, *next_o;
    TAILQ_FOREACH_SAFE(o, &d->ops, link, next_o) {
        if (o->deadline_ms <= now_ms) {
            int status = -ETIMEDOUT;
            if ((o->kind == OP_GET && o->nheld > 0) || (o->kind == OP_PUT && o->stored > 0) ||
                o->kind == OP_FIND)
                status = 0;
            op_finish(d, o, status, now_ms);
        }
    }
    if (now_ms >= d->rotate_at) {
        memcpy(d->prev_secret, d->secret, sizeof(d->secret));
        d->io.random(d->io.ud, d->secret, sizeof(d->secret));
        d->rotate_at = now_ms + SECRET_ROTATE_MS;
    }
    if (now_ms >= d->sweep_at) {
        hm_dht_store_sweep(d->store, secs(now_ms));
        d->sweep_at = now_ms + SWEEP_MS;
    }
    probe_failing(d, now_ms);
    while (refreshes < MAX_REFRESH_PER_CALL && d->nops < d->cfg.max_lookups &&
           hm_rt_size(d->rt) > 0) {
        uint8_t rnd[HM_RT_ID_BYTES], t[HM_RT_ID_BYTES];
        d->io.random(d->io.ud, rnd, sizeof(rnd));
        if (!hm_rt_refresh_target(d->rt, now_ms, rnd, t))
            break;
        start_find(d, t, 0, now_ms);
        refreshes++;
    }
    d->now_ms = now_ms;
    many_pump(d);
    flush_done(d, now_ms);

    next = HM_MIN(d->rotate_at, d->sweep_at);
    if (d->probing)
        next = HM_MIN(next, d->probe_at);
    if (hm_rt_size(d->rt) > 0)
        next = HM_MIN(next, hm_rt_next_refresh_ms(d->rt));
    for (size_t i = 0; i < d->nreqs; i++)
        next = HM_MIN(next, d->reqs[i].slowed ? d->reqs[i].deadline_ms : d->reqs[i].soft_ms);
    TAILQ_FOREACH(o, &d->ops, link)
        next = HM_MIN(next, o->deadline_ms);
    if (!TAILQ_EMPTY(&d->done) || next < now_ms)
        next = now_ms;
    return next;
}

static void merge_cfg(hm_dht_config *c, const hm_dht_config *in)
{
    hm_dht_config def;
    hm_rt_config rdef;
    hm_dht_store_config sdef;

    hm_dht_config_default(&def);
    *c = *in;
#define DEF(f)                                                                                 \
    if (!c->f)                                                                                 \
    c->f = def.f
    DEF(k);
    DEF(alpha);
    DEF(disjoint_paths);
    DEF(num_replicas);
    DEF(request_timeout_ms);
    DEF(request_timeout_min_ms);
    DEF(max_lookups);
    DEF(max_datagram);
    DEF(rate_per_s);
    DEF(rate_burst);
    DEF(rate_ban_ms);
#undef DEF
    hm_rt_config_default(&rdef);
    if (!c->rt.k)
        c->rt.k = c->k;
    if (!c->rt.cache_size)
        c->rt.cache_size = c->rt.k;
#define RDEF(f)                                                                                \
    if (!c->rt.f)                                                                              \
    c->rt.f = rdef.f
    RDEF(depth_modulo);
    RDEF(max_buckets);
    RDEF(max_failures);
    RDEF(subnet_per_bucket);
    RDEF(subnet_per_table);
    RDEF(blacklist_size);
    RDEF(refresh_ms);
    RDEF(ban_base_ms);
    RDEF(ban_max_ms);
#undef RDEF
    hm_dht_store_config_default(&sdef);
#define SDEF(f)                                                                                \
    if (!c->store.f)                                                                           \
    c->store.f = sdef.f
    SDEF(max_value);
    SDEF(max_ttl);
    SDEF(max_bytes);
    SDEF(max_entries);
    SDEF(max_peer_bytes);
    SDEF(max_origin_share);
    SDEF(max_tombstones);
    SDEF(clock_skew);
#undef SDEF
}

int hm_dht_new(const hm_identity *id, const uint8_t swarm_id[HM_SWARM_ID_BYTES],
               const hm_dht_config *cfg, const hm_dht_io *io, uint64_t now_ms, hm_dht **out)
{
    hm_dht_config defcfg;
    hm_dht *d = NULL;
    int result;

    *out = NULL;
    if (id == NULL || io == NULL || io->send == NULL || io->random == NULL)
        return -EINVAL;
    if (cfg == NULL) {
        hm_dht_config_default(&defcfg);
        cfg = &defcfg;
    }
    if ((d = calloc(1, sizeof(*d))) == NULL)
        return -ENOMEM;
    TAILQ_INIT(&d->ops);
    TAILQ_INIT(&d->done);
    LIST_INIT(&d->many);
    merge_cfg(&d->cfg, cfg);
    if (d->cfg.disjoint_paths > MAX_PATHS || d->cfg.k > HM_DHT_PROTO_MAX_CONTACTS ||
        d->cfg.max_datagram > HM_DHT_PROTO_MAX_SIZE || d->cfg.max_datagram < 256 ||
        !(d->cfg.rate_per_s > 0) || !(d->cfg.rate_burst >= 1)) {
        result = -EINVAL;
        goto out;
    }
    d->id = *id;
    memcpy(d->swarm_id, swarm_id, HM_SWARM_ID_BYTES);
    d->io = *io;
    memcpy(d->cfg.store.swarm_id, swarm_id, HM_SWARM_ID_BYTES);
    if ((result = hm_rt_new(id->node_id, &d->cfg.rt, now_ms, &d->rt)) < 0)
        goto out;
    if ((result = hm_dht_store_new(&d->cfg.store, &d->store)) < 0)
        goto out;
    io->random(io->ud, d->secret, sizeof(d->secret));
    io->random(io->ud, d->prev_secret, sizeof(d->prev_secret));
    d->rotate_at = now_ms + SECRET_ROTATE_MS;
    d->sweep_at = now_ms + SWEEP_MS;
    if ((result = ltab_init(&d->rates, MAX_RATE_ENTRIES, sizeof(struct rate))) < 0)
        goto out;
    if ((result = ltab_init(&d->tokens, MAX_PEER_TOKENS, sizeof(struct peer_token))) < 0)
        goto out;
    *out = d;
    d = NULL;
    result = 0;
out:
    if (d)
        hm_dht_free(d);
    return result;
}

/* ---- get_many: a batch of gets with one callback ---- */

struct many_key {
    struct many *m;
    size_t idx;
};

struct many {
    hm_dht *d;
    LIST_ENTRY(many) link; /* in d->many while keys wait for slots */
    int queued;
    size_t n, started, answered;
    uint64_t deadline_ms;
    uint8_t **keys;
    size_t *key_lens;
    struct many_key *ctx;
    int *status;
    struct held **held;  /* per key, copies of its values */
    size_t *nheld;
    hm_dht_get_many_cb cb;
    void *ud;
};

static void many_free(struct many *m)
{
    for (size_t i = 0; i < m->n; i++) {
        free(m->keys ? m->keys[i] : NULL);
        if (m->held && m->held[i]) {
            for (size_t j = 0; j < m->nheld[i]; j++)
                held_free(&m->held[i][j]);
            free(m->held[i]);
        }
    }
    free(m->keys);
    free(m->key_lens);
    free(m->ctx);
    free(m->status);
    free(m->held);
    free(m->nheld);
    free(m);
}

static void many_unqueue(struct many *m)
{
    if (m->queued)
        LIST_REMOVE(m, link);
    m->queued = 0;
}

static void many_finish(struct many *m)
{
    size_t total = 0;
    for (size_t i = 0; i < m->n; i++)
        total += m->nheld[i];
    hm_dht_many_result *res = calloc(m->n, sizeof(*res));
    hm_dht_value *vals = calloc(total ? total : 1, sizeof(*vals));
    if (res == NULL) {
        /* Not even the result array: the caller learns of the batch's end. */
        m->cb(m->ud, NULL, 0);
        goto out;
    }
    size_t k = 0;
    for (size_t i = 0; i < m->n; i++) {
        res[i].status = vals == NULL ? -ENOMEM : m->status[i];
        res[i].values = vals == NULL ? NULL : vals + k;
        res[i].n = vals == NULL ? 0 : m->nheld[i];
        for (size_t j = 0; vals != NULL && j < m->nheld[i]; j++, k++) {
            vals[k].rec = m->held[i][j].rec;
            memcpy(vals[k].source_pk, m->held[i][j].source_pk, HM_PK_BYTES);
            vals[k].held_s = m->held[i][j].held_s;
        }
    }
    m->cb(m->ud, res, m->n);
out:
    free(vals);
    free(res);
    many_free(m);
}

static void many_on_get(void *ud, int status, const hm_dht_value *values, size_t n,
                        const hm_dht_lookup_info *info)
{
    struct many_key *c = ud;
    struct many *m = c->m;
    HM_UNUSED(info);
    m->status[c->idx] = status;
    if (status == 0 && n > 0) {
        m->held[c->idx] = calloc(n, sizeof(struct held));
        if (m->held[c->idx] == NULL) {
            m->status[c->idx] = -ENOMEM;
        } else {
            for (size_t j = 0; j < n; j++) {
                if (held_copy(&m->held[c->idx][j], &values[j].rec, values[j].source_pk) < 0) {
                    m->status[c->idx] = -ENOMEM;
                    break;
                }
                m->held[c->idx][j].held_s = values[j].held_s;
                m->nheld[c->idx]++;
            }
        }
    }
    m->answered++;
    if (m->answered == m->n)
        many_finish(m);
    else
        many_pump(m->d); /* a slot just freed up */
}

/* Starts the keys of queued batches while lookup slots are free. */
static void many_pump(hm_dht *d)
{
    struct many *m, *next;
    LIST_FOREACH_SAFE(m, &d->many, link, next) {
        while (m->started < m->n && d->nops < d->cfg.max_lookups) {
            size_t i = m->started++;
            uint64_t left = m->deadline_ms > d->now_ms ? m->deadline_ms - d->now_ms : 0;
            int r = left == 0 ? -ETIMEDOUT
                              : hm_dht_get(d, m->keys[i], m->key_lens[i], d->now_ms, left,
                                           many_on_get, &m->ctx[i], NULL);
            if (r < 0) {
                m->status[i] = r;
                m->answered++;
            }
        }
        if (m->started == m->n) {
            many_unqueue(m);
            /* Every key failed to start: nothing else will finish the batch. */
            if (m->answered == m->n)
                many_finish(m);
        }
    }
}

int hm_dht_get_many(hm_dht *d, const uint8_t *const *keys, const size_t *key_lens, size_t n_keys,
                    uint64_t now_ms, uint64_t timeout_ms, hm_dht_get_many_cb cb, void *ud)
{
    if (keys == NULL || key_lens == NULL || n_keys == 0 || cb == NULL)
        return -EINVAL;
    if (n_keys > HM_DHT_MANY_MAX)
        return -EMSGSIZE;
    for (size_t i = 0; i < n_keys; i++)
        if (keys[i] == NULL || key_lens[i] == 0 || key_lens[i] > HM_DHT_KEY_MAX)
            return -EINVAL;
    struct many *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return -ENOMEM;
    m->d = d;
    m->n = n_keys;
    m->cb = cb;
    m->ud = ud;
    m->deadline_ms = now_ms + timeout_ms;
    m->keys = calloc(n_keys, sizeof(*m->keys));
    m->key_lens = calloc(n_keys, sizeof(*m->key_lens));
    m->ctx = calloc(n_keys, sizeof(*m->ctx));
    m->status = calloc(n_keys, sizeof(*m->status));
    m->held = calloc(n_keys, sizeof(*m->held));
    m->nheld = calloc(n_keys, sizeof(*m->nheld));
    if (!m->keys || !m->key_lens || !m->ctx || !m->status || !m->held || !m->nheld) {
        many_free(m);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n_keys; i++) {
        m->keys[i] = malloc(key_lens[i]);
        if (m->keys[i] == NULL) {
            many_free(m);
            return -ENOMEM;
        }
        memcpy(m->keys[i], keys[i], key_lens[i]);
        m->key_lens[i] = key_lens[i];
        m->ctx[i].m = m;
        m->ctx[i].idx = i;
    }
    /* The lookups start from the next periodic call, so the callback can
     * never fire inside this one. */
    LIST_INSERT_HEAD(&d->many, m, link);
    m->queued = 1;
    d->now_ms = now_ms;
    return 0;
}

void hm_dht_free(hm_dht *d)
{
    if (d == NULL)
        return;
    /* Batches still waiting for slots: their unstarted keys are cancelled;
     * a batch whose started gets are all answered finishes here, the others
     * when their gets are cancelled below. */
    struct many *m;
    while ((m = LIST_FIRST(&d->many)) != NULL) {
        many_unqueue(m);
        while (m->started < m->n) {
            m->status[m->started++] = -ECANCELED;
            m->answered++;
        }
        if (m->answered == m->n)
            many_finish(m);
    }
    /* Pending callbacks see -ECANCELED, whether their result was queued or not. */
    struct op *o;
    while ((o = TAILQ_FIRST(&d->ops)) != NULL)
        op_finish(d, o, -ECANCELED, o->start_ms);
    while ((o = TAILQ_FIRST(&d->done)) != NULL) {
        TAILQ_REMOVE(&d->done, o, link);
        fire(d, o, -ECANCELED, o->start_ms + o->info.duration_ms);
        op_free(o);
    }
    for (size_t i = 0; i < d->nreqs; i++)
        free(d->reqs[i].pkt);
    free(d->reqs);
    ltab_free(&d->rates);
    ltab_free(&d->tokens);
    hm_rt_free(d->rt);
    hm_dht_store_free(d->store);
    sodium_memzero(d->secret, sizeof(d->secret));
    sodium_memzero(d->prev_secret, sizeof(d->prev_secret));
    hm_identity_wipe(&d->id);
    free(d);
}

int hm_dht_bootstrap(hm_dht *d, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *addr,
                     uint64_t now_ms)
{
    hm_rt_contact c;
    socklen_t alen = hm_addr_len(addr);

    if (alen == 0 || alen > sizeof(c.addr) ||
        (addr->sa_family != AF_INET && addr->sa_family != AF_INET6))
        return -EINVAL;
    memset(&c, 0, sizeof(c));
    memcpy(c.pk, pk, HM_PK_BYTES);
    hm_node_id_from_pk(pk, c.id);
    memcpy(&c.addr, addr, alen);
    return send_ping(d, &c, P_BOOT, now_ms);
}

int hm_dht_get(hm_dht *d, const uint8_t *key, size_t key_len, uint64_t now_ms,
               uint64_t timeout_ms, hm_dht_get_cb cb, void *ud, uint64_t *op_out)
{
    uint8_t kid[HM_DHT_KEY_ID_BYTES];
    hm_dht_record local[HM_DHT_PROTO_MAX_RECORDS];
    hm_dht_get_result res;
    const uint8_t *cursor = NULL;
    size_t cursor_len = 0;
    struct op *o;

    if (key == NULL || key_len == 0 || key_len > HM_DHT_KEY_MAX || cb == NULL)
        return -EINVAL;
    if (d->nops >= d->cfg.max_lookups)
        return -ENOBUFS;
    hm_dht_key_id(key, key_len, kid);
    if ((o = op_new(d, OP_GET, kid, now_ms, timeout_ms)) == NULL)
        return -ENOMEM;
    o->get_cb = cb;
    o->ud = ud;
    o->key_len = key_len;
    if ((o->key = malloc(key_len)) == NULL) {
        op_free(o);
        return -ENOMEM;
    }
    memcpy(o->key, key, key_len);
    /* What we hold ourselves counts as one replica, of an origin of its own. */
    for (unsigned page = 0; page < MAX_PAGES; page++) {
        uint32_t held[HM_DHT_PROTO_MAX_RECORDS];
        if (hm_dht_store_get_held(d->store, kid, secs(now_ms), cursor, cursor_len,
                                  HM_DHT_PROTO_MAX_SIZE, local, held, HM_DHT_PROTO_MAX_RECORDS,
                                  &res) < 0 ||
            res.n == 0)
            break;
        int rep = held_rep(o, d->id.pk, NULL);
        for (size_t i = 0; i < res.n; i++)
            held_note(o, rep, get_offer(d, o, &local[i], d->id.pk, secs(now_ms)), held[i]);
        if (!res.more || !local[res.n - 1].has_subkey)
            break;
        /* The store does not change between the calls, so its views stay valid. */
        cursor = local[res.n - 1].subkey;
        cursor_len = local[res.n - 1].subkey_len;
    }
    if (op_out)
        *op_out = o->id;
    op_start(d, o, now_ms);
    return 0;
}

int hm_dht_put(hm_dht *d, const uint8_t *key, size_t key_len, const uint8_t *subkey,
               size_t subkey_len, int has_subkey, const uint8_t *value, size_t value_len,
               double expiration, uint64_t now_ms, uint64_t timeout_ms, hm_dht_put_cb cb,
               void *ud, uint64_t *op_out)
{
    hm_dht_record r;
    uint8_t owner[HM_PK_BYTES], sig[HM_DHT_SIG_BYTES], kid[HM_DHT_KEY_ID_BYTES];
    struct op *o;
    int owned;

    if (key == NULL || key_len == 0 || cb == NULL || (value == NULL && value_len > 0) ||
        (has_subkey && subkey == NULL && subkey_len > 0))
        return -EINVAL;
    if (d->cfg.store.max_value < value_len)
        return -EMSGSIZE;
    if (!(expiration > secs(now_ms)))
        return -ETIME;
    if (d->nops >= d->cfg.max_lookups)
        return -ENOBUFS;
    memset(&r, 0, sizeof(r));
    r.key = key;
    r.key_len = key_len;
    r.has_subkey = has_subkey != 0;
    r.subkey = has_subkey ? (subkey ? subkey : (const uint8_t *)"") : NULL;
    r.subkey_len = has_subkey ? subkey_len : 0;
    r.value = value ? value : (const uint8_t *)"";
    r.value_len = value_len;
    r.expiration = expiration;
    if ((owned = hm_dht_record_owner(&r, owner)) < 0)
        return owned;
    if (hm_dht_record_encoded_size(&r) == 0)
        return -EMSGSIZE;
    if (owned && memcmp(owner, d->id.pk, HM_PK_BYTES) == 0) {
        /* Sequence numbers from the clock keep rising across restarts. */
        int result;
        r.seq = HM_MAX(now_ms, d->last_seq + 1);
        if ((result = hm_dht_record_sign(&r, &d->id, d->swarm_id, secs(now_ms),
                                         d->cfg.store.max_ttl, sig)) < 0)
            return result;
        d->last_seq = r.seq;
        r.sig = sig;
        if (hm_dht_record_encoded_size(&r) == 0)
            return -EMSGSIZE;
    }
    hm_dht_key_id(key, key_len, kid);
    if ((o = op_new(d, OP_PUT, kid, now_ms, timeout_ms)) == NULL)
        return -ENOMEM;
    o->put_cb = cb;
    o->ud = ud;
    if (held_copy(&o->put, &r, d->id.pk) < 0) {
        op_free(o);
        return -ENOMEM;
    }
    if (op_out)
        *op_out = o->id;
    op_start(d, o, now_ms);
    return 0;
}

int hm_dht_cancel(hm_dht *d, uint64_t op)
{
    struct op *o = op_find_active(d, op);

    if (o != NULL) {
        op_finish(d, o, -ECANCELED, o->start_ms + o->info.duration_ms);
        /* op_finish queued it last; take it back out and fire now. */
    }
    TAILQ_FOREACH(o, &d->done, link)
        if (o->id == op)
            break;
    if (o == NULL || (o->get_cb == NULL && o->put_cb == NULL))
        return -ENOENT;
    TAILQ_REMOVE(&d->done, o, link);
    fire(d, o, -ECANCELED, o->start_ms + o->info.duration_ms);
    op_free(o);
    return 0;
}

void hm_dht_set_client_mode(hm_dht *d, int on) { d->cfg.client_mode = on != 0; }

void hm_dht_get_stats(const hm_dht *d, hm_dht_stats *out)
{
    hm_dht_store_stats ss;

    *out = d->st;
    out->rt_size = hm_rt_size(d->rt);
    out->rt_depth = hm_rt_depth(d->rt);
    out->rt_buckets = hm_rt_bucket_count(d->rt);
    out->rt_cached = hm_rt_cache_count(d->rt);
    hm_dht_store_stats_get(d->store, &ss);
    out->records = ss.entries;
    out->record_bytes = ss.bytes;
    out->store_evicted = ss.evicted;
    out->lookups_active = d->nops;
}

void hm_dht_limits(const hm_dht *d, hm_limit_emit_fn emit, void *ud)
{
    hm_dht_store_stats ss;

    hm_dht_store_stats_get(d->store, &ss);
    emit(ud, "DhtRequestRate", d->st.rate_limited);
    emit(ud, "DhtStorePeerKiB", ss.refused_peer);
    emit(ud, "DhtStoreOriginShare", ss.refused_origin);
    emit(ud, "DhtStoreEntries", ss.refused_full);
    emit(ud, "DhtStoreMiB", ss.refused_full_bytes);
}

const hm_rt *hm_dht_routing(const hm_dht *d) { return d->rt; }

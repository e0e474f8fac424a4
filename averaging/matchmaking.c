/*
 * matchmaking: forms averaging groups through the DHT (see matchmaking.h
 * for the scheme, the messages and the guarantees).
 *
 * It owns the searches of one node, each with one uv timer that drives its
 * state (declaration refresh, DHT reads, the attempt deadline, the overall
 * timeout, the pruning of followers), at most one rpc call in flight (the
 * join or the wait), the inbound waits it holds as a leader, and the
 * bookkeeping of every DHT operation and rpc call it started ("ops"), so
 * that a search or the whole module can end while those are in flight:
 * their callbacks then find their search gone (or the module gone) and
 * only free their op.
 */
#include "config.h"

#include "averaging/matchmaking.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>

#include "averaging/allreduce.h"
#include "dht/record.h"
#include "src/base/origin.h"
#include "src/base/util.h"

#define MOD "mm"

#define M_JOIN "avg.mm.join"
#define M_WAIT "avg.mm.wait"
/*
 * Version 2: the members of a group this forms speak averaging protocol 2
 * (allreduce.h). Matchmaking carries the version so that peers that could
 * not average together never form a group: a version 1 node (an older
 * hivemindd) and a version 2 one refuse each other's declarations and joins
 * here, with a log line, instead of meeting in a round that then fails.
 */
#define WIRE_VERSION 2
_Static_assert(HM_AR_VERSION == 2, "bump the matchmaking version with the averaging one");
/* Candidates kept from one DHT read (the earliest ones). */
#define MAX_CANDIDATES 128
/* Leaders that recently refused us, remembered per search. */
#define MAX_REFUSED 64
/* Redirects followed in a row before going back to the candidate list. */
#define MAX_REDIRECTS 4
/* Extra life of a declaration past its deadline, at least. */
#define DECL_EXTRA_MS 2000
/* How often followers' waits are checked for dropped connections. */
#define PRUNE_MS 200

enum { OP_GET, OP_PUT, OP_JOIN, OP_WAIT };
enum { PH_DONE = 3 };

typedef struct op op;
struct op {
    hm_mm *mm; /* NULL once the module is freed */
    LIST_ENTRY(op) link; /* in mm->ops while mm is set */
    uint64_t search_id; /* 0: orphaned, the result is dropped */
    int kind;
    uint64_t call_id;
};

typedef struct follower {
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr;
    double bandwidth;
    uint64_t deadline_ms;
    uint64_t accepted_ms;
    hm_rpc_req *wait;
    hm_origin org; /* of the join request's source address */
} follower;

typedef struct peer {
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr;
    uint64_t deadline_ms;
} peer;

/*
 * A refusal of one leader's attempt (same deadline), or, with until_ms, of
 * the leader as a whole for a while (unreachable, following someone).
 */
typedef struct refusal {
    uint8_t pk[HM_PK_BYTES];
    uint64_t deadline_ms;
    uint64_t until_ms;
} refusal;

typedef struct search search;
struct search {
    hm_mm *mm;
    LIST_ENTRY(search) link; /* in mm->searches until it finishes */
    uint64_t id;
    hm_mm_cb cb;
    void *ud;

    char prefix[HM_MM_PREFIX_MAX + 1];
    char bits[HM_MM_BITS_MAX + 1];
    char key[HM_MM_KEY_MAX + 1];
    size_t key_len;
    unsigned target, min;
    uint64_t min_mm_ms, req_ms, period_ms;
    double bandwidth;
    double bandwidth_asked; /* the caller's, for a client that becomes a full peer */
    double bandwidth_factor;
    unsigned members_per_origin;
    int cap_loopback;
    int client;
    int client_asked; /* the caller asked for client mode: for the whole search */

    int phase;
    uint64_t end_ms, deadline_ms; /* DHT time */
    unsigned attempts;

    peer leader; /* REQUESTING, FOLLOWING */
    unsigned redirects;
    op *call;

    follower followers[HM_AVG_MAX_GROUP];
    size_t n_followers;

    peer cands[MAX_CANDIDATES];
    size_t n_cands, next_cand;
    refusal refused[MAX_REFUSED];
    size_t n_refused;

    int get_busy, put_busy;
    uint64_t next_get_ms, next_put_ms;
    int declared;

    uv_timer_t timer;
};

struct hm_mm {
    hm_node *node;
    hm_rpc *rpc;
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr;
    LIST_HEAD(, search) searches;
    size_t n_searches;
    LIST_HEAD(, op) ops;
    uint64_t next_id;
    uint64_t bandwidth_refused;
    uint64_t origin_refused;
    uint64_t old_version;                  /* refused, in all */
    uint64_t old_version_count, old_version_last_ms; /* for the log's rate */
};

uint64_t hm_mm_bandwidth_refused(const hm_mm *mm) { return mm->bandwidth_refused; }
uint64_t hm_mm_origin_refused(const hm_mm *mm) { return mm->origin_refused; }
uint64_t hm_mm_old_version(const hm_mm *mm) { return mm->old_version; }

static void step(search *s);
static void finish(search *s, int status, const hm_avg_group *g);

/* ------------------------------------------------------------ codec */

static const hm_wire_limits mm_limits = {
    .max_size = HM_MM_WIRE_MAX,
    .max_depth = 3,
    .max_elements = 8 + 4 * HM_AVG_MAX_GROUP,
};

static int get_bandwidth(const msgpack_object *o, double *out)
{
    double v;
    if (hm_wire_get_double(o, &v) < 0 || !isfinite(v) || v < 0)
        return -EPROTO;
    *out = v;
    return 0;
}

static int get_key(const msgpack_object *o, uint8_t *key, size_t *len)
{
    const uint8_t *p;
    uint32_t n;
    if (hm_wire_get_bin(o, &p, &n) < 0 || n == 0 || n > HM_MM_KEY_MAX)
        return -EPROTO;
    memcpy(key, p, n);
    *len = n;
    return 0;
}

int hm_mm_msg_version(const void *buf, size_t len)
{
    hm_wire_msg m;
    uint64_t v = 0;
    int result = hm_wire_decode_open_array(&m, buf, len, &mm_limits, 1, 64, HM_WIRE_ANY_VERSION);

    if (result == 0 && (hm_wire_get_uint(&m.items[0], &v) < 0 || v > INT_MAX))
        result = -EPROTO;
    hm_wire_decode_close(&m);
    return result < 0 ? result : (int)v;
}

/*
 * A join, wait or declaration of another matchmaking version (most likely
 * from an older hivemindd, which speaks averaging version 1) is refused,
 * and the operator hears it in words that say so, once a minute. Returns 1
 * when the body was of another version (and counted).
 */
static int complain_version(hm_mm *mm, const void *body, size_t len, const struct sockaddr *from,
                            const uint8_t *pk, const char *what)
{
    int version = hm_mm_msg_version(body, len);
    uint64_t now = hm_now_ms();
    char who[HM_ADDRSTRLEN];

    if (version < 0 || version == WIRE_VERSION)
        return 0;
    mm->old_version++;
    mm->old_version_count++;
    if (mm->old_version_last_ms != 0 && now - mm->old_version_last_ms < 60000)
        return 1;
    if (from == NULL || hm_format_addr(from, who, sizeof(who)) != 0) {
        static const char hex[] = "0123456789abcdef";
        size_t k = 0;
        for (size_t i = 0; pk != NULL && i < 8; i++) {
            who[k++] = hex[pk[i] >> 4];
            who[k++] = hex[pk[i] & 15];
        }
        memcpy(who + k, pk != NULL ? "..." : "a peer", pk != NULL ? 4 : 7);
    }
    hm_warn(MOD, "refused %llu matchmaking message%s %s of version %d (the latest, a %s from "
            "%s); this hivemindd forms groups of matchmaking version %d (averaging version %d) "
            "only: upgrade the peer",
            (unsigned long long)mm->old_version_count, mm->old_version_count == 1 ? "" : "s",
            mm->old_version_last_ms == 0 ? "so far" : "in the last minute", version, what, who,
            WIRE_VERSION, HM_AR_VERSION);
    mm->old_version_last_ms = now;
    mm->old_version_count = 0;
    return 1;
}

void hm_mm_encode_join(hm_wire_wr *w, const hm_mm_join *j)
{
    hm_wire_wr_array(w, 6);
    hm_wire_wr_uint(w, WIRE_VERSION);
    hm_wire_wr_bin(w, j->key, j->key_len);
    hm_wire_wr_addr(w, &j->addr);
    hm_wire_wr_double(w, j->bandwidth);
    hm_wire_wr_bool(w, j->client);
    hm_wire_wr_uint(w, j->deadline_ms);
}

void hm_mm_encode_wait(hm_wire_wr *w, const hm_mm_wait *m)
{
    hm_wire_wr_array(w, m->leave ? 3 : 2);
    hm_wire_wr_uint(w, WIRE_VERSION);
    hm_wire_wr_bin(w, m->key, m->key_len);
    if (m->leave)
        hm_wire_wr_bool(w, 1);
}

void hm_mm_encode_reply(hm_wire_wr *w, const hm_mm_reply *r)
{
    switch (r->code) {
    case HM_MM_ACCEPTED:
        hm_wire_wr_array(w, 2);
        hm_wire_wr_uint(w, HM_MM_ACCEPTED);
        hm_wire_wr_uint(w, r->deadline_ms);
        break;
    case HM_MM_REDIRECT:
    case HM_MM_DISBANDED:
        if (r->code == HM_MM_DISBANDED && !r->has_leader) {
            hm_wire_wr_array(w, 1);
            hm_wire_wr_uint(w, HM_MM_DISBANDED);
            break;
        }
        hm_wire_wr_array(w, 4);
        hm_wire_wr_uint(w, (uint64_t)r->code);
        hm_wire_wr_bin(w, r->leader_pk, HM_PK_BYTES);
        hm_wire_wr_addr(w, &r->leader_addr);
        hm_wire_wr_uint(w, r->deadline_ms);
        break;
    case HM_MM_FULL:
    case HM_MM_NOT_LOOKING:
    case HM_MM_BAD_DEADLINE:
        hm_wire_wr_array(w, 1);
        hm_wire_wr_uint(w, (uint64_t)r->code);
        break;
    case HM_MM_BEGIN:
        if (r->group.n == 0 || r->group.n > HM_AVG_MAX_GROUP) {
            if (w->err == 0)
                w->err = -EINVAL;
            return;
        }
        hm_wire_wr_array(w, 3);
        hm_wire_wr_uint(w, HM_MM_BEGIN);
        hm_wire_wr_bin(w, r->group.group_id, HM_AVG_GROUP_ID_BYTES);
        hm_wire_wr_array(w, (uint32_t)r->group.n);
        for (size_t i = 0; i < r->group.n; i++) {
            const hm_avg_member *m = &r->group.members[i];
            hm_wire_wr_array(w, 3);
            hm_wire_wr_bin(w, m->pk, HM_PK_BYTES);
            hm_wire_wr_addr(w, &m->addr);
            hm_wire_wr_double(w, m->bandwidth);
        }
        break;
    default:
        if (w->err == 0)
            w->err = -EINVAL;
    }
}

void hm_mm_encode_decl(hm_wire_wr *w, const hm_mm_decl *d)
{
    hm_wire_wr_array(w, 6);
    hm_wire_wr_uint(w, WIRE_VERSION);
    hm_wire_wr_addr(w, &d->addr);
    hm_wire_wr_double(w, d->bandwidth);
    hm_wire_wr_bool(w, d->client);
    hm_wire_wr_uint(w, d->deadline_ms);
    hm_wire_wr_bool(w, d->looking);
}


int hm_mm_decode_join(const void *buf, size_t len, hm_mm_join *out)
{
    hm_wire_msg m;
    const msgpack_object *it;
    int result;

    memset(out, 0, sizeof(*out));
    if ((result = hm_wire_decode_open_array(&m, buf, len, &mm_limits, 6, 6, WIRE_VERSION)) < 0)
        goto out;
    it = m.items;
    if (get_key(&it[1], out->key, &out->key_len) < 0 ||
        hm_wire_get_addr(&it[2], &out->addr) < 0 || get_bandwidth(&it[3], &out->bandwidth) < 0 ||
        hm_wire_get_bool(&it[4], &out->client) < 0 ||
        hm_wire_get_uint(&it[5], &out->deadline_ms) < 0)
        result = -EPROTO;
out:
    hm_wire_decode_close(&m);
    return result;
}

int hm_mm_decode_wait(const void *buf, size_t len, hm_mm_wait *out)
{
    hm_wire_msg m;
    const msgpack_object *it;
    uint32_t n;
    int result;

    memset(out, 0, sizeof(*out));
    if ((result = hm_wire_decode_open_array(&m, buf, len, &mm_limits, 2, 3, WIRE_VERSION)) < 0)
        goto out;
    it = m.items;
    n = m.n;
    if (get_key(&it[1], out->key, &out->key_len) < 0 ||
        (n == 3 && it[2].type != MSGPACK_OBJECT_BOOLEAN))
        result = -EPROTO;
    else if (n == 3)
        out->leave = it[2].via.boolean ? 1 : 0;
out:
    hm_wire_decode_close(&m);
    return result;
}

static int decode_members(const msgpack_object *o, hm_avg_group *g)
{
    const msgpack_object *ms, *f;
    uint32_t n, nf;
    if (hm_wire_get_array(o, 1, HM_AVG_MAX_GROUP, &ms, &n) < 0)
        return -EPROTO;
    for (uint32_t i = 0; i < n; i++) {
        hm_avg_member *m = &g->members[i];
        if (hm_wire_get_array(&ms[i], 3, 3, &f, &nf) < 0 ||
            hm_wire_get_bin_exact(&f[0], m->pk, HM_PK_BYTES) < 0 ||
            hm_wire_get_addr(&f[1], &m->addr) < 0 || get_bandwidth(&f[2], &m->bandwidth) < 0)
            return -EPROTO;
        for (uint32_t k = 0; k < i; k++)
            if (memcmp(g->members[k].pk, m->pk, HM_PK_BYTES) == 0)
                return -EPROTO;
    }
    g->n = n;
    return 0;
}

int hm_mm_decode_reply(const void *buf, size_t len, hm_mm_reply *out)
{
    hm_wire_msg m;
    const msgpack_object *it;
    const uint8_t *p;
    uint32_t n, bl;
    uint64_t code;
    int result;

    memset(out, 0, sizeof(*out));
    /* A reply carries no version: it opens with its code. */
    if ((result = hm_wire_decode_open_array(&m, buf, len, &mm_limits, 1, 4,
                                            HM_WIRE_ANY_VERSION)) < 0)
        goto out;
    it = m.items;
    n = m.n;
    result = -EPROTO;
    if (hm_wire_get_uint(&it[0], &code) < 0 || code > HM_MM_DISBANDED)
        goto out;
    out->code = (int)code;
    switch (out->code) {
    case HM_MM_ACCEPTED:
        if (n != 2 || hm_wire_get_uint(&it[1], &out->deadline_ms) < 0)
            goto out;
        break;
    case HM_MM_DISBANDED:
        if (n == 1)
            break;
        /* fallthrough */
    case HM_MM_REDIRECT:
        if (n != 4 || hm_wire_get_bin_exact(&it[1], out->leader_pk, HM_PK_BYTES) < 0 ||
            hm_wire_get_addr(&it[2], &out->leader_addr) < 0 ||
            hm_wire_get_uint(&it[3], &out->deadline_ms) < 0)
            goto out;
        out->has_leader = 1;
        break;
    case HM_MM_FULL:
    case HM_MM_NOT_LOOKING:
    case HM_MM_BAD_DEADLINE:
        if (n != 1)
            goto out;
        break;
    case HM_MM_BEGIN:
        if (n != 3 || hm_wire_get_bin(&it[1], &p, &bl) < 0 || bl != HM_AVG_GROUP_ID_BYTES)
            goto out;
        memcpy(out->group.group_id, p, HM_AVG_GROUP_ID_BYTES);
        if (decode_members(&it[2], &out->group) < 0)
            goto out;
        break;
    default:
        goto out;
    }
    result = 0;
out:
    hm_wire_decode_close(&m);
    return result;
}

int hm_mm_decode_decl(const void *buf, size_t len, hm_mm_decl *out)
{
    hm_wire_msg m;
    const msgpack_object *it;
    int result;

    memset(out, 0, sizeof(*out));
    if ((result = hm_wire_decode_open_array(&m, buf, len, &mm_limits, 6, 6, WIRE_VERSION)) < 0)
        goto out;
    it = m.items;
    if (hm_wire_get_addr(&it[1], &out->addr) < 0 ||
        get_bandwidth(&it[2], &out->bandwidth) < 0 ||
        hm_wire_get_bool(&it[3], &out->client) < 0 ||
        hm_wire_get_uint(&it[4], &out->deadline_ms) < 0 ||
        hm_wire_get_bool(&it[5], &out->looking) < 0)
        result = -EPROTO;
out:
    hm_wire_decode_close(&m);
    return result;
}

/* ------------------------------------------------------------ keys and bits */

int hm_mm_group_key(const char *prefix, const char *bits, char *out, size_t cap)
{
    if (prefix == NULL)
        return -EINVAL;
    if (bits == NULL)
        bits = "";
    size_t pl = strnlen(prefix, HM_MM_PREFIX_MAX + 1);
    size_t bl = strnlen(bits, HM_MM_BITS_MAX + 1);
    if (pl == 0 || pl > HM_MM_PREFIX_MAX || bl > HM_MM_BITS_MAX)
        return -EINVAL;
    /* An owner marker in the key would make every declaration malformed. */
    if (strstr(prefix, "[owner:") != NULL)
        return -EINVAL;
    for (size_t i = 0; i < bl; i++)
        if (bits[i] != '0' && bits[i] != '1')
            return -EINVAL;
    if (pl + 3 + bl + 1 > cap)
        return -EMSGSIZE;
    memcpy(out, prefix, pl);
    memcpy(out + pl, ".0b", 3);
    memcpy(out + pl + 3, bits, bl);
    out[pl + 3 + bl] = '\0';
    return (int)(pl + 3 + bl);
}

/* A uniform draw below bound from BLAKE2b(group_id, "moshpit", counter). */
static uint64_t id_draw(const uint8_t group_id[HM_AVG_GROUP_ID_BYTES], uint64_t counter,
                        uint64_t bound)
{
    uint8_t in[HM_AVG_GROUP_ID_BYTES + 7 + 8], h[8];
    uint64_t v = 0;
    memcpy(in, group_id, HM_AVG_GROUP_ID_BYTES);
    memcpy(in + HM_AVG_GROUP_ID_BYTES, "moshpit", 7);
    for (int i = 0; i < 8; i++)
        in[HM_AVG_GROUP_ID_BYTES + 7 + i] = (uint8_t)(counter >> (8 * i));
    crypto_generichash(h, sizeof(h), in, sizeof(in), NULL, 0);
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)h[i] << (8 * i);
    /* The bias of a 64-bit draw reduced modulo at most 64 is below 2^-57. */
    return v % bound;
}

void hm_mm_next_bits(const char *bits, const uint8_t group_id[HM_AVG_GROUP_ID_BYTES],
                     size_t index, size_t group_size, unsigned num_buckets,
                     char out[HM_MM_BITS_MAX + 1])
{
    unsigned perm[HM_AVG_MAX_GROUP];
    char cat[2 * HM_MM_BITS_MAX + 8];
    size_t len = bits == NULL ? 0 : strnlen(bits, HM_MM_BITS_MAX);
    size_t nb = num_buckets, nbits = 0;

    out[0] = '\0';
    if (len == 0 || group_size == 0 || index >= group_size)
        return;
    if (nb < group_size)
        nb = group_size;
    if (nb > HM_AVG_MAX_GROUP)
        nb = HM_AVG_MAX_GROUP;
    if (index >= nb)
        index %= nb;
    while (((size_t)1 << nbits) < nb)
        nbits++;
    /* The first group_size entries of a permutation of the buckets drawn
     * from the group id: every member gets a distinct bucket. */
    for (size_t i = 0; i < nb; i++)
        perm[i] = (unsigned)i;
    for (size_t i = 0; i + 1 < nb; i++) {
        size_t j = i + (size_t)id_draw(group_id, i, nb - i);
        unsigned t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    unsigned bucket = perm[index];
    memcpy(cat, bits, len);
    for (size_t i = 0; i < nbits; i++)
        cat[len + i] = (bucket >> (nbits - 1 - i)) & 1 ? '1' : '0';
    memcpy(out, cat + nbits, len);
    out[len] = '\0';
}

/* ------------------------------------------------------------ helpers */

static uint64_t now_ms(const hm_mm *mm) { return hm_node_dht_now_ms(mm->node); }

/* Whether key (da, pa) comes before (db, pb). */
static int key_less(uint64_t da, const uint8_t pa[HM_PK_BYTES], uint64_t db,
                    const uint8_t pb[HM_PK_BYTES])
{
    if (da != db)
        return da < db;
    return memcmp(pa, pb, HM_PK_BYTES) < 0;
}

/* Our key; client-mode peers come after everyone. */
static uint64_t self_deadline(const search *s) { return s->client ? UINT64_MAX : s->deadline_ms; }

static search *search_by_id(hm_mm *mm, uint64_t id)
{
    if (id == 0)
        return NULL;
    search *s;
    LIST_FOREACH(s, &mm->searches, link)
        if (s->id == id)
            return s;
    return NULL;
}

static search *search_by_key(hm_mm *mm, const uint8_t *key, size_t len)
{
    search *s;
    LIST_FOREACH(s, &mm->searches, link)
        if (s->key_len == len && memcmp(s->key, key, len) == 0)
            return s;
    return NULL;
}

static op *op_new(hm_mm *mm, search *s, int kind)
{
    op *o = calloc(1, sizeof(*o));
    if (o == NULL)
        return NULL;
    o->mm = mm;
    o->search_id = s != NULL ? s->id : 0;
    o->kind = kind;
    LIST_INSERT_HEAD(&mm->ops, o, link);
    return o;
}

/* Unlinks and frees an op. */
static void op_free(op *o)
{
    if (o->mm != NULL)
        LIST_REMOVE(o, link);
    free(o);
}

/*
 * Ends an op whose callback fired: returns its search (NULL when the
 * module or the search is gone, or the op was orphaned) and frees the op.
 */
static search *op_done(op *o)
{
    hm_mm *mm = o->mm;
    uint64_t id = o->search_id;
    op_free(o);
    return mm == NULL ? NULL : search_by_id(mm, id);
}

static int reply_body(const hm_mm_reply *r, uint8_t *buf, size_t cap, size_t *len)
{
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, buf, cap);
    hm_mm_encode_reply(&w, r);
    *len = w.len;
    return hm_wire_wr_error(&w);
}

static void respond_code(hm_rpc_req *req, int code)
{
    uint8_t buf[64];
    size_t len;
    hm_mm_reply r = {.code = code};
    if (reply_body(&r, buf, sizeof(buf), &len) == 0)
        (void)hm_rpc_respond(req, 0, buf, len);
    else
        (void)hm_rpc_respond(req, -EPROTO, NULL, 0);
}

static int is_refused(const search *s, const peer *p, uint64_t now)
{
    for (size_t i = 0; i < s->n_refused; i++) {
        const refusal *f = &s->refused[i];
        if (memcmp(f->pk, p->pk, HM_PK_BYTES) != 0)
            continue;
        if (now < f->until_ms || f->deadline_ms == p->deadline_ms)
            return 1;
    }
    return 0;
}

/*
 * The refusal entry of p, made (nothing refused yet) when there is none;
 * the oldest entry goes when full.
 */
static refusal *refusal_of(search *s, const peer *p)
{
    for (size_t i = 0; i < s->n_refused; i++)
        if (memcmp(s->refused[i].pk, p->pk, HM_PK_BYTES) == 0)
            return &s->refused[i];
    if (s->n_refused == MAX_REFUSED) {
        memmove(&s->refused[0], &s->refused[1], (MAX_REFUSED - 1) * sizeof(refusal));
        s->n_refused--;
    }
    refusal *f = &s->refused[s->n_refused++];
    memcpy(f->pk, p->pk, HM_PK_BYTES);
    f->deadline_ms = 0; /* no attempt refused */
    f->until_ms = 0;
    return f;
}

/*
 * Remembers a refusal: of the leader's current attempt (transient_ms 0) or
 * of the leader for transient_ms.
 */
static void refuse(search *s, const peer *p, uint64_t transient_ms, uint64_t now)
{
    refusal *f = refusal_of(s, p);
    f->deadline_ms = p->deadline_ms;
    if (transient_ms > 0)
        f->until_ms = HM_MAX(f->until_ms, now + transient_ms);
}

/*
 * Refuses a leader for ms without refusing its attempt: a leader whose key
 * is later than ours (BAD_DEADLINE) may still take us once it is committed.
 */
static void refuse_briefly(search *s, const peer *p, uint64_t ms, uint64_t now)
{
    refusal *f = refusal_of(s, p);
    f->until_ms = HM_MAX(f->until_ms, now + ms);
}

/*
 * A leader is committed when it has followers and its deadline is less
 * than a request timeout away: it asks nobody else before it begins (see
 * try_next_candidate), so it may also take a joiner whose key is earlier
 * than its own without any risk of a cycle.
 */
static int committed(const search *s, uint64_t now)
{
    return s->phase == HM_MM_SEARCHING && !s->client && s->n_followers > 0 &&
           now < s->deadline_ms && s->deadline_ms <= now + s->req_ms;
}

/*
 * A peer is stranded when nobody follows it and its deadline is less than
 * a request timeout away: the later peers it was waiting for have led
 * groups of their own, and without a follower it would disband at its
 * deadline and find them begun. It then asks later leaders too, which take
 * it if they are committed.
 */
static int stranded(const search *s, uint64_t now)
{
    return s->phase == HM_MM_SEARCHING && !s->client && s->n_followers == 0 &&
           s->deadline_ms <= now + s->req_ms;
}

static size_t n_waiting(const search *s)
{
    size_t k = 0;
    for (size_t i = 0; i < s->n_followers; i++)
        if (s->followers[i].wait != NULL)
            k++;
    return k;
}

static void drop_follower(search *s, size_t i)
{
    s->followers[i] = s->followers[s->n_followers - 1];
    s->n_followers--;
}

/*
 * Drops followers whose wait was cancelled (the connection dropped, or
 * they gave up) and accepted ones that never sent their wait.
 */
static void prune_followers(search *s, uint64_t now)
{
    for (size_t i = 0; i < s->n_followers;) {
        follower *f = &s->followers[i];
        int gone;
        if (f->wait != NULL)
            gone = hm_rpc_req_cancelled(f->wait);
        else
            gone = now >= f->accepted_ms + s->req_ms;
        if (!gone) {
            i++;
            continue;
        }
        hm_debug(MOD, "%s: follower left", s->key);
        if (f->wait != NULL)
            (void)hm_rpc_respond(f->wait, -ECANCELED, NULL, 0);
        drop_follower(s, i);
    }
}

/* Answers every held wait with DISBANDED (and a leader to try, if any). */
static void disband(search *s, const peer *next_leader)
{
    uint8_t buf[256];
    size_t len = 0;
    hm_mm_reply r = {.code = HM_MM_DISBANDED};
    if (next_leader != NULL) {
        r.has_leader = 1;
        memcpy(r.leader_pk, next_leader->pk, HM_PK_BYTES);
        r.leader_addr = next_leader->addr;
        r.deadline_ms = next_leader->deadline_ms;
    }
    int enc = reply_body(&r, buf, sizeof(buf), &len);
    for (size_t i = 0; i < s->n_followers; i++) {
        follower *f = &s->followers[i];
        if (f->wait == NULL)
            continue;
        if (enc == 0)
            (void)hm_rpc_respond(f->wait, 0, buf, len);
        else
            (void)hm_rpc_respond(f->wait, -EPROTO, NULL, 0);
        f->wait = NULL;
    }
    if (s->n_followers > 0)
        hm_debug(MOD, "%s: disbanded %zu followers", s->key, s->n_followers);
    s->n_followers = 0;
}

static void cancel_call(search *s)
{
    op *o = s->call;
    if (o == NULL)
        return;
    s->call = NULL;
    o->search_id = 0;
    /* Fires the op's callback now, which finds it orphaned and frees it. */
    (void)hm_rpc_cancel(s->mm->rpc, o->call_id);
}

/* ------------------------------------------------------------ DHT */

static void on_put(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    HM_UNUSED(stored);
    HM_UNUSED(info);
    op *o = ud;
    search *s = op_done(o);
    if (s == NULL)
        return;
    s->put_busy = 0;
    if (status == -ECANCELED) {
        finish(s, -ECANCELED, NULL);
        return;
    }
    if (status != 0)
        hm_debug(MOD, "%s: declaration not stored: %s", s->key, hm_strerror(status));
    step(s);
}

/* Stores our declaration (looking or not) under the group key. */
static int put_decl(hm_mm *mm, search *s, const char *key, size_t key_len, uint64_t deadline,
                    double bandwidth, int looking, double ttl_s, uint64_t timeout_ms)
{
    uint8_t value[128];
    char marker[HM_DHT_OWNER_MARKER_LEN + 1];
    hm_wire_wr w;
    /* The declared address, read each time (it can change); with none that
     * others could dial, nothing is declared (docs/protocol.md,
     * Reachability): declare() tries again later. */
    struct sockaddr_storage ann;
    int r = hm_node_announce(mm->node, &ann);
    if (r < 0)
        return r;
    mm->addr = ann;
    hm_mm_decl d = {.addr = mm->addr, .bandwidth = bandwidth, .client = 0,
                    .deadline_ms = deadline, .looking = looking};

    hm_wire_wr_init_fixed(&w, value, sizeof(value));
    hm_mm_encode_decl(&w, &d);
    if ((r = hm_wire_wr_error(&w)) < 0)
        return r;
    hm_dht_owner_marker(mm->pk, marker);
    op *o = op_new(mm, s, OP_PUT);
    if (o == NULL)
        return -ENOMEM;
    r = hm_node_dht_put(mm->node, (const uint8_t *)key, key_len, (const uint8_t *)marker,
                        strlen(marker), 1, value, w.len, ttl_s, timeout_ms, on_put, o);
    if (r < 0)
        op_free(o);
    return r;
}

static int declare(search *s, uint64_t now)
{
    int r;
    uint64_t left = s->deadline_ms > now ? s->deadline_ms - now : 0;
    uint64_t life = left + HM_MAX((uint64_t)DECL_EXTRA_MS, 2 * s->req_ms);
    s->next_put_ms = now + HM_MAX(life / 2, (uint64_t)100);
    r = put_decl(s->mm, s, s->key, s->key_len, s->deadline_ms, s->bandwidth, 1,
                 (double)life / 1000.0, 2 * s->req_ms);
    if (r == 0) {
        s->put_busy = 1;
        s->declared = 1;
    }
    return r;
}

static int cand_cmp(const void *a, const void *b)
{
    const peer *x = a, *y = b;
    if (key_less(x->deadline_ms, x->pk, y->deadline_ms, y->pk))
        return -1;
    return key_less(y->deadline_ms, y->pk, x->deadline_ms, x->pk) ? 1 : 0;
}

static void on_get(void *ud, int status, const hm_dht_value *values, size_t n,
                   const hm_dht_lookup_info *info)
{
    HM_UNUSED(info);
    op *o = ud;
    search *s = op_done(o);
    if (s == NULL)
        return;
    uint64_t now = now_ms(s->mm);
    s->get_busy = 0;
    s->next_get_ms = now + s->period_ms;
    if (status == -ECANCELED) {
        finish(s, -ECANCELED, NULL);
        return;
    }
    if (status < 0) {
        hm_debug(MOD, "%s: DHT read failed: %s", s->key, hm_strerror(status));
        step(s);
        return;
    }
    s->n_cands = 0;
    for (size_t i = 0; i < n; i++) {
        const hm_dht_record *rec = &values[i].rec;
        peer p;
        hm_mm_decl d;
        /* Only owned subkeys count: the DHT checked their signatures. */
        if (!rec->has_subkey || hm_dht_record_owner(rec, p.pk) != 1)
            continue;
        if (memcmp(p.pk, s->mm->pk, HM_PK_BYTES) == 0)
            continue;
        if (hm_mm_decode_decl(rec->value, rec->value_len, &d) < 0) {
            (void)complain_version(s->mm, rec->value, rec->value_len, NULL, p.pk, "declaration");
            continue;
        }
        if (!d.looking || d.client)
            continue;
        /* A leader whose deadline is long past has finished or moved on. */
        if (d.deadline_ms + 2 * s->req_ms < now)
            continue;
        p.addr = d.addr;
        p.deadline_ms = d.deadline_ms;
        if (s->n_cands < MAX_CANDIDATES) {
            s->cands[s->n_cands++] = p;
        } else {
            /* Keep the earliest: replace the latest held if this one is earlier. */
            size_t worst = 0;
            for (size_t k = 1; k < s->n_cands; k++)
                if (cand_cmp(&s->cands[k], &s->cands[worst]) > 0)
                    worst = k;
            if (cand_cmp(&p, &s->cands[worst]) < 0)
                s->cands[worst] = p;
        }
    }
    qsort(s->cands, s->n_cands, sizeof(peer), cand_cmp);
    s->next_cand = 0;
    step(s);
}

static int start_get(search *s)
{
    op *o = op_new(s->mm, s, OP_GET);
    if (o == NULL)
        return -ENOMEM;
    int r = hm_node_dht_get(s->mm->node, (const uint8_t *)s->key, s->key_len, 2 * s->req_ms,
                            on_get, o);
    if (r < 0) {
        op_free(o);
        s->next_get_ms = now_ms(s->mm) + s->period_ms;
        return r;
    }
    s->get_busy = 1;
    return 0;
}

/* ------------------------------------------------------------ the end of a search */

static void on_search_closed(uv_handle_t *h) { free(h->data); }

/*
 * Ends a search: answers the followers, cancels the call in flight,
 * withdraws the declaration, fires the callback and frees the search once
 * its timer is closed.
 */
static void finish(search *s, int status, const hm_avg_group *g)
{
    hm_mm *mm = s->mm;
    if (s->phase == PH_DONE)
        return;
    s->phase = PH_DONE;
    disband(s, NULL);
    cancel_call(s);
    if (s->declared && !s->client)
        (void)put_decl(mm, NULL, s->key, s->key_len, s->deadline_ms, s->bandwidth, 0,
                       (double)DECL_EXTRA_MS / 1000.0, 2 * s->req_ms);
    LIST_REMOVE(s, link);
    mm->n_searches--;
    uv_timer_stop(&s->timer);
    uv_close((uv_handle_t *)&s->timer, on_search_closed);
    hm_mm_cb cb = s->cb;
    void *ud = s->ud;
    if (status == 0)
        hm_debug(MOD, "%s: group of %zu formed", s->key, g->n);
    else
        hm_debug(MOD, "%s: matchmaking ended: %s", s->key, hm_strerror(status));
    cb(ud, status, status == 0 ? g : NULL);
}

/* Completes a group received or built: our index and next round's bits. */
static int complete_group(search *s, hm_avg_group *g)
{
    size_t self = g->n;
    for (size_t i = 0; i < g->n; i++)
        if (memcmp(g->members[i].pk, s->mm->pk, HM_PK_BYTES) == 0)
            self = i;
    if (self == g->n)
        return -EPROTO;
    g->self = self;
    hm_mm_next_bits(s->bits, g->group_id, self, g->n, s->target, g->next_bits);
    return 0;
}

/* The leader begins: the group goes to every waiting follower and to us. */
static void assemble(search *s)
{
    hm_avg_group g;
    hm_wire_wr w;
    uint8_t *body = NULL;
    size_t len = 0;

    memset(&g, 0, sizeof(g));
    randombytes_buf(g.group_id, sizeof(g.group_id));
    memcpy(g.members[0].pk, s->mm->pk, HM_PK_BYTES);
    g.members[0].addr = s->mm->addr;
    g.members[0].bandwidth = s->bandwidth;
    g.n = 1;
    for (size_t i = 0; i < s->n_followers && g.n < s->target; i++) {
        follower *f = &s->followers[i];
        if (f->wait == NULL)
            continue;
        hm_avg_member *m = &g.members[g.n++];
        memcpy(m->pk, f->pk, HM_PK_BYTES);
        m->addr = f->addr;
        m->bandwidth = f->bandwidth;
    }
    s->mm->bandwidth_refused += hm_avg_clamp_bandwidths(&g, s->bandwidth_factor);
    /* A random order, as Hivemind's leaders choose, spreads the span layout. */
    for (size_t i = g.n; i > 1; i--) {
        size_t j = randombytes_uniform((uint32_t)i);
        hm_avg_member t = g.members[i - 1];
        g.members[i - 1] = g.members[j];
        g.members[j] = t;
    }
    hm_mm_reply r = {.code = HM_MM_BEGIN};
    r.group = g;
    hm_wire_wr_init_dynamic(&w, HM_MM_WIRE_MAX);
    hm_mm_encode_reply(&w, &r);
    body = hm_wire_wr_steal(&w, &len);
    if (body == NULL) {
        /* Cannot happen within the caps; the followers retry elsewhere. */
        hm_warn(MOD, "%s: cannot encode the group", s->key);
        finish(s, -EMSGSIZE, NULL);
        return;
    }
    for (size_t i = 0; i < s->n_followers; i++) {
        follower *f = &s->followers[i];
        if (f->wait == NULL)
            continue;
        (void)hm_rpc_respond(f->wait, 0, body, len);
        f->wait = NULL;
    }
    free(body);
    s->n_followers = 0;
    (void)complete_group(s, &g);
    finish(s, 0, &g);
}

/* ------------------------------------------------------------ follower side */

static void on_join_reply(void *ud, int status, const uint8_t *body, size_t len);
static void on_wait_reply(void *ud, int status, const uint8_t *body, size_t len);

static int send_join(search *s, const peer *p)
{
    uint8_t buf[512];
    hm_wire_wr w;
    hm_mm_join j = {.addr = s->mm->addr, .bandwidth = s->bandwidth, .client = s->client,
                    .deadline_ms = s->deadline_ms};
    int r;

    memcpy(j.key, s->key, s->key_len);
    j.key_len = s->key_len;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_mm_encode_join(&w, &j);
    if ((r = hm_wire_wr_error(&w)) < 0)
        return r;
    op *o = op_new(s->mm, s, OP_JOIN);
    if (o == NULL)
        return -ENOMEM;
    r = hm_rpc_call(s->mm->rpc, p->pk, (const struct sockaddr *)&p->addr, M_JOIN, buf, w.len,
                    HM_RPC_STREAM, s->req_ms, on_join_reply, o, &o->call_id);
    if (r < 0) {
        op_free(o);
        return r;
    }
    s->call = o;
    s->leader = *p;
    s->phase = HM_MM_REQUESTING;
    return 0;
}

static int send_wait(search *s)
{
    uint8_t buf[HM_MM_KEY_MAX + 16];
    hm_wire_wr w;
    hm_mm_wait m = {.leave = 0};
    uint64_t now = now_ms(s->mm);
    int r;

    if (now >= s->end_ms)
        return -ETIMEDOUT;
    memcpy(m.key, s->key, s->key_len);
    m.key_len = s->key_len;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_mm_encode_wait(&w, &m);
    if ((r = hm_wire_wr_error(&w)) < 0)
        return r;
    /* The leader begins by its deadline; past that plus a grace it is gone. */
    uint64_t t = (s->leader.deadline_ms > now ? s->leader.deadline_ms - now : 0) + 2 * s->req_ms;
    t = HM_MAX(HM_MIN(t, s->end_ms - now), (uint64_t)1);
    op *o = op_new(s->mm, s, OP_WAIT);
    if (o == NULL)
        return -ENOMEM;
    r = hm_rpc_call(s->mm->rpc, s->leader.pk, (const struct sockaddr *)&s->leader.addr, M_WAIT,
                    buf, w.len, HM_RPC_STREAM, t, on_wait_reply, o, &o->call_id);
    if (r < 0) {
        op_free(o);
        return r;
    }
    s->call = o;
    s->phase = HM_MM_FOLLOWING;
    return 0;
}

/* Tells a leader that accepted us that we will not come; nobody waits for the answer. */
static void send_leave(search *s, const peer *p)
{
    uint8_t buf[HM_MM_KEY_MAX + 16];
    hm_wire_wr w;
    hm_mm_wait m = {.leave = 1};

    memcpy(m.key, s->key, s->key_len);
    m.key_len = s->key_len;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_mm_encode_wait(&w, &m);
    if (hm_wire_wr_error(&w) < 0)
        return;
    op *o = op_new(s->mm, s, OP_WAIT);
    if (o == NULL)
        return;
    o->search_id = 0; /* orphaned from the start: its answer is dropped */
    if (hm_rpc_call(s->mm->rpc, p->pk, (const struct sockaddr *)&p->addr, M_WAIT, buf, w.len,
                    HM_RPC_STREAM, s->req_ms, on_wait_reply, o, &o->call_id) < 0)
        op_free(o);
}

/*
 * Follows a suggested leader when it may lead us. 0 when a join went out,
 * -ENOENT when there is no leader we may follow (none suggested, too many
 * redirects, ourselves, refused, or one that may not lead us), or the error
 * of sending the join.
 */
static int try_suggested(search *s, const hm_mm_reply *r, uint64_t now)
{
    peer p;
    if (!r->has_leader || s->redirects >= MAX_REDIRECTS)
        return -ENOENT;
    memcpy(p.pk, r->leader_pk, HM_PK_BYTES);
    p.addr = r->leader_addr;
    p.deadline_ms = r->deadline_ms;
    if (memcmp(p.pk, s->mm->pk, HM_PK_BYTES) == 0 || is_refused(s, &p, now) ||
        (!key_less(p.deadline_ms, p.pk, self_deadline(s), s->mm->pk) && !stranded(s, now)))
        return -ENOENT;
    s->redirects++;
    return send_join(s, &p);
}

/*
 * What a reply to a join or a wait starts with: the call is over and we are
 * searching again. Returns the search when a decoded reply is in *r, NULL
 * when the reply was handled here (search gone, cancelled, or a failed call,
 * after which the leader is avoided for a while and the search moves on).
 */
static search *reply_begin(void *ud, int status, const uint8_t *body, size_t len,
                           const char *what, hm_mm_reply *r, peer *leader_out, uint64_t *now_out)
{
    search *s = op_done(ud);
    if (s == NULL)
        return NULL;
    *now_out = now_ms(s->mm);
    *leader_out = s->leader;
    s->call = NULL;
    s->phase = HM_MM_SEARCHING;
    /* Only the rpc layer closing cancels a call we did not orphan. */
    if (status == -ECANCELED) {
        finish(s, -ECANCELED, NULL);
        return NULL;
    }
    if (status < 0 || hm_mm_decode_reply(body, len, r) < 0) {
        hm_debug(MOD, "%s: %s: %s", s->key, what, hm_strerror(status < 0 ? status : -EPROTO));
        refuse(s, leader_out, HM_MAX(s->req_ms, 4 * s->period_ms), *now_out);
        step(s);
        return NULL;
    }
    return s;
}

static void on_join_reply(void *ud, int status, const uint8_t *body, size_t len)
{
    hm_mm_reply r;
    peer leader;
    uint64_t now;
    search *s = reply_begin(ud, status, body, len, "join failed", &r, &leader, &now);
    if (s == NULL)
        return;
    switch (r.code) {
    case HM_MM_ACCEPTED:
        /*
         * With a full group of our own, we begin rather than move, and say
         * so: the leader frees our place now, not a request timeout later
         * (a place held for nobody can leave a peer with no group).
         */
        if (s->n_followers + 1 >= s->target) {
            send_leave(s, &leader);
            break;
        }
        s->leader.deadline_ms = r.deadline_ms;
        leader.deadline_ms = r.deadline_ms;
        disband(s, &leader);
        if (send_wait(s) == 0)
            return;
        refuse(s, &leader, HM_MAX(s->req_ms, 4 * s->period_ms), now);
        break;
    case HM_MM_REDIRECT:
        refuse(s, &leader, s->period_ms, now);
        if (try_suggested(s, &r, now) == 0)
            return;
        break;
    case HM_MM_BAD_DEADLINE:
        /* It should join us; once committed it may take us instead (stranded()). */
        refuse_briefly(s, &leader, s->period_ms, now);
        break;
    default:
        refuse(s, &leader, 0, now);
        break;
    }
    step(s);
}

/* Whether the per-origin member cap applies to o under s. */
static int origin_capped(const search *s, const hm_origin *o)
{
    return s->members_per_origin > 0 && (s->cap_loopback || !hm_origin_is_loopback(o));
}

/* 1 when no origin holds more than the cap of the announced group's members. */
static int group_origins_ok(const search *s, const hm_avg_group *g)
{
    hm_origin o[HM_AVG_MAX_GROUP];
    for (size_t i = 0; i < g->n && i < HM_AVG_MAX_GROUP; i++) {
        hm_origin_of((const struct sockaddr *)&g->members[i].addr, &o[i]);
        if (!origin_capped(s, &o[i]))
            continue;
        size_t same = 0;
        for (size_t k = 0; k <= i; k++)
            same += hm_origin_eq(&o[k], &o[i]);
        if (same > s->members_per_origin)
            return 0;
    }
    return 1;
}

static int valid_begin(const search *s, const hm_mm_reply *r)
{
    int has_leader = 0, has_self = 0;
    for (size_t i = 0; i < r->group.n; i++) {
        if (memcmp(r->group.members[i].pk, s->leader.pk, HM_PK_BYTES) == 0)
            has_leader = 1;
        if (memcmp(r->group.members[i].pk, s->mm->pk, HM_PK_BYTES) == 0)
            has_self = 1;
    }
    if (has_leader && has_self && !group_origins_ok(s, &r->group)) {
        /* A leader that admits one host's many keys hands that host the group. */
        s->mm->origin_refused++;
        return 0;
    }
    if (has_leader && has_self && !hm_avg_bandwidths_bounded(&r->group, s->bandwidth_factor)) {
        /* A leader that lets a member (itself, say) claim more than the
         * bound would hand it the reduction of most of the vector. */
        s->mm->bandwidth_refused++;
        return 0;
    }
    return has_leader && has_self;
}

static void on_wait_reply(void *ud, int status, const uint8_t *body, size_t len)
{
    hm_mm_reply r;
    peer leader;
    uint64_t now;
    search *s = reply_begin(ud, status, body, len, "leader lost", &r, &leader, &now);
    if (s == NULL)
        return;
    if (r.code == HM_MM_BEGIN && valid_begin(s, &r) && complete_group(s, &r.group) == 0) {
        finish(s, 0, &r.group);
        return;
    }
    refuse(s, &leader, 0, now);
    if (r.code == HM_MM_DISBANDED) {
        s->redirects = 0;
        if (try_suggested(s, &r, now) == 0)
            return;
    } else {
        hm_warn(MOD, "%s: leader sent a bad group or code %d", s->key, r.code);
    }
    step(s);
}

/* Asks the next candidate that may lead us; stays a leader when none. */
static void try_next_candidate(search *s, uint64_t now)
{
    /* A leader about to begin keeps its followers rather than risk them. */
    if (s->n_followers > 0 && s->deadline_ms <= now + s->req_ms)
        return;
    while (s->next_cand < s->n_cands) {
        const peer *c = &s->cands[s->next_cand++];
        if (!key_less(c->deadline_ms, c->pk, self_deadline(s), s->mm->pk) && !stranded(s, now)) {
            s->next_cand = s->n_cands; /* sorted: no later one may lead us */
            return;
        }
        if (is_refused(s, c, now))
            continue;
        s->redirects = 0;
        int r = send_join(s, c);
        if (r == 0)
            return;
        if (r == -ECANCELED) {
            finish(s, -ECANCELED, NULL);
            return;
        }
        refuse(s, c, HM_MAX(s->req_ms, 4 * s->period_ms), now);
    }
}

/* ------------------------------------------------------------ the state machine */

/*
 * A search that averages as a client only because the node had no address
 * others could dial becomes a full peer as soon as it has one. The address
 * can be missing for a moment (reach.h: a listen address replaced by the
 * same address observed by peers is not declared until a dial-back
 * confirms it, a fraction of a second later); a search that stayed a client
 * for all of its timeout would never declare nor lead, and peers that all
 * started in that moment would find no leader at all. Only a searching
 * peer switches (it holds no followers and has no call in flight): its key
 * moves from after everyone's to its deadline, as if it had just started.
 */
static void address_recheck(search *s, uint64_t now)
{
    struct sockaddr_storage ann;
    if (!s->client || s->client_asked || s->phase != HM_MM_SEARCHING ||
        hm_node_announce(s->mm->node, &ann) < 0)
        return;
    s->client = 0;
    s->mm->addr = ann;
    s->bandwidth = s->bandwidth_asked;
    s->next_put_ms = now;
    s->next_cand = 0;
    hm_info(MOD, "%s: this node has an address others can dial now: averaging as a full peer",
            s->prefix);
}

static void new_attempt(search *s, uint64_t now)
{
    s->attempts++;
    s->deadline_ms = HM_MIN(now + s->min_mm_ms, s->end_ms);
    s->next_cand = 0;
    s->next_put_ms = now;
    s->next_get_ms = now;
}

static void on_timer(uv_timer_t *t) { step(t->data); }

static void rearm(search *s, uint64_t now)
{
    uint64_t next = s->end_ms;
    if (s->phase == HM_MM_SEARCHING)
        next = HM_MIN(next, s->deadline_ms);
    if (!s->get_busy && s->phase == HM_MM_SEARCHING)
        next = HM_MIN(next, s->next_get_ms);
    if (!s->client && !s->put_busy)
        next = HM_MIN(next, s->next_put_ms);
    for (size_t i = 0; i < s->n_followers; i++) {
        if (s->followers[i].wait == NULL)
            next = HM_MIN(next, s->followers[i].accepted_ms + s->req_ms);
        else
            next = HM_MIN(next, now + PRUNE_MS);
    }
    uv_timer_start(&s->timer, on_timer, next > now ? next - now : 0, 0);
}

/*
 * Evaluates a search: deadlines first, then the DHT, then the next
 * candidate; rearms its timer. Called from the timer and after every event.
 */
static void step(search *s)
{
    uint64_t now = now_ms(s->mm);
    if (s->phase == PH_DONE)
        return;
    prune_followers(s, now);
    if (s->phase == HM_MM_SEARCHING) {
        if (n_waiting(s) + 1 >= s->target) {
            assemble(s);
            return;
        }
        /* At the deadline, followers accepted but whose wait is still on
         * its way (at most request_timeout_ms) are waited for: leaving
         * them out could strand them with nobody left to group with. */
        if (now >= s->deadline_ms && n_waiting(s) == s->n_followers) {
            if (n_waiting(s) + 1 >= s->min) {
                assemble(s);
                return;
            }
            disband(s, NULL);
            if (now >= s->end_ms) {
                finish(s, -ETIMEDOUT, NULL);
                return;
            }
            new_attempt(s, now);
        }
    }
    if (now >= s->end_ms) {
        finish(s, -ETIMEDOUT, NULL);
        return;
    }
    address_recheck(s, now);
    if (!s->client && !s->put_busy && now >= s->next_put_ms && declare(s, now) == -ECANCELED) {
        finish(s, -ECANCELED, NULL);
        return;
    }
    /* Only a peer with nobody to ask reads the DHT (reads cost every
     * replica a signature check per entry); a peer asking or following a
     * leader reads again once that ends. */
    if (!s->get_busy && now >= s->next_get_ms && s->phase == HM_MM_SEARCHING &&
        start_get(s) == -ECANCELED) {
        finish(s, -ECANCELED, NULL);
        return;
    }
    if (s->phase == HM_MM_SEARCHING)
        try_next_candidate(s, now);
    if (s->phase != PH_DONE)
        rearm(s, now);
}

/* ------------------------------------------------------------ leader side */

static void on_join_request(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                            const struct sockaddr *from, const uint8_t *body, size_t len)
{
    hm_mm *mm = ud;
    hm_mm_join j;
    hm_mm_reply r = {.code = HM_MM_NOT_LOOKING};
    uint8_t buf[256];
    size_t blen;
    int rc;

    if ((rc = hm_mm_decode_join(body, len, &j)) < 0) {
        if (complain_version(mm, body, len, from, peer_pk, "join"))
            rc = -EPROTONOSUPPORT;
        (void)hm_rpc_respond(req, rc, NULL, 0);
        return;
    }
    search *s = search_by_key(mm, j.key, j.key_len);
    uint64_t now = now_ms(mm);
    uint64_t joiner_deadline = j.client ? UINT64_MAX : j.deadline_ms;
    follower *f = NULL;
    if (s == NULL || s->client || memcmp(peer_pk, mm->pk, HM_PK_BYTES) == 0)
        goto reply;
    if (s->phase == HM_MM_FOLLOWING) {
        r.code = HM_MM_REDIRECT;
        r.has_leader = 1;
        memcpy(r.leader_pk, s->leader.pk, HM_PK_BYTES);
        r.leader_addr = s->leader.addr;
        r.deadline_ms = s->leader.deadline_ms;
        goto reply;
    }
    for (size_t i = 0; i < s->n_followers; i++)
        if (memcmp(s->followers[i].pk, peer_pk, HM_PK_BYTES) == 0)
            f = &s->followers[i];
    if (f == NULL) {
        if (!key_less(s->deadline_ms, mm->pk, joiner_deadline, peer_pk) && !committed(s, now)) {
            r.code = HM_MM_BAD_DEADLINE;
            goto reply;
        }
        if (s->n_followers + 1 >= s->target) {
            r.code = HM_MM_FULL;
            goto reply;
        }
        hm_origin jo;
        hm_origin_of(from, &jo);
        if (origin_capped(s, &jo)) {
            hm_origin mine;
            hm_origin_of((const struct sockaddr *)&mm->addr, &mine);
            size_t same = hm_origin_eq(&mine, &jo);
            for (size_t i = 0; i < s->n_followers; i++)
                same += hm_origin_eq(&s->followers[i].org, &jo);
            if (same >= s->members_per_origin) {
                /* Full for this origin: the joiner looks for another group. */
                mm->origin_refused++;
                r.code = HM_MM_FULL;
                goto reply;
            }
        }
        /* At our deadline we begin with those already waiting. */
        if (now >= s->deadline_ms)
            goto reply;
        f = &s->followers[s->n_followers++];
        memset(f, 0, sizeof(*f));
        memcpy(f->pk, peer_pk, HM_PK_BYTES);
        f->org = jo;
    }
    f->addr = j.addr;
    /* A follower listening on every interface is reached where it came from. */
    if (j.addr.ss_family == AF_INET && from->sa_family == AF_INET &&
        ((struct sockaddr_in *)&j.addr)->sin_addr.s_addr == htonl(INADDR_ANY))
        ((struct sockaddr_in *)&f->addr)->sin_addr = ((const struct sockaddr_in *)from)->sin_addr;
    if (j.addr.ss_family == AF_INET6 && from->sa_family == AF_INET6 &&
        IN6_IS_ADDR_UNSPECIFIED(&((struct sockaddr_in6 *)&j.addr)->sin6_addr))
        ((struct sockaddr_in6 *)&f->addr)->sin6_addr =
            ((const struct sockaddr_in6 *)from)->sin6_addr;
    f->bandwidth = j.client ? 0.0 : j.bandwidth;
    f->deadline_ms = j.deadline_ms;
    f->accepted_ms = now;
    r.code = HM_MM_ACCEPTED;
    r.deadline_ms = s->deadline_ms;
reply:
    if (hm_log_get_level() >= HM_LOG_DEBUG) {
        char who[HM_PEER_ID_LEN + 1];
        hm_peer_id_encode(peer_pk, who);
        hm_debug(MOD, "%.8s: join from %.8s: code %d (%zu followers)",
                 hm_node_identity(mm->node)->peer_id, who, r.code,
                 s != NULL ? s->n_followers : 0);
    }
    if (reply_body(&r, buf, sizeof(buf), &blen) == 0)
        (void)hm_rpc_respond(req, 0, buf, blen);
    else
        (void)hm_rpc_respond(req, -EPROTO, NULL, 0);
    if (s != NULL && r.code == HM_MM_ACCEPTED)
        rearm(s, now);
}

static void on_wait_request(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                            const struct sockaddr *from, const uint8_t *body, size_t len)
{
    hm_mm *mm = ud;
    hm_mm_wait m = {.leave = 0};
    int rc;

    if ((rc = hm_mm_decode_wait(body, len, &m)) < 0) {
        if (complain_version(mm, body, len, from, peer_pk, "wait"))
            rc = -EPROTONOSUPPORT;
        (void)hm_rpc_respond(req, rc, NULL, 0);
        return;
    }
    search *s = search_by_key(mm, m.key, m.key_len);
    follower *f = NULL;
    if (s != NULL && s->phase != HM_MM_FOLLOWING)
        for (size_t i = 0; i < s->n_followers; i++)
            if (memcmp(s->followers[i].pk, peer_pk, HM_PK_BYTES) == 0)
                f = &s->followers[i];
    if (f == NULL && s != NULL && s->phase == HM_MM_FOLLOWING) {
        /* We moved to another leader after accepting this peer: so may it. */
        hm_mm_reply r = {.code = HM_MM_DISBANDED, .has_leader = 1};
        uint8_t buf[256];
        size_t blen;
        memcpy(r.leader_pk, s->leader.pk, HM_PK_BYTES);
        r.leader_addr = s->leader.addr;
        r.deadline_ms = s->leader.deadline_ms;
        if (reply_body(&r, buf, sizeof(buf), &blen) == 0)
            (void)hm_rpc_respond(req, 0, buf, blen);
        else
            (void)hm_rpc_respond(req, -EPROTO, NULL, 0);
        return;
    }
    if (f == NULL || m.leave) {
        /* A follower that leaves gives its place back at once. */
        if (f != NULL) {
            if (f->wait != NULL)
                (void)hm_rpc_respond(f->wait, -ECANCELED, NULL, 0);
            drop_follower(s, (size_t)(f - s->followers));
            hm_debug(MOD, "%s: follower left", s->key);
        }
        respond_code(req, HM_MM_DISBANDED);
        if (f != NULL)
            step(s);
        return;
    }
    /* A newer wait from the same follower replaces the one it gave up. */
    if (f->wait != NULL)
        (void)hm_rpc_respond(f->wait, -ECANCELED, NULL, 0);
    f->wait = req;
    step(s);
}

/* ------------------------------------------------------------ public */

int hm_mm_new(hm_node *node, hm_mm **out)
{
    int result = 0;
    hm_mm *mm = calloc(1, sizeof(*mm));
    *out = NULL;
    if (mm == NULL)
        return -ENOMEM;
    LIST_INIT(&mm->searches);
    LIST_INIT(&mm->ops);
    mm->node = node;
    mm->rpc = hm_node_rpc(node);
    mm->next_id = 1;
    memcpy(mm->pk, hm_node_identity(node)->pk, HM_PK_BYTES);
    if ((result = hm_transport_local_addr(hm_rpc_transport(mm->rpc), &mm->addr)) < 0)
        goto out;
    if ((result = hm_rpc_register(mm->rpc, M_JOIN, on_join_request, mm)) < 0)
        goto out;
    if ((result = hm_rpc_register(mm->rpc, M_WAIT, on_wait_request, mm)) < 0) {
        hm_rpc_unregister(mm->rpc, M_JOIN);
        goto out;
    }
    *out = mm;
out:
    if (result < 0)
        free(mm);
    return result;
}

void hm_mm_free(hm_mm *mm)
{
    if (mm == NULL)
        return;
    while (!LIST_EMPTY(&mm->searches))
        finish(LIST_FIRST(&mm->searches), -ECANCELED, NULL);
    /* DHT operations still in flight end later and only free their op. */
    op *o;
    LIST_FOREACH(o, &mm->ops, link)
        o->mm = NULL;
    hm_rpc_unregister(mm->rpc, M_JOIN);
    hm_rpc_unregister(mm->rpc, M_WAIT);
    free(mm);
}

int hm_mm_find_group(hm_mm *mm, const hm_mm_config *cfg, uint64_t timeout_ms, hm_mm_cb cb,
                     void *ud, uint64_t *search_out)
{
    char key[HM_MM_KEY_MAX + 1];
    int klen;
    unsigned target, min;

    if (cfg == NULL || cb == NULL || timeout_ms == 0)
        return -EINVAL;
    if ((klen = hm_mm_group_key(cfg->prefix, cfg->group_bits, key, sizeof(key))) < 0)
        return -EINVAL;
    target = cfg->target_group_size != 0 ? cfg->target_group_size : 16;
    min = cfg->min_group_size != 0 ? cfg->min_group_size : HM_MIN(2u, target);
    if (target > HM_AVG_MAX_GROUP || min > target || !isfinite(cfg->bandwidth) ||
        cfg->bandwidth < 0)
        return -EINVAL;
    if (search_by_key(mm, (const uint8_t *)key, (size_t)klen) != NULL)
        return -EBUSY;
    if (mm->n_searches >= HM_MM_MAX_SEARCHES)
        return -ENOBUFS;
    search *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return -ENOMEM;
    s->mm = mm;
    s->id = mm->next_id++;
    s->cb = cb;
    s->ud = ud;
    hm_strlcpy(s->prefix, cfg->prefix, sizeof(s->prefix));
    hm_strlcpy(s->bits, cfg->group_bits != NULL ? cfg->group_bits : "", sizeof(s->bits));
    memcpy(s->key, key, (size_t)klen + 1);
    s->key_len = (size_t)klen;
    s->target = target;
    s->min = min;
    s->min_mm_ms = cfg->min_matchmaking_ms != 0 ? cfg->min_matchmaking_ms : 5000;
    s->req_ms = cfg->request_timeout_ms != 0 ? cfg->request_timeout_ms : 3000;
    s->period_ms = HM_MAX(HM_MIN(s->min_mm_ms / 4, (uint64_t)2000), (uint64_t)100);
    /*
     * A node with no address others can dial (0.0.0.0 not yet confirmed,
     * or nobody reaches it) averages as a client: it sends and receives
     * over connections it opens, and no member is told to dial it; until
     * it has one (address_recheck), not for the whole search.
     */
    struct sockaddr_storage ann;
    s->client_asked = cfg->client_mode != 0;
    s->client = cfg->client_mode != 0 || hm_node_announce(mm->node, &ann) < 0;
    if (s->client && !cfg->client_mode)
        hm_info(MOD, "%s: averaging as a client: this node has no address others can dial",
                s->prefix);
    else if (!s->client)
        mm->addr = ann;
    s->bandwidth_asked = cfg->bandwidth;
    s->bandwidth = s->client ? 0.0 : cfg->bandwidth;
    s->bandwidth_factor = cfg->bandwidth_factor != 0 ? cfg->bandwidth_factor : 2.0;
    s->members_per_origin = cfg->members_per_origin;
    s->cap_loopback = cfg->cap_loopback != 0;
    s->phase = HM_MM_SEARCHING;
    uint64_t now = now_ms(mm);
    s->end_ms = now + timeout_ms;
    new_attempt(s, now);
    uv_timer_init(hm_node_loop(mm->node), &s->timer);
    s->timer.data = s;
    /* The first step runs from the loop, so cb never fires in here. */
    uv_timer_start(&s->timer, on_timer, 0, 0);
    LIST_INSERT_HEAD(&mm->searches, s, link);
    mm->n_searches++;
    if (search_out != NULL)
        *search_out = s->id;
    return 0;
}

int hm_mm_cancel(hm_mm *mm, uint64_t id)
{
    search *s = search_by_id(mm, id);
    if (s == NULL)
        return -ENOENT;
    finish(s, -ECANCELED, NULL);
    return 0;
}

int hm_mm_search_info(const hm_mm *mm, uint64_t id, hm_mm_info *out)
{
    const search *s = search_by_id((hm_mm *)mm, id);
    if (s == NULL)
        return -ENOENT;
    memset(out, 0, sizeof(*out));
    out->phase = s->phase;
    if (s->phase == HM_MM_REQUESTING || s->phase == HM_MM_FOLLOWING)
        memcpy(out->leader_pk, s->leader.pk, HM_PK_BYTES);
    out->followers = s->n_followers;
    out->waiting = n_waiting(s);
    out->deadline_ms = s->deadline_ms;
    out->attempts = s->attempts;
    out->candidates = s->n_cands;
    return 0;
}

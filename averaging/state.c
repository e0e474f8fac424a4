/*
 * state: state sharing between donors and newcomers (see state.h for the
 * manifest, the messages and the guarantees).
 *
 * It owns the shares of one node (each a copied blob, its manifest and a
 * uv timer that hashes the blob a slice at a time and then refreshes the
 * DHT declaration), the loads in progress (each with one uv timer for its
 * deadline, DHT retries and donor back-off), and the bookkeeping of every
 * DHT operation and rpc call it started ("ops"), so that a load, a share
 * or the whole module can end while those are in flight: their callbacks
 * then find their owner gone and only free their op.
 */
#include "config.h"

#include "averaging/state.h"

#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>

#include "dht/record.h"

#define MOD "state"

#define M_MANIFEST "state.manifest"
#define M_CHUNK "state.chunk"
#define WIRE_VERSION 1
#define KEY_SUFFIX ".state"
/* Declarations read per load; the rest are ignored. */
#define MAX_DECLS 256
/*
 * Unseen donors one load asks to prove their address; each answer is a
 * manifest (at most HM_STATE_MANIFEST_MAX, 2 MiB), so a load spends at most
 * 32 MiB on proofs.
 */
#define MAX_PROBES 16
/* A DHT read of the declarations. */
#define DHT_TIMEOUT_MS 5000
/* Between two reads of the declarations when no agreement was found. */
#define DHT_RETRY_MS 1000
/* A probe of an unseen donor (see probe()): shorter than a read's retry period. */
#define PROBE_TIMEOUT_MS 900
/* A donor that answered -ENOBUFS (busy) is asked again after this. */
#define BUSY_BACKOFF_MS 200
/* After a failed request, a donor waits this times its failures in a row. */
#define FAIL_BACKOFF_MS 100
/* Between two hashing slices of a share, so that the loop polls for I/O in between. */
#define HASH_SLICE_GAP_MS 1
/* The absolute ceiling of a state's size: the chunk count times the chunk size. */
#define ABS_MAX_BLOB ((uint64_t)HM_STATE_MAX_CHUNKS * HM_STATE_CHUNK_MAX)

enum { OP_GET, OP_PUT, OP_MANIFEST, OP_CHUNK, OP_PROBE };
enum { L_DHT, L_MANIFEST, L_CHUNKS, L_DONE };
enum { C_PENDING = 0, C_INFLIGHT = 1, C_DONE = 2 };

typedef struct op op;
struct op {
    hm_state *st; /* NULL once the module is freed */
    LIST_ENTRY(op) link; /* in st->ops while st is set */
    uint64_t owner; /* load or share id; 0: orphaned, the result is dropped */
    int kind;
    size_t donor, chunk;
    uint64_t call_id;
    uint8_t pk[HM_PK_BYTES], hash[HM_STATE_HASH_BYTES]; /* OP_PROBE: whom, for which state */
};

/* One hashed (or being hashed) copy of a shared blob. */
typedef struct version {
    uint64_t step;
    uint8_t *blob;
    size_t len, chunk_size, n_chunks;
    uint8_t *hashes;  /* n_chunks * 32 */
    size_t hashed;    /* chunks hashed so far */
    uint8_t *manifest;
    size_t manifest_len;
    uint8_t hash[HM_STATE_HASH_BYTES];
    double ttl_s;
    int corrupt;
} version;

#define KEEP_OLD_VERSIONS 2

/* A caller waiting for a step (or a newer one) to be declared (declared_cb). */
typedef struct waiter waiter;
struct waiter {
    waiter *next;
    uint64_t step;
    hm_state_declared_cb cb;
    void *ud;
};

typedef struct share share;
struct share {
    hm_state *st;
    LIST_ENTRY(share) link; /* in st->shares */
    uint64_t id;
    char prefix[HM_STATE_PREFIX_MAX + 1];
    char key[HM_STATE_PREFIX_MAX + sizeof(KEY_SUFFIX)];
    size_t key_len;
    version *cur;  /* served; NULL until the first version is hashed */
    version *next_v; /* being hashed */
    /*
     * The versions cur replaced, newest first, still served: a newcomer
     * reads a declaration that may be a version or two old by the time it
     * asks (a trainer can share every second or two, and DHT puts and gets
     * take about as long under load).
     */
    version *old[KEEP_OLD_VERSIONS];
    /*
     * The version whose declaration is being put (put_busy): a version
     * that becomes current meanwhile is declared when that put ends, so
     * that the DHT never goes on naming an older step than the one served
     * for a refresh period.
     */
    int put_busy;
    uint64_t put_step;
    uint8_t put_hash[HM_STATE_HASH_BYTES];
    waiter *waiters; /* declared_cb callers, oldest first */
    unsigned declared;
    uint64_t chunks_served, manifests_served, refused_busy;
    uv_timer_t timer;
};

typedef struct donor {
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr;
    int dropped;
    int last_error;
    unsigned inflight, failures;
    uint64_t chunks, bytes;
    uint64_t wait_until_ms;
} donor;

typedef struct load load;
struct load {
    hm_state *st;
    LIST_ENTRY(load) link; /* in st->loads until it finishes */
    uint64_t id;
    char prefix[HM_STATE_PREFIX_MAX + 1];
    char key[HM_STATE_PREFIX_MAX + sizeof(KEY_SUFFIX)];
    size_t key_len;
    hm_state_load_cb cb;
    void *ud;

    unsigned min_agree, window, max_failures, dht_attempts;
    uint64_t req_ms;
    void *dest;
    size_t dest_cap;

    int phase;
    unsigned dht_reads;
    uint64_t started_ms, deadline_ms; /* monotonic */
    size_t n_declared;
    hm_state_decl agreed;
    donor donors[HM_STATE_MAX_DONORS];
    size_t n_donors;
    size_t next_manifest; /* the donor asked next for the manifest */
    int manifest_busy;
    int bad_manifest;

    uint8_t *hashes;
    size_t n_chunks;
    uint8_t *chunk_state;
    size_t n_done, cursor, rr;
    uint8_t *blob;
    uint64_t refetched;
    uv_timer_t timer;
    /*
     * Donors the node has not seen (not in its peer table) are asked for
     * their manifest before their vote counts (state.h, "Who is
     * believed"): those that answered under their key at the address they
     * declare, and those asked so far.
     */
    uint8_t verified[MAX_PROBES][HM_PK_BYTES];
    size_t n_verified;
    uint8_t probed[MAX_PROBES][HM_PK_BYTES];
    size_t n_probed;
};

struct hm_state {
    hm_node *node;
    hm_rpc *rpc;
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr;
    hm_state_config cfg;
    LIST_HEAD(, share) shares;
    size_t n_shares;
    LIST_HEAD(, load) loads;
    size_t n_loads;
    LIST_HEAD(, op) ops;
    uint64_t next_id;
    int closing;
    /* uv handles not yet through their close callback, the anchor included:
     * the module is freed when closing and this reaches 0. */
    size_t handles;
    uv_timer_t anchor;
    void (*close_cb)(void *ud);
    void *close_ud;
    uint8_t (*trusted)[HM_PK_BYTES]; /* the config's copy; n in cfg.n_trusted */
    uint64_t refused_origin, refused_untrusted, refused_lead; /* hm_state_limits */
};

static void pump(load *l);
static void load_finish(load *l, int status);

/* ------------------------------------------------------------ codec */

static const hm_wire_limits small_limits = {
    .max_size = HM_STATE_SMALL_MAX,
    .max_depth = 1,
    .max_elements = 8,
};

static const hm_wire_limits manifest_limits = {
    .max_size = HM_STATE_MANIFEST_MAX,
    .max_depth = 1,
    .max_elements = 8,
};

size_t hm_state_n_chunks(uint64_t total_len, uint64_t chunk_size, uint64_t max_blob)
{
    if (chunk_size < HM_STATE_CHUNK_MIN || chunk_size > HM_STATE_CHUNK_MAX || total_len == 0 ||
        total_len > max_blob || total_len > ABS_MAX_BLOB || total_len > SIZE_MAX)
        return 0;
    uint64_t n = (total_len + chunk_size - 1) / chunk_size;
    return n <= HM_STATE_MAX_CHUNKS ? (size_t)n : 0;
}

/* A prefix: 1..HM_STATE_PREFIX_MAX bytes, no NUL, no owner marker (which
 * would make the key owned and every declaration malformed). */
static int prefix_ok(const char *p, size_t n)
{
    if (n == 0 || n > HM_STATE_PREFIX_MAX || memchr(p, '\0', n) != NULL)
        return 0;
    static const char marker[] = "[owner:";
    for (size_t i = 0; i + sizeof(marker) - 1 <= n; i++)
        if (memcmp(p + i, marker, sizeof(marker) - 1) == 0)
            return 0;
    return 1;
}

void hm_state_encode_decl(hm_wire_wr *w, const hm_state_decl *d)
{
    hm_wire_wr_array(w, 5);
    hm_wire_wr_addr(w, &d->addr);
    hm_wire_wr_uint(w, d->step);
    hm_wire_wr_uint(w, d->total_len);
    hm_wire_wr_uint(w, d->chunk_size);
    hm_wire_wr_bin(w, d->hash, HM_STATE_HASH_BYTES);
}

int hm_state_decode_decl(const uint8_t *buf, size_t len, hm_state_decl *out)
{
    hm_wire_msg m;
    const msgpack_object *it;
    int r;
    if ((r = hm_wire_decode_open_array(&m, buf, len, &small_limits, 5, 5, HM_WIRE_ANY_VERSION)) < 0)
        goto out;
    it = m.items;
    r = -EPROTO;
    if (hm_wire_get_addr(&it[0], &out->addr) < 0 ||
        hm_wire_get_uint(&it[1], &out->step) < 0 ||
        hm_wire_get_uint(&it[2], &out->total_len) < 0 ||
        hm_wire_get_uint(&it[3], &out->chunk_size) < 0 ||
        hm_wire_get_bin_exact(&it[4], out->hash, HM_STATE_HASH_BYTES) < 0)
        goto out;
    if (hm_state_n_chunks(out->total_len, out->chunk_size, ABS_MAX_BLOB) == 0)
        goto out;
    r = 0;
out:
    hm_wire_decode_close(&m);
    return r;
}

void hm_state_encode_manifest(hm_wire_wr *w, uint64_t step, uint64_t total_len,
                              uint64_t chunk_size, const uint8_t *hashes, size_t n_chunks)
{
    hm_wire_wr_array(w, 5);
    hm_wire_wr_uint(w, WIRE_VERSION);
    hm_wire_wr_uint(w, step);
    hm_wire_wr_uint(w, total_len);
    hm_wire_wr_uint(w, chunk_size);
    hm_wire_wr_bin(w, hashes, n_chunks * HM_STATE_HASH_BYTES);
}

int hm_state_decode_manifest(const uint8_t *buf, size_t len, hm_state_manifest *out)
{
    hm_wire_msg m;
    const msgpack_object *it;
    const uint8_t *p;
    uint32_t n;
    int r;
    if ((r = hm_wire_decode_open_array(&m, buf, len, &manifest_limits, 5, 5, WIRE_VERSION)) < 0)
        goto out;
    it = m.items;
    r = -EPROTO;
    if (hm_wire_get_uint(&it[1], &out->step) < 0 ||
        hm_wire_get_uint(&it[2], &out->total_len) < 0 ||
        hm_wire_get_uint(&it[3], &out->chunk_size) < 0 || hm_wire_get_bin(&it[4], &p, &n) < 0)
        goto out;
    out->n_chunks = hm_state_n_chunks(out->total_len, out->chunk_size, ABS_MAX_BLOB);
    if (out->n_chunks == 0 || (uint64_t)n != (uint64_t)out->n_chunks * HM_STATE_HASH_BYTES)
        goto out;
    out->hashes = p;
    r = 0;
out:
    hm_wire_decode_close(&m);
    return r;
}

void hm_state_encode_req(hm_wire_wr *w, const hm_state_req *r, int with_index)
{
    hm_wire_wr_array(w, with_index ? 3 : 2);
    hm_wire_wr_cstr(w, r->prefix);
    hm_wire_wr_bin(w, r->hash, HM_STATE_HASH_BYTES);
    if (with_index)
        hm_wire_wr_uint(w, r->index);
}

int hm_state_decode_req(const uint8_t *buf, size_t len, int with_index, hm_state_req *out)
{
    hm_wire_msg m;
    const msgpack_object *it;
    const char *p;
    uint32_t n, want = with_index ? 3 : 2;
    int r;
    if ((r = hm_wire_decode_open_array(&m, buf, len, &small_limits, want, want,
                                       HM_WIRE_ANY_VERSION)) < 0)
        goto out;
    it = m.items;
    r = -EPROTO;
    if (hm_wire_get_str(&it[0], &p, &n) < 0 ||
        !prefix_ok(p, n) || hm_wire_get_bin_exact(&it[1], out->hash, HM_STATE_HASH_BYTES) < 0)
        goto out;
    memcpy(out->prefix, p, n);
    out->prefix[n] = '\0';
    out->index = 0;
    if (with_index && hm_wire_get_uint(&it[2], &out->index) < 0)
        goto out;
    r = 0;
out:
    hm_wire_decode_close(&m);
    return r;
}

const char *hm_state_drop_name(int reason)
{
    switch (reason) {
    case HM_STATE_DROP_NONE:
        return "none";
    case HM_STATE_DROP_BAD_CHUNK:
        return "bad_chunk";
    case HM_STATE_DROP_BAD_MANIFEST:
        return "bad_manifest";
    case HM_STATE_DROP_ERRORS:
        return "errors";
    default:
        return "unknown";
    }
}

/* ------------------------------------------------------------ ops and lookups */

static op *op_new(hm_state *st, uint64_t owner, int kind)
{
    op *o = calloc(1, sizeof(*o));
    if (o == NULL)
        return NULL;
    o->st = st;
    o->owner = owner;
    o->kind = kind;
    LIST_INSERT_HEAD(&st->ops, o, link);
    return o;
}

static void op_free(op *o)
{
    if (o->st != NULL)
        LIST_REMOVE(o, link);
    free(o);
}

static load *load_by_id(hm_state *st, uint64_t id)
{
    load *l;
    LIST_FOREACH(l, &st->loads, link)
        if (l->id == id)
            return l;
    return NULL;
}

static share *share_by_id(hm_state *st, uint64_t id)
{
    share *s;
    LIST_FOREACH(s, &st->shares, link)
        if (s->id == id)
            return s;
    return NULL;
}

static share *share_by_prefix(const hm_state *st, const char *prefix)
{
    share *s;
    LIST_FOREACH(s, &st->shares, link)
        if (strcmp(s->prefix, prefix) == 0)
            return s;
    return NULL;
}

static int make_key(const char *prefix, char *key, size_t cap, size_t *len_out)
{
    size_t pl = strnlen(prefix, HM_STATE_PREFIX_MAX + 1);
    if (!prefix_ok(prefix, pl) || pl + sizeof(KEY_SUFFIX) > cap)
        return -EINVAL;
    memcpy(key, prefix, pl);
    memcpy(key + pl, KEY_SUFFIX, sizeof(KEY_SUFFIX));
    *len_out = pl + sizeof(KEY_SUFFIX) - 1;
    return 0;
}

static void hash_bytes(const uint8_t *p, size_t n, uint8_t out[HM_STATE_HASH_BYTES])
{
    crypto_generichash(out, HM_STATE_HASH_BYTES, p, n, NULL, 0);
}

/* ------------------------------------------------------------ closing */

static void handle_closed(hm_state *st)
{
    if (--st->handles > 0 || !st->closing)
        return;
    void (*cb)(void *) = st->close_cb;
    void *ud = st->close_ud;
    free(st->trusted);
    free(st);
    if (cb != NULL)
        cb(ud);
}

/* ------------------------------------------------------------ donor side */

static void version_free(version *v)
{
    if (v == NULL)
        return;
    free(v->blob);
    free(v->hashes);
    free(v->manifest);
    free(v);
}

/*
 * Answers the waiters of steps lo..hi: they are taken off the share before
 * any callback runs, so a callback may share again or unshare (then s is
 * closing: callers look it up again before they use it).
 */
static void answer_waiters(share *s, uint64_t lo, uint64_t hi, int status, unsigned replicas)
{
    waiter *done = NULL, **tail = &done, **pp = &s->waiters;
    while (*pp != NULL) {
        waiter *w = *pp;
        if (w->step >= lo && w->step <= hi) {
            *pp = w->next;
            w->next = NULL;
            *tail = w;
            tail = &w->next;
        } else {
            pp = &w->next;
        }
    }
    while (done != NULL) {
        waiter *w = done;
        done = w->next;
        w->cb(w->ud, status, replicas);
        free(w);
    }
}

static void on_share_closed(uv_handle_t *h)
{
    share *s = h->data;
    hm_state *st = s->st;
    version_free(s->cur);
    version_free(s->next_v);
    for (size_t i = 0; i < KEEP_OLD_VERSIONS; i++)
        version_free(s->old[i]);
    free(s);
    handle_closed(st);
}

static void declare(share *s);

static void on_put(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    HM_UNUSED(info);
    op *o = ud;
    hm_state *st = o->st;
    uint64_t id = o->owner;
    op_free(o);
    if (st == NULL)
        return;
    share *s = share_by_id(st, id);
    if (s == NULL)
        return;
    s->put_busy = 0;
    s->declared = status == 0 ? stored : 0;
    if (status != 0)
        hm_debug(MOD, "%s: declaration not stored: %s", s->key, hm_strerror(status));
    answer_waiters(s, 0, s->put_step, status, status == 0 ? stored : 0);
    /* A newer version became current while this put ran: it is declared
     * now rather than at the next refresh, and its waiters wait for that. */
    s = share_by_id(st, id);
    if (s != NULL && !s->put_busy && s->cur != NULL &&
        (s->cur->step != s->put_step ||
         sodium_memcmp(s->cur->hash, s->put_hash, HM_STATE_HASH_BYTES) != 0))
        declare(s);
}

static void declare(share *s)
{
    hm_state *st = s->st;
    version *v = s->cur;
    uint8_t value[HM_STATE_SMALL_MAX];
    char marker[HM_DHT_OWNER_MARKER_LEN + 1];
    hm_wire_wr w;
    hm_state_decl d = {.step = v->step, .total_len = v->len, .chunk_size = v->chunk_size};
    int r;

    if (s->put_busy)
        return; /* on_put declares v when the put in flight ends */
    /* Read each time: the declared address can change, and with none that
     * others could dial there is nothing worth declaring. */
    if ((r = hm_node_announce(st->node, &st->addr)) < 0) {
        hm_debug(MOD, "%s: not declared: no address others can dial (%s)", s->key,
                 hm_strerror(r));
        answer_waiters(s, 0, v->step, r, 0);
        return;
    }
    d.addr = st->addr;
    memcpy(d.hash, v->hash, HM_STATE_HASH_BYTES);
    hm_wire_wr_init_fixed(&w, value, sizeof(value));
    hm_state_encode_decl(&w, &d);
    if ((r = hm_wire_wr_error(&w)) < 0) {
        hm_warn(MOD, "%s: cannot encode the declaration: %s", s->key, hm_strerror(r));
        answer_waiters(s, 0, v->step, r, 0);
        return;
    }
    hm_dht_owner_marker(st->pk, marker);
    op *o = op_new(st, s->id, OP_PUT);
    if (o == NULL) {
        answer_waiters(s, 0, v->step, -ENOMEM, 0);
        return;
    }
    r = hm_node_dht_put(st->node, (const uint8_t *)s->key, s->key_len, (const uint8_t *)marker,
                        strlen(marker), 1, value, w.len, v->ttl_s, DHT_TIMEOUT_MS, on_put, o);
    if (r < 0) {
        op_free(o);
        hm_debug(MOD, "%s: cannot declare: %s", s->key, hm_strerror(r));
        answer_waiters(s, 0, v->step, r, 0);
        return;
    }
    s->put_busy = 1;
    s->put_step = v->step;
    memcpy(s->put_hash, v->hash, HM_STATE_HASH_BYTES);
}

/* Hashes one slice of the version being prepared; 1 once it is complete. */
static int hash_slice(version *v)
{
    size_t budget = HM_STATE_HASH_SLICE;
    while (v->hashed < v->n_chunks && budget > 0) {
        size_t off = v->hashed * v->chunk_size;
        size_t n = HM_MIN(v->chunk_size, v->len - off);
        hash_bytes(v->blob + off, n, v->hashes + v->hashed * HM_STATE_HASH_BYTES);
        v->hashed++;
        budget = budget > n ? budget - n : 0;
    }
    return v->hashed == v->n_chunks;
}

static int build_manifest(version *v)
{
    hm_wire_wr w;
    hm_wire_wr_init_dynamic(&w, HM_STATE_MANIFEST_MAX);
    hm_state_encode_manifest(&w, v->step, v->len, v->chunk_size, v->hashes, v->n_chunks);
    v->manifest = hm_wire_wr_steal(&w, &v->manifest_len);
    if (v->manifest == NULL)
        return -ENOMEM;
    hash_bytes(v->manifest, v->manifest_len, v->hash);
    return 0;
}

static void on_share_timer(uv_timer_t *t)
{
    share *s = t->data;
    if (s->next_v != NULL) {
        if (!hash_slice(s->next_v)) {
            /*
             * 1 ms, not 0: libuv runs a timer re-armed with 0 from its own
             * callback again in the same pass, so every slice would run
             * before the loop polls for I/O. A 1 ms timer waits for the next
             * pass, with I/O and other timers in between.
             */
            uv_timer_start(&s->timer, on_share_timer, HASH_SLICE_GAP_MS, 0);
            return;
        }
        if (build_manifest(s->next_v) < 0) {
            hm_warn(MOD, "%s: no memory for the manifest; step %llu not shared", s->key,
                    (unsigned long long)s->next_v->step);
            version_free(s->next_v);
            s->next_v = NULL;
            /* Those who waited for it (or for a version it superseded
             * while hashing) are told; the current one stays declared. */
            hm_state *st = s->st;
            uint64_t id = s->id;
            answer_waiters(s, s->cur != NULL ? s->cur->step + 1 : 0, UINT64_MAX, -ENOMEM, 0);
            if (share_by_id(st, id) == NULL)
                return;
        } else {
            version_free(s->old[KEEP_OLD_VERSIONS - 1]);
            memmove(&s->old[1], &s->old[0], (KEEP_OLD_VERSIONS - 1) * sizeof(s->old[0]));
            s->old[0] = s->cur;
            s->cur = s->next_v;
            s->next_v = NULL;
            char hex[2 * HM_STATE_HASH_BYTES + 1];
            hm_hex_encode(s->cur->hash, 8, hex);
            hm_info(MOD, "%s: sharing step %llu, %zu bytes in %zu chunks, hash %s...", s->prefix,
                    (unsigned long long)s->cur->step, s->cur->len, s->cur->n_chunks, hex);
        }
    }
    if (s->cur == NULL)
        return;
    hm_state *st = s->st;
    uint64_t id = s->id;
    declare(s);
    if (share_by_id(st, id) == NULL)
        return; /* a waiter's callback unshared it */
    /* Refresh a third into the TTL, with up to 10% jitter so that donors
     * that started together do not refresh together. */
    double period_ms = s->cur->ttl_s * 1000.0 / 3.0;
    uint64_t ms = (uint64_t)period_ms;
    ms -= randombytes_uniform((uint32_t)HM_MAX(ms / 10, (uint64_t)1));
    uv_timer_start(&s->timer, on_share_timer, HM_MAX(ms, (uint64_t)100), 0);
}

int hm_state_share(hm_state *st, const char *prefix, uint64_t step, const void *blob, size_t len,
                   const hm_state_share_opts *opts)
{
    hm_state_share_opts none = {0};
    char key[HM_STATE_PREFIX_MAX + sizeof(KEY_SUFFIX)];
    size_t key_len;
    int result = 0;
    version *v = NULL;
    waiter *wt = NULL;
    share *s;

    if (opts == NULL)
        opts = &none;
    if (st->closing)
        return -ESHUTDOWN;
    if (prefix == NULL || (blob == NULL && len > 0) || len == 0 ||
        make_key(prefix, key, sizeof(key), &key_len) < 0)
        return -EINVAL;
    size_t cs = opts->chunk_size != 0 ? opts->chunk_size : HM_STATE_CHUNK_DEFAULT;
    double ttl = opts->ttl_s != 0 ? opts->ttl_s : 60.0;
    if (cs < HM_STATE_CHUNK_MIN || cs > HM_STATE_CHUNK_MAX || !isfinite(ttl) || ttl < 1.0 ||
        ttl > 86400.0)
        return -EINVAL;
    size_t n = hm_state_n_chunks(len, cs, st->cfg.max_blob_bytes);
    if (n == 0)
        return -EMSGSIZE;
    s = share_by_prefix(st, prefix);
    if (s != NULL) {
        const version *hv = s->next_v != NULL ? s->next_v : s->cur;
        if (hv != NULL && step < hv->step)
            return -ESTALE;
    } else if (st->n_shares >= HM_STATE_MAX_SHARES) {
        return -ENOBUFS;
    }

    v = calloc(1, sizeof(*v));
    if (v == NULL)
        return -ENOMEM;
    v->step = step;
    v->len = len;
    v->chunk_size = cs;
    v->n_chunks = n;
    v->ttl_s = ttl;
    v->corrupt = opts->corrupt_chunks != 0;
    v->blob = malloc(len);
    v->hashes = malloc(n * HM_STATE_HASH_BYTES);
    if (v->blob == NULL || v->hashes == NULL) {
        result = -ENOMEM;
        goto out;
    }
    if (opts->declared_cb != NULL) {
        if ((wt = calloc(1, sizeof(*wt))) == NULL) {
            result = -ENOMEM;
            goto out;
        }
        wt->step = step;
        wt->cb = opts->declared_cb;
        wt->ud = opts->declared_ud;
    }
    memcpy(v->blob, blob, len);

    if (s == NULL) {
        s = calloc(1, sizeof(*s));
        if (s == NULL) {
            result = -ENOMEM;
            goto out;
        }
        s->st = st;
        s->id = st->next_id++;
        memcpy(s->prefix, prefix, strlen(prefix) + 1);
        memcpy(s->key, key, key_len + 1);
        s->key_len = key_len;
        uv_timer_init(hm_node_loop(st->node), &s->timer);
        s->timer.data = s;
        st->handles++;
        LIST_INSERT_HEAD(&st->shares, s, link);
        st->n_shares++;
    }
    /* A version still being hashed is superseded by this one. */
    version_free(s->next_v);
    s->next_v = v;
    v = NULL;
    if (wt != NULL) {
        waiter **pp = &s->waiters;
        while (*pp != NULL)
            pp = &(*pp)->next;
        *pp = wt;
        wt = NULL;
    }
    uv_timer_start(&s->timer, on_share_timer, 0, 0);
out:
    free(wt);
    version_free(v);
    return result;
}

static void share_free(share *s)
{
    hm_state *st = s->st;
    LIST_REMOVE(s, link);
    st->n_shares--;
    uv_timer_stop(&s->timer);
    uv_close((uv_handle_t *)&s->timer, on_share_closed);
    /* Off the list already: a callback that shares again makes a new share. */
    answer_waiters(s, 0, UINT64_MAX, -ECANCELED, 0);
}

int hm_state_unshare(hm_state *st, const char *prefix)
{
    share *s = prefix != NULL ? share_by_prefix(st, prefix) : NULL;
    if (s == NULL)
        return -ENOENT;
    share_free(s);
    return 0;
}

int hm_state_share_info_get(const hm_state *st, const char *prefix, hm_state_share_info *out)
{
    const share *s = prefix != NULL ? share_by_prefix(st, prefix) : NULL;
    if (s == NULL)
        return -ENOENT;
    const version *v = s->next_v != NULL ? s->next_v : s->cur;
    if (v == NULL)
        return -ENOENT;
    memset(out, 0, sizeof(*out));
    out->step = v->step;
    out->bytes = v->len;
    out->chunk_size = v->chunk_size;
    out->n_chunks = v->n_chunks;
    out->ready = s->next_v == NULL;
    if (out->ready)
        memcpy(out->hash, v->hash, HM_STATE_HASH_BYTES);
    out->declared = s->declared;
    out->chunks_served = s->chunks_served;
    out->manifests_served = s->manifests_served;
    out->refused_busy = s->refused_busy;
    return 0;
}

/* Finds the version a request names (the current one or one it
 * replaced): 0, or the error to answer. */
static int req_version(hm_state *st, const hm_state_req *q, share **s_out, version **v_out)
{
    share *s = share_by_prefix(st, q->prefix);
    if (s == NULL || s->cur == NULL)
        return -ENOENT;
    version *v = NULL;
    if (sodium_memcmp(s->cur->hash, q->hash, HM_STATE_HASH_BYTES) == 0)
        v = s->cur;
    for (size_t i = 0; v == NULL && i < KEEP_OLD_VERSIONS; i++)
        if (s->old[i] != NULL &&
            sodium_memcmp(s->old[i]->hash, q->hash, HM_STATE_HASH_BYTES) == 0)
            v = s->old[i];
    if (v == NULL)
        return -ESTALE;
    *s_out = s;
    *v_out = v;
    return 0;
}

/*
 * The serving caps (state.h): bytes still queued for this peer, and for
 * everyone. 1 when a reply now would go over them.
 */
static int serving_busy(hm_state *st, const uint8_t peer_pk[HM_PK_BYTES])
{
    hm_transport *t = hm_rpc_transport(st->rpc);
    hm_transport_stats ts;

    hm_transport_get_stats(t, &ts);
    return hm_transport_queued(t, peer_pk) > st->cfg.max_queued_per_peer ||
           ts.queued_bytes > st->cfg.max_queued_total;
}

/*
 * What both requests check before anything is served: the body, the
 * version it names (and, for a chunk, the index), and the serving caps.
 * 0 with *s_out and *v_out set, or the negative errno req has been answered
 * with.
 */
static int serve_check(hm_state *st, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                       const uint8_t *body, size_t len, int with_index, hm_state_req *q,
                       share **s_out, version **v_out)
{
    int r = hm_state_decode_req(body, len, with_index, q) < 0 ? -EINVAL : 0;
    if (r == 0)
        r = req_version(st, q, s_out, v_out);
    if (r == 0 && with_index && q->index >= (*v_out)->n_chunks)
        r = -ERANGE;
    /* A manifest is up to 2 MiB: it is held to the same caps as a chunk. */
    if (r == 0 && serving_busy(st, peer_pk)) {
        (*s_out)->refused_busy++;
        r = -ENOBUFS;
    }
    if (r != 0) {
        (void)hm_rpc_respond(req, r, NULL, 0);
        return r;
    }
    return 0;
}

static void on_manifest_req(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                            const struct sockaddr *from, const uint8_t *body, size_t len)
{
    HM_UNUSED(from);
    hm_state_req q;
    share *s = NULL;
    version *v = NULL;
    if (serve_check(ud, req, peer_pk, body, len, 0, &q, &s, &v) < 0)
        return;
    s->manifests_served++;
    (void)hm_rpc_respond(req, 0, v->manifest, v->manifest_len);
}

static void on_chunk_req(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                         const struct sockaddr *from, const uint8_t *body, size_t len)
{
    HM_UNUSED(from);
    hm_state_req q;
    share *s = NULL;
    version *v = NULL;
    if (serve_check(ud, req, peer_pk, body, len, 1, &q, &s, &v) < 0)
        return;
    size_t off = (size_t)q.index * v->chunk_size;
    size_t n = HM_MIN(v->chunk_size, v->len - off);
    s->chunks_served++;
    if (!v->corrupt) {
        (void)hm_rpc_respond(req, 0, v->blob + off, n);
        return;
    }
    uint8_t *bad = malloc(n);
    if (bad == NULL) {
        (void)hm_rpc_respond(req, -ENOMEM, NULL, 0);
        return;
    }
    memcpy(bad, v->blob + off, n);
    bad[n / 2] ^= 0x5a;
    (void)hm_rpc_respond(req, 0, bad, n);
    free(bad);
}

/* ------------------------------------------------------------ newcomer side */

static uint64_t mono_ms(void) { return hm_now_ms(); }

static void on_load_closed(uv_handle_t *h)
{
    load *l = h->data;
    hm_state *st = l->st;
    free(l);
    handle_closed(st);
}

static void load_finish(load *l, int status)
{
    hm_state *st = l->st;
    hm_state_report rep;
    uint8_t *blob = NULL;
    size_t len = 0;

    if (l->phase == L_DONE)
        return;
    l->phase = L_DONE;
    LIST_REMOVE(l, link);
    st->n_loads--;
    /* Calls in flight end now; their callbacks find the load gone. */
    for (int again = 1; again;) {
        again = 0;
        op *o;
        LIST_FOREACH(o, &st->ops, link) {
            if (o->owner != l->id)
                continue;
            o->owner = 0;
            if (o->kind == OP_MANIFEST || o->kind == OP_CHUNK || o->kind == OP_PROBE) {
                (void)hm_rpc_cancel(st->rpc, o->call_id);
                again = 1;
                break;
            }
        }
    }

    memset(&rep, 0, sizeof(rep));
    rep.status = status;
    memcpy(rep.prefix, l->prefix, sizeof(rep.prefix));
    if (l->n_donors > 0) {
        rep.step = l->agreed.step;
        memcpy(rep.hash, l->agreed.hash, HM_STATE_HASH_BYTES);
        rep.chunk_size = (size_t)l->agreed.chunk_size;
    }
    rep.n_chunks = l->n_chunks;
    rep.n_declared = l->n_declared;
    rep.n_donors = l->n_donors;
    for (size_t i = 0; i < l->n_donors; i++) {
        const donor *d = &l->donors[i];
        hm_state_donor_report *dr = &rep.donors[i];
        hm_peer_id_encode(d->pk, dr->peer_id);
        if (hm_format_addr((const struct sockaddr *)&d->addr, dr->addr, sizeof(dr->addr)) < 0)
            dr->addr[0] = '\0';
        dr->chunks = d->chunks;
        dr->bytes = d->bytes;
        dr->dropped = d->dropped;
        dr->last_error = d->last_error;
        rep.bytes += d->bytes;
    }
    rep.chunks_refetched = l->refetched;
    rep.duration_s = (double)(mono_ms() - l->started_ms) / 1000.0;
    if (status == 0) {
        blob = l->blob;
        len = (size_t)l->agreed.total_len;
        l->blob = NULL;
    } else if (l->dest == NULL) {
        free(l->blob);
    }
    l->blob = NULL;
    free(l->hashes);
    free(l->chunk_state);
    l->hashes = NULL;
    l->chunk_state = NULL;
    uv_timer_stop(&l->timer);
    uv_close((uv_handle_t *)&l->timer, on_load_closed);

    if (status == 0)
        hm_debug(MOD, "%s: loaded step %llu, %zu bytes", l->prefix,
                 (unsigned long long)rep.step, len);
    else
        hm_info(MOD, "%s: load failed: %s", l->prefix, hm_strerror(status));
    l->cb(l->ud, status, blob, len, &rep);
}

static void drop_donor(load *l, size_t i, int reason)
{
    donor *d = &l->donors[i];
    if (d->dropped)
        return;
    d->dropped = reason;
    char id[HM_PEER_ID_LEN + 1];
    hm_peer_id_encode(d->pk, id);
    hm_warn(MOD, "%s: dropped donor %s: %s", l->prefix, id, hm_state_drop_name(reason));
}

static size_t active_donors(const load *l)
{
    size_t n = 0;
    for (size_t i = 0; i < l->n_donors; i++)
        if (!l->donors[i].dropped)
            n++;
    return n;
}

/* Counts a failed request against a donor; drops it after max_failures. */
static void donor_failed(load *l, size_t i, int err)
{
    donor *d = &l->donors[i];
    d->last_error = err;
    if (err == -ENOBUFS) {
        /* Busy, not broken: it asks us to come back later. */
        d->wait_until_ms = mono_ms() + BUSY_BACKOFF_MS;
        return;
    }
    d->failures++;
    d->wait_until_ms = mono_ms() + (uint64_t)FAIL_BACKOFF_MS * d->failures;
    if (d->failures >= l->max_failures)
        drop_donor(l, i, HM_STATE_DROP_ERRORS);
}

static void on_load_timer(uv_timer_t *t);

static void load_arm(load *l, uint64_t at_ms)
{
    uint64_t now = mono_ms();
    if (at_ms > l->deadline_ms)
        at_ms = l->deadline_ms;
    uv_timer_start(&l->timer, on_load_timer, at_ms > now ? at_ms - now : 0, 0);
}

/* ---- declarations ---- */

static int start_get(load *l);

static int decl_same(const hm_state_decl *a, const hm_state_decl *b)
{
    return a->step == b->step && a->total_len == b->total_len &&
           a->chunk_size == b->chunk_size && memcmp(a->hash, b->hash, HM_STATE_HASH_BYTES) == 0;
}

typedef struct decl_entry {
    uint8_t pk[HM_PK_BYTES];
    hm_state_decl d;
    hm_origin origin; /* where the node saw it, else where it says it is */
    int verified;     /* seen by the node, proven at its address, or trusted: it votes */
} decl_entry;

static int pk_in(uint8_t (*list)[HM_PK_BYTES], size_t n, const uint8_t pk[HM_PK_BYTES])
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(list[i], pk, HM_PK_BYTES) == 0)
            return 1;
    return 0;
}

static int is_trusted(const hm_state *st, const uint8_t pk[HM_PK_BYTES])
{
    for (size_t i = 0; i < st->cfg.n_trusted; i++)
        if (memcmp(st->trusted[i], pk, HM_PK_BYTES) == 0)
            return 1;
    return 0;
}

/*
 * A declared address with an unspecified host (a donor listening on all
 * interfaces) is completed from the peer table, where the node keeps the
 * address each peer was last seen at. 0, or -ENOENT when it cannot be.
 */
static int complete_addr(hm_state *st, const uint8_t pk[HM_PK_BYTES],
                         struct sockaddr_storage *addr)
{
    int unspecified = 0;
    if (addr->ss_family == AF_INET)
        unspecified = ((struct sockaddr_in *)addr)->sin_addr.s_addr == htonl(INADDR_ANY);
    else if (addr->ss_family == AF_INET6)
        unspecified = IN6_IS_ADDR_UNSPECIFIED(&((struct sockaddr_in6 *)addr)->sin6_addr);
    if (!unspecified)
        return 0;
    size_t n = hm_node_peers(st->node, NULL, 0);
    hm_peer_info *peers = n > 0 ? calloc(n, sizeof(*peers)) : NULL;
    int result = -ENOENT;
    if (peers == NULL)
        return result;
    n = HM_MIN(n, hm_node_peers(st->node, peers, n));
    for (size_t i = 0; i < n; i++) {
        if (memcmp(peers[i].pk, pk, HM_PK_BYTES) != 0 || peers[i].addr.ss_family != addr->ss_family)
            continue;
        if (addr->ss_family == AF_INET)
            ((struct sockaddr_in *)addr)->sin_addr =
                ((struct sockaddr_in *)&peers[i].addr)->sin_addr;
        else
            ((struct sockaddr_in6 *)addr)->sin6_addr =
                ((struct sockaddr_in6 *)&peers[i].addr)->sin6_addr;
        result = 0;
        break;
    }
    free(peers);
    return result;
}

static void start_manifest(load *l);

/*
 * Picks the newest state enough origins vouch for (state.h, "Who is
 * believed"); 0, -ENOENT, -EPROTO or -ENOMEM. O(n^2) in the declarations
 * read (at most MAX_DECLS), so that many declarations cost the loop little.
 */
static int agree(load *l, const decl_entry *e, size_t n)
{
    hm_state *st = l->st;
    /* Trusted donors stand for themselves: one suffices, wherever it runs. */
    int trusting = st->cfg.n_trusted > 0;
    unsigned per_origin = trusting ? HM_STATE_MAX_DONORS : st->cfg.donors_per_origin;
    size_t need = trusting ? 1 : l->min_agree;
    size_t *cls = calloc(n ? n : 1, sizeof(*cls));
    size_t *vote = calloc(n ? n : 1, sizeof(*vote));
    size_t best = SIZE_MAX, major = SIZE_MAX;
    if (cls == NULL || vote == NULL) {
        free(cls);
        free(vote);
        return -ENOMEM;
    }
    /* cls[i]: the first declaration of e[i]'s state; vote[c]: its counted donors. */
    for (size_t i = 0; i < n; i++) {
        unsigned before = 0;
        cls[i] = i;
        for (size_t j = 0; j < i; j++)
            if (decl_same(&e[i].d, &e[j].d)) {
                cls[i] = cls[j];
                break;
            }
        if (!e[i].verified)
            continue; /* its address is not proven yet: no vote */
        for (size_t j = cls[i]; j < i; j++)
            if (cls[j] == cls[i] && e[j].verified && hm_origin_eq(&e[j].origin, &e[i].origin))
                before++;
        if (before < per_origin)
            vote[cls[i]]++;
        else
            st->refused_origin++; /* its origin voted for this state already */
    }
    /* The state most origins vouch for (ties: the newer), for the lead bound. */
    for (size_t c = 0; c < n; c++)
        if (cls[c] == c && (major == SIZE_MAX || vote[c] > vote[major] ||
                            (vote[c] == vote[major] && e[c].d.step > e[major].d.step)))
            major = c;
    for (size_t c = 0; c < n; c++) {
        if (cls[c] != c || vote[c] < need)
            continue;
        if (!trusting && st->cfg.max_step_lead > 0 && e[c].d.step > e[major].d.step &&
            e[c].d.step - e[major].d.step > st->cfg.max_step_lead) {
            st->refused_lead += vote[c];
            continue;
        }
        if (best == SIZE_MAX || e[c].d.step > e[best].d.step ||
            (e[c].d.step == e[best].d.step &&
             (vote[c] > vote[best] ||
              (vote[c] == vote[best] &&
               memcmp(e[c].d.hash, e[best].d.hash, HM_STATE_HASH_BYTES) < 0))))
            best = c;
    }
    free(cls);
    free(vote);
    if (best == SIZE_MAX)
        return n == 0 ? -ENOENT : -EPROTO;
    l->agreed = e[best].d;
    l->n_donors = 0;
    for (size_t j = 0; j < n && l->n_donors < HM_STATE_MAX_DONORS; j++) {
        if (!e[j].verified || !decl_same(&e[j].d, &l->agreed))
            continue;
        donor *d = &l->donors[l->n_donors++];
        memset(d, 0, sizeof(*d));
        memcpy(d->pk, e[j].pk, HM_PK_BYTES);
        d->addr = e[j].d.addr;
    }
    return 0;
}

static void on_probe(void *ud, int status, const uint8_t *body, size_t len)
{
    op *o = ud;
    hm_state *st = o->st;
    uint64_t id = o->owner;
    uint8_t pk[HM_PK_BYTES], want[HM_STATE_HASH_BYTES], h[HM_STATE_HASH_BYTES];
    memcpy(pk, o->pk, HM_PK_BYTES);
    memcpy(want, o->hash, HM_STATE_HASH_BYTES);
    op_free(o);
    load *l = st != NULL && id != 0 ? load_by_id(st, id) : NULL;
    if (l == NULL || status != 0 || len > HM_STATE_MANIFEST_MAX)
        return;
    /* The key answered at the address it declares, with the state it declares. */
    hash_bytes(body, len, h);
    if (sodium_memcmp(h, want, HM_STATE_HASH_BYTES) == 0 && l->n_verified < MAX_PROBES &&
        !pk_in(l->verified, l->n_verified, pk)) {
        memcpy(l->verified[l->n_verified++], pk, HM_PK_BYTES);
        hm_debug(MOD, "%s: an unseen donor proved its address", l->key);
    }
}

/*
 * Asks a donor the node has not seen for the manifest it declares, once
 * per load: an answer under its key proves the address it declares, and
 * so its origin; the next read of the declarations counts its vote.
 * 1 when the request went out.
 */
static int probe(load *l, const decl_entry *x)
{
    hm_state *st = l->st;
    uint8_t buf[HM_STATE_SMALL_MAX];
    hm_wire_wr w;
    hm_state_req q;
    if (l->n_probed >= MAX_PROBES || pk_in(l->probed, l->n_probed, x->pk))
        return 0;
    memcpy(l->probed[l->n_probed++], x->pk, HM_PK_BYTES);
    hm_debug(MOD, "%s: asking an unseen donor to prove its address", l->key);
    memset(&q, 0, sizeof(q));
    memcpy(q.prefix, l->prefix, sizeof(q.prefix));
    memcpy(q.hash, x->d.hash, HM_STATE_HASH_BYTES);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_state_encode_req(&w, &q, 0);
    if (hm_wire_wr_error(&w) < 0)
        return 0;
    op *o = op_new(st, l->id, OP_PROBE);
    if (o == NULL)
        return 0;
    memcpy(o->pk, x->pk, HM_PK_BYTES);
    memcpy(o->hash, x->d.hash, HM_STATE_HASH_BYTES);
    if (hm_rpc_call(st->rpc, x->pk, (const struct sockaddr *)&x->d.addr, M_MANIFEST, buf, w.len,
                    HM_RPC_STREAM, HM_MIN(l->req_ms, (uint64_t)PROBE_TIMEOUT_MS), on_probe, o,
                    &o->call_id) < 0) {
        op_free(o);
        return 0;
    }
    return 1;
}

static void on_get(void *ud, int status, const hm_dht_value *values, size_t n,
                   const hm_dht_lookup_info *info)
{
    HM_UNUSED(info);
    op *o = ud;
    hm_state *st = o->st;
    uint64_t id = o->owner;
    op_free(o);
    load *l = st != NULL && id != 0 ? load_by_id(st, id) : NULL;
    if (l == NULL)
        return;
    if (status == -ECANCELED) {
        load_finish(l, -ECANCELED);
        return;
    }
    int r = -ENOENT;
    decl_entry *e = NULL;
    size_t ne = 0;
    /* The newest step an unseen donor was first asked to prove this read. */
    int probed = 0;
    uint64_t probed_step = 0;
    if (status == 0 && n > 0) {
        e = calloc(HM_MIN(n, (size_t)MAX_DECLS), sizeof(*e));
        /* Where the node verified each peer: a donor's origin, whatever it declares. */
        size_t n_peers = hm_node_peers(st->node, NULL, 0);
        hm_peer_info *peers = n_peers > 0 ? calloc(n_peers, sizeof(*peers)) : NULL;
        if (e == NULL || (n_peers > 0 && peers == NULL)) {
            free(e);
            free(peers);
            load_finish(l, -ENOMEM);
            return;
        }
        if (peers != NULL)
            n_peers = HM_MIN(n_peers, hm_node_peers(st->node, peers, n_peers));
        for (size_t i = 0; i < n && ne < MAX_DECLS; i++) {
            const hm_dht_record *rec = &values[i].rec;
            decl_entry *x = &e[ne];
            /* Only owned subkeys count: the DHT checked their signatures. */
            if (!rec->has_subkey || hm_dht_record_owner(rec, x->pk) != 1)
                continue;
            if (memcmp(x->pk, st->pk, HM_PK_BYTES) == 0)
                continue;
            if (st->cfg.n_trusted > 0 && !is_trusted(st, x->pk)) {
                st->refused_untrusted++;
                continue;
            }
            if (hm_state_decode_decl(rec->value, rec->value_len, &x->d) < 0)
                continue;
            if (complete_addr(st, x->pk, &x->d.addr) < 0)
                continue;
            hm_origin_of((const struct sockaddr *)&x->d.addr, &x->origin);
            /* Trusted donors vote as who they are; the origin rule does not apply. */
            x->verified = st->cfg.n_trusted > 0 || pk_in(l->verified, l->n_verified, x->pk);
            /* Where the node saw it, if it answered our ping there: the address
             * a datagram came from alone is the sender's to choose (a spoofer's
             * source), so an unverified entry proves nothing and the donor
             * proves its declared address instead (probe()). */
            for (size_t p = 0; p < n_peers; p++)
                if (peers[p].verified && memcmp(peers[p].pk, x->pk, HM_PK_BYTES) == 0) {
                    hm_origin_of((const struct sockaddr *)&peers[p].addr, &x->origin);
                    x->verified = 1;
                    break;
                }
            if (!x->verified && probe(l, x)) {
                probed_step = probed ? HM_MAX(probed_step, x->d.step) : x->d.step;
                probed = 1;
            }
            ne++;
        }
        free(peers);
        l->n_declared = ne;
        r = agree(l, e, ne);
        free(e);
        if (r == -ENOMEM) {
            load_finish(l, -ENOMEM);
            return;
        }
    } else if (status < 0) {
        hm_debug(MOD, "%s: DHT read failed: %s", l->key, hm_strerror(status));
    }
    /*
     * Agreement on a step older than one an unseen donor declares and is
     * being asked to prove: its vote may count at the next read, so the
     * newest state enough origins vouch for is decided then, not by which
     * proof came first. Each donor is asked once per load, so this waits
     * at most one more read per new donor, within dht_attempts.
     */
    if (r == 0 && probed && probed_step > l->agreed.step && l->dht_reads < l->dht_attempts &&
        mono_ms() + DHT_RETRY_MS < l->deadline_ms) {
        hm_debug(MOD, "%s: step %llu agreed, an unseen donor declares %llu: reading again",
                 l->key, (unsigned long long)l->agreed.step, (unsigned long long)probed_step);
        l->n_donors = 0;
        load_arm(l, mono_ms() + DHT_RETRY_MS);
        return;
    }
    if (r == 0) {
        uint64_t cap = l->dest != NULL ? HM_MIN(st->cfg.max_blob_bytes, (uint64_t)l->dest_cap)
                                       : st->cfg.max_blob_bytes;
        if (l->agreed.total_len > cap) {
            load_finish(l, -EMSGSIZE);
            return;
        }
        start_manifest(l);
        return;
    }
    /* No agreement yet: donors may still be declaring; read again. */
    if (l->dht_reads < l->dht_attempts && mono_ms() + DHT_RETRY_MS < l->deadline_ms) {
        load_arm(l, mono_ms() + DHT_RETRY_MS);
        return;
    }
    load_finish(l, r);
}

static int start_get(load *l)
{
    hm_state *st = l->st;
    uint64_t now = mono_ms();
    uint64_t left = l->deadline_ms > now ? l->deadline_ms - now : 1;
    op *o = op_new(st, l->id, OP_GET);
    if (o == NULL)
        return -ENOMEM;
    int r = hm_node_dht_get(st->node, (const uint8_t *)l->key, l->key_len,
                            HM_MIN(left, (uint64_t)DHT_TIMEOUT_MS), on_get, o);
    if (r < 0) {
        op_free(o);
        return r;
    }
    l->dht_reads++;
    return 0;
}

/* ---- manifest ---- */

static void on_manifest(void *ud, int status, const uint8_t *body, size_t len)
{
    op *o = ud;
    hm_state *st = o->st;
    uint64_t id = o->owner;
    size_t di = o->donor;
    op_free(o);
    load *l = st != NULL && id != 0 ? load_by_id(st, id) : NULL;
    if (l == NULL)
        return;
    l->manifest_busy = 0;
    if (status < 0) {
        donor_failed(l, di, status);
        l->next_manifest = di + 1;
        start_manifest(l);
        return;
    }
    uint8_t h[HM_STATE_HASH_BYTES];
    hm_state_manifest m;
    if (len > HM_STATE_MANIFEST_MAX) {
        drop_donor(l, di, HM_STATE_DROP_BAD_MANIFEST);
        l->bad_manifest = 1;
        l->next_manifest = di + 1;
        start_manifest(l);
        return;
    }
    hash_bytes(body, len, h);
    if (sodium_memcmp(h, l->agreed.hash, HM_STATE_HASH_BYTES) != 0) {
        drop_donor(l, di, HM_STATE_DROP_BAD_MANIFEST);
        l->bad_manifest = 1;
        l->next_manifest = di + 1;
        start_manifest(l);
        return;
    }
    /*
     * The manifest is the one every agreeing donor vouched for; if it is
     * malformed or contradicts their declaration, they all lied alike and
     * no other donor can help.
     */
    if (hm_state_decode_manifest(body, len, &m) < 0 || m.step != l->agreed.step ||
        m.total_len != l->agreed.total_len || m.chunk_size != l->agreed.chunk_size) {
        drop_donor(l, di, HM_STATE_DROP_BAD_MANIFEST);
        load_finish(l, -EPROTO);
        return;
    }
    l->n_chunks = m.n_chunks;
    l->hashes = malloc(m.n_chunks * HM_STATE_HASH_BYTES);
    l->chunk_state = calloc(m.n_chunks, 1);
    if (l->dest != NULL)
        l->blob = l->dest;
    else
        l->blob = malloc((size_t)m.total_len);
    if (l->hashes == NULL || l->chunk_state == NULL || l->blob == NULL) {
        load_finish(l, -ENOMEM);
        return;
    }
    memcpy(l->hashes, m.hashes, m.n_chunks * HM_STATE_HASH_BYTES);
    l->phase = L_CHUNKS;
    hm_debug(MOD, "%s: manifest of step %llu: %zu chunks from %zu donors", l->prefix,
             (unsigned long long)m.step, m.n_chunks, active_donors(l));
    pump(l);
}

static void start_manifest(load *l)
{
    hm_state *st = l->st;
    uint8_t buf[HM_STATE_SMALL_MAX];
    hm_wire_wr w;
    hm_state_req q;
    uint64_t now = mono_ms();

    l->phase = L_MANIFEST;
    for (;;) {
        if (active_donors(l) == 0) {
            load_finish(l, l->bad_manifest ? -EPROTO : -EHOSTUNREACH);
            return;
        }
        size_t i = l->next_manifest % l->n_donors;
        donor *d = &l->donors[i];
        if (d->dropped) {
            l->next_manifest = i + 1;
            continue;
        }
        if (d->wait_until_ms > now) {
            /* Every donor left is backing off: ask this one when it may. */
            size_t k = 0;
            for (; k < l->n_donors; k++) {
                const donor *x = &l->donors[(i + k) % l->n_donors];
                if (!x->dropped && x->wait_until_ms <= now)
                    break;
            }
            if (k == l->n_donors) {
                load_arm(l, d->wait_until_ms);
                return;
            }
            l->next_manifest = i + k;
            continue;
        }
        memset(&q, 0, sizeof(q));
        memcpy(q.prefix, l->prefix, sizeof(q.prefix));
        memcpy(q.hash, l->agreed.hash, HM_STATE_HASH_BYTES);
        hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
        hm_state_encode_req(&w, &q, 0);
        if (hm_wire_wr_error(&w) < 0) {
            load_finish(l, -EINVAL);
            return;
        }
        op *o = op_new(st, l->id, OP_MANIFEST);
        if (o == NULL) {
            load_finish(l, -ENOMEM);
            return;
        }
        o->donor = i;
        int r = hm_rpc_call(st->rpc, d->pk, (const struct sockaddr *)&d->addr, M_MANIFEST, buf,
                            w.len, HM_RPC_STREAM, l->req_ms, on_manifest, o, &o->call_id);
        if (r < 0) {
            op_free(o);
            donor_failed(l, i, r);
            l->next_manifest = i + 1;
            continue;
        }
        l->manifest_busy = 1;
        load_arm(l, l->deadline_ms);
        return;
    }
}

/* ---- chunks ---- */

static void on_chunk(void *ud, int status, const uint8_t *body, size_t len)
{
    op *o = ud;
    hm_state *st = o->st;
    uint64_t id = o->owner;
    size_t di = o->donor, ci = o->chunk;
    op_free(o);
    load *l = st != NULL && id != 0 ? load_by_id(st, id) : NULL;
    if (l == NULL)
        return;
    donor *d = &l->donors[di];
    d->inflight--;
    if (status < 0) {
        l->chunk_state[ci] = C_PENDING;
        l->cursor = HM_MIN(l->cursor, ci);
        l->refetched++;
        donor_failed(l, di, status);
        pump(l);
        return;
    }
    size_t off = ci * (size_t)l->agreed.chunk_size;
    size_t want = HM_MIN((size_t)l->agreed.chunk_size, (size_t)l->agreed.total_len - off);
    uint8_t h[HM_STATE_HASH_BYTES];
    int ok = len == want;
    if (ok) {
        hash_bytes(body, len, h);
        ok = sodium_memcmp(h, l->hashes + ci * HM_STATE_HASH_BYTES, HM_STATE_HASH_BYTES) == 0;
    }
    if (!ok) {
        l->chunk_state[ci] = C_PENDING;
        l->cursor = HM_MIN(l->cursor, ci);
        l->refetched++;
        d->last_error = -EBADMSG;
        drop_donor(l, di, HM_STATE_DROP_BAD_CHUNK);
        pump(l);
        return;
    }
    /* A verified chunk is right whoever sent it, a dropped donor included. */
    memcpy(l->blob + off, body, len);
    l->chunk_state[ci] = C_DONE;
    l->n_done++;
    d->chunks++;
    d->bytes += len;
    d->failures = 0;
    pump(l);
}

/* The next chunk nobody holds or is fetching, or SIZE_MAX. */
static size_t next_pending(load *l)
{
    while (l->cursor < l->n_chunks && l->chunk_state[l->cursor] != C_PENDING)
        l->cursor++;
    return l->cursor < l->n_chunks ? l->cursor : SIZE_MAX;
}

static int send_chunk_req(load *l, size_t di, size_t ci)
{
    hm_state *st = l->st;
    donor *d = &l->donors[di];
    uint8_t buf[HM_STATE_SMALL_MAX];
    hm_wire_wr w;
    hm_state_req q;
    memset(&q, 0, sizeof(q));
    memcpy(q.prefix, l->prefix, sizeof(q.prefix));
    memcpy(q.hash, l->agreed.hash, HM_STATE_HASH_BYTES);
    q.index = ci;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_state_encode_req(&w, &q, 1);
    if (hm_wire_wr_error(&w) < 0)
        return -EINVAL;
    op *o = op_new(st, l->id, OP_CHUNK);
    if (o == NULL)
        return -ENOMEM;
    o->donor = di;
    o->chunk = ci;
    int r = hm_rpc_call(st->rpc, d->pk, (const struct sockaddr *)&d->addr, M_CHUNK, buf, w.len,
                        HM_RPC_STREAM, l->req_ms, on_chunk, o, &o->call_id);
    if (r < 0) {
        op_free(o);
        return r;
    }
    l->chunk_state[ci] = C_INFLIGHT;
    d->inflight++;
    return 0;
}

/*
 * Hands pending chunks to donors, one per donor per pass in turn, each up
 * to its window, and finishes the load when every chunk is in or no donor
 * is left. A donor backing off is skipped and the timer set for it.
 */
static void pump(load *l)
{
    if (l->phase != L_CHUNKS)
        return;
    if (l->n_done == l->n_chunks) {
        load_finish(l, 0);
        return;
    }
    uint64_t now = mono_ms();
    uint64_t wake = UINT64_MAX;
    for (int progress = 1; progress;) {
        progress = 0;
        for (size_t k = 0; k < l->n_donors; k++) {
            size_t di = (l->rr + k) % l->n_donors;
            donor *d = &l->donors[di];
            if (d->dropped || d->inflight >= l->window)
                continue;
            if (d->wait_until_ms > now) {
                wake = HM_MIN(wake, d->wait_until_ms);
                continue;
            }
            size_t ci = next_pending(l);
            if (ci == SIZE_MAX)
                break;
            int r = send_chunk_req(l, di, ci);
            if (r == -ENOMEM) {
                load_finish(l, -ENOMEM);
                return;
            }
            if (r < 0) {
                donor_failed(l, di, r);
                if (!d->dropped && d->wait_until_ms > now)
                    wake = HM_MIN(wake, d->wait_until_ms);
            } else {
                progress = 1;
            }
        }
        l->rr = (l->rr + 1) % l->n_donors;
    }
    unsigned inflight = 0;
    for (size_t i = 0; i < l->n_donors; i++)
        inflight += l->donors[i].inflight;
    if (active_donors(l) == 0 && inflight == 0) {
        load_finish(l, -EHOSTUNREACH);
        return;
    }
    /* The deadline is always armed; a back-off may need an earlier wake. */
    load_arm(l, wake);
}

static void on_load_timer(uv_timer_t *t)
{
    load *l = t->data;
    if (mono_ms() >= l->deadline_ms) {
        load_finish(l, -ETIMEDOUT);
        return;
    }
    switch (l->phase) {
    case L_DHT: {
        int r = start_get(l);
        if (r < 0)
            load_finish(l, r);
        else
            load_arm(l, l->deadline_ms);
        break;
    }
    case L_MANIFEST:
        if (!l->manifest_busy)
            start_manifest(l);
        else
            load_arm(l, l->deadline_ms);
        break;
    case L_CHUNKS:
        pump(l);
        break;
    default:
        break;
    }
}

int hm_state_load(hm_state *st, const char *prefix, const hm_state_load_opts *opts,
                  hm_state_load_cb cb, void *ud)
{
    hm_state_load_opts none = {0};
    int r;
    if (opts == NULL)
        opts = &none;
    if (st->closing)
        return -ESHUTDOWN;
    if (prefix == NULL || cb == NULL || (opts->dest == NULL && opts->dest_cap > 0))
        return -EINVAL;
    if (st->n_loads >= HM_STATE_MAX_LOADS)
        return -ENOBUFS;
    load *l = calloc(1, sizeof(*l));
    if (l == NULL)
        return -ENOMEM;
    if (make_key(prefix, l->key, sizeof(l->key), &l->key_len) < 0) {
        free(l);
        return -EINVAL;
    }
    memcpy(l->prefix, prefix, strlen(prefix) + 1);
    l->st = st;
    l->id = st->next_id++;
    l->cb = cb;
    l->ud = ud;
    l->min_agree = opts->min_agree != 0 ? opts->min_agree : 2;
    l->window = opts->window != 0 ? HM_MIN(opts->window, 64u) : 4;
    l->max_failures = opts->max_failures != 0 ? opts->max_failures : 3;
    l->dht_attempts = opts->dht_attempts != 0 ? opts->dht_attempts : 3;
    l->req_ms = opts->request_timeout_ms != 0 ? opts->request_timeout_ms : 15000;
    l->dest = opts->dest;
    l->dest_cap = opts->dest_cap;
    l->started_ms = mono_ms();
    l->deadline_ms = l->started_ms + (opts->timeout_ms != 0 ? opts->timeout_ms : 300000);
    l->phase = L_DHT;
    uv_timer_init(hm_node_loop(st->node), &l->timer);
    l->timer.data = l;
    st->handles++;
    if ((r = start_get(l)) < 0) {
        /* The timer was never started: closing it frees the load. */
        uv_close((uv_handle_t *)&l->timer, on_load_closed);
        return r;
    }
    LIST_INSERT_HEAD(&st->loads, l, link);
    st->n_loads++;
    load_arm(l, l->deadline_ms);
    return 0;
}

/* ------------------------------------------------------------ module */

static void on_anchor_closed(uv_handle_t *h) { handle_closed(h->data); }

int hm_state_new(hm_node *node, const hm_state_config *cfg, hm_state **out)
{
    int result = 0;
    hm_state *st = calloc(1, sizeof(*st));
    *out = NULL;
    if (st == NULL)
        return -ENOMEM;
    LIST_INIT(&st->shares);
    LIST_INIT(&st->loads);
    LIST_INIT(&st->ops);
    if (cfg != NULL)
        st->cfg = *cfg;
    if (st->cfg.donors_per_origin == 0)
        st->cfg.donors_per_origin = 1;
    if (st->cfg.n_trusted > HM_STATE_MAX_DONORS || (st->cfg.n_trusted > 0 && cfg->trusted == NULL)) {
        free(st);
        return -EINVAL;
    }
    st->cfg.trusted = NULL;
    if (st->cfg.n_trusted > 0) {
        st->trusted = malloc(st->cfg.n_trusted * HM_PK_BYTES);
        if (st->trusted == NULL) {
            free(st);
            return -ENOMEM;
        }
        memcpy(st->trusted, cfg->trusted, st->cfg.n_trusted * HM_PK_BYTES);
    }
    if (st->cfg.max_blob_bytes == 0)
        st->cfg.max_blob_bytes = 4ull << 30;
    if (st->cfg.max_queued_per_peer == 0)
        st->cfg.max_queued_per_peer = 8u << 20;
    if (st->cfg.max_queued_total == 0)
        st->cfg.max_queued_total = 64u << 20;
    st->node = node;
    st->rpc = hm_node_rpc(node);
    st->next_id = 1;
    memcpy(st->pk, hm_node_identity(node)->pk, HM_PK_BYTES);
    if ((result = hm_transport_local_addr(hm_rpc_transport(st->rpc), &st->addr)) < 0)
        goto out;
    if ((result = hm_rpc_register(st->rpc, M_MANIFEST, on_manifest_req, st)) < 0)
        goto out;
    if ((result = hm_rpc_register(st->rpc, M_CHUNK, on_chunk_req, st)) < 0) {
        hm_rpc_unregister(st->rpc, M_MANIFEST);
        goto out;
    }
    uv_timer_init(hm_node_loop(node), &st->anchor);
    st->anchor.data = st;
    st->handles = 1;
    *out = st;
out:
    if (result < 0) {
        free(st->trusted);
        free(st);
    }
    return result;
}

void hm_state_limits(const hm_state *st, hm_limit_emit_fn emit, void *ud)
{
    emit(ud, "StateDonorsPerOrigin", st->refused_origin);
    emit(ud, "StateTrustedDonors", st->refused_untrusted);
    emit(ud, "StateMaxStepLead", st->refused_lead);
}

void hm_state_close(hm_state *st, void (*cb)(void *ud), void *ud)
{
    if (st == NULL || st->closing)
        return;
    st->closing = 1;
    st->close_cb = cb;
    st->close_ud = ud;
    while (!LIST_EMPTY(&st->loads))
        load_finish(LIST_FIRST(&st->loads), -ECANCELED);
    while (!LIST_EMPTY(&st->shares))
        share_free(LIST_FIRST(&st->shares));
    /* DHT operations still in flight end later and only free their op. */
    op *o;
    LIST_FOREACH(o, &st->ops, link)
        o->st = NULL;
    LIST_INIT(&st->ops);
    hm_rpc_unregister(st->rpc, M_MANIFEST);
    hm_rpc_unregister(st->rpc, M_CHUNK);
    /* The anchor's close callback comes from the loop, so cb never fires
     * from inside this call even when nothing else was open. */
    uv_close((uv_handle_t *)&st->anchor, on_anchor_closed);
}

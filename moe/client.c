/*
 * client: finding experts through the DHT and calling them (see client.h
 * for the semantics).
 *
 * It owns two kinds of work in flight:
 *   - find operations (a lookup or a beam search), each waiting on one DHT
 *     get or get_many. The node gives no handle to cancel those, so when
 *     the client is freed a find operation is detached (its callback fires
 *     with -ECANCELED then) and lives on until the DHT answers or the node
 *     closes, when it only frees itself;
 *   - expert calls, each with one rpc call per expert, an overall timer and
 *     a timer started at the k_min-th answer. Finishing a call cancels its
 *     rpc calls (whose callbacks fire synchronously and find the call
 *     done), so nothing writes into the caller's buffers after its
 *     callback; the call's memory goes in the timers' close callback.
 */
#include "config.h"

#include "moe/client.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dht/record.h"
#include "src/base/util.h"
#include "src/base/wire.h"

#define MOD "moe.client"

/* Keys fetched per beam level, so that a level is one get_many. */
#define BEAM_MAX HM_DHT_MANY_MAX

typedef struct find_op find_op;
typedef struct call call;
typedef struct route_op route_op;

/* A name's remembered holder (policy in client.h); name[0] == 0: a free slot. */
typedef struct holder {
    char name[HM_MOE_UID_MAX + 1];
    uint8_t pk[HM_PK_BYTES];
} holder;

/*
 * A host that stalled a call (client.h, "Stalled hosts"); used == 0: a
 * free slot. A probe is one call allowed through after the back-off; while
 * it is in flight until_ms holds the other calls off.
 */
typedef struct backoff {
    int used;
    int probing;
    uint8_t pk[HM_PK_BYTES];
    uint64_t until_ms;  /* skipped until then */
    uint64_t period_ms; /* the back-off now in force */
    unsigned stalls;    /* in a row */
} backoff;

struct hm_moe_client {
    hm_node *node;
    hm_rpc *rpc;
    double max_ttl_s;
    int any_holder;
    const hm_moe_allow *allow;
    holder *holders; /* HM_MOE_HOLDERS slots, allocated on first use */
    backoff *backoffs; /* HM_MOE_BACKOFF_HOSTS slots, allocated at the first stall */
    uint64_t backoff_ms, backoff_max_ms;
    uint64_t n_stalls, n_skipped, n_recovered;
    uint64_t refused_ttl, refused_allow, refused_holder;
    uint64_t next_call_id;
    LIST_HEAD(, find_op) finds; /* active find operations */
    LIST_HEAD(, call) calls;    /* active expert calls */
    LIST_HEAD(, route_op) routes; /* active per-sample searches */
};

/* ------------------------------------------------------------ find ops */

enum { FIND_LOOKUP = 1, FIND_BEAM = 2 };

/* One beam entry: a grid prefix ("ffn.3.") or, at the last level, an expert. */
typedef struct beam_ent {
    char name[HM_MOE_UID_MAX + 1];
    double score;
    double expiration; /* the chosen declaration's */
    int64_t held_s;    /* -- held since -- the chosen declaration's (dht.h), -1 unknown */
    unsigned n_owners; /* declarations of this name seen in the read (the chosen one too) */
    hm_moe_expert ex;  /* experts: uid, address and owner; prefixes: the owner only */
} beam_ent;

struct find_op {
    hm_moe_client *c; /* NULL once detached by hm_moe_client_free */
    LIST_ENTRY(find_op) link; /* in c->finds while c is set */
    int kind;
    hm_moe_find_cb cb;
    void *ud;
    char uid[HM_MOE_UID_MAX + 1]; /* lookup */

    /* Beam search. scores are copied so that the caller's may go away. */
    char prefix[HM_MOE_PREFIX_MAX + 1];
    size_t ndims, k_best, beam_size;
    size_t grid[HM_MOE_MAX_GRID_DIMS];
    double *scores[HM_MOE_MAX_GRID_DIMS];
    uint64_t deadline_ms;
    unsigned level;
    int failed_gets; /* a get of this search failed (timeout, unreachable) */
    beam_ent *beam;  /* beam_size entries */
    size_t n_beam;
    beam_ent *next_beam; /* candidates of the level being read */
    size_t n_next;
};

static void find_link(hm_moe_client *c, find_op *f)
{
    f->c = c;
    LIST_INSERT_HEAD(&c->finds, f, link);
}

static void find_unlink(find_op *f)
{
    if (f->c == NULL)
        return;
    LIST_REMOVE(f, link);
    f->c = NULL;
}

static void find_free(find_op *f)
{
    if (f == NULL)
        return;
    for (size_t d = 0; d < HM_MOE_MAX_GRID_DIMS; d++)
        free(f->scores[d]);
    free(f->beam);
    free(f->next_beam);
    free(f);
}

/* Ends a find operation that is still attached: unlinks, reports, frees. */
static void find_finish(find_op *f, int status, const hm_moe_expert *ex, size_t n)
{
    find_unlink(f);
    hm_moe_find_cb cb = f->cb;
    void *ud = f->ud;
    cb(ud, status, ex, n);
    find_free(f);
}

/* "[owner:PEERID]" exactly: the owner's key. 0 or -EINVAL. */
static int parse_owner_subkey(const uint8_t *sk, size_t len, uint8_t pk[HM_PK_BYTES])
{
    if (len != HM_DHT_OWNER_MARKER_LEN || memcmp(sk, "[owner:", 7) != 0 || sk[len - 1] != ']')
        return -EINVAL;
    return hm_peer_id_decode((const char *)sk + 7, HM_PEER_ID_LEN, pk) == 0 ? 0 : -EINVAL;
}

/* Fills an expert's address from "HOST:PORT". 0 or -EINVAL. */
static int expert_set_addr(hm_moe_expert *ex, const char *addr)
{
    if (hm_strlcpy(ex->addr_str, addr, sizeof(ex->addr_str)) < 0)
        return -EINVAL;
    return hm_parse_hostport(addr, &ex->addr) == 0 ? 0 : -EINVAL;
}

/* ------------------------------------------------------------ which declarations */

static holder *holder_slot(hm_moe_client *c, const char *name, int create)
{
    uint8_t h[8];
    uint64_t v = 0;
    if (c->holders == NULL) {
        if (!create || (c->holders = calloc(HM_MOE_HOLDERS, sizeof(*c->holders))) == NULL)
            return NULL;
    }
    crypto_generichash(h, sizeof(h), (const uint8_t *)name, strlen(name), NULL, 0);
    for (int i = 0; i < 8; i++)
        v = (v << 8) | h[i];
    return &c->holders[v % HM_MOE_HOLDERS];
}

/* The remembered holder of name, or NULL. */
static const uint8_t *holder_get(hm_moe_client *c, const char *name)
{
    holder *h = holder_slot(c, name, 0);
    return h != NULL && strcmp(h->name, name) == 0 ? h->pk : NULL;
}

/* One holder per name applies (no allow-list rule covers it, any_holder unset). */
static int one_holder(const hm_moe_client *c, const char *name)
{
    return !c->any_holder && hm_moe_allow_find(c->allow, name) == NULL;
}

/* Whether a declaration of name by pk, expiring then, is believed at all. */
static int decl_admit(hm_moe_client *c, const char *name, const uint8_t pk[HM_PK_BYTES],
                      double expiration, double now)
{
    if (expiration > now + c->max_ttl_s + HM_MOE_CLOCK_SLACK_S) {
        c->refused_ttl++;
        return 0;
    }
    if (!hm_moe_allow_permits(c->allow, name, pk)) {
        c->refused_allow++;
        return 0;
    }
    return 1;
}

/*
 * Whether declaration a of name is preferred to b: the live holder this
 * client knows, then (-- held since --) the one the DHT's replicas have
 * held longer without a gap (held_s, dht.h), then the fresher.
 */
static int decl_better(hm_moe_client *c, const char *name, const uint8_t *pk_a, double exp_a,
                       int64_t held_a, const uint8_t *pk_b, double exp_b, int64_t held_b)
{
    if (one_holder(c, name)) {
        const uint8_t *h = holder_get(c, name);
        if (h != NULL) {
            int a_holds = memcmp(pk_a, h, HM_PK_BYTES) == 0;
            int b_holds = memcmp(pk_b, h, HM_PK_BYTES) == 0;
            if (a_holds != b_holds)
                return a_holds;
        }
        /* A first look: the replicas' memory of who came first. Another
         * owner cannot make its own declaration older than it is, however
         * fresh it signs it; only the owner that keeps refreshing keeps
         * its time. Unknown (-1, older replicas) counts as none. */
        if (held_a != held_b)
            return held_a > held_b;
    }
    return exp_a > exp_b;
}

/*
 * After a read chose pk for name: counts the other owners passed over
 * while a holder was kept, and remembers pk as the holder (a holder that
 * was not among the read's live declarations is replaced: its run ended).
 */
static void holder_note(hm_moe_client *c, const char *name, const uint8_t pk[HM_PK_BYTES],
                        size_t n_others)
{
    if (!one_holder(c, name))
        return;
    const uint8_t *h = holder_get(c, name);
    /* -- held since -- a first look passes the others over too (held times) */
    if (h == NULL || memcmp(h, pk, HM_PK_BYTES) == 0)
        c->refused_holder += n_others;
    holder *slot = holder_slot(c, name, 1);
    if (slot == NULL)
        return; /* no memory for the cache: the next read chooses afresh */
    hm_strlcpy(slot->name, name, sizeof(slot->name));
    memcpy(slot->pk, pk, HM_PK_BYTES);
}

/* Forgets name's holder (a read found no live declaration of it). */
static void holder_forget(hm_moe_client *c, const char *name)
{
    holder *h = holder_slot(c, name, 0);
    if (h != NULL && strcmp(h->name, name) == 0)
        h->name[0] = '\0';
}

/* ------------------------------------------------------------ stalled hosts */

static backoff *backoff_slot(hm_moe_client *c, const uint8_t pk[HM_PK_BYTES], int create)
{
    uint8_t h[8];
    uint64_t v = 0;
    if (c->backoffs == NULL) {
        if (!create || (c->backoffs = calloc(HM_MOE_BACKOFF_HOSTS, sizeof(*c->backoffs))) == NULL)
            return NULL;
    }
    /* Keys are chosen by their owners: hash them so that a swarm of made
     * identities cannot aim at one slot any better than at random. */
    crypto_generichash(h, sizeof(h), pk, HM_PK_BYTES, NULL, 0);
    for (int i = 0; i < 8; i++)
        v = (v << 8) | h[i];
    return &c->backoffs[v % HM_MOE_BACKOFF_HOSTS];
}

static backoff *backoff_get(hm_moe_client *c, const uint8_t pk[HM_PK_BYTES])
{
    backoff *b = backoff_slot(c, pk, 0);
    return b != NULL && b->used && memcmp(b->pk, pk, HM_PK_BYTES) == 0 ? b : NULL;
}

enum { HOST_GOOD = 0, HOST_BACKED_OFF = 1, HOST_DUE = 2 };

/* Where a host stands now: in good standing, backed off, or due for a probe. */
static int backoff_state(hm_moe_client *c, const uint8_t pk[HM_PK_BYTES], uint64_t now)
{
    const backoff *b = backoff_get(c, pk);
    if (b == NULL)
        return HOST_GOOD;
    return now < b->until_ms ? HOST_BACKED_OFF : HOST_DUE;
}

/* A call goes to a host whose back-off ran out: the others wait for its verdict. */
static void backoff_probe(hm_moe_client *c, const uint8_t pk[HM_PK_BYTES], uint64_t now,
                          uint64_t timeout_ms)
{
    backoff *b = backoff_get(c, pk);
    if (b == NULL || now < b->until_ms)
        return;
    b->probing = 1;
    b->until_ms = now + timeout_ms;
}

/*
 * The host let a call wait. The first stall of a period starts (or
 * doubles) the back-off; more stalls in the same period (several of its
 * experts in one call, calls that had to use it anyway) change nothing.
 */
static void backoff_stall(hm_moe_client *c, const uint8_t pk[HM_PK_BYTES], uint64_t now)
{
    backoff *b = backoff_get(c, pk);
    if (b != NULL && !b->probing && now < b->until_ms)
        return;
    if (b == NULL) {
        if ((b = backoff_slot(c, pk, 1)) == NULL)
            return; /* no memory for the table: the host is only called again */
        memset(b, 0, sizeof(*b));
        b->used = 1;
        memcpy(b->pk, pk, HM_PK_BYTES);
    }
    b->period_ms = b->period_ms == 0 ? c->backoff_ms : HM_MIN(2 * b->period_ms, c->backoff_max_ms);
    b->until_ms = now + b->period_ms;
    b->probing = 0;
    b->stalls++;
    c->n_stalls++;
    char peer[HM_PEER_ID_LEN + 1];
    hm_peer_id_encode(pk, peer);
    hm_info(MOD, "host %.12s stalled a call: skipped for %.1f s (stall %u in a row)", peer,
            (double)b->period_ms / 1000.0, b->stalls);
}

/* The host answered (a result or an error reply): it is alive, its back-off ends. */
static void backoff_alive(hm_moe_client *c, const uint8_t pk[HM_PK_BYTES])
{
    backoff *b = backoff_get(c, pk);
    if (b == NULL)
        return;
    char peer[HM_PEER_ID_LEN + 1];
    hm_peer_id_encode(pk, peer);
    hm_info(MOD, "host %.12s answers again after %u stalls", peer, b->stalls);
    b->used = 0;
    c->n_recovered++;
}

/* A probe ended without a verdict (cancelled, a transport error): the next call probes. */
static void backoff_unprobe(hm_moe_client *c, const uint8_t pk[HM_PK_BYTES], uint64_t now)
{
    backoff *b = backoff_get(c, pk);
    if (b != NULL && b->probing) {
        b->probing = 0;
        b->until_ms = now;
    }
}

void hm_moe_client_backoff_stats(hm_moe_client *c, hm_moe_backoff_stats *out)
{
    memset(out, 0, sizeof(*out));
    if (c == NULL)
        return;
    out->stalls = c->n_stalls;
    out->skipped = c->n_skipped;
    out->recovered = c->n_recovered;
    for (size_t i = 0; c->backoffs != NULL && i < HM_MOE_BACKOFF_HOSTS; i++)
        out->hosts += c->backoffs[i].used != 0;
}

size_t hm_moe_client_backoffs(hm_moe_client *c, hm_moe_backoff_host *out, size_t max)
{
    size_t n = 0;
    uint64_t now = hm_now_ms();
    for (size_t i = 0; c != NULL && c->backoffs != NULL && i < HM_MOE_BACKOFF_HOSTS && n < max;
         i++) {
        const backoff *b = &c->backoffs[i];
        if (!b->used)
            continue;
        memcpy(out[n].pk, b->pk, HM_PK_BYTES);
        out[n].left_ms = b->probing || now >= b->until_ms ? 0 : b->until_ms - now;
        out[n].period_ms = b->period_ms;
        out[n].stalls = b->stalls;
        n++;
    }
    return n;
}

static double wall_s(void) { return (double)hm_wall_us() / 1e6; }

int hm_moe_client_set_policy(hm_moe_client *c, const hm_moe_client_policy *p)
{
    if (c == NULL || p == NULL || !(p->record_max_ttl_s >= 0) || p->record_max_ttl_s > 86400)
        return -EINVAL;
    uint64_t bo = p->backoff_ms > 0 ? p->backoff_ms : HM_MOE_BACKOFF_MS;
    uint64_t bmax = p->backoff_max_ms > 0 ? p->backoff_max_ms : HM_MAX(HM_MOE_BACKOFF_MAX_MS, bo);
    if (bo > 86400000 || bmax > 86400000 || bmax < bo)
        return -EINVAL;
    c->backoff_ms = bo;
    c->backoff_max_ms = bmax;
    c->max_ttl_s = p->record_max_ttl_s > 0 ? p->record_max_ttl_s : HM_MOE_RECORD_MAX_TTL_S;
    c->any_holder = p->any_holder;
    c->allow = p->allow;
    return 0;
}

void hm_moe_client_limits(hm_moe_client *c, hm_limit_emit_fn emit, void *ud)
{
    if (c == NULL)
        return;
    emit(ud, "ExpertRecordMaxTtl", c->refused_ttl);
    emit(ud, "ExpertHostsFile", c->refused_allow);
    emit(ud, "ExpertOneHolder", c->refused_holder);
}

static int map_get_status(int status)
{
    /* No replica answering at all is a failed lookup, not an absent key. */
    return status == -EHOSTUNREACH ? -ETIMEDOUT : status;
}

static void lookup_cb(void *ud, int status, const hm_dht_value *values, size_t n,
                      const hm_dht_lookup_info *info)
{
    find_op *f = ud;
    HM_UNUSED(info);
    if (f->c == NULL) { /* detached: the caller has heard -ECANCELED already */
        find_free(f);
        return;
    }
    if (status < 0) {
        find_finish(f, map_get_status(status), NULL, 0);
        return;
    }
    hm_moe_client *c = f->c;
    hm_moe_expert best;
    memset(&best, 0, sizeof(best));
    double best_exp = -INFINITY, now = wall_s();
    int64_t best_held = -1;
    size_t found = 0;
    size_t uid_len = strlen(f->uid);
    for (size_t i = 0; i < n; i++) {
        const hm_dht_record *r = &values[i].rec;
        hm_moe_expert ex;
        char addr[HM_MOE_ADDR_MAX + 1], type[HM_MOE_TYPE_MAX + 1];
        size_t dim;
        if (r->key_len != uid_len || memcmp(r->key, f->uid, uid_len) != 0 || !r->has_subkey)
            continue;
        memset(&ex, 0, sizeof(ex));
        if (parse_owner_subkey(r->subkey, r->subkey_len, ex.pk) != 0)
            continue;
        /* Empty (withdrawn) and malformed declarations are skipped alike. */
        if (hm_moe_decode_expert_value(r->value, r->value_len, addr, type, &dim) != 0)
            continue;
        if (!decl_admit(c, f->uid, ex.pk, r->expiration, now))
            continue;
        if (expert_set_addr(&ex, addr) != 0)
            continue;
        if (found > 0 && !decl_better(c, f->uid, ex.pk, r->expiration, values[i].held_s, best.pk,
                                      best_exp, best_held)) {
            found++;
            continue;
        }
        memcpy(ex.uid, f->uid, uid_len + 1);
        best = ex;
        best_exp = r->expiration;
        best_held = values[i].held_s;
        found++;
    }
    if (found) {
        holder_note(c, f->uid, best.pk, found - 1);
        find_finish(f, 0, &best, 1);
    } else {
        holder_forget(c, f->uid);
        find_finish(f, -ENOENT, NULL, 0);
    }
}

int hm_moe_lookup(hm_moe_client *c, const char *uid, uint64_t timeout_ms, hm_moe_find_cb cb,
                  void *ud)
{
    hm_moe_uid u;
    if (c == NULL || uid == NULL || cb == NULL || timeout_ms == 0)
        return -EINVAL;
    size_t len = strnlen(uid, HM_MOE_UID_MAX + 1);
    if (len > HM_MOE_UID_MAX || hm_moe_uid_parse(uid, len, &u) != 0)
        return -EINVAL;
    find_op *f = calloc(1, sizeof(*f));
    if (f == NULL)
        return -ENOMEM;
    f->kind = FIND_LOOKUP;
    f->cb = cb;
    f->ud = ud;
    memcpy(f->uid, uid, len);
    f->uid[len] = '\0';
    int r = hm_node_dht_get(c->node, (const uint8_t *)f->uid, len, timeout_ms, lookup_cb, f);
    if (r < 0) {
        find_free(f);
        return r;
    }
    find_link(c, f);
    return 0;
}

/* ----------------------------------------------------------- beam search */

/* Whether a ranks before b: higher score, then the smaller name (so that the
 * result does not depend on the order replies came in). */
static int ent_better(const beam_ent *a, const beam_ent *b)
{
    if (a->score != b->score)
        return a->score > b->score;
    return strcmp(a->name, b->name) < 0;
}

/*
 * Offers a candidate to a sorted array of at most cap entries. A name
 * already present is not added twice; for experts the fresher declaration
 * replaces the older one (same name, hence same score and place).
 */
static void ent_offer(hm_moe_client *c, beam_ent *arr, size_t *n, size_t cap,
                      const beam_ent *cand, int experts)
{
    for (size_t i = 0; i < *n; i++) {
        if (strcmp(arr[i].name, cand->name) == 0) {
            arr[i].n_owners++;
            /* Only an expert's host matters: a grid prefix entry says that
             * the coordinate exists, and every owner's entry says the same. */
            if (experts ? decl_better(c, cand->name, cand->ex.pk, cand->expiration,
                                      cand->held_s, arr[i].ex.pk, arr[i].expiration,
                                      arr[i].held_s)
                        : cand->expiration > arr[i].expiration) {
                unsigned k = arr[i].n_owners;
                arr[i] = *cand;
                arr[i].n_owners = k;
            }
            return;
        }
    }
    size_t pos = *n;
    while (pos > 0 && ent_better(cand, &arr[pos - 1]))
        pos--;
    if (pos >= cap)
        return;
    size_t last = *n < cap ? *n : cap - 1;
    memmove(&arr[pos + 1], &arr[pos], (last - pos) * sizeof(*arr));
    arr[pos] = *cand;
    if (*n < cap)
        (*n)++;
}

static void beam_finish(find_op *f)
{
    hm_moe_expert out[HM_MOE_MAX_K];
    size_t n = 0;
    uint64_t now = hm_now_ms();
    /*
     * At the last level next_beam holds the experts, best first (up to
     * twice k_best of them): those on hosts in good standing come first,
     * then the backed-off ones fill what is left (client.h).
     */
    for (int pass = 0; pass < 2 && f->c != NULL; pass++)
        for (size_t i = 0; i < f->n_next && n < f->k_best; i++) {
            int off = backoff_state(f->c, f->next_beam[i].ex.pk, now) == HOST_BACKED_OFF;
            if (off == pass)
                out[n++] = f->next_beam[i].ex;
        }
    int status = 0;
    if (n == 0)
        status = f->failed_gets ? -ETIMEDOUT : -ENOENT;
    find_finish(f, status, out, n);
}

static int beam_request(find_op *f);

/* Reads one key's dictionary into the level's candidates. */
static void beam_take(find_op *f, const beam_ent *parent, const hm_dht_value *values, size_t n)
{
    int last = f->level + 1 == f->ndims;
    size_t plen = strlen(parent->name);
    double now = wall_s();
    for (size_t i = 0; i < n; i++) {
        const hm_dht_record *r = &values[i].rec;
        uint32_t coord;
        beam_ent cand;
        char uid[HM_MOE_UID_MAX + 1], addr[HM_MOE_ADDR_MAX + 1];
        hm_moe_uid u;

        if (!r->has_subkey || r->key_len != plen || memcmp(r->key, parent->name, plen) != 0)
            continue;
        memset(&cand.ex, 0, sizeof(cand.ex));
        if (hm_moe_parse_prefix_subkey(r->subkey, r->subkey_len, &coord, cand.ex.pk) != 0)
            continue;
        if (coord >= f->grid[f->level])
            continue;
        if (hm_moe_decode_prefix_value(r->value, r->value_len, uid, addr) != 0)
            continue; /* withdrawn or malformed */
        int w = snprintf(cand.name, sizeof(cand.name), "%s%" PRIu32 "%s", parent->name, coord,
                         last ? "" : ".");
        if (w < 0 || (size_t)w >= sizeof(cand.name))
            continue;
        /* The entry's expert must lie below the prefix it is listed under
         * (at the last level: be exactly the uid it names). */
        size_t clen = (size_t)w;
        size_t ulen = strlen(uid);
        if (hm_moe_uid_parse(uid, ulen, &u) != 0 || u.ndims != f->ndims)
            continue;
        if (last ? strcmp(uid, cand.name) != 0 : strncmp(uid, cand.name, clen) != 0)
            continue;
        if (!decl_admit(f->c, cand.name, cand.ex.pk, r->expiration, now))
            continue;
        cand.score = parent->score + f->scores[f->level][coord];
        cand.expiration = r->expiration;
        cand.held_s = values[i].held_s;
        cand.n_owners = 1;
        if (last) {
            memcpy(cand.ex.uid, uid, ulen + 1);
            cand.ex.score = cand.score;
            if (expert_set_addr(&cand.ex, addr) != 0)
                continue;
        }
        ent_offer(f->c, f->next_beam, &f->n_next, last ? 2 * f->k_best : f->beam_size, &cand,
                  last);
    }
}

static void beam_level_cb(void *ud, const hm_dht_many_result *results, size_t n_keys)
{
    find_op *f = ud;
    if (f->c == NULL) {
        find_free(f);
        return;
    }
    f->n_next = 0;
    for (size_t k = 0; k < n_keys && k < f->n_beam; k++) {
        if (results[k].status < 0) {
            f->failed_gets = 1;
            continue;
        }
        beam_take(f, &f->beam[k], results[k].values, results[k].n);
    }
    /* The experts' chosen hosts become (or stay) the uids' holders. */
    if (f->level + 1 == f->ndims)
        for (size_t i = 0; i < f->n_next; i++)
            holder_note(f->c, f->next_beam[i].name, f->next_beam[i].ex.pk,
                        f->next_beam[i].n_owners - 1);
    if (f->level + 1 == f->ndims) {
        beam_finish(f);
        return;
    }
    /* The candidates become the next level's beam. */
    beam_ent *t = f->beam;
    f->beam = f->next_beam;
    f->n_beam = f->n_next;
    f->next_beam = t;
    f->n_next = 0;
    f->level++;
    if (f->n_beam == 0 || hm_now_ms() >= f->deadline_ms) {
        if (f->n_beam > 0)
            f->failed_gets = 1;
        beam_finish(f);
        return;
    }
    int r = beam_request(f);
    if (r < 0) {
        f->failed_gets = 1;
        f->n_next = 0;
        beam_finish(f);
    }
}

/* Starts the get_many for the current beam. */
static int beam_request(find_op *f)
{
    const uint8_t *keys[BEAM_MAX];
    size_t lens[BEAM_MAX];
    for (size_t i = 0; i < f->n_beam; i++) {
        keys[i] = (const uint8_t *)f->beam[i].name;
        lens[i] = strlen(f->beam[i].name);
    }
    uint64_t now = hm_now_ms();
    uint64_t left = f->deadline_ms > now ? f->deadline_ms - now : 1;
    hm_moe_client *c = f->c;
    return hm_node_dht_get_many(c->node, keys, lens, f->n_beam, left, beam_level_cb, f);
}

int hm_moe_beam_search(hm_moe_client *c, const char *prefix, const double *const *scores,
                       const size_t *grid_sizes, size_t ndims, size_t k_best, size_t beam_size,
                       uint64_t timeout_ms, hm_moe_find_cb cb, void *ud)
{
    int result = 0;
    find_op *f = NULL;
    char probe[HM_MOE_PREFIX_MAX + 8];
    hm_moe_uid u;

    if (c == NULL || prefix == NULL || scores == NULL || grid_sizes == NULL || cb == NULL ||
        timeout_ms == 0)
        return -EINVAL;
    if (ndims < 1 || ndims > HM_MOE_MAX_GRID_DIMS || k_best < 1 || k_best > HM_MOE_MAX_K)
        return -EINVAL;
    if (beam_size == 0)
        beam_size = k_best;
    if (beam_size > BEAM_MAX)
        return -EINVAL;
    /* A grid name, or Hivemind's form of it with the dot ("ffn."). */
    int nl = hm_moe_name_check(prefix, strnlen(prefix, HM_MOE_PREFIX_MAX + 2), NULL, 0);
    if (nl < 0)
        return -EINVAL;
    size_t plen = (size_t)nl;
    snprintf(probe, sizeof(probe), "%.*s.0", nl, prefix);
    if (hm_moe_uid_parse(probe, strlen(probe), &u) != 0)
        return -EINVAL;
    for (size_t d = 0; d < ndims; d++) {
        if (scores[d] == NULL || grid_sizes[d] < 1 || grid_sizes[d] > HM_MOE_MAX_GRID)
            return -EINVAL;
        for (size_t i = 0; i < grid_sizes[d]; i++)
            if (!isfinite(scores[d][i]))
                return -EINVAL;
    }

    f = calloc(1, sizeof(*f));
    if (f == NULL)
        return -ENOMEM;
    f->kind = FIND_BEAM;
    f->cb = cb;
    f->ud = ud;
    memcpy(f->prefix, prefix, plen);
    f->prefix[plen] = '\0';
    f->ndims = ndims;
    f->k_best = k_best;
    f->beam_size = beam_size;
    f->deadline_ms = hm_now_ms() + timeout_ms;
    for (size_t d = 0; d < ndims; d++) {
        f->grid[d] = grid_sizes[d];
        f->scores[d] = malloc(grid_sizes[d] * sizeof(double));
        if (f->scores[d] == NULL) {
            result = -ENOMEM;
            goto out;
        }
        memcpy(f->scores[d], scores[d], grid_sizes[d] * sizeof(double));
    }
    /* Both arrays must hold a level of prefixes and the final experts
     * (twice k_best, so that backed-off hosts can be passed over). */
    size_t cap = HM_MAX(beam_size, 2 * k_best);
    f->beam = calloc(cap, sizeof(beam_ent));
    f->next_beam = calloc(cap, sizeof(beam_ent));
    if (f->beam == NULL || f->next_beam == NULL) {
        result = -ENOMEM;
        goto out;
    }
    snprintf(f->beam[0].name, sizeof(f->beam[0].name), "%s.", f->prefix);
    f->beam[0].score = 0;
    f->n_beam = 1;
    f->c = c;
    if ((result = beam_request(f)) < 0) {
        f->c = NULL;
        goto out;
    }
    find_link(c, f);
    f = NULL;
out:
    find_free(f);
    return result;
}

/* ----------------------------------------------------- per-sample routing */

/*
 * A routed search keeps one beam per sample but reads the DHT once per
 * level for all of them: the level's keys are the union of the prefixes
 * in the samples' beams, fetched in get_many's of up to BEAM_MAX keys that
 * run at once. Each key's dictionary is read once into its children (one
 * per coordinate, the declaration the policy believes); every sample then
 * scores the children of its own beam with its own gate scores.
 */

/* Keys one level of a routed search may read (checked from the grid before it starts). */
#define ROUTE_MAX_KEYS 4096

typedef struct route_child {
    beam_ent ent;
    uint32_t coord;
} route_child;

/* A beam entry of one sample: ref is a key (beam) or a child (next) of the level. */
typedef struct route_pick {
    uint32_t ref;
    double score;
} route_pick;

typedef struct route_chunk {
    route_op *op;
    size_t first, n; /* keys[first .. first + n) */
} route_chunk;

struct route_op {
    hm_moe_client *c; /* NULL once detached */
    LIST_ENTRY(route_op) link;
    hm_moe_route_cb cb;
    void *ud;
    size_t ndims, batch, k_best, beam_size, cap;
    size_t grid[HM_MOE_MAX_GRID_DIMS], off[HM_MOE_MAX_GRID_DIMS], total;
    double *scores; /* [batch, total] */
    uint64_t deadline_ms;
    unsigned level;
    int failed_gets;
    char (*keys)[HM_MOE_UID_MAX + 1]; /* this level's keys */
    size_t n_keys;
    route_chunk *chunks;
    size_t chunks_left;  /* get_many's in flight */
    route_child **kids;  /* [n_keys]: each key's children */
    size_t *n_kids;      /* [n_keys] */
    size_t *kid_base;    /* [n_keys]: the global index of each key's first child */
    route_pick *beam, *next; /* [batch * cap] */
    size_t *n_beam, *n_next; /* [batch] */
};

static void route_kids_free(route_op *r)
{
    for (size_t i = 0; r->kids != NULL && i < r->n_keys; i++)
        free(r->kids[i]);
    free(r->kids);
    free(r->n_kids);
    free(r->kid_base);
    r->kids = NULL;
    r->n_kids = NULL;
    r->kid_base = NULL;
}

static void route_free(route_op *r)
{
    if (r == NULL)
        return;
    route_kids_free(r);
    free(r->scores);
    free(r->keys);
    free(r->chunks);
    free(r->beam);
    free(r->next);
    free(r->n_beam);
    free(r->n_next);
    free(r);
}

static void route_unlink(route_op *r)
{
    if (r->c == NULL)
        return;
    LIST_REMOVE(r, link);
    r->c = NULL;
}

static void route_report(route_op *r, int status, const hm_moe_expert *ex, size_t n,
                         const int32_t *routes)
{
    route_unlink(r);
    r->cb(r->ud, status, ex, n, routes, r->batch, r->k_best);
    route_free(r);
}

/* Reads key kk's dictionary into its children, one per coordinate. */
static void route_take(route_op *r, size_t kk, const hm_dht_value *values, size_t n)
{
    int last = r->level + 1 == r->ndims;
    const char *parent = r->keys[kk];
    size_t plen = strlen(parent);
    double now = wall_s();
    route_child *kids = n > 0 ? calloc(n, sizeof(*kids)) : NULL;
    size_t nk = 0;
    if (n > 0 && kids == NULL) {
        r->failed_gets = 1; /* no memory for the key's entries: as if it failed */
        return;
    }
    for (size_t i = 0; i < n; i++) {
        const hm_dht_record *rec = &values[i].rec;
        route_child cand;
        char uid[HM_MOE_UID_MAX + 1], addr[HM_MOE_ADDR_MAX + 1];
        hm_moe_uid u;

        if (!rec->has_subkey || rec->key_len != plen || memcmp(rec->key, parent, plen) != 0)
            continue;
        memset(&cand, 0, sizeof(cand));
        if (hm_moe_parse_prefix_subkey(rec->subkey, rec->subkey_len, &cand.coord,
                                       cand.ent.ex.pk) != 0)
            continue;
        if (cand.coord >= r->grid[r->level])
            continue;
        if (hm_moe_decode_prefix_value(rec->value, rec->value_len, uid, addr) != 0)
            continue; /* withdrawn or malformed */
        int w = snprintf(cand.ent.name, sizeof(cand.ent.name), "%s%" PRIu32 "%s", parent,
                         cand.coord, last ? "" : ".");
        if (w < 0 || (size_t)w >= sizeof(cand.ent.name))
            continue;
        size_t ulen = strlen(uid);
        if (hm_moe_uid_parse(uid, ulen, &u) != 0 || u.ndims != r->ndims)
            continue;
        if (last ? strcmp(uid, cand.ent.name) != 0 : strncmp(uid, cand.ent.name, (size_t)w) != 0)
            continue;
        if (!decl_admit(r->c, cand.ent.name, cand.ent.ex.pk, rec->expiration, now))
            continue;
        cand.ent.expiration = rec->expiration;
        cand.ent.held_s = values[i].held_s;
        cand.ent.n_owners = 1;
        if (last) {
            memcpy(cand.ent.ex.uid, uid, ulen + 1);
            if (expert_set_addr(&cand.ent.ex, addr) != 0)
                continue;
        }
        size_t j = 0;
        while (j < nk && kids[j].coord != cand.coord)
            j++;
        if (j == nk) {
            kids[nk++] = cand;
            continue;
        }
        /* Another owner's entry of the same name (as ent_offer decides). */
        kids[j].ent.n_owners++;
        if (last ? decl_better(r->c, cand.ent.name, cand.ent.ex.pk, cand.ent.expiration,
                               cand.ent.held_s, kids[j].ent.ex.pk, kids[j].ent.expiration,
                               kids[j].ent.held_s)
                 : cand.ent.expiration > kids[j].ent.expiration) {
            unsigned owners = kids[j].ent.n_owners;
            kids[j] = cand;
            kids[j].ent.n_owners = owners;
        }
    }
    if (last)
        for (size_t j = 0; j < nk; j++)
            holder_note(r->c, kids[j].ent.name, kids[j].ent.ex.pk, kids[j].ent.n_owners - 1);
    r->kids[kk] = kids;
    r->n_kids[kk] = nk;
}

/* The child with global index g. */
static const route_child *route_kid(const route_op *r, uint32_t g)
{
    /* kid_base is ascending: a binary search finds g's key. */
    size_t lo = 0, hi = r->n_keys;
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (r->kid_base[mid] <= g)
            lo = mid;
        else
            hi = mid;
    }
    return &r->kids[lo][g - r->kid_base[lo]];
}

/* Whether a ranks before b: higher score, then the smaller name. */
static int pick_better(const route_op *r, const route_pick *a, const route_pick *b)
{
    if (a->score != b->score)
        return a->score > b->score;
    return strcmp(route_kid(r, a->ref)->ent.name, route_kid(r, b->ref)->ent.name) < 0;
}

/* Offers a candidate to a sample's sorted list of at most cap picks. */
static void pick_offer(const route_op *r, route_pick *arr, size_t *n, size_t cap,
                       const route_pick *cand)
{
    if (*n == cap && !pick_better(r, cand, &arr[cap - 1]))
        return;
    size_t pos = *n < cap ? *n : cap - 1;
    while (pos > 0 && pick_better(r, cand, &arr[pos - 1])) {
        arr[pos] = arr[pos - 1];
        pos--;
    }
    arr[pos] = *cand;
    if (*n < cap)
        (*n)++;
}

static int route_request(route_op *r);

/*
 * The experts of every sample, from the last level's picks: those on hosts
 * in good standing first, then the backed-off ones (client.h), k_best at
 * most; each distinct expert once in the list, routes indexing it.
 */
static void route_finish(route_op *r)
{
    size_t n_total = r->n_keys > 0 ? r->kid_base[r->n_keys - 1] + r->n_kids[r->n_keys - 1] : 0;
    int32_t *map = n_total > 0 ? malloc(n_total * sizeof(int32_t)) : NULL;
    int32_t *routes = malloc(r->batch * r->k_best * sizeof(int32_t));
    hm_moe_expert *ex = NULL;
    size_t n_ex = 0;
    uint64_t now = hm_now_ms();
    if ((n_total > 0 && map == NULL) || routes == NULL) {
        free(map);
        free(routes);
        route_report(r, -ENOMEM, NULL, 0, NULL);
        return;
    }
    for (size_t i = 0; i < n_total; i++)
        map[i] = -1;
    for (size_t i = 0; i < r->batch * r->k_best; i++)
        routes[i] = -1;
    ex = calloc(HM_MIN(r->batch * r->k_best, (size_t)HM_MOE_MAX_ROUTED), sizeof(*ex));
    if (ex == NULL) {
        free(map);
        free(routes);
        route_report(r, -ENOMEM, NULL, 0, NULL);
        return;
    }
    size_t cap_ex = HM_MIN(r->batch * r->k_best, (size_t)HM_MOE_MAX_ROUTED);
    for (size_t b = 0; b < r->batch; b++) {
        const route_pick *p = r->next + b * r->cap;
        size_t got = 0;
        for (int pass = 0; pass < 2 && r->c != NULL; pass++) {
            for (size_t i = 0; i < r->n_next[b] && got < r->k_best; i++) {
                const route_child *kid = route_kid(r, p[i].ref);
                int off = backoff_state(r->c, kid->ent.ex.pk, now) == HOST_BACKED_OFF;
                if (off != pass)
                    continue;
                if (map[p[i].ref] < 0) {
                    if (n_ex == cap_ex)
                        continue; /* cannot happen under the checks at the start */
                    ex[n_ex] = kid->ent.ex;
                    ex[n_ex].score = 0;
                    map[p[i].ref] = (int32_t)n_ex++;
                }
                routes[b * r->k_best + got++] = map[p[i].ref];
            }
        }
    }
    int status = 0;
    if (n_ex == 0)
        status = r->failed_gets ? -ETIMEDOUT : -ENOENT;
    route_report(r, status, ex, n_ex, routes);
    free(ex);
    free(map);
    free(routes);
}

/* Every key of the level has been read: score, then go down a level or finish. */
static void route_level_done(route_op *r)
{
    int last = r->level + 1 == r->ndims;
    size_t lim = last ? 2 * r->k_best : r->beam_size;
    r->kid_base = malloc((r->n_keys > 0 ? r->n_keys : 1) * sizeof(size_t));
    if (r->kid_base == NULL) {
        route_report(r, -ENOMEM, NULL, 0, NULL);
        return;
    }
    size_t base = 0;
    for (size_t kk = 0; kk < r->n_keys; kk++) {
        r->kid_base[kk] = base;
        base += r->n_kids[kk];
    }
    for (size_t b = 0; b < r->batch; b++) {
        const double *sc = r->scores + b * r->total + r->off[r->level];
        route_pick *nx = r->next + b * r->cap;
        r->n_next[b] = 0;
        for (size_t i = 0; i < r->n_beam[b]; i++) {
            const route_pick *p = &r->beam[b * r->cap + i];
            for (size_t j = 0; j < r->n_kids[p->ref]; j++) {
                route_pick cand = {
                    .ref = (uint32_t)(r->kid_base[p->ref] + j),
                    .score = p->score + sc[r->kids[p->ref][j].coord],
                };
                pick_offer(r, nx, &r->n_next[b], lim, &cand);
            }
        }
    }
    if (last) {
        route_finish(r);
        return;
    }
    /* The picked children become the next level's keys (each once). */
    int32_t *map = base > 0 ? malloc(base * sizeof(int32_t)) : NULL;
    char(*keys)[HM_MOE_UID_MAX + 1] = calloc(ROUTE_MAX_KEYS, sizeof(*keys));
    if ((base > 0 && map == NULL) || keys == NULL) {
        free(map);
        free(keys);
        route_report(r, -ENOMEM, NULL, 0, NULL);
        return;
    }
    for (size_t i = 0; i < base; i++)
        map[i] = -1;
    size_t n_keys = 0;
    for (size_t b = 0; b < r->batch; b++) {
        size_t kept = 0;
        for (size_t i = 0; i < r->n_next[b]; i++) {
            route_pick p = r->next[b * r->cap + i];
            if (map[p.ref] < 0) {
                if (n_keys == ROUTE_MAX_KEYS) {
                    r->failed_gets = 1; /* cannot happen under the checks at the start */
                    continue;
                }
                hm_strlcpy(keys[n_keys], route_kid(r, p.ref)->ent.name, sizeof(keys[0]));
                map[p.ref] = (int32_t)n_keys++;
            }
            r->beam[b * r->cap + kept].ref = (uint32_t)map[p.ref];
            r->beam[b * r->cap + kept].score = p.score;
            kept++;
        }
        r->n_beam[b] = kept;
    }
    free(map);
    route_kids_free(r);
    free(r->keys);
    r->keys = keys;
    r->n_keys = n_keys;
    r->level++;
    if (n_keys == 0 || hm_now_ms() >= r->deadline_ms) {
        if (n_keys > 0)
            r->failed_gets = 1;
        /* Nothing reached the last level: no sample has an expert. */
        r->n_keys = 0;
        for (size_t b = 0; b < r->batch; b++)
            r->n_next[b] = 0;
        route_finish(r);
        return;
    }
    if (route_request(r) < 0) {
        r->failed_gets = 1;
        r->n_keys = 0;
        for (size_t b = 0; b < r->batch; b++)
            r->n_next[b] = 0;
        route_finish(r);
    }
}

static void route_chunk_cb(void *ud, const hm_dht_many_result *results, size_t n_keys)
{
    route_chunk *ch = ud;
    route_op *r = ch->op;
    r->chunks_left--;
    if (r->c == NULL) {
        if (r->chunks_left == 0)
            route_free(r); /* detached: the caller has heard -ECANCELED already */
        return;
    }
    for (size_t i = 0; i < ch->n && i < n_keys; i++) {
        if (results[i].status < 0) {
            r->failed_gets = 1;
            continue;
        }
        route_take(r, ch->first + i, results[i].values, results[i].n);
    }
    if (r->chunks_left == 0)
        route_level_done(r);
}

/* Starts the get_many's of the level's keys. 0 or an error (nothing started then). */
static int route_request(route_op *r)
{
    const uint8_t *keys[BEAM_MAX];
    size_t lens[BEAM_MAX];
    size_t n_chunks = (r->n_keys + BEAM_MAX - 1) / BEAM_MAX;
    uint64_t now = hm_now_ms();
    uint64_t left = r->deadline_ms > now ? r->deadline_ms - now : 1;

    free(r->chunks);
    r->kids = calloc(r->n_keys, sizeof(*r->kids));
    r->n_kids = calloc(r->n_keys, sizeof(*r->n_kids));
    r->chunks = calloc(n_chunks, sizeof(*r->chunks));
    if (r->kids == NULL || r->n_kids == NULL || r->chunks == NULL)
        return -ENOMEM;
    /*
     * Every chunk counts as in flight before the first is sent, so that a
     * chunk answered at once cannot end the level early; a chunk that
     * cannot be sent ends its count and marks the search as having failed
     * a read, as a failed get would.
     */
    r->chunks_left = n_chunks + 1;
    size_t started = 0;
    for (size_t ci = 0; ci < n_chunks; ci++) {
        route_chunk *ch = &r->chunks[ci];
        ch->op = r;
        ch->first = ci * BEAM_MAX;
        ch->n = HM_MIN((size_t)BEAM_MAX, r->n_keys - ch->first);
        for (size_t i = 0; i < ch->n; i++) {
            keys[i] = (const uint8_t *)r->keys[ch->first + i];
            lens[i] = strlen(r->keys[ch->first + i]);
        }
        if (hm_node_dht_get_many(r->c->node, keys, lens, ch->n, left, route_chunk_cb, ch) == 0) {
            started++;
        } else {
            r->failed_gets = 1;
            r->chunks_left--;
        }
    }
    if (started == 0) {
        r->chunks_left = 0;
        return -EHOSTUNREACH;
    }
    /* The extra count: the level ends here if every chunk came back already. */
    if (--r->chunks_left == 0)
        route_level_done(r);
    return 0;
}

int hm_moe_route(hm_moe_client *c, const char *prefix, const float *scores, size_t batch,
                 const size_t *grid_sizes, size_t ndims, size_t k_best, size_t beam_size,
                 uint64_t timeout_ms, hm_moe_route_cb cb, void *ud)
{
    int result = 0;
    route_op *r = NULL;
    char probe[HM_MOE_PREFIX_MAX + 8];
    hm_moe_uid u;

    if (c == NULL || prefix == NULL || scores == NULL || grid_sizes == NULL || cb == NULL ||
        timeout_ms == 0)
        return -EINVAL;
    if (ndims < 1 || ndims > HM_MOE_MAX_GRID_DIMS || k_best < 1 || k_best > HM_MOE_MAX_K ||
        batch < 1 || batch > HM_MOE_MAX_BATCH)
        return -EINVAL;
    if (beam_size == 0)
        beam_size = k_best;
    if (beam_size > BEAM_MAX)
        return -EINVAL;
    size_t plen = strnlen(prefix, HM_MOE_PREFIX_MAX + 1);
    if (plen > HM_MOE_PREFIX_MAX)
        return -EINVAL;
    snprintf(probe, sizeof(probe), "%s.0", prefix);
    if (hm_moe_uid_parse(probe, strlen(probe), &u) != 0)
        return -EINVAL;
    size_t total = 0;
    for (size_t d = 0; d < ndims; d++) {
        if (grid_sizes[d] < 1 || grid_sizes[d] > HM_MOE_MAX_GRID)
            return -EINVAL;
        total += grid_sizes[d];
    }
    /*
     * The keys of a level are at most the prefixes the grid has there and
     * at most one per beam entry of every sample; the experts chosen at
     * most the grid's and k_best per sample. Both are bounded up front so
     * that a search never has to drop what it found.
     */
    double prefixes = 1;
    for (size_t d = 0; d < ndims; d++) {
        if (HM_MIN(prefixes, (double)batch * (double)beam_size) > ROUTE_MAX_KEYS)
            return -E2BIG;
        prefixes *= (double)grid_sizes[d];
    }
    if (HM_MIN(prefixes, (double)batch * (double)k_best) > HM_MOE_MAX_ROUTED)
        return -E2BIG;
    for (size_t i = 0; i < batch * total; i++)
        if (!isfinite(scores[i]))
            return -EINVAL;

    r = calloc(1, sizeof(*r));
    if (r == NULL)
        return -ENOMEM;
    r->cb = cb;
    r->ud = ud;
    r->ndims = ndims;
    r->batch = batch;
    r->k_best = k_best;
    r->beam_size = beam_size;
    r->cap = HM_MAX(beam_size, 2 * k_best);
    r->total = total;
    for (size_t d = 0, at = 0; d < ndims; d++) {
        r->grid[d] = grid_sizes[d];
        r->off[d] = at;
        at += grid_sizes[d];
    }
    r->deadline_ms = hm_now_ms() + timeout_ms;
    r->scores = malloc(batch * total * sizeof(double));
    r->keys = calloc(1, sizeof(*r->keys));
    r->beam = calloc(batch * r->cap, sizeof(*r->beam));
    r->next = calloc(batch * r->cap, sizeof(*r->next));
    r->n_beam = calloc(batch, sizeof(size_t));
    r->n_next = calloc(batch, sizeof(size_t));
    if (r->scores == NULL || r->keys == NULL || r->beam == NULL || r->next == NULL ||
        r->n_beam == NULL || r->n_next == NULL) {
        result = -ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < batch * total; i++)
        r->scores[i] = scores[i];
    snprintf(r->keys[0], sizeof(r->keys[0]), "%s.", prefix);
    r->n_keys = 1;
    for (size_t b = 0; b < batch; b++) {
        r->beam[b * r->cap].ref = 0;
        r->beam[b * r->cap].score = 0;
        r->n_beam[b] = 1;
    }
    r->c = c;
    LIST_INSERT_HEAD(&c->routes, r, link);
    if ((result = route_request(r)) < 0) {
        route_unlink(r);
        goto out;
    }
    r = NULL;
out:
    route_free(r);
    return result;
}

/* ---------------------------------------------------------- expert calls */

/* The largest request (a backward at HM_MOE_MAX_ELEMS) must fit the transport's default frame. */
_Static_assert(HM_MOE_MAX_FRAME <= (size_t)80 << 20,
               "a backward frame at HM_MOE_MAX_ELEMS exceeds the transport's max_message");

typedef struct slot {
    call *call;
    size_t e;
    uint64_t rpc_id;
    int pending; /* an rpc call is in flight */
    int status;  /* how it ended (hm_moe_call_error.status) */
    int refused; /* the server answered with an error and its reason */
    uint8_t pk[HM_PK_BYTES]; /* the host, for its back-off */
    size_t n_rows; /* rows sent to the expert (0: routed to no sample, not called) */
    size_t row0;   /* routed calls: its first row in the call's row tables */
} slot;

/*
 * An expert call. A per-batch call sends the whole batch to each of its k
 * experts and counts answers for the batch as one; a routed call sends
 * each expert only the rows routed to it (gathered into xg, gyg, grouped
 * by expert) and counts answers per sample. Both count through the same
 * tables: need[s] answers are wanted for sample s (a per-batch call has
 * one "sample", the batch), got[s] came, and n_short samples still lack
 * theirs.
 */
struct call {
    hm_moe_client *c; /* NULL once the call has left c->calls */
    LIST_ENTRY(call) link;
    uint64_t id;
    int backward;
    int routed;
    int done;
    size_t k, k_min, batch, dim;
    size_t seq; /* 0: x is [batch, dim]; else batch rows are batch / seq sequences */
    const uint8_t *mask; /* the caller's key-padding mask (seq calls), or NULL */
    size_t sdim;   /* routed over sequences: the experts' dim; dim is then seq * sdim, a
                      row of the gathered buffers one whole sequence */
    uint8_t *maskg; /* routed over sequences with a mask: seq bytes a gathered row */
    size_t per;  /* routed: slots per sample in the caller's out */
    uint64_t timeout_after_k_min_ms;
    float *out; /* per batch: [k, batch, dim]; routed: [batch, per, dim] */
    hm_moe_call_cb cb;
    void *ud;
    size_t n_pending, n_answered;
    size_t n_cancelled; /* slots the rpc layer ended with -ECANCELED (the node closing) */
    uint8_t *answered;  /* [k] */
    hm_moe_call_error *errs; /* the caller's, or NULL */
    const float *x, *gy;     /* the caller's, for experts called late */
    uint64_t deadline_ms;
    hm_moe_expert *skipped;  /* [k] copies, where some expert was left out; else NULL */
    size_t n_skipped;        /* experts left out and not called since */
    slot *slots;             /* [k] */
    size_t n_samples;        /* 1 for a per-batch call, batch for a routed one */
    uint32_t *need, *got;    /* [n_samples] */
    size_t n_short;          /* samples with got < need */
    uint32_t *row_src;       /* routed: [rows] the sample of each row, grouped by expert */
    uint32_t *row_dst;       /* routed: [rows] its row in out (b * per + j) */
    float *xg, *gyg, *outg;  /* routed: [rows, dim] gathered inputs and the replies */
    uv_timer_t timer;      /* the overall timeout (or a deferred finish) */
    uv_timer_t kmin_timer; /* timeout_after_k_min, from the k_min-th answer */
    int handles_open;
};

static void call_free(call *k)
{
    if (k == NULL)
        return;
    free(k->skipped);
    free(k->slots);
    free(k->answered);
    free(k->need);
    free(k->got);
    free(k->row_src);
    free(k->row_dst);
    free(k->xg);
    free(k->gyg);
    free(k->maskg);
    free(k->outg);
    free(k);
}

static void call_unlink(call *k)
{
    if (k->c == NULL)
        return;
    LIST_REMOVE(k, link);
    k->c = NULL;
}

static void call_handle_closed(uv_handle_t *h)
{
    call *k = h->data;
    if (--k->handles_open == 0)
        call_free(k);
}

/* Expert e's input rows, gradients (backward) and reply block. */
static const float *slot_x(const call *k, size_t e)
{
    return k->routed ? k->xg + k->slots[e].row0 * k->dim : k->x;
}

static const float *slot_gy(const call *k, size_t e)
{
    return k->routed ? k->gyg + k->slots[e].row0 * k->dim : k->gy + e * k->batch * k->dim;
}

static float *slot_out(const call *k, size_t e)
{
    return k->routed ? k->outg + k->slots[e].row0 * k->dim : k->out + e * k->batch * k->dim;
}

/* Counts expert e's answer for its samples; a routed reply goes to its rows of out. */
static void slot_answered(call *k, size_t e)
{
    slot *s = &k->slots[e];
    k->answered[e] = 1;
    k->n_answered++;
    if (!k->routed) {
        if (++k->got[0] == k->need[0])
            k->n_short--;
        return;
    }
    for (size_t r = s->row0; r < s->row0 + s->n_rows; r++) {
        memcpy(k->out + (size_t)k->row_dst[r] * k->dim, k->outg + r * k->dim,
               k->dim * sizeof(float));
        uint32_t b = k->row_src[r];
        if (++k->got[b] == k->need[b])
            k->n_short--;
    }
}

static void slot_cb(void *ud, int status, const uint8_t *body, size_t len);

/*
 * Sends expert e its request. 0 when it is in flight, -ENOMEM, or another
 * error, after which the expert counts as not answering.
 */
static int slot_send(call *k, size_t e, const hm_moe_expert *ex, uint64_t timeout_ms,
                     uint64_t now)
{
    hm_moe_client *c = k->c;
    slot *s = &k->slots[e];
    hm_wire_wr w;

    if (backoff_state(c, ex->pk, now) == HOST_DUE)
        backoff_probe(c, ex->pk, now, timeout_ms);
    hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
    const uint8_t *gm = k->maskg != NULL ? k->maskg + s->row0 * k->seq : NULL;
    if (k->seq != 0 && k->routed && k->backward)
        hm_moe_encode_bwd_mask(&w, ex->uid, slot_x(k, e), gm, slot_gy(k, e), s->n_rows, k->seq,
                               k->sdim);
    else if (k->seq != 0 && k->routed)
        hm_moe_encode_fwd_mask(&w, ex->uid, slot_x(k, e), gm, s->n_rows, k->seq, k->sdim);
    else if (k->seq != 0 && k->backward)
        hm_moe_encode_bwd_mask(&w, ex->uid, slot_x(k, e), k->mask, slot_gy(k, e),
                               k->batch / k->seq, k->seq, k->dim);
    else if (k->seq != 0)
        hm_moe_encode_fwd_mask(&w, ex->uid, slot_x(k, e), k->mask, k->batch / k->seq, k->seq,
                               k->dim);
    else if (k->backward)
        hm_moe_encode_bwd(&w, ex->uid, slot_x(k, e), slot_gy(k, e), s->n_rows, k->dim);
    else
        hm_moe_encode_fwd(&w, ex->uid, slot_x(k, e), s->n_rows, k->dim);
    int r = hm_wire_wr_error(&w);
    if (r == 0)
        r = hm_rpc_call(c->rpc, ex->pk, (const struct sockaddr *)&ex->addr,
                        k->backward ? HM_MOE_METHOD_BWD : HM_MOE_METHOD_FWD, w.buf, w.len,
                        HM_RPC_STREAM, timeout_ms, slot_cb, s, &s->rpc_id);
    hm_wire_wr_free(&w);
    if (r == 0) {
        s->pending = 1;
        s->status = 0;
        k->n_pending++;
        return 0;
    }
    s->status = r;
    backoff_unprobe(c, ex->pk, now);
    /* An expert we cannot even send to counts as not answering. */
    hm_debug(MOD, "cannot call %s at %s: %s", ex->uid, ex->addr_str, hm_strerror(r));
    return r;
}

/*
 * The experts called could not make k_min: the ones left out for their
 * hosts' back-off are called after all, with the time that is left, since
 * the call cannot succeed otherwise. Returns how many are now in flight.
 */
static size_t call_unskip(call *k)
{
    uint64_t now = hm_now_ms();
    uint64_t left = k->deadline_ms > now ? k->deadline_ms - now : 1;
    for (size_t e = 0; k->skipped != NULL && e < k->k && k->n_skipped > 0; e++) {
        if (k->slots[e].status != -EAGAIN || k->slots[e].pending)
            continue;
        k->n_skipped--;
        if (k->errs != NULL)
            k->errs[e].msg[0] = '\0';
        (void)slot_send(k, e, &k->skipped[e], left, now);
    }
    return k->n_pending;
}

/*
 * Ends a call: cancels what is still in flight (those callbacks fire here
 * and see done), reports once, and closes the timers, whose close
 * callback frees the call. waited: the call ended at one of its timers,
 * so an expert still pending made it wait, and its host is backed off.
 */
static void call_finish_waited(call *k, int status, int waited)
{
    if (k->done)
        return;
    k->done = 1;
    hm_moe_client *c = k->c;
    hm_rpc *rpc = c->rpc;
    uint64_t now = hm_now_ms();
    call_unlink(k);
    for (size_t e = 0; e < k->k; e++) {
        slot *s = &k->slots[e];
        if (!s->pending)
            continue;
        s->status = waited ? -ETIMEDOUT : -ECANCELED;
        if (waited && status != -ECANCELED)
            backoff_stall(c, s->pk, now);
        else
            backoff_unprobe(c, s->pk, now);
        (void)hm_rpc_cancel(rpc, s->rpc_id);
    }
    if (k->errs != NULL)
        for (size_t e = 0; e < k->k; e++)
            k->errs[e].status = k->answered[e] ? 0 : k->slots[e].status;
    uv_timer_stop(&k->timer);
    uv_timer_stop(&k->kmin_timer);
    uv_close((uv_handle_t *)&k->timer, call_handle_closed);
    uv_close((uv_handle_t *)&k->kmin_timer, call_handle_closed);
    k->cb(k->ud, status, k->answered, k->n_answered);
}

static void call_finish(call *k, int status)
{
    call_finish_waited(k, status, 0);
}

static void call_timeout_cb(uv_timer_t *t)
{
    call *k = t->data;
    call_finish_waited(k, k->n_short == 0 ? 0 : -ETIMEDOUT, k->n_pending > 0);
}

static void call_kmin_cb(uv_timer_t *t)
{
    call_finish_waited(t->data, 0, 1);
}

/*
 * Why a call with fewer than k_min answers failed, once nothing is in
 * flight: a timeout if any expert timed out (or none said why), else the
 * first refusal's code, so that a wrong width reads as a wrong width.
 */
static int call_failure(const call *k)
{
    int first = 0;
    for (size_t e = 0; e < k->k; e++) {
        const slot *s = &k->slots[e];
        if (k->answered[e] || s->n_rows == 0)
            continue;
        if (s->status == -ETIMEDOUT)
            return -ETIMEDOUT;
        if (s->refused && first == 0)
            first = s->status;
    }
    return first != 0 ? first : -ETIMEDOUT;
}

static void slot_cb(void *ud, int status, const uint8_t *body, size_t len)
{
    slot *s = ud;
    call *k = s->call;
    s->pending = 0;
    k->n_pending--;
    if (k->done)
        return;
    hm_moe_client *c = k->c;
    size_t short_before = k->n_short;
    s->status = status;
    if (status == -ECANCELED)
        k->n_cancelled++;
    if (status == 0) {
        int r = k->seq != 0 && k->routed
                    ? hm_moe_decode_out_seq(body, len, k->backward, s->n_rows, k->seq, k->sdim,
                                            slot_out(k, s->e))
                : k->seq != 0 ? hm_moe_decode_out_seq(body, len, k->backward, k->batch / k->seq,
                                                    k->seq, k->dim, slot_out(k, s->e))
                            : hm_moe_decode_out(body, len, k->backward, s->n_rows, k->dim,
                                                slot_out(k, s->e));
        if (r == 0) {
            slot_answered(k, s->e);
        } else {
            s->status = r;
            if (k->errs != NULL)
                snprintf(k->errs[s->e].msg, sizeof(k->errs[s->e].msg), "a bad reply (%s)",
                         hm_strerror(r));
            hm_debug(MOD, "call %" PRIu64 ": expert %zu sent a bad reply (%s)", k->id, s->e,
                     hm_strerror(r));
        }
        backoff_alive(c, s->pk);
    } else if (status == -ETIMEDOUT) {
        backoff_stall(c, s->pk, hm_now_ms());
    } else if (len > 0) {
        /* An error reply with the server's reason: the host is alive and
         * said what was wrong; the caller hears it (client.h). */
        s->refused = 1;
        if (k->errs != NULL)
            hm_moe_decode_error(body, len, k->errs[s->e].msg);
        backoff_alive(c, s->pk);
    } else {
        backoff_unprobe(c, s->pk, hm_now_ms());
    }
    if (k->n_pending == 0 && k->n_short > 0 && k->n_cancelled == 0 && k->n_skipped > 0 &&
        call_unskip(k) > 0)
        return;
    if (k->n_pending == 0) {
        /*
         * Our calls are only cancelled under us when the node closes (the
         * call's own cancel marks it done first): that is -ECANCELED, not
         * a timeout.
         */
        int fail = k->n_cancelled > 0 ? -ECANCELED : call_failure(k);
        call_finish(k, k->n_short == 0 ? 0 : fail);
        return;
    }
    if (short_before > 0 && k->n_short == 0) {
        if (k->timeout_after_k_min_ms == 0)
            call_finish(k, 0);
        else
            uv_timer_start(&k->kmin_timer, call_kmin_cb, k->timeout_after_k_min_ms, 0);
    }
}

/*
 * Routed calls: groups the rows by expert (counting sort over the routes),
 * gathers each expert's inputs, and sets what each sample needs:
 * min(k_min, the experts routed to it). 0, -EINVAL (an index out of range)
 * or -EMSGSIZE (one expert's rows over a frame's caps), -ENOMEM.
 */
static int call_route_copied(call *k, const int32_t *routes)
{
    size_t per = k->per, dim = k->dim, rows = 0;
    for (size_t i = 0; i < k->batch * per; i++) {
        if (routes[i] < 0)
            continue;
        if ((size_t)routes[i] >= k->k)
            return -EINVAL;
        k->slots[routes[i]].n_rows++;
        rows++;
    }
    for (size_t e = 0; e < k->k; e++) {
        size_t n = k->slots[e].n_rows;
        if (n > HM_MOE_MAX_BATCH || n * dim > HM_MOE_MAX_ELEMS)
            return -EMSGSIZE;
    }
    size_t alloc = rows > 0 ? rows : 1;
    k->row_src = malloc(alloc * sizeof(uint32_t));
    k->row_dst = malloc(alloc * sizeof(uint32_t));
    k->xg = malloc(alloc * dim * sizeof(float));
    k->outg = malloc(alloc * dim * sizeof(float));
    if (k->backward)
        k->gyg = malloc(alloc * dim * sizeof(float));
    if (k->mask != NULL)
        k->maskg = malloc(alloc * k->seq);
    if (k->row_src == NULL || k->row_dst == NULL || k->xg == NULL || k->outg == NULL ||
        (k->backward && k->gyg == NULL) || (k->mask != NULL && k->maskg == NULL))
        return -ENOMEM;
    size_t at = 0;
    for (size_t e = 0; e < k->k; e++) {
        k->slots[e].row0 = at;
        at += k->slots[e].n_rows;
    }
    size_t *fill = calloc(k->k, sizeof(size_t));
    if (fill == NULL)
        return -ENOMEM;
    for (size_t b = 0; b < k->batch; b++) {
        uint32_t live = 0;
        for (size_t j = 0; j < per; j++) {
            int32_t e = routes[b * per + j];
            if (e < 0)
                continue;
            size_t r = k->slots[e].row0 + fill[e]++;
            k->row_src[r] = (uint32_t)b;
            k->row_dst[r] = (uint32_t)(b * per + j);
            memcpy(k->xg + r * dim, k->x + b * dim, dim * sizeof(float));
            if (k->maskg != NULL)
                memcpy(k->maskg + r * k->seq, k->mask + b * k->seq, k->seq);
            if (k->backward)
                memcpy(k->gyg + r * dim, k->gy + (b * per + j) * dim, dim * sizeof(float));
            live++;
        }
        k->need[b] = (uint32_t)HM_MIN((size_t)live, k->k_min);
        k->n_short += k->need[b] > 0;
    }
    free(fill);
    return 0;
}

static int call_route(call *k, const int32_t *caller_routes)
{
    size_t per = k->per;
    /* The caller's routes may sit in memory a trainer shares: read them
     * once, so that the count and the fill below agree. */
    int32_t *routes = malloc(k->batch * per * sizeof(int32_t));
    if (routes == NULL)
        return -ENOMEM;
    memcpy(routes, caller_routes, k->batch * per * sizeof(int32_t));
    int r = call_route_copied(k, routes);
    free(routes);
    return r;
}

static int call_start(hm_moe_client *c, const hm_moe_expert *experts, size_t k_n,
                      const int32_t *routes, size_t per, const float *x, const float *gy,
                      size_t batch, size_t dim, float *out, const hm_moe_call_opts *o,
                      hm_moe_call_cb cb, void *ud, uint64_t *call_out)
{
    int result = 0;
    call *k = NULL;
    int routed = routes != NULL;

    if (c == NULL || experts == NULL || x == NULL || out == NULL || o == NULL || cb == NULL)
        return -EINVAL;
    if (k_n < 1 || k_n > (routed ? HM_MOE_MAX_ROUTED : HM_MOE_MAX_K) || o->timeout_ms == 0)
        return -EINVAL;
    /* A routed call may need no answer at all (a Switch layer's zero outputs). */
    if (routed ? o->k_min > per : o->k_min < 1 || o->k_min > k_n)
        return -EINVAL;
    if (batch < 1 || dim < 1 || (routed && (per < 1 || per > HM_MOE_MAX_K)))
        return -EINVAL;
    /*
     * Over the protocol's caps the frame could not be sent (or would be
     * refused): say so now, rather than as a timeout when every send fails.
     */
    /* Per batch, sequences are batch / seq of the batch rows; routed, each
     * of the batch samples is a sequence of seq rows. */
    if (o->seq != 0 && !routed && batch % o->seq != 0)
        return -EINVAL;
    const size_t nseq = o->seq == 0 ? 0 : routed ? batch : batch / o->seq;
    const size_t xrows = routed && o->seq != 0 ? batch * o->seq : batch;
    if (routed && o->seq != 0 && (o->seq > HM_MOE_MAX_SEQ || batch > SIZE_MAX / o->seq))
        return -EMSGSIZE;
    /* A mask pads keys of sequences: 0/1 a row, every sequence keeping one. */
    if (o->mask != NULL) {
        if (o->seq == 0)
            return -EINVAL;
        for (size_t b = 0; b < nseq; b++) {
            size_t kept = 0;
            for (size_t j = 0; j < o->seq; j++) {
                if (o->mask[b * o->seq + j] > 1)
                    return -EINVAL;
                kept += o->mask[b * o->seq + j];
            }
            if (kept == 0)
                return -EINVAL;
        }
    }
    if ((o->seq == 0 || routed ? batch : batch / o->seq) > HM_MOE_MAX_BATCH ||
        o->seq > HM_MOE_MAX_SEQ || dim > HM_MOE_MAX_DIM || xrows * dim > HM_MOE_MAX_ELEMS ||
        (routed && xrows * per * dim > HM_MOE_MAX_ROUTED_ELEMS))
        return -EMSGSIZE;
    for (size_t e = 0; e < k_n; e++)
        if (strnlen(experts[e].uid, sizeof(experts[e].uid)) > HM_MOE_UID_MAX)
            return -EINVAL;

    k = calloc(1, sizeof(*k));
    if (k == NULL)
        return -ENOMEM;
    k->backward = gy != NULL;
    k->routed = routed;
    k->k = k_n;
    k->k_min = o->k_min;
    k->batch = batch;
    k->seq = o->seq;
    k->mask = o->mask;
    k->dim = dim;
    if (routed && o->seq != 0) {
        k->sdim = dim;
        k->dim = o->seq * dim;
    }
    k->per = per;
    k->timeout_after_k_min_ms = o->timeout_after_k_min_ms;
    k->out = out;
    k->cb = cb;
    k->ud = ud;
    k->c = c;
    k->errs = o->errors_out;
    if (k->errs != NULL)
        memset(k->errs, 0, k_n * sizeof(*k->errs));
    k->x = x;
    k->gy = gy;
    k->deadline_ms = hm_now_ms() + o->timeout_ms;
    k->n_samples = routed ? batch : 1;
    k->slots = calloc(k_n, sizeof(*k->slots));
    k->answered = calloc(k_n, 1);
    k->need = calloc(k->n_samples, sizeof(uint32_t));
    k->got = calloc(k->n_samples, sizeof(uint32_t));
    if (k->slots == NULL || k->answered == NULL || k->need == NULL || k->got == NULL) {
        result = -ENOMEM;
        goto out;
    }
    if (routed) {
        if ((result = call_route(k, routes)) != 0)
            goto out;
    } else {
        for (size_t e = 0; e < k_n; e++)
            k->slots[e].n_rows = batch;
        k->need[0] = (uint32_t)o->k_min;
        k->n_short = 1;
    }

    /*
     * Experts on backed-off hosts are left out, unless that would leave
     * some sample fewer than it needs: then the call is made to all, as
     * without the back-off, since it cannot succeed otherwise. They are
     * also called late should the others fail to make k_min (call_unskip).
     */
    uint64_t now = hm_now_ms();
    uint8_t *skip = calloc(k_n, 1);
    if (skip == NULL) {
        result = -ENOMEM;
        goto out;
    }
    size_t n_skip = 0;
    for (size_t e = 0; e < k_n; e++) {
        k->slots[e].call = k;
        k->slots[e].e = e;
        memcpy(k->slots[e].pk, experts[e].pk, HM_PK_BYTES);
        if (k->slots[e].n_rows > 0 && backoff_state(c, experts[e].pk, now) == HOST_BACKED_OFF) {
            skip[e] = 1;
            n_skip++;
        }
    }
    if (n_skip > 0) {
        /* What each sample would still have: got[] serves as the tally. */
        int enough = 1;
        if (!routed) {
            enough = k_n - n_skip >= o->k_min;
        } else {
            for (size_t e = 0; e < k_n; e++)
                for (size_t r = 0; !skip[e] && r < k->slots[e].n_rows; r++)
                    k->got[k->row_src[k->slots[e].row0 + r]]++;
            for (size_t b = 0; b < batch && enough; b++)
                enough = k->got[b] >= k->need[b];
            memset(k->got, 0, batch * sizeof(uint32_t));
        }
        if (!enough)
            n_skip = 0;
    }
    if (n_skip > 0 && (k->skipped = malloc(k_n * sizeof(*k->skipped))) == NULL) {
        free(skip);
        result = -ENOMEM;
        goto out;
    }
    if (n_skip > 0)
        memcpy(k->skipped, experts, k_n * sizeof(*k->skipped));

    for (size_t e = 0; e < k_n; e++) {
        if (k->slots[e].n_rows == 0) {
            /* Routed to no sample: not called at all. */
            k->slots[e].status = -ENODATA;
            if (k->errs != NULL)
                snprintf(k->errs[e].msg, sizeof(k->errs[e].msg), "no rows were routed to it");
            continue;
        }
        if (n_skip > 0 && skip[e]) {
            k->slots[e].status = -EAGAIN;
            if (k->errs != NULL)
                snprintf(k->errs[e].msg, sizeof(k->errs[e].msg),
                         "skipped: its host stalled a recent call and is backed off");
            k->n_skipped++;
            c->n_skipped++;
            continue;
        }
        if (slot_send(k, e, &experts[e], o->timeout_ms, now) == -ENOMEM) {
            free(skip);
            result = -ENOMEM;
            goto out;
        }
    }
    free(skip);
    if (k->n_pending == 0 && k->n_skipped > 0 && k->n_short > 0)
        (void)call_unskip(k);

    uv_loop_t *loop = hm_node_loop(c->node);
    uv_timer_init(loop, &k->timer);
    uv_timer_init(loop, &k->kmin_timer);
    k->timer.data = k;
    k->kmin_timer.data = k;
    k->handles_open = 2;
    /* libuv's clock is cached at the start of the loop turn; a caller that
     * computed for a while before this call would otherwise get a timeout
     * that is already mostly spent. */
    uv_update_time(loop);
    /* With nothing in flight the call is over, but the callback must not
     * fire from inside this function: a zero timer reports it. */
    uv_timer_start(&k->timer, call_timeout_cb, k->n_pending == 0 ? 0 : o->timeout_ms, 0);
    /* No sample needs an answer (k_min 0): as after the k_min-th answer,
     * the rest get timeout_after_k_min from the start. */
    if (k->n_short == 0 && k->n_pending > 0)
        uv_timer_start(&k->kmin_timer, call_kmin_cb, k->timeout_after_k_min_ms, 0);

    k->id = ++c->next_call_id;
    LIST_INSERT_HEAD(&c->calls, k, link);
    if (call_out != NULL)
        *call_out = k->id;
    k = NULL;
out:
    if (k != NULL) {
        /* Abandon what was started; those callbacks see done and return. */
        k->done = 1;
        for (size_t e = 0; k->slots != NULL && e < k_n; e++)
            if (k->slots[e].pending)
                (void)hm_rpc_cancel(c->rpc, k->slots[e].rpc_id);
        call_free(k);
    }
    return result;
}

int hm_moe_forward(hm_moe_client *c, const hm_moe_expert *experts, size_t k, const float *x,
                   size_t batch, size_t dim, float *y_out, const hm_moe_call_opts *o,
                   hm_moe_call_cb cb, void *ud, uint64_t *call_out)
{
    return call_start(c, experts, k, NULL, 0, x, NULL, batch, dim, y_out, o, cb, ud, call_out);
}

int hm_moe_backward(hm_moe_client *c, const hm_moe_expert *experts, size_t k, const float *x,
                    const float *gy, size_t batch, size_t dim, float *gx_out,
                    const hm_moe_call_opts *o, hm_moe_call_cb cb, void *ud, uint64_t *call_out)
{
    if (gy == NULL)
        return -EINVAL;
    return call_start(c, experts, k, NULL, 0, x, gy, batch, dim, gx_out, o, cb, ud, call_out);
}

int hm_moe_forward_routed(hm_moe_client *c, const hm_moe_expert *experts, size_t n_experts,
                          const int32_t *routes, size_t per, const float *x, size_t batch,
                          size_t dim, float *y_out, const hm_moe_call_opts *o, hm_moe_call_cb cb,
                          void *ud, uint64_t *call_out)
{
    if (routes == NULL)
        return -EINVAL;
    return call_start(c, experts, n_experts, routes, per, x, NULL, batch, dim, y_out, o, cb, ud,
                      call_out);
}

int hm_moe_backward_routed(hm_moe_client *c, const hm_moe_expert *experts, size_t n_experts,
                           const int32_t *routes, size_t per, const float *x, const float *gy,
                           size_t batch, size_t dim, float *gx_out, const hm_moe_call_opts *o,
                           hm_moe_call_cb cb, void *ud, uint64_t *call_out)
{
    if (routes == NULL || gy == NULL)
        return -EINVAL;
    return call_start(c, experts, n_experts, routes, per, x, gy, batch, dim, gx_out, o, cb, ud,
                      call_out);
}

int hm_moe_cancel(hm_moe_client *c, uint64_t id)
{
    if (c == NULL)
        return -EINVAL;
    call *k;
    LIST_FOREACH(k, &c->calls, link) {
        if (k->id == id) {
            call_finish(k, -ECANCELED);
            return 0;
        }
    }
    return -ENOENT;
}

/* -------------------------------------------------------------- combine */

int hm_moe_combine(const float *y, const float *logits, const uint8_t *answered, size_t k,
                   size_t batch, size_t dim, float *out, float *weights_out)
{
    if (y == NULL || logits == NULL || answered == NULL || out == NULL || k < 1 ||
        k > HM_MOE_MAX_K || batch < 1 || dim < 1)
        return -EINVAL;
    size_t n_ans = 0;
    for (size_t e = 0; e < k; e++)
        n_ans += answered[e] != 0;
    if (n_ans == 0)
        return -EINVAL;

    for (size_t b = 0; b < batch; b++) {
        const float *lg = logits + b * k;
        double w[HM_MOE_MAX_K];
        /* Softmax with the maximum subtracted, so that large logits do not
         * overflow exp. */
        double mx = -INFINITY;
        for (size_t e = 0; e < k; e++)
            if (answered[e] && lg[e] > mx)
                mx = lg[e];
        double sum = 0;
        for (size_t e = 0; e < k; e++) {
            w[e] = answered[e] ? exp((double)lg[e] - mx) : 0.0;
            sum += w[e];
        }
        if (!(sum > 0) || !isfinite(sum))
            return -EINVAL; /* a non-finite logit */
        float *o = out + b * dim;
        for (size_t i = 0; i < dim; i++)
            o[i] = 0.0f;
        for (size_t e = 0; e < k; e++) {
            w[e] /= sum;
            if (weights_out != NULL)
                weights_out[b * k + e] = (float)w[e];
            if (!answered[e])
                continue;
            const float *ye = y + (e * batch + b) * dim;
            for (size_t i = 0; i < dim; i++)
                o[i] += (float)(w[e] * ye[i]);
        }
    }
    return 0;
}

int hm_moe_combine_routed(const float *y, const float *logits, const int32_t *routes,
                          const uint8_t *answered, size_t n_experts, size_t batch, size_t per,
                          size_t dim, float *out, float *weights_out)
{
    if (y == NULL || logits == NULL || routes == NULL || answered == NULL || out == NULL ||
        batch < 1 || per < 1 || per > HM_MOE_MAX_K || dim < 1)
        return -EINVAL;
    for (size_t b = 0; b < batch; b++) {
        const float *lg = logits + b * per;
        const int32_t *rt = routes + b * per;
        double w[HM_MOE_MAX_K];
        uint8_t live[HM_MOE_MAX_K];
        double mx = -INFINITY;
        for (size_t j = 0; j < per; j++) {
            if (rt[j] >= 0 && (size_t)rt[j] >= n_experts)
                return -EINVAL;
            live[j] = rt[j] >= 0 && answered[rt[j]];
            if (live[j] && lg[j] > mx)
                mx = lg[j];
        }
        double sum = 0;
        for (size_t j = 0; j < per; j++) {
            w[j] = live[j] ? exp((double)lg[j] - mx) : 0.0;
            sum += w[j];
        }
        float *o = out + b * dim;
        for (size_t i = 0; i < dim; i++)
            o[i] = 0.0f;
        /* A sample none of whose experts answered gets zeros (client.h). */
        if (sum == 0 && mx == -INFINITY) {
            for (size_t j = 0; weights_out != NULL && j < per; j++)
                weights_out[b * per + j] = 0.0f;
            continue;
        }
        if (!(sum > 0) || !isfinite(sum))
            return -EINVAL; /* a non-finite logit */
        for (size_t j = 0; j < per; j++) {
            w[j] /= sum;
            if (weights_out != NULL)
                weights_out[b * per + j] = (float)w[j];
            if (!live[j])
                continue;
            const float *yj = y + (b * per + j) * dim;
            for (size_t i = 0; i < dim; i++)
                o[i] += (float)(w[j] * yj[i]);
        }
    }
    return 0;
}

/* ------------------------------------------------------------- lifetime */

int hm_moe_client_new(hm_node *node, hm_moe_client **out)
{
    if (node == NULL || out == NULL)
        return -EINVAL;
    hm_moe_client *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return -ENOMEM;
    LIST_INIT(&c->finds);
    LIST_INIT(&c->calls);
    LIST_INIT(&c->routes);
    c->node = node;
    c->max_ttl_s = HM_MOE_RECORD_MAX_TTL_S;
    c->backoff_ms = HM_MOE_BACKOFF_MS;
    c->backoff_max_ms = HM_MOE_BACKOFF_MAX_MS;
    c->rpc = hm_node_rpc(node);
    *out = c;
    return 0;
}

void hm_moe_client_free(hm_moe_client *c)
{
    if (c == NULL)
        return;
    while (!LIST_EMPTY(&c->calls))
        call_finish(LIST_FIRST(&c->calls), -ECANCELED);
    /* A find waits on the DHT, which cannot be cancelled from here: detach
     * it (its DHT callback then only frees it) and report now. */
    find_op *f;
    while ((f = LIST_FIRST(&c->finds)) != NULL) {
        find_unlink(f);
        f->cb(f->ud, -ECANCELED, NULL, 0);
    }
    route_op *ro;
    while ((ro = LIST_FIRST(&c->routes)) != NULL) {
        route_unlink(ro);
        ro->cb(ro->ud, -ECANCELED, NULL, 0, NULL, ro->batch, ro->k_best);
    }
    free(c->holders);
    free(c->backoffs);
    free(c);
}

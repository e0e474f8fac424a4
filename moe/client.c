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
} slot;

struct call {
    hm_moe_client *c; /* NULL once the call has left c->calls */
    LIST_ENTRY(call) link;
    uint64_t id;
    int backward;
    int done;
    size_t k, k_min, batch, dim;
    size_t seq; /* 0: x is [batch, dim]; else batch rows are batch / seq sequences */
    uint64_t timeout_after_k_min_ms;
    float *out; /* [k, batch, dim] */
    hm_moe_call_cb cb;
    void *ud;
    size_t n_pending, n_answered;
    size_t n_cancelled; /* slots the rpc layer ended with -ECANCELED (the node closing) */
    uint8_t answered[HM_MOE_MAX_K];
    hm_moe_call_error *errs; /* the caller's, or NULL */
    const float *x, *gy;     /* the caller's, for experts called late */
    uint64_t deadline_ms;
    hm_moe_expert *skipped;  /* [k] copies, where some expert was left out; else NULL */
    size_t n_skipped;        /* experts left out and not called since */
    slot slots[HM_MOE_MAX_K];
    uv_timer_t timer;      /* the overall timeout (or a deferred finish) */
    uv_timer_t kmin_timer; /* timeout_after_k_min, from the k_min-th answer */
    int handles_open;
};

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
    if (--k->handles_open == 0) {
        free(k->skipped);
        free(k);
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
    size_t block = k->batch * k->dim;

    if (backoff_state(c, ex->pk, now) == HOST_DUE)
        backoff_probe(c, ex->pk, now, timeout_ms);
    hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
    if (k->seq != 0 && k->backward)
        hm_moe_encode_bwd_seq(&w, ex->uid, k->x, k->gy + e * block, k->batch / k->seq, k->seq,
                              k->dim);
    else if (k->seq != 0)
        hm_moe_encode_fwd_seq(&w, ex->uid, k->x, k->batch / k->seq, k->seq, k->dim);
    else if (k->backward)
        hm_moe_encode_bwd(&w, ex->uid, k->x, k->gy + e * block, k->batch, k->dim);
    else
        hm_moe_encode_fwd(&w, ex->uid, k->x, k->batch, k->dim);
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
    call_finish_waited(k, k->n_answered >= k->k_min ? 0 : -ETIMEDOUT, k->n_pending > 0);
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
        if (k->answered[e])
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
    s->status = status;
    if (status == -ECANCELED)
        k->n_cancelled++;
    if (status == 0) {
        float *block = k->out + s->e * k->batch * k->dim;
        int r = k->seq != 0 ? hm_moe_decode_out_seq(body, len, k->backward, k->batch / k->seq,
                                                    k->seq, k->dim, block)
                            : hm_moe_decode_out(body, len, k->backward, k->batch, k->dim, block);
        if (r == 0) {
            k->answered[s->e] = 1;
            k->n_answered++;
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
    if (k->n_pending == 0 && k->n_answered < k->k_min && k->n_cancelled == 0 &&
        k->n_skipped > 0 && call_unskip(k) > 0)
        return;
    if (k->n_pending == 0) {
        /*
         * Our calls are only cancelled under us when the node closes (the
         * call's own cancel marks it done first): that is -ECANCELED, not
         * a timeout.
         */
        int fail = k->n_cancelled > 0 ? -ECANCELED : call_failure(k);
        call_finish(k, k->n_answered >= k->k_min ? 0 : fail);
        return;
    }
    if (status == 0 && k->answered[s->e] && k->n_answered == k->k_min) {
        if (k->timeout_after_k_min_ms == 0)
            call_finish(k, 0);
        else
            uv_timer_start(&k->kmin_timer, call_kmin_cb, k->timeout_after_k_min_ms, 0);
    }
}

static int call_start(hm_moe_client *c, const hm_moe_expert *experts, size_t k_n,
                      const float *x, const float *gy, size_t batch, size_t dim, float *out,
                      const hm_moe_call_opts *o, hm_moe_call_cb cb, void *ud,
                      uint64_t *call_out)
{
    int result = 0;
    call *k = NULL;

    if (c == NULL || experts == NULL || x == NULL || out == NULL || o == NULL || cb == NULL)
        return -EINVAL;
    if (k_n < 1 || k_n > HM_MOE_MAX_K || o->k_min < 1 || o->k_min > k_n || o->timeout_ms == 0)
        return -EINVAL;
    if (batch < 1 || dim < 1)
        return -EINVAL;
    /*
     * Over the protocol's caps the frame could not be sent (or would be
     * refused): say so now, rather than as a timeout when every send fails.
     */
    if (o->seq != 0 && batch % o->seq != 0)
        return -EINVAL;
    if ((o->seq == 0 ? batch : batch / o->seq) > HM_MOE_MAX_BATCH || o->seq > HM_MOE_MAX_SEQ ||
        dim > HM_MOE_MAX_DIM || batch * dim > HM_MOE_MAX_ELEMS)
        return -EMSGSIZE;
    for (size_t e = 0; e < k_n; e++)
        if (strnlen(experts[e].uid, sizeof(experts[e].uid)) > HM_MOE_UID_MAX)
            return -EINVAL;

    k = calloc(1, sizeof(*k));
    if (k == NULL)
        return -ENOMEM;
    k->backward = gy != NULL;
    k->k = k_n;
    k->k_min = o->k_min;
    k->batch = batch;
    k->seq = o->seq;
    k->dim = dim;
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

    /*
     * Experts on backed-off hosts are left out, unless that would leave
     * fewer than k_min: then the call is made to all, as without the
     * back-off, since it cannot succeed otherwise. They are also called
     * late should the others fail to make k_min (call_unskip).
     */
    uint64_t now = hm_now_ms();
    uint8_t skip[HM_MOE_MAX_K] = {0};
    size_t n_skip = 0;
    for (size_t e = 0; e < k_n; e++) {
        k->slots[e].call = k;
        k->slots[e].e = e;
        memcpy(k->slots[e].pk, experts[e].pk, HM_PK_BYTES);
        if (backoff_state(c, experts[e].pk, now) == HOST_BACKED_OFF) {
            skip[e] = 1;
            n_skip++;
        }
    }
    if (k_n - n_skip < o->k_min)
        n_skip = 0;
    if (n_skip > 0) {
        if ((k->skipped = malloc(k_n * sizeof(*k->skipped))) == NULL) {
            result = -ENOMEM;
            goto out;
        }
        memcpy(k->skipped, experts, k_n * sizeof(*k->skipped));
    }

    for (size_t e = 0; e < k_n; e++) {
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
            result = -ENOMEM;
            goto out;
        }
    }
    if (k->n_pending == 0 && k->n_skipped > 0)
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

    k->id = ++c->next_call_id;
    LIST_INSERT_HEAD(&c->calls, k, link);
    if (call_out != NULL)
        *call_out = k->id;
    k = NULL;
out:
    if (k != NULL) {
        /* Abandon what was started; those callbacks see done and return. */
        k->done = 1;
        for (size_t e = 0; e < k_n; e++)
            if (k->slots[e].pending)
                (void)hm_rpc_cancel(c->rpc, k->slots[e].rpc_id);
        free(k->skipped);
        free(k);
    }
    return result;
}

int hm_moe_forward(hm_moe_client *c, const hm_moe_expert *experts, size_t k, const float *x,
                   size_t batch, size_t dim, float *y_out, const hm_moe_call_opts *o,
                   hm_moe_call_cb cb, void *ud, uint64_t *call_out)
{
    return call_start(c, experts, k, x, NULL, batch, dim, y_out, o, cb, ud, call_out);
}

int hm_moe_backward(hm_moe_client *c, const hm_moe_expert *experts, size_t k, const float *x,
                    const float *gy, size_t batch, size_t dim, float *gx_out,
                    const hm_moe_call_opts *o, hm_moe_call_cb cb, void *ud, uint64_t *call_out)
{
    if (gy == NULL)
        return -EINVAL;
    return call_start(c, experts, k, x, gy, batch, dim, gx_out, o, cb, ud, call_out);
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
    free(c->holders);
    free(c->backoffs);
    free(c);
}

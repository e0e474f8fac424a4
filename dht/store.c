/*
 * store: the DHT record store with Hivemind's expiration semantics, owned
 * records, replay tombstones, quotas and paged gets (see store.h for the
 * contract). Owns every key, entry and accounting structure it allocates.
 *
 * Keys and storing peers live in two hmaps (SipHash under the process's
 * secret key), so chosen key ids and storer ids cannot pile into one chain. A key's entries ("slots") are one array sorted by subkey, the
 * plain value (no subkey) first; gets page through it in that order, which
 * keeps a cursor meaningful while the dictionary changes.
 */
#include "config.h"

#include "dht/store.h"

#include "src/base/hmap.h"
#include "src/base/util.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>

struct key;
struct origin_acct;

/* Slots are allocated one by one, so that a slot stays where it is while its
 * key's array moves and its origin can list it for eviction. */
struct slot {
    struct key *key;
    struct origin_acct *org;   /* live slots only: the storer's origin */
    TAILQ_ENTRY(slot) by_age; /* in org->slots, oldest stored first */
    uint8_t storer[HM_NODE_ID_BYTES];
    double expiration;
    double stored_at;
    /* -- held since -- When this store began to hold the slot's value
     * without a gap: kept while new versions carry the same value bytes
     * (an owner's refreshes), reset by another value, and gone with the
     * entry (an expiry, an eviction). This store's own observation, so no
     * storer can be told an older one. */
    double held_since;
    double tomb_until; /* tombstones only */
    uint64_t seq;
    uint8_t *data; /* subkey bytes then value bytes; NULL when both are empty */
    uint16_t sub_len;
    uint16_t val_len;
    uint8_t has_sub;
    uint8_t owned;
    uint8_t dead; /* a tombstone: no value, only the slot's seq */
    uint8_t has_sig;
    uint8_t sig[HM_DHT_SIG_BYTES];
};

struct key {
    hm_hmap_node node; /* in keys, by id */
    uint8_t id[HM_DHT_KEY_ID_BYTES];
    uint8_t *bytes;
    size_t len;
    struct slot **slots;
    size_t n, cap;
};

struct peer {
    hm_hmap_node node; /* in peers, by id */
    uint8_t id[HM_NODE_ID_BYTES];
    size_t bytes;
};

/*
 * The charge of one network origin (src/base/origin.h) and its live
 * entries, oldest stored first: eviction takes the head of the heaviest
 * origin's list. Its own table rather than an hm_origin_tab, because an
 * origin needs the list of its entries, not only counters.
 */
struct origin_acct {
    hm_hmap_node node; /* in origins, by o */
    hm_origin o;
    size_t bytes, entries;
    TAILQ_HEAD(, slot) slots;
};

struct hm_dht_store {
    hm_dht_store_config cfg;
    hm_hmap keys;  /* struct key */
    hm_hmap peers; /* struct peer: storers with a charge */
    hm_hmap origins; /* struct origin_acct: origins with a charge */
    uint64_t refused_peer, refused_origin, refused_full, refused_full_bytes, evicted;
    size_t entries;
    size_t bytes;
    size_t tombstones;
    double last_quota_sweep;
};

void hm_dht_store_config_default(hm_dht_store_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->max_value = HM_DHT_VALUE_MAX;
    cfg->max_ttl = 86400.0;
    cfg->clock_skew = 60.0;
    cfg->max_bytes = 64u << 20;
    cfg->max_entries = 65536;
    cfg->max_peer_bytes = 1u << 20;
    cfg->max_origin_share = 0.12;
    cfg->max_tombstones = 16384;
}

static size_t origin_max_bytes(const hm_dht_store *st)
{
    return HM_MAX((size_t)((double)st->cfg.max_bytes * st->cfg.max_origin_share), (size_t)1);
}

static size_t origin_max_entries(const hm_dht_store *st)
{
    return HM_MAX((size_t)((double)st->cfg.max_entries * st->cfg.max_origin_share), (size_t)1);
}

/* ---- tables ---- */

static struct key *key_find(const hm_dht_store *st, const uint8_t id[HM_DHT_KEY_ID_BYTES])
{
    return hm_hmap_entry(hm_hmap_find(&st->keys, id, HM_DHT_KEY_ID_BYTES), struct key, node);
}

static struct peer *peer_find(const hm_dht_store *st, const uint8_t id[HM_NODE_ID_BYTES])
{
    return hm_hmap_entry(hm_hmap_find(&st->peers, id, HM_NODE_ID_BYTES), struct peer, node);
}

size_t hm_dht_store_peer_bytes(const hm_dht_store *st, const uint8_t storer[HM_NODE_ID_BYTES])
{
    const struct peer *p = peer_find(st, storer);
    return p != NULL ? p->bytes : 0;
}

static struct origin_acct *origin_find(const hm_dht_store *st, const hm_origin *o)
{
    return hm_hmap_entry(hm_hmap_find(&st->origins, o->b, HM_ORIGIN_BYTES), struct origin_acct,
                         node);
}

static size_t slot_cost(const struct key *k, const struct slot *s);

void hm_dht_store_origin_usage(const hm_dht_store *st, const hm_origin *o, size_t *bytes,
                               size_t *entries)
{
    const struct origin_acct *a = origin_find(st, o);

    *bytes = a != NULL ? a->bytes : 0;
    *entries = a != NULL ? a->entries : 0;
}

/* Charges a new live slot to its storer and origin; the caller has checked
 * the quotas. The origin lists it as its newest entry. */
static int slot_charge(hm_dht_store *st, struct slot *s, const hm_origin *o)
{
    size_t n = slot_cost(s->key, s);
    struct peer *p = peer_find(st, s->storer);
    struct origin_acct *a = origin_find(st, o);
    int new_peer = 0;

    if (p == NULL) {
        if ((p = calloc(1, sizeof(*p))) == NULL)
            return -ENOMEM;
        memcpy(p->id, s->storer, HM_NODE_ID_BYTES);
        hm_hmap_insert(&st->peers, &p->node, p->id, HM_NODE_ID_BYTES);
        new_peer = 1;
    }
    if (a == NULL) {
        if ((a = calloc(1, sizeof(*a))) == NULL) {
            if (new_peer) {
                hm_hmap_remove(&st->peers, &p->node);
                free(p);
            }
            return -ENOMEM;
        }
        a->o = *o;
        TAILQ_INIT(&a->slots);
        hm_hmap_insert(&st->origins, &a->node, a->o.b, HM_ORIGIN_BYTES);
    }
    p->bytes += n;
    a->bytes += n;
    a->entries++;
    TAILQ_INSERT_TAIL(&a->slots, s, by_age);
    s->org = a;
    st->bytes += n;
    st->entries++;
    return 0;
}

static void slot_uncharge(hm_dht_store *st, struct slot *s)
{
    size_t n = slot_cost(s->key, s);
    struct peer *p = peer_find(st, s->storer);
    struct origin_acct *a = s->org;

    st->bytes -= n;
    st->entries--;
    if (p != NULL) {
        p->bytes -= n;
        if (p->bytes == 0) {
            hm_hmap_remove(&st->peers, &p->node);
            free(p);
        }
    }
    if (a != NULL) {
        TAILQ_REMOVE(&a->slots, s, by_age);
        a->bytes -= n;
        if (--a->entries == 0) {
            hm_hmap_remove(&st->origins, &a->node);
            free(a);
        }
        s->org = NULL;
    }
}

/* ---- slots ---- */

static size_t slot_cost(const struct key *k, const struct slot *s)
{
    return k->len + s->sub_len + s->val_len + HM_DHT_STORE_ENTRY_COST;
}

static const uint8_t *slot_sub(const struct slot *s) { return s->data; }
static const uint8_t *slot_val(const struct slot *s) { return s->data + s->sub_len; }

/* Order: the plain value first, then subkeys by bytes, a prefix before its extensions. */
static int cmp_sub(int has_a, const uint8_t *a, size_t alen, int has_b, const uint8_t *b,
                   size_t blen)
{
    int c;

    if (!has_a || !has_b)
        return has_a - has_b;
    c = HM_MIN(alen, blen) > 0 ? memcmp(a, b, HM_MIN(alen, blen)) : 0;
    if (c != 0)
        return c;
    return alen < blen ? -1 : alen > blen;
}

/* First slot index not before (has_sub, sub); *found_out says whether it is that slot. */
static size_t slot_search(const struct key *k, int has_sub, const uint8_t *sub, size_t len,
                          int *found_out)
{
    size_t lo = 0, hi = k->n;

    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const struct slot *s = k->slots[mid];
        if (cmp_sub(s->has_sub, slot_sub(s), s->sub_len, has_sub, sub, len) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    *found_out = lo < k->n && cmp_sub(k->slots[lo]->has_sub, slot_sub(k->slots[lo]),
                                      k->slots[lo]->sub_len, has_sub, sub, len) == 0;
    return lo;
}

static void slot_delete(hm_dht_store *st, struct key *k, size_t i)
{
    struct slot *s = k->slots[i];

    if (s->dead)
        st->tombstones--;
    else
        slot_uncharge(st, s);
    free(s->data);
    free(s);
    memmove(&k->slots[i], &k->slots[i + 1], (k->n - i - 1) * sizeof(*k->slots));
    k->n--;
}

/*
 * Ends a live slot: an owned one becomes a tombstone (if there is room for
 * one and memory for its subkey), anything else is deleted. Returns 1 if
 * the slot is gone from the array.
 */
static int slot_end(hm_dht_store *st, struct key *k, size_t i)
{
    struct slot *s = k->slots[i];
    uint8_t *sub = NULL;

    if (s->owned && st->tombstones < st->cfg.max_tombstones &&
        (s->sub_len == 0 || (sub = malloc(s->sub_len)) != NULL)) {
        if (sub != NULL)
            memcpy(sub, s->data, s->sub_len);
        slot_uncharge(st, s);
        free(s->data);
        s->data = sub;
        s->val_len = 0;
        s->dead = 1;
        s->tomb_until = HM_MAX(s->expiration, s->stored_at + st->cfg.max_ttl) + st->cfg.clock_skew;
        st->tombstones++;
        return 0;
    }
    slot_delete(st, k, i);
    return 1;
}

/* Ends expired slots and drops ended tombstones of one key; returns entries ended. */
static size_t key_expire(hm_dht_store *st, struct key *k, double now)
{
    size_t ended = 0;

    for (size_t i = 0; i < k->n;) {
        struct slot *s = k->slots[i];
        if (s->dead) {
            if (s->tomb_until <= now) {
                slot_delete(st, k, i);
                continue;
            }
        } else if (s->expiration <= now) {
            ended++;
            if (slot_end(st, k, i))
                continue;
        }
        i++;
    }
    return ended;
}

static void key_unlink_free(hm_dht_store *st, struct key *k)
{
    hm_hmap_remove(&st->keys, &k->node);
    for (size_t i = k->n; i-- > 0;)
        slot_delete(st, k, i);
    free(k->slots);
    free(k->bytes);
    free(k);
}

/* ---- store ---- */

int hm_dht_store_new(const hm_dht_store_config *cfg, hm_dht_store **out)
{
    hm_dht_store *st;

    *out = NULL;
    if (cfg->max_value > HM_DHT_VALUE_MAX || !(cfg->max_ttl > 0) || !isfinite(cfg->max_ttl) ||
        !(cfg->clock_skew >= 0) || !isfinite(cfg->clock_skew) || cfg->max_entries == 0 ||
        cfg->max_bytes == 0 || cfg->max_peer_bytes == 0 || !(cfg->max_origin_share > 0) ||
        !(cfg->max_origin_share <= 1))
        return -EINVAL;
    if ((st = calloc(1, sizeof(*st))) == NULL)
        return -ENOMEM;
    st->cfg = *cfg;
    st->last_quota_sweep = -INFINITY;
    /* Every key and every charged storer holds at least one entry. */
    if (hm_hmap_init(&st->keys, HM_MIN(cfg->max_entries, (size_t)64), cfg->max_entries) < 0 ||
        hm_hmap_init(&st->peers, HM_MIN(cfg->max_entries, (size_t)16), cfg->max_entries) < 0 ||
        hm_hmap_init(&st->origins, HM_MIN(cfg->max_entries, (size_t)16), cfg->max_entries) < 0) {
        hm_dht_store_free(st);
        return -ENOMEM;
    }
    *out = st;
    return 0;
}

void hm_dht_store_free(hm_dht_store *st)
{
    if (st == NULL)
        return;
    hm_hmap_node *e, *next;
    if (st->keys.b != NULL)
        for (e = hm_hmap_next(&st->keys, NULL); e != NULL; e = next) {
            next = hm_hmap_next(&st->keys, e);
            key_unlink_free(st, hm_hmap_entry(e, struct key, node));
        }
    if (st->peers.b != NULL)
        for (e = hm_hmap_next(&st->peers, NULL); e != NULL; e = next) {
            next = hm_hmap_next(&st->peers, e);
            free(hm_hmap_entry(e, struct peer, node));
        }
    if (st->origins.b != NULL)
        for (e = hm_hmap_next(&st->origins, NULL); e != NULL; e = next) {
            next = hm_hmap_next(&st->origins, e);
            free(hm_hmap_entry(e, struct origin_acct, node));
        }
    hm_hmap_free(&st->keys);
    hm_hmap_free(&st->peers);
    hm_hmap_free(&st->origins);
    free(st);
}

size_t hm_dht_store_sweep(hm_dht_store *st, double now)
{
    size_t ended = 0;

    hm_hmap_node *e, *next;

    /* Unlinking the key a walk stands on is safe once it has the next one. */
    for (e = hm_hmap_next(&st->keys, NULL); e != NULL; e = next) {
        struct key *k = hm_hmap_entry(e, struct key, node);
        next = hm_hmap_next(&st->keys, e);
        ended += key_expire(st, k, now);
        if (k->n == 0)
            key_unlink_free(st, k);
    }
    return ended;
}

/*
 * What a put would change, decided before anything is changed: the slot it
 * writes, and the live entries it ends (the slot's old version and, when
 * the key switches between plain and dictionary, the other kind).
 */
struct plan {
    int found;        /* the slot exists (live or tombstone) */
    size_t pos;
    size_t freed_total;  /* charge of the entries that end */
    size_t freed_storer; /* the part of it charged to this storer */
    size_t freed_entries;
    size_t freed_origin; /* the part of it charged to this origin, and its entries */
    size_t freed_origin_entries;
};

static void plan_free(struct plan *p, const struct key *k, const struct slot *s,
                      const uint8_t *storer, const hm_origin *o)
{
    size_t c = slot_cost(k, s);

    p->freed_total += c;
    p->freed_entries++;
    if (memcmp(s->storer, storer, HM_NODE_ID_BYTES) == 0)
        p->freed_storer += c;
    if (s->org != NULL && hm_origin_eq(&s->org->o, o)) {
        p->freed_origin += c;
        p->freed_origin_entries++;
    }
}

/* Applies the rules of store.h to a key whose expired slots are already ended. */
static int plan_put(const struct key *k, const hm_dht_record *r, int owned, double exp,
                    const uint8_t *storer, const hm_origin *o, struct plan *p)
{
    memset(p, 0, sizeof(*p));
    if (k == NULL)
        return 0;
    p->pos = slot_search(k, r->has_subkey, r->subkey, r->subkey_len, &p->found);
    if (p->found) {
        const struct slot *s = k->slots[p->pos];
        if (owned ? r->seq <= s->seq : exp <= s->expiration)
            return -ESTALE;
        if (!s->dead)
            plan_free(p, k, s, storer, o);
    }
    for (size_t i = 0; i < k->n; i++) {
        const struct slot *s = k->slots[i];
        if (s->dead || (p->found && i == p->pos) || s->has_sub == r->has_subkey)
            continue;
        /*
         * A live entry of the other kind: the new record must outlive it,
         * and only an owner may end an owned subkey. An owned plain record
         * names its owner in the key, which then owns every subkey too.
         */
        if (!r->has_subkey && s->owned && !owned)
            return -EPERM;
        if (exp <= s->expiration)
            return -ESTALE;
        plan_free(p, k, s, storer, o);
    }
    return 0;
}

/* The origin's charge and entry count once the put's plan is applied. */
static void origin_after(const hm_dht_store *st, const struct plan *p, const hm_origin *o,
                         size_t cost, size_t *bytes, size_t *entries)
{
    const struct origin_acct *a = origin_find(st, o);

    *bytes = (a != NULL ? a->bytes : 0) - p->freed_origin + cost;
    *entries = (a != NULL ? a->entries : 0) - p->freed_origin_entries + 1;
}

static int check_quota(const hm_dht_store *st, const struct plan *p, size_t cost,
                       const uint8_t *storer, const hm_origin *o)
{
    size_t peer = hm_dht_store_peer_bytes(st, storer) - p->freed_storer;
    size_t ob, oe;

    if (peer + cost > st->cfg.max_peer_bytes)
        return -EDQUOT;
    /* A share of the whole store is the totals' business (-ENOSPC). */
    origin_after(st, p, o, cost, &ob, &oe);
    if (st->cfg.max_origin_share < 1.0 &&
        (ob > origin_max_bytes(st) || oe > origin_max_entries(st)))
        return -EUSERS;
    if (st->bytes - p->freed_total + cost > st->cfg.max_bytes ||
        st->entries - p->freed_entries + 1 > st->cfg.max_entries)
        return -ENOSPC;
    return 0;
}

/*
 * The store is full for a put from origin o: ends the oldest entry of the
 * heaviest origin, by whichever of entries and bytes is short, if that
 * origin holds more than o will once the put is done (so evicting never
 * makes o the heavier one, and an origin at its fair share evicts nobody).
 * Returns 0 when an entry went, -ENOSPC when o is itself among the
 * heaviest. O(origins), and origins <= entries.
 */
static int evict_for(hm_dht_store *st, const struct plan *p, size_t cost, const hm_origin *o)
{
    int by_entries = st->entries - p->freed_entries + 1 > st->cfg.max_entries;
    size_t ob, oe, mine, best = 0;
    struct origin_acct *h = NULL;

    origin_after(st, p, o, cost, &ob, &oe);
    mine = by_entries ? oe : ob;
    for (hm_hmap_node *e = hm_hmap_next(&st->origins, NULL); e != NULL;
         e = hm_hmap_next(&st->origins, e)) {
        struct origin_acct *a = hm_hmap_entry(e, struct origin_acct, node);
        size_t w = by_entries ? a->entries : a->bytes;
        if (w > best) {
            best = w;
            h = a;
        }
    }
    if (h == NULL || hm_origin_eq(&h->o, o) || best <= mine)
        return -ENOSPC;
    struct slot *victim = TAILQ_FIRST(&h->slots);
    struct key *k = victim->key;
    int found;
    size_t i = slot_search(k, victim->has_sub, slot_sub(victim), victim->sub_len, &found);
    if (!found || k->slots[i] != victim)
        return -ENOSPC; /* cannot happen: every live slot is in its key */
    slot_end(st, k, i);
    if (k->n == 0)
        key_unlink_free(st, k);
    st->evicted++;
    return 0;
}

static struct key *key_create(hm_dht_store *st, const uint8_t id[HM_DHT_KEY_ID_BYTES],
                              const hm_dht_record *r)
{
    struct key *k = calloc(1, sizeof(*k));

    if (k == NULL || (k->bytes = malloc(r->key_len)) == NULL) {
        free(k);
        return NULL;
    }
    memcpy(k->id, id, HM_DHT_KEY_ID_BYTES);
    memcpy(k->bytes, r->key, r->key_len);
    k->len = r->key_len;
    hm_hmap_insert(&st->keys, &k->node, k->id, HM_DHT_KEY_ID_BYTES);
    return k;
}

int hm_dht_store_put(hm_dht_store *st, const hm_dht_record *r,
                     const uint8_t storer[HM_NODE_ID_BYTES], double now)
{
    return hm_dht_store_put_from(st, r, storer, NULL, now);
}

int hm_dht_store_put_from(hm_dht_store *st, const hm_dht_record *r,
                          const uint8_t storer[HM_NODE_ID_BYTES], const hm_origin *origin,
                          double now)
{
    uint8_t key_id[HM_DHT_KEY_ID_BYTES];
    struct key *k;
    struct plan p;
    struct slot *ns;
    size_t cost, data_len;
    double exp;
    int owned, found, result, swept = 0;
    hm_origin none;

    if (origin == NULL) {
        hm_origin_of(NULL, &none);
        origin = &none;
    }
    if ((owned = hm_dht_record_verify(r, st->cfg.swarm_id, NULL)) < 0)
        return owned;
    if (r->value_len > st->cfg.max_value)
        return -EMSGSIZE;
    if (!isfinite(now))
        return -EINVAL;
    if (r->expiration <= now)
        return -ETIME;
    exp = r->expiration;
    if (owned) {
        if (exp > now + st->cfg.max_ttl + st->cfg.clock_skew)
            return -ERANGE;
    } else {
        exp = HM_MIN(exp, now + st->cfg.max_ttl);
    }
    cost = r->key_len + (r->has_subkey ? r->subkey_len : 0) + r->value_len +
           HM_DHT_STORE_ENTRY_COST;
    hm_dht_key_id(r->key, r->key_len, key_id);

again:
    if ((k = key_find(st, key_id)) != NULL)
        key_expire(st, k, now);
    if ((result = plan_put(k, r, owned, exp, storer, origin, &p)) < 0)
        goto out;
    if ((result = check_quota(st, &p, cost, storer, origin)) < 0) {
        /* Expired entries still hold charge until swept; sweep at most once a second. */
        if (!swept && now - st->last_quota_sweep >= 1.0) {
            st->last_quota_sweep = now;
            swept = 1;
            hm_dht_store_sweep(st, now);
            goto again;
        }
        /* A full store makes room at the heaviest origin's expense; each
         * round ends one entry, and the plan is made again since the
         * entry may have been this key's. */
        if (result == -ENOSPC && evict_for(st, &p, cost, origin) == 0)
            goto again;
        if (result == -EDQUOT)
            st->refused_peer++;
        else if (result == -EUSERS)
            st->refused_origin++;
        else if (st->entries - p.freed_entries + 1 > st->cfg.max_entries)
            st->refused_full++;
        else
            st->refused_full_bytes++;
        if (result == -EUSERS)
            result = -EDQUOT;
        goto out;
    }

    /* Build the new slot before changing anything, so a failed allocation changes nothing. */
    if ((ns = calloc(1, sizeof(*ns))) == NULL) {
        result = -ENOMEM;
        goto out;
    }
    memcpy(ns->storer, storer, HM_NODE_ID_BYTES);
    ns->expiration = exp;
    ns->stored_at = now;
    ns->held_since = now;
    ns->seq = r->seq;
    ns->sub_len = (uint16_t)(r->has_subkey ? r->subkey_len : 0);
    ns->val_len = (uint16_t)r->value_len;
    ns->has_sub = r->has_subkey ? 1 : 0;
    ns->owned = owned ? 1 : 0;
    if (owned) {
        ns->has_sig = 1;
        memcpy(ns->sig, r->sig, HM_DHT_SIG_BYTES);
    }
    data_len = (size_t)ns->sub_len + ns->val_len;
    if (data_len > 0) {
        if ((ns->data = malloc(data_len)) == NULL) {
            free(ns);
            result = -ENOMEM;
            goto out;
        }
        if (ns->sub_len > 0)
            memcpy(ns->data, r->subkey, ns->sub_len);
        if (ns->val_len > 0)
            memcpy(ns->data + ns->sub_len, r->value, ns->val_len);
    }
    if (k == NULL && (k = key_create(st, key_id, r)) == NULL) {
        free(ns->data);
        free(ns);
        result = -ENOMEM;
        goto out;
    }
    ns->key = k;
    if (k->n == k->cap) {
        size_t ncap = k->cap ? 2 * k->cap : 2;
        struct slot **sl = realloc(k->slots, ncap * sizeof(*sl));
        if (sl == NULL) {
            free(ns->data);
            free(ns);
            result = -ENOMEM;
            goto out;
        }
        k->slots = sl;
        k->cap = ncap;
    }
    if ((result = slot_charge(st, ns, origin)) < 0) {
        free(ns->data);
        free(ns);
        goto out;
    }

    /* End the live entries of the other kind (plain versus dictionary). */
    for (size_t i = 0; i < k->n;) {
        struct slot *s = k->slots[i];
        if (!s->dead && s->has_sub != ns->has_sub && slot_end(st, k, i))
            continue;
        i++;
    }
    p.pos = slot_search(k, ns->has_sub, r->subkey, ns->sub_len, &found);
    if (found) {
        struct slot *s = k->slots[p.pos];
        /* -- held since -- the same value, refreshed before it ended */
        if (!s->dead && s->val_len == ns->val_len &&
            (ns->val_len == 0 || memcmp(slot_val(s), slot_val(ns), ns->val_len) == 0))
            ns->held_since = s->held_since;
        if (s->dead)
            st->tombstones--;
        else
            slot_uncharge(st, s);
        free(s->data);
        free(s);
        k->slots[p.pos] = ns;
    } else {
        memmove(&k->slots[p.pos + 1], &k->slots[p.pos], (k->n - p.pos) * sizeof(*k->slots));
        k->slots[p.pos] = ns;
        k->n++;
    }
    result = 0;
out:
    if (k != NULL && k->n == 0)
        key_unlink_free(st, k);
    return result;
}

static void slot_view(const struct key *k, const struct slot *s, hm_dht_record *out)
{
    memset(out, 0, sizeof(*out));
    out->key = k->bytes;
    out->key_len = k->len;
    out->has_subkey = s->has_sub;
    out->subkey = s->has_sub ? (s->data != NULL ? slot_sub(s) : (const uint8_t *)"") : NULL;
    out->subkey_len = s->sub_len;
    out->value = s->data != NULL ? slot_val(s) : (const uint8_t *)"";
    out->value_len = s->val_len;
    out->expiration = s->expiration;
    out->seq = s->seq;
    out->sig = s->has_sig ? s->sig : NULL;
}

int hm_dht_store_get(const hm_dht_store *st, const uint8_t key_id[HM_DHT_KEY_ID_BYTES],
                     double now, const uint8_t *cursor, size_t cursor_len, size_t max_bytes,
                     hm_dht_record *out, size_t out_cap, hm_dht_get_result *res)
{
    return hm_dht_store_get_held(st, key_id, now, cursor, cursor_len, max_bytes, out, NULL,
                                 out_cap, res);
}

int hm_dht_store_get_held(const hm_dht_store *st, const uint8_t key_id[HM_DHT_KEY_ID_BYTES],
                          double now, const uint8_t *cursor, size_t cursor_len, size_t max_bytes,
                          hm_dht_record *out, uint32_t *held_out, size_t out_cap,
                          hm_dht_get_result *res)
{
    const struct key *k;
    size_t i = 0, used = 0;
    int found;

    memset(res, 0, sizeof(*res));
    if (out_cap == 0 || (cursor != NULL && cursor_len > HM_DHT_SUBKEY_MAX))
        return -EINVAL;
    if ((k = key_find(st, key_id)) == NULL)
        return 0;
    for (size_t j = 0; j < k->n; j++) {
        const struct slot *s = k->slots[j];
        if (s->dead || s->expiration <= now)
            continue;
        res->expiration = HM_MAX(res->expiration, s->expiration);
        if (s->has_sub)
            res->is_dict = 1;
    }
    /* A live plain value is the whole answer, whatever the cursor says. */
    if (cursor != NULL && !(k->n > 0 && !k->slots[0]->has_sub && !k->slots[0]->dead &&
                            k->slots[0]->expiration > now)) {
        i = slot_search(k, 1, cursor, cursor_len, &found);
        if (found)
            i++;
    }
    for (; i < k->n; i++) {
        const struct slot *s = k->slots[i];
        hm_dht_record v;
        size_t sz;

        if (s->dead || s->expiration <= now)
            continue;
        slot_view(k, s, &v);
        sz = hm_dht_record_encoded_size(&v);
        if (res->n == out_cap || used + sz > max_bytes) {
            if (res->n == 0)
                return -EMSGSIZE;
            res->more = 1;
            break;
        }
        if (held_out != NULL) {
            double h = floor(now - s->held_since);
            held_out[res->n] = h <= 0 ? 0 : h >= (double)UINT32_MAX ? UINT32_MAX : (uint32_t)h;
        }
        out[res->n++] = v;
        used += sz;
    }
    return 0;
}

void hm_dht_store_stats_get(const hm_dht_store *st, hm_dht_store_stats *out)
{
    out->keys = hm_hmap_count(&st->keys);
    out->entries = st->entries;
    out->bytes = st->bytes;
    out->tombstones = st->tombstones;
    out->peers = hm_hmap_count(&st->peers);
    out->origins = hm_hmap_count(&st->origins);
    out->refused_peer = st->refused_peer;
    out->refused_origin = st->refused_origin;
    out->refused_full = st->refused_full;
    out->refused_full_bytes = st->refused_full_bytes;
    out->evicted = st->evicted;
}

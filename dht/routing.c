/*
 * routing: Kademlia k-buckets with replacement caches, address diversity
 * limits and a blacklist with backoff (see routing.h for the contract).
 * Owns the buckets, their contact arrays and the blacklist.
 *
 * Buckets live in one array sorted by the start of their ranges, so the
 * bucket covering an id is found by binary search. Within a bucket, live
 * contacts and cache entries are arrays ordered by last sight, head first;
 * k is small, so moving an entry to the tail is a short memmove.
 */
#include "config.h"

#include "dht/routing.h"

#include "src/base/util.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* A contact as stored: the address in the smallest form that holds both families. */
struct entry {
    uint8_t id[HM_RT_ID_BYTES];
    uint8_t pk[HM_PK_BYTES];
    union {
        struct sockaddr sa;
        struct sockaddr_in in4;
        struct sockaddr_in6 in6;
    } addr;
    uint64_t last_seen_ms;
    uint32_t failures;
    uint32_t rtt_ms;
};

struct bucket {
    uint8_t prefix[HM_RT_ID_BYTES];
    unsigned depth;
    struct entry *live;
    unsigned n, cap;
    struct entry *cache;
    unsigned nc, ccap;
    uint64_t touched_ms;
};

struct ban {
    uint8_t id[HM_RT_ID_BYTES];
    uint64_t until_ms;
    unsigned strikes;
};

struct hm_rt {
    uint8_t self[HM_RT_ID_BYTES];
    hm_rt_config cfg;
    struct bucket *b;
    size_t nb, bcap;
    size_t live_count;
    size_t cache_count;
    struct ban *bans;
    size_t nbans;
};

/* Subnet key: family tag then the /24 or /48 prefix; exempt addresses have none. */
#define SUBNET_KEY 8

void hm_rt_config_default(hm_rt_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->k = 20;
    cfg->cache_size = 20;
    cfg->depth_modulo = 5;
    cfg->max_buckets = 1024;
    cfg->max_failures = 3;
    cfg->subnet_per_bucket = 2;
    cfg->subnet_per_table = 10;
    cfg->blacklist_size = 1024;
    cfg->refresh_ms = 15ull * 60 * 1000;
    cfg->ban_base_ms = 60ull * 1000;
    cfg->ban_max_ms = 60ull * 60 * 1000;
}

/* ---- ids ---- */

static int get_bit(const uint8_t *id, unsigned bit) { return (id[bit / 8] >> (7 - bit % 8)) & 1; }

unsigned hm_rt_common_prefix(const uint8_t a[HM_RT_ID_BYTES], const uint8_t b[HM_RT_ID_BYTES])
{
    for (unsigned i = 0; i < HM_RT_ID_BYTES; i++) {
        uint8_t x = a[i] ^ b[i];
        if (x != 0)
            return i * 8 + (unsigned)__builtin_clz(x) - 24;
    }
    return HM_RT_ID_BYTES * 8;
}

int hm_rt_distance_cmp(const uint8_t target[HM_RT_ID_BYTES], const uint8_t a[HM_RT_ID_BYTES],
                       const uint8_t b[HM_RT_ID_BYTES])
{
    for (unsigned i = 0; i < HM_RT_ID_BYTES; i++) {
        uint8_t da = a[i] ^ target[i], db = b[i] ^ target[i];
        if (da != db)
            return da < db ? -1 : 1;
    }
    return 0;
}

static int in_range(const struct bucket *b, const uint8_t *id)
{
    return hm_rt_common_prefix(b->prefix, id) >= b->depth;
}

/* The bucket covering id: the last one whose range starts at or before it. */
static size_t find_bucket(const hm_rt *rt, const uint8_t *id)
{
    size_t lo = 0, hi = rt->nb; /* answer in [lo, hi) */

    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (memcmp(rt->b[mid].prefix, id, HM_RT_ID_BYTES) <= 0)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* ---- addresses ---- */

/* Returns 1 and fills key for a limited address, 0 for an exempt one. */
static int subnet_key(const struct entry *e, uint8_t key[SUBNET_KEY])
{
    const uint8_t *p;

    memset(key, 0, SUBNET_KEY);
    if (e->addr.sa.sa_family == AF_INET) {
        p = (const uint8_t *)&e->addr.in4.sin_addr;
    } else {
        const struct in6_addr *a6 = &e->addr.in6.sin6_addr;
        p = a6->s6_addr;
        if (IN6_IS_ADDR_V4MAPPED(a6)) {
            p += 12;
        } else {
            if (IN6_IS_ADDR_LOOPBACK(a6) || (p[0] & 0xfe) == 0xfc)
                return 0;
            key[0] = 6;
            memcpy(key + 1, p, 6);
            return 1;
        }
    }
    if (p[0] == 127 || p[0] == 10 || (p[0] == 172 && (p[1] & 0xf0) == 16) ||
        (p[0] == 192 && p[1] == 168))
        return 0;
    key[0] = 4;
    memcpy(key + 1, p, 3);
    return 1;
}

static unsigned count_subnet(const struct entry *a, unsigned n, const uint8_t key[SUBNET_KEY],
                             const uint8_t *skip_id)
{
    uint8_t k2[SUBNET_KEY];
    unsigned c = 0;

    for (unsigned i = 0; i < n; i++) {
        if (skip_id != NULL && memcmp(a[i].id, skip_id, HM_RT_ID_BYTES) == 0)
            continue;
        if (subnet_key(&a[i], k2) && memcmp(k2, key, SUBNET_KEY) == 0)
            c++;
    }
    return c;
}

/*
 * Whether e may be live in bucket b under the subnet limits; skip_id is an
 * entry not to count (e itself when it changes address).
 */
static int diversity_ok(const hm_rt *rt, const struct bucket *b, const struct entry *e,
                        const uint8_t *skip_id)
{
    uint8_t key[SUBNET_KEY];
    size_t total = 0;

    if (!subnet_key(e, key))
        return 1;
    if (count_subnet(b->live, b->n, key, skip_id) >= rt->cfg.subnet_per_bucket)
        return 0;
    for (size_t i = 0; i < rt->nb; i++)
        total += count_subnet(rt->b[i].live, rt->b[i].n, key, skip_id);
    return total < rt->cfg.subnet_per_table;
}

static int set_addr(struct entry *e, const struct sockaddr_storage *ss)
{
    memset(&e->addr, 0, sizeof(e->addr));
    if (ss->ss_family == AF_INET)
        memcpy(&e->addr.in4, ss, sizeof(e->addr.in4));
    else if (ss->ss_family == AF_INET6)
        memcpy(&e->addr.in6, ss, sizeof(e->addr.in6));
    else
        return -EINVAL;
    return 0;
}

static void to_contact(const struct entry *e, hm_rt_contact *c)
{
    memset(c, 0, sizeof(*c));
    memcpy(c->id, e->id, HM_RT_ID_BYTES);
    memcpy(c->pk, e->pk, HM_PK_BYTES);
    if (e->addr.sa.sa_family == AF_INET)
        memcpy(&c->addr, &e->addr.in4, sizeof(e->addr.in4));
    else
        memcpy(&c->addr, &e->addr.in6, sizeof(e->addr.in6));
    c->last_seen_ms = e->last_seen_ms;
    c->failures = e->failures;
    c->rtt_ms = e->rtt_ms;
}

/* ---- entry arrays ---- */

static int find_entry(const struct entry *a, unsigned n, const uint8_t *id)
{
    for (unsigned i = 0; i < n; i++)
        if (memcmp(a[i].id, id, HM_RT_ID_BYTES) == 0)
            return (int)i;
    return -1;
}

static void remove_at(struct entry *a, unsigned *n, unsigned i)
{
    memmove(&a[i], &a[i + 1], (*n - i - 1) * sizeof(*a));
    (*n)--;
}

/* Ensures room for one more entry, growing geometrically up to limit. */
static int reserve(struct entry **a, unsigned n, unsigned *cap, unsigned limit)
{
    unsigned ncap;
    struct entry *na;

    if (n < *cap)
        return 0;
    ncap = *cap ? *cap * 2 : 4;
    if (ncap > limit)
        ncap = limit;
    if (ncap <= n)
        return -ENOBUFS;
    na = realloc(*a, ncap * sizeof(*na));
    if (na == NULL)
        return -ENOMEM;
    *a = na;
    *cap = ncap;
    return 0;
}

/* ---- blacklist ---- */

static struct ban *find_ban(const hm_rt *rt, const uint8_t *id)
{
    for (size_t i = 0; i < rt->nbans; i++)
        if (memcmp(rt->bans[i].id, id, HM_RT_ID_BYTES) == 0)
            return &rt->bans[i];
    return NULL;
}

int hm_rt_is_banned(const hm_rt *rt, const uint8_t id[HM_RT_ID_BYTES], uint64_t now_ms)
{
    const struct ban *bn = find_ban(rt, id);
    return bn != NULL && now_ms < bn->until_ms;
}

static void add_strike(hm_rt *rt, const uint8_t *id, uint64_t now_ms)
{
    struct ban *bn = find_ban(rt, id);
    uint64_t dur;

    if (rt->cfg.blacklist_size == 0)
        return;
    if (bn != NULL) {
        /* Strikes are forgotten after a quiet ban_max_ms past the last ban. */
        if (now_ms >= bn->until_ms + rt->cfg.ban_max_ms)
            bn->strikes = 0;
    } else if (rt->nbans < rt->cfg.blacklist_size) {
        bn = &rt->bans[rt->nbans++];
        memset(bn, 0, sizeof(*bn));
    } else {
        /* Full: replace the entry whose ban ends first (a forgotten one if any). */
        bn = &rt->bans[0];
        for (size_t i = 1; i < rt->nbans; i++)
            if (rt->bans[i].until_ms < bn->until_ms)
                bn = &rt->bans[i];
        memset(bn, 0, sizeof(*bn));
    }
    memcpy(bn->id, id, HM_RT_ID_BYTES);
    if (bn->strikes < 64)
        bn->strikes++;
    /* Doubling per strike, capped (and so never overflowing). */
    dur = rt->cfg.ban_base_ms;
    for (unsigned s = 1; s < bn->strikes && dur < rt->cfg.ban_max_ms; s++)
        dur = dur > rt->cfg.ban_max_ms / 2 ? rt->cfg.ban_max_ms : dur * 2;
    bn->until_ms = now_ms + HM_MIN(dur, rt->cfg.ban_max_ms);
}

size_t hm_rt_blacklist_count(const hm_rt *rt) { return rt->nbans; }

/* ---- table ---- */

int hm_rt_new(const uint8_t self_id[HM_RT_ID_BYTES], const hm_rt_config *cfg, uint64_t now_ms,
              hm_rt **out)
{
    hm_rt *rt;
    hm_rt_config def;
    int result = 0;

    *out = NULL;
    if (cfg == NULL) {
        hm_rt_config_default(&def);
        cfg = &def;
    }
    if (cfg->k < 1 || cfg->k > HM_RT_MAX_K || cfg->cache_size < 1 ||
        cfg->cache_size > HM_RT_MAX_K || cfg->max_buckets < 1 || cfg->max_failures < 1 ||
        cfg->subnet_per_bucket < 1 || cfg->subnet_per_table < cfg->subnet_per_bucket ||
        cfg->refresh_ms < 1 || cfg->ban_base_ms < 1 || cfg->ban_max_ms < cfg->ban_base_ms)
        return -EINVAL;
    if ((rt = calloc(1, sizeof(*rt))) == NULL)
        return -ENOMEM;
    memcpy(rt->self, self_id, HM_RT_ID_BYTES);
    rt->cfg = *cfg;
    /* The bucket array grows as the table splits; the blacklist is small. */
    rt->bcap = 8;
    rt->b = calloc(rt->bcap, sizeof(*rt->b));
    rt->bans = calloc(cfg->blacklist_size ? cfg->blacklist_size : 1, sizeof(*rt->bans));
    if (rt->b == NULL || rt->bans == NULL) {
        result = -ENOMEM;
        goto out;
    }
    rt->nb = 1;
    rt->b[0].touched_ms = now_ms;
    *out = rt;
out:
    if (result < 0)
        hm_rt_free(rt);
    return result;
}

void hm_rt_free(hm_rt *rt)
{
    if (rt == NULL)
        return;
    if (rt->b != NULL) {
        for (size_t i = 0; i < rt->nb; i++) {
            free(rt->b[i].live);
            free(rt->b[i].cache);
        }
    }
    free(rt->b);
    free(rt->bans);
    free(rt);
}

static int may_split(const hm_rt *rt, const struct bucket *b)
{
    if (rt->nb >= rt->cfg.max_buckets || b->depth >= HM_RT_ID_BYTES * 8)
        return 0;
    if (in_range(b, rt->self))
        return 1;
    return rt->cfg.depth_modulo > 1 && b->depth % rt->cfg.depth_modulo != 0;
}

/* Moves the entries of src whose bit `bit` is `side` into dst, keeping their order. */
static int split_entries(const struct entry *src, unsigned n, unsigned bit, int side,
                         struct entry **dst, unsigned *dn, unsigned *dcap, unsigned limit)
{
    for (unsigned i = 0; i < n; i++) {
        int result;
        if (get_bit(src[i].id, bit) != side)
            continue;
        if ((result = reserve(dst, *dn, dcap, limit)) < 0)
            return result;
        (*dst)[(*dn)++] = src[i];
    }
    return 0;
}

static int split(hm_rt *rt, size_t i)
{
    struct bucket *old;
    struct bucket lo, hi;
    int result = 0;

    if (rt->nb == rt->bcap) {
        size_t ncap = HM_MIN(rt->bcap * 2, (size_t)rt->cfg.max_buckets);
        struct bucket *nb = realloc(rt->b, ncap * sizeof(*nb));
        if (nb == NULL)
            return -ENOMEM;
        rt->b = nb;
        rt->bcap = ncap;
    }
    old = &rt->b[i];
    memset(&lo, 0, sizeof(lo));
    memset(&hi, 0, sizeof(hi));
    memcpy(lo.prefix, old->prefix, HM_RT_ID_BYTES);
    memcpy(hi.prefix, old->prefix, HM_RT_ID_BYTES);
    hi.prefix[old->depth / 8] |= (uint8_t)(0x80 >> (old->depth % 8));
    lo.depth = hi.depth = old->depth + 1;
    lo.touched_ms = hi.touched_ms = old->touched_ms;
    if ((result = split_entries(old->live, old->n, old->depth, 0, &lo.live, &lo.n, &lo.cap,
                                rt->cfg.k)) < 0 ||
        (result = split_entries(old->live, old->n, old->depth, 1, &hi.live, &hi.n, &hi.cap,
                                rt->cfg.k)) < 0 ||
        (result = split_entries(old->cache, old->nc, old->depth, 0, &lo.cache, &lo.nc, &lo.ccap,
                                rt->cfg.cache_size)) < 0 ||
        (result = split_entries(old->cache, old->nc, old->depth, 1, &hi.cache, &hi.nc, &hi.ccap,
                                rt->cfg.cache_size)) < 0)
        goto out;
    free(old->live);
    free(old->cache);
    memmove(&rt->b[i + 2], &rt->b[i + 1], (rt->nb - i - 1) * sizeof(*rt->b));
    rt->b[i] = lo;
    rt->b[i + 1] = hi;
    rt->nb++;
out:
    if (result < 0) {
        free(lo.live);
        free(lo.cache);
        free(hi.live);
        free(hi.cache);
    }
    return result;
}

/* Moves the most recently seen cache entry that fits the limits into the bucket. */
static void promote(hm_rt *rt, struct bucket *b)
{
    for (unsigned j = b->nc; j-- > 0;) {
        if (b->n >= rt->cfg.k)
            return;
        if (!diversity_ok(rt, b, &b->cache[j], NULL))
            continue;
        if (reserve(&b->live, b->n, &b->cap, rt->cfg.k) < 0)
            return;
        b->live[b->n++] = b->cache[j];
        remove_at(b->cache, &b->nc, j);
        rt->live_count++;
        rt->cache_count--;
        return;
    }
}

/* Removes id from bucket b (live or cache); returns 1 if it was there. */
static int remove_id(hm_rt *rt, struct bucket *b, const uint8_t *id)
{
    int i;

    if ((i = find_entry(b->live, b->n, id)) >= 0) {
        remove_at(b->live, &b->n, (unsigned)i);
        rt->live_count--;
        promote(rt, b);
        return 1;
    }
    if ((i = find_entry(b->cache, b->nc, id)) >= 0) {
        remove_at(b->cache, &b->nc, (unsigned)i);
        rt->cache_count--;
        return 1;
    }
    return 0;
}

int hm_rt_observe(hm_rt *rt, const hm_rt_contact *c, uint64_t now_ms, hm_rt_contact *ping_out)
{
    uint8_t check[HM_RT_ID_BYTES];
    uint8_t key[SUBNET_KEY];
    struct entry e;
    struct bucket *b;
    size_t bi;
    int i, result;

    if (memcmp(c->id, rt->self, HM_RT_ID_BYTES) == 0)
        return -EINVAL;
    hm_node_id_from_pk(c->pk, check);
    if (memcmp(check, c->id, HM_RT_ID_BYTES) != 0)
        return -EINVAL;
    memset(&e, 0, sizeof(e));
    memcpy(e.id, c->id, HM_RT_ID_BYTES);
    memcpy(e.pk, c->pk, HM_PK_BYTES);
    if ((result = set_addr(&e, &c->addr)) < 0)
        return result;
    e.last_seen_ms = now_ms;
    e.rtt_ms = c->rtt_ms;

    bi = find_bucket(rt, e.id);
    b = &rt->b[bi];
    if ((i = find_entry(b->live, b->n, e.id)) >= 0) {
        struct entry *cur = &b->live[i];
        uint8_t okey[SUBNET_KEY];
        int moved = subnet_key(&e, key) != subnet_key(cur, okey) ||
                    memcmp(key, okey, SUBNET_KEY) != 0;
        if (moved && !diversity_ok(rt, b, &e, e.id))
            return -ENOBUFS;
        if (e.rtt_ms == 0)
            e.rtt_ms = cur->rtt_ms;
        remove_at(b->live, &b->n, (unsigned)i);
        b->live[b->n++] = e;
        b->touched_ms = now_ms;
        return HM_RT_UPDATED;
    }
    if (hm_rt_is_banned(rt, e.id, now_ms))
        return -EPERM;
    if ((i = find_entry(b->cache, b->nc, e.id)) >= 0) {
        /* Re-inserted below as a newcomer, keeping a known rtt. */
        if (e.rtt_ms == 0)
            e.rtt_ms = b->cache[i].rtt_ms;
        remove_at(b->cache, &b->nc, (unsigned)i);
        rt->cache_count--;
    }
    for (;;) {
        b = &rt->b[bi];
        if (!diversity_ok(rt, b, &e, NULL))
            return -ENOBUFS;
        if (b->n < rt->cfg.k) {
            if ((result = reserve(&b->live, b->n, &b->cap, rt->cfg.k)) < 0)
                return result;
            b->live[b->n++] = e;
            b->touched_ms = now_ms;
            rt->live_count++;
            return HM_RT_INSERTED;
        }
        if (!may_split(rt, b))
            break;
        if ((result = split(rt, bi)) < 0)
            return result;
        bi = find_bucket(rt, e.id);
    }
    /* Full and may not split: the newcomer waits in the cache. */
    if (subnet_key(&e, key) && count_subnet(b->cache, b->nc, key, NULL) >= rt->cfg.subnet_per_bucket)
        return -ENOBUFS;
    if (b->nc >= rt->cfg.cache_size) {
        remove_at(b->cache, &b->nc, 0);
        rt->cache_count--;
    }
    if ((result = reserve(&b->cache, b->nc, &b->ccap, rt->cfg.cache_size)) < 0)
        return result;
    b->cache[b->nc++] = e;
    rt->cache_count++;
    if (ping_out != NULL)
        to_contact(&b->live[0], ping_out);
    return HM_RT_CACHED;
}

int hm_rt_fail(hm_rt *rt, const uint8_t id[HM_RT_ID_BYTES], uint64_t now_ms)
{
    struct bucket *b = &rt->b[find_bucket(rt, id)];
    int i;

    if ((i = find_entry(b->live, b->n, id)) >= 0) {
        if (++b->live[i].failures < rt->cfg.max_failures)
            return 0;
        remove_id(rt, b, id);
        add_strike(rt, id, now_ms);
        return 1;
    }
    if ((i = find_entry(b->cache, b->nc, id)) >= 0) {
        remove_id(rt, b, id);
        add_strike(rt, id, now_ms);
        return 1;
    }
    return -ENOENT;
}

int hm_rt_ban(hm_rt *rt, const uint8_t id[HM_RT_ID_BYTES], uint64_t now_ms)
{
    if (memcmp(id, rt->self, HM_RT_ID_BYTES) == 0)
        return -EINVAL;
    remove_id(rt, &rt->b[find_bucket(rt, id)], id);
    add_strike(rt, id, now_ms);
    return 0;
}

int hm_rt_find(const hm_rt *rt, const uint8_t id[HM_RT_ID_BYTES], hm_rt_contact *out)
{
    const struct bucket *b = &rt->b[find_bucket(rt, id)];
    int i = find_entry(b->live, b->n, id);

    if (i < 0)
        return -ENOENT;
    if (out != NULL)
        to_contact(&b->live[i], out);
    return 0;
}

size_t hm_rt_closest(const hm_rt *rt, const uint8_t target[HM_RT_ID_BYTES], size_t n,
                     hm_rt_contact *out, unsigned flags)
{
    const struct entry *best[HM_RT_MAX_K * 4];
    size_t have = 0;

    if (n == 0)
        return 0;
    if (n > HM_ARRAY_LEN(best))
        n = HM_ARRAY_LEN(best);
    for (size_t bi = 0; bi < rt->nb; bi++) {
        const struct bucket *b = &rt->b[bi];
        for (unsigned j = 0; j < b->n; j++) {
            const struct entry *e = &b->live[j];
            size_t pos;
            if ((flags & HM_RT_SKIP_FAILING) && e->failures > 0)
                continue;
            if (have == n && hm_rt_distance_cmp(target, e->id, best[n - 1]->id) >= 0)
                continue;
            pos = have < n ? have : n - 1;
            while (pos > 0 && hm_rt_distance_cmp(target, e->id, best[pos - 1]->id) < 0) {
                best[pos] = best[pos - 1];
                pos--;
            }
            best[pos] = e;
            if (have < n)
                have++;
        }
    }
    for (size_t i = 0; i < have; i++)
        to_contact(best[i], &out[i]);
    return have;
}

void hm_rt_touch(hm_rt *rt, const uint8_t target[HM_RT_ID_BYTES], uint64_t now_ms)
{
    rt->b[find_bucket(rt, target)].touched_ms = now_ms;
}

int hm_rt_refresh_target(hm_rt *rt, uint64_t now_ms, const uint8_t random[HM_RT_ID_BYTES],
                         uint8_t target_out[HM_RT_ID_BYTES])
{
    struct bucket *b = &rt->b[0];
    unsigned d;

    for (size_t i = 1; i < rt->nb; i++)
        if (rt->b[i].touched_ms < b->touched_ms)
            b = &rt->b[i];
    if (now_ms < b->touched_ms || now_ms - b->touched_ms < rt->cfg.refresh_ms)
        return 0;
    d = b->depth;
    for (unsigned i = 0; i < HM_RT_ID_BYTES; i++) {
        uint8_t mask; /* bits of this byte that come from the prefix */
        if (8 * i + 8 <= d)
            mask = 0xff;
        else if (8 * i >= d)
            mask = 0;
        else
            mask = (uint8_t)(0xff00 >> (d - 8 * i));
        target_out[i] = (uint8_t)((b->prefix[i] & mask) | (random[i] & ~mask));
    }
    b->touched_ms = now_ms;
    return 1;
}

uint64_t hm_rt_next_refresh_ms(const hm_rt *rt)
{
    uint64_t t = rt->b[0].touched_ms;

    for (size_t i = 1; i < rt->nb; i++)
        t = HM_MIN(t, rt->b[i].touched_ms);
    return t + rt->cfg.refresh_ms;
}

size_t hm_rt_size(const hm_rt *rt) { return rt->live_count; }
size_t hm_rt_cache_count(const hm_rt *rt) { return rt->cache_count; }
size_t hm_rt_bucket_count(const hm_rt *rt) { return rt->nb; }

unsigned hm_rt_depth(const hm_rt *rt)
{
    unsigned d = 0;

    for (size_t i = 0; i < rt->nb; i++)
        d = HM_MAX(d, rt->b[i].depth);
    return d;
}

int hm_rt_bucket_get(const hm_rt *rt, size_t index, hm_rt_bucket_info *out)
{
    const struct bucket *b;

    if (index >= rt->nb)
        return -ENOENT;
    b = &rt->b[index];
    memcpy(out->prefix, b->prefix, HM_RT_ID_BYTES);
    out->depth = b->depth;
    out->count = b->n;
    out->cache_count = b->nc;
    out->touched_ms = b->touched_ms;
    return 0;
}

int hm_rt_bucket_contacts(const hm_rt *rt, size_t index, hm_rt_contact *out, size_t cap)
{
    const struct bucket *b;
    size_t n;

    if (index >= rt->nb)
        return -ENOENT;
    b = &rt->b[index];
    n = HM_MIN((size_t)b->n, cap);
    for (size_t i = 0; i < n; i++)
        to_contact(&b->live[i], &out[i]);
    return (int)n;
}

int hm_rt_foreach(const hm_rt *rt, int (*fn)(void *arg, const hm_rt_contact *c), void *arg)
{
    hm_rt_contact c;

    for (size_t i = 0; i < rt->nb; i++) {
        for (unsigned j = 0; j < rt->b[i].n; j++) {
            int r;
            to_contact(&rt->b[i].live[j], &c);
            if ((r = fn(arg, &c)) != 0)
                return r;
        }
    }
    return 0;
}

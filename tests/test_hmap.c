/*
 * Tests for the keyed hash map: entries are found, replaced and removed by
 * their bytes, the bucket array grows with the entries and stops at its
 * bound, keys that agree in their low bits (what a peer grinding public keys
 * would send) still spread over the buckets, and a walk may remove the entry
 * it stands on.
 */
#include "config.h"

#include "src/base/hmap.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct item {
    hm_hmap_node node;
    uint8_t key[32];
    int value;
    int seen;
} item;

static item *items_new(size_t n)
{
    item *v = calloc(n, sizeof(*v));
    cr_assert_not_null(v);
    for (size_t i = 0; i < n; i++) {
        /* Keys that differ only in their last bytes, like ground keys. */
        memset(v[i].key, 0xab, sizeof(v[i].key));
        v[i].key[28] = (uint8_t)(i >> 24);
        v[i].key[29] = (uint8_t)(i >> 16);
        v[i].key[30] = (uint8_t)(i >> 8);
        v[i].key[31] = (uint8_t)i;
        v[i].value = (int)i;
    }
    return v;
}

static item *find(const hm_hmap *m, const uint8_t *key, size_t klen)
{
    return hm_hmap_entry(hm_hmap_find(m, key, klen), item, node);
}

static void insert_all(hm_hmap *m, item *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        hm_hmap_insert(m, &v[i].node, v[i].key, sizeof(v[i].key));
    cr_assert_eq(hm_hmap_count(m), n);
}

/* A map set up with these bucket bounds, holding n fresh items. */
static item *filled(hm_hmap *m, size_t initial, size_t max, size_t n)
{
    cr_assert_eq(hm_hmap_init(m, initial, max), 0);
    item *v = items_new(n);
    insert_all(m, v, n);
    return v;
}

static void release(hm_hmap *m, item *v)
{
    hm_hmap_free(m);
    free(v);
}

/* Every item is found under its key, as itself. */
static void find_all(const hm_hmap *m, item *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(find(m, v[i].key, sizeof(v[i].key)), &v[i]);
}

Test(hmap, insert_find_delete)
{
    hm_hmap m;
    item *v = filled(&m, 4, 64, 3);
    find_all(&m, v, 3);
    uint8_t other[32];
    memset(other, 0x11, sizeof(other));
    cr_assert_null(find(&m, other, sizeof(other)));
    /* A prefix of a key is another key. */
    cr_assert_null(find(&m, v[0].key, 31));

    hm_hmap_remove(&m, &v[1].node);
    cr_assert_eq(hm_hmap_count(&m), 2);
    cr_assert_null(find(&m, v[1].key, sizeof(v[1].key)));
    cr_assert_eq(find(&m, v[0].key, sizeof(v[0].key)), &v[0]);
    cr_assert_eq(find(&m, v[2].key, sizeof(v[2].key)), &v[2]);
    release(&m, v);
}

Test(hmap, duplicate_keys_are_walked)
{
    hm_hmap m;
    cr_assert_eq(hm_hmap_init(&m, 0, 0), 0);
    item *v = items_new(4);
    memcpy(v[1].key, v[0].key, sizeof(v[0].key));
    memcpy(v[2].key, v[0].key, sizeof(v[0].key));
    for (int i = 0; i < 4; i++)
        hm_hmap_insert(&m, &v[i].node, v[i].key, sizeof(v[i].key));
    int n = 0, mask = 0;
    for (hm_hmap_node *e = hm_hmap_find(&m, v[0].key, 32); e != NULL; e = hm_hmap_find_next(&m, e)) {
        n++;
        mask |= 1 << hm_hmap_entry(e, item, node)->value;
    }
    cr_assert_eq(n, 3);
    cr_assert_eq(mask, 7);
    release(&m, v);
}

Test(hmap, grows_and_keeps_every_key)
{
    enum { N = 20000 };
    hm_hmap m;
    item *v = filled(&m, 1, 0, N);
    cr_assert_geq(hm_hmap_buckets(&m), N);
    find_all(&m, v, N);
    for (int i = 0; i < N; i += 2)
        hm_hmap_remove(&m, &v[i].node);
    cr_assert_eq(hm_hmap_count(&m), N / 2);
    for (int i = 0; i < N; i++)
        cr_assert_eq(find(&m, v[i].key, sizeof(v[i].key)), i % 2 ? &v[i] : NULL);
    release(&m, v);
}

/*
 * Keys equal in every byte a cheap hash would look at, differing only in a
 * few high bits: with SipHash under a secret key they still spread, so no
 * chain is much longer than average.
 */
Test(hmap, low_bit_collisions_spread)
{
    enum { N = 4096 };
    hm_hmap m;
    cr_assert_eq(hm_hmap_init(&m, N, N), 0);
    item *v = items_new(N);
    for (int i = 0; i < N; i++) {
        memset(v[i].key, 0, sizeof(v[i].key));
        v[i].key[0] = (uint8_t)(i << 4);
        v[i].key[1] = (uint8_t)(i >> 4);
        hm_hmap_insert(&m, &v[i].node, v[i].key, sizeof(v[i].key));
    }
    size_t longest = 0;
    for (size_t b = 0; b < m.nb; b++) {
        size_t len = 0;
        for (hm_hmap_node *e = m.b[b]; e != NULL; e = e->next)
            len++;
        if (len > longest)
            longest = len;
    }
    /* A uniform hash puts about ln N / ln ln N in the longest chain. */
    cr_assert_leq(longest, 16, "longest chain %zu", longest);
    /* The hash itself is keyed: equal inputs agree, different ones differ. */
    cr_assert_eq(hm_hmap_hash(v[0].key, 32), hm_hmap_hash(v[0].key, 32));
    cr_assert_neq(hm_hmap_hash(v[0].key, 32), hm_hmap_hash(v[1].key, 32));
    release(&m, v);
}

Test(hmap, delete_during_iteration)
{
    enum { N = 1000 };
    hm_hmap m;
    item *v = filled(&m, 8, 0, N);
    int visited = 0;
    hm_hmap_node *next;
    for (hm_hmap_node *e = hm_hmap_next(&m, NULL); e != NULL; e = next) {
        next = hm_hmap_next(&m, e);
        item *it = hm_hmap_entry(e, item, node);
        cr_assert_eq(it->seen, 0);
        it->seen = 1;
        visited++;
        if (it->value % 3 != 0)
            hm_hmap_remove(&m, e);
    }
    cr_assert_eq(visited, N);
    int left = 0;
    for (hm_hmap_node *e = hm_hmap_next(&m, NULL); e != NULL; e = hm_hmap_next(&m, e)) {
        cr_assert_eq(hm_hmap_entry(e, item, node)->value % 3, 0);
        left++;
    }
    cr_assert_eq(left, (N + 2) / 3);
    cr_assert_eq(hm_hmap_count(&m), (size_t)left);
    release(&m, v);
}

Test(hmap, bound_refuses_growth)
{
    enum { N = 1000 };
    hm_hmap m;
    item *v = filled(&m, 4, 32, N);
    /* The array stopped at its bound; the chains took the rest. */
    cr_assert_eq(hm_hmap_buckets(&m), 32);
    cr_assert_eq(hm_hmap_count(&m), N);
    find_all(&m, v, N);
    release(&m, v);
    cr_assert_eq(hm_hmap_init(&m, 64, 32), -EINVAL);
}

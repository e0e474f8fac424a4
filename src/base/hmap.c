/*
 * hmap: see hmap.h. Owns the process-wide SipHash key, which is drawn once
 * and is configuration of the process rather than state of any node.
 */
#include "config.h"

#include "src/base/hmap.h"

#include <errno.h>
#include <pthread.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_BUCKETS 16u
#define DEFAULT_MAX_BUCKETS ((size_t)1 << 20)

static unsigned char hash_key[crypto_shorthash_KEYBYTES];
static pthread_once_t hash_key_once = PTHREAD_ONCE_INIT;

static void hash_key_init(void)
{
    /*
     * sodium_init is idempotent and thread-safe; calling it here means the
     * map works in a program that has not called it yet (a unit test).
     */
    if (sodium_init() < 0)
        abort();
    randombytes_buf(hash_key, sizeof(hash_key));
}

uint64_t hm_hmap_hash(const void *key, size_t klen)
{
    unsigned char out[crypto_shorthash_BYTES];
    uint64_t h;

    pthread_once(&hash_key_once, hash_key_init);
    crypto_shorthash(out, key, klen, hash_key);
    memcpy(&h, out, sizeof(h));
    return h;
}

static size_t round_pow2(size_t v)
{
    size_t p = 1;
    while (p < v && p <= SIZE_MAX / 2)
        p <<= 1;
    return p;
}

int hm_hmap_init(hm_hmap *m, size_t initial_buckets, size_t max_buckets)
{
    memset(m, 0, sizeof(*m));
    size_t nb = round_pow2(initial_buckets == 0 ? DEFAULT_BUCKETS : initial_buckets);
    size_t max = round_pow2(max_buckets == 0 ? DEFAULT_MAX_BUCKETS : max_buckets);
    if (max < nb)
        return -EINVAL;
    m->b = calloc(nb, sizeof(*m->b));
    if (m->b == NULL)
        return -ENOMEM;
    m->nb = nb;
    m->max_buckets = max;
    pthread_once(&hash_key_once, hash_key_init);
    return 0;
}

void hm_hmap_free(hm_hmap *m)
{
    free(m->b);
    memset(m, 0, sizeof(*m));
}

/* Doubles the bucket array; on failure the map keeps its current one. */
static void grow(hm_hmap *m)
{
    size_t nb = m->nb * 2;
    hm_hmap_node **b = calloc(nb, sizeof(*b));
    if (b == NULL)
        return;
    for (size_t i = 0; i < m->nb; i++) {
        hm_hmap_node *n = m->b[i];
        while (n != NULL) {
            hm_hmap_node *next = n->next;
            size_t j = (size_t)n->hash & (nb - 1);
            n->next = b[j];
            b[j] = n;
            n = next;
        }
    }
    free(m->b);
    m->b = b;
    m->nb = nb;
}

void hm_hmap_insert(hm_hmap *m, hm_hmap_node *node, const void *key, size_t klen)
{
    if (m->n >= m->nb && m->nb < m->max_buckets)
        grow(m);
    node->key = key;
    node->klen = klen;
    node->hash = hm_hmap_hash(key, klen);
    size_t i = (size_t)node->hash & (m->nb - 1);
    node->next = m->b[i];
    m->b[i] = node;
    m->n++;
}

void hm_hmap_remove(hm_hmap *m, hm_hmap_node *node)
{
    hm_hmap_node **pp = &m->b[(size_t)node->hash & (m->nb - 1)];
    while (*pp != NULL && *pp != node)
        pp = &(*pp)->next;
    if (*pp == NULL)
        return;
    *pp = node->next;
    node->next = NULL;
    m->n--;
}

static hm_hmap_node *chain_find(hm_hmap_node *n, uint64_t h, const void *key, size_t klen)
{
    for (; n != NULL; n = n->next)
        if (n->hash == h && n->klen == klen && memcmp(n->key, key, klen) == 0)
            return n;
    return NULL;
}

hm_hmap_node *hm_hmap_find(const hm_hmap *m, const void *key, size_t klen)
{
    uint64_t h = hm_hmap_hash(key, klen);
    return chain_find(m->b[(size_t)h & (m->nb - 1)], h, key, klen);
}

hm_hmap_node *hm_hmap_find_next(const hm_hmap *m, const hm_hmap_node *node)
{
    (void)m;
    return chain_find(node->next, node->hash, node->key, node->klen);
}

hm_hmap_node *hm_hmap_next(const hm_hmap *m, const hm_hmap_node *node)
{
    size_t i = 0;
    if (node != NULL) {
        if (node->next != NULL)
            return node->next;
        i = ((size_t)node->hash & (m->nb - 1)) + 1;
    }
    for (; i < m->nb; i++)
        if (m->b[i] != NULL)
            return m->b[i];
    return NULL;
}

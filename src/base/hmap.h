/*
 * hmap: an intrusive hash map keyed by byte strings, for every table whose
 * keys a peer chose (public keys, record keys, request ids).
 *
 * Identities cost nothing, so a peer can grind keys until many of them land
 * in one bucket and turn every lookup into a list walk. The map therefore
 * hashes with SipHash-2-4 (libsodium's crypto_shorthash) under a key drawn
 * at random once per process: without the key nobody can predict which
 * bucket a byte string falls into, and SipHash is built to keep it so.
 *
 * The map owns only its bucket array. Entries embed an hm_hmap_node, whose
 * key pointer refers to bytes inside the entry itself; those bytes must not
 * change while the entry is in the map. Several entries may share a key
 * (hm_hmap_find_next walks them). The bucket array doubles when the map
 * holds more entries than buckets, up to max_buckets; past that bound, or
 * when memory for a larger array is short, chains grow instead and every
 * operation stays correct. Removal never moves other entries, so a walk
 * with hm_hmap_next may remove the entry it stands on once it has taken the
 * next one; insertion during a walk may rehash and is not allowed.
 */
#ifndef HM_HMAP_H
#define HM_HMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct hm_hmap_node {
    struct hm_hmap_node *next; /* bucket chain */
    const uint8_t *key;
    size_t klen;
    uint64_t hash;
} hm_hmap_node;

typedef struct hm_hmap {
    hm_hmap_node **b;
    size_t nb;          /* a power of two */
    size_t max_buckets; /* a power of two, >= nb */
    size_t n;
} hm_hmap;

/* The entry that embeds node as member (NULL stays NULL). */
#define hm_hmap_entry(node, type, member)                                      \
    ((node) == NULL ? (type *)NULL : (type *)(void *)((char *)(node) - offsetof(type, member)))

/*
 * Sets up an empty map with at least initial_buckets buckets that may grow to
 * max_buckets (both rounded up to powers of two; 0 means 16 and 1 << 20).
 * Returns 0, -EINVAL or -ENOMEM.
 */
int hm_hmap_init(hm_hmap *m, size_t initial_buckets, size_t max_buckets);
/* Frees the bucket array; the entries belong to the caller. */
void hm_hmap_free(hm_hmap *m);

/* The keyed hash of a byte string, as the map computes it. */
uint64_t hm_hmap_hash(const void *key, size_t klen);

/*
 * Adds node under key (klen bytes at key, which must stay valid and
 * unchanged until the node is removed). Does not look for an existing entry
 * with the same key: callers that want one entry per key find first.
 */
void hm_hmap_insert(hm_hmap *m, hm_hmap_node *node, const void *key, size_t klen);
/* Takes node out of the map; node must be in it. */
void hm_hmap_remove(hm_hmap *m, hm_hmap_node *node);

/* The first entry with this key, or NULL. */
hm_hmap_node *hm_hmap_find(const hm_hmap *m, const void *key, size_t klen);
/* The next entry after node with node's key, or NULL. */
hm_hmap_node *hm_hmap_find_next(const hm_hmap *m, const hm_hmap_node *node);

/* Iteration in no particular order: hm_hmap_next(m, NULL) is the first entry. */
hm_hmap_node *hm_hmap_next(const hm_hmap *m, const hm_hmap_node *node);

static inline size_t hm_hmap_count(const hm_hmap *m) { return m->n; }
static inline size_t hm_hmap_buckets(const hm_hmap *m) { return m->nb; }

#endif

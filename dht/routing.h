/*
 * routing: the Kademlia routing table of one node. A pure data structure:
 * no I/O, no clock reads, no randomness of its own. Every call that needs
 * time takes now_ms (any monotonic millisecond clock, virtual time in a
 * simulation); the one that needs randomness takes caller-supplied bytes.
 * It owns its buckets, their replacement caches and the blacklist, and
 * nothing else. Not thread-safe: one owner (the DHT core) calls it.
 *
 * Ids and distance. Node ids are 256 bits (BLAKE2b-256 of the public key);
 * the distance of two ids is their XOR read as a big-endian number.
 *
 * Buckets. The id space is partitioned into buckets, each the set of ids
 * with a given prefix (depth = prefix length in bits). A bucket holds at
 * most k live contacts ordered by last sight (head = least recently seen)
 * and a replacement cache of at most cache_size contacts seen while it was
 * full. A full bucket is split in two when a new contact arrives if it
 * covers our own id, or (relaxed splitting, Kademlia paper section 4.2 and
 * Hivemind's depth_modulo) if its depth is not a multiple of depth_modulo;
 * depth_modulo 0 or 1 gives strict Kademlia. The number of buckets is
 * capped at max_buckets; a bucket that may not split keeps its k contacts
 * and sends newcomers to its cache.
 *
 * Eviction. Kademlia prefers old contacts: when a bucket is full, observing a
 * newcomer puts it in the cache and returns HM_RT_CACHED with the bucket's
 * least recently seen contact, which the core should ping. If the ping
 * succeeds, the core observes that contact again (it moves to the tail);
 * if it fails, hm_rt_fail. A contact that fails max_failures times in a
 * row is removed, blacklisted, and replaced by the most recently seen cache
 * entry that passes the address limits.
 *
 * Address diversity. Contacts are grouped by subnet: /24 for IPv4
 * (IPv4-mapped IPv6 counts as IPv4), /48 for IPv6. At most
 * subnet_per_bucket contacts of one subnet in a bucket (and as many again
 * in its cache), and at most subnet_per_table in the whole table.
 * Loopback and private addresses (127/8, 10/8, 172.16/12, 192.168/16, ::1,
 * fc00::/7) are exempt, so local swarms and tests on 127.0.0.1 work.
 * Only AF_INET and AF_INET6 addresses are accepted.
 *
 * Blacklist. A contact removed for failing (or banned by hm_rt_ban) cannot
 * re-enter the table or the cache until its ban ends. The n-th ban of the
 * same id lasts ban_base_ms * 2^(n-1), at most ban_max_ms. An id's strike
 * count is forgotten ban_max_ms after its last ban ended. The blacklist
 * holds at most blacklist_size ids; when it is full, the entry whose ban
 * ends first is replaced.
 *
 * Refresh. Each bucket remembers when it was last touched: a contact in it
 * was observed, or the core reported a lookup into its range
 * (hm_rt_touch). hm_rt_refresh_target names a bucket untouched for
 * refresh_ms and a random id in it to look up.
 *
 * Memory is bounded by max_buckets * (k + cache_size) contacts plus
 * blacklist_size entries; a bucket's arrays grow only as it fills.
 */
#ifndef HM_DHT_ROUTING_H
#define HM_DHT_ROUTING_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "src/base/crypto.h"

#define HM_RT_ID_BYTES HM_NODE_ID_BYTES
#define HM_RT_MAX_K 256

typedef struct hm_rt hm_rt;

typedef struct hm_rt_contact {
    uint8_t id[HM_RT_ID_BYTES]; /* must be BLAKE2b-256(pk) */
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr;
    uint64_t last_seen_ms; /* set by the table */
    uint32_t failures;     /* consecutive failures since last seen; set by the table */
    uint32_t rtt_ms;       /* 0 = unknown; a known value is kept when 0 is observed */
} hm_rt_contact;

typedef struct hm_rt_config {
    unsigned k;                 /* bucket size, default 20, 1..HM_RT_MAX_K */
    unsigned cache_size;        /* replacement cache per bucket, default k, 0..HM_RT_MAX_K */
    unsigned depth_modulo;      /* relaxed splitting, default 5; 0 or 1 = strict */
    unsigned max_buckets;       /* default 1024, at least 1 */
    unsigned max_failures;      /* consecutive failures before removal, default 3, >= 1 */
    unsigned subnet_per_bucket; /* default 2, >= 1 */
    unsigned subnet_per_table;  /* default 10, >= subnet_per_bucket */
    unsigned blacklist_size;    /* default 1024 */
    uint64_t refresh_ms;        /* default 15 minutes, >= 1 */
    uint64_t ban_base_ms;       /* first ban, default 60 s, >= 1 */
    uint64_t ban_max_ms;        /* longest ban, default 1 h, >= ban_base_ms */
} hm_rt_config;

void hm_rt_config_default(hm_rt_config *cfg);

/*
 * Makes an empty table (one bucket, depth 0, touched at now_ms). cfg NULL
 * means the defaults. Returns 0, -EINVAL (a config value out of range) or
 * -ENOMEM.
 */
int hm_rt_new(const uint8_t self_id[HM_RT_ID_BYTES], const hm_rt_config *cfg, uint64_t now_ms,
              hm_rt **out);
void hm_rt_free(hm_rt *rt);

enum {
    HM_RT_INSERTED = 1, /* new contact, now live in its bucket */
    HM_RT_UPDATED = 2,  /* already live: moved to the tail, address and rtt refreshed */
    HM_RT_CACHED = 3,   /* bucket full: (kept) in the replacement cache */
};

/*
 * The contact was seen alive at now_ms (it answered us, or sent us an
 * authenticated request). Resets its failure count. Returns HM_RT_INSERTED,
 * HM_RT_UPDATED or HM_RT_CACHED; with HM_RT_CACHED, *ping_out (may be NULL)
 * receives the bucket's least recently seen contact, to be pinged. Errors:
 * -EINVAL (our own id, id not the hash of pk, unsupported address family),
 * -EPERM (blacklisted; the ban is not extended), -ENOBUFS (the subnet is
 * at its limit; a live contact that moved there keeps its old address).
 */
int hm_rt_observe(hm_rt *rt, const hm_rt_contact *c, uint64_t now_ms, hm_rt_contact *ping_out);

/*
 * A request to id failed (timeout, error). Counts a consecutive failure;
 * at max_failures the contact is removed, banned, and replaced from the
 * cache. A failing cache entry is dropped from the cache and banned at once.
 * Returns 1 if the contact was removed, 0 if only counted, -ENOENT if
 * unknown.
 */
int hm_rt_fail(hm_rt *rt, const uint8_t id[HM_RT_ID_BYTES], uint64_t now_ms);

/*
 * Removes id (live or cached) and bans it as hm_rt_fail would: for a peer
 * the core caught misbehaving. Unknown ids are banned too. Returns 0 or
 * -EINVAL for our own id.
 */
int hm_rt_ban(hm_rt *rt, const uint8_t id[HM_RT_ID_BYTES], uint64_t now_ms);

/* 1 while id is banned at now_ms, else 0. */
int hm_rt_is_banned(const hm_rt *rt, const uint8_t id[HM_RT_ID_BYTES], uint64_t now_ms);

/* Copies the live contact id into out (may be NULL); 0 or -ENOENT. */
int hm_rt_find(const hm_rt *rt, const uint8_t id[HM_RT_ID_BYTES], hm_rt_contact *out);

#define HM_RT_SKIP_FAILING 1 /* leave out contacts with a failure pending */

/*
 * Writes the (at most) n live contacts closest to target into out, nearest
 * first, ties impossible (ids are distinct). Returns how many.
 */
size_t hm_rt_closest(const hm_rt *rt, const uint8_t target[HM_RT_ID_BYTES], size_t n,
                     hm_rt_contact *out, unsigned flags);

/* Marks the bucket covering target as touched (the core finished a lookup there). */
void hm_rt_touch(hm_rt *rt, const uint8_t target[HM_RT_ID_BYTES], uint64_t now_ms);

/*
 * Finds the bucket least recently touched, if untouched for refresh_ms.
 * Then writes into target_out an id inside that bucket's range (its prefix,
 * followed by the bits of random, which the caller fills with 32 random
 * bytes from whatever source it uses), marks the bucket touched, and
 * returns 1. Returns 0 when no bucket is due.
 */
int hm_rt_refresh_target(hm_rt *rt, uint64_t now_ms, const uint8_t random[HM_RT_ID_BYTES],
                         uint8_t target_out[HM_RT_ID_BYTES]);
/* When the next bucket falls due (to schedule the core's next deadline). */
uint64_t hm_rt_next_refresh_ms(const hm_rt *rt);

/* Live contacts in the table (caches not counted). */
size_t hm_rt_size(const hm_rt *rt);
/* Contacts waiting in replacement caches. */
size_t hm_rt_cache_count(const hm_rt *rt);
/*
 * Depth of the table: the prefix length of its deepest bucket, i.e. how
 * many times it has split along the deepest path (the path to our own id,
 * or a relaxed split next to it); the table has depth + 1 levels of
 * buckets. About log2(N / k): with k = 20 and 2,000 random peers it is
 * 7 or 8 with relaxed splitting, 6 to 8 with strict splitting (measured
 * and explained in tests/test_dht_routing.c).
 */
unsigned hm_rt_depth(const hm_rt *rt);
size_t hm_rt_bucket_count(const hm_rt *rt);
/* Ids on the blacklist (banned or remembered for their strikes). */
size_t hm_rt_blacklist_count(const hm_rt *rt);

typedef struct hm_rt_bucket_info {
    uint8_t prefix[HM_RT_ID_BYTES]; /* first id of the range (bits past depth are zero) */
    unsigned depth;
    size_t count;       /* live contacts */
    size_t cache_count; /* replacement cache */
    uint64_t touched_ms;
} hm_rt_bucket_info;

/*
 * Buckets are numbered 0 .. hm_rt_bucket_count - 1 in the order of their
 * ranges. Returns 0 or -ENOENT.
 */
int hm_rt_bucket_get(const hm_rt *rt, size_t index, hm_rt_bucket_info *out);
/*
 * Copies the live contacts of bucket index, head (least recently seen)
 * first, into out (at most cap). Returns how many, or -ENOENT.
 */
int hm_rt_bucket_contacts(const hm_rt *rt, size_t index, hm_rt_contact *out, size_t cap);

/*
 * Calls fn on every live contact, bucket by bucket. The table must not be
 * changed from inside fn. A nonzero return from fn stops the walk and is
 * returned.
 */
int hm_rt_foreach(const hm_rt *rt, int (*fn)(void *arg, const hm_rt_contact *c), void *arg);

/* Compares the distances of a and b to target: <0, 0 or >0 as a is nearer. */
int hm_rt_distance_cmp(const uint8_t target[HM_RT_ID_BYTES], const uint8_t a[HM_RT_ID_BYTES],
                       const uint8_t b[HM_RT_ID_BYTES]);
/* Length of the common prefix of a and b in bits (256 when equal). */
unsigned hm_rt_common_prefix(const uint8_t a[HM_RT_ID_BYTES], const uint8_t b[HM_RT_ID_BYTES]);

#endif

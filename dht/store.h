/*
 * store: the records one DHT node keeps for others. A pure data structure:
 * no I/O and no clock reads; every call takes now, the wall clock in UNIX
 * seconds (expirations are absolute times shared by all nodes, so this is
 * wall-clock time, virtual in a simulation). It owns its records, their
 * bytes, the per-peer accounting and the replay tombstones. Not
 * thread-safe: one owner (the DHT core) calls it.
 *
 * Records are addressed by key_id = BLAKE2b-256(key) (record.h). Under one
 * key_id the store holds either one plain value (a record without subkey)
 * or a dictionary (records with subkeys, one entry per subkey). Hivemind's
 * rules decide between a stored entry and a new record:
 *   - an entry whose expiration has passed is gone (lazily at every call,
 *     physically at hm_dht_store_sweep);
 *   - a record that expires at or before now is refused (-ETIME);
 *   - a plain record's expiration is clamped to now + max_ttl;
 *   - an unowned record replaces the entry in its slot (the plain value, or
 *     its subkey) only with a strictly later expiration (-ESTALE otherwise);
 *   - a subkey record replaces a plain value, turning the key into a
 *     dictionary, only if it expires later than the plain value; a plain
 *     record replaces a dictionary only if it expires later than every live
 *     subkey, and never while the dictionary holds a live owned subkey
 *     (-EPERM), since nobody but an owner may delete an owner's entry.
 *
 * Owned records (record.h) are accepted only with the owner's valid
 * signature (-EBADMSG otherwise), and within their slot they are ordered by
 * seq instead of expiration: a new version must have a seq strictly above
 * the stored one (-ESTALE otherwise), whatever its expiration, so an owner
 * can shorten or end its record. An owned record's expiration is signed, so
 * it is not clamped: one beyond now + max_ttl + clock_skew is refused
 * (-ERANGE).
 *
 * Replay tombstones. When an owned entry ends (expires, or is replaced by
 * a dictionary of the same owner), its seq is kept as a tombstone until
 * max(expiration, stored_at + max_ttl) + clock_skew. Signers never sign an
 * expiration beyond their clock plus max_ttl (record.h), so every older
 * version of the record has expired by then, and a replayed lower or equal
 * seq is refused (-ESTALE) for as long as it could still be alive. At most
 * max_tombstones are kept; past that an ending entry leaves none (only
 * replay protection for that slot is weakened, and only on this node). A
 * node that never saw the newer version cannot know it: readers take the
 * highest seq among the replicas.
 *
 * Quotas. Each live entry is charged its key, subkey and value lengths
 * plus HM_DHT_STORE_ENTRY_COST to the peer that stored it (by node id), to
 * the network origin it came from (src/base/origin.h: the sender's /24 or
 * /48, a local address whole) and to the totals. Identities are free, so
 * the origin is what bounds a flood:
 *   - a record that would take its storer past max_peer_bytes, or its
 *     origin past max_origin_share (12%) of max_bytes or of max_entries, is
 *     refused with -EDQUOT;
 *   - a record that would take the store past max_bytes or max_entries
 *     evicts instead: the oldest stored entry of the heaviest origin (by
 *     entries when entries are short, by bytes otherwise) ends, as if it
 *     had expired (an owned one leaves its tombstone), again until the
 *     record fits, but only while that origin holds more than the storing
 *     origin will hold with the record. A store full of a flood thus makes
 *     room for any lighter origin, and an origin is refused (-ENOSPC) only
 *     when it is itself among the heaviest: when full, every origin keeps
 *     at least its fair share, and a flood from few origins cannot shut
 *     out the rest.
 * Before refusing or evicting for quota the store sweeps expired entries
 * (at most once per second of now, so refusals stay cheap). Eviction costs
 * O(origins) per entry ended.
 *
 * Gets return the live entries of a key_id: the plain value, or the
 * dictionary's subkeys in subkey byte order (shorter first on a common
 * prefix), paged by bytes of wire form. Views point into the store and
 * stay valid until the next call that changes it (put, sweep, free).
 */
#ifndef HM_DHT_STORE_H
#define HM_DHT_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "dht/record.h"
#include "src/base/origin.h"

/* Bytes charged per entry on top of its key, subkey and value. */
#define HM_DHT_STORE_ENTRY_COST 128

typedef struct hm_dht_store hm_dht_store;

typedef struct hm_dht_store_config {
    size_t max_value;      /* value cap, default and most HM_DHT_VALUE_MAX */
    double max_ttl;        /* seconds, default 86400 */
    double clock_skew;     /* seconds of tolerance for owned expirations, default 60 */
    size_t max_bytes;      /* total charge, default 64 MiB */
    size_t max_entries;    /* live entries, default 65536 */
    size_t max_peer_bytes; /* charge per storing peer, default 1 MiB */
    double max_origin_share; /* charge and entries per origin, as a fraction of
                                max_bytes and max_entries, in (0, 1], default 0.12 */
    size_t max_tombstones; /* default 16384 */
    uint8_t swarm_id[HM_SWARM_ID_BYTES]; /* signatures are bound to it */
} hm_dht_store_config;

/* Defaults, with swarm_id zero: the caller sets it. */
void hm_dht_store_config_default(hm_dht_store_config *cfg);

/* Returns 0, -EINVAL (a value out of range) or -ENOMEM. */
int hm_dht_store_new(const hm_dht_store_config *cfg, hm_dht_store **out);
void hm_dht_store_free(hm_dht_store *st);

/*
 * Stores r on behalf of the peer with node id storer, whose request came
 * from origin (NULL: the "none" origin), at wall time now.
 * Verifies the record itself (hm_dht_record_verify). Returns 0 when stored,
 * or: -EMSGSIZE (over a size cap), -EINVAL (malformed: empty key, bad
 * marker, non-finite time), -EPERM (key and subkey name different owners,
 * or a plain record would delete an owned subkey), -EBADMSG (owned record
 * without its owner's valid signature), -ETIME (already expired), -ERANGE
 * (owned record expiring too far ahead), -ESTALE (not newer than what is
 * stored, or a replayed seq), -EDQUOT (the storer's or its origin's
 * quota), -ENOSPC (store full and the origin among the heaviest), -ENOMEM.
 */
int hm_dht_store_put_from(hm_dht_store *st, const hm_dht_record *r,
                          const uint8_t storer[HM_NODE_ID_BYTES], const hm_origin *origin,
                          double now);
/* The same with the "none" origin (hm_origin_of(NULL)), for local callers. */
int hm_dht_store_put(hm_dht_store *st, const hm_dht_record *r,
                     const uint8_t storer[HM_NODE_ID_BYTES], double now);

typedef struct hm_dht_get_result {
    size_t n;           /* records written to out */
    int more;           /* more live subkeys follow the last one returned */
    int is_dict;        /* the key holds a dictionary (possibly empty after paging) */
    double expiration;  /* latest expiration among the key's live entries; 0 if none */
} hm_dht_get_result;

/*
 * Live entries of key_id at now. cursor (NULL to start) is the subkey of
 * the last record a previous page returned; the page holds the entries
 * after it, as many as fit in max_bytes of wire form
 * (hm_dht_record_encoded_size) and in out_cap. To continue, pass the last
 * returned record's subkey as the next cursor. A plain value ignores the
 * cursor. Returns 0 (n = 0 when nothing lives there), -EINVAL (out_cap 0,
 * or a cursor longer than HM_DHT_SUBKEY_MAX) or -EMSGSIZE (the first record
 * due does not fit in max_bytes, so the page could make no progress; any
 * max_bytes >= HM_DHT_RECORD_MAX_WIRE never gets it).
 */
int hm_dht_store_get(const hm_dht_store *st, const uint8_t key_id[HM_DHT_KEY_ID_BYTES],
                     double now, const uint8_t *cursor, size_t cursor_len, size_t max_bytes,
                     hm_dht_record *out, size_t out_cap, hm_dht_get_result *res);

/* -- held since --
 * hm_dht_store_get, and for each record returned the whole seconds this
 * store has held its value without a gap (held_out, out_cap entries; NULL:
 * none): since the first put of the slot that carried these value bytes
 * while no live entry of the slot carried them. An owner's refreshes (a
 * higher seq, the same value) keep the time; another value, or a put after
 * the entry ended (expired, evicted), starts it again. It is the store's
 * own observation, kept in the entry (bounded and charged with it), so a
 * storer cannot be told an older time. Readers combine the times of
 * several replicas (dht.h, hm_dht_value.held_s).
 */
int hm_dht_store_get_held(const hm_dht_store *st, const uint8_t key_id[HM_DHT_KEY_ID_BYTES],
                          double now, const uint8_t *cursor, size_t cursor_len, size_t max_bytes,
                          hm_dht_record *out, uint32_t *held_out, size_t out_cap,
                          hm_dht_get_result *res);

/* Frees expired entries and ended tombstones; returns how many entries went. */
size_t hm_dht_store_sweep(hm_dht_store *st, double now);

typedef struct hm_dht_store_stats {
    size_t keys;       /* key ids with live entries or tombstones */
    size_t entries;    /* live entries (expired ones count until swept) */
    size_t bytes;      /* total charge */
    size_t tombstones;
    size_t peers;      /* storers with a charge */
    size_t origins;    /* origins with a charge */
    uint64_t refused_peer;   /* puts refused for the storer's quota (max_peer_bytes) */
    uint64_t refused_origin; /* puts refused for the origin's share */
    uint64_t refused_full;   /* puts refused when out of entries, the origin among the heaviest */
    uint64_t refused_full_bytes; /* the same when out of bytes */
    uint64_t evicted;        /* entries ended to make room */
} hm_dht_store_stats;

/* Current charge and entries of one origin. */
void hm_dht_store_origin_usage(const hm_dht_store *st, const hm_origin *o, size_t *bytes,
                               size_t *entries);

void hm_dht_store_stats_get(const hm_dht_store *st, hm_dht_store_stats *out);
/* Current charge of one storer. */
size_t hm_dht_store_peer_bytes(const hm_dht_store *st, const uint8_t storer[HM_NODE_ID_BYTES]);

#endif

/*
 * dht: the Kademlia protocol core of one node. Sans-I/O, in the manner of
 * jech/dht: it never touches a socket or a clock. The owner feeds it
 * received datagrams and the time (hm_dht_input), calls hm_dht_periodic by
 * the deadline it returns, and gives it a send function at creation. The
 * node (src/node/node.c) drives it over the transport's one-way datagram channel;
 * the simulator (tests/sim/dht_sim.c) drives thousands of them over a
 * virtual network in virtual time, deterministically from a seed.
 *
 * It owns the routing table (routing.h), the record store (store.h), the
 * lookups in flight, the outstanding requests, the per-address rate limiter
 * and the token secrets.
 *
 * Time. Every entry point takes now_ms: milliseconds on the DHT clock,
 * which is UNIX time (record expirations are absolute UNIX times shared by
 * all nodes). The node passes a monotonic clock anchored to the wall clock
 * at start, so that timeouts never jump; the simulator passes virtual time.
 *
 * Messages (msgpack, each one datagram body; see proto.h for the exact
 * forms): PING, FIND_NODE(target), GET(key_id, cursor), STORE(token,
 * record), and their replies. Every request carries a transaction id; a
 * reply is accepted only from the peer the request went to, with a
 * matching id, before the request's timeout. Every reply carries a token
 * the requester must present to STORE (BEP 5 style: BLAKE2b keyed with a
 * secret rotated every 5 minutes, over the requester's key and address; the
 * previous secret is still accepted). A request that carries no valid
 * token for its sender's address is answered with a reply no larger than
 * the request itself (the token and whatever contacts fit), so the DHT
 * cannot be used to amplify traffic towards a spoofed address; requesters
 * that hold no token for a peer yet pad their requests (proto.h).
 *
 * Lookups are iterative: alpha requests in flight, candidates ordered by
 * XOR distance to the target, finished when the k closest candidates seen
 * have answered (or failed), or at the operation's deadline. A lookup's or
 * a put's request that times out is sent once more (the same body, the
 * same transaction id) before its contact counts as failed, even when its
 * operation has finished meanwhile, so that one lost datagram on a lossy
 * link costs a second, not a replica or a contact. A contact whose last
 * request timed out is a suspect for 60 s: asked without a slot of alpha,
 * and a get that has found the value and num_replicas answers (every
 * other of the k closest having answered or failed) does not wait for it.
 * With
 * disjoint_paths = d > 1, d lookups run side by side over disjoint sets of
 * nodes (S/Kademlia), so nodes that return wrong contacts on one path
 * cannot capture the others; a get succeeds if any path finds the value.
 *
 * get(key) returns the freshest record found among the replicas (for a
 * dictionary, the freshest per subkey, merged) and then stores the result
 * at the closest node on the path that did not have it (caching along the
 * lookup path). put(key, ...) looks up the key, then STOREs to the
 * num_replicas closest nodes that answered, and reports how many accepted.
 * A record whose key or subkey names this node as owner is signed here.
 *
 * Defences: per-address request rate limit (token bucket) with a temporary
 * ban for addresses that keep exceeding it; a bound on concurrent lookups;
 * the routing table's subnet limits and blacklist; the store's quotas per
 * identity and per network origin, with eviction from the heaviest origin;
 * replies from a peer we did not ask, or with an unknown id, are dropped.
 *
 * Client mode: the node queries and stores but answers no DHT requests and
 * asks others (a flag in every request) not to put it in their routing
 * tables.
 *
 * Callbacks of get/put fire exactly once (result, -ETIMEDOUT at the
 * deadline, -ECANCELED on hm_dht_cancel or hm_dht_free); never from inside
 * the call that started the operation.
 */
#ifndef HM_DHT_H
#define HM_DHT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "src/base/crypto.h"
#include "dht/record.h"
#include "dht/routing.h"
#include "dht/store.h"

typedef struct hm_dht hm_dht;

typedef struct hm_dht_io {
    void *ud;
    /* Sends one datagram body to the peer; 0 or a negative error. */
    int (*send)(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                const uint8_t *msg, size_t len);
    /* Fills buf with random bytes (randombytes_buf, or a seeded PRNG in the simulator). */
    void (*random)(void *ud, void *buf, size_t len);
} hm_dht_io;

typedef struct hm_dht_config {
    unsigned k;                  /* default 20 */
    unsigned alpha;              /* requests in flight per lookup path, default 3 */
    unsigned disjoint_paths;     /* default 1; 3 against malicious nodes */
    unsigned num_replicas;       /* default 5 */
    /*
     * A request is sent a second time (lookups and stores) and fails on
     * request_timeout_ms. Before that, at an adaptive timeout (RFC 6298's
     * smoothed RTT plus four deviations, or twice the contact's own RTT
     * when that is longer, within [request_timeout_min_ms,
     * request_timeout_ms]), a lookup stops waiting for it once k others
     * answered. defaults 200 and 1000.
     */
    uint64_t request_timeout_ms;
    uint64_t request_timeout_min_ms;
    unsigned max_lookups;        /* concurrent lookups, default 64 */
    size_t max_datagram;         /* largest body we send, default HM_DGRAM_MAX_PAYLOAD - 16 */
    double rate_per_s;           /* requests per second per address, default 200 */
    double rate_burst;           /* default 400 */
    uint64_t rate_ban_ms;        /* default 60000 */
    int client_mode;
    hm_rt_config rt;             /* zero fields: routing.h defaults */
    hm_dht_store_config store;   /* zero fields: store.h defaults; swarm_id set by hm_dht_new */
} hm_dht_config;

void hm_dht_config_default(hm_dht_config *cfg);

/* swarm_id binds record signatures to the swarm. */
int hm_dht_new(const hm_identity *id, const uint8_t swarm_id[HM_SWARM_ID_BYTES],
               const hm_dht_config *cfg, const hm_dht_io *io, uint64_t now_ms, hm_dht **out);
/* Fires every pending callback with -ECANCELED, then frees. */
void hm_dht_free(hm_dht *d);

/* A datagram body from an authenticated peer. Never trusts its contents. */
void hm_dht_input(hm_dht *d, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                  const uint8_t *msg, size_t len, uint64_t now_ms);
/* Runs timeouts, refreshes, token rotation and store expiry; returns the
 * next time it wants to be called (absolute, same clock). Starting an
 * operation (get, put, bootstrap) sends requests whose timeouts may fall
 * before that time: call hm_dht_periodic again after starting one (it
 * fires nothing early and returns the new deadline). Callbacks of
 * operations that finish fire from hm_dht_input, hm_dht_periodic and
 * hm_dht_cancel only, never from the call that started them; io->send
 * must not call back into the node. */
uint64_t hm_dht_periodic(hm_dht *d, uint64_t now_ms);

/* Pings the peer and, once it answers, looks up our own id (joins). */
int hm_dht_bootstrap(hm_dht *d, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *addr,
                     uint64_t now_ms);

typedef struct hm_dht_value {
    hm_dht_record rec;                  /* points into memory valid during the callback */
    uint8_t source_pk[HM_PK_BYTES];     /* the node that returned it */
    /*
     * -- held since -- How long the key's replicas have held this entry's
     * value without a gap (store.h, hm_dht_store_get_held), in seconds:
     * each replica that answered with records of the key says how long it
     * held this one (0 where it holds none of it); the replicas of one
     * network origin (the address they answered from; this node's own
     * store is an origin of its own) count as one, with their lower
     * median; the value is the lower median over the origins. A storer's
     * time is its own observation, so one hostile storer, or many on one
     * origin, cannot make it older: that takes more than half of the
     * origins. Replicas that did not tell (older nodes) do not vote; -1
     * when none told. Readers use it to keep a name with the owner that
     * has held it longest (moe/client.h).
     */
    int64_t held_s;
} hm_dht_value;

/* What a lookup cost, for the simulator and the metrics. */
typedef struct hm_dht_lookup_info {
    unsigned hops;        /* longest referral chain from our table to the nodes that answered
                             (for a get: to the first node that returned the value) */
    unsigned requests;    /* requests sent by this operation, STOREs included */
    unsigned timeouts;
    uint64_t duration_ms;
} hm_dht_lookup_info;

/*
 * status 0 with n >= 1 values (one plain value, or the merged dictionary's
 * subkeys), status 0 with n = 0 when no replica holds the key, or negative.
 */
typedef void (*hm_dht_get_cb)(void *ud, int status, const hm_dht_value *values, size_t n,
                              const hm_dht_lookup_info *info);
typedef void (*hm_dht_put_cb)(void *ud, int status, unsigned stored,
                              const hm_dht_lookup_info *info);

int hm_dht_get(hm_dht *d, const uint8_t *key, size_t key_len, uint64_t now_ms,
               uint64_t timeout_ms, hm_dht_get_cb cb, void *ud, uint64_t *op_out);
/*
 * Stores (key, subkey, value) with an absolute expiration (UNIX seconds).
 * status 0 when at least one replica accepted it, stored = how many did.
 */
int hm_dht_put(hm_dht *d, const uint8_t *key, size_t key_len, const uint8_t *subkey,
               size_t subkey_len, int has_subkey, const uint8_t *value, size_t value_len,
               double expiration, uint64_t now_ms, uint64_t timeout_ms, hm_dht_put_cb cb,
               void *ud, uint64_t *op_out);
/*
 * Several gets under one deadline, for callers that look up many keys at
 * once (a beam search over an expert grid, a matchmaking scan). At most
 * HM_DHT_MANY_MAX keys; lookups start as slots under max_lookups free up,
 * so a large batch never starves other operations of more than it needs.
 * cb fires once, when every key has an answer or the deadline passed, with
 * one result per key in the order given (values valid during the
 * callback). Returns 0, -EINVAL, -EMSGSIZE (too many keys) or -ENOMEM.
 */
#define HM_DHT_MANY_MAX 256
typedef struct hm_dht_many_result {
    int status;                 /* as a single get's: 0 (n = 0: not found) or negative */
    const hm_dht_value *values;
    size_t n;
} hm_dht_many_result;
typedef void (*hm_dht_get_many_cb)(void *ud, const hm_dht_many_result *results, size_t n_keys);
int hm_dht_get_many(hm_dht *d, const uint8_t *const *keys, const size_t *key_lens, size_t n_keys,
                    uint64_t now_ms, uint64_t timeout_ms, hm_dht_get_many_cb cb, void *ud);

/* Cancels an operation: its callback fires now with -ECANCELED. 0 or -ENOENT. */
int hm_dht_cancel(hm_dht *d, uint64_t op);

typedef struct hm_dht_stats {
    size_t rt_size, rt_depth, rt_buckets, rt_cached;
    size_t records, record_bytes;
    size_t lookups_active;
    uint64_t requests_sent, requests_received, replies_received, timeouts;
    uint64_t rate_limited, bad_messages;
    uint64_t lookups_done, gets_ok, gets_failed, puts_ok, puts_failed;
    uint64_t store_evicted;  /* stored entries ended to make room (store.h) */
} hm_dht_stats;
void hm_dht_get_stats(const hm_dht *d, hm_dht_stats *out);
/* Switches client mode at run time (a node that learns nobody can reach
 * it): later messages carry the flag, and requests go unanswered. */
void hm_dht_set_client_mode(hm_dht *d, int on);
const hm_rt *hm_dht_routing(const hm_dht *d);
/* Emits DhtRequestRate (requests dropped by the rate limit), DhtStorePeerKiB,
 * DhtStoreOriginShare, DhtStoreEntries and DhtStoreMiB (STOREs refused by the
 * store's per-identity quota, per-origin share, and when out of entries or
 * bytes with the storer's origin among the heaviest; docs/security.md). */
void hm_dht_limits(const hm_dht *d, hm_limit_emit_fn emit, void *ud);

#endif

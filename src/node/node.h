/*
 * node: one hivemindd node. It owns the identity, the rpc layer (and through
 * it the transport), the peer table and the timers that keep the peer table
 * fresh, and the DHT (dht.h); the averager and the expert server will hang
 * off it too.
 * It runs on a caller-provided libuv loop and keeps no global state, so one
 * process can run many nodes (tests, simulations). The process must ignore
 * SIGPIPE (hivemindd does): libuv writes to TCP sockets with write(2), and
 * a peer that closes while a write is in flight would raise it.
 *
 * Peers. Every authenticated datagram or stream message refreshes its
 * sender's entry (address, last seen), or adds one. Identities are free,
 * so places are counted by network origin (src/base/origin.h): one origin
 * holds at most max_peers_per_origin places, and a full table (max_peers)
 * makes room for a newcomer from a lighter origin by evicting from the
 * heaviest origin its newest peer that never answered our ping (else its
 * newest), so verified, long-lived and diverse peers stay. The node pings
 * each known peer every ping_interval_ms (with jitter) over a datagram,
 * which measures the round-trip time and verifies the peer's address; the
 * max_stream_pings verified peers known longest are also pinged over their
 * stream, which keeps a connection warm (pings never open a connection to
 * every peer of a large table). A peer that misses max_ping_failures
 * datagram pings in a row is dropped from the table.
 * Initial peers (PEERID@HOST:PORT) are pinged at start and retried with
 * backoff until they answer.
 */
#ifndef HM_NODE_H
#define HM_NODE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "src/base/crypto.h"
#include "dht/dht.h"
#include "src/net/rpc.h"
#include "src/net/relay.h"
#include "src/net/transport.h"
#include "src/node/reach.h"

typedef struct hm_node hm_node;

#define HM_NODE_MAX_INITIAL_PEERS 64

typedef struct hm_node_options {
    const char *listen;                /* "HOST:PORT", default "127.0.0.1:0" */
    const char *const *initial_peers;  /* PEERID@HOST:PORT strings */
    size_t n_initial_peers;
    const char *state_dir;             /* identity at STATE_DIR/identity.key; NULL: ephemeral */
    const char *swarm;                 /* default "default" */
    const uint8_t *swarm_key;          /* 32 bytes or NULL */
    int client_mode;                   /* DHT client: queries and stores, serves no DHT requests */
    uint64_t ping_interval_ms;         /* default 15000 */
    unsigned max_ping_failures;        /* default 4 */
    size_t max_peers;                  /* peer table cap, default 4096 */
    size_t max_peers_per_origin;       /* places one network origin may hold, default 64 */
    unsigned max_stream_pings;         /* peers pinged over a stream each round, default 32 */
    hm_dht_config dht;                 /* zero fields take defaults */
    hm_transport_config transport;     /* zero fields take defaults */
    hm_rpc_config rpc;
    /* ---- the declared address (reach.h) ---- */
    const char *announce;              /* "HOST:PORT" to declare; NULL/"": detect */
    hm_reach_config reach;             /* zero fields take defaults; announce is set from above */
    /* ---- relays (src/net/relay.h): serving them, and using RelayVia when unreachable ---- */
    hm_relay_config relay;
} hm_node_options;

typedef struct hm_peer_info {
    uint8_t pk[HM_PK_BYTES];
    char peer_id[HM_PEER_ID_LEN + 1];
    struct sockaddr_storage addr;     /* last UDP/listen address seen */
    uint64_t last_seen_ms;            /* monotonic, hm_now_ms() */
    double rtt_ms;                    /* smoothed; < 0 until measured */
    int connected;                    /* a stream is up */
    unsigned failures;                /* consecutive missed pings */
    int verified;                     /* it answered our datagram ping at addr */
} hm_peer_info;

/* On failure err holds a sentence for the operator. */
int hm_node_new(uv_loop_t *loop, const hm_node_options *opts, hm_node **out, char *err,
                size_t errlen);
const hm_identity *hm_node_identity(const hm_node *n);
/*
 * PEERID@HOST:PORT of this node: the declared address (hm_node_announce)
 * when there is one, else the address it listens on, for local use.
 */
int hm_node_address(const hm_node *n, char *buf, size_t len);
/*
 * The address this node declares to others (expert records, state and
 * group declarations): 0, or -EADDRNOTAVAIL when it has none that others
 * could dial (0.0.0.0 with no confirmed observation, loopback with peers
 * off loopback) or -ENETUNREACH when dial-backs showed nobody reaches it.
 * Modules read it each time they declare, since it can change.
 */
int hm_node_announce(hm_node *n, struct sockaddr_storage *out);
/*
 * Relays (relay.h). When dial-backs show nobody reaches us and RelayVia is
 * set, the node reserves with a relay and hm_node_announce declares the
 * relay's HOST:PORT: a dialler dials it with our key and the relay splices
 * it to us, end to end encrypted. hm_node_relay_set_active forces the
 * reservation on (1) or hands it back to reach.h (0); for tests and for
 * operators who know they are behind a NAT.
 */
void hm_node_relay(hm_node *n, hm_relay_status *out);
void hm_node_relay_set_active(hm_node *n, int active);
/*
 * -- relay failover -- cb(ud) runs on the loop when hm_node_announce's answer
 * may have changed because the relay changed (another relay, or none left),
 * so declarations can be redone at once instead of at their next refresh.
 * At most HM_NODE_ADDR_WATCHERS; -ENOSPC past that. Unwatch before ud goes.
 */
#define HM_NODE_ADDR_WATCHERS 4
int hm_node_watch_address(hm_node *n, void (*cb)(void *ud), void *ud);
void hm_node_unwatch_address(hm_node *n, void (*cb)(void *ud), void *ud);
typedef struct hm_node_reach_info {
    int reachable;                    /* HM_REACH_UNKNOWN, _YES, _NO */
    char source[16];                  /* "config", "observed", "listen", "none" */
    int declared;                     /* addr is declared */
    struct sockaddr_storage addr;     /* the candidate address */
    char reason[HM_REACH_REASON_LEN];
    int client_mode;                  /* configured, or switched on by ourselves */
    int auto_client_mode;             /* switched on because nobody reaches us */
    uint64_t dialbacks_ok, dialbacks_failed, dialbacks_served;
} hm_node_reach_info;
int hm_node_reach(hm_node *n, hm_node_reach_info *out);
const char *hm_node_swarm(const hm_node *n);
uint64_t hm_node_uptime_ms(const hm_node *n);
hm_rpc *hm_node_rpc(hm_node *n);
uv_loop_t *hm_node_loop(hm_node *n);

/*
 * The node's DHT (dht.h), driven over the rpc layer's one-way datagram
 * channel and a timer. Initial peers and every peer added later also
 * bootstrap the DHT. The DHT clock is the wall clock read once at start and
 * advanced by the monotonic clock, so that its timeouts never jump.
 */
hm_dht *hm_node_dht(hm_node *n);
uint64_t hm_node_dht_now_ms(const hm_node *n);
int hm_node_dht_get(hm_node *n, const uint8_t *key, size_t key_len, uint64_t timeout_ms,
                    hm_dht_get_cb cb, void *ud);
int hm_node_dht_get_many(hm_node *n, const uint8_t *const *keys, const size_t *key_lens,
                         size_t n_keys, uint64_t timeout_ms, hm_dht_get_many_cb cb, void *ud);
/* ttl_s is relative; the record expires at DHT time + ttl_s. */
int hm_node_dht_put(hm_node *n, const uint8_t *key, size_t key_len, const uint8_t *subkey,
                    size_t subkey_len, int has_subkey, const uint8_t *value, size_t value_len,
                    double ttl_s, uint64_t timeout_ms, hm_dht_put_cb cb, void *ud);

/* Adds PEERID@HOST:PORT and pings it now. 0, -EINVAL or -ENOBUFS. */
int hm_node_add_peer(hm_node *n, const char *addr);
/* Copies up to max entries; returns the total number of peers. */
size_t hm_node_peers(const hm_node *n, hm_peer_info *out, size_t max);
/* The entry of one peer, as hm_node_peers gives it: 0, or -ENOENT when pk is not in the table. */
int hm_node_peer_get(hm_node *n, const uint8_t pk[HM_PK_BYTES], hm_peer_info *out);

/*
 * Renders Prometheus text exposition (version 0.0.4) into a malloc'd string:
 * peers, bytes in/out, datagrams, connections, RPCs by method and result and
 * the RPC latency histogram. Returns NULL on allocation failure.
 */
char *hm_node_metrics(hm_node *n);
/* Calls emit once per limit the node, its transport and its DHT enforce. */
void hm_node_limits(hm_node *n, hm_limit_emit_fn emit, void *ud);

/* Stops timers, closes rpc and transport; cb fires after everything is
 * freed. */
void hm_node_close(hm_node *n, void (*cb)(void *ud), void *ud);

#endif

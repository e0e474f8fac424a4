/*
 * reach: the address a node declares to others, and whether anyone can
 * dial it (docs/protocol.md "Reachability"). Internal to src/node: the node
 * owns one and feeds it; the rest of the tree asks through node.h
 * (hm_node_announce, hm_node_reach).
 *
 * What is declared, in order of preference:
 *   - config: the operator's Announce HOST:PORT;
 *   - observed: the address peers see our datagrams come from, which their
 *     authenticated ping replies carry, counted only when peers of at least
 *     HM_REACH_MIN_ORIGINS different network origins (origin.h) agree, and
 *     declared only once a peer dialled it back;
 *   - listen: the address we listen on, when it is one address (not
 *     0.0.0.0 or ::).
 * A loopback address is never declared while we know peers off loopback,
 * and 0.0.0.0 or :: never: with nothing better the node declares nothing,
 * and says why.
 *
 * Dial-back. A candidate that is not a loopback listen address is
 * confirmed by asking peers of different origins, over an authenticated
 * datagram rpc (node.dialback {"addr": "HOST:PORT"}), to open a fresh TCP
 * connection to us there and run the handshake (hm_transport_probe). One
 * success makes us reachable; failures from HM_REACH_FAIL_ORIGINS
 * different origins, or no inbound connection in inbound_timeout_ms while
 * peers of several origins answer us, make us unreachable: the node then
 * declares nothing and switches its DHT to client mode (mode_cb), and
 * switches back when a later dial-back succeeds.
 *
 * The asked side dials only the IP the request came from (any port: the
 * port we listen on need not be the one a NAT maps our datagrams to), and
 * only for a peer that answered our ping at that IP (a datagram's source
 * IP can be spoofed, its key cannot), at
 * most max_dialbacks probes at once, one at a time per origin and at most
 * dialback_rate_per_origin a minute per origin, so a swarm member cannot
 * make us dial a third party, nor flood its own host with our handshakes.
 *
 * It owns its observer table, its timer and the dial-back handler; all on
 * the loop thread.
 */
#ifndef HM_NODE_REACH_H
#define HM_NODE_REACH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "src/base/origin.h"
#include "src/net/rpc.h"

#define HM_REACH_METHOD "node.dialback"
#define HM_REACH_MIN_ORIGINS 2  /* origins that must agree on an observed address */
#define HM_REACH_FAIL_ORIGINS 2 /* origins whose dial-back failed: unreachable */
#define HM_REACH_OBSERVERS 64   /* peers whose observation we keep */
#define HM_REACH_REASON_LEN 160

typedef struct hm_reach hm_reach;

enum { HM_REACH_UNKNOWN = 0, HM_REACH_YES = 1, HM_REACH_NO = 2 };

typedef struct hm_reach_config {
    int has_announce;                 /* announce is set (config) */
    struct sockaddr_storage announce;
    unsigned dialback_rate_per_origin; /* dial-backs we run for one origin a minute, default 6 */
    size_t max_dialbacks;              /* dial-backs we run at once, default 16 */
    uint64_t check_ms;                 /* while undecided, default 2000 */
    uint64_t recheck_ms;               /* once decided, default 300000 */
    uint64_t inbound_timeout_ms;       /* default 600000 */
    /*
     * Whether pk answered one of our datagram pings at an address with the
     * IP of from. A datagram's source IP is not authenticated, only its
     * key: without this, a member could spoof a third party's IP and have
     * us dial it. NULL: every asker passes (tests of this module only).
     */
    int (*peer_verified)(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from);
    void *peer_verified_ud;
} hm_reach_config;

typedef struct hm_reach_status {
    int reachable;                     /* HM_REACH_* */
    const char *source;                /* "config", "observed", "listen" or "none" */
    int declared;                      /* addr is what we declare */
    struct sockaddr_storage addr;      /* the candidate (declared or not) */
    char reason[HM_REACH_REASON_LEN];  /* why, for info and the log */
    uint64_t dialbacks_ok, dialbacks_failed; /* our requests' answers */
    uint64_t dialbacks_served;         /* probes run for others */
} hm_reach_status;

/* client_mode 1: nobody can reach us; 0: we are reachable again. */
typedef void (*hm_reach_mode_cb)(void *ud, int client_mode, const char *reason);

int hm_reach_new(uv_loop_t *loop, hm_rpc *rpc, const hm_reach_config *cfg, hm_reach_mode_cb cb,
                 void *ud, hm_reach **out);
/* A datagram ping reply from pk, which we reach at peer_addr, saw us at observed. */
void hm_reach_observed(hm_reach *r, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *peer_addr,
                       const struct sockaddr *observed);
/* Forgets pk (it left the peer table). */
void hm_reach_forget(hm_reach *r, const uint8_t pk[HM_PK_BYTES]);
/* The address to declare: 0, or -EADDRNOTAVAIL (none) / -ENETUNREACH (nobody reaches us). */
int hm_reach_declared(hm_reach *r, struct sockaddr_storage *out);
void hm_reach_get_status(hm_reach *r, hm_reach_status *out);
void hm_reach_limits(const hm_reach *r, hm_limit_emit_fn emit, void *ud);
/* Stops the timer and sends nothing more; call before the rpc layer closes. */
void hm_reach_stop(hm_reach *r);
/* Frees it; only after the rpc layer closed (every callback has fired). */
void hm_reach_free(hm_reach *r, void (*cb)(void *ud), void *ud);

/* Parsers of untrusted bytes (tests/fuzz/fuzz_reach.c). 0 or -EPROTO. */
int hm_reach_parse_request(const uint8_t *body, size_t len, struct sockaddr_storage *addr_out);
int hm_reach_parse_reply(const uint8_t *body, size_t len, int *reached_out, int *error_out);
int hm_reach_parse_ping_reply(const uint8_t *body, size_t len, struct sockaddr_storage *observed_out);

#endif

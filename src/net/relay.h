/*
 * relay: circuit relays for peers nobody can dial (docs/protocol.md
 * "Relays", docs/security.md "Relays").
 *
 * Two roles, both optional, in one object that hangs off the rpc layer.
 *
 * Serving (Relay yes). A NAT'd peer reserves a slot with relay.reserve over
 * its authenticated stream to us, and refreshes it; the reservation lives
 * reservation_ttl_ms past the last refresh. A dialler reaches that peer by
 * dialling *our* HOST:PORT with the peer's key, exactly as it would dial
 * the peer: its handshake msg1 names the server key it expects, the
 * transport sees a key that is not ours and hands us the socket
 * (hm_transport_set_divert) before any cryptography. With a reservation
 * and room in the budgets we hold the dialler's bytes, ask the peer
 * (relay.connect {"token": 32 random bytes}, on its reserved connection)
 * to open a fresh TCP connection to us that starts with the ACCEPT
 * preamble carrying the token, then write the held bytes to it and copy
 * both sockets byte for byte. The handshake and every record run end to
 * end between the dialler and the peer: we never hold a key, and see only
 * the public keys of msg1 and ciphertext.
 *
 * Budgets: reservations in total and per origin (origin.h) of the peer,
 * circuits in total and per origin of the dialler, bytes per circuit over
 * its life, a rate per circuit (the copy pauses when over it), a lifetime
 * per circuit, and accept_timeout_ms for the peer to call back. Each
 * refusal is counted under its config keyword (hm_relay_limits).
 * relay.connect names the dialler's address ("from"). The peer admits the
 * connection as an inbound one (hm_transport_accept_relayed), from that
 * origin when it believes it (a RelayVia relay, and an address no more
 * local than the relay's), from the relay's address otherwise, so diallers
 * behind a configured relay are told apart.
 *
 * Using relays (RelayVia, or relays the node found advertised in the DHT:
 * hm_relay_set_found). hm_relay_client_set_active(1) (the node calls it
 * when reach.h finds nobody dials us) reserves with the configured relays
 * in order, refreshes every refresh_ms and at once when the connection to
 * the relay goes away, and on a failed reservation or refresh moves to
 * the next one; with every relay failing it says so (the
 * status and the log), and tries again from the first after a back-off
 * (retry_min_ms doubling up to retry_max_ms). relay.connect is answered
 * only for the relay we hold a reservation with, and we dial only its
 * configured address.
 *
 * Everything runs on the loop thread.
 */
#ifndef HM_NET_RELAY_H
#define HM_NET_RELAY_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "src/base/crypto.h"
#include "src/base/origin.h"
#include "src/base/wire.h"
#include "src/net/rpc.h"

#define HM_RELAY_METHOD_RESERVE "relay.reserve"
#define HM_RELAY_METHOD_CONNECT "relay.connect"
#define HM_RELAY_VERSION 1
#define HM_RELAY_KIND_ACCEPT 1
#define HM_RELAY_TOKEN_BYTES 32
#define HM_RELAY_MAX_VIA 8
#define HM_RELAY_ADDR_LEN 160 /* PEERID@HOST:PORT */
#define HM_RELAY_REASON_LEN 384

typedef struct hm_relay hm_relay;

typedef struct hm_relay_via {
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr;
} hm_relay_via;

typedef struct hm_relay_config {
    /* ---- serving ---- */
    int serve;                        /* Relay yes */
    size_t max_reservations;          /* RelayMaxReservations, default 128 */
    size_t reservations_per_origin;   /* RelayReservationsPerOrigin, default 4 */
    size_t max_circuits;              /* RelayMaxCircuits, default 64 */
    size_t circuits_per_origin;       /* RelayCircuitsPerOrigin, default 8 */
    uint64_t max_circuit_bytes;       /* RelayMaxMiB (per circuit, both ways), default 256 MiB */
    uint64_t rate;                    /* RelayRate bytes/s per circuit, default 16 MiB/s */
    uint64_t circuit_lifetime_ms;     /* RelayCircuitLifetime, default 3600 s */
    uint64_t reservation_ttl_ms;      /* default 60000 */
    uint64_t accept_timeout_ms;       /* the peer's call back, default 10000 */
    /* ---- using relays ---- */
    size_t n_via;
    hm_relay_via via[HM_RELAY_MAX_VIA]; /* RelayVia, in order */
    uint64_t refresh_ms;              /* default 5000: a relay gone silent is left within
                                       * it and a call's 5 s timeout */
    uint64_t retry_min_ms;            /* default 1000 */
    uint64_t retry_max_ms;            /* default 60000 */
} hm_relay_config;

void hm_relay_config_defaults(hm_relay_config *cfg);

enum { HM_RELAY_OFF = 0, HM_RELAY_RESERVING = 1, HM_RELAY_RESERVED = 2, HM_RELAY_NONE = 3 };

typedef struct hm_relay_status {
    int state;                         /* HM_RELAY_* */
    const char *state_name;            /* "off", "reserving", "reserved", "none" */
    int via_index;                     /* the relay in use or being tried, -1: none */
    char relay[HM_RELAY_ADDR_LEN];     /* PEERID@HOST:PORT of it, "" when none */
    char address[HM_RELAY_ADDR_LEN]; /* our relayed address, "" unless reserved */
    char reason[HM_RELAY_REASON_LEN];  /* why, for info and the log */
    uint64_t failovers;                /* moves to another relay */
    uint64_t accepts;                  /* relayed connections we opened */
    uint64_t refused_dialler_origin;   /* ... refused by the inbound admission rules, charged to
                                        * the dialler's origin (or the relay's, below) */
    uint64_t dialler_not_taken;        /* relay.connect named a dialler we did not believe
                                        * (dialler_to_trust): charged to the relay's address */
    /* serving */
    int serving;
    size_t reservations, circuits;
    uint64_t circuits_total, bytes_relayed;
} hm_relay_status;

int hm_relay_new(uv_loop_t *loop, hm_rpc *rpc, const hm_identity *id, const hm_relay_config *cfg,
                 hm_relay **out);
/* Starts (1) or stops (0) reserving with the RelayVia relays. */
void hm_relay_client_set_active(hm_relay *r, int active);
int hm_relay_client_active(const hm_relay *r);
/*
 * Relays found elsewhere (the node reads those advertised in the DHT) for a
 * node whose RelayVia names none: taken only then, and only while no relay
 * is in use or being tried (state off or none); a node in state none starts
 * reserving with them at once. Returns 1 when taken.
 */
int hm_relay_set_found(hm_relay *r, const hm_relay_via *via, size_t n);
/* Whether RelayVia named relays (the DHT is then not read for others). */
int hm_relay_configured(const hm_relay *r);
/* The relay's address we are reachable at: 0, or -ENOENT with no reservation. */
int hm_relay_declared(hm_relay *r, struct sockaddr_storage *out);
void hm_relay_get_status(hm_relay *r, hm_relay_status *out);
/*
 * -- relay failover -- cb runs (on the loop) whenever our relayed address
 * changes: a reservation with another relay, or none left. The node re-declares
 * its experts with it. One callback; NULL removes it.
 */
void hm_relay_set_notify(hm_relay *r, void (*cb)(void *ud), void *ud);
void hm_relay_limits(const hm_relay *r, hm_limit_emit_fn emit, void *ud);
/* Closes every circuit and timer and sends nothing more; before the rpc layer closes. */
void hm_relay_stop(hm_relay *r);
/* Frees it once every handle has closed and (after the rpc layer closed) every call returned. */
void hm_relay_free(hm_relay *r, void (*cb)(void *ud), void *ud);

/*
 * Parsers of untrusted bytes (tests/fuzz/fuzz_relay.c).
 * The ACCEPT preamble: 0 with the token, or -EPROTO.
 */
int hm_relay_parse_preamble(const uint8_t *p, size_t len, uint8_t token_out[HM_RELAY_TOKEN_BYTES]);
/* Writes the ACCEPT preamble for token into out (HM_TRANSPORT_RELAY_PREAMBLE bytes). */
void hm_relay_make_preamble(const uint8_t token[HM_RELAY_TOKEN_BYTES], uint8_t *out);
/* Writes relay.connect's body: the token and, unless from is NULL or
 * AF_UNSPEC, the dialler's address (HM_ADDRSTRLEN + 64 bytes suffice). */
void hm_relay_write_connect(hm_wire_wr *w, const uint8_t token[HM_RELAY_TOKEN_BYTES],
                            const struct sockaddr_storage *from);
/* relay.connect's body: 0 with the token and the dialler's address
 * (ss_family AF_UNSPEC when the relay named none), or -EPROTO. */
int hm_relay_parse_connect(const uint8_t *body, size_t len, uint8_t token_out[HM_RELAY_TOKEN_BYTES],
                           struct sockaddr_storage *from_out);
/* relay.reserve's reply: 0 with the reservation's ttl, or -EPROTO. */
int hm_relay_parse_reserve_reply(const uint8_t *body, size_t len, uint64_t *ttl_ms_out);
/*
 * RelayVia's value: "PEERID@HOST:PORT[,PEERID@HOST:PORT...]", at most
 * HM_RELAY_MAX_VIA entries and 4096 bytes. 0, or -EINVAL with err.
 */
int hm_relay_parse_via(const char *s, hm_relay_via *out, size_t *n_out, char *err, size_t errlen);

#endif

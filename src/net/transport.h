/*
 * transport: authenticated UDP datagrams and encrypted, multiplexed TCP
 * streams on one libuv loop, on one HOST:PORT (the UDP socket and the TCP
 * listener share the port number).
 *
 * It owns the UDP socket, the TCP listener, every connection, their write
 * queues and the datagram context (crypto.h). Connections are keyed by the
 * peer's public key and reused; one idle for idle_close_ms is closed. A
 * message handed to hm_transport_send is split into chunks of at most
 * HM_TRANSPORT_CHUNK bytes, and the writer takes chunks round-robin from the
 * messages queued on a connection, high priority first, so a 64 MB tensor
 * never holds back a small reply queued behind it.
 *
 * Bounds (docs/security.md): a frame (one message) is at most max_message
 * bytes. Write queues: bytes queued for one peer are capped at
 * max_queued_bytes, for one origin (origin.h) at wq_origin_bytes (a single
 * message always fits an origin with nothing queued) and for all peers at
 * wq_max_bytes; a send past a cap fails with -ENOBUFS, except that when the
 * total is full and another origin queues more than the sender's would, that
 * origin's fullest connection is closed instead (fair shedding). A
 * connection that makes no write progress for write_stall_ms while it has
 * data queued, or that drains slower than write_min_rate while over 1 MiB is
 * queued, is closed and its queue freed, so a peer that stops reading, or
 * reads a trickle, cannot make our memory grow; freed memory is handed back
 * to the system (malloc_trim). Reassembly of inbound messages is charged by
 * the bytes its buffers hold, which grow as chunks arrive (never by the size
 * a first chunk declares): at most 256 messages in progress per connection,
 * max_message + max_queued_bytes per connection, rasm_origin_bytes per
 * origin and rasm_max_bytes in total, where a lighter origin's new message
 * sheds the stalest message of the heaviest one. A message past a cap is
 * refused, not the connection: its chunks are dropped as they arrive, and
 * the layer above is told (on_refused, with the message's first bytes) so
 * that it can tell the sender at once; one with no chunk for rasm_stall_ms
 * is dropped. Such refusal notices (HM_PRIO_NOTICE, tiny) have their own
 * allowance past the write-queue caps, notice_origin_bytes per origin.
 * A peer breaking the framing is disconnected. Connections are capped in
 * total, inbound ones also per origin and per identity, and admitted (or
 * refused with a reset) before any cryptography (see the admission fields
 * of hm_transport_config); handshakes must finish within
 * handshake_timeout_ms.
 *
 * A stream message to our own key is delivered to our own on_message from
 * the loop (never from inside the send), in order, without a connection;
 * at most max_queued_bytes wait at once.
 *
 * Fault injection (tests only, off by default): drop a fraction of outgoing
 * datagrams and stream messages, delay everything we send, stall (stop
 * reading and writing entirely, like a SIGSTOPped process), or partition
 * from a set of peers (their traffic is dropped both ways).
 */
#ifndef HM_TRANSPORT_H
#define HM_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "src/base/crypto.h"
#include "src/base/origin.h"
#include "src/net/delay_rules.h" /* -- netlab -- */

#define HM_TRANSPORT_CHUNK 16000

typedef struct hm_transport hm_transport;

typedef struct hm_transport_config {
    const char *listen;          /* "HOST:PORT"; port 0 picks a free one */
    size_t max_message;          /* default 80 MiB */
    size_t max_queued_bytes;     /* per peer, default 16 MiB above one message */
    size_t max_connections;      /* default 512 */
    uint64_t idle_close_ms;      /* default 120000 */
    uint64_t handshake_timeout_ms; /* default 5000 */
    uint64_t write_stall_ms;     /* default 30000 */
    size_t dgram_peers;          /* replay/key cache size, default 65536 */
    /* ---- connection admission and handshake work (docs/security.md) ---- */
    /*
     * Inbound connections are charged to their origin (origin.h). Inbound
     * ones may take at most max_connections - reserved_outbound slots, so
     * our own dials always find room; one origin holds at most
     * max_conns_per_origin of them, and at most max_handshakes_per_origin
     * still in their handshake (all origins: max_handshakes). When the
     * inbound share is full, a newcomer from an origin holding fewer
     * connections than the heaviest one evicts one of the heaviest origin's
     * (handshaking first, then the youngest), so long-lived peers of light
     * origins are never the ones to go. One identity keeps at most
     * max_conns_per_peer connections: a newer one retires its oldest (it
     * finishes what is on its way, 5-6 s at most; a simultaneous dial keeps
     * the one dialled by the smaller key at both ends).
     * Inbound handshakes cost an X25519 and a signature each and are rated
     * per origin (handshake_rate_per_origin per second, bursts of four
     * seconds' worth); datagrams from senders whose key is not cached yet
     * cost an X25519 each and are rated per origin and in total.
     */
    size_t max_conns_per_origin;      /* inbound, default max_connections / 8 (at least 8) */
    size_t max_handshakes;            /* inbound handshaking, default max_connections / 4 (>= 16) */
    size_t max_handshakes_per_origin; /* default max_handshakes / 4 (at least 4) */
    size_t max_conns_per_peer;        /* per identity, in and out, default 4 */
    size_t reserved_outbound;         /* slots inbound never takes, default max_connections / 8 */
    unsigned handshake_rate_per_origin;      /* inbound handshakes/s per origin, default 64 */
    unsigned dgram_new_key_rate_per_origin;  /* new-key datagrams/s per origin, default 64 */
    unsigned dgram_new_key_rate;             /* new-key datagrams/s in total, default 2048 */
    /* ---- reassembly and write queues against hostile members (docs/security.md) ---- */
    size_t rasm_max_bytes;       /* inbound messages in progress, all peers: default 512 MiB */
    size_t rasm_origin_bytes;    /* the same from one origin: default 2 max_message + 32 MiB */
    uint64_t rasm_stall_ms;      /* an inbound message with no chunk this long is dropped: 30000 */
    size_t wq_max_bytes;         /* bytes queued for all peers together: default 256 MiB */
    size_t wq_origin_bytes;      /* bytes queued for one origin: default 32 MiB */
    size_t write_min_rate;       /* bytes/s a connection holding over 1 MiB must drain:
                                  * default 256 KiB/s; SIZE_MAX turns the rule off */
    /* -- refusal notices -- */
    size_t notice_origin_bytes;  /* queued refusal notices past the caps, per origin: 64 KiB
                                  * (64 times that over all origins) */
    /* -- aead: the stream record cipher (crypto.h) -- */
    int stream_cipher; /* 0: auto (hm_rec_cipher_auto's list); else the one hm_rec_cipher id
                        * offered and accepted, so a peer without it is refused (-ENOPROTOOPT) */
    uint64_t rekey_records; /* tests only: records per key (both ends must agree); 0: the
                             * protocol's HM_REC_REKEY_RECORDS */
    /* -- netlab -- tests only: faults in force from the first send (copied; NULL: none) */
    const struct hm_transport_faults *faults;
} hm_transport_config;

/* Fills defaults for every zero field. */
void hm_transport_config_defaults(hm_transport_config *cfg);

typedef struct hm_transport_cbs {
    /* An authenticated datagram; from is the sender's UDP address. */
    void (*on_dgram)(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                     const uint8_t *msg, size_t len);
    /* A complete stream message from an authenticated peer. */
    void (*on_message)(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                       const uint8_t *msg, size_t len);
    /* A connection to pk came up (1), or the last one to pk went away or
     * could not be established (0); optional. Never called from inside a
     * transport function, only from the loop. */
    void (*on_conn)(void *ud, const uint8_t pk[HM_PK_BYTES], int up);
    /* An inbound stream message from pk was refused by reassembly (a cap
     * was full); head holds its first head_len (<= HM_TRANSPORT_HEAD_MAX)
     * bytes. Optional; called from the loop, at most REFUSED_PENDING_MAX
     * (64) per turn, the rest counted untold. */
    void (*on_refused)(void *ud, const uint8_t pk[HM_PK_BYTES], const uint8_t *head,
                       size_t head_len);
} hm_transport_cbs;

typedef struct hm_transport_faults {
    double drop_rate;     /* 0..1, applied to each outgoing datagram/message */
    uint64_t delay_ms;    /* added before each outgoing datagram/message no rule matches */
    int stall;            /* nonzero: neither read nor write anything */
    size_t n_partitioned; /* peers whose traffic is dropped both ways */
    const uint8_t (*partitioned)[HM_PK_BYTES];
    /* -- netlab -- per-address delays: the longest matching prefix decides, by the
     * address the bytes go to (a stream's connection: a relayed peer's is its relay) */
    size_t n_delay_rules; /* at most HM_TRANSPORT_DELAY_RULES_MAX */
    const hm_transport_delay_rule *delay_rules;
} hm_transport_faults;

typedef struct hm_transport_stats {
    uint64_t bytes_in, bytes_out; /* on the wire, both UDP and TCP */
    uint64_t dgrams_in, dgrams_out, dgrams_rejected;
    uint64_t messages_in, messages_out;
    uint64_t handshakes_ok, handshakes_failed;
    size_t connections;
    size_t queued_bytes; /* total, all peers */
    uint64_t refused_max_connections; /* connections refused or not dialled: MaxConnections */
    /* ---- connection admission and handshake work (docs/security.md) ---- */
    /* Each counts what its limit refused; an eviction counts as a refusal
     * of the limit that made it. */
    uint64_t refused_per_origin;             /* MaxConnectionsPerOrigin */
    uint64_t refused_reserved;               /* ReservedOutbound: the inbound share was full */
    uint64_t refused_handshakes;             /* MaxHandshakes */
    uint64_t refused_handshakes_per_origin;  /* MaxHandshakesPerOrigin */
    uint64_t refused_per_peer;               /* MaxConnectionsPerPeer: older ones replaced */
    uint64_t refused_handshake_rate;         /* HandshakeRatePerOrigin */
    uint64_t refused_dgram_new_key;          /* DgramNewKeyRate */
    uint64_t refused_dgram_new_key_origin;   /* DgramNewKeyRatePerOrigin */
    uint64_t evicted;                        /* inbound connections closed for a lighter origin */
    size_t inbound, inbound_handshaking;     /* now, charged to origins */
    /* ---- reassembly and write queues (docs/security.md) ---- */
    size_t rasm_bytes;            /* bytes held by inbound messages in progress, all peers */
    uint64_t rasm_refused_total;  /* messages refused, the total budget full: ReassemblyMaxMiB */
    uint64_t rasm_shed;           /* messages dropped to make room for a lighter origin */
    uint64_t rasm_refused_origin; /* refused over the origin's (or connection's) share */
    uint64_t rasm_stalled;        /* dropped after no chunk for rasm_stall_ms */
    uint64_t wq_refused_total;    /* sends refused, every queue together full: WriteQueueMaxMiB */
    uint64_t wq_shed;             /* connections closed to make room for a lighter origin */
    uint64_t wq_refused_origin;   /* sends refused over the origin's share: WriteQueueOriginMiB */
    uint64_t write_too_slow;      /* connections closed for draining under write_min_rate */
    uint64_t handed_over;      /* queued messages moved to the peer's other connection */
    uint64_t handover_dropped; /* ... and dropped there: that queue was full */
    uint64_t retired;          /* duplicates closed gracefully: writes finished, FIN, read to EOF */
    uint64_t drain_expired;    /* ... of which the peer did not finish within 5 s: closed */
    /* ---- connections by state, now (the status page's metrics) ---- */
    size_t conns_handshake, conns_open, conns_closing;
    size_t conns_draining; /* open, retired, finishing (not counted in conns_open) */
    uint64_t notices_refused;     /* refusal notices not queued: RefusalNoticeOriginKiB */
    uint64_t refusals_untold;     /* inbound refusals past the 64 pending per turn */
    /* ---- reachability (hm_transport_probe) ---- */
    uint64_t inbound_handshakes_ok; /* inbound connections that completed their handshake */
    uint64_t probes;                /* probes dialled */
    /* -- aead -- */
    uint64_t handshakes_old_version; /* inbound hellos of another stream protocol version */
    uint64_t refused_no_cipher;      /* inbound handshakes with no StreamCipher in common */
} hm_transport_stats;

int hm_transport_new(uv_loop_t *loop, const hm_identity *id,
                     const uint8_t swarm_id[HM_SWARM_ID_BYTES], const hm_transport_config *cfg,
                     const hm_transport_cbs *cbs, void *ud, hm_transport **out);
/* The bound address (with the port chosen when 0 was asked). */
int hm_transport_local_addr(hm_transport *t, struct sockaddr_storage *out);

/* Sends one datagram; len <= HM_DGRAM_MAX_PAYLOAD. Fire and forget. */
int hm_transport_send_dgram(hm_transport *t, const uint8_t pk[HM_PK_BYTES],
                            const struct sockaddr *to, const void *msg, size_t len);

/*
 * HM_PRIO_NOTICE: a refusal notice of at most HM_TRANSPORT_NOTICE_MAX
 * bytes on an existing connection (to must be NULL), queued as HIGH and
 * admitted within notice_origin_bytes past the write-queue caps, so that a
 * peer whose message or reply was refused learns it now, not at its
 * deadline.
 */
enum { HM_PRIO_HIGH = 0, HM_PRIO_LOW = 1, HM_PRIO_NOTICE = 2 };
#define HM_TRANSPORT_NOTICE_MAX 64
/* First bytes of a refused inbound message given to on_refused. */
#define HM_TRANSPORT_HEAD_MAX 24
/*
 * Queues one message for pk. Uses an existing connection to pk if there is
 * one, otherwise dials `to` (may be NULL when a connection must already
 * exist: -ENOTCONN otherwise). The bytes are copied. Returns 0, -EMSGSIZE,
 * -ENOBUFS, -ENOTCONN or a dial error. Delivery is not confirmed: a reply
 * at the layer above is.
 */
int hm_transport_send(hm_transport *t, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                      const void *msg, size_t len, int prio);
/*
 * The same as hm_transport_send for a message gathered from n pieces, which
 * are copied once into the queue (the rpc layer sends an envelope header and
 * a caller's multi-megabyte body this way without joining them first).
 */
int hm_transport_sendv(hm_transport *t, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                       const uv_buf_t *bufs, unsigned n, int prio);

/*
 * A hold on memory that the transport sends without copying it. The owner
 * sets refs to 1 and release; hm_transport_sendv_ref takes one more
 * reference for each message queued on a connection, and gives it back
 * (hm_tx_ref_drop) once the message's last chunk is sealed into a record
 * or the message is dropped (with its connection, or in a handover); the owner drops its own reference
 * when it no longer needs the memory. release runs when the count reaches
 * zero, on the loop thread, possibly from inside any transport call or
 * close: it may only free memory, never call the transport. The count is
 * not atomic: references are taken and dropped on the loop alone.
 */
typedef struct hm_tx_ref {
    unsigned refs;
    void (*release)(struct hm_tx_ref *ref);
} hm_tx_ref;
void hm_tx_ref_hold(hm_tx_ref *ref);
void hm_tx_ref_drop(hm_tx_ref *ref);
/*
 * Copies into the queues every piece still held under ref and gives those
 * holds back, so that the owner can free or reuse the memory now: for one
 * whose messages wait on a slow or stalled peer, which would otherwise pin
 * the whole of it, outside the write-queue bounds (those count only the
 * messages' own bytes). A message the copy finds no memory for keeps its
 * hold.
 */
void hm_transport_unhold(hm_transport *t, hm_tx_ref *ref);
/*
 * hm_transport_sendv, but bufs[held] is not copied when the message is
 * queued on a connection: the transport holds ref (which owns that
 * memory) until it has sealed the piece, and the bytes must stay as they
 * are until then. The other pieces are copied as by hm_transport_sendv,
 * and so is everything on the paths that copy anyway (a message to our
 * own key, one held back by injected delays). ref NULL, or held not under
 * n: hm_transport_sendv.
 */
int hm_transport_sendv_ref(hm_transport *t, const uint8_t pk[HM_PK_BYTES],
                           const struct sockaddr *to, const uv_buf_t *bufs, unsigned n, int prio,
                           hm_tx_ref *ref, unsigned held);
/*
 * A reachability probe: dials a fresh connection to pk at `to` (never an
 * existing one), runs the handshake, which proves pk answers there, and
 * closes it. cb fires once, from the loop: 0 when the handshake completed,
 * else the dial's error or -ETIMEDOUT after handshake_timeout_ms
 * (-ECANCELED when the transport closes first). If this returns an error,
 * cb never fires. The probe carries no messages and is not counted as a
 * connection to pk.
 */
typedef void (*hm_transport_probe_cb)(void *ud, int status);
int hm_transport_probe(hm_transport *t, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                       hm_transport_probe_cb cb, void *ud);
/* ---- relays (src/net/relay.h) ---- */
/*
 * The relay preamble: "HMRL", a version byte, a kind byte, two zero bytes
 * and a 32-byte circuit token, 40 bytes in all. A NAT'd peer opens a
 * connection to its relay with it (kind HM_RELAY_KIND_ACCEPT) when the relay
 * asks, and then answers the handshake a dialler started. The first byte
 * ('H') is never a handshake version, so the two cannot be confused.
 */
#define HM_TRANSPORT_RELAY_MAGIC "HMRL"
#define HM_TRANSPORT_RELAY_PREAMBLE 40
/*
 * An inbound connection whose first bytes are a relay preamble, or a
 * handshake msg1 naming a server key other than ours, is offered to the
 * divert hook before any cryptography: head holds every byte read so far
 * (at least the preamble or msg1), fd is a descriptor of its own for the
 * socket. The hook returns 1 when it took fd (it closes it in every case
 * later), 0 to leave the connection here (fd is then closed for it, and a
 * msg1 for another key fails as usual). Without a hook nothing is diverted.
 */
typedef int (*hm_transport_divert_fn)(void *ud, const uint8_t *head, size_t len,
                                      const struct sockaddr *from, int fd);
void hm_transport_set_divert(hm_transport *t, hm_transport_divert_fn fn, void *ud);
/*
 * The NAT'd side of a relayed connection: dials the relay at `to`, writes
 * the preamble (at most 256 bytes) and then answers, as the server, the
 * handshake of whoever the relay splices us to. Once that completes the
 * connection is an ordinary one to the dialler's key (sends to it use it).
 * `dialler` (NULL: unknown) is the dialler's address as the relay saw it:
 * the connection is then admitted and charged like an inbound one from
 * there (per-origin connections, handshake rate, memory shares), and its
 * messages' `from` is that address, so diallers behind one relay are told
 * apart by their own origins. 0, or -EINVAL, -ENOBUFS (max_connections),
 * -EBUSY (the dialler's origin is over its share), -ECANCELED or a dial
 * error.
 */
int hm_transport_accept_relayed(hm_transport *t, const struct sockaddr *to, const uint8_t *preamble,
                                size_t len, const struct sockaddr *dialler);

/* Bytes queued for pk and not yet written to the socket. */
size_t hm_transport_queued(hm_transport *t, const uint8_t pk[HM_PK_BYTES]);
int hm_transport_connected(hm_transport *t, const uint8_t pk[HM_PK_BYTES]);
/* Closes the connection to pk, if any. */
void hm_transport_disconnect(hm_transport *t, const uint8_t pk[HM_PK_BYTES]);

/* Copies the faults (and the partition list). */
void hm_transport_set_faults(hm_transport *t, const hm_transport_faults *f);
void hm_transport_get_stats(hm_transport *t, hm_transport_stats *out);
/* Calls emit once per limit the transport enforces (origin.h). */
void hm_transport_limits(hm_transport *t, hm_limit_emit_fn emit, void *ud);

/*
 * Closes every handle. cb fires once everything is closed; only then may
 * the transport's memory be released, which happens right before cb.
 */
void hm_transport_close(hm_transport *t, void (*cb)(void *ud), void *ud);

#endif

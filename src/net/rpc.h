/*
 * rpc: request/response over the transport's datagrams and streams.
 *
 * Envelope (msgpack, validated by wire.h before anything is read):
 *   request  [0, id, method, timeout_ms, body]
 *   response [1, id, status, body]         status 0 = ok, else a negative code
 *   cancel   [2, id]
 * body is a bin holding the method's own msgpack (or raw) bytes.
 *
 * The caller picks the carrier per call: HM_RPC_DGRAM (request and reply
 * must each fit in one datagram; no retransmission here, the DHT retries
 * itself) or HM_RPC_STREAM (any size up to the transport's cap). Each call
 * has a deadline; the callback fires exactly once, with the reply, with
 * -ETIMEDOUT, with -ECANCELED (hm_rpc_cancel, or shutdown), or with the
 * transport's error; if hm_rpc_call returns an error, it never fires.
 *
 * Bounds: calls in flight per peer (-ENOBUFS past it), inbound requests being
 * served per peer (further ones get an immediate -ENOBUFS reply), method
 * names of at most 64 bytes, and the transport's queue bounds. Handlers are
 * registered by name by the modules above; an unknown method is answered
 * with -ENOSYS.
 *
 * It also counts what the metrics need: calls by method and result, and a
 * latency histogram per method.
 */
#ifndef HM_RPC_H
#define HM_RPC_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "src/base/crypto.h"
#include "src/net/transport.h"

typedef struct hm_rpc hm_rpc;
typedef struct hm_rpc_req hm_rpc_req;

#define HM_RPC_METHOD_MAX 64

enum { HM_RPC_DGRAM = 1, HM_RPC_STREAM = 2 };

typedef struct hm_rpc_config {
    size_t max_inflight_per_peer;  /* outbound calls, default 256 */
    size_t max_serving_per_peer;   /* inbound requests not yet answered, default 64 */
    uint64_t max_timeout_ms;       /* a peer's requested timeout is clamped, default 600000 */
} hm_rpc_config;

/*
 * Inbound request. The handler answers with hm_rpc_respond, now or later
 * (exactly once; the request is freed by it). If the caller cancels or the
 * deadline passes first, respond still must be called and sends nothing.
 * body (and a reply's body in hm_rpc_cb) points into a receive buffer that
 * is valid only during the callback: copy what is needed later.
 */
typedef void (*hm_rpc_handler)(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                               const struct sockaddr *from, const uint8_t *body, size_t len);
typedef void (*hm_rpc_cb)(void *ud, int status, const uint8_t *body, size_t len);

/* Called for every authenticated datagram/message the rpc layer sees (the node
 * uses it to keep its peer table fresh); optional. */
typedef void (*hm_rpc_seen_cb)(void *ud, const uint8_t peer_pk[HM_PK_BYTES],
                               const struct sockaddr *from, int via_stream);

/*
 * Creates the rpc layer and the transport under it (the rpc layer owns the
 * transport: it installs itself as the transport's callbacks).
 */
int hm_rpc_new(uv_loop_t *loop, const hm_identity *id, const uint8_t swarm_id[HM_SWARM_ID_BYTES],
               const hm_transport_config *tcfg, const hm_rpc_config *rcfg, hm_rpc **out);
hm_transport *hm_rpc_transport(hm_rpc *rpc);
void hm_rpc_set_seen_cb(hm_rpc *rpc, hm_rpc_seen_cb cb, void *ud);
/* -- relay failover -- The last connection to pk went away (up 0) or one came
 * up (1), after the calls it carried failed; one watcher (relay.h), optional. */
typedef void (*hm_rpc_conn_cb)(void *ud, const uint8_t peer_pk[HM_PK_BYTES], int up);
void hm_rpc_set_conn_cb(hm_rpc *rpc, hm_rpc_conn_cb cb, void *ud);

int hm_rpc_register(hm_rpc *rpc, const char *method, hm_rpc_handler h, void *ud);
/*
 * Removes a method's handler, so that a module can be freed while the node
 * runs on: later requests for it are answered -ENOSYS. Requests already
 * handed to the handler stay its to answer. 0 or -ENOENT.
 */
int hm_rpc_unregister(hm_rpc *rpc, const char *method);

int hm_rpc_call(hm_rpc *rpc, const uint8_t peer_pk[HM_PK_BYTES], const struct sockaddr *to,
                const char *method, const void *body, size_t len, unsigned flags,
                uint64_t timeout_ms, hm_rpc_cb cb, void *ud, uint64_t *call_id_out);
/*
 * The same call with its body given in up to HM_RPC_BODY_PIECES pieces, sent
 * as one body: a large part need not be copied next to a small header
 * first. The pieces are copied (once, by the transport; a datagram's are
 * joined into it) before this returns, except body[held] when ref is not
 * NULL and held < nbody: over a stream, that piece is held uncopied under
 * ref until its message is sealed
 * (hm_transport_sendv_ref), and must not change meanwhile.
 */
#define HM_RPC_BODY_PIECES 4
int hm_rpc_callv(hm_rpc *rpc, const uint8_t peer_pk[HM_PK_BYTES], const struct sockaddr *to,
                 const char *method, const uv_buf_t *body, unsigned nbody, hm_tx_ref *ref,
                 unsigned held, unsigned flags, uint64_t timeout_ms, hm_rpc_cb cb, void *ud,
                 uint64_t *call_id_out);
/* Cancels a call in flight: its callback fires with -ECANCELED. 0 or -ENOENT. */
int hm_rpc_cancel(hm_rpc *rpc, uint64_t call_id);

/* Replies to an inbound request and frees it. status 0 = ok. */
int hm_rpc_respond(hm_rpc_req *req, int status, const void *body, size_t len);
/* The same with the body in up to HM_RPC_BODY_PIECES pieces, copied before it
 * returns but for body[held] under ref, as for hm_rpc_callv. Bad pieces
 * (too many, NULL with bytes) answer -EINVAL to the caller and return
 * -EINVAL. */
int hm_rpc_respondv(hm_rpc_req *req, int status, const uv_buf_t *body, unsigned nbody,
                    hm_tx_ref *ref, unsigned held);

/*
 * Refusals are not silent. A reply our write queues refuse (ENOBUFS: the
 * caller's origin holds its share) and a request our reassembly refuses
 * are answered at once with status -ENOBUFS and no body, a refusal notice
 * with its own small allowance in the transport (HM_PRIO_NOTICE); a reply
 * to one of our calls that our reassembly refuses ends that call with
 * -ENOBUFS. A caller thus tells "refused by a limit" (-ENOBUFS) from
 * "dead" (-ETIMEDOUT) long before its deadline.
 */
typedef struct hm_rpc_refusal_stats {
    uint64_t notices_sent;     /* -ENOBUFS notices queued for callers */
    uint64_t refused_requests; /* inbound requests reassembly refused (each noticed) */
    uint64_t refused_replies;  /* replies to our calls reassembly refused (each call ended) */
} hm_rpc_refusal_stats;
void hm_rpc_refusals(const hm_rpc *rpc, hm_rpc_refusal_stats *out);
/*
 * The envelope type and call id from the first bytes of a message (an
 * array of 1 to 65535 items, then two msgpack unsigned integers), as a
 * refused message's head gives them: untrusted bytes, fuzzed by
 * tests/fuzz/fuzz_rpc_head.c. 0 or -EPROTO.
 */
int hm_rpc_parse_head(const uint8_t *head, size_t len, uint64_t *type, uint64_t *id);
/* Whether the caller gave up (cancel or deadline): long handlers may stop early. */
int hm_rpc_req_cancelled(const hm_rpc_req *req);

/*
 * One-way datagrams: [3, channel, body] with no id, reply or deadline, for
 * protocols that run their own transactions over datagrams (the DHT core is
 * sans-I/O and matches its own replies). Each channel has one handler.
 */
#define HM_RPC_ONEWAY_CHANNELS 8
enum { HM_RPC_CHANNEL_DHT = 1 };
typedef void (*hm_rpc_oneway_handler)(void *ud, const uint8_t peer_pk[HM_PK_BYTES],
                                      const struct sockaddr *from, const uint8_t *body,
                                      size_t len);
int hm_rpc_register_oneway(hm_rpc *rpc, unsigned channel, hm_rpc_oneway_handler h, void *ud);
/* body must fit one datagram with the envelope (-EMSGSIZE otherwise). */
int hm_rpc_send_oneway(hm_rpc *rpc, const uint8_t peer_pk[HM_PK_BYTES], const struct sockaddr *to,
                       unsigned channel, const void *body, size_t len);

/* Per-method counters for metrics. */
#define HM_RPC_LAT_BUCKETS 12
extern const double hm_rpc_latency_bounds_s[HM_RPC_LAT_BUCKETS]; /* upper bounds, seconds */
typedef struct hm_rpc_method_stats {
    char method[HM_RPC_METHOD_MAX + 1];
    uint64_t ok, error, timeout, cancelled; /* outbound calls by result */
    uint64_t served;                        /* inbound requests answered */
    uint64_t lat_buckets[HM_RPC_LAT_BUCKETS + 1]; /* outbound ok latency; last = +Inf */
    double lat_sum_s;
} hm_rpc_method_stats;
/* Calls fn for each method seen (registered or called). */
void hm_rpc_foreach_stats(hm_rpc *rpc, void (*fn)(void *ud, const hm_rpc_method_stats *s),
                          void *ud);

/* Cancels every call (callbacks fire with -ECANCELED), closes the transport,
 * frees everything, then fires cb. */
void hm_rpc_close(hm_rpc *rpc, void (*cb)(void *ud), void *ud);

#endif

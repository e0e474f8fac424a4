/*
 * server: the expert server inside hivemindd. It hosts experts (ffn.h) on
 * a node, answers "moe.fwd", "moe.bwd" and "moe.info" (proto.h), declares
 * its experts in the DHT and checkpoints them.
 *
 * Batching. Requests for one expert queue in arrival order; a batch is
 * taken, oldest first, as soon as it reaches max_batch_size samples or the
 * oldest request has waited batch_wait_ms, and runs on one of the server's
 * compute worker threads (never the loop thread); the results return to
 * the loop through uv_async and each request gets its own rows back. One
 * expert runs at most one batch at a time (backward steps its optimizer);
 * forward and backward requests are batched separately, in arrival order.
 * A request whose caller has gone (cancel or deadline) is dropped before
 * it is computed. At most max_queued_samples samples wait per expert, and
 * at most max_queued_bytes (1 GiB) of request tensors are held by the
 * whole server, counted from arrival until the reply (queued, in a job
 * waiting for a worker, or computing); beyond that requests are answered
 * -ENOBUFS.
 *
 * Fairness (docs/security.md, "Expert queues"). Each request is charged to
 * the network origin it came from (src/base/origin.h), not to its
 * identity, which is free. Within one expert's queue every origin has its
 * own line, and batches take one request per origin in turn (an origin
 * that had nothing queued goes first), so a request waits for at most
 * about one request of each other origin, however many another origin
 * queued. When a bound is reached, the oldest queued requests of the
 * origin holding the most (samples at that expert, or bytes in the whole
 * server) are shed with -ENOBUFS to make room, as long as that origin is
 * not the newcomer's and holds more than the newcomer would; otherwise the
 * newcomer is refused with -ENOBUFS. Requests already in a batch are never
 * shed. Non-finite inputs are refused on arrival (-EDOM), so that they
 * never fail a whole batch. A backward whose step would overflow a
 * parameter or optimizer moment (a finite but huge dL/dy) steps nothing
 * and is answered -EDOM; when it came in a batch with others, each request
 * of that batch is then run as its own step, so that only the offending
 * one fails.
 *
 * Declarations. Every hosted expert and each of its grid prefixes is put
 * into the DHT as an owned record (proto.h) with declare_ttl_s, refreshed
 * every declare_ttl_s / 3 with jitter; hm_moe_server_close with withdraw
 * set puts empty values over them before it finishes. The puts of a round
 * are paced (40 a second, bursts of 40), so that a host of hundreds of
 * experts stays under its peers' DHT rate limits at every refresh, and
 * the records no replica took are retried within the round after 1, 2
 * and 4 s before the next refresh takes them all again. A round whose puts
 * reached no peer (kept only in this node's own store) is followed by the
 * next within 1 to 4 s, as one that stored nothing. One record per
 * put: a grid prefix's entries are separate subkeys, not one batch.
 *
 * Durability. With a state_dir, each expert is checkpointed
 * (checkpoint.h) to STATE_DIR/experts/UID.ckpt every checkpoint_interval_ms
 * when it has stepped since the last one, and on close. Hosting an expert
 * whose checkpoint exists resumes from it (the newest good one: a file
 * that is corrupt, or verifies but holds a malformed state, is logged and
 * the previous one used; with neither usable the expert starts afresh); a
 * well-formed checkpoint whose dim, hidden or optimizer differ from the
 * requested config is refused (-EPROTO). Creating STATE_DIR/experts fsyncs
 * STATE_DIR, so that the directory survives a crash with its files.
 *
 * Blocking. The periodic checkpoints run on the compute workers. Three
 * things run on the loop thread and block it while they do file I/O:
 * hm_moe_server_host reading (and verifying) each new expert's checkpoint,
 * hm_moe_server_checkpoint, and the final checkpoint that
 * hm_moe_server_close writes once running batches have finished. Each
 * costs about one read or write of the experts' states (tens of MiB per
 * expert at typical sizes), so they belong at startup and shutdown.
 *
 * Lifetime: create on a running node; close before the node.
 */
#ifndef HM_MOE_SERVER_H
#define HM_MOE_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "moe/ffn.h"
#include "moe/transformer.h"
#include "src/node/node.h"
#include "moe/proto.h"
#include "src/base/origin.h"

typedef struct hm_moe_server hm_moe_server;

#define HM_MOE_SERVER_MAX_EXPERTS 4096

typedef struct hm_moe_server_opts {
    const char *state_dir;           /* NULL: no checkpoints */
    unsigned workers;                /* compute threads; 0: 2 */
    size_t max_batch_size;           /* samples per batch; 0: 1024 */
    uint64_t batch_wait_ms;          /* 0: 2 */
    size_t max_queued_samples;       /* per expert; 0: 16384 */
    double declare_ttl_s;            /* 0: 60; at most HM_MOE_DECLARE_TTL_MAX_S (readers
                                      * ignore declarations that live longer) */
    uint64_t checkpoint_interval_ms; /* 0: 60000 */
    size_t max_queued_bytes;         /* request tensors held by the server; 0: 1 GiB */
} hm_moe_server_opts;

/* 0, -ENOMEM, -EEXIST (the node already has a server), -EINVAL. */
int hm_moe_server_new(hm_node *node, const hm_moe_server_opts *opts, hm_moe_server **out);

/*
 * Hosts every expert a pattern names (proto.h), each an ffn with cfg
 * (the seed is mixed with the uid so that experts differ). Experts already
 * hosted are skipped. n_added_out gets how many were added. On failure err
 * holds a sentence and nothing was added: -EINVAL (pattern or config),
 * -EMSGSIZE (over HM_MOE_SERVER_MAX_EXPERTS), -EPROTO (a checkpoint that
 * does not match cfg), -ENOMEM, -ESHUTDOWN (the server is closing).
 * A checkpoint file that exists but is unusable (neither it nor its
 * .prev verifies and holds a well-formed state) is logged and the expert
 * starts afresh. Runs on the loop thread and reads the checkpoints there.
 */
int hm_moe_server_host(hm_moe_server *s, const char *pattern, const char *type,
                       const hm_ffn_config *cfg, size_t *n_added_out, char *err, size_t errlen);

/*
 * Hosts every expert a pattern names as a transformer (transformer.h) with
 * cfg, declared with type HM_MOE_TYPE_TRANSFORMER so that callers know it
 * takes [batch, seq, dim] (proto.h, revision 2); otherwise as
 * hm_moe_server_host, whose checkpoint rules it follows (a checkpoint of
 * an ffn, or of other heads, is refused with -EPROTO). Its queue bounds
 * and max_batch_size count rows (batch * seq) as samples; a request whose
 * seq passes the expert's max_seq is refused (-EPROTO, limit
 * ExpertMaxSeq). hm_moe_server_host refuses the type "transformer".
 */
#define HM_MOE_TYPE_TRANSFORMER "transformer"
int hm_moe_server_host_xf(hm_moe_server *s, const char *pattern, const hm_xf_config *cfg,
                          size_t *n_added_out, char *err, size_t errlen);

typedef struct hm_moe_hosted {
    char uid[HM_MOE_UID_MAX + 1];
    char type[HM_MOE_TYPE_MAX + 1];
    size_t dim, hidden;
    size_t heads, max_seq;               /* a transformer's; 0 for an ffn */
    uint64_t fwd_requests, bwd_requests; /* answered with results */
    uint64_t batches;
    double mean_batch_size;              /* samples per batch */
    double latency_p50_ms, latency_p99_ms; /* request arrival to reply */
    uint64_t steps;                      /* optimizer steps */
    uint64_t last_checkpoint_unix_ms;    /* 0: never */
    int resumed;                         /* started from a checkpoint */
} hm_moe_hosted;

/* Copies up to max hosted experts (sorted by uid); returns how many there are. */
size_t hm_moe_server_list(hm_moe_server *s, hm_moe_hosted *out, size_t max);

/*
 * What the queue bounds refused or shed, under their config keywords
 * (ExpertMaxQueued: max_queued_samples; ExpertMaxQueuedBytes:
 * max_queued_bytes; ExpertMaxSeq: sequences longer than a transformer's
 * max_seq). Calls emit once per limit.
 */
void hm_moe_server_limits(hm_moe_server *s, hm_limit_emit_fn emit, void *ud);

/* Checkpoints every expert that stepped since its last checkpoint, now
 * (blocking the loop; used on SIGTERM). Returns 0 or the first error. */
int hm_moe_server_checkpoint(hm_moe_server *s);

/*
 * Stops taking requests (answered -ESHUTDOWN), waits for running batches,
 * checkpoints (on the loop thread, blocking it for the write), withdraws
 * the declarations when withdraw is set (bounded by a few seconds),
 * unregisters the methods, joins the workers and frees the server; cb (may
 * be NULL) fires from the loop after that. Returns 0, or -EALREADY when a
 * close is already under way: that call changes nothing and its cb never
 * fires (the first call's cb says when the server is gone). s must not be
 * used after the first call's cb.
 */
int hm_moe_server_close(hm_moe_server *s, int withdraw, void (*cb)(void *ud), void *ud);

#endif

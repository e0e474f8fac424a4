/*
 * client: calling experts elsewhere in the swarm, from the node. Finds
 * experts through the DHT (lookup by uid, beam search over a grid) and
 * calls several in parallel with Hivemind's k_min / timeout semantics. It
 * owns its calls in flight; the caller owns the tensors.
 *
 * Beam search. The grid is PREFIX.i.j... with per-dimension gate scores
 * from the trainer (scores[d][c] for coordinate c of dimension d). Level
 * by level, the beam keeps the beam_size best partial uids by summed
 * score among the coordinates that some host declared under each prefix
 * (proto.h); the last level yields experts with their hosts. Results are
 * the k_best best live experts, best first (fewer when fewer exist).
 * With a beam at least as wide as the number of declared prefixes at each
 * level the result is exact; a narrower beam may miss an expert whose
 * prefix scored low.
 *
 * Calls. hm_moe_forward sends x to k experts at once. It finishes
 *   - with 0 as soon as all k answered, or timeout_after_k_min after the
 *     k_min-th answer (whichever first);
 *   - with -ETIMEDOUT when timeout passes with fewer than k_min answers
 *     (or as soon as every expert has replied or failed with fewer than
 *     k_min answers, since nothing more can come);
 *   - with the server's own error code (e.g. -EPROTO: the input's width
 *     is not the expert's; -ENOENT: no such expert there; -ENOBUFS:
 *     refused by a limit) when fewer than k_min answered, none timed out
 *     and some expert's server refused the call with its reason; the
 *     first such expert (by index) gives the code, and errors_out (when
 *     given) every expert's code and the server's words. A refusal comes
 *     back as soon as the server sends it, not at the timeout.
 * An expert whose reply is an error, wrongly shaped or non-finite counts
 * as not answering. Calls still open when it finishes are cancelled.
 * hm_moe_backward is the same with backward_k_min and backward_timeout.
 * The callback fires exactly once, never from inside the starting call.
 *
 * Stalled hosts. A host that let a call wait (its expert had not answered
 * when the call ended at its timeout or timeout_after_k_min) is backed
 * off: for backoff_ms (15 s by default), doubling at each further stall
 * up to backoff_max_ms (300 s), and forgotten at its first answer (a
 * result or an error reply: it is alive). While a host is backed off, its
 * experts are left out of calls (errors_out says -EAGAIN) unless fewer
 * than k_min of the call's experts would remain, and beam searches rank
 * them after every expert on a host in good standing. When the back-off
 * has run out, one call probes the host (the other calls keep skipping it
 * until the probe ends). The back-off is kept per host peer id for every
 * caller of the client (HM_MOE_BACKOFF_HOSTS hosts, a direct-mapped
 * cache: a host pushed out is only called again).
 */
#ifndef HM_MOE_CLIENT_H
#define HM_MOE_CLIENT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "src/node/node.h"
#include "moe/proto.h"
#include "src/base/origin.h"

typedef struct hm_moe_client hm_moe_client;

#define HM_MOE_MAX_K 64

typedef struct hm_moe_expert {
    char uid[HM_MOE_UID_MAX + 1];
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr;
    char addr_str[HM_MOE_ADDR_MAX + 1];  /* HOST:PORT */
    double score;                        /* beam search: summed gate score */
} hm_moe_expert;

int hm_moe_client_new(hm_node *node, hm_moe_client **out);

/*
 * Which declarations a lookup or beam search believes (docs/security.md,
 * "Expert records"). Owners are free identities, so for every name (a uid,
 * or a grid prefix with its next coordinate; the holder rule concerns uids
 * only, since every owner's prefix entry says the same: the coordinate
 * exists):
 *   - a declaration expiring more than record_max_ttl_s (+
 *     HM_MOE_CLOCK_SLACK_S) past this host's clock is ignored: a record
 *     signed for a day would outlive its signer by a day;
 *   - where an allow-list rule covers the name, only the hosts it lists are
 *     believed, and any of them may serve (the freshest declaration wins);
 *   - elsewhere, unless any_holder is set, the name has one owner: the one
 *     this client has seen holding it without a gap (in every read since
 *     it first saw it) is kept while its declaration is live, and another
 *     owner's declaration is passed over. A holder whose declaration is
 *     gone (withdrawn, expired, no longer refreshed) is forgotten, so a
 *     departed owner does not break the name. Where no holder is known
 *     (a first read, or the holder left), the owner whose declaration the
 *     DHT's replicas have held longest without a gap wins (held_s,
 *     dht/dht.h: the storers' own times, a median over their origins),
 *     then the freshest: an owner that declares a name later cannot take
 *     it from one that keeps refreshing it, however fresh it signs. First
 *     come, first served: swarms that must not be taken over by whoever
 *     declares first list their hosts.
 *     The client remembers HM_MOE_HOLDERS names (a direct-mapped cache).
 * With any_holder set and no allow-list: the freshest declaration of any
 * owner, as before these rules.
 */
#define HM_MOE_HOLDERS 4096

#define HM_MOE_BACKOFF_HOSTS 1024
#define HM_MOE_BACKOFF_MS 15000
#define HM_MOE_BACKOFF_MAX_MS 300000

typedef struct hm_moe_client_policy {
    double record_max_ttl_s;   /* 0: HM_MOE_RECORD_MAX_TTL_S; at most 86400 */
    int any_holder;            /* 0: one holder per name (the default) */
    const hm_moe_allow *allow; /* NULL: none; borrowed, must outlive the client */
    uint64_t backoff_ms;       /* a stalled host's first back-off; 0: HM_MOE_BACKOFF_MS */
    uint64_t backoff_max_ms;   /* the cap of its doubling; 0: HM_MOE_BACKOFF_MAX_MS */
} hm_moe_client_policy;

/* 0 or -EINVAL (a negative, non-finite or over-a-day TTL; a back-off over
 * a day or a cap below the first back-off). */
int hm_moe_client_set_policy(hm_moe_client *c, const hm_moe_client_policy *p);

/*
 * Declarations the policy passed over, under their config keywords:
 * ExpertRecordMaxTtl (living too long), ExpertHostsFile (a host the
 * allow-list does not name), ExpertOneHolder (another owner of a name
 * that has a live holder).
 */
void hm_moe_client_limits(hm_moe_client *c, hm_limit_emit_fn emit, void *ud);
/* Cancels everything in flight (callbacks fire with -ECANCELED first). */
void hm_moe_client_free(hm_moe_client *c);

typedef struct hm_moe_backoff_stats {
    uint64_t stalls;       /* host stalls seen (each starts or doubles a back-off) */
    uint64_t skipped;      /* experts left out of calls because their host was backed off */
    uint64_t recovered;    /* backed-off hosts that answered again */
    size_t hosts;          /* hosts backed off now */
} hm_moe_backoff_stats;

void hm_moe_client_backoff_stats(hm_moe_client *c, hm_moe_backoff_stats *out);

/* One backed-off host, for listings. */
typedef struct hm_moe_backoff_host {
    uint8_t pk[HM_PK_BYTES];
    uint64_t left_ms;      /* until the next probe (0: a probe is due or in flight) */
    uint64_t period_ms;    /* the current back-off */
    unsigned stalls;       /* stalls in a row */
} hm_moe_backoff_host;

/* Fills up to max hosts backed off now; returns how many. */
size_t hm_moe_client_backoffs(hm_moe_client *c, hm_moe_backoff_host *out, size_t max);

typedef void (*hm_moe_find_cb)(void *ud, int status, const hm_moe_expert *experts, size_t n);

/* Looks one uid up (the declaration the policy above believes). status 0 or
 * -ENOENT / -ETIMEDOUT (no DHT replica answered) / -ECANCELED (the client
 * was freed, or the node is closing). experts is valid during the
 * callback only. */
int hm_moe_lookup(hm_moe_client *c, const char *uid, uint64_t timeout_ms, hm_moe_find_cb cb,
                  void *ud);

/* scores[d] has grid_sizes[d] finite entries (copied: they may go away
 * after the call); ndims <= HM_MOE_MAX_GRID_DIMS; k_best <= HM_MOE_MAX_K;
 * beam_size 0: k_best, at most HM_DHT_MANY_MAX. Declared coordinates
 * outside grid_sizes are ignored. status 0 with n >= 1; -ENOENT when no
 * live expert is declared in the grid; -ETIMEDOUT when none was found and
 * some DHT read failed or the timeout passed mid-search; -ECANCELED. */
int hm_moe_beam_search(hm_moe_client *c, const char *prefix, const double *const *scores,
                       const size_t *grid_sizes, size_t ndims, size_t k_best, size_t beam_size,
                       uint64_t timeout_ms, hm_moe_find_cb cb, void *ud);

/* How one expert of a call ended. */
typedef struct hm_moe_call_error {
    int status; /* 0 answered; -ETIMEDOUT no answer in time; -EAGAIN skipped (host backed
                   off); -ECANCELED not waited for; else the server's or the transport's code */
    char msg[HM_MOE_ERR_MAX + 1]; /* the server's reason, "" when none came */
} hm_moe_call_error;

typedef struct hm_moe_call_opts {
    size_t k_min;                   /* 1..k */
    uint64_t timeout_ms;            /* forward_timeout / backward_timeout */
    uint64_t timeout_after_k_min_ms;
    hm_moe_call_error *errors_out;  /* NULL or k entries, filled when the callback fires;
                                       must stay valid until then */
    size_t seq;                     /* 0: [batch, dim] calls; else the batch rows are
                                       batch / seq sequences of seq rows, sent as
                                       [batch / seq, seq, dim] to experts over sequences
                                       (transformers; proto.h revision 2) */
    const uint8_t *mask;            /* NULL, or with seq: a key-padding mask of batch bytes
                                       (one a row), 1 a token and 0 padding, each sequence
                                       keeping one (proto.h revision 3); must stay valid
                                       until the callback */
} hm_moe_call_opts;

/*
 * status 0, -ETIMEDOUT, a server's code (above), or -ECANCELED
 * (hm_moe_cancel, hm_moe_client_free, or the node closing under the
 * call); answered[e] is 1 for the experts
 * whose rows in the output are valid, n_answered how many. answered is
 * valid during the callback only.
 */
typedef void (*hm_moe_call_cb)(void *ud, int status, const uint8_t *answered, size_t n_answered);

/*
 * x: [batch, dim]; y_out: [k, batch, dim], row block e for expert e.
 * Buffers must stay valid until the callback. 0, -EINVAL (zero sizes, bad
 * options), -EMSGSIZE (batch, dim or batch * dim over the caps of
 * proto.h), -ENOMEM; the callback fires only after 0.
 */
int hm_moe_forward(hm_moe_client *c, const hm_moe_expert *experts, size_t k, const float *x,
                   size_t batch, size_t dim, float *y_out, const hm_moe_call_opts *o,
                   hm_moe_call_cb cb, void *ud, uint64_t *call_out);
/* gy: [k, batch, dim] (dL/dy of each expert's output); gx_out likewise. */
int hm_moe_backward(hm_moe_client *c, const hm_moe_expert *experts, size_t k, const float *x,
                    const float *gy, size_t batch, size_t dim, float *gx_out,
                    const hm_moe_call_opts *o, hm_moe_call_cb cb, void *ud, uint64_t *call_out);
/*
 * Per-sample routing (Hivemind's RemoteMixtureOfExperts). Each sample runs
 * its own beam search over its own gate scores; the batch's searches share
 * one walk of the DHT, one level at a time: a level reads the union of the
 * prefixes the samples' beams hold (in get_many's of up to HM_DHT_MANY_MAX
 * keys that run at once), and every sample scores the children of its own
 * beam. With a beam at least as wide as the declared prefixes of each
 * level, every sample gets exactly its top k_best of the grid.
 *
 * A routed call groups the rows by expert: each expert that some sample
 * was routed to gets one request holding exactly those samples' rows.
 * k_min and timeout_after_k_min count per sample: sample b needs
 * min(k_min, the experts routed to it) answers; the call succeeds as soon
 * as every expert answered, or timeout_after_k_min after the last sample
 * got what it needs, and fails with -ETIMEDOUT (or a server's code, as
 * above) when at timeout some sample has fewer. k_min 0 is allowed (a
 * Switch layer: a sample whose expert did not answer gets zeros); the
 * call then waits at most timeout_after_k_min from its start. The back-off
 * leaves an expert out only while every sample keeps what it needs.
 * Experts no sample was routed to are not called (errors_out: -ENODATA).
 *
 * Over sequences (o->seq not 0, experts of type transformer) a sample is a
 * whole sequence: x is [batch, seq, dim], the outputs [batch, per, seq,
 * dim], each expert gets [its samples, seq, dim] in one request, and
 * o->mask, when set, is [batch, seq] bytes (each sample's own mask goes
 * with it).
 */

/* Distinct experts in one routed search or call, and the elements of its output. */
#define HM_MOE_MAX_ROUTED 1024
#define HM_MOE_MAX_ROUTED_ELEMS ((size_t)1 << 25)

/*
 * routes: [batch, k_best], row b the experts of sample b, best first, as
 * indices into experts (-1 past the ones found). Both are valid during
 * the callback only.
 */
typedef void (*hm_moe_route_cb)(void *ud, int status, const hm_moe_expert *experts, size_t n,
                                const int32_t *routes, size_t batch, size_t k_best);

/*
 * scores: [batch, sum(grid_sizes)] finite gate scores, sample b's row the
 * scores of grid dimension 0, then 1, ... (copied). batch 1..
 * HM_MOE_MAX_BATCH, the other bounds as hm_moe_beam_search; -E2BIG when a
 * level could need more than 4096 keys (min(batch * beam_size, the grid's
 * prefixes there)) or the result more than HM_MOE_MAX_ROUTED experts
 * (min(batch * k_best, the grid's size)). status 0 when some sample has
 * an expert (samples with none have a row of -1), -ENOENT, -ETIMEDOUT,
 * -ECANCELED as hm_moe_beam_search.
 */
int hm_moe_route(hm_moe_client *c, const char *prefix, const float *scores, size_t batch,
                 const size_t *grid_sizes, size_t ndims, size_t k_best, size_t beam_size,
                 uint64_t timeout_ms, hm_moe_route_cb cb, void *ud);

/*
 * x: [batch, dim]; routes: [batch, per] indices into experts (n_experts
 * 1..HM_MOE_MAX_ROUTED) or -1 (copied at the call); y_out: [batch, per,
 * dim], slot j of sample b the output of expert routes[b][j] on x[b]
 * (slots of experts that did not answer are left as they were). k_min
 * 0..per. answered in the callback is per expert. 0, -EINVAL, -EMSGSIZE
 * (batch * per * dim over HM_MOE_MAX_ROUTED_ELEMS, or one expert's rows
 * over a frame's caps), -ENOMEM.
 */
int hm_moe_forward_routed(hm_moe_client *c, const hm_moe_expert *experts, size_t n_experts,
                          const int32_t *routes, size_t per, const float *x, size_t batch,
                          size_t dim, float *y_out, const hm_moe_call_opts *o, hm_moe_call_cb cb,
                          void *ud, uint64_t *call_out);
/* gy: [batch, per, dim] (dL/dy of each slot); gx_out likewise. Pass the
 * routes of the forward with -1 in the slots whose expert did not answer
 * it, so that backward goes only to the experts that gave those rows. */
int hm_moe_backward_routed(hm_moe_client *c, const hm_moe_expert *experts, size_t n_experts,
                           const int32_t *routes, size_t per, const float *x, const float *gy,
                           size_t batch, size_t dim, float *gx_out, const hm_moe_call_opts *o,
                           hm_moe_call_cb cb, void *ud, uint64_t *call_out);

/* Ends a call now: its callback fires with -ECANCELED. 0 or -ENOENT. */
int hm_moe_cancel(hm_moe_client *c, uint64_t call);

/*
 * Mixture output: out[b] = sum over answered e of w[b][e] * y[e][b], with
 * w[b] = softmax over the answered experts of logits[b][e] ([batch, k]).
 * weights_out ([batch, k], may be NULL) gets w (0 for experts that did not
 * answer). -EINVAL when none answered.
 */
int hm_moe_combine(const float *y, const float *logits, const uint8_t *answered, size_t k,
                   size_t batch, size_t dim, float *out, float *weights_out);

/*
 * The routed mixture: out[b] = sum over the answered slots j of sample b of
 * w[b][j] * y[b][j], w[b] the softmax of logits[b] ([batch, per]) over
 * those slots; a sample with none gets zeros (weights 0). -EINVAL on a
 * non-finite logit or an index out of range.
 */
int hm_moe_combine_routed(const float *y, const float *logits, const int32_t *routes,
                          const uint8_t *answered, size_t n_experts, size_t batch, size_t per,
                          size_t dim, float *out, float *weights_out);

#endif

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
 *     k_min answers, since nothing more can come).
 * An expert whose reply is an error, wrongly shaped or non-finite counts
 * as not answering. Calls still open when it finishes are cancelled.
 * hm_moe_backward is the same with backward_k_min and backward_timeout.
 * The callback fires exactly once, never from inside the starting call.
 */
#ifndef HM_MOE_CLIENT_H
#define HM_MOE_CLIENT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "src/node/node.h"
#include "moe/proto.h"

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
/* Cancels everything in flight (callbacks fire with -ECANCELED first). */
void hm_moe_client_free(hm_moe_client *c);

typedef void (*hm_moe_find_cb)(void *ud, int status, const hm_moe_expert *experts, size_t n);

/* Looks one uid up (the freshest non-withdrawn declaration). status 0 or
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

typedef struct hm_moe_call_opts {
    size_t k_min;                   /* 1..k */
    uint64_t timeout_ms;            /* forward_timeout / backward_timeout */
    uint64_t timeout_after_k_min_ms;
} hm_moe_call_opts;

/*
 * status 0, -ETIMEDOUT, or -ECANCELED (hm_moe_cancel, hm_moe_client_free,
 * or the node closing under the call); answered[e] is 1 for the experts
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

#endif

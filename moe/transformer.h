/*
 * transformer: the transformer expert, a pre-LN block over sequences, its
 * gradients and its optimizer, computed with OpenBLAS. Pure compute over
 * caller memory plus the expert's own parameters; no I/O, no threads, no
 * global state. The expert server (server.h) runs it on worker threads as
 * it runs ffn experts, one call per expert at a time.
 *
 *   h = x + MHA(LN1(x))          multi-head self-attention over the sequence
 *   y = h + FFN(LN2(h))          exactly an ffn expert (ffn.h) applied to h
 *
 * x, h, y: [batch, seq, dim] row-major float32; each sample's sequence
 * attends only to itself (an encoder block). The _mask calls take a
 * key-padding mask, [batch, seq] bytes, 1 for a token and 0 for padding
 * (Hivemind's attention_mask): a padded key gets attention weight exactly
 * 0 from every query of its sample (its own row is still computed, over
 * the sample's tokens). Each byte must be 0 or 1 and each sample keep at
 * least one key (-EINVAL otherwise); an all-ones mask is the same, to the
 * bit, as none. LN is LayerNorm
 * over dim with learned gamma/beta and eps 1e-5. MHA projects LN1(x) with
 * Wqkv [3 dim, dim] + bqkv into queries, keys and values (rows 0..dim-1,
 * dim..2dim-1, 2dim..3dim-1 of Wqkv), splits each into `heads` heads of
 * dim / heads columns, takes softmax(Q K^T / sqrt(dim / heads)) V per head
 * and sample, concatenates the heads and projects them with Wo [dim, dim]
 * + bo. This is torch's nn.MultiheadAttention (in_proj_weight = Wqkv,
 * out_proj = Wo), in Hivemind's transformer expert's pre-LN form.
 *
 * Parameters are two flat float32 vectors, the attention's
 *   ln1_gamma[dim], ln1_beta[dim], Wqkv[3 dim * dim], bqkv[3 dim],
 *   Wo[dim * dim], bo[dim]
 * and the FFN's (an hm_ffn, in ffn.h's order); hm_xf_param(t, i) indexes
 * both as one vector of hm_xf_nparams, the attention's first, which is also
 * the order of every gradient vector here.
 *
 * Backward follows the ffn expert: nothing is kept between calls; backward
 * gets x and dL/dy, recomputes the forward pass, returns dL/dx and applies
 * one optimizer step (the ffn's optimizer and settings, over both vectors as
 * one: a step that would overflow either changes neither).
 *
 * Bounds: batch >= 1, 1 <= seq <= max_seq (at most HM_XF_MAX_SEQ), dim
 * and hidden as ffn.h's, heads dividing dim (at most HM_XF_MAX_HEADS); the
 * server adds the wire's caps on batch * seq * dim (proto.h).
 *
 * Errors as ffn.h's: -EINVAL (bad config or shape, NULL), -ENOMEM, -EDOM.
 * A call allocates its scratch, about 4 * batch * seq * (6 dim + 2 hidden)
 * bytes plus two seq x seq matrices; backward also one gradient vector.
 */
#ifndef HM_MOE_TRANSFORMER_H
#define HM_MOE_TRANSFORMER_H

#include <stddef.h>
#include <stdint.h>

#include "moe/ffn.h"

typedef struct hm_xf hm_xf;

#define HM_XF_MAX_SEQ 2048
#define HM_XF_MAX_HEADS 64
#define HM_XF_DEFAULT_MAX_SEQ 512

typedef struct hm_xf_config {
    hm_ffn_config ffn; /* dim, hidden, optimizer and its settings, seed (ffn.h) */
    size_t heads;      /* divides dim; 0: the largest of 8, 4, 2, 1 that does */
    size_t max_seq;    /* longest sequence a call may pass; 0: HM_XF_DEFAULT_MAX_SEQ */
} hm_xf_config;

/*
 * A new expert: gammas 1, betas and biases 0, Wqkv and Wo uniform in
 * +-1/sqrt(dim) and the FFN as hm_ffn_new makes it, all from cfg's seed.
 */
int hm_xf_new(const hm_xf_config *cfg, hm_xf **out);
void hm_xf_free(hm_xf *t);

/* The config with defaults filled in. */
const hm_xf_config *hm_xf_config_of(const hm_xf *t);
size_t hm_xf_dim(const hm_xf *t);
size_t hm_xf_nparams(const hm_xf *t);
/* Parameter i of the one vector (attention first, then the FFN); NULL past the end. */
float *hm_xf_param(hm_xf *t, size_t i);
uint64_t hm_xf_steps(const hm_xf *t);

/* y[batch*seq*dim] from x; y must not alias x. -EDOM when x or the output is
 * not finite. */
int hm_xf_forward(const hm_xf *t, const float *x, size_t batch, size_t seq, float *y);

/* dL/dx into grad_x and, when grad_params is not NULL, dL/dparams (summed
 * over the batch) into grad_params[hm_xf_nparams]. No step. */
int hm_xf_grad(const hm_xf *t, const float *x, const float *grad_y, size_t batch, size_t seq,
               float *grad_x, float *grad_params);

/* The same with a key-padding mask (above); NULL: none. */
int hm_xf_forward_mask(const hm_xf *t, const float *x, const uint8_t *mask, size_t batch,
                       size_t seq, float *y);
int hm_xf_grad_mask(const hm_xf *t, const float *x, const uint8_t *mask, const float *grad_y,
                    size_t batch, size_t seq, float *grad_x, float *grad_params);
int hm_xf_backward_mask(hm_xf *t, const float *x, const uint8_t *mask, const float *grad_y,
                        size_t batch, size_t seq, float *grad_x);

/* One optimizer step with the given gradient; nothing changes on -EDOM. */
int hm_xf_apply(hm_xf *t, const float *grad_params);

/* hm_xf_grad then hm_xf_apply. */
int hm_xf_backward(hm_xf *t, const float *x, const float *grad_y, size_t batch, size_t seq,
                   float *grad_x);

/*
 * The whole state as one msgpack map: "version" (1), "type"
 * ("transformer", so that a checkpoint says what expert it holds), "heads",
 * "max_seq", "attn", "attn_m1", "attn_m2" (raw little-endian float32; the
 * moments empty when the optimizer keeps none) and "ffn" (hm_ffn_save's
 * state, as bin). hm_xf_load checks everything against the config the
 * state declares and, when expect is not NULL, that dim, hidden, optimizer
 * and heads match it (-EPROTO otherwise; max_seq is expect's, a serving
 * bound rather than a shape). Errors as hm_ffn_load's.
 */
int hm_xf_save(const hm_xf *t, uint8_t **buf_out, size_t *len_out);
int hm_xf_load(const uint8_t *buf, size_t len, const hm_xf_config *expect, hm_xf **out);
/* 1 when buf is a well-framed state whose "type" is "transformer", else 0. */
int hm_xf_is_state(const uint8_t *buf, size_t len);

#endif

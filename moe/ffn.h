/*
 * ffn: the feed-forward expert, its gradients and its optimizer, computed
 * with OpenBLAS (cblas_sgemm). Pure compute over caller memory plus the
 * expert's own parameters; no I/O, no threads, no global state. The expert
 * server (server.h) runs it on worker threads, one call per expert at a
 * time; calls on different experts may run concurrently.
 *
 *   y = x + W2 · gelu(W1 · LN(x) + b1) + b2
 *
 * x, y: [batch, dim] row-major float32. LN is LayerNorm over dim with
 * learned gamma/beta and eps 1e-5; W1: [hidden, dim], W2: [dim, hidden];
 * gelu is the tanh approximation (as torch's approximate="tanh").
 *
 * Parameters are one flat float32 vector (hm_ffn_params), in this order:
 *   gamma[dim], beta[dim], W1[hidden*dim], b1[hidden], W2[dim*hidden], b2[dim]
 * so that gradients, optimizer state and averaging see one vector.
 *
 * Backward follows Hivemind's expert servers: the server keeps no
 * activations between calls; backward gets x and dL/dy, recomputes the
 * forward pass, returns dL/dx and applies one optimizer step to the
 * parameters (hm_ffn_backward). hm_ffn_grad computes the same gradients
 * without stepping, for tests and finite differences.
 *
 * Optimizers: SGD (lr, optional momentum) and Adam (lr, beta1, beta2, eps,
 * bias-corrected as in torch.optim.Adam), both with optional decoupled
 * weight decay left at 0 by default.
 *
 * Errors: -EINVAL (bad config, zero batch or one over INT_MAX, which BLAS
 * cannot take, NULL), -ENOMEM, -EDOM (a non-finite value in x or dL/dy, or
 * in the gradient given to hm_ffn_apply, or a finite gradient so large that
 * a new parameter or optimizer moment would overflow: nothing is stepped).
 *
 * Each forward/backward call allocates its own scratch, about
 * 4 * batch * (dim + 2 * hidden) bytes, and backward also one gradient
 * vector (4 * nparams bytes); nothing is kept between calls.
 */
#ifndef HM_MOE_FFN_H
#define HM_MOE_FFN_H

#include <stddef.h>
#include <stdint.h>

typedef struct hm_ffn hm_ffn;

#define HM_FFN_MAX_DIM 8192
#define HM_FFN_MAX_HIDDEN 32768

enum hm_ffn_opt { HM_FFN_SGD = 0, HM_FFN_ADAM = 1 };

typedef struct hm_ffn_config {
    size_t dim;          /* 1..HM_FFN_MAX_DIM */
    size_t hidden;       /* 0: 4 * dim; at most HM_FFN_MAX_HIDDEN */
    int optimizer;       /* enum hm_ffn_opt */
    double lr;           /* 0: 1e-3 (Adam) or 1e-2 (SGD) */
    double momentum;     /* SGD only, 0: none */
    double beta1, beta2; /* Adam, 0: 0.9 and 0.999 */
    double eps;          /* Adam, 0: 1e-8 */
    double weight_decay; /* decoupled, 0: none */
    uint64_t seed;       /* initial weights are a deterministic function of it */
} hm_ffn_config;

/*
 * A new expert: gamma 1, beta 0, W uniform in +-1/sqrt(fan_in) (torch's
 * nn.Linear default), biases 0, from a generator seeded by cfg->seed.
 */
int hm_ffn_new(const hm_ffn_config *cfg, hm_ffn **out);
void hm_ffn_free(hm_ffn *f);

/* The config with defaults filled in. */
const hm_ffn_config *hm_ffn_config_of(const hm_ffn *f);
size_t hm_ffn_dim(const hm_ffn *f);
size_t hm_ffn_nparams(const hm_ffn *f);
float *hm_ffn_params(hm_ffn *f);
uint64_t hm_ffn_steps(const hm_ffn *f); /* optimizer steps taken */

/* y[batch*dim] from x[batch*dim]; y must not alias x. -EDOM when x, or the
 * output (finite but huge weights overflow), is not finite. */
int hm_ffn_forward(const hm_ffn *f, const float *x, size_t batch, float *y);

/*
 * dL/dx into grad_x[batch*dim] and, when grad_params is not NULL, dL/dparams
 * (summed over the batch) into grad_params[hm_ffn_nparams]. No step.
 */
int hm_ffn_grad(const hm_ffn *f, const float *x, const float *grad_y, size_t batch,
                float *grad_x, float *grad_params);

/*
 * One optimizer step with the given parameter gradient. A read-only pass
 * first checks that every new parameter and moment would be finite; if
 * one would not (a huge but finite gradient overflowing Adam's second
 * moment, say), nothing changes and -EDOM is returned, so that one hostile
 * dL/dy can neither stop the expert learning nor make its state unloadable.
 */
int hm_ffn_apply(hm_ffn *f, const float *grad_params);

/*
 * The same optimizer over any flat vector, for experts that hold an ffn and
 * parameters of their own (transformer.h) and step both as one. c is a
 * config as hm_ffn_config_of returns it (defaults filled in); the vector has
 * n parameters and hm_ffn_moments(c) moment vectors m1, m2 (NULL when the
 * optimizer keeps fewer); steps is the number of steps taken before this
 * one. hm_ffn_opt_check writes nothing: 0, -EDOM (a non-finite gradient,
 * or a step that would make a value non-finite) or -EINVAL. hm_ffn_opt_step
 * then writes the step; it checks nothing.
 */
int hm_ffn_moments(const hm_ffn_config *c);
int hm_ffn_opt_check(const hm_ffn_config *c, uint64_t steps, const float *params,
                     const float *m1, const float *m2, const float *grad, size_t n);
void hm_ffn_opt_step(const hm_ffn_config *c, uint64_t steps, float *params, float *m1,
                     float *m2, const float *grad, size_t n);

/* hm_ffn_grad then hm_ffn_apply, as the server does on each backward call. */
int hm_ffn_backward(hm_ffn *f, const float *x, const float *grad_y, size_t batch,
                    float *grad_x);

/*
 * The whole state (config, step count, parameters, optimizer moments) as
 * one msgpack object in a malloc'd buffer, and back. The object is a map:
 * "version" (1), "dim", "hidden", "optimizer", "lr", "momentum", "beta1",
 * "beta2", "eps", "weight_decay", "seed", "steps", and "params", "m1", "m2"
 * as bin of raw little-endian float32 (m1: SGD momentum buffer or Adam's
 * first moment; m2: Adam's second moment; empty when the optimizer keeps
 * none). Loaded values must be finite (and m2 non-negative). hm_ffn_load parses
 * through the bounded wire validator and checks every length against the
 * config it declares; when expect is not NULL, dim, hidden and optimizer
 * must match it. Returns 0; -EPROTO only for a well-formed state whose dim,
 * hidden or optimizer differ from expect; -EBADMSG for malformed content
 * (truncated, trailing bytes, missing or mistyped fields, lengths that
 * disagree, non-finite values); -EMSGSIZE (over the largest state any
 * config can have); -EINVAL (NULL, or an invalid expect); -ENOMEM.
 */
int hm_ffn_save(const hm_ffn *f, uint8_t **buf_out, size_t *len_out);
int hm_ffn_load(const uint8_t *buf, size_t len, const hm_ffn_config *expect, hm_ffn **out);

#endif

/*
 * model: the example classifier trained by train_local and trainer, with
 * its own forward and backward passes on OpenBLAS (cblas_sgemm):
 *
 *   h   = relu(x · W_in^T + b_in)                  x: [batch, in_dim]
 *   s   = h · W_gate^T + b_gate                    s: [batch, G0 + G1]
 *   mix = sum over chosen experts e = (i, j) that answered of
 *         softmax_e(s[i] + s[G0 + j]) * expert_e(h)
 *   z   = mix · W_out^T + b_out                    z: [batch, n_classes]
 *   loss = mean over the batch of cross-entropy(softmax(z), label)
 *
 * The mixture layer follows Hivemind's RemoteMixtureOfExperts on a 2-D
 * grid of G0 x G1 experts (uid PREFIX.i.j): the gate scores each grid
 * coordinate, an expert's score is the sum of its two coordinates' scores,
 * and with per-batch routing the whole batch goes to the k_best experts
 * with the highest score averaged over the batch (each chosen expert is
 * called once per step with the whole batch; per-sample routing and the
 * Switch layer: see "Routing" below). Each sample mixes the
 * outputs of the experts that answered with softmax weights over their
 * scores (moe/client.h's hm_moe_combine formula); experts that did not
 * answer are left out of the softmax. Gradients flow to the gate (through
 * the weights) and to h (through the gate and through the experts).
 *
 * The experts are not part of this module: it calls them through
 * hm_model_experts, so that the same model runs them in-process (hm_ffn
 * objects, hm_model_local_experts) or remotely through the client library.
 * An expert applies its own optimizer step when it runs backward, as
 * Hivemind's expert servers do.
 *
 * The local parameters (W_in, b_in, W_gate, b_gate, W_out, b_out, in this
 * order, row-major) are one flat float vector, as are their gradient and
 * the optimizer's moments, so that a swarm can average them as one tensor.
 *
 * Errors: -EINVAL (bad config or arguments, a label out of range),
 * -ENOMEM, -EDOM (a non-finite input or loss: nothing is stepped), and any
 * error the expert interface returns (-ETIMEDOUT when no expert answered).
 */
#ifndef HM_EXAMPLES_MODEL_H
#define HM_EXAMPLES_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "moe/ffn.h"

#define HM_MODEL_MAX_K 64          /* experts per step, as HM_MOE_MAX_K */
#define HM_MODEL_MAX_GRID 256      /* coordinates per grid dimension */
#define HM_MODEL_MAX_EXPERTS 4096  /* G0 * G1 */
#define HM_MODEL_MAX_DIM 8192      /* in_dim and dim */
#define HM_MODEL_MAX_CLASSES 1024
#define HM_MODEL_MAX_BATCH 8192

enum hm_model_opt { HM_MODEL_SGD = 0, HM_MODEL_ADAM = 1 };

typedef struct hm_model_config {
    size_t in_dim;    /* 784 for 28x28 images */
    size_t dim;       /* d: the hidden width and the experts' dim */
    size_t n_classes; /* 10 */
    size_t grid[2];   /* G0 x G1 experts */
    size_t k_best;    /* experts asked per step, 1..min(HM_MODEL_MAX_K, G0*G1) */
    size_t max_batch; /* scratch memory is sized for this batch */
    int optimizer;    /* enum hm_model_opt, for the local parameters */
    double lr;        /* 0: 1e-3 (Adam) or 1e-2 (SGD) */
    double momentum;  /* SGD only, 0: none */
    double beta1, beta2, eps; /* Adam, 0: 0.9, 0.999, 1e-8 */
    uint64_t seed;    /* initial weights are a deterministic function of it */
    /* -- routing options -- */
    int routing;      /* enum hm_model_routing (0: per batch) */
    int switch_layer; /* a Switch layer: per sample, k_best 1 (see below) */
    double balance_weight; /* Switch: the balancing loss's factor in the objective */
    double jitter_eps;     /* Switch: gate input noise in training, [0, 1) */
} hm_model_config;

/*
 * Routing. HM_MODEL_ROUTE_BATCH: the whole batch goes to the k_best
 * experts of the best mean score, as above. HM_MODEL_ROUTE_SAMPLE
 * (Hivemind's RemoteMixtureOfExperts): each sample goes to the k_best
 * available experts of its own best scores s[i] + s[G0 + j] (an exact
 * top-k, which the DHT's beam search approximates), every chosen expert
 * gets one call with the rows routed to it (hm_model_experts'
 * forward_routed), each sample mixes the experts that answered for it
 * with softmax weights over their scores, and backward goes to each
 * expert only with the rows it answered (backward_routed).
 *
 * A Switch layer (Fedus et al., 2021; switch_layer != 0, routed per
 * sample, k_best must be 1) as contrib/python's RemoteSwitchMixtureOfExperts:
 * sample b goes to its best expert e_b, and its mixture is
 * p_b(e_b) * y_b with p_b(e) = prod_d softmax(s_bd)[e_d], or zeros when
 * e_b did not answer. The balancing loss n_experts * sum_e f_e * P_e (f_e
 * the fraction of the batch routed to e, constant in the backward; P_e the
 * batch mean of p_b(e)) is 1 for a uniform routing and grows as it
 * concentrates; the gradient is that of loss + balance_weight *
 * balancing_loss. In training (hm_model_backward) the gate's input is
 * multiplied by uniform noise in [1 - jitter_eps, 1 + jitter_eps]; the
 * experts get h as it is.
 */
enum hm_model_routing { HM_MODEL_ROUTE_BATCH = 0, HM_MODEL_ROUTE_SAMPLE = 1 };

/*
 * The experts. Indices are flat grid positions e = i * G1 + j. Buffers are
 * [k, batch, dim] with row block n for experts[n].
 *
 * forward: runs experts[0..k) on h and writes y_out, sets answered[n] to 1
 * for each expert whose rows are valid (the model zeroes answered first).
 * Returns 0, or a negative code to fail the step (e.g. fewer than k_min
 * answered).
 *
 * backward: for the experts that answered forward, with gy = dL/dy; writes
 * gh_out = dL/dh of each and sets answered[n] for those that answered
 * (the model zeroes it first). A remote expert steps its own parameters
 * here. An expert that does not answer backward contributes no gradient to
 * h. Returns 0 or a negative code to fail the step.
 */
typedef struct hm_model_experts {
    void *ud;
    int (*forward)(void *ud, const size_t *experts, size_t k, const float *h, size_t batch,
                   size_t dim, float *y_out, uint8_t *answered);
    int (*backward)(void *ud, const size_t *experts, size_t k, const float *h, const float *gy,
                    size_t batch, size_t dim, float *gh_out, uint8_t *answered);
    /*
     * Per-sample routing (NULL: the model refuses it with -EINVAL).
     * experts[0..n): the distinct experts the batch is routed to; routes:
     * [batch, slots] int32, indices into experts or -1; y_out and gh_out
     * [batch, slots, dim], slot j of sample b the expert routes[b*slots+j]
     * on h[b]; answered[n] as above, per expert. allow_zero: a sample may
     * end with no answer (a Switch layer). backward gets routes with -1
     * for the experts that did not answer forward, and an expert whose
     * rows all are -1 need not be called.
     */
    int (*forward_routed)(void *ud, const size_t *experts, size_t n, const int32_t *routes,
                          size_t slots, const float *h, size_t batch, size_t dim,
                          int allow_zero, float *y_out, uint8_t *answered);
    int (*backward_routed)(void *ud, const size_t *experts, size_t n, const int32_t *routes,
                           size_t slots, const float *h, const float *gy, size_t batch,
                           size_t dim, int allow_zero, float *gh_out, uint8_t *answered);
} hm_model_experts;

/* What one forward (and backward) did. */
typedef struct hm_model_result {
    double loss;                       /* mean cross-entropy (0 without labels) */
    size_t correct;                    /* samples whose argmax is the label */
    size_t k;                          /* experts asked */
    size_t chosen[HM_MODEL_MAX_K];     /* their flat indices, best first */
    uint8_t answered[HM_MODEL_MAX_K];  /* forward */
    size_t n_answered;                 /* forward */
    size_t n_answered_backward;
    /* -- per-sample routing -- (k, chosen and answered then hold the first
     * HM_MODEL_MAX_K of the n_routed distinct experts; n_answered and
     * n_answered_backward count all of them) */
    size_t n_routed;
    double balancing_loss;             /* Switch, else 0 */
    uint64_t route_sig;                /* a hash of the routes and answers */
} hm_model_result;

typedef struct hm_model hm_model;

/* Weights uniform in +-1/sqrt(fan_in) (torch's nn.Linear), biases 0. */
int hm_model_new(const hm_model_config *cfg, hm_model **out);
void hm_model_free(hm_model *m);

/* The config with defaults filled in. */
const hm_model_config *hm_model_config_of(const hm_model *m);
size_t hm_model_nparams(const hm_model *m);
float *hm_model_params(hm_model *m);
const float *hm_model_grad(const hm_model *m);
size_t hm_model_n_experts(const hm_model *m);
uint64_t hm_model_steps(const hm_model *m);

/*
 * Which experts may be chosen: mask[G0 * G1], nonzero for yes (all are, at
 * first). -EINVAL when none is; when fewer than k_best are available,
 * only those are asked.
 */
int hm_model_set_available(hm_model *m, const uint8_t *mask);

/*
 * Forward only. labels may be NULL (then res->loss is 0); pred_out
 * ([batch], may be NULL) gets each sample's argmax. Experts run forward
 * only. batch 1..max_batch.
 */
int hm_model_forward(hm_model *m, const hm_model_experts *ex, const float *x,
                     const uint8_t *labels, size_t batch, uint8_t *pred_out,
                     hm_model_result *res);

/*
 * Forward and backward: the gradient of the mean loss with respect to the
 * local parameters replaces hm_model_grad; grad_x ([batch, in_dim], may be
 * NULL) gets dL/dx. Experts run backward (and step themselves). No local
 * step.
 */
int hm_model_backward(hm_model *m, const hm_model_experts *ex, const float *x,
                      const uint8_t *labels, size_t batch, float *grad_x, hm_model_result *res);

/* One optimizer step of the local parameters with hm_model_grad. */
int hm_model_step(hm_model *m);

/* hm_model_backward, then hm_model_step when it succeeded. */
int hm_model_train_step(hm_model *m, const hm_model_experts *ex, const float *x,
                        const uint8_t *labels, size_t batch, hm_model_result *res);

/*
 * In-process experts: experts[e] serves flat index e. step 1: backward is
 * hm_ffn_backward (the expert's optimizer steps, as on a server); step 0:
 * hm_ffn_grad only (for finite differences). dead, when not NULL, marks
 * experts that never answer (dead[e] != 0), to exercise the model's
 * handling of missing experts. bind fills an hm_model_experts that calls
 * into le, which must outlive it.
 */
typedef struct hm_model_local_experts {
    hm_ffn **experts;
    size_t n;
    int step;
    const uint8_t *dead;
} hm_model_local_experts;

void hm_model_local_experts_bind(hm_model_local_experts *le, hm_model_experts *out);

/*
 * The balancing loss of a Switch layer on its own: s [batch, G0 + G1] the
 * gate's scores, first[b] the flat index of sample b's expert (-1: none).
 * Returns n_experts * sum_e f_e * P_e; gs_out ([batch, G0 + G1], may be
 * NULL) gets its gradient with respect to s, f held constant.
 */
double hm_model_balancing_loss(const size_t *grid, const float *s, size_t batch,
                               const int32_t *first, float *gs_out);

#endif

/*
 * model: the example classifier's forward and backward passes and its
 * optimizer (model.h). It owns the local parameters, their gradient, the
 * optimizer's moments and scratch buffers sized once for max_batch, so a
 * training step allocates nothing. The experts are reached only through
 * hm_model_experts; the in-process implementation over hm_ffn objects is
 * at the end of this file.
 */
#include "config.h"

#include "contrib/examples/model.h"

#include <cblas.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

struct hm_model {
    hm_model_config cfg;
    size_t n_experts, n_scores; /* G0 * G1, G0 + G1 */
    size_t nparams;
    /* Offsets of each block inside params. */
    size_t o_win, o_bin, o_wgate, o_bgate, o_wout, o_bout;
    float *params, *grad, *m1, *m2;
    uint64_t steps;
    uint8_t *available;
    /* Scratch, sized for max_batch. */
    float *h_pre, *h, *s, *ys, *mix, *w, *z, *gz, *gmix, *gy, *ghe, *gh, *gs;
    size_t k;                          /* experts asked in the last forward */
    size_t chosen[HM_MODEL_MAX_K];
    uint8_t answered[HM_MODEL_MAX_K];
};

/* splitmix64, so that initial weights depend on the seed alone. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void init_uniform(float *w, size_t n, double bound, uint64_t *rng)
{
    for (size_t i = 0; i < n; i++) {
        double u = (double)(rng_next(rng) >> 11) * 0x1p-53;
        w[i] = (float)((2.0 * u - 1.0) * bound);
    }
}

static int check_config(const hm_model_config *c)
{
    if (c->in_dim < 1 || c->in_dim > HM_MODEL_MAX_DIM || c->dim < 1 ||
        c->dim > HM_MODEL_MAX_DIM || c->n_classes < 2 || c->n_classes > HM_MODEL_MAX_CLASSES)
        return -EINVAL;
    if (c->grid[0] < 1 || c->grid[0] > HM_MODEL_MAX_GRID || c->grid[1] < 1 ||
        c->grid[1] > HM_MODEL_MAX_GRID || c->grid[0] * c->grid[1] > HM_MODEL_MAX_EXPERTS)
        return -EINVAL;
    if (c->k_best < 1 || c->k_best > HM_MODEL_MAX_K || c->k_best > c->grid[0] * c->grid[1])
        return -EINVAL;
    if (c->max_batch < 1 || c->max_batch > HM_MODEL_MAX_BATCH)
        return -EINVAL;
    if (c->optimizer != HM_MODEL_SGD && c->optimizer != HM_MODEL_ADAM)
        return -EINVAL;
    if (!(c->lr > 0) || !isfinite(c->lr) || c->momentum < 0 || c->momentum >= 1 ||
        c->beta1 < 0 || c->beta1 >= 1 || c->beta2 < 0 || c->beta2 >= 1 || !(c->eps > 0))
        return -EINVAL;
    return 0;
}

static void *alloc_floats(size_t n)
{
    return calloc(n ? n : 1, sizeof(float));
}

int hm_model_new(const hm_model_config *cfg, hm_model **out)
{
    if (cfg == NULL || out == NULL)
        return -EINVAL;
    *out = NULL;
    hm_model_config c = *cfg;
    if (c.lr == 0)
        c.lr = c.optimizer == HM_MODEL_ADAM ? 1e-3 : 1e-2;
    if (c.beta1 == 0)
        c.beta1 = 0.9;
    if (c.beta2 == 0)
        c.beta2 = 0.999;
    if (c.eps == 0)
        c.eps = 1e-8;
    int result = check_config(&c);
    if (result < 0)
        return result;

    hm_model *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return -ENOMEM;
    m->cfg = c;
    m->n_experts = c.grid[0] * c.grid[1];
    m->n_scores = c.grid[0] + c.grid[1];
    size_t d = c.dim, B = c.max_batch, K = c.k_best;
    m->o_win = 0;
    m->o_bin = m->o_win + d * c.in_dim;
    m->o_wgate = m->o_bin + d;
    m->o_bgate = m->o_wgate + m->n_scores * d;
    m->o_wout = m->o_bgate + m->n_scores;
    m->o_bout = m->o_wout + c.n_classes * d;
    m->nparams = m->o_bout + c.n_classes;

    m->params = alloc_floats(m->nparams);
    m->grad = alloc_floats(m->nparams);
    m->m1 = alloc_floats(m->nparams);
    m->m2 = c.optimizer == HM_MODEL_ADAM ? alloc_floats(m->nparams) : alloc_floats(1);
    m->available = malloc(m->n_experts);
    m->h_pre = alloc_floats(B * d);
    m->h = alloc_floats(B * d);
    m->s = alloc_floats(B * m->n_scores);
    m->ys = alloc_floats(K * B * d);
    m->mix = alloc_floats(B * d);
    m->w = alloc_floats(B * K);
    m->z = alloc_floats(B * c.n_classes);
    m->gz = alloc_floats(B * c.n_classes);
    m->gmix = alloc_floats(B * d);
    m->gy = alloc_floats(K * B * d);
    m->ghe = alloc_floats(K * B * d);
    m->gh = alloc_floats(B * d);
    m->gs = alloc_floats(B * m->n_scores);
    if (m->params == NULL || m->grad == NULL || m->m1 == NULL || m->m2 == NULL ||
        m->available == NULL || m->h_pre == NULL || m->h == NULL || m->s == NULL ||
        m->ys == NULL || m->mix == NULL || m->w == NULL || m->z == NULL || m->gz == NULL ||
        m->gmix == NULL || m->gy == NULL || m->ghe == NULL || m->gh == NULL || m->gs == NULL) {
        result = -ENOMEM;
        goto out;
    }
    memset(m->available, 1, m->n_experts);

    uint64_t rng = c.seed;
    init_uniform(m->params + m->o_win, d * c.in_dim, 1.0 / sqrt((double)c.in_dim), &rng);
    init_uniform(m->params + m->o_wgate, m->n_scores * d, 1.0 / sqrt((double)d), &rng);
    init_uniform(m->params + m->o_wout, c.n_classes * d, 1.0 / sqrt((double)d), &rng);
    *out = m;
    m = NULL;
    result = 0;
out:
    hm_model_free(m);
    return result;
}

void hm_model_free(hm_model *m)
{
    if (m == NULL)
        return;
    free(m->params);
    free(m->grad);
    free(m->m1);
    free(m->m2);
    free(m->available);
    free(m->h_pre);
    free(m->h);
    free(m->s);
    free(m->ys);
    free(m->mix);
    free(m->w);
    free(m->z);
    free(m->gz);
    free(m->gmix);
    free(m->gy);
    free(m->ghe);
    free(m->gh);
    free(m->gs);
    free(m);
}

const hm_model_config *hm_model_config_of(const hm_model *m) { return &m->cfg; }
size_t hm_model_nparams(const hm_model *m) { return m->nparams; }
float *hm_model_params(hm_model *m) { return m->params; }
const float *hm_model_grad(const hm_model *m) { return m->grad; }
size_t hm_model_n_experts(const hm_model *m) { return m->n_experts; }
uint64_t hm_model_steps(const hm_model *m) { return m->steps; }

int hm_model_set_available(hm_model *m, const uint8_t *mask)
{
    if (m == NULL || mask == NULL)
        return -EINVAL;
    size_t n = 0;
    for (size_t e = 0; e < m->n_experts; e++)
        n += mask[e] != 0;
    if (n == 0)
        return -EINVAL;
    for (size_t e = 0; e < m->n_experts; e++)
        m->available[e] = mask[e] != 0;
    return 0;
}

/* out[B, n] = a[B, k] · w[n, k]^T + b[n] */
static void linear(const float *a, const float *w, const float *b, size_t batch, size_t k,
                   size_t n, float *out)
{
    for (size_t r = 0; r < batch; r++)
        memcpy(out + r * n, b, n * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)batch, (int)n, (int)k, 1.0f, a,
                (int)k, w, (int)k, 1.0f, out, (int)n);
}

/*
 * Picks up to k_best available experts by their score averaged over the
 * batch: mean(s0[i]) + mean(s1[j]). A selection sort over at most
 * HM_MODEL_MAX_EXPERTS candidates; ties go to the lower index, so the
 * choice is deterministic.
 */
static void choose_experts(hm_model *m, size_t batch)
{
    size_t G0 = m->cfg.grid[0], G1 = m->cfg.grid[1], S = m->n_scores;
    double mean[2 * HM_MODEL_MAX_GRID];
    for (size_t c = 0; c < S; c++)
        mean[c] = 0;
    for (size_t b = 0; b < batch; b++)
        for (size_t c = 0; c < S; c++)
            mean[c] += m->s[b * S + c];
    uint8_t taken[HM_MODEL_MAX_EXPERTS];
    memset(taken, 0, m->n_experts);
    m->k = 0;
    while (m->k < m->cfg.k_best) {
        size_t best = SIZE_MAX;
        double best_score = -INFINITY;
        for (size_t e = 0; e < m->n_experts; e++) {
            if (!m->available[e] || taken[e])
                continue;
            double sc = mean[e / G1] + mean[G0 + e % G1];
            if (best == SIZE_MAX || sc > best_score) {
                best = e;
                best_score = sc;
            }
        }
        if (best == SIZE_MAX)
            break;
        taken[best] = 1;
        m->chosen[m->k++] = best;
    }
}

static int all_finite(const float *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(v[i]))
            return 0;
    return 1;
}

/*
 * The forward pass into the scratch buffers; loss and correct count when
 * labels are given. Leaves softmax(z) in m->z for the backward pass.
 */
static int forward(hm_model *m, const hm_model_experts *ex, const float *x,
                   const uint8_t *labels, size_t batch, uint8_t *pred_out, hm_model_result *res)
{
    const hm_model_config *c = &m->cfg;
    size_t d = c->dim, S = m->n_scores, C = c->n_classes, G0 = c->grid[0], G1 = c->grid[1];
    if (ex == NULL || ex->forward == NULL || x == NULL || batch < 1 || batch > c->max_batch)
        return -EINVAL;
    if (labels != NULL)
        for (size_t b = 0; b < batch; b++)
            if (labels[b] >= C)
                return -EINVAL;
    if (!all_finite(x, batch * c->in_dim))
        return -EDOM;

    linear(x, m->params + m->o_win, m->params + m->o_bin, batch, c->in_dim, d, m->h_pre);
    for (size_t i = 0; i < batch * d; i++)
        m->h[i] = m->h_pre[i] > 0 ? m->h_pre[i] : 0.0f;
    linear(m->h, m->params + m->o_wgate, m->params + m->o_bgate, batch, d, S, m->s);
    if (!all_finite(m->s, batch * S))
        return -EDOM;
    choose_experts(m, batch);

    size_t k = m->k;
    memset(m->answered, 0, sizeof(m->answered));
    int result = ex->forward(ex->ud, m->chosen, k, m->h, batch, d, m->ys, m->answered);
    if (result < 0)
        return result;
    size_t n_ans = 0;
    for (size_t e = 0; e < k; e++)
        n_ans += m->answered[e] != 0;
    if (n_ans == 0)
        return -ETIMEDOUT;
    for (size_t e = 0; e < k; e++)
        if (m->answered[e] && !all_finite(m->ys + e * batch * d, batch * d))
            m->answered[e] = 0; /* a non-finite answer counts as none */

    /* Mixture weights: softmax over the answered experts of s0[i] + s1[j],
     * the maximum subtracted so that exp cannot overflow. */
    for (size_t b = 0; b < batch; b++) {
        const float *sb = m->s + b * S;
        float *wb = m->w + b * k;
        double mx = -INFINITY, sum = 0;
        for (size_t e = 0; e < k; e++) {
            double lg = (double)sb[m->chosen[e] / G1] + sb[G0 + m->chosen[e] % G1];
            wb[e] = (float)lg;
            if (m->answered[e] && lg > mx)
                mx = lg;
        }
        for (size_t e = 0; e < k; e++) {
            double v = m->answered[e] ? exp((double)wb[e] - mx) : 0.0;
            wb[e] = (float)v;
            sum += v;
        }
        if (!(sum > 0))
            return -ETIMEDOUT; /* every answer was non-finite */
        float *o = m->mix + b * d;
        memset(o, 0, d * sizeof(float));
        for (size_t e = 0; e < k; e++) {
            wb[e] = (float)(wb[e] / sum);
            if (!m->answered[e])
                continue;
            cblas_saxpy((int)d, wb[e], m->ys + (e * batch + b) * d, 1, o, 1);
        }
    }

    linear(m->mix, m->params + m->o_wout, m->params + m->o_bout, batch, d, C, m->z);
    double loss = 0;
    size_t correct = 0;
    for (size_t b = 0; b < batch; b++) {
        float *zb = m->z + b * C;
        size_t arg = 0;
        float mx = zb[0];
        for (size_t j = 1; j < C; j++)
            if (zb[j] > mx) {
                mx = zb[j];
                arg = j;
            }
        double sum = 0;
        for (size_t j = 0; j < C; j++)
            sum += exp((double)zb[j] - mx);
        double lse = mx + log(sum);
        if (labels != NULL) {
            loss += lse - zb[labels[b]];
            correct += arg == labels[b];
        }
        if (pred_out != NULL)
            pred_out[b] = (uint8_t)arg;
        for (size_t j = 0; j < C; j++)
            zb[j] = (float)exp((double)zb[j] - lse);
    }
    loss /= (double)batch;
    if (!isfinite(loss))
        return -EDOM;

    if (res != NULL) {
        memset(res, 0, sizeof(*res));
        res->loss = labels != NULL ? loss : 0.0;
        res->correct = correct;
        res->k = k;
        memcpy(res->chosen, m->chosen, k * sizeof(size_t));
        memcpy(res->answered, m->answered, k);
        for (size_t e = 0; e < k; e++)
            res->n_answered += m->answered[e] != 0;
    }
    return 0;
}

int hm_model_forward(hm_model *m, const hm_model_experts *ex, const float *x,
                     const uint8_t *labels, size_t batch, uint8_t *pred_out,
                     hm_model_result *res)
{
    if (m == NULL)
        return -EINVAL;
    return forward(m, ex, x, labels, batch, pred_out, res);
}

int hm_model_backward(hm_model *m, const hm_model_experts *ex, const float *x,
                      const uint8_t *labels, size_t batch, float *grad_x, hm_model_result *res)
{
    if (m == NULL || labels == NULL || ex == NULL || ex->backward == NULL)
        return -EINVAL;
    hm_model_result r;
    int result = forward(m, ex, x, labels, batch, NULL, &r);
    if (result < 0)
        return result;
    const hm_model_config *c = &m->cfg;
    size_t d = c->dim, S = m->n_scores, C = c->n_classes, G0 = c->grid[0], G1 = c->grid[1];
    size_t k = m->k;
    float *g = m->grad;
    const float inv_b = 1.0f / (float)batch;

    /* dL/dz = (softmax - onehot) / batch */
    for (size_t b = 0; b < batch; b++)
        for (size_t j = 0; j < C; j++)
            m->gz[b * C + j] = (m->z[b * C + j] - (j == labels[b] ? 1.0f : 0.0f)) * inv_b;

    /* Output layer: dW_out = gz^T · mix, db_out = column sums, dmix = gz · W_out. */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)C, (int)d, (int)batch, 1.0f, m->gz,
                (int)C, m->mix, (int)d, 0.0f, g + m->o_wout, (int)d);
    for (size_t j = 0; j < C; j++) {
        float sum = 0;
        for (size_t b = 0; b < batch; b++)
            sum += m->gz[b * C + j];
        g[m->o_bout + j] = sum;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)batch, (int)d, (int)C, 1.0f,
                m->gz, (int)C, m->params + m->o_wout, (int)d, 0.0f, m->gmix, (int)d);

    /*
     * Mixture: dy_e = w_e * dmix; with dot_e = dmix · y_e, the softmax
     * gives dlogit_e = w_e * (dot_e - sum_e' w_e' dot_e'), and an expert's
     * logit is s0[i] + s1[j], so dlogit_e adds to both coordinates.
     */
    memset(m->gs, 0, batch * S * sizeof(float));
    for (size_t b = 0; b < batch; b++) {
        const float *gm = m->gmix + b * d;
        const float *wb = m->w + b * k;
        double dot[HM_MODEL_MAX_K], avg = 0;
        for (size_t e = 0; e < k; e++) {
            dot[e] = 0;
            if (!m->answered[e])
                continue;
            dot[e] = cblas_sdot((int)d, gm, 1, m->ys + (e * batch + b) * d, 1);
            avg += wb[e] * dot[e];
        }
        float *gsb = m->gs + b * S;
        for (size_t e = 0; e < k; e++) {
            if (!m->answered[e])
                continue;
            float gl = (float)(wb[e] * (dot[e] - avg));
            gsb[m->chosen[e] / G1] += gl;
            gsb[G0 + m->chosen[e] % G1] += gl;
        }
    }

    /* Gate: dW_gate = gs^T · h, db_gate = column sums, dh = gs · W_gate. */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)S, (int)d, (int)batch, 1.0f, m->gs,
                (int)S, m->h, (int)d, 0.0f, g + m->o_wgate, (int)d);
    for (size_t j = 0; j < S; j++) {
        float sum = 0;
        for (size_t b = 0; b < batch; b++)
            sum += m->gs[b * S + j];
        g[m->o_bgate + j] = sum;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)batch, (int)d, (int)S, 1.0f,
                m->gs, (int)S, m->params + m->o_wgate, (int)d, 0.0f, m->gh, (int)d);

    /* Experts: backward only for those that answered forward, packed. */
    size_t idx[HM_MODEL_MAX_K], kb = 0;
    for (size_t e = 0; e < k; e++) {
        if (!m->answered[e])
            continue;
        idx[kb] = m->chosen[e];
        float *gye = m->gy + kb * batch * d;
        for (size_t b = 0; b < batch; b++) {
            float wbe = m->w[b * k + e];
            const float *gm = m->gmix + b * d;
            for (size_t i = 0; i < d; i++)
                gye[b * d + i] = wbe * gm[i];
        }
        kb++;
    }
    uint8_t bans[HM_MODEL_MAX_K];
    memset(bans, 0, sizeof(bans));
    result = ex->backward(ex->ud, idx, kb, m->h, m->gy, batch, d, m->ghe, bans);
    if (result < 0)
        return result;
    size_t n_bans = 0;
    for (size_t n = 0; n < kb; n++) {
        if (!bans[n] || !all_finite(m->ghe + n * batch * d, batch * d))
            continue;
        n_bans++;
        cblas_saxpy((int)(batch * d), 1.0f, m->ghe + n * batch * d, 1, m->gh, 1);
    }

    /* Input layer through the ReLU. */
    for (size_t i = 0; i < batch * d; i++)
        if (!(m->h_pre[i] > 0))
            m->gh[i] = 0.0f;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)d, (int)c->in_dim, (int)batch, 1.0f,
                m->gh, (int)d, x, (int)c->in_dim, 0.0f, g + m->o_win, (int)c->in_dim);
    for (size_t i = 0; i < d; i++) {
        float sum = 0;
        for (size_t b = 0; b < batch; b++)
            sum += m->gh[b * d + i];
        g[m->o_bin + i] = sum;
    }
    if (grad_x != NULL)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)batch, (int)c->in_dim, (int)d,
                    1.0f, m->gh, (int)d, m->params + m->o_win, (int)c->in_dim, 0.0f, grad_x,
                    (int)c->in_dim);
    if (!all_finite(g, m->nparams))
        return -EDOM;
    r.n_answered_backward = n_bans;
    if (res != NULL)
        *res = r;
    return 0;
}

int hm_model_step(hm_model *m)
{
    if (m == NULL)
        return -EINVAL;
    const hm_model_config *c = &m->cfg;
    m->steps++;
    if (c->optimizer == HM_MODEL_SGD) {
        for (size_t i = 0; i < m->nparams; i++) {
            float gi = m->grad[i];
            if (c->momentum > 0) {
                m->m1[i] = (float)(c->momentum * m->m1[i] + gi);
                gi = m->m1[i];
            }
            m->params[i] -= (float)(c->lr * gi);
        }
        return 0;
    }
    /* Adam as torch.optim.Adam, bias-corrected. */
    double bc1 = 1.0 - pow(c->beta1, (double)m->steps);
    double bc2 = 1.0 - pow(c->beta2, (double)m->steps);
    float b1 = (float)c->beta1, b2 = (float)c->beta2;
    float step = (float)(c->lr / bc1), sq_bc2 = (float)sqrt(bc2), eps = (float)c->eps;
    for (size_t i = 0; i < m->nparams; i++) {
        float gi = m->grad[i];
        m->m1[i] = b1 * m->m1[i] + (1.0f - b1) * gi;
        m->m2[i] = b2 * m->m2[i] + (1.0f - b2) * gi * gi;
        m->params[i] -= step * m->m1[i] / (sqrtf(m->m2[i]) / sq_bc2 + eps);
    }
    return 0;
}

int hm_model_train_step(hm_model *m, const hm_model_experts *ex, const float *x,
                        const uint8_t *labels, size_t batch, hm_model_result *res)
{
    int result = hm_model_backward(m, ex, x, labels, batch, NULL, res);
    if (result < 0)
        return result;
    return hm_model_step(m);
}

/* ---- in-process experts ---- */

static int local_forward(void *ud, const size_t *experts, size_t k, const float *h,
                         size_t batch, size_t dim, float *y_out, uint8_t *answered)
{
    hm_model_local_experts *le = ud;
    for (size_t n = 0; n < k; n++) {
        size_t e = experts[n];
        if (e >= le->n || le->experts[e] == NULL || (le->dead != NULL && le->dead[e]))
            continue;
        if (hm_ffn_dim(le->experts[e]) != dim)
            return -EINVAL;
        if (hm_ffn_forward(le->experts[e], h, batch, y_out + n * batch * dim) == 0)
            answered[n] = 1;
    }
    return 0;
}

static int local_backward(void *ud, const size_t *experts, size_t k, const float *h,
                          const float *gy, size_t batch, size_t dim, float *gh_out,
                          uint8_t *answered)
{
    hm_model_local_experts *le = ud;
    for (size_t n = 0; n < k; n++) {
        size_t e = experts[n];
        if (e >= le->n || le->experts[e] == NULL || (le->dead != NULL && le->dead[e]))
            continue;
        if (hm_ffn_dim(le->experts[e]) != dim)
            return -EINVAL;
        const float *g = gy + n * batch * dim;
        float *gx = gh_out + n * batch * dim;
        int r = le->step ? hm_ffn_backward(le->experts[e], h, g, batch, gx)
                         : hm_ffn_grad(le->experts[e], h, g, batch, gx, NULL);
        if (r == 0)
            answered[n] = 1;
    }
    return 0;
}

void hm_model_local_experts_bind(hm_model_local_experts *le, hm_model_experts *out)
{
    out->ud = le;
    out->forward = local_forward;
    out->backward = local_backward;
}

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
    /* -- per-sample routing: [B, K] routes into rlist, the distinct
     * experts of the last forward (n_list), their answers, the Switch's
     * per-dimension softmax [B, S] and the jittered gate input [B, d]. */
    int32_t *routes, *broutes, *slot_of;
    size_t *rlist, n_list;
    uint8_t *rans, *bans;
    float *sm, *hg, *noise;
    int jittered;
    uint64_t noise_rng;
    double bal;
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
    if ((c->routing != HM_MODEL_ROUTE_BATCH && c->routing != HM_MODEL_ROUTE_SAMPLE) ||
        (c->switch_layer && c->k_best != 1) || !(c->jitter_eps >= 0) || c->jitter_eps >= 1 ||
        !(c->balance_weight >= 0) || !isfinite(c->balance_weight))
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
    m->routes = calloc(B * K, sizeof(int32_t));
    m->broutes = calloc(B * K, sizeof(int32_t));
    m->slot_of = malloc(m->n_experts * sizeof(int32_t));
    m->rlist = calloc(m->n_experts, sizeof(size_t));
    m->rans = calloc(m->n_experts, 1);
    m->bans = calloc(m->n_experts, 1);
    m->sm = alloc_floats(B * m->n_scores);
    m->hg = alloc_floats(B * d);
    m->noise = alloc_floats(B * d);
    m->noise_rng = c.seed ^ 0x6a09e667f3bcc909ull;
    if (m->routes == NULL || m->broutes == NULL || m->slot_of == NULL || m->rlist == NULL ||
        m->rans == NULL || m->bans == NULL || m->sm == NULL || m->hg == NULL ||
        m->noise == NULL) {
        result = -ENOMEM;
        goto out;
    }
    for (size_t e = 0; e < m->n_experts; e++)
        m->slot_of[e] = -1;
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
    free(m->routes);
    free(m->broutes);
    free(m->slot_of);
    free(m->rlist);
    free(m->rans);
    free(m->bans);
    free(m->sm);
    free(m->hg);
    free(m->noise);
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


/* -- per-sample routing -- */

static int per_sample(const hm_model *m)
{
    return m->cfg.routing == HM_MODEL_ROUTE_SAMPLE || m->cfg.switch_layer;
}

/* Slots per sample: k_best (1 for a Switch layer, which check_config ensures). */
static size_t slots_of(const hm_model *m) { return m->cfg.k_best; }

/*
 * Each sample's k_best available experts by its own scores, best first
 * (ties to the lower index); m->rlist gets the distinct ones in the order
 * first routed to, m->routes the indices into it (-1 past the available).
 */
static void route_samples(hm_model *m, size_t batch)
{
    size_t G0 = m->cfg.grid[0], G1 = m->cfg.grid[1], S = m->n_scores, K = slots_of(m);
    for (size_t n = 0; n < m->n_list; n++)
        m->slot_of[m->rlist[n]] = -1;
    m->n_list = 0;
    for (size_t b = 0; b < batch; b++) {
        const float *sb = m->s + b * S;
        size_t picks[HM_MODEL_MAX_K];
        for (size_t j = 0; j < K; j++) {
            size_t best = SIZE_MAX;
            double best_score = -INFINITY;
            for (size_t e = 0; e < m->n_experts; e++) {
                if (!m->available[e])
                    continue;
                size_t q = 0;
                while (q < j && picks[q] != e)
                    q++;
                if (q < j)
                    continue;
                double sc = (double)sb[e / G1] + sb[G0 + e % G1];
                if (best == SIZE_MAX || sc > best_score) {
                    best = e;
                    best_score = sc;
                }
            }
            if (best == SIZE_MAX) {
                for (; j < K; j++)
                    m->routes[b * K + j] = -1;
                break;
            }
            picks[j] = best;
            if (m->slot_of[best] < 0) {
                m->slot_of[best] = (int32_t)m->n_list;
                m->rlist[m->n_list++] = best;
            }
            m->routes[b * K + j] = m->slot_of[best];
        }
    }
}

/* The softmax of each grid dimension's scores of one sample (S floats). */
static void grid_softmax(const size_t *grid, const float *sb, double *out)
{
    for (size_t d = 0, at = 0; d < 2; at += grid[d], d++) {
        double mx = sb[at], sum = 0;
        for (size_t c = 1; c < grid[d]; c++)
            if (sb[at + c] > mx)
                mx = sb[at + c];
        for (size_t c = 0; c < grid[d]; c++) {
            out[at + c] = exp((double)sb[at + c] - mx);
            sum += out[at + c];
        }
        for (size_t c = 0; c < grid[d]; c++)
            out[at + c] /= sum;
    }
}

double hm_model_balancing_loss(const size_t *grid, const float *s, size_t batch,
                               const int32_t *first, float *gs_out)
{
    if (grid == NULL || s == NULL || first == NULL || batch < 1 ||
        batch > HM_MODEL_MAX_BATCH || grid[0] < 1 || grid[0] > HM_MODEL_MAX_GRID ||
        grid[1] < 1 || grid[1] > HM_MODEL_MAX_GRID || grid[0] * grid[1] > HM_MODEL_MAX_EXPERTS)
        return NAN;
    size_t G0 = grid[0], G1 = grid[1], N = G0 * G1, S = G0 + G1;
    static _Thread_local size_t count[HM_MODEL_MAX_EXPERTS], used[HM_MODEL_MAX_EXPERTS];
    size_t n_used = 0;
    for (size_t e = 0; e < N; e++)
        count[e] = 0;
    for (size_t b = 0; b < batch; b++)
        if (first[b] >= 0 && (size_t)first[b] < N && count[first[b]]++ == 0)
            used[n_used++] = (size_t)first[b];
    /* loss = N * sum_e f_e * (1/B) sum_b p_b(e); with p_b(e) = sm0[i] *
     * sm1[j], dp/ds_d[c] = p * ([c == e_d] - sm_d[c]). */
    double loss = 0, scale = (double)N / ((double)batch * (double)batch);
    for (size_t b = 0; b < batch; b++) {
        double sm[2 * HM_MODEL_MAX_GRID], tot = 0;
        grid_softmax(grid, s + b * S, sm);
        float *g = gs_out != NULL ? gs_out + b * S : NULL;
        if (g != NULL)
            memset(g, 0, S * sizeof(float));
        for (size_t u = 0; u < n_used; u++) {
            size_t e = used[u];
            /* f_e / B * p_b(e) * N, f_e = count / B */
            double c = scale * (double)count[e] * sm[e / G1] * sm[G0 + e % G1];
            loss += c;
            tot += c;
            if (g != NULL) {
                g[e / G1] += (float)c;
                g[G0 + e % G1] += (float)c;
            }
        }
        if (g != NULL)
            for (size_t c = 0; c < S; c++)
                g[c] -= (float)(tot * sm[c]);
    }
    return loss;
}

/*
 * The mixture of a per-sample routed batch into m->mix (and m->w: slot
 * weights, or for a Switch layer p_b(e_b), 0 when e_b did not answer).
 */
static int forward_sample(hm_model *m, const hm_model_experts *ex, size_t batch)
{
    const hm_model_config *c = &m->cfg;
    size_t d = c->dim, S = m->n_scores, G0 = c->grid[0], G1 = c->grid[1], K = slots_of(m);
    if (ex->forward_routed == NULL)
        return -EINVAL;
    route_samples(m, batch);
    if (m->n_list == 0)
        return -ETIMEDOUT;
    memset(m->rans, 0, m->n_list);
    int result = ex->forward_routed(ex->ud, m->rlist, m->n_list, m->routes, K, m->h, batch, d,
                                    c->switch_layer, m->ys, m->rans);
    if (result < 0)
        return result;
    /* A non-finite row counts as no answer from its expert. */
    for (size_t i = 0; i < batch * K; i++) {
        int32_t r = m->routes[i];
        if (r >= 0 && m->rans[r] && !all_finite(m->ys + i * d, d))
            m->rans[r] = 0;
    }
    size_t n_ans = 0;
    for (size_t n = 0; n < m->n_list; n++)
        n_ans += m->rans[n] != 0;
    if (n_ans == 0 && !c->switch_layer)
        return -ETIMEDOUT;
    m->bal = 0;
    if (c->switch_layer) {
        for (size_t b = 0; b < batch; b++) {
            double sm[2 * HM_MODEL_MAX_GRID];
            grid_softmax(c->grid, m->s + b * S, sm);
            for (size_t q = 0; q < S; q++)
                m->sm[b * S + q] = (float)sm[q];
            int32_t r = m->routes[b];
            float *o = m->mix + b * d;
            memset(o, 0, d * sizeof(float));
            m->w[b] = 0;
            m->broutes[b] = r >= 0 ? (int32_t)m->rlist[r] : -1;
            if (r < 0 || !m->rans[r])
                continue;
            size_t e = m->rlist[r];
            m->w[b] = (float)(sm[e / G1] * sm[G0 + e % G1]);
            cblas_saxpy((int)d, m->w[b], m->ys + b * d, 1, o, 1);
        }
        /* broutes holds each sample's expert for now, as the loss wants. */
        m->bal = hm_model_balancing_loss(c->grid, m->s, batch, m->broutes, NULL);
        return 0;
    }
    for (size_t b = 0; b < batch; b++) {
        const float *sb = m->s + b * S;
        float *wb = m->w + b * K;
        double mx = -INFINITY, sum = 0;
        for (size_t j = 0; j < K; j++) {
            int32_t r = m->routes[b * K + j];
            wb[j] = 0;
            if (r < 0 || !m->rans[r])
                continue;
            double lg = (double)sb[m->rlist[r] / G1] + sb[G0 + m->rlist[r] % G1];
            wb[j] = (float)lg;
            if (lg > mx)
                mx = lg;
        }
        for (size_t j = 0; j < K; j++) {
            int32_t r = m->routes[b * K + j];
            double v = r >= 0 && m->rans[r] ? exp((double)wb[j] - mx) : 0.0;
            wb[j] = (float)v;
            sum += v;
        }
        if (!(sum > 0))
            return -ETIMEDOUT; /* none of this sample's experts answered */
        float *o = m->mix + b * d;
        memset(o, 0, d * sizeof(float));
        for (size_t j = 0; j < K; j++) {
            wb[j] = (float)(wb[j] / sum);
            if (wb[j] != 0)
                cblas_saxpy((int)d, wb[j], m->ys + (b * K + j) * d, 1, o, 1);
        }
    }
    return 0;
}

/* dL/ds of a per-sample routed mixture (and the Switch's balancing loss) into m->gs. */
static void sample_gs(hm_model *m, size_t batch)
{
    const hm_model_config *c = &m->cfg;
    size_t d = c->dim, S = m->n_scores, G0 = c->grid[0], G1 = c->grid[1], K = slots_of(m);
    if (c->switch_layer) {
        /* m->broutes still holds each sample's expert from forward. */
        if (c->balance_weight > 0) {
            hm_model_balancing_loss(c->grid, m->s, batch, m->broutes, m->gs);
            for (size_t i = 0; i < batch * S; i++)
                m->gs[i] *= (float)c->balance_weight;
        } else {
            memset(m->gs, 0, batch * S * sizeof(float));
        }
        /* mix_b = p_b * y_b: dL/dp = gmix · y, dp/ds_d[q] = p ([q == e_d] - sm_d[q]). */
        for (size_t b = 0; b < batch; b++) {
            if (!(m->w[b] > 0))
                continue;
            size_t e = m->rlist[m->routes[b]];
            double coef = m->w[b] * cblas_sdot((int)d, m->gmix + b * d, 1, m->ys + b * d, 1);
            float *gsb = m->gs + b * S;
            const float *smb = m->sm + b * S;
            gsb[e / G1] += (float)coef;
            gsb[G0 + e % G1] += (float)coef;
            for (size_t q = 0; q < S; q++)
                gsb[q] -= (float)(coef * smb[q]);
        }
        return;
    }
    memset(m->gs, 0, batch * S * sizeof(float));
    for (size_t b = 0; b < batch; b++) {
        const float *gm = m->gmix + b * d, *wb = m->w + b * K;
        double dot[HM_MODEL_MAX_K], avg = 0;
        for (size_t j = 0; j < K; j++) {
            dot[j] = 0;
            if (wb[j] == 0)
                continue;
            dot[j] = cblas_sdot((int)d, gm, 1, m->ys + (b * K + j) * d, 1);
            avg += wb[j] * dot[j];
        }
        float *gsb = m->gs + b * S;
        for (size_t j = 0; j < K; j++) {
            if (wb[j] == 0)
                continue;
            size_t e = m->rlist[m->routes[b * K + j]];
            float gl = (float)(wb[j] * (dot[j] - avg));
            gsb[e / G1] += gl;
            gsb[G0 + e % G1] += gl;
        }
    }
}

/*
 * Backward to the experts of a per-sample routed forward, each with the
 * rows it answered; their dL/dh adds to m->gh.
 */
static int sample_experts_backward(hm_model *m, const hm_model_experts *ex, size_t batch,
                                   size_t *n_bans_out)
{
    const hm_model_config *c = &m->cfg;
    size_t d = c->dim, K = slots_of(m);
    *n_bans_out = 0;
    if (ex->backward_routed == NULL)
        return -EINVAL;
    for (size_t b = 0; b < batch; b++) {
        for (size_t j = 0; j < K; j++) {
            size_t i = b * K + j;
            int32_t r = m->routes[i];
            int live = r >= 0 && m->rans[r];
            m->broutes[i] = live ? r : -1;
            float wv = live ? m->w[i] : 0.0f;
            for (size_t q = 0; q < d; q++)
                m->gy[i * d + q] = wv * m->gmix[b * d + q];
        }
    }
    memset(m->bans, 0, m->n_list);
    int result = ex->backward_routed(ex->ud, m->rlist, m->n_list, m->broutes, K, m->h, m->gy,
                                     batch, d, c->switch_layer, m->ghe, m->bans);
    if (result < 0)
        return result;
    for (size_t i = 0; i < batch * K; i++) {
        int32_t r = m->broutes[i];
        if (r >= 0 && m->bans[r] && !all_finite(m->ghe + i * d, d))
            m->bans[r] = 0;
    }
    for (size_t n = 0; n < m->n_list; n++)
        *n_bans_out += m->rans[n] && m->bans[n];
    for (size_t i = 0; i < batch * K; i++) {
        int32_t r = m->broutes[i];
        if (r >= 0 && m->bans[r])
            cblas_saxpy((int)d, 1.0f, m->ghe + i * d, 1, m->gh + (i / K) * d, 1);
    }
    return 0;
}

/* FNV-1a over the routes and the answers, so callers can tell whether two passes routed alike. */
static uint64_t route_signature(const hm_model *m, size_t batch)
{
    uint64_t hsh = 0xcbf29ce484222325ull;
    const uint8_t *p;
    size_t n;
    for (int part = 0; part < 4; part++) {
        if (part == 0) {
            p = per_sample(m) ? (const uint8_t *)m->routes : (const uint8_t *)m->chosen;
            n = per_sample(m) ? batch * slots_of(m) * sizeof(int32_t) : m->k * sizeof(size_t);
        } else if (part == 1) {
            p = per_sample(m) ? m->rans : m->answered;
            n = per_sample(m) ? m->n_list : m->k;
        } else if (part == 2) {
            p = (const uint8_t *)m->rlist;
            n = per_sample(m) ? m->n_list * sizeof(size_t) : 0;
        } else {
            break;
        }
        for (size_t i = 0; i < n; i++)
            hsh = (hsh ^ p[i]) * 0x100000001b3ull;
    }
    return hsh;
}

/*
 * The forward pass into the scratch buffers; loss and correct count when
 * labels are given. Leaves softmax(z) in m->z for the backward pass.
 */
static int forward(hm_model *m, const hm_model_experts *ex, const float *x,
                   const uint8_t *labels, size_t batch, uint8_t *pred_out, hm_model_result *res,
                   int train)
{
    const hm_model_config *c = &m->cfg;
    size_t d = c->dim, S = m->n_scores, C = c->n_classes, G0 = c->grid[0], G1 = c->grid[1];
    if (ex == NULL || (per_sample(m) ? ex->forward_routed == NULL : ex->forward == NULL) ||
        x == NULL || batch < 1 || batch > c->max_batch)
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
    /* The Switch layer's jitter: the gate sees h times noise in training. */
    const float *gin = m->h;
    m->jittered = train && c->switch_layer && c->jitter_eps > 0;
    if (m->jittered) {
        for (size_t i = 0; i < batch * d; i++) {
            double u = (double)(rng_next(&m->noise_rng) >> 11) * 0x1p-53;
            m->noise[i] = (float)(1.0 + (2.0 * u - 1.0) * c->jitter_eps);
            m->hg[i] = m->h[i] * m->noise[i];
        }
        gin = m->hg;
    }
    linear(gin, m->params + m->o_wgate, m->params + m->o_bgate, batch, d, S, m->s);
    if (!all_finite(m->s, batch * S))
        return -EDOM;
    size_t k = 0;
    int result;
    if (per_sample(m)) {
        result = forward_sample(m, ex, batch);
        if (result < 0)
            return result;
        goto output;
    }
    choose_experts(m, batch);

    k = m->k;
    memset(m->answered, 0, sizeof(m->answered));
    result = ex->forward(ex->ud, m->chosen, k, m->h, batch, d, m->ys, m->answered);
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

output:
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
        res->route_sig = route_signature(m, batch);
        if (per_sample(m)) {
            res->n_routed = m->n_list;
            res->k = m->n_list < HM_MODEL_MAX_K ? m->n_list : HM_MODEL_MAX_K;
            memcpy(res->chosen, m->rlist, res->k * sizeof(size_t));
            memcpy(res->answered, m->rans, res->k);
            for (size_t n = 0; n < m->n_list; n++)
                res->n_answered += m->rans[n] != 0;
            res->balancing_loss = m->bal;
            return 0;
        }
        res->k = k;
        res->n_routed = k;
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
    return forward(m, ex, x, labels, batch, pred_out, res, 0);
}

int hm_model_backward(hm_model *m, const hm_model_experts *ex, const float *x,
                      const uint8_t *labels, size_t batch, float *grad_x, hm_model_result *res)
{
    if (m == NULL || labels == NULL || ex == NULL ||
        (per_sample(m) ? ex->backward_routed == NULL : ex->backward == NULL))
        return -EINVAL;
    hm_model_result r;
    int result = forward(m, ex, x, labels, batch, NULL, &r, 1);
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
    if (per_sample(m))
        sample_gs(m, batch);
    for (size_t b = 0; !per_sample(m) && b < batch; b++) {
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
                (int)S, m->jittered ? m->hg : m->h, (int)d, 0.0f, g + m->o_wgate, (int)d);
    for (size_t j = 0; j < S; j++) {
        float sum = 0;
        for (size_t b = 0; b < batch; b++)
            sum += m->gs[b * S + j];
        g[m->o_bgate + j] = sum;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)batch, (int)d, (int)S, 1.0f,
                m->gs, (int)S, m->params + m->o_wgate, (int)d, 0.0f, m->gh, (int)d);
    if (m->jittered)
        for (size_t i = 0; i < batch * d; i++)
            m->gh[i] *= m->noise[i];
    if (per_sample(m)) {
        result = sample_experts_backward(m, ex, batch, &r.n_answered_backward);
        if (result < 0)
            return result;
        goto input_layer;
    }

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
    r.n_answered_backward = n_bans;

input_layer:
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

/*
 * Routed calls: each expert runs once on the rows routed to it, gathered
 * into one batch as a server gets them (a sample routes to an expert at
 * most once, so at most batch rows). The gather buffers are allocated per
 * call: this path serves tests and train_local, not a tight server loop.
 */
static int local_routed(hm_model_local_experts *le, const size_t *experts, size_t n,
                        const int32_t *routes, size_t slots, const float *h, const float *gy,
                        size_t batch, size_t dim, float *out, uint8_t *answered)
{
    float *in = malloc(batch * dim * sizeof(float));
    float *g = gy != NULL ? malloc(batch * dim * sizeof(float)) : NULL;
    float *res = malloc(batch * dim * sizeof(float));
    size_t *rows = malloc(batch * sizeof(size_t));
    int result = -ENOMEM;
    if (in == NULL || res == NULL || rows == NULL || (gy != NULL && g == NULL))
        goto out;
    for (size_t x = 0; x < n; x++) {
        size_t e = experts[x], cnt = 0;
        if (e >= le->n || le->experts[e] == NULL || (le->dead != NULL && le->dead[e]))
            continue;
        if (hm_ffn_dim(le->experts[e]) != dim) {
            result = -EINVAL;
            goto out;
        }
        for (size_t i = 0; i < batch * slots && cnt < batch; i++) {
            if (routes[i] != (int32_t)x)
                continue;
            rows[cnt] = i;
            memcpy(in + cnt * dim, h + (i / slots) * dim, dim * sizeof(float));
            if (g != NULL)
                memcpy(g + cnt * dim, gy + i * dim, dim * sizeof(float));
            cnt++;
        }
        if (cnt == 0)
            continue;
        int r = g == NULL ? hm_ffn_forward(le->experts[e], in, cnt, res)
                : le->step ? hm_ffn_backward(le->experts[e], in, g, cnt, res)
                           : hm_ffn_grad(le->experts[e], in, g, cnt, res, NULL);
        if (r != 0)
            continue;
        answered[x] = 1;
        for (size_t q = 0; q < cnt; q++)
            memcpy(out + rows[q] * dim, res + q * dim, dim * sizeof(float));
    }
    result = 0;
out:
    free(in);
    free(g);
    free(res);
    free(rows);
    return result;
}

static int local_forward_routed(void *ud, const size_t *experts, size_t n,
                                const int32_t *routes, size_t slots, const float *h,
                                size_t batch, size_t dim, int allow_zero, float *y_out,
                                uint8_t *answered)
{
    (void)allow_zero;
    return local_routed(ud, experts, n, routes, slots, h, NULL, batch, dim, y_out, answered);
}

static int local_backward_routed(void *ud, const size_t *experts, size_t n,
                                 const int32_t *routes, size_t slots, const float *h,
                                 const float *gy, size_t batch, size_t dim, int allow_zero,
                                 float *gh_out, uint8_t *answered)
{
    (void)allow_zero;
    return local_routed(ud, experts, n, routes, slots, h, gy, batch, dim, gh_out, answered);
}

void hm_model_local_experts_bind(hm_model_local_experts *le, hm_model_experts *out)
{
    out->ud = le;
    out->forward = local_forward;
    out->backward = local_backward;
    out->forward_routed = local_forward_routed;
    out->backward_routed = local_backward_routed;
}

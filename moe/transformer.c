/*
 * transformer: the pre-LN transformer expert (see transformer.h). The FFN
 * half is an hm_ffn, so its math, gradients, optimizer and state are the
 * ffn expert's own; this file adds the attention half: LayerNorm, the QKV
 * projection, softmax attention per sample and head, the output projection
 * and the residual, forward and backward, every matrix product through
 * cblas_sgemm. The attention's parameters and moments are stepped with the
 * ffn's optimizer (hm_ffn_opt_check / hm_ffn_opt_step), checked before
 * either half is written, so that one step moves both or neither. Each call
 * allocates its own scratch; the expert owns only its config, the two
 * parameter vectors and their moments.
 */
#include "config.h"

#include "moe/transformer.h"
#include "src/base/util.h"
#include "src/base/wire.h"

#include <cblas.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "moe/transformer.c stores float32 vectors as host bytes and needs a little-endian host"
#endif

#define LN_EPS 1e-5
#define STATE_VERSION 1
#define STATE_TYPE "transformer"
#define STATE_HEADER_MAX 1024

struct hm_xf {
    hm_xf_config cfg; /* defaults filled in; cfg.ffn is the ffn's resolved config */
    hm_ffn *ffn;
    size_t nattn;
    float *attn;
    float *m1, *m2; /* the attention's moments, NULL when the optimizer keeps none */
};

/* Offsets inside the attention's vector. */
struct alayout {
    size_t g, b, wqkv, bqkv, wo, bo;
};

static struct alayout alayout_of(size_t d)
{
    struct alayout l;
    l.g = 0;
    l.b = d;
    l.wqkv = 2 * d;
    l.bqkv = l.wqkv + 3 * d * d;
    l.wo = l.bqkv + 3 * d;
    l.bo = l.wo + d * d;
    return l;
}

static size_t nattn_of(size_t d) { return 4 * d * d + 6 * d; }

static int finite_all(const float *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(v[i]))
            return 0;
    return 1;
}

/* Fills in heads and max_seq and checks them against the dim. 0 or -EINVAL. */
static int config_resolve(const hm_xf_config *in, size_t dim, hm_xf_config *out)
{
    hm_xf_config c = *in;

    if (c.heads == 0) {
        static const size_t pick[] = {8, 4, 2, 1};
        for (size_t i = 0; i < HM_ARRAY_LEN(pick) && c.heads == 0; i++)
            if (dim % pick[i] == 0)
                c.heads = pick[i];
    }
    if (c.heads < 1 || c.heads > HM_XF_MAX_HEADS || dim % c.heads != 0)
        return -EINVAL;
    if (c.max_seq == 0)
        c.max_seq = HM_XF_DEFAULT_MAX_SEQ;
    if (c.max_seq > HM_XF_MAX_SEQ)
        return -EINVAL;
    *out = c;
    return 0;
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rng_uniform(uint64_t *s, double bound)
{
    double u = (double)(rng_next(s) >> 11) * 0x1p-53;
    return (float)((2 * u - 1) * bound);
}

/* The attention's vectors for t (whose cfg and ffn are set): uninitialised, moments zero. */
static int attn_alloc(hm_xf *t)
{
    int nmom = hm_ffn_moments(&t->cfg.ffn);
    t->nattn = nattn_of(t->cfg.ffn.dim);
    t->attn = malloc(t->nattn * sizeof(float));
    if (nmom >= 1)
        t->m1 = calloc(t->nattn, sizeof(float));
    if (nmom >= 2)
        t->m2 = calloc(t->nattn, sizeof(float));
    if (t->attn == NULL || (nmom >= 1 && t->m1 == NULL) || (nmom >= 2 && t->m2 == NULL))
        return -ENOMEM;
    return 0;
}

int hm_xf_new(const hm_xf_config *cfg, hm_xf **out)
{
    hm_xf *t = NULL;
    int result;

    if (out == NULL)
        return -EINVAL;
    *out = NULL;
    if (cfg == NULL)
        return -EINVAL;
    if ((t = calloc(1, sizeof(*t))) == NULL)
        return -ENOMEM;
    if ((result = hm_ffn_new(&cfg->ffn, &t->ffn)) < 0)
        goto out;
    if ((result = config_resolve(cfg, hm_ffn_dim(t->ffn), &t->cfg)) < 0)
        goto out;
    t->cfg.ffn = *hm_ffn_config_of(t->ffn);
    if ((result = attn_alloc(t)) < 0)
        goto out;
    {
        const size_t d = t->cfg.ffn.dim;
        const struct alayout l = alayout_of(d);
        /* A stream of its own, so that the FFN's weights are those of an ffn of the same seed. */
        uint64_t s = t->cfg.ffn.seed ^ 0x7472616e73666d72ull;
        const double bound = 1.0 / sqrt((double)d);
        for (size_t i = 0; i < d; i++) {
            t->attn[l.g + i] = 1.0f;
            t->attn[l.b + i] = 0.0f;
            t->attn[l.bo + i] = 0.0f;
        }
        for (size_t i = 0; i < 3 * d; i++)
            t->attn[l.bqkv + i] = 0.0f;
        for (size_t i = 0; i < 3 * d * d; i++)
            t->attn[l.wqkv + i] = rng_uniform(&s, bound);
        for (size_t i = 0; i < d * d; i++)
            t->attn[l.wo + i] = rng_uniform(&s, bound);
    }
    *out = t;
    t = NULL;
    result = 0;
out:
    hm_xf_free(t);
    return result;
}

void hm_xf_free(hm_xf *t)
{
    if (t == NULL)
        return;
    hm_ffn_free(t->ffn);
    free(t->attn);
    free(t->m1);
    free(t->m2);
    free(t);
}

const hm_xf_config *hm_xf_config_of(const hm_xf *t) { return &t->cfg; }
size_t hm_xf_dim(const hm_xf *t) { return t->cfg.ffn.dim; }
size_t hm_xf_nparams(const hm_xf *t) { return t->nattn + hm_ffn_nparams(t->ffn); }
uint64_t hm_xf_steps(const hm_xf *t) { return hm_ffn_steps(t->ffn); }

float *hm_xf_param(hm_xf *t, size_t i)
{
    if (t == NULL)
        return NULL;
    if (i < t->nattn)
        return &t->attn[i];
    i -= t->nattn;
    return i < hm_ffn_nparams(t->ffn) ? &hm_ffn_params(t->ffn)[i] : NULL;
}

/* ---- forward and backward ---- */

/*
 * Per-call scratch for n = batch * seq tokens: a = LN1(x) [n, dim] with each
 * row's mean and 1/std, qkv [n, 3 dim], o = the heads' outputs [n, dim],
 * h = x + attention [n, dim], and one seq x seq matrix per role (p the
 * attention weights, dp their gradient).
 */
struct scratch {
    float *a, *qkv, *o, *h, *p, *dp;
    float *mu, *rstd;
};

static void scratch_free(struct scratch *s)
{
    free(s->a);
    free(s->qkv);
    free(s->o);
    free(s->h);
    free(s->p);
    free(s->dp);
    free(s->mu);
    free(s->rstd);
    memset(s, 0, sizeof(*s));
}

/*
 * Checks a call's shape and allocates its scratch. BLAS takes int sizes,
 * so the token count must fit an int; dim and seq are bounded by the config.
 */
static int scratch_alloc(const hm_xf *t, size_t batch, size_t seq, int backward,
                         struct scratch *s)
{
    const size_t d = t->cfg.ffn.dim;
    size_t n;

    memset(s, 0, sizeof(*s));
    if (batch == 0 || seq == 0 || seq > t->cfg.max_seq || batch > INT_MAX / seq)
        return -EINVAL;
    n = batch * seq;
    if (n > SIZE_MAX / (3 * d * sizeof(float)))
        return -ENOMEM;
    s->a = malloc(n * d * sizeof(float));
    s->qkv = malloc(n * 3 * d * sizeof(float));
    s->o = malloc(n * d * sizeof(float));
    s->h = malloc(n * d * sizeof(float));
    s->p = malloc(seq * seq * sizeof(float));
    s->dp = backward ? malloc(seq * seq * sizeof(float)) : NULL;
    s->mu = malloc(n * sizeof(float));
    s->rstd = malloc(n * sizeof(float));
    if (s->a == NULL || s->qkv == NULL || s->o == NULL || s->h == NULL || s->p == NULL ||
        (backward && s->dp == NULL) || s->mu == NULL || s->rstd == NULL) {
        scratch_free(s);
        return -ENOMEM;
    }
    return 0;
}

/*
 * The attention weights of sample b, head hd into s->p [seq, seq]: the
 * scaled scores, then a softmax per row (max subtracted; the sum in double).
 */
static void attn_weights(const hm_xf *t, struct scratch *s, const uint8_t *mask, size_t b,
                         size_t hd, size_t seq)
{
    const uint8_t *keep = mask != NULL ? mask + b * seq : NULL;
    const size_t d = t->cfg.ffn.dim, dh = d / t->cfg.heads, ld = 3 * d;
    const float *q = s->qkv + b * seq * ld + hd * dh, *k = q + d;
    const float scale = (float)(1.0 / sqrt((double)dh));

    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)seq, (int)seq, (int)dh, scale, q,
                (int)ld, k, (int)ld, 0.0f, s->p, (int)seq);
    /* A masked key gets weight exactly 0 and takes no part in the row's max:
     * with an all-ones mask the weights are bit for bit those without one. */
    for (size_t i = 0; i < seq; i++) {
        float *row = s->p + i * seq, mx = -INFINITY;
        double sum = 0;
        for (size_t j = 0; j < seq; j++)
            if (keep == NULL || keep[j])
                mx = row[j] > mx ? row[j] : mx;
        for (size_t j = 0; j < seq; j++) {
            row[j] = keep == NULL || keep[j] ? expf(row[j] - mx) : 0.0f;
            sum += row[j];
        }
        const float inv = (float)(1.0 / sum);
        for (size_t j = 0; j < seq; j++)
            row[j] *= inv;
    }
}

/* The attention half's forward: a, qkv, o and h = x + MHA(LN1(x)) into s. */
static void attn_forward(const hm_xf *t, const float *x, const uint8_t *mask, size_t batch,
                         size_t seq, struct scratch *s)
{
    const size_t d = t->cfg.ffn.dim, n = batch * seq, dh = d / t->cfg.heads, ld = 3 * d;
    const struct alayout l = alayout_of(d);
    const float *p = t->attn;

    /* LN1, with the row statistics in double as the ffn's. */
    for (size_t r = 0; r < n; r++) {
        const float *xr = x + r * d;
        float *ar = s->a + r * d;
        double sum = 0, var = 0, mu;
        for (size_t j = 0; j < d; j++)
            sum += xr[j];
        mu = sum / (double)d;
        for (size_t j = 0; j < d; j++) {
            double c = xr[j] - mu;
            var += c * c;
        }
        const float rstd = (float)(1.0 / sqrt(var / (double)d + LN_EPS)), muf = (float)mu;
        s->mu[r] = muf;
        s->rstd[r] = rstd;
        for (size_t j = 0; j < d; j++)
            ar[j] = (xr[j] - muf) * rstd * p[l.g + j] + p[l.b + j];
    }
    /* qkv = a · Wqkv^T + bqkv */
    for (size_t r = 0; r < n; r++)
        memcpy(s->qkv + r * ld, p + l.bqkv, ld * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)ld, (int)d, 1.0f, s->a,
                (int)d, p + l.wqkv, (int)d, 1.0f, s->qkv, (int)ld);
    /* o[b, :, head] = softmax(Q K^T / sqrt(dh)) V, per sample and head. */
    for (size_t b = 0; b < batch; b++) {
        for (size_t hd = 0; hd < t->cfg.heads; hd++) {
            const float *v = s->qkv + b * seq * ld + 2 * d + hd * dh;
            attn_weights(t, s, mask, b, hd, seq);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)seq, (int)dh, (int)seq,
                        1.0f, s->p, (int)seq, v, (int)ld, 0.0f, s->o + b * seq * d + hd * dh,
                        (int)d);
        }
    }
    /* h = x + bo + o · Wo^T */
    for (size_t r = 0; r < n; r++)
        for (size_t j = 0; j < d; j++)
            s->h[r * d + j] = x[r * d + j] + p[l.bo + j];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)d, (int)d, 1.0f, s->o,
                (int)d, p + l.wo, (int)d, 1.0f, s->h, (int)d);
}

/* A mask is 0/1 bytes and keeps at least one key of every sample, so that
 * every softmax has something to weigh. */
static int mask_check(const uint8_t *mask, size_t batch, size_t seq)
{
    if (mask == NULL)
        return 0;
    for (size_t b = 0; b < batch; b++) {
        size_t kept = 0;
        for (size_t j = 0; j < seq; j++) {
            if (mask[b * seq + j] > 1)
                return -EINVAL;
            kept += mask[b * seq + j];
        }
        if (kept == 0)
            return -EINVAL;
    }
    return 0;
}

int hm_xf_forward(const hm_xf *t, const float *x, size_t batch, size_t seq, float *y)
{
    return hm_xf_forward_mask(t, x, NULL, batch, seq, y);
}

int hm_xf_forward_mask(const hm_xf *t, const float *x, const uint8_t *mask, size_t batch,
                       size_t seq, float *y)
{
    struct scratch s;
    int result;

    if (t == NULL || x == NULL || y == NULL)
        return -EINVAL;
    if ((result = scratch_alloc(t, batch, seq, 0, &s)) < 0)
        return result;
    if ((result = mask_check(mask, batch, seq)) < 0)
        goto out;
    if (!finite_all(x, batch * seq * t->cfg.ffn.dim)) {
        result = -EDOM;
        goto out;
    }
    attn_forward(t, x, mask, batch, seq, &s);
    result = hm_ffn_forward(t->ffn, s.h, batch * seq, y);
out:
    scratch_free(&s);
    return result;
}

static void sum_rows(const float *m, size_t rows, size_t cols, size_t ld, float *out)
{
    memset(out, 0, cols * sizeof(float));
    for (size_t r = 0; r < rows; r++)
        for (size_t j = 0; j < cols; j++)
            out[j] += m[r * ld + j];
}

int hm_xf_grad(const hm_xf *t, const float *x, const float *grad_y, size_t batch, size_t seq,
               float *grad_x, float *grad_params)
{
    return hm_xf_grad_mask(t, x, NULL, grad_y, batch, seq, grad_x, grad_params);
}

int hm_xf_grad_mask(const hm_xf *t, const float *x, const uint8_t *mask, const float *grad_y,
                    size_t batch, size_t seq, float *grad_x, float *grad_params)
{
    struct scratch s;
    float *gh = NULL, *dqkv = NULL, *gp = grad_params;
    int result;

    if (t == NULL || x == NULL || grad_y == NULL || grad_x == NULL)
        return -EINVAL;
    if ((result = scratch_alloc(t, batch, seq, 1, &s)) < 0)
        return result;
    const size_t d = t->cfg.ffn.dim, n = batch * seq, dh = d / t->cfg.heads, ld = 3 * d;
    const struct alayout l = alayout_of(d);
    const float *p = t->attn;
    const float scale = (float)(1.0 / sqrt((double)dh));
    if ((result = mask_check(mask, batch, seq)) < 0)
        goto out;
    if (!finite_all(x, n * d) || !finite_all(grad_y, n * d)) {
        result = -EDOM;
        goto out;
    }
    gh = malloc(n * d * sizeof(float));
    dqkv = malloc(n * ld * sizeof(float));
    if (gh == NULL || dqkv == NULL) {
        result = -ENOMEM;
        goto out;
    }
    attn_forward(t, x, mask, batch, seq, &s);
    /* The FFN half: dL/dh, and its own parameters' gradient after the attention's. */
    if ((result = hm_ffn_grad(t->ffn, s.h, grad_y, n, gh, gp != NULL ? gp + t->nattn : NULL)) < 0)
        goto out;
    if (gp != NULL) {
        /* dWo = gh^T · o; dbo = sum of gh. */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)d, (int)d, (int)n, 1.0f, gh,
                    (int)d, s.o, (int)d, 0.0f, gp + l.wo, (int)d);
        sum_rows(gh, n, d, d, gp + l.bo);
    }
    /* do = gh · Wo, into o, whose last reader was dWo. */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)d, (int)d, 1.0f, gh,
                (int)d, p + l.wo, (int)d, 0.0f, s.o, (int)d);
    /*
     * Per sample and head, with P recomputed: dV = P^T dO; dP = dO V^T;
     * dS = P * (dP - rowsum(dP * P)); dQ = scale dS K; dK = scale dS^T Q.
     */
    for (size_t b = 0; b < batch; b++) {
        for (size_t hd = 0; hd < t->cfg.heads; hd++) {
            const size_t off = b * seq * ld + hd * dh;
            const float *q = s.qkv + off, *k = q + d, *v = q + 2 * d;
            const float *dout = s.o + b * seq * d + hd * dh;
            attn_weights(t, &s, mask, b, hd, seq);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)seq, (int)dh, (int)seq,
                        1.0f, s.p, (int)seq, dout, (int)d, 0.0f, dqkv + off + 2 * d, (int)ld);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)seq, (int)seq, (int)dh,
                        1.0f, dout, (int)d, v, (int)ld, 0.0f, s.dp, (int)seq);
            for (size_t i = 0; i < seq; i++) {
                const float *pr = s.p + i * seq;
                float *dr = s.dp + i * seq;
                double c = 0;
                for (size_t j = 0; j < seq; j++)
                    c += (double)dr[j] * pr[j];
                for (size_t j = 0; j < seq; j++)
                    dr[j] = pr[j] * (dr[j] - (float)c);
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)seq, (int)dh, (int)seq,
                        scale, s.dp, (int)seq, k, (int)ld, 0.0f, dqkv + off, (int)ld);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)seq, (int)dh, (int)seq,
                        scale, s.dp, (int)seq, q, (int)ld, 0.0f, dqkv + off + d, (int)ld);
        }
    }
    if (gp != NULL) {
        /* dWqkv = dqkv^T · a; dbqkv = sum of dqkv. */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)ld, (int)d, (int)n, 1.0f, dqkv,
                    (int)ld, s.a, (int)d, 0.0f, gp + l.wqkv, (int)d);
        sum_rows(dqkv, n, ld, ld, gp + l.bqkv);
        memset(gp + l.g, 0, 2 * d * sizeof(float));
    }
    /* da = dqkv · Wqkv, into a, whose last reader was dWqkv. */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)d, (int)ld, 1.0f, dqkv,
                (int)ld, p + l.wqkv, (int)d, 0.0f, s.a, (int)d);
    /* LN1 backward per row (as the ffn's), plus the residual's gh. */
    for (size_t r = 0; r < n; r++) {
        const float *xr = x + r * d, *dar = s.a + r * d, *ghr = gh + r * d;
        float *gxr = grad_x + r * d;
        const float mu = s.mu[r], rstd = s.rstd[r];
        double sum_dxh = 0, sum_dxh_xh = 0;
        for (size_t j = 0; j < d; j++) {
            float xh = (xr[j] - mu) * rstd, dxh = dar[j] * p[l.g + j];
            sum_dxh += dxh;
            sum_dxh_xh += (double)dxh * xh;
            if (gp != NULL) {
                gp[l.g + j] += dar[j] * xh;
                gp[l.b + j] += dar[j];
            }
        }
        const float mean_dxh = (float)(sum_dxh / (double)d);
        const float mean_dxh_xh = (float)(sum_dxh_xh / (double)d);
        for (size_t j = 0; j < d; j++) {
            float xh = (xr[j] - mu) * rstd, dxh = dar[j] * p[l.g + j];
            gxr[j] = ghr[j] + rstd * (dxh - mean_dxh - xh * mean_dxh_xh);
        }
    }
    result = 0;
out:
    free(gh);
    free(dqkv);
    scratch_free(&s);
    return result;
}

int hm_xf_apply(hm_xf *t, const float *grad_params)
{
    int r;

    if (t == NULL || grad_params == NULL)
        return -EINVAL;
    const uint64_t steps = hm_ffn_steps(t->ffn);
    /* The attention's step is checked first and the ffn's step checks itself
     * before writing: a refused step leaves both halves as they were. */
    r = hm_ffn_opt_check(&t->cfg.ffn, steps, t->attn, t->m1, t->m2, grad_params, t->nattn);
    if (r < 0)
        return r;
    if ((r = hm_ffn_apply(t->ffn, grad_params + t->nattn)) < 0)
        return r;
    hm_ffn_opt_step(&t->cfg.ffn, steps, t->attn, t->m1, t->m2, grad_params, t->nattn);
    return 0;
}

int hm_xf_backward(hm_xf *t, const float *x, const float *grad_y, size_t batch, size_t seq,
                   float *grad_x)
{
    return hm_xf_backward_mask(t, x, NULL, grad_y, batch, seq, grad_x);
}

int hm_xf_backward_mask(hm_xf *t, const float *x, const uint8_t *mask, const float *grad_y,
                        size_t batch, size_t seq, float *grad_x)
{
    float *gp;
    int result;

    if (t == NULL)
        return -EINVAL;
    if ((gp = malloc(hm_xf_nparams(t) * sizeof(float))) == NULL)
        return -ENOMEM;
    result = hm_xf_grad_mask(t, x, mask, grad_y, batch, seq, grad_x, gp);
    if (result == 0)
        result = hm_xf_apply(t, gp);
    free(gp);
    return result;
}

/* ---- serialized state ---- */

int hm_xf_save(const hm_xf *t, uint8_t **buf_out, size_t *len_out)
{
    uint8_t *fbuf = NULL, *buf = NULL;
    size_t flen = 0, cap;
    hm_wire_wr w;
    int result;

    if (t == NULL || buf_out == NULL || len_out == NULL)
        return -EINVAL;
    *buf_out = NULL;
    *len_out = 0;
    if ((result = hm_ffn_save(t->ffn, &fbuf, &flen)) < 0)
        return result;
    cap = flen + 3 * t->nattn * sizeof(float) + STATE_HEADER_MAX;
    if ((buf = malloc(cap)) == NULL) {
        result = -ENOMEM;
        goto out;
    }
    hm_wire_wr_init_fixed(&w, buf, cap);
    hm_wire_wr_map(&w, 8);
    hm_wire_wr_cstr(&w, "version");
    hm_wire_wr_uint(&w, STATE_VERSION);
    hm_wire_wr_cstr(&w, "type");
    hm_wire_wr_cstr(&w, STATE_TYPE);
    hm_wire_wr_cstr(&w, "heads");
    hm_wire_wr_uint(&w, t->cfg.heads);
    hm_wire_wr_cstr(&w, "max_seq");
    hm_wire_wr_uint(&w, t->cfg.max_seq);
    hm_wire_wr_cstr(&w, "attn");
    hm_wire_wr_bin(&w, t->attn, t->nattn * sizeof(float));
    hm_wire_wr_cstr(&w, "attn_m1");
    hm_wire_wr_bin(&w, t->m1, t->m1 != NULL ? t->nattn * sizeof(float) : 0);
    hm_wire_wr_cstr(&w, "attn_m2");
    hm_wire_wr_bin(&w, t->m2, t->m2 != NULL ? t->nattn * sizeof(float) : 0);
    hm_wire_wr_cstr(&w, "ffn");
    hm_wire_wr_bin(&w, fbuf, flen);
    if ((result = hm_wire_wr_error(&w)) < 0)
        goto out;
    *buf_out = buf;
    *len_out = w.len;
    buf = NULL;
    result = 0;
out:
    free(fbuf);
    free(buf);
    return result;
}

/* The largest state of any config: the ffn's largest and the attention's at the largest dim. */
static size_t state_max_bytes(void)
{
    const size_t d = HM_FFN_MAX_DIM, h = HM_FFN_MAX_HIDDEN;
    return (3 * d + 2 * d * h + h + nattn_of(d)) * 12 + 2 * STATE_HEADER_MAX;
}

static hm_wire_limits state_limits(void)
{
    const hm_wire_limits lim = {.max_size = state_max_bytes(), .max_depth = 1, .max_elements = 32};
    return lim;
}

/* Whether the open map's "type" is ours. */
static int type_is_ours(const msgpack_object *root)
{
    const msgpack_object *o = hm_wire_map_get(root, "type");
    const char *p;
    uint32_t n;
    return o != NULL && hm_wire_get_str(o, &p, &n) == 0 && n == strlen(STATE_TYPE) &&
           memcmp(p, STATE_TYPE, n) == 0;
}

int hm_xf_is_state(const uint8_t *buf, size_t len)
{
    const hm_wire_limits lim = state_limits();
    hm_wire_msg m;
    int r;

    if (buf == NULL || len > lim.max_size)
        return 0;
    if (hm_wire_decode_open_map(&m, buf, len, &lim, NULL, 0) < 0) {
        hm_wire_decode_close(&m);
        return 0;
    }
    r = type_is_ours(&m.root);
    hm_wire_decode_close(&m);
    return r;
}

/* A vector of exactly n floats (n may be 0) from the bin under key, finite
 * (and non-negative when nonneg), copied into dst when dst is not NULL. */
static int get_vector(const msgpack_object *map, const char *key, size_t n, int nonneg,
                      float *dst)
{
    const msgpack_object *o = hm_wire_map_get(map, key);
    const uint8_t *p;
    uint32_t len;

    if (o == NULL || hm_wire_get_bin(o, &p, &len) < 0 || (uint64_t)len != (uint64_t)n * 4)
        return -EBADMSG;
    if (dst == NULL)
        return 0;
    memcpy(dst, p, n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        if (!isfinite(dst[i]) || (nonneg && dst[i] < 0))
            return -EBADMSG;
    return 0;
}

int hm_xf_load(const uint8_t *buf, size_t len, const hm_xf_config *expect, hm_xf **out)
{
    const hm_wire_limits lim = state_limits();
    hm_wire_msg m;
    const msgpack_object *root, *o;
    const uint8_t *fp;
    uint32_t flen;
    uint64_t heads, max_seq;
    hm_xf_config want, have;
    hm_xf *t = NULL;
    int result;

    if (out == NULL)
        return -EINVAL;
    *out = NULL;
    if (buf == NULL)
        return -EINVAL;
    if (len > lim.max_size)
        return -EMSGSIZE;
    if ((result = hm_wire_decode_open_map(&m, buf, len, &lim, "version", STATE_VERSION)) < 0) {
        if (result != -ENOMEM)
            result = -EBADMSG;
        goto out;
    }
    root = &m.root;
    result = -EBADMSG;
    if (!type_is_ours(root) || (o = hm_wire_map_get(root, "heads")) == NULL ||
        hm_wire_get_uint(o, &heads) < 0 || (o = hm_wire_map_get(root, "max_seq")) == NULL ||
        hm_wire_get_uint(o, &max_seq) < 0 || (o = hm_wire_map_get(root, "ffn")) == NULL ||
        hm_wire_get_bin(o, &fp, &flen) < 0)
        goto out;
    if (heads < 1 || heads > HM_XF_MAX_HEADS || max_seq < 1 || max_seq > HM_XF_MAX_SEQ)
        goto out;
    if ((t = calloc(1, sizeof(*t))) == NULL) {
        result = -ENOMEM;
        goto out;
    }
    /* The ffn half checks its own state, and its shape against expect's. */
    if ((result = hm_ffn_load(fp, flen, expect != NULL ? &expect->ffn : NULL, &t->ffn)) < 0)
        goto out;
    result = -EBADMSG;
    memset(&have, 0, sizeof(have));
    have.heads = (size_t)heads;
    have.max_seq = (size_t)max_seq;
    if (config_resolve(&have, hm_ffn_dim(t->ffn), &have) < 0)
        goto out;
    if (expect != NULL) {
        if (config_resolve(expect, hm_ffn_dim(t->ffn), &want) < 0) {
            result = -EINVAL;
            goto out;
        }
        if (want.heads != have.heads) {
            result = -EPROTO;
            goto out;
        }
        have.max_seq = want.max_seq;
    }
    t->cfg = have;
    t->cfg.ffn = *hm_ffn_config_of(t->ffn);
    /* Lengths are checked before the attention is allocated, so len bounds it. */
    const size_t na = nattn_of(t->cfg.ffn.dim);
    const int nmom = hm_ffn_moments(&t->cfg.ffn);
    if (get_vector(root, "attn", na, 0, NULL) < 0 ||
        get_vector(root, "attn_m1", nmom >= 1 ? na : 0, 0, NULL) < 0 ||
        get_vector(root, "attn_m2", nmom >= 2 ? na : 0, 1, NULL) < 0)
        goto out;
    if ((result = attn_alloc(t)) < 0)
        goto out;
    result = -EBADMSG;
    if (get_vector(root, "attn", na, 0, t->attn) < 0 ||
        (t->m1 != NULL && get_vector(root, "attn_m1", na, 0, t->m1) < 0) ||
        (t->m2 != NULL && get_vector(root, "attn_m2", na, 1, t->m2) < 0))
        goto out;
    *out = t;
    t = NULL;
    result = 0;
out:
    hm_xf_free(t);
    hm_wire_decode_close(&m);
    return result;
}

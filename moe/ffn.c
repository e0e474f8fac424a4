/*
 * ffn: the feed-forward expert (LayerNorm, two linear layers, tanh GELU and
 * a residual connection), its gradients, its optimizers (SGD with momentum,
 * Adam) and its serialized state. Every matrix product goes through
 * cblas_sgemm; LayerNorm, GELU and the biases are plain loops. Each call
 * allocates its own scratch memory, sized from the batch, so that calls on
 * different experts can run on different threads with nothing shared. The
 * expert owns only its config, step count, parameters and moments.
 */
#include "config.h"

#include "moe/ffn.h"
#include "src/base/util.h"
#include "src/base/wire.h"

#include <cblas.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define LN_EPS 1e-5
/* sqrt(2 / pi), the tanh-approximation GELU's constant. */
#define GELU_K 0.7978845608028654f
#define GELU_C 0.044715f

/* The serialized state's format version. */
#define STATE_VERSION 1
/* Room for the msgpack map, its keys and scalars; the vectors come on top. */
#define STATE_HEADER_MAX 1024
/* Floats converted per chunk when writing vectors as little-endian bytes. */
#define LE_CHUNK 4096

struct hm_ffn {
    hm_ffn_config cfg; /* with defaults filled in */
    size_t nparams;
    uint64_t steps;
    float *params;
    float *m1; /* SGD momentum buffer, or Adam's first moment; NULL when unused */
    float *m2; /* Adam's second moment; NULL when unused */
};

/* Offsets of each parameter block inside the flat vector. */
struct layout {
    size_t gamma, beta, w1, b1, w2, b2;
};

static struct layout layout_of(size_t d, size_t h)
{
    struct layout l;

    l.gamma = 0;
    l.beta = d;
    l.w1 = 2 * d;
    l.b1 = l.w1 + h * d;
    l.w2 = l.b1 + h;
    l.b2 = l.w2 + d * h;
    return l;
}

/* a * b into *out; 0, or -ENOMEM when the product does not fit in size_t. */
static int mul_size(size_t a, size_t b, size_t *out)
{
    if (a != 0 && b > SIZE_MAX / a)
        return -ENOMEM;
    *out = a * b;
    return 0;
}

static int finite_all(const float *v, size_t n)
{
    size_t i;

    for (i = 0; i < n; i++) {
        if (!isfinite(v[i]))
            return 0;
    }
    return 1;
}

static int finite_pos(double v) { return isfinite(v) && v > 0; }

/* Number of moment vectors the optimizer keeps: 0, 1 (SGD momentum) or 2 (Adam). */
static int moments_of(const hm_ffn_config *c)
{
    if (c->optimizer == HM_FFN_ADAM)
        return 2;
    return c->momentum != 0 ? 1 : 0;
}

/*
 * Fills in defaults and checks every field, so that later arithmetic can
 * trust the config. Returns 0 or -EINVAL.
 */
static int config_resolve(const hm_ffn_config *in, hm_ffn_config *out)
{
    hm_ffn_config c = *in;

    if (c.dim < 1 || c.dim > HM_FFN_MAX_DIM)
        return -EINVAL;
    if (c.hidden == 0)
        c.hidden = 4 * c.dim;
    if (c.hidden > HM_FFN_MAX_HIDDEN)
        return -EINVAL;
    if (c.optimizer != HM_FFN_SGD && c.optimizer != HM_FFN_ADAM)
        return -EINVAL;
    if (c.lr == 0)
        c.lr = c.optimizer == HM_FFN_ADAM ? 1e-3 : 1e-2;
    if (!finite_pos(c.lr))
        return -EINVAL;
    if (!(c.momentum >= 0 && c.momentum < 1))
        return -EINVAL;
    if (c.beta1 == 0)
        c.beta1 = 0.9;
    if (c.beta2 == 0)
        c.beta2 = 0.999;
    if (c.eps == 0)
        c.eps = 1e-8;
    if (!(c.beta1 > 0 && c.beta1 < 1) || !(c.beta2 > 0 && c.beta2 < 1) || !finite_pos(c.eps))
        return -EINVAL;
    if (!(c.weight_decay >= 0 && isfinite(c.weight_decay)))
        return -EINVAL;
    *out = c;
    return 0;
}

/* 3*dim + 2*dim*hidden + hidden; cannot overflow for a resolved config. */
static size_t nparams_of(const hm_ffn_config *c)
{
    return 3 * c->dim + 2 * c->dim * c->hidden + c->hidden;
}

/* splitmix64: a small, well-mixed generator that reproduces from its seed. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-bound, bound). */
static float rng_uniform(uint64_t *s, double bound)
{
    double u = (double)(rng_next(s) >> 11) * 0x1p-53;

    return (float)((2 * u - 1) * bound);
}

/* Allocates an expert for a resolved config: parameters uninitialised, moments zero. */
static int ffn_alloc(const hm_ffn_config *c, hm_ffn **out)
{
    hm_ffn *f;
    size_t bytes;
    int nmom = moments_of(c);
    int result;

    *out = NULL;
    f = calloc(1, sizeof(*f));
    if (f == NULL)
        return -ENOMEM;
    f->cfg = *c;
    f->nparams = nparams_of(c);
    if ((result = mul_size(f->nparams, sizeof(float), &bytes)) < 0)
        goto out;
    result = -ENOMEM;
    if ((f->params = malloc(bytes)) == NULL)
        goto out;
    if (nmom >= 1 && (f->m1 = calloc(f->nparams, sizeof(float))) == NULL)
        goto out;
    if (nmom >= 2 && (f->m2 = calloc(f->nparams, sizeof(float))) == NULL)
        goto out;
    *out = f;
    f = NULL;
    result = 0;
out:
    hm_ffn_free(f);
    return result;
}

int hm_ffn_new(const hm_ffn_config *cfg, hm_ffn **out)
{
    hm_ffn_config c;
    hm_ffn *f = NULL;
    struct layout l;
    uint64_t s;
    size_t i, d, h;
    int result;

    if (out == NULL)
        return -EINVAL;
    *out = NULL;
    if (cfg == NULL)
        return -EINVAL;
    if ((result = config_resolve(cfg, &c)) < 0)
        return result;
    if ((result = ffn_alloc(&c, &f)) < 0)
        return result;
    d = c.dim;
    h = c.hidden;
    l = layout_of(d, h);
    s = c.seed;
    for (i = 0; i < d; i++) {
        f->params[l.gamma + i] = 1.0f;
        f->params[l.beta + i] = 0.0f;
        f->params[l.b2 + i] = 0.0f;
    }
    for (i = 0; i < h * d; i++)
        f->params[l.w1 + i] = rng_uniform(&s, 1.0 / sqrt((double)d));
    for (i = 0; i < h; i++)
        f->params[l.b1 + i] = 0.0f;
    for (i = 0; i < d * h; i++)
        f->params[l.w2 + i] = rng_uniform(&s, 1.0 / sqrt((double)h));
    *out = f;
    return 0;
}

void hm_ffn_free(hm_ffn *f)
{
    if (f == NULL)
        return;
    free(f->params);
    free(f->m1);
    free(f->m2);
    free(f);
}

const hm_ffn_config *hm_ffn_config_of(const hm_ffn *f) { return &f->cfg; }
size_t hm_ffn_dim(const hm_ffn *f) { return f->cfg.dim; }
size_t hm_ffn_nparams(const hm_ffn *f) { return f->nparams; }
float *hm_ffn_params(hm_ffn *f) { return f->params; }
uint64_t hm_ffn_steps(const hm_ffn *f) { return f->steps; }

/* ---- forward and backward ---- */

/*
 * Per-call scratch: a = LN(x) [batch, dim], h = W1·a + b1 and g = gelu(h)
 * [batch, hidden], and each row's mean and 1/std.
 */
struct scratch {
    float *a, *h, *g;
    float *mu, *rstd;
};

static void scratch_free(struct scratch *s)
{
    free(s->a);
    free(s->h);
    free(s->g);
    free(s->mu);
    free(s->rstd);
    memset(s, 0, sizeof(*s));
}

/*
 * Checks the call's arguments and allocates scratch for it (h only when
 * backward needs it). BLAS takes int sizes, so the batch must fit an int.
 */
static int scratch_alloc(const hm_ffn *f, size_t batch, int need_h, struct scratch *s)
{
    size_t bd, bh;
    int result;

    memset(s, 0, sizeof(*s));
    if (batch == 0 || batch > INT_MAX)
        return -EINVAL;
    if ((result = mul_size(batch, f->cfg.dim * sizeof(float), &bd)) < 0 ||
        (result = mul_size(batch, f->cfg.hidden * sizeof(float), &bh)) < 0)
        return result;
    s->a = malloc(bd);
    s->g = malloc(bh);
    s->h = need_h ? malloc(bh) : NULL;
    s->mu = malloc(batch * sizeof(float));
    s->rstd = malloc(batch * sizeof(float));
    if (s->a == NULL || s->g == NULL || (need_h && s->h == NULL) || s->mu == NULL ||
        s->rstd == NULL) {
        scratch_free(s);
        return -ENOMEM;
    }
    return 0;
}

static inline float gelu(float v)
{
    return 0.5f * v * (1.0f + tanhf(GELU_K * (v + GELU_C * v * v * v)));
}

static inline float gelu_grad(float v)
{
    float t = tanhf(GELU_K * (v + GELU_C * v * v * v));

    return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * GELU_K * (1.0f + 3.0f * GELU_C * v * v);
}

/*
 * The forward pass into s (a, g, and h when allocated) and y when not NULL.
 * Row statistics are accumulated in double: a row of 8192 floats summed in
 * float would lose digits the tests (and training) notice.
 */
static void forward_into(const hm_ffn *f, const float *x, size_t batch, struct scratch *s,
                         float *y)
{
    const size_t d = f->cfg.dim, hd = f->cfg.hidden;
    const struct layout l = layout_of(d, hd);
    const float *p = f->params;
    float *hbuf = s->h != NULL ? s->h : s->g;
    size_t r, j;

    for (r = 0; r < batch; r++) {
        const float *xr = x + r * d;
        float *ar = s->a + r * d;
        double sum = 0, var = 0, mu;
        float rstd, muf;

        for (j = 0; j < d; j++)
            sum += xr[j];
        mu = sum / (double)d;
        for (j = 0; j < d; j++) {
            double c = xr[j] - mu;
            var += c * c;
        }
        rstd = (float)(1.0 / sqrt(var / (double)d + LN_EPS));
        muf = (float)mu;
        s->mu[r] = muf;
        s->rstd[r] = rstd;
        for (j = 0; j < d; j++)
            ar[j] = (xr[j] - muf) * rstd * p[l.gamma + j] + p[l.beta + j];
    }
    /* h = a · W1^T + b1, with b1 broadcast into h first so that sgemm adds onto it. */
    for (r = 0; r < batch; r++)
        memcpy(hbuf + r * hd, p + l.b1, hd * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)batch, (int)hd, (int)d, 1.0f,
                s->a, (int)d, p + l.w1, (int)d, 1.0f, hbuf, (int)hd);
    if (s->h != NULL) {
        for (j = 0; j < batch * hd; j++)
            s->g[j] = gelu(s->h[j]);
    } else {
        for (j = 0; j < batch * hd; j++)
            s->g[j] = gelu(s->g[j]);
    }
    if (y == NULL)
        return;
    /* y = x + b2 + g · W2^T */
    for (r = 0; r < batch; r++) {
        for (j = 0; j < d; j++)
            y[r * d + j] = x[r * d + j] + p[l.b2 + j];
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)batch, (int)d, (int)hd, 1.0f, s->g,
                (int)hd, p + l.w2, (int)hd, 1.0f, y, (int)d);
}

int hm_ffn_forward(const hm_ffn *f, const float *x, size_t batch, float *y)
{
    struct scratch s;
    int result;

    if (f == NULL || x == NULL || y == NULL)
        return -EINVAL;
    if ((result = scratch_alloc(f, batch, 0, &s)) < 0)
        return result;
    if (!finite_all(x, batch * f->cfg.dim)) {
        result = -EDOM;
        goto out;
    }
    forward_into(f, x, batch, &s, y);
    /* Finite but huge weights can overflow: an error, never inf handed back. */
    result = finite_all(y, batch * f->cfg.dim) ? 0 : -EDOM;
out:
    scratch_free(&s);
    return result;
}

/* Sum over rows of m[rows, cols] into out[cols]. */
static void sum_rows(const float *m, size_t rows, size_t cols, float *out)
{
    size_t r, j;

    memset(out, 0, cols * sizeof(float));
    for (r = 0; r < rows; r++) {
        const float *mr = m + r * cols;
        for (j = 0; j < cols; j++)
            out[j] += mr[j];
    }
}

int hm_ffn_grad(const hm_ffn *f, const float *x, const float *grad_y, size_t batch,
                float *grad_x, float *grad_params)
{
    struct scratch s;
    size_t d, hd, r, j;
    struct layout l;
    const float *p;
    float *gp = grad_params;
    int result;

    if (f == NULL || x == NULL || grad_y == NULL || grad_x == NULL)
        return -EINVAL;
    if ((result = scratch_alloc(f, batch, 1, &s)) < 0)
        return result;
    d = f->cfg.dim;
    hd = f->cfg.hidden;
    l = layout_of(d, hd);
    p = f->params;
    if (!finite_all(x, batch * d) || !finite_all(grad_y, batch * d)) {
        result = -EDOM;
        goto out;
    }
    forward_into(f, x, batch, &s, NULL);

    if (gp != NULL) {
        /* dW2 = gy^T · g [dim, hidden]; db2 = sum of gy over the batch. */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)d, (int)hd, (int)batch, 1.0f,
                    grad_y, (int)d, s.g, (int)hd, 0.0f, gp + l.w2, (int)hd);
        sum_rows(grad_y, batch, d, gp + l.b2);
    }
    /* dg = gy · W2 [batch, hidden], into g, which is no longer needed. */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)batch, (int)hd, (int)d, 1.0f,
                grad_y, (int)d, p + l.w2, (int)hd, 0.0f, s.g, (int)hd);
    /* dh = dg * gelu'(h), into h. */
    for (j = 0; j < batch * hd; j++)
        s.h[j] = s.g[j] * gelu_grad(s.h[j]);
    if (gp != NULL) {
        /* dW1 = dh^T · a [hidden, dim]; db1 = sum of dh over the batch. */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)hd, (int)d, (int)batch, 1.0f,
                    s.h, (int)hd, s.a, (int)d, 0.0f, gp + l.w1, (int)d);
        sum_rows(s.h, batch, hd, gp + l.b1);
        memset(gp + l.gamma, 0, 2 * d * sizeof(float));
    }
    /* da = dh · W1 [batch, dim], into a, whose last reader was dW1. */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)batch, (int)d, (int)hd, 1.0f, s.h,
                (int)hd, p + l.w1, (int)d, 0.0f, s.a, (int)d);

    /*
     * LayerNorm backward per row, with xhat recomputed from x and the saved
     * statistics (recovering it from a would divide by gamma):
     *   dx = gy + rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),
     * where dxhat = da * gamma; the residual contributes gy.
     */
    for (r = 0; r < batch; r++) {
        const float *xr = x + r * d, *dar = s.a + r * d, *gyr = grad_y + r * d;
        float *gxr = grad_x + r * d;
        const float mu = s.mu[r], rstd = s.rstd[r];
        double sum_dxh = 0, sum_dxh_xh = 0;
        float mean_dxh, mean_dxh_xh;

        for (j = 0; j < d; j++) {
            float xh = (xr[j] - mu) * rstd;
            float dxh = dar[j] * p[l.gamma + j];
            sum_dxh += dxh;
            sum_dxh_xh += (double)dxh * xh;
            if (gp != NULL) {
                gp[l.gamma + j] += dar[j] * xh;
                gp[l.beta + j] += dar[j];
            }
        }
        mean_dxh = (float)(sum_dxh / (double)d);
        mean_dxh_xh = (float)(sum_dxh_xh / (double)d);
        for (j = 0; j < d; j++) {
            float xh = (xr[j] - mu) * rstd;
            float dxh = dar[j] * p[l.gamma + j];
            gxr[j] = gyr[j] + rstd * (dxh - mean_dxh - xh * mean_dxh_xh);
        }
    }
    result = 0;
out:
    scratch_free(&s);
    return result;
}

/* ---- optimizers ---- */

/* The step's constants, computed once per step from the config and the step count. */
struct step_k {
    float keep;               /* decoupled weight decay: 1 - lr * weight_decay, or 1 */
    float lr, mom;            /* SGD */
    float step_size, bc2_sqrt, b1, b2, eps; /* Adam */
};

static struct step_k step_constants(const hm_ffn_config *c, uint64_t steps)
{
    struct step_k k;
    /* torch.optim.Adam: bias-corrected moments, eps added after the correction. */
    const double t = (double)(steps + 1);
    const double bc1 = 1.0 - pow(c->beta1, t), bc2 = 1.0 - pow(c->beta2, t);

    k.keep = c->weight_decay != 0 ? (float)(1.0 - c->lr * c->weight_decay) : 1.0f;
    k.lr = (float)c->lr;
    k.mom = (float)c->momentum;
    k.step_size = (float)(c->lr / bc1);
    k.bc2_sqrt = (float)sqrt(bc2);
    k.b1 = (float)c->beta1;
    k.b2 = (float)c->beta2;
    k.eps = (float)c->eps;
    return k;
}

/*
 * One parameter's step: its new value and new moments, computed without
 * writing anything, so that the same arithmetic serves the check pass and
 * the update pass. SGD follows torch.optim.SGD (dampening 0: buf =
 * momentum * buf + g, with buf = g on the first step, which a zero buffer
 * gives too); weight decay is decoupled (AdamW-style: it shrinks the
 * weights, not the gradient).
 */
static inline void step_one(const hm_ffn_config *c, const struct step_k *k, const float *params,
                            const float *m1, const float *m2, size_t i, float g, float *p_out,
                            float *m1_out, float *m2_out)
{
    float p = params[i] * k->keep;

    if (c->optimizer == HM_FFN_SGD) {
        if (m1 != NULL) {
            float b = k->mom * m1[i] + g;
            *m1_out = b;
            p -= k->lr * b;
        } else {
            p -= k->lr * g;
        }
    } else {
        float m = k->b1 * m1[i] + (1.0f - k->b1) * g;
        float v = k->b2 * m2[i] + (1.0f - k->b2) * g * g;
        *m1_out = m;
        *m2_out = v;
        p -= k->step_size * m / (sqrtf(v) / k->bc2_sqrt + k->eps);
    }
    *p_out = p;
}

int hm_ffn_moments(const hm_ffn_config *c) { return c != NULL ? moments_of(c) : 0; }

int hm_ffn_opt_check(const hm_ffn_config *c, uint64_t steps, const float *params,
                     const float *m1, const float *m2, const float *grad, size_t n)
{
    struct step_k k;
    size_t i;

    if (c == NULL || (n > 0 && (params == NULL || grad == NULL)) ||
        (moments_of(c) >= 1 && n > 0 && m1 == NULL) || (moments_of(c) >= 2 && n > 0 && m2 == NULL))
        return -EINVAL;
    /* A non-finite gradient would poison every parameter it touches: refuse it whole. */
    if (!finite_all(grad, n))
        return -EDOM;
    k = step_constants(c, steps);
    /*
     * A finite but huge gradient can still overflow a moment (Adam squares
     * it) or a parameter: the expert would then stop learning for good and
     * its checkpoints could not be loaded. So this read-only pass checks
     * that every new value would be finite before anything is written. It
     * costs a few flops per parameter, little next to the matrix products
     * of the gradient.
     */
    for (i = 0; i < n; i++) {
        float p, nm1 = 0, nm2 = 0;
        step_one(c, &k, params, m1, m2, i, grad[i], &p, &nm1, &nm2);
        if (!isfinite(p) || !isfinite(nm1) || !isfinite(nm2))
            return -EDOM;
    }
    return 0;
}

void hm_ffn_opt_step(const hm_ffn_config *c, uint64_t steps, float *params, float *m1,
                     float *m2, const float *grad, size_t n)
{
    struct step_k k = step_constants(c, steps);
    size_t i;

    for (i = 0; i < n; i++) {
        float p, nm1 = 0, nm2 = 0;
        step_one(c, &k, params, m1, m2, i, grad[i], &p, &nm1, &nm2);
        params[i] = p;
        if (m1 != NULL)
            m1[i] = nm1;
        if (m2 != NULL)
            m2[i] = nm2;
    }
}

int hm_ffn_apply(hm_ffn *f, const float *grad_params)
{
    int r;

    if (f == NULL || grad_params == NULL)
        return -EINVAL;
    r = hm_ffn_opt_check(&f->cfg, f->steps, f->params, f->m1, f->m2, grad_params, f->nparams);
    if (r < 0)
        return r;
    hm_ffn_opt_step(&f->cfg, f->steps, f->params, f->m1, f->m2, grad_params, f->nparams);
    f->steps++;
    return 0;
}

int hm_ffn_backward(hm_ffn *f, const float *x, const float *grad_y, size_t batch,
                    float *grad_x)
{
    float *gp = NULL;
    size_t bytes;
    int result;

    if (f == NULL)
        return -EINVAL;
    if ((result = mul_size(f->nparams, sizeof(float), &bytes)) < 0)
        return result;
    if ((gp = malloc(bytes)) == NULL)
        return -ENOMEM;
    if ((result = hm_ffn_grad(f, x, grad_y, batch, grad_x, gp)) < 0)
        goto out;
    result = hm_ffn_apply(f, gp);
out:
    free(gp);
    return result;
}

/* ---- serialized state ---- */

static void f32_to_le(uint8_t *dst, const float *src, size_t n)
{
    size_t i;

    for (i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &src[i], 4);
        dst[4 * i] = (uint8_t)u;
        dst[4 * i + 1] = (uint8_t)(u >> 8);
        dst[4 * i + 2] = (uint8_t)(u >> 16);
        dst[4 * i + 3] = (uint8_t)(u >> 24);
    }
}

static void le_to_f32(float *dst, const uint8_t *src, size_t n)
{
    size_t i;

    for (i = 0; i < n; i++) {
        uint32_t u = (uint32_t)src[4 * i] | (uint32_t)src[4 * i + 1] << 8 |
                     (uint32_t)src[4 * i + 2] << 16 | (uint32_t)src[4 * i + 3] << 24;
        memcpy(&dst[i], &u, 4);
    }
}

/* A float vector as one bin of little-endian bytes, converted a chunk at a time. */
static void wr_vector(hm_wire_wr *w, const float *v, size_t n)
{
    uint8_t chunk[LE_CHUNK * 4];
    size_t off;

    if (n > UINT32_MAX / 4) {
        if (w->err == 0)
            w->err = -EMSGSIZE;
        return;
    }
    (void)msgpack_pack_bin(&w->pk, n * 4);
    for (off = 0; off < n; off += LE_CHUNK) {
        size_t k = HM_MIN(n - off, LE_CHUNK);
        f32_to_le(chunk, v + off, k);
        (void)msgpack_pack_bin_body(&w->pk, chunk, k * 4);
    }
}

int hm_ffn_save(const hm_ffn *f, uint8_t **buf_out, size_t *len_out)
{
    const hm_ffn_config *c;
    hm_wire_wr w;
    uint8_t *buf = NULL;
    size_t vec_bytes, cap;
    int nmom, result;

    if (f == NULL || buf_out == NULL || len_out == NULL)
        return -EINVAL;
    *buf_out = NULL;
    *len_out = 0;
    c = &f->cfg;
    nmom = moments_of(c);
    /* The size is known up front, so one exact allocation replaces repeated growth. */
    if ((result = mul_size(f->nparams, 4 * (size_t)(1 + nmom), &vec_bytes)) < 0)
        return result;
    if (vec_bytes > SIZE_MAX - STATE_HEADER_MAX)
        return -ENOMEM;
    cap = vec_bytes + STATE_HEADER_MAX;
    if ((buf = malloc(cap)) == NULL)
        return -ENOMEM;
    hm_wire_wr_init_fixed(&w, buf, cap);
    hm_wire_wr_map(&w, 15);
    hm_wire_wr_cstr(&w, "version");
    hm_wire_wr_uint(&w, STATE_VERSION);
    hm_wire_wr_cstr(&w, "dim");
    hm_wire_wr_uint(&w, c->dim);
    hm_wire_wr_cstr(&w, "hidden");
    hm_wire_wr_uint(&w, c->hidden);
    hm_wire_wr_cstr(&w, "optimizer");
    hm_wire_wr_uint(&w, (uint64_t)c->optimizer);
    hm_wire_wr_cstr(&w, "lr");
    hm_wire_wr_double(&w, c->lr);
    hm_wire_wr_cstr(&w, "momentum");
    hm_wire_wr_double(&w, c->momentum);
    hm_wire_wr_cstr(&w, "beta1");
    hm_wire_wr_double(&w, c->beta1);
    hm_wire_wr_cstr(&w, "beta2");
    hm_wire_wr_double(&w, c->beta2);
    hm_wire_wr_cstr(&w, "eps");
    hm_wire_wr_double(&w, c->eps);
    hm_wire_wr_cstr(&w, "weight_decay");
    hm_wire_wr_double(&w, c->weight_decay);
    hm_wire_wr_cstr(&w, "seed");
    hm_wire_wr_uint(&w, c->seed);
    hm_wire_wr_cstr(&w, "steps");
    hm_wire_wr_uint(&w, f->steps);
    hm_wire_wr_cstr(&w, "params");
    wr_vector(&w, f->params, f->nparams);
    hm_wire_wr_cstr(&w, "m1");
    wr_vector(&w, f->m1, f->m1 != NULL ? f->nparams : 0);
    hm_wire_wr_cstr(&w, "m2");
    wr_vector(&w, f->m2, f->m2 != NULL ? f->nparams : 0);
    if ((result = hm_wire_wr_error(&w)) < 0)
        goto out;
    *buf_out = buf;
    *len_out = w.len;
    buf = NULL;
    result = 0;
out:
    free(buf);
    return result;
}

/* The largest state hm_ffn_save can produce: Adam at the largest dim and hidden. */
static size_t state_max_bytes(void)
{
    const size_t np = 3 * (size_t)HM_FFN_MAX_DIM + 2 * (size_t)HM_FFN_MAX_DIM * HM_FFN_MAX_HIDDEN +
                      HM_FFN_MAX_HIDDEN;
    size_t bytes;

    if (mul_size(np, 12, &bytes) < 0 || bytes > SIZE_MAX - STATE_HEADER_MAX)
        return SIZE_MAX;
    return bytes + STATE_HEADER_MAX;
}

static int get_uint_key(const msgpack_object *map, const char *key, uint64_t *out)
{
    const msgpack_object *o = hm_wire_map_get(map, key);

    return o != NULL ? hm_wire_get_uint(o, out) : -EBADMSG;
}

static int get_double_key(const msgpack_object *map, const char *key, double *out)
{
    const msgpack_object *o = hm_wire_map_get(map, key);

    return o != NULL ? hm_wire_get_double(o, out) : -EBADMSG;
}

/*
 * A vector of exactly n floats (n may be 0) from the bin under key; every
 * value must be finite, and non-negative when nonneg (Adam's second moment,
 * whose square root the next step takes).
 */
static int get_vector(const msgpack_object *map, const char *key, size_t n, int nonneg,
                      float *dst)
{
    const msgpack_object *o = hm_wire_map_get(map, key);
    const uint8_t *p;
    uint32_t len;
    size_t i;

    if (o == NULL || hm_wire_get_bin(o, &p, &len) < 0)
        return -EBADMSG;
    if (n > UINT32_MAX / 4 || len != n * 4)
        return -EBADMSG;
    if (dst == NULL)
        return 0;
    le_to_f32(dst, p, n);
    for (i = 0; i < n; i++) {
        if (!isfinite(dst[i]) || (nonneg && dst[i] < 0))
            return -EBADMSG;
    }
    return 0;
}

int hm_ffn_load(const uint8_t *buf, size_t len, const hm_ffn_config *expect, hm_ffn **out)
{
    /* Fifteen keys and their values; a state has no nesting below the map. */
    const hm_wire_limits lim = {.max_size = state_max_bytes(), .max_depth = 1, .max_elements = 64};
    hm_wire_msg m;
    const msgpack_object *root;
    hm_ffn_config c, want;
    hm_ffn *f = NULL;
    uint64_t dim, hidden, opt, seed, steps;
    size_t np;
    int nmom, result;

    if (out == NULL)
        return -EINVAL;
    *out = NULL;
    if (buf == NULL)
        return -EINVAL;
    if (len > lim.max_size)
        return -EMSGSIZE;
    /*
     * Whatever the validator refuses (truncation, trailing bytes, depth), a
     * root that is not a map and a version that is not ours are all
     * malformed content.
     */
    if ((result = hm_wire_decode_open_map(&m, buf, len, &lim, "version", STATE_VERSION)) < 0) {
        if (result != -ENOMEM)
            result = -EBADMSG;
        goto out;
    }
    root = &m.root;
    result = -EBADMSG;
    memset(&c, 0, sizeof(c));
    if (get_uint_key(root, "dim", &dim) < 0 || get_uint_key(root, "hidden", &hidden) < 0 ||
        get_uint_key(root, "optimizer", &opt) < 0 || get_uint_key(root, "seed", &seed) < 0 ||
        get_uint_key(root, "steps", &steps) < 0 || get_double_key(root, "lr", &c.lr) < 0 ||
        get_double_key(root, "momentum", &c.momentum) < 0 ||
        get_double_key(root, "beta1", &c.beta1) < 0 ||
        get_double_key(root, "beta2", &c.beta2) < 0 || get_double_key(root, "eps", &c.eps) < 0 ||
        get_double_key(root, "weight_decay", &c.weight_decay) < 0)
        goto out;
    /* Zero hidden or lr would be replaced by defaults: a saved state never holds them. */
    if (dim < 1 || dim > HM_FFN_MAX_DIM || hidden < 1 || hidden > HM_FFN_MAX_HIDDEN ||
        opt > HM_FFN_ADAM || c.lr == 0)
        goto out;
    c.dim = (size_t)dim;
    c.hidden = (size_t)hidden;
    c.optimizer = (int)opt;
    c.seed = seed;
    if (config_resolve(&c, &c) < 0)
        goto out;
    if (expect != NULL) {
        if (config_resolve(expect, &want) < 0) {
            result = -EINVAL;
            goto out;
        }
        /* A well-formed state of another shape: the one error that is not corruption. */
        if (want.dim != c.dim || want.hidden != c.hidden || want.optimizer != c.optimizer) {
            result = -EPROTO;
            goto out;
        }
    }
    /* Every length is checked before anything is allocated, so the allocation is bounded by len. */
    np = nparams_of(&c);
    nmom = moments_of(&c);
    if (get_vector(root, "params", np, 0, NULL) < 0 ||
        get_vector(root, "m1", nmom >= 1 ? np : 0, 0, NULL) < 0 ||
        get_vector(root, "m2", nmom >= 2 ? np : 0, 1, NULL) < 0)
        goto out;
    if ((result = ffn_alloc(&c, &f)) < 0)
        goto out;
    result = -EBADMSG;
    f->steps = steps;
    if (get_vector(root, "params", np, 0, f->params) < 0 ||
        (f->m1 != NULL && get_vector(root, "m1", np, 0, f->m1) < 0) ||
        (f->m2 != NULL && get_vector(root, "m2", np, 1, f->m2) < 0))
        goto out;
    *out = f;
    f = NULL;
    result = 0;
out:
    hm_ffn_free(f);
    hm_wire_decode_close(&m);
    return result;
}

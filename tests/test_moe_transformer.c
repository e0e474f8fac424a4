/*
 * Tests for the transformer expert (moe/transformer.h). Its forward pass is
 * compared with a naive double-precision reference of the pre-LN block
 * written here (LayerNorm, per-head softmax attention, the output
 * projection, then the ffn expert's block, each with its residual); its
 * gradients with central finite differences of that reference, for the
 * input and every parameter. The optimizer step moves both halves as one
 * (SGD and Adam written out by hand), and a step that would overflow either
 * half moves neither. Samples attend only within themselves. Saved state
 * round-trips bit for bit, says it is a transformer, trains on exactly as
 * the original, and malformed or mismatched state is refused as ffn state
 * is.
 */
#include "config.h"

#include "moe/ffn.h"
#include "moe/transformer.h"
#include "src/base/util.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

struct rng {
    uint64_t s;
};

static uint64_t rng_next(struct rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_range(struct rng *r, double lo, double hi)
{
    return lo + (hi - lo) * ((double)(rng_next(r) >> 11) * 0x1p-53);
}

static void fill(struct rng *r, float *v, size_t n, double lo, double hi)
{
    for (size_t i = 0; i < n; i++)
        v[i] = (float)rng_range(r, lo, hi);
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    cr_assert_not_null(p);
    return p;
}

static hm_xf *make_xf(size_t dim, size_t hidden, size_t heads, int opt, uint64_t seed)
{
    hm_xf_config c = {0};
    hm_xf *t = NULL;
    c.ffn.dim = dim;
    c.ffn.hidden = hidden;
    c.ffn.optimizer = opt;
    c.ffn.seed = seed;
    c.heads = heads;
    c.max_seq = 64;
    cr_assert_eq(hm_xf_new(&c, &t), 0);
    return t;
}

/* Every parameter away from its init (gammas near 1), so that no term hides behind a zero. */
static void randomize(hm_xf *t, struct rng *r)
{
    const size_t d = hm_xf_dim(t), n = hm_xf_nparams(t);
    for (size_t i = 0; i < n; i++)
        *hm_xf_param(t, i) = (float)rng_range(r, -0.5, 0.5);
    for (size_t j = 0; j < d; j++)
        *hm_xf_param(t, j) = (float)rng_range(r, 0.5, 1.5); /* ln1 gamma */
}

/* ---- the reference, in double, written for clarity ---- */

static void ref_ln(size_t d, const double *x, const double *g, const double *b, double *out)
{
    double mu = 0, var = 0;
    for (size_t j = 0; j < d; j++)
        mu += x[j];
    mu /= (double)d;
    for (size_t j = 0; j < d; j++)
        var += (x[j] - mu) * (x[j] - mu);
    var /= (double)d;
    for (size_t j = 0; j < d; j++)
        out[j] = (x[j] - mu) / sqrt(var + 1e-5) * g[j] + b[j];
}

static double ref_gelu(double v)
{
    return 0.5 * v * (1.0 + tanh(sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
}

/* y for one sample x [seq, d]; p is the one parameter vector (attention, then ffn). */
static void ref_sample(size_t d, size_t hid, size_t heads, size_t seq, const double *p,
                       const uint8_t *keep, const double *x, double *y)
{
    const double *g1 = p, *b1 = p + d, *wqkv = p + 2 * d, *bqkv = wqkv + 3 * d * d,
                 *wo = bqkv + 3 * d, *bo = wo + d * d;
    const double *f = bo + d;
    const double *g2 = f, *b2 = f + d, *w1 = f + 2 * d, *fb1 = w1 + hid * d, *w2 = fb1 + hid,
                 *fb2 = w2 + d * hid;
    const size_t dh = d / heads;
    double *a = xmalloc(seq * d * sizeof(double)), *qkv = xmalloc(seq * 3 * d * sizeof(double));
    double *o = xmalloc(seq * d * sizeof(double)), *h = xmalloc(seq * d * sizeof(double));
    double *s = xmalloc(seq * sizeof(double)), *ln2 = xmalloc(d * sizeof(double));
    double *gg = xmalloc(hid * sizeof(double));

    for (size_t t = 0; t < seq; t++) {
        ref_ln(d, x + t * d, g1, b1, a + t * d);
        for (size_t k = 0; k < 3 * d; k++) {
            double v = bqkv[k];
            for (size_t j = 0; j < d; j++)
                v += wqkv[k * d + j] * a[t * d + j];
            qkv[t * 3 * d + k] = v;
        }
    }
    for (size_t hh = 0; hh < heads; hh++) {
        for (size_t i = 0; i < seq; i++) {
            double mx = -INFINITY, sum = 0;
            for (size_t j = 0; j < seq; j++) {
                double v = 0;
                for (size_t c = 0; c < dh; c++)
                    v += qkv[i * 3 * d + hh * dh + c] * qkv[j * 3 * d + d + hh * dh + c];
                s[j] = v / sqrt((double)dh);
                /* A padded key: minus infinity, as torch's key_padding_mask. */
                if (keep != NULL && !keep[j])
                    s[j] = -INFINITY;
                mx = fmax(mx, s[j]);
            }
            for (size_t j = 0; j < seq; j++) {
                s[j] = exp(s[j] - mx);
                sum += s[j];
            }
            for (size_t c = 0; c < dh; c++) {
                double v = 0;
                for (size_t j = 0; j < seq; j++)
                    v += s[j] / sum * qkv[j * 3 * d + 2 * d + hh * dh + c];
                o[i * d + hh * dh + c] = v;
            }
        }
    }
    for (size_t t = 0; t < seq; t++) {
        for (size_t j = 0; j < d; j++) {
            double v = x[t * d + j] + bo[j];
            for (size_t k = 0; k < d; k++)
                v += wo[j * d + k] * o[t * d + k];
            h[t * d + j] = v;
        }
        ref_ln(d, h + t * d, g2, b2, ln2);
        for (size_t k = 0; k < hid; k++) {
            double v = fb1[k];
            for (size_t j = 0; j < d; j++)
                v += w1[k * d + j] * ln2[j];
            gg[k] = ref_gelu(v);
        }
        for (size_t j = 0; j < d; j++) {
            double v = h[t * d + j] + fb2[j];
            for (size_t k = 0; k < hid; k++)
                v += w2[j * hid + k] * gg[k];
            y[t * d + j] = v;
        }
    }
    free(a);
    free(qkv);
    free(o);
    free(h);
    free(s);
    free(ln2);
    free(gg);
}

static void ref_forward(size_t d, size_t hid, size_t heads, size_t batch, size_t seq,
                        const double *p, const uint8_t *mask, const double *x, double *y)
{
    for (size_t b = 0; b < batch; b++)
        ref_sample(d, hid, heads, seq, p, mask != NULL ? mask + b * seq : NULL, x + b * seq * d,
                   y + b * seq * d);
}

static double ref_loss(size_t d, size_t hid, size_t heads, size_t batch, size_t seq,
                       const double *p, const uint8_t *mask, const double *x, const double *gy)
{
    const size_t n = batch * seq * d;
    double *y = xmalloc(n * sizeof(double)), l = 0;
    ref_forward(d, hid, heads, batch, seq, p, mask, x, y);
    for (size_t i = 0; i < n; i++)
        l += gy[i] * y[i];
    free(y);
    return l;
}

static double *params_double(hm_xf *t)
{
    size_t n = hm_xf_nparams(t);
    double *p = xmalloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++)
        p[i] = *hm_xf_param(t, i);
    return p;
}

static double *to_double(const float *v, size_t n)
{
    double *o = xmalloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++)
        o[i] = v[i];
    return o;
}

/* ---- construction ---- */

Test(xf, config_defaults_and_validation)
{
    hm_xf_config c = {0};
    hm_xf *t = NULL;
    c.ffn.dim = 12;
    cr_assert_eq(hm_xf_new(&c, &t), 0);
    cr_assert_eq(hm_xf_config_of(t)->heads, 4u, "the largest of 8, 4, 2, 1 dividing 12");
    cr_assert_eq(hm_xf_config_of(t)->max_seq, (size_t)HM_XF_DEFAULT_MAX_SEQ);
    cr_assert_eq(hm_xf_config_of(t)->ffn.hidden, 48u);
    cr_assert_eq(hm_xf_nparams(t), 4 * 144 + 6 * 12 + (3 * 12 + 2 * 12 * 48 + 48));
    cr_assert_null(hm_xf_param(t, hm_xf_nparams(t)));
    float x[12] = {0}, y[12];
    /* A sequence longer than max_seq, or none, is refused. */
    cr_assert_eq(hm_xf_forward(t, x, 1, HM_XF_DEFAULT_MAX_SEQ + 1, y), -EINVAL);
    cr_assert_eq(hm_xf_forward(t, x, 1, 0, y), -EINVAL);
    cr_assert_eq(hm_xf_forward(t, x, 0, 1, y), -EINVAL);
    hm_xf_free(t);
    c.heads = 5; /* does not divide 12 */
    cr_assert_eq(hm_xf_new(&c, &t), -EINVAL);
    cr_assert_null(t);
    c.heads = HM_XF_MAX_HEADS + 1;
    c.ffn.dim = 65 * 2;
    cr_assert_eq(hm_xf_new(&c, &t), -EINVAL);
    c.heads = 1;
    c.max_seq = HM_XF_MAX_SEQ + 1;
    cr_assert_eq(hm_xf_new(&c, &t), -EINVAL);
    c.max_seq = 0;
    c.ffn.dim = 7; /* only 1 divides 7 */
    cr_assert_eq(hm_xf_new(&c, &t), 0);
    cr_assert_eq(hm_xf_config_of(t)->heads, 1u);
    hm_xf_free(t);
    c.ffn.dim = 0;
    cr_assert_eq(hm_xf_new(&c, &t), -EINVAL);
    cr_assert_eq(hm_xf_new(NULL, &t), -EINVAL);
}

Test(xf, the_ffn_half_is_an_ffn_of_the_same_seed)
{
    hm_xf *t = make_xf(8, 16, 2, HM_FFN_ADAM, 99);
    hm_ffn_config fc = {0};
    hm_ffn *f = NULL;
    fc.dim = 8;
    fc.hidden = 16;
    fc.optimizer = HM_FFN_ADAM;
    fc.seed = 99;
    cr_assert_eq(hm_ffn_new(&fc, &f), 0);
    const size_t na = hm_xf_nparams(t) - hm_ffn_nparams(f);
    cr_assert_eq(na, 4 * 64 + 6 * 8);
    for (size_t i = 0; i < hm_ffn_nparams(f); i++)
        cr_assert_eq(*hm_xf_param(t, na + i), hm_ffn_params(f)[i], "ffn parameter %zu", i);
    /* LN1 starts as the identity's scale, Wqkv and Wo within +-1/sqrt(dim). */
    for (size_t j = 0; j < 8; j++)
        cr_assert_eq(*hm_xf_param(t, j), 1.0f);
    for (size_t i = 16; i < 16 + 192; i++)
        cr_assert(fabsf(*hm_xf_param(t, i)) <= 1.0f / sqrtf(8.0f));
    hm_ffn_free(f);
    hm_xf_free(t);
}

/* ---- forward ---- */

static void check_forward_mask(size_t d, size_t hid, size_t heads, size_t batch, size_t seq,
                               uint64_t seed, const uint8_t *mask)
{
    struct rng r = {seed};
    hm_xf *t = make_xf(d, hid, heads, HM_FFN_SGD, seed);
    hid = hm_xf_config_of(t)->ffn.hidden;
    const size_t n = batch * seq * d;
    float *x = xmalloc(n * sizeof(float)), *y = xmalloc(n * sizeof(float));
    double *yr = xmalloc(n * sizeof(double));
    randomize(t, &r);
    fill(&r, x, n, -2, 2);
    cr_assert_eq(hm_xf_forward_mask(t, x, mask, batch, seq, y), 0);
    double *p = params_double(t), *xd = to_double(x, n);
    ref_forward(d, hid, heads, batch, seq, p, mask, xd, yr);
    for (size_t i = 0; i < n; i++)
        cr_assert(fabs(y[i] - yr[i]) <= 1e-4 * fmax(1.0, fabs(yr[i])),
                  "d %zu heads %zu seq %zu: y[%zu] = %.9g, reference %.9g", d, heads, seq, i,
                  (double)y[i], yr[i]);
    free(x);
    free(y);
    free(yr);
    free(p);
    free(xd);
    hm_xf_free(t);
}

static void check_forward(size_t d, size_t hid, size_t heads, size_t batch, size_t seq,
                          uint64_t seed)
{
    check_forward_mask(d, hid, heads, batch, seq, seed, NULL);
}

Test(xf, forward_matches_double_reference)
{
    check_forward(8, 16, 2, 3, 5, 1);
    check_forward(8, 16, 1, 2, 4, 2);
    check_forward(8, 0, 8, 2, 3, 3);  /* heads of one column */
    check_forward(12, 20, 3, 1, 7, 4);
    check_forward(6, 10, 2, 4, 1, 5); /* a sequence of one: attention passes V through */
    check_forward(64, 96, 4, 2, 33, 6);
}

/*
 * Each sample attends within itself: its output does not depend on its
 * batch. Up to float rounding only: BLAS may pick other kernels (another
 * order of the same sums) for a product of 4 rows than for one of 12, as
 * OpenBLAS does on some CPUs; a sample that saw another would be off by far
 * more than that.
 */
Test(xf, samples_are_independent)
{
    struct rng r = {21};
    hm_xf *t = make_xf(8, 16, 2, HM_FFN_SGD, 21);
    enum { B = 3, S = 4, D = 8 };
    float x[B * S * D], y[B * S * D], y1[S * D];
    randomize(t, &r);
    fill(&r, x, B * S * D, -1, 1);
    cr_assert_eq(hm_xf_forward(t, x, B, S, y), 0);
    for (size_t b = 0; b < B; b++) {
        cr_assert_eq(hm_xf_forward(t, x + b * S * D, 1, S, y1), 0);
        for (size_t k = 0; k < S * D; k++) {
            float a = y1[k], e = y[b * S * D + k];
            cr_assert_leq(fabsf(a - e), 1e-5f * (1.0f + fabsf(e)),
                          "sample %zu element %zu: %.9g alone, %.9g in the batch", b, k,
                          (double)a, (double)e);
        }
    }
    hm_xf_free(t);
}

/* ---- gradients ---- */

static void assert_close_vec(const char *what, const float *a, const double *ref, size_t n)
{
    double scale = 0;
    for (size_t i = 0; i < n; i++)
        scale = fmax(scale, fabs(ref[i]));
    for (size_t i = 0; i < n; i++) {
        double tol = 2e-3 * fmax(fabs(ref[i]), 1e-2 * scale) + 1e-6;
        cr_assert(fabs(a[i] - ref[i]) <= tol, "%s[%zu]: %.9g vs finite difference %.9g", what, i,
                  (double)a[i], ref[i]);
    }
}

static void check_grad_mask(size_t d, size_t hid, size_t heads, size_t batch, size_t seq,
                            uint64_t seed, const uint8_t *mask)
{
    struct rng r = {seed};
    hm_xf *t = make_xf(d, hid, heads, HM_FFN_SGD, seed);
    hid = hm_xf_config_of(t)->ffn.hidden;
    const size_t np = hm_xf_nparams(t), nx = batch * seq * d;
    float *x = xmalloc(nx * sizeof(float)), *gy = xmalloc(nx * sizeof(float));
    float *gx = xmalloc(nx * sizeof(float)), *gp = xmalloc(np * sizeof(float));
    double *num_x = xmalloc(nx * sizeof(double)), *num_p = xmalloc(np * sizeof(double));
    const double step = 1e-5;

    randomize(t, &r);
    fill(&r, x, nx, -2, 2);
    fill(&r, gy, nx, -1, 1);
    cr_assert_eq(hm_xf_grad_mask(t, x, mask, gy, batch, seq, gx, gp), 0);
    double *pd = params_double(t), *xd = to_double(x, nx), *gyd = to_double(gy, nx);
    for (size_t i = 0; i < nx; i++) {
        double keep = xd[i], lp, lm;
        xd[i] = keep + step;
        lp = ref_loss(d, hid, heads, batch, seq, pd, mask, xd, gyd);
        xd[i] = keep - step;
        lm = ref_loss(d, hid, heads, batch, seq, pd, mask, xd, gyd);
        xd[i] = keep;
        num_x[i] = (lp - lm) / (2 * step);
    }
    for (size_t i = 0; i < np; i++) {
        double keep = pd[i], lp, lm;
        pd[i] = keep + step;
        lp = ref_loss(d, hid, heads, batch, seq, pd, mask, xd, gyd);
        pd[i] = keep - step;
        lm = ref_loss(d, hid, heads, batch, seq, pd, mask, xd, gyd);
        pd[i] = keep;
        num_p[i] = (lp - lm) / (2 * step);
    }
    assert_close_vec("dL/dx", gx, num_x, nx);
    /* Block by block, so that a small block is not judged by a large one's scale. */
    const size_t na = 4 * d * d + 6 * d;
    size_t off[] = {0,      d,          2 * d,          2 * d + 3 * d * d, 5 * d + 3 * d * d,
                    5 * d + 4 * d * d, na,       na + d,  na + 2 * d,  na + 2 * d + hid * d,
                    na + 2 * d + hid * d + hid,  na + 2 * d + 2 * hid * d + hid, np};
    const char *names[] = {"ln1 gamma", "ln1 beta", "Wqkv",  "bqkv", "Wo",  "bo",
                           "ln2 gamma", "ln2 beta", "W1",    "b1",   "W2",  "b2"};
    for (size_t b = 0; b < 12; b++)
        assert_close_vec(names[b], gp + off[b], num_p + off[b], off[b + 1] - off[b]);
    /* Without grad_params, dL/dx is the same. */
    float *gx2 = xmalloc(nx * sizeof(float));
    cr_assert_eq(hm_xf_grad_mask(t, x, mask, gy, batch, seq, gx2, NULL), 0);
    cr_assert_eq(memcmp(gx, gx2, nx * sizeof(float)), 0);
    free(gx2);
    free(x);
    free(gy);
    free(gx);
    free(gp);
    free(pd);
    free(xd);
    free(gyd);
    free(num_x);
    free(num_p);
    hm_xf_free(t);
}

static void check_grad(size_t d, size_t hid, size_t heads, size_t batch, size_t seq,
                       uint64_t seed)
{
    check_grad_mask(d, hid, heads, batch, seq, seed, NULL);
}

Test(xf, grad_matches_finite_differences)
{
    check_grad(8, 12, 2, 2, 3, 11);
    check_grad(6, 0, 3, 1, 4, 12);
    check_grad(4, 6, 1, 3, 1, 13); /* a sequence of one */
    check_grad(4, 5, 4, 1, 5, 14); /* heads of one column */
}

/* ---- the key-padding mask ---- */

Test(xf, masked_forward_matches_double_reference)
{
    /* Sample 0 keeps all, sample 1 pads its tail, sample 2 its head and middle. */
    static const uint8_t m1[3 * 5] = {1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 0, 1, 1};
    check_forward_mask(8, 16, 2, 3, 5, 31, m1);
    static const uint8_t m2[2 * 7] = {1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0};
    check_forward_mask(12, 20, 3, 2, 7, 32, m2);
    uint8_t m3[2 * 33];
    for (size_t i = 0; i < sizeof(m3); i++)
        m3[i] = (uint8_t)((i % 33) < (i < 33 ? 20u : 33u));
    check_forward_mask(64, 96, 4, 2, 33, 33, m3);
}

Test(xf, masked_grad_matches_finite_differences)
{
    static const uint8_t m1[2 * 3] = {1, 1, 0, 0, 1, 1};
    check_grad_mask(8, 12, 2, 2, 3, 41, m1);
    static const uint8_t m2[1 * 4] = {1, 0, 1, 0};
    check_grad_mask(6, 0, 3, 1, 4, 42, m2);
    static const uint8_t m3[1 * 5] = {0, 0, 0, 0, 1};
    check_grad_mask(4, 5, 4, 1, 5, 43, m3);
}

/*
 * What the mask promises a caller: a padded key's content does not reach
 * any other position, an all-ones mask is no mask to the bit, and a mask
 * that is not 0/1 or pads a whole sample is refused.
 */
Test(xf, masked_keys_get_no_weight)
{
    struct rng r = {51};
    hm_xf *t = make_xf(8, 16, 2, HM_FFN_SGD, 51);
    enum { B = 2, S = 4, D = 8 };
    float x[B * S * D], x2[B * S * D], y[B * S * D], y2[B * S * D], gy[B * S * D];
    float gx[B * S * D], gx2[B * S * D];
    const uint8_t mask[B * S] = {1, 1, 0, 1, 1, 1, 1, 0}, ones[B * S] = {1, 1, 1, 1, 1, 1, 1, 1};
    randomize(t, &r);
    fill(&r, x, B * S * D, -1, 1);
    fill(&r, gy, B * S * D, -1, 1);
    memcpy(x2, x, sizeof(x));
    for (size_t j = 0; j < D; j++) {
        x2[(0 * S + 2) * D + j] += 3.0f; /* padded positions changed */
        x2[(1 * S + 3) * D + j] -= 2.0f;
    }
    cr_assert_eq(hm_xf_forward_mask(t, x, mask, B, S, y), 0);
    cr_assert_eq(hm_xf_forward_mask(t, x2, mask, B, S, y2), 0);
    for (size_t b = 0; b < B; b++)
        for (size_t i = 0; i < S; i++)
            if (mask[b * S + i])
                cr_assert_eq(memcmp(y + (b * S + i) * D, y2 + (b * S + i) * D, D * 4), 0,
                             "token %zu of sample %zu saw a padded key", i, b);
    /* No gradient flows into a padded key except through its own row. */
    float gyp[B * S * D];
    memcpy(gyp, gy, sizeof(gy));
    for (size_t j = 0; j < D; j++) {
        gyp[(0 * S + 2) * D + j] = 0;
        gyp[(1 * S + 3) * D + j] = 0;
    }
    cr_assert_eq(hm_xf_grad_mask(t, x, mask, gyp, B, S, gx, NULL), 0);
    for (size_t j = 0; j < D; j++) {
        cr_assert_eq(gx[(0 * S + 2) * D + j], 0.0f);
        cr_assert_eq(gx[(1 * S + 3) * D + j], 0.0f);
    }
    cr_assert_eq(hm_xf_forward(t, x, B, S, y), 0);
    cr_assert_eq(hm_xf_forward_mask(t, x, ones, B, S, y2), 0);
    cr_assert_eq(memcmp(y, y2, sizeof(y)), 0);
    cr_assert_eq(hm_xf_grad(t, x, gy, B, S, gx, NULL), 0);
    cr_assert_eq(hm_xf_grad_mask(t, x, ones, gy, B, S, gx2, NULL), 0);
    cr_assert_eq(memcmp(gx, gx2, sizeof(gx)), 0);
    const uint8_t two[B * S] = {1, 2, 1, 1, 1, 1, 1, 1}, empty[B * S] = {1, 1, 1, 1, 0, 0, 0, 0};
    cr_assert_eq(hm_xf_forward_mask(t, x, two, B, S, y), -EINVAL);
    cr_assert_eq(hm_xf_forward_mask(t, x, empty, B, S, y), -EINVAL);
    cr_assert_eq(hm_xf_grad_mask(t, x, empty, gy, B, S, gx, NULL), -EINVAL);
    const uint64_t steps = hm_xf_steps(t);
    cr_assert_eq(hm_xf_backward_mask(t, x, two, gy, B, S, gx), -EINVAL);
    cr_assert_eq(hm_xf_steps(t), steps, "a refused mask steps nothing");
    cr_assert_eq(hm_xf_backward_mask(t, x, mask, gy, B, S, gx), 0);
    cr_assert_eq(hm_xf_steps(t), steps + 1);
    hm_xf_free(t);
}

/* ---- the optimizer over both halves ---- */

Test(xf, sgd_step_moves_every_parameter_by_lr_times_its_gradient)
{
    struct rng r = {31};
    hm_xf *t = make_xf(8, 16, 2, HM_FFN_SGD, 31);
    const size_t np = hm_xf_nparams(t);
    float *g = xmalloc(np * sizeof(float));
    double *before = params_double(t);
    const double lr = hm_xf_config_of(t)->ffn.lr;
    fill(&r, g, np, -1, 1);
    cr_assert_eq(hm_xf_apply(t, g), 0);
    cr_assert_eq(hm_xf_steps(t), 1u);
    for (size_t i = 0; i < np; i++)
        cr_assert_float_eq(*hm_xf_param(t, i), (float)(before[i] - lr * g[i]), 1e-6,
                           "parameter %zu", i);
    free(g);
    free(before);
    hm_xf_free(t);
}

Test(xf, adam_steps_both_halves_as_torch)
{
    struct rng r = {32};
    hm_xf *t = make_xf(4, 8, 2, HM_FFN_ADAM, 32);
    const size_t np = hm_xf_nparams(t);
    const hm_ffn_config *c = &hm_xf_config_of(t)->ffn;
    float *g = xmalloc(np * sizeof(float));
    double *p = params_double(t), *m = calloc(np, sizeof(double)), *v = calloc(np, sizeof(double));
    for (int step = 1; step <= 3; step++) {
        fill(&r, g, np, -1, 1);
        cr_assert_eq(hm_xf_apply(t, g), 0);
        for (size_t i = 0; i < np; i++) {
            m[i] = c->beta1 * m[i] + (1 - c->beta1) * g[i];
            v[i] = c->beta2 * v[i] + (1 - c->beta2) * (double)g[i] * g[i];
            double mh = m[i] / (1 - pow(c->beta1, step)), vh = v[i] / (1 - pow(c->beta2, step));
            p[i] -= c->lr * mh / (sqrt(vh) + c->eps);
            cr_assert(fabs(*hm_xf_param(t, i) - p[i]) <= 1e-6, "step %d parameter %zu", step, i);
        }
    }
    free(g);
    free(p);
    free(m);
    free(v);
    hm_xf_free(t);
}

Test(xf, backward_is_grad_then_apply_and_overflow_steps_nothing)
{
    struct rng r = {41};
    hm_xf *a = make_xf(8, 16, 2, HM_FFN_ADAM, 41), *b = make_xf(8, 16, 2, HM_FFN_ADAM, 41);
    enum { B = 2, S = 3, D = 8 };
    float x[B * S * D], gy[B * S * D], gx[B * S * D], gx2[B * S * D];
    const size_t np = hm_xf_nparams(a);
    float *gp = xmalloc(np * sizeof(float));
    fill(&r, x, B * S * D, -1, 1);
    fill(&r, gy, B * S * D, -1, 1);
    cr_assert_eq(hm_xf_backward(a, x, gy, B, S, gx), 0);
    cr_assert_eq(hm_xf_grad(b, x, gy, B, S, gx2, gp), 0);
    cr_assert_eq(hm_xf_apply(b, gp), 0);
    cr_assert_eq(memcmp(gx, gx2, sizeof(gx)), 0);
    for (size_t i = 0; i < np; i++)
        cr_assert_eq(*hm_xf_param(a, i), *hm_xf_param(b, i));

    /* A gradient that overflows Adam's second moment in the attention half
     * only, then in the ffn half only: neither half moves, no step counted. */
    double *keep = params_double(a);
    for (int half = 0; half < 2; half++) {
        memset(gp, 0, np * sizeof(float));
        gp[half == 0 ? 20 : np - 3] = 3e38f;
        cr_assert_eq(hm_xf_apply(a, gp), -EDOM, "half %d", half);
        cr_assert_eq(hm_xf_steps(a), 1u);
        for (size_t i = 0; i < np; i++)
            cr_assert_eq(*hm_xf_param(a, i), (float)keep[i], "half %d parameter %zu", half, i);
    }
    gp[0] = NAN;
    cr_assert_eq(hm_xf_apply(a, gp), -EDOM);
    /* Non-finite input is refused before anything is computed. */
    x[5] = INFINITY;
    cr_assert_eq(hm_xf_backward(a, x, gy, B, S, gx), -EDOM);
    cr_assert_eq(hm_xf_forward(a, x, B, S, gx), -EDOM);
    cr_assert_eq(hm_xf_steps(a), 1u);
    free(keep);
    free(gp);
    hm_xf_free(a);
    hm_xf_free(b);
}

/* ---- state ---- */

static void train(hm_xf *t, uint64_t seed, int steps)
{
    struct rng r = {seed};
    enum { B = 2, S = 3 };
    const size_t n = B * S * hm_xf_dim(t);
    float *x = xmalloc(n * sizeof(float)), *gy = xmalloc(n * sizeof(float)),
          *gx = xmalloc(n * sizeof(float));
    for (int i = 0; i < steps; i++) {
        fill(&r, x, n, -1, 1);
        fill(&r, gy, n, -1, 1);
        cr_assert_eq(hm_xf_backward(t, x, gy, B, S, gx), 0);
    }
    free(x);
    free(gy);
    free(gx);
}

static void check_round_trip(int opt)
{
    hm_xf *t = make_xf(8, 12, 2, opt, 51), *u = NULL;
    uint8_t *buf = NULL, *buf2 = NULL;
    size_t len = 0, len2 = 0;
    train(t, 1, 3);
    cr_assert_eq(hm_xf_save(t, &buf, &len), 0);
    cr_assert(hm_xf_is_state(buf, len));
    cr_assert_eq(hm_xf_load(buf, len, hm_xf_config_of(t), &u), 0);
    cr_assert_eq(hm_xf_steps(u), 3u);
    cr_assert_eq(hm_xf_config_of(u)->heads, 2u);
    cr_assert_eq(hm_xf_save(u, &buf2, &len2), 0);
    cr_assert_eq(len2, len);
    cr_assert_eq(memcmp(buf, buf2, len), 0, "the state does not round-trip bit for bit");
    /* Both train on identically. */
    train(t, 2, 2);
    train(u, 2, 2);
    for (size_t i = 0; i < hm_xf_nparams(t); i++)
        cr_assert_eq(*hm_xf_param(t, i), *hm_xf_param(u, i), "parameter %zu", i);
    free(buf);
    free(buf2);
    hm_xf_free(t);
    hm_xf_free(u);
}

Test(xf_state, round_trip_is_bit_exact)
{
    check_round_trip(HM_FFN_ADAM);
    check_round_trip(HM_FFN_SGD);
}

Test(xf_state, malformed_and_mismatched_states_are_refused)
{
    hm_xf *t = make_xf(8, 12, 2, HM_FFN_ADAM, 61), *u = NULL;
    uint8_t *buf = NULL;
    size_t len = 0;
    cr_assert_eq(hm_xf_save(t, &buf, &len), 0);
    /* Truncated anywhere: malformed, never loaded. */
    for (size_t cut = 0; cut < len; cut += 1 + cut / 16) {
        int r = hm_xf_load(buf, cut, NULL, &u);
        cr_assert(r == -EBADMSG || r == -EINVAL, "cut at %zu: %d", cut, r);
        cr_assert_null(u);
    }
    /* Another shape: -EPROTO, the one error that is not corruption. */
    hm_xf_config want = *hm_xf_config_of(t);
    want.heads = 4;
    cr_assert_eq(hm_xf_load(buf, len, &want, &u), -EPROTO);
    want = *hm_xf_config_of(t);
    want.ffn.hidden = 16;
    cr_assert_eq(hm_xf_load(buf, len, &want, &u), -EPROTO);
    want = *hm_xf_config_of(t);
    want.ffn.optimizer = HM_FFN_SGD;
    cr_assert_eq(hm_xf_load(buf, len, &want, &u), -EPROTO);
    /* max_seq is a serving bound: expect's wins. */
    want = *hm_xf_config_of(t);
    want.max_seq = 9;
    cr_assert_eq(hm_xf_load(buf, len, &want, &u), 0);
    cr_assert_eq(hm_xf_config_of(u)->max_seq, 9u);
    hm_xf_free(u);
    u = NULL;
    /* An ffn's state is not a transformer's, and the other way round. */
    hm_ffn_config fc = {0};
    hm_ffn *f = NULL;
    uint8_t *fbuf = NULL;
    size_t flen = 0;
    fc.dim = 8;
    cr_assert_eq(hm_ffn_new(&fc, &f), 0);
    cr_assert_eq(hm_ffn_save(f, &fbuf, &flen), 0);
    cr_assert(!hm_xf_is_state(fbuf, flen));
    cr_assert_eq(hm_xf_load(fbuf, flen, NULL, &u), -EBADMSG);
    hm_ffn *g = NULL;
    cr_assert_eq(hm_ffn_load(buf, len, NULL, &g), -EBADMSG);
    cr_assert(!hm_xf_is_state((const uint8_t *)"junk", 4));
    /* A non-finite parameter inside: malformed. */
    size_t pos = 0;
    for (size_t i = 0; i + 4 < len; i++)
        if (memcmp(buf + i, "attn", 4) == 0 && buf[i + 4] == 0xc5) {
            pos = i + 4 + 3; /* a bin16 header */
            break;
        }
    cr_assert_neq(pos, 0u, "no attn vector in the state");
    const float inf = INFINITY;
    memcpy(buf + pos + 8, &inf, 4);
    cr_assert_eq(hm_xf_load(buf, len, NULL, &u), -EBADMSG);
    free(fbuf);
    hm_ffn_free(f);
    free(buf);
    hm_xf_free(t);
}

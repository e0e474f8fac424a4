/*
 * Tests for the feed-forward expert and for checkpoint files. The expert's
 * forward pass is compared with a naive double-precision reference written
 * here; its gradients with central finite differences of that reference;
 * SGD and Adam steps with updates computed by hand as torch.optim defines
 * them. Saved state must round-trip bit for bit and a reloaded expert must
 * train on exactly as the original; malformed state (truncated, mismatched,
 * lengths that disagree with the config) is refused. Checkpoint files must
 * survive corruption of the newest file by falling back to the previous one,
 * and report the documented errors when nothing usable is left.
 */
#include "config.h"

#include "moe/checkpoint.h"
#include "moe/ffn.h"
#include "src/base/util.h"
#include "src/base/wire.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- helpers ---- */

/* splitmix64: deterministic, so that a failure reproduces. */
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

static hm_ffn *make_ffn(size_t dim, size_t hidden, int opt, uint64_t seed)
{
    hm_ffn_config cfg = {.dim = dim, .hidden = hidden, .optimizer = opt, .seed = seed};
    hm_ffn *f = NULL;

    cr_assert_eq(hm_ffn_new(&cfg, &f), 0);
    return f;
}

/*
 * Fresh experts have gamma 1 and zero biases, which would hide mistakes in
 * those paths: give every parameter a non-trivial value.
 */
static void randomize_params(hm_ffn *f, struct rng *r)
{
    size_t d = hm_ffn_dim(f), h = hm_ffn_config_of(f)->hidden;
    float *p = hm_ffn_params(f);

    fill(r, p, d, 0.5, 1.5);                  /* gamma */
    fill(r, p + d, d, -0.3, 0.3);             /* beta */
    fill(r, p + 2 * d + h * d, h, -0.2, 0.2); /* b1 */
    fill(r, p + 2 * d + 2 * h * d + h, d, -0.2, 0.2); /* b2 */
}

/* ---- the double-precision reference ---- */

static double ref_gelu(double v)
{
    return 0.5 * v * (1.0 + tanh(sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
}

/* y = x + W2 gelu(W1 LN(x) + b1) + b2, row by row, in double, written for clarity. */
static void ref_forward(size_t d, size_t h, const double *p, const double *x, size_t batch,
                        double *y)
{
    const double *gamma = p, *beta = p + d, *w1 = p + 2 * d, *b1 = w1 + h * d, *w2 = b1 + h,
                 *b2 = w2 + d * h;
    double *a = xmalloc(d * sizeof(double)), *g = xmalloc(h * sizeof(double));

    for (size_t r = 0; r < batch; r++) {
        const double *xr = x + r * d;
        double mu = 0, var = 0;
        for (size_t j = 0; j < d; j++)
            mu += xr[j];
        mu /= (double)d;
        for (size_t j = 0; j < d; j++)
            var += (xr[j] - mu) * (xr[j] - mu);
        var /= (double)d;
        for (size_t j = 0; j < d; j++)
            a[j] = (xr[j] - mu) / sqrt(var + 1e-5) * gamma[j] + beta[j];
        for (size_t k = 0; k < h; k++) {
            double s = b1[k];
            for (size_t j = 0; j < d; j++)
                s += w1[k * d + j] * a[j];
            g[k] = ref_gelu(s);
        }
        for (size_t j = 0; j < d; j++) {
            double s = xr[j] + b2[j];
            for (size_t k = 0; k < h; k++)
                s += w2[j * h + k] * g[k];
            y[r * d + j] = s;
        }
    }
    free(a);
    free(g);
}

static double *to_double(const float *v, size_t n)
{
    double *o = xmalloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++)
        o[i] = v[i];
    return o;
}

/* L = sum(gy * y) of the reference. */
static double ref_loss(size_t d, size_t h, const double *p, const double *x, const double *gy,
                       size_t batch)
{
    double *y = xmalloc(batch * d * sizeof(double)), l = 0;

    ref_forward(d, h, p, x, batch, y);
    for (size_t i = 0; i < batch * d; i++)
        l += gy[i] * y[i];
    free(y);
    return l;
}

/* ---- construction ---- */

Test(ffn, config_defaults_and_validation)
{
    hm_ffn_config cfg = {.dim = 16};
    hm_ffn *f = NULL;

    cr_assert_eq(hm_ffn_new(&cfg, &f), 0);
    cr_assert_eq(hm_ffn_config_of(f)->hidden, 64);
    cr_assert_eq(hm_ffn_config_of(f)->optimizer, HM_FFN_SGD);
    cr_assert_eq(hm_ffn_config_of(f)->lr, 1e-2);
    cr_assert_eq(hm_ffn_nparams(f), 3 * 16 + 2 * 16 * 64 + 64);
    cr_assert_eq(hm_ffn_steps(f), 0);
    hm_ffn_free(f);

    cfg.optimizer = HM_FFN_ADAM;
    cr_assert_eq(hm_ffn_new(&cfg, &f), 0);
    cr_assert_eq(hm_ffn_config_of(f)->lr, 1e-3);
    cr_assert_eq(hm_ffn_config_of(f)->beta1, 0.9);
    cr_assert_eq(hm_ffn_config_of(f)->beta2, 0.999);
    cr_assert_eq(hm_ffn_config_of(f)->eps, 1e-8);
    hm_ffn_free(f);

    const hm_ffn_config bad[] = {
        {.dim = 0},
        {.dim = HM_FFN_MAX_DIM + 1},
        {.dim = 8, .hidden = HM_FFN_MAX_HIDDEN + 1},
        {.dim = 8, .optimizer = 2},
        {.dim = 8, .lr = -1},
        {.dim = 8, .lr = NAN},
        {.dim = 8, .momentum = 1.0},
        {.dim = 8, .optimizer = HM_FFN_ADAM, .beta2 = 1.0},
        {.dim = 8, .optimizer = HM_FFN_ADAM, .eps = -1e-8},
        {.dim = 8, .weight_decay = -0.1},
    };
    for (size_t i = 0; i < HM_ARRAY_LEN(bad); i++) {
        f = (hm_ffn *)1;
        cr_assert_eq(hm_ffn_new(&bad[i], &f), -EINVAL, "bad config %zu accepted", i);
        cr_assert_null(f);
    }
    cr_assert_eq(hm_ffn_new(NULL, &f), -EINVAL);
}

Test(ffn, init_is_deterministic_and_torch_like)
{
    hm_ffn *a = make_ffn(32, 48, HM_FFN_SGD, 7), *b = make_ffn(32, 48, HM_FFN_SGD, 7),
           *c = make_ffn(32, 48, HM_FFN_SGD, 8);
    size_t d = 32, h = 48, n = hm_ffn_nparams(a);
    const float *p = hm_ffn_params(a);

    cr_assert_eq(memcmp(hm_ffn_params(a), hm_ffn_params(b), n * sizeof(float)), 0);
    cr_assert_neq(memcmp(hm_ffn_params(a), hm_ffn_params(c), n * sizeof(float)), 0);
    for (size_t j = 0; j < d; j++) {
        cr_assert_eq(p[j], 1.0f);
        cr_assert_eq(p[d + j], 0.0f);
        cr_assert_eq(p[2 * d + 2 * h * d + h + j], 0.0f);
    }
    double maxw1 = 0, maxw2 = 0;
    for (size_t i = 0; i < h * d; i++) {
        maxw1 = fmax(maxw1, fabs(p[2 * d + i]));
        maxw2 = fmax(maxw2, fabs(p[2 * d + h * d + h + i]));
    }
    cr_assert(maxw1 <= 1 / sqrt(32.0) && maxw1 > 0.9 / sqrt(32.0), "W1 bound %g", maxw1);
    cr_assert(maxw2 <= 1 / sqrt(48.0) && maxw2 > 0.9 / sqrt(48.0), "W2 bound %g", maxw2);
    for (size_t k = 0; k < h; k++)
        cr_assert_eq(p[2 * d + h * d + k], 0.0f);
    hm_ffn_free(a);
    hm_ffn_free(b);
    hm_ffn_free(c);
}

/* ---- forward ---- */

Test(ffn, forward_matches_double_reference)
{
    static const size_t shapes[][3] = {
        /* dim, hidden (0: 4*dim), batch */
        {8, 0, 1}, {16, 24, 7}, {33, 50, 5}, {64, 256, 64}, {128, 100, 3}, {1, 3, 4},
    };
    struct rng r = {42};

    for (size_t s = 0; s < HM_ARRAY_LEN(shapes); s++) {
        size_t d = shapes[s][0], batch = shapes[s][2];
        hm_ffn *f = make_ffn(d, shapes[s][1], HM_FFN_SGD, s + 1);
        size_t h = hm_ffn_config_of(f)->hidden, n = hm_ffn_nparams(f);
        float *x = xmalloc(batch * d * sizeof(float)), *y = xmalloc(batch * d * sizeof(float));
        double *yref = xmalloc(batch * d * sizeof(double)), *pd, *xd;
        double maxerr = 0, maxref = 0;

        randomize_params(f, &r);
        for (size_t i = 0; i < batch * d; i++)
            x[i] = (float)(rng_range(&r, -2, 2) + 0.5 * (double)(i % d) / (double)d);
        cr_assert_eq(hm_ffn_forward(f, x, batch, y), 0);
        pd = to_double(hm_ffn_params(f), n);
        xd = to_double(x, batch * d);
        ref_forward(d, h, pd, xd, batch, yref);
        for (size_t i = 0; i < batch * d; i++) {
            maxerr = fmax(maxerr, fabs(y[i] - yref[i]));
            maxref = fmax(maxref, fabs(yref[i]));
        }
        cr_assert(maxerr <= 1e-5 * maxref, "shape %zu (d=%zu h=%zu b=%zu): error %g of %g", s, d,
                  h, batch, maxerr, maxref);
        free(x);
        free(y);
        free(yref);
        free(pd);
        free(xd);
        hm_ffn_free(f);
    }
}

Test(ffn, forward_rows_are_independent)
{
    /* A row's output must not depend on the rest of the batch (no cross-row leaks in LN). */
    struct rng r = {5};
    hm_ffn *f = make_ffn(24, 40, HM_FFN_SGD, 3);
    float x[6 * 24], y[6 * 24], y1[24];

    randomize_params(f, &r);
    fill(&r, x, 6 * 24, -1, 1);
    cr_assert_eq(hm_ffn_forward(f, x, 6, y), 0);
    for (size_t row = 0; row < 6; row++) {
        cr_assert_eq(hm_ffn_forward(f, x + row * 24, 1, y1), 0);
        for (size_t j = 0; j < 24; j++)
            cr_assert_float_eq(y1[j], y[row * 24 + j], 1e-5);
    }
    hm_ffn_free(f);
}

/* ---- gradients ---- */

/* |a - ref| within 1e-3 of |ref|, with a floor relative to the vector's scale for near-zero entries. */
static void assert_close_vec(const char *what, const float *a, const double *ref, size_t n)
{
    double scale = 0;

    for (size_t i = 0; i < n; i++)
        scale = fmax(scale, fabs(ref[i]));
    for (size_t i = 0; i < n; i++) {
        double tol = 1e-3 * fmax(fabs(ref[i]), 1e-2 * scale);
        cr_assert(fabs(a[i] - ref[i]) <= tol, "%s[%zu]: %.9g vs finite difference %.9g", what, i,
                  (double)a[i], ref[i]);
    }
}

static void check_grad(size_t d, size_t h, size_t batch, uint64_t seed)
{
    struct rng r = {seed};
    hm_ffn *f = make_ffn(d, h, HM_FFN_SGD, seed);
    size_t n = hm_ffn_nparams(f), nx = batch * d;

    h = hm_ffn_config_of(f)->hidden; /* 0 asked for the default */
    float *x = xmalloc(nx * sizeof(float)), *gy = xmalloc(nx * sizeof(float));
    float *gx = xmalloc(nx * sizeof(float)), *gp = xmalloc(n * sizeof(float));
    double *pd, *xd, *gyd, *num_x = xmalloc(nx * sizeof(double)),
                          *num_p = xmalloc(n * sizeof(double));
    const double step = 1e-4;

    randomize_params(f, &r);
    fill(&r, x, nx, -2, 2);
    fill(&r, gy, nx, -1, 1);
    cr_assert_eq(hm_ffn_grad(f, x, gy, batch, gx, gp), 0);

    pd = to_double(hm_ffn_params(f), n);
    xd = to_double(x, nx);
    gyd = to_double(gy, nx);
    for (size_t i = 0; i < nx; i++) {
        double keep = xd[i], lp, lm;
        xd[i] = keep + step;
        lp = ref_loss(d, h, pd, xd, gyd, batch);
        xd[i] = keep - step;
        lm = ref_loss(d, h, pd, xd, gyd, batch);
        xd[i] = keep;
        num_x[i] = (lp - lm) / (2 * step);
    }
    for (size_t i = 0; i < n; i++) {
        double keep = pd[i], lp, lm;
        pd[i] = keep + step;
        lp = ref_loss(d, h, pd, xd, gyd, batch);
        pd[i] = keep - step;
        lm = ref_loss(d, h, pd, xd, gyd, batch);
        pd[i] = keep;
        num_p[i] = (lp - lm) / (2 * step);
    }
    assert_close_vec("dL/dx", gx, num_x, nx);
    /* Each parameter block separately, so that a small block is not judged by a large one's scale. */
    size_t off[] = {0, d, 2 * d, 2 * d + h * d, 2 * d + h * d + h, 2 * d + 2 * h * d + h, n};
    const char *names[] = {"gamma", "beta", "W1", "b1", "W2", "b2"};
    for (size_t b = 0; b < 6; b++)
        assert_close_vec(names[b], gp + off[b], num_p + off[b], off[b + 1] - off[b]);

    /* Without grad_params, dL/dx is the same. */
    float *gx2 = xmalloc(nx * sizeof(float));
    cr_assert_eq(hm_ffn_grad(f, x, gy, batch, gx2, NULL), 0);
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
    hm_ffn_free(f);
}

Test(ffn, grad_matches_finite_differences)
{
    check_grad(6, 10, 3, 11);
    check_grad(5, 0, 1, 12);
    check_grad(1, 3, 2, 13); /* dim 1: LN output is beta alone, dL/dx is the residual */
}

/* ---- optimizers ---- */

/* Applies three fixed gradients and compares with the update written out in double. */
static void check_optimizer(const hm_ffn_config *cfg)
{
    struct rng r = {99};
    hm_ffn *f = NULL;
    size_t n;
    double *p, *m, *v;

    cr_assert_eq(hm_ffn_new(cfg, &f), 0);
    const hm_ffn_config *c = hm_ffn_config_of(f);
    n = hm_ffn_nparams(f);
    p = to_double(hm_ffn_params(f), n);
    m = calloc(n, sizeof(double));
    v = calloc(n, sizeof(double));
    float *g = xmalloc(n * sizeof(float));
    for (int t = 1; t <= 4; t++) {
        fill(&r, g, n, -1, 1);
        cr_assert_eq(hm_ffn_apply(f, g), 0);
        for (size_t i = 0; i < n; i++) {
            p[i] *= 1 - c->lr * c->weight_decay;
            if (c->optimizer == HM_FFN_SGD) {
                if (c->momentum != 0) {
                    /* torch: the buffer starts as the first gradient. */
                    m[i] = t == 1 ? g[i] : c->momentum * m[i] + g[i];
                    p[i] -= c->lr * m[i];
                } else {
                    p[i] -= c->lr * g[i];
                }
            } else {
                m[i] = c->beta1 * m[i] + (1 - c->beta1) * g[i];
                v[i] = c->beta2 * v[i] + (1 - c->beta2) * g[i] * g[i];
                double bc1 = 1 - pow(c->beta1, t), bc2 = 1 - pow(c->beta2, t);
                p[i] -= c->lr / bc1 * m[i] / (sqrt(v[i]) / sqrt(bc2) + c->eps);
            }
        }
        cr_assert_eq(hm_ffn_steps(f), (uint64_t)t);
        for (size_t i = 0; i < n; i++)
            cr_assert(fabs(hm_ffn_params(f)[i] - p[i]) <= 1e-6 + 1e-5 * fabs(p[i]),
                      "step %d param %zu: %.9g vs %.9g", t, i, (double)hm_ffn_params(f)[i], p[i]);
    }
    free(g);
    free(p);
    free(m);
    free(v);
    hm_ffn_free(f);
}

Test(ffn, sgd_steps_match_torch)
{
    check_optimizer(&(hm_ffn_config){.dim = 4, .hidden = 6, .optimizer = HM_FFN_SGD, .lr = 0.1});
    check_optimizer(&(hm_ffn_config){
        .dim = 4, .hidden = 6, .optimizer = HM_FFN_SGD, .lr = 0.05, .momentum = 0.9});
    check_optimizer(&(hm_ffn_config){
        .dim = 3, .hidden = 5, .optimizer = HM_FFN_SGD, .momentum = 0.5, .weight_decay = 0.1});
}

Test(ffn, adam_steps_match_torch)
{
    check_optimizer(&(hm_ffn_config){.dim = 4, .hidden = 6, .optimizer = HM_FFN_ADAM});
    check_optimizer(&(hm_ffn_config){.dim = 4,
                                     .hidden = 6,
                                     .optimizer = HM_FFN_ADAM,
                                     .lr = 0.01,
                                     .beta1 = 0.8,
                                     .beta2 = 0.99,
                                     .eps = 1e-6,
                                     .weight_decay = 0.01});
}

Test(ffn, backward_is_grad_then_apply)
{
    struct rng r = {3};
    hm_ffn *a = make_ffn(16, 40, HM_FFN_ADAM, 5), *b = make_ffn(16, 40, HM_FFN_ADAM, 5);
    size_t n = hm_ffn_nparams(a), batch = 9, nx = batch * 16;
    float *x = xmalloc(nx * sizeof(float)), *gy = xmalloc(nx * sizeof(float));
    float *gxa = xmalloc(nx * sizeof(float)), *gxb = xmalloc(nx * sizeof(float));
    float *gp = xmalloc(n * sizeof(float));

    for (int step = 0; step < 3; step++) {
        fill(&r, x, nx, -1, 1);
        fill(&r, gy, nx, -1, 1);
        cr_assert_eq(hm_ffn_backward(a, x, gy, batch, gxa), 0);
        cr_assert_eq(hm_ffn_grad(b, x, gy, batch, gxb, gp), 0);
        cr_assert_eq(hm_ffn_apply(b, gp), 0);
        cr_assert_eq(memcmp(gxa, gxb, nx * sizeof(float)), 0);
        cr_assert_eq(memcmp(hm_ffn_params(a), hm_ffn_params(b), n * sizeof(float)), 0);
    }
    cr_assert_eq(hm_ffn_steps(a), 3);

    /* Training lowers a simple loss: L = 0.5 * |y|^2, so dL/dy = y. */
    float *y = xmalloc(nx * sizeof(float));
    double first = -1, last = 0;
    fill(&r, x, nx, -1, 1);
    for (int step = 0; step < 30; step++) {
        double l = 0;
        cr_assert_eq(hm_ffn_forward(a, x, batch, y), 0);
        for (size_t i = 0; i < nx; i++)
            l += 0.5 * y[i] * y[i];
        if (first < 0)
            first = l;
        last = l;
        cr_assert_eq(hm_ffn_backward(a, x, y, batch, gxa), 0);
    }
    cr_assert(last < 0.9 * first, "loss %g -> %g", first, last);
    free(y);
    free(x);
    free(gy);
    free(gxa);
    free(gxb);
    free(gp);
    hm_ffn_free(a);
    hm_ffn_free(b);
}

Test(ffn, non_finite_input_is_refused_and_nothing_steps)
{
    hm_ffn *f = make_ffn(8, 16, HM_FFN_ADAM, 1);
    size_t n = hm_ffn_nparams(f);
    float *before = xmalloc(n * sizeof(float)), *gp = xmalloc(n * sizeof(float));
    float x[2 * 8], gy[2 * 8], gx[2 * 8], y[2 * 8];
    const float bad[] = {NAN, INFINITY, -INFINITY};

    memcpy(before, hm_ffn_params(f), n * sizeof(float));
    for (size_t k = 0; k < HM_ARRAY_LEN(bad); k++) {
        for (size_t i = 0; i < 16; i++)
            x[i] = gy[i] = 0.1f * (float)i;
        x[11] = bad[k];
        cr_assert_eq(hm_ffn_forward(f, x, 2, y), -EDOM);
        cr_assert_eq(hm_ffn_grad(f, x, gy, 2, gx, gp), -EDOM);
        cr_assert_eq(hm_ffn_backward(f, x, gy, 2, gx), -EDOM);
        x[11] = 0;
        gy[3] = bad[k];
        cr_assert_eq(hm_ffn_backward(f, x, gy, 2, gx), -EDOM);
        memset(gp, 0, n * sizeof(float));
        gp[n / 2] = bad[k];
        cr_assert_eq(hm_ffn_apply(f, gp), -EDOM);
    }
    cr_assert_eq(memcmp(before, hm_ffn_params(f), n * sizeof(float)), 0);
    cr_assert_eq(hm_ffn_steps(f), 0);
    /* Bad arguments. */
    cr_assert_eq(hm_ffn_forward(f, x, 0, y), -EINVAL);
    cr_assert_eq(hm_ffn_backward(f, x, gy, 0, gx), -EINVAL);
    cr_assert_eq(hm_ffn_forward(f, NULL, 1, y), -EINVAL);
    cr_assert_eq(hm_ffn_grad(f, x, NULL, 1, gx, NULL), -EINVAL);
    free(before);
    free(gp);
    hm_ffn_free(f);
}

/*
 * A finite but huge dL/dy passes the finiteness check on the inputs, yet
 * would overflow Adam's second moment to +inf: the expert would then stop
 * learning and its checkpoint could not be loaded. Such a step is refused
 * whole, and honest steps afterwards still train and save.
 */
Test(ffn, overflowing_step_is_refused_and_nothing_steps)
{
    hm_ffn *f = make_ffn(16, 0, HM_FFN_ADAM, 1), *g = NULL;
    size_t n = hm_ffn_nparams(f);
    float *before = xmalloc(n * sizeof(float)), *gp = xmalloc(n * sizeof(float));
    float x[16], gy[16], gx[16];
    uint8_t *buf;
    size_t len, changed = 0;

    for (int i = 0; i < 16; i++) {
        x[i] = (float)i / 8 - 1;
        gy[i] = 1e25f;
    }
    memcpy(before, hm_ffn_params(f), n * sizeof(float));
    cr_assert_eq(hm_ffn_backward(f, x, gy, 1, gx), -EDOM);
    cr_assert_eq(hm_ffn_steps(f), 0);
    cr_assert_eq(memcmp(before, hm_ffn_params(f), n * sizeof(float)), 0);
    /* The moments were not touched either: the saved state still loads. */
    cr_assert_eq(hm_ffn_save(f, &buf, &len), 0);
    cr_assert_eq(hm_ffn_load(buf, len, NULL, &g), 0);
    hm_ffn_free(g);
    free(buf);
    for (int i = 0; i < 16; i++)
        gy[i] = 0.5f;
    for (int s = 0; s < 20; s++)
        cr_assert_eq(hm_ffn_backward(f, x, gy, 1, gx), 0);
    for (size_t i = 0; i < n; i++)
        changed += before[i] != hm_ffn_params(f)[i];
    cr_assert_gt(changed, n / 2, "only %zu of %zu parameters learned", changed, n);
    cr_assert_eq(hm_ffn_save(f, &buf, &len), 0);
    cr_assert_eq(hm_ffn_load(buf, len, NULL, &g), 0);
    cr_assert_eq(hm_ffn_steps(g), 20);
    hm_ffn_free(g);
    free(buf);
    /* The same through hm_ffn_apply, with one huge entry among small ones. */
    memset(gp, 0, n * sizeof(float));
    gp[n - 1] = 3e30f;
    memcpy(before, hm_ffn_params(f), n * sizeof(float));
    cr_assert_eq(hm_ffn_apply(f, gp), -EDOM);
    cr_assert_eq(memcmp(before, hm_ffn_params(f), n * sizeof(float)), 0);
    cr_assert_eq(hm_ffn_steps(f), 20);
    free(before);
    free(gp);
    hm_ffn_free(f);
}

/* SGD: a momentum buffer or a parameter that would overflow refuses the step too. */
Test(ffn, sgd_overflow_is_refused)
{
    hm_ffn_config mc = {.dim = 4, .hidden = 8, .optimizer = HM_FFN_SGD, .momentum = 0.9, .seed = 3};
    hm_ffn_config pc = {.dim = 4, .hidden = 8, .optimizer = HM_FFN_SGD, .lr = 100, .seed = 3};
    hm_ffn *m = NULL, *p = NULL, *g = NULL;
    uint8_t *buf;
    size_t len;

    cr_assert_eq(hm_ffn_new(&mc, &m), 0);
    cr_assert_eq(hm_ffn_new(&pc, &p), 0);
    size_t n = hm_ffn_nparams(m);
    float *gp = xmalloc(n * sizeof(float)), *before = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        gp[i] = 0.01f;
    gp[0] = 3e38f;
    /* The first step fits (buffer = g), the second would push 0.9 * 3e38 + 3e38 past FLT_MAX. */
    cr_assert_eq(hm_ffn_apply(m, gp), 0);
    memcpy(before, hm_ffn_params(m), n * sizeof(float));
    cr_assert_eq(hm_ffn_apply(m, gp), -EDOM);
    cr_assert_eq(hm_ffn_steps(m), 1);
    cr_assert_eq(memcmp(before, hm_ffn_params(m), n * sizeof(float)), 0);
    cr_assert_eq(hm_ffn_save(m, &buf, &len), 0);
    cr_assert_eq(hm_ffn_load(buf, len, NULL, &g), 0);
    hm_ffn_free(g);
    free(buf);
    /* Without momentum: lr * g itself overflows the parameter. */
    memcpy(before, hm_ffn_params(p), n * sizeof(float));
    cr_assert_eq(hm_ffn_apply(p, gp), -EDOM);
    cr_assert_eq(hm_ffn_steps(p), 0);
    cr_assert_eq(memcmp(before, hm_ffn_params(p), n * sizeof(float)), 0);
    free(gp);
    free(before);
    hm_ffn_free(m);
    hm_ffn_free(p);
}

/* ---- saved state ---- */

static void train_a_little(hm_ffn *f, uint64_t seed, int steps)
{
    struct rng r = {seed};
    size_t d = hm_ffn_dim(f), batch = 4;
    float *x = xmalloc(batch * d * sizeof(float)), *gy = xmalloc(batch * d * sizeof(float)),
          *gx = xmalloc(batch * d * sizeof(float));

    for (int s = 0; s < steps; s++) {
        fill(&r, x, batch * d, -1, 1);
        fill(&r, gy, batch * d, -1, 1);
        cr_assert_eq(hm_ffn_backward(f, x, gy, batch, gx), 0);
    }
    free(x);
    free(gy);
    free(gx);
}

static void assert_same_config(const hm_ffn_config *a, const hm_ffn_config *b)
{
    cr_assert_eq(a->dim, b->dim);
    cr_assert_eq(a->hidden, b->hidden);
    cr_assert_eq(a->optimizer, b->optimizer);
    cr_assert_eq(a->lr, b->lr);
    cr_assert_eq(a->momentum, b->momentum);
    cr_assert_eq(a->beta1, b->beta1);
    cr_assert_eq(a->beta2, b->beta2);
    cr_assert_eq(a->eps, b->eps);
    cr_assert_eq(a->weight_decay, b->weight_decay);
    cr_assert_eq(a->seed, b->seed);
}

static void check_round_trip(const hm_ffn_config *cfg)
{
    hm_ffn *f = NULL, *g = NULL;
    uint8_t *s1 = NULL, *s2 = NULL;
    size_t l1, l2, n;

    cr_assert_eq(hm_ffn_new(cfg, &f), 0);
    train_a_little(f, 1, 3);
    n = hm_ffn_nparams(f);
    cr_assert_eq(hm_ffn_save(f, &s1, &l1), 0);
    cr_assert_eq(hm_ffn_load(s1, l1, cfg, &g), 0);
    cr_assert_eq(hm_ffn_steps(g), 3);
    cr_assert_eq(memcmp(hm_ffn_params(f), hm_ffn_params(g), n * sizeof(float)), 0);
    assert_same_config(hm_ffn_config_of(f), hm_ffn_config_of(g));
    /* The moments are only visible through the saved bytes: they must match exactly. */
    cr_assert_eq(hm_ffn_save(g, &s2, &l2), 0);
    cr_assert_eq(l1, l2);
    cr_assert_eq(memcmp(s1, s2, l1), 0);
    /* A reloaded expert trains on exactly as the original would have. */
    train_a_little(f, 2, 3);
    train_a_little(g, 2, 3);
    cr_assert_eq(memcmp(hm_ffn_params(f), hm_ffn_params(g), n * sizeof(float)), 0);
    cr_assert_eq(hm_ffn_steps(g), 6);
    free(s1);
    free(s2);
    hm_ffn_free(f);
    hm_ffn_free(g);
}

Test(ffn_state, round_trip_is_bit_exact)
{
    check_round_trip(&(hm_ffn_config){.dim = 6, .hidden = 10, .optimizer = HM_FFN_ADAM, .seed = 4});
    check_round_trip(
        &(hm_ffn_config){.dim = 5, .optimizer = HM_FFN_SGD, .momentum = 0.9, .seed = 5});
    check_round_trip(&(hm_ffn_config){.dim = 7, .hidden = 3, .optimizer = HM_FFN_SGD, .lr = 0.3});
}

Test(ffn_state, params_are_little_endian_float32)
{
    /* The format promises raw little-endian float32: find the params bin and read it back. */
    hm_ffn *f = make_ffn(3, 4, HM_FFN_SGD, 9);
    uint8_t *s;
    size_t len;
    msgpack_zone zone;
    msgpack_object root;
    const uint8_t *bin;
    uint32_t blen;
    hm_wire_limits lim = {.max_size = 1 << 20, .max_depth = 4, .max_elements = 100};

    cr_assert_eq(hm_ffn_save(f, &s, &len), 0);
    msgpack_zone_init(&zone, 1024);
    cr_assert_eq(hm_wire_unpack(s, len, &lim, &zone, &root), 0);
    cr_assert_eq(hm_wire_get_bin(hm_wire_map_get(&root, "params"), &bin, &blen), 0);
    cr_assert_eq(blen, hm_ffn_nparams(f) * 4);
    for (size_t i = 0; i < hm_ffn_nparams(f); i++) {
        uint32_t u = (uint32_t)bin[4 * i] | (uint32_t)bin[4 * i + 1] << 8 |
                     (uint32_t)bin[4 * i + 2] << 16 | (uint32_t)bin[4 * i + 3] << 24;
        float v;
        memcpy(&v, &u, 4);
        cr_assert_eq(v, hm_ffn_params(f)[i]);
    }
    msgpack_zone_destroy(&zone);
    free(s);
    hm_ffn_free(f);
}

Test(ffn_state, truncation_at_every_offset_is_refused)
{
    hm_ffn *f = make_ffn(4, 6, HM_FFN_ADAM, 2), *g = NULL;
    uint8_t *s;
    size_t len;

    train_a_little(f, 3, 1);
    cr_assert_eq(hm_ffn_save(f, &s, &len), 0);
    for (size_t cut = 0; cut < len; cut++) {
        /* A copy of exactly cut bytes, so that the sanitizer sees any read past it. */
        uint8_t *t = xmalloc(cut);
        memcpy(t, s, cut);
        int rc = hm_ffn_load(t, cut, NULL, &g);
        cr_assert_eq(rc, -EBADMSG, "cut %zu of %zu: %d", cut, len, rc);
        cr_assert_null(g);
        free(t);
    }
    /* Trailing bytes are refused too. */
    uint8_t *t = xmalloc(len + 1);
    memcpy(t, s, len);
    t[len] = 0xc0;
    cr_assert_eq(hm_ffn_load(t, len + 1, NULL, &g), -EBADMSG);
    free(t);
    free(s);
    hm_ffn_free(f);
}

Test(ffn_state, mismatched_expect_is_refused)
{
    hm_ffn *f = make_ffn(4, 6, HM_FFN_ADAM, 2), *g = NULL;
    uint8_t *s;
    size_t len;

    cr_assert_eq(hm_ffn_save(f, &s, &len), 0);
    cr_assert_eq(hm_ffn_load(s, len, &(hm_ffn_config){.dim = 5, .hidden = 6, .optimizer = 1}, &g),
                 -EPROTO);
    cr_assert_eq(hm_ffn_load(s, len, &(hm_ffn_config){.dim = 4, .optimizer = 1}, &g), -EPROTO);
    cr_assert_eq(hm_ffn_load(s, len, &(hm_ffn_config){.dim = 4, .hidden = 6, .optimizer = 0}, &g),
                 -EPROTO);
    cr_assert_null(g);
    /* Only shape and optimizer are compared: another learning rate is fine. */
    cr_assert_eq(
        hm_ffn_load(s, len, &(hm_ffn_config){.dim = 4, .hidden = 6, .optimizer = 1, .lr = 5}, &g),
        0);
    cr_assert_eq(hm_ffn_config_of(g)->lr, 1e-3);
    hm_ffn_free(g);
    free(s);
    hm_ffn_free(f);
}

/* What build_state changes from a valid state. */
enum variant {
    V_VALID,
    V_PARAMS_SHORT,
    V_PARAMS_LONG,
    V_M1_MISSING,
    V_M2_SHORT,
    V_DIM_DISAGREES,
    V_HIDDEN_DISAGREES,
    V_DIM_OVER_CAP,
    V_HIDDEN_OVER_CAP,
    V_VERSION,
    V_NAN_PARAM,
    V_NEG_SECOND_MOMENT,
    V_BAD_LR,
    V_BAD_OPT,
    V_PARAMS_NOT_BIN,
    V_NOT_MAP,
    V_COUNT
};

/* A hand-written Adam state for dim 2, hidden 3 (nparams 21), changed as v says. */
static uint8_t *build_state(enum variant v, size_t *len_out)
{
    const size_t np = 3 * 2 + 2 * 2 * 3 + 3;
    float vec[64];
    hm_wire_wr w;
    uint8_t *out;

    for (size_t i = 0; i < 64; i++)
        vec[i] = 0.25f; /* little-endian hosts only, which the test machines are */
    hm_wire_wr_init_dynamic(&w, 1 << 16);
    if (v == V_NOT_MAP) {
        hm_wire_wr_array(&w, 1);
        hm_wire_wr_uint(&w, 1);
        goto done;
    }
    hm_wire_wr_map(&w, 15);
    hm_wire_wr_cstr(&w, "version");
    hm_wire_wr_uint(&w, v == V_VERSION ? 2 : 1);
    hm_wire_wr_cstr(&w, "dim");
    hm_wire_wr_uint(&w, v == V_DIM_DISAGREES ? 3 : v == V_DIM_OVER_CAP ? HM_FFN_MAX_DIM + 1 : 2);
    hm_wire_wr_cstr(&w, "hidden");
    hm_wire_wr_uint(&w, v == V_HIDDEN_DISAGREES  ? 4
                        : v == V_HIDDEN_OVER_CAP ? HM_FFN_MAX_HIDDEN + 1
                                                 : 3);
    hm_wire_wr_cstr(&w, "optimizer");
    hm_wire_wr_uint(&w, v == V_BAD_OPT ? 7 : HM_FFN_ADAM);
    hm_wire_wr_cstr(&w, "lr");
    hm_wire_wr_double(&w, v == V_BAD_LR ? -1.0 : 1e-3);
    hm_wire_wr_cstr(&w, "momentum");
    hm_wire_wr_double(&w, 0);
    hm_wire_wr_cstr(&w, "beta1");
    hm_wire_wr_double(&w, 0.9);
    hm_wire_wr_cstr(&w, "beta2");
    hm_wire_wr_double(&w, 0.999);
    hm_wire_wr_cstr(&w, "eps");
    hm_wire_wr_double(&w, 1e-8);
    hm_wire_wr_cstr(&w, "weight_decay");
    hm_wire_wr_double(&w, 0);
    hm_wire_wr_cstr(&w, "seed");
    hm_wire_wr_uint(&w, 1);
    hm_wire_wr_cstr(&w, "steps");
    hm_wire_wr_uint(&w, 12);
    hm_wire_wr_cstr(&w, "params");
    if (v == V_PARAMS_NOT_BIN) {
        hm_wire_wr_str(&w, (const char *)vec, np * 4);
    } else {
        float p[64];
        memcpy(p, vec, sizeof(p));
        if (v == V_NAN_PARAM)
            p[5] = NAN;
        hm_wire_wr_bin(&w, p,
                       (np + (v == V_PARAMS_LONG ? 1 : 0) - (v == V_PARAMS_SHORT ? 1 : 0)) * 4);
    }
    hm_wire_wr_cstr(&w, v == V_M1_MISSING ? "m9" : "m1");
    hm_wire_wr_bin(&w, vec, np * 4);
    hm_wire_wr_cstr(&w, "m2");
    {
        float m2[64];
        memcpy(m2, vec, sizeof(m2));
        if (v == V_NEG_SECOND_MOMENT)
            m2[0] = -1;
        hm_wire_wr_bin(&w, m2, (np - (v == V_M2_SHORT ? 1 : 0)) * 4);
    }
done:
    out = hm_wire_wr_steal(&w, len_out);
    cr_assert_not_null(out);
    return out;
}

Test(ffn_state, lengths_and_fields_that_disagree_are_refused)
{
    hm_ffn *g = NULL;
    size_t len;
    uint8_t *s = build_state(V_VALID, &len);

    /* The hand-written state is accepted, so each variant below fails for its own reason. */
    cr_assert_eq(hm_ffn_load(s, len, NULL, &g), 0);
    cr_assert_eq(hm_ffn_steps(g), 12);
    cr_assert_eq(hm_ffn_nparams(g), 21);
    cr_assert_eq(hm_ffn_params(g)[20], 0.25f);
    hm_ffn_free(g);
    free(s);
    for (int v = V_VALID + 1; v < V_COUNT; v++) {
        s = build_state((enum variant)v, &len);
        g = NULL;
        int rc = hm_ffn_load(s, len, NULL, &g);
        /* Malformed content is -EBADMSG, never the shape mismatch's -EPROTO. */
        cr_assert_eq(rc, -EBADMSG, "variant %d: %d", v, rc);
        cr_assert_null(g);
        free(s);
    }
    cr_assert_eq(hm_ffn_load((const uint8_t *)"", 0, NULL, &g), -EBADMSG);
    /* A malformed state is -EBADMSG even when an expected shape is given. */
    s = build_state(V_NAN_PARAM, &len);
    cr_assert_eq(hm_ffn_load(s, len, &(hm_ffn_config){.dim = 2, .hidden = 3, .optimizer = 1}, &g),
                 -EBADMSG);
    free(s);
    cr_assert_eq(hm_ffn_load(NULL, 0, NULL, &g), -EINVAL);
}

/* ---- checkpoint files ---- */

struct tmpdir {
    char dir[64];
    char path[128];
};

static void tmpdir_make(struct tmpdir *t)
{
    strcpy(t->dir, "/tmp/hm-ckpt-XXXXXX");
    cr_assert_not_null(mkdtemp(t->dir));
    snprintf(t->path, sizeof(t->path), "%s/expert.ckpt", t->dir);
}

static void tmpdir_remove(struct tmpdir *t)
{
    const char *suffix[] = {"", ".prev", ".tmp"};
    char p[160];

    for (size_t i = 0; i < HM_ARRAY_LEN(suffix); i++) {
        snprintf(p, sizeof(p), "%s%s", t->path, suffix[i]);
        unlink(p);
    }
    rmdir(t->dir);
}

static void write_file(const char *path, const void *data, size_t len)
{
    FILE *fp = fopen(path, "wb");
    cr_assert_not_null(fp);
    cr_assert_eq(fwrite(data, 1, len, fp), len);
    cr_assert_eq(fclose(fp), 0);
}

static void flip_byte(const char *path, off_t off)
{
    int fd = open(path, O_RDWR);
    uint8_t b;
    cr_assert_geq(fd, 0);
    cr_assert_eq(pread(fd, &b, 1, off), 1);
    b ^= 0x40;
    cr_assert_eq(pwrite(fd, &b, 1, off), 1);
    close(fd);
}

static void expect_read(const char *path, const char *want, int want_prev)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    int used_prev = -1;

    cr_assert_eq(hm_ckpt_read(path, 1 << 20, &buf, &len, &used_prev), 0);
    cr_assert_eq(len, strlen(want));
    cr_assert_eq(memcmp(buf, want, len), 0);
    cr_assert_eq(used_prev, want_prev);
    free(buf);
}

Test(ckpt, write_read_round_trip_and_rotation)
{
    struct tmpdir t;
    char prev[160];
    struct stat st;

    tmpdir_make(&t);
    snprintf(prev, sizeof(prev), "%s.prev", t.path);
    cr_assert_eq(hm_ckpt_write(t.path, "first", 5), 0);
    expect_read(t.path, "first", 0);
    cr_assert_eq(stat(t.path, &st), 0);
    cr_assert_eq(st.st_size, HM_CKPT_HEADER_BYTES + 5);
    cr_assert_eq(st.st_mode & 077, 0, "checkpoint readable by others");
    cr_assert_eq(hm_ckpt_write(t.path, "second", 6), 0);
    expect_read(t.path, "second", 0);
    expect_read(prev, "first", 0);
    /* An empty payload is a valid checkpoint. */
    cr_assert_eq(hm_ckpt_write(t.path, NULL, 0), 0);
    expect_read(t.path, "", 0);
    tmpdir_remove(&t);
}

Test(ckpt, corrupt_newest_falls_back_to_prev)
{
    struct tmpdir t;

    tmpdir_make(&t);
    cr_assert_eq(hm_ckpt_write(t.path, "older state", 11), 0);
    cr_assert_eq(hm_ckpt_write(t.path, "newer state", 11), 0);
    /* A flipped byte anywhere (magic, version, length, hash, payload) is caught. */
    const off_t offs[] = {0, 5, 12, 20, 47, 48, 58};
    for (size_t i = 0; i < HM_ARRAY_LEN(offs); i++) {
        flip_byte(t.path, offs[i]);
        expect_read(t.path, "older state", 1);
        flip_byte(t.path, offs[i]);
        expect_read(t.path, "newer state", 0);
    }
    /* Truncated, at the header and in the payload. */
    cr_assert_eq(truncate(t.path, 50), 0);
    expect_read(t.path, "older state", 1);
    cr_assert_eq(truncate(t.path, 20), 0);
    expect_read(t.path, "older state", 1);
    cr_assert_eq(truncate(t.path, 0), 0);
    expect_read(t.path, "older state", 1);
    /* A crash between the two renames leaves only PATH.prev. */
    cr_assert_eq(unlink(t.path), 0);
    expect_read(t.path, "older state", 1);
    tmpdir_remove(&t);
}

Test(ckpt, broken_newest_does_not_displace_prev)
{
    struct tmpdir t;

    tmpdir_make(&t);
    cr_assert_eq(hm_ckpt_write(t.path, "A", 1), 0);
    cr_assert_eq(hm_ckpt_write(t.path, "B", 1), 0);
    /* PATH is cut short; the next write must keep the good PATH.prev ("A"). */
    cr_assert_eq(truncate(t.path, 30), 0);
    cr_assert_eq(hm_ckpt_write(t.path, "C", 1), 0);
    expect_read(t.path, "C", 0);
    flip_byte(t.path, 48);
    expect_read(t.path, "A", 1);
    tmpdir_remove(&t);
}

/* A PATH whose header and size are right but whose payload does not hash is not rotated either. */
Test(ckpt, bad_hash_newest_does_not_displace_prev)
{
    struct tmpdir t;
    char prev[160];
    uint8_t *buf = NULL;
    size_t len = 0;

    tmpdir_make(&t);
    snprintf(prev, sizeof(prev), "%s.prev", t.path);
    cr_assert_eq(hm_ckpt_write(t.path, "good A", 6), 0);
    cr_assert_eq(hm_ckpt_write(t.path, "good B", 6), 0);
    /* One payload byte of PATH flipped: header and size still agree. */
    flip_byte(t.path, HM_CKPT_HEADER_BYTES + 2);
    cr_assert_eq(hm_ckpt_read_file(t.path, 1 << 20, &buf, &len), -EBADMSG);
    cr_assert_eq(hm_ckpt_write(t.path, "good C", 6), 0);
    expect_read(t.path, "good C", 0);
    expect_read(prev, "good A", 0);
    /* hm_ckpt_read_file reads exactly one file, without falling back. */
    cr_assert_eq(hm_ckpt_read_file(prev, 1 << 20, &buf, &len), 0);
    cr_assert_eq(len, 6);
    cr_assert_eq(memcmp(buf, "good A", 6), 0);
    free(buf);
    flip_byte(t.path, HM_CKPT_HEADER_BYTES);
    cr_assert_eq(hm_ckpt_read_file(t.path, 1 << 20, &buf, &len), -EBADMSG);
    cr_assert_null(buf);
    cr_assert_eq(hm_ckpt_read_file(t.path, 1 << 20, NULL, &len), -EINVAL);
    tmpdir_remove(&t);
}

Test(ckpt, missing_corrupt_and_oversized)
{
    struct tmpdir t;
    uint8_t *buf = (uint8_t *)1;
    size_t len = 1;
    char prev[160];

    tmpdir_make(&t);
    snprintf(prev, sizeof(prev), "%s.prev", t.path);
    cr_assert_eq(hm_ckpt_read(t.path, 1 << 20, &buf, &len, NULL), -ENOENT);
    cr_assert_null(buf);

    /* Both corrupt. */
    cr_assert_eq(hm_ckpt_write(t.path, "aaaa", 4), 0);
    cr_assert_eq(hm_ckpt_write(t.path, "bbbb", 4), 0);
    flip_byte(t.path, 50);
    flip_byte(prev, 49);
    cr_assert_eq(hm_ckpt_read(t.path, 1 << 20, &buf, &len, NULL), -EBADMSG);
    /* Only a corrupt PATH.prev. */
    cr_assert_eq(unlink(t.path), 0);
    cr_assert_eq(hm_ckpt_read(t.path, 1 << 20, &buf, &len, NULL), -EBADMSG);
    /* Garbage shorter than a header. */
    write_file(t.path, "HMCK", 4);
    cr_assert_eq(hm_ckpt_read(t.path, 1 << 20, &buf, &len, NULL), -EBADMSG);
    cr_assert_null(buf);

    /* Over max_len: refused without reading the payload in. */
    cr_assert_eq(unlink(prev), 0);
    cr_assert_eq(hm_ckpt_write(t.path, "0123456789", 10), 0);
    cr_assert_eq(hm_ckpt_read(t.path, 9, &buf, &len, NULL), -EMSGSIZE);
    cr_assert_null(buf);
    expect_read(t.path, "0123456789", 0);
    /* A length that disagrees with the file is corruption, not an oversized checkpoint. */
    flip_byte(t.path, 8);
    cr_assert_eq(hm_ckpt_read(t.path, 1 << 20, &buf, &len, NULL), -EBADMSG);
    flip_byte(t.path, 8);
    /* A directory where the file should be is not a checkpoint. */
    cr_assert_eq(unlink(t.path), 0);
    cr_assert_eq(mkdir(t.path, 0700), 0);
    cr_assert_eq(hm_ckpt_read(t.path, 1 << 20, &buf, &len, NULL), -EBADMSG);
    cr_assert_eq(rmdir(t.path), 0);
    tmpdir_remove(&t);
}

Test(ckpt, stale_tmp_is_ignored)
{
    struct tmpdir t;
    char tmp[160];
    struct stat st;

    tmpdir_make(&t);
    snprintf(tmp, sizeof(tmp), "%s.tmp", t.path);
    cr_assert_eq(hm_ckpt_write(t.path, "good", 4), 0);
    /* A crash mid-write left a partial temp file: reads ignore it ... */
    write_file(tmp, "HMCK\0\0\0\1garbage", 15);
    expect_read(t.path, "good", 0);
    /* ... and with PATH gone it is not read in its place. */
    cr_assert_eq(unlink(t.path), 0);
    uint8_t *buf = NULL;
    size_t len;
    cr_assert_eq(hm_ckpt_read(t.path, 1 << 20, &buf, &len, NULL), -ENOENT);
    /* The next write replaces it and leaves no temp file behind. */
    cr_assert_eq(hm_ckpt_write(t.path, "next", 4), 0);
    expect_read(t.path, "next", 0);
    cr_assert_eq(stat(tmp, &st), -1);
    cr_assert_eq(errno, ENOENT);
    tmpdir_remove(&t);
}

Test(ckpt, write_errors_are_reported)
{
    cr_assert_eq(hm_ckpt_write("/nonexistent-dir-hm/x.ckpt", "a", 1), -ENOENT);
    cr_assert_eq(hm_ckpt_write(NULL, "a", 1), -EINVAL);
}

Test(ckpt, parse_checks_image)
{
    struct tmpdir t;
    uint8_t *img;
    size_t len;
    const uint8_t *payload;
    size_t plen;
    FILE *fp;

    tmpdir_make(&t);
    cr_assert_eq(hm_ckpt_write(t.path, "payload!", 8), 0);
    fp = fopen(t.path, "rb");
    cr_assert_not_null(fp);
    img = xmalloc(256);
    len = fread(img, 1, 256, fp);
    fclose(fp);
    cr_assert_eq(len, HM_CKPT_HEADER_BYTES + 8);
    cr_assert_eq(memcmp(img, "HMCK\0\0\0\1\0\0\0\0\0\0\0\x08", 16), 0);
    cr_assert_eq(hm_ckpt_parse(img, len, 100, &payload, &plen), 0);
    cr_assert_eq(plen, 8);
    cr_assert_eq(payload, img + HM_CKPT_HEADER_BYTES);
    cr_assert_eq(hm_ckpt_parse(img, len, 7, &payload, &plen), -EMSGSIZE);
    for (size_t cut = 0; cut < len; cut++)
        cr_assert_eq(hm_ckpt_parse(img, cut, 100, &payload, &plen), -EBADMSG);
    for (size_t i = 0; i < len; i++) {
        img[i] ^= 1;
        int rc = hm_ckpt_parse(img, len, 100, &payload, &plen);
        /* A flip in the length's low byte may make it look oversized; all else is corrupt. */
        cr_assert(rc == -EBADMSG || (i >= 8 && i < 16 && rc == -EMSGSIZE), "byte %zu: %d", i, rc);
        img[i] ^= 1;
    }
    free(img);
    tmpdir_remove(&t);
}

Test(ckpt, expert_state_survives_through_checkpoint)
{
    struct tmpdir t;
    hm_ffn *f = make_ffn(8, 12, HM_FFN_ADAM, 77), *g = NULL;
    uint8_t *s, *back;
    size_t len, blen;
    int used_prev;

    tmpdir_make(&t);
    train_a_little(f, 8, 2);
    cr_assert_eq(hm_ffn_save(f, &s, &len), 0);
    cr_assert_eq(hm_ckpt_write(t.path, s, len), 0);
    cr_assert_eq(hm_ckpt_read(t.path, len, &back, &blen, &used_prev), 0);
    cr_assert_eq(used_prev, 0);
    cr_assert_eq(hm_ffn_load(back, blen, hm_ffn_config_of(f), &g), 0);
    cr_assert_eq(memcmp(hm_ffn_params(f), hm_ffn_params(g), hm_ffn_nparams(f) * sizeof(float)),
                 0);
    cr_assert_eq(hm_ffn_steps(g), 2);
    free(s);
    free(back);
    hm_ffn_free(f);
    hm_ffn_free(g);
    tmpdir_remove(&t);
}

/*
 * Tests for the example classifier (contrib/examples/model.h) with
 * in-process experts (moe/ffn.h). The whole model's gradient, for every
 * local parameter and every input, is compared with central finite
 * differences of its loss; experts that do not answer must drop out of the
 * mixture (their parameters stop mattering) while training still works;
 * and a few hundred steps on a Fashion-MNIST subset must lower the loss
 * and beat chance clearly. The dataset directory is
 * $HM_FASHION_MNIST_DIR, default /usr/share/datasets/fashion-mnist
 * (Debian's dataset-fashion-mnist); the training tests skip without it.
 */
#include "config.h"

#include "moe/ffn.h"
#include "contrib/examples/idx.h"
#include "contrib/examples/model.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- helpers ---- */

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define MIN_SZ(a, b) ((a) < (b) ? (a) : (b))

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

static double rng_unit(struct rng *r) { return (double)(rng_next(r) >> 11) * 0x1p-53; }

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    cr_assert_not_null(p);
    return p;
}

/* A model and its in-process experts. */
struct fixture {
    hm_model *m;
    hm_ffn **experts;
    size_t n;
    uint8_t *dead;
    hm_model_local_experts le;
    hm_model_experts ex;
};

static void fixture_init(struct fixture *f, const hm_model_config *mc, int optimizer,
                         int step)
{
    memset(f, 0, sizeof(*f));
    cr_assert_eq(hm_model_new(mc, &f->m), 0);
    f->n = mc->grid[0] * mc->grid[1];
    f->experts = xmalloc(f->n * sizeof(hm_ffn *));
    f->dead = xmalloc(f->n);
    memset(f->dead, 0, f->n);
    for (size_t e = 0; e < f->n; e++) {
        hm_ffn_config fc = {.dim = mc->dim, .hidden = 2 * mc->dim, .optimizer = optimizer,
                            .seed = 1000 + e};
        cr_assert_eq(hm_ffn_new(&fc, &f->experts[e]), 0);
    }
    f->le.experts = f->experts;
    f->le.n = f->n;
    f->le.step = step;
    f->le.dead = f->dead;
    hm_model_local_experts_bind(&f->le, &f->ex);
}

static void fixture_free(struct fixture *f)
{
    for (size_t e = 0; e < f->n; e++)
        hm_ffn_free(f->experts[e]);
    free(f->experts);
    free(f->dead);
    hm_model_free(f->m);
}

static double loss_of(struct fixture *f, const float *x, const uint8_t *y, size_t batch,
                      hm_model_result *res)
{
    hm_model_result r;
    cr_assert_eq(hm_model_forward(f->m, &f->ex, x, y, batch, NULL, &r), 0);
    if (res != NULL)
        *res = r;
    /* The objective the gradient is of (the balancing loss is 0 but for a Switch layer). */
    return r.loss + hm_model_config_of(f->m)->balance_weight * r.balancing_loss;
}

static int same_choice(const hm_model_result *a, const hm_model_result *b)
{
    if (a->k != b->k || a->route_sig != b->route_sig)
        return 0;
    for (size_t e = 0; e < a->k; e++)
        if (a->chosen[e] != b->chosen[e] || a->answered[e] != b->answered[e])
            return 0;
    return 1;
}

/*
 * Compares analytic gradient g[n] of the loss in v[n] with central
 * differences; returns the relative error ||fd - g|| / ||g|| over the
 * coordinates whose perturbation left the expert choice unchanged.
 */
static double fd_check(struct fixture *f, float *v, const float *g, size_t n, const float *x,
                       const uint8_t *y, size_t batch, const hm_model_result *base,
                       const char *what)
{
    const float eps = 1e-2f;
    double num = 0, den = 0;
    size_t used = 0;
    for (size_t i = 0; i < n; i++) {
        float old = v[i];
        hm_model_result rp, rm;
        v[i] = old + eps;
        double lp = loss_of(f, x, y, batch, &rp);
        v[i] = old - eps;
        double lm = loss_of(f, x, y, batch, &rm);
        v[i] = old;
        if (!same_choice(base, &rp) || !same_choice(base, &rm))
            continue;
        double fd = (lp - lm) / (2.0 * eps);
        num += (fd - g[i]) * (fd - g[i]);
        den += (double)g[i] * g[i];
        used++;
    }
    cr_assert_gt(used, n / 2, "%s: too few coordinates kept the expert choice", what);
    cr_assert_gt(den, 0.0, "%s: the gradient is zero", what);
    return sqrt(num / den);
}

static const hm_model_config small_cfg = {
    .in_dim = 10, .dim = 6, .n_classes = 4, .grid = {2, 3}, .k_best = 3, .max_batch = 8,
    .optimizer = HM_MODEL_ADAM, .seed = 7};

static void gradient_check_cfg(const hm_model_config *cfg, const uint8_t *dead_mask)
{
    struct fixture f;
    struct rng r = {42};
    const size_t batch = 6;
    const hm_model_config mc = *cfg;
    fixture_init(&f, &mc, HM_FFN_ADAM, 0);
    if (dead_mask != NULL)
        memcpy(f.dead, dead_mask, f.n);
    float *x = xmalloc(batch * mc.in_dim * sizeof(float));
    float *gx = xmalloc(batch * mc.in_dim * sizeof(float));
    uint8_t y[6];
    for (size_t i = 0; i < batch * mc.in_dim; i++)
        x[i] = (float)(2.0 * rng_unit(&r) - 1.0);
    for (size_t b = 0; b < batch; b++)
        y[b] = (uint8_t)(rng_next(&r) % mc.n_classes);
    /* Larger gate weights make the softmax over experts matter. */
    float *p = hm_model_params(f.m);
    size_t np = hm_model_nparams(f.m);
    for (size_t i = 0; i < np; i++)
        p[i] *= 2.0f;

    hm_model_result base;
    cr_assert_eq(hm_model_backward(f.m, &f.ex, x, y, batch, gx, &base), 0);
    if (mc.routing == HM_MODEL_ROUTE_BATCH && !mc.switch_layer)
        cr_assert_eq(base.k, 3);
    if (dead_mask != NULL)
        cr_assert_lt(base.n_answered, base.k, "the dead expert was not among those chosen");
    else
        cr_assert_eq(base.n_answered, base.k);
    cr_assert_eq(base.n_answered_backward, base.n_answered);
    float *g = xmalloc(np * sizeof(float));
    memcpy(g, hm_model_grad(f.m), np * sizeof(float));

    /* Every block of the flat vector, and the input. */
    double err = fd_check(&f, p, g, np, x, y, batch, &base, "params");
    cr_log_info("parameter gradient: relative error %g", err);
    cr_expect_lt(err, 0.02, "parameter gradient relative error %g", err);
    err = fd_check(&f, x, gx, batch * mc.in_dim, x, y, batch, &base, "input");
    cr_log_info("input gradient: relative error %g", err);
    cr_expect_lt(err, 0.02, "input gradient relative error %g", err);

    /* The gate's own block gets a gradient only through the mixture; it
     * must be nonzero, or the check above would not have tested it. */
    double gate = 0;
    size_t o_wgate = mc.dim * mc.in_dim + mc.dim;
    for (size_t i = 0; i < (mc.grid[0] + mc.grid[1]) * mc.dim; i++)
        gate += fabs(g[o_wgate + i]);
    cr_expect_gt(gate, 1e-4);
    free(g);
    free(gx);
    free(x);
    fixture_free(&f);
}

static void gradient_check(const uint8_t *dead_mask)
{
    gradient_check_cfg(&small_cfg, dead_mask);
}

/* ---- gradients ---- */

Test(model, gradients_match_finite_differences)
{
    gradient_check(NULL);
}

Test(model, gradients_with_a_dead_expert)
{
    /* Find the experts the batch picks, then kill the best one. */
    struct fixture f;
    struct rng r = {42};
    fixture_init(&f, &small_cfg, HM_FFN_ADAM, 0);
    float x[6 * 10];
    uint8_t y[6];
    for (size_t i = 0; i < ARRAY_LEN(x); i++)
        x[i] = (float)(2.0 * rng_unit(&r) - 1.0);
    for (size_t b = 0; b < 6; b++)
        y[b] = (uint8_t)(rng_next(&r) % small_cfg.n_classes);
    float *p = hm_model_params(f.m);
    for (size_t i = 0; i < hm_model_nparams(f.m); i++)
        p[i] *= 2.0f;
    hm_model_result res;
    loss_of(&f, x, y, 6, &res);
    uint8_t dead[6] = {0};
    dead[res.chosen[0]] = 1;
    fixture_free(&f);
    gradient_check(dead);
}

/* ---- missing experts ---- */

Test(model, dead_experts_leave_the_mixture)
{
    struct fixture f;
    struct rng r = {5};
    hm_model_config mc = small_cfg;
    mc.k_best = 4;
    fixture_init(&f, &mc, HM_FFN_ADAM, 0);
    float x[8 * 10];
    uint8_t y[8];
    for (size_t i = 0; i < ARRAY_LEN(x); i++)
        x[i] = (float)(2.0 * rng_unit(&r) - 1.0);
    for (size_t b = 0; b < 8; b++)
        y[b] = (uint8_t)(rng_next(&r) % mc.n_classes);

    hm_model_result res;
    double l0 = loss_of(&f, x, y, 8, &res);
    cr_assert_eq(res.n_answered, 4);
    size_t victim = res.chosen[1], other = res.chosen[2];

    /* A live expert's parameters change the loss ... */
    float *pv = hm_ffn_params(f.experts[other]);
    size_t npv = hm_ffn_nparams(f.experts[other]);
    float *saved = xmalloc(npv * sizeof(float));
    memcpy(saved, pv, npv * sizeof(float));
    for (size_t i = 0; i < npv; i++)
        pv[i] += 0.5f;
    cr_assert_gt(fabs(loss_of(&f, x, y, 8, NULL) - l0), 1e-4);
    memcpy(pv, saved, npv * sizeof(float));
    free(saved);

    /* ... a dead one's do not, and it is reported as not answering. */
    f.dead[victim] = 1;
    double l1 = loss_of(&f, x, y, 8, &res);
    cr_assert_eq(res.n_answered, 3);
    cr_assert_eq(res.answered[1], 0);
    float *pd = hm_ffn_params(f.experts[victim]);
    for (size_t i = 0; i < hm_ffn_nparams(f.experts[victim]); i++)
        pd[i] += 0.5f;
    cr_assert_float_eq(loss_of(&f, x, y, 8, NULL), l1, 1e-9);

    /* No expert answering fails the step and changes nothing. */
    memset(f.dead, 1, f.n);
    size_t np = hm_model_nparams(f.m);
    float *before = xmalloc(np * sizeof(float));
    memcpy(before, hm_model_params(f.m), np * sizeof(float));
    cr_assert_eq(hm_model_train_step(f.m, &f.ex, x, y, 8, &res), -ETIMEDOUT);
    cr_assert_eq(memcmp(before, hm_model_params(f.m), np * sizeof(float)), 0);
    cr_assert_eq(hm_model_steps(f.m), 0);
    free(before);

    /* Availability steers the choice away from experts never to be asked. */
    uint8_t mask[6] = {0, 0, 0, 0, 1, 1};
    memset(f.dead, 0, f.n);
    cr_assert_eq(hm_model_set_available(f.m, mask), 0);
    loss_of(&f, x, y, 8, &res);
    cr_assert_eq(res.k, 2);
    cr_assert(res.chosen[0] >= 4 && res.chosen[1] >= 4);
    memset(mask, 0, sizeof(mask));
    cr_assert_eq(hm_model_set_available(f.m, mask), -EINVAL);
    fixture_free(&f);
}

Test(model, bad_inputs_are_refused)
{
    struct fixture f;
    fixture_init(&f, &small_cfg, HM_FFN_ADAM, 0);
    float x[9 * 10];
    uint8_t y[9] = {0};
    memset(x, 0, sizeof(x));
    cr_assert_eq(hm_model_forward(f.m, &f.ex, x, y, 9, NULL, NULL), -EINVAL); /* > max_batch */
    cr_assert_eq(hm_model_forward(f.m, &f.ex, x, y, 0, NULL, NULL), -EINVAL);
    y[3] = 4; /* n_classes is 4 */
    cr_assert_eq(hm_model_backward(f.m, &f.ex, x, y, 8, NULL, NULL), -EINVAL);
    y[3] = 0;
    x[5] = NAN;
    cr_assert_eq(hm_model_backward(f.m, &f.ex, x, y, 8, NULL, NULL), -EDOM);
    cr_assert_eq(hm_model_steps(f.m), 0);

    hm_model *m = NULL;
    hm_model_config bad = small_cfg;
    bad.k_best = 7; /* more than 2 x 3 experts */
    cr_assert_eq(hm_model_new(&bad, &m), -EINVAL);
    bad = small_cfg;
    bad.grid[1] = 0;
    cr_assert_eq(hm_model_new(&bad, &m), -EINVAL);
    bad = small_cfg;
    bad.max_batch = HM_MODEL_MAX_BATCH + 1;
    cr_assert_eq(hm_model_new(&bad, &m), -EINVAL);
    cr_assert_null(m);
    fixture_free(&f);
}

/* ---- training on Fashion-MNIST ---- */

static const char *data_dir(void)
{
    const char *d = getenv("HM_FASHION_MNIST_DIR");
    return d != NULL && d[0] != '\0' ? d : "/usr/share/datasets/fashion-mnist";
}

static int load_subset(size_t n_train, size_t n_test, hm_idx_images *tr, hm_idx_labels *trl,
                       hm_idx_images *te, hm_idx_labels *tel)
{
    char err[HM_IDX_ERR_LEN];
    char probe[4096];
    snprintf(probe, sizeof(probe), "%s/train-labels-idx1-ubyte.gz", data_dir());
    if (access(probe, R_OK) != 0) {
        snprintf(probe, sizeof(probe), "%s/train-labels-idx1-ubyte", data_dir());
        if (access(probe, R_OK) != 0)
            return -ENOENT;
    }
    cr_assert_eq(hm_idx_load_pair(data_dir(), "train", n_train, tr, trl, err, sizeof(err)), 0,
                 "%s", err);
    cr_assert_eq(hm_idx_load_pair(data_dir(), "t10k", n_test, te, tel, err, sizeof(err)), 0,
                 "%s", err);
    float mean, std;
    hm_idx_stats(tr, &mean, &std);
    cr_assert_eq(hm_idx_normalize(tr, mean, std), 0);
    cr_assert_eq(hm_idx_normalize(te, mean, std), 0);
    return 0;
}

static double accuracy(struct fixture *f, const hm_idx_images *te, const hm_idx_labels *tel,
                       size_t batch)
{
    size_t pix = te->rows * te->cols, correct = 0;
    for (size_t i = 0; i < te->n; i += batch) {
        size_t b = MIN_SZ(batch, te->n - i);
        hm_model_result res;
        cr_assert_eq(hm_model_forward(f->m, &f->ex, te->data + i * pix, tel->data + i, b, NULL,
                                      &res), 0);
        correct += res.correct;
    }
    return (double)correct / (double)te->n;
}

/* Trains `steps` steps; returns mean loss of the first and last 25 steps. */
static void train(struct fixture *f, const hm_idx_images *tr, const hm_idx_labels *trl,
                  size_t steps, size_t batch, double *first, double *last, size_t *partial)
{
    size_t pix = tr->rows * tr->cols;
    float *x = xmalloc(batch * pix * sizeof(float));
    uint8_t *y = xmalloc(batch);
    struct rng r = {99};
    *first = *last = 0;
    *partial = 0;
    for (size_t s = 0; s < steps; s++) {
        for (size_t b = 0; b < batch; b++) {
            size_t i = rng_next(&r) % tr->n;
            memcpy(x + b * pix, tr->data + i * pix, pix * sizeof(float));
            y[b] = trl->data[i];
        }
        hm_model_result res;
        cr_assert_eq(hm_model_train_step(f->m, &f->ex, x, y, batch, &res), 0);
        if (res.n_answered < res.k)
            (*partial)++;
        if (s < 25)
            *first += res.loss / 25;
        if (s >= steps - 25)
            *last += res.loss / 25;
    }
    free(x);
    free(y);
}

static const hm_model_config mnist_cfg = {
    .in_dim = 784, .dim = 32, .n_classes = 10, .grid = {4, 4}, .k_best = 4, .max_batch = 32,
    .optimizer = HM_MODEL_ADAM, .seed = 3};

Test(model, training_lowers_the_loss, .timeout = 120)
{
    hm_idx_images tr, te;
    hm_idx_labels trl, tel;
    if (load_subset(3000, 1000, &tr, &trl, &te, &tel) < 0)
        cr_skip_test("Fashion-MNIST not found in %s", data_dir());
    struct fixture f;
    fixture_init(&f, &mnist_cfg, HM_FFN_ADAM, 1);
    double acc0 = accuracy(&f, &te, &tel, 32);
    double first, last;
    size_t partial;
    train(&f, &tr, &trl, 300, 32, &first, &last, &partial);
    double acc = accuracy(&f, &te, &tel, 32);
    cr_log_info("loss %.3f -> %.3f, test accuracy %.3f -> %.3f", first, last, acc0, acc);
    cr_expect_lt(last, 0.6 * first, "loss %.3f -> %.3f", first, last);
    cr_expect_gt(acc, 0.65, "test accuracy %.3f after 300 steps", acc);
    cr_expect_eq(partial, 0);
    /* The experts trained too: the chosen ones stepped on each backward. */
    uint64_t expert_steps = 0;
    for (size_t e = 0; e < f.n; e++)
        expert_steps += hm_ffn_steps(f.experts[e]);
    cr_expect_eq(expert_steps, 300 * mnist_cfg.k_best);
    cr_expect_eq(hm_model_steps(f.m), 300);
    fixture_free(&f);
    hm_idx_images_free(&tr);
    hm_idx_images_free(&te);
    hm_idx_labels_free(&trl);
    hm_idx_labels_free(&tel);
}

Test(model, training_with_dead_experts, .timeout = 120)
{
    hm_idx_images tr, te;
    hm_idx_labels trl, tel;
    if (load_subset(3000, 1000, &tr, &trl, &te, &tel) < 0)
        cr_skip_test("Fashion-MNIST not found in %s", data_dir());
    struct fixture f;
    fixture_init(&f, &mnist_cfg, HM_FFN_ADAM, 1);
    /* Half the grid never answers: a whole row and a whole column. */
    for (size_t e = 0; e < f.n; e++)
        f.dead[e] = e / 4 == 1 || e % 4 == 2 || e == 0;
    double first, last;
    size_t partial;
    train(&f, &tr, &trl, 300, 32, &first, &last, &partial);
    double acc = accuracy(&f, &te, &tel, 32);
    cr_log_info("dead experts: loss %.3f -> %.3f, accuracy %.3f, %zu partial steps", first,
                last, acc, partial);
    cr_expect_gt(partial, 0, "no step had a missing expert");
    cr_expect_lt(last, 0.6 * first, "loss %.3f -> %.3f", first, last);
    cr_expect_gt(acc, 0.6, "test accuracy %.3f", acc);
    for (size_t e = 0; e < f.n; e++)
        if (f.dead[e])
            cr_expect_eq(hm_ffn_steps(f.experts[e]), 0, "dead expert %zu stepped", e);
    fixture_free(&f);
    hm_idx_images_free(&tr);
    hm_idx_images_free(&te);
    hm_idx_labels_free(&trl);
    hm_idx_labels_free(&tel);
}

/* ---- per-sample routing and the Switch layer ---- */

static hm_model_config sample_cfg(void)
{
    hm_model_config c = small_cfg;
    c.routing = HM_MODEL_ROUTE_SAMPLE;
    c.k_best = 2;
    return c;
}

static hm_model_config switch_cfg(double balance_weight, double jitter)
{
    hm_model_config c = small_cfg;
    c.switch_layer = 1;
    c.routing = HM_MODEL_ROUTE_SAMPLE;
    c.k_best = 1;
    c.balance_weight = balance_weight;
    c.jitter_eps = jitter;
    return c;
}

Test(model, per_sample_gradients_match_finite_differences)
{
    hm_model_config c = sample_cfg();
    gradient_check_cfg(&c, NULL);
}

Test(model, per_sample_gradients_with_a_dead_expert)
{
    hm_model_config c = sample_cfg();
    uint8_t dead[6] = {0};
    /* Experts 0 and 4 are among those the batch is routed to (the check asserts it). */
    dead[0] = 1;
    dead[4] = 1;
    gradient_check_cfg(&c, dead);
}

Test(model, switch_gradients_match_finite_differences)
{
    /* A large factor, so that the balancing loss's share of the gradient is checked too. */
    hm_model_config c = switch_cfg(1.0, 0);
    gradient_check_cfg(&c, NULL);
}

/* Independent of the model: n_experts * sum_e f_e * P_e as its definition reads. */
static double balancing_by_definition(const size_t *grid, const float *s, size_t batch,
                                      const int32_t *first)
{
    size_t G0 = grid[0], G1 = grid[1], N = G0 * G1, S = G0 + G1;
    double loss = 0;
    for (size_t e = 0; e < N; e++) {
        double f = 0, P = 0;
        for (size_t b = 0; b < batch; b++) {
            f += first[b] == (int32_t)e ? 1.0 / (double)batch : 0.0;
            double z0 = 0, z1 = 0;
            for (size_t i = 0; i < G0; i++)
                z0 += exp(s[b * S + i]);
            for (size_t j = 0; j < G1; j++)
                z1 += exp(s[b * S + G0 + j]);
            P += exp(s[b * S + e / G1]) / z0 * exp(s[b * S + G0 + e % G1]) / z1 / (double)batch;
        }
        loss += f * P;
    }
    return (double)N * loss;
}

Test(model, balancing_loss_matches_its_definition_and_its_gradient)
{
    const size_t grid[2] = {3, 4}, S = 7, batch = 10;
    struct rng r = {11};
    float s[10 * 7], gs[10 * 7];
    int32_t first[10];
    for (size_t i = 0; i < batch * S; i++)
        s[i] = (float)(3.0 * rng_unit(&r) - 1.5);
    /* Concentrated on two experts, one sample without any. */
    for (size_t b = 0; b < batch; b++)
        first[b] = b == 9 ? -1 : (b < 6 ? 5 : 11);
    double l = hm_model_balancing_loss(grid, s, batch, first, gs);
    double def = balancing_by_definition(grid, s, batch, first);
    cr_assert_float_eq(l, def, 1e-9 * fabs(def) + 1e-12, "loss %g, by its definition %g", l, def);
    cr_assert(isnan(hm_model_balancing_loss(grid, s, 0, first, NULL)));

    /* Central differences of the loss in each score, routes held. */
    double num = 0, den = 0, gnorm = 0;
    for (size_t i = 0; i < batch * S; i++) {
        float old = s[i];
        const float eps = 1e-2f;
        s[i] = old + eps;
        double lp = hm_model_balancing_loss(grid, s, batch, first, NULL);
        s[i] = old - eps;
        double lm = hm_model_balancing_loss(grid, s, batch, first, NULL);
        s[i] = old;
        double fd = (lp - lm) / (2.0 * eps);
        num += (fd - gs[i]) * (fd - gs[i]);
        den += (double)gs[i] * gs[i];
        gnorm += fabs(gs[i]);
    }
    cr_assert_gt(gnorm, 1e-3, "the balancing loss has no gradient in the gate's scores");
    double err = sqrt(num / den);
    cr_log_info("balancing loss gradient: relative error %g", err);
    cr_expect_lt(err, 0.01, "relative error %g", err);

    /* Uniform routing and uniform scores give exactly 1. */
    float zero[12 * 7] = {0};
    int32_t each[12];
    for (size_t b = 0; b < 12; b++)
        each[b] = (int32_t)b;
    cr_assert_float_eq(hm_model_balancing_loss(grid, zero, 12, each, NULL), 1.0, 1e-6);
}

Test(model, switch_balancing_loss_reaches_the_gate)
{
    /* The model's gate gradient with the balancing term alone (no task
     * loss would be exact zero, so compare weight 1 against weight 0). */
    struct rng r = {3};
    const size_t batch = 8;
    float x[8 * 10];
    uint8_t y[8];
    for (size_t i = 0; i < ARRAY_LEN(x); i++)
        x[i] = (float)(2.0 * rng_unit(&r) - 1.0);
    for (size_t b = 0; b < batch; b++)
        y[b] = (uint8_t)(rng_next(&r) % small_cfg.n_classes);
    size_t o_wgate = small_cfg.dim * small_cfg.in_dim + small_cfg.dim;
    size_t n_gate = (small_cfg.grid[0] + small_cfg.grid[1]) * (small_cfg.dim + 1);
    float g[2][(2 + 3) * (6 + 1)];
    hm_model_result res[2];
    for (int w = 0; w < 2; w++) {
        hm_model_config c = switch_cfg(w, 0);
        struct fixture f;
        fixture_init(&f, &c, HM_FFN_ADAM, 0);
        cr_assert_eq(hm_model_backward(f.m, &f.ex, x, y, batch, NULL, &res[w]), 0);
        memcpy(g[w], hm_model_grad(f.m) + o_wgate, n_gate * sizeof(float));
        fixture_free(&f);
    }
    cr_assert_eq(res[0].route_sig, res[1].route_sig);
    cr_assert_float_eq(res[0].balancing_loss, res[1].balancing_loss, 1e-12);
    cr_assert_geq(res[0].balancing_loss, 1.0 - 1e-6, "n * sum f P is at least 1 for one route each");
    double diff = 0;
    for (size_t i = 0; i < n_gate; i++)
        diff += fabs(g[1][i] - g[0][i]);
    cr_assert_gt(diff, 1e-4, "the balancing loss does not move the gate");
}

/* Experts whose forward answers and whose backward records the routes it got. */
struct spy {
    hm_model_experts inner;
    size_t silent;          /* this flat expert never answers forward */
    int32_t broutes[8 * 2];
    size_t bexperts[6], bn, slots, batch;
    int called;
};

static int spy_forward(void *ud, const size_t *experts, size_t n, const int32_t *routes,
                       size_t slots, const float *h, size_t batch, size_t dim, int allow_zero,
                       float *y_out, uint8_t *answered)
{
    struct spy *sp = ud;
    int r = sp->inner.forward_routed(sp->inner.ud, experts, n, routes, slots, h, batch, dim,
                                     allow_zero, y_out, answered);
    for (size_t i = 0; i < n; i++)
        if (experts[i] == sp->silent)
            answered[i] = 0;
    return r;
}

static int spy_backward(void *ud, const size_t *experts, size_t n, const int32_t *routes,
                        size_t slots, const float *h, const float *gy, size_t batch, size_t dim,
                        int allow_zero, float *gh_out, uint8_t *answered)
{
    struct spy *sp = ud;
    sp->called = 1;
    sp->bn = n;
    sp->slots = slots;
    sp->batch = batch;
    memcpy(sp->bexperts, experts, n * sizeof(size_t));
    memcpy(sp->broutes, routes, batch * slots * sizeof(int32_t));
    return sp->inner.backward_routed(sp->inner.ud, experts, n, routes, slots, h, gy, batch, dim,
                                     allow_zero, gh_out, answered);
}

Test(model, per_sample_routes_each_sample_and_backward_skips_the_silent)
{
    hm_model_config c = sample_cfg();
    struct fixture f;
    struct rng r = {9};
    fixture_init(&f, &c, HM_FFN_ADAM, 1);
    float x[8 * 10];
    uint8_t y[8];
    for (size_t i = 0; i < ARRAY_LEN(x); i++)
        x[i] = (float)(4.0 * rng_unit(&r) - 2.0);
    for (size_t b = 0; b < 8; b++)
        y[b] = (uint8_t)(rng_next(&r) % c.n_classes);
    float *p = hm_model_params(f.m);
    for (size_t i = 0; i < hm_model_nparams(f.m); i++)
        p[i] *= 3.0f;
    hm_model_result res;
    loss_of(&f, x, y, 8, &res);
    /* Samples differ: the batch uses more experts than one sample's k_best. */
    cr_assert_gt(res.n_routed, c.k_best, "every sample went to the same experts");
    cr_assert_eq(res.n_answered, res.n_routed);

    struct spy sp = {.inner = f.ex, .silent = res.chosen[0]};
    hm_model_experts ex = {.ud = &sp, .forward_routed = spy_forward,
                           .backward_routed = spy_backward};
    hm_model_result br;
    uint64_t steps_before = hm_ffn_steps(f.experts[sp.silent]);
    cr_assert_eq(hm_model_backward(f.m, &ex, x, y, 8, NULL, &br), 0);
    cr_assert(sp.called);
    cr_assert_eq(sp.slots, c.k_best);
    cr_assert_eq(br.n_answered, br.n_routed - 1);
    cr_assert_eq(br.n_answered_backward, br.n_answered);
    size_t silent_idx = SIZE_MAX, rows = 0;
    for (size_t i = 0; i < sp.bn; i++)
        if (sp.bexperts[i] == sp.silent)
            silent_idx = i;
    cr_assert_neq(silent_idx, SIZE_MAX);
    for (size_t i = 0; i < sp.batch * sp.slots; i++) {
        cr_assert_neq(sp.broutes[i], (int32_t)silent_idx, "backward got the silent expert's row");
        rows += sp.broutes[i] >= 0;
    }
    cr_assert_gt(rows, 0);
    /* The silent expert got no backward, so it did not step. */
    cr_assert_eq(hm_ffn_steps(f.experts[sp.silent]), steps_before);

    /* Per-sample routing needs the routed calls. */
    hm_model_experts plain = {.ud = f.ex.ud, .forward = f.ex.forward, .backward = f.ex.backward};
    cr_assert_eq(hm_model_forward(f.m, &plain, x, y, 8, NULL, &res), -EINVAL);
    fixture_free(&f);

    /* A Switch layer needs k_best 1 and a jitter below 1. */
    hm_model *m = NULL;
    hm_model_config bad = switch_cfg(0.01, 0.01);
    bad.k_best = 2;
    cr_assert_eq(hm_model_new(&bad, &m), -EINVAL);
    bad = switch_cfg(0.01, 1.0);
    cr_assert_eq(hm_model_new(&bad, &m), -EINVAL);
}

Test(model, switch_zeroes_unanswered_samples_and_jitters_only_in_training)
{
    hm_model_config c = switch_cfg(0.01, 0.1);
    struct fixture f;
    struct rng r = {21};
    fixture_init(&f, &c, HM_FFN_ADAM, 0);
    float x[8 * 10];
    uint8_t y[8];
    for (size_t i = 0; i < ARRAY_LEN(x); i++)
        x[i] = (float)(2.0 * rng_unit(&r) - 1.0);
    for (size_t b = 0; b < 8; b++)
        y[b] = (uint8_t)(rng_next(&r) % c.n_classes);
    hm_model_result a, b2;
    double l0 = loss_of(&f, x, y, 8, &a);
    cr_assert_float_eq(loss_of(&f, x, y, 8, &b2), l0, 1e-12, "evaluation is not deterministic");
    /* Training draws new noise each step: two gradients at the same
     * parameters differ (the experts do not step here). */
    size_t np = hm_model_nparams(f.m);
    float *g0 = xmalloc(np * sizeof(float));
    cr_assert_eq(hm_model_backward(f.m, &f.ex, x, y, 8, NULL, &a), 0);
    memcpy(g0, hm_model_grad(f.m), np * sizeof(float));
    cr_assert_eq(hm_model_backward(f.m, &f.ex, x, y, 8, NULL, &b2), 0);
    cr_assert_neq(memcmp(g0, hm_model_grad(f.m), np * sizeof(float)), 0);
    free(g0);
    /* Every expert silent: a Switch layer still runs, each sample's mixture zeros. */
    memset(f.dead, 1, f.n);
    cr_assert_eq(hm_model_forward(f.m, &f.ex, x, y, 8, NULL, &a), 0);
    cr_assert_eq(a.n_answered, 0);
    cr_assert(isfinite(a.loss));
    fixture_free(&f);
}

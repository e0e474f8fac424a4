/*
 * train_common: options, data, batches, evaluation and stop requests shared
 * by train_local and trainer (train_common.h).
 */
#include "config.h"

#include "contrib/examples/train_common.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char hm_train_common_usage[] =
    "  --steps N          stop after N steps (default 3000; 0: only --time-limit)\n"
    "  --time-limit S     stop after S seconds (default: none)\n"
    "  --batch B          samples per step (default 64)\n"
    "  --dim D            hidden width and expert dim (default 64)\n"
    "  --hidden H         expert hidden width (default 4*D)\n"
    "  --experts G0xG1    expert grid (default 4x4)\n"
    "  --k-best K         experts asked per step (default 4)\n"
    "  --lr LR            learning rate of the local parameters (default 1e-3, Adam)\n"
    "  --eval-every N     test accuracy every N steps (default 500; 0: at the end)\n"
    "  --print-every N    a train line every N steps (default 100)\n"
    "  --seed S           initial weights and batch order (default 1)\n"
    "  --data DIR         Fashion-MNIST files (default /usr/share/datasets/fashion-mnist)\n"
    "  --train-limit N    use the first N training images only (default: all)\n"
    "  --routing R        sample: each sample goes to its own k_best experts (default);\n"
    "                     batch: the whole batch to the k_best of the best mean score\n"
    "  --switch           a Switch layer: each sample to its one best expert, output\n"
    "                     scaled by the gate's probability, zeros when it did not answer,\n"
    "                     and a load-balancing loss (implies --routing sample, k_best 1)\n"
    "  --balance-weight W --switch: the balancing loss's factor (default 0.01)\n"
    "  --jitter EPS       --switch: the gate's input times uniform noise in\n"
    "                     [1-EPS, 1+EPS] in training (default 0.01)\n";

void hm_train_opts_default(hm_train_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->steps = 3000;
    o->batch = 64;
    o->dim = 64;
    o->grid[0] = o->grid[1] = 4;
    o->k_best = 4;
    o->eval_every = 500;
    o->print_every = 100;
    o->seed = 1;
    o->data = "/usr/share/datasets/fashion-mnist";
    o->routing = HM_MODEL_ROUTE_SAMPLE;
    o->balance_weight = 0.01;
    o->jitter_eps = 0.01;
}

static int parse_size(const char *name, const char *v, size_t max, size_t *out)
{
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0' || v[0] == '-' || x > max) {
        fprintf(stderr, "%s: '%s' is not a whole number in 0..%zu\n", name, v, max);
        return -EINVAL;
    }
    *out = (size_t)x;
    return 0;
}

static int parse_double(const char *name, const char *v, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno != 0 || end == v || *end != '\0' || !isfinite(x) || x < 0) {
        fprintf(stderr, "%s: '%s' is not a non-negative number\n", name, v);
        return -EINVAL;
    }
    *out = x;
    return 0;
}

int hm_train_opt(hm_train_opts *o, int argc, char **argv, int *i)
{
    static const char *const names[] = {"--steps", "--time-limit", "--batch", "--dim",
                                        "--hidden", "--experts", "--k-best", "--lr",
                                        "--eval-every", "--print-every", "--seed", "--data",
                                        "--train-limit", "--routing", "--balance-weight",
                                        "--jitter"};
    const char *arg = argv[*i];
    if (strcmp(arg, "--switch") == 0) {
        o->switch_layer = 1;
        return 1;
    }
    size_t which = sizeof(names) / sizeof(names[0]);
    const char *val = NULL;
    for (size_t n = 0; n < sizeof(names) / sizeof(names[0]); n++) {
        size_t len = strlen(names[n]);
        if (strncmp(arg, names[n], len) == 0 && (arg[len] == '\0' || arg[len] == '=')) {
            which = n;
            if (arg[len] == '=')
                val = arg + len + 1;
            break;
        }
    }
    if (which == sizeof(names) / sizeof(names[0]))
        return 0;
    if (val == NULL) {
        if (*i + 1 >= argc) {
            fprintf(stderr, "%s needs a value\n", names[which]);
            return -EINVAL;
        }
        val = argv[++*i];
    }
    const char *name = names[which];
    size_t sz;
    switch (which) {
    case 0:
        return parse_size(name, val, SIZE_MAX / 2, &o->steps) < 0 ? -EINVAL : 1;
    case 1:
        return parse_double(name, val, &o->time_limit) < 0 ? -EINVAL : 1;
    case 2:
        return parse_size(name, val, HM_MODEL_MAX_BATCH, &o->batch) < 0 ? -EINVAL : 1;
    case 3:
        return parse_size(name, val, HM_FFN_MAX_DIM, &o->dim) < 0 ? -EINVAL : 1;
    case 4:
        return parse_size(name, val, HM_FFN_MAX_HIDDEN, &o->hidden) < 0 ? -EINVAL : 1;
    case 5: {
        unsigned a, b;
        int used = 0;
        if (sscanf(val, "%3ux%3u%n", &a, &b, &used) != 2 || val[used] != '\0' || a < 1 ||
            b < 1 || a > HM_MODEL_MAX_GRID || b > HM_MODEL_MAX_GRID) {
            fprintf(stderr, "--experts: '%s' is not G0xG1 with each in 1..%d\n", val,
                    HM_MODEL_MAX_GRID);
            return -EINVAL;
        }
        o->grid[0] = a;
        o->grid[1] = b;
        return 1;
    }
    case 6:
        return parse_size(name, val, HM_MODEL_MAX_K, &o->k_best) < 0 ? -EINVAL : 1;
    case 7:
        return parse_double(name, val, &o->lr) < 0 ? -EINVAL : 1;
    case 8:
        return parse_size(name, val, SIZE_MAX / 2, &o->eval_every) < 0 ? -EINVAL : 1;
    case 9:
        if (parse_size(name, val, SIZE_MAX / 2, &sz) < 0 || sz == 0) {
            fprintf(stderr, "--print-every must be at least 1\n");
            return -EINVAL;
        }
        o->print_every = sz;
        return 1;
    case 10:
        if (parse_size(name, val, SIZE_MAX, &sz) < 0)
            return -EINVAL;
        o->seed = sz;
        return 1;
    case 11:
        o->data = val;
        return 1;
    case 12:
        return parse_size(name, val, HM_IDX_MAX_ITEMS, &o->train_limit) < 0 ? -EINVAL : 1;
    case 13:
        if (strcmp(val, "sample") == 0)
            o->routing = HM_MODEL_ROUTE_SAMPLE;
        else if (strcmp(val, "batch") == 0)
            o->routing = HM_MODEL_ROUTE_BATCH;
        else {
            fprintf(stderr, "--routing: '%s' is neither sample nor batch\n", val);
            return -EINVAL;
        }
        return 1;
    case 14:
        return parse_double(name, val, &o->balance_weight) < 0 ? -EINVAL : 1;
    case 15:
        if (parse_double(name, val, &o->jitter_eps) < 0 || o->jitter_eps >= 1) {
            fprintf(stderr, "--jitter must be in [0, 1)\n");
            return -EINVAL;
        }
        return 1;
    }
    return 0;
}

int hm_train_opts_check(const hm_train_opts *o)
{
    if (o->steps == 0 && o->time_limit <= 0) {
        fprintf(stderr, "--steps 0 needs a --time-limit\n");
        return -EINVAL;
    }
    if (o->batch < 1 || o->dim < 1) {
        fprintf(stderr, "--batch and --dim must be at least 1\n");
        return -EINVAL;
    }
    if (o->switch_layer && o->routing == HM_MODEL_ROUTE_BATCH) {
        fprintf(stderr, "--switch routes per sample: it does not go with --routing batch\n");
        return -EINVAL;
    }
    if (!o->switch_layer && o->k_best < 1) {
        fprintf(stderr, "--k-best must be at least 1\n");
        return -EINVAL;
    }
    if (!o->switch_layer && o->k_best > o->grid[0] * o->grid[1]) {
        fprintf(stderr, "--k-best must be in 1..%zu for a %zux%zu grid\n",
                o->grid[0] * o->grid[1], o->grid[0], o->grid[1]);
        return -EINVAL;
    }
    return 0;
}

void hm_train_model_config(const hm_train_opts *o, hm_model_config *mc)
{
    memset(mc, 0, sizeof(*mc));
    mc->in_dim = 784;
    mc->dim = o->dim;
    mc->n_classes = 10;
    mc->grid[0] = o->grid[0];
    mc->grid[1] = o->grid[1];
    mc->k_best = o->switch_layer ? 1 : o->k_best;
    mc->max_batch = o->batch;
    mc->routing = o->switch_layer ? HM_MODEL_ROUTE_SAMPLE : o->routing;
    mc->switch_layer = o->switch_layer;
    mc->balance_weight = o->switch_layer ? o->balance_weight : 0;
    mc->jitter_eps = o->switch_layer ? o->jitter_eps : 0;
    mc->optimizer = HM_MODEL_ADAM;
    mc->lr = o->lr;
    mc->seed = o->seed;
}

const char *hm_train_routing_name(const hm_train_opts *o)
{
    if (o->switch_layer)
        return "switch";
    return o->routing == HM_MODEL_ROUTE_SAMPLE ? "sample" : "batch";
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void shuffle(hm_train_data *d)
{
    for (size_t i = d->train.n - 1; i > 0; i--) {
        size_t j = (size_t)(rng_next(&d->rng) % (i + 1));
        size_t t = d->order[i];
        d->order[i] = d->order[j];
        d->order[j] = t;
    }
    d->pos = 0;
}

int hm_train_data_load(hm_train_data *d, const hm_train_opts *o)
{
    char err[HM_IDX_ERR_LEN];
    memset(d, 0, sizeof(*d));
    int result = hm_idx_load_pair(o->data, "train", o->train_limit, &d->train, &d->train_labels,
                                  err, sizeof(err));
    if (result == 0)
        result = hm_idx_load_pair(o->data, "t10k", 0, &d->test, &d->test_labels, err,
                                  sizeof(err));
    if (result < 0) {
        fprintf(stderr, "%s\n", err);
        goto out;
    }
    d->pix = d->train.rows * d->train.cols;
    if (d->pix != 784 || d->test.rows * d->test.cols != 784) {
        fprintf(stderr, "%s: images are not 28x28\n", o->data);
        result = -EINVAL;
        goto out;
    }
    float mean, std;
    hm_idx_stats(&d->train, &mean, &std);
    hm_idx_normalize(&d->train, mean, std);
    hm_idx_normalize(&d->test, mean, std);
    d->batch = o->batch;
    d->order = malloc(d->train.n * sizeof(size_t));
    d->x = malloc(o->batch * d->pix * sizeof(float));
    d->y = malloc(o->batch);
    if (d->order == NULL || d->x == NULL || d->y == NULL) {
        fprintf(stderr, "out of memory\n");
        result = -ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < d->train.n; i++)
        d->order[i] = i;
    d->rng = o->seed ^ 0x5eed5eed5eedull;
    shuffle(d);
    result = 0;
out:
    if (result < 0)
        hm_train_data_free(d);
    return result;
}

void hm_train_data_free(hm_train_data *d)
{
    hm_idx_images_free(&d->train);
    hm_idx_images_free(&d->test);
    hm_idx_labels_free(&d->train_labels);
    hm_idx_labels_free(&d->test_labels);
    free(d->order);
    free(d->x);
    free(d->y);
    memset(d, 0, sizeof(*d));
}

void hm_train_next_batch(hm_train_data *d)
{
    for (size_t b = 0; b < d->batch; b++) {
        if (d->pos == d->train.n)
            shuffle(d);
        size_t i = d->order[d->pos++];
        memcpy(d->x + b * d->pix, d->train.data + i * d->pix, d->pix * sizeof(float));
        d->y[b] = d->train_labels.data[i];
    }
}

double hm_train_evaluate(hm_model *m, const hm_model_experts *ex, const hm_train_data *d,
                         size_t *failed_out)
{
    size_t bs = hm_model_config_of(m)->max_batch, correct = 0, failed = 0;
    for (size_t i = 0; i < d->test.n; i += bs) {
        size_t b = d->test.n - i < bs ? d->test.n - i : bs;
        hm_model_result res;
        if (hm_model_forward(m, ex, d->test.data + i * d->pix, d->test_labels.data + i, b, NULL,
                             &res) == 0)
            correct += res.correct;
        else
            failed++;
    }
    if (failed_out != NULL)
        *failed_out = failed;
    return (double)correct / (double)d->test.n;
}

/*
 * The signal that asked us to stop. OpenBLAS starts its threads before
 * main, and a blocked signal can still land on one of them and kill the
 * process, so the signals get a handler (process-wide) rather than a mask;
 * a handler can only talk through a variable like this one.
 */
static volatile sig_atomic_t stop_signal;

static void on_stop_signal(int sig) { stop_signal = sig; }

int hm_train_signals_block(sigset_t *set)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigemptyset(set);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGTERM);
    if (sigaction(SIGINT, &sa, NULL) < 0 || sigaction(SIGTERM, &sa, NULL) < 0)
        return -errno;
    return 0;
}

int hm_train_stop_requested(const sigset_t *set)
{
    (void)set;
    return (int)stop_signal;
}

uint64_t hm_train_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

double hm_train_seconds(uint64_t start_us)
{
    return (double)(hm_train_now_us() - start_us) / 1e6;
}

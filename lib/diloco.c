/*
 * diloco: DiLoCo in libhivemind (hivemind.h, "DiLoCo"). It owns a DiLoCo
 * optimizer's two shared buffers: the state (header, outer parameters,
 * momentum, laid out as hivemind.h describes, so that state.share and
 * state.load take it as it is, without a copy) and the pseudo-gradient
 * that the daemon averages in place. The arithmetic is torch.optim.SGD's
 * (nesterov=True, dampening 0) in float32, in the same order of
 * operations, so that a PyTorch reference matches to the last bits.
 *
 * Everything goes through the public calls of client.c (hmc_average,
 * hmc_call, hmc_buf_*): this file holds no connection state of its own.
 * The one input from outside that is not the daemon's own reply is a
 * loaded state, which comes from other peers: hmc_diloco_state_check
 * reads it whole (header, length, every value finite) before any of it
 * is used, and a state that fails the check is dropped for our own start.
 */
#include "config.h"

#include "lib/hivemind.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The outer step must round as torch's separate multiply and add do: no
 * fused multiply-add, whatever -march the library is built with. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* client.c: sets hmc_last_error(h) for a local failure. */
void hm_lib_set_error(hmc *h, const char *msg);

#define MAGIC "HMDILOCO"
#define STATE_VERSION 1u
#define FLAG_MOMENTUM 1u
/* One round's vector: the daemon takes at most 2^30 elements a round and a
 * state of 2 n floats, so 2^28 keeps both well inside. */
#define MAX_PARAMS ((size_t)1 << 28)
/* What the state.load call waits on top of its own timeout. */
#define LOAD_SLACK_MS 15000
/* A state.share with wait: the daemon's DHT put (5 s at most) and slack,
 * plus a second for every 32 MiB it hashes first (it does ~1 GB/s). */
#define SHARE_WAIT_MS 30000
#define SHARE_HASH_BYTES_PER_S ((size_t)32 << 20)
#define PREFIX_MAX 128

struct hmc_diloco {
    hmc *h;
    hmc_diloco_opts o;
    char run_id[HMC_DILOCO_RUN_MAX + 1];
    char compression[16];
    char state_prefix[PREFIX_MAX];
    size_t n;
    hmc_buf *state; /* header, outer[n], momentum[n] */
    hmc_buf *grad;  /* the pseudo-gradient, n floats */
    hmc_buf *spare; /* a catch-up load's target, allocated at the first miss */
    float *outer, *mom;
    uint64_t round;
    int has_mom;
    unsigned count;
    int begun;
};

typedef struct {
    char magic[8];
    uint32_t version;
    uint32_t flags;
    uint64_t n_params;
    uint64_t round;
} state_header;

_Static_assert(sizeof(state_header) == HMC_DILOCO_STATE_HEADER, "the state header is 32 bytes");

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void report_clear(hmc_diloco_report *rep)
{
    if (rep != NULL)
        memset(rep, 0, sizeof(*rep));
}

/* Records a failed call's outcome in rep (the handle's sentence and code). */
static void report_failure(hmc_diloco *d, hmc_diloco_report *rep, int status)
{
    if (rep == NULL)
        return;
    rep->status = status;
    snprintf(rep->code, sizeof(rep->code), "%s", hmc_last_error_code(d->h));
    snprintf(rep->error, sizeof(rep->error), "%s", hmc_last_error(d->h));
}

void hmc_diloco_opts_init(hmc_diloco_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->inner_steps = 500;
    o->outer_lr = 0.7;
    o->outer_momentum = 0.9;
    o->weight = 1.0;
    o->load_state = 1;
    o->share_state = 1;
    o->load_timeout_s = 30.0;
    o->state_min_agree = 1;
    o->catch_up = 1;
}

static size_t state_bytes(size_t n) { return HMC_DILOCO_STATE_HEADER + 2 * n * sizeof(float); }

int hmc_diloco_state_check(const void *blob, size_t len, size_t n_params, uint64_t *round_out,
                           int *has_momentum_out)
{
    state_header hd;
    if (blob == NULL || n_params == 0 || n_params > MAX_PARAMS || len < sizeof(hd))
        return -EPROTO;
    memcpy(&hd, blob, sizeof(hd));
    if (memcmp(hd.magic, MAGIC, sizeof(hd.magic)) != 0 || hd.version != STATE_VERSION ||
        (hd.flags & ~FLAG_MOMENTUM) != 0 || hd.n_params != (uint64_t)n_params ||
        len != state_bytes(n_params))
        return -EPROTO;
    /* The values may sit at any alignment in a caller's blob: read each by memcpy. */
    const unsigned char *v = (const unsigned char *)blob + sizeof(hd);
    for (size_t i = 0; i < 2 * n_params; i++) {
        float x;
        memcpy(&x, v + i * sizeof(float), sizeof(x));
        if (!isfinite(x))
            return -EDOM;
    }
    *round_out = hd.round;
    *has_momentum_out = (hd.flags & FLAG_MOMENTUM) != 0;
    return 0;
}

static void write_header(hmc_diloco *d)
{
    state_header hd;
    memcpy(hd.magic, MAGIC, sizeof(hd.magic));
    hd.version = STATE_VERSION;
    hd.flags = d->has_mom ? FLAG_MOMENTUM : 0;
    hd.n_params = d->n;
    hd.round = d->round;
    memcpy(hmc_buf_data(d->state), &hd, sizeof(hd));
}

static int check_opts(const hmc_diloco_opts *o, size_t n, char *why, size_t len)
{
    const char *bad = NULL;
    if (o == NULL || o->run_id == NULL || o->run_id[0] == '\0' ||
        strlen(o->run_id) > HMC_DILOCO_RUN_MAX)
        bad = "run_id must be 1 to 96 bytes";
    else if (n == 0 || n > MAX_PARAMS)
        bad = "n_params must be 1 to 2^28";
    else if (o->inner_steps == 0)
        bad = "inner_steps must be at least 1";
    else if (!isfinite(o->outer_lr) || !(o->outer_lr > 0))
        bad = "outer_lr must be finite and above 0";
    else if (!(o->outer_momentum >= 0 && o->outer_momentum < 1))
        bad = "outer_momentum must be in [0, 1)";
    else if (!isfinite(o->weight) || !(o->weight >= 0))
        bad = "weight must be finite and >= 0";
    else if (!(o->load_timeout_s > 0 && o->load_timeout_s <= 3600))
        bad = "load_timeout_s must be above 0 and at most 3600";
    else if (o->state_min_agree < 1 || o->state_min_agree > 32)
        bad = "state_min_agree must be 1 to 32";
    else if (o->compression != NULL && strcmp(o->compression, "none") != 0 &&
             strcmp(o->compression, "fp16") != 0 && strcmp(o->compression, "8bit") != 0)
        bad = "compression must be none, fp16 or 8bit";
    if (bad != NULL)
        snprintf(why, len, "DiLoCo: %s", bad);
    return bad != NULL ? -EINVAL : 0;
}

int hmc_diloco_open(hmc *h, const hmc_diloco_opts *o, size_t n_params, hmc_diloco **out)
{
    char why[128];
    int r;
    *out = NULL;
    if (check_opts(o, n_params, why, sizeof(why)) != 0) {
        hm_lib_set_error(h, why);
        return -EINVAL;
    }
    hmc_diloco *d = calloc(1, sizeof(*d));
    if (d == NULL)
        return -ENOMEM;
    d->h = h;
    d->o = *o;
    d->n = n_params;
    snprintf(d->run_id, sizeof(d->run_id), "%s", o->run_id);
    d->o.run_id = d->run_id;
    if (o->compression != NULL) {
        snprintf(d->compression, sizeof(d->compression), "%s", o->compression);
        d->o.compression = d->compression;
    }
    snprintf(d->state_prefix, sizeof(d->state_prefix), "%s.diloco", d->run_id);
    if ((r = hmc_buf_alloc(h, state_bytes(n_params), &d->state)) != 0 ||
        (r = hmc_buf_alloc(h, n_params * sizeof(float), &d->grad)) != 0) {
        hmc_buf_free(d->state);
        free(d);
        return r;
    }
    d->outer = (float *)((char *)hmc_buf_data(d->state) + HMC_DILOCO_STATE_HEADER);
    d->mom = d->outer + n_params;
    *out = d;
    return 0;
}

void hmc_diloco_close(hmc_diloco *d)
{
    if (d == NULL)
        return;
    hmc_buf_free(d->spare);
    hmc_buf_free(d->grad);
    hmc_buf_free(d->state);
    free(d);
}

uint64_t hmc_diloco_round(const hmc_diloco *d) { return d->round; }
unsigned hmc_diloco_inner_count(const hmc_diloco *d) { return d->count; }
const float *hmc_diloco_outer_params(const hmc_diloco *d) { return d->outer; }
const float *hmc_diloco_momentum(const hmc_diloco *d) { return d->mom; }

static int all_finite(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return 0;
    return 1;
}

/*
 * Hands the outer state to the daemon for newcomers (it copies the bytes),
 * and returns once the daemon has declared it in the DHT ("wait"): the
 * round is over for this trainer only when a newcomer that asks from then
 * on finds this round's state, not the one before it, which the DHT would
 * otherwise still name for the few milliseconds the put takes (or, with
 * the previous put still in flight, longer).
 */
static void share(hmc_diloco *d, hmc_diloco_report *rep)
{
    if (!d->o.share_state)
        return;
    write_header(d);
    char args[PREFIX_MAX + 176];
    snprintf(args, sizeof(args),
             "{\"prefix\": \"%s\", \"step\": %llu, \"wait\": true, \"data\": {\"shm\": %llu, "
             "\"offset\": 0, \"elems\": %zu}}",
             d->state_prefix, (unsigned long long)d->round,
             (unsigned long long)hmc_buf_id(d->state), state_bytes(d->n) / sizeof(float));
    int wait_ms = SHARE_WAIT_MS + (int)(state_bytes(d->n) / SHARE_HASH_BYTES_PER_S) * 1000;
    int r = hmc_call(d->h, "state.share", args, wait_ms, NULL, NULL);
    if (r == 0) {
        if (rep != NULL)
            rep->shared = 1;
    } else if (rep != NULL && rep->status == 0) {
        report_failure(d, rep, r);
    }
}

/* state.load into b (a state-sized buffer); 1 when a good state is in
 * place (its round and momentum flag in *round_out, *has_mom_out), else 0. */
static int load(hmc_diloco *d, hmc_buf *b, hmc_diloco_report *rep, uint64_t *round_out,
                int *has_mom_out)
{
    char args[PREFIX_MAX + 192];
    char *res = NULL;
    snprintf(args, sizeof(args),
             "{\"prefix\": \"%s\", \"min_agree\": %d, \"timeout\": %.3f, "
             "\"data\": {\"shm\": %llu, \"offset\": 0, \"elems\": %zu}}",
             d->state_prefix, d->o.state_min_agree, d->o.load_timeout_s,
             (unsigned long long)hmc_buf_id(b), state_bytes(d->n) / sizeof(float));
    int wait_ms = (int)(d->o.load_timeout_s * 1000.0) + LOAD_SLACK_MS;
    int r = hmc_call(d->h, "state.load", args, wait_ms, &res, NULL);
    if (r != 0) {
        report_failure(d, rep, r);
        return 0;
    }
    json_t *j = json_loads(res, 0, NULL);
    hmc_free_string(res);
    json_t *step = json_object_get(j, "step"), *bytes = json_object_get(j, "bytes");
    uint64_t round = 0;
    int has_mom = 0, ok = 0;
    if (json_is_integer(step) && json_is_integer(bytes) && json_integer_value(bytes) >= 0 &&
        hmc_diloco_state_check(hmc_buf_data(b), (size_t)json_integer_value(bytes), d->n,
                               &round, &has_mom) == 0 &&
        json_integer_value(step) >= 0 && (uint64_t)json_integer_value(step) == round)
        ok = 1;
    json_decref(j);
    if (!ok) {
        if (rep != NULL) {
            rep->status = -EPROTO;
            snprintf(rep->code, sizeof(rep->code), "bad_state");
            snprintf(rep->error, sizeof(rep->error),
                     "the state loaded under '%s' is not a DiLoCo state of %zu parameters "
                     "(or holds NaN or infinity, or its round is not its step)",
                     d->state_prefix, d->n);
        }
        return 0;
    }
    *round_out = round;
    *has_mom_out = has_mom;
    return 1;
}

int hmc_diloco_begin(hmc_diloco *d, float *params, hmc_diloco_report *rep)
{
    report_clear(rep);
    if (d->begun || params == NULL || !all_finite(params, d->n))
        return -EINVAL;
    double t0 = now_s();
    int loaded = d->o.load_state ? load(d, d->state, rep, &d->round, &d->has_mom) : 0;
    if (loaded) {
        memcpy(params, d->outer, d->n * sizeof(float));
    } else {
        /* A failed load may have written part of the buffer. */
        memcpy(d->outer, params, d->n * sizeof(float));
        memset(d->mom, 0, d->n * sizeof(float));
        d->round = 0;
        d->has_mom = 0;
    }
    d->begun = 1;
    d->count = 0;
    if (rep != NULL) {
        rep->loaded = loaded;
        rep->round = d->round;
        rep->average_s = now_s() - t0;
    }
    share(d, rep);
    return 0;
}

int hmc_diloco_inner_done(hmc_diloco *d)
{
    if (d->count < d->o.inner_steps)
        d->count++;
    return d->count >= d->o.inner_steps;
}

/* g = outer - params into the grad buffer; returns its squared norm (NaN if not finite). */
static double pseudo_grad(hmc_diloco *d, const float *params)
{
    float *g = hmc_buf_data(d->grad);
    double ss = 0;
    for (size_t i = 0; i < d->n; i++) {
        g[i] = d->outer[i] - params[i];
        ss += (double)g[i] * (double)g[i];
    }
    return ss;
}

/*
 * After a miss: the newest state peers share, into the spare buffer (a
 * failed load must not touch ours); taken only when it is of a later round
 * than the one we just closed, so a trainer that is not behind keeps its
 * own step. The miss's code and sentence stay in rep.
 */
static void catch_up(hmc_diloco *d, hmc_diloco_report *rep)
{
    hmc_diloco_report scratch;
    uint64_t round;
    int has_mom;
    if (d->spare == NULL && hmc_buf_alloc(d->h, state_bytes(d->n), &d->spare) != 0)
        return;
    report_clear(&scratch);
    if (!load(d, d->spare, &scratch, &round, &has_mom) || round <= d->round)
        return;
    memcpy(d->outer, (char *)hmc_buf_data(d->spare) + HMC_DILOCO_STATE_HEADER,
           2 * d->n * sizeof(float));
    d->round = round;
    d->has_mom = has_mom;
    if (rep != NULL)
        rep->caught_up = 1;
}

int hmc_diloco_outer_step(hmc_diloco *d, float *params, hmc_diloco_report *rep)
{
    report_clear(rep);
    if (!d->begun || params == NULL)
        return -EINVAL;
    if (!all_finite(params, d->n))
        return -EDOM;
    double ss = pseudo_grad(d, params);
    if (!isfinite(ss))
        return -EDOM;

    char prefix[PREFIX_MAX];
    snprintf(prefix, sizeof(prefix), "%s.diloco.%llu", d->run_id, (unsigned long long)d->round);
    hmc_avg_opts ao;
    hmc_avg_opts_init(&ao);
    ao.prefix = prefix;
    ao.weight = d->o.weight;
    ao.timeout_s = d->o.timeout_s;
    ao.round_timeout_s = d->o.round_timeout_s;
    ao.matchmaking_time_s = d->o.matchmaking_time_s;
    ao.target_group_size = d->o.target_group_size;
    ao.min_group_size = d->o.min_group_size;
    ao.compression = d->o.compression;
    char *report = NULL;
    double t0 = now_s();
    int r = hmc_average(d->h, d->grad, 0, d->n, &ao, &report);
    int averaged = 0, group = 0;
    if (r == 0) {
        json_t *j = json_loads(report, 0, NULL);
        json_t *gs = json_object_get(j, "group_size");
        group = json_is_integer(gs) ? (int)json_integer_value(gs) : 0;
        json_decref(j);
        /* The daemon refuses non-finite input, yet the average comes back
         * through shared memory that others could write: check it. */
        averaged = all_finite(hmc_buf_data(d->grad), d->n);
    }
    hmc_free_string(report);
    if (r != 0)
        report_failure(d, rep, r);
    if (!averaged) {
        /* A miss: our own pseudo-gradient, which a failed round may have
         * partly overwritten with averaged chunks. */
        if (r == 0 && rep != NULL) {
            rep->status = -EDOM;
            snprintf(rep->code, sizeof(rep->code), "bad_average");
            snprintf(rep->error, sizeof(rep->error), "the averaged pseudo-gradient holds NaN "
                     "or infinity");
        }
        pseudo_grad(d, params);
    }
    if (rep != NULL) {
        rep->round = d->round;
        rep->averaged = averaged;
        rep->group_size = averaged ? group : 0;
        rep->average_s = now_s() - t0;
        rep->pseudo_grad_norm = sqrt(ss);
    }

    /* torch.optim.SGD, nesterov=True, dampening 0, in float32:
     * buf.mul_(m).add_(g); d = g.add(buf, alpha=m); p.add_(d, alpha=-lr). */
    const float *g = hmc_buf_data(d->grad);
    const float m = (float)d->o.outer_momentum, lr = (float)d->o.outer_lr;
    for (size_t i = 0; i < d->n; i++) {
        float b = d->has_mom ? d->mom[i] * m + g[i] : g[i];
        d->mom[i] = b;
        float step = g[i] + m * b;
        d->outer[i] = d->outer[i] + -lr * step;
    }
    d->has_mom = 1;
    d->round++;
    if (!averaged && d->o.catch_up)
        catch_up(d, rep);
    memcpy(params, d->outer, d->n * sizeof(float));
    d->count = 0;
    share(d, rep);
    return 0;
}

int hmc_diloco_step(hmc_diloco *d, float *params, hmc_diloco_report *rep)
{
    report_clear(rep);
    if (!d->begun)
        return -EINVAL;
    if (!hmc_diloco_inner_done(d))
        return 0;
    int r = hmc_diloco_outer_step(d, params, rep);
    return r < 0 ? r : 1;
}

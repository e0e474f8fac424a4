/*
 * optimizer: the collaborative optimizer of libhivemind (hivemind.h,
 * hmc_opt_*): gradient accumulation toward a swarm-wide batch, epochs
 * from the daemon's progress aggregate, sample-weighted gradient
 * averaging at an epoch's end, and the local step. It owns the
 * accumulator (a shared buffer, which the daemon averages in place) and a
 * copy of the local mean gradient for the fallback; the hmc handle stays
 * the caller's. With delay_step a second buffer holds the epoch whose
 * round runs in the background while the next epoch accumulates.
 */
#include "config.h"

#include "lib/hivemind.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* client.c: sets hmc_last_error(h) for a local failure. */
void hm_lib_set_error(hmc *h, const char *msg);

#define RUN_MAX 128
/*
 * How long after opening the optimizer trusts an empty view of the run: a
 * peer's record reaches the others within about 1.5 s (the daemon's 0.5 s
 * publication gap and 1 s read cache), so before this a trainer that sees
 * nobody may simply not see them yet, and averages all the same.
 */
#define DISCOVERY_S 5.0
/*
 * The shortest gap between two progress reports and reads of a trainer:
 * the daemon publishes a record at most every 0.5 s and caches what it
 * reads for 1 s, so polling it at every step of a fast trainer only adds
 * two control-socket round trips (and, on a loaded machine, two context
 * switches) to each step, for news no fresher. Our own samples reaching
 * the target are never waited for.
 */
#define POLL_S 0.05

struct hmc_opt {
    hmc *h;
    hmc_opt_opts opts;
    char run[RUN_MAX + 1];
    char compression[8];
    char peer_id[64];
    size_t n;
    hmc_buf *buf;  /* the accumulator: sum of grads * batch size, then the mean */
    hmc_buf *pend; /* delay_step: the mean of the epoch whose round runs in the background */
    hmc_round *round; /* that round; NULL when the epoch had nobody to average with */
    int pending;      /* pend holds an epoch whose step has not run yet */
    uint64_t pend_epoch;
    hmc_buf *state; /* the parameters shared, loaded or averaged */
    float *local;  /* the local mean, kept for a failed round */
    uint64_t epoch, global_epoch, samples;
    uint64_t others_samples; /* the others' at our epoch, as last read */
    double last_poll_s;
    size_t others; /* other trainers in the run, as last read */
    double sps, last_step_s, opened_s;
    double ahead_since_s; /* since when our epoch's end waits for the swarm (0: it does not) */
    int ahead_gave_up;    /* a hold timed out: none again until the swarm reaches our epoch */
    double eta_s;  /* the swarm's estimate of the time to our epoch's end, < 0 unknown */
    /* -- scheduled rounds -- */
    hmc_round *sched;       /* this epoch's gradient round, matched ahead and held (on buf) */
    uint64_t sched_epoch;   /* the epoch it was scheduled for */
    int sched_tried;        /* one schedule per epoch */
    double sched_start_s;   /* when its matchmaking began */
    /* -- optimizer statistics and state -- */
    char stat_names[HMC_OPT_STAT_NAMES_MAX + 1];
    size_t state_off;       /* floats before the parameters in the state: header and names */
    size_t state_elems;     /* floats of the whole state */
    /* -- local updates with the delta rule -- */
    hmc_round *state_round; /* local_updates: the epoch end's state average, in the background */
    float *snap;            /* what it started from: parameters then statistics */
    float *stats_tmp;       /* the statistics now, to add the delta to */
    /* -- delayed local steps (delay_step with local_updates) -- */
    int bg;                 /* the local step runs on a thread of its own */
    int bg_running;         /* one runs now: step(off, gcopy) */
    pthread_t bg_thread;
    float *off;             /* its own copy of the parameters */
    float *gcopy;           /* the gradients it steps on */
    uint64_t bg_epoch;      /* the epoch of those gradients */
};

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* -- optimizer statistics and state -- */

static size_t pad4(size_t len) { return (len + 3) & ~(size_t)3; }

/* Statistics names: 1..HMC_OPT_STAT_NAMES_MAX printable bytes. */
static int names_ok(const char *names)
{
    if (names == NULL || names[0] == '\0')
        return 0;
    size_t len = strnlen(names, HMC_OPT_STAT_NAMES_MAX + 1);
    if (len > HMC_OPT_STAT_NAMES_MAX)
        return 0;
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)names[i] < 0x20 || (unsigned char)names[i] > 0x7e)
            return 0;
    return 1;
}

int hmc_opt_state_check(const void *blob, size_t len, size_t n_params, size_t n_stats,
                        const char *stat_names, uint64_t *epoch_out)
{
    const unsigned char *b = blob;
    uint32_t version, names_len;
    uint64_t np, ns, epoch;
    const char *names = stat_names != NULL ? stat_names : "";
    size_t want_names = strlen(names);
    if (blob == NULL || len < HMC_OPT_STATE_HEADER || memcmp(b, "HMOPTST1", 8) != 0)
        return -EPROTO;
    memcpy(&version, b + 8, 4);
    memcpy(&names_len, b + 12, 4);
    memcpy(&np, b + 16, 8);
    memcpy(&ns, b + 24, 8);
    memcpy(&epoch, b + 32, 8);
    /* Sizes are compared with ours before any arithmetic on them. */
    if (version != 1 || names_len != want_names || np != n_params || ns != n_stats ||
        n_params > ((size_t)1 << 30) || n_stats > ((size_t)1 << 30))
        return -EPROTO;
    size_t off = HMC_OPT_STATE_HEADER + pad4(names_len);
    if (len != off + (n_params + n_stats) * sizeof(float) ||
        memcmp(b + HMC_OPT_STATE_HEADER, names, names_len) != 0)
        return -EPROTO;
    for (size_t i = names_len; i < pad4(names_len); i++)
        if (b[HMC_OPT_STATE_HEADER + i] != 0)
            return -EPROTO;
    for (size_t i = 0; i < n_params + n_stats; i++) {
        float x;
        memcpy(&x, b + off + i * sizeof(float), sizeof(x));
        if (!isfinite(x))
            return -EDOM;
    }
    if (epoch_out != NULL)
        *epoch_out = epoch;
    return 0;
}

/* Writes our state into the state buffer: header, names, params, statistics. */
static void state_fill(hmc_opt *o, const float *params)
{
    unsigned char *b = hmc_buf_data(o->state);
    uint32_t version = 1, names_len = (uint32_t)strlen(o->stat_names);
    uint64_t np = o->n, ns = o->opts.n_stats, epoch = o->epoch;
    memset(b, 0, o->state_off * sizeof(float));
    memcpy(b, "HMOPTST1", 8);
    memcpy(b + 8, &version, 4);
    memcpy(b + 12, &names_len, 4);
    memcpy(b + 16, &np, 8);
    memcpy(b + 24, &ns, 8);
    memcpy(b + 32, &epoch, 8);
    memcpy(b + HMC_OPT_STATE_HEADER, o->stat_names, names_len);
    float *f = (float *)hmc_buf_data(o->state) + o->state_off;
    memcpy(f, params, o->n * sizeof(float));
    if (o->opts.n_stats > 0)
        o->opts.stats_get(o->opts.step_ud, f + o->n, o->opts.n_stats);
}

/* Takes the parameters and statistics back from the state buffer. */
static void state_take(hmc_opt *o, float *params)
{
    const float *f = (const float *)hmc_buf_data(o->state) + o->state_off;
    memcpy(params, f, o->n * sizeof(float));
    if (o->opts.n_stats > 0)
        o->opts.stats_set(o->opts.step_ud, f + o->n, o->opts.n_stats);
}

void hmc_opt_opts_init(hmc_opt_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->matchmaking_time_s = 5;
    o->averaging_timeout_s = 30;
    o->target_group_size = 16;
}

static int sched_go(hmc_opt *o, double weight);

uint64_t hmc_opt_local_epoch(const hmc_opt *o) { return o->epoch; }
uint64_t hmc_opt_global_epoch(const hmc_opt *o) { return o->global_epoch; }

static void bg_wait(hmc_opt *o);

void hmc_opt_close(hmc_opt *o)
{
    if (o == NULL)
        return;
    bg_wait(o); /* its result is dropped: nobody takes it any more */
    free(o->off);
    free(o->gcopy);
    /*
     * A round still running reads and writes pend: it is waited for (at
     * most its own deadline) so that the segment is not released under it.
     */
    if (o->round != NULL)
        hmc_round_wait(o->round, -1, NULL);
    hmc_round_free(o->round);
    if (o->state_round != NULL)
        hmc_round_wait(o->state_round, -1, NULL);
    hmc_round_free(o->state_round);
    free(o->snap);
    free(o->stats_tmp);
    /* A group was found with us in it: we take part with nothing rather
     * than leave its members to time us out (the daemon keeps the range). */
    if (o->sched != NULL) {
        memset(hmc_buf_data(o->buf), 0, o->n * sizeof(float));
        if (sched_go(o, 0))
            hmc_round_free(o->sched);
    }
    hmc_buf_free(o->buf);
    hmc_buf_free(o->pend);
    hmc_buf_free(o->state);
    free(o->local);
    free(o);
}

int hmc_opt_open(hmc *h, const hmc_opt_opts *opts, size_t n_params, hmc_opt **out)
{
    char *info = NULL;
    int r;
    *out = NULL;
    if (h == NULL || opts == NULL || opts->run_id == NULL || opts->run_id[0] == '\0' ||
        strlen(opts->run_id) > RUN_MAX || opts->target_batch_size == 0 || opts->step == NULL ||
        n_params == 0 || n_params > ((size_t)1 << 30) || opts->matchmaking_time_s < 0 ||
        opts->averaging_timeout_s < 0 || opts->target_group_size < 0 ||
        opts->target_group_size > 64 ||
        opts->n_stats > ((size_t)1 << 30) ||
        (opts->n_stats > 0 && (opts->stats_get == NULL || opts->stats_set == NULL ||
                               !names_ok(opts->stat_names))) ||
        (opts->compression != NULL && strcmp(opts->compression, "none") != 0 &&
         strcmp(opts->compression, "fp16") != 0 && strcmp(opts->compression, "8bit") != 0))
        return -EINVAL;
    hmc_opt *o = calloc(1, sizeof(*o));
    if (o == NULL)
        return -ENOMEM;
    o->h = h;
    o->opts = *opts;
    o->opened_s = mono_s();
    o->n = n_params;
    snprintf(o->run, sizeof(o->run), "%s", opts->run_id);
    snprintf(o->compression, sizeof(o->compression), "%s",
             opts->compression != NULL ? opts->compression : "none");
    o->opts.run_id = o->run;
    o->opts.compression = o->compression;
    if (o->opts.n_stats > 0)
        snprintf(o->stat_names, sizeof(o->stat_names), "%s", opts->stat_names);
    o->opts.stat_names = o->stat_names;
    o->state_off = (HMC_OPT_STATE_HEADER + pad4(strlen(o->stat_names))) / sizeof(float);
    o->state_elems = o->state_off + n_params + o->opts.n_stats;
    if (o->opts.matchmaking_time_s == 0)
        o->opts.matchmaking_time_s = 5;
    if (o->opts.averaging_timeout_s == 0)
        o->opts.averaging_timeout_s = 30;
    if (o->opts.target_group_size == 0)
        o->opts.target_group_size = 16;
    o->local = malloc(n_params * sizeof(float));
    if (o->local == NULL) {
        r = -ENOMEM;
        goto fail;
    }
    if ((r = hmc_buf_alloc(h, n_params * sizeof(float), &o->buf)) != 0)
        goto fail;
    if (o->opts.load_timeout_s <= 0)
        o->opts.load_timeout_s = 30;
    if (o->opts.local_updates && o->opts.average_state_every == 0)
        o->opts.average_state_every = 1;
    if (o->opts.local_updates &&
        ((o->snap = malloc((n_params + o->opts.n_stats) * sizeof(float))) == NULL ||
         (o->opts.n_stats > 0 &&
          (o->stats_tmp = malloc(o->opts.n_stats * sizeof(float))) == NULL))) {
        r = -ENOMEM;
        goto fail;
    }
    o->bg = o->opts.delay_step && o->opts.local_updates;
    if (o->bg && ((o->off = malloc(n_params * sizeof(float))) == NULL ||
                  (o->gcopy = malloc(n_params * sizeof(float))) == NULL)) {
        r = -ENOMEM;
        goto fail;
    }
    if (o->opts.delay_step && !o->opts.local_updates &&
        (r = hmc_buf_alloc(h, n_params * sizeof(float), &o->pend)) != 0)
        goto fail;
    if ((o->opts.share_state || o->opts.average_state_every > 0) &&
        (r = hmc_buf_alloc(h, o->state_elems * sizeof(float), &o->state)) != 0)
        goto fail;
    /* Our own record is replaced by the exact local count when reading the swarm's. */
    if ((r = hmc_info(h, &info)) != 0)
        goto fail;
    json_t *j = json_loads(info, 0, NULL);
    hmc_free_string(info);
    const char *pid = json_string_value(json_object_get(j, "peer_id"));
    snprintf(o->peer_id, sizeof(o->peer_id), "%s", pid != NULL ? pid : "");
    json_decref(j);
    /* The trainer is in the swarm from the start, at epoch 0. */
    if ((r = hmc_progress_report(h, o->run, 0, 0, 0, o->opts.client)) != 0)
        goto fail;
    *out = o;
    return 0;
fail:
    hmc_opt_close(o);
    return r;
}

/*
 * Reads the swarm's progress: the global epoch and the samples reported
 * at our epoch, raw (never extrapolated), with our own exact count in
 * place of our record.
 */
static int read_swarm(hmc_opt *o, uint64_t *swarm_out)
{
    char *text = NULL;
    hmc_progress p;
    int r = hmc_progress_get(o->h, o->run, o->opts.target_batch_size, &p, &text);
    if (r != 0)
        return r;
    json_t *j = json_loads(text, 0, NULL);
    hmc_free_string(text);
    if (j == NULL)
        return -EPROTO;
    uint64_t sum = o->samples;
    size_t i;
    o->others = 0;
    const json_t *peer;
    json_array_foreach(json_object_get(j, "peers"), i, peer) {
        const char *id = json_string_value(json_object_get(peer, "peer"));
        if (id != NULL && strcmp(id, o->peer_id) == 0)
            continue;
        o->others++;
        if ((uint64_t)json_integer_value(json_object_get(peer, "epoch")) == o->epoch)
            sum += (uint64_t)json_integer_value(json_object_get(peer, "samples"));
    }
    json_decref(j);
    o->global_epoch = p.global_epoch;
    o->eta_s = p.global_epoch == o->epoch ? p.eta_s : -1;
    o->others_samples = sum - o->samples;
    *swarm_out = sum;
    return 0;
}

/*
 * Whether our epoch's end waits for the swarm: our epoch is past the
 * global one, which moves only once more than half of the trainer origins
 * reach an epoch (ProgressEpochMajority), and another trainer is there.
 * Ending it on our own samples would put us two epochs ahead, where no
 * one averages with us, and the trainers would drift apart for good: the
 * others count only the samples reported at their own epoch. So we keep
 * accumulating, and the end comes when the swarm reaches our epoch (its
 * samples then count with ours), or after averaging_timeout_s, so that
 * trainers that are stopped or dead, but still on record, hold us up no
 * longer than a round that fails would. After a hold timed out we do not
 * hold again until the swarm has reached our epoch: a global epoch kept
 * low for good (a hung trainer whose record stays fresh, as many hostile
 * origins as honest ones) costs one timeout, not one per epoch.
 */
static int held_ahead(hmc_opt *o, double now)
{
    if (o->epoch <= o->global_epoch || o->others == 0) {
        o->ahead_since_s = 0;
        o->ahead_gave_up = 0;
        return 0;
    }
    if (o->ahead_gave_up)
        return 0;
    if (o->ahead_since_s == 0)
        o->ahead_since_s = now;
    if (now - o->ahead_since_s < o->opts.averaging_timeout_s)
        return 1;
    o->ahead_gave_up = 1;
    return 0;
}

/* The gradient round's options for our epoch; prefix holds its name. */
static void grad_opts(hmc_opt *o, hmc_avg_opts *out, char *prefix, size_t size)
{
    hmc_avg_opts ao;
    snprintf(prefix, size, "%s.grad.%llu", o->run, (unsigned long long)o->epoch);
    hmc_avg_opts_init(&ao);
    ao.prefix = prefix;
    ao.weight = (double)o->samples;
    ao.timeout_s = o->opts.matchmaking_time_s;
    ao.matchmaking_time_s = o->opts.matchmaking_time_s;
    ao.round_timeout_s = o->opts.averaging_timeout_s;
    ao.target_group_size = o->opts.target_group_size;
    ao.min_group_size = o->opts.target_group_size > 1 ? 2 : 1;
    ao.compression = o->compression;
    ao.client_mode = o->opts.client;
    *out = ao;
}

/*
 * Fills the report from a round's outcome r (its report json, or why it
 * failed: msg, code) and, when it failed, puts our own mean back in b.
 */
static void outcome(hmc_opt *o, hmc_buf *b, int r, const char *json, const char *msg,
                    const char *code, hmc_opt_report *rep)
{
    if (r == 0) {
        json_t *j = json_loads(json != NULL ? json : "", 0, NULL);
        rep->group_size = (int)json_integer_value(json_object_get(j, "group_size"));
        json_decref(j);
        rep->averaged = 1;
    } else {
        /* Chunks a failed round did not average keep whatever they hold: use ours. */
        memcpy(hmc_buf_data(b), o->local, o->n * sizeof(float));
        rep->local_fallback = 1;
        snprintf(rep->error, sizeof(rep->error), "%s%s%s%s", msg, code[0] ? " (" : "", code,
                 code[0] ? ")" : "");
    }
}

/* -- scheduled rounds -- */

/*
 * Matchmaking ahead of the epoch's end (Hivemind's scheduled step): once
 * the swarm's estimated time to the target is within matchmaking_time_s,
 * the epoch's gradient round starts on the accumulator with "hold": the
 * daemon finds the group meanwhile, and the all-reduce waits for
 * hmc_average_go at the epoch's end, so it begins on time instead of a
 * matchmaking time later. Until then the daemon leaves the buffer alone
 * (the all-reduce copies its input when it begins), so accumulation goes
 * on into it. One schedule per epoch; one that fails (no group, or not
 * released in time) leaves the epoch's end to an ordinary round.
 */
static void sched_maybe_start(hmc_opt *o, uint64_t swarm)
{
    char prefix[RUN_MAX + 48], extra[128];
    hmc_avg_opts ao;
    if (o->sched != NULL || o->sched_tried || o->opts.local_updates || o->others == 0 ||
        o->global_epoch != o->epoch || o->eta_s < 0 || o->eta_s > o->opts.matchmaking_time_s ||
        swarm >= o->opts.target_batch_size)
        return;
    o->sched_tried = 1;
    grad_opts(o, &ao, prefix, sizeof(prefix));
    /* Long enough to find the group before the end and for one more
     * window after it, should the estimate have been early. */
    ao.timeout_s = 2 * o->opts.matchmaking_time_s;
    snprintf(extra, sizeof(extra), "{\"hold\":true,\"hold_timeout\":%.3f}",
             2 * o->opts.matchmaking_time_s + o->opts.averaging_timeout_s);
    ao.extra_json = extra;
    if (hmc_average_start(o->h, o->buf, 0, o->n, &ao, &o->sched) != 0) {
        o->sched = NULL;
        return;
    }
    o->sched_epoch = o->epoch;
    o->sched_start_s = mono_s();
}

/*
 * Releases the scheduled round with weight (the buffer holding what is to
 * be averaged); 1 when it was released, 0 when it was over already (no
 * group, or past its hold) and is dropped: the buffer is then untouched.
 */
static int sched_go(hmc_opt *o, double weight)
{
    char prefix[RUN_MAX + 48];
    if (o->sched == NULL)
        return 0;
    snprintf(prefix, sizeof(prefix), "%s.grad.%llu", o->run, (unsigned long long)o->sched_epoch);
    if (hmc_average_go(o->h, prefix, weight) == 0)
        return 1;
    /* Nothing held under that prefix: the round is over; its reply is near. */
    hmc_round_wait(o->sched, -1, NULL);
    hmc_round_free(o->sched);
    o->sched = NULL;
    return 0;
}

/*
 * Ends a scheduled round that this epoch does not use: released with
 * weight 0 and an emptied buffer (its group keeps a member that reduces
 * its span and adds nothing) and waited for, since the daemon writes the
 * buffer until it is over. 1 when it averaged with others.
 */
static int sched_drop(hmc_opt *o, hmc_opt_report *rep)
{
    int averaged = 0;
    if (o->sched == NULL)
        return 0;
    memset(hmc_buf_data(o->buf), 0, o->n * sizeof(float));
    if (sched_go(o, 0)) {
        char *json = NULL;
        if (hmc_round_wait(o->sched, -1, &json) == 0) {
            json_t *j = json_loads(json != NULL ? json : "", 0, NULL);
            if (rep != NULL)
                rep->tagged_along_group = (int)json_integer_value(json_object_get(j, "group_size"));
            json_decref(j);
            averaged = 1;
        }
        hmc_free_string(json);
        hmc_round_free(o->sched);
        o->sched = NULL;
        memset(hmc_buf_data(o->buf), 0, o->n * sizeof(float));
    }
    return averaged;
}

/* Averages the accumulated mean with the epoch's peers; fills the report. */
static void average(hmc_opt *o, hmc_opt_report *rep)
{
    char prefix[RUN_MAX + 48], *json = NULL;
    hmc_avg_opts ao;
    double lead = mono_s() - o->sched_start_s;
    if (sched_go(o, (double)o->samples)) {
        int r = hmc_round_wait(o->sched, -1, &json);
        if (r == -EAGAIN)
            r = -ETIMEDOUT;
        rep->scheduled = 1;
        rep->matchmaking_lead_s = lead;
        outcome(o, o->buf, r, json, hmc_round_error(o->sched), hmc_round_error_code(o->sched),
                rep);
        hmc_free_string(json);
        hmc_round_free(o->sched);
        o->sched = NULL;
        return;
    }
    grad_opts(o, &ao, prefix, sizeof(prefix));
    int r = hmc_average(o->h, o->buf, 0, o->n, &ao, &json);
    outcome(o, o->buf, r, json, hmc_last_error(o->h), hmc_last_error_code(o->h), rep);
    hmc_free_string(json);
}

/*
 * delay_step: runs the pending epoch's step once its round is over (at
 * once when block, waiting at most for the round's own deadline, which
 * averaging_timeout_s bounds). 1 when the step ran.
 */
static int finish_pending(hmc_opt *o, int block, float *params, hmc_opt_report *rep)
{
    char *json = NULL;
    if (!o->pending)
        return 0;
    if (o->round != NULL) {
        if (!block && !hmc_round_done(o->round))
            return 0;
        int r = hmc_round_wait(o->round, -1, &json);
        if (r == -EAGAIN) /* past its deadline and still no reply: treat it as failed */
            r = -ETIMEDOUT;
        outcome(o, o->pend, r, json, hmc_round_error(o->round), hmc_round_error_code(o->round),
                rep);
        hmc_free_string(json);
        hmc_round_free(o->round);
        o->round = NULL;
    } else {
        rep->local_fallback = 1;
        snprintf(rep->error, sizeof(rep->error), "no other trainer in run '%s'", o->run);
    }
    o->opts.step(o->opts.step_ud, params, hmc_buf_data(o->pend), o->n);
    o->pending = 0;
    rep->stepped = 1;
    rep->stepped_epoch = o->pend_epoch;
    return 1;
}

/*
 * delay_step: hands the epoch's mean (in buf) to a background round and
 * takes pend as the next epoch's accumulator. A round that cannot start
 * leaves the mean as it is, to be stepped on alone.
 */
static void start_pending(hmc_opt *o, int with_peers, hmc_opt_report *rep)
{
    char prefix[RUN_MAX + 48];
    hmc_avg_opts ao;
    hmc_buf *b = o->buf;
    o->buf = o->pend;
    o->pend = b;
    o->pending = 1;
    o->pend_epoch = o->epoch;
    o->round = NULL;
    memset(hmc_buf_data(o->buf), 0, o->n * sizeof(float));
    if (!with_peers)
        return;
    /* A round scheduled on that buffer (now pend) runs as the pending one. */
    double lead = mono_s() - o->sched_start_s;
    if (sched_go(o, (double)o->samples)) {
        o->round = o->sched;
        o->sched = NULL;
        rep->scheduled = 1;
        rep->matchmaking_lead_s = lead;
        return;
    }
    grad_opts(o, &ao, prefix, sizeof(prefix));
    if (hmc_average_start(o->h, o->pend, 0, o->n, &ao, &o->round) != 0) {
        o->round = NULL;
        snprintf(rep->error, sizeof(rep->error), "%s", hmc_last_error(o->h));
    }
}

/* Averages the parameters with the peers that reached the same epoch; 1 when it did. */
static int average_params(hmc_opt *o, float *params)
{
    char prefix[RUN_MAX + 48];
    hmc_avg_opts ao;
    snprintf(prefix, sizeof(prefix), "%s.params.%llu", o->run, (unsigned long long)o->epoch);
    state_fill(o, params);
    hmc_avg_opts_init(&ao);
    ao.prefix = prefix;
    ao.timeout_s = o->opts.matchmaking_time_s;
    ao.matchmaking_time_s = o->opts.matchmaking_time_s;
    ao.round_timeout_s = o->opts.averaging_timeout_s;
    ao.target_group_size = o->opts.target_group_size;
    ao.min_group_size = o->opts.target_group_size > 1 ? 2 : 1;
    ao.compression = o->compression;
    ao.client_mode = o->opts.client;
    /* The parameters and the statistics, in one round; not the header. */
    if (hmc_average(o->h, o->state, o->state_off, o->n + o->opts.n_stats, &ao, NULL) != 0)
        return 0; /* a failed round leaves the parameters as they are */
    state_take(o, params);
    return 1;
}

/* -- local updates with the delta rule -- */

/*
 * local_updates: the epoch end's state average runs in the background
 * while the local steps go on (Hivemind's use_local_updates, whose state
 * averaging is delayed and applies the delta rule). The state buffer gets
 * the parameters and statistics as they are now, snap keeps a copy, and
 * once the round is over each value moves by what averaging changed:
 *     x += average - snap
 * so the local steps taken meanwhile are kept. 1 when a round started.
 */
static int delta_start(hmc_opt *o, const float *params)
{
    char prefix[RUN_MAX + 48];
    hmc_avg_opts ao;
    size_t m = o->n + o->opts.n_stats;
    snprintf(prefix, sizeof(prefix), "%s.params.%llu", o->run, (unsigned long long)o->epoch);
    state_fill(o, params);
    memcpy(o->snap, (float *)hmc_buf_data(o->state) + o->state_off, m * sizeof(float));
    hmc_avg_opts_init(&ao);
    ao.prefix = prefix;
    ao.timeout_s = o->opts.matchmaking_time_s;
    ao.matchmaking_time_s = o->opts.matchmaking_time_s;
    ao.round_timeout_s = o->opts.averaging_timeout_s;
    ao.target_group_size = o->opts.target_group_size;
    ao.min_group_size = o->opts.target_group_size > 1 ? 2 : 1;
    ao.compression = o->compression;
    ao.client_mode = o->opts.client;
    if (hmc_average_start(o->h, o->state, o->state_off, m, &ao, &o->state_round) != 0) {
        o->state_round = NULL;
        return 0;
    }
    return 1;
}

/*
 * Applies a finished background state average by the delta rule (at once
 * when block, waiting at most for the round's deadline). 1 when it
 * averaged and was applied; a failed round changes nothing.
 */
static int delta_finish(hmc_opt *o, int block, float *params, hmc_opt_report *rep)
{
    if (o->state_round == NULL || (!block && !hmc_round_done(o->state_round)))
        return 0;
    int r = hmc_round_wait(o->state_round, -1, NULL);
    hmc_round_free(o->state_round);
    o->state_round = NULL;
    rep->state_pending = 0;
    if (r != 0)
        return 0;
    const float *avg = (const float *)hmc_buf_data(o->state) + o->state_off;
    for (size_t i = 0; i < o->n; i++)
        params[i] += avg[i] - o->snap[i];
    if (o->opts.n_stats > 0) {
        o->opts.stats_get(o->opts.step_ud, o->stats_tmp, o->opts.n_stats);
        for (size_t i = 0; i < o->opts.n_stats; i++)
            o->stats_tmp[i] += avg[o->n + i] - o->snap[o->n + i];
        o->opts.stats_set(o->opts.step_ud, o->stats_tmp, o->opts.n_stats);
    }
    return 1;
}

/* Shares the state (params, statistics) of the epoch just reached. */
static void share(hmc_opt *o, const float *params)
{
    char args[512], *res = NULL;
    state_fill(o, params);
    json_t *a = json_pack("{s:s, s:I, s:{s:I, s:i, s:I}}", "prefix", o->run, "step",
                          (json_int_t)o->epoch, "data", "shm", (json_int_t)hmc_buf_id(o->state),
                          "offset", 0, "elems", (json_int_t)o->state_elems);
    char *text = a != NULL ? json_dumps(a, JSON_COMPACT) : NULL;
    json_decref(a);
    if (text != NULL && strlen(text) < sizeof(args))
        hmc_request(o->h, "state.share", text, &res);
    free(text);
    hmc_free_string(res);
}

/* Loads the newest shared state: params, statistics, epoch; 1 when it did. */
static int load(hmc_opt *o, float *params)
{
    char *res = NULL;
    json_t *a = json_pack("{s:s, s:f, s:i, s:{s:I, s:i, s:I}}", "prefix", o->run, "timeout",
                          o->opts.load_timeout_s, "min_agree", 1, "data", "shm",
                          (json_int_t)hmc_buf_id(o->state), "offset", 0, "elems",
                          (json_int_t)o->state_elems);
    char *text = a != NULL ? json_dumps(a, JSON_COMPACT) : NULL;
    json_decref(a);
    int r = text != NULL ? hmc_call(o->h, "state.load", text,
                                    (int)(o->opts.load_timeout_s * 1000) + 5000, &res, NULL)
                         : -ENOMEM;
    free(text);
    if (r == 0) {
        json_t *j = json_loads(res, 0, NULL);
        uint64_t bytes = (uint64_t)json_integer_value(json_object_get(j, "bytes"));
        uint64_t epoch = 0;
        json_decref(j);
        /* The donors' word: checked whole before any of it is used. */
        if (bytes == o->state_elems * sizeof(float) &&
            hmc_opt_state_check(hmc_buf_data(o->state), (size_t)bytes, o->n, o->opts.n_stats,
                                o->stat_names, &epoch) == 0) {
            state_take(o, params);
            /* The epoch the state was shared at; a donor a step behind the
             * swarm's leaves us at the global epoch (Hivemind's rule). */
            if (epoch > o->epoch)
                o->epoch = epoch;
        } else {
            r = -EPROTO;
        }
    }
    hmc_free_string(res);
    return r == 0;
}

/* -- delayed local steps (delay_step with local_updates) -- */

/*
 * Hivemind's delay_optimizer_step with use_local_updates: each call's local
 * step runs on a thread of its own, on the optimizer's copy of the
 * parameters (Hivemind's offloaded ones), while the caller computes its
 * next gradients; the next call waits for it and hands its result to the
 * caller's parameters, so gradients are taken one local step late. Only
 * the step runs on that thread; everything else (rounds, statistics,
 * loads) runs between a wait and the next start, when none runs.
 */
static void *bg_main(void *arg)
{
    hmc_opt *o = arg;
    o->opts.step(o->opts.step_ud, o->off, o->gcopy, o->n);
    return NULL;
}

static void bg_wait(hmc_opt *o)
{
    if (o->bg_running) {
        pthread_join(o->bg_thread, NULL);
        o->bg_running = 0;
    }
}

/* The step started by the previous call, into params; 1 when there was one. */
static int bg_take(hmc_opt *o, float *params, hmc_opt_report *rep)
{
    if (!o->bg_running)
        return 0;
    bg_wait(o);
    memcpy(params, o->off, o->n * sizeof(float));
    rep->stepped = 1;
    rep->stepped_epoch = o->bg_epoch;
    return 1;
}

/* This call's step, from params as the call leaves them. */
static void bg_start(hmc_opt *o, float *params, const float *grads, uint64_t epoch,
                     hmc_opt_report *rep)
{
    memcpy(o->off, params, o->n * sizeof(float));
    memcpy(o->gcopy, grads, o->n * sizeof(float));
    o->bg_epoch = epoch;
    if (pthread_create(&o->bg_thread, NULL, bg_main, o) == 0) {
        o->bg_running = 1;
        return;
    }
    /* No thread to be had: the step runs now, as without delay_step. */
    bg_main(o);
    memcpy(params, o->off, o->n * sizeof(float));
    rep->stepped = 1;
    rep->stepped_epoch = epoch;
}

int hmc_opt_step(hmc_opt *o, const float *grads, uint64_t batch_size, float *params,
                 hmc_opt_report *report)
{
    hmc_opt_report rep;
    uint64_t swarm = 0;
    float *acc = hmc_buf_data(o->buf);
    int r;

    memset(&rep, 0, sizeof(rep));
    if (batch_size == 0)
        batch_size = o->opts.batch_size_per_step;
    if (batch_size == 0 || grads == NULL || params == NULL)
        return -EINVAL;
    /* A delayed step whose round is over runs before this call's gradients count. */
    finish_pending(o, 0, params, &rep);
    uint64_t grads_epoch = o->epoch;
    if (o->bg) {
        /* The previous call's step; this call's starts at the end. */
        bg_take(o, params, &rep);
        rep.state_averaged = delta_finish(o, 0, params, &rep);
    } else if (o->opts.local_updates) {
        o->opts.step(o->opts.step_ud, params, grads, o->n);
        rep.stepped = 1;
        rep.stepped_epoch = o->epoch;
        /* After the step, so that the delta lands on what it produced. */
        rep.state_averaged = delta_finish(o, 0, params, &rep);
    } else {
        for (size_t i = 0; i < o->n; i++)
            acc[i] += grads[i] * (float)batch_size;
    }
    o->samples += batch_size;
    /* Throughput: a moving average of this trainer's samples per second. */
    double now = mono_s();
    if (o->last_step_s > 0 && now > o->last_step_s) {
        double inst = (double)batch_size / (now - o->last_step_s);
        o->sps = o->sps > 0 ? 0.8 * o->sps + 0.2 * inst : inst;
    }
    o->last_step_s = now;
    int polled = now - o->last_poll_s >= POLL_S || o->samples >= o->opts.target_batch_size;
    if (polled) {
        if ((r = hmc_progress_report(o->h, o->run, o->epoch, o->samples, o->sps,
                                     o->opts.client)) != 0 ||
            (r = read_swarm(o, &swarm)) != 0) {
            if (o->bg)
                bg_start(o, params, grads, grads_epoch, &rep);
            return r;
        }
        o->last_poll_s = now;
    } else {
        swarm = o->others_samples + o->samples;
    }
    rep.swarm_samples = swarm;
    r = 0;
    if (!polled) {
        /* Nothing new is known: the epoch goes on. */
    } else if (o->global_epoch > o->epoch + 1) {
        /* Too far behind: these gradients belong to an epoch the swarm left.
         * A group already found with us in it gets us with weight 0. */
        finish_pending(o, 1, params, &rep);
        rep.tagged_along = sched_drop(o, &rep);
        o->sched_tried = 0;
        memset(hmc_buf_data(o->buf), 0, o->n * sizeof(float));
        o->samples = 0;
        o->others_samples = 0;
        o->epoch = o->global_epoch;
        rep.caught_up = 1;
        if (o->opts.share_state)
            rep.state_loaded = load(o, params);
        r = hmc_progress_report(o->h, o->run, o->epoch, 0, o->sps, o->opts.client);
    } else if (swarm >= o->opts.target_batch_size && held_ahead(o, now)) {
        rep.held_ahead = 1;
    } else if (swarm >= o->opts.target_batch_size || o->global_epoch > o->epoch) {
        int with_peers = o->others > 0 || mono_s() - o->opened_s < DISCOVERY_S;
        rep.samples = o->samples;
        if (o->opts.local_updates) {
            /* Every call stepped already: the epoch's end is the state average's. */
        } else if (o->opts.delay_step) {
            /* The previous epoch's step runs first: the mean in local is to be ours. */
            finish_pending(o, 1, params, &rep);
            for (size_t i = 0; i < o->n; i++)
                o->local[i] = acc[i] /= (float)o->samples;
            start_pending(o, with_peers, &rep);
        } else {
            for (size_t i = 0; i < o->n; i++)
                o->local[i] = acc[i] /= (float)o->samples;
            if (with_peers) {
                average(o, &rep);
            } else {
                /* Alone in the run: no group can form, so none is waited for. */
                rep.local_fallback = 1;
                snprintf(rep.error, sizeof(rep.error), "no other trainer in run '%s'", o->run);
            }
            o->opts.step(o->opts.step_ud, params, acc, o->n);
            memset(acc, 0, o->n * sizeof(float));
            rep.stepped = 1;
            rep.stepped_epoch = o->epoch;
        }
        sched_drop(o, NULL); /* a round this end did not use (no peers left) */
        o->sched_tried = 0;
        o->samples = 0;
        o->others_samples = 0;
        o->epoch = o->global_epoch > o->epoch + 1 ? o->global_epoch : o->epoch + 1;
        rep.epoch_ended = 1;
        if (o->opts.average_state_every > 0 && o->epoch % o->opts.average_state_every == 0 &&
            (o->others > 0 || mono_s() - o->opened_s < DISCOVERY_S)) {
            if (o->opts.local_updates) {
                /* The previous epoch's average first: one round at a time. */
                rep.state_averaged = delta_finish(o, 1, params, &rep) || rep.state_averaged;
                rep.state_started = delta_start(o, params);
            } else {
                rep.state_averaged = average_params(o, params);
            }
        }
        if (o->opts.share_state)
            share(o, params);
        r = hmc_progress_report(o->h, o->run, o->epoch, 0, o->sps, o->opts.client);
    } else {
        sched_maybe_start(o, swarm);
    }
    if (!rep.epoch_ended)
        rep.samples = o->samples;
    /* After the epoch's end and any load: the step works on what they left.
     * Gradients of an epoch the swarm left are dropped, as Hivemind drops
     * them after a catch-up load (they were taken at the old parameters). */
    if (o->bg && !rep.caught_up)
        bg_start(o, params, grads, grads_epoch, &rep);
    rep.scheduled = rep.scheduled || o->sched != NULL;
    rep.pending = o->pending || o->bg_running;
    rep.state_pending = o->state_round != NULL;
    rep.epoch = o->epoch;
    rep.global_epoch = o->global_epoch;
    if (report != NULL)
        *report = rep;
    return r;
}

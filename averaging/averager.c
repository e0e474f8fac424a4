/*
 * averager: matchmaking then all-reduce, per round, on one node (see
 * averager.h). It owns the node's hm_mm and hm_ar_ctx, the rounds in
 * progress (a list), the group bits per prefix and the ring of finished
 * rounds' reports.
 *
 * A round moves through two states, each with exactly one thing in flight
 * that ends it: MATCHMAKING (a search whose callback fires exactly once)
 * and ALLREDUCE (an hm_ar round whose callback fires exactly once). Each of
 * those callbacks either moves the round on or finishes it, so the user's
 * callback fires exactly once, and since neither fires from inside the
 * call that started it, never from inside hm_averager_round.
 *
 * A held round (opts.hold) has a third state between the two, HELD: the
 * group formed and nothing is in flight; hm_averager_release starts its
 * all-reduce, and the averager's one hold timer, set to the earliest held
 * round's deadline, or closing, ends it.
 */
#include "config.h"

#include "averaging/averager.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "averaging/codec.h"
#include "src/base/util.h"

#define MOD "averager"

/* Rounds at once: one per matchmaking search at most. */
#define MAX_ROUNDS HM_MM_MAX_SEARCHES

typedef struct avg_round avg_round;

typedef struct prefix_bits {
    char prefix[HM_MM_PREFIX_MAX + 1];
    char bits[HM_MM_BITS_MAX + 1];
    uint64_t used; /* a counter, for least-recently-used eviction */
    int in_use;
} prefix_bits;

struct hm_averager {
    hm_node *node;
    hm_mm *mm;
    hm_ar_ctx *ar;
    unsigned members_per_origin; /* matchmaking's per-origin cap (hm_ar_limit_cfg) */
    int cap_loopback;
    LIST_HEAD(, avg_round) rounds; /* in progress, newest first */
    size_t n_rounds;
    uint64_t next_round;
    uint64_t use_clock;
    prefix_bits bits[HM_AVERAGER_MAX_PREFIXES];
    hm_avg_report *history; /* ring of HM_AVERAGER_HISTORY */
    size_t hist_head;       /* next slot to write */
    size_t hist_len;
    int closing;
    uv_timer_t hold_timer; /* the earliest held round's deadline */
    int closes_pending;    /* the all-reduce context and the timer */
    void (*close_cb)(void *ud);
    void *close_ud;
};

struct avg_round {
    hm_averager *av;
    LIST_ENTRY(avg_round) link; /* in av->rounds */
    hm_avg_opts opts;     /* prefix and group_bits point into rep */
    float *data;
    size_t n;
    hm_avg_done_cb cb;
    void *ud;
    uint64_t search;      /* matchmaking search id */
    hm_ar_round *ar_round;
    uint64_t start_ms, mm_end_ms;
    int released;         /* hold: hm_averager_release came */
    int held;             /* hold: the group formed, the all-reduce waits for release */
    uint64_t hold_until_ms;
    hm_avg_report rep;
};

/* ---- group bits per prefix ---- */

static prefix_bits *bits_find(hm_averager *av, const char *prefix)
{
    for (size_t i = 0; i < HM_AVERAGER_MAX_PREFIXES; i++)
        if (av->bits[i].in_use && strcmp(av->bits[i].prefix, prefix) == 0)
            return &av->bits[i];
    return NULL;
}

static void bits_store(hm_averager *av, const char *prefix, const char *bits)
{
    prefix_bits *e = bits_find(av, prefix);
    if (e == NULL) {
        /* A free slot, else the least recently used one. */
        e = &av->bits[0];
        for (size_t i = 0; i < HM_AVERAGER_MAX_PREFIXES; i++) {
            if (!av->bits[i].in_use) {
                e = &av->bits[i];
                break;
            }
            if (av->bits[i].used < e->used)
                e = &av->bits[i];
        }
        hm_strlcpy(e->prefix, prefix, sizeof(e->prefix));
        e->in_use = 1;
    }
    hm_strlcpy(e->bits, bits, sizeof(e->bits));
    e->used = ++av->use_clock;
}

/* ---- rounds ---- */

static void round_unlink(hm_averager *av, avg_round *r)
{
    LIST_REMOVE(r, link);
    av->n_rounds--;
}

static const char *stage_name(int stage)
{
    return stage == HM_AVG_STAGE_MATCHMAKING ? "matchmaking" : "all-reduce";
}

/* Records the round in the history, tells the caller and frees the round. */
static void round_finish(avg_round *r, int status)
{
    hm_averager *av = r->av;
    uint64_t now = hm_now_ms();

    round_unlink(av, r);
    r->rep.status = status;
    r->rep.duration_s = (double)(now - r->start_ms) / 1000.0;
    if (r->rep.stage == HM_AVG_STAGE_MATCHMAKING)
        r->rep.matchmaking_s = r->rep.duration_s;
    else
        r->rep.allreduce_s = (double)(now - r->mm_end_ms) / 1000.0;
    if (status == 0)
        hm_debug(MOD, "round %llu under %s: averaged in a group of %zu in %.3f s",
                 (unsigned long long)r->rep.round, r->rep.prefix, r->rep.group.n,
                 r->rep.duration_s);
    else
        hm_info(MOD, "round %llu under %s ended in %s: %s", (unsigned long long)r->rep.round,
                r->rep.prefix, stage_name(r->rep.stage), hm_strerror(status));
    av->history[av->hist_head] = r->rep;
    av->hist_head = (av->hist_head + 1) % HM_AVERAGER_HISTORY;
    if (av->hist_len < HM_AVERAGER_HISTORY)
        av->hist_len++;
    r->cb(r->ud, status, &r->rep);
    free(r);
}

static void on_allreduce_done(void *ud, const hm_ar_report *rep)
{
    avg_round *r = ud;
    r->ar_round = NULL;
    r->rep.ar = *rep;
    round_finish(r, rep->status);
}

static void hold_timer_arm(hm_averager *av);

/* Starts the all-reduce of a round whose group formed (in rep.group). */
static void round_allreduce(avg_round *r)
{
    hm_averager *av = r->av;
    int result;
    hm_ar_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.round_timeout_ms = r->opts.round_timeout_ms;
    cfg.compression = r->opts.compression;
    cfg.aggregate = r->opts.aggregate;
    cfg.clip_tau = r->opts.clip_tau;
    cfg.chunk_elems = r->opts.chunk_elems;
    /* Checked when the round was asked for (check_opts), and a held vector,
     * written after that, just below. */
    cfg.input_checked = 1;
    /* A held vector was written after the round started: checked again. */
    result = r->opts.hold && !hm_avg_all_finite(r->data, r->n)
                 ? -EDOM
                 : hm_ar_start(av->ar, &r->rep.group, r->data, r->n, r->opts.weight, &cfg,
                               on_allreduce_done, r, &r->ar_round);
    if (result < 0) {
        hm_warn(MOD, "round %llu: cannot start the all-reduce: %s",
                (unsigned long long)r->rep.round, hm_strerror(result));
        round_finish(r, result);
    }
}

static void on_group(void *ud, int status, const hm_avg_group *group)
{
    avg_round *r = ud;
    hm_averager *av = r->av;

    r->search = 0;
    r->mm_end_ms = hm_now_ms();
    r->rep.matchmaking_s = (double)(r->mm_end_ms - r->start_ms) / 1000.0;
    if (status != 0) {
        round_finish(r, status);
        return;
    }
    r->rep.stage = HM_AVG_STAGE_ALLREDUCE;
    r->rep.group = *group;
    /*
     * Every member of the group moves to its next bits, whatever the
     * all-reduce does, so that the next round meets other partners; a
     * failure is no reason to meet the same ones again.
     */
    bits_store(av, r->rep.prefix, group->next_bits);
    if (av->closing) {
        round_finish(r, -ECANCELED);
        return;
    }
    if (r->opts.hold && !r->released) {
        /* The others may start before us: their parts are refused with
         * -EAGAIN and retried until the reducer timeout, which is what
         * bounds how late our release may come without losing them. */
        r->held = 1;
        r->hold_until_ms = r->mm_end_ms + r->opts.hold_timeout_ms;
        hm_debug(MOD, "round %llu under %s: group of %zu formed, held", 
                 (unsigned long long)r->rep.round, r->rep.prefix, group->n);
        hold_timer_arm(av);
        return;
    }
    round_allreduce(r);
}

/* Ends the held rounds past their deadline and sets the timer for the next. */
static void on_hold_timer(uv_timer_t *t)
{
    hm_averager *av = t->data;
    uint64_t now = hm_now_ms();
    avg_round *r;
    int again = 1;
    while (again) {
        again = 0;
        LIST_FOREACH(r, &av->rounds, link) {
            if (r->held && now >= r->hold_until_ms) {
                hm_info(MOD, "round %llu under %s: not released within %.1f s of its group",
                        (unsigned long long)r->rep.round, r->rep.prefix,
                        (double)r->opts.hold_timeout_ms / 1000.0);
                r->held = 0;
                round_finish(r, -ETIMEDOUT);
                again = 1; /* the list changed under the walk */
                break;
            }
        }
    }
    hold_timer_arm(av);
}

static void hold_timer_arm(hm_averager *av)
{
    uint64_t next = UINT64_MAX, now = hm_now_ms();
    const avg_round *r;
    if (av->closing)
        return;
    LIST_FOREACH(r, &av->rounds, link)
        if (r->held && r->hold_until_ms < next)
            next = r->hold_until_ms;
    if (next == UINT64_MAX)
        uv_timer_stop(&av->hold_timer);
    else
        uv_timer_start(&av->hold_timer, on_hold_timer, next > now ? next - now : 0, 0);
}

int hm_averager_release(hm_averager *av, const char *prefix, double weight)
{
    avg_round *r;
    int released = 0, result = 0, again = 1;
    if (av == NULL || prefix == NULL || !isfinite(weight) || weight < 0)
        return -EINVAL;
    while (again) {
        again = 0;
        LIST_FOREACH(r, &av->rounds, link) {
            if (!r->opts.hold || r->released || strcmp(r->rep.prefix, prefix) != 0)
                continue;
            r->released = 1;
            r->opts.weight = weight;
            r->rep.weight = weight;
            released++;
            if (!r->held)
                continue; /* still looking: starts once its group forms */
            r->held = 0;
            if (!hm_avg_all_finite(r->data, r->n))
                result = -EDOM;
            round_allreduce(r); /* may finish r: the walk starts over */
            again = 1;
            break;
        }
    }
    hold_timer_arm(av);
    return result < 0 ? result : released;
}

static int check_opts(const hm_avg_opts *o, const float *data, size_t n)
{
    if (o == NULL || o->prefix == NULL || o->prefix[0] == '\0' ||
        strlen(o->prefix) > HM_MM_PREFIX_MAX || (data == NULL && n > 0) ||
        !isfinite(o->weight) || o->weight < 0 || o->compression < 0 ||
        o->compression >= HM_AVG_COMP_COUNT || o->target_group_size > HM_AVG_MAX_GROUP ||
        !isfinite(o->bandwidth) || o->bandwidth < 0 ||
        (o->aggregate != HM_AR_MEAN && o->aggregate != HM_AR_CENTERED_CLIP) ||
        (o->aggregate == HM_AR_CENTERED_CLIP && !(isfinite(o->clip_tau) && o->clip_tau > 0)) ||
        o->chunk_elems > HM_AR_MAX_CHUNK_ELEMS)
        return -EINVAL;
    if (o->group_bits != NULL) {
        size_t len = strlen(o->group_bits);
        if (len > HM_MM_BITS_MAX || strspn(o->group_bits, "01") != len)
            return -EINVAL;
    }
    unsigned target = o->target_group_size ? o->target_group_size : 16;
    if (o->min_group_size > target)
        return -EINVAL;
    if (!hm_avg_all_finite(data, n))
        return -EDOM;
    return 0;
}

int hm_averager_round(hm_averager *av, const hm_avg_opts *opts, float *data, size_t n,
                      hm_avg_done_cb cb, void *ud, uint64_t *round_out)
{
    int result;
    avg_round *r = NULL;

    if (round_out != NULL)
        *round_out = 0;
    if (av == NULL || cb == NULL)
        return -EINVAL;
    if (av->closing)
        return -ESHUTDOWN;
    if ((result = check_opts(opts, data, n)) < 0)
        return result;
    if (av->n_rounds >= MAX_ROUNDS)
        return -ENOBUFS;
    r = calloc(1, sizeof(*r));
    if (r == NULL)
        return -ENOMEM;
    r->av = av;
    r->opts = *opts;
    r->data = data;
    r->n = n;
    r->cb = cb;
    r->ud = ud;
    if (r->opts.matchmaking_timeout_ms == 0)
        r->opts.matchmaking_timeout_ms = 30000;
    if (r->opts.round_timeout_ms == 0)
        r->opts.round_timeout_ms = 30000;
    if (r->opts.bandwidth == 0)
        r->opts.bandwidth = 1e8;
    if (r->opts.hold && r->opts.hold_timeout_ms == 0)
        r->opts.hold_timeout_ms = 60000;

    hm_avg_report *rep = &r->rep;
    rep->round = av->next_round + 1;
    rep->stage = HM_AVG_STAGE_MATCHMAKING;
    hm_strlcpy(rep->prefix, opts->prefix, sizeof(rep->prefix));
    const prefix_bits *kept = bits_find(av, opts->prefix);
    hm_strlcpy(rep->group_bits,
               kept != NULL ? kept->bits : opts->group_bits != NULL ? opts->group_bits : "",
               sizeof(rep->group_bits));
    rep->weight = opts->weight;
    rep->n_elems = n;
    rep->compression = opts->compression;
    rep->started_unix_ms = hm_wall_us() / 1000;
    rep->status = -EINPROGRESS;
    r->opts.prefix = rep->prefix;
    r->opts.group_bits = rep->group_bits;
    r->start_ms = hm_now_ms();

    hm_mm_config mc;
    memset(&mc, 0, sizeof(mc));
    mc.prefix = rep->prefix;
    mc.group_bits = rep->group_bits;
    mc.target_group_size = opts->target_group_size;
    mc.min_group_size = opts->min_group_size;
    mc.min_matchmaking_ms = opts->matchmaking_time_ms;
    mc.request_timeout_ms = opts->request_timeout_ms;
    mc.bandwidth = r->opts.bandwidth;
    mc.client_mode = opts->client_mode;
    mc.bandwidth_factor = hm_ar_bandwidth_factor(av->ar);
    mc.members_per_origin = av->members_per_origin;
    mc.cap_loopback = av->cap_loopback;
    result = hm_mm_find_group(av->mm, &mc, r->opts.matchmaking_timeout_ms, on_group, r,
                              &r->search);
    if (result < 0)
        goto out;
    av->next_round++;
    LIST_INSERT_HEAD(&av->rounds, r, link);
    av->n_rounds++;
    if (round_out != NULL)
        *round_out = rep->round;
    hm_debug(MOD, "round %llu under %s (bits '%s'): %zu elements, weight %g",
             (unsigned long long)rep->round, rep->prefix, rep->group_bits, n, opts->weight);
    r = NULL;
out:
    free(r);
    return result;
}

int hm_averager_cancel(hm_averager *av, uint64_t round)
{
    avg_round *r;
    LIST_FOREACH(r, &av->rounds, link) {
        if (r->rep.round != round)
            continue;
        if (r->ar_round != NULL) {
            hm_ar_cancel(r->ar_round);
        } else if (r->search != 0) {
            hm_mm_cancel(av->mm, r->search);
        } else if (r->held) {
            r->held = 0;
            round_finish(r, -ECANCELED);
            hold_timer_arm(av);
        }
        return 0;
    }
    return -ENOENT;
}

size_t hm_averager_active(const hm_averager *av, hm_avg_active *out, size_t max)
{
    size_t total = av->n_rounds, i = 0;
    /* The list is newest first; the copy is oldest first. */
    const avg_round *r;
    LIST_FOREACH(r, &av->rounds, link) {
        size_t slot = total - 1 - i++;
        if (slot >= max)
            continue;
        hm_avg_active *a = &out[slot];
        memset(a, 0, sizeof(*a));
        a->round = r->rep.round;
        a->stage = r->rep.stage;
        hm_strlcpy(a->prefix, r->rep.prefix, sizeof(a->prefix));
        a->n_elems = r->n;
        a->group_size = r->rep.stage == HM_AVG_STAGE_ALLREDUCE ? r->rep.group.n : 0;
        a->started_unix_ms = r->rep.started_unix_ms;
    }
    return total;
}

size_t hm_averager_history(const hm_averager *av, hm_avg_report *out, size_t max)
{
    for (size_t i = 0; i < av->hist_len && i < max; i++) {
        size_t slot = (av->hist_head + HM_AVERAGER_HISTORY - 1 - i) % HM_AVERAGER_HISTORY;
        out[i] = av->history[slot];
    }
    return av->hist_len;
}

hm_node *hm_averager_node(hm_averager *av) { return av->node; }

/* ---- lifetime ---- */

int hm_averager_set_limits(hm_averager *av, const hm_ar_limit_cfg *lim)
{
    if (av == NULL || av->ar == NULL || lim->members_per_origin > HM_AVG_MAX_GROUP)
        return -EINVAL;
    int r = hm_ar_set_limits(av->ar, lim);
    if (r == 0) {
        av->members_per_origin = lim->members_per_origin;
        av->cap_loopback = lim->cap_loopback;
    }
    return r;
}

int hm_averager_set_workers(hm_averager *av, unsigned threads)
{
    if (av == NULL || av->ar == NULL)
        return -EINVAL;
    return hm_ar_set_workers(av->ar, threads);
}

void hm_averager_limits(const hm_averager *av, hm_limit_emit_fn emit, void *ud)
{
    if (av != NULL && av->ar != NULL) {
        hm_ar_limits(av->ar, emit, ud);
        emit(ud, "AverageBandwidthFactor",
             hm_ar_bandwidths_clamped(av->ar) + (av->mm != NULL ? hm_mm_bandwidth_refused(av->mm) : 0));
        emit(ud, "AverageMembersPerOrigin", av->mm != NULL ? hm_mm_origin_refused(av->mm) : 0);
        emit(ud, "AverageProtocolVersion", av->mm != NULL ? hm_mm_old_version(av->mm) : 0);
    }
}

/* The averager is freed once the all-reduce context and the timer are closed. */
static void close_part_done(hm_averager *av)
{
    if (--av->closes_pending > 0)
        return;
    void (*cb)(void *) = av->close_cb;
    void *cud = av->close_ud;
    free(av->history);
    free(av);
    if (cb != NULL)
        cb(cud);
}

static void on_timer_closed(uv_handle_t *h) { close_part_done(h->data); }

int hm_averager_new(hm_node *node, hm_averager **out)
{
    int result;
    hm_averager *av = calloc(1, sizeof(*av));

    *out = NULL;
    if (av == NULL)
        return -ENOMEM;
    LIST_INIT(&av->rounds);
    av->node = node;
    av->history = calloc(HM_AVERAGER_HISTORY, sizeof(*av->history));
    if (av->history == NULL) {
        result = -ENOMEM;
        goto out;
    }
    if ((result = hm_mm_new(node, &av->mm)) < 0)
        goto out;
    result = hm_ar_ctx_new(hm_node_loop(node), hm_node_rpc(node), hm_node_identity(node), &av->ar);
    if (result < 0)
        goto out;
    uv_timer_init(hm_node_loop(node), &av->hold_timer);
    av->hold_timer.data = av;
    *out = av;
    av = NULL;
out:
    if (av != NULL) {
        /*
         * A context that failed half way may hold one registration: it is
         * closed (answering -ESHUTDOWN) and both of its methods are removed.
         */
        if (av->ar != NULL) {
            hm_ar_ctx_close(av->ar, NULL, NULL);
            hm_rpc_unregister(hm_node_rpc(node), HM_AR_PART_METHOD);
            hm_rpc_unregister(hm_node_rpc(node), HM_AR_DEAD_METHOD);
        }
        hm_mm_free(av->mm);
        free(av->history);
        free(av);
    }
    return result;
}

static void on_ar_closed(void *ud) { close_part_done(ud); }

void hm_averager_close(hm_averager *av, void (*cb)(void *ud), void *ud)
{
    avg_round *r;
    if (av == NULL || av->closing)
        return;
    av->closing = 1;
    av->close_cb = cb;
    av->close_ud = ud;
    av->closes_pending = 2;
    /* Searches end first (their callbacks see closing and finish), then
     * held rounds, then the all-reduce rounds end inside hm_ar_ctx_close. */
    hm_mm_free(av->mm);
    av->mm = NULL;
    int again = 1;
    while (again) {
        again = 0;
        LIST_FOREACH(r, &av->rounds, link) {
            if (r->held) {
                r->held = 0;
                round_finish(r, -ECANCELED);
                again = 1;
                break;
            }
        }
    }
    uv_timer_stop(&av->hold_timer);
    uv_close((uv_handle_t *)&av->hold_timer, on_timer_closed);
    hm_ar_ctx_close(av->ar, on_ar_closed, av);
    /* The rpc layer must not hand parts to the closed context. */
    hm_rpc_unregister(hm_node_rpc(av->node), HM_AR_PART_METHOD);
    hm_rpc_unregister(hm_node_rpc(av->node), HM_AR_DEAD_METHOD);
}

/*
 * cmd_average: the averaging commands of hivemindd (daemon.h).
 *
 * "average" averages a raw little-endian float32 file through the swarm:
 * the daemon reads args.in, runs one round (averager.h) and writes the
 * result to args.out, atomically (tensor_file.h: a temporary file in the
 * same directory, fsync, rename, fsync of the directory), then replies with
 * the round's report. The paths must be absolute and are opened with the
 * daemon's own permissions; whoever may use the control socket already
 * controls the daemon. Files are read and written on libuv's threadpool,
 * never on the loop. This file interface is what hivemindctl and scripts
 * use. Trainers pass args.data instead, a shared-memory reference
 * (daemon.h): the round averages those floats in place, pinned until it
 * ends, and the reply is the same report; the client library
 * (lib/hivemind.h) runs such a round on a connection of its own when the
 * trainer wants to keep computing meanwhile.
 *
 * "averaging" lists the rounds in progress and the recent ones.
 *
 * It owns the commands in flight and the bound on the memory they hold;
 * hm_cmd_average_close frees it once the last of them has answered.
 */
#include "config.h"

#include "averaging/averager.h"
#include "averaging/codec.h"
#include "src/daemon/daemon.h"
#include "src/daemon/tensor_file.h"
#include "src/base/crypto.h"
#include "src/base/util.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/*
 * Largest tensor one "average" takes from a file, and the memory all rounds
 * may hold together: a file's buffer, and the copy of its input that the
 * all-reduce keeps for the round (allreduce.h), also for shared memory.
 */
#define AVERAGE_MAX_BYTES ((size_t)256 << 20)
#define AVERAGE_MAX_HELD ((size_t)4 << 30)
#define AVERAGE_MAX_JOBS 16
#define AVERAGE_MAX_TIMEOUT_S 3600.0
/* Largest shared-memory tensor: the default largest segment (shm.h). */
#define AVERAGE_SHM_MAX_ELEMS ((size_t)1 << 30)

struct hm_cmd_average {
    hm_daemon *d;
    hm_daemon_life life; /* jobs: "average" commands in progress */
    size_t bytes;        /* bytes of tensors they hold */
};

typedef struct avg_job {
    hm_cmd_average *a;
    hm_control_req *req;
    char in[PATH_MAX], out[PATH_MAX];
    char prefix[HM_MM_PREFIX_MAX + 1];
    char bits[HM_MM_BITS_MAX + 1];
    hm_avg_opts opts;
    float *data;
    size_t n, held;
    hm_avg_report *rep; /* once the round is over */
    uint64_t shm_id;    /* data is pinned shared memory (args.data) when in_shm */
    int in_shm;
} avg_job;

static const char *const comp_names[HM_AVG_COMP_COUNT] = {"none", "fp16", "8bit"};
static const char *const reason_names[] = {"in", "late", "dead", "bad"};

static const char *reason_name(int r)
{
    return r >= 0 && (size_t)r < HM_ARRAY_LEN(reason_names) ? reason_names[r] : "?";
}

void hm_cmd_average_close(hm_cmd_average *a, void (*cb)(void *ud), void *ud)
{
    hm_daemon_life_close(&a->life, cb, ud);
    hm_daemon_life_settle(&a->life, a);
}

static void avg_job_free(avg_job *j)
{
    hm_cmd_average *a = j->a;
    a->life.jobs--;
    a->bytes -= j->held;
    /* The registry itself, not hm_daemon_shm: the pin goes also while the
     * daemon stops, and the registry outlives the loop. */
    if (j->in_shm)
        hm_shm_put(a->d->shm, j->shm_id);
    else
        free(j->data);
    free(j->rep);
    free(j);
    hm_daemon_life_settle(&a->life, a);
}

/* Charges the job's tensors to the bound on what all rounds hold; 0, or
 * -ENOBUFS with req answered "busy". */
static int avg_hold(avg_job *j, size_t bytes)
{
    j->held = bytes;
    j->a->bytes += bytes;
    if (j->a->bytes > AVERAGE_MAX_HELD) {
        hm_control_reply_error(j->req, "busy", "too many tensors are being averaged at once");
        return -ENOBUFS;
    }
    return 0;
}

/* Member indices of a mask, as a JSON array. */
static json_t *mask_json(uint64_t mask, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a != NULL && i < n && i < 64; i++)
        if ((mask >> i) & 1)
            json_array_append_new(a, json_integer((json_int_t)i));
    return a;
}

/* The report of a round as the control protocol shows it. */
static json_t *report_json(const hm_avg_report *r)
{
    char hex[2 * HM_AVG_GROUP_ID_BYTES + 1];
    json_t *o = json_pack("{s:I, s:b, s:s, s:s, s:s, s:f, s:I, s:s, s:f, s:f, s:f, s:f}",
                          "round", (json_int_t)r->round, "ok", r->status == 0, "status",
                          r->status == 0 ? "ok" : hm_strerror(r->status), "stage",
                          r->stage == HM_AVG_STAGE_MATCHMAKING ? "matchmaking" : "allreduce",
                          "prefix", r->prefix, "weight", r->weight, "elements",
                          (json_int_t)r->n_elems, "compression",
                          r->compression >= 0 && r->compression < HM_AVG_COMP_COUNT
                              ? comp_names[r->compression]
                              : "?",
                          "started", (double)r->started_unix_ms / 1000.0, "matchmaking_s",
                          r->matchmaking_s, "allreduce_s", r->allreduce_s, "duration_s",
                          r->duration_s);
    if (o == NULL)
        return NULL;
    json_object_set_new(o, "group_bits", json_string(r->group_bits));
    if (r->stage != HM_AVG_STAGE_ALLREDUCE) {
        json_object_set_new(o, "group_size", json_integer(0));
        return o;
    }
    const hm_avg_group *g = &r->group;
    const hm_ar_report *ar = &r->ar;
    hm_hex_encode(g->group_id, sizeof(g->group_id), hex);
    json_object_set_new(o, "group_id", json_string(hex));
    json_object_set_new(o, "group_size", json_integer((json_int_t)g->n));
    json_object_set_new(o, "self", json_integer((json_int_t)g->self));
    json_object_set_new(o, "next_bits", json_string(g->next_bits));
    json_object_set_new(o, "bytes_sent", json_integer((json_int_t)ar->bytes_sent));
    json_object_set_new(o, "bytes_received", json_integer((json_int_t)ar->bytes_received));
    json_t *members = json_array(), *left = json_array(), *spans = json_array();
    for (size_t i = 0; i < g->n && members != NULL && left != NULL; i++) {
        char id[HM_PEER_ID_LEN + 1], addr[HM_ADDRSTRLEN];
        hm_peer_id_encode(g->members[i].pk, id);
        if (hm_format_addr((const struct sockaddr *)&g->members[i].addr, addr, sizeof(addr)) != 0)
            hm_strlcpy(addr, "?", sizeof(addr));
        int reason = ar->group_size == g->n ? ar->reason[i] : HM_AR_IN;
        json_array_append_new(members,
                              json_pack("{s:i, s:s, s:s, s:f, s:s, s:b}", "index", (int)i,
                                        "peer_id", id, "address", addr, "bandwidth",
                                        g->members[i].bandwidth, "state", reason_name(reason),
                                        "self", i == g->self));
        if (reason != HM_AR_IN)
            json_array_append_new(left, json_pack("{s:i, s:s, s:s}", "index", (int)i, "peer_id",
                                                  id, "reason", reason_name(reason)));
    }
    for (size_t s = 0; s < ar->n_spans && s < HM_AVG_MAX_GROUP && spans != NULL; s++) {
        const hm_ar_span_report *sp = &ar->spans[s];
        json_array_append_new(
            spans, json_pack("{s:I, s:I, s:I, s:i, s:i, s:o, s:o, s:I}", "offset",
                             (json_int_t)sp->offset, "count", (json_int_t)sp->count, "chunks",
                             (json_int_t)sp->n_chunks, "reducer", sp->reducer, "final_reducer",
                             sp->final_reducer, "contributors", mask_json(sp->contributors, g->n),
                             "partial", mask_json(sp->partial, g->n), "chunks_local",
                             (json_int_t)sp->chunks_local));
    }
    json_object_set_new(o, "members", members ? members : json_null());
    json_object_set_new(o, "left_out", left ? left : json_null());
    json_object_set_new(o, "spans", spans ? spans : json_null());
    return o;
}

/* An error reply for a round that did not come back averaged. */
static void reply_round_error(hm_control_req *req, const hm_avg_report *r)
{
    char msg[1024];
    const char *code;
    int st = r->status;
    if (r->stage == HM_AVG_STAGE_MATCHMAKING) {
        code = st == -ETIMEDOUT ? "no_group" : st == -ECANCELED ? "cancelled" : "matchmaking";
        if (st == -ETIMEDOUT)
            snprintf(msg, sizeof(msg),
                     "no group formed under '%s' (bits '%s') within %.1f s", r->prefix,
                     r->group_bits, r->matchmaking_s);
        else
            snprintf(msg, sizeof(msg), "matchmaking under '%s' failed: %s", r->prefix,
                     hm_strerror(st));
    } else {
        code = st == -ETIMEDOUT ? "timeout"
               : st == -EPERM   ? "left_out"
               : st == -ENOTCONN ? "isolated"
               : st == -ECANCELED ? "cancelled"
                                  : "allreduce";
        int len = snprintf(msg, sizeof(msg), "all-reduce in a group of %zu under '%s' failed "
                           "after %.1f s: %s", r->group.n, r->prefix, r->allreduce_s,
                           hm_strerror(st));
        for (size_t i = 0; i < r->group.n && i < r->ar.group_size && len > 0 &&
                           (size_t)len < sizeof(msg) - 80; i++) {
            if (r->ar.reason[i] == HM_AR_IN)
                continue;
            char id[HM_PEER_ID_LEN + 1];
            hm_peer_id_encode(r->group.members[i].pk, id);
            len += snprintf(msg + len, sizeof(msg) - (size_t)len, "; %.12s %s", id,
                            reason_name(r->ar.reason[i]));
        }
    }
    hm_control_reply_error(req, code, msg);
}

static void on_avg_written(void *ud, int status, const char *msg)
{
    avg_job *j = ud;
    if (status != 0) {
        hm_control_reply_error(j->req, "io", msg);
    } else {
        json_t *rep = report_json(j->rep);
        if (rep != NULL)
            json_object_set_new(rep, "out", json_string(j->out));
        hm_daemon_reply(j->req, rep);
    }
    avg_job_free(j);
}

static void on_avg_round(void *ud, int status, const hm_avg_report *rep)
{
    avg_job *j = ud;
    j->rep = malloc(sizeof(*j->rep));
    if (j->rep == NULL) {
        hm_control_reply_error(j->req, "internal", "out of memory");
        goto fail;
    }
    *j->rep = *rep;
    if (status != 0) {
        reply_round_error(j->req, rep);
        goto fail;
    }
    if (j->in_shm) {
        /* Averaged in place: the trainer reads the result where it wrote. */
        hm_daemon_reply(j->req, report_json(j->rep));
        goto fail;
    }
    /* The daemon may be closing: the round is over and its result is
     * delivered; the loop runs the write to its end. */
    int r = hm_tensor_file_write(j->a->d->loop, j->out, j->data, j->n, on_avg_written, j);
    if (r != 0) {
        hm_control_reply_error(j->req, "internal", hm_strerror(r));
        goto fail;
    }
    return;
fail:
    avg_job_free(j);
}

static void avg_start_round(avg_job *j);

static void on_avg_read(void *ud, int status, float *data, size_t n, const char *msg)
{
    avg_job *j = ud;
    if (status != 0) {
        hm_control_reply_error(j->req, status == -ENOMEM ? "internal" : "bad_input", msg);
        goto fail;
    }
    j->data = data;
    j->n = n;
    /* The shutdown began while the file was read. */
    if (j->a->d->av == NULL) {
        hm_daemon_reply_stopping(j->req);
        goto fail;
    }
    if (avg_hold(j, 2 * j->n * sizeof(float)) != 0)
        goto fail;
    avg_start_round(j);
    return;
fail:
    avg_job_free(j);
}

/* Starts the round of a job whose data is ready; on failure replies and frees it. */
static void avg_start_round(avg_job *j)
{
    int r = hm_averager_round(j->a->d->av, &j->opts, j->data, j->n, on_avg_round, j, NULL);
    if (r < 0) {
        char msg[256];
        snprintf(msg, sizeof(msg), "cannot start a round under '%s': %s", j->prefix,
                 r == -EBUSY     ? "a round under this prefix and group bits is running"
                 : r == -ENOBUFS ? "too many rounds are running"
                 : r == -EDOM    ? "the tensor holds NaN or infinity"
                                 : hm_strerror(r));
        hm_control_reply_error(j->req, r == -EBUSY || r == -ENOBUFS ? "busy" : "bad_args", msg);
        goto fail;
    }
    return;
fail:
    avg_job_free(j);
}

static const char *const aggregate_names[] = {"mean", "centered_clip"};

/* Every argument of "average" into j->opts (and j->in, j->out unless the
 * tensor is in shared memory); 0, or -EINVAL with req answered. */
static int average_args(avg_job *j, hm_control_req *req, const json_t *args, int in_shm)
{
    const char *prefix, *bits;
    long long target, min;
    double t, rt, mt, weight, bandwidth, tau = 0;
    int comp, client_mode, agg;

    if (hm_daemon_arg_string(req, args, "prefix", HM_MM_PREFIX_MAX, 0, &prefix) != 0)
        return -EINVAL;
    hm_strlcpy(j->prefix, prefix, sizeof(j->prefix));
    if (in_shm && (json_object_get(args, "in") || json_object_get(args, "out"))) {
        hm_control_reply_error(req, "bad_args", "give either args.data or args.in and args.out");
        return -EINVAL;
    }
    if (!in_shm && (hm_daemon_arg_path(req, args, "in", j->in) != 0 ||
                    hm_daemon_arg_path(req, args, "out", j->out) != 0))
        return -EINVAL;
    if (hm_daemon_arg_real(req, args, "weight", 1.0, 0, 0, HUGE_VAL, "a finite number >= 0",
                           &weight) != 0 ||
        hm_daemon_arg_int(req, args, "target_group_size", 16, 1, HM_AVG_MAX_GROUP, &target) != 0 ||
        hm_daemon_arg_int(req, args, "min_group_size", target > 1 ? 2 : 1, 1, target, &min) != 0 ||
        hm_daemon_arg_seconds(req, args, "timeout", 30, AVERAGE_MAX_TIMEOUT_S, &t) != 0 ||
        hm_daemon_arg_seconds(req, args, "round_timeout", 30, AVERAGE_MAX_TIMEOUT_S, &rt) != 0 ||
        hm_daemon_arg_seconds(req, args, "matchmaking_time", HM_MIN(5.0, t), t, &mt) != 0)
        return -EINVAL;
    j->opts.prefix = j->prefix;
    j->opts.weight = weight;
    j->opts.target_group_size = (unsigned)target;
    j->opts.min_group_size = (unsigned)min;
    j->opts.matchmaking_timeout_ms = (uint64_t)(t * 1000);
    j->opts.round_timeout_ms = (uint64_t)(rt * 1000);
    j->opts.matchmaking_time_ms = (uint64_t)(mt * 1000);
    if (j->opts.matchmaking_timeout_ms == 0 || j->opts.round_timeout_ms == 0 ||
        j->opts.matchmaking_time_ms == 0) {
        hm_control_reply_error(req, "bad_args", "timeouts must be at least a millisecond");
        return -EINVAL;
    }
    /* The bandwidth this node declares sizes its span (0: the default).
     * CenteredClip is for swarms whose members do not trust each other. */
    if (hm_daemon_arg_choice(req, args, "compression", comp_names, HM_AVG_COMP_COUNT,
                             HM_AVG_COMP_NONE, &comp) != 0 ||
        hm_daemon_arg_bits(req, args, "group_bits", HM_MM_BITS_MAX, &bits) != 0 ||
        hm_daemon_arg_bool(req, args, "client_mode", 0, &client_mode) != 0 ||
        hm_daemon_arg_real(req, args, "bandwidth", 0, 0, 1, 1e12,
                           "bytes per second, above 0 and at most 1e12", &bandwidth) != 0 ||
        hm_daemon_arg_choice(req, args, "aggregate", aggregate_names,
                             (int)HM_ARRAY_LEN(aggregate_names), 0, &agg) != 0)
        return -EINVAL;
    if (agg == 1) {
        /* Missing or bad, one message: the radius is what the mode needs. */
        const json_t *tv = json_object_get(args, "clip_tau");
        tau = json_is_number(tv) ? json_number_value(tv) : NAN;
        if (!(tau > 0) || !isfinite(tau)) {
            hm_control_reply_error(req, "bad_args", "aggregate centered_clip needs "
                                   "args.clip_tau, a finite radius above 0");
            return -EINVAL;
        }
    }
    j->opts.compression = comp;
    if (bits != NULL) {
        hm_strlcpy(j->bits, bits, sizeof(j->bits));
        j->opts.group_bits = j->bits;
    }
    j->opts.client_mode = client_mode;
    j->opts.bandwidth = bandwidth;
    /* -- held rounds -- */
    int hold;
    double ht;
    if (hm_daemon_arg_bool(req, args, "hold", 0, &hold) != 0 ||
        hm_daemon_arg_seconds(req, args, "hold_timeout", 60, AVERAGE_MAX_TIMEOUT_S, &ht) != 0)
        return -EINVAL;
    if (hold && !in_shm) {
        /* A file is read before the round starts: nothing could change it later. */
        hm_control_reply_error(req, "bad_args", "args.hold needs args.data (shared memory)");
        return -EINVAL;
    }
    j->opts.hold = hold;
    j->opts.hold_timeout_ms = (uint64_t)(ht * 1000) > 0 ? (uint64_t)(ht * 1000) : 1;
    j->opts.aggregate = agg == 1 ? HM_AR_CENTERED_CLIP : HM_AR_MEAN;
    j->opts.clip_tau = tau;
    return 0;
}

static void cmd_average(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_average *a = ud;
    avg_job *j = NULL;
    char expect[128];

    if (a->d->av == NULL || a->d->stopping) {
        hm_daemon_reply_stopping(req);
        return;
    }
    if (a->life.jobs >= AVERAGE_MAX_JOBS) {
        hm_control_reply_error(req, "busy", "too many average commands are running");
        return;
    }
    const json_t *data_ref = json_object_get(args, "data");
    j = calloc(1, sizeof(*j));
    if (j == NULL) {
        hm_control_reply_error(req, "internal", "out of memory");
        return;
    }
    j->a = a;
    j->req = req;
    a->life.jobs++;
    if (average_args(j, req, args, data_ref != NULL) != 0)
        goto fail;
    if (data_ref != NULL) {
        if (hm_daemon_shm_ref_any(hm_daemon_shm(a->d), req, data_ref, "data",
                                  AVERAGE_SHM_MAX_ELEMS, &j->data, &j->shm_id, &j->n) < 0)
            goto fail;
        j->in_shm = 1;
        if (avg_hold(j, j->n * sizeof(float)) != 0)
            goto fail;
        avg_start_round(j);
        return;
    }
    snprintf(expect, sizeof(expect), "a positive multiple of 4 (float32), at most %zu",
             AVERAGE_MAX_BYTES);
    hm_tensor_file_read_opts ro = {
        .row = 1, .max_bytes = AVERAGE_MAX_BYTES, .finite = 1, .expect = expect};
    int r = hm_tensor_file_read(a->d->loop, j->in, &ro, on_avg_read, j);
    if (r != 0) {
        hm_control_reply_error(req, "internal", hm_strerror(r));
        goto fail;
    }
    return;
fail:
    avg_job_free(j);
}

/*
 * "average.go": releases the held rounds under a prefix (args.hold) with
 * their final weight; their all-reduce begins at once, or as soon as the
 * group forms.
 */
static void cmd_average_go(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_average *a = ud;
    const char *prefix;
    double weight;
    if (a->d->av == NULL || a->d->stopping) {
        hm_daemon_reply_stopping(req);
        return;
    }
    if (hm_daemon_arg_string(req, args, "prefix", HM_MM_PREFIX_MAX, 0, &prefix) != 0 ||
        hm_daemon_arg_real(req, args, "weight", 1.0, 0, 0, HUGE_VAL, "a finite number >= 0",
                           &weight) != 0)
        return;
    int r = hm_averager_release(a->d->av, prefix, weight);
    if (r == 0) {
        hm_control_reply_error(req, "not_found", "no held round under this prefix");
        return;
    }
    if (r < 0) {
        hm_control_reply_error(req, "bad_args", r == -EDOM ? "the tensor holds NaN or infinity"
                                                           : hm_strerror(r));
        return;
    }
    hm_daemon_reply(req, json_pack("{s:s, s:i}", "prefix", prefix, "released", r));
}

static void cmd_averaging(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_average *a = ud;
    hm_daemon *d = a->d;
    hm_avg_report *hist = NULL;
    hm_avg_active act[HM_MM_MAX_SEARCHES];
    json_t *rounds = NULL, *active = NULL;
    (void)args;

    if (d->av == NULL) {
        hm_daemon_reply_stopping(req);
        return;
    }
    hist = calloc(HM_AVERAGER_HISTORY, sizeof(*hist));
    rounds = json_array();
    active = json_array();
    if (hist == NULL || rounds == NULL || active == NULL)
        goto fail;
    size_t nh = HM_MIN(hm_averager_history(d->av, hist, HM_AVERAGER_HISTORY),
                       (size_t)HM_AVERAGER_HISTORY);
    for (size_t i = 0; i < nh; i++) {
        json_t *e = report_json(&hist[i]);
        if (e == NULL || json_array_append_new(rounds, e) != 0)
            goto fail;
    }
    size_t na = HM_MIN(hm_averager_active(d->av, act, HM_ARRAY_LEN(act)), HM_ARRAY_LEN(act));
    for (size_t i = 0; i < na; i++) {
        json_t *e = json_pack("{s:I, s:s, s:s, s:I, s:I, s:f}", "round", (json_int_t)act[i].round,
                              "stage",
                              act[i].stage == HM_AVG_STAGE_MATCHMAKING ? "matchmaking"
                                                                       : "allreduce",
                              "prefix", act[i].prefix, "elements", (json_int_t)act[i].n_elems,
                              "group_size", (json_int_t)act[i].group_size, "started",
                              (double)act[i].started_unix_ms / 1000.0);
        if (e == NULL || json_array_append_new(active, e) != 0)
            goto fail;
    }
    free(hist);
    hm_daemon_reply(req, json_pack("{s:o, s:o}", "active", active, "rounds", rounds));
    return;
fail:
    free(hist);
    json_decref(rounds);
    json_decref(active);
    hm_control_reply_error(req, "internal", "out of memory");
}

int hm_cmd_average_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen)
{
    hm_cmd_average *a = calloc(1, sizeof(*a));
    int r;
    if (a == NULL) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    a->d = d;
    if ((r = hm_control_register(ctl, "average", cmd_average, a)) != 0 ||
        (r = hm_control_register(ctl, "averaging", cmd_averaging, a)) != 0 ||
        (r = hm_control_register(ctl, "average.go", cmd_average_go, a)) != 0) {
        snprintf(err, errlen, "cannot register the averaging commands: %s", hm_strerror(r));
        free(a);
        return r;
    }
    d->average = a;
    return 0;
}

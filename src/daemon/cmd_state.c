/*
 * cmd_state: the state.* commands of hivemindd (cmd_state.h). Every
 * command validates its arguments completely before it starts anything,
 * pins the shared-memory range it uses for as long as it uses it, and
 * answers exactly once: with the result, with the reason it failed, or
 * with "stopping" when the daemon shuts down under it.
 */
#include "config.h"

#include "src/daemon/cmd_state.h"

#include "src/daemon/daemon.h"
#include "src/daemon/tensor_file.h"
#include "averaging/state.h"
#include "src/base/crypto.h"
#include "src/base/util.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "state"

/* A download may be given at most this long (seconds); default 300. */
#define MAX_TIMEOUT_S 3600.0
#define DEFAULT_TIMEOUT_S 300.0
/* The largest shared-memory range a command takes, in float32 slots
 * (the state module's default blob cap of 4 GiB). */
#define MAX_ELEMS ((size_t)1 << 30)
/* The largest state file state.share reads (args.in): the same 4 GiB. */
#define MAX_FILE_BYTES (MAX_ELEMS * sizeof(float))

struct hm_cmd_state {
    hm_daemon *d;
    hm_node *node;
    hm_state *st;
    hm_daemon_life life; /* jobs: state.load commands in progress; parts: the module */
};

typedef struct load_job {
    hm_cmd_state *s;
    hm_control_req *req;
    hm_shm *shm; /* pinned range's registry, valid until the loop ends; NULL with out */
    uint64_t shm_id;
    char out[PATH_MAX]; /* args.out: the file the state goes to, or "" */
    uint8_t *blob;      /* with out: the loaded state while it is written */
    json_t *result;     /* with out: the reply, sent once the file is written */
} load_job;

/* A state.share whose bytes come from a file (args.in), while it is read. */
typedef struct share_job {
    hm_cmd_state *s;
    hm_control_req *req;
    char prefix[HM_STATE_PREFIX_MAX + 1];
    uint64_t step;
    hm_state_share_opts opts;
    int wait;
    char in[PATH_MAX];
} share_job;

/* A state.share with args.wait, until its step (or a newer one) is declared. */
typedef struct declare_job {
    hm_cmd_state *s;
    hm_control_req *req;
    json_t *result; /* the reply, with "declared" added when it comes */
} declare_job;

/* ---- argument helpers ---- */

/* args.prefix, checked as the state module wants it; NULL when bad (replied). */
static const char *arg_prefix(hm_control_req *req, const json_t *args)
{
    const json_t *v = json_object_get(args, "prefix");
    char msg[160];
    if (!json_is_string(v) || json_string_length(v) == 0 ||
        json_string_length(v) > HM_STATE_PREFIX_MAX ||
        strlen(json_string_value(v)) != json_string_length(v) ||
        strstr(json_string_value(v), "[owner:") != NULL) {
        snprintf(msg, sizeof(msg),
                 "args.prefix must be a string of 1 to %d bytes without \"[owner:\"",
                 HM_STATE_PREFIX_MAX);
        hm_control_reply_error(req, "bad_args", msg);
        return NULL;
    }
    return json_string_value(v);
}

static json_t *hash_json(const uint8_t h[HM_STATE_HASH_BYTES])
{
    char hex[2 * HM_STATE_HASH_BYTES + 1];
    hm_hex_encode(h, HM_STATE_HASH_BYTES, hex);
    return json_string(hex);
}

/* ---- state.share ---- */

/* The module declared the step of a waiting state.share (or could not). */
static void on_declared(void *ud, int status, unsigned replicas)
{
    declare_job *j = ud;
    hm_cmd_state *s = j->s;
    if (status == -ECANCELED && s->life.closing) {
        hm_daemon_reply_stopping(j->req);
        json_decref(j->result);
    } else if (status == -ECANCELED) {
        /* state.unshare took it back before its declaration was stored. */
        json_object_set_new(j->result, "declared", json_integer(0));
        json_object_set_new(j->result, "declare_error",
                            json_string("unshared before it was declared"));
        hm_daemon_reply(j->req, j->result);
    } else {
        json_object_set_new(j->result, "declared", json_integer((json_int_t)replicas));
        /* The state is shared and served either way; the declaration is
         * put again at the next refresh. */
        if (status != 0)
            json_object_set_new(j->result, "declare_error", json_string(hm_strerror(status)));
        hm_daemon_reply(j->req, j->result);
    }
    free(j);
    s->life.jobs--;
    hm_daemon_life_settle(&s->life, s);
}

/* Shares bytes[0..len) and answers req: at once, or with wait once the
 * step is declared in the DHT. */
static void do_share(hm_cmd_state *s, hm_control_req *req, const char *prefix, uint64_t step,
                     const void *bytes, size_t len, const hm_state_share_opts *opts, int wait)
{
    char msg[256];
    hm_state_share_opts so = *opts;
    const hm_state_share_opts *o = &so;
    long long chunk = (long long)o->chunk_size;
    declare_job *dj = NULL;
    if (wait) {
        if ((dj = calloc(1, sizeof(*dj))) == NULL) {
            hm_control_reply_error(req, "internal", "out of memory");
            return;
        }
        dj->s = s;
        dj->req = req;
        so.declared_cb = on_declared;
        so.declared_ud = dj;
    }
    /* The module copies the bytes, so the caller may free them at once. */
    int r = hm_state_share(s->st, prefix, step, bytes, len, o);
    if (r < 0)
        free(dj); /* the callback never fires */
    if (r == -ESTALE) {
        snprintf(msg, sizeof(msg), "a newer step than %llu is already shared under '%s'",
                 (unsigned long long)step, prefix);
        hm_control_reply_error(req, "stale", msg);
        return;
    }
    if (r == -EMSGSIZE) {
        snprintf(msg, sizeof(msg), "%zu bytes in chunks of %lld are over the state's bounds "
                 "(at most %d chunks and the size cap)", len, chunk, HM_STATE_MAX_CHUNKS);
        hm_control_reply_error(req, "limit", msg);
        return;
    }
    if (r == -ENOBUFS) {
        snprintf(msg, sizeof(msg), "at most %d prefixes may be shared at once",
                 HM_STATE_MAX_SHARES);
        hm_control_reply_error(req, "limit", msg);
        return;
    }
    if (r < 0) {
        hm_control_reply_error(req, r == -ENOMEM ? "no_space" : "internal", hm_strerror(r));
        return;
    }
    hm_info(MOD, "sharing '%s' at step %llu: %zu bytes", prefix, (unsigned long long)step, len);
    size_t chunks = hm_state_n_chunks((uint64_t)len, (uint64_t)chunk, UINT64_MAX);
    json_t *result = json_pack("{s:s, s:I, s:I, s:I, s:I}", "prefix", prefix, "step",
                               (json_int_t)step, "bytes", (json_int_t)len, "chunk_size",
                               (json_int_t)chunk, "chunks", (json_int_t)chunks);
    if (dj == NULL) {
        hm_daemon_reply(req, result);
        return;
    }
    /* Answered by on_declared, which the module calls exactly once. */
    dj->result = result;
    s->life.jobs++;
}

static void on_share_read(void *ud, int status, float *data, size_t n, const char *msg)
{
    share_job *j = ud;
    hm_cmd_state *s = j->s;
    if (status != 0)
        hm_control_reply_error(j->req, status == -ENOMEM ? "internal" : "bad_input", msg);
    else if (s->life.closing)
        hm_daemon_reply_stopping(j->req);
    else
        do_share(s, j->req, j->prefix, j->step, data, n * sizeof(float), &j->opts, j->wait);
    free(data);
    free(j);
    s->life.jobs--;
    hm_daemon_life_settle(&s->life, s);
}

static void cmd_share(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_state *s = ud;
    hm_shm *shm = hm_daemon_shm(s->d);
    float *p;
    uint64_t id;
    size_t elems;

    if (hm_daemon_life_refuse(&s->life, req))
        return;
    const char *prefix = arg_prefix(req, args);
    if (prefix == NULL)
        return;
    const json_t *sv = json_object_get(args, "step");
    if (!json_is_integer(sv) || json_integer_value(sv) < 0) {
        hm_control_reply_error(req, "bad_args", "args.step must be an integer, 0 or above");
        return;
    }
    long long chunk;
    if (hm_daemon_arg_int(req, args, "chunk_size", HM_STATE_CHUNK_DEFAULT, HM_STATE_CHUNK_MIN,
                          HM_STATE_CHUNK_MAX, &chunk) != 0)
        return;
    double ttl;
    if (hm_daemon_arg_seconds(req, args, "ttl", 60.0, 86400.0, &ttl) != 0)
        return;
    if (ttl < 1.0) {
        hm_control_reply_error(req, "bad_args", "args.ttl must be at least 1 second");
        return;
    }
    int wait;
    if (hm_daemon_arg_bool(req, args, "wait", 0, &wait) != 0)
        return;
    hm_state_share_opts o = {.chunk_size = (size_t)chunk, .ttl_s = ttl};
    uint64_t step = (uint64_t)json_integer_value(sv);
    if (json_object_get(args, "in") != NULL) {
        /* The state is a float32 file (hivemindctl state share --in). */
        if (json_object_get(args, "data") != NULL || json_object_get(args, "bytes") != NULL) {
            hm_control_reply_error(req, "bad_args", "give either args.data or args.in");
            return;
        }
        share_job *j = calloc(1, sizeof(*j));
        if (j == NULL) {
            hm_control_reply_error(req, "internal", "out of memory");
            return;
        }
        if (hm_daemon_arg_path(req, args, "in", j->in) != 0) {
            free(j);
            return;
        }
        j->s = s;
        j->req = req;
        hm_strlcpy(j->prefix, prefix, sizeof(j->prefix));
        j->step = step;
        j->opts = o;
        j->wait = wait;
        char expect[96];
        snprintf(expect, sizeof(expect), "a positive multiple of 4 (float32), at most %zu",
                 MAX_FILE_BYTES);
        hm_tensor_file_read_opts ro = {.row = 1, .max_bytes = MAX_FILE_BYTES, .expect = expect};
        int r = hm_tensor_file_read(s->d->loop, j->in, &ro, on_share_read, j);
        if (r != 0) {
            free(j);
            hm_control_reply_error(req, "internal", hm_strerror(r));
            return;
        }
        s->life.jobs++;
        return;
    }
    if (hm_daemon_shm_ref_any(shm, req, json_object_get(args, "data"), "data", MAX_ELEMS, &p,
                              &id, &elems) < 0)
        return;
    long long bytes;
    long long max_bytes = (long long)(elems * sizeof(float));
    if (hm_daemon_arg_int(req, args, "bytes", max_bytes, 1, max_bytes, &bytes) != 0) {
        hm_shm_put(shm, id);
        return;
    }
    do_share(s, req, prefix, step, p, (size_t)bytes, &o, wait);
    hm_shm_put(shm, id);
}

/* ---- state.info ---- */

static void cmd_info(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_state *s = ud;
    hm_state_share_info info;
    if (hm_daemon_life_refuse(&s->life, req))
        return;
    const char *prefix = arg_prefix(req, args);
    if (prefix == NULL)
        return;
    if (hm_state_share_info_get(s->st, prefix, &info) < 0) {
        hm_control_reply_error(req, "not_found", "this node shares no state under the prefix");
        return;
    }
    json_t *o = json_pack("{s:s, s:I, s:I, s:I, s:I, s:b, s:I, s:I, s:I, s:I}", "prefix", prefix,
                          "step", (json_int_t)info.step, "bytes", (json_int_t)info.bytes,
                          "chunk_size", (json_int_t)info.chunk_size, "chunks",
                          (json_int_t)info.n_chunks, "ready", info.ready, "declared",
                          (json_int_t)info.declared, "chunks_served",
                          (json_int_t)info.chunks_served, "manifests_served",
                          (json_int_t)info.manifests_served, "refused_busy",
                          (json_int_t)info.refused_busy);
    if (o != NULL && info.ready)
        json_object_set_new(o, "hash", hash_json(info.hash));
    hm_daemon_reply(req, o);
}

/* ---- state.load ---- */

static json_t *report_json(const hm_state_report *rep)
{
    json_t *donors = json_array();
    if (donors == NULL)
        return NULL;
    for (size_t i = 0; i < rep->n_donors; i++) {
        const hm_state_donor_report *d = &rep->donors[i];
        json_t *o = json_pack("{s:s, s:s, s:I, s:I, s:s}", "peer", d->peer_id, "addr", d->addr,
                              "chunks", (json_int_t)d->chunks, "bytes", (json_int_t)d->bytes,
                              "dropped", hm_state_drop_name(d->dropped));
        if (o == NULL) {
            json_decref(donors);
            return NULL;
        }
        if (d->last_error != 0)
            json_object_set_new(o, "last_error", json_string(hm_strerror(d->last_error)));
        json_array_append_new(donors, o);
    }
    json_t *r = json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:o}", "prefix",
                          rep->prefix, "step", (json_int_t)rep->step, "bytes",
                          (json_int_t)rep->bytes, "chunk_size", (json_int_t)rep->chunk_size,
                          "chunks", (json_int_t)rep->n_chunks, "declared",
                          (json_int_t)rep->n_declared, "refetched",
                          (json_int_t)rep->chunks_refetched, "duration_s", rep->duration_s,
                          "donors", donors);
    if (r != NULL)
        json_object_set_new(r, "hash", hash_json(rep->hash));
    return r;
}


static void load_job_end(load_job *j)
{
    hm_cmd_state *s = j->s;
    free(j->blob);
    json_decref(j->result);
    free(j);
    s->life.jobs--;
    hm_daemon_life_settle(&s->life, s);
}

static void on_state_written(void *ud, int status, const char *msg)
{
    load_job *j = ud;
    if (status != 0) {
        hm_control_reply_error(j->req, "bad_output", msg);
    } else {
        json_object_set_new(j->result, "out", json_string(j->out));
        hm_daemon_reply(j->req, j->result);
        j->result = NULL;
    }
    load_job_end(j);
}

static void on_loaded(void *ud, int status, uint8_t *blob, size_t len, const hm_state_report *rep)
{
    load_job *j = ud;
    char msg[256];
    size_t dropped = 0;

    if (j->shm != NULL)
        hm_shm_put(j->shm, j->shm_id);
    else
        j->blob = blob; /* ours to free, whatever the status */
    for (size_t i = 0; i < rep->n_donors; i++)
        if (rep->donors[i].dropped != HM_STATE_DROP_NONE)
            dropped++;
    switch (status) {
    case 0:
        hm_info(MOD, "loaded '%s' at step %llu: %zu bytes from %zu donors (%zu dropped) in %.1f s",
                rep->prefix, (unsigned long long)rep->step, len, rep->n_donors, dropped,
                rep->duration_s);
        if (j->shm != NULL) {
            hm_daemon_reply(j->req, report_json(rep));
            break;
        }
        /* A state file is float32, as state share --in reads it. */
        if (len == 0 || len % sizeof(float) != 0) {
            snprintf(msg, sizeof(msg), "the state of step %llu is %zu bytes, not a whole number "
                     "of float32 values, so it cannot go to a state file; load it into shared "
                     "memory (args.data)", (unsigned long long)rep->step, len);
            hm_control_reply_error(j->req, "bad_output", msg);
            break;
        }
        j->result = report_json(rep);
        int r = j->result == NULL ? -ENOMEM
                                  : hm_tensor_file_write(j->s->d->loop, j->out, (const float *)blob,
                                                         len / sizeof(float), on_state_written, j);
        if (r != 0) {
            hm_control_reply_error(j->req, "internal", hm_strerror(r));
            break;
        }
        return; /* answered once the file is written */
    case -ENOENT:
        hm_control_reply_error(j->req, "not_found", "no donor declares a state under the prefix");
        break;
    case -EPROTO:
        snprintf(msg, sizeof(msg), "no state that %s: %zu declarations read",
                 rep->n_donors > 0 ? "the donors vouch for checks out (bad manifest)"
                                   : "enough donors agree on",
                 rep->n_declared);
        hm_control_reply_error(j->req, "no_agreement", msg);
        break;
    case -ETIMEDOUT:
        snprintf(msg, sizeof(msg), "the download did not finish in time (%llu bytes of "
                 "step %llu were in)", (unsigned long long)rep->bytes,
                 (unsigned long long)rep->step);
        hm_control_reply_error(j->req, "timeout", msg);
        break;
    case -EMSGSIZE:
        snprintf(msg, sizeof(msg), "the agreed state (step %llu) does not fit args.data",
                 (unsigned long long)rep->step);
        hm_control_reply_error(j->req, "no_space", msg);
        break;
    case -EHOSTUNREACH:
        snprintf(msg, sizeof(msg), "every donor of step %llu was dropped (%zu donors)",
                 (unsigned long long)rep->step, rep->n_donors);
        hm_control_reply_error(j->req, "unreachable", msg);
        break;
    case -ECANCELED:
        hm_control_reply_error(j->req, "stopping", "the daemon is shutting down");
        break;
    default:
        hm_control_reply_error(j->req, "internal", hm_strerror(status));
        break;
    }
    load_job_end(j);
}

static void cmd_load(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_state *s = ud;
    hm_shm *shm = hm_daemon_shm(s->d);
    float *p;
    uint64_t id;
    size_t elems;

    if (hm_daemon_life_refuse(&s->life, req))
        return;
    const char *prefix = arg_prefix(req, args);
    if (prefix == NULL)
        return;
    double timeout;
    if (hm_daemon_arg_seconds(req, args, "timeout", DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S,
                              &timeout) != 0)
        return;
    long long min_agree;
    if (hm_daemon_arg_int(req, args, "min_agree", 2, 1, HM_STATE_MAX_DONORS, &min_agree) != 0)
        return;
    load_job *j = calloc(1, sizeof(*j));
    if (j == NULL) {
        hm_control_reply_error(req, "internal", "out of memory");
        return;
    }
    hm_state_load_opts o = {
        .min_agree = (unsigned)min_agree,
        .timeout_ms = (uint64_t)llround(timeout * 1000.0),
    };
    if (json_object_get(args, "out") != NULL) {
        /* To a float32 file (hivemindctl state load --out); the module
         * allocates the blob, within its 4 GiB bound. */
        if (json_object_get(args, "data") != NULL) {
            free(j);
            hm_control_reply_error(req, "bad_args", "give either args.data or args.out");
            return;
        }
        if (hm_daemon_arg_path(req, args, "out", j->out) != 0) {
            free(j);
            return;
        }
    } else {
        if (hm_daemon_shm_ref_any(shm, req, json_object_get(args, "data"), "data", MAX_ELEMS,
                                  &p, &id, &elems) < 0) {
            free(j);
            return;
        }
        j->shm = shm;
        j->shm_id = id;
        o.dest = p;
        o.dest_cap = elems * sizeof(float);
    }
    j->s = s;
    j->req = req;
    int r = hm_state_load(s->st, prefix, &o, on_loaded, j);
    if (r < 0) {
        if (j->shm != NULL)
            hm_shm_put(shm, id);
        free(j);
        hm_control_reply_error(req, r == -ENOBUFS ? "busy" : "internal",
                               r == -ENOBUFS ? "too many state downloads at once"
                                             : hm_strerror(r));
        return;
    }
    s->life.jobs++;
}

/* ---- lifetime ---- */

static void on_state_closed(void *ud);

/* The StateTrustedDonors list (peer ids, comma-separated) as keys; 0 or -EINVAL. */
static int parse_trusted(const char *list, uint8_t out[][HM_PK_BYTES], size_t *n_out)
{
    size_t n = 0;
    const char *p = list;
    *n_out = 0;
    while (*p != '\0') {
        const char *end = strchr(p, ',');
        size_t len = end != NULL ? (size_t)(end - p) : strlen(p);
        if (n >= HM_STATE_MAX_DONORS || hm_peer_id_decode(p, len, out[n]) != 0)
            return -EINVAL;
        n++;
        p += len;
        if (*p == ',' && *++p == '\0')
            return -EINVAL; /* a trailing comma */
    }
    *n_out = n;
    return 0;
}

void hm_cmd_state_limits(const hm_cmd_state *s, hm_limit_emit_fn emit, void *ud)
{
    if (s->st != NULL)
        hm_state_limits(s->st, emit, ud);
}

int hm_cmd_state_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen)
{
    int r;
    hm_cmd_state *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    s->d = d;
    s->node = d->node;
    hm_state_config sc;
    uint8_t trusted[HM_STATE_MAX_DONORS][HM_PK_BYTES];
    memset(&sc, 0, sizeof(sc));
    sc.donors_per_origin = d->cfg->state_donors_per_origin;
    sc.max_step_lead = d->cfg->state_max_step_lead;
    if ((r = parse_trusted(d->cfg->state_trusted_donors, trusted, &sc.n_trusted)) < 0) {
        snprintf(err, errlen, "StateTrustedDonors: expected up to %d comma-separated peer ids",
                 HM_STATE_MAX_DONORS);
        free(s);
        return r;
    }
    sc.trusted = (const uint8_t(*)[HM_PK_BYTES])trusted;
    if ((r = hm_state_new(d->node, &sc, &s->st)) < 0) {
        snprintf(err, errlen, "cannot start state sharing: %s", hm_strerror(r));
        free(s);
        return r;
    }
    s->life.parts = 1;
    if ((r = hm_control_register(ctl, "state.share", cmd_share, s)) != 0 ||
        (r = hm_control_register(ctl, "state.load", cmd_load, s)) != 0 ||
        (r = hm_control_register(ctl, "state.info", cmd_info, s)) != 0) {
        snprintf(err, errlen, "cannot register the state commands: %s", hm_strerror(r));
        /* Nothing was shared yet; the module's close frees s from the loop. */
        hm_daemon_life_close(&s->life, NULL, NULL);
        hm_state_close(s->st, on_state_closed, s);
        return r;
    }
    d->state = s;
    return 0;
}

static void on_state_closed(void *ud)
{
    hm_cmd_state *s = ud;
    s->st = NULL;
    s->life.parts--;
    hm_daemon_life_settle(&s->life, s);
}

void hm_cmd_state_close(hm_cmd_state *s, void (*cb)(void *ud), void *ud)
{
    hm_daemon_life_close(&s->life, cb, ud);
    /* Downloads end now (-ECANCELED), which answers their commands; the
     * module's own callback comes from the loop and frees us. */
    hm_state_close(s->st, on_state_closed, s);
}

/*
 * cmd_experts: the experts.* commands of hivemindd (cmd_experts.h). Every
 * command validates its arguments completely before it starts anything,
 * pins the shared-memory tensors it uses for as long as it uses them, and
 * answers exactly once: with the result, with the reason it failed, or
 * with "stopping" when the daemon shuts down under it.
 */
#include "config.h"

#include "src/daemon/cmd_experts.h"

#include "dht/dht.h"
#include "moe/client.h"
#include "src/daemon/daemon.h"
#include "src/daemon/tensor_file.h"
#include "moe/ffn.h"
#include "moe/proto.h"
#include "moe/server.h"
#include "src/base/util.h"
#include "src/base/wire.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <unistd.h>

#define MOD "experts"

/* A command may ask for at most this long (seconds). */
#define MAX_TIMEOUT_S 600.0
/* experts.list walks at most this many grid prefixes and lists at most this
 * many experts of the swarm. */
#define LIST_MAX_PREFIXES 1024
#define LIST_MAX_EXPERTS 1024
#define LIST_MAX_GRIDS 8
/*
 * Bounds on what control clients can make the daemon hold: the encoded
 * frames of expert calls in flight (each of the k experts gets its own
 * frame), and the parameters and optimizer state of hosted experts.
 */
#define MAX_CALL_BYTES ((uint64_t)1 << 30)
#define MAX_HOSTED_BYTES ((uint64_t)8 << 30)

/* The expert settings of the configuration, as this file takes them. */
typedef struct hm_cmd_experts_config {
    const char *state_dir;       /* checkpoints under STATE_DIR/experts */
    const char *host_experts;    /* comma-separated patterns, "" for none */
    const char *type;            /* "ffn" */
    unsigned dim, hidden;        /* hidden 0: 4 dim */
    const char *optimizer;       /* "adam" or "sgd" */
    const char *lr;              /* "" for the optimizer's default */
    unsigned workers, max_batch;
    unsigned checkpoint_interval_s;
    unsigned max_queued, max_queued_mib; /* queue bounds (docs/security.md) */
    unsigned record_max_ttl_s;           /* declarations living longer are ignored */
    int one_holder;                      /* an open uid keeps its earliest live holder */
    const char *hosts_file;              /* allow-list of expert hosts, "" for none */
    unsigned backoff_s, backoff_max_s;   /* stalled hosts (moe/client.h) */
    unsigned heads, max_seq;             /* transformer experts (moe/transformer.h) */
} hm_cmd_experts_config;

struct file_job;
TAILQ_HEAD(file_jobs, file_job);

struct hm_cmd_experts {
    hm_daemon *d;
    hm_node *node;
    hm_moe_server *srv;
    hm_moe_client *cli;
    hm_moe_allow *allow;        /* ExpertHostsFile, borrowed by cli; NULL: none */
    hm_ffn_config defcfg;       /* the configured experts' layer */
    char deftype[HM_MOE_TYPE_MAX + 1];
    unsigned defheads, defmaxseq; /* ExpertHeads, ExpertMaxSeq */
    hm_daemon_life life;        /* jobs: commands in progress; parts: the server */
    uint64_t call_bytes;        /* frames of experts.forward/backward in flight */
    uint64_t hosted_bytes;      /* parameters and optimizer state hosted */
    struct file_jobs files;     /* experts.call commands, to cancel at close */
};

/* ---- lifetime ---- */

static void file_cancel_info(hm_cmd_experts *m);

static void job_done(hm_cmd_experts *m)
{
    m->life.jobs--;
    hm_daemon_life_settle(&m->life, m);
}

static void on_server_closed(void *ud)
{
    hm_cmd_experts *m = ud;
    m->life.parts--;
    hm_daemon_life_settle(&m->life, m);
}

void hm_cmd_experts_close(hm_cmd_experts *m, void (*cb)(void *ud), void *ud)
{
    hm_daemon_life_close(&m->life, cb, ud);
    /* experts.call jobs asking an expert for its shape hold an rpc call of
     * their own: end them now rather than at their timeout. */
    file_cancel_info(m);
    /* Calls in flight end now (-ECANCELED), which answers their commands. */
    if (m->cli != NULL) {
        hm_moe_client_free(m->cli);
        m->cli = NULL;
    }
    hm_moe_allow_free(m->allow);
    m->allow = NULL;
    if (m->srv != NULL) {
        hm_moe_server *s = m->srv;
        m->srv = NULL;
        hm_moe_server_close(s, 1, on_server_closed, m);
        return;
    }
    hm_daemon_life_settle(&m->life, m);
}

/* ---- argument helpers ---- */

/* Seconds to milliseconds, at least 1: a timeout above 0 never becomes "none". */
static uint64_t ms_of(double s)
{
    long long ms = llround(s * 1000.0);
    return ms < 1 ? 1 : (uint64_t)ms;
}

/* Fills an expert config from type/optimizer/lr strings; err gets why not. */
static int build_ffn_config(const char *type, unsigned dim, unsigned hidden,
                            const char *optimizer, const char *lr, hm_ffn_config *cfg_out, char *err,
                            size_t errlen)
{
    memset(cfg_out, 0, sizeof(*cfg_out));
    if (strcmp(type, "ffn") != 0 && strcmp(type, HM_MOE_TYPE_TRANSFORMER) != 0) {
        snprintf(err, errlen, "unknown expert type '%s' (known: ffn, transformer)", type);
        return -EINVAL;
    }
    if (dim < 1 || dim > HM_FFN_MAX_DIM || dim > HM_MOE_MAX_DIM) {
        snprintf(err, errlen, "expert dim %u is outside 1..%d", dim, HM_FFN_MAX_DIM);
        return -EINVAL;
    }
    if (hidden > HM_FFN_MAX_HIDDEN) {
        snprintf(err, errlen, "expert hidden width %u is over %d", hidden, HM_FFN_MAX_HIDDEN);
        return -EINVAL;
    }
    if (strcmp(optimizer, "adam") == 0) {
        cfg_out->optimizer = HM_FFN_ADAM;
    } else if (strcmp(optimizer, "sgd") == 0) {
        cfg_out->optimizer = HM_FFN_SGD;
    } else {
        snprintf(err, errlen, "unknown optimizer '%s' (known: adam, sgd)", optimizer);
        return -EINVAL;
    }
    if (lr != NULL && lr[0] != '\0') {
        char *end;
        errno = 0;
        double x = strtod(lr, &end);
        if (errno != 0 || *end != '\0' || !(x > 0) || !isfinite(x) || x > 10) {
            snprintf(err, errlen, "learning rate '%s' is not a number in (0, 10]", lr);
            return -EINVAL;
        }
        cfg_out->lr = x;
    }
    cfg_out->dim = dim;
    cfg_out->hidden = hidden;
    return 0;
}

/* Hosts each comma-separated pattern of list; heads and max_seq serve transformers. */
static int host_list(hm_cmd_experts *m, const char *list, const char *type,
                     const hm_ffn_config *cfg, unsigned heads, unsigned max_seq,
                     size_t *added_out, char *err, size_t errlen)
{
    const int xf = strcmp(type, HM_MOE_TYPE_TRANSFORMER) == 0;
    char one[HM_MOE_UID_MAX * 4];
    const char *p = list;
    *added_out = 0;
    while (*p != '\0') {
        /* A grid name may hold commas (uids follow Hivemind's grammar); the
         * coordinates and ranges after its first '.' cannot, so only a comma
         * there ends a pattern. */
        const char *dot = strchr(p, '.');
        const char *comma = dot != NULL ? strchr(dot, ',') : NULL;
        size_t n = comma != NULL ? (size_t)(comma - p) : strlen(p);
        if (n == 0 || n >= sizeof(one)) {
            snprintf(err, errlen, "empty or overlong pattern in '%s'", list);
            return -EINVAL;
        }
        memcpy(one, p, n);
        one[n] = '\0';
        size_t added = 0;
        char why[256] = "";
        /* The pattern's experts, counted as if all were new, must fit the
         * budget: each holds its parameters and up to two moments. */
        size_t h = cfg->hidden > 0 ? cfg->hidden : 4 * cfg->dim;
        uint64_t per = ((uint64_t)3 * cfg->dim + 2 * (uint64_t)h * cfg->dim + h +
                        (xf ? 4 * (uint64_t)cfg->dim * cfg->dim + 6 * (uint64_t)cfg->dim : 0)) *
                       3 * sizeof(float);
        hm_moe_uid *uids = calloc(HM_MOE_MAX_PATTERN_EXPERTS, sizeof(*uids));
        if (uids == NULL) {
            snprintf(err, errlen, "out of memory");
            return -ENOMEM;
        }
        int count = hm_moe_pattern_expand(one, uids, HM_MOE_MAX_PATTERN_EXPERTS, NULL, 0);
        free(uids);
        if (count > 0 && m->hosted_bytes + (uint64_t)count * per > MAX_HOSTED_BYTES) {
            snprintf(err, errlen, "cannot host '%s': its experts would take the hosted experts "
                     "past %llu GiB of parameters and optimizer state", one,
                     (unsigned long long)(MAX_HOSTED_BYTES >> 30));
            return -ENOBUFS;
        }
        int r;
        if (xf) {
            hm_xf_config xc = {.ffn = *cfg, .heads = heads, .max_seq = max_seq};
            r = hm_moe_server_host_xf(m->srv, one, &xc, &added, why, sizeof(why));
        } else {
            r = hm_moe_server_host(m->srv, one, type, cfg, &added, why, sizeof(why));
        }
        if (r != 0) {
            snprintf(err, errlen, "cannot host '%s': %s", one, why[0] ? why : hm_strerror(r));
            return r;
        }
        m->hosted_bytes += (uint64_t)added * per;
        *added_out += added;
        p += n;
        if (*p == ',')
            p++;
    }
    return 0;
}

/* ---- experts.host ---- */

static void cmd_host(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_experts *m = ud;
    hm_ffn_config cfg;
    char err[512];
    size_t added = 0;

    if (hm_daemon_life_refuse(&m->life, req))
        return;
    const char *pattern;
    if (hm_daemon_arg_string(req, args, "pattern", HM_MOE_UID_MAX * 4, 0, &pattern) != 0)
        return;
    const char *type;
    if (hm_daemon_arg_string(req, args, "type", HM_MOE_TYPE_MAX, 1, &type) != 0)
        return;
    type = type != NULL ? type : m->deftype;
    const char *opt;
    if (hm_daemon_arg_string(req, args, "optimizer", 16, 1, &opt) != 0)
        return;
    opt = opt != NULL ? opt : m->defcfg.optimizer == HM_FFN_SGD ? "sgd" : "adam";
    /* Each check answers the request when it fails: stop at the first. */
    long long dim;
    if (hm_daemon_arg_int(req, args, "dim", (long long)m->defcfg.dim, 1, HM_FFN_MAX_DIM, &dim) != 0)
        return;
    long long hidden;
    if (hm_daemon_arg_int(req, args, "hidden", 0, 0, HM_FFN_MAX_HIDDEN, &hidden) != 0)
        return;
    long long heads, max_seq;
    if (hm_daemon_arg_int(req, args, "heads", (long long)m->defheads, 0, HM_XF_MAX_HEADS,
                          &heads) != 0)
        return;
    if (hm_daemon_arg_int(req, args, "max_seq", (long long)m->defmaxseq, 1, HM_XF_MAX_SEQ,
                          &max_seq) != 0)
        return;
    char lr[32] = "";
    const json_t *v = json_object_get(args, "lr");
    if (v != NULL) {
        if (!json_is_number(v)) {
            hm_control_reply_error(req, "bad_args", "args.lr must be a number");
            return;
        }
        snprintf(lr, sizeof(lr), "%.17g", json_number_value(v));
    }
    if (build_ffn_config(type, (unsigned)dim, (unsigned)hidden, opt, lr, &cfg, err,
                         sizeof(err)) != 0) {
        hm_control_reply_error(req, "bad_args", err);
        return;
    }
    cfg.seed = m->defcfg.seed;
    int r = host_list(m, pattern, type, &cfg, (unsigned)heads, (unsigned)max_seq, &added, err,
                      sizeof(err));
    if (r != 0) {
        hm_control_reply_error(req, r == -EPROTO ? "conflict" : r == -ENOBUFS ? "limit"
                                                                            : "bad_args",
                               err);
        return;
    }
    size_t total = hm_moe_server_list(m->srv, NULL, 0);
    hm_info(MOD, "hosting %zu more experts (%s), %zu in all", added, pattern, total);
    hm_daemon_reply(req, json_pack("{s:I, s:I}", "added", (json_int_t)added, "hosted",
                              (json_int_t)total));
}

/* ---- experts.list ---- */

typedef struct list_job {
    hm_cmd_experts *m;
    hm_control_req *req;
    json_t *result;   /* {"hosted": [...], "swarm": [...]} */
    json_t *swarm;    /* borrowed from result */
    uint64_t deadline_ms;
    /* the grid prefixes still to look at, this level's and the next */
    char (*keys)[HM_MOE_UID_MAX + 2];
    size_t n_keys;
    char (*next)[HM_MOE_UID_MAX + 2];
    size_t n_next;
    size_t walked;
} list_job;

static void list_finish(list_job *j)
{
    hm_cmd_experts *m = j->m;
    hm_control_reply(j->req, j->result);
    free(j->keys);
    free(j->next);
    free(j);
    job_done(m);
}

static size_t count_coords(const char *key)
{
    size_t dots = 0;
    for (const char *p = key; *p; p++)
        dots += *p == '.';
    return dots > 0 ? dots - 1 : 0;
}

static int swarm_has(const json_t *swarm, const char *uid, const char *host)
{
    size_t i;
    json_t *e;
    json_array_foreach(swarm, i, e)
    {
        if (strcmp(json_string_value(json_object_get(e, "uid")), uid) == 0 &&
            strcmp(json_string_value(json_object_get(e, "host")), host) == 0)
            return 1;
    }
    return 0;
}

static void list_next_level(list_job *j);

static void on_list_level(void *ud, const hm_dht_many_result *results, size_t n_keys)
{
    list_job *j = ud;
    j->n_next = 0;
    for (size_t k = 0; k < n_keys && k < j->n_keys; k++) {
        const char *key = j->keys[k];
        size_t level = count_coords(key);
        for (size_t i = 0; i < results[k].n; i++) {
            const hm_dht_record *rec = &results[k].values[i].rec;
            uint32_t coord;
            uint8_t pk[HM_PK_BYTES];
            char uid[HM_MOE_UID_MAX + 1], addr[HM_MOE_ADDR_MAX + 1];
            hm_moe_uid u;
            if (!rec->has_subkey ||
                hm_moe_parse_prefix_subkey(rec->subkey, rec->subkey_len, &coord, pk) != 0 ||
                hm_moe_decode_prefix_value(rec->value, rec->value_len, uid, addr) != 0 ||
                hm_moe_uid_parse(uid, strlen(uid), &u) != 0)
                continue; /* withdrawn, or not ours to read */
            if (u.ndims == level + 1) {
                char peer[HM_PEER_ID_LEN + 1], host[HM_PEER_ID_LEN + HM_MOE_ADDR_MAX + 2];
                hm_peer_id_encode(pk, peer);
                snprintf(host, sizeof(host), "%s@%s", peer, addr);
                if (json_array_size(j->swarm) >= LIST_MAX_EXPERTS || swarm_has(j->swarm, uid, host))
                    continue;
                json_array_append_new(j->swarm,
                                      json_pack("{s:s, s:s, s:f}", "uid", uid, "host", host,
                                                "expires", rec->expiration));
            } else if (u.ndims > level + 1 && j->n_next < HM_DHT_MANY_MAX &&
                       j->walked + j->n_next < LIST_MAX_PREFIXES) {
                char nk[2 * (HM_MOE_UID_MAX + 2)];
                int w = snprintf(nk, sizeof(nk), "%s%u.", key, (unsigned)coord);
                if (w <= 0 || (size_t)w >= sizeof(j->next[0]))
                    continue;
                int dup = 0;
                for (size_t q = 0; q < j->n_next && !dup; q++)
                    dup = strcmp(j->next[q], nk) == 0;
                if (!dup)
                    memcpy(j->next[j->n_next++], nk, (size_t)w + 1);
            }
        }
    }
    /* The next level becomes the current one. */
    char(*t)[HM_MOE_UID_MAX + 2] = j->keys;
    j->keys = j->next;
    j->next = t;
    j->n_keys = j->n_next;
    j->n_next = 0;
    list_next_level(j);
}

static void list_next_level(list_job *j)
{
    const uint8_t *keys[HM_DHT_MANY_MAX];
    size_t lens[HM_DHT_MANY_MAX];
    uint64_t now = hm_now_ms();
    if (j->n_keys == 0 || j->m->life.closing || now >= j->deadline_ms) {
        list_finish(j);
        return;
    }
    for (size_t i = 0; i < j->n_keys; i++) {
        keys[i] = (const uint8_t *)j->keys[i];
        lens[i] = strlen(j->keys[i]);
    }
    j->walked += j->n_keys;
    int r = hm_node_dht_get_many(j->m->node, keys, lens, j->n_keys, j->deadline_ms - now,
                                 on_list_level, j);
    if (r != 0)
        list_finish(j);
}

static json_t *hosted_json(hm_cmd_experts *m)
{
    size_t n = hm_moe_server_list(m->srv, NULL, 0);
    hm_moe_hosted *h = NULL;
    json_t *arr = json_array();
    if (arr == NULL)
        return NULL;
    if (n > 0) {
        h = calloc(n, sizeof(*h));
        if (h == NULL) {
            json_decref(arr);
            return NULL;
        }
        n = HM_MIN(n, hm_moe_server_list(m->srv, h, n));
    }
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_pack(
            "{s:s, s:s, s:I, s:I, s:I, s:I, s:I, s:f, s:f, s:f, s:I, s:f, s:b}", "uid", h[i].uid,
            "type", h[i].type, "dim", (json_int_t)h[i].dim, "hidden", (json_int_t)h[i].hidden,
            "forward_requests", (json_int_t)h[i].fwd_requests, "backward_requests",
            (json_int_t)h[i].bwd_requests, "batches", (json_int_t)h[i].batches,
            "mean_batch_size", h[i].mean_batch_size, "latency_p50_ms", h[i].latency_p50_ms,
            "latency_p99_ms", h[i].latency_p99_ms, "steps", (json_int_t)h[i].steps,
            "last_checkpoint", (double)h[i].last_checkpoint_unix_ms / 1000.0, "resumed",
            h[i].resumed != 0);
        /* Transformers take [batch, seq, dim]: say how many heads and how long a seq. */
        if (e != NULL && h[i].max_seq != 0) {
            json_object_set_new(e, "heads", json_integer((json_int_t)h[i].heads));
            json_object_set_new(e, "max_seq", json_integer((json_int_t)h[i].max_seq));
        }
        if (e == NULL || json_array_append_new(arr, e) != 0) {
            json_decref(arr);
            arr = NULL;
            break;
        }
    }
    free(h);
    return arr;
}

/* The hosts this daemon's calls skip now (moe/client.h, "Stalled hosts"). */
static json_t *backoffs_json(hm_cmd_experts *m)
{
    hm_moe_backoff_host *hs = calloc(HM_MOE_BACKOFF_HOSTS, sizeof(*hs));
    json_t *arr = json_array();
    size_t n = hs != NULL ? hm_moe_client_backoffs(m->cli, hs, HM_MOE_BACKOFF_HOSTS) : 0;
    for (size_t i = 0; arr != NULL && i < n; i++) {
        char peer[HM_PEER_ID_LEN + 1];
        hm_peer_id_encode(hs[i].pk, peer);
        json_array_append_new(arr, json_pack("{s:s, s:f, s:f, s:I}", "peer_id", peer, "left_s",
                                             (double)hs[i].left_ms / 1000.0, "backoff_s",
                                             (double)hs[i].period_ms / 1000.0, "stalls",
                                             (json_int_t)hs[i].stalls));
    }
    free(hs);
    return arr != NULL ? arr : json_array();
}

static void cmd_list(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_experts *m = ud;
    list_job *j = NULL;
    char grids[LIST_MAX_GRIDS][HM_MOE_PREFIX_MAX + 1];
    size_t n_grids = 0;

    if (hm_daemon_life_refuse(&m->life, req))
        return;
    const char *prefix;
    if (hm_daemon_arg_string(req, args, "prefix", HM_MOE_PREFIX_MAX + 1, 1, &prefix) != 0)
        return;
    double timeout;
    if (hm_daemon_arg_seconds(req, args, "timeout", 5.0, MAX_TIMEOUT_S, &timeout) != 0)
        return;
    char name[HM_MOE_PREFIX_MAX + 1];
    if (prefix != NULL) {
        char why[160];
        int nl = hm_moe_name_check(prefix, strlen(prefix), why, sizeof(why));
        if (nl < 0) {
            hm_control_reply_error(req, "bad_args", why);
            return;
        }
        /* "ffn." and "ffn" name the same grid. */
        memcpy(name, prefix, (size_t)nl);
        name[nl] = '\0';
        prefix = name;
        hm_strlcpy(grids[n_grids++], prefix, sizeof(grids[0]));
    }
    j = calloc(1, sizeof(*j));
    if (j == NULL)
        goto nomem;
    j->keys = calloc(HM_DHT_MANY_MAX, sizeof(*j->keys));
    j->next = calloc(HM_DHT_MANY_MAX, sizeof(*j->next));
    json_t *hosted = hosted_json(m);
    j->swarm = json_array();
    j->result = json_object();
    if (j->keys == NULL || j->next == NULL || hosted == NULL || j->swarm == NULL ||
        j->result == NULL) {
        json_decref(hosted);
        json_decref(j->swarm);
        goto nomem;
    }
    json_object_set_new(j->result, "swarm", j->swarm);
    json_object_set_new(j->result, "backed_off", backoffs_json(m));
    /* Without a prefix, the swarm part covers the grids this node hosts in. */
    if (prefix == NULL) {
        size_t i;
        json_t *e;
        json_array_foreach(hosted, i, e)
        {
            hm_moe_uid u;
            const char *uid = json_string_value(json_object_get(e, "uid"));
            if (hm_moe_uid_parse(uid, strlen(uid), &u) != 0)
                continue;
            int dup = 0;
            for (size_t g = 0; g < n_grids && !dup; g++)
                dup = strcmp(grids[g], u.prefix) == 0;
            if (!dup && n_grids < LIST_MAX_GRIDS)
                hm_strlcpy(grids[n_grids++], u.prefix, sizeof(grids[0]));
        }
    } else {
        /* Only the hosted experts under the prefix. */
        json_t *keep = json_array();
        size_t i;
        json_t *e;
        if (keep == NULL) {
            json_decref(hosted);
            goto nomem;
        }
        json_array_foreach(hosted, i, e)
        {
            hm_moe_uid u;
            const char *uid = json_string_value(json_object_get(e, "uid"));
            if (hm_moe_uid_parse(uid, strlen(uid), &u) == 0 && strcmp(u.prefix, prefix) == 0)
                json_array_append(keep, e);
        }
        json_decref(hosted);
        hosted = keep;
    }
    json_object_set_new(j->result, "hosted", hosted);
    for (size_t g = 0; g < n_grids; g++) {
        size_t n = strnlen(grids[g], HM_MOE_PREFIX_MAX);
        memcpy(j->keys[j->n_keys], grids[g], n);
        memcpy(j->keys[j->n_keys++] + n, ".", 2);
    }
    j->m = m;
    j->req = req;
    j->deadline_ms = hm_now_ms() + ms_of(timeout);
    m->life.jobs++;
    list_next_level(j);
    return;
nomem:
    if (j != NULL) {
        json_decref(j->result);
        free(j->keys);
        free(j->next);
        free(j);
    }
    hm_control_reply_error(req, "internal", "out of memory");
}

/* ---- experts.find ---- */

typedef struct find_job {
    hm_cmd_experts *m;
    hm_control_req *req;
} find_job;

static json_t *experts_json(const hm_moe_expert *e, size_t n)
{
    json_t *arr = json_array();
    for (size_t i = 0; arr != NULL && i < n; i++) {
        char peer[HM_PEER_ID_LEN + 1], host[HM_PEER_ID_LEN + HM_MOE_ADDR_MAX + 2];
        hm_peer_id_encode(e[i].pk, peer);
        snprintf(host, sizeof(host), "%s@%s", peer, e[i].addr_str);
        if (json_array_append_new(arr, json_pack("{s:s, s:s, s:f}", "uid", e[i].uid, "peer",
                                                 host, "score", e[i].score)) != 0) {
            json_decref(arr);
            arr = NULL;
        }
    }
    return arr;
}

static void on_found(void *ud, int status, const hm_moe_expert *experts, size_t n)
{
    find_job *j = ud;
    hm_cmd_experts *m = j->m;
    if (status == -ECANCELED) {
        hm_control_reply_error(j->req, "stopping", "the daemon is shutting down");
    } else if (status != 0 && status != -ENOENT) {
        char msg[160];
        snprintf(msg, sizeof(msg), "beam search failed: %s", hm_strerror(status));
        hm_control_reply_error(j->req, status == -ETIMEDOUT ? "timeout" : "failed", msg);
    } else {
        json_t *arr = experts_json(experts, status == 0 ? n : 0);
        hm_daemon_reply(j->req, arr != NULL ? json_pack("{s:o}", "experts", arr) : NULL);
    }
    free(j);
    job_done(m);
}

static void cmd_find(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_experts *m = ud;
    double *scores[HM_MOE_MAX_GRID_DIMS] = {0};
    size_t sizes[HM_MOE_MAX_GRID_DIMS] = {0};
    const double *cscores[HM_MOE_MAX_GRID_DIMS];
    size_t ndims = 0;
    find_job *j = NULL;

    if (hm_daemon_life_refuse(&m->life, req))
        return;
    const char *prefix;
    if (hm_daemon_arg_string(req, args, "prefix", HM_MOE_PREFIX_MAX + 1, 0, &prefix) != 0)
        return;
    char why[160];
    if (hm_moe_name_check(prefix, strlen(prefix), why, sizeof(why)) < 0) {
        hm_control_reply_error(req, "bad_args", why);
        return;
    }
    long long k_best;
    if (hm_daemon_arg_int(req, args, "k_best", -1, 1, HM_MOE_MAX_K, &k_best) != 0)
        return;
    long long beam;
    if (hm_daemon_arg_int(req, args, "beam_size", 0, 0, HM_DHT_MANY_MAX, &beam) != 0)
        return;
    double timeout;
    if (hm_daemon_arg_seconds(req, args, "timeout", 5.0, MAX_TIMEOUT_S, &timeout) != 0)
        return;
    const json_t *sv = json_object_get(args, "scores");
    if (!json_is_array(sv) || json_array_size(sv) < 1 ||
        json_array_size(sv) > HM_MOE_MAX_GRID_DIMS) {
        hm_control_reply_error(req, "bad_args", "args.scores must be a list of 1 to 16 lists of "
                               "gate scores, one per grid dimension");
        return;
    }
    ndims = json_array_size(sv);
    for (size_t d = 0; d < ndims; d++) {
        const json_t *row = json_array_get(sv, d);
        size_t n = json_array_size(row);
        if (!json_is_array(row) || n < 1 || n > HM_MOE_MAX_GRID) {
            hm_control_reply_error(req, "bad_args", "each list in args.scores must hold 1 to "
                                   "65536 numbers");
            goto out;
        }
        scores[d] = malloc(n * sizeof(double));
        if (scores[d] == NULL) {
            hm_control_reply_error(req, "internal", "out of memory");
            goto out;
        }
        for (size_t c = 0; c < n; c++) {
            const json_t *x = json_array_get(row, c);
            if (!json_is_number(x) || !isfinite(json_number_value(x))) {
                hm_control_reply_error(req, "bad_args", "gate scores must be finite numbers");
                goto out;
            }
            scores[d][c] = json_number_value(x);
        }
        sizes[d] = n;
        cscores[d] = scores[d];
    }
    j = calloc(1, sizeof(*j));
    if (j == NULL) {
        hm_control_reply_error(req, "internal", "out of memory");
        goto out;
    }
    j->m = m;
    j->req = req;
    int r = hm_moe_beam_search(m->cli, prefix, cscores, sizes, ndims, (size_t)k_best,
                               (size_t)beam, ms_of(timeout), on_found, j);
    if (r != 0) {
        char msg[160];
        snprintf(msg, sizeof(msg), "cannot search under '%s': %s", prefix, hm_strerror(r));
        hm_control_reply_error(req, "bad_args", msg);
        free(j);
        goto out;
    }
    m->life.jobs++;
out:
    for (size_t d = 0; d < ndims; d++)
        free(scores[d]);
}

/* ---- experts.forward and experts.backward ---- */

typedef struct call_job {
    hm_cmd_experts *m;
    hm_control_req *req;
    hm_shm *shm;
    uint64_t pins[4];
    size_t n_pins;
    int backward;
    int routed;                 /* args.routes: rows routed per sample */
    size_t k, k_min;
    uint64_t bytes;             /* counted in hm_cmd_experts.call_bytes */
    double timeout_s;
    hm_moe_expert *experts;     /* [k] */
    hm_moe_call_error *errs;    /* [k] */
    uint8_t *mask;              /* args.mask as bytes, [batch * seq]; NULL: none */
} call_job;

static void call_job_free(call_job *j)
{
    if (j == NULL)
        return;
    free(j->mask);
    free(j->experts);
    free(j->errs);
    free(j);
}

static void call_release(call_job *j)
{
    for (size_t i = 0; i < j->n_pins; i++)
        hm_shm_put(j->shm, j->pins[i]);
    j->n_pins = 0;
}

/*
 * The control code of a server's refusal (docs/control-protocol.md), so
 * that a caller can tell a wrong width from an overloaded host without
 * reading the message.
 */
static const char *refusal_code(int status)
{
    switch (status) {
    case -EPROTO:
        return "expert_wrong_shape";
    case -ENOENT:
        return "expert_not_found";
    case -ENOBUFS:
        return "expert_busy";
    case -EDOM:
        return "expert_bad_input";
    default:
        return "expert_error";
    }
}

/* Each expert that did not answer, and why, for the reply: [{uid, status, error}]. */
static json_t *failures_json(const call_job *j, const uint8_t *answered)
{
    json_t *arr = json_array();
    for (size_t i = 0; arr != NULL && i < j->k; i++) {
        if (answered != NULL && answered[i])
            continue;
        const hm_moe_call_error *e = &j->errs[i];
        if (e->status == -ENODATA)
            continue; /* routed to no sample: not called */
        const char *st = e->status == -ETIMEDOUT   ? "timeout"
                         : e->status == -EAGAIN    ? "skipped"
                         : e->status == -ECANCELED ? "not_waited_for"
                                                   : refusal_code(e->status);
        json_array_append_new(arr, json_pack("{s:I, s:s, s:s, s:s}", "index", (json_int_t)i, "uid",
                                             j->experts[i].uid, "status", st, "error",
                                             e->msg[0] ? e->msg : hm_strerror(e->status)));
    }
    return arr;
}

static void on_called(void *ud, int status, const uint8_t *answered, size_t n_answered)
{
    call_job *j = ud;
    hm_cmd_experts *m = j->m;
    char msg[1024]; /* a 128-byte uid and a 320-byte server reason fit */
    call_release(j);
    m->call_bytes -= j->bytes;
    if (status == -ECANCELED) {
        hm_control_reply_error(j->req, "stopping", "the daemon is shutting down");
    } else if (status == -ETIMEDOUT && j->routed) {
        snprintf(msg, sizeof(msg), "some samples had fewer than %s %zu answers within %g s "
                 "(%zu of %zu experts answered)", j->backward ? "backward_k_min" : "k_min",
                 j->k_min, j->timeout_s, n_answered, j->k);
        hm_control_reply_error(j->req, "timeout", msg);
    } else if (status == -ETIMEDOUT) {
        snprintf(msg, sizeof(msg), "only %zu of %zu experts answered within %g s (%s needs %zu)",
                 n_answered, j->k, j->timeout_s, j->backward ? "backward_k_min" : "k_min",
                 j->k_min);
        hm_control_reply_error(j->req, "timeout", msg);
    } else if (status != 0) {
        /* The server refused (client.h): its reason, first by index, goes
         * back word for word, with a code for the kind of refusal. */
        size_t first = 0;
        while (first + 1 < j->k && j->errs[first].status != status)
            first++;
        char peer[HM_PEER_ID_LEN + 1];
        hm_peer_id_encode(j->experts[first].pk, peer);
        snprintf(msg, sizeof(msg), "expert %s at %.12s refused the call: %s (%s); %zu of %zu "
                 "experts answered (%s needs %zu)", j->experts[first].uid, peer,
                 j->errs[first].msg[0] ? j->errs[first].msg : "no reason given",
                 hm_strerror(status), n_answered, j->k,
                 j->backward ? "backward_k_min" : "k_min", j->k_min);
        hm_control_reply_error(j->req, refusal_code(status), msg);
    } else {
        json_t *arr = json_array();
        for (size_t i = 0; arr != NULL && i < j->k; i++)
            json_array_append_new(arr, json_boolean(answered != NULL && answered[i]));
        json_t *fails = n_answered < j->k ? failures_json(j, answered) : json_array();
        if (arr == NULL || fails == NULL) {
            json_decref(arr);
            json_decref(fails);
            hm_daemon_reply(j->req, NULL);
        } else {
            hm_daemon_reply(j->req, json_pack("{s:o, s:I, s:o}", "answered", arr, "n_answered",
                                              (json_int_t)n_answered, "failed", fails));
        }
    }
    call_job_free(j);
    job_done(m);
}

/*
 * args.experts: [{uid, peer}, ...] into j->experts, at most max of them.
 * With args.hosts (a list of "PEERID@HOST:PORT"), an expert may name its
 * host by index instead, {uid, host: I}, so that the many experts of a
 * routed call fit a request line.
 */
static int parse_experts(hm_control_req *req, const json_t *args, call_job *j, size_t max)
{
    const json_t *ev = json_object_get(args, "experts");
    const json_t *hosts = json_object_get(args, "hosts");
    char msg[200];
    if (!json_is_array(ev) || json_array_size(ev) < 1 || json_array_size(ev) > max) {
        snprintf(msg, sizeof(msg), "args.experts must be a list of 1 to %zu experts "
                 "{\"uid\": ..., \"peer\": \"PEERID@HOST:PORT\"} (as experts.find returns)",
                 max);
        hm_control_reply_error(req, "bad_args", msg);
        return -EINVAL;
    }
    if (hosts != NULL && (!json_is_array(hosts) || json_array_size(hosts) > max)) {
        snprintf(msg, sizeof(msg), "args.hosts must be a list of at most %zu "
                 "\"PEERID@HOST:PORT\"", max);
        hm_control_reply_error(req, "bad_args", msg);
        return -EINVAL;
    }
    j->k = json_array_size(ev);
    j->experts = calloc(j->k, sizeof(*j->experts));
    j->errs = calloc(j->k, sizeof(*j->errs));
    if (j->experts == NULL || j->errs == NULL) {
        hm_control_reply_error(req, "internal", "out of memory");
        return -ENOMEM;
    }
    for (size_t i = 0; i < j->k; i++) {
        const json_t *e = json_array_get(ev, i);
        const char *uid = json_string_value(json_object_get(e, "uid"));
        const char *peer = json_string_value(json_object_get(e, "peer"));
        const json_t *hi = json_object_get(e, "host");
        if (peer == NULL && hosts != NULL && json_is_integer(hi) && json_integer_value(hi) >= 0 &&
            (size_t)json_integer_value(hi) < json_array_size(hosts))
            peer = json_string_value(json_array_get(hosts, (size_t)json_integer_value(hi)));
        hm_moe_uid u;
        const char *at = peer != NULL ? strchr(peer, '@') : NULL;
        if (uid == NULL || hm_moe_uid_parse(uid, strlen(uid), &u) != 0 || at == NULL ||
            strlen(at + 1) > HM_MOE_ADDR_MAX ||
            hm_peer_addr_parse(peer, j->experts[i].pk, &j->experts[i].addr) != 0) {
            snprintf(msg, sizeof(msg), "args.experts[%zu] must be {\"uid\": UID, \"peer\": "
                     "\"PEERID@HOST:PORT\"} (or {\"uid\": UID, \"host\": INDEX into "
                     "args.hosts}) with a valid uid and peer", i);
            hm_control_reply_error(req, "bad_args", msg);
            return -EINVAL;
        }
        hm_strlcpy(j->experts[i].uid, uid, sizeof(j->experts[i].uid));
        hm_strlcpy(j->experts[i].addr_str, at + 1, sizeof(j->experts[i].addr_str));
    }
    return 0;
}

static void call_common(hm_cmd_experts *m, hm_control_req *req, const json_t *args, int backward)
{
    call_job *j = NULL;
    float *x = NULL, *gy = NULL, *out = NULL, *routes = NULL;
    char msg[240];

    if (hm_daemon_life_refuse(&m->life, req))
        return;
    hm_shm *shm = hm_daemon_shm(m->d);
    if (shm == NULL) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
        return;
    }
    j = calloc(1, sizeof(*j));
    if (j == NULL) {
        hm_control_reply_error(req, "internal", "out of memory");
        return;
    }
    j->m = m;
    j->req = req;
    j->shm = shm;
    j->backward = backward;
    j->routed = json_object_get(args, "routes") != NULL;
    if (parse_experts(req, args, j, j->routed ? HM_MOE_MAX_ROUTED : HM_MOE_MAX_K) != 0)
        goto fail;
    long long batch;
    if (hm_daemon_arg_int(req, args, "batch", -1, 1, HM_MOE_MAX_BATCH, &batch) != 0)
        goto fail;
    long long dim;
    if (hm_daemon_arg_int(req, args, "dim", -1, 1, HM_MOE_MAX_DIM, &dim) != 0)
        goto fail;
    /* args.seq: batch sequences of seq rows each, for experts over sequences. */
    long long seq;
    if (hm_daemon_arg_int(req, args, "seq", 0, 0, HM_MOE_MAX_SEQ, &seq) != 0)
        goto fail;
    if (seq == 0 && json_object_get(args, "mask") != NULL) {
        hm_control_reply_error(req, "bad_args", "args.mask goes with args.seq (it pads keys of "
                               "sequences)");
        goto fail;
    }
    const size_t rows = (size_t)batch * (size_t)(seq != 0 ? seq : 1);
    if (rows * (size_t)dim > HM_MOE_MAX_ELEMS) {
        snprintf(msg, sizeof(msg), "batch * %sdim is over %zu values", seq != 0 ? "seq * " : "",
                 (size_t)HM_MOE_MAX_ELEMS);
        hm_control_reply_error(req, "bad_args", msg);
        goto fail;
    }
    /* Routed: slots per sample; the outputs are [batch, slots, dim]. */
    long long slots = 0;
    if (j->routed) {
        if (hm_daemon_arg_int(req, args, "slots", -1, 1, HM_MOE_MAX_K, &slots) != 0)
            goto fail;
        if (rows * (size_t)slots * (size_t)dim > HM_MOE_MAX_ROUTED_ELEMS) {
            snprintf(msg, sizeof(msg), "batch * slots * %sdim is over %zu values",
                     seq != 0 ? "seq * " : "", (size_t)HM_MOE_MAX_ROUTED_ELEMS);
            hm_control_reply_error(req, "bad_args", msg);
            goto fail;
        }
    } else if (json_object_get(args, "slots") != NULL) {
        hm_control_reply_error(req, "bad_args", "args.slots goes with args.routes");
        goto fail;
    }
    /* backward_k_min and backward_timeout, when given, win over k_min and timeout. */
    const char *kname =
        backward && json_object_get(args, "backward_k_min") != NULL ? "backward_k_min" : "k_min";
    const char *tname = backward && json_object_get(args, "backward_timeout") != NULL
                            ? "backward_timeout"
                            : "timeout";
    int zero_ok;
    if (hm_daemon_arg_bool(req, args, "allow_zero_outputs", 0, &zero_ok) != 0)
        goto fail;
    if (zero_ok && !j->routed) {
        hm_control_reply_error(req, "bad_args", "args.allow_zero_outputs goes with args.routes "
                               "(a sample without answers gets zeros)");
        goto fail;
    }
    long long k_min;
    if (j->routed) {
        /* Per sample: k_min 0 only where the caller takes zero outputs. */
        if (hm_daemon_arg_int(req, args, kname, 1, zero_ok ? 0 : 1, slots, &k_min) != 0)
            goto fail;
    } else if (hm_daemon_arg_int(req, args, kname, (long long)j->k, 1, (long long)j->k,
                                 &k_min) != 0) {
        goto fail;
    }
    double timeout;
    if (hm_daemon_arg_seconds(req, args, tname, 10.0, MAX_TIMEOUT_S, &timeout) != 0)
        goto fail;
    double after;
    if (hm_daemon_arg_seconds(req, args, "timeout_after_k_min", 1.0, MAX_TIMEOUT_S, &after) != 0)
        goto fail;
    size_t n = rows * (size_t)dim;
    size_t kn = j->routed ? n * (size_t)slots : j->k * n;
    if (j->routed) {
        /* The rows gathered per expert, their replies and (backward) gradients. */
        j->bytes = (uint64_t)kn * sizeof(float) * (backward ? 3 : 2) + (uint64_t)j->k * 4096;
    } else {
        /* Each expert gets a frame of its own: x (and gy) plus an envelope. */
        j->bytes = (uint64_t)j->k * ((uint64_t)n * sizeof(float) * (backward ? 2 : 1) +
                                     (json_object_get(args, "mask") != NULL ? rows : 0) + 4096);
    }
    if (m->call_bytes + j->bytes > MAX_CALL_BYTES) {
        snprintf(msg, sizeof(msg), "expert calls in flight already hold %llu MiB, and this one "
                 "needs %llu MiB more (at most %llu MiB at once): retry later",
                 (unsigned long long)(m->call_bytes >> 20),
                 (unsigned long long)(j->bytes >> 20),
                 (unsigned long long)(MAX_CALL_BYTES >> 20));
        hm_control_reply_error(req, "busy", msg);
        goto fail;
    }
    if (hm_daemon_shm_ref(shm, req, json_object_get(args, "x"), "x", n, &x,
                          &j->pins[j->n_pins]) != 0)
        goto fail;
    j->n_pins++;
    if (json_object_get(args, "mask") != NULL) {
        /* float32 0 or 1 a row (1 a token), copied as bytes: checked here
         * so that a bad mask is the caller's error, not every expert's. */
        float *mf;
        uint64_t pin;
        if (hm_daemon_shm_ref(shm, req, json_object_get(args, "mask"), "mask", rows, &mf, &pin) !=
            0)
            goto fail;
        j->mask = malloc(rows);
        size_t bad = rows, empty = (size_t)batch;
        for (size_t i = 0; j->mask != NULL && i < rows; i++) {
            if (mf[i] != 0.0f && mf[i] != 1.0f && bad == rows)
                bad = i;
            j->mask[i] = mf[i] == 1.0f;
        }
        for (size_t b = 0; j->mask != NULL && bad == rows && empty == (size_t)batch &&
                           b < (size_t)batch;
             b++) {
            size_t kept = 0;
            for (size_t t = 0; t < (size_t)seq; t++)
                kept += j->mask[b * (size_t)seq + t];
            if (kept == 0)
                empty = b;
        }
        hm_shm_put(shm, pin);
        if (j->mask == NULL) {
            hm_control_reply_error(req, "internal", "out of memory");
            goto fail;
        }
        if (bad != rows || empty != (size_t)batch) {
            if (bad != rows)
                snprintf(msg, sizeof(msg), "args.mask[%zu] is neither 0 nor 1 (1: a token, 0: "
                         "padding)", bad);
            else
                snprintf(msg, sizeof(msg), "args.mask pads every key of sequence %zu: each "
                         "must keep one", empty);
            hm_control_reply_error(req, "bad_args", msg);
            goto fail;
        }
    }
    if (j->routed) {
        /* int32 expert indices (-1: none), in place of floats of the same size. */
        if (hm_daemon_shm_ref(shm, req, json_object_get(args, "routes"), "routes",
                              (size_t)batch * (size_t)slots, &routes, &j->pins[j->n_pins]) != 0)
            goto fail;
        j->n_pins++;
    }
    if (backward) {
        if (hm_daemon_shm_ref(shm, req, json_object_get(args, "gy"), "gy", kn, &gy,
                              &j->pins[j->n_pins]) != 0)
            goto fail;
        j->n_pins++;
    }
    const char *oname = backward ? "gx" : "y";
    if (hm_daemon_shm_ref(shm, req, json_object_get(args, oname), oname, kn, &out,
                          &j->pins[j->n_pins]) != 0)
        goto fail;
    j->n_pins++;
    j->k_min = (size_t)k_min;
    j->timeout_s = timeout;
    hm_moe_call_opts o = {.k_min = (size_t)k_min,
                          .timeout_ms = ms_of(timeout),
                          .timeout_after_k_min_ms = ms_of(after),
                          .errors_out = j->errs,
                          .seq = (size_t)seq,
                          .mask = j->mask};
    int r;
    if (j->routed) {
        const int32_t *rt = (const int32_t *)(void *)routes;
        r = backward ? hm_moe_backward_routed(m->cli, j->experts, j->k, rt, (size_t)slots, x, gy,
                                              (size_t)batch, (size_t)dim, out, &o, on_called, j,
                                              NULL)
                     : hm_moe_forward_routed(m->cli, j->experts, j->k, rt, (size_t)slots, x,
                                             (size_t)batch, (size_t)dim, out, &o, on_called, j,
                                             NULL);
    } else {
        r = backward ? hm_moe_backward(m->cli, j->experts, j->k, x, gy, rows, (size_t)dim, out,
                                       &o, on_called, j, NULL)
                     : hm_moe_forward(m->cli, j->experts, j->k, x, rows, (size_t)dim, out, &o,
                                      on_called, j, NULL);
    }
    if (r != 0) {
        if (r == -EINVAL && j->routed)
            snprintf(msg, sizeof(msg), "cannot start the call: args.routes holds an index that "
                     "is neither -1 nor one of the %zu experts", j->k);
        else
            snprintf(msg, sizeof(msg), "cannot start the call: %s", hm_strerror(r));
        hm_control_reply_error(req, r == -EINVAL || r == -EMSGSIZE ? "bad_args" : "internal",
                               msg);
        goto fail;
    }
    m->call_bytes += j->bytes;
    m->life.jobs++;
    return;
fail:
    call_release(j);
    call_job_free(j);
}

/* ---- experts.route: per-sample beam search over a batch's gate scores ---- */

typedef struct route_job {
    hm_cmd_experts *m;
    hm_control_req *req;
    hm_shm *shm;
    uint64_t pins[2];
    size_t n_pins;
    int32_t *routes_out; /* [batch, k_best] in shared memory */
} route_job;

static void route_job_release(route_job *j)
{
    for (size_t i = 0; i < j->n_pins; i++)
        hm_shm_put(j->shm, j->pins[i]);
    j->n_pins = 0;
}

/* The experts as {hosts: [...], experts: [{uid, host, peer}]}: each host once. */
static json_t *routed_experts_json(const hm_moe_expert *e, size_t n, json_t **hosts_out)
{
    json_t *arr = json_array(), *hosts = json_array();
    char (*seen)[HM_PEER_ID_LEN + HM_MOE_ADDR_MAX + 2] = n > 0 ? calloc(n, sizeof(*seen)) : NULL;
    size_t n_hosts = 0;
    if (arr == NULL || hosts == NULL || (n > 0 && seen == NULL))
        goto fail;
    for (size_t i = 0; i < n; i++) {
        char peer[HM_PEER_ID_LEN + 1], host[HM_PEER_ID_LEN + HM_MOE_ADDR_MAX + 2];
        hm_peer_id_encode(e[i].pk, peer);
        snprintf(host, sizeof(host), "%s@%s", peer, e[i].addr_str);
        size_t h = 0;
        while (h < n_hosts && strcmp(seen[h], host) != 0)
            h++;
        if (h == n_hosts) {
            memcpy(seen[n_hosts++], host, sizeof(host));
            if (json_array_append_new(hosts, json_string(host)) != 0)
                goto fail;
        }
        if (json_array_append_new(arr, json_pack("{s:s, s:I, s:s}", "uid", e[i].uid, "host",
                                                 (json_int_t)h, "peer", host)) != 0)
            goto fail;
    }
    free(seen);
    *hosts_out = hosts;
    return arr;
fail:
    free(seen);
    json_decref(arr);
    json_decref(hosts);
    return NULL;
}

static void on_routed(void *ud, int status, const hm_moe_expert *experts, size_t n,
                      const int32_t *routes, size_t batch, size_t k_best)
{
    route_job *j = ud;
    hm_cmd_experts *m = j->m;
    if (status == -ECANCELED) {
        hm_control_reply_error(j->req, "stopping", "the daemon is shutting down");
    } else if (status != 0 && status != -ENOENT) {
        char msg[160];
        snprintf(msg, sizeof(msg), "per-sample beam search failed: %s", hm_strerror(status));
        hm_control_reply_error(j->req, status == -ETIMEDOUT ? "timeout" : "failed", msg);
    } else {
        size_t short_samples = 0;
        for (size_t b = 0; b < batch; b++) {
            for (size_t i = 0; i < k_best; i++)
                j->routes_out[b * k_best + i] = status == 0 ? routes[b * k_best + i] : -1;
            short_samples += status != 0 || routes[b * k_best + k_best - 1] < 0;
        }
        json_t *hosts = NULL;
        json_t *arr = routed_experts_json(experts, status == 0 ? n : 0, &hosts);
        hm_daemon_reply(j->req, arr != NULL ? json_pack("{s:o, s:o, s:I}", "experts", arr,
                                                        "hosts", hosts, "short_samples",
                                                        (json_int_t)short_samples)
                                            : NULL);
    }
    route_job_release(j);
    free(j);
    job_done(m);
}

static void cmd_route(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_experts *m = ud;
    size_t sizes[HM_MOE_MAX_GRID_DIMS] = {0};
    size_t ndims = 0, total = 0;
    float *scores = NULL, *routes = NULL;
    route_job *j = NULL;
    char msg[200];

    if (hm_daemon_life_refuse(&m->life, req))
        return;
    hm_shm *shm = hm_daemon_shm(m->d);
    if (shm == NULL) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
        return;
    }
    const char *prefix;
    if (hm_daemon_arg_string(req, args, "prefix", HM_MOE_PREFIX_MAX, 0, &prefix) != 0)
        return;
    long long k_best;
    if (hm_daemon_arg_int(req, args, "k_best", -1, 1, HM_MOE_MAX_K, &k_best) != 0)
        return;
    long long beam;
    if (hm_daemon_arg_int(req, args, "beam_size", 0, 0, HM_DHT_MANY_MAX, &beam) != 0)
        return;
    long long batch;
    if (hm_daemon_arg_int(req, args, "batch", -1, 1, HM_MOE_MAX_BATCH, &batch) != 0)
        return;
    double timeout;
    if (hm_daemon_arg_seconds(req, args, "timeout", 5.0, MAX_TIMEOUT_S, &timeout) != 0)
        return;
    const json_t *gv = json_object_get(args, "grid");
    if (!json_is_array(gv) || json_array_size(gv) < 1 ||
        json_array_size(gv) > HM_MOE_MAX_GRID_DIMS) {
        hm_control_reply_error(req, "bad_args", "args.grid must be a list of 1 to 4 grid sizes");
        return;
    }
    ndims = json_array_size(gv);
    for (size_t d = 0; d < ndims; d++) {
        const json_t *g = json_array_get(gv, d);
        if (!json_is_integer(g) || json_integer_value(g) < 1 ||
            json_integer_value(g) > HM_MOE_MAX_GRID) {
            hm_control_reply_error(req, "bad_args", "each size in args.grid must be an integer "
                                   "from 1 to 65536");
            return;
        }
        sizes[d] = (size_t)json_integer_value(g);
        total += sizes[d];
    }
    if ((size_t)batch * total > HM_MOE_MAX_ROUTED_ELEMS) {
        hm_control_reply_error(req, "bad_args", "batch * sum(grid) is over 2^25 scores");
        return;
    }
    j = calloc(1, sizeof(*j));
    if (j == NULL) {
        hm_control_reply_error(req, "internal", "out of memory");
        return;
    }
    j->m = m;
    j->req = req;
    j->shm = shm;
    if (hm_daemon_shm_ref(shm, req, json_object_get(args, "scores"), "scores",
                          (size_t)batch * total, &scores, &j->pins[j->n_pins]) != 0)
        goto fail;
    j->n_pins++;
    if (hm_daemon_shm_ref(shm, req, json_object_get(args, "routes"), "routes",
                          (size_t)batch * (size_t)k_best, &routes, &j->pins[j->n_pins]) != 0)
        goto fail;
    j->n_pins++;
    j->routes_out = (int32_t *)(void *)routes;
    /* The search copies the scores before it returns. */
    int r = hm_moe_route(m->cli, prefix, scores, (size_t)batch, sizes, ndims, (size_t)k_best,
                         (size_t)beam, ms_of(timeout), on_routed, j);
    if (r != 0) {
        if (r == -E2BIG)
            snprintf(msg, sizeof(msg), "the search is too wide: a level could read over 4096 "
                     "prefixes, or the batch choose over %d experts; use a smaller batch, "
                     "beam_size or k_best", HM_MOE_MAX_ROUTED);
        else if (r == -EINVAL)
            snprintf(msg, sizeof(msg), "cannot search under '%s': a bad prefix or a score "
                     "that is not finite", prefix);
        else
            snprintf(msg, sizeof(msg), "cannot search under '%s': %s", prefix, hm_strerror(r));
        hm_control_reply_error(req, r == -ENOMEM ? "internal" : "bad_args", msg);
        goto fail;
    }
    m->life.jobs++;
    return;
fail:
    route_job_release(j);
    free(j);
}

static void cmd_forward(void *ud, hm_control_req *req, const json_t *args)
{
    call_common(ud, req, args, 0);
}

static void cmd_backward(void *ud, hm_control_req *req, const json_t *args)
{
    call_common(ud, req, args, 1);
}

/* ---- experts.call: one forward on a file, for hivemindctl ---- */

typedef struct file_job {
    TAILQ_ENTRY(file_job) link;
    int info_pending;           /* info_call is in flight */
    hm_cmd_experts *m;
    hm_control_req *req;
    char uid[HM_MOE_UID_MAX + 1];
    char in[PATH_MAX], out[PATH_MAX];
    uint64_t deadline_ms;
    hm_moe_expert ex;
    size_t dim, batch;          /* batch: rows of dim in the file */
    size_t seq;                 /* args.seq: 0, or rows per sequence for a transformer */
    size_t max_seq;             /* the expert's, from moe.info; 0: it takes [batch, dim] */
    float *x, *y;
    uint64_t started_ms;
    uint64_t info_call;
    hm_moe_call_error err;
} file_job;

static void file_finish(file_job *j, const char *code, const char *msg)
{
    hm_cmd_experts *m = j->m;
    TAILQ_REMOVE(&m->files, j, link);
    if (code != NULL)
        hm_control_reply_error(j->req, code, msg);
    free(j->x);
    free(j->y);
    free(j);
    job_done(m);
}

/* Jobs asking an expert for its shape end now rather than at their
 * timeout. The next job is taken first: a cancelled call's callback
 * (-ECANCELED) may finish and free its job before hm_rpc_cancel returns. */
static void file_cancel_info(hm_cmd_experts *m)
{
    for (file_job *f = TAILQ_FIRST(&m->files), *next; f != NULL; f = next) {
        next = TAILQ_NEXT(f, link);
        if (f->info_pending)
            hm_rpc_cancel(hm_node_rpc(m->node), f->info_call);
    }
}

static uint64_t remaining_ms(const file_job *j)
{
    uint64_t now = hm_now_ms();
    return now < j->deadline_ms ? j->deadline_ms - now : 1;
}

static void on_file_written(void *ud, int status, const char *msg)
{
    file_job *j = ud;
    if (status != 0) {
        file_finish(j, "io", msg);
        return;
    }
    char peer[HM_PEER_ID_LEN + 1], host[HM_PEER_ID_LEN + HM_MOE_ADDR_MAX + 2];
    hm_peer_id_encode(j->ex.pk, peer);
    snprintf(host, sizeof(host), "%s@%s", peer, j->ex.addr_str);
    json_t *res = json_pack("{s:s, s:s, s:I, s:I, s:f}", "uid", j->uid, "peer", host, "batch",
                            (json_int_t)(j->seq != 0 ? j->batch / j->seq : j->batch), "dim",
                            (json_int_t)j->dim, "duration",
                            (double)(hm_now_ms() - j->started_ms) / 1000.0);
    if (res != NULL && j->seq != 0)
        json_object_set_new(res, "seq", json_integer((json_int_t)j->seq));
    hm_daemon_reply(j->req, res);
    file_finish(j, NULL, NULL);
}

static void on_file_called(void *ud, int status, const uint8_t *answered, size_t n_answered)
{
    file_job *j = ud;
    char msg[PATH_MAX + 200];
    HM_UNUSED(answered);
    if (status == -ECANCELED) {
        file_finish(j, "stopping", "the daemon is shutting down");
        return;
    }
    if (status != 0 && status != -ETIMEDOUT) {
        snprintf(msg, sizeof(msg), "expert %s refused the call: %s (%s)", j->uid,
                 j->err.msg[0] ? j->err.msg : "no reason given", hm_strerror(status));
        file_finish(j, refusal_code(status), msg);
        return;
    }
    if (status != 0 || n_answered != 1) {
        snprintf(msg, sizeof(msg), "expert %s did not answer: %s", j->uid,
                 status == -ETIMEDOUT ? "timed out" : hm_strerror(status != 0 ? status : -EPROTO));
        file_finish(j, status == -ETIMEDOUT ? "timeout" : "failed", msg);
        return;
    }
    /* The expert answered: the output is delivered even if the daemon
     * begins to close meanwhile (the job keeps the group alive). */
    int r = hm_tensor_file_write(j->m->d->loop, j->out, j->y, j->batch * j->dim,
                                 on_file_written, j);
    if (r != 0) {
        snprintf(msg, sizeof(msg), "cannot write %s: %s", j->out, hm_strerror(r));
        file_finish(j, "io", msg);
    }
}

static void on_file_read(void *ud, int status, float *data, size_t n, const char *msg)
{
    file_job *j = ud;
    char why[256];
    if (status != 0) {
        file_finish(j, "bad_input", msg);
        return;
    }
    j->x = data;
    j->batch = n / j->dim;
    if (j->m->life.closing) {
        file_finish(j, "stopping", "the daemon is shutting down");
        return;
    }
    j->y = malloc(n * sizeof(float));
    if (j->y == NULL) {
        file_finish(j, "bad_input", "out of memory");
        return;
    }
    hm_moe_call_opts o = {.k_min = 1,
                          .timeout_ms = remaining_ms(j),
                          .timeout_after_k_min_ms = 0,
                          .errors_out = &j->err,
                          .seq = j->seq};
    int r = hm_moe_forward(j->m->cli, &j->ex, 1, j->x, j->batch, j->dim, j->y, &o,
                           on_file_called, j, NULL);
    if (r != 0) {
        snprintf(why, sizeof(why), "cannot call %s: %s", j->uid, hm_strerror(r));
        file_finish(j, "failed", why);
    }
}

/* Reads the input off the loop: a whole number of rows of the expert's
 * dim, at most a call's cap; on_file_read goes on from there. */
static void read_input(file_job *j)
{
    char expect[160];
    size_t per = j->seq != 0 ? j->seq : 1; /* rows of dim per sample */
    if (j->seq != 0)
        snprintf(expect, sizeof(expect), "1 to %d sequences of %zu rows of %zu float32 (seq, "
                 "the expert's dim)", HM_MOE_MAX_BATCH, j->seq, j->dim);
    else
        snprintf(expect, sizeof(expect), "1 to %d rows of %zu float32 (the expert's dim)",
                 HM_MOE_MAX_BATCH, j->dim);
    hm_tensor_file_read_opts ro = {
        .row = j->dim * per,
        .max_bytes = HM_MIN((size_t)HM_MOE_MAX_BATCH * per * j->dim, (size_t)HM_MOE_MAX_ELEMS) *
                     sizeof(float),
        .finite = 0,
        .expect = expect,
    };
    int r = hm_tensor_file_read(j->m->d->loop, j->in, &ro, on_file_read, j);
    if (r != 0) {
        char msg[PATH_MAX + 64];
        snprintf(msg, sizeof(msg), "cannot read %s: %s", j->in, hm_strerror(r));
        file_finish(j, "internal", msg);
    }
}

static void on_file_info(void *ud, int status, const uint8_t *body, size_t len)
{
    file_job *j = ud;
    char type[HM_MOE_TYPE_MAX + 1], msg[PATH_MAX + 200];
    size_t hidden;
    j->info_pending = 0;
    if (status == -ECANCELED || j->m->life.closing) {
        file_finish(j, "stopping", "the daemon is shutting down");
        return;
    }
    size_t heads;
    if (status != 0 ||
        hm_moe_decode_info_seq(body, len, type, &j->dim, &hidden, &heads, &j->max_seq) != 0) {
        snprintf(msg, sizeof(msg), "expert %s at %s did not describe itself: %s", j->uid,
                 j->ex.addr_str, status != 0 ? hm_strerror(status) : "malformed reply");
        file_finish(j, status == -ETIMEDOUT ? "timeout" : "failed", msg);
        return;
    }
    /* An expert over sequences reads the file as [batch, seq, dim]: it needs args.seq. */
    if (j->max_seq != 0 && (j->seq == 0 || j->seq > j->max_seq)) {
        snprintf(msg, sizeof(msg), "expert %s is a %s taking inputs [batch, seq, %zu] with seq "
                 "at most %zu: give args.seq (hivemindctl: --seq) within that", j->uid, type,
                 j->dim, j->max_seq);
        file_finish(j, "bad_args", msg);
        return;
    }
    if (j->max_seq == 0 && j->seq != 0) {
        snprintf(msg, sizeof(msg), "expert %s takes inputs [batch, %zu]: it has no seq", j->uid,
                 j->dim);
        file_finish(j, "bad_args", msg);
        return;
    }
    read_input(j);
}

static void on_file_lookup(void *ud, int status, const hm_moe_expert *experts, size_t n)
{
    file_job *j = ud;
    char msg[256];
    uint8_t buf[256];
    hm_wire_wr w;
    if (status == -ECANCELED || j->m->life.closing) {
        file_finish(j, "stopping", "the daemon is shutting down");
        return;
    }
    if (status != 0 || n == 0) {
        snprintf(msg, sizeof(msg), "no live host declares expert %s%s", j->uid,
                 status == -ETIMEDOUT ? " (the lookup timed out)" : "");
        file_finish(j, status == -ETIMEDOUT ? "timeout" : "not_found", msg);
        return;
    }
    j->ex = experts[0];
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_moe_encode_info_req(&w, j->uid);
    int r = hm_wire_wr_error(&w);
    if (r == 0)
        r = hm_rpc_call(hm_node_rpc(j->m->node), j->ex.pk, (const struct sockaddr *)&j->ex.addr,
                        HM_MOE_METHOD_INFO, w.buf, w.len, HM_RPC_STREAM, remaining_ms(j),
                        on_file_info, j, &j->info_call);
    if (r == 0)
        j->info_pending = 1;
    if (r != 0) {
        snprintf(msg, sizeof(msg), "cannot ask %s for its shape: %s", j->uid, hm_strerror(r));
        file_finish(j, "failed", msg);
    }
}

static void cmd_call(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_experts *m = ud;
    file_job *j;
    hm_moe_uid u;

    if (hm_daemon_life_refuse(&m->life, req))
        return;
    const char *uid;
    if (hm_daemon_arg_string(req, args, "uid", HM_MOE_UID_MAX, 0, &uid) != 0)
        return;
    char why[160];
    if (hm_moe_uid_check(uid, strlen(uid), &u, why, sizeof(why)) != 0) {
        hm_control_reply_error(req, "bad_args", why);
        return;
    }
    double timeout;
    if (hm_daemon_arg_seconds(req, args, "timeout", 30.0, MAX_TIMEOUT_S, &timeout) != 0)
        return;
    long long seq;
    if (hm_daemon_arg_int(req, args, "seq", 0, 0, HM_MOE_MAX_SEQ, &seq) != 0)
        return;
    j = calloc(1, sizeof(*j));
    if (j == NULL) {
        hm_control_reply_error(req, "internal", "out of memory");
        return;
    }
    j->m = m;
    j->req = req;
    j->seq = (size_t)seq;
    hm_strlcpy(j->uid, uid, sizeof(j->uid));
    if (hm_daemon_arg_path(req, args, "in", j->in) != 0 ||
        hm_daemon_arg_path(req, args, "out", j->out) != 0) {
        free(j);
        return;
    }
    j->started_ms = hm_now_ms();
    j->deadline_ms = j->started_ms + ms_of(timeout);
    int r = hm_moe_lookup(m->cli, j->uid, remaining_ms(j), on_file_lookup, j);
    if (r != 0) {
        char msg[160];
        snprintf(msg, sizeof(msg), "cannot look %s up: %s", j->uid, hm_strerror(r));
        hm_control_reply_error(req, "internal", msg);
        free(j);
        return;
    }
    m->life.jobs++;
    TAILQ_INSERT_TAIL(&m->files, j, link);
}

/* ---- setup ---- */

/* The expert settings of the configuration. */
static void config_of(const hm_config *c, hm_cmd_experts_config *out)
{
    *out = (hm_cmd_experts_config){
        .state_dir = c->state_dir,
        .host_experts = c->host_experts,
        .type = c->expert_type,
        .dim = c->expert_dim,
        .hidden = c->expert_hidden,
        .optimizer = c->expert_optimizer,
        .lr = c->expert_lr,
        .workers = c->expert_workers,
        .max_batch = c->expert_max_batch,
        .checkpoint_interval_s = c->checkpoint_interval_s,
        .max_queued = c->expert_max_queued,
        .max_queued_mib = c->expert_max_queued_mib,
        .record_max_ttl_s = c->expert_record_max_ttl_s,
        .one_holder = c->expert_one_holder,
        .hosts_file = c->expert_hosts_file,
        .backoff_s = c->expert_backoff_s,
        .backoff_max_s = c->expert_backoff_max_s,
        .heads = c->expert_heads,
        .max_seq = c->expert_max_seq,
    };
}

/* Largest ExpertHostsFile read: HM_MOE_ALLOW_MAX_RULES lines of a prefix and a few keys. */
#define HOSTS_FILE_MAX (1024 * 1024)

/* Reads and parses the allow-list file. 0 (*out NULL for none), or an error with err set. */
static int load_hosts_file(const char *path, hm_moe_allow **out, char *err, size_t errlen)
{
    char why[256] = "";
    char *buf = NULL;
    size_t len = 0;
    int r;

    *out = NULL;
    if (path == NULL || path[0] == '\0')
        return 0;
    FILE *fp = fopen(path, "r");
    if (fp == NULL) {
        r = -errno;
        snprintf(err, errlen, "ExpertHostsFile: cannot open %s: %s", path, strerror(errno));
        return r;
    }
    buf = malloc(HOSTS_FILE_MAX + 1);
    if (buf == NULL) {
        fclose(fp);
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    len = fread(buf, 1, HOSTS_FILE_MAX + 1, fp);
    r = ferror(fp) ? -EIO : 0;
    fclose(fp);
    if (r == 0 && len > HOSTS_FILE_MAX) {
        snprintf(err, errlen, "ExpertHostsFile: %s is larger than %d bytes", path,
                 HOSTS_FILE_MAX);
        r = -EMSGSIZE;
    } else if (r < 0) {
        snprintf(err, errlen, "ExpertHostsFile: cannot read %s", path);
    } else if ((r = hm_moe_allow_parse(buf, len, out, why, sizeof(why))) < 0) {
        snprintf(err, errlen, "ExpertHostsFile: %s: %s", path,
                 why[0] != '\0' ? why : hm_strerror(r));
    }
    free(buf);
    return r < 0 ? -EINVAL : 0;
}

static int check_config(const hm_cmd_experts_config *c, char *err, size_t errlen)
{
    if (strcmp(c->type, HM_MOE_TYPE_TRANSFORMER) == 0 && c->heads != 0 && c->dim % c->heads != 0) {
        snprintf(err, errlen, "ExpertHeads (%u) must divide ExpertDim (%u)", c->heads, c->dim);
        return -EINVAL;
    }
    if (c->backoff_max_s < c->backoff_s) {
        snprintf(err, errlen, "ExpertBackoffMax (%u s) must be at least ExpertBackoff (%u s)",
                 c->backoff_max_s, c->backoff_s);
        return -EINVAL;
    }
    hm_ffn_config cfg;
    hm_moe_allow *allow = NULL;
    char one[HM_MOE_UID_MAX * 4], why[256];
    int r = build_ffn_config(c->type, c->dim, c->hidden, c->optimizer, c->lr, &cfg, err, errlen);
    if (r == 0)
        r = load_hosts_file(c->hosts_file, &allow, err, errlen);
    hm_moe_allow_free(allow);
    if (r != 0 || c->host_experts == NULL || c->host_experts[0] == '\0')
        return r;
    hm_moe_uid *uids = calloc(HM_MOE_MAX_PATTERN_EXPERTS, sizeof(*uids));
    if (uids == NULL) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    const char *p = c->host_experts;
    while (r == 0 && *p != '\0') {
        const char *comma = strchr(p, ',');
        size_t n = comma != NULL ? (size_t)(comma - p) : strlen(p);
        if (n == 0 || n >= sizeof(one)) {
            snprintf(err, errlen, "HostExperts: empty or overlong pattern in '%s'",
                     c->host_experts);
            r = -EINVAL;
            break;
        }
        memcpy(one, p, n);
        one[n] = '\0';
        int got = hm_moe_pattern_expand(one, uids, HM_MOE_MAX_PATTERN_EXPERTS, why, sizeof(why));
        if (got < 0) {
            snprintf(err, errlen, "HostExperts: '%s': %s", one,
                     why[0] != '\0' ? why : hm_strerror(got));
            r = -EINVAL;
        }
        p += n;
        if (*p == ',')
            p++;
    }
    free(uids);
    return r;
}

static int experts_new(hm_daemon *d, hm_node *node, hm_control *ctl,
                       const hm_cmd_experts_config *c, hm_cmd_experts **m_out, char *err,
                       size_t errlen)
{
    hm_cmd_experts *m = calloc(1, sizeof(*m));
    int r;
    size_t added = 0;

    if (m == NULL) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    m->d = d;
    m->node = node;
    TAILQ_INIT(&m->files);
    r = build_ffn_config(c->type, c->dim, c->hidden, c->optimizer, c->lr, &m->defcfg, err,
                         errlen);
    if (r != 0)
        goto fail;
    hm_strlcpy(m->deftype, c->type, sizeof(m->deftype));
    m->defheads = c->heads;
    m->defmaxseq = c->max_seq;
    hm_moe_server_opts so = {
        .state_dir = c->state_dir,
        .workers = c->workers,
        .max_batch_size = c->max_batch,
        .checkpoint_interval_ms = (uint64_t)c->checkpoint_interval_s * 1000u,
        .max_queued_samples = c->max_queued,
        .max_queued_bytes = (size_t)c->max_queued_mib << 20,
    };
    r = hm_moe_server_new(node, &so, &m->srv);
    if (r != 0) {
        snprintf(err, errlen, "cannot start the expert server: %s", hm_strerror(r));
        goto fail;
    }
    m->life.parts = 1;
    r = hm_moe_client_new(node, &m->cli);
    if (r != 0) {
        snprintf(err, errlen, "cannot start the expert client: %s", hm_strerror(r));
        goto fail;
    }
    if ((r = load_hosts_file(c->hosts_file, &m->allow, err, errlen)) != 0)
        goto fail;
    hm_moe_client_policy pol = {
        .record_max_ttl_s = c->record_max_ttl_s,
        .any_holder = !c->one_holder,
        .allow = m->allow,
        .backoff_ms = (uint64_t)c->backoff_s * 1000,
        .backoff_max_ms = (uint64_t)c->backoff_max_s * 1000,
    };
    if ((r = hm_moe_client_set_policy(m->cli, &pol)) != 0) {
        snprintf(err, errlen, "ExpertRecordMaxTtl, ExpertBackoff or ExpertBackoffMax: %s",
                 hm_strerror(r));
        goto fail;
    }
    if (c->host_experts != NULL && c->host_experts[0] != '\0') {
        r = host_list(m, c->host_experts, m->deftype, &m->defcfg, m->defheads, m->defmaxseq,
                      &added, err, errlen);
        if (r != 0)
            goto fail;
        hm_info(MOD, "hosting %zu experts (%s, %s, dim %u)", added, c->host_experts, c->type,
                c->dim);
    }
    if ((r = hm_control_register(ctl, "experts.host", cmd_host, m)) != 0 ||
        (r = hm_control_register(ctl, "experts.list", cmd_list, m)) != 0 ||
        (r = hm_control_register(ctl, "experts.find", cmd_find, m)) != 0 ||
        (r = hm_control_register(ctl, "experts.route", cmd_route, m)) != 0 ||
        (r = hm_control_register(ctl, "experts.forward", cmd_forward, m)) != 0 ||
        (r = hm_control_register(ctl, "experts.backward", cmd_backward, m)) != 0 ||
        (r = hm_control_register(ctl, "experts.call", cmd_call, m)) != 0) {
        snprintf(err, errlen, "cannot register the experts commands: %s", hm_strerror(r));
        goto fail;
    }
    *m_out = m;
    return 0;
fail:
    /* Nothing was hosted for long: close without withdrawing, synchronously
     * as far as the caller is concerned (the loop finishes the rest). */
    if (m->cli != NULL)
        hm_moe_client_free(m->cli);
    if (m->srv != NULL)
        hm_moe_server_close(m->srv, 0, NULL, NULL);
    hm_moe_allow_free(m->allow);
    free(m);
    return r;
}

json_t *hm_cmd_experts_hosted(hm_cmd_experts *m)
{
    if (m == NULL || m->srv == NULL || m->life.closing)
        return json_array();
    return hosted_json(m);
}

void hm_cmd_experts_metrics(hm_cmd_experts *m, hm_strbuf *b)
{
    hm_moe_backoff_stats st;
    if (m == NULL || m->cli == NULL)
        return;
    hm_moe_client_backoff_stats(m->cli, &st);
    hm_strbuf_printf(b,
                     "# HELP hivemindd_expert_host_stalls_total Expert hosts that let a call "
                     "wait (each starts or doubles a back-off).\n"
                     "# TYPE hivemindd_expert_host_stalls_total counter\n"
                     "hivemindd_expert_host_stalls_total %llu\n"
                     "# HELP hivemindd_expert_calls_skipped_total Experts left out of calls "
                     "because their host was backed off.\n"
                     "# TYPE hivemindd_expert_calls_skipped_total counter\n"
                     "hivemindd_expert_calls_skipped_total %llu\n"
                     "# HELP hivemindd_expert_host_recoveries_total Backed-off expert hosts "
                     "that answered again.\n"
                     "# TYPE hivemindd_expert_host_recoveries_total counter\n"
                     "hivemindd_expert_host_recoveries_total %llu\n"
                     "# HELP hivemindd_expert_hosts_backed_off Expert hosts this daemon's calls "
                     "skip now.\n"
                     "# TYPE hivemindd_expert_hosts_backed_off gauge\n"
                     "hivemindd_expert_hosts_backed_off %zu\n",
                     (unsigned long long)st.stalls, (unsigned long long)st.skipped,
                     (unsigned long long)st.recovered, st.hosts);
}

void hm_cmd_experts_limits(hm_cmd_experts *m, hm_limit_emit_fn emit, void *ud)
{
    if (m == NULL)
        return;
    hm_moe_server_limits(m->srv, emit, ud);
    hm_moe_client_limits(m->cli, emit, ud);
}

int hm_cmd_experts_check_config(const hm_config *c, char *err, size_t errlen)
{
    hm_cmd_experts_config mc;
    config_of(c, &mc);
    return check_config(&mc, err, errlen);
}

int hm_cmd_experts_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen)
{
    hm_cmd_experts_config mc;
    config_of(d->cfg, &mc);
    return experts_new(d, d->node, ctl, &mc, &d->experts, err, errlen);
}

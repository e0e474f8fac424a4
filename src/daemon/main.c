/*
 * hivemindd: the daemon. It reads the configuration (config.c), runs one
 * node (node.c) and the control socket (control.c) on one libuv loop, and
 * handles the process's signals: SIGTERM and SIGINT drain and exit 0, SIGHUP
 * re-reads the config file. It owns the loop, the node, the control server
 * and the signal handles.
 *
 * Once the node listens and the control socket is up, the node's address
 * PEERID@HOST:PORT is written alone on the first line of standard output
 * (and flushed), so that scripts can read it with `head -n 1`. Logs go to
 * standard error.
 *
 * systemd readiness is told without libsystemd: when NOTIFY_SOCKET names a
 * socket (a path, or @name for an abstract one) the daemon sends READY=1
 * once listening, RELOADING=1 and READY=1 around a reload, and STOPPING=1
 * when it begins to shut down.
 */
#include "config.h"

#include "averaging/averager.h"
#include "averaging/codec.h"
#include "src/daemon/control.h"
#include "src/base/crypto.h"
#include "src/daemon/daemon.h"
#include "src/daemon/cmd_experts.h"
#include "src/daemon/cmd_state.h"
#include "src/daemon/hm_config.h"
#include "src/node/node.h"
#include "src/daemon/shm.h"
#include "src/base/util.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#define MOD "hivemindd"

typedef struct daemon {
    uv_loop_t loop;
    hm_config cfg;      /* the configuration in force */
    hm_config_args args;
    hm_node *node;
    hm_averager *av;    /* the node's averager; NULL once shutting down */
    size_t avg_jobs;    /* "average" commands in progress */
    size_t avg_bytes;   /* bytes of tensors they hold */
    hm_control *ctl;
    hm_shm *shm;        /* shared memory with the trainers; freed after the loop */
    hm_dmoe *moe;       /* hosted experts and expert calls; NULL once closing */
    hm_dstate *state;   /* state sharing (state.* commands); NULL once closing */
    uv_signal_t sig_term, sig_int, sig_hup;
    int signals_open;
    int stopping;
    int parts_open;     /* node and control server not yet closed */
    int loop_open;      /* the loop was initialised */
    uint8_t swarm_key[32];
    int have_swarm_key;
} daemon_t;

/* ---- systemd notification ---- */

static void sd_notify_msg(const char *msg)
{
    const char *e = getenv("NOTIFY_SOCKET");
    struct sockaddr_un sa;
    size_t n;

    if (e == NULL || (e[0] != '/' && e[0] != '@'))
        return;
    n = strlen(e);
    if (n >= sizeof(sa.sun_path))
        return;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, e, n);
    if (e[0] == '@')
        sa.sun_path[0] = '\0';
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return;
    socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
    if (sendto(fd, msg, strlen(msg), MSG_NOSIGNAL, (struct sockaddr *)&sa, len) < 0)
        hm_debug(MOD, "notify socket %s: %s", e, strerror(errno));
    close(fd);
}

static void sd_notify_reloading(void)
{
    char msg[96];
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    /* systemd 253+ wants the time of the reload with RELOADING=1. */
    snprintf(msg, sizeof(msg), "RELOADING=1\nMONOTONIC_USEC=%llu",
             (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000);
    sd_notify_msg(msg);
}

/* ---- shutdown ---- */

static void on_part_closed(void *ud)
{
    daemon_t *d = ud;
    d->parts_open--;
}

static void close_node(daemon_t *d);

/* The expert settings of the configuration, as daemon_moe takes them. */
static void moe_config(const hm_config *c, hm_dmoe_config *out)
{
    *out = (hm_dmoe_config){
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
    };
}

static void on_moe_closed(void *ud)
{
    daemon_t *d = ud;
    d->parts_open--;
    close_node(d);
}

static void begin_shutdown(daemon_t *d, const char *why)
{
    if (d->stopping)
        return;
    d->stopping = 1;
    sd_notify_msg("STOPPING=1");
    hm_info(MOD, "shutting down (%s)", why);
    /* With the handlers gone a second SIGTERM or SIGINT kills the process
     * outright, which is the way out of a drain that hangs. */
    if (d->signals_open) {
        uv_close((uv_handle_t *)&d->sig_term, NULL);
        uv_close((uv_handle_t *)&d->sig_int, NULL);
        uv_close((uv_handle_t *)&d->sig_hup, NULL);
        d->signals_open = 0;
    }
    /* The control socket closes last but the node, so that commands ended
     * by the shutdown are still answered ("stopping"). The expert server
     * checkpoints and withdraws its DHT declarations while the node still
     * runs; the rest closes after it. */
    if (d->moe != NULL) {
        hm_dmoe *m = d->moe;
        d->moe = NULL;
        hm_dmoe_close(m, on_moe_closed, d);
        return;
    }
    close_node(d);
}

static void close_node(daemon_t *d)
{
    if (d->state != NULL) {
        hm_dstate_close(d->state, on_part_closed, d);
        d->state = NULL;
    }
    /* Rounds end (-ECANCELED) and are answered before the socket closes. */
    if (d->av != NULL) {
        hm_averager_close(d->av, on_part_closed, d);
        d->av = NULL;
    }
    if (d->ctl != NULL) {
        hm_control_close(d->ctl, on_part_closed, d);
        d->ctl = NULL;
    }
    if (d->node != NULL) {
        hm_node_close(d->node, on_part_closed, d);
        d->node = NULL;
    }
}

/* ---- reload ---- */

static int has_peer(const hm_config *c, const char *addr)
{
    for (size_t i = 0; i < c->n_initial_peers; i++)
        if (strcmp(c->initial_peers[i], addr) == 0)
            return 1;
    return 0;
}

static void reload(daemon_t *d)
{
    hm_config *fresh = NULL;
    char err[512];
    const char *changed[32];
    int reloadable[32];

    sd_notify_reloading();
    if (d->args.config_file == NULL) {
        hm_info(MOD, "SIGHUP: no config file was given (-c), nothing to re-read");
        goto out;
    }
    fresh = malloc(sizeof(*fresh));
    if (fresh == NULL) {
        hm_error(MOD, "SIGHUP: out of memory; keeping the running configuration");
        goto out;
    }
    if (hm_config_build(fresh, &d->args, err, sizeof(err)) != 0) {
        hm_error(MOD, "SIGHUP: %s; keeping the running configuration", err);
        goto out;
    }
    size_t n = hm_config_diff(&d->cfg, fresh, changed, reloadable, HM_ARRAY_LEN(changed));
    if (n == 0)
        hm_info(MOD, "SIGHUP: %s re-read, nothing changed", d->args.config_file);
    for (size_t i = 0; i < n && i < HM_ARRAY_LEN(changed); i++) {
        if (!reloadable[i]) {
            hm_warn(MOD, "SIGHUP: %s changed; restart hivemindd to apply it", changed[i]);
            continue;
        }
        if (strcmp(changed[i], "LogLevel") == 0) {
            hm_log_set_level(fresh->log_level);
            hm_info(MOD, "SIGHUP: LogLevel is now %s", hm_log_level_name(fresh->log_level));
            d->cfg.log_level = fresh->log_level;
        } else if (strcmp(changed[i], "InitialPeers") == 0) {
            for (size_t j = 0; j < fresh->n_initial_peers; j++) {
                const char *p = fresh->initial_peers[j];
                if (has_peer(&d->cfg, p) || d->node == NULL)
                    continue;
                int r = hm_node_add_peer(d->node, p);
                if (r < 0)
                    hm_warn(MOD, "SIGHUP: initial peer %s not added: %s", p, hm_strerror(r));
                else
                    hm_info(MOD, "SIGHUP: added initial peer %s", p);
            }
            memcpy(d->cfg.initial_peers, fresh->initial_peers, sizeof(d->cfg.initial_peers));
            d->cfg.n_initial_peers = fresh->n_initial_peers;
        }
    }
out:
    free(fresh);
    sd_notify_msg("READY=1");
}

static void on_signal(uv_signal_t *h, int signum)
{
    daemon_t *d = h->data;
    if (signum == SIGHUP)
        reload(d);
    else
        begin_shutdown(d, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* ---- control commands ---- */

static void cmd_info(void *ud, hm_control_req *req, const json_t *args)
{
    daemon_t *d = ud;
    char addr[HM_PEER_ID_LEN + HM_ADDRSTRLEN + 2];
    (void)args;
    if (d->node == NULL) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
        return;
    }
    if (hm_node_address(d->node, addr, sizeof(addr)) != 0)
        addr[0] = '\0';
    size_t shm_segments = 0, shm_bytes = 0;
    if (d->shm != NULL)
        hm_shm_stats(d->shm, &shm_segments, &shm_bytes);
    hm_daemon_reply(req, json_pack("{s:s, s:s, s:s, s:s, s:I, s:b, s:I, s:s, s:{s:I, s:I}}",
                                 "peer_id", hm_node_identity(d->node)->peer_id, "address", addr,
                                 "swarm", hm_node_swarm(d->node), "version", PACKAGE_VERSION,
                                 "uptime_s", (json_int_t)(hm_node_uptime_ms(d->node) / 1000),
                                 "client_mode", d->cfg.client_mode, "pid", (json_int_t)getpid(),
                                 "control_socket", d->cfg.control_socket, "shm", "segments",
                                 (json_int_t)shm_segments, "bytes", (json_int_t)shm_bytes));
}

static void cmd_peers(void *ud, hm_control_req *req, const json_t *args)
{
    daemon_t *d = ud;
    hm_peer_info *peers = NULL;
    json_t *list = NULL;
    (void)args;

    if (d->node == NULL) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
        return;
    }
    size_t total = hm_node_peers(d->node, NULL, 0);
    if (total > 0) {
        peers = calloc(total, sizeof(*peers));
        if (peers == NULL)
            goto fail;
        total = HM_MIN(total, hm_node_peers(d->node, peers, total));
    }
    list = json_array();
    if (list == NULL)
        goto fail;
    uint64_t now = hm_now_ms();
    for (size_t i = 0; i < total; i++) {
        const hm_peer_info *p = &peers[i];
        char a[HM_ADDRSTRLEN];
        json_t *addr = json_null();
        if ((p->addr.ss_family == AF_INET || p->addr.ss_family == AF_INET6) &&
            hm_format_addr((const struct sockaddr *)&p->addr, a, sizeof(a)) == 0)
            addr = json_string(a);
        uint64_t ago = now > p->last_seen_ms ? now - p->last_seen_ms : 0;
        json_t *e = json_pack("{s:s, s:o, s:f, s:o, s:b}", "peer_id", p->peer_id, "address",
                              addr, "last_seen_s", (double)ago / 1000.0, "rtt_ms",
                              p->rtt_ms < 0 ? json_null() : json_real(round(p->rtt_ms * 1000) / 1000),
                              "connected",
                              p->connected);
        if (e == NULL || json_array_append_new(list, e) != 0)
            goto fail;
    }
    free(peers);
    hm_daemon_reply(req, json_pack("{s:o}", "peers", list));
    return;
fail:
    free(peers);
    json_decref(list);
    hm_control_reply_error(req, "internal", "out of memory");
}

static void cmd_metrics(void *ud, hm_control_req *req, const json_t *args)
{
    daemon_t *d = ud;
    (void)args;
    if (d->node == NULL) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
        return;
    }
    char *text = hm_node_metrics(d->node);
    if (text == NULL) {
        hm_control_reply_error(req, "internal", "out of memory");
        return;
    }
    hm_daemon_reply(req, json_pack("{s:s}", "text", text));
    free(text);
}

/* ---- DHT commands ---- */

#define DHT_CMD_TIMEOUT_MS 8000
#define DHT_MAX_TTL_S 86400.0

/* Text when the bytes are valid UTF-8 without NUL, hex otherwise. */
static int set_bytes(json_t *obj, const char *name, const uint8_t *p, size_t len)
{
    json_t *v = memchr(p, 0, len) == NULL ? json_stringn((const char *)p, len) : NULL;
    if (v != NULL)
        return json_object_set_new(obj, name, v);
    char hexname[32];
    char *hex = malloc(2 * len + 1);
    if (hex == NULL)
        return -1;
    hm_hex_encode(p, len, hex);
    snprintf(hexname, sizeof(hexname), "%s_hex", name);
    int r = json_object_set_new(obj, hexname, json_string(hex));
    free(hex);
    return r;
}

/* DHT errors in the words of the DHT (util's hm_strerror speaks transport). */
static const char *dht_strerror(int err)
{
    switch (-err) {
    case ETIMEDOUT:
        return "no answer before the deadline";
    case EHOSTUNREACH:
        return "no DHT peer reachable (is the node connected to a swarm?)";
    case ESTALE:
        return "the replicas hold a newer version of this record";
    case EPERM:
        return "the key or subkey is owned by another node";
    case EBADMSG:
        return "owned record without a valid signature";
    case ETIME:
        return "the record has already expired";
    case ERANGE:
        return "expiration too far ahead";
    case EDQUOT:
        return "this node's storage quota at the replicas is used up";
    case ENOSPC:
        return "the replicas are full";
    case EACCES:
        return "the replicas refused the store token";
    case EMSGSIZE:
        return "record too large for one datagram";
    case ENOBUFS:
        return "too many DHT lookups in progress";
    default:
        return hm_strerror(err);
    }
}

typedef struct dht_get_ctx {
    hm_control_req *req;
    char *subkey; /* filter, or NULL */
} dht_get_ctx;

static void on_dht_get(void *ud, int status, const hm_dht_value *values, size_t n,
                       const hm_dht_lookup_info *info)
{
    dht_get_ctx *c = ud;
    json_t *list = NULL;
    if (status < 0) {
        hm_control_reply_error(c->req, status == -ETIMEDOUT ? "timeout" : "dht_error",
                               dht_strerror(status));
        goto out;
    }
    list = json_array();
    if (list == NULL)
        goto oom;
    for (size_t i = 0; i < n; i++) {
        const hm_dht_record *r = &values[i].rec;
        if (c->subkey != NULL &&
            (!r->has_subkey || r->subkey_len != strlen(c->subkey) ||
             memcmp(r->subkey, c->subkey, r->subkey_len) != 0))
            continue;
        char src[HM_PEER_ID_LEN + 1];
        hm_peer_id_encode(values[i].source_pk, src);
        json_t *e = json_pack("{s:f, s:I, s:s}", "expiration", r->expiration, "seq",
                              (json_int_t)r->seq, "source", src);
        if (e == NULL || set_bytes(e, "value", r->value, r->value_len) != 0 ||
            (r->has_subkey && set_bytes(e, "subkey", r->subkey, r->subkey_len) != 0) ||
            json_array_append_new(list, e) != 0) {
            json_decref(e);
            goto oom;
        }
    }
    hm_daemon_reply(c->req, json_pack("{s:b, s:o, s:i, s:i}", "found", json_array_size(list) > 0,
                                    "values", list, "hops", (int)info->hops, "requests",
                                    (int)info->requests));
    list = NULL;
    goto out;
oom:
    json_decref(list);
    hm_control_reply_error(c->req, "internal", "out of memory");
out:
    free(c->subkey);
    free(c);
}

static int dht_args_key(const json_t *args, const char *name, const char **s_out, size_t *len_out,
                        hm_control_req *req, int required)
{
    const json_t *v = json_object_get(args, name);
    char msg[96];
    if (v == NULL && !required) {
        *s_out = NULL;
        *len_out = 0;
        return 0;
    }
    if (!json_is_string(v)) {
        snprintf(msg, sizeof(msg), "args.%s must be a string", name);
        hm_control_reply_error(req, "bad_args", msg);
        return -EINVAL;
    }
    *s_out = json_string_value(v);
    *len_out = json_string_length(v);
    return 0;
}

static void cmd_dht_get(void *ud, hm_control_req *req, const json_t *args)
{
    daemon_t *d = ud;
    const char *key, *subkey;
    size_t klen, slen;
    if (d->node == NULL) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
        return;
    }
    if (dht_args_key(args, "key", &key, &klen, req, 1) < 0 ||
        dht_args_key(args, "subkey", &subkey, &slen, req, 0) < 0)
        return;
    if (klen == 0 || klen > HM_DHT_KEY_MAX || slen > HM_DHT_SUBKEY_MAX) {
        hm_control_reply_error(req, "bad_args", "key must be 1 to 256 bytes, subkey at most 128");
        return;
    }
    dht_get_ctx *c = calloc(1, sizeof(*c));
    if (c == NULL || (subkey != NULL && (c->subkey = strdup(subkey)) == NULL)) {
        free(c);
        hm_control_reply_error(req, "internal", "out of memory");
        return;
    }
    c->req = req;
    int r = hm_node_dht_get(d->node, (const uint8_t *)key, klen, DHT_CMD_TIMEOUT_MS, on_dht_get, c);
    if (r < 0) {
        free(c->subkey);
        free(c);
        hm_control_reply_error(req, "dht_error", dht_strerror(r));
    }
}

static void on_dht_put(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    hm_control_req *req = ud;
    if (status < 0) {
        hm_control_reply_error(req, status == -ETIMEDOUT ? "timeout" : "dht_error",
                               dht_strerror(status));
        return;
    }
    hm_daemon_reply(req, json_pack("{s:i, s:i, s:i}", "stored", (int)stored, "hops", (int)info->hops,
                                 "requests", (int)info->requests));
}

static void cmd_dht_put(void *ud, hm_control_req *req, const json_t *args)
{
    daemon_t *d = ud;
    const char *key, *subkey, *value;
    size_t klen, slen, vlen;
    if (d->node == NULL) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
        return;
    }
    if (dht_args_key(args, "key", &key, &klen, req, 1) < 0 ||
        dht_args_key(args, "subkey", &subkey, &slen, req, 0) < 0 ||
        dht_args_key(args, "value", &value, &vlen, req, 1) < 0)
        return;
    double ttl = 3600;
    const json_t *t = json_object_get(args, "ttl");
    if (t != NULL) {
        if (!json_is_number(t) || !(json_number_value(t) > 0) ||
            json_number_value(t) > DHT_MAX_TTL_S) {
            hm_control_reply_error(req, "bad_args", "args.ttl must be seconds, above 0 and at most 86400");
            return;
        }
        ttl = json_number_value(t);
    }
    if (klen == 0 || klen > HM_DHT_KEY_MAX || slen > HM_DHT_SUBKEY_MAX || vlen > HM_DHT_VALUE_MAX) {
        hm_control_reply_error(req, "bad_args",
                               "key must be 1 to 256 bytes, subkey at most 128, value at most 1024");
        return;
    }
    int r = hm_node_dht_put(d->node, (const uint8_t *)key, klen, (const uint8_t *)subkey, slen,
                            subkey != NULL, (const uint8_t *)value, vlen, ttl, DHT_CMD_TIMEOUT_MS,
                            on_dht_put, req);
    if (r < 0)
        hm_control_reply_error(req, r == -EMSGSIZE ? "bad_args" : "dht_error",
                               dht_strerror(r));
}

static void cmd_dht_info(void *ud, hm_control_req *req, const json_t *args)
{
    daemon_t *d = ud;
    (void)args;
    if (d->node == NULL) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
        return;
    }
    hm_dht_stats st;
    hm_dht_get_stats(hm_node_dht(d->node), &st);
    hm_daemon_reply(req, json_pack("{s:{s:I, s:I, s:I, s:I}, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:b}",
                                 "routing_table", "size", (json_int_t)st.rt_size, "depth",
                                 (json_int_t)st.rt_depth, "buckets", (json_int_t)st.rt_buckets,
                                 "cached", (json_int_t)st.rt_cached, "records",
                                 (json_int_t)st.records, "record_bytes",
                                 (json_int_t)st.record_bytes, "lookups_active",
                                 (json_int_t)st.lookups_active, "requests_sent",
                                 (json_int_t)st.requests_sent, "requests_received",
                                 (json_int_t)st.requests_received, "timeouts",
                                 (json_int_t)st.timeouts, "rate_limited",
                                 (json_int_t)st.rate_limited, "client_mode", d->cfg.client_mode));
}

/* ---- averaging commands ----
 *
 * "average" averages a raw little-endian float32 file through the swarm:
 * the daemon reads args.in, runs one round (averager.h) and writes the
 * result to args.out, atomically (a temporary file in the same directory,
 * fsync, rename), then replies with the round's report. The paths must be
 * absolute and are opened with the daemon's own permissions; whoever may
 * use the control socket already controls the daemon. Files are read and
 * written on libuv's threadpool, never on the loop. This file interface is
 * what hivemindctl and scripts use. Trainers pass args.data instead, a
 * shared-memory reference (daemon.h): the round averages those floats in
 * place, pinned until it ends, and the reply is the same report; the
 * client library (lib/hivemind.h) runs such a round on a connection of its
 * own when the trainer wants to keep computing meanwhile.
 *
 * "averaging" lists the rounds in progress and the recent ones.
 */

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

typedef struct avg_job {
    uv_work_t work;
    daemon_t *d;
    hm_control_req *req;
    char in[PATH_MAX], out[PATH_MAX];
    char prefix[HM_MM_PREFIX_MAX + 1];
    char bits[HM_MM_BITS_MAX + 1];
    int have_bits;
    hm_avg_opts opts;
    float *data;
    size_t n, held;
    /* Set by the worker: 0 or a negative code, and a sentence. */
    int err;
    char msg[PATH_MAX + 128];
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

static void avg_job_free(avg_job *j)
{
    if (j == NULL)
        return;
    if (j->d != NULL) {
        j->d->avg_jobs--;
        j->d->avg_bytes -= j->held;
    }
    if (j->in_shm)
        hm_shm_put(j->d->shm, j->shm_id);
    else
        free(j->data);
    free(j->rep);
    free(j);
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

static void avg_read_work(uv_work_t *w)
{
    avg_job *j = w->data;
    struct stat st;
    size_t got = 0;
    /* O_NONBLOCK: opening a FIFO must not hang the worker; we refuse it below. */
    int fd = open(j->in, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) {
        j->err = -errno;
        snprintf(j->msg, sizeof(j->msg), "cannot open %s: %s", j->in, strerror(errno));
        return;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        j->err = -EINVAL;
        snprintf(j->msg, sizeof(j->msg), "%s is not a regular file", j->in);
        goto out;
    }
    if (st.st_size <= 0 || (st.st_size % 4) != 0 || (uint64_t)st.st_size > AVERAGE_MAX_BYTES) {
        j->err = -EINVAL;
        snprintf(j->msg, sizeof(j->msg),
                 "%s holds %lld bytes: expected a positive multiple of 4 (float32), at most %zu",
                 j->in, (long long)st.st_size, AVERAGE_MAX_BYTES);
        goto out;
    }
    j->n = (size_t)st.st_size / 4;
    j->data = malloc((size_t)st.st_size);
    if (j->data == NULL) {
        j->err = -ENOMEM;
        snprintf(j->msg, sizeof(j->msg), "out of memory for %lld bytes", (long long)st.st_size);
        goto out;
    }
    while (got < (size_t)st.st_size) {
        ssize_t r = read(fd, (char *)j->data + got, (size_t)st.st_size - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            j->err = r < 0 ? -errno : -EIO;
            snprintf(j->msg, sizeof(j->msg), "reading %s: %s", j->in,
                     r < 0 ? strerror(errno) : "the file shrank while being read");
            goto out;
        }
        got += (size_t)r;
    }
    for (size_t i = 0; i < j->n; i++) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        uint32_t u;
        memcpy(&u, &j->data[i], 4);
        u = __builtin_bswap32(u);
        memcpy(&j->data[i], &u, 4);
#endif
        if (!isfinite(j->data[i])) {
            j->err = -EDOM;
            snprintf(j->msg, sizeof(j->msg), "%s: element %zu is not a finite number", j->in, i);
            goto out;
        }
    }
out:
    close(fd);
}

static void avg_write_work(uv_work_t *w)
{
    avg_job *j = w->data;
    char tmp[PATH_MAX + 16];
    size_t len = j->n * sizeof(float), done = 0;

    if (snprintf(tmp, sizeof(tmp), "%s.XXXXXX", j->out) >= (int)sizeof(tmp)) {
        j->err = -ENAMETOOLONG;
        snprintf(j->msg, sizeof(j->msg), "output path too long");
        return;
    }
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        j->err = -errno;
        snprintf(j->msg, sizeof(j->msg), "cannot create a file next to %s: %s", j->out,
                 strerror(errno));
        return;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (size_t i = 0; i < j->n; i++) {
        uint32_t u;
        memcpy(&u, &j->data[i], 4);
        u = __builtin_bswap32(u);
        memcpy(&j->data[i], &u, 4);
    }
#endif
    while (done < len) {
        ssize_t r = write(fd, (const char *)j->data + done, len - done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            j->err = -errno;
            break;
        }
        done += (size_t)r;
    }
    if (j->err == 0 && (fchmod(fd, 0644) != 0 || fsync(fd) != 0))
        j->err = -errno;
    if (close(fd) != 0 && j->err == 0)
        j->err = -errno;
    if (j->err == 0 && rename(tmp, j->out) != 0)
        j->err = -errno;
    if (j->err != 0) {
        snprintf(j->msg, sizeof(j->msg), "writing %s: %s", j->out, strerror(-j->err));
        unlink(tmp);
    }
}

static void avg_after_write(uv_work_t *w, int status)
{
    avg_job *j = w->data;
    if (status != 0 && j->err == 0) {
        j->err = status;
        snprintf(j->msg, sizeof(j->msg), "writing %s: %s", j->out, uv_strerror(status));
    }
    if (j->err != 0) {
        hm_control_reply_error(j->req, "io", j->msg);
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
    /* The daemon may be closing: the loop still runs the write to its end. */
    j->err = 0;
    int r = uv_queue_work(&j->d->loop, &j->work, avg_write_work, avg_after_write);
    if (r != 0) {
        hm_control_reply_error(j->req, "internal", uv_strerror(r));
        goto fail;
    }
    return;
fail:
    avg_job_free(j);
}

static void avg_start_round(avg_job *j);

static void avg_after_read(uv_work_t *w, int status)
{
    avg_job *j = w->data;
    daemon_t *d = j->d;
    if (status != 0 && j->err == 0) {
        j->err = status;
        snprintf(j->msg, sizeof(j->msg), "reading %s: %s", j->in, uv_strerror(status));
    }
    if (j->err != 0) {
        hm_control_reply_error(j->req, j->err == -ENOMEM ? "internal" : "bad_input", j->msg);
        goto fail;
    }
    if (d->av == NULL) {
        hm_control_reply_error(j->req, "stopping", "the daemon is shutting down");
        goto fail;
    }
    j->held = 2 * j->n * sizeof(float);
    d->avg_bytes += j->held;
    if (d->avg_bytes > AVERAGE_MAX_HELD) {
        hm_control_reply_error(j->req, "busy", "too many tensors are being averaged at once");
        goto fail;
    }
    avg_start_round(j);
    return;
fail:
    avg_job_free(j);
}

/* Starts the round of a job whose data is ready; on failure replies and frees it. */
static void avg_start_round(avg_job *j)
{
    daemon_t *d = j->d;
    int r = hm_averager_round(d->av, &j->opts, j->data, j->n, on_avg_round, j, NULL);
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

static void cmd_average(void *ud, hm_control_req *req, const json_t *args)
{
    daemon_t *d = ud;
    avg_job *j = NULL;
    const json_t *v;

    if (d->av == NULL || d->stopping) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
        return;
    }
    if (d->avg_jobs >= AVERAGE_MAX_JOBS) {
        hm_control_reply_error(req, "busy", "too many average commands are running");
        return;
    }
    j = calloc(1, sizeof(*j));
    if (j == NULL) {
        hm_control_reply_error(req, "internal", "out of memory");
        return;
    }
    j->req = req;
    v = json_object_get(args, "prefix");
    if (!json_is_string(v) || json_string_length(v) == 0 ||
        json_string_length(v) > HM_MM_PREFIX_MAX ||
        strlen(json_string_value(v)) != json_string_length(v)) {
        hm_control_reply_error(req, "bad_args", "args.prefix must be a string of 1 to 128 bytes");
        goto fail;
    }
    hm_strlcpy(j->prefix, json_string_value(v), sizeof(j->prefix));
    const json_t *data_ref = json_object_get(args, "data");
    if (data_ref != NULL && (json_object_get(args, "in") || json_object_get(args, "out"))) {
        hm_control_reply_error(req, "bad_args", "give either args.data or args.in and args.out");
        goto fail;
    }
    if (data_ref == NULL &&
        (hm_daemon_arg_path(req, args, "in", j->in) < 0 ||
         hm_daemon_arg_path(req, args, "out", j->out) < 0))
        goto fail;
    j->opts.prefix = j->prefix;
    j->opts.weight = 1.0;
    v = json_object_get(args, "weight");
    if (v != NULL) {
        if (!json_is_number(v) || !isfinite(json_number_value(v)) || json_number_value(v) < 0) {
            hm_control_reply_error(req, "bad_args", "args.weight must be a finite number >= 0");
            goto fail;
        }
        j->opts.weight = json_number_value(v);
    }
    long long target = hm_daemon_arg_int(req, args, "target_group_size", 16, 1, HM_AVG_MAX_GROUP);
    if (target < 0)
        goto fail;
    long long min =
        hm_daemon_arg_int(req, args, "min_group_size", target > 1 ? 2 : 1, 1, target);
    if (min < 0)
        goto fail;
    j->opts.target_group_size = (unsigned)target;
    j->opts.min_group_size = (unsigned)min;
    double t = hm_daemon_arg_seconds(req, args, "timeout", 30, AVERAGE_MAX_TIMEOUT_S);
    if (t < 0)
        goto fail;
    double rt = hm_daemon_arg_seconds(req, args, "round_timeout", 30, AVERAGE_MAX_TIMEOUT_S);
    if (rt < 0)
        goto fail;
    double mt = hm_daemon_arg_seconds(req, args, "matchmaking_time", HM_MIN(5.0, t), t);
    if (mt < 0)
        goto fail;
    j->opts.matchmaking_timeout_ms = (uint64_t)(t * 1000);
    j->opts.round_timeout_ms = (uint64_t)(rt * 1000);
    j->opts.matchmaking_time_ms = (uint64_t)(mt * 1000);
    if (j->opts.matchmaking_timeout_ms == 0 || j->opts.round_timeout_ms == 0 ||
        j->opts.matchmaking_time_ms == 0) {
        hm_control_reply_error(req, "bad_args", "timeouts must be at least a millisecond");
        goto fail;
    }
    v = json_object_get(args, "compression");
    if (v != NULL) {
        int found = -1;
        for (int c = 0; c < HM_AVG_COMP_COUNT && json_is_string(v); c++)
            if (strcmp(json_string_value(v), comp_names[c]) == 0)
                found = c;
        if (found < 0) {
            hm_control_reply_error(req, "bad_args", "args.compression must be none, fp16 or 8bit");
            goto fail;
        }
        j->opts.compression = found;
    }
    v = json_object_get(args, "group_bits");
    if (v != NULL) {
        const char *b = json_string_value(v);
        if (b == NULL || strlen(b) > HM_MM_BITS_MAX || strspn(b, "01") != strlen(b)) {
            hm_control_reply_error(req, "bad_args", "args.group_bits must be up to 32 of 0 and 1");
            goto fail;
        }
        hm_strlcpy(j->bits, b, sizeof(j->bits));
        j->opts.group_bits = j->bits;
    }
    v = json_object_get(args, "client_mode");
    if (v != NULL && !json_is_boolean(v)) {
        hm_control_reply_error(req, "bad_args", "args.client_mode must be true or false");
        goto fail;
    }
    j->opts.client_mode = json_is_true(v);
    /* The bandwidth this node declares sizes its span (0: the default). */
    v = json_object_get(args, "bandwidth");
    if (v != NULL) {
        if (!json_is_number(v) || !(json_number_value(v) > 0) || json_number_value(v) > 1e12) {
            hm_control_reply_error(req, "bad_args", "args.bandwidth must be bytes per second, "
                                   "above 0 and at most 1e12");
            goto fail;
        }
        j->opts.bandwidth = json_number_value(v);
    }
    /* CenteredClip, for swarms whose members do not trust each other. */
    v = json_object_get(args, "aggregate");
    if (v != NULL) {
        const char *a = json_string_value(v);
        if (a != NULL && strcmp(a, "mean") == 0) {
            j->opts.aggregate = HM_AR_MEAN;
        } else if (a != NULL && strcmp(a, "centered_clip") == 0) {
            const json_t *tau = json_object_get(args, "clip_tau");
            if (!json_is_number(tau) || !(json_number_value(tau) > 0) ||
                !isfinite(json_number_value(tau))) {
                hm_control_reply_error(req, "bad_args", "aggregate centered_clip needs "
                                       "args.clip_tau, a finite radius above 0");
                goto fail;
            }
            j->opts.aggregate = HM_AR_CENTERED_CLIP;
            j->opts.clip_tau = json_number_value(tau);
        } else {
            hm_control_reply_error(req, "bad_args", "args.aggregate must be mean or "
                                   "centered_clip");
            goto fail;
        }
    }
    j->d = d;
    d->avg_jobs++;
    if (data_ref != NULL) {
        if (hm_daemon_shm_ref_any(hm_daemon_shm(d), req, data_ref, "data", AVERAGE_SHM_MAX_ELEMS,
                                  &j->data, &j->shm_id, &j->n) < 0)
            goto fail;
        j->in_shm = 1;
        j->held = j->n * sizeof(float);
        d->avg_bytes += j->held;
        if (d->avg_bytes > AVERAGE_MAX_HELD) {
            hm_control_reply_error(req, "busy", "too many tensors are being averaged at once");
            goto fail;
        }
        avg_start_round(j);
        return;
    }
    j->work.data = j;
    int r = uv_queue_work(&d->loop, &j->work, avg_read_work, avg_after_read);
    if (r != 0) {
        hm_control_reply_error(req, "internal", uv_strerror(r));
        goto fail;
    }
    return;
fail:
    avg_job_free(j);
}

static void cmd_averaging(void *ud, hm_control_req *req, const json_t *args)
{
    daemon_t *d = ud;
    hm_avg_report *hist = NULL;
    hm_avg_active act[HM_MM_MAX_SEARCHES];
    json_t *rounds = NULL, *active = NULL;
    (void)args;

    if (d->av == NULL) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
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

/* ---- shared memory with the trainers (shm.h, daemon.h) ---- */

hm_shm *hm_daemon_shm(struct daemon *d) { return d->stopping ? NULL : d->shm; }

/* args.<what>.<name> as an integer in [lo, hi], or def when absent (-1: required). */
static int ref_uint(hm_control_req *req, const json_t *ref, const char *what, const char *name,
                    int64_t def, int64_t lo, int64_t hi, uint64_t *out)
{
    const json_t *v = json_object_get(ref, name);
    char msg[160];
    if (v == NULL && def >= 0) {
        *out = (uint64_t)def;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        snprintf(msg, sizeof(msg), "args.%s.%s must be an integer from %lld to %lld", what, name,
                 (long long)lo, (long long)hi);
        hm_control_reply_error(req, "bad_args", msg);
        return -EINVAL;
    }
    *out = (uint64_t)json_integer_value(v);
    return 0;
}

/* The one parser of shared-memory references: elems > 0 fixes the count,
 * 0 takes it from the reference (1..max_elems). */
static int shm_ref(hm_shm *shm, hm_control_req *req, const json_t *ref, const char *what,
                   size_t elems, size_t max_elems, float **ptr_out, uint64_t *id_out,
                   size_t *elems_out)
{
    char msg[256];
    uint64_t id, offset, n;
    void *p;
    if (shm == NULL) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
        return -ESHUTDOWN;
    }
    if (!json_is_object(ref)) {
        snprintf(msg, sizeof(msg),
                 "args.%s must be a shared-memory reference {\"shm\": ID, \"offset\": BYTES, "
                 "\"elems\": N}", what);
        hm_control_reply_error(req, "bad_args", msg);
        return -EINVAL;
    }
    if (ref_uint(req, ref, what, "shm", -1, 1, (int64_t)1 << 53, &id) < 0 ||
        ref_uint(req, ref, what, "offset", 0, 0, INT64_MAX, &offset) < 0 ||
        ref_uint(req, ref, what, "elems", elems > 0 ? (int64_t)elems : -1, 1,
                 (int64_t)(elems > 0 ? elems : max_elems), &n) < 0)
        return -EINVAL;
    if (elems > 0 && n != elems) {
        snprintf(msg, sizeof(msg), "args.%s.elems is %llu but the command needs %zu floats",
                 what, (unsigned long long)n, elems);
        hm_control_reply_error(req, "bad_args", msg);
        return -EINVAL;
    }
    int r = hm_shm_get(shm, id, offset, n * sizeof(float), &p);
    if (r == -ENOENT) {
        snprintf(msg, sizeof(msg), "args.%s: no shared-memory segment %llu (never allocated, "
                 "or freed)", what, (unsigned long long)id);
        hm_control_reply_error(req, "bad_args", msg);
        return r;
    }
    if (r != 0) {
        snprintf(msg, sizeof(msg), "args.%s: %llu floats at byte offset %llu do not fit in "
                 "segment %llu (or the offset is not a multiple of 4)", what,
                 (unsigned long long)n, (unsigned long long)offset, (unsigned long long)id);
        hm_control_reply_error(req, "bad_args", msg);
        return r;
    }
    *ptr_out = p;
    *id_out = id;
    if (elems_out != NULL)
        *elems_out = (size_t)n;
    return 0;
}

int hm_daemon_shm_ref(hm_shm *shm, hm_control_req *req, const json_t *ref, const char *what,
                      size_t elems, float **ptr_out, uint64_t *id_out)
{
    if (elems == 0) {
        hm_control_reply_error(req, "bad_args", "a tensor of no elements");
        return -EINVAL;
    }
    return shm_ref(shm, req, ref, what, elems, elems, ptr_out, id_out, NULL);
}

int hm_daemon_shm_ref_any(hm_shm *shm, hm_control_req *req, const json_t *ref, const char *what,
                          size_t max_elems, float **ptr_out, uint64_t *id_out, size_t *elems_out)
{
    return shm_ref(shm, req, ref, what, 0, max_elems, ptr_out, id_out, elems_out);
}

static void cmd_shm_alloc(void *ud, hm_control_req *req, const json_t *args)
{
    daemon_t *d = ud;
    hm_shm *shm = hm_daemon_shm(d);
    const json_t *v = json_object_get(args, "bytes");
    char name[HM_SHM_NAME_MAX], msg[256];
    uint64_t id;
    if (shm == NULL) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
        return;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 1) {
        hm_control_reply_error(req, "bad_args", "args.bytes must be a positive integer");
        return;
    }
    size_t bytes = (size_t)json_integer_value(v);
    int r = hm_shm_alloc(shm, hm_control_req_client(req), bytes, &id, name);
    if (r != 0) {
        size_t segs, total;
        hm_shm_stats(shm, &segs, &total);
        if (r == -ENOBUFS)
            snprintf(msg, sizeof(msg), "cannot allocate %zu bytes of shared memory: over the "
                     "daemon's bounds (%zu segments of %zu bytes are in use)", bytes, segs, total);
        else
            snprintf(msg, sizeof(msg), "cannot allocate %zu bytes of shared memory: %s", bytes,
                     strerror(-r));
        hm_control_reply_error(req, r == -ENOBUFS ? "limit" : r == -ENOSPC ? "no_space"
                                                                        : "internal", msg);
        return;
    }
    hm_daemon_reply(req, json_pack("{s:I, s:s, s:I}", "shm", (json_int_t)id, "name", name, "bytes",
                                 (json_int_t)bytes));
}

static void cmd_shm_free(void *ud, hm_control_req *req, const json_t *args)
{
    daemon_t *d = ud;
    hm_shm *shm = hm_daemon_shm(d);
    const json_t *v = json_object_get(args, "shm");
    char msg[160];
    if (shm == NULL) {
        hm_control_reply_error(req, "stopping", "the daemon is shutting down");
        return;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 1) {
        hm_control_reply_error(req, "bad_args", "args.shm must be a segment id");
        return;
    }
    uint64_t id = (uint64_t)json_integer_value(v);
    int r = hm_shm_release(shm, hm_control_req_client(req), id);
    if (r == -ENOENT) {
        snprintf(msg, sizeof(msg), "no shared-memory segment %llu (never allocated, or freed)",
                 (unsigned long long)id);
        hm_control_reply_error(req, "not_found", msg);
        return;
    }
    if (r == -EPERM) {
        snprintf(msg, sizeof(msg), "segment %llu belongs to another connection",
                 (unsigned long long)id);
        hm_control_reply_error(req, "not_owner", msg);
        return;
    }
    hm_daemon_reply(req, json_object());
}

/* A control connection closed: its segments go (pinned ones at their last put). */
static void on_conn_closed(void *ud, uint64_t conn_id)
{
    daemon_t *d = ud;
    if (d->shm != NULL)
        hm_shm_release_owner(d->shm, conn_id);
}

/* A connection that holds segments is a trainer between rounds: closing it
 * for idleness would release its buffers, so it never idles out. */
static int conn_holds_shm(void *ud, uint64_t conn_id)
{
    daemon_t *d = ud;
    return d->shm != NULL && hm_shm_owned(d->shm, conn_id) > 0;
}

static void cmd_shutdown(void *ud, hm_control_req *req, const json_t *args)
{
    daemon_t *d = ud;
    (void)args;
    /* The reply is queued first; closing the server lets it be written. */
    hm_daemon_reply(req, json_pack("{s:b}", "stopping", 1));
    begin_shutdown(d, "hivemindctl shutdown");
}

/* ---- start ---- */

static int start(daemon_t *d, char *err, size_t errlen)
{
    const char *peers[HM_CONFIG_MAX_PEERS];
    int r;

    if (hm_crypto_init() != 0) {
        snprintf(err, errlen, "cannot initialise libsodium");
        return -EIO;
    }
    if (d->cfg.swarm_key_file[0] != '\0') {
        r = hm_swarm_key_load(d->cfg.swarm_key_file, d->swarm_key, err, errlen);
        if (r != 0)
            return r;
        d->have_swarm_key = 1;
    }
    r = hm_config_make_dir(d->cfg.state_dir, 0700, err, errlen);
    if (r != 0)
        return r;
    /* The control socket's directory is made when missing; one that exists
     * (such as systemd's RuntimeDirectory) is left as it is. */
    char sockdir[HM_CONFIG_SOCKET_PATH_LEN];
    hm_strlcpy(sockdir, d->cfg.control_socket, sizeof(sockdir));
    char *slash = strrchr(sockdir, '/');
    if (slash != NULL && slash != sockdir) {
        *slash = '\0';
        /* With a group, others may pass through the directory (0711) so
         * that the group's members reach the socket, which itself is 0660. */
        r = hm_config_make_dir(sockdir, d->cfg.control_socket_group[0] ? 0711 : 0700, err,
                               errlen);
        if (r != 0)
            return r;
    }

    r = uv_loop_init(&d->loop);
    if (r != 0) {
        snprintf(err, errlen, "cannot create the event loop: %s", uv_strerror(r));
        return r;
    }
    d->loop_open = 1;

    for (size_t i = 0; i < d->cfg.n_initial_peers; i++)
        peers[i] = d->cfg.initial_peers[i];
    hm_node_options no;
    memset(&no, 0, sizeof(no));
    no.listen = d->cfg.listen;
    no.initial_peers = peers;
    no.n_initial_peers = d->cfg.n_initial_peers;
    no.state_dir = d->cfg.state_dir;
    no.swarm = d->cfg.swarm;
    no.swarm_key = d->have_swarm_key ? d->swarm_key : NULL;
    no.client_mode = d->cfg.client_mode;
    no.ping_interval_ms = (uint64_t)d->cfg.ping_interval_s * 1000u;
    no.transport.max_connections = d->cfg.max_connections;
    r = hm_node_new(&d->loop, &no, &d->node, err, errlen);
    if (r != 0)
        return r;
    d->parts_open++;
    r = hm_averager_new(d->node, &d->av);
    if (r != 0) {
        snprintf(err, errlen, "cannot start the averager: %s", hm_strerror(r));
        return r;
    }
    d->parts_open++;

    r = hm_shm_new(NULL, &d->shm);
    if (r != 0) {
        snprintf(err, errlen, "cannot set up shared memory: %s", hm_strerror(r));
        return r;
    }

    hm_control_config cc = {
        .path = d->cfg.control_socket,
        .group = d->cfg.control_socket_group[0] ? d->cfg.control_socket_group : NULL,
        .max_clients = d->cfg.control_max_clients,
        .idle_timeout_ms = d->cfg.control_idle_timeout_s
                               ? (uint64_t)d->cfg.control_idle_timeout_s * 1000u
                               : UINT64_MAX,
    };
    r = hm_control_new(&d->loop, &cc, &d->ctl, err, errlen);
    if (r != 0)
        return r;
    d->parts_open++;
    hm_control_register(d->ctl, "info", cmd_info, d);
    hm_control_register(d->ctl, "peers", cmd_peers, d);
    hm_control_register(d->ctl, "metrics", cmd_metrics, d);
    hm_control_register(d->ctl, "shutdown", cmd_shutdown, d);
    hm_control_register(d->ctl, "dht.get", cmd_dht_get, d);
    hm_control_register(d->ctl, "dht.put", cmd_dht_put, d);
    hm_control_register(d->ctl, "dht.info", cmd_dht_info, d);
    hm_control_register(d->ctl, "average", cmd_average, d);
    hm_control_register(d->ctl, "averaging", cmd_averaging, d);
    hm_control_register(d->ctl, "shm.alloc", cmd_shm_alloc, d);
    hm_control_register(d->ctl, "shm.free", cmd_shm_free, d);
    hm_control_set_close_cb(d->ctl, on_conn_closed, d);
    hm_control_set_idle_check(d->ctl, conn_holds_shm, d);
    hm_dmoe_config mc;
    moe_config(&d->cfg, &mc);
    r = hm_dmoe_new(d, d->node, d->ctl, &mc, &d->moe, err, errlen);
    if (r != 0)
        return r;
    d->parts_open++;
    r = hm_dstate_new(d, d->node, d->ctl, &d->state, err, errlen);
    if (r != 0)
        return r;
    d->parts_open++;

    uv_signal_init(&d->loop, &d->sig_term);
    uv_signal_init(&d->loop, &d->sig_int);
    uv_signal_init(&d->loop, &d->sig_hup);
    d->sig_term.data = d->sig_int.data = d->sig_hup.data = d;
    d->signals_open = 1;
    uv_signal_start(&d->sig_term, on_signal, SIGTERM);
    uv_signal_start(&d->sig_int, on_signal, SIGINT);
    uv_signal_start(&d->sig_hup, on_signal, SIGHUP);
    return 0;
}

int main(int argc, char **argv)
{
    daemon_t *d = NULL;
    char err[1024];
    int code = HM_EXIT_FAILURE;

    /* A control client that leaves while its reply is written must not
     * kill the daemon; the write fails with EPIPE instead. */
    signal(SIGPIPE, SIG_IGN);

    d = calloc(1, sizeof(*d));
    if (d == NULL) {
        fprintf(stderr, "hivemindd: out of memory\n");
        return HM_EXIT_FAILURE;
    }
    if (hm_config_parse_args(argc, argv, &d->args, err, sizeof(err)) != 0) {
        fprintf(stderr, "hivemindd: %s\nTry 'hivemindd --help'.\n", err);
        code = HM_EXIT_USAGE;
        goto out;
    }
    if (d->args.help) {
        hm_config_usage(stdout, "hivemindd");
        code = HM_EXIT_OK;
        goto out;
    }
    if (d->args.version) {
        printf("hivemindd %s\n", PACKAGE_VERSION);
        code = HM_EXIT_OK;
        goto out;
    }
    if (hm_config_build(&d->cfg, &d->args, err, sizeof(err)) != 0) {
        fprintf(stderr, "hivemindd: %s\n", err);
        code = HM_EXIT_CONFIG;
        goto out;
    }
    /* Expert patterns and settings are checked here, so that a bad one is a
     * configuration error (also for -t) rather than a failure to start. */
    hm_dmoe_config mc;
    moe_config(&d->cfg, &mc);
    if (hm_dmoe_check_config(&mc, err, sizeof(err)) != 0) {
        fprintf(stderr, "hivemindd: %s\n", err);
        code = HM_EXIT_CONFIG;
        goto out;
    }
    if (d->args.test_config) {
        char *text = hm_config_format(&d->cfg);
        if (text == NULL) {
            fprintf(stderr, "hivemindd: out of memory\n");
            goto out;
        }
        fputs(text, stdout);
        free(text);
        fprintf(stderr, "hivemindd: configuration ok\n");
        code = fflush(stdout) == 0 ? HM_EXIT_OK : HM_EXIT_FAILURE;
        goto out;
    }
    hm_log_set_level(d->cfg.log_level);

    int r = start(d, err, sizeof(err));
    if (r != 0) {
        hm_error(MOD, "%s", err);
        fprintf(stderr, "hivemindd: %s\n", err);
        begin_shutdown(d, "start failed");
        code = HM_EXIT_FAILURE;
    } else {
        char addr[HM_PEER_ID_LEN + HM_ADDRSTRLEN + 2];
        if (hm_node_address(d->node, addr, sizeof(addr)) != 0) {
            hm_error(MOD, "cannot tell the node's own address");
            begin_shutdown(d, "start failed");
            code = HM_EXIT_FAILURE;
        } else {
            printf("%s\n", addr);
            fflush(stdout);
            hm_info(MOD, "hivemindd %s listening on %s, control socket %s", PACKAGE_VERSION, addr,
                    d->cfg.control_socket);
            char ready[64];
            snprintf(ready, sizeof(ready), "READY=1\nMAINPID=%ld", (long)getpid());
            sd_notify_msg(ready);
            code = HM_EXIT_OK;
        }
    }
    if (d->loop_open) {
        uv_run(&d->loop, UV_RUN_DEFAULT);
        if (d->parts_open != 0)
            hm_error(MOD, "the loop ended with parts still open");
        int cr = uv_loop_close(&d->loop);
        if (cr != 0)
            hm_warn(MOD, "event loop closed with handles left: %s", uv_strerror(cr));
    }
    if (code == HM_EXIT_OK)
        hm_info(MOD, "stopped");
out:
    if (d != NULL) {
        /* After the loop: rounds and connections that pinned or owned
         * segments are all over by now. */
        hm_shm_free(d->shm);
        sodium_memzero(d->swarm_key, sizeof(d->swarm_key));
        free(d);
    }
    return code;
}

/*
 * cmd_status: the whole swarm as one snapshot, for the HTTP listener's
 * /api/status and swarm page (http.h) and for `hivemindctl top` (the
 * "status" control command, docs/control-protocol.md).
 *
 * A snapshot is assembled from the daemon's own control commands, run
 * locally (hm_control_call): info, peers, averaging, dht.info,
 * experts.list (per grid: StatusGrids, else the grids this node hosts in),
 * progress (per run: StatusRuns, else the runs the attached trainers
 * report) and a dht.get of the swarm's summary key. So the snapshot says
 * exactly what the commands say, and no module is read behind its back.
 *
 * The summary key, HM_STATUS_KEY, is how any node shows everyone: with
 * StatusPublish (the default) every node stores under it, every 15 s, a
 * signed owned record (subkey "[owner:PEERID]", so nobody can write
 * another node's entry) holding its address, version, uptime, peer count,
 * averaging results and its hosted experts with their requests and
 * latency, at most HM_STATUS_VALUE_MAX bytes of JSON. A reader trusts
 * nothing in it beyond its owner: each entry is parsed within that bound,
 * only known fields of the right type are kept, strings are cut to their
 * limits, and at most HM_STATUS_MAX_NODES entries are shown.
 *
 * The group also keeps, with a timer every 2 s, what no command holds: the
 * averaging rounds counted by result with a histogram of their duration
 * (from the round numbers of "averaging"'s recent list, so rounds are
 * counted whether or not anyone watches), and a history of 180 points
 * (six minutes) of rounds, peers and samples per second for the page's
 * plots. Its metrics (hm_cmd_status_metrics) add the process_* family,
 * connections by state and per-expert requests and latency to /metrics.
 *
 * Loop thread only. It owns its timer, the history and the builds in
 * flight; a build outlives nothing: the group closes once the last has
 * answered (every command answers, "stopping" at worst).
 */
#include "config.h"

#include "src/daemon/cmd_status.h"
#include "src/daemon/status_rec.h"
#include "src/daemon/cmd_experts.h"
#include "src/base/crypto.h"
#include "src/base/util.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#define MOD "status"
#define TICK_MS 2000
#define PUBLISH_MS 15000
#define PUBLISH_TTL_S 45
#define HISTORY 180
#define MAX_GRIDS 8
#define MAX_RUNS 8
#define MAX_EXPERTS_SHOWN 4096

static const double dur_buckets[] = {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
#define N_BUCKETS (sizeof(dur_buckets) / sizeof(dur_buckets[0]))

typedef struct point {
    double t;
    uint64_t ok, failed;
    uint64_t swarm_ok, swarm_failed; /* over every node's summary */
    unsigned peers;
    double sps;
} point;

struct hm_cmd_status {
    hm_daemon *d;
    hm_control *ctl;
    hm_daemon_life life;
    uv_timer_t timer;
    int timer_open;
    int tick_busy, put_busy;
    uint64_t last_publish_ms;
    long long last_round; /* the newest finished round counted; -1 none */
    uint64_t rounds_ok, rounds_failed;
    uint64_t dur_count[N_BUCKETS + 1]; /* the last: above every bound */
    double dur_sum;
    point ring[HISTORY];
    size_t ring_n, ring_pos;
    double last_sps; /* samples per second over the runs, from the last build */
    uint64_t last_swarm_ok, last_swarm_failed; /* rounds over the nodes, likewise */
    char grids[MAX_GRIDS][64];
    size_t n_grids;
    char runs[MAX_RUNS][129];
    size_t n_runs;
    char marker[HM_PEER_ID_LEN + 16];
};

/* ---- one local call of a build ---- */

typedef struct build build;
typedef struct part {
    build *b;
    char name[160]; /* where the result goes: "info", "experts.ffn", "progress.RUN" */
} part;

struct build {
    hm_cmd_status *s;
    unsigned pending;
    int started;
    json_t *parts;  /* name -> result */
    json_t *errors; /* name -> message */
    hm_status_cb cb;
    void *ud;
    hm_control_req *req; /* the "status" command's, or NULL */
};

static void build_finish(build *b);

static void on_part(void *ud, int ok, const json_t *result, const char *code, const char *message)
{
    part *p = ud;
    build *b = p->b;
    if (ok && result != NULL)
        json_object_set(b->parts, p->name, (json_t *)result);
    else
        json_object_set_new(b->errors, p->name,
                            json_sprintf("%s: %s", code ? code : "error", message ? message : ""));
    free(p);
    if (--b->pending == 0 && b->started)
        build_finish(b);
}

/* Starts one local call; a call that cannot start is an error of its part. */
static void call(build *b, const char *name, const char *cmd, json_t *args)
{
    part *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        json_object_set_new(b->errors, name, json_string("out of memory"));
        json_decref(args);
        return;
    }
    p->b = b;
    hm_strlcpy(p->name, name, sizeof(p->name));
    b->pending++;
    int r = hm_control_call(b->s->ctl, cmd, args, on_part, p);
    json_decref(args);
    if (r != 0) {
        b->pending--;
        json_object_set_new(b->errors, name, json_sprintf("%s", hm_strerror(r)));
        free(p);
    }
}

/* ---- the summary records ---- */

/* The summary this node publishes; at most HM_STATUS_VALUE_MAX bytes. */
static char *own_summary(hm_cmd_status *s)
{
    hm_daemon *d = s->d;
    char addr[HM_PEER_ID_LEN + HM_ADDRSTRLEN + 2] = "";
    if (hm_node_address(d->node, addr, sizeof(addr)) != 0)
        addr[0] = '\0';
    const char *at = strchr(addr, '@');
    json_t *hosted = hm_cmd_experts_hosted(d->experts);
    json_t *x = json_array();
    json_t *v = json_pack("{s:i, s:f, s:s, s:s, s:I, s:I, s:I, s:I, s:b, s:I}", "v", 1, "t",
                          round((double)hm_wall_us() / 1e5) / 10, "addr",
                          at ? at + 1 : addr, "ver", PACKAGE_VERSION, "up",
                          (json_int_t)(hm_node_uptime_ms(d->node) / 1000), "peers",
                          (json_int_t)hm_node_peers(d->node, NULL, 0), "ok",
                          (json_int_t)s->rounds_ok, "fail", (json_int_t)s->rounds_failed, "cm",
                          d->cfg->client_mode, "nx", (json_int_t)json_array_size(hosted));
    char *text = NULL;
    if (v == NULL || x == NULL || hosted == NULL)
        goto out;
    text = json_dumps(v, JSON_COMPACT);
    json_object_set(v, "x", x);
    size_t i;
    json_t *e;
    /* Experts go in while the record stays in bounds; the rest are counted in nx. */
    json_array_foreach(hosted, i, e)
    {
        json_int_t req = json_integer_value(json_object_get(e, "forward_requests")) +
                         json_integer_value(json_object_get(e, "backward_requests"));
        json_array_append_new(
            x, json_pack("[s, I, f, f]", json_string_value(json_object_get(e, "uid")), req,
                         round(json_real_value(json_object_get(e, "latency_p50_ms")) * 100) / 100,
                         round(json_real_value(json_object_get(e, "latency_p99_ms")) * 100) / 100));
        char *t = json_dumps(v, JSON_COMPACT);
        if (t == NULL || strlen(t) > HM_STATUS_VALUE_MAX) {
            free(t);
            break;
        }
        free(text);
        text = t;
    }
out:
    json_decref(hosted);
    json_decref(x);
    json_decref(v);
    return text;
}

static void on_put(void *ud, int ok, const json_t *result, const char *code, const char *message)
{
    hm_cmd_status *s = ud;
    (void)result;
    s->put_busy = 0;
    if (!ok)
        hm_debug(MOD, "summary record not stored: %s: %s", code, message);
    s->life.jobs--;
    hm_daemon_life_settle(&s->life, s);
}

static void publish(hm_cmd_status *s)
{
    char *text = own_summary(s);
    if (text == NULL)
        return;
    json_t *args = json_pack("{s:s, s:s, s:s, s:i}", "key", HM_STATUS_KEY, "subkey", s->marker,
                             "value", text, "ttl", PUBLISH_TTL_S);
    free(text);
    if (args == NULL)
        return;
    s->put_busy = 1;
    s->life.jobs++;
    if (hm_control_call(s->ctl, "dht.put", args, on_put, s) != 0) {
        s->put_busy = 0;
        s->life.jobs--;
    }
    json_decref(args);
}

/* ---- the rounds and the history ---- */

static void count_rounds(hm_cmd_status *s, const json_t *averaging)
{
    const json_t *rounds = json_object_get(averaging, "rounds");
    long long newest = s->last_round;
    size_t i;
    const json_t *r;
    /* Newest first: count those above the last one counted. */
    json_array_foreach(rounds, i, r)
    {
        long long n = (long long)json_integer_value(json_object_get(r, "round"));
        if (n <= s->last_round)
            break;
        if (n > newest)
            newest = n;
        if (json_is_true(json_object_get(r, "ok")))
            s->rounds_ok++;
        else
            s->rounds_failed++;
        double dur = json_number_value(json_object_get(r, "duration_s"));
        if (!isfinite(dur) || dur < 0)
            dur = 0;
        size_t b = 0;
        while (b < N_BUCKETS && dur > dur_buckets[b])
            b++;
        s->dur_count[b]++;
        s->dur_sum += dur;
    }
    s->last_round = newest;
}

static void on_tick_averaging(void *ud, int ok, const json_t *result, const char *code,
                              const char *message)
{
    hm_cmd_status *s = ud;
    (void)code;
    (void)message;
    s->tick_busy = 0;
    if (ok && !s->life.closing && s->d->node != NULL) {
        count_rounds(s, result);
        point *p = &s->ring[s->ring_pos];
        p->t = (double)hm_wall_us() / 1e6;
        p->ok = s->rounds_ok;
        p->failed = s->rounds_failed;
        p->peers = (unsigned)hm_node_peers(s->d->node, NULL, 0);
        p->sps = s->last_sps;
        p->swarm_ok = HM_MAX(s->last_swarm_ok, s->rounds_ok);
        p->swarm_failed = HM_MAX(s->last_swarm_failed, s->rounds_failed);
        s->ring_pos = (s->ring_pos + 1) % HISTORY;
        if (s->ring_n < HISTORY)
            s->ring_n++;
        uint64_t now = hm_now_ms();
        if (s->d->cfg->status_publish && !s->put_busy &&
            (s->last_publish_ms == 0 || now - s->last_publish_ms >= PUBLISH_MS)) {
            s->last_publish_ms = now;
            publish(s);
        }
    }
    s->life.jobs--;
    hm_daemon_life_settle(&s->life, s);
}

static void on_tick(uv_timer_t *t)
{
    hm_cmd_status *s = t->data;
    if (s->tick_busy || s->life.closing || s->d->node == NULL)
        return;
    s->tick_busy = 1;
    s->life.jobs++;
    if (hm_control_call(s->ctl, "averaging", NULL, on_tick_averaging, s) != 0) {
        s->tick_busy = 0;
        s->life.jobs--;
    }
}

static json_t *history_json(const hm_cmd_status *s)
{
    json_t *a = json_array();
    for (size_t i = 0; a != NULL && i < s->ring_n; i++) {
        const point *p = &s->ring[(s->ring_pos + HISTORY - s->ring_n + i) % HISTORY];
        json_array_append_new(
            a, json_pack("{s:f, s:I, s:I, s:I, s:I, s:I, s:f}", "t", p->t, "rounds_ok",
                         (json_int_t)p->ok, "rounds_failed", (json_int_t)p->failed,
                         "swarm_rounds_ok", (json_int_t)p->swarm_ok, "swarm_rounds_failed",
                         (json_int_t)p->swarm_failed, "peers", (json_int_t)p->peers,
                         "samples_per_second", p->sps));
    }
    return a;
}

/* ---- assembling the snapshot ---- */

static json_t *get(build *b, const char *name)
{
    return json_object_get(b->parts, name);
}

static void build_finish(build *b)
{
    hm_cmd_status *s = b->s;
    double now = (double)hm_wall_us() / 1e6;
    json_t *st = json_object();
    json_t *info = get(b, "info");
    json_t *nodes = json_array();
    json_t *hosted = NULL, *swarm = json_array(), *progress = json_array();
    const char *self = json_string_value(json_object_get(info, "peer_id"));

    /* Every grid's walk gives the same hosted list; the swarm lists merge. */
    const char *name;
    json_t *v;
    json_object_foreach(b->parts, name, v)
    {
        if (strncmp(name, "experts.", 8) == 0) {
            if (hosted == NULL)
                hosted = json_incref(json_object_get(v, "hosted"));
            size_t i;
            json_t *e;
            json_array_foreach(json_object_get(v, "swarm"), i, e)
            {
                if (json_array_size(swarm) < MAX_EXPERTS_SHOWN)
                    json_array_append(swarm, e);
            }
        } else if (strncmp(name, "progress.", 9) == 0) {
            json_array_append(progress, v);
        }
    }
    if (hosted == NULL)
        hosted = hm_cmd_experts_hosted(s->d->experts);
    double sps = 0;
    size_t i;
    json_t *e;
    json_array_foreach(progress, i, e) sps += json_number_value(json_object_get(e, "samples_per_second"));
    s->last_sps = sps;

    /* The nodes: every summary record, this node's own from what it knows now. */
    json_t *recs = json_object_get(get(b, "summary"), "values");
    json_array_foreach(recs, i, e)
    {
        if (json_array_size(nodes) >= HM_STATUS_MAX_NODES)
            break;
        json_t *n = hm_status_node_of_record(e, now);
        if (n == NULL)
            continue;
        if (self != NULL && strcmp(json_string_value(json_object_get(n, "peer_id")), self) == 0) {
            json_decref(n);
            continue;
        }
        json_array_append_new(nodes, n);
    }
    if (self != NULL && s->d->node != NULL) {
        json_t *x = json_array();
        size_t j;
        json_t *h;
        json_array_foreach(hosted, j, h)
        {
            json_array_append_new(
                x, json_pack("{s:O, s:I, s:O, s:O}", "uid", json_object_get(h, "uid"), "requests",
                             json_integer_value(json_object_get(h, "forward_requests")) +
                                 json_integer_value(json_object_get(h, "backward_requests")),
                             "latency_p50_ms", json_object_get(h, "latency_p50_ms"),
                             "latency_p99_ms", json_object_get(h, "latency_p99_ms")));
        }
        const char *addr = json_string_value(json_object_get(info, "address"));
        const char *at = addr ? strchr(addr, '@') : NULL;
        json_array_insert_new(
            nodes, 0,
            json_pack("{s:s, s:s, s:s, s:I, s:I, s:I, s:I, s:b, s:o, s:I, s:f, s:b}", "peer_id",
                      self, "address", at ? at + 1 : "", "version", PACKAGE_VERSION, "uptime_s",
                      (json_int_t)(hm_node_uptime_ms(s->d->node) / 1000), "peers",
                      (json_int_t)hm_node_peers(s->d->node, NULL, 0), "rounds_ok",
                      (json_int_t)s->rounds_ok, "rounds_failed", (json_int_t)s->rounds_failed,
                      "client_mode", s->d->cfg->client_mode, "experts", x, "n_experts",
                      (json_int_t)json_array_size(hosted), "expires_in_s", 0.0, "self", 1));
        json_object_set_new(json_array_get(nodes, 0), "age_s", json_real(0));
    }
    /* Up: this node, or a peer it is connected to or heard from within
     * three ping intervals. A summary outlives its node by its TTL, so the
     * record alone says nothing about being alive. */
    json_t *peers = json_object_get(get(b, "peers"), "peers");
    double stale_s = 3.0 * (double)s->d->cfg->ping_interval_s;
    json_array_foreach(nodes, i, e)
    {
        int up = json_is_true(json_object_get(e, "self"));
        json_t *seen = json_null();
        size_t j;
        json_t *p;
        json_array_foreach(peers, j, p)
        {
            if (strcmp(json_string_value(json_object_get(p, "peer_id")),
                       json_string_value(json_object_get(e, "peer_id"))) != 0)
                continue;
            double ago = json_number_value(json_object_get(p, "last_seen_s"));
            up = up || json_is_true(json_object_get(p, "connected")) || ago < stale_s;
            seen = json_real(ago);
        }
        json_object_set_new(e, "up", json_boolean(up));
        json_object_set_new(e, "last_seen_s", seen);
    }
    /* The swarm's rounds: what every node says it finished. */
    uint64_t sw_ok = 0, sw_failed = 0;
    json_array_foreach(nodes, i, e)
    {
        sw_ok += (uint64_t)json_integer_value(json_object_get(e, "rounds_ok"));
        sw_failed += (uint64_t)json_integer_value(json_object_get(e, "rounds_failed"));
    }
    s->last_swarm_ok = sw_ok;
    s->last_swarm_failed = sw_failed;
    json_t *av = get(b, "averaging");
    json_object_set_new(st, "time", json_real(now));
    json_object_set(st, "node", info ? info : json_null());
    json_object_set_new(st, "peers", json_incref(json_object_get(get(b, "peers"), "peers")));
    json_object_set_new(st, "nodes", nodes);
    json_object_set_new(st, "experts", json_pack("{s:o, s:o}", "hosted", hosted ? hosted : json_array(), "swarm", swarm));
    json_object_set_new(st, "rounds",
                        json_pack("{s:I, s:I, s:O, s:O}", "ok", (json_int_t)s->rounds_ok, "failed",
                                  (json_int_t)s->rounds_failed, "active",
                                  json_object_get(av, "active") ? json_object_get(av, "active")
                                                                : json_array(),
                                  "recent",
                                  json_object_get(av, "rounds") ? json_object_get(av, "rounds")
                                                                : json_array()));
    json_object_set_new(st, "progress", progress);
    json_object_set_new(st, "history", history_json(s));
    json_object_set(st, "dht", get(b, "dht") ? get(b, "dht") : json_null());
    json_object_set(st, "errors", b->errors);
    if (b->req != NULL)
        hm_daemon_reply(b->req, st);
    else {
        b->cb(b->ud, st);
        json_decref(st);
    }
    json_decref(b->parts);
    json_decref(b->errors);
    free(b);
    s->life.jobs--;
    hm_daemon_life_settle(&s->life, s);
}

static int start_build(hm_cmd_status *s, hm_control_req *req, hm_status_cb cb, void *ud)
{
    hm_daemon *d = s->d;
    if (s->life.closing || d->node == NULL)
        return -ESHUTDOWN;
    build *b = calloc(1, sizeof(*b));
    if (b == NULL)
        return -ENOMEM;
    b->s = s;
    b->cb = cb;
    b->ud = ud;
    b->req = req;
    b->parts = json_object();
    b->errors = json_object();
    if (b->parts == NULL || b->errors == NULL) {
        json_decref(b->parts);
        json_decref(b->errors);
        free(b);
        return -ENOMEM;
    }
    s->life.jobs++;
    call(b, "info", "info", NULL);
    call(b, "peers", "peers", NULL);
    call(b, "averaging", "averaging", NULL);
    call(b, "dht", "dht.info", NULL);
    call(b, "summary", "dht.get", json_pack("{s:s}", "key", HM_STATUS_KEY));
    char name[160];
    if (s->n_grids == 0) {
        call(b, "experts.", "experts.list", json_pack("{s:f}", "timeout", 2.0));
    }
    for (size_t i = 0; i < s->n_grids; i++) {
        snprintf(name, sizeof(name), "experts.%s", s->grids[i]);
        call(b, name, "experts.list", json_pack("{s:s, s:f}", "prefix", s->grids[i], "timeout", 2.0));
    }
    const char *runs[MAX_RUNS * 2];
    size_t n_runs = 0;
    for (size_t i = 0; i < s->n_runs; i++)
        runs[n_runs++] = s->runs[i];
    if (s->n_runs == 0)
        n_runs = hm_cmd_progress_runs(d->progress, runs, MAX_RUNS);
    for (size_t i = 0; i < n_runs; i++) {
        snprintf(name, sizeof(name), "progress.%s", runs[i]);
        call(b, name, "progress", json_pack("{s:s}", "run", runs[i]));
    }
    b->started = 1;
    if (b->pending == 0)
        build_finish(b);
    return 0;
}

int hm_cmd_status_build(hm_cmd_status *s, hm_status_cb cb, void *ud)
{
    if (s == NULL || cb == NULL)
        return -EINVAL;
    return start_build(s, NULL, cb, ud);
}

static void cmd_status(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_status *s = ud;
    (void)args;
    if (hm_daemon_life_refuse(&s->life, req))
        return;
    int r = start_build(s, req, NULL, NULL);
    if (r == -ESHUTDOWN)
        hm_daemon_reply_stopping(req);
    else if (r != 0)
        hm_control_reply_error(req, "internal", hm_strerror(r));
}

/* ---- metrics ---- */

/* Label values: backslash, quote and newline escaped (Prometheus text format). */
static void label(hm_strbuf *b, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\' || *v == '"')
            hm_strbuf_printf(b, "\\%c", *v);
        else if (*v == '\n')
            hm_strbuf_printf(b, "\\n");
        else
            hm_strbuf_printf(b, "%c", *v);
    }
}

static void process_metrics(hm_strbuf *b)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        hm_strbuf_printf(b, "# HELP process_cpu_seconds_total User and system CPU time spent.\n"
                            "# TYPE process_cpu_seconds_total counter\n"
                            "process_cpu_seconds_total %.3f\n",
                         (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 +
                             (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6);
    long page = sysconf(_SC_PAGESIZE);
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long vsz, rss;
    if (f != NULL) {
        if (fscanf(f, "%llu %llu", &vsz, &rss) == 2)
            hm_strbuf_printf(b, "# HELP process_resident_memory_bytes Resident memory size.\n"
                                "# TYPE process_resident_memory_bytes gauge\n"
                                "process_resident_memory_bytes %llu\n"
                                "# HELP process_virtual_memory_bytes Virtual memory size.\n"
                                "# TYPE process_virtual_memory_bytes gauge\n"
                                "process_virtual_memory_bytes %llu\n",
                             rss * (unsigned long long)page, vsz * (unsigned long long)page);
        fclose(f);
    }
    DIR *dir = opendir("/proc/self/fd");
    if (dir != NULL) {
        unsigned long n = 0;
        struct dirent *de;
        while ((de = readdir(dir)) != NULL)
            n += de->d_name[0] != '.';
        closedir(dir);
        /* The directory's own descriptor is not one of the daemon's. */
        hm_strbuf_printf(b, "# HELP process_open_fds Open file descriptors.\n"
                            "# TYPE process_open_fds gauge\nprocess_open_fds %lu\n",
                         n > 0 ? n - 1 : 0);
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
        hm_strbuf_printf(b, "# HELP process_max_fds Limit of open file descriptors.\n"
                            "# TYPE process_max_fds gauge\nprocess_max_fds %llu\n",
                         (unsigned long long)rl.rlim_cur);
    /* Start time: /proc/self/stat's field 22 (clock ticks after boot) plus
     * the boot time of /proc/stat. */
    double btime = -1, start_ticks = -1;
    f = fopen("/proc/stat", "r");
    if (f != NULL) {
        char line[256];
        while (fgets(line, sizeof(line), f) != NULL)
            if (strncmp(line, "btime ", 6) == 0)
                btime = strtod(line + 6, NULL);
        fclose(f);
    }
    f = fopen("/proc/self/stat", "r");
    if (f != NULL) {
        char buf[1024];
        size_t n = fread(buf, 1, sizeof(buf) - 1, f);
        buf[n] = '\0';
        fclose(f);
        /* The command name may hold spaces; fields resume after its ')'. */
        char *p = strrchr(buf, ')');
        for (int field = 2; p != NULL && field < 22; field++)
            p = strchr(p + 1, ' ');
        if (p != NULL)
            start_ticks = strtod(p + 1, NULL);
    }
    long hz = sysconf(_SC_CLK_TCK);
    if (btime >= 0 && start_ticks >= 0 && hz > 0)
        hm_strbuf_printf(b, "# HELP process_start_time_seconds Start time of the process since "
                            "the UNIX epoch.\n# TYPE process_start_time_seconds gauge\n"
                            "process_start_time_seconds %.2f\n",
                         btime + start_ticks / (double)hz);
}

void hm_cmd_status_metrics(hm_cmd_status *s, hm_strbuf *b)
{
    process_metrics(b);
    if (s == NULL)
        return;
    hm_strbuf_printf(b, "# HELP hivemindd_averaging_rounds_total Averaging rounds finished, by "
                        "result.\n# TYPE hivemindd_averaging_rounds_total counter\n"
                        "hivemindd_averaging_rounds_total{result=\"ok\"} %llu\n"
                        "hivemindd_averaging_rounds_total{result=\"failed\"} %llu\n",
                     (unsigned long long)s->rounds_ok, (unsigned long long)s->rounds_failed);
    hm_strbuf_printf(b, "# HELP hivemindd_averaging_round_duration_seconds How long finished "
                        "rounds took, matchmaking and all-reduce.\n"
                        "# TYPE hivemindd_averaging_round_duration_seconds histogram\n");
    uint64_t cum = 0;
    for (size_t i = 0; i < N_BUCKETS; i++) {
        cum += s->dur_count[i];
        hm_strbuf_printf(b, "hivemindd_averaging_round_duration_seconds_bucket{le=\"%g\"} %llu\n",
                         dur_buckets[i], (unsigned long long)cum);
    }
    cum += s->dur_count[N_BUCKETS];
    hm_strbuf_printf(b,
                     "hivemindd_averaging_round_duration_seconds_bucket{le=\"+Inf\"} %llu\n"
                     "hivemindd_averaging_round_duration_seconds_sum %.6f\n"
                     "hivemindd_averaging_round_duration_seconds_count %llu\n",
                     (unsigned long long)cum, s->dur_sum, (unsigned long long)cum);
    if (s->d->node != NULL) {
        hm_transport_stats ts;
        hm_transport_get_stats(hm_rpc_transport(hm_node_rpc(s->d->node)), &ts);
        hm_strbuf_printf(b, "# HELP hivemindd_connections_by_state Stream connections by state.\n"
                            "# TYPE hivemindd_connections_by_state gauge\n"
                            "hivemindd_connections_by_state{state=\"handshake\"} %zu\n"
                            "hivemindd_connections_by_state{state=\"open\"} %zu\n"
                            "hivemindd_connections_by_state{state=\"draining\"} %zu\n"
                            "hivemindd_connections_by_state{state=\"closing\"} %zu\n",
                         ts.conns_handshake, ts.conns_open, ts.conns_draining, ts.conns_closing);
    }
    json_t *hosted = hm_cmd_experts_hosted(s->d->experts);
    static const struct {
        const char *name, *type, *help, *field;
        int is_ms;
    } em[] = {
        {"hivemindd_expert_forward_requests_total", "counter", "Forward requests answered, per "
         "hosted expert.", "forward_requests", 0},
        {"hivemindd_expert_backward_requests_total", "counter", "Backward requests answered, per "
         "hosted expert.", "backward_requests", 0},
        {"hivemindd_expert_batches_total", "counter", "Batches run, per hosted expert.",
         "batches", 0},
        {"hivemindd_expert_latency_p50_seconds", "gauge", "Median latency from arrival to "
         "reply, per hosted expert.", "latency_p50_ms", 1},
        {"hivemindd_expert_latency_p99_seconds", "gauge", "99th percentile latency from arrival "
         "to reply, per hosted expert.", "latency_p99_ms", 1},
    };
    for (size_t k = 0; hosted != NULL && k < HM_ARRAY_LEN(em); k++) {
        hm_strbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", em[k].name, em[k].help, em[k].name,
                         em[k].type);
        size_t i;
        json_t *e;
        json_array_foreach(hosted, i, e)
        {
            hm_strbuf_printf(b, "%s{uid=\"", em[k].name);
            label(b, json_string_value(json_object_get(e, "uid")));
            json_t *v = json_object_get(e, em[k].field);
            if (em[k].is_ms)
                hm_strbuf_printf(b, "\"} %.6f\n", json_number_value(v) / 1000.0);
            else
                hm_strbuf_printf(b, "\"} %lld\n", (long long)json_integer_value(v));
        }
    }
    json_decref(hosted);
}

/* ---- lifetime ---- */

static void split_list(const char *list, char (*out)[64], size_t width, size_t max, size_t *n_out)
{
    size_t n = 0;
    const char *p = list;
    while (*p != '\0' && n < max) {
        size_t len = strcspn(p, ",");
        if (len > 0 && len < width) {
            memcpy(out[n], p, len);
            out[n][len] = '\0';
            n++;
        }
        p += len;
        if (*p == ',')
            p++;
    }
    *n_out = n;
}

static void on_timer_closed(uv_handle_t *h)
{
    hm_cmd_status *s = h->data;
    s->life.parts--;
    hm_daemon_life_settle(&s->life, s);
}

void hm_cmd_status_close(hm_cmd_status *s, void (*cb)(void *ud), void *ud)
{
    hm_daemon_life_close(&s->life, cb, ud);
    if (s->timer_open) {
        s->timer_open = 0;
        uv_close((uv_handle_t *)&s->timer, on_timer_closed);
        return;
    }
    hm_daemon_life_settle(&s->life, s);
}

int hm_cmd_status_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen)
{
    hm_cmd_status *s = calloc(1, sizeof(*s));
    int r;
    if (s == NULL) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    s->d = d;
    s->ctl = ctl;
    s->last_round = -1;
    split_list(d->cfg->status_grids, s->grids, sizeof(s->grids[0]), MAX_GRIDS, &s->n_grids);
    /* Runs may be 128 bytes; they are split in place through a wider buffer. */
    {
        const char *p = d->cfg->status_runs;
        while (*p != '\0' && s->n_runs < MAX_RUNS) {
            size_t len = strcspn(p, ",");
            if (len > 0 && len < sizeof(s->runs[0])) {
                memcpy(s->runs[s->n_runs], p, len);
                s->runs[s->n_runs++][len] = '\0';
            }
            p += len;
            if (*p == ',')
                p++;
        }
    }
    snprintf(s->marker, sizeof(s->marker), "[owner:%s]", hm_node_identity(d->node)->peer_id);
    if ((r = hm_control_register(ctl, "status", cmd_status, s)) != 0) {
        snprintf(err, errlen, "cannot register the status command: %s", hm_strerror(r));
        free(s);
        return r;
    }
    uv_timer_init(d->loop, &s->timer);
    s->timer.data = s;
    s->timer_open = 1;
    s->life.parts = 1;
    /* The first tick right away: a node's summary is in the DHT soon after it starts. */
    uv_timer_start(&s->timer, on_tick, 100, TICK_MS);
    d->status = s;
    return 0;
}

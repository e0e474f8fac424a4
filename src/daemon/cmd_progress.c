/*
 * cmd_progress: the progress.report and progress commands of hivemindd
 * (docs/control-protocol.md). It owns the reports of the trainers attached
 * to this daemon (the latest one per control connection and run), the one
 * timer that publishes and refreshes them as signed DHT records
 * (progress.h), and a short cache of what the DHT holds per run, so that a
 * trainer asking for the aggregate every step costs one DHT lookup per
 * PROGRESS_CACHE_MS, not one per step.
 *
 * Publishing: a report goes out at once when its epoch changed (or it is
 * the first), otherwise once it changed and PUBLISH_GAP_MS passed since
 * the last publication, and every refresh_s (default 5 s, well inside
 * HM_PROGRESS_STALE_S, so that a live trainer busy in a long round is never
 * taken for a dead one) while its
 * connection stays open, with the latest values and the time updated. The
 * record lives ttl_s (default 60 s); it stops being refreshed when the
 * connection closes, so it disappears from the swarm's aggregate within
 * ttl_s. At most one DHT put per report is in flight.
 *
 * Reading: the aggregate is over the DHT's records under "RUN.progress"
 * whose subkey names their owner (the DHT checked the signature) and whose
 * value decodes within bounds, with this daemon's own report put in place
 * of its record, so that a node alone still sees itself.
 *
 * Who counts where: identities are free, so the aggregate counts network
 * origins (progress.h), and a record counts only once its owner was seen
 * at an address, which gives its origin: a peer of the node's peer table
 * that answered its datagram ping there (hm_peer_info.verified), else the
 * record's own "addr" once the owner answered a "node.ping" datagram sent
 * there under its key (only who receives at that address and holds the key
 * can). Such proofs are kept PROOF_TTL_MS in a table of PROOFS entries; a
 * failed one is not retried for PROOF_RETRY_MS, at most PROBES_IN_FLIGHT
 * pings are out at once and PROBES_PER_ORIGIN of them to one origin, so a
 * record's address makes a reader send one small datagram per owner a
 * minute at most, and to any one origin at most 4 per PROBE_TIMEOUT_MS.
 */
#include "config.h"

#include "src/daemon/daemon.h"
#include "src/daemon/progress.h"
#include "src/base/origin.h"
#include "src/base/util.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "progress"

#define PUBLISH_GAP_MS 500
#define PROGRESS_CACHE_MS 1000
#define DHT_TIMEOUT_MS 5000
/* Runs whose DHT records are cached at once. */
#define CACHE_RUNS 64
/* Records of one run that are read (the rest of a huge dictionary is not); one
 * more place in the aggregate holds this daemon's own report. */
#define MAX_PEERS (HM_PROGRESS_MAX_READ - 1)
/* Owners proven at an address (see above). */
#define PROOFS 1024
#define PROOF_TTL_MS (10 * 60 * 1000)
#define PROOF_RETRY_MS 60000
#define PROBE_TIMEOUT_MS 3000
#define PROBES_IN_FLIGHT 32
#define PROBES_PER_ORIGIN 4
#define DEFAULT_TTL_S HM_PROGRESS_TTL_MAX
#define DEFAULT_REFRESH_S 5.0

typedef struct report {
    uint64_t id;
    uint64_t conn;
    char run[HM_PROGRESS_RUN_MAX + 1];
    hm_progress_rec cur;
    int published;        /* at least once */
    uint64_t pub_epoch;   /* the epoch last published */
    uint64_t last_pub_ms; /* monotonic */
    int dirty;            /* changed since the last publication */
    int put_busy;
    uint64_t retry_ms;    /* a put that could not start is not retried before this */
    double ttl_s, refresh_s;
} report;

typedef struct waiter {
    hm_control_req *req;
    uint64_t target;
    struct waiter *next;
} waiter;

typedef struct cache_entry {
    uint64_t id;
    char run[HM_PROGRESS_RUN_MAX + 1];
    uint64_t fetched_ms; /* 0: never */
    int fetching;
    hm_progress_peer *peers;
    size_t n;
    waiter *waiters;
} cache_entry;

typedef struct hm_cmd_progress hm_cmd_progress;

/* An owner's proof of address: pending, proven (origin) or failed. */
typedef struct proof {
    uint8_t pk[HM_PK_BYTES];
    hm_origin origin;
    int state; /* PROOF_* */
    uint64_t until_ms; /* monotonic: when a proof or a failure lapses */
    int used;
} proof;
enum { PROOF_PENDING = 1, PROOF_OK, PROOF_FAILED };

/* A DHT operation in flight; it outlives the group if need be (p NULL). */
typedef struct op {
    hm_cmd_progress *p;
    uint64_t target_id; /* a report's or a cache entry's id; 0 for a probe */
    uint8_t pk[HM_PK_BYTES]; /* a probe's owner */
    struct sockaddr_storage addr; /* and the address it is asked at */
    struct op *prev, *next;
} op;

struct hm_cmd_progress {
    hm_daemon *d;
    uv_timer_t timer;
    int closing;
    void (*close_cb)(void *ud);
    void *close_ud;
    report **reports;
    size_t n_reports, max_reports, per_conn;
    cache_entry cache[CACHE_RUNS];
    uint64_t next_id;
    op *ops;
    uint64_t refused_runs, refused_per_conn;
    uint64_t held_back, clamped; /* hm_cmd_progress_limits */
    hm_progress_rules rules;
    int cap_loopback;
    proof *proofs; /* PROOFS */
    size_t probes_in_flight;
    char self_id[HM_PEER_ID_LEN + 1];
    char marker[HM_DHT_OWNER_MARKER_LEN + 1];
};

/* The DHT's clock while the node runs (records are stamped with it). */
static double wall_now(hm_cmd_progress *p)
{
    if (p->d->node == NULL)
        return (double)hm_wall_us() / 1e6;
    return (double)hm_node_dht_now_ms(p->d->node) / 1000.0;
}

static op *op_new(hm_cmd_progress *p, uint64_t target_id)
{
    op *o = calloc(1, sizeof(*o));
    if (o == NULL)
        return NULL;
    o->p = p;
    o->target_id = target_id;
    o->next = p->ops;
    if (p->ops != NULL)
        p->ops->prev = o;
    p->ops = o;
    return o;
}

/* Unlinks and frees o; returns the group it belonged to (NULL once closed). */
static hm_cmd_progress *op_end(op *o)
{
    hm_cmd_progress *p = o->p;
    if (p != NULL) {
        if (o->prev != NULL)
            o->prev->next = o->next;
        else
            p->ops = o->next;
        if (o->next != NULL)
            o->next->prev = o->prev;
    }
    free(o);
    return p;
}

static report *report_by_id(hm_cmd_progress *p, uint64_t id)
{
    for (size_t i = 0; i < p->n_reports; i++)
        if (p->reports[i]->id == id)
            return p->reports[i];
    return NULL;
}

/* ---- publishing ---- */

static void arm(hm_cmd_progress *p);

static void on_put(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    HM_UNUSED(info);
    op *o = ud;
    uint64_t id = o->target_id;
    hm_cmd_progress *p = op_end(o);
    if (p == NULL || p->closing)
        return;
    report *r = report_by_id(p, id);
    if (r == NULL)
        return;
    r->put_busy = 0;
    if (status < 0)
        hm_debug(MOD, "%s: publishing failed: %s", r->run, hm_strerror(status));
    else
        hm_debug(MOD, "%s: epoch %llu, %llu samples published to %u replicas", r->run,
                 (unsigned long long)r->cur.epoch, (unsigned long long)r->cur.samples, stored);
    arm(p);
}

/* 1 when a put started. */
static int publish(hm_cmd_progress *p, report *r, uint64_t now_ms)
{
    uint8_t value[HM_PROGRESS_VALUE_MAX];
    char key[HM_PROGRESS_RUN_MAX + 16];
    size_t len;
    int rc;

    if (r->put_busy || p->d->node == NULL)
        return 0;
    /* Where readers that never met us can prove we are (read each time: it can change). */
    struct sockaddr_storage self;
    r->cur.addr[0] = '\0';
    if (hm_node_announce(p->d->node, &self) == 0 &&
        hm_format_addr((const struct sockaddr *)&self, r->cur.addr, sizeof(r->cur.addr)) < 0)
        r->cur.addr[0] = '\0';
    if (hm_progress_encode(&r->cur, value, sizeof(value), &len) < 0)
        return 0;
    int klen = snprintf(key, sizeof(key), "%s.progress", r->run);
    op *o = op_new(p, r->id);
    if (o == NULL)
        return 0;
    rc = hm_node_dht_put(p->d->node, (const uint8_t *)key, (size_t)klen, (const uint8_t *)p->marker,
                         strlen(p->marker), 1, value, len, r->ttl_s, DHT_TIMEOUT_MS, on_put, o);
    if (rc < 0) {
        op_end(o);
        hm_debug(MOD, "%s: cannot publish: %s", r->run, hm_strerror(rc));
        /* Try again after a gap rather than at once (the DHT may be full of lookups). */
        r->retry_ms = now_ms + PUBLISH_GAP_MS;
        return 0;
    }
    r->put_busy = 1;
    r->published = 1;
    r->pub_epoch = r->cur.epoch;
    r->last_pub_ms = now_ms;
    r->dirty = 0;
    return 1;
}

/* When r wants publishing next (monotonic ms). */
static uint64_t due_ms(const report *r)
{
    uint64_t refresh = r->last_pub_ms + (uint64_t)llround(r->refresh_s * 1000.0), due;
    if (!r->published || r->cur.epoch != r->pub_epoch)
        due = 0;
    else if (r->dirty)
        due = HM_MIN(r->last_pub_ms + PUBLISH_GAP_MS, refresh);
    else
        due = refresh;
    return HM_MAX(due, r->retry_ms);
}

static void on_timer(uv_timer_t *t)
{
    hm_cmd_progress *p = t->data;
    uint64_t now = hm_now_ms();
    double wall = wall_now(p);
    for (size_t i = 0; i < p->n_reports; i++) {
        report *r = p->reports[i];
        if (r->put_busy || due_ms(r) > now)
            continue;
        if (!r->dirty)
            r->cur.time = wall; /* a refresh: the values still hold now */
        publish(p, r, now);
    }
    arm(p);
}

static void arm(hm_cmd_progress *p)
{
    uint64_t next = UINT64_MAX, now = hm_now_ms();
    if (p->closing)
        return;
    for (size_t i = 0; i < p->n_reports; i++)
        if (!p->reports[i]->put_busy)
            next = HM_MIN(next, due_ms(p->reports[i]));
    if (next == UINT64_MAX) {
        uv_timer_stop(&p->timer);
        return;
    }
    uv_timer_start(&p->timer, on_timer, next > now ? next - now : 0, 0);
}

/* ---- progress.report ---- */

static const char *arg_run(hm_control_req *req, const json_t *args)
{
    const json_t *v = json_object_get(args, "run");
    char msg[160];
    if (!json_is_string(v) || json_string_length(v) == 0 ||
        json_string_length(v) > HM_PROGRESS_RUN_MAX ||
        strlen(json_string_value(v)) != json_string_length(v) ||
        strstr(json_string_value(v), "[owner:") != NULL) {
        snprintf(msg, sizeof(msg),
                 "args.run must be a string of 1 to %d bytes without \"[owner:\"",
                 HM_PROGRESS_RUN_MAX);
        hm_control_reply_error(req, "bad_args", msg);
        return NULL;
    }
    return json_string_value(v);
}

static void cmd_report(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_progress *p = ud;
    long long epoch, samples;
    double sps, ttl, refresh;
    int client;
    char msg[256];

    if (p->closing || p->d->node == NULL) {
        hm_daemon_reply_stopping(req);
        return;
    }
    const char *run = arg_run(req, args);
    if (run == NULL)
        return;
    if (hm_daemon_arg_int(req, args, "epoch", -1, 0, (long long)HM_PROGRESS_MAX_EPOCH, &epoch) ||
        hm_daemon_arg_int(req, args, "samples", -1, 0, (long long)HM_PROGRESS_MAX_SAMPLES,
                          &samples) ||
        hm_daemon_arg_real(req, args, "samples_per_second", 0, 0, 0, HM_PROGRESS_MAX_SPS,
                           "a finite number from 0 to 1e7", &sps) ||
        hm_daemon_arg_bool(req, args, "client", 0, &client) ||
        hm_daemon_arg_real(req, args, "ttl", DEFAULT_TTL_S, 1, 0, HM_PROGRESS_TTL_MAX,
                           "seconds from 1 to 60", &ttl) ||
        hm_daemon_arg_real(req, args, "refresh", DEFAULT_REFRESH_S, 0.5, 0, 30,
                           "seconds from 0.5 to 30", &refresh))
        return;
    if (json_object_get(args, "samples_per_second") == NULL) {
        hm_control_reply_error(req, "bad_args", "args.samples_per_second is required");
        return;
    }
    if (refresh >= ttl) {
        hm_control_reply_error(req, "bad_args", "args.refresh must be below args.ttl, so that "
                                                "the record is refreshed before it expires");
        return;
    }
    uint64_t conn = hm_control_req_client(req);
    report *r = NULL;
    size_t mine = 0;
    for (size_t i = 0; i < p->n_reports; i++) {
        report *x = p->reports[i];
        if (strcmp(x->run, run) == 0) {
            if (x->conn != conn) {
                snprintf(msg, sizeof(msg), "run '%s' is already reported by another connection "
                         "to this daemon (the record is the daemon's: one trainer per daemon "
                         "and run)", run);
                hm_control_reply_error(req, "conflict", msg);
                return;
            }
            r = x;
        }
        mine += x->conn == conn;
    }
    if (r == NULL && mine >= p->per_conn) {
        p->refused_per_conn++;
        snprintf(msg, sizeof(msg), "this connection already reports %zu runs "
                 "(ProgressRunsPerConnection)", mine);
        hm_control_reply_error(req, "limit", msg);
        return;
    }
    if (r == NULL && p->n_reports >= p->max_reports) {
        p->refused_runs++;
        snprintf(msg, sizeof(msg), "this daemon already reports %zu runs (ProgressMaxRuns)",
                 p->n_reports);
        hm_control_reply_error(req, "limit", msg);
        return;
    }
    if (r == NULL) {
        r = calloc(1, sizeof(*r));
        if (r == NULL) {
            hm_control_reply_error(req, "internal", "out of memory");
            return;
        }
        r->id = ++p->next_id;
        r->conn = conn;
        hm_strlcpy(r->run, run, sizeof(r->run));
        p->reports[p->n_reports++] = r;
        hm_info(MOD, "reporting progress in run '%s'", run);
    }
    hm_progress_rec nr = {.epoch = (uint64_t)epoch, .samples = (uint64_t)samples, .sps = sps,
                          .time = wall_now(p), .client = client};
    int changed = !r->published || nr.epoch != r->cur.epoch || nr.samples != r->cur.samples ||
                  nr.sps != r->cur.sps || nr.client != r->cur.client || ttl != r->ttl_s ||
                  refresh != r->refresh_s;
    r->cur = nr;
    r->ttl_s = ttl;
    r->refresh_s = refresh;
    r->dirty |= changed;
    int published = 0;
    uint64_t now = hm_now_ms();
    if (now >= r->retry_ms && (!r->published || r->cur.epoch != r->pub_epoch ||
                               (r->dirty && now >= r->last_pub_ms + PUBLISH_GAP_MS)))
        published = publish(p, r, now);
    arm(p);
    hm_daemon_reply(req, json_pack("{s:s, s:b}", "run", run, "published", published));
}

static void on_conn_closed(void *ud, uint64_t conn)
{
    hm_cmd_progress *p = ud;
    size_t k = 0;
    for (size_t i = 0; i < p->n_reports; i++) {
        report *r = p->reports[i];
        if (r->conn == conn) {
            hm_info(MOD, "no longer reporting progress in run '%s' (its connection closed)",
                    r->run);
            free(r);
        } else {
            p->reports[k++] = r;
        }
    }
    p->n_reports = k;
    if (!p->closing)
        arm(p);
}

/* ---- progress ---- */

static json_t *peer_json(const hm_progress_peer *x)
{
    return json_pack("{s:s, s:I, s:I, s:f, s:f, s:b}", "peer", x->peer, "epoch",
                     (json_int_t)x->r.epoch, "samples", (json_int_t)x->r.samples,
                     "samples_per_second", x->r.sps, "time", x->r.time, "client", x->r.client);
}

/* ---- proofs of address ---- */

static proof *proof_find(hm_cmd_progress *p, const uint8_t pk[HM_PK_BYTES])
{
    for (size_t i = 0; i < PROOFS; i++)
        if (p->proofs[i].used && memcmp(p->proofs[i].pk, pk, HM_PK_BYTES) == 0)
            return &p->proofs[i];
    return NULL;
}

static void on_probe(void *ud, int status, const uint8_t *body, size_t len)
{
    HM_UNUSED(body);
    HM_UNUSED(len);
    op *o = ud;
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr = o->addr;
    memcpy(pk, o->pk, HM_PK_BYTES);
    hm_cmd_progress *p = op_end(o);
    if (p == NULL)
        return;
    p->probes_in_flight--;
    proof *f = proof_find(p, pk);
    if (f == NULL || f->state != PROOF_PENDING)
        return;
    /* The rpc layer takes a reply only from the key asked, which had to
     * receive our datagram at addr to answer it. */
    if (status == 0) {
        f->state = PROOF_OK;
        hm_origin_of((const struct sockaddr *)&addr, &f->origin);
        f->until_ms = hm_now_ms() + PROOF_TTL_MS;
    } else {
        f->state = PROOF_FAILED;
        f->until_ms = hm_now_ms() + PROOF_RETRY_MS;
    }
}

/* Asks the owner of a record, at the address it names, to answer a ping. */
static void probe(hm_cmd_progress *p, const uint8_t pk[HM_PK_BYTES], const char *addr_str,
                  uint64_t now)
{
    static const uint8_t empty_map = 0x80;
    struct sockaddr_storage addr;
    hm_origin org;
    size_t same = 0;
    proof *slot = NULL;
    if (p->probes_in_flight >= PROBES_IN_FLIGHT || hm_parse_hostport(addr_str, &addr) != 0 ||
        hm_addr_dialable(&addr) != 0)
        return;
    hm_origin_of((const struct sockaddr *)&addr, &org);
    for (size_t i = 0; i < PROOFS; i++) {
        proof *f = &p->proofs[i];
        if (f->used && f->state == PROOF_PENDING && hm_origin_eq(&f->origin, &org))
            same++;
        /* A free place, else the one that lapses first (never a pending one). */
        if (f->state != PROOF_PENDING &&
            (slot == NULL || !f->used || (slot->used && f->until_ms < slot->until_ms)))
            slot = f;
    }
    if (same >= PROBES_PER_ORIGIN || slot == NULL)
        return;
    op *o = op_new(p, 0);
    if (o == NULL)
        return;
    memcpy(o->pk, pk, HM_PK_BYTES);
    o->addr = addr;
    memset(slot, 0, sizeof(*slot));
    slot->used = 1;
    memcpy(slot->pk, pk, HM_PK_BYTES);
    slot->origin = org; /* the origin asked, for PROBES_PER_ORIGIN */
    slot->state = PROOF_PENDING;
    if (hm_rpc_call(hm_node_rpc(p->d->node), pk, (const struct sockaddr *)&addr, "node.ping",
                    &empty_map, 1, HM_RPC_DGRAM, PROBE_TIMEOUT_MS, on_probe, o, NULL) < 0) {
        op_end(o);
        slot->state = PROOF_FAILED;
        slot->until_ms = now + PROOF_RETRY_MS;
        return;
    }
    p->probes_in_flight++;
}

/*
 * Where x's owner counts (see the top of the file): its verified place in
 * the peer table, else a proof of the address its record names, which is
 * asked for when there is none.
 */
static void attribute(hm_cmd_progress *p, hm_progress_peer *x, uint64_t now)
{
    hm_peer_info pi;
    x->verified = 0;
    if (hm_node_peer_get(p->d->node, x->pk, &pi) == 0 && pi.verified) {
        hm_origin_of((const struct sockaddr *)&pi.addr, &x->origin);
        x->verified = 1;
    }
    if (!x->verified) {
        proof *f = proof_find(p, x->pk);
        if (f != NULL && f->state == PROOF_OK && f->until_ms > now) {
            x->origin = f->origin;
            x->verified = 1;
        } else if (x->r.addr[0] != '\0' && (f == NULL || (f->state != PROOF_PENDING &&
                                                            f->until_ms <= now))) {
            probe(p, x->pk, x->r.addr, now);
        }
    }
    /* Daemons of one machine (tests, demos) count apart unless told otherwise. */
    x->unique = x->verified && !p->cap_loopback && hm_origin_is_loopback(&x->origin);
}

/* Answers one query from the entry's records and this daemon's own report. */
static void answer(hm_cmd_progress *p, cache_entry *e, hm_control_req *req, uint64_t target)
{
    size_t n = 0;
    hm_progress_peer *all = calloc(e->n + 1, sizeof(*all));
    int *used = calloc(e->n + 1, sizeof(*used));
    json_t *list = json_array(), *o = NULL;
    if (all == NULL || used == NULL || list == NULL)
        goto fail;
    const report *mine = NULL;
    for (size_t i = 0; i < p->n_reports; i++)
        if (strcmp(p->reports[i]->run, e->run) == 0)
            mine = p->reports[i];
    uint64_t now = hm_now_ms();
    for (size_t i = 0; i < e->n; i++)
        if (mine == NULL || strcmp(e->peers[i].peer, p->self_id) != 0) {
            all[n] = e->peers[i];
            attribute(p, &all[n++], now);
        }
    if (mine != NULL) {
        hm_progress_peer *x = &all[n++];
        struct sockaddr_storage self;
        hm_strlcpy(x->peer, p->self_id, sizeof(x->peer));
        memcpy(x->pk, hm_node_identity(p->d->node)->pk, HM_PK_BYTES);
        x->r = mine->cur;
        x->verified = 1;
        x->live = 1; /* its connection is open */
        /* At our declared address's origin, so that other daemons of our host
         * count with us; without one, on our own. */
        x->unique = 1;
        if (hm_node_announce(p->d->node, &self) == 0) {
            hm_origin_of((const struct sockaddr *)&self, &x->origin);
            x->unique = !p->cap_loopback && hm_origin_is_loopback(&x->origin);
        }
    }
    hm_progress_agg agg;
    hm_progress_aggregate(all, n, wall_now(p), target, &p->rules, &agg, used);
    p->held_back += agg.held_back;
    p->clamped += agg.clamped;
    for (size_t i = 0; i < n; i++) {
        json_t *x;
        if (!used[i])
            continue;
        if ((x = peer_json(&all[i])) == NULL || json_array_append_new(list, x) != 0)
            goto fail;
    }
    o = json_pack("{s:s, s:I, s:I, s:f, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:o}",
                  "run", e->run, "global_epoch", (json_int_t)agg.global_epoch, "samples",
                  (json_int_t)floor(agg.samples), "samples_per_second", agg.sps, "n_peers",
                  (json_int_t)agg.n_peers, "n_clients", (json_int_t)agg.n_clients, "n_origins",
                  (json_int_t)agg.n_origins, "ignored", (json_int_t)agg.ignored, "unverified",
                  (json_int_t)agg.unverified, "stale", (json_int_t)agg.stale, "held_back",
                  (json_int_t)agg.held_back, "clamped", (json_int_t)agg.clamped, "peers", list);
    list = NULL;
    if (o == NULL)
        goto fail;
    if (target > 0)
        json_object_set_new(o, "target_batch_size", json_integer((json_int_t)target));
    json_object_set_new(o, "eta_s", agg.eta_s >= 0 ? json_real(agg.eta_s) : json_null());
    free(all);
    free(used);
    hm_daemon_reply(req, o);
    return;
fail:
    free(all);
    free(used);
    json_decref(list);
    hm_control_reply_error(req, "internal", "out of memory");
}

static cache_entry *entry_by_id(hm_cmd_progress *p, uint64_t id)
{
    for (size_t i = 0; i < CACHE_RUNS; i++)
        if (p->cache[i].id == id)
            return &p->cache[i];
    return NULL;
}

static void on_get(void *ud, int status, const hm_dht_value *values, size_t n,
                   const hm_dht_lookup_info *info)
{
    HM_UNUSED(info);
    op *o = ud;
    uint64_t id = o->target_id;
    hm_cmd_progress *p = op_end(o);
    if (p == NULL)
        return;
    cache_entry *e = entry_by_id(p, id);
    if (e == NULL)
        return;
    e->fetching = 0;
    e->fetched_ms = hm_now_ms();
    free(e->peers);
    e->peers = NULL;
    e->n = 0;
    if (status < 0)
        hm_debug(MOD, "%s: DHT read failed: %s", e->run, hm_strerror(status));
    if (status == 0 && n > 0)
        e->peers = calloc(HM_MIN(n, (size_t)MAX_PEERS), sizeof(*e->peers));
    for (size_t i = 0; e->peers != NULL && i < n && e->n < MAX_PEERS; i++) {
        const hm_dht_record *rec = &values[i].rec;
        uint8_t pk[HM_PK_BYTES];
        hm_progress_peer *x = &e->peers[e->n];
        /* Only owned subkeys count: the DHT checked their signatures. */
        if (!rec->has_subkey || hm_dht_record_owner(rec, pk) != 1)
            continue;
        if (hm_progress_decode(rec->value, rec->value_len, &x->r) < 0)
            continue;
        hm_peer_id_encode(pk, x->peer);
        memcpy(x->pk, pk, HM_PK_BYTES);
        e->n++;
    }
    waiter *w = e->waiters;
    e->waiters = NULL;
    while (w != NULL) {
        waiter *next = w->next;
        if (p->closing || p->d->node == NULL)
            hm_daemon_reply_stopping(w->req);
        else
            answer(p, e, w->req, w->target);
        free(w);
        w = next;
    }
}

static void cmd_progress(void *ud, hm_control_req *req, const json_t *args)
{
    hm_cmd_progress *p = ud;
    long long target;
    if (p->closing || p->d->node == NULL) {
        hm_daemon_reply_stopping(req);
        return;
    }
    const char *run = arg_run(req, args);
    if (run == NULL)
        return;
    if (hm_daemon_arg_int(req, args, "target_batch_size", 0, 1,
                          (long long)HM_PROGRESS_MAX_EPOCH, &target) != 0)
        return;
    uint64_t now = hm_now_ms();
    cache_entry *e = NULL, *victim = NULL;
    for (size_t i = 0; i < CACHE_RUNS; i++) {
        cache_entry *x = &p->cache[i];
        if (x->id != 0 && strcmp(x->run, run) == 0) {
            e = x;
            break;
        }
        /* An empty slot first, else the least recently fetched idle one. */
        if (!x->fetching && (victim == NULL || (victim->id != 0 &&
                                                (x->id == 0 || x->fetched_ms < victim->fetched_ms))))
            victim = x;
    }
    if (e != NULL && !e->fetching && e->fetched_ms != 0 &&
        now - e->fetched_ms < PROGRESS_CACHE_MS) {
        answer(p, e, req, (uint64_t)target);
        return;
    }
    if (e == NULL) {
        if (victim == NULL) {
            hm_control_reply_error(req, "busy", "too many runs are being read at once");
            return;
        }
        free(victim->peers);
        memset(victim, 0, sizeof(*victim));
        victim->id = ++p->next_id;
        hm_strlcpy(victim->run, run, sizeof(victim->run));
        e = victim;
    }
    waiter *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        hm_control_reply_error(req, "internal", "out of memory");
        return;
    }
    w->req = req;
    w->target = (uint64_t)target;
    w->next = e->waiters;
    e->waiters = w;
    if (e->fetching)
        return;
    char key[HM_PROGRESS_RUN_MAX + 16];
    int klen = snprintf(key, sizeof(key), "%s.progress", run);
    op *o = op_new(p, e->id);
    int rc = o == NULL ? -ENOMEM
                       : hm_node_dht_get(p->d->node, (const uint8_t *)key, (size_t)klen,
                                         DHT_TIMEOUT_MS, on_get, o);
    if (rc < 0) {
        if (o != NULL)
            op_end(o);
        e->waiters = NULL;
        free(w);
        hm_control_reply_error(req, rc == -ENOBUFS ? "busy" : "dht_error", hm_strerror(rc));
        return;
    }
    e->fetching = 1;
}

/* ---- lifetime ---- */

size_t hm_cmd_progress_runs(const hm_cmd_progress *p, const char **runs_out, size_t max)
{
    size_t n = 0;
    for (size_t i = 0; p != NULL && i < p->n_reports; i++) {
        int dup = 0;
        for (size_t j = 0; j < n && !dup; j++)
            dup = strcmp(runs_out[j], p->reports[i]->run) == 0;
        if (!dup && n < max)
            runs_out[n++] = p->reports[i]->run;
    }
    return n;
}

void hm_cmd_progress_limits(const hm_cmd_progress *p, hm_limit_emit_fn emit, void *ud)
{
    emit(ud, "ProgressMaxRuns", p->refused_runs);
    emit(ud, "ProgressRunsPerConnection", p->refused_per_conn);
    /* -- progress origin limits -- */
    emit(ud, "ProgressEpochOrigins", p->held_back);
    emit(ud, "ProgressOriginFactor", p->clamped);
}

int hm_cmd_progress_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen)
{
    int r;
    hm_cmd_progress *p = calloc(1, sizeof(*p));
    if (p != NULL) {
        p->reports = calloc(d->cfg->progress_max_runs, sizeof(*p->reports));
        p->proofs = calloc(PROOFS, sizeof(*p->proofs));
    }
    if (p == NULL || p->reports == NULL || p->proofs == NULL) {
        if (p != NULL) {
            free(p->reports);
            free(p->proofs);
            free(p);
        }
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    p->d = d;
    p->max_reports = d->cfg->progress_max_runs;
    p->per_conn = d->cfg->progress_runs_per_connection;
    p->rules.epoch_origins = d->cfg->progress_epoch_origins;
    p->rules.origin_factor = d->cfg->progress_origin_factor;
    p->rules.majority = d->cfg->progress_epoch_majority; /* -- progress majority -- */
    p->cap_loopback = d->cfg->progress_cap_loopback;
    hm_peer_id_encode(hm_node_identity(d->node)->pk, p->self_id);
    hm_dht_owner_marker(hm_node_identity(d->node)->pk, p->marker);
    uv_timer_init(d->loop, &p->timer);
    p->timer.data = p;
    if ((r = hm_control_register(ctl, "progress.report", cmd_report, p)) != 0 ||
        (r = hm_control_register(ctl, "progress", cmd_progress, p)) != 0 ||
        (r = hm_control_add_close_cb(ctl, on_conn_closed, p)) != 0) {
        snprintf(err, errlen, "cannot register the progress commands: %s", hm_strerror(r));
        /* The daemon does not start; the loop closes the timer's handle. */
        p->closing = 1;
        uv_close((uv_handle_t *)&p->timer, NULL);
        return r;
    }
    d->progress = p;
    return 0;
}

static void on_timer_closed(uv_handle_t *h)
{
    hm_cmd_progress *p = h->data;
    void (*cb)(void *) = p->close_cb;
    void *ud = p->close_ud;
    for (size_t i = 0; i < p->n_reports; i++)
        free(p->reports[i]);
    free(p->reports);
    free(p->proofs);
    for (size_t i = 0; i < CACHE_RUNS; i++)
        free(p->cache[i].peers);
    free(p);
    if (cb != NULL)
        cb(ud);
}

void hm_cmd_progress_close(hm_cmd_progress *p, void (*cb)(void *ud), void *ud)
{
    p->closing = 1;
    p->close_cb = cb;
    p->close_ud = ud;
    /* Operations in flight end in the DHT's own time; they find no group. */
    for (op *o = p->ops; o != NULL; o = o->next)
        o->p = NULL;
    p->ops = NULL;
    for (size_t i = 0; i < CACHE_RUNS; i++) {
        waiter *w = p->cache[i].waiters;
        p->cache[i].waiters = NULL;
        while (w != NULL) {
            waiter *next = w->next;
            hm_daemon_reply_stopping(w->req);
            free(w);
            w = next;
        }
    }
    uv_timer_stop(&p->timer);
    uv_close((uv_handle_t *)&p->timer, on_timer_closed);
}

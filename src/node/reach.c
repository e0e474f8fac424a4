/*
 * reach: the declared address and the dial-back check (see reach.h). One
 * function, reach_set, changes the reachability state and logs the
 * transition; everything runs on the loop thread.
 */
#include "config.h"

#include "src/node/reach.h"

#include <errno.h>
#include <stdarg.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "src/base/util.h"
#include "src/base/wire.h"

#define MOD "reach"

/* Requests and replies are tiny: one map, a short string or two. */
static const hm_wire_limits reach_limits = {.max_size = 256, .max_depth = 2, .max_elements = 16};
/* A dial-back answer can take the prober's handshake timeout (5 s) and a bit. */
#define DIALBACK_TIMEOUT_MS 12000u
/* Our own dial-back requests in flight at once. */
#define OUT_MAX 4u
/* An observation not refreshed for this long no longer counts. */
#define OBS_FRESH_MS 600000u
/* An observer is asked again no sooner than this after an answer. */
#define ASK_AGAIN_MS 30000u
/* Per-origin entries of the asked side (spoofing is impossible: the rpc is authenticated). */
#define SERVE_ORIGINS_MAX 4096u
enum { SV_TAT = 0, SV_INFLIGHT = 1 };

typedef struct observer {
    int used;
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage peer_addr; /* where we reach it */
    hm_origin org;                     /* of peer_addr */
    struct sockaddr_storage observed;  /* where it sees us */
    uint64_t seen_ms;
    uint64_t next_ask_ms;
    int asking;
} observer;

typedef struct out_ctx {
    hm_reach *r;
    uint8_t pk[HM_PK_BYTES];
    hm_origin org;
    uint64_t gen; /* the candidate asked about */
} out_ctx;

typedef struct serve_ctx {
    hm_reach *r;
    hm_rpc_req *req;
    hm_origin org;
} serve_ctx;

struct hm_reach {
    uv_loop_t *loop;
    hm_rpc *rpc;
    hm_reach_config cfg;
    hm_reach_mode_cb mode_cb;
    void *mode_ud;
    uv_timer_t timer;
    int stopped;
    uint64_t started_ms;

    observer obs[HM_REACH_OBSERVERS];

    /* The current candidate; gen changes whenever it does. */
    const char *source;
    int has_cand;
    struct sockaddr_storage cand;
    uint64_t gen;
    int state;
    int dialback_needed;
    char reason[HM_REACH_REASON_LEN];
    hm_origin failed[HM_REACH_FAIL_ORIGINS]; /* origins whose dial-back of cand failed */
    size_t n_failed;
    uint64_t recheck_at_ms;
    unsigned out_inflight;

    /* The asked side. */
    hm_origin_tab serve;
    size_t serving;
    uint64_t refused_rate, refused_max, refused_other;

    uint64_t ok, failed_n, served;
    void (*free_cb)(void *ud);
    void *free_ud;
};

/* ------------------------------------------------------------- parsers */

int hm_reach_parse_request(const uint8_t *body, size_t len, struct sockaddr_storage *addr_out)
{
    hm_wire_msg m;
    int result = hm_wire_decode_open_map(&m, body, len, &reach_limits, NULL, 0);
    if (result < 0)
        return -EPROTO;
    const msgpack_object *a = hm_wire_map_get(&m.root, "addr");
    result = a != NULL && hm_wire_get_addr(a, addr_out) == 0 ? 0 : -EPROTO;
    hm_wire_decode_close(&m);
    return result;
}

int hm_reach_parse_reply(const uint8_t *body, size_t len, int *reached_out, int *error_out)
{
    hm_wire_msg m;
    int64_t e = 0;
    int result = hm_wire_decode_open_map(&m, body, len, &reach_limits, NULL, 0);
    if (result < 0)
        return -EPROTO;
    const msgpack_object *ok = hm_wire_map_get(&m.root, "reached");
    const msgpack_object *err = hm_wire_map_get(&m.root, "error");
    result = -EPROTO;
    if (ok != NULL && hm_wire_get_bool(ok, reached_out) == 0 &&
        (err == NULL || (hm_wire_get_int(err, &e) == 0 && e <= 0 && e > -4096))) {
        *error_out = (int)e;
        result = 0;
    }
    hm_wire_decode_close(&m);
    return result;
}

int hm_reach_parse_ping_reply(const uint8_t *body, size_t len, struct sockaddr_storage *observed_out)
{
    hm_wire_msg m;
    int result = hm_wire_decode_open_map(&m, body, len, &reach_limits, NULL, 0);
    if (result < 0)
        return -EPROTO;
    const msgpack_object *o = hm_wire_map_get(&m.root, "observed");
    result = o != NULL && hm_wire_get_addr(o, observed_out) == 0 ? 0 : -EPROTO;
    hm_wire_decode_close(&m);
    return result;
}

/* ------------------------------------------------------------- helpers */

static int addr_port(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET)
        return ntohs(((const struct sockaddr_in *)ss)->sin_port);
    if (ss->ss_family == AF_INET6)
        return ntohs(((const struct sockaddr_in6 *)ss)->sin6_port);
    return 0;
}

static int addr_unspecified(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET)
        return ((const struct sockaddr_in *)ss)->sin_addr.s_addr == htonl(INADDR_ANY);
    if (ss->ss_family == AF_INET6)
        return IN6_IS_ADDR_UNSPECIFIED(&((const struct sockaddr_in6 *)ss)->sin6_addr);
    return 1;
}

static int addr_loopback(const struct sockaddr_storage *ss)
{
    hm_origin o;
    hm_origin_of((const struct sockaddr *)ss, &o);
    return hm_origin_is_loopback(&o);
}

/* Same IP (an IPv4-mapped IPv6 address read as IPv4), ports ignored. */
static int same_ip(const struct sockaddr *a, const struct sockaddr *b)
{
    struct in_addr a4 = {0}, b4 = {0};
    int a_is4 = 0, b_is4 = 0;
    if (a->sa_family == AF_INET) {
        a4 = ((const struct sockaddr_in *)a)->sin_addr;
        a_is4 = 1;
    } else if (a->sa_family == AF_INET6 &&
               IN6_IS_ADDR_V4MAPPED(&((const struct sockaddr_in6 *)a)->sin6_addr)) {
        memcpy(&a4, &((const struct sockaddr_in6 *)a)->sin6_addr.s6_addr[12], 4);
        a_is4 = 1;
    }
    if (b->sa_family == AF_INET) {
        b4 = ((const struct sockaddr_in *)b)->sin_addr;
        b_is4 = 1;
    } else if (b->sa_family == AF_INET6 &&
               IN6_IS_ADDR_V4MAPPED(&((const struct sockaddr_in6 *)b)->sin6_addr)) {
        memcpy(&b4, &((const struct sockaddr_in6 *)b)->sin6_addr.s6_addr[12], 4);
        b_is4 = 1;
    }
    if (a_is4 || b_is4)
        return a_is4 && b_is4 && a4.s_addr == b4.s_addr;
    if (a->sa_family != AF_INET6 || b->sa_family != AF_INET6)
        return 0;
    return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                  &((const struct sockaddr_in6 *)b)->sin6_addr, 16) == 0;
}

static const char *fmt(const struct sockaddr_storage *ss, char *buf, size_t len)
{
    if (hm_format_addr((const struct sockaddr *)ss, buf, len) != 0)
        hm_strlcpy(buf, "?", len);
    return buf;
}

static const char *state_name(int s)
{
    return s == HM_REACH_YES ? "reachable" : s == HM_REACH_NO ? "unreachable" : "unknown";
}

/* The one place the state changes. */
static void reach_set(hm_reach *r, int state, const char *fmt_, ...)
    __attribute__((format(printf, 3, 4)));
static void reach_set(hm_reach *r, int state, const char *fmt_, ...)
{
    char why[HM_REACH_REASON_LEN];
    va_list ap;
    va_start(ap, fmt_);
    vsnprintf(why, sizeof(why), fmt_, ap);
    va_end(ap);
    int was = r->state;
    if (was == state && strcmp(why, r->reason) == 0)
        return;
    hm_strlcpy(r->reason, why, sizeof(r->reason));
    r->state = state;
    if (was == state) {
        hm_debug(MOD, "%s: %s", state_name(state), why);
        return;
    }
    if (state == HM_REACH_NO)
        hm_warn(MOD, "%s -> %s: %s; switching to client mode", state_name(was), state_name(state),
                why);
    else
        hm_info(MOD, "%s -> %s: %s", state_name(was), state_name(state), why);
    if (r->mode_cb != NULL && (state == HM_REACH_NO) != (was == HM_REACH_NO))
        r->mode_cb(r->mode_ud, state == HM_REACH_NO, why);
}

static int off_loopback_peers(const hm_reach *r, uint64_t now)
{
    for (size_t i = 0; i < HM_REACH_OBSERVERS; i++)
        if (r->obs[i].used && now - r->obs[i].seen_ms < OBS_FRESH_MS &&
            !hm_origin_is_loopback(&r->obs[i].org))
            return 1;
    return 0;
}

/* The observed address most origins agree on, if at least HM_REACH_MIN_ORIGINS do. */
static int best_observed(const hm_reach *r, uint64_t now, struct sockaddr_storage *out)
{
    size_t best = 0;
    for (size_t i = 0; i < HM_REACH_OBSERVERS; i++) {
        const observer *a = &r->obs[i];
        if (!a->used || now - a->seen_ms >= OBS_FRESH_MS)
            continue;
        /* Distinct origins among the fresh observers that saw a->observed. */
        hm_origin seen[HM_REACH_OBSERVERS];
        size_t n = 0;
        for (size_t j = 0; j < HM_REACH_OBSERVERS; j++) {
            const observer *b = &r->obs[j];
            if (!b->used || now - b->seen_ms >= OBS_FRESH_MS ||
                !hm_addr_equal((const struct sockaddr *)&a->observed,
                               (const struct sockaddr *)&b->observed))
                continue;
            size_t k = 0;
            while (k < n && !hm_origin_eq(&seen[k], &b->org))
                k++;
            if (k == n)
                seen[n++] = b->org;
        }
        if (n > best) {
            best = n;
            *out = a->observed;
        }
    }
    return best >= HM_REACH_MIN_ORIGINS;
}

/* Recomputes the candidate; a new one starts undecided. */
static void reach_update(hm_reach *r, uint64_t now)
{
    struct sockaddr_storage cand, listen;
    const char *source = "none";
    int has = 0, need = 1;
    char a[HM_ADDRSTRLEN];

    memset(&cand, 0, sizeof(cand));
    hm_transport_local_addr(hm_rpc_transport(r->rpc), &listen);
    if (r->cfg.has_announce) {
        cand = r->cfg.announce;
        source = "config";
        has = 1;
    } else if (best_observed(r, now, &cand)) {
        source = "observed";
        has = 1;
    } else if (!addr_unspecified(&listen)) {
        cand = listen;
        source = "listen";
        has = 1;
        /* Bound to loopback, only this machine can dial us, and it can. */
        need = !addr_loopback(&listen);
    }
    if (has == r->has_cand && strcmp(source, r->source) == 0 &&
        (!has || hm_addr_equal((const struct sockaddr *)&cand, (const struct sockaddr *)&r->cand)))
        return;
    r->has_cand = has;
    r->source = source;
    r->cand = cand;
    r->gen++;
    r->n_failed = 0;
    r->dialback_needed = has && need;
    r->recheck_at_ms = 0;
    for (size_t i = 0; i < HM_REACH_OBSERVERS; i++)
        r->obs[i].next_ask_ms = 0;
    if (!has)
        reach_set(r, HM_REACH_UNKNOWN,
                  "listening on %s and no %d peers of different origins agree on our address yet",
                  fmt(&listen, a, sizeof(a)), HM_REACH_MIN_ORIGINS);
    else if (r->dialback_needed)
        reach_set(r, HM_REACH_UNKNOWN, "%s address %s not confirmed by a dial-back yet", source,
                  fmt(&cand, a, sizeof(a)));
    else
        reach_set(r, HM_REACH_UNKNOWN, "listening on loopback %s: not checked",
                  fmt(&cand, a, sizeof(a)));
}

/* ---------------------------------------------------- asking for a dial-back */

static void on_dialback_reply(void *ud, int status, const uint8_t *body, size_t len)
{
    out_ctx *c = ud;
    hm_reach *r = c->r;
    char a[HM_ADDRSTRLEN], id[HM_PEER_ID_LEN + 1];
    int reached = 0, error = 0;

    r->out_inflight--;
    for (size_t i = 0; i < HM_REACH_OBSERVERS; i++)
        if (r->obs[i].used && memcmp(r->obs[i].pk, c->pk, HM_PK_BYTES) == 0)
            r->obs[i].asking = 0;
    hm_peer_id_encode(c->pk, id);
    if (r->stopped || c->gen != r->gen)
        goto out;
    if (status < 0 || hm_reach_parse_reply(body, len, &reached, &error) != 0) {
        /* A refusal (rate, bounds, an old peer: -ENOSYS) or a lost datagram proves nothing. */
        hm_debug(MOD, "dial-back request to %s: %s", id,
                 status < 0 ? hm_strerror(status) : "malformed reply");
        goto out;
    }
    fmt(&r->cand, a, sizeof(a));
    if (reached) {
        r->ok++;
        r->n_failed = 0;
        r->recheck_at_ms = hm_now_ms() + r->cfg.recheck_ms;
        reach_set(r, HM_REACH_YES, "%s dialled us back at %s", id, a);
        goto out;
    }
    r->failed_n++;
    size_t k = 0;
    while (k < r->n_failed && !hm_origin_eq(&r->failed[k], &c->org))
        k++;
    if (k == r->n_failed && r->n_failed < HM_REACH_FAIL_ORIGINS)
        r->failed[r->n_failed++] = c->org;
    hm_info(MOD, "%s could not dial us back at %s: %s", id, a, hm_strerror(error));
    if (r->n_failed >= HM_REACH_FAIL_ORIGINS) {
        r->recheck_at_ms = hm_now_ms() + r->cfg.recheck_ms;
        reach_set(r, HM_REACH_NO, "dial-back to %s failed from %zu peers of different origins (%s)",
                  a, r->n_failed, hm_strerror(error));
    }
out:
    free(c);
}

static int ask(hm_reach *r, observer *o)
{
    uint8_t buf[96];
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_map(&w, 1);
    hm_wire_wr_cstr(&w, "addr");
    hm_wire_wr_addr(&w, &r->cand);
    if (hm_wire_wr_error(&w) != 0)
        return -EINVAL;
    out_ctx *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return -ENOMEM;
    c->r = r;
    memcpy(c->pk, o->pk, HM_PK_BYTES);
    c->org = o->org;
    c->gen = r->gen;
    int result = hm_rpc_call(r->rpc, o->pk, (const struct sockaddr *)&o->peer_addr, HM_REACH_METHOD,
                             w.buf, w.len, HM_RPC_DGRAM, DIALBACK_TIMEOUT_MS, on_dialback_reply, c,
                             NULL);
    if (result < 0) {
        free(c);
        return result;
    }
    r->out_inflight++;
    o->asking = 1;
    return 0;
}

static void ask_some(hm_reach *r, uint64_t now)
{
    hm_origin asked[OUT_MAX];
    size_t n_asked = 0;
    for (size_t i = 0; i < HM_REACH_OBSERVERS && r->out_inflight < OUT_MAX; i++) {
        observer *o = &r->obs[i];
        if (!o->used || o->asking || now < o->next_ask_ms || now - o->seen_ms >= OBS_FRESH_MS)
            continue;
        /* Failures count by origin, so each round asks different origins. */
        int dup = 0;
        for (size_t k = 0; k < r->n_failed; k++)
            dup |= hm_origin_eq(&r->failed[k], &o->org);
        for (size_t k = 0; k < n_asked; k++)
            dup |= hm_origin_eq(&asked[k], &o->org);
        if (dup)
            continue;
        if (ask(r, o) == 0) {
            asked[n_asked++] = o->org;
            o->next_ask_ms = now + ASK_AGAIN_MS;
            if (n_asked == 2)
                break;
        }
    }
}

static void on_timer(uv_timer_t *t)
{
    hm_reach *r = t->data;
    uint64_t now = hm_now_ms();
    char a[HM_ADDRSTRLEN];
    if (r->stopped)
        return;
    reach_update(r, now);
    if (r->dialback_needed &&
        (r->state == HM_REACH_UNKNOWN || now >= r->recheck_at_ms)) {
        if (r->state != HM_REACH_UNKNOWN && r->n_failed >= HM_REACH_FAIL_ORIGINS)
            r->n_failed = 0; /* a recheck counts afresh */
        ask_some(r, now);
    }
    /*
     * No verdict from dial-backs, yet peers of several origins answer us and
     * nobody ever completed a connection to us: a NAT or firewall in front.
     */
    int on_loopback = r->has_cand && !r->dialback_needed;
    if (!on_loopback && r->state == HM_REACH_UNKNOWN &&
        now - r->started_ms >= r->cfg.inbound_timeout_ms) {
        hm_transport_stats st;
        hm_transport_get_stats(hm_rpc_transport(r->rpc), &st);
        hm_origin seen[HM_REACH_MIN_ORIGINS];
        size_t n = 0;
        for (size_t i = 0; i < HM_REACH_OBSERVERS && n < HM_REACH_MIN_ORIGINS; i++) {
            const observer *o = &r->obs[i];
            if (!o->used || now - o->seen_ms >= OBS_FRESH_MS)
                continue;
            size_t k = 0;
            while (k < n && !hm_origin_eq(&seen[k], &o->org))
                k++;
            if (k == n)
                seen[n++] = o->org;
        }
        if (st.inbound_handshakes_ok == 0 && st.handshakes_ok > 0 && n >= HM_REACH_MIN_ORIGINS) {
            r->recheck_at_ms = now + r->cfg.recheck_ms;
            struct sockaddr_storage where = r->cand;
            if (!r->has_cand)
                hm_transport_local_addr(hm_rpc_transport(r->rpc), &where);
            reach_set(r, HM_REACH_NO,
                      "no inbound connection at %s in %llu s while outbound ones work",
                      fmt(&where, a, sizeof(a)),
                      (unsigned long long)(r->cfg.inbound_timeout_ms / 1000));
        }
    }
    /* Per-origin rate entries whose time has passed are freed. */
    uint64_t now_us = hm_now_us();
    for (hm_origin_ent *e = hm_origin_tab_next(&r->serve, NULL), *next; e != NULL; e = next) {
        next = hm_origin_tab_next(&r->serve, e);
        if (e->v[SV_TAT] <= now_us)
            e->v[SV_TAT] = 0;
        hm_origin_tab_release(&r->serve, e);
    }
    uint64_t next_ms = r->state == HM_REACH_UNKNOWN || !r->has_cand ? r->cfg.check_ms
                                                                    : r->cfg.check_ms * 5;
    uv_timer_start(&r->timer, on_timer, next_ms, 0);
}

/* ------------------------------------------------------ dialling back */

static void serve_reply(hm_rpc_req *req, int reached, int error)
{
    uint8_t buf[48];
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_map(&w, 2);
    hm_wire_wr_cstr(&w, "reached");
    hm_wire_wr_bool(&w, reached);
    hm_wire_wr_cstr(&w, "error");
    hm_wire_wr_int(&w, error);
    hm_rpc_respond(req, 0, w.buf, w.len);
}

static void on_probe_done(void *ud, int status)
{
    serve_ctx *c = ud;
    hm_reach *r = c->r;
    r->serving--;
    hm_origin_ent *e = hm_origin_tab_get(&r->serve, &c->org, 0);
    if (e != NULL) {
        if (e->v[SV_INFLIGHT] > 0)
            e->v[SV_INFLIGHT]--;
        hm_origin_tab_release(&r->serve, e);
    }
    serve_reply(c->req, status == 0, status);
    free(c);
}

static void on_dialback_request(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                                const struct sockaddr *from, const uint8_t *body, size_t len)
{
    hm_reach *r = ud;
    struct sockaddr_storage to;
    hm_origin org;
    char a[HM_ADDRSTRLEN], f[HM_ADDRSTRLEN];

    /* Cap (the rpc layer), validate, bound, rate-limit, then dial. */
    if (r->stopped || from == NULL) {
        hm_rpc_respond(req, -ECANCELED, NULL, 0);
        return;
    }
    if (hm_reach_parse_request(body, len, &to) != 0 || addr_port(&to) == 0) {
        hm_rpc_respond(req, -EPROTO, NULL, 0);
        return;
    }
    /* Only the host the request came from: never a third party. */
    if (!same_ip((const struct sockaddr *)&to, from) ||
        (r->cfg.peer_verified != NULL && !r->cfg.peer_verified(r->cfg.peer_verified_ud, peer_pk,
                                                               from))) {
        r->refused_other++;
        struct sockaddr_storage fs;
        memcpy(&fs, from, hm_addr_len(from));
        hm_debug(MOD, "refusing to dial %s for a request from %s", fmt(&to, a, sizeof(a)),
                 fmt(&fs, f, sizeof(f)));
        hm_rpc_respond(req, -EPERM, NULL, 0);
        return;
    }
    if (r->serving >= r->cfg.max_dialbacks) {
        r->refused_max++;
        hm_rpc_respond(req, -EBUSY, NULL, 0);
        return;
    }
    hm_origin_of(from, &org);
    hm_origin_ent *e = hm_origin_tab_get(&r->serve, &org, 1);
    if (e == NULL) {
        r->refused_max++;
        hm_rpc_respond(req, -EBUSY, NULL, 0);
        return;
    }
    /* One at a time per origin, and a GCRA of rate a minute with a burst of 3. */
    uint64_t now = hm_now_us();
    uint64_t step = 60000000u / r->cfg.dialback_rate_per_origin;
    uint64_t tat = HM_MAX(e->v[SV_TAT], now);
    if (e->v[SV_INFLIGHT] > 0 || tat > now + 2 * step) {
        r->refused_rate++;
        hm_origin_tab_release(&r->serve, e);
        hm_rpc_respond(req, -EAGAIN, NULL, 0);
        return;
    }
    serve_ctx *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        hm_origin_tab_release(&r->serve, e);
        hm_rpc_respond(req, -ENOMEM, NULL, 0);
        return;
    }
    c->r = r;
    c->req = req;
    c->org = org;
    int result = hm_transport_probe(hm_rpc_transport(r->rpc), peer_pk,
                                    (const struct sockaddr *)&to, on_probe_done, c);
    if (result < 0) {
        free(c);
        hm_origin_tab_release(&r->serve, e);
        if (result == -ENOBUFS) {
            r->refused_max++;
            hm_rpc_respond(req, -EBUSY, NULL, 0);
        } else {
            serve_reply(req, 0, result);
        }
        return;
    }
    e->v[SV_TAT] = tat + step;
    e->v[SV_INFLIGHT]++;
    r->serving++;
    r->served++;
}

/* ------------------------------------------------------------------ API */

int hm_reach_new(uv_loop_t *loop, hm_rpc *rpc, const hm_reach_config *cfg, hm_reach_mode_cb cb,
                 void *ud, hm_reach **out)
{
    int result;
    hm_reach *r = calloc(1, sizeof(*r));
    *out = NULL;
    if (r == NULL)
        return -ENOMEM;
    r->loop = loop;
    r->rpc = rpc;
    r->cfg = *cfg;
    if (r->cfg.dialback_rate_per_origin == 0)
        r->cfg.dialback_rate_per_origin = 6;
    if (r->cfg.max_dialbacks == 0)
        r->cfg.max_dialbacks = 16;
    if (r->cfg.check_ms == 0)
        r->cfg.check_ms = 2000;
    if (r->cfg.recheck_ms == 0)
        r->cfg.recheck_ms = 300000;
    if (r->cfg.inbound_timeout_ms == 0)
        r->cfg.inbound_timeout_ms = 600000;
    r->mode_cb = cb;
    r->mode_ud = ud;
    r->source = "none";
    r->started_ms = hm_now_ms();
    if ((result = hm_origin_tab_init(&r->serve, SERVE_ORIGINS_MAX)) < 0) {
        free(r);
        return result;
    }
    if ((result = hm_rpc_register(rpc, HM_REACH_METHOD, on_dialback_request, r)) < 0) {
        hm_origin_tab_free(&r->serve);
        free(r);
        return result;
    }
    uv_timer_init(loop, &r->timer);
    r->timer.data = r;
    /* The first candidate at once, so that what we declare is known from the start. */
    r->has_cand = -1;
    reach_update(r, hm_now_ms());
    uv_timer_start(&r->timer, on_timer, r->cfg.check_ms, 0);
    *out = r;
    return 0;
}

void hm_reach_observed(hm_reach *r, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *peer_addr,
                       const struct sockaddr *observed)
{
    if (r->stopped || (observed->sa_family != AF_INET && observed->sa_family != AF_INET6) ||
        (peer_addr->sa_family != AF_INET && peer_addr->sa_family != AF_INET6))
        return;
    struct sockaddr_storage obs;
    memcpy(&obs, observed, hm_addr_len(observed));
    if (addr_unspecified(&obs) || addr_port(&obs) == 0)
        return;
    uint64_t now = hm_now_ms();
    /* Its own entry, else a free one, else the stalest not being asked. */
    observer *slot = NULL, *free_slot = NULL, *oldest = NULL;
    for (size_t i = 0; i < HM_REACH_OBSERVERS && slot == NULL; i++) {
        observer *o = &r->obs[i];
        if (!o->used) {
            if (free_slot == NULL)
                free_slot = o;
        } else if (memcmp(o->pk, pk, HM_PK_BYTES) == 0) {
            slot = o;
        } else if (!o->asking && (oldest == NULL || o->seen_ms < oldest->seen_ms)) {
            oldest = o;
        }
    }
    if (slot == NULL)
        slot = free_slot != NULL ? free_slot : oldest;
    if (slot == NULL)
        return;
    if (!slot->used || memcmp(slot->pk, pk, HM_PK_BYTES) != 0) {
        memset(slot, 0, sizeof(*slot));
        memcpy(slot->pk, pk, HM_PK_BYTES);
        slot->used = 1;
    }
    memcpy(&slot->peer_addr, peer_addr, hm_addr_len(peer_addr));
    hm_origin_of(peer_addr, &slot->org);
    slot->observed = obs;
    slot->seen_ms = now;
}

void hm_reach_forget(hm_reach *r, const uint8_t pk[HM_PK_BYTES])
{
    for (size_t i = 0; i < HM_REACH_OBSERVERS; i++)
        if (r->obs[i].used && !r->obs[i].asking && memcmp(r->obs[i].pk, pk, HM_PK_BYTES) == 0)
            memset(&r->obs[i], 0, sizeof(r->obs[i]));
}

int hm_reach_declared(hm_reach *r, struct sockaddr_storage *out)
{
    uint64_t now = hm_now_ms();
    reach_update(r, now);
    if (!r->has_cand)
        return -EADDRNOTAVAIL;
    if (r->state == HM_REACH_NO)
        return -ENETUNREACH;
    /*
     * Observed addresses are only peers' word until one of them dialled it,
     * except our own listen address, which was declared before peers saw it
     * (source "listen"): peers agreeing on it is no reason to withdraw it
     * for the dial-back's time, which would leave a search that begins then
     * without an address (matchmaking as a client, records not made).
     */
    if (strcmp(r->source, "observed") == 0 && r->state != HM_REACH_YES) {
        struct sockaddr_storage listen;
        hm_transport_local_addr(hm_rpc_transport(r->rpc), &listen);
        if (addr_unspecified(&listen) ||
            !hm_addr_equal((const struct sockaddr *)&listen, (const struct sockaddr *)&r->cand))
            return -EADDRNOTAVAIL;
    }
    /* Whoever is off loopback would dial itself. */
    if (addr_loopback(&r->cand) && off_loopback_peers(r, now))
        return -EADDRNOTAVAIL;
    *out = r->cand;
    return 0;
}

void hm_reach_get_status(hm_reach *r, hm_reach_status *out)
{
    struct sockaddr_storage d;
    memset(out, 0, sizeof(*out));
    int dr = hm_reach_declared(r, &d);
    out->reachable = r->state;
    out->source = r->source;
    out->declared = dr == 0;
    out->addr = r->cand;
    if (dr == -EADDRNOTAVAIL && r->has_cand && addr_loopback(&r->cand) &&
        off_loopback_peers(r, hm_now_ms())) {
        char a[HM_ADDRSTRLEN];
        snprintf(out->reason, sizeof(out->reason),
                 "loopback address %s not declared: peers off loopback know us",
                 fmt(&r->cand, a, sizeof(a)));
    } else {
        hm_strlcpy(out->reason, r->reason, sizeof(out->reason));
    }
    out->dialbacks_ok = r->ok;
    out->dialbacks_failed = r->failed_n;
    out->dialbacks_served = r->served;
}

void hm_reach_limits(const hm_reach *r, hm_limit_emit_fn emit, void *ud)
{
    emit(ud, "DialbackRatePerOrigin", r->refused_rate);
    emit(ud, "MaxDialbacks", r->refused_max);
    /* A fixed rule, not a setting: we dial back only the asker's own host. */
    emit(ud, "DialbackOtherHost", r->refused_other);
}

void hm_reach_stop(hm_reach *r)
{
    if (r->stopped)
        return;
    r->stopped = 1;
    uv_timer_stop(&r->timer);
    hm_rpc_unregister(r->rpc, HM_REACH_METHOD);
}

static void reach_timer_closed(uv_handle_t *h)
{
    hm_reach *r = h->data;
    void (*cb)(void *) = r->free_cb;
    void *ud = r->free_ud;
    hm_origin_tab_free(&r->serve);
    free(r);
    if (cb != NULL)
        cb(ud);
}

void hm_reach_free(hm_reach *r, void (*cb)(void *ud), void *ud)
{
    hm_reach_stop(r);
    r->mode_cb = NULL;
    r->free_cb = cb;
    r->free_ud = ud;
    uv_close((uv_handle_t *)&r->timer, reach_timer_closed);
}

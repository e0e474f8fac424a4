/*
 * relay: see relay.h. The serving side keeps reservations (by key, in a
 * small array: at most max_reservations) and circuits (a list); each
 * circuit is two sockets taken over from the transport and copied into
 * each other with backpressure, a byte budget and a rate.
 */
#include "config.h"

#include "src/net/relay.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <unistd.h>

#include "src/base/util.h"
#include "src/base/wire.h"
#include "src/net/transport.h"

#define MOD "relay"
#define TICK_MS 100u
/* With both FINs in, what is still queued toward an end may take this long to go. */
#define CLOSE_DRAIN_MS 10000u
#define SIDE_RBUF (64u * 1024u)
/* Bytes one side may have queued towards the other before we stop reading it. */
#define SIDE_HIGH_WATER (1u << 20)
#define SIDE_LOW_WATER (256u * 1024u)
#define CALL_TIMEOUT_MS 5000u
#define HEAD_MAX (64u * 1024u)

static const hm_wire_limits relay_limits = {.max_size = 256, .max_depth = 2, .max_elements = 16};

typedef struct reservation {
    int used;
    uint8_t pk[HM_PK_BYTES];
    hm_origin origin;
    uint64_t expires_ms;
} reservation;

struct circuit;

typedef struct side {
    uv_tcp_t tcp;
    struct circuit *c;
    int open;    /* the handle is initialised and not yet closed */
    int reading;
    int eof;     /* it sent FIN: nothing more to copy from it */
    int shut_done; /* the other's FIN was passed on to it, after every write */
    uv_shutdown_t shut_req;
    uint8_t *rbuf;
} side;

enum { CIRC_PENDING = 0, CIRC_SPLICED = 1, CIRC_CLOSING = 2 };

typedef struct circuit {
    LIST_ENTRY(circuit) link;
    hm_relay *r;
    int state;
    side a;                 /* the dialler */
    side b;                 /* the NAT'd peer's accept connection */
    uint8_t target[HM_PK_BYTES];
    uint8_t token[HM_RELAY_TOKEN_BYTES];
    hm_origin origin;       /* the dialler's */
    struct sockaddr_storage from; /* the dialler's address, told to the peer */
    uint8_t *head;          /* the dialler's bytes read by the transport */
    size_t head_len;
    uint64_t created_ms;
    uint64_t bytes;         /* copied, both ways */
    int64_t tokens;         /* rate budget, bytes */
    int paused_rate;
    int handles;            /* open handles; freed at 0 */
    uint64_t both_eof_ms;   /* when the second side sent FIN, 0: not yet */
} circuit;

typedef struct wr {
    uv_write_t req;
    side *to;
    size_t len;
    uint8_t data[];
} wr;

typedef struct call_ctx {
    hm_relay *r;
    int kind; /* 0 reserve, 1 connect */
    uint64_t gen;
    int via;
    uint8_t token[HM_RELAY_TOKEN_BYTES];
} call_ctx;

struct hm_relay {
    uv_loop_t *loop;
    hm_rpc *rpc;
    hm_transport *t;
    char peer_id[HM_PEER_ID_LEN + 1]; /* ours, for the relayed address */
    hm_relay_config cfg;
    uv_timer_t tick;      /* serving: expiries, rates, lifetimes */
    uv_timer_t ctimer;    /* using: refresh and retries */
    int handles;
    int stopped;
    size_t calls;         /* rpc calls in flight (their contexts point here) */
    void (*free_cb)(void *ud);
    void *free_ud;
    int freeing;

    /* serving */
    reservation *res;
    size_t n_res;
    hm_origin_tab res_origins;  /* v[0]: reservations */
    hm_origin_tab circ_origins; /* v[0]: circuits */
    int tabs_init;
    LIST_HEAD(, circuit) circuits;
    size_t n_circuits;
    uint64_t circuits_total, bytes_relayed;
    uint64_t refused_max_res, refused_res_origin, refused_max_circ, refused_circ_origin;
    uint64_t cut_bytes, throttled, cut_lifetime, accept_timeouts, no_reservation;

    /* using */
    int configured;       /* RelayVia named relays (else they come from hm_relay_set_found) */
    int active;
    int state;
    int via;              /* index in use or being tried */
    int tried;            /* relays tried in this round */
    uint64_t gen;         /* bumps on every state change, so stale replies are ignored */
    uint64_t backoff_ms;
    uint64_t failovers, accepts, refused_dialler_origin, dialler_not_taken;
    char reason[HM_RELAY_REASON_LEN];
    /* -- relay failover -- */
    void (*notify)(void *ud); /* our relayed address changed (hm_relay_set_notify) */
    void *notify_ud;
    uint64_t lost_ms;         /* when the connection to our relay last went away */
};

static void maybe_free(hm_relay *r);

static uint64_t now_ms(void) { return hm_now_ms(); }

void hm_relay_config_defaults(hm_relay_config *c)
{
    if (c->max_reservations == 0)
        c->max_reservations = 128;
    if (c->reservations_per_origin == 0)
        c->reservations_per_origin = 4;
    if (c->max_circuits == 0)
        c->max_circuits = 64;
    if (c->circuits_per_origin == 0)
        c->circuits_per_origin = 8;
    if (c->max_circuit_bytes == 0)
        c->max_circuit_bytes = 256ull << 20;
    if (c->rate == 0)
        c->rate = 16384ull << 10;
    if (c->circuit_lifetime_ms == 0)
        c->circuit_lifetime_ms = 3600000;
    if (c->reservation_ttl_ms == 0)
        c->reservation_ttl_ms = 60000;
    if (c->accept_timeout_ms == 0)
        c->accept_timeout_ms = 10000;
    if (c->refresh_ms == 0)
        c->refresh_ms = 5000;
    if (c->retry_min_ms == 0)
        c->retry_min_ms = 1000;
    if (c->retry_max_ms == 0)
        c->retry_max_ms = 60000;
    if (c->retry_max_ms < c->retry_min_ms)
        c->retry_max_ms = c->retry_min_ms;
}

/* ------------------------------------------------------------- parsers */

void hm_relay_make_preamble(const uint8_t token[HM_RELAY_TOKEN_BYTES], uint8_t *out)
{
    memcpy(out, HM_TRANSPORT_RELAY_MAGIC, 4);
    out[4] = HM_RELAY_VERSION;
    out[5] = HM_RELAY_KIND_ACCEPT;
    out[6] = 0;
    out[7] = 0;
    memcpy(out + 8, token, HM_RELAY_TOKEN_BYTES);
}

int hm_relay_parse_preamble(const uint8_t *p, size_t len, uint8_t token_out[HM_RELAY_TOKEN_BYTES])
{
    if (p == NULL || len < HM_TRANSPORT_RELAY_PREAMBLE || memcmp(p, HM_TRANSPORT_RELAY_MAGIC, 4) != 0 ||
        p[4] != HM_RELAY_VERSION || p[5] != HM_RELAY_KIND_ACCEPT || p[6] != 0 || p[7] != 0)
        return -EPROTO;
    memcpy(token_out, p + 8, HM_RELAY_TOKEN_BYTES);
    return 0;
}

void hm_relay_write_connect(hm_wire_wr *w, const uint8_t token[HM_RELAY_TOKEN_BYTES],
                            const struct sockaddr_storage *from)
{
    int has_from = from != NULL && from->ss_family != AF_UNSPEC;
    hm_wire_wr_map(w, has_from ? 2 : 1);
    hm_wire_wr_cstr(w, "token");
    hm_wire_wr_bin(w, token, HM_RELAY_TOKEN_BYTES);
    if (has_from) {
        /* Whom the peer is to charge the circuit to (its origin's shares). */
        hm_wire_wr_cstr(w, "from");
        hm_wire_wr_addr(w, from);
    }
}

int hm_relay_parse_connect(const uint8_t *body, size_t len, uint8_t token_out[HM_RELAY_TOKEN_BYTES],
                           struct sockaddr_storage *from_out)
{
    hm_wire_msg m;
    if (hm_wire_decode_open_map(&m, body, len, &relay_limits, NULL, 0) < 0)
        return -EPROTO;
    const msgpack_object *t = hm_wire_map_get(&m.root, "token");
    const msgpack_object *f = hm_wire_map_get(&m.root, "from");
    int result = t != NULL && hm_wire_get_bin_exact(t, token_out, HM_RELAY_TOKEN_BYTES) == 0
                     ? 0 : -EPROTO;
    memset(from_out, 0, sizeof(*from_out));
    from_out->ss_family = AF_UNSPEC;
    /* "from" is optional (relays before it did not send it), never malformed. */
    if (result == 0 && f != NULL && hm_wire_get_addr(f, from_out) < 0)
        result = -EPROTO;
    if (result == 0 && f != NULL && from_out->ss_family != AF_INET &&
        from_out->ss_family != AF_INET6)
        result = -EPROTO;
    hm_wire_decode_close(&m);
    return result;
}

int hm_relay_parse_reserve_reply(const uint8_t *body, size_t len, uint64_t *ttl_ms_out)
{
    hm_wire_msg m;
    uint64_t ttl = 0;
    if (hm_wire_decode_open_map(&m, body, len, &relay_limits, NULL, 0) < 0)
        return -EPROTO;
    const msgpack_object *t = hm_wire_map_get(&m.root, "ttl_ms");
    /* A ttl under a second or over a day is no reservation we can keep. */
    int result = t != NULL && hm_wire_get_uint(t, &ttl) == 0 && ttl >= 1000 && ttl <= 86400000u
                     ? 0 : -EPROTO;
    if (result == 0)
        *ttl_ms_out = ttl;
    hm_wire_decode_close(&m);
    return result;
}

int hm_relay_parse_via(const char *s, hm_relay_via *out, size_t *n_out, char *err, size_t errlen)
{
    size_t n = 0;
    if (s == NULL || strlen(s) > 4096) {
        snprintf(err, errlen, "RelayVia: expected PEERID@HOST:PORT[,...] of at most 4096 bytes");
        return -EINVAL;
    }
    const char *p = s;
    while (*p != '\0') {
        const char *e = strchr(p, ',');
        size_t len = e != NULL ? (size_t)(e - p) : strlen(p);
        char one[HM_PEER_ID_LEN + 80];
        if (len == 0 || len >= sizeof(one)) {
            snprintf(err, errlen, "RelayVia: an empty or over-long entry");
            return -EINVAL;
        }
        if (n == HM_RELAY_MAX_VIA) {
            snprintf(err, errlen, "RelayVia: at most %d relays", HM_RELAY_MAX_VIA);
            return -EINVAL;
        }
        memcpy(one, p, len);
        one[len] = '\0';
        if (hm_peer_addr_parse(one, out[n].pk, &out[n].addr) != 0) {
            snprintf(err, errlen, "RelayVia: bad relay '%s': expected PEERID@HOST:PORT", one);
            return -EINVAL;
        }
        n++;
        p += len;
        if (*p == ',')
            p++;
    }
    *n_out = n;
    return 0;
}

/* ------------------------------------------------------------ circuits */

static void circ_close(circuit *c, const char *why);

static void side_closed_cb(uv_handle_t *h)
{
    side *s = h->data;
    circuit *c = s->c;
    hm_relay *r = c->r;
    free(s->rbuf);
    s->rbuf = NULL;
    if (--c->handles > 0)
        return;
    free(c->head);
    free(c);
    r->handles--;
    maybe_free(r);
}

static void side_close(side *s)
{
    if (!s->open)
        return;
    s->open = 0;
    s->reading = 0;
    uv_close((uv_handle_t *)&s->tcp, side_closed_cb);
}

static void circ_close(circuit *c, const char *why)
{
    hm_relay *r = c->r;
    if (c->state == CIRC_CLOSING)
        return;
    hm_debug(MOD, "circuit closed after %llu bytes: %s", (unsigned long long)c->bytes, why);
    c->state = CIRC_CLOSING;
    LIST_REMOVE(c, link);
    r->n_circuits--;
    hm_origin_ent *e = hm_origin_tab_get(&r->circ_origins, &c->origin, 0);
    if (e != NULL) {
        e->v[0]--;
        hm_origin_tab_release(&r->circ_origins, e);
    }
    /* Our own handle count keeps r alive until the last side closes. */
    r->handles++;
    int any = c->a.open || c->b.open;
    side_close(&c->a);
    side_close(&c->b);
    if (!any) {
        free(c->head);
        free(c);
        r->handles--;
    }
}

static side *other(side *s) { return s == &s->c->a ? &s->c->b : &s->c->a; }

static void side_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    side *s = h->data;
    HM_UNUSED(suggested);
    if (s->rbuf == NULL)
        s->rbuf = malloc(SIDE_RBUF);
    *buf = uv_buf_init((char *)s->rbuf, s->rbuf != NULL ? SIDE_RBUF : 0);
}

static void side_read_cb(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf);

static void side_start(side *s)
{
    circuit *c = s->c;
    if (!s->open || s->reading || s->eof || c->state != CIRC_SPLICED || c->paused_rate)
        return;
    side *o = other(s);
    if (o->open && uv_stream_get_write_queue_size((uv_stream_t *)&o->tcp) > SIDE_HIGH_WATER)
        return;
    if (uv_read_start((uv_stream_t *)&s->tcp, side_alloc, side_read_cb) == 0)
        s->reading = 1;
}

static void side_stop(side *s)
{
    if (s->open && s->reading)
        uv_read_stop((uv_stream_t *)&s->tcp);
    s->reading = 0;
}

static void wr_cb(uv_write_t *req, int status)
{
    wr *w = (wr *)req;
    side *to = w->to;
    circuit *c = to->c;
    free(w);
    if (c->state != CIRC_SPLICED)
        return;
    if (status < 0) {
        circ_close(c, uv_strerror(status));
        return;
    }
    /* Below the low water mark, the side feeding `to` may read again. */
    if (to->open && uv_stream_get_write_queue_size((uv_stream_t *)&to->tcp) < SIDE_LOW_WATER)
        side_start(other(to));
}

static int side_write(side *to, const uint8_t *p, size_t len)
{
    wr *w = malloc(sizeof(*w) + len);
    if (w == NULL)
        return -ENOMEM;
    w->to = to;
    w->len = len;
    memcpy(w->data, p, len);
    uv_buf_t b = uv_buf_init((char *)w->data, (unsigned)len);
    int r = uv_write(&w->req, (uv_stream_t *)&to->tcp, &b, 1, wr_cb);
    if (r < 0) {
        free(w);
        return r;
    }
    return 0;
}

/*
 * A FIN passed on: to->tcp has written everything queued for it, then its
 * FIN. The circuit closes once both FINs have been passed on so, and not
 * before: closing cancels writes still queued, which are what an end
 * wrote after reading the other's FIN (a retired connection's last
 * replies, docs/protocol.md). A cancelled shutdown (the circuit closing)
 * runs before its side's close callback, so the circuit still exists.
 */
static void shutdown_cb(uv_shutdown_t *req, int status)
{
    side *to = req->data;
    circuit *c = to->c;
    if (c->state != CIRC_SPLICED)
        return;
    if (status < 0) {
        circ_close(c, uv_strerror(status));
        return;
    }
    to->shut_done = 1;
    if (c->a.shut_done && c->b.shut_done)
        circ_close(c, "both sides closed");
}

static void side_read_cb(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    side *s = st->data;
    circuit *c = s->c;
    hm_relay *r = c->r;
    HM_UNUSED(buf);
    if (c->state != CIRC_SPLICED || nread == 0)
        return;
    side *o = other(s);
    if (nread < 0) {
        if (nread != UV_EOF) {
            circ_close(c, uv_strerror((int)nread));
            return;
        }
        /* A half close is passed on, so each end sees the other's FIN. */
        s->eof = 1;
        side_stop(s);
        if (o->eof)
            c->both_eof_ms = now_ms();
        o->shut_req.data = o;
        if (uv_shutdown(&o->shut_req, (uv_stream_t *)&o->tcp, shutdown_cb) < 0)
            circ_close(c, "peer closed");
        return;
    }
    c->bytes += (uint64_t)nread;
    r->bytes_relayed += (uint64_t)nread;
    if (c->bytes > r->cfg.max_circuit_bytes) {
        r->cut_bytes++;
        circ_close(c, "over RelayMaxMiB");
        return;
    }
    if (side_write(o, s->rbuf, (size_t)nread) < 0) {
        circ_close(c, "write failed");
        return;
    }
    c->tokens -= nread;
    if (c->tokens < 0) {
        /* Over the rate: both directions wait for the tick to refill. */
        r->throttled++;
        c->paused_rate = 1;
        side_stop(&c->a);
        side_stop(&c->b);
        return;
    }
    if (uv_stream_get_write_queue_size((uv_stream_t *)&o->tcp) > SIDE_HIGH_WATER)
        side_stop(s);
}

static int side_open(hm_relay *r, circuit *c, side *s, int fd)
{
    s->c = c;
    int e = uv_tcp_init(r->loop, &s->tcp);
    if (e < 0) {
        close(fd);
        return e;
    }
    s->tcp.data = s;
    s->open = 1;
    c->handles++;
    e = uv_tcp_open(&s->tcp, (uv_os_sock_t)fd);
    if (e < 0) {
        close(fd);
        return e;
    }
    uv_tcp_nodelay(&s->tcp, 1);
    return 0;
}

static reservation *res_find(hm_relay *r, const uint8_t pk[HM_PK_BYTES])
{
    uint64_t now = now_ms();
    for (size_t i = 0; i < r->cfg.max_reservations; i++)
        if (r->res[i].used && r->res[i].expires_ms > now &&
            memcmp(r->res[i].pk, pk, HM_PK_BYTES) == 0)
            return &r->res[i];
    return NULL;
}

static void res_drop(hm_relay *r, reservation *v)
{
    hm_origin_ent *e = hm_origin_tab_get(&r->res_origins, &v->origin, 0);
    if (e != NULL) {
        e->v[0]--;
        hm_origin_tab_release(&r->res_origins, e);
    }
    v->used = 0;
    r->n_res--;
}

static void connect_cb(void *ud, int status, const uint8_t *body, size_t len)
{
    call_ctx *x = ud;
    hm_relay *r = x->r;
    HM_UNUSED(body);
    HM_UNUSED(len);
    r->calls--;
    if (status < 0 && !r->stopped) {
        circuit *c;
        LIST_FOREACH(c, &r->circuits, link)
            if (c->state == CIRC_PENDING && memcmp(c->token, x->token, HM_RELAY_TOKEN_BYTES) == 0)
                break;
        if (c != NULL) {
            hm_debug(MOD, "the relayed peer did not take a circuit: %s", hm_strerror(status));
            circ_close(c, "the peer refused the circuit");
        }
    }
    free(x);
    maybe_free(r);
}

/* A dialler's msg1 names a key we relay for: hold it and call the peer. */
static int divert_dialler(hm_relay *r, const uint8_t *head, size_t len, const struct sockaddr *from,
                          int fd)
{
    const uint8_t *target = head + 65; /* msg1: version, C pk, C eph pk, S pk (crypto.h) */
    reservation *v = res_find(r, target);
    if (v == NULL) {
        r->no_reservation++;
        return 0; /* the transport answers it: a handshake for another key fails */
    }
    hm_origin o;
    hm_origin_of(from, &o);
    if (r->n_circuits >= r->cfg.max_circuits) {
        r->refused_max_circ++;
        close(fd);
        return 1;
    }
    hm_origin_ent *e = hm_origin_tab_get(&r->circ_origins, &o, 1);
    if (e == NULL || e->v[0] >= r->cfg.circuits_per_origin) {
        r->refused_circ_origin++;
        if (e != NULL)
            hm_origin_tab_release(&r->circ_origins, e);
        close(fd);
        return 1;
    }
    circuit *c = calloc(1, sizeof(*c));
    if (c == NULL || len > HEAD_MAX || (c->head = malloc(len)) == NULL) {
        free(c);
        hm_origin_tab_release(&r->circ_origins, e);
        close(fd);
        return 1;
    }
    e->v[0]++;
    c->r = r;
    c->state = CIRC_PENDING;
    c->origin = o;
    memcpy(&c->from, from, hm_addr_len(from));
    c->created_ms = now_ms();
    c->tokens = (int64_t)HM_MIN(r->cfg.rate, (uint64_t)INT64_MAX / 2);
    memcpy(c->target, target, HM_PK_BYTES);
    memcpy(c->head, head, len);
    c->head_len = len;
    randombytes_buf(c->token, sizeof(c->token));
    LIST_INSERT_HEAD(&r->circuits, c, link);
    r->n_circuits++;
    r->circuits_total++;
    if (side_open(r, c, &c->a, fd) < 0) {
        circ_close(c, "cannot take the socket");
        return 1;
    }
    uint8_t buf[64 + HM_ADDRSTRLEN];
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_relay_write_connect(&w, c->token, &c->from);
    if (hm_wire_wr_error(&w) != 0) {
        circ_close(c, "cannot encode the circuit's call");
        return 1;
    }
    call_ctx *x = calloc(1, sizeof(*x));
    if (x == NULL) {
        circ_close(c, "out of memory");
        return 1;
    }
    x->r = r;
    x->kind = 1;
    memcpy(x->token, c->token, sizeof(x->token));
    /* On the peer's reserved connection only (no address): it is behind a NAT. */
    int rc = hm_rpc_call(r->rpc, target, NULL, HM_RELAY_METHOD_CONNECT, w.buf, w.len, HM_RPC_STREAM,
                         r->cfg.accept_timeout_ms, connect_cb, x, NULL);
    if (rc < 0) {
        free(x);
        if (rc == -ENOTCONN)
            res_drop(r, v); /* its connection is gone, and so is the reservation */
        circ_close(c, "cannot reach the relayed peer");
        return 1;
    }
    r->calls++;
    return 1;
}

/* The NAT'd peer calls back with its token: splice. */
static int divert_accept(hm_relay *r, const uint8_t *head, size_t len, int fd)
{
    uint8_t token[HM_RELAY_TOKEN_BYTES];
    if (hm_relay_parse_preamble(head, len, token) < 0) {
        close(fd);
        return 1;
    }
    circuit *c;
    LIST_FOREACH(c, &r->circuits, link)
        if (c->state == CIRC_PENDING && sodium_memcmp(c->token, token, HM_RELAY_TOKEN_BYTES) == 0)
            break;
    if (c == NULL) {
        close(fd);
        return 1;
    }
    if (side_open(r, c, &c->b, fd) < 0) {
        circ_close(c, "cannot take the accept socket");
        return 1;
    }
    c->state = CIRC_SPLICED;
    /* The dialler's msg1 (and anything after it), then whatever the peer sent past its preamble. */
    int e = side_write(&c->b, c->head, c->head_len);
    if (e == 0 && len > HM_TRANSPORT_RELAY_PREAMBLE)
        e = side_write(&c->a, head + HM_TRANSPORT_RELAY_PREAMBLE, len - HM_TRANSPORT_RELAY_PREAMBLE);
    free(c->head);
    c->head = NULL;
    if (e < 0) {
        circ_close(c, "write failed");
        return 1;
    }
    c->bytes += len - HM_TRANSPORT_RELAY_PREAMBLE;
    side_start(&c->a);
    side_start(&c->b);
    return 1;
}

static int on_divert(void *ud, const uint8_t *head, size_t len, const struct sockaddr *from, int fd)
{
    hm_relay *r = ud;
    if (r->stopped || !r->cfg.serve)
        return 0;
    if (head[0] == (uint8_t)HM_TRANSPORT_RELAY_MAGIC[0])
        return divert_accept(r, head, len, fd);
    return divert_dialler(r, head, len, from, fd);
}

static void on_reserve_request(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                               const struct sockaddr *from, const uint8_t *body, size_t len)
{
    hm_relay *r = ud;
    HM_UNUSED(body);
    HM_UNUSED(len);
    if (r->stopped || !r->cfg.serve || from == NULL) {
        hm_rpc_respond(req, -EPERM, NULL, 0);
        return;
    }
    uint64_t now = now_ms();
    reservation *v = res_find(r, peer_pk);
    if (v == NULL) {
        hm_origin o;
        hm_origin_of(from, &o);
        if (r->n_res >= r->cfg.max_reservations) {
            r->refused_max_res++;
            hm_rpc_respond(req, -ENOBUFS, NULL, 0);
            return;
        }
        hm_origin_ent *e = hm_origin_tab_get(&r->res_origins, &o, 1);
        if (e == NULL || e->v[0] >= r->cfg.reservations_per_origin) {
            r->refused_res_origin++;
            if (e != NULL)
                hm_origin_tab_release(&r->res_origins, e);
            hm_rpc_respond(req, -EUSERS, NULL, 0);
            return;
        }
        for (size_t i = 0; i < r->cfg.max_reservations; i++)
            if (!r->res[i].used) {
                v = &r->res[i];
                break;
            }
        e->v[0]++;
        v->used = 1;
        memcpy(v->pk, peer_pk, HM_PK_BYTES);
        v->origin = o;
        r->n_res++;
        char id[HM_PEER_ID_LEN + 1];
        hm_peer_id_encode(peer_pk, id);
        hm_info(MOD, "relaying for %s", id);
    }
    v->expires_ms = now + r->cfg.reservation_ttl_ms;
    uint8_t buf[32];
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_map(&w, 1);
    hm_wire_wr_cstr(&w, "ttl_ms");
    hm_wire_wr_uint(&w, r->cfg.reservation_ttl_ms);
    hm_rpc_respond(req, 0, w.buf, w.len);
}

static void tick_cb(uv_timer_t *h)
{
    hm_relay *r = h->data;
    uint64_t now = now_ms();
    for (size_t i = 0; i < r->cfg.max_reservations; i++)
        if (r->res[i].used && r->res[i].expires_ms <= now)
            res_drop(r, &r->res[i]);
    int64_t refill = (int64_t)HM_MIN(r->cfg.rate * TICK_MS / 1000u + 1u, (uint64_t)INT64_MAX / 4);
    int64_t cap = (int64_t)HM_MIN(r->cfg.rate, (uint64_t)INT64_MAX / 4);
    circuit *c, *next;
    for (c = LIST_FIRST(&r->circuits); c != NULL; c = next) {
        next = LIST_NEXT(c, link);
        if (c->state == CIRC_PENDING && now - c->created_ms >= r->cfg.accept_timeout_ms) {
            r->accept_timeouts++;
            circ_close(c, "the relayed peer did not call back");
            continue;
        }
        if (now - c->created_ms >= r->cfg.circuit_lifetime_ms) {
            r->cut_lifetime++;
            circ_close(c, "over RelayCircuitLifetime");
            continue;
        }
        if (c->both_eof_ms != 0 && now - c->both_eof_ms >= CLOSE_DRAIN_MS) {
            circ_close(c, "both sides closed; the last writes did not drain in time");
            continue;
        }
        c->tokens = HM_MIN(c->tokens + refill, cap);
        if (c->paused_rate && c->tokens > 0) {
            c->paused_rate = 0;
            side_start(&c->a);
            side_start(&c->b);
        }
    }
}

/* ---------------------------------------------------------- using relays */

static void client_schedule(hm_relay *r, uint64_t ms);

static void via_str(const hm_relay *r, int i, char *buf, size_t len)
{
    char id[HM_PEER_ID_LEN + 1], a[HM_ADDRSTRLEN];
    buf[0] = '\0';
    if (i < 0 || (size_t)i >= r->cfg.n_via)
        return;
    hm_peer_id_encode(r->cfg.via[i].pk, id);
    if (hm_format_addr((const struct sockaddr *)&r->cfg.via[i].addr, a, sizeof(a)) != 0)
        hm_strlcpy(a, "?", sizeof(a));
    snprintf(buf, len, "%s@%s", id, a);
}

static int client_reserve(hm_relay *r);

static void reserve_cb(void *ud, int status, const uint8_t *body, size_t len)
{
    call_ctx *x = ud;
    hm_relay *r = x->r;
    r->calls--;
    uint64_t ttl = 0;
    int stale = r->stopped || !r->active || x->gen != r->gen;
    if (!stale && status == 0 && hm_relay_parse_reserve_reply(body, len, &ttl) < 0)
        status = -EPROTO;
    free(x);
    if (stale) {
        maybe_free(r);
        return;
    }
    char who[HM_RELAY_ADDR_LEN];
    via_str(r, r->via, who, sizeof(who));
    if (status == 0) {
        int changed = r->state != HM_RELAY_RESERVED;
        if (changed)
            hm_info(MOD, "reachable through the relay %s", who);
        r->state = HM_RELAY_RESERVED;
        r->tried = 0;
        r->backoff_ms = 0;
        snprintf(r->reason, sizeof(r->reason), "reserved with the relay %s", who);
        client_schedule(r, HM_MIN(r->cfg.refresh_ms, ttl / 2));
        /* Last: the callback may read our status (and declare the new address). */
        if (changed && r->notify != NULL)
            r->notify(r->notify_ud);
        return;
    }
    hm_warn(MOD, "the relay %s failed: %s", who, hm_strerror(status));
    r->gen++;
    r->tried++;
    if ((size_t)r->tried < r->cfg.n_via) {
        r->via = (int)(((size_t)r->via + 1) % r->cfg.n_via);
        r->failovers++;
        r->state = HM_RELAY_RESERVING;
        if (client_reserve(r) == 0)
            return;
    }
    /* Every relay failed in this round: say so, and start again after a while. */
    r->state = HM_RELAY_NONE;
    r->backoff_ms = r->backoff_ms == 0 ? r->cfg.retry_min_ms
                                       : HM_MIN(r->backoff_ms * 2, r->cfg.retry_max_ms);
    snprintf(r->reason, sizeof(r->reason),
             "no relay: all %zu %s relays failed (the last, %s: %s); retrying in %.1f s",
             r->cfg.n_via, r->configured ? "RelayVia" : "advertised", who, hm_strerror(status), (double)r->backoff_ms / 1000.0);
    hm_warn(MOD, "%s", r->reason);
    r->tried = 0;
    r->via = 0;
    client_schedule(r, r->backoff_ms);
    if (r->notify != NULL)
        r->notify(r->notify_ud);
}

/*
 * -- relay failover -- The connection to the relay we hold a reservation
 * with went away (the relay stopped, crashed or cut us off): refresh now
 * instead of at the next refresh, so a dead relay is left within a dial's
 * time, not refresh_ms later. A relay that keeps closing us is asked at
 * most once per retry_min_ms this way.
 */
static void on_conn_change(void *ud, const uint8_t pk[HM_PK_BYTES], int up)
{
    hm_relay *r = ud;
    if (up || r->stopped || !r->active || r->state != HM_RELAY_RESERVED || r->via < 0 ||
        (size_t)r->via >= r->cfg.n_via || memcmp(pk, r->cfg.via[r->via].pk, HM_PK_BYTES) != 0)
        return;
    uint64_t now = now_ms();
    uint64_t wait = r->lost_ms != 0 && now - r->lost_ms < r->cfg.retry_min_ms
                        ? r->cfg.retry_min_ms - (now - r->lost_ms)
                        : 0;
    r->lost_ms = now;
    char who[HM_RELAY_ADDR_LEN];
    via_str(r, r->via, who, sizeof(who));
    hm_info(MOD, "the connection to the relay %s went away: refreshing the reservation%s", who,
            wait > 0 ? " shortly" : " now");
    client_schedule(r, wait);
}

void hm_relay_set_notify(hm_relay *r, void (*cb)(void *ud), void *ud)
{
    r->notify = cb;
    r->notify_ud = ud;
}

static int client_reserve(hm_relay *r)
{
    call_ctx *x = calloc(1, sizeof(*x));
    if (x == NULL)
        return -ENOMEM;
    x->r = r;
    x->gen = r->gen;
    x->via = r->via;
    static const uint8_t empty_map = 0x80;
    const hm_relay_via *v = &r->cfg.via[r->via];
    int rc = hm_rpc_call(r->rpc, v->pk, (const struct sockaddr *)&v->addr, HM_RELAY_METHOD_RESERVE,
                         &empty_map, 1, HM_RPC_STREAM, CALL_TIMEOUT_MS, reserve_cb, x, NULL);
    if (rc < 0) {
        free(x);
        return rc;
    }
    r->calls++;
    return 0;
}

static void ctimer_cb(uv_timer_t *h)
{
    hm_relay *r = h->data;
    if (r->stopped || !r->active || r->cfg.n_via == 0)
        return;
    if (r->state != HM_RELAY_RESERVED)
        r->state = HM_RELAY_RESERVING;
    int rc = client_reserve(r);
    if (rc < 0) {
        snprintf(r->reason, sizeof(r->reason), "cannot ask the relay: %s", hm_strerror(rc));
        client_schedule(r, r->cfg.retry_min_ms);
    }
}

static void client_schedule(hm_relay *r, uint64_t ms)
{
    if (!r->stopped)
        uv_timer_start(&r->ctimer, ctimer_cb, ms, 0);
}

void hm_relay_client_set_active(hm_relay *r, int active)
{
    if (r->stopped || r->active == !!active)
        return;
    r->active = !!active;
    r->gen++;
    r->tried = 0;
    r->via = 0;
    r->backoff_ms = 0;
    uv_timer_stop(&r->ctimer);
    if (!r->active) {
        r->state = HM_RELAY_OFF;
        snprintf(r->reason, sizeof(r->reason), "not using a relay");
        return;
    }
    if (r->cfg.n_via == 0) {
        r->state = HM_RELAY_NONE;
        snprintf(r->reason, sizeof(r->reason),
                 "no relay: RelayVia names none, and none is advertised in the DHT (yet)");
        hm_warn(MOD, "nobody can dial this node and it has no relay (RelayVia names none); "
                "looking for relays advertised in the DHT");
        return;
    }
    r->state = HM_RELAY_RESERVING;
    snprintf(r->reason, sizeof(r->reason), "reserving with a relay");
    client_schedule(r, 0);
}

int hm_relay_client_active(const hm_relay *r) { return r->active; }
int hm_relay_configured(const hm_relay *r) { return r->configured; }

int hm_relay_set_found(hm_relay *r, const hm_relay_via *via, size_t n)
{
    if (r->stopped || r->configured || n == 0 ||
        (r->state != HM_RELAY_OFF && r->state != HM_RELAY_NONE))
        return 0;
    n = HM_MIN(n, (size_t)HM_RELAY_MAX_VIA);
    memcpy(r->cfg.via, via, n * sizeof(*via));
    r->cfg.n_via = n;
    r->via = 0;
    r->tried = 0;
    if (r->active && r->state == HM_RELAY_NONE) {
        r->gen++;
        uv_timer_stop(&r->ctimer);
        r->state = HM_RELAY_RESERVING;
        snprintf(r->reason, sizeof(r->reason), "reserving with a relay advertised in the DHT");
        client_schedule(r, 0);
    }
    return 1;
}

/*
 * The dialler's address named in relay.connect, when we take the relay's
 * word for it; NULL charges the circuit to the relay's own address. The
 * word is taken only from a relay the operator configured (RelayVia): one
 * found in the DHT is anybody's, and could spread its own circuits over
 * made-up origins. Even then an address more local than the relay's own
 * (loopback, private, link-local, where each address is an origin of its
 * own and loopback escapes the averaging's members-per-origin rule) is not
 * believed of a relay that is not itself there, nor one no peer could
 * dial from (0.0.0.0, ::, port 0: hm_addr_dialable).
 */
static const struct sockaddr *dialler_to_trust(hm_relay *r, const struct sockaddr_storage *d,
                                               const struct sockaddr *relay_sa)
{
    const struct sockaddr *sa = (const struct sockaddr *)d;
    if (d->ss_family == AF_UNSPEC)
        return NULL;
    if (!r->configured || hm_addr_dialable(d) < 0 ||
        (hm_origin_addr_is_local(sa) && !hm_origin_addr_is_local(relay_sa))) {
        r->dialler_not_taken++;
        return NULL;
    }
    return sa;
}

static void on_connect_request(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                               const struct sockaddr *from, const uint8_t *body, size_t len)
{
    hm_relay *r = ud;
    uint8_t token[HM_RELAY_TOKEN_BYTES], pre[HM_TRANSPORT_RELAY_PREAMBLE];
    struct sockaddr_storage dialler;
    HM_UNUSED(from);
    /* Only the relay we reserved with: nobody else makes us dial anything. */
    if (r->stopped || r->state != HM_RELAY_RESERVED || r->via < 0 ||
        memcmp(peer_pk, r->cfg.via[r->via].pk, HM_PK_BYTES) != 0) {
        hm_rpc_respond(req, -EPERM, NULL, 0);
        return;
    }
    if (hm_relay_parse_connect(body, len, token, &dialler) < 0) {
        hm_rpc_respond(req, -EPROTO, NULL, 0);
        return;
    }
    hm_relay_make_preamble(token, pre);
    const struct sockaddr *relay_sa = (const struct sockaddr *)&r->cfg.via[r->via].addr;
    int rc = hm_transport_accept_relayed(r->t, relay_sa, pre, sizeof(pre),
                                         dialler_to_trust(r, &dialler, relay_sa));
    if (rc == 0)
        r->accepts++;
    else if (rc == -EBUSY)
        r->refused_dialler_origin++;
    hm_rpc_respond(req, rc, NULL, 0);
}

/* ------------------------------------------------------------- lifecycle */

int hm_relay_new(uv_loop_t *loop, hm_rpc *rpc, const hm_identity *id, const hm_relay_config *cfg,
                 hm_relay **out)
{
    int result;
    hm_relay *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return -ENOMEM;
    r->loop = loop;
    r->rpc = rpc;
    r->t = hm_rpc_transport(rpc);
    hm_strlcpy(r->peer_id, id->peer_id, sizeof(r->peer_id));
    r->cfg = *cfg;
    hm_relay_config_defaults(&r->cfg);
    if (r->cfg.n_via > HM_RELAY_MAX_VIA) {
        free(r);
        return -EINVAL;
    }
    r->via = -1;
    r->configured = r->cfg.n_via > 0;
    LIST_INIT(&r->circuits);
    snprintf(r->reason, sizeof(r->reason), "not using a relay");
    if (r->cfg.serve) {
        r->res = calloc(r->cfg.max_reservations, sizeof(*r->res));
        if (r->res == NULL || hm_origin_tab_init(&r->res_origins, r->cfg.max_reservations) < 0) {
            result = -ENOMEM;
            goto fail;
        }
        if (hm_origin_tab_init(&r->circ_origins, r->cfg.max_circuits) < 0) {
            hm_origin_tab_free(&r->res_origins);
            result = -ENOMEM;
            goto fail;
        }
        r->tabs_init = 1;
        if ((result = hm_rpc_register(rpc, HM_RELAY_METHOD_RESERVE, on_reserve_request, r)) < 0)
            goto fail;
        hm_transport_set_divert(r->t, on_divert, r);
    }
    if ((result = hm_rpc_register(rpc, HM_RELAY_METHOD_CONNECT, on_connect_request, r)) < 0)
        goto fail;
    hm_rpc_set_conn_cb(rpc, on_conn_change, r); /* -- relay failover -- */
    uv_timer_init(loop, &r->tick);
    r->tick.data = r;
    uv_timer_init(loop, &r->ctimer);
    r->ctimer.data = r;
    r->handles = 2;
    if (r->cfg.serve)
        uv_timer_start(&r->tick, tick_cb, TICK_MS, TICK_MS);
    *out = r;
    return 0;
fail:
    if (r->cfg.serve) {
        hm_rpc_unregister(rpc, HM_RELAY_METHOD_RESERVE);
        hm_transport_set_divert(r->t, NULL, NULL);
    }
    if (r->tabs_init) {
        hm_origin_tab_free(&r->res_origins);
        hm_origin_tab_free(&r->circ_origins);
    }
    free(r->res);
    free(r);
    return result;
}

int hm_relay_declared(hm_relay *r, struct sockaddr_storage *out)
{
    if (r == NULL || r->stopped || r->state != HM_RELAY_RESERVED || r->via < 0)
        return -ENOENT;
    *out = r->cfg.via[r->via].addr;
    return 0;
}

void hm_relay_get_status(hm_relay *r, hm_relay_status *out)
{
    static const char *const names[] = {"off", "reserving", "reserved", "none"};
    memset(out, 0, sizeof(*out));
    out->state = r->state;
    out->state_name = names[r->state];
    out->via_index = r->state == HM_RELAY_OFF ? -1 : r->via;
    if (r->state == HM_RELAY_RESERVING || r->state == HM_RELAY_RESERVED)
        via_str(r, r->via, out->relay, sizeof(out->relay));
    if (r->state == HM_RELAY_RESERVED) {
        char a[HM_ADDRSTRLEN];
        if (hm_format_addr((const struct sockaddr *)&r->cfg.via[r->via].addr, a, sizeof(a)) == 0)
            snprintf(out->address, sizeof(out->address), "%s@%s", r->peer_id, a);
    }
    hm_strlcpy(out->reason, r->reason, sizeof(out->reason));
    out->failovers = r->failovers;
    out->accepts = r->accepts;
    out->refused_dialler_origin = r->refused_dialler_origin;
    out->dialler_not_taken = r->dialler_not_taken;
    out->serving = r->cfg.serve;
    out->reservations = r->n_res;
    out->circuits = r->n_circuits;
    out->circuits_total = r->circuits_total;
    out->bytes_relayed = r->bytes_relayed;
}

void hm_relay_limits(const hm_relay *r, hm_limit_emit_fn emit, void *ud)
{
    emit(ud, "RelayMaxReservations", r->refused_max_res);
    emit(ud, "RelayReservationsPerOrigin", r->refused_res_origin);
    emit(ud, "RelayMaxCircuits", r->refused_max_circ);
    emit(ud, "RelayCircuitsPerOrigin", r->refused_circ_origin);
    emit(ud, "RelayMaxMiB", r->cut_bytes);
    emit(ud, "RelayRate", r->throttled);
    emit(ud, "RelayCircuitLifetime", r->cut_lifetime);
}

static void timer_closed_cb(uv_handle_t *h)
{
    hm_relay *r = h->data;
    r->handles--;
    maybe_free(r);
}

void hm_relay_stop(hm_relay *r)
{
    if (r->stopped)
        return;
    r->stopped = 1;
    hm_rpc_set_conn_cb(r->rpc, NULL, NULL);
    r->notify = NULL;
    if (r->cfg.serve)
        hm_transport_set_divert(r->t, NULL, NULL);
    while (!LIST_EMPTY(&r->circuits))
        circ_close(LIST_FIRST(&r->circuits), "shutting down");
    uv_close((uv_handle_t *)&r->tick, timer_closed_cb);
    uv_close((uv_handle_t *)&r->ctimer, timer_closed_cb);
}

static void maybe_free(hm_relay *r)
{
    if (!r->freeing || r->handles > 0 || r->calls > 0)
        return;
    void (*cb)(void *) = r->free_cb;
    void *ud = r->free_ud;
    if (r->tabs_init) {
        hm_origin_tab_free(&r->res_origins);
        hm_origin_tab_free(&r->circ_origins);
    }
    free(r->res);
    free(r);
    if (cb != NULL)
        cb(ud);
}

void hm_relay_free(hm_relay *r, void (*cb)(void *ud), void *ud)
{
    hm_relay_stop(r);
    r->freeing = 1;
    r->free_cb = cb;
    r->free_ud = ud;
    maybe_free(r);
}

/*
 * rpc: request/response over the transport's datagrams and streams (see
 * rpc.h for the contract and the envelope format).
 *
 * It owns the transport (it is the transport's only set of callbacks), the
 * outbound calls (a hash table by id, a min-heap of deadlines driven by one
 * uv_timer), the inbound requests being served (a hash table by peer and id,
 * so that a cancel can find them), a small per-peer record of both counts,
 * and the per-method statistics table.
 *
 * Every outbound call ends exactly once, through call_finish: with the reply,
 * at its deadline, on cancel, when the stream it went out on dies
 * (-ECONNRESET), or at close (-ECANCELED). Inbound requests live until the
 * handler responds; when the rpc layer is closed first they are orphaned,
 * and the later respond only frees them.
 */
#include "config.h"

#include "src/net/rpc.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "src/base/hmap.h"
#include "src/base/util.h"
#include "src/base/wire.h"

#define MOD "rpc"

/* Initial and largest bucket counts of the tables. */
#define CALL_BUCKETS 1024u
#define REQ_BUCKETS 1024u
#define PEER_BUCKETS 256u
#define TABLE_BUCKETS_MAX 65536u
#define METHODS_MAX 256u
#define SERVING_TOTAL_MAX 65536u
/* Envelope bytes around the body: array, type, id, method, timeout, bin header. */
#define ENVELOPE_SLACK (1u + 1u + 9u + 2u + HM_RPC_METHOD_MAX + 9u + 5u + 16u)
/* Messages up to this size jump the queue ahead of bulk transfers. */
#define HIGH_PRIO_MAX (64u * 1024u)

enum { MSG_REQUEST = 0, MSG_RESPONSE = 1, MSG_CANCEL = 2, MSG_ONEWAY = 3 };

const double hm_rpc_latency_bounds_s[HM_RPC_LAT_BUCKETS] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
};

typedef struct method {
    hm_rpc_method_stats s;
    hm_rpc_handler h;
    void *ud;
} method;

typedef struct call call;

typedef struct rpeer {
    hm_hmap_node by_pk;
    uint8_t pk[HM_PK_BYTES];
    size_t inflight;
    size_t serving;
    LIST_HEAD(, call) calls; /* our calls to this peer, newest first */
} rpeer;

struct call {
    uint64_t id;
    hm_hmap_node by_id;
    LIST_ENTRY(call) plink; /* in peer->calls */
    rpeer *peer;
    unsigned flags;
    hm_rpc_cb cb;
    void *ud;
    uint64_t start_us;
    uint64_t deadline_ms;
    size_t heap_idx;
    method *m;
    struct sockaddr_storage to; /* datagram calls: where a cancel goes */
};

struct hm_rpc_req {
    hm_rpc *rpc; /* NULL once orphaned by hm_rpc_close */
    uint64_t id;
    hm_hmap_node by_key;
    LIST_ENTRY(hm_rpc_req) alink; /* in rpc->all_reqs */
    rpeer *peer;
    uint8_t pk[HM_PK_BYTES];
    uint8_t key[HM_PK_BYTES + 8]; /* pk, then id: both chosen by the caller */
    struct sockaddr_storage from;
    int via_stream;
    int cancelled;
    uint64_t deadline_ms;
    method *m;
};

struct hm_rpc {
    uv_loop_t *loop;
    hm_transport *t;
    hm_rpc_config cfg;
    size_t max_message;
    uv_timer_t timer;

    hm_hmap calls; /* call.by_id */
    call **heap;
    size_t heap_len, heap_cap;
    uint64_t next_id;

    /*
     * Peers and their requests are keyed by bytes the peers chose (their keys
     * and request ids), so these tables are hmaps under a secret hash key.
     */
    hm_hmap peers; /* rpeer.by_pk */
    hm_hmap reqs;  /* hm_rpc_req.by_key */
    LIST_HEAD(, hm_rpc_req) all_reqs;
    size_t n_serving;

    method *methods;
    size_t n_methods;

    hm_rpc_seen_cb seen_cb;
    void *seen_ud;
    hm_rpc_conn_cb conn_cb; /* -- relay failover -- */
    void *conn_ud;

    hm_rpc_oneway_handler oneway[HM_RPC_ONEWAY_CHANNELS];
    void *oneway_ud[HM_RPC_ONEWAY_CHANNELS];

    /* Refusal notices (hm_rpc_refusals). */
    uint64_t notices_sent, refused_requests, refused_replies;

    int closing;
    int pending_closes;
    void (*close_cb)(void *ud);
    void *close_ud;
};

/* ------------------------------------------------------------- helpers */

static int method_name_ok(const char *s, size_t len)
{
    if (len == 0 || len > HM_RPC_METHOD_MAX)
        return 0;
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)s[i] < 0x21 || (unsigned char)s[i] > 0x7e)
            return 0;
    return 1;
}

static method *method_find(hm_rpc *rpc, const char *name, size_t len)
{
    for (size_t i = 0; i < rpc->n_methods; i++) {
        method *m = &rpc->methods[i];
        if (strlen(m->s.method) == len && memcmp(m->s.method, name, len) == 0)
            return m;
    }
    return NULL;
}

/* Finds or adds a method entry; NULL when the table is full. */
static method *method_get(hm_rpc *rpc, const char *name, size_t len)
{
    method *m = method_find(rpc, name, len);
    if (m != NULL || rpc->n_methods >= METHODS_MAX)
        return m;
    m = &rpc->methods[rpc->n_methods++];
    memset(m, 0, sizeof(*m));
    memcpy(m->s.method, name, len);
    m->s.method[len] = '\0';
    return m;
}

static rpeer *peer_find(hm_rpc *rpc, const uint8_t pk[HM_PK_BYTES])
{
    return hm_hmap_entry(hm_hmap_find(&rpc->peers, pk, HM_PK_BYTES), rpeer, by_pk);
}

static rpeer *peer_get(hm_rpc *rpc, const uint8_t pk[HM_PK_BYTES])
{
    rpeer *p = peer_find(rpc, pk);
    if (p != NULL)
        return p;
    p = calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    memcpy(p->pk, pk, HM_PK_BYTES);
    LIST_INIT(&p->calls);
    hm_hmap_insert(&rpc->peers, &p->by_pk, p->pk, HM_PK_BYTES);
    return p;
}

static void peer_release(hm_rpc *rpc, rpeer *p)
{
    if (p->inflight > 0 || p->serving > 0 || !LIST_EMPTY(&p->calls))
        return;
    hm_hmap_remove(&rpc->peers, &p->by_pk);
    free(p);
}

/* ---------------------------------------------------- deadline min-heap */

static void heap_swap(hm_rpc *rpc, size_t a, size_t b)
{
    call *x = rpc->heap[a];
    rpc->heap[a] = rpc->heap[b];
    rpc->heap[b] = x;
    rpc->heap[a]->heap_idx = a;
    rpc->heap[b]->heap_idx = b;
}

static void heap_up(hm_rpc *rpc, size_t i)
{
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (rpc->heap[p]->deadline_ms <= rpc->heap[i]->deadline_ms)
            break;
        heap_swap(rpc, p, i);
        i = p;
    }
}

static void heap_down(hm_rpc *rpc, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < rpc->heap_len && rpc->heap[l]->deadline_ms < rpc->heap[m]->deadline_ms)
            m = l;
        if (r < rpc->heap_len && rpc->heap[r]->deadline_ms < rpc->heap[m]->deadline_ms)
            m = r;
        if (m == i)
            break;
        heap_swap(rpc, i, m);
        i = m;
    }
}

static int heap_push(hm_rpc *rpc, call *c)
{
    if (rpc->heap_len == rpc->heap_cap) {
        size_t ncap = rpc->heap_cap ? rpc->heap_cap * 2 : 64;
        call **nh = realloc(rpc->heap, ncap * sizeof(*nh));
        if (nh == NULL)
            return -ENOMEM;
        rpc->heap = nh;
        rpc->heap_cap = ncap;
    }
    c->heap_idx = rpc->heap_len;
    rpc->heap[rpc->heap_len++] = c;
    heap_up(rpc, c->heap_idx);
    return 0;
}

static void heap_remove(hm_rpc *rpc, call *c)
{
    size_t i = c->heap_idx;
    rpc->heap_len--;
    if (i != rpc->heap_len) {
        rpc->heap[i] = rpc->heap[rpc->heap_len];
        rpc->heap[i]->heap_idx = i;
        heap_down(rpc, i);
        heap_up(rpc, i);
    }
}

static void timer_cb(uv_timer_t *h);

static void arm_timer(hm_rpc *rpc)
{
    if (rpc->closing)
        return;
    if (rpc->heap_len == 0) {
        uv_timer_stop(&rpc->timer);
        return;
    }
    uint64_t now = hm_now_ms();
    uint64_t due = rpc->heap[0]->deadline_ms;
    uv_timer_start(&rpc->timer, timer_cb, due > now ? due - now : 0, 0);
}

/* ---------------------------------------------------------------- calls */

static call *call_find(hm_rpc *rpc, uint64_t id)
{
    return hm_hmap_entry(hm_hmap_find(&rpc->calls, &id, sizeof(id)), call, by_id);
}

static void call_unlink(hm_rpc *rpc, call *c)
{
    hm_hmap_remove(&rpc->calls, &c->by_id);
    heap_remove(rpc, c);
    LIST_REMOVE(c, plink);
    c->peer->inflight--;
    peer_release(rpc, c->peer);
}

static void count_result(method *m, int status, uint64_t start_us)
{
    if (m == NULL)
        return;
    if (status == 0) {
        double s = (double)(hm_now_us() - start_us) / 1e6;
        size_t b = 0;
        while (b < HM_RPC_LAT_BUCKETS && s > hm_rpc_latency_bounds_s[b])
            b++;
        m->s.ok++;
        m->s.lat_buckets[b]++;
        m->s.lat_sum_s += s;
    } else if (status == -ETIMEDOUT) {
        m->s.timeout++;
    } else if (status == -ECANCELED) {
        m->s.cancelled++;
    } else {
        m->s.error++;
    }
}

/* Ends a call: takes it out of every table, then fires its callback once. */
static void call_finish(hm_rpc *rpc, call *c, int status, const uint8_t *body, size_t len)
{
    call_unlink(rpc, c);
    count_result(c->m, status, c->start_us);
    hm_rpc_cb cb = c->cb;
    void *ud = c->ud;
    free(c);
    arm_timer(rpc);
    cb(ud, status, body, len);
}

static void send_cancel(hm_rpc *rpc, call *c)
{
    uint8_t buf[32];
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_array(&w, 2);
    hm_wire_wr_uint(&w, MSG_CANCEL);
    hm_wire_wr_uint(&w, c->id);
    if (hm_wire_wr_error(&w) < 0)
        return;
    /* Best effort: the caller has already given up either way. */
    if (c->flags == HM_RPC_STREAM)
        (void)hm_transport_send(rpc->t, c->peer->pk, NULL, buf, w.len, HM_PRIO_HIGH);
    else
        (void)hm_transport_send_dgram(rpc->t, c->peer->pk, (const struct sockaddr *)&c->to, buf,
                                      w.len);
}

static void timer_cb(uv_timer_t *h)
{
    hm_rpc *rpc = h->data;
    uint64_t now = hm_now_ms();
    while (!rpc->closing && rpc->heap_len > 0 && rpc->heap[0]->deadline_ms <= now) {
        call *c = rpc->heap[0];
        send_cancel(rpc, c);
        call_finish(rpc, c, -ETIMEDOUT, NULL, 0);
    }
    arm_timer(rpc);
}

/* The bytes of a body given in pieces; SIZE_MAX when a piece is NULL with bytes. */
static size_t body_len(const uv_buf_t *body, unsigned n)
{
    size_t len = 0;
    for (unsigned i = 0; i < n; i++) {
        if (body[i].base == NULL && body[i].len > 0)
            return SIZE_MAX;
        len += body[i].len;
    }
    return len;
}

/* Appends a body's pieces to a datagram's envelope, after its bin header. */
static void wr_body(hm_wire_wr *w, const uv_buf_t *body, unsigned n, size_t len)
{
    hm_wire_wr_bin_header(w, len);
    for (unsigned i = 0; i < n; i++)
        if (body[i].len > 0)
            hm_wire_wr_raw(w, body[i].base, body[i].len);
}

/* The envelope, then the body's pieces, all uncopied: the transport copies them once. */
static int stream_send(hm_rpc *rpc, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                       const uint8_t *env, size_t env_len, const uv_buf_t *body, unsigned n,
                       size_t len, hm_tx_ref *ref, unsigned held)
{
    uv_buf_t parts[1 + HM_RPC_BODY_PIECES];
    parts[0] = uv_buf_init((char *)env, (unsigned)env_len);
    for (unsigned i = 0; i < n; i++)
        parts[1 + i] = body[i];
    return hm_transport_sendv_ref(rpc->t, pk, to, parts, 1 + n,
                                  env_len + len <= HIGH_PRIO_MAX ? HM_PRIO_HIGH : HM_PRIO_LOW,
                                  held < n ? ref : NULL, 1 + held);
}

int hm_rpc_call(hm_rpc *rpc, const uint8_t peer_pk[HM_PK_BYTES], const struct sockaddr *to,
                const char *method_name, const void *body, size_t len, unsigned flags,
                uint64_t timeout_ms, hm_rpc_cb cb, void *ud, uint64_t *call_id_out)
{
    if (body == NULL && len > 0)
        return -EINVAL;
    if (len > UINT32_MAX)
        return -EMSGSIZE;
    uv_buf_t b = uv_buf_init((char *)body, (unsigned)len);
    return hm_rpc_callv(rpc, peer_pk, to, method_name, &b, 1, NULL, 0, flags, timeout_ms, cb, ud,
                        call_id_out);
}

int hm_rpc_callv(hm_rpc *rpc, const uint8_t peer_pk[HM_PK_BYTES], const struct sockaddr *to,
                 const char *method_name, const uv_buf_t *body, unsigned nbody, hm_tx_ref *ref,
                 unsigned held, unsigned flags,
                 uint64_t timeout_ms, hm_rpc_cb cb, void *ud, uint64_t *call_id_out)
{
    int result = 0;
    uint8_t dbuf[HM_DGRAM_MAX_PAYLOAD];
    call *c = NULL;
    rpeer *p = NULL;
    hm_wire_wr w;

    if (rpc->closing)
        return -ECANCELED;
    if (nbody > HM_RPC_BODY_PIECES || (body == NULL && nbody > 0))
        return -EINVAL;
    size_t len = body_len(body, nbody);
    if (method_name == NULL || cb == NULL || timeout_ms == 0 || len == SIZE_MAX)
        return -EINVAL;
    size_t mlen = strnlen(method_name, HM_RPC_METHOD_MAX + 1);
    if (!method_name_ok(method_name, mlen))
        return -EINVAL;
    if (flags != HM_RPC_DGRAM && flags != HM_RPC_STREAM)
        return -EINVAL;
    if (flags == HM_RPC_DGRAM && to == NULL)
        return -EINVAL;
    if (flags == HM_RPC_STREAM && len > rpc->max_message - ENVELOPE_SLACK)
        return -EMSGSIZE;

    p = peer_get(rpc, peer_pk);
    if (p == NULL)
        return -ENOMEM;
    if (p->inflight >= rpc->cfg.max_inflight_per_peer) {
        result = -ENOBUFS;
        goto out;
    }

    uint64_t id = rpc->next_id++;
    /* A stream envelope is written up to the bin header; the body follows it uncopied. */
    hm_wire_wr_init_fixed(&w, dbuf, sizeof(dbuf));
    hm_wire_wr_array(&w, 5);
    hm_wire_wr_uint(&w, MSG_REQUEST);
    hm_wire_wr_uint(&w, id);
    hm_wire_wr_str(&w, method_name, mlen);
    hm_wire_wr_uint(&w, timeout_ms);
    if (flags == HM_RPC_DGRAM)
        wr_body(&w, body, nbody, len);
    else
        hm_wire_wr_bin_header(&w, len);
    if ((result = hm_wire_wr_error(&w)) < 0)
        goto out;

    c = calloc(1, sizeof(*c));
    if (c == NULL) {
        result = -ENOMEM;
        goto out;
    }
    c->id = id;
    c->flags = flags;
    c->cb = cb;
    c->ud = ud;
    c->peer = p;
    c->start_us = hm_now_us();
    c->deadline_ms = hm_now_ms() + timeout_ms;
    if (to != NULL)
        memcpy(&c->to, to, hm_addr_len(to));
    if ((result = heap_push(rpc, c)) < 0)
        goto out;

    if (flags == HM_RPC_DGRAM) {
        result = hm_transport_send_dgram(rpc->t, peer_pk, to, dbuf, w.len);
    } else {
        result = stream_send(rpc, peer_pk, to, dbuf, w.len, body, nbody, len, ref, held);
    }
    if (result < 0) {
        heap_remove(rpc, c);
        goto out;
    }

    /* Registered only once sent, so a failed call leaves no trace. */
    hm_hmap_insert(&rpc->calls, &c->by_id, &c->id, sizeof(c->id));
    LIST_INSERT_HEAD(&p->calls, c, plink);
    p->inflight++;
    c->m = method_get(rpc, method_name, mlen);
    c = NULL;
    arm_timer(rpc);
    if (call_id_out != NULL)
        *call_id_out = id;

out:
    free(c);
    if (p != NULL)
        peer_release(rpc, p);
    return result;
}

int hm_rpc_cancel(hm_rpc *rpc, uint64_t call_id)
{
    call *c = call_find(rpc, call_id);
    if (c == NULL)
        return -ENOENT;
    send_cancel(rpc, c);
    call_finish(rpc, c, -ECANCELED, NULL, 0);
    return 0;
}

/* -------------------------------------------------------- inbound requests */

static void req_key(const uint8_t pk[HM_PK_BYTES], uint64_t id, uint8_t key[HM_PK_BYTES + 8])
{
    memcpy(key, pk, HM_PK_BYTES);
    memcpy(key + HM_PK_BYTES, &id, sizeof(id));
}

static hm_rpc_req *req_find(hm_rpc *rpc, const uint8_t pk[HM_PK_BYTES], uint64_t id)
{
    uint8_t key[HM_PK_BYTES + 8];
    req_key(pk, id, key);
    return hm_hmap_entry(hm_hmap_find(&rpc->reqs, key, sizeof(key)), hm_rpc_req, by_key);
}

static void req_unlink(hm_rpc *rpc, hm_rpc_req *r)
{
    hm_hmap_remove(&rpc->reqs, &r->by_key);
    LIST_REMOVE(r, alink);
    r->peer->serving--;
    rpc->n_serving--;
    peer_release(rpc, r->peer);
}

/*
 * Tells pk at once that its call id was refused by one of our limits (a
 * write queue full for its reply, or reassembly refusing its request): a
 * reply of status -ENOBUFS and no body, sent as a refusal notice, which has
 * its own small allowance in the write queues (HM_PRIO_NOTICE), so the
 * caller fails now instead of at its deadline. A notice is never larger
 * than what it answers, so it amplifies nothing.
 */
static void send_notice(hm_rpc *rpc, const uint8_t pk[HM_PK_BYTES], uint64_t id)
{
    uint8_t buf[HM_TRANSPORT_NOTICE_MAX];
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_array(&w, 4);
    hm_wire_wr_uint(&w, MSG_RESPONSE);
    hm_wire_wr_uint(&w, id);
    hm_wire_wr_int(&w, -ENOBUFS);
    hm_wire_wr_bin(&w, NULL, 0);
    if (hm_wire_wr_error(&w) == 0 &&
        hm_transport_send(rpc->t, pk, NULL, buf, w.len, HM_PRIO_NOTICE) == 0)
        rpc->notices_sent++;
}

static int send_reply(hm_rpc *rpc, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                      int via_stream, uint64_t id, int status, const uv_buf_t *body, unsigned n,
                      size_t len, hm_tx_ref *ref, unsigned held)
{
    uint8_t buf[HM_DGRAM_MAX_PAYLOAD];
    hm_wire_wr w;

    if (via_stream && len > rpc->max_message - ENVELOPE_SLACK) {
        /* Tell the caller the reply was too big instead of going silent. */
        (void)send_reply(rpc, pk, from, via_stream, id, -EMSGSIZE, NULL, 0, 0, NULL, 0);
        return -EMSGSIZE;
    }
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_array(&w, 4);
    hm_wire_wr_uint(&w, MSG_RESPONSE);
    hm_wire_wr_uint(&w, id);
    hm_wire_wr_int(&w, status);
    if (via_stream) {
        hm_wire_wr_bin_header(&w, len);
        if (hm_wire_wr_error(&w) < 0)
            return -EMSGSIZE;
        int r = stream_send(rpc, pk, NULL, buf, w.len, body, n, len, ref, held);
        /* A reply our write queues refuse is not silent: the caller hears so now. */
        if (r == -ENOBUFS)
            send_notice(rpc, pk, id);
        return r;
    }
    wr_body(&w, body, n, len);
    if (hm_wire_wr_error(&w) < 0) {
        /* The reply does not fit a datagram: tell the caller so instead of going silent. */
        hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
        hm_wire_wr_array(&w, 4);
        hm_wire_wr_uint(&w, MSG_RESPONSE);
        hm_wire_wr_uint(&w, id);
        hm_wire_wr_int(&w, -EMSGSIZE);
        hm_wire_wr_bin(&w, NULL, 0);
        if (hm_wire_wr_error(&w) == 0)
            (void)hm_transport_send_dgram(rpc->t, pk, from, buf, w.len);
        return -EMSGSIZE;
    }
    return hm_transport_send_dgram(rpc->t, pk, from, buf, w.len);
}

int hm_rpc_respond(hm_rpc_req *req, int status, const void *body, size_t len)
{
    if (body == NULL)
        len = 0;
    if (len > UINT32_MAX) {
        /* Answered, as any reply too big for the stream is. */
        uv_buf_t none = uv_buf_init(NULL, 0);
        (void)hm_rpc_respondv(req, -EMSGSIZE, &none, 0, NULL, 0);
        return -EMSGSIZE;
    }
    uv_buf_t b = uv_buf_init((char *)body, (unsigned)len);
    return hm_rpc_respondv(req, status, &b, 1, NULL, 0);
}

int hm_rpc_respondv(hm_rpc_req *req, int status, const uv_buf_t *body, unsigned nbody,
                    hm_tx_ref *ref, unsigned held)
{
    int result = 0;
    hm_rpc *rpc = req->rpc;

    if (rpc == NULL) {
        free(req);
        return -ECANCELED;
    }
    size_t len = nbody <= HM_RPC_BODY_PIECES && (body != NULL || nbody == 0)
                     ? body_len(body, nbody)
                     : SIZE_MAX;
    int bad = len == SIZE_MAX;
    if (bad) {
        /* A caller's mistake: the peer still hears of it, not silence. */
        status = -EINVAL;
        nbody = 0;
        len = 0;
    }
    req_unlink(rpc, req);
    if (req->m != NULL)
        req->m->s.served++;
    if (status > 0)
        status = -EINVAL;
    if (req->cancelled)
        result = -ECANCELED;
    else if (hm_now_ms() > req->deadline_ms)
        result = -ETIMEDOUT;
    else
        result = send_reply(rpc, req->pk, (const struct sockaddr *)&req->from, req->via_stream,
                            req->id, status, body, nbody, len, bad ? NULL : ref, held);
    free(req);
    return bad ? -EINVAL : result;
}

int hm_rpc_req_cancelled(const hm_rpc_req *req)
{
    return req->rpc == NULL || req->cancelled || hm_now_ms() > req->deadline_ms;
}

static void handle_request(hm_rpc *rpc, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                           int via_stream, uint64_t id, const char *name, uint32_t nlen,
                           uint64_t timeout_ms, const uint8_t *body, size_t blen)
{
    if (!method_name_ok(name, nlen)) {
        (void)send_reply(rpc, pk, from, via_stream, id, -EINVAL, NULL, 0, 0, NULL, 0);
        return;
    }
    /* A duplicate of a request still being served is dropped. */
    if (req_find(rpc, pk, id) != NULL)
        return;
    method *m = method_find(rpc, name, nlen);
    if (m == NULL || m->h == NULL) {
        (void)send_reply(rpc, pk, from, via_stream, id, -ENOSYS, NULL, 0, 0, NULL, 0);
        return;
    }
    rpeer *p = peer_get(rpc, pk);
    if (p == NULL)
        return;
    if (p->serving >= rpc->cfg.max_serving_per_peer || rpc->n_serving >= SERVING_TOTAL_MAX) {
        peer_release(rpc, p);
        (void)send_reply(rpc, pk, from, via_stream, id, -ENOBUFS, NULL, 0, 0, NULL, 0);
        return;
    }
    hm_rpc_req *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        peer_release(rpc, p);
        return;
    }
    if (timeout_ms == 0 || timeout_ms > rpc->cfg.max_timeout_ms)
        timeout_ms = rpc->cfg.max_timeout_ms;
    r->rpc = rpc;
    r->id = id;
    r->peer = p;
    memcpy(r->pk, pk, HM_PK_BYTES);
    memcpy(&r->from, from, hm_addr_len(from));
    r->via_stream = via_stream;
    r->deadline_ms = hm_now_ms() + timeout_ms;
    r->m = m;
    req_key(pk, id, r->key);
    hm_hmap_insert(&rpc->reqs, &r->by_key, r->key, sizeof(r->key));
    LIST_INSERT_HEAD(&rpc->all_reqs, r, alink);
    p->serving++;
    rpc->n_serving++;
    m->h(m->ud, r, pk, from, body, blen);
}

static void handle_response(hm_rpc *rpc, const uint8_t pk[HM_PK_BYTES], uint64_t id, int64_t status,
                            const uint8_t *body, size_t blen)
{
    call *c = call_find(rpc, id);
    /* Only the peer that was asked may answer. */
    if (c == NULL || memcmp(c->peer->pk, pk, HM_PK_BYTES) != 0) {
        hm_debug(MOD, "dropping a reply to unknown call %llu", (unsigned long long)id);
        return;
    }
    if (status > 0 || status < -4095)
        status = -EPROTO;
    call_finish(rpc, c, (int)status, body, blen);
}

static void rpc_input(hm_rpc *rpc, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                      const uint8_t *msg, size_t len, int via_stream)
{
    hm_wire_msg m;
    const msgpack_object *it;
    uint32_t n;
    uint64_t type, id;
    hm_wire_limits lim = {
        .max_size = via_stream ? rpc->max_message : HM_DGRAM_MAX_PAYLOAD,
        .max_depth = 1,
        .max_elements = 8,
    };

    if (rpc->closing)
        return;
    if (rpc->seen_cb != NULL) {
        rpc->seen_cb(rpc->seen_ud, pk, from, via_stream);
        if (rpc->closing)
            return;
    }
    if (hm_wire_decode_open_array(&m, msg, len, &lim, 2, 5, HM_WIRE_ANY_VERSION) < 0 ||
        hm_wire_get_uint(&m.items[0], &type) < 0 || hm_wire_get_uint(&m.items[1], &id) < 0) {
        hm_debug(MOD, "dropping a malformed envelope (%zu bytes)", len);
        goto out;
    }
    it = m.items;
    n = m.n;
    if (type == MSG_REQUEST && n == 5) {
        const char *name;
        uint32_t nlen, blen;
        uint64_t timeout;
        const uint8_t *body;
        if (hm_wire_get_str(&it[2], &name, &nlen) < 0 || hm_wire_get_uint(&it[3], &timeout) < 0 ||
            hm_wire_get_bin(&it[4], &body, &blen) < 0)
            goto out;
        handle_request(rpc, pk, from, via_stream, id, name, nlen, timeout, body, blen);
    } else if (type == MSG_RESPONSE && n == 4) {
        int64_t status;
        uint32_t blen;
        const uint8_t *body;
        if (hm_wire_get_int(&it[2], &status) < 0 || hm_wire_get_bin(&it[3], &body, &blen) < 0)
            goto out;
        handle_response(rpc, pk, id, status, body, blen);
    } else if (type == MSG_ONEWAY && n == 3 && !via_stream) {
        /* it[1] is the channel for one-way datagrams. */
        uint32_t blen;
        const uint8_t *body;
        if (id >= HM_RPC_ONEWAY_CHANNELS || rpc->oneway[id] == NULL ||
            hm_wire_get_bin(&it[2], &body, &blen) < 0)
            goto out;
        rpc->oneway[id](rpc->oneway_ud[id], pk, from, body, blen);
    } else if (type == MSG_CANCEL && n == 2) {
        hm_rpc_req *r = req_find(rpc, pk, id);
        if (r != NULL)
            r->cancelled = 1;
    } else {
        hm_debug(MOD, "dropping an envelope of unknown type %llu", (unsigned long long)type);
    }
out:
    hm_wire_decode_close(&m);
}

static void on_dgram(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                     const uint8_t *msg, size_t len)
{
    rpc_input(ud, pk, from, msg, len, 0);
}

static void on_message(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                       const uint8_t *msg, size_t len)
{
    rpc_input(ud, pk, from, msg, len, 1);
}

/*
 * The last stream to a peer went away: what was sent over it will never be
 * answered, so stream calls fail now rather than at their deadlines, and
 * requests that came over it can no longer be answered.
 */
/* A msgpack unsigned integer at *p (n bytes left); 0 or -EPROTO. */
static int head_uint(const uint8_t **p, size_t *n, uint64_t *out)
{
    size_t w;
    if (*n < 1)
        return -EPROTO;
    uint8_t b = **p;
    if (b <= 0x7f) {
        *out = b;
        (*p)++;
        (*n)--;
        return 0;
    }
    w = b == 0xcc ? 1 : b == 0xcd ? 2 : b == 0xce ? 4 : b == 0xcf ? 8 : 0;
    if (w == 0 || *n < 1 + w)
        return -EPROTO;
    uint64_t v = 0;
    for (size_t i = 0; i < w; i++)
        v = v << 8 | (*p)[1 + i];
    *out = v;
    *p += 1 + w;
    *n -= 1 + w;
    return 0;
}

int hm_rpc_parse_head(const uint8_t *head, size_t len, uint64_t *type, uint64_t *id)
{
    if (len < 1)
        return -EPROTO;
    if ((head[0] & 0xf0) == 0x90 && head[0] != 0x90) {
        head++;
        len--;
    } else if (head[0] == 0xdc && len >= 3) {
        head += 3;
        len -= 3;
    } else {
        return -EPROTO;
    }
    if (head_uint(&head, &len, type) < 0 || head_uint(&head, &len, id) < 0)
        return -EPROTO;
    return 0;
}

/*
 * The transport refused an inbound message from pk for lack of room; head
 * is its start, the envelope [type, id, ...]. A refused request is answered
 * with a notice at once; a refused reply ends our own call now: either way
 * nobody waits for a deadline that nothing will meet.
 */
static void on_refused(void *ud, const uint8_t pk[HM_PK_BYTES], const uint8_t *head, size_t len)
{
    hm_rpc *rpc = ud;
    uint64_t type, id;
    if (rpc->closing || hm_rpc_parse_head(head, len, &type, &id) < 0)
        return;
    if (type == MSG_REQUEST) {
        rpc->refused_requests++;
        send_notice(rpc, pk, id);
    } else if (type == MSG_RESPONSE) {
        call *c = call_find(rpc, id);
        if (c != NULL && memcmp(c->peer->pk, pk, HM_PK_BYTES) == 0) {
            rpc->refused_replies++;
            call_finish(rpc, c, -ENOBUFS, NULL, 0);
        }
    }
}

static void on_conn_down(hm_rpc *rpc, const uint8_t pk[HM_PK_BYTES])
{
    hm_rpc_req *r;
    LIST_FOREACH(r, &rpc->all_reqs, alink)
        if (r->via_stream && memcmp(r->pk, pk, HM_PK_BYTES) == 0)
            r->cancelled = 1;
    /* Calls made from the callbacks below went out on a new connection: spare them. */
    uint64_t watermark = rpc->next_id;
    for (;;) {
        if (rpc->closing)
            return;
        rpeer *p = peer_find(rpc, pk);
        if (p == NULL)
            return;
        call *c;
        LIST_FOREACH(c, &p->calls, plink)
            if (c->flags == HM_RPC_STREAM && c->id < watermark)
                break;
        if (c == NULL)
            return;
        call_finish(rpc, c, -ECONNRESET, NULL, 0);
    }
}

static void on_conn(void *ud, const uint8_t pk[HM_PK_BYTES], int up)
{
    hm_rpc *rpc = ud;
    if (rpc->closing)
        return;
    if (up) {
        if (rpc->conn_cb != NULL)
            rpc->conn_cb(rpc->conn_ud, pk, 1);
        return;
    }
    on_conn_down(rpc, pk);
    if (!rpc->closing && rpc->conn_cb != NULL)
        rpc->conn_cb(rpc->conn_ud, pk, 0);
}

/* ----------------------------------------------------------- lifecycle */

int hm_rpc_new(uv_loop_t *loop, const hm_identity *id, const uint8_t swarm_id[HM_SWARM_ID_BYTES],
               const hm_transport_config *tcfg, const hm_rpc_config *rcfg, hm_rpc **out)
{
    int result = 0;
    hm_rpc *rpc = NULL;
    hm_transport_config tc;
    hm_transport_cbs cbs = {.on_dgram = on_dgram, .on_message = on_message, .on_conn = on_conn,
                            .on_refused = on_refused};

    *out = NULL;
    memset(&tc, 0, sizeof(tc));
    if (tcfg != NULL)
        tc = *tcfg;
    hm_transport_config_defaults(&tc);
    rpc = calloc(1, sizeof(*rpc));
    if (rpc == NULL)
        return -ENOMEM;
    LIST_INIT(&rpc->all_reqs);
    rpc->methods = calloc(METHODS_MAX, sizeof(*rpc->methods));
    if (rpc->methods == NULL) {
        result = -ENOMEM;
        goto out;
    }
    if ((result = hm_hmap_init(&rpc->calls, CALL_BUCKETS, TABLE_BUCKETS_MAX)) < 0 ||
        (result = hm_hmap_init(&rpc->peers, PEER_BUCKETS, TABLE_BUCKETS_MAX)) < 0 ||
        (result = hm_hmap_init(&rpc->reqs, REQ_BUCKETS, TABLE_BUCKETS_MAX)) < 0)
        goto out;
    rpc->loop = loop;
    if (rcfg != NULL)
        rpc->cfg = *rcfg;
    if (rpc->cfg.max_inflight_per_peer == 0)
        rpc->cfg.max_inflight_per_peer = 256;
    if (rpc->cfg.max_serving_per_peer == 0)
        rpc->cfg.max_serving_per_peer = 64;
    if (rpc->cfg.max_timeout_ms == 0)
        rpc->cfg.max_timeout_ms = 600000;
    rpc->max_message = tc.max_message;
    if (rpc->max_message <= ENVELOPE_SLACK) {
        result = -EINVAL;
        goto out;
    }
    /* Random first id: ids of a restarted caller do not collide with its old ones. */
    randombytes_buf(&rpc->next_id, sizeof(rpc->next_id));
    rpc->next_id = (rpc->next_id >> 2) + 1;
    result = hm_transport_new(loop, id, swarm_id, &tc, &cbs, rpc, &rpc->t);
    if (result < 0)
        goto out;
    uv_timer_init(loop, &rpc->timer);
    rpc->timer.data = rpc;
    *out = rpc;
    rpc = NULL;
out:
    if (rpc != NULL) {
        free(rpc->methods);
        hm_hmap_free(&rpc->calls);
        hm_hmap_free(&rpc->peers);
        hm_hmap_free(&rpc->reqs);
        free(rpc);
    }
    return result;
}

hm_transport *hm_rpc_transport(hm_rpc *rpc) { return rpc->t; }

void hm_rpc_set_seen_cb(hm_rpc *rpc, hm_rpc_seen_cb cb, void *ud)
{
    rpc->seen_cb = cb;
    rpc->seen_ud = ud;
}

void hm_rpc_set_conn_cb(hm_rpc *rpc, hm_rpc_conn_cb cb, void *ud)
{
    rpc->conn_cb = cb;
    rpc->conn_ud = ud;
}

int hm_rpc_register(hm_rpc *rpc, const char *method_name, hm_rpc_handler h, void *ud)
{
    if (method_name == NULL || h == NULL)
        return -EINVAL;
    size_t len = strnlen(method_name, HM_RPC_METHOD_MAX + 1);
    if (!method_name_ok(method_name, len))
        return -EINVAL;
    method *m = method_get(rpc, method_name, len);
    if (m == NULL)
        return -ENOBUFS;
    if (m->h != NULL)
        return -EEXIST;
    m->h = h;
    m->ud = ud;
    return 0;
}

int hm_rpc_unregister(hm_rpc *rpc, const char *method_name)
{
    if (method_name == NULL)
        return -EINVAL;
    size_t len = strnlen(method_name, HM_RPC_METHOD_MAX + 1);
    method *m = method_find(rpc, method_name, len);
    if (m == NULL || m->h == NULL)
        return -ENOENT;
    m->h = NULL;
    m->ud = NULL;
    return 0;
}

int hm_rpc_register_oneway(hm_rpc *rpc, unsigned channel, hm_rpc_oneway_handler h, void *ud)
{
    if (channel >= HM_RPC_ONEWAY_CHANNELS || h == NULL)
        return -EINVAL;
    if (rpc->oneway[channel] != NULL)
        return -EEXIST;
    rpc->oneway[channel] = h;
    rpc->oneway_ud[channel] = ud;
    return 0;
}

int hm_rpc_send_oneway(hm_rpc *rpc, const uint8_t peer_pk[HM_PK_BYTES], const struct sockaddr *to,
                       unsigned channel, const void *body, size_t len)
{
    uint8_t buf[HM_DGRAM_MAX_PAYLOAD];
    hm_wire_wr w;
    if (rpc->closing)
        return -ECANCELED;
    if (channel >= HM_RPC_ONEWAY_CHANNELS || to == NULL)
        return -EINVAL;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_array(&w, 3);
    hm_wire_wr_uint(&w, MSG_ONEWAY);
    hm_wire_wr_uint(&w, channel);
    hm_wire_wr_bin(&w, body, len);
    if (hm_wire_wr_error(&w) != 0)
        return -EMSGSIZE;
    return hm_transport_send_dgram(rpc->t, peer_pk, to, buf, w.len);
}

void hm_rpc_refusals(const hm_rpc *rpc, hm_rpc_refusal_stats *out)
{
    out->notices_sent = rpc->notices_sent;
    out->refused_requests = rpc->refused_requests;
    out->refused_replies = rpc->refused_replies;
}

void hm_rpc_foreach_stats(hm_rpc *rpc, void (*fn)(void *ud, const hm_rpc_method_stats *s),
                          void *ud)
{
    for (size_t i = 0; i < rpc->n_methods; i++)
        fn(ud, &rpc->methods[i].s);
}

static void finish_close(hm_rpc *rpc)
{
    if (--rpc->pending_closes > 0)
        return;
    void (*cb)(void *) = rpc->close_cb;
    void *ud = rpc->close_ud;
    free(rpc->heap);
    free(rpc->methods);
    hm_hmap_free(&rpc->calls);
    hm_hmap_free(&rpc->peers);
    hm_hmap_free(&rpc->reqs);
    free(rpc);
    if (cb != NULL)
        cb(ud);
}

static void timer_closed_cb(uv_handle_t *h) { finish_close(h->data); }
static void transport_closed_cb(void *ud) { finish_close(ud); }

void hm_rpc_close(hm_rpc *rpc, void (*cb)(void *ud), void *ud)
{
    if (rpc->closing)
        return;
    rpc->closing = 1;
    rpc->close_cb = cb;
    rpc->close_ud = ud;
    while (rpc->heap_len > 0)
        call_finish(rpc, rpc->heap[0], -ECANCELED, NULL, 0);
    /* Handlers still hold their requests; respond on an orphan only frees it. */
    hm_rpc_req *r;
    while ((r = LIST_FIRST(&rpc->all_reqs)) != NULL) {
        req_unlink(rpc, r);
        r->rpc = NULL;
        r->m = NULL;
    }
    rpc->pending_closes = 2;
    uv_close((uv_handle_t *)&rpc->timer, timer_closed_cb);
    hm_transport_close(rpc->t, transport_closed_cb, rpc);
}

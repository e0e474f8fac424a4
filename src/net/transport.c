/*
 * transport: authenticated UDP datagrams and encrypted, multiplexed TCP
 * streams on one libuv loop (see transport.h for the contract).
 *
 * This file owns the UDP socket, the TCP listener, every connection with its
 * handshake, session, read buffer, reassembly slots and write queues, the
 * housekeeping timer (handshake deadline, idle close, write stall) and the
 * fault-injection state.
 *
 * Stream framing. Every record's plaintext is one chunk:
 *
 *   u32 message id (big-endian, chosen by the sender, per connection)
 *   u8  flags: 1 = first chunk, 2 = last chunk, other bits must be zero
 *   u32 total message length (first chunk only)
 *   ... up to HM_TRANSPORT_CHUNK bytes of message data
 *
 * The writer takes one chunk at a time, round-robin over the messages queued
 * on the connection, high priority first, so a small message queued behind a
 * large one goes out after at most one chunk of each message ahead of it. At
 * most WR_ACTIVE_MULTI multi-chunk messages per priority are in progress at
 * once (the rest wait their turn, single-chunk messages never wait), which is
 * what lets the reader cap its reassembly slots without refusing an honest
 * sender.
 *
 * Connection states: HANDSHAKE -> OPEN -> CLOSING, changed only by
 * conn_set_state. Every connection dies the same way: conn_close moves it to
 * CLOSING (conn_set_state logs that once), drops its key, queue, slots and
 * crypto state and closes the handle; conn_closed_cb unlinks and frees it. A
 * connection joins the list only once its TCP handle exists, so there is no
 * other teardown. Connections with a known key are found through an hmap
 * keyed by the public key. A connection's memory is released in its close callback,
 * never inside one of its own handlers, and every callback into the layer
 * above is followed by a check that the connection (or the transport) was
 * not closed by it. Callbacks are never invoked from inside an API call, so
 * the layer above may call the transport from its callbacks and its own
 * state is consistent when a callback arrives.
 *
 * Two connections to one peer (both sides dialled at once, or a peer that
 * reconnected before we noticed its old connection die) both stay usable:
 * sends go to the one established last, the other one still delivers what
 * arrives on it and is eventually retired as idle. A duplicate that goes
 * (replaced, idle, or shut by its peer) is retired (conn_retire): its queue
 * moves to the other connection, its sealed writes finish and it reads to
 * the peer's FIN, so nothing on the wire is lost. A connection that closes
 * otherwise hands its queue to another live one to the same peer where it
 * may (conn_close_handover), else frees it; the layer above learns of a
 * lost peer through on_conn(pk, 0), which fires when the last connection
 * to a peer goes away or a dial fails.
 */
#include "config.h"

#include "src/net/transport.h"

#include <errno.h>
#include <fcntl.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "src/base/hmap.h"
#include "src/base/util.h"

#define MOD "transport"

#define RBUF_SIZE (64u * 1024u)
#define CHUNK_HDR_FIRST 9u
#define CHUNK_HDR_NEXT 5u
#define FLAG_FIRST 1u
#define FLAG_LAST 2u
#define WR_RECORDS 4u
#define WR_BUF_SIZE (WR_RECORDS * (HM_REC_MAX_PLAIN + HM_REC_OVERHEAD))
#define WR_INFLIGHT_MAX (256u * 1024u)
#define WR_CACHE_MAX 4u
#define WR_ACTIVE_MULTI 32u
#define RASM_SLOTS_MAX 256u
/* A reassembly buffer starts this large (or at its message's size) and doubles as chunks arrive. */
#define RASM_FIRST_CAP (64u * 1024u)
/* Per-origin counters (origin.h) of what each origin holds in reassembly and write queues. */
#define V_RASM 0u
#define V_WQ 1u
/* The drain-rate rule applies to a connection holding more than this many queued bytes, */
#define WR_RATE_FLOOR (1u << 20)
/* measured over windows of this length. */
#define WR_RATE_WINDOW_MS 4000u
/* Single-chunk messages may pass an origin's write-queue share by this much. */
#define WQ_SMALL_SLACK (1u << 20)
/* Refusals of inbound messages waiting to be told to the layer above (from the loop). */
#define REFUSED_PENDING_MAX 64
/* Freed bytes after which the housekeeping hands free heap pages back (malloc_trim). */
#define TRIM_AFTER_BYTES (8u << 20)
#define CONN_BUCKETS 256u
#define CONN_BUCKETS_MAX 65536u
#define UDP_PENDING_MAX 1024u
/* The datagram socket's receive buffer we ask for (bind_sockets). */
#define UDP_RCVBUF_BYTES (2 * 1024 * 1024)
#define UDP_RBUF_SIZE 2048u
#define BIND_ATTEMPTS 16
#define POOL_SLOTS 8
#define POOL_MIN (64u * 1024u)
#define POOL_MAX_BYTES (64u * 1024u * 1024u)
#define POOL_IDLE_MS 2000u
/* Rated work may come in bursts of this many seconds' worth. */
#define RATE_BURST_S 4u
/* Origins tracked for datagram rates (sources are spoofable, so bounded). */
#define DGRAM_ORIGINS_MAX 16384u
/* A retired duplicate may take this long (plus a housekeeping tick, at most 1 s) to
 * finish its writes and read the peer's close. */
#define DRAIN_MS 5000u
/* Two connections to one peer, one dialled each way, that both came up within this
 * long of each other are a simultaneous dial (limit_per_peer). */
#define SIMUL_OPEN_MS 5000u

#if HM_TRANSPORT_CHUNK + CHUNK_HDR_FIRST > HM_REC_MAX_PLAIN
#error "a chunk and its header must fit in one record"
#endif

enum conn_state { CONN_HANDSHAKE = 0, CONN_OPEN = 1, CONN_CLOSING = 2 };
static const char *const conn_state_names[] = {"handshake", "open", "closing"};

/*
 * One queued outbound message. Its bytes follow the header, except for a
 * piece sent uncopied (hm_transport_sendv_ref): bytes [inl, inl + elen) of
 * the message lie at ext, held by ref until they are sealed, and data[]
 * holds what comes before and after them.
 */
typedef struct omsg {
    STAILQ_ENTRY(omsg) link;
    size_t cap; /* bytes allocated for the whole struct, for the buffer pool */
    uint32_t id;
    uint32_t len;
    uint32_t off; /* bytes already cut into chunks */
    uint32_t inl, elen;
    const uint8_t *ext;
    hm_tx_ref *ref;
    uint8_t data[];
} omsg;

/* One uv_write of sealed records (or of a handshake message). */
typedef struct wreq {
    uv_write_t req;
    struct conn *c;
    SLIST_ENTRY(wreq) link; /* in the connection's cache of free buffers */
    size_t len;
    size_t cap;
    uint8_t buf[];
} wreq;

/*
 * One inbound message being reassembled. Its buffer grows as chunks arrive
 * and is what the budgets are charged (cap). A refused or dropped message
 * keeps its slot with no buffer (discard) so the rest of its chunks are
 * checked and dropped without closing the connection.
 */
typedef struct rasm {
    uint32_t id;
    uint32_t total;
    uint32_t len;
    uint32_t cap;
    uint8_t *buf;
    uint64_t last_ms; /* when its last chunk arrived */
    int discard;
    /* The message's first bytes, for the layer above when it is refused. */
    uint8_t head[HM_TRANSPORT_HEAD_MAX];
    uint8_t head_len;
} rasm;

typedef struct refused_msg {
    uint8_t pk[HM_PK_BYTES];
    uint8_t head[HM_TRANSPORT_HEAD_MAX];
    uint8_t head_len;
} refused_msg;

STAILQ_HEAD(omsg_queue, omsg);

typedef struct conn {
    uv_tcp_t tcp;
    uv_connect_t connect_req;
    struct hm_transport *t;
    LIST_ENTRY(conn) link; /* every connection, closing ones included */
    hm_hmap_node by_pk;    /* live connections with a known key, by key */
    int in_hash;
    int state;
    int outbound;
    int connected; /* the socket is connected (inbound: always) */
    int reading;
    int pk_known;
    int quiet; /* a dial that failed inside an API call: no on_conn */
    uint64_t seq;
    uint64_t open_seq; /* order of reaching OPEN, for picking among duplicates */
    int heard; /* a chunk came in on it since its handshake (conn_find) */
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr;
    hm_handshake *hs;
    hm_session sess;
    int have_sess;
    uint8_t *rbuf;
    size_t rlen;
    int pending_input; /* bytes left in rbuf while stalled */
    rasm *slots;
    size_t n_slots;
    size_t rasm_bytes;
    struct omsg_queue act[2];  /* per priority: messages being cut into chunks */
    struct omsg_queue pend[2]; /* multi-chunk messages waiting for an active slot */
    unsigned act_multi[2];
    size_t unsent;   /* message bytes not yet sealed */
    size_t inflight; /* sealed bytes handed to uv_write, not yet completed */
    uint32_t next_id;
    uint64_t created_ms, last_activity_ms, last_progress_ms;
    SLIST_HEAD(, wreq) cache;
    unsigned n_cache;
    /* ---- connection admission (docs/security.md) ---- */
    hm_origin origin; /* of conn_from(): set at admission (inbound) or on first use */
    /* A relayed accept's dialler, as its relay (the one we reserved with) saw
     * it: where the connection's traffic comes from, for origins and `from`. */
    struct sockaddr_storage relayed_from;
    int have_relayed_from;
    int counted_inb;  /* charged to its origin as an inbound connection */
    int counted_hs;   /* ... and as one still in its handshake */
    int reset;        /* refused: close with a reset */
    /* ---- reassembly and write-queue accounting (docs/security.md) ---- */
    int origin_known;          /* origin (above) is set; it is computed on first use */
    size_t wq_charged;         /* unsent + inflight as last charged to the origin and total */
    uint64_t bytes_written;    /* sealed bytes whose writes completed */
    uint64_t drain_mark_ms;    /* start of the current drain-rate window, 0: none */
    uint64_t drain_mark_bytes; /* bytes_written then */
    /* ---- reachability probes (hm_transport_probe) ---- */
    hm_transport_probe_cb probe_cb; /* set: a probe, never used for sends */
    void *probe_ud;
    int probe_status; /* 0 once its handshake completed */
    /* ---- relays (src/net/relay.h) ---- */
    int divert_checked; /* inbound: its first bytes were offered to the divert hook */
    int diverted;       /* its socket went to the relay: no handshake failure, no reset */
    uint8_t *preamble;  /* a relayed accept: written before anything else */
    size_t preamble_len;
    int relayed_accept; /* we dialled the relay, but the peer dialled us */
    /* ---- retiring a duplicate gracefully (conn_retire) ---- */
    uint64_t open_ms;   /* when it reached OPEN */
    int draining;       /* retired: out of the hash, writes shut once they are done */
    int got_eof;        /* the peer has shut its side */
    int shut_done;      /* our FIN is out: every write completed */
    uint64_t drain_ms;  /* when it was retired */
    uv_shutdown_t shut_req;
} conn;

enum { DELAY_DGRAM = 1, DELAY_STREAM = 2 };

typedef struct delayed {
    TAILQ_ENTRY(delayed) link;
    uint64_t due_us; /* microseconds: a held send never leaves early, even by a tick */
    int kind;
    int prio;
    int has_to;
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage to;
    size_t len;
    uint8_t data[];
} delayed;

/*
 * A few recently freed large buffers (queued messages, reassembly slots),
 * kept for reuse. Streaming multi-megabyte messages otherwise costs a fresh
 * mapping per message, and its page faults cost more than the encryption.
 * Entries unused for POOL_IDLE_MS are released.
 */
typedef struct pool_ent {
    void *p;
    size_t cap;
    uint64_t freed_ms;
} pool_ent;

typedef struct udp_send {
    uv_udp_send_t req;
    struct hm_transport *t;
    size_t len;
    uint8_t buf[];
} udp_send;

struct hm_transport {
    uv_loop_t *loop;
    hm_identity id;
    uint8_t swarm_id[HM_SWARM_ID_BYTES];
    hm_transport_config cfg;
    hm_transport_cbs cbs;
    void *ud;
    hm_dgram_ctx *dctx;

    uv_tcp_t listener;
    uv_udp_t udp;
    uv_timer_t hk_timer;
    uv_timer_t delay_timer;
    uv_timer_t self_timer;  /* delivers messages sent to our own key */
    int open_handles;
    /* Stream messages to ourselves, in order, awaiting self_timer. */
    STAILQ_HEAD(, selfmsg) self_q;
    /* Inbound messages refused by reassembly, told on_refused from self_timer. */
    refused_msg refused[REFUSED_PENDING_MAX];
    size_t n_refused;
    size_t self_bytes;
    struct sockaddr_storage local;

    LIST_HEAD(, conn) conns;
    hm_hmap by_pk; /* conn.by_pk */
    size_t n_conns; /* allocated, closing ones included */
    uint64_t conn_seq;
    uint64_t open_counter;

    hm_transport_faults faults;
    uint8_t (*partitioned)[HM_PK_BYTES];
    hm_transport_delay_rule delay_rules[HM_TRANSPORT_DELAY_RULES_MAX]; /* -- netlab -- */
    uint64_t rng;

    TAILQ_HEAD(delayed_queue, delayed) delayed_q; /* by due time */
    size_t delayed_bytes;
    int kick; /* the delay timer should also resume stalled input and output */

    size_t udp_pending;
    hm_transport_stats stats;
    /* Failures a peer of another swarm causes, told at most once a minute. */
    struct complaint {
        uint64_t last_ms; /* monotonic; 0: never told */
        uint64_t count;   /* since it was last told */
    } bad_dgrams, bad_handshakes, old_version;
    size_t rasm_total; /* bytes held by inbound messages in progress, all connections */

    pool_ent pool[POOL_SLOTS];
    size_t pool_n;
    size_t pool_bytes;

    int closing;
    int failed_new;
    void (*close_cb)(void *ud);
    void *close_ud;

    /* ---- connection admission and handshake work (docs/security.md) ---- */
    hm_origin_tab origins;       /* inbound: v[OV_CONNS], v[OV_HS], v[OV_TAT] */
    hm_origin_tab dgram_origins; /* v[OV_TAT]: new-key datagrams */
    size_t n_inb, n_inb_hs;      /* inbound connections charged to origins, handshaking ones */
    uint64_t dgram_tat_us;       /* new-key datagrams, all origins */
    int origins_init, dgram_origins_init;
    /* ---- reassembly and write-queue accounting (docs/security.md) ---- */
    hm_origin_tab mem_origins; /* V_RASM and V_WQ bytes per origin */
    int mem_origins_init;
    size_t wq_total;         /* unsent + inflight, all connections */
    size_t freed_since_trim; /* large buffers freed since the last malloc_trim */

    /* ---- relays (src/net/relay.h) ---- */
    hm_transport_divert_fn divert;
    void *divert_ud;
    uint64_t relayed_accepts; /* hm_transport_accept_relayed dials */

    uint8_t udp_rbuf[UDP_RBUF_SIZE];
    uint8_t dgram_pt[HM_DGRAM_MAX];
};

static void conn_close(conn *c, const char *why);
static void shutdown_cb(uv_shutdown_t *req, int status);
static void conn_uncount(conn *c);
static void conn_pump(conn *c);
static void conn_process(conn *c);
static void delay_timer_cb(uv_timer_t *h);

/*
 * A stream message sent to our own key. The node's modules address peers
 * by key and may well pick their own node (a trainer calling an expert
 * that its own daemon hosts), so such a message is delivered to our
 * on_message from the loop, as if it had come over a connection; a TCP
 * connection to oneself would need a handshake with oneself.
 */
typedef struct selfmsg {
    STAILQ_ENTRY(selfmsg) link;
    size_t len;
    uint8_t data[];
} selfmsg;
static void maybe_finish_close(hm_transport *t);

/* ---------------------------------------------------------------- helpers */

static void pk_short(const uint8_t pk[HM_PK_BYTES], char out[9])
{
    char full[HM_PEER_ID_LEN + 1];
    hm_peer_id_encode(pk, full);
    memcpy(out, full, 8);
    out[8] = '\0';
}

/* xorshift64*: deterministic, so a test's drop pattern is reproducible. */
static double rng_next(hm_transport *t)
{
    uint64_t x = t->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    t->rng = x;
    return (double)((x * 2685821657736338717ull) >> 11) / 9007199254740992.0;
}

static int is_partitioned(const hm_transport *t, const uint8_t pk[HM_PK_BYTES])
{
    for (size_t i = 0; i < t->faults.n_partitioned; i++)
        if (memcmp(t->partitioned[i], pk, HM_PK_BYTES) == 0)
            return 1;
    return 0;
}

static int fault_drop(hm_transport *t, const uint8_t pk[HM_PK_BYTES])
{
    if (is_partitioned(t, pk))
        return 1;
    if (t->faults.drop_rate > 0 && rng_next(t) < t->faults.drop_rate)
        return 1;
    return 0;
}

/* -- netlab: per-address delays (TestDelay) -- */

/* An address's bytes and bit count, an IPv4-mapped IPv6 address as IPv4. */
static const uint8_t *delay_key(const struct sockaddr *sa, unsigned *bits)
{
    if (sa->sa_family == AF_INET) {
        *bits = 32;
        return (const uint8_t *)&((const struct sockaddr_in *)sa)->sin_addr;
    }
    if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_V4MAPPED(a)) {
            *bits = 32;
            return a->s6_addr + 12;
        }
        *bits = 128;
        return a->s6_addr;
    }
    return NULL;
}

static int prefix_match(const uint8_t *a, const uint8_t *b, unsigned prefix)
{
    unsigned whole = prefix / 8, rest = prefix % 8;
    if (memcmp(a, b, whole) != 0)
        return 0;
    if (rest == 0)
        return 1;
    uint8_t mask = (uint8_t)(0xff00u >> rest);
    return ((a[whole] ^ b[whole]) & mask) == 0;
}

/* ------------------------------------------------------------ buffer pool */

/* A pooled buffer of at least n bytes (and not much more), or NULL. */
static void *pool_get_cached(hm_transport *t, size_t n, size_t *cap_out)
{
    size_t best = SIZE_MAX;
    if (n >= POOL_MIN) {
        for (size_t i = 0; i < t->pool_n; i++)
            if (t->pool[i].cap >= n && t->pool[i].cap - n <= n / 2 &&
                (best == SIZE_MAX || t->pool[i].cap < t->pool[best].cap))
                best = i;
    }
    if (best != SIZE_MAX) {
        void *p = t->pool[best].p;
        *cap_out = t->pool[best].cap;
        t->pool_bytes -= t->pool[best].cap;
        t->pool[best] = t->pool[--t->pool_n];
        return p;
    }
    return NULL;
}

/* Returns a buffer of at least n bytes; *cap_out receives its real size. */
static void *pool_get(hm_transport *t, size_t n, size_t *cap_out)
{
    void *p = pool_get_cached(t, n, cap_out);
    if (p != NULL)
        return p;
    *cap_out = n;
    return malloc(n);
}

static void pool_put(hm_transport *t, void *p, size_t cap)
{
    if (p == NULL)
        return;
    if (cap < POOL_MIN || cap > POOL_MAX_BYTES / 2 || t->closing) {
        free(p);
        t->freed_since_trim += cap;
        return;
    }
    /* Make room by dropping the oldest entries. */
    while (t->pool_n > 0 && (t->pool_n == POOL_SLOTS || t->pool_bytes + cap > POOL_MAX_BYTES)) {
        size_t old = 0;
        for (size_t i = 1; i < t->pool_n; i++)
            if (t->pool[i].freed_ms < t->pool[old].freed_ms)
                old = i;
        free(t->pool[old].p);
        t->pool_bytes -= t->pool[old].cap;
        t->freed_since_trim += t->pool[old].cap;
        t->pool[old] = t->pool[--t->pool_n];
    }
    t->pool[t->pool_n].p = p;
    t->pool[t->pool_n].cap = cap;
    t->pool[t->pool_n].freed_ms = hm_now_ms();
    t->pool_n++;
    t->pool_bytes += cap;
}

void hm_tx_ref_drop(hm_tx_ref *ref)
{
    if (ref != NULL && --ref->refs == 0)
        ref->release(ref);
}

void hm_tx_ref_hold(hm_tx_ref *ref) { ref->refs++; }

/* A queued message is done with: its held memory goes back to its owner. */
static void omsg_free(hm_transport *t, omsg *m)
{
    hm_tx_ref *ref = m->ref;
    pool_put(t, m, m->cap);
    hm_tx_ref_drop(ref);
}

static void pool_trim(hm_transport *t, uint64_t older_than_ms)
{
    size_t i = 0;
    while (i < t->pool_n) {
        if (t->pool[i].freed_ms <= older_than_ms) {
            free(t->pool[i].p);
            t->pool_bytes -= t->pool[i].cap;
            t->freed_since_trim += t->pool[i].cap;
            t->pool[i] = t->pool[--t->pool_n];
        } else {
            i++;
        }
    }
}


/* ------------------------------------------------ per-origin accounting */

/* Whom c's traffic is from: its peer's address, or a relayed dialler's. */
static const struct sockaddr *conn_from(const conn *c)
{
    return (const struct sockaddr *)(c->have_relayed_from ? &c->relayed_from : &c->addr);
}

/*
 * Identities are free, addresses are not (origin.h): what a peer holds in
 * our reassembly buffers and write queues is also charged to its origin, and
 * the per-origin shares and the shedding below count origins, so any number
 * of identities on one origin get no more than one honest origin gets.
 */

static const hm_origin *conn_origin(conn *c)
{
    if (!c->origin_known) {
        hm_origin_of(conn_from(c), &c->origin);
        c->origin_known = 1;
    }
    return &c->origin;
}

/* Moves origin o's counter idx from `was` to `now` bytes (the entry is made or freed as needed). */
static void origin_move(hm_transport *t, const hm_origin *o, unsigned idx, size_t was, size_t now)
{
    if (was == now)
        return;
    hm_origin_ent *e = hm_origin_tab_get(&t->mem_origins, o, now > was);
    if (e == NULL)
        return;
    if (now > was)
        e->v[idx] += now - was;
    else
        e->v[idx] -= HM_MIN(e->v[idx], (uint64_t)(was - now));
    hm_origin_tab_release(&t->mem_origins, e);
}

static uint64_t origin_val(hm_transport *t, const hm_origin *o, unsigned idx)
{
    hm_origin_ent *e = hm_origin_tab_get(&t->mem_origins, o, 0);
    return e != NULL ? e->v[idx] : 0;
}

/* Brings the write-queue charges of c (its origin's and the total) up to date. */
static void wq_sync(conn *c)
{
    hm_transport *t = c->t;
    size_t now = c->unsent + c->inflight;
    if (now == c->wq_charged)
        return;
    origin_move(t, conn_origin(c), V_WQ, c->wq_charged, now);
    t->wq_total = t->wq_total - c->wq_charged + now;
    if (now < c->wq_charged)
        t->freed_since_trim += c->wq_charged - now;
    c->wq_charged = now;
}

/*
 * The origin's part of queueing len more bytes for an origin that queues
 * `mine`. A single message always fits an origin with nothing queued, so a
 * max_message transfer reaches any peer whatever the share (while the
 * origin table has room), and single-chunk messages (replies, control) may
 * pass the share by WQ_SMALL_SLACK, so they still get through behind a
 * bulk transfer.
 */
static int wq_origin_fits(const hm_transport *t, uint64_t mine, size_t len)
{
    size_t share = t->cfg.wq_origin_bytes + (len <= HM_TRANSPORT_CHUNK ? WQ_SMALL_SLACK : 0);
    if (mine > 0)
        return mine + len <= share;
    return hm_origin_tab_count(&t->mem_origins) < t->mem_origins.max_origins;
}

/*
 * Whether len more bytes may be queued on c: within its origin's share and
 * within the total. When the total is full, the origin queueing the most
 * pays first: if it would still queue more than c's origin after this send,
 * its fullest connection is closed (its queue freed) and the check repeats;
 * otherwise the send is refused. Returns 0 or -ENOBUFS, counted.
 */
static int wq_admit(conn *c, size_t len, int notice)
{
    hm_transport *t = c->t;
    uint64_t mine = origin_val(t, conn_origin(c), V_WQ);
    if (notice) {
        /*
         * A refusal notice has an allowance of its own past the share and
         * the total (notice_origin_bytes per origin, 64 times that in
         * all), which ordinary sends never reach, and never sheds anyone.
         */
        if (mine + len > t->cfg.wq_origin_bytes + WQ_SMALL_SLACK + t->cfg.notice_origin_bytes ||
            t->wq_total + len > t->cfg.wq_max_bytes + 64 * t->cfg.notice_origin_bytes ||
            (mine == 0 && hm_origin_tab_count(&t->mem_origins) >= t->mem_origins.max_origins)) {
            t->stats.notices_refused++;
            return -ENOBUFS;
        }
        return 0;
    }
    if (!wq_origin_fits(t, mine, len)) {
        t->stats.wq_refused_origin++;
        return -ENOBUFS;
    }
    while (t->wq_total + len > t->cfg.wq_max_bytes) {
        hm_origin_ent *h = hm_origin_tab_heaviest(&t->mem_origins, V_WQ);
        if (h == NULL || hm_origin_eq(&h->o, conn_origin(c)) || h->v[V_WQ] <= mine + len) {
            t->stats.wq_refused_total++;
            return -ENOBUFS;
        }
        conn *victim = NULL, *o;
        LIST_FOREACH(o, &t->conns, link)
            /* Closing frees what is not yet sealed (unsent); what is in
             * flight stays until the kernel gives it back, so the victim is
             * the connection holding the most unsent bytes. */
            if (o->state != CONN_CLOSING && o->unsent > 0 &&
                hm_origin_eq(conn_origin(o), &h->o) &&
                (victim == NULL || o->unsent > victim->unsent))
                victim = o;
        if (victim == NULL) {
            t->stats.wq_refused_total++;
            return -ENOBUFS;
        }
        char who[9], ob[HM_ORIGIN_STR];
        pk_short(victim->pk, who);
        hm_info(MOD, "write queues full (%zu bytes): closing the stream to %s of %s, the origin "
                "queueing the most (%zu bytes on it)", t->wq_total, who,
                hm_origin_str(&h->o, ob), victim->unsent + victim->inflight);
        t->stats.wq_shed++;
        size_t before = t->wq_total;
        conn_close(victim, "write queues full: shedding the heaviest origin");
        /* Bytes already handed to the socket stay until their writes complete. */
        if (t->wq_total == before) {
            t->stats.wq_refused_total++;
            return -ENOBUFS;
        }
    }
    return 0;
}

/* Moves c's reassembly charge (its own, its origin's, the total) from was to now bytes. */
static void rasm_move(conn *c, size_t was, size_t now)
{
    hm_transport *t = c->t;
    origin_move(t, conn_origin(c), V_RASM, was, now);
    c->rasm_bytes = c->rasm_bytes - was + now;
    t->rasm_total = t->rasm_total - was + now;
}

/* Frees a slot's buffer and turns it into a discard slot: its later chunks are dropped. */
static void slot_abort(conn *c, rasm *s)
{
    rasm_move(c, s->cap, 0);
    pool_put(c->t, s->buf, s->cap);
    s->buf = NULL;
    s->cap = 0;
    s->discard = 1;
}

static void rasm_refused(conn *c, const rasm *s);

/* Drops the message of origin o whose last chunk is the oldest; 0 if o has none. */
static int rasm_shed_stalest(hm_transport *t, const hm_origin *o)
{
    conn *best_c = NULL, *c;
    rasm *best = NULL;
    LIST_FOREACH(c, &t->conns, link) {
        if (c->state == CONN_CLOSING || c->rasm_bytes == 0 || !hm_origin_eq(conn_origin(c), o))
            continue;
        for (size_t i = 0; i < c->n_slots; i++)
            if (c->slots[i].cap > 0 && (best == NULL || c->slots[i].last_ms < best->last_ms)) {
                best = &c->slots[i];
                best_c = c;
            }
    }
    if (best == NULL)
        return 0;
    char ob[HM_ORIGIN_STR];
    hm_info(MOD, "reassembly full (%zu bytes): dropping a %u-byte message in progress from %s, "
            "the origin holding the most", t->rasm_total, best->total, hm_origin_str(o, ob));
    rasm_refused(best_c, best);
    slot_abort(best_c, best);
    return 1;
}

static void self_timer_cb(uv_timer_t *h);

/*
 * Remembers that s, an inbound message on c, was refused for lack of room,
 * so that the layer above can tell its sender (on_refused, from the loop:
 * never from inside the chunk processing that refused it).
 */
static void rasm_refused(conn *c, const rasm *s)
{
    hm_transport *t = c->t;
    if (t->cbs.on_refused == NULL || t->closing || s->head_len == 0)
        return;
    if (t->n_refused >= REFUSED_PENDING_MAX) {
        t->stats.refusals_untold++;
        return;
    }
    refused_msg *m = &t->refused[t->n_refused++];
    memcpy(m->pk, c->pk, HM_PK_BYTES);
    memcpy(m->head, s->head, s->head_len);
    m->head_len = s->head_len;
    if (!uv_is_active((uv_handle_t *)&t->self_timer))
        uv_timer_start(&t->self_timer, self_timer_cb, 0, 0);
}

/*
 * Room for `more` bytes of reassembly buffer on c: within the connection's
 * budget, its origin's share and the total, where a full total first sheds
 * the stalest message of an origin holding more than c's would. Returns 0 or
 * -ENOBUFS (counted); the message that asked is then refused, never the
 * connection.
 */
static int rasm_reserve(conn *c, size_t more)
{
    hm_transport *t = c->t;
    uint64_t mine = origin_val(t, conn_origin(c), V_RASM);
    if (c->rasm_bytes + more > t->cfg.max_message + t->cfg.max_queued_bytes ||
        mine + more > t->cfg.rasm_origin_bytes ||
        (mine == 0 && hm_origin_tab_count(&t->mem_origins) >= t->mem_origins.max_origins)) {
        t->stats.rasm_refused_origin++;
        return -ENOBUFS;
    }
    while (t->rasm_total + more > t->cfg.rasm_max_bytes) {
        hm_origin_ent *h = hm_origin_tab_heaviest(&t->mem_origins, V_RASM);
        if (h == NULL || hm_origin_eq(&h->o, conn_origin(c)) || h->v[V_RASM] <= mine + more ||
            !rasm_shed_stalest(t, &h->o)) {
            t->stats.rasm_refused_total++;
            return -ENOBUFS;
        }
        t->stats.rasm_shed++;
    }
    return 0;
}

/*
 * Makes s's buffer hold at least need bytes. It doubles (from
 * RASM_FIRST_CAP, never past the message's size), so a message costs what
 * its sender has sent, not what its first chunk declared; a recently freed
 * buffer of the whole size is taken from the pool when there is one, as its
 * pages are already resident. Returns 0, -ENOBUFS or -ENOMEM.
 */
static int slot_grow(conn *c, rasm *s, size_t need)
{
    hm_transport *t = c->t;
    if (need <= s->cap)
        return 0;
    size_t want = HM_MIN((size_t)s->total, HM_MAX(need, HM_MAX((size_t)RASM_FIRST_CAP,
                                                               2 * (size_t)s->cap)));
    size_t cap = 0;
    void *p = NULL;
    if (s->buf == NULL) {
        p = pool_get_cached(t, s->total, &cap);
        if (p != NULL && rasm_reserve(c, cap) < 0) {
            pool_put(t, p, cap);
            p = NULL;
        }
    }
    if (p == NULL) {
        int r = rasm_reserve(c, want - s->cap);
        if (r < 0)
            return r;
        p = realloc(s->buf, want);
        if (p == NULL)
            return -ENOMEM;
        cap = want;
    }
    rasm_move(c, s->cap, cap);
    s->buf = p;
    s->cap = (uint32_t)HM_MIN(cap, (size_t)UINT32_MAX);
    return 0;
}

/* ------------------------------------------------------------ connections */

static void conn_set_state(conn *c, int state, const char *why)
{
    char who[9] = "?";
    if (c->pk_known)
        pk_short(c->pk, who);
    hm_debug(MOD, "conn #%llu %s %s: %s -> %s (%s)", (unsigned long long)c->seq,
             c->outbound ? "to" : "from", who, conn_state_names[c->state],
             conn_state_names[state], why);
    c->state = state;
}

/*
 * Keys are chosen by peers (identities are free), so connections are found
 * through the keyed map rather than by bytes of the key itself, which a peer
 * could grind to pile every connection into one bucket.
 */
static void hash_insert(conn *c)
{
    hm_hmap_insert(&c->t->by_pk, &c->by_pk, c->pk, HM_PK_BYTES);
    c->in_hash = 1;
}

static void hash_remove(conn *c)
{
    if (!c->in_hash)
        return;
    hm_hmap_remove(&c->t->by_pk, &c->by_pk);
    c->in_hash = 0;
}

/* Walks the live connections with key pk. */
#define FOREACH_PK_CONN(c, t, pk)                                                                  \
    for (conn *c = hm_hmap_entry(hm_hmap_find(&(t)->by_pk, (pk), HM_PK_BYTES), conn, by_pk);       \
         c != NULL; c = hm_hmap_entry(hm_hmap_find_next(&(t)->by_pk, &c->by_pk), conn, by_pk))

/*
 * Whether an open connection has shown that its peer uses it: our own dial,
 * or one it has sent on. An inbound connection that has carried nothing
 * since its handshake may be a reachability probe (hm_transport_probe),
 * which its dialer closes as soon as the handshake completes: whatever we
 * queue on it then dies with it, unseen by the layer above while another
 * connection to the peer lives, and each call in it waits out its whole
 * deadline (in an all-reduce, a reducer timeout and a member wrongly found
 * dead).
 */
static int conn_in_use(const conn *c) { return c->outbound || c->heard; }

/*
 * The connection to send on: the open one in use (conn_in_use) that came
 * up last, else the open one that came up last, else one still in its
 * handshake (our own dial, whose queue is flushed once open). The newest
 * wins because a peer that dials again while we still hold an older
 * connection has usually dropped that one and we have not read its close
 * yet (it may be behind megabytes of unread data); such a peer sends on its
 * new connection, which then is in use.
 */
static conn *conn_find(hm_transport *t, const uint8_t pk[HM_PK_BYTES])
{
    conn *best = NULL;
    FOREACH_PK_CONN(c, t, pk) {
        if (best == NULL)
            best = c;
        else if (c->state == CONN_OPEN && best->state != CONN_OPEN)
            best = c;
        else if (c->state == CONN_OPEN && best->state == CONN_OPEN &&
                 conn_in_use(c) != conn_in_use(best))
            best = conn_in_use(c) ? c : best;
        else if (c->state == CONN_OPEN && best->state == CONN_OPEN && c->open_seq > best->open_seq)
            best = c;
        else if (c->state == CONN_HANDSHAKE && best->state == CONN_HANDSHAKE && c->outbound &&
                 !best->outbound)
            best = c;
    }
    return best;
}

static size_t live_conns(const hm_transport *t)
{
    size_t n = 0;
    const conn *c;
    LIST_FOREACH(c, &t->conns, link)
        if (c->state != CONN_CLOSING)
            n++;
    return n;
}

/*
 * A new connection with its TCP handle initialised. It joins the list only
 * once it is a handle, so that from then on every connection dies the same
 * way, through conn_close and its close callback.
 */
static int conn_bufs(conn *c)
{
    c->rbuf = malloc(RBUF_SIZE);
    c->hs = malloc(sizeof(*c->hs));
    return c->rbuf == NULL || c->hs == NULL ? -ENOMEM : 0;
}

/* bufs: allocate the read buffer and handshake now; an inbound connection
 * gets them (conn_bufs) only once admitted, so refusing one costs little. */
static int conn_new(hm_transport *t, int bufs, conn **out)
{
    int result = 0;
    conn *c = calloc(1, sizeof(*c));

    *out = NULL;
    if (c == NULL)
        return -ENOMEM;
    if (bufs && (result = conn_bufs(c)) < 0)
        goto out;
    result = uv_tcp_init(t->loop, &c->tcp);
    if (result < 0)
        goto out;
    c->t = t;
    c->seq = ++t->conn_seq;
    c->state = CONN_HANDSHAKE;
    c->created_ms = c->last_activity_ms = c->last_progress_ms = hm_now_ms();
    c->tcp.data = c;
    for (int p = 0; p < 2; p++) {
        STAILQ_INIT(&c->act[p]);
        STAILQ_INIT(&c->pend[p]);
    }
    SLIST_INIT(&c->cache);
    LIST_INSERT_HEAD(&t->conns, c, link);
    t->n_conns++;
    *out = c;
    c = NULL;
out:
    if (c != NULL) {
        free(c->rbuf);
        free(c->hs);
        free(c);
    }
    return result;
}

static void free_queue(conn *c)
{
    for (int p = 0; p < 2; p++) {
        struct omsg_queue *lists[2] = {&c->act[p], &c->pend[p]};
        for (int l = 0; l < 2; l++) {
            omsg *m, *n;
            STAILQ_FOREACH_SAFE(m, lists[l], link, n)
                omsg_free(c->t, m);
            STAILQ_INIT(lists[l]);
        }
        c->act_multi[p] = 0;
    }
    c->unsent = 0;
    wq_sync(c);
}

static void free_slots(conn *c)
{
    for (size_t i = 0; i < c->n_slots; i++)
        pool_put(c->t, c->slots[i].buf, c->slots[i].cap);
    rasm_move(c, c->rasm_bytes, 0);
    free(c->slots);
    c->slots = NULL;
    c->n_slots = 0;
    c->rasm_bytes = 0;
}

static int live_conn_for(const hm_transport *t, const uint8_t pk[HM_PK_BYTES])
{
    return hm_hmap_find(&t->by_pk, pk, HM_PK_BYTES) != NULL;
}

static void conn_closed_cb(uv_handle_t *h)
{
    conn *c = h->data;
    hm_transport *t = c->t;

    LIST_REMOVE(c, link);
    t->n_conns--;
    /* Every write has completed by now; whatever was still charged goes. */
    c->inflight = 0;
    wq_sync(c);

    wreq *w, *wn;
    SLIST_FOREACH_SAFE(w, &c->cache, link, wn)
        free(w);
    free(c->rbuf);
    /*
     * The layer above learns here, after the fact and outside any API call,
     * that the peer is unreachable, so it can fail what it had in flight
     * instead of waiting for deadlines.
     */
    /* A retired duplicate never tells: the live one's close does, if it goes. */
    int notify = c->pk_known && !c->quiet && !c->draining && !t->closing &&
                 !live_conn_for(t, c->pk);
    hm_transport_probe_cb probe_cb = c->quiet ? NULL : c->probe_cb;
    void *probe_ud = c->probe_ud;
    int probe_status = t->closing && c->probe_status != 0 ? -ECANCELED : c->probe_status;
    if (probe_cb != NULL)
        notify = 0;
    uint8_t pk[HM_PK_BYTES];
    memcpy(pk, c->pk, HM_PK_BYTES);
    sodium_memzero(c, sizeof(*c));
    free(c);
    if (notify && t->cbs.on_conn != NULL)
        t->cbs.on_conn(t->ud, pk, 0);
    /* A probe reports here, from its close callback, exactly once. */
    if (probe_cb != NULL)
        probe_cb(probe_ud, probe_status);
    maybe_finish_close(t);
}

static void conn_close(conn *c, const char *why)
{
    if (c->state == CONN_CLOSING)
        return;
    if (c->state == CONN_HANDSHAKE && !c->diverted)
        c->t->stats.handshakes_failed++;
    if (c->probe_cb != NULL && c->probe_status != 0 && strcmp(why, "handshake timeout") == 0)
        c->probe_status = -ETIMEDOUT;
    conn_set_state(c, CONN_CLOSING, why);
    conn_uncount(c);
    hash_remove(c);
    free_queue(c);
    free_slots(c);
    if (c->hs != NULL) {
        hm_hs_wipe(c->hs);
        free(c->hs);
        c->hs = NULL;
    }
    if (c->have_sess) {
        hm_session_wipe(&c->sess);
        c->have_sess = 0;
    }
    c->pending_input = 0;
    free(c->preamble);
    c->preamble = NULL;
    if (c->reset && !c->diverted && uv_tcp_close_reset(&c->tcp, conn_closed_cb) == 0)
        return;
    uv_close((uv_handle_t *)&c->tcp, conn_closed_cb);
}

/*
 * Whether len more bytes may be queued on c without shedding anyone: its
 * own cap, its origin's share and the total, as wq_admit counts them.
 */
static int wq_fits(conn *c, size_t len)
{
    hm_transport *t = c->t;
    if (c->unsent + c->inflight + len > t->cfg.max_queued_bytes ||
        !wq_origin_fits(t, origin_val(t, conn_origin(c), V_WQ), len))
        return 0;
    return t->wq_total + len <= t->cfg.wq_max_bytes;
}

/*
 * Appends m, whose cutting starts over, to c's queue at priority p. An
 * empty c takes the stall clock of the connection m comes from (since), so
 * that a peer which never reads cannot restart it by opening connection
 * after connection.
 */
static void queue_moved(conn *c, omsg *m, int p, uint64_t since)
{
    m->id = c->next_id++;
    m->off = 0;
    if (c->unsent + c->inflight == 0)
        c->last_progress_ms = since;
    c->unsent += m->len;
    wq_sync(c);
    if (m->len > HM_TRANSPORT_CHUNK && c->act_multi[p] >= WR_ACTIVE_MULTI) {
        STAILQ_INSERT_TAIL(&c->pend[p], m, link);
    } else {
        if (m->len > HM_TRANSPORT_CHUNK)
            c->act_multi[p]++;
        STAILQ_INSERT_TAIL(&c->act[p], m, link);
    }
}

/* Moves c's queue to s, whose cutting starts over (see conn_close_handover). */
static void handover_queue(conn *c, conn *s)
{
    hm_transport *t = c->t;
    for (int p = 0; p < 2; p++) {
        struct omsg_queue *lists[2] = {&c->act[p], &c->pend[p]};
        for (int l = 0; l < 2; l++) {
            omsg *m;
            while ((m = STAILQ_FIRST(lists[l])) != NULL) {
                STAILQ_REMOVE_HEAD(lists[l], link);
                c->unsent -= m->len - m->off;
                wq_sync(c);
                if (wq_fits(s, m->len)) {
                    queue_moved(s, m, p, c->last_progress_ms);
                    t->stats.handed_over++;
                } else {
                    omsg_free(t, m);
                    t->stats.handover_dropped++;
                }
            }
        }
        c->act_multi[p] = 0;
    }
}

/*
 * Closes c, handing what it had queued to another live connection to the
 * same peer, if there is one. That is the close of a duplicate: the peer
 * closed this connection but keeps another (its own MaxConnectionsPerPeer
 * replaced the older one, or it was a dial-back probe's), or we replaced or
 * evicted it. The layer above hears of no loss in that case (the peer is
 * still connected), so without the handover whatever was queued here would
 * vanish and each call in it would wait out its whole deadline.
 *
 * A queued message has not had its last chunk sealed, so the peer has not
 * received it whole and never will on this connection: it starts over on
 * the other one, and is never delivered twice. What was already handed to
 * the socket whole is not recoverable here; such a message is lost as any
 * message on a dying connection is, which is why duplicates we close
 * ourselves, or whose peer closed them, are retired instead (conn_retire).
 * A message that does not fit the other connection's queue (its cap, its
 * origin's share, the total) is dropped, counted. Closes for a slow or
 * hostile peer (write stall, draining too slowly, a full total, bad
 * records) use conn_close and free the queue: there the point is to stop
 * holding its bytes.
 */
static void conn_close_handover(conn *c, const char *why)
{
    hm_transport *t = c->t;
    if (c->state == CONN_CLOSING)
        return;
    conn *s = NULL;
    if (c->state == CONN_OPEN && c->unsent > 0 && !t->closing) {
        hash_remove(c); /* so that conn_find looks past it */
        s = conn_find(t, c->pk);
    }
    if (s != NULL)
        handover_queue(c, s);
    conn_close(c, why);
    if (s != NULL)
        conn_pump(s);
}

/*
 * Retires c, a duplicate (another connection to its peer lives), without
 * losing what is on its way in either direction. What was queued moves to
 * the other connection (as in conn_close_handover) and sends no longer
 * find c; what was already sealed is still written, and then our side is
 * shut (a FIN after the last byte). c keeps reading and delivering until the
 * peer shuts its side too, which a hivemindd peer does once its own writes
 * on it are done (read_cb), and only then closes. So a message handed whole
 * to the socket on either side still arrives, where closing at once lost
 * it (its call waited out its deadline while the peer stayed connected).
 *
 * A retire is bounded: a peer that never shuts its side, or never reads,
 * has c closed after DRAIN_MS (hk_timer_cb). While it drains c stays
 * charged to its origin, so retiring grants no extra connections. Without
 * another connection to the peer (the last one goes: nothing would carry
 * the replies, and the layer above should hear of the loss now), when the
 * transport is closing, or when the shutdown cannot start, this is
 * conn_close_handover.
 */
static void conn_retire(conn *c, const char *why)
{
    hm_transport *t = c->t;
    if (c->state == CONN_CLOSING || c->draining)
        return;
    conn *s = NULL;
    if (c->state == CONN_OPEN && !t->closing) {
        hash_remove(c);
        s = conn_find(t, c->pk);
    }
    if (s == NULL) {
        conn_close_handover(c, why);
        return;
    }
    handover_queue(c, s);
    c->shut_req.data = c;
    if (uv_shutdown(&c->shut_req, (uv_stream_t *)&c->tcp, shutdown_cb) < 0) {
        conn_close(c, why);
        conn_pump(s);
        return;
    }
    c->draining = 1;
    c->drain_ms = hm_now_ms();
    t->stats.retired++;
    hm_debug(MOD, "retiring conn #%llu: %s", (unsigned long long)c->seq, why);
    conn_pump(s);
}

/* Our FIN went out after the last write (or the shutdown was cancelled by a close). */
static void shutdown_cb(uv_shutdown_t *req, int status)
{
    conn *c = req->data;
    if (c->state == CONN_CLOSING)
        return;
    c->shut_done = 1;
    if (status < 0)
        conn_close(c, uv_strerror(status));
    else if (c->got_eof)
        conn_close(c, "retired: both sides done");
}

/* -------------------------------------------------------------- admission */

/*
 * Identities are free, addresses are not (docs/security.md): inbound
 * connections are charged to their origin, and the values of its entry in
 * t->origins are these. OV_TAT is also the only value of t->dgram_origins.
 */
enum { OV_CONNS = 0, OV_HS = 1, OV_TAT = 2 };

/*
 * A rate of `rate` events per second with bursts of RATE_BURST_S seconds'
 * worth, kept as one number, the theoretical arrival time of the next event
 * (GCRA): it lies at most the burst ahead of now, and an entry whose time
 * has passed holds no state worth keeping. Returns 1 when the event may go.
 */
static int rate_take(uint64_t *tat_us, uint64_t now_us, unsigned rate)
{
    uint64_t step = HM_MAX((uint64_t)1000000u / HM_MAX(rate, 1u), (uint64_t)1);
    uint64_t burst = step * (uint64_t)HM_MAX(rate, 1u) * RATE_BURST_S;
    uint64_t start = *tat_us > now_us ? *tat_us : now_us;
    if (start + step - now_us > burst)
        return 0;
    *tat_us = start + step;
    return 1;
}

/* Frees an origin's entry once nothing is charged to it and its rate is idle. */
static void origin_release(hm_origin_tab *tab, hm_origin_ent *e, uint64_t now_us)
{
    if (e->v[OV_CONNS] != 0 || e->v[OV_HS] != 0 || e->v[OV_TAT] > now_us)
        return;
    e->v[OV_TAT] = 0;
    hm_origin_tab_release(tab, e);
}

static void origin_sweep(hm_origin_tab *tab, uint64_t now_us)
{
    hm_origin_ent *e = hm_origin_tab_next(tab, NULL);
    while (e != NULL) {
        hm_origin_ent *next = hm_origin_tab_next(tab, e);
        origin_release(tab, e, now_us);
        e = next;
    }
}

/* The connection no longer counts for its origin's handshakes. */
static void conn_uncount_hs(conn *c, hm_origin_ent *e)
{
    if (!c->counted_hs)
        return;
    c->t->n_inb_hs--;
    if (e != NULL)
        e->v[OV_HS]--;
    c->counted_hs = 0;
}

static void conn_uncount(conn *c)
{
    hm_transport *t = c->t;
    if (!c->counted_inb)
        return;
    hm_origin_ent *e = hm_origin_tab_get(&t->origins, &c->origin, 0);
    conn_uncount_hs(c, e);
    t->n_inb--;
    c->counted_inb = 0;
    if (e != NULL) {
        e->v[OV_CONNS]--;
        origin_release(&t->origins, e, hm_now_us());
    }
}

/*
 * The connection to evict for a newcomer whose origin holds `have` of what
 * v[idx] counts: one of the origin that holds the most, and only if that is
 * at least two more than the newcomer's, so that eviction moves the table
 * towards equal shares and never takes from an origin as light as the
 * newcomer's. Among the heaviest origin's connections: a retired one (it is
 * going anyway), else one still in its
 * handshake (the oldest, the likeliest never to finish), else the youngest
 * open one, so its long-lived verified peers are the last to go. NULL when
 * there is no such connection.
 */
static conn *evict_pick(hm_transport *t, unsigned idx, uint64_t have)
{
    hm_origin_ent *h = hm_origin_tab_heaviest(&t->origins, idx);
    if (h == NULL || h->v[idx] < have + 2)
        return NULL;
    conn *best = NULL, *c;
    LIST_FOREACH(c, &t->conns, link) {
        if (c->state == CONN_CLOSING || !c->counted_inb || !hm_origin_eq(&c->origin, &h->o))
            continue;
        if (idx == OV_HS && !c->counted_hs)
            continue;
        /* A retired one is going anyway: it goes first. */
        if (best == NULL || (c->draining && !best->draining))
            best = c;
        else if (c->draining != best->draining)
            continue;
        else if (c->counted_hs && !best->counted_hs)
            best = c;
        else if (c->counted_hs == best->counted_hs &&
                 (c->counted_hs ? c->seq < best->seq : c->seq > best->seq))
            best = c;
    }
    return best;
}

static void conn_evict(conn *v, const char *why)
{
    v->t->stats.evicted++;
    hm_debug(MOD, "evicting conn #%llu: %s", (unsigned long long)v->seq, why);
    conn_close_handover(v, why);
}

/*
 * Decides whether the inbound connection c (its address known, not yet
 * reading) may stay, evicting another if that is what makes room, and
 * charges it to its origin. Returns 0 when it must be closed.
 */
static int admit_inbound(hm_transport *t, conn *c)
{
    const hm_transport_config *cf = &t->cfg;
    uint64_t now = hm_now_us();
    hm_origin_of(conn_from(c), &c->origin);
    c->origin_known = 1;
    hm_origin_ent *e = hm_origin_tab_get(&t->origins, &c->origin, 1);
    if (e == NULL) {
        /* Every tracked origin is in use: the conservative answer. */
        t->stats.refused_per_origin++;
        return 0;
    }
    /* The handshake's X25519 and signature are what an origin may not take all of. */
    if (!rate_take(&e->v[OV_TAT], now, cf->handshake_rate_per_origin)) {
        t->stats.refused_handshake_rate++;
        goto refuse;
    }
    if (e->v[OV_CONNS] >= cf->max_conns_per_origin) {
        t->stats.refused_per_origin++;
        goto refuse;
    }
    if (e->v[OV_HS] >= cf->max_handshakes_per_origin) {
        t->stats.refused_handshakes_per_origin++;
        goto refuse;
    }
    /*
     * Both victims are chosen before either is evicted, so a newcomer that
     * will be refused anyway costs nobody a connection. A connection victim
     * is a handshaking one when the heaviest origin has one, which also
     * frees a handshake slot.
     */
    size_t inb_share = cf->max_connections - cf->reserved_outbound;
    int need_hs = t->n_inb_hs >= cf->max_handshakes;
    int need_conn = t->n_inb >= inb_share || live_conns(t) > cf->max_connections; /* counts c */
    conn *v_conn = NULL, *v_hs = NULL;
    if (need_conn) {
        if (live_conns(t) > cf->max_connections)
            t->stats.refused_max_connections++;
        else
            t->stats.refused_reserved++;
        if ((v_conn = evict_pick(t, OV_CONNS, e->v[OV_CONNS])) == NULL)
            goto refuse;
    }
    if (need_hs && (v_conn == NULL || !v_conn->counted_hs)) {
        t->stats.refused_handshakes++;
        if ((v_hs = evict_pick(t, OV_HS, e->v[OV_HS])) == NULL)
            goto refuse;
    }
    if (v_conn != NULL)
        conn_evict(v_conn, "evicted for a lighter origin");
    if (v_hs != NULL)
        conn_evict(v_hs, "evicted: handshakes full");
    e->v[OV_CONNS]++;
    e->v[OV_HS]++;
    t->n_inb++;
    t->n_inb_hs++;
    c->counted_inb = c->counted_hs = 1;
    return 1;
refuse:
    origin_release(&t->origins, e, now);
    return 0;
}

/*
 * Whether both ends keep c when two connections, one dialled each way,
 * came up at once: both keep the one dialled by the smaller key, so that
 * they retire the same one and not one each.
 */
static int conn_wins_tie(const conn *c)
{
    int we_dialled = c->outbound && !c->relayed_accept;
    return we_dialled == (memcmp(c->t->id.pk, c->pk, HM_PK_BYTES) < 0);
}

/*
 * One identity keeps at most max_conns_per_peer connections. A peer that
 * opens another (it reconnected, or an attacker reusing one key) replaces
 * its oldest open one rather than adding to its share; c, just open, is the
 * newest. Connections dialled both ways within SIMUL_OPEN_MS of each other
 * are a simultaneous dial, which each end sees in its own order: there the
 * oldest of those the tie rule drops goes, c included, the same one at both
 * ends. The replaced one is retired (conn_retire), so nothing already on its
 * way in either direction is lost.
 */
static void limit_per_peer(conn *c)
{
    hm_transport *t = c->t;
    size_t n = 0;
    conn *oldest = NULL, *tie_loser = NULL;
    int recent_win = 0, recent_lose = 0;
    FOREACH_PK_CONN(o, t, c->pk) {
        n++;
        if (o->state != CONN_OPEN)
            continue;
        if (o != c && (oldest == NULL || o->open_seq < oldest->open_seq))
            oldest = o;
        if (c->open_ms - o->open_ms >= SIMUL_OPEN_MS)
            continue;
        if (conn_wins_tie(o)) {
            recent_win = 1;
        } else {
            recent_lose = 1;
            if (tie_loser == NULL || o->open_seq < tie_loser->open_seq)
                tie_loser = o;
        }
    }
    conn *victim = recent_win && recent_lose ? tie_loser : oldest;
    if (n <= t->cfg.max_conns_per_peer || victim == NULL)
        return;
    t->stats.refused_per_peer++;
    conn_retire(victim, "replaced by a newer connection of the same peer");
}

/* Whether a datagram whose sender key is not cached yet may cost its X25519. */
static int dgram_new_key_admit(hm_transport *t, const struct sockaddr *from)
{
    uint64_t now = hm_now_us();
    hm_origin o;
    hm_origin_of(from, &o);
    hm_origin_ent *e = hm_origin_tab_get(&t->dgram_origins, &o, 1);
    /* With the origin table full (a spoofer's many sources), only the
     * global bound below holds: an honest newcomer is not refused outright. */
    if (e != NULL && !rate_take(&e->v[OV_TAT], now, t->cfg.dgram_new_key_rate_per_origin)) {
        t->stats.refused_dgram_new_key_origin++;
        return 0;
    }
    if (!rate_take(&t->dgram_tat_us, now, t->cfg.dgram_new_key_rate)) {
        t->stats.refused_dgram_new_key++;
        return 0;
    }
    return 1;
}

/* ------------------------------------------------------------- write path */

static wreq *wreq_get(conn *c, size_t cap)
{
    if (cap == WR_BUF_SIZE && !SLIST_EMPTY(&c->cache)) {
        wreq *w = SLIST_FIRST(&c->cache);
        SLIST_REMOVE_HEAD(&c->cache, link);
        c->n_cache--;
        return w;
    }
    wreq *w = malloc(sizeof(*w) + cap);
    if (w == NULL)
        return NULL;
    w->c = c;
    w->cap = cap;
    w->len = 0;
    return w;
}

static void wreq_put(conn *c, wreq *w)
{
    if (w->cap == WR_BUF_SIZE && c->state != CONN_CLOSING && c->n_cache < WR_CACHE_MAX) {
        SLIST_INSERT_HEAD(&c->cache, w, link);
        c->n_cache++;
        return;
    }
    free(w);
}

static void write_cb(uv_write_t *req, int status)
{
    wreq *w = (wreq *)req;
    conn *c = w->c;
    hm_transport *t = c->t;

    c->inflight -= w->len;
    wq_sync(c);
    if (status < 0) {
        free(w);
        if (c->state != CONN_CLOSING)
            conn_close_handover(c, uv_strerror(status));
        return;
    }
    t->stats.bytes_out += w->len;
    c->bytes_written += w->len;
    c->last_progress_ms = c->last_activity_ms = hm_now_ms();
    wreq_put(c, w);
    conn_pump(c);
}

static int conn_write_raw(conn *c, const uint8_t *p, size_t len)
{
    wreq *w = wreq_get(c, len);
    if (w == NULL)
        return -ENOMEM;
    memcpy(w->buf, p, len);
    w->len = len;
    uv_buf_t b = uv_buf_init((char *)w->buf, (unsigned)len);
    int r = uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, write_cb);
    if (r < 0) {
        free(w);
        return r;
    }
    c->inflight += len;
    wq_sync(c);
    return 0;
}

static int has_chunks(const conn *c) { return !STAILQ_EMPTY(&c->act[0]) || !STAILQ_EMPTY(&c->act[1]); }

static void promote_pending(conn *c, int p)
{
    while (!STAILQ_EMPTY(&c->pend[p]) && c->act_multi[p] < WR_ACTIVE_MULTI) {
        omsg *m = STAILQ_FIRST(&c->pend[p]);
        STAILQ_REMOVE_HEAD(&c->pend[p], link);
        STAILQ_INSERT_TAIL(&c->act[p], m, link);
        c->act_multi[p]++;
    }
}

/*
 * Bytes [off, off + n) of m (n at most one chunk): where they lie when they
 * lie in one place, else gathered into join.
 */
static const uint8_t *omsg_bytes(const omsg *m, size_t off, size_t n, uint8_t *join)
{
    size_t e0 = m->inl, e1 = (size_t)m->inl + m->elen;
    if (off + n <= e0)
        return m->data + off;
    if (off >= e0 && off + n <= e1)
        return m->ext + (off - e0);
    if (off >= e1)
        return m->data + (off - m->elen);
    for (size_t i = 0; i < n;) {
        size_t at = off + i, k;
        const uint8_t *p;
        if (at < e0) {
            p = m->data + at;
            k = e0 - at;
        } else if (at < e1) {
            p = m->ext + (at - e0);
            k = e1 - at;
        } else {
            p = m->data + (at - m->elen);
            k = n - i;
        }
        k = HM_MIN(k, n - i);
        memcpy(join + i, p, k);
        i += k;
    }
    return join;
}

/*
 * Cuts the next chunk (round-robin within the highest non-empty priority)
 * and seals it as one record at rec; returns hm_session_seal2's result,
 * with the record's length in *sealed_out.
 */
static int next_chunk(conn *c, uint8_t *rec, size_t *sealed_out)
{
    uint8_t *o = rec + HM_REC_HEADER;
    hm_transport *t = c->t;
    int p = !STAILQ_EMPTY(&c->act[0]) ? 0 : 1;
    omsg *m = STAILQ_FIRST(&c->act[p]);
    size_t hdr;
    uint8_t flags = 0;

    STAILQ_REMOVE_HEAD(&c->act[p], link);

    hm_put_be32(o, m->id);
    if (m->off == 0) {
        flags |= FLAG_FIRST;
        hm_put_be32(o + 5, m->len);
        hdr = CHUNK_HDR_FIRST;
    } else {
        hdr = CHUNK_HDR_NEXT;
    }
    size_t n = HM_MIN((size_t)(m->len - m->off), (size_t)HM_TRANSPORT_CHUNK);
    if (m->off + n == m->len)
        flags |= FLAG_LAST;
    o[4] = flags;
    /*
     * Sealed from where the bytes lie: the header in place, the data
     * straight out of the message (or out of the caller's memory it
     * holds), so no copy joins them first. Only a chunk that spans both
     * parts of a message is joined, in a chunk-sized scratch.
     */
    uint8_t join[HM_TRANSPORT_CHUNK];
    const uint8_t *src = omsg_bytes(m, m->off, n, join);
    int r = hm_session_seal2(&c->sess, o, hdr, src, n, rec, sealed_out);
    m->off += (uint32_t)n;
    c->unsent -= n;

    if (flags & FLAG_LAST) {
        if (m->len > HM_TRANSPORT_CHUNK) {
            c->act_multi[p]--;
            promote_pending(c, p);
        }
        omsg_free(t, m);
        t->stats.messages_out++;
    } else {
        STAILQ_INSERT_TAIL(&c->act[p], m, link);
    }
    return r;
}

/* Seals chunks into write requests while the in-flight budget allows. */
static void conn_pump(conn *c)
{
    hm_transport *t = c->t;
    while (c->state == CONN_OPEN && !c->draining && !t->faults.stall &&
           c->inflight < WR_INFLIGHT_MAX && has_chunks(c)) {
        wreq *w = wreq_get(c, WR_BUF_SIZE);
        if (w == NULL) {
            conn_close(c, "out of memory");
            return;
        }
        w->len = 0;
        for (unsigned i = 0; i < WR_RECORDS && has_chunks(c); i++) {
            size_t sealed = 0;
            int r = next_chunk(c, w->buf + w->len, &sealed);
            if (r < 0) {
                free(w);
                conn_close(c, "seal failed");
                return;
            }
            w->len += sealed;
        }
        uv_buf_t b = uv_buf_init((char *)w->buf, (unsigned)w->len);
        int r = uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, write_cb);
        if (r < 0) {
            free(w);
            conn_close(c, uv_strerror(r));
            return;
        }
        c->inflight += w->len;
    }
    wq_sync(c);
}

static size_t bufs_len(const uv_buf_t *bufs, unsigned n)
{
    size_t len = 0;
    for (unsigned i = 0; i < n; i++)
        len += bufs[i].len;
    return len;
}

static void bufs_copy(uint8_t *dst, const uv_buf_t *bufs, unsigned n)
{
    for (unsigned i = 0; i < n; i++) {
        if (bufs[i].len > 0)
            memcpy(dst, bufs[i].base, bufs[i].len);
        dst += bufs[i].len;
    }
}

static int conn_enqueue(conn *c, const uv_buf_t *bufs, unsigned nbufs, size_t len, int prio,
                        hm_tx_ref *ref, unsigned held)
{
    hm_transport *t = c->t;
    int notice = prio == HM_PRIO_NOTICE;
    if (notice)
        prio = HM_PRIO_HIGH; /* queued as any small reply, ahead of bulk chunks */
    if (c->unsent + c->inflight + len >
        t->cfg.max_queued_bytes + (notice ? t->cfg.notice_origin_bytes : 0)) {
        if (notice)
            t->stats.notices_refused++;
        return -ENOBUFS;
    }
    int r = wq_admit(c, len, notice);
    if (r < 0)
        return r;
    /* A held piece stays where it lies; the rest is copied in. */
    size_t ext = ref != NULL && held < nbufs ? bufs[held].len : 0;
    size_t cap;
    omsg *m = pool_get(t, sizeof(*m) + (len - ext), &cap);
    if (m == NULL)
        return -ENOMEM;
    m->cap = cap;
    m->id = c->next_id++;
    m->len = (uint32_t)len;
    m->off = 0;
    m->inl = 0;
    m->elen = 0;
    m->ext = NULL;
    m->ref = NULL;
    if (ext > 0) {
        bufs_copy(m->data, bufs, held);
        m->inl = (uint32_t)bufs_len(bufs, held);
        m->elen = (uint32_t)ext;
        bufs_copy(m->data + m->inl, bufs + held + 1, nbufs - held - 1);
        m->ext = (const uint8_t *)bufs[held].base;
        m->ref = ref;
        hm_tx_ref_hold(ref);
    } else {
        bufs_copy(m->data, bufs, nbufs);
    }
    /* The stall clock starts when data appears in an empty queue. */
    if (c->unsent + c->inflight == 0)
        c->last_progress_ms = hm_now_ms();
    c->unsent += len;
    wq_sync(c);

    int multi = len > HM_TRANSPORT_CHUNK;
    if (multi && c->act_multi[prio] >= WR_ACTIVE_MULTI) {
        STAILQ_INSERT_TAIL(&c->pend[prio], m, link);
    } else {
        if (multi)
            c->act_multi[prio]++;
        STAILQ_INSERT_TAIL(&c->act[prio], m, link);
    }
    conn_pump(c);
    return 0;
}

/* -------------------------------------------------------------- read path */

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    conn *c = h->data;
    HM_UNUSED(suggested);
    buf->base = (char *)c->rbuf + c->rlen;
    buf->len = RBUF_SIZE - c->rlen;
}

static void deliver(conn *c, const uint8_t *msg, size_t len)
{
    hm_transport *t = c->t;
    t->stats.messages_in++;
    if (is_partitioned(t, c->pk))
        return;
    if (t->cbs.on_message != NULL)
        t->cbs.on_message(t->ud, c->pk, conn_from(c), msg, len);
}

static rasm *slot_find(conn *c, uint32_t id)
{
    for (size_t i = 0; i < c->n_slots; i++)
        if (c->slots[i].id == id)
            return &c->slots[i];
    return NULL;
}

/* Removes slot s from c (its buffer already taken or freed). */
static void slot_remove(conn *c, rasm *s)
{
    *s = c->slots[c->n_slots - 1];
    c->n_slots--;
}

/*
 * Where the data of a continuation chunk can be opened straight into: its
 * message's reassembly buffer, at the end of what it holds, when the chunk
 * fits the room the buffer already has. It only reads: the header it looks
 * at is not authenticated yet, so nothing is allocated, grown, shed or
 * counted for it; handle_chunk does all that once the record checks out
 * (and finds the data already in place). NULL: open in place and copy.
 */
static uint8_t *chunk_dest(conn *c, const uint8_t *head, size_t head_len, size_t n)
{
    if (head_len < CHUNK_HDR_NEXT || n < CHUNK_HDR_NEXT || (head[4] & FLAG_FIRST))
        return NULL;
    rasm *s = slot_find(c, hm_get_be32(head));
    size_t data = n - CHUNK_HDR_NEXT;
    if (s == NULL || s->discard || s->buf == NULL || data > (size_t)(s->total - s->len) ||
        (size_t)s->len + data > s->cap)
        return NULL;
    return s->buf + s->len;
}

/*
 * Handles one decrypted chunk; returns 0 or a negative code that closes the
 * connection. placed: the chunk's data is already at the end of its
 * message's reassembly buffer (chunk_dest), so it is not copied there.
 */
static int handle_chunk(conn *c, const uint8_t *p, size_t n, int placed)
{
    hm_transport *t = c->t;
    if (n < CHUNK_HDR_NEXT)
        return -EPROTO;
    uint32_t id = hm_get_be32(p);
    uint8_t flags = p[4];
    if (flags & ~(FLAG_FIRST | FLAG_LAST))
        return -EPROTO;
    p += CHUNK_HDR_NEXT;
    n -= CHUNK_HDR_NEXT;

    if (flags & FLAG_FIRST) {
        if (n < 4)
            return -EPROTO;
        uint32_t total = hm_get_be32(p);
        p += 4;
        n -= 4;
        if (total > t->cfg.max_message)
            return -EMSGSIZE;
        if (slot_find(c, id) != NULL)
            return -EPROTO;
        if (flags & FLAG_LAST) {
            if (n != total)
                return -EPROTO;
            deliver(c, p, n);
            return 0;
        }
        if (n >= total)
            return -EPROTO;
        if (c->n_slots >= RASM_SLOTS_MAX)
            return -ENOBUFS;
        if (c->slots == NULL) {
            c->slots = calloc(RASM_SLOTS_MAX, sizeof(*c->slots));
            if (c->slots == NULL)
                return -ENOMEM;
        }
        rasm *s = &c->slots[c->n_slots++];
        memset(s, 0, sizeof(*s));
        s->id = id;
        s->total = total;
        s->last_ms = hm_now_ms();
        s->head_len = (uint8_t)HM_MIN(n, (size_t)HM_TRANSPORT_HEAD_MAX);
        memcpy(s->head, p, s->head_len);
        int r = slot_grow(c, s, n);
        if (r == -ENOBUFS) {
            /* Refused, not the connection: the rest of it is dropped as it arrives. */
            rasm_refused(c, s);
            s->discard = 1;
            s->len = (uint32_t)n;
            return 0;
        }
        if (r < 0)
            return r;
        memcpy(s->buf, p, n);
        s->len = (uint32_t)n;
        return 0;
    }

    rasm *s = slot_find(c, id);
    if (s == NULL)
        return -EPROTO;
    if (n > (size_t)(s->total - s->len))
        return -EPROTO;
    int last = s->len + n == s->total;
    if (last != !!(flags & FLAG_LAST))
        return -EPROTO;
    s->last_ms = hm_now_ms();
    if (!s->discard) {
        int r = slot_grow(c, s, s->len + n);
        if (r == -ENOBUFS) {
            rasm_refused(c, s);
            slot_abort(c, s);
        }
        else if (r < 0)
            return r;
    }
    if (s->discard) {
        s->len += (uint32_t)n;
        if (last)
            slot_remove(c, s);
        return 0;
    }
    if (!placed)
        memcpy(s->buf + s->len, p, n);
    s->len += (uint32_t)n;
    if (!last)
        return 0;
    /* Take the slot out before the callback, which may close the connection. */
    uint8_t *buf = s->buf;
    size_t len = s->len, cap = s->cap;
    rasm_move(c, cap, 0);
    slot_remove(c, s);
    deliver(c, buf, len);
    pool_put(t, buf, cap);
    return 0;
}

/* -- aead: the record cipher the configuration allows -- */
static void hs_set_cipher(hm_transport *t, hm_handshake *hs)
{
    /* auto keeps the handshake's own list, hm_rec_cipher_auto's. */
    if (t->cfg.stream_cipher != 0) {
        uint8_t only = (uint8_t)t->cfg.stream_cipher;
        (void)hm_hs_set_ciphers(hs, &only, 1); /* checked in hm_transport_new */
    }
}

static void hs_complete(conn *c)
{
    hm_transport *t = c->t;
    hm_debug(MOD, "stream with %s peer uses %s", c->outbound ? "dialled" : "inbound",
             hm_rec_cipher_name(hm_hs_cipher(c->hs)));
    hm_hs_finish(c->hs, &c->sess);
    c->have_sess = 1;
    if (t->cfg.rekey_records != 0)
        (void)hm_session_set_rekey_records(&c->sess, t->cfg.rekey_records); /* checked in new */
    free(c->hs);
    c->hs = NULL;
    if (!c->pk_known) {
        memcpy(c->pk, c->sess.peer_pk, HM_PK_BYTES);
        c->pk_known = 1;
        hash_insert(c);
    }
    if (c->counted_hs)
        conn_uncount_hs(c, hm_origin_tab_get(&t->origins, &c->origin, 0));
    t->stats.handshakes_ok++;
    if (!c->outbound)
        t->stats.inbound_handshakes_ok++;
    if (c->probe_cb != NULL) {
        /* The peer proved its key at that address: all a probe asks. */
        c->probe_status = 0;
        conn_close(c, "probe done");
        return;
    }
    c->open_seq = ++t->open_counter;
    int was_up = 0;
    FOREACH_PK_CONN(o, t, c->pk)
        if (o != c && o->state == CONN_OPEN)
            was_up = 1;
    conn_set_state(c, CONN_OPEN, "handshake complete");
    c->open_ms = c->last_progress_ms = hm_now_ms();
    limit_per_peer(c);
    if (c->state != CONN_OPEN || c->draining)
        return; /* c itself was the one replaced: the peer was up already */
    conn_pump(c);
    if (!was_up && c->state == CONN_OPEN && t->cbs.on_conn != NULL)
        t->cbs.on_conn(t->ud, c->pk, 1);
}

/*
 * Datagrams that fail to open and handshakes that fail are what a peer of
 * another swarm, or with another swarm key, looks like (and what a
 * misconfigured bootstrap looks like from its side). One warning a minute
 * at most, with the count and the latest case, so the operator hears of it
 * without a hostile sender filling the log.
 */
static void complain(struct complaint *k, const char *what, const struct sockaddr *from,
                     const char *why)
{
    uint64_t now = hm_now_ms();
    k->count++;
    if (k->last_ms != 0 && now - k->last_ms < 60000)
        return;
    char addr[HM_ADDRSTRLEN];
    if (from == NULL || hm_format_addr(from, addr, sizeof(addr)) != 0)
        hm_strlcpy(addr, "?", sizeof(addr));
    hm_warn(MOD, "%llu %s %s (the latest from %s: %s): a peer of another swarm, with another "
            "swarm key, or with a clock far off?", (unsigned long long)k->count, what,
            k->last_ms == 0 ? "so far" : "in the last minute", addr, why);
    k->last_ms = now;
    k->count = 0;
}

/*
 * A peer of another stream protocol version (most likely an older
 * hivemindd) cannot talk to us at all, which its operator needs to hear of
 * in words that say so; rated like the other complaints.
 */
static void complain_version(hm_transport *t, const struct sockaddr *from, int version)
{
    struct complaint *k = &t->old_version;
    uint64_t now = hm_now_ms();
    t->stats.handshakes_old_version++;
    k->count++;
    if (k->last_ms != 0 && now - k->last_ms < 60000)
        return;
    char addr[HM_ADDRSTRLEN];
    if (from == NULL || hm_format_addr(from, addr, sizeof(addr)) != 0)
        hm_strlcpy(addr, "?", sizeof(addr));
    hm_warn(MOD, "refused %llu connection%s %s from peers of stream protocol version %d (the "
            "latest from %s); this hivemindd speaks version %d only: upgrade the peer",
            (unsigned long long)k->count, k->count == 1 ? "" : "s",
            k->last_ms == 0 ? "so far" : "in the last minute", version, addr, HM_HS_VERSION);
    k->last_ms = now;
    k->count = 0;
}

/*
 * A relay (relay.h) takes over inbound sockets that open with its preamble,
 * or whose handshake names a server key that is not ours (a dialler asking
 * for a peer we relay for). The decision needs the preamble or the whole
 * msg1, which a server waits for anyway, and nothing but plaintext public
 * keys has been read by then. The hook gets its own descriptor (a dup), so
 * our handle closes as usual and the socket lives on in the relay.
 * Returns 1 when diverted (c is closing), -EAGAIN while more bytes are
 * needed, 0 to run the handshake here.
 */
static int divert_check(conn *c)
{
    hm_transport *t = c->t;
    size_t need = HM_HS_MSG1_LEN;
    if (c->rlen >= 1 && c->rbuf[0] == (uint8_t)HM_TRANSPORT_RELAY_MAGIC[0])
        need = HM_TRANSPORT_RELAY_PREAMBLE;
    if (c->rlen < need)
        return -EAGAIN;
    c->divert_checked = 1;
    if (need == HM_HS_MSG1_LEN && memcmp(c->rbuf + 65, t->id.pk, HM_PK_BYTES) == 0)
        return 0;
    uv_os_fd_t fd;
    if (uv_fileno((uv_handle_t *)&c->tcp, &fd) != 0)
        return 0;
    int nfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (nfd < 0)
        return 0;
    int took = t->divert(t->divert_ud, c->rbuf, c->rlen, (const struct sockaddr *)&c->addr, nfd);
    if (!took) {
        close(nfd);
        return 0;
    }
    c->diverted = 1;
    conn_close(c, "handed to the relay");
    return 1;
}

/* Consumes whatever complete handshake messages and records rbuf holds. */
static void conn_process(conn *c)
{
    hm_transport *t = c->t;
    size_t off = 0;

    c->pending_input = 0;
    if (c->state == CONN_HANDSHAKE && !c->outbound && !c->divert_checked && t->divert != NULL) {
        int d = divert_check(c);
        if (d != 0)
            return; /* diverted (closed), or waiting for the rest of msg1 */
    }
    if (c->state == CONN_HANDSHAKE) {
        size_t used = 0;
        int r = hm_hs_input(c->hs, c->rbuf, c->rlen, &used);
        off = used;
        if (c->hs->out_len > 0) {
            int w = conn_write_raw(c, c->hs->out, c->hs->out_len);
            c->hs->out_len = 0;
            if (w < 0) {
                conn_close(c, "handshake write failed");
                return;
            }
        }
        if (r < 0) {
            hm_debug(MOD, "handshake with %s peer failed: %s", c->outbound ? "dialled" : "inbound",
                     hm_strerror(r));
            /* A probe that fails answers its own question; it is no complaint. */
            if (c->probe_cb != NULL)
                c->probe_status = r;
            else if (r == -EPROTONOSUPPORT)
                complain_version(t, conn_from(c), hm_hs_peer_version(c->hs));
            else if (r == -ENOPROTOOPT) {
                t->stats.refused_no_cipher++;
                complain(&t->bad_handshakes, "handshakes failed", conn_from(c),
                         "no stream cipher in common");
            } else
                complain(&t->bad_handshakes, "handshakes failed", conn_from(c), hm_strerror(r));
            conn_close(c, hm_strerror(r));
            return;
        }
        if (r == 1) {
            hs_complete(c);
            if (c->state != CONN_OPEN)
                return;
        }
    }
    while (c->state == CONN_OPEN && off < c->rlen) {
        if (t->faults.stall || t->closing) {
            c->pending_input = 1;
            break;
        }
        /*
         * Opened in place, the chunk header first: a continuation chunk's
         * data then goes straight into its reassembly buffer, anything else
         * is handled out of the read buffer. Either way no byte is acted
         * on before the record authenticates.
         */
        hm_rec_open op;
        int r = hm_session_open_begin(&c->sess, c->rbuf + off, c->rlen - off, CHUNK_HDR_NEXT, &op);
        uint8_t *pt = c->rbuf + off + HM_REC_HEADER, *dest = NULL;
        if (r == 1) {
            dest = chunk_dest(c, pt, op.head_len, op.pt_len);
            r = hm_session_open_end(&c->sess, &op, dest);
        }
        if (r < 0) {
            hm_info(MOD, "closing a stream: bad record (%s)", hm_strerror(r));
            conn_close(c, "bad record");
            return;
        }
        if (r == 0)
            break;
        off += op.consumed;
        c->heard = 1;
        r = handle_chunk(c, pt, op.pt_len, dest != NULL);
        if (r < 0) {
            hm_info(MOD, "closing a stream: framing violation (%s)", hm_strerror(r));
            conn_close(c, "framing violation");
            return;
        }
    }
    if (c->state == CONN_CLOSING)
        return;
    if (off > 0) {
        memmove(c->rbuf, c->rbuf + off, c->rlen - off);
        c->rlen -= off;
    }
    if (c->rlen == RBUF_SIZE) {
        /* A record never exceeds a quarter of the buffer, so this is a peer lying. */
        conn_close(c, "read buffer full");
    }
}

static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    conn *c = s->data;
    hm_transport *t = c->t;
    HM_UNUSED(buf);
    if (c->state == CONN_CLOSING)
        return;
    if (nread == UV_EOF) {
        /*
         * The peer shut its side: it retired this duplicate, or it is going.
         * Our own writes on it finish first (conn_retire), then we close.
         */
        c->got_eof = 1;
        /* No chunk can come any more: a message left half here starts over elsewhere. */
        free_slots(c);
        if (!c->draining)
            conn_retire(c, "peer closed");
        else if (c->shut_done)
            conn_close(c, "retired: both sides done");
        return;
    }
    if (nread < 0) {
        conn_close_handover(c, uv_strerror((int)nread));
        return;
    }
    if (nread == 0)
        return;
    c->rlen += (size_t)nread;
    t->stats.bytes_in += (uint64_t)nread;
    c->last_activity_ms = hm_now_ms();
    conn_process(c);
}

static void conn_start_reading(conn *c)
{
    if (c->reading || c->state == CONN_CLOSING || !c->connected || c->t->faults.stall)
        return;
    int r = uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, read_cb);
    if (r < 0) {
        conn_close(c, uv_strerror(r));
        return;
    }
    c->reading = 1;
}

static void conn_stop_reading(conn *c)
{
    if (!c->reading || c->state == CONN_CLOSING)
        return;
    uv_read_stop((uv_stream_t *)&c->tcp);
    c->reading = 0;
}

/* ------------------------------------------------------- dial and accept */

static void connect_cb(uv_connect_t *req, int status)
{
    conn *c = req->data;
    if (c->state == CONN_CLOSING)
        return;
    if (status < 0) {
        if (c->probe_cb != NULL)
            c->probe_status = status;
        conn_close(c, uv_strerror(status));
        return;
    }
    c->connected = 1;
    uv_tcp_nodelay(&c->tcp, 1);
    c->last_activity_ms = hm_now_ms();
    int r;
    if (c->preamble != NULL) {
        /* A relayed accept: the preamble, then we answer as the server. */
        r = conn_write_raw(c, c->preamble, c->preamble_len);
        free(c->preamble);
        c->preamble = NULL;
    } else {
        r = conn_write_raw(c, c->hs->out, c->hs->out_len);
        c->hs->out_len = 0;
    }
    if (r < 0) {
        conn_close(c, "handshake write failed");
        return;
    }
    conn_start_reading(c);
}

/*
 * A dial leaves from the address we listen on when that is one address
 * (not 0.0.0.0 or ::), so a peer sees our connections come from where our
 * datagrams come from: the origin (origin.h) it charges them to is ours,
 * and a node on 127.0.0.2 is 127.0.0.2 to everyone, not 127.0.0.1.
 */
static int bind_source(hm_transport *t, conn *c, const struct sockaddr *to)
{
    struct sockaddr_storage src = t->local;
    if (src.ss_family != to->sa_family)
        return 0;
    if (src.ss_family == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)&src;
        if (a->sin_addr.s_addr == htonl(INADDR_ANY))
            return 0;
        a->sin_port = 0;
    } else {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&src;
        if (IN6_IS_ADDR_UNSPECIFIED(&a->sin6_addr))
            return 0;
        a->sin6_port = 0;
    }
    return uv_tcp_bind(&c->tcp, (const struct sockaddr *)&src, 0);
}

static int conn_dial(hm_transport *t, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                     conn **out)
{
    if (to->sa_family != AF_INET && to->sa_family != AF_INET6)
        return -EAFNOSUPPORT;
    if (memcmp(pk, t->id.pk, HM_PK_BYTES) == 0)
        return -EINVAL;
    if (live_conns(t) >= t->cfg.max_connections) {
        /* Our own dials come first: an inbound one of the heaviest origin makes room. */
        conn *v = evict_pick(t, OV_CONNS, 0);
        t->stats.refused_max_connections++;
        if (v == NULL)
            return -ENOBUFS;
        conn_evict(v, "evicted for our own dial");
    }
    conn *c;
    int r = conn_new(t, 1, &c);
    if (r < 0)
        return r;
    c->outbound = 1;
    c->pk_known = 1;
    memcpy(c->pk, pk, HM_PK_BYTES);
    memcpy(&c->addr, to, hm_addr_len(to));
    hm_hs_init_client(c->hs, &t->id, t->swarm_id, pk);
    hs_set_cipher(t, c->hs);
    c->connect_req.data = c;
    r = bind_source(t, c, to);
    if (r == 0)
        r = uv_tcp_connect(&c->connect_req, &c->tcp, to, connect_cb);
    if (r < 0) {
        c->quiet = 1;
        conn_close(c, uv_strerror(r));
        return r;
    }
    hash_insert(c);
    *out = c;
    return 0;
}

static void on_connection(uv_stream_t *server, int status)
{
    hm_transport *t = server->data;
    if (status < 0) {
        hm_warn(MOD, "accept: %s", uv_strerror(status));
        return;
    }
    conn *c;
    int r = conn_new(t, 0, &c);
    if (r < 0) {
        /*
         * Without a connection there is nothing to accept into; libuv pauses
         * the listener until the next successful accept.
         */
        hm_warn(MOD, "accept: %s", hm_strerror(r));
        return;
    }
    c->connected = 1;
    r = uv_accept(server, (uv_stream_t *)&c->tcp);
    if (r < 0) {
        conn_close(c, uv_strerror(r));
        return;
    }
    int alen = sizeof(c->addr);
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&c->addr, &alen) < 0) {
        conn_close(c, "no peer address");
        return;
    }
    /* Before any cryptography: admission by origin, rate and share. */
    if (!admit_inbound(t, c)) {
        char o[HM_ORIGIN_STR];
        hm_debug(MOD, "refusing a connection from %s", hm_origin_str(&c->origin, o));
        /* A reset, not a FIN: nothing lingers for a peer that comes back at once. */
        c->reset = 1;
        conn_close(c, "refused by the admission limits");
        return;
    }
    if (conn_bufs(c) < 0) {
        conn_close(c, "out of memory");
        return;
    }
    hm_hs_init_server(c->hs, &t->id, t->swarm_id);
    hs_set_cipher(t, c->hs);
    uv_tcp_nodelay(&c->tcp, 1);
    conn_start_reading(c);
}

/* ---------------------------------------------------------------- datagrams */

static void udp_send_cb(uv_udp_send_t *req, int status)
{
    udp_send *s = (udp_send *)req;
    s->t->udp_pending--;
    if (status == 0)
        s->t->stats.bytes_out += s->len;
    free(s);
}

static int dgram_send_now(hm_transport *t, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                          const void *msg, size_t len)
{
    uint8_t out[HM_DGRAM_MAX];
    size_t n = 0;
    int r = hm_dgram_seal(t->dctx, pk, hm_wall_us(), msg, len, out, sizeof(out), &n);
    if (r < 0)
        return r;
    uv_buf_t b = uv_buf_init((char *)out, (unsigned)n);
    r = uv_udp_try_send(&t->udp, &b, 1, to);
    if (r >= 0) {
        t->stats.dgrams_out++;
        t->stats.bytes_out += n;
        return 0;
    }
    if (r != UV_EAGAIN && r != UV_ENOSYS)
        return r;
    if (t->udp_pending >= UDP_PENDING_MAX)
        return -ENOBUFS;
    udp_send *s = malloc(sizeof(*s) + n);
    if (s == NULL)
        return -ENOMEM;
    s->t = t;
    s->len = n;
    memcpy(s->buf, out, n);
    b = uv_buf_init((char *)s->buf, (unsigned)n);
    r = uv_udp_send(&s->req, &t->udp, &b, 1, to, udp_send_cb);
    if (r < 0) {
        free(s);
        return r;
    }
    t->udp_pending++;
    t->stats.dgrams_out++;
    return 0;
}

static void udp_alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    hm_transport *t = h->data;
    HM_UNUSED(suggested);
    buf->base = (char *)t->udp_rbuf;
    buf->len = sizeof(t->udp_rbuf);
}

static void udp_recv_cb(uv_udp_t *h, ssize_t nread, const uv_buf_t *buf, const struct sockaddr *from,
                        unsigned flags)
{
    hm_transport *t = h->data;
    HM_UNUSED(buf);
    if (nread == 0 || from == NULL || t->closing || t->faults.stall)
        return;
    if (nread < 0) {
        hm_debug(MOD, "udp receive: %s", uv_strerror((int)nread));
        return;
    }
    t->stats.bytes_in += (uint64_t)nread;
    /* Cap and filter before any cryptography. */
    if ((flags & UV_UDP_PARTIAL) || (size_t)nread > HM_DGRAM_MAX ||
        (size_t)nread < HM_DGRAM_OVERHEAD) {
        t->stats.dgrams_rejected++;
        return;
    }
    /* A sender whose key is not cached costs an X25519: rated by origin and in total. */
    if (!hm_dgram_sender_cached(t->dctx, t->udp_rbuf, (size_t)nread) &&
        !dgram_new_key_admit(t, from)) {
        t->stats.dgrams_rejected++;
        return;
    }
    uint8_t sender[HM_PK_BYTES];
    size_t ptlen = 0;
    int r = hm_dgram_open(t->dctx, t->udp_rbuf, (size_t)nread, hm_wall_us(), sender, t->dgram_pt,
                          sizeof(t->dgram_pt), &ptlen);
    if (r < 0) {
        t->stats.dgrams_rejected++;
        hm_debug(MOD, "datagram rejected: %s", hm_strerror(r));
        complain(&t->bad_dgrams, "datagrams failed to authenticate", from, hm_strerror(r));
        return;
    }
    if (is_partitioned(t, sender))
        return;
    t->stats.dgrams_in++;
    if (t->cbs.on_dgram != NULL)
        t->cbs.on_dgram(t->ud, sender, from, t->dgram_pt, ptlen);
}

/* ------------------------------------------------------- delayed sending */

/* The delay of what goes to `to` (or to pk's connection): the longest rule
 * matching the address, else the global delay. */
static uint64_t fault_delay(hm_transport *t, const uint8_t pk[HM_PK_BYTES],
                            const struct sockaddr *to)
{
    if (t->faults.n_delay_rules == 0)
        return t->faults.delay_ms;
    if (to == NULL) {
        conn *c = conn_find(t, pk);
        if (c == NULL)
            return t->faults.delay_ms;
        to = (const struct sockaddr *)&c->addr;
    }
    unsigned bits, rbits;
    const uint8_t *a = delay_key(to, &bits);
    uint64_t delay = t->faults.delay_ms;
    long best = -1;
    for (size_t i = 0; a != NULL && i < t->faults.n_delay_rules; i++) {
        const hm_transport_delay_rule *r = &t->delay_rules[i];
        const uint8_t *b = delay_key((const struct sockaddr *)&r->addr, &rbits);
        if (b != NULL && rbits == bits && (long)r->prefix > best &&
            prefix_match(a, b, r->prefix)) {
            best = r->prefix;
            delay = r->delay_ms;
        }
    }
    return delay;
}

static int stream_send_now(hm_transport *t, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                           const uv_buf_t *bufs, unsigned nbufs, size_t len, int prio,
                           hm_tx_ref *ref, unsigned held)
{
    conn *c = conn_find(t, pk);
    /*
     * A dial still in its handshake at another address than the caller's
     * does not take the message: a NAT'd peer's direct address (learned
     * from its datagrams) never answers, while the one the caller names,
     * its relay's (relay.h), does. The message goes to a dial at `to`.
     */
    if (c != NULL && c->state != CONN_OPEN && c->outbound && to != NULL &&
        !hm_addr_equal((const struct sockaddr *)&c->addr, to)) {
        conn *d = NULL;
        FOREACH_PK_CONN(o, t, pk)
            if (o->state == CONN_HANDSHAKE && o->outbound &&
                hm_addr_equal((const struct sockaddr *)&o->addr, to))
                d = o;
        c = d;
    }
    if (c == NULL) {
        if (to == NULL)
            return -ENOTCONN;
        int r = conn_dial(t, pk, to, &c);
        if (r < 0)
            return r;
    }
    return conn_enqueue(c, bufs, nbufs, len, prio, ref, held);
}

static void arm_delay_timer(hm_transport *t)
{
    if (t->closing)
        return;
    if (t->kick) {
        uv_timer_start(&t->delay_timer, delay_timer_cb, 0, 0);
        return;
    }
    if (TAILQ_EMPTY(&t->delayed_q))
        return;
    uint64_t now = hm_now_us();
    uint64_t due = TAILQ_FIRST(&t->delayed_q)->due_us;
    uv_timer_start(&t->delay_timer, delay_timer_cb, due > now ? (due - now + 999) / 1000 : 0, 0);
}

static void delay_timer_cb(uv_timer_t *h)
{
    hm_transport *t = h->data;
    if (t->kick) {
        t->kick = 0;
        conn *c;
        LIST_FOREACH(c, &t->conns, link) {
            if (c->state == CONN_CLOSING)
                continue;
            conn_start_reading(c);
            if (c->pending_input)
                conn_process(c);
            if (t->closing || t->faults.stall)
                break;
            conn_pump(c);
        }
    }
    uint64_t now = hm_now_us();
    delayed *d;
    while ((d = TAILQ_FIRST(&t->delayed_q)) != NULL && d->due_us <= now && !t->closing) {
        TAILQ_REMOVE(&t->delayed_q, d, link);
        t->delayed_bytes -= d->len;
        const struct sockaddr *to = d->has_to ? (const struct sockaddr *)&d->to : NULL;
        int r;
        if (d->kind == DELAY_DGRAM)
            r = t->faults.stall ? 0 : dgram_send_now(t, d->pk, to, d->data, d->len);
        else {
            uv_buf_t b = uv_buf_init((char *)d->data, (unsigned)d->len);
            r = stream_send_now(t, d->pk, to, &b, 1, d->len, d->prio, NULL, 0);
        }
        if (r < 0)
            hm_debug(MOD, "delayed send failed: %s", hm_strerror(r));
        free(d);
    }
    arm_delay_timer(t);
}

static int delay_push(hm_transport *t, int kind, const uint8_t pk[HM_PK_BYTES],
                      const struct sockaddr *to, const uv_buf_t *bufs, unsigned nbufs, size_t len,
                      int prio, uint64_t delay_ms)
{
    if (t->delayed_bytes + len > t->cfg.max_queued_bytes)
        return -ENOBUFS;
    delayed *d = malloc(sizeof(*d) + len);
    if (d == NULL)
        return -ENOMEM;
    memset(d, 0, sizeof(*d));
    d->due_us = hm_now_us() + delay_ms * 1000u;
    d->kind = kind;
    d->prio = prio;
    memcpy(d->pk, pk, HM_PK_BYTES);
    if (to != NULL) {
        memcpy(&d->to, to, hm_addr_len(to));
        d->has_to = 1;
    }
    d->len = len;
    bufs_copy(d->data, bufs, nbufs);
    /* Keep the list sorted by due time; equal times keep their send order. */
    delayed *after = TAILQ_LAST(&t->delayed_q, delayed_queue);
    while (after != NULL && after->due_us > d->due_us)
        after = TAILQ_PREV(after, delayed_queue, link);
    if (after != NULL)
        TAILQ_INSERT_AFTER(&t->delayed_q, after, d, link);
    else
        TAILQ_INSERT_HEAD(&t->delayed_q, d, link);
    t->delayed_bytes += len;
    arm_delay_timer(t);
    return 0;
}

/* ------------------------------------------------------------ housekeeping */

/* Drops c's inbound messages that had no chunk for rasm_stall_ms, so a
 * sender that stops halfway does not hold its buffer forever. */
static void rasm_expire(conn *c, uint64_t now)
{
    hm_transport *t = c->t;
    for (size_t i = 0; i < c->n_slots; i++) {
        rasm *s = &c->slots[i];
        if (s->cap > 0 && now - s->last_ms >= t->cfg.rasm_stall_ms) {
            hm_debug(MOD, "dropping a %u-byte inbound message: no chunk for %llu ms", s->total,
                     (unsigned long long)(now - s->last_ms));
            slot_abort(c, s);
            t->stats.rasm_stalled++;
        }
    }
}

/*
 * The drain-rate rule: a connection holding more than WR_RATE_FLOOR queued
 * bytes must write at least write_min_rate bytes/s over each window of
 * WR_RATE_WINDOW_MS. A reader that takes a little now and then (1 MiB
 * every 8 s) makes some progress, so write_stall_ms alone never fires on
 * it, but it drains too slowly to keep a queue. The rule holds only under
 * memory pressure, when all queues together hold over half of wq_max_bytes
 * or c's origin over half of its share: an honest volunteer whose uplink
 * gives each of many connections less than the rate is left alone while
 * memory is plentiful. Returns 1 if c was closed.
 */
static int wq_pressure(conn *c)
{
    hm_transport *t = c->t;
    if (t->wq_total > t->cfg.wq_max_bytes / 2)
        return 1;
    hm_origin_ent *e = hm_origin_tab_get(&t->mem_origins, conn_origin(c), 0);
    return e != NULL && e->v[V_WQ] > t->cfg.wq_origin_bytes / 2;
}

static int drain_check(conn *c, uint64_t now)
{
    hm_transport *t = c->t;
    if (t->cfg.write_min_rate == SIZE_MAX || c->unsent + c->inflight <= WR_RATE_FLOOR ||
        !wq_pressure(c)) {
        c->drain_mark_ms = 0;
        return 0;
    }
    if (c->drain_mark_ms == 0) {
        c->drain_mark_ms = now;
        c->drain_mark_bytes = c->bytes_written;
        return 0;
    }
    uint64_t elapsed = now - c->drain_mark_ms;
    if (elapsed < WR_RATE_WINDOW_MS)
        return 0;
    uint64_t wrote = c->bytes_written - c->drain_mark_bytes;
    if (wrote * 1000u < (uint64_t)t->cfg.write_min_rate * elapsed) {
        char who[9];
        pk_short(c->pk, who);
        hm_info(MOD, "closing the stream to %s: drained %llu bytes in %llu ms with %zu queued "
                "(under %zu bytes/s)", who, (unsigned long long)wrote, (unsigned long long)elapsed,
                c->unsent + c->inflight, t->cfg.write_min_rate);
        t->stats.write_too_slow++;
        conn_close(c, "draining too slowly");
        return 1;
    }
    c->drain_mark_ms = now;
    c->drain_mark_bytes = c->bytes_written;
    return 0;
}

static void hk_timer_cb(uv_timer_t *h)
{
    hm_transport *t = h->data;
    /* A stalled node does nothing at all, like a stopped process. */
    if (t->faults.stall || t->closing)
        return;
    uint64_t now = hm_now_ms();
    if (now > POOL_IDLE_MS)
        pool_trim(t, now - POOL_IDLE_MS);
    origin_sweep(&t->origins, hm_now_us());
    origin_sweep(&t->dgram_origins, hm_now_us());
    conn *c, *next;
    LIST_FOREACH_SAFE(c, &t->conns, link, next) {
        if (c->state == CONN_CLOSING) {
            /* its close callback is on its way */
        } else if (c->draining && now - c->drain_ms >= DRAIN_MS) {
            t->stats.drain_expired++;
            conn_close(c, "retired, and not done in time");
        } else if (c->draining) {
            if (c->rasm_bytes > 0)
                rasm_expire(c, now);
        } else if (c->state == CONN_HANDSHAKE && now - c->created_ms >= t->cfg.handshake_timeout_ms) {
            conn_close(c, "handshake timeout");
        } else if (c->state == CONN_OPEN && c->unsent + c->inflight > 0 &&
                   now - c->last_progress_ms >= t->cfg.write_stall_ms) {
            char who[9];
            pk_short(c->pk, who);
            hm_info(MOD, "closing the stream to %s: no write progress for %llu ms (%zu bytes queued)",
                    who, (unsigned long long)t->cfg.write_stall_ms, c->unsent + c->inflight);
            conn_close(c, "write stall");
        } else if (c->state == CONN_OPEN && now - c->last_activity_ms >= t->cfg.idle_close_ms &&
                   c->unsent + c->inflight == 0) {
            conn_retire(c, "idle");
        } else if (c->state == CONN_OPEN && !drain_check(c, now) && c->rasm_bytes > 0) {
            rasm_expire(c, now);
        }
        c = next;
    }
#ifdef __GLIBC__
    /*
     * Queues and reassembly buffers below glibc's mmap threshold live in the
     * heap, whose free pages stay resident until trimmed: after a flood has
     * been shed, hand them back so resident memory comes down again.
     */
    if (t->freed_since_trim >= TRIM_AFTER_BYTES) {
        malloc_trim(0);
        t->freed_since_trim = 0;
    }
#endif
}

/* ---------------------------------------------------------------- setup */

void hm_transport_config_defaults(hm_transport_config *cfg)
{
    if (cfg->max_message == 0)
        cfg->max_message = 80u * 1024u * 1024u;
    if (cfg->max_queued_bytes == 0)
        cfg->max_queued_bytes = cfg->max_message + 16u * 1024u * 1024u;
    if (cfg->max_connections == 0)
        cfg->max_connections = 512;
    if (cfg->idle_close_ms == 0)
        cfg->idle_close_ms = 120000;
    if (cfg->handshake_timeout_ms == 0)
        cfg->handshake_timeout_ms = 5000;
    if (cfg->write_stall_ms == 0)
        cfg->write_stall_ms = 30000;
    if (cfg->dgram_peers == 0)
        cfg->dgram_peers = 65536;
    size_t max = cfg->max_connections;
    if (cfg->max_conns_per_origin == 0)
        cfg->max_conns_per_origin = HM_MIN(max, HM_MAX((size_t)8, max / 8));
    if (cfg->max_handshakes == 0)
        cfg->max_handshakes = HM_MIN(max, HM_MAX((size_t)16, max / 4));
    if (cfg->max_handshakes_per_origin == 0)
        cfg->max_handshakes_per_origin =
            HM_MIN(cfg->max_handshakes, HM_MAX((size_t)4, cfg->max_handshakes / 4));
    if (cfg->max_conns_per_peer == 0)
        cfg->max_conns_per_peer = 4;
    if (cfg->reserved_outbound == 0)
        cfg->reserved_outbound = max / 8;
    if (cfg->reserved_outbound >= max)
        cfg->reserved_outbound = max - 1;
    if (cfg->handshake_rate_per_origin == 0)
        cfg->handshake_rate_per_origin = 64;
    if (cfg->dgram_new_key_rate_per_origin == 0)
        cfg->dgram_new_key_rate_per_origin = 64;
    if (cfg->dgram_new_key_rate == 0)
        cfg->dgram_new_key_rate = 2048;
    if (cfg->rasm_max_bytes == 0)
        cfg->rasm_max_bytes = 512u * 1024u * 1024u;
    if (cfg->rasm_origin_bytes == 0)
        cfg->rasm_origin_bytes = 2 * cfg->max_message + 32u * 1024u * 1024u;
    if (cfg->rasm_stall_ms == 0)
        cfg->rasm_stall_ms = 30000;
    if (cfg->wq_max_bytes == 0)
        cfg->wq_max_bytes = 256u * 1024u * 1024u;
    if (cfg->wq_origin_bytes == 0)
        cfg->wq_origin_bytes = 32u * 1024u * 1024u;
    if (cfg->write_min_rate == 0)
        cfg->write_min_rate = 256u * 1024u;
    if (cfg->notice_origin_bytes == 0)
        cfg->notice_origin_bytes = 64u * 1024u;
}

static void handle_closed_cb(uv_handle_t *h)
{
    hm_transport *t = h->data;
    t->open_handles--;
    maybe_finish_close(t);
}

static void maybe_finish_close(hm_transport *t)
{
    if (!t->closing || t->open_handles > 0 || !LIST_EMPTY(&t->conns))
        return;
    void (*cb)(void *) = t->close_cb;
    void *ud = t->close_ud;
    hm_dgram_ctx_free(t->dctx);
    hm_hmap_free(&t->by_pk);
    hm_origin_tab_free(&t->origins);
    hm_origin_tab_free(&t->dgram_origins);
    if (t->mem_origins_init)
        hm_origin_tab_free(&t->mem_origins);
    free(t->partitioned);
    pool_trim(t, UINT64_MAX);
    hm_identity_wipe(&t->id);
    sodium_memzero(t, sizeof(*t));
    free(t);
    if (cb != NULL)
        cb(ud);
}

/*
 * Binds the TCP listener and the UDP socket to one port. With port 0 the
 * kernel picks the TCP port; the UDP port of the same number may be taken,
 * so that case retries with a new TCP port.
 */
static int bind_sockets(const struct sockaddr *want, int *tcp_fd_out, int *udp_fd_out,
                        struct sockaddr_storage *bound_out)
{
    int want_port = want->sa_family == AF_INET ? ((const struct sockaddr_in *)want)->sin_port
                                               : ((const struct sockaddr_in6 *)want)->sin6_port;
    int attempts = want_port == 0 ? BIND_ATTEMPTS : 1;
    int result = -EADDRINUSE;
    for (int i = 0; i < attempts; i++) {
        int tfd = socket(want->sa_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (tfd < 0)
            return -errno;
        int one = 1;
        setsockopt(tfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(tfd, want, hm_addr_len(want)) < 0) {
            result = -errno;
            close(tfd);
            return result;
        }
        struct sockaddr_storage bound;
        socklen_t blen = sizeof(bound);
        if (getsockname(tfd, (struct sockaddr *)&bound, &blen) < 0) {
            result = -errno;
            close(tfd);
            return result;
        }
        int ufd = socket(want->sa_family, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (ufd < 0) {
            result = -errno;
            close(tfd);
            return result;
        }
        if (bind(ufd, (struct sockaddr *)&bound, hm_addr_len((struct sockaddr *)&bound)) < 0) {
            result = -errno;
            close(ufd);
            close(tfd);
            if (result == -EADDRINUSE)
                continue;
            return result;
        }
        /* A lookup's replies come back together: a node that asks the k
         * closest of several keys at once gets a burst of k times as many
         * datagrams, which the default buffer (about 90 of them on Linux)
         * drops, and a dropped reply costs a second (or a live contact).
         * Best effort: the kernel caps it at net.core.rmem_max. */
        int rcvbuf = UDP_RCVBUF_BYTES;
        (void)setsockopt(ufd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
        *tcp_fd_out = tfd;
        *udp_fd_out = ufd;
        *bound_out = bound;
        return 0;
    }
    return result;
}

int hm_transport_new(uv_loop_t *loop, const hm_identity *id,
                     const uint8_t swarm_id[HM_SWARM_ID_BYTES], const hm_transport_config *cfg,
                     const hm_transport_cbs *cbs, void *ud, hm_transport **out)
{
    int result = 0;
    int tfd = -1, ufd = -1;
    hm_transport *t = NULL;
    struct sockaddr_storage want;

    *out = NULL;
    t = calloc(1, sizeof(*t));
    if (t == NULL)
        return -ENOMEM;
    t->loop = loop;
    LIST_INIT(&t->conns);
    TAILQ_INIT(&t->delayed_q);
    STAILQ_INIT(&t->self_q);
    t->id = *id;
    memcpy(t->swarm_id, swarm_id, HM_SWARM_ID_BYTES);
    if (cfg != NULL)
        t->cfg = *cfg;
    hm_transport_config_defaults(&t->cfg);
    if ((t->cfg.stream_cipher != 0 && hm_rec_cipher_name(t->cfg.stream_cipher) == NULL) ||
        t->cfg.rekey_records > HM_REC_REKEY_RECORDS) {
        result = -EINVAL;
        goto out;
    }
    if (t->cfg.max_message > UINT32_MAX - 1 || t->cfg.max_queued_bytes < t->cfg.max_message) {
        result = -EINVAL;
        goto out;
    }
    /* One message of the largest size always fits every cap. */
    t->cfg.rasm_max_bytes = HM_MAX(t->cfg.rasm_max_bytes, t->cfg.max_message);
    t->cfg.rasm_origin_bytes = HM_MAX(t->cfg.rasm_origin_bytes, t->cfg.max_message);
    t->cfg.wq_max_bytes = HM_MAX(t->cfg.wq_max_bytes, t->cfg.max_message);
    if (cbs != NULL)
        t->cbs = *cbs;
    t->ud = ud;
    /* Seeded from the identity so a test's fault pattern is reproducible. */
    memcpy(&t->rng, id->pk, sizeof(t->rng));
    t->rng |= 1;

    result = hm_parse_hostport(t->cfg.listen != NULL ? t->cfg.listen : "127.0.0.1:0", &want);
    if (result < 0)
        goto out;
    t->cfg.listen = NULL; /* the caller's string need not outlive this call */
    result = hm_dgram_ctx_new(&t->id, swarm_id, t->cfg.dgram_peers, &t->dctx);
    if (result < 0)
        goto out;
    result = hm_hmap_init(&t->by_pk, CONN_BUCKETS, CONN_BUCKETS_MAX);
    if (result < 0)
        goto out;
    result = hm_origin_tab_init(&t->origins, 0);
    if (result < 0)
        goto out;
    t->origins_init = 1;
    result = hm_origin_tab_init(&t->dgram_origins, DGRAM_ORIGINS_MAX);
    if (result < 0)
        goto out;
    t->dgram_origins_init = 1;
    result = hm_origin_tab_init(&t->mem_origins, 0);
    if (result < 0)
        goto out;
    t->mem_origins_init = 1;
    result = bind_sockets((struct sockaddr *)&want, &tfd, &ufd, &t->local);
    if (result < 0)
        goto out;

    /* From here on the handles exist and can only be released asynchronously. */
    t->listener.data = t;
    t->udp.data = t;
    t->hk_timer.data = t;
    t->delay_timer.data = t;
    t->self_timer.data = t;
    uv_tcp_init(loop, &t->listener);
    uv_udp_init(loop, &t->udp);
    uv_timer_init(loop, &t->hk_timer);
    uv_timer_init(loop, &t->delay_timer);
    uv_timer_init(loop, &t->self_timer);
    t->open_handles = 5;
    result = uv_tcp_open(&t->listener, tfd);
    if (result == 0)
        tfd = -1;
    if (result == 0)
        result = uv_udp_open(&t->udp, ufd);
    if (result == 0)
        ufd = -1;
    if (result == 0)
        /* A deep accept queue: under a connection flood the kernel drops an
         * honest SYN only once it is full, and a dropped SYN costs a second. */
        result = uv_listen((uv_stream_t *)&t->listener, SOMAXCONN, on_connection);
    if (result == 0)
        result = uv_udp_recv_start(&t->udp, udp_alloc_cb, udp_recv_cb);
    if (result == 0) {
        uint64_t iv = HM_MIN(t->cfg.handshake_timeout_ms,
                             HM_MIN(t->cfg.idle_close_ms, t->cfg.write_stall_ms)) / 4;
        iv = HM_MAX(iv, (uint64_t)5);
        iv = HM_MIN(iv, (uint64_t)1000);
        result = uv_timer_start(&t->hk_timer, hk_timer_cb, iv, iv);
    }
    if (result < 0) {
        if (tfd >= 0)
            close(tfd);
        if (ufd >= 0)
            close(ufd);
        t->closing = 1;
        t->failed_new = 1;
        uv_close((uv_handle_t *)&t->listener, handle_closed_cb);
        uv_close((uv_handle_t *)&t->udp, handle_closed_cb);
        uv_close((uv_handle_t *)&t->hk_timer, handle_closed_cb);
        uv_close((uv_handle_t *)&t->delay_timer, handle_closed_cb);
        uv_close((uv_handle_t *)&t->self_timer, handle_closed_cb);
        return result;
    }
    {
        char a[HM_ADDRSTRLEN];
        hm_format_addr((struct sockaddr *)&t->local, a, sizeof(a));
        hm_debug(MOD, "listening on %s (tcp and udp)", a);
    }
    /* -- netlab -- before anyone can send: the first pings are delayed too */
    if (t->cfg.faults != NULL)
        hm_transport_set_faults(t, t->cfg.faults);
    t->cfg.faults = NULL;
    *out = t;
    return 0;

out:
    if (tfd >= 0)
        close(tfd);
    if (ufd >= 0)
        close(ufd);
    if (t != NULL) {
        hm_dgram_ctx_free(t->dctx);
        hm_hmap_free(&t->by_pk);
        if (t->origins_init)
            hm_origin_tab_free(&t->origins);
        if (t->dgram_origins_init)
            hm_origin_tab_free(&t->dgram_origins);
        if (t->mem_origins_init)
            hm_origin_tab_free(&t->mem_origins);
        hm_identity_wipe(&t->id);
        free(t);
    }
    return result;
}

int hm_transport_local_addr(hm_transport *t, struct sockaddr_storage *out)
{
    *out = t->local;
    return 0;
}

/* ---------------------------------------------------------------- API */

int hm_transport_send_dgram(hm_transport *t, const uint8_t pk[HM_PK_BYTES],
                            const struct sockaddr *to, const void *msg, size_t len)
{
    if (t->closing)
        return -ECANCELED;
    if (len > HM_DGRAM_MAX_PAYLOAD)
        return -EMSGSIZE;
    if (to == NULL || (to->sa_family != AF_INET && to->sa_family != AF_INET6))
        return -EINVAL;
    if (t->faults.stall || fault_drop(t, pk))
        return 0;
    uint64_t delay = fault_delay(t, pk, to);
    if (delay > 0) {
        uv_buf_t b = uv_buf_init((char *)msg, (unsigned)len);
        return delay_push(t, DELAY_DGRAM, pk, to, &b, 1, len, 0, delay);
    }
    return dgram_send_now(t, pk, to, msg, len);
}

static void self_timer_cb(uv_timer_t *h)
{
    hm_transport *t = h->data;
    /* Refusals first (a copy: the callback may refuse more, or close us). */
    size_t nr = t->n_refused;
    refused_msg *rb = nr > 0 ? malloc(nr * sizeof(*rb)) : NULL;
    if (rb != NULL)
        memcpy(rb, t->refused, nr * sizeof(*rb));
    t->n_refused = 0;
    for (size_t i = 0; rb != NULL && i < nr && !t->closing; i++)
        t->cbs.on_refused(t->ud, rb[i].pk, rb[i].head, rb[i].head_len);
    free(rb);
    /* Only what was queued before this turn: a reply sent from a handler
     * goes out on the next one. */
    STAILQ_HEAD(, selfmsg) batch = STAILQ_HEAD_INITIALIZER(batch);
    STAILQ_CONCAT(&batch, &t->self_q);
    selfmsg *m, *next;
    STAILQ_FOREACH_SAFE(m, &batch, link, next) {
        /* A close from a handler has already zeroed the count. */
        if (!t->closing)
            t->self_bytes -= m->len;
        if (!t->closing && t->cbs.on_message != NULL)
            t->cbs.on_message(t->ud, t->id.pk, (const struct sockaddr *)&t->local, m->data,
                              m->len);
        free(m);
    }
}

static int self_send(hm_transport *t, const uv_buf_t *bufs, unsigned n, size_t len)
{
    if (t->self_bytes + len > t->cfg.max_queued_bytes)
        return -ENOBUFS;
    selfmsg *m = malloc(sizeof(*m) + len);
    if (m == NULL)
        return -ENOMEM;
    m->len = len;
    size_t off = 0;
    for (unsigned i = 0; i < n; i++) {
        if (bufs[i].len > 0)
            memcpy(m->data + off, bufs[i].base, bufs[i].len);
        off += bufs[i].len;
    }
    STAILQ_INSERT_TAIL(&t->self_q, m, link);
    t->self_bytes += len;
    if (!uv_is_active((uv_handle_t *)&t->self_timer))
        uv_timer_start(&t->self_timer, self_timer_cb, 0, 0);
    return 0;
}

int hm_transport_sendv(hm_transport *t, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                       const uv_buf_t *bufs, unsigned n, int prio)
{
    return hm_transport_sendv_ref(t, pk, to, bufs, n, prio, NULL, 0);
}

int hm_transport_sendv_ref(hm_transport *t, const uint8_t pk[HM_PK_BYTES],
                           const struct sockaddr *to, const uv_buf_t *bufs, unsigned n, int prio,
                           hm_tx_ref *ref, unsigned held)
{
    if (t->closing)
        return -ECANCELED;
    if (prio != HM_PRIO_HIGH && prio != HM_PRIO_LOW && prio != HM_PRIO_NOTICE)
        return -EINVAL;
    size_t len = bufs_len(bufs, n);
    if (prio == HM_PRIO_NOTICE && (len > HM_TRANSPORT_NOTICE_MAX || to != NULL))
        return -EINVAL;
    if (len > t->cfg.max_message)
        return -EMSGSIZE;
    if (memcmp(pk, t->id.pk, HM_PK_BYTES) == 0)
        return self_send(t, bufs, n, len);
    if (fault_drop(t, pk))
        return 0;
    uint64_t delay = fault_delay(t, pk, to);
    if (delay > 0) {
        if (to == NULL && conn_find(t, pk) == NULL)
            return -ENOTCONN;
        return delay_push(t, DELAY_STREAM, pk, to, bufs, n, len, prio, delay);
    }
    return stream_send_now(t, pk, to, bufs, n, len, prio, ref, held);
}

int hm_transport_send(hm_transport *t, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                      const void *msg, size_t len, int prio)
{
    if (len > UINT32_MAX)
        return -EMSGSIZE;
    uv_buf_t b = uv_buf_init((char *)msg, (unsigned)len);
    return hm_transport_sendv(t, pk, to, &b, 1, prio);
}

/* A copy of m with its held piece copied in and no hold; NULL without memory. */
static omsg *omsg_copy_held(hm_transport *t, const omsg *m)
{
    size_t cap;
    omsg *n = pool_get(t, sizeof(*n) + m->len, &cap);
    if (n == NULL)
        return NULL;
    size_t after = (size_t)m->len - m->inl - m->elen;
    *n = *m;
    n->cap = cap;
    memcpy(n->data, m->data, m->inl);
    memcpy(n->data + m->inl, m->ext, m->elen);
    memcpy(n->data + m->inl + m->elen, m->data + m->inl, after);
    n->inl = n->elen = 0;
    n->ext = NULL;
    n->ref = NULL;
    return n;
}

void hm_transport_unhold(hm_transport *t, hm_tx_ref *ref)
{
    conn *c;
    LIST_FOREACH(c, &t->conns, link) {
        for (int p = 0; p < 2; p++) {
            struct omsg_queue *lists[2] = {&c->act[p], &c->pend[p]};
            for (int l = 0; l < 2; l++) {
                omsg *m = STAILQ_FIRST(lists[l]);
                while (m != NULL) {
                    omsg *next = STAILQ_NEXT(m, link);
                    omsg *n = m->ref == ref ? omsg_copy_held(t, m) : NULL;
                    if (n != NULL) { /* without memory, m keeps its hold */
                        STAILQ_INSERT_AFTER(lists[l], m, n, link);
                        STAILQ_REMOVE(lists[l], m, omsg, link);
                        omsg_free(t, m);
                    }
                    m = next;
                }
            }
        }
    }
}

int hm_transport_probe(hm_transport *t, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                       hm_transport_probe_cb cb, void *ud)
{
    int result;
    conn *c;
    if (t->closing)
        return -ECANCELED;
    if (cb == NULL || (to->sa_family != AF_INET && to->sa_family != AF_INET6))
        return -EINVAL;
    if (memcmp(pk, t->id.pk, HM_PK_BYTES) == 0)
        return -EINVAL;
    /* A probe never evicts anyone: it is a favour to a peer, not our traffic. */
    if (live_conns(t) >= t->cfg.max_connections) {
        t->stats.refused_max_connections++;
        return -ENOBUFS;
    }
    if ((result = conn_new(t, 1, &c)) < 0)
        return result;
    /* Never in the keyed map: sends, on_conn and the per-peer cap ignore it. */
    c->outbound = 1;
    memcpy(c->pk, pk, HM_PK_BYTES);
    memcpy(&c->addr, to, hm_addr_len(to));
    c->probe_cb = cb;
    c->probe_ud = ud;
    c->probe_status = -ECONNRESET;
    hm_hs_init_client(c->hs, &t->id, t->swarm_id, pk);
    hs_set_cipher(t, c->hs);
    c->connect_req.data = c;
    result = bind_source(t, c, to);
    if (result == 0)
        result = uv_tcp_connect(&c->connect_req, &c->tcp, to, connect_cb);
    if (result < 0) {
        c->quiet = 1;
        conn_close(c, uv_strerror(result));
        return result;
    }
    t->stats.probes++;
    return 0;
}

void hm_transport_set_divert(hm_transport *t, hm_transport_divert_fn fn, void *ud)
{
    t->divert = fn;
    t->divert_ud = ud;
}

int hm_transport_accept_relayed(hm_transport *t, const struct sockaddr *to, const uint8_t *preamble,
                                size_t len, const struct sockaddr *dialler)
{
    int result;
    conn *c;
    if (t->closing)
        return -ECANCELED;
    if (to == NULL || (to->sa_family != AF_INET && to->sa_family != AF_INET6) || preamble == NULL ||
        len == 0 || len > 256 ||
        (dialler != NULL && dialler->sa_family != AF_INET && dialler->sa_family != AF_INET6))
        return -EINVAL;
    if ((result = conn_new(t, 1, &c)) < 0)
        return result;
    /*
     * We dial it (outbound: reach.h does not take it for proof that anyone
     * dials us, and it is never redialled), but the key is not known until
     * the dialler's msg1 arrives through the splice: the handshake runs as
     * the server, and the connection joins the keyed map once it completes
     * (hs_complete), like an inbound one. It is admitted like one too, from
     * the dialler's origin as the relay reports it, or the relay's own
     * address when it reports none: the per-origin connection count and
     * handshake rate, the inbound share with its eviction of the heaviest
     * origin, and then everything it queues and sends is charged there.
     */
    c->outbound = 1;
    memcpy(&c->addr, to, hm_addr_len(to));
    if (dialler != NULL) {
        memcpy(&c->relayed_from, dialler, hm_addr_len(dialler));
        c->have_relayed_from = 1;
    }
    if (!admit_inbound(t, c)) {
        c->quiet = 1;
        conn_close(c, "the relayed dialler's origin is over its share");
        return -EBUSY;
    }
    c->preamble = malloc(len);
    if (c->preamble == NULL) {
        c->quiet = 1;
        conn_close(c, "out of memory");
        return -ENOMEM;
    }
    memcpy(c->preamble, preamble, len);
    c->preamble_len = len;
    c->relayed_accept = 1;
    hm_hs_init_server(c->hs, &t->id, t->swarm_id);
    c->connect_req.data = c;
    result = bind_source(t, c, to);
    if (result == 0)
        result = uv_tcp_connect(&c->connect_req, &c->tcp, to, connect_cb);
    if (result < 0) {
        c->quiet = 1;
        conn_close(c, uv_strerror(result));
        return result;
    }
    t->relayed_accepts++;
    return 0;
}

size_t hm_transport_queued(hm_transport *t, const uint8_t pk[HM_PK_BYTES])
{
    size_t n = 0;
    FOREACH_PK_CONN(c, t, pk)
        n += c->unsent + c->inflight;
    return n;
}

int hm_transport_connected(hm_transport *t, const uint8_t pk[HM_PK_BYTES])
{
    FOREACH_PK_CONN(c, t, pk)
        if (c->state == CONN_OPEN)
            return 1;
    return 0;
}

void hm_transport_disconnect(hm_transport *t, const uint8_t pk[HM_PK_BYTES])
{
    conn *c;
    while ((c = conn_find(t, pk)) != NULL)
        conn_close(c, "disconnect requested");
    LIST_FOREACH(c, &t->conns, link)
        if (c->draining && c->pk_known && memcmp(c->pk, pk, HM_PK_BYTES) == 0)
            conn_close(c, "disconnect requested");
}

void hm_transport_set_faults(hm_transport *t, const hm_transport_faults *f)
{
    int was_stalled = t->faults.stall;
    uint8_t(*part)[HM_PK_BYTES] = NULL;
    size_t n_part = 0;

    if (t->closing)
        return;
    if (f->n_partitioned > 0 && f->partitioned != NULL) {
        part = malloc(f->n_partitioned * HM_PK_BYTES);
        if (part != NULL) {
            memcpy(part, f->partitioned, f->n_partitioned * HM_PK_BYTES);
            n_part = f->n_partitioned;
        } else {
            hm_warn(MOD, "fault injection: out of memory for the partition list");
        }
    }
    free(t->partitioned);
    t->faults = *f;
    t->partitioned = part;
    t->faults.partitioned = (const uint8_t(*)[HM_PK_BYTES])part;
    t->faults.n_partitioned = n_part;
    if (t->faults.drop_rate < 0 || t->faults.drop_rate != t->faults.drop_rate)
        t->faults.drop_rate = 0;
    if (t->faults.drop_rate > 1)
        t->faults.drop_rate = 1;
    /* -- netlab -- the rules are copied, as the partition list is */
    t->faults.n_delay_rules = 0;
    if (f->delay_rules != NULL)
        t->faults.n_delay_rules = HM_MIN(f->n_delay_rules, (size_t)HM_TRANSPORT_DELAY_RULES_MAX);
    if (t->faults.n_delay_rules > 0)
        memcpy(t->delay_rules, f->delay_rules, t->faults.n_delay_rules * sizeof(*f->delay_rules));
    t->faults.delay_rules = t->delay_rules;

    conn *c;
    if (t->faults.stall && !was_stalled) {
        LIST_FOREACH(c, &t->conns, link)
            conn_stop_reading(c);
        uv_udp_recv_stop(&t->udp);
    } else if (!t->faults.stall && was_stalled) {
        uint64_t now = hm_now_ms();
        LIST_FOREACH(c, &t->conns, link) {
            /* Time spent stalled is not the peer's fault. */
            c->last_progress_ms = c->last_activity_ms = now;
            c->drain_mark_ms = 0;
            if (c->state == CONN_HANDSHAKE)
                c->created_ms = now;
        }
        uv_udp_recv_start(&t->udp, udp_alloc_cb, udp_recv_cb);
        /* Resume reading and writing from the loop, not from inside this call. */
        t->kick = 1;
        arm_delay_timer(t);
    }
}

void hm_transport_get_stats(hm_transport *t, hm_transport_stats *out)
{
    *out = t->stats;
    out->rasm_bytes = t->rasm_total;
    out->connections = 0;
    out->queued_bytes = 0;
    out->inbound = t->n_inb;
    out->inbound_handshaking = t->n_inb_hs;
    out->conns_handshake = out->conns_open = out->conns_closing = out->conns_draining = 0;
    const conn *c;
    LIST_FOREACH(c, &t->conns, link) {
        out->conns_handshake += c->state == CONN_HANDSHAKE;
        out->conns_open += c->state == CONN_OPEN && !c->draining;
        out->conns_draining += c->state == CONN_OPEN && c->draining;
        out->conns_closing += c->state == CONN_CLOSING;
        if (c->state == CONN_CLOSING)
            continue;
        out->connections++;
        out->queued_bytes += c->unsent + c->inflight;
    }
}

void hm_transport_limits(hm_transport *t, hm_limit_emit_fn emit, void *ud)
{
    emit(ud, "MaxConnections", t->stats.refused_max_connections);
    emit(ud, "MaxConnectionsPerOrigin", t->stats.refused_per_origin);
    emit(ud, "ReservedOutbound", t->stats.refused_reserved);
    emit(ud, "MaxHandshakes", t->stats.refused_handshakes);
    emit(ud, "MaxHandshakesPerOrigin", t->stats.refused_handshakes_per_origin);
    emit(ud, "MaxConnectionsPerPeer", t->stats.refused_per_peer);
    emit(ud, "HandshakeRatePerOrigin", t->stats.refused_handshake_rate);
    emit(ud, "DgramNewKeyRate", t->stats.refused_dgram_new_key);
    emit(ud, "DgramNewKeyRatePerOrigin", t->stats.refused_dgram_new_key_origin);
    emit(ud, "ReassemblyMaxMiB", t->stats.rasm_refused_total + t->stats.rasm_shed);
    emit(ud, "ReassemblyOriginMiB", t->stats.rasm_refused_origin);
    emit(ud, "ReassemblyStallTimeout", t->stats.rasm_stalled);
    emit(ud, "WriteQueueMaxMiB", t->stats.wq_refused_total + t->stats.wq_shed);
    emit(ud, "WriteQueueOriginMiB", t->stats.wq_refused_origin);
    emit(ud, "WriteMinRate", t->stats.write_too_slow);
    /* -- refusal notices -- */
    emit(ud, "RefusalNoticeOriginKiB", t->stats.notices_refused + t->stats.refusals_untold);
    /* -- aead -- */
    emit(ud, "StreamProtocolVersion", t->stats.handshakes_old_version);
    emit(ud, "StreamCipher", t->stats.refused_no_cipher);
}

void hm_transport_close(hm_transport *t, void (*cb)(void *ud), void *ud)
{
    if (t->closing)
        return;
    t->closing = 1;
    t->close_cb = cb;
    t->close_ud = ud;
    conn *c;
    LIST_FOREACH(c, &t->conns, link)
        conn_close(c, "transport closing");
    delayed *d, *dn;
    TAILQ_FOREACH_SAFE(d, &t->delayed_q, link, dn)
        free(d);
    TAILQ_INIT(&t->delayed_q);
    t->delayed_bytes = 0;
    selfmsg *m, *mn;
    STAILQ_FOREACH_SAFE(m, &t->self_q, link, mn)
        free(m);
    STAILQ_INIT(&t->self_q);
    t->self_bytes = 0;
    uv_close((uv_handle_t *)&t->listener, handle_closed_cb);
    uv_close((uv_handle_t *)&t->udp, handle_closed_cb);
    uv_close((uv_handle_t *)&t->hk_timer, handle_closed_cb);
    uv_close((uv_handle_t *)&t->delay_timer, handle_closed_cb);
    uv_close((uv_handle_t *)&t->self_timer, handle_closed_cb);
}

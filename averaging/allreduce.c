/*
 * allreduce: butterfly all-reduce of one round inside a formed group (the
 * design, the messages and the failure rules are in allreduce.h). This file
 * owns the per-node context (rounds by group id, a short list of finished
 * rounds, one tick timer), each round's sender tasks and reducer chunks,
 * the copy of its input kept for rollback, the end-of-round barrier's
 * state, and the message codecs.
 *
 * Reentrancy: hm_rpc_cancel fires the call's callback synchronously, so a
 * task's generation is bumped before its call is cancelled and a callback
 * whose generation is stale only frees its context. Nothing fires the
 * caller's done_cb except the tick timer, so it never runs inside an rpc
 * handler, a call callback or one of our own functions.
 */
#include "config.h"

#include "averaging/allreduce.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "averaging/codec.h"
#include "averaging/workpool.h"
#include "src/base/util.h"

#define MOD "allreduce"

#define TICK_MS 10
#define TOMBSTONES 64
#define TOMBSTONE_MS (10u * 60u * 1000u)
#define NOTICE_TIMEOUT_MS 2000u
#define RETRY_MIN_MS 10u
#define RETRY_MAX_MS 200u
#define WINDOW_MAX 32u
#define SHARE_BITS 20
/* Vectors up to this many elements (1 MiB of float32) go as one chunk per span. */
#define SMALL_ELEMS ((size_t)1 << 18)
/* How long a message for a round not started yet is held (allreduce.h, "Early parts"). */
#define EARLY_HOLD_MS 2000u
/* Bookkeeping charged per held message on top of its body. */
#define EARLY_OVERHEAD 512u
#define EARLY_MAX_ORIGINS 4096u
/* Header bytes of a part or reply around its chunk data (generous). */
#define MSG_SLACK 256u
/*
 * Chunks waiting for or on a worker, per worker: enough to keep every
 * worker busy while the loop moves the next parts in, few enough that a
 * round's memory is not held in a queue (the rest are averaged on the loop).
 */
#define AR_JOBS_PER_THREAD 32u

enum { T_QUEUED = 0, T_INFLIGHT, T_DONE, T_FAILED };

typedef struct task {
    uint32_t span, chunk;
    size_t off, cnt;
    uint8_t state;
    uint8_t have_result; /* the data region holds an average, not our own values */
    uint8_t attempts;    /* "not ready" retries at the current reducer */
    int to;              /* reducer while in flight */
    uint32_t gen;
    uint64_t call_id;
    uint64_t contrib;     /* who is in the average we hold */
    uint64_t first_try_ms; /* first try at the current reducer, 0 = none */
    uint64_t retry_at_ms;
} task;

/* What a reply's coding needs, copied so that a worker never reads the round. */
typedef struct coding {
    int comp;
    uint64_t dead, bad;
} coding;

/* One chunk open at this node as reducer. */
typedef struct oslot {
    uint64_t first_ms;
    uint64_t have;        /* DATA in */
    uint64_t held;        /* network calls held, answered at finalization */
    float **part;         /* [G]; NULL for self, whose values are read from data */
    double *w;            /* [G] */
    hm_rpc_req **req;     /* [G] */
    size_t self_task;     /* our task waiting here, or SIZE_MAX */
    int busy;             /* its average is being computed on a worker (a job holds it) */
} oslot;

/*
 * One chunk's finalization on a worker: the reduction of its parts and the
 * encoding of every held call's answer. The loop fills the inputs (the
 * weights are the cheap part), the worker reads only the job and the parts
 * it points at (which nothing frees while the slot is busy), and the loop
 * applies the outputs when the job comes back (job_done).
 */
/*
 * A part or an answer as the pieces it is sent in (hm_rpc_callv), so that
 * its chunk is not copied into the message first: the envelope through the
 * chunk's own header, the chunk's bytes where they lie (an uncompressed
 * chunk is the floats themselves) or in its encoding, and a reply's tail.
 */
#define MSGV_HEAD 160
#define MSGV_TAIL 24
typedef struct msgv {
    uint8_t head[MSGV_HEAD];
    uint8_t tail[MSGV_TAIL];
    uint8_t ch[HM_AVG_CHUNK_HEADER]; /* an uncompressed chunk's header */
    size_t chl;                      /* its length, 0 when data is an encoding */
    uint8_t *enc;                    /* the encoding, owned while ref is NULL */
    hm_tx_ref *ref;                  /* our hold on data, lent to the transport */
    const uint8_t *data;
    size_t dlen;
    uv_buf_t b[3];
    unsigned n;
    unsigned held; /* which of b is data, held under ref */
    size_t len;
} msgv;

typedef struct arjob {
    hm_work w;
    LIST_ENTRY(arjob) link; /* in r->jobs while the round lives */
    hm_ar_round *r;         /* NULL once the round is gone: the job owns o then */
    oslot *o;
    size_t s, k, g, cnt;
    uint32_t self_gen;
    /* inputs */
    coding c;
    int aggregate;
    double clip_tau;
    unsigned clip_iters;
    uint64_t have, held;
    size_t m;
    const float *xs[HM_AVG_MAX_GROUP];
    double wt[HM_AVG_MAX_GROUP];
    double total;
    double share[HM_AVG_MAX_GROUP]; /* by member */
    float *self_vals;               /* our values, copied */
    /* outputs */
    float *out;
    hm_tx_ref *out_ref; /* owns out once set: answers send it uncopied */
    msgv *body;         /* uncompressed: one answer for all (its data is out) */
    int err;
    msgv *mine[HM_AVG_MAX_GROUP]; /* compressed: each sender's own */
} arjob;

typedef struct hspan {
    int hosted;
    size_t n_chunks;
    uint8_t *final;
    uint64_t *fcontrib; /* who is in each final chunk's answer, so that a death reopens it */
    oslot **open;
} hspan;

/* A call of ours on "avg.dead": a notice of deaths, or our "done". */
typedef struct notice {
    LIST_ENTRY(notice) link; /* in r->notices while the round runs */
    hm_ar_round *r;
    uint64_t call_id;
    int pending;
    int done;      /* a done announcement (its reply matters) */
    size_t member; /* whom it went to */
} notice;

typedef struct callctx {
    hm_ar_round *r;
    size_t task;
    uint32_t gen;
} callctx;

struct hm_ar_round {
    LIST_ENTRY(hm_ar_round) link; /* in ctx->rounds */
    hm_ar_ctx *ctx;
    hm_avg_group g;
    hm_ar_config cfg;
    float *data;
    size_t n;
    double weight;
    hm_ar_done_cb cb;
    void *ud;
    uint64_t self_bit;
    uint64_t all_mask;
    /*
     * Our values as they came in: a chunk whose average turns out to hold a
     * member found dead later is averaged again from these (allreduce.h,
     * "Rollback").
     */
    float *orig;
    size_t orig_n;       /* elements orig has room for (a reused buffer may be larger) */
    hm_tx_ref *orig_ref; /* owns orig: our parts are sent from it uncopied */

    size_t off[HM_AVG_MAX_GROUP], cnt[HM_AVG_MAX_GROUP], nch[HM_AVG_MAX_GROUP];
    uint64_t share[HM_AVG_MAX_GROUP];
    int cur[HM_AVG_MAX_GROUP]; /* current reducer per span, -1 none */
    hspan hs[HM_AVG_MAX_GROUP];
    size_t n_open;

    task *tasks;
    size_t n_tasks;
    size_t lo; /* first task not complete */

    uint64_t dead, bad, late;
    int reason[HM_AVG_MAX_GROUP];

    /* The end-of-round barrier (allreduce.h, "Rollback"). */
    uint64_t peer_done;                      /* members whose "done" we hold */
    uint64_t peer_over;                      /* members whose round is over ("round over") */
    uint64_t done_pending;                   /* our "done" calls in flight */
    uint64_t peer_done_view[HM_AVG_MAX_GROUP]; /* the view each was sent under */
    uint64_t done_sent;                      /* members our "done" reached (or is on its way to) */
    uint64_t done_sent_view[HM_AVG_MAX_GROUP];
    uint64_t done_retry_at[HM_AVG_MAX_GROUP];
    uint64_t done_first_ms[HM_AVG_MAX_GROUP]; /* first try under "not ready" answers */

    LIST_HEAD(, notice) notices;
    LIST_HEAD(, arjob) jobs; /* chunks being finalized on workers */
    size_t n_jobs;
    uint64_t start_ms, deadline_ms, start_us;
    uint64_t bytes_sent, bytes_recv;
    hm_ar_limit_cfg lim; /* the context's bounds when the round started */
    int status;    /* first failure, 0 while none */
    int finishing; /* finish scheduled for the next tick */
    int leaving;   /* finishing before its end (cancel, close, left out, own values bad) */
    int farewell;  /* ... for a reason of ours (own values bad, a cancel): the others hear */
    int finished;  /* inside finish: callbacks only clean up */
};

/* A message held for a round this node has not started yet. */
typedef struct early {
    TAILQ_ENTRY(early) link;
    int is_dead; /* "avg.dead", else "avg.part" */
    hm_rpc_req *req;
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage from;
    uint8_t gid[HM_AVG_GROUP_ID_BYTES];
    hm_origin origin;
    uint64_t until_ms;
    size_t charge;
    size_t len;
    uint8_t body[];
} early;

typedef struct tombstone {
    uint8_t gid[HM_AVG_GROUP_ID_BYTES];
    uint64_t until_ms;
    int status; /* what its messages are told: -ESRCH (ended) or -ESHUTDOWN (left) */
} tombstone;

struct hm_ar_ctx {
    uv_loop_t *loop;
    hm_rpc *rpc;
    uint8_t pk[HM_PK_BYTES];
    uv_timer_t timer;
    int timer_on;
    LIST_HEAD(, hm_ar_round) rounds;
    tombstone tomb[TOMBSTONES];
    size_t tomb_next;
    int closing;
    void (*close_cb)(void *ud);
    void *close_ud;
    hm_ar_limit_cfg lim;
    /* What the bounds changed (hm_ar_limits). */
    uint64_t weights_clamped, clip_weights_clamped, bandwidths_clamped;
    /* Messages of another protocol version since the last warning. */
    uint64_t old_version_count, old_version_last_ms;
    /* Held for rounds not started yet (allreduce.h, "Early parts"). */
    TAILQ_HEAD(, early) early;
    size_t early_bytes;
    hm_origin_tab early_origins; /* v[0]: bytes held per origin */
    uint64_t early_refused, early_origin_refused;
    hm_workpool *pool; /* NULL: every chunk is finalized on the loop */
    /* The last round's rollback copy, kept for the next round of about its
     * size (orig_take): memory the kernel has already faulted in. */
    float *spare_orig;
    size_t spare_n;
    uint64_t jobs_inline; /* chunks finalized on the loop: no pool, or its queue full */
};

/* Inputs at least this large get their rollback copy in huge pages where the kernel allows. */
#define HUGE_BYTES ((size_t)2 << 20)

static void progress(hm_ar_round *r);

/*
 * The rollback copy of a round's input. A large one is aligned to 2 MiB
 * and marked for transparent huge pages: fresh memory of the vector's size
 * every round otherwise costs one page fault per 4 KiB, which on virtual
 * machines is most of the copy's price.
 */
static float *copy_alloc(size_t n)
{
    size_t bytes = n ? n * sizeof(float) : sizeof(float);
    void *p = NULL;
    if (bytes < HUGE_BYTES)
        return malloc(bytes);
    if (posix_memalign(&p, HUGE_BYTES, bytes) != 0)
        return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}

/*
 * A round's rollback copy. Rounds of one size follow one another (the same
 * model each time), and a fresh 64 MiB copy costs two to three times a
 * copy into memory already faulted in, all of it on the loop at the
 * start of a round: so the last round's buffer is kept, one at a time, and
 * taken by the next round that fits it without being more than twice as
 * large. Between rounds this holds one tensor's worth, no more than a
 * round itself holds.
 */
static float *orig_take(hm_ar_ctx *ctx, size_t n, size_t *cap)
{
    float *p = ctx->spare_orig;
    if (p != NULL && ctx->spare_n >= n && ctx->spare_n / 2 <= n) {
        *cap = ctx->spare_n;
        ctx->spare_orig = NULL;
        ctx->spare_n = 0;
        return p;
    }
    free(p);
    ctx->spare_orig = NULL;
    ctx->spare_n = 0;
    *cap = n;
    return copy_alloc(n);
}

static void orig_give(hm_ar_ctx *ctx, float *p, size_t cap)
{
    if (p != NULL && !ctx->closing && ctx->spare_orig == NULL &&
        cap * sizeof(float) >= HUGE_BYTES) {
        ctx->spare_orig = p;
        ctx->spare_n = cap;
        return;
    }
    free(p);
}

static void apply_view(hm_ar_round *r, uint64_t dead_add, uint64_t bad_add, int reason);

static inline uint64_t bit(size_t i) { return (uint64_t)1 << i; }

/*
 * A member of another averaging protocol version (most likely an older
 * hivemindd) cannot average with us, and its operator needs to hear that
 * in words that say so rather than as a "bad member"; once a minute.
 * Returns 1 when the body was of another version (and counted).
 */
static int complain_version(hm_ar_ctx *ctx, const uint8_t *body, size_t len,
                            const struct sockaddr *from, const char *what)
{
    int version = hm_ar_msg_version(body, len);
    uint64_t now = hm_now_ms();
    char addr[HM_ADDRSTRLEN];

    if (version < 0 || version == HM_AR_VERSION)
        return 0;
    ctx->old_version_count++;
    if (ctx->old_version_last_ms != 0 && now - ctx->old_version_last_ms < 60000)
        return 1;
    if (from == NULL || hm_format_addr(from, addr, sizeof(addr)) != 0)
        hm_strlcpy(addr, "a member", sizeof(addr));
    hm_warn(MOD, "refused %llu averaging message%s %s of protocol version %d (the latest, %s "
            "from %s); this hivemindd speaks averaging version %d only: upgrade the peer",
            (unsigned long long)ctx->old_version_count, ctx->old_version_count == 1 ? "" : "s",
            ctx->old_version_last_ms == 0 ? "so far" : "in the last minute", version, what, addr,
            HM_AR_VERSION);
    ctx->old_version_last_ms = now;
    ctx->old_version_count = 0;
    return 1;
}

/* ================================================================ messages */

static const hm_wire_limits *msg_limits(size_t max_elems, hm_wire_limits *lim)
{
    lim->max_size = max_elems * sizeof(float) + HM_AVG_CHUNK_HEADER + HM_AVG_CHUNK_UINT8_PARAMS +
                    MSG_SLACK;
    lim->max_depth = 1;
    lim->max_elements = 16;
    return lim;
}

static int get_mask(const msgpack_object *o, uint64_t *out) { return hm_wire_get_uint(o, out); }

static int check_chunk(const uint8_t *p, size_t len, size_t max_elems)
{
    size_t n = 0;
    int rc = hm_avg_chunk_peek(p, len, NULL, &n);
    if (rc < 0)
        return rc;
    return n > max_elems ? -EMSGSIZE : 0;
}

int hm_ar_msg_version(const uint8_t *buf, size_t len)
{
    size_t at;
    if (buf == NULL || len < 2)
        return -1;
    if (buf[0] >= 0x91 && buf[0] <= 0x9f) /* fixarray, at least one element */
        at = 1;
    else if (buf[0] == 0xdc && len >= 4) /* array 16 */
        at = 3;
    else
        return -1;
    if (buf[at] <= 0x7f) /* positive fixint: every version so far */
        return buf[at];
    if (buf[at] == 0xcc && len > at + 1) /* uint 8 */
        return buf[at + 1];
    return -1;
}

void hm_ar_part_encode(hm_wire_wr *w, const hm_ar_part_msg *m)
{
    hm_ar_part_encode_head(w, m);
    if (m->data_len > 0)
        hm_wire_wr_raw(w, m->data, m->data_len);
}

void hm_ar_part_encode_head(hm_wire_wr *w, const hm_ar_part_msg *m)
{
    hm_wire_wr_array(w, 12);
    hm_wire_wr_uint(w, HM_AR_VERSION);
    hm_wire_wr_bin(w, m->group_id, HM_AVG_GROUP_ID_BYTES);
    hm_wire_wr_uint(w, m->sender);
    hm_wire_wr_uint(w, m->n_total);
    hm_wire_wr_uint(w, m->span);
    hm_wire_wr_uint(w, m->chunk);
    hm_wire_wr_uint(w, m->kind);
    hm_wire_wr_double(w, m->weight);
    hm_wire_wr_uint(w, m->dead_mask);
    hm_wire_wr_uint(w, m->bad_mask);
    hm_wire_wr_uint(w, m->contrib_mask);
    hm_wire_wr_bin_header(w, m->data_len);
}

int hm_ar_part_decode(const uint8_t *buf, size_t len, size_t max_elems, hm_ar_part_msg *out)
{
    hm_wire_msg m;
    const msgpack_object *it;
    hm_wire_limits lim;
    uint64_t sender, span, chunk, kind;
    const uint8_t *gid, *data;
    uint32_t glen, dlen;
    int result;

    memset(out, 0, sizeof(*out));
    if ((result = hm_wire_decode_open_array(&m, buf, len, msg_limits(max_elems, &lim), 12, 12,
                                            HM_AR_VERSION)) < 0)
        goto out;
    it = m.items;
    if ((result = hm_wire_get_bin(&it[1], &gid, &glen)) < 0 ||
        (result = hm_wire_get_uint(&it[2], &sender)) < 0 ||
        (result = hm_wire_get_uint(&it[3], &out->n_total)) < 0 ||
        (result = hm_wire_get_uint(&it[4], &span)) < 0 ||
        (result = hm_wire_get_uint(&it[5], &chunk)) < 0 ||
        (result = hm_wire_get_uint(&it[6], &kind)) < 0 ||
        (result = hm_wire_get_double(&it[7], &out->weight)) < 0 ||
        (result = get_mask(&it[8], &out->dead_mask)) < 0 ||
        (result = get_mask(&it[9], &out->bad_mask)) < 0 ||
        (result = get_mask(&it[10], &out->contrib_mask)) < 0 ||
        (result = hm_wire_get_bin(&it[11], &data, &dlen)) < 0)
        goto out;
    if (glen != HM_AVG_GROUP_ID_BYTES || sender >= HM_AVG_MAX_GROUP || span >= HM_AVG_MAX_GROUP ||
        chunk > UINT32_MAX || kind > HM_AR_RESULT || !isfinite(out->weight) || out->weight < 0 ||
        (kind == HM_AR_RESULT && out->contrib_mask == 0)) {
        result = -EPROTO;
        goto out;
    }
    if ((result = check_chunk(data, dlen, max_elems)) < 0)
        goto out;
    memcpy(out->group_id, gid, HM_AVG_GROUP_ID_BYTES);
    out->sender = (uint32_t)sender;
    out->span = (uint32_t)span;
    out->chunk = (uint32_t)chunk;
    out->kind = (uint32_t)kind;
    out->data = data;
    out->data_len = dlen;
out:
    hm_wire_decode_close(&m);
    if (result < 0)
        memset(out, 0, sizeof(*out));
    return result;
}

void hm_ar_reply_encode(hm_wire_wr *w, const hm_ar_reply_msg *m)
{
    hm_ar_reply_encode_head(w, m);
    if (m->data != NULL && m->data_len > 0)
        hm_wire_wr_raw(w, m->data, m->data_len);
    hm_ar_reply_encode_tail(w, m);
}

void hm_ar_reply_encode_head(hm_wire_wr *w, const hm_ar_reply_msg *m)
{
    hm_wire_wr_array(w, 7);
    hm_wire_wr_uint(w, HM_AR_VERSION);
    hm_wire_wr_uint(w, m->dead_mask);
    hm_wire_wr_uint(w, m->bad_mask);
    hm_wire_wr_uint(w, m->contrib_mask);
    if (m->data != NULL)
        hm_wire_wr_bin_header(w, m->data_len);
    else
        hm_wire_wr_nil(w);
}

void hm_ar_reply_encode_tail(hm_wire_wr *w, const hm_ar_reply_msg *m)
{
    hm_wire_wr_uint(w, m->form);
    hm_wire_wr_double(w, m->share);
}

int hm_ar_reply_decode(const uint8_t *buf, size_t len, size_t max_elems, hm_ar_reply_msg *out)
{
    hm_wire_msg m;
    const msgpack_object *it;
    hm_wire_limits lim;
    int result;

    uint64_t form;

    memset(out, 0, sizeof(*out));
    if ((result = hm_wire_decode_open_array(&m, buf, len, msg_limits(max_elems, &lim), 7, 7,
                                            HM_AR_VERSION)) < 0)
        goto out;
    it = m.items;
    if ((result = get_mask(&it[1], &out->dead_mask)) < 0 ||
        (result = get_mask(&it[2], &out->bad_mask)) < 0 ||
        (result = get_mask(&it[3], &out->contrib_mask)) < 0 ||
        (result = hm_wire_get_uint(&it[5], &form)) < 0 ||
        (result = hm_wire_get_double(&it[6], &out->share)) < 0)
        goto out;
    /* A difference needs its data; a share is a fraction of the total weight. */
    if (form > HM_AR_FORM_DELTA || !(out->share >= 0.0 && out->share <= 1.0) ||
        (form == HM_AR_FORM_DELTA && it[4].type == MSGPACK_OBJECT_NIL)) {
        result = -EPROTO;
        goto out;
    }
    out->form = (uint32_t)form;
    if (it[4].type != MSGPACK_OBJECT_NIL) {
        const uint8_t *d;
        uint32_t dlen;
        if ((result = hm_wire_get_bin(&it[4], &d, &dlen)) < 0 ||
            (result = check_chunk(d, dlen, max_elems)) < 0)
            goto out;
        out->data = d;
        out->data_len = dlen;
    }
out:
    hm_wire_decode_close(&m);
    if (result < 0)
        memset(out, 0, sizeof(*out));
    return result;
}

void hm_ar_dead_encode(hm_wire_wr *w, const hm_ar_dead_msg *m)
{
    hm_wire_wr_array(w, 7);
    hm_wire_wr_uint(w, HM_AR_VERSION);
    hm_wire_wr_bin(w, m->group_id, HM_AVG_GROUP_ID_BYTES);
    hm_wire_wr_uint(w, m->sender);
    hm_wire_wr_uint(w, m->n_total);
    hm_wire_wr_uint(w, m->dead_mask);
    hm_wire_wr_uint(w, m->bad_mask);
    hm_wire_wr_uint(w, m->done ? 1 : 0);
}

int hm_ar_dead_decode(const uint8_t *buf, size_t len, hm_ar_dead_msg *out)
{
    static const hm_wire_limits lim = {.max_size = 256, .max_depth = 1, .max_elements = 8};
    hm_wire_msg m;
    const msgpack_object *it;
    uint64_t sender, done = 0;
    const uint8_t *gid;
    uint32_t glen, count;
    int result;

    memset(out, 0, sizeof(*out));
    /* The seventh element (done) is optional: a plain notice may omit it. */
    if ((result = hm_wire_decode_open_array(&m, buf, len, &lim, 6, 7, HM_AR_VERSION)) < 0)
        goto out;
    it = m.items;
    count = m.n;
    if ((result = hm_wire_get_bin(&it[1], &gid, &glen)) < 0 ||
        (result = hm_wire_get_uint(&it[2], &sender)) < 0 ||
        (result = hm_wire_get_uint(&it[3], &out->n_total)) < 0 ||
        (result = get_mask(&it[4], &out->dead_mask)) < 0 ||
        (result = get_mask(&it[5], &out->bad_mask)) < 0 ||
        (count == 7 && (result = hm_wire_get_uint(&it[6], &done)) < 0))
        goto out;
    if (glen != HM_AVG_GROUP_ID_BYTES || sender >= HM_AVG_MAX_GROUP || done > 1) {
        result = -EPROTO;
        goto out;
    }
    memcpy(out->group_id, gid, HM_AVG_GROUP_ID_BYTES);
    out->sender = (uint32_t)sender;
    out->done = (uint32_t)done;
out:
    hm_wire_decode_close(&m);
    if (result < 0)
        memset(out, 0, sizeof(*out));
    return result;
}

/* ================================================================== layout */

static int factor_ok(double f) { return isfinite(f) && f >= 1.0; }

static double lower_median_positive(const double *v, size_t n)
{
    return hm_avg_lower_median_positive(v, n);
}

double hm_ar_weight_cap(const double *w, size_t n, double factor)
{
    double med = lower_median_positive(w, n);
    if (!factor_ok(factor))
        factor = HM_AR_WEIGHT_FACTOR_DEFAULT;
    /* The product may overflow to infinity (a median near DBL_MAX): then nothing is above it. */
    return med * factor;
}

/*
 * Integer shares from the bandwidths, each positive one first clamped to
 * factor x the group's lower median (allreduce.h, "Bounds"). Every step is
 * exactly rounded IEEE arithmetic on the same inputs, so every member gets
 * the same shares. *clamped (may be NULL) gets how many were clamped.
 */
static int shares(const hm_avg_group *g, double factor, uint64_t *share, size_t *clamped)
{
    double bw[HM_AVG_MAX_GROUP];
    double max_b = 0;
    if (!factor_ok(factor))
        factor = HM_AR_BANDWIDTH_FACTOR_DEFAULT;
    if (clamped != NULL)
        *clamped = 0;
    for (size_t i = 0; i < g->n; i++) {
        double b = g->members[i].bandwidth;
        bw[i] = (isfinite(b) && b > 0) ? b : 0;
    }
    double cap = hm_avg_bandwidth_cap(g, factor);
    for (size_t i = 0; i < g->n; i++) {
        if (bw[i] > cap) {
            bw[i] = cap;
            if (clamped != NULL)
                (*clamped)++;
        }
        if (bw[i] > max_b)
            max_b = bw[i];
    }
    if (max_b <= 0)
        return -EHOSTUNREACH;
    for (size_t i = 0; i < g->n; i++) {
        double b = bw[i];
        /* b / max_b is correctly rounded and the scaling is exact: the same everywhere. */
        share[i] = b > 0 ? (uint64_t)floor(b / max_b * (double)(1u << SHARE_BITS)) : 0;
    }
    return 0;
}

double hm_ar_bandwidth_factor(const hm_ar_ctx *ctx) { return ctx->lim.bandwidth_factor; }
uint64_t hm_ar_bandwidths_clamped(const hm_ar_ctx *ctx) { return ctx->bandwidths_clamped; }

int hm_ar_layout(const hm_avg_group *g, size_t n, size_t *offsets, size_t *counts)
{
    return hm_ar_layout_bounded(g, n, HM_AR_BANDWIDTH_FACTOR_DEFAULT, offsets, counts);
}

int hm_ar_layout_bounded(const hm_avg_group *g, size_t n, double bandwidth_factor,
                         size_t *offsets, size_t *counts)
{
    uint64_t share[HM_AVG_MAX_GROUP];
    uint64_t total = 0, acc = 0;
    int rc;

    if (g == NULL || g->n == 0 || g->n > HM_AVG_MAX_GROUP)
        return -EINVAL;
    if ((rc = shares(g, bandwidth_factor, share, NULL)) < 0)
        return rc;
    for (size_t i = 0; i < g->n; i++)
        total += share[i];
    if (total == 0)
        return -EHOSTUNREACH;
    for (size_t i = 0; i < g->n; i++) {
        size_t a = (size_t)(((unsigned __int128)n * acc) / total);
        acc += share[i];
        size_t b = (size_t)(((unsigned __int128)n * acc) / total);
        offsets[i] = a;
        counts[i] = b - a;
    }
    return 0;
}

/* ================================================================= views */

static uint64_t out_mask(const hm_ar_round *r) { return r->dead | r->bad; }

static int is_out(const hm_ar_round *r, size_t i) { return (out_mask(r) & bit(i)) != 0; }

/* The current reducer of span s: its owner while live, else the next live
 * member with bandwidth in group order; -1 for an empty span or none left. */
static int reducer_of(const hm_ar_round *r, size_t s)
{
    if (r->cnt[s] == 0)
        return -1;
    for (size_t k = 0; k < r->g.n; k++) {
        size_t j = (s + k) % r->g.n;
        if (r->share[j] > 0 && !is_out(r, j))
            return (int)j;
    }
    return -1;
}

/* ============================================================ reducer side */

static int host_span(hm_ar_round *r, size_t s)
{
    hspan *h = &r->hs[s];
    if (h->hosted)
        return 0;
    h->n_chunks = r->nch[s];
    h->final = calloc(h->n_chunks ? h->n_chunks : 1, 1);
    h->fcontrib = calloc(h->n_chunks ? h->n_chunks : 1, sizeof(*h->fcontrib));
    h->open = calloc(h->n_chunks ? h->n_chunks : 1, sizeof(*h->open));
    if (h->final == NULL || h->fcontrib == NULL || h->open == NULL) {
        free(h->final);
        free(h->fcontrib);
        free(h->open);
        h->final = NULL;
        h->fcontrib = NULL;
        h->open = NULL;
        return -ENOMEM;
    }
    h->hosted = 1;
    return 0;
}

static oslot *slot_new(hm_ar_round *r)
{
    size_t g = r->g.n;
    oslot *o = calloc(1, sizeof(*o));
    if (o == NULL)
        return NULL;
    o->part = calloc(g, sizeof(*o->part));
    o->w = calloc(g, sizeof(*o->w));
    o->req = calloc(g, sizeof(*o->req));
    if (o->part == NULL || o->w == NULL || o->req == NULL) {
        free(o->part);
        free(o->w);
        free(o->req);
        free(o);
        return NULL;
    }
    o->self_task = SIZE_MAX;
    o->first_ms = hm_now_ms();
    return o;
}

static void slot_free_n(size_t g, oslot *o)
{
    for (size_t j = 0; j < g; j++)
        free(o->part[j]);
    free(o->part);
    free(o->w);
    free(o->req);
    free(o);
}

static void slot_free(hm_ar_round *r, oslot *o) { slot_free_n(r->g.n, o); }

static void reply_status(hm_ar_round *r, hm_rpc_req *req, int status)
{
    uint8_t buf[96];
    hm_wire_wr w;
    hm_ar_reply_msg m = {.dead_mask = r != NULL ? r->dead : 0, .bad_mask = r != NULL ? r->bad : 0};
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_ar_reply_encode(&w, &m);
    if (hm_wire_wr_error(&w) == 0 && hm_rpc_respond(req, status, buf, w.len) == 0 && r != NULL)
        r->bytes_sent += w.len;
    else if (hm_wire_wr_error(&w) != 0)
        hm_rpc_respond(req, status, NULL, 0);
}

/* Encodes x with the round's compression; falls back to none when fp16 cannot hold it. */
static uint8_t *encode_chunk(int comp, const float *x, size_t n, size_t *len_out, int *err)
{
    /* An 8-bit chunk of one or two values is longer than a plain one. */
    size_t cap = HM_MAX(hm_avg_chunk_size(HM_AVG_COMP_NONE, n), hm_avg_chunk_size(comp, n));
    uint8_t *buf = malloc(cap ? cap : 1);
    *err = -ENOMEM;
    if (buf == NULL)
        return NULL;
    *err = hm_avg_chunk_encode(comp, x, n, buf, cap, len_out);
    if (*err == -ERANGE)
        *err = hm_avg_chunk_encode(HM_AVG_COMP_NONE, x, n, buf, cap, len_out);
    if (*err < 0) {
        free(buf);
        return NULL;
    }
    return buf;
}

/*
 * Memory lent to the transport uncopied (hm_tx_ref): freed once the
 * transport and its owner have both let go of it.
 */
typedef struct heapref {
    hm_tx_ref ref;
    void *p;
} heapref;

static void heapref_release(hm_tx_ref *ref)
{
    heapref *h = (heapref *)ref;
    free(h->p);
    free(h);
}

/* A hold on p (malloc'd), which it then owns; NULL without memory. */
static hm_tx_ref *heapref_new(void *p)
{
    heapref *h = malloc(sizeof(*h));
    if (h == NULL)
        return NULL;
    h->ref.refs = 1;
    h->ref.release = heapref_release;
    h->p = p;
    return &h->ref;
}

static void msgv_clear(msgv *v)
{
    if (v->ref != NULL)
        hm_tx_ref_drop(v->ref);
    else
        free(v->enc);
    v->ref = NULL;
    v->enc = NULL;
}

static void msgv_free(msgv *v)
{
    if (v != NULL)
        msgv_clear(v);
    free(v);
}

/*
 * x's chunk under comp into v: uncompressed, a header and x's own bytes,
 * held under xref (which owns x; NULL: x is copied when sent); otherwise
 * an encoding that v holds. 0 or encode_chunk's error.
 */
static int msgv_chunk(msgv *v, int comp, const float *x, size_t n, hm_tx_ref *xref)
{
    int err;
    v->enc = NULL;
    v->ref = NULL;
    v->chl = 0;
    if (comp == HM_AVG_COMP_NONE) {
        err = hm_avg_chunk_none_view(x, n, v->ch);
        if (err == 0) {
            v->chl = HM_AVG_CHUNK_HEADER;
            v->data = (const uint8_t *)x;
            v->dlen = n * sizeof(float);
            if (xref != NULL) {
                hm_tx_ref_hold(xref);
                v->ref = xref;
            }
            return 0;
        }
        if (err != -ENOTSUP)
            return err;
    }
    v->enc = encode_chunk(comp, x, n, &v->dlen, &err);
    if (v->enc == NULL)
        return err;
    v->data = v->enc;
    v->ref = heapref_new(v->enc); /* without memory for it, the encoding is copied */
    return 0;
}

static size_t msgv_chunk_len(const msgv *v) { return v->chl + v->dlen; }

/* Closes v's head (written into v->head by w, the chunk's header still to
 * come) and its tail (tail_len bytes in v->tail) into v->b. */
static int msgv_finish(msgv *v, hm_wire_wr *w, size_t tail_len)
{
    if (v->chl > 0)
        hm_wire_wr_raw(w, v->ch, v->chl);
    if (hm_wire_wr_error(w) < 0)
        return -EMSGSIZE;
    v->n = 0;
    v->b[v->n++] = uv_buf_init((char *)v->head, (unsigned)w->len);
    if (v->dlen == 0) /* nothing to hold */
        msgv_clear(v);
    v->held = v->n;
    if (v->dlen > 0)
        v->b[v->n++] = uv_buf_init((char *)v->data, (unsigned)v->dlen);
    if (tail_len > 0)
        v->b[v->n++] = uv_buf_init((char *)v->tail, (unsigned)tail_len);
    v->len = w->len + v->dlen + tail_len;
    return 0;
}

/*
 * One reply body with status 0: vals with the round's compression, as an
 * average (form 0) or as a sender's difference from it (form 1). An
 * uncompressed one refers to vals, which must outlive it.
 */
static msgv *answer_body(const coding *c, const float *vals, hm_tx_ref *vref, size_t cnt,
                         uint64_t contrib, int form, double share, int *err)
{
    msgv *v = calloc(1, sizeof(*v));
    if (v == NULL) {
        *err = -ENOMEM;
        return NULL;
    }
    if ((*err = msgv_chunk(v, c->comp, vals, cnt, vref)) < 0) {
        msgv_free(v);
        return NULL;
    }
    hm_wire_wr w, wt;
    hm_ar_reply_msg m = {.dead_mask = c->dead, .bad_mask = c->bad, .contrib_mask = contrib,
                         .data = v->data, .data_len = msgv_chunk_len(v),
                         .form = (uint32_t)form, .share = share};
    hm_wire_wr_init_fixed(&w, v->head, sizeof(v->head));
    hm_ar_reply_encode_head(&w, &m);
    hm_wire_wr_init_fixed(&wt, v->tail, sizeof(v->tail));
    hm_ar_reply_encode_tail(&wt, &m);
    if (hm_wire_wr_error(&wt) < 0 || (*err = msgv_finish(v, &w, wt.len)) < 0) {
        *err = -EMSGSIZE;
        msgv_free(v);
        return NULL;
    }
    return v;
}

/*
 * Sender j's answer in a compressed round (allreduce.h, "Compressed
 * rounds"): the average minus j's part as we decoded it, or the average
 * itself where that rounds better (members far apart: the difference is
 * larger than the average), with j's share of the weight either way.
 * diff is scratch of cnt floats; ans_cost is hm_avg_coding_cost of the average.
 * A difference that is not finite (two parts near FLT_MAX of opposite
 * signs) never wins.
 */
static msgv *compressed_body(const coding *c, const float *ans, double ans_cost,
                             const float *part, float *diff, size_t cnt, uint64_t contrib,
                             double share, int *err)
{
    double cost;
    if (hm_avg_diff_cost(c->comp, ans, part, diff, cnt, &cost) == 0 && isfinite(cost) &&
        cost < ans_cost)
        return answer_body(c, diff, NULL, cnt, contrib, HM_AR_FORM_DELTA, share, err);
    return answer_body(c, ans, NULL, cnt, contrib, HM_AR_FORM_AVERAGE, share, err);
}

/* vals may be the task's region of the vector itself, already filled. */
static void task_complete(hm_ar_round *r, size_t ti, const float *vals, uint64_t contrib)
{
    task *t = &r->tasks[ti];
    if (vals != r->data + t->off)
        memcpy(r->data + t->off, vals, t->cnt * sizeof(float));
    t->state = T_DONE;
    t->have_result = 1;
    t->contrib = contrib;
    t->gen++;
}

static void set_status(hm_ar_round *r, int status)
{
    if (r->status == 0)
        r->status = status;
}

static void rollback(hm_ar_round *r, uint64_t gone);
static void schedule_tick(hm_ar_ctx *ctx, uint64_t ms);

/*
 * What a message for a round that is over here is told: -ESRCH when the
 * round ended (its barrier or its deadline: a sender still waiting was
 * late), -ESHUTDOWN when this node left it early (a cancel, a close): it is
 * gone for the round, and a sender must not take that as being late.
 */
static int over_status(const hm_ar_round *r) { return r->leaving ? -ESHUTDOWN : -ESRCH; }

/* On a worker: the chunk's average and every held call's answer. */
static void job_work(hm_work *w)
{
    arjob *jb = (arjob *)w;
    size_t cnt = jb->cnt;
    const float *ans = NULL;

    if (jb->have != 0) {
        jb->out = malloc(cnt ? cnt * sizeof(float) : sizeof(float));
        if (jb->out != NULL) {
            int clipped = 0;
            if (jb->aggregate == HM_AR_CENTERED_CLIP && cnt > 0)
                clipped = hm_avg_centered_clip(jb->xs, jb->wt, jb->m, cnt, jb->clip_tau,
                                               jb->clip_iters, jb->out) >= 0;
            if (!clipped) /* double accumulation: exact to float32 rounding */
                hm_avg_weighted_mean(jb->xs, jb->wt, jb->m, cnt, jb->total, jb->out);
            ans = jb->out;
        }
    }
    /*
     * Uncompressed rounds hand everyone the same average; compressed ones
     * hand each sender its own difference from it (allreduce.h,
     * "Compressed rounds").
     */
    jb->err = -ENOMEM;
    if (ans == NULL || jb->held == 0)
        return;
    if (jb->c.comp == HM_AVG_COMP_NONE) {
        /* Sent to every sender uncopied: out is held until the last is sealed. */
        jb->out_ref = heapref_new(jb->out);
        jb->body = answer_body(&jb->c, ans, jb->out_ref, cnt, jb->have, HM_AR_FORM_AVERAGE, 0.0,
                               &jb->err);
        return;
    }
    float *diff = malloc(cnt ? cnt * sizeof(float) : sizeof(float));
    if (diff == NULL)
        return;
    double ans_cost;
    if (hm_avg_coding_cost(jb->c.comp, ans, cnt, &ans_cost) < 0)
        ans_cost = HUGE_VAL; /* not finite: answer_body refuses it anyway */
    for (size_t j = 0; j < jb->g; j++)
        if ((jb->held & bit(j)) && jb->o->part[j] != NULL)
            jb->mine[j] = compressed_body(&jb->c, ans, ans_cost, jb->o->part[j], diff, cnt,
                                          jb->have, jb->share[j], &jb->err);
    free(diff);
}

static void job_free(arjob *jb)
{
    if (jb->r == NULL)
        slot_free_n(jb->g, jb->o);
    for (size_t j = 0; j < jb->g; j++)
        msgv_free(jb->mine[j]);
    msgv_free(jb->body);
    if (jb->out_ref != NULL)
        hm_tx_ref_drop(jb->out_ref);
    else
        free(jb->out);
    free(jb->self_vals);
    free(jb);
}

/*
 * On the loop: hands the answer to every call still held and to our own
 * task, and closes the chunk. An average that holds a member found out
 * while the job ran is not handed out: that member's part leaves the slot,
 * which opens again with the held calls of the others (the next
 * check_slots closes it over them), as if the death had come before the
 * chunk closed; handing it out would only make every sender undo it.
 */
static void job_apply(hm_ar_round *r, arjob *jb)
{
    hspan *h = &r->hs[jb->s];
    oslot *o = jb->o;
    const float *ans = jb->out;
    uint64_t contrib = ans != NULL ? jb->have : 0;
    uint64_t gone = contrib & out_mask(r);

    if (gone != 0) {
        for (size_t j = 0; j < r->g.n; j++) {
            if (!(gone & bit(j)))
                continue;
            if (o->held & bit(j)) { /* slots_drop_member refused it already */
                reply_status(r, o->req[j], -EPERM);
                o->req[j] = NULL;
                o->held &= ~bit(j);
            }
            free(o->part[j]);
            o->part[j] = NULL;
            o->have &= ~bit(j);
        }
        o->busy = 0;
        return;
    }

    for (size_t j = 0; j < r->g.n; j++) {
        if (!(o->held & bit(j)))
            continue;
        const msgv *v = jb->mine[j] != NULL ? jb->mine[j] : jb->body;
        if ((jb->held & bit(j)) && v != NULL) {
            if (hm_rpc_respondv(o->req[j], 0, v->b, v->n, v->ref, v->held) == 0)
                r->bytes_sent += v->len;
        } else {
            reply_status(r, o->req[j], ans == NULL ? -ETIME : jb->err);
        }
        o->req[j] = NULL;
    }
    o->held = 0;
    if (o->self_task != SIZE_MAX) {
        task *t = &r->tasks[o->self_task];
        /* A task sent elsewhere since (its span moved) is not ours to complete. */
        if (t->state == T_INFLIGHT && (size_t)t->to == r->g.self) {
            if (ans != NULL) {
                task_complete(r, o->self_task, ans, contrib);
            } else {
                t->state = T_FAILED;
                set_status(r, -ETIMEDOUT);
            }
        }
    }
    slot_free(r, o);
    h->open[jb->k] = NULL;
    h->final[jb->k] = 1;
    h->fcontrib[jb->k] = contrib;
    r->n_open--;
}

static void job_done(hm_work *w, int cancelled)
{
    arjob *jb = (arjob *)w;
    hm_ar_round *r = jb->r;
    if (r == NULL) {
        job_free(jb);
        return;
    }
    if (cancelled) /* the pool closed under a live round: compute it here */
        job_work(w);
    LIST_REMOVE(jb, link);
    r->n_jobs--;
    job_apply(r, jb);
    job_free(jb);
    if (r->finishing)
        schedule_tick(r->ctx, 0);
    else
        progress(r);
}

/*
 * Closes chunk k of span s: its weights are settled here, its average and
 * answers are computed on a worker (or here when there is no pool or its
 * queue is full), and job_apply hands them out.
 */
static void finalize(hm_ar_round *r, size_t s, size_t k)
{
    hspan *h = &r->hs[s];
    oslot *o = h->open[k];
    size_t off = r->off[s] + k * r->cfg.chunk_elems;
    size_t cnt = HM_MIN(r->cfg.chunk_elems, r->cnt[s] - k * r->cfg.chunk_elems);
    int clip = r->cfg.aggregate == HM_AR_CENTERED_CLIP;
    arjob *jb = calloc(1, sizeof(*jb));

    if (jb == NULL) {
        /* No memory for the job: the chunk closes without an answer. */
        for (size_t j = 0; j < r->g.n; j++)
            if (o->held & bit(j)) {
                reply_status(r, o->req[j], -ENOMEM);
                o->req[j] = NULL;
            }
        o->held = 0;
        o->have = 0;
        arjob none = {.o = o, .s = s, .k = k, .g = r->g.n, .err = -ENOMEM, .self_gen = UINT32_MAX};
        if (o->self_task != SIZE_MAX) {
            r->tasks[o->self_task].state = T_FAILED;
            set_status(r, -ETIMEDOUT);
            o->self_task = SIZE_MAX;
        }
        job_apply(r, &none);
        return;
    }
    jb->w.work = job_work;
    jb->w.done = job_done;
    jb->r = r;
    jb->o = o;
    jb->s = s;
    jb->k = k;
    jb->g = r->g.n;
    jb->cnt = cnt;
    jb->c = (coding){.comp = r->cfg.compression, .dead = r->dead, .bad = r->bad};
    jb->aggregate = r->cfg.aggregate;
    jb->clip_tau = r->cfg.clip_tau;
    jb->clip_iters = r->cfg.clip_iters;
    jb->held = o->held;
    jb->err = -ENOMEM;
    if (o->self_task != SIZE_MAX)
        jb->self_gen = r->tasks[o->self_task].gen;

    if (o->have != 0) {
        size_t who[HM_AVG_MAX_GROUP];
        size_t m = 0;
        double total = 0;
        int ok = 1;
        if ((o->have & r->self_bit) && o->part[r->g.self] == NULL) {
            /* Our values are copied: the round's data may be written (or gone) meanwhile. */
            jb->self_vals = malloc(cnt ? cnt * sizeof(float) : sizeof(float));
            if (jb->self_vals != NULL)
                memcpy(jb->self_vals, r->data + off, cnt * sizeof(float));
            else
                ok = 0;
        }
        for (size_t j = 0; j < r->g.n && ok; j++) {
            if (!(o->have & bit(j)))
                continue;
            jb->xs[m] = o->part[j] != NULL ? o->part[j] : jb->self_vals;
            jb->wt[m] = o->w[j];
            who[m] = j;
            m++;
        }
        /*
         * Weights are the senders' word: each is clamped to a factor of the
         * chunk's median, then all are divided by the largest, so that
         * neither one member's share nor the accumulator can run away
         * (allreduce.h, "Bounds").
         */
        double *w = jb->wt;
        double cap = hm_ar_weight_cap(w, m, clip ? r->lim.clip_weight_factor
                                                 : r->lim.weight_factor);
        double wmax = 0;
        for (size_t j = 0; j < m; j++) {
            if (w[j] > cap) {
                w[j] = cap;
                if (clip)
                    r->ctx->clip_weights_clamped++;
                else
                    r->ctx->weights_clamped++;
            }
            wmax = HM_MAX(wmax, w[j]);
        }
        for (size_t j = 0; j < m && wmax > 0; j++) {
            w[j] /= wmax;
            total += w[j];
        }
        if (total <= 0) /* every weight 0: the plain mean */
            for (size_t j = 0; j < m; j++)
                w[j] = 1.0;
        if (total <= 0)
            total = (double)m;
        /* CenteredClip is not linear in the parts: no share corrects it. */
        for (size_t j = 0; j < m && !clip; j++)
            jb->share[who[j]] = HM_MIN(1.0, w[j] / total);
        jb->m = m;
        jb->total = total;
        jb->have = ok ? o->have : 0;
    }

    o->busy = 1;
    /* A round that is finishing closes its last chunks here, before it is freed. */
    if (!r->finishing && r->ctx->pool != NULL && hm_workpool_submit(r->ctx->pool, &jb->w) == 0) {
        LIST_INSERT_HEAD(&r->jobs, jb, link);
        r->n_jobs++;
        return;
    }
    /* Back-pressure: with the queue full the loop does this chunk itself. */
    if (!r->finishing)
        r->ctx->jobs_inline++;
    job_work(&jb->w);
    job_apply(r, jb);
    job_free(jb);
}

/*
 * The round ends while chunks are on workers: their held calls are
 * refused now, and each job keeps its slot and frees it when it comes back.
 */
static void jobs_detach(hm_ar_round *r)
{
    arjob *jb;
    while ((jb = LIST_FIRST(&r->jobs)) != NULL) {
        LIST_REMOVE(jb, link);
        oslot *o = jb->o;
        for (size_t j = 0; j < r->g.n; j++)
            if (o->held & bit(j)) {
                reply_status(r, o->req[j], over_status(r));
                o->req[j] = NULL;
            }
        o->held = 0;
        r->hs[jb->s].open[jb->k] = NULL;
        r->n_open--;
        jb->r = NULL;
    }
    r->n_jobs = 0;
}

static int slot_complete(const hm_ar_round *r, const oslot *o)
{
    uint64_t expected = r->all_mask & ~out_mask(r) & ~r->late;
    return (expected & ~o->have) == 0;
}

/* Takes a member out of every chunk still open here. */
static void slots_drop_member(hm_ar_round *r, size_t j, int status)
{
    for (size_t s = 0; s < r->g.n; s++) {
        hspan *h = &r->hs[s];
        if (!h->hosted)
            continue;
        for (size_t k = 0; k < h->n_chunks; k++) {
            oslot *o = h->open[k];
            if (o == NULL)
                continue;
            if (o->held & bit(j)) {
                reply_status(r, o->req[j], status);
                o->req[j] = NULL;
                o->held &= ~bit(j);
            }
            /* A busy slot's parts are a worker's until its job comes back. */
            if ((o->have & bit(j)) && !o->busy) {
                free(o->part[j]);
                o->part[j] = NULL;
                o->have &= ~bit(j);
            }
        }
    }
}

static void check_slots(hm_ar_round *r, int force)
{
    if (r->n_open == 0)
        return;
    uint64_t now = hm_now_ms();
    for (size_t s = 0; s < r->g.n; s++) {
        hspan *h = &r->hs[s];
        if (!h->hosted)
            continue;
        for (size_t k = 0; k < h->n_chunks; k++) {
            oslot *o = h->open[k];
            if (o == NULL || o->busy)
                continue;
            if (!force && !slot_complete(r, o) && now >= o->first_ms + r->cfg.part_timeout_ms) {
                /* Senders that missed this chunk's deadline are not waited for again. */
                uint64_t missing =
                    r->all_mask & ~out_mask(r) & ~r->late & ~r->self_bit & ~o->have;
                for (size_t j = 0; j < r->g.n; j++)
                    if (missing & bit(j)) {
                        r->late |= bit(j);
                        if (r->reason[j] == HM_AR_IN)
                            r->reason[j] = HM_AR_LATE;
                        hm_debug(MOD, "member %zu missed a chunk deadline", j);
                    }
            }
            if (force || slot_complete(r, o))
                finalize(r, s, k);
        }
    }
}

/* ============================================================= sender side */

static void found_out(hm_ar_round *r, size_t j, int reason);
static void leave_round(hm_ar_round *r, int status);

/* Member j's "done" counts: it is done under the view we hold now, or its round is over. */
static int done_of(const hm_ar_round *r, size_t j)
{
    if (r->peer_over & bit(j))
        return 1;
    return (r->peer_done & bit(j)) && r->peer_done_view[j] == out_mask(r);
}

/* What member j answered to our "done". */
static void done_reply(hm_ar_round *r, size_t j, int status, const uint8_t *body, size_t len)
{
    hm_ar_dead_msg m;
    uint64_t now = hm_now_ms();

    r->done_pending &= ~bit(j);
    if (is_out(r, j))
        return;
    switch (status) {
    case 0:
        /* The reply carries its view, so that we learn of deaths it knows. */
        if (hm_ar_dead_decode(body, len, &m) == 0 && m.sender == j && m.n_total == r->n &&
            !(r->late & bit(j)) && !((m.dead_mask | m.bad_mask) & r->self_bit) &&
            memcmp(m.group_id, r->g.group_id, HM_AVG_GROUP_ID_BYTES) == 0)
            apply_view(r, m.dead_mask, m.bad_mask, HM_AR_DEAD);
        break;
    case -ESRCH:
        /* Its round is over: it needs nothing more from us, and we can get nothing from it. */
        r->peer_over |= bit(j);
        break;
    case -EAGAIN:
        /* It has not started the round: ask again shortly, for a reducer timeout at most. */
        if (r->done_first_ms[j] == 0)
            r->done_first_ms[j] = now;
        if (now < r->done_first_ms[j] + r->cfg.reducer_timeout_ms) {
            r->done_sent &= ~bit(j);
            r->done_retry_at[j] = now + RETRY_MAX_MS;
            break;
        }
        if (!(r->late & bit(j)))
            found_out(r, j, HM_AR_DEAD);
        break;
    case -EPERM:
        leave_round(r, -EPERM);
        break;
    case -ESTALE:
    case -ECANCELED:
        break;
    default:
        /*
         * No answer: a member we wait for is gone, unless we already hold
         * its own "done" (it had every result, so nothing it sent changes).
         * A late member is not waited for, so its silence changes nothing.
         */
        if (!(r->late & bit(j)) && !done_of(r, j))
            found_out(r, j, HM_AR_DEAD);
        break;
    }
}

static void notice_cb(void *ud, int status, const uint8_t *body, size_t len)
{
    notice *nt = ud;
    hm_ar_round *r = nt->r;
    if (r != NULL)
        r->bytes_recv += len;
    nt->pending = 0;
    if (r == NULL || r->finished) {
        /* finish() unlinks and frees every notice itself. */
        if (r == NULL)
            free(nt);
        return;
    }
    LIST_REMOVE(nt, link);
    if (nt->done) {
        size_t j = nt->member;
        free(nt);
        done_reply(r, j, status, body, len);
        progress(r);
        return;
    }
    free(nt);
}

/* Sends one "avg.dead" call (a notice or our "done") to member j. */
static int notice_send(hm_ar_round *r, size_t j, const uint8_t *buf, size_t len, int done,
                       uint64_t timeout)
{
    notice *nt = calloc(1, sizeof(*nt));
    if (nt == NULL)
        return -ENOMEM;
    nt->r = r;
    nt->pending = 1;
    nt->done = done;
    nt->member = j;
    const hm_avg_member *mb = &r->g.members[j];
    int rc = hm_rpc_call(r->ctx->rpc, mb->pk, (const struct sockaddr *)&mb->addr,
                         HM_AR_DEAD_METHOD, buf, len, HM_RPC_STREAM, timeout, notice_cb, nt,
                         &nt->call_id);
    if (rc < 0) {
        free(nt);
        return rc;
    }
    r->bytes_sent += len;
    LIST_INSERT_HEAD(&r->notices, nt, link);
    return 0;
}

/* Our view as an "avg.dead" body; dead_add: more members named dead in it (farewell). */
static int encode_view(const hm_ar_round *r, int done, uint64_t dead_add, uint8_t *buf,
                       size_t cap, size_t *len)
{
    hm_wire_wr w;
    hm_ar_dead_msg m = {.sender = (uint32_t)r->g.self, .n_total = r->n,
                        .dead_mask = r->dead | dead_add, .bad_mask = r->bad,
                        .done = (uint32_t)done};
    memcpy(m.group_id, r->g.group_id, HM_AVG_GROUP_ID_BYTES);
    hm_wire_wr_init_fixed(&w, buf, cap);
    hm_ar_dead_encode(&w, &m);
    *len = w.len;
    return hm_wire_wr_error(&w);
}

/*
 * Every task of ours is finished: tell each member that is not out, once
 * per view (a view that changes may reopen chunks, so an earlier "done"
 * no longer counts).
 */
static void send_dones(hm_ar_round *r)
{
    uint8_t buf[128];
    size_t len;
    uint64_t now = hm_now_ms(), view = out_mask(r);
    if (now >= r->deadline_ms || encode_view(r, 1, 0, buf, sizeof(buf), &len) != 0)
        return;
    for (size_t j = 0; j < r->g.n; j++) {
        if (j == r->g.self || is_out(r, j) || (r->peer_over & bit(j)) ||
            (r->done_pending & bit(j)) || now < r->done_retry_at[j] ||
            ((r->done_sent & bit(j)) && r->done_sent_view[j] == view))
            continue;
        uint64_t timeout = HM_MIN(r->cfg.reducer_timeout_ms, r->deadline_ms - now);
        if (notice_send(r, j, buf, len, 1, timeout) < 0) {
            r->done_retry_at[j] = now + RETRY_MAX_MS;
            continue;
        }
        r->done_sent |= bit(j);
        r->done_sent_view[j] = view;
        r->done_pending |= bit(j);
    }
}

/* The barrier: every member we wait for (not out, not late) is done under our view. */
static int barrier_met(const hm_ar_round *r)
{
    for (size_t j = 0; j < r->g.n; j++) {
        if (j == r->g.self || is_out(r, j) || (r->late & bit(j)))
            continue;
        if (!done_of(r, j))
            return 0;
    }
    return 1;
}

/* Tells every live member whom we found dead or bad. */
static void broadcast_view(hm_ar_round *r)
{
    uint8_t buf[128];
    size_t len;
    uint64_t now = hm_now_ms();
    if (now >= r->deadline_ms || encode_view(r, 0, 0, buf, sizeof(buf), &len) != 0)
        return;
    for (size_t j = 0; j < r->g.n; j++) {
        if (j == r->g.self || is_out(r, j))
            continue;
        notice_send(r, j, buf, len, 0, HM_MIN(NOTICE_TIMEOUT_MS, r->deadline_ms - now));
    }
}

/* Marks members dead or bad because of what we saw ourselves, and says so. */
static void found_out(hm_ar_round *r, size_t j, int reason)
{
    if (j == r->g.self || is_out(r, j))
        return;
    hm_debug(MOD, "member %zu is %s", j, reason == HM_AR_BAD ? "bad" : "dead");
    if (reason == HM_AR_BAD)
        apply_view(r, 0, bit(j), HM_AR_BAD);
    else
        apply_view(r, bit(j), 0, HM_AR_DEAD);
    broadcast_view(r);
}

static void leave_round(hm_ar_round *r, int status)
{
    set_status(r, status);
    r->finishing = 1;
    r->leaving = 1;
}

/* Leaves for a reason of our own, which the others hear of (farewell). */
static void quit_round(hm_ar_round *r, int status)
{
    r->farewell = 1;
    leave_round(r, status);
}

/*
 * A member that quits a round early (its values are not finite, or its
 * caller cancelled) tells every member still in, once, with a view that
 * counts itself dead: they undo its parts and hand its span to the next
 * reducer at once, as for a member they found dead themselves, instead of
 * finding it late at their part timeout and losing the span. The calls
 * outlive the round (their notices belong to no round).
 */
static void farewell(hm_ar_round *r)
{
    uint8_t buf[128];
    size_t len;
    uint64_t now = hm_now_ms();
    if (now >= r->deadline_ms || r->g.n < 2 ||
        encode_view(r, 0, r->self_bit, buf, sizeof(buf), &len) != 0)
        return;
    for (size_t j = 0; j < r->g.n; j++) {
        if (j == r->g.self || is_out(r, j))
            continue;
        notice *nt = calloc(1, sizeof(*nt));
        if (nt == NULL)
            return;
        nt->pending = 1;
        nt->member = j;
        const hm_avg_member *mb = &r->g.members[j];
        if (hm_rpc_call(r->ctx->rpc, mb->pk, (const struct sockaddr *)&mb->addr,
                        HM_AR_DEAD_METHOD, buf, len, HM_RPC_STREAM,
                        HM_MIN(NOTICE_TIMEOUT_MS, r->deadline_ms - now), notice_cb, nt,
                        &nt->call_id) < 0)
            free(nt);
        else
            r->bytes_sent += len;
    }
}

static void task_retry(task *t)
{
    uint64_t now = hm_now_ms();
    unsigned shift = t->attempts < 5 ? t->attempts : 5;
    t->state = T_QUEUED;
    t->attempts++;
    t->retry_at_ms = now + HM_MIN((uint64_t)RETRY_MIN_MS << shift, (uint64_t)RETRY_MAX_MS);
    t->gen++;
}

/*
 * A compressed round's answer (allreduce.h, "Compressed rounds"): vals
 * holds what the reducer sent, decoded (form 1: the average minus our part
 * as the reducer decoded it; form 0: the average), and becomes our result,
 * with our share of our own rounding taken out. -ENOMEM, or -EDOM when the
 * result is not finite (a hostile answer near FLT_MAX).
 */
static int apply_answer(hm_ar_round *r, const task *t, float *vals, int form, double share)
{
    const float *x = r->orig + t->off;
    float *qx = malloc(t->cnt ? t->cnt * sizeof(float) : sizeof(float));
    int rc;
    if (qx == NULL)
        return -ENOMEM;
    /* The same choice as encode_chunk: a chunk fp16 cannot hold went uncompressed. */
    rc = hm_avg_chunk_roundtrip(r->cfg.compression, x, t->cnt, qx);
    if (rc == -ERANGE)
        rc = hm_avg_chunk_roundtrip(HM_AVG_COMP_NONE, x, t->cnt, qx);
    if (rc == 0) {
        hm_avg_answer_apply(vals, x, qx, vals, t->cnt, form == HM_AR_FORM_DELTA, share);
        rc = hm_avg_all_finite(vals, t->cnt) ? 0 : -EDOM;
    }
    free(qx);
    return rc;
}

/* An answer refused after decoding: in our vector (direct), our own values go back. */
static void vals_drop(hm_ar_round *r, const task *t, float *vals, int direct)
{
    if (direct)
        memcpy(r->data + t->off, r->orig + t->off, t->cnt * sizeof(float));
    else
        free(vals);
}

static void part_cb(void *ud, int status, const uint8_t *body, size_t len)
{
    callctx *cc = ud;
    hm_ar_round *r = cc->r;
    task *t = &r->tasks[cc->task];
    hm_ar_reply_msg rep;
    int rc;

    if (r->finished || t->gen != cc->gen || t->state != T_INFLIGHT) {
        free(cc);
        return;
    }
    free(cc);
    r->bytes_recv += len;
    size_t red = (size_t)t->to;
    int good = !is_out(r, red) && !(r->late & bit(red));
    rc = hm_ar_reply_decode(body, len, r->cfg.chunk_elems, &rep);
    if (rc == 0 && good && !((rep.dead_mask | rep.bad_mask) & r->self_bit))
        apply_view(r, rep.dead_mask, rep.bad_mask, HM_AR_DEAD);
    if (t->state != T_INFLIGHT || t->to != (int)red) /* the view moved the task elsewhere */
        goto out;

    switch (status) {
    case 0: {
        /* What can be judged before a value is written: who is in it, its count. */
        int pc;
        size_t pn = 0;
        if (rc < 0 || rep.data == NULL || (rep.contrib_mask & ~r->all_mask) != 0 ||
            !(rep.contrib_mask & r->self_bit) ||
            hm_avg_chunk_peek(rep.data, rep.data_len, &pc, &pn) < 0 || pn != t->cnt) {
            if (rc < 0)
                complain_version(r->ctx, body, len, (const struct sockaddr *)&r->g.members[red].addr,
                                 "a reply");
            t->state = T_QUEUED;
            t->gen++;
            found_out(r, red, HM_AR_BAD);
            break;
        }
        if (rep.contrib_mask & out_mask(r)) {
            /*
             * The average holds a member we know is out (the reducer had
             * not heard yet): send our values again, with our view, so that
             * it reopens the chunk and averages it without that member.
             */
            task_retry(t);
            break;
        }
        /*
         * An average with no share (uncompressed rounds) is taken as it is,
         * exactly: decoded straight into our vector. Only values that do
         * not decode (not finite: a bad reducer) are refused after that,
         * and the chunk then gets its values from the round's start back.
         */
        int direct = rep.form != HM_AR_FORM_DELTA && !(rep.share > 0);
        float *vals =
            direct ? r->data + t->off : malloc(t->cnt ? t->cnt * sizeof(float) : sizeof(float));
        size_t got = 0;
        if (vals == NULL) {
            task_retry(t);
            break;
        }
        if (hm_avg_chunk_decode(rep.data, rep.data_len, vals, t->cnt, &got) < 0 || got != t->cnt) {
            vals_drop(r, t, vals, direct);
            t->state = T_QUEUED;
            t->gen++;
            found_out(r, red, HM_AR_BAD);
            break;
        }
        if (!direct && (rc = apply_answer(r, t, vals, (int)rep.form, rep.share)) < 0) {
            vals_drop(r, t, vals, direct);
            if (rc == -ENOMEM) {
                task_retry(t);
                break;
            }
            t->state = T_QUEUED;
            t->gen++;
            found_out(r, red, HM_AR_BAD);
            break;
        }
        task_complete(r, (size_t)(t - r->tasks), vals, rep.contrib_mask);
        if (!direct)
            free(vals);
        break;
    }
    case -EAGAIN:
    case -ENOBUFS:
    case -EXDEV:
        if (hm_now_ms() >= t->first_try_ms + r->cfg.reducer_timeout_ms) {
            t->state = T_QUEUED;
            t->gen++;
            found_out(r, red, HM_AR_DEAD);
        } else {
            task_retry(t);
        }
        break;
    case -ETIME:
    case -ESRCH:
        /* We were late for this chunk: it keeps our values. */
        t->state = T_FAILED;
        t->gen++;
        set_status(r, -ETIMEDOUT);
        break;
    case -EPROTO:
    case -EINVAL:
    case -EDOM:
    case -EMSGSIZE:
        /*
         * Our part passed our own checks (finite, our layout), so a reducer
         * that calls it malformed disagrees with us about the round: it is
         * the one left out, and the span goes to the next reducer.
         */
        t->state = T_QUEUED;
        t->gen++;
        found_out(r, red, HM_AR_BAD);
        break;
    case -EPERM:
        t->state = T_FAILED;
        t->gen++;
        hm_debug(MOD, "member %zu left us out (%s)", red, hm_strerror(status));
        leave_round(r, -EPERM);
        break;
    case -ECANCELED:
        /* Not our cancel (the generation matched): the rpc layer is closing. */
        t->state = T_FAILED;
        t->gen++;
        leave_round(r, -ECANCELED);
        break;
    default:
        /* Timed out, connection lost, view conflict or anything else: the reducer is gone. */
        t->state = T_QUEUED;
        t->gen++;
        found_out(r, red, HM_AR_DEAD);
        break;
    }
out:
    progress(r);
}

/* Our own part of a chunk we reduce: no network, values read in place. */
static void submit_local(hm_ar_round *r, size_t ti)
{
    task *t = &r->tasks[ti];
    hspan *h = &r->hs[t->span];
    size_t self = r->g.self;

    if (host_span(r, t->span) < 0) {
        task_retry(t);
        return;
    }
    if (h->final[t->chunk]) {
        t->state = T_FAILED;
        set_status(r, -ETIMEDOUT);
        return;
    }
    oslot *o = h->open[t->chunk];
    if (o != NULL && o->busy)
        return; /* closing on a worker: tried again once it is final */
    if (r->cfg.input_checked && !hm_avg_all_finite(r->data + t->off, t->cnt)) {
        /* As encode_chunk refuses a part bound for another reducer. */
        t->state = T_FAILED;
        quit_round(r, -EDOM);
        return;
    }
    if (o == NULL) {
        if ((o = slot_new(r)) == NULL) {
            task_retry(t);
            return;
        }
        h->open[t->chunk] = o;
        r->n_open++;
    }
    o->have |= bit(self);
    o->w[self] = r->weight;
    o->self_task = ti;
    t->state = T_INFLIGHT;
    t->to = (int)self;
    t->gen++;
}

static void send_task(hm_ar_round *r, size_t ti)
{
    task *t = &r->tasks[ti];
    int red = r->cur[t->span];
    uint64_t now = hm_now_ms();
    int err;

    if (red < 0) {
        t->state = T_FAILED;
        set_status(r, -EHOSTUNREACH);
        return;
    }
    if ((size_t)red == r->g.self) {
        submit_local(r, ti);
        return;
    }
    if (now >= r->deadline_ms)
        return;
    if (t->first_try_ms == 0)
        t->first_try_ms = now;

    /* From our input as it came in, which a compressed answer is relative to. */
    msgv v;
    if ((err = msgv_chunk(&v, r->cfg.compression, r->orig + t->off, t->cnt, r->orig_ref)) < 0) {
        if (err == -EDOM) {
            /* Our own values are not finite (changed during the round): we cannot take part. */
            t->state = T_FAILED;
            quit_round(r, -EDOM);
        } else {
            task_retry(t);
        }
        return;
    }
    hm_ar_part_msg m = {
        .sender = (uint32_t)r->g.self,
        .n_total = r->n,
        .span = t->span,
        .chunk = t->chunk,
        .kind = HM_AR_DATA,
        .weight = r->weight,
        .dead_mask = r->dead,
        .bad_mask = r->bad,
        .contrib_mask = 0,
        .data = v.data,
        .data_len = msgv_chunk_len(&v),
    };
    memcpy(m.group_id, r->g.group_id, HM_AVG_GROUP_ID_BYTES);
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, v.head, sizeof(v.head));
    hm_ar_part_encode_head(&w, &m);
    callctx *cc = NULL;
    if (msgv_finish(&v, &w, 0) < 0 || (cc = calloc(1, sizeof(*cc))) == NULL) {
        msgv_clear(&v);
        task_retry(t);
        return;
    }
    t->gen++;
    cc->r = r;
    cc->task = ti;
    cc->gen = t->gen;
    uint64_t budget = t->first_try_ms + r->cfg.reducer_timeout_ms;
    uint64_t until = HM_MIN(budget, r->deadline_ms);
    uint64_t timeout = until > now ? until - now : 1;
    const hm_avg_member *mb = &r->g.members[red];
    int rc = hm_rpc_callv(r->ctx->rpc, mb->pk, (const struct sockaddr *)&mb->addr,
                          HM_AR_PART_METHOD, v.b, v.n, v.ref, v.held, HM_RPC_STREAM, timeout,
                          part_cb, cc, &t->call_id);
    msgv_clear(&v);
    if (rc == -ENOBUFS) {
        free(cc);
        task_retry(t);
        return;
    }
    if (rc < 0) {
        free(cc);
        t->state = T_QUEUED;
        found_out(r, (size_t)red, HM_AR_DEAD);
        return;
    }
    r->bytes_sent += v.len;
    t->state = T_INFLIGHT;
    t->to = red;
}

/* Puts our own values back into a task's region and queues it to be sent again. */
static void task_reset(hm_ar_round *r, task *t)
{
    if (t->state == T_INFLIGHT) {
        t->gen++;
        t->state = T_QUEUED;
        if ((size_t)t->to != r->g.self)
            hm_rpc_cancel(r->ctx->rpc, t->call_id);
    }
    if (t->have_result) {
        memcpy(r->data + t->off, r->orig + t->off, t->cnt * sizeof(float));
        t->have_result = 0;
        t->contrib = 0;
    }
    t->state = T_QUEUED;
    t->first_try_ms = 0;
    t->retry_at_ms = 0;
    t->attempts = 0;
    t->gen++;
    r->lo = 0;
}

/*
 * Rollback (allreduce.h): every average that holds a member now out is
 * undone, on both sides. As a sender, each such chunk gets our own values
 * back and is sent again; as a reducer, each such final chunk is reopened,
 * so that the parts sent again are averaged over the members still in.
 */
static void rollback(hm_ar_round *r, uint64_t gone)
{
    for (size_t i = 0; i < r->n_tasks; i++) {
        task *t = &r->tasks[i];
        if (t->state == T_DONE && (t->contrib & gone))
            task_reset(r, t);
    }
    for (size_t s = 0; s < r->g.n; s++) {
        hspan *h = &r->hs[s];
        if (!h->hosted)
            continue;
        for (size_t k = 0; k < h->n_chunks; k++)
            if (h->final[k] && (h->fcontrib[k] & gone)) {
                h->final[k] = 0;
                h->fcontrib[k] = 0;
            }
    }
}

/* Every span whose reducer changed is sent again to its new reducer. */
static void reroute(hm_ar_round *r)
{
    for (size_t s = 0; s < r->g.n; s++) {
        int now_red = reducer_of(r, s);
        if (now_red == r->cur[s])
            continue;
        hm_debug(MOD, "span %zu moves from member %d to member %d", s, r->cur[s], now_red);
        r->cur[s] = now_red;
        /*
         * The new reducer averages every chunk of the span again from
         * everyone's own values, so that all survivors end with the same
         * average over themselves.
         */
        for (size_t i = 0; i < r->n_tasks; i++) {
            task *t = &r->tasks[i];
            if (t->span == s && t->state != T_FAILED)
                task_reset(r, t);
        }
    }
}

static void apply_view(hm_ar_round *r, uint64_t dead_add, uint64_t bad_add, int reason)
{
    dead_add &= r->all_mask & ~r->self_bit;
    bad_add &= r->all_mask & ~r->self_bit;
    uint64_t fresh = (dead_add | bad_add) & ~out_mask(r);
    if (fresh == 0)
        return;
    r->dead |= dead_add & fresh;
    r->bad |= bad_add & fresh;
    for (size_t j = 0; j < r->g.n; j++) {
        if (!(fresh & bit(j)))
            continue;
        r->reason[j] = (bad_add & bit(j)) ? HM_AR_BAD : (reason == HM_AR_BAD ? HM_AR_DEAD : reason);
        slots_drop_member(r, j, -EPERM);
    }
    rollback(r, fresh);
    reroute(r);
}

static int task_open(const task *t) { return t->state == T_QUEUED || t->state == T_INFLIGHT; }

static void pump(hm_ar_round *r)
{
    uint64_t now = hm_now_ms();
    int again = 1;
    while (again && !r->finishing) {
        again = 0;
        while (r->lo < r->n_tasks && !task_open(&r->tasks[r->lo]))
            r->lo++;
        size_t end = HM_MIN(r->n_tasks, r->lo + r->cfg.window);
        for (size_t i = r->lo; i < end && !r->finishing; i++) {
            task *t = &r->tasks[i];
            if (t->state != T_QUEUED || now < t->retry_at_ms)
                continue;
            send_task(r, i);
            if (t->state != T_QUEUED)
                again = 1;
        }
        if (again)
            check_slots(r, 0);
    }
}

static void schedule_tick(hm_ar_ctx *ctx, uint64_t ms);

static void progress(hm_ar_round *r)
{
    if (r->finished)
        return;
    check_slots(r, 0);
    pump(r);
    check_slots(r, 0);
    if (!r->finishing) {
        int done = 1;
        for (size_t i = r->lo; done && i < r->n_tasks; i++)
            if (task_open(&r->tasks[i]))
                done = 0;
        /*
         * Our results are final only once every member we wait for is done
         * under the same view (allreduce.h, "Rollback"); until then we keep
         * serving our chunks, which a late death may reopen.
         */
        if (done) {
            send_dones(r);
            if (!r->finishing && barrier_met(r))
                r->finishing = 1;
        }
    }
    if (r->finishing)
        schedule_tick(r->ctx, 0);
}

/* ============================================================== inbound */

static hm_ar_round *round_find(hm_ar_ctx *ctx, const uint8_t *gid)
{
    hm_ar_round *r;
    LIST_FOREACH(r, &ctx->rounds, link)
        if (memcmp(r->g.group_id, gid, HM_AVG_GROUP_ID_BYTES) == 0)
            return r;
    return NULL;
}

/* A round of that group that ended here: its over_status, else 0. */
static int tomb_find(hm_ar_ctx *ctx, const uint8_t *gid)
{
    uint64_t now = hm_now_ms();
    for (size_t i = 0; i < TOMBSTONES; i++)
        if (ctx->tomb[i].until_ms > now &&
            memcmp(ctx->tomb[i].gid, gid, HM_AVG_GROUP_ID_BYTES) == 0)
            return ctx->tomb[i].status;
    return 0;
}

/* Status for a message about a group that has no running round here. */
static int no_round_status(hm_ar_ctx *ctx, const uint8_t *gid)
{
    if (ctx->closing)
        return -ESHUTDOWN;
    int st = tomb_find(ctx, gid);
    return st != 0 ? st : -EAGAIN;
}

/* Common checks of a member's message; returns 0 or the refusal status. */
static int check_sender(hm_ar_round *r, uint32_t sender, const uint8_t pk[HM_PK_BYTES],
                        uint64_t n_total, uint64_t dead_mask, uint64_t bad_mask)
{
    if (sender >= r->g.n || sender == r->g.self ||
        memcmp(r->g.members[sender].pk, pk, HM_PK_BYTES) != 0)
        return -EPERM;
    if (is_out(r, sender))
        return -EPERM;
    if (n_total != r->n) {
        /* A member averaging a vector of another size: nothing it says can be used. */
        found_out(r, sender, HM_AR_BAD);
        return -EINVAL;
    }
    if ((dead_mask | bad_mask) & r->self_bit)
        return -ESTALE;
    /* Views are taken only from members in good standing (see allreduce.h). */
    if (!(r->late & bit(sender)))
        apply_view(r, dead_mask, bad_mask, HM_AR_DEAD);
    return 0;
}

/* ============================================================ early parts */

/*
 * Holds a message for a group with no round here yet (allreduce.h, "Early
 * parts"): 0, or -ENOBUFS past a bound (the caller refuses it as before).
 */
static int early_hold(hm_ar_ctx *ctx, int is_dead, hm_rpc_req *req, const uint8_t pk[HM_PK_BYTES],
                      const struct sockaddr *from, const uint8_t *gid, const uint8_t *body,
                      size_t len)
{
    size_t charge = len + EARLY_OVERHEAD;
    hm_origin o;
    hm_origin_ent *oe;
    early *e;

    if (ctx->closing || ctx->lim.early_bytes == 0)
        return -ENOBUFS;
    if (ctx->early_bytes + charge > ctx->lim.early_bytes) {
        ctx->early_refused++;
        return -ENOBUFS;
    }
    if (from == NULL)
        return -ENOBUFS; /* no origin to charge */
    hm_origin_of(from, &o);
    if ((oe = hm_origin_tab_get(&ctx->early_origins, &o, 1)) == NULL) {
        ctx->early_origin_refused++;
        return -ENOBUFS;
    }
    if (oe->v[0] + charge > ctx->lim.early_origin_bytes) {
        ctx->early_origin_refused++;
        if (oe->v[0] == 0)
            hm_origin_tab_release(&ctx->early_origins, oe);
        return -ENOBUFS;
    }
    if ((e = malloc(sizeof(*e) + len)) == NULL) {
        if (oe->v[0] == 0)
            hm_origin_tab_release(&ctx->early_origins, oe);
        return -ENOBUFS;
    }
    memset(e, 0, sizeof(*e));
    e->is_dead = is_dead;
    e->req = req;
    memcpy(e->pk, pk, HM_PK_BYTES);
    memcpy(&e->from, from, hm_addr_len(from));
    memcpy(e->gid, gid, HM_AVG_GROUP_ID_BYTES);
    e->origin = o;
    e->until_ms = hm_now_ms() + EARLY_HOLD_MS;
    e->charge = charge;
    e->len = len;
    memcpy(e->body, body, len);
    oe->v[0] += charge;
    ctx->early_bytes += charge;
    TAILQ_INSERT_TAIL(&ctx->early, e, link);
    /* The tick expires it even while no round runs here. */
    if (!ctx->timer_on)
        schedule_tick(ctx, TICK_MS);
    return 0;
}

static void early_free(hm_ar_ctx *ctx, early *e)
{
    hm_origin_ent *oe = hm_origin_tab_get(&ctx->early_origins, &e->origin, 0);
    TAILQ_REMOVE(&ctx->early, e, link);
    ctx->early_bytes -= e->charge;
    if (oe != NULL) {
        oe->v[0] -= HM_MIN(oe->v[0], e->charge);
        if (oe->v[0] == 0)
            hm_origin_tab_release(&ctx->early_origins, oe);
    }
    free(e);
}

static void on_part(void *ud, hm_rpc_req *req, const uint8_t pk[HM_PK_BYTES],
                    const struct sockaddr *from, const uint8_t *body, size_t len);
static void on_dead(void *ud, hm_rpc_req *req, const uint8_t pk[HM_PK_BYTES],
                    const struct sockaddr *from, const uint8_t *body, size_t len);

/*
 * Hands held messages to the rounds that have started since, as if they
 * had just arrived, and refuses those held too long (-EAGAIN: the sender
 * retries with backoff), those of a round that ended here meanwhile, or all
 * of them when closing (-ESHUTDOWN).
 */
static void early_run(hm_ar_ctx *ctx)
{
    uint64_t now = hm_now_ms();
    early *e, *next;
    for (e = TAILQ_FIRST(&ctx->early); e != NULL; e = next) {
        next = TAILQ_NEXT(e, link);
        int ready = !ctx->closing && round_find(ctx, e->gid) != NULL;
        if (!ready && !ctx->closing && now < e->until_ms && tomb_find(ctx, e->gid) == 0)
            continue;
        if (ready) {
            /*
             * The handlers may hold new messages (at the tail) but free
             * none, so next stays valid.
             */
            hm_rpc_req *req = e->req;
            uint8_t pk[HM_PK_BYTES];
            struct sockaddr_storage from = e->from;
            int is_dead = e->is_dead;
            memcpy(pk, e->pk, HM_PK_BYTES);
            uint8_t *body = malloc(e->len ? e->len : 1);
            size_t len = e->len;
            if (body == NULL) {
                early_free(ctx, e);
                reply_status(NULL, req, -EAGAIN);
                continue;
            }
            memcpy(body, e->body, len);
            early_free(ctx, e);
            if (is_dead)
                on_dead(ctx, req, pk, (const struct sockaddr *)&from, body, len);
            else
                on_part(ctx, req, pk, (const struct sockaddr *)&from, body, len);
            free(body);
        } else {
            hm_rpc_req *req = e->req;
            int is_dead = e->is_dead;
            int st = no_round_status(ctx, e->gid);
            early_free(ctx, e);
            if (st == -EAGAIN)
                ctx->early_refused++;
            if (is_dead)
                hm_rpc_respond(req, st, NULL, 0);
            else
                reply_status(NULL, req, st);
        }
    }
}

static void on_part(void *ud, hm_rpc_req *req, const uint8_t pk[HM_PK_BYTES],
                    const struct sockaddr *from, const uint8_t *body, size_t len)
{
    hm_ar_ctx *ctx = ud;
    hm_ar_part_msg m;
    hm_ar_round *r;
    int rc;

    if ((rc = hm_ar_part_decode(body, len, HM_AR_MAX_CHUNK_ELEMS, &m)) < 0) {
        complain_version(ctx, body, len, from, "a part");
        reply_status(NULL, req, rc == -EMSGSIZE ? -EMSGSIZE : -EPROTO);
        return;
    }
    r = round_find(ctx, m.group_id);
    if (r == NULL || r->finishing || r->finished) {
        int st = r == NULL ? no_round_status(ctx, m.group_id) : over_status(r);
        if (st == -EAGAIN && early_hold(ctx, 0, req, pk, from, m.group_id, body, len) == 0)
            return;
        reply_status(r, req, st);
        return;
    }
    r->bytes_recv += len;
    if ((rc = check_sender(r, m.sender, pk, m.n_total, m.dead_mask, m.bad_mask)) < 0) {
        reply_status(r, req, rc);
        goto out;
    }
    size_t s = m.span, k = m.chunk, j = m.sender;
    size_t cnt = 0;
    if (m.kind != HM_AR_DATA) {
        /* RESULT is retired (allreduce.h): a member that sends one speaks another protocol. */
        reply_status(r, req, -EPROTO);
        found_out(r, j, HM_AR_BAD);
        goto out;
    }
    if (s >= r->g.n || r->cnt[s] == 0 || k >= r->nch[s]) {
        reply_status(r, req, -EINVAL);
        found_out(r, j, HM_AR_BAD);
        goto out;
    }
    cnt = HM_MIN(r->cfg.chunk_elems, r->cnt[s] - k * r->cfg.chunk_elems);
    if (r->cur[s] != (int)r->g.self) {
        reply_status(r, req, -EXDEV);
        goto out;
    }
    if ((rc = host_span(r, s)) < 0) {
        reply_status(r, req, -ENOBUFS);
        goto out;
    }
    hspan *h = &r->hs[s];
    /* A chunk closing on a worker is as closed as a final one. */
    if (h->final[k] || (h->open[k] != NULL && h->open[k]->busy)) {
        reply_status(r, req, -ETIME);
        goto out;
    }
    float *vals = malloc(cnt * sizeof(float));
    size_t got = 0;
    if (vals == NULL) {
        reply_status(r, req, -ENOBUFS);
        goto out;
    }
    rc = hm_avg_chunk_decode(m.data, m.data_len, vals, cnt, &got);
    if (rc < 0 || got != cnt) {
        free(vals);
        rc = rc == -EDOM ? -EDOM : -EINVAL;
        hm_debug(MOD, "member %zu sent a bad part (%s)", j, hm_strerror(rc));
        reply_status(r, req, rc);
        found_out(r, j, HM_AR_BAD);
        goto out;
    }
    oslot *o = h->open[k];
    if (o == NULL) {
        if ((o = slot_new(r)) == NULL) {
            free(vals);
            reply_status(r, req, -ENOBUFS);
            goto out;
        }
        h->open[k] = o;
        r->n_open++;
    }
    if (o->held & bit(j)) /* a newer copy replaces the one held */
        reply_status(r, o->req[j], -EALREADY);
    o->req[j] = req;
    o->held |= bit(j);
    free(o->part[j]);
    o->part[j] = vals;
    o->w[j] = m.weight;
    o->have |= bit(j);
out:
    progress(r);
}

static void on_dead(void *ud, hm_rpc_req *req, const uint8_t pk[HM_PK_BYTES],
                    const struct sockaddr *from, const uint8_t *body, size_t len)
{
    hm_ar_ctx *ctx = ud;
    hm_ar_dead_msg m;
    hm_ar_round *r;
    int rc;

    if ((rc = hm_ar_dead_decode(body, len, &m)) < 0) {
        complain_version(ctx, body, len, from, "a notice");
        hm_rpc_respond(req, -EPROTO, NULL, 0);
        return;
    }
    r = round_find(ctx, m.group_id);
    if (r == NULL || r->finishing || r->finished) {
        int st = r == NULL ? no_round_status(ctx, m.group_id) : over_status(r);
        if (st == -EAGAIN && early_hold(ctx, 1, req, pk, from, m.group_id, body, len) == 0)
            return;
        hm_rpc_respond(req, st, NULL, 0);
        return;
    }
    r->bytes_recv += len;
    rc = check_sender(r, m.sender, pk, m.n_total, m.dead_mask, m.bad_mask);
    if (rc == 0 && m.done) {
        r->peer_done |= bit(m.sender);
        r->peer_done_view[m.sender] = m.dead_mask | m.bad_mask;
    }
    if (rc == 0) {
        /* Our view rides on the reply, so that a member done under an older one hears. */
        uint8_t buf[128];
        size_t blen;
        if (encode_view(r, 0, 0, buf, sizeof(buf), &blen) == 0 &&
            hm_rpc_respond(req, 0, buf, blen) == 0)
            r->bytes_sent += blen;
        else
            hm_rpc_respond(req, 0, NULL, 0);
    } else {
        hm_rpc_respond(req, rc, NULL, 0);
    }
    progress(r);
}

/* ================================================================= rounds */

static void round_free(hm_ar_round *r)
{
    for (size_t s = 0; s < HM_AVG_MAX_GROUP; s++) {
        free(r->hs[s].final);
        free(r->hs[s].fcontrib);
        free(r->hs[s].open);
    }
    free(r->tasks);
    /*
     * Parts still queued (to a slow or stalled peer) would pin the whole
     * rollback copy past the round, outside the write queues' bounds: they
     * are copied into their queues, and the copy is free again.
     */
    if (r->orig_ref != NULL && r->orig_ref->refs > 1 && !r->ctx->closing)
        hm_transport_unhold(hm_rpc_transport(r->ctx->rpc), r->orig_ref);
    if (r->orig_ref != NULL && r->orig_ref->refs > 1) {
        /* Still held (no memory for the copies, or the node closing with
         * it): freed when the transport lets go of it. */
        hm_tx_ref_drop(r->orig_ref);
    } else {
        free(r->orig_ref); /* the hold alone: orig is kept for the next round */
        orig_give(r->ctx, r->orig, r->orig_n);
    }
    free(r);
}

static void finish(hm_ar_round *r)
{
    hm_ar_ctx *ctx = r->ctx;
    hm_ar_report *rep = calloc(1, sizeof(*rep));
    int cancelled = r->status == -ECANCELED;

    jobs_detach(r); /* only a cancel or a close finishes with jobs out (tick) */
    /* Open chunks are answered with what is in (they are due now), or refused on cancel. */
    if (r->n_open > 0) {
        if (cancelled) {
            for (size_t j = 0; j < r->g.n; j++)
                slots_drop_member(r, j, over_status(r));
        }
        check_slots(r, 1);
    }
    r->finished = 1;
    for (size_t i = 0; i < r->n_tasks; i++) {
        task *t = &r->tasks[i];
        if (t->state == T_INFLIGHT && (size_t)t->to != r->g.self) {
            t->gen++;
            hm_rpc_cancel(ctx->rpc, t->call_id);
        }
    }
    notice *nt;
    while ((nt = LIST_FIRST(&r->notices)) != NULL) {
        LIST_REMOVE(nt, link);
        if (nt->pending) {
            nt->r = NULL; /* its callback frees it */
            if (hm_rpc_cancel(ctx->rpc, nt->call_id) < 0)
                free(nt);
        } else {
            free(nt);
        }
    }
    if (r->farewell && !ctx->closing)
        farewell(r);
    LIST_REMOVE(r, link);
    tombstone *tb = &ctx->tomb[ctx->tomb_next++ % TOMBSTONES];
    memcpy(tb->gid, r->g.group_id, HM_AVG_GROUP_ID_BYTES);
    tb->until_ms = hm_now_ms() + TOMBSTONE_MS;
    tb->status = over_status(r);

    int all_done = 1;
    uint64_t anyone = 0;
    for (size_t i = 0; i < r->n_tasks; i++) {
        if (r->tasks[i].state != T_DONE)
            all_done = 0;
        else
            anyone |= r->tasks[i].contrib;
    }
    if (rep != NULL) {
        rep->status = all_done ? 0 : (r->status != 0 ? r->status : -ETIMEDOUT);
        /* Averaging with nobody else is no success, whatever the chunks say. */
        if (rep->status == 0 && r->g.n > 1 &&
            ((anyone & ~r->self_bit) == 0 ||
             (r->all_mask & ~r->self_bit & ~out_mask(r) & ~r->late) == 0))
            rep->status = -ENOTCONN;
        rep->group_size = r->g.n;
        rep->self = r->g.self;
        memcpy(rep->group_id, r->g.group_id, HM_AVG_GROUP_ID_BYTES);
        memcpy(rep->reason, r->reason, sizeof(rep->reason));
        rep->bytes_sent = r->bytes_sent;
        rep->bytes_received = r->bytes_recv;
        rep->duration_s = (double)(hm_now_us() - r->start_us) / 1e6;
        rep->n_spans = r->g.n;
        for (size_t s = 0; s < r->g.n; s++) {
            hm_ar_span_report *sp = &rep->spans[s];
            uint64_t all = ~(uint64_t)0, any = 0;
            size_t averaged = 0;
            sp->offset = r->off[s];
            sp->count = r->cnt[s];
            sp->n_chunks = r->nch[s];
            sp->reducer = r->cnt[s] > 0 ? (int)s : -1;
            for (size_t i = 0; i < r->n_tasks; i++) {
                task *t = &r->tasks[i];
                if (t->span != s)
                    continue;
                if (t->state == T_DONE) {
                    all &= t->contrib;
                    any |= t->contrib;
                    averaged++;
                } else {
                    sp->chunks_local++;
                }
            }
            sp->contributors = averaged > 0 ? all : 0;
            sp->partial = any & ~sp->contributors;
            sp->final_reducer = averaged > 0 ? r->cur[s] : -1;
        }
        r->cb(r->ud, rep);
    } else {
        /* Out of memory for the report: the caller still hears the outcome. */
        hm_ar_report small;
        memset(&small, 0, sizeof(small));
        small.status = -ENOMEM;
        small.group_size = r->g.n;
        small.self = r->g.self;
        r->cb(r->ud, &small);
    }
    free(rep);
    round_free(r);
}

static void tick(uv_timer_t *h)
{
    hm_ar_ctx *ctx = h->data;
    ctx->timer_on = 0;
    /* Messages held for rounds that have started since come first. */
    early_run(ctx);
    uint64_t now = hm_now_ms();
    hm_ar_round *r = LIST_FIRST(&ctx->rounds);
    while (r != NULL) {
        hm_ar_round *next = LIST_NEXT(r, link);
        if (!r->finishing && now >= r->deadline_ms) {
            set_status(r, -ETIMEDOUT);
            r->finishing = 1;
        }
        if (!r->finishing)
            progress(r);
        /* Chunks on workers come back within milliseconds; a cancel does not wait. */
        if (r->finishing && (r->n_jobs == 0 || r->status == -ECANCELED)) {
            finish(r);
            /* done_cb may have started or ended rounds: start over from the head. */
            next = LIST_FIRST(&ctx->rounds);
        }
        r = next;
    }
    if (LIST_EMPTY(&ctx->rounds) && TAILQ_EMPTY(&ctx->early)) {
        if (ctx->timer_on)
            uv_timer_stop(&ctx->timer);
        ctx->timer_on = 0;
    } else if (!ctx->timer_on) {
        schedule_tick(ctx, TICK_MS);
    }
}

static void schedule_tick(hm_ar_ctx *ctx, uint64_t ms)
{
    if (ctx->closing)
        return;
    uv_timer_start(&ctx->timer, tick, ms, 0);
    ctx->timer_on = 1;
}

void hm_ar_config_defaults(hm_ar_config *cfg)
{
    if (cfg->round_timeout_ms == 0)
        cfg->round_timeout_ms = 30000;
    if (cfg->part_timeout_ms == 0)
        cfg->part_timeout_ms = cfg->round_timeout_ms / 5;
    if (cfg->reducer_timeout_ms == 0)
        cfg->reducer_timeout_ms = cfg->round_timeout_ms * 2 / 5;
    if (cfg->chunk_elems == 0)
        cfg->chunk_elems = 65536; /* chosen by measurement: docs/benchmarks.md */
    if (cfg->window == 0)
        cfg->window = 16; /* 4 MiB in flight per member, as with 8 chunks of twice the size */
    if (cfg->clip_iters == 0)
        cfg->clip_iters = 20;
}

int hm_ar_start(hm_ar_ctx *ctx, const hm_avg_group *group, float *data, size_t n, double weight,
                const hm_ar_config *cfg_in, hm_ar_done_cb cb, void *ud, hm_ar_round **round_out)
{
    int result = 0;
    hm_ar_round *r = NULL;
    hm_ar_config cfg;

    if (round_out != NULL)
        *round_out = NULL;
    if (ctx == NULL || group == NULL || cb == NULL || (data == NULL && n > 0) ||
        !isfinite(weight) || weight < 0 || group->n == 0 || group->n > HM_AVG_MAX_GROUP ||
        group->self >= group->n ||
        memcmp(group->members[group->self].pk, ctx->pk, HM_PK_BYTES) != 0 || ctx->closing)
        return -EINVAL;
    memset(&cfg, 0, sizeof(cfg));
    if (cfg_in != NULL)
        cfg = *cfg_in;
    int chunk_default = cfg.chunk_elems == 0;
    hm_ar_config_defaults(&cfg);
    if (cfg.window > WINDOW_MAX || cfg.chunk_elems > HM_AR_MAX_CHUNK_ELEMS ||
        cfg.compression < 0 || cfg.compression >= HM_AVG_COMP_COUNT ||
        (cfg.aggregate != HM_AR_MEAN && cfg.aggregate != HM_AR_CENTERED_CLIP) ||
        (cfg.aggregate == HM_AR_CENTERED_CLIP &&
         (!isfinite(cfg.clip_tau) || cfg.clip_tau <= 0 || cfg.clip_iters > HM_AVG_CLIP_MAX_ITERS)))
        return -EINVAL;
    if (!cfg.input_checked && !hm_avg_all_finite(data, n))
        return -EDOM;
    if (round_find(ctx, group->group_id) != NULL)
        return -EALREADY;

    r = calloc(1, sizeof(*r));
    if (r == NULL)
        return -ENOMEM;
    LIST_INIT(&r->notices);
    LIST_INIT(&r->jobs);
    r->ctx = ctx;
    r->g = *group;
    r->cfg = cfg;
    r->data = data;
    r->n = n;
    r->weight = weight;
    r->cb = cb;
    r->ud = ud;
    r->self_bit = bit(group->self);
    r->all_mask = group->n == 64 ? ~(uint64_t)0 : bit(group->n) - 1;
    r->lim = ctx->lim;
    if ((result = hm_ar_layout_bounded(group, n, r->lim.bandwidth_factor, r->off, r->cnt)) < 0)
        goto out;
    size_t bw_clamped = 0;
    if ((result = shares(group, r->lim.bandwidth_factor, r->share, &bw_clamped)) < 0)
        goto out;
    ctx->bandwidths_clamped += bw_clamped;
    /*
     * A small vector (gradients of a small model) goes as one chunk per
     * span: one round trip each, all at once, instead of a chunk's
     * pipeline. Every member applies the same rule to the same layout; a
     * chunk size the caller chose is kept.
     */
    if (n <= SMALL_ELEMS && chunk_default)
        for (size_t s = 0; s < group->n; s++)
            r->cfg.chunk_elems = cfg.chunk_elems = HM_MAX(cfg.chunk_elems, r->cnt[s]);
    size_t max_ch = 0;
    for (size_t s = 0; s < group->n; s++) {
        r->nch[s] = (r->cnt[s] + cfg.chunk_elems - 1) / cfg.chunk_elems;
        r->n_tasks += r->nch[s];
        max_ch = HM_MAX(max_ch, r->nch[s]);
        r->cur[s] = r->cnt[s] > 0 ? (int)s : -1;
    }
    r->tasks = calloc(r->n_tasks ? r->n_tasks : 1, sizeof(*r->tasks));
    r->orig = orig_take(ctx, n, &r->orig_n);
    r->orig_ref = r->orig != NULL ? heapref_new(r->orig) : NULL;
    if (r->tasks == NULL || r->orig_ref == NULL) {
        result = -ENOMEM;
        goto out;
    }
    size_t ti = 0;
    for (size_t k = 0; k < max_ch; k++)
        for (size_t s = 0; s < group->n; s++) {
            if (k >= r->nch[s])
                continue;
            task *t = &r->tasks[ti++];
            t->span = (uint32_t)s;
            t->chunk = (uint32_t)k;
            t->off = r->off[s] + k * cfg.chunk_elems;
            t->cnt = HM_MIN(cfg.chunk_elems, r->cnt[s] - k * cfg.chunk_elems);
            t->state = T_QUEUED;
        }
    /*
     * The whole input is copied here, at the start: a caller may go on
     * writing its vector while the round runs (the optimizer's local
     * updates), and its answers are relative to the values it had when the
     * round began. (Filling the copy chunk by chunk took some 60 ms per
     * 64 MiB off the loop but read such later values.)
     */
    if (n > 0)
        memcpy(r->orig, data, n * sizeof(float));
    r->start_ms = hm_now_ms();
    r->start_us = hm_now_us();
    r->deadline_ms = r->start_ms + cfg.round_timeout_ms;
    LIST_INSERT_HEAD(&ctx->rounds, r, link);
    if (round_out != NULL)
        *round_out = r;
    /* The first sends happen on the next tick, never inside this call. */
    schedule_tick(ctx, 0);
    r = NULL;
out:
    if (r != NULL)
        round_free(r);
    return result;
}

void hm_ar_cancel(hm_ar_round *r)
{
    if (r == NULL || r->finished)
        return;
    set_status(r, -ECANCELED);
    r->status = -ECANCELED;
    r->finishing = 1;
    r->leaving = 1;
    r->farewell = 1;
    schedule_tick(r->ctx, 0);
}

/* ================================================================ context */

int hm_ar_ctx_new(uv_loop_t *loop, hm_rpc *rpc, const hm_identity *id, hm_ar_ctx **out)
{
    int result = 0;
    hm_ar_ctx *ctx = calloc(1, sizeof(*ctx));
    *out = NULL;
    if (ctx == NULL)
        return -ENOMEM;
    LIST_INIT(&ctx->rounds);
    TAILQ_INIT(&ctx->early);
    if (hm_origin_tab_init(&ctx->early_origins, EARLY_MAX_ORIGINS) < 0) {
        free(ctx);
        return -ENOMEM;
    }
    hm_ar_limit_defaults(&ctx->lim);
    ctx->loop = loop;
    ctx->rpc = rpc;
    memcpy(ctx->pk, id->pk, HM_PK_BYTES);
    if ((result = hm_rpc_register(rpc, HM_AR_PART_METHOD, on_part, ctx)) < 0) {
        hm_origin_tab_free(&ctx->early_origins);
        free(ctx);
        return result;
    }
    if ((result = hm_rpc_register(rpc, HM_AR_DEAD_METHOD, on_dead, ctx)) < 0) {
        /*
         * The rpc layer has no unregister and now points at ctx for "avg.part":
         * the context stays allocated, closed, answering every part -ESHUTDOWN.
         */
        hm_warn(MOD, "cannot register %s: %s", HM_AR_DEAD_METHOD, hm_strerror(result));
        ctx->closing = 1;
        return result;
    }
    uv_timer_init(loop, &ctx->timer);
    ctx->timer.data = ctx;
    /*
     * No workers unless hm_ar_set_workers asks for them: on the 2-core
     * machine measured they win nothing (docs/benchmarks.md, "Averaging on
     * worker threads").
     */
    *out = ctx;
    return 0;
}

void hm_ar_limit_defaults(hm_ar_limit_cfg *lim)
{
    lim->weight_factor = HM_AR_WEIGHT_FACTOR_DEFAULT;
    lim->clip_weight_factor = HM_AR_CLIP_WEIGHT_FACTOR_DEFAULT;
    lim->bandwidth_factor = HM_AR_BANDWIDTH_FACTOR_DEFAULT;
    lim->early_bytes = (size_t)HM_AR_EARLY_MIB_DEFAULT << 20;
    lim->early_origin_bytes = (size_t)HM_AR_EARLY_ORIGIN_MIB_DEFAULT << 20;
}

int hm_ar_set_limits(hm_ar_ctx *ctx, const hm_ar_limit_cfg *lim)
{
    if (ctx == NULL || lim == NULL || !factor_ok(lim->weight_factor) ||
        !factor_ok(lim->clip_weight_factor) || !factor_ok(lim->bandwidth_factor))
        return -EINVAL;
    ctx->lim = *lim;
    return 0;
}

void hm_ar_limits(const hm_ar_ctx *ctx, hm_limit_emit_fn emit, void *ud)
{
    emit(ud, "AverageWeightFactor", ctx->weights_clamped);
    emit(ud, "AverageClipWeightFactor", ctx->clip_weights_clamped);
    emit(ud, "AverageEarlyPartsMiB", ctx->early_refused);
    emit(ud, "AverageEarlyPartsOriginMiB", ctx->early_origin_refused);
}

int hm_ar_set_workers(hm_ar_ctx *ctx, unsigned threads)
{
    if (ctx == NULL || threads > HM_WORKPOOL_MAX_THREADS || ctx->closing)
        return -EINVAL;
    hm_ar_round *r;
    LIST_FOREACH(r, &ctx->rounds, link)
        return -EBUSY;
    hm_workpool_close(ctx->pool);
    ctx->pool = NULL;
    if (threads == 0)
        return 0;
    return hm_workpool_new(ctx->loop, threads, (size_t)threads * AR_JOBS_PER_THREAD, &ctx->pool);
}

static void ctx_timer_closed(uv_handle_t *h)
{
    hm_ar_ctx *ctx = h->data;
    void (*cb)(void *) = ctx->close_cb;
    void *ud = ctx->close_ud;
    hm_origin_tab_free(&ctx->early_origins);
    free(ctx->spare_orig);
    free(ctx);
    if (cb != NULL)
        cb(ud);
}

void hm_ar_ctx_close(hm_ar_ctx *ctx, void (*cb)(void *ud), void *ud)
{
    if (ctx->closing)
        return;
    ctx->closing = 1;
    ctx->close_cb = cb;
    ctx->close_ud = ud;
    hm_ar_round *r;
    while ((r = LIST_FIRST(&ctx->rounds)) != NULL) {
        r->status = -ECANCELED;
        r->finishing = 1;
        r->leaving = 1;
        finish(r);
    }
    early_run(ctx); /* closing: every held message is refused */
    hm_workpool_close(ctx->pool); /* the jobs of finished rounds free themselves */
    ctx->pool = NULL;
    uv_timer_stop(&ctx->timer);
    uv_close((uv_handle_t *)&ctx->timer, ctx_timer_closed);
}

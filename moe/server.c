/*
 * server: hosts experts on a node (see server.h for batching, declarations
 * and durability).
 *
 * It owns the hosted experts (each an ffn, its request queues and its
 * statistics), a pool of compute threads with one job queue, the uv_async
 * that brings finished jobs back to the loop, three timers (batch
 * deadlines, declaration rounds, periodic checkpoints) and the DHT puts it
 * started. Puts outlive nothing: when the server goes while one is in
 * flight, its op is orphaned and only frees itself when the DHT answers
 * (the node's close answers every one).
 *
 * Threads. The loop thread owns every field except an expert's ffn, which
 * is touched under the expert's lock: by one worker at a time (an expert
 * with a job out is "busy" and gets no second one) or by the loop in the
 * blocking hm_moe_server_checkpoint. Workers see only their job, which
 * holds copies of the request tensors, and return it through the done
 * list; they build the reply bodies themselves so that the loop only
 * sends.
 */
#include "config.h"

#include "moe/server.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#include <uv.h>

#include "moe/checkpoint.h"
#include "moe/transformer.h"
#include "dht/record.h"
#include "src/base/origin.h"
#include "src/base/util.h"

#define MOD "moe"

/* Ring of recent request latencies per expert, for the percentiles in listings. */
#define LAT_RING 256
/* DHT puts a declaration round keeps in flight; the DHT's lookup slots are shared. */
#define PUTS_INFLIGHT 8
#define PUT_TIMEOUT_MS 5000
/* A put the DHT refused for lack of slots is retried after this long. */
#define PUT_RETRY_MS 250
/*
 * Declaration puts per second, and their burst. Each put reaches every
 * replica of its key with a lookup and a store, so a host declaring
 * hundreds of experts as fast as the DHT allows would exceed its peers'
 * per-address rate limits (DhtRequestRate, 200 a second by default) at
 * every refresh and be banned for a while: paced, a refresh is normal
 * load. 40 a second declares 250 experts of a two-level grid (about 510
 * records) in 13 s, inside the refresh period of a third of the TTL.
 */
#define DECL_PUTS_PER_S 40.0
#define DECL_PUTS_BURST 40.0
/* A round's puts that failed are retried this many times, after 1 s, 2 s, 4 s. */
#define DECL_RETRIES 3
/* Withdrawal at close gives up after this long. */
#define WITHDRAW_MAX_MS 4000
#define WITHDRAW_PUT_TIMEOUT_MS 3000
/*
 * Request copies waiting in all queues together: the per-expert bound is in
 * samples, and thousands of experts times a large dim would otherwise let
 * callers pin far more memory than a host has.
 */
#define MAX_QUEUED_BYTES ((size_t)1 << 30)
/* After a failed job allocation, the batch timer waits this long before trying again. */
#define ALLOC_RETRY_MS 10
/* Checkpoints are read back with this much room over the parameters and two moments. */
#define CKPT_SLACK (64 * 1024)
#define DECL_VALUE_MAX 256

enum { Q_FWD = 0, Q_BWD = 1 };
enum { JOB_FWD = 0, JOB_BWD = 1, JOB_CKPT = 2 };

/* The server's life: serving, then the steps of hm_moe_server_close in order. */
enum srv_state { S_RUNNING, S_DRAINING, S_WITHDRAWING, S_CLOSING };

static const char *state_name(enum srv_state st)
{
    switch (st) {
    case S_RUNNING:
        return "running";
    case S_DRAINING:
        return "draining";
    case S_WITHDRAWING:
        return "withdrawing";
    case S_CLOSING:
        return "closing";
    }
    return "?";
}

typedef struct expert expert;
typedef struct pending pending;

/* One request waiting in a queue or riding in a job; x and gy are its own copies. */
struct pending {
    STAILQ_ENTRY(pending) link; /* in a queue or a job */
    hm_rpc_req *req;
    hm_origin_ent *oe; /* its origin's entry: v[OV_BYTES] and v[OV_REQS] count it */
    size_t batch;      /* rows of dim: samples, or samples * seq for a transformer */
    size_t seq;        /* a transformer request's sequence length; 0 for an ffn's */
    size_t bytes; /* of the copies, for the server-wide bound */
    uint64_t arrived_ms;
    float *x;
    float *gy;
    uint8_t *mask;  /* a transformer request's key-padding mask, a byte a row; NULL: none */
    uint8_t *reply; /* built by the worker */
    size_t reply_len;
    int status;
};

STAILQ_HEAD(pending_list, pending);

/*
 * The requests of one origin in one queue, oldest first. A queue serves its
 * flows round-robin, one request per turn: an origin that floods the queue
 * lengthens only its own line, and a newcomer waits for at most the batch
 * being formed, not for everything queued before it.
 */
typedef struct flow {
    TAILQ_ENTRY(flow) link;
    hm_origin_ent *oe;
    struct pending_list reqs;
    size_t samples;
} flow;

TAILQ_HEAD(flow_list, flow);

typedef struct queue {
    struct flow_list flows; /* origins with requests; the head is served next */
    size_t samples;
    size_t *srv_bytes; /* the server's total of queued copies */
} queue;

/* Per-origin counters of the server's origin table. */
enum { OV_BYTES = 0, OV_REQS = 1 };

typedef struct job {
    STAILQ_ENTRY(job) link; /* in the server's job or done queue */
    expert *e;
    int kind;
    struct pending_list reqs;
    size_t samples;
    int status;
    uint64_t steps;          /* the expert's step count after the job */
    uint64_t ckpt_wall_ms;   /* a checkpoint job: when it was written */
} job;

struct expert {
    hm_moe_server *s;
    char uid[HM_MOE_UID_MAX + 1];
    hm_moe_uid u;
    char type[HM_MOE_TYPE_MAX + 1];
    size_t dim, hidden;
    size_t heads, max_seq; /* a transformer's; 0 for an ffn */
    hm_ffn *ffn;           /* exactly one of ffn and xf is set */
    hm_xf *xf;
    uv_mutex_t lock; /* guards ffn and xf between the loop and a worker */
    char *path;      /* checkpoint file, NULL without a state_dir */

    queue q[2];
    int busy;          /* a job of this expert is out on a worker */
    int ckpt_wanted;   /* a periodic checkpoint waits for the current job */
    int waiting;       /* on the server's list of experts with queued requests */
    LIST_ENTRY(expert) wlink; /* in s->waiting while waiting is set */

    uint64_t steps, steps_at_ckpt;
    uint64_t fwd_requests, bwd_requests, batches, batch_samples;
    uint64_t last_ckpt_unix_ms;
    int resumed;
    double lat_ms[LAT_RING];
    size_t lat_n, lat_pos;
};

/* One declaration record: key, owned subkey, value (empty for a withdrawal). */
typedef struct decl {
    char key[HM_MOE_UID_MAX + 2];
    uint8_t subkey[16 + HM_DHT_OWNER_MARKER_LEN];
    size_t subkey_len;
    uint8_t value[DECL_VALUE_MAX];
    size_t value_len;
    int failed; /* its last put this round was stored nowhere */
} decl;

typedef struct putop putop;
struct putop {
    hm_moe_server *s; /* NULL once orphaned */
    LIST_ENTRY(putop) link; /* in s->puts while s is set */
    size_t idx;             /* in s->decls */
};

struct hm_moe_server {
    hm_node *node;
    uv_loop_t *loop;
    hm_rpc *rpc;
    enum srv_state state;
    char *state_dir;
    unsigned nworkers;
    size_t max_batch, max_queued;
    size_t queued_bytes;     /* request copies from arrival until their batch is answered */
    size_t max_queued_bytes;
    hm_origin_tab origins;   /* request bytes and requests held, per origin */
    uint64_t refused_queued; /* refused or shed by the per-expert sample bound */
    uint64_t refused_bytes;  /* refused or shed by the server-wide byte bound */
    uint64_t refused_seq;    /* sequences longer than their transformer's max_seq */
    uint64_t retry_after_ms; /* a job allocation failed: no batch before this (0: none) */
    uint64_t batch_wait_ms, ckpt_interval_ms;
    double ttl_s;
    char addr[HM_MOE_ADDR_MAX + 1];
    int addr_missing; /* no declarable address: nothing declared until there is one */
    char marker[HM_DHT_OWNER_MARKER_LEN + 1];
    int registered;

    expert **ex; /* sorted by uid */
    size_t nex;

    /* Experts with queued requests, and the batch timer's due time. */
    LIST_HEAD(, expert) waiting;
    uv_timer_t batch_timer;
    uint64_t batch_due_ms; /* 0: not armed */

    /* Compute workers. */
    uv_thread_t *threads;
    unsigned nthreads;
    uv_mutex_t jlock;
    uv_cond_t jcond;
    STAILQ_HEAD(job_list, job) jobs; /* for the workers, guarded by jlock */
    int jstop;
    struct job_list done; /* finished, in completion order, guarded by jlock */
    uv_async_t async;
    size_t jobs_out;

    /* Declarations. */
    uv_timer_t decl_timer;
    decl *decls;
    size_t ndecls;
    size_t decl_cursor;
    int decl_round;  /* a round is running */
    int decl_dirty;  /* the expert set changed since decls was built */
    int withdrawing;
    LIST_HEAD(, putop) puts;
    size_t puts_out;
    size_t round_stored;   /* puts of this round that some replica accepted */
    size_t round_failed;   /* puts of this pass stored nowhere */
    unsigned retry_pass;   /* 0: the round's first pass; then the retries of failed puts */
    double decl_tokens;    /* the pacing's bucket (DECL_PUTS_PER_S) */
    uint64_t decl_tokens_ms;
    unsigned failed_rounds; /* rounds in a row in which none was stored */
    uint64_t withdraw_deadline_ms;

    uv_timer_t ckpt_timer;

    int handles_open;
    void (*close_cb)(void *ud);
    void *close_ud;
    int do_withdraw;
};

static void set_state(hm_moe_server *s, enum srv_state st)
{
    if (s->state == st)
        return;
    hm_debug(MOD, "server %s -> %s", state_name(s->state), state_name(st));
    s->state = st;
}

/* ------------------------------------------------------------ small helpers */

static uint64_t splitmix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The seed of one expert: the configured seed mixed with a hash of its uid. */
static uint64_t expert_seed(uint64_t seed, const char *uid)
{
    uint8_t h[8];
    uint64_t v = 0;
    crypto_generichash(h, sizeof(h), (const uint8_t *)uid, strlen(uid), NULL, 0);
    for (int i = 0; i < 8; i++)
        v = (v << 8) | h[i];
    return splitmix64(seed ^ v);
}

static uint64_t wall_ms(void) { return hm_wall_us() / 1000; }

/* delay_ms scaled by a uniform factor in [0.9, 1.1], so that servers started together drift apart. */
static uint64_t jitter(uint64_t delay_ms)
{
    uint64_t span = delay_ms / 5;
    if (span == 0)
        return delay_ms;
    return delay_ms - span / 2 + randombytes_uniform((uint32_t)HM_MIN(span, (uint64_t)UINT32_MAX));
}

static int type_ok(const char *type)
{
    size_t n = type ? strnlen(type, HM_MOE_TYPE_MAX + 1) : 0;
    if (n == 0 || n > HM_MOE_TYPE_MAX)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = type[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

static int floats_finite(const float *v, size_t n)
{
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &v[i], 4);
        bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
    }
    return bad == 0;
}

static int expert_cmp(const void *a, const void *b)
{
    const expert *x = *(expert *const *)a, *y = *(expert *const *)b;
    return strcmp(x->uid, y->uid);
}

static expert *find_expert(hm_moe_server *s, const char *uid)
{
    size_t lo = 0, hi = s->nex;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(uid, s->ex[mid]->uid);
        if (c == 0)
            return s->ex[mid];
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

static void pending_free(pending *p)
{
    if (p == NULL)
        return;
    free(p->reply);
    free(p);
}

static void lat_add(expert *e, double ms)
{
    e->lat_ms[e->lat_pos] = ms;
    e->lat_pos = (e->lat_pos + 1) % LAT_RING;
    if (e->lat_n < LAT_RING)
        e->lat_n++;
}

/* ------------------------------------------------------------ the expert's model */

/* The calls below dispatch on what an expert holds: an ffn or a transformer. */
static uint64_t model_steps(const expert *e)
{
    return e->xf != NULL ? hm_xf_steps(e->xf) : hm_ffn_steps(e->ffn);
}

static int model_save(const expert *e, uint8_t **buf, size_t *len)
{
    return e->xf != NULL ? hm_xf_save(e->xf, buf, len) : hm_ffn_save(e->ffn, buf, len);
}

/* One request's rows alone, as its own optimizer step. */
static int model_backward(expert *e, const pending *p, float *out)
{
    if (e->xf != NULL)
        return hm_xf_backward_mask(e->xf, p->x, p->mask, p->gy, p->batch / p->seq, p->seq, out);
    return hm_ffn_backward(e->ffn, p->x, p->gy, p->batch, out);
}

/*
 * A transformer's batch: the requests' rows in order, computed in runs of
 * requests with the same sequence length; backward sums the runs'
 * gradients into one step, as an ffn's batch is one step.
 */
static int xf_batch(expert *e, job *j, const float *x, const float *gy, float *out)
{
    const size_t np = hm_xf_nparams(e->xf), dim = e->dim;
    int backward = j->kind == JOB_BWD;
    float *gsum = NULL, *g = NULL;
    uint8_t *mask = NULL;
    size_t off = 0;
    pending *p = STAILQ_FIRST(&j->reqs);
    int r = 0;

    /* Where some request is masked, the batch's mask: all ones for the
     * others, which is the same to the bit as none (transformer.h). */
    STAILQ_FOREACH(p, &j->reqs, link)
        if (p->mask != NULL)
            break;
    if (p != NULL) {
        if ((mask = malloc(j->samples)) == NULL) {
            r = -ENOMEM;
            goto out;
        }
        STAILQ_FOREACH(p, &j->reqs, link) {
            if (p->mask != NULL)
                memcpy(mask + off, p->mask, p->batch);
            else
                memset(mask + off, 1, p->batch);
            off += p->batch;
        }
        off = 0;
    }
    p = STAILQ_FIRST(&j->reqs);
    if (backward) {
        gsum = calloc(np, sizeof(float));
        g = malloc(np * sizeof(float));
        if (gsum == NULL || g == NULL) {
            r = -ENOMEM;
            goto out;
        }
    }
    while (p != NULL && r == 0) {
        size_t seq = p->seq, rows = 0;
        while (p != NULL && p->seq == seq) {
            rows += p->batch;
            p = STAILQ_NEXT(p, link);
        }
        if (backward) {
            r = hm_xf_grad_mask(e->xf, x + off * dim, mask != NULL ? mask + off : NULL,
                                gy + off * dim, rows / seq, seq, out + off * dim, g);
            for (size_t i = 0; r == 0 && i < np; i++)
                gsum[i] += g[i];
        } else {
            r = hm_xf_forward_mask(e->xf, x + off * dim, mask != NULL ? mask + off : NULL,
                                   rows / seq, seq, out + off * dim);
        }
        off += rows;
    }
    if (r == 0 && backward)
        r = hm_xf_apply(e->xf, gsum);
out:
    free(gsum);
    free(g);
    free(mask);
    return r;
}

/* ------------------------------------------------------------ workers */

/*
 * Checkpoints one expert: save and write under its lock, so that the
 * periodic job on a worker and the blocking call on the loop never write
 * the same files at once.
 */
static int write_checkpoint(expert *e, uint64_t *steps_out)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    int result;

    uv_mutex_lock(&e->lock);
    *steps_out = model_steps(e);
    result = model_save(e, &buf, &len);
    if (result == 0)
        result = hm_ckpt_write(e->path, buf, len);
    uv_mutex_unlock(&e->lock);
    free(buf);
    return result;
}

/*
 * A backward batch refused with -EDOM stepped nothing: one request's dL/dy
 * (finite, but large enough to overflow a parameter or moment) may be the
 * cause. Each request then runs alone, as its own step, so that only the
 * offending one is answered -EDOM. Called with the expert's lock held.
 */
static void backward_each(expert *e, job *j, float *out)
{
    size_t off = 0;
    pending *p;

    STAILQ_FOREACH(p, &j->reqs, link) {
        p->status = model_backward(e, p, out + off * e->dim);
        off += p->batch;
    }
}

/*
 * Runs one batch: gathers the requests' rows, computes, and builds each
 * request's reply from its rows of the output.
 */
static void run_batch(job *j)
{
    expert *e = j->e;
    size_t dim = e->dim, off = 0;
    int backward = j->kind == JOB_BWD;
    float *x = malloc(j->samples * dim * sizeof(float));
    float *gy = backward ? malloc(j->samples * dim * sizeof(float)) : NULL;
    float *out = malloc(j->samples * dim * sizeof(float));
    pending *p;
    int r;

    if (x == NULL || out == NULL || (backward && gy == NULL)) {
        j->status = -ENOMEM;
        goto out;
    }
    STAILQ_FOREACH(p, &j->reqs, link) {
        memcpy(x + off * dim, p->x, p->batch * dim * sizeof(float));
        if (backward)
            memcpy(gy + off * dim, p->gy, p->batch * dim * sizeof(float));
        off += p->batch;
    }
    uv_mutex_lock(&e->lock);
    if (e->xf != NULL)
        r = xf_batch(e, j, x, gy, out);
    else if (backward)
        r = hm_ffn_backward(e->ffn, x, gy, j->samples, out);
    else
        r = hm_ffn_forward(e->ffn, x, j->samples, out);
    if (backward && r == -EDOM && STAILQ_NEXT(STAILQ_FIRST(&j->reqs), link) != NULL) {
        backward_each(e, j, out);
        r = 0;
    }
    j->steps = model_steps(e);
    uv_mutex_unlock(&e->lock);
    if (r < 0) {
        j->status = r;
        goto out;
    }
    off = 0;
    STAILQ_FOREACH(p, &j->reqs, link) {
        hm_wire_wr w;
        if (p->status != 0) {
            off += p->batch; /* refused alone by backward_each */
            continue;
        }
        hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
        if (p->seq != 0)
            hm_moe_encode_out_seq(&w, backward, out + off * dim, p->batch / p->seq, p->seq, dim);
        else
            hm_moe_encode_out(&w, backward, out + off * dim, p->batch, dim);
        if ((r = hm_wire_wr_error(&w)) < 0) {
            hm_wire_wr_free(&w);
            p->status = r;
        } else {
            p->reply = hm_wire_wr_steal(&w, &p->reply_len);
            p->status = p->reply != NULL ? 0 : -ENOMEM;
        }
        off += p->batch;
    }
    j->status = 0;
out:
    free(x);
    free(gy);
    free(out);
}

static void worker_main(void *arg)
{
    hm_moe_server *s = arg;

    for (;;) {
        job *j;
        uv_mutex_lock(&s->jlock);
        while (STAILQ_EMPTY(&s->jobs) && !s->jstop)
            uv_cond_wait(&s->jcond, &s->jlock);
        if (STAILQ_EMPTY(&s->jobs)) {
            uv_mutex_unlock(&s->jlock);
            return;
        }
        j = STAILQ_FIRST(&s->jobs);
        STAILQ_REMOVE_HEAD(&s->jobs, link);
        uv_mutex_unlock(&s->jlock);

        if (j->kind == JOB_CKPT) {
            j->status = write_checkpoint(j->e, &j->steps);
            j->ckpt_wall_ms = wall_ms();
        } else {
            run_batch(j);
        }

        uv_mutex_lock(&s->jlock);
        STAILQ_INSERT_TAIL(&s->done, j, link);
        uv_mutex_unlock(&s->jlock);
        uv_async_send(&s->async);
    }
}

static void submit(hm_moe_server *s, job *j)
{
    j->e->busy = 1;
    s->jobs_out++;
    uv_mutex_lock(&s->jlock);
    STAILQ_INSERT_TAIL(&s->jobs, j, link);
    uv_cond_signal(&s->jcond);
    uv_mutex_unlock(&s->jlock);
}

/* ------------------------------------------------------------ queues and batching */

static void waiting_add(hm_moe_server *s, expert *e)
{
    if (e->waiting)
        return;
    e->waiting = 1;
    LIST_INSERT_HEAD(&s->waiting, e, wlink);
}

static void waiting_remove(hm_moe_server *s, expert *e)
{
    if (!e->waiting)
        return;
    HM_UNUSED(s);
    LIST_REMOVE(e, wlink);
    e->waiting = 0;
}

/* The flow of oe in q, or NULL. Linear: a queue holds few origins at once
 * (each flow holds at least one sample of the bounded queue). */
static flow *queue_flow(queue *q, const hm_origin_ent *oe)
{
    flow *f;
    TAILQ_FOREACH(f, &q->flows, link)
        if (f->oe == oe)
            return f;
    return NULL;
}

/* The request the next batch starts with, or NULL. */
static pending *queue_head(const queue *q)
{
    const flow *f = TAILQ_FIRST(&q->flows);
    return f != NULL ? STAILQ_FIRST(&f->reqs) : NULL;
}

/* Arrival of the oldest request in q (the heads of its flows), 0 when empty. */
static uint64_t queue_oldest_ms(const queue *q)
{
    uint64_t t = 0;
    const flow *f;
    TAILQ_FOREACH(f, &q->flows, link) {
        uint64_t a = STAILQ_FIRST(&f->reqs)->arrived_ms;
        if (t == 0 || a < t)
            t = a;
    }
    return t;
}

/* Takes the oldest request of flow f off q, freeing f once empty. */
static pending *flow_pop(queue *q, flow *f)
{
    pending *p = STAILQ_FIRST(&f->reqs);
    STAILQ_REMOVE_HEAD(&f->reqs, link);
    f->samples -= p->batch;
    q->samples -= p->batch;
    if (STAILQ_EMPTY(&f->reqs)) {
        TAILQ_REMOVE(&q->flows, f, link);
        free(f);
    }
    return p;
}

/*
 * Takes the next request off q: the oldest of the flow whose turn it is,
 * which then goes to the back of the line. Its bytes stay counted in the
 * server's total until the request is answered (pending_done): a request
 * that moved into a job waiting for a worker, or running on one, still
 * holds its copies.
 */
static pending *queue_pop(queue *q)
{
    flow *f = TAILQ_FIRST(&q->flows);
    if (f == NULL)
        return NULL;
    /* flow_pop frees f with its last request: decide the rotation first. */
    int rotate = STAILQ_NEXT(STAILQ_FIRST(&f->reqs), link) != NULL && TAILQ_NEXT(f, link) != NULL;
    pending *p = flow_pop(q, f);
    if (rotate) {
        TAILQ_REMOVE(&q->flows, f, link);
        TAILQ_INSERT_TAIL(&q->flows, f, link);
    }
    return p;
}

/* Releases an answered request, its share of the server-wide byte bound and of its origin. */
static void pending_done(hm_moe_server *s, pending *p)
{
    s->queued_bytes -= p->bytes;
    if (p->oe != NULL) {
        p->oe->v[OV_BYTES] -= p->bytes;
        p->oe->v[OV_REQS]--;
        hm_origin_tab_release(&s->origins, p->oe);
    }
    pending_free(p);
}

/*
 * Queues p behind the earlier requests of its origin. An origin with
 * nothing queued goes to the front of the line (as a sparse flow does in
 * fq_codel): it has waited longest for its turn. -ENOMEM: nothing queued.
 */
static int queue_push(queue *q, pending *p)
{
    flow *f = queue_flow(q, p->oe);
    if (f == NULL) {
        if ((f = calloc(1, sizeof(*f))) == NULL)
            return -ENOMEM;
        f->oe = p->oe;
        STAILQ_INIT(&f->reqs);
        TAILQ_INSERT_HEAD(&q->flows, f, link);
    }
    STAILQ_INSERT_TAIL(&f->reqs, p, link);
    f->samples += p->batch;
    q->samples += p->batch;
    *q->srv_bytes += p->bytes;
    return 0;
}

/* Drops requests at the head of each flow whose callers have gone: they are not computed. */
static void queue_drop_gone(hm_moe_server *s, queue *q)
{
    flow *f, *next;
    TAILQ_FOREACH_SAFE(f, &q->flows, link, next) {
        for (;;) {
            pending *p = STAILQ_FIRST(&f->reqs);
            if (p == NULL || !hm_rpc_req_cancelled(p->req))
                break;
            int last = STAILQ_NEXT(p, link) == NULL;
            flow_pop(q, f);
            hm_rpc_respond(p->req, -ECANCELED, NULL, 0);
            pending_done(s, p);
            if (last)
                break; /* f is freed */
        }
    }
}

/* Answers every queued request of e with status (shutdown, or the expert going away). */
static void queue_fail_all(hm_moe_server *s, expert *e, int status)
{
    for (int k = 0; k < 2; k++) {
        pending *p;
        while ((p = queue_pop(&e->q[k])) != NULL) {
            hm_rpc_respond(p->req, status, NULL, 0);
            pending_done(s, p);
        }
    }
    waiting_remove(s, e);
}

/* When e's next batch is due (its oldest request plus the wait), or 0 with nothing queued. */
static uint64_t expert_due(const hm_moe_server *s, const expert *e)
{
    uint64_t due = 0;
    for (int k = 0; k < 2; k++) {
        const queue *q = &e->q[k];
        uint64_t oldest = queue_oldest_ms(q);
        if (oldest == 0)
            continue;
        uint64_t d = q->samples >= s->max_batch ? oldest : oldest + s->batch_wait_ms;
        if (due == 0 || d < due)
            due = d;
    }
    return due;
}

static int dispatch_checkpoint(hm_moe_server *s, expert *e)
{
    job *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return -ENOMEM;
    STAILQ_INIT(&j->reqs);
    j->e = e;
    j->kind = JOB_CKPT;
    e->ckpt_wanted = 0;
    submit(s, j);
    return 0;
}

/*
 * Gives e's next job to a worker when e is idle: a checkpoint that waited
 * for the last batch, else a due batch (from the due queue whose oldest
 * request came first: oldest requests first, up to max_batch samples; a
 * single larger request goes alone). Requests whose callers left are
 * dropped on the way.
 */
static void expert_kick(hm_moe_server *s, expert *e, uint64_t now)
{
    if (e->busy || s->state != S_RUNNING)
        return;
    if (e->ckpt_wanted && e->path != NULL) {
        if (dispatch_checkpoint(s, e) == 0)
            return;
    }
    queue_drop_gone(s, &e->q[Q_FWD]);
    queue_drop_gone(s, &e->q[Q_BWD]);
    if (queue_head(&e->q[Q_FWD]) == NULL && queue_head(&e->q[Q_BWD]) == NULL) {
        waiting_remove(s, e);
        return;
    }
    /* Of the queues whose batch is due, the one whose oldest request came first. */
    int k = -1;
    uint64_t k_oldest = 0;
    for (int i = 0; i < 2; i++) {
        uint64_t oldest = queue_oldest_ms(&e->q[i]);
        if (oldest == 0)
            continue;
        if (e->q[i].samples < s->max_batch && now < oldest + s->batch_wait_ms)
            continue;
        if (k < 0 || oldest < k_oldest) {
            k = i;
            k_oldest = oldest;
        }
    }
    if (k < 0)
        return;
    queue *q = &e->q[k];
    job *j = calloc(1, sizeof(*j));
    if (j == NULL) {
        /*
         * The batch timer tries again, but not at once: the batch is due,
         * so a zero timeout would run again within this loop pass.
         */
        s->retry_after_ms = now + ALLOC_RETRY_MS;
        return;
    }
    j->e = e;
    j->kind = k == Q_BWD ? JOB_BWD : JOB_FWD;
    STAILQ_INIT(&j->reqs);
    /* One request per origin in turn (queue_pop), until the batch is full. */
    pending *head;
    while ((head = queue_head(q)) != NULL) {
        if (hm_rpc_req_cancelled(head->req)) {
            pending *gone = flow_pop(q, TAILQ_FIRST(&q->flows));
            hm_rpc_respond(gone->req, -ECANCELED, NULL, 0);
            pending_done(s, gone);
            continue;
        }
        if (j->samples > 0 && j->samples + head->batch > s->max_batch)
            break;
        pending *p = queue_pop(q);
        j->samples += p->batch;
        STAILQ_INSERT_TAIL(&j->reqs, p, link);
    }
    if (STAILQ_EMPTY(&j->reqs)) {
        free(j);
        if (queue_head(&e->q[0]) == NULL && queue_head(&e->q[1]) == NULL)
            waiting_remove(s, e);
        return;
    }
    if (queue_head(&e->q[0]) == NULL && queue_head(&e->q[1]) == NULL)
        waiting_remove(s, e);
    submit(s, j);
}

static void batch_timer_cb(uv_timer_t *t);

/* Arms the batch timer for the earliest due batch of an idle expert. */
static void batch_rearm(hm_moe_server *s)
{
    uint64_t now = hm_now_ms(), due = 0;

    if (s->state != S_RUNNING)
        return;
    expert *e;
    LIST_FOREACH(e, &s->waiting, wlink) {
        if (e->busy)
            continue;
        uint64_t d = expert_due(s, e);
        if (d != 0 && (due == 0 || d < due))
            due = d;
    }
    if (due == 0) {
        uv_timer_stop(&s->batch_timer);
        s->batch_due_ms = 0;
        return;
    }
    if (s->retry_after_ms != 0) {
        if (now < s->retry_after_ms)
            due = HM_MAX(due, s->retry_after_ms);
        else
            s->retry_after_ms = 0;
    }
    if (s->batch_due_ms != 0 && s->batch_due_ms <= due && uv_is_active((uv_handle_t *)&s->batch_timer))
        return;
    s->batch_due_ms = due;
    uv_timer_start(&s->batch_timer, batch_timer_cb, due > now ? due - now : 0, 0);
}

static void batch_timer_cb(uv_timer_t *t)
{
    hm_moe_server *s = t->data;
    uint64_t now = hm_now_ms();
    expert *e, *next;

    s->batch_due_ms = 0;
    /* A kick may take e off the list. */
    LIST_FOREACH_SAFE(e, &s->waiting, wlink, next)
        expert_kick(s, e, now);
    batch_rearm(s);
}

/* ------------------------------------------------------------ finished jobs */

static void close_step(hm_moe_server *s);

static void finish_batch(job *j)
{
    expert *e = j->e;
    hm_moe_server *s = e->s;
    uint64_t now = hm_now_ms();
    int backward = j->kind == JOB_BWD;
    pending *p, *next;

    e->steps = HM_MAX(e->steps, j->steps);
    if (j->status == 0) {
        e->batches++;
        e->batch_samples += j->samples;
    } else {
        hm_warn(MOD, "%s: %s batch of %zu samples failed: %s", e->uid,
                backward ? "backward" : "forward", j->samples, hm_strerror(j->status));
    }
    STAILQ_FOREACH_SAFE(p, &j->reqs, link, next) {
        int st = j->status != 0 ? j->status : p->status;
        if (st == 0) {
            hm_rpc_respond(p->req, 0, p->reply, p->reply_len);
            if (backward)
                e->bwd_requests++;
            else
                e->fwd_requests++;
            lat_add(e, (double)(now - p->arrived_ms));
        } else {
            hm_rpc_respond(p->req, st, NULL, 0);
        }
        pending_done(s, p);
    }
}

static void async_cb(uv_async_t *a)
{
    hm_moe_server *s = a->data;
    struct job_list done = STAILQ_HEAD_INITIALIZER(done);
    job *j, *next;
    uint64_t now;

    /* Answered in completion order, the order the workers queued them. */
    uv_mutex_lock(&s->jlock);
    STAILQ_CONCAT(&done, &s->done);
    uv_mutex_unlock(&s->jlock);
    now = hm_now_ms();
    STAILQ_FOREACH_SAFE(j, &done, link, next) {
        expert *e = j->e;
        e->busy = 0;
        s->jobs_out--;
        if (j->kind == JOB_CKPT) {
            if (j->status == 0) {
                e->steps_at_ckpt = HM_MAX(e->steps_at_ckpt, j->steps);
                e->last_ckpt_unix_ms = j->ckpt_wall_ms;
            } else {
                hm_error(MOD, "%s: checkpoint to %s failed: %s", e->uid, e->path,
                         hm_strerror(j->status));
            }
        } else {
            finish_batch(j);
        }
        free(j);
        expert_kick(s, e, now);
    }
    if (s->state == S_DRAINING && s->jobs_out == 0)
        close_step(s);
    else
        batch_rearm(s);
}

/* ------------------------------------------------------------ rpc handlers */

/* Answers a request with an error and its reason in words (proto.h), so
 * that the caller can tell a wrong width from a lost host. */
static void respond_why(hm_rpc_req *req, int status, const char *why)
{
    hm_rpc_respond(req, status, why, why != NULL ? strnlen(why, HM_MOE_ERR_MAX) : 0);
}

/* Answers a queued request that was shed for a newcomer from a lighter origin. */
static void shed(hm_moe_server *s, queue *q, flow *f)
{
    pending *p = flow_pop(q, f);
    respond_why(p->req, -ENOBUFS, "shed by limit ExpertMaxQueued: a lighter caller needed the room");
    pending_done(s, p);
}

/* Samples oe has queued at e (both queues). */
static size_t expert_share(const expert *e, const hm_origin_ent *oe)
{
    size_t n = 0;
    for (int k = 0; k < 2; k++) {
        const flow *f = queue_flow((queue *)&e->q[k], oe);
        n += f != NULL ? f->samples : 0;
    }
    return n;
}

/*
 * Makes room for need samples from oe at e by shedding the oldest requests
 * of the longest line of another origin there (forward or backward), as
 * long as it holds more than oe would have at e in all. 0, or -ENOBUFS when the
 * newcomer is (or would be) the heaviest: then it is refused instead.
 */
static int make_room_samples(hm_moe_server *s, expert *e, const hm_origin_ent *oe, size_t need)
{
    if (need > s->max_queued)
        return -ENOBUFS;
    size_t mine = expert_share(e, oe) + need;
    while (e->q[Q_FWD].samples + e->q[Q_BWD].samples + need > s->max_queued) {
        /* The longest line of another origin (one pass: O(origins queued here)). */
        flow *heavy = NULL;
        queue *hq = NULL;
        for (int k = 0; k < 2; k++) {
            flow *f;
            TAILQ_FOREACH(f, &e->q[k].flows, link) {
                if (f->oe != oe && (heavy == NULL || f->samples > heavy->samples)) {
                    heavy = f;
                    hq = &e->q[k];
                }
            }
        }
        if (heavy == NULL || heavy->samples <= mine)
            return -ENOBUFS;
        shed(s, hq, heavy);
        s->refused_queued++;
    }
    return 0;
}

/* Sheds the oldest queued request of origin h at any expert. 0, or -ENOENT
 * when all of h's requests are already in batches. */
static int shed_origin(hm_moe_server *s, const hm_origin_ent *h)
{
    expert *e;
    LIST_FOREACH(e, &s->waiting, wlink) {
        for (int k = 0; k < 2; k++) {
            flow *f = queue_flow(&e->q[k], h);
            if (f != NULL) {
                shed(s, &e->q[k], f);
                return 0;
            }
        }
    }
    return -ENOENT;
}

/* The same for the server-wide byte bound, by the bytes each origin holds. */
static int make_room_bytes(hm_moe_server *s, hm_origin_ent *oe, size_t need)
{
    if (need > s->max_queued_bytes)
        return -ENOBUFS;
    while (s->queued_bytes + need > s->max_queued_bytes) {
        hm_origin_ent *h = hm_origin_tab_heaviest(&s->origins, OV_BYTES);
        if (h == NULL || h == oe || h->v[OV_BYTES] <= oe->v[OV_BYTES] + need)
            return -ENOBUFS;
        if (shed_origin(s, h) != 0)
            return -ENOBUFS;
        s->refused_bytes++;
    }
    return 0;
}

static void handle(hm_moe_server *s, hm_rpc_req *req, const struct sockaddr *from,
                   const uint8_t *body, size_t len, int backward)
{
    char why[HM_MOE_ERR_MAX + 1] = "";
    hm_moe_req mr;
    hm_origin o;
    hm_origin_ent *oe = NULL;
    expert *e;
    pending *p;
    size_t n, bytes;
    int r;

    if (s->state != S_RUNNING) {
        r = -ESHUTDOWN;
        snprintf(why, sizeof(why), "the host is shutting down");
        goto fail;
    }
    if ((r = hm_moe_decode_req(body, len, backward, &mr)) < 0) {
        snprintf(why, sizeof(why), "malformed %s request (%s)", backward ? "backward" : "forward",
                 hm_strerror(r));
        goto fail;
    }
    if ((e = find_expert(s, mr.uid)) == NULL) {
        r = -ENOENT;
        snprintf(why, sizeof(why), "no expert %s is hosted here", mr.uid);
        goto fail;
    }
    if (mr.dim != e->dim) {
        r = -EPROTO;
        snprintf(why, sizeof(why), "%s takes inputs of width %zu, not %zu", e->uid, e->dim,
                 mr.dim);
        goto fail;
    }
    /* An ffn takes [batch, dim], a transformer [batch, seq, dim] (proto.h, revision 2). */
    if ((e->xf != NULL) != (mr.seq != 0)) {
        r = -EPROTO;
        if (e->xf != NULL)
            snprintf(why, sizeof(why), "%s is a transformer: it takes inputs [batch, seq, %zu], "
                     "not [%zu, %zu]", e->uid, e->dim, mr.batch, mr.dim);
        else
            snprintf(why, sizeof(why), "%s takes inputs [batch, %zu], not [%zu, %zu, %zu]",
                     e->uid, e->dim, mr.batch, mr.seq, mr.dim);
        goto fail;
    }
    if (e->xf != NULL && mr.seq > e->max_seq) {
        r = -EPROTO;
        s->refused_seq++;
        snprintf(why, sizeof(why), "refused by limit ExpertMaxSeq: %s takes sequences of at "
                 "most %zu, not %zu", e->uid, e->max_seq, mr.seq);
        goto fail;
    }
    /* Queues, batches and their bounds count rows of dim. */
    if (mr.seq != 0)
        mr.batch *= mr.seq;
    n = mr.batch * mr.dim;
    bytes = n * sizeof(float) * (backward ? 2 : 1) + (mr.mask != NULL ? mr.batch : 0);
    hm_origin_of(from, &o);
    if ((oe = hm_origin_tab_get(&s->origins, &o, 1)) == NULL) {
        r = -ENOBUFS; /* more origins waiting than the table holds */
        s->refused_queued++;
        snprintf(why, sizeof(why), "refused by limit ExpertMaxQueued: too many callers waiting");
        goto fail;
    }
    /*
     * Full queues shed the heaviest origin's requests rather than refuse a
     * lighter newcomer (docs/security.md, "Expert queues").
     */
    if ((r = make_room_samples(s, e, oe, mr.batch)) < 0) {
        s->refused_queued++;
        snprintf(why, sizeof(why), "refused by limit ExpertMaxQueued: %s's queue is full (%zu "
                 "samples)", e->uid, s->max_queued);
        goto fail;
    }
    if ((r = make_room_bytes(s, oe, bytes)) < 0) {
        s->refused_bytes++;
        snprintf(why, sizeof(why), "refused by limit ExpertMaxQueuedBytes: the queues are full "
                 "(%zu MiB)", s->max_queued_bytes >> 20);
        goto fail;
    }
    /* The body lives only during this call: the request keeps its own copy. */
    p = malloc(sizeof(*p) + bytes);
    if (p == NULL) {
        r = -ENOMEM;
        goto fail;
    }
    memset(p, 0, sizeof(*p));
    p->x = (float *)(p + 1);
    memcpy(p->x, mr.x, n * sizeof(float));
    if (backward) {
        p->gy = p->x + n;
        memcpy(p->gy, mr.gy, n * sizeof(float));
    }
    if (mr.mask != NULL) {
        p->mask = (uint8_t *)(p->x + n * (backward ? 2 : 1));
        memcpy(p->mask, mr.mask, mr.batch);
    }
    /* Non-finite input is refused alone, so that it cannot fail a whole batch. */
    if (!floats_finite(p->x, n) || (backward && !floats_finite(p->gy, n))) {
        free(p);
        r = -EDOM;
        snprintf(why, sizeof(why), "the %s holds non-finite values", backward ? "input or "
                 "gradient" : "input");
        goto fail;
    }
    p->req = req;
    p->batch = mr.batch;
    p->seq = mr.seq;
    p->bytes = bytes;
    p->arrived_ms = hm_now_ms();
    p->oe = oe;
    if (queue_push(&e->q[backward ? Q_BWD : Q_FWD], p) < 0) {
        free(p);
        r = -ENOMEM;
        goto fail;
    }
    oe->v[OV_BYTES] += bytes;
    oe->v[OV_REQS]++;
    waiting_add(s, e);
    expert_kick(s, e, p->arrived_ms);
    batch_rearm(s);
    return;
fail:
    if (oe != NULL)
        hm_origin_tab_release(&s->origins, oe);
    respond_why(req, r, why);
}

void hm_moe_server_limits(hm_moe_server *s, hm_limit_emit_fn emit, void *ud)
{
    if (s == NULL)
        return;
    emit(ud, "ExpertMaxQueued", s->refused_queued);
    emit(ud, "ExpertMaxQueuedBytes", s->refused_bytes);
    emit(ud, "ExpertMaxSeq", s->refused_seq);
}

static void on_fwd(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                   const struct sockaddr *from, const uint8_t *body, size_t len)
{
    HM_UNUSED(peer_pk);
    handle(ud, req, from, body, len, 0);
}

static void on_bwd(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                   const struct sockaddr *from, const uint8_t *body, size_t len)
{
    HM_UNUSED(peer_pk);
    handle(ud, req, from, body, len, 1);
}

static void on_info(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                    const struct sockaddr *from, const uint8_t *body, size_t len)
{
    hm_moe_server *s = ud;
    char uid[HM_MOE_UID_MAX + 1];
    uint8_t out[128];
    hm_wire_wr w;
    expert *e;
    int r;

    HM_UNUSED(peer_pk);
    HM_UNUSED(from);
    if (s->state != S_RUNNING) {
        r = -ESHUTDOWN;
        goto fail;
    }
    if ((r = hm_moe_decode_info_req(body, len, uid)) < 0)
        goto fail;
    if ((e = find_expert(s, uid)) == NULL) {
        r = -ENOENT;
        goto fail;
    }
    hm_wire_wr_init_fixed(&w, out, sizeof(out));
    hm_moe_encode_info_seq(&w, e->type, e->dim, e->hidden, e->heads, e->max_seq);
    if ((r = hm_wire_wr_error(&w)) < 0)
        goto fail;
    hm_rpc_respond(req, 0, out, w.len);
    return;
fail:
    hm_rpc_respond(req, r, NULL, 0);
}

/* ------------------------------------------------------------ declarations */

static int decl_cmp(const void *a, const void *b)
{
    const decl *x = a, *y = b;
    int c = strcmp(x->key, y->key);
    if (c != 0)
        return c;
    if (x->subkey_len != y->subkey_len)
        return x->subkey_len < y->subkey_len ? -1 : 1;
    c = memcmp(x->subkey, y->subkey, x->subkey_len);
    if (c != 0)
        return c;
    if (x->value_len != y->value_len)
        return x->value_len < y->value_len ? -1 : 1;
    return memcmp(x->value, y->value, x->value_len);
}

/*
 * Builds the records of every hosted expert: its own and one per grid
 * prefix (deduplicated: experts under one prefix coordinate share it, and
 * the entry names the first of them in uid order).
 */
static int decls_build(hm_moe_server *s)
{
    size_t cap = 0, n = 0;
    decl *d;

    for (size_t i = 0; i < s->nex; i++)
        cap += 1 + s->ex[i]->u.ndims;
    d = calloc(cap > 0 ? cap : 1, sizeof(*d));
    if (d == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < s->nex; i++) {
        expert *e = s->ex[i];
        decl *x = &d[n];
        int r;
        hm_strlcpy(x->key, e->uid, sizeof(x->key));
        x->subkey_len = strlen(s->marker);
        memcpy(x->subkey, s->marker, x->subkey_len);
        r = hm_moe_encode_expert_value(x->value, sizeof(x->value), s->addr, e->type, e->dim);
        if (r < 0) {
            free(d);
            return r;
        }
        x->value_len = (size_t)r;
        n++;
        for (unsigned l = 0; l < e->u.ndims; l++) {
            x = &d[n];
            if ((r = hm_moe_uid_prefix(&e->u, l, x->key, sizeof(x->key))) < 0) {
                free(d);
                return r;
            }
            r = snprintf((char *)x->subkey, sizeof(x->subkey), "%u%s", (unsigned)e->u.coords[l],
                         s->marker);
            x->subkey_len = (size_t)r;
            r = hm_moe_encode_prefix_value(x->value, sizeof(x->value), e->uid, s->addr);
            if (r < 0) {
                free(d);
                return r;
            }
            x->value_len = (size_t)r;
            n++;
        }
    }
    qsort(d, n, sizeof(*d), decl_cmp);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (m > 0 && strcmp(d[m - 1].key, d[i].key) == 0 &&
            d[m - 1].subkey_len == d[i].subkey_len &&
            memcmp(d[m - 1].subkey, d[i].subkey, d[i].subkey_len) == 0)
            continue;
        if (m != i)
            d[m] = d[i];
        m++;
    }
    free(s->decls);
    s->decls = d;
    s->ndecls = m;
    s->decl_dirty = 0;
    return 0;
}

static void decl_timer_cb(uv_timer_t *t);
static void decl_continue(hm_moe_server *s);

static void putop_unlink(hm_moe_server *s, putop *o)
{
    LIST_REMOVE(o, link);
    s->puts_out--;
}

static void on_put(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    putop *o = ud;
    hm_moe_server *s = o->s;

    HM_UNUSED(stored);
    if (s == NULL) {
        free(o);
        return;
    }
    putop_unlink(s, o);
    size_t idx = o->idx;
    free(o);
    /* A node that asked nobody kept the record only in its own store (a
     * lone node, or one whose first peers have not answered yet): that
     * round does not count as stored, so the next comes within seconds
     * and reaches the peers as soon as there are some. */
    if (status == 0 && (info == NULL || info->requests > 0))
        s->round_stored++;
    if (status < 0 && status != -ECANCELED) {
        hm_debug(MOD, "declaration not stored: %s", hm_strerror(status));
        if (idx < s->ndecls && !s->withdrawing) {
            s->decls[idx].failed = 1;
            s->round_failed++;
        }
    }
    decl_continue(s);
}

/* Orphans the puts in flight: their callbacks free only themselves. */
static void puts_orphan(hm_moe_server *s)
{
    putop *o;
    LIST_FOREACH(o, &s->puts, link)
        o->s = NULL;
    LIST_INIT(&s->puts);
    s->puts_out = 0;
}

static void withdraw_done(hm_moe_server *s)
{
    uv_timer_stop(&s->decl_timer);
    puts_orphan(s);
    s->decl_round = 0;
    close_step(s);
}

/*
 * Starts puts from the cursor while slots are free. A round ends when every
 * record is out and answered; the next refresh is then a third of the TTL
 * away (with jitter), or now when the expert set changed meanwhile.
 */
static void decl_continue(hm_moe_server *s)
{
    int withdraw = s->withdrawing;

    if (!s->decl_round)
        return;
    if (withdraw && hm_now_ms() >= s->withdraw_deadline_ms) {
        withdraw_done(s);
        return;
    }
    while (s->decl_cursor < s->ndecls && s->puts_out < PUTS_INFLIGHT) {
        decl *d = &s->decls[s->decl_cursor];
        /* A retry pass sends only what failed. */
        if (s->retry_pass > 0 && !d->failed) {
            s->decl_cursor++;
            continue;
        }
        /* Paced (DECL_PUTS_PER_S); a withdrawal at close is not, it has a deadline. */
        if (!withdraw) {
            uint64_t now = hm_now_ms();
            if (now > s->decl_tokens_ms) {
                s->decl_tokens = HM_MIN(DECL_PUTS_BURST, s->decl_tokens +
                                                             (double)(now - s->decl_tokens_ms) *
                                                                 DECL_PUTS_PER_S / 1000.0);
                s->decl_tokens_ms = now;
            }
            if (s->decl_tokens < 1.0) {
                uint64_t wait = (uint64_t)((1.0 - s->decl_tokens) * 1000.0 / DECL_PUTS_PER_S) + 1;
                uv_timer_start(&s->decl_timer, decl_timer_cb, wait, 0);
                return;
            }
        }
        putop *o = calloc(1, sizeof(*o));
        int r;
        if (o == NULL)
            break;
        o->s = s;
        o->idx = s->decl_cursor;
        r = hm_node_dht_put(s->node, (const uint8_t *)d->key, strlen(d->key), d->subkey,
                            d->subkey_len, 1, d->value, withdraw ? 0 : d->value_len, s->ttl_s,
                            withdraw ? WITHDRAW_PUT_TIMEOUT_MS : PUT_TIMEOUT_MS, on_put, o);
        if (r == -ENOBUFS || r == -ENOMEM) {
            /* The DHT is busy with other lookups: come back shortly. */
            free(o);
            if (s->puts_out == 0)
                uv_timer_start(&s->decl_timer, decl_timer_cb, PUT_RETRY_MS, 0);
            return;
        }
        s->decl_cursor++;
        d->failed = 0;
        if (!withdraw)
            s->decl_tokens -= 1.0;
        if (r < 0) {
            free(o);
            hm_debug(MOD, "%s: declaration not started: %s", d->key, hm_strerror(r));
            continue;
        }
        LIST_INSERT_HEAD(&s->puts, o, link);
        s->puts_out++;
    }
    if (s->decl_cursor < s->ndecls || s->puts_out > 0)
        return;
    if (!withdraw && s->state == S_RUNNING && s->round_failed > 0 &&
        s->retry_pass < DECL_RETRIES) {
        /*
         * Some records reached no replica (a lookup timed out, a peer
         * refused): only those go again, after a back-off, rather than
         * waiting for the next refresh while callers cannot find them.
         */
        hm_debug(MOD, "retrying %zu declarations that were not stored", s->round_failed);
        s->round_failed = 0;
        s->decl_cursor = 0;
        uv_timer_start(&s->decl_timer, decl_timer_cb, jitter((uint64_t)1000 << s->retry_pass),
                       0);
        s->retry_pass++;
        return;
    }
    s->decl_round = 0;
    if (withdraw) {
        withdraw_done(s);
        return;
    }
    if (s->state != S_RUNNING)
        return;
    uint64_t next = (uint64_t)(s->ttl_s * 1000.0 / 3.0);
    if (s->ndecls > 0 && s->round_stored == 0) {
        /*
         * Nothing was stored (a node that has not found its peers yet, say):
         * retry sooner than the refresh period, backing off from 1 s to
         * 4 s: a round that reaches nobody costs next to nothing, and a
         * daemon started with its experts should be findable as soon as
         * its first peer answers.
         */
        uint64_t backoff = (uint64_t)1000 << HM_MIN(s->failed_rounds, 2u);
        s->failed_rounds++;
        next = HM_MIN(next, backoff);
    } else {
        s->failed_rounds = 0;
    }
    uv_timer_start(&s->decl_timer, decl_timer_cb, s->decl_dirty ? 0 : jitter(next), 0);
}

static void decl_round_start(hm_moe_server *s)
{
    /*
     * The declared address can change (detected, confirmed, lost), so it is
     * read each round; with none that others could dial, nothing is
     * declared: a record pointing at 0.0.0.0 or at an unreachable node only
     * makes callers time out.
     */
    struct sockaddr_storage ss;
    char a[HM_ADDRSTRLEN];
    int ar = hm_node_announce(s->node, &ss);
    if (ar < 0 || hm_format_addr((const struct sockaddr *)&ss, a, sizeof(a)) != 0 ||
        strlen(a) > HM_MOE_ADDR_MAX) {
        if (!s->addr_missing && s->nex > 0)
            hm_warn(MOD, "experts not declared: this node has no address others can dial (%s)",
                    hm_strerror(ar < 0 ? ar : -EINVAL));
        s->addr_missing = 1;
        uv_timer_start(&s->decl_timer, decl_timer_cb, 2000, 0);
        return;
    }
    if (s->addr_missing || strcmp(a, s->addr) != 0) {
        hm_info(MOD, "declaring the experts at %s", a);
        hm_strlcpy(s->addr, a, sizeof(s->addr));
        s->decl_dirty = 1;
    }
    s->addr_missing = 0;
    if (s->decl_dirty || s->decls == NULL) {
        if (decls_build(s) < 0) {
            hm_warn(MOD, "cannot build the expert declarations; retrying");
            uv_timer_start(&s->decl_timer, decl_timer_cb, 1000, 0);
            return;
        }
    }
    s->decl_round = 1;
    s->decl_cursor = 0;
    s->round_stored = 0;
    s->round_failed = 0;
    s->retry_pass = 0;
    decl_continue(s);
}

static void decl_timer_cb(uv_timer_t *t)
{
    hm_moe_server *s = t->data;

    if (s->decl_round) {
        /* A retry after the DHT was busy, or the withdrawal's deadline. */
        decl_continue(s);
        return;
    }
    if (s->state == S_RUNNING)
        decl_round_start(s);
}

/* Asks for a declaration round now (after the current one, if one is running). */
static void decl_soon(hm_moe_server *s)
{
    s->decl_dirty = 1;
    if (!s->decl_round && s->state == S_RUNNING)
        uv_timer_start(&s->decl_timer, decl_timer_cb, 0, 0);
}

/* -- relay failover -- The node's address moved (another relay, or none):
 * declare the experts there now, not at the next refresh (ttl / 3). */
static void on_node_address(void *ud)
{
    hm_moe_server *s = ud;
    if (s->nex > 0)
        decl_soon(s);
}

/* ------------------------------------------------------------ checkpoints */

static void ckpt_timer_cb(uv_timer_t *t)
{
    hm_moe_server *s = t->data;

    if (s->state != S_RUNNING)
        return;
    for (size_t i = 0; i < s->nex; i++) {
        expert *e = s->ex[i];
        if (e->steps <= e->steps_at_ckpt)
            continue;
        e->ckpt_wanted = 1;
        expert_kick(s, e, hm_now_ms());
    }
    batch_rearm(s);
}

int hm_moe_server_checkpoint(hm_moe_server *s)
{
    int first = 0;

    if (s == NULL)
        return -EINVAL;
    if (s->state_dir == NULL)
        return 0;
    for (size_t i = 0; i < s->nex; i++) {
        expert *e = s->ex[i];
        uint64_t steps;
        int r;
        /* The lock also waits for a batch running on a worker; its step is saved too. */
        uv_mutex_lock(&e->lock);
        steps = model_steps(e);
        uv_mutex_unlock(&e->lock);
        /*
         * An expert that never stepped is still written once (unless its
         * file exists already), so that what it serves can be read back.
         */
        if (steps <= e->steps_at_ckpt && (e->last_ckpt_unix_ms != 0 || e->resumed))
            continue;
        if ((r = write_checkpoint(e, &steps)) < 0) {
            hm_error(MOD, "%s: checkpoint to %s failed: %s", e->uid, e->path, hm_strerror(r));
            if (first == 0)
                first = r;
            continue;
        }
        e->steps_at_ckpt = HM_MAX(e->steps_at_ckpt, steps);
        e->last_ckpt_unix_ms = wall_ms();
    }
    return first;
}

/* ------------------------------------------------------------ hosting */

static void expert_free(expert *e)
{
    if (e == NULL)
        return;
    hm_ffn_free(e->ffn);
    hm_xf_free(e->xf);
    uv_mutex_destroy(&e->lock);
    free(e->path);
    free(e);
}

/* Room for a checkpoint of this config: the parameters and at most two moment vectors. */
/* What a hosted expert is made of: an ffn, or a transformer (whose xf.ffn is ffn). */
typedef struct model_cfg {
    int transformer;
    hm_ffn_config ffn;
    hm_xf_config xf;
} model_cfg;

static size_t ckpt_max_len(const model_cfg *mc)
{
    const hm_ffn_config *cfg = &mc->ffn;
    size_t d = cfg->dim, h = cfg->hidden ? cfg->hidden : 4 * cfg->dim;
    size_t np = 2 * d + h * d + h + d * h + d;
    if (mc->transformer)
        np += 4 * d * d + 6 * d; /* the attention's parameters, and its header below */
    return np * sizeof(float) * 3 + CKPT_SLACK * (mc->transformer ? 2 : 1);
}

/*
 * Loads a state of the model c asks for into e. A well-formed state of the
 * other kind (an ffn's where a transformer is hosted, or the other way
 * round) is -EPROTO with *other_kind set: the file is not corrupt, it is
 * another expert's.
 */
static int load_model(expert *e, const model_cfg *c, const uint8_t *buf, size_t len,
                      int *other_kind)
{
    *other_kind = 0;
    if (c->transformer) {
        if (!hm_xf_is_state(buf, len)) {
            hm_ffn *tmp = NULL;
            if (hm_ffn_load(buf, len, NULL, &tmp) == 0) {
                hm_ffn_free(tmp);
                *other_kind = 1;
                return -EPROTO;
            }
        }
        return hm_xf_load(buf, len, &c->xf, &e->xf);
    }
    if (hm_xf_is_state(buf, len)) {
        *other_kind = 1;
        return -EPROTO;
    }
    return hm_ffn_load(buf, len, &c->ffn, &e->ffn);
}

/* Why a checkpoint was unusable, in words: -EBADMSG here is corruption, not authentication. */
static const char *ckpt_why(int r)
{
    return r == -EBADMSG ? "corrupt or malformed" : hm_strerror(r);
}

/*
 * Loads e's checkpoint into e->ffn when there is a usable one. A file
 * that does not verify, or verifies but holds malformed content (a state
 * written before a bug was fixed, say), is treated alike: PATH.prev is
 * tried, and failing that the expert starts afresh (e->ffn stays NULL),
 * with the reason logged. Only a well-formed state of another dim, hidden
 * size or optimizer refuses the expert (-EPROTO, with err set); -ENOMEM
 * and -EINVAL (a config hm_ffn cannot take) are returned as they are.
 */
static int expert_resume(expert *e, const model_cfg *c, size_t max_len, char *err,
                         size_t errlen)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    char *prev = NULL;
    int used_prev = 0, other_kind = 0, r;

    r = hm_ckpt_read(e->path, max_len, &buf, &len, &used_prev);
    if (r == -ENOENT)
        return 0;
    if (r == -EMSGSIZE) {
        snprintf(err, errlen, "the checkpoint %s is larger than an expert of the requested size",
                 e->path);
        return -EPROTO;
    }
    if (r == -ENOMEM)
        return r;
    if (r < 0) {
        hm_error(MOD, "%s: no good checkpoint at %s (%s); starting afresh", e->uid, e->path,
                 ckpt_why(r));
        return 0;
    }
    r = load_model(e, c, buf, len, &other_kind);
    if (r == -EBADMSG && !used_prev) {
        size_t pl = strlen(e->path) + sizeof(".prev");
        hm_warn(MOD, "%s: %s verifies but holds a malformed state; trying %s.prev", e->uid,
                e->path, e->path);
        free(buf);
        buf = NULL;
        if ((prev = malloc(pl)) == NULL) {
            r = -ENOMEM;
            goto out;
        }
        snprintf(prev, pl, "%s.prev", e->path);
        int rp = hm_ckpt_read_file(prev, max_len, &buf, &len);
        if (rp == 0) {
            used_prev = 1;
            r = load_model(e, c, buf, len, &other_kind);
        } else if (rp == -ENOMEM) {
            r = rp;
        }
    }
    if (r == -EPROTO && other_kind) {
        snprintf(err, errlen, "the checkpoint %s%s holds %s expert, not %s", e->path,
                 used_prev ? ".prev" : "", c->transformer ? "an ffn" : "a transformer",
                 c->transformer ? "a transformer" : "an ffn");
        goto out;
    }
    if (r == -EPROTO) {
        snprintf(err, errlen,
                 "the checkpoint %s%s does not match the requested dim, hidden size, %soptimizer",
                 e->path, used_prev ? ".prev" : "", c->transformer ? "heads or " : "or ");
        goto out;
    }
    if (r == -ENOMEM)
        goto out;
    if (r == -EINVAL) {
        snprintf(err, errlen, "cannot create expert %s: invalid expert config", e->uid);
        goto out;
    }
    if (r < 0) {
        hm_error(MOD, "%s: checkpoint %s%s holds no usable state (%s); starting afresh", e->uid,
                 e->path, used_prev ? " and its .prev" : "", ckpt_why(r));
        e->ffn = NULL;
        e->xf = NULL;
        r = 0;
        goto out;
    }
    if (used_prev)
        hm_warn(MOD, "%s: %s was missing, corrupt or malformed; resumed from %s.prev", e->uid,
                e->path, e->path);
    e->resumed = 1;
    e->steps = e->steps_at_ckpt = model_steps(e);
out:
    free(prev);
    free(buf);
    return r;
}

/*
 * The file name of a uid's checkpoint. A uid's name may hold any character
 * but '.' ('/' included), so the bytes outside [A-Za-z0-9_.-] are written as
 * %XX: the name stays inside experts/, one uid has one file, and the uids
 * of that old alphabet keep the names they always had. A name that would
 * pass CKPT_NAME_MAX bytes (room left for ".ckpt.prev" and ".tmp" under
 * NAME_MAX) is "h-" and the hex of the uid's BLAKE2b-128 instead; it holds
 * no '.', so it is never the name of another uid.
 */
#define CKPT_NAME_MAX 200

static void ckpt_name(const char *uid, char out[CKPT_NAME_MAX + 1])
{
    static const char hex[] = "0123456789ABCDEF";
    size_t n = 0;

    for (const unsigned char *p = (const unsigned char *)uid; *p != '\0'; p++) {
        unsigned char c = *p;
        int keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                   c == '_' || c == '.' || c == '-';
        if (n + (keep ? 1 : 3) > CKPT_NAME_MAX) {
            uint8_t h[16];
            crypto_generichash(h, sizeof(h), (const uint8_t *)uid, strlen(uid), NULL, 0);
            memcpy(out, "h-", 2);
            for (size_t i = 0; i < sizeof(h); i++) {
                out[2 + 2 * i] = hex[h[i] >> 4];
                out[3 + 2 * i] = hex[h[i] & 15];
            }
            out[2 + 2 * sizeof(h)] = '\0';
            return;
        }
        if (keep) {
            out[n++] = (char)c;
        } else {
            out[n++] = '%';
            out[n++] = hex[c >> 4];
            out[n++] = hex[c & 15];
        }
    }
    out[n] = '\0';
}

static int expert_new(hm_moe_server *s, const hm_moe_uid *u, const char *type,
                      const model_cfg *cfg, expert **out, char *err, size_t errlen)
{
    model_cfg c = *cfg;
    expert *e;
    int result;

    e = calloc(1, sizeof(*e));
    if (e == NULL)
        return -ENOMEM;
    if (uv_mutex_init(&e->lock) != 0) {
        free(e);
        return -ENOMEM;
    }
    e->s = s;
    e->u = *u;
    TAILQ_INIT(&e->q[Q_FWD].flows);
    TAILQ_INIT(&e->q[Q_BWD].flows);
    e->q[Q_FWD].srv_bytes = e->q[Q_BWD].srv_bytes = &s->queued_bytes;
    if ((result = hm_moe_uid_format(u, e->uid, sizeof(e->uid))) < 0)
        goto out;
    hm_strlcpy(e->type, type, sizeof(e->type));
    c.ffn.seed = expert_seed(cfg->ffn.seed, e->uid);
    c.xf.ffn = c.ffn;
    if (s->state_dir != NULL) {
        char name[CKPT_NAME_MAX + 1];
        ckpt_name(e->uid, name);
        size_t pl = strlen(s->state_dir) + strlen("/experts/") + strlen(name) + 6;
        e->path = malloc(pl);
        if (e->path == NULL) {
            result = -ENOMEM;
            goto out;
        }
        snprintf(e->path, pl, "%s/experts/%s.ckpt", s->state_dir, name);
        if ((result = expert_resume(e, &c, ckpt_max_len(cfg), err, errlen)) < 0)
            goto out;
    }
    if (e->ffn == NULL && e->xf == NULL) {
        result = c.transformer ? hm_xf_new(&c.xf, &e->xf) : hm_ffn_new(&c.ffn, &e->ffn);
        if (result < 0) {
            snprintf(err, errlen, "cannot create expert %s: %s", e->uid, hm_strerror(result));
            goto out;
        }
    }
    if (e->xf != NULL) {
        const hm_xf_config *xc = hm_xf_config_of(e->xf);
        e->dim = xc->ffn.dim;
        e->hidden = xc->ffn.hidden;
        e->heads = xc->heads;
        e->max_seq = xc->max_seq;
    } else {
        e->dim = hm_ffn_dim(e->ffn);
        e->hidden = hm_ffn_config_of(e->ffn)->hidden;
    }
    result = 0;
out:
    if (result < 0) {
        expert_free(e);
        e = NULL;
    }
    *out = e;
    return result;
}

static int make_dirs(const char *state_dir, char *err, size_t errlen)
{
    size_t pl = strlen(state_dir) + strlen("/experts") + 1;
    char *p = malloc(pl);
    int result = 0;

    if (p == NULL)
        return -ENOMEM;
    snprintf(p, pl, "%s/experts", state_dir);
    if (mkdir(p, 0700) < 0) {
        if (errno != EEXIST) {
            result = -errno;
            snprintf(err, errlen, "cannot create %s: %s", p, strerror(errno));
        }
        goto out;
    }
    /*
     * The new directory's entry lives in state_dir: without an fsync of it,
     * a crash could lose experts/ and every checkpoint fsync'd inside it.
     */
    result = hm_fsync_dir(state_dir);
    if (result != 0)
        snprintf(err, errlen, "cannot sync %s: %s", state_dir, strerror(-result));
out:
    free(p);
    return result;
}

static int host_common(hm_moe_server *s, const char *pattern, const char *type,
                       const model_cfg *mc, size_t *n_added_out, char *err, size_t errlen)
{
    const hm_ffn_config *cfg = mc != NULL ? &mc->ffn : NULL;
    hm_moe_uid *uids = NULL;
    expert **fresh = NULL;
    expert **grown;
    size_t nfresh = 0, nnew = 0;
    char ebuf[1];
    int n, result;

    if (err == NULL || errlen == 0) {
        err = ebuf;
        errlen = sizeof(ebuf);
    }
    err[0] = '\0';
    if (n_added_out != NULL)
        *n_added_out = 0;
    if (s == NULL || cfg == NULL) {
        snprintf(err, errlen, "no server or no expert config");
        return -EINVAL;
    }
    if (s->state != S_RUNNING) {
        snprintf(err, errlen, "the expert server is shutting down");
        return -ESHUTDOWN;
    }
    if (!type_ok(type)) {
        snprintf(err, errlen, "expert type must be 1..%d characters of [A-Za-z0-9_-]",
                 HM_MOE_TYPE_MAX);
        return -EINVAL;
    }
    if (cfg->dim == 0 || cfg->dim > HM_MOE_MAX_DIM || cfg->dim > HM_FFN_MAX_DIM ||
        cfg->hidden > HM_FFN_MAX_HIDDEN ||
        (cfg->optimizer != HM_FFN_SGD && cfg->optimizer != HM_FFN_ADAM)) {
        snprintf(err, errlen, "expert dim must be 1..%d, hidden at most %d, optimizer sgd or adam",
                 HM_MOE_MAX_DIM, HM_FFN_MAX_HIDDEN);
        return -EINVAL;
    }
    uids = calloc(HM_MOE_MAX_PATTERN_EXPERTS, sizeof(*uids));
    if (uids == NULL)
        return -ENOMEM;
    n = hm_moe_pattern_expand(pattern, uids, HM_MOE_MAX_PATTERN_EXPERTS, err, errlen);
    if (n < 0) {
        result = n;
        goto out;
    }
    for (int i = 0; i < n; i++) {
        char uid[HM_MOE_UID_MAX + 1];
        hm_moe_uid_format(&uids[i], uid, sizeof(uid));
        if (find_expert(s, uid) == NULL)
            nnew++;
    }
    if (s->nex + nnew > HM_MOE_SERVER_MAX_EXPERTS) {
        snprintf(err, errlen, "hosting %zu more experts would exceed %d", nnew,
                 HM_MOE_SERVER_MAX_EXPERTS);
        result = -EMSGSIZE;
        goto out;
    }
    if (nnew == 0) {
        result = 0;
        goto out;
    }
    if (s->state_dir != NULL && (result = make_dirs(s->state_dir, err, errlen)) < 0)
        goto out;
    fresh = calloc(nnew, sizeof(*fresh));
    if (fresh == NULL) {
        result = -ENOMEM;
        goto out;
    }
    for (int i = 0; i < n; i++) {
        char uid[HM_MOE_UID_MAX + 1];
        hm_moe_uid_format(&uids[i], uid, sizeof(uid));
        if (find_expert(s, uid) != NULL)
            continue;
        /* A pattern may name an expert twice only through the same coordinates: skip repeats. */
        int dup = 0;
        for (size_t k = 0; k < nfresh && !dup; k++)
            dup = strcmp(fresh[k]->uid, uid) == 0;
        if (dup)
            continue;
        if ((result = expert_new(s, &uids[i], type, mc, &fresh[nfresh], err, errlen)) < 0) {
            if (err[0] == '\0')
                snprintf(err, errlen, "cannot host %s: %s", uid, hm_strerror(result));
            goto out;
        }
        nfresh++;
    }
    grown = realloc(s->ex, (s->nex + nfresh) * sizeof(*grown));
    if (grown == NULL) {
        result = -ENOMEM;
        goto out;
    }
    s->ex = grown;
    memcpy(s->ex + s->nex, fresh, nfresh * sizeof(*fresh));
    s->nex += nfresh;
    qsort(s->ex, s->nex, sizeof(*s->ex), expert_cmp);
    if (n_added_out != NULL)
        *n_added_out = nfresh;
    hm_info(MOD, "hosting %zu new experts from %s (%zu in all)", nfresh, pattern, s->nex);
    nfresh = 0;
    decl_soon(s);
    result = 0;
out:
    for (size_t k = 0; k < nfresh; k++)
        expert_free(fresh[k]);
    free(fresh);
    free(uids);
    return result;
}

int hm_moe_server_host(hm_moe_server *s, const char *pattern, const char *type,
                       const hm_ffn_config *cfg, size_t *n_added_out, char *err, size_t errlen)
{
    model_cfg mc;

    if (type != NULL && strcmp(type, HM_MOE_TYPE_TRANSFORMER) == 0) {
        if (err != NULL && errlen > 0)
            snprintf(err, errlen, "transformer experts take a transformer config "
                     "(hm_moe_server_host_xf)");
        if (n_added_out != NULL)
            *n_added_out = 0;
        return -EINVAL;
    }
    memset(&mc, 0, sizeof(mc));
    if (cfg != NULL)
        mc.ffn = *cfg;
    return host_common(s, pattern, type, cfg != NULL ? &mc : NULL, n_added_out, err, errlen);
}

int hm_moe_server_host_xf(hm_moe_server *s, const char *pattern, const hm_xf_config *cfg,
                          size_t *n_added_out, char *err, size_t errlen)
{
    model_cfg mc;
    hm_xf_config probe;

    if (n_added_out != NULL)
        *n_added_out = 0;
    if (cfg == NULL)
        return host_common(s, pattern, HM_MOE_TYPE_TRANSFORMER, NULL, n_added_out, err, errlen);
    probe = *cfg;
    /* The shape is checked once here, with defaults filled in, before any expert is made. */
    if (probe.max_seq > HM_MOE_MAX_SEQ || probe.heads > HM_XF_MAX_HEADS ||
        (probe.heads != 0 && probe.ffn.dim % probe.heads != 0) ||
        probe.max_seq > HM_XF_MAX_SEQ) {
        if (err != NULL && errlen > 0)
            snprintf(err, errlen, "a transformer's heads must divide its dim (at most %d heads) "
                     "and its max_seq be at most %d", HM_XF_MAX_HEADS, HM_XF_MAX_SEQ);
        return -EINVAL;
    }
    memset(&mc, 0, sizeof(mc));
    mc.transformer = 1;
    mc.ffn = cfg->ffn;
    mc.xf = *cfg;
    return host_common(s, pattern, HM_MOE_TYPE_TRANSFORMER, &mc, n_added_out, err, errlen);
}

/* ------------------------------------------------------------ listing */

static int dbl_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

size_t hm_moe_server_list(hm_moe_server *s, hm_moe_hosted *out, size_t max)
{
    double lat[LAT_RING];

    if (s == NULL)
        return 0;
    for (size_t i = 0; i < s->nex && i < max && out != NULL; i++) {
        expert *e = s->ex[i];
        hm_moe_hosted *h = &out[i];
        memset(h, 0, sizeof(*h));
        hm_strlcpy(h->uid, e->uid, sizeof(h->uid));
        hm_strlcpy(h->type, e->type, sizeof(h->type));
        h->dim = e->dim;
        h->hidden = e->hidden;
        h->heads = e->heads;
        h->max_seq = e->max_seq;
        h->fwd_requests = e->fwd_requests;
        h->bwd_requests = e->bwd_requests;
        h->batches = e->batches;
        h->mean_batch_size = e->batches ? (double)e->batch_samples / (double)e->batches : 0.0;
        if (e->lat_n > 0) {
            memcpy(lat, e->lat_ms, e->lat_n * sizeof(double));
            qsort(lat, e->lat_n, sizeof(double), dbl_cmp);
            h->latency_p50_ms = lat[(e->lat_n - 1) / 2];
            h->latency_p99_ms = lat[(size_t)((double)(e->lat_n - 1) * 0.99 + 0.5)];
        }
        h->steps = e->steps;
        h->last_checkpoint_unix_ms = e->last_ckpt_unix_ms;
        h->resumed = e->resumed;
    }
    return s->nex;
}

/* ------------------------------------------------------------ life */

static void handle_closed(uv_handle_t *h)
{
    hm_moe_server *s = h->data;
    if (--s->handles_open > 0)
        return;
    void (*cb)(void *) = s->close_cb;
    void *ud = s->close_ud;
    for (size_t i = 0; i < s->nex; i++)
        expert_free(s->ex[i]);
    free(s->ex);
    free(s->decls);
    free(s->threads);
    free(s->state_dir);
    hm_origin_tab_free(&s->origins);
    uv_mutex_destroy(&s->jlock);
    uv_cond_destroy(&s->jcond);
    free(s);
    if (cb != NULL)
        cb(ud);
}

static void join_workers(hm_moe_server *s)
{
    uv_mutex_lock(&s->jlock);
    s->jstop = 1;
    uv_cond_broadcast(&s->jcond);
    uv_mutex_unlock(&s->jlock);
    for (unsigned i = 0; i < s->nthreads; i++)
        uv_thread_join(&s->threads[i]);
    s->nthreads = 0;
}

/*
 * Advances the close: DRAINING (running jobs finish) -> checkpoint ->
 * WITHDRAWING (empty values over the declarations, bounded) -> CLOSING
 * (methods unregistered, workers joined, handles closed, then freed).
 */
static void close_step(hm_moe_server *s)
{
    if (s->state == S_DRAINING) {
        if (s->jobs_out > 0)
            return;
        if (s->state_dir != NULL)
            (void)hm_moe_server_checkpoint(s);
        uv_timer_stop(&s->decl_timer);
        puts_orphan(s);
        s->decl_round = 0;
        if (s->do_withdraw && s->nex > 0) {
            set_state(s, S_WITHDRAWING);
            s->withdrawing = 1;
            s->withdraw_deadline_ms = hm_now_ms() + WITHDRAW_MAX_MS;
            if (s->decl_dirty || s->decls == NULL)
                (void)decls_build(s);
            s->decl_round = 1;
            s->decl_cursor = 0;
            s->retry_pass = 0;
            /* The deadline holds even when every put hangs. */
            uv_timer_start(&s->decl_timer, decl_timer_cb, WITHDRAW_MAX_MS, 0);
            decl_continue(s);
            return;
        }
        set_state(s, S_CLOSING);
    } else if (s->state == S_WITHDRAWING) {
        set_state(s, S_CLOSING);
    } else {
        return;
    }
    hm_node_unwatch_address(s->node, on_node_address, s); /* -- relay failover -- */
    if (s->registered) {
        hm_rpc_unregister(s->rpc, HM_MOE_METHOD_FWD);
        hm_rpc_unregister(s->rpc, HM_MOE_METHOD_BWD);
        hm_rpc_unregister(s->rpc, HM_MOE_METHOD_INFO);
        s->registered = 0;
    }
    join_workers(s);
    s->handles_open = 4;
    uv_close((uv_handle_t *)&s->async, handle_closed);
    uv_close((uv_handle_t *)&s->batch_timer, handle_closed);
    uv_close((uv_handle_t *)&s->decl_timer, handle_closed);
    uv_close((uv_handle_t *)&s->ckpt_timer, handle_closed);
}

int hm_moe_server_close(hm_moe_server *s, int withdraw, void (*cb)(void *ud), void *ud)
{
    if (s == NULL) {
        if (cb != NULL)
            cb(ud);
        return 0;
    }
    if (s->state != S_RUNNING) {
        /* The first call's cb says when the server is gone; this one's never fires. */
        hm_warn(MOD, "the expert server is already closing");
        return -EALREADY;
    }
    s->close_cb = cb;
    s->close_ud = ud;
    s->do_withdraw = withdraw;
    set_state(s, S_DRAINING);
    uv_timer_stop(&s->batch_timer);
    uv_timer_stop(&s->ckpt_timer);
    for (size_t i = 0; i < s->nex; i++)
        queue_fail_all(s, s->ex[i], -ESHUTDOWN);
    close_step(s);
    return 0;
}

int hm_moe_server_new(hm_node *node, const hm_moe_server_opts *opts, hm_moe_server **out)
{
    hm_moe_server_opts o;
    hm_moe_server *s = NULL;
    char addr[HM_PEER_ID_LEN + 2 + HM_ADDRSTRLEN];
    const char *at;
    int result, locks = 0;

    if (out == NULL)
        return -EINVAL;
    *out = NULL;
    if (node == NULL)
        return -EINVAL;
    memset(&o, 0, sizeof(o));
    if (opts != NULL)
        o = *opts;
    if (o.declare_ttl_s < 0 || o.declare_ttl_s != o.declare_ttl_s ||
        o.declare_ttl_s > HM_MOE_DECLARE_TTL_MAX_S ||
        o.workers > 256)
        return -EINVAL;
    if (hm_node_address(node, addr, sizeof(addr)) < 0 || (at = strchr(addr, '@')) == NULL ||
        strlen(at + 1) > HM_MOE_ADDR_MAX)
        return -EINVAL;

    s = calloc(1, sizeof(*s));
    if (s == NULL)
        return -ENOMEM;
    LIST_INIT(&s->waiting);
    STAILQ_INIT(&s->jobs);
    STAILQ_INIT(&s->done);
    LIST_INIT(&s->puts);
    s->node = node;
    s->loop = hm_node_loop(node);
    s->rpc = hm_node_rpc(node);
    s->state = S_RUNNING;
    s->nworkers = o.workers ? o.workers : 2;
    s->max_batch = o.max_batch_size ? o.max_batch_size : 1024;
    s->batch_wait_ms = o.batch_wait_ms ? o.batch_wait_ms : 2;
    s->max_queued = o.max_queued_samples ? o.max_queued_samples : 16384;
    s->max_queued_bytes = o.max_queued_bytes ? o.max_queued_bytes : MAX_QUEUED_BYTES;
    s->ttl_s = o.declare_ttl_s > 0 ? o.declare_ttl_s : 60.0;
    s->ckpt_interval_ms = o.checkpoint_interval_ms ? o.checkpoint_interval_ms : 60000;
    hm_strlcpy(s->addr, at + 1, sizeof(s->addr));
    hm_dht_owner_marker(hm_node_identity(node)->pk, s->marker);
    if (o.state_dir != NULL && (s->state_dir = strdup(o.state_dir)) == NULL) {
        result = -ENOMEM;
        goto fail;
    }
    if (hm_origin_tab_init(&s->origins, 0) != 0) {
        result = -ENOMEM;
        goto fail;
    }
    locks = 1;
    if (uv_mutex_init(&s->jlock) != 0) {
        result = -ENOMEM;
        goto fail;
    }
    locks = 2;
    if (uv_cond_init(&s->jcond) != 0) {
        result = -ENOMEM;
        goto fail;
    }
    locks = 3;
    s->threads = calloc(s->nworkers, sizeof(*s->threads));
    if (s->threads == NULL) {
        result = -ENOMEM;
        goto fail;
    }

    result = hm_rpc_register(s->rpc, HM_MOE_METHOD_FWD, on_fwd, s);
    if (result == 0 && (result = hm_rpc_register(s->rpc, HM_MOE_METHOD_BWD, on_bwd, s)) < 0)
        hm_rpc_unregister(s->rpc, HM_MOE_METHOD_FWD);
    if (result == 0 && (result = hm_rpc_register(s->rpc, HM_MOE_METHOD_INFO, on_info, s)) < 0) {
        hm_rpc_unregister(s->rpc, HM_MOE_METHOD_FWD);
        hm_rpc_unregister(s->rpc, HM_MOE_METHOD_BWD);
    }
    if (result < 0)
        goto fail; /* -EEXIST: this node already has an expert server */
    s->registered = 1;

    for (unsigned i = 0; i < s->nworkers; i++) {
        if (uv_thread_create(&s->threads[i], worker_main, s) != 0) {
            result = -ENOMEM;
            join_workers(s);
            hm_rpc_unregister(s->rpc, HM_MOE_METHOD_FWD);
            hm_rpc_unregister(s->rpc, HM_MOE_METHOD_BWD);
            hm_rpc_unregister(s->rpc, HM_MOE_METHOD_INFO);
            goto fail;
        }
        s->nthreads++;
    }
    /* Handle inits on a running loop do not fail. */
    uv_async_init(s->loop, &s->async, async_cb);
    uv_timer_init(s->loop, &s->batch_timer);
    uv_timer_init(s->loop, &s->decl_timer);
    uv_timer_init(s->loop, &s->ckpt_timer);
    s->async.data = s->batch_timer.data = s->decl_timer.data = s->ckpt_timer.data = s;
    if (s->state_dir != NULL)
        uv_timer_start(&s->ckpt_timer, ckpt_timer_cb, s->ckpt_interval_ms, s->ckpt_interval_ms);
    /* -- relay failover -- without a slot, the next refresh still moves the records */
    (void)hm_node_watch_address(s->node, on_node_address, s);
    *out = s;
    return 0;
fail:
    if (locks >= 3)
        uv_cond_destroy(&s->jcond);
    if (locks >= 2)
        uv_mutex_destroy(&s->jlock);
    if (locks >= 1)
        hm_origin_tab_free(&s->origins);
    free(s->threads);
    free(s->state_dir);
    free(s);
    return result;
}

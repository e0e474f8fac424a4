/*
 * bench_moe: what calling a feed-forward expert through the swarm costs,
 * measured next to the same computation run locally, in one run. It owns
 * the expert server processes it forks and nothing else.
 *
 *   bench_moe [--dim D] [--batches B,B,...] [--reps N] [--calls N]
 *             [--only throughput|straggler] [--quick] [-v]
 *
 * -v turns on debug logs in every process (a failed call then says why).
 * Part 1, throughput. One expert server process (forked, its own libuv
 * loop, node and hm_moe_server with default options) hosts one ffn expert
 * per batch size (dim D, hidden 4 * D, Adam; uids bench.0, bench.1, ...,
 * so that the server's per-expert statistics belong to one batch size).
 * The parent runs a client node and, for each batch size, times
 * hm_moe_forward then hm_moe_backward with k = 1 (real rpc over encrypted
 * TCP streams on 127.0.0.1), and hm_ffn_forward then hm_ffn_backward on a
 * local expert with the same seed, hence the same weights: the server's
 * expert seed is the configured one mixed with the uid (moe/server.c,
 * expert_seed), mirrored here, and the first forward's outputs are
 * compared so that a mismatch shows. One warm-up of each (it also opens
 * the connection), then --reps repetitions, remote and local alternating
 * so that load from other processes hits both alike; each timed run
 * starts after a short pause so that the other side's OpenBLAS threads,
 * which spin for a while after their last job, have gone to sleep.
 * Printed per batch: the medians of samples/s, the ratio remote/local,
 * the medians of the forward and backward times on each side, and the
 * server's own view of the expert (batches, mean batch size, arrival to
 * reply p50/p99 over forward and backward requests together).
 *
 * Part 2, a straggler. Four expert server processes host one expert each
 * (dim 256, hidden 1024). The client calls all four with k_min = 3,
 * timeout_after_k_min 100 ms and timeout 2 s, --calls times at batch 64:
 * first with all four healthy, then with one stopped by SIGSTOP (a stalled
 * process: its socket still accepts bytes, nothing answers). Printed: the
 * p50/p99 latency of each phase, how many experts answered each call, and
 * the ratio of the stalled phase's p50 to the healthy one's (the client
 * backs a stalled host off, so only the first stalled call should wait).
 *
 * Only figures are printed; the exit status is 1 only when something could
 * not be measured (a process or a call failed). Every child is killed and
 * reaped on every exit path: normally each is asked to close (its control
 * pipe is closed) and killed if it has not exited within a few seconds; on
 * failure, at exit and on SIGINT/SIGTERM they get SIGKILL; and each child
 * has PR_SET_PDEATHSIG, so that it dies with the parent even on SIGKILL.
 */
#include "config.h"

#include <cblas.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <uv.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "moe/client.h"
#include "src/base/crypto.h"
#include "moe/ffn.h"
#include "src/node/node.h"
#include "moe/proto.h"
#include "moe/server.h"
#include "src/base/util.h"
#include "bench/bench_common.h"

#define SWARM "bench-moe"
#define MAX_BATCHES 8
#define MAX_REPS 100
#define MAX_CALLS 10000
#define N_STRAG 4           /* servers in part 2 */
#define MAX_CHILDREN (1 + N_STRAG)
#define PAUSE_MS 150        /* before each timed run: OpenBLAS threads go to sleep */
#define START_TIMEOUT_MS 120000
#define CALL_TIMEOUT_MS 600000 /* part 1: a call must never time out, only measure */
#define STRAG_DIM 256
#define STRAG_BATCH 64
#define STRAG_K_MIN 3
#define STRAG_AFTER_K_MIN_MS 100
#define STRAG_TIMEOUT_MS 2000
#define EXPERT_SEED 1

typedef struct options {
    size_t dim;
    size_t batches[MAX_BATCHES];
    size_t nbatches;
    int reps;
    int calls;
    int skip_throughput, skip_straggler;
    int verbose;
} options;

static void usage(void)
{
    fprintf(stderr, "usage: bench_moe [--dim D] [--batches B,B,...] [--reps N] [--calls N]\n"
                    "                 [--only throughput|straggler] [--quick] [-v]\n");
    exit(64);
}

static void parse_batches(options *o, const char *s)
{
    char buf[256], *save = NULL;

    if (hm_strlcpy(buf, s, sizeof(buf)) < 0)
        usage();
    o->nbatches = 0;
    for (char *t = strtok_r(buf, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        if (o->nbatches == MAX_BATCHES)
            usage();
        o->batches[o->nbatches++] = hm_bench_parse_size(t, 1, HM_MOE_MAX_BATCH, usage);
    }
    if (o->nbatches == 0)
        usage();
}

static double minimum(const double *v, size_t n)
{
    double m = v[0];
    for (size_t i = 1; i < n; i++)
        m = HM_MIN(m, v[i]);
    return m;
}

/*
 * The seed the expert server gives the expert named uid when hosting it
 * with seed: the same mix as moe/server.c (expert_seed), so that the local
 * expert starts with the remote one's weights.
 */
static uint64_t server_expert_seed(uint64_t seed, const char *uid)
{
    uint8_t h[8];
    uint64_t z = 0;
    crypto_generichash(h, sizeof(h), (const uint8_t *)uid, strlen(uid), NULL, 0);
    for (int i = 0; i < 8; i++)
        z = (z << 8) | h[i];
    z = seed ^ z;
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* ------------------------------------------------------------ a server child */

typedef struct child {
    uv_loop_t loop;
    hm_node *node;
    hm_moe_server *server;
    uv_pipe_t down;
    int up_fd;
    hm_bench_linebuf lb;
    int closing;
} child;

static void child_closed(void *ud)
{
    HM_UNUSED(ud);
}

static void child_server_closed(void *ud)
{
    child *c = ud;
    c->server = NULL;
    hm_node_close(c->node, child_closed, c);
    c->node = NULL;
}

/* The parent closed our control pipe: close everything and let the loop end. */
static void child_shutdown(child *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    uv_close((uv_handle_t *)&c->down, NULL);
    hm_moe_server_close(c->server, 0, child_server_closed, c);
}

/* "S": one "H uid fwd bwd batches mean p50 p99" line per expert, then "E". */
static void child_command(child *c, const char *line)
{
    hm_moe_hosted h[MAX_BATCHES + 1];

    if (strcmp(line, "S") != 0)
        hm_bench_dief("child: unknown command");
    size_t n = hm_moe_server_list(c->server, h, MAX_BATCHES + 1);
    for (size_t i = 0; i < n && i < MAX_BATCHES + 1; i++)
        hm_bench_put_line(c->up_fd, "H %s %llu %llu %llu %.2f %.2f %.2f\n", h[i].uid,
                          (unsigned long long)h[i].fwd_requests,
                          (unsigned long long)h[i].bwd_requests, (unsigned long long)h[i].batches,
                          h[i].mean_batch_size, h[i].latency_p50_ms, h[i].latency_p99_ms);
    hm_bench_put_line(c->up_fd, "E\n");
}

static void child_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    child *c = h->data;
    HM_UNUSED(hint);
    buf->base = c->lb.buf + c->lb.len;
    buf->len = sizeof(c->lb.buf) - c->lb.len;
}

static void child_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    child *c = s->data;
    char line[HM_BENCH_LINE_MAX];
    int r;

    HM_UNUSED(buf);
    if (nread < 0) {
        child_shutdown(c);
        return;
    }
    c->lb.len += (size_t)nread;
    while ((r = hm_bench_lb_pop(&c->lb, line, sizeof(line))) > 0)
        child_command(c, line);
    if (r < 0)
        hm_bench_dief("child: command too long");
}

/*
 * Runs one expert server: hosts pattern with experts of dimension dim,
 * reports "A PEERID@HOST:PORT BLAS_THREADS" and serves until the parent
 * closes the control pipe.
 */
static void child_main(const char *pattern, size_t dim, int up_fd, int down_fd)
{
    child *c = calloc(1, sizeof(*c));
    hm_node_options no = {0};
    hm_moe_server_opts so = {0};
    hm_ffn_config cfg = {0};
    char err[256] = "", addr[256];
    size_t added = 0;
    int r;

#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
    if (getppid() != hm_bench_owner_pid())
        _exit(1); /* the parent died before PR_SET_PDEATHSIG took hold */
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    if (c == NULL)
        hm_bench_die("child", -ENOMEM);
    c->up_fd = up_fd;
    if ((r = uv_loop_init(&c->loop)) < 0)
        hm_bench_die("child: loop", r);
    no.listen = "127.0.0.1:0";
    no.swarm = SWARM;
    if ((r = hm_node_new(&c->loop, &no, &c->node, err, sizeof(err))) < 0) {
        fprintf(stderr, "bench_moe: child: node: %s\n", err);
        exit(1);
    }
    /* The server's defaults: what a daemon hosting experts runs with. */
    if ((r = hm_moe_server_new(c->node, &so, &c->server)) < 0)
        hm_bench_die("child: expert server", r);
    cfg.dim = dim;
    cfg.optimizer = HM_FFN_ADAM;
    cfg.seed = EXPERT_SEED;
    if ((r = hm_moe_server_host(c->server, pattern, "ffn", &cfg, &added, err, sizeof(err))) <
        0) {
        fprintf(stderr, "bench_moe: child: host %s: %s\n", pattern, err);
        exit(1);
    }
    if ((r = hm_node_address(c->node, addr, sizeof(addr))) < 0)
        hm_bench_die("child: address", r);
    hm_bench_put_line(up_fd, "A %s %d\n", addr, openblas_get_num_threads());

    uv_pipe_init(&c->loop, &c->down, 0);
    c->down.data = c;
    if ((r = uv_pipe_open(&c->down, down_fd)) < 0 ||
        (r = uv_read_start((uv_stream_t *)&c->down, child_alloc, child_read)) < 0)
        hm_bench_die("child: control pipe", r);
    uv_run(&c->loop, UV_RUN_DEFAULT);
    r = uv_loop_close(&c->loop);
    close(up_fd);
    free(c);
    exit(r == 0 ? 0 : 1);
}

/* ------------------------------------------------------------ the parent's view of a child */

typedef struct proc {
    int slot;          /* index in the caller's array */
    pid_t pid;         /* 0 once reaped */
    int up_fd, down_fd;
    hm_bench_linebuf lb;
    hm_moe_expert ex;  /* uid filled in by the caller */
    int blas_threads;
    int stopped;
} proc;

/* Forks the server child for ps[slot]; the earlier ps[0..slot) are running. */
static void spawn(proc *ps, int slot, const char *pattern, size_t dim)
{
    proc *p = &ps[slot];
    int up[2], down[2];

    if (pipe(up) < 0 || pipe(down) < 0)
        hm_bench_die("pipe", -errno);
    pid_t pid = hm_bench_fork();
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        /* The parent's ends of the earlier siblings' pipes: held open here,
         * a sibling's control pipe would not reach EOF when the parent
         * closes it. */
        for (int i = 0; i < slot; i++) {
            close(ps[i].up_fd);
            close(ps[i].down_fd);
        }
        child_main(pattern, dim, up[1], down[0]);
    }
    close(up[1]);
    close(down[0]);
    memset(p, 0, sizeof(*p));
    p->slot = slot;
    p->pid = pid;
    p->up_fd = up[0];
    p->down_fd = down[1];
    hm_bench_child_add(pid);
}

/* Next line from p, waiting at most until deadline_ms; dies when p dies. */
static void proc_line(proc *p, char *line, size_t cap, uint64_t deadline_ms)
{
    int got_line;

    while ((got_line = hm_bench_lb_pop(&p->lb, line, cap)) == 0) {
        uint64_t now = hm_now_ms();
        if (now >= deadline_ms)
            hm_bench_dief("timed out waiting for an expert server");
        struct pollfd pfd = {.fd = p->up_fd, .events = POLLIN};
        int r = poll(&pfd, 1, (int)HM_MIN(deadline_ms - now, 1000u));
        if (r < 0 && errno != EINTR)
            hm_bench_die("poll", -errno);
        if (r <= 0)
            continue;
        ssize_t got = read(p->up_fd, p->lb.buf + p->lb.len, sizeof(p->lb.buf) - p->lb.len);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            hm_bench_dief("an expert server exited (see its messages above)");
        p->lb.len += (size_t)got;
    }
    if (got_line < 0)
        hm_bench_dief("line too long from a server");
}

/* Waits for p's "A" line and fills in its address. */
static void proc_ready(proc *p, const char *uid)
{
    char line[HM_BENCH_LINE_MAX], addr[300];
    int threads;

    proc_line(p, line, sizeof(line), hm_now_ms() + START_TIMEOUT_MS);
    if (sscanf(line, "A %299s %d", addr, &threads) != 2)
        hm_bench_dief("bad ready line from an expert server");
    if (hm_peer_addr_parse(addr, p->ex.pk, &p->ex.addr) < 0)
        hm_bench_dief("bad address from an expert server");
    const char *at = strchr(addr, '@');
    if (at == NULL || hm_strlcpy(p->ex.addr_str, at + 1, sizeof(p->ex.addr_str)) < 0 ||
        hm_strlcpy(p->ex.uid, uid, sizeof(p->ex.uid)) < 0)
        hm_bench_dief("bad address from an expert server");
    p->blas_threads = threads;
}

typedef struct hosted_stats {
    unsigned long long fwd, bwd, batches;
    double mean, p50, p99;
} hosted_stats;

/* Asks p for its experts' statistics; fills the one named uid. */
static void proc_stats(proc *p, const char *uid, hosted_stats *out)
{
    char line[HM_BENCH_LINE_MAX], name[HM_MOE_UID_MAX + 1];
    hosted_stats h = {0};
    int found = 0;

    hm_bench_put_line(p->down_fd, "S\n");
    for (;;) {
        proc_line(p, line, sizeof(line), hm_now_ms() + 30000);
        if (strcmp(line, "E") == 0)
            break;
        if (sscanf(line, "H %96s %llu %llu %llu %lf %lf %lf", name, &h.fwd, &h.bwd, &h.batches,
                   &h.mean, &h.p50, &h.p99) != 7)
            hm_bench_dief("bad statistics line from an expert server");
        if (strcmp(name, uid) == 0) {
            *out = h;
            found = 1;
        }
    }
    if (!found)
        hm_bench_dief("the expert server does not list the expert");
}

/*
 * Asks every child to close (by closing its control pipe), gives them a
 * few seconds to exit cleanly, then kills and reaps what is left.
 */
static void stop_all(proc *ps, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (ps[i].stopped)
            kill(ps[i].pid, SIGCONT);
        close(ps[i].down_fd);
        ps[i].down_fd = -1;
    }
    uint64_t end = hm_now_ms() + 5000;
    for (;;) {
        size_t left = 0;
        for (size_t i = 0; i < n; i++) {
            pid_t pid = ps[i].pid;
            if (pid <= 0)
                continue;
            int st;
            if (waitpid(pid, &st, WNOHANG) == pid) {
                hm_bench_child_forget(pid);
                ps[i].pid = 0;
                if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
                    fprintf(stderr, "bench_moe: expert server %d ended with status %d\n",
                            ps[i].slot, st);
            } else {
                left++;
            }
        }
        if (left == 0 || hm_now_ms() >= end)
            break;
        usleep(20000);
    }
    for (size_t i = 0; i < n; i++) {
        pid_t pid = ps[i].pid;
        if (pid > 0) {
            fprintf(stderr, "bench_moe: expert server %d did not exit; killing it\n",
                    ps[i].slot);
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            hm_bench_child_forget(pid);
            ps[i].pid = 0;
        }
        close(ps[i].up_fd);
    }
}

/* ------------------------------------------------------------ calls */

typedef struct waiter {
    int done;
    int status;
    size_t n_answered;
} waiter;

static void on_call(void *ud, int status, const uint8_t *answered, size_t n_answered)
{
    waiter *w = ud;
    HM_UNUSED(answered);
    w->done = 1;
    w->status = status;
    w->n_answered = n_answered;
}

/*
 * The loop's cached clock, refreshed before each call: between calls this
 * process blocks the loop thread (local compute, reading the servers'
 * pipes) for seconds, and the call's timers are armed relative to libuv's
 * cached time, so a stale one would fire them that much early.
 */
static void fresh_clock(uv_loop_t *loop)
{
    uv_update_time(loop);
}

/* Runs the loop until the call's callback fired (its own timer bounds this). */
static void wait_call(uv_loop_t *loop, waiter *w)
{
    while (!w->done)
        uv_run(loop, UV_RUN_ONCE);
}

typedef struct parent {
    options o;
    uv_loop_t loop;
    hm_node *node;
    hm_moe_client *client;
} parent;

/* One remote forward (k = 1); seconds. */
static double remote_fwd(parent *pa, const hm_moe_expert *ex, const float *x, size_t batch,
                         float *y)
{
    hm_moe_call_opts co = {.k_min = 1, .timeout_ms = CALL_TIMEOUT_MS};
    waiter w = {0};
    fresh_clock(&pa->loop);
    uint64_t t0 = hm_now_us();
    int r = hm_moe_forward(pa->client, ex, 1, x, batch, pa->o.dim, y, &co, on_call, &w, NULL);
    if (r < 0)
        hm_bench_die("hm_moe_forward", r);
    wait_call(&pa->loop, &w);
    if (w.status < 0 || w.n_answered != 1)
        hm_bench_die("remote forward", w.status < 0 ? w.status : -EPROTO);
    return (double)(hm_now_us() - t0) / 1e6;
}

static double remote_bwd(parent *pa, const hm_moe_expert *ex, const float *x, const float *gy,
                         size_t batch, float *gx)
{
    hm_moe_call_opts co = {.k_min = 1, .timeout_ms = CALL_TIMEOUT_MS};
    waiter w = {0};
    fresh_clock(&pa->loop);
    uint64_t t0 = hm_now_us();
    int r = hm_moe_backward(pa->client, ex, 1, x, gy, batch, pa->o.dim, gx, &co, on_call, &w,
                            NULL);
    if (r < 0)
        hm_bench_die("hm_moe_backward", r);
    wait_call(&pa->loop, &w);
    if (w.status < 0 || w.n_answered != 1)
        hm_bench_die("remote backward", w.status < 0 ? w.status : -EPROTO);
    return (double)(hm_now_us() - t0) / 1e6;
}

/* dL/dy = y / batch, the gradient of a mean squared output: realistic magnitudes. */
static void make_gy(const float *y, float *gy, size_t n, size_t batch)
{
    for (size_t k = 0; k < n; k++)
        gy[k] = y[k] / (float)batch;
}

/* Lets the loop run for ms (the pause before a timed run; keeps pings answered). */
static void on_pause_timer(uv_timer_t *t)
{
    *(int *)t->data = 1;
}

static void pause_ms(parent *pa, uint64_t ms)
{
    uv_timer_t t;
    int fired = 0;
    fresh_clock(&pa->loop);
    uv_timer_init(&pa->loop, &t);
    t.data = &fired;
    uv_timer_start(&t, on_pause_timer, ms, 0);
    while (!fired)
        uv_run(&pa->loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&t, NULL);
    uv_run(&pa->loop, UV_RUN_NOWAIT);
}

/* Part 1 for one batch size; bi is its index (expert bench.bi). */
static void throughput_batch(parent *pa, proc *srv, size_t bi)
{
    size_t batch = pa->o.batches[bi], d = pa->o.dim, n = batch * d;
    int reps = pa->o.reps;
    double rf[MAX_REPS], rb[MAX_REPS], rt[MAX_REPS], lf[MAX_REPS], lb[MAX_REPS], lt[MAX_REPS];
    float *x = malloc(n * sizeof(float)), *yr = malloc(n * sizeof(float));
    float *yl = malloc(n * sizeof(float)), *gy = malloc(n * sizeof(float));
    float *gx = malloc(n * sizeof(float));
    hm_ffn_config cfg = {.dim = d, .optimizer = HM_FFN_ADAM};
    hm_moe_expert ex = srv->ex;
    hm_ffn *f = NULL;
    hosted_stats hs = {0};
    int r;

    if (x == NULL || yr == NULL || yl == NULL || gy == NULL || gx == NULL)
        hm_bench_die("buffers", -ENOMEM);
    snprintf(ex.uid, sizeof(ex.uid), "bench.%zu", bi);
    cfg.seed = server_expert_seed(EXPERT_SEED, ex.uid);
    if ((r = hm_ffn_new(&cfg, &f)) < 0)
        hm_bench_die("local expert", r);
    hm_bench_fill(x, n, 0x1234 + bi);

    /* Warm-up: opens the connection, touches every buffer, starts BLAS threads. */
    remote_fwd(pa, &ex, x, batch, yr);
    if ((r = hm_ffn_forward(f, x, batch, yl)) < 0)
        hm_bench_die("local forward", r);
    double maxdiff = 0;
    for (size_t k = 0; k < n; k++)
        maxdiff = HM_MAX(maxdiff, fabs((double)yr[k] - (double)yl[k]));
    make_gy(yr, gy, n, batch);
    remote_bwd(pa, &ex, x, gy, batch, gx);
    make_gy(yl, gy, n, batch);
    if ((r = hm_ffn_backward(f, x, gy, batch, gx)) < 0)
        hm_bench_die("local backward", r);

    for (int i = 0; i < reps; i++) {
        pause_ms(pa, PAUSE_MS);
        rf[i] = remote_fwd(pa, &ex, x, batch, yr);
        make_gy(yr, gy, n, batch);
        rb[i] = remote_bwd(pa, &ex, x, gy, batch, gx);
        rt[i] = rf[i] + rb[i];

        pause_ms(pa, PAUSE_MS);
        uint64_t t0 = hm_now_us();
        if ((r = hm_ffn_forward(f, x, batch, yl)) < 0)
            hm_bench_die("local forward", r);
        uint64_t t1 = hm_now_us();
        make_gy(yl, gy, n, batch);
        uint64_t t2 = hm_now_us();
        if ((r = hm_ffn_backward(f, x, gy, batch, gx)) < 0)
            hm_bench_die("local backward", r);
        uint64_t t3 = hm_now_us();
        lf[i] = (double)(t1 - t0) / 1e6;
        lb[i] = (double)(t3 - t2) / 1e6;
        lt[i] = lf[i] + lb[i];
    }
    proc_stats(srv, ex.uid, &hs);

    double mr = hm_bench_median(rt, (size_t)reps), ml = hm_bench_median(lt, (size_t)reps);
    printf("%5zu  %10.1f  %10.1f  %6.2f   %8.1f %8.1f   %8.1f %8.1f   %7.1e\n", batch,
           (double)batch / mr, (double)batch / ml, ml / mr, hm_bench_median(rf, (size_t)reps) * 1e3,
           hm_bench_median(rb, (size_t)reps) * 1e3, hm_bench_median(lf, (size_t)reps) * 1e3,
           hm_bench_median(lb, (size_t)reps) * 1e3, maxdiff);
    printf("       server: %llu fwd + %llu bwd requests in %llu batches (mean %.0f samples), "
           "arrival to reply p50 %.0f ms, p99 %.0f ms; remote min %.1f ms, local min %.1f ms\n",
           hs.fwd, hs.bwd, hs.batches, hs.mean, hs.p50, hs.p99,
           minimum(rt, (size_t)reps) * 1e3, minimum(lt, (size_t)reps) * 1e3);
    fflush(stdout);
    hm_ffn_free(f);
    free(x);
    free(yr);
    free(yl);
    free(gy);
    free(gx);
}

static void throughput(parent *pa, proc *srv)
{
    printf("\n== 1. remote vs local ffn forward + backward (Adam), dim %zu, hidden %zu\n",
           pa->o.dim, 4 * pa->o.dim);
    printf("remote: hm_moe_forward + hm_moe_backward, k = 1, to a server process on 127.0.0.1\n"
           "(encrypted streams; server defaults: 2 workers, max batch 1024, batch wait 2 ms;\n"
           "server OpenBLAS threads %d); local: hm_ffn_forward + hm_ffn_backward in this\n"
           "process. Medians of %d reps after 1 warm-up, alternating, %d ms pause before each.\n",
           srv->blas_threads, pa->o.reps, PAUSE_MS);
    printf("batch  remote s/s   local s/s  remote/   remote ms         local ms          "
           "first fwd\n");
    printf("                               local     fwd      bwd      fwd      bwd     "
           "max|diff|\n");
    for (size_t i = 0; i < pa->o.nbatches; i++)
        throughput_batch(pa, srv, i);
}

/* Part 2: --calls forwards to the four experts; latency and answers. Returns the p50 (s). */
static double straggler_phase(parent *pa, proc *srv, const char *label)
{
    size_t n = STRAG_BATCH * STRAG_DIM;
    int calls = pa->o.calls;
    hm_moe_expert ex[N_STRAG];
    double lat[MAX_CALLS];
    size_t answered[N_STRAG + 1] = {0};
    int failed = 0;
    float *x = malloc(n * sizeof(float)), *y = malloc(N_STRAG * n * sizeof(float));
    hm_moe_call_opts co = {.k_min = STRAG_K_MIN,
                           .timeout_ms = STRAG_TIMEOUT_MS,
                           .timeout_after_k_min_ms = STRAG_AFTER_K_MIN_MS};

    if (x == NULL || y == NULL)
        hm_bench_die("buffers", -ENOMEM);
    for (int e = 0; e < N_STRAG; e++)
        ex[e] = srv[e].ex;
    hm_bench_fill(x, n, 0x5678);
    for (int i = 0; i < calls; i++) {
        waiter w = {0};
        fresh_clock(&pa->loop);
        uint64_t t0 = hm_now_us();
        int r = hm_moe_forward(pa->client, ex, N_STRAG, x, STRAG_BATCH, STRAG_DIM, y, &co,
                               on_call, &w, NULL);
        if (r < 0)
            hm_bench_die("hm_moe_forward", r);
        wait_call(&pa->loop, &w);
        lat[i] = (double)(hm_now_us() - t0) / 1e6;
        if (w.status < 0) {
            failed++;
            fprintf(stderr, "bench_moe: %s call %d failed after %.1f ms with %zu answers: %s\n",
                    label, i, lat[i] * 1e3, w.n_answered, hm_strerror(w.status));
        }
        answered[HM_MIN(w.n_answered, (size_t)N_STRAG)]++;
    }
    printf("%-34s p50 %7.1f ms  p99 %7.1f ms  max %7.1f ms  answered:", label,
           hm_bench_percentile(lat, (size_t)calls, 0.5) * 1e3,
           hm_bench_percentile(lat, (size_t)calls, 0.99) * 1e3,
           hm_bench_percentile(lat, (size_t)calls, 1.0) * 1e3);
    for (int k = N_STRAG; k >= 0; k--)
        if (answered[k] > 0)
            printf(" %zu calls %d/%d", answered[k], k, N_STRAG);
    printf(", %d failed\n", failed);
    fflush(stdout);
    free(x);
    free(y);
    return hm_bench_percentile(lat, (size_t)calls, 0.5);
}

static void straggler(parent *pa, proc *srv)
{
    printf("\n== 2. k_best = %d forward with a straggler: dim %d, hidden %d, batch %d, k_min %d,"
           "\ntimeout_after_k_min %d ms, timeout %d ms, %d calls per phase, one after another\n",
           N_STRAG, STRAG_DIM, 4 * STRAG_DIM, STRAG_BATCH, STRAG_K_MIN, STRAG_AFTER_K_MIN_MS,
           STRAG_TIMEOUT_MS, pa->o.calls);
    /* Warm-up: opens the four connections. */
    int saved = pa->o.calls;
    pa->o.calls = 3;
    straggler_phase(pa, srv, "(warm-up, all 4 healthy)");
    pa->o.calls = saved;
    double healthy = straggler_phase(pa, srv, "all 4 healthy:");
    if (kill(srv[N_STRAG - 1].pid, SIGSTOP) < 0)
        hm_bench_die("SIGSTOP", -errno);
    srv[N_STRAG - 1].stopped = 1;
    double stalled = straggler_phase(pa, srv, "one server SIGSTOPped:");
    /*
     * The client backs the stopped host off after the first call it
     * stalls (moe/client.h), so the calls after it no longer wait out
     * timeout_after_k_min: the median is the healthy one's, give or take.
     */
    hm_moe_backoff_stats bs;
    hm_moe_client_backoff_stats(pa->client, &bs);
    printf("stalled p50 / healthy p50: %.2f (target <= 1.5); host stalls %llu, experts skipped "
           "%llu of %d calls' %d\n",
           healthy > 0 ? stalled / healthy : 0.0, (unsigned long long)bs.stalls,
           (unsigned long long)bs.skipped, pa->o.calls, N_STRAG * pa->o.calls);
}

static void on_closed(void *ud)
{
    ++*(int *)ud;
}

int main(int argc, char **argv)
{
    parent *pa = calloc(1, sizeof(*pa));
    proc procs[MAX_CHILDREN];
    size_t nprocs = 0, tp = 0, st = 0;
    char err[256] = "", pattern[64];
    int r, quick = 0, custom_dim = 0, custom_batches = 0, custom_reps = 0, custom_calls = 0;

    hm_bench_set_name("bench_moe");

    if (pa == NULL)
        hm_bench_die("parent", -ENOMEM);
    options *o = &pa->o;
    o->dim = 1024;
    o->batches[0] = 256;
    o->batches[1] = 512;
    o->batches[2] = 1024;
    o->nbatches = 3;
    o->reps = 5;
    o->calls = 50;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--dim") == 0 && i + 1 < argc) {
            o->dim = hm_bench_parse_size(argv[++i], 1, HM_FFN_MAX_DIM, usage);
            custom_dim = 1;
        } else if (strcmp(argv[i], "--batches") == 0 && i + 1 < argc) {
            parse_batches(o, argv[++i]);
            custom_batches = 1;
        } else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
            o->reps = (int)hm_bench_parse_size(argv[++i], 1, MAX_REPS, usage);
            custom_reps = 1;
        } else if (strcmp(argv[i], "--calls") == 0 && i + 1 < argc) {
            o->calls = (int)hm_bench_parse_size(argv[++i], 1, MAX_CALLS, usage);
            custom_calls = 1;
        } else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
            i++;
            if (strcmp(argv[i], "throughput") == 0)
                o->skip_straggler = 1;
            else if (strcmp(argv[i], "straggler") == 0)
                o->skip_throughput = 1;
            else
                usage();
        } else if (strcmp(argv[i], "--quick") == 0) {
            quick = 1;
        } else if (strcmp(argv[i], "-v") == 0) {
            o->verbose = 1;
        } else {
            usage();
        }
    }
    if (quick) {
        /* A smoke run: seconds, not minutes; explicit flags still win. */
        if (!custom_dim)
            o->dim = 256;
        if (!custom_batches) {
            o->batches[0] = 32;
            o->batches[1] = 128;
            o->nbatches = 2;
        }
        if (!custom_reps)
            o->reps = 3;
        if (!custom_calls)
            o->calls = 10;
    }
    for (size_t i = 0; i < o->nbatches; i++)
        if (o->batches[i] * o->dim > HM_MOE_MAX_ELEMS)
            hm_bench_dief("batch * dim is over the expert protocol's cap");

    hm_log_set_level(o->verbose ? HM_LOG_DEBUG : HM_LOG_ERROR);
    if ((r = hm_crypto_init()) < 0)
        hm_bench_die("crypto", r);
    signal(SIGPIPE, SIG_IGN);
    hm_bench_children_guard();

    /* Every server is forked before this process starts a loop or a node. */
    if (!o->skip_throughput) {
        tp = nprocs;
        snprintf(pattern, sizeof(pattern), "bench.[0:%zu]", o->nbatches);
        spawn(procs, (int)nprocs, pattern, o->dim);
        nprocs++;
    }
    if (!o->skip_straggler) {
        st = nprocs;
        for (int i = 0; i < N_STRAG; i++) {
            snprintf(pattern, sizeof(pattern), "strag.%d", i);
            spawn(procs, (int)nprocs, pattern, STRAG_DIM);
            nprocs++;
        }
    }
    if (!o->skip_throughput) {
        snprintf(pattern, sizeof(pattern), "bench.0");
        proc_ready(&procs[tp], pattern);
    }
    if (!o->skip_straggler)
        for (int i = 0; i < N_STRAG; i++) {
            snprintf(pattern, sizeof(pattern), "strag.%d", i);
            proc_ready(&procs[st + (size_t)i], pattern);
        }

    double load[3] = {0, 0, 0};
    if (getloadavg(load, 3) < 0)
        load[0] = load[1] = load[2] = -1;
    printf("bench_moe: %ld CPUs online (nproc), %s, %d threads here (OPENBLAS_NUM_THREADS "
           "sets it), load average %.2f %.2f %.2f\n",
           sysconf(_SC_NPROCESSORS_ONLN), openblas_get_config(), openblas_get_num_threads(),
           load[0], load[1], load[2]);
    fflush(stdout);

    if ((r = uv_loop_init(&pa->loop)) < 0)
        hm_bench_die("loop", r);
    hm_node_options no = {0};
    no.listen = "127.0.0.1:0";
    no.swarm = SWARM;
    if ((r = hm_node_new(&pa->loop, &no, &pa->node, err, sizeof(err))) < 0) {
        fprintf(stderr, "bench_moe: node: %s\n", err);
        return 1;
    }
    if ((r = hm_moe_client_new(pa->node, &pa->client)) < 0)
        hm_bench_die("client", r);

    if (!o->skip_throughput)
        throughput(pa, &procs[tp]);
    if (!o->skip_straggler)
        straggler(pa, &procs[st]);

    hm_moe_client_free(pa->client);
    int closed = 0;
    hm_node_close(pa->node, on_closed, &closed);
    while (!closed)
        uv_run(&pa->loop, UV_RUN_ONCE);
    uv_run(&pa->loop, UV_RUN_NOWAIT);
    if ((r = uv_loop_close(&pa->loop)) < 0)
        fprintf(stderr, "bench_moe: loop still busy at exit: %s\n", hm_strerror(r));
    stop_all(procs, nprocs);
    free(pa);
    return 0;
}

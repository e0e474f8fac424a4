/*
 * bench_allreduce: wall time and memory of the butterfly all-reduce
 * (averaging/allreduce.h) among --peers processes on 127.0.0.1, the
 * figure set next to MPI_Allreduce by bench/allreduce_vs_mpi.sh.
 *
 * The parent forks one process per peer. Each peer runs its own uv loop,
 * identity, rpc layer (encrypted streams, as in production) and all-reduce
 * context, and tells the parent its public key and port over a shared pipe
 * (lines shorter than PIPE_BUF, so concurrent writes never interleave). The
 * parent hands every peer the same member list over a pipe of its own, so
 * each builds the same hm_avg_group with equal bandwidths: matchmaking is
 * skipped, because this measures the all-reduce alone, as MPI_Allreduce
 * does. Peer i fills --mb MiB of float32 with value(i, k) = base(k) +
 * i / 4 (base(k) a fixed pattern in [-1, 1)), every weight is 1, so the
 * expected result is base(k) + (N - 1) / 8 for every element.
 *
 * Rounds are separated by barriers run by the parent: it sends "go" to
 * every peer; each peer times hm_ar_start to its done callback and reports;
 * once all have reported, the parent sends "verify", and each peer checks
 * every element against the expected average (within the compression's
 * documented error), refills its vector and reports again. Verification
 * happens after every peer finished, so it never delays another peer's
 * round, and the peers' loops keep running while they wait so that queued
 * replies still drain. The first round opens the encrypted connections and
 * is reported apart as the warm-up; --runs rounds follow.
 *
 * Reported per round: the slowest peer's time (a round is over when the
 * last peer has its result) and the fastest; then the median and maximum
 * of the slowest-peer time over the measured rounds, bytes each peer sent,
 * and each peer's peak resident memory (VmHWM) against the tensor size,
 * both as a whole and above what the process held before it allocated the
 * tensor. The last line, "RESULT ...", is for scripts. Exit status 0 only
 * when every round of every peer came back fully averaged and correct.
 */
#include "config.h"

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

#include "averaging/allreduce.h"
#include "averaging/codec.h"
#include "src/base/crypto.h"
#include "averaging/group.h"
#include "src/net/rpc.h"
#include "src/net/transport.h"
#include "src/base/util.h"
#include "bench/bench_common.h"

#define MAX_PEERS 64
#define MAX_RUNS 1000

typedef struct options {
    int peers;
    int kb; /* tensor size in KiB (--mb M is M * 1024) */
    int runs;
    int compression;
    uint64_t timeout_ms;
    size_t chunk_elems;
    size_t window;
    int workers; /* averaging worker threads per peer, 0 = on the loop */
} options;

/* A fixed pattern in [-1, 1), multiples of 1/512: exact in float32. */
static inline float base_value(size_t k)
{
    uint32_t h = (uint32_t)k * 2654435761u;
    return (float)((h >> 16) & 1023u) / 512.0f - 1.0f;
}

/* The next complete line in lb, 1, or 0 if none is complete yet; a line
 * longer than out or the buffer ends the program, as nothing in this
 * benchmark sends one. */
static int pop_line(hm_bench_linebuf *lb, char *out, size_t cap)
{
    int r = hm_bench_lb_pop(lb, out, cap);
    if (r < 0)
        hm_bench_die("line too long", r);
    return r;
}

/* ------------------------------------------------------------ one peer */

typedef struct peer {
    options o;
    int idx;
    int up_fd, down_fd;
    uv_loop_t loop;
    hm_identity id;
    hm_rpc *rpc;
    hm_ar_ctx *ctx;
    uv_pipe_t down;
    hm_bench_linebuf lb;
    hm_avg_group group;
    float *data;
    size_t n;
    long base_kb;
    uint64_t t0_us, cpu0_us;
    int round;
    int quitting;
    int closed;
    hm_ar_report rep;
} peer;

static void peer_fill(peer *p)
{
    float add = 0.25f * (float)p->idx;
    for (size_t k = 0; k < p->n; k++)
        p->data[k] = base_value(k) + add;
}

/*
 * Counts elements farther from the expected average than the compression's
 * documented round-trip error (codec.h) allows, going to the reducer and
 * coming back; also the largest absolute error seen.
 */
static size_t peer_verify(const peer *p, double *max_err)
{
    double mean_add = 0.125 * (double)(p->o.peers - 1);
    double maxabs = 1.0 + 0.25 * (double)(p->o.peers - 1);
    double tol;
    switch (p->o.compression) {
    case HM_AVG_COMP_FP16:
        tol = 2.0 * ldexp(maxabs, -11) + 1e-6;
        break;
    case HM_AVG_COMP_UINT8:
        /* Every sender's chunk spans at most 2 (base in [-1, 1)), and so does the average. */
        tol = 2.0 * (2.0 / 510.0 + ldexp(maxabs, -23)) + 1e-6;
        break;
    default:
        tol = 1e-6 * maxabs;
        break;
    }
    size_t bad = 0;
    double worst = 0;
    for (size_t k = 0; k < p->n; k++) {
        double e = (double)base_value(k) + mean_add;
        double d = fabs((double)p->data[k] - e);
        if (!(d <= tol))
            bad++;
        if (d > worst || d != d)
            worst = d;
    }
    *max_err = worst;
    return bad;
}

static void peer_done(void *ud, const hm_ar_report *rep)
{
    peer *p = ud;
    uint64_t us = hm_now_us() - p->t0_us, cpu = hm_bench_cpu_us() - p->cpu0_us;
    p->rep = *rep;
    int left_out = 0;
    for (size_t i = 0; i < rep->group_size; i++)
        if (rep->reason[i] != HM_AR_IN)
            left_out++;
    hm_bench_put_line(p->up_fd, "D %d %d %llu %llu %d %d %llu %llu\n", p->idx, p->round,
                      (unsigned long long)us, (unsigned long long)cpu, rep->status, left_out,
                      (unsigned long long)rep->bytes_sent, (unsigned long long)rep->bytes_received);
}

static void peer_start_round(peer *p, int round)
{
    hm_ar_config cfg = {0};
    cfg.round_timeout_ms = p->o.timeout_ms;
    cfg.compression = p->o.compression;
    cfg.chunk_elems = p->o.chunk_elems;
    cfg.window = p->o.window;
    /* A fresh group id per round, as matchmaking would pick. */
    memset(p->group.group_id, 0xa5, sizeof(p->group.group_id));
    memcpy(p->group.group_id, &round, sizeof(round));
    p->round = round;
    p->t0_us = hm_now_us();
    p->cpu0_us = hm_bench_cpu_us();
    int r = hm_ar_start(p->ctx, &p->group, p->data, p->n, 1.0, &cfg, peer_done, p, NULL);
    if (r < 0)
        hm_bench_die("hm_ar_start", r);
}

static void peer_closed(void *ud) { ((peer *)ud)->closed++; }

static void peer_pipe_closed(uv_handle_t *h) { ((peer *)h->data)->closed++; }

static void peer_command(peer *p, const char *line)
{
    int round;
    if (sscanf(line, "G %d", &round) == 1) {
        peer_start_round(p, round);
    } else if (sscanf(line, "V %d", &round) == 1) {
        double worst = 0;
        size_t bad = peer_verify(p, &worst);
        peer_fill(p);
        hm_bench_put_line(p->up_fd, "R %d %d %zu %.3g %ld %ld\n", p->idx, round, bad, worst,
                          hm_bench_proc_status_kb("VmHWM:"), p->base_kb);
    } else if (strcmp(line, "Q") == 0 && !p->quitting) {
        p->quitting = 1;
        uv_read_stop((uv_stream_t *)&p->down);
        uv_close((uv_handle_t *)&p->down, peer_pipe_closed);
        hm_ar_ctx_close(p->ctx, peer_closed, p);
        hm_rpc_close(p->rpc, peer_closed, p);
    } else {
        fprintf(stderr, "bench_allreduce: peer %d: unexpected command \"%s\"\n", p->idx, line);
        exit(1);
    }
}

static void peer_alloc(uv_handle_t *h, size_t sz, uv_buf_t *buf)
{
    peer *p = h->data;
    HM_UNUSED(sz);
    buf->base = p->lb.buf + p->lb.len;
    buf->len = sizeof(p->lb.buf) - p->lb.len;
}

static void peer_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    peer *p = s->data;
    char line[HM_BENCH_LINE_MAX];
    HM_UNUSED(buf);
    if (nread < 0) {
        /* The parent is gone: nothing more to measure. */
        exit(1);
    }
    p->lb.len += (size_t)nread;
    while (!p->quitting && pop_line(&p->lb, line, sizeof(line)))
        peer_command(p, line);
}

/* Blocking read of one line from the parent, before the loop runs. */
static void peer_read_line(peer *p, char *line, size_t cap)
{
    while (!pop_line(&p->lb, line, cap)) {
        ssize_t r = read(p->down_fd, p->lb.buf + p->lb.len, sizeof(p->lb.buf) - p->lb.len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            exit(1);
        p->lb.len += (size_t)r;
    }
}

static void run_peer(const options *o, int idx, int up_fd, int down_fd,
                     const uint8_t swarm[HM_SWARM_ID_BYTES])
{
    peer *p = calloc(1, sizeof(*p));
    struct sockaddr_storage addr;
    char line[HM_BENCH_LINE_MAX], hex[2 * HM_PK_BYTES + 1];
    int r;

#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
    if (p == NULL)
        hm_bench_die("peer", -ENOMEM);
    p->o = *o;
    p->idx = idx;
    p->up_fd = up_fd;
    p->down_fd = down_fd;
    uv_loop_init(&p->loop);
    if ((r = hm_identity_generate(&p->id)) < 0)
        hm_bench_die("identity", r);
    hm_transport_config tc = {.listen = "127.0.0.1:0"};
    if ((r = hm_rpc_new(&p->loop, &p->id, swarm, &tc, NULL, &p->rpc)) < 0)
        hm_bench_die("rpc", r);
    if ((r = hm_ar_ctx_new(&p->loop, p->rpc, &p->id, &p->ctx)) < 0)
        hm_bench_die("all-reduce context", r);
    if ((r = hm_ar_set_workers(p->ctx, (unsigned)o->workers)) < 0)
        hm_bench_die("all-reduce workers", r);
    if ((r = hm_transport_local_addr(hm_rpc_transport(p->rpc), &addr)) < 0)
        hm_bench_die("local address", r);
    hm_hex_encode(p->id.pk, HM_PK_BYTES, hex);
    hm_bench_put_line(up_fd, "A %d %s %u\n", idx, hex,
                      ntohs(((struct sockaddr_in *)&addr)->sin_port));

    /* The member list, in group order, the same for every peer. */
    p->group.n = (size_t)o->peers;
    p->group.self = (size_t)idx;
    for (int i = 0; i < o->peers; i++) {
        unsigned port;
        char addr_s[64];
        hm_avg_member *m = &p->group.members[i];
        peer_read_line(p, line, sizeof(line));
        if (sscanf(line, "P %64s %u", hex, &port) != 2 || port == 0 || port > 65535 ||
            hm_hex_decode(hex, strlen(hex), m->pk, HM_PK_BYTES) < 0)
            hm_bench_die("member list", -EPROTO);
        snprintf(addr_s, sizeof(addr_s), "127.0.0.1:%u", port);
        if (hm_parse_hostport(addr_s, &m->addr) < 0)
            hm_bench_die("member address", -EINVAL);
        m->bandwidth = 1.0;
    }

    /* What the process holds before the tensor exists: libraries, loop, rpc. */
    p->base_kb = hm_bench_proc_status_kb("VmRSS:");
    p->n = (size_t)o->kb * (1024u / sizeof(float));
    p->data = malloc(p->n * sizeof(float));
    if (p->data == NULL)
        hm_bench_die("tensor", -ENOMEM);
    peer_fill(p);
    hm_bench_put_line(up_fd, "R %d -1 0 0 %ld %ld\n", idx, hm_bench_proc_status_kb("VmHWM:"),
                      p->base_kb);

    uv_pipe_init(&p->loop, &p->down, 0);
    p->down.data = p;
    if ((r = uv_pipe_open(&p->down, down_fd)) < 0)
        hm_bench_die("control pipe", r);
    /* Commands that arrived with the member list. */
    while (!p->quitting && pop_line(&p->lb, line, sizeof(line)))
        peer_command(p, line);
    if ((r = uv_read_start((uv_stream_t *)&p->down, peer_alloc, peer_read)) < 0)
        hm_bench_die("control pipe", r);
    while (p->closed < 3)
        uv_run(&p->loop, UV_RUN_ONCE);
    uv_run(&p->loop, UV_RUN_NOWAIT);
    r = uv_loop_close(&p->loop);
    free(p->data);
    hm_identity_wipe(&p->id);
    free(p);
    exit(r == 0 ? 0 : 1);
}

/* ------------------------------------------------------------ the parent */

typedef struct parent {
    options o;
    pid_t pids[MAX_PEERS];
    int down[MAX_PEERS];
    int up;
    hm_bench_linebuf lb;
} parent;

static void kill_all(parent *pa)
{
    for (int i = 0; i < pa->o.peers; i++)
        if (pa->pids[i] > 0) {
            kill(pa->pids[i], SIGKILL);
            waitpid(pa->pids[i], NULL, 0);
            pa->pids[i] = 0;
        }
}

static void fail(parent *pa, const char *what)
{
    fprintf(stderr, "bench_allreduce: %s\n", what);
    kill_all(pa);
    exit(1);
}

/* Next line from any peer, waiting at most until deadline_ms. */
static void parent_line(parent *pa, char *line, size_t cap, uint64_t deadline_ms)
{
    while (!pop_line(&pa->lb, line, cap)) {
        uint64_t now = hm_now_ms();
        if (now >= deadline_ms)
            fail(pa, "timed out waiting for the peers");
        struct pollfd pfd = {.fd = pa->up, .events = POLLIN};
        int wait_ms = (int)HM_MIN(deadline_ms - now, 1000u);
        int r = poll(&pfd, 1, wait_ms);
        if (r < 0 && errno != EINTR)
            fail(pa, "poll failed");
        for (int i = 0; i < pa->o.peers; i++) {
            int st;
            if (pa->pids[i] > 0 && waitpid(pa->pids[i], &st, WNOHANG) == pa->pids[i]) {
                pa->pids[i] = 0;
                fprintf(stderr, "bench_allreduce: peer %d exited (status %d)\n", i, st);
                fail(pa, "a peer died");
            }
        }
        if (r <= 0 || !(pfd.revents & (POLLIN | POLLHUP)))
            continue;
        ssize_t got = read(pa->up, pa->lb.buf + pa->lb.len, sizeof(pa->lb.buf) - pa->lb.len);
        if (got <= 0)
            fail(pa, "the peers' pipe closed");
        pa->lb.len += (size_t)got;
    }
}

typedef struct round_stats {
    double max_s, min_s, cpu_s; /* cpu_s: summed over peers */
    uint64_t sent_max, recv_max;
    int failed;
} round_stats;

static int parse_comp(const char *s)
{
    if (strcmp(s, "none") == 0)
        return HM_AVG_COMP_NONE;
    if (strcmp(s, "fp16") == 0)
        return HM_AVG_COMP_FP16;
    if (strcmp(s, "8bit") == 0)
        return HM_AVG_COMP_UINT8;
    return -1;
}

static const char *comp_name(int c)
{
    return c == HM_AVG_COMP_FP16 ? "fp16" : c == HM_AVG_COMP_UINT8 ? "8bit" : "none";
}

static void usage(void)
{
    fprintf(stderr,
            "usage: bench_allreduce --peers N --mb M|--kb K [--runs R]\n"
            "                       [--compression none|fp16|8bit]\n"
            "                       [--timeout S] [--chunk-elems E] [--window W] [--workers T]\n"
            "  N peers (2..%d) each average M MiB (1..1024) or K KiB of float32 over R rounds\n"
            "  (default 5) after one warm-up round; --timeout is the round timeout\n"
            "  (default 60 s); --chunk-elems and --window default to the all-reduce's.\n"
            "  --workers: averaging threads per peer (default 0: chunks reduced on the loop).\n",
            MAX_PEERS);
    exit(64);
}

int main(int argc, char **argv)
{
    options o = {.runs = 5, .timeout_ms = 60000};
    hm_bench_set_name("bench_allreduce");
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--peers") == 0 && i + 1 < argc)
            o.peers = atoi(argv[++i]);
        else if (strcmp(argv[i], "--mb") == 0 && i + 1 < argc && atoi(argv[i + 1]) <= 1024)
            o.kb = atoi(argv[++i]) * 1024;
        else if (strcmp(argv[i], "--kb") == 0 && i + 1 < argc)
            o.kb = atoi(argv[++i]);
        else if (strcmp(argv[i], "--runs") == 0 && i + 1 < argc)
            o.runs = atoi(argv[++i]);
        else if (strcmp(argv[i], "--compression") == 0 && i + 1 < argc)
            o.compression = parse_comp(argv[++i]);
        else if (strcmp(argv[i], "--timeout") == 0 && i + 1 < argc)
            o.timeout_ms = (uint64_t)(atof(argv[++i]) * 1000.0);
        else if (strcmp(argv[i], "--chunk-elems") == 0 && i + 1 < argc)
            o.chunk_elems = (size_t)strtoul(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--workers") == 0 && i + 1 < argc && atoi(argv[i + 1]) >= 0 &&
                 atoi(argv[i + 1]) <= 16)
            o.workers = atoi(argv[++i]);
        else if (strcmp(argv[i], "--window") == 0 && i + 1 < argc)
            o.window = (size_t)strtoul(argv[++i], NULL, 10);
        else
            usage();
    }
    if (o.peers < 2 || o.peers > MAX_PEERS || o.kb < 1 || o.kb > 1024 * 1024 || o.runs < 1 ||
        o.runs > MAX_RUNS || o.compression < 0 || o.timeout_ms < 100 ||
        o.timeout_ms > 3600000 || o.chunk_elems > HM_AR_MAX_CHUNK_ELEMS || o.window > 32)
        usage();
    hm_log_set_level(HM_LOG_WARN);
    if (hm_crypto_init() < 0)
        hm_bench_die("crypto init", -EIO);
    uint8_t swarm[HM_SWARM_ID_BYTES];
    hm_swarm_id("bench-allreduce", NULL, 0, swarm);
    signal(SIGPIPE, SIG_IGN);

    parent *pa = calloc(1, sizeof(*pa));
    if (pa == NULL)
        hm_bench_die("parent", -ENOMEM);
    pa->o = o;
    int upp[2];
    if (pipe(upp) < 0)
        hm_bench_die("pipe", -errno);
    pa->up = upp[0];
    fflush(stdout);
    for (int i = 0; i < o.peers; i++) {
        int dp[2];
        if (pipe(dp) < 0)
            fail(pa, "pipe failed");
        pid_t pid = fork();
        if (pid < 0)
            fail(pa, "fork failed");
        if (pid == 0) {
            close(upp[0]);
            close(dp[1]);
            for (int j = 0; j < i; j++)
                close(pa->down[j]);
            run_peer(&o, i, upp[1], dp[0], swarm);
        }
        close(dp[0]);
        pa->down[i] = dp[1];
        pa->pids[i] = pid;
    }
    close(upp[1]);

    /* Gather every peer's key and port, then send the member list to all. */
    char line[HM_BENCH_LINE_MAX];
    char (*hexes)[2 * HM_PK_BYTES + 1] = calloc((size_t)o.peers, sizeof(*hexes));
    unsigned *ports = calloc((size_t)o.peers, sizeof(*ports));
    uint64_t deadline = hm_now_ms() + 10000;
    for (int got = 0; got < o.peers;) {
        int i;
        unsigned port;
        char hex[2 * HM_PK_BYTES + 1];
        parent_line(pa, line, sizeof(line), deadline);
        if (sscanf(line, "A %d %64s %u", &i, hex, &port) != 3 || i < 0 || i >= o.peers ||
            ports[i] != 0)
            fail(pa, "bad address line from a peer");
        memcpy(hexes[i], hex, sizeof(hex));
        ports[i] = port;
        got++;
    }
    for (int i = 0; i < o.peers; i++)
        for (int j = 0; j < o.peers; j++)
            hm_bench_put_line(pa->down[i], "P %s %u\n", hexes[j], ports[j]);
    free(hexes);
    free(ports);

    long *hwm_kb = calloc((size_t)o.peers, sizeof(long)), *base_kb = calloc((size_t)o.peers, sizeof(long));
    size_t bad_total = 0;
    double worst_err = 0;
    /* Every peer says "R" once its tensor is filled, and after each verification. */
    int total = o.runs + 1;
    round_stats *rs = calloc((size_t)total, sizeof(*rs));
    for (int round = -1; round < total; round++) {
        uint64_t dl = hm_now_ms() + o.timeout_ms + 30000 + (uint64_t)o.kb / 5;
        for (int got = 0; got < o.peers; got++) {
            int i, rr;
            size_t bad;
            double err;
            long hwm, base;
            parent_line(pa, line, sizeof(line), dl);
            if (sscanf(line, "R %d %d %zu %lg %ld %ld", &i, &rr, &bad, &err, &hwm, &base) != 6 ||
                i < 0 || i >= o.peers || rr != round)
                fail(pa, "bad ready line from a peer");
            hwm_kb[i] = hwm;
            base_kb[i] = base;
            if (round >= 0) {
                bad_total += bad;
                if (bad > 0)
                    rs[round].failed = 1;
                if (err > worst_err || err != err)
                    worst_err = err;
            }
        }
        if (round + 1 >= total)
            break;
        int next = round + 1;
        for (int i = 0; i < o.peers; i++)
            hm_bench_put_line(pa->down[i], "G %d\n", next);
        round_stats *s = &rs[next];
        s->min_s = INFINITY;
        dl = hm_now_ms() + o.timeout_ms + 10000;
        for (int got = 0; got < o.peers; got++) {
            int i, rr, status, left_out;
            unsigned long long us, cpu, sent, recv;
            parent_line(pa, line, sizeof(line), dl);
            if (sscanf(line, "D %d %d %llu %llu %d %d %llu %llu", &i, &rr, &us, &cpu, &status,
                       &left_out, &sent, &recv) != 8 ||
                i < 0 || i >= o.peers || rr != next)
                fail(pa, "bad done line from a peer");
            if (status != 0 || left_out != 0) {
                fprintf(stderr, "bench_allreduce: round %d: peer %d: status %s, %d left out\n",
                        next, i, hm_strerror(status), left_out);
                s->failed = 1;
            }
            double sec = (double)us / 1e6;
            s->max_s = HM_MAX(s->max_s, sec);
            s->cpu_s += (double)cpu / 1e6;
            s->min_s = HM_MIN(s->min_s, sec);
            s->sent_max = HM_MAX(s->sent_max, (uint64_t)sent);
            s->recv_max = HM_MAX(s->recv_max, (uint64_t)recv);
        }
        for (int i = 0; i < o.peers; i++)
            hm_bench_put_line(pa->down[i], "V %d\n", next);
    }
    for (int i = 0; i < o.peers; i++)
        hm_bench_put_line(pa->down[i], "Q\n");
    for (int i = 0; i < o.peers; i++) {
        int st = 0;
        if (waitpid(pa->pids[i], &st, 0) == pa->pids[i] && (!WIFEXITED(st) || WEXITSTATUS(st)))
            fprintf(stderr, "bench_allreduce: peer %d did not shut down cleanly\n", i);
        pa->pids[i] = 0;
    }

    /* ---- report ---- */
    double tensor_mib = (double)o.kb / 1024.0;
    long nproc = sysconf(_SC_NPROCESSORS_ONLN);
    printf("bench_allreduce: %d peers, %g MiB of float32 each (%zu elements), compression %s,\n"
           "  encrypted streams on 127.0.0.1, equal bandwidths, weight 1 each; %d rounds after a "
           "warm-up round\n",
           o.peers, tensor_mib, (size_t)o.kb * 256u, comp_name(o.compression), o.runs);
    if (nproc > 0 && o.peers > nproc)
        printf("  note: %d peer processes on %ld CPUs: the machine is oversubscribed\n", o.peers,
               nproc);
    printf("%-8s %10s %10s %12s %14s %14s %s\n", "round", "slowest s", "fastest s", "CPU s (all)",
           "MiB sent/peer", "MiB recv/peer", "result");
    double *times = calloc((size_t)o.runs, sizeof(double));
    double *cpus = calloc((size_t)o.runs, sizeof(double));
    int failed_rounds = 0;
    for (int r = 0; r < total; r++) {
        char name[16];
        if (r == 0)
            snprintf(name, sizeof(name), "warm-up");
        else
            snprintf(name, sizeof(name), "%d", r);
        printf("%-8s %10.4f %10.4f %12.4f %14.2f %14.2f %s\n", name, rs[r].max_s, rs[r].min_s,
               rs[r].cpu_s,
               (double)rs[r].sent_max / 1048576.0, (double)rs[r].recv_max / 1048576.0,
               rs[r].failed ? "FAILED" : "ok");
        if (r > 0) {
            times[r - 1] = rs[r].max_s;
            cpus[r - 1] = rs[r].cpu_s;
        }
        if (rs[r].failed)
            failed_rounds++;
    }
    double med = hm_bench_median(times, o.runs), mx = 0;
    for (int r = 0; r < o.runs; r++)
        mx = HM_MAX(mx, times[r]);
    double med_cpu = hm_bench_median(cpus, o.runs);
    long peak_kb = 0, base_max_kb = 0, extra_kb = 0;
    for (int i = 0; i < o.peers; i++) {
        peak_kb = HM_MAX(peak_kb, hwm_kb[i]);
        base_max_kb = HM_MAX(base_max_kb, base_kb[i]);
        extra_kb = HM_MAX(extra_kb, hwm_kb[i] - base_kb[i]);
    }
    double peak_mib = (double)peak_kb / 1024.0, extra_mib = (double)extra_kb / 1024.0;
    printf("median over rounds of the slowest peer: %.4f s (max %.4f s), %.1f MiB/s of tensor\n",
           med, mx, med > 0 ? tensor_mib / med : 0.0);
    /* Whether the round was bound by CPU (all CPUs busy) or by waiting. */
    printf("CPU time per round, all peers together: %.4f s (median), %.2f CPUs busy on average "
           "of %ld\n",
           med_cpu, med > 0 ? med_cpu / med : 0.0, nproc);
    printf("peak RSS per peer (max over peers): %.1f MiB = %.2fx the tensor; "
           "%.1f MiB = %.2fx above the %.1f MiB held before the tensor\n",
           peak_mib, peak_mib / tensor_mib, extra_mib, extra_mib / tensor_mib,
           (double)base_max_kb / 1024.0);
    printf("check: %s (%zu elements off, largest error %.3g)\n",
           failed_rounds == 0 && bad_total == 0 ? "every round averaged correctly" : "FAILED",
           bad_total, worst_err);
    printf("RESULT peers=%d mb=%g comp=%s median_s=%.6f max_s=%.6f warmup_s=%.6f "
           "cpu_s=%.6f peak_mib=%.1f peak_ratio=%.3f extra_ratio=%.3f ok=%d\n",
           o.peers, tensor_mib, comp_name(o.compression), med, mx, rs[0].max_s, med_cpu, peak_mib,
           peak_mib / tensor_mib, extra_mib / tensor_mib, failed_rounds == 0 && bad_total == 0);
    free(times);
    free(cpus);
    free(rs);
    free(hwm_kb);
    free(base_kb);
    for (int i = 0; i < o.peers; i++)
        close(pa->down[i]);
    close(pa->up);
    free(pa);
    return failed_rounds == 0 && bad_total == 0 ? 0 : 1;
}

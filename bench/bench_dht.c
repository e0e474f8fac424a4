/*
 * bench_dht: figures for the DHT, with real hivemindd processes on
 * loopback. It measures two things:
 *
 *   1. Serving rate: how many DHT requests one hivemindd answers per second
 *      on one core. One daemon runs pinned to CPU 0. In-process helper
 *      nodes (full DHT nodes on the bench's loop) join it first, so that
 *      its routing table is filled and every reply carries the k closest
 *      contacts, as in a real swarm. Load comes from --clients lightweight
 *      clients (an rpc layer each, own identity and UDP port) in worker
 *      processes pinned to the other CPUs. Each client fetches a token with
 *      a PING, then sends GET requests for random keys, crafted with
 *      dht/proto.h and sent over the one-way DHT channel, at most --window
 *      in flight and at most CLIENT_RATE per second. The daemon meters
 *      requests per address (200/s by default; loopback is keyed by port),
 *      so each client stays under that rate and the figure is the daemon's
 *      datagram crypto + DHT serving path, not its rate limiter. Reported:
 *      replies per second (median of --runs runs of --seconds), the
 *      daemon's CPU use over each run from /proc/PID/stat, and the workers'.
 *
 *   2. Latency: --nodes hivemindd processes on 127.0.0.1 (port 0, a temp
 *      state dir and control socket each, --ping-interval 2), each joining
 *      through the first. Once their routing tables hold at least half the
 *      swarm (read with `hivemindctl dht info`), an in-process client-mode
 *      node that joined through three of them does --ops puts of distinct
 *      keys one after another, then --ops gets of those keys, and reports
 *      the p50/p95 wall time of each, success counts, and the mean hops,
 *      requests and replicas from hm_dht_lookup_info. Then (--churn PCT,
 *      default 30) PCT% of the daemons are SIGKILLed at once, the client
 *      not told, and the keys are read again, 8 gets at a time as a trainer
 *      reading expert records would: p50/p95 and how many found the value.
 *      A get that meets a dead contact waits one request timeout for it,
 *      which is what this phase measures.
 *
 *   3. (--only round) The DHT while the node averages: --round-peers
 *      hivemindd processes average --round-mb MiB of float32 through
 *      `hivemindctl average`, --runs rounds with 3 s idle before each,
 *      while an in-process probe sends the first of them a DHT GET every
 *      10 ms (at most 128 in flight) and times each reply. Reported: the
 *      p50/p99/max reply time and the losses of the GETs sent while no
 *      round ran and of those sent while one ran (matchmaking and
 *      all-reduce), and each round's all-reduce time. A node whose loop
 *      thread is busy reducing and coding chunks answers late; this is that
 *      figure. --daemon-arg ARG (repeatable) passes more options to every
 *      daemon, to compare settings.
 *
 * Every child gets PR_SET_PDEATHSIG and is killed on exit, on failure and
 * on SIGINT/SIGTERM; the temp directories are removed. This prints
 * figures; it is not a test and asserts nothing.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "src/base/crypto.h"
#include "dht/dht.h"
#include "src/node/node.h"
#include "dht/proto.h"
#include "src/net/rpc.h"
#include "src/base/util.h"
#include "bench/bench_common.h"

/* Requests per second each load client sends at most: under the daemon's
 * per-address limit (200/s, burst 400), so that none is throttled. */
#define CLIENT_RATE 180.0
#define MAX_WINDOW 32
/* A request unanswered for this long counts as lost and frees its slot. */
#define LOST_AFTER_US 1000000u
#define MAX_WORKERS 16
#define SWARM_NAME "bench-dht"
#define MAX_DAEMON_ARGS 8

typedef struct options {
    int runs;
    double seconds;
    int nodes;
    int ops;
    int clients;
    int window;
    int helpers;
    int workers;
    const char *daemon;
    const char *ctl;
    int churn; /* percent of the daemons SIGKILLed before the churn gets; 0: none */
    int skip_serve, skip_latency;
    int round; /* --only round */
    int round_peers, round_mb;
    const char *daemon_args[MAX_DAEMON_ARGS];
    int n_daemon_args;
} options;

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

/* Busy and total jiffies of one CPU from /proc/stat; 0 or -1. */
static int cpu_jiffies(int cpu, double *busy_out, double *total_out)
{
    char want[16], line[512];
    int result = -1;
    FILE *f = fopen("/proc/stat", "r");
    if (f == NULL)
        return -1;
    snprintf(want, sizeof(want), "cpu%d ", cpu);
    while (fgets(line, sizeof(line), f) != NULL) {
        unsigned long long v[8] = {0};
        if (strncmp(line, want, strlen(want)) != 0)
            continue;
        if (sscanf(line + strlen(want), "%llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1],
                   &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]) >= 4) {
            double idle = (double)(v[3] + v[4]), total = 0;
            for (int i = 0; i < 8; i++)
                total += (double)v[i];
            *busy_out = total - idle;
            *total_out = total;
            result = 0;
        }
        break;
    }
    fclose(f);
    return result;
}

static void print_machine(void)
{
    char model[256] = "unknown";
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f != NULL) {
        char line[512];
        while (fgets(line, sizeof(line), f) != NULL) {
            if (strncmp(line, "model name", 10) == 0) {
                char *c = strchr(line, ':');
                if (c != NULL) {
                    c++;
                    while (*c == ' ' || *c == '\t')
                        c++;
                    c[strcspn(c, "\n")] = '\0';
                    snprintf(model, sizeof(model), "%s", c);
                }
                break;
            }
        }
        fclose(f);
    }
    struct utsname u;
    uname(&u);
    printf("machine: %ld CPUs online, %s, %s %s\n", sysconf(_SC_NPROCESSORS_ONLN), model,
           u.sysname, u.release);
    double load = 0;
    f = fopen("/proc/loadavg", "r");
    if (f != NULL) {
        if (fscanf(f, "%lf", &load) != 1)
            load = 0;
        fclose(f);
    }
    printf("load average before start: %.2f%s\n", load,
           load > 0.5 ? " (other work is running: figures will be low and noisy)" : "");
}

static void pin_to(int first, int last)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c = first; c <= last; c++)
        CPU_SET(c, &set);
    if (sched_setaffinity(0, sizeof(set), &set) < 0)
        fprintf(stderr, "bench_dht: sched_setaffinity: %s\n", strerror(errno));
}

/* ------------------------------------------------------------ processes */

typedef struct daemon_proc {
    pid_t pid;
    char dir[128];
    char sock[192];
    char out[192];
    char addr[256];
} daemon_proc;

/*
 * Starts hivemindd with stdout and stderr to files in its directory.
 * cpu >= 0 pins it (the affinity survives exec). extra is a
 * NULL-terminated list of more arguments.
 */
static void daemon_start(daemon_proc *d, const options *o, const char *name, int cpu,
                         const char *const *extra)
{
    char err_path[192];
    char *argv[32];
    int argc = 0;

    memset(d, 0, sizeof(*d));
    snprintf(d->dir, sizeof(d->dir), "%s/%s", hm_bench_tmpdir(), name);
    snprintf(d->sock, sizeof(d->sock), "%s/ctl.sock", d->dir);
    snprintf(d->out, sizeof(d->out), "%s/out", d->dir);
    snprintf(err_path, sizeof(err_path), "%s/err", d->dir);
    if (mkdir(d->dir, 0700) < 0)
        hm_bench_die("mkdir", -errno);
    argv[argc++] = (char *)o->daemon;
    argv[argc++] = "--listen";
    argv[argc++] = "127.0.0.1:0";
    argv[argc++] = "--state-dir";
    argv[argc++] = d->dir;
    argv[argc++] = "--control-socket";
    argv[argc++] = d->sock;
    argv[argc++] = "--swarm";
    argv[argc++] = SWARM_NAME;
    argv[argc++] = "--log-level";
    argv[argc++] = "warn";
    for (size_t i = 0; extra != NULL && extra[i] != NULL && argc < 22; i++)
        argv[argc++] = (char *)extra[i];
    for (int i = 0; i < o->n_daemon_args && argc < 31; i++)
        argv[argc++] = (char *)o->daemon_args[i];
    argv[argc] = NULL;

    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        hm_bench_die("fork", -errno);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        if (cpu >= 0)
            pin_to(cpu, cpu);
        int fo = open(d->out, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int fe = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int fi = open("/dev/null", O_RDONLY);
        if (fo < 0 || fe < 0 || fi < 0)
            _exit(127);
        dup2(fi, 0);
        dup2(fo, 1);
        dup2(fe, 2);
        unsetenv("NOTIFY_SOCKET");
        unsetenv("HIVEMINDD_CONTROL_SOCKET");
        signal(SIGPIPE, SIG_DFL);
        execv(o->daemon, argv);
        _exit(127);
    }
    d->pid = pid;
    hm_bench_child_add(pid);

    /* The first line on stdout is PEERID@HOST:PORT. */
    uint64_t deadline = hm_now_ms() + 15000;
    while (hm_now_ms() < deadline) {
        FILE *f = fopen(d->out, "r");
        if (f != NULL) {
            char line[256];
            int ok = fgets(line, sizeof(line), f) != NULL && strchr(line, '\n') != NULL;
            fclose(f);
            if (ok) {
                line[strcspn(line, "\n")] = '\0';
                snprintf(d->addr, sizeof(d->addr), "%s", line);
                return;
            }
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            hm_bench_child_forget(pid);
            fprintf(stderr, "bench_dht: %s exited before printing its address; see %s\n",
                    o->daemon, err_path);
            hm_bench_dief("daemon did not start");
        }
        sleep_ms(20);
    }
    hm_bench_dief("a daemon did not print its address within 15 s");
}

static void daemon_stop(daemon_proc *d)
{
    if (d->pid <= 0)
        return;
    kill(d->pid, SIGTERM);
    uint64_t deadline = hm_now_ms() + 5000;
    int st;
    while (waitpid(d->pid, &st, WNOHANG) != d->pid) {
        if (hm_now_ms() > deadline) {
            kill(d->pid, SIGKILL);
            waitpid(d->pid, &st, 0);
            break;
        }
        sleep_ms(10);
    }
    hm_bench_child_forget(d->pid);
    d->pid = 0;
}

/* Runs `hivemindctl -s SOCK --json dht info`; returns the parsed result
 * object (caller decrefs) or NULL. */
static json_t *dht_info(const options *o, const daemon_proc *d)
{
    int pfd[2];
    if (pipe(pfd) < 0)
        return NULL;
    pid_t pid = fork();
    if (pid < 0) {
        close(pfd[0]);
        close(pfd[1]);
        return NULL;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fi = open("/dev/null", O_RDWR);
        dup2(fi, 0);
        dup2(fi, 2);
        dup2(pfd[1], 1);
        close(pfd[0]);
        char *argv[] = {(char *)o->ctl, "-s", (char *)d->sock, "--timeout", "5", "--json",
                        "dht", "info", NULL};
        execv(o->ctl, argv);
        _exit(127);
    }
    hm_bench_child_add(pid);
    close(pfd[1]);
    char buf[8192];
    size_t got = 0;
    for (;;) {
        ssize_t n = read(pfd[0], buf + got, sizeof(buf) - 1 - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
        if (got == sizeof(buf) - 1)
            break;
    }
    buf[got] = '\0';
    close(pfd[0]);
    waitpid(pid, NULL, 0);
    hm_bench_child_forget(pid);
    json_t *j = json_loads(buf, 0, NULL);
    if (j == NULL)
        return NULL;
    json_t *r = json_incref(json_object_get(j, "result"));
    json_decref(j);
    return r;
}

static long info_int(const json_t *r, const char *a, const char *b)
{
    const json_t *v = json_object_get(r, a);
    if (b != NULL)
        v = json_object_get(v, b);
    return json_is_integer(v) ? (long)json_integer_value(v) : -1;
}

/* ------------------------------------------------------------ loop helpers */

static void on_tick_nop(uv_timer_t *t) { HM_UNUSED(t); }

/* Runs the loop for ms milliseconds or until *stop becomes nonzero. */
static void run_loop(uv_loop_t *loop, uint64_t ms, const int *stop)
{
    uv_timer_t t;
    uint64_t end = hm_now_ms() + ms;
    uv_timer_init(loop, &t);
    uv_timer_start(&t, on_tick_nop, 10, 10);
    while (hm_now_ms() < end && (stop == NULL || !*stop))
        uv_run(loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&t, NULL);
    uv_run(loop, UV_RUN_NOWAIT);
}

static void on_node_closed(void *ud) { (*(int *)ud)--; }

/* ------------------------------------------------------------ load clients */

typedef struct slot {
    uint32_t tid;
    uint64_t sent_us; /* 0: free */
} slot;

struct worker;

typedef struct client {
    struct worker *w;
    hm_rpc *rpc;
    hm_identity id;
    uint8_t token[HM_DHT_TOKEN_MAX];
    size_t token_len;
    uint64_t ping_sent_us;
    double bucket;
    uint64_t bucket_us;
    unsigned inflight;
    uint32_t next_tid;
    slot slots[MAX_WINDOW];
} client;

typedef struct worker {
    uv_loop_t loop;
    uv_timer_t tick;
    uv_poll_t cmd_poll;
    int cmd_fd, res_fd;
    client *clients;
    size_t n;
    unsigned window;
    uint8_t server_pk[HM_PK_BYTES];
    struct sockaddr_storage server;
    hm_dht_msg *msg;      /* request template, and scratch for decoding samples */
    int ready_sent;
    int measuring;
    int quitting;
    int open_rpcs;
    uint64_t end_us;
    uint64_t replies, sent, lost, send_errors, bad;
    uint64_t sampled, sample_contacts, sample_bytes;
} worker;

/* The type and tid at the head of a DHT datagram ([type, tid, ...]), read
 * without decoding the rest so that the load side stays cheap. */
static int peek_head(const uint8_t *m, size_t len, int *type, uint32_t *tid)
{
    if (len < 3 || (m[0] & 0xf0) != 0x90 || m[1] > 0x7f)
        return -EPROTO;
    *type = m[1];
    const uint8_t *p = m + 2;
    size_t left = len - 2;
    if (p[0] <= 0x7f)
        *tid = p[0];
    else if (p[0] == 0xcc && left >= 2)
        *tid = p[1];
    else if (p[0] == 0xcd && left >= 3)
        *tid = (uint32_t)p[1] << 8 | p[2];
    else if (p[0] == 0xce && left >= 5)
        *tid = (uint32_t)p[1] << 24 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 8 | p[4];
    else
        return -EPROTO;
    return 0;
}

static int client_send(client *c, int type, uint64_t now_us)
{
    worker *w = c->w;
    hm_dht_msg *m = w->msg;
    uint8_t buf[HM_DHT_PROTO_MAX_SIZE];
    size_t len;
    int r;

    m->type = type;
    m->tid = ++c->next_tid;
    m->flags = HM_DHT_FLAG_CLIENT;
    m->token = c->token_len > 0 ? c->token : NULL;
    m->token_len = c->token_len;
    m->has_cursor = 0;
    m->n_records = 0;
    m->n_contacts = 0;
    if (type == HM_DHT_MSG_GET)
        randombytes_buf(m->target, sizeof(m->target));
    /* Without a token the daemon answers with no more bytes than it got,
     * so the PING that fetches one is padded to leave room for the PONG. */
    if ((r = hm_dht_msg_encode(m, c->token_len > 0 ? 0 : 96, buf, sizeof(buf), &len)) < 0)
        return r;
    r = hm_rpc_send_oneway(c->rpc, w->server_pk, (const struct sockaddr *)&w->server,
                           HM_RPC_CHANNEL_DHT, buf, len);
    if (r < 0)
        return r;
    if (type == HM_DHT_MSG_GET) {
        for (unsigned i = 0; i < w->window; i++) {
            if (c->slots[i].sent_us == 0) {
                c->slots[i].tid = m->tid;
                c->slots[i].sent_us = now_us;
                break;
            }
        }
        c->inflight++;
    }
    return 0;
}

/* Sends as many GETs as the window and the client's rate allow. */
static void client_fill(client *c, uint64_t now_us)
{
    worker *w = c->w;
    if (!w->measuring || c->token_len == 0)
        return;
    c->bucket = HM_MIN(4.0, c->bucket + (double)(now_us - c->bucket_us) * 1e-6 * CLIENT_RATE);
    c->bucket_us = now_us;
    while (c->bucket >= 1.0 && c->inflight < w->window) {
        if (client_send(c, HM_DHT_MSG_GET, now_us) < 0) {
            w->send_errors++;
            break;
        }
        c->bucket -= 1.0;
        w->sent++;
    }
}

static void on_client_dgram(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                            const uint8_t *body, size_t len)
{
    client *c = ud;
    worker *w = c->w;
    int type;
    uint32_t tid;
    HM_UNUSED(from);

    if (memcmp(pk, w->server_pk, HM_PK_BYTES) != 0 || peek_head(body, len, &type, &tid) < 0) {
        w->bad++;
        return;
    }
    if (type == HM_DHT_MSG_PONG) {
        /* The token proves our address, so the daemon answers in full. */
        hm_dht_msg *m = w->msg;
        if (c->token_len == 0 && hm_dht_msg_decode(body, len, m) == 0 && m->token != NULL &&
            m->token_len <= sizeof(c->token)) {
            memcpy(c->token, m->token, m->token_len);
            c->token_len = m->token_len;
        }
        return;
    }
    if (type != HM_DHT_MSG_VALUE) {
        w->bad++;
        return;
    }
    for (unsigned i = 0; i < w->window; i++) {
        if (c->slots[i].sent_us != 0 && c->slots[i].tid == tid) {
            c->slots[i].sent_us = 0;
            c->inflight--;
            if (w->measuring) {
                w->replies++;
                /* Decode one reply in 64 in full, to check its shape and
                 * report what a reply carries. */
                if ((w->replies & 63) == 1 && hm_dht_msg_decode(body, len, w->msg) == 0) {
                    w->sampled++;
                    w->sample_contacts += w->msg->n_contacts;
                    w->sample_bytes += len;
                }
            }
            client_fill(c, hm_now_us());
            return;
        }
    }
}

static void worker_report(worker *w, const char *line)
{
    size_t n = strlen(line);
    if (write(w->res_fd, line, n) != (ssize_t)n)
        _exit(1);
}

static void on_rpc_closed(void *ud) { ((worker *)ud)->open_rpcs--; }

static void on_worker_tick(uv_timer_t *t)
{
    worker *w = t->data;
    uint64_t now = hm_now_us();
    size_t with_token = 0;

    for (size_t i = 0; i < w->n; i++) {
        client *c = &w->clients[i];
        if (c->token_len == 0) {
            if (now - c->ping_sent_us > 300000) {
                c->ping_sent_us = now;
                if (client_send(c, HM_DHT_MSG_PING, now) < 0)
                    w->send_errors++;
            }
            continue;
        }
        with_token++;
        for (unsigned s = 0; s < w->window; s++) {
            if (c->slots[s].sent_us != 0 && now - c->slots[s].sent_us > LOST_AFTER_US) {
                c->slots[s].sent_us = 0;
                c->inflight--;
                if (w->measuring)
                    w->lost++;
            }
        }
        client_fill(c, now);
    }
    if (!w->ready_sent && with_token == w->n) {
        w->ready_sent = 1;
        worker_report(w, "ready\n");
    }
    if (w->measuring && now >= w->end_us) {
        char line[160];
        w->measuring = 0;
        snprintf(line, sizeof(line), "%llu %llu %llu %llu %llu %llu %llu\n",
                 (unsigned long long)w->replies, (unsigned long long)w->sent,
                 (unsigned long long)w->lost, (unsigned long long)w->send_errors,
                 (unsigned long long)w->sampled, (unsigned long long)w->sample_contacts,
                 (unsigned long long)w->sample_bytes);
        worker_report(w, line);
    }
}

static void on_worker_cmd(uv_poll_t *p, int status, int events)
{
    worker *w = p->data;
    char buf[64];
    HM_UNUSED(events);
    ssize_t n = status < 0 ? -1 : read(w->cmd_fd, buf, sizeof(buf) - 1);
    if (n < 0 && errno == EINTR)
        return;
    double secs;
    if (n > 0) {
        buf[n] = '\0';
        if (sscanf(buf, "run %lf", &secs) == 1 && secs > 0) {
            w->replies = w->sent = w->lost = w->send_errors = 0;
            w->sampled = w->sample_contacts = w->sample_bytes = 0;
            uint64_t now = hm_now_us();
            w->end_us = now + (uint64_t)(secs * 1e6);
            w->measuring = 1;
            for (size_t i = 0; i < w->n; i++) {
                w->clients[i].bucket = 1.0;
                w->clients[i].bucket_us = now;
                client_fill(&w->clients[i], now);
            }
            return;
        }
    }
    /* "quit", EOF or an error: close everything and leave. */
    w->quitting = 1;
    uv_poll_stop(p);
}

/* The body of one worker process; never returns. */
static void worker_main(const options *o, int cmd_fd, int res_fd, int n_clients, int cpu_first,
                        int cpu_last, const uint8_t server_pk[HM_PK_BYTES],
                        const struct sockaddr_storage *server)
{
    worker w;
    uint8_t swarm[HM_SWARM_ID_BYTES];
    int r;

    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (cpu_first >= 0)
        pin_to(cpu_first, cpu_last);
    memset(&w, 0, sizeof(w));
    w.cmd_fd = cmd_fd;
    w.res_fd = res_fd;
    w.window = (unsigned)o->window;
    memcpy(w.server_pk, server_pk, HM_PK_BYTES);
    memcpy(&w.server, server, sizeof(w.server));
    w.msg = calloc(1, sizeof(*w.msg));
    w.n = (size_t)n_clients;
    w.clients = calloc(w.n, sizeof(*w.clients));
    if (w.msg == NULL || w.clients == NULL)
        _exit(1);
    hm_swarm_id(SWARM_NAME, NULL, 0, swarm);
    uv_loop_init(&w.loop);
    for (size_t i = 0; i < w.n; i++) {
        client *c = &w.clients[i];
        c->w = &w;
        hm_identity_generate(&c->id);
        /* One peer only: a small datagram key cache is enough. */
        hm_transport_config tc = {.listen = "127.0.0.1:0", .dgram_peers = 16};
        if ((r = hm_rpc_new(&w.loop, &c->id, swarm, &tc, NULL, &c->rpc)) < 0) {
            fprintf(stderr, "bench_dht: load client %zu: %s\n", i, hm_strerror(r));
            _exit(1);
        }
        hm_rpc_register_oneway(c->rpc, HM_RPC_CHANNEL_DHT, on_client_dgram, c);
        w.open_rpcs++;
    }
    uv_timer_init(&w.loop, &w.tick);
    w.tick.data = &w;
    uv_timer_start(&w.tick, on_worker_tick, 1, 1);
    uv_poll_init(&w.loop, &w.cmd_poll, cmd_fd);
    w.cmd_poll.data = &w;
    uv_poll_start(&w.cmd_poll, UV_READABLE, on_worker_cmd);
    while (!w.quitting)
        uv_run(&w.loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&w.tick, NULL);
    uv_close((uv_handle_t *)&w.cmd_poll, NULL);
    for (size_t i = 0; i < w.n; i++)
        hm_rpc_close(w.clients[i].rpc, on_rpc_closed, &w);
    while (w.open_rpcs > 0)
        uv_run(&w.loop, UV_RUN_ONCE);
    uv_run(&w.loop, UV_RUN_NOWAIT);
    uv_loop_close(&w.loop);
    for (size_t i = 0; i < w.n; i++)
        hm_identity_wipe(&w.clients[i].id);
    free(w.clients);
    free(w.msg);
    _exit(0);
}

typedef struct worker_proc {
    pid_t pid;
    int cmd_fd, res_fd;
    FILE *res;
} worker_proc;

static void worker_start(worker_proc *wp, const options *o, int n_clients, int cpu_first,
                         int cpu_last, const uint8_t server_pk[HM_PK_BYTES],
                         const struct sockaddr_storage *server)
{
    int cmd[2], res[2];
    if (pipe(cmd) < 0 || pipe(res) < 0)
        hm_bench_die("pipe", -errno);
    pid_t pid = hm_bench_fork();
    if (pid == 0) {
        close(cmd[1]);
        close(res[0]);
        worker_main(o, cmd[0], res[1], n_clients, cpu_first, cpu_last, server_pk, server);
    }
    close(cmd[0]);
    close(res[1]);
    hm_bench_child_add(pid);
    wp->pid = pid;
    wp->cmd_fd = cmd[1];
    wp->res_fd = res[0];
    wp->res = fdopen(res[0], "r");
    if (wp->res == NULL)
        hm_bench_die("fdopen", -errno);
}

/* Reads one line of a worker's report; dies if the worker died. */
static void worker_line(worker_proc *wp, char *line, size_t len)
{
    if (fgets(line, (int)len, wp->res) == NULL)
        hm_bench_dief("a load worker exited early");
}

static void worker_cmd(worker_proc *wp, const char *cmd)
{
    size_t n = strlen(cmd);
    if (write(wp->cmd_fd, cmd, n) != (ssize_t)n)
        hm_bench_die("worker command", -errno);
}

/* ------------------------------------------------------------ 1. serving */

static void bench_serve(const options *o)
{
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    daemon_proc d;
    worker_proc wp[MAX_WORKERS];
    uint8_t server_pk[HM_PK_BYTES];
    struct sockaddr_storage server;
    int nw = o->workers;
    int pinned = ncpu >= 2;

    if (nw <= 0)
        nw = (int)HM_MAX(1, HM_MIN(ncpu - 1, 4));
    nw = HM_MIN(nw, MAX_WORKERS);
    nw = HM_MIN(nw, o->clients);

    printf("\n== serving rate: one hivemindd, %s ==\n",
           pinned ? "pinned to CPU 0; load clients pinned to the other CPUs"
                  : "one CPU only: daemon and load share it, so the figure is a lower bound");
    printf("load: %d clients in %d worker process%s, GET for random keys, at most %d in flight "
           "and %.0f/s per client (offered at most %.0f/s)\n",
           o->clients, nw, nw == 1 ? "" : "es", o->window, CLIENT_RATE,
           CLIENT_RATE * o->clients);
    printf("note: the daemon rate-limits DHT requests per address (200/s, loopback keyed by "
           "port); each client stays under it, so this is the daemon's datagram crypto + DHT "
           "serving path, not its limiter\n");
    fflush(stdout);

    const char *extra[] = {"--ping-interval", "3600", NULL};
    daemon_start(&d, o, "serve", pinned ? 0 : -1, extra);
    if (hm_peer_addr_parse(d.addr, server_pk, &server) < 0)
        hm_bench_dief("cannot parse the daemon's address");

    /* Helpers: full DHT nodes that join the daemon, so its routing table
     * holds real contacts and its GET replies carry k of them. */
    uv_loop_t loop;
    hm_node **helpers = calloc((size_t)o->helpers, sizeof(*helpers));
    for (int i = 0; i < nw; i++) {
        int share = o->clients / nw + (i < o->clients % nw);
        worker_start(&wp[i], o, share, pinned ? 1 : -1, pinned ? (int)ncpu - 1 : -1, server_pk,
                     &server);
    }
    if (pinned)
        pin_to(1, (int)ncpu - 1);
    uv_loop_init(&loop);
    for (int i = 0; i < o->helpers; i++) {
        char err[256];
        const char *peers[1] = {d.addr};
        hm_node_options no = {.listen = "127.0.0.1:0", .initial_peers = peers,
                              .n_initial_peers = 1, .swarm = SWARM_NAME,
                              .ping_interval_ms = 3600000};
        int r = hm_node_new(&loop, &no, &helpers[i], err, sizeof(err));
        if (r < 0) {
            fprintf(stderr, "bench_dht: helper node: %s\n", err);
            exit(1);
        }
    }
    /* Let the helpers join and the daemon's table fill. */
    long rt = -1, prev = -2;
    uint64_t deadline = hm_now_ms() + 20000;
    while (hm_now_ms() < deadline) {
        run_loop(&loop, 1000, NULL);
        json_t *info = dht_info(o, &d);
        rt = info != NULL ? info_int(info, "routing_table", "size") : -1;
        json_decref(info);
        if (rt >= HM_MIN(20, o->helpers) && rt == prev)
            break;
        prev = rt;
    }
    for (int i = 0; i < nw; i++) {
        char line[64];
        worker_line(&wp[i], line, sizeof(line));
    }
    printf("daemon routing table: %ld contacts (%d helper nodes joined it)\n", rt, o->helpers);
    fflush(stdout);

    double *rate = calloc((size_t)o->runs, sizeof(double));
    double *dcpu = calloc((size_t)o->runs, sizeof(double));
    double *wcpu = calloc((size_t)o->runs, sizeof(double));
    double *cpu0 = calloc((size_t)o->runs, sizeof(double));
    double *per_cpu_s = calloc((size_t)o->runs, sizeof(double));
    uint64_t lost_total = 0, sampled = 0, contacts = 0, bytes = 0;
    char cmd[64];
    snprintf(cmd, sizeof(cmd), "run %.3f\n", o->seconds);
    for (int run = 0; run < o->runs; run++) {
        double d0 = hm_bench_proc_cpu_s(d.pid), w0 = 0, w1 = 0, b0 = 0, t0j = 0, b1 = 0, t1j = 0;
        int have_cpu0 = cpu_jiffies(0, &b0, &t0j) == 0;
        for (int i = 0; i < nw; i++)
            w0 += hm_bench_proc_cpu_s(wp[i].pid);
        uint64_t t0 = hm_now_us();
        for (int i = 0; i < nw; i++)
            worker_cmd(&wp[i], cmd);
        /* Keep the helpers answering the daemon while the run lasts. */
        run_loop(&loop, (uint64_t)(o->seconds * 1000), NULL);
        uint64_t replies = 0, sent = 0, lost = 0, errs = 0;
        for (int i = 0; i < nw; i++) {
            char line[160];
            unsigned long long v[7];
            worker_line(&wp[i], line, sizeof(line));
            if (sscanf(line, "%llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                       &v[4], &v[5], &v[6]) != 7)
                hm_bench_dief("bad worker report");
            replies += v[0];
            sent += v[1];
            lost += v[2];
            errs += v[3];
            sampled += v[4];
            contacts += v[5];
            bytes += v[6];
        }
        double el = (double)(hm_now_us() - t0) / 1e6;
        double d1 = hm_bench_proc_cpu_s(d.pid);
        have_cpu0 = have_cpu0 && cpu_jiffies(0, &b1, &t1j) == 0 && t1j > t0j;
        cpu0[run] = have_cpu0 ? 100.0 * (b1 - b0) / (t1j - t0j) : -1;
        for (int i = 0; i < nw; i++)
            w1 += hm_bench_proc_cpu_s(wp[i].pid);
        rate[run] = (double)replies / o->seconds;
        dcpu[run] = 100.0 * (d1 - d0) / el;
        per_cpu_s[run] = d1 > d0 ? (double)replies / (d1 - d0) : 0;
        wcpu[run] = 100.0 * (w1 - w0) / el;
        lost_total += lost;
        fprintf(stderr,
                "  run %d: %.0f replies/s (%llu sent, %llu lost, %llu send errors), daemon CPU "
                "%.0f%%, CPU 0 busy %.0f%%, load CPU %.0f%%\n",
                run + 1, rate[run], (unsigned long long)sent, (unsigned long long)lost,
                (unsigned long long)errs, dcpu[run], cpu0[run], wcpu[run]);
        /* Idle a little, so that the daemon's per-address buckets refill. */
        run_loop(&loop, 500, NULL);
    }
    json_t *info = dht_info(o, &d);
    long limited = info != NULL ? info_int(info, "rate_limited", NULL) : -1;
    json_decref(info);

    double mrate = hm_bench_median(rate, o->runs), mdcpu = hm_bench_median(dcpu, o->runs),
           mwcpu = hm_bench_median(wcpu, o->runs), mcpu0 = hm_bench_median(cpu0, o->runs);
    printf("DHT GET replies served: %.0f /s (median of %d runs of %.1f s)\n", mrate, o->runs,
           o->seconds);
    printf("daemon CPU during runs: %.0f%% of one core (median); CPU 0 busy: %.0f%%; load "
           "workers: %.0f%%\n",
           mdcpu, mcpu0, mwcpu);
    if (pinned && mcpu0 > mdcpu + 15.0)
        printf("warning: other work used CPU 0 during the runs (busy %.0f%%, daemon %.0f%%)\n",
               mcpu0, mdcpu);
    double per_core = hm_bench_median(per_cpu_s, o->runs);
    printf("DHT GET replies per second of daemon CPU time: %.0f (median; what one fully used "
           "core would serve at this per-request cost)\n",
           per_core);
    if (sampled > 0)
        printf("a reply carried %.1f contacts, %.0f bytes of DHT message (mean of %llu sampled)\n",
               (double)contacts / (double)sampled, (double)bytes / (double)sampled,
               (unsigned long long)sampled);
    printf("requests lost (no reply within 1 s): %llu; daemon rate-limited: %ld\n",
           (unsigned long long)lost_total, limited);
    if (mdcpu < 90.0) {
        if (mwcpu >= 90.0 * nw)
            printf("note: the daemon was not saturated (%.0f%% CPU) because the load workers "
                   "filled their CPUs; on a machine with more cores, more --workers reach its "
                   "ceiling; the per-CPU-second figure above estimates it\n",
                   mdcpu);
        else if (mrate >= 0.97 * CLIENT_RATE * o->clients)
            printf("note: the daemon was not saturated (%.0f%% CPU): it answered all the offered "
                   "load; raise --clients for its ceiling\n",
                   mdcpu);
        else
            printf("note: the daemon was not saturated (%.0f%% CPU) and the load was not CPU "
                   "bound: see the lost count and other work on the machine\n",
                   mdcpu);
    }
    fflush(stdout);

    for (int i = 0; i < nw; i++) {
        worker_cmd(&wp[i], "quit\n");
        fclose(wp[i].res);
        close(wp[i].cmd_fd);
        waitpid(wp[i].pid, NULL, 0);
        hm_bench_child_forget(wp[i].pid);
    }
    int open_nodes = o->helpers;
    for (int i = 0; i < o->helpers; i++)
        hm_node_close(helpers[i], on_node_closed, &open_nodes);
    while (open_nodes > 0)
        uv_run(&loop, UV_RUN_ONCE);
    uv_run(&loop, UV_RUN_NOWAIT);
    uv_loop_close(&loop);
    daemon_stop(&d);
    free(helpers);
    free(rate);
    free(dcpu);
    free(wcpu);
    free(cpu0);
    free(per_cpu_s);
}

/* ------------------------------------------------------------ 2. latency */

typedef struct op_state {
    int done;
    int status;
    unsigned stored;
    size_t nvalues;
    int match;
    const uint8_t *want;
    size_t want_len;
    hm_dht_lookup_info info;
    uint64_t end_us;
} op_state;

static void on_put(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    op_state *s = ud;
    s->end_us = hm_now_us();
    s->status = status;
    s->stored = stored;
    if (info != NULL)
        s->info = *info;
    s->done = 1;
}

static void on_get(void *ud, int status, const hm_dht_value *values, size_t n,
                   const hm_dht_lookup_info *info)
{
    op_state *s = ud;
    s->end_us = hm_now_us();
    s->status = status;
    s->nvalues = n;
    s->match = status == 0 && n >= 1 && values[0].rec.value_len == s->want_len &&
               memcmp(values[0].rec.value, s->want, s->want_len) == 0;
    if (info != NULL)
        s->info = *info;
    s->done = 1;
}

static void print_lat(const char *what, double *v, size_t n)
{
    qsort(v, n, sizeof(*v), hm_bench_cmp_double);
    printf("%s latency: p50 %7.2f ms   p95 %7.2f ms   (max %.2f ms, %zu ops)\n", what,
           hm_bench_percentile(v, n, 0.50), hm_bench_percentile(v, n, 0.95),
           n > 0 ? v[n - 1] : NAN, n);
}

/*
 * -- churn -- The host's count of UDP datagrams dropped because a socket's
 * receive buffer was full (RcvbufErrors of /proc/net/snmp), or -1. Every
 * process of the network namespace counts, so it is an upper bound for
 * this run's; a lookup whose replies are dropped waits out timeouts and
 * may lose live contacts, which the latencies alone would not tell.
 */
static long long udp_rcvbuf_errors(void)
{
    FILE *f = fopen("/proc/net/snmp", "r");
    char head[1024], vals[1024];
    long long result = -1;
    if (f == NULL)
        return -1;
    while (fgets(head, sizeof(head), f) != NULL && fgets(vals, sizeof(vals), f) != NULL) {
        if (strncmp(head, "Udp: ", 5) != 0 || strncmp(vals, "Udp: ", 5) != 0)
            continue;
        char *hs = NULL, *vs = NULL;
        char *h = strtok_r(head + 5, " \n", &hs), *v = strtok_r(vals + 5, " \n", &vs);
        for (; h != NULL && v != NULL;
             h = strtok_r(NULL, " \n", &hs), v = strtok_r(NULL, " \n", &vs))
            if (strcmp(h, "RcvbufErrors") == 0) {
                result = strtoll(v, NULL, 10);
                break;
            }
        break;
    }
    fclose(f);
    return result;
}

static void bench_latency(const options *o)
{
    int n = o->nodes;
    daemon_proc *nodes = calloc((size_t)n, sizeof(*nodes));
    char name[16];

    printf("\n== latency: %d hivemindd processes on 127.0.0.1, %d puts then %d gets ==\n", n,
           o->ops, o->ops);
    fflush(stdout);
    const char *first_extra[] = {"--ping-interval", "2", NULL};
    daemon_start(&nodes[0], o, "n0", -1, first_extra);
    for (int i = 1; i < n; i++) {
        const char *extra[] = {"--ping-interval", "2", "--initial-peers", nodes[0].addr, NULL};
        snprintf(name, sizeof(name), "n%d", i);
        daemon_start(&nodes[i], o, name, -1, extra);
    }
    /* Settle: every routing table holds at least half the swarm. */
    uint64_t t0 = hm_now_ms(), deadline = t0 + 60000;
    long want = HM_MIN(n - 1, HM_MAX(1, n / 2));
    long *sizes = calloc((size_t)n, sizeof(long));
    int ready = 0;
    while (hm_now_ms() < deadline) {
        ready = 0;
        for (int i = 0; i < n; i++) {
            if (sizes[i] < want) {
                json_t *info = dht_info(o, &nodes[i]);
                sizes[i] = info != NULL ? info_int(info, "routing_table", "size") : -1;
                json_decref(info);
            }
            ready += sizes[i] >= want;
        }
        if (ready == n)
            break;
        sleep_ms(500);
    }
    long min_rt = sizes[0], sum_rt = 0;
    for (int i = 0; i < n; i++) {
        min_rt = HM_MIN(min_rt, sizes[i]);
        sum_rt += sizes[i];
    }
    double settle_s = (double)(hm_now_ms() - t0) / 1000.0;
    /* The joins' own lookups and refreshes die down before measuring. */
    sleep_ms(3000);
    printf("swarm settled in %.1f s (then 3 s more before measuring): %d of %d routing tables "
           "hold >= %ld contacts (min %ld, mean %.1f)\n",
           settle_s, ready, n, want, min_rt, (double)sum_rt / n);
    if (ready < n)
        printf("warning: the swarm did not fully settle within 60 s\n");
    free(sizes);

    /* The measuring client: a client-mode node that joined through three
     * daemons, so that it takes no part in serving. */
    uv_loop_t loop;
    hm_node *cn;
    char err[256];
    const char *peers[3] = {nodes[0].addr, nodes[n / 3].addr, nodes[(2 * n) / 3].addr};
    hm_node_options no = {.listen = "127.0.0.1:0", .initial_peers = peers,
                          .n_initial_peers = n >= 3 ? 3 : 1, .swarm = SWARM_NAME,
                          .client_mode = 1, .ping_interval_ms = 2000};
    uv_loop_init(&loop);
    if (hm_node_new(&loop, &no, &cn, err, sizeof(err)) < 0) {
        fprintf(stderr, "bench_dht: client node: %s\n", err);
        exit(1);
    }
    hm_dht_stats st;
    deadline = hm_now_ms() + 15000;
    do {
        run_loop(&loop, 200, NULL);
        hm_dht_get_stats(hm_node_dht(cn), &st);
    } while ((long)st.rt_size < want && hm_now_ms() < deadline);
    printf("client routing table: %zu contacts\n", st.rt_size);
    fflush(stdout);

    long long rcvbuf0 = udp_rcvbuf_errors();
    size_t P = (size_t)o->ops;
    double *put_ms = calloc(P, sizeof(double)), *get_ms = calloc(P, sizeof(double));
    char (*keys)[48] = calloc(P, sizeof(*keys));
    uint8_t (*vals)[64] = calloc(P, sizeof(*vals));
    uint32_t tag;
    randombytes_buf(&tag, sizeof(tag));
    size_t put_ok = 0, get_ok = 0, np = 0, ng = 0;
    double hops_p = 0, req_p = 0, stored = 0, hops_g = 0, req_g = 0;
    size_t put_to = 0, get_to = 0; /* operations that saw a request time out */
    for (size_t i = 0; i < P; i++) {
        op_state s = {0};
        snprintf(keys[i], sizeof(keys[i]), "bench-dht-%08x-%zu", tag, i);
        randombytes_buf(vals[i], sizeof(vals[i]));
        uint64_t start = hm_now_us();
        int r = hm_node_dht_put(cn, (const uint8_t *)keys[i], strlen(keys[i]), NULL, 0, 0,
                                vals[i], sizeof(vals[i]), 600, 10000, on_put, &s);
        if (r < 0)
            hm_bench_die("put", r);
        run_loop(&loop, 20000, &s.done);
        if (!s.done)
            hm_bench_dief("a put's callback never fired");
        put_ms[np++] = (double)(s.end_us - start) / 1000.0;
        put_to += s.info.timeouts > 0;
        if (s.status == 0 && s.stored > 0) {
            put_ok++;
            stored += s.stored;
            hops_p += s.info.hops;
            req_p += s.info.requests;
        }
    }
    for (size_t i = 0; i < P; i++) {
        op_state s = {.want = vals[i], .want_len = sizeof(vals[i])};
        uint64_t start = hm_now_us();
        int r = hm_node_dht_get(cn, (const uint8_t *)keys[i], strlen(keys[i]), 10000, on_get,
                                &s);
        if (r < 0)
            hm_bench_die("get", r);
        run_loop(&loop, 20000, &s.done);
        if (!s.done)
            hm_bench_dief("a get's callback never fired");
        get_ms[ng++] = (double)(s.end_us - start) / 1000.0;
        get_to += s.info.timeouts > 0;
        if (s.match) {
            get_ok++;
            hops_g += s.info.hops;
            req_g += s.info.requests;
        }
    }
    print_lat("put", put_ms, np);
    print_lat("get", get_ms, ng);
    printf("puts ok: %zu of %zu (mean %.1f replicas stored, %.1f hops, %.1f requests)\n", put_ok,
           P, put_ok ? stored / (double)put_ok : 0.0, put_ok ? hops_p / (double)put_ok : 0.0,
           put_ok ? req_p / (double)put_ok : 0.0);
    printf("gets ok: %zu of %zu found the value put (mean %.1f hops, %.1f requests)\n", get_ok, P,
           get_ok ? hops_g / (double)get_ok : 0.0, get_ok ? req_g / (double)get_ok : 0.0);
    printf("operations that waited out a request timeout: %zu puts, %zu gets\n", put_to, get_to);
    fflush(stdout);

    if (o->churn > 0) {
        /* Kill churn% of the daemons at once; the client's table still
         * holds them, as a trainer's would. */
        int nkill = (n * o->churn + 50) / 100, killed = 0;
        uint8_t *dead = calloc((size_t)n, 1);
        while (killed < nkill) {
            uint32_t pick;
            randombytes_buf(&pick, sizeof(pick));
            int i = (int)(pick % (uint32_t)n);
            if (dead[i])
                continue;
            kill(nodes[i].pid, SIGKILL);
            dead[i] = 1;
            killed++;
        }
        printf("\n== churn: %d of %d daemons SIGKILLed, then %zu gets, 8 at a time ==\n", killed,
               n, P);
        fflush(stdout);
        double *churn_ms = calloc(P, sizeof(double));
        size_t nc = 0, churn_ok = 0, churn_to = 0;
        for (size_t i = 0; i < P; i += 8) {
            op_state cs[8];
            uint64_t start[8];
            size_t batch = HM_MIN((size_t)8, P - i);
            int done = 0;
            memset(cs, 0, sizeof(cs));
            for (size_t j = 0; j < batch; j++) {
                cs[j].want = vals[i + j];
                cs[j].want_len = sizeof(vals[i + j]);
                start[j] = hm_now_us();
                int r = hm_node_dht_get(cn, (const uint8_t *)keys[i + j], strlen(keys[i + j]),
                                        10000, on_get, &cs[j]);
                if (r < 0)
                    hm_bench_die("get", r);
            }
            uint64_t until = hm_now_ms() + 20000;
            while (!done && hm_now_ms() < until) {
                run_loop(&loop, 5, NULL);
                done = 1;
                for (size_t j = 0; j < batch; j++)
                    done &= cs[j].done;
            }
            if (!done)
                hm_bench_dief("a get's callback never fired");
            for (size_t j = 0; j < batch; j++) {
                churn_ms[nc++] = (double)(cs[j].end_us - start[j]) / 1000.0;
                churn_ok += cs[j].match;
                churn_to += cs[j].info.timeouts > 0;
            }
        }
        print_lat("get after churn", churn_ms, nc);
        printf("gets after churn ok: %zu of %zu found the value put; %zu met a dead contact\n",
               churn_ok, nc, churn_to);
        fflush(stdout);
        free(churn_ms);
        free(dead);
    }
    long long rcvbuf1 = udp_rcvbuf_errors();
    if (rcvbuf0 >= 0 && rcvbuf1 >= 0)
        printf("UDP datagrams dropped by full receive buffers during the puts and gets: %lld "
               "(the whole host's count)\n",
               rcvbuf1 - rcvbuf0);

    int open_nodes = 1;
    hm_node_close(cn, on_node_closed, &open_nodes);
    while (open_nodes > 0)
        uv_run(&loop, UV_RUN_ONCE);
    uv_run(&loop, UV_RUN_NOWAIT);
    uv_loop_close(&loop);
    for (int i = n - 1; i >= 0; i--)
        kill(nodes[i].pid, SIGTERM);
    for (int i = n - 1; i >= 0; i--)
        daemon_stop(&nodes[i]);
    free(nodes);
    free(put_ms);
    free(get_ms);
    free(keys);
    free(vals);
}

/* ------------------------------------------------------------ during a round */

/* In flight at once: 128 x 10 ms covers a stall past LOST_AFTER_US, so a
 * stalled loop does not make the probe skip the GETs that would have waited
 * on it (the figure would read low). */
#define PROBE_WINDOW 128
#define PROBE_EVERY_US 10000u
#define PROBE_MAX_SAMPLES 200000u

typedef struct probe {
    hm_rpc *rpc;
    hm_identity id;
    uint8_t server_pk[HM_PK_BYTES];
    struct sockaddr_storage server;
    hm_dht_msg *msg;
    uint8_t token[HM_DHT_TOKEN_MAX];
    size_t token_len;
    uint32_t next_tid;
    uint64_t next_us;
    struct {
        uint32_t tid;
        uint64_t sent_us; /* 0: free */
        int busy;         /* sent while a round ran */
    } slots[PROBE_WINDOW];
    int busy; /* a round runs now */
    double *ms[2];
    size_t n[2];
    uint64_t lost[2];
    uint64_t skipped; /* due with the window full: not sent, not counted */
} probe;

static void probe_send(probe *p, int type, uint64_t now_us)
{
    hm_dht_msg *m = p->msg;
    uint8_t buf[HM_DHT_PROTO_MAX_SIZE];
    size_t len;
    int free_slot = -1;
    if (type == HM_DHT_MSG_GET) {
        for (int i = 0; i < PROBE_WINDOW && free_slot < 0; i++)
            if (p->slots[i].sent_us == 0)
                free_slot = i;
        if (free_slot < 0) {
            p->skipped++;
            return;
        }
    }
    memset(m, 0, sizeof(*m));
    m->type = type;
    m->tid = ++p->next_tid;
    m->flags = HM_DHT_FLAG_CLIENT;
    m->token = p->token_len > 0 ? p->token : NULL;
    m->token_len = p->token_len;
    if (type == HM_DHT_MSG_GET)
        randombytes_buf(m->target, sizeof(m->target));
    /* The PING that fetches a token is padded to leave room for the PONG. */
    if (hm_dht_msg_encode(m, p->token_len > 0 ? 0 : 96, buf, sizeof(buf), &len) < 0 ||
        hm_rpc_send_oneway(p->rpc, p->server_pk, (const struct sockaddr *)&p->server,
                           HM_RPC_CHANNEL_DHT, buf, len) < 0)
        return;
    if (free_slot >= 0) {
        p->slots[free_slot].tid = m->tid;
        p->slots[free_slot].sent_us = now_us;
        p->slots[free_slot].busy = p->busy;
    }
}

static void on_probe_dgram(void *ud, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *from,
                           const uint8_t *body, size_t len)
{
    probe *p = ud;
    int type;
    uint32_t tid;
    HM_UNUSED(from);
    if (memcmp(pk, p->server_pk, HM_PK_BYTES) != 0 || peek_head(body, len, &type, &tid) < 0)
        return;
    if (type == HM_DHT_MSG_PONG) {
        if (p->token_len == 0 && hm_dht_msg_decode(body, len, p->msg) == 0 &&
            p->msg->token != NULL && p->msg->token_len <= sizeof(p->token)) {
            memcpy(p->token, p->msg->token, p->msg->token_len);
            p->token_len = p->msg->token_len;
        }
        return;
    }
    uint64_t now = hm_now_us();
    for (int i = 0; i < PROBE_WINDOW; i++) {
        if (p->slots[i].sent_us != 0 && p->slots[i].tid == tid) {
            int b = p->slots[i].busy;
            if (p->n[b] < PROBE_MAX_SAMPLES)
                p->ms[b][p->n[b]++] = (double)(now - p->slots[i].sent_us) / 1000.0;
            p->slots[i].sent_us = 0;
            return;
        }
    }
}

/* Every millisecond: expire lost GETs, send the next one when due. */
static void on_probe_tick(uv_timer_t *t)
{
    probe *p = t->data;
    uint64_t now = hm_now_us();
    if (p->token_len == 0) {
        if (now >= p->next_us) {
            probe_send(p, HM_DHT_MSG_PING, now);
            p->next_us = now + 300000;
        }
        return;
    }
    for (int i = 0; i < PROBE_WINDOW; i++) {
        if (p->slots[i].sent_us != 0 && now - p->slots[i].sent_us > LOST_AFTER_US) {
            p->lost[p->slots[i].busy]++;
            p->slots[i].sent_us = 0;
        }
    }
    if (now >= p->next_us) {
        probe_send(p, HM_DHT_MSG_GET, now);
        /* On schedule, without a burst after the bench's own loop stalled. */
        p->next_us = HM_MAX(p->next_us + PROBE_EVERY_US, now);
    }
}

static void print_probe(const char *what, double *v, size_t n, uint64_t lost)
{
    if (n == 0) {
        printf("  %-20s no replies, %llu lost\n", what, (unsigned long long)lost);
        return;
    }
    qsort(v, n, sizeof(*v), hm_bench_cmp_double);
    printf("  %-20s p50 %8.2f ms  p99 %8.2f ms  max %8.2f ms  (%zu replies, %llu lost)\n", what,
           hm_bench_percentile(v, n, 0.50), hm_bench_percentile(v, n, 0.99), v[n - 1], n,
           (unsigned long long)lost);
}

/* Starts `hivemindctl average` at daemon d, its report to d->dir/round.json. */
static pid_t start_average(const options *o, const daemon_proc *d, const char *key,
                           const char *in)
{
    char out[256], report[256], group[16];
    snprintf(out, sizeof(out), "%s/out.f32", d->dir);
    snprintf(report, sizeof(report), "%s/round.json", d->dir);
    snprintf(group, sizeof(group), "%d", o->round_peers);
    pid_t parent = getpid();
    pid_t pid = hm_bench_fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        int fd = open(report, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0)
            _exit(127);
        dup2(fd, 1);
        dup2(fd, 2);
        unsetenv("HIVEMINDD_CONTROL_SOCKET");
        execl(o->ctl, o->ctl, "-s", d->sock, "--json", "average", key, "--in", in, "--out", out,
              "--target-group-size", group, "--min-group-size", group, "--matchmaking-time", "5",
              "--timeout", "60", "--round-timeout", "120", (char *)NULL);
        _exit(127);
    }
    hm_bench_child_add(pid);
    return pid;
}

/* The all-reduce seconds in d's last round report, or -1. */
static double round_seconds(const daemon_proc *d)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/round.json", d->dir);
    json_error_t jerr;
    json_t *j = json_load_file(path, 0, &jerr);
    json_t *v = json_object_get(json_object_get(j, "result"), "allreduce_s");
    double s = json_is_number(v) ? json_number_value(v) : -1;
    json_decref(j);
    return s;
}

static void bench_round(const options *o)
{
    int n = o->round_peers;
    daemon_proc *nodes = calloc((size_t)n, sizeof(*nodes));
    pid_t *pids = calloc((size_t)n, sizeof(*pids));
    double *ar_s = calloc((size_t)o->runs, sizeof(double));
    char name[16], in[256];
    if (nodes == NULL || pids == NULL || ar_s == NULL)
        hm_bench_die("round", -ENOMEM);
    printf("\n== the DHT during an all-reduce: %d hivemindd processes average %d MiB, %d rounds; "
           "a DHT GET to the first every %u ms ==\n",
           n, o->round_mb, o->runs, PROBE_EVERY_US / 1000);
    printf("daemon options:");
    for (int i = 0; i < o->n_daemon_args; i++)
        printf(" %s", o->daemon_args[i]);
    printf("%s\n", o->n_daemon_args == 0 ? " (defaults)" : "");
    fflush(stdout);

    /* The tensor every peer averages. */
    snprintf(in, sizeof(in), "%s/in.f32", hm_bench_tmpdir());
    size_t elems = (size_t)o->round_mb << 18;
    float *v = malloc(elems * sizeof(float));
    FILE *f = fopen(in, "wb");
    if (v == NULL || f == NULL)
        hm_bench_dief("cannot write the tensor file");
    hm_bench_fill(v, elems, 1);
    int wrote = fwrite(v, sizeof(float), elems, f) == elems;
    if (fclose(f) != 0 || !wrote)
        hm_bench_dief("cannot write the tensor file");
    free(v);

    daemon_start(&nodes[0], o, "a0", -1, NULL);
    for (int i = 1; i < n; i++) {
        const char *extra[] = {"--initial-peers", nodes[0].addr, NULL};
        snprintf(name, sizeof(name), "a%d", i);
        daemon_start(&nodes[i], o, name, -1, extra);
    }

    uv_loop_t loop;
    uv_timer_t tick;
    uint8_t swarm[HM_SWARM_ID_BYTES];
    probe p;
    memset(&p, 0, sizeof(p));
    p.msg = calloc(1, sizeof(*p.msg));
    p.ms[0] = calloc(PROBE_MAX_SAMPLES, sizeof(double));
    p.ms[1] = calloc(PROBE_MAX_SAMPLES, sizeof(double));
    if (p.msg == NULL || p.ms[0] == NULL || p.ms[1] == NULL)
        hm_bench_die("probe", -ENOMEM);
    if (hm_peer_addr_parse(nodes[0].addr, p.server_pk, &p.server) < 0)
        hm_bench_dief("cannot parse the first daemon's address");
    hm_swarm_id(SWARM_NAME, NULL, 0, swarm);
    uv_loop_init(&loop);
    hm_identity_generate(&p.id);
    hm_transport_config tc = {.listen = "127.0.0.1:0", .dgram_peers = 16};
    int r = hm_rpc_new(&loop, &p.id, swarm, &tc, NULL, &p.rpc);
    if (r < 0)
        hm_bench_die("probe rpc", r);
    hm_rpc_register_oneway(p.rpc, HM_RPC_CHANNEL_DHT, on_probe_dgram, &p);
    uv_timer_init(&loop, &tick);
    tick.data = &p;
    uv_timer_start(&tick, on_probe_tick, 1, 1);

    int stop = 0;
    run_loop(&loop, 3000, &stop); /* the joins settle; the probe gets its token */
    if (p.token_len == 0)
        hm_bench_dief("the first daemon never answered the probe's PING");
    p.n[0] = p.n[1] = 0;
    p.lost[0] = p.lost[1] = 0;

    int failed = 0;
    for (int round = 0; round < o->runs; round++) {
        run_loop(&loop, 3000, &stop); /* idle */
        char key[32];
        snprintf(key, sizeof(key), "probe.%d", round);
        for (int i = 0; i < n; i++)
            pids[i] = start_average(o, &nodes[i], key, in);
        p.busy = 1;
        int left = n, ok = 1;
        uint64_t deadline = hm_now_ms() + 200000;
        while (left > 0 && hm_now_ms() < deadline) {
            run_loop(&loop, 5, &stop);
            for (int i = 0; i < n; i++) {
                int st;
                if (pids[i] > 0 && waitpid(pids[i], &st, WNOHANG) == pids[i]) {
                    hm_bench_child_forget(pids[i]);
                    pids[i] = 0;
                    left--;
                    ok &= WIFEXITED(st) && WEXITSTATUS(st) == 0;
                }
            }
        }
        p.busy = 0;
        if (left > 0)
            hm_bench_dief("a round did not end within 200 s");
        ar_s[round] = -1;
        for (int i = 0; i < n; i++)
            ar_s[round] = HM_MAX(ar_s[round], round_seconds(&nodes[i]));
        if (!ok) {
            failed++;
            printf("round %d failed; the reports are in %s/a*/round.json\n", round,
                   hm_bench_tmpdir());
        }
    }
    run_loop(&loop, 1500, &stop); /* the last replies */

    printf("all-reduce of the slowest member, per round (s):");
    for (int i = 0; i < o->runs; i++)
        printf(" %.3f", ar_s[i]);
    printf("%s\n", failed > 0 ? "  (some rounds failed)" : "");
    printf("DHT GET reply time at the first daemon:\n");
    print_probe("no round running:", p.ms[0], p.n[0], p.lost[0]);
    print_probe("during the rounds:", p.ms[1], p.n[1], p.lost[1]);
    if (p.skipped > 0)
        printf("  %llu GETs not sent: %d already in flight\n", (unsigned long long)p.skipped,
               PROBE_WINDOW);
    if (p.n[0] > 0 && p.n[1] > 0) {
        double idle99 = hm_bench_percentile(p.ms[0], p.n[0], 0.99);
        double busy99 = hm_bench_percentile(p.ms[1], p.n[1], 0.99);
        printf("RESULT idle_p99_ms %.2f round_p99_ms %.2f round_max_ms %.2f round_lost %llu "
               "failed_rounds %d\n",
               idle99, busy99, p.ms[1][p.n[1] - 1], (unsigned long long)p.lost[1], failed);
    }
    fflush(stdout);

    uv_timer_stop(&tick);
    uv_close((uv_handle_t *)&tick, NULL);
    int open_rpcs = 1;
    hm_rpc_close(p.rpc, on_node_closed, &open_rpcs);
    while (open_rpcs > 0)
        uv_run(&loop, UV_RUN_ONCE);
    uv_run(&loop, UV_RUN_NOWAIT);
    uv_loop_close(&loop);
    for (int i = 0; i < n; i++)
        daemon_stop(&nodes[i]);
    hm_identity_wipe(&p.id);
    free(p.msg);
    free(p.ms[0]);
    free(p.ms[1]);
    free(ar_s);
    free(pids);
    free(nodes);
}

/* ------------------------------------------------------------ main */

static void usage(void)
{
    fprintf(stderr,
            "usage: bench_dht [--runs R] [--seconds S] [--nodes N] [--ops P]\n"
            "                 [--clients C] [--window W] [--helpers H] [--workers K]\n"
            "                 [--daemon PATH] [--ctl PATH] [--only serve|latency|round]\n"
            "                 [--churn PCT] [--round-peers N] [--round-mb M] [--daemon-arg ARG]\n"
            "  defaults: --runs 5 --seconds 3 --nodes 32 --ops 200 --clients 256 --window 8\n"
            "            --churn 30 (0: no churn phase), --round-peers 4 --round-mb 64\n"
            "            --helpers 64, --workers min(CPUs - 1, 4),\n"
            "            --daemon ./src/hivemindd --ctl ./src/hivemindctl\n"
            "  --only round is never part of the default run; --daemon-arg (up to %d)\n"
            "  goes to every daemon it starts\n",
            MAX_DAEMON_ARGS);
    exit(64);
}

int main(int argc, char **argv)
{
    options o = {.runs = 5, .seconds = 3.0, .nodes = 32, .ops = 200, .clients = 256,
                 .window = 8, .helpers = 64, .daemon = "./src/hivemindd",
                 .ctl = "./src/hivemindctl", .churn = 30, .round_peers = 4, .round_mb = 64};
    const char *only = NULL;
    hm_bench_set_name("bench_dht");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL)
            usage();
        i++;
        if (strcmp(a, "--runs") == 0)
            o.runs = atoi(v);
        else if (strcmp(a, "--seconds") == 0)
            o.seconds = atof(v);
        else if (strcmp(a, "--nodes") == 0)
            o.nodes = atoi(v);
        else if (strcmp(a, "--ops") == 0)
            o.ops = atoi(v);
        else if (strcmp(a, "--clients") == 0)
            o.clients = atoi(v);
        else if (strcmp(a, "--window") == 0)
            o.window = atoi(v);
        else if (strcmp(a, "--helpers") == 0)
            o.helpers = atoi(v);
        else if (strcmp(a, "--workers") == 0)
            o.workers = atoi(v);
        else if (strcmp(a, "--daemon") == 0)
            o.daemon = v;
        else if (strcmp(a, "--ctl") == 0)
            o.ctl = v;
        else if (strcmp(a, "--only") == 0)
            only = v;
        else if (strcmp(a, "--churn") == 0)
            o.churn = atoi(v);
        else if (strcmp(a, "--round-peers") == 0)
            o.round_peers = atoi(v);
        else if (strcmp(a, "--round-mb") == 0)
            o.round_mb = atoi(v);
        else if (strcmp(a, "--daemon-arg") == 0 && o.n_daemon_args < MAX_DAEMON_ARGS)
            o.daemon_args[o.n_daemon_args++] = v;
        else
            usage();
    }
    if (o.runs < 1 || o.runs > 100 || !(o.seconds > 0 && o.seconds <= 600) || o.nodes < 2 ||
        o.nodes > 128 || o.ops < 1 || o.ops > 100000 || o.clients < 1 || o.clients > 4000 ||
        o.window < 1 || o.window > MAX_WINDOW || o.helpers < 0 || o.helpers > 1000 ||
        o.workers < 0 || o.workers > MAX_WORKERS || o.churn < 0 || o.churn > 90 ||
        o.round_peers < 2 || o.round_peers > 64 || o.round_mb < 1 || o.round_mb > 1024)
        usage();
    if (only != NULL && strcmp(only, "serve") == 0)
        o.skip_latency = 1;
    else if (only != NULL && strcmp(only, "latency") == 0)
        o.skip_serve = 1;
    else if (only != NULL && strcmp(only, "round") == 0)
        o.skip_serve = o.skip_latency = o.round = 1;
    else if (only != NULL)
        usage();
    if (access(o.daemon, X_OK) != 0 || access(o.ctl, X_OK) != 0) {
        fprintf(stderr, "bench_dht: %s or %s is not an executable (--daemon, --ctl)\n", o.daemon,
                o.ctl);
        return 1;
    }

    /* Each load client holds a UDP socket and a TCP listener. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    hm_log_set_level(HM_LOG_WARN);
    if (hm_crypto_init() < 0)
        hm_bench_dief("crypto init failed");
    signal(SIGPIPE, SIG_IGN);
    if (hm_bench_tmpdir_make("/tmp/bench_dht-XXXXXX") == NULL)
        hm_bench_die("mkdtemp", -errno);
    hm_bench_children_guard();

    printf("bench_dht: DHT serving rate and swarm latency over real hivemindd processes\n");
    print_machine();
    printf("parameters: --runs %d --seconds %.1f --nodes %d --ops %d --clients %d --window %d "
           "--helpers %d --daemon %s\n",
           o.runs, o.seconds, o.nodes, o.ops, o.clients, o.window, o.helpers, o.daemon);
    fflush(stdout);

    /* The serving bench pins this process; the latency bench runs after it
     * on every CPU again. */
    cpu_set_t all;
    sched_getaffinity(0, sizeof(all), &all);
    if (!o.skip_serve)
        bench_serve(&o);
    sched_setaffinity(0, sizeof(all), &all);
    if (!o.skip_latency)
        bench_latency(&o);
    if (o.round)
        bench_round(&o);
    return 0;
}

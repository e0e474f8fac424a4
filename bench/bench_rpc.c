/*
 * bench_rpc: figures for the transport and rpc layers, between two processes
 * on loopback. A forked server process runs its own loop with an rpc node
 * (methods "echo" and "sink") and a plain libuv TCP sink; the parent is the
 * client. It measures:
 *
 *   1. rpc round-trip latency over datagrams and over streams: N sequential
 *      calls with a small body, p50 and p99 in microseconds;
 *   2. encrypted stream throughput: "sink" calls carrying --size bytes each,
 *      a few in flight, for --seconds; MB/s of bodies acknowledged. The
 *      body is sent uncopied under a hold (hm_rpc_callv), as the all-reduce
 *      sends its parts; --copy sends it with hm_rpc_call, which copies it
 *      into the transport's queue;
 *   3. raw loopback TCP throughput measured the same way (length-prefixed
 *      messages of the same size, a one-byte acknowledgement per message,
 *      the same number in flight, no crypto), and the ratio of 2 to 3,
 *      next to an estimate (a model, not a bound) of its ceiling on this
 *      machine: each end does
 *      what raw TCP does plus one seal (or one open) per byte, at the
 *      cipher's speed measured here in the same run (the record layer in
 *      one thread, as in 4), so the ratio is about at most
 *      1 / (1 + raw / (2 x seal+open rate));
 *   4. with --only records (not in the default set), the record layer
 *      alone in one thread: seal + open per CPU second for each stream
 *      cipher and for version 1's libsodium secretstream, as ratios to it.
 * --cipher makes the client offer only that record cipher.
 *
 * Each measurement runs --runs times (default 5) and the medians are
 * printed. This prints figures; it is not a test and asserts nothing.
 */
#include "config.h"

#include <errno.h>
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

#include "src/base/crypto.h"
#include "src/net/rpc.h"
#include "src/net/transport.h"
#include "src/base/util.h"
#include "bench/bench_common.h"

#define INFLIGHT_MSGS 4

typedef struct options {
    double seconds;
    size_t size;
    int calls;
    int runs;
    const char *only; /* NULL, "latency", "encrypted" or "raw" */
    const char *cipher; /* the client's StreamCipher: auto or one cipher */
    int copy;           /* --copy: bodies copied into the queue, not held */
} options;

/* ------------------------------------------------------------ the server */

typedef struct raw_conn {
    uv_tcp_t tcp;
    uint8_t hdr[4];
    unsigned hdr_have;
    size_t remaining;
    char *rbuf;
} raw_conn;

static void s_echo(void *ud, hm_rpc_req *req, const uint8_t peer[HM_PK_BYTES],
                   const struct sockaddr *from, const uint8_t *body, size_t len)
{
    HM_UNUSED(ud);
    HM_UNUSED(peer);
    HM_UNUSED(from);
    hm_rpc_respond(req, 0, body, len);
}

static void s_sink(void *ud, hm_rpc_req *req, const uint8_t peer[HM_PK_BYTES],
                   const struct sockaddr *from, const uint8_t *body, size_t len)
{
    HM_UNUSED(ud);
    HM_UNUSED(peer);
    HM_UNUSED(from);
    HM_UNUSED(body);
    HM_UNUSED(len);
    hm_rpc_respond(req, 0, NULL, 0);
}

static void raw_alloc(uv_handle_t *h, size_t sz, uv_buf_t *buf)
{
    raw_conn *c = h->data;
    HM_UNUSED(sz);
    buf->base = c->rbuf;
    buf->len = 256 * 1024;
}

static void raw_closed(uv_handle_t *h)
{
    raw_conn *c = h->data;
    free(c->rbuf);
    free(c);
}

static void ack_written(uv_write_t *req, int status)
{
    HM_UNUSED(status);
    free(req);
}

static void raw_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    raw_conn *c = s->data;
    if (n < 0) {
        uv_close((uv_handle_t *)s, raw_closed);
        return;
    }
    const uint8_t *p = (const uint8_t *)buf->base;
    size_t left = (size_t)n;
    unsigned acks = 0;
    while (left > 0) {
        if (c->remaining == 0) {
            while (c->hdr_have < 4 && left > 0) {
                c->hdr[c->hdr_have++] = *p++;
                left--;
            }
            if (c->hdr_have < 4)
                break;
            c->remaining = (size_t)c->hdr[0] << 24 | (size_t)c->hdr[1] << 16 |
                           (size_t)c->hdr[2] << 8 | c->hdr[3];
            c->hdr_have = 0;
            if (c->remaining == 0) {
                acks++;
                continue;
            }
        }
        size_t take = HM_MIN(left, c->remaining);
        c->remaining -= take;
        p += take;
        left -= take;
        if (c->remaining == 0)
            acks++;
    }
    static char ack_bytes[256];
    while (acks > 0) {
        unsigned k = HM_MIN(acks, 256u);
        uv_write_t *w = malloc(sizeof(*w));
        uv_buf_t b = uv_buf_init(ack_bytes, k);
        if (uv_write(w, s, &b, 1, ack_written) < 0)
            free(w);
        acks -= k;
    }
}

static void raw_accept(uv_stream_t *server, int status)
{
    if (status < 0)
        return;
    raw_conn *c = calloc(1, sizeof(*c));
    c->rbuf = malloc(256 * 1024);
    uv_tcp_init(server->loop, &c->tcp);
    c->tcp.data = c;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) < 0) {
        uv_close((uv_handle_t *)&c->tcp, raw_closed);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    uv_read_start((uv_stream_t *)&c->tcp, raw_alloc, raw_read);
}

static void run_server(int fd, const uint8_t swarm[HM_SWARM_ID_BYTES])
{
    uv_loop_t loop;
    hm_identity id;
    hm_rpc *rpc;
    uv_tcp_t raw;
    struct sockaddr_storage addr, raw_addr, any;
    int r;

#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGTERM);
#endif
    uv_loop_init(&loop);
    if ((r = hm_identity_generate(&id)) < 0)
        hm_bench_die("identity", r);
    hm_transport_config tc = {.listen = "127.0.0.1:0"};
    if ((r = hm_rpc_new(&loop, &id, swarm, &tc, NULL, &rpc)) < 0)
        hm_bench_die("server rpc", r);
    hm_rpc_register(rpc, "echo", s_echo, NULL);
    hm_rpc_register(rpc, "sink", s_sink, NULL);
    hm_transport_local_addr(hm_rpc_transport(rpc), &addr);

    hm_parse_hostport("127.0.0.1:0", &any);
    uv_tcp_init(&loop, &raw);
    if ((r = uv_tcp_bind(&raw, (struct sockaddr *)&any, 0)) < 0 ||
        (r = uv_listen((uv_stream_t *)&raw, 16, raw_accept)) < 0)
        hm_bench_die("raw listener", r);
    int alen = sizeof(raw_addr);
    uv_tcp_getsockname(&raw, (struct sockaddr *)&raw_addr, &alen);

    /* Tell the parent who and where we are: public key, rpc port, raw port. */
    char line[256], hex[2 * HM_PK_BYTES + 1];
    hm_hex_encode(id.pk, HM_PK_BYTES, hex);
    int n = snprintf(line, sizeof(line), "%s %u %u\n", hex,
                     ntohs(((struct sockaddr_in *)&addr)->sin_port),
                     ntohs(((struct sockaddr_in *)&raw_addr)->sin_port));
    if (write(fd, line, (size_t)n) != n)
        exit(1);
    close(fd);
    uv_run(&loop, UV_RUN_DEFAULT);
    exit(0);
}

/* ------------------------------------------------------------ the client */

static uv_loop_t loop;

static void on_tick(uv_timer_t *t) { HM_UNUSED(t); }

static void run_while(const int *busy)
{
    uv_timer_t tick;
    uv_timer_init(&loop, &tick);
    uv_timer_start(&tick, on_tick, 50, 50);
    while (*busy)
        uv_run(&loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&tick, NULL);
    uv_run(&loop, UV_RUN_NOWAIT);
}

typedef struct lat_state {
    hm_rpc *rpc;
    const uint8_t *pk;
    const struct sockaddr *to;
    unsigned flags;
    int total, done, busy, failures;
    uint64_t t0;
    uint64_t *samples;
} lat_state;

static void lat_issue(lat_state *s);

static void lat_cb(void *ud, int status, const uint8_t *body, size_t len)
{
    lat_state *s = ud;
    HM_UNUSED(body);
    HM_UNUSED(len);
    uint64_t now = hm_now_us();
    if (status != 0)
        s->failures++;
    s->samples[s->done++] = now - s->t0;
    if (s->done < s->total)
        lat_issue(s);
    else
        s->busy = 0;
}

static void lat_issue(lat_state *s)
{
    static const char body[32] = "0123456789abcdef0123456789abcdef";
    s->t0 = hm_now_us();
    int r = hm_rpc_call(s->rpc, s->pk, s->to, "echo", body, sizeof(body), s->flags, 5000, lat_cb,
                        s, NULL);
    if (r < 0)
        hm_bench_die("latency call", r);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void measure_latency(hm_rpc *rpc, const uint8_t *pk, const struct sockaddr *to,
                            unsigned flags, int calls, double *p50_out, double *p99_out)
{
    lat_state s = {.rpc = rpc, .pk = pk, .to = to, .flags = flags, .total = calls, .busy = 1};
    s.samples = calloc((size_t)calls, sizeof(*s.samples));
    lat_issue(&s);
    run_while(&s.busy);
    if (s.failures > 0)
        fprintf(stderr, "bench_rpc: %d of %d calls failed\n", s.failures, calls);
    qsort(s.samples, (size_t)calls, sizeof(*s.samples), cmp_u64);
    *p50_out = (double)s.samples[calls / 2];
    *p99_out = (double)s.samples[(size_t)((double)calls * 0.99)];
    free(s.samples);
}

typedef struct tput_state {
    hm_rpc *rpc;
    const uint8_t *pk;
    const struct sockaddr *to;
    const uint8_t *body;
    size_t size;
    uint64_t end_us;
    int inflight, busy, stop, failures;
    uint64_t acked;
    int copy;
    hm_tx_ref hold; /* the body is the bench's own for the whole run: never released */
} tput_state;

static void hold_release(hm_tx_ref *ref) { HM_UNUSED(ref); }

static void tput_issue(tput_state *s);

static void tput_cb(void *ud, int status, const uint8_t *body, size_t len)
{
    tput_state *s = ud;
    HM_UNUSED(body);
    HM_UNUSED(len);
    s->inflight--;
    if (status == 0)
        s->acked += s->size;
    else
        s->failures++;
    if (hm_now_us() >= s->end_us)
        s->stop = 1;
    tput_issue(s);
    if (s->stop && s->inflight == 0)
        s->busy = 0;
}

static void tput_issue(tput_state *s)
{
    while (!s->stop && s->inflight < INFLIGHT_MSGS) {
        uv_buf_t b = uv_buf_init((char *)s->body, (unsigned)s->size);
        int r = s->copy ? hm_rpc_call(s->rpc, s->pk, s->to, "sink", s->body, s->size,
                                      HM_RPC_STREAM, 30000, tput_cb, s, NULL)
                        : hm_rpc_callv(s->rpc, s->pk, s->to, "sink", &b, 1, &s->hold, 0,
                                       HM_RPC_STREAM, 30000, tput_cb, s, NULL);
        if (r < 0)
            hm_bench_die("throughput call", r);
        s->inflight++;
    }
}

static double measure_rpc_tput(hm_rpc *rpc, const uint8_t *pk, const struct sockaddr *to,
                               const uint8_t *body, size_t size, double seconds, int copy)
{
    tput_state s = {.rpc = rpc, .pk = pk, .to = to, .body = body, .size = size, .busy = 1,
                    .copy = copy, .hold = {.refs = 1, .release = hold_release}};
    uint64_t t0 = hm_now_us();
    s.end_us = t0 + (uint64_t)(seconds * 1e6);
    tput_issue(&s);
    run_while(&s.busy);
    double el = (double)(hm_now_us() - t0) / 1e6;
    if (s.failures > 0)
        fprintf(stderr, "bench_rpc: %d throughput calls failed\n", s.failures);
    if (s.hold.refs != 1)
        hm_bench_die("the transport kept a hold on the body", -EIO);
    return (double)s.acked / el / 1e6;
}

typedef struct raw_client {
    uv_tcp_t tcp;
    uv_connect_t creq;
    const uint8_t *body;
    size_t size;
    uint8_t hdr[4];
    uint64_t end_us;
    int inflight, busy, stop, connected, closed;
    uint64_t acked;
    char rbuf[4096];
} raw_client;

static void raw_issue(raw_client *c);

static void raw_write_cb(uv_write_t *req, int status)
{
    if (status < 0)
        fprintf(stderr, "bench_rpc: raw write: %s\n", uv_strerror(status));
    free(req);
}

static void raw_c_alloc(uv_handle_t *h, size_t sz, uv_buf_t *buf)
{
    raw_client *c = h->data;
    HM_UNUSED(sz);
    buf->base = c->rbuf;
    buf->len = sizeof(c->rbuf);
}

static void raw_c_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    raw_client *c = s->data;
    HM_UNUSED(buf);
    if (n < 0) {
        c->stop = 1;
        c->busy = 0;
        return;
    }
    for (ssize_t i = 0; i < n; i++) {
        c->inflight--;
        c->acked += c->size;
    }
    if (hm_now_us() >= c->end_us)
        c->stop = 1;
    raw_issue(c);
    if (c->stop && c->inflight == 0)
        c->busy = 0;
}

static void raw_issue(raw_client *c)
{
    while (!c->stop && c->inflight < INFLIGHT_MSGS) {
        uv_write_t *w = malloc(sizeof(*w));
        uv_buf_t b[2] = {uv_buf_init((char *)c->hdr, 4),
                         uv_buf_init((char *)c->body, (unsigned)c->size)};
        if (uv_write(w, (uv_stream_t *)&c->tcp, b, 2, raw_write_cb) < 0)
            hm_bench_die("raw write", -EIO);
        c->inflight++;
    }
}

static void raw_connected(uv_connect_t *req, int status)
{
    raw_client *c = req->data;
    if (status < 0)
        hm_bench_die("raw connect", status);
    c->connected = 1;
}

static void raw_c_closed(uv_handle_t *h) { ((raw_client *)h->data)->closed = 1; }

static double measure_raw_tput(const struct sockaddr *to, const uint8_t *body, size_t size,
                               double seconds)
{
    raw_client *c = calloc(1, sizeof(*c));
    c->body = body;
    c->size = size;
    c->hdr[0] = (uint8_t)(size >> 24);
    c->hdr[1] = (uint8_t)(size >> 16);
    c->hdr[2] = (uint8_t)(size >> 8);
    c->hdr[3] = (uint8_t)size;
    uv_tcp_init(&loop, &c->tcp);
    c->tcp.data = c;
    c->creq.data = c;
    if (uv_tcp_connect(&c->creq, &c->tcp, to, raw_connected) < 0)
        hm_bench_die("raw connect", -EIO);
    while (!c->connected)
        uv_run(&loop, UV_RUN_ONCE);
    uv_tcp_nodelay(&c->tcp, 1);
    uv_read_start((uv_stream_t *)&c->tcp, raw_c_alloc, raw_c_read);
    c->busy = 1;
    uint64_t t0 = hm_now_us();
    c->end_us = t0 + (uint64_t)(seconds * 1e6);
    raw_issue(c);
    run_while(&c->busy);
    double el = (double)(hm_now_us() - t0) / 1e6;
    double mbs = (double)c->acked / el / 1e6;
    uv_close((uv_handle_t *)&c->tcp, raw_c_closed);
    while (!c->closed)
        uv_run(&loop, UV_RUN_ONCE);
    free(c);
    return mbs;
}

static size_t parse_size(const char *s)
{
    char *end;
    double v = strtod(s, &end);
    if (*end == 'k' || *end == 'K')
        v *= 1024;
    else if (*end == 'm' || *end == 'M')
        v *= 1024 * 1024;
    return v > 0 ? (size_t)v : 0;
}

/* ------------------------------------------- the record layer alone */

/*
 * Seals and opens full records (one transport chunk each) in one thread
 * for about `seconds` of CPU time; returns MB/s of plaintext per CPU
 * second, both ends counted (one seal and one open per byte). CPU time,
 * not wall time, so that other load on the machine does not count.
 * cipher 0 is version 1's layer, libsodium secretstream, as the reference.
 */
static double records_rate(int cipher, double seconds)
{
    static uint8_t pt[HM_REC_MAX_PLAIN], rec[HM_REC_MAX_PLAIN + 64], back[HM_REC_MAX_PLAIN];
    const size_t len = HM_TRANSPORT_CHUNK + 9;
    uint64_t bytes = 0, start = hm_bench_cpu_us(), limit = (uint64_t)(seconds * 1e6);
    randombytes_buf(pt, len);
    if (cipher == 0) {
        crypto_secretstream_xchacha20poly1305_state tx, rx;
        uint8_t key[32], header[crypto_secretstream_xchacha20poly1305_HEADERBYTES];
        randombytes_buf(key, sizeof(key));
        crypto_secretstream_xchacha20poly1305_init_push(&tx, header, key);
        crypto_secretstream_xchacha20poly1305_init_pull(&rx, header, key);
        while (hm_bench_cpu_us() - start < limit) {
            for (int i = 0; i < 64; i++) {
                unsigned long long cl = 0, ml = 0;
                unsigned char tag = 0;
                crypto_secretstream_xchacha20poly1305_push(&tx, rec, &cl, pt, len, NULL, 0, 0);
                if (crypto_secretstream_xchacha20poly1305_pull(&rx, back, &ml, &tag, rec, cl,
                                                               NULL, 0) != 0)
                    hm_bench_die("secretstream open", -EBADMSG);
                bytes += len;
            }
        }
    } else {
        hm_session tx, rx;
        memset(&tx, 0, sizeof(tx));
        randombytes_buf(tx.tx.secret, 32);
        tx.cipher = cipher;
        tx.rekey_records = HM_REC_REKEY_RECORDS;
        rx = tx;
        memcpy(rx.rx.secret, tx.tx.secret, 32);
        while (hm_bench_cpu_us() - start < limit) {
            for (int i = 0; i < 64; i++) {
                size_t rl = 0, used = 0, pl = 0;
                if (hm_session_seal(&tx, pt, len, rec, &rl) != 0 ||
                    hm_session_open(&rx, rec, rl, &used, back, &pl) != 1)
                    hm_bench_die("record", -EBADMSG);
                bytes += len;
            }
        }
        hm_session_wipe(&tx);
        hm_session_wipe(&rx);
    }
    double cpu_s = (double)(hm_bench_cpu_us() - start) / 1e6;
    return (double)bytes / 1e6 / cpu_s;
}

static void bench_records(const options *o)
{
    const int ciphers[3] = {0, HM_CIPHER_CHACHA20_POLY1305, HM_CIPHER_AES_256_GCM};
    const char *names[3] = {"secretstream (v1)", "chacha20-poly1305", "aes-256-gcm"};
    double *v[3];
    for (int k = 0; k < 3; k++)
        v[k] = calloc((size_t)o->runs, sizeof(double));
    /* Alternated within each run, so that a slow moment hits all three alike. */
    for (int r = 0; r < o->runs; r++)
        for (int k = 0; k < 3; k++)
            v[k][r] = records_rate(ciphers[k], o->seconds / 3);
    double ref = hm_bench_median(v[0], (size_t)o->runs);
    printf("record layer, one thread, seal + open of %u-byte records, MB/s per CPU second "
           "(medians of %d):\n", HM_TRANSPORT_CHUNK + 9, o->runs);
    for (int k = 0; k < 3; k++) {
        double m = hm_bench_median(v[k], (size_t)o->runs);
        printf("  %-18s %8.1f MB/s  %5.2fx secretstream\n", names[k], m, m / ref);
        free(v[k]);
    }
}

static void usage(void)
{
    fprintf(stderr, "usage: bench_rpc [--seconds S] [--size BYTES[K|M]] [--calls N] [--runs R]\n"
                    "                 [--only latency|encrypted|raw|records]\n"
                    "                 [--cipher auto|aes-256-gcm|chacha20-poly1305] [--copy]\n");
    exit(64);
}

static void on_closed(void *ud) { *(int *)ud = 0; }

int main(int argc, char **argv)
{
    options o = {.seconds = 3.0, .size = 4u << 20, .calls = 20000, .runs = 5};
    hm_bench_set_name("bench_rpc");
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc)
            o.seconds = atof(argv[++i]);
        else if (strcmp(argv[i], "--size") == 0 && i + 1 < argc)
            o.size = parse_size(argv[++i]);
        else if (strcmp(argv[i], "--calls") == 0 && i + 1 < argc)
            o.calls = atoi(argv[++i]);
        else if (strcmp(argv[i], "--runs") == 0 && i + 1 < argc)
            o.runs = atoi(argv[++i]);
        else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc)
            o.only = argv[++i];
        else if (strcmp(argv[i], "--cipher") == 0 && i + 1 < argc)
            o.cipher = argv[++i];
        else if (strcmp(argv[i], "--copy") == 0)
            o.copy = 1;
        else
            usage();
    }
    if (o.seconds <= 0 || o.size == 0 || o.size > (64u << 20) || o.calls < 100 || o.runs < 1)
        usage();
    if (o.only != NULL && strcmp(o.only, "latency") != 0 && strcmp(o.only, "encrypted") != 0 &&
        strcmp(o.only, "raw") != 0 && strcmp(o.only, "records") != 0)
        usage();
    /* The client offers only this cipher; the server (auto) takes it. */
    int cipher = 0;
    if (o.cipher != NULL && strcmp(o.cipher, "auto") != 0 &&
        (cipher = hm_rec_cipher_parse(o.cipher)) < 0)
        usage();
    int do_lat = o.only == NULL || strcmp(o.only, "latency") == 0;
    int do_enc = o.only == NULL || strcmp(o.only, "encrypted") == 0;
    int do_raw = o.only == NULL || strcmp(o.only, "raw") == 0;
    hm_log_set_level(HM_LOG_WARN);
    if (hm_crypto_init() < 0)
        hm_bench_die("crypto init", -EIO);
    if (o.only != NULL && strcmp(o.only, "records") == 0) {
        bench_records(&o);
        return 0;
    }
    uint8_t swarm[HM_SWARM_ID_BYTES];
    hm_swarm_id("bench", NULL, 0, swarm);

    int pfd[2];
    if (pipe(pfd) < 0)
        hm_bench_die("pipe", -errno);
    pid_t pid = fork();
    if (pid < 0)
        hm_bench_die("fork", -errno);
    if (pid == 0) {
        close(pfd[0]);
        run_server(pfd[1], swarm);
    }
    close(pfd[1]);
    char line[256];
    size_t got = 0;
    while (got < sizeof(line) - 1) {
        ssize_t n = read(pfd[0], line + got, sizeof(line) - 1 - got);
        if (n <= 0)
            break;
        got += (size_t)n;
        if (memchr(line, '\n', got) != NULL)
            break;
    }
    line[got] = '\0';
    close(pfd[0]);
    char hex[2 * HM_PK_BYTES + 1];
    unsigned port = 0, raw_port = 0;
    uint8_t server_pk[HM_PK_BYTES];
    if (sscanf(line, "%64s %u %u", hex, &port, &raw_port) != 3 ||
        hm_hex_decode(hex, strlen(hex), server_pk, HM_PK_BYTES) < 0)
        hm_bench_die("server did not start", -EIO);
    char addr_s[64];
    struct sockaddr_storage to, raw_to;
    snprintf(addr_s, sizeof(addr_s), "127.0.0.1:%u", port);
    hm_parse_hostport(addr_s, &to);
    snprintf(addr_s, sizeof(addr_s), "127.0.0.1:%u", raw_port);
    hm_parse_hostport(addr_s, &raw_to);

    uv_loop_init(&loop);
    hm_identity id;
    hm_identity_generate(&id);
    hm_rpc *rpc;
    hm_transport_config tc = {.listen = "127.0.0.1:0", .stream_cipher = cipher};
    int r = hm_rpc_new(&loop, &id, swarm, &tc, NULL, &rpc);
    if (r < 0)
        hm_bench_die("client rpc", r);

    uint8_t pref[HM_HS_CIPHERS_MAX];
    hm_rec_cipher_auto(pref);
    int used_cipher = cipher != 0 ? cipher : pref[0];
    printf("bench_rpc: %d runs, medians; %d sequential calls for latency, %zu-byte messages "
           "(%d in flight, %s) for %.1f s for throughput; stream cipher %s\n",
           o.runs, o.calls, o.size, INFLIGHT_MSGS, o.copy ? "copied" : "held uncopied",
           o.seconds, hm_rec_cipher_name(used_cipher));
    double *a50 = calloc((size_t)o.runs, sizeof(double)), *a99 = calloc((size_t)o.runs, sizeof(double));
    const char *names[2] = {"datagram", "stream"};
    unsigned carriers[2] = {HM_RPC_DGRAM, HM_RPC_STREAM};
    for (int k = 0; k < 2 && do_lat; k++) {
        double w50, w99;
        measure_latency(rpc, server_pk, (struct sockaddr *)&to, carriers[k], 1000, &w50, &w99);
        for (int i = 0; i < o.runs; i++)
            measure_latency(rpc, server_pk, (struct sockaddr *)&to, carriers[k], o.calls, &a50[i],
                            &a99[i]);
        printf("rpc latency over %-8s: p50 %7.1f us   p99 %7.1f us\n", names[k],
               hm_bench_median(a50, o.runs), hm_bench_median(a99, o.runs));
        fflush(stdout);
    }

    uint8_t *body = malloc(o.size);
    randombytes_buf(body, o.size);
    double *enc = calloc((size_t)o.runs, sizeof(double)), *raw = calloc((size_t)o.runs, sizeof(double));
    double *aead = calloc((size_t)o.runs, sizeof(double));
    /* Interleave the three so that machine noise hits them alike. */
    for (int i = 0; i < o.runs && (do_enc || do_raw); i++) {
        if (do_enc)
            enc[i] = measure_rpc_tput(rpc, server_pk, (struct sockaddr *)&to, body, o.size,
                                      o.seconds, o.copy);
        if (do_enc && do_raw)
            aead[i] = records_rate(used_cipher, HM_MIN(o.seconds, 1.0));
        if (do_raw)
            raw[i] = measure_raw_tput((struct sockaddr *)&raw_to, body, o.size, o.seconds);
        if (do_enc && do_raw)
            fprintf(stderr, "  run %d: encrypted %.0f MB/s, raw %.0f MB/s\n", i + 1, enc[i], raw[i]);
        else
            fprintf(stderr, "  run %d: %.0f MB/s\n", i + 1, do_enc ? enc[i] : raw[i]);
    }
    double me = hm_bench_median(enc, o.runs), mr = hm_bench_median(raw, o.runs);
    if (do_enc)
        printf("encrypted stream throughput: %8.1f MB/s\n", me);
    if (do_raw)
        printf("raw loopback TCP throughput: %8.1f MB/s\n", mr);
    if (do_enc && do_raw) {
        double ma = hm_bench_median(aead, o.runs);
        printf("ratio encrypted/raw:         %8.2f (target >= 0.70)\n", mr > 0 ? me / mr : 0.0);
        printf("%s seal + open, one thread: %.1f MB/s per CPU second\n",
               hm_rec_cipher_name(used_cipher), ma);
        printf("ceiling of the ratio here:   %8.2f (raw TCP's work plus one seal or open per "
               "byte at each end)\n",
               ma > 0 ? 1.0 / (1.0 + mr / (2.0 * ma)) : 0.0);
    }

    int busy = 1;
    hm_rpc_close(rpc, on_closed, &busy);
    run_while(&busy);
    uv_loop_close(&loop);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
    free(a50);
    free(a99);
    free(enc);
    free(raw);
    free(aead);
    free(body);
    hm_identity_wipe(&id);
    return 0;
}

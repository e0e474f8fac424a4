/*
 * test_hostile_mem: attack cases 2 and 3 of docs/security.md (reassembly
 * and write queues) against real hivemindd processes on 127.0.0.1, the
 * attacker being this process on 127.0.0.2 and 127.0.0.3 with many
 * identities, speaking the stream protocol by hand (tests/rawstream.h).
 *
 *  - reassembly: over 4 connections per victim, 12 first chunks of 21 bytes
 *    declare 80 + 80 + 16 MiB each (what once filled the whole reassembly
 *    budget), and 16 more identities keep opening messages that declare
 *    80 MiB and never continue, while two honest daemons run `average` on
 *    a vector whose parts take many chunks: the average succeeds, and its
 *    result is exactly the weighted average of the two inputs.
 *  - write queues: 16 identities send moe.fwd with 4096x16 inputs to a
 *    daemon hosting the expert and never read the replies, except 1 MiB
 *    every 8 s each (which once dodged the write-stall timer): the victim's
 *    resident memory grows by less than 64 MiB while the attack runs, an
 *    honest call of the same expert through another daemon returns within
 *    its timeout during the attack, and the memory comes back afterwards.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <string.h>

#include "moe/proto.h"
#include "src/base/wire.h"
#include "tests/hostile.h"
#include "tests/proc.h"
#include "tests/rawstream.h"

static void setup(void) { hm_proc_setup("hmem"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(hostile_mem, .init = setup, .fini = teardown, .timeout = 120);

static uint8_t swarm[HM_SWARM_ID_BYTES];

static void parse_peer(const struct node *n, uint8_t pk[HM_PK_BYTES], struct sockaddr_storage *sa)
{
    const char *at = strchr(n->addr, '@');
    cr_assert_not_null(at, "address %s", n->addr);
    cr_assert_eq(hm_base32_decode(n->addr, (size_t)(at - n->addr), pk, HM_PK_BYTES), HM_PK_BYTES);
    cr_assert_eq(hm_parse_hostport(at + 1, sa), 0);
}

static void raw_to_buf(hm_raw *r, const char *ip, const struct node *victim, int rcvbuf)
{
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage sa;
    parse_peer(victim, pk, &sa);
    int rc = hm_raw_connect(r, ip, (struct sockaddr *)&sa, pk, swarm, rcvbuf, NULL, NULL);
    cr_assert_eq(rc, 0, "attacker handshake from %s: %s", ip, hm_strerror(rc));
}

static void raw_to(hm_raw *r, const char *ip, const struct node *victim)
{
    raw_to_buf(r, ip, victim, 0);
}

static uint64_t limit_refused(struct node *n, const char *keyword)
{
    char *out, *err, pat[128];
    cr_assert_eq(ctl(n->sock, "metrics", 0, &out, &err), 0, "metrics: %s", err);
    snprintf(pat, sizeof(pat), "hivemindd_limit_refused_total{limit=\"%s\"} ", keyword);
    char *p = strstr(out, pat);
    unsigned long long v = p != NULL ? strtoull(p + strlen(pat), NULL, 10) : 0;
    free(out);
    free(err);
    return v;
}

/* ------------------------------------------------------------ reassembly */

#define AVG_ELEMS 200000

typedef struct flooder {
    hm_raw r;
    uint32_t next_id;
    int open;
} flooder;

Test(hostile_mem, reassembly_flood_leaves_average_exact)
{
    struct node d[2];
    hm_swarm_id("default", NULL, 0, swarm);
    start_node(&d[0], "d0", NULL, NULL);
    start_node(&d[1], "d1", NULL, "--initial-peers", d[0].addr, NULL);
    long deadline = hm_test_now_ms() + 20000;
    while ((node_rt_size(&d[0]) < 1 || node_rt_size(&d[1]) < 1) && hm_test_now_ms() < deadline)
        usleep(200000);
    cr_assert(node_rt_size(&d[0]) >= 1 && node_rt_size(&d[1]) >= 1, "the daemons know each other");

    /* The attack of the issue, against both: 4 connections from 127.0.0.2,
     * each with 3 messages declaring 80 + 80 + 16 MiB and sending 21 bytes. */
    hm_raw fixed[2][4];
    const uint32_t sizes[3] = {80u << 20, 80u << 20, 16u << 20};
    for (int v = 0; v < 2; v++)
        for (int i = 0; i < 4; i++) {
            raw_to(&fixed[v][i], "127.0.0.2", &d[v]);
            for (uint32_t k = 0; k < 3; k++)
                cr_assert_eq(hm_raw_part(&fixed[v][i], k, sizes[k], 0, 21), 0);
        }
    /* 16 more identities from 127.0.0.3 keep opening messages while the average runs. */
    flooder fl[16];
    for (int i = 0; i < 16; i++) {
        raw_to(&fl[i].r, "127.0.0.3", &d[i % 2]);
        fl[i].next_id = 0;
        fl[i].open = 1;
    }

    /* Two honest inputs, weights 1 and 3; each part is about 400 kB, 25 chunks. */
    static float x[2][AVG_ELEMS];
    const double w[2] = {1.0, 3.0};
    char in[2][128], outp[2][128], aout[2][160], aerr[2][160];
    pid_t jobs[2];
    for (int i = 0; i < 2; i++) {
        for (size_t k = 0; k < AVG_ELEMS; k++)
            x[i][k] = (float)(sin((double)k * 0.001 * (i + 1)) * 3.0 + i);
        snprintf(in[i], sizeof(in[i]), "%s/in%d", tmpdir, i);
        snprintf(outp[i], sizeof(outp[i]), "%s/out%d", tmpdir, i);
        cr_assert_eq(hm_test_write_file(in[i], x[i], sizeof(x[i]), 0600), 0);
    }
    for (int i = 0; i < 2; i++) {
        char wbuf[32];
        snprintf(wbuf, sizeof(wbuf), "%g", w[i]);
        char *argv[] = {bin_ctl, "-s", d[i].sock, "--json", "average", "hostile.mem", "--in",
                        in[i], "--out", outp[i], "--weight", wbuf, "--target-group-size", "2",
                        "--min-group-size", "2", "--timeout", "30", "--round-timeout", "10",
                        "--matchmaking-time", "3", NULL};
        snprintf(aout[i], sizeof(aout[i]), "%s/avg%d.out", tmpdir, i);
        snprintf(aerr[i], sizeof(aerr[i]), "%s/avg%d.err", tmpdir, i);
        jobs[i] = spawn(bin_ctl, argv, aout[i], aerr[i], NULL);
    }

    /* The flood goes on until both averages are done. */
    int status[2] = {-1, -1}, done = 0;
    uint64_t opened = 0;
    deadline = hm_test_now_ms() + 45000;
    while (done < 2 && hm_test_now_ms() < deadline) {
        for (int i = 0; i < 16; i++) {
            if (!fl[i].open)
                continue;
            if (hm_raw_part(&fl[i].r, fl[i].next_id++, 80u << 20, 0, 21) < 0)
                fl[i].open = 0; /* its 256 slots are full: the victim closed it */
            else
                opened++;
        }
        for (int i = 0; i < 2; i++) {
            int st;
            if (status[i] == -1 && waitpid(jobs[i], &st, WNOHANG) == jobs[i]) {
                forget_child(jobs[i]);
                status[i] = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
                done++;
            }
        }
        usleep(20000);
    }
    cr_assert_eq(done, 2, "the averages did not finish");
    for (int i = 0; i < 2; i++) {
        char *o = slurp(aout[i]), *e = slurp(aerr[i]);
        cr_assert_eq(status[i], 0, "daemon %d: average failed under the flood: %s %s", i, o, e);
        free(o);
        free(e);
    }
    cr_assert_geq(opened, 16, "the flood ran (%llu messages opened)", (unsigned long long)opened);
    /* The exact honest result on both. */
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(outp[i], "rb");
        cr_assert_not_null(f);
        static float got[AVG_ELEMS + 1];
        cr_assert_eq(fread(got, sizeof(float), AVG_ELEMS + 1, f), AVG_ELEMS);
        fclose(f);
        for (size_t k = 0; k < AVG_ELEMS; k++) {
            double e = (w[0] * x[0][k] + w[1] * x[1][k]) / (w[0] + w[1]);
            if (fabs(got[k] - e) > 1e-6 * fabs(e) + 1e-7)
                cr_assert_fail("daemon %d element %zu: %.9g, expected %.9g", i, k,
                               (double)got[k], e);
        }
    }
    /* The attacker's connections were kept: they cost the bytes they sent. */
    for (int v = 0; v < 2; v++)
        for (int i = 0; i < 4; i++)
            cr_assert_eq(hm_raw_chunk(&fixed[v][i], 99, 3, 1, "x", 1), 0);
    for (int v = 0; v < 2; v++)
        for (int i = 0; i < 4; i++)
            hm_raw_close(&fixed[v][i]);
    for (int i = 0; i < 16; i++)
        hm_raw_close(&fl[i].r);
    stop_node(&d[1]);
    stop_node(&d[0]);
}

/* ------------------------------------------------------------ write queues */

#define DIM 16
#define FWD_BATCH 4096
#define N_ATTACKERS 16

/* A non-reading moe.fwd client: one sealed request at a time, sent as the socket allows. */
typedef struct sink {
    hm_raw r;
    uint8_t *out;
    size_t out_len, out_off;
    uint32_t next_id;
    uint64_t last_read_ms;
    uint64_t next_send_ms;
    int open;
} sink;

/* The rpc envelope of a request (src/net/rpc.c): [0, id, method, timeout_ms, bin body]. */
static uint8_t *fwd_request(uint64_t id, const uint8_t *body, size_t blen, size_t *len)
{
    hm_wire_wr w;
    hm_wire_wr_init_dynamic(&w, blen + 256);
    hm_wire_wr_array(&w, 5);
    hm_wire_wr_uint(&w, 0);
    hm_wire_wr_uint(&w, id);
    hm_wire_wr_cstr(&w, "moe.fwd");
    hm_wire_wr_uint(&w, 60000);
    hm_wire_wr_bin(&w, body, blen);
    uint8_t *p = hm_wire_wr_steal(&w, len);
    cr_assert_not_null(p);
    return p;
}

/* Seals one whole message into s->out as records of the transport's framing. */
static void sink_seal(sink *s, const uint8_t *msg, size_t len)
{
    size_t recs = len / 16000 + 1;
    s->out = realloc(s->out, recs * (HM_REC_MAX_PLAIN + HM_REC_OVERHEAD));
    cr_assert_not_null(s->out);
    s->out_len = s->out_off = 0;
    uint8_t pt[HM_REC_MAX_PLAIN];
    uint32_t id = s->next_id++;
    for (size_t off = 0; off < len;) {
        size_t n = HM_MIN(len - off, (size_t)16000);
        size_t hdr = off == 0 ? 9 : 5;
        hm_put_be32(pt, id);
        pt[4] = (uint8_t)((off == 0 ? 1 : 0) | (off + n == len ? 2 : 0));
        if (off == 0)
            hm_put_be32(pt + 5, (uint32_t)len);
        memcpy(pt + hdr, msg + off, n);
        size_t sl = 0;
        cr_assert_eq(hm_session_seal(&s->r.sess, pt, hdr + n, s->out + s->out_len, &sl), 0);
        s->out_len += sl;
        off += n;
    }
}

/* Reads up to max bytes the victim sent, without looking at them. */
static void sink_read(sink *s, size_t max)
{
    static uint8_t junk[64 * 1024];
    size_t got = 0;
    while (got < max) {
        ssize_t n = recv(s->r.fd, junk, HM_MIN(sizeof(junk), max - got), MSG_DONTWAIT);
        if (n == 0) {
            s->open = 0;
            return;
        }
        if (n < 0)
            return;
        got += (size_t)n;
    }
}

/*
 * Sends the current request as far as the socket takes it, and a new one
 * every SEND_EVERY_MS: the flood is paced so that the expert itself keeps
 * up (its queue is another limit's business) and what piles up is replies.
 */
#define SEND_EVERY_MS 200

static void sink_pump(sink *s, const uint8_t *body, size_t blen, uint64_t *sent)
{
    if (!s->open)
        return;
    for (;;) {
        if (s->out_off == s->out_len) {
            uint64_t now = hm_now_ms();
            if (now < s->next_send_ms)
                return;
            s->next_send_ms = now + SEND_EVERY_MS;
            size_t len;
            uint8_t *msg = fwd_request(s->next_id, body, blen, &len);
            sink_seal(s, msg, len);
            free(msg);
        }
        ssize_t n = send(s->r.fd, s->out + s->out_off, s->out_len - s->out_off,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                s->open = 0;
            return;
        }
        s->out_off += (size_t)n;
        if (s->out_off == s->out_len)
            (*sent)++;
        else
            return;
    }
}

static void fill(float *x, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        x[i] = (float)((seed >> 8) & 0xffff) / 65536.0f - 0.5f;
    }
}

#if defined(__SANITIZE_ADDRESS__)
#define HM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HM_ASAN 1
#endif
#endif

/*
 * The victim's environment. Under AddressSanitizer freed memory sits in a
 * quarantine (256 MiB by default) and is handed back to the system only
 * now and then, which would measure the sanitizer rather than the daemon;
 * the victim runs with neither, its other options kept.
 */
static const char *victim_env(void)
{
#ifdef HM_ASAN
    static char env[1024];
    const char *old = getenv("ASAN_OPTIONS");
    snprintf(env, sizeof(env), "ASAN_OPTIONS=%s%squarantine_size_mb=0:"
             "thread_local_quarantine_size_kb=0:allocator_release_to_os_interval_ms=100",
             old != NULL ? old : "", old != NULL && old[0] != '\0' ? ":" : "");
    return env;
#else
    return NULL;
#endif
}

Test(hostile_mem, non_reading_expert_flood_keeps_memory_bounded)
{
    struct node host, tr;
    hm_swarm_id("default", NULL, 0, swarm);
    start_node(&host, "host", victim_env(), "--host-experts", "ffn.0.[0:1]", "--expert-dim", "16",
               "--expert-max-batch", "4096", "--expert-hidden", "4", NULL);
    start_node(&tr, "trainer", NULL, "--initial-peers", host.addr, NULL);

    char in[192], outp[192];
    float x[5 * DIM];
    fill(x, 5 * DIM, 7);
    snprintf(in, sizeof(in), "%s/x.f32", tmpdir);
    snprintf(outp, sizeof(outp), "%s/y.f32", tmpdir);
    cr_assert_eq(hm_test_write_file(in, x, sizeof(x), 0600), 0);
    char *argv[] = {bin_ctl, "-s", tr.sock, "experts", "call", "ffn.0.0", "--in", in,
                    "--out", outp, "--timeout", "10", NULL};
    /* The declaration takes a moment to reach the trainer's DHT. */
    int r = -1;
    char *out = NULL, *err = NULL;
    long deadline = hm_test_now_ms() + 30000;
    do {
        free(out);
        free(err);
        r = run_prog(bin_ctl, argv, &out, &err);
        if (r != 0)
            usleep(300000);
    } while (r != 0 && hm_test_now_ms() < deadline);
    cr_assert_eq(r, 0, "experts call before the attack: %s", err);
    free(out);
    free(err);

    /* The request: moe.fwd of ffn.0.0 with a 4096x16 input (a 256 KiB reply). */
    static float big[FWD_BATCH * DIM];
    fill(big, FWD_BATCH * DIM, 11);
    hm_wire_wr bw;
    hm_wire_wr_init_dynamic(&bw, sizeof(big) + 1024);
    hm_moe_encode_fwd(&bw, "ffn.0.0", big, FWD_BATCH, DIM);
    size_t blen;
    uint8_t *body = hm_wire_wr_steal(&bw, &blen);
    cr_assert_not_null(body);

    usleep(500000);
    long base = hm_hostile_rss_kib(host.pid);
    cr_assert_gt(base, 0);

    sink s[N_ATTACKERS];
    memset(s, 0, sizeof(s));
    for (int i = 0; i < N_ATTACKERS; i++) {
        raw_to_buf(&s[i].r, "127.0.0.2", &host, 4096);
        s[i].open = 1;
        s[i].last_read_ms = hm_test_now_ms();
    }

    uint64_t sent = 0;
    long peak = base;
    long start = hm_test_now_ms();
    const long attack_ms = 16000;
    pid_t honest = -1;
    int honest_status = -1;
    long honest_started = 0, honest_ms = -1;
    char hout[160], herr[160];
    snprintf(hout, sizeof(hout), "%s/honest.out", tmpdir);
    snprintf(herr, sizeof(herr), "%s/honest.err", tmpdir);
    while (hm_test_now_ms() - start < attack_ms) {
        long now = hm_test_now_ms();
        for (int i = 0; i < N_ATTACKERS; i++) {
            sink_pump(&s[i], body, blen, &sent);
            /* 1 MiB every 8 s: some progress, never enough to drain. */
            if (s[i].open && now - (long)s[i].last_read_ms >= 8000) {
                sink_read(&s[i], 1u << 20);
                s[i].last_read_ms = (uint64_t)now;
            }
            /* A connection the victim closed is opened again under a new identity. */
            if (!s[i].open) {
                hm_raw_close(&s[i].r);
                free(s[i].out);
                memset(&s[i], 0, sizeof(s[i]));
                raw_to_buf(&s[i].r, "127.0.0.2", &host, 4096);
                s[i].open = 1;
                s[i].last_read_ms = (uint64_t)now;
            }
        }
        long rss = hm_hostile_rss_kib(host.pid);
        if (rss > peak)
            peak = rss;
        /* Halfway through, an honest call through the trainer's daemon. */
        if (honest < 0 && now - start >= attack_ms / 2) {
            honest = spawn(bin_ctl, argv, hout, herr, NULL);
            honest_started = now;
        }
        int st;
        if (honest > 0 && honest_status == -1 && waitpid(honest, &st, WNOHANG) == honest) {
            forget_child(honest);
            honest_status = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
            honest_ms = now - honest_started;
        }
        usleep(2000);
    }
    if (honest > 0 && honest_status == -1) {
        int st = wait_exit(honest, 15000);
        cr_assert(st != -1, "the honest call did not finish");
        honest_status = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
        honest_ms = hm_test_now_ms() - honest_started;
    }
    cr_log_info("victim RSS %ld KiB before, peak %ld KiB during; %llu requests sent; honest call "
                "%ld ms", base, peak, (unsigned long long)sent, honest_ms);
    cr_assert_gt(sent, 200, "the flood ran (%llu requests)", (unsigned long long)sent);
    {
        char *e = slurp(herr);
        cr_assert_eq(honest_status, 0, "the honest call failed during the attack: %s", e);
        free(e);
    }
    cr_assert_lt(honest_ms, 10000 + 2000, "the honest call took %ld ms", honest_ms);
    cr_assert_lt(peak - base, 64 * 1024, "victim RSS grew by %ld KiB (from %ld) under the flood",
                 peak - base, base);
    uint64_t by_origin = limit_refused(&host, "WriteQueueOriginMiB"),
             by_rate = limit_refused(&host, "WriteMinRate"),
             by_total = limit_refused(&host, "WriteQueueMaxMiB");
    cr_log_info("refused: WriteQueueOriginMiB %llu, WriteMinRate %llu, WriteQueueMaxMiB %llu",
                (unsigned long long)by_origin, (unsigned long long)by_rate,
                (unsigned long long)by_total);
    uint64_t refused = by_origin + by_rate + by_total;
    cr_assert_gt(refused, 0, "the write-queue limits refused nothing");

    /* The attack ends; the memory comes back. */
    for (int i = 0; i < N_ATTACKERS; i++) {
        hm_raw_close(&s[i].r);
        free(s[i].out);
    }
    long after = peak;
    deadline = hm_test_now_ms() + 15000;
    while (hm_test_now_ms() < deadline) {
        after = hm_hostile_rss_kib(host.pid);
        if (after < base + 16 * 1024)
            break;
        usleep(200000);
    }
    cr_log_info("victim RSS %ld KiB after the attack", after);
    cr_assert_lt(after, base + 16 * 1024, "RSS %ld KiB after the attack, %ld before", after, base);
    free(body);
    stop_node(&tr);
    stop_node(&host);
}

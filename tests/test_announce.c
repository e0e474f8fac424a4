/*
 * test_announce: the address a daemon declares and the dial-back check
 * (src/node/reach.h), on real daemons over loopback:
 *  - --announce is what expert records carry;
 *  - a daemon listening on 0.0.0.0 is declared at the 127.0.0.1 address
 *    two peers of different origins observe and one dials back, never at
 *    0.0.0.0, and its expert is called there from another daemon;
 *  - the dial-back rpc dials only the asker's own host, one at a time per
 *    origin, and counts what it refused;
 *  - a daemon announcing a port nobody listens on ends up unreachable and
 *    in client mode, with the reason in info.
 * Peers sit on 127.0.0.2 and 127.0.0.3, which are origins of their own.
 */
#include "config.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "tests/proc.h"
#include "tests/loop.h"
#include "src/base/wire.h"

static void setup(void) { hm_proc_setup("announce"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(announce, .init = setup, .fini = teardown, .timeout = 180);

static json_t *info(struct node *n)
{
    int rc;
    json_t *j = ctl_json(n, &rc, "info", NULL);
    if (j == NULL)
        return NULL;
    json_t *r = json_incref(json_object_get(j, "result"));
    json_decref(j);
    return r;
}

static const char *jstr(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    return json_is_string(v) ? json_string_value(v) : "";
}

/* Polls info until field k is the string want (or, want NULL, until it is a JSON true). */
static json_t *wait_info(struct node *n, const char *k, const char *want, int timeout_ms)
{
    long deadline = hm_test_now_ms() + timeout_ms;
    json_t *j = NULL;
    do {
        json_decref(j);
        j = info(n);
        if (j != NULL) {
            json_t *v = json_object_get(j, k);
            if (want != NULL ? (json_is_string(v) && strcmp(json_string_value(v), want) == 0)
                             : json_is_true(v))
                return j;
        }
        usleep(200000);
    } while (hm_test_now_ms() < deadline);
    return j;
}

/* PEERID@LISTEN of a daemon: where it listens, whatever it declares. */
static void listen_addr(struct node *n, char *buf, size_t len)
{
    json_t *j = info(n);
    cr_assert_not_null(j);
    snprintf(buf, len, "%s@%s", n->id, jstr(j, "listen"));
    json_decref(j);
}

/* The port of an address HOST:PORT. */
static int addr_port(const char *a)
{
    const char *c = strrchr(a, ':');
    return c != NULL ? atoi(c + 1) : -1;
}

/* The hosts the swarm declares for experts under prefix, seen from n (polled until one shows). */
static char *expert_host(struct node *n, const char *prefix, int timeout_ms)
{
    long deadline = hm_test_now_ms() + timeout_ms;
    do {
        int rc;
        json_t *j = ctl_json(n, &rc, "experts", "list", prefix, NULL);
        json_t *sw = json_object_get(json_object_get(j, "result"), "swarm");
        if (json_array_size(sw) > 0) {
            char *h = strdup(jstr(json_array_get(sw, 0), "host"));
            json_decref(j);
            return h;
        }
        json_decref(j);
        usleep(300000);
    } while (hm_test_now_ms() < deadline);
    return NULL;
}

Test(announce, configured_address_is_what_records_carry)
{
    struct node a, b;
    start_node(&a, "a", NULL, "--announce", "127.0.0.5:4567", "--host-experts", "ffn.0.0",
               "--expert-dim", "8", NULL);
    char boot[256];
    listen_addr(&a, boot, sizeof(boot));
    start_node(&b, "b", NULL, "--listen", "127.0.0.2:0", "--initial-peers", boot, NULL);
    json_t *j = wait_info(&a, "announce", "127.0.0.5:4567", 10000);
    cr_assert_str_eq(jstr(j, "announce"), "127.0.0.5:4567");
    cr_assert_str_eq(jstr(j, "announce_source"), "config");
    json_decref(j);
    /* The printed address is the declared one, too. */
    cr_assert(strstr(a.addr, "@127.0.0.5:4567") != NULL, "%s", a.addr);

    char *h = expert_host(&b, "ffn", 30000);
    cr_assert_not_null(h, "no expert record reached b");
    char want[128];
    snprintf(want, sizeof(want), "%s@127.0.0.5:4567", a.id);
    cr_assert_str_eq(h, want);
    free(h);
    stop_node(&b);
    stop_node(&a);
}

Test(announce, bad_announce_is_a_config_error)
{
    char *out, *err, conf[128];
    /* On the command line a usage error, in a file a config error. */
    char *argv[] = {bin_daemon, "--announce", "0.0.0.0:31400", "-t", NULL};
    int rc = run_prog(bin_daemon, argv, &out, &err);
    cr_assert_eq(rc, 64, "exit %d: %s", rc, err);
    cr_assert(strstr(err, "dialable") != NULL, "%s", err);
    free(out);
    free(err);
    snprintf(conf, sizeof(conf), "%s/bad.conf", tmpdir);
    const char text[] = "Announce [::]:31400\n";
    cr_assert_eq(hm_test_write_file(conf, text, strlen(text), 0600), 0);
    char *argv2[] = {bin_daemon, "-c", conf, "-t", NULL};
    rc = run_prog(bin_daemon, argv2, &out, &err);
    cr_assert_eq(rc, 78, "exit %d: %s", rc, err);
    cr_assert(strstr(err, "dialable") != NULL, "%s", err);
    free(out);
    free(err);
}

Test(announce, wildcard_listener_is_declared_at_a_dialable_address)
{
    struct node a, b, c;
    start_node(&a, "a", NULL, "--listen", "0.0.0.0:0", "--host-experts", "ffn.0.0",
               "--expert-dim", "8", NULL);
    char boot[256], want[64];
    listen_addr(&a, boot, sizeof(boot));
    cr_assert(strstr(boot, "@0.0.0.0:") != NULL, "%s", boot);
    int port = addr_port(boot);
    snprintf(boot, sizeof(boot), "%s@127.0.0.1:%d", a.id, port);
    snprintf(want, sizeof(want), "127.0.0.1:%d", port);
    /* Alone, it knows no address to declare, and says so. */
    json_t *j = info(&a);
    cr_assert_not_null(j);
    cr_assert(json_is_null(json_object_get(j, "announce")), "declared %s alone",
              jstr(j, "announce"));
    cr_assert(strstr(jstr(j, "reach_reason"), "0.0.0.0") != NULL, "%s", jstr(j, "reach_reason"));
    json_decref(j);

    start_node(&b, "b", NULL, "--listen", "127.0.0.2:0", "--initial-peers", boot, NULL);
    start_node(&c, "c", NULL, "--listen", "127.0.0.3:0", "--initial-peers", boot, NULL);
    j = wait_info(&a, "reachable", NULL, 60000);
    cr_assert(json_is_true(json_object_get(j, "reachable")), "not confirmed: %s",
              jstr(j, "reach_reason"));
    cr_assert_str_eq(jstr(j, "announce"), want);
    cr_assert_str_eq(jstr(j, "announce_source"), "observed");
    cr_assert(json_is_false(json_object_get(j, "client_mode")));
    json_decref(j);

    /* The expert record carries that address, and c calls the expert there. */
    char *h = expert_host(&c, "ffn", 30000);
    cr_assert_not_null(h, "no expert record reached c");
    cr_assert(strstr(h, "0.0.0.0") == NULL, "declared %s", h);
    char full[128];
    snprintf(full, sizeof(full), "%s@%s", a.id, want);
    cr_assert_str_eq(h, full);
    free(h);

    char in[192], outp[192], *out = NULL, *err = NULL;
    float x[2 * 8];
    for (int i = 0; i < 16; i++)
        x[i] = (float)i / 16.0f;
    snprintf(in, sizeof(in), "%s/x.f32", tmpdir);
    snprintf(outp, sizeof(outp), "%s/y.f32", tmpdir);
    cr_assert_eq(hm_test_write_file(in, x, sizeof(x), 0600), 0);
    char *argv[] = {bin_ctl, "-s", c.sock, "experts", "call", "ffn.0.0", "--in", in,
                    "--out", outp, "--timeout", "10", NULL};
    int r = -1;
    long deadline = hm_test_now_ms() + 30000;
    do {
        free(out);
        free(err);
        r = run_prog(bin_ctl, argv, &out, &err);
        if (r != 0)
            usleep(300000);
    } while (r != 0 && hm_test_now_ms() < deadline);
    cr_assert_eq(r, 0, "experts call: %s", err);
    free(out);
    free(err);
    struct stat st;
    cr_assert_eq(stat(outp, &st), 0);
    cr_assert_eq(st.st_size, (off_t)sizeof(x));
    stop_node(&c);
    stop_node(&b);
    stop_node(&a);
}

/* ---- the dial-back rpc, asked by an in-process node on 127.0.0.2 ---- */

typedef struct ask {
    int done, status, reached, error;
} ask;

static void on_ask(void *ud, int status, const uint8_t *body, size_t len)
{
    ask *a = ud;
    a->status = status;
    if (status == 0 && hm_reach_parse_reply(body, len, &a->reached, &a->error) != 0)
        a->status = -EPROTO;
    a->done = 1;
}

static int ask_done(void *ud) { return ((ask *)ud)->done; }

static void send_ask(hm_node *me, const uint8_t pk[HM_PK_BYTES], const struct sockaddr *to,
                     const char *addr, ask *a)
{
    uint8_t buf[96];
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_map(&w, 1);
    hm_wire_wr_cstr(&w, "addr");
    hm_wire_wr_cstr(&w, addr);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    memset(a, 0, sizeof(*a));
    cr_assert_eq(hm_rpc_call(hm_node_rpc(me), pk, to, HM_REACH_METHOD, w.buf, w.len, HM_RPC_DGRAM,
                             12000, on_ask, a, NULL),
                 0);
}

static long limit_refused(struct node *n, const char *keyword)
{
    char *out, *err, pat[128];
    long v = -1;
    int rc = ctl(n->sock, "metrics", 0, &out, &err);
    snprintf(pat, sizeof(pat), "hivemindd_limit_refused_total{limit=\"%s\"} ", keyword);
    char *p = rc == 0 ? strstr(out, pat) : NULL;
    if (p != NULL)
        v = atol(p + strlen(pat));
    free(out);
    free(err);
    return v;
}

Test(announce, dialback_dials_only_the_askers_host)
{
    struct node a;
    start_node(&a, "a", NULL, NULL);
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage to;
    cr_assert_eq(hm_peer_addr_parse(a.addr, pk, &to), 0);

    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_node_options o = {0};
    o.listen = "127.0.0.2:0";
    o.ping_interval_ms = 100000;
    hm_node *me;
    char e[256];
    cr_assert_eq(hm_node_new(&loop, &o, &me, e, sizeof(e)), 0, "%s", e);
    struct sockaddr_storage mine;
    cr_assert_eq(hm_transport_local_addr(hm_rpc_transport(hm_node_rpc(me)), &mine), 0);
    char own[64], third[] = "127.0.0.9:4000";
    cr_assert_eq(hm_format_addr((const struct sockaddr *)&mine, own, sizeof(own)), 0);

    /* Another host: refused, and counted. */
    ask x;
    send_ask(me, pk, (const struct sockaddr *)&to, third, &x);
    cr_assert(hm_test_run_until(&loop, ask_done, &x, 15000));
    cr_assert_eq(x.status, -EPERM, "a dial to %s was not refused: %d", third, x.status);
    cr_assert_eq(limit_refused(&a, "DialbackOtherHost"), 1);

    /* Our own address, before we answered a ping of a there:
     * refused too (a datagram's source IP proves nothing by itself). */
    send_ask(me, pk, (const struct sockaddr *)&to, own, &x);
    cr_assert(hm_test_run_until(&loop, ask_done, &x, 15000));
    cr_assert_eq(x.status, -EPERM, "dialled back a peer it never verified: %d", x.status);
    cr_assert_eq(limit_refused(&a, "DialbackOtherHost"), 2);

    /* Once a has pinged us and we answered: dialled, and the handshake worked. */
    cr_assert_eq(hm_node_add_peer(me, a.addr), 0);
    long until = hm_test_now_ms() + 30000;
    do {
        send_ask(me, pk, (const struct sockaddr *)&to, own, &x);
        cr_assert(hm_test_run_until(&loop, ask_done, &x, 15000));
        if (x.status == -EPERM) {
            ask idle = {0};
            hm_test_run_until(&loop, ask_done, &idle, 300);
        }
    } while (x.status == -EPERM && hm_test_now_ms() < until);
    cr_assert_eq(x.status, 0, "%d", x.status);
    cr_assert(x.reached, "a could not dial us back at %s: %d", own, x.error);

    /* Our host, a port nobody listens on (bound, never listening: a reset). */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sin = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.2", &sin.sin_addr);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sin, sizeof(sin)), 0);
    socklen_t sl = sizeof(sin);
    getsockname(fd, (struct sockaddr *)&sin, &sl);
    char dead[64];
    snprintf(dead, sizeof(dead), "127.0.0.2:%d", ntohs(sin.sin_port));
    send_ask(me, pk, (const struct sockaddr *)&to, dead, &x);
    cr_assert(hm_test_run_until(&loop, ask_done, &x, 15000));
    cr_assert_eq(x.status, 0, "%d", x.status);
    cr_assert(!x.reached, "a reached %s, where nobody listens", dead);

    /* Past the burst (3, at 6 a minute), the origin is refused. */
    int refused = 0;
    for (int i = 0; i < 4; i++) {
        send_ask(me, pk, (const struct sockaddr *)&to, own, &x);
        cr_assert(hm_test_run_until(&loop, ask_done, &x, 15000));
        refused += x.status == -EAGAIN;
    }
    cr_assert(refused >= 1, "no dial-back was rate limited");
    cr_assert(limit_refused(&a, "DialbackRatePerOrigin") >= 1);
    close(fd);

    hm_node_close(me, NULL, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_loop_close(&loop);
    stop_node(&a);
}

Test(announce, unreachable_node_switches_to_client_mode)
{
    /* A port bound but never listening: every dial there is reset. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sin = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &sin.sin_addr);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sin, sizeof(sin)), 0);
    socklen_t sl = sizeof(sin);
    getsockname(fd, (struct sockaddr *)&sin, &sl);
    char dead[64];
    snprintf(dead, sizeof(dead), "127.0.0.1:%d", ntohs(sin.sin_port));

    struct node a, b, c;
    start_node(&a, "a", NULL, "--announce", dead, "--host-experts", "ffn.0.0", "--expert-dim",
               "8", NULL);
    /* The printed address is the one declared; the others join where a listens. */
    char boot[256];
    cr_assert(strstr(a.addr, dead) != NULL, "%s", a.addr);
    listen_addr(&a, boot, sizeof(boot));
    start_node(&b, "b", NULL, "--listen", "127.0.0.2:0", "--initial-peers", boot, NULL);
    start_node(&c, "c", NULL, "--listen", "127.0.0.3:0", "--initial-peers", boot, NULL);
    json_t *j = wait_info(&a, "client_mode", NULL, 60000);
    cr_assert(json_is_true(json_object_get(j, "client_mode")), "still a server: %s",
              jstr(j, "reach_reason"));
    cr_assert(json_is_false(json_object_get(j, "reachable")));
    cr_assert(json_is_true(json_object_get(j, "client_mode_auto")));
    cr_assert(strstr(jstr(j, "reach_reason"), "dial-back") != NULL, "%s",
              jstr(j, "reach_reason"));
    cr_assert(strstr(jstr(j, "reach_reason"), dead) != NULL, "%s", jstr(j, "reach_reason"));
    /* Nothing is declared for an address nobody reaches. */
    cr_assert(json_is_null(json_object_get(j, "announce")));
    json_decref(j);
    char *log = slurp(a.err);
    cr_assert(strstr(log, "client mode") != NULL, "the log does not say so:\n%s", log);
    free(log);
    char *out, *err;
    cr_assert_eq(ctl(a.sock, "metrics", 0, &out, &err), 0);
    cr_assert(strstr(out, "\nhivemindd_reachable 0\n") != NULL, "%s", out);
    cr_assert(strstr(out, "hivemindd_dialbacks_total{result=\"failed\"} ") != NULL);
    free(out);
    free(err);
    /* The DHT itself is in client mode. */
    int rc;
    j = ctl_json(&a, &rc, "dht", "info", NULL);
    cr_assert(json_is_true(json_object_get(json_object_get(j, "result"), "client_mode")));
    json_decref(j);
    close(fd);
    stop_node(&c);
    stop_node(&b);
    stop_node(&a);
}

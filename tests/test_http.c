/*
 * test_http: the HTTP listener (src/daemon/http.h) of real hivemindd
 * processes on 127.0.0.1, spoken to over raw sockets: what each path
 * answers, 404 and 405, the request caps (headers, bodies), the
 * connection caps in total and per origin (the attacker on 127.0.0.2 and
 * up), the idle timeout, that it is off by default, and that one node's
 * /api/status shows the other nodes and their experts from the DHT.
 */
#include "config.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>

#include "tests/proc.h"

/* The node summaries' DHT key (src/daemon/cmd_status.h). */
#define HM_STATUS_KEY_TEST "hivemindd.status"

static void setup(void) { hm_proc_setup("http"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(http, .init = setup, .fini = teardown, .timeout = 120);

/* The node's HTTP address from "info" (port 0 resolved). */
static int http_port(struct node *n)
{
    int rc;
    json_t *j = ctl_json(n, &rc, "info", NULL);
    cr_assert_not_null(j);
    const char *a = json_string_value(json_object_get(json_object_get(j, "result"), "http"));
    cr_assert_not_null(a, "info has no http address");
    const char *colon = strrchr(a, ':');
    cr_assert_not_null(colon);
    int port = atoi(colon + 1);
    json_decref(j);
    cr_assert(port > 0);
    return port;
}

/* A TCP connection from the loopback address src to 127.0.0.1:port. */
static int dial(const char *src, int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    inet_pton(AF_INET, src, &sa.sin_addr);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "bind %s: %s", src,
                 strerror(errno));
    sa.sin_port = htons((uint16_t)port);
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "connect: %s",
                 strerror(errno));
    return fd;
}

/* Reads until the peer closes or timeout_ms pass; returns bytes read, the
 * text NUL-terminated in buf. */
static size_t read_all(int fd, char *buf, size_t cap, int timeout_ms)
{
    size_t n = 0;
    long deadline = hm_test_now_ms() + timeout_ms;
    while (n + 1 < cap) {
        long left = deadline - hm_test_now_ms();
        if (left <= 0)
            break;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, (int)left) <= 0)
            break;
        ssize_t r = read(fd, buf + n, cap - 1 - n);
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    buf[n] = '\0';
    return n;
}

/* Whether the server closed fd within timeout_ms (EOF or reset, no data). */
static int closed_within(int fd, int timeout_ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, timeout_ms) <= 0)
        return 0;
    char c;
    ssize_t r = read(fd, &c, 1);
    return r <= 0;
}

/* Sends a raw request with Connection: close and returns the status; the
 * whole response goes into resp (caller frees). */
static int http_raw(const char *src, int port, const char *req, char **resp)
{
    int fd = dial(src, port);
    size_t len = strlen(req);
    cr_assert_eq(write(fd, req, len), (ssize_t)len);
    char *buf = malloc(1 << 20);
    cr_assert_not_null(buf);
    read_all(fd, buf, 1 << 20, 5000);
    close(fd);
    int code = 0;
    if (strncmp(buf, "HTTP/1.", 7) == 0)
        code = atoi(buf + 9);
    if (resp != NULL)
        *resp = buf;
    else
        free(buf);
    return code;
}

static int http_get(int port, const char *path, char **resp)
{
    char req[4096];
    snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
             path);
    return http_raw("127.0.0.1", port, req, resp);
}

static const char *body_of(const char *resp)
{
    const char *b = strstr(resp, "\r\n\r\n");
    cr_assert_not_null(b, "no end of headers in: %.200s", resp);
    return b + 4;
}

/* GET path until it answers 200 (the first snapshot takes a moment). */
static char *get_ok(int port, const char *path)
{
    long deadline = hm_test_now_ms() + 10000;
    for (;;) {
        char *resp;
        int code = http_get(port, path, &resp);
        if (code == 200)
            return resp;
        cr_assert(code == 503, "GET %s: %d: %.300s", path, code, resp);
        free(resp);
        cr_assert(hm_test_now_ms() < deadline, "GET %s stays 503", path);
        usleep(100000);
    }
}

/* The value of one metric line (exact series name with labels), -1 if absent. */
static double metric(int port, const char *series)
{
    char *resp = get_ok(port, "/metrics");
    const char *body = body_of(resp);
    double v = -1;
    size_t n = strlen(series);
    for (const char *p = body; p != NULL && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (strncmp(p, series, n) == 0 && p[n] == ' ') {
            v = strtod(p + n + 1, NULL);
            break;
        }
    }
    free(resp);
    return v;
}

/* Waits up to 10 s for a metric to reach at least want (snapshots lag 2 s). */
static double wait_metric(int port, const char *series, double want)
{
    long deadline = hm_test_now_ms() + 10000;
    double v;
    while ((v = metric(port, series)) < want && hm_test_now_ms() < deadline)
        usleep(300000);
    return v;
}

Test(http, serves_the_page_status_and_metrics)
{
    struct node n;
    start_node(&n, "n0", NULL, "--http-listen", "127.0.0.1:0", NULL);
    int port = http_port(&n);

    char *resp = get_ok(port, "/");
    cr_assert(strstr(resp, "Content-Type: text/html") != NULL, "%.300s", resp);
    cr_assert(strstr(resp, "Content-Security-Policy: default-src 'none'") != NULL);
    cr_assert(strstr(body_of(resp), "<title>hivemindd swarm</title>") != NULL);
    free(resp);

    resp = get_ok(port, "/api/status");
    cr_assert(strstr(resp, "Content-Type: application/json") != NULL);
    json_t *st = json_loads(body_of(resp), 0, NULL);
    cr_assert_not_null(st, "not JSON: %.300s", body_of(resp));
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(st, "node"), "peer_id")),
                     n.id);
    cr_assert(json_is_array(json_object_get(st, "peers")));
    cr_assert(json_is_array(json_object_get(st, "history")));
    json_t *self = json_array_get(json_object_get(st, "nodes"), 0);
    cr_assert_str_eq(json_string_value(json_object_get(self, "peer_id")), n.id);
    cr_assert(json_is_true(json_object_get(self, "self")));
    /* No key material: the identity file's contents never appear. */
    cr_assert(strstr(body_of(resp), "secret") == NULL && strstr(body_of(resp), "key\"") == NULL);
    json_decref(st);
    free(resp);

    resp = get_ok(port, "/metrics");
    const char *m = body_of(resp);
    cr_assert(strstr(resp, "Content-Type: text/plain; version=0.0.4") != NULL);
    static const char *const want[] = {
        "\nprocess_cpu_seconds_total ", "\nprocess_resident_memory_bytes ",
        "\nprocess_open_fds ", "\nprocess_start_time_seconds ",
        "\nhivemindd_averaging_rounds_total{result=\"ok\"} 0\n",
        "\nhivemindd_averaging_round_duration_seconds_bucket{le=\"+Inf\"} 0\n",
        "\nhivemindd_connections_by_state{state=\"open\"} ", "\nhivemindd_dht_records ",
        "\nhivemindd_limit_refused_total{limit=\"HttpMaxConnectionsPerOrigin\"} 0\n",
        "\nhivemindd_uptime_seconds "};
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
        cr_assert(strstr(m, want[i]) != NULL, "/metrics lacks %s", want[i] + 1);
    /* One family once: a duplicate # TYPE breaks a Prometheus scrape. */
    cr_assert(strstr(strstr(m, "# TYPE hivemindd_limit_refused_total") + 1,
                     "# TYPE hivemindd_limit_refused_total") == NULL);
    free(resp);

    /* HEAD: the headers alone. */
    int code = http_raw("127.0.0.1", port,
                        "HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", &resp);
    cr_assert_eq(code, 200);
    cr_assert_str_eq(body_of(resp), "");
    free(resp);

    cr_assert_eq(http_get(port, "/nope", NULL), 404);
    cr_assert_eq(http_get(port, "/api/status/../../etc/passwd", NULL), 404);
    code = http_raw("127.0.0.1", port,
                    "POST /api/status HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                    "Connection: close\r\n\r\n", &resp);
    cr_assert_eq(code, 405);
    cr_assert(strstr(resp, "Allow: GET, HEAD") != NULL, "%.300s", resp);
    free(resp);
    cr_assert_eq(http_raw("127.0.0.1", port,
                          "DELETE / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", NULL),
                 405);
    /* Not HTTP at all: an error status or a close, and the listener lives on. */
    code = http_raw("127.0.0.1", port, "\x16\x03\x01\x02\x00garbage\r\n\r\n", NULL);
    cr_assert(code == 0 || code == 400, "garbage got %d", code);
    cr_assert(wait_metric(port, "hivemindd_http_requests_total{code=\"405\"}", 2) >= 2);
    stop_node(&n);
}

Test(http, request_size_and_bodies_are_capped)
{
    struct node n;
    start_node(&n, "n0", NULL, "--http-listen", "127.0.0.1:0", "--http-max-request-bytes",
               "1024", NULL);
    int port = http_port(&n);
    free(get_ok(port, "/metrics"));

    /* Headers over the cap but within the parser's pool: ours, 413. */
    char req[8192], pad[1600];
    memset(pad, 'a', sizeof(pad) - 1);
    pad[sizeof(pad) - 1] = '\0';
    snprintf(req, sizeof(req),
             "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: %s\r\nConnection: close\r\n\r\n", pad);
    cr_assert_eq(http_raw("127.0.0.1", port, req, NULL), 413);
    /* Far over: libmicrohttpd's own refusal; either way no 200. */
    char *big = malloc(70000);
    cr_assert_not_null(big);
    memset(big, 'b', 69000);
    big[69000] = '\0';
    char *hreq = malloc(71000);
    cr_assert_not_null(hreq);
    snprintf(hreq, 71000, "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\n\r\n", big);
    int code = http_raw("127.0.0.1", port, hreq, NULL);
    cr_assert(code == 413 || code == 431 || code == 0, "a 69 kB header got %d", code);
    free(big);
    free(hreq);
    /* A long URL counts too. */
    char url[1400] = "/";
    memset(url + 1, 'u', sizeof(url) - 2);
    url[sizeof(url) - 1] = '\0';
    cr_assert_eq(http_get(port, url, NULL), 413);
    /* A body is refused whatever its size. */
    cr_assert_eq(http_raw("127.0.0.1", port,
                          "GET /api/status HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                          "Connection: close\r\n\r\nhello", NULL),
                 413);
    cr_assert_eq(http_raw("127.0.0.1", port,
                          "GET /api/status HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                          "Connection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n", NULL),
                 413);
    /* A request under the cap still works. */
    cr_assert_eq(http_get(port, "/metrics", NULL), 200);
    cr_assert_geq(wait_metric(port, "hivemindd_limit_refused_total{limit=\"HttpMaxRequestBytes\"}",
                              4),
                  4);
    stop_node(&n);
}

Test(http, connections_are_capped_per_origin_and_in_total)
{
    struct node n;
    start_node(&n, "n0", NULL, "--http-listen", "127.0.0.1:0",
               "--http-max-connections-per-origin", "2", "--http-max-connections", "4", NULL);
    int port = http_port(&n);
    free(get_ok(port, "/metrics"));

    /* The attacker on 127.0.0.2 holds two idle connections; a third is shut. */
    int a1 = dial("127.0.0.2", port), a2 = dial("127.0.0.2", port);
    usleep(200000);
    int a3 = dial("127.0.0.2", port);
    cr_assert(closed_within(a3, 3000), "a third connection of one origin stayed open");
    close(a3);
    cr_assert(!closed_within(a1, 300), "an admitted connection was closed");
    /* The honest origin is served meanwhile. */
    cr_assert_eq(http_get(port, "/api/status", NULL), 200);

    /* Two more origins fill the total of 4; a fifth connection is shut. */
    int b1 = dial("127.0.0.3", port), b2 = dial("127.0.0.4", port);
    usleep(200000);
    int c1 = dial("127.0.0.5", port);
    cr_assert(closed_within(c1, 3000), "a connection over HttpMaxConnections stayed open");
    close(c1);
    close(a1);
    close(a2);
    close(b1);
    close(b2);
    usleep(300000);
    cr_assert_eq(http_get(port, "/metrics", NULL), 200);
    cr_assert_geq(wait_metric(port,
                              "hivemindd_limit_refused_total{limit=\"HttpMaxConnectionsPerOrigin\"}",
                              1),
                  1);
    cr_assert_geq(wait_metric(port, "hivemindd_limit_refused_total{limit=\"HttpMaxConnections\"}",
                              1),
                  1);
    stop_node(&n);
}

Test(http, an_idle_connection_times_out)
{
    struct node n;
    start_node(&n, "n0", NULL, "--http-listen", "127.0.0.1:0", "--http-timeout", "1", NULL);
    int port = http_port(&n);
    free(get_ok(port, "/metrics"));
    /* Half a request, then nothing: closed after about a second. */
    int fd = dial("127.0.0.2", port);
    const char *half = "GET /metrics HTTP/1.1\r\nHost: x\r\n";
    cr_assert_eq(write(fd, half, strlen(half)), (ssize_t)strlen(half));
    long t0 = hm_test_now_ms();
    cr_assert(closed_within(fd, 6000), "a stalled request was kept open");
    long took = hm_test_now_ms() - t0;
    cr_assert(took >= 500, "closed after %ld ms, before the timeout", took);
    close(fd);
    cr_assert_geq(wait_metric(port, "hivemindd_limit_refused_total{limit=\"HttpTimeout\"}", 1),
                  1);
    /* A request answered at once is no timeout. */
    double before = metric(port, "hivemindd_limit_refused_total{limit=\"HttpTimeout\"}");
    cr_assert_eq(http_get(port, "/metrics", NULL), 200);
    usleep(2500000);
    cr_assert_eq(metric(port, "hivemindd_limit_refused_total{limit=\"HttpTimeout\"}"), before);
    stop_node(&n);
}

Test(http, off_by_default_and_bad_addresses_refused)
{
    struct node n;
    start_node(&n, "n0", NULL, NULL);
    int rc;
    json_t *j = ctl_json(&n, &rc, "info", NULL);
    cr_assert(json_is_null(json_object_get(json_object_get(j, "result"), "http")));
    json_decref(j);
    /* The "status" command works without the listener (hivemindctl top). */
    j = ctl_json(&n, &rc, "status", NULL);
    cr_assert_eq(rc, 0);
    cr_assert_str_eq(json_string_value(json_object_get(
                         json_object_get(json_object_get(j, "result"), "node"), "peer_id")),
                     n.id);
    json_decref(j);
    stop_node(&n);

    char *out, *err;
    char *argv[] = {bin_daemon, "-t", "--http-listen", "local_host:80", NULL};
    cr_assert_eq(run_prog(bin_daemon, argv, &out, &err), 64, "%s", err);
    free(out);
    free(err);
    /* A port in use: the daemon does not start. */
    struct node a;
    start_node(&a, "a", NULL, "--http-listen", "127.0.0.1:0", NULL);
    char addr[32];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", http_port(&a));
    char dir[160], sock[200];
    snprintf(dir, sizeof(dir), "%s/b", tmpdir);
    snprintf(sock, sizeof(sock), "%s/b.sock", tmpdir);
    mkdir(dir, 0700);
    char *argv2[] = {bin_daemon, "--listen", "127.0.0.1:0", "--state-dir", dir, "--control-socket",
                     sock, "--http-listen", addr, NULL};
    cr_assert_eq(run_prog(bin_daemon, argv2, &out, &err), 1);
    cr_assert(strstr(err, "HttpListen") != NULL, "%s", err);
    free(out);
    free(err);
    stop_node(&a);
}

Test(http, any_node_shows_the_whole_swarm)
{
    struct node nodes[3];
    start_node(&nodes[0], "n0", NULL, "--http-listen", "127.0.0.1:0", "--status-grids", "tg",
               NULL);
    start_node(&nodes[1], "n1", NULL, "--initial-peers", nodes[0].addr, "--host-experts",
               "tg.[0:2].[0:2]", "--expert-dim", "8", NULL);
    start_node(&nodes[2], "n2", NULL, "--initial-peers", nodes[0].addr, NULL);
    int port = http_port(&nodes[0]);
    long deadline = hm_test_now_ms() + 40000;
    size_t seen = 0, experts = 0;
    json_t *st = NULL;
    while (hm_test_now_ms() < deadline) {
        char *resp = get_ok(port, "/api/status");
        json_decref(st);
        st = json_loads(body_of(resp), 0, NULL);
        free(resp);
        cr_assert_not_null(st);
        seen = 0;
        for (int i = 0; i < 3; i++) {
            size_t k;
            json_t *e;
            json_array_foreach(json_object_get(st, "nodes"), k, e)
            {
                if (strcmp(json_string_value(json_object_get(e, "peer_id")), nodes[i].id) == 0)
                    seen++;
            }
        }
        experts = json_array_size(json_object_get(json_object_get(st, "experts"), "swarm"));
        if (seen == 3 && experts == 4)
            break;
        usleep(500000);
    }
    cr_assert_eq(seen, 3, "the status of n0 shows %zu of the 3 nodes", seen);
    cr_assert_eq(experts, 4, "the grid shows %zu of n1's 4 experts", experts);
    /* n1's own summary names its experts. */
    size_t k;
    json_t *e;
    int found = 0;
    json_array_foreach(json_object_get(st, "nodes"), k, e)
    {
        if (strcmp(json_string_value(json_object_get(e, "peer_id")), nodes[1].id) == 0) {
            found = 1;
            cr_assert_eq(json_integer_value(json_object_get(e, "n_experts")), 4);
            cr_assert_eq(json_array_size(json_object_get(e, "experts")), 4);
        }
    }
    cr_assert(found);
    json_decref(st);
    for (int i = 2; i >= 0; i--)
        stop_node(&nodes[i]);
}

/* An attacker on 127.0.0.2 writes its own summary with markup, negative
 * and huge numbers and a forged expert: the honest node's status shows
 * that node (its record is its own) but none of the bad fields. */
Test(http, a_hostile_summary_is_cut_to_plain_values)
{
    struct node honest, att;
    start_node(&honest, "h", NULL, "--http-listen", "127.0.0.1:0", NULL);
    start_node(&att, "att", NULL, "--listen", "127.0.0.2:0", "--initial-peers", honest.addr,
               "--status-publish=no", NULL);
    int port = http_port(&honest);
    char subkey[96];
    snprintf(subkey, sizeof(subkey), "[owner:%s]", att.id);
    const char *value = "{\"addr\":\"<img src=x onerror=alert(1)>\",\"ver\":\"9\\\"><b>\","
                        "\"up\":-40,\"peers\":1e300,\"ok\":\"many\",\"x\":[[\"<b>x</b>\",1,2,3],"
                        "[\"ffn.0.0\",-5,1e300,-1],[\"ffn.0.1\",7,0.5,0.9]],\"nx\":-1}";
    long deadline = hm_test_now_ms() + 20000;
    int rc = 1;
    while (rc != 0 && hm_test_now_ms() < deadline) {
        json_decref(ctl_json(&att, &rc, "dht", "put", HM_STATUS_KEY_TEST, value, "--subkey",
                             subkey, "--ttl", "120", NULL));
        if (rc != 0)
            usleep(300000);
    }
    cr_assert_eq(rc, 0, "the attacker could not store its summary");
    json_t *found = NULL;
    while (found == NULL && hm_test_now_ms() < deadline) {
        char *resp = get_ok(port, "/api/status");
        json_t *st = json_loads(body_of(resp), 0, NULL);
        free(resp);
        size_t i;
        json_t *e;
        json_array_foreach(json_object_get(st, "nodes"), i, e)
        {
            if (strcmp(json_string_value(json_object_get(e, "peer_id")), att.id) == 0)
                found = json_incref(e);
        }
        json_decref(st);
        if (found == NULL)
            usleep(300000);
    }
    cr_assert_not_null(found, "the attacker's summary never showed");
    cr_assert_str_eq(json_string_value(json_object_get(found, "address")), "");
    cr_assert_str_eq(json_string_value(json_object_get(found, "version")), "");
    cr_assert_eq(json_integer_value(json_object_get(found, "rounds_ok")), 0);
    cr_assert_geq(json_integer_value(json_object_get(found, "uptime_s")), 0);
    cr_assert_leq(json_integer_value(json_object_get(found, "peers")), 1000000000);
    cr_assert_eq(json_integer_value(json_object_get(found, "n_experts")), 0);
    /* Only the well-formed expert is kept, and the negative count as 0. */
    json_t *x = json_object_get(found, "experts");
    size_t i;
    json_t *e;
    int has_good = 0;
    json_array_foreach(x, i, e)
    {
        const char *uid = json_string_value(json_object_get(e, "uid"));
        cr_assert(strchr(uid, '<') == NULL, "markup kept in a uid: %s", uid);
        cr_assert_geq(json_integer_value(json_object_get(e, "requests")), 0);
        cr_assert_geq(json_number_value(json_object_get(e, "latency_p50_ms")), 0);
        cr_assert_geq(json_number_value(json_object_get(e, "latency_p99_ms")), 0);
        cr_assert_leq(json_number_value(json_object_get(e, "latency_p50_ms")), 3.6e6);
        has_good |= strcmp(uid, "ffn.0.1") == 0 &&
                    json_integer_value(json_object_get(e, "requests")) == 7;
    }
    cr_assert(has_good);
    json_decref(found);
    /* And the page says nothing of it as markup: every swarm value is set as text. */
    char *resp = get_ok(port, "/");
    cr_assert(strstr(body_of(resp), "innerHTML") == NULL);
    free(resp);
    stop_node(&att);
    stop_node(&honest);
}

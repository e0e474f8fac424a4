/*
 * test_control: a real control server on a temporary socket path, its loop
 * running on a thread of its own, and clients talking to it over blocking
 * Unix sockets the way hivemindctl, socat or a script would.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "src/daemon/control.h"
#include "tests/helpers.h"
#include "src/base/util.h"

struct server {
    uv_loop_t loop;
    uv_async_t stop;
    hm_control *ctl;
    pthread_t thread;
    char dir[64];
    char path[128];
    int closed;        /* the close callback ran */
    int replies_gone;  /* hm_control_reply returned -EPIPE */
    uint64_t held;     /* the connection "hold" keeps from idling out; loop thread */
};

struct delayed {
    uv_timer_t timer;
    hm_control_req *req;
    struct server *s;
};

static void echo_handler(void *ud, hm_control_req *req, const json_t *args)
{
    (void)ud;
    hm_control_reply(req, json_pack("{s:O}", "args", (json_t *)args));
}

static void fail_handler(void *ud, hm_control_req *req, const json_t *args)
{
    (void)ud;
    (void)args;
    hm_control_reply_error(req, "bad_args", "this command always fails");
}

/* Marks the calling connection as holding resources ({"on": true}), as a
 * trainer's shared buffers do in hivemindd, or clears the mark. */
static void hold_handler(void *ud, hm_control_req *req, const json_t *args)
{
    struct server *s = ud;
    s->held = json_is_true(json_object_get(args, "on")) ? hm_control_req_client(req) : 0;
    hm_control_reply(req, NULL);
}

static int is_held(void *ud, uint64_t conn_id)
{
    struct server *s = ud;
    return s->held != 0 && s->held == conn_id;
}

static void on_delayed_closed(uv_handle_t *h) { free(h->data); }

static void on_delay(uv_timer_t *t)
{
    struct delayed *d = t->data;
    if (hm_control_reply(d->req, json_pack("{s:b}", "late", 1)) == -EPIPE)
        d->s->replies_gone++;
    uv_close((uv_handle_t *)&d->timer, on_delayed_closed);
}

/* Replies after args.ms milliseconds, from a timer: an asynchronous handler. */
static void later_handler(void *ud, hm_control_req *req, const json_t *args)
{
    struct server *s = ud;
    struct delayed *d = calloc(1, sizeof(*d));
    cr_assert_not_null(d);
    d->req = req;
    d->s = s;
    d->timer.data = d;
    json_int_t ms = json_integer_value(json_object_get(args, "ms"));
    uv_timer_init(&s->loop, &d->timer);
    uv_timer_start(&d->timer, on_delay, (uint64_t)(ms > 0 ? ms : 100), 0);
}

static void *loop_thread(void *arg)
{
    struct server *s = arg;
    uv_run(&s->loop, UV_RUN_DEFAULT);
    return NULL;
}

static void on_ctl_closed(void *ud)
{
    struct server *s = ud;
    s->closed = 1;
}

static void on_stop(uv_async_t *a)
{
    struct server *s = a->data;
    hm_control_close(s->ctl, on_ctl_closed, s);
    uv_close((uv_handle_t *)&s->stop, NULL);
}

static void server_start(struct server *s, size_t max_clients, uint64_t idle_ms,
                         const char *group)
{
    char err[256];
    memset(s, 0, sizeof(*s));
    /* As in hivemindd: a write to a client that left must not kill us. */
    signal(SIGPIPE, SIG_IGN);
    cr_assert_eq(hm_test_mkdtemp(s->dir, sizeof(s->dir), "ctl"), 0);
    snprintf(s->path, sizeof(s->path), "%s/control.sock", s->dir);
    cr_assert_eq(uv_loop_init(&s->loop), 0);
    hm_control_config cfg = {
        .path = s->path,
        .group = group,
        .max_clients = max_clients,
        .idle_timeout_ms = idle_ms,
        .max_line = 4096,
    };
    int r = hm_control_new(&s->loop, &cfg, &s->ctl, err, sizeof(err));
    cr_assert_eq(r, 0, "hm_control_new: %s", err);
    cr_assert_eq(hm_control_register(s->ctl, "echo", echo_handler, s), 0);
    cr_assert_eq(hm_control_register(s->ctl, "fail", fail_handler, s), 0);
    cr_assert_eq(hm_control_register(s->ctl, "later", later_handler, s), 0);
    cr_assert_eq(hm_control_register(s->ctl, "hold", hold_handler, s), 0);
    hm_control_set_idle_check(s->ctl, is_held, s);
    cr_assert_eq(hm_control_register(s->ctl, "echo", echo_handler, s), -EEXIST);
    cr_assert_eq(hm_control_register(s->ctl, "Bad Name", echo_handler, s), -EINVAL);
    cr_assert_eq(uv_async_init(&s->loop, &s->stop, on_stop), 0);
    s->stop.data = s;
    cr_assert_eq(pthread_create(&s->thread, NULL, loop_thread, s), 0);
}

static void server_stop(struct server *s)
{
    uv_async_send(&s->stop);
    pthread_join(s->thread, NULL);
    cr_assert(s->closed, "close callback did not run");
    cr_assert_eq(uv_loop_close(&s->loop), 0, "handles left open");
    hm_test_rmtree(s->dir);
}

static int connect_client(struct server *s)
{
    int fd = hm_test_unix_connect(s->path);
    cr_assert(fd >= 0, "connect: %s", strerror(-fd));
    return fd;
}

static int send_str(int fd, const char *text) { return hm_test_send_all(fd, text, strlen(text)); }

/* Sends text and reads one reply line, parsed. */
static json_t *roundtrip(int fd, const char *text)
{
    char line[65536];
    cr_assert_eq(hm_test_send_all(fd, text, strlen(text)), 0);
    int n = hm_test_read_line(fd, line, sizeof(line), 5000);
    cr_assert(n > 0, "no reply to %s (%d)", text, n);
    json_error_t e;
    json_t *j = json_loads(line, 0, &e);
    cr_assert_not_null(j, "reply is not JSON: %s", line);
    return j;
}

static json_t *read_reply(int fd)
{
    char line[65536];
    int n = hm_test_read_line(fd, line, sizeof(line), 5000);
    cr_assert(n > 0, "no reply (%d)", n);
    json_t *j = json_loads(line, 0, NULL);
    cr_assert_not_null(j, "reply is not JSON: %s", line);
    return j;
}

static void assert_error(json_t *j, const char *code)
{
    cr_assert(json_is_false(json_object_get(j, "ok")));
    const char *got = json_string_value(json_object_get(json_object_get(j, "error"), "code"));
    cr_assert_not_null(got);
    cr_assert_str_eq(got, code);
    const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    cr_assert(msg != NULL && msg[0] != '\0');
}

static void assert_echo_works(int fd)
{
    json_t *j = roundtrip(fd, "{\"cmd\":\"echo\",\"args\":{\"x\":1}}\n");
    cr_assert(json_is_true(json_object_get(j, "ok")));
    cr_assert_eq(json_integer_value(
                     json_object_get(json_object_get(json_object_get(j, "result"), "args"), "x")),
                 1);
    json_decref(j);
}

Test(control, registered_command_and_id_echo)
{
    struct server s;
    server_start(&s, 8, 10000, NULL);
    int fd = connect_client(&s);
    assert_echo_works(fd);

    json_t *j = roundtrip(fd, "{\"cmd\":\"echo\",\"id\":42}\n");
    cr_assert(json_is_true(json_object_get(j, "ok")));
    cr_assert_eq(json_integer_value(json_object_get(j, "id")), 42);
    cr_assert(json_is_object(json_object_get(json_object_get(j, "result"), "args")));
    json_decref(j);

    j = roundtrip(fd, "{\"id\":\"abc\",\"cmd\":\"fail\"}\r\n");
    assert_error(j, "bad_args");
    cr_assert_str_eq(json_string_value(json_object_get(j, "id")), "abc");
    json_decref(j);

    /* Two requests in one write come back as two replies, in order. */
    cr_assert_eq(send_str(fd, "{\"cmd\":\"later\",\"args\":{\"ms\":150},\"id\":1}\n"
                                      "{\"cmd\":\"echo\",\"id\":2}\n"),
                 0);
    j = read_reply(fd);
    cr_assert_eq(json_integer_value(json_object_get(j, "id")), 1);
    cr_assert(json_is_true(json_object_get(json_object_get(j, "result"), "late")));
    json_decref(j);
    j = read_reply(fd);
    cr_assert_eq(json_integer_value(json_object_get(j, "id")), 2);
    json_decref(j);
    close(fd);
    server_stop(&s);
}

Test(control, bad_requests_get_errors_and_the_connection_stays_usable)
{
    struct server s;
    server_start(&s, 8, 10000, NULL);
    int fd = connect_client(&s);
    static const struct {
        const char *line;
        const char *code;
    } cases[] = {
        {"{\"cmd\":\"echo\"\n", "parse_error"},
        {"not json at all\n", "parse_error"},
        {"\x01\x02\xff\xfe\x80garbage\n", "parse_error"},
        {"[1,2,3]\n", "invalid_request"},
        {"\"info\"\n", "invalid_request"},
        {"{}\n", "invalid_request"},
        {"{\"cmd\":7}\n", "invalid_request"},
        {"{\"cmd\":\"echo\",\"args\":[1]}\n", "invalid_request"},
        {"{\"cmd\":\"echo\",\"extra\":1}\n", "invalid_request"},
        {"{\"cmd\":\"echo\",\"cmd\":\"fail\"}\n", "parse_error"},
        {"{\"cmd\":\"nosuchcommand\"}\n", "unknown_command"},
        {"{\"cmd\":\"../../etc\"}\n", "invalid_request"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        json_t *j = roundtrip(fd, cases[i].line);
        assert_error(j, cases[i].code);
        json_decref(j);
        assert_echo_works(fd);
    }
    /* Blank lines are ignored, not answered. */
    cr_assert_eq(send_str(fd, "\n  \n"), 0);
    assert_echo_works(fd);
    /* An unknown command still echoes the id. */
    json_t *j = roundtrip(fd, "{\"cmd\":\"nope\",\"id\":9}\n");
    assert_error(j, "unknown_command");
    cr_assert_eq(json_integer_value(json_object_get(j, "id")), 9);
    json_decref(j);
    close(fd);
    server_stop(&s);
}

Test(control, overlong_line_gets_an_error_and_a_disconnect)
{
    struct server s;
    server_start(&s, 8, 10000, NULL);
    int fd = connect_client(&s);
    size_t n = 3 * 4096;
    char *big = malloc(n + 1);
    cr_assert_not_null(big);
    memset(big, 'a', n);
    big[n] = '\n';
    /* The server stops reading once the cap is passed, so a send of more than
     * the socket buffer could block: send what it takes, then read. */
    hm_test_send_all(fd, big, 4096 + 10);
    json_t *j = read_reply(fd);
    assert_error(j, "line_too_long");
    json_decref(j);
    cr_assert_eq(hm_test_wait_eof(fd, 3000), 0);
    close(fd);
    free(big);

    /* A line of exactly the cap is still accepted. */
    fd = connect_client(&s);
    big = malloc(4097);
    cr_assert_not_null(big);
    memset(big, ' ', 4096);
    memcpy(big, "{\"cmd\":\"echo\"}", 14);
    big[4096] = '\n';
    cr_assert_eq(hm_test_send_all(fd, big, 4097), 0);
    j = read_reply(fd);
    cr_assert(json_is_true(json_object_get(j, "ok")));
    json_decref(j);
    free(big);
    assert_echo_works(fd);
    close(fd);

    /* The server keeps serving new clients. */
    fd = connect_client(&s);
    assert_echo_works(fd);
    close(fd);
    server_stop(&s);
}

Test(control, client_cap)
{
    struct server s;
    server_start(&s, 2, 10000, NULL);
    int a = connect_client(&s), b = connect_client(&s);
    assert_echo_works(a);
    assert_echo_works(b);
    int c = connect_client(&s);
    json_t *j = read_reply(c);
    assert_error(j, "too_many_clients");
    json_decref(j);
    cr_assert_eq(hm_test_wait_eof(c, 3000), 0);
    close(c);
    /* A freed slot can be taken again. */
    close(a);
    long deadline = hm_test_now_ms() + 3000;
    int ok = 0;
    while (!ok && hm_test_now_ms() < deadline) {
        int d = connect_client(&s);
        char line[1024];
        send_str(d, "{\"cmd\":\"echo\"}\n");
        if (hm_test_read_line(d, line, sizeof(line), 2000) > 0 && strstr(line, "\"ok\":true"))
            ok = 1;
        close(d);
        if (!ok)
            usleep(20000);
    }
    cr_assert(ok, "no slot after a client left");
    assert_echo_works(b);
    close(b);
    server_stop(&s);
}

Test(control, idle_clients_are_closed)
{
    struct server s;
    server_start(&s, 8, 300, NULL);
    int fd = connect_client(&s);
    assert_echo_works(fd);
    long t0 = hm_test_now_ms();
    json_t *j = read_reply(fd);
    assert_error(j, "idle_timeout");
    json_decref(j);
    cr_assert_eq(hm_test_wait_eof(fd, 3000), 0);
    long waited = hm_test_now_ms() - t0;
    cr_assert(waited >= 200 && waited < 3000, "closed after %ld ms", waited);
    close(fd);

    /* A client waiting on a slow command is not idle. */
    fd = connect_client(&s);
    j = roundtrip(fd, "{\"cmd\":\"later\",\"args\":{\"ms\":700}}\n");
    cr_assert(json_is_true(json_object_get(j, "ok")), "slow reply lost to the idle timer");
    json_decref(j);
    close(fd);
    server_stop(&s);
}

Test(control, a_connection_holding_resources_is_not_idle_closed)
{
    struct server s;
    server_start(&s, 8, 300, NULL);
    int held = connect_client(&s);
    json_t *j = roundtrip(held, "{\"cmd\":\"hold\",\"args\":{\"on\":true}}\n");
    cr_assert(json_is_true(json_object_get(j, "ok")));
    json_decref(j);
    /* Its neighbour without resources still idles out... */
    int plain = connect_client(&s);
    assert_echo_works(plain);
    j = read_reply(plain);
    assert_error(j, "idle_timeout");
    json_decref(j);
    cr_assert_eq(hm_test_wait_eof(plain, 3000), 0);
    close(plain);
    /* ...while the held one stays silent and open for several periods. */
    struct pollfd p = {.fd = held, .events = POLLIN};
    cr_assert_eq(poll(&p, 1, 1500), 0, "the held connection got something (idle-closed?)");
    assert_echo_works(held);
    /* Once it holds nothing it is an ordinary idle client again. */
    j = roundtrip(held, "{\"cmd\":\"hold\",\"args\":{\"on\":false}}\n");
    cr_assert(json_is_true(json_object_get(j, "ok")));
    json_decref(j);
    j = read_reply(held);
    assert_error(j, "idle_timeout");
    json_decref(j);
    cr_assert_eq(hm_test_wait_eof(held, 3000), 0);
    close(held);
    server_stop(&s);
}

Test(control, socket_file_mode_and_removal)
{
    struct server s;
    struct stat st;
    server_start(&s, 8, 10000, NULL);
    cr_assert_eq(lstat(s.path, &st), 0);
    cr_assert(S_ISSOCK(st.st_mode));
    cr_assert_eq(st.st_mode & 0777, 0600, "mode %o", st.st_mode & 0777);
    cr_assert_str_eq(hm_control_path(s.ctl), s.path);
    char path[128];
    memcpy(path, s.path, sizeof(path));
    uv_async_send(&s.stop);
    pthread_join(s.thread, NULL);
    cr_assert(s.closed);
    cr_assert_eq(lstat(path, &st), -1);
    cr_assert_eq(errno, ENOENT);
    cr_assert_eq(uv_loop_close(&s.loop), 0);
    hm_test_rmtree(s.dir);
}

Test(control, group_socket_is_0660)
{
    struct server s;
    struct stat st;
    char group[64];
    /* A group this process is in, so that the chown is allowed. */
    struct group *g = getgrgid(getegid());
    if (g != NULL)
        snprintf(group, sizeof(group), "%s", g->gr_name);
    else
        snprintf(group, sizeof(group), "%u", (unsigned)getegid());
    server_start(&s, 8, 10000, group);
    cr_assert_eq(lstat(s.path, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0660, "mode %o", st.st_mode & 0777);
    cr_assert_eq(st.st_gid, getegid());
    server_stop(&s);

    /* A group that does not exist is a clear error. */
    uv_loop_t loop;
    hm_control *ctl;
    char err[256], dir[64], path[128];
    cr_assert_eq(hm_test_mkdtemp(dir, sizeof(dir), "ctl"), 0);
    snprintf(path, sizeof(path), "%s/c.sock", dir);
    uv_loop_init(&loop);
    hm_control_config cfg = {.path = path, .group = "no-such-group-hm"};
    cr_assert_eq(hm_control_new(&loop, &cfg, &ctl, err, sizeof(err)), -ENOENT);
    cr_assert(strstr(err, "no-such-group-hm") != NULL, "%s", err);
    cr_assert_eq(uv_loop_close(&loop), 0);
    hm_test_rmtree(dir);
}

Test(control, second_server_refuses_while_first_is_alive)
{
    struct server s;
    server_start(&s, 8, 10000, NULL);
    uv_loop_t loop;
    hm_control *ctl = NULL;
    char err[256];
    cr_assert_eq(uv_loop_init(&loop), 0);
    hm_control_config cfg = {.path = s.path};
    cr_assert_eq(hm_control_new(&loop, &cfg, &ctl, err, sizeof(err)), -EADDRINUSE);
    cr_assert(strstr(err, "already listening") != NULL, "%s", err);
    cr_assert_null(ctl);
    cr_assert_eq(uv_loop_close(&loop), 0);
    /* And the first one is untouched. */
    int fd = connect_client(&s);
    assert_echo_works(fd);
    close(fd);
    server_stop(&s);
}

static void on_closed_flag(void *ud) { *(int *)ud = 1; }

Test(control, stale_socket_is_replaced_and_other_files_are_not)
{
    char dir[64], path[128], err[256];
    uv_loop_t loop;
    hm_control *ctl = NULL;
    cr_assert_eq(hm_test_mkdtemp(dir, sizeof(dir), "ctl"), 0);
    snprintf(path, sizeof(path), "%s/c.sock", dir);

    /* A socket file nobody listens on, as a crashed daemon leaves it. */
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    strcpy(sa.sun_path, path);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    close(fd);

    cr_assert_eq(uv_loop_init(&loop), 0);
    hm_control_config cfg = {.path = path};
    cr_assert_eq(hm_control_new(&loop, &cfg, &ctl, err, sizeof(err)), 0, "%s", err);
    int closed = 0;
    hm_control_close(ctl, on_closed_flag, &closed);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert(closed);

    /* A regular file is never removed. */
    cr_assert_eq(hm_test_write_file(path, "keep", 4, 0600), 0);
    cr_assert_eq(hm_control_new(&loop, &cfg, &ctl, err, sizeof(err)), -EEXIST);
    cr_assert(strstr(err, "not a socket") != NULL, "%s", err);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_size, 4);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&loop), 0);
    hm_test_rmtree(dir);
}

Test(control, client_that_half_closes_still_gets_its_reply)
{
    struct server s;
    server_start(&s, 8, 10000, NULL);
    int fd = connect_client(&s);
    /* No trailing newline, then EOF: the way `printf ... | nc -U` talks. */
    cr_assert_eq(send_str(fd, "{\"cmd\":\"echo\",\"id\":5}"), 0);
    shutdown(fd, SHUT_WR);
    json_t *j = read_reply(fd);
    cr_assert(json_is_true(json_object_get(j, "ok")));
    cr_assert_eq(json_integer_value(json_object_get(j, "id")), 5);
    json_decref(j);
    cr_assert_eq(hm_test_wait_eof(fd, 3000), 0);
    close(fd);
    server_stop(&s);
}

Test(control, reply_after_the_client_left_is_dropped)
{
    struct server s;
    server_start(&s, 8, 10000, NULL);
    int fd = connect_client(&s);
    cr_assert_eq(send_str(fd, "{\"cmd\":\"later\",\"args\":{\"ms\":200}}\n"), 0);
    usleep(50000);
    close(fd);
    usleep(400000);
    fd = connect_client(&s);
    assert_echo_works(fd);
    close(fd);
    server_stop(&s);
}

Test(control, close_with_a_request_pending)
{
    struct server s;
    server_start(&s, 8, 10000, NULL);
    int fd = connect_client(&s);
    assert_echo_works(fd);
    /* A request pending at close is answered by its handler into the void,
     * and the client sees the connection end. */
    cr_assert_eq(send_str(fd, "{\"cmd\":\"later\",\"args\":{\"ms\":200}}\n"), 0);
    usleep(50000);
    uv_async_send(&s.stop);
    cr_assert_eq(hm_test_wait_eof(fd, 3000), 0);
    pthread_join(s.thread, NULL);
    cr_assert(s.closed);
    cr_assert_eq(s.replies_gone, 1);
    cr_assert_eq(uv_loop_close(&s.loop), 0);
    close(fd);
    hm_test_rmtree(s.dir);
}

Test(control, parse_request_is_strict_and_bounded)
{
    hm_control_request r;
    const char *code;
    char msg[256];
    const char ok[] = "{\"cmd\":\"peers\",\"args\":{\"a\":[1,2]},\"id\":\"x\"}";
    cr_assert_eq(hm_control_parse_request(ok, sizeof(ok) - 1, &r, &code, msg, sizeof(msg)), 0);
    cr_assert_str_eq(r.cmd, "peers");
    cr_assert(json_is_object(r.args));
    cr_assert_str_eq(json_string_value(r.id), "x");
    hm_control_request_clear(&r);

    /* Not NUL-terminated: the parser must stop at len. */
    const char cut[] = "{\"cmd\":\"info\"}GARBAGE";
    cr_assert_eq(hm_control_parse_request(cut, 14, &r, &code, msg, sizeof(msg)), 0, "%s", msg);
    hm_control_request_clear(&r);

    const char nul[] = "{\"cmd\":\"in\\u0000fo\"}";
    cr_assert_eq(hm_control_parse_request(nul, sizeof(nul) - 1, &r, &code, msg, sizeof(msg)),
                 -EINVAL);
    hm_control_request_clear(&r);

    char longid[400];
    snprintf(longid, sizeof(longid), "{\"cmd\":\"info\",\"id\":\"%0300d\"}", 0);
    cr_assert_eq(hm_control_parse_request(longid, strlen(longid), &r, &code, msg, sizeof(msg)),
                 -EINVAL);
    cr_assert_str_eq(code, "invalid_request");
    hm_control_request_clear(&r);

    /* Deep nesting is refused by the parser's depth limit, not the stack. */
    size_t depth = 100000;
    char *deep = malloc(depth * 2 + 32);
    cr_assert_not_null(deep);
    size_t n = (size_t)sprintf(deep, "{\"cmd\":\"info\",\"args\":{\"a\":");
    for (size_t i = 0; i < depth; i++)
        deep[n++] = '[';
    for (size_t i = 0; i < depth; i++)
        deep[n++] = ']';
    deep[n++] = '}';
    deep[n++] = '}';
    cr_assert_eq(hm_control_parse_request(deep, n, &r, &code, msg, sizeof(msg)), -EINVAL);
    cr_assert_str_eq(code, "parse_error");
    hm_control_request_clear(&r);
    free(deep);

    size_t len;
    char *line = hm_control_format_reply(NULL, 0, NULL, "x", "a\nb", &len);
    cr_assert_not_null(line);
    cr_assert_eq(strchr(line, '\n'), line + len - 1, "reply must be one line: %s", line);
    free(line);
}

Test(control, a_client_that_never_reads_cannot_hold_a_slot)
{
    struct server s;
    server_start(&s, 1, 300, NULL);
    int fd = connect_client(&s);
    /* Requests without ever reading a reply, until the server stops taking
     * them (its reply queue is full) and our send buffer fills up. */
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    static const char req[] = "{\"cmd\":\"echo\",\"args\":{\"pad\":\"xxxxxxxxxxxxxxxxxxxxxxxx\"}}\n";
    char chunk[64 * 1024];
    size_t per = sizeof(req) - 1, n = 0;
    while (n + per <= sizeof(chunk)) {
        memcpy(chunk + n, req, per);
        n += per;
    }
    long deadline = hm_test_now_ms() + 10000;
    size_t sent = 0;
    int blocked_since = 0;
    long t_block = 0;
    while (hm_test_now_ms() < deadline) {
        ssize_t w = send(fd, chunk, n, MSG_NOSIGNAL);
        if (w > 0) {
            sent += (size_t)w;
            blocked_since = 0;
            continue;
        }
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (!blocked_since) {
                blocked_since = 1;
                t_block = hm_test_now_ms();
            }
            /* Blocked for a while: the server has stopped reading us. */
            if (hm_test_now_ms() - t_block > 200)
                break;
            usleep(10000);
            continue;
        }
        break;
    }
    cr_assert(sent > HM_CONTROL_MAX_QUEUED / 20, "sent only %zu bytes", sent);
    /* The slot frees up within the idle timeout plus the drain time. */
    deadline = hm_test_now_ms() + 5000;
    int ok = 0;
    while (!ok && hm_test_now_ms() < deadline) {
        int d = connect_client(&s);
        char line[1024];
        send_str(d, "{\"cmd\":\"echo\"}\n");
        if (hm_test_read_line(d, line, sizeof(line), 2000) > 0 && strstr(line, "\"ok\":true"))
            ok = 1;
        close(d);
        if (!ok)
            usleep(100000);
    }
    cr_assert(ok, "a client that never reads kept its slot");
    close(fd);
    server_stop(&s);
}

/* -- http: hm_control_call, the daemon's own use of its commands -- */

struct local_reply {
    int fired, ok;
    json_t *result;
    char code[32];
};

static void on_local(void *ud, int ok, const json_t *result, const char *code, const char *message)
{
    struct local_reply *r = ud;
    r->fired++;
    r->ok = ok;
    r->result = result ? json_deep_copy(result) : NULL;
    if (!ok) {
        cr_assert_not_null(code);
        cr_assert(message != NULL && message[0] != '\0');
        snprintf(r->code, sizeof(r->code), "%s", code);
    }
}

Test(control, local_calls_run_commands_and_answer_once)
{
    struct server s;
    char err[256];
    memset(&s, 0, sizeof(s));
    cr_assert_eq(hm_test_mkdtemp(s.dir, sizeof(s.dir), "ctl"), 0);
    snprintf(s.path, sizeof(s.path), "%s/control.sock", s.dir);
    cr_assert_eq(uv_loop_init(&s.loop), 0);
    hm_control_config cfg = {.path = s.path, .max_clients = 4, .idle_timeout_ms = 10000,
                             .max_line = 4096};
    cr_assert_eq(hm_control_new(&s.loop, &cfg, &s.ctl, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(hm_control_register(s.ctl, "echo", echo_handler, &s), 0);
    cr_assert_eq(hm_control_register(s.ctl, "fail", fail_handler, &s), 0);
    cr_assert_eq(hm_control_register(s.ctl, "later", later_handler, &s), 0);

    /* A command that answers at once: the callback fired before the return. */
    struct local_reply a = {0}, b = {0}, c = {0}, d = {0};
    json_t *args = json_pack("{s:i}", "x", 7);
    cr_assert_eq(hm_control_call(s.ctl, "echo", args, on_local, &a), 0);
    json_decref(args);
    cr_assert_eq(a.fired, 1);
    cr_assert(a.ok);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(a.result, "args"), "x")), 7);
    /* An error reply. */
    cr_assert_eq(hm_control_call(s.ctl, "fail", NULL, on_local, &b), 0);
    cr_assert_eq(b.fired, 1);
    cr_assert(!b.ok);
    cr_assert_str_eq(b.code, "bad_args");
    /* One that answers later, from the loop. */
    args = json_pack("{s:i}", "ms", 50);
    cr_assert_eq(hm_control_call(s.ctl, "later", args, on_local, &c), 0);
    json_decref(args);
    cr_assert_eq(c.fired, 0);
    while (c.fired == 0)
        uv_run(&s.loop, UV_RUN_ONCE);
    cr_assert_eq(c.fired, 1);
    cr_assert(json_is_true(json_object_get(c.result, "late")));
    /* No such command, or a bad call: an error, and no callback. */
    cr_assert_eq(hm_control_call(s.ctl, "nope", NULL, on_local, &d), -ENOENT);
    cr_assert_eq(hm_control_call(s.ctl, "echo", NULL, NULL, NULL), -EINVAL);
    cr_assert_eq(d.fired, 0);
    /* A request that is still pending when the server closes still answers. */
    struct local_reply e = {0};
    args = json_pack("{s:i}", "ms", 50);
    cr_assert_eq(hm_control_call(s.ctl, "later", args, on_local, &e), 0);
    json_decref(args);
    hm_control_close(s.ctl, on_ctl_closed, &s);
    cr_assert_eq(hm_control_call(s.ctl, "echo", NULL, on_local, &d), -ESHUTDOWN);
    uv_run(&s.loop, UV_RUN_DEFAULT);
    cr_assert(s.closed);
    cr_assert_eq(e.fired, 1);
    cr_assert(e.ok);
    cr_assert_eq(d.fired, 0);
    cr_assert_eq(uv_loop_close(&s.loop), 0);
    json_decref(a.result);
    json_decref(c.result);
    json_decref(e.result);
    hm_test_rmtree(s.dir);
}

/*
 * test_client: the trainer client library (lib/hivemind.h) against real
 * hivemindd processes: connecting, shared buffers the daemon sees, rounds
 * averaged in shared memory (blocking and in the background), bad
 * shared-memory references, segments released when a trainer goes, a
 * trainer's connection kept through idleness while it holds buffers, a
 * connect to a stopped daemon that times out, and the generic call
 * (hmc_call: result and reply line, the daemon's errors passed through, its
 * own timeout). The reply parser is checked on hand-made lines too.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <grp.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lib/hivemind.h"
#include "tests/proc.h"

static void setup(void) { hm_proc_setup("client"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(client, .init = setup, .fini = teardown, .timeout = 90);

static hmc *attach(struct node *n)
{
    hmc *h;
    char err[256];
    int r = hmc_connect(n->sock, &h, err, sizeof(err));
    cr_assert_eq(r, 0, "connect: %s", err);
    return h;
}

static json_t *info(hmc *h)
{
    char *text;
    cr_assert_eq(hmc_info(h, &text), 0, "info: %s", hmc_last_error(h));
    json_t *j = json_loads(text, 0, NULL);
    hmc_free_string(text);
    cr_assert_not_null(j);
    return j;
}

static long shm_bytes(hmc *h)
{
    json_t *j = info(h);
    long b = (long)json_integer_value(json_object_get(json_object_get(j, "shm"), "bytes"));
    json_decref(j);
    return b;
}

static long rt_size(hmc *h)
{
    char *text;
    long size = -1;
    if (hmc_request(h, "dht.info", NULL, &text) != 0)
        return -1;
    json_t *j = json_loads(text, 0, NULL);
    hmc_free_string(text);
    size = (long)json_integer_value(json_object_get(json_object_get(j, "routing_table"), "size"));
    json_decref(j);
    return size;
}

Test(client, version_macros_match_the_package)
{
    /* Programs built against hivemind.h test these; they follow the release. */
    char v[32];
    snprintf(v, sizeof(v), "%d.%d.%d", HMC_VERSION_MAJOR, HMC_VERSION_MINOR, HMC_VERSION_PATCH);
    cr_assert_str_eq(v, PACKAGE_VERSION);
    cr_assert_str_eq(HMC_VERSION, PACKAGE_VERSION);
}

Test(client, connect_errors_are_clear)
{
    hmc *h = (hmc *)1;
    char err[512], path[256];
    snprintf(path, sizeof(path), "%s/nobody.sock", tmpdir);
    int r = hmc_connect(path, &h, err, sizeof(err));
    cr_assert_eq(r, -ENOENT);
    cr_assert_null(h);
    cr_assert(strstr(err, "cannot connect to hivemindd") != NULL && strstr(err, path) != NULL,
              "%s", err);
    cr_assert(strstr(err, "HIVEMINDD_CONTROL_SOCKET") != NULL, "%s", err);

    char longp[300];
    memset(longp, 'x', sizeof(longp) - 1);
    longp[0] = '/';
    longp[sizeof(longp) - 1] = '\0';
    cr_assert_eq(hmc_connect(longp, &h, err, sizeof(err)), -ENAMETOOLONG);
    cr_assert(strstr(err, "too long") != NULL, "%s", err);

    /* The environment names the socket when no path is given. */
    setenv("HIVEMINDD_CONTROL_SOCKET", path, 1);
    cr_assert_eq(hmc_connect(NULL, &h, err, sizeof(err)), -ENOENT);
    cr_assert(strstr(err, path) != NULL, "%s", err);
}

/*
 * As an unprivileged member of the control socket's group: connects, maps
 * a shared buffer and fills it. Exit 0 on success, 10 + step otherwise.
 */
static int as_group_member(const char *sock, gid_t gid)
{
    gid_t groups[1] = {gid};
    if (setgroups(1, groups) != 0 || setgid(gid) != 0 || setuid(65534) != 0)
        return 10;
    hmc *h;
    char err[256];
    if (hmc_connect(sock, &h, err, sizeof(err)) != 0) {
        fprintf(stderr, "connect: %s\n", err);
        return 11;
    }
    hmc_buf *b;
    if (hmc_buf_alloc(h, 4096, &b) != 0) {
        fprintf(stderr, "alloc: %s\n", hmc_last_error(h));
        return 12;
    }
    memset(hmc_buf_data(b), 0x5a, 4096);
    hmc_buf_free(b);
    hmc_close(h);
    return 0;
}

Test(client, a_trainer_in_the_socket_group_maps_buffers)
{
    /* Under the shipped unit only members of ControlSocketGroup reach the
     * daemon; they must also be able to map its segments. */
    if (geteuid() != 0)
        cr_skip_test("needs root, to run the trainer as another user");
    struct group *g = getgrnam("nogroup");
    cr_assert_not_null(g, "Debian has the group nogroup");
    gid_t gid = g->gr_gid;
    struct node n;
    start_node(&n, "grp", NULL, "--control-socket-group", "nogroup", NULL);
    /* The socket is 0660 in the group; its directories must let the user by. */
    cr_assert_eq(chmod(tmpdir, 0711), 0);
    cr_assert_eq(chmod(n.dir, 0711), 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0)
        _exit(as_group_member(n.sock, gid));
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the group member failed at step %d",
              WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    stop_node(&n);
}

Test(client, buffers_are_the_daemons_memory)
{
    struct node n;
    start_node(&n, "solo", NULL, NULL);
    hmc *h = attach(&n);
    hmc_buf *b;
    const size_t N = 1000;
    cr_assert_eq(hmc_buf_alloc(h, N * sizeof(float), &b), 0, "%s", hmc_last_error(h));
    cr_assert_eq(hmc_buf_size(b), N * sizeof(float));
    cr_assert_neq(hmc_buf_id(b), 0);
    cr_assert_eq(shm_bytes(h), (long)(N * sizeof(float)));
    float *x = hmc_buf_data(b);
    for (size_t i = 0; i < N; i++)
        cr_assert_eq(x[i], 0.0f);

    /* The daemon reads what we wrote: a NaN at element 700 is refused... */
    for (size_t i = 0; i < N; i++)
        x[i] = (float)i * 0.25f;
    x[700] = NAN;
    hmc_avg_opts o;
    hmc_avg_opts_init(&o);
    o.prefix = "client.solo";
    o.target_group_size = 1;
    o.timeout_s = 5;
    o.round_timeout_s = 5;
    char *report = NULL;
    int r = hmc_average(h, b, 0, N, &o, &report);
    cr_assert_eq(r, -EREMOTEIO);
    cr_assert_null(report);
    cr_assert_str_eq(hmc_last_error_code(h), "bad_args");
    cr_assert(strstr(hmc_last_error(h), "NaN") != NULL, "%s", hmc_last_error(h));
    /* ...but not outside the range the round names. */
    r = hmc_average(h, b, 0, 700, &o, &report);
    cr_assert_eq(r, 0, "%s: %s", hmc_last_error_code(h), hmc_last_error(h));
    json_t *rep = json_loads(report, 0, NULL);
    hmc_free_string(report);
    cr_assert_eq(json_integer_value(json_object_get(rep, "elements")), 700);
    cr_assert(json_is_true(json_object_get(rep, "ok")));
    json_decref(rep);
    for (size_t i = 0; i < 700; i++)
        cr_assert_eq(x[i], (float)i * 0.25f, "a group of one keeps the values");

    /* Client-side checks need no daemon round trip. */
    cr_assert_eq(hmc_average(h, b, 900, 101, &o, NULL), -EINVAL);
    cr_assert(strstr(hmc_last_error(h), "do not fit") != NULL, "%s", hmc_last_error(h));
    cr_assert_eq(hmc_average(h, b, 0, 0, &o, NULL), -EINVAL);
    o.prefix = NULL;
    cr_assert_eq(hmc_average(h, b, 0, 10, &o, NULL), -EINVAL);

    /* An expert call that needs no answer at all is refused here, as the
     * daemon would refuse it. */
    hmc_expert ex;
    memset(&ex, 0, sizeof(ex));
    snprintf(ex.uid, sizeof(ex.uid), "ffn.0.0");
    snprintf(ex.peer, sizeof(ex.peer), "%s", n.addr);
    cr_assert_eq(hmc_experts_forward(h, &ex, 1, b, 0, b, 4, 1, 4, 0, 1.0, 0.0, NULL, NULL),
                 -EINVAL);
    cr_assert(strstr(hmc_last_error(h), "k_min") != NULL, "%s", hmc_last_error(h));
    cr_assert_str_eq(hmc_last_error_code(h), "");
    cr_assert_eq(hmc_experts_backward(h, &ex, 1, b, 0, b, 4, b, 8, 1, 4, 0, 1.0, NULL, NULL),
                 -EINVAL);

    /* The generic request and strict args. */
    char *res;
    cr_assert_eq(hmc_request(h, "info", "[1]", &res), -EINVAL);
    cr_assert_eq(hmc_request(h, "no.such", "{}", &res), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h), "unknown_command");

    hmc_buf_free(b);
    cr_assert_eq(shm_bytes(h), 0);
    hmc_close(h);
    stop_node(&n);
}

Test(client, bad_shm_references_are_clear_errors)
{
    struct node n;
    char args[512], *res = NULL;
    start_node(&n, "bad", NULL, NULL);
    hmc *h = attach(&n);
    hmc_buf *b, *g;
    cr_assert_eq(hmc_buf_alloc(h, 4096, &b), 0, "%s", hmc_last_error(h));
    unsigned long long id = (unsigned long long)hmc_buf_id(b);

    /* A wrong id. */
    snprintf(args, sizeof(args),
             "{\"prefix\":\"x\",\"data\":{\"shm\":%llu,\"offset\":0,\"elems\":4}}", id ^ 1);
    cr_assert_eq(hmc_request(h, "average", args, &res), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h), "bad_args");
    cr_assert(strstr(hmc_last_error(h), "no shared-memory segment") != NULL, "%s",
              hmc_last_error(h));
    /* Out of range, and a misaligned offset. */
    snprintf(args, sizeof(args),
             "{\"prefix\":\"x\",\"data\":{\"shm\":%llu,\"offset\":4000,\"elems\":25}}", id);
    cr_assert_eq(hmc_request(h, "average", args, &res), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h), "bad_args");
    cr_assert(strstr(hmc_last_error(h), "do not fit") != NULL, "%s", hmc_last_error(h));
    snprintf(args, sizeof(args),
             "{\"prefix\":\"x\",\"data\":{\"shm\":%llu,\"offset\":2,\"elems\":1}}", id);
    cr_assert_eq(hmc_request(h, "average", args, &res), -EREMOTEIO);
    /* Not a reference at all, or both forms at once. */
    cr_assert_eq(hmc_request(h, "average", "{\"prefix\":\"x\",\"data\":7}", &res), -EREMOTEIO);
    cr_assert(strstr(hmc_last_error(h), "shared-memory reference") != NULL, "%s",
              hmc_last_error(h));
    snprintf(args, sizeof(args),
             "{\"prefix\":\"x\",\"in\":\"/a\",\"out\":\"/b\",\"data\":{\"shm\":%llu,"
             "\"elems\":1}}", id);
    cr_assert_eq(hmc_request(h, "average", args, &res), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h), "bad_args");

    /* Freed. */
    cr_assert_eq(hmc_buf_alloc(h, 64, &g), 0);
    unsigned long long gid = (unsigned long long)hmc_buf_id(g);
    hmc_buf_free(g);
    snprintf(args, sizeof(args), "{\"prefix\":\"x\",\"data\":{\"shm\":%llu,\"elems\":4}}", gid);
    cr_assert_eq(hmc_request(h, "average", args, &res), -EREMOTEIO);
    cr_assert(strstr(hmc_last_error(h), "no shared-memory segment") != NULL, "%s",
              hmc_last_error(h));
    snprintf(args, sizeof(args), "{\"shm\":%llu}", gid);
    cr_assert_eq(hmc_request(h, "shm.free", args, &res), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h), "not_found");

    /* Another connection may name the segment but not free it. */
    hmc *other = attach(&n);
    snprintf(args, sizeof(args), "{\"shm\":%llu}", id);
    cr_assert_eq(hmc_request(other, "shm.free", args, &res), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(other), "not_owner");
    cr_assert_eq(hmc_request(h, "shm.alloc", "{\"bytes\":0}", &res), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h), "bad_args");
    cr_assert_eq(hmc_request(h, "shm.alloc", "{\"bytes\":1099511627776000}", &res), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h), "limit");

    /* The daemon keeps serving both. */
    cr_assert_eq(shm_bytes(other), 4096);
    cr_assert_eq(shm_bytes(h), 4096);
    hmc_close(other);
    hmc_buf_free(b);
    hmc_close(h);
    stop_node(&n);
}

Test(client, a_trainer_that_leaves_has_its_segments_released)
{
    struct node n;
    start_node(&n, "leave", NULL, NULL);
    hmc *watcher = attach(&n);
    hmc *h = attach(&n);
    hmc_buf *b1, *b2;
    cr_assert_eq(hmc_buf_alloc(h, 1 << 20, &b1), 0, "%s", hmc_last_error(h));
    cr_assert_eq(hmc_buf_alloc(h, 12345, &b2), 0, "%s", hmc_last_error(h));
    memset(hmc_buf_data(b1), 7, 1 << 20);
    cr_assert_eq(shm_bytes(watcher), (1 << 20) + 12345);
    hmc_close(h);
    long deadline = hm_test_now_ms() + 5000, bytes = -1;
    while (hm_test_now_ms() < deadline && (bytes = shm_bytes(watcher)) != 0)
        usleep(20000);
    cr_assert_eq(bytes, 0, "the daemon still holds %ld bytes", bytes);
    json_t *j = info(watcher);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "shm"), "segments")), 0);
    json_decref(j);
    /* Our side of the memory stays mapped until we free it. */
    cr_assert_eq(((unsigned char *)hmc_buf_data(b1))[12345], 7);
    hmc_buf_free(b1);
    hmc_buf_free(b2);
    hmc_close(watcher);
    stop_node(&n);
}

Test(client, a_trainer_with_buffers_is_never_idle_closed)
{
    struct node n;
    start_node(&n, "idle", NULL, "--control-idle-timeout", "1", NULL);
    hmc *h = attach(&n), *plain = attach(&n);
    hmc_buf *b;
    const size_t N = 256;
    cr_assert_eq(hmc_buf_alloc(h, N * sizeof(float), &b), 0, "%s", hmc_last_error(h));
    float *x = hmc_buf_data(b);
    for (size_t i = 0; i < N; i++)
        x[i] = (float)i;
    char *res;
    cr_assert_eq(hmc_info(plain, &res), 0, "%s", hmc_last_error(plain));
    hmc_free_string(res);
    /* "Training": both connections stay silent for four idle timeouts. */
    sleep(4);
    /* The one without buffers was closed, and says why... */
    cr_assert_eq(hmc_info(plain, &res), -EPIPE, "%s", hmc_last_error(plain));
    cr_assert_str_eq(hmc_last_error_code(plain), "idle_timeout");
    cr_assert(strstr(hmc_last_error(plain), "inactivity") != NULL, "%s", hmc_last_error(plain));
    hmc_close(plain);
    /* ...the trainer's is open, its buffer still the daemon's, and a round
     * on it (on a connection of its own) works. */
    cr_assert_eq(shm_bytes(h), (long)(N * sizeof(float)), "%s", hmc_last_error(h));
    hmc_avg_opts o;
    hmc_avg_opts_init(&o);
    o.prefix = "client.idle";
    o.target_group_size = 1;
    o.timeout_s = 5;
    o.round_timeout_s = 5;
    o.matchmaking_time_s = 0.5;
    hmc_round *rd;
    cr_assert_eq(hmc_average_start(h, b, 0, N, &o, &rd), 0, "%s", hmc_last_error(h));
    cr_assert_eq(hmc_round_wait(rd, -1, NULL), 0, "%s: %s", hmc_round_error_code(rd),
                 hmc_round_error(rd));
    hmc_round_free(rd);
    for (size_t i = 0; i < N; i++)
        cr_assert_eq(x[i], (float)i, "a group of one keeps the values");
    /* Without buffers it is an ordinary client again and idles out. */
    hmc_buf_free(b);
    sleep(3);
    cr_assert_eq(hmc_info(h, &res), -EPIPE, "still open after giving its buffer back");
    cr_assert_str_eq(hmc_last_error_code(h), "idle_timeout");
    hmc_close(h);
    stop_node(&n);
}

Test(client, connect_to_a_daemon_that_does_not_accept_times_out)
{
    struct node n;
    char err[512];
    int fillers[256];
    size_t n_fill = 0;
    start_node(&n, "stopped", NULL, NULL);
    cr_assert_eq(kill(n.pid, SIGSTOP), 0);
    /* Fill the stopped daemon's backlog until connect would have to wait. */
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    cr_assert_lt(strlen(n.sock), sizeof(sa.sun_path));
    memcpy(sa.sun_path, n.sock, strlen(n.sock) + 1);
    for (;;) {
        cr_assert_lt(n_fill, sizeof(fillers) / sizeof(fillers[0]), "the backlog never filled");
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        cr_assert_geq(fd, 0);
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
            cr_assert_eq(errno, EAGAIN, "connect: %s", strerror(errno));
            close(fd);
            break;
        }
        fillers[n_fill++] = fd;
    }
    hmc *h = (hmc *)1;
    long t0 = hm_test_now_ms();
    int r = hmc_connect_timeout(n.sock, 500, &h, err, sizeof(err));
    long took = hm_test_now_ms() - t0;
    cr_assert_eq(r, -ETIMEDOUT, "%d: %s", r, err);
    cr_assert_null(h);
    cr_assert(took >= 400 && took < 5000, "gave up after %ld ms", took);
    cr_assert(strstr(err, "did not accept") != NULL && strstr(err, n.sock) != NULL, "%s", err);
    cr_assert_eq(hmc_connect_timeout(n.sock, 0, &h, err, sizeof(err)), -EINVAL);

    /* Once the daemon runs again, the backlog drains and connecting works. */
    cr_assert_eq(kill(n.pid, SIGCONT), 0);
    for (size_t i = 0; i < n_fill; i++)
        close(fillers[i]);
    r = hmc_connect_timeout(n.sock, 10000, &h, err, sizeof(err));
    cr_assert_eq(r, 0, "%s", err);
    char *res;
    cr_assert_eq(hmc_info(h, &res), 0, "%s", hmc_last_error(h));
    hmc_free_string(res);
    hmc_close(h);
    stop_node(&n);
}

Test(client, call_gives_the_result_and_the_reply_line)
{
    struct node n;
    char *res, *line;
    start_node(&n, "call", NULL, NULL);
    hmc *h = attach(&n);
    cr_assert_eq(hmc_call(h, "dht.info", "{}", 5000, &res, &line), 0, "%s", hmc_last_error(h));
    json_t *r = json_loads(res, 0, NULL), *l = json_loads(line, 0, NULL);
    cr_assert(json_is_object(json_object_get(r, "routing_table")), "%s", res);
    /* The line is the whole reply as the daemon sent it, its result the same object. */
    cr_assert(json_is_true(json_object_get(l, "ok")), "%s", line);
    cr_assert(json_is_integer(json_object_get(l, "id")), "%s", line);
    cr_assert(json_equal(json_object_get(l, "result"), r), "%s vs %s", line, res);
    cr_assert_null(strchr(line, '\n'));
    json_decref(r);
    json_decref(l);
    hmc_free_string(res);
    hmc_free_string(line);
    /* Either output may be left out; 0 is the handle's timeout. */
    cr_assert_eq(hmc_call(h, "info", NULL, 0, NULL, NULL), 0, "%s", hmc_last_error(h));
    res = line = (char *)1;
    cr_assert_eq(hmc_call(h, "info", "[1]", 5000, &res, &line), -EINVAL);
    cr_assert_null(res);
    cr_assert_null(line);
    cr_assert_eq(hmc_call(h, "info", NULL, -1, &res, &line), -EINVAL);
    cr_assert_eq(hmc_call(h, "", NULL, 5000, &res, &line), -EINVAL);
    /* Refused requests leave the connection as good as it was. */
    cr_assert_eq(hmc_call(h, "info", NULL, 5000, &res, NULL), 0, "%s", hmc_last_error(h));
    hmc_free_string(res);
    hmc_close(h);
    stop_node(&n);
}

Test(client, call_passes_the_daemons_error_through)
{
    struct node n;
    char *res = (char *)1, *line;
    start_node(&n, "callerr", NULL, NULL);
    hmc *h = attach(&n);
    cr_assert_eq(hmc_call(h, "no.such.command", "{\"x\":1}", 5000, &res, &line), -EREMOTEIO);
    cr_assert_null(res);
    cr_assert_str_eq(hmc_last_error_code(h), "unknown_command");
    cr_assert(strstr(hmc_last_error(h), "no.such.command") != NULL, "%s", hmc_last_error(h));
    /* The error reply's line comes too, in the daemon's words. */
    cr_assert_not_null(line);
    json_t *l = json_loads(line, 0, NULL);
    cr_assert(json_is_false(json_object_get(l, "ok")), "%s", line);
    const json_t *e = json_object_get(l, "error");
    cr_assert_str_eq(json_string_value(json_object_get(e, "code")), "unknown_command");
    cr_assert_str_eq(json_string_value(json_object_get(e, "message")), hmc_last_error(h));
    json_decref(l);
    hmc_free_string(line);
    /* An error reply answers its request: the next one works. */
    cr_assert_eq(hmc_call(h, "info", NULL, 5000, &res, &line), 0, "%s", hmc_last_error(h));
    cr_assert_str_eq(hmc_last_error_code(h), "");
    hmc_free_string(res);
    hmc_free_string(line);
    hmc_close(h);
    stop_node(&n);
}

Test(client, call_times_out_and_the_handle_is_then_unusable)
{
    struct node n;
    char *res = (char *)1, *line = (char *)1;
    start_node(&n, "calltime", NULL, NULL);
    hmc *h = attach(&n);
    /* The daemon accepted the connection; stopped, it never answers. */
    cr_assert_eq(hmc_call(h, "info", NULL, 5000, NULL, NULL), 0, "%s", hmc_last_error(h));
    cr_assert_eq(kill(n.pid, SIGSTOP), 0);
    long t0 = hm_test_now_ms();
    int r = hmc_call(h, "info", NULL, 300, &res, &line);
    long took = hm_test_now_ms() - t0;
    cr_assert_eq(kill(n.pid, SIGCONT), 0);
    cr_assert_eq(r, -ETIMEDOUT, "%d: %s", r, hmc_last_error(h));
    cr_assert(took >= 250 && took < 3000, "gave up after %ld ms", took);
    cr_assert_null(res);
    cr_assert_null(line);
    /* The late reply must not be taken for the next request's. */
    r = hmc_call(h, "dht.info", NULL, 5000, &res, &line);
    cr_assert_eq(r, -EPIPE, "%d: %s", r, hmc_last_error(h));
    cr_assert_null(line);
    hmc_close(h);
    /* A fresh connection to the running daemon works, within the handle's own timeout. */
    h = attach(&n);
    hmc_set_timeout(h, 5000);
    cr_assert_eq(hmc_call(h, "info", NULL, 0, &res, NULL), 0, "%s", hmc_last_error(h));
    hmc_free_string(res);
    hmc_close(h);
    stop_node(&n);
}

#define N_TRAINERS 3
#define N_ELEMS 30000

Test(client, three_trainers_average_in_shared_memory)
{
    struct node nodes[N_TRAINERS];
    hmc *h[N_TRAINERS];
    hmc_buf *b[N_TRAINERS];
    hmc_round *rd[N_TRAINERS];
    const double w[N_TRAINERS] = {1.0, 2.0, 5.0};
    char name[16];

    start_node(&nodes[0], "t0", NULL, NULL);
    for (int i = 1; i < N_TRAINERS; i++) {
        snprintf(name, sizeof(name), "t%d", i);
        start_node(&nodes[i], name, NULL, "--initial-peers", nodes[0].addr, NULL);
    }
    for (int i = 0; i < N_TRAINERS; i++)
        h[i] = attach(&nodes[i]);
    long deadline = hm_test_now_ms() + 20000;
    for (int i = 0; i < N_TRAINERS; i++)
        while (rt_size(h[i]) < N_TRAINERS - 1) {
            cr_assert_lt(hm_test_now_ms(), deadline, "daemon %d does not know the others", i);
            usleep(100000);
        }
    /* Quarter steps: every weighted mean below is exact in float32. */
    for (int i = 0; i < N_TRAINERS; i++) {
        cr_assert_eq(hmc_buf_alloc(h[i], N_ELEMS * sizeof(float), &b[i]), 0, "%s",
                     hmc_last_error(h[i]));
        float *x = hmc_buf_data(b[i]);
        for (size_t k = 0; k < N_ELEMS; k++)
            x[k] = (float)((long)((k * 7 + (size_t)i * 131) % 97) - 48) * 0.25f;
    }
    hmc_avg_opts o;
    hmc_avg_opts_init(&o);
    o.prefix = "client.three";
    o.target_group_size = N_TRAINERS;
    o.min_group_size = N_TRAINERS;
    o.timeout_s = 20;
    o.round_timeout_s = 20;
    o.matchmaking_time_s = 3;
    for (int i = 0; i < N_TRAINERS; i++) {
        o.weight = w[i];
        cr_assert_eq(hmc_average_start(h[i], b[i], 0, N_ELEMS, &o, &rd[i]), 0, "%s",
                     hmc_last_error(h[i]));
    }
    /* The trainer keeps computing while the rounds run. */
    volatile double acc = 0;
    long busy_polls = 0;
    int done = 0;
    deadline = hm_test_now_ms() + 45000;
    while (done < N_TRAINERS) {
        cr_assert_lt(hm_test_now_ms(), deadline, "the rounds did not finish");
        for (int k = 0; k < 20000; k++)
            acc += sqrt((double)k);
        done = 0;
        for (int i = 0; i < N_TRAINERS; i++)
            done += hmc_round_done(rd[i]);
        busy_polls += done < N_TRAINERS;
    }
    cr_assert_gt(busy_polls, 0, "the rounds should take a while (matchmaking)");
    for (int i = 0; i < N_TRAINERS; i++) {
        char *report;
        int r = hmc_round_wait(rd[i], 0, &report);
        cr_assert_eq(r, 0, "trainer %d: %s: %s", i, hmc_round_error_code(rd[i]),
                     hmc_round_error(rd[i]));
        json_t *rep = json_loads(report, 0, NULL);
        hmc_free_string(report);
        cr_assert_eq(json_integer_value(json_object_get(rep, "group_size")), N_TRAINERS);
        cr_assert_eq(json_array_size(json_object_get(rep, "left_out")), 0);
        json_decref(rep);
        cr_assert_eq(hmc_round_wait(rd[i], 0, NULL), 0, "the outcome stays");
        hmc_round_free(rd[i]);
    }
    for (int i = 0; i < N_TRAINERS; i++) {
        const float *x = hmc_buf_data(b[i]);
        for (size_t k = 0; k < N_ELEMS; k++) {
            double s = 0, ws = 0;
            for (int j = 0; j < N_TRAINERS; j++) {
                s += w[j] * ((double)((long)((k * 7 + (size_t)j * 131) % 97) - 48) * 0.25);
                ws += w[j];
            }
            double e = s / ws;
            if (fabs(x[k] - e) > 1e-6 * (1 + fabs(e)))
                cr_assert_fail("trainer %d element %zu: %.9g, expected %.9g", i, k,
                               (double)x[k], e);
        }
    }
    /* A blocking round on the handle's own connection works the same way. */
    for (int i = 0; i < N_TRAINERS; i++) {
        o.weight = 1;
        o.prefix = "client.three.bg";
        cr_assert_eq(hmc_average_start(h[i], b[i], 0, 100, &o, &rd[i]), 0);
    }
    for (int i = 0; i < N_TRAINERS; i++) {
        cr_assert_eq(hmc_round_wait(rd[i], -1, NULL), 0, "%s", hmc_round_error(rd[i]));
        hmc_round_free(rd[i]);
    }
    for (int i = 0; i < N_TRAINERS; i++) {
        hmc_buf_free(b[i]);
        hmc_close(h[i]);
        stop_node(&nodes[i]);
    }
}

Test(client, reply_parser_is_strict)
{
    char code[64], err[256], *res;
    const char *ok = "{\"id\":3,\"ok\":true,\"result\":{\"a\":1}}";
    cr_assert_eq(hmc_parse_reply(ok, strlen(ok), 3, &res, code, sizeof(code), err, sizeof(err)),
                 0);
    cr_assert_str_eq(res, "{\"a\":1}");
    hmc_free_string(res);
    cr_assert_eq(hmc_parse_reply(ok, strlen(ok), 4, &res, code, sizeof(code), err, sizeof(err)),
                 -EPROTO, "another request's reply");
    const char *noresult = "{\"id\":1,\"ok\":true}";
    cr_assert_eq(hmc_parse_reply(noresult, strlen(noresult), 1, &res, code, sizeof(code), err,
                                 sizeof(err)), 0);
    cr_assert_str_eq(res, "{}");
    hmc_free_string(res);
    const char *e = "{\"id\":1,\"ok\":false,\"error\":{\"code\":\"busy\",\"message\":\"later\"}}";
    cr_assert_eq(hmc_parse_reply(e, strlen(e), 1, &res, code, sizeof(code), err, sizeof(err)),
                 -EREMOTEIO);
    cr_assert_null(res);
    cr_assert_str_eq(code, "busy");
    cr_assert_str_eq(err, "later");
    const char *bad[] = {
        "", "[]", "{\"ok\":1}", "{\"id\":1,\"ok\":true,\"result\":[]}",
        "{\"id\":1,\"ok\":false}", "{\"id\":1,\"ok\":false,\"error\":{\"code\":5}}",
        "{\"id\":1,\"ok\":true,\"ok\":false}", "{\"id\":1,\"ok\":true} x",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        cr_assert_eq(hmc_parse_reply(bad[i], strlen(bad[i]), 1, &res, code, sizeof(code), err,
                                     sizeof(err)), -EPROTO, "accepted %s", bad[i]);
}

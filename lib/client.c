/*
 * client: libhivemind, the trainer client library (see hivemind.h). It
 * owns the trainer's connections to the daemon's control socket, their
 * read buffers, and the mappings of the shared buffers the daemon
 * allocated for it. Every connect, read and write has a deadline;
 * every reply line is bounded (HMC_MAX_REPLY) and parsed strictly: an
 * object with a boolean "ok", the request's id echoed, and a "result"
 * object or an "error" object with string "code" and "message".
 *
 * A connection that timed out in the middle of a request, or received
 * something it could not parse, no longer knows which reply answers which
 * request; it is marked broken and every later call on it fails at once
 * with -EPIPE, so a stale reply is never taken for a fresh one.
 *
 * hivemindctl is a client of this library too (hmc_call), so the tree has
 * one control-socket client and one set of deadline and parsing rules.
 *
 * Only libc and jansson: no libuv, no state shared between handles.
 */
#include "config.h"

#include "lib/hivemind.h"
#include "src/base/paths.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define PATH_LEN sizeof(((struct sockaddr_un *)0)->sun_path)
/* The daemon's request line bound (control.h, HM_CONTROL_MAX_LINE). */
#define MAX_REQUEST (64 * 1024)
#define CODE_MAX 64
/* What a blocking averaging or expert call waits on top of its own timeouts. */
#define SLACK_MS 30000
#define DEFAULT_ROUND_S 30.0
#define READ_CHUNK 65536

struct conn {
    int fd;
    int broken;
    char *buf;
    size_t len, cap;
    size_t consume; /* bytes of the last line handed out, dropped on the next read */
    int64_t next_id;
};

struct hmc {
    struct conn c;
    char path[PATH_LEN];
    int timeout_ms;
    char err[HMC_ERROR_MAX];
    char code[CODE_MAX];
    LIST_HEAD(, hmc_buf) bufs; /* live buffers, detached on hmc_close */
};

struct hmc_buf {
    hmc *h; /* NULL once the connection is closed */
    LIST_ENTRY(hmc_buf) link; /* in h->bufs while h is set */
    void *data;
    size_t size;
    uint64_t id;
};

struct hmc_round {
    struct conn c;
    int64_t id;
    int64_t deadline_ms;
    int done;
    int status;
    char *report;
    char err[HMC_ERROR_MAX];
    char code[CODE_MAX];
};

/* ---- helpers ---- */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void fmt(char *buf, size_t len, const char *f, ...) __attribute__((format(printf, 3, 4)));
static void fmt(char *buf, size_t len, const char *f, ...)
{
    va_list ap;
    if (buf == NULL || len == 0)
        return;
    va_start(ap, f);
    vsnprintf(buf, len, f, ap);
    va_end(ap);
}

static void copy_str(char *dst, size_t len, const char *src)
{
    if (dst == NULL || len == 0)
        return;
    snprintf(dst, len, "%s", src);
}

void hmc_free_string(char *s) { free(s); }

/* ---- connections ---- */

static int conn_wait(struct conn *c, short events, int64_t deadline);

/*
 * Connects to path within timeout_ms. The socket is non-blocking from the
 * start: a blocking connect to a daemon that does not accept (stopped, or
 * its backlog full) would wait without end. A Unix stream socket answers a
 * full backlog with EAGAIN and leaves nothing in progress (poll would only
 * report a hang-up), so connect is tried again, with short growing pauses,
 * until the deadline; EINPROGRESS, where a system reports it, is waited for
 * with poll and SO_ERROR.
 */
static int conn_open(struct conn *c, const char *path, int timeout_ms, char *err, size_t errlen)
{
    struct sockaddr_un sa;
    int result = 0, pause_ms = 2;
    int64_t deadline = now_ms() + timeout_ms;

    memset(c, 0, sizeof(*c));
    c->fd = -1;
    c->next_id = 1;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof(sa.sun_path)) {
        fmt(err, errlen, "control socket path too long (at most %zu bytes): %s",
            sizeof(sa.sun_path) - 1, path);
        return -ENAMETOOLONG;
    }
    memcpy(sa.sun_path, path, strlen(path) + 1);
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (c->fd < 0) {
        result = -errno;
        fmt(err, errlen, "socket: %s", strerror(-result));
        goto out;
    }
    for (;;) {
        if (connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
            break;
        int e = errno;
        if (e == EINTR)
            continue;
        if (e == EINPROGRESS) {
            int so = 0;
            socklen_t sl = sizeof(so);
            result = conn_wait(c, POLLOUT, deadline);
            if (result == 0 && getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &so, &sl) != 0)
                result = -errno;
            else if (result == 0)
                result = -so;
            if (result == 0)
                break;
            e = -result;
        } else if (e == EAGAIN) {
            int64_t left = deadline - now_ms();
            if (left > 0) {
                /* The backlog is full: let the daemon take some, then retry. */
                struct timespec ts = {0, (long)(left < pause_ms ? left : pause_ms) * 1000000L};
                nanosleep(&ts, NULL);
                if (pause_ms < 50)
                    pause_ms *= 2;
                continue;
            }
            e = ETIMEDOUT;
        }
        result = -e;
        if (e == ETIMEDOUT)
            fmt(err, errlen, "hivemindd at %s did not accept the connection within %d ms (is "
                "the daemon stopped or overloaded?)", path, timeout_ms);
        else
            fmt(err, errlen, "cannot connect to hivemindd at %s: %s%s", path, strerror(e),
                e == ENOENT || e == ECONNREFUSED
                    ? " (is the daemon running? pass its --control-socket path or set "
                      "HIVEMINDD_CONTROL_SOCKET)"
                    : "");
        goto out;
    }
out:
    if (result != 0 && c->fd >= 0) {
        close(c->fd);
        c->fd = -1;
    }
    return result;
}

static void conn_close(struct conn *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    free(c->buf);
    c->buf = NULL;
    c->len = c->cap = c->consume = 0;
}

/* Waits for events on the socket until deadline; 0, -ETIMEDOUT or -errno. */
static int conn_wait(struct conn *c, short events, int64_t deadline)
{
    for (;;) {
        int64_t left = deadline - now_ms();
        struct pollfd p = {.fd = c->fd, .events = events};
        int r = poll(&p, 1, left <= 0 ? 0 : left > 60000 ? 60000 : (int)left);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -errno;
        if (r > 0)
            return 0;
        if (left <= 0)
            return -ETIMEDOUT;
    }
}

static int conn_send(struct conn *c, const char *data, size_t len, int64_t deadline, char *err,
                     size_t errlen)
{
    size_t done = 0;
    while (done < len) {
        ssize_t n = send(c->fd, data + done, len - done, MSG_NOSIGNAL);
        if (n >= 0) {
            done += (size_t)n;
            continue;
        }
        if (errno == EINTR)
            continue;
        int r = errno == EAGAIN || errno == EWOULDBLOCK ? conn_wait(c, POLLOUT, deadline) : -errno;
        if (r != 0) {
            c->broken = 1;
            fmt(err, errlen, r == -ETIMEDOUT ? "the daemon did not take the request in time"
                                             : "sending to the daemon: %s",
                strerror(-r));
            return r == -ETIMEDOUT ? r : -EPIPE;
        }
    }
    return 0;
}

/*
 * Reads one line (without its newline) into *line_out, valid until the next
 * read. 0, -ETIMEDOUT (nothing complete by deadline; the connection stays
 * usable for the caller to decide), -EPIPE (closed or failed) or -EMSGSIZE.
 */
static int conn_read_line(struct conn *c, int64_t deadline, char **line_out, size_t *len_out,
                          char *err, size_t errlen)
{
    size_t scanned = 0;
    if (c->consume > 0) {
        memmove(c->buf, c->buf + c->consume, c->len - c->consume);
        c->len -= c->consume;
        c->consume = 0;
    }
    for (;;) {
        char *nl = c->len > scanned ? memchr(c->buf + scanned, '\n', c->len - scanned) : NULL;
        if (nl != NULL) {
            *line_out = c->buf;
            *len_out = (size_t)(nl - c->buf);
            c->consume = *len_out + 1;
            return 0;
        }
        scanned = c->len;
        if (c->len >= HMC_MAX_REPLY) {
            c->broken = 1;
            fmt(err, errlen, "the daemon's reply is longer than %zu bytes", HMC_MAX_REPLY);
            return -EMSGSIZE;
        }
        if (c->cap - c->len < READ_CHUNK && c->cap < HMC_MAX_REPLY) {
            size_t cap = c->cap ? c->cap * 2 : READ_CHUNK * 2;
            if (cap > HMC_MAX_REPLY)
                cap = HMC_MAX_REPLY;
            char *nb = realloc(c->buf, cap);
            if (nb == NULL) {
                fmt(err, errlen, "out of memory for the daemon's reply");
                return -ENOMEM;
            }
            c->buf = nb;
            c->cap = cap;
        }
        ssize_t n = recv(c->fd, c->buf + c->len, c->cap - c->len, 0);
        if (n > 0) {
            c->len += (size_t)n;
            continue;
        }
        if (n == 0) {
            c->broken = 1;
            fmt(err, errlen, "the daemon closed the connection");
            return -EPIPE;
        }
        if (errno == EINTR)
            continue;
        int r = errno == EAGAIN || errno == EWOULDBLOCK ? conn_wait(c, POLLIN, deadline) : -errno;
        if (r == -ETIMEDOUT) {
            fmt(err, errlen, "no reply from the daemon in time");
            return r;
        }
        if (r != 0) {
            c->broken = 1;
            fmt(err, errlen, "reading from the daemon: %s", strerror(-r));
            return -EPIPE;
        }
    }
}

/* ---- replies ---- */

static int parse_reply(const char *line, size_t len, int64_t expect_id, json_t **result_out,
                       char *code, size_t codelen, char *err, size_t errlen)
{
    json_error_t jerr;
    json_t *o = NULL;
    int result = -EPROTO;

    copy_str(code, codelen, "");
    if (result_out != NULL)
        *result_out = NULL;
    if (len > HMC_MAX_REPLY) {
        fmt(err, errlen, "the daemon's reply is longer than %zu bytes", HMC_MAX_REPLY);
        return -EPROTO;
    }
    o = json_loadb(line, len, JSON_REJECT_DUPLICATES, &jerr);
    if (o == NULL) {
        fmt(err, errlen, "the daemon's reply is not JSON: %s", jerr.text);
        goto out;
    }
    if (!json_is_object(o)) {
        fmt(err, errlen, "the daemon's reply is not a JSON object");
        goto out;
    }
    const json_t *ok = json_object_get(o, "ok");
    if (!json_is_boolean(ok)) {
        fmt(err, errlen, "the daemon's reply has no boolean \"ok\"");
        goto out;
    }
    if (expect_id >= 0) {
        const json_t *id = json_object_get(o, "id");
        if (!json_is_integer(id) || json_integer_value(id) != expect_id) {
            fmt(err, errlen, "the daemon's reply does not carry the request's id %lld",
                (long long)expect_id);
            goto out;
        }
    }
    if (json_is_true(ok)) {
        json_t *res = json_object_get(o, "result");
        if (res != NULL && !json_is_object(res)) {
            fmt(err, errlen, "the daemon's reply has a \"result\" that is not an object");
            goto out;
        }
        if (result_out != NULL) {
            *result_out = res != NULL ? json_incref(res) : json_object();
            if (*result_out == NULL) {
                fmt(err, errlen, "out of memory");
                result = -ENOMEM;
                goto out;
            }
        }
        fmt(err, errlen, "%s", "");
        result = 0;
        goto out;
    }
    const json_t *e = json_object_get(o, "error");
    const char *c = json_string_value(json_object_get(e, "code"));
    const char *m = json_string_value(json_object_get(e, "message"));
    if (!json_is_object(e) || c == NULL || m == NULL || c[0] == '\0' || strlen(c) >= CODE_MAX) {
        fmt(err, errlen, "the daemon's error reply lacks a valid \"code\" and \"message\"");
        goto out;
    }
    copy_str(code, codelen, c);
    fmt(err, errlen, "%s", m);
    result = -EREMOTEIO;
out:
    json_decref(o);
    return result;
}

int hmc_parse_reply(const char *line, size_t len, int64_t expect_id, char **result_json_out,
                    char *code, size_t codelen, char *err, size_t errlen)
{
    json_t *res = NULL;
    if (result_json_out != NULL)
        *result_json_out = NULL;
    if (line == NULL && len > 0) {
        fmt(err, errlen, "no reply");
        return -EINVAL;
    }
    int r = parse_reply(line != NULL ? line : "", len, expect_id,
                        result_json_out != NULL ? &res : NULL, code, codelen, err, errlen);
    if (r == 0 && result_json_out != NULL) {
        *result_json_out = json_dumps(res, JSON_COMPACT);
        if (*result_json_out == NULL) {
            fmt(err, errlen, "out of memory");
            r = -ENOMEM;
        }
    }
    json_decref(res);
    return r;
}

/* ---- requests ---- */

/* Sends {"cmd", "args", "id"} on c; args is taken over. *id_out gets the id. */
static int send_request(struct conn *c, const char *cmd, json_t *args, int64_t deadline,
                        int64_t *id_out, char *err, size_t errlen)
{
    int result = 0;
    char *text = NULL;
    int64_t id = c->next_id++;
    json_t *req = json_pack("{s:s, s:o, s:I}", "cmd", cmd, "args", args, "id", (json_int_t)id);
    if (req == NULL) {
        fmt(err, errlen, "out of memory, or a command name that is not UTF-8");
        return -ENOMEM;
    }
    text = json_dumps(req, JSON_COMPACT);
    if (text == NULL) {
        fmt(err, errlen, "out of memory");
        result = -ENOMEM;
        goto out;
    }
    size_t n = strlen(text);
    if (n + 1 > MAX_REQUEST) {
        fmt(err, errlen, "the request is %zu bytes; the daemon takes at most %d per line", n + 1,
            MAX_REQUEST);
        result = -EMSGSIZE;
        goto out;
    }
    /* JSON text never holds a raw newline, so the line ends where we say. */
    text[n] = '\n';
    result = conn_send(c, text, n + 1, deadline, err, errlen);
    *id_out = id;
out:
    free(text);
    json_decref(req);
    return result;
}

/*
 * Reads the reply to id on c until deadline; a timeout breaks the
 * connection. *line_out (if not NULL) gets a copy of the line when it was a
 * reply or the daemon's closing notice, NULL otherwise.
 */
static int read_reply(struct conn *c, int64_t id, int64_t deadline, json_t **result_out,
                      char **line_out, char *code, size_t codelen, char *err, size_t errlen)
{
    char *line;
    size_t len;
    if (line_out != NULL)
        *line_out = NULL;
    int r = conn_read_line(c, deadline, &line, &len, err, errlen);
    if (r == -ETIMEDOUT)
        c->broken = 1;
    if (r != 0)
        return r;
    r = parse_reply(line, len, id, result_out, code, codelen, err, errlen);
    if (r == -EPROTO) {
        /* The daemon's notices that end a connection (idle_timeout,
         * too_many_clients, line_too_long) answer no request and carry no
         * id: report them as the connection's end, in the daemon's words. */
        char msg[HMC_ERROR_MAX - 64];
        if (parse_reply(line, len, -1, NULL, code, codelen, msg, sizeof(msg)) == -EREMOTEIO) {
            fmt(err, errlen, "the daemon closed the connection: %s", msg);
            r = -EPIPE;
        }
    }
    if ((r == 0 || r == -EREMOTEIO || r == -EPIPE) && line_out != NULL) {
        *line_out = strndup(line, len);
        if (*line_out == NULL) {
            if (result_out != NULL) {
                json_decref(*result_out);
                *result_out = NULL;
            }
            fmt(err, errlen, "out of memory");
            r = -ENOMEM;
        }
    }
    if (r == -EPROTO || r == -ENOMEM || r == -EPIPE)
        c->broken = 1;
    return r;
}

/*
 * After a send failed on a connection the daemon ended: the daemon may have
 * said why first (idle_timeout, ...), in a line still waiting to be read.
 * If so, code and err get its reason; otherwise they are left as they are.
 */
static void take_notice(struct conn *c, char *code, size_t codelen, char *err, size_t errlen,
                        char **line_out)
{
    char *line, c2[CODE_MAX], e2[HMC_ERROR_MAX], msg[HMC_ERROR_MAX - 64];
    size_t len;
    if (conn_read_line(c, now_ms(), &line, &len, e2, sizeof(e2)) != 0)
        return;
    if (parse_reply(line, len, -1, NULL, c2, sizeof(c2), msg, sizeof(msg)) != -EREMOTEIO)
        return;
    copy_str(code, codelen, c2);
    fmt(err, errlen, "the daemon closed the connection: %s", msg);
    /* The notice is the daemon's reply to this request, as hmc_call says. */
    if (line_out != NULL)
        *line_out = strndup(line, len);
}

/*
 * One request on the handle's connection within timeout_ms; args is taken
 * over. line_out (may be NULL) as read_reply.
 */
static int call(hmc *h, const char *cmd, json_t *args, int timeout_ms, json_t **result_out,
                char **line_out)
{
    int64_t id;
    h->code[0] = '\0';
    if (result_out != NULL)
        *result_out = NULL;
    if (line_out != NULL)
        *line_out = NULL;
    if (args == NULL) {
        fmt(h->err, sizeof(h->err), "out of memory");
        return -ENOMEM;
    }
    if (h->c.broken || h->c.fd < 0) {
        json_decref(args);
        fmt(h->err, sizeof(h->err),
            "the connection to the daemon is unusable after an earlier failure; reconnect");
        return -EPIPE;
    }
    int64_t deadline = now_ms() + timeout_ms;
    int r = send_request(&h->c, cmd, args, deadline, &id, h->err, sizeof(h->err));
    if (r == -EPIPE)
        take_notice(&h->c, h->code, sizeof(h->code), h->err, sizeof(h->err), line_out);
    if (r != 0)
        return r;
    return read_reply(&h->c, id, deadline, result_out, line_out, h->code, sizeof(h->code),
                      h->err, sizeof(h->err));
}

/* The result as text for a caller's *out (which may be NULL). */
static int give_json(hmc *h, json_t *res, char **out)
{
    if (out == NULL)
        return 0;
    *out = json_dumps(res, JSON_COMPACT);
    if (*out == NULL) {
        fmt(h->err, sizeof(h->err), "out of memory");
        return -ENOMEM;
    }
    return 0;
}

/*
 * call for the public functions, whose results are text: every output is
 * NULL unless the call succeeded (the reply line also after an error
 * reply or a notice, as hmc_call promises).
 */
static int call_text(hmc *h, const char *cmd, json_t *args, int timeout_ms,
                     char **result_json_out, char **line_out)
{
    json_t *res = NULL;
    if (result_json_out != NULL)
        *result_json_out = NULL;
    int r = call(h, cmd, args, timeout_ms, &res, line_out);
    if (r == 0)
        r = give_json(h, res, result_json_out);
    if (r == -ENOMEM && line_out != NULL) {
        free(*line_out);
        *line_out = NULL;
    }
    json_decref(res);
    return r;
}

/* ---- connection API ---- */

int hmc_connect(const char *socket_path, hmc **out, char *err, size_t errlen)
{
    return hmc_connect_timeout(socket_path, HMC_DEFAULT_TIMEOUT_MS, out, err, errlen);
}

int hmc_connect_timeout(const char *socket_path, int timeout_ms, hmc **out, char *err,
                        size_t errlen)
{
    char path[PATH_LEN];
    int r;
    *out = NULL;
    if (timeout_ms <= 0) {
        fmt(err, errlen, "the timeout must be positive (milliseconds)");
        return -EINVAL;
    }
    if (socket_path == NULL) {
        r = hm_paths_client_control_socket(path, sizeof(path));
        if (r != 0) {
            fmt(err, errlen, "cannot tell the daemon's control socket (%s); pass its path or "
                "set HIVEMINDD_CONTROL_SOCKET", strerror(-r));
            return r;
        }
    } else if (strlen(socket_path) >= sizeof(path)) {
        fmt(err, errlen, "control socket path too long (at most %zu bytes): %s",
            sizeof(path) - 1, socket_path);
        return -ENAMETOOLONG;
    } else {
        memcpy(path, socket_path, strlen(socket_path) + 1);
    }
    hmc *h = calloc(1, sizeof(*h));
    if (h == NULL) {
        fmt(err, errlen, "out of memory");
        return -ENOMEM;
    }
    memcpy(h->path, path, sizeof(path));
    h->timeout_ms = timeout_ms;
    LIST_INIT(&h->bufs);
    r = conn_open(&h->c, h->path, h->timeout_ms, err, errlen);
    if (r != 0) {
        free(h);
        return r;
    }
    *out = h;
    return 0;
}

void hmc_close(hmc *h)
{
    if (h == NULL)
        return;
    hmc_buf *b;
    LIST_FOREACH(b, &h->bufs, link)
        b->h = NULL;
    conn_close(&h->c);
    free(h);
}

/* For the library's other files (diloco.c): a local failure's sentence.
 * Not hmc_-named, so not exported (the library exports ^hmc_ only). */
void hm_lib_set_error(hmc *h, const char *msg)
{
    h->code[0] = '\0';
    copy_str(h->err, sizeof(h->err), msg);
}

const char *hmc_last_error(const hmc *h) { return h != NULL ? h->err : "no connection"; }
const char *hmc_last_error_code(const hmc *h) { return h != NULL ? h->code : ""; }

void hmc_set_timeout(hmc *h, int timeout_ms)
{
    if (timeout_ms > 0)
        h->timeout_ms = timeout_ms;
}

int hmc_request(hmc *h, const char *cmd, const char *args_json, char **result_json_out)
{
    return hmc_call(h, cmd, args_json, 0, result_json_out, NULL);
}

int hmc_call(hmc *h, const char *cmd, const char *args_json, int timeout_ms,
             char **result_json_out, char **reply_line_out)
{
    json_t *args;
    json_error_t jerr;
    if (result_json_out != NULL)
        *result_json_out = NULL;
    if (reply_line_out != NULL)
        *reply_line_out = NULL;
    h->code[0] = '\0';
    if (cmd == NULL || cmd[0] == '\0') {
        fmt(h->err, sizeof(h->err), "no command given");
        return -EINVAL;
    }
    if (timeout_ms < 0) {
        fmt(h->err, sizeof(h->err), "the timeout must be 0 (the handle's) or positive "
            "(milliseconds)");
        return -EINVAL;
    }
    if (args_json != NULL) {
        args = json_loads(args_json, JSON_REJECT_DUPLICATES, &jerr);
        if (!json_is_object(args)) {
            fmt(h->err, sizeof(h->err), "the args must be a JSON object%s%s",
                args == NULL ? ": " : "", args == NULL ? jerr.text : "");
            json_decref(args);
            return -EINVAL;
        }
    } else {
        args = json_object();
    }
    return call_text(h, cmd, args, timeout_ms > 0 ? timeout_ms : h->timeout_ms, result_json_out,
                     reply_line_out);
}

int hmc_info(hmc *h, char **info_json_out) { return hmc_request(h, "info", NULL, info_json_out); }

/* ---- shared buffers ---- */

/*
 * Releases segment id on the daemon's side, best effort: the caller's
 * failure, if any, is what the trainer should hear about, so the handle's
 * last error is left as it was.
 */
static void shm_release(hmc *h, uint64_t id)
{
    char keep[HMC_ERROR_MAX], keep_code[CODE_MAX];
    memcpy(keep, h->err, sizeof(keep));
    memcpy(keep_code, h->code, sizeof(keep_code));
    call(h, "shm.free", json_pack("{s:I}", "shm", (json_int_t)id), h->timeout_ms, NULL, NULL);
    memcpy(h->err, keep, sizeof(keep));
    memcpy(h->code, keep_code, sizeof(keep_code));
}

int hmc_buf_alloc(hmc *h, size_t bytes, hmc_buf **out)
{
    json_t *res = NULL;
    hmc_buf *b = NULL;
    int fd = -1, result;
    *out = NULL;
    if (bytes == 0 || bytes > (size_t)INT64_MAX) {
        h->code[0] = '\0';
        fmt(h->err, sizeof(h->err), "a buffer needs a positive size");
        return -EINVAL;
    }
    result = call(h, "shm.alloc", json_pack("{s:I}", "bytes", (json_int_t)bytes), h->timeout_ms,
                  &res, NULL);
    if (result != 0)
        return result;
    b = calloc(1, sizeof(*b));
    if (b == NULL) {
        fmt(h->err, sizeof(h->err), "out of memory");
        result = -ENOMEM;
        goto fail;
    }
    const json_t *id = json_object_get(res, "shm");
    const char *name = json_string_value(json_object_get(res, "name"));
    const json_t *size = json_object_get(res, "bytes");
    /* The name must be one the daemon makes: nothing else gets opened. */
    if (!json_is_integer(id) || json_integer_value(id) <= 0 || name == NULL ||
        strncmp(name, "/hivemindd-", 11) != 0 || strchr(name + 1, '/') != NULL ||
        strlen(name) >= 64 || !json_is_integer(size) ||
        (uint64_t)json_integer_value(size) != bytes) {
        fmt(h->err, sizeof(h->err), "the daemon's shm.alloc reply is malformed");
        result = -EPROTO;
        goto fail;
    }
    b->id = (uint64_t)json_integer_value(id);
    fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
        result = -errno;
        int e = errno;
        fmt(h->err, sizeof(h->err), "cannot open shared memory %s: %s%s", name, strerror(e),
            e == EACCES ? " (the daemon opens its segments to its own user and its "
                          "ControlSocketGroup only: is this process one of them?)"
            : e == ENOENT ? " (is the daemon on another machine or in another container, with "
                            "another /dev/shm?)"
                          : "");
        goto free_seg;
    }
    /* Nobody else needs the name: no trace in /dev/shm whatever happens next. */
    shm_unlink(name);
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size < 0 || (uint64_t)st.st_size < bytes) {
        fmt(h->err, sizeof(h->err), "shared memory %s is smaller than the %zu bytes asked for",
            name, bytes);
        result = -EPROTO;
        goto free_seg;
    }
    b->data = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (b->data == MAP_FAILED) {
        b->data = NULL;
        result = -errno;
        fmt(h->err, sizeof(h->err), "cannot map %zu bytes of shared memory: %s", bytes,
            strerror(errno));
        goto free_seg;
    }
    close(fd);
    b->size = bytes;
    b->h = h;
    LIST_INSERT_HEAD(&h->bufs, b, link);
    json_decref(res);
    *out = b;
    return 0;
free_seg:
    if (fd >= 0)
        close(fd);
    shm_release(h, b->id);
fail:
    free(b);
    json_decref(res);
    return result;
}

void *hmc_buf_data(const hmc_buf *b) { return b->data; }
size_t hmc_buf_size(const hmc_buf *b) { return b->size; }
uint64_t hmc_buf_id(const hmc_buf *b) { return b->id; }

void hmc_buf_free(hmc_buf *b)
{
    if (b == NULL)
        return;
    hmc *h = b->h;
    if (h != NULL) {
        LIST_REMOVE(b, link);
        if (!h->c.broken)
            shm_release(h, b->id);
    }
    munmap(b->data, b->size);
    free(b);
}

/* A shared-memory reference to n floats of b from element off, or NULL (err set). */
static json_t *shm_ref(hmc *h, const char *what, const hmc_buf *b, size_t off, size_t n)
{
    h->code[0] = '\0';
    if (b == NULL || b->data == NULL) {
        fmt(h->err, sizeof(h->err), "%s: no buffer", what);
        return NULL;
    }
    size_t cap = b->size / sizeof(float);
    if (n == 0 || off > cap || n > cap - off) {
        fmt(h->err, sizeof(h->err), "%s: %zu floats from element %zu do not fit in a buffer of "
            "%zu floats", what, n, off, cap);
        return NULL;
    }
    json_t *r = json_pack("{s:I, s:I, s:I}", "shm", (json_int_t)b->id, "offset",
                          (json_int_t)(off * sizeof(float)), "elems", (json_int_t)n);
    if (r == NULL)
        fmt(h->err, sizeof(h->err), "out of memory");
    return r;
}

/* ---- averaging ---- */

void hmc_avg_opts_init(hmc_avg_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->weight = 1.0;
}

/*
 * A timeout the daemon will use for an "average" arg: its value in seconds,
 * or the default when absent or not a positive number (the daemon then uses
 * its default or refuses the request). Bounded, so the sum stays finite.
 */
static double arg_seconds(const json_t *v)
{
    double x = json_is_number(v) ? json_number_value(v) : 0;
    if (!(x > 0) || !isfinite(x))
        return DEFAULT_ROUND_S;
    return x > 86400 ? 86400 : x;
}

/* The "average" args and how long to wait for its reply; NULL when bad (err set). */
static json_t *avg_args(hmc *h, hmc_buf *b, size_t off, size_t n, const hmc_avg_opts *o,
                        int *wait_ms_out)
{
    json_t *a = NULL, *extra = NULL, *ref = NULL;
    json_error_t jerr;
    if (o == NULL || o->prefix == NULL || o->prefix[0] == '\0') {
        h->code[0] = '\0';
        fmt(h->err, sizeof(h->err), "averaging needs options with a prefix");
        return NULL;
    }
    if (!isfinite(o->weight) || o->weight < 0 || !(o->timeout_s >= 0) ||
        !(o->round_timeout_s >= 0) || !(o->matchmaking_time_s >= 0) ||
        o->timeout_s > 86400 || o->round_timeout_s > 86400 || o->target_group_size < 0 ||
        o->min_group_size < 0) {
        h->code[0] = '\0';
        fmt(h->err, sizeof(h->err), "averaging options out of range (weight and timeouts must "
            "be finite and >= 0, group sizes >= 0)");
        return NULL;
    }
    ref = shm_ref(h, "data", b, off, n);
    if (ref == NULL)
        return NULL;
    a = json_pack("{s:s, s:f, s:o}", "prefix", o->prefix, "weight", o->weight, "data", ref);
    if (a == NULL) {
        fmt(h->err, sizeof(h->err), "out of memory, or a prefix that is not UTF-8");
        return NULL;
    }
    if (o->timeout_s > 0)
        json_object_set_new(a, "timeout", json_real(o->timeout_s));
    if (o->round_timeout_s > 0)
        json_object_set_new(a, "round_timeout", json_real(o->round_timeout_s));
    if (o->matchmaking_time_s > 0)
        json_object_set_new(a, "matchmaking_time", json_real(o->matchmaking_time_s));
    if (o->target_group_size > 0)
        json_object_set_new(a, "target_group_size", json_integer(o->target_group_size));
    if (o->min_group_size > 0)
        json_object_set_new(a, "min_group_size", json_integer(o->min_group_size));
    if (o->compression != NULL)
        json_object_set_new(a, "compression", json_string(o->compression));
    if (o->group_bits != NULL)
        json_object_set_new(a, "group_bits", json_string(o->group_bits));
    if (o->client_mode)
        json_object_set_new(a, "client_mode", json_true());
    if (o->extra_json != NULL) {
        extra = json_loads(o->extra_json, JSON_REJECT_DUPLICATES, &jerr);
        if (!json_is_object(extra) || json_object_update(a, extra) != 0) {
            fmt(h->err, sizeof(h->err), "extra_json must be a JSON object");
            json_decref(extra);
            json_decref(a);
            return NULL;
        }
        json_decref(extra);
    }
    /* The daemon answers within its two timeouts; the slack covers a busy
     * machine. They are read from the args as sent, after extra_json, which
     * may set them: a wait shorter than the daemon's would call a round done
     * while the daemon still writes the buffer. */
    double wait_s = arg_seconds(json_object_get(a, "timeout")) +
                    arg_seconds(json_object_get(a, "round_timeout"));
    /* A held round may wait that long for its release before the all-reduce. */
    if (json_is_true(json_object_get(a, "hold"))) {
        const json_t *ht = json_object_get(a, "hold_timeout");
        wait_s += ht != NULL ? arg_seconds(ht) : 60;
    }
    double ms = wait_s * 1000.0 + SLACK_MS;
    *wait_ms_out = ms > 2e9 ? 2000000000 : (int)ms;
    if (*wait_ms_out < h->timeout_ms)
        *wait_ms_out = h->timeout_ms;
    return a;
}

int hmc_average(hmc *h, hmc_buf *b, size_t offset_elems, size_t n, const hmc_avg_opts *o,
                char **report_json_out)
{
    int wait_ms;
    if (report_json_out != NULL)
        *report_json_out = NULL;
    json_t *a = avg_args(h, b, offset_elems, n, o, &wait_ms);
    if (a == NULL)
        return -EINVAL;
    return call_text(h, "average", a, wait_ms, report_json_out, NULL);
}

int hmc_average_start(hmc *h, hmc_buf *b, size_t offset_elems, size_t n, const hmc_avg_opts *o,
                      hmc_round **out)
{
    int wait_ms, r;
    *out = NULL;
    json_t *a = avg_args(h, b, offset_elems, n, o, &wait_ms);
    if (a == NULL)
        return -EINVAL;
    hmc_round *rd = calloc(1, sizeof(*rd));
    if (rd == NULL) {
        json_decref(a);
        fmt(h->err, sizeof(h->err), "out of memory");
        return -ENOMEM;
    }
    r = conn_open(&rd->c, h->path, h->timeout_ms, h->err, sizeof(h->err));
    if (r != 0) {
        json_decref(a);
        free(rd);
        return r;
    }
    int64_t now = now_ms();
    rd->deadline_ms = now + wait_ms;
    r = send_request(&rd->c, "average", a, now + h->timeout_ms, &rd->id, h->err,
                     sizeof(h->err));
    if (r != 0) {
        conn_close(&rd->c);
        free(rd);
        return r;
    }
    *out = rd;
    return 0;
}

int hmc_average_go(hmc *h, const char *prefix, double weight)
{
    char *res = NULL;
    if (h == NULL || prefix == NULL || !isfinite(weight) || weight < 0)
        return -EINVAL;
    json_t *a = json_pack("{s:s, s:f}", "prefix", prefix, "weight", weight);
    if (a == NULL)
        return -ENOMEM;
    int r = call_text(h, "average.go", a, h->timeout_ms, &res, NULL);
    hmc_free_string(res);
    return r;
}

/* Takes the reply if it has come by deadline; marks the round done when over. */
static void round_poll(hmc_round *r, int64_t deadline)
{
    json_t *res = NULL;
    if (r->done)
        return;
    if (deadline > r->deadline_ms)
        deadline = r->deadline_ms;
    int st = read_reply(&r->c, r->id, deadline, &res, NULL, r->code, sizeof(r->code), r->err,
                        sizeof(r->err));
    if (st == -ETIMEDOUT && now_ms() < r->deadline_ms) {
        /* Not yet: read_reply gave up on the connection, but the round's own
         * deadline has not passed, so it stays usable. */
        r->c.broken = 0;
        return;
    }
    if (st == -ETIMEDOUT)
        fmt(r->err, sizeof(r->err), "the daemon did not finish the round within its timeouts");
    if (st == 0) {
        r->report = json_dumps(res, JSON_COMPACT);
        if (r->report == NULL) {
            st = -ENOMEM;
            fmt(r->err, sizeof(r->err), "out of memory");
        }
    }
    json_decref(res);
    r->status = st;
    r->done = 1;
    conn_close(&r->c);
}

int hmc_round_done(hmc_round *r)
{
    round_poll(r, now_ms());
    return r->done;
}

int hmc_round_wait(hmc_round *r, int timeout_ms, char **report_json_out)
{
    if (report_json_out != NULL)
        *report_json_out = NULL;
    round_poll(r, timeout_ms < 0 ? r->deadline_ms : now_ms() + timeout_ms);
    if (!r->done)
        return -EAGAIN;
    if (r->status == 0 && report_json_out != NULL) {
        *report_json_out = strdup(r->report);
        if (*report_json_out == NULL)
            return -ENOMEM;
    }
    return r->status;
}

const char *hmc_round_error(const hmc_round *r) { return r->err; }
const char *hmc_round_error_code(const hmc_round *r) { return r->code; }

void hmc_round_free(hmc_round *r)
{
    if (r == NULL)
        return;
    conn_close(&r->c);
    free(r->report);
    free(r);
}

/* ---- experts ---- */

static int mul_ok(size_t a, size_t b, size_t *out)
{
    if (a != 0 && b > SIZE_MAX / a)
        return 0;
    *out = a * b;
    return 1;
}

static int wait_for(hmc *h, double seconds)
{
    double ms = seconds * 1000.0 + SLACK_MS;
    int w = ms > 2e9 ? 2000000000 : (int)ms;
    return w < h->timeout_ms ? h->timeout_ms : w;
}

int hmc_experts_find(hmc *h, const char *prefix, const double *scores, const size_t *dim_sizes,
                     size_t n_dims, size_t k_best, double timeout_s, hmc_expert *out,
                     size_t max_out, size_t *n_out, char **result_json_out)
{
    json_t *grid = NULL, *res = NULL;
    int result;
    size_t at = 0;
    *n_out = 0;
    if (result_json_out != NULL)
        *result_json_out = NULL;
    h->code[0] = '\0';
    if (prefix == NULL || prefix[0] == '\0' || n_dims == 0 || k_best == 0 || scores == NULL ||
        dim_sizes == NULL || !(timeout_s > 0) || !isfinite(timeout_s)) {
        fmt(h->err, sizeof(h->err), "experts_find needs a prefix, at least one dimension of "
            "scores, k_best >= 1 and a positive timeout");
        return -EINVAL;
    }
    grid = json_array();
    for (size_t d = 0; grid != NULL && d < n_dims; d++) {
        json_t *row = json_array();
        if (row == NULL || dim_sizes[d] == 0 || json_array_append_new(grid, row) != 0) {
            if (dim_sizes[d] == 0)
                fmt(h->err, sizeof(h->err), "dimension %zu has no scores", d);
            else
                fmt(h->err, sizeof(h->err), "out of memory");
            json_decref(grid);
            return dim_sizes[d] == 0 ? -EINVAL : -ENOMEM;
        }
        for (size_t i = 0; i < dim_sizes[d]; i++, at++) {
            if (!isfinite(scores[at])) {
                fmt(h->err, sizeof(h->err), "score %zu of dimension %zu is not finite", i, d);
                json_decref(grid);
                return -EINVAL;
            }
            json_array_append_new(row, json_real(scores[at]));
        }
    }
    json_t *args = grid == NULL ? NULL
                                : json_pack("{s:s, s:o, s:I, s:f}", "prefix", prefix, "scores",
                                            grid, "k_best", (json_int_t)k_best, "timeout",
                                            timeout_s);
    result = call(h, "experts.find", args, wait_for(h, timeout_s), &res, NULL);
    if (result != 0)
        goto out;
    const json_t *ex = json_object_get(res, "experts");
    if (!json_is_array(ex)) {
        fmt(h->err, sizeof(h->err), "the daemon's experts.find reply has no \"experts\" list");
        result = -EPROTO;
        goto out;
    }
    for (size_t i = 0; i < json_array_size(ex) && *n_out < max_out && out != NULL; i++) {
        const json_t *e = json_array_get(ex, i);
        const char *uid = json_string_value(json_object_get(e, "uid"));
        const char *peer = json_string_value(json_object_get(e, "peer"));
        const json_t *score = json_object_get(e, "score");
        if (uid == NULL || peer == NULL || strlen(uid) >= HMC_UID_MAX ||
            strlen(peer) >= HMC_PEER_MAX || (score != NULL && !json_is_number(score))) {
            fmt(h->err, sizeof(h->err), "expert %zu of the daemon's reply is malformed", i);
            result = -EPROTO;
            goto out;
        }
        hmc_expert *o = &out[(*n_out)++];
        memset(o, 0, sizeof(*o));
        memcpy(o->uid, uid, strlen(uid) + 1);
        memcpy(o->peer, peer, strlen(peer) + 1);
        o->score = score != NULL ? json_number_value(score) : 0;
    }
    result = give_json(h, res, result_json_out);
out:
    json_decref(res);
    return result;
}

static json_t *experts_json(hmc *h, const hmc_expert *experts, size_t k)
{
    json_t *a = json_array();
    for (size_t i = 0; a != NULL && i < k; i++) {
        if (memchr(experts[i].uid, '\0', HMC_UID_MAX) == NULL ||
            memchr(experts[i].peer, '\0', HMC_PEER_MAX) == NULL || experts[i].uid[0] == '\0' ||
            experts[i].peer[0] == '\0') {
            fmt(h->err, sizeof(h->err), "expert %zu has no uid or peer", i);
            json_decref(a);
            return NULL;
        }
        json_t *e = json_pack("{s:s, s:s}", "uid", experts[i].uid, "peer", experts[i].peer);
        if (e == NULL || json_array_append_new(a, e) != 0) {
            fmt(h->err, sizeof(h->err), "expert %zu: out of memory, or text that is not UTF-8",
                i);
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

/* Reads {answered: [bool x k], n_answered} into the caller's outputs. */
static int take_answered(hmc *h, const json_t *res, size_t k, int *answered_out,
                         size_t *n_answered_out)
{
    const json_t *a = json_object_get(res, "answered");
    const json_t *n = json_object_get(res, "n_answered");
    size_t count = 0;
    if (!json_is_array(a) || json_array_size(a) != k || !json_is_integer(n)) {
        fmt(h->err, sizeof(h->err), "the daemon's reply lacks \"answered\" for each of the %zu "
            "experts or \"n_answered\"", k);
        return -EPROTO;
    }
    for (size_t i = 0; i < k; i++) {
        const json_t *v = json_array_get(a, i);
        if (!json_is_boolean(v)) {
            fmt(h->err, sizeof(h->err), "answered[%zu] is not true or false", i);
            return -EPROTO;
        }
        count += json_is_true(v);
        if (answered_out != NULL)
            answered_out[i] = json_is_true(v);
    }
    if ((json_int_t)count != json_integer_value(n)) {
        fmt(h->err, sizeof(h->err), "n_answered is %lld but %zu experts are marked answered",
            (long long)json_integer_value(n), count);
        return -EPROTO;
    }
    if (n_answered_out != NULL)
        *n_answered_out = count;
    return 0;
}

/* Checks the sizes of an expert call; out: batch * dim and k * batch * dim. */
static int expert_sizes(hmc *h, size_t k, size_t batch, size_t dim, size_t k_min, double timeout_s,
                        size_t *bd_out, size_t *kbd_out)
{
    h->code[0] = '\0';
    /* k_min 0 is refused here as the daemon would: a call that needs no
     * answer at all is surely a mistake, not "all of them". */
    if (k == 0 || batch == 0 || dim == 0 || k_min == 0 || k_min > k || !(timeout_s > 0) ||
        !isfinite(timeout_s) || !mul_ok(batch, dim, bd_out) || !mul_ok(k, *bd_out, kbd_out)) {
        fmt(h->err, sizeof(h->err), "an expert call needs k >= 1 experts, 1 <= k_min <= k, a "
            "batch and a dimension >= 1 and a positive timeout");
        return -EINVAL;
    }
    return 0;
}

/*
 * Adds args.seq and, when maskb is not NULL, args.mask (batch * seq floats
 * from mask_off) to args, for the calls over sequences. 0 or -EINVAL.
 */
static int seq_args(hmc *h, json_t *args, size_t batch, size_t seq, hmc_buf *maskb,
                    size_t mask_off)
{
    size_t bs;
    if (seq == 0)
        return 0;
    if (!mul_ok(batch, seq, &bs) ||
        json_object_set_new(args, "seq", json_integer((json_int_t)seq)) != 0) {
        fmt(h->err, sizeof(h->err), "batch * seq is too large");
        return -EINVAL;
    }
    if (maskb == NULL)
        return 0;
    json_t *m = shm_ref(h, "mask", maskb, mask_off, bs);
    if (m == NULL || json_object_set_new(args, "mask", m) != 0)
        return -EINVAL;
    return 0;
}

/* Rows of dim in a call: batch, or batch sequences of seq rows. */
static int seq_rows(hmc *h, size_t batch, size_t seq, hmc_buf *maskb, size_t *rows_out)
{
    if (seq == 0 && maskb != NULL) {
        h->code[0] = '\0';
        fmt(h->err, sizeof(h->err), "a mask pads keys of sequences: it needs seq >= 1");
        return -EINVAL;
    }
    if (!mul_ok(batch, seq != 0 ? seq : 1, rows_out)) {
        h->code[0] = '\0';
        fmt(h->err, sizeof(h->err), "batch * seq is too large");
        return -EINVAL;
    }
    return 0;
}

static int experts_fwd(hmc *h, const hmc_expert *experts, size_t k, hmc_buf *xb, size_t x_off,
                       hmc_buf *maskb, size_t mask_off, hmc_buf *yb, size_t y_off, size_t batch,
                       size_t seq, size_t dim, size_t k_min, double timeout_s,
                       double timeout_after_k_min_s, int *answered_out, size_t *n_answered_out)
{
    size_t bd, kbd, rows;
    json_t *res = NULL;
    if (n_answered_out != NULL)
        *n_answered_out = 0;
    int r = seq_rows(h, batch, seq, maskb, &rows);
    if (r != 0)
        return r;
    r = expert_sizes(h, k, rows, dim, k_min, timeout_s, &bd, &kbd);
    if (r != 0)
        return r;
    if (!(timeout_after_k_min_s >= 0) || !isfinite(timeout_after_k_min_s)) {
        fmt(h->err, sizeof(h->err), "timeout_after_k_min must be >= 0");
        return -EINVAL;
    }
    json_t *ex = experts_json(h, experts, k);
    json_t *x = ex != NULL ? shm_ref(h, "x", xb, x_off, bd) : NULL;
    json_t *y = x != NULL ? shm_ref(h, "y", yb, y_off, kbd) : NULL;
    if (y == NULL) {
        json_decref(ex);
        json_decref(x);
        return -EINVAL;
    }
    json_t *args = json_pack("{s:o, s:o, s:o, s:I, s:I, s:I, s:f, s:f}", "experts", ex, "x", x,
                             "y", y, "batch", (json_int_t)batch, "dim", (json_int_t)dim, "k_min",
                             (json_int_t)k_min, "timeout", timeout_s, "timeout_after_k_min",
                             timeout_after_k_min_s);
    if (args != NULL && (r = seq_args(h, args, batch, seq, maskb, mask_off)) != 0) {
        json_decref(args);
        return r;
    }
    r = call(h, "experts.forward", args, wait_for(h, timeout_s + timeout_after_k_min_s), &res,
             NULL);
    if (r == 0)
        r = take_answered(h, res, k, answered_out, n_answered_out);
    json_decref(res);
    return r;
}

int hmc_experts_forward(hmc *h, const hmc_expert *experts, size_t k, hmc_buf *xb, size_t x_off,
                        hmc_buf *yb, size_t y_off, size_t batch, size_t dim, size_t k_min,
                        double timeout_s, double timeout_after_k_min_s, int *answered_out,
                        size_t *n_answered_out)
{
    return experts_fwd(h, experts, k, xb, x_off, NULL, 0, yb, y_off, batch, 0, dim, k_min,
                       timeout_s, timeout_after_k_min_s, answered_out, n_answered_out);
}

int hmc_experts_forward_seq(hmc *h, const hmc_expert *experts, size_t k, hmc_buf *xb,
                            size_t x_off, hmc_buf *maskb, size_t mask_off, hmc_buf *yb,
                            size_t y_off, size_t batch, size_t seq, size_t dim, size_t k_min,
                            double timeout_s, double timeout_after_k_min_s, int *answered_out,
                            size_t *n_answered_out)
{
    if (seq == 0) {
        h->code[0] = '\0';
        fmt(h->err, sizeof(h->err), "a call over sequences needs seq >= 1");
        return -EINVAL;
    }
    return experts_fwd(h, experts, k, xb, x_off, maskb, mask_off, yb, y_off, batch, seq, dim,
                       k_min, timeout_s, timeout_after_k_min_s, answered_out, n_answered_out);
}

static int experts_bwd(hmc *h, const hmc_expert *experts, size_t k, hmc_buf *xb, size_t x_off,
                       hmc_buf *maskb, size_t mask_off, hmc_buf *gyb, size_t gy_off,
                       hmc_buf *gxb, size_t gx_off, size_t batch, size_t seq, size_t dim,
                       size_t k_min, double timeout_s, int *answered_out,
                       size_t *n_answered_out)
{
    size_t bd, kbd, rows;
    json_t *res = NULL;
    if (n_answered_out != NULL)
        *n_answered_out = 0;
    int r = seq_rows(h, batch, seq, maskb, &rows);
    if (r != 0)
        return r;
    r = expert_sizes(h, k, rows, dim, k_min, timeout_s, &bd, &kbd);
    if (r != 0)
        return r;
    json_t *ex = experts_json(h, experts, k);
    json_t *x = ex != NULL ? shm_ref(h, "x", xb, x_off, bd) : NULL;
    json_t *gy = x != NULL ? shm_ref(h, "gy", gyb, gy_off, kbd) : NULL;
    json_t *gx = gy != NULL ? shm_ref(h, "gx", gxb, gx_off, kbd) : NULL;
    if (gx == NULL) {
        json_decref(ex);
        json_decref(x);
        json_decref(gy);
        return -EINVAL;
    }
    json_t *args = json_pack("{s:o, s:o, s:o, s:o, s:I, s:I, s:I, s:f}", "experts", ex, "x", x,
                             "gy", gy, "gx", gx, "batch", (json_int_t)batch, "dim",
                             (json_int_t)dim, "k_min", (json_int_t)k_min, "timeout", timeout_s);
    if (args != NULL && (r = seq_args(h, args, batch, seq, maskb, mask_off)) != 0) {
        json_decref(args);
        return r;
    }
    r = call(h, "experts.backward", args, wait_for(h, timeout_s), &res, NULL);
    if (r == 0)
        r = take_answered(h, res, k, answered_out, n_answered_out);
    json_decref(res);
    return r;
}

int hmc_experts_backward(hmc *h, const hmc_expert *experts, size_t k, hmc_buf *xb, size_t x_off,
                         hmc_buf *gyb, size_t gy_off, hmc_buf *gxb, size_t gx_off, size_t batch,
                         size_t dim, size_t k_min, double timeout_s, int *answered_out,
                         size_t *n_answered_out)
{
    return experts_bwd(h, experts, k, xb, x_off, NULL, 0, gyb, gy_off, gxb, gx_off, batch, 0,
                       dim, k_min, timeout_s, answered_out, n_answered_out);
}

int hmc_experts_backward_seq(hmc *h, const hmc_expert *experts, size_t k, hmc_buf *xb,
                             size_t x_off, hmc_buf *maskb, size_t mask_off, hmc_buf *gyb,
                             size_t gy_off, hmc_buf *gxb, size_t gx_off, size_t batch,
                             size_t seq, size_t dim, size_t k_min, double timeout_s,
                             int *answered_out, size_t *n_answered_out)
{
    if (seq == 0) {
        h->code[0] = '\0';
        fmt(h->err, sizeof(h->err), "a call over sequences needs seq >= 1");
        return -EINVAL;
    }
    return experts_bwd(h, experts, k, xb, x_off, maskb, mask_off, gyb, gy_off, gxb, gx_off,
                       batch, seq, dim, k_min, timeout_s, answered_out, n_answered_out);
}

/* ---- per-sample routing ---- */

/*
 * The experts of a routed call as {hosts, experts: [{uid, host}]}: each
 * host once, so that a call to many experts fits a request line.
 */
static int routed_experts_args(hmc *h, const hmc_expert *experts, size_t n, json_t *args)
{
    json_t *hosts = json_array(), *list = json_array();
    int result = -ENOMEM;
    if (hosts == NULL || list == NULL)
        goto out;
    for (size_t i = 0; i < n; i++) {
        if (memchr(experts[i].uid, '\0', HMC_UID_MAX) == NULL ||
            memchr(experts[i].peer, '\0', HMC_PEER_MAX) == NULL || experts[i].uid[0] == '\0' ||
            experts[i].peer[0] == '\0') {
            fmt(h->err, sizeof(h->err), "expert %zu has no uid or peer", i);
            result = -EINVAL;
            goto out;
        }
        /* Hosts are few: a linear look through the ones seen is enough. */
        size_t at = 0, nh = json_array_size(hosts);
        while (at < nh && strcmp(json_string_value(json_array_get(hosts, at)), experts[i].peer))
            at++;
        if (at == nh && json_array_append_new(hosts, json_string(experts[i].peer)) != 0)
            goto text;
        json_t *e = json_pack("{s:s, s:I}", "uid", experts[i].uid, "host", (json_int_t)at);
        if (e == NULL || json_array_append_new(list, e) != 0)
            goto text;
    }
    json_object_set_new(args, "hosts", hosts);
    json_object_set_new(args, "experts", list);
    return 0;
text:
    fmt(h->err, sizeof(h->err), "out of memory, or an expert's text is not UTF-8");
    result = -EINVAL;
out:
    if (result == -ENOMEM)
        fmt(h->err, sizeof(h->err), "out of memory");
    json_decref(hosts);
    json_decref(list);
    return result;
}

int hmc_experts_route(hmc *h, const char *prefix, const size_t *grid, size_t n_dims,
                      hmc_buf *scoresb, size_t scores_off, size_t batch, size_t k_best,
                      size_t beam_size, double timeout_s, hmc_buf *routesb, size_t routes_off,
                      hmc_expert *out, size_t max_out, size_t *n_out, char **result_json_out)
{
    json_t *res = NULL, *g = NULL;
    size_t total = 0, bk;
    int result;
    *n_out = 0;
    if (result_json_out != NULL)
        *result_json_out = NULL;
    h->code[0] = '\0';
    if (prefix == NULL || prefix[0] == '\0' || grid == NULL || n_dims == 0 || batch == 0 ||
        k_best == 0 || !(timeout_s > 0) || !isfinite(timeout_s) || !mul_ok(batch, k_best, &bk)) {
        fmt(h->err, sizeof(h->err), "experts_route needs a prefix, a grid, a batch >= 1, "
            "k_best >= 1 and a positive timeout");
        return -EINVAL;
    }
    g = json_array();
    for (size_t d = 0; g != NULL && d < n_dims; d++) {
        if (grid[d] == 0 || total + grid[d] < total) {
            fmt(h->err, sizeof(h->err), "grid dimension %zu has no coordinates", d);
            json_decref(g);
            return -EINVAL;
        }
        total += grid[d];
        json_array_append_new(g, json_integer((json_int_t)grid[d]));
    }
    size_t bt;
    if (g == NULL || !mul_ok(batch, total, &bt)) {
        json_decref(g);
        fmt(h->err, sizeof(h->err), "out of memory, or batch * sum(grid) overflows");
        return g == NULL ? -ENOMEM : -EINVAL;
    }
    json_t *sc = shm_ref(h, "scores", scoresb, scores_off, bt);
    json_t *rt = sc != NULL ? shm_ref(h, "routes", routesb, routes_off, bk) : NULL;
    if (rt == NULL) {
        json_decref(g);
        json_decref(sc);
        return -EINVAL;
    }
    json_t *args = json_pack("{s:s, s:o, s:o, s:o, s:I, s:I, s:I, s:f}", "prefix", prefix,
                             "grid", g, "scores", sc, "routes", rt, "batch", (json_int_t)batch,
                             "k_best", (json_int_t)k_best, "beam_size", (json_int_t)beam_size,
                             "timeout", timeout_s);
    result = call(h, "experts.route", args, wait_for(h, timeout_s), &res, NULL);
    if (result != 0)
        goto out;
    const json_t *ex = json_object_get(res, "experts");
    if (!json_is_array(ex)) {
        fmt(h->err, sizeof(h->err), "the daemon's experts.route reply has no \"experts\" list");
        result = -EPROTO;
        goto out;
    }
    if (json_array_size(ex) > max_out) {
        /* The routes index the whole list: a part of it would be useless. */
        fmt(h->err, sizeof(h->err), "the batch is routed to %zu experts, more than the %zu "
            "the caller has room for", json_array_size(ex), max_out);
        result = -ENOBUFS;
        goto out;
    }
    for (size_t i = 0; i < json_array_size(ex); i++) {
        const json_t *e = json_array_get(ex, i);
        const char *uid = json_string_value(json_object_get(e, "uid"));
        const char *peer = json_string_value(json_object_get(e, "peer"));
        if (uid == NULL || peer == NULL || strlen(uid) >= HMC_UID_MAX ||
            strlen(peer) >= HMC_PEER_MAX || out == NULL) {
            fmt(h->err, sizeof(h->err), "expert %zu of the daemon's reply is malformed", i);
            result = -EPROTO;
            goto out;
        }
        hmc_expert *o = &out[(*n_out)++];
        memset(o, 0, sizeof(*o));
        memcpy(o->uid, uid, strlen(uid) + 1);
        memcpy(o->peer, peer, strlen(peer) + 1);
    }
    /* The routes the daemon wrote must index that list. */
    const int32_t *routes = (const int32_t *)((const char *)hmc_buf_data(routesb) +
                                              routes_off * sizeof(float));
    for (size_t i = 0; i < bk; i++) {
        if (routes[i] < -1 || routes[i] >= (int32_t)*n_out) {
            fmt(h->err, sizeof(h->err), "route %zu of the daemon's reply is out of range", i);
            result = -EPROTO;
            goto out;
        }
    }
    result = give_json(h, res, result_json_out);
out:
    json_decref(res);
    return result;
}

/* The arguments routed forward and backward share. */
static json_t *routed_args(hmc *h, const hmc_expert *experts, size_t n_experts, hmc_buf *routesb,
                           size_t routes_off, size_t slots, hmc_buf *xb, size_t x_off,
                           size_t batch, size_t dim, size_t k_min, int allow_zero_outputs,
                           double timeout_s, size_t *sbd_out)
{
    size_t bd, bs;
    h->code[0] = '\0';
    if (n_experts == 0 || slots == 0 || batch == 0 || dim == 0 || k_min > slots ||
        (k_min == 0 && !allow_zero_outputs) || !(timeout_s > 0) || !isfinite(timeout_s) ||
        !mul_ok(batch, dim, &bd) || !mul_ok(batch, slots, &bs) || !mul_ok(bs, dim, sbd_out)) {
        fmt(h->err, sizeof(h->err), "a routed call needs experts, slots >= 1, a batch and a "
            "dimension >= 1, k_min <= slots (0 only with allow_zero_outputs) and a positive "
            "timeout");
        return NULL;
    }
    json_t *args = json_object();
    json_t *x = args != NULL ? shm_ref(h, "x", xb, x_off, bd) : NULL;
    json_t *rt = x != NULL ? shm_ref(h, "routes", routesb, routes_off, bs) : NULL;
    if (rt == NULL || routed_experts_args(h, experts, n_experts, args) != 0) {
        json_decref(args);
        json_decref(x);
        json_decref(rt);
        return NULL;
    }
    json_object_set_new(args, "x", x);
    json_object_set_new(args, "routes", rt);
    json_object_set_new(args, "slots", json_integer((json_int_t)slots));
    json_object_set_new(args, "batch", json_integer((json_int_t)batch));
    json_object_set_new(args, "dim", json_integer((json_int_t)dim));
    json_object_set_new(args, "k_min", json_integer((json_int_t)k_min));
    json_object_set_new(args, "allow_zero_outputs", json_boolean(allow_zero_outputs));
    json_object_set_new(args, "timeout", json_real(timeout_s));
    return args;
}

/*
 * A routed call's args over sequences: the sizes are those of rows of seq *
 * dim (a sample one sequence), args.dim the experts' own, and args.seq and
 * args.mask added (seq_args). NULL (h->err set) on a bad size.
 */
static json_t *routed_seq_args(hmc *h, const hmc_expert *experts, size_t n_experts,
                               hmc_buf *routesb, size_t routes_off, size_t slots, hmc_buf *xb,
                               size_t x_off, hmc_buf *maskb, size_t mask_off, size_t batch,
                               size_t seq, size_t dim, size_t k_min, int allow_zero_outputs,
                               double timeout_s, size_t *sbd_out)
{
    size_t sd;
    if (seq == 0 && maskb != NULL) {
        h->code[0] = '\0';
        fmt(h->err, sizeof(h->err), "a mask pads keys of sequences: it needs seq >= 1");
        return NULL;
    }
    if (!mul_ok(seq != 0 ? seq : 1, dim, &sd)) {
        h->code[0] = '\0';
        fmt(h->err, sizeof(h->err), "seq * dim is too large");
        return NULL;
    }
    json_t *args = routed_args(h, experts, n_experts, routesb, routes_off, slots, xb, x_off,
                               batch, sd, k_min, allow_zero_outputs, timeout_s, sbd_out);
    if (args == NULL || seq == 0)
        return args;
    json_object_set_new(args, "dim", json_integer((json_int_t)dim));
    if (seq_args(h, args, batch, seq, maskb, mask_off) != 0) {
        json_decref(args);
        return NULL;
    }
    return args;
}

static int routed_fwd(hmc *h, const hmc_expert *experts, size_t n_experts, hmc_buf *routesb,
                      size_t routes_off, size_t slots, hmc_buf *xb, size_t x_off,
                      hmc_buf *maskb, size_t mask_off, hmc_buf *yb, size_t y_off, size_t batch,
                      size_t seq, size_t dim, size_t k_min, int allow_zero_outputs,
                      double timeout_s, double timeout_after_k_min_s, int *answered_out,
                      size_t *n_answered_out)
{
    size_t sbd;
    json_t *res = NULL;
    if (n_answered_out != NULL)
        *n_answered_out = 0;
    if (!(timeout_after_k_min_s >= 0) || !isfinite(timeout_after_k_min_s)) {
        h->code[0] = '\0';
        fmt(h->err, sizeof(h->err), "timeout_after_k_min must be >= 0");
        return -EINVAL;
    }
    json_t *args = routed_seq_args(h, experts, n_experts, routesb, routes_off, slots, xb, x_off,
                                   maskb, mask_off, batch, seq, dim, k_min, allow_zero_outputs,
                                   timeout_s, &sbd);
    json_t *y = args != NULL ? shm_ref(h, "y", yb, y_off, sbd) : NULL;
    if (y == NULL) {
        json_decref(args);
        return -EINVAL;
    }
    json_object_set_new(args, "y", y);
    json_object_set_new(args, "timeout_after_k_min", json_real(timeout_after_k_min_s));
    int r = call(h, "experts.forward", args, wait_for(h, timeout_s + timeout_after_k_min_s),
                 &res, NULL);
    if (r == 0)
        r = take_answered(h, res, n_experts, answered_out, n_answered_out);
    json_decref(res);
    return r;
}

int hmc_experts_forward_routed(hmc *h, const hmc_expert *experts, size_t n_experts,
                               hmc_buf *routesb, size_t routes_off, size_t slots, hmc_buf *xb,
                               size_t x_off, hmc_buf *yb, size_t y_off, size_t batch, size_t dim,
                               size_t k_min, int allow_zero_outputs, double timeout_s,
                               double timeout_after_k_min_s, int *answered_out,
                               size_t *n_answered_out)
{
    return routed_fwd(h, experts, n_experts, routesb, routes_off, slots, xb, x_off, NULL, 0, yb,
                      y_off, batch, 0, dim, k_min, allow_zero_outputs, timeout_s,
                      timeout_after_k_min_s, answered_out, n_answered_out);
}

int hmc_experts_forward_routed_seq(hmc *h, const hmc_expert *experts, size_t n_experts,
                                   hmc_buf *routesb, size_t routes_off, size_t slots,
                                   hmc_buf *xb, size_t x_off, hmc_buf *maskb, size_t mask_off,
                                   hmc_buf *yb, size_t y_off, size_t batch, size_t seq,
                                   size_t dim, size_t k_min, int allow_zero_outputs,
                                   double timeout_s, double timeout_after_k_min_s,
                                   int *answered_out, size_t *n_answered_out)
{
    if (seq == 0) {
        h->code[0] = '\0';
        fmt(h->err, sizeof(h->err), "a call over sequences needs seq >= 1");
        return -EINVAL;
    }
    return routed_fwd(h, experts, n_experts, routesb, routes_off, slots, xb, x_off, maskb,
                      mask_off, yb, y_off, batch, seq, dim, k_min, allow_zero_outputs, timeout_s,
                      timeout_after_k_min_s, answered_out, n_answered_out);
}

static int routed_bwd(hmc *h, const hmc_expert *experts, size_t n_experts, hmc_buf *routesb,
                      size_t routes_off, size_t slots, hmc_buf *xb, size_t x_off,
                      hmc_buf *maskb, size_t mask_off, hmc_buf *gyb, size_t gy_off,
                      hmc_buf *gxb, size_t gx_off, size_t batch, size_t seq, size_t dim,
                      size_t k_min, int allow_zero_outputs, double timeout_s, int *answered_out,
                      size_t *n_answered_out)
{
    size_t sbd;
    json_t *res = NULL;
    if (n_answered_out != NULL)
        *n_answered_out = 0;
    json_t *args = routed_seq_args(h, experts, n_experts, routesb, routes_off, slots, xb, x_off,
                                   maskb, mask_off, batch, seq, dim, k_min, allow_zero_outputs,
                                   timeout_s, &sbd);
    json_t *gy = args != NULL ? shm_ref(h, "gy", gyb, gy_off, sbd) : NULL;
    json_t *gx = gy != NULL ? shm_ref(h, "gx", gxb, gx_off, sbd) : NULL;
    if (gx == NULL) {
        json_decref(args);
        json_decref(gy);
        return -EINVAL;
    }
    json_object_set_new(args, "gy", gy);
    json_object_set_new(args, "gx", gx);
    int r = call(h, "experts.backward", args, wait_for(h, timeout_s), &res, NULL);
    if (r == 0)
        r = take_answered(h, res, n_experts, answered_out, n_answered_out);
    json_decref(res);
    return r;
}

int hmc_experts_backward_routed(hmc *h, const hmc_expert *experts, size_t n_experts,
                                hmc_buf *routesb, size_t routes_off, size_t slots, hmc_buf *xb,
                                size_t x_off, hmc_buf *gyb, size_t gy_off, hmc_buf *gxb,
                                size_t gx_off, size_t batch, size_t dim, size_t k_min,
                                int allow_zero_outputs, double timeout_s, int *answered_out,
                                size_t *n_answered_out)
{
    return routed_bwd(h, experts, n_experts, routesb, routes_off, slots, xb, x_off, NULL, 0, gyb,
                      gy_off, gxb, gx_off, batch, 0, dim, k_min, allow_zero_outputs, timeout_s,
                      answered_out, n_answered_out);
}

int hmc_experts_backward_routed_seq(hmc *h, const hmc_expert *experts, size_t n_experts,
                                    hmc_buf *routesb, size_t routes_off, size_t slots,
                                    hmc_buf *xb, size_t x_off, hmc_buf *maskb, size_t mask_off,
                                    hmc_buf *gyb, size_t gy_off, hmc_buf *gxb, size_t gx_off,
                                    size_t batch, size_t seq, size_t dim, size_t k_min,
                                    int allow_zero_outputs, double timeout_s,
                                    int *answered_out, size_t *n_answered_out)
{
    if (seq == 0) {
        h->code[0] = '\0';
        fmt(h->err, sizeof(h->err), "a call over sequences needs seq >= 1");
        return -EINVAL;
    }
    return routed_bwd(h, experts, n_experts, routesb, routes_off, slots, xb, x_off, maskb,
                      mask_off, gyb, gy_off, gxb, gx_off, batch, seq, dim, k_min,
                      allow_zero_outputs, timeout_s, answered_out, n_answered_out);
}

/*
 * control: the control socket server (see control.h and
 * docs/control-protocol.md). It owns the listening pipe, the socket file,
 * one struct client per connection (its line buffer, its idle timer and
 * its outstanding writes) and the table of registered commands. Requests
 * (hm_control_req) belong to the handler from dispatch until it replies.
 */
#include "config.h"

#include "src/daemon/control.h"
#include "src/base/util.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define MOD "control"
#define DRAIN_MS 1000
#define BACKLOG 16

struct command {
    char name[HM_CONTROL_MAX_CMD + 1];
    hm_control_handler handler;
    void *ud;
};

struct client {
    hm_control *ctl;
    LIST_ENTRY(client) link;
    uv_pipe_t pipe;
    uv_timer_t idle;
    char *buf;
    size_t len, cap;
    hm_control_req *pending; /* the request being handled, at most one */
    uint64_t conn_id;        /* unique for the server's lifetime, never 0 */
    size_t queued;           /* reply bytes handed to uv_write, not yet done */
    unsigned writes;         /* outstanding uv_write requests */
    int handles;             /* open libuv handles (pipe, timer) */
    unsigned reading : 1;
    unsigned eof : 1;             /* the client shut down its side */
    unsigned closing : 1;         /* uv_close has been called */
    unsigned close_after_write : 1;
    unsigned rejected : 1;        /* over the client cap: only an error line */
    unsigned in_process : 1;      /* inside process(), to avoid reentry */
};

struct hm_control_req {
    struct client *client; /* NULL once the client has gone */
    uint64_t conn_id;      /* the connection it came on, kept after it goes */
    json_t *id;
    char cmd[HM_CONTROL_MAX_CMD + 1];
    hm_control_local_cb local_cb; /* hm_control_call's: the reply goes here */
    void *local_ud;
};

struct hm_control {
    uv_loop_t *loop;
    uv_pipe_t listener;
    uv_timer_t drain;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    dev_t dev;
    ino_t ino;
    int have_file; /* we created the socket file and still own it */
    size_t max_clients, max_line;
    uint64_t idle_ms;
    struct command cmds[HM_CONTROL_MAX_COMMANDS];
    size_t n_cmds;
    LIST_HEAD(, client) clients;
    size_t n_served, n_rejected;
    int closing;
    int listener_open, drain_open;
    int new_failed; /* hm_control_new failed: free on the listener's close */
    void (*close_cb)(void *ud);
    void *close_ud;
    uint64_t next_conn_id;
    hm_control_conn_closed_cb conn_closed_cb;
    void *conn_closed_ud;
    /* More listeners (hm_control_add_close_cb), after the one above. */
    struct {
        hm_control_conn_closed_cb cb;
        void *ud;
    } more_closed[HM_CONTROL_MAX_CLOSE_CBS];
    size_t n_more_closed;
    hm_control_busy_cb busy_cb;
    void *busy_ud;
};

struct write_req {
    uv_write_t w;
    struct client *c;
    size_t len;
    char data[];
};

/* ---- pure parts ---- */

static int valid_cmd_name(const char *s, size_t n)
{
    if (n == 0 || n > HM_CONTROL_MAX_CMD)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_' || ch == '-' ||
              ch == '.'))
            return 0;
    }
    return 1;
}

void hm_control_request_clear(hm_control_request *r)
{
    json_decref(r->args);
    json_decref(r->id);
    r->args = NULL;
    r->id = NULL;
    r->cmd[0] = '\0';
}

int hm_control_parse_request(const char *line, size_t len, hm_control_request *req_out,
                             const char **code_out, char *msg, size_t msglen)
{
    json_error_t jerr;
    json_t *root = NULL;
    int result = -EINVAL;
    const char *key;
    json_t *val;

    memset(req_out, 0, sizeof(*req_out));
    *code_out = "invalid_request";
    root = json_loadb(line, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (root == NULL) {
        *code_out = "parse_error";
        snprintf(msg, msglen, "invalid JSON at column %d: %s", jerr.column, jerr.text);
        goto out;
    }
    if (!json_is_object(root)) {
        snprintf(msg, msglen, "a request must be a JSON object");
        goto out;
    }
    /* Take the id first, so that the error replies below can echo it. */
    val = json_object_get(root, "id");
    if (val != NULL) {
        if (!(json_is_integer(val) || json_is_null(val) ||
              (json_is_string(val) && json_string_length(val) <= HM_CONTROL_MAX_ID))) {
            snprintf(msg, msglen, "\"id\" must be an integer, null or a string of at most %d "
                     "bytes", HM_CONTROL_MAX_ID);
            goto out;
        }
        req_out->id = json_incref(val);
    }
    json_object_foreach(root, key, val) {
        if (strcmp(key, "cmd") != 0 && strcmp(key, "args") != 0 && strcmp(key, "id") != 0) {
            snprintf(msg, msglen, "unknown field \"%.64s\" (expected cmd, args, id)", key);
            goto out;
        }
    }
    val = json_object_get(root, "cmd");
    if (val == NULL) {
        snprintf(msg, msglen, "missing \"cmd\"");
        goto out;
    }
    if (!json_is_string(val) || !valid_cmd_name(json_string_value(val), json_string_length(val))) {
        snprintf(msg, msglen, "\"cmd\" must be a command name (1-%d of a-z 0-9 _ - .)",
                 HM_CONTROL_MAX_CMD);
        goto out;
    }
    memcpy(req_out->cmd, json_string_value(val), json_string_length(val) + 1);
    val = json_object_get(root, "args");
    if (val == NULL || json_is_null(val)) {
        req_out->args = json_object();
        if (req_out->args == NULL) {
            *code_out = "internal";
            snprintf(msg, msglen, "out of memory");
            goto out;
        }
    } else if (json_is_object(val)) {
        req_out->args = json_incref(val);
    } else {
        snprintf(msg, msglen, "\"args\" must be an object");
        goto out;
    }
    result = 0;
out:
    json_decref(root);
    return result;
}

char *hm_control_format_reply(const json_t *id, int ok, const json_t *result, const char *code,
                              const char *message, size_t *len_out)
{
    json_t *root = json_object();
    char *s = NULL, *line = NULL;
    int bad = root == NULL;

    if (!bad)
        bad |= json_object_set_new(root, "ok", json_boolean(ok));
    if (!bad && ok) {
        /* set (not set_new) takes its own reference: the caller keeps his. */
        if (result != NULL)
            bad |= json_object_set(root, "result", (json_t *)result);
        else
            bad |= json_object_set_new(root, "result", json_object());
    } else if (!bad) {
        json_t *e = json_object();
        bad |= e == NULL;
        if (!bad) {
            bad |= json_object_set_new(e, "code", json_string(code ? code : "error"));
            bad |= json_object_set_new(e, "message", json_string(message ? message : ""));
            bad |= json_object_set_new(root, "error", e);
        }
    }
    if (!bad && id != NULL)
        bad |= json_object_set(root, "id", (json_t *)id);
    if (!bad)
        s = json_dumps(root, JSON_COMPACT | JSON_REAL_PRECISION(15));
    json_decref(root);
    if (s == NULL)
        return NULL;
    size_t n = strlen(s);
    line = malloc(n + 2);
    if (line != NULL) {
        memcpy(line, s, n);
        line[n] = '\n';
        line[n + 1] = '\0';
        if (len_out)
            *len_out = n + 1;
    }
    free(s);
    return line;
}

/* ---- clients ---- */

static void process(struct client *c);
static void client_close(struct client *c);
static void maybe_finish_close(hm_control *ctl);
static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);
static void on_idle(uv_timer_t *t);

static void on_client_handle_closed(uv_handle_t *h)
{
    struct client *c = h->data;
    if (--c->handles > 0)
        return;
    hm_control *ctl = c->ctl;
    free(c->buf);
    free(c);
    maybe_finish_close(ctl);
}

static void client_close(struct client *c)
{
    hm_control *ctl = c->ctl;
    if (c->closing)
        return;
    c->closing = 1;
    if (c->pending != NULL) {
        c->pending->client = NULL;
        c->pending = NULL;
    }
    LIST_REMOVE(c, link);
    if (c->rejected)
        ctl->n_rejected--;
    else
        ctl->n_served--;
    /* Rejected clients never ran a command, so nothing can hang off them. */
    if (!c->rejected && ctl->conn_closed_cb != NULL)
        ctl->conn_closed_cb(ctl->conn_closed_ud, c->conn_id);
    for (size_t i = 0; !c->rejected && i < ctl->n_more_closed; i++)
        ctl->more_closed[i].cb(ctl->more_closed[i].ud, c->conn_id);
    uv_read_stop((uv_stream_t *)&c->pipe);
    uv_timer_stop(&c->idle);
    uv_close((uv_handle_t *)&c->pipe, on_client_handle_closed);
    uv_close((uv_handle_t *)&c->idle, on_client_handle_closed);
}

static void on_write(uv_write_t *w, int status)
{
    struct write_req *wr = (struct write_req *)w;
    struct client *c = wr->c;
    c->writes--;
    c->queued -= wr->len;
    free(wr);
    if (c->closing)
        return;
    if (status < 0) {
        hm_debug(MOD, "write to a control client failed: %s", uv_strerror(status));
        client_close(c);
        return;
    }
    if (c->close_after_write) {
        if (c->writes == 0)
            client_close(c);
        return;
    }
    /* A drained queue may let the next buffered request through. */
    process(c);
}

static int client_write(struct client *c, const char *data, size_t len)
{
    struct write_req *wr = malloc(sizeof(*wr) + len);
    if (wr == NULL) {
        client_close(c);
        return -ENOMEM;
    }
    wr->c = c;
    wr->len = len;
    memcpy(wr->data, data, len);
    uv_buf_t b = uv_buf_init(wr->data, (unsigned)len);
    int r = uv_write(&wr->w, (uv_stream_t *)&c->pipe, &b, 1, on_write);
    if (r < 0) {
        free(wr);
        client_close(c);
        return r;
    }
    c->writes++;
    c->queued += len;
    return 0;
}

static void client_send_error(struct client *c, const json_t *id, const char *code,
                              const char *message)
{
    size_t n;
    char *line = hm_control_format_reply(id, 0, NULL, code, message, &n);
    if (line == NULL) {
        client_close(c);
        return;
    }
    client_write(c, line, n);
    free(line);
}

/* Sends a last error line and closes the client once it has been written. */
static void client_fail(struct client *c, const char *code, const char *message)
{
    if (c->closing || c->close_after_write)
        return;
    uv_read_stop((uv_stream_t *)&c->pipe);
    c->reading = 0;
    client_send_error(c, NULL, code, message);
    if (c->closing)
        return;
    c->close_after_write = 1;
    if (c->writes == 0) {
        client_close(c);
        return;
    }
    /* A client that does not take its last line in time is cut off, so
     * that it cannot hold a slot by not reading. */
    uv_timer_start(&c->idle, on_idle, DRAIN_MS, 0);
}

static void client_touch(struct client *c)
{
    hm_control *ctl = c->ctl;
    if (c->closing || c->close_after_write || ctl->idle_ms == UINT64_MAX)
        return;
    uv_timer_again(&c->idle);
}

static void on_idle(uv_timer_t *t)
{
    struct client *c = t->data;
    if (c->close_after_write) {
        client_close(c);
        return;
    }
    /* A client waiting for a slow command is not idle. */
    if (c->pending != NULL)
        return;
    /* Nor is one whose connection holds the program's resources (a trainer's
     * shared buffers while it trains): the repeating timer asks again. */
    if (c->ctl->busy_cb != NULL && c->ctl->busy_cb(c->ctl->busy_ud, c->conn_id))
        return;
    client_fail(c, "idle_timeout", "closing the connection after a period of inactivity");
}

static void dispatch(struct client *c, const char *line, size_t len)
{
    hm_control *ctl = c->ctl;
    hm_control_request r;
    const char *code;
    char msg[256];
    struct command *cmd = NULL;

    if (hm_control_parse_request(line, len, &r, &code, msg, sizeof(msg)) != 0) {
        client_send_error(c, r.id, code, msg);
        goto out;
    }
    for (size_t i = 0; i < ctl->n_cmds; i++)
        if (strcmp(ctl->cmds[i].name, r.cmd) == 0)
            cmd = &ctl->cmds[i];
    if (cmd == NULL) {
        snprintf(msg, sizeof(msg), "unknown command \"%s\"", r.cmd);
        client_send_error(c, r.id, "unknown_command", msg);
        goto out;
    }
    hm_control_req *req = calloc(1, sizeof(*req));
    if (req == NULL) {
        client_send_error(c, r.id, "internal", "out of memory");
        goto out;
    }
    req->client = c;
    req->conn_id = c->conn_id;
    req->id = r.id;
    r.id = NULL;
    memcpy(req->cmd, r.cmd, sizeof(req->cmd));
    c->pending = req;
    cmd->handler(cmd->ud, req, r.args);
out:
    hm_control_request_clear(&r);
}

static void update_reading(struct client *c)
{
    hm_control *ctl = c->ctl;
    int want = !c->closing && !c->close_after_write && !c->eof && !ctl->closing &&
               c->len <= ctl->max_line && c->queued <= HM_CONTROL_MAX_QUEUED;
    if (want && !c->reading) {
        if (uv_read_start((uv_stream_t *)&c->pipe, on_alloc, on_read) == 0)
            c->reading = 1;
        else
            client_close(c);
    } else if (!want && c->reading) {
        uv_read_stop((uv_stream_t *)&c->pipe);
        c->reading = 0;
    }
}

/*
 * Handles the complete lines in the buffer, one request at a time: the
 * next line waits until the current request has its reply and the replies
 * already queued are under the cap.
 */
static void process(struct client *c)
{
    hm_control *ctl = c->ctl;
    if (c->in_process)
        return;
    c->in_process = 1;
    while (!c->closing && !c->close_after_write && c->pending == NULL &&
           c->queued <= HM_CONTROL_MAX_QUEUED && c->len > 0) {
        char *nl = memchr(c->buf, '\n', c->len);
        size_t n, consumed;
        if (nl != NULL) {
            n = (size_t)(nl - c->buf);
            consumed = n + 1;
        } else if (c->len > ctl->max_line) {
            n = c->len;
            consumed = c->len;
        } else if (c->eof) {
            /* The last line of a client that shut down may lack its newline. */
            n = c->len;
            consumed = c->len;
        } else {
            break;
        }
        if (n > ctl->max_line) {
            char msg[128];
            snprintf(msg, sizeof(msg), "request line longer than %zu bytes", ctl->max_line);
            client_fail(c, "line_too_long", msg);
            break;
        }
        size_t m = n;
        if (m > 0 && c->buf[m - 1] == '\r')
            m--;
        size_t i = 0;
        while (i < m && (c->buf[i] == ' ' || c->buf[i] == '\t'))
            i++;
        /* The line is copied out so that the buffer may move under a handler
         * that replies at once and lets the next line in. */
        if (i < m) {
            char *line = malloc(m - i + 1);
            if (line == NULL) {
                client_close(c);
                break;
            }
            memcpy(line, c->buf + i, m - i);
            line[m - i] = '\0';
            memmove(c->buf, c->buf + consumed, c->len - consumed);
            c->len -= consumed;
            dispatch(c, line, m - i);
            free(line);
        } else {
            memmove(c->buf, c->buf + consumed, c->len - consumed);
            c->len -= consumed;
        }
    }
    c->in_process = 0;
    if (c->closing)
        return;
    if (c->eof && c->pending == NULL && c->len == 0 && !c->close_after_write) {
        /* Everything the client sent is answered; close once it is written. */
        c->close_after_write = 1;
        if (c->writes == 0) {
            client_close(c);
            return;
        }
        /* It gets the idle timeout to read its replies, and no longer. */
        if (ctl->idle_ms != UINT64_MAX)
            uv_timer_start(&c->idle, on_idle, ctl->idle_ms, 0);
    }
    update_reading(c);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    struct client *c = h->data;
    hm_control *ctl = c->ctl;
    size_t limit = ctl->max_line + 1;
    (void)suggested;
    if (c->len >= c->cap && c->cap < limit) {
        size_t ncap = c->cap ? c->cap * 2 : 4096;
        if (ncap > limit)
            ncap = limit;
        char *nb = realloc(c->buf, ncap);
        if (nb != NULL) {
            c->buf = nb;
            c->cap = ncap;
        }
    }
    if (c->len >= c->cap) {
        *buf = uv_buf_init(NULL, 0); /* read_cb gets UV_ENOBUFS */
        return;
    }
    *buf = uv_buf_init(c->buf + c->len, (unsigned)(c->cap - c->len));
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    struct client *c = s->data;
    (void)buf;
    if (c->closing)
        return;
    if (nread == UV_ENOBUFS) {
        /* The buffer is full: process() decides (overlong line, or wait). */
        uv_read_stop(s);
        c->reading = 0;
        process(c);
        return;
    }
    if (nread == UV_EOF) {
        uv_read_stop(s);
        c->reading = 0;
        c->eof = 1;
        process(c);
        return;
    }
    if (nread < 0) {
        hm_debug(MOD, "control client read error: %s", uv_strerror((int)nread));
        client_close(c);
        return;
    }
    if (nread == 0)
        return;
    c->len += (size_t)nread;
    client_touch(c);
    process(c);
}

static void on_connection(uv_stream_t *server, int status)
{
    hm_control *ctl = server->data;
    struct client *c;

    if (status < 0) {
        hm_warn(MOD, "accept on the control socket failed: %s", uv_strerror(status));
        return;
    }
    c = calloc(1, sizeof(*c));
    if (c == NULL)
        return;
    c->ctl = ctl;
    c->conn_id = ++ctl->next_conn_id;
    uv_pipe_init(ctl->loop, &c->pipe, 0);
    uv_timer_init(ctl->loop, &c->idle);
    c->pipe.data = c;
    c->idle.data = c;
    c->handles = 2;
    LIST_INSERT_HEAD(&ctl->clients, c, link);
    if (ctl->n_served >= ctl->max_clients) {
        c->rejected = 1;
        ctl->n_rejected++;
    } else {
        ctl->n_served++;
    }
    if (uv_accept(server, (uv_stream_t *)&c->pipe) != 0) {
        client_close(c);
        return;
    }
    if (c->rejected) {
        /* Rejected clients cost a write each; past a bound they cost nothing. */
        if (ctl->n_rejected > ctl->max_clients) {
            client_close(c);
            return;
        }
        char msg[96];
        snprintf(msg, sizeof(msg), "too many control clients (at most %zu)", ctl->max_clients);
        client_fail(c, "too_many_clients", msg);
        return;
    }
    if (ctl->idle_ms != UINT64_MAX)
        uv_timer_start(&c->idle, on_idle, ctl->idle_ms, ctl->idle_ms);
    update_reading(c);
}

/* ---- requests ---- */

static int send_reply(hm_control_req *req, int ok, json_t *result, const char *code,
                      const char *message)
{
    struct client *c = req->client;
    int r = 0;

    if (req->local_cb != NULL) {
        req->local_cb(req->local_ud, ok, result, code, message);
        goto out;
    }
    if (c == NULL) {
        r = -EPIPE;
        goto out;
    }
    size_t n;
    char *line = hm_control_format_reply(req->id, ok, result, code, message, &n);
    if (line == NULL) {
        /* A result that cannot be rendered (or no memory) still gets a line. */
        line = hm_control_format_reply(req->id, 0, NULL, "internal",
                                       "the reply could not be rendered", &n);
    }
    c->pending = NULL;
    if (line == NULL) {
        client_close(c);
        r = -ENOMEM;
        goto out;
    }
    r = client_write(c, line, n);
    free(line);
    if (c->closing)
        goto out;
    client_touch(c);
    process(c);
out:
    json_decref(result);
    json_decref(req->id);
    free(req);
    return r;
}

int hm_control_reply(hm_control_req *req, json_t *result)
{
    return send_reply(req, 1, result, NULL, NULL);
}

int hm_control_reply_error(hm_control_req *req, const char *code, const char *message)
{
    return send_reply(req, 0, NULL, code, message);
}

const char *hm_control_req_cmd(const hm_control_req *req) { return req->cmd; }
uint64_t hm_control_req_client(const hm_control_req *req) { return req->conn_id; }

void hm_control_set_close_cb(hm_control *ctl, hm_control_conn_closed_cb cb, void *ud)
{
    ctl->conn_closed_cb = cb;
    ctl->conn_closed_ud = ud;
}

int hm_control_add_close_cb(hm_control *ctl, hm_control_conn_closed_cb cb, void *ud)
{
    if (cb == NULL)
        return -EINVAL;
    if (ctl->n_more_closed >= HM_CONTROL_MAX_CLOSE_CBS)
        return -ENOBUFS;
    ctl->more_closed[ctl->n_more_closed].cb = cb;
    ctl->more_closed[ctl->n_more_closed++].ud = ud;
    return 0;
}

void hm_control_set_idle_check(hm_control *ctl, hm_control_busy_cb busy, void *ud)
{
    ctl->busy_cb = busy;
    ctl->busy_ud = ud;
}

/* ---- calls from inside the program ---- */

int hm_control_call(hm_control *ctl, const char *cmd, const json_t *args, hm_control_local_cb cb,
                    void *ud)
{
    struct command *found = NULL;
    if (cb == NULL || cmd == NULL || strlen(cmd) > HM_CONTROL_MAX_CMD)
        return -EINVAL;
    if (ctl->closing)
        return -ESHUTDOWN;
    for (size_t i = 0; i < ctl->n_cmds; i++)
        if (strcmp(ctl->cmds[i].name, cmd) == 0)
            found = &ctl->cmds[i];
    if (found == NULL)
        return -ENOENT;
    json_t *empty = NULL;
    if (args == NULL && (args = empty = json_object()) == NULL)
        return -ENOMEM;
    hm_control_req *req = calloc(1, sizeof(*req));
    if (req == NULL) {
        json_decref(empty);
        return -ENOMEM;
    }
    /* A connection of its own, so that what a command ties to connections
     * never mixes a local caller with a client. */
    req->conn_id = ++ctl->next_conn_id;
    memcpy(req->cmd, cmd, strlen(cmd) + 1);
    req->local_cb = cb;
    req->local_ud = ud;
    found->handler(found->ud, req, args);
    json_decref(empty);
    return 0;
}

/* ---- server ---- */

int hm_control_register(hm_control *ctl, const char *cmd, hm_control_handler h, void *ud)
{
    if (cmd == NULL || h == NULL || !valid_cmd_name(cmd, strlen(cmd)))
        return -EINVAL;
    for (size_t i = 0; i < ctl->n_cmds; i++)
        if (strcmp(ctl->cmds[i].name, cmd) == 0)
            return -EEXIST;
    if (ctl->n_cmds >= HM_CONTROL_MAX_COMMANDS)
        return -ENOBUFS;
    struct command *c = &ctl->cmds[ctl->n_cmds++];
    memcpy(c->name, cmd, strlen(cmd) + 1);
    c->handler = h;
    c->ud = ud;
    return 0;
}

const char *hm_control_path(const hm_control *ctl) { return ctl->path; }
size_t hm_control_clients(const hm_control *ctl) { return ctl->n_served; }

/*
 * Makes sure no server is listening at path, and removes a stale socket
 * left by one that died. A non-blocking connect tells the cases apart:
 * ECONNREFUSED means nobody listens; success or EAGAIN (a full backlog)
 * means somebody does.
 */
static int clear_stale_socket(const char *path, char *err, size_t errlen)
{
    struct stat st;
    struct sockaddr_un sa;
    int fd, r;

    if (lstat(path, &st) != 0) {
        if (errno == ENOENT)
            return 0;
        r = -errno;
        snprintf(err, errlen, "cannot use control socket %s: %s", path, strerror(-r));
        return r;
    }
    if (!S_ISSOCK(st.st_mode)) {
        snprintf(err, errlen, "control socket path %s exists and is not a socket; "
                 "refusing to replace it", path);
        return -EEXIST;
    }
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, path, strlen(path) + 1);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        r = -errno;
        snprintf(err, errlen, "socket: %s", strerror(-r));
        return r;
    }
    r = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
    int e = errno;
    close(fd);
    if (r == 0 || e == EAGAIN || e == EINPROGRESS) {
        snprintf(err, errlen, "another hivemindd is already listening on %s", path);
        return -EADDRINUSE;
    }
    if (e != ECONNREFUSED) {
        snprintf(err, errlen, "cannot check control socket %s: %s", path, strerror(e));
        return -e;
    }
    if (unlink(path) != 0 && errno != ENOENT) {
        r = -errno;
        snprintf(err, errlen, "cannot remove stale control socket %s: %s", path, strerror(-r));
        return r;
    }
    hm_info(MOD, "removed stale control socket %s", path);
    return 0;
}

int hm_control_lookup_group(const char *name, gid_t *out, char *err, size_t errlen)
{
    struct group gr, *res = NULL;
    char buf[8192];
    char *end;
    int r = getgrnam_r(name, &gr, buf, sizeof(buf), &res);
    if (r == 0 && res != NULL) {
        *out = res->gr_gid;
        return 0;
    }
    errno = 0;
    unsigned long v = strtoul(name, &end, 10);
    if (name[0] >= '0' && name[0] <= '9' && *end == '\0' && errno == 0 && v < (gid_t)-1) {
        *out = (gid_t)v;
        return 0;
    }
    snprintf(err, errlen, "control socket group '%s' does not exist", name);
    return -ENOENT;
}

static void on_listener_closed(uv_handle_t *h)
{
    hm_control *ctl = h->data;
    ctl->listener_open = 0;
    if (ctl->new_failed) {
        if (!ctl->drain_open)
            free(ctl);
        return;
    }
    maybe_finish_close(ctl);
}

static void on_drain_closed(uv_handle_t *h)
{
    hm_control *ctl = h->data;
    ctl->drain_open = 0;
    if (ctl->new_failed) {
        if (!ctl->listener_open)
            free(ctl);
        return;
    }
    void (*cb)(void *) = ctl->close_cb;
    void *ud = ctl->close_ud;
    free(ctl);
    if (cb)
        cb(ud);
}

static void maybe_finish_close(hm_control *ctl)
{
    if (!ctl->closing || !LIST_EMPTY(&ctl->clients) || ctl->listener_open || !ctl->drain_open)
        return;
    if (uv_is_closing((uv_handle_t *)&ctl->drain))
        return;
    uv_close((uv_handle_t *)&ctl->drain, on_drain_closed);
}

int hm_control_new(uv_loop_t *loop, const hm_control_config *cfg, hm_control **ctl_out, char *err,
                   size_t errlen)
{
    hm_control *ctl = NULL;
    int result;
    struct stat st;

    *ctl_out = NULL;
    if (cfg->path == NULL || cfg->path[0] == '\0') {
        snprintf(err, errlen, "no control socket path");
        return -EINVAL;
    }
    ctl = calloc(1, sizeof(*ctl));
    if (ctl == NULL) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    if (hm_strlcpy(ctl->path, cfg->path, sizeof(ctl->path)) != 0) {
        snprintf(err, errlen, "control socket path longer than %zu bytes: %s",
                 sizeof(ctl->path) - 1, cfg->path);
        free(ctl);
        return -ENAMETOOLONG;
    }
    ctl->loop = loop;
    LIST_INIT(&ctl->clients);
    ctl->max_clients = cfg->max_clients ? cfg->max_clients : 32;
    ctl->idle_ms = cfg->idle_timeout_ms ? cfg->idle_timeout_ms : 300000;
    ctl->max_line = cfg->max_line ? cfg->max_line : HM_CONTROL_MAX_LINE;

    gid_t gid = 0;
    if (cfg->group != NULL && cfg->group[0] != '\0') {
        result = hm_control_lookup_group(cfg->group, &gid, err, errlen);
        if (result != 0) {
            free(ctl);
            return result;
        }
    }
    result = clear_stale_socket(ctl->path, err, errlen);
    if (result != 0) {
        free(ctl);
        return result;
    }

    uv_pipe_init(loop, &ctl->listener, 0);
    uv_timer_init(loop, &ctl->drain);
    ctl->listener.data = ctl;
    ctl->drain.data = ctl;
    ctl->listener_open = 1;
    ctl->drain_open = 1;

    result = uv_pipe_bind(&ctl->listener, ctl->path);
    if (result != 0) {
        snprintf(err, errlen, "cannot bind control socket %s: %s", ctl->path,
                 uv_strerror(result));
        goto fail;
    }
    ctl->have_file = 1;
    /* Nobody can connect before uv_listen, so the mode is set in time. */
    if (lstat(ctl->path, &st) != 0) {
        result = -errno;
        snprintf(err, errlen, "cannot stat control socket %s: %s", ctl->path, strerror(-result));
        goto fail;
    }
    ctl->dev = st.st_dev;
    ctl->ino = st.st_ino;
    if (cfg->group != NULL && cfg->group[0] != '\0') {
        if (chown(ctl->path, (uid_t)-1, gid) != 0) {
            result = -errno;
            snprintf(err, errlen, "cannot give control socket %s to group %s: %s", ctl->path,
                     cfg->group, strerror(-result));
            goto fail;
        }
        if (chmod(ctl->path, 0660) != 0) {
            result = -errno;
            snprintf(err, errlen, "cannot chmod control socket %s: %s", ctl->path,
                     strerror(-result));
            goto fail;
        }
    } else if (chmod(ctl->path, 0600) != 0) {
        result = -errno;
        snprintf(err, errlen, "cannot chmod control socket %s: %s", ctl->path, strerror(-result));
        goto fail;
    }
    result = uv_listen((uv_stream_t *)&ctl->listener, BACKLOG, on_connection);
    if (result != 0) {
        snprintf(err, errlen, "cannot listen on control socket %s: %s", ctl->path,
                 uv_strerror(result));
        goto fail;
    }
    *ctl_out = ctl;
    return 0;

fail:
    if (ctl->have_file)
        unlink(ctl->path);
    ctl->new_failed = 1;
    uv_close((uv_handle_t *)&ctl->listener, on_listener_closed);
    uv_close((uv_handle_t *)&ctl->drain, on_drain_closed);
    return result;
}

static void on_drain_timeout(uv_timer_t *t)
{
    hm_control *ctl = t->data;
    /* Clients that did not take their last replies in time are cut off. */
    while (!LIST_EMPTY(&ctl->clients))
        client_close(LIST_FIRST(&ctl->clients));
}

void hm_control_close(hm_control *ctl, void (*cb)(void *ud), void *ud)
{
    struct stat st;

    if (ctl->closing)
        return;
    ctl->closing = 1;
    ctl->close_cb = cb;
    ctl->close_ud = ud;
    /* Remove the file only if it is still ours: a second daemon may have
     * replaced a file someone deleted under us. */
    if (ctl->have_file && lstat(ctl->path, &st) == 0 && st.st_dev == ctl->dev &&
        st.st_ino == ctl->ino)
        unlink(ctl->path);
    ctl->have_file = 0;
    uv_close((uv_handle_t *)&ctl->listener, on_listener_closed);

    struct client *c = LIST_FIRST(&ctl->clients);
    while (c != NULL) {
        /* client_close unlinks c, so the next one is taken first. */
        struct client *next = LIST_NEXT(c, link);
        if (c->pending != NULL) {
            c->pending->client = NULL;
            c->pending = NULL;
        }
        if (c->writes == 0) {
            client_close(c);
        } else {
            uv_read_stop((uv_stream_t *)&c->pipe);
            c->reading = 0;
            uv_timer_stop(&c->idle);
            c->close_after_write = 1;
        }
        c = next;
    }
    uv_timer_start(&ctl->drain, on_drain_timeout, DRAIN_MS, 0);
    maybe_finish_close(ctl);
}

/*
 * control: the control socket of hivemindd. A Unix stream socket on the
 * node's libuv loop that speaks newline-delimited JSON: each request line
 * gets exactly one reply line, in order (docs/control-protocol.md).
 *
 *   request  {"cmd": "info", "args": {...}, "id": <optional, echoed>}
 *   reply    {"id": ..., "ok": true, "result": {...}}
 *            {"id": ..., "ok": false, "error": {"code": "...", "message": "..."}}
 *
 * It owns the listening socket, the socket file, the connected clients and
 * their buffers; the commands are registered by the program (hivemindd) with
 * a handler each. A handler answers now or later, exactly once, with
 * hm_control_reply or hm_control_reply_error; the answer is dropped quietly
 * if the client has gone away (or the server was closed) in the meantime.
 *
 * Bounds: a request line is at most max_line bytes (a longer one gets an
 * error reply and the client is disconnected); at most max_clients clients
 * are served at once (one more gets an error line and is closed); a client
 * that sends nothing for idle_timeout_ms while no request of it is pending
 * is closed, unless the program's idle check says that the connection holds
 * something (a trainer's shared buffers) that closing it would release; one
 * request per client is handled at a time, and a client's
 * next line is not read while its replies pile up unread (more than
 * HM_CONTROL_MAX_QUEUED bytes). Malformed JSON, a non-object, a missing or
 * unknown "cmd" each get an error reply and the connection stays usable.
 *
 * The program must ignore SIGPIPE (hivemindd does), since a client may go
 * away while its reply is being written.
 *
 * Socket file: at start an existing file at the path is removed only if it
 * is a socket that nobody listens on (a connect test); if a daemon answers,
 * the server refuses to start (-EADDRINUSE). The file is created with mode
 * 0600, or 0660 and the given group. It is removed on close, unless another
 * server has replaced it since.
 */
#ifndef HM_CONTROL_H
#define HM_CONTROL_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

typedef struct hm_control hm_control;
typedef struct hm_control_req hm_control_req;

#define HM_CONTROL_MAX_LINE (64 * 1024)
#define HM_CONTROL_MAX_CMD 32
#define HM_CONTROL_MAX_ID 256         /* bytes of a string id */
#define HM_CONTROL_MAX_QUEUED (4 * 1024 * 1024)
#define HM_CONTROL_MAX_COMMANDS 64

typedef struct hm_control_config {
    const char *path;          /* socket path, required */
    const char *group;         /* group name or number; NULL: mode 0600 */
    size_t max_clients;        /* default 32 */
    uint64_t idle_timeout_ms;  /* default 300000; UINT64_MAX: never */
    size_t max_line;           /* default HM_CONTROL_MAX_LINE */
} hm_control_config;

/*
 * A handler. args is the request's "args" object (an empty object if it
 * was absent), valid only during the call: take a reference to keep it.
 */
typedef void (*hm_control_handler)(void *ud, hm_control_req *req, const json_t *args);

/*
 * The gid of a group given by name or number (ControlSocketGroup); 0 or
 * -ENOENT with a sentence in err.
 */
int hm_control_lookup_group(const char *name, gid_t *out, char *err, size_t errlen);

/* On failure err holds a sentence for the operator. */
int hm_control_new(uv_loop_t *loop, const hm_control_config *cfg, hm_control **ctl_out, char *err,
                   size_t errlen);
/*
 * Registers cmd (1..HM_CONTROL_MAX_CMD of [a-z0-9_.-]). 0, -EINVAL,
 * -EEXIST or -ENOBUFS (more than HM_CONTROL_MAX_COMMANDS).
 */
int hm_control_register(hm_control *ctl, const char *cmd, hm_control_handler h, void *ud);

/*
 * Answers a request and frees it. result (may be NULL: {}) is taken over,
 * i.e. its reference is stolen. Returns 0, or -EPIPE if the client has gone
 * (the request is freed all the same).
 */
int hm_control_reply(hm_control_req *req, json_t *result);
/* code is a short machine-readable word ("bad_args"), message a sentence. */
int hm_control_reply_error(hm_control_req *req, const char *code, const char *message);
/* The command name of a request. */
const char *hm_control_req_cmd(const hm_control_req *req);
/*
 * The connection a request came on: an id unique for the server's lifetime
 * (never 0), still valid after the client has gone. Resources a command
 * ties to a connection (shared-memory segments) are released when the
 * close callback below reports that id.
 */
uint64_t hm_control_req_client(const hm_control_req *req);

/*
 * cb(ud, conn_id) fires once for each served connection as it closes (the
 * client left, misbehaved, idled out, or the server is closing), after its
 * pending request, if any, has been detached (its reply will be dropped).
 * It must not call back into the server. NULL unsets it.
 */
typedef void (*hm_control_conn_closed_cb)(void *ud, uint64_t conn_id);
void hm_control_set_close_cb(hm_control *ctl, hm_control_conn_closed_cb cb, void *ud);
/*
 * Adds one more such listener (they fire in the order added, after the
 * one set above), for command groups that tie state of their own to a
 * connection. 0, -EINVAL (cb NULL) or -ENOBUFS (HM_CONTROL_MAX_CLOSE_CBS
 * already).
 */
#define HM_CONTROL_MAX_CLOSE_CBS 4
int hm_control_add_close_cb(hm_control *ctl, hm_control_conn_closed_cb cb, void *ud);

/*
 * busy(ud, conn_id) is asked when a connection has been idle for the idle
 * timeout; nonzero keeps it open for another period (it is asked again
 * then). A connection that owns resources tied to it (shared-memory
 * segments) must not be idle-closed, since closing releases them under a
 * trainer that is merely busy training. It must not call back into the
 * server. NULL unsets it: every idle client is closed.
 */
typedef int (*hm_control_busy_cb)(void *ud, uint64_t conn_id);
void hm_control_set_idle_check(hm_control *ctl, hm_control_busy_cb busy, void *ud);

/*
 * Runs a registered command from inside the program (the HTTP status
 * snapshot, http.h), as a client's request would run, on the loop thread.
 * cb(ud, ok, result, code, message) fires exactly once with the reply
 * (result borrowed for the call; code and message set when !ok), possibly
 * before hm_control_call returns. args may be NULL ({}). 0, or -ENOENT (no
 * such command), -ESHUTDOWN (the server is closing), -EINVAL, -ENOMEM; on
 * error cb never fires.
 */
typedef void (*hm_control_local_cb)(void *ud, int ok, const json_t *result, const char *code,
                                    const char *message);
int hm_control_call(hm_control *ctl, const char *cmd, const json_t *args, hm_control_local_cb cb,
                    void *ud);

const char *hm_control_path(const hm_control *ctl);
size_t hm_control_clients(const hm_control *ctl);

/*
 * Stops listening, removes the socket file, lets replies already queued
 * reach their clients (for at most a second), closes every client and
 * frees the server; cb fires after that. Pending requests stay valid:
 * their handlers still reply, and the reply is dropped.
 */
void hm_control_close(hm_control *ctl, void (*cb)(void *ud), void *ud);

/* ---- the pure parts, exposed for tests and the fuzz target ---- */

typedef struct hm_control_request {
    char cmd[HM_CONTROL_MAX_CMD + 1];
    json_t *args; /* an object; never NULL after a successful parse */
    json_t *id;   /* NULL when absent */
} hm_control_request;

/*
 * Parses one request line (without its newline; need not be
 * NUL-terminated). Returns 0, or -EINVAL with *code_out set to
 * "parse_error" (not JSON) or "invalid_request" (not a request object) and
 * a sentence in msg. Even on failure req_out->id may be set (so the error reply
 * can echo it): call hm_control_request_clear either way.
 */
int hm_control_parse_request(const char *line, size_t len, hm_control_request *req_out,
                             const char **code_out, char *msg, size_t msglen);
void hm_control_request_clear(hm_control_request *r);

/*
 * Renders a reply line (with its trailing newline) into a malloc'd string.
 * id may be NULL; for ok replies result may be NULL ({}); the references
 * are not taken. Returns NULL on allocation failure.
 */
char *hm_control_format_reply(const json_t *id, int ok, const json_t *result, const char *code,
                              const char *message, size_t *len_out);

#endif

/*
 * http: the read-only HTTP listener (http.h says what it serves, its
 * threads and its bounds).
 *
 * libmicrohttpd was chosen over h2o and civetweb: it is a C library made
 * to be embedded (no configuration files, no event loop of its own that
 * would fight libuv), it parses and bounds the request for us (we parse
 * nothing beyond the method and path it hands over), it is packaged by
 * every distribution as a shared library (libmicrohttpd-dev) with security
 * updates, and it has an accept policy callback, a connection memory limit
 * and timeouts, which are exactly the limits we need. h2o brings its own
 * loop and HTTP/2 we do not need; civetweb is mostly vendored as source.
 */
#include "config.h"

#include "src/daemon/http.h"
#include "src/daemon/cmd_status.h"
#include "src/base/util.h"

#include <errno.h>
#include <jansson.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "http"
#define REFRESH_MS 2000

/* The page, generated from src/daemon/http_page.html at build time. */
extern const char hm_http_page[];
extern const size_t hm_http_page_len;

enum { C_200, C_404, C_405, C_413, C_503, C_OTHER, N_CODES };
static const char *const code_names[N_CODES] = {"200", "404", "405", "413", "503", "other"};

struct hm_http {
    hm_daemon *d;
    hm_control *ctl;
    struct MHD_Daemon *mhd;
    unsigned max_conns, max_per_origin;
    uint64_t timeout_ms;
    size_t max_request;
    /* ---- the MHD thread's own (never the loop's) ---- */
    hm_origin_tab origins; /* v[0]: connections open */
    unsigned open;
    /* ---- shared, by atomics or the mutex ---- */
    _Atomic uint64_t refused_conns, refused_origin, refused_request, refused_timeout;
    _Atomic uint64_t requests[N_CODES];
    _Atomic unsigned open_now;
    pthread_mutex_t mu;
    char *status;  /* the snapshot's texts; NULL until the first */
    size_t status_len;
    char *metrics;
    size_t metrics_len;
    /* ---- the loop's ---- */
    uv_timer_t timer;
    int timer_open;
    int jobs; /* a status build and a "metrics" call in flight */
    char *next_status, *next_metrics;
    int closing;
    void (*close_cb)(void *ud);
    void *close_ud;
};

/* The connection's origin, kept from its start to its close. */
typedef struct conn_ctx {
    hm_origin o;
    uint64_t last_ms; /* the start, or the end of its last request */
} conn_ctx;

/* ---- the MHD thread ---- */

static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen)
{
    hm_http *h = cls;
    (void)addrlen;
    if (h->open >= h->max_conns) {
        atomic_fetch_add(&h->refused_conns, 1);
        return MHD_NO;
    }
    hm_origin o;
    hm_origin_of(addr, &o);
    hm_origin_ent *e = hm_origin_tab_get(&h->origins, &o, 0);
    if (e != NULL && e->v[0] >= h->max_per_origin) {
        atomic_fetch_add(&h->refused_origin, 1);
        return MHD_NO;
    }
    return MHD_YES;
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe)
{
    hm_http *h = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        conn_ctx *c = calloc(1, sizeof(*c));
        if (c == NULL)
            return;
        hm_origin_of(ci != NULL ? ci->client_addr : NULL, &c->o);
        hm_origin_ent *e = hm_origin_tab_get(&h->origins, &c->o, 1);
        if (e == NULL) {
            /* A full origin table counts nobody new: the connection is
             * still bounded by HttpMaxConnections. */
            free(c);
            return;
        }
        e->v[0]++;
        c->last_ms = hm_now_ms();
        h->open++;
        atomic_store(&h->open_now, h->open);
        *socket_context = c;
    } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        conn_ctx *c = *socket_context;
        if (c == NULL)
            return;
        /* libmicrohttpd does not say why it closes; a connection that saw
         * nothing complete for the whole timeout was closed for it (a
         * client leaving by itself almost never waits exactly so long). */
        if (hm_now_ms() - c->last_ms + 50 >= h->timeout_ms)
            atomic_fetch_add(&h->refused_timeout, 1);
        hm_origin_ent *e = hm_origin_tab_get(&h->origins, &c->o, 0);
        if (e != NULL && e->v[0] > 0) {
            e->v[0]--;
            hm_origin_tab_release(&h->origins, e);
        }
        h->open--;
        atomic_store(&h->open_now, h->open);
        free(c);
        *socket_context = NULL;
    }
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)cls;
    (void)con_cls;
    (void)toe;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    conn_ctx *c = ci != NULL ? ci->socket_context : NULL;
    if (c != NULL)
        c->last_ms = hm_now_ms();
}

static void count(hm_http *h, unsigned code)
{
    int i = code == 200   ? C_200
            : code == 404 ? C_404
            : code == 405 ? C_405
            : code == 413 ? C_413
            : code == 503 ? C_503
                          : C_OTHER;
    atomic_fetch_add(&h->requests[i], 1);
}

static enum MHD_Result respond(hm_http *h, struct MHD_Connection *conn, unsigned code,
                               const char *type, const void *body, size_t len,
                               enum MHD_ResponseMemoryMode mode)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(len, (void *)body, mode);
    if (r == NULL) {
        if (mode == MHD_RESPMEM_MUST_FREE)
            free((void *)body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    /* The page loads nothing from anywhere: its script and styles are
     * inline and it talks to this listener only. */
    MHD_add_response_header(r, "Content-Security-Policy",
                            "default-src 'none'; script-src 'unsafe-inline'; style-src "
                            "'unsafe-inline'; connect-src 'self'; img-src data:; "
                            "frame-ancestors 'none'");
    if (code == 405)
        MHD_add_response_header(r, "Allow", "GET, HEAD");
    if (code == 503)
        MHD_add_response_header(r, "Retry-After", "1");
    enum MHD_Result res = MHD_queue_response(conn, code, r);
    MHD_destroy_response(r);
    count(h, code);
    return res;
}

static enum MHD_Result error(hm_http *h, struct MHD_Connection *conn, unsigned code,
                             const char *text)
{
    return respond(h, conn, code, "text/plain; charset=utf-8", text, strlen(text),
                   MHD_RESPMEM_PERSISTENT);
}

/* Adds up the request line and headers, as the client sent them. */
static enum MHD_Result add_header(void *cls, enum MHD_ValueKind kind, const char *key,
                                  const char *value)
{
    size_t *n = cls;
    (void)kind;
    *n += strlen(key) + 4 + (value != NULL ? strlen(value) : 0);
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls)
{
    hm_http *h = cls;
    (void)version;
    (void)upload_data;
    (void)con_cls;
    int head = strcmp(method, "HEAD") == 0;
    if (!head && strcmp(method, "GET") != 0)
        return error(h, conn, 405, "only GET and HEAD\n");
    size_t n = strlen(method) + strlen(url) + 12;
    MHD_get_connection_values(conn, MHD_HEADER_KIND, add_header, &n);
    if (n > h->max_request) {
        atomic_fetch_add(&h->refused_request, 1);
        return error(h, conn, 413, "request headers too large (HttpMaxRequestBytes)\n");
    }
    /* A body is nothing we read: refused, and the connection closes after. */
    if ((upload_data_size != NULL && *upload_data_size > 0) ||
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length") != NULL ||
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Transfer-Encoding") != NULL) {
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
        if (cl == NULL || strcmp(cl, "0") != 0) {
            atomic_fetch_add(&h->refused_request, 1);
            return error(h, conn, 413, "a request body is not accepted\n");
        }
    }
    if (strcmp(url, "/") == 0 || strcmp(url, "/index.html") == 0)
        return respond(h, conn, 200, "text/html; charset=utf-8", hm_http_page, hm_http_page_len,
                       MHD_RESPMEM_PERSISTENT);
    int is_status = strcmp(url, "/api/status") == 0, is_metrics = strcmp(url, "/metrics") == 0;
    if (!is_status && !is_metrics)
        return error(h, conn, 404, "not found: try /, /api/status or /metrics\n");
    char *copy = NULL;
    size_t len = 0;
    pthread_mutex_lock(&h->mu);
    const char *src = is_status ? h->status : h->metrics;
    len = is_status ? h->status_len : h->metrics_len;
    if (src != NULL && (copy = malloc(len + 1)) != NULL)
        memcpy(copy, src, len);
    pthread_mutex_unlock(&h->mu);
    if (src == NULL)
        return error(h, conn, 503, "the first snapshot is being taken\n");
    if (copy == NULL)
        return MHD_NO;
    return respond(h, conn, 200,
                   is_status ? "application/json" : "text/plain; version=0.0.4; charset=utf-8",
                   copy, len, MHD_RESPMEM_MUST_FREE);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    char msg[256];
    (void)cls;
    vsnprintf(msg, sizeof(msg), fmt, ap);
    msg[strcspn(msg, "\n")] = '\0';
    hm_debug(MOD, "libmicrohttpd: %s", msg);
}

/* ---- the loop ---- */

static void http_free(hm_http *h)
{
    pthread_mutex_destroy(&h->mu);
    hm_origin_tab_free(&h->origins);
    free(h->status);
    free(h->metrics);
    free(h->next_status);
    free(h->next_metrics);
    void (*cb)(void *) = h->close_cb;
    void *ud = h->close_ud;
    free(h);
    if (cb != NULL)
        cb(ud);
}

static void maybe_free(hm_http *h)
{
    if (h->closing && h->jobs == 0 && !h->timer_open)
        http_free(h);
}

static void http_metrics(hm_http *h, hm_strbuf *b)
{
    hm_strbuf_printf(b, "# HELP hivemindd_http_requests_total HTTP requests answered, by status "
                        "code.\n# TYPE hivemindd_http_requests_total counter\n");
    for (int i = 0; i < N_CODES; i++)
        hm_strbuf_printf(b, "hivemindd_http_requests_total{code=\"%s\"} %llu\n", code_names[i],
                         (unsigned long long)atomic_load(&h->requests[i]));
    hm_strbuf_printf(b, "# HELP hivemindd_http_connections HTTP connections open.\n"
                        "# TYPE hivemindd_http_connections gauge\n"
                        "hivemindd_http_connections %u\n",
                     atomic_load(&h->open_now));
}

/* Both halves of a refresh are in: the texts replace the old ones. */
static void publish_if_done(hm_http *h)
{
    if (h->jobs != 0)
        return;
    if (!h->closing && h->next_status != NULL && h->next_metrics != NULL) {
        pthread_mutex_lock(&h->mu);
        char *old_s = h->status, *old_m = h->metrics;
        h->status = h->next_status;
        h->status_len = strlen(h->status);
        h->metrics = h->next_metrics;
        h->metrics_len = strlen(h->metrics);
        pthread_mutex_unlock(&h->mu);
        free(old_s);
        free(old_m);
        h->next_status = h->next_metrics = NULL;
    }
    maybe_free(h);
}

static void on_status(void *ud, const json_t *st)
{
    hm_http *h = ud;
    free(h->next_status);
    h->next_status = json_dumps(st, JSON_COMPACT);
    h->jobs--;
    publish_if_done(h);
}

static void on_metrics(void *ud, int ok, const json_t *result, const char *code,
                       const char *message)
{
    hm_http *h = ud;
    (void)code;
    (void)message;
    free(h->next_metrics);
    h->next_metrics = NULL;
    const char *text = ok ? json_string_value(json_object_get(result, "text")) : NULL;
    if (text != NULL && !h->closing) {
        hm_strbuf b = {0};
        hm_strbuf_printf(&b, "%s", text);
        hm_cmd_status_metrics(h->d->status, &b);
        http_metrics(h, &b);
        h->next_metrics = hm_strbuf_finish(&b);
    }
    h->jobs--;
    publish_if_done(h);
}

static void on_refresh(uv_timer_t *t)
{
    hm_http *h = t->data;
    if (h->jobs != 0 || h->closing || h->d->status == NULL)
        return;
    h->jobs += 2;
    if (hm_cmd_status_build(h->d->status, on_status, h) != 0)
        h->jobs--;
    if (hm_control_call(h->ctl, "metrics", NULL, on_metrics, h) != 0)
        h->jobs--;
    publish_if_done(h);
}

static void on_timer_closed(uv_handle_t *hd)
{
    hm_http *h = hd->data;
    h->timer_open = 0;
    maybe_free(h);
}

void hm_http_close(hm_http *h, void (*cb)(void *ud), void *ud)
{
    h->closing = 1;
    h->close_cb = cb;
    h->close_ud = ud;
    if (h->mhd != NULL) {
        MHD_stop_daemon(h->mhd);
        h->mhd = NULL;
    }
    uv_close((uv_handle_t *)&h->timer, on_timer_closed);
}

void hm_http_limits(hm_http *h, hm_limit_emit_fn emit, void *ud)
{
    /* Without a listener the limits refuse nothing; the lines stay, so
     * that a dashboard's series exist whatever the configuration. */
    emit(ud, "HttpMaxConnections", h ? atomic_load(&h->refused_conns) : 0);
    emit(ud, "HttpMaxConnectionsPerOrigin", h ? atomic_load(&h->refused_origin) : 0);
    emit(ud, "HttpMaxRequestBytes", h ? atomic_load(&h->refused_request) : 0);
    emit(ud, "HttpTimeout", h ? atomic_load(&h->refused_timeout) : 0);
}

int hm_http_new(hm_daemon *d, hm_control *ctl, hm_http **out, char *addr, size_t addrlen,
                char *err, size_t errlen)
{
    const hm_config *c = d->cfg;
    struct sockaddr_storage ss;
    int r;
    *out = NULL;
    if (addrlen > 0)
        addr[0] = '\0';
    if (c->http_listen[0] == '\0')
        return 0;
    /* A host name is resolved here, once: this runs at start, before the
     * loop does, so the lookup's blocking holds up nothing. */
    char why[320];
    if ((r = hm_resolve_hostport(c->http_listen, &ss, why, sizeof(why))) != 0) {
        snprintf(err, errlen, "HttpListen %s: %s", c->http_listen, why);
        return r;
    }
    hm_http *h = calloc(1, sizeof(*h));
    if (h == NULL) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    h->d = d;
    h->ctl = ctl;
    h->max_conns = c->http_max_connections;
    h->max_per_origin = c->http_max_conns_per_origin;
    h->max_request = c->http_max_request_bytes;
    h->timeout_ms = (uint64_t)c->http_timeout_s * 1000u;
    pthread_mutex_init(&h->mu, NULL);
    if ((r = hm_origin_tab_init(&h->origins, 4096)) != 0) {
        snprintf(err, errlen, "out of memory");
        pthread_mutex_destroy(&h->mu);
        free(h);
        return r;
    }
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG | MHD_USE_POLL;
    if (ss.ss_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    /* The pool holds the request line and headers and the response's
     * headers; past HttpMaxRequestBytes plus room for the latter a request
     * is refused by libmicrohttpd itself (431), below it by us (413). */
    size_t pool = (size_t)c->http_max_request_bytes + 4096;
    h->mhd = MHD_start_daemon(
        flags, 0, on_accept, h, on_request, h, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h,
        MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)c->http_max_connections + 1,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)c->http_timeout_s,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, pool, MHD_OPTION_NOTIFY_CONNECTION, on_connection, h,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, h, MHD_OPTION_LISTEN_BACKLOG_SIZE, 64u, MHD_OPTION_END);
    if (h->mhd == NULL) {
        snprintf(err, errlen, "cannot listen for HTTP on %s (HttpListen): in use, or not an "
                 "address of this host", c->http_listen);
        hm_origin_tab_free(&h->origins);
        pthread_mutex_destroy(&h->mu);
        free(h);
        return -EADDRINUSE;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_BIND_PORT);
    unsigned port = di != NULL ? di->port : 0;
    char host[HM_ADDRSTRLEN];
    hm_strlcpy(host, c->http_listen, sizeof(host));
    char *colon = strrchr(host, ':');
    if (colon != NULL)
        *colon = '\0';
    snprintf(addr, addrlen, "%s:%u", host, port);
    uv_timer_init(d->loop, &h->timer);
    h->timer.data = h;
    h->timer_open = 1;
    uv_timer_start(&h->timer, on_refresh, 0, REFRESH_MS);
    hm_info(MOD, "serving /metrics, /api/status and the swarm page on http://%s/", addr);
    *out = h;
    return 0;
}

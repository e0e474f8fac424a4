/*
 * http: the optional, read-only HTTP listener of hivemindd (HttpListen,
 * --http-listen; off by default). It serves
 *
 *   GET /metrics      the Prometheus text: "metrics" plus process_*,
 *                     rounds, connections by state and per-expert figures
 *                     (hm_cmd_status_metrics)
 *   GET /api/status   the swarm snapshot as JSON (cmd_status.h)
 *   GET /             the swarm page: one HTML file with its script and
 *                     styles inside, compiled into the daemon
 *                     (src/daemon/http_page.html), which polls /api/status
 *
 * and HEAD of each; any other method gets 405, any other path 404, a
 * request with a body 413. It exposes nothing the control socket's "info",
 * "peers", "averaging", "experts.list", "progress" and "metrics" do not,
 * and no key.
 *
 * Threads. libmicrohttpd runs the listener on a thread of its own (one
 * polling thread, MHD_USE_INTERNAL_POLLING_THREAD, so its callbacks never
 * run concurrently with each other). That thread never touches loop-owned
 * state: the loop refreshes a snapshot every 2 s (a status build and the
 * "metrics" command, run locally) and swaps the rendered texts in under a
 * mutex; a request copies the current text under the same mutex and
 * answers at once. A snapshot, rather than handing each request to the
 * loop through uv_async and waiting, because a request then costs the
 * loop nothing (a page left open, or a scraper hammering /metrics, cannot
 * slow the DHT or an all-reduce), the HTTP thread never blocks on the
 * loop, and a 2 s old figure is as good as a fresh one for a dashboard
 * (Prometheus scrapes every 15 s or more).
 *
 * Bounds (docs/security.md): HttpMaxConnections open at once,
 * HttpMaxConnectionsPerOrigin per network origin (src/base/origin.h;
 * both counted in the accept policy, before a byte is read),
 * HttpMaxRequestBytes of request line and headers (libmicrohttpd's pool
 * holds them; a request over it is refused, 413 or libmicrohttpd's own
 * 431), no request body, and HttpTimeout seconds of idleness. Each
 * refusal is counted under its keyword (hm_http_limits).
 */
#ifndef HM_DAEMON_HTTP_H
#define HM_DAEMON_HTTP_H

#include "src/daemon/daemon.h"
#include "src/base/origin.h"

/*
 * Starts the listener at d->cfg->http_listen (nothing when it is empty:
 * *out is NULL), and the loop's snapshot timer. On success the bound
 * address (port 0 resolved) is written into addr. 0, or a negative code
 * with a sentence in err.
 */
int hm_http_new(hm_daemon *d, hm_control *ctl, hm_http **out, char *addr, size_t addrlen,
                char *err, size_t errlen);

/* Stops the listener at once (its thread is joined), then frees the rest
 * once the snapshot in flight, if any, has come; cb fires after that. */
void hm_http_close(hm_http *h, void (*cb)(void *ud), void *ud);

/* HttpMaxConnections, HttpMaxConnectionsPerOrigin, HttpMaxRequestBytes
 * and HttpTimeout, with what each refused (h NULL, the listener off: 0). */
void hm_http_limits(hm_http *h, hm_limit_emit_fn emit, void *ud);

#endif

/*
 * cmd_node: the node's own control commands (daemon.h): "info" (identity,
 * address, version, uptime, shared memory in use), "peers" (the peer table
 * with round-trip times), "metrics" (the Prometheus text) and "shutdown".
 * It owns nothing; every command answers at once, on the loop thread.
 */
#include "config.h"

#include "src/daemon/daemon.h"
#include "src/daemon/cmd_experts.h"
#include "src/daemon/http.h"
#include "src/base/crypto.h"
#include "src/base/util.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void cmd_info(void *ud, hm_control_req *req, const json_t *args)
{
    hm_daemon *d = ud;
    char addr[HM_PEER_ID_LEN + HM_ADDRSTRLEN + 2];
    (void)args;
    if (d->node == NULL) {
        hm_daemon_reply_stopping(req);
        return;
    }
    if (hm_node_address(d->node, addr, sizeof(addr)) != 0)
        addr[0] = '\0';
    size_t shm_segments = 0, shm_bytes = 0;
    /* The registry itself, not hm_daemon_shm: it lives until the loop is
     * over, so info tells the truth during a shutdown too. */
    if (d->shm != NULL)
        hm_shm_stats(d->shm, &shm_segments, &shm_bytes);
    /* The declared address and whether anyone can dial it (docs/control-protocol.md). */
    hm_node_reach_info ri;
    json_t *announce = json_null(), *reachable = json_string("unknown");
    char a[HM_ADDRSTRLEN];
    int client_mode = d->cfg->client_mode;
    struct sockaddr_storage lss;
    char listen[HM_ADDRSTRLEN] = "";
    if (hm_transport_local_addr(hm_rpc_transport(hm_node_rpc(d->node)), &lss) != 0 ||
        hm_format_addr((const struct sockaddr *)&lss, listen, sizeof(listen)) != 0)
        listen[0] = '\0';
    if (hm_node_reach(d->node, &ri) == 0) {
        if (ri.declared && hm_format_addr((const struct sockaddr *)&ri.addr, a, sizeof(a)) == 0)
            announce = json_string(a);
        if (ri.reachable != HM_REACH_UNKNOWN) {
            json_decref(reachable);
            reachable = json_boolean(ri.reachable == HM_REACH_YES);
        }
        client_mode = ri.client_mode;
    } else {
        ri.source[0] = '\0';
        ri.reason[0] = '\0';
        ri.auto_client_mode = 0;
    }
    json_t *res = json_pack("{s:s, s:s, s:s, s:s, s:I, s:b, s:I, s:s, s:{s:I, s:I}, "
                                   "s:s, s:o, s:o, s:s, s:s, s:b, s:o}",
                                 "peer_id", hm_node_identity(d->node)->peer_id, "address", addr,
                                 "swarm", hm_node_swarm(d->node), "version", PACKAGE_VERSION,
                                 "uptime_s", (json_int_t)(hm_node_uptime_ms(d->node) / 1000),
                                 "client_mode", client_mode, "pid", (json_int_t)getpid(),
                                 "control_socket", d->cfg->control_socket, "shm", "segments",
                                 (json_int_t)shm_segments, "bytes", (json_int_t)shm_bytes,
                                 "listen", listen, "announce", announce, "reachable", reachable,
                                 "announce_source", ri.source, "reach_reason", ri.reason,
                                 "client_mode_auto", ri.auto_client_mode, "http",
                                 d->http_address[0] ? json_string(d->http_address)
                                                    : json_null());
    /* -- relay -- the relay this node is reachable through, and what it relays for others. */
    hm_relay_status rs;
    hm_node_relay(d->node, &rs);
    json_t *rel = json_pack("{s:s, s:s?, s:s?, s:s, s:I, s:I, s:I, s:I, s:b, s:I, s:I, s:I, s:I}",
                            "state", rs.state_name, "relay", rs.relay[0] ? rs.relay : NULL,
                            "address", rs.address[0] ? rs.address : NULL, "reason", rs.reason,
                            "failovers", (json_int_t)rs.failovers,
                            "accepts", (json_int_t)rs.accepts,
                            "refused_dialler_origin", (json_int_t)rs.refused_dialler_origin,
                            "dialler_not_taken", (json_int_t)rs.dialler_not_taken,
                            "serving", rs.serving,
                            "reservations", (json_int_t)rs.reservations,
                            "circuits", (json_int_t)rs.circuits,
                            "circuits_total", (json_int_t)rs.circuits_total,
                            "bytes_relayed", (json_int_t)rs.bytes_relayed);
    if (res != NULL && rel != NULL)
        json_object_set_new(res, "relay", rel);
    else
        json_decref(rel);
    hm_daemon_reply(req, res);
}

static void cmd_peers(void *ud, hm_control_req *req, const json_t *args)
{
    hm_daemon *d = ud;
    hm_peer_info *peers = NULL;
    json_t *list = NULL;
    (void)args;

    if (d->node == NULL) {
        hm_daemon_reply_stopping(req);
        return;
    }
    size_t total = hm_node_peers(d->node, NULL, 0);
    if (total > 0) {
        peers = calloc(total, sizeof(*peers));
        if (peers == NULL)
            goto fail;
        total = HM_MIN(total, hm_node_peers(d->node, peers, total));
    }
    list = json_array();
    if (list == NULL)
        goto fail;
    uint64_t now = hm_now_ms();
    for (size_t i = 0; i < total; i++) {
        const hm_peer_info *p = &peers[i];
        char a[HM_ADDRSTRLEN];
        json_t *addr = json_null();
        if ((p->addr.ss_family == AF_INET || p->addr.ss_family == AF_INET6) &&
            hm_format_addr((const struct sockaddr *)&p->addr, a, sizeof(a)) == 0)
            addr = json_string(a);
        uint64_t ago = now > p->last_seen_ms ? now - p->last_seen_ms : 0;
        json_t *e = json_pack("{s:s, s:o, s:f, s:o, s:b, s:b}", "peer_id", p->peer_id, "address",
                              addr, "last_seen_s", (double)ago / 1000.0, "rtt_ms",
                              p->rtt_ms < 0 ? json_null() : json_real(round(p->rtt_ms * 1000) / 1000),
                              "connected",
                              p->connected, "verified", p->verified);
        if (e == NULL || json_array_append_new(list, e) != 0)
            goto fail;
    }
    free(peers);
    hm_daemon_reply(req, json_pack("{s:o}", "peers", list));
    return;
fail:
    free(peers);
    json_decref(list);
    hm_control_reply_error(req, "internal", "out of memory");
}

static void cmd_metrics(void *ud, hm_control_req *req, const json_t *args)
{
    hm_daemon *d = ud;
    (void)args;
    if (d->node == NULL) {
        hm_daemon_reply_stopping(req);
        return;
    }
    char *node_text = hm_node_metrics(d->node);
    if (node_text == NULL) {
        hm_control_reply_error(req, "internal", "out of memory");
        return;
    }
    hm_strbuf b = {0};
    hm_strbuf_printf(&b, "%s", node_text);
    free(node_text);
    hm_cmd_experts_metrics(d->experts, &b);
    hm_daemon_limit_metrics(d, &b);
    char *text = hm_strbuf_finish(&b);
    if (text == NULL) {
        hm_control_reply_error(req, "internal", "out of memory");
        return;
    }
    hm_daemon_reply(req, json_pack("{s:s}", "text", text));
    free(text);
}

static void limit_line(void *ud, const char *keyword, uint64_t refused)
{
    hm_strbuf_printf(ud, "hivemindd_limit_refused_total{limit=\"%s\"} %llu\n", keyword,
                     (unsigned long long)refused);
}

void hm_daemon_limit_metrics(hm_daemon *d, hm_strbuf *b)
{
    hm_strbuf_printf(b, "# HELP hivemindd_limit_refused_total What each limit refused, by its "
                        "config keyword (docs/security.md).\n"
                        "# TYPE hivemindd_limit_refused_total counter\n");
    if (d->node != NULL)
        hm_node_limits(d->node, limit_line, b);
    if (d->av != NULL)
        hm_averager_limits(d->av, limit_line, b);
    if (d->state != NULL)
        hm_cmd_state_limits(d->state, limit_line, b);
    hm_cmd_experts_limits(d->experts, limit_line, b);
    if (d->progress != NULL)
        hm_cmd_progress_limits(d->progress, limit_line, b);
    hm_http_limits(d->http, limit_line, b);
}

static void cmd_shutdown(void *ud, hm_control_req *req, const json_t *args)
{
    hm_daemon *d = ud;
    (void)args;
    /* The reply is queued first; closing the server lets it be written. */
    hm_daemon_reply(req, json_pack("{s:b}", "stopping", 1));
    d->stop(d, "hivemindctl shutdown");
}

int hm_cmd_node_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen)
{
    int r;
    if ((r = hm_control_register(ctl, "info", cmd_info, d)) != 0 ||
        (r = hm_control_register(ctl, "peers", cmd_peers, d)) != 0 ||
        (r = hm_control_register(ctl, "metrics", cmd_metrics, d)) != 0 ||
        (r = hm_control_register(ctl, "shutdown", cmd_shutdown, d)) != 0)
        snprintf(err, errlen, "cannot register the node commands: %s", hm_strerror(r));
    return r;
}

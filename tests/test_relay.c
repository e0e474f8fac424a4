/*
 * test_relay: circuit relays (src/net/relay.h) between in-process nodes on
 * loopback. The relays listen on 127.0.0.1, the NAT'd peers on 127.0.0.3
 * and up, diallers on 127.0.0.2 and up, so that each is an origin of its
 * own (origin.h):
 *  - a reservation, then a dialler's stream call to the NAT'd peer through
 *    the relay's address: the reply is the NAT'd peer's, the relay copied
 *    the bytes and holds no session of its own with the dialler;
 *  - reservations and circuits per origin refused with their counters,
 *    while another origin still gets through;
 *  - a circuit over RelayMaxMiB cut, one over RelayRate paused (and
 *    completed), one past RelayCircuitLifetime closed, RelayMaxCircuits
 *    refusing another origin, each with its counter;
 *  - a state shared by the NAT'd peer is loaded through the relay, whole;
 *  - the relay dies: the NAT'd peer moves to the second relay and is
 *    reached through it; with no relay left it says so.
 */
#include "config.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>

#include "tests/loop.h"
#include "src/net/relay.h"
#include "averaging/state.h"

TestSuite(relay, .timeout = 120);

/* Inbound connections per origin at the next node made (0: the default). */
static size_t conns_per_origin;

static hm_node *make_full(uv_loop_t *loop, const char *listen, const hm_relay_config *rc,
                          const char *peer, uint64_t ping_ms)
{
    hm_node_options o = {0};
    o.transport.max_conns_per_origin = conns_per_origin;
    const char *peers[1] = {peer};
    signal(SIGPIPE, SIG_IGN);
    o.listen = listen;
    o.swarm = "relay-test";
    o.ping_interval_ms = ping_ms;
    if (peer != NULL) {
        o.initial_peers = peers;
        o.n_initial_peers = 1;
    }
    o.dht.rate_per_s = 1e6;
    o.dht.rate_burst = 1e6;
    if (rc != NULL)
        o.relay = *rc;
    hm_node *n = NULL;
    char err[256] = "";
    int r = hm_node_new(loop, &o, &n, err, sizeof(err));
    cr_assert_eq(r, 0, "hm_node_new: %s", err);
    return n;
}

static hm_node *make(uv_loop_t *loop, const char *listen, const hm_relay_config *rc)
{
    return make_full(loop, listen, rc, NULL, 1000);
}

static void addr_of(hm_node *n, struct sockaddr_storage *ss)
{
    cr_assert_eq(hm_transport_local_addr(hm_rpc_transport(hm_node_rpc(n)), ss), 0);
}

static void via(hm_relay_config *rc, hm_node *relay)
{
    memcpy(rc->via[rc->n_via].pk, hm_node_identity(relay)->pk, HM_PK_BYTES);
    addr_of(relay, &rc->via[rc->n_via].addr);
    rc->n_via++;
}

static hm_relay_config serving(void)
{
    hm_relay_config rc = {0};
    rc.serve = 1;
    return rc;
}

/* ---- waiting for a relay state ---- */

struct want_state {
    hm_node *n;
    int state;
    int via;
};

static int state_is(void *ud)
{
    struct want_state *w = ud;
    hm_relay_status st;
    hm_node_relay(w->n, &st);
    return st.state == w->state && (w->via < 0 || st.via_index == w->via);
}

static void wait_state(uv_loop_t *loop, hm_node *n, int state, int via_index, uint64_t ms)
{
    struct want_state w = {n, state, via_index};
    hm_relay_status st;
    int ok = hm_test_run_until(loop, state_is, &w, ms);
    hm_node_relay(n, &st);
    cr_assert(ok, "relay state %s via %d (%s), want %d via %d", st.state_name, st.via_index,
              st.reason, state, via_index);
}

/* ---- an echo method on the NAT'd peer, and calls to it ---- */

static int echo_served;
static struct sockaddr_storage echo_from; /* the last call's */

static void on_echo(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                    const struct sockaddr *from, const uint8_t *body, size_t len)
{
    HM_UNUSED(ud);
    HM_UNUSED(peer_pk);
    echo_served++;
    memcpy(&echo_from, from, hm_addr_len(from));
    /* The answer differs from the question, so that a copy of the request cannot pass. */
    uint8_t *out = malloc(len + 1);
    cr_assert_not_null(out);
    for (size_t i = 0; i < len; i++)
        out[i] = (uint8_t)(body[i] ^ 0x5a);
    out[len] = 0x42;
    hm_rpc_respond(req, 0, out, len + 1);
    free(out);
}

struct call {
    int done;
    int status;
    uint8_t *reply;
    size_t len;
};

static void on_reply(void *ud, int status, const uint8_t *body, size_t len)
{
    struct call *c = ud;
    c->done = 1;
    c->status = status;
    if (status == 0) {
        c->reply = malloc(len ? len : 1);
        memcpy(c->reply, body, len);
        c->len = len;
    }
}

static int call_done(void *ud) { return ((struct call *)ud)->done; }

/* Calls test.echo on target at the address `at` (the relay's) from `from`. */
static int call_echo(uv_loop_t *loop, hm_node *from, hm_node *target, const struct sockaddr_storage *at,
                     size_t n, struct call *c)
{
    uint8_t *body = malloc(n);
    cr_assert_not_null(body);
    for (size_t i = 0; i < n; i++)
        body[i] = (uint8_t)(i * 7 + 3);
    memset(c, 0, sizeof(*c));
    int r = hm_rpc_call(hm_node_rpc(from), hm_node_identity(target)->pk, (const struct sockaddr *)at,
                        "test.echo", body, n, HM_RPC_STREAM, 8000, on_reply, c, NULL);
    cr_assert_eq(r, 0, "hm_rpc_call: %s", hm_strerror(r));
    hm_test_run_until(loop, call_done, c, 10000);
    cr_assert(c->done);
    if (c->status == 0) {
        cr_assert_eq(c->len, n + 1);
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(c->reply[i], (uint8_t)(body[i] ^ 0x5a), "byte %zu", i);
        cr_assert_eq(c->reply[n], 0x42);
    }
    free(body);
    free(c->reply);
    c->reply = NULL;
    return c->status;
}

/* ---- limit counters ---- */

struct lim {
    const char *kw;
    uint64_t v;
};

static void on_limit(void *ud, const char *kw, uint64_t refused)
{
    struct lim *l = ud;
    if (strcmp(kw, l->kw) == 0)
        l->v = refused;
}

static uint64_t limit(hm_node *n, const char *kw)
{
    struct lim l = {kw, UINT64_MAX};
    hm_node_limits(n, on_limit, &l);
    cr_assert_neq(l.v, UINT64_MAX, "no limit %s", kw);
    return l.v;
}

static int closed_count;
static void on_closed(void *ud)
{
    HM_UNUSED(ud);
    closed_count++;
}
static int all_closed_target;
static int all_closed(void *ud)
{
    HM_UNUSED(ud);
    return closed_count >= all_closed_target;
}

static void close_all(uv_loop_t *loop, hm_node **nodes, int n)
{
    closed_count = 0;
    all_closed_target = 0;
    for (int i = 0; i < n; i++)
        if (nodes[i] != NULL) {
            hm_node_close(nodes[i], on_closed, NULL);
            all_closed_target++;
        }
    cr_assert(hm_test_run_until(loop, all_closed, NULL, 10000), "nodes did not close");
    uv_run(loop, UV_RUN_NOWAIT);
    cr_assert_eq(uv_loop_close(loop), 0, "handles left open");
}

static hm_node *natd(uv_loop_t *loop, const char *listen, hm_relay_config *rc)
{
    rc->refresh_ms = rc->refresh_ms ? rc->refresh_ms : 300;
    rc->retry_min_ms = rc->retry_min_ms ? rc->retry_min_ms : 200;
    rc->retry_max_ms = rc->retry_max_ms ? rc->retry_max_ms : 400;
    hm_node *n = make(loop, listen, rc);
    cr_assert_eq(hm_rpc_register(hm_node_rpc(n), "test.echo", on_echo, NULL), 0);
    hm_node_relay_set_active(n, 1);
    return n;
}

/* A relay on 127.0.0.1 and a NAT'd peer on 127.0.0.3 that uses it, with
 * max_conns_per_origin (0: the default) at the NAT'd peer. */
static hm_node *relay_and_natd(uv_loop_t *loop, hm_node **relay, size_t natd_conns_per_origin)
{
    uv_loop_init(loop);
    hm_relay_config rs = serving();
    *relay = make(loop, "127.0.0.1:0", &rs);
    hm_relay_config rc = {0};
    via(&rc, *relay);
    conns_per_origin = natd_conns_per_origin;
    hm_node *n = natd(loop, "127.0.0.3:0", &rc);
    conns_per_origin = 0;
    return n;
}

Test(relay, call_through_a_reservation)
{
    uv_loop_t loop;
    hm_node *r;
    hm_node *n = relay_and_natd(&loop, &r, 0);
    hm_node *d = make(&loop, "127.0.0.2:0", NULL);
    wait_state(&loop, n, HM_RELAY_RESERVED, 0, 5000);

    /* The declared address is the relay's, and info shows it. */
    struct sockaddr_storage ann, ra;
    addr_of(r, &ra);
    cr_assert_eq(hm_node_announce(n, &ann), 0);
    cr_assert(hm_addr_equal((struct sockaddr *)&ann, (struct sockaddr *)&ra));
    hm_relay_status st;
    hm_node_relay(n, &st);
    cr_assert_str_eq(st.state_name, "reserved");
    char want[HM_RELAY_ADDR_LEN], a[HM_ADDRSTRLEN];
    hm_format_addr((struct sockaddr *)&ra, a, sizeof(a));
    snprintf(want, sizeof(want), "%s@%s", hm_node_identity(n)->peer_id, a);
    cr_assert_str_eq(st.address, want);

    echo_served = 0;
    struct call c;
    /* Large enough to take many records and to be split into chunks. */
    cr_assert_eq(call_echo(&loop, d, n, &ra, 200000, &c), 0, "%s", hm_strerror(c.status));
    cr_assert_eq(echo_served, 1);
    hm_relay_status rst;
    hm_node_relay(r, &rst);
    cr_assert_eq(rst.circuits_total, 1);
    cr_assert_eq(rst.circuits, 1);
    cr_assert_geq(rst.bytes_relayed, 400000u, "%llu", (unsigned long long)rst.bytes_relayed);
    /* The relay holds no session of its own with the dialler or for the NAT'd key. */
    hm_transport *rt = hm_rpc_transport(hm_node_rpc(r));
    cr_assert(!hm_transport_connected(rt, hm_node_identity(d)->pk));
    hm_node_relay(n, &st);
    cr_assert_eq(st.accepts, 1);
    char *m = hm_node_metrics(r);
    cr_assert_not_null(m);
    cr_assert(strstr(m, "\nhivemindd_relay_circuits 1\n") != NULL, "%s", m);
    cr_assert(strstr(m, "\nhivemindd_relay_reservations 1\n") != NULL);
    free(m);
    m = hm_node_metrics(n);
    cr_assert(strstr(m, "\nhivemindd_relay_reserved 1\n") != NULL);
    free(m);
    /* A second call reuses the circuit's connection. */
    cr_assert_eq(call_echo(&loop, d, n, &ra, 100, &c), 0);
    hm_node_relay(r, &rst);
    cr_assert_eq(rst.circuits_total, 1);

    /* A key nobody reserved is no circuit: the dial through the relay fails. */
    hm_node *stranger = make(&loop, "127.0.0.4:0", NULL);
    cr_assert_eq(hm_rpc_register(hm_node_rpc(stranger), "test.echo", on_echo, NULL), 0);
    cr_assert_neq(call_echo(&loop, d, stranger, &ra, 100, &c), 0);
    hm_node_relay(r, &rst);
    cr_assert_eq(rst.circuits_total, 1);

    hm_node *all[] = {d, n, r, stranger};
    close_all(&loop, all, 4);
}

struct not_connected {
    hm_transport *t;
    const uint8_t *pk;
};

static int is_not_connected(void *ud)
{
    struct not_connected *w = ud;
    return !hm_transport_connected(w->t, w->pk);
}

/* The host part of the address the last echo call came from. */
static const char *echo_from_host(char *buf, size_t len)
{
    hm_format_addr((struct sockaddr *)&echo_from, buf, len);
    char *colon = strrchr(buf, ':');
    if (colon != NULL)
        *colon = '\0';
    return buf;
}

/*
 * Diallers behind one relay are not one origin at the NAT'd peer: each
 * call's `from` is the dialler's own address, and the per-origin
 * connection cap (1 here) turns away a second key of one dialler's
 * origin while another origin's dialler still gets through.
 */
Test(relay, relayed_diallers_are_charged_to_their_own_origins)
{
    uv_loop_t loop;
    hm_node *r;
    hm_node *n = relay_and_natd(&loop, &r, 1);
    hm_node *d1 = make(&loop, "127.0.0.2:0", NULL);
    hm_node *d1b = make(&loop, "127.0.0.2:0", NULL);
    hm_node *d2 = make(&loop, "127.0.0.5:0", NULL);
    wait_state(&loop, n, HM_RELAY_RESERVED, 0, 5000);
    struct sockaddr_storage ra;
    addr_of(r, &ra);
    struct call c;
    char h[HM_ADDRSTRLEN];

    cr_assert_eq(call_echo(&loop, d1, n, &ra, 1000, &c), 0, "%s", hm_strerror(c.status));
    cr_assert_str_eq(echo_from_host(h, sizeof(h)), "127.0.0.2", "the call came from %s", h);
    cr_assert_eq(call_echo(&loop, d2, n, &ra, 1000, &c), 0, "%s", hm_strerror(c.status));
    cr_assert_str_eq(echo_from_host(h, sizeof(h)), "127.0.0.5", "the call came from %s", h);
    hm_relay_status st;
    hm_node_relay(n, &st);
    cr_assert_eq(st.accepts, 2);
    cr_assert_eq(st.refused_dialler_origin, 0);
    cr_assert_eq(st.dialler_not_taken, 0);

    /* Another key on 127.0.0.2: its origin already holds its one connection. */
    echo_served = 0;
    cr_assert_neq(call_echo(&loop, d1b, n, &ra, 1000, &c), 0, "a second key of one origin got in");
    cr_assert_eq(echo_served, 0);
    hm_node_relay(n, &st);
    cr_assert_eq(st.refused_dialler_origin, 1);
    /* The others still get their answers over the connections they hold. */
    cr_assert_eq(call_echo(&loop, d2, n, &ra, 1000, &c), 0, "%s", hm_strerror(c.status));
    cr_assert_eq(call_echo(&loop, d1, n, &ra, 1000, &c), 0, "%s", hm_strerror(c.status));

    /* A share, not a ban: once d1 is gone, the other key of its origin gets in. */
    const uint8_t *d1_pk = hm_node_identity(d1)->pk;
    uint8_t gone[HM_PK_BYTES];
    memcpy(gone, d1_pk, sizeof(gone));
    closed_count = 0;
    all_closed_target = 1;
    hm_node_close(d1, on_closed, NULL);
    cr_assert(hm_test_run_until(&loop, all_closed, NULL, 10000));
    d1 = NULL;
    struct not_connected nc = {hm_rpc_transport(hm_node_rpc(n)), gone};
    cr_assert(hm_test_run_until(&loop, is_not_connected, &nc, 10000),
              "the NAT'd peer kept its connection to a closed dialler");
    cr_assert_eq(call_echo(&loop, d1b, n, &ra, 1000, &c), 0, "%s", hm_strerror(c.status));
    cr_assert_str_eq(echo_from_host(h, sizeof(h)), "127.0.0.2", "the call came from %s", h);

    hm_node *all[] = {d1, d1b, d2, n, r};
    close_all(&loop, all, 5);
}

Test(relay, reservations_per_origin)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_relay_config rs = serving();
    rs.reservations_per_origin = 1;
    hm_node *r = make(&loop, "127.0.0.1:0", &rs);
    hm_relay_config rc = {0};
    via(&rc, r);
    hm_node *n1 = natd(&loop, "127.0.0.3:0", &rc);
    wait_state(&loop, n1, HM_RELAY_RESERVED, 0, 5000);
    hm_relay_config rc2 = {0};
    via(&rc2, r);
    rc2.retry_min_ms = 5000;
    rc2.retry_max_ms = 5000;
    /* A second identity from the same host is refused ... */
    hm_node *n2 = natd(&loop, "127.0.0.3:0", &rc2);
    wait_state(&loop, n2, HM_RELAY_NONE, -1, 5000);
    cr_assert_eq(limit(r, "RelayReservationsPerOrigin"), 1);
    hm_relay_status st;
    hm_node_relay(n2, &st);
    cr_assert(strstr(st.reason, "no relay") != NULL, "%s", st.reason);
    /* ... another host is not. */
    hm_relay_config rc3 = {0};
    via(&rc3, r);
    hm_node *n3 = natd(&loop, "127.0.0.4:0", &rc3);
    wait_state(&loop, n3, HM_RELAY_RESERVED, 0, 5000);
    hm_node_relay(r, &st);
    cr_assert_eq(st.reservations, 2);
    cr_assert_eq(limit(r, "RelayMaxReservations"), 0);
    hm_node *all[] = {n1, n2, n3, r};
    close_all(&loop, all, 4);
}

Test(relay, circuits_per_origin_and_bytes)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_relay_config rs = serving();
    rs.circuits_per_origin = 1;
    rs.max_circuit_bytes = 256 * 1024;
    hm_node *r = make(&loop, "127.0.0.1:0", &rs);
    hm_relay_config rc = {0};
    via(&rc, r);
    hm_node *n = natd(&loop, "127.0.0.3:0", &rc);
    wait_state(&loop, n, HM_RELAY_RESERVED, 0, 5000);
    struct sockaddr_storage ra;
    addr_of(r, &ra);
    hm_node *d1 = make(&loop, "127.0.0.2:0", NULL);
    hm_node *d2 = make(&loop, "127.0.0.2:0", NULL);
    hm_node *d3 = make(&loop, "127.0.0.5:0", NULL);
    struct call c;
    cr_assert_eq(call_echo(&loop, d1, n, &ra, 1000, &c), 0);
    /* d1's circuit stays open: a second dialler of its host is refused. */
    cr_assert_neq(call_echo(&loop, d2, n, &ra, 1000, &c), 0);
    cr_assert_eq(limit(r, "RelayCircuitsPerOrigin"), 1);
    cr_assert_eq(call_echo(&loop, d3, n, &ra, 1000, &c), 0);
    /* Past RelayMaxMiB the circuit is cut, and the call fails. */
    cr_assert_eq(limit(r, "RelayMaxMiB"), 0);
    cr_assert_neq(call_echo(&loop, d3, n, &ra, 400000, &c), 0);
    cr_assert_eq(limit(r, "RelayMaxMiB"), 1);
    hm_relay_status st;
    hm_node_relay(r, &st);
    cr_assert_eq(st.circuits_total, 2);
    hm_node *all[] = {d1, d2, d3, n, r};
    close_all(&loop, all, 5);
}

struct circuits_at {
    hm_node *relay;
    size_t want;
};

static int circuits_are(void *ud)
{
    struct circuits_at *w = ud;
    hm_relay_status st;
    hm_node_relay(w->relay, &st);
    return st.circuits == w->want;
}

Test(relay, total_rate_and_lifetime)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_relay_config rs = serving();
    rs.max_circuits = 1;
    rs.rate = 256 * 1024;
    rs.circuit_lifetime_ms = 4000;
    hm_node *r = make(&loop, "127.0.0.1:0", &rs);
    hm_relay_config rc = {0};
    via(&rc, r);
    hm_node *n = natd(&loop, "127.0.0.3:0", &rc);
    wait_state(&loop, n, HM_RELAY_RESERVED, 0, 5000);
    struct sockaddr_storage ra;
    addr_of(r, &ra);
    hm_node *d1 = make(&loop, "127.0.0.2:0", NULL);
    hm_node *d2 = make(&loop, "127.0.0.5:0", NULL);
    struct call c;
    /* Over the rate the copy pauses, and the call still completes. */
    cr_assert_eq(call_echo(&loop, d1, n, &ra, 200000, &c), 0, "%s", hm_strerror(c.status));
    cr_assert_gt(limit(r, "RelayRate"), 0);
    /* One circuit in all: a dialler of another origin is refused while d1's lives. */
    cr_assert_neq(call_echo(&loop, d2, n, &ra, 100, &c), 0);
    cr_assert_eq(limit(r, "RelayMaxCircuits"), 1);
    /* At its lifetime the circuit is closed, and the slot is free again. */
    struct circuits_at w = {r, 0};
    cr_assert(hm_test_run_until(&loop, circuits_are, &w, 8000), "the circuit outlived its lifetime");
    cr_assert_eq(limit(r, "RelayCircuitLifetime"), 1);
    int rc2 = call_echo(&loop, d2, n, &ra, 100, &c);
    hm_relay_status st;
    hm_node_relay(r, &st);
    cr_assert_eq(rc2, 0, "%s: total %llu, max %llu, origin %llu, life %llu", hm_strerror(c.status),
                 (unsigned long long)st.circuits_total,
                 (unsigned long long)limit(r, "RelayMaxCircuits"),
                 (unsigned long long)limit(r, "RelayCircuitsPerOrigin"),
                 (unsigned long long)limit(r, "RelayCircuitLifetime"));
    hm_node *all[] = {d1, d2, n, r};
    close_all(&loop, all, 4);
}

Test(relay, failover_then_none)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_relay_config rs = serving();
    hm_node *r1 = make(&loop, "127.0.0.1:0", &rs);
    hm_node *r2 = make(&loop, "127.0.0.1:0", &rs);
    hm_relay_config rc = {0};
    via(&rc, r1);
    via(&rc, r2);
    hm_node *n = natd(&loop, "127.0.0.3:0", &rc);
    hm_node *d = make(&loop, "127.0.0.2:0", NULL);
    wait_state(&loop, n, HM_RELAY_RESERVED, 0, 5000);

    /* The first relay dies: the NAT'd peer moves to the second and is reached there. */
    closed_count = 0;
    hm_node_close(r1, on_closed, NULL);
    r1 = NULL;
    wait_state(&loop, n, HM_RELAY_RESERVED, 1, 8000);
    hm_relay_status st;
    hm_node_relay(n, &st);
    cr_assert_geq(st.failovers, 1);
    struct sockaddr_storage r2a, ann;
    addr_of(r2, &r2a);
    cr_assert_eq(hm_node_announce(n, &ann), 0);
    cr_assert(hm_addr_equal((struct sockaddr *)&ann, (struct sockaddr *)&r2a));
    struct call c;
    cr_assert_eq(call_echo(&loop, d, n, &r2a, 5000, &c), 0, "%s", hm_strerror(c.status));

    /* The second dies too: the peer says it has no relay, and declares none. */
    hm_node_close(r2, on_closed, NULL);
    r2 = NULL;
    wait_state(&loop, n, HM_RELAY_NONE, -1, 8000);
    hm_node_relay(n, &st);
    cr_assert(strstr(st.reason, "no relay: all 2 RelayVia relays failed") != NULL, "%s", st.reason);
    cr_assert_str_eq(st.address, "");
    /* What it declares now is its own (reach.h), no relay's. */
    cr_assert(hm_node_announce(n, &ann) != 0 ||
              !hm_addr_equal((struct sockaddr *)&ann, (struct sockaddr *)&r2a));
    /* It keeps trying (the back-off), and says so again. */
    wait_state(&loop, n, HM_RELAY_RESERVING, -1, 3000);
    wait_state(&loop, n, HM_RELAY_NONE, -1, 8000);

    hm_node *all[] = {d, n};
    close_all(&loop, all, 2);
}

Test(relay, parsers)
{
    uint8_t tok[HM_RELAY_TOKEN_BYTES], out[HM_RELAY_TOKEN_BYTES], pre[HM_TRANSPORT_RELAY_PREAMBLE];
    for (size_t i = 0; i < sizeof(tok); i++)
        tok[i] = (uint8_t)i;
    hm_relay_make_preamble(tok, pre);
    cr_assert_eq(hm_relay_parse_preamble(pre, sizeof(pre), out), 0);
    cr_assert_arr_eq(out, tok, sizeof(tok));
    cr_assert_eq(hm_relay_parse_preamble(pre, sizeof(pre) - 1, out), -EPROTO);
    pre[4] = 2;
    cr_assert_eq(hm_relay_parse_preamble(pre, sizeof(pre), out), -EPROTO);

    /* relay.connect: the token, and the dialler's address when the relay names it. */
    uint8_t buf[64 + HM_ADDRSTRLEN];
    hm_wire_wr w;
    struct sockaddr_storage from, back;
    cr_assert_eq(hm_parse_hostport("192.0.2.7:4242", &from), 0);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_relay_write_connect(&w, tok, &from);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    cr_assert_eq(hm_relay_parse_connect(w.buf, w.len, out, &back), 0);
    cr_assert_arr_eq(out, tok, sizeof(tok));
    cr_assert(hm_addr_equal((struct sockaddr *)&from, (struct sockaddr *)&back));
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_relay_write_connect(&w, tok, NULL);
    cr_assert_eq(hm_relay_parse_connect(w.buf, w.len, out, &back), 0);
    cr_assert_eq(back.ss_family, AF_UNSPEC);
    /* A "from" that is no address is refused, not taken for none. */
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_map(&w, 2);
    hm_wire_wr_cstr(&w, "token");
    hm_wire_wr_bin(&w, tok, sizeof(tok));
    hm_wire_wr_cstr(&w, "from");
    hm_wire_wr_cstr(&w, "nowhere");
    cr_assert_eq(hm_relay_parse_connect(w.buf, w.len, out, &back), -EPROTO);

    hm_relay_via v[HM_RELAY_MAX_VIA];
    size_t n = 0;
    char err[200];
    hm_identity id;
    cr_assert_eq(hm_identity_generate(&id), 0);
    char s[1024];
    snprintf(s, sizeof(s), "%s@127.0.0.1:5000,%s@[::1]:6000", id.peer_id, id.peer_id);
    cr_assert_eq(hm_relay_parse_via(s, v, &n, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(n, 2);
    cr_assert_eq(hm_relay_parse_via("nonsense", v, &n, err, sizeof(err)), -EINVAL);
    snprintf(s, sizeof(s), "%s@127.0.0.1:5000,,", id.peer_id);
    cr_assert_eq(hm_relay_parse_via(s, v, &n, err, sizeof(err)), -EINVAL);
    s[0] = '\0';
    for (int i = 0; i < HM_RELAY_MAX_VIA + 1; i++) {
        char one[128];
        snprintf(one, sizeof(one), "%s%s@127.0.0.1:%d", i ? "," : "", id.peer_id, 5000 + i);
        strcat(s, one);
    }
    cr_assert_eq(hm_relay_parse_via(s, v, &n, err, sizeof(err)), -EINVAL);
    hm_identity_wipe(&id);
}

/* ---- state through a relay ---- */

struct load_result {
    int done, status;
    uint8_t *blob;
    size_t len;
    char donor_addr[HM_ADDRSTRLEN];
    size_t n_donors;
};

static void on_load(void *ud, int status, uint8_t *blob, size_t len, const hm_state_report *rep)
{
    struct load_result *l = ud;
    l->done = 1;
    l->status = status;
    l->blob = blob;
    l->len = len;
    l->n_donors = rep->n_donors;
    if (rep->n_donors > 0)
        hm_strlcpy(l->donor_addr, rep->donors[0].addr, sizeof(l->donor_addr));
}

static int load_done(void *ud) { return ((struct load_result *)ud)->done; }

struct share_ready {
    hm_state *st;
};

static int shared(void *ud)
{
    hm_state_share_info info;
    struct share_ready *s = ud;
    return hm_state_share_info_get(s->st, "relay.state", &info) == 0 && info.ready &&
           info.declared > 0;
}

static int st_closed;
static void on_st_closed(void *ud)
{
    HM_UNUSED(ud);
    st_closed++;
}
static int both_st_closed(void *ud)
{
    HM_UNUSED(ud);
    return st_closed == 2;
}

Test(relay, state_served_through_a_relay)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_log_set_level(HM_LOG_WARN);
    hm_relay_config rs = serving();
    hm_node *r = make(&loop, "127.0.0.1:0", &rs);
    char boot[256];
    cr_assert_eq(hm_node_address(r, boot, sizeof(boot)), 0);
    hm_relay_config rc = {0};
    via(&rc, r);
    rc.refresh_ms = 300;
    /*
     * No pings for a long while on the donor and the newcomer: a ping over
     * a stream would connect them directly, and the load would not need the
     * relay.
     */
    hm_node *n = make_full(&loop, "127.0.0.3:0", &rc, boot, 600000);
    hm_node_relay_set_active(n, 1);
    hm_node *l = make_full(&loop, "127.0.0.2:0", NULL, boot, 600000);
    wait_state(&loop, n, HM_RELAY_RESERVED, 0, 5000);

    hm_state_config sc = {0};
    hm_state *sn = NULL, *sl = NULL;
    cr_assert_eq(hm_state_new(n, &sc, &sn), 0);
    cr_assert_eq(hm_state_new(l, &sc, &sl), 0);
    size_t len = 3u * 1024 * 1024 + 17;
    uint8_t *blob = malloc(len);
    cr_assert_not_null(blob);
    for (size_t i = 0; i < len; i++)
        blob[i] = (uint8_t)(i * 131 + (i >> 9));
    cr_assert_eq(hm_state_share(sn, "relay.state", 7, blob, len, NULL), 0);
    struct share_ready sr = {sn};
    cr_assert(hm_test_run_until(&loop, shared, &sr, 15000), "the state was never declared");

    hm_relay_status before;
    hm_node_relay(r, &before);
    struct load_result lr = {0};
    hm_state_load_opts lo = {.min_agree = 1, .timeout_ms = 30000};
    cr_assert_eq(hm_state_load(sl, "relay.state", &lo, on_load, &lr), 0);
    cr_assert(hm_test_run_until(&loop, load_done, &lr, 40000), "the load never finished");
    cr_assert_eq(lr.status, 0, "load: %s", hm_strerror(lr.status));
    cr_assert_eq(lr.len, len);
    cr_assert(memcmp(lr.blob, blob, len) == 0, "the loaded state differs");
    /* The donor was read at the relay's address, and the relay carried the state. */
    struct sockaddr_storage ra;
    char a[HM_ADDRSTRLEN];
    addr_of(r, &ra);
    hm_format_addr((struct sockaddr *)&ra, a, sizeof(a));
    cr_assert_eq(lr.n_donors, 1);
    cr_assert_str_eq(lr.donor_addr, a);
    hm_relay_status after;
    hm_node_relay(r, &after);
    cr_assert_geq(after.bytes_relayed - before.bytes_relayed, len, "%llu bytes relayed",
                  (unsigned long long)(after.bytes_relayed - before.bytes_relayed));
    free(lr.blob);
    free(blob);

    st_closed = 0;
    hm_state_close(sn, on_st_closed, NULL);
    hm_state_close(sl, on_st_closed, NULL);
    cr_assert(hm_test_run_until(&loop, both_st_closed, NULL, 5000));
    hm_node *all[] = {l, n, r};
    close_all(&loop, all, 3);
}

/* ---- relays advertised in the DHT ---- */

Test(relay, found_in_the_dht_without_relay_via)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_relay_config rs = serving();
    hm_node *r = make(&loop, "127.0.0.1:0", &rs);
    char boot[256];
    cr_assert_eq(hm_node_address(r, boot, sizeof(boot)), 0);
    hm_node *other = make_full(&loop, "127.0.0.4:0", NULL, boot, 1000);
    /* No RelayVia: the NAT'd node says it has none, then finds r's advertisement. */
    hm_relay_config rc = {0};
    rc.refresh_ms = 300;
    hm_node *n = make_full(&loop, "127.0.0.3:0", &rc, boot, 1000);
    hm_node_relay_set_active(n, 1);
    hm_relay_status st;
    hm_node_relay(n, &st);
    cr_assert_str_eq(st.state_name, "none");
    cr_assert(strstr(st.reason, "no relay: RelayVia names none") != NULL, "%s", st.reason);
    wait_state(&loop, n, HM_RELAY_RESERVED, 0, 30000);
    hm_node_relay(n, &st);
    struct sockaddr_storage ra;
    char a[HM_ADDRSTRLEN], want[HM_RELAY_ADDR_LEN];
    addr_of(r, &ra);
    hm_format_addr((struct sockaddr *)&ra, a, sizeof(a));
    snprintf(want, sizeof(want), "%s@%s", hm_node_identity(r)->peer_id, a);
    cr_assert_str_eq(st.relay, want);
    /* Reached through it, by a dialler outside the swarm (so with no stream of its own to n). */
    cr_assert_eq(hm_rpc_register(hm_node_rpc(n), "test.echo", on_echo, NULL), 0);
    hm_node *d = make(&loop, "127.0.0.2:0", NULL);
    struct call c;
    cr_assert_eq(call_echo(&loop, d, n, &ra, 1000, &c), 0, "%s", hm_strerror(c.status));
    hm_relay_status rst;
    hm_node_relay(r, &rst);
    cr_assert_eq(rst.circuits_total, 1);
    /* A relay found in the DHT is anybody's: its word on the dialler is not
     * taken, and the circuit is charged to the relay's own address. */
    char h[HM_ADDRSTRLEN];
    cr_assert_str_eq(echo_from_host(h, sizeof(h)), "127.0.0.1", "the call came from %s", h);
    hm_node_relay(n, &st);
    cr_assert_eq(st.dialler_not_taken, 1);
    hm_node *all[] = {d, other, n, r};
    close_all(&loop, all, 4);
}

/* -- relay failover -- */
static int addr_changes;
static void on_addr_change(void *ud)
{
    HM_UNUSED(ud);
    addr_changes++;
}

/*
 * With a refresh a minute apart, only the closed connection can make the
 * NAT'd peer leave a relay that stopped: it moves to the second within 3 s
 * and its address watchers hear of it, once per move (a refresh at the
 * same relay is no move). Without that watch it would stay a minute on a
 * dead relay.
 */
Test(relay, a_closed_relay_is_left_at_once_and_watchers_hear)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    hm_relay_config rs = serving();
    hm_node *r1 = make(&loop, "127.0.0.1:0", &rs);
    hm_node *r2 = make(&loop, "127.0.0.1:0", &rs);
    hm_relay_config rc = {.refresh_ms = 60000};
    via(&rc, r1);
    via(&rc, r2);
    hm_node *n = natd(&loop, "127.0.0.3:0", &rc);
    addr_changes = 0;
    cr_assert_eq(hm_node_watch_address(n, on_addr_change, NULL), 0);
    wait_state(&loop, n, HM_RELAY_RESERVED, 0, 5000);
    int first = addr_changes;
    /* A first reservation counts only if the watch came in time; either way, at most one. */
    cr_assert_leq(first, 1);

    uint64_t t0 = hm_now_ms();
    hm_node_close(r1, on_closed, NULL);
    r1 = NULL;
    wait_state(&loop, n, HM_RELAY_RESERVED, 1, 3000);
    cr_assert_lt(hm_now_ms() - t0, 3000);
    cr_assert_eq(addr_changes, first + 1, "one move, one change (%d)", addr_changes - first);
    struct sockaddr_storage r2a, ann;
    addr_of(r2, &r2a);
    cr_assert_eq(hm_node_announce(n, &ann), 0);
    cr_assert(hm_addr_equal((struct sockaddr *)&ann, (struct sockaddr *)&r2a));
    hm_node_unwatch_address(n, on_addr_change, NULL);

    hm_node *all[] = {r2, n};
    close_all(&loop, all, 2);
}

/*
 * Tests for state sharing: real nodes on 127.0.0.1 in one process and one
 * loop, bootstrapped to each other so that their DHT works. Donors share
 * a multi-megabyte blob; a newcomer downloads it from all of them at once
 * and must end with exactly the donors' bytes, also when one donor serves
 * corrupted chunks, when a hostile peer (raw rpc handlers under a real
 * declaration) serves a manifest or chunks that do not verify, when a
 * donor dies in the middle of the download, and when donors disagree on
 * the state. It also checks the clear failures (-ENOENT, -EPROTO,
 * -ETIMEDOUT, -EMSGSIZE, -ECANCELED) and the wire forms.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "tests/loop.h"
#include "src/node/node.h"
#include "dht/record.h"
#include "averaging/state.h"
#include "src/base/util.h"

#define MAX_NODES 6
#define BLOB_BYTES (6u * 1024 * 1024 + 12345)
#define CHUNK (256u * 1024)

typedef struct swarm {
    uv_loop_t loop;
    hm_node *nodes[MAX_NODES];
    hm_state *st[MAX_NODES];
    size_t n;
    hm_rpc_req *held; /* a request a hostile handler keeps unanswered */
} swarm;

typedef struct result {
    int calls, status;
    uint8_t *blob;
    size_t len;
    hm_state_report rep;
    uint64_t start_ms, done_ms;
} result;

static int dht_ready(void *ud)
{
    swarm *sw = ud;
    size_t need = HM_MIN(sw->n - 1, (size_t)4);
    for (size_t i = 0; i < sw->n; i++)
        if (sw->nodes[i] != NULL &&
            hm_rt_size(hm_dht_routing(hm_node_dht(sw->nodes[i]))) < need)
            return 0;
    return 1;
}

/* Every node has verified every other node at its address (they answered its pings). */
static int peers_verified(void *ud)
{
    swarm *sw = ud;
    hm_peer_info peers[16];
    for (size_t i = 0; i < sw->n; i++) {
        size_t ok = 0, n;
        if (sw->nodes[i] == NULL)
            continue;
        n = HM_MIN(hm_node_peers(sw->nodes[i], peers, 16), (size_t)16);
        for (size_t k = 0; k < n; k++)
            ok += peers[k].verified != 0;
        if (ok < sw->n - 1)
            return 0;
    }
    return 1;
}

/*
 * Every node here listens on 127.0.0.1, a single origin, and agreement
 * counts one donor per origin by default: these swarms count each donor,
 * as separate hosts would (the origin rule has tests of its own below).
 */
static const hm_state_config one_host = {.donors_per_origin = HM_STATE_MAX_DONORS};

/* n nodes bootstrapped from the first; nodes in [0, with_state) get a state module. */
static void swarm_start(swarm *sw, size_t n, size_t with_state)
{
    char addr[256];
    memset(sw, 0, sizeof(*sw));
    hm_log_set_level(getenv("HM_TEST_DEBUG") != NULL ? HM_LOG_DEBUG : HM_LOG_ERROR);
    cr_assert_eq(uv_loop_init(&sw->loop), 0);
    sw->n = n;
    for (size_t i = 0; i < n; i++) {
        sw->nodes[i] = hm_test_make_node(&sw->loop, "state-test", i == 0 ? NULL : addr);
        if (i == 0)
            cr_assert_eq(hm_node_address(sw->nodes[0], addr, sizeof(addr)), 0);
        if (i < with_state)
            cr_assert_eq(hm_state_new(sw->nodes[i], &one_host, &sw->st[i]), 0);
    }
    cr_assert(hm_test_run_until(&sw->loop, dht_ready, sw, 10000), "the DHT did not come up");
    /* Donors vote where a node verified them (state.h, "Who is believed"),
     * so the swarm is up once every node's pings have reached the others. */
    cr_assert(hm_test_run_until(&sw->loop, peers_verified, sw, 10000),
              "the nodes did not verify each other");
}

static void kill_node(swarm *sw, size_t i)
{
    if (sw->st[i] != NULL)
        hm_state_close(sw->st[i], NULL, NULL);
    sw->st[i] = NULL;
    if (sw->nodes[i] != NULL)
        hm_node_close(sw->nodes[i], NULL, NULL);
    sw->nodes[i] = NULL;
}

static void swarm_stop(swarm *sw)
{
    if (sw->held != NULL)
        hm_rpc_respond(sw->held, -ECANCELED, NULL, 0);
    for (size_t i = 0; i < sw->n; i++)
        kill_node(sw, i);
    uv_run(&sw->loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&sw->loop), 0, "handles left open after close");
}

static uint8_t *make_blob(size_t n, uint64_t seed)
{
    uint8_t *b = malloc(n);
    cr_assert_not_null(b);
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b[i] = (uint8_t)x;
    }
    return b;
}

typedef struct declared_pred {
    swarm *sw;
    const char *prefix;
    size_t from, to;
    uint64_t step;
} declared_pred;

static int all_declared(void *ud)
{
    declared_pred *p = ud;
    for (size_t i = p->from; i < p->to; i++) {
        hm_state_share_info info;
        if (hm_state_share_info_get(p->sw->st[i], p->prefix, &info) < 0 || !info.ready ||
            info.declared == 0 || info.step != p->step)
            return 0;
    }
    return 1;
}

static void share_on(swarm *sw, size_t from, size_t to, const char *prefix, uint64_t step,
                     const uint8_t *blob, size_t len, const hm_state_share_opts *o)
{
    for (size_t i = from; i < to; i++)
        cr_assert_eq(hm_state_share(sw->st[i], prefix, step, blob, len, o), 0);
    declared_pred p = {sw, prefix, from, to, step};
    cr_assert(hm_test_run_until(&sw->loop, all_declared, &p, 15000), "declarations not stored");
}

static void on_load(void *ud, int status, uint8_t *blob, size_t len, const hm_state_report *rep)
{
    result *r = ud;
    r->calls++;
    r->status = status;
    r->blob = blob;
    r->len = len;
    r->rep = *rep;
    r->done_ms = hm_now_ms();
    if (status != 0)
        cr_assert_null(blob);
}

static int load_done(void *ud) { return ((result *)ud)->calls > 0; }

static void load(swarm *sw, size_t who, const char *prefix, const hm_state_load_opts *o,
                 result *r, uint64_t wait_ms)
{
    memset(r, 0, sizeof(*r));
    r->start_ms = hm_now_ms();
    cr_assert_eq(hm_state_load(sw->st[who], prefix, o, on_load, r), 0);
    cr_assert_eq(r->calls, 0, "the callback fired from inside hm_state_load");
    cr_assert(hm_test_run_until(&sw->loop, load_done, r, wait_ms), "the load did not end");
    cr_assert_eq(r->calls, 1);
}

static const hm_state_donor_report *donor_of(const result *r, hm_node *n)
{
    char id[HM_PEER_ID_LEN + 1];
    hm_peer_id_encode(hm_node_identity(n)->pk, id);
    for (size_t i = 0; i < r->rep.n_donors; i++)
        if (strcmp(r->rep.donors[i].peer_id, id) == 0)
            return &r->rep.donors[i];
    return NULL;
}

/* ---------------------------------------------------------------- downloads */

Test(state, three_donors_newcomer_loads_exactly)
{
    swarm sw;
    swarm_start(&sw, 4, 4);
    uint8_t *blob = make_blob(BLOB_BYTES, 1);
    hm_state_share_opts so = {.chunk_size = CHUNK};
    share_on(&sw, 0, 3, "run1", 7, blob, BLOB_BYTES, &so);
    /* The donors hashed the same bytes alike. */
    hm_state_share_info i0, i2;
    cr_assert_eq(hm_state_share_info_get(sw.st[0], "run1", &i0), 0);
    cr_assert_eq(hm_state_share_info_get(sw.st[2], "run1", &i2), 0);
    cr_assert_eq(memcmp(i0.hash, i2.hash, HM_STATE_HASH_BYTES), 0);
    cr_assert_eq(i0.n_chunks, (BLOB_BYTES + CHUNK - 1) / CHUNK);

    result r;
    hm_state_load_opts o = {.timeout_ms = 20000};
    load(&sw, 3, "run1", &o, &r, 25000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.len, BLOB_BYTES);
    cr_assert_eq(memcmp(r.blob, blob, BLOB_BYTES), 0);
    cr_assert_eq(r.rep.step, 7u);
    cr_assert_eq(r.rep.bytes, BLOB_BYTES);
    cr_assert_eq(memcmp(r.rep.hash, i0.hash, HM_STATE_HASH_BYTES), 0);
    cr_assert_eq(r.rep.n_donors, 3u);
    cr_assert_eq(r.rep.n_declared, 3u);
    uint64_t chunks = 0;
    for (size_t i = 0; i < 3; i++) {
        const hm_state_donor_report *d = donor_of(&r, sw.nodes[i]);
        cr_assert_not_null(d, "donor %zu missing from the report", i);
        cr_assert_eq(d->dropped, HM_STATE_DROP_NONE);
        /* Parallel: every donor served part of it. */
        cr_assert_gt(d->chunks, 0u, "donor %zu served nothing", i);
        chunks += d->chunks;
    }
    cr_assert_eq(chunks, i0.n_chunks);
    free(r.blob);
    free(blob);
    swarm_stop(&sw);
}

Test(state, corrupting_donor_is_dropped_and_blob_still_right)
{
    swarm sw;
    swarm_start(&sw, 4, 4);
    uint8_t *blob = make_blob(BLOB_BYTES, 2);
    hm_state_share_opts so = {.chunk_size = CHUNK};
    share_on(&sw, 0, 2, "run2", 7, blob, BLOB_BYTES, &so);
    hm_state_share_opts bad = {.chunk_size = CHUNK, .corrupt_chunks = 1};
    share_on(&sw, 2, 3, "run2", 7, blob, BLOB_BYTES, &bad);

    result r;
    hm_state_load_opts o = {.timeout_ms = 20000};
    load(&sw, 3, "run2", &o, &r, 25000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.len, BLOB_BYTES);
    cr_assert_eq(memcmp(r.blob, blob, BLOB_BYTES), 0);
    const hm_state_donor_report *d = donor_of(&r, sw.nodes[2]);
    cr_assert_not_null(d);
    cr_assert_eq(d->dropped, HM_STATE_DROP_BAD_CHUNK, "dropped: %s",
                 hm_state_drop_name(d->dropped));
    cr_assert_eq(d->chunks, 0u);
    cr_assert_gt(r.rep.chunks_refetched, 0u);
    for (size_t i = 0; i < 2; i++)
        cr_assert_eq(donor_of(&r, sw.nodes[i])->dropped, HM_STATE_DROP_NONE);
    free(r.blob);
    free(blob);
    swarm_stop(&sw);
}

/* A hostile peer's handlers: a manifest and chunks of its own invention. */
static void hostile_manifest(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                             const struct sockaddr *from, const uint8_t *body, size_t len)
{
    HM_UNUSED(ud);
    HM_UNUSED(peer_pk);
    HM_UNUSED(from);
    HM_UNUSED(body);
    HM_UNUSED(len);
    uint8_t hashes[4 * HM_STATE_HASH_BYTES];
    memset(hashes, 0xab, sizeof(hashes));
    hm_wire_wr w;
    hm_wire_wr_init_dynamic(&w, 4096);
    hm_state_encode_manifest(&w, 7, 4 * CHUNK, CHUNK, hashes, 4);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    hm_rpc_respond(req, 0, w.buf, w.len);
    hm_wire_wr_free(&w);
}

static void hostile_chunk(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                          const struct sockaddr *from, const uint8_t *body, size_t len)
{
    HM_UNUSED(ud);
    HM_UNUSED(peer_pk);
    HM_UNUSED(from);
    HM_UNUSED(body);
    HM_UNUSED(len);
    uint8_t *junk = make_blob(CHUNK, 99);
    hm_rpc_respond(req, 0, junk, CHUNK);
    free(junk);
}

static void hostile_hold(void *ud, hm_rpc_req *req, const uint8_t peer_pk[HM_PK_BYTES],
                         const struct sockaddr *from, const uint8_t *body, size_t len)
{
    HM_UNUSED(peer_pk);
    HM_UNUSED(from);
    HM_UNUSED(body);
    HM_UNUSED(len);
    swarm *sw = ud;
    if (sw->held != NULL) {
        hm_rpc_respond(req, -EBUSY, NULL, 0);
        return;
    }
    sw->held = req;
}

static void put_done(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    HM_UNUSED(info);
    int *p = ud;
    *p = status == 0 && stored > 0 ? 1 : -1;
}

static int flag_set(void *ud) { return *(int *)ud != 0; }

/* Declares node i as a donor of (step, hash, total, chunk) under prefix,
 * exactly as a real donor would, whatever it serves. */
static void declare_raw(swarm *sw, size_t i, const char *prefix, uint64_t step,
                        const uint8_t hash[HM_STATE_HASH_BYTES], uint64_t total, uint64_t chunk)
{
    char key[256], marker[HM_DHT_OWNER_MARKER_LEN + 1];
    uint8_t value[HM_STATE_SMALL_MAX];
    hm_wire_wr w;
    hm_state_decl d = {.step = step, .total_len = total, .chunk_size = chunk};
    memcpy(d.hash, hash, HM_STATE_HASH_BYTES);
    cr_assert_eq(hm_transport_local_addr(hm_rpc_transport(hm_node_rpc(sw->nodes[i])), &d.addr), 0);
    hm_wire_wr_init_fixed(&w, value, sizeof(value));
    hm_state_encode_decl(&w, &d);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    snprintf(key, sizeof(key), "%s.state", prefix);
    hm_dht_owner_marker(hm_node_identity(sw->nodes[i])->pk, marker);
    int done = 0;
    cr_assert_eq(hm_node_dht_put(sw->nodes[i], (const uint8_t *)key, strlen(key),
                                 (const uint8_t *)marker, strlen(marker), 1, value, w.len, 60.0,
                                 5000, put_done, &done),
                 0);
    cr_assert(hm_test_run_until(&sw->loop, flag_set, &done, 10000));
    cr_assert_eq(done, 1, "the hostile declaration was not stored");
}

Test(state, manifest_hash_mismatch_rejected)
{
    swarm sw;
    swarm_start(&sw, 4, 3);
    /* Node 3 declares a state it cannot back: its manifest hashes to something else. */
    hm_rpc *rpc = hm_node_rpc(sw.nodes[3]);
    cr_assert_eq(hm_rpc_register(rpc, "state.manifest", hostile_manifest, NULL), 0);
    cr_assert_eq(hm_rpc_register(rpc, "state.chunk", hostile_chunk, NULL), 0);
    uint8_t fake[HM_STATE_HASH_BYTES];
    memset(fake, 0x11, sizeof(fake));
    declare_raw(&sw, 3, "run3", 7, fake, 4 * CHUNK, CHUNK);

    result r;
    hm_state_load_opts o = {.timeout_ms = 10000, .min_agree = 1};
    load(&sw, 2, "run3", &o, &r, 15000);
    cr_assert_eq(r.status, -EPROTO, "%s", hm_strerror(r.status));
    cr_assert_eq(r.rep.n_donors, 1u);
    cr_assert_eq(r.rep.donors[0].dropped, HM_STATE_DROP_BAD_MANIFEST);
    cr_assert_eq(r.rep.bytes, 0u);
    swarm_stop(&sw);
}

Test(state, hostile_peer_under_a_true_declaration_is_dropped)
{
    swarm sw;
    swarm_start(&sw, 4, 3);
    uint8_t *blob = make_blob(BLOB_BYTES, 3);
    hm_state_share_opts so = {.chunk_size = CHUNK};
    share_on(&sw, 0, 2, "run4", 7, blob, BLOB_BYTES, &so);
    hm_state_share_info info;
    cr_assert_eq(hm_state_share_info_get(sw.st[0], "run4", &info), 0);
    /* Node 3 claims the honest donors' state and serves junk for it. */
    hm_rpc *rpc = hm_node_rpc(sw.nodes[3]);
    cr_assert_eq(hm_rpc_register(rpc, "state.manifest", hostile_manifest, NULL), 0);
    cr_assert_eq(hm_rpc_register(rpc, "state.chunk", hostile_chunk, NULL), 0);
    declare_raw(&sw, 3, "run4", 7, info.hash, BLOB_BYTES, CHUNK);

    result r;
    hm_state_load_opts o = {.timeout_ms = 20000};
    load(&sw, 2, "run4", &o, &r, 25000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.len, BLOB_BYTES);
    cr_assert_eq(memcmp(r.blob, blob, BLOB_BYTES), 0);
    cr_assert_eq(r.rep.n_donors, 3u);
    const hm_state_donor_report *d = donor_of(&r, sw.nodes[3]);
    cr_assert_not_null(d);
    /* Asked for the manifest or for chunks, it is found out either way. */
    cr_assert(d->dropped == HM_STATE_DROP_BAD_CHUNK || d->dropped == HM_STATE_DROP_BAD_MANIFEST,
              "dropped: %s", hm_state_drop_name(d->dropped));
    cr_assert_eq(d->chunks, 0u);
    free(r.blob);
    free(blob);
    swarm_stop(&sw);
}

typedef struct served_pred {
    swarm *sw;
    size_t i;
    uint64_t at_least;
    result *r;
} served_pred;

static int served_some(void *ud)
{
    served_pred *p = ud;
    hm_state_share_info info;
    if (p->r->calls > 0)
        return 1;
    return hm_state_share_info_get(p->sw->st[p->i], "run5", &info) == 0 &&
           info.chunks_served >= p->at_least;
}

Test(state, donor_dies_mid_download)
{
    swarm sw;
    swarm_start(&sw, 4, 4);
    const size_t len = 4u * 1024 * 1024, chunk = 32u * 1024;
    uint8_t *blob = make_blob(len, 5);
    hm_state_share_opts so = {.chunk_size = chunk};
    share_on(&sw, 0, 3, "run5", 11, blob, len, &so);
    /* Slow every donor down so that the download lasts long enough to lose one. */
    hm_transport_faults f = {.delay_ms = 30};
    for (size_t i = 0; i < 3; i++)
        hm_transport_set_faults(hm_rpc_transport(hm_node_rpc(sw.nodes[i])), &f);

    result r;
    memset(&r, 0, sizeof(r));
    hm_state_load_opts o = {.timeout_ms = 25000, .request_timeout_ms = 3000, .window = 2};
    cr_assert_eq(hm_state_load(sw.st[3], "run5", &o, on_load, &r), 0);
    served_pred p = {&sw, 0, 4, &r};
    cr_assert(hm_test_run_until(&sw.loop, served_some, &p, 15000));
    cr_assert_eq(r.calls, 0, "the download ended before the donor could die");
    kill_node(&sw, 0);
    cr_assert(hm_test_run_until(&sw.loop, load_done, &r, 28000), "the load did not end");
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.len, len);
    cr_assert_eq(memcmp(r.blob, blob, len), 0);
    cr_assert_eq(r.rep.n_donors, 3u);
    /* The dead donor served part; the others finished it. */
    uint64_t total = 0, dead_chunks = UINT64_MAX;
    for (size_t i = 0; i < 3; i++) {
        const hm_state_donor_report *d = &r.rep.donors[i];
        total += d->chunks;
        if (d->last_error != 0 && d->dropped != HM_STATE_DROP_BAD_CHUNK)
            dead_chunks = d->chunks;
    }
    cr_assert_eq(total, len / chunk);
    cr_assert_neq(dead_chunks, UINT64_MAX, "no donor saw a failure");
    cr_assert_lt(dead_chunks, len / chunk);
    free(r.blob);
    free(blob);
    swarm_stop(&sw);
}

/* ---------------------------------------------------------------- agreement */

Test(state, newest_agreed_step_wins)
{
    swarm sw;
    swarm_start(&sw, 4, 4);
    uint8_t *a = make_blob(64 * 1024, 6), *b = make_blob(80 * 1024, 7);
    hm_state_share_opts so = {.chunk_size = 16 * 1024};
    share_on(&sw, 0, 2, "run6", 7, a, 64 * 1024, &so);
    /* A newer step that only one donor holds is not trusted by default. */
    share_on(&sw, 2, 3, "run6", 9, b, 80 * 1024, &so);

    result r;
    hm_state_load_opts o = {.timeout_ms = 10000};
    load(&sw, 3, "run6", &o, &r, 15000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.rep.step, 7u);
    cr_assert_eq(r.rep.n_declared, 3u);
    cr_assert_eq(r.rep.n_donors, 2u);
    cr_assert_eq(r.len, 64u * 1024);
    cr_assert_eq(memcmp(r.blob, a, r.len), 0);
    free(r.blob);

    /* Allowing a single donor takes the newest step. */
    o.min_agree = 1;
    load(&sw, 3, "run6", &o, &r, 15000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.rep.step, 9u);
    cr_assert_eq(r.len, 80u * 1024);
    cr_assert_eq(memcmp(r.blob, b, r.len), 0);
    free(r.blob);

    /* Once a second donor moves to step 9, it is the agreed one. */
    share_on(&sw, 1, 2, "run6", 9, b, 80 * 1024, &so);
    o.min_agree = 0;
    load(&sw, 3, "run6", &o, &r, 15000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.rep.step, 9u);
    cr_assert_eq(r.rep.n_donors, 2u);
    cr_assert_eq(memcmp(r.blob, b, r.len), 0);
    free(r.blob);
    /* A donor never goes back to an older step. */
    cr_assert_eq(hm_state_share(sw.st[1], "run6", 8, a, 64 * 1024, &so), -ESTALE);
    free(a);
    free(b);
    swarm_stop(&sw);
}

Test(state, disagreeing_donors_give_eproto)
{
    swarm sw;
    swarm_start(&sw, 4, 4);
    hm_state_share_opts so = {.chunk_size = 16 * 1024};
    for (size_t i = 0; i < 3; i++) {
        uint8_t *x = make_blob(50 * 1024, 10 + i);
        share_on(&sw, i, i + 1, "run7", 7, x, 50 * 1024, &so);
        free(x);
    }
    result r;
    hm_state_load_opts o = {.timeout_ms = 10000, .dht_attempts = 2};
    load(&sw, 3, "run7", &o, &r, 15000);
    cr_assert_eq(r.status, -EPROTO, "%s", hm_strerror(r.status));
    cr_assert_eq(r.rep.n_declared, 3u);
    cr_assert_eq(r.rep.n_donors, 0u);
    swarm_stop(&sw);
}

/* ------------------------------------------------------- who is believed */

static uint64_t seen_origin, seen_untrusted;
static void limit_emit(void *ud, const char *kw, uint64_t v)
{
    HM_UNUSED(ud);
    if (strcmp(kw, "StateDonorsPerOrigin") == 0)
        seen_origin = v;
    else if (strcmp(kw, "StateTrustedDonors") == 0)
        seen_untrusted = v;
}

/*
 * Two donors on one address (127.0.0.1, one origin) agree on a newer step:
 * with the default of one donor per origin that is one vote, and a
 * newcomer asking for two finds no agreement instead of taking it.
 */
Test(state, one_origin_is_one_vote)
{
    swarm sw;
    swarm_start(&sw, 4, 3);
    cr_assert_eq(hm_state_new(sw.nodes[3], NULL, &sw.st[3]), 0); /* the default: 1 per origin */
    uint8_t *b = make_blob(40 * 1024, 21);
    hm_state_share_opts so = {.chunk_size = 16 * 1024};
    share_on(&sw, 0, 2, "orig", 999999, b, 40 * 1024, &so);
    result r;
    hm_state_load_opts o = {.timeout_ms = 10000, .dht_attempts = 1};
    load(&sw, 3, "orig", &o, &r, 15000);
    cr_assert_eq(r.status, -EPROTO, "%s", hm_strerror(r.status));
    cr_assert_eq(r.rep.n_declared, 2u);
    seen_origin = 0;
    hm_state_limits(sw.st[3], limit_emit, NULL);
    cr_assert_gt(seen_origin, 0, "the second donor of the origin was set aside");
    /* One vote is enough when one is asked for. */
    o.min_agree = 1;
    load(&sw, 3, "orig", &o, &r, 15000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.rep.step, 999999u);
    cr_assert_eq(memcmp(r.blob, b, r.len), 0);
    free(r.blob);
    free(b);
    swarm_stop(&sw);
}

static int closed_flag(void *ud) { return *(int *)ud != 0; }
static void lead_emit(void *ud, const char *kw, uint64_t v)
{
    if (strcmp(kw, "StateMaxStepLead") == 0)
        *(uint64_t *)ud = v;
}
static void set_flag(void *ud) { *(int *)ud = 1; }

/* With trusted donors, only they are read, and one suffices. */
Test(state, trusted_donors_alone_are_used)
{
    swarm sw;
    swarm_start(&sw, 4, 3);
    const uint8_t(*none)[HM_PK_BYTES] = NULL;
    hm_state_config bad = {.n_trusted = 1, .trusted = none};
    cr_assert_eq(hm_state_new(sw.nodes[3], &bad, &sw.st[3]), -EINVAL);
    uint8_t trusted[1][HM_PK_BYTES];
    memcpy(trusted[0], hm_node_identity(sw.nodes[0])->pk, HM_PK_BYTES);
    hm_state_config cfg = {.n_trusted = 1, .trusted = (const uint8_t(*)[HM_PK_BYTES])trusted};
    cr_assert_eq(hm_state_new(sw.nodes[3], &cfg, &sw.st[3]), 0);
    memset(trusted, 0, sizeof(trusted)); /* copied */
    uint8_t *a = make_blob(30 * 1024, 22), *b = make_blob(50 * 1024, 23);
    hm_state_share_opts so = {.chunk_size = 16 * 1024};
    share_on(&sw, 0, 1, "trust", 7, a, 30 * 1024, &so);
    share_on(&sw, 1, 3, "trust", 9, b, 50 * 1024, &so);
    result r;
    hm_state_load_opts o = {.timeout_ms = 10000}; /* min_agree 2, which the list replaces */
    load(&sw, 3, "trust", &o, &r, 15000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.rep.step, 7u);
    cr_assert_eq(r.rep.n_donors, 1u);
    cr_assert_not_null(donor_of(&r, sw.nodes[0]));
    cr_assert_eq(r.len, 30u * 1024);
    cr_assert_eq(memcmp(r.blob, a, r.len), 0);
    free(r.blob);
    seen_untrusted = 0;
    hm_state_limits(sw.st[3], limit_emit, NULL);
    cr_assert_geq(seen_untrusted, 2, "the two untrusted declarations were set aside");
    /* The state module closes cleanly with its list. */
    int closed = 0;
    hm_state_close(sw.st[3], set_flag, &closed);
    sw.st[3] = NULL;
    cr_assert(hm_test_run_until(&sw.loop, closed_flag, &closed, 5000));
    free(a);
    free(b);
    swarm_stop(&sw);
}

/*
 * Three donors at step 100 and two at step 999999: the newest agreed step
 * wins, unless max_step_lead bounds how far ahead of the state most donors
 * vouch for it may be.
 */
Test(state, a_step_far_ahead_of_the_majority_is_not_taken)
{
    swarm sw;
    swarm_start(&sw, 6, 6);
    uint8_t *a = make_blob(30 * 1024, 31), *b = make_blob(30 * 1024, 32);
    hm_state_share_opts so = {.chunk_size = 16 * 1024};
    share_on(&sw, 0, 3, "lead", 100, a, 30 * 1024, &so);
    share_on(&sw, 3, 5, "lead", 999999, b, 30 * 1024, &so);
    result r;
    hm_state_load_opts o = {.timeout_ms = 10000};
    load(&sw, 5, "lead", &o, &r, 15000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.rep.step, 999999u, "without the bound the newest agreed step wins");
    free(r.blob);
    int closed = 0;
    hm_state_close(sw.st[5], set_flag, &closed);
    sw.st[5] = NULL;
    cr_assert(hm_test_run_until(&sw.loop, closed_flag, &closed, 5000));
    hm_state_config cfg = one_host;
    cfg.max_step_lead = 1000;
    cr_assert_eq(hm_state_new(sw.nodes[5], &cfg, &sw.st[5]), 0);
    load(&sw, 5, "lead", &o, &r, 15000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.rep.step, 100u);
    cr_assert_eq(r.rep.n_donors, 3u);
    cr_assert_eq(memcmp(r.blob, a, r.len), 0);
    free(r.blob);
    static uint64_t lead;
    lead = 0;
    hm_state_limits(sw.st[5], lead_emit, &lead);
    cr_assert_eq(lead, 2, "the two donors of the step far ahead were set aside");
    free(a);
    free(b);
    swarm_stop(&sw);
}

/*
 * A donor the newcomer has never seen votes only once it answers under its
 * key at the address it declares: here one that declared step 999999 and
 * then went away, next to a live one, does not make the two agree; the two
 * honest donors at step 7 win.
 */
Test(state, an_unseen_donor_votes_only_once_it_answers)
{
    swarm sw;
    char addr[256];
    swarm_start(&sw, 5, 4);
    uint8_t *a = make_blob(30 * 1024, 41), *b = make_blob(30 * 1024, 42);
    hm_state_share_opts so = {.chunk_size = 16 * 1024};
    share_on(&sw, 0, 1, "unseen", 7, a, 30 * 1024, &so);
    share_on(&sw, 2, 3, "unseen", 7, a, 30 * 1024, &so);
    share_on(&sw, 1, 2, "unseen", 999999, b, 30 * 1024, &so);
    share_on(&sw, 3, 4, "unseen", 999999, b, 30 * 1024, &so);
    /* Donor 3 leaves; its declaration stays in the DHT. */
    kill_node(&sw, 3);
    /* The newcomer joins afterwards: donor 3 is in no table of its. */
    cr_assert_eq(hm_node_address(sw.nodes[0], addr, sizeof(addr)), 0);
    sw.nodes[5] = hm_test_make_node(&sw.loop, "state-test", addr);
    sw.n = 6;
    cr_assert_eq(hm_state_new(sw.nodes[5], &one_host, &sw.st[5]), 0);
    cr_assert(hm_test_run_until(&sw.loop, dht_ready, &sw, 10000));
    result r;
    hm_state_load_opts o = {.timeout_ms = 10000};
    load(&sw, 5, "unseen", &o, &r, 15000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.rep.step, 7u, "the departed donor's vote was counted");
    cr_assert_eq(r.rep.n_donors, 2u);
    cr_assert_eq(memcmp(r.blob, a, r.len), 0);
    free(r.blob);
    free(a);
    free(b);
    swarm_stop(&sw);
}

/* ---------------------------------------------------------------- failures */

Test(state, no_donors_enoent_within_timeout)
{
    swarm sw;
    swarm_start(&sw, 3, 3);
    result r;
    hm_state_load_opts o = {.timeout_ms = 8000};
    load(&sw, 2, "nobody", &o, &r, 12000);
    cr_assert_eq(r.status, -ENOENT, "%s", hm_strerror(r.status));
    cr_assert_lt(r.done_ms - r.start_ms, 8000 + 2000u);
    cr_assert_eq(r.rep.n_declared, 0u);
    swarm_stop(&sw);
}

Test(state, silent_donor_times_out)
{
    swarm sw;
    swarm_start(&sw, 3, 2);
    /* Node 2 declares and then never answers the manifest request. */
    cr_assert_eq(hm_rpc_register(hm_node_rpc(sw.nodes[2]), "state.manifest", hostile_hold, &sw),
                 0);
    uint8_t h[HM_STATE_HASH_BYTES];
    memset(h, 0x22, sizeof(h));
    declare_raw(&sw, 2, "run8", 3, h, 10000, 4096);
    result r;
    hm_state_load_opts o = {.timeout_ms = 2000, .request_timeout_ms = 10000, .min_agree = 1};
    load(&sw, 1, "run8", &o, &r, 8000);
    cr_assert_eq(r.status, -ETIMEDOUT, "%s", hm_strerror(r.status));
    cr_assert_geq(r.done_ms - r.start_ms, 1900u);
    cr_assert_lt(r.done_ms - r.start_ms, 2000 + 3000u);
    cr_assert_not_null(sw.held);
    swarm_stop(&sw);
}

Test(state, destination_buffer_and_its_size)
{
    swarm sw;
    swarm_start(&sw, 3, 3);
    uint8_t *blob = make_blob(100000, 8);
    hm_state_share_opts so = {.chunk_size = 8192};
    share_on(&sw, 0, 2, "run9", 1, blob, 100000, &so);
    uint8_t *dest = calloc(1, 100000);
    cr_assert_not_null(dest);
    result r;
    hm_state_load_opts o = {.timeout_ms = 10000, .dest = dest, .dest_cap = 99999};
    load(&sw, 2, "run9", &o, &r, 15000);
    cr_assert_eq(r.status, -EMSGSIZE, "%s", hm_strerror(r.status));
    o.dest_cap = 100000;
    load(&sw, 2, "run9", &o, &r, 15000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.blob, dest);
    cr_assert_eq(memcmp(dest, blob, 100000), 0);
    free(dest);
    free(blob);
    swarm_stop(&sw);
}

static void count_closed(void *ud) { (*(int *)ud)++; }

Test(state, close_cancels_loads_and_unshare)
{
    swarm sw;
    swarm_start(&sw, 3, 3);
    uint8_t *blob = make_blob(20000, 9);
    cr_assert_eq(hm_state_share(sw.st[0], "run10", 1, blob, 20000, NULL), 0);
    cr_assert_eq(hm_state_unshare(sw.st[0], "run10"), 0);
    cr_assert_eq(hm_state_unshare(sw.st[0], "run10"), -ENOENT);
    hm_state_share_info info;
    cr_assert_eq(hm_state_share_info_get(sw.st[0], "run10", &info), -ENOENT);

    /* Bad arguments never start anything. */
    cr_assert_eq(hm_state_share(sw.st[0], "", 1, blob, 20000, NULL), -EINVAL);
    cr_assert_eq(hm_state_share(sw.st[0], "x[owner:y]", 1, blob, 20000, NULL), -EINVAL);
    cr_assert_eq(hm_state_share(sw.st[0], "x", 1, blob, 0, NULL), -EINVAL);
    hm_state_share_opts tiny = {.chunk_size = 16};
    cr_assert_eq(hm_state_share(sw.st[0], "x", 1, blob, 20000, &tiny), -EINVAL);

    result r;
    memset(&r, 0, sizeof(r));
    cr_assert_eq(hm_state_load(sw.st[2], "nothing-here", NULL, on_load, &r), 0);
    int closed = 0;
    hm_state_close(sw.st[2], count_closed, &closed);
    sw.st[2] = NULL;
    cr_assert_eq(r.calls, 1);
    cr_assert_eq(r.status, -ECANCELED);
    cr_assert_eq(closed, 0, "close's callback fired from inside the call");
    hm_test_run_until(&sw.loop, flag_set, &closed, 5000);
    cr_assert_eq(closed, 1);
    /* The methods are free again for a new module on the node. */
    cr_assert_eq(hm_state_new(sw.nodes[2], &one_host, &sw.st[2]), 0);
    free(blob);
    swarm_stop(&sw);
}

/* ---------------------------------------------------------------- wire forms */

Test(state_wire, round_trips_and_rejects)
{
    hm_wire_wr w;
    uint8_t buf[HM_STATE_SMALL_MAX];
    hm_state_decl d = {.step = 42, .total_len = 5000, .chunk_size = 1024}, d2;
    memset(d.hash, 7, sizeof(d.hash));
    cr_assert_eq(hm_parse_hostport("127.0.0.1:4567", &d.addr), 0);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_state_encode_decl(&w, &d);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    cr_assert_eq(hm_state_decode_decl(buf, w.len, &d2), 0);
    cr_assert_eq(d2.step, 42u);
    cr_assert_eq(d2.total_len, 5000u);
    cr_assert_eq(memcmp(d2.hash, d.hash, 32), 0);
    cr_assert(hm_addr_equal((struct sockaddr *)&d.addr, (struct sockaddr *)&d2.addr));
    /* Truncated, trailing bytes, a chunk size out of bounds, too many chunks. */
    cr_assert_lt(hm_state_decode_decl(buf, w.len - 1, &d2), 0);
    d.chunk_size = 100;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_state_encode_decl(&w, &d);
    cr_assert_eq(hm_state_decode_decl(buf, w.len, &d2), -EPROTO);
    d.chunk_size = 1024;
    d.total_len = (uint64_t)HM_STATE_MAX_CHUNKS * 1024 + 1;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_state_encode_decl(&w, &d);
    cr_assert_eq(hm_state_decode_decl(buf, w.len, &d2), -EPROTO);

    uint8_t hashes[3 * 32];
    memset(hashes, 3, sizeof(hashes));
    hm_state_manifest m;
    hm_wire_wr_init_dynamic(&w, 4096);
    hm_state_encode_manifest(&w, 5, 2500, 1024, hashes, 3);
    cr_assert_eq(hm_state_decode_manifest(w.buf, w.len, &m), 0);
    cr_assert_eq(m.n_chunks, 3u);
    cr_assert_eq(memcmp(m.hashes, hashes, sizeof(hashes)), 0);
    hm_wire_wr_free(&w);
    /* The hash count must be the chunking's. */
    hm_wire_wr_init_dynamic(&w, 4096);
    hm_state_encode_manifest(&w, 5, 2500, 1024, hashes, 2);
    cr_assert_eq(hm_state_decode_manifest(w.buf, w.len, &m), -EPROTO);
    hm_wire_wr_free(&w);

    hm_state_req q = {.prefix = "p.q", .index = 9}, q2;
    memset(q.hash, 1, 32);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_state_encode_req(&w, &q, 1);
    cr_assert_eq(hm_state_decode_req(buf, w.len, 1, &q2), 0);
    cr_assert_str_eq(q2.prefix, "p.q");
    cr_assert_eq(q2.index, 9u);
    cr_assert_eq(hm_state_decode_req(buf, w.len, 0, &q2), -EPROTO);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_state_encode_req(&w, &q, 0);
    cr_assert_eq(hm_state_decode_req(buf, w.len, 0, &q2), 0);
    static const uint8_t junk[] = {0xdd, 0xff, 0xff, 0xff, 0xff};
    cr_assert_lt(hm_state_decode_req(junk, sizeof(junk), 1, &q2), 0);
    cr_assert_lt(hm_state_decode_manifest(junk, sizeof(junk), &m), 0);
}

/* ---------------------------------------------------------------- donor-side bounds */

static int tick_count_until_ready;
static hm_state *tick_state;

static void on_tick_count(uv_timer_t *t)
{
    hm_state_share_info info;
    HM_UNUSED(t);
    if (hm_state_share_info_get(tick_state, "big", &info) == 0 && !info.ready)
        tick_count_until_ready++;
}

static int share_ready(void *ud)
{
    hm_state_share_info info;
    return hm_state_share_info_get(ud, "big", &info) == 0 && info.ready;
}

/*
 * Hashing a share goes a slice (16 MiB) per loop pass, and the loop runs
 * its other timers (and I/O) between slices: a 64 MiB share takes four
 * slices, between which a 1 ms timer fires.
 */
Test(state, hashing_slices_let_the_loop_run)
{
    swarm sw;
    uv_timer_t tick;
    size_t len = (size_t)64 << 20;
    swarm_start(&sw, 1, 1);
    uint8_t *blob = malloc(len);
    cr_assert_not_null(blob);
    memset(blob, 7, len);
    tick_count_until_ready = 0;
    tick_state = sw.st[0];
    cr_assert_eq(hm_state_share(sw.st[0], "big", 1, blob, len, NULL), 0);
    free(blob);
    cr_assert_eq(uv_timer_init(&sw.loop, &tick), 0);
    cr_assert_eq(uv_timer_start(&tick, on_tick_count, 1, 1), 0);
    cr_assert(hm_test_run_until(&sw.loop, share_ready, sw.st[0], 20000), "never hashed");
    uv_timer_stop(&tick);
    uv_close((uv_handle_t *)&tick, NULL);
    cr_assert_geq(tick_count_until_ready, 2,
                  "another timer ran %d times while 4 slices were hashed", tick_count_until_ready);
    swarm_stop(&sw);
}

typedef struct rawcall {
    int done, status;
} rawcall;

static void on_rawcall(void *ud, int status, const uint8_t *body, size_t len)
{
    HM_UNUSED(body);
    HM_UNUSED(len);
    rawcall *c = ud;
    c->done = 1;
    c->status = status;
}

static int rawcall_done(void *ud) { return ((rawcall *)ud)->done; }

static int node_pk_addr(hm_node *n, uint8_t pk[HM_PK_BYTES], struct sockaddr_storage *ss)
{
    char addr[256];
    cr_assert_eq(hm_node_address(n, addr, sizeof(addr)), 0);
    return hm_peer_addr_parse(addr, pk, ss);
}

/* Asks node `from` for the donor's manifest; returns the rpc status. */
static int ask_manifest(swarm *sw, size_t from, size_t donor, const char *prefix,
                        const uint8_t hash[HM_STATE_HASH_BYTES])
{
    uint8_t pk[HM_PK_BYTES], body[HM_STATE_SMALL_MAX];
    struct sockaddr_storage ss;
    hm_state_req q;
    hm_wire_wr w;
    rawcall c = {0};
    memset(&q, 0, sizeof(q));
    hm_strlcpy(q.prefix, prefix, sizeof(q.prefix));
    memcpy(q.hash, hash, HM_STATE_HASH_BYTES);
    hm_wire_wr_init_fixed(&w, body, sizeof(body));
    hm_state_encode_req(&w, &q, 0);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    cr_assert_eq(node_pk_addr(sw->nodes[donor], pk, &ss), 0);
    cr_assert_eq(hm_rpc_call(hm_node_rpc(sw->nodes[from]), pk, (const struct sockaddr *)&ss,
                             "state.manifest", body, w.len, HM_RPC_STREAM, 10000, on_rawcall, &c,
                             NULL),
                 0);
    cr_assert(hm_test_run_until(&sw->loop, rawcall_done, &c, 12000), "manifest call hung");
    return c.status;
}

static int queued_over(void *ud)
{
    hm_transport_stats ts;
    hm_transport_get_stats(hm_rpc_transport(hm_node_rpc(ud)), &ts);
    return ts.queued_bytes > ((size_t)1 << 20);
}

static int queued_under(void *ud) { return !queued_over(ud); }

/*
 * Manifest requests are held to the serving caps like chunk requests:
 * while the donor has more than max_queued_total bytes queued (here, to a
 * peer that stopped reading), a manifest request is answered -ENOBUFS.
 */
Test(state, manifest_requests_respect_the_serving_caps)
{
    swarm sw;
    hm_state_config cfg = {.max_queued_total = (size_t)1 << 20};
    hm_state_share_info info;
    swarm_start(&sw, 3, 0);
    cr_assert_eq(hm_state_new(sw.nodes[0], &cfg, &sw.st[0]), 0);
    uint8_t *blob = make_blob(100000, 3);
    hm_state_share_opts so = {.chunk_size = 8192};
    cr_assert_eq(hm_state_share(sw.st[0], "capped", 1, blob, 100000, &so), 0);
    free(blob);
    for (int i = 0; i < 200 && !(hm_state_share_info_get(sw.st[0], "capped", &info) == 0 &&
                                 info.ready);
         i++)
        uv_run(&sw.loop, UV_RUN_ONCE);
    cr_assert(info.ready);
    cr_assert_eq(ask_manifest(&sw, 1, 0, "capped", info.hash), 0);

    /* Node 2 stops reading; 16 MiB from the donor to it stay queued. */
    hm_transport_faults stall = {.stall = 1}, none = {0};
    hm_transport_set_faults(hm_rpc_transport(hm_node_rpc(sw.nodes[2])), &stall);
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage ss;
    cr_assert_eq(node_pk_addr(sw.nodes[2], pk, &ss), 0);
    size_t big_len = (size_t)16 << 20;
    uint8_t *big = calloc(1, big_len);
    cr_assert_not_null(big);
    rawcall held = {0};
    cr_assert_eq(hm_rpc_call(hm_node_rpc(sw.nodes[0]), pk, (const struct sockaddr *)&ss,
                             "nothing.here", big, big_len, HM_RPC_STREAM, 20000, on_rawcall,
                             &held, NULL),
                 0);
    free(big);
    cr_assert(hm_test_run_until(&sw.loop, queued_over, sw.nodes[0], 5000),
              "the donor has nothing queued");
    cr_assert_eq(ask_manifest(&sw, 1, 0, "capped", info.hash), -ENOBUFS);
    cr_assert_eq(hm_state_share_info_get(sw.st[0], "capped", &info), 0);
    cr_assert_geq(info.refused_busy, 1);
    cr_assert_eq(info.manifests_served, 1);

    /* Once the queue drains, manifests are served again. */
    hm_transport_set_faults(hm_rpc_transport(hm_node_rpc(sw.nodes[2])), &none);
    cr_assert(hm_test_run_until(&sw.loop, queued_under, sw.nodes[0], 15000), "never drained");
    cr_assert_eq(ask_manifest(&sw, 1, 0, "capped", info.hash), 0);
    cr_assert(hm_test_run_until(&sw.loop, rawcall_done, &held, 15000));
    swarm_stop(&sw);
}

typedef struct declared_rec {
    int calls, status;
    unsigned replicas;
    uint64_t at_ms;
} declared_rec;

static void on_declared_rec(void *ud, int status, unsigned replicas)
{
    declared_rec *d = ud;
    d->calls++;
    d->status = status;
    d->replicas = replicas;
    d->at_ms = hm_now_ms();
}

static int declared_called(void *ud) { return ((declared_rec *)ud)->calls > 0; }

static int ready_at(void *ud)
{
    declared_pred *p = ud;
    hm_state_share_info info;
    return hm_state_share_info_get(p->sw->st[p->from], p->prefix, &info) == 0 && info.ready &&
           info.step == p->step;
}

/*
 * A step that becomes ready while the declaration of the one before is
 * still being put (a replica is dead, so the put waits for it) is
 * declared when that put ends, not a refresh period (20 s) later: a
 * newcomer that asks once the donor said it was declared loads it, not
 * the older step the DHT would otherwise go on naming.
 */
Test(state, a_step_ready_during_a_put_is_declared_when_it_ends)
{
    swarm sw;
    swarm_start(&sw, 3, 2);
    kill_node(&sw, 2);
    uint8_t *a = make_blob(40000, 51), *b = make_blob(40000, 52);
    declared_rec d1 = {0}, d2 = {0}, d3 = {0};
    hm_state_share_opts so1 = {.declared_cb = on_declared_rec, .declared_ud = &d1};
    hm_state_share_opts so2 = {.declared_cb = on_declared_rec, .declared_ud = &d2};
    hm_state_share_opts so3 = {.declared_cb = on_declared_rec, .declared_ud = &d3};
    cr_assert_eq(hm_state_share(sw.st[0], "racing", 1, a, 40000, &so1), 0);
    cr_assert_eq(d1.calls, 0, "declared_cb fired inside hm_state_share");
    declared_pred p1 = {&sw, "racing", 0, 1, 1};
    cr_assert(hm_test_run_until(&sw.loop, ready_at, &p1, 5000), "step 1 never hashed");
    uint64_t t0 = hm_now_ms();
    cr_assert_eq(hm_state_share(sw.st[0], "racing", 2, b, 40000, &so2), 0);
    cr_assert(hm_test_run_until(&sw.loop, declared_called, &d2, 15000),
              "step 2 was not declared within 15 s of being shared");
    cr_assert_eq(d2.calls, 1);
    cr_assert_eq(d2.status, 0, "%s", hm_strerror(d2.status));
    cr_assert_geq(d2.replicas, 1u);
    cr_assert_eq(d1.calls, 1, "step 1's waiter was not answered");
    cr_assert_eq(d1.status, 0, "%s", hm_strerror(d1.status));
    cr_assert_leq(d1.at_ms, d2.at_ms);
    cr_log_info("step 2 declared %llu ms after it was shared",
                (unsigned long long)(d2.at_ms - t0));

    result r;
    hm_state_load_opts o = {.timeout_ms = 10000, .min_agree = 1};
    load(&sw, 1, "racing", &o, &r, 15000);
    cr_assert_eq(r.status, 0, "%s", hm_strerror(r.status));
    cr_assert_eq(r.rep.step, 2u, "the newcomer loaded step %llu",
                 (unsigned long long)r.rep.step);
    cr_assert_eq(memcmp(r.blob, b, r.len), 0);
    free(r.blob);

    /* Unsharing answers a waiter at once. */
    cr_assert_eq(hm_state_share(sw.st[0], "racing", 3, a, 40000, &so3), 0);
    cr_assert_eq(hm_state_unshare(sw.st[0], "racing"), 0);
    cr_assert_eq(d3.calls, 1);
    cr_assert_eq(d3.status, -ECANCELED);
    free(a);
    free(b);
    swarm_stop(&sw);
}

Test(state, replaced_versions_stay_served_for_two_more_shares)
{
    swarm sw;
    hm_state_share_info info;
    uint8_t first[HM_STATE_HASH_BYTES];
    swarm_start(&sw, 2, 1);
    uint8_t *blob = make_blob(50000, 11);
    share_on(&sw, 0, 1, "moving", 1, blob, 50000, NULL);
    cr_assert_eq(hm_state_share_info_get(sw.st[0], "moving", &info), 0);
    memcpy(first, info.hash, sizeof(first));
    /* A newcomer that read the declaration of step 1 may ask for it after
     * the donor moved on: the two versions before the current one stay. */
    for (uint64_t step = 2; step <= 3; step++) {
        blob[0] = (uint8_t)step;
        share_on(&sw, 0, 1, "moving", step, blob, 50000, NULL);
        cr_assert_eq(ask_manifest(&sw, 1, 0, "moving", first), 0, "step %llu",
                     (unsigned long long)step);
    }
    blob[0] = 4;
    share_on(&sw, 0, 1, "moving", 4, blob, 50000, NULL);
    cr_assert_eq(ask_manifest(&sw, 1, 0, "moving", first), -ESTALE);
    free(blob);
    swarm_stop(&sw);
}

/*
 * Tests for the expert server (moe/server.h), with in-process nodes on
 * 127.0.0.1: node A hosts "ffn.[0:2].[0:2]" (dim 16), node B calls it over
 * real rpc streams. Forward replies equal a local ffn rebuilt from the
 * server's own checkpoint; backward returns the local dL/dx and steps the
 * server's parameters exactly as one local optimizer step; concurrent
 * requests are batched and each gets its own rows back; hostile, non-finite
 * or misdirected requests get their error and the server keeps serving;
 * the queue bound answers -ENOBUFS; one origin flooding an expert's queue
 * is shed for, and does not delay, a request from another origin; the DHT declarations are found from B
 * (uid key and both prefix levels, owner-marked) and withdrawn on close; a
 * new server resumes from the state directory, from the previous file when
 * the current one is corrupt.
 */
#include "config.h"

#include "moe/server.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "moe/checkpoint.h"
#include "src/base/crypto.h"
#include "tests/helpers.h"
#include "tests/loop.h"
#include "dht/record.h"
#include "src/base/util.h"

#define DIM 16
#define PATTERN "ffn.[0:2].[0:2]"

typedef struct fx {
    uv_loop_t loop;
    hm_node *a, *b;
    hm_moe_server *srv;
    uint8_t a_pk[HM_PK_BYTES];
    struct sockaddr_storage a_addr;
    char a_hostport[HM_MOE_ADDR_MAX + 1];
    char dir[64];
} fx;

/* ---- helpers ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((double)(rng_state >> 11) / (double)(1ull << 53) * 4.0 - 2.0);
}

static void fill(float *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        v[i] = rnd();
}

static int never(void *ud)
{
    HM_UNUSED(ud);
    return 0;
}

static int dht_ready(void *ud)
{
    fx *f = ud;
    return hm_rt_size(hm_dht_routing(hm_node_dht(f->a))) >= 1 &&
           hm_rt_size(hm_dht_routing(hm_node_dht(f->b))) >= 1;
}

static void fx_start(fx *f, int with_dir)
{
    char addr[256];
    memset(f, 0, sizeof(*f));
    hm_log_set_level(getenv("HM_TEST_DEBUG") != NULL ? HM_LOG_DEBUG : HM_LOG_ERROR);
    cr_assert_eq(hm_crypto_init(), 0);
    cr_assert_eq(uv_loop_init(&f->loop), 0);
    f->a = hm_test_make_node(&f->loop, "moe-server-test", NULL);
    cr_assert_eq(hm_node_address(f->a, addr, sizeof(addr)), 0);
    cr_assert_eq(hm_peer_addr_parse(addr, f->a_pk, &f->a_addr), 0);
    hm_strlcpy(f->a_hostport, strchr(addr, '@') + 1, sizeof(f->a_hostport));
    f->b = hm_test_make_node(&f->loop, "moe-server-test", addr);
    cr_assert(hm_test_run_until(&f->loop, dht_ready, f, 10000), "the DHT did not come up");
    if (with_dir)
        cr_assert_eq(hm_test_mkdtemp(f->dir, sizeof(f->dir), "moe"), 0);
}

static int flag_set(void *ud) { return *(int *)ud; }
static void set_flag(void *ud) { *(int *)ud = 1; }

static void server_close(fx *f, int withdraw)
{
    int closed = 0;
    if (f->srv == NULL)
        return;
    hm_moe_server_close(f->srv, withdraw, set_flag, &closed);
    cr_assert(hm_test_run_until(&f->loop, flag_set, &closed, 15000), "server close hung");
    f->srv = NULL;
}

static void fx_stop(fx *f)
{
    server_close(f, 0);
    hm_node_close(f->a, NULL, NULL);
    hm_node_close(f->b, NULL, NULL);
    uv_run(&f->loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&f->loop), 0, "handles left open after close");
    hm_test_rmtree(f->dir);
}

static hm_ffn_config cfg16(void)
{
    hm_ffn_config c;
    memset(&c, 0, sizeof(c));
    c.dim = DIM;
    c.optimizer = HM_FFN_SGD;
    c.lr = 0.05;
    c.seed = 7;
    return c;
}

static void server_start(fx *f, const hm_moe_server_opts *o)
{
    hm_moe_server_opts def;
    hm_ffn_config c = cfg16();
    char err[256] = "";
    size_t added = 0;
    memset(&def, 0, sizeof(def));
    def.state_dir = f->dir[0] ? f->dir : NULL;
    cr_assert_eq(hm_moe_server_new(f->a, o ? o : &def, &f->srv), 0);
    cr_assert_eq(hm_moe_server_host(f->srv, PATTERN, "ffn", &c, &added, err, sizeof(err)), 0,
                 "%s", err);
    cr_assert_eq(added, 4);
}

/* One rpc call from B to A, with its result copied out. */
typedef struct call {
    int done, status;
    uint8_t *body;
    size_t len;
} call;

static void on_reply(void *ud, int status, const uint8_t *body, size_t len)
{
    call *c = ud;
    c->done = 1;
    c->status = status;
    /* An error's body is the server's reason (proto.h): kept too. */
    if (len > 0) {
        c->body = malloc(len);
        cr_assert_not_null(c->body);
        memcpy(c->body, body, len);
        c->len = len;
    }
}

static void call_start(fx *f, const char *method, const uint8_t *body, size_t len, call *c)
{
    memset(c, 0, sizeof(*c));
    int r = hm_rpc_call(hm_node_rpc(f->b), f->a_pk, (const struct sockaddr *)&f->a_addr, method,
                        body, len, HM_RPC_STREAM, 10000, on_reply, c, NULL);
    cr_assert_eq(r, 0, "hm_rpc_call: %s", hm_strerror(r));
}

static int call_done(void *ud) { return ((call *)ud)->done; }

static int call_sync(fx *f, const char *method, const uint8_t *body, size_t len, call *c)
{
    call_start(f, method, body, len, c);
    cr_assert(hm_test_run_until(&f->loop, call_done, c, 12000), "%s did not finish", method);
    return c->status;
}

static uint8_t *enc_fwd(const char *uid, const float *x, size_t batch, size_t dim, size_t *len)
{
    hm_wire_wr w;
    hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
    hm_moe_encode_fwd(&w, uid, x, batch, dim);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    uint8_t *b = hm_wire_wr_steal(&w, len);
    cr_assert_not_null(b);
    return b;
}

static uint8_t *enc_bwd(const char *uid, const float *x, const float *gy, size_t batch,
                        size_t dim, size_t *len)
{
    hm_wire_wr w;
    hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
    hm_moe_encode_bwd(&w, uid, x, gy, batch, dim);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    uint8_t *b = hm_wire_wr_steal(&w, len);
    cr_assert_not_null(b);
    return b;
}

/* Forward through the server: status, and y on success. */
static int remote_fwd(fx *f, const char *uid, const float *x, size_t batch, float *y)
{
    size_t len;
    call c;
    uint8_t *b = enc_fwd(uid, x, batch, DIM, &len);
    int st = call_sync(f, HM_MOE_METHOD_FWD, b, len, &c);
    free(b);
    if (st == 0)
        cr_assert_eq(hm_moe_decode_out(c.body, c.len, 0, batch, DIM, y), 0);
    free(c.body);
    return st;
}

static void ckpt_path(const fx *f, const char *uid, char *buf, size_t len)
{
    snprintf(buf, len, "%s/experts/%s.ckpt", f->dir, uid);
}

/* The expert as the server has it: checkpoint now, read the file back. */
static hm_ffn *server_copy(fx *f, const char *uid)
{
    char path[256];
    uint8_t *buf = NULL;
    size_t len = 0;
    hm_ffn *e = NULL;
    cr_assert_eq(hm_moe_server_checkpoint(f->srv), 0);
    ckpt_path(f, uid, path, sizeof(path));
    cr_assert_eq(hm_ckpt_read(path, (size_t)1 << 26, &buf, &len, NULL), 0, "%s", path);
    cr_assert_eq(hm_ffn_load(buf, len, NULL, &e), 0);
    free(buf);
    return e;
}

static hm_ffn *file_copy(fx *f, const char *uid, int *used_prev)
{
    char path[256];
    uint8_t *buf = NULL;
    size_t len = 0;
    hm_ffn *e = NULL;
    ckpt_path(f, uid, path, sizeof(path));
    cr_assert_eq(hm_ckpt_read(path, (size_t)1 << 26, &buf, &len, used_prev), 0, "%s", path);
    cr_assert_eq(hm_ffn_load(buf, len, NULL, &e), 0);
    free(buf);
    return e;
}

static void assert_close(const float *got, const float *want, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++)
        cr_assert(fabsf(got[i] - want[i]) <= 1e-6f * (1.0f + fabsf(want[i])),
                  "%s[%zu]: %.9g vs %.9g", what, i, (double)got[i], (double)want[i]);
}

static const hm_moe_hosted *find_hosted(const hm_moe_hosted *h, size_t n, const char *uid)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(h[i].uid, uid) == 0)
            return &h[i];
    cr_assert_fail("%s is not listed", uid);
    return NULL;
}

/* ---- tests ---- */

Test(moe_server, forward_matches_the_checkpointed_expert)
{
    fx f;
    fx_start(&f, 1);
    server_start(&f, NULL);

    hm_moe_hosted h[8];
    cr_assert_eq(hm_moe_server_list(f.srv, h, 8), 4);
    cr_assert_str_eq(h[0].uid, "ffn.0.0");
    cr_assert_str_eq(h[3].uid, "ffn.1.1");
    cr_assert_eq(h[0].dim, DIM);
    cr_assert_eq(h[0].hidden, 4 * DIM);
    cr_assert_str_eq(h[0].type, "ffn");
    cr_assert_eq(h[0].resumed, 0);

    enum { B = 3 };
    float x[B * DIM], y[B * DIM], want[B * DIM], y2[B * DIM];
    fill(x, B * DIM);
    hm_ffn *local = server_copy(&f, "ffn.1.0");
    cr_assert_eq(remote_fwd(&f, "ffn.1.0", x, B, y), 0);
    cr_assert_eq(hm_ffn_forward(local, x, B, want), 0);
    assert_close(y, want, B * DIM, "y");
    /* Experts differ: the seed is mixed with the uid. */
    cr_assert_eq(remote_fwd(&f, "ffn.0.1", x, B, y2), 0);
    cr_assert(memcmp(y, y2, sizeof(y)) != 0);
    hm_ffn_free(local);

    /* moe.info */
    uint8_t body[128];
    hm_wire_wr w;
    call c;
    char type[HM_MOE_TYPE_MAX + 1];
    size_t dim, hidden;
    hm_wire_wr_init_fixed(&w, body, sizeof(body));
    hm_moe_encode_info_req(&w, "ffn.1.1");
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_INFO, body, w.len, &c), 0);
    cr_assert_eq(hm_moe_decode_info(c.body, c.len, type, &dim, &hidden), 0);
    cr_assert_str_eq(type, "ffn");
    cr_assert_eq(dim, DIM);
    cr_assert_eq(hidden, 4 * DIM);
    free(c.body);
    hm_wire_wr_init_fixed(&w, body, sizeof(body));
    hm_moe_encode_info_req(&w, "ffn.2.0");
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_INFO, body, w.len, &c), -ENOENT);

    cr_assert_eq(hm_moe_server_list(f.srv, h, 8), 4);
    cr_assert_eq(find_hosted(h, 4, "ffn.1.0")->fwd_requests, 1);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.0")->fwd_requests, 0);
    cr_assert_gt(find_hosted(h, 4, "ffn.1.0")->batches, 0);
    cr_assert_neq(find_hosted(h, 4, "ffn.1.0")->last_checkpoint_unix_ms, 0);
    fx_stop(&f);
}

Test(moe_server, backward_returns_grad_and_steps_once)
{
    fx f;
    fx_start(&f, 1);
    server_start(&f, NULL);

    enum { B = 4 };
    float x[B * DIM], gy[B * DIM], gx[B * DIM], want[B * DIM];
    fill(x, B * DIM);
    fill(gy, B * DIM);
    hm_ffn *local = server_copy(&f, "ffn.0.1");
    hm_ffn *initial = file_copy(&f, "ffn.0.1", NULL);
    size_t np = hm_ffn_nparams(local);
    float *gp = malloc(np * sizeof(float));
    cr_assert_not_null(gp);
    cr_assert_eq(hm_ffn_grad(local, x, gy, B, want, gp), 0);
    cr_assert_eq(hm_ffn_apply(local, gp), 0);

    size_t len;
    call c;
    uint8_t *b = enc_bwd("ffn.0.1", x, gy, B, DIM, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_BWD, b, len, &c), 0);
    free(b);
    cr_assert_eq(hm_moe_decode_out(c.body, c.len, 1, B, DIM, gx), 0);
    free(c.body);
    assert_close(gx, want, B * DIM, "gx");

    hm_moe_hosted h[4];
    hm_moe_server_list(f.srv, h, 4);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.1")->steps, 1);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.1")->bwd_requests, 1);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.0")->steps, 0);

    hm_ffn *after = server_copy(&f, "ffn.0.1");
    cr_assert_eq(hm_ffn_steps(after), 1);
    cr_assert_eq(hm_ffn_nparams(after), np);
    assert_close(hm_ffn_params(after), hm_ffn_params(local), np, "params");
    /* And the step did change them. */
    cr_assert(memcmp(hm_ffn_params(after), hm_ffn_params(initial), np * sizeof(float)) != 0);
    hm_ffn_free(initial);
    hm_ffn_free(after);
    hm_ffn_free(local);
    free(gp);
    fx_stop(&f);
}

Test(moe_server, concurrent_requests_are_batched)
{
    fx f;
    hm_moe_server_opts o;
    fx_start(&f, 1);
    memset(&o, 0, sizeof(o));
    o.state_dir = f.dir;
    o.batch_wait_ms = 30;
    server_start(&f, &o);

    enum { N = 50, MAXB = 2 };
    static float x[N][MAXB * DIM], want[N][MAXB * DIM], y[MAXB * DIM];
    static call c[N];
    uint8_t *bodies[N];
    size_t lens[N], batch[N];
    hm_ffn *local = server_copy(&f, "ffn.1.1");
    for (int i = 0; i < N; i++) {
        batch[i] = 1 + (size_t)(i % MAXB);
        fill(x[i], batch[i] * DIM);
        cr_assert_eq(hm_ffn_forward(local, x[i], batch[i], want[i]), 0);
        bodies[i] = enc_fwd("ffn.1.1", x[i], batch[i], DIM, &lens[i]);
    }
    for (int i = 0; i < N; i++)
        call_start(&f, HM_MOE_METHOD_FWD, bodies[i], lens[i], &c[i]);
    for (int i = 0; i < N; i++) {
        cr_assert(hm_test_run_until(&f.loop, call_done, &c[i], 15000));
        cr_assert_eq(c[i].status, 0, "request %d: %s", i, hm_strerror(c[i].status));
        cr_assert_eq(hm_moe_decode_out(c[i].body, c[i].len, 0, batch[i], DIM, y), 0);
        assert_close(y, want[i], batch[i] * DIM, "y");
        free(c[i].body);
        free(bodies[i]);
    }
    hm_moe_hosted h[4];
    hm_moe_server_list(f.srv, h, 4);
    const hm_moe_hosted *e = find_hosted(h, 4, "ffn.1.1");
    cr_assert_eq(e->fwd_requests, N);
    cr_assert_gt(e->mean_batch_size, 1.0, "mean batch %.2f over %llu batches",
                 e->mean_batch_size, (unsigned long long)e->batches);
    cr_assert_lt(e->batches, (uint64_t)N);
    cr_assert_gt(e->latency_p50_ms, 0.0);
    cr_assert_geq(e->latency_p99_ms, e->latency_p50_ms);
    hm_ffn_free(local);
    fx_stop(&f);
}

Test(moe_server, bad_requests_get_errors_and_serving_goes_on)
{
    fx f;
    fx_start(&f, 0);
    server_start(&f, NULL);

    enum { B = 2 };
    float x[B * DIM], y[B * DIM];
    fill(x, B * DIM);
    call c;
    size_t len;

    /* A declared shape far larger than the bytes behind it. */
    hm_wire_wr w;
    hm_wire_wr_init_dynamic(&w, 1 << 20);
    hm_wire_wr_map(&w, 2);
    hm_wire_wr_cstr(&w, "uid");
    hm_wire_wr_cstr(&w, "ffn.0.0");
    hm_wire_wr_cstr(&w, "x");
    hm_wire_wr_array(&w, 3);
    hm_wire_wr_uint(&w, HM_DTYPE_F32);
    hm_wire_wr_array(&w, 2);
    hm_wire_wr_uint(&w, 4096);
    hm_wire_wr_uint(&w, 4096);
    hm_wire_wr_bin(&w, x, sizeof(x));
    uint8_t *b = hm_wire_wr_steal(&w, &len);
    cr_assert_not_null(b);
    cr_assert_lt(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), 0);
    cr_assert_neq(c.status, -ETIMEDOUT);
    free(b);

    /* Not msgpack at all. */
    uint8_t junk[] = {0xc1, 0xff, 0x00};
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, junk, sizeof(junk), &c), -EINVAL);

    /* The wrong dim for this expert. */
    float x8[B * 8];
    fill(x8, B * 8);
    hm_moe_encode_fwd(&w, "ffn.0.0", x8, B, 8);
    b = hm_wire_wr_steal(&w, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), -EPROTO);
    free(b);

    /* Non-finite input, forward and backward. */
    float xn[B * DIM];
    memcpy(xn, x, sizeof(x));
    xn[5] = NAN;
    b = enc_fwd("ffn.0.0", xn, B, DIM, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), -EDOM);
    free(b);
    xn[5] = INFINITY;
    b = enc_bwd("ffn.0.0", x, xn, B, DIM, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_BWD, b, len, &c), -EDOM);
    free(b);

    /* An expert that is not here, and a uid that is not a uid. */
    b = enc_fwd("ffn.5.5", x, B, DIM, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), -ENOENT);
    free(b);
    b = enc_fwd("moe.0", x, B, DIM, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), -ENOENT);
    free(b);

    /* A forward body sent as backward lacks gy. */
    b = enc_fwd("ffn.0.0", x, B, DIM, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_BWD, b, len, &c), -EINVAL);
    free(b);

    /* Still serving, and nothing stepped. */
    cr_assert_eq(remote_fwd(&f, "ffn.0.0", x, B, y), 0);
    hm_moe_hosted h[4];
    hm_moe_server_list(f.srv, h, 4);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.0")->steps, 0);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.0")->fwd_requests, 1);
    hm_wire_wr_free(&w);
    fx_stop(&f);
}

Test(moe_server, queue_bound_answers_enobufs)
{
    fx f;
    hm_moe_server_opts o;
    fx_start(&f, 0);
    memset(&o, 0, sizeof(o));
    o.max_queued_samples = 8;
    o.batch_wait_ms = 300;
    server_start(&f, &o);

    enum { N = 12, B = 2 };
    float x[B * DIM], y[B * DIM];
    fill(x, B * DIM);
    size_t len;
    call one;

    /* One request larger than the whole bound. */
    float big[9 * DIM];
    fill(big, 9 * DIM);
    uint8_t *b = enc_fwd("ffn.0.0", big, 9, DIM, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &one), -ENOBUFS);
    free(b);

    /* A burst while the batch wait holds them: four fit (8 samples), the rest bounce. */
    static call c[N];
    b = enc_fwd("ffn.0.0", x, B, DIM, &len);
    for (int i = 0; i < N; i++)
        call_start(&f, HM_MOE_METHOD_FWD, b, len, &c[i]);
    int ok = 0, nobufs = 0;
    for (int i = 0; i < N; i++) {
        cr_assert(hm_test_run_until(&f.loop, call_done, &c[i], 10000));
        if (c[i].status == 0) {
            cr_assert_eq(hm_moe_decode_out(c[i].body, c[i].len, 0, B, DIM, y), 0);
            ok++;
        } else {
            cr_assert_eq(c[i].status, -ENOBUFS);
            nobufs++;
        }
        free(c[i].body);
    }
    free(b);
    cr_assert_geq(ok, 4);
    cr_assert_geq(nobufs, 1, "ok %d, -ENOBUFS %d", ok, nobufs);
    /* Other experts have their own bound. */
    cr_assert_eq(remote_fwd(&f, "ffn.1.1", x, B, y), 0);
    fx_stop(&f);
}

/* ---- declarations ---- */

typedef struct got {
    int done, status;
    size_t n;
    struct {
        uint8_t subkey[HM_DHT_SUBKEY_MAX];
        size_t subkey_len;
        uint8_t value[HM_DHT_VALUE_MAX];
        size_t value_len;
        int has_subkey;
    } v[16];
} got;

static void on_get(void *ud, int status, const hm_dht_value *values, size_t n,
                   const hm_dht_lookup_info *info)
{
    got *g = ud;
    HM_UNUSED(info);
    g->done = 1;
    g->status = status;
    g->n = HM_MIN(n, HM_ARRAY_LEN(g->v));
    for (size_t i = 0; i < g->n; i++) {
        const hm_dht_record *r = &values[i].rec;
        g->v[i].has_subkey = r->has_subkey;
        g->v[i].subkey_len = r->has_subkey ? r->subkey_len : 0;
        if (r->has_subkey)
            memcpy(g->v[i].subkey, r->subkey, r->subkey_len);
        g->v[i].value_len = r->value_len;
        memcpy(g->v[i].value, r->value, r->value_len);
    }
}

static int got_done(void *ud) { return ((got *)ud)->done; }

static void dht_get_b(fx *f, const char *key, got *g)
{
    memset(g, 0, sizeof(*g));
    cr_assert_eq(hm_node_dht_get(f->b, (const uint8_t *)key, strlen(key), 3000, on_get, g), 0);
    cr_assert(hm_test_run_until(&f->loop, got_done, g, 6000));
}

/* Gets key from B until it shows at least n live (non-empty) values, or gives up. */
static size_t live_values(const got *g)
{
    size_t k = 0;
    for (size_t i = 0; i < g->n; i++)
        k += g->v[i].value_len > 0;
    return k;
}

static void get_until_live(fx *f, const char *key, size_t n, got *g)
{
    uint64_t end = hm_now_ms() + 10000;
    do {
        dht_get_b(f, key, g);
        if (g->status == 0 && live_values(g) >= n)
            return;
        hm_test_run_until(&f->loop, never, NULL, 100);
    } while (hm_now_ms() < end);
    cr_assert_fail("%s: %zu live values, wanted %zu", key, live_values(g), n);
}

/* Checks a prefix key lists coordinates 0 and 1, owned by A, with entries below it. */
static void check_prefix(fx *f, const char *key, got *g)
{
    int seen[2] = {0, 0};
    get_until_live(f, key, 2, g);
    for (size_t i = 0; i < g->n; i++) {
        uint32_t coord;
        uint8_t pk[HM_PK_BYTES];
        char uid[HM_MOE_UID_MAX + 1], addr[HM_MOE_ADDR_MAX + 1];
        cr_assert(g->v[i].has_subkey);
        cr_assert_eq(hm_moe_parse_prefix_subkey(g->v[i].subkey, g->v[i].subkey_len, &coord, pk),
                     0);
        cr_assert_arr_eq(pk, f->a_pk, HM_PK_BYTES);
        cr_assert_lt(coord, 2);
        seen[coord] = 1;
        cr_assert_eq(hm_moe_decode_prefix_value(g->v[i].value, g->v[i].value_len, uid, addr), 0);
        cr_assert_str_eq(addr, f->a_hostport);
        /* The entry names an expert below key.coord. */
        char below[HM_MOE_UID_MAX + 2];
        snprintf(below, sizeof(below), "%s%u.", key, (unsigned)coord);
        char uidd[HM_MOE_UID_MAX + 2];
        snprintf(uidd, sizeof(uidd), "%s.", uid);
        cr_assert(strncmp(uidd, below, strlen(below)) == 0, "%s under %s", uid, below);
    }
    cr_assert(seen[0] && seen[1]);
}

Test(moe_server, declarations_are_found_and_withdrawn)
{
    fx f;
    hm_moe_server_opts o;
    got g;
    char marker[HM_DHT_OWNER_MARKER_LEN + 1];
    fx_start(&f, 0);
    memset(&o, 0, sizeof(o));
    o.declare_ttl_s = 30;
    server_start(&f, &o);
    hm_dht_owner_marker(f.a_pk, marker);

    get_until_live(&f, "ffn.0.1", 1, &g);
    cr_assert_eq(g.n, 1);
    cr_assert(g.v[0].has_subkey);
    cr_assert_eq(g.v[0].subkey_len, strlen(marker));
    cr_assert(memcmp(g.v[0].subkey, marker, strlen(marker)) == 0);
    char addr[HM_MOE_ADDR_MAX + 1], type[HM_MOE_TYPE_MAX + 1];
    size_t dim;
    cr_assert_eq(hm_moe_decode_expert_value(g.v[0].value, g.v[0].value_len, addr, type, &dim), 0);
    cr_assert_str_eq(addr, f.a_hostport);
    cr_assert_str_eq(type, "ffn");
    cr_assert_eq(dim, DIM);

    check_prefix(&f, "ffn.", &g);
    check_prefix(&f, "ffn.1.", &g);

    /* Close with withdraw: the same keys now read as withdrawn. */
    server_close(&f, 1);
    dht_get_b(&f, "ffn.0.1", &g);
    cr_assert_eq(g.status, 0);
    cr_assert_eq(live_values(&g), 0, "ffn.0.1 still has a live declaration");
    cr_assert_geq(g.n, 1);
    cr_assert_eq(hm_moe_decode_expert_value(g.v[0].value, g.v[0].value_len, addr, type, &dim),
                 -ENOENT);
    dht_get_b(&f, "ffn.", &g);
    cr_assert_eq(live_values(&g), 0);
    dht_get_b(&f, "ffn.0.", &g);
    cr_assert_eq(live_values(&g), 0);
    /* After close the methods are gone. */
    float x[DIM];
    fill(x, DIM);
    size_t len;
    call c;
    uint8_t *b = enc_fwd("ffn.0.0", x, 1, DIM, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), -ENOSYS);
    free(b);
    fx_stop(&f);
}

/* ---- durability ---- */

static void do_backward(fx *f, const char *uid)
{
    enum { B = 2 };
    float x[B * DIM], gy[B * DIM], gx[B * DIM];
    size_t len;
    call c;
    fill(x, B * DIM);
    fill(gy, B * DIM);
    uint8_t *b = enc_bwd(uid, x, gy, B, DIM, &len);
    cr_assert_eq(call_sync(f, HM_MOE_METHOD_BWD, b, len, &c), 0);
    cr_assert_eq(hm_moe_decode_out(c.body, c.len, 1, B, DIM, gx), 0);
    free(c.body);
    free(b);
}

Test(moe_server, resumes_from_the_state_dir)
{
    fx f;
    fx_start(&f, 1);
    server_start(&f, NULL);
    do_backward(&f, "ffn.1.0");
    do_backward(&f, "ffn.1.0");
    server_close(&f, 0);

    /* What close wrote. */
    hm_ffn *saved = file_copy(&f, "ffn.1.0", NULL);
    cr_assert_eq(hm_ffn_steps(saved), 2);

    /* A second server on the same node and state dir picks it up. */
    server_start(&f, NULL);
    hm_moe_hosted h[4];
    cr_assert_eq(hm_moe_server_list(f.srv, h, 4), 4);
    cr_assert_eq(find_hosted(h, 4, "ffn.1.0")->resumed, 1);
    cr_assert_eq(find_hosted(h, 4, "ffn.1.0")->steps, 2);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.0")->steps, 0);

    enum { B = 3 };
    float x[B * DIM], y[B * DIM], want[B * DIM];
    fill(x, B * DIM);
    cr_assert_eq(hm_ffn_forward(saved, x, B, want), 0);
    cr_assert_eq(remote_fwd(&f, "ffn.1.0", x, B, y), 0);
    assert_close(y, want, B * DIM, "resumed y");
    hm_ffn_free(saved);

    /* Hosting again skips what is hosted; a mismatching config is refused. */
    hm_ffn_config c = cfg16();
    size_t added = 99;
    char err[256] = "";
    cr_assert_eq(hm_moe_server_host(f.srv, PATTERN, "ffn", &c, &added, err, sizeof(err)), 0);
    cr_assert_eq(added, 0);
    server_close(&f, 0);

    hm_moe_server_opts o;
    memset(&o, 0, sizeof(o));
    o.state_dir = f.dir;
    cr_assert_eq(hm_moe_server_new(f.a, &o, &f.srv), 0);
    c.hidden = 32;
    cr_assert_eq(hm_moe_server_host(f.srv, "ffn.1.[0:2]", "ffn", &c, &added, err, sizeof(err)),
                 -EPROTO);
    cr_assert(strlen(err) > 0);
    cr_assert_eq(hm_moe_server_list(f.srv, h, 4), 0, "a refused pattern adds nothing");
    fx_stop(&f);
}

Test(moe_server, corrupt_checkpoint_falls_back_to_previous)
{
    fx f;
    char path[256];
    fx_start(&f, 1);
    server_start(&f, NULL);
    do_backward(&f, "ffn.0.1");
    cr_assert_eq(hm_moe_server_checkpoint(f.srv), 0);
    do_backward(&f, "ffn.0.1");
    server_close(&f, 0);

    /* Current holds step 2, previous step 1; damage the current file's payload. */
    ckpt_path(&f, "ffn.0.1", path, sizeof(path));
    FILE *fp = fopen(path, "r+b");
    cr_assert_not_null(fp);
    cr_assert_eq(fseek(fp, HM_CKPT_HEADER_BYTES + 40, SEEK_SET), 0);
    int ch = fgetc(fp);
    cr_assert_eq(fseek(fp, HM_CKPT_HEADER_BYTES + 40, SEEK_SET), 0);
    fputc(ch ^ 0x5a, fp);
    fclose(fp);
    int used_prev = 0;
    hm_ffn *prev = file_copy(&f, "ffn.0.1", &used_prev);
    cr_assert_eq(used_prev, 1);
    cr_assert_eq(hm_ffn_steps(prev), 1);

    server_start(&f, NULL);
    hm_moe_hosted h[4];
    hm_moe_server_list(f.srv, h, 4);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.1")->resumed, 1);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.1")->steps, 1);
    enum { B = 2 };
    float x[B * DIM], y[B * DIM], want[B * DIM];
    fill(x, B * DIM);
    cr_assert_eq(hm_ffn_forward(prev, x, B, want), 0);
    cr_assert_eq(remote_fwd(&f, "ffn.0.1", x, B, y), 0);
    assert_close(y, want, B * DIM, "y from previous");
    hm_ffn_free(prev);
    fx_stop(&f);
}

Test(moe_server, one_server_per_node_and_bad_host_calls)
{
    fx f;
    fx_start(&f, 0);
    server_start(&f, NULL);
    hm_moe_server *second = NULL;
    cr_assert_eq(hm_moe_server_new(f.a, NULL, &second), -EEXIST);
    cr_assert_null(second);

    hm_ffn_config c = cfg16();
    char err[256];
    size_t added = 5;
    cr_assert_eq(hm_moe_server_host(f.srv, "ffn.[0:2", "ffn", &c, &added, err, sizeof(err)),
                 -EINVAL);
    cr_assert(strstr(err, "byte") != NULL, "%s", err);
    cr_assert_eq(added, 0);
    cr_assert_eq(hm_moe_server_host(f.srv, "big.[0:65536]", "ffn", &c, &added, err, sizeof(err)),
                 -EMSGSIZE);
    cr_assert_eq(hm_moe_server_host(f.srv, "ffn.9", "bad type!", &c, &added, err, sizeof(err)),
                 -EINVAL);
    c.dim = 0;
    cr_assert_eq(hm_moe_server_host(f.srv, "ffn.9", "ffn", &c, &added, err, sizeof(err)),
                 -EINVAL);
    c = cfg16();
    c.dim = 8;
    /* Another grid next to the first, with its own dim. */
    cr_assert_eq(hm_moe_server_host(f.srv, "small.[0:3]", "ffn", &c, &added, err, sizeof(err)), 0,
                 "%s", err);
    cr_assert_eq(added, 3);
    hm_moe_hosted h[8];
    cr_assert_eq(hm_moe_server_list(f.srv, h, 8), 7);
    cr_assert_eq(find_hosted(h, 7, "small.2")->dim, 8);
    /* list copies at most max and still says how many there are. */
    cr_assert_eq(hm_moe_server_list(f.srv, h, 2), 7);
    fx_stop(&f);
}

Test(moe_server, requests_whose_caller_left_are_not_computed)
{
    fx f;
    hm_moe_server_opts o;
    fx_start(&f, 0);
    memset(&o, 0, sizeof(o));
    o.batch_wait_ms = 400;
    server_start(&f, &o);

    float x[DIM], y[DIM];
    fill(x, DIM);
    size_t len;
    call c;
    memset(&c, 0, sizeof(c));
    uint8_t *b = enc_fwd("ffn.1.1", x, 1, DIM, &len);
    /* The caller gives up long before the batch wait is over. */
    cr_assert_eq(hm_rpc_call(hm_node_rpc(f.b), f.a_pk, (const struct sockaddr *)&f.a_addr,
                             HM_MOE_METHOD_FWD, b, len, HM_RPC_STREAM, 100, on_reply, &c, NULL),
                 0);
    cr_assert(hm_test_run_until(&f.loop, call_done, &c, 5000));
    cr_assert_eq(c.status, -ETIMEDOUT);
    free(b);
    hm_test_run_until(&f.loop, never, NULL, 700);
    hm_moe_hosted h[4];
    hm_moe_server_list(f.srv, h, 4);
    cr_assert_eq(find_hosted(h, 4, "ffn.1.1")->batches, 0, "a request nobody waits for ran");
    cr_assert_eq(find_hosted(h, 4, "ffn.1.1")->fwd_requests, 0);
    /* The expert still serves the next caller. */
    cr_assert_eq(remote_fwd(&f, "ffn.1.1", x, 1, y), 0);
    fx_stop(&f);
}

Test(moe_server, declares_once_peers_appear)
{
    uv_loop_t loop;
    hm_moe_server *srv = NULL;
    hm_moe_server_opts o;
    hm_ffn_config c = cfg16();
    char addr[256], err[256] = "";
    got g;
    int closed = 0;

    hm_log_set_level(getenv("HM_TEST_DEBUG") != NULL ? HM_LOG_DEBUG : HM_LOG_ERROR);
    cr_assert_eq(hm_crypto_init(), 0);
    cr_assert_eq(uv_loop_init(&loop), 0);
    /* A lone node hosts first (as a daemon does at start); its first round stores nothing. */
    hm_node *a = hm_test_make_node(&loop, "moe-server-test", NULL);
    memset(&o, 0, sizeof(o));
    o.declare_ttl_s = 300; /* a refresh would be 100 s away */
    cr_assert_eq(hm_moe_server_new(a, &o, &srv), 0);
    cr_assert_eq(hm_moe_server_host(srv, "late.[0:2]", "ffn", &c, NULL, err, sizeof(err)), 0);
    hm_test_run_until(&loop, never, NULL, 300);

    cr_assert_eq(hm_node_address(a, addr, sizeof(addr)), 0);
    hm_node *b = hm_test_make_node(&loop, "moe-server-test", addr);
    fx f;
    memset(&f, 0, sizeof(f));
    f.a = a;
    f.b = b;
    cr_assert(hm_test_run_until(&loop, dht_ready, &f, 10000));
    memset(&g, 0, sizeof(g));
    uint64_t end = hm_now_ms() + 12000;
    int found = 0;
    while (!found && hm_now_ms() < end) {
        memset(&g, 0, sizeof(g));
        cr_assert_eq(hm_node_dht_get(b, (const uint8_t *)"late.1", 6, 2000, on_get, &g), 0);
        cr_assert(hm_test_run_until(&loop, got_done, &g, 4000));
        found = g.status == 0 && live_values(&g) == 1;
        if (!found)
            hm_test_run_until(&loop, never, NULL, 200);
    }
    cr_assert(found, "the declaration never appeared after the peer came");

    hm_moe_server_close(srv, 0, set_flag, &closed);
    cr_assert(hm_test_run_until(&loop, flag_set, &closed, 10000));
    hm_node_close(a, NULL, NULL);
    hm_node_close(b, NULL, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&loop), 0);
}

static int stepped_and_saved(void *ud)
{
    fx *f = ud;
    hm_moe_hosted h[4];
    hm_moe_server_list(f->srv, h, 4);
    const hm_moe_hosted *e = find_hosted(h, 4, "ffn.1.1");
    return e->steps == 1 && e->last_checkpoint_unix_ms != 0;
}

Test(moe_server, periodic_checkpoints_save_stepped_experts)
{
    fx f;
    hm_moe_server_opts o;
    fx_start(&f, 1);
    memset(&o, 0, sizeof(o));
    o.state_dir = f.dir;
    o.checkpoint_interval_ms = 150;
    server_start(&f, &o);
    do_backward(&f, "ffn.1.1");
    cr_assert(hm_test_run_until(&f.loop, stepped_and_saved, &f, 5000),
              "no periodic checkpoint after a step");
    hm_ffn *saved = file_copy(&f, "ffn.1.1", NULL);
    cr_assert_eq(hm_ffn_steps(saved), 1);
    hm_ffn_free(saved);
    /* Experts that never stepped are not rewritten periodically. */
    hm_moe_hosted h[4];
    hm_moe_server_list(f.srv, h, 4);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.0")->last_checkpoint_unix_ms, 0);
    fx_stop(&f);
}

/* Points at params[0] inside a saved state (the bin after the key "params"). */
static uint8_t *state_param0(uint8_t *buf, size_t len)
{
    for (size_t i = 0; i + 7 + 8 < len; i++) {
        if (memcmp(buf + i, "\xa6params", 7) != 0)
            continue;
        uint8_t t = buf[i + 7];
        size_t hdr = t == 0xc4 ? 2 : t == 0xc5 ? 3 : t == 0xc6 ? 5 : 0;
        cr_assert_neq(hdr, 0, "params is not a bin");
        return buf + i + 7 + hdr;
    }
    cr_assert_fail("no params in the state");
    return NULL;
}

/*
 * Puts at PATH a checkpoint that verifies (header and hash are right) but
 * whose state is malformed: params[0] is +inf, as an expert whose Adam
 * moment overflowed used to save. PATH.prev is left alone.
 */
static void plant_malformed(fx *f, const char *uid)
{
    char path[256], tmp[300];
    uint8_t *buf = NULL;
    size_t len = 0;
    hm_ffn *e = NULL;
    const uint8_t inf_le[4] = {0x00, 0x00, 0x80, 0x7f};

    ckpt_path(f, uid, path, sizeof(path));
    cr_assert_eq(hm_ckpt_read_file(path, (size_t)1 << 26, &buf, &len), 0);
    memcpy(state_param0(buf, len), inf_le, 4);
    cr_assert_eq(hm_ffn_load(buf, len, NULL, &e), -EBADMSG);
    snprintf(tmp, sizeof(tmp), "%s/planted", f->dir);
    cr_assert_eq(hm_ckpt_write(tmp, buf, len), 0);
    cr_assert_eq(rename(tmp, path), 0);
    free(buf);
}

/*
 * A checkpoint that verifies but holds a malformed state is treated like a
 * corrupt file: PATH.prev is used, and with no usable file the expert
 * starts afresh. Hosting is never refused for it (only a real shape
 * mismatch is -EPROTO), so hivemindd still starts.
 */
Test(moe_server, malformed_checkpoint_falls_back_or_starts_afresh)
{
    fx f;
    char path[256], prev[300];
    fx_start(&f, 1);
    server_start(&f, NULL);
    do_backward(&f, "ffn.0.0");
    cr_assert_eq(hm_moe_server_checkpoint(f.srv), 0);
    do_backward(&f, "ffn.0.0");
    server_close(&f, 0);
    /* PATH holds step 2, PATH.prev step 1. */
    plant_malformed(&f, "ffn.0.0");

    server_start(&f, NULL);
    hm_moe_hosted h[4];
    cr_assert_eq(hm_moe_server_list(f.srv, h, 4), 4);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.0")->resumed, 1);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.0")->steps, 1);
    server_close(&f, 0);

    /* Malformed PATH and no PATH.prev: a fresh expert. */
    plant_malformed(&f, "ffn.0.0");
    ckpt_path(&f, "ffn.0.0", path, sizeof(path));
    snprintf(prev, sizeof(prev), "%s.prev", path);
    unlink(prev);
    server_start(&f, NULL);
    cr_assert_eq(hm_moe_server_list(f.srv, h, 4), 4);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.0")->resumed, 0);
    cr_assert_eq(find_hosted(h, 4, "ffn.0.0")->steps, 0);
    do_backward(&f, "ffn.0.0");
    fx_stop(&f);
}

/*
 * A finite but huge dL/dy would overflow Adam's second moment: that request
 * is answered -EDOM and steps nothing, while requests batched with it are
 * answered and stepped, and the expert goes on learning.
 */
Test(moe_server, overflowing_backward_is_edom_alone)
{
    fx f;
    hm_moe_server_opts o;
    hm_ffn_config c = cfg16();
    char err[256] = "";
    size_t added = 0, len;
    fx_start(&f, 0);
    memset(&o, 0, sizeof(o));
    o.batch_wait_ms = 200;
    server_start(&f, &o);
    c.optimizer = HM_FFN_ADAM;
    c.lr = 0;
    cr_assert_eq(hm_moe_server_host(f.srv, "adam.0", "ffn", &c, &added, err, sizeof(err)), 0,
                 "%s", err);

    enum { B = 2, N = 3 };
    float x[B * DIM], gy[B * DIM], huge[B * DIM], gx[B * DIM];
    fill(x, B * DIM);
    fill(gy, B * DIM);
    for (size_t i = 0; i < B * DIM; i++)
        huge[i] = 1e25f;
    call one;
    uint8_t *b = enc_bwd("adam.0", x, huge, B, DIM, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_BWD, b, len, &one), -EDOM);
    free(b);

    /* The same among honest requests in one batch (the batch wait holds them together). */
    static call cs[N];
    uint8_t *bodies[N];
    size_t lens[N];
    for (int i = 0; i < N; i++)
        bodies[i] = enc_bwd("adam.0", x, i == 1 ? huge : gy, B, DIM, &lens[i]);
    for (int i = 0; i < N; i++)
        call_start(&f, HM_MOE_METHOD_BWD, bodies[i], lens[i], &cs[i]);
    for (int i = 0; i < N; i++) {
        cr_assert(hm_test_run_until(&f.loop, call_done, &cs[i], 10000));
        if (i == 1) {
            cr_assert_eq(cs[i].status, -EDOM);
        } else {
            cr_assert_eq(cs[i].status, 0, "request %d: %s", i, hm_strerror(cs[i].status));
            cr_assert_eq(hm_moe_decode_out(cs[i].body, cs[i].len, 1, B, DIM, gx), 0);
        }
        free(cs[i].body);
        free(bodies[i]);
    }
    hm_moe_hosted h[5];
    cr_assert_eq(hm_moe_server_list(f.srv, h, 5), 5);
    cr_assert_eq(find_hosted(h, 5, "adam.0")->steps, 2);
    cr_assert_eq(find_hosted(h, 5, "adam.0")->bwd_requests, 2);
    fx_stop(&f);
}

/*
 * The server-wide byte bound counts a request from arrival until its
 * reply: requests that became jobs waiting for the one worker still hold
 * their bytes, so a burst over several experts is refused past the bound,
 * and the bytes come back once the batches are answered.
 */
Test(moe_server, byte_bound_counts_jobs_until_answered)
{
    fx f;
    hm_moe_server_opts o;
    hm_ffn_config c;
    char err[256] = "";
    size_t added = 0, len;
    enum { D = 256, B = 512, E = 3 };
    fx_start(&f, 0);
    memset(&o, 0, sizeof(o));
    o.workers = 1;
    o.max_batch_size = 1; /* every request is a batch of its own, due on arrival */
    o.max_queued_bytes = (size_t)B * D * sizeof(float) * 3 / 2;
    cr_assert_eq(hm_moe_server_new(f.a, &o, &f.srv), 0);
    memset(&c, 0, sizeof(c));
    c.dim = D;
    c.hidden = 8192; /* a batch takes a while, so that the others wait for the worker */
    c.seed = 1;
    cr_assert_eq(hm_moe_server_host(f.srv, "big.[0:3]", "ffn", &c, &added, err, sizeof(err)), 0,
                 "%s", err);

    float *x = malloc((size_t)B * D * sizeof(float));
    cr_assert_not_null(x);
    fill(x, (size_t)B * D);
    static call cs[E];
    uint8_t *bodies[E];
    for (int i = 0; i < E; i++) {
        char uid[16];
        snprintf(uid, sizeof(uid), "big.%d", i);
        hm_wire_wr w;
        hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
        hm_moe_encode_fwd(&w, uid, x, B, D);
        cr_assert_eq(hm_wire_wr_error(&w), 0);
        bodies[i] = hm_wire_wr_steal(&w, &len);
    }
    for (int i = 0; i < E; i++)
        call_start(&f, HM_MOE_METHOD_FWD, bodies[i], len, &cs[i]);
    int ok = 0, nobufs = 0;
    for (int i = 0; i < E; i++) {
        cr_assert(hm_test_run_until(&f.loop, call_done, &cs[i], 20000));
        if (cs[i].status == 0)
            ok++;
        else if (cs[i].status == -ENOBUFS)
            nobufs++;
        else
            cr_assert_fail("request %d: %s", i, hm_strerror(cs[i].status));
        free(cs[i].body);
    }
    cr_assert_geq(ok, 1);
    cr_assert_geq(nobufs, 1, "ok %d, -ENOBUFS %d: jobs waiting for the worker were not counted",
                  ok, nobufs);
    /* Answered batches give their bytes back: each expert is served now, one at a time. */
    for (int i = 0; i < E; i++) {
        call again;
        cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, bodies[i], len, &again), 0);
        free(again.body);
        free(bodies[i]);
    }
    free(x);
    fx_stop(&f);
}

/* A second close while the first is under way is -EALREADY; only the first cb fires. */
Test(moe_server, second_close_is_ealready)
{
    fx f;
    int first = 0, second = 0;
    fx_start(&f, 0);
    server_start(&f, NULL);
    cr_assert_eq(hm_moe_server_close(f.srv, 1, set_flag, &first), 0);
    cr_assert_eq(hm_moe_server_close(f.srv, 0, set_flag, &second), -EALREADY);
    cr_assert(hm_test_run_until(&f.loop, flag_set, &first, 15000), "server close hung");
    cr_assert_eq(second, 0);
    f.srv = NULL;
    fx_stop(&f);
}

/* ---- fairness across origins ---- */

/* A node on another loopback address: another origin to the server. */
static hm_node *node_on(uv_loop_t *loop, const char *listen)
{
    hm_node_options o = {0};
    o.listen = listen;
    o.swarm = "moe-server-test";
    o.ping_interval_ms = 1000;
    /* A flooder queues what it likes: its own write-queue shares do not hold it back. */
    o.transport.wq_origin_bytes = (size_t)1 << 30;
    o.transport.wq_max_bytes = (size_t)1 << 30;
    hm_node *n = NULL;
    char err[256] = "";
    cr_assert_eq(hm_node_new(loop, &o, &n, err, sizeof(err)), 0, "hm_node_new %s: %s", listen,
                 err);
    return n;
}

static void limit_cb_queued(void *ud, const char *keyword, uint64_t refused)
{
    if (strcmp(keyword, "ExpertMaxQueued") == 0)
        *(uint64_t *)ud = refused;
}

typedef struct flood {
    call c[24];
    size_t n_done, n_ok, n_nobufs;
} flood;

static void on_flood_reply(void *ud, int status, const uint8_t *body, size_t len)
{
    call *c = ud;
    HM_UNUSED(body);
    HM_UNUSED(len);
    c->done = 1;
    c->status = status;
    if (getenv("HM_TEST_DEBUG") != NULL)
        fprintf(stderr, "%llu flood reply %d\n", (unsigned long long)hm_now_ms(), status);
}

static int flood_started(void *ud)
{
    /* Some answered (work is flowing) and some bounced (the queue is full). */
    flood *fl = ud;
    size_t ok = 0, bounced = 0;
    for (size_t i = 0; i < HM_ARRAY_LEN(fl->c); i++) {
        ok += fl->c[i].done && fl->c[i].status == 0;
        bounced += fl->c[i].done && fl->c[i].status == -ENOBUFS;
    }
    return ok >= 1 && bounced >= 1;
}

/*
 * One origin (a node on 127.0.0.2) fills ffn.0.0's queue with whole
 * batches of slow work; a request from another origin (B, 127.0.0.1) that
 * arrives at the full queue is admitted by shedding the flooder's oldest
 * request, and is served next: when it returns, most of the flooder's
 * admitted requests are still waiting. Arrival order (the old single
 * queue) would refuse it, or answer it after all of them.
 */
Test(moe_server, a_flooding_origin_neither_blocks_nor_delays_another)
{
    fx f;
    hm_moe_server_opts o;
    hm_ffn_config c;
    char err[256] = "";
    size_t added = 0;
    enum { D = 512, AB = 1024, HB = 8 };

    fx_start(&f, 0);
    memset(&o, 0, sizeof(o));
    o.workers = 1;
    o.max_batch_size = AB;
    o.batch_wait_ms = 1;
    o.max_queued_samples = 8 * AB;
    cr_assert_eq(hm_moe_server_new(f.a, &o, &f.srv), 0);
    memset(&c, 0, sizeof(c));
    c.dim = D;
    c.hidden = 4 * D;
    c.optimizer = HM_FFN_SGD;
    c.lr = 0.01;
    c.seed = 3;
    cr_assert_eq(hm_moe_server_host(f.srv, "ffn.0.0", "ffn", &c, &added, err, sizeof(err)), 0,
                 "%s", err);
    hm_node *att = node_on(&f.loop, "127.0.0.2:0");

    float *xa = malloc(sizeof(float) * AB * D), *xh = malloc(sizeof(float) * HB * D);
    float *yh = malloc(sizeof(float) * HB * D);
    cr_assert(xa != NULL && xh != NULL && yh != NULL);
    fill(xa, (size_t)AB * D);
    fill(xh, (size_t)HB * D);
    size_t alen, hlen;
    uint8_t *ab = enc_fwd("ffn.0.0", xa, AB, D, &alen);
    uint8_t *hb = enc_fwd("ffn.0.0", xh, HB, D, &hlen);

    /* B's stream to A is up before the flood, so that the honest call below
     * measures queueing, not a handshake. */
    call warm;
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, hb, hlen, &warm), 0);
    free(warm.body);

    static flood fl;
    memset(&fl, 0, sizeof(fl));
    for (size_t i = 0; i < HM_ARRAY_LEN(fl.c); i++)
        cr_assert_eq(hm_rpc_call(hm_node_rpc(att), f.a_pk, (const struct sockaddr *)&f.a_addr,
                                 HM_MOE_METHOD_FWD, ab, alen, HM_RPC_STREAM, 60000,
                                 on_flood_reply, &fl.c[i], NULL),
                     0);
    cr_assert(hm_test_run_until(&f.loop, flood_started, &fl, 20000), "the flood did not start");

    call h;
    memset(&h, 0, sizeof(h));
    if (getenv("HM_TEST_DEBUG") != NULL)
        fprintf(stderr, "%llu honest sent\n", (unsigned long long)hm_now_ms());
    cr_assert_eq(hm_rpc_call(hm_node_rpc(f.b), f.a_pk, (const struct sockaddr *)&f.a_addr,
                             HM_MOE_METHOD_FWD, hb, hlen, HM_RPC_STREAM, 20000, on_reply, &h,
                             NULL),
                 0);
    cr_assert(hm_test_run_until(&f.loop, call_done, &h, 25000), "the honest call hung");
    cr_assert_eq(h.status, 0, "the honest call: %s", hm_strerror(h.status));
    cr_assert_eq(hm_moe_decode_out(h.body, h.len, 0, HB, D, yh), 0);
    size_t waiting = 0, ok = 0;
    for (size_t i = 0; i < HM_ARRAY_LEN(fl.c); i++) {
        waiting += !fl.c[i].done;
        ok += fl.c[i].done && fl.c[i].status == 0;
    }
    if (getenv("HM_TEST_DEBUG") != NULL)
        fprintf(stderr, "honest returned: flooder %zu answered, %zu waiting\n", ok, waiting);
    cr_assert_geq(waiting, 4, "only %zu of the flooder's requests were still queued when the "
                              "honest call returned", waiting);
    free(h.body);

    /* The shedding shows in the limit's count. */
    struct { uint64_t queued; } lim = {0};
    hm_moe_server_limits(f.srv, limit_cb_queued, &lim);
    cr_assert_geq(lim.queued, 1);

    for (size_t i = 0; i < HM_ARRAY_LEN(fl.c); i++)
        cr_assert(hm_test_run_until(&f.loop, call_done, &fl.c[i], 30000));
    free(ab);
    free(hb);
    free(xa);
    free(xh);
    free(yh);
    server_close(&f, 0);
    hm_node_close(att, NULL, NULL);
    fx_stop(&f);
}

/* ---- transformer experts ---- */

static hm_xf *xf_file_copy(fx *f, const char *uid)
{
    char path[256];
    uint8_t *buf = NULL;
    size_t len = 0;
    hm_xf *t = NULL;
    ckpt_path(f, uid, path, sizeof(path));
    cr_assert_eq(hm_ckpt_read(path, (size_t)1 << 26, &buf, &len, NULL), 0, "%s", path);
    cr_assert(hm_xf_is_state(buf, len), "%s does not say it holds a transformer", path);
    cr_assert_eq(hm_xf_load(buf, len, NULL, &t), 0);
    free(buf);
    return t;
}

static uint8_t *enc_seq(const char *uid, const float *x, const float *gy, size_t batch,
                        size_t seq, size_t *len)
{
    hm_wire_wr w;
    hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
    if (gy != NULL)
        hm_moe_encode_bwd_seq(&w, uid, x, gy, batch, seq, DIM);
    else
        hm_moe_encode_fwd_seq(&w, uid, x, batch, seq, DIM);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    uint8_t *b = hm_wire_wr_steal(&w, len);
    cr_assert_not_null(b);
    return b;
}

/*
 * Transformer experts through the server: declared with their type, a
 * remote forward and backward over [batch, seq, dim] (two requests of
 * different sequence lengths batched together) equal the local
 * computation of the checkpointed expert, and the backward is one step
 * with the summed gradient; wrong shapes and overlong sequences are
 * refused with the reason; a checkpoint of the other kind is refused.
 */
Test(moe_server, transformer_experts_equal_the_local_block)
{
    fx f;
    fx_start(&f, 1);
    hm_moe_server_opts o = {.state_dir = f.dir, .batch_wait_ms = 200};
    cr_assert_eq(hm_moe_server_new(f.a, &o, &f.srv), 0);
    hm_xf_config xc = {.ffn = cfg16(), .heads = 4, .max_seq = 8};
    char err[256] = "";
    size_t added = 0;
    cr_assert_eq(hm_moe_server_host_xf(f.srv, "transformer::enc.[0:2]", &xc, &added, err,
                                       sizeof(err)),
                 0, "%s", err);
    cr_assert_eq(added, 2u);
    /* The plain call refuses the type: a transformer needs its config. */
    hm_ffn_config c16 = cfg16();
    cr_assert_eq(hm_moe_server_host(f.srv, "t.1", HM_MOE_TYPE_TRANSFORMER, &c16, &added, err,
                                    sizeof(err)),
                 -EINVAL);
    hm_xf_config bad = xc;
    bad.heads = 3;
    cr_assert_eq(hm_moe_server_host_xf(f.srv, "t.1", &bad, &added, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "divide") != NULL, "%s", err);

    hm_moe_hosted h[4];
    cr_assert_eq(hm_moe_server_list(f.srv, h, 4), 2u);
    cr_assert_str_eq(h[1].uid, "transformer::enc.1");
    cr_assert_str_eq(h[1].type, "transformer");
    cr_assert_eq(h[1].heads, 4u);
    cr_assert_eq(h[1].max_seq, 8u);

    /* moe.info says the shape. */
    uint8_t ib[256];
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, ib, sizeof(ib));
    hm_moe_encode_info_req(&w, "transformer::enc.1");
    call c;
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_INFO, ib, w.len, &c), 0);
    char type[HM_MOE_TYPE_MAX + 1];
    size_t dim, hidden, heads, max_seq;
    cr_assert_eq(hm_moe_decode_info_seq(c.body, c.len, type, &dim, &hidden, &heads, &max_seq), 0);
    cr_assert_str_eq(type, "transformer");
    cr_assert_eq(dim, (size_t)DIM);
    cr_assert_eq(heads, 4u);
    cr_assert_eq(max_seq, 8u);
    free(c.body);

    /* The expert as it starts, for the local computation. */
    cr_assert_eq(hm_moe_server_checkpoint(f.srv), 0);
    hm_xf *local = xf_file_copy(&f, "transformer%3A%3Aenc.1");
    enum { B1 = 2, S1 = 5, B2 = 3, S2 = 3 };
    float x1[B1 * S1 * DIM], x2[B2 * S2 * DIM], g1[B1 * S1 * DIM], g2[B2 * S2 * DIM];
    float y[B1 * S1 * DIM], want[B1 * S1 * DIM];
    fill(x1, B1 * S1 * DIM);
    fill(x2, B2 * S2 * DIM);
    fill(g1, B1 * S1 * DIM);
    fill(g2, B2 * S2 * DIM);
    size_t len;
    uint8_t *b = enc_seq("transformer::enc.1", x1, NULL, B1, S1, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), 0);
    free(b);
    cr_assert_eq(hm_moe_decode_out_seq(c.body, c.len, 0, B1, S1, DIM, y), 0);
    free(c.body);
    cr_assert_eq(hm_xf_forward(local, x1, B1, S1, want), 0);
    assert_close(y, want, B1 * S1 * DIM, "forward");

    /* Two backward requests of different lengths, in one batch (batch_wait 200 ms). */
    call c1, c2;
    uint8_t *bb1 = enc_seq("transformer::enc.1", x1, g1, B1, S1, &len);
    call_start(&f, HM_MOE_METHOD_BWD, bb1, len, &c1);
    size_t len2;
    uint8_t *bb2 = enc_seq("transformer::enc.1", x2, g2, B2, S2, &len2);
    call_start(&f, HM_MOE_METHOD_BWD, bb2, len2, &c2);
    cr_assert(hm_test_run_until(&f.loop, call_done, &c1, 12000));
    cr_assert(hm_test_run_until(&f.loop, call_done, &c2, 12000));
    free(bb1);
    free(bb2);
    cr_assert_eq(c1.status, 0);
    cr_assert_eq(c2.status, 0);
    float gx1[B1 * S1 * DIM], gx2[B2 * S2 * DIM], w1[B1 * S1 * DIM], w2[B2 * S2 * DIM];
    cr_assert_eq(hm_moe_decode_out_seq(c1.body, c1.len, 1, B1, S1, DIM, gx1), 0);
    cr_assert_eq(hm_moe_decode_out_seq(c2.body, c2.len, 1, B2, S2, DIM, gx2), 0);
    free(c1.body);
    free(c2.body);
    const size_t np = hm_xf_nparams(local);
    float *gp1 = calloc(np, sizeof(float)), *gp2 = calloc(np, sizeof(float));
    cr_assert_eq(hm_xf_grad(local, x1, g1, B1, S1, w1, gp1), 0);
    cr_assert_eq(hm_xf_grad(local, x2, g2, B2, S2, w2, gp2), 0);
    assert_close(gx1, w1, B1 * S1 * DIM, "dL/dx of the first request");
    assert_close(gx2, w2, B2 * S2 * DIM, "dL/dx of the second request");
    cr_assert_eq(hm_moe_server_list(f.srv, h, 4), 2u);
    cr_assert_eq(h[1].steps, 1u, "two requests in one batch are one step");
    for (size_t i = 0; i < np; i++)
        gp1[i] += gp2[i];
    cr_assert_eq(hm_xf_apply(local, gp1), 0);
    cr_assert_eq(hm_moe_server_checkpoint(f.srv), 0);
    hm_xf *after = xf_file_copy(&f, "transformer%3A%3Aenc.1");
    for (size_t i = 0; i < np; i++)
        cr_assert(fabsf(*hm_xf_param(after, i) - *hm_xf_param(local, i)) <= 1e-6f,
                  "parameter %zu after the step", i);
    hm_xf_free(after);
    free(gp1);
    free(gp2);

    /* Shapes: [batch, dim] to a transformer, a sequence past max_seq, [b, s, d] to nothing. */
    b = enc_fwd("transformer::enc.1", x1, 2, DIM, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), -EPROTO);
    free(b);
    char msg[HM_MOE_ERR_MAX + 1];
    hm_moe_decode_error(c.body, c.len, msg);
    cr_assert(strstr(msg, "[batch, seq, 16]") != NULL, "the reason: %s", msg);
    free(c.body);
    float big[10 * DIM];
    fill(big, 10 * DIM);
    b = enc_seq("transformer::enc.1", big, NULL, 1, 10, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), -EPROTO);
    free(b);
    hm_moe_decode_error(c.body, c.len, msg);
    cr_assert(strstr(msg, "ExpertMaxSeq") != NULL && strstr(msg, "at most 8") != NULL, "%s",
              msg);
    free(c.body);
    hm_xf_free(local);
    server_close(&f, 0);

    /* An ffn hosted over a transformer's checkpoint, and the other way round: refused. */
    cr_assert_eq(hm_moe_server_new(f.a, &o, &f.srv), 0);
    cr_assert_eq(hm_moe_server_host(f.srv, "transformer::enc.1", "ffn", &c16, &added, err,
                                    sizeof(err)),
                 -EPROTO);
    cr_assert(strstr(err, "holds a transformer expert") != NULL, "%s", err);
    cr_assert_eq(hm_moe_server_host(f.srv, "plain.0", "ffn", &c16, &added, err, sizeof(err)), 0);
    cr_assert_eq(hm_moe_server_checkpoint(f.srv), 0);
    server_close(&f, 0);
    cr_assert_eq(hm_moe_server_new(f.a, &o, &f.srv), 0);
    cr_assert_eq(hm_moe_server_host_xf(f.srv, "plain.0", &xc, &added, err, sizeof(err)), -EPROTO);
    cr_assert(strstr(err, "holds an ffn expert") != NULL, "%s", err);
    /* A transformer resumes from its own checkpoint, stepped once. */
    cr_assert_eq(hm_moe_server_host_xf(f.srv, "transformer::enc.1", &xc, &added, err,
                                       sizeof(err)),
                 0, "%s", err);
    cr_assert_eq(hm_moe_server_list(f.srv, h, 4), 1u);
    cr_assert(h[0].resumed);
    cr_assert_eq(h[0].steps, 1u);
    fx_stop(&f);
}

static uint8_t *enc_mask(const char *uid, const float *x, const uint8_t *mask, const float *gy,
                         size_t batch, size_t seq, size_t *len)
{
    hm_wire_wr w;
    hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
    if (gy != NULL)
        hm_moe_encode_bwd_mask(&w, uid, x, mask, gy, batch, seq, DIM);
    else
        hm_moe_encode_fwd_mask(&w, uid, x, mask, batch, seq, DIM);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    uint8_t *b = hm_wire_wr_steal(&w, len);
    cr_assert_not_null(b);
    return b;
}

/*
 * Masked requests (revision 3) batched with unmasked ones: a masked and an
 * unmasked backward of one sequence length, and a masked one of another,
 * in one batch, each answer equal to its own local masked (or unmasked)
 * computation, and the batch one step with their summed gradient; a
 * masked request to an ffn is refused.
 */
Test(moe_server, masked_and_unmasked_requests_share_a_batch)
{
    fx f;
    fx_start(&f, 1);
    hm_moe_server_opts o = {.state_dir = f.dir, .batch_wait_ms = 200};
    cr_assert_eq(hm_moe_server_new(f.a, &o, &f.srv), 0);
    hm_xf_config xc = {.ffn = cfg16(), .heads = 4, .max_seq = 8};
    hm_ffn_config c16 = cfg16();
    char err[256] = "";
    size_t added = 0;
    cr_assert_eq(hm_moe_server_host_xf(f.srv, "enc.0", &xc, &added, err, sizeof(err)), 0, "%s",
                 err);
    cr_assert_eq(hm_moe_server_host(f.srv, "plain.0", "ffn", &c16, &added, err, sizeof(err)), 0,
                 "%s", err);
    cr_assert_eq(hm_moe_server_checkpoint(f.srv), 0);
    hm_xf *local = xf_file_copy(&f, "enc.0");
    enum { B = 2, S = 4, B3 = 1, S3 = 6, N = B * S * DIM, N3 = B3 * S3 * DIM };
    float x[3][N3 > N ? N3 : N], g[3][N3 > N ? N3 : N], gx[3][N3 > N ? N3 : N];
    float want[N3 > N ? N3 : N];
    const uint8_t m1[B * S] = {1, 1, 0, 0, 1, 0, 1, 1}, m3[B3 * S3] = {0, 1, 1, 1, 1, 0};
    const uint8_t *masks[3] = {m1, NULL, m3};
    const size_t bs[3] = {B, B, B3}, ss[3] = {S, S, S3};
    for (int i = 0; i < 3; i++) {
        fill(x[i], bs[i] * ss[i] * DIM);
        fill(g[i], bs[i] * ss[i] * DIM);
        for (size_t j = 0; j < bs[i] * ss[i] * DIM; j++) {
            x[i][j] *= 1.0f + 0.3f * (float)i;
            g[i][j] = -g[i][j] * (float)(i + 1);
        }
    }
    /* Forward, masked, alone. */
    size_t len;
    call c;
    uint8_t *b = enc_mask("enc.0", x[0], m1, NULL, B, S, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), 0);
    free(b);
    float y[N];
    cr_assert_eq(hm_moe_decode_out_seq(c.body, c.len, 0, B, S, DIM, y), 0);
    free(c.body);
    cr_assert_eq(hm_xf_forward_mask(local, x[0], m1, B, S, want), 0);
    assert_close(y, want, N, "masked forward");

    /* Three backward requests in one batch. */
    call cs[3];
    uint8_t *bodies[3];
    for (int i = 0; i < 3; i++) {
        bodies[i] = enc_mask("enc.0", x[i], masks[i], g[i], bs[i], ss[i], &len);
        call_start(&f, HM_MOE_METHOD_BWD, bodies[i], len, &cs[i]);
    }
    const size_t np = hm_xf_nparams(local);
    float *gsum = calloc(np, sizeof(float)), *gp = calloc(np, sizeof(float));
    cr_assert(gsum != NULL && gp != NULL);
    for (int i = 0; i < 3; i++) {
        cr_assert(hm_test_run_until(&f.loop, call_done, &cs[i], 12000));
        free(bodies[i]);
        cr_assert_eq(cs[i].status, 0, "request %d", i);
        cr_assert_eq(hm_moe_decode_out_seq(cs[i].body, cs[i].len, 1, bs[i], ss[i], DIM, gx[i]),
                     0);
        free(cs[i].body);
        cr_assert_eq(hm_xf_grad_mask(local, x[i], masks[i], g[i], bs[i], ss[i], want, gp), 0);
        assert_close(gx[i], want, bs[i] * ss[i] * DIM, "dL/dx");
        for (size_t p = 0; p < np; p++)
            gsum[p] += gp[p];
    }
    hm_moe_hosted h[4];
    cr_assert_eq(hm_moe_server_list(f.srv, h, 4), 2u);
    const hm_moe_hosted *he = strcmp(h[0].uid, "enc.0") == 0 ? &h[0] : &h[1];
    cr_assert_eq(he->steps, 1u, "three requests in one batch are one step");
    cr_assert_eq(hm_xf_apply(local, gsum), 0);
    cr_assert_eq(hm_moe_server_checkpoint(f.srv), 0);
    hm_xf *after = xf_file_copy(&f, "enc.0");
    for (size_t p = 0; p < np; p++)
        cr_assert(fabsf(*hm_xf_param(after, p) - *hm_xf_param(local, p)) <= 1e-6f,
                  "parameter %zu after the step", p);
    hm_xf_free(after);
    free(gsum);
    free(gp);

    /* A sequence to an ffn is refused, masked or not. */
    b = enc_mask("plain.0", x[0], m1, NULL, B, S, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), -EPROTO);
    free(b);
    free(c.body);
    /* A mask byte that is not 0 or 1, or a sequence with every key padded:
     * malformed, said so, and the expert serves on. */
    const uint8_t bad2[B * S] = {1, 2, 1, 1, 1, 1, 1, 1}, empty[B * S] = {1, 1, 1, 1, 0, 0, 0, 0};
    const uint8_t *bads[2] = {bad2, empty};
    for (int i = 0; i < 2; i++) {
        hm_wire_wr w;
        hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
        hm_wire_wr_map(&w, 3);
        hm_wire_wr_cstr(&w, "uid");
        hm_wire_wr_cstr(&w, "enc.0");
        hm_wire_wr_cstr(&w, "xm");
        hm_wire_tensor t = {.dtype = HM_DTYPE_F32, .ndim = 3, .shape = {B, S, DIM},
                            .data = (const uint8_t *)x[0], .nbytes = N * sizeof(float)};
        hm_wire_wr_tensor(&w, &t);
        hm_wire_wr_cstr(&w, "mask");
        hm_wire_wr_bin(&w, bads[i], B * S);
        b = hm_wire_wr_steal(&w, &len);
        cr_assert_not_null(b);
        cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), -EINVAL);
        char why[HM_MOE_ERR_MAX + 1];
        hm_moe_decode_error(c.body, c.len, why);
        cr_assert(strstr(why, "malformed forward request") != NULL, "%s", why);
        free(b);
        free(c.body);
    }
    b = enc_mask("enc.0", x[0], m1, NULL, B, S, &len);
    cr_assert_eq(call_sync(&f, HM_MOE_METHOD_FWD, b, len, &c), 0);
    free(b);
    free(c.body);
    hm_xf_free(local);
    fx_stop(&f);
}

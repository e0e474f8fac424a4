/*
 * test_moe_daemon: experts across real hivemindd processes on 127.0.0.1,
 * called the way trainers call them: through the client library
 * (lib/hivemind.h) attached to a daemon of their own, with tensors in
 * shared memory.
 *
 *  - numerics: a remote forward equals the local computation of the same
 *    expert (its checkpoint, loaded with moe/ffn.h) within 1e-5; a remote
 *    backward returns the local dL/dx and leaves the host's parameters one
 *    SGD step further, as its next checkpoint shows; a host restarted on
 *    its state directory resumes from its checkpoint.
 *  - stragglers: of 4 experts one host is SIGSTOPped and one SIGKILLed;
 *    k_min = 2 returns within timeout_after_k_min plus slack with exactly
 *    the two live experts; k_min = 3 fails with a timeout within the
 *    forward timeout plus slack.
 *  - durability: a host SIGKILLed after a backward restarts from its
 *    periodic checkpoint and reappears in the DHT at its new address.
 *  - files: `hivemindctl experts call` reads a float32 file and writes the
 *    forward's output next to it atomically (the local result, nothing
 *    else left in the directory); a file that is not rows of the expert's
 *    dim is refused with the reason.
 *  - one node is a swarm: a daemon without peers finds and calls its own
 *    experts and reads its own DHT records; a call of the wrong width or
 *    to an unknown uid fails at once with the server's reason and code.
 *  - a thousand experts on four hosts: all listed, beam searches exact,
 *    declarations paced under the DHT's rate limits.
 *  - stalled hosts: after one wait for a SIGSTOPped host the trainer's
 *    daemon skips it (its metrics count one stall, the rest skipped), and
 *    after SIGCONT and the back-off a probe brings it back.
 *  - per-sample routing through libhivemind: every sample's routes are its
 *    brute-force top k; routed forward and backward equal the experts'
 *    local computation per slot; a Switch call (k_best 1, k_min 0 with
 *    zero outputs) with one host stopped succeeds after
 *    timeout_after_k_min, that host's experts not answering.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <string.h>

#include "moe/checkpoint.h"
#include "moe/ffn.h"
#include "moe/transformer.h"
#include "lib/hivemind.h"
#include "tests/proc.h"

#define DIM 16
#define BATCH 5

static void setup(void) { hm_proc_setup("moed"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(moe_daemon, .init = setup, .fini = teardown, .timeout = 120);

static hmc *attach(struct node *n)
{
    hmc *h = NULL;
    char err[256] = "";
    int r = hmc_connect(n->sock, &h, err, sizeof(err));
    cr_assert_eq(r, 0, "hmc_connect %s: %s", n->sock, err);
    hmc_set_timeout(h, 20000);
    return h;
}

/* Beam search with flat scores until want experts are found (declarations
 * take a moment to spread); returns how many were found. */
static size_t find_experts(hmc *h, size_t g0, size_t g1, size_t want, hmc_expert *out,
                           int timeout_ms)
{
    double scores[64];
    size_t sizes[2] = {g0, g1}, n = 0;
    for (size_t i = 0; i < g0 + g1; i++)
        scores[i] = 0.01 * (double)i; /* a fixed preference: later coordinates first */
    long deadline = hm_test_now_ms() + timeout_ms;
    do {
        n = 0;
        int r = hmc_experts_find(h, "ffn", scores, sizes, 2, want, 5.0, out, want, &n, NULL);
        if (r == 0 && n >= want)
            return n;
        usleep(300000);
    } while (hm_test_now_ms() < deadline);
    return n;
}

static hm_ffn *load_expert(const char *dir, const char *uid)
{
    char path[512];
    uint8_t *buf = NULL;
    size_t len = 0;
    hm_ffn *f = NULL;
    snprintf(path, sizeof(path), "%s/experts/%s.ckpt", dir, uid);
    int r = hm_ckpt_read(path, (size_t)1 << 30, &buf, &len, NULL);
    cr_assert_eq(r, 0, "reading %s: %d", path, r);
    r = hm_ffn_load(buf, len, NULL, &f);
    free(buf);
    cr_assert_eq(r, 0, "loading %s: %d", path, r);
    return f;
}

static void fill(float *x, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        x[i] = (float)((seed >> 8) & 0xffff) / 65536.0f - 0.5f;
    }
}

static double rel_err(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static json_t *hosted_entry(struct node *n, const char *uid)
{
    char *argv[] = {bin_ctl, "-s", n->sock, "--json", "experts", "list", NULL};
    char *out, *err;
    int rc = run_prog(bin_ctl, argv, &out, &err);
    cr_assert_eq(rc, 0, "experts list: %s", err);
    json_t *j = json_loads(out, 0, NULL);
    free(out);
    free(err);
    cr_assert_not_null(j);
    json_t *hosted = json_object_get(json_object_get(j, "result"), "hosted"), *e, *found = NULL;
    size_t i;
    json_array_foreach(hosted, i, e)
    {
        if (strcmp(json_string_value(json_object_get(e, "uid")), uid) == 0)
            found = json_incref(e);
    }
    json_decref(j);
    cr_assert_not_null(found, "%s is not hosted", uid);
    return found;
}

Test(moe_daemon, remote_equals_local_and_resumes)
{
    struct node host, tr;
    const char *sgd[] = {"--host-experts", "ffn.0.[0:2]", "--expert-dim", "16",
                         "--expert-optimizer", "sgd", "--expert-lr", "0.1"};

    /* A first life only writes the initial checkpoints (on SIGTERM). */
    start_node(&host, "host", NULL, sgd[0], sgd[1], sgd[2], sgd[3], sgd[4], sgd[5], sgd[6], sgd[7],
               NULL);
    stop_node(&host);
    hm_ffn *p0 = load_expert(host.dir, "ffn.0.1");
    cr_assert_eq(hm_ffn_dim(p0), DIM);

    start_node(&host, "host", NULL, sgd[0], sgd[1], sgd[2], sgd[3], sgd[4], sgd[5], sgd[6], sgd[7],
               NULL);
    json_t *e = hosted_entry(&host, "ffn.0.1");
    cr_assert(json_is_true(json_object_get(e, "resumed")), "the restarted host did not resume");
    json_decref(e);
    start_node(&tr, "trainer", NULL, "--initial-peers", host.addr, NULL);

    hmc *h = attach(&tr);
    hmc_expert ex[2];
    size_t n = find_experts(h, 1, 2, 2, ex, 20000);
    cr_assert_eq(n, 2, "beam search found %zu of 2 experts", n);
    /* Scores prefer coordinate 1 of the second dimension. */
    cr_assert_str_eq(ex[0].uid, "ffn.0.1");
    cr_assert(strstr(ex[0].peer, host.id) == ex[0].peer, "expert declared by %s", ex[0].peer);

    hmc_buf *xb, *yb, *gyb, *gxb;
    size_t bd = BATCH * DIM;
    cr_assert_eq(hmc_buf_alloc(h, bd * sizeof(float), &xb), 0, "%s", hmc_last_error(h));
    cr_assert_eq(hmc_buf_alloc(h, bd * sizeof(float), &yb), 0, "%s", hmc_last_error(h));
    cr_assert_eq(hmc_buf_alloc(h, bd * sizeof(float), &gyb), 0, "%s", hmc_last_error(h));
    cr_assert_eq(hmc_buf_alloc(h, bd * sizeof(float), &gxb), 0, "%s", hmc_last_error(h));
    float *x = hmc_buf_data(xb), *y = hmc_buf_data(yb), *gy = hmc_buf_data(gyb),
          *gx = hmc_buf_data(gxb);
    fill(x, bd, 7);
    fill(gy, bd, 11);

    int answered[1];
    size_t n_ans = 0;
    int r = hmc_experts_forward(h, ex, 1, xb, 0, yb, 0, BATCH, DIM, 1, 10.0, 1.0, answered,
                                &n_ans);
    cr_assert_eq(r, 0, "forward: %s", hmc_last_error(h));
    cr_assert_eq(n_ans, 1);
    float want[BATCH * DIM], want_gx[BATCH * DIM];
    cr_assert_eq(hm_ffn_forward(p0, x, BATCH, want), 0);
    double err = rel_err(y, want, bd);
    cr_assert(err <= 1e-5, "remote forward differs from local by %g", err);

    r = hmc_experts_backward(h, ex, 1, xb, 0, gyb, 0, gxb, 0, BATCH, DIM, 1, 10.0, answered,
                             &n_ans);
    cr_assert_eq(r, 0, "backward: %s", hmc_last_error(h));
    size_t np = hm_ffn_nparams(p0);
    float *gp = calloc(np, sizeof(float));
    cr_assert_not_null(gp);
    cr_assert_eq(hm_ffn_grad(p0, x, gy, BATCH, want_gx, gp), 0);
    err = rel_err(gx, want_gx, bd);
    cr_assert(err <= 1e-5, "remote dL/dx differs from local by %g", err);

    hmc_buf_free(xb);
    hmc_buf_free(yb);
    hmc_buf_free(gyb);
    hmc_buf_free(gxb);
    hmc_close(h);

    /* The host's parameters took exactly one SGD step with that gradient. */
    stop_node(&host);
    hm_ffn *p1 = load_expert(host.dir, "ffn.0.1");
    cr_assert_eq(hm_ffn_steps(p1), 1);
    const float *a = hm_ffn_params(p0), *b = hm_ffn_params(p1);
    double worst = 0;
    for (size_t i = 0; i < np; i++)
        worst = fmax(worst, fabs((double)b[i] - ((double)a[i] - 0.1 * gp[i])));
    cr_assert(worst <= 1e-5, "parameters after the backward are off by %g", worst);
    free(gp);
    hm_ffn_free(p0);
    hm_ffn_free(p1);
    stop_node(&tr);
}

Test(moe_daemon, stragglers_and_k_min)
{
    struct node hosts[4], tr;
    char pat[32], name[16];
    start_node(&tr, "trainer", NULL, NULL);
    for (int i = 0; i < 4; i++) {
        snprintf(pat, sizeof(pat), "ffn.0.%d", i);
        snprintf(name, sizeof(name), "h%d", i);
        start_node(&hosts[i], name, NULL, "--host-experts", pat, "--expert-dim", "16",
                   "--initial-peers", tr.addr, NULL);
    }
    hmc *h = attach(&tr);
    hmc_expert ex[4];
    size_t n = find_experts(h, 1, 4, 4, ex, 20000);
    cr_assert_eq(n, 4, "beam search found %zu of 4 experts", n);

    /* h2 stalls, h3 dies. */
    cr_assert_eq(kill(hosts[2].pid, SIGSTOP), 0);
    cr_assert_eq(kill(hosts[3].pid, SIGKILL), 0);
    waitpid(hosts[3].pid, NULL, 0);
    forget_child(hosts[3].pid);

    hmc_buf *xb, *yb;
    size_t bd = BATCH * DIM;
    cr_assert_eq(hmc_buf_alloc(h, bd * sizeof(float), &xb), 0);
    cr_assert_eq(hmc_buf_alloc(h, 4 * bd * sizeof(float), &yb), 0);
    fill(hmc_buf_data(xb), bd, 3);

    int answered[4];
    size_t n_ans = 0;
    long t0 = hm_test_now_ms();
    int r = hmc_experts_forward(h, ex, 4, xb, 0, yb, 0, BATCH, DIM, 2, 5.0, 0.5, answered,
                                &n_ans);
    long took = hm_test_now_ms() - t0;
    cr_assert_eq(r, 0, "k_min 2: %s", hmc_last_error(h));
    cr_assert_eq(n_ans, 2);
    for (int i = 0; i < 4; i++) {
        int live = strstr(ex[i].peer, hosts[0].id) == ex[i].peer ||
                   strstr(ex[i].peer, hosts[1].id) == ex[i].peer;
        cr_assert_eq(answered[i] != 0, live, "%s answered=%d", ex[i].uid, answered[i]);
    }
    cr_assert(took <= 500 + 2000, "k_min 2 took %ld ms (timeout_after_k_min 0.5 s)", took);

    t0 = hm_test_now_ms();
    r = hmc_experts_forward(h, ex, 4, xb, 0, yb, 0, BATCH, DIM, 3, 5.0, 0.5, answered, &n_ans);
    took = hm_test_now_ms() - t0;
    cr_assert_eq(r, -EREMOTEIO, "k_min 3 should fail, got %d", r);
    cr_assert_str_eq(hmc_last_error_code(h), "timeout");
    cr_assert(strstr(hmc_last_error(h), "2 of 4") != NULL, "message: %s", hmc_last_error(h));
    cr_assert(took >= 4500 && took <= 5000 + 2500, "k_min 3 failed after %ld ms (timeout 5 s)",
              took);

    hmc_buf_free(xb);
    hmc_buf_free(yb);
    hmc_close(h);
    kill(hosts[2].pid, SIGCONT);
}

Test(moe_daemon, restart_after_sigkill_resumes)
{
    struct node host, tr;
    start_node(&tr, "trainer", NULL, NULL);
    start_node(&host, "host", NULL, "--host-experts", "ffn.0.0", "--expert-dim", "16",
               "--checkpoint-interval", "1", "--initial-peers", tr.addr, NULL);
    hmc *h = attach(&tr);
    hmc_expert ex[1];
    cr_assert_eq(find_experts(h, 1, 1, 1, ex, 20000), 1);

    hmc_buf *xb, *gyb, *gxb;
    size_t bd = BATCH * DIM;
    cr_assert_eq(hmc_buf_alloc(h, bd * sizeof(float), &xb), 0);
    cr_assert_eq(hmc_buf_alloc(h, bd * sizeof(float), &gyb), 0);
    cr_assert_eq(hmc_buf_alloc(h, bd * sizeof(float), &gxb), 0);
    fill(hmc_buf_data(xb), bd, 5);
    fill(hmc_buf_data(gyb), bd, 9);
    int answered[1];
    size_t n_ans;
    cr_assert_eq(hmc_experts_backward(h, ex, 1, xb, 0, gyb, 0, gxb, 0, BATCH, DIM, 1, 10.0,
                                      answered, &n_ans),
                 0, "backward: %s", hmc_last_error(h));

    /* Let the periodic checkpoint (every second) catch the step, then kill. */
    json_t *e = NULL;
    long deadline = hm_test_now_ms() + 10000;
    do {
        usleep(300000);
        json_decref(e);
        e = hosted_entry(&host, "ffn.0.0");
    } while (json_number_value(json_object_get(e, "last_checkpoint")) <= 0 &&
             hm_test_now_ms() < deadline);
    usleep(1500000);
    json_decref(e);
    char old_addr[256];
    snprintf(old_addr, sizeof(old_addr), "%s", host.addr);
    cr_assert_eq(kill(host.pid, SIGKILL), 0);
    waitpid(host.pid, NULL, 0);
    forget_child(host.pid);

    start_node(&host, "host", NULL, "--host-experts", "ffn.0.0", "--expert-dim", "16",
               "--checkpoint-interval", "1", "--initial-peers", tr.addr, NULL);
    cr_assert_str_neq(host.addr, old_addr, "the restarted host should listen on a new port");
    e = hosted_entry(&host, "ffn.0.0");
    cr_assert(json_is_true(json_object_get(e, "resumed")));
    cr_assert_eq(json_integer_value(json_object_get(e, "steps")), 1,
                 "resumed with %lld steps", (long long)json_integer_value(json_object_get(e, "steps")));
    json_decref(e);

    /* The trainer finds it at its new address and can call it. */
    int moved = 0;
    deadline = hm_test_now_ms() + 30000;
    while (!moved && hm_test_now_ms() < deadline) {
        if (find_experts(h, 1, 1, 1, ex, 1000) == 1 && strcmp(ex[0].peer, host.addr) == 0)
            moved = 1;
        else
            usleep(500000);
    }
    cr_assert(moved, "the DHT still points at %s", ex[0].peer);
    hmc_buf *yb;
    cr_assert_eq(hmc_buf_alloc(h, bd * sizeof(float), &yb), 0);
    cr_assert_eq(hmc_experts_forward(h, ex, 1, xb, 0, yb, 0, BATCH, DIM, 1, 10.0, 1.0, answered,
                                     &n_ans),
                 0, "forward after the restart: %s", hmc_last_error(h));
    hmc_buf_free(xb);
    hmc_buf_free(yb);
    hmc_buf_free(gyb);
    hmc_buf_free(gxb);
    hmc_close(h);
}

Test(moe_daemon, bad_arguments_are_answered_once_and_survived)
{
    struct node n;
    start_node(&n, "solo", NULL, "--host-experts", "ffn.0.0", "--expert-dim", "16", NULL);
    hmc *h = attach(&n);
    /* Requests with two bad or missing arguments each: exactly one error
     * reply, and the daemon goes on serving the same connection. */
    static const char *const bad[][2] = {
        {"experts.find", "{\"prefix\":\"ffn\",\"scores\":[[1]],\"beam_size\":-1}"},
        {"experts.host", "{\"pattern\":\"ffn.5\",\"dim\":0,\"hidden\":-1}"},
        {"experts.forward", "{\"experts\":[{\"uid\":\"ffn.0.0\",\"peer\":\"x\"}],\"batch\":0}"},
        {"experts.forward", "{\"batch\":0,\"dim\":-1}"},
        {"experts.backward", "{\"k_min\":5,\"timeout\":-1}"},
        {"experts.call", "{\"uid\":\"ffn.0.0\",\"in\":\"rel\",\"out\":\"rel\",\"timeout\":-1}"},
        {"experts.list", "{\"prefix\":\"a.b\",\"timeout\":0}"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int r = hmc_request(h, bad[i][0], bad[i][1], NULL);
        cr_assert_eq(r, -EREMOTEIO, "%s %s: %d %s", bad[i][0], bad[i][1], r, hmc_last_error(h));
        cr_assert_str_eq(hmc_last_error_code(h), "bad_args", "%s", hmc_last_error(h));
        char *info = NULL;
        cr_assert_eq(hmc_info(h, &info), 0, "after %s: %s", bad[i][0], hmc_last_error(h));
        hmc_free_string(info);
    }
    /* A beam wider than the search can hold is refused by its name, not
     * as a failed search. */
    int r = hmc_request(h, "experts.find",
                        "{\"prefix\":\"ffn\",\"k_best\":1,\"scores\":[[1]],\"beam_size\":300}",
                        NULL);
    cr_assert_eq(r, -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h), "bad_args");
    cr_assert_not_null(strstr(hmc_last_error(h), "beam_size"), "%s", hmc_last_error(h));
    hmc_close(h);
    stop_node(&n);
}

/*
 * Uids as Hivemind writes them, through the daemon: hosted from the command
 * line, listed and found by their grid names (with and without the dot,
 * five dimensions), and bad ones refused with the rule they break.
 */
Test(moe_daemon, hivemind_uids_are_hosted_found_and_bad_ones_named)
{
    struct node n;
    start_node(&n, "solo", NULL, "--host-experts",
               "transformer::encoder.[0:2],\xe4\xb8\x93\xe5\xae\xb6.0.1.2.3.[0:2]",
               "--expert-dim", "16", NULL);
    hmc *h = attach(&n);
    char *res = NULL;
    int r = hmc_request(h, "experts.list", "{\"prefix\":\"transformer::encoder.\"}", &res);
    cr_assert_eq(r, 0, "%s", hmc_last_error(h));
    json_t *j = json_loads(res, 0, NULL);
    hmc_free_string(res);
    cr_assert_not_null(j);
    json_t *hosted = json_object_get(j, "hosted");
    cr_assert_eq(json_array_size(hosted), 2u);
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(hosted, 1), "uid")),
                     "transformer::encoder.1");
    json_decref(j);

    /* Five dimensions under a non-ASCII name: the one's own experts, best first. */
    long deadline = hm_test_now_ms() + 20000;
    size_t found = 0;
    do {
        r = hmc_request(h, "experts.find",
                        "{\"prefix\":\"\\u4e13\\u5bb6\",\"k_best\":2,\"scores\":[[1],[0,1],"
                        "[0,0,1],[0,0,0,1],[0.5,2]]}",
                        &res);
        cr_assert_eq(r, 0, "%s", hmc_last_error(h));
        j = json_loads(res, 0, NULL);
        hmc_free_string(res);
        found = json_array_size(json_object_get(j, "experts"));
        if (found == 2) {
            json_t *e0 = json_array_get(json_object_get(j, "experts"), 0);
            cr_assert_str_eq(json_string_value(json_object_get(e0, "uid")),
                             "\xe4\xb8\x93\xe5\xae\xb6.0.1.2.3.1");
            cr_assert_float_eq(json_number_value(json_object_get(e0, "score")), 6.0, 1e-9);
        }
        json_decref(j);
        if (found < 2)
            usleep(300000);
    } while (found < 2 && hm_test_now_ms() < deadline);
    cr_assert_eq(found, 2u);

    static const char *const bad[][3] = {
        {"experts.call", "{\"uid\":\"ffn.01\",\"in\":\"/x\",\"out\":\"/y\"}", "leading zeros"},
        {"experts.call", "{\"uid\":\"a\\tb.1\",\"in\":\"/x\",\"out\":\"/y\"}",
         "control characters"},
        {"experts.find", "{\"prefix\":\"a.b\",\"k_best\":1,\"scores\":[[1]]}", "holds a '.'"},
        {"experts.list", "{\"prefix\":\"a[owner:b]\"}", "[owner:"},
        {"experts.host", "{\"pattern\":\"g.1.2.3.4.5.6.7.8.9.10.11.12.13.14.15.16.17\"}",
         "more than 16 grid coordinates"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        r = hmc_request(h, bad[i][0], bad[i][1], NULL);
        cr_assert_eq(r, -EREMOTEIO, "%s %s: %d", bad[i][0], bad[i][1], r);
        cr_assert_str_eq(hmc_last_error_code(h), "bad_args", "%s", hmc_last_error(h));
        cr_assert_not_null(strstr(hmc_last_error(h), bad[i][2]), "%s: %s", bad[i][1],
                           hmc_last_error(h));
    }
    hmc_close(h);
    stop_node(&n);
}

/* How many entries a directory holds besides . and .. */
static size_t count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    size_t n = 0;
    cr_assert_not_null(d, "opendir %s", dir);
    while ((e = readdir(d)) != NULL)
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    return n;
}

Test(moe_daemon, call_on_files_writes_the_output_atomically)
{
    struct node host, tr;
    char files[128], in[192], outp[192], *out = NULL, *err = NULL;
    float x[BATCH * DIM], want[BATCH * DIM], y[BATCH * DIM];
    const char *fl[] = {"--host-experts", "ffn.0.[0:1]", "--expert-dim", "16"};

    /* A first life writes the checkpoint the local computation loads. */
    start_node(&host, "host", NULL, fl[0], fl[1], fl[2], fl[3], NULL);
    stop_node(&host);
    hm_ffn *p0 = load_expert(host.dir, "ffn.0.0");
    start_node(&host, "host", NULL, fl[0], fl[1], fl[2], fl[3], NULL);
    start_node(&tr, "trainer", NULL, "--initial-peers", host.addr, NULL);

    snprintf(files, sizeof(files), "%s/files", tmpdir);
    cr_assert_eq(mkdir(files, 0700), 0);
    snprintf(in, sizeof(in), "%s/x.f32", files);
    snprintf(outp, sizeof(outp), "%s/y.f32", files);
    fill(x, BATCH * DIM, 5);
    cr_assert_eq(hm_test_write_file(in, x, sizeof(x), 0600), 0);
    char *argv[] = {bin_ctl, "-s", tr.sock, "experts", "call", "ffn.0.0", "--in", in,
                    "--out", outp, "--timeout", "10", NULL};
    /* The declaration takes a moment to reach the trainer's DHT. */
    int r = -1;
    long deadline = hm_test_now_ms() + 30000;
    do {
        free(out);
        free(err);
        r = run_prog(bin_ctl, argv, &out, &err);
        if (r != 0)
            usleep(300000);
    } while (r != 0 && hm_test_now_ms() < deadline);
    cr_assert_eq(r, 0, "experts call: %s", err);
    free(out);
    free(err);

    FILE *f = fopen(outp, "rb");
    cr_assert_not_null(f);
    cr_assert_eq(fread(y, 1, sizeof(y) + 1, f), sizeof(y));
    fclose(f);
    cr_assert_eq(hm_ffn_forward(p0, x, BATCH, want), 0);
    double e = rel_err(y, want, BATCH * DIM);
    cr_assert(e <= 1e-5, "the file's forward differs from local by %g", e);
    cr_assert_eq(count_entries(files), 2, "a temporary file was left in %s", files);

    /* Not whole rows of 16: refused, and the old output stays. */
    cr_assert_eq(hm_test_write_file(in, x, 10 * sizeof(float), 0600), 0);
    cr_assert_eq(run_prog(bin_ctl, argv, &out, &err), 1);
    cr_assert(strstr(err, "rows of 16 float32") != NULL, "%s", err);
    free(out);
    free(err);
    struct stat st;
    cr_assert_eq(stat(outp, &st), 0);
    cr_assert_eq(st.st_size, (off_t)sizeof(y));
    cr_assert_eq(count_entries(files), 2);

    hm_ffn_free(p0);
    stop_node(&tr);
    stop_node(&host);
}

/*
 * A transformer expert hosted with --expert-type transformer answers
 * `hivemindctl experts call --seq` on a [batch, seq, dim] file with
 * exactly the local block of its checkpoint; without --seq, or with one
 * past its max_seq, the call is refused with the shape it takes.
 */
Test(moe_daemon, transformer_expert_call_equals_local)
{
    struct node host, tr;
    char files[128], in[192], outp[192], *out = NULL, *err = NULL;
    enum { B = 3, S = 4 };
    float x[B * S * DIM], want[B * S * DIM], y[B * S * DIM];
    const char *fl[] = {"--host-experts", "enc::layer.[0:2]", "--expert-dim", "16",
                        "--expert-type", "transformer", "--expert-heads", "4",
                        "--expert-max-seq", "6"};

    start_node(&host, "host", NULL, fl[0], fl[1], fl[2], fl[3], fl[4], fl[5], fl[6], fl[7], fl[8],
               fl[9], NULL);
    stop_node(&host);
    char path[512];
    uint8_t *buf = NULL;
    size_t len = 0;
    hm_xf *t = NULL;
    snprintf(path, sizeof(path), "%s/experts/enc%%3A%%3Alayer.1.ckpt", host.dir);
    cr_assert_eq(hm_ckpt_read(path, (size_t)1 << 30, &buf, &len, NULL), 0, "%s", path);
    cr_assert_eq(hm_xf_load(buf, len, NULL, &t), 0);
    free(buf);
    cr_assert_eq(hm_xf_config_of(t)->heads, 4u);

    start_node(&host, "host", NULL, fl[0], fl[1], fl[2], fl[3], fl[4], fl[5], fl[6], fl[7], fl[8],
               fl[9], NULL);
    json_t *e = hosted_entry(&host, "enc::layer.1");
    cr_assert_str_eq(json_string_value(json_object_get(e, "type")), "transformer");
    cr_assert_eq(json_integer_value(json_object_get(e, "max_seq")), 6);
    json_decref(e);
    start_node(&tr, "trainer", NULL, "--initial-peers", host.addr, NULL);
    snprintf(files, sizeof(files), "%s/xfiles", tmpdir);
    cr_assert_eq(mkdir(files, 0700), 0);
    snprintf(in, sizeof(in), "%s/x.f32", files);
    snprintf(outp, sizeof(outp), "%s/y.f32", files);
    fill(x, B * S * DIM, 9);
    cr_assert_eq(hm_test_write_file(in, x, sizeof(x), 0600), 0);
    char *argv[] = {bin_ctl, "-s", tr.sock, "experts", "call", "enc::layer.1", "--in", in,
                    "--out", outp, "--seq", "4", "--timeout", "10", NULL};
    int r = -1;
    long deadline = hm_test_now_ms() + 30000;
    do {
        free(out);
        free(err);
        r = run_prog(bin_ctl, argv, &out, &err);
        if (r != 0)
            usleep(300000);
    } while (r != 0 && hm_test_now_ms() < deadline);
    cr_assert_eq(r, 0, "experts call: %s", err);
    free(out);
    free(err);
    FILE *f = fopen(outp, "rb");
    cr_assert_not_null(f);
    cr_assert_eq(fread(y, 1, sizeof(y) + 1, f), sizeof(y));
    fclose(f);
    cr_assert_eq(hm_xf_forward(t, x, B, S, want), 0);
    double d = rel_err(y, want, B * S * DIM);
    cr_assert(d <= 1e-5, "the remote transformer differs from local by %g", d);

    /* Without --seq, or past max_seq: refused, naming the shape. */
    char *argv2[] = {bin_ctl, "-s", tr.sock, "experts", "call", "enc::layer.1", "--in", in,
                     "--out", outp, "--timeout", "10", NULL};
    cr_assert_eq(run_prog(bin_ctl, argv2, &out, &err), 1);
    cr_assert(strstr(err, "[batch, seq, 16]") != NULL, "%s", err);
    free(out);
    free(err);
    argv[11] = "12";
    cr_assert_eq(run_prog(bin_ctl, argv, &out, &err), 1);
    cr_assert(strstr(err, "at most 6") != NULL, "%s", err);
    free(out);
    free(err);
    hm_xf_free(t);
    stop_node(&tr);
    stop_node(&host);
}

/* A counter or gauge of n's metrics (the unlabelled line NAME VALUE), or -1. */
static double metric_value(struct node *n, const char *name)
{
    char *out = NULL, *err = NULL;
    double v = -1;
    int rc = ctl(n->sock, "metrics", 0, &out, &err);
    if (rc == 0 && out != NULL) {
        size_t len = strlen(name);
        for (char *line = out; line != NULL && *line; line = strchr(line, '\n')) {
            if (*line == '\n')
                line++;
            if (strncmp(line, name, len) == 0 && line[len] == ' ') {
                v = strtod(line + len + 1, NULL);
                break;
            }
        }
    }
    free(out);
    free(err);
    return v;
}

/*
 * One node is a swarm: a daemon with no peer at all finds the experts it
 * hosts by beam search and calls them, and `dht get` answers from its own
 * store. A call of the wrong width comes back with the server's reason and
 * code, not as a timeout.
 */
Test(moe_daemon, lone_node_finds_its_own_experts_and_records)
{
    struct node solo;
    start_node(&solo, "solo", NULL, "--host-experts", "ffn.0.[0:2]", "--expert-dim", "16", NULL);
    hmc *h = attach(&solo);
    hmc_expert ex[2];
    size_t n = find_experts(h, 1, 2, 2, ex, 20000);
    cr_assert_eq(n, 2, "a lone node found %zu of its 2 experts", n);
    cr_assert(strstr(ex[0].peer, solo.id) == ex[0].peer, "expert declared by %s", ex[0].peer);

    hmc_buf *xb, *yb;
    size_t bd = BATCH * DIM;
    cr_assert_eq(hmc_buf_alloc(h, bd * sizeof(float), &xb), 0);
    cr_assert_eq(hmc_buf_alloc(h, bd * sizeof(float), &yb), 0);
    fill(hmc_buf_data(xb), bd, 5);
    int answered[1];
    size_t n_ans = 0;
    int r = hmc_experts_forward(h, ex, 1, xb, 0, yb, 0, BATCH, DIM, 1, 10.0, 1.0, answered,
                                &n_ans);
    cr_assert_eq(r, 0, "forward on a lone node: %s", hmc_last_error(h));
    cr_assert_eq(n_ans, 1);

    /* The wrong width: the expert's own words, at once (the timeout is 30 s). */
    long t0 = hm_test_now_ms();
    r = hmc_experts_forward(h, ex, 1, xb, 0, yb, 0, 2 * BATCH, DIM / 2, 1, 30.0, 1.0, answered,
                            &n_ans);
    long took = hm_test_now_ms() - t0;
    cr_assert_eq(r, -EREMOTEIO, "a wrong width should fail, got %d", r);
    cr_assert_str_eq(hmc_last_error_code(h), "expert_wrong_shape", "code %s: %s",
                     hmc_last_error_code(h), hmc_last_error(h));
    cr_assert(strstr(hmc_last_error(h), "takes inputs of width 16, not 8") != NULL, "message: %s",
              hmc_last_error(h));
    cr_assert(strstr(hmc_last_error(h), "timed out") == NULL);
    cr_assert_lt(took, 5000, "the refusal took %ld ms", took);

    /* An unknown uid, likewise. */
    hmc_expert bogus = ex[0];
    snprintf(bogus.uid, sizeof(bogus.uid), "ffn.0.7");
    r = hmc_experts_forward(h, &bogus, 1, xb, 0, yb, 0, BATCH, DIM, 1, 30.0, 1.0, answered,
                            &n_ans);
    cr_assert_eq(r, -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h), "expert_not_found", "%s", hmc_last_error(h));
    cr_assert(strstr(hmc_last_error(h), "no expert ffn.0.7") != NULL, "message: %s",
              hmc_last_error(h));
    hmc_buf_free(xb);
    hmc_buf_free(yb);
    hmc_close(h);

    /* Its own records: put, then get from its own store. */
    char *argv_put[] = {bin_ctl, "-s", solo.sock, "dht", "put", "lone-key", "lone-value", NULL};
    char *out, *err;
    int rc = run_prog(bin_ctl, argv_put, &out, &err);
    cr_assert_eq(rc, 0, "dht put on a lone node: %s", err);
    free(out);
    free(err);
    char *argv_get[] = {bin_ctl, "-s", solo.sock, "dht", "get", "lone-key", NULL};
    rc = run_prog(bin_ctl, argv_get, &out, &err);
    cr_assert_eq(rc, 0, "dht get on a lone node: %s", err);
    cr_assert(strstr(out, "lone-value") != NULL, "dht get printed: %s", out);
    free(out);
    free(err);
    char *argv_none[] = {bin_ctl, "-s", solo.sock, "dht", "get", "never-put", NULL};
    rc = run_prog(bin_ctl, argv_none, &out, &err);
    cr_assert_eq(rc, 1);
    cr_assert(strstr(err, "not found") != NULL, "an absent key: %s", err);
    free(out);
    free(err);
    stop_node(&solo);
}

/*
 * A SIGSTOPped host costs one wait: the trainer's daemon backs it off, the
 * calls after the first do not wait for it (counted by the daemon's
 * metrics, not by the clock), `experts list` shows it, and after SIGCONT
 * and the back-off (ExpertBackoff 2) a probe finds it and it is used again.
 */
Test(moe_daemon, stopped_host_is_skipped_then_used_again)
{
    struct node hosts[2], tr;
    start_node(&tr, "trainer", NULL, "--expert-backoff", "2", NULL);
    for (int i = 0; i < 2; i++) {
        char pat[32], name[16];
        snprintf(pat, sizeof(pat), "ffn.0.%d", i);
        snprintf(name, sizeof(name), "h%d", i);
        start_node(&hosts[i], name, NULL, "--host-experts", pat, "--expert-dim", "16",
                   "--initial-peers", tr.addr, NULL);
    }
    hmc *h = attach(&tr);
    hmc_expert ex[2];
    size_t n = find_experts(h, 1, 2, 2, ex, 20000);
    cr_assert_eq(n, 2, "beam search found %zu of 2 experts", n);
    int stopped = strstr(ex[0].peer, hosts[1].id) == ex[0].peer ? 0 : 1;

    hmc_buf *xb, *yb;
    size_t bd = BATCH * DIM;
    cr_assert_eq(hmc_buf_alloc(h, bd * sizeof(float), &xb), 0);
    cr_assert_eq(hmc_buf_alloc(h, 2 * bd * sizeof(float), &yb), 0);
    fill(hmc_buf_data(xb), bd, 9);
    int answered[2];
    size_t n_ans = 0;
    int r = hmc_experts_forward(h, ex, 2, xb, 0, yb, 0, BATCH, DIM, 1, 10.0, 2.0, answered,
                                &n_ans);
    cr_assert_eq(r, 0, "%s", hmc_last_error(h));
    cr_assert_eq(n_ans, 2);
    cr_assert_eq(metric_value(&tr, "hivemindd_expert_host_stalls_total"), 0);

    cr_assert_eq(kill(hosts[1].pid, SIGSTOP), 0);
    enum { CALLS = 12 };
    for (int i = 0; i < CALLS; i++) {
        r = hmc_experts_forward(h, ex, 2, xb, 0, yb, 0, BATCH, DIM, 1, 10.0, 2.0, answered,
                                &n_ans);
        cr_assert_eq(r, 0, "call %d: %s", i, hmc_last_error(h));
        cr_assert_eq(n_ans, 1);
        cr_assert(answered[1 - stopped] && !answered[stopped]);
    }
    /* Only the first call waited for the stopped host; the others skipped it. */
    cr_assert_eq(metric_value(&tr, "hivemindd_expert_host_stalls_total"), 1);
    cr_assert_eq(metric_value(&tr, "hivemindd_expert_calls_skipped_total"), CALLS - 1);
    cr_assert_eq(metric_value(&tr, "hivemindd_expert_hosts_backed_off"), 1);
    int rc;
    json_t *j = ctl_json(&tr, &rc, "experts", "list", "ffn", NULL);
    cr_assert_not_null(j);
    json_t *off = json_object_get(json_object_get(j, "result"), "backed_off");
    cr_assert_eq(json_array_size(off), 1, "experts list shows %zu hosts backed off",
                 json_array_size(off));
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(off, 0), "peer_id")),
                     hosts[1].id);
    json_decref(j);

    /* Back: after the back-off, a probe finds it and calls use it again. */
    cr_assert_eq(kill(hosts[1].pid, SIGCONT), 0);
    usleep(2500000);
    int both = 0;
    for (int i = 0; i < 5 && !both; i++) {
        r = hmc_experts_forward(h, ex, 2, xb, 0, yb, 0, BATCH, DIM, 1, 10.0, 2.0, answered,
                                &n_ans);
        cr_assert_eq(r, 0, "%s", hmc_last_error(h));
        both = n_ans == 2;
    }
    cr_assert(both, "the host was not used again after SIGCONT");
    cr_assert_eq(metric_value(&tr, "hivemindd_expert_host_recoveries_total"), 1);
    cr_assert_eq(metric_value(&tr, "hivemindd_expert_hosts_backed_off"), 0);
    hmc_buf_free(xb);
    hmc_buf_free(yb);
    hmc_close(h);
}

/*
 * A thousand experts: four hosts declare 250 each (grid ffn 40 x 25); the
 * trainer's listing shows all 1,000, and 25 beam searches with random gate
 * scores return the true top 4 (brute force over the grid), best first,
 * also after the hosts' declarations were refreshed. The declarations are
 * paced, so no DHT rate limiter of the swarm refuses a single request of
 * theirs (unpaced, each refresh of 510 records per host cost a few dozen).
 */
Test(moe_daemon, a_thousand_experts, .timeout = 240)
{
    enum { G0 = 40, G1 = 25, HOSTS = 4 };
    struct node hosts[HOSTS], tr;
    start_node(&tr, "trainer", NULL, NULL);
    for (int i = 0; i < HOSTS; i++) {
        char pat[48], name[16];
        snprintf(pat, sizeof(pat), "ffn.[%d:%d].[0:%d]", i * G0 / HOSTS, (i + 1) * G0 / HOSTS,
                 G1);
        snprintf(name, sizeof(name), "h%d", i);
        start_node(&hosts[i], name, NULL, "--host-experts", pat, "--expert-dim", "16",
                   "--expert-hidden", "16", "--checkpoint-interval", "3600", "--initial-peers",
                   tr.addr, NULL);
    }
    /* The listing walks the grid's prefix records: every expert, once. */
    size_t listed = 0;
    long deadline = hm_test_now_ms() + 90000;
    while (hm_test_now_ms() < deadline) {
        int rc;
        json_t *j = ctl_json(&tr, &rc, "experts", "list", "ffn", NULL);
        listed = json_array_size(json_object_get(json_object_get(j, "result"), "swarm"));
        json_decref(j);
        if (listed >= G0 * G1)
            break;
        usleep(1000000);
    }
    cr_assert_eq(listed, G0 * G1, "the listing shows %zu of %d experts", listed, G0 * G1);

    hmc *h = attach(&tr);
    unsigned seed = 12345;
    for (int round = 0; round < 2; round++) {
        for (int q = 0; q < 25; q++) {
            double scores[G0 + G1];
            for (size_t i = 0; i < G0 + G1; i++) {
                seed = seed * 1103515245u + 12345u;
                scores[i] = (double)((seed >> 8) & 0xffff) / 65536.0;
            }
            /* The true top 4 of s0[i] + s1[j] over the full grid. */
            int best[4][2];
            double bs[4] = {-1, -1, -1, -1};
            for (int i = 0; i < G0; i++)
                for (int jj = 0; jj < G1; jj++) {
                    double s = scores[i] + scores[G0 + jj];
                    int p = 4;
                    while (p > 0 && s > bs[p - 1])
                        p--;
                    if (p >= 4)
                        continue;
                    for (int m = 3; m > p; m--) {
                        bs[m] = bs[m - 1];
                        best[m][0] = best[m - 1][0];
                        best[m][1] = best[m - 1][1];
                    }
                    bs[p] = s;
                    best[p][0] = i;
                    best[p][1] = jj;
                }
            size_t sizes[2] = {G0, G1}, n = 0;
            hmc_expert ex[4];
            int r = hmc_experts_find(h, "ffn", scores, sizes, 2, 4, 10.0, ex, 4, &n, NULL);
            cr_assert_eq(r, 0, "search %d: %s", q, hmc_last_error(h));
            cr_assert_eq(n, 4, "search %d found %zu experts", q, n);
            for (int m = 0; m < 4; m++) {
                char want[32];
                snprintf(want, sizeof(want), "ffn.%d.%d", best[m][0], best[m][1]);
                cr_assert_str_eq(ex[m].uid, want, "search %d (round %d), place %d: %s want %s", q, round, m, ex[m].uid, want);
            }
        }
        /* Again after the declarations' refresh (a third of their 60 s TTL). */
        if (round == 0)
            usleep(22000000);
    }
    hmc_close(h);
    for (int i = 0; i < HOSTS; i++) {
        double refused =
            metric_value(&hosts[i], "hivemindd_limit_refused_total{limit=\"DhtRequestRate\"}");
        cr_assert_eq(refused, 0, "host %d's rate limiter refused %g requests", i, refused);
    }
    double refused = metric_value(&tr, "hivemindd_limit_refused_total{limit=\"DhtRequestRate\"}");
    cr_assert_eq(refused, 0, "the trainer's rate limiter refused %g requests", refused);
}

/* The uid ffn.I.J's coordinates. */
static void uid_coords(const char *uid, int *i, int *j)
{
    cr_assert_eq(sscanf(uid, "ffn.%d.%d", i, j), 2, "%s", uid);
}

Test(moe_daemon, routed_per_sample_through_the_library_and_zero_outputs)
{
    struct node a, b, tr;
    const char *opt[] = {"--expert-dim", "16", "--expert-optimizer", "sgd", "--expert-lr",
                         "1e-30"};
    /* First lives write the initial checkpoints (on SIGTERM); SGD at 1e-30
     * leaves the experts as they are, so those checkpoints stay exact. */
    start_node(&a, "a", NULL, "--host-experts", "ffn.0.[0:3]", opt[0], opt[1], opt[2], opt[3],
               opt[4], opt[5], NULL);
    start_node(&b, "b", NULL, "--host-experts", "ffn.1.[0:3]", opt[0], opt[1], opt[2], opt[3],
               opt[4], opt[5], NULL);
    stop_node(&a);
    stop_node(&b);
    hm_ffn *local[2][3];
    char uid[32];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++) {
            snprintf(uid, sizeof(uid), "ffn.%d.%d", i, j);
            local[i][j] = load_expert(i == 0 ? a.dir : b.dir, uid);
        }
    start_node(&tr, "trainer", NULL, NULL);
    start_node(&a, "a", NULL, "--host-experts", "ffn.0.[0:3]", opt[0], opt[1], opt[2], opt[3],
               opt[4], opt[5], "--initial-peers", tr.addr, NULL);
    start_node(&b, "b", NULL, "--host-experts", "ffn.1.[0:3]", opt[0], opt[1], opt[2], opt[3],
               opt[4], opt[5], "--initial-peers", tr.addr, NULL);
    hmc *h = attach(&tr);
    hmc_expert all[6];
    cr_assert_eq(find_experts(h, 2, 3, 6, all, 30000), 6, "not every expert is declared");

    enum { B = 8, K = 2, S = 5 };
    hmc_buf *sb, *rb, *xb, *yb, *gyb, *gxb;
    cr_assert_eq(hmc_buf_alloc(h, B * S * sizeof(float), &sb), 0);
    cr_assert_eq(hmc_buf_alloc(h, B * K * sizeof(int32_t), &rb), 0);
    cr_assert_eq(hmc_buf_alloc(h, B * DIM * sizeof(float), &xb), 0);
    cr_assert_eq(hmc_buf_alloc(h, B * K * DIM * sizeof(float), &yb), 0);
    cr_assert_eq(hmc_buf_alloc(h, B * K * DIM * sizeof(float), &gyb), 0);
    cr_assert_eq(hmc_buf_alloc(h, B * K * DIM * sizeof(float), &gxb), 0);
    float *sc = hmc_buf_data(sb), *x = hmc_buf_data(xb), *y = hmc_buf_data(yb),
          *gy = hmc_buf_data(gyb), *gx = hmc_buf_data(gxb);
    int32_t *routes = hmc_buf_data(rb);
    fill(sc, B * S, 5);
    for (size_t i = 0; i < B * S; i++)
        sc[i] *= 8.0f;
    fill(x, B * DIM, 6);
    fill(gy, B * K * DIM, 7);

    /* Every sample's own top 2 of the 2 x 3 grid, brute force. */
    size_t grid[2] = {2, 3}, n = 0;
    hmc_expert ex[16];
    int r = hmc_experts_route(h, "ffn", grid, 2, sb, 0, B, K, 3, 10.0, rb, 0, ex, 16, &n, NULL);
    cr_assert_eq(r, 0, "route: %s", hmc_last_error(h));
    cr_assert_gt(n, (size_t)K, "the samples were all routed to the same %zu experts", n);
    for (size_t s = 0; s < B; s++) {
        int used[6] = {0};
        for (size_t k = 0; k < K; k++) {
            int best = -1;
            double bs = -INFINITY;
            for (int c = 0; c < 6; c++) {
                double v = (double)sc[s * S + c / 3] + (double)sc[s * S + 2 + c % 3];
                if (!used[c] && v > bs) {
                    bs = v;
                    best = c;
                }
            }
            used[best] = 1;
            snprintf(uid, sizeof(uid), "ffn.%d.%d", best / 3, best % 3);
            cr_assert_geq(routes[s * K + k], 0);
            cr_assert_str_eq(ex[routes[s * K + k]].uid, uid, "sample %zu rank %zu", s, k);
        }
    }

    /* Forward and backward: slot j of sample b is its expert on x[b]. */
    int answered[16];
    size_t n_ans = 0;
    r = hmc_experts_forward_routed(h, ex, n, rb, 0, K, xb, 0, yb, 0, B, DIM, K, 0, 10.0, 1.0,
                                   answered, &n_ans);
    cr_assert_eq(r, 0, "forward: %s", hmc_last_error(h));
    cr_assert_eq(n_ans, n);
    r = hmc_experts_backward_routed(h, ex, n, rb, 0, K, xb, 0, gyb, 0, gxb, 0, B, DIM, K, 0, 10.0,
                                    answered, &n_ans);
    cr_assert_eq(r, 0, "backward: %s", hmc_last_error(h));
    for (size_t s = 0; s < B; s++)
        for (size_t k = 0; k < K; k++) {
            int i, j;
            uid_coords(ex[routes[s * K + k]].uid, &i, &j);
            float ly[DIM], lgx[DIM];
            cr_assert_eq(hm_ffn_forward(local[i][j], x + s * DIM, 1, ly), 0);
            cr_assert_eq(hm_ffn_grad(local[i][j], x + s * DIM, gy + (s * K + k) * DIM, 1, lgx,
                                     NULL),
                         0);
            double e1 = rel_err(y + (s * K + k) * DIM, ly, DIM);
            double e2 = rel_err(gx + (s * K + k) * DIM, lgx, DIM);
            cr_assert(e1 <= 1e-5 && e2 <= 1e-5, "sample %zu slot %zu: %g %g", s, k, e1, e2);
        }

    /*
     * A Switch layer's call: k_best 1, host b stopped. Without zero outputs
     * k_min 0 is refused here; with them the call succeeds after
     * timeout_after_k_min, b's experts not answering.
     */
    r = hmc_experts_route(h, "ffn", grid, 2, sb, 0, B, 1, 3, 10.0, rb, 0, ex, 16, &n, NULL);
    cr_assert_eq(r, 0, "route: %s", hmc_last_error(h));
    int on_b = 0, on_a = 0;
    for (size_t s = 0; s < B; s++) {
        int i, j;
        uid_coords(ex[routes[s]].uid, &i, &j);
        on_b += i == 1;
        on_a += i == 0;
    }
    cr_assert(on_a > 0 && on_b > 0, "samples on a %d, on b %d", on_a, on_b);
    cr_assert_eq(kill(b.pid, SIGSTOP), 0);
    r = hmc_experts_forward_routed(h, ex, n, rb, 0, 1, xb, 0, yb, 0, B, DIM, 0, 0, 10.0, 0.5,
                                   answered, &n_ans);
    cr_assert_eq(r, -EINVAL);
    long t0 = hm_test_now_ms();
    r = hmc_experts_forward_routed(h, ex, n, rb, 0, 1, xb, 0, yb, 0, B, DIM, 0, 1, 10.0, 0.5,
                                   answered, &n_ans);
    long took = hm_test_now_ms() - t0;
    cr_assert_eq(r, 0, "zero outputs: %s", hmc_last_error(h));
    cr_assert(took < 500 + 3000, "took %ld ms (timeout_after_k_min 0.5 s)", took);
    for (size_t e = 0; e < n; e++) {
        int i, j;
        uid_coords(ex[e].uid, &i, &j);
        cr_assert_eq(answered[e] != 0, i == 0, "%s answered=%d", ex[e].uid, answered[e]);
    }
    kill(b.pid, SIGCONT);

    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++)
            hm_ffn_free(local[i][j]);
    hmc_buf_free(sb);
    hmc_buf_free(rb);
    hmc_buf_free(xb);
    hmc_buf_free(yb);
    hmc_buf_free(gyb);
    hmc_buf_free(gxb);
    hmc_close(h);
}

/*
 * libhivemind's calls over sequences: a transformer expert found by beam
 * search answers hmc_experts_forward_seq and hmc_experts_backward_seq on
 * [batch, seq, dim] with exactly what its checkpoint computes locally,
 * with and without a key-padding mask, and its backward steps it as the
 * local copy steps; shapes it does not take come back with its code and
 * reason, and a bad mask is the caller's error.
 */
Test(moe_daemon, transformer_seq_calls_from_libhivemind_equal_local)
{
    struct node host, tr;
    enum { B = 3, S = 5 };
    const char *fl[] = {"--host-experts", "ffn.0.[0:2]", "--expert-dim", "16",
                        "--expert-type", "transformer", "--expert-heads", "4",
                        "--expert-max-seq", "6", "--expert-optimizer", "sgd",
                        "--expert-lr", "0.1"};

    start_node(&host, "host", NULL, fl[0], fl[1], fl[2], fl[3], fl[4], fl[5], fl[6], fl[7], fl[8],
               fl[9], fl[10], fl[11], fl[12], fl[13], NULL);
    stop_node(&host);
    char path[512];
    uint8_t *buf = NULL;
    size_t len = 0;
    hm_xf *t = NULL;
    snprintf(path, sizeof(path), "%s/experts/ffn.0.1.ckpt", host.dir);
    cr_assert_eq(hm_ckpt_read(path, (size_t)1 << 30, &buf, &len, NULL), 0, "%s", path);
    cr_assert_eq(hm_xf_load(buf, len, NULL, &t), 0);
    free(buf);

    start_node(&host, "host", NULL, fl[0], fl[1], fl[2], fl[3], fl[4], fl[5], fl[6], fl[7], fl[8],
               fl[9], fl[10], fl[11], fl[12], fl[13], NULL);
    start_node(&tr, "trainer", NULL, "--initial-peers", host.addr, NULL);
    hmc *h = attach(&tr);
    hmc_expert ex[2];
    size_t n = find_experts(h, 1, 2, 2, ex, 20000);
    cr_assert_eq(n, 2, "beam search found %zu of 2 experts", n);
    cr_assert_str_eq(ex[0].uid, "ffn.0.1");

    const size_t nx = B * S * DIM;
    hmc_buf *xb, *yb, *gyb, *gxb, *mb;
    cr_assert_eq(hmc_buf_alloc(h, nx * sizeof(float), &xb), 0);
    cr_assert_eq(hmc_buf_alloc(h, nx * sizeof(float), &yb), 0);
    cr_assert_eq(hmc_buf_alloc(h, nx * sizeof(float), &gyb), 0);
    cr_assert_eq(hmc_buf_alloc(h, nx * sizeof(float), &gxb), 0);
    cr_assert_eq(hmc_buf_alloc(h, B * S * sizeof(float), &mb), 0);
    float *x = hmc_buf_data(xb), *y = hmc_buf_data(yb), *gy = hmc_buf_data(gyb),
          *gx = hmc_buf_data(gxb), *mf = hmc_buf_data(mb);
    /* Sample 0 whole, sample 1 padded at its tail, sample 2 at its head. */
    const uint8_t mask[B * S] = {1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1};
    for (size_t i = 0; i < B * S; i++)
        mf[i] = mask[i];
    fill(x, nx, 21);
    fill(gy, nx, 22);
    float want[B * S * DIM], want_gx[B * S * DIM];
    int answered[1];
    size_t n_ans = 0;

    for (int masked = 0; masked <= 1; masked++) {
        const uint8_t *m = masked ? mask : NULL;
        int r = hmc_experts_forward_seq(h, ex, 1, xb, 0, masked ? mb : NULL, 0, yb, 0, B, S, DIM,
                                        1, 10.0, 1.0, answered, &n_ans);
        cr_assert_eq(r, 0, "forward (mask %d): %s", masked, hmc_last_error(h));
        cr_assert_eq(n_ans, 1);
        cr_assert_eq(hm_xf_forward_mask(t, x, m, B, S, want), 0);
        double d = rel_err(y, want, nx);
        cr_assert(d <= 1e-5, "remote forward (mask %d) differs from local by %g", masked, d);
    }
    /* The mask matters: unmasked outputs of the padded samples differ. */
    float nomask[B * S * DIM];
    cr_assert_eq(hm_xf_forward(t, x, B, S, nomask), 0);
    cr_assert(rel_err(want + S * DIM, nomask + S * DIM, S * DIM) > 1e-3);

    /* Backward steps the expert: the local copy takes the same step. */
    for (int masked = 1; masked >= 0; masked--) {
        const uint8_t *m = masked ? mask : NULL;
        int r = hmc_experts_backward_seq(h, ex, 1, xb, 0, masked ? mb : NULL, 0, gyb, 0, gxb, 0,
                                         B, S, DIM, 1, 10.0, answered, &n_ans);
        cr_assert_eq(r, 0, "backward (mask %d): %s", masked, hmc_last_error(h));
        cr_assert_eq(hm_xf_backward_mask(t, x, m, gy, B, S, want_gx), 0);
        double d = rel_err(gx, want_gx, nx);
        cr_assert(d <= 1e-5, "remote dL/dx (mask %d) differs from local by %g", masked, d);
    }
    /* Both steps landed as the local ones did. */
    int r;
    r = hmc_experts_forward_seq(h, ex, 1, xb, 0, mb, 0, yb, 0, B, S, DIM, 1, 10.0, 1.0,
                                    answered, &n_ans);
    cr_assert_eq(r, 0, "%s", hmc_last_error(h));
    cr_assert_eq(hm_xf_forward_mask(t, x, mask, B, S, want), 0);
    cr_assert(rel_err(y, want, nx) <= 1e-5, "after two steps: %g", rel_err(y, want, nx));

    /*
     * Routed per sample, a sample one sequence: sample 0 to both experts,
     * 1 to ffn.0.0 only, 2 to ffn.0.1 only, each with its own mask. Each
     * expert's answer is its local block on the sequences routed to it.
     */
    snprintf(path, sizeof(path), "%s/experts/ffn.0.0.ckpt", host.dir);
    hm_xf *t0 = NULL;
    cr_assert_eq(hm_ckpt_read(path, (size_t)1 << 30, &buf, &len, NULL), 0, "%s", path);
    cr_assert_eq(hm_xf_load(buf, len, NULL, &t0), 0);
    free(buf);
    cr_assert_str_eq(ex[1].uid, "ffn.0.0");
    hm_xf *loc[2] = {t, t0};
    const int32_t rt[B * 2] = {0, 1, 1, -1, 0, -1};
    hmc_buf *rb, *ryb, *rgyb, *rgxb;
    cr_assert_eq(hmc_buf_alloc(h, sizeof(rt), &rb), 0);
    cr_assert_eq(hmc_buf_alloc(h, 2 * nx * sizeof(float), &ryb), 0);
    cr_assert_eq(hmc_buf_alloc(h, 2 * nx * sizeof(float), &rgyb), 0);
    cr_assert_eq(hmc_buf_alloc(h, 2 * nx * sizeof(float), &rgxb), 0);
    memcpy(hmc_buf_data(rb), rt, sizeof(rt));
    float *ry = hmc_buf_data(ryb), *rgy = hmc_buf_data(rgyb), *rgx = hmc_buf_data(rgxb);
    fill(rgy, 2 * nx, 23);
    int ans2[2];
    r = hmc_experts_forward_routed_seq(h, ex, 2, rb, 0, 2, xb, 0, mb, 0, ryb, 0, B, S, DIM, 1, 0,
                                       10.0, 1.0, ans2, &n_ans);
    cr_assert_eq(r, 0, "routed forward: %s", hmc_last_error(h));
    cr_assert_eq(n_ans, 2);
    const size_t sq = S * DIM;
    for (size_t b = 0; b < B; b++)
        for (size_t j = 0; j < 2; j++) {
            if (rt[b * 2 + j] < 0)
                continue;
            cr_assert_eq(hm_xf_forward_mask(loc[rt[b * 2 + j]], x + b * sq, mask + b * S, 1, S,
                                            want), 0);
            double d = rel_err(ry + (b * 2 + j) * sq, want, sq);
            cr_assert(d <= 1e-5, "routed forward, sample %zu slot %zu: %g", b, j, d);
        }
    r = hmc_experts_backward_routed_seq(h, ex, 2, rb, 0, 2, xb, 0, mb, 0, rgyb, 0, rgxb, 0, B, S,
                                        DIM, 1, 0, 10.0, ans2, &n_ans);
    cr_assert_eq(r, 0, "routed backward: %s", hmc_last_error(h));
    /* Locally: each expert's gathered sequences, one step each. */
    for (int e = 0; e < 2; e++) {
        float gxe[B * S * DIM], xe[B * S * DIM], gye[B * S * DIM];
        uint8_t me[B * S];
        size_t at = 0, slot_of[B];
        for (size_t b = 0; b < B; b++)
            for (size_t j = 0; j < 2; j++)
                if (rt[b * 2 + j] == e) {
                    memcpy(xe + at * sq, x + b * sq, sq * sizeof(float));
                    memcpy(gye + at * sq, rgy + (b * 2 + j) * sq, sq * sizeof(float));
                    memcpy(me + at * S, mask + b * S, S);
                    slot_of[at++] = b * 2 + j;
                }
        cr_assert_eq(hm_xf_backward_mask(loc[e], xe, me, gye, at, S, gxe), 0);
        for (size_t i = 0; i < at; i++) {
            double d = rel_err(rgx + slot_of[i] * sq, gxe + i * sq, sq);
            cr_assert(d <= 1e-5, "routed dL/dx of expert %d, slot %zu: %g", e, slot_of[i], d);
        }
    }
    hmc_buf_free(rb);
    hmc_buf_free(ryb);
    hmc_buf_free(rgyb);
    hmc_buf_free(rgxb);
    hm_xf_free(t0);

    /* A sequence over ExpertMaxSeq (B*S rows as one sequence of 15). */
    r = hmc_experts_forward_seq(h, ex, 1, xb, 0, NULL, 0, yb, 0, 1, B * S, DIM, 1, 30.0, 1.0,
                                answered, &n_ans);
    cr_assert_eq(r, -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h), "expert_wrong_shape", "%s", hmc_last_error(h));
    cr_assert(strstr(hmc_last_error(h), "ExpertMaxSeq") != NULL &&
                  strstr(hmc_last_error(h), "at most 6, not 15") != NULL,
              "%s", hmc_last_error(h));
    /* [batch, dim] to a transformer. */
    r = hmc_experts_forward(h, ex, 1, xb, 0, yb, 0, B * S, DIM, 1, 30.0, 1.0, answered, &n_ans);
    cr_assert_eq(r, -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h), "expert_wrong_shape", "%s", hmc_last_error(h));
    cr_assert(strstr(hmc_last_error(h), "[batch, seq, 16]") != NULL, "%s", hmc_last_error(h));
    /* The wrong width over sequences. */
    r = hmc_experts_forward_seq(h, ex, 1, xb, 0, NULL, 0, yb, 0, B, S * 2, DIM / 2, 1, 30.0, 1.0,
                                answered, &n_ans);
    cr_assert_eq(r, -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(h), "expert_wrong_shape", "%s", hmc_last_error(h));
    cr_assert(strstr(hmc_last_error(h), "width 16, not 8") != NULL, "%s", hmc_last_error(h));
    /* Bad masks never leave the daemon. */
    mf[3] = 0.5f;
    r = hmc_experts_forward_seq(h, ex, 1, xb, 0, mb, 0, yb, 0, B, S, DIM, 1, 10.0, 1.0, answered,
                                &n_ans);
    cr_assert_str_eq(hmc_last_error_code(h), "bad_args", "%d %s", r, hmc_last_error(h));
    cr_assert(strstr(hmc_last_error(h), "args.mask[3]") != NULL, "%s", hmc_last_error(h));
    mf[3] = 1;
    for (size_t j = 0; j < S; j++)
        mf[2 * S + j] = 0;
    r = hmc_experts_forward_seq(h, ex, 1, xb, 0, mb, 0, yb, 0, B, S, DIM, 1, 10.0, 1.0, answered,
                                &n_ans);
    cr_assert_str_eq(hmc_last_error_code(h), "bad_args", "%d %s", r, hmc_last_error(h));
    cr_assert(strstr(hmc_last_error(h), "sequence 2") != NULL, "%s", hmc_last_error(h));
    cr_assert_eq(hmc_experts_forward_seq(h, ex, 1, xb, 0, mb, 0, yb, 0, B, 0, DIM, 1, 10.0, 1.0,
                                         answered, &n_ans),
                 -EINVAL);

    hmc_buf_free(xb);
    hmc_buf_free(yb);
    hmc_buf_free(gyb);
    hmc_buf_free(gxb);
    hmc_buf_free(mb);
    hmc_close(h);
    hm_xf_free(t);
    stop_node(&tr);
    stop_node(&host);
}

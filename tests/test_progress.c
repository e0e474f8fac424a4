/*
 * test_progress: swarm progress across real hivemindd processes on
 * 127.0.0.1. Trainers attach through libhivemind and report with
 * "progress.report"; every daemon's "progress" must then show the same
 * aggregate (the global epoch over non-client peers, the samples summed at
 * that epoch, the throughput, the peers), a record must stay while its
 * connection is open (refreshed) and leave the aggregate once its
 * connection closed and it expired, and out-of-range reports and
 * malformed records in the DHT must be refused or ignored without
 * breaking the aggregate.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <string.h>

#include <arpa/inet.h>

#include "lib/hivemind.h"
#include "src/base/origin.h"
#include "src/daemon/progress.h"
#include "tests/proc.h"

static void setup(void) { hm_proc_setup("progress"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(progress, .init = setup, .fini = teardown, .timeout = 120);

static void start_swarm(struct node *nodes, size_t n)
{
    char name[16];
    start_node(&nodes[0], "n0", NULL, NULL);
    for (size_t i = 1; i < n; i++) {
        snprintf(name, sizeof(name), "n%zu", i);
        start_node(&nodes[i], name, NULL, "--initial-peers", nodes[0].addr, NULL);
    }
    long deadline = hm_test_now_ms() + 20000;
    size_t ready = 0;
    while (ready < n && hm_test_now_ms() < deadline) {
        ready = 0;
        for (size_t i = 0; i < n; i++)
            ready += node_rt_size(&nodes[i]) >= (long)(n - 1);
        if (ready < n)
            usleep(200000);
    }
    cr_assert_eq(ready, n, "only %zu of %zu daemons know the others", ready, n);
}

static hmc *attach(struct node *n)
{
    hmc *h;
    char err[256];
    int r = hmc_connect(n->sock, &h, err, sizeof(err));
    cr_assert_eq(r, 0, "connect to %s: %s", n->sock, err);
    return h;
}

/* A report with short record times; the result or the error reply. */
static int report(hmc *h, const char *run, long epoch, long samples, double sps, int client,
                  double ttl, double refresh)
{
    char args[512];
    snprintf(args, sizeof(args),
             "{\"run\":\"%s\",\"epoch\":%ld,\"samples\":%ld,\"samples_per_second\":%.17g,"
             "\"client\":%s,\"ttl\":%g,\"refresh\":%g}",
             run, epoch, samples, sps, client ? "true" : "false", ttl, refresh);
    char *res = NULL;
    int r = hmc_request(h, "progress.report", args, &res);
    hmc_free_string(res);
    return r;
}

static json_t *progress(hmc *h, const char *run, uint64_t target)
{
    char *text = NULL;
    hmc_progress p;
    int r = hmc_progress_get(h, run, target, &p, &text);
    cr_assert_eq(r, 0, "progress: %s", hmc_last_error(h));
    json_t *j = json_loads(text, 0, NULL);
    cr_assert_not_null(j);
    /* The struct and the JSON tell the same. */
    cr_assert_eq(p.global_epoch, (uint64_t)json_integer_value(json_object_get(j, "global_epoch")));
    cr_assert_eq(p.samples, (uint64_t)json_integer_value(json_object_get(j, "samples")));
    cr_assert_eq(p.n_peers, (size_t)json_integer_value(json_object_get(j, "n_peers")));
    hmc_free_string(text);
    return j;
}

static long jint(const json_t *o, const char *k)
{
    return (long)json_integer_value(json_object_get(o, k));
}

/* Polls until every node's aggregate has n_peers and n_clients (or the deadline). */
static int wait_counts(hmc **hs, size_t n, const char *run, long peers, long clients,
                       int timeout_ms)
{
    long deadline = hm_test_now_ms() + timeout_ms;
    for (;;) {
        size_t ok = 0;
        for (size_t i = 0; i < n; i++) {
            json_t *j = progress(hs[i], run, 0);
            ok += jint(j, "n_peers") == peers && jint(j, "n_clients") == clients;
            json_decref(j);
        }
        if (ok == n)
            return 1;
        if (hm_test_now_ms() > deadline)
            return 0;
        usleep(300000);
    }
}

Test(progress, three_daemons_agree_on_the_aggregate)
{
    struct node nodes[3];
    hmc *h[3];
    start_swarm(nodes, 3);
    for (int i = 0; i < 3; i++)
        h[i] = attach(&nodes[i]);
    cr_assert_eq(report(h[0], "run1", 5, 100, 0, 0, 60, 30), 0, "%s", hmc_last_error(h[0]));
    cr_assert_eq(report(h[1], "run1", 5, 250, 0, 0, 60, 30), 0, "%s", hmc_last_error(h[1]));
    /* A client ahead: its epoch does not lead, its samples are not at the global epoch. */
    cr_assert_eq(report(h[2], "run1", 7, 40, 0, 1, 60, 30), 0, "%s", hmc_last_error(h[2]));
    cr_assert(wait_counts(h, 3, "run1", 2, 1, 20000), "the nodes never saw 2 peers and 1 client");
    for (int i = 0; i < 3; i++) {
        json_t *j = progress(h[i], "run1", 1000);
        cr_assert_eq(jint(j, "global_epoch"), 5, "node %d: global epoch %ld", i,
                     jint(j, "global_epoch"));
        cr_assert_eq(jint(j, "samples"), 350, "node %d: samples %ld", i, jint(j, "samples"));
        cr_assert_eq(jint(j, "target_batch_size"), 1000);
        cr_assert(json_is_null(json_object_get(j, "eta_s")), "no throughput, no eta");
        cr_assert_eq(json_array_size(json_object_get(j, "peers")), 3);
        json_decref(j);
    }

    /* Throughput: both trainers now claim 20/s and 30/s; the eta follows. */
    cr_assert_eq(report(h[0], "run1", 5, 100, 20, 0, 60, 30), 0);
    cr_assert_eq(report(h[1], "run1", 5, 250, 30, 0, 60, 30), 0);
    long deadline = hm_test_now_ms() + 20000;
    size_t agree = 0;
    while (agree < 3 && hm_test_now_ms() < deadline) {
        agree = 0;
        for (int i = 0; i < 3; i++) {
            json_t *j = progress(h[i], "run1", 100000);
            double sps = json_number_value(json_object_get(j, "samples_per_second"));
            double eta = json_number_value(json_object_get(j, "eta_s"));
            long s = jint(j, "samples");
            /* 350 plus at most 60 s of extrapolation at 50/s. */
            if (fabs(sps - 50) < 1e-9 && s >= 350 && s <= 350 + 50 * 60 &&
                fabs(eta - (100000.0 - (double)s) / 50.0) < 1.0)
                agree++;
            json_decref(j);
        }
        if (agree < 3)
            usleep(300000);
    }
    cr_assert_eq(agree, 3, "only %zu nodes saw 50 samples/s and the matching eta", agree);

    /* A new epoch is published at once, but one trainer's origin alone does
     * not move the global epoch (ProgressEpochOrigins 2)... */
    cr_assert_eq(report(h[1], "run1", 6, 10, 0, 0, 60, 30), 0);
    cr_assert_eq(report(h[0], "run1", 5, 100, 0, 0, 60, 30), 0);
    deadline = hm_test_now_ms() + 20000;
    agree = 0;
    while (agree < 3 && hm_test_now_ms() < deadline) {
        agree = 0;
        for (int i = 0; i < 3; i++) {
            json_t *j = progress(h[i], "run1", 0);
            /* Node 1 sees its own epoch 6 at once; wait until every node has it. */
            const json_t *peers = json_object_get(j, "peers");
            size_t k;
            const json_t *x;
            int seen6 = 0;
            json_array_foreach(peers, k, x) seen6 |= jint(x, "epoch") == 6;
            agree += seen6 && jint(j, "global_epoch") == 5 && jint(j, "samples") == 100 &&
                     jint(j, "held_back") == 1;
            json_decref(j);
        }
        if (agree < 3)
            usleep(300000);
    }
    cr_assert_eq(agree, 3, "only %zu nodes held epoch 5 with one origin at 6", agree);
    /* ...a second one does, and the samples at epoch 6 are summed. */
    cr_assert_eq(report(h[0], "run1", 6, 4, 0, 0, 60, 30), 0);
    deadline = hm_test_now_ms() + 20000;
    agree = 0;
    while (agree < 3 && hm_test_now_ms() < deadline) {
        agree = 0;
        for (int i = 0; i < 3; i++) {
            json_t *j = progress(h[i], "run1", 0);
            agree += jint(j, "global_epoch") == 6 && jint(j, "samples") == 14 &&
                     jint(j, "held_back") == 0;
            json_decref(j);
        }
        if (agree < 3)
            usleep(300000);
    }
    cr_assert_eq(agree, 3, "only %zu nodes moved to epoch 6 with 14 samples", agree);

    /* hivemindctl shows the same. */
    int rc;
    json_t *j = ctl_json(&nodes[2], &rc, "progress", "run1", "--target", "40", NULL);
    cr_assert_eq(rc, 0);
    json_t *res = json_object_get(j, "result");
    cr_assert_eq(jint(res, "global_epoch"), 6);
    cr_assert_eq(jint(res, "target_batch_size"), 40);
    json_decref(j);
    for (int i = 0; i < 3; i++)
        hmc_close(h[i]);
}

Test(progress, a_record_is_refreshed_while_open_and_expires_after_close)
{
    struct node nodes[2];
    start_swarm(nodes, 2);
    hmc *h[2] = {attach(&nodes[0]), attach(&nodes[1])};
    /* Records of 3 s, refreshed every second. */
    cr_assert_eq(report(h[1], "run2", 1, 7, 0, 0, 3, 1), 0, "%s", hmc_last_error(h[1]));
    cr_assert(wait_counts(h, 1, "run2", 1, 0, 15000), "node 0 never saw node 1's report");
    /* Well past the record's 3 s, the refreshes keep it. */
    for (int k = 0; k < 8; k++) {
        usleep(1000000);
        json_t *j = progress(h[0], "run2", 0);
        cr_assert_eq(jint(j, "n_peers"), 1, "the record went away while its connection was open");
        cr_assert_eq(jint(j, "samples"), 7);
        json_decref(j);
    }
    long closed = hm_test_now_ms();
    hmc_close(h[1]);
    cr_assert(wait_counts(h, 1, "run2", 0, 0, 15000), "the record outlived its connection");
    long gone = hm_test_now_ms() - closed;
    /* Its expiry (3 s), the cache's second and the polls, with room for a loaded machine. */
    cr_assert(gone <= 3000 + 1000 + 4000, "gone after %ld ms", gone);
    hmc_close(h[0]);
}

Test(progress, out_of_range_reports_are_refused)
{
    struct node nodes[1];
    start_node(&nodes[0], "n0", NULL, NULL);
    hmc *h = attach(&nodes[0]);
    static const struct {
        const char *args, *word;
    } bad[] = {
        {"{\"run\":\"r\",\"epoch\":-1,\"samples\":0,\"samples_per_second\":0}", "epoch"},
        {"{\"run\":\"r\",\"epoch\":9007199254740992,\"samples\":0,\"samples_per_second\":0}",
         "epoch"},
        {"{\"run\":\"r\",\"epoch\":1,\"samples\":1099511627777,\"samples_per_second\":0}",
         "samples"},
        {"{\"run\":\"r\",\"epoch\":1,\"samples\":1,\"samples_per_second\":1e9}",
         "samples_per_second"},
        {"{\"run\":\"r\",\"epoch\":1,\"samples\":1,\"samples_per_second\":-1}",
         "samples_per_second"},
        {"{\"run\":\"r\",\"epoch\":1,\"samples\":1}", "samples_per_second"},
        {"{\"run\":\"r\",\"epoch\":\"1\",\"samples\":1,\"samples_per_second\":1}", "epoch"},
        {"{\"run\":\"x[owner:abc]\",\"epoch\":1,\"samples\":1,\"samples_per_second\":1}", "run"},
        {"{\"run\":\"\",\"epoch\":1,\"samples\":1,\"samples_per_second\":1}", "run"},
        {"{\"run\":\"r\",\"epoch\":1,\"samples\":1,\"samples_per_second\":1,\"ttl\":61}", "ttl"},
        {"{\"run\":\"r\",\"epoch\":1,\"samples\":1,\"samples_per_second\":1,\"ttl\":5,"
         "\"refresh\":5}", "refresh"},
        {"{\"run\":\"r\",\"epoch\":1,\"samples\":1,\"samples_per_second\":1,\"client\":1}",
         "client"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char *res = NULL;
        int r = hmc_request(h, "progress.report", bad[i].args, &res);
        cr_assert_eq(r, -EREMOTEIO, "%s was accepted", bad[i].args);
        cr_assert_str_eq(hmc_last_error_code(h), "bad_args");
        cr_assert(strstr(hmc_last_error(h), bad[i].word) != NULL, "'%s' does not name %s",
                  hmc_last_error(h), bad[i].word);
        hmc_free_string(res);
    }
    /* Nothing of them was taken. */
    json_t *j = progress(h, "r", 0);
    cr_assert_eq(jint(j, "n_peers"), 0);
    json_decref(j);
    hmc_close(h);
}

Test(progress, malformed_records_do_not_break_the_aggregate)
{
    struct node nodes[2];
    start_swarm(nodes, 2);
    hmc *h[2] = {attach(&nodes[0]), attach(&nodes[1])};
    cr_assert_eq(report(h[0], "run3", 2, 30, 0, 0, 60, 30), 0);
    /* Node 1 stores garbage under the run's key: one owned record with a
     * value that is no progress record, one unowned subkey. */
    char marker[128], args[512];
    snprintf(marker, sizeof(marker), "[owner:%s]", nodes[1].id);
    snprintf(args, sizeof(args), "{\"key\":\"run3.progress\",\"subkey\":\"%s\","
             "\"value\":\"epoch=99999999 samples=1e30\",\"ttl\":60}", marker);
    char *res = NULL;
    cr_assert_eq(hmc_request(h[1], "dht.put", args, &res), 0, "%s", hmc_last_error(h[1]));
    hmc_free_string(res);
    res = NULL;
    cr_assert_eq(hmc_request(h[1], "dht.put",
                             "{\"key\":\"run3.progress\",\"subkey\":\"mallory\","
                             "\"value\":\"x\",\"ttl\":60}", &res),
                 0, "%s", hmc_last_error(h[1]));
    hmc_free_string(res);
    cr_assert(wait_counts(h, 2, "run3", 1, 0, 15000), "the honest report is not seen alone");
    for (int i = 0; i < 2; i++) {
        json_t *j = progress(h[i], "run3", 0);
        cr_assert_eq(jint(j, "global_epoch"), 2);
        cr_assert_eq(jint(j, "samples"), 30);
        cr_assert_eq(json_array_size(json_object_get(j, "peers")), 1);
        json_decref(j);
    }
    hmc_close(h[0]);
    hmc_close(h[1]);
}

Test(progress, runs_are_bounded_per_connection_and_per_daemon)
{
    struct node nodes[1];
    start_node(&nodes[0], "n0", NULL, "--progress-runs-per-connection", "2",
               "--progress-max-runs", "3", NULL);
    hmc *a = attach(&nodes[0]), *b = attach(&nodes[0]);
    cr_assert_eq(report(a, "ra", 1, 1, 0, 0, 60, 30), 0);
    cr_assert_eq(report(a, "rb", 1, 1, 0, 0, 60, 30), 0);
    /* The same run again on the same connection is an update, not a new run. */
    cr_assert_eq(report(a, "rb", 1, 2, 0, 0, 60, 30), 0);
    cr_assert_eq(report(a, "rc", 1, 1, 0, 0, 60, 30), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(a), "limit");
    cr_assert(strstr(hmc_last_error(a), "ProgressRunsPerConnection") != NULL, "%s",
              hmc_last_error(a));
    /* Another connection may not report a run this daemon already reports. */
    cr_assert_eq(report(b, "ra", 1, 1, 0, 0, 60, 30), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(b), "conflict");
    cr_assert_eq(report(b, "rd", 1, 1, 0, 0, 60, 30), 0);
    cr_assert_eq(report(b, "re", 1, 1, 0, 0, 60, 30), -EREMOTEIO);
    cr_assert_str_eq(hmc_last_error_code(b), "limit");
    cr_assert(strstr(hmc_last_error(b), "ProgressMaxRuns") != NULL, "%s", hmc_last_error(b));
    /* Both refusals are counted. */
    char *out, *err;
    cr_assert_eq(ctl(nodes[0].sock, "metrics", 0, &out, &err), 0);
    cr_assert(strstr(out, "hivemindd_limit_refused_total{limit=\"ProgressRunsPerConnection\"} 1") != NULL);
    cr_assert(strstr(out, "hivemindd_limit_refused_total{limit=\"ProgressMaxRuns\"} 1") != NULL);
    free(out);
    free(err);
    /* A closed connection frees its runs. */
    hmc_close(a);
    long deadline = hm_test_now_ms() + 5000;
    int r;
    while ((r = report(b, "re", 1, 1, 0, 0, 60, 30)) != 0 && hm_test_now_ms() < deadline)
        usleep(50000);
    cr_assert_eq(r, 0, "%s", hmc_last_error(b));
    hmc_close(b);
}

/*
 * A reader whose peer table holds one place for 127.0.0.1 knows only one of
 * the two reporters there; the other's record counts once its owner
 * answered a ping at the address the record names (progress.h, "addr").
 */
Test(progress, an_owner_outside_the_peer_table_counts_once_proven_at_its_address)
{
    struct node nodes[3];
    start_node(&nodes[0], "n0", NULL, "--peer-table-origin-cap", "1", NULL);
    start_node(&nodes[1], "n1", NULL, "--initial-peers", nodes[0].addr, NULL);
    start_node(&nodes[2], "n2", NULL, "--initial-peers", nodes[0].addr, NULL);
    long deadline = hm_test_now_ms() + 20000;
    while ((node_rt_size(&nodes[1]) < 2 || node_rt_size(&nodes[2]) < 2) &&
           hm_test_now_ms() < deadline)
        usleep(200000);
    hmc *h[3] = {attach(&nodes[0]), attach(&nodes[1]), attach(&nodes[2])};
    cr_assert_eq(report(h[1], "run5", 3, 10, 0, 0, 60, 30), 0, "%s", hmc_last_error(h[1]));
    cr_assert_eq(report(h[2], "run5", 3, 20, 0, 0, 60, 30), 0, "%s", hmc_last_error(h[2]));
    cr_assert(wait_counts(h, 1, "run5", 2, 0, 20000), "node 0 never counted both reporters");
    int rc;
    json_t *pj = ctl_json(&nodes[0], &rc, "peers", NULL);
    size_t known = json_array_size(json_object_get(json_object_get(pj, "result"), "peers"));
    json_decref(pj);
    cr_assert_eq(known, 1, "node 0's table holds %zu peers, not the one place", known);
    json_t *j = progress(h[0], "run5", 0);
    cr_assert_eq(jint(j, "samples"), 30);
    cr_assert_eq(jint(j, "unverified"), 0);
    json_decref(j);
    for (int i = 0; i < 3; i++)
        hmc_close(h[i]);
}

/* ---- the aggregate by origin (progress.h), as a pure function ---- */

/* A verified trainer record at origin 10.0.0.o (o 0: an origin of its own). */
static hm_progress_peer rec(unsigned o, uint64_t epoch, uint64_t samples, double sps, int client)
{
    hm_progress_peer x;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x0a000000u | o)};
    memset(&x, 0, sizeof(x));
    x.r = (hm_progress_rec){.epoch = epoch, .samples = samples, .sps = sps, .time = 1000,
                            .client = client};
    x.verified = 1;
    x.unique = o == 0;
    hm_origin_of((const struct sockaddr *)&sa, &x.origin);
    return x;
}

Test(progress_agg, the_global_epoch_needs_two_origins)
{
    hm_progress_rules rules = {.epoch_origins = 2, .origin_factor = 4};
    hm_progress_agg agg;
    hm_progress_peer p[16];
    /* One origin alone leads. */
    p[0] = rec(1, 7, 10, 0, 0);
    hm_progress_aggregate(p, 1, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 7);
    /* One origin ahead of two: held back until a second one gets there. */
    p[1] = rec(2, 5, 10, 0, 0);
    p[2] = rec(3, 5, 20, 0, 0);
    hm_progress_aggregate(p, 3, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 5);
    cr_assert_eq(agg.held_back, 1);
    cr_assert_eq(agg.samples, 30);
    p[1].r.epoch = 7;
    hm_progress_aggregate(p, 3, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 7);
    cr_assert_eq(agg.samples, 20);
    /* Ten identities of one origin are one vote. */
    for (int i = 3; i < 13; i++)
        p[i] = rec(9, 999999, 10, 0, 0);
    p[0].r.epoch = p[1].r.epoch = 5;
    hm_progress_aggregate(p, 13, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 5);
    cr_assert_eq(agg.n_origins, 4);
    cr_assert_eq(agg.n_peers, 13);
    /* ...unless they count apart (exempt loopback). */
    for (int i = 3; i < 13; i++)
        p[i].unique = 1;
    hm_progress_aggregate(p, 13, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 999999);
    /* Clients do not lead while trainers count, and lead alone. */
    p[0] = rec(1, 3, 0, 0, 0);
    p[1] = rec(2, 3, 0, 0, 0);
    p[2] = rec(3, 8, 0, 0, 1);
    p[3] = rec(4, 8, 0, 0, 1);
    hm_progress_aggregate(p, 4, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 3);
    hm_progress_aggregate(p + 2, 2, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 8);
}

/* -- progress majority unit test -- */
Test(progress_agg, the_global_epoch_needs_a_majority_of_origins)
{
    hm_progress_rules rules = {.epoch_origins = 2, .origin_factor = 4, .majority = 1};
    hm_progress_agg agg;
    hm_progress_peer p[8];
    /* Three honest origins at 5, two hostile ones far ahead. */
    p[0] = rec(1, 5, 10, 0, 0);
    p[1] = rec(2, 5, 10, 0, 0);
    p[2] = rec(3, 5, 10, 0, 0);
    p[3] = rec(4, 999999, 10, 0, 0);
    p[4] = rec(5, 999999, 10, 0, 0);
    hm_progress_aggregate(p, 5, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 5);
    cr_assert_eq(agg.held_back, 2);
    /* Two origins are enough without the majority rule. */
    rules.majority = 0;
    hm_progress_aggregate(p, 5, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 999999);
    /* Honest hosts move it once most of them got there: 3 of 5, not 2 of 4. */
    rules.majority = 1;
    p[0].r.epoch = p[1].r.epoch = 6;
    hm_progress_aggregate(p, 5, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 6);
    p[3] = rec(7, 5, 10, 0, 0);
    p[4] = rec(6, 6, 10, 0, 0);
    p[0].r.epoch = 7;
    hm_progress_aggregate(p, 4, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 5);
    hm_progress_aggregate(p, 5, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 6);
    /* A lone origin and two origins still lead as before (all of them). */
    hm_progress_aggregate(p, 1, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 7);
    hm_progress_aggregate(p, 2, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 6);
}

Test(progress_agg, an_origin_counts_at_most_factor_times_the_median)
{
    hm_progress_rules rules = {.epoch_origins = 2, .origin_factor = 4};
    hm_progress_agg agg;
    hm_progress_peer p[8];
    int used[8];
    p[0] = rec(1, 5, 100, 10, 0);
    p[1] = rec(2, 5, 200, 20, 0);
    p[2] = rec(3, 5, 300, 30, 0);
    hm_progress_aggregate(p, 3, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.samples, 600, "honest origins within the factor are summed exactly");
    cr_assert_eq(agg.sps, 60);
    cr_assert_eq(agg.clamped, 0);
    /* Three identities of one origin claim 2^40 samples and 1e7/s each. */
    for (int i = 3; i < 6; i++)
        p[i] = rec(7, 5, HM_PROGRESS_MAX_SAMPLES, HM_PROGRESS_MAX_SPS, 0);
    hm_progress_aggregate(p, 6, 1000, 100000, &rules, &agg, NULL);
    cr_assert_eq(agg.samples, 600 + 4 * 200);
    cr_assert_eq(agg.sps, 60 + 4 * 20);
    cr_assert_eq(agg.clamped, 1);
    cr_assert_gt(agg.eta_s, 0);
    /* An unverified record never counts, whatever it claims. */
    p[6] = rec(8, 999, HM_PROGRESS_MAX_SAMPLES, HM_PROGRESS_MAX_SPS, 0);
    p[6].verified = 0;
    hm_progress_aggregate(p, 7, 1000, 0, &rules, &agg, used);
    cr_assert_eq(agg.unverified, 1);
    cr_assert_eq(used[6], 0);
    cr_assert_eq(agg.global_epoch, 5);
    cr_assert_eq(agg.samples, 1400);
    /* Factor 0: no bound. */
    rules.origin_factor = 0;
    hm_progress_aggregate(p, 6, 1000, 0, &rules, &agg, NULL);
    cr_assert_eq(agg.samples, 600 + 3.0 * (double)HM_PROGRESS_MAX_SAMPLES);
}

Test(progress_agg, an_addr_entry_round_trips_and_bad_ones_are_refused)
{
    hm_progress_rec r = {.epoch = 1, .samples = 2, .sps = 3, .time = 4}, back;
    uint8_t buf[HM_PROGRESS_VALUE_MAX];
    size_t len;
    snprintf(r.addr, sizeof(r.addr), "[2001:db8:ffff:ffff:ffff:ffff:ffff:ffff]:65535");
    cr_assert_eq(hm_progress_encode(&r, buf, sizeof(buf), &len), 0);
    cr_assert_eq(hm_progress_decode(buf, len, &back), 0);
    cr_assert_str_eq(back.addr, r.addr);
    snprintf(r.addr, sizeof(r.addr), "not an address");
    cr_assert_eq(hm_progress_encode(&r, buf, sizeof(buf), &len), -ERANGE);
    r.addr[0] = '\0';
    cr_assert_eq(hm_progress_encode(&r, buf, sizeof(buf), &len), 0);
    cr_assert_eq(hm_progress_decode(buf, len, &back), 0);
    cr_assert_str_eq(back.addr, "");
}

/*
 * A dead trainer's last record would vote for its old epoch until it
 * expires, and with the majority rule hold the live trainers back. Once
 * it is HM_PROGRESS_STALE_S old and its own throughput says it should have
 * reached the target twice over, it counts nowhere.
 */
Test(progress_agg, a_dead_trainers_record_stops_voting_once_stale)
{
    hm_progress_rules rules = {.epoch_origins = 2, .origin_factor = 4, .majority = 1};
    hm_progress_agg agg;
    hm_progress_peer p[4];
    int used[4];
    /* Two live trainers at 9 (reported just now); two dead ones at 4, 21 s ago, at 100/s. */
    p[0] = rec(1, 9, 10, 100, 0);
    p[1] = rec(2, 9, 10, 100, 0);
    p[2] = rec(3, 4, 10, 100, 0);
    p[3] = rec(4, 4, 10, 100, 0);
    p[0].r.time = p[1].r.time = 1021;
    hm_progress_aggregate(p, 4, 1021, 0, &rules, &agg, used);
    cr_assert_eq(agg.global_epoch, 4, "without a target nothing is stale");
    hm_progress_aggregate(p, 4, 1021, 400, &rules, &agg, used);
    cr_assert_eq(agg.global_epoch, 9);
    cr_assert_eq(agg.stale, 2);
    cr_assert(used[0] && used[1] && !used[2] && !used[3]);
    cr_assert_float_eq(agg.sps, 200, 1e-9, "a stale record's throughput counted");
    /* Not yet stale: younger than HM_PROGRESS_STALE_S, or its throughput
     * would not have reached twice the target in that time. */
    hm_progress_aggregate(p, 4, 1019, 400, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 4);
    hm_progress_aggregate(p, 4, 1021, 1100, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 4);
    /* Nor one the reader knows is alive (its own trainer). */
    p[2].live = p[3].live = 1;
    hm_progress_aggregate(p, 4, 1021, 400, &rules, &agg, NULL);
    cr_assert_eq(agg.global_epoch, 4);
    cr_assert_eq(agg.stale, 0);
}

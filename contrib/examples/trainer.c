/*
 * trainer: the swarm version of train_local. The same model (model.h), but
 * its mixture-of-experts layer runs on experts hosted anywhere in the
 * swarm, called through the local hivemindd with the client library
 * (lib/hivemind.h), and its local parameters are averaged with the other
 * trainers in the background.
 *
 *   trainer --socket PATH [--expert-prefix ffn] [--k-min 1] [--timeout 5]
 *           [--timeout-after-k-min 1] [--find-every 200]
 *           [--average-every 100] [--average-prefix fmnist.params]
 *           [--group-size 16] [common options: train_common.h]
 *
 * Experts. The grid PREFIX.i.j (G0 x G1, from --experts) is looked up with
 * hmc_experts_find at start and every --find-every steps, with equal
 * scores and k_best = G0 * G1, so that it returns every live expert; the
 * model then picks its k_best by the gate among those (hm_model_set_
 * available). A forward call succeeds once k_min experts answered (at most
 * --timeout seconds, then --timeout-after-k-min more for the rest); a step
 * with fewer is skipped and counted. The experts step their own optimizer
 * on backward.
 *
 * Averaging with a delayed update. Every --average-every steps (when no
 * round is running) the parameters are copied into a shared buffer and a
 * round starts in the background with weight = samples trained since the
 * last round started; training goes on meanwhile. When the round is done,
 * the update is params += averaged - snapshot, so the steps taken during
 * the round are kept. A failed round (no group, timeout) changes nothing.
 *
 * Output: the lines of train_common.h, with "avg" lines for rounds:
 *   avg t=SECONDS step=N status=ok|CODE group=SIZE weight=W duration=S
 * and the train lines carry failed=STEPS_SKIPPED experts=LIVE. SIGINT or
 * SIGTERM ends training after the current step with a done line.
 *
 * Exit status: 0 when it trained to the end or was stopped by a signal, 64
 * on a usage error, 1 otherwise (no daemon, the daemon went away).
 */
#include "config.h"

#include "hivemind.h"
#include "model.h"
#include "train_common.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct remote {
    hmc *h;
    hmc_buf *xb, *yb, *gyb, *gxb;
    size_t G1;
    hmc_expert *by_index; /* [G0 * G1]: found experts at their grid index */
    uint8_t *live;        /* [G0 * G1] */
    size_t n_live;
    size_t k_min;
    double timeout_s, after_k_min_s;
    int fatal;            /* the connection is gone */
    size_t calls_failed;
};

struct trainer_opts {
    const char *socket;
    const char *expert_prefix;
    const char *average_prefix;
    size_t k_min;
    double timeout_s, after_k_min_s;
    size_t find_every;
    size_t average_every;
    size_t group_size;
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: trainer --socket PATH [OPTIONS]\n"
            "Trains the example mixture-of-experts classifier on Fashion-MNIST with the\n"
            "experts of a hivemindd swarm, averaging its own parameters with other trainers.\n\n"
            "  --socket PATH            the local daemon's control socket\n"
            "  --expert-prefix P        expert grid prefix (default ffn: uids ffn.i.j)\n"
            "  --k-min K                experts that must answer a forward (default 1)\n"
            "  --timeout S              expert call timeout in seconds (default 5)\n"
            "  --timeout-after-k-min S  wait for the rest after k_min answered (default 1)\n"
            "  --find-every N           look the grid up again every N steps (default 200)\n"
            "  --average-every N        start an averaging round every N steps (default 100,\n"
            "                           0: never)\n"
            "  --average-prefix P       what the parameters are averaged under\n"
            "                           (default fmnist.params)\n"
            "  --group-size N           target averaging group size (default 16)\n"
            "%s"
            "  -h, --help               this text\n",
            hm_train_common_usage);
}

static int map_answered(const int *ans, size_t k, uint8_t *answered)
{
    size_t n = 0;
    for (size_t e = 0; e < k; e++) {
        answered[e] = ans[e] != 0;
        n += answered[e];
    }
    return (int)n;
}

static int note_failure(struct remote *r, int rc, const char *what)
{
    r->calls_failed++;
    if (rc == -EPIPE) {
        fprintf(stderr, "trainer: %s: the daemon went away\n", what);
        r->fatal = 1;
    } else if (rc != -EREMOTEIO && rc != -ETIMEDOUT) {
        fprintf(stderr, "trainer: %s: %s (%s)\n", what, strerror(-rc), hmc_last_error(r->h));
        if (rc == -EPROTO || rc == -EINVAL)
            r->fatal = 1;
    }
    return rc;
}

static int remote_forward(void *ud, const size_t *experts, size_t k, const float *h, size_t batch,
                          size_t dim, float *y_out, uint8_t *answered)
{
    struct remote *r = ud;
    hmc_expert list[HM_MODEL_MAX_K];
    int ans[HM_MODEL_MAX_K];
    size_t n_ans = 0;
    for (size_t e = 0; e < k; e++)
        list[e] = r->by_index[experts[e]];
    memcpy(hmc_buf_data(r->xb), h, batch * dim * sizeof(float));
    size_t k_min = r->k_min < k ? r->k_min : k;
    int rc = hmc_experts_forward(r->h, list, k, r->xb, 0, r->yb, 0, batch, dim, k_min,
                                 r->timeout_s, r->after_k_min_s, ans, &n_ans);
    if (rc < 0)
        return note_failure(r, rc, "experts forward");
    map_answered(ans, k, answered);
    memcpy(y_out, hmc_buf_data(r->yb), k * batch * dim * sizeof(float));
    return 0;
}

static int remote_backward(void *ud, const size_t *experts, size_t k, const float *h,
                           const float *gy, size_t batch, size_t dim, float *gh_out,
                           uint8_t *answered)
{
    struct remote *r = ud;
    hmc_expert list[HM_MODEL_MAX_K];
    int ans[HM_MODEL_MAX_K];
    size_t n_ans = 0;
    for (size_t e = 0; e < k; e++)
        list[e] = r->by_index[experts[e]];
    memcpy(hmc_buf_data(r->xb), h, batch * dim * sizeof(float));
    memcpy(hmc_buf_data(r->gyb), gy, k * batch * dim * sizeof(float));
    /* Backward asks only that one expert answers, as Hivemind's
     * backward_k_min defaults to 1: a lost gradient is not worth a step. */
    int rc = hmc_experts_backward(r->h, list, k, r->xb, 0, r->gyb, 0, r->gxb, 0, batch, dim, 1,
                                  r->timeout_s, ans, &n_ans);
    if (rc < 0)
        return note_failure(r, rc, "experts backward");
    map_answered(ans, k, answered);
    memcpy(gh_out, hmc_buf_data(r->gxb), k * batch * dim * sizeof(float));
    return 0;
}

/*
 * Looks the whole grid up and marks which experts are live. Equal scores
 * and k_best = every expert make the beam search return all it finds.
 * Returns the number of live experts or a negative code.
 */
static int find_experts(struct remote *r, hm_model *m, const char *prefix, const size_t *grid)
{
    size_t n = grid[0] * grid[1], found = 0;
    double *scores = calloc(grid[0] + grid[1], sizeof(double));
    hmc_expert *out = calloc(n, sizeof(hmc_expert));
    int result;
    if (scores == NULL || out == NULL) {
        result = -ENOMEM;
        goto out;
    }
    result = hmc_experts_find(r->h, prefix, scores, grid, 2, n, r->timeout_s, out, n, &found,
                              NULL);
    if (result < 0) {
        note_failure(r, result, "experts find");
        goto out;
    }
    memset(r->live, 0, n);
    r->n_live = 0;
    size_t plen = strlen(prefix);
    for (size_t f = 0; f < found; f++) {
        unsigned long i, j;
        int used = 0;
        const char *uid = out[f].uid;
        if (strncmp(uid, prefix, plen) != 0 || uid[plen] != '.' ||
            sscanf(uid + plen + 1, "%lu.%lu%n", &i, &j, &used) != 2 || uid[plen + 1 + used] != '\0')
            continue;
        if (i >= grid[0] || j >= grid[1] || r->live[i * grid[1] + j])
            continue;
        r->by_index[i * grid[1] + j] = out[f];
        r->live[i * grid[1] + j] = 1;
        r->n_live++;
    }
    if (r->n_live > 0)
        hm_model_set_available(m, r->live);
    result = (int)r->n_live;
out:
    free(scores);
    free(out);
    return result;
}

/* The report's group_size, or 0. */
static int report_group_size(const char *report)
{
    int size = 0;
    if (report == NULL)
        return 0;
    json_t *j = json_loads(report, 0, NULL);
    if (j != NULL) {
        json_t *g = json_object_get(j, "group_size");
        if (json_is_integer(g))
            size = (int)json_integer_value(g);
        json_decref(j);
    }
    return size;
}

static int parse_own(struct trainer_opts *t, int argc, char **argv, int *i)
{
    static const char *const names[] = {"--socket", "--expert-prefix", "--average-prefix",
                                        "--k-min", "--timeout", "--timeout-after-k-min",
                                        "--find-every", "--average-every", "--group-size"};
    const size_t count = sizeof(names) / sizeof(names[0]);
    const char *arg = argv[*i], *val = NULL;
    size_t which = count;
    for (size_t n = 0; n < count; n++) {
        size_t len = strlen(names[n]);
        if (strncmp(arg, names[n], len) == 0 && (arg[len] == '\0' || arg[len] == '=')) {
            which = n;
            val = arg[len] == '=' ? arg + len + 1 : NULL;
            break;
        }
    }
    if (which == count)
        return 0;
    if (val == NULL) {
        if (*i + 1 >= argc) {
            fprintf(stderr, "%s needs a value\n", names[which]);
            return -EINVAL;
        }
        val = argv[++*i];
    }
    char *end;
    errno = 0;
    if (which <= 2) {
        if (val[0] == '\0' || strlen(val) > 128) {
            fprintf(stderr, "%s: 1 to 128 characters\n", names[which]);
            return -EINVAL;
        }
        if (which == 0)
            t->socket = val;
        else if (which == 1)
            t->expert_prefix = val;
        else
            t->average_prefix = val;
        return 1;
    }
    if (which == 4 || which == 5) {
        double x = strtod(val, &end);
        if (errno != 0 || end == val || *end != '\0' || !(x > 0) || x > 3600) {
            fprintf(stderr, "%s: '%s' is not a number of seconds in (0, 3600]\n", names[which],
                    val);
            return -EINVAL;
        }
        *(which == 4 ? &t->timeout_s : &t->after_k_min_s) = x;
        return 1;
    }
    unsigned long long x = strtoull(val, &end, 10);
    if (errno != 0 || end == val || *end != '\0' || val[0] == '-' || x > 1000000000ull) {
        fprintf(stderr, "%s: '%s' is not a whole number\n", names[which], val);
        return -EINVAL;
    }
    if ((which == 3 && (x < 1 || x > HM_MODEL_MAX_K)) || (which == 6 && x < 1) ||
        (which == 8 && (x < 1 || x > 64))) {
        fprintf(stderr, "%s: %llu is out of range\n", names[which], x);
        return -EINVAL;
    }
    if (which == 3)
        t->k_min = (size_t)x;
    else if (which == 6)
        t->find_every = (size_t)x;
    else if (which == 7)
        t->average_every = (size_t)x;
    else
        t->group_size = (size_t)x;
    return 1;
}

int main(int argc, char **argv)
{
    hm_train_opts o;
    struct trainer_opts t = {.expert_prefix = "ffn", .average_prefix = "fmnist.params",
                             .k_min = 1, .timeout_s = 5, .after_k_min_s = 1,
                             .find_every = 200, .average_every = 100, .group_size = 16};
    hm_train_data d;
    hm_model *m = NULL;
    struct remote r;
    hmc_buf *pb = NULL;
    hmc_round *round = NULL;
    float *snapshot = NULL;
    sigset_t sigs;
    char err[HMC_ERROR_MAX];
    int result = 1;

    memset(&d, 0, sizeof(d));
    memset(&r, 0, sizeof(r));
    hm_train_opts_default(&o);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage(stdout);
            return 0;
        }
        int rc = hm_train_opt(&o, argc, argv, &i);
        if (rc == 0)
            rc = parse_own(&t, argc, argv, &i);
        if (rc < 0)
            return 64;
        if (rc == 0) {
            fprintf(stderr, "trainer: unknown option '%s'\n", argv[i]);
            usage(stderr);
            return 64;
        }
    }
    if (hm_train_opts_check(&o) < 0)
        return 64;
    if (t.socket == NULL) {
        fprintf(stderr, "trainer: --socket PATH is required\n");
        return 64;
    }
    if (hm_train_signals_block(&sigs) < 0) {
        perror("sigprocmask");
        return 1;
    }

    int rc = hmc_connect(t.socket, &r.h, err, sizeof(err));
    if (rc < 0) {
        fprintf(stderr, "trainer: %s\n", err);
        return 1;
    }
    if (hm_train_data_load(&d, &o) < 0)
        goto out;
    hm_model_config mc;
    hm_train_model_config(&o, &mc);
    rc = hm_model_new(&mc, &m);
    if (rc < 0) {
        fprintf(stderr, "trainer: model: %s\n", strerror(-rc));
        goto out;
    }
    size_t n_experts = o.grid[0] * o.grid[1], np = hm_model_nparams(m);
    size_t kbd = o.k_best * o.batch * o.dim * sizeof(float);
    r.G1 = o.grid[1];
    r.k_min = t.k_min;
    r.timeout_s = t.timeout_s;
    r.after_k_min_s = t.after_k_min_s;
    r.by_index = calloc(n_experts, sizeof(hmc_expert));
    r.live = calloc(n_experts, 1);
    snapshot = malloc(np * sizeof(float));
    if (r.by_index == NULL || r.live == NULL || snapshot == NULL)
        goto out;
    if ((rc = hmc_buf_alloc(r.h, o.batch * o.dim * sizeof(float), &r.xb)) < 0 ||
        (rc = hmc_buf_alloc(r.h, kbd, &r.yb)) < 0 || (rc = hmc_buf_alloc(r.h, kbd, &r.gyb)) < 0 ||
        (rc = hmc_buf_alloc(r.h, kbd, &r.gxb)) < 0 ||
        (rc = hmc_buf_alloc(r.h, np * sizeof(float), &pb)) < 0) {
        fprintf(stderr, "trainer: shared buffers: %s (%s)\n", strerror(-rc),
                hmc_last_error(r.h));
        goto out;
    }
    hm_model_experts ex = {.ud = &r, .forward = remote_forward, .backward = remote_backward};

    printf("config batch=%zu dim=%zu experts=%zux%zu k_best=%zu k_min=%zu params=%zu "
           "expert_prefix=%s average_prefix=%s average_every=%zu\n",
           o.batch, o.dim, o.grid[0], o.grid[1], o.k_best, t.k_min, np, t.expert_prefix,
           t.average_prefix, t.average_every);
    fflush(stdout);

    uint64_t start = hm_train_now_us();
    double last_t = 0, loss_sum = 0, acc = -1;
    size_t step = 0, since = 0, skipped = 0, samples_since_avg = 0;
    size_t rounds = 0, rounds_ok = 0, last_find = 0;
    int found_once = 0;
    const char *reason = "steps";
    for (;;) {
        if (o.steps != 0 && step >= o.steps)
            break;
        if (o.time_limit > 0 && hm_train_seconds(start) >= o.time_limit) {
            reason = "time";
            break;
        }
        if (hm_train_stop_requested(&sigs) != 0) {
            reason = "signal";
            break;
        }
        if (r.fatal) {
            reason = "error";
            break;
        }
        if (!found_once || step - last_find >= t.find_every) {
            rc = find_experts(&r, m, t.expert_prefix, o.grid);
            last_find = step;
            if (rc > 0 && !found_once)
                printf("experts t=%.2f live=%zu\n", hm_train_seconds(start), r.n_live);
            if (rc > 0)
                found_once = 1;
            else if (!found_once) {
                /* Nothing to train with yet: wait for the experts to be
                 * declared, polling the stop conditions above. */
                if (rc < 0 && r.calls_failed == 1)
                    fprintf(stderr, "trainer: experts find: %s\n", hmc_last_error(r.h));
                printf("experts t=%.2f live=0 waiting\n", hm_train_seconds(start));
                fflush(stdout);
                struct timespec two = {2, 0};
                if (sigtimedwait(&sigs, NULL, &two) > 0) {
                    reason = "signal";
                    break;
                }
                continue;
            }
        }

        hm_train_next_batch(&d);
        hm_model_result res;
        rc = hm_model_train_step(m, &ex, d.x, d.y, o.batch, &res);
        if (rc < 0) {
            skipped++;
            step++;
            continue;
        }
        step++;
        since++;
        loss_sum += res.loss;
        samples_since_avg += o.batch;

        /* A finished round: apply the delayed update. */
        if (round != NULL && hmc_round_done(round)) {
            char *report = NULL;
            int arc = hmc_round_wait(round, 0, &report);
            const float *avg = hmc_buf_data(pb);
            float *p = hm_model_params(m);
            if (arc == 0) {
                for (size_t i = 0; i < np; i++)
                    p[i] += avg[i] - snapshot[i];
                rounds_ok++;
            }
            printf("avg t=%.2f step=%zu status=%s group=%d\n", hm_train_seconds(start), step,
                   arc == 0 ? "ok" : (hmc_round_error_code(round)[0] != '\0'
                                          ? hmc_round_error_code(round) : strerror(-arc)),
                   report_group_size(report));
            fflush(stdout);
            hmc_free_string(report);
            hmc_round_free(round);
            round = NULL;
        }
        if (round == NULL && t.average_every != 0 && step % t.average_every == 0) {
            memcpy(snapshot, hm_model_params(m), np * sizeof(float));
            memcpy(hmc_buf_data(pb), snapshot, np * sizeof(float));
            hmc_avg_opts ao;
            hmc_avg_opts_init(&ao);
            ao.prefix = t.average_prefix;
            ao.weight = (double)samples_since_avg;
            ao.target_group_size = (int)t.group_size;
            rc = hmc_average_start(r.h, pb, 0, np, &ao, &round);
            if (rc < 0) {
                fprintf(stderr, "trainer: average: %s (%s)\n", strerror(-rc),
                        hmc_last_error(r.h));
                round = NULL;
            } else {
                rounds++;
                samples_since_avg = 0;
            }
        }

        if (step % o.print_every == 0) {
            double now = hm_train_seconds(start);
            printf("train t=%.2f step=%zu loss=%.4f sps=%.1f failed=%zu experts=%zu\n", now,
                   step, since ? loss_sum / (double)since : 0.0,
                   (double)(since * o.batch) / (now - last_t), skipped, r.n_live);
            fflush(stdout);
            last_t = now;
            loss_sum = 0;
            since = 0;
        }
        if (o.eval_every != 0 && step % o.eval_every == 0) {
            size_t efail = 0;
            acc = hm_train_evaluate(m, &ex, &d, &efail);
            printf("eval t=%.2f step=%zu acc=%.4f failed_batches=%zu\n", hm_train_seconds(start),
                   step, acc, efail);
            fflush(stdout);
            last_t = hm_train_seconds(start);
        }
    }
    /* Let a round in flight finish briefly, so that its update is not lost
     * to an ordinary stop; a round still running after that is abandoned. */
    if (round != NULL) {
        char *report = NULL;
        if (hmc_round_wait(round, 2000, &report) == 0) {
            const float *avg = hmc_buf_data(pb);
            float *p = hm_model_params(m);
            for (size_t i = 0; i < np; i++)
                p[i] += avg[i] - snapshot[i];
            rounds_ok++;
        }
        hmc_free_string(report);
        hmc_round_free(round);
        round = NULL;
    }
    size_t efail = 0;
    if (!r.fatal && found_once)
        acc = hm_train_evaluate(m, &ex, &d, &efail);
    printf("done t=%.2f step=%zu acc=%.4f reason=%s failed=%zu rounds=%zu rounds_ok=%zu "
           "expert_calls_failed=%zu\n",
           hm_train_seconds(start), step, acc < 0 ? 0.0 : acc, reason, skipped, rounds, rounds_ok,
           r.calls_failed);
    fflush(stdout);
    result = r.fatal ? 1 : 0;
out:
    hmc_round_free(round);
    hmc_buf_free(pb);
    hmc_buf_free(r.xb);
    hmc_buf_free(r.yb);
    hmc_buf_free(r.gyb);
    hmc_buf_free(r.gxb);
    hmc_close(r.h);
    free(r.by_index);
    free(r.live);
    free(snapshot);
    hm_model_free(m);
    hm_train_data_free(&d);
    return result;
}

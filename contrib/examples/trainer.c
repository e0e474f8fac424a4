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
 *           [--group-size 16] [--share-every 0] [--state-prefix fmnist]
 *           [--load-state] [--load-timeout 60] [--min-agree 1]
 *           [common options: train_common.h]
 *
 * Experts. The grid PREFIX.i.j (G0 x G1, from --experts) is looked up with
 * hmc_experts_find at start and every --find-every steps, with equal
 * scores and k_best = G0 * G1, so that it returns every live expert; the
 * model then picks its k_best by the gate among those (hm_model_set_
 * available): per sample by default (--routing sample, each sample its own
 * k_best, one hmc_experts_forward_routed call with each expert's rows, k_min
 * per sample, backward only with the rows an expert answered), or for the
 * whole batch (--routing batch, hmc_experts_forward). --switch is a Switch
 * layer (model.h). A forward call succeeds once k_min experts answered (at
 * most --timeout seconds, then --timeout-after-k-min more for the rest); a
 * step with fewer is skipped and counted. The experts step their own
 * optimizer on backward. An expert that did not answer a forward is left
 * out of the gate's choice for --backoff seconds (doubling at each further
 * silence up to 20 times it, forgiven at its first answer), lookups
 * included, so that a stopped or dead host costs one timeout per expert
 * and back-off, not one per step or lookup (its DHT declaration outlives it
 * by up to a minute); when the back-off runs out the expert is probed by
 * a routed call with k_min 0, which waits --timeout-after-k-min at most.
 * A lookup blocks training for up to --find-timeout (default --timeout);
 * one that fails keeps the experts of the last.
 *
 * Averaging with a delayed update. Every --average-every steps (when no
 * round is running) the parameters are copied into a shared buffer and a
 * round starts in the background with weight = samples trained since the
 * last round started; training goes on meanwhile. When the round is done,
 * the update is params += averaged - snapshot, so the steps taken during
 * the round are kept. A failed round (no group, timeout) changes nothing.
 *
 * DiLoCo (--diloco). The model's own Adam takes --inner-steps steps, then
 * hmc_diloco_step averages the pseudo-gradients (outer parameters minus
 * local ones) with the run's other trainers and takes the outer Nesterov
 * step; the parameters become the new outer ones. Every trainer must
 * start from the same outer parameters, so the initial weights come from
 * --init-seed (1 unless given) rather than --seed. The library shares the
 * outer state after each outer step, and --load-state makes a newcomer
 * load it at hmc_diloco_begin. Each outer step prints an "outer" line
 * whose params= sum (FNV-1a over the parameters' bytes) lets a script see
 * that the trainers of a round hold the same parameters.
 *
 * State for newcomers. Every --share-every steps the trainer publishes its
 * local parameters with the daemon's state.share under --state-prefix,
 * so that a trainer that joins later can start from the swarm's state
 * instead of from scratch. The step it shares under is the swarm step: its
 * own steps plus the step of the state it loaded, so that the newest state
 * is the one trained longest. With --load-state a trainer first downloads
 * that newest state (state.load, from several donors at once, every chunk
 * checked against the manifest's hashes) and prints its test accuracy
 * before its first step. --min-agree (default 1) is how many donors must
 * declare the same state: trainers that average with a delayed update hold
 * equal parameters only right after a round, and each goes on stepping
 * with its own batches, so two donors almost never share the same bytes
 * and a higher value would find no agreement. The experts' parameters
 * live on their servers and need no download; the local optimizer's
 * moments are not part of the state (Adam starts afresh, which moves each
 * parameter by at most about the learning rate per step).
 *
 * Output: the lines of train_common.h; the train lines carry
 * failed=STEPS_SKIPPED experts=LIVE silent=LEFT_OUT_UNTIL_THE_NEXT_LOOKUP.
 * Rounds print "avg" lines, a failed share a "share" line, and
 * --load-state one "load" line before the first step:
 *   avg t=SECONDS step=N status=ok|CODE group=SIZE
 *   share t=SECONDS step=N status=CODE
 *   load t=SECONDS status=ok|CODE step=SWARM_STEP donors=N bytes=B acc=TEST_ACCURACY
 *   begin t=SECONDS round=R loaded=0|1 inner_steps=0            (--diloco)
 *   outer t=SECONDS step=N round=R status=ok|CODE group=SIZE caught_up=0|1
 *         norm=PSEUDO_GRADIENT_NORM avg_s=SECONDS params=HEX    (--diloco)
 * (with --diloco the load line's step is the outer round and donors 0).
 * SIGINT or SIGTERM ends training after the current step with a done line.
 *
 * Exit status: 0 when it trained to the end or was stopped by a signal, 64
 * on a usage error, 1 otherwise (no daemon, the daemon went away).
 */
#include "config.h"

#include "lib/hivemind.h"
#include "contrib/examples/model.h"
#include "contrib/examples/train_common.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct remote {
    hmc *h;
    hmc_buf *xb, *yb, *gyb, *gxb;
    hmc_buf *rb;          /* per-sample routes, [batch, k_best] int32 */
    hmc_expert *rlist;    /* [G0 * G1]: a routed call's experts */
    int *rans;            /* [G0 * G1]: their answers */
    uint64_t *out_until;  /* [G0 * G1]: a silent expert is left out until then (us) */
    uint64_t *out_period; /* [G0 * G1]: its back-off (us), 0: in good standing */
    uint64_t backoff_us;  /* --backoff: the first back-off, doubled to 20 times it */
    size_t G1;
    hmc_expert *by_index; /* [G0 * G1]: found experts at their grid index */
    uint8_t *live;        /* [G0 * G1]: found in the last lookup */
    uint8_t *avail;       /* [G0 * G1]: live and not silent since that lookup */
    int avail_changed;    /* avail lost an expert: tell the model */
    hm_model *m;          /* whose choice avail restricts */
    size_t n_experts;     /* G0 * G1 */
    size_t n_live;
    size_t k_min;
    double timeout_s, after_k_min_s;
    double find_timeout_s; /* --find-timeout: a lookup blocks training this long at most */
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
    size_t share_every;
    const char *state_prefix;
    int load_state;
    double load_timeout_s;
    size_t min_agree;
    int collaborative;          /* train through hmc_opt_* instead */
    size_t target_batch_size;
    double matchmaking_time_s, averaging_timeout_s; /* --collaborative; 0: the library's */
    int delay_step, local_updates;
    double backoff_s;           /* --backoff: a silent expert's first back-off */
    double find_timeout_s;      /* --find-timeout, 0: --timeout */
    /* -- DiLoCo options -- */
    int diloco;                 /* train through hmc_diloco_* instead */
    unsigned inner_steps;       /* H */
    double outer_lr, outer_momentum;
    const char *compression;    /* --collaborative, --diloco: the rounds' wire form */
    int init_seed_set;
    uint64_t init_seed;         /* the initial weights' seed (default --seed; --diloco: 1) */
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
            "  --backoff S              leave an expert that did not answer out for S seconds,\n"
            "                           doubling at each further silence up to 20 S, lookups\n"
            "                           included (default 15)\n"
            "  --find-timeout S         a lookup's deadline (default: --timeout); one that\n"
            "                           fails keeps the last lookup's experts\n"
            "  --average-every N        start an averaging round every N steps (default 100,\n"
            "                           0: never)\n"
            "  --average-prefix P       what the parameters are averaged under\n"
            "                           (default fmnist.params)\n"
            "  --group-size N           target averaging group size (default 16)\n"
            "  --share-every N          share the parameters for newcomers every N steps\n"
            "                           (default 0: never)\n"
            "  --state-prefix P         what the state is shared under (default fmnist)\n"
            "  --load-state             start from the newest state shared in the swarm\n"
            "  --load-timeout S         how long to try downloading it (default 60)\n"
            "  --min-agree N            donors that must declare the same state (default 1)\n"
            "  --collaborative          train with the collaborative optimizer: accumulate\n"
            "                           gradients until the swarm's samples reach the target\n"
            "                           batch size, average them weighted by samples, then\n"
            "                           step (replaces --average-every; run id: the state\n"
            "                           prefix)\n"
            "  --target-batch-size N    samples per swarm epoch with --collaborative\n"
            "                           (default 1024)\n"
            "  --matchmaking-time S     --collaborative: matchmaking starts this long before\n"
            "                           the epoch's estimated end (default 5)\n"
            "  --averaging-timeout S    --collaborative: the gradient round's deadline, then\n"
            "                           the local gradients (default 30)\n"
            "  --delay-step             --collaborative: step one epoch late, the round in\n"
            "                           the background\n"
            "  --local-updates          --collaborative: step every batch, average the state\n"
            "                           at epoch ends by the delta rule (not with\n"
            "                           --delay-step)\n"
            "  --diloco                 train with DiLoCo: --inner-steps local Adam steps, then\n"
            "                           the swarm averages the pseudo-gradients (outer\n"
            "                           parameters minus local ones) and every trainer takes\n"
            "                           the same outer Nesterov step (replaces --average-every;\n"
            "                           run id: the state prefix; --load-state loads the run's\n"
            "                           outer state; --matchmaking-time and --averaging-timeout\n"
            "                           apply to its rounds)\n"
            "  --inner-steps H          --diloco: local steps per outer step, 1 to 1000000\n"
            "                           (default 500)\n"
            "  --outer-lr X             --diloco: the outer learning rate, in (0, 10]\n"
            "                           (default 0.7)\n"
            "  --outer-momentum X       --diloco: the outer Nesterov momentum, in [0, 1)\n"
            "                           (default 0.9; 0: plain SGD)\n"
            "  --compression C          --collaborative, --diloco: the rounds' wire form:\n"
            "                           none, fp16 or 8bit (default none)\n"
            "  --init-seed S            the initial weights' seed (default: --seed; with\n"
            "                           --diloco 1, since trainers that start together must\n"
            "                           start from the same outer parameters)\n"
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

/*
 * Leaves the experts that did not answer out of the gate's choice for a
 * back-off (--backoff, doubling at each further silence up to 20 times
 * it), lookups included: a stopped host's declarations outlive it by a
 * minute, and each lookup that brought its experts back would cost a
 * timeout again. An expert that answers is forgiven.
 */
static void mark_silent(struct remote *r, const size_t *experts, size_t k, const int *ans)
{
    uint64_t now = hm_train_now_us();
    for (size_t e = 0; e < k; e++) {
        size_t x = experts[e];
        if (ans != NULL && ans[e]) {
            r->out_period[x] = 0;
            continue;
        }
        uint64_t p = r->out_period[x];
        p = p == 0 ? r->backoff_us : (2 * p > 20 * r->backoff_us ? 20 * r->backoff_us : 2 * p);
        r->out_period[x] = p;
        r->out_until[x] = now + p;
        if (r->avail[x]) {
            r->avail[x] = 0;
            r->avail_changed = 1;
        }
    }
}

/* Live experts whose back-off ran out are chosen again (on probation). */
static void expire_backoffs(struct remote *r)
{
    uint64_t now = hm_train_now_us();
    for (size_t e = 0; e < r->n_experts; e++) {
        if (r->live[e] && !r->avail[e] && now >= r->out_until[e]) {
            r->avail[e] = 1;
            r->avail_changed = 1;
        }
    }
}

/* Whether one of experts is tried again after a back-off and has not answered since. */
static int any_on_probation(const struct remote *r, const size_t *experts, size_t n)
{
    for (size_t e = 0; e < n; e++)
        if (r->out_period[experts[e]] != 0)
            return 1;
    return 0;
}

/*
 * The model's choice follows avail; when every expert fell silent, all
 * found ones are tried again. Called from the forward callback: the model
 * chose this batch's experts already, and the mask only steers the next
 * choice (evaluation batches included).
 */
static void apply_avail(struct remote *r)
{
    size_t n = 0, n_experts = r->n_experts;
    if (!r->avail_changed)
        return;
    r->avail_changed = 0;
    for (size_t e = 0; e < n_experts; e++)
        n += r->avail[e] != 0;
    if (n == 0)
        memcpy(r->avail, r->live, n_experts);
    if (r->n_live > 0)
        hm_model_set_available(r->m, r->avail);
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
    if (rc < 0) {
        /* Too few answered: all of them count as silent (ans is not set). */
        if (rc == -EREMOTEIO || rc == -ETIMEDOUT) {
            mark_silent(r, experts, k, NULL);
            apply_avail(r);
        }
        return note_failure(r, rc, "experts forward");
    }
    map_answered(ans, k, answered);
    mark_silent(r, experts, k, ans);
    apply_avail(r);
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
 * Per-sample routing: one call per expert with the rows routed to it
 * (hmc_experts_forward_routed). k_min counts per sample, as the library
 * does; a Switch layer (allow_zero) asks for none and waits at most
 * --timeout-after-k-min. An expert that did not answer is left out until
 * the next lookup, as in the per-batch path.
 */
static int remote_forward_routed(void *ud, const size_t *experts, size_t n,
                                 const int32_t *routes, size_t slots, const float *h,
                                 size_t batch, size_t dim, int allow_zero, float *y_out,
                                 uint8_t *answered)
{
    struct remote *r = ud;
    size_t n_ans = 0;
    for (size_t e = 0; e < n; e++)
        r->rlist[e] = r->by_index[experts[e]];
    memcpy(hmc_buf_data(r->xb), h, batch * dim * sizeof(float));
    memcpy(hmc_buf_data(r->rb), routes, batch * slots * sizeof(int32_t));
    size_t k_min = allow_zero ? 0 : (r->k_min < slots ? r->k_min : slots);
    /*
     * An expert on probation that is still silent would hold a sample
     * routed only to silent ones until --timeout; with k_min 0 the call
     * waits --timeout-after-k-min at most, and the model fails the step
     * only if some sample got no answer at all.
     */
    if (k_min > 0 && any_on_probation(r, experts, n)) {
        k_min = 0;
        allow_zero = 1;
    }
    int rc = hmc_experts_forward_routed(r->h, r->rlist, n, r->rb, 0, slots, r->xb, 0, r->yb, 0,
                                        batch, dim, k_min, allow_zero, r->timeout_s,
                                        r->after_k_min_s, r->rans, &n_ans);
    if (rc < 0 && (rc == -EREMOTEIO || rc == -ETIMEDOUT) && !allow_zero) {
        /*
         * Some sample had fewer than k_min answers, and a failed call does
         * not say who answered. Marking all silent would route the next
         * batch the same way (all silent is all live again); so ask once
         * more with k_min 0, which waits at most --timeout-after-k-min and
         * skips hosts the daemon backs off: its answers say exactly which
         * experts to leave out, and the model drops the samples' experts
         * that did not answer (a sample left with none fails the step).
         */
        note_failure(r, rc, "experts forward");
        rc = hmc_experts_forward_routed(r->h, r->rlist, n, r->rb, 0, slots, r->xb, 0, r->yb, 0,
                                        batch, dim, 0, 1, r->timeout_s, r->after_k_min_s,
                                        r->rans, &n_ans);
    }
    if (rc < 0) {
        if (rc == -EREMOTEIO || rc == -ETIMEDOUT) {
            mark_silent(r, experts, n, NULL);
            apply_avail(r);
        }
        return note_failure(r, rc, "experts forward");
    }
    map_answered(r->rans, n, answered);
    mark_silent(r, experts, n, r->rans);
    apply_avail(r);
    memcpy(y_out, hmc_buf_data(r->yb), batch * slots * dim * sizeof(float));
    return 0;
}

static int remote_backward_routed(void *ud, const size_t *experts, size_t n,
                                  const int32_t *routes, size_t slots, const float *h,
                                  const float *gy, size_t batch, size_t dim, int allow_zero,
                                  float *gh_out, uint8_t *answered)
{
    struct remote *r = ud;
    size_t n_ans = 0;
    for (size_t e = 0; e < n; e++)
        r->rlist[e] = r->by_index[experts[e]];
    memcpy(hmc_buf_data(r->xb), h, batch * dim * sizeof(float));
    memcpy(hmc_buf_data(r->rb), routes, batch * slots * sizeof(int32_t));
    memcpy(hmc_buf_data(r->gyb), gy, batch * slots * dim * sizeof(float));
    /* One answer per sample, as the per-batch backward asks for one. */
    int rc = hmc_experts_backward_routed(r->h, r->rlist, n, r->rb, 0, slots, r->xb, 0, r->gyb,
                                         0, r->gxb, 0, batch, dim, allow_zero ? 0 : 1,
                                         allow_zero, r->timeout_s, r->rans, &n_ans);
    if (rc < 0)
        return note_failure(r, rc, "experts backward");
    map_answered(r->rans, n, answered);
    memcpy(gh_out, hmc_buf_data(r->gxb), batch * slots * dim * sizeof(float));
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
    result = hmc_experts_find(r->h, prefix, scores, grid, 2, n, r->find_timeout_s, out, n,
                              &found, NULL);
    if (result < 0) {
        note_failure(r, result, "experts find");
        goto out;
    }
    memset(r->live, 0, n);
    r->n_live = 0;
    r->avail_changed = 0;
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
    uint64_t now = hm_train_now_us();
    for (size_t e = 0; e < n; e++)
        r->avail[e] = r->live[e] && now >= r->out_until[e];
    r->avail_changed = 1;
    apply_avail(r);
    (void)m;
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

/*
 * The arguments of state.share (step >= 0) or state.load (step < 0) as
 * JSON text to free(), or NULL when out of memory. Built with jansson so
 * that any prefix is quoted correctly.
 */
static char *request_args(const char *prefix, json_int_t step, double timeout_s,
                          size_t min_agree, uint64_t shm, size_t np)
{
    json_t *a = json_pack("{s:s, s:{s:I, s:i, s:I}}", "prefix", prefix, "data", "shm",
                          (json_int_t)shm, "offset", 0, "elems", (json_int_t)np);
    char *text = NULL;
    if (a == NULL)
        return NULL;
    if (step >= 0) {
        /* The declaration outlives a few shares of a slow trainer. */
        if (json_object_set_new(a, "step", json_integer(step)) < 0 ||
            json_object_set_new(a, "ttl", json_integer(120)) < 0)
            goto out;
    } else {
        if (json_object_set_new(a, "timeout", json_real(timeout_s)) < 0 ||
            json_object_set_new(a, "min_agree", json_integer((json_int_t)min_agree)) < 0)
            goto out;
    }
    text = json_dumps(a, JSON_COMPACT);
out:
    json_decref(a);
    return text;
}

/*
 * Publishes params (np floats, copied into the shared buffer sb) under
 * prefix at the given swarm step. The daemon copies the bytes out before
 * it answers, so sb is free again on return.
 */
static int share_state(hmc *h, hmc_buf *sb, const float *params, size_t np, const char *prefix,
                       uint64_t step)
{
    memcpy(hmc_buf_data(sb), params, np * sizeof(float));
    char *args = request_args(prefix, (json_int_t)step, 0, 0, hmc_buf_id(sb), np);
    if (args == NULL)
        return -ENOMEM;
    int result = hmc_request(h, "state.share", args, NULL);
    free(args);
    return result;
}

/*
 * Downloads the newest state under prefix into sb and, when it is exactly
 * np floats, copies it into params. *step_out gets its swarm step,
 * *donors_out how many donors served it. A failed attempt is retried
 * until the timeout: a newcomer may start before any donor declared
 * itself, and a donor keeps only its newest state, so a download of a step
 * that the donor replaced meanwhile fails ("unreachable") and the next
 * attempt finds the newer step.
 */
static int load_state(hmc *h, hmc_buf *sb, float *params, size_t np, const char *prefix,
                      double timeout_s, size_t min_agree, uint64_t *step_out,
                      size_t *donors_out, size_t *bytes_out)
{
    char *res = NULL;
    uint64_t t0 = hm_train_now_us();
    int result;
    for (;;) {
        double left = timeout_s - hm_train_seconds(t0);
        if (left < 1)
            left = 1;
        char *args = request_args(prefix, -1, left, min_agree, hmc_buf_id(sb), np);
        if (args == NULL)
            return -ENOMEM;
        /* The reply comes when the download is done: wait past its timeout. */
        hmc_free_string(res);
        res = NULL;
        hmc_set_timeout(h, (int)((left + 10) * 1000));
        result = hmc_request(h, "state.load", args, &res);
        hmc_set_timeout(h, HMC_DEFAULT_TIMEOUT_MS);
        free(args);
        if (result == 0 || (result != -EREMOTEIO && result != -ETIMEDOUT) ||
            strcmp(hmc_last_error_code(h), "no_space") == 0 ||
            strcmp(hmc_last_error_code(h), "bad_args") == 0 ||
            hm_train_seconds(t0) + 1 > timeout_s)
            break;
        fprintf(stderr, "trainer: state.load: %s; trying again\n", hmc_last_error(h));
        struct timespec one = {1, 0};
        nanosleep(&one, NULL);
    }
    if (result < 0)
        goto out;
    json_t *j = json_loads(res, 0, NULL);
    json_t *bytes = j ? json_object_get(j, "bytes") : NULL;
    json_t *step = j ? json_object_get(j, "step") : NULL;
    json_t *donors = j ? json_object_get(j, "donors") : NULL;
    if (!json_is_integer(bytes) || !json_is_integer(step) || !json_is_array(donors)) {
        result = -EPROTO;
    } else if ((size_t)json_integer_value(bytes) != np * sizeof(float)) {
        /* A state of another model shape (other --dim or --experts). */
        fprintf(stderr, "trainer: the shared state has %lld bytes, this model %zu\n",
                (long long)json_integer_value(bytes), np * sizeof(float));
        result = -EMSGSIZE;
    } else {
        size_t served = 0, k;
        json_t *dn;
        json_array_foreach(donors, k, dn) {
            json_t *c = json_object_get(dn, "chunks");
            if (json_is_integer(c) && json_integer_value(c) > 0)
                served++;
        }
        memcpy(params, hmc_buf_data(sb), np * sizeof(float));
        *step_out = (uint64_t)json_integer_value(step);
        *donors_out = served;
        *bytes_out = np * sizeof(float);
    }
    json_decref(j);
out:
    hmc_free_string(res);
    return result;
}

/* The collaborative optimizer's local step: the model's own optimizer on the averaged gradients. */
static void model_step(void *ud, float *params, const float *grads, size_t n)
{
    hm_model *m = ud;
    (void)params; /* hm_model_step updates hm_model_params(m), which params is */
    /* The model keeps its gradient in the buffer hm_model_grad shows. */
    memcpy((float *)(uintptr_t)hm_model_grad(m), grads, n * sizeof(float));
    hm_model_step(m);
}

/* -- DiLoCo options -- */
/* --inner-steps (0), --outer-lr (1), --outer-momentum (2), --compression (3), --init-seed (4). */
static int parse_diloco(struct trainer_opts *t, const char *name, size_t which, const char *val)
{
    char *end;
    errno = 0;
    if (which == 3) {
        if (strcmp(val, "none") != 0 && strcmp(val, "fp16") != 0 && strcmp(val, "8bit") != 0) {
            fprintf(stderr, "%s: '%s' is not one of none, fp16, 8bit\n", name, val);
            return -EINVAL;
        }
        t->compression = val;
        return 1;
    }
    if (which == 1 || which == 2) {
        double x = strtod(val, &end);
        if (errno != 0 || end == val || *end != '\0' || !isfinite(x) ||
            (which == 1 && !(x > 0 && x <= 10)) || (which == 2 && !(x >= 0 && x < 1))) {
            fprintf(stderr, "%s: '%s' is not a number in %s\n", name, val,
                    which == 1 ? "(0, 10]" : "[0, 1)");
            return -EINVAL;
        }
        *(which == 1 ? &t->outer_lr : &t->outer_momentum) = x;
        return 1;
    }
    unsigned long long x = strtoull(val, &end, 10);
    unsigned long long max = which == 0 ? 1000000ull : UINT64_MAX;
    if (errno != 0 || end == val || *end != '\0' || val[0] == '-' || x > max ||
        (which == 0 && x < 1)) {
        fprintf(stderr, "%s: '%s' is not a whole number in [%d, %llu]\n", name, val,
                which == 0 ? 1 : 0, max);
        return -EINVAL;
    }
    if (which == 0) {
        t->inner_steps = (unsigned)x;
    } else {
        t->init_seed = (uint64_t)x;
        t->init_seed_set = 1;
    }
    return 1;
}

/*
 * The options that only make sense together, checked once all are read:
 * 0, or -EINVAL after saying which.
 */
static int check_modes(const struct trainer_opts *t)
{
    int inner_set = t->inner_steps != 0, outer_set = t->outer_lr != 0 || t->outer_momentum >= 0;
    if (t->diloco && t->collaborative) {
        fprintf(stderr, "trainer: --diloco and --collaborative are two ways to train; pick one\n");
        return -EINVAL;
    }
    if (!t->collaborative && (t->delay_step || t->local_updates)) {
        fprintf(stderr, "trainer: --delay-step and --local-updates need --collaborative\n");
        return -EINVAL;
    }
    if (t->delay_step && t->local_updates) {
        /* The library would run each local step on a thread of its own, on
         * its copy of the parameters; the model's step (model_step) updates
         * the model's own parameters, which the next batch reads. */
        fprintf(stderr, "trainer: --delay-step and --local-updates exclude each other (the "
                        "local step is the model's own, on the parameters the next batch "
                        "uses; see lib/README.md)\n");
        return -EINVAL;
    }
    if (!t->diloco && (inner_set || outer_set)) {
        fprintf(stderr, "trainer: --inner-steps, --outer-lr and --outer-momentum need --diloco\n");
        return -EINVAL;
    }
    if (!t->diloco && !t->collaborative && t->compression != NULL) {
        fprintf(stderr, "trainer: --compression needs --collaborative or --diloco\n");
        return -EINVAL;
    }
    return 0;
}

/* FNV-1a over the parameters' bytes: equal parameters print equal sums. */
static uint64_t params_sum(const float *p, size_t n)
{
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n * sizeof(float); i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static int parse_own(struct trainer_opts *t, int argc, char **argv, int *i)
{
    static const char *const names[] = {"--socket", "--expert-prefix", "--average-prefix",
                                        "--k-min", "--timeout", "--timeout-after-k-min",
                                        "--find-every", "--average-every", "--group-size",
                                        "--share-every", "--state-prefix", "--load-timeout",
                                        "--min-agree", "--target-batch-size",
                                        "--matchmaking-time", "--averaging-timeout",
                                        "--backoff", "--find-timeout",
                                        /* -- DiLoCo options (from index 18) -- */
                                        "--inner-steps", "--outer-lr", "--outer-momentum",
                                        "--compression", "--init-seed"};
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
    if (which == count) {
        if (strcmp(arg, "--load-state") == 0) {
            t->load_state = 1;
            return 1;
        }
        if (strcmp(arg, "--collaborative") == 0) {
            t->collaborative = 1;
            return 1;
        }
        if (strcmp(arg, "--delay-step") == 0) {
            t->delay_step = 1;
            return 1;
        }
        if (strcmp(arg, "--local-updates") == 0) {
            t->local_updates = 1;
            return 1;
        }
        if (strcmp(arg, "--diloco") == 0) {
            t->diloco = 1;
            return 1;
        }
        return 0;
    }
    if (val == NULL) {
        if (*i + 1 >= argc) {
            fprintf(stderr, "%s needs a value\n", names[which]);
            return -EINVAL;
        }
        val = argv[++*i];
    }
    char *end;
    errno = 0;
    if (which >= 18)
        return parse_diloco(t, names[which], which - 18, val);
    if (which <= 2 || which == 10) {
        if (val[0] == '\0' || strlen(val) > 128) {
            fprintf(stderr, "%s: 1 to 128 characters\n", names[which]);
            return -EINVAL;
        }
        if (which == 0)
            t->socket = val;
        else if (which == 1)
            t->expert_prefix = val;
        else if (which == 10)
            t->state_prefix = val;
        else
            t->average_prefix = val;
        return 1;
    }
    if (which == 4 || which == 5 || which == 11 || which == 14 || which == 15 || which == 16 ||
        which == 17) {
        double x = strtod(val, &end);
        if (errno != 0 || end == val || *end != '\0' || !(x > 0) || x > 3600) {
            fprintf(stderr, "%s: '%s' is not a number of seconds in (0, 3600]\n", names[which],
                    val);
            return -EINVAL;
        }
        if (which == 17)
            t->find_timeout_s = x;
        else if (which == 16)
            t->backoff_s = x;
        else if (which == 14)
            t->matchmaking_time_s = x;
        else if (which == 15)
            t->averaging_timeout_s = x;
        else if (which == 11)
            t->load_timeout_s = x;
        else
            *(which == 4 ? &t->timeout_s : &t->after_k_min_s) = x;
        return 1;
    }
    unsigned long long x = strtoull(val, &end, 10);
    if (errno != 0 || end == val || *end != '\0' || val[0] == '-' || x > 1000000000ull) {
        fprintf(stderr, "%s: '%s' is not a whole number\n", names[which], val);
        return -EINVAL;
    }
    if ((which == 3 && (x < 1 || x > HM_MODEL_MAX_K)) || (which == 6 && x < 1) ||
        (which == 8 && (x < 1 || x > 64)) || (which == 12 && (x < 1 || x > 16)) ||
        (which == 13 && x < 1)) {
        fprintf(stderr, "%s: %llu is out of range\n", names[which], x);
        return -EINVAL;
    }
    if (which == 3)
        t->k_min = (size_t)x;
    else if (which == 6)
        t->find_every = (size_t)x;
    else if (which == 7)
        t->average_every = (size_t)x;
    else if (which == 8)
        t->group_size = (size_t)x;
    else if (which == 9)
        t->share_every = (size_t)x;
    else if (which == 13)
        t->target_batch_size = (size_t)x;
    else
        t->min_agree = (size_t)x;
    return 1;
}

int main(int argc, char **argv)
{
    hm_train_opts o;
    struct trainer_opts t = {.expert_prefix = "ffn", .average_prefix = "fmnist.params",
                             .k_min = 1, .timeout_s = 5, .after_k_min_s = 1,
                             .find_every = 200, .average_every = 100, .group_size = 16,
                             .state_prefix = "fmnist", .load_timeout_s = 60, .min_agree = 1,
                             .target_batch_size = 1024, .backoff_s = 15,
                             .outer_momentum = -1};
    hm_train_data d;
    hm_model *m = NULL;
    struct remote r;
    hmc_buf *pb = NULL, *sb = NULL;
    hmc_round *round = NULL;
    hmc_opt *opt = NULL;
    hmc_diloco *dl = NULL;
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
    if (hm_train_opts_check(&o) < 0 || check_modes(&t) < 0)
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
    if (t.init_seed_set)
        mc.seed = t.init_seed;
    else if (t.diloco)
        mc.seed = 1; /* the same outer parameters for every trainer of the run */
    rc = hm_model_new(&mc, &m);
    if (rc < 0) {
        fprintf(stderr, "trainer: model: %s\n", strerror(-rc));
        goto out;
    }
    size_t n_experts = o.grid[0] * o.grid[1], np = hm_model_nparams(m);
    size_t kbd = mc.k_best * o.batch * o.dim * sizeof(float);
    r.G1 = o.grid[1];
    r.m = m;
    r.n_experts = n_experts;
    r.k_min = t.k_min;
    r.timeout_s = t.timeout_s;
    r.after_k_min_s = t.after_k_min_s;
    r.find_timeout_s = t.find_timeout_s > 0 ? t.find_timeout_s : t.timeout_s;
    r.by_index = calloc(n_experts, sizeof(hmc_expert));
    r.live = calloc(n_experts, 1);
    r.avail = calloc(n_experts, 1);
    r.rlist = calloc(n_experts, sizeof(hmc_expert));
    r.rans = calloc(n_experts, sizeof(int));
    r.out_until = calloc(n_experts, sizeof(uint64_t));
    r.out_period = calloc(n_experts, sizeof(uint64_t));
    r.backoff_us = (uint64_t)(t.backoff_s * 1e6);
    snapshot = malloc(np * sizeof(float));
    if (r.by_index == NULL || r.live == NULL || r.avail == NULL || r.rlist == NULL ||
        r.rans == NULL || r.out_until == NULL || r.out_period == NULL || snapshot == NULL)
        goto out;
    if ((rc = hmc_buf_alloc(r.h, o.batch * o.dim * sizeof(float), &r.xb)) < 0 ||
        (rc = hmc_buf_alloc(r.h, kbd, &r.yb)) < 0 || (rc = hmc_buf_alloc(r.h, kbd, &r.gyb)) < 0 ||
        (rc = hmc_buf_alloc(r.h, kbd, &r.gxb)) < 0 ||
        (rc = hmc_buf_alloc(r.h, mc.k_best * o.batch * sizeof(int32_t), &r.rb)) < 0 ||
        (rc = hmc_buf_alloc(r.h, np * sizeof(float), &pb)) < 0 ||
        (rc = hmc_buf_alloc(r.h, np * sizeof(float), &sb)) < 0) {
        fprintf(stderr, "trainer: shared buffers: %s (%s)\n", strerror(-rc),
                hmc_last_error(r.h));
        goto out;
    }
    hm_model_experts ex = {.ud = &r, .forward = remote_forward, .backward = remote_backward,
                           .forward_routed = remote_forward_routed,
                           .backward_routed = remote_backward_routed};
    if (t.collaborative) {
        hmc_opt_opts oo;
        hmc_opt_opts_init(&oo);
        oo.run_id = t.state_prefix;
        oo.target_batch_size = t.target_batch_size;
        oo.batch_size_per_step = o.batch;
        oo.target_group_size = (int)t.group_size;
        oo.step = model_step;
        oo.step_ud = m;
        oo.matchmaking_time_s = t.matchmaking_time_s;
        oo.averaging_timeout_s = t.averaging_timeout_s;
        oo.delay_step = t.delay_step;
        oo.local_updates = t.local_updates;
        oo.compression = t.compression;
        t.average_every = 0; /* the optimizer averages, at each epoch's end */
        if ((rc = hmc_opt_open(r.h, &oo, np, &opt)) < 0) {
            fprintf(stderr, "trainer: collaborative optimizer: %s (%s)\n", strerror(-rc),
                    hmc_last_error(r.h));
            goto out;
        }
    }
    if (t.diloco) {
        hmc_diloco_opts dopts;
        hmc_diloco_opts_init(&dopts);
        dopts.run_id = t.state_prefix;
        if (t.inner_steps != 0)
            dopts.inner_steps = t.inner_steps;
        if (t.outer_lr != 0)
            dopts.outer_lr = t.outer_lr;
        if (t.outer_momentum >= 0)
            dopts.outer_momentum = t.outer_momentum;
        dopts.compression = t.compression;
        dopts.target_group_size = (int)t.group_size;
        dopts.min_group_size = t.group_size > 1 ? 2 : 1;
        dopts.timeout_s = t.averaging_timeout_s;
        dopts.round_timeout_s = t.averaging_timeout_s;
        dopts.matchmaking_time_s = t.matchmaking_time_s;
        /* Trainers that start together start from the same seed; a newcomer
         * asks for the run's outer state. */
        dopts.load_state = t.load_state;
        dopts.load_timeout_s = t.load_timeout_s;
        dopts.state_min_agree = (int)t.min_agree;
        t.average_every = 0; /* the outer step averages, every H steps */
        if ((rc = hmc_diloco_open(r.h, &dopts, np, &dl)) < 0) {
            fprintf(stderr, "trainer: DiLoCo: %s (%s)\n", strerror(-rc), hmc_last_error(r.h));
            goto out;
        }
    }

    printf("config batch=%zu dim=%zu experts=%zux%zu k_best=%zu k_min=%zu params=%zu "
           "expert_prefix=%s average_prefix=%s average_every=%zu mode=%s routing=%s\n",
           o.batch, o.dim, o.grid[0], o.grid[1], mc.k_best, t.k_min, np, t.expert_prefix,
           t.average_prefix, t.average_every,
           dl != NULL ? "diloco" : opt != NULL ? "collaborative" : "periodic",
           hm_train_routing_name(&o));
    fflush(stdout);

    uint64_t start = hm_train_now_us();
    /* The swarm step of the state this trainer started from (0: scratch). */
    uint64_t base_step = 0;
    int loaded = 0;
    char load_status[64] = "ok";
    size_t load_donors = 0, load_bytes = 0;
    if (dl != NULL) {
        hmc_diloco_report drep;
        rc = hmc_diloco_begin(dl, hm_model_params(m), &drep);
        if (rc < 0) {
            fprintf(stderr, "trainer: DiLoCo begin: %s\n", strerror(-rc));
            goto out;
        }
        loaded = drep.loaded;
        base_step = drep.round;
        if (t.load_state && !loaded) {
            snprintf(load_status, sizeof(load_status), "%s",
                     drep.code[0] != '\0' ? drep.code : "none");
            fprintf(stderr, "trainer: DiLoCo outer state: %s\n",
                    drep.error[0] != '\0' ? drep.error : "nobody shares one");
        }
        if (loaded)
            load_bytes = HMC_DILOCO_STATE_HEADER + 2 * np * sizeof(float);
        printf("begin t=%.2f round=%llu loaded=%d inner_steps=%u\n", hm_train_seconds(start),
               (unsigned long long)drep.round, drep.loaded, hmc_diloco_inner_count(dl));
        fflush(stdout);
    } else if (t.load_state) {
        rc = load_state(r.h, sb, hm_model_params(m), np, t.state_prefix, t.load_timeout_s,
                        t.min_agree, &base_step, &load_donors, &load_bytes);
        if (rc == -EPIPE) {
            fprintf(stderr, "trainer: state.load: the daemon went away\n");
            goto out;
        }
        if (rc < 0) {
            /* Training from scratch is still useful; the load line says why. */
            snprintf(load_status, sizeof(load_status), "%s",
                     hmc_last_error_code(r.h)[0] != '\0' ? hmc_last_error_code(r.h)
                                                         : strerror(-rc));
            fprintf(stderr, "trainer: state.load: %s\n", rc == -EREMOTEIO ? hmc_last_error(r.h)
                                                                         : strerror(-rc));
            base_step = 0;
        } else {
            loaded = 1;
        }
    }
    double last_t = 0, loss_sum = 0, bal_sum = 0, acc = -1;
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
            uint64_t find_t0 = hm_train_now_us();
            rc = find_experts(&r, m, t.expert_prefix, o.grid);
            last_find = step;
            double find_s = hm_train_seconds(find_t0);
            if (found_once && find_s > 0.5) {
                /* A lookup blocks training: a slow one is worth a line. */
                printf("lookup t=%.2f step=%zu seconds=%.2f live=%zu status=%s\n",
                       hm_train_seconds(start), step, find_s, r.n_live, rc >= 0 ? "ok" : "failed");
                fflush(stdout);
            }
            if (rc > 0 && !found_once) {
                printf("experts t=%.2f live=%zu\n", hm_train_seconds(start), r.n_live);
                if (t.load_state) {
                    /* The loaded state's accuracy before any step of ours:
                     * what the newcomer got from the swarm. */
                    size_t lfail = 0;
                    double lacc = loaded ? hm_train_evaluate(m, &ex, &d, &lfail) : 0.0;
                    printf("load t=%.2f status=%s step=%llu donors=%zu bytes=%zu acc=%.4f "
                           "failed_batches=%zu\n",
                           hm_train_seconds(start), load_status, (unsigned long long)base_step,
                           load_donors, load_bytes, lacc, lfail);
                }
                fflush(stdout);
            }
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

        expire_backoffs(&r);
        apply_avail(&r);
        hm_train_next_batch(&d);
        hm_model_result res;
        if (opt != NULL) {
            rc = hm_model_backward(m, &ex, d.x, d.y, o.batch, NULL, &res);
            hmc_opt_report orep;
            int orc = rc < 0 ? 0
                             : hmc_opt_step(opt, hm_model_grad(m), o.batch, hm_model_params(m),
                                            &orep);
            if (orc < 0) {
                note_failure(&r, orc, "collaborative step");
            } else if (rc >= 0 && orep.epoch_ended) {
                printf("epoch t=%.2f step=%zu epoch=%llu samples=%llu status=%s group=%d\n",
                       hm_train_seconds(start), step + 1, (unsigned long long)orep.epoch,
                       (unsigned long long)orep.samples, orep.averaged ? "ok" : "local",
                       orep.group_size);
                fflush(stdout);
            }
        } else {
            rc = hm_model_train_step(m, &ex, d.x, d.y, o.batch, &res);
        }
        if (rc >= 0 && dl != NULL) {
            hmc_diloco_report drep;
            int drc = hmc_diloco_step(dl, hm_model_params(m), &drep);
            if (drc < 0) {
                /* -EDOM: the inner steps diverged to NaN or infinity. */
                fprintf(stderr, "trainer: DiLoCo outer step: %s\n", strerror(-drc));
                r.fatal = 1;
            } else if (drc == 1) {
                rounds++;
                rounds_ok += drep.averaged != 0;
                printf("outer t=%.2f step=%zu round=%llu status=%s group=%d caught_up=%d "
                       "norm=%.4g avg_s=%.2f params=%016llx\n",
                       hm_train_seconds(start), step + 1, (unsigned long long)drep.round,
                       drep.averaged ? "ok"
                                     : (drep.code[0] != '\0' ? drep.code : "local"),
                       drep.group_size, drep.caught_up, drep.pseudo_grad_norm, drep.average_s,
                       (unsigned long long)params_sum(hm_model_params(m), np));
                fflush(stdout);
            }
        }
        if (rc < 0) {
            skipped++;
            step++;
            continue;
        }
        step++;
        since++;
        loss_sum += res.loss;
        bal_sum += res.balancing_loss;
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

        if (t.share_every != 0 && step % t.share_every == 0) {
            rc = share_state(r.h, sb, hm_model_params(m), np, t.state_prefix, base_step + step);
            if (rc == -EPIPE) {
                r.fatal = 1;
            } else if (rc < 0) {
                printf("share t=%.2f step=%llu status=%s\n", hm_train_seconds(start),
                       (unsigned long long)(base_step + step),
                       hmc_last_error_code(r.h)[0] != '\0' ? hmc_last_error_code(r.h)
                                                           : strerror(-rc));
                fflush(stdout);
            }
        }

        if (step % o.print_every == 0) {
            double now = hm_train_seconds(start);
            size_t n_avail = 0;
            for (size_t e = 0; e < n_experts; e++)
                n_avail += r.avail[e] != 0;
            char bal[48] = "";
            if (o.switch_layer)
                snprintf(bal, sizeof(bal), " balance=%.4f",
                         since ? bal_sum / (double)since : 0.0);
            printf("train t=%.2f step=%zu loss=%.4f sps=%.1f failed=%zu experts=%zu "
                   "silent=%zu%s\n",
                   now, step, since ? loss_sum / (double)since : 0.0,
                   (double)(since * o.batch) / (now - last_t), skipped, r.n_live,
                   r.n_live - n_avail, bal);
            fflush(stdout);
            last_t = now;
            loss_sum = 0;
            bal_sum = 0;
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
    hmc_diloco_close(dl);
    hmc_opt_close(opt);
    hmc_round_free(round);
    hmc_buf_free(pb);
    hmc_buf_free(sb);
    hmc_buf_free(r.xb);
    hmc_buf_free(r.yb);
    hmc_buf_free(r.gyb);
    hmc_buf_free(r.gxb);
    hmc_buf_free(r.rb);
    hmc_close(r.h);
    free(r.by_index);
    free(r.live);
    free(r.avail);
    free(r.rlist);
    free(r.rans);
    free(r.out_until);
    free(r.out_period);
    free(snapshot);
    hm_model_free(m);
    hm_train_data_free(&d);
    return result;
}

/*
 * train_local: the baseline for the swarm trainer. The same model
 * (model.h) and the same mixture of G0 x G1 feed-forward experts
 * (moe/ffn.h), trained on Fashion-MNIST in one process with no swarm: the
 * experts are hm_ffn objects called in-process and step their own
 * optimizer on backward, exactly as expert servers do. It prints the lines
 * described in train_common.h, so its curve can be set beside trainer's.
 *
 *   train_local [--steps N] [--batch B] [--dim D] [--experts 4x4]
 *               [--k-best K] [--eval-every N] [--seed S] [--time-limit S] ...
 *
 * Exit status: 0 when it trained to the end (or was stopped by SIGINT /
 * SIGTERM after a summary line), 64 on a usage error, 1 otherwise.
 */
#include "config.h"

#include "moe/ffn.h"
#include "contrib/examples/model.h"
#include "contrib/examples/train_common.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f)
{
    fprintf(f, "usage: train_local [OPTIONS]\n"
               "Trains the example mixture-of-experts classifier on Fashion-MNIST in one\n"
               "process (the experts in-process), printing train/eval/done lines.\n\n%s"
               "  -h, --help         this text\n",
            hm_train_common_usage);
}

int main(int argc, char **argv)
{
    hm_train_opts o;
    hm_train_data d;
    hm_model *m = NULL;
    hm_ffn **experts = NULL;
    size_t n_experts = 0;
    sigset_t sigs;
    int result = 1;

    memset(&d, 0, sizeof(d));
    hm_train_opts_default(&o);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage(stdout);
            return 0;
        }
        int r = hm_train_opt(&o, argc, argv, &i);
        if (r < 0)
            return 64;
        if (r == 0) {
            fprintf(stderr, "train_local: unknown option '%s'\n", argv[i]);
            usage(stderr);
            return 64;
        }
    }
    if (hm_train_opts_check(&o) < 0)
        return 64;
    if (hm_train_signals_block(&sigs) < 0) {
        perror("sigprocmask");
        return 1;
    }
    if (hm_train_data_load(&d, &o) < 0)
        goto out;

    hm_model_config mc;
    hm_train_model_config(&o, &mc);
    int rc = hm_model_new(&mc, &m);
    if (rc < 0) {
        fprintf(stderr, "train_local: model: %s\n", strerror(-rc));
        goto out;
    }
    n_experts = o.grid[0] * o.grid[1];
    experts = calloc(n_experts, sizeof(*experts));
    if (experts == NULL)
        goto out;
    for (size_t e = 0; e < n_experts; e++) {
        /* The experts' defaults as a server would use them: Adam, lr 1e-3,
         * each seeded by its position so that a run is reproducible. */
        hm_ffn_config fc = {.dim = o.dim, .hidden = o.hidden, .optimizer = HM_FFN_ADAM,
                            .lr = o.lr, .seed = o.seed * 1000003u + e};
        rc = hm_ffn_new(&fc, &experts[e]);
        if (rc < 0) {
            fprintf(stderr, "train_local: expert: %s\n", strerror(-rc));
            goto out;
        }
    }
    hm_model_local_experts le = {.experts = experts, .n = n_experts, .step = 1, .dead = NULL};
    hm_model_experts ex;
    hm_model_local_experts_bind(&le, &ex);

    printf("config batch=%zu dim=%zu hidden=%zu experts=%zux%zu k_best=%zu params=%zu "
           "expert_params=%zu train=%zu test=%zu routing=%s\n",
           o.batch, o.dim, hm_ffn_config_of(experts[0])->hidden, o.grid[0], o.grid[1], mc.k_best,
           hm_model_nparams(m), hm_ffn_nparams(experts[0]), d.train.n, d.test.n,
           hm_train_routing_name(&o));
    fflush(stdout);

    uint64_t start = hm_train_now_us();
    double last_t = 0, loss_sum = 0, bal_sum = 0, acc = -1;
    size_t step = 0, since = 0, failed = 0;
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
        hm_train_next_batch(&d);
        hm_model_result res;
        rc = hm_model_train_step(m, &ex, d.x, d.y, o.batch, &res);
        if (rc < 0) {
            /* In-process experts do not time out; a failure here is a
             * non-finite loss, which more steps would not fix. */
            fprintf(stderr, "train_local: step %zu: %s\n", step, strerror(-rc));
            failed++;
            reason = "error";
            break;
        }
        step++;
        since++;
        loss_sum += res.loss;
        bal_sum += res.balancing_loss;
        if (step % o.print_every == 0) {
            double t = hm_train_seconds(start);
            char bal[48] = "";
            if (o.switch_layer)
                snprintf(bal, sizeof(bal), " balance=%.4f", bal_sum / since);
            printf("train t=%.2f step=%zu loss=%.4f sps=%.1f%s\n", t, step, loss_sum / since,
                   (double)(since * o.batch) / (t - last_t), bal);
            fflush(stdout);
            last_t = t;
            loss_sum = 0;
            bal_sum = 0;
            since = 0;
        }
        if (o.eval_every != 0 && step % o.eval_every == 0) {
            acc = hm_train_evaluate(m, &ex, &d, NULL);
            printf("eval t=%.2f step=%zu acc=%.4f\n", hm_train_seconds(start), step, acc);
            fflush(stdout);
            /* Evaluation time is not training throughput. */
            last_t = hm_train_seconds(start);
        }
    }
    if (o.eval_every == 0 || step % o.eval_every != 0 || acc < 0)
        acc = hm_train_evaluate(m, &ex, &d, NULL);
    printf("done t=%.2f step=%zu acc=%.4f reason=%s failed=%zu\n", hm_train_seconds(start), step,
           acc, reason, failed);
    fflush(stdout);
    result = failed == 0 ? 0 : 1;
out:
    for (size_t e = 0; e < n_experts && experts != NULL; e++)
        hm_ffn_free(experts[e]);
    free(experts);
    hm_model_free(m);
    hm_train_data_free(&d);
    return result;
}

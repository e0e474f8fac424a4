/*
 * bench_moe_local: throughput of one feed-forward expert (moe/ffn.h) run
 * locally, with no network: samples per second of a forward pass followed
 * by a backward pass (which recomputes the forward, as the expert server
 * does, and takes one optimizer step), the work an expert server does per
 * training sample.
 *
 *   bench_moe_local [--dim D] [--hidden H] [--runs N] [--adam|--sgd] [BATCH ...]
 *
 * Defaults: dim 1024, hidden 4 * dim, Adam, 5 timed runs after one warm-up,
 * batches 256, 512 and 1024. Each line gives the batch, the median and best
 * time of one forward + backward, and samples/s at the median. OpenBLAS
 * picks its own thread count (OPENBLAS_NUM_THREADS sets it).
 */
#include "config.h"

#include "bench/bench_common.h"
#include "moe/ffn.h"
#include "src/base/util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RUNS 100
#define MAX_BATCHES 16

static void usage(void)
{
    fprintf(stderr,
            "usage: bench_moe_local [--dim D] [--hidden H] [--runs N] [--adam|--sgd] [BATCH ...]\n");
    exit(64);
}

/* One batch size: returns 0, or the first error of the expert. */
static int bench_batch(hm_ffn *f, size_t batch, int runs)
{
    size_t d = hm_ffn_dim(f), n = batch * d;
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
    float *gx = malloc(n * sizeof(float));
    double t[MAX_RUNS], med;
    int result = -ENOMEM, i;

    if (x == NULL || y == NULL || gx == NULL)
        goto out;
    hm_bench_fill(x, n, 0x1234);
    /* Run zero is the warm-up: first-touch page faults and OpenBLAS thread start. */
    for (i = 0; i <= runs; i++) {
        uint64_t t0 = hm_now_us();
        if ((result = hm_ffn_forward(f, x, batch, y)) < 0)
            goto out;
        /* dL/dy = y / batch, the gradient of a mean squared output: realistic magnitudes. */
        for (size_t k = 0; k < n; k++)
            y[k] /= (float)batch;
        if ((result = hm_ffn_backward(f, x, y, batch, gx)) < 0)
            goto out;
        if (i > 0)
            t[i - 1] = (double)(hm_now_us() - t0) / 1e6;
    }
    qsort(t, (size_t)runs, sizeof(double), hm_bench_cmp_double);
    med = t[runs / 2];
    printf("batch %5zu  median %8.2f ms  best %8.2f ms  %10.1f samples/s\n", batch, med * 1e3,
           t[0] * 1e3, (double)batch / med);
    fflush(stdout);
    result = 0;
out:
    free(x);
    free(y);
    free(gx);
    return result;
}

int main(int argc, char **argv)
{
    hm_ffn_config cfg = {.dim = 1024, .optimizer = HM_FFN_ADAM, .seed = 1};
    size_t batches[MAX_BATCHES] = {256, 512, 1024};
    int nbatches = 3, custom = 0, runs = 5, i, rc;
    hm_ffn *f = NULL;

    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--dim") == 0 && i + 1 < argc)
            cfg.dim = hm_bench_parse_size(argv[++i], 1, HM_FFN_MAX_DIM, usage);
        else if (strcmp(argv[i], "--hidden") == 0 && i + 1 < argc)
            cfg.hidden = hm_bench_parse_size(argv[++i], 1, HM_FFN_MAX_HIDDEN, usage);
        else if (strcmp(argv[i], "--runs") == 0 && i + 1 < argc)
            runs = (int)hm_bench_parse_size(argv[++i], 1, MAX_RUNS, usage);
        else if (strcmp(argv[i], "--adam") == 0)
            cfg.optimizer = HM_FFN_ADAM;
        else if (strcmp(argv[i], "--sgd") == 0)
            cfg.optimizer = HM_FFN_SGD;
        else if (argv[i][0] == '-')
            usage();
        else {
            if (!custom) {
                nbatches = 0;
                custom = 1;
            }
            if (nbatches == MAX_BATCHES)
                usage();
            batches[nbatches++] = hm_bench_parse_size(argv[i], 1, 1 << 20, usage);
        }
    }
    if ((rc = hm_ffn_new(&cfg, &f)) < 0) {
        fprintf(stderr, "bench_moe_local: hm_ffn_new: %s\n", hm_strerror(rc));
        return 1;
    }
    printf("ffn dim %zu hidden %zu %s, %d runs (median), forward + backward per sample\n",
           hm_ffn_dim(f), hm_ffn_config_of(f)->hidden,
           cfg.optimizer == HM_FFN_ADAM ? "adam" : "sgd", runs);
    for (i = 0; i < nbatches; i++) {
        if ((rc = bench_batch(f, batches[i], runs)) < 0) {
            fprintf(stderr, "bench_moe_local: batch %zu: %s\n", batches[i], hm_strerror(rc));
            hm_ffn_free(f);
            return 1;
        }
    }
    hm_ffn_free(f);
    return 0;
}

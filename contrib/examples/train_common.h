/*
 * train_common: what the two example trainers share: the command-line
 * options they both take, loading and normalizing Fashion-MNIST, shuffled
 * batches, test-set evaluation, the lines they print, and SIGINT / SIGTERM
 * as a request to stop (polled between steps, so no handler and no global
 * flag). It owns the datasets and the batch buffers it allocates.
 *
 * Output lines, one event per line, key=value fields that a script can
 * split on spaces:
 *   train t=SECONDS step=N loss=MEAN_LOSS sps=SAMPLES_PER_SECOND [extra]
 *   eval t=SECONDS step=N acc=TEST_ACCURACY
 *   done t=SECONDS step=N acc=TEST_ACCURACY reason=steps|time|signal|error [extra]
 * t counts from the first step and includes evaluation time.
 */
#ifndef HM_EXAMPLES_TRAIN_COMMON_H
#define HM_EXAMPLES_TRAIN_COMMON_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "contrib/examples/idx.h"
#include "contrib/examples/model.h"

typedef struct hm_train_opts {
    size_t steps;        /* --steps N: 0 runs until --time-limit */
    size_t batch;        /* --batch B */
    size_t dim;          /* --dim D */
    size_t hidden;       /* --hidden H, the experts' hidden width (0: 4 * dim) */
    size_t grid[2];      /* --experts G0xG1 */
    size_t k_best;       /* --k-best K */
    size_t eval_every;   /* --eval-every N steps, 0: only at the end */
    size_t print_every;  /* --print-every N steps */
    uint64_t seed;       /* --seed S */
    double time_limit;   /* --time-limit SECONDS, 0: none */
    double lr;           /* --lr: for the local parameters and local experts (0: Adam's 1e-3) */
    const char *data;    /* --data DIR */
    size_t train_limit;  /* --train-limit N: use only the first N training items (0: all) */
    /* -- routing options -- */
    int routing;           /* --routing sample|batch (default sample), enum hm_model_routing */
    int switch_layer;      /* --switch: a Switch layer (per sample, k_best 1) */
    double balance_weight; /* --balance-weight W: the Switch's balancing loss factor (0.01) */
    double jitter_eps;     /* --jitter EPS: the Switch's gate input noise (0.01) */
} hm_train_opts;

void hm_train_opts_default(hm_train_opts *o);

/*
 * Handles argv[*i] when it is a common option ("--name VALUE" or
 * "--name=VALUE"), advancing *i past its value. Returns 1 when handled, 0
 * when the option is not a common one, -EINVAL (with a message on stderr)
 * when its value is bad or missing.
 */
int hm_train_opt(hm_train_opts *o, int argc, char **argv, int *i);
/* Checks the combination; prints why not on stderr. 0 or -EINVAL. */
int hm_train_opts_check(const hm_train_opts *o);
/* The usage text of the common options. */
extern const char hm_train_common_usage[];

/* The model config the options describe. */
void hm_train_model_config(const hm_train_opts *o, hm_model_config *mc);
/* "sample", "batch" or "switch", for the config line. */
const char *hm_train_routing_name(const hm_train_opts *o);

typedef struct hm_train_data {
    hm_idx_images train, test;
    hm_idx_labels train_labels, test_labels;
    size_t pix;
    /* Shuffled order of the training set, redrawn each epoch. */
    size_t *order;
    size_t pos;
    uint64_t rng;
    float *x;      /* one batch */
    uint8_t *y;
    size_t batch;
} hm_train_data;

/*
 * Loads DIR's train and t10k files and normalizes both with the training
 * set's mean and std. Prints the loader's message on failure.
 */
int hm_train_data_load(hm_train_data *d, const hm_train_opts *o);
void hm_train_data_free(hm_train_data *d);
/* Fills d->x / d->y with the next batch of the shuffled training set. */
void hm_train_next_batch(hm_train_data *d);

/*
 * Test accuracy over the whole test set, in batches of the model's
 * max_batch. A batch whose forward fails (no expert answered) counts as
 * wrong; *failed_out (may be NULL) gets how many batches failed.
 */
double hm_train_evaluate(hm_model *m, const hm_model_experts *ex, const hm_train_data *d,
                         size_t *failed_out);

/* Catches SIGINT and SIGTERM (set gets them) so that hm_train_stop_requested
 * can poll them; the loop then stops cleanly. */
int hm_train_signals_block(sigset_t *set);
/* The signal that arrived (and is consumed), or 0. */
int hm_train_stop_requested(const sigset_t *set);

/* The monotonic clock in microseconds, and seconds since a reading of it. */
uint64_t hm_train_now_us(void);
double hm_train_seconds(uint64_t start_us);

#endif

/*
 * hivemind.h: the trainer client library of hivemindd (libhivemind). A
 * trainer process attaches to the local daemon through its control socket
 * (newline-delimited JSON, docs/control-protocol.md) and hands tensors over
 * through shared memory that the daemon allocates, never through the
 * socket. Plain C: libc and jansson only; every call blocks with a timeout.
 * hivemindctl is built on it as well: any control command goes through
 * hmc_call.
 *
 * Conventions. Functions return 0 or a negative errno code; after a failure
 * hmc_last_error(h) holds a sentence and, when the daemon refused the
 * request, hmc_last_error_code(h) its machine-readable code ("bad_args",
 * "no_group", ...), and the call returned -EREMOTEIO. Results are also
 * given as JSON text (char **..._json_out; pass NULL when not wanted) that
 * the caller frees with hmc_free_string, so bindings (ctypes) can simply
 * parse them. Handles are opaque; sizes and offsets are plain integers.
 * Tensors are float32 in the host's byte order.
 *
 * Threads: one hmc handle is used by one thread at a time. A background
 * round (hmc_round) has a connection of its own and may be polled or waited
 * for from another thread than the one using its hmc.
 *
 * Shared buffers. hmc_buf_alloc asks the daemon for a segment
 * ("shm.alloc"), maps it and unlinks its name, so nothing is left in
 * /dev/shm even if the trainer crashes. The segment belongs to the
 * connection: hmc_buf_free or hmc_close (or the trainer's exit) releases it
 * on the daemon's side; a buffer outlives hmc_close on the trainer's side
 * until hmc_buf_free unmaps it. A connection that holds buffers is never
 * closed for idleness (ControlIdleTimeout), so a trainer may leave it
 * silent for as long as it trains; one without buffers is closed after
 * that timeout, and its calls then fail with -EPIPE ("idle_timeout").
 *
 * Averaging with a delayed update (the usual way to keep training while the
 * swarm averages):
 *
 *     hmc_buf *b;  hmc_round *r = NULL;
 *     hmc_buf_alloc(h, n * sizeof(float), &b);
 *     for (step = 0;; step++) {
 *         train_step(params);
 *         if (r != NULL && hmc_round_done(r)) {
 *             if (hmc_round_wait(r, 0, NULL) == 0)
 *                 apply_average(params, hmc_buf_data(b), n);  // e.g. params += avg - snapshot
 *             hmc_round_free(r);  r = NULL;
 *         }
 *         if (r == NULL && step % 100 == 0) {
 *             memcpy(hmc_buf_data(b), params, n * sizeof(float));  // the snapshot
 *             hmc_average_start(h, b, 0, n, &opts, &r);
 *         }
 *     }
 *
 * While a round runs the daemon reads and writes the buffer's range: leave
 * it alone until the round is done (hmc_round_done is 1 or hmc_round_wait
 * returned something else than -EAGAIN).
 */
#ifndef HIVEMIND_H
#define HIVEMIND_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library's version, the same as hivemindd's (test_client checks it). */
#define HMC_VERSION_MAJOR 0
#define HMC_VERSION_MINOR 1
#define HMC_VERSION_PATCH 0
#define HMC_VERSION "0.1.0"

typedef struct hmc hmc;
typedef struct hmc_buf hmc_buf;
typedef struct hmc_round hmc_round;

/* The longest reply line the library accepts, and the default timeout. */
#define HMC_MAX_REPLY ((size_t)32 << 20)
#define HMC_DEFAULT_TIMEOUT_MS 30000
#define HMC_ERROR_MAX 512

/* ---- connection ---- */

/*
 * Connects to the daemon's control socket at socket_path; NULL means
 * $HIVEMINDD_CONTROL_SOCKET, else the daemon's default path (as
 * hivemindctl finds it). On failure err (may be NULL) gets a sentence.
 * Returns 0, -ENOENT/-ECONNREFUSED (no daemon there), -ETIMEDOUT (a daemon
 * is there but did not accept within HMC_DEFAULT_TIMEOUT_MS: stopped, or
 * its backlog full), -ENAMETOOLONG, -ENOMEM.
 */
int hmc_connect(const char *socket_path, hmc **out, char *err, size_t errlen);
/*
 * The same with timeout_ms (> 0, else -EINVAL) for the connect and as the
 * handle's request timeout (hmc_set_timeout). Background rounds connect
 * within the handle's timeout too.
 */
int hmc_connect_timeout(const char *socket_path, int timeout_ms, hmc **out, char *err,
                        size_t errlen);
/* Closes the connection: the daemon releases its buffers (see above). NULL is fine. */
void hmc_close(hmc *h);
/* The last failure's sentence ("" when none), valid until the next call on h. */
const char *hmc_last_error(const hmc *h);
/* The daemon's error code of the last failure, "" when the failure was local. */
const char *hmc_last_error_code(const hmc *h);
/* Timeout of each ordinary request in milliseconds (default HMC_DEFAULT_TIMEOUT_MS; >0). */
void hmc_set_timeout(hmc *h, int timeout_ms);
/* Frees a string the library returned. */
void hmc_free_string(char *s);

/*
 * Any control command: args_json is a JSON object (NULL: {}); the result
 * object goes to *result_json_out. Returns 0, -EINVAL (args not an
 * object), -EREMOTEIO (the daemon answered an error), -ETIMEDOUT, -EPIPE
 * (the daemon went away or ended the connection, hmc_last_error_code then
 * saying why, e.g. "idle_timeout": the handle is unusable after that) or
 * -EPROTO (the reply was not a valid reply line).
 */
int hmc_request(hmc *h, const char *cmd, const char *args_json, char **result_json_out);
/*
 * The same with a timeout of its own and the reply line as the daemon sent
 * it, for tools that show the daemon's words (hivemindctl --json).
 * timeout_ms bounds the whole request, sending and reply (0: the handle's
 * timeout; < 0 is -EINVAL): a command that works for long ("average",
 * "experts.call") needs its own timeouts plus a margin. *reply_line_out
 * (may be NULL), without its newline, is set whenever a reply line came:
 * an ok reply (0), an error reply (-EREMOTEIO) and the notice with which
 * the daemon ends a connection (-EPIPE, hmc_last_error_code then set);
 * otherwise it is NULL. Free both strings with hmc_free_string.
 */
int hmc_call(hmc *h, const char *cmd, const char *args_json, int timeout_ms,
             char **result_json_out, char **reply_line_out);
/* The node's "info" (peer id, address, swarm, shared-memory use, ...). */
int hmc_info(hmc *h, char **info_json_out);

/* ---- shared buffers ---- */

/* A zero-filled shared buffer of bytes (> 0). */
int hmc_buf_alloc(hmc *h, size_t bytes, hmc_buf **out);
void *hmc_buf_data(const hmc_buf *b);
size_t hmc_buf_size(const hmc_buf *b);
/* The daemon's segment id, for shared-memory references in hmc_request. */
uint64_t hmc_buf_id(const hmc_buf *b);
/* Releases the segment (if its connection is still open) and unmaps it. NULL is fine. */
void hmc_buf_free(hmc_buf *b);

/* ---- averaging ---- */

typedef struct hmc_avg_opts {
    const char *prefix;          /* required: what is averaged, e.g. "mymodel.params" */
    double weight;               /* >= 0; hmc_avg_opts_init sets 1 */
    double timeout_s;            /* to find a group; 0: the daemon's default (30) */
    double round_timeout_s;      /* the all-reduce's deadline; 0: 30 */
    double matchmaking_time_s;   /* 0: the daemon's default */
    int target_group_size;       /* 0: 16 */
    int min_group_size;          /* 0: 2 (1 when the target is 1) */
    const char *compression;     /* NULL: "none"; "fp16", "8bit" */
    const char *group_bits;      /* NULL: the daemon's */
    int client_mode;             /* 1: send and receive only */
    const char *extra_json;      /* NULL, or an object whose members are added to the args */
} hmc_avg_opts;

void hmc_avg_opts_init(hmc_avg_opts *o);

/*
 * Averages n floats of b from element offset_elems in place, with the
 * swarm, and waits for the round. report_json_out gets the round's report
 * (group, spans, bytes, durations: docs/control-protocol.md, "average").
 * A round that failed returns -EREMOTEIO with the daemon's code
 * ("no_group", "timeout", "left_out", ...); chunks not averaged keep their
 * values.
 */
int hmc_average(hmc *h, hmc_buf *b, size_t offset_elems, size_t n, const hmc_avg_opts *o,
                char **report_json_out);

/*
 * The same in the background, on a connection of its own: returns at once
 * with *out set. b must stay allocated until the round is done.
 */
int hmc_average_start(hmc *h, hmc_buf *b, size_t offset_elems, size_t n, const hmc_avg_opts *o,
                      hmc_round **out);
/* 1 once the round is over (averaged or failed), 0 while it runs. Never blocks. */
int hmc_round_done(hmc_round *r);
/*
 * Waits up to timeout_ms (0: just look; -1: until the round's own deadline)
 * for the round. Returns -EAGAIN while it still runs, else its outcome as
 * hmc_average would (0 with the report, -EREMOTEIO, ...); the outcome stays
 * and may be asked for again.
 */
int hmc_round_wait(hmc_round *r, int timeout_ms, char **report_json_out);
/*
 * Releases this daemon's held rounds under prefix (an "average" sent with
 * "hold": true in extra_json: matchmaking runs, the all-reduce waits) with
 * their final weight: the all-reduce begins now, or once the group forms.
 * Until then the daemon leaves the buffer alone. 0, -EREMOTEIO with
 * "not_found" when none is held there (the round is over), or hmc's errors.
 */
int hmc_average_go(hmc *h, const char *prefix, double weight);
const char *hmc_round_error(const hmc_round *r);
const char *hmc_round_error_code(const hmc_round *r);
/*
 * Frees the round. One still running is not stopped: the daemon finishes it
 * and writes the buffer all the same, so leave the buffer alone for the
 * round's timeouts. NULL is fine.
 */
void hmc_round_free(hmc_round *r);

/* ---- mixture of experts ---- */

#define HMC_UID_MAX 256
#define HMC_PEER_MAX 256

typedef struct hmc_expert {
    char uid[HMC_UID_MAX];   /* "prefix.i.j" */
    char peer[HMC_PEER_MAX]; /* "PEERID@HOST:PORT" */
    double score;
} hmc_expert;

/*
 * Beam search over the expert grid under prefix: scores holds n_dims
 * consecutive runs of grid scores, dim_sizes[d] of them for dimension d.
 * Up to min(k_best, max_out) experts, best first, go to out and their
 * number to *n_out.
 */
int hmc_experts_find(hmc *h, const char *prefix, const double *scores, const size_t *dim_sizes,
                     size_t n_dims, size_t k_best, double timeout_s, hmc_expert *out,
                     size_t max_out, size_t *n_out, char **result_json_out);

/*
 * Calls forward on k experts with the batch x (batch * dim floats of xb
 * from element x_off); expert i's output goes to y (k * batch * dim floats
 * of yb from y_off, expert i at i * batch * dim). Succeeds once k_min
 * (1..k; anything else is -EINVAL) have answered, waiting at most
 * timeout_after_k_min_s more for the rest.
 * answered_out (k ints, may be NULL) says which did; *n_answered_out their
 * number. Fewer than k_min answering is -EREMOTEIO: hmc_last_error_code
 * "timeout" when experts did not answer in time, or, when a host refused
 * the call, the refusal's code ("expert_wrong_shape", "expert_not_found",
 * "expert_busy", "expert_bad_input", "expert_error") with the host's own
 * reason in hmc_last_error (docs/control-protocol.md).
 */
int hmc_experts_forward(hmc *h, const hmc_expert *experts, size_t k, hmc_buf *xb, size_t x_off,
                        hmc_buf *yb, size_t y_off, size_t batch, size_t dim, size_t k_min,
                        double timeout_s, double timeout_after_k_min_s, int *answered_out,
                        size_t *n_answered_out);

/*
 * Backward on k experts: the input x (batch * dim), the gradients of their
 * outputs gy (k * batch * dim), and the gradients of the input per expert
 * into gx (k * batch * dim). k_min is 1..k as for forward.
 */
int hmc_experts_backward(hmc *h, const hmc_expert *experts, size_t k, hmc_buf *xb, size_t x_off,
                         hmc_buf *gyb, size_t gy_off, hmc_buf *gxb, size_t gx_off, size_t batch,
                         size_t dim, size_t k_min, double timeout_s, int *answered_out,
                         size_t *n_answered_out);

/*
 * The same over sequences, for transformer experts (ExpertType
 * transformer): x is batch sequences of seq rows of dim ([batch, seq, dim],
 * batch * seq * dim floats), y, gy and gx k of those. maskb (may be NULL:
 * no padding) holds a key-padding mask of batch * seq floats from mask_off,
 * 1 for a token and 0 for padding (Hivemind's attention_mask), each
 * sequence keeping at least one token: a padded key gets no attention
 * weight. A sequence longer than the expert's ExpertMaxSeq, or a call to
 * an ffn expert, is refused with "expert_wrong_shape"; seq 0 is -EINVAL.
 */
int hmc_experts_forward_seq(hmc *h, const hmc_expert *experts, size_t k, hmc_buf *xb,
                            size_t x_off, hmc_buf *maskb, size_t mask_off, hmc_buf *yb,
                            size_t y_off, size_t batch, size_t seq, size_t dim, size_t k_min,
                            double timeout_s, double timeout_after_k_min_s, int *answered_out,
                            size_t *n_answered_out);
int hmc_experts_backward_seq(hmc *h, const hmc_expert *experts, size_t k, hmc_buf *xb,
                             size_t x_off, hmc_buf *maskb, size_t mask_off, hmc_buf *gyb,
                             size_t gy_off, hmc_buf *gxb, size_t gx_off, size_t batch,
                             size_t seq, size_t dim, size_t k_min, double timeout_s,
                             int *answered_out, size_t *n_answered_out);

/*
 * Per-sample routing (Hivemind's RemoteMixtureOfExperts): every sample of a
 * batch has its own gate scores and its own beam search; the daemon runs
 * the batch's searches as one walk of the DHT ("experts.route").
 *
 * scores: batch rows of sum(grid) floats in scoresb from element
 * scores_off, each row the scores of grid dimension 0, then 1, ...
 * routes: batch * k_best int32 in routesb from element routes_off (an
 * element is 4 bytes), written by the daemon: row b the experts of sample
 * b, best first, as indices into out, -1 past the ones found. out gets
 * every expert some sample was routed to (each once; more than max_out is
 * -ENOBUFS), *n_out their number. beam_size 0: k_best.
 */
int hmc_experts_route(hmc *h, const char *prefix, const size_t *grid, size_t n_dims,
                      hmc_buf *scoresb, size_t scores_off, size_t batch, size_t k_best,
                      size_t beam_size, double timeout_s, hmc_buf *routesb, size_t routes_off,
                      hmc_expert *out, size_t max_out, size_t *n_out, char **result_json_out);

/*
 * Forward with the rows grouped by expert: each of the n_experts gets one
 * request holding the rows of the samples routed to it. routes: batch *
 * slots int32 (as hmc_experts_route writes them with slots = k_best; -1:
 * none); y: batch * slots * dim floats, slot j of sample b the output of
 * expert routes[b][j] on x[b] (slots whose expert did not answer are left
 * as they were). k_min and timeout_after_k_min count per sample: sample b
 * needs min(k_min, the experts routed to it) answers; the call ends when
 * every expert answered or timeout_after_k_min after the last sample got
 * its k_min, and fails (-EREMOTEIO, "timeout" or a refusal's code) when
 * at timeout some sample has fewer. k_min 0 needs allow_zero_outputs (a
 * Switch layer: a sample without answers gets zeros from the mixture; the
 * call then waits at most timeout_after_k_min). answered_out: n_experts
 * ints.
 */
int hmc_experts_forward_routed(hmc *h, const hmc_expert *experts, size_t n_experts,
                               hmc_buf *routesb, size_t routes_off, size_t slots, hmc_buf *xb,
                               size_t x_off, hmc_buf *yb, size_t y_off, size_t batch, size_t dim,
                               size_t k_min, int allow_zero_outputs, double timeout_s,
                               double timeout_after_k_min_s, int *answered_out,
                               size_t *n_answered_out);

/*
 * Backward of a routed forward: gy and gx are batch * slots * dim. Give it
 * the forward's routes with -1 in every slot whose expert did not answer
 * the forward, so that backward goes only to the experts that produced
 * those rows; experts left with no rows are not called.
 */
int hmc_experts_backward_routed(hmc *h, const hmc_expert *experts, size_t n_experts,
                                hmc_buf *routesb, size_t routes_off, size_t slots, hmc_buf *xb,
                                size_t x_off, hmc_buf *gyb, size_t gy_off, hmc_buf *gxb,
                                size_t gx_off, size_t batch, size_t dim, size_t k_min,
                                int allow_zero_outputs, double timeout_s, int *answered_out,
                                size_t *n_answered_out);

/*
 * Routed calls over sequences (transformer experts), a sample one whole
 * sequence: x is batch * seq * dim floats ([batch, seq, dim]), routes
 * batch * slots as above, y, gy and gx batch * slots * seq * dim; maskb
 * (may be NULL) a key-padding mask of batch * seq floats (1 a token, 0
 * padding), each sample's going with it to its experts.
 */
int hmc_experts_forward_routed_seq(hmc *h, const hmc_expert *experts, size_t n_experts,
                                   hmc_buf *routesb, size_t routes_off, size_t slots,
                                   hmc_buf *xb, size_t x_off, hmc_buf *maskb, size_t mask_off,
                                   hmc_buf *yb, size_t y_off, size_t batch, size_t seq,
                                   size_t dim, size_t k_min, int allow_zero_outputs,
                                   double timeout_s, double timeout_after_k_min_s,
                                   int *answered_out, size_t *n_answered_out);
int hmc_experts_backward_routed_seq(hmc *h, const hmc_expert *experts, size_t n_experts,
                                    hmc_buf *routesb, size_t routes_off, size_t slots,
                                    hmc_buf *xb, size_t x_off, hmc_buf *maskb, size_t mask_off,
                                    hmc_buf *gyb, size_t gy_off, hmc_buf *gxb, size_t gx_off,
                                    size_t batch, size_t seq, size_t dim, size_t k_min,
                                    int allow_zero_outputs, double timeout_s,
                                    int *answered_out, size_t *n_answered_out);

/* ---- DiLoCo ---- */

/*
 * DiLoCo (Douillard et al., 2023): each trainer takes inner_steps (H)
 * steps with its own optimizer, then the swarm all-reduces the
 * pseudo-gradient g = outer - params (the parameters at the last outer
 * step minus the current ones) and every trainer takes the same outer
 * Nesterov SGD step on the average, exactly as torch.optim.SGD(lr,
 * momentum, nesterov=True, dampening 0) does, in float32:
 *
 *     buf = g                      (the first outer step)
 *     buf = momentum * buf + g     (later ones)
 *     outer -= lr * (g + momentum * buf)
 *
 * and the parameters are reset to the new outer ones. Round k (k outer
 * steps taken before it) averages under the prefix "RUN_ID.diloco.K", so
 * that only trainers at the same outer step meet. A round that fails (no
 * group within timeout_s, an all-reduce timeout, the daemon gone) is a
 * miss: the trainer applies its own pseudo-gradient, says so in the
 * report, and looks for the others again at the next round. A trainer
 * that missed because it fell behind (the others averaged round k
 * without it and went on) would never meet them again under its own
 * round numbers, so after a miss it also asks for the newest shared
 * state (catch_up): when the run is at a later round than its own, it
 * takes that state and joins the run's next round (rep->caught_up).
 *
 * The outer state (outer parameters, momentum, the round number) is
 * shared with newcomers after every outer step through the daemon's
 * state.share under "RUN_ID.diloco" with the round as the step, and a
 * newcomer loads the newest one at hmc_diloco_begin (state.load). The
 * outer step returns once the daemon has declared that state in the DHT
 * (state.share's "wait"), so a newcomer that begins after the trainers
 * finished round R loads round R's state, not an older one. Its
 * layout, HMC_DILOCO_STATE_HEADER bytes then 2 n floats:
 *     "HMDILOCO", u32 version (1), u32 flags (bit 0: momentum set),
 *     u64 n_params, u64 round; the outer parameters; the momentum,
 * in the host's byte order. A loaded state is checked
 * (hmc_diloco_state_check) before any of it is used.
 *
 *     hmc_diloco_opts o;  hmc_diloco *d;  hmc_diloco_report rep;
 *     hmc_diloco_opts_init(&o);  o.run_id = "mnist";  o.inner_steps = 100;
 *     hmc_diloco_open(h, &o, n, &d);
 *     hmc_diloco_begin(d, params, &rep);        // rep.loaded: a newcomer
 *     for (;;) {
 *         inner_optimizer_step(params);
 *         if (hmc_diloco_step(d, params, &rep) == 1)   // every H steps
 *             log(rep.averaged, rep.group_size, rep.code);
 *     }
 *     hmc_diloco_close(d);
 *
 * The hmc handle is used by d for its calls (one thread at a time, as
 * always); hmc_diloco_close before hmc_close.
 */

typedef struct hmc_diloco hmc_diloco;

#define HMC_DILOCO_RUN_MAX 96
#define HMC_DILOCO_STATE_HEADER 32
#define HMC_DILOCO_CODE_MAX 64

typedef struct hmc_diloco_opts {
    const char *run_id;        /* required: 1..HMC_DILOCO_RUN_MAX bytes, no '\0' */
    unsigned inner_steps;      /* H, >= 1; init 500 */
    double outer_lr;           /* finite, > 0; init 0.7 */
    double outer_momentum;     /* 0 <= m < 1; init 0.9 (0: plain SGD) */
    double weight;             /* this trainer's weight in the average, >= 0; init 1 */
    const char *compression;   /* NULL/"none", "fp16", "8bit": the pseudo-gradient's wire form */
    double timeout_s;          /* to find a group each round; 0: the daemon's (30) */
    double round_timeout_s;    /* the all-reduce's deadline; 0: the daemon's (30) */
    double matchmaking_time_s; /* 0: the daemon's */
    int target_group_size;     /* 0: the daemon's (16) */
    int min_group_size;        /* 0: the daemon's (2) */
    int load_state;            /* 1 (init): hmc_diloco_begin loads the peers' outer state */
    int share_state;           /* 1 (init): share ours after every outer step */
    double load_timeout_s;     /* init 30: the state download's deadline */
    int state_min_agree;       /* donors (origins) that must agree on the state; init 1 */
    int catch_up;              /* 1 (init): after a miss, load a newer round's state if shared */
} hmc_diloco_opts;

typedef struct hmc_diloco_report {
    uint64_t round;       /* hmc_diloco_begin: the round to come; a step: the round it closed */
    int loaded;           /* begin: 1 when the outer state came from peers */
    int averaged;         /* step: 1 when the group's average was applied, 0 our own */
    int group_size;       /* step: the round's group (0 when none formed) */
    int shared;           /* 1 when the daemon took our outer state for newcomers */
    int caught_up;        /* step: 1 when, after a miss, a newer round's state was loaded */
    int status;           /* 0, or the failed call's return (-EREMOTEIO: see code) */
    char code[HMC_DILOCO_CODE_MAX]; /* the daemon's code of the failure ("no_group", ...) */
    char error[HMC_ERROR_MAX];      /* its sentence, "" when none */
    double average_s;     /* step: seconds in the averaging call; begin: in the load */
    double pseudo_grad_norm; /* step: L2 norm of our own pseudo-gradient */
} hmc_diloco_report;

void hmc_diloco_opts_init(hmc_diloco_opts *o);
/*
 * A DiLoCo optimizer over n_params float32 parameters (1..2^28; they travel
 * in one averaging round). Allocates its shared buffers from the daemon.
 * Returns 0, -EINVAL (options out of range; hmc_last_error says which) or
 * hmc_buf_alloc's errors.
 */
int hmc_diloco_open(hmc *h, const hmc_diloco_opts *o, size_t n_params, hmc_diloco **out);
/*
 * Starts the run from params: with load_state, the newest outer state that
 * peers share is loaded and written to params (rep->loaded 1, rep->round
 * its round); when nobody shares one (or the load fails: rep->status and
 * code say why) params become the outer parameters of round 0. Then shares
 * the state. Returns 0, or -EINVAL when called twice or with
 * non-finite params. rep may be NULL.
 */
int hmc_diloco_begin(hmc_diloco *d, float *params, hmc_diloco_report *rep);
/* Counts one inner step; returns 1 when the outer step is due (H steps since the last), else 0. */
int hmc_diloco_inner_done(hmc_diloco *d);
/*
 * The outer step now, whatever the count: the round's average (or, on a
 * miss, our own pseudo-gradient), the Nesterov update, params reset to the
 * outer parameters, the state shared, the round counted. Returns 0 (see
 * rep for how it went; a miss is not an error), -EINVAL (not begun) or
 * -EDOM (params hold NaN or infinity: nothing changed).
 */
int hmc_diloco_outer_step(hmc_diloco *d, float *params, hmc_diloco_report *rep);
/* hmc_diloco_inner_done, then hmc_diloco_outer_step when due: 1 (outer step taken), 0, or < 0. */
int hmc_diloco_step(hmc_diloco *d, float *params, hmc_diloco_report *rep);
/* Outer steps taken so far (the next round's number). */
uint64_t hmc_diloco_round(const hmc_diloco *d);
/* Inner steps counted since the last outer step. */
unsigned hmc_diloco_inner_count(const hmc_diloco *d);
/* The outer parameters and the momentum buffer (n_params floats each, read only). */
const float *hmc_diloco_outer_params(const hmc_diloco *d);
const float *hmc_diloco_momentum(const hmc_diloco *d);
/* Frees its buffers (the daemon keeps serving the last shared state). NULL is fine. */
void hmc_diloco_close(hmc_diloco *d);
/*
 * Checks a state blob of len bytes (as loaded from peers, untrusted) for
 * n_params parameters: header, sizes and finite values. Returns 0 with
 * *round_out and *has_momentum_out set, or -EPROTO (not a DiLoCo state,
 * another version, flags unknown, another n_params, a wrong length) or
 * -EDOM (NaN or infinity in it).
 */
int hmc_diloco_state_check(const void *blob, size_t len, size_t n_params, uint64_t *round_out,
                           int *has_momentum_out);

/* ---- swarm progress (lib/progress.c) ---- */

/*
 * Reports this trainer's progress in run ("progress.report"): the epoch,
 * the samples accumulated in it, the samples per second and whether it is
 * a client. The daemon publishes it to the swarm (signed, refreshed while
 * h stays open, gone about 60 s after h closes). One trainer per daemon
 * and run. Returns 0, -EINVAL (run NULL, or a number the daemon refuses:
 * -EREMOTEIO with "bad_args"), or hmc_request's errors.
 */
int hmc_progress_report(hmc *h, const char *run, uint64_t epoch, uint64_t samples,
                        double samples_per_second, int client);

/* The swarm's progress in a run, as "progress" gives it. */
typedef struct hmc_progress {
    uint64_t global_epoch;      /* the largest epoch two origins of non-client peers reached
                                 * (ProgressEpochOrigins; docs/control-protocol.md) */
    uint64_t samples;           /* at the global epoch, extrapolated to now */
    uint64_t target_batch_size; /* as asked; 0 when not */
    double samples_per_second;  /* the swarm's throughput */
    double eta_s;               /* to the target; < 0 when unknown */
    size_t n_peers;             /* non-client peers */
    size_t n_clients;
} hmc_progress;

/*
 * Reads the aggregate ("progress"); target_batch_size 0 means none. out
 * and json_out (the whole result, with the peers) may be NULL. The daemon
 * caches its DHT reads for about a second, so calling this every step is
 * fine.
 */
int hmc_progress_get(hmc *h, const char *run, uint64_t target_batch_size, hmc_progress *out,
                     char **json_out);

/* ---- the collaborative optimizer (lib/optimizer.c) ----
 *
 * Hivemind's Optimizer in C: a trainer's local optimizer (its own step
 * function over its parameter and gradient arrays) wrapped so that the
 * swarm takes one step per epoch on the gradients of target_batch_size
 * samples from all its trainers. hmc_opt_step adds a step's gradients,
 * weighted by its batch size, to an accumulator in a shared buffer and
 * reports the trainer's progress ("progress.report"; a call within 50 ms
 * of the last report neither reports nor reads the swarm's, unless our
 * own samples alone reach the target). An epoch ends when
 * the samples the swarm reports at this epoch (never extrapolated, so
 * never before they are in) reach target_batch_size, or when the global
 * epoch has moved past ours; but while our epoch is past the global one
 * (which moves once ProgressEpochOrigins trainer origins, and with
 * ProgressEpochMajority more than half of them, reach an epoch),
 * the end waits, accumulating, until the swarm reaches our epoch or for
 * averaging_timeout_s at most (report.held_ahead; after a hold timed out,
 * none again until the swarm reaches our epoch), so that a leader does
 * not run off where no one averages with it. Then the accumulated mean gradient is
 * averaged with the peers of the same epoch under "RUN.grad.EPOCH", each
 * weighted by the samples it accumulated; if no group forms or the round
 * fails (no group within matchmaking_time_s, an all-reduce past
 * averaging_timeout_s), the trainer steps on its own
 * gradients and the report says so. The local step runs on the result,
 * the accumulator is cleared and the epoch advances. A trainer more than
 * one epoch behind the swarm discards its gradients and jumps to the
 * global epoch; with share_state, every trainer shares its state after
 * each step and a late one loads the newest: the parameters, the named
 * optimizer statistics (n_stats, stat_names, stats_get/stats_set) and the
 * epoch it was shared at. The state's layout (HMC_OPT_STATE_HEADER bytes,
 * then the names, then the floats; host byte order):
 *     "HMOPTST1", u32 version (1), u32 names_len, u64 n_params,
 *     u64 n_stats, u64 epoch; names_len bytes of stat_names, zero-padded
 *     to a multiple of 4; n_params floats of parameters; n_stats floats
 * of statistics. A loaded state is checked (hmc_opt_state_check) before
 * any of it is used.
 *
 * delay_step runs the epoch's round in the background (hmc_average_start)
 * and returns at once; the next epoch accumulates meanwhile, and the
 * step on the averaged gradients runs in the first call that finds the
 * round over, or at the next epoch's end at the latest, so the parameters
 * are one epoch stale (report.stepped and stepped_epoch say when).
 * local_updates steps on every call's own gradients and, instead of a
 * gradient round, averages the state (parameters and statistics) at epoch
 * ends in the background, as Hivemind's use_local_updates with its
 * delayed state averaging: the round starts from the values at the
 * epoch's end (report.state_started), the local steps go on, and the first
 * call that finds it over (or the next epoch end at the latest) applies it
 * by the delta rule, x += average - x at the round's start, after that
 * call's local step (report.state_averaged), so the local progress made
 * while the round ran is kept. A failed round changes nothing. Both
 * together run each local step in the background as well (see
 * local_updates below).
 *
 * Matchmaking starts matchmaking_time_s before the epoch's estimated end
 * (the daemon's eta_s for our epoch), as Hivemind's scheduled step: the
 * round is started with "hold" (hmc_average_go), the group forms while
 * the epoch's last samples come in, and at the end the all-reduce begins
 * at once with the final weight. A schedule that fails (no group) leaves
 * the end to an ordinary round, which then looks for a group for
 * matchmaking_time_s. A trainer that finds itself more than an epoch
 * behind while scheduled takes part in that round with weight 0 and an
 * empty buffer (report.tagged_along) rather than leave its group.
 */
typedef void (*hmc_opt_step_fn)(void *ud, float *params, const float *grads, size_t n);
/* The local optimizer's statistics: get fills n floats, set takes them (opts.stats_*). */
typedef void (*hmc_opt_stats_get_fn)(void *ud, float *stats, size_t n);
typedef void (*hmc_opt_stats_set_fn)(void *ud, const float *stats, size_t n);

/* The longest stat_names, and the fixed part of the shared state's header. */
#define HMC_OPT_STAT_NAMES_MAX 256
#define HMC_OPT_STATE_HEADER 40

typedef struct hmc_opt_opts {
    const char *run_id;         /* required */
    uint64_t target_batch_size; /* required: samples per swarm epoch */
    uint64_t batch_size_per_step; /* the default batch size of hmc_opt_step (0: given each call) */
    double matchmaking_time_s;  /* 0: 5: how long to look for a group */
    double averaging_timeout_s; /* 0: 30: the all-reduce's deadline */
    unsigned average_state_every; /* 0: never; else every N epochs, after the step, the
                                     parameters and the statistics (n_stats) are averaged
                                     with the peers (weight 1, in the foreground) */
    int client;                 /* a client's epoch does not lead, it reduces nothing */
    int target_group_size;      /* 0: 16 */
    const char *compression;    /* NULL: "none"; "fp16", "8bit" */
    int share_state;            /* share the state (parameters, statistics, epoch) after each
                                   epoch ("state.share" under RUN, step = epoch) and load it
                                   when catching up */
    double load_timeout_s;      /* 0: 30 */
    hmc_opt_step_fn step;       /* required: the local optimizer */
    void *step_ud;
    /* -- delayed and local-update options -- */
    int delay_step;             /* the epoch's round runs in the background (its own
                                   connection) while the next epoch accumulates; its step
                                   runs in the first call that finds the round over, or at
                                   the next epoch's end at the latest: one epoch stale */
    int local_updates;          /* the local step runs every call on that call's gradients;
                                   no gradient round; at an epoch's end the parameters are
                                   averaged (every average_state_every epochs, 0 meaning 1).
                                   With delay_step too (Hivemind's delay_optimizer_step
                                   with use_local_updates), each call's step runs on a
                                   thread of its own, on the optimizer's copy of the
                                   parameters and of the gradients, while the caller
                                   computes its next gradients; the next call waits
                                   for it and copies its result into params, so
                                   gradients are taken one local step late
                                   (report.stepped: a step landed; report.pending: one
                                   runs). step must then change only the params it is
                                   given and its own statistics (stats_get/stats_set
                                   run only while no step does); close waits for it
                                   and drops its result. */
    /* -- optimizer statistics -- */
    size_t n_stats;             /* floats of the local optimizer's statistics (e.g. Adam's
                                   exp_avg and exp_avg_sq of every parameter); 0: none. They
                                   travel with the parameters: shared and loaded with them
                                   (share_state), averaged with them (average_state_every) */
    const char *stat_names;     /* what they are, e.g. "exp_avg,exp_avg_sq" (1 to
                                   HMC_OPT_STAT_NAMES_MAX printable bytes; required with
                                   n_stats): a loaded state must name the same */
    hmc_opt_stats_get_fn stats_get; /* required with n_stats; called with step_ud */
    hmc_opt_stats_set_fn stats_set; /* required with n_stats: after a load or an average */
} hmc_opt_opts;

typedef struct hmc_opt hmc_opt;

typedef struct hmc_opt_report {
    int epoch_ended;       /* this call ended an epoch (and called the local step) */
    int averaged;          /* the step used the swarm's average */
    int local_fallback;    /* the round failed: the step used this trainer's gradients */
    int caught_up;         /* the trainer was behind and jumped to the global epoch */
    int state_loaded;      /* and loaded a peer's state: parameters, statistics, epoch */
    int state_averaged;    /* the parameters (and statistics) were averaged after the step
                              (average_state_every); local_updates: a state average was
                              applied by the delta rule in this call */
    uint64_t epoch;        /* the local epoch after the call */
    uint64_t global_epoch; /* as last read */
    uint64_t samples;      /* this trainer's samples in the epoch (before a step: those averaged) */
    uint64_t swarm_samples; /* the swarm's at our epoch, as last read */
    int group_size;        /* of the round, 0 when none */
    char error[HMC_ERROR_MAX]; /* why the round failed */
    int stepped;           /* this call ran the local step (with delay_step, the previous
                              epoch's: averaged, local_fallback, group_size and error
                              are then that round's) */
    int pending;           /* a delayed round is still running after this call (delay_step
                              with local_updates: this call's local step runs; stepped
                              then says the previous call's landed in params) */
    uint64_t stepped_epoch; /* the epoch whose gradients that step used */
    /* -- scheduled rounds -- */
    int scheduled;         /* the epoch's round was matched ahead of its end (and, at the
                              end, released: averaged etc. are its outcome) */
    double matchmaking_lead_s; /* at the end: how long before it that round's matchmaking
                                  began (0 when none was scheduled) */
    int tagged_along;      /* caught up: the scheduled round ran with weight 0 */
    int tagged_along_group; /* its group's size */
    /* -- local updates with the delta rule -- */
    int state_started;     /* local_updates: this epoch end started the state average */
    int state_pending;     /* local_updates: a state average still runs after this call */
    /* -- ahead of the swarm -- */
    int held_ahead;        /* our epoch is past the swarm's global epoch and has its
                              samples: the epoch's end waits (up to averaging_timeout_s)
                              for the swarm to reach it, accumulating meanwhile */
} hmc_opt_report;

/* Sets the defaults above (everything else 0/NULL). */
void hmc_opt_opts_init(hmc_opt_opts *o);
/* n_params floats of parameters and gradients. 0, -EINVAL, -ENOMEM or hmc's errors. */
int hmc_opt_open(hmc *h, const hmc_opt_opts *opts, size_t n_params, hmc_opt **out);
/*
 * One local step's gradients (n_params floats, the mean over batch_size
 * samples; batch_size 0 means batch_size_per_step); params is what the
 * local step updates. report may be NULL. 0 or a negative code (the
 * daemon unreachable); a failed round is not an error (see report).
 */
int hmc_opt_step(hmc_opt *o, const float *grads, uint64_t batch_size, float *params,
                 hmc_opt_report *report);
uint64_t hmc_opt_local_epoch(const hmc_opt *o);
uint64_t hmc_opt_global_epoch(const hmc_opt *o);
/*
 * Checks a shared optimizer state of len bytes (as loaded from peers,
 * untrusted) against this trainer's n_params, n_stats and stat_names (NULL
 * when n_stats is 0): 0 with *epoch_out set, -EPROTO (not such a state,
 * another version, other sizes or names, a wrong length) or -EDOM (NaN or
 * infinity in it).
 */
int hmc_opt_state_check(const void *blob, size_t len, size_t n_params, size_t n_stats,
                        const char *stat_names, uint64_t *epoch_out);
/*
 * Frees the optimizer and its buffers (not h), waiting first for a delayed
 * round still running (at most its deadline). NULL is fine.
 */
void hmc_opt_close(hmc_opt *o);

/* ---- the reply parser, exposed for tests and fuzzing ---- */

/*
 * Parses one reply line (without its newline, need not be NUL-terminated)
 * to a request sent with id expect_id (< 0: any id or none). Returns 0 (an
 * ok reply; *result_json_out, if not NULL, gets its result object), or
 * -EREMOTEIO (an error reply: code gets its code) or -EPROTO (not a valid
 * reply), with a sentence in err either way.
 */
int hmc_parse_reply(const char *line, size_t len, int64_t expect_id, char **result_json_out,
                    char *code, size_t codelen, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif

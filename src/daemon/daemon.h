/*
 * daemon: the internal header of the hivemindd program. It declares what
 * main.c (the lifecycle: config, start, signals, reload, shutdown) shares
 * with the command groups, one file each, that register the control
 * commands:
 *
 *   cmd_node.c     info, peers, metrics, shutdown
 *   cmd_dht.c      dht.get, dht.put, dht.info
 *   cmd_average.c  average, averaging
 *   cmd_shm.c      shm.alloc, shm.free, and the parser of shared-memory
 *                  references the other groups take
 *   cmd_experts.c  experts.* (cmd_experts.h)
 *   cmd_state.c    state.* (cmd_state.h)
 *   cmd_progress.c progress.report, progress (the record: progress.h)
 *   cmd_status.c   status: the swarm snapshot (cmd_status.h), also behind
 *                  the HTTP listener (http.h)
 *
 * and the argument checks they all use (args.c). Every group registers
 * through the same function shape (hm_daemon_group_fn), and gets what it
 * needs of the daemon through hm_daemon: main.c owns that struct and its
 * parts, and sets a part to NULL once it begins to close, so that a command
 * that finds NULL answers "stopping".
 *
 * A shared-memory tensor reference is a JSON object
 *
 *     {"shm": ID, "offset": BYTES, "elems": N}
 *
 * naming N float32 values at byte offset BYTES (a multiple of 4; 0 when
 * absent) of a segment that a client allocated with "shm.alloc". Any
 * connection may name any live segment (a trainer's background rounds run
 * on a second connection), so the id is the capability; segment ids are
 * random 53-bit numbers (exact as JSON numbers everywhere), so a stale id
 * practically never names a newer segment.
 *
 * Loop thread only, like everything in the daemon; file work goes to
 * libuv's threadpool through tensor_file.h.
 */
#ifndef HM_DAEMON_H
#define HM_DAEMON_H

#include "averaging/averager.h"
#include "src/daemon/control.h"
#include "src/daemon/hm_config.h"
#include "src/daemon/shm.h"
#include "src/base/util.h"
#include "src/node/node.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

typedef struct hm_cmd_experts hm_cmd_experts;
typedef struct hm_cmd_state hm_cmd_state;
typedef struct hm_cmd_average hm_cmd_average;
typedef struct hm_cmd_progress hm_cmd_progress;
typedef struct hm_cmd_status hm_cmd_status;
typedef struct hm_http hm_http;

/*
 * What the command groups see of the daemon. main.c fills it before the
 * groups register and changes it only on the loop thread.
 */
typedef struct hm_daemon {
    uv_loop_t *loop;
    const hm_config *cfg;   /* the configuration in force */
    hm_node *node;          /* NULL once shutting down */
    hm_averager *av;        /* the node's averager; NULL once shutting down */
    hm_shm *shm;            /* freed after the loop; use hm_daemon_shm */
    int stopping;           /* the shutdown has begun */
    /* The groups that own state of their own, for main.c to close; each
     * is NULL until its group registered and again once it closes. */
    hm_cmd_experts *experts;
    hm_cmd_average *average;
    hm_cmd_state *state;
    hm_cmd_progress *progress; /* closed after the control server (cmd_progress.c) */
    hm_cmd_status *status;     /* the swarm snapshot (cmd_status.h) */
    hm_http *http;             /* the HTTP listener (http.h); NULL when off */
    char http_address[80];     /* where it listens, HOST:PORT; empty when off */
    /* Begins the shutdown (the "shutdown" command); why goes to the log. */
    void (*stop)(struct hm_daemon *d, const char *why);
} hm_daemon;

/*
 * The shape of every command group's registration: registers its commands
 * on ctl (and creates the group's own state, hung on d). 0, or a negative
 * code with a sentence for the operator in err, and nothing left running.
 */
typedef int (*hm_daemon_group_fn)(hm_daemon *d, hm_control *ctl, char *err, size_t errlen);

int hm_cmd_node_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen);
int hm_cmd_dht_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen);
int hm_cmd_average_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen);
int hm_cmd_shm_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen);
int hm_cmd_experts_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen);
int hm_cmd_state_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen);
int hm_cmd_progress_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen);
int hm_cmd_status_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen);
/* Closes the progress group (its timer, its pending queries answer
 * "stopping"); cb fires once it is freed. Call it after the control
 * server has closed. */
void hm_cmd_progress_close(hm_cmd_progress *p, void (*cb)(void *ud), void *ud);
/* The runs the attached trainers report progress in (distinct, at most
 * max; the strings live until the next control command), for the status
 * snapshot (cmd_status.c). */
size_t hm_cmd_progress_runs(const hm_cmd_progress *p, const char **runs_out, size_t max);
/* ProgressMaxRuns and ProgressRunsPerConnection, for hm_daemon_limit_metrics. */
void hm_cmd_progress_limits(const hm_cmd_progress *p, hm_limit_emit_fn emit, void *ud);

/*
 * Closes the average group once its commands in flight have answered
 * (those whose file is being read answer "stopping"; a finished round
 * still writes its output); cb fires after that. Call it after the
 * averager's close has begun.
 */
void hm_cmd_average_close(hm_cmd_average *a, void (*cb)(void *ud), void *ud);

/*
 * Appends hivemindd_limit_refused_total, one line per limit of the node,
 * the expert server and the averager, each labelled with its config
 * keyword (cmd_node.c).
 */
void hm_daemon_limit_metrics(hm_daemon *d, hm_strbuf *b);
/* The state downloads' limits (hm_state_limits), for hm_daemon_limit_metrics. */
void hm_cmd_state_limits(const hm_cmd_state *s, hm_limit_emit_fn emit, void *ud);

/* The daemon's shared-memory registry; NULL once it is shutting down. */
hm_shm *hm_daemon_shm(const hm_daemon *d);

/*
 * Validates the reference ref (args.<what>; what names it in the error
 * message) and pins its range (hm_shm_get). elems > 0 is the number of
 * floats the command needs: the reference's "elems" must equal it (or be
 * absent). On success *ptr_out points at the floats and *id_out holds the
 * segment id: call hm_shm_put(shm, *id_out) once done with the range (the
 * memory stays mapped until then even if the segment is freed or its owner
 * disconnects). On error the function has already answered req with a
 * "bad_args" error (or "stopping" when shm is NULL) and returns a negative
 * code: -EINVAL (malformed or a count mismatch), -ENOENT (no such segment,
 * or freed), -ERANGE (outside the segment) or -ESHUTDOWN.
 */
int hm_daemon_shm_ref(hm_shm *shm, hm_control_req *req, const json_t *ref, const char *what,
                      size_t elems, float **ptr_out, uint64_t *id_out);

/*
 * The same for a reference whose size the command takes from it: "elems"
 * is required (1 to max_elems) and *elems_out gets it.
 */
int hm_daemon_shm_ref_any(hm_shm *shm, hm_control_req *req, const json_t *ref, const char *what,
                          size_t max_elems, float **ptr_out, uint64_t *id_out,
                          size_t *elems_out);

/* ---- argument checks shared by the command files (args.c) ----
 *
 * Each returns 0 and fills *out, or answers req with a "bad_args" error
 * that names the argument and what was expected and returns -EINVAL; a
 * command stops at the first bad argument.
 */

/* Answers req with result, or with an "internal" error when it is NULL
 * (a failed json_pack). */
void hm_daemon_reply(hm_control_req *req, json_t *result);
/* Answers req with a "stopping" error: the daemon is shutting down. */
void hm_daemon_reply_stopping(hm_control_req *req);

/*
 * The lifetime of a command group that owns work in flight (cmd_average,
 * cmd_experts, cmd_state), one path for all of them. The group embeds it;
 * its close marks it closing, its commands refuse new work from then on
 * ("stopping"), and the group is freed, and its close callback fired, once
 * no command is in progress (jobs) and no module it owns is still closing
 * (parts).
 */
typedef struct hm_daemon_life {
    size_t jobs;    /* commands in progress */
    unsigned parts; /* owned modules still open or closing (server, state) */
    int closing;
    void (*close_cb)(void *ud);
    void *close_ud;
} hm_daemon_life;

/* Marks the group closing; cb (may be NULL) fires when it is freed. */
void hm_daemon_life_close(hm_daemon_life *l, void (*cb)(void *ud), void *ud);
/* 1 after answering req "stopping" when the group is closing, else 0. */
int hm_daemon_life_refuse(const hm_daemon_life *l, hm_control_req *req);
/*
 * Called whenever a job or part ends and at close: when the group is
 * closing with nothing left, frees group (free(); l lives inside it), fires
 * the close callback and returns 1; otherwise returns 0.
 */
int hm_daemon_life_settle(hm_daemon_life *l, void *group);
/* args.name as seconds in (0, max], def when absent. */
int hm_daemon_arg_seconds(hm_control_req *req, const json_t *args, const char *name, double def,
                          double max, double *out);
/* args.name as an integer in [lo, hi], def when absent (def < 0: the
 * argument is required). */
int hm_daemon_arg_int(hm_control_req *req, const json_t *args, const char *name, long long def,
                      long long lo, long long hi, long long *out);
/* args.name as a finite number in [lo, hi] (above lo when lo_open), def
 * when absent; the error says "args.NAME must be EXPECT". */
int hm_daemon_arg_real(hm_control_req *req, const json_t *args, const char *name, double def,
                       double lo, int lo_open, double hi, const char *expect, double *out);
/* args.name as true or false, def when absent. */
int hm_daemon_arg_bool(hm_control_req *req, const json_t *args, const char *name, int def,
                       int *out);
/* args.name as one of the n strings of names (its index), def when absent
 * (def < 0: required). */
int hm_daemon_arg_choice(hm_control_req *req, const json_t *args, const char *name,
                         const char *const *names, int n, int def, int *out);
/* args.name as a string of 1 to max bytes without NUL; when optional and
 * absent, *out is NULL. The string lives as long as args. */
int hm_daemon_arg_string(hm_control_req *req, const json_t *args, const char *name, size_t max,
                         int optional, const char **out);
/* args.name as up to max characters of 0 and 1 (group bits); NULL when absent. */
int hm_daemon_arg_bits(hm_control_req *req, const json_t *args, const char *name, size_t max,
                       const char **out);
/* args.name as an absolute path of less than PATH_MAX bytes, copied into
 * out (PATH_MAX bytes). */
int hm_daemon_arg_path(hm_control_req *req, const json_t *args, const char *name, char *out);

#endif

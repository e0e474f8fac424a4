/*
 * averager: one node's averaging rounds, end to end. It ties matchmaking
 * (matchmaking.h: find a group through the DHT) to the butterfly
 * all-reduce (allreduce.h: average inside that group) and gives the
 * trainer-facing side one call: average this float32 vector under this
 * prefix with this weight, and tell me, once, how it went. It owns the
 * node's hm_mm and hm_ar_ctx (so their "avg.*" rpc methods), every round in
 * progress, the Moshpit group bits kept per prefix between rounds, and a
 * bounded history of finished rounds for status commands.
 *
 * A round. hm_averager_round looks for a group under the prefix with the
 * prefix's current group bits; once the group forms, it runs the
 * all-reduce on the caller's vector in place and fires the callback with a
 * report that merges both phases: the group (members, their addresses and
 * bandwidths), who was left out and why, what each span of the vector was
 * averaged over, bytes sent and received, and how long each phase took.
 * Everything happens on the node's loop in the background: the call only
 * starts the round, and the caller keeps computing until the callback
 * (a delayed update). The callback fires exactly once for a started round
 * and never from inside hm_averager_round; if that call fails it never
 * fires. The vector must stay valid and untouched until the callback.
 *
 * Group bits. After a round whose group formed, the prefix's bits become
 * the group's next_bits (group.h), so the next round under that prefix
 * meets other partners (Moshpit averaging); a round that found no group
 * keeps them. The first round under a prefix uses opts->group_bits (empty
 * when NULL: one group key for everybody, for ever). At most
 * HM_AVERAGER_MAX_PREFIXES prefixes are remembered, the least recently used
 * forgotten first.
 *
 * Outcome. The report's status is 0 when every chunk of the vector came
 * back averaged (possibly over fewer members than the group: the spans
 * say over whom), otherwise the reason: -ETIMEDOUT (no group within the
 * matchmaking timeout, or the all-reduce's deadline), -EPERM (the others
 * left us out), -ENOTCONN (nobody else's values reached us),
 * -EHOSTUNREACH, -ECANCELED (hm_averager_cancel or close), or what
 * matchmaking or hm_ar_start refused. stage says which phase ended it.
 * When status is not 0, chunks that did not come back keep our values.
 *
 * Several rounds may run at once under different prefixes (one per group
 * key; matchmaking refuses a second with -EBUSY). HM_AVERAGER_HISTORY
 * finished rounds are kept, the oldest dropped first.
 *
 * Lifetime. Create it on a running node; close it before the node (or
 * right before hm_node_close in the same loop turn). Closing ends every
 * round: their callbacks fire with -ECANCELED from inside
 * hm_averager_close, after which the caller's vectors are free again.
 */
#ifndef HM_AVERAGER_H
#define HM_AVERAGER_H

#include <stddef.h>
#include <stdint.h>

#include "averaging/allreduce.h"
#include "averaging/group.h"
#include "averaging/matchmaking.h"
#include "src/node/node.h"

typedef struct hm_averager hm_averager;

#define HM_AVERAGER_HISTORY 32
#define HM_AVERAGER_MAX_PREFIXES 64

typedef struct hm_avg_opts {
    const char *prefix;              /* 1..HM_MM_PREFIX_MAX bytes, required */
    const char *group_bits;          /* first round under the prefix; NULL: "" */
    double weight;                   /* finite, >= 0 (e.g. samples since the last round) */
    unsigned target_group_size;      /* 0: 16 */
    unsigned min_group_size;         /* 0: 2 (1 when target is 1) */
    uint64_t matchmaking_timeout_ms; /* to find a group; 0: 30000 */
    uint64_t matchmaking_time_ms;    /* one attempt's length (the leader's wait); 0: 5000 */
    uint64_t request_timeout_ms;     /* matchmaking's per-call timeout; 0: 3000 */
    uint64_t round_timeout_ms;       /* the all-reduce's hard deadline; 0: 30000 */
    int compression;                 /* enum hm_avg_comp */
    double bandwidth;                /* bytes per second declared; 0: 1e8 */
    int client_mode;                 /* send and receive, reduce nothing, never lead */
    int aggregate;                   /* enum hm_ar_aggregate */
    double clip_tau;                 /* with HM_AR_CENTERED_CLIP */
    size_t chunk_elems;              /* 0: the all-reduce's default */
    /*
     * hold: matchmaking runs at once, but the all-reduce waits for
     * hm_averager_release (which sets the final weight; the vector may be
     * written until then), at most hold_timeout_ms (0: 60000) after the
     * group formed, else the round fails with -ETIMEDOUT. So a trainer
     * can find its group before its data is ready and begin the all-reduce
     * the moment it is (Hivemind's scheduled step).
     */
    int hold;
    uint64_t hold_timeout_ms;
} hm_avg_opts;

enum hm_avg_stage {
    HM_AVG_STAGE_MATCHMAKING = 0, /* ended (or is) looking for a group */
    HM_AVG_STAGE_ALLREDUCE = 1,   /* the group formed; ended (or is) in the all-reduce */
};

typedef struct hm_avg_report {
    uint64_t round;                          /* this averager's round number, from 1 */
    int status;                              /* see above */
    int stage;                               /* enum hm_avg_stage */
    char prefix[HM_MM_PREFIX_MAX + 1];
    char group_bits[HM_MM_BITS_MAX + 1];     /* the bits this round looked under */
    double weight;
    size_t n_elems;
    int compression;
    uint64_t started_unix_ms;                /* wall clock */
    double matchmaking_s, allreduce_s, duration_s;
    /*
     * Valid when stage is HM_AVG_STAGE_ALLREDUCE: the group as formed
     * (members in group order, group.self is us, next_bits the bits taken
     * for the next round) and the all-reduce's report (per-member reasons,
     * per-span contributors, bytes).
     */
    hm_avg_group group;
    hm_ar_report ar;
} hm_avg_report;

/* Fired once per started round, from the loop; rep is valid during the call. */
typedef void (*hm_avg_done_cb)(void *ud, int status, const hm_avg_report *rep);

/*
 * Creates the averager on a node: its matchmaker and all-reduce context,
 * which register "avg.mm.*" and "avg.part"/"avg.dead" on the node's rpc.
 * 0, -ENOMEM or -EEXIST (the node already has an averager).
 */
int hm_averager_new(hm_node *node, hm_averager **out);

/*
 * The all-reduce's bounds on declared weights and bandwidths
 * (allreduce.h, "Bounds"), for rounds started from now on: 0 or -EINVAL.
 * hm_averager_limits reports what they changed (hm_ar_limits).
 */
int hm_averager_set_limits(hm_averager *av, const hm_ar_limit_cfg *lim);
void hm_averager_limits(const hm_averager *av, hm_limit_emit_fn emit, void *ud);

/* The all-reduce's worker threads (hm_ar_set_workers): 0 or a negative code. */
int hm_averager_set_workers(hm_averager *av, unsigned threads);

/*
 * Ends every round (callbacks fire with -ECANCELED before this returns),
 * unregisters the methods and frees the averager; cb (may be NULL) fires
 * from the loop once everything is released.
 */
void hm_averager_close(hm_averager *av, void (*cb)(void *ud), void *ud);

/*
 * Starts a round on data[0..n), averaged in place. Returns 0 (cb will fire
 * once, later), -EINVAL (bad options, a NULL vector, a weight that is not
 * finite and >= 0), -EDOM (the vector holds NaN or infinity), -EBUSY (a
 * round runs under the same group key), -ENOBUFS (too many rounds),
 * -ESHUTDOWN (closing) or -ENOMEM. round_out (may be NULL) gets the round
 * number for hm_averager_cancel.
 */
int hm_averager_round(hm_averager *av, const hm_avg_opts *opts, float *data, size_t n,
                      hm_avg_done_cb cb, void *ud, uint64_t *round_out);

/*
 * Releases the held rounds under prefix (hold above) with weight (finite,
 * >= 0): one whose group formed begins its all-reduce now, one still
 * looking begins it as soon as its group forms. Returns the number of
 * rounds released (0: none held under prefix), -EINVAL, or -EDOM when a
 * released round's vector holds NaN or infinity (that round then fails
 * with -EDOM).
 */
int hm_averager_release(hm_averager *av, const char *prefix, double weight);

/* Ends a round now; its callback fires with -ECANCELED (matchmaking) at
 * once or (all-reduce) from the loop soon after. 0 or -ENOENT. */
int hm_averager_cancel(hm_averager *av, uint64_t round);

/* A round in progress, for status. */
typedef struct hm_avg_active {
    uint64_t round;
    int stage;
    char prefix[HM_MM_PREFIX_MAX + 1];
    size_t n_elems;
    size_t group_size;       /* 0 while looking */
    uint64_t started_unix_ms;
} hm_avg_active;

/* Copies up to max rounds in progress, oldest first; returns their number. */
size_t hm_averager_active(const hm_averager *av, hm_avg_active *out, size_t max);

/*
 * Copies up to max finished rounds, newest first, and returns how many
 * are kept (at most HM_AVERAGER_HISTORY).
 */
size_t hm_averager_history(const hm_averager *av, hm_avg_report *out, size_t max);

/* The node this averager runs on. */
hm_node *hm_averager_node(hm_averager *av);

#endif

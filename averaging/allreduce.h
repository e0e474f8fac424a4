/*
 * allreduce: the butterfly all-reduce of one averaging round inside a group
 * that matchmaking already formed (group.h). It owns the per-node context
 * that routes all-reduce messages to rounds, every round's sender and
 * reducer state, and the report handed to the caller. It runs on the node's
 * uv loop over the node's hm_rpc stream calls (encrypted, chunked,
 * multiplexed, with deadlines).
 *
 * Layout. The flat float32 vector of n elements is split into one span per
 * member, in group order, sized in proportion to the members' declared
 * bandwidth: each bandwidth is quantized to an integer share (share_i =
 * floor(2^20 * b_i / max_b)) and span i covers [floor(n * S_i / S),
 * floor(n * S_{i+1} / S)) with S_i the sum of the shares before i, all in
 * integers, so that every member computes the same layout bit for bit.
 * Members with bandwidth 0 (client mode) get empty spans and reduce nothing.
 * A span is cut into chunks of chunk_elems elements (with the default
 * chunk size, a vector of at most 2^18 elements, 1 MiB, is one chunk per
 * span: one round trip each); chunk k of span s is
 * the task (k, s), and tasks are ordered chunk-major (all spans' chunk 0,
 * then all chunk 1, ...), so that every reducer is kept busy at once.
 *
 * Messages (stream calls, bodies msgpack, decoded with wire.h's bounded
 * validator; sizes checked against the layout):
 *   Every message opens with the averaging protocol version, 2
 *   (HM_AR_VERSION; version 1 returned the average itself under
 *   compression, see "Compressed rounds"). A message of another version is
 *   refused (-EPROTO) and logged as a peer to upgrade, once a minute.
 *   "avg.part" request: [2, group_id(bin 32), sender, n_total, span, chunk,
 *        kind, weight, dead_mask, bad_mask, contrib_mask, data(bin)]
 *     kind 0 (DATA): the sender's own values, always. Kind 1 (RESULT, a
 *     chunk average handed on with its contributors in contrib_mask) is
 *     retired since rollback (below) makes every replacement average
 *     from DATA: the codec still parses it, and a reducer refuses it
 *     (-EPROTO, the sender marked bad). data is one chunk in codec.h's
 *     self-describing format (none, fp16 or 8-bit).
 *   reply (any status): [2, dead_mask, bad_mask, contrib_mask, data(bin)|nil,
 *        form, share]
 *     status 0 carries the chunk's answer and who is in it: form 0, the
 *     average itself (rounds without compression); form 1, the average
 *     minus the sender's part as the reducer decoded it, with share the
 *     sender's weight over the chunk's total weight in [0, 1] (compressed
 *     rounds, below). Refusals carry form 0, share 0 and no data:
 *     -EAGAIN    this node has not started that group (yet): retry shortly;
 *     -EXDEV     not this node's span in its view (the masks say why);
 *     -EPERM     the sender is not a member or is left out of the round;
 *     -EPROTO / -EINVAL / -EDOM  malformed part, wrong size or non-finite
 *                values: the sender is left out of the round (marked bad);
 *     -ETIME     the chunk was final before the part arrived (late sender);
 *     -ESTALE    the sender's view names the receiver dead;
 *     -ESRCH     this node's round ended (its barrier or its deadline);
 *     -ESHUTDOWN this node left the round before its end (hm_ar_cancel,
 *                hm_ar_ctx_close, or it gave up): gone for the round.
 *   "avg.dead" request: [2, group_id, sender, n_total, dead_mask, bad_mask,
 *        done]: a member tells the others whom it found dead or bad
 *     (done 0, a notice) or that it holds every result under that view
 *     (done 1, the end-of-round barrier below); done may be absent (0).
 *     Reply with status 0: the same form with the receiver's view (done 0),
 *     so that a member learns the deaths the other knows of.
 * A member whose n_total differs from ours (it averages another vector) is
 * marked bad on its first message. A sender whose own part was checked
 * (finite, our layout) and is still called malformed by a reducer blames
 * the reducer: that reducer is marked bad and its span moves on.
 * Masks are bit i for member i (HM_AVG_MAX_GROUP is 64). Every part and
 * reply carries the sender's view, so views converge with the traffic;
 * views are only merged from members in good standing (not dead, bad or
 * late in ours), and a view naming ourselves dead is refused, so that a
 * member that was stopped and resumes with a stale view cannot exclude the
 * live ones.
 *
 * Flow. Every member sends each chunk of each span to the span's reducer
 * with its weight (to itself without the network), at most `window` tasks
 * ahead of its oldest unfinished one, in task order; that keeps memory
 * bounded and guarantees progress (the globally oldest task has been sent
 * by every live member). A reducer keeps each sender's decoded chunk until
 * the chunk is final: when every live, non-late member's part is in, or
 * part_timeout_ms after its first part (the missing senders are then
 * marked late and not waited for again: a sender that misses its deadline
 * is left out of the spans it had not sent, but parts it still sends to
 * open chunks count). The reducer then answers every held call with the
 * weighted average (in double precision; weights summing to 0 give the
 * plain mean) or CenteredClip, and frees the chunk. Parts for a group the
 * node has not started are held for a while (see "Early parts" below),
 * else refused with -EAGAIN and retried with backoff.
 *
 * Failures. A reducer whose call fails (transport error, connection reset,
 * no answer within reducer_timeout_ms, "not ready" for as long, a reply
 * with bad data, a refusal of a part we checked) is dead (or bad) for the
 * round, and so is one that left it (-ESHUTDOWN: a cancel or a close
 * answers the calls it held, and the parts sent to it afterwards, so); a
 * reducer whose round ended (-ESRCH) or whose chunk was final (-ETIME)
 * only means we were late, and that chunk keeps our values. The finder
 * tells every other live member ("avg.dead"), and every member that learns
 * of it (from its own call, the notice, or a mask riding on any message)
 * reassigns the dead reducer's span, and any span that member held, to the
 * next live member with bandwidth > 0 after it in group order (cyclic), the
 * same choice everywhere. Each member then sends every chunk of that span
 * to the replacement again, as DATA with its own values (rollback below),
 * and the replacement averages them over the live members. A member that
 * quits early (its values not finite, or hm_ar_cancel) says so with a
 * view naming itself dead (a farewell), so that the others do the same
 * for it at once. A member found
 * dead or bad is removed from every chunk this node has open, its held
 * calls are refused and its later parts too; a sender caught with
 * non-finite values or a wrong size is marked bad the same way. A member
 * that learns it was left out stops and reports -EPERM; its data keeps its
 * local values where no average came back. No state survives a round:
 * every chunk still open at the round deadline is finalized with what is
 * in, and the round ends by its deadline whatever happens.
 *
 * Rollback. A result is only final once every contributor is known to have
 * lived through the round. Each member keeps a copy of its own input for
 * the round, and each reducer remembers, per final chunk, whose parts are
 * in it (one 64-bit mask). When a member learns that someone is dead or
 * bad (from its own call, a notice, a mask on any message), every average
 * it holds that includes that member is undone: as a sender it puts its
 * own values back into those chunks and sends them again (to the same
 * reducer, or to the replacement if the reducer is the one gone); as a
 * reducer it reopens those final chunks, and averages the parts sent
 * again over the members still in. An answer that arrives holding a member
 * the sender already knows is out is not taken: the part goes again, with
 * the sender's view, which makes the reducer reopen the chunk. So a member
 * killed while reducing (after the others' parts reached it, and after
 * its own parts went into averages others handed out) ends up in no chunk
 * of any survivor.
 *
 * The end-of-round barrier. A member whose tasks are all finished does
 * not end its round: it sends "done" (with its view) to every member not
 * out, keeps serving its chunks, and ends once every member it waits for
 * (not dead, bad or late in its view) has sent "done" under the same view
 * as its own now, or has ended its round ("round over"), or at the
 * deadline. A "done" sent under an older view does not count, since that
 * member still has to undo averages; a member that does not answer our
 * "done" (and whose own "done" we do not hold) is dead, which is how a
 * member killed after every call to it was answered is still found. So no
 * survivor ends with an average that another survivor is about to undo.
 *
 * What a result contains. A chunk's average is over exactly the members
 * whose part was in when the chunk became final (after any rollback), and
 * the report says who for each span. A member found dead or bad during the
 * round is in no chunk of any survivor. Members marked late are not waited
 * for at the barrier: a late member's parts that made it into open chunks
 * count, and a late member that dies after the others ended stays in them.
 * Races remain only where the round is already over for someone: a member
 * that dies after it sent "done" to some members but not others (it had
 * every result: the ones that got its "done" keep it, the others undo it),
 * or a member late in some views and waited for in others, found dead after
 * the ones that did not wait ended (the others cannot reopen chunks held
 * there: those keep their local values and the round reports -ETIMEDOUT).
 * Each member's report still says exactly whom its values include.
 *
 * Early parts. Members start a round when matchmaking tells each of them,
 * so the first parts of a fast member often reach one that has not
 * started yet. Refusing them with -EAGAIN made the sender retry after at
 * least 10 ms, far longer than a whole round of a small tensor takes. A
 * part or notice for a group this node has not started (and has not
 * ended) is instead held, its call unanswered, for at most
 * EARLY_HOLD_MS; when the round starts, the next tick hands every held
 * message to the round as if it had just arrived, so the sender's call is
 * answered when its chunk is final, with no retry. What is held is
 * bounded in bytes (body plus bookkeeping), in total (early_bytes,
 * AverageEarlyPartsMiB) and per network origin (early_origin_bytes,
 * AverageEarlyPartsOriginMiB), since nothing about the sender can be
 * checked before the group is known; past either bound, or once the hold
 * expires, the message is refused with -EAGAIN as before (the sender
 * retries with backoff) and the refusal is counted. The rpc layer's bound
 * on unanswered inbound requests per peer applies to held calls too.
 *
 * Compressed rounds. With fp16 or 8 bits on the wire, a sender's part is
 * rounded once on its way to the reducer, and what comes back is rounded
 * again. Write x_j for sender j's exact values, p_j for its part as the
 * reducer decodes it (the sender computes the same p_j itself with
 * hm_avg_chunk_roundtrip), e_j = p_j - x_j (0 for the reducer's own part,
 * which never goes through the codec), w_k for the clamped weights, W
 * their total and m = sum_k w_k x_k / W the exact mean. The reducer's
 * average is
 *     a = sum_k w_k p_k / W = m + sum_k w_k e_k / W.
 * Version 1 sent a back encoded, so a sender ended with a + E(a): the
 * inputs' errors plus a second rounding of a full-size value (half an
 * fp16 ulp of |a|, or half an 8-bit step of the average's range). Now the
 * reducer sends, per sender, the difference d_j = a - p_j encoded, and the
 * share s_j = w_j / W; the sender decodes d_j + E(d_j) and computes
 * (hm_avg_delta_apply)
 *     y_j = p_j + (d_j + E(d_j)) + s_j (x_j - p_j)
 *         = a - s_j e_j + E(d_j)
 *         = m + sum_{k != j} w_k e_k / W + E(d_j).
 * So the one input error a sender knows exactly, its own, leaves its
 * result; the return trip's error E(d_j) is relative to the distance from
 * the average, not to the average (members of one model are close to
 * each other, so |d_j| is much smaller than |a|); what remains is the
 * other senders' rounding, by their share. In a pair the member that does
 * not reduce a span ends with m + E(d_j) there, and the reducer with
 * m + s_j e_j. Hivemind's reducers send the same difference and a sender
 * adds it to x_j: y = m + sum_{k != j} w_k e_k / W - (1 - s_j) e_j +
 * E(d_j); the share term removes that -(1 - s_j) e_j, the largest term in
 * groups of more than two. CenteredClip is not linear in the parts, so
 * under it the share is 0 and y_j = a + E(d_j). Rounds without
 * compression keep form 0: p_j = x_j and the average comes back exact.
 * A reducer is trusted with its span's answer anyway; a share outside
 * [0, 1] or a difference that does not decode marks it bad.
 *
 * Memory. Per round: the caller's vector (written in place) and one copy
 * of it (our input, for rollback), so twice the vector; at most `window`
 * outgoing chunk bodies per member (uncompressed ones lent to the
 * transport out of the rollback copy, uncopied; a round that ends with
 * some still queued has them copied in, hm_transport_unhold, so the copy
 * is not pinned by a slow peer); at the reducer, one decoded chunk per live sender for each open
 * chunk and one mask per chunk of the spans it reduces; senders keep at
 * most `window` tasks open each. Beyond the two vectors, that is a few tens
 * of MiB at most with the defaults, whatever the tensor's size.
 *
 * Trust. Members are trusted to report deaths honestly: a member that lies
 * in its masks can leave others out of a round. Data is checked (sizes,
 * finiteness), and CenteredClip bounds what a minority of bad values can do
 * to an average. A reducer is trusted with its own span's answer, which is
 * why the shares below are bounded.
 *
 * Bounds on what a member declares (hm_ar_limit_cfg; docs/security.md,
 * "Averaging and state download"). Weights and bandwidths are the
 * members' own word, so a hostile one could declare 1e30 and own every
 * average, or 1e12 bytes per second and reduce nearly the whole vector.
 *   - Weights: a reducer clamps every part's weight, per chunk, to
 *     weight_factor (mean) or clip_weight_factor (centered_clip) times
 *     the median positive weight among that chunk's parts (the lower
 *     median: element floor((k-1)/2) of the k sorted positive weights).
 *     A member alone thus holds at most F / (F + others) of the total when
 *     the others declare the median weight; with factor 1 under
 *     CenteredClip one member among h honest of equal weight holds 1/(h+1)
 *     of the weight, below half for h >= 2, which is the condition of
 *     CenteredClip's bound. The clamped weights are then divided by their
 *     largest and the average is accumulated in double, so no weight (up
 *     to DBL_MAX) can overflow it: every float32 part times a weight in
 *     [0, 1], summed over at most 64 members, stays finite.
 *   - Bandwidths: the leader clamps the group's declared bandwidths to
 *     bandwidth_factor times their lower median positive value before it
 *     announces the group, and every follower refuses a group past its own
 *     factor (group.h, hm_avg_bandwidth_cap), so all members split the
 *     vector from the same bounded numbers whatever factor each one runs
 *     with. The layout clamps again with this node's factor, which changes
 *     nothing in a group that passed matchmaking.
 * Both default to values that leave honest swarms exact (weights within a
 * factor of 4 of the median average exactly as declared).
 */
#ifndef HM_AVG_ALLREDUCE_H
#define HM_AVG_ALLREDUCE_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "averaging/group.h"
#include "src/net/rpc.h"
#include "src/base/origin.h"
#include "src/base/wire.h"

typedef struct hm_ar_ctx hm_ar_ctx;
typedef struct hm_ar_round hm_ar_round;

#define HM_AR_PART_METHOD "avg.part"
#define HM_AR_DEAD_METHOD "avg.dead"
/* 2: compressed answers are differences from the sender's part (form 1). */
#define HM_AR_VERSION 2
/* Largest chunk a part may carry; matches codec.h's cap. */
#define HM_AR_MAX_CHUNK_ELEMS (1u << 24)

enum hm_ar_kind { HM_AR_DATA = 0, HM_AR_RESULT = 1 };
/* What a reply's data holds (allreduce.h, "Compressed rounds"). */
enum hm_ar_form { HM_AR_FORM_AVERAGE = 0, HM_AR_FORM_DELTA = 1 };
enum hm_ar_aggregate { HM_AR_MEAN = 0, HM_AR_CENTERED_CLIP = 1 };

/* Why a member was left out, per member in the report. */
enum hm_ar_reason {
    HM_AR_IN = 0,      /* took part */
    HM_AR_LATE = 1,    /* missed a reducer's deadline as a sender (out of the spans it had not sent) */
    HM_AR_DEAD = 2,    /* its calls failed or timed out: out of the round */
    HM_AR_BAD = 3,     /* sent non-finite values, a wrong size or a malformed part */
};

typedef struct hm_ar_config {
    uint64_t round_timeout_ms;   /* hard end of the round, default 30000 */
    uint64_t part_timeout_ms;    /* reducer's wait for missing senders, default round/5 */
    uint64_t reducer_timeout_ms; /* sender's wait for a reducer's answer, default round*2/5 */
    size_t chunk_elems;          /* default 65536 (256 KiB of float32); by default a
                                    vector of <= 2^18 elements goes as one chunk per span */
    size_t window;               /* tasks in flight per member, default 16, at most 32 */
    int compression;             /* enum hm_avg_comp, default none */
    int aggregate;               /* enum hm_ar_aggregate */
    double clip_tau;             /* CenteredClip radius, required when aggregate is clip */
    unsigned clip_iters;         /* default 20 */
    int input_checked;           /* nonzero: the caller has just found every value finite
                                    (hm_avg_all_finite), so hm_ar_start skips that pass
                                    over the vector; a value that is not finite is still
                                    refused chunk by chunk, as it is reduced or sent (the
                                    round then ends -EDOM) */
} hm_ar_config;

typedef struct hm_ar_span_report {
    size_t offset, count;     /* elements of the vector */
    size_t n_chunks;
    int reducer;              /* by layout; -1 for an empty span */
    int final_reducer;        /* who reduced it in the end; -1 if empty or none could */
    uint64_t contributors;    /* members in every averaged chunk of the span */
    uint64_t partial;         /* members in some averaged chunks but not all */
    size_t chunks_local;      /* chunks left at our local values */
} hm_ar_span_report;

typedef struct hm_ar_report {
    /*
     * 0: every chunk came back averaged. Otherwise the first reason some did
     * not: -ETIMEDOUT (round deadline, or we were late), -EPERM (we were
     * left out), -EHOSTUNREACH (no live reducer left for a span),
     * -ENOTCONN (every other member ended dead, bad or late in our view, or no
     * chunk we got back holds anyone else's values: how a member cut off
     * from the rest sees the round; its chunks may hold partial averages),
     * -ECANCELED (hm_ar_cancel or the rpc layer closed).
     */
    int status;
    size_t group_size, self;
    uint8_t group_id[HM_AVG_GROUP_ID_BYTES];
    int reason[HM_AVG_MAX_GROUP]; /* enum hm_ar_reason per member, as this node saw it */
    uint64_t bytes_sent, bytes_received; /* all-reduce message bodies, network only */
    double duration_s;
    size_t n_spans;                         /* = group_size */
    hm_ar_span_report spans[HM_AVG_MAX_GROUP];
} hm_ar_report;

/* Fired exactly once per started round, from the loop; the vector is the
 * caller's again. */
typedef void (*hm_ar_done_cb)(void *ud, const hm_ar_report *rep);

void hm_ar_config_defaults(hm_ar_config *cfg);

/* The bounds above; defaults HM_AR_*_FACTOR_DEFAULT. Each factor is at least 1. */
#define HM_AR_WEIGHT_FACTOR_DEFAULT 4.0
#define HM_AR_CLIP_WEIGHT_FACTOR_DEFAULT 1.0
#define HM_AR_BANDWIDTH_FACTOR_DEFAULT 2.0
#define HM_AR_EARLY_MIB_DEFAULT 64
#define HM_AR_EARLY_ORIGIN_MIB_DEFAULT 16
typedef struct hm_ar_limit_cfg {
    double weight_factor;      /* mean: weight <= this x the chunk's median weight */
    double clip_weight_factor; /* centered_clip: the same */
    double bandwidth_factor;   /* bandwidth <= this x the group's median bandwidth */
    /* Matchmaking (matchmaking.h): members of one origin in a group; 0: no
     * cap. Loopback origins are capped only with cap_loopback. */
    unsigned members_per_origin;
    int cap_loopback;
    /* -- early parts options -- */
    /* Bytes of messages held for rounds not started yet (allreduce.h,
     * "Early parts"), in total and per origin; 0 holds nothing. */
    size_t early_bytes;
    size_t early_origin_bytes;
} hm_ar_limit_cfg;

void hm_ar_limit_defaults(hm_ar_limit_cfg *lim);
/*
 * Sets the bounds for rounds started from now on. 0, or -EINVAL when a
 * factor is under 1 or not finite.
 */
int hm_ar_set_limits(hm_ar_ctx *ctx, const hm_ar_limit_cfg *lim);
/*
 * Reports what the weight bounds changed, by config keyword:
 * AverageWeightFactor and AverageClipWeightFactor (parts whose weight a
 * reducer here clamped), AverageEarlyPartsMiB and AverageEarlyPartsOriginMiB
 * (early messages refused at once, and held ones that expired). The bandwidth bound is reported by the averager,
 * which adds matchmaking's count to hm_ar_bandwidths_clamped.
 */
void hm_ar_limits(const hm_ar_ctx *ctx, hm_limit_emit_fn emit, void *ud);
double hm_ar_bandwidth_factor(const hm_ar_ctx *ctx);
/* Members whose bandwidth a layout here clamped (0 in groups whose leader
 * bounded them already, as matchmaking does). */
uint64_t hm_ar_bandwidths_clamped(const hm_ar_ctx *ctx);


/*
 * Creates the context on a node's rpc layer and registers the methods
 * ("avg.part", "avg.dead"); one per rpc. -EEXIST when already registered.
 */
int hm_ar_ctx_new(uv_loop_t *loop, hm_rpc *rpc, const hm_identity *id, hm_ar_ctx **out);
/*
 * Ends every round now (each done_cb fires with -ECANCELED before this
 * returns), then closes the timer and frees the context in its close
 * callback and fires cb. The rpc layer keeps pointers to the handlers and
 * has no unregister: call hm_rpc_close right after this, before the loop
 * runs again (the rpc layer delivers nothing once closing).
 */
/*
 * Replaces the context's averaging workers (see "Threads" below): threads
 * 1..16, or 0 to finalize every chunk on the loop thread as before (the
 * benchmark's reference). Default 0: on the 2-core machine measured the
 * loop alone is as fast (docs/benchmarks.md, "Averaging on worker
 * threads"); hm_workpool_default_threads() is the machine's cores less
 * one, 1 to 8.
 * -EBUSY while a round runs.
 */
int hm_ar_set_workers(hm_ar_ctx *ctx, unsigned threads);

void hm_ar_ctx_close(hm_ar_ctx *ctx, void (*cb)(void *ud), void *ud);

/*
 * Starts our part of a round: data[0..n) is read and overwritten in place
 * with the averages; it must stay valid until done_cb. group is copied;
 * group->self is our index and its pk must be ours. weight must be finite
 * and >= 0. Returns 0 (done_cb will fire), -EINVAL, -EALREADY (a round for
 * that group id is running), -EHOSTUNREACH (no member has bandwidth), or
 * -ENOMEM.
 */
int hm_ar_start(hm_ar_ctx *ctx, const hm_avg_group *group, float *data, size_t n, double weight,
                const hm_ar_config *cfg, hm_ar_done_cb cb, void *ud, hm_ar_round **round_out);
/* Ends the round early: done_cb fires from the loop with -ECANCELED. */
void hm_ar_cancel(hm_ar_round *round);

/* The span layout: offsets/counts for every member (n_members entries), with
 * bandwidths bounded by HM_AR_BANDWIDTH_FACTOR_DEFAULT; hm_ar_layout_bounded
 * takes the factor (>= 1; a smaller or non-finite one means the default). */
int hm_ar_layout(const hm_avg_group *group, size_t n, size_t *offsets, size_t *counts);
int hm_ar_layout_bounded(const hm_avg_group *group, size_t n, double bandwidth_factor,
                         size_t *offsets, size_t *counts);
/*
 * The bound of a set of weights: factor x the lower median of the positive
 * ones (0 when none is positive, then nothing is clamped). Public for the
 * tests; the reducer applies it per chunk.
 */
double hm_ar_weight_cap(const double *w, size_t n, double factor);

/* ---- messages (public for the fuzz target and tests) ---- */

typedef struct hm_ar_part_msg {
    uint8_t group_id[HM_AVG_GROUP_ID_BYTES];
    uint32_t sender, span, chunk;
    uint64_t n_total;
    uint32_t kind;
    double weight;
    uint64_t dead_mask, bad_mask, contrib_mask;
    const uint8_t *data; /* a codec chunk, pointing into the decoded buffer */
    size_t data_len;
} hm_ar_part_msg;

typedef struct hm_ar_reply_msg {
    uint64_t dead_mask, bad_mask, contrib_mask;
    const uint8_t *data; /* NULL when absent */
    size_t data_len;
    uint32_t form;       /* enum hm_ar_form */
    double share;        /* the sender's share of the average, in [0, 1] */
} hm_ar_reply_msg;

typedef struct hm_ar_dead_msg {
    uint8_t group_id[HM_AVG_GROUP_ID_BYTES];
    uint32_t sender;
    uint64_t n_total;
    uint64_t dead_mask, bad_mask;
    uint32_t done; /* 1: the sender has every result under this view (the barrier) */
} hm_ar_dead_msg;

/*
 * Encoders write into a bounded writer (see wire.h). Decoders validate the
 * whole buffer with the bounded validator (one object, no trailing bytes),
 * check types and ranges (version, group id length, member indices below
 * HM_AVG_MAX_GROUP, kind, weight finite and >= 0, a reply's form known and
 * its share finite in [0, 1], form 1 only with data, the chunk's codec
 * header and length, at most max_elems elements) and return 0, -EPROTO,
 * -EINVAL, -EMSGSIZE or -ENOMEM. Checks against a round's layout are the
 * caller's. hm_ar_msg_version says which version a body claims (its first
 * element), or -1 when it does not look like an averaging message, so
 * that a peer of another version can be named as such.
 */
int hm_ar_msg_version(const uint8_t *buf, size_t len);
void hm_ar_part_encode(hm_wire_wr *w, const hm_ar_part_msg *m);
/* Everything up to and with data's bin header (data_len bytes): the data
 * itself is then sent after it as it lies (hm_rpc_callv). */
void hm_ar_part_encode_head(hm_wire_wr *w, const hm_ar_part_msg *m);
int hm_ar_part_decode(const uint8_t *buf, size_t len, size_t max_elems, hm_ar_part_msg *out);
void hm_ar_reply_encode(hm_wire_wr *w, const hm_ar_reply_msg *m);
/* A reply in three pieces: the head (with data's bin header, or its nil),
 * data's bytes as they lie, the tail. */
void hm_ar_reply_encode_head(hm_wire_wr *w, const hm_ar_reply_msg *m);
void hm_ar_reply_encode_tail(hm_wire_wr *w, const hm_ar_reply_msg *m);
int hm_ar_reply_decode(const uint8_t *buf, size_t len, size_t max_elems, hm_ar_reply_msg *out);
void hm_ar_dead_encode(hm_wire_wr *w, const hm_ar_dead_msg *m);
int hm_ar_dead_decode(const uint8_t *buf, size_t len, hm_ar_dead_msg *out);

#endif

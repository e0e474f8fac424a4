/*
 * progress: the swarm-progress record and its aggregate, pure functions
 * over caller memory (it owns nothing). cmd_progress.c publishes and reads
 * the records; the fuzz target (tests/fuzz/fuzz_progress.c) drives the
 * decoder.
 *
 * Every trainer's progress in a run is one signed DHT record under the key
 * "RUN.progress", with the reporting daemon's owner marker
 * "[owner:PEERID]" as its subkey (so the DHT accepts it only with that
 * daemon's signature, dht/record.h). Its value is a msgpack map of these
 * five entries, in any order, and optionally a sixth:
 *
 *   "epoch"              uint, at most HM_PROGRESS_MAX_EPOCH
 *   "samples"            uint, samples accumulated in this epoch, at most
 *                        HM_PROGRESS_MAX_SAMPLES
 *   "samples_per_second" float or uint, finite, 0 to HM_PROGRESS_MAX_SPS
 *   "time"               float or uint: the reporter's wall clock (UNIX
 *                        seconds) when the values were current
 *   "client"             bool: the trainer is a client (its epoch does not
 *                        lead the swarm's)
 *   "addr"               (optional) str HOST:PORT of at most
 *                        HM_PROGRESS_ADDR_MAX bytes: where the reporting
 *                        daemon answers, so that a reader that never met it
 *                        can prove the owner is there (its origin counts)
 *
 * of at most HM_PROGRESS_VALUE_MAX bytes. Anything else (another key, a
 * missing one, a number out of range) is refused, so that a hostile record
 * is ignored whole rather than half-read.
 *
 * The aggregate follows Hivemind's ProgressTracker, with network origins
 * (src/base/origin.h) where it counted peers, since identities are free.
 * Only records whose owner was verified at an address count (the caller
 * says which, and at which origin; docs/security.md, "Swarm progress
 * records"). Per origin: its epoch is the largest over its non-client
 * records (its client records when it has no other), its samples are the
 * sum over its records at the global epoch of samples +
 * samples_per_second * (now - time), the elapsed time clamped to [0,
 * HM_PROGRESS_TTL_MAX], and its throughput the sum of its records'
 * samples_per_second. Then:
 *
 *   - the global epoch is the largest epoch that at least epoch_origins
 *     trainer origins (client origins when there is no trainer) have
 *     reached, or all of them when fewer are counted: one origin alone
 *     cannot move it; with majority set, also at least a strict majority
 *     of those origins (more than half), so that an attacker on fewer
 *     origins than the honest trainers have cannot move it at all, however
 *     many origins epoch_origins asks for;
 *   - an origin's samples count at most origin_factor times the lower
 *     median over the origins with records at the global epoch, and its
 *     throughput at most origin_factor times the lower median over all
 *     counted origins; the swarm's samples and throughput are the sums.
 *
 * A record whose time lies more than HM_PROGRESS_SKEW_S in the reader's
 * future is ignored.
 *
 * A stale record counts nowhere (neither its vote nor its samples): one
 * at least HM_PROGRESS_STALE_S old whose own throughput would have
 * brought it to twice the target in that time (target > 0, its
 * samples_per_second > 0), unless the reader knows it is alive (live: this
 * daemon's own trainers). A trainer that reports reaches the target and
 * publishes a new epoch long before, and a live one's daemon refreshes its
 * record every few seconds (cmd_progress.c); what is left is a dead or
 * stopped trainer's last word, which would otherwise hold the majority
 * epoch down for the record's whole lifetime. The age is the reader's
 * clock minus the writer's, so the rule assumes clocks within a few
 * seconds (NTP); a reader more than about 10 s ahead takes fast live
 * trainers for stale. And it only applies where one trainer's
 * throughput covers twice the target within the record's lifetime; in a
 * slow swarm a dead record votes until it expires.
 */
#ifndef HM_DAEMON_PROGRESS_H
#define HM_DAEMON_PROGRESS_H

#include "src/base/crypto.h"
#include "src/base/origin.h"

#include <stddef.h>
#include <stdint.h>

#define HM_PROGRESS_RUN_MAX 128
#define HM_PROGRESS_VALUE_MAX 192
/* The longest "addr" ("[v6 address]:port" fits). */
#define HM_PROGRESS_ADDR_MAX 64
/* Exact as JSON numbers everywhere. */
#define HM_PROGRESS_MAX_EPOCH ((UINT64_C(1) << 53) - 1)
/* 2^40 (about 1.1e12) samples in one epoch of one peer. */
#define HM_PROGRESS_MAX_SAMPLES (UINT64_C(1) << 40)
/* Records of one run a reader takes (the rest of a huge dictionary is not read). */
#define HM_PROGRESS_MAX_READ 513
/* Samples per second one peer may claim. */
#define HM_PROGRESS_MAX_SPS 1e7
/* A record lives at most this long (seconds), which also bounds its extrapolation. */
#define HM_PROGRESS_TTL_MAX 60.0
/* A record this old (seconds) may be stale (above). */
#define HM_PROGRESS_STALE_S 20.0
/* How far in the reader's future a record's time may be. */
#define HM_PROGRESS_SKEW_S 30.0

typedef struct hm_progress_rec {
    uint64_t epoch;
    uint64_t samples;
    double sps;  /* samples per second */
    double time; /* UNIX seconds */
    int client;
    char addr[HM_PROGRESS_ADDR_MAX + 1]; /* "" when the record names none */
} hm_progress_rec;

/*
 * Checks the bounds above (time: finite and positive; addr, when set, a
 * HOST:PORT that parses). 0, or -ERANGE with
 * the offending field's name in *field_out (may be NULL).
 */
int hm_progress_check(const hm_progress_rec *r, const char **field_out);

/* Writes the value into buf (cap bytes); 0 or -EMSGSIZE, -ERANGE (out of bounds). */
int hm_progress_encode(const hm_progress_rec *r, uint8_t *buf, size_t cap, size_t *len_out);

/*
 * Decodes a value from untrusted bytes: hm_wire's validator first, then
 * exactly the five entries. 0, -EMSGSIZE (over HM_PROGRESS_VALUE_MAX or the
 * wire caps), -EINVAL (not msgpack), -EPROTO (another shape or type, or an
 * addr that is no HOST:PORT of at most HM_PROGRESS_ADDR_MAX bytes) or
 * -ERANGE (a number out of bounds).
 */
int hm_progress_decode(const uint8_t *buf, size_t len, hm_progress_rec *out);

/* One peer's record, as the aggregate takes it. */
typedef struct hm_progress_peer {
    char peer[HM_PEER_ID_LEN + 1];
    uint8_t pk[HM_PK_BYTES];
    hm_progress_rec r;
    int verified;     /* its owner was proven at an address: the record counts */
    hm_origin origin; /* that address's origin */
    int unique;       /* counts as an origin of its own (this daemon; exempt loopback) */
    int live;         /* the reader knows it is alive: never stale */
} hm_progress_peer;

/* How records are weighed (hivemindd.conf: ProgressEpochOrigins, ProgressOriginFactor). */
typedef struct hm_progress_rules {
    unsigned epoch_origins; /* 0 takes 1 */
    unsigned origin_factor; /* 0: no clamp */
    /* -- progress majority -- */
    int majority;           /* the epoch also needs a strict majority of the voting origins */
} hm_progress_rules;

typedef struct hm_progress_agg {
    uint64_t global_epoch;
    double samples;  /* at the global epoch, extrapolated to now */
    double sps;      /* the swarm's throughput */
    double eta_s;    /* to the target; < 0 when unknown (no target or no throughput) */
    size_t n_peers;  /* non-client peers counted */
    size_t n_clients;
    size_t n_origins;  /* origins their records count for */
    size_t ignored;    /* records ignored (time in the future) */
    size_t stale;      /* records of trainers that stopped reporting (above) */
    size_t unverified; /* records whose owner was not proven at an address */
    size_t held_back;  /* origins whose epoch was past the global one it set */
    size_t clamped;    /* origins whose samples or throughput were clamped */
} hm_progress_agg;

/*
 * The aggregate of n peers (at most HM_PROGRESS_MAX_READ) at wall time
 * now under rules (NULL: one origin suffices, no clamp); target 0 means
 * none. A peer's used flag (used_out[i], may be NULL) says whether it
 * counted; peers past HM_PROGRESS_MAX_READ never do. O(n^2) time, no
 * allocation.
 */
void hm_progress_aggregate(const hm_progress_peer *peers, size_t n, double now, uint64_t target,
                           const hm_progress_rules *rules, hm_progress_agg *out, int *used_out);

/* The elapsed time a record is extrapolated over, clamped as above. */
double hm_progress_elapsed(const hm_progress_rec *r, double now);

#endif

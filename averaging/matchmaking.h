/*
 * matchmaking: forms averaging groups through the DHT, with Hivemind's
 * scheme and Moshpit's group bits. It owns the node's "avg.mm.join" and
 * "avg.mm.wait" handlers, every search in progress (its DHT declaration,
 * the candidate leaders it read, the join or wait call it has in flight,
 * the followers it holds as a leader) and nothing else; the group it hands
 * back (group.h) goes to the all-reduce.
 *
 * Group key. A peer that wants to average under PREFIX with group bits B
 * (a string of up to 32 '0'/'1') meets only peers with the same key
 * "PREFIX.0bB". After a round every member gets next_bits: B shifted left
 * by ceil(log2(target_group_size)) bits, with the member's bucket appended,
 * the buckets being a permutation drawn from the group id, so the members
 * of one group land under different keys next round and meet new partners
 * (Moshpit averaging). With target_group_size 2 this is pairwise gossip.
 * With B empty everybody shares one key forever.
 *
 * Declaration. Each peer not in client mode stores under its group key a
 * dictionary entry whose subkey is its owner marker "[owner:PEERID]"
 * (record.h), so the node signs it and nobody else can forge or overwrite
 * it. The value (hm_mm_decl) carries its listen address, bandwidth, client
 * flag, its deadline (DHT time in ms: when it will start with whoever
 * joined it) and whether it is still looking. The entry lives a little past
 * the deadline and is refreshed while the peer waits; when the peer is done
 * it replaces the entry with one that says it no longer looks. A peer's
 * key is (deadline, public key), compared in that order; client-mode peers
 * never declare, never lead, and their key counts as later than any. A
 * search is in client mode when the caller asks, or while the node has no
 * address others can dial (hm_node_announce): once it has one, a searching
 * client becomes a full peer, its key its deadline.
 *
 * Who leads. A searching peer reads the group key's dictionary every
 * quarter of min_matchmaking_ms (at least every 100 ms, at most every 2 s)
 * and asks the candidates whose key is earlier than its own, earliest
 * first, to take it ("avg.mm.join"). A peer that is asked answers at once:
 *   ACCEPTED      with its deadline; the joiner then sends "avg.mm.wait",
 *                 which the leader holds until it begins or disbands;
 *   REDIRECT      it follows someone else: here is that leader, try it;
 *   FULL          it already holds target_group_size - 1 followers;
 *   NOT_LOOKING   it has no search under that key (another prefix or other
 *                 bits, finished, client mode, or its deadline is now);
 *   BAD_DEADLINE  the joiner's key is earlier: the joiner should lead.
 * Since a follower's key is always later than its leader's, "follows" has
 * no cycles. A refused or redirected peer tries the next candidate. A
 * searching peer accepts followers even while it asks an earlier leader;
 * once that leader accepts it, it disbands its own followers and redirects
 * them to its new leader, so a peer that follows never leads. A peer with
 * followers stops asking others when its own deadline is less than
 * request_timeout_ms away; it is then committed: it also accepts a joiner
 * whose key is earlier than its own (it will follow nobody before it
 * begins, so no cycle can form). A peer that nobody follows and whose
 * deadline is less than request_timeout_ms away is stranded: the later
 * peers it waited for lead groups of their own, so it also asks later
 * candidates (and follows later leaders it is redirected to), which take
 * it if committed and answer BAD_DEADLINE otherwise (a refusal for a
 * read period only, not for the attempt). A peer accepted by a leader
 * while its own group filled up begins its own group and tells that leader
 * it leaves (a wait with the leave flag), so its place is given back at
 * once rather than held until request_timeout_ms passes.
 *
 * Assembly. A leader begins when target_group_size - 1 followers wait on
 * it, or at its deadline with at least min_group_size - 1 of them (it
 * takes no new follower from its deadline on, and waits for the waits of
 * those it already accepted, at most request_timeout_ms, since a follower
 * left out at the last moment may find nobody left to group with). It picks
 * a random group id, puts itself and its waiting followers in a random
 * order and answers every held wait with that group (BEGIN); its own
 * callback fires with the same group. At its deadline with too few, it
 * disbands (DISBANDED answers to the waits) and starts a new attempt with
 * a new deadline; so does a follower whose leader refuses, disbands,
 * vanishes (its connection drops, or no answer by the leader's deadline
 * plus twice request_timeout_ms) or sends a malformed group. Every peer
 * keeps trying until the caller's timeout, then fails with -ETIMEDOUT;
 * each attempt's deadline is min(now + min_matchmaking_ms, that timeout).
 *
 * Guarantees. A peer's callback fires once, so a peer is in at most one
 * group per search. A group never holds more than the leader's
 * target_group_size members (peers that average together should use the
 * same size). Every member receives the same group id and members in the
 * same order; only self and next_bits differ. A member that gives up
 * while the leader's BEGIN is on its way (its own timeout or cancel
 * crosses the leader's assembly) is listed in a group it does not run:
 * the all-reduce treats it as a member that died.
 *
 * Bounds. A group holds at most HM_AVG_MAX_GROUP members; a node runs at
 * most HM_MM_MAX_SEARCHES searches (one per group key). Joins come only
 * from authenticated peers of the swarm (the transport sees to that) and
 * are answered at once; held waits are at most target_group_size - 1 per
 * search, and an accepted follower that does not send its wait within
 * request_timeout_ms is dropped. Every message is decoded with the bounded
 * codec (wire.h) into fixed structures, and every call has a timeout.
 *
 * Wire forms (msgpack; bodies of stream rpc calls):
 *   join  [1, group_key bin, addr str, bandwidth float, client bool,
 *          deadline uint]
 *   wait  [1, group_key bin] or [1, group_key bin, true] (leave: the
 *         follower gives its place back; answered DISBANDED)
 *   reply [code, ...]: ACCEPTED [0, deadline]; REDIRECT [1, pk bin(32),
 *          addr str, deadline]; FULL [2], NOT_LOOKING [3],
 *          BAD_DEADLINE [4]; BEGIN [5, group_id bin(32),
 *          [[pk bin(32), addr str, bandwidth float], ...]];
 *          DISBANDED [6] or [6, pk, addr, deadline] (a leader to try next)
 *   decl  [1, addr str, bandwidth float, client bool, deadline uint,
 *          looking bool]  (the DHT value)
 * Addresses are "HOST:PORT" strings (hm_parse_hostport). Deadlines are
 * DHT time (UNIX milliseconds, hm_node_dht_now_ms).
 *
 * Lifetime. hm_mm_free may be called any time before the node is freed
 * (before hm_node_close's callback); a search's callback fires exactly
 * once: with the group, -ETIMEDOUT, -ECANCELED (hm_mm_cancel, hm_mm_free,
 * or the node closing) or another error, never from inside
 * hm_mm_find_group.
 */
#ifndef HM_MATCHMAKING_H
#define HM_MATCHMAKING_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "averaging/group.h"
#include "src/node/node.h"
#include "src/base/wire.h"

#define HM_MM_PREFIX_MAX 128
#define HM_MM_BITS_MAX 32
/* "PREFIX" ".0b" "BITS" */
#define HM_MM_KEY_MAX (HM_MM_PREFIX_MAX + 3 + HM_MM_BITS_MAX)
#define HM_MM_MAX_SEARCHES 16
/* Largest matchmaking message (a BEGIN with HM_AVG_MAX_GROUP members). */
#define HM_MM_WIRE_MAX 16384

typedef struct hm_mm hm_mm;

typedef struct hm_mm_config {
    const char *prefix;          /* 1..HM_MM_PREFIX_MAX bytes, without "[owner:" */
    const char *group_bits;      /* NULL or "" or up to HM_MM_BITS_MAX of '0'/'1' */
    unsigned target_group_size;  /* 1..HM_AVG_MAX_GROUP; 0: 16 */
    unsigned min_group_size;     /* 1..target; 0: 2 (1 when target is 1) */
    uint64_t min_matchmaking_ms; /* an attempt's length; 0: 5000 */
    uint64_t request_timeout_ms; /* per join call, and grace; 0: 3000 */
    double bandwidth;            /* bytes per second, finite, >= 0 */
    int client_mode;             /* never leads; bandwidth 0 in the group */
    /* The bandwidth bound (group.h, hm_avg_bandwidth_cap): as leader we clamp
     * the group to it, as follower we refuse a group past it. 0: 2. */
    double bandwidth_factor;
    /*
     * Members of one network origin (origin.h) in a group, 0 for no cap: as
     * leader we accept no more joins from an origin that has this many
     * (counting ourselves), as follower we refuse an announced group past
     * it. Identities are free, addresses are not: without the cap one host's
     * keys fill a group and own its weight. Loopback origins (one machine
     * running several daemons: tests, demos) are capped only with
     * cap_loopback.
     */
    unsigned members_per_origin;
    int cap_loopback;
} hm_mm_config;

/* group is valid only during the callback (NULL unless status is 0). */
typedef void (*hm_mm_cb)(void *ud, int status, const hm_avg_group *group);

/* Bandwidths this node clamped as leader plus groups it refused as
 * follower for the bandwidth bound (AverageBandwidthFactor). */
uint64_t hm_mm_bandwidth_refused(const hm_mm *mm);
/* Joins refused as leader plus groups refused as follower for the
 * per-origin member cap (AverageMembersPerOrigin). */
uint64_t hm_mm_origin_refused(const hm_mm *mm);
/* Joins, waits and declarations refused for another matchmaking version
 * (AverageProtocolVersion). */
uint64_t hm_mm_old_version(const hm_mm *mm);
/* The version a join, wait or declaration body claims (its first element),
 * or -EPROTO when it claims none. */
int hm_mm_msg_version(const void *buf, size_t len);

/* Registers the handlers on the node's rpc. 0, -ENOMEM or -EEXIST. */
int hm_mm_new(hm_node *node, hm_mm **out);
/* Ends every search (callbacks fire with -ECANCELED) and unregisters. */
void hm_mm_free(hm_mm *mm);

/*
 * Starts looking for a group. Returns 0 (cb fires later, exactly once),
 * -EINVAL (bad config or timeout 0), -EBUSY (a search under the same group
 * key runs), -ENOBUFS (HM_MM_MAX_SEARCHES run) or -ENOMEM. search_out
 * (may be NULL) receives an id for hm_mm_cancel and hm_mm_search_info.
 */
int hm_mm_find_group(hm_mm *mm, const hm_mm_config *cfg, uint64_t timeout_ms, hm_mm_cb cb,
                     void *ud, uint64_t *search_out);
/* The search's callback fires now with -ECANCELED. 0 or -ENOENT. */
int hm_mm_cancel(hm_mm *mm, uint64_t search);

enum hm_mm_phase {
    HM_MM_SEARCHING = 0, /* a potential leader, no join in flight */
    HM_MM_REQUESTING = 1, /* asking a leader to take us */
    HM_MM_FOLLOWING = 2,  /* accepted, waiting for the leader's BEGIN */
};

typedef struct hm_mm_info {
    int phase;
    uint8_t leader_pk[HM_PK_BYTES]; /* REQUESTING or FOLLOWING */
    size_t followers;               /* accepted by us */
    size_t waiting;                 /* of which hold a wait */
    uint64_t deadline_ms;           /* this attempt's, DHT time */
    unsigned attempts;
    size_t candidates;              /* from the last DHT read */
} hm_mm_info;
/* 0 or -ENOENT (unknown or finished search). */
int hm_mm_search_info(const hm_mm *mm, uint64_t search, hm_mm_info *out);

/* Writes "PREFIX.0bBITS" and returns its length, or -EINVAL / -EMSGSIZE. */
int hm_mm_group_key(const char *prefix, const char *bits, char *out, size_t cap);

/*
 * Moshpit's bits for the next round of the member at index of a group of
 * group_size (see above): deterministic in (bits, group_id, index,
 * group_size, num_buckets), distinct across the members of one group when
 * bits has at least ceil(log2(num_buckets)) digits. num_buckets below
 * group_size counts as group_size.
 */
void hm_mm_next_bits(const char *bits, const uint8_t group_id[HM_AVG_GROUP_ID_BYTES],
                     size_t index, size_t group_size, unsigned num_buckets,
                     char out[HM_MM_BITS_MAX + 1]);

/* ---- the messages, pure functions (fuzzed by tests/fuzz/fuzz_matchmaking) ---- */

enum hm_mm_code {
    HM_MM_ACCEPTED = 0,
    HM_MM_REDIRECT = 1,
    HM_MM_FULL = 2,
    HM_MM_NOT_LOOKING = 3,
    HM_MM_BAD_DEADLINE = 4,
    HM_MM_BEGIN = 5,
    HM_MM_DISBANDED = 6,
};

typedef struct hm_mm_join {
    uint8_t key[HM_MM_KEY_MAX];
    size_t key_len;                  /* 1..HM_MM_KEY_MAX */
    struct sockaddr_storage addr;
    double bandwidth;                /* finite, >= 0 */
    int client;
    uint64_t deadline_ms;
} hm_mm_join;

typedef struct hm_mm_wait {
    uint8_t key[HM_MM_KEY_MAX];
    size_t key_len;
    int leave; /* the follower gives its place back (it will not wait) */
} hm_mm_wait;

typedef struct hm_mm_reply {
    int code;
    /* ACCEPTED: the leader's deadline. REDIRECT, DISBANDED with a leader:
     * the suggested leader and its deadline. */
    uint64_t deadline_ms;
    int has_leader;
    uint8_t leader_pk[HM_PK_BYTES];
    struct sockaddr_storage leader_addr;
    /* BEGIN: group id and members (n >= 1, distinct keys; self unset). */
    hm_avg_group group;
} hm_mm_reply;

typedef struct hm_mm_decl {
    struct sockaddr_storage addr;
    double bandwidth;
    int client;
    uint64_t deadline_ms;
    int looking;
} hm_mm_decl;

/* Encoders: errors land in the writer (hm_wire_wr_error). */
void hm_mm_encode_join(hm_wire_wr *w, const hm_mm_join *j);
void hm_mm_encode_wait(hm_wire_wr *w, const hm_mm_wait *m);
void hm_mm_encode_reply(hm_wire_wr *w, const hm_mm_reply *r);
void hm_mm_encode_decl(hm_wire_wr *w, const hm_mm_decl *d);

/*
 * Decoders: buf must be exactly one message of at most HM_MM_WIRE_MAX
 * bytes. They fill out entirely from the bytes (nothing points into buf)
 * and return 0, -EMSGSIZE, -EINVAL (malformed msgpack) or -EPROTO (wrong
 * shape, version, code, types or values: a bad address, a non-finite or
 * negative bandwidth, a duplicated member, a key over its cap).
 */
int hm_mm_decode_join(const void *buf, size_t len, hm_mm_join *out);
int hm_mm_decode_wait(const void *buf, size_t len, hm_mm_wait *out);
int hm_mm_decode_reply(const void *buf, size_t len, hm_mm_reply *out);
int hm_mm_decode_decl(const void *buf, size_t len, hm_mm_decl *out);

#endif

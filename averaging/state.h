/*
 * state: sharing the training state with newcomers. A node that joins a
 * run late downloads the current parameters and optimizer state (to this
 * module one opaque byte blob and a step number) in chunks from several
 * donors at once, checks every chunk against a manifest whose hash more
 * than one donor vouches for, and names and drops a donor that serves bad
 * bytes. It owns the node's "state.manifest" and "state.chunk" rpc methods,
 * the blobs this node shares (copies), their DHT declarations and the
 * timers that refresh them, and every download in progress.
 *
 * Manifest. A shared blob of total_len bytes is cut into chunks of
 * chunk_size bytes (the last one shorter); the manifest is the msgpack
 *   [1, step, total_len, chunk_size, bin(n_chunks * 32)]
 * holding BLAKE2b-256 of every chunk in order, and the state hash is
 * BLAKE2b-256 of the manifest's bytes. So one 32-byte hash pins the step,
 * the length, the chunking and every byte.
 *
 * Donor side. hm_state_share copies the blob and hashes it a slice at a
 * time on the loop (HM_STATE_HASH_SLICE bytes per loop turn, with the
 * next slice 1 ms later so that I/O and other timers run in between: a
 * multi-gigabyte blob never stalls the loop for long); once hashed, the
 * new version replaces the one served so far and the node declares itself
 * under key "PREFIX.state" with its owner marker as subkey (an owned,
 * signed record, as matchmaking declares), value
 *   [HOST:PORT, step, total_len, chunk_size, state_hash bin(32)]
 * with a TTL of ttl_s, refreshed every ttl_s / 3 (with jitter). Sharing a
 * newer step (or the same step again) replaces the old version once the
 * new one is hashed; an older step is refused. The current version and
 * the two it replaced last are served (a newcomer's view of the
 * declarations may be a version or two old when a trainer shares every
 * few seconds), so a share holds up to four copies of its blob while a
 * new one is hashed; a download of an older version sees -ESTALE.
 * Requests (msgpack bodies):
 *   "state.manifest" [prefix str, state_hash bin(32)] -> the manifest bytes
 *   "state.chunk"    [prefix str, state_hash bin(32), index uint] -> the
 *                    chunk's raw bytes
 * answered -ENOENT (no such prefix), -ESTALE (another hash), -ERANGE (index
 * past the end), -EINVAL (malformed), or -ENOBUFS when the bytes already
 * queued to that peer or to all peers pass the serving caps (the newcomer
 * backs off and asks again; this bounds what one donor spends on serving).
 *
 * Newcomer side. hm_state_load reads the declarations under the prefix,
 * groups the donors by (step, state_hash, total_len, chunk_size) and picks
 * the newest step declared alike by at least min_agree donors. It fetches
 * the manifest from one of them and checks that its BLAKE2b-256 is the
 * agreed hash (a donor whose manifest does not match is dropped and the
 * next one asked), then downloads the chunks from every agreeing donor at
 * once: round-robin, at most window chunk requests in flight per donor.
 * Each chunk is checked against the manifest before it is kept. A donor
 * that serves a chunk that does not verify is dropped at once (reason
 * HM_STATE_DROP_BAD_CHUNK); one whose requests fail max_failures times in a
 * row (errors, timeouts, a dead connection) is dropped too; their chunks
 * are asked of the others. A verified chunk is kept whoever sent it. The
 * callback gets the blob and a report: the step and hash, the bytes, and
 * per donor the chunks it served and, if dropped, why.
 *
 * Who is believed. Identities are free, so min_agree counts network
 * origins (src/base/origin.h: a public /24 or /48, a local address whole),
 * not keys: the donors that declare one state count, per origin, at most
 * donors_per_origin (default 1) toward min_agree. A donor's origin is that
 * of the address the node last saw it at (its peer table), if it answered
 * the node's datagram ping there (hm_peer_info.verified: a datagram's
 * source alone can be forged). A donor the node has not seen or not
 * verified has no vote until it proves the address it declares:
 * the load asks it for the manifest it declares (once, at most 16
 * donors per load, with a timeout shorter than the pause between two
 * reads), and from the next read on a donor that answered under its key
 * votes with the origin of that address. Keys that declare a state and
 * are never reachable at their address (another origin's address, or
 * gone) thus never vote, and only donors with a vote are downloaded from.
 * A step agreed on while an unseen donor that declares a newer one is
 * being asked for its proof is not taken at once: the declarations are
 * read again (within dht_attempts), so the newest step is decided with
 * that donor's vote, not by which answer came first.
 * So two
 * identities on one host agreeing on step 999999 are one vote, and the
 * newest step wins only among steps that enough origins vouch for. With a
 * list of trusted donors (hm_state_config) only their declarations count,
 * and one suffices. With max_step_lead set, a step further ahead than that
 * of the state most origins vouch for is not taken, so a few origins
 * agreeing on step 999999 cannot overtake a majority at step 100.
 * hm_state_limits reports how many declarations each rule set aside.
 *
 * Outcome: 0, or -ENOENT (nobody declares a state under the prefix),
 * -EPROTO (declarations exist but no step has min_agree agreeing donors,
 * or every agreeing donor served a bad manifest), -EHOSTUNREACH (every
 * agreeing donor was dropped before the download ended), -EMSGSIZE (the
 * agreed state is larger than max_blob_bytes or the caller's buffer),
 * -ETIMEDOUT (the load's deadline passed), -ECANCELED (hm_state_close),
 * -ENOMEM. When no agreement is found, the declarations are read again
 * up to dht_attempts times before failing, so donors that declared a
 * moment ago are still found.
 *
 * Hashing. A newcomer hashes each chunk (at most HM_STATE_CHUNK_MAX = 1 MiB,
 * about a millisecond) on the loop as it arrives; donors hash their blob in
 * slices as above. Everything runs on the node's loop: hm_node_rpc and
 * hm_node_dht_get/put.
 *
 * Bounds: the blob (max_blob_bytes, default 4 GiB, on both sides), chunk
 * size (HM_STATE_CHUNK_MIN..HM_STATE_CHUNK_MAX), chunks per state
 * (HM_STATE_MAX_CHUNKS, hence the manifest's size), prefixes shared
 * (HM_STATE_MAX_SHARES), donors considered per load (HM_STATE_MAX_DONORS),
 * loads at once (HM_STATE_MAX_LOADS), chunk requests in flight per donor
 * (window), and the serving caps above. Every decoder goes through hm_wire's
 * bounded validator.
 *
 * Callbacks. A load's callback fires exactly once and never from inside
 * hm_state_load; if that call fails it never fires.
 *
 * Lifetime. Create it on a running node; close it before the node (or
 * right before hm_node_close in the same loop turn). Closing ends every
 * load: their callbacks fire with -ECANCELED from inside hm_state_close.
 */
#ifndef HM_STATE_H
#define HM_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "src/node/node.h"
#include "src/base/origin.h"
#include "src/base/util.h"
#include "src/base/wire.h"

typedef struct hm_state hm_state;

#define HM_STATE_PREFIX_MAX 128
#define HM_STATE_HASH_BYTES 32
#define HM_STATE_CHUNK_MIN 1024
#define HM_STATE_CHUNK_MAX (1024 * 1024)
#define HM_STATE_CHUNK_DEFAULT HM_STATE_CHUNK_MAX
#define HM_STATE_MAX_CHUNKS 65536
/* The manifest's largest wire form: the hashes and a small header. */
#define HM_STATE_MANIFEST_MAX (HM_STATE_MAX_CHUNKS * HM_STATE_HASH_BYTES + 64)
#define HM_STATE_MAX_SHARES 16
#define HM_STATE_MAX_DONORS 32
#define HM_STATE_MAX_LOADS 8
#define HM_STATE_HASH_SLICE (16u * 1024 * 1024)
/* A declaration's value and a request's body are at most this long. */
#define HM_STATE_SMALL_MAX 512

typedef struct hm_state_config {
    uint64_t max_blob_bytes;        /* shared or loaded; 0: 4 GiB */
    /* Manifest and chunk requests over a cap are answered -ENOBUFS. */
    size_t max_queued_per_peer;     /* serving cap per peer, bytes queued; 0: 8 MiB */
    size_t max_queued_total;        /* serving cap over all peers; 0: 64 MiB */
    /*
     * Agreement ("Who is believed" above): donors of one network origin
     * (hm_origin) that count toward min_agree; 0: 1. Tests that run
     * several honest donors on one loopback address raise it.
     */
    unsigned donors_per_origin;
    /*
     * Trusted donors: when n_trusted > 0, only declarations signed by
     * these keys are read, and one of them suffices (min_agree and
     * donors_per_origin do not apply). Copied; at most HM_STATE_MAX_DONORS.
     */
    const uint8_t (*trusted)[HM_PK_BYTES];
    size_t n_trusted;
    /*
     * A state more than this many steps ahead of the one most origins
     * vouch for is not taken, however many agree on it; 0: no bound.
     */
    uint64_t max_step_lead;
} hm_state_config;

/* Creates the module and registers its rpc methods. 0, -ENOMEM, -EEXIST
 * (the methods are taken: the node already has one). */
int hm_state_new(hm_node *node, const hm_state_config *cfg, hm_state **out);

/*
 * Ends every load (callbacks fire with -ECANCELED before this returns),
 * stops sharing, unregisters the methods; cb (may be NULL) fires from the
 * loop once everything is released.
 */
void hm_state_close(hm_state *st, void (*cb)(void *ud), void *ud);

/*
 * Reports, by config keyword, the declarations set aside by the rules of
 * "Who is believed": StateDonorsPerOrigin (a donor beyond its origin's
 * count, at each read of the declarations) and StateTrustedDonors (a donor
 * not on the list) and StateMaxStepLead (the counted donors of a state
 * too far ahead).
 */
void hm_state_limits(const hm_state *st, hm_limit_emit_fn emit, void *ud);

/* ---- donor side ---- */

/*
 * The outcome of a share's first declaration (hm_state_share_opts): 0 and
 * the replicas that stored it, or the negative errno of the DHT put (or of
 * the declaration that could not start: no address others can dial);
 * -ECANCELED when the prefix was unshared or the module closed first.
 */
typedef void (*hm_state_declared_cb)(void *ud, int status, unsigned replicas);

typedef struct hm_state_share_opts {
    size_t chunk_size;   /* HM_STATE_CHUNK_MIN..HM_STATE_CHUNK_MAX; 0: 1 MiB */
    double ttl_s;        /* declaration lifetime; 0: 60 */
    /*
     * When set, fires once (never inside hm_state_share, and never when it
     * fails) after this step, or a newer one shared since, was hashed and
     * its declaration put to the DHT. A newcomer that reads the
     * declarations after that finds this step (or the newer one), not an
     * older one; a trainer that wants newcomers to find its latest state
     * waits for it (state.share's "wait").
     */
    hm_state_declared_cb declared_cb;
    void *declared_ud;
    /*
     * Tests: serve every chunk with one byte flipped while declaring the
     * true hash, i.e. behave as a hostile donor would.
     */
    int corrupt_chunks;
} hm_state_share_opts;

/*
 * Shares blob[0..len) as the state at step under prefix (opts may be
 * NULL). The bytes are copied before this returns; hashing and the DHT
 * declaration follow from the loop (hm_state_share_info_get says when it
 * is served and declared, opts->declared_cb when it was declared). A step
 * that becomes ready while the previous declaration is still being put is
 * declared as soon as that put ends, not at the next refresh. Returns 0, -EINVAL (bad prefix or options, an
 * empty or NULL blob), -EMSGSIZE (len over
 * max_blob_bytes or over HM_STATE_MAX_CHUNKS chunks), -ESTALE (an older
 * step than the one shared), -ENOBUFS (HM_STATE_MAX_SHARES prefixes
 * shared), -ESHUTDOWN or -ENOMEM.
 */
int hm_state_share(hm_state *st, const char *prefix, uint64_t step, const void *blob, size_t len,
                   const hm_state_share_opts *opts);

/* Stops serving the prefix (the declaration expires on its own). 0 or -ENOENT. */
int hm_state_unshare(hm_state *st, const char *prefix);

typedef struct hm_state_share_info {
    uint64_t step;                          /* of the version served (or being hashed) */
    uint64_t bytes;
    size_t chunk_size, n_chunks;
    uint8_t hash[HM_STATE_HASH_BYTES];      /* valid when ready */
    int ready;                              /* hashed and served */
    unsigned declared;                      /* replicas that took the last declaration */
    uint64_t chunks_served, manifests_served, refused_busy;
} hm_state_share_info;

/* 0 with the prefix's share described, or -ENOENT. */
int hm_state_share_info_get(const hm_state *st, const char *prefix, hm_state_share_info *out);

/* ---- newcomer side ---- */

typedef struct hm_state_load_opts {
    unsigned min_agree;          /* donors that must declare the same state; 0: 2 */
    uint64_t timeout_ms;         /* whole load; 0: 300000 */
    uint64_t request_timeout_ms; /* one chunk or manifest request; 0: 15000 */
    unsigned window;             /* chunk requests in flight per donor; 0: 4 */
    unsigned max_failures;       /* failed requests in a row before a donor is dropped; 0: 3 */
    unsigned dht_attempts;       /* declaration reads before giving up; 0: 3 */
    /*
     * Optional destination: when set, chunks are written here and the
     * callback's blob is dest (not malloc'd); a state larger than dest_cap
     * ends with -EMSGSIZE. It must stay valid until the callback.
     */
    void *dest;
    size_t dest_cap;
} hm_state_load_opts;

enum hm_state_drop {
    HM_STATE_DROP_NONE = 0,
    HM_STATE_DROP_BAD_CHUNK = 1,    /* served a chunk whose hash is not the manifest's */
    HM_STATE_DROP_BAD_MANIFEST = 2, /* its manifest does not hash to the agreed hash */
    HM_STATE_DROP_ERRORS = 3,       /* max_failures failed requests in a row */
};

typedef struct hm_state_donor_report {
    char peer_id[HM_PEER_ID_LEN + 1];
    char addr[HM_ADDRSTRLEN];
    uint64_t chunks, bytes;      /* verified chunks it served */
    int dropped;                 /* enum hm_state_drop */
    int last_error;              /* the last failed request's code, or 0 */
} hm_state_donor_report;

typedef struct hm_state_report {
    int status;
    char prefix[HM_STATE_PREFIX_MAX + 1];
    uint64_t step;
    uint8_t hash[HM_STATE_HASH_BYTES];
    uint64_t bytes;
    size_t chunk_size, n_chunks;
    size_t n_declared;           /* declarations read (all steps) */
    size_t n_donors;             /* the agreeing donors, in donors[] */
    hm_state_donor_report donors[HM_STATE_MAX_DONORS];
    uint64_t chunks_refetched;   /* chunk requests that had to be asked again */
    double duration_s;
} hm_state_report;

/* Drop reason as a word for reports: "none", "bad_chunk", ... */
const char *hm_state_drop_name(int reason);

/*
 * Fired once per started load, from the loop. On success blob holds the
 * state (malloc'd, and the callback's to free; or opts->dest) and len its length;
 * otherwise blob is NULL. rep is valid during the call.
 */
typedef void (*hm_state_load_cb)(void *ud, int status, uint8_t *blob, size_t len,
                                 const hm_state_report *rep);

/*
 * Starts a download of the state under prefix (opts may be NULL). Returns
 * 0 (cb fires once, later), -EINVAL, -ENOBUFS (HM_STATE_MAX_LOADS loads
 * running), -ESHUTDOWN, -ENOMEM or the DHT's refusal.
 */
int hm_state_load(hm_state *st, const char *prefix, const hm_state_load_opts *opts,
                  hm_state_load_cb cb, void *ud);

/* ---- wire forms (exposed for the fuzz target and tests) ---- */

typedef struct hm_state_decl {
    struct sockaddr_storage addr;
    uint64_t step, total_len;
    uint64_t chunk_size;
    uint8_t hash[HM_STATE_HASH_BYTES];
} hm_state_decl;

typedef struct hm_state_manifest {
    uint64_t step, total_len, chunk_size;
    size_t n_chunks;
    const uint8_t *hashes; /* n_chunks * 32 bytes, pointing into the decoded buffer */
} hm_state_manifest;

typedef struct hm_state_req {
    char prefix[HM_STATE_PREFIX_MAX + 1];
    uint8_t hash[HM_STATE_HASH_BYTES];
    uint64_t index;  /* chunk requests only */
} hm_state_req;

/* Chunks a state of total_len bytes has, or 0 when the shape is out of
 * bounds (chunk size, chunk count, max_blob). */
size_t hm_state_n_chunks(uint64_t total_len, uint64_t chunk_size, uint64_t max_blob);

void hm_state_encode_decl(hm_wire_wr *w, const hm_state_decl *d);
/* 0, -EPROTO (shape, or a chunking out of bounds) or hm_wire's errors. */
int hm_state_decode_decl(const uint8_t *buf, size_t len, hm_state_decl *out);
void hm_state_encode_manifest(hm_wire_wr *w, uint64_t step, uint64_t total_len,
                              uint64_t chunk_size, const uint8_t *hashes, size_t n_chunks);
/* hashes in out point into buf. 0, -EPROTO or hm_wire's errors. */
int hm_state_decode_manifest(const uint8_t *buf, size_t len, hm_state_manifest *out);
/* with_index: a chunk request [prefix, hash, index]; else a manifest
 * request [prefix, hash]. */
void hm_state_encode_req(hm_wire_wr *w, const hm_state_req *r, int with_index);
int hm_state_decode_req(const uint8_t *buf, size_t len, int with_index, hm_state_req *out);

#endif

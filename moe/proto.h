/*
 * proto: the expert protocol's messages, DHT declarations and uid grammar.
 * Pure encode/decode over caller memory; every decoder goes through the
 * bounded wire validator (wire.h) and trusts no declared shape.
 *
 * UIDs follow Hivemind's grammar: "NAME.i.j...", a grid name followed by
 * 1..HM_MOE_MAX_GRID_DIMS grid coordinates. The name may hold any character
 * but '.' (so "transformer::encoder.2" and non-ASCII names are uids), within
 * these bounds: 1..HM_MOE_PREFIX_MAX bytes of well-formed UTF-8, no control
 * character (U+0000..U+001F, U+007F..U+009F: uids reach logs, terminals and
 * JSON) and no "[owner:" (a DHT key holding it is malformed, dht/record.h).
 * Each coordinate is a decimal integer in [0, HM_MOE_MAX_GRID) without
 * leading zeros (so that an expert has exactly one uid, which is also its
 * DHT key); the whole uid is at most HM_MOE_UID_MAX bytes. Hivemind bounds
 * none of these; hivemindd keeps every one, with a sentence naming the rule
 * a bad uid breaks (hm_moe_uid_check). A hosting pattern is a uid whose
 * coordinates may be ranges "[a:b]" (b exclusive), e.g. "ffn.[0:16].[0:4]"
 * names 64 experts; at most HM_MOE_PATTERN_MAX bytes, and every uid it
 * names within the uid bounds.
 *
 * RPC methods (rpc.h, HM_RPC_STREAM; bodies are msgpack maps):
 *   "moe.fwd"   {"uid": str, "x": tensor f32 [batch, dim]}
 *               -> {"y": tensor f32 [batch, dim]}
 *   "moe.bwd"   {"uid": str, "x": tensor f32 [batch, dim],
 *                "gy": tensor f32 [batch, dim]}
 *               -> {"gx": tensor f32 [batch, dim]}
 *   "moe.info"  {"uid": str}
 *               -> {"type": str, "dim": uint, "hidden": uint
 *                   [, "heads": uint, "max_seq": uint]}
 * Revision 2 of the bodies (experts over sequences, type "transformer"):
 * the tensors may be [batch, seq, dim] (rank 3), and the reply has the
 * request's shape; moe.info adds heads and max_seq for such experts. A
 * rank-2 request to a transformer, or a rank-3 one to an ffn, is refused
 * with -EPROTO and the shape the expert takes; a revision-1 server refuses
 * every rank-3 request as malformed. Nothing else changed: rank-2 bodies
 * are those of revision 1, so old and new peers call each other's ffn
 * experts as before.
 * Revision 3 of the requests (a key-padding mask, Hivemind's
 * attention_mask): a rank-3 moe.fwd or moe.bwd may carry
 *               "mask": bin of batch * seq bytes, 1 for a token, 0 for
 *                       padding (a padded key gets no attention weight)
 * and then names its input "xm" instead of "x", so that a revision-2
 * server, which requires "x", refuses it as malformed (-EINVAL) instead
 * of answering as if nothing were padded. A request with both or neither
 * of "x" and "xm", "xm" without "mask" or "mask" without "xm", a mask of
 * another length, a byte other than 0 or 1, or a sample with every key
 * padded is -EINVAL; a mask on a rank-2 tensor is -EPROTO. Replies are
 * unchanged.
 * Errors travel as the rpc status: -ENOENT (no such expert here), -EINVAL
 * (malformed), -EMSGSIZE (over a cap), -EPROTO (dim is not the expert's),
 * -EDOM (non-finite input), -ENOBUFS (the server's queue is full). The
 * error reply's body is the server's reason in words (raw text, at most
 * HM_MOE_ERR_MAX bytes, e.g. "ffn.3 takes inputs of width 16, not 8"), so
 * that the caller hears what was wrong; an empty body is allowed.
 *
 * Caps: batch <= HM_MOE_MAX_BATCH, seq <= HM_MOE_MAX_SEQ, dim <=
 * HM_MOE_MAX_DIM, batch * seq * dim <= HM_MOE_MAX_ELEMS; a request frame is
 * at most HM_MOE_MAX_FRAME bytes.
 *
 * DHT declarations (owned records, signed by the host; dht/record.h). For
 * an expert uid "ffn.3.5" hosted by PEERID at HOST:PORT:
 *   key "ffn.3.5",  subkey "[owner:PEERID]"   -> value EXPERT
 *   key "ffn.",     subkey "3[owner:PEERID]"  -> value PREFIX_ENTRY
 *   key "ffn.3.",   subkey "5[owner:PEERID]"  -> value PREFIX_ENTRY
 * i.e. each grid prefix (the uid cut after each coordinate but the last,
 * and the bare "PREFIX.") lists, as subkeys, the next coordinate that some
 * host serves under it. Values (msgpack):
 *   EXPERT        ["HOST:PORT", type str, dim uint]
 *   PREFIX_ENTRY  [uid str, "HOST:PORT"]  (uid: one live expert below the
 *                                          prefix, its host's address)
 * An empty value is a withdrawal (a host that shuts down cleanly puts
 * empty values with a later expiration); readers skip it.
 *
 * Who may serve a uid (docs/security.md, "Expert records"): anyone can sign
 * a declaration under its own key, so readers (client.h) ignore
 * declarations that live longer than a few minutes (HM_MOE_RECORD_MAX_TTL_S
 * by default; hosts declare with at most HM_MOE_DECLARE_TTL_MAX_S and
 * refresh every third of it), take a uid only from the owner that has held
 * it longest without a gap, and, where an allow-list (below) covers the
 * uid, only from the listed hosts.
 *
 * Allow-list (ExpertHostsFile). Text, one rule a line:
 *   PREFIX PEERID [PEERID...]
 * PREFIX is 1..HM_MOE_UID_MAX bytes of UTF-8 free of control characters
 * (a uid whose name holds a space cannot be named here) ("ffn." for a
 * whole grid, "ffn.3." for a row; matching is by text, so "ffn.3.5" covers
 * ffn.3.5 and also ffn.3.50 to ffn.3.59); the longest
 * PREFIX that begins a uid or grid prefix decides who may declare it; the
 * PEERIDs (52-character ids, at most HM_MOE_ALLOW_MAX_KEYS a line) may all
 * serve it, as replicas. '#' starts a comment; blank lines are skipped; at
 * most HM_MOE_ALLOW_MAX_RULES rules, lines of at most HM_MOE_ALLOW_MAX_LINE
 * bytes, a PREFIX at most once.
 */
#ifndef HM_MOE_PROTO_H
#define HM_MOE_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "src/base/crypto.h"
#include "src/base/wire.h"

#define HM_MOE_UID_MAX 128
#define HM_MOE_PREFIX_MAX 126 /* the longest name that leaves room for ".0" */
#define HM_MOE_MAX_GRID_DIMS 16
#define HM_MOE_PATTERN_MAX 384
#define HM_MOE_MAX_GRID 65536
#define HM_MOE_MAX_BATCH 4096
#define HM_MOE_MAX_SEQ 2048
#define HM_MOE_MAX_DIM 8192
/*
 * 32 MiB of float32 per tensor. A backward request carries two tensors, so
 * its frame is at most 64 MiB plus a header: this must stay under the
 * transport's max_message (80 MiB by default, transport.h), or calls of the
 * largest sizes could never be sent.
 */
#define HM_MOE_MAX_ELEMS ((size_t)1 << 23)
/* ... and a key-padding mask (revision 3) one byte a row, at most
 * HM_MOE_MAX_ELEMS of them: 72 MiB and a header in all. */
#define HM_MOE_MAX_FRAME (2 * HM_MOE_MAX_ELEMS * 4 + HM_MOE_MAX_ELEMS + 4096)
#define HM_MOE_MAX_PATTERN_EXPERTS 4096
#define HM_MOE_TYPE_MAX 16
#define HM_MOE_ADDR_MAX 64
/* Readers ignore declarations expiring later than this past their clock
 * (plus HM_MOE_CLOCK_SLACK_S); hosts declare with at most the second. */
#define HM_MOE_RECORD_MAX_TTL_S 300
#define HM_MOE_DECLARE_TTL_MAX_S 300
#define HM_MOE_CLOCK_SLACK_S 30
#define HM_MOE_ALLOW_MAX_RULES 1024
#define HM_MOE_ALLOW_MAX_KEYS 64
#define HM_MOE_ALLOW_MAX_LINE 4096

/* ---- uids ---- */

typedef struct hm_moe_uid {
    char prefix[HM_MOE_PREFIX_MAX + 1];
    unsigned ndims;
    uint32_t coords[HM_MOE_MAX_GRID_DIMS];
} hm_moe_uid;

/* Parses a uid (len bytes, need not be NUL-terminated). 0 or -EINVAL. */
int hm_moe_uid_parse(const char *s, size_t len, hm_moe_uid *out);
/* The same, with the rule a bad uid breaks in err ("bad expert uid: ..."). */
int hm_moe_uid_check(const char *s, size_t len, hm_moe_uid *out, char *err, size_t errlen);
/*
 * Checks a grid name as beam searches and listings take it: a uid's name,
 * optionally with its trailing dot as Hivemind writes prefixes ("ffn." is
 * "ffn"). Returns the name's length without the dot, or -EINVAL with the
 * rule in err.
 */
int hm_moe_name_check(const char *s, size_t len, char *err, size_t errlen);
/* Formats "prefix.c0.c1..." ; returns bytes written or -EMSGSIZE. */
int hm_moe_uid_format(const hm_moe_uid *u, char *buf, size_t len);
/*
 * The grid prefix of u cut after its first `level` coordinates, with a
 * trailing dot: level 0 -> "ffn.", level 1 -> "ffn.3.". level < ndims.
 */
int hm_moe_uid_prefix(const hm_moe_uid *u, unsigned level, char *buf, size_t len);

/*
 * Expands a hosting pattern into at most max uids (the caller's array).
 * Returns the number of uids, -EINVAL (malformed: the message says where)
 * or -EMSGSIZE (more than max, or HM_MOE_MAX_PATTERN_EXPERTS).
 */
int hm_moe_pattern_expand(const char *pattern, hm_moe_uid *out, size_t max, char *err,
                          size_t errlen);

/* ---- rpc bodies ---- */

#define HM_MOE_METHOD_FWD "moe.fwd"
#define HM_MOE_METHOD_BWD "moe.bwd"
#define HM_MOE_METHOD_INFO "moe.info"

/* A decoded request; pointers point into the frame. x and gy are
 * little-endian float32 [batch, dim] (or [batch, seq, dim]), possibly
 * unaligned: copy with memcpy. */
typedef struct hm_moe_req {
    char uid[HM_MOE_UID_MAX + 1];
    size_t batch, dim;
    size_t seq;        /* 0: x is [batch, dim]; else [batch, seq, dim] */
    const uint8_t *x;  /* batch*dim*4 bytes */
    const uint8_t *gy; /* backward only, else NULL */
    const uint8_t *mask; /* revision 3: NULL, or batch*seq bytes of 0/1 (1: a token) */
} hm_moe_req;

/* Encoders write one msgpack map into w (check hm_wire_wr_error). */
void hm_moe_encode_fwd(hm_wire_wr *w, const char *uid, const float *x, size_t batch, size_t dim);
void hm_moe_encode_bwd(hm_wire_wr *w, const char *uid, const float *x, const float *gy,
                       size_t batch, size_t dim);
void hm_moe_encode_info_req(hm_wire_wr *w, const char *uid);
/* Replies: the output tensor "y" (forward) or "gx" (backward). */
void hm_moe_encode_out(hm_wire_wr *w, int backward, const float *t, size_t batch, size_t dim);
void hm_moe_encode_info(hm_wire_wr *w, const char *type, size_t dim, size_t hidden);
/* Revision 2: the same with [batch, seq, dim] tensors when seq is not 0, and
 * an info reply with heads and max_seq when max_seq is not 0. */
void hm_moe_encode_fwd_seq(hm_wire_wr *w, const char *uid, const float *x, size_t batch,
                           size_t seq, size_t dim);
void hm_moe_encode_bwd_seq(hm_wire_wr *w, const char *uid, const float *x, const float *gy,
                           size_t batch, size_t seq, size_t dim);
void hm_moe_encode_out_seq(hm_wire_wr *w, int backward, const float *t, size_t batch, size_t seq,
                           size_t dim);
void hm_moe_encode_info_seq(hm_wire_wr *w, const char *type, size_t dim, size_t hidden,
                            size_t heads, size_t max_seq);
/* Revision 3: with a key-padding mask ([batch, seq] bytes of 0/1) when mask
 * is not NULL (seq must then not be 0), the input under "xm". */
void hm_moe_encode_fwd_mask(hm_wire_wr *w, const char *uid, const float *x, const uint8_t *mask,
                            size_t batch, size_t seq, size_t dim);
void hm_moe_encode_bwd_mask(hm_wire_wr *w, const char *uid, const float *x, const uint8_t *mask,
                            const float *gy, size_t batch, size_t seq, size_t dim);

/*
 * Decoders. backward selects which request/reply is expected. 0, -EINVAL
 * (malformed, bad uid), -EMSGSIZE (over a cap), -EPROTO (wrong dtype,
 * shapes that disagree).
 */
int hm_moe_decode_req(const uint8_t *buf, size_t len, int backward, hm_moe_req *out);
int hm_moe_decode_info_req(const uint8_t *buf, size_t len, char uid[HM_MOE_UID_MAX + 1]);
/*
 * A reply must be float32 [batch, dim] exactly as asked (-EPROTO otherwise)
 * and hold only finite values (-EDOM otherwise). Copies into out.
 */
int hm_moe_decode_out(const uint8_t *buf, size_t len, int backward, size_t batch, size_t dim,
                      float *out);
int hm_moe_decode_info(const uint8_t *buf, size_t len, char type[HM_MOE_TYPE_MAX + 1],
                       size_t *dim_out, size_t *hidden_out);
/* The reply's shape as asked, [batch, seq, dim] when seq is not 0. */
int hm_moe_decode_out_seq(const uint8_t *buf, size_t len, int backward, size_t batch, size_t seq,
                          size_t dim, float *out);
/* Also heads and max_seq (0 and 0 from an expert that takes [batch, dim]). */
int hm_moe_decode_info_seq(const uint8_t *buf, size_t len, char type[HM_MOE_TYPE_MAX + 1],
                           size_t *dim_out, size_t *hidden_out, size_t *heads_out,
                           size_t *max_seq_out);

#define HM_MOE_ERR_MAX 320 /* room for a sentence naming a 128-byte uid */
/*
 * An error reply's reason, made safe to print: cut to HM_MOE_ERR_MAX
 * bytes, every byte outside printable ASCII (controls, escapes, UTF-8)
 * written as '?'. "" for an empty body. Never fails.
 */
void hm_moe_decode_error(const uint8_t *buf, size_t len, char msg[HM_MOE_ERR_MAX + 1]);

/* ---- DHT values ---- */

/* Write into buf (at most HM_DHT_VALUE_MAX); return bytes, -EMSGSIZE, or
 * -EINVAL for what a decoder would refuse (an address that is not a numeric
 * HOST:PORT, a type that is not 1..HM_MOE_TYPE_MAX of [A-Za-z0-9_-], dim 0
 * or over HM_MOE_MAX_DIM, a bad uid). */
int hm_moe_encode_expert_value(uint8_t *buf, size_t len, const char *addr, const char *type,
                               size_t dim);
int hm_moe_encode_prefix_value(uint8_t *buf, size_t len, const char *uid, const char *addr);
/* 0, -ENOENT (an empty value: withdrawn) or -EINVAL. */
int hm_moe_decode_expert_value(const uint8_t *buf, size_t len, char addr[HM_MOE_ADDR_MAX + 1],
                               char type[HM_MOE_TYPE_MAX + 1], size_t *dim_out);
int hm_moe_decode_prefix_value(const uint8_t *buf, size_t len, char uid[HM_MOE_UID_MAX + 1],
                               char addr[HM_MOE_ADDR_MAX + 1]);
/*
 * A prefix subkey "COORD[owner:PEERID]": the coordinate and the owner.
 * 0 or -EINVAL.
 */
int hm_moe_parse_prefix_subkey(const uint8_t *sk, size_t len, uint32_t *coord_out,
                               uint8_t pk_out[HM_PK_BYTES]);

/* ---- host allow-list ---- */

typedef struct hm_moe_allow_rule {
    char prefix[HM_MOE_UID_MAX + 1];
    size_t n_keys;
    uint8_t keys[HM_MOE_ALLOW_MAX_KEYS][HM_PK_BYTES];
} hm_moe_allow_rule;

typedef struct hm_moe_allow {
    size_t n;
    hm_moe_allow_rule *rules;
} hm_moe_allow;

/*
 * Parses an allow-list (len bytes of text, need not be NUL-terminated).
 * 0 with *out allocated (free with hm_moe_allow_free), -EINVAL with the
 * line and reason in err, -EMSGSIZE (over a cap above), -ENOMEM.
 */
int hm_moe_allow_parse(const char *text, size_t len, hm_moe_allow **out, char *err,
                       size_t errlen);
void hm_moe_allow_free(hm_moe_allow *a);
/* The rule with the longest prefix that begins name, or NULL (a NULL a has none). */
const hm_moe_allow_rule *hm_moe_allow_find(const hm_moe_allow *a, const char *name);
/* Whether pk may declare name: no rule covers it, or the rule lists pk. */
int hm_moe_allow_permits(const hm_moe_allow *a, const char *name, const uint8_t pk[HM_PK_BYTES]);

#endif

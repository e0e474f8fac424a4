/*
 * proto: the expert protocol's uid grammar, rpc bodies and DHT values (see
 * proto.h). Pure functions over caller memory; it owns nothing. Every
 * decoder first walks the bytes with the bounded wire validator under
 * limits sized for the message at hand, and tensors are read with an
 * element cap, so a declared shape never drives an allocation.
 */
#include "config.h"

#include "moe/proto.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "dht/record.h"
#include "src/base/util.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "moe/proto.c sends float32 tensors as host bytes and needs a little-endian host"
#endif

/* A request or reply: one map with a few keys and at most two tensors. */
static const hm_wire_limits frame_limits = {
    .max_size = HM_MOE_MAX_FRAME,
    .max_depth = 4,
    .max_elements = 64,
};
/* Info requests and replies, and DHT values: small maps and arrays. */
static const hm_wire_limits small_limits = {
    .max_size = HM_DHT_VALUE_MAX,
    .max_depth = 4,
    .max_elements = 64,
};

/* hidden is not a wire cap of its own; this keeps nonsense out of listings. */
#define INFO_MAX_HIDDEN ((size_t)1 << 20)

static const char owner_open[] = "[owner:";

/* ------------------------------------------------------------ uids */

/*
 * Type names (and nothing else since uids follow Hivemind's grammar) are
 * short words of [A-Za-z0-9_-].
 */
static int prefix_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '-';
}

/*
 * The length of the UTF-8 character at s[0..n) when it is well formed
 * (shortest form, no surrogate, at most U+10FFFF) and not a control
 * character (U+0000..U+001F, U+007F..U+009F); 0 otherwise. Control
 * characters are refused because uids end up in logs, terminals and JSON,
 * where they could move a cursor or split a line.
 */
static size_t utf8_char(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    uint32_t cp;
    size_t len;

    if (c < 0x80)
        return c >= 0x20 && c != 0x7f ? 1 : 0;
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2;
        cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
        (cp >= 0xd800 && cp <= 0xdfff) || (cp >= 0x80 && cp <= 0x9f))
        return 0;
    return len;
}

/* The rules below name these numbers in words. */
_Static_assert(HM_MOE_UID_MAX == 128 && HM_MOE_PREFIX_MAX == 126 && HM_MOE_MAX_GRID_DIMS == 16 &&
                   HM_MOE_MAX_GRID == 65536,
               "update the rules' wording");

static int has_owner_open(const char *s, size_t n)
{
    const size_t ol = sizeof(owner_open) - 1;
    for (size_t i = 0; i + ol <= n; i++)
        if (memcmp(s + i, owner_open, ol) == 0)
            return 1;
    return 0;
}

/*
 * Checks a grid name (a uid's prefix, without its dot): 1..HM_MOE_PREFIX_MAX
 * bytes of UTF-8 holding no '.', no control character and no owner marker
 * opening. NULL when it is good, else the rule it breaks.
 */
static const char *name_rule(const char *s, size_t n)
{
    if (n == 0)
        return "the grid name before the first '.' is empty";
    if (n > HM_MOE_PREFIX_MAX)
        return "the grid name is longer than 126 bytes";
    for (size_t i = 0; i < n;) {
        size_t l;
        if (s[i] == '.')
            return "the grid name holds a '.'";
        if ((l = utf8_char((const unsigned char *)s + i, n - i)) == 0)
            return "the grid name is not UTF-8 free of control characters";
        i += l;
    }
    /* A DHT key holding "[owner:" anywhere but as its owner marker is malformed
     * (dht/record.h): such a grid could never be declared. */
    if (has_owner_open(s, n))
        return "the grid name holds '[owner:', which marks DHT record owners";
    return NULL;
}

/*
 * Reads a canonical decimal coordinate at s[*pos..len): no sign, no leading
 * zero (so that one expert has one uid, which is also its DHT key), below
 * HM_MOE_MAX_GRID. Returns 0 and advances *pos, or -EINVAL.
 */
static int read_coord(const char *s, size_t len, size_t *pos, uint32_t *out)
{
    size_t i = *pos;
    uint32_t v = 0;

    if (i >= len || s[i] < '0' || s[i] > '9')
        return -EINVAL;
    if (s[i] == '0' && i + 1 < len && s[i + 1] >= '0' && s[i + 1] <= '9')
        return -EINVAL;
    while (i < len && s[i] >= '0' && s[i] <= '9') {
        v = v * 10 + (uint32_t)(s[i] - '0');
        if (v >= HM_MOE_MAX_GRID)
            return -EINVAL;
        i++;
    }
    *pos = i;
    *out = v;
    return 0;
}

/* The prefix up to the first dot; returns its length, or -EINVAL with the rule in *why. */
static int read_prefix(const char *s, size_t len, const char **why)
{
    const char *dot = memchr(s, '.', len);
    size_t n = dot != NULL ? (size_t)(dot - s) : len;

    if ((*why = name_rule(s, n)) != NULL)
        return -EINVAL;
    if (dot == NULL) {
        *why = "no grid coordinates: a uid is NAME.i[.j...]";
        return -EINVAL;
    }
    return (int)n;
}

#define COORD_RULE "each grid coordinate is a decimal integer below 65536 without leading zeros"

static int uid_parse(const char *s, size_t len, hm_moe_uid *out, const char **why)
{
    hm_moe_uid u;
    size_t pos;
    int pl;

    *why = NULL;
    if (s == NULL || len == 0) {
        *why = "the uid is empty";
        return -EINVAL;
    }
    if (len > HM_MOE_UID_MAX) {
        *why = "the uid is longer than 128 bytes";
        return -EINVAL;
    }
    memset(&u, 0, sizeof(u));
    if ((pl = read_prefix(s, len, why)) < 0)
        return pl;
    memcpy(u.prefix, s, (size_t)pl);
    pos = (size_t)pl;
    while (pos < len) {
        if (s[pos] != '.') {
            *why = COORD_RULE;
            return -EINVAL;
        }
        if (u.ndims == HM_MOE_MAX_GRID_DIMS) {
            *why = "more than 16 grid coordinates";
            return -EINVAL;
        }
        pos++;
        if (read_coord(s, len, &pos, &u.coords[u.ndims]) < 0) {
            *why = COORD_RULE;
            return -EINVAL;
        }
        u.ndims++;
    }
    if (out != NULL)
        *out = u;
    return 0;
}

int hm_moe_uid_parse(const char *s, size_t len, hm_moe_uid *out)
{
    const char *why;
    return uid_parse(s, len, out, &why);
}

int hm_moe_uid_check(const char *s, size_t len, hm_moe_uid *out, char *err, size_t errlen)
{
    const char *why;
    int r = uid_parse(s, len, out, &why);
    if (r < 0 && err != NULL && errlen > 0)
        snprintf(err, errlen, "bad expert uid: %s", why);
    return r;
}

int hm_moe_name_check(const char *s, size_t len, char *err, size_t errlen)
{
    const char *why;
    /* Hivemind writes grid prefixes with their dot ("ffn."); both forms name the grid. */
    if (s != NULL && len > 0 && s[len - 1] == '.')
        len--;
    why = s != NULL ? name_rule(s, len) : "no grid name";
    if (why != NULL) {
        if (err != NULL && errlen > 0)
            snprintf(err, errlen, "bad expert grid name: %s", why);
        return -EINVAL;
    }
    return (int)len;
}

/* Checks a uid struct a caller filled in, so that formatting it yields a parseable uid. */
static int uid_ok(const hm_moe_uid *u)
{
    size_t pl;
    if (u == NULL || u->ndims == 0 || u->ndims > HM_MOE_MAX_GRID_DIMS)
        return 0;
    pl = strnlen(u->prefix, sizeof(u->prefix));
    if (pl > HM_MOE_PREFIX_MAX || name_rule(u->prefix, pl) != NULL)
        return 0;
    for (unsigned i = 0; i < u->ndims; i++)
        if (u->coords[i] >= HM_MOE_MAX_GRID)
            return 0;
    return 1;
}

/* Writes the prefix and the first n coordinates, each followed by a dot when dot_after. */
static int format_cut(const hm_moe_uid *u, unsigned n, int trailing_dot, char *buf, size_t len)
{
    size_t pos;
    int w;

    if (buf == NULL || !uid_ok(u))
        return -EINVAL;
    w = snprintf(buf, len, "%s", u->prefix);
    if (w < 0 || (size_t)w >= len)
        return -EMSGSIZE;
    pos = (size_t)w;
    for (unsigned i = 0; i < n; i++) {
        w = snprintf(buf + pos, len - pos, ".%u", (unsigned)u->coords[i]);
        if (w < 0 || (size_t)w >= len - pos)
            return -EMSGSIZE;
        pos += (size_t)w;
    }
    if (trailing_dot) {
        if (pos + 1 >= len)
            return -EMSGSIZE;
        buf[pos++] = '.';
        buf[pos] = '\0';
    }
    return (int)pos;
}

int hm_moe_uid_format(const hm_moe_uid *u, char *buf, size_t len)
{
    if (u == NULL)
        return -EINVAL;
    return format_cut(u, u->ndims, 0, buf, len);
}

int hm_moe_uid_prefix(const hm_moe_uid *u, unsigned level, char *buf, size_t len)
{
    if (u == NULL || level >= u->ndims)
        return -EINVAL;
    return format_cut(u, level, 1, buf, len);
}

/* ------------------------------------------------------------ patterns */

static int pattern_fail(char *err, size_t errlen, int code, size_t at, const char *what)
{
    if (err != NULL && errlen > 0)
        snprintf(err, errlen, "bad expert pattern at byte %zu: %s", at, what);
    return code;
}

int hm_moe_pattern_expand(const char *pattern, hm_moe_uid *out, size_t max, char *err,
                          size_t errlen)
{
    uint32_t lo[HM_MOE_MAX_GRID_DIMS], hi[HM_MOE_MAX_GRID_DIMS];
    hm_moe_uid u;
    unsigned nd = 0;
    size_t len, pos, total = 1, cap, longest;
    const char *why;
    int pl;

    if (err != NULL && errlen > 0)
        err[0] = '\0';
    if (pattern == NULL)
        return pattern_fail(err, errlen, -EINVAL, 0, "no pattern");
    /* A pattern is longer than a uid only by its brackets: 16 * "[65535:65536]". */
    len = strnlen(pattern, HM_MOE_PATTERN_MAX + 1);
    if (len > HM_MOE_PATTERN_MAX)
        return pattern_fail(err, errlen, -EINVAL, 0, "pattern longer than 384 bytes");
    memset(&u, 0, sizeof(u));
    if ((pl = read_prefix(pattern, len, &why)) < 0)
        return pattern_fail(err, errlen, -EINVAL, 0, why);
    memcpy(u.prefix, pattern, (size_t)pl);
    pos = (size_t)pl;
    while (pos < len) {
        if (pattern[pos] != '.')
            return pattern_fail(err, errlen, -EINVAL, pos, "expected '.'");
        if (nd == HM_MOE_MAX_GRID_DIMS)
            return pattern_fail(err, errlen, -EINVAL, pos, "more than 16 grid coordinates");
        pos++;
        if (pos < len && pattern[pos] == '[') {
            pos++;
            if (read_coord(pattern, len, &pos, &lo[nd]) < 0)
                return pattern_fail(err, errlen, -EINVAL, pos,
                                    "expected a coordinate below 65536 (no leading zeros)");
            if (pos >= len || pattern[pos] != ':')
                return pattern_fail(err, errlen, -EINVAL, pos, "expected ':' in a range");
            pos++;
            /* The end is exclusive, so it may equal HM_MOE_MAX_GRID. */
            if (pos + 5 <= len && memcmp(pattern + pos, "65536", 5) == 0 &&
                (pos + 5 == len || pattern[pos + 5] < '0' || pattern[pos + 5] > '9')) {
                hi[nd] = HM_MOE_MAX_GRID;
                pos += 5;
            } else if (read_coord(pattern, len, &pos, &hi[nd]) < 0) {
                return pattern_fail(err, errlen, -EINVAL, pos,
                                    "expected a range end of at most 65536");
            }
            if (pos >= len || pattern[pos] != ']')
                return pattern_fail(err, errlen, -EINVAL, pos, "expected ']'");
            pos++;
            if (hi[nd] <= lo[nd])
                return pattern_fail(err, errlen, -EINVAL, pos, "empty range");
        } else {
            if (read_coord(pattern, len, &pos, &lo[nd]) < 0)
                return pattern_fail(err, errlen, -EINVAL, pos,
                                    "expected a coordinate below 65536 (no leading zeros) or "
                                    "a range [a:b]");
            hi[nd] = lo[nd] + 1;
        }
        nd++;
    }
    if (nd == 0)
        return pattern_fail(err, errlen, -EINVAL, pos, "no grid coordinates");
    /* Every uid named must be a uid: the longest has each range's last coordinate. */
    longest = (size_t)pl;
    for (unsigned d = 0; d < nd; d++) {
        char digits[8];
        longest += 1 + (size_t)snprintf(digits, sizeof(digits), "%u", (unsigned)(hi[d] - 1));
    }
    if (longest > HM_MOE_UID_MAX)
        return pattern_fail(err, errlen, -EINVAL, 0,
                            "the uids it names would be longer than 128 bytes");
    cap = HM_MIN(max, (size_t)HM_MOE_MAX_PATTERN_EXPERTS);
    for (unsigned d = 0; d < nd; d++) {
        total *= hi[d] - lo[d];
        /* Each factor is at most 65536, so checking after every product cannot overflow. */
        if (total > cap) {
            if (err != NULL && errlen > 0)
                snprintf(err, errlen, "expert pattern names more than %zu experts", cap);
            return -EMSGSIZE;
        }
    }
    if (out == NULL && total > 0 && max > 0)
        return pattern_fail(err, errlen, -EINVAL, 0, "no output array");
    /* Row-major: the last coordinate varies fastest. */
    u.ndims = nd;
    for (size_t k = 0; k < total; k++) {
        size_t rem = k;
        for (unsigned d = nd; d-- > 0;) {
            size_t span = hi[d] - lo[d];
            u.coords[d] = lo[d] + (uint32_t)(rem % span);
            rem /= span;
        }
        out[k] = u;
    }
    return (int)total;
}

/* ------------------------------------------------------------ rpc bodies */

/* A float32 tensor [batch, dim], or [batch, seq, dim] when seq is not 0. */
static void wr_tensor(hm_wire_wr *w, const float *t, size_t batch, size_t seq, size_t dim)
{
    hm_wire_tensor tt;
    size_t rows = seq != 0 ? batch * seq : batch;

    memset(&tt, 0, sizeof(tt));
    tt.dtype = HM_DTYPE_F32;
    tt.ndim = seq != 0 ? 3 : 2;
    tt.shape[0] = batch;
    if (seq != 0) {
        tt.shape[1] = seq;
        tt.shape[2] = dim;
    } else {
        tt.shape[1] = dim;
    }
    tt.data = (const uint8_t *)t;
    tt.nbytes = rows * dim * sizeof(float);
    if ((seq != 0 && rows / seq != batch) || (rows != 0 && tt.nbytes / rows / sizeof(float) != dim)) {
        if (w->err == 0)
            w->err = -EINVAL;
        return;
    }
    hm_wire_wr_tensor(w, &tt);
}

/* A NULL uid is a caller bug; it lands in the writer like any other encoding error. */
static int uid_arg_ok(hm_wire_wr *w, const char *uid)
{
    if (uid != NULL)
        return 1;
    if (w->err == 0)
        w->err = -EINVAL;
    return 0;
}

void hm_moe_encode_fwd_mask(hm_wire_wr *w, const char *uid, const float *x, const uint8_t *mask,
                            size_t batch, size_t seq, size_t dim)
{
    if (!uid_arg_ok(w, uid))
        return;
    if (mask != NULL && seq == 0) {
        if (w->err == 0)
            w->err = -EINVAL;
        return;
    }
    hm_wire_wr_map(w, mask != NULL ? 3 : 2);
    hm_wire_wr_cstr(w, "uid");
    hm_wire_wr_cstr(w, uid);
    /* Masked, the input is "xm": a server that knows no mask finds no "x"
     * and refuses the request rather than compute it unmasked. */
    hm_wire_wr_cstr(w, mask != NULL ? "xm" : "x");
    wr_tensor(w, x, batch, seq, dim);
    if (mask != NULL) {
        hm_wire_wr_cstr(w, "mask");
        hm_wire_wr_bin(w, mask, batch * seq);
    }
}

void hm_moe_encode_bwd_mask(hm_wire_wr *w, const char *uid, const float *x, const uint8_t *mask,
                            const float *gy, size_t batch, size_t seq, size_t dim)
{
    if (!uid_arg_ok(w, uid))
        return;
    if (mask != NULL && seq == 0) {
        if (w->err == 0)
            w->err = -EINVAL;
        return;
    }
    hm_wire_wr_map(w, mask != NULL ? 4 : 3);
    hm_wire_wr_cstr(w, "uid");
    hm_wire_wr_cstr(w, uid);
    hm_wire_wr_cstr(w, mask != NULL ? "xm" : "x");
    wr_tensor(w, x, batch, seq, dim);
    hm_wire_wr_cstr(w, "gy");
    wr_tensor(w, gy, batch, seq, dim);
    if (mask != NULL) {
        hm_wire_wr_cstr(w, "mask");
        hm_wire_wr_bin(w, mask, batch * seq);
    }
}

void hm_moe_encode_fwd_seq(hm_wire_wr *w, const char *uid, const float *x, size_t batch,
                           size_t seq, size_t dim)
{
    hm_moe_encode_fwd_mask(w, uid, x, NULL, batch, seq, dim);
}

void hm_moe_encode_bwd_seq(hm_wire_wr *w, const char *uid, const float *x, const float *gy,
                           size_t batch, size_t seq, size_t dim)
{
    hm_moe_encode_bwd_mask(w, uid, x, NULL, gy, batch, seq, dim);
}

void hm_moe_encode_fwd(hm_wire_wr *w, const char *uid, const float *x, size_t batch, size_t dim)
{
    hm_moe_encode_fwd_seq(w, uid, x, batch, 0, dim);
}

void hm_moe_encode_bwd(hm_wire_wr *w, const char *uid, const float *x, const float *gy,
                       size_t batch, size_t dim)
{
    hm_moe_encode_bwd_seq(w, uid, x, gy, batch, 0, dim);
}

void hm_moe_encode_info_req(hm_wire_wr *w, const char *uid)
{
    if (!uid_arg_ok(w, uid))
        return;
    hm_wire_wr_map(w, 1);
    hm_wire_wr_cstr(w, "uid");
    hm_wire_wr_cstr(w, uid);
}

void hm_moe_encode_out_seq(hm_wire_wr *w, int backward, const float *t, size_t batch, size_t seq,
                           size_t dim)
{
    hm_wire_wr_map(w, 1);
    hm_wire_wr_cstr(w, backward ? "gx" : "y");
    wr_tensor(w, t, batch, seq, dim);
}

void hm_moe_encode_out(hm_wire_wr *w, int backward, const float *t, size_t batch, size_t dim)
{
    hm_moe_encode_out_seq(w, backward, t, batch, 0, dim);
}

void hm_moe_encode_info_seq(hm_wire_wr *w, const char *type, size_t dim, size_t hidden,
                            size_t heads, size_t max_seq)
{
    if (!uid_arg_ok(w, type))
        return;
    hm_wire_wr_map(w, max_seq != 0 ? 5 : 3);
    hm_wire_wr_cstr(w, "type");
    hm_wire_wr_cstr(w, type);
    hm_wire_wr_cstr(w, "dim");
    hm_wire_wr_uint(w, dim);
    hm_wire_wr_cstr(w, "hidden");
    hm_wire_wr_uint(w, hidden);
    if (max_seq != 0) {
        hm_wire_wr_cstr(w, "heads");
        hm_wire_wr_uint(w, heads);
        hm_wire_wr_cstr(w, "max_seq");
        hm_wire_wr_uint(w, max_seq);
    }
}

void hm_moe_encode_info(hm_wire_wr *w, const char *type, size_t dim, size_t hidden)
{
    hm_moe_encode_info_seq(w, type, dim, hidden, 0, 0);
}

/* Reads the "uid" field of a request map: a str that parses as a uid. */
static int get_uid(const msgpack_object *map, char uid[HM_MOE_UID_MAX + 1])
{
    const msgpack_object *o = hm_wire_map_get(map, "uid");
    const char *p;
    uint32_t n;

    if (o == NULL || hm_wire_get_str(o, &p, &n) < 0)
        return -EINVAL;
    if (hm_moe_uid_parse(p, n, NULL) < 0)
        return -EINVAL;
    memcpy(uid, p, n);
    uid[n] = '\0';
    return 0;
}

/*
 * Reads a float32 [batch, dim] or [batch, seq, dim] tensor under the
 * protocol's caps. The wire layer checks the element count against the bin
 * before anything else, so a declared shape larger than the bytes sent is
 * refused here.
 */
static int get_f32(const msgpack_object *o, hm_wire_tensor *t)
{
    int r;

    if (o == NULL)
        return -EINVAL;
    if ((r = hm_wire_get_tensor(o, HM_MOE_MAX_ELEMS, t)) < 0)
        return r;
    if (t->dtype != HM_DTYPE_F32 || (t->ndim != 2 && t->ndim != 3))
        return -EPROTO;
    for (unsigned i = 0; i < t->ndim; i++)
        if (t->shape[i] == 0)
            return -EINVAL;
    if (t->shape[0] > HM_MOE_MAX_BATCH || t->shape[t->ndim - 1] > HM_MOE_MAX_DIM ||
        (t->ndim == 3 && t->shape[1] > HM_MOE_MAX_SEQ))
        return -EMSGSIZE;
    return 0;
}

/* The tensor's sequence length: 0 for [batch, dim]. */
static size_t seq_of(const hm_wire_tensor *t) { return t->ndim == 3 ? (size_t)t->shape[1] : 0; }

/*
 * A key-padding mask for x [batch, seq, dim]: a bin of exactly batch * seq
 * bytes, each 0 or 1, keeping at least one key of every sample (-EINVAL
 * otherwise; the shape is bounded by x's, which the caps bound).
 */
static int get_mask(const msgpack_object *o, const hm_wire_tensor *x, const uint8_t **out)
{
    const uint8_t *p;
    uint32_t len;

    if (x->ndim != 3)
        return -EPROTO; /* only sequences have keys to pad */
    const size_t batch = (size_t)x->shape[0], seq = (size_t)x->shape[1];
    if (hm_wire_get_bin(o, &p, &len) < 0 || (size_t)len != batch * seq)
        return -EINVAL;
    for (size_t b = 0; b < batch; b++) {
        size_t kept = 0;
        for (size_t j = 0; j < seq; j++) {
            if (p[b * seq + j] > 1)
                return -EINVAL;
            kept += p[b * seq + j];
        }
        if (kept == 0)
            return -EINVAL;
    }
    *out = p;
    return 0;
}

/*
 * Opens a request or reply, which is a map. The expert protocol has always
 * reported a root that is not a map as -EINVAL, so the prologue's -EPROTO
 * (which it returns for nothing else) becomes that.
 */
static int open_map(hm_wire_msg *m, const uint8_t *buf, size_t len, const hm_wire_limits *lim)
{
    int r = hm_wire_decode_open_map(m, buf, len, lim, NULL, 0);
    return r == -EPROTO ? -EINVAL : r;
}

int hm_moe_decode_req(const uint8_t *buf, size_t len, int backward, hm_moe_req *out)
{
    hm_wire_msg m;
    hm_wire_tensor x, gy;
    hm_moe_req req;
    int result;

    if (out == NULL)
        return -EINVAL;
    memset(&req, 0, sizeof(req));
    if ((result = open_map(&m, buf, len, &frame_limits)) < 0)
        goto out;
    if ((result = get_uid(&m.root, req.uid)) < 0)
        goto out;
    /* A masked request names its input "xm" (proto.h, revision 3). */
    const msgpack_object *xo = hm_wire_map_get(&m.root, "x");
    const msgpack_object *xmo = hm_wire_map_get(&m.root, "xm");
    const msgpack_object *mo = hm_wire_map_get(&m.root, "mask");
    if ((xo != NULL) == (xmo != NULL) || (xmo != NULL) != (mo != NULL)) {
        result = -EINVAL;
        goto out;
    }
    if ((result = get_f32(xo != NULL ? xo : xmo, &x)) < 0)
        goto out;
    req.batch = (size_t)x.shape[0];
    req.seq = seq_of(&x);
    req.dim = (size_t)x.shape[x.ndim - 1];
    req.x = x.data;
    if (backward) {
        if ((result = get_f32(hm_wire_map_get(&m.root, "gy"), &gy)) < 0)
            goto out;
        if (gy.ndim != x.ndim || gy.shape[0] != x.shape[0] || gy.shape[1] != x.shape[1] ||
            gy.shape[x.ndim - 1] != x.shape[x.ndim - 1]) {
            result = -EPROTO;
            goto out;
        }
        req.gy = gy.data;
    }
    if (mo != NULL && (result = get_mask(mo, &x, &req.mask)) < 0)
        goto out;
    *out = req;
    result = 0;
out:
    hm_wire_decode_close(&m);
    return result;
}

int hm_moe_decode_info_req(const uint8_t *buf, size_t len, char uid[HM_MOE_UID_MAX + 1])
{
    hm_wire_msg m;
    int result;

    if (uid == NULL)
        return -EINVAL;
    if ((result = open_map(&m, buf, len, &small_limits)) < 0)
        goto out;
    result = get_uid(&m.root, uid);
out:
    hm_wire_decode_close(&m);
    return result;
}

/* Whether every float in the (possibly unaligned) bytes is finite; exponent bits all set is not. */
static int all_finite_bytes(const uint8_t *p, size_t n)
{
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, p + 4 * i, 4);
        bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
    }
    return bad == 0;
}

int hm_moe_decode_out_seq(const uint8_t *buf, size_t len, int backward, size_t batch, size_t seq,
                          size_t dim, float *out)
{
    hm_wire_msg m;
    hm_wire_tensor t;
    size_t rows = seq != 0 ? batch * seq : batch;
    int result;

    if (out == NULL || batch == 0 || dim == 0 || batch > HM_MOE_MAX_BATCH ||
        dim > HM_MOE_MAX_DIM || seq > HM_MOE_MAX_SEQ || rows * dim > HM_MOE_MAX_ELEMS)
        return -EINVAL;
    if ((result = open_map(&m, buf, len, &frame_limits)) < 0)
        goto out;
    if ((result = get_f32(hm_wire_map_get(&m.root, backward ? "gx" : "y"), &t)) < 0)
        goto out;
    if (t.shape[0] != batch || seq_of(&t) != seq || t.shape[t.ndim - 1] != dim) {
        result = -EPROTO;
        goto out;
    }
    if (!all_finite_bytes(t.data, rows * dim)) {
        result = -EDOM;
        goto out;
    }
    memcpy(out, t.data, rows * dim * sizeof(float));
    result = 0;
out:
    hm_wire_decode_close(&m);
    return result;
}

int hm_moe_decode_out(const uint8_t *buf, size_t len, int backward, size_t batch, size_t dim,
                      float *out)
{
    return hm_moe_decode_out_seq(buf, len, backward, batch, 0, dim, out);
}

/* Type names are short printable words, so that listings and logs can show them as they are. */
static int get_type(const msgpack_object *o, char type[HM_MOE_TYPE_MAX + 1])
{
    const char *p;
    uint32_t n;

    if (o == NULL || hm_wire_get_str(o, &p, &n) < 0 || n == 0 || n > HM_MOE_TYPE_MAX)
        return -EINVAL;
    for (uint32_t i = 0; i < n; i++)
        if (!prefix_char(p[i]))
            return -EINVAL;
    memcpy(type, p, n);
    type[n] = '\0';
    return 0;
}

void hm_moe_decode_error(const uint8_t *buf, size_t len, char msg[HM_MOE_ERR_MAX + 1])
{
    size_t n = buf != NULL ? HM_MIN(len, (size_t)HM_MOE_ERR_MAX) : 0;
    /* The text goes to logs, terminals and JSON: nothing a peer sends may
     * move a cursor or split a line there. */
    for (size_t i = 0; i < n; i++)
        msg[i] = buf[i] >= 0x20 && buf[i] < 0x7f ? (char)buf[i] : '?';
    msg[n] = '\0';
}

int hm_moe_decode_info(const uint8_t *buf, size_t len, char type[HM_MOE_TYPE_MAX + 1],
                       size_t *dim_out, size_t *hidden_out)
{
    return hm_moe_decode_info_seq(buf, len, type, dim_out, hidden_out, NULL, NULL);
}

int hm_moe_decode_info_seq(const uint8_t *buf, size_t len, char type[HM_MOE_TYPE_MAX + 1],
                           size_t *dim_out, size_t *hidden_out, size_t *heads_out,
                           size_t *max_seq_out)
{
    uint64_t heads = 0, max_seq = 0;
    hm_wire_msg m;
    const msgpack_object *o;
    char ty[HM_MOE_TYPE_MAX + 1];
    uint64_t dim, hidden;
    int result;

    if ((result = open_map(&m, buf, len, &small_limits)) < 0)
        goto out;
    result = -EINVAL;
    if (get_type(hm_wire_map_get(&m.root, "type"), ty) < 0)
        goto out;
    if ((o = hm_wire_map_get(&m.root, "dim")) == NULL || hm_wire_get_uint(o, &dim) < 0)
        goto out;
    if ((o = hm_wire_map_get(&m.root, "hidden")) == NULL || hm_wire_get_uint(o, &hidden) < 0)
        goto out;
    if (dim == 0 || dim > HM_MOE_MAX_DIM || hidden == 0 || hidden > INFO_MAX_HIDDEN) {
        result = -EMSGSIZE;
        goto out;
    }
    /* Experts over sequences say how long a sequence may be; both keys or neither. */
    const msgpack_object *ho = hm_wire_map_get(&m.root, "heads");
    const msgpack_object *so = hm_wire_map_get(&m.root, "max_seq");
    if ((ho == NULL) != (so == NULL))
        goto out;
    if (so != NULL) {
        if (hm_wire_get_uint(ho, &heads) < 0 || hm_wire_get_uint(so, &max_seq) < 0)
            goto out;
        if (heads == 0 || heads > dim || max_seq == 0 || max_seq > HM_MOE_MAX_SEQ) {
            result = -EMSGSIZE;
            goto out;
        }
    }
    if (heads_out != NULL)
        *heads_out = (size_t)heads;
    if (max_seq_out != NULL)
        *max_seq_out = (size_t)max_seq;
    if (type != NULL)
        memcpy(type, ty, sizeof(ty));
    if (dim_out != NULL)
        *dim_out = (size_t)dim;
    if (hidden_out != NULL)
        *hidden_out = (size_t)hidden;
    result = 0;
out:
    hm_wire_decode_close(&m);
    return result;
}

/* ------------------------------------------------------------ DHT values */

/* HOST:PORT with a numeric host, as the node's listen address prints. */
static int addr_ok(const char *p, size_t n)
{
    char tmp[HM_MOE_ADDR_MAX + 1];
    struct sockaddr_storage ss;

    if (n == 0 || n > HM_MOE_ADDR_MAX || memchr(p, '\0', n) != NULL)
        return 0;
    memcpy(tmp, p, n);
    tmp[n] = '\0';
    return hm_parse_hostport(tmp, &ss) == 0;
}

static int finish_value(hm_wire_wr *w)
{
    int r = hm_wire_wr_error(w);
    if (r < 0)
        return r == -EINVAL ? -EINVAL : -EMSGSIZE;
    return (int)w->len;
}

int hm_moe_encode_expert_value(uint8_t *buf, size_t len, const char *addr, const char *type,
                               size_t dim)
{
    hm_wire_wr w;
    size_t tl;

    if (buf == NULL || addr == NULL || type == NULL || !addr_ok(addr, strlen(addr)))
        return -EINVAL;
    tl = strlen(type);
    if (tl == 0 || tl > HM_MOE_TYPE_MAX || dim == 0 || dim > HM_MOE_MAX_DIM)
        return -EINVAL;
    for (size_t i = 0; i < tl; i++)
        if (!prefix_char(type[i]))
            return -EINVAL;
    hm_wire_wr_init_fixed(&w, buf, HM_MIN(len, (size_t)HM_DHT_VALUE_MAX));
    hm_wire_wr_array(&w, 3);
    hm_wire_wr_cstr(&w, addr);
    hm_wire_wr_str(&w, type, tl);
    hm_wire_wr_uint(&w, dim);
    return finish_value(&w);
}

int hm_moe_encode_prefix_value(uint8_t *buf, size_t len, const char *uid, const char *addr)
{
    hm_wire_wr w;

    if (buf == NULL || uid == NULL || addr == NULL || !addr_ok(addr, strlen(addr)) ||
        hm_moe_uid_parse(uid, strlen(uid), NULL) < 0)
        return -EINVAL;
    hm_wire_wr_init_fixed(&w, buf, HM_MIN(len, (size_t)HM_DHT_VALUE_MAX));
    hm_wire_wr_array(&w, 2);
    hm_wire_wr_cstr(&w, uid);
    hm_wire_wr_cstr(&w, addr);
    return finish_value(&w);
}

static int get_addr(const msgpack_object *o, char addr[HM_MOE_ADDR_MAX + 1])
{
    const char *p;
    uint32_t n;
    if (hm_wire_get_str(o, &p, &n) < 0 || !addr_ok(p, n))
        return -EINVAL;
    memcpy(addr, p, n);
    addr[n] = '\0';
    return 0;
}

/*
 * Opens a DHT value: an array of exactly n elements, since a later version
 * that adds fields changes the form on purpose. A value that is not this
 * form, whatever is wrong with it, is -EINVAL; only a failed allocation
 * stays -ENOMEM.
 */
static int open_value(hm_wire_msg *m, const uint8_t *buf, size_t len, uint32_t n)
{
    int r = hm_wire_decode_open_array(m, buf, len, &small_limits, n, n, HM_WIRE_ANY_VERSION);
    return r < 0 && r != -ENOMEM ? -EINVAL : r;
}

int hm_moe_decode_expert_value(const uint8_t *buf, size_t len, char addr[HM_MOE_ADDR_MAX + 1],
                               char type[HM_MOE_TYPE_MAX + 1], size_t *dim_out)
{
    hm_wire_msg m;
    const msgpack_object *it;
    char a[HM_MOE_ADDR_MAX + 1], ty[HM_MOE_TYPE_MAX + 1];
    uint64_t dim;
    int result;

    if (len == 0)
        return -ENOENT;
    if ((result = open_value(&m, buf, len, 3)) < 0)
        goto out;
    it = m.items;
    result = -EINVAL;
    if (get_addr(&it[0], a) < 0 || get_type(&it[1], ty) < 0 || hm_wire_get_uint(&it[2], &dim) < 0 ||
        dim == 0 || dim > HM_MOE_MAX_DIM)
        goto out;
    if (addr != NULL)
        memcpy(addr, a, sizeof(a));
    if (type != NULL)
        memcpy(type, ty, sizeof(ty));
    if (dim_out != NULL)
        *dim_out = (size_t)dim;
    result = 0;
out:
    hm_wire_decode_close(&m);
    return result;
}

int hm_moe_decode_prefix_value(const uint8_t *buf, size_t len, char uid[HM_MOE_UID_MAX + 1],
                               char addr[HM_MOE_ADDR_MAX + 1])
{
    hm_wire_msg m;
    const msgpack_object *it;
    char a[HM_MOE_ADDR_MAX + 1], u[HM_MOE_UID_MAX + 1];
    const char *p;
    uint32_t n;
    int result;

    if (len == 0)
        return -ENOENT;
    if ((result = open_value(&m, buf, len, 2)) < 0)
        goto out;
    it = m.items;
    result = -EINVAL;
    if (hm_wire_get_str(&it[0], &p, &n) < 0 || hm_moe_uid_parse(p, n, NULL) < 0 ||
        get_addr(&it[1], a) < 0)
        goto out;
    memcpy(u, p, n);
    u[n] = '\0';
    if (uid != NULL)
        memcpy(uid, u, sizeof(u));
    if (addr != NULL)
        memcpy(addr, a, sizeof(a));
    result = 0;
out:
    hm_wire_decode_close(&m);
    return result;
}

int hm_moe_parse_prefix_subkey(const uint8_t *sk, size_t len, uint32_t *coord_out,
                               uint8_t pk_out[HM_PK_BYTES])
{
    const size_t ol = sizeof(owner_open) - 1;
    const size_t marker = ol + HM_PEER_ID_LEN + 1;
    const char *s = (const char *)sk;
    uint8_t pk[HM_PK_BYTES];
    uint32_t coord;
    size_t pos = 0;

    if (sk == NULL || len <= marker || len > HM_DHT_SUBKEY_MAX)
        return -EINVAL;
    if (read_coord(s, len - marker, &pos, &coord) < 0 || pos != len - marker)
        return -EINVAL;
    if (memcmp(s + pos, owner_open, ol) != 0 || s[len - 1] != ']')
        return -EINVAL;
    if (hm_peer_id_decode(s + pos + ol, HM_PEER_ID_LEN, pk) < 0)
        return -EINVAL;
    if (coord_out != NULL)
        *coord_out = coord;
    if (pk_out != NULL)
        memcpy(pk_out, pk, HM_PK_BYTES);
    return 0;
}

/* ------------------------------------------------------------ host allow-list */

/* A rule's prefix is text that begins uids: UTF-8 free of control characters. */
static int allow_prefix_ok(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        size_t l = utf8_char((const unsigned char *)s + i, n - i);
        if (l == 0)
            return 0;
        i += l;
    }
    return 1;
}

static int allow_space(char c) { return c == ' ' || c == '\t' || c == '\r'; }

/* One line (no '\n'), comment already cut. 0 (rule added or blank), or an error. */
static int allow_line(hm_moe_allow *a, const char *s, size_t n, size_t lineno, char *err,
                      size_t errlen)
{
    size_t i = 0, tok_start, tok_len;
    hm_moe_allow_rule *r;

    while (i < n && allow_space(s[i]))
        i++;
    if (i == n)
        return 0;
    tok_start = i;
    while (i < n && !allow_space(s[i]))
        i++;
    tok_len = i - tok_start;
    if (tok_len > HM_MOE_UID_MAX) {
        snprintf(err, errlen, "line %zu: the prefix is longer than %d characters", lineno,
                 HM_MOE_UID_MAX);
        return -EINVAL;
    }
    if (!allow_prefix_ok(s + tok_start, tok_len)) {
        snprintf(err, errlen, "line %zu: the prefix is not UTF-8 free of control characters",
                 lineno);
        return -EINVAL;
    }
    for (size_t k = 0; k < a->n; k++) {
        if (strlen(a->rules[k].prefix) == tok_len &&
            memcmp(a->rules[k].prefix, s + tok_start, tok_len) == 0) {
            snprintf(err, errlen, "line %zu: prefix %.*s listed twice", lineno, (int)tok_len,
                     s + tok_start);
            return -EINVAL;
        }
    }
    if (a->n >= HM_MOE_ALLOW_MAX_RULES) {
        snprintf(err, errlen, "line %zu: more than %d rules", lineno, HM_MOE_ALLOW_MAX_RULES);
        return -EMSGSIZE;
    }
    r = &a->rules[a->n];
    memset(r, 0, sizeof(*r));
    memcpy(r->prefix, s + tok_start, tok_len);
    for (;;) {
        while (i < n && allow_space(s[i]))
            i++;
        if (i == n)
            break;
        tok_start = i;
        while (i < n && !allow_space(s[i]))
            i++;
        tok_len = i - tok_start;
        if (r->n_keys >= HM_MOE_ALLOW_MAX_KEYS) {
            snprintf(err, errlen, "line %zu: more than %d peer ids", lineno,
                     HM_MOE_ALLOW_MAX_KEYS);
            return -EMSGSIZE;
        }
        if (tok_len != HM_PEER_ID_LEN ||
            hm_peer_id_decode(s + tok_start, tok_len, r->keys[r->n_keys]) < 0) {
            snprintf(err, errlen, "line %zu: '%.*s' is not a peer id", lineno,
                     (int)HM_MIN(tok_len, (size_t)64), s + tok_start);
            return -EINVAL;
        }
        r->n_keys++;
    }
    if (r->n_keys == 0) {
        snprintf(err, errlen, "line %zu: prefix %s lists no peer id", lineno, r->prefix);
        return -EINVAL;
    }
    a->n++;
    return 0;
}

int hm_moe_allow_parse(const char *text, size_t len, hm_moe_allow **out, char *err,
                       size_t errlen)
{
    char ebuf[1];
    hm_moe_allow *a;
    size_t pos = 0, lineno = 0;
    int r = 0;

    if (err == NULL || errlen == 0) {
        err = ebuf;
        errlen = sizeof(ebuf);
    }
    err[0] = '\0';
    if (out == NULL || (text == NULL && len > 0))
        return -EINVAL;
    *out = NULL;
    a = calloc(1, sizeof(*a));
    if (a == NULL)
        return -ENOMEM;
    /* Grown as rules come: a short file costs little. */
    size_t cap = 0;
    while (pos < len) {
        const char *nl = memchr(text + pos, '\n', len - pos);
        size_t n = nl != NULL ? (size_t)(nl - (text + pos)) : len - pos;
        const char *hash = memchr(text + pos, '#', n);
        lineno++;
        if (n > HM_MOE_ALLOW_MAX_LINE) {
            snprintf(err, errlen, "line %zu: longer than %d bytes", lineno, HM_MOE_ALLOW_MAX_LINE);
            r = -EMSGSIZE;
            break;
        }
        if (memchr(text + pos, '\0', n) != NULL) {
            snprintf(err, errlen, "line %zu: a NUL byte", lineno);
            r = -EINVAL;
            break;
        }
        if (a->n == cap && cap < HM_MOE_ALLOW_MAX_RULES) {
            size_t ncap = cap ? HM_MIN(cap * 2, (size_t)HM_MOE_ALLOW_MAX_RULES) : 4;
            hm_moe_allow_rule *g = realloc(a->rules, ncap * sizeof(*g));
            if (g == NULL) {
                r = -ENOMEM;
                break;
            }
            a->rules = g;
            cap = ncap;
        }
        if ((r = allow_line(a, text + pos, hash != NULL ? (size_t)(hash - (text + pos)) : n,
                            lineno, err, errlen)) < 0)
            break;
        pos += n + (nl != NULL);
    }
    if (r < 0) {
        hm_moe_allow_free(a);
        return r;
    }
    *out = a;
    return 0;
}

void hm_moe_allow_free(hm_moe_allow *a)
{
    if (a == NULL)
        return;
    free(a->rules);
    free(a);
}

const hm_moe_allow_rule *hm_moe_allow_find(const hm_moe_allow *a, const char *name)
{
    const hm_moe_allow_rule *best = NULL;
    size_t best_len = 0;

    if (a == NULL || name == NULL)
        return NULL;
    for (size_t i = 0; i < a->n; i++) {
        size_t l = strlen(a->rules[i].prefix);
        if (l > best_len && strncmp(name, a->rules[i].prefix, l) == 0) {
            best = &a->rules[i];
            best_len = l;
        }
    }
    return best;
}

int hm_moe_allow_permits(const hm_moe_allow *a, const char *name, const uint8_t pk[HM_PK_BYTES])
{
    const hm_moe_allow_rule *r = hm_moe_allow_find(a, name);
    if (r == NULL)
        return 1;
    for (size_t i = 0; i < r->n_keys; i++)
        if (memcmp(r->keys[i], pk, HM_PK_BYTES) == 0)
            return 1;
    return 0;
}

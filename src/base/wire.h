/*
 * wire: the bounded msgpack codec every network and file parser goes through.
 *
 * msgpack-c allocates from the element counts a sender declares (a 5-byte
 * array header can ask for 4 billion elements), so nothing untrusted reaches
 * msgpack_unpack before hm_wire_validate has walked it: every declared count
 * and length is checked against the bytes that are actually left, nesting
 * depth and the total number of elements are capped, and the frame as a whole
 * has a hard size cap. After validation every container holds at most as many
 * elements as bytes remain, so msgpack-c's zone allocation is bounded by a
 * small multiple of the frame's size (str and bin point into the frame; they
 * are not copied).
 *
 * Encoding goes through msgpack-c's packer into a bounded buffer (hm_wire_wr)
 * so that no encoder can grow without limit either.
 *
 * Tensors travel as [dtype, [dim, ...], bin] with the raw little-endian
 * element bytes in the bin, never as msgpack arrays of numbers.
 */
#ifndef HM_WIRE_H
#define HM_WIRE_H

#include <msgpack.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

typedef struct hm_wire_limits {
    size_t max_size;     /* bytes in one frame */
    unsigned max_depth;  /* nesting of arrays/maps; a scalar has depth 0, [] has 1 */
    size_t max_elements; /* total objects in the frame, containers included */
} hm_wire_limits;

/* 1 MiB, depth 16, 65536 elements: what RPC envelopes and control data use. */
extern const hm_wire_limits hm_wire_default_limits;

/*
 * msgpack-c's unpacker keeps a fixed stack of 32 open containers, so a
 * max_depth above this is treated as this.
 */
#define HM_WIRE_MAX_DEPTH 32

/*
 * Checks that buf starts with exactly one complete msgpack object within the
 * limits. *used_out receives the object's length (it may be shorter than
 * len; callers that require the frame to be one object compare). Reserved
 * type byte 0xc1 and ext types are rejected. Allocates nothing; lim NULL
 * means the default limits.
 * Returns 0, -EMSGSIZE (over a cap: the object would need more than max_size
 * bytes, or is too deep, or has too many elements, so more input can never
 * make it acceptable), -EINVAL (malformed, or truncated within the caps: a
 * stream reader may wait for more bytes).
 */
int hm_wire_validate(const void *buf, size_t len, const hm_wire_limits *lim, size_t *used_out);

/*
 * Validates, then unpacks the whole of buf (which must be exactly one object)
 * into zone. The result's str/bin point into buf, which must outlive it.
 * Returns 0, -EMSGSIZE (len over max_size, or a cap as above), -EINVAL
 * (malformed, truncated or trailing bytes) or -ENOMEM. The zone grows by at
 * most about 50 bytes per frame byte plus one zone chunk.
 */
int hm_wire_unpack(const void *buf, size_t len, const hm_wire_limits *lim, msgpack_zone *zone,
                   msgpack_object *obj_out);

/*
 * The one prologue of every message decoder: a zone, the validated and
 * unpacked root, and (for an array) its elements. A decoder opens it, reads
 * its fields, and closes it on every path, so that no decoder can reach
 * msgpack-c without the validator or forget the zone.
 *
 *     hm_wire_msg m;
 *     if ((result = hm_wire_decode_open_array(&m, buf, len, &lim, 3, 3, VER)) < 0)
 *         goto out;
 *     ... read m.items[1], m.items[2] ...
 *     out:
 *     hm_wire_decode_close(&m);
 *
 * The objects live in the zone and their str/bin point into buf, so both
 * must outlive what the decoder keeps; whatever it hands back must point
 * into buf (or be copied) before the close.
 */
typedef struct hm_wire_msg {
    msgpack_zone zone;
    msgpack_object root;
    const msgpack_object *items; /* the root array's elements (open_array only) */
    uint32_t n;                  /* how many there are */
    int live;                    /* the zone is initialised and close must destroy it */
} hm_wire_msg;

/* The version argument of hm_wire_decode_open_array/_map that checks none. */
#define HM_WIRE_ANY_VERSION UINT64_MAX

/*
 * Validates buf under lim (NULL: the default limits) and unpacks it, which
 * must be exactly one object, into m. Returns 0, -EINVAL (buf NULL, or as
 * hm_wire_unpack), -EMSGSIZE or -ENOMEM. After a failed open m holds
 * nothing, and hm_wire_decode_close on it is still safe.
 */
int hm_wire_decode_open(hm_wire_msg *m, const void *buf, size_t len, const hm_wire_limits *lim);
/*
 * As hm_wire_decode_open, then the root must be an array of min_n to max_n
 * elements (as hm_wire_get_array) and, unless version is
 * HM_WIRE_ANY_VERSION, its first element the unsigned integer version.
 * Fills m->items and m->n. A wrong shape or version is -EPROTO (the frame is
 * well formed but is not this message).
 */
int hm_wire_decode_open_array(hm_wire_msg *m, const void *buf, size_t len,
                              const hm_wire_limits *lim, uint32_t min_n, uint32_t max_n,
                              uint64_t version);
/*
 * As hm_wire_decode_open, then the root must be a map and, unless
 * version_key is NULL, hold version_key with the unsigned integer version.
 * Anything else is -EPROTO.
 */
int hm_wire_decode_open_map(hm_wire_msg *m, const void *buf, size_t len,
                            const hm_wire_limits *lim, const char *version_key, uint64_t version);
/* Frees what the open unpacked; every object of m is gone after it. */
void hm_wire_decode_close(hm_wire_msg *m);

/*
 * Typed access to unpacked objects; each returns 0 or -EPROTO on a type
 * mismatch (get_int also when the value is beyond INT64_MAX). Out pointers
 * may be NULL. An empty str or bin yields a valid, non-NULL pointer.
 */
int hm_wire_get_uint(const msgpack_object *o, uint64_t *out);
int hm_wire_get_int(const msgpack_object *o, int64_t *out);
int hm_wire_get_double(const msgpack_object *o, double *out); /* accepts ints too */
int hm_wire_get_bool(const msgpack_object *o, int *out);
int hm_wire_get_str(const msgpack_object *o, const char **ptr_out, uint32_t *len_out);
int hm_wire_get_bin(const msgpack_object *o, const uint8_t **ptr_out, uint32_t *len_out);
/*
 * An array of min_n to max_n elements, inclusive; max_n = 0 means no upper
 * bound (so min_n = max_n = 0 accepts any array). items_out and n_out may be
 * NULL.
 */
int hm_wire_get_array(const msgpack_object *o, uint32_t min_n, uint32_t max_n,
                      const msgpack_object **items_out, uint32_t *n_out);
/*
 * Finds key in a map with string keys (other keys are skipped); NULL when
 * absent or o is not a map. With a duplicated key the first entry wins.
 */
const msgpack_object *hm_wire_map_get(const msgpack_object *o, const char *key);

/*
 * Bounded writer. Either over a caller buffer (fixed) or growing up to a
 * cap (dynamic; free with hm_wire_wr_free). Any write past the cap sets
 * err = -EMSGSIZE (a failed growth -ENOMEM, an inconsistent tensor -EINVAL)
 * and later writes are ignored; check hm_wire_wr_error once at the end.
 * The packer points back at the writer, so a writer must not be moved or
 * copied after init.
 */
typedef struct hm_wire_wr {
    msgpack_packer pk;
    uint8_t *buf;
    size_t len;
    size_t cap;     /* bytes currently allocated (fixed: buffer size) */
    size_t max;     /* hard cap */
    int dynamic;
    int err;
} hm_wire_wr;

void hm_wire_wr_init_fixed(hm_wire_wr *w, void *buf, size_t cap);
void hm_wire_wr_init_dynamic(hm_wire_wr *w, size_t max);
void hm_wire_wr_free(hm_wire_wr *w);
static inline int hm_wire_wr_error(const hm_wire_wr *w) { return w->err; }
/*
 * Hands the dynamic buffer to the caller (free() it); the writer is reset to
 * empty and may be reused. Returns NULL when the writer has an error (the
 * buffer is freed and the error cleared) or is fixed (it is left as it is);
 * an empty dynamic writer yields a non-NULL buffer.
 */
uint8_t *hm_wire_wr_steal(hm_wire_wr *w, size_t *len_out);

void hm_wire_wr_array(hm_wire_wr *w, uint32_t n);
void hm_wire_wr_map(hm_wire_wr *w, uint32_t n);
void hm_wire_wr_uint(hm_wire_wr *w, uint64_t v);
void hm_wire_wr_int(hm_wire_wr *w, int64_t v);
void hm_wire_wr_double(hm_wire_wr *w, double v);
void hm_wire_wr_bool(hm_wire_wr *w, int v);
void hm_wire_wr_nil(hm_wire_wr *w);
void hm_wire_wr_str(hm_wire_wr *w, const char *s, size_t len);
void hm_wire_wr_cstr(hm_wire_wr *w, const char *s);
void hm_wire_wr_bin(hm_wire_wr *w, const void *p, size_t len);
/* Only the header of a bin of len bytes: its body is written (or sent) after
 * it by the caller, so a large body need not be copied into the message. */
void hm_wire_wr_bin_header(hm_wire_wr *w, size_t len);
/* A socket address as "HOST:PORT" text (hm_format_addr); an address that
 * cannot be formatted sets err = -EINVAL. */
void hm_wire_wr_addr(hm_wire_wr *w, const struct sockaddr_storage *ss);
/* Reads such a string back (numeric host only). 0 or -EPROTO. */
int hm_wire_get_addr(const msgpack_object *o, struct sockaddr_storage *out);
/* A bin of exactly n bytes, copied into out. 0 or -EPROTO. */
int hm_wire_get_bin_exact(const msgpack_object *o, void *out, size_t n);
/* Appends bytes that already are one encoded msgpack object. */
void hm_wire_wr_raw(hm_wire_wr *w, const void *p, size_t len);

enum hm_dtype {
    HM_DTYPE_F32 = 0,
    HM_DTYPE_F16 = 1,
    HM_DTYPE_BF16 = 2,
    HM_DTYPE_U8 = 3,
};
#define HM_TENSOR_MAX_DIMS 8

typedef struct hm_wire_tensor {
    uint8_t dtype;
    uint8_t ndim;
    uint64_t shape[HM_TENSOR_MAX_DIMS];
    const uint8_t *data; /* points into the frame when decoded */
    size_t nbytes;
} hm_wire_tensor;

size_t hm_dtype_size(int dtype); /* 0 for an unknown dtype */

/* Writes [dtype, [dims], bin]; a shape that does not match nbytes sets err = -EINVAL. */
void hm_wire_wr_tensor(hm_wire_wr *w, const hm_wire_tensor *t);
/*
 * Reads a tensor from an unpacked object. The declared shape is never
 * trusted: the element count must not overflow, must be at most max_elems,
 * and must match the bin length exactly. Returns 0, -EPROTO (wrong types,
 * unknown dtype, more than HM_TENSOR_MAX_DIMS dims, bin length not the
 * shape's) or -EMSGSIZE (a dim or the element count over max_elems, which
 * includes any product that would overflow).
 */
int hm_wire_get_tensor(const msgpack_object *o, uint64_t max_elems, hm_wire_tensor *out);

#endif

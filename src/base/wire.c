/*
 * wire: the bounded msgpack codec (see wire.h). It owns no state: the
 * validator walks caller bytes with a fixed-size stack on the C stack, the
 * unpacker allocates only from the caller's zone, and each writer owns only
 * its own buffer.
 */
#include "config.h"

#include "src/base/wire.h"

#include "src/base/util.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

const hm_wire_limits hm_wire_default_limits = {
    .max_size = 1u << 20,
    .max_depth = 16,
    .max_elements = 65536,
};

/* ---- validation ---- */

/*
 * Byte-level walk state. A position never passes min(len, max_size), so
 * "bytes left before the cap" and "bytes left in the buffer" can both be
 * computed by subtraction without overflow.
 */
struct walk {
    const uint8_t *p;
    size_t len;
    size_t cap;
    size_t pos;
};

/*
 * Checks that n more bytes exist at the current position. Needing more than
 * the size cap allows is -EMSGSIZE (the frame can never be accepted, so a
 * stream reader should give up rather than wait for more); needing more than
 * the buffer holds but no more than the cap is -EINVAL (truncated).
 */
static int walk_need(const struct walk *wk, uint64_t n)
{
    if (n > (uint64_t)(wk->cap - wk->pos))
        return -EMSGSIZE;
    if (n > (uint64_t)(wk->len - wk->pos))
        return -EINVAL;
    return 0;
}

/* Reads a big-endian unsigned integer of width bytes (1, 2 or 4) after the type byte. */
static uint32_t read_be(const uint8_t *p, unsigned width)
{
    uint32_t v = 0;
    for (unsigned i = 0; i < width; i++)
        v = (v << 8) | p[i];
    return v;
}

int hm_wire_validate(const void *buf, size_t len, const hm_wire_limits *lim, size_t *used_out)
{
    /* Children still to read in each open container (maps count keys and values). */
    uint64_t remaining[HM_WIRE_MAX_DEPTH];
    unsigned depth = 0;
    unsigned max_depth;
    uint64_t pending = 1; /* objects announced but not yet read, the root included */
    uint64_t elements = 0;
    struct walk wk;
    int result = 0;

    if (buf == NULL && len > 0)
        return -EINVAL;
    if (lim == NULL)
        lim = &hm_wire_default_limits;
    max_depth = lim->max_depth < HM_WIRE_MAX_DEPTH ? lim->max_depth : HM_WIRE_MAX_DEPTH;

    wk.p = buf;
    wk.len = len < lim->max_size ? len : lim->max_size;
    wk.cap = lim->max_size;
    wk.pos = 0;
    /*
     * When the buffer is longer than the cap, the walk still sees only the
     * first max_size bytes: an object that needs more is over the cap.
     */

    for (;;) {
        uint8_t b;
        uint64_t hdr = 1;      /* bytes of type byte plus length/count field */
        uint64_t payload = 0;  /* bytes of str/bin/number body */
        uint64_t children = 0; /* objects inside a container (2 per map entry) */
        int container = 0;

        if ((result = walk_need(&wk, 1)) < 0)
            goto out;
        b = wk.p[wk.pos];
        pending--;
        if (++elements > lim->max_elements) {
            result = -EMSGSIZE;
            goto out;
        }
        if (depth > 0)
            remaining[depth - 1]--;

        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
            /* fixint, negative fixint, nil, false, true: the type byte is all. */
        } else if (b >= 0x80 && b <= 0x8f) {
            container = 1;
            children = 2u * (uint64_t)(b & 0x0f);
        } else if (b >= 0x90 && b <= 0x9f) {
            container = 1;
            children = b & 0x0f;
        } else if (b >= 0xa0 && b <= 0xbf) {
            payload = b & 0x1f;
        } else {
            unsigned width = 0; /* bytes of the length or count field */
            int kind = 0;       /* 0 fixed-size number, 1 str/bin, 2 array, 3 map */

            switch (b) {
            case 0xcc: case 0xd0: payload = 1; break;
            case 0xcd: case 0xd1: payload = 2; break;
            case 0xca: case 0xce: case 0xd2: payload = 4; break;
            case 0xcb: case 0xcf: case 0xd3: payload = 8; break;
            case 0xc4: case 0xd9: width = 1; kind = 1; break;
            case 0xc5: case 0xda: width = 2; kind = 1; break;
            case 0xc6: case 0xdb: width = 4; kind = 1; break;
            case 0xdc: width = 2; kind = 2; break;
            case 0xdd: width = 4; kind = 2; break;
            case 0xde: width = 2; kind = 3; break;
            case 0xdf: width = 4; kind = 3; break;
            default:
                /*
                 * 0xc1 is reserved by the format, and ext types (0xc7-0xc9,
                 * 0xd4-0xd8) are not part of any hivemindd message; both are
                 * malformed here.
                 */
                result = -EINVAL;
                goto out;
            }
            if (width > 0) {
                uint32_t n;

                if ((result = walk_need(&wk, 1 + (uint64_t)width)) < 0)
                    goto out;
                n = read_be(wk.p + wk.pos + 1, width);
                hdr = 1 + width;
                if (kind == 1) {
                    payload = n;
                } else {
                    container = 1;
                    children = kind == 3 ? 2u * (uint64_t)n : n;
                }
            }
        }

        if ((result = walk_need(&wk, hdr + payload)) < 0)
            goto out;
        wk.pos += (size_t)(hdr + payload);

        if (container) {
            if (depth + 1 > max_depth) {
                result = -EMSGSIZE;
                goto out;
            }
            if (children > 0) {
                pending += children;
                /*
                 * Every announced object takes at least one byte, so the
                 * announced total is checked against the caps and the bytes
                 * left now, before anything is read or allocated for it.
                 */
                if (pending > lim->max_elements - elements) {
                    result = -EMSGSIZE;
                    goto out;
                }
                if ((result = walk_need(&wk, pending)) < 0)
                    goto out;
                remaining[depth++] = children;
            }
        }

        while (depth > 0 && remaining[depth - 1] == 0)
            depth--;
        if (depth == 0)
            break;
    }

    if (used_out != NULL)
        *used_out = wk.pos;
out:
    return result;
}

int hm_wire_unpack(const void *buf, size_t len, const hm_wire_limits *lim, msgpack_zone *zone,
                   msgpack_object *obj_out)
{
    size_t used = 0;
    size_t off = 0;
    msgpack_unpack_return ret;
    int result;

    if (lim == NULL)
        lim = &hm_wire_default_limits;
    if (zone == NULL || obj_out == NULL)
        return -EINVAL;
    if (len > lim->max_size)
        return -EMSGSIZE;
    if ((result = hm_wire_validate(buf, len, lim, &used)) < 0)
        goto out;
    if (used != len) {
        /* A frame is exactly one object; trailing bytes are malformed. */
        result = -EINVAL;
        goto out;
    }
    ret = msgpack_unpack(buf, len, &off, zone, obj_out);
    if (ret == MSGPACK_UNPACK_NOMEM_ERROR) {
        result = -ENOMEM;
        goto out;
    }
    if (ret != MSGPACK_UNPACK_SUCCESS || off != len) {
        /* The validator accepted something msgpack-c does not: treat it as malformed. */
        result = -EINVAL;
        goto out;
    }
    result = 0;
out:
    return result;
}

/* ---- the decoders' prologue ---- */

/*
 * The zone's first chunk. After validation the zone needs at most one
 * msgpack_object per frame byte, but str and bin point into the frame, so
 * most messages need far less: a chunk the size of the frame, between 256
 * bytes and 2 KiB, holds a DHT datagram or a matchmaking reply in one
 * malloc and lets the zone grow for the rare frame that needs more.
 */
static size_t zone_chunk(size_t len) { return HM_MAX(HM_MIN(len, (size_t)2048), (size_t)256); }

int hm_wire_decode_open(hm_wire_msg *m, const void *buf, size_t len, const hm_wire_limits *lim)
{
    int result;

    memset(m, 0, sizeof(*m));
    if (buf == NULL)
        return -EINVAL;
    if (!msgpack_zone_init(&m->zone, zone_chunk(len)))
        return -ENOMEM;
    m->live = 1;
    if ((result = hm_wire_unpack(buf, len, lim, &m->zone, &m->root)) < 0)
        goto out;
    result = 0;
out:
    if (result < 0)
        hm_wire_decode_close(m);
    return result;
}

/* Whether o is the unsigned integer version (a missing o is not). */
static int is_version(const msgpack_object *o, uint64_t version)
{
    uint64_t v;
    return hm_wire_get_uint(o, &v) == 0 && v == version;
}

/* A frame that is well formed but not the message asked for keeps nothing. */
static int wrong_shape(hm_wire_msg *m)
{
    hm_wire_decode_close(m);
    return -EPROTO;
}

int hm_wire_decode_open_array(hm_wire_msg *m, const void *buf, size_t len,
                              const hm_wire_limits *lim, uint32_t min_n, uint32_t max_n,
                              uint64_t version)
{
    int result = hm_wire_decode_open(m, buf, len, lim);

    if (result == 0 && (hm_wire_get_array(&m->root, min_n, max_n, &m->items, &m->n) < 0 ||
                        (version != HM_WIRE_ANY_VERSION &&
                         (m->n == 0 || !is_version(&m->items[0], version)))))
        result = wrong_shape(m);
    return result;
}

int hm_wire_decode_open_map(hm_wire_msg *m, const void *buf, size_t len,
                            const hm_wire_limits *lim, const char *version_key, uint64_t version)
{
    int result = hm_wire_decode_open(m, buf, len, lim);

    if (result == 0 && (m->root.type != MSGPACK_OBJECT_MAP ||
                        (version_key != NULL &&
                         !is_version(hm_wire_map_get(&m->root, version_key), version))))
        result = wrong_shape(m);
    return result;
}

void hm_wire_decode_close(hm_wire_msg *m)
{
    if (m->live)
        msgpack_zone_destroy(&m->zone);
    memset(m, 0, sizeof(*m));
}

/* ---- typed access ---- */

int hm_wire_get_uint(const msgpack_object *o, uint64_t *out)
{
    if (o == NULL || o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return -EPROTO;
    if (out != NULL)
        *out = o->via.u64;
    return 0;
}

int hm_wire_get_int(const msgpack_object *o, int64_t *out)
{
    int64_t v;

    if (o == NULL)
        return -EPROTO;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > (uint64_t)INT64_MAX)
            return -EPROTO;
        v = (int64_t)o->via.u64;
    } else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        v = o->via.i64;
    } else {
        return -EPROTO;
    }
    if (out != NULL)
        *out = v;
    return 0;
}

int hm_wire_get_double(const msgpack_object *o, double *out)
{
    double v;

    if (o == NULL)
        return -EPROTO;
    switch (o->type) {
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        v = o->via.f64;
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        v = (double)o->via.u64;
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        v = (double)o->via.i64;
        break;
    default:
        return -EPROTO;
    }
    if (out != NULL)
        *out = v;
    return 0;
}

int hm_wire_get_bool(const msgpack_object *o, int *out)
{
    if (o == NULL || o->type != MSGPACK_OBJECT_BOOLEAN)
        return -EPROTO;
    if (out != NULL)
        *out = o->via.boolean ? 1 : 0;
    return 0;
}

int hm_wire_get_str(const msgpack_object *o, const char **ptr_out, uint32_t *len_out)
{
    if (o == NULL || o->type != MSGPACK_OBJECT_STR)
        return -EPROTO;
    /*
     * msgpack-c leaves an empty str's pointer NULL; hand out a valid empty
     * string instead so that callers may pass it to memcpy and friends.
     */
    if (ptr_out != NULL)
        *ptr_out = o->via.str.ptr != NULL ? o->via.str.ptr : "";
    if (len_out != NULL)
        *len_out = o->via.str.size;
    return 0;
}

int hm_wire_get_bin(const msgpack_object *o, const uint8_t **ptr_out, uint32_t *len_out)
{
    if (o == NULL || o->type != MSGPACK_OBJECT_BIN)
        return -EPROTO;
    if (ptr_out != NULL)
        *ptr_out = o->via.bin.ptr != NULL ? (const uint8_t *)o->via.bin.ptr
                                          : (const uint8_t *)"";
    if (len_out != NULL)
        *len_out = o->via.bin.size;
    return 0;
}

int hm_wire_get_array(const msgpack_object *o, uint32_t min_n, uint32_t max_n,
                      const msgpack_object **items_out, uint32_t *n_out)
{
    uint32_t n;

    if (o == NULL || o->type != MSGPACK_OBJECT_ARRAY)
        return -EPROTO;
    n = o->via.array.size;
    if (n < min_n || (max_n != 0 && n > max_n))
        return -EPROTO;
    if (items_out != NULL)
        *items_out = o->via.array.ptr;
    if (n_out != NULL)
        *n_out = n;
    return 0;
}

const msgpack_object *hm_wire_map_get(const msgpack_object *o, const char *key)
{
    size_t klen;

    if (o == NULL || key == NULL || o->type != MSGPACK_OBJECT_MAP)
        return NULL;
    klen = strlen(key);
    for (uint32_t i = 0; i < o->via.map.size; i++) {
        const msgpack_object *k = &o->via.map.ptr[i].key;

        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == klen &&
            (klen == 0 || memcmp(k->via.str.ptr, key, klen) == 0))
            return &o->via.map.ptr[i].val;
    }
    return NULL;
}

/* ---- bounded writer ---- */

static void wr_fail(hm_wire_wr *w, int err)
{
    if (w->err == 0)
        w->err = err;
}

/* msgpack_packer's sink: appends to the writer's buffer within its cap. */
static int wr_write(void *data, const char *buf, size_t len)
{
    hm_wire_wr *w = data;

    if (w->err != 0)
        return -1;
    if (len == 0)
        return 0;
    if (len > w->max - w->len) {
        wr_fail(w, -EMSGSIZE);
        return -1;
    }
    if (len > w->cap - w->len) {
        size_t ncap = w->cap > 0 ? w->cap : 256;
        uint8_t *nbuf;

        /* Only a dynamic writer gets here: a fixed one has cap == max. */
        while (ncap - w->len < len) {
            if (ncap > w->max / 2) {
                ncap = w->max;
                break;
            }
            ncap *= 2;
        }
        if (ncap > w->max)
            ncap = w->max;
        nbuf = realloc(w->buf, ncap);
        if (nbuf == NULL) {
            wr_fail(w, -ENOMEM);
            return -1;
        }
        w->buf = nbuf;
        w->cap = ncap;
    }
    memcpy(w->buf + w->len, buf, len);
    w->len += len;
    return 0;
}

void hm_wire_wr_init_fixed(hm_wire_wr *w, void *buf, size_t cap)
{
    memset(w, 0, sizeof(*w));
    w->buf = buf;
    w->cap = buf != NULL ? cap : 0;
    w->max = w->cap;
    msgpack_packer_init(&w->pk, w, wr_write);
}

void hm_wire_wr_init_dynamic(hm_wire_wr *w, size_t max)
{
    memset(w, 0, sizeof(*w));
    w->max = max;
    w->dynamic = 1;
    msgpack_packer_init(&w->pk, w, wr_write);
}

void hm_wire_wr_free(hm_wire_wr *w)
{
    if (w->dynamic)
        free(w->buf);
    w->buf = NULL;
    w->len = 0;
    w->cap = 0;
}

uint8_t *hm_wire_wr_steal(hm_wire_wr *w, size_t *len_out)
{
    uint8_t *buf = NULL;
    size_t len = 0;

    if (w->dynamic) {
        if (w->err == 0) {
            /* An empty writer still hands back a buffer, so NULL always means failure. */
            if (w->buf == NULL)
                w->buf = malloc(1);
            buf = w->buf;
            len = buf != NULL ? w->len : 0;
        } else {
            free(w->buf);
        }
        w->buf = NULL;
        w->len = 0;
        w->cap = 0;
        w->err = 0;
    }
    if (len_out != NULL)
        *len_out = len;
    return buf;
}

void hm_wire_wr_array(hm_wire_wr *w, uint32_t n) { (void)msgpack_pack_array(&w->pk, n); }

void hm_wire_wr_map(hm_wire_wr *w, uint32_t n) { (void)msgpack_pack_map(&w->pk, n); }

void hm_wire_wr_uint(hm_wire_wr *w, uint64_t v) { (void)msgpack_pack_uint64(&w->pk, v); }

void hm_wire_wr_int(hm_wire_wr *w, int64_t v) { (void)msgpack_pack_int64(&w->pk, v); }

void hm_wire_wr_double(hm_wire_wr *w, double v) { (void)msgpack_pack_double(&w->pk, v); }

void hm_wire_wr_bool(hm_wire_wr *w, int v)
{
    (void)(v ? msgpack_pack_true(&w->pk) : msgpack_pack_false(&w->pk));
}

void hm_wire_wr_nil(hm_wire_wr *w) { (void)msgpack_pack_nil(&w->pk); }

void hm_wire_wr_str(hm_wire_wr *w, const char *s, size_t len)
{
    if (len > UINT32_MAX) {
        wr_fail(w, -EMSGSIZE);
        return;
    }
    (void)msgpack_pack_str(&w->pk, len);
    (void)msgpack_pack_str_body(&w->pk, s, len);
}

void hm_wire_wr_cstr(hm_wire_wr *w, const char *s) { hm_wire_wr_str(w, s, strlen(s)); }

void hm_wire_wr_bin(hm_wire_wr *w, const void *p, size_t len)
{
    if (len > UINT32_MAX) {
        wr_fail(w, -EMSGSIZE);
        return;
    }
    (void)msgpack_pack_bin(&w->pk, len);
    (void)msgpack_pack_bin_body(&w->pk, p, len);
}

void hm_wire_wr_bin_header(hm_wire_wr *w, size_t len)
{
    if (len > UINT32_MAX) {
        wr_fail(w, -EMSGSIZE);
        return;
    }
    (void)msgpack_pack_bin(&w->pk, len);
}

void hm_wire_wr_raw(hm_wire_wr *w, const void *p, size_t len) { (void)wr_write(w, p, len); }

/* ---- tensors ---- */

size_t hm_dtype_size(int dtype)
{
    switch (dtype) {
    case HM_DTYPE_F32:
        return 4;
    case HM_DTYPE_F16:
    case HM_DTYPE_BF16:
        return 2;
    case HM_DTYPE_U8:
        return 1;
    default:
        return 0;
    }
}

/*
 * Multiplies the dims into an element count no larger than max_elems and
 * the count into a byte size, refusing any overflow. Each partial product is
 * kept at most max_elems, so a later zero cannot hide an earlier overflow.
 */
static int tensor_size(int dtype, unsigned ndim, const uint64_t *shape, uint64_t max_elems,
                       size_t *nbytes_out)
{
    size_t dsize = hm_dtype_size(dtype);
    uint64_t count = 1;

    if (dsize == 0 || ndim > HM_TENSOR_MAX_DIMS)
        return -EPROTO;
    for (unsigned i = 0; i < ndim; i++) {
        if (shape[i] > max_elems)
            return -EMSGSIZE;
        if (count != 0 && shape[i] > max_elems / count)
            return -EMSGSIZE;
        count *= shape[i];
    }
    if (count > max_elems || count > SIZE_MAX / dsize)
        return -EMSGSIZE;
    *nbytes_out = (size_t)count * dsize;
    return 0;
}

void hm_wire_wr_tensor(hm_wire_wr *w, const hm_wire_tensor *t)
{
    size_t nbytes = 0;

    if (tensor_size(t->dtype, t->ndim, t->shape, UINT64_MAX, &nbytes) < 0 || nbytes != t->nbytes ||
        (t->data == NULL && nbytes > 0)) {
        /* A tensor whose shape does not describe its bytes is a caller bug, not a size problem. */
        wr_fail(w, -EINVAL);
        return;
    }
    hm_wire_wr_array(w, 3);
    hm_wire_wr_uint(w, t->dtype);
    hm_wire_wr_array(w, t->ndim);
    for (unsigned i = 0; i < t->ndim; i++)
        hm_wire_wr_uint(w, t->shape[i]);
    hm_wire_wr_bin(w, t->data, t->nbytes);
}

int hm_wire_get_tensor(const msgpack_object *o, uint64_t max_elems, hm_wire_tensor *out)
{
    const msgpack_object *items;
    const msgpack_object *dims;
    const uint8_t *data;
    uint32_t ndim;
    uint32_t blen;
    uint64_t dtype;
    size_t nbytes = 0;
    hm_wire_tensor t;
    int result;

    memset(&t, 0, sizeof(t));
    if ((result = hm_wire_get_array(o, 3, 3, &items, NULL)) < 0)
        goto out;
    if ((result = hm_wire_get_uint(&items[0], &dtype)) < 0)
        goto out;
    if (hm_dtype_size(dtype > 255 ? -1 : (int)dtype) == 0) {
        result = -EPROTO;
        goto out;
    }
    if ((result = hm_wire_get_array(&items[1], 0, 0, &dims, &ndim)) < 0)
        goto out;
    if (ndim > HM_TENSOR_MAX_DIMS) {
        result = -EPROTO;
        goto out;
    }
    for (uint32_t i = 0; i < ndim; i++)
        if ((result = hm_wire_get_uint(&dims[i], &t.shape[i])) < 0)
            goto out;
    if ((result = hm_wire_get_bin(&items[2], &data, &blen)) < 0)
        goto out;
    t.dtype = (uint8_t)dtype;
    t.ndim = (uint8_t)ndim;
    if ((result = tensor_size(t.dtype, t.ndim, t.shape, max_elems, &nbytes)) < 0)
        goto out;
    if (nbytes != blen) {
        result = -EPROTO;
        goto out;
    }
    t.data = data;
    t.nbytes = nbytes;
    if (out != NULL)
        *out = t;
    result = 0;
out:
    return result;
}

void hm_wire_wr_addr(hm_wire_wr *w, const struct sockaddr_storage *ss)
{
    char buf[HM_ADDRSTRLEN];
    if (hm_format_addr((const struct sockaddr *)ss, buf, sizeof(buf)) < 0) {
        if (w->err == 0)
            w->err = -EINVAL;
        return;
    }
    hm_wire_wr_cstr(w, buf);
}

int hm_wire_get_addr(const msgpack_object *o, struct sockaddr_storage *out)
{
    const char *p;
    uint32_t n;
    char buf[HM_ADDRSTRLEN];
    if (hm_wire_get_str(o, &p, &n) < 0 || n == 0 || n >= sizeof(buf))
        return -EPROTO;
    memcpy(buf, p, n);
    buf[n] = '\0';
    if (memchr(buf, '\0', n) != NULL)
        return -EPROTO;
    memset(out, 0, sizeof(*out));
    return hm_parse_hostport(buf, out) == 0 ? 0 : -EPROTO;
}

int hm_wire_get_bin_exact(const msgpack_object *o, void *out, size_t n)
{
    const uint8_t *p;
    uint32_t len;
    if (hm_wire_get_bin(o, &p, &len) < 0 || len != n)
        return -EPROTO;
    memcpy(out, p, n);
    return 0;
}

/*
 * fuzz_wire: fuzz target for the bounded msgpack codec. Each input is
 * validated and unpacked under the default limits and under tight ones;
 * whatever unpacks goes through every typed getter and the tensor reader,
 * and is re-encoded through the bounded writer. Besides memory safety it
 * checks the codec's promises: what the validator accepts msgpack-c
 * unpacks, tight limits never accept what the default ones refuse, pointers
 * handed out stay inside the frame, and re-encoding reaches a fixed point.
 */
#include "config.h"

#include "src/base/wire.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                           \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "fuzz_wire: check failed at line %d: %s\n", __LINE__, #cond);     \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

static const hm_wire_limits any_limits = {
    .max_size = SIZE_MAX,
    .max_depth = HM_WIRE_MAX_DEPTH,
    .max_elements = SIZE_MAX,
};

struct frame {
    const uint8_t *p;
    size_t len;
};

static int inside(const struct frame *f, const void *p, size_t n)
{
    const uint8_t *b = p;
    return n == 0 || (b >= f->p && n <= f->len && b <= f->p + (f->len - n));
}

/* Writes o back out through the bounded writer. */
static void encode(hm_wire_wr *w, const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
        hm_wire_wr_nil(w);
        break;
    case MSGPACK_OBJECT_BOOLEAN:
        hm_wire_wr_bool(w, o->via.boolean);
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        hm_wire_wr_uint(w, o->via.u64);
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        hm_wire_wr_int(w, o->via.i64);
        break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        hm_wire_wr_double(w, o->via.f64);
        break;
    case MSGPACK_OBJECT_STR:
        hm_wire_wr_str(w, o->via.str.ptr, o->via.str.size);
        break;
    case MSGPACK_OBJECT_BIN:
        hm_wire_wr_bin(w, o->via.bin.ptr, o->via.bin.size);
        break;
    case MSGPACK_OBJECT_ARRAY:
        hm_wire_wr_array(w, o->via.array.size);
        for (uint32_t i = 0; i < o->via.array.size; i++)
            encode(w, &o->via.array.ptr[i]);
        break;
    case MSGPACK_OBJECT_MAP:
        hm_wire_wr_map(w, o->via.map.size);
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            encode(w, &o->via.map.ptr[i].key);
            encode(w, &o->via.map.ptr[i].val);
        }
        break;
    default:
        /* The validator refuses ext types, so nothing else can come out. */
        CHECK(0);
    }
}

/* Runs every accessor on o and its children and checks their answers agree with o. */
static void probe(const struct frame *f, const msgpack_object *o, unsigned depth)
{
    uint64_t u;
    int64_t i;
    double d;
    int b;
    const char *s;
    const uint8_t *p;
    uint32_t n;
    const msgpack_object *items;
    hm_wire_tensor t;
    int rc;

    CHECK(depth <= HM_WIRE_MAX_DEPTH);
    CHECK((hm_wire_get_uint(o, &u) == 0) == (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER));
    rc = hm_wire_get_int(o, &i);
    CHECK(rc == 0 || rc == -EPROTO);
    if (rc == 0)
        CHECK(o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER ? i < 0 : (uint64_t)i == o->via.u64);
    rc = hm_wire_get_double(o, &d);
    CHECK(rc == 0 || rc == -EPROTO);
    CHECK((hm_wire_get_bool(o, &b) == 0) == (o->type == MSGPACK_OBJECT_BOOLEAN));
    if (hm_wire_get_str(o, &s, &n) == 0)
        CHECK(s != NULL && inside(f, s, n));
    if (hm_wire_get_bin(o, &p, &n) == 0)
        CHECK(p != NULL && inside(f, p, n));

    rc = hm_wire_get_tensor(o, UINT64_MAX, &t);
    CHECK(rc == 0 || rc == -EPROTO || rc == -EMSGSIZE);
    if (rc == 0) {
        uint64_t count = 1;
        CHECK(t.ndim <= HM_TENSOR_MAX_DIMS);
        CHECK(hm_dtype_size(t.dtype) != 0);
        for (unsigned k = 0; k < t.ndim; k++)
            count *= t.shape[k];
        CHECK(count * hm_dtype_size(t.dtype) == t.nbytes);
        CHECK(t.data != NULL && inside(f, t.data, t.nbytes));
        /* A tight element cap must refuse exactly the tensors over it. */
        if (count > 0)
            CHECK(hm_wire_get_tensor(o, count - 1, &t) == -EMSGSIZE);
    }

    if (hm_wire_get_array(o, 0, 0, &items, &n) == 0) {
        CHECK(n == 0 || items != NULL);
        CHECK(hm_wire_get_array(o, n, n, NULL, NULL) == 0);
        CHECK(hm_wire_get_array(o, n + 1, 0, NULL, NULL) == (n == UINT32_MAX ? 0 : -EPROTO));
        for (uint32_t k = 0; k < n; k++)
            probe(f, &items[k], depth + 1);
    }
    if (o->type == MSGPACK_OBJECT_MAP) {
        for (uint32_t k = 0; k < o->via.map.size; k++) {
            const msgpack_object *key = &o->via.map.ptr[k].key;
            probe(f, key, depth + 1);
            probe(f, &o->via.map.ptr[k].val, depth + 1);
            /* Lookups are linear, so only the first keys are looked up (time stays linear). */
            if (k < 64 && key->type == MSGPACK_OBJECT_STR && key->via.str.size > 0 &&
                key->via.str.size < 64 && memchr(key->via.str.ptr, 0, key->via.str.size) == NULL) {
                char name[64];
                const msgpack_object *v;
                memcpy(name, key->via.str.ptr, key->via.str.size);
                name[key->via.str.size] = '\0';
                v = hm_wire_map_get(o, name);
                /* The first entry with this key is at or before this one. */
                CHECK(v != NULL && v >= &o->via.map.ptr[0].val && v <= &o->via.map.ptr[k].val);
            }
        }
    }
}

/* Encodes o, unpacks the result, and checks that encoding it again changes nothing. */
static void round_trip(const msgpack_object *o, size_t in_len)
{
    hm_wire_wr w1, w2;
    msgpack_zone z;
    msgpack_object again;
    /* Only float32 grows on re-encoding (5 bytes to 9), so twice the input is enough. */
    size_t max = 2 * in_len + 16;

    hm_wire_wr_init_dynamic(&w1, max);
    encode(&w1, o);
    CHECK(hm_wire_wr_error(&w1) == 0);

    msgpack_zone_init(&z, 2048);
    CHECK(hm_wire_unpack(w1.buf, w1.len, &any_limits, &z, &again) == 0);
    hm_wire_wr_init_dynamic(&w2, max);
    encode(&w2, &again);
    CHECK(hm_wire_wr_error(&w2) == 0);
    CHECK(w1.len == w2.len && memcmp(w1.buf, w2.buf, w1.len) == 0);

    /* A fixed writer one byte short fails cleanly, without writing past its end. */
    if (w1.len > 0) {
        hm_wire_wr w3;
        uint8_t *small = malloc(w1.len - 1 > 0 ? w1.len - 1 : 1);
        CHECK(small != NULL);
        hm_wire_wr_init_fixed(&w3, small, w1.len - 1);
        encode(&w3, o);
        CHECK(hm_wire_wr_error(&w3) == -EMSGSIZE);
        free(small);
    }
    hm_wire_wr_free(&w2);
    hm_wire_wr_free(&w1);
    msgpack_zone_destroy(&z);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const hm_wire_limits tight = {
        .max_size = size / 2 + 1,
        .max_depth = 3,
        .max_elements = 32,
    };
    struct frame f = {data, size};
    msgpack_zone z;
    msgpack_object o;
    size_t used = 0;
    int rc_default, rc_tight, rc_validate;

    msgpack_zone_init(&z, 2048);

    /* Whatever prefix the validator accepts, msgpack-c must unpack exactly. */
    rc_validate = hm_wire_validate(data, size, NULL, &used);
    CHECK(rc_validate == 0 || rc_validate == -EINVAL || rc_validate == -EMSGSIZE);
    if (rc_validate == 0) {
        CHECK(used > 0 && used <= size);
        CHECK(hm_wire_unpack(data, used, NULL, &z, &o) == 0);
    }

    rc_default = hm_wire_unpack(data, size, NULL, &z, &o);
    CHECK(rc_default == 0 || rc_default == -EINVAL || rc_default == -EMSGSIZE);
    CHECK((rc_default == 0) == (rc_validate == 0 && used == size));
    if (rc_default == 0) {
        probe(&f, &o, 0);
        round_trip(&o, size);
    }

    rc_tight = hm_wire_unpack(data, size, &tight, &z, &o);
    CHECK(rc_tight == 0 || rc_tight == -EINVAL || rc_tight == -EMSGSIZE);
    if (rc_tight == 0) {
        CHECK(rc_default == 0);
        probe(&f, &o, 0);
    }
    /* Limits only ever turn acceptance into -EMSGSIZE, never into another error. */
    if (rc_default == 0)
        CHECK(rc_tight == 0 || rc_tight == -EMSGSIZE);

    msgpack_zone_destroy(&z);
    return 0;
}

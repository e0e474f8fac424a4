/*
 * Tests for the bounded msgpack codec: every type round-trips through the
 * writer and the unpacker, hostile frames are rejected with the documented
 * error before msgpack-c sees them, unpacking allocates at most a small
 * multiple of the frame's size, and tensor headers cannot lie about their
 * size.
 */
#include "config.h"

#include "src/base/util.h"
#include "src/base/wire.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <float.h>
#include <malloc.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SANITIZE_ADDRESS__)
#define HM_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HM_TEST_ASAN 1
#endif
#endif
#ifdef HM_TEST_ASAN
/* From ASan's allocator interface; gcc does not install the header. */
size_t __sanitizer_get_current_allocated_bytes(void);
#endif

/* ---- helpers ---- */

/* A growing byte buffer for hand-built (often hostile) frames. */
struct bytes {
    uint8_t *p;
    size_t len;
    size_t cap;
};

static void put(struct bytes *b, const void *src, size_t n)
{
    if (b->len + n > b->cap) {
        size_t ncap = b->cap ? b->cap : 64;
        while (ncap < b->len + n)
            ncap *= 2;
        b->p = realloc(b->p, ncap);
        cr_assert_not_null(b->p);
        b->cap = ncap;
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void put1(struct bytes *b, uint8_t v) { put(b, &v, 1); }

static void put_be(struct bytes *b, uint64_t v, unsigned width)
{
    for (unsigned i = 0; i < width; i++)
        put1(b, (uint8_t)(v >> (8 * (width - 1 - i))));
}

static void put_fill(struct bytes *b, uint8_t v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        put1(b, v);
}

/* Unpacks a frame that must be valid under the default limits. */
static msgpack_object unpack_ok(msgpack_zone *z, const void *buf, size_t len)
{
    msgpack_object o;
    int rc = hm_wire_unpack(buf, len, NULL, z, &o);

    cr_assert_eq(rc, 0, "unpack of a valid %zu-byte frame failed: %d", len, rc);
    return o;
}

/* Bytes of heap in use: ASan's own count under ASan, glibc's otherwise. */
static size_t heap_in_use(void)
{
#ifdef HM_TEST_ASAN
    return __sanitizer_get_current_allocated_bytes();
#else
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
#endif
}

/* ---- round trips ---- */

Test(wire, scalars_round_trip)
{
    static const uint64_t uints[] = {0, 1, 127, 128, 255, 256, 65535, 65536, 0xffffffffu,
                                     0x100000000ull, UINT64_MAX};
    static const int64_t ints[] = {-1, -32, -33, -128, -129, -32768, -32769,
                                   (int64_t)INT32_MIN - 1, INT64_MIN, INT64_MAX, 0, 5};
    static const double dbls[] = {0.0, -0.0, 1.5, -2.25e300, DBL_MAX, DBL_MIN, INFINITY,
                                  -INFINITY};
    hm_wire_wr w;
    msgpack_zone z;
    msgpack_object o;
    const msgpack_object *items;
    uint32_t n;
    size_t len;
    uint8_t *buf;
    size_t i = 0;

    hm_wire_wr_init_dynamic(&w, 4096);
    hm_wire_wr_array(&w, HM_ARRAY_LEN(uints) + HM_ARRAY_LEN(ints) + HM_ARRAY_LEN(dbls) + 4);
    for (size_t k = 0; k < HM_ARRAY_LEN(uints); k++)
        hm_wire_wr_uint(&w, uints[k]);
    for (size_t k = 0; k < HM_ARRAY_LEN(ints); k++)
        hm_wire_wr_int(&w, ints[k]);
    for (size_t k = 0; k < HM_ARRAY_LEN(dbls); k++)
        hm_wire_wr_double(&w, dbls[k]);
    hm_wire_wr_double(&w, NAN);
    hm_wire_wr_bool(&w, 1);
    hm_wire_wr_bool(&w, 0);
    hm_wire_wr_nil(&w);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    buf = hm_wire_wr_steal(&w, &len);
    cr_assert_not_null(buf);

    msgpack_zone_init(&z, 1024);
    o = unpack_ok(&z, buf, len);
    cr_assert_eq(hm_wire_get_array(&o, 0, 0, &items, &n), 0);
    cr_assert_eq(n, HM_ARRAY_LEN(uints) + HM_ARRAY_LEN(ints) + HM_ARRAY_LEN(dbls) + 4);
    for (size_t k = 0; k < HM_ARRAY_LEN(uints); k++, i++) {
        uint64_t u;
        cr_assert_eq(hm_wire_get_uint(&items[i], &u), 0);
        cr_assert_eq(u, uints[k]);
    }
    for (size_t k = 0; k < HM_ARRAY_LEN(ints); k++, i++) {
        int64_t v;
        cr_assert_eq(hm_wire_get_int(&items[i], &v), 0, "int %zu", k);
        cr_assert_eq(v, ints[k]);
    }
    for (size_t k = 0; k < HM_ARRAY_LEN(dbls); k++, i++) {
        double d;
        cr_assert_eq(hm_wire_get_double(&items[i], &d), 0);
        cr_assert_eq(memcmp(&d, &dbls[k], sizeof(d)), 0, "double %zu", k);
    }
    {
        double d;
        int bv;
        cr_assert_eq(hm_wire_get_double(&items[i++], &d), 0);
        cr_assert(isnan(d));
        cr_assert_eq(hm_wire_get_bool(&items[i++], &bv), 0);
        cr_assert_eq(bv, 1);
        cr_assert_eq(hm_wire_get_bool(&items[i++], &bv), 0);
        cr_assert_eq(bv, 0);
        cr_assert_eq(items[i++].type, MSGPACK_OBJECT_NIL);
    }
    msgpack_zone_destroy(&z);
    free(buf);
}

Test(wire, strings_and_bins_of_every_length_class)
{
    /* Lengths straddle each msgpack header size: fix, 8-, 16- and 32-bit. */
    static const size_t lens[] = {0, 1, 31, 32, 255, 256, 65535, 65536, 70000};
    char *src = malloc(70000);
    cr_assert_not_null(src);
    for (size_t i = 0; i < 70000; i++)
        src[i] = (char)('a' + i % 26);

    for (size_t k = 0; k < HM_ARRAY_LEN(lens); k++) {
        hm_wire_wr w;
        msgpack_zone z;
        msgpack_object o;
        const msgpack_object *items;
        const char *sp;
        const uint8_t *bp;
        uint32_t sl, bl;
        size_t len;
        uint8_t *buf;

        hm_wire_wr_init_dynamic(&w, 1 << 20);
        hm_wire_wr_array(&w, 2);
        hm_wire_wr_str(&w, src, lens[k]);
        hm_wire_wr_bin(&w, src, lens[k]);
        buf = hm_wire_wr_steal(&w, &len);
        cr_assert_not_null(buf);
        msgpack_zone_init(&z, 1024);
        o = unpack_ok(&z, buf, len);
        cr_assert_eq(hm_wire_get_array(&o, 2, 2, &items, NULL), 0);
        cr_assert_eq(hm_wire_get_str(&items[0], &sp, &sl), 0);
        cr_assert_eq(hm_wire_get_bin(&items[1], &bp, &bl), 0);
        cr_assert_eq(sl, lens[k]);
        cr_assert_eq(bl, lens[k]);
        cr_assert_eq(memcmp(sp, src, sl), 0);
        cr_assert_eq(memcmp(bp, src, bl), 0);
        /* str and bin point into the frame rather than into copies. */
        cr_assert_not_null(sp);
        cr_assert_not_null(bp);
        if (lens[k] > 0) {
            cr_assert(sp >= (const char *)buf && sp + sl <= (const char *)buf + len);
            cr_assert(bp >= buf && bp + bl <= buf + len);
        }
        msgpack_zone_destroy(&z);
        free(buf);
    }
    free(src);
}

Test(wire, containers_round_trip_and_map_lookup)
{
    static const uint32_t sizes[] = {0, 1, 15, 16, 65535, 65536};
    hm_wire_limits lim = {.max_size = 1 << 20, .max_depth = 4, .max_elements = 300000};

    for (size_t k = 0; k < HM_ARRAY_LEN(sizes); k++) {
        hm_wire_wr w;
        msgpack_zone z;
        msgpack_object o;
        const msgpack_object *items;
        uint32_t n;
        size_t len;
        uint8_t *buf;

        hm_wire_wr_init_dynamic(&w, 1 << 20);
        hm_wire_wr_array(&w, 2);
        hm_wire_wr_array(&w, sizes[k]);
        for (uint32_t i = 0; i < sizes[k]; i++)
            hm_wire_wr_uint(&w, i % 100);
        hm_wire_wr_map(&w, sizes[k]);
        for (uint32_t i = 0; i < sizes[k]; i++) {
            hm_wire_wr_uint(&w, i);
            hm_wire_wr_int(&w, -(int64_t)i);
        }
        buf = hm_wire_wr_steal(&w, &len);
        cr_assert_not_null(buf);
        msgpack_zone_init(&z, 4096);
        cr_assert_eq(hm_wire_unpack(buf, len, &lim, &z, &o), 0, "size %u", sizes[k]);
        cr_assert_eq(hm_wire_get_array(&o, 2, 2, &items, NULL), 0);
        cr_assert_eq(hm_wire_get_array(&items[0], 0, 0, NULL, &n), 0);
        cr_assert_eq(n, sizes[k]);
        cr_assert_eq(items[1].type, MSGPACK_OBJECT_MAP);
        cr_assert_eq(items[1].via.map.size, sizes[k]);
        for (uint32_t i = 0; i < sizes[k]; i++) {
            uint64_t u;
            int64_t v;
            cr_assert_eq(hm_wire_get_uint(&items[0].via.array.ptr[i], &u), 0);
            cr_assert_eq(u, i % 100);
            cr_assert_eq(hm_wire_get_uint(&items[1].via.map.ptr[i].key, &u), 0);
            cr_assert_eq(hm_wire_get_int(&items[1].via.map.ptr[i].val, &v), 0);
            cr_assert_eq(u, i);
            cr_assert_eq(v, -(int64_t)i);
        }
        msgpack_zone_destroy(&z);
        free(buf);
    }
}

Test(wire, map_get_and_array_bounds)
{
    hm_wire_wr w;
    msgpack_zone z;
    msgpack_object o;
    const msgpack_object *v;
    uint8_t buf[256];
    int64_t i;
    const char *s;
    uint32_t sl;

    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_map(&w, 5);
    hm_wire_wr_uint(&w, 7); /* a non-string key is skipped by lookups */
    hm_wire_wr_cstr(&w, "seven");
    hm_wire_wr_cstr(&w, "id");
    hm_wire_wr_int(&w, -42);
    hm_wire_wr_cstr(&w, "");
    hm_wire_wr_cstr(&w, "empty key");
    hm_wire_wr_cstr(&w, "args");
    hm_wire_wr_array(&w, 3);
    hm_wire_wr_nil(&w);
    hm_wire_wr_nil(&w);
    hm_wire_wr_nil(&w);
    hm_wire_wr_cstr(&w, "id");
    hm_wire_wr_int(&w, 99);
    cr_assert_eq(hm_wire_wr_error(&w), 0);

    msgpack_zone_init(&z, 1024);
    o = unpack_ok(&z, buf, w.len);
    v = hm_wire_map_get(&o, "id");
    cr_assert_not_null(v);
    cr_assert_eq(hm_wire_get_int(v, &i), 0);
    cr_assert_eq(i, -42, "the first of duplicated keys wins");
    v = hm_wire_map_get(&o, "");
    cr_assert_not_null(v);
    cr_assert_eq(hm_wire_get_str(v, &s, &sl), 0);
    cr_assert_eq(sl, 9);
    cr_assert_null(hm_wire_map_get(&o, "i"));
    cr_assert_null(hm_wire_map_get(&o, "seven"));
    cr_assert_null(hm_wire_map_get(&o, "idx"));
    v = hm_wire_map_get(&o, "args");
    cr_assert_not_null(v);
    cr_assert_null(hm_wire_map_get(v, "id"), "an array is not a map");
    cr_assert_eq(hm_wire_get_array(v, 3, 3, NULL, NULL), 0);
    cr_assert_eq(hm_wire_get_array(v, 1, 5, NULL, NULL), 0);
    cr_assert_eq(hm_wire_get_array(v, 4, 4, NULL, NULL), -EPROTO);
    cr_assert_eq(hm_wire_get_array(v, 0, 2, NULL, NULL), -EPROTO);
    cr_assert_eq(hm_wire_get_array(v, 4, 0, NULL, NULL), -EPROTO);
    cr_assert_eq(hm_wire_get_array(&o, 0, 0, NULL, NULL), -EPROTO, "a map is not an array");
    msgpack_zone_destroy(&z);
}

Test(wire, typed_getters_reject_wrong_types)
{
    /* [nil, true, 5, -5, 1.5 (f32), "s", bin "b", [], {}, 2^64-1] */
    static const uint8_t frame[] = {0x9a, 0xc0, 0xc3, 0x05, 0xfb, 0xca, 0x3f, 0xc0, 0x00, 0x00,
                                    0xa1, 's',  0xc4, 0x01, 'b',  0x90, 0x80, 0xcf, 0xff, 0xff,
                                    0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    msgpack_zone z;
    msgpack_object o;
    const msgpack_object *it;
    uint64_t u;
    int64_t i;
    double d;
    int b;
    const char *s;
    const uint8_t *p;
    uint32_t l;

    msgpack_zone_init(&z, 1024);
    o = unpack_ok(&z, frame, sizeof(frame));
    cr_assert_eq(hm_wire_get_array(&o, 10, 10, &it, NULL), 0);

    /* uint accepts only non-negative integers. */
    cr_assert_eq(hm_wire_get_uint(&it[2], &u), 0);
    for (int k = 0; k < 10; k++)
        if (k != 2 && k != 9)
            cr_assert_eq(hm_wire_get_uint(&it[k], &u), -EPROTO, "uint on item %d", k);
    /* int accepts both signs but not values beyond INT64_MAX. */
    cr_assert_eq(hm_wire_get_int(&it[3], &i), 0);
    cr_assert_eq(i, -5);
    cr_assert_eq(hm_wire_get_int(&it[9], &i), -EPROTO);
    cr_assert_eq(hm_wire_get_int(&it[4], &i), -EPROTO);
    cr_assert_eq(hm_wire_get_int(&it[5], &i), -EPROTO);
    /* double accepts floats (f32 too) and integers, nothing else. */
    cr_assert_eq(hm_wire_get_double(&it[4], &d), 0);
    cr_assert_eq(d, 1.5);
    cr_assert_eq(hm_wire_get_double(&it[3], &d), 0);
    cr_assert_eq(d, -5.0);
    cr_assert_eq(hm_wire_get_double(&it[1], &d), -EPROTO);
    cr_assert_eq(hm_wire_get_double(&it[5], &d), -EPROTO);
    cr_assert_eq(hm_wire_get_double(&it[0], &d), -EPROTO);
    /* bool is only a bool (not nil, not 0/1). */
    cr_assert_eq(hm_wire_get_bool(&it[1], &b), 0);
    cr_assert_eq(b, 1);
    cr_assert_eq(hm_wire_get_bool(&it[0], &b), -EPROTO);
    cr_assert_eq(hm_wire_get_bool(&it[2], &b), -EPROTO);
    /* str and bin are distinct. */
    cr_assert_eq(hm_wire_get_str(&it[5], &s, &l), 0);
    cr_assert_eq(hm_wire_get_str(&it[6], &s, &l), -EPROTO);
    cr_assert_eq(hm_wire_get_bin(&it[6], &p, &l), 0);
    cr_assert_eq(hm_wire_get_bin(&it[5], &p, &l), -EPROTO);
    cr_assert_eq(hm_wire_get_bin(&it[7], &p, &l), -EPROTO);
    cr_assert_eq(hm_wire_get_array(&it[8], 0, 0, NULL, NULL), -EPROTO);
    cr_assert_eq(hm_wire_get_array(&it[7], 0, 0, NULL, NULL), 0);
    cr_assert_null(hm_wire_map_get(&it[7], "x"));
    cr_assert_null(hm_wire_map_get(&it[8], "x"));
    cr_assert_eq(hm_wire_get_tensor(&it[7], 100, NULL), -EPROTO);
    msgpack_zone_destroy(&z);
}

/* ---- writer bounds ---- */

Test(wire, fixed_writer_stops_at_its_buffer)
{
    uint8_t buf[8];
    hm_wire_wr w;

    memset(buf, 0xee, sizeof(buf));
    hm_wire_wr_init_fixed(&w, buf, 6);
    hm_wire_wr_array(&w, 2);
    hm_wire_wr_uint(&w, 1);
    hm_wire_wr_cstr(&w, "toolong");
    hm_wire_wr_uint(&w, 2); /* ignored after the error */
    cr_assert_eq(hm_wire_wr_error(&w), -EMSGSIZE);
    cr_assert_leq(w.len, 6);
    cr_assert_eq(buf[6], 0xee, "nothing is written past the cap");
    cr_assert_eq(buf[7], 0xee);
    cr_assert_null(hm_wire_wr_steal(&w, NULL), "a fixed buffer is not handed over");
    cr_assert_eq(hm_wire_wr_error(&w), -EMSGSIZE, "and the fixed writer is left as it was");
}

Test(wire, dynamic_writer_grows_to_its_cap_only)
{
    hm_wire_wr w;
    uint8_t *buf;
    size_t len;
    static const char blob[1000];

    hm_wire_wr_init_dynamic(&w, 3000);
    hm_wire_wr_bin(&w, blob, sizeof(blob));
    hm_wire_wr_bin(&w, blob, sizeof(blob));
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    cr_assert_leq(w.cap, 3000);
    hm_wire_wr_bin(&w, blob, sizeof(blob));
    cr_assert_eq(hm_wire_wr_error(&w), -EMSGSIZE);
    cr_assert_leq(w.cap, 3000);
    cr_assert_null(hm_wire_wr_steal(&w, &len), "a failed writer hands back nothing");
    cr_assert_eq(len, 0);

    /* After steal the writer is empty and usable again. */
    hm_wire_wr_nil(&w);
    buf = hm_wire_wr_steal(&w, &len);
    cr_assert_not_null(buf);
    cr_assert_eq(len, 1);
    cr_assert_eq(buf[0], 0xc0);
    free(buf);

    buf = hm_wire_wr_steal(&w, &len);
    cr_assert_not_null(buf, "an empty writer still returns a buffer");
    cr_assert_eq(len, 0);
    free(buf);

    /* Exactly at the cap is fine. */
    hm_wire_wr_init_dynamic(&w, 1003);
    hm_wire_wr_bin(&w, blob, sizeof(blob));
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    cr_assert_eq(w.len, 1003);
    hm_wire_wr_raw(&w, "\xc0", 1);
    cr_assert_eq(hm_wire_wr_error(&w), -EMSGSIZE);
    hm_wire_wr_free(&w);
}

/* ---- hostile frames ---- */

/* A frame that uses every type the codec accepts, nested. */
static uint8_t *rich_frame(size_t *len_out)
{
    hm_wire_wr w;
    uint8_t data[300];
    uint8_t *buf;

    for (size_t i = 0; i < sizeof(data); i++)
        data[i] = (uint8_t)i;
    hm_wire_wr_init_dynamic(&w, 4096);
    hm_wire_wr_map(&w, 4);
    hm_wire_wr_cstr(&w, "scalars");
    hm_wire_wr_array(&w, 9);
    hm_wire_wr_nil(&w);
    hm_wire_wr_bool(&w, 1);
    hm_wire_wr_uint(&w, 200);
    hm_wire_wr_uint(&w, 70000);
    hm_wire_wr_uint(&w, UINT64_MAX);
    hm_wire_wr_int(&w, -100);
    hm_wire_wr_int(&w, -40000);
    hm_wire_wr_double(&w, 3.25);
    hm_wire_wr_raw(&w, "\xca\x40\x00\x00\x00", 5); /* float32 2.0 */
    hm_wire_wr_cstr(&w, "bytes");
    hm_wire_wr_array(&w, 3);
    hm_wire_wr_str(&w, (const char *)data, 40);
    hm_wire_wr_bin(&w, data, 300);
    hm_wire_wr_str(&w, (const char *)data, 3);
    hm_wire_wr_cstr(&w, "nested");
    hm_wire_wr_array(&w, 1);
    hm_wire_wr_array(&w, 2);
    hm_wire_wr_map(&w, 0);
    hm_wire_wr_array(&w, 0);
    hm_wire_wr_uint(&w, 3);
    hm_wire_wr_array(&w, 20);
    for (int i = 0; i < 20; i++)
        hm_wire_wr_int(&w, -i);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    buf = hm_wire_wr_steal(&w, len_out);
    cr_assert_not_null(buf);
    return buf;
}

Test(wire, every_truncation_is_rejected)
{
    size_t len, used;
    uint8_t *frame = rich_frame(&len);
    msgpack_zone z;
    msgpack_object o;
    hm_wire_limits tight = {.max_size = len, .max_depth = 4, .max_elements = 44};

    cr_assert_eq(hm_wire_validate(frame, len, &tight, &used), 0);
    cr_assert_eq(used, len);
    /* The frame sits exactly at each cap: one less of any is refused. */
    {
        hm_wire_limits less = tight;
        less.max_elements--;
        cr_assert_eq(hm_wire_validate(frame, len, &less, &used), -EMSGSIZE);
        less = tight;
        less.max_depth--;
        cr_assert_eq(hm_wire_validate(frame, len, &less, &used), -EMSGSIZE);
        less = tight;
        less.max_size--;
        cr_assert_eq(hm_wire_validate(frame, len, &less, &used), -EMSGSIZE);
    }
    msgpack_zone_init(&z, 1024);
    for (size_t cut = 0; cut < len; cut++) {
        /* Copy so that ASan sees any read past the truncated end. */
        uint8_t *copy = malloc(cut ? cut : 1);
        memcpy(copy, frame, cut);
        cr_assert_eq(hm_wire_validate(copy, cut, NULL, &used), -EINVAL, "cut at %zu", cut);
        cr_assert_eq(hm_wire_validate(copy, cut, &tight, &used), -EINVAL, "cut at %zu", cut);
        cr_assert_eq(hm_wire_unpack(copy, cut, NULL, &z, &o), -EINVAL, "cut at %zu", cut);
        free(copy);
    }
    msgpack_zone_destroy(&z);
    free(frame);
}

Test(wire, trailing_bytes)
{
    size_t len, used;
    uint8_t *frame = rich_frame(&len);
    uint8_t *longer = malloc(len + 1);
    msgpack_zone z;
    msgpack_object o;

    memcpy(longer, frame, len);
    longer[len] = 0xc0;
    /* validate reports where the first object ends; unpack wants exactly one. */
    cr_assert_eq(hm_wire_validate(longer, len + 1, NULL, &used), 0);
    cr_assert_eq(used, len);
    msgpack_zone_init(&z, 1024);
    cr_assert_eq(hm_wire_unpack(longer, len + 1, NULL, &z, &o), -EINVAL);
    cr_assert_eq(hm_wire_unpack(frame, len, NULL, &z, &o), 0);
    msgpack_zone_destroy(&z);
    free(longer);
    free(frame);
}

struct hostile {
    const char *name;
    const uint8_t *bytes;
    size_t len;
    int want;
};

#define H(name_, want_, ...)                                                                  \
    {                                                                                         \
        name_, (const uint8_t[]){__VA_ARGS__}, sizeof((const uint8_t[]){__VA_ARGS__}), want_  \
    }

static const struct hostile hostile_frames[] = {
    /* Counts and lengths that no frame under the cap could hold. */
    H("array32 of 2^32-1", -EMSGSIZE, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x00, 0x00),
    H("map32 of 2^32-1", -EMSGSIZE, 0xdf, 0xff, 0xff, 0xff, 0xff, 0x00, 0x00),
    H("str32 of 4 GiB", -EMSGSIZE, 0xdb, 0xff, 0xff, 0xff, 0xff, 'a'),
    H("bin32 of 4 GiB", -EMSGSIZE, 0xc6, 0xff, 0xff, 0xff, 0xff, 0x00),
    H("bin32 of 2 MiB", -EMSGSIZE, 0xc6, 0x00, 0x20, 0x00, 0x00, 0x00),
    H("array16 of 65535 nested", -EMSGSIZE, 0x91, 0xdc, 0xff, 0xff, 0xc0),
    H("array32 of 70000 elements", -EMSGSIZE, 0xdd, 0x00, 0x01, 0x11, 0x70, 0xc0),
    H("map16 of 40000 entries", -EMSGSIZE, 0xde, 0x9c, 0x40, 0xc0, 0xc0),
    /* Counts and lengths within the caps but beyond the bytes sent. */
    H("array16 of 300, 3 sent", -EINVAL, 0xdc, 0x01, 0x2c, 0xc0, 0xc0, 0xc0),
    H("fixarray of 15, 1 sent", -EINVAL, 0x9f, 0xc0),
    H("fixmap of 1, key only", -EINVAL, 0x81, 0xc0),
    H("str8 of 200, 3 sent", -EINVAL, 0xd9, 0xc8, 'a', 'b', 'c'),
    H("str16 of 1000, 1 sent", -EINVAL, 0xda, 0x03, 0xe8, 'a'),
    H("bin8 of 2, 1 sent", -EINVAL, 0xc4, 0x02, 0x00),
    H("bin16 header cut", -EINVAL, 0xc5, 0x01),
    H("uint64 cut", -EINVAL, 0xcf, 0x00, 0x00, 0x00),
    H("float64 cut", -EINVAL, 0xcb, 0x00),
    H("fixstr cut", -EINVAL, 0xa5, 'a', 'b'),
    H("empty", -EINVAL),
    /* Reserved and ext types. */
    H("reserved 0xc1", -EINVAL, 0xc1),
    H("reserved 0xc1 nested", -EINVAL, 0x92, 0x01, 0xc1),
    H("reserved 0xc1 as map key", -EINVAL, 0x81, 0xc1, 0x00),
    H("ext8", -EINVAL, 0xc7, 0x01, 0x05, 0x00),
    H("ext16", -EINVAL, 0xc8, 0x00, 0x01, 0x05, 0x00),
    H("ext32", -EINVAL, 0xc9, 0x00, 0x00, 0x00, 0x01, 0x05, 0x00),
    H("fixext1", -EINVAL, 0xd4, 0x05, 0x00),
    H("fixext2", -EINVAL, 0xd5, 0x05, 0x00, 0x00),
    H("fixext4", -EINVAL, 0xd6, 0xff, 0x00, 0x00, 0x00, 0x00),
    H("fixext8", -EINVAL, 0xd7, 0x05, 0, 0, 0, 0, 0, 0, 0, 0),
    H("fixext16", -EINVAL, 0xd8, 0x05, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
    H("timestamp ext in a map", -EINVAL, 0x81, 0xa1, 't', 0xd6, 0xff, 0, 0, 0, 1),
    /* Trailing garbage after a complete object. */
    H("trailing byte", -EINVAL, 0x92, 0x01, 0x02, 0x03),
    H("two objects", -EINVAL, 0xc0, 0xc0),
};

Test(wire, hostile_frame_table)
{
    msgpack_zone z;

    msgpack_zone_init(&z, 1024);
    for (size_t i = 0; i < HM_ARRAY_LEN(hostile_frames); i++) {
        const struct hostile *h = &hostile_frames[i];
        uint8_t *copy = malloc(h->len ? h->len : 1);
        msgpack_object o;
        size_t before = z.chunk_list.free;

        memcpy(copy, h->bytes, h->len);
        cr_assert_eq(hm_wire_unpack(copy, h->len, NULL, &z, &o), h->want,
                     "%s: got %d, want %d", h->name, hm_wire_unpack(copy, h->len, NULL, &z, &o),
                     h->want);
        cr_assert_eq(z.chunk_list.free, before, "%s: nothing was unpacked into the zone",
                     h->name);
        free(copy);
    }
    msgpack_zone_destroy(&z);
}

/* Builds `depth` nested one-element arrays around a nil. */
static struct bytes nested(unsigned depth, uint8_t open)
{
    struct bytes b = {0};
    for (unsigned i = 0; i < depth; i++)
        put1(&b, open);
    put1(&b, 0xc0);
    return b;
}

Test(wire, depth_is_capped)
{
    msgpack_zone z;
    msgpack_object o;
    hm_wire_limits deep = {.max_size = 1 << 20, .max_depth = 1000, .max_elements = 65536};

    msgpack_zone_init(&z, 1024);
    for (unsigned d = 0; d <= 40; d++) {
        struct bytes arr = nested(d, 0x91);
        struct bytes map = {0};
        struct bytes empty = nested(d > 0 ? d - 1 : 0, 0x91);
        int want_default = d <= 16 ? 0 : -EMSGSIZE;
        int want_deep = d <= HM_WIRE_MAX_DEPTH ? 0 : -EMSGSIZE;

        /* Maps nest through their values: {nil: {nil: ... nil}}. */
        for (unsigned i = 0; i < d; i++) {
            put1(&map, 0x81);
            put1(&map, 0xc0);
        }
        put1(&map, 0xc0);
        /* An empty container at the bottom still counts as a level. */
        if (d > 0)
            empty.p[empty.len - 1] = 0x90;

        cr_assert_eq(hm_wire_unpack(arr.p, arr.len, NULL, &z, &o), want_default, "array %u", d);
        cr_assert_eq(hm_wire_unpack(map.p, map.len, NULL, &z, &o), want_default, "map %u", d);
        cr_assert_eq(hm_wire_unpack(empty.p, empty.len, NULL, &z, &o), want_default,
                     "empty %u", d);
        /* Beyond 32 levels msgpack-c itself cannot unpack, so the cap is 32. */
        cr_assert_eq(hm_wire_unpack(arr.p, arr.len, &deep, &z, &o), want_deep, "deep %u", d);
        cr_assert_eq(hm_wire_unpack(empty.p, empty.len, &deep, &z, &o), want_deep,
                     "deep empty %u", d);
        if (d == HM_WIRE_MAX_DEPTH) {
            const msgpack_object *p = &o;
            for (unsigned i = 0; i + 1 < d; i++) {
                cr_assert_eq(p->type, MSGPACK_OBJECT_ARRAY);
                cr_assert_eq(p->via.array.size, 1);
                p = &p->via.array.ptr[0];
            }
            cr_assert_eq(p->type, MSGPACK_OBJECT_ARRAY, "the innermost [] survives");
            cr_assert_eq(p->via.array.size, 0);
        }
        free(arr.p);
        free(map.p);
        free(empty.p);
    }
    msgpack_zone_destroy(&z);
}

Test(wire, element_count_is_capped)
{
    hm_wire_limits lim = {.max_size = 1 << 20, .max_depth = 16, .max_elements = 1000};
    msgpack_zone z;
    msgpack_object o;
    size_t used;
    struct bytes b = {0};

    msgpack_zone_init(&z, 1024);
    /* 999 elements plus the array itself is exactly the cap. */
    put1(&b, 0xdc);
    put_be(&b, 999, 2);
    put_fill(&b, 0xc0, 999);
    cr_assert_eq(hm_wire_unpack(b.p, b.len, &lim, &z, &o), 0);
    b.len = 0;
    put1(&b, 0xdc);
    put_be(&b, 1000, 2);
    put_fill(&b, 0xc0, 1000);
    cr_assert_eq(hm_wire_unpack(b.p, b.len, &lim, &z, &o), -EMSGSIZE);
    /* Counted across many small containers too: 200 x [nil x 4] is 1001 objects. */
    b.len = 0;
    put1(&b, 0xdc);
    put_be(&b, 200, 2);
    for (int i = 0; i < 200; i++) {
        put1(&b, 0x94);
        put_fill(&b, 0xc0, 4);
    }
    cr_assert_eq(hm_wire_unpack(b.p, b.len, &lim, &z, &o), -EMSGSIZE);
    cr_assert_eq(hm_wire_validate(b.p, b.len, NULL, &used), 0, "fine under the default cap");
    /* A map's entries count twice (key and value). */
    b.len = 0;
    put1(&b, 0xde);
    put_be(&b, 500, 2);
    put_fill(&b, 0x00, 1000);
    cr_assert_eq(hm_wire_unpack(b.p, b.len, &lim, &z, &o), -EMSGSIZE);
    b.len = 0;
    put1(&b, 0xde);
    put_be(&b, 499, 2);
    put_fill(&b, 0x00, 998);
    cr_assert_eq(hm_wire_unpack(b.p, b.len, &lim, &z, &o), 0);
    /* The default cap rejects a bomb of 1-byte elements that fits 1 MiB. */
    b.len = 0;
    put1(&b, 0xdd);
    put_be(&b, 500000, 4);
    put_fill(&b, 0xc0, 500000);
    cr_assert_eq(hm_wire_unpack(b.p, b.len, NULL, &z, &o), -EMSGSIZE);
    msgpack_zone_destroy(&z);
    free(b.p);
}

Test(wire, frame_size_is_capped)
{
    hm_wire_limits lim = {.max_size = 100, .max_depth = 16, .max_elements = 1000};
    msgpack_zone z;
    msgpack_object o;
    size_t used;
    struct bytes b = {0};

    msgpack_zone_init(&z, 1024);
    /* A str of 97 bytes makes a 99-byte frame; 98 makes 100; 99 makes 101. */
    for (int n = 97; n <= 99; n++) {
        b.len = 0;
        put1(&b, 0xd9);
        put1(&b, (uint8_t)n);
        put_fill(&b, 'x', (size_t)n);
        cr_assert_eq(hm_wire_unpack(b.p, b.len, &lim, &z, &o), n <= 98 ? 0 : -EMSGSIZE);
        /* Even when only the header has arrived, an oversize frame is over the cap. */
        cr_assert_eq(hm_wire_validate(b.p, 2, &lim, &used), n <= 98 ? -EINVAL : -EMSGSIZE);
    }
    /*
     * An array announcing more elements than the cap has bytes is over the
     * cap as soon as its header is read, before any element arrives.
     */
    b.len = 0;
    put1(&b, 0xdc);
    put_be(&b, 500, 2);
    put_fill(&b, 0xc0, 10);
    cr_assert_eq(hm_wire_validate(b.p, 3, &lim, &used), -EMSGSIZE);
    cr_assert_eq(hm_wire_validate(b.p, b.len, &lim, &used), -EMSGSIZE);
    b.len = 0;
    put1(&b, 0xdc);
    put_be(&b, 97, 2);
    put_fill(&b, 0xc0, 10);
    cr_assert_eq(hm_wire_validate(b.p, b.len, &lim, &used), -EINVAL, "97 fit: only truncated");
    /* A buffer longer than the cap holding one small object validates... */
    b.len = 0;
    put1(&b, 0xc3);
    put_fill(&b, 0, 200);
    cr_assert_eq(hm_wire_validate(b.p, b.len, &lim, &used), 0);
    cr_assert_eq(used, 1);
    /* ...but is not a frame. */
    cr_assert_eq(hm_wire_unpack(b.p, b.len, &lim, &z, &o), -EMSGSIZE);
    /* The default cap is 1 MiB. */
    b.len = 0;
    put1(&b, 0xc6);
    put_be(&b, (1 << 20) - 5, 4);
    put_fill(&b, 0, (1 << 20) - 5);
    cr_assert_eq(hm_wire_unpack(b.p, b.len, NULL, &z, &o), 0);
    b.len = 0;
    put1(&b, 0xc6);
    put_be(&b, (1 << 20) - 4, 4);
    put_fill(&b, 0, (1 << 20) - 4);
    cr_assert_eq(hm_wire_unpack(b.p, b.len, NULL, &z, &o), -EMSGSIZE);
    msgpack_zone_destroy(&z);
    free(b.p);
}

/* ---- allocation bound ---- */

/*
 * Unpacks buf into a fresh zone and checks that the heap grew by at most
 * 64 bytes per frame byte plus 32 KiB (the zone's first chunk and malloc's
 * bookkeeping), whatever the outcome. Returns the unpack result.
 */
static int unpack_bounded(const uint8_t *buf, size_t len)
{
    size_t before = heap_in_use();
    size_t peak;
    msgpack_zone *z = msgpack_zone_new(MSGPACK_ZONE_CHUNK_SIZE);
    msgpack_object o;
    int rc;

    cr_assert_not_null(z);
    rc = hm_wire_unpack(buf, len, NULL, z, &o);
    peak = heap_in_use();
    cr_assert_leq(peak - before, 64 * len + 32768,
                  "unpacking %zu bytes (rc %d) took %zu bytes of heap", len, rc, peak - before);
    msgpack_zone_free(z);
    return rc;
}

Test(wire, unpack_allocation_is_bounded_by_frame_size)
{
    struct bytes b = {0};

    /* Hostile headers: nothing beyond the zone itself. */
    for (size_t i = 0; i < HM_ARRAY_LEN(hostile_frames); i++)
        unpack_bounded(hostile_frames[i].bytes, hostile_frames[i].len);

    /* The densest valid frames msgpack-c allocates most for. */
    /* One array of 65535 one-byte elements. */
    put1(&b, 0xdc);
    put_be(&b, 65535, 2);
    put_fill(&b, 0x00, 65535);
    cr_assert_eq(unpack_bounded(b.p, b.len), 0);
    /* A map of 32767 one-byte keys and values. */
    b.len = 0;
    put1(&b, 0xde);
    put_be(&b, 32767, 2);
    put_fill(&b, 0x00, 2 * 32767);
    cr_assert_eq(unpack_bounded(b.p, b.len), 0);
    /* Many one-element arrays: [[0], [0], ...]. */
    b.len = 0;
    put1(&b, 0xdc);
    put_be(&b, 30000, 2);
    for (int i = 0; i < 30000; i++) {
        put1(&b, 0x91);
        put1(&b, 0x00);
    }
    cr_assert_eq(unpack_bounded(b.p, b.len), 0);
    /*
     * Arrays sized so that each takes just over half a zone chunk, the
     * pattern that wastes the most of each chunk.
     */
    b.len = 0;
    put1(&b, 0xdc);
    put_be(&b, 300, 2);
    for (int i = 0; i < 300; i++) {
        put1(&b, 0xdc);
        put_be(&b, 171, 2);
        put_fill(&b, 0xc0, 171);
    }
    cr_assert_eq(unpack_bounded(b.p, b.len), 0);
    /* The same bomb headers followed by as much filler as the cap allows. */
    b.len = 0;
    put1(&b, 0xdd);
    put_be(&b, 0xffffffffu, 4);
    put_fill(&b, 0xc0, 60000);
    cr_assert_eq(unpack_bounded(b.p, b.len), -EMSGSIZE);
    free(b.p);
}

/* ---- tensors ---- */

Test(wire, tensors_round_trip_in_every_dtype)
{
    static const int dtypes[] = {HM_DTYPE_F32, HM_DTYPE_F16, HM_DTYPE_BF16, HM_DTYPE_U8};
    static const size_t sizes[] = {4, 2, 2, 1};
    uint8_t data[2 * 3 * 5 * 4];

    for (size_t i = 0; i < sizeof(data); i++)
        data[i] = (uint8_t)(i * 7);
    for (size_t k = 0; k < HM_ARRAY_LEN(dtypes); k++) {
        hm_wire_tensor t = {.dtype = (uint8_t)dtypes[k], .ndim = 3, .shape = {2, 3, 5},
                            .data = data, .nbytes = 30 * sizes[k]};
        hm_wire_tensor got;
        hm_wire_wr w;
        uint8_t buf[256];
        msgpack_zone z;
        msgpack_object o;

        cr_assert_eq(hm_dtype_size(dtypes[k]), sizes[k]);
        hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
        hm_wire_wr_tensor(&w, &t);
        cr_assert_eq(hm_wire_wr_error(&w), 0);
        msgpack_zone_init(&z, 1024);
        o = unpack_ok(&z, buf, w.len);
        cr_assert_eq(hm_wire_get_tensor(&o, 1000, &got), 0);
        cr_assert_eq(got.dtype, dtypes[k]);
        cr_assert_eq(got.ndim, 3);
        cr_assert_eq(got.shape[0], 2);
        cr_assert_eq(got.shape[1], 3);
        cr_assert_eq(got.shape[2], 5);
        cr_assert_eq(got.shape[3], 0);
        cr_assert_eq(got.nbytes, t.nbytes);
        cr_assert_eq(memcmp(got.data, data, got.nbytes), 0);
        cr_assert(got.data >= buf && got.data + got.nbytes <= buf + w.len,
                  "tensor data points into the frame");
        /* The element cap applies to the count, not to bytes. */
        cr_assert_eq(hm_wire_get_tensor(&o, 30, &got), 0);
        cr_assert_eq(hm_wire_get_tensor(&o, 29, &got), -EMSGSIZE);
        msgpack_zone_destroy(&z);
    }
    cr_assert_eq(hm_dtype_size(4), 0);
    cr_assert_eq(hm_dtype_size(-1), 0);
}

Test(wire, tensor_edge_shapes)
{
    /* A scalar (no dims) holds one element; a zero dim holds none. */
    uint8_t one[4] = {1, 2, 3, 4};
    hm_wire_tensor scalar = {.dtype = HM_DTYPE_F32, .ndim = 0, .data = one, .nbytes = 4};
    hm_wire_tensor empty = {.dtype = HM_DTYPE_U8, .ndim = 2, .shape = {0, 7}, .nbytes = 0};
    hm_wire_tensor got;
    hm_wire_wr w;
    msgpack_zone z;
    msgpack_object o;
    uint8_t buf[64];

    msgpack_zone_init(&z, 1024);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_tensor(&w, &scalar);
    o = unpack_ok(&z, buf, w.len);
    cr_assert_eq(hm_wire_get_tensor(&o, 1, &got), 0);
    cr_assert_eq(got.ndim, 0);
    cr_assert_eq(got.nbytes, 4);

    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_tensor(&w, &empty);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    o = unpack_ok(&z, buf, w.len);
    cr_assert_eq(hm_wire_get_tensor(&o, 0, &got), -EMSGSIZE, "a dim of 7 is over a cap of 0");
    cr_assert_eq(hm_wire_get_tensor(&o, 7, &got), 0);
    cr_assert_eq(got.nbytes, 0);
    msgpack_zone_destroy(&z);
}

Test(wire, writer_refuses_inconsistent_tensors)
{
    uint8_t data[16] = {0};
    hm_wire_tensor bad[] = {
        {.dtype = HM_DTYPE_F32, .ndim = 1, .shape = {4}, .data = data, .nbytes = 15},
        {.dtype = 9, .ndim = 1, .shape = {4}, .data = data, .nbytes = 16},
        {.dtype = HM_DTYPE_U8, .ndim = 9, .shape = {1, 1, 1, 1, 1, 1, 1, 1}, .data = data,
         .nbytes = 1},
        {.dtype = HM_DTYPE_U8, .ndim = 2, .shape = {1ull << 32, 1ull << 32}, .data = data,
         .nbytes = 0},
        {.dtype = HM_DTYPE_U8, .ndim = 1, .shape = {4}, .data = NULL, .nbytes = 4},
    };

    for (size_t i = 0; i < HM_ARRAY_LEN(bad); i++) {
        hm_wire_wr w;
        uint8_t buf[128];

        hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
        hm_wire_wr_tensor(&w, &bad[i]);
        cr_assert_eq(hm_wire_wr_error(&w), -EINVAL, "bad tensor %zu", i);
        cr_assert_eq(w.len, 0);
    }
}

/* Writes [dtype, [dims...], bin(nbytes)] by hand so that the header can lie. */
static struct bytes lying_tensor(uint64_t dtype, const uint64_t *dims, unsigned ndim,
                                 size_t nbytes)
{
    struct bytes b = {0};
    hm_wire_wr w;
    uint8_t hdr[256];
    uint8_t *zeros = calloc(1, nbytes + 1);

    hm_wire_wr_init_fixed(&w, hdr, sizeof(hdr));
    hm_wire_wr_array(&w, 3);
    hm_wire_wr_uint(&w, dtype);
    hm_wire_wr_array(&w, ndim);
    for (unsigned i = 0; i < ndim; i++)
        hm_wire_wr_uint(&w, dims[i]);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    put(&b, hdr, w.len);
    /* A bin header for nbytes, then the bytes. */
    if (nbytes < 256) {
        put1(&b, 0xc4);
        put1(&b, (uint8_t)nbytes);
    } else {
        put1(&b, 0xc6);
        put_be(&b, nbytes, 4);
    }
    put(&b, zeros, nbytes);
    free(zeros);
    return b;
}

Test(wire, tensor_shape_lies_are_rejected)
{
    static const struct {
        const char *name;
        uint64_t dtype;
        uint64_t dims[10];
        unsigned ndim;
        size_t nbytes;
        uint64_t max_elems;
        int want;
    } cases[] = {
        {"honest", HM_DTYPE_F32, {2, 3}, 2, 24, 1000, 0},
        {"bin one short", HM_DTYPE_F32, {2, 3}, 2, 23, 1000, -EPROTO},
        {"bin one long", HM_DTYPE_F32, {2, 3}, 2, 25, 1000, -EPROTO},
        {"f16 counted as f32", HM_DTYPE_F16, {2, 3}, 2, 24, 1000, -EPROTO},
        {"product wraps to zero", HM_DTYPE_U8, {1ull << 32, 1ull << 32}, 2, 0, UINT64_MAX,
         -EMSGSIZE},
        {"product wraps to 16", HM_DTYPE_U8, {(1ull << 63) + 1, 16}, 2, 16, UINT64_MAX,
         -EMSGSIZE},
        {"bytes wrap", HM_DTYPE_F32, {1ull << 62}, 1, 0, UINT64_MAX, -EMSGSIZE},
        {"overflow hidden behind a zero", HM_DTYPE_U8, {1ull << 40, 1ull << 40, 0}, 3, 0,
         UINT64_MAX, -EMSGSIZE},
        {"dim over the cap", HM_DTYPE_U8, {1001}, 1, 1001, 1000, -EMSGSIZE},
        {"count over the cap", HM_DTYPE_U8, {40, 40}, 2, 1600, 1000, -EMSGSIZE},
        {"nine dims", HM_DTYPE_U8, {1, 1, 1, 1, 1, 1, 1, 1, 1}, 9, 1, 1000, -EPROTO},
        {"eight dims", HM_DTYPE_U8, {1, 1, 1, 1, 1, 1, 1, 2}, 8, 2, 1000, 0},
        {"unknown dtype", 4, {2}, 1, 2, 1000, -EPROTO},
        {"dtype past a byte", 256 + HM_DTYPE_U8, {2}, 1, 2, 1000, -EPROTO},
    };
    msgpack_zone z;

    msgpack_zone_init(&z, 1024);
    for (size_t i = 0; i < HM_ARRAY_LEN(cases); i++) {
        struct bytes b =
            lying_tensor(cases[i].dtype, cases[i].dims, cases[i].ndim, cases[i].nbytes);
        msgpack_object o = unpack_ok(&z, b.p, b.len);
        hm_wire_tensor t;

        cr_assert_eq(hm_wire_get_tensor(&o, cases[i].max_elems, &t), cases[i].want,
                     "%s: got %d", cases[i].name, hm_wire_get_tensor(&o, cases[i].max_elems, &t));
        free(b.p);
    }
    msgpack_zone_destroy(&z);
}

Test(wire, tensor_wrong_types_are_rejected)
{
    const struct {
        const char *name;
        const uint8_t *bytes;
        size_t len;
    } cases[] = {
#define T(name_, ...) {name_, (const uint8_t[]){__VA_ARGS__}, sizeof((const uint8_t[]){__VA_ARGS__})}
        T("not an array", 0xc0),
        T("two items", 0x92, 0x00, 0x90),
        T("four items", 0x94, 0x03, 0x91, 0x01, 0xc4, 0x01, 0x00, 0xc0),
        T("negative dtype", 0x93, 0xff, 0x91, 0x01, 0xc4, 0x01, 0x00),
        T("dims not an array", 0x93, 0x03, 0x01, 0xc4, 0x01, 0x00),
        T("negative dim", 0x93, 0x03, 0x91, 0xff, 0xc4, 0x01, 0x00),
        T("float dim", 0x93, 0x03, 0x91, 0xca, 0x3f, 0x80, 0x00, 0x00, 0xc4, 0x01, 0x00),
        T("data as str", 0x93, 0x03, 0x91, 0x01, 0xa1, 0x00),
        T("data as array", 0x93, 0x03, 0x91, 0x01, 0x91, 0x00),
#undef T
    };
    msgpack_zone z;

    msgpack_zone_init(&z, 1024);
    for (size_t i = 0; i < HM_ARRAY_LEN(cases); i++) {
        msgpack_object o = unpack_ok(&z, cases[i].bytes, cases[i].len);
        hm_wire_tensor t;
        cr_assert_eq(hm_wire_get_tensor(&o, 1000, &t), -EPROTO, "%s", cases[i].name);
    }
    msgpack_zone_destroy(&z);
}

/* ---- the decoders' prologue ---- */

/* [7, "ab", 3]: a version-7 message of three elements. */
static const uint8_t msg_v7[] = {0x93, 0x07, 0xa2, 'a', 'b', 0x03};

Test(wire, decode_open_array_opens_a_good_message)
{
    hm_wire_msg m;
    const char *s;
    uint32_t n;

    cr_assert_eq(hm_wire_decode_open_array(&m, msg_v7, sizeof(msg_v7), NULL, 3, 3, 7), 0);
    cr_assert_eq(m.n, 3);
    cr_assert_eq(m.root.type, MSGPACK_OBJECT_ARRAY);
    cr_assert_eq(hm_wire_get_str(&m.items[1], &s, &n), 0);
    cr_assert(n == 2 && memcmp(s, "ab", 2) == 0);
    /* str points into the frame, not into the zone. */
    cr_assert_eq((const uint8_t *)s, msg_v7 + 3);
    hm_wire_decode_close(&m);
    /* A second close (as after a failed open) is harmless. */
    hm_wire_decode_close(&m);

    /* Any version, and a range of counts. */
    cr_assert_eq(hm_wire_decode_open_array(&m, msg_v7, sizeof(msg_v7), NULL, 2, 4,
                                           HM_WIRE_ANY_VERSION),
                 0);
    cr_assert_eq(m.n, 3);
    hm_wire_decode_close(&m);
}

Test(wire, decode_open_refuses_a_truncated_frame)
{
    hm_wire_msg m;

    for (size_t cut = 0; cut < sizeof(msg_v7); cut++) {
        cr_assert_eq(hm_wire_decode_open_array(&m, msg_v7, cut, NULL, 3, 3, 7), -EINVAL,
                     "cut at %zu", cut);
        hm_wire_decode_close(&m);
        cr_assert_eq(hm_wire_decode_open(&m, msg_v7, cut, NULL), -EINVAL, "cut at %zu", cut);
        hm_wire_decode_close(&m);
    }
    /* Trailing bytes are malformed too, and so is no buffer at all. */
    const uint8_t longer[] = {0x93, 0x07, 0xa2, 'a', 'b', 0x03, 0xc0};
    cr_assert_eq(hm_wire_decode_open(&m, longer, sizeof(longer), NULL), -EINVAL);
    hm_wire_decode_close(&m);
    cr_assert_eq(hm_wire_decode_open(&m, NULL, 4, NULL), -EINVAL);
    hm_wire_decode_close(&m);
}

Test(wire, decode_open_refuses_a_wrong_version_or_shape)
{
    const uint8_t v8[] = {0x93, 0x08, 0xa2, 'a', 'b', 0x03};
    const uint8_t str_version[] = {0x93, 0xa1, '7', 0xa2, 'a', 'b', 0x03};
    const uint8_t neg_version[] = {0x93, 0xf9, 0xa2, 'a', 'b', 0x03};
    const uint8_t empty[] = {0x90};
    const uint8_t map_v7[] = {0x82, 0xa7, 'v', 'e', 'r', 's', 'i', 'o', 'n', 0x07,
                              0xa1, 'x', 0x01};
    hm_wire_msg m;

    cr_assert_eq(hm_wire_decode_open_array(&m, v8, sizeof(v8), NULL, 3, 3, 7), -EPROTO);
    hm_wire_decode_close(&m);
    cr_assert_eq(hm_wire_decode_open_array(&m, str_version, sizeof(str_version), NULL, 3, 3, 7),
                 -EPROTO);
    hm_wire_decode_close(&m);
    cr_assert_eq(hm_wire_decode_open_array(&m, neg_version, sizeof(neg_version), NULL, 3, 3, 7),
                 -EPROTO);
    hm_wire_decode_close(&m);
    /* An empty array has no version to check. */
    cr_assert_eq(hm_wire_decode_open_array(&m, empty, sizeof(empty), NULL, 0, 0, 7), -EPROTO);
    hm_wire_decode_close(&m);
    /* Too few and too many elements, and a map where an array belongs. */
    cr_assert_eq(hm_wire_decode_open_array(&m, msg_v7, sizeof(msg_v7), NULL, 4, 4, 7), -EPROTO);
    hm_wire_decode_close(&m);
    cr_assert_eq(hm_wire_decode_open_array(&m, msg_v7, sizeof(msg_v7), NULL, 1, 2, 7), -EPROTO);
    hm_wire_decode_close(&m);
    cr_assert_eq(hm_wire_decode_open_array(&m, map_v7, sizeof(map_v7), NULL, 0, 0,
                                           HM_WIRE_ANY_VERSION),
                 -EPROTO);
    hm_wire_decode_close(&m);

    /* Maps: the version key must be there and hold the version. */
    cr_assert_eq(hm_wire_decode_open_map(&m, map_v7, sizeof(map_v7), NULL, "version", 7), 0);
    cr_assert_not_null(hm_wire_map_get(&m.root, "x"));
    hm_wire_decode_close(&m);
    cr_assert_eq(hm_wire_decode_open_map(&m, map_v7, sizeof(map_v7), NULL, "version", 6),
                 -EPROTO);
    hm_wire_decode_close(&m);
    cr_assert_eq(hm_wire_decode_open_map(&m, map_v7, sizeof(map_v7), NULL, "ver", 7), -EPROTO);
    hm_wire_decode_close(&m);
    cr_assert_eq(hm_wire_decode_open_map(&m, map_v7, sizeof(map_v7), NULL, NULL, 0), 0);
    hm_wire_decode_close(&m);
    cr_assert_eq(hm_wire_decode_open_map(&m, msg_v7, sizeof(msg_v7), NULL, NULL, 0), -EPROTO);
    hm_wire_decode_close(&m);
}

Test(wire, decode_open_refuses_frames_over_the_limits)
{
    const hm_wire_limits tight = {.max_size = 64, .max_depth = 2, .max_elements = 8};
    struct bytes deep = {0}, wide = {0}, big = {0};
    hm_wire_msg m;

    /* [7, [[[1]]]]: depth 4 against a cap of 2. */
    put1(&deep, 0x92);
    put1(&deep, 0x07);
    put_fill(&deep, 0x91, 3);
    put1(&deep, 0x01);
    cr_assert_eq(hm_wire_decode_open_array(&m, deep.p, deep.len, &tight, 2, 2, 7), -EMSGSIZE);
    hm_wire_decode_close(&m);
    cr_assert_eq(hm_wire_decode_open_array(&m, deep.p, deep.len, NULL, 2, 2, 7), 0);
    hm_wire_decode_close(&m);

    /* [7, 0, 0, ...]: 12 elements against a cap of 8. */
    put1(&wide, 0x9c);
    put1(&wide, 0x07);
    put_fill(&wide, 0x00, 11);
    cr_assert_eq(hm_wire_decode_open_array(&m, wide.p, wide.len, &tight, 12, 12, 7), -EMSGSIZE);
    hm_wire_decode_close(&m);

    /* [7, bin of 100 bytes]: over the 64-byte frame cap. */
    put1(&big, 0x92);
    put1(&big, 0x07);
    put1(&big, 0xc4);
    put1(&big, 100);
    put_fill(&big, 0xab, 100);
    cr_assert_eq(hm_wire_decode_open_array(&m, big.p, big.len, &tight, 2, 2, 7), -EMSGSIZE);
    hm_wire_decode_close(&m);
    /* A header that declares more than the cap fails as over the cap even when truncated. */
    cr_assert_eq(hm_wire_decode_open_array(&m, big.p, 8, &tight, 2, 2, 7), -EMSGSIZE);
    hm_wire_decode_close(&m);
    /* A declared count no bytes back up is never allocated for. */
    const uint8_t liar[] = {0xdd, 0xff, 0xff, 0xff, 0xff, 0x07};
    cr_assert_eq(hm_wire_decode_open_array(&m, liar, sizeof(liar), NULL, 0, 0, 7), -EMSGSIZE);
    hm_wire_decode_close(&m);

    free(deep.p);
    free(wide.p);
    free(big.p);
}

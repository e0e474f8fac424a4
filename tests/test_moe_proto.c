/*
 * Tests for the expert protocol (moe/proto.h): the uid and pattern grammar
 * (accept and reject tables, ranges, patterns over the cap), round trips of
 * every rpc body and DHT value, hostile request bodies (declared shapes
 * larger than the bytes sent, huge dims, wrong dtypes, truncation at every
 * offset) and the owner-marked prefix subkeys.
 */
#include "config.h"

/* moe's proto.h, not the DHT's (both folders are on the include path). */
#include "moe/proto.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "src/base/crypto.h"
#include "dht/record.h"
#include "src/base/util.h"

static void setup(void) { cr_assert_eq(hm_crypto_init(), 0); }

TestSuite(moe_proto, .init = setup);

/* ---- helpers ---- */

static void fill(float *v, size_t n, float base)
{
    for (size_t i = 0; i < n; i++)
        v[i] = base + 0.25f * (float)i - 3.0f * (float)(i % 7);
}

/* A request map {"uid": uid, "x": [dtype, shape, bin(nbytes)]} with any header the test wants. */
static uint8_t *raw_req(const char *uid, uint64_t dtype, const uint64_t *shape, unsigned ndim,
                        size_t nbytes, size_t *len_out)
{
    hm_wire_wr w;
    uint8_t *bin = calloc(1, nbytes + 1);
    cr_assert_not_null(bin);
    hm_wire_wr_init_dynamic(&w, (size_t)1 << 28);
    hm_wire_wr_map(&w, 2);
    hm_wire_wr_cstr(&w, "uid");
    hm_wire_wr_cstr(&w, uid);
    hm_wire_wr_cstr(&w, "x");
    hm_wire_wr_array(&w, 3);
    hm_wire_wr_uint(&w, dtype);
    hm_wire_wr_array(&w, ndim);
    for (unsigned i = 0; i < ndim; i++)
        hm_wire_wr_uint(&w, shape[i]);
    hm_wire_wr_bin(&w, bin, nbytes);
    free(bin);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    uint8_t *out = hm_wire_wr_steal(&w, len_out);
    cr_assert_not_null(out);
    return out;
}

static int decode_raw(const char *uid, uint64_t dtype, const uint64_t *shape, unsigned ndim,
                      size_t nbytes)
{
    size_t len;
    hm_moe_req req;
    uint8_t *b = raw_req(uid, dtype, shape, ndim, nbytes, &len);
    int r = hm_moe_decode_req(b, len, 0, &req);
    free(b);
    return r;
}

/* ---- uids ---- */

Test(moe_proto, uid_accepts_and_formats_back)
{
    static const struct {
        const char *s;
        unsigned ndims;
        uint32_t c0, clast;
    } ok[] = {
        {"ffn.0", 1, 0, 0},
        {"ffn.3.5", 2, 3, 5},
        {"a.65535", 1, 65535, 65535},
        {"A_b-9.1.2.3.4", 4, 1, 4},
        {"expert_layer-10.12.0", 2, 12, 0},
        {"abcdefghijklmnopqrstuvwxyz012345.7", 1, 7, 7}, /* 32-character prefix */
        {"ffn.65535.65535.65535.65535", 4, 65535, 65535},
        /* Hivemind's grammar: any name without '.', any number of dimensions. */
        {"transformer::encoder.2", 1, 2, 2},
        {"ffn.1.2.3.4.5", 5, 1, 5},
        {"g.0.1.2.3.4.5.6.7.8.9.10.11.12.13.14.15", 16, 0, 15},
        {"f\xc3\xa9.1", 1, 1, 1},                         /* fé */
        {"\xe4\xb8\x93\xe5\xae\xb6.3.4", 2, 3, 4},        /* 专家 */
        {"\xf0\x9f\xa7\xa0 brain/layer,1.7", 1, 7, 7},  /* emoji, space, '/', ',' */
        {"ff n.1", 1, 1, 1},
        {"a[b]:c.0", 1, 0, 0},
    };
    for (size_t i = 0; i < HM_ARRAY_LEN(ok); i++) {
        hm_moe_uid u;
        char buf[HM_MOE_UID_MAX + 1];
        cr_assert_eq(hm_moe_uid_parse(ok[i].s, strlen(ok[i].s), &u), 0, "%s", ok[i].s);
        cr_assert_eq(u.ndims, ok[i].ndims, "%s", ok[i].s);
        cr_assert_eq(u.coords[0], ok[i].c0, "%s", ok[i].s);
        cr_assert_eq(u.coords[u.ndims - 1], ok[i].clast, "%s", ok[i].s);
        int n = hm_moe_uid_format(&u, buf, sizeof(buf));
        cr_assert_eq(n, (int)strlen(ok[i].s));
        cr_assert_str_eq(buf, ok[i].s);
    }
}

Test(moe_proto, uid_rejects)
{
    static const char *const bad[] = {
        "", "ffn", "ffn.", ".1", "ffn.01", "ffn.00", "ffn.65536", "ffn.1.", "ffn..1",
        "ffn.-1", "ffn.+1", "ffn.1a", "ffn.1 ", "ffn.1.2.3.4.5.6.7.8.9.10.11.12.13.14.15.16.17",
        "ffn[owner:x].1", "ffn.[0:2]", "ffn.1e3", "ffn.0x10", "ffn.99999999999999999999",
        "f\tn.1", "f\x7fn.1", "f\nn.1", "\xc3.1", "\xc0\xaf.1", "\xed\xa0\x80.1",
        "\xc2\x85.1", "\xf4\x90\x80\x80.1", "\xff.1",
    };
    for (size_t i = 0; i < HM_ARRAY_LEN(bad); i++) {
        hm_moe_uid u;
        cr_assert_eq(hm_moe_uid_parse(bad[i], strlen(bad[i]), &u), -EINVAL, "'%s'", bad[i]);
    }
    /* 128 bytes is a uid, 129 is not; a 126-byte name is, 127 is not. */
    char lim[HM_MOE_UID_MAX + 2];
    memset(lim, 'n', sizeof(lim));
    memcpy(lim + 124, ".1.2", 4);
    cr_assert_eq(hm_moe_uid_parse(lim, 128, NULL), 0);
    memcpy(lim + 124, ".1.23", 5);
    cr_assert_eq(hm_moe_uid_parse(lim, 129, NULL), -EINVAL);
    memset(lim, 'n', sizeof(lim));
    memcpy(lim + 126, ".1", 2);
    cr_assert_eq(hm_moe_uid_parse(lim, 128, NULL), 0);
    memcpy(lim + 127, ".1", 2);
    cr_assert_eq(hm_moe_uid_parse(lim, 129, NULL), -EINVAL);
    lim[HM_MOE_UID_MAX] = '\0';
    cr_assert_eq(hm_moe_uid_parse(lim, 128, NULL), -EINVAL); /* no dot: 128 bytes of name */
    /* The length is what counts: an embedded NUL is a bad character, not an end. */
    cr_assert_eq(hm_moe_uid_parse("ffn.1\0", 6, NULL), -EINVAL);
    cr_assert_eq(hm_moe_uid_parse("ffn.12", 5, NULL), 0);
    char big[200];
    memset(big, '1', sizeof(big));
    memcpy(big, "ffn.", 4);
    cr_assert_eq(hm_moe_uid_parse(big, sizeof(big), NULL), -EINVAL);
}

/* A bad uid is refused with the rule it breaks, in words. */
Test(moe_proto, uid_errors_name_the_rule)
{
    static const struct {
        const char *s, *rule;
    } cases[] = {
        {"ffn", "no grid coordinates"},
        {".1", "grid name before the first '.' is empty"},
        {"ffn.01", "without leading zeros"},
        {"ffn.65536", "below 65536"},
        {"ffn.1.2.3.4.5.6.7.8.9.10.11.12.13.14.15.16.17", "more than 16 grid coordinates"},
        {"f\tn.1", "control characters"},
        {"\xc3.1", "not UTF-8"},
        {"a[owner:b].1", "'[owner:'"},
        {"", "empty"},
    };
    for (size_t i = 0; i < HM_ARRAY_LEN(cases); i++) {
        char err[160] = "";
        cr_assert_eq(hm_moe_uid_check(cases[i].s, strlen(cases[i].s), NULL, err, sizeof(err)),
                     -EINVAL, "'%s'", cases[i].s);
        cr_assert(strncmp(err, "bad expert uid: ", 16) == 0, "%s", err);
        cr_assert(strstr(err, cases[i].rule) != NULL, "'%s': %s", cases[i].s, err);
    }
    char big[HM_MOE_UID_MAX + 8], err[160];
    memset(big, 'x', sizeof(big));
    big[3] = '.';
    cr_assert_eq(hm_moe_uid_check(big, sizeof(big), NULL, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "longer than 128 bytes") != NULL, "%s", err);
    hm_moe_uid u;
    cr_assert_eq(hm_moe_uid_check("transformer::encoder.2", 22, &u, err, sizeof(err)), 0);
    cr_assert_str_eq(u.prefix, "transformer::encoder");

    /* Grid names as beam searches take them, with or without Hivemind's dot. */
    cr_assert_eq(hm_moe_name_check("ffn", 3, err, sizeof(err)), 3);
    cr_assert_eq(hm_moe_name_check("ffn.", 4, err, sizeof(err)), 3);
    cr_assert_eq(hm_moe_name_check("\xe4\xb8\x93\xe5\xae\xb6", 6, err, sizeof(err)), 6);
    cr_assert_eq(hm_moe_name_check("ffn.3", 5, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "holds a '.'") != NULL, "%s", err);
    cr_assert_eq(hm_moe_name_check(".", 1, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "empty") != NULL, "%s", err);
}

Test(moe_proto, uid_prefixes_and_small_buffers)
{
    hm_moe_uid u;
    char buf[HM_MOE_UID_MAX + 1];
    cr_assert_eq(hm_moe_uid_parse("ffn.3.5.7", 9, &u), 0);
    cr_assert_eq(hm_moe_uid_prefix(&u, 0, buf, sizeof(buf)), 4);
    cr_assert_str_eq(buf, "ffn.");
    cr_assert_eq(hm_moe_uid_prefix(&u, 1, buf, sizeof(buf)), 6);
    cr_assert_str_eq(buf, "ffn.3.");
    cr_assert_eq(hm_moe_uid_prefix(&u, 2, buf, sizeof(buf)), 8);
    cr_assert_str_eq(buf, "ffn.3.5.");
    cr_assert_eq(hm_moe_uid_prefix(&u, 3, buf, sizeof(buf)), -EINVAL);
    cr_assert_eq(hm_moe_uid_format(&u, buf, 9), -EMSGSIZE);
    cr_assert_eq(hm_moe_uid_format(&u, buf, 10), 9);
    cr_assert_eq(hm_moe_uid_prefix(&u, 1, buf, 6), -EMSGSIZE);
    /* A struct a caller filled with nonsense is refused, not formatted. */
    u.coords[1] = HM_MOE_MAX_GRID;
    cr_assert_eq(hm_moe_uid_format(&u, buf, sizeof(buf)), -EINVAL);
    u.coords[1] = 5;
    u.ndims = 0;
    cr_assert_eq(hm_moe_uid_format(&u, buf, sizeof(buf)), -EINVAL);
    u.ndims = 2;
    strcpy(u.prefix, "a.b");
    cr_assert_eq(hm_moe_uid_format(&u, buf, sizeof(buf)), -EINVAL);
}

/* ---- patterns ---- */

Test(moe_proto, pattern_expands_in_row_major_order)
{
    hm_moe_uid *u = calloc(HM_MOE_MAX_PATTERN_EXPERTS, sizeof(*u));
    char err[128], buf[HM_MOE_UID_MAX + 1];
    cr_assert_not_null(u);

    int n = hm_moe_pattern_expand("ffn.[0:16].[0:4]", u, HM_MOE_MAX_PATTERN_EXPERTS, err,
                                  sizeof(err));
    cr_assert_eq(n, 64, "%s", err);
    for (int k = 0; k < n; k++) {
        cr_assert_eq(u[k].ndims, 2);
        cr_assert_eq(u[k].coords[0], (uint32_t)(k / 4));
        cr_assert_eq(u[k].coords[1], (uint32_t)(k % 4));
        cr_assert_str_eq(u[k].prefix, "ffn");
    }
    hm_moe_uid_format(&u[5], buf, sizeof(buf));
    cr_assert_str_eq(buf, "ffn.1.1");

    cr_assert_eq(hm_moe_pattern_expand("ffn.3.[1:3]", u, 10, err, sizeof(err)), 2);
    hm_moe_uid_format(&u[1], buf, sizeof(buf));
    cr_assert_str_eq(buf, "ffn.3.2");
    cr_assert_eq(hm_moe_pattern_expand("solo.7", u, 10, err, sizeof(err)), 1);
    hm_moe_uid_format(&u[0], buf, sizeof(buf));
    cr_assert_str_eq(buf, "solo.7");
    cr_assert_eq(hm_moe_pattern_expand("x.[65535:65536]", u, 10, err, sizeof(err)), 1);
    cr_assert_eq(u[0].coords[0], 65535);
    cr_assert_eq(hm_moe_pattern_expand("x.[0:4].[10:12].1.[0:2]", u, 100, err, sizeof(err)), 16);
    cr_assert_eq(u[15].ndims, 4);
    cr_assert_eq(u[15].coords[0], 3);
    cr_assert_eq(u[15].coords[1], 11);
    cr_assert_eq(u[15].coords[2], 1);
    cr_assert_eq(u[15].coords[3], 1);
    /* Exactly the cap is fine. */
    cr_assert_eq(hm_moe_pattern_expand("x.[0:64].[0:64]", u, HM_MOE_MAX_PATTERN_EXPERTS, err,
                                       sizeof(err)),
                 4096);
    free(u);
}

/* Patterns of Hivemind's uids: any grid name, many dimensions, within the uid bounds. */
Test(moe_proto, pattern_of_hivemind_uids)
{
    hm_moe_uid u[64];
    char err[160] = "", buf[HM_MOE_UID_MAX + 1];
    cr_assert_eq(hm_moe_pattern_expand("transformer::encoder.[0:3]", u, 64, err, sizeof(err)), 3,
                 "%s", err);
    hm_moe_uid_format(&u[2], buf, sizeof(buf));
    cr_assert_str_eq(buf, "transformer::encoder.2");
    cr_assert_eq(hm_moe_pattern_expand("\xe4\xb8\x93.[0:2].1.[0:2].3.[0:2].5", u, 64, err,
                                       sizeof(err)),
                 8, "%s", err);
    hm_moe_uid_format(&u[7], buf, sizeof(buf));
    cr_assert_str_eq(buf, "\xe4\xb8\x93.1.1.1.3.1.5");
    cr_assert_eq(u[7].ndims, 6);
    /* 16 dimensions of two coordinates would be 65536 experts: over the cap, said so. */
    cr_assert_eq(hm_moe_pattern_expand("g.[0:2].[0:2].[0:2].[0:2].[0:2].[0:2].[0:2].[0:2].[0:2]."
                                       "[0:2].[0:2].[0:2].[0:2].[0:2].[0:2].[0:2]",
                                       u, 64, err, sizeof(err)),
                 -EMSGSIZE);
    /* A uid the pattern names would pass 128 bytes: refused, with the rule. */
    char longp[HM_MOE_PATTERN_MAX];
    memset(longp, 'n', 123);
    strcpy(longp + 123, ".[0:2].[99:101]");
    cr_assert_eq(hm_moe_pattern_expand(longp, u, 64, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "longer than 128 bytes") != NULL, "%s", err);
    strcpy(longp + 123, ".[0:2].[9:11]");
    cr_assert_eq(hm_moe_pattern_expand(longp, u, 64, err, sizeof(err)), 4, "%s", err);
    /* Naming the rule for a bad name, too. */
    cr_assert_eq(hm_moe_pattern_expand("a[owner:b].[0:2]", u, 64, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "[owner:") != NULL, "%s", err);
}

Test(moe_proto, pattern_over_cap)
{
    hm_moe_uid u[8];
    char err[128];
    cr_assert_eq(hm_moe_pattern_expand("x.[0:65536]", u, 8, err, sizeof(err)), -EMSGSIZE);
    cr_assert(strlen(err) > 0);
    cr_assert_eq(hm_moe_pattern_expand("x.[0:3].[0:3]", u, 8, err, sizeof(err)), -EMSGSIZE);
    cr_assert_eq(hm_moe_pattern_expand("x.[0:2].[0:4]", u, 8, err, sizeof(err)), 8);
    /* The protocol's own cap binds even with a huge array. */
    cr_assert_eq(hm_moe_pattern_expand("x.[0:64].[0:64].[0:2]", u, SIZE_MAX, err, sizeof(err)),
                 -EMSGSIZE);
    cr_assert_eq(hm_moe_pattern_expand("x.[0:65536].[0:65536].[0:65536].[0:65536]", u, SIZE_MAX,
                                       err, sizeof(err)),
                 -EMSGSIZE);
}

Test(moe_proto, pattern_rejects_with_a_position)
{
    static const char *const bad[] = {
        "", "ffn", "ffn.", "ffn.[2:2]", "ffn.[3:1]", "ffn.[0:65537]", "ffn.[0:2", "ffn.[a:b]",
        "ffn.[0:2]x", "ffn.[0:2].", "ffn.1.2.3.4.5.6.7.8.9.10.11.12.13.14.15.16.17", "ffn.[0-2]", "ffn.[:2]", "ffn.[0:]",
        "ffn.[01:2]", "ffn.[65536:65537]", "ffn.[0:2]]", "ffn..1", ".[0:2]", "f\tn.[0:2]",
        "ffn.[0:655360]",
    };
    for (size_t i = 0; i < HM_ARRAY_LEN(bad); i++) {
        hm_moe_uid u[8];
        char err[128] = "";
        cr_assert_eq(hm_moe_pattern_expand(bad[i], u, 8, err, sizeof(err)), -EINVAL, "'%s'",
                     bad[i]);
        cr_assert(strstr(err, "byte") != NULL, "'%s': %s", bad[i], err);
    }
    char longp[400];
    memset(longp, '1', sizeof(longp) - 1);
    longp[sizeof(longp) - 1] = '\0';
    memcpy(longp, "ffn.", 4);
    hm_moe_uid u[2];
    cr_assert_eq(hm_moe_pattern_expand(longp, u, 2, NULL, 0), -EINVAL);
    cr_assert_eq(hm_moe_pattern_expand(NULL, u, 2, NULL, 0), -EINVAL);
}

/* ---- rpc bodies ---- */

Test(moe_proto, forward_and_backward_requests_round_trip)
{
    enum { B = 3, D = 5 };
    float x[B * D], gy[B * D], back[B * D];
    hm_wire_wr w;
    hm_moe_req req;
    size_t len;
    fill(x, B * D, 1.5f);
    fill(gy, B * D, -2.0f);

    hm_wire_wr_init_dynamic(&w, 1 << 20);
    hm_moe_encode_fwd(&w, "ffn.1.2", x, B, D);
    uint8_t *b = hm_wire_wr_steal(&w, &len);
    cr_assert_not_null(b);
    cr_assert_eq(hm_moe_decode_req(b, len, 0, &req), 0);
    cr_assert_str_eq(req.uid, "ffn.1.2");
    cr_assert_eq(req.batch, B);
    cr_assert_eq(req.dim, D);
    cr_assert_null(req.gy);
    memcpy(back, req.x, sizeof(back));
    cr_assert_arr_eq(back, x, sizeof(x));
    /* A forward body has no gy, so it is not a backward request. */
    cr_assert_eq(hm_moe_decode_req(b, len, 1, &req), -EINVAL);
    free(b);

    hm_moe_encode_bwd(&w, "ffn.1.2", x, gy, B, D);
    b = hm_wire_wr_steal(&w, &len);
    cr_assert_not_null(b);
    cr_assert_eq(hm_moe_decode_req(b, len, 1, &req), 0);
    cr_assert_eq(req.batch, B);
    cr_assert_eq(req.dim, D);
    memcpy(back, req.x, sizeof(back));
    cr_assert_arr_eq(back, x, sizeof(x));
    memcpy(back, req.gy, sizeof(back));
    cr_assert_arr_eq(back, gy, sizeof(gy));
    /* Trailing bytes make it not one frame. */
    uint8_t *b2 = malloc(len + 1);
    memcpy(b2, b, len);
    b2[len] = 0xc0;
    cr_assert_eq(hm_moe_decode_req(b2, len + 1, 1, &req), -EINVAL);
    free(b2);
    free(b);
    hm_wire_wr_free(&w);
}

Test(moe_proto, info_round_trip)
{
    uint8_t buf[256];
    hm_wire_wr w;
    char uid[HM_MOE_UID_MAX + 1], type[HM_MOE_TYPE_MAX + 1];
    size_t dim, hidden;

    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_moe_encode_info_req(&w, "ffn.0.0");
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    cr_assert_eq(hm_moe_decode_info_req(buf, w.len, uid), 0);
    cr_assert_str_eq(uid, "ffn.0.0");

    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_moe_encode_info_req(&w, "ffn.00");
    cr_assert_eq(hm_moe_decode_info_req(buf, w.len, uid), -EINVAL);

    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_moe_encode_info(&w, "ffn", 16, 64);
    cr_assert_eq(hm_moe_decode_info(buf, w.len, type, &dim, &hidden), 0);
    cr_assert_str_eq(type, "ffn");
    cr_assert_eq(dim, 16);
    cr_assert_eq(hidden, 64);
    for (size_t cut = 0; cut < w.len; cut++)
        cr_assert_lt(hm_moe_decode_info(buf, cut, type, &dim, &hidden), 0);

    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_moe_encode_info(&w, "ffn", 0, 64);
    cr_assert_lt(hm_moe_decode_info(buf, w.len, type, &dim, &hidden), 0);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_moe_encode_info(&w, "a-type-name-too-long", 16, 64);
    cr_assert_eq(hm_moe_decode_info(buf, w.len, type, &dim, &hidden), -EINVAL);
}

Test(moe_proto, replies_check_shape_and_finiteness)
{
    enum { B = 2, D = 4 };
    float y[B * D], out[B * D];
    hm_wire_wr w;
    size_t len;
    fill(y, B * D, 0.5f);

    hm_wire_wr_init_dynamic(&w, 1 << 20);
    hm_moe_encode_out(&w, 0, y, B, D);
    uint8_t *b = hm_wire_wr_steal(&w, &len);
    cr_assert_eq(hm_moe_decode_out(b, len, 0, B, D, out), 0);
    cr_assert_arr_eq(out, y, sizeof(y));
    /* The shape must be exactly what was asked: same element count, other shape. */
    cr_assert_eq(hm_moe_decode_out(b, len, 0, D, B, out), -EPROTO);
    cr_assert_eq(hm_moe_decode_out(b, len, 0, 1, D, out), -EPROTO);
    /* A forward reply is not a backward one. */
    cr_assert_eq(hm_moe_decode_out(b, len, 1, B, D, out), -EINVAL);
    for (size_t cut = 0; cut < len; cut++)
        cr_assert_lt(hm_moe_decode_out(b, cut, 0, B, D, out), 0);
    free(b);

    hm_moe_encode_out(&w, 1, y, B, D);
    b = hm_wire_wr_steal(&w, &len);
    cr_assert_eq(hm_moe_decode_out(b, len, 1, B, D, out), 0);
    free(b);

    const float bad[] = {NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < HM_ARRAY_LEN(bad); i++) {
        float t[B * D];
        memcpy(t, y, sizeof(t));
        t[B * D - 1] = bad[i];
        hm_moe_encode_out(&w, 0, t, B, D);
        b = hm_wire_wr_steal(&w, &len);
        cr_assert_eq(hm_moe_decode_out(b, len, 0, B, D, out), -EDOM);
        free(b);
    }
    /* A reply in another dtype is refused even when its byte count matches. */
    uint64_t shape[2] = {B, D * 2};
    b = raw_req("ffn.1", HM_DTYPE_F16, shape, 2, B * D * 4, &len);
    cr_assert_lt(hm_moe_decode_out(b, len, 0, B, D, out), 0);
    free(b);
    hm_wire_wr_free(&w);
}

Test(moe_proto, hostile_request_shapes)
{
    uint64_t s[4];
    /* A shape much larger than the bytes sent. */
    s[0] = 4;
    s[1] = 16;
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F32, s, 2, 16), -EPROTO);
    s[0] = 1024;
    s[1] = 8192;
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F32, s, 2, 16), -EPROTO);
    /* Over the element cap, and products that would overflow. */
    s[0] = 4096;
    s[1] = 8192;
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F32, s, 2, 16), -EMSGSIZE);
    s[0] = (uint64_t)1 << 40;
    s[1] = (uint64_t)1 << 40;
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F32, s, 2, 16), -EMSGSIZE);
    s[0] = UINT64_MAX;
    s[1] = 0;
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F32, s, 2, 16), -EMSGSIZE);
    /* Dims over the protocol's caps with honest bytes. */
    s[0] = 1;
    s[1] = HM_MOE_MAX_DIM + 1;
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F32, s, 2, (HM_MOE_MAX_DIM + 1) * 4), -EMSGSIZE);
    s[0] = HM_MOE_MAX_BATCH + 1;
    s[1] = 1;
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F32, s, 2, (HM_MOE_MAX_BATCH + 1) * 4), -EMSGSIZE);
    /* Empty tensors, other dtypes and ranks. */
    s[0] = 0;
    s[1] = 4;
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F32, s, 2, 0), -EINVAL);
    s[0] = 2;
    s[1] = 4;
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F16, s, 2, 16), -EPROTO);
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_U8, s, 2, 8), -EPROTO);
    cr_assert_eq(decode_raw("ffn.1", 99, s, 2, 32), -EPROTO);
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F32, s, 1, 8), -EPROTO);
    /* Rank 3 is revision 2's [batch, seq, dim] (the server decides who takes it); rank 4 is
     * nothing. */
    s[2] = 1;
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F32, s, 3, 32), 0);
    s[3] = 1;
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F32, s, 4, 32), -EPROTO);
    /* A bad uid. */
    cr_assert_eq(decode_raw("ffn.01", HM_DTYPE_F32, s, 2, 32), -EINVAL);
    cr_assert_eq(decode_raw("../../etc/passwd.1", HM_DTYPE_F32, s, 2, 32), -EINVAL);
    /* And the honest one decodes. */
    cr_assert_eq(decode_raw("ffn.1", HM_DTYPE_F32, s, 2, 32), 0);
}

Test(moe_proto, hostile_request_frames)
{
    hm_moe_req req;
    /* A bin32 header that declares 200 MB with a handful of bytes behind it. */
    uint8_t big[] = {0x82, 0xa3, 'u', 'i', 'd', 0xa5, 'f', 'f', 'n', '.', '1', 0xa1, 'x',
                     0x93, 0x00, 0x92, 0x01, 0x01, 0xc6, 0x0c, 0x00, 0x00, 0x00, 1, 2, 3, 4};
    cr_assert_lt(hm_moe_decode_req(big, sizeof(big), 0, &req), 0);
    /* An array header that declares four billion elements. */
    uint8_t arr[] = {0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0};
    cr_assert_lt(hm_moe_decode_req(arr, sizeof(arr), 0, &req), 0);
    /* Not a map; a map without x; a uid of the wrong type. */
    uint8_t nil[] = {0xc0};
    cr_assert_eq(hm_moe_decode_req(nil, 1, 0, &req), -EINVAL);
    uint8_t nox[] = {0x81, 0xa3, 'u', 'i', 'd', 0xa5, 'f', 'f', 'n', '.', '1'};
    cr_assert_eq(hm_moe_decode_req(nox, sizeof(nox), 0, &req), -EINVAL);
    uint8_t intuid[] = {0x81, 0xa3, 'u', 'i', 'd', 0x05};
    cr_assert_eq(hm_moe_decode_req(intuid, sizeof(intuid), 0, &req), -EINVAL);
    cr_assert_eq(hm_moe_decode_req(NULL, 0, 0, &req), -EINVAL);

    /* gy whose shape disagrees with x. */
    float x[6] = {1, 2, 3, 4, 5, 6};
    hm_wire_wr w;
    size_t len;
    hm_wire_wr_init_dynamic(&w, 1 << 16);
    hm_wire_wr_map(&w, 3);
    hm_wire_wr_cstr(&w, "uid");
    hm_wire_wr_cstr(&w, "ffn.1");
    hm_wire_tensor t = {.dtype = HM_DTYPE_F32, .ndim = 2, .shape = {2, 3},
                        .data = (const uint8_t *)x, .nbytes = sizeof(x)};
    hm_wire_wr_cstr(&w, "x");
    hm_wire_wr_tensor(&w, &t);
    t.shape[0] = 3;
    t.shape[1] = 2;
    hm_wire_wr_cstr(&w, "gy");
    hm_wire_wr_tensor(&w, &t);
    uint8_t *b = hm_wire_wr_steal(&w, &len);
    cr_assert_not_null(b);
    cr_assert_eq(hm_moe_decode_req(b, len, 1, &req), -EPROTO);
    free(b);

    /* Truncation at every offset of a valid backward request. */
    float gy[6] = {-1, -2, -3, -4, -5, -6};
    hm_moe_encode_bwd(&w, "ffn.2.3", x, gy, 2, 3);
    b = hm_wire_wr_steal(&w, &len);
    cr_assert_not_null(b);
    for (size_t cut = 0; cut < len; cut++) {
        cr_assert_lt(hm_moe_decode_req(b, cut, 1, &req), 0, "cut %zu", cut);
        cr_assert_lt(hm_moe_decode_req(b, cut, 0, &req), 0, "cut %zu", cut);
    }
    cr_assert_eq(hm_moe_decode_req(b, len, 1, &req), 0);
    /* Every single-byte corruption is either refused or still a well-formed request. */
    for (size_t i = 0; i < len; i++) {
        uint8_t save = b[i];
        b[i] ^= 0xff;
        int r = hm_moe_decode_req(b, len, 1, &req);
        if (r == 0)
            cr_assert(req.batch * req.dim == 6 && req.x != NULL && req.gy != NULL);
        b[i] = save;
    }
    free(b);
    hm_wire_wr_free(&w);
}

Test(moe_proto, encoders_report_errors)
{
    uint8_t small[16];
    float x[64] = {0};
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, small, sizeof(small));
    hm_moe_encode_fwd(&w, "ffn.1", x, 8, 8);
    cr_assert_eq(hm_wire_wr_error(&w), -EMSGSIZE);
    hm_wire_wr_init_fixed(&w, small, sizeof(small));
    hm_moe_encode_fwd(&w, NULL, x, 8, 8);
    cr_assert_eq(hm_wire_wr_error(&w), -EINVAL);
}

/* ---- DHT values and subkeys ---- */

Test(moe_proto, dht_values_round_trip)
{
    uint8_t buf[HM_DHT_VALUE_MAX];
    char addr[HM_MOE_ADDR_MAX + 1], type[HM_MOE_TYPE_MAX + 1], uid[HM_MOE_UID_MAX + 1];
    size_t dim;

    int n = hm_moe_encode_expert_value(buf, sizeof(buf), "127.0.0.1:4321", "ffn", 16);
    cr_assert_gt(n, 0);
    cr_assert_eq(hm_moe_decode_expert_value(buf, (size_t)n, addr, type, &dim), 0);
    cr_assert_str_eq(addr, "127.0.0.1:4321");
    cr_assert_str_eq(type, "ffn");
    cr_assert_eq(dim, 16);
    for (int cut = 1; cut < n; cut++)
        cr_assert_eq(hm_moe_decode_expert_value(buf, (size_t)cut, addr, type, &dim), -EINVAL);
    cr_assert_eq(hm_moe_decode_expert_value(buf, 0, addr, type, &dim), -ENOENT);
    /* The prefix entry is not an expert value and the other way round. */
    cr_assert_eq(hm_moe_decode_prefix_value(buf, (size_t)n, uid, addr), -EINVAL);

    n = hm_moe_encode_prefix_value(buf, sizeof(buf), "ffn.3.5", "[::1]:80");
    cr_assert_gt(n, 0);
    cr_assert_eq(hm_moe_decode_prefix_value(buf, (size_t)n, uid, addr), 0);
    cr_assert_str_eq(uid, "ffn.3.5");
    cr_assert_str_eq(addr, "[::1]:80");
    cr_assert_eq(hm_moe_decode_prefix_value(buf, 0, uid, addr), -ENOENT);
    cr_assert_eq(hm_moe_decode_expert_value(buf, (size_t)n, addr, type, &dim), -EINVAL);
    for (int cut = 1; cut < n; cut++)
        cr_assert_eq(hm_moe_decode_prefix_value(buf, (size_t)cut, uid, addr), -EINVAL);

    /* Encoders refuse what decoders would refuse. */
    cr_assert_eq(hm_moe_encode_expert_value(buf, sizeof(buf), "localhost:80", "ffn", 16),
                 -EINVAL);
    cr_assert_eq(hm_moe_encode_expert_value(buf, sizeof(buf), "1.2.3.4:5", "", 16), -EINVAL);
    cr_assert_eq(hm_moe_encode_expert_value(buf, sizeof(buf), "1.2.3.4:5", "f n", 16), -EINVAL);
    cr_assert_eq(hm_moe_encode_expert_value(buf, sizeof(buf), "1.2.3.4:5", "ffn", 0), -EINVAL);
    cr_assert_eq(hm_moe_encode_prefix_value(buf, sizeof(buf), "ffn", "1.2.3.4:5"), -EINVAL);
    cr_assert_eq(hm_moe_encode_expert_value(buf, 8, "1.2.3.4:5", "ffn", 16), -EMSGSIZE);

    /* Hand-made values with wrong types or shapes. */
    hm_wire_wr w;
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_array(&w, 3);
    hm_wire_wr_cstr(&w, "1.2.3.4:5");
    hm_wire_wr_cstr(&w, "ffn");
    hm_wire_wr_int(&w, -1);
    cr_assert_eq(hm_moe_decode_expert_value(buf, w.len, addr, type, &dim), -EINVAL);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_array(&w, 4);
    hm_wire_wr_cstr(&w, "1.2.3.4:5");
    hm_wire_wr_cstr(&w, "ffn");
    hm_wire_wr_uint(&w, 16);
    hm_wire_wr_nil(&w);
    cr_assert_eq(hm_moe_decode_expert_value(buf, w.len, addr, type, &dim), -EINVAL);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_array(&w, 3);
    hm_wire_wr_cstr(&w, "1.2.3.4:5");
    hm_wire_wr_cstr(&w, "ffn");
    hm_wire_wr_uint(&w, HM_MOE_MAX_DIM + 1);
    cr_assert_eq(hm_moe_decode_expert_value(buf, w.len, addr, type, &dim), -EINVAL);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_array(&w, 2);
    hm_wire_wr_cstr(&w, "ffn.1");
    hm_wire_wr_str(&w, "1.2.3.4:5\0x", 11);
    cr_assert_eq(hm_moe_decode_prefix_value(buf, w.len, uid, addr), -EINVAL);
}

Test(moe_proto, prefix_subkeys)
{
    hm_identity id;
    char marker[HM_DHT_OWNER_MARKER_LEN + 1];
    char sk[HM_DHT_SUBKEY_MAX + 1];
    uint8_t pk[HM_PK_BYTES];
    uint32_t coord;

    cr_assert_eq(hm_identity_generate(&id), 0);
    /* The marker as dht/record.h defines it (record.c is not linked into this test). */
    snprintf(marker, sizeof(marker), "[owner:%s]", id.peer_id);
    cr_assert_eq(strlen(marker), HM_DHT_OWNER_MARKER_LEN);

    snprintf(sk, sizeof(sk), "5%s", marker);
    cr_assert_eq(hm_moe_parse_prefix_subkey((const uint8_t *)sk, strlen(sk), &coord, pk), 0);
    cr_assert_eq(coord, 5);
    cr_assert_arr_eq(pk, id.pk, HM_PK_BYTES);
    snprintf(sk, sizeof(sk), "65535%s", marker);
    cr_assert_eq(hm_moe_parse_prefix_subkey((const uint8_t *)sk, strlen(sk), &coord, pk), 0);
    cr_assert_eq(coord, 65535);

    const char *bad_coords[] = {"", "05", "65536", "-1", "a", "1.2", " 1"};
    for (size_t i = 0; i < HM_ARRAY_LEN(bad_coords); i++) {
        snprintf(sk, sizeof(sk), "%s%s", bad_coords[i], marker);
        cr_assert_eq(hm_moe_parse_prefix_subkey((const uint8_t *)sk, strlen(sk), &coord, pk),
                     -EINVAL, "'%s'", bad_coords[i]);
    }
    /* Broken markers: cut, extra byte, wrong tag, bad peer id. */
    snprintf(sk, sizeof(sk), "5%s", marker);
    size_t l = strlen(sk);
    for (size_t cut = 0; cut < l; cut++)
        cr_assert_eq(hm_moe_parse_prefix_subkey((const uint8_t *)sk, cut, &coord, pk), -EINVAL);
    snprintf(sk, sizeof(sk), "5%sx", marker);
    cr_assert_eq(hm_moe_parse_prefix_subkey((const uint8_t *)sk, strlen(sk), &coord, pk), -EINVAL);
    snprintf(sk, sizeof(sk), "5%s", marker);
    sk[2] = 'O';
    cr_assert_eq(hm_moe_parse_prefix_subkey((const uint8_t *)sk, l, &coord, pk), -EINVAL);
    snprintf(sk, sizeof(sk), "5%s", marker);
    sk[10] = '!';
    cr_assert_eq(hm_moe_parse_prefix_subkey((const uint8_t *)sk, l, &coord, pk), -EINVAL);
    snprintf(sk, sizeof(sk), "5%s", marker);
    sk[l - 1] = ')';
    cr_assert_eq(hm_moe_parse_prefix_subkey((const uint8_t *)sk, l, &coord, pk), -EINVAL);
}

/* ---- host allow-list ---- */

Test(moe_proto, allow_list_parses_matches_longest_and_refuses_bad_lines)
{
    hm_identity a, b;
    char ida[HM_PEER_ID_LEN + 1], idb[HM_PEER_ID_LEN + 1], text[1024], err[256];
    hm_moe_allow *al = NULL;
    cr_assert_eq(hm_crypto_init(), 0);
    cr_assert_eq(hm_identity_generate(&a), 0);
    cr_assert_eq(hm_identity_generate(&b), 0);
    hm_peer_id_encode(a.pk, ida);
    hm_peer_id_encode(b.pk, idb);
    snprintf(text, sizeof(text), "# grid hosts\n\nffn. %s %s\r\n  ffn.3.\t%s # row 3: b only\n",
             ida, idb, idb);
    cr_assert_eq(hm_moe_allow_parse(text, strlen(text), &al, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(al->n, 2u);
    cr_assert(hm_moe_allow_permits(al, "ffn.1.0", a.pk));
    cr_assert(hm_moe_allow_permits(al, "ffn.1.0", b.pk));
    cr_assert(!hm_moe_allow_permits(al, "ffn.3.5", a.pk), "the longer prefix decides");
    cr_assert(hm_moe_allow_permits(al, "ffn.3.5", b.pk));
    cr_assert(hm_moe_allow_permits(al, "other.1", a.pk), "no rule: open");
    cr_assert_null(hm_moe_allow_find(al, "ff"));
    hm_moe_allow_free(al);

    /* Rules for Hivemind's uids: any name without '.', in UTF-8. */
    snprintf(text, sizeof(text), "\xe4\xb8\x93\xe5\xae\xb6. %s\ntransformer::enc. %s\n", ida, idb);
    cr_assert_eq(hm_moe_allow_parse(text, strlen(text), &al, err, sizeof(err)), 0, "%s", err);
    cr_assert(hm_moe_allow_permits(al, "\xe4\xb8\x93\xe5\xae\xb6.1.2", a.pk));
    cr_assert(!hm_moe_allow_permits(al, "\xe4\xb8\x93\xe5\xae\xb6.1.2", b.pk));
    cr_assert(!hm_moe_allow_permits(al, "transformer::enc.0", a.pk));
    hm_moe_allow_free(al);

    const char *bad[] = {"ffn.\n", "ffn. notakey\n", "ff/n. x\n", "ffn.\x01 a\n",
                         "\xc3. x\n"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        al = (hm_moe_allow *)1;
        cr_assert_eq(hm_moe_allow_parse(bad[i], strlen(bad[i]), &al, err, sizeof(err)), -EINVAL,
                     "%s", bad[i]);
        cr_assert_null(al);
        cr_assert(strstr(err, "line 1") != NULL, "%s", err);
    }
    snprintf(text, sizeof(text), "ffn. %s\nffn. %s\n", ida, idb);
    cr_assert_eq(hm_moe_allow_parse(text, strlen(text), &al, err, sizeof(err)), -EINVAL);
    cr_assert(strstr(err, "line 2") != NULL && strstr(err, "twice") != NULL, "%s", err);
    cr_assert_eq(hm_moe_allow_parse("", 0, &al, err, sizeof(err)), 0);
    cr_assert_eq(al->n, 0u);
    hm_moe_allow_free(al);
}

/* ---- revision 2: tensors over sequences ---- */

Test(moe_proto, sequence_requests_and_replies_round_trip)
{
    enum { B = 2, S = 3, D = 4 };
    float x[B * S * D], gy[B * S * D], back[B * S * D];
    hm_wire_wr w;
    hm_moe_req req;
    size_t len;
    fill(x, B * S * D, 0.5f);
    fill(gy, B * S * D, -1.0f);

    hm_wire_wr_init_dynamic(&w, 1 << 20);
    hm_moe_encode_bwd_seq(&w, "transformer::enc.1", x, gy, B, S, D);
    uint8_t *b = hm_wire_wr_steal(&w, &len);
    cr_assert_not_null(b);
    cr_assert_eq(hm_moe_decode_req(b, len, 1, &req), 0);
    cr_assert_str_eq(req.uid, "transformer::enc.1");
    cr_assert_eq(req.batch, B);
    cr_assert_eq(req.seq, S);
    cr_assert_eq(req.dim, D);
    memcpy(back, req.gy, sizeof(back));
    cr_assert_eq(memcmp(back, gy, sizeof(back)), 0);
    free(b);
    /* Rank 2 says seq 0, as revision 1 bodies always were. */
    hm_wire_wr_init_dynamic(&w, 1 << 20);
    hm_moe_encode_fwd(&w, "ffn.1", x, B, D);
    b = hm_wire_wr_steal(&w, &len);
    cr_assert_eq(hm_moe_decode_req(b, len, 0, &req), 0);
    cr_assert_eq(req.seq, 0u);
    free(b);

    /* Replies: the shape asked, rank included. */
    hm_wire_wr_init_dynamic(&w, 1 << 20);
    hm_moe_encode_out_seq(&w, 0, x, B, S, D);
    b = hm_wire_wr_steal(&w, &len);
    cr_assert_eq(hm_moe_decode_out_seq(b, len, 0, B, S, D, back), 0);
    cr_assert_eq(memcmp(back, x, sizeof(back)), 0);
    cr_assert_eq(hm_moe_decode_out_seq(b, len, 0, B, 2, D, back), -EPROTO);
    cr_assert_eq(hm_moe_decode_out(b, len, 0, B * S, D, back), -EPROTO);
    cr_assert_eq(hm_moe_decode_out_seq(b, len, 0, B, HM_MOE_MAX_SEQ + 1, D, back), -EINVAL);
    free(b);

    /* x and gy of different ranks, a seq over the cap: refused. */
    uint64_t s3[3] = {1, HM_MOE_MAX_SEQ + 1, 1};
    cr_assert_eq(decode_raw("t.1", HM_DTYPE_F32, s3, 3, (HM_MOE_MAX_SEQ + 1) * 4), -EMSGSIZE);
    uint64_t s4[4] = {1, 1, 1, 1};
    cr_assert_eq(decode_raw("t.1", HM_DTYPE_F32, s4, 4, 4), -EPROTO);
    hm_wire_wr_init_dynamic(&w, 1 << 20);
    hm_wire_wr_map(&w, 3);
    hm_wire_wr_cstr(&w, "uid");
    hm_wire_wr_cstr(&w, "t.1");
    hm_wire_wr_cstr(&w, "x");
    hm_wire_tensor t3 = {.dtype = HM_DTYPE_F32, .ndim = 3, .shape = {B, S, D},
                         .data = (const uint8_t *)x, .nbytes = sizeof(x)};
    hm_wire_wr_tensor(&w, &t3);
    hm_wire_wr_cstr(&w, "gy");
    hm_wire_tensor t2 = {.dtype = HM_DTYPE_F32, .ndim = 2, .shape = {B * S, D},
                         .data = (const uint8_t *)gy, .nbytes = sizeof(gy)};
    hm_wire_wr_tensor(&w, &t2);
    b = hm_wire_wr_steal(&w, &len);
    cr_assert_eq(hm_moe_decode_req(b, len, 1, &req), -EPROTO);
    free(b);

    /* Info: heads and max_seq for experts over sequences; a revision-1 reader skips them. */
    uint8_t ib[256];
    char type[HM_MOE_TYPE_MAX + 1];
    size_t dim, hidden, heads = 9, max_seq = 9;
    hm_wire_wr_init_fixed(&w, ib, sizeof(ib));
    hm_moe_encode_info_seq(&w, "transformer", 16, 64, 4, 512);
    cr_assert_eq(hm_moe_decode_info_seq(ib, w.len, type, &dim, &hidden, &heads, &max_seq), 0);
    cr_assert_eq(heads, 4u);
    cr_assert_eq(max_seq, 512u);
    cr_assert_eq(hm_moe_decode_info(ib, w.len, type, &dim, &hidden), 0);
    cr_assert_str_eq(type, "transformer");
    hm_wire_wr_init_fixed(&w, ib, sizeof(ib));
    hm_moe_encode_info(&w, "ffn", 16, 64);
    cr_assert_eq(hm_moe_decode_info_seq(ib, w.len, type, &dim, &hidden, &heads, &max_seq), 0);
    cr_assert_eq(heads, 0u);
    cr_assert_eq(max_seq, 0u);
    hm_wire_wr_init_fixed(&w, ib, sizeof(ib));
    hm_moe_encode_info_seq(&w, "transformer", 16, 64, 4, HM_MOE_MAX_SEQ + 1);
    cr_assert_eq(hm_moe_decode_info_seq(ib, w.len, type, &dim, &hidden, &heads, &max_seq),
                 -EMSGSIZE);
}

/* Revision 3: a masked request carries its input as "xm", so that a
 * revision-2 server (which requires "x") refuses it instead of ignoring
 * the mask; the mask itself is checked byte by byte. */
Test(moe_proto, masked_requests_round_trip_and_bad_masks_are_refused)
{
    enum { B = 2, S = 3, D = 4 };
    float x[B * S * D], gy[B * S * D], back[B * S * D];
    const uint8_t mask[B * S] = {1, 1, 0, 0, 1, 1};
    hm_wire_wr w;
    hm_wire_msg m;
    hm_moe_req req;
    size_t len;
    fill(x, B * S * D, 0.5f);
    fill(gy, B * S * D, -1.0f);

    for (int backward = 0; backward <= 1; backward++) {
        hm_wire_wr_init_dynamic(&w, 1 << 20);
        if (backward)
            hm_moe_encode_bwd_mask(&w, "transformer::enc.1", x, mask, gy, B, S, D);
        else
            hm_moe_encode_fwd_mask(&w, "transformer::enc.1", x, mask, B, S, D);
        uint8_t *b = hm_wire_wr_steal(&w, &len);
        cr_assert_not_null(b);
        cr_assert_eq(hm_moe_decode_req(b, len, backward, &req), 0);
        cr_assert_eq(req.batch, B);
        cr_assert_eq(req.seq, S);
        cr_assert_not_null(req.mask);
        cr_assert_eq(memcmp(req.mask, mask, sizeof(mask)), 0);
        memcpy(back, req.x, sizeof(back));
        cr_assert_eq(memcmp(back, x, sizeof(back)), 0);
        /* What a revision-2 server reads: no "x", so a malformed request. */
        const hm_wire_limits lim = {.max_size = HM_MOE_MAX_FRAME, .max_depth = 4,
                                    .max_elements = 64};
        cr_assert_eq(hm_wire_decode_open_map(&m, b, len, &lim, NULL, 0), 0);
        cr_assert_null(hm_wire_map_get(&m.root, "x"));
        cr_assert_not_null(hm_wire_map_get(&m.root, "xm"));
        hm_wire_decode_close(&m);
        free(b);
    }
    /* Unmasked requests are revision 2's, with mask NULL. */
    hm_wire_wr_init_dynamic(&w, 1 << 20);
    hm_moe_encode_fwd_mask(&w, "t.1", x, NULL, B, S, D);
    uint8_t *b = hm_wire_wr_steal(&w, &len);
    cr_assert_eq(hm_moe_decode_req(b, len, 0, &req), 0);
    cr_assert_null(req.mask);
    free(b);
    /* No mask on [batch, dim]. */
    hm_wire_wr_init_dynamic(&w, 1 << 20);
    hm_moe_encode_fwd_mask(&w, "t.1", x, mask, B * S, 0, D);
    cr_assert_eq(hm_wire_wr_error(&w), -EINVAL);
    hm_wire_wr_free(&w);

    /* Hand-made frames: {uid, KEY: x[B,S,D] or [B*S,D], mask?} */
    struct {
        const char *xkey;
        int rank3;
        int with_mask;
        size_t mask_len;
        uint8_t bad;
        int want;
    } cases[] = {
        {"xm", 1, 1, B * S, 0, 0},
        {"xm", 1, 0, 0, 0, -EINVAL},      /* xm without a mask */
        {"x", 1, 1, B * S, 0, -EINVAL},   /* a mask with x: an old server would ignore it */
        {"xm", 1, 1, B * S - 1, 0, -EINVAL},
        {"xm", 1, 1, B * S + 1, 0, -EINVAL},
        {"xm", 1, 1, B * S, 2, -EINVAL},  /* a byte that is not 0 or 1 */
        {"xm", 1, 1, B * S, 3, -EINVAL},  /* sample 1 all padding */
        {"xm", 0, 1, B * S, 0, -EPROTO},  /* rank 2 has no keys */
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        uint8_t mk[B * S + 1] = {1, 1, 0, 0, 1, 1, 1};
        if (cases[c].bad == 2)
            mk[1] = 2;
        if (cases[c].bad == 3)
            mk[3] = mk[4] = mk[5] = 0;
        hm_wire_wr_init_dynamic(&w, 1 << 20);
        hm_wire_wr_map(&w, cases[c].with_mask ? 3 : 2);
        hm_wire_wr_cstr(&w, "uid");
        hm_wire_wr_cstr(&w, "t.1");
        hm_wire_wr_cstr(&w, cases[c].xkey);
        hm_wire_tensor t = {.dtype = HM_DTYPE_F32, .ndim = cases[c].rank3 ? 3 : 2,
                            .shape = {B, S, D}, .data = (const uint8_t *)x, .nbytes = sizeof(x)};
        if (!cases[c].rank3) {
            t.shape[0] = B * S;
            t.shape[1] = D;
        }
        hm_wire_wr_tensor(&w, &t);
        if (cases[c].with_mask) {
            hm_wire_wr_cstr(&w, "mask");
            hm_wire_wr_bin(&w, mk, cases[c].mask_len);
        }
        b = hm_wire_wr_steal(&w, &len);
        cr_assert_not_null(b);
        cr_assert_eq(hm_moe_decode_req(b, len, 0, &req), cases[c].want, "case %zu", c);
        free(b);
    }
}

/*
 * fuzz_moe_proto: every decoder of the expert protocol (moe/proto.h) on
 * arbitrary bytes: forward and backward requests, info requests and
 * replies, output replies, both DHT values, prefix subkeys, uid parsing and
 * pattern expansion, the host allow-list, error reasons. Besides memory safety it checks the promises callers
 * rely on:
 *   - only the documented error codes come back;
 *   - a decoded request lies inside the caps, its tensors point inside the
 *     input, and it encodes again to a request that decodes the same;
 *   - a decoded reply is finite; a decoded DHT value re-encodes to one that
 *     decodes to the same fields;
 *   - a parsed uid formats back to exactly its bytes (one uid per expert);
 *   - an expanded pattern yields at most the cap of uids, each valid.
 * The input is also used as the raw tensor bytes of a well-formed reply, so
 * that the shape and finiteness checks are reached, not only the framing.
 */
#include "config.h"

#include "moe/proto.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "src/base/util.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                           \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "fuzz_moe_proto: check failed at line %d: %s\n", __LINE__,       \
                    #cond);                                                                   \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

static int req_err_ok(int r)
{
    return r == 0 || r == -EINVAL || r == -EMSGSIZE || r == -EPROTO || r == -ENOMEM;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    hm_log_set_level(HM_LOG_ERROR);
    CHECK(hm_crypto_init() == 0);
    return 0;
}

static int inside(const uint8_t *p, size_t n, const uint8_t *data, size_t size)
{
    return p >= data && n <= size && (size_t)(p - data) <= size - n;
}

static void check_request(const uint8_t *data, size_t size, int backward)
{
    hm_moe_req req, again;
    int r = hm_moe_decode_req(data, size, backward, &req);
    CHECK(req_err_ok(r));
    if (r != 0)
        return;
    size_t rows = req.seq != 0 ? req.batch * req.seq : req.batch;
    size_t n = rows * req.dim;
    CHECK(req.seq <= HM_MOE_MAX_SEQ);
    CHECK(req.batch >= 1 && req.batch <= HM_MOE_MAX_BATCH);
    CHECK(req.dim >= 1 && req.dim <= HM_MOE_MAX_DIM);
    CHECK(n <= HM_MOE_MAX_ELEMS);
    CHECK(hm_moe_uid_parse(req.uid, strlen(req.uid), NULL) == 0);
    CHECK(inside(req.x, n * 4, data, size));
    CHECK(backward ? req.gy != NULL && inside(req.gy, n * 4, data, size) : req.gy == NULL);
    /* A mask (revision 3) goes with sequences only, one 0/1 byte a row, each sample keeping one. */
    if (req.mask != NULL) {
        CHECK(req.seq != 0 && inside(req.mask, rows, data, size));
        for (size_t b = 0; b < req.batch; b++) {
            size_t kept = 0;
            for (size_t j = 0; j < req.seq; j++) {
                CHECK(req.mask[b * req.seq + j] <= 1);
                kept += req.mask[b * req.seq + j];
            }
            CHECK(kept >= 1);
        }
    }

    float *x = malloc(n * sizeof(float));
    float *gy = malloc(n * sizeof(float));
    CHECK(x != NULL && gy != NULL);
    memcpy(x, req.x, n * 4);
    if (backward)
        memcpy(gy, req.gy, n * 4);
    hm_wire_wr w;
    size_t len;
    hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
    if (backward)
        hm_moe_encode_bwd_mask(&w, req.uid, x, req.mask, gy, req.batch, req.seq, req.dim);
    else
        hm_moe_encode_fwd_mask(&w, req.uid, x, req.mask, req.batch, req.seq, req.dim);
    CHECK(hm_wire_wr_error(&w) == 0);
    uint8_t *b = hm_wire_wr_steal(&w, &len);
    CHECK(b != NULL);
    CHECK(hm_moe_decode_req(b, len, backward, &again) == 0);
    CHECK(strcmp(again.uid, req.uid) == 0 && again.batch == req.batch && again.dim == req.dim &&
          again.seq == req.seq);
    CHECK(memcmp(again.x, x, n * 4) == 0);
    if (backward)
        CHECK(memcmp(again.gy, gy, n * 4) == 0);
    CHECK((again.mask != NULL) == (req.mask != NULL));
    if (req.mask != NULL)
        CHECK(memcmp(again.mask, req.mask, rows) == 0);
    free(b);
    free(x);
    free(gy);
}

static void check_out(const uint8_t *data, size_t size, int backward, size_t batch, size_t dim)
{
    float *out = malloc(batch * dim * sizeof(float));
    CHECK(out != NULL);
    int r = hm_moe_decode_out(data, size, backward, batch, dim, out);
    CHECK(r == 0 || r == -EINVAL || r == -EMSGSIZE || r == -EPROTO || r == -EDOM ||
          r == -ENOMEM);
    if (r == 0)
        for (size_t i = 0; i < batch * dim; i++) {
            uint32_t u;
            memcpy(&u, &out[i], 4);
            CHECK((u & 0x7f800000u) != 0x7f800000u);
        }
    free(out);
}

/* The input's bytes as the tensor of a well-formed reply, shaped from its length. */
static void check_wrapped_out(const uint8_t *data, size_t size)
{
    size_t n = size / 4;
    if (n == 0 || n > HM_MOE_MAX_ELEMS)
        return;
    size_t dim = 1 + (data[0] % 8);
    if (n % dim != 0 || n / dim > HM_MOE_MAX_BATCH)
        dim = 1;
    size_t batch = n / dim;
    if (batch > HM_MOE_MAX_BATCH)
        return;
    hm_wire_wr w;
    size_t len;
    hm_wire_wr_init_dynamic(&w, HM_MOE_MAX_FRAME);
    hm_wire_wr_map(&w, 1);
    hm_wire_wr_cstr(&w, "y");
    hm_wire_tensor t = {.dtype = HM_DTYPE_F32, .ndim = 2, .shape = {batch, dim},
                        .data = data, .nbytes = n * 4};
    hm_wire_wr_tensor(&w, &t);
    CHECK(hm_wire_wr_error(&w) == 0);
    uint8_t *b = hm_wire_wr_steal(&w, &len);
    CHECK(b != NULL);
    check_out(b, len, 0, batch, dim);
    /* Asked for another shape, it must be refused. */
    float one;
    if (batch * dim != 1)
        CHECK(hm_moe_decode_out(b, len, 0, 1, 1, &one) == -EPROTO);
    free(b);
}

static void check_info(const uint8_t *data, size_t size)
{
    char uid[HM_MOE_UID_MAX + 1], type[HM_MOE_TYPE_MAX + 1];
    size_t dim, hidden;
    int r = hm_moe_decode_info_req(data, size, uid);
    CHECK(req_err_ok(r));
    if (r == 0)
        CHECK(hm_moe_uid_parse(uid, strlen(uid), NULL) == 0);
    r = hm_moe_decode_info(data, size, type, &dim, &hidden);
    CHECK(req_err_ok(r));
    if (r == 0) {
        CHECK(strlen(type) >= 1 && strlen(type) <= HM_MOE_TYPE_MAX);
        CHECK(dim >= 1 && dim <= HM_MOE_MAX_DIM && hidden >= 1);
    }
}

static void check_values(const uint8_t *data, size_t size)
{
    char addr[HM_MOE_ADDR_MAX + 1], type[HM_MOE_TYPE_MAX + 1], uid[HM_MOE_UID_MAX + 1];
    char addr2[HM_MOE_ADDR_MAX + 1], type2[HM_MOE_TYPE_MAX + 1], uid2[HM_MOE_UID_MAX + 1];
    uint8_t buf[1024];
    size_t dim, dim2;

    int r = hm_moe_decode_expert_value(data, size, addr, type, &dim);
    CHECK(r == 0 || r == -EINVAL || r == -ENOENT || r == -ENOMEM);
    CHECK(r != -ENOENT || size == 0);
    if (r == 0) {
        int n = hm_moe_encode_expert_value(buf, sizeof(buf), addr, type, dim);
        CHECK(n > 0);
        CHECK(hm_moe_decode_expert_value(buf, (size_t)n, addr2, type2, &dim2) == 0);
        CHECK(strcmp(addr, addr2) == 0 && strcmp(type, type2) == 0 && dim == dim2);
    }
    r = hm_moe_decode_prefix_value(data, size, uid, addr);
    CHECK(r == 0 || r == -EINVAL || r == -ENOENT || r == -ENOMEM);
    if (r == 0) {
        int n = hm_moe_encode_prefix_value(buf, sizeof(buf), uid, addr);
        CHECK(n > 0);
        CHECK(hm_moe_decode_prefix_value(buf, (size_t)n, uid2, addr2) == 0);
        CHECK(strcmp(uid, uid2) == 0 && strcmp(addr, addr2) == 0);
    }
}

static void check_grammar(const uint8_t *data, size_t size)
{
    static hm_moe_uid uids[HM_MOE_MAX_PATTERN_EXPERTS];
    char buf[HM_MOE_UID_MAX + 1], err[192], pat[HM_MOE_PATTERN_MAX + 8];
    hm_moe_uid u;
    uint32_t coord;
    uint8_t pk[HM_PK_BYTES];

    int r = hm_moe_uid_parse((const char *)data, size, &u);
    CHECK(r == 0 || r == -EINVAL);
    /* The checking form agrees, and names a rule whenever it refuses. */
    char why[160] = "";
    CHECK(hm_moe_uid_check((const char *)data, size, NULL, why, sizeof(why)) == r);
    CHECK(r == 0 || strncmp(why, "bad expert uid: ", 16) == 0);
    int nl = hm_moe_name_check((const char *)data, size, why, sizeof(why));
    CHECK(nl == -EINVAL || (nl >= 1 && nl <= HM_MOE_PREFIX_MAX && memchr(data, '.', (size_t)nl) == NULL));
    if (r == 0) {
        int n = hm_moe_uid_format(&u, buf, sizeof(buf));
        CHECK(n >= 0 && (size_t)n == size && memcmp(buf, data, size) == 0);
        for (unsigned l = 0; l < u.ndims; l++) {
            n = hm_moe_uid_prefix(&u, l, buf, sizeof(buf));
            CHECK(n > 0 && (size_t)n < size && memcmp(buf, data, (size_t)n) == 0);
        }
    }
    r = hm_moe_parse_prefix_subkey(data, size, &coord, pk);
    CHECK(r == 0 || r == -EINVAL);
    if (r == 0)
        CHECK(coord < HM_MOE_MAX_GRID);

    size_t pl = HM_MIN(size, sizeof(pat) - 1);
    memcpy(pat, data, pl);
    pat[pl] = '\0';
    size_t max = size > 0 ? (size_t)(data[0] & 1 ? 16 : HM_MOE_MAX_PATTERN_EXPERTS) : 16;
    r = hm_moe_pattern_expand(pat, uids, max, err, sizeof(err));
    CHECK(r == -EINVAL || r == -EMSGSIZE || (r >= 1 && (size_t)r <= max));
    if (r < 0)
        CHECK(err[0] != '\0');
    for (int i = 0; i < r; i++) {
        int n = hm_moe_uid_format(&uids[i], buf, sizeof(buf));
        CHECK(n > 0);
        CHECK(hm_moe_uid_parse(buf, (size_t)n, NULL) == 0);
    }
}

/* The host allow-list (ExpertHostsFile): documented errors only, rules
 * inside the caps, every prefix found again by lookup. */
static void check_allow(const uint8_t *data, size_t size)
{
    hm_moe_allow *a = NULL;
    char err[256];
    int r = hm_moe_allow_parse((const char *)data, size, &a, err, sizeof(err));
    CHECK(r == 0 || r == -EINVAL || r == -EMSGSIZE || r == -ENOMEM);
    if (r != 0) {
        CHECK(a == NULL);
        return;
    }
    CHECK(a != NULL && a->n <= HM_MOE_ALLOW_MAX_RULES);
    for (size_t i = 0; i < a->n; i++) {
        const hm_moe_allow_rule *rule = &a->rules[i];
        size_t l = strlen(rule->prefix);
        CHECK(l >= 1 && l <= HM_MOE_UID_MAX);
        CHECK(rule->n_keys >= 1 && rule->n_keys <= HM_MOE_ALLOW_MAX_KEYS);
        CHECK(hm_moe_allow_find(a, rule->prefix) == rule);
        CHECK(hm_moe_allow_permits(a, rule->prefix, rule->keys[0]));
    }
    hm_moe_allow_free(a);
}

/* An error reason is printable, bounded, and the input's own bytes where they were printable. */
static void check_error(const uint8_t *data, size_t size)
{
    char msg[HM_MOE_ERR_MAX + 1];
    hm_moe_decode_error(data, size, msg);
    size_t n = strlen(msg);
    CHECK(n == HM_MIN(size, (size_t)HM_MOE_ERR_MAX));
    for (size_t i = 0; i < n; i++) {
        CHECK(msg[i] >= 0x20 && msg[i] < 0x7f);
        CHECK(msg[i] == (char)data[i] || (msg[i] == '?' && (data[i] < 0x20 || data[i] >= 0x7f)) ||
              data[i] == '?');
    }
}

/* Revision 2: replies over sequences and info replies with heads and max_seq. */
static void check_seq(const uint8_t *data, size_t size)
{
    float out[2 * 3 * 4];
    char type[HM_MOE_TYPE_MAX + 1];
    size_t dim = 0, hidden = 0, heads = 0, max_seq = 0;
    int r = hm_moe_decode_out_seq(data, size, 0, 2, 3, 4, out);
    CHECK(r == 0 || r == -EINVAL || r == -EMSGSIZE || r == -EPROTO || r == -EDOM ||
          r == -ENOMEM);
    if (r == 0)
        for (size_t i = 0; i < 24; i++)
            CHECK(isfinite(out[i]));
    r = hm_moe_decode_info_seq(data, size, type, &dim, &hidden, &heads, &max_seq);
    CHECK(r == 0 || r == -EINVAL || r == -EMSGSIZE || r == -ENOMEM);
    if (r == 0)
        CHECK((heads == 0) == (max_seq == 0) && heads <= dim && max_seq <= HM_MOE_MAX_SEQ);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    check_seq(data, size);
    check_request(data, size, 0);
    check_request(data, size, 1);
    check_info(data, size);
    check_out(data, size, 0, 1, 1);
    check_out(data, size, 1, 2, 3);
    check_wrapped_out(data, size);
    check_values(data, size);
    check_grammar(data, size);
    check_allow(data, size);
    check_error(data, size);
    return 0;
}

/*
 * fuzz_avg_codec: fuzz target for the averaging chunk codec. Each input is
 * decoded as it stands (exercising the header checks), then its bytes are
 * used as the payload of a well-formed header for every compression, so
 * that the value checks (NaN and infinity, 8-bit range parameters) are
 * reached rather than stopped at the length check. Besides memory safety it
 * checks the codec's promises: only the documented errors come back; what
 * decodes is finite and of the declared count; a chunk that decodes
 * re-encodes to the same bytes (uncompressed and fp16) or within the
 * documented 8-bit error; an output one element short is refused. The same
 * bytes read as float32 values also go through the encoder, whose output
 * must decode within the documented bounds.
 */
#include "config.h"

#include "averaging/codec.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                           \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "fuzz_avg_codec: check failed at line %d: %s\n", __LINE__,       \
                    #cond);                                                                   \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    CHECK(p != NULL);
    return p;
}

/* Decodes one chunk and checks everything the contract promises about it. */
static void decode_and_check(const uint8_t *buf, size_t len)
{
    size_t n = 0, n2 = 0, peek_n = 0, cap = len, enc_len = 0;
    int comp = -1;
    int rc_peek = hm_avg_chunk_peek(buf, len, &comp, &peek_n);
    /* No chunk of len bytes holds more than len elements. */
    float *out = xmalloc(cap * sizeof(float));
    uint8_t *again;
    int rc;

    CHECK(rc_peek == 0 || rc_peek == -EPROTO || rc_peek == -EMSGSIZE);
    rc = hm_avg_chunk_decode(buf, len, out, cap, &n);
    CHECK(rc == 0 || rc == -EPROTO || rc == -EMSGSIZE || rc == -EDOM);
    if (rc_peek != 0) {
        CHECK(rc == rc_peek);
        goto out;
    }
    CHECK(peek_n <= cap);
    CHECK(hm_avg_chunk_size(comp, peek_n) == len);
    if (rc != 0) {
        CHECK(n == 0);
        CHECK(rc == -EDOM || (rc == -EPROTO && comp == HM_AVG_COMP_UINT8));
        goto out;
    }
    CHECK(n == peek_n);
    CHECK(hm_avg_all_finite(out, n));
    /* An output one element short is refused as a whole. */
    if (n > 0)
        CHECK(hm_avg_chunk_decode(buf, len, out, n - 1, &n2) == -EMSGSIZE && n2 == 0);

    /* What decoded re-encodes: exactly for none and fp16, within bounds for 8 bits. */
    again = xmalloc(len);
    CHECK(hm_avg_chunk_encode(comp, out, n, again, len, &enc_len) == 0);
    CHECK(enc_len == len);
    if (comp != HM_AVG_COMP_UINT8) {
        /* -0.0 and 0.0 both survive, so the bytes are the same. */
        CHECK(memcmp(again, buf, len) == 0);
    } else {
        float *out2 = xmalloc(n * sizeof(float));
        float mn = INFINITY, mx = -INFINITY;
        for (size_t i = 0; i < n; i++) {
            mn = fminf(mn, out[i]);
            mx = fmaxf(mx, out[i]);
        }
        CHECK(hm_avg_chunk_decode(again, enc_len, out2, n, &n2) == 0 && n2 == n);
        for (size_t i = 0; i < n; i++) {
            double bound = ((double)mx - (double)mn) / 510.0 +
                           0x1p-23 * fmax(fabs((double)mn), fabs((double)mx)) + 0x1p-149;
            CHECK(fabs((double)out[i] - (double)out2[i]) <= bound);
            CHECK(out2[i] >= mn && out2[i] <= mx);
        }
        free(out2);
    }
    free(again);
out:
    free(out);
}

/* Reads the bytes as float32 values, encodes them every way and checks the errors. */
static void encode_and_check(const uint8_t *data, size_t size)
{
    size_t n = size / 4;
    float *x = xmalloc(n * sizeof(float));
    float *out = xmalloc(n * sizeof(float));
    int finite;

    if (n > 0)
        memcpy(x, data, n * 4);
    finite = hm_avg_all_finite(x, n);
    for (int comp = 0; comp < HM_AVG_COMP_COUNT; comp++) {
        size_t cap = hm_avg_chunk_size(comp, n), len = 0, got = 0;
        uint8_t *buf = xmalloc(cap);
        float mn = INFINITY, mx = -INFINITY;
        int rc = hm_avg_chunk_encode(comp, x, n, buf, cap, &len);

        CHECK(rc == 0 || rc == -EDOM || rc == -ERANGE);
        CHECK((rc == -EDOM) == !finite);
        CHECK(rc != -ERANGE || comp == HM_AVG_COMP_FP16);
        if (rc != 0) {
            CHECK(len == 0);
            free(buf);
            continue;
        }
        CHECK(len == cap);
        CHECK(hm_avg_chunk_decode(buf, len, out, n, &got) == 0 && got == n);
        for (size_t i = 0; i < n; i++) {
            mn = fminf(mn, x[i]);
            mx = fmaxf(mx, x[i]);
        }
        for (size_t i = 0; i < n; i++) {
            double err = fabs((double)x[i] - (double)out[i]);
            if (comp == HM_AVG_COMP_NONE)
                CHECK(err == 0.0);
            else if (comp == HM_AVG_COMP_FP16)
                CHECK(err <= (fabsf(x[i]) >= 0x1p-14f ? 0x1p-11 * fabs((double)x[i]) : 0x1p-25));
            else
                CHECK(err <= ((double)mx - (double)mn) / 510.0 +
                                 0x1p-23 * fmax(fabs((double)mn), fabs((double)mx)) + 0x1p-149);
        }
        free(buf);
    }
    free(x);
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *chunk;

    decode_and_check(data, size);

    /*
     * The input as the payload of a well-formed chunk of every compression,
     * its length cut down to a whole number of elements.
     */
    chunk = xmalloc(size + HM_AVG_CHUNK_HEADER);
    for (int comp = 0; comp < HM_AVG_COMP_COUNT; comp++) {
        size_t params = comp == HM_AVG_COMP_UINT8 ? HM_AVG_CHUNK_UINT8_PARAMS : 0;
        size_t eb = comp == HM_AVG_COMP_NONE ? 4 : comp == HM_AVG_COMP_FP16 ? 2 : 1;
        size_t n, len;

        if (size < params)
            continue;
        n = (size - params) / eb;
        if (n > HM_AVG_CHUNK_MAX_ELEMS)
            n = HM_AVG_CHUNK_MAX_ELEMS;
        len = HM_AVG_CHUNK_HEADER + params + n * eb;
        chunk[0] = (uint8_t)comp;
        chunk[1] = chunk[2] = chunk[3] = 0;
        chunk[4] = (uint8_t)n;
        chunk[5] = (uint8_t)(n >> 8);
        chunk[6] = (uint8_t)(n >> 16);
        chunk[7] = (uint8_t)(n >> 24);
        memcpy(chunk + HM_AVG_CHUNK_HEADER, data, len - HM_AVG_CHUNK_HEADER);
        CHECK(hm_avg_chunk_peek(chunk, len, NULL, NULL) == 0);
        decode_and_check(chunk, len);
    }
    free(chunk);

    encode_and_check(data, size);
    return 0;
}

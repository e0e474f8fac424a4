/*
 * fuzz_allreduce: every all-reduce message decoder against arbitrary bytes.
 * Each input goes through the part, reply and notice decoders, each under
 * a small and the full chunk cap. Whatever decodes must stay inside the
 * input, obey the decoder's promises (member indices below the group cap,
 * a finite non-negative weight, a chunk whose codec header matches its
 * length and the element cap), decode its chunk values without trouble,
 * encode again and decode to the same message (an oracle: a mismatch
 * aborts). The seed corpus holds one valid message of each kind, with every
 * compression and both reply forms, and a version 1 part (refused).
 */
#include "config.h"

#include "averaging/allreduce.h"
#include "averaging/codec.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                           \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "fuzz_allreduce: check failed at line %d: %s\n", __LINE__, #cond); \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

#define SMALL_ELEMS 4096

static int inside(const uint8_t *base, size_t size, const uint8_t *p, size_t n)
{
    return p >= base && n <= size && (size_t)(p - base) <= size - n;
}

/* Decodes the chunk's values as the all-reduce would, into a bounded buffer. */
static void check_chunk(const uint8_t *p, size_t len, size_t max_elems)
{
    static float vals[SMALL_ELEMS];
    size_t n = 0, got = 0;
    int comp;
    CHECK(hm_avg_chunk_peek(p, len, &comp, &n) == 0);
    CHECK(n <= max_elems && comp >= 0 && comp < HM_AVG_COMP_COUNT);
    if (n > SMALL_ELEMS)
        return;
    if (hm_avg_chunk_decode(p, len, vals, SMALL_ELEMS, &got) == 0) {
        CHECK(got == n);
        CHECK(hm_avg_all_finite(vals, got));
    }
}

static void fuzz_part(const uint8_t *data, size_t size, size_t max_elems)
{
    hm_ar_part_msg m, again;
    hm_wire_wr w;
    size_t len;

    if (hm_ar_part_decode(data, size, max_elems, &m) != 0)
        return;
    CHECK(m.sender < HM_AVG_MAX_GROUP && m.span < HM_AVG_MAX_GROUP);
    CHECK(m.kind == HM_AR_DATA || m.kind == HM_AR_RESULT);
    CHECK(isfinite(m.weight) && m.weight >= 0);
    CHECK(m.kind == HM_AR_DATA || m.contrib_mask != 0);
    CHECK(inside(data, size, m.data, m.data_len));
    check_chunk(m.data, m.data_len, max_elems);

    hm_wire_wr_init_dynamic(&w, size + 256);
    hm_ar_part_encode(&w, &m);
    uint8_t *buf = hm_wire_wr_steal(&w, &len);
    CHECK(buf != NULL);
    CHECK(hm_ar_part_decode(buf, len, max_elems, &again) == 0);
    CHECK(memcmp(again.group_id, m.group_id, sizeof(m.group_id)) == 0);
    CHECK(again.sender == m.sender && again.span == m.span && again.chunk == m.chunk);
    CHECK(again.n_total == m.n_total && again.kind == m.kind && again.weight == m.weight);
    CHECK(again.dead_mask == m.dead_mask && again.bad_mask == m.bad_mask &&
          again.contrib_mask == m.contrib_mask);
    CHECK(again.data_len == m.data_len && memcmp(again.data, m.data, m.data_len) == 0);
    free(buf);
}

static void fuzz_reply(const uint8_t *data, size_t size, size_t max_elems)
{
    hm_ar_reply_msg m, again;
    hm_wire_wr w;
    size_t len;

    if (hm_ar_reply_decode(data, size, max_elems, &m) != 0)
        return;
    CHECK(m.form == HM_AR_FORM_AVERAGE || m.form == HM_AR_FORM_DELTA);
    CHECK(m.share >= 0.0 && m.share <= 1.0);
    CHECK(m.form == HM_AR_FORM_AVERAGE || m.data != NULL);
    if (m.data != NULL) {
        CHECK(inside(data, size, m.data, m.data_len));
        check_chunk(m.data, m.data_len, max_elems);
    }
    hm_wire_wr_init_dynamic(&w, size + 256);
    hm_ar_reply_encode(&w, &m);
    uint8_t *buf = hm_wire_wr_steal(&w, &len);
    CHECK(buf != NULL);
    CHECK(hm_ar_reply_decode(buf, len, max_elems, &again) == 0);
    CHECK(again.dead_mask == m.dead_mask && again.bad_mask == m.bad_mask &&
          again.contrib_mask == m.contrib_mask);
    CHECK(again.form == m.form && again.share == m.share);
    CHECK((again.data == NULL) == (m.data == NULL));
    if (m.data != NULL)
        CHECK(again.data_len == m.data_len && memcmp(again.data, m.data, m.data_len) == 0);
    free(buf);
}

static void fuzz_dead(const uint8_t *data, size_t size)
{
    hm_ar_dead_msg m, again;
    uint8_t buf[256];
    hm_wire_wr w;

    if (hm_ar_dead_decode(data, size, &m) != 0)
        return;
    CHECK(m.sender < HM_AVG_MAX_GROUP);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_ar_dead_encode(&w, &m);
    CHECK(hm_wire_wr_error(&w) == 0);
    CHECK(hm_ar_dead_decode(buf, w.len, &again) == 0);
    CHECK(memcmp(again.group_id, m.group_id, sizeof(m.group_id)) == 0);
    CHECK(again.sender == m.sender && again.n_total == m.n_total &&
          again.dead_mask == m.dead_mask && again.bad_mask == m.bad_mask);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* The version peek reads within the input, and only a version a decoder could take. */
    int version = hm_ar_msg_version(data, size);
    CHECK(version >= -1 && version <= 255);
    fuzz_part(data, size, SMALL_ELEMS);
    fuzz_part(data, size, HM_AR_MAX_CHUNK_ELEMS);
    fuzz_reply(data, size, SMALL_ELEMS);
    fuzz_reply(data, size, HM_AR_MAX_CHUNK_ELEMS);
    fuzz_dead(data, size);
    return 0;
}

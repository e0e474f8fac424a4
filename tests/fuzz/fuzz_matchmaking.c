/*
 * fuzz_matchmaking: every matchmaking message decoder (join, wait, reply,
 * DHT declaration) against arbitrary bytes. Each input goes to all four.
 * Whatever decodes must satisfy the decoder's promises (bounded keys,
 * finite non-negative bandwidths, 1..HM_AVG_MAX_GROUP distinct members)
 * and must encode again to bytes that decode to the same message (an
 * oracle: a mismatch aborts). The seed corpus holds one valid message of
 * every kind and reply code.
 */
#include "config.h"

#include "averaging/matchmaking.h"
#include "src/base/util.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                            \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);           \
            abort();                                                                           \
        }                                                                                      \
    } while (0)

static uint8_t enc[HM_MM_WIRE_MAX];

static int decode_ok(int rc)
{
    CHECK(rc == 0 || rc == -EINVAL || rc == -EMSGSIZE || rc == -EPROTO || rc == -ENOMEM);
    return rc == 0;
}

static int addr_eq(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
    return hm_addr_equal((const struct sockaddr *)a, (const struct sockaddr *)b);
}

static void bw_ok(double b) { CHECK(isfinite(b) && b >= 0); }

static void fuzz_join(const uint8_t *data, size_t size)
{
    hm_mm_join a, b;
    hm_wire_wr w;
    if (!decode_ok(hm_mm_decode_join(data, size, &a)))
        return;
    CHECK(a.key_len >= 1 && a.key_len <= HM_MM_KEY_MAX);
    bw_ok(a.bandwidth);
    CHECK(a.client == 0 || a.client == 1);
    hm_wire_wr_init_fixed(&w, enc, sizeof(enc));
    hm_mm_encode_join(&w, &a);
    CHECK(hm_wire_wr_error(&w) == 0);
    CHECK(hm_mm_decode_join(enc, w.len, &b) == 0);
    CHECK(a.key_len == b.key_len && memcmp(a.key, b.key, a.key_len) == 0);
    CHECK(addr_eq(&a.addr, &b.addr) && a.bandwidth == b.bandwidth && a.client == b.client &&
          a.deadline_ms == b.deadline_ms);
}

static void fuzz_wait(const uint8_t *data, size_t size)
{
    hm_mm_wait a, b;
    hm_wire_wr w;
    if (!decode_ok(hm_mm_decode_wait(data, size, &a)))
        return;
    CHECK(a.key_len >= 1 && a.key_len <= HM_MM_KEY_MAX);
    hm_wire_wr_init_fixed(&w, enc, sizeof(enc));
    hm_mm_encode_wait(&w, &a);
    CHECK(hm_wire_wr_error(&w) == 0);
    CHECK(hm_mm_decode_wait(enc, w.len, &b) == 0);
    CHECK(a.key_len == b.key_len && memcmp(a.key, b.key, a.key_len) == 0);
}

static void fuzz_reply(const uint8_t *data, size_t size)
{
    static hm_mm_reply a, b;
    hm_wire_wr w;
    if (!decode_ok(hm_mm_decode_reply(data, size, &a)))
        return;
    CHECK(a.code >= HM_MM_ACCEPTED && a.code <= HM_MM_DISBANDED);
    if (a.code == HM_MM_BEGIN) {
        CHECK(a.group.n >= 1 && a.group.n <= HM_AVG_MAX_GROUP);
        for (size_t i = 0; i < a.group.n; i++) {
            bw_ok(a.group.members[i].bandwidth);
            for (size_t k = 0; k < i; k++)
                CHECK(memcmp(a.group.members[i].pk, a.group.members[k].pk, HM_PK_BYTES) != 0);
        }
    } else {
        CHECK(a.group.n == 0);
    }
    CHECK(!a.has_leader || a.code == HM_MM_REDIRECT || a.code == HM_MM_DISBANDED);
    CHECK(a.code != HM_MM_REDIRECT || a.has_leader);
    hm_wire_wr_init_fixed(&w, enc, sizeof(enc));
    hm_mm_encode_reply(&w, &a);
    CHECK(hm_wire_wr_error(&w) == 0);
    CHECK(hm_mm_decode_reply(enc, w.len, &b) == 0);
    CHECK(a.code == b.code && a.has_leader == b.has_leader);
    if (a.code == HM_MM_ACCEPTED || a.has_leader)
        CHECK(a.deadline_ms == b.deadline_ms);
    if (a.has_leader)
        CHECK(memcmp(a.leader_pk, b.leader_pk, HM_PK_BYTES) == 0 &&
              addr_eq(&a.leader_addr, &b.leader_addr));
    if (a.code == HM_MM_BEGIN) {
        CHECK(a.group.n == b.group.n);
        CHECK(memcmp(a.group.group_id, b.group.group_id, HM_AVG_GROUP_ID_BYTES) == 0);
        for (size_t i = 0; i < a.group.n; i++) {
            const hm_avg_member *x = &a.group.members[i], *y = &b.group.members[i];
            CHECK(memcmp(x->pk, y->pk, HM_PK_BYTES) == 0 && addr_eq(&x->addr, &y->addr) &&
                  x->bandwidth == y->bandwidth);
        }
    }
}

static void fuzz_decl(const uint8_t *data, size_t size)
{
    hm_mm_decl a, b;
    hm_wire_wr w;
    if (!decode_ok(hm_mm_decode_decl(data, size, &a)))
        return;
    bw_ok(a.bandwidth);
    hm_wire_wr_init_fixed(&w, enc, sizeof(enc));
    hm_mm_encode_decl(&w, &a);
    CHECK(hm_wire_wr_error(&w) == 0);
    CHECK(hm_mm_decode_decl(enc, w.len, &b) == 0);
    CHECK(addr_eq(&a.addr, &b.addr) && a.bandwidth == b.bandwidth && a.client == b.client &&
          a.deadline_ms == b.deadline_ms && a.looking == b.looking);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_join(data, size);
    fuzz_wait(data, size);
    fuzz_reply(data, size);
    fuzz_decl(data, size);
    return 0;
}

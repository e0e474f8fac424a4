/*
 * fuzz_state: every state-sharing decoder (the DHT declaration, the
 * manifest, the manifest and chunk requests) against arbitrary bytes. Each
 * input goes to all four. Whatever decodes must satisfy the decoder's
 * promises (a chunking within bounds, a manifest holding exactly one hash
 * per chunk, a prefix without NUL or owner marker) and must encode again
 * to bytes that decode to the same message (an oracle: a mismatch aborts).
 * The seed corpus holds one valid message of every kind.
 */
#include "config.h"

#include "averaging/state.h"
#include "src/base/util.h"

#include <errno.h>
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

static int decode_ok(int rc)
{
    CHECK(rc == 0 || rc == -EINVAL || rc == -EMSGSIZE || rc == -EPROTO || rc == -ENOMEM);
    return rc == 0;
}

static void fuzz_decl(const uint8_t *data, size_t size)
{
    hm_state_decl a, b;
    uint8_t buf[HM_STATE_SMALL_MAX];
    hm_wire_wr w;
    if (!decode_ok(hm_state_decode_decl(data, size, &a)))
        return;
    CHECK(hm_state_n_chunks(a.total_len, a.chunk_size, UINT64_MAX) > 0);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_state_encode_decl(&w, &a);
    CHECK(hm_wire_wr_error(&w) == 0);
    CHECK(hm_state_decode_decl(buf, w.len, &b) == 0);
    CHECK(a.step == b.step && a.total_len == b.total_len && a.chunk_size == b.chunk_size);
    CHECK(memcmp(a.hash, b.hash, HM_STATE_HASH_BYTES) == 0);
    CHECK(hm_addr_equal((const struct sockaddr *)&a.addr, (const struct sockaddr *)&b.addr));
}

static void fuzz_manifest(const uint8_t *data, size_t size)
{
    hm_state_manifest a, b;
    hm_wire_wr w;
    if (!decode_ok(hm_state_decode_manifest(data, size, &a)))
        return;
    CHECK(a.n_chunks >= 1 && a.n_chunks <= HM_STATE_MAX_CHUNKS);
    CHECK(a.n_chunks == hm_state_n_chunks(a.total_len, a.chunk_size, UINT64_MAX));
    CHECK(a.hashes >= data && a.hashes + a.n_chunks * HM_STATE_HASH_BYTES <= data + size);
    hm_wire_wr_init_dynamic(&w, HM_STATE_MANIFEST_MAX);
    hm_state_encode_manifest(&w, a.step, a.total_len, a.chunk_size, a.hashes, a.n_chunks);
    CHECK(hm_wire_wr_error(&w) == 0);
    CHECK(hm_state_decode_manifest(w.buf, w.len, &b) == 0);
    CHECK(a.step == b.step && a.total_len == b.total_len && a.chunk_size == b.chunk_size &&
          a.n_chunks == b.n_chunks);
    CHECK(memcmp(a.hashes, b.hashes, a.n_chunks * HM_STATE_HASH_BYTES) == 0);
    hm_wire_wr_free(&w);
}

static void fuzz_req(const uint8_t *data, size_t size, int with_index)
{
    hm_state_req a, b;
    uint8_t buf[HM_STATE_SMALL_MAX];
    hm_wire_wr w;
    if (!decode_ok(hm_state_decode_req(data, size, with_index, &a)))
        return;
    size_t n = strlen(a.prefix);
    CHECK(n >= 1 && n <= HM_STATE_PREFIX_MAX);
    CHECK(strstr(a.prefix, "[owner:") == NULL);
    CHECK(with_index || a.index == 0);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_state_encode_req(&w, &a, with_index);
    CHECK(hm_wire_wr_error(&w) == 0);
    CHECK(hm_state_decode_req(buf, w.len, with_index, &b) == 0);
    CHECK(strcmp(a.prefix, b.prefix) == 0 && a.index == b.index);
    CHECK(memcmp(a.hash, b.hash, HM_STATE_HASH_BYTES) == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_decl(data, size);
    fuzz_manifest(data, size);
    fuzz_req(data, size, 0);
    fuzz_req(data, size, 1);
    return 0;
}

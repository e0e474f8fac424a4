/*
 * fuzz_dgram: the datagram opener against arbitrary bytes. Each input is
 * used three ways, each against fresh contexts so that an input behaves the
 * same whatever ran before it:
 *   1. opened as a datagram by node A (fixed-seed identity, fixed clock);
 *      only B's datagrams can be authentic, so anything else accepted aborts;
 *   2. sealed by node B as a payload for A, which must open it unchanged;
 *   3. XORed into a valid datagram from B, which A must reject unless the
 *      XOR changed nothing.
 * Case 1 also checks hm_dgram_sender_cached, the header-only look-up the
 * transport rates new keys with. Cases 2 and 3 are oracles: a violation aborts, which the driver and
 * libFuzzer report as a crash. The seed corpus holds datagrams from B to A
 * at FUZZ_DGRAM_NOW, so that mutations reach the decryption and replay code.
 */
#include "config.h"

#include "src/base/crypto.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_DGRAM_NOW (UINT64_C(1700000000) * 1000000u)
#define FUZZ_SEED_A 0xa1
#define FUZZ_SEED_B 0xb2

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/*
 * Fixed identities, derived once: a fuzz target is a single process whose
 * only job is this loop, and deriving keys per input would dominate its time.
 */
struct fixture {
    int ready;
    hm_identity a, b;
    uint8_t swarm[HM_SWARM_ID_BYTES];
};
static struct fixture fx;

static void fixture_init(void)
{
    uint8_t seed[32];
    if (fx.ready)
        return;
    if (hm_crypto_init() < 0)
        abort();
    memset(seed, FUZZ_SEED_A, sizeof(seed));
    if (hm_identity_from_seed(seed, &fx.a) < 0)
        abort();
    memset(seed, FUZZ_SEED_B, sizeof(seed));
    if (hm_identity_from_seed(seed, &fx.b) < 0)
        abort();
    hm_swarm_id("fuzz", NULL, 0, fx.swarm);
    fx.ready = 1;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fixture_init();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t pt[HM_DGRAM_MAX], dg[HM_DGRAM_MAX + 64], sender[HM_PK_BYTES];
    size_t pt_len = 0, dg_len = 0;
    hm_dgram_ctx *a = NULL, *b = NULL;
    int rc;

    fixture_init();
    if (hm_dgram_ctx_new(&fx.a, fx.swarm, 4, &a) < 0 ||
        hm_dgram_ctx_new(&fx.b, fx.swarm, 4, &b) < 0)
        abort();

    /* 1. The input as a received datagram. A fresh receiver has no key
     * cached, and only an authentic datagram caches its sender's. */
    if (hm_dgram_sender_cached(a, data, size) != 0)
        abort();
    rc = hm_dgram_open(a, data, size, FUZZ_DGRAM_NOW, sender, pt, sizeof(pt), &pt_len);
    if (rc == 0 && (pt_len + HM_DGRAM_OVERHEAD != size || memcmp(sender, fx.b.pk, 32) != 0))
        abort();
    if (hm_dgram_sender_cached(a, data, size) != (rc == 0))
        abort();
    /* Whatever it was, it is not accepted twice. */
    if (rc == 0 && hm_dgram_open(a, data, size, FUZZ_DGRAM_NOW, sender, pt, sizeof(pt),
                                 &pt_len) != -EALREADY)
        abort();

    /* A fresh receiver, so that a seed accepted above is not a replay below. */
    hm_dgram_ctx_free(a);
    if (hm_dgram_ctx_new(&fx.a, fx.swarm, 4, &a) < 0)
        abort();

    /* 2. The input as a payload: it must arrive intact. */
    size_t plen = size < HM_DGRAM_MAX_PAYLOAD ? size : HM_DGRAM_MAX_PAYLOAD;
    if (hm_dgram_seal(b, fx.a.pk, FUZZ_DGRAM_NOW, data, plen, dg, sizeof(dg), &dg_len) != 0)
        abort();
    rc = hm_dgram_open(a, dg, dg_len, FUZZ_DGRAM_NOW, sender, pt, sizeof(pt), &pt_len);
    if (rc != 0 || pt_len != plen || memcmp(pt, data, plen) != 0 ||
        memcmp(sender, fx.b.pk, 32) != 0)
        abort();

    /* 3. The input as damage to a valid datagram: any change must be caught. */
    static const char msg[] = "a valid datagram from b";
    if (hm_dgram_seal(b, fx.a.pk, FUZZ_DGRAM_NOW, msg, sizeof(msg), dg, sizeof(dg), &dg_len) != 0)
        abort();
    int changed = 0;
    size_t n = size < dg_len ? size : dg_len;
    for (size_t i = 0; i < n; i++) {
        dg[i] ^= data[i];
        changed |= data[i] != 0;
    }
    /* Input longer than the datagram extends it, up to a little past the limit. */
    size_t total = dg_len;
    if (size > dg_len) {
        size_t extra = size - dg_len;
        if (extra > sizeof(dg) - dg_len)
            extra = sizeof(dg) - dg_len;
        memcpy(dg + dg_len, data + dg_len, extra);
        total += extra;
        changed = 1;
    }
    rc = hm_dgram_open(a, dg, total, FUZZ_DGRAM_NOW, sender, pt, sizeof(pt), &pt_len);
    if (changed ? rc == 0 : rc != 0)
        abort();

    hm_dgram_ctx_free(a);
    hm_dgram_ctx_free(b);
    return 0;
}

/*
 * fuzz_opt_state: the collaborative optimizer's state check
 * (hmc_opt_state_check), the one reader of the state blob that donors
 * serve to a late trainer, on arbitrary bytes. The first byte picks
 * n_params (0..15) and n_stats (0..15, 2 per parameter in half the
 * cases) and whether the names are "exp_avg,exp_avg_sq" or none; the rest
 * is the blob. Besides memory safety it checks the check's promises: it
 * answers 0, -EPROTO or -EDOM; 0 only for a blob of exactly the header,
 * the padded names and n_params + n_stats finite floats, opening with the
 * magic and naming our sizes and names, with the epoch of its header.
 */
#include "config.h"

#include "lib/hivemind.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                           \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "fuzz_opt_state: check failed at line %d: %s\n", __LINE__,       \
                    #cond);                                                                   \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    size_t n = data[0] & 15;
    int named = (data[0] >> 4) & 1;
    size_t ns = named ? 2 * n : 0;
    const char *names = named ? "exp_avg,exp_avg_sq" : NULL;
    /* A copy of its own size, so that a read past the end trips ASan. */
    size_t len = size - 1;
    uint8_t *blob = malloc(len ? len : 1);
    CHECK(blob != NULL);
    memcpy(blob, data + 1, len);
    uint64_t epoch = 12345;
    int r = hmc_opt_state_check(blob, len, n, ns, names, &epoch);
    CHECK(r == 0 || r == -EPROTO || r == -EDOM);
    if (r == 0) {
        size_t nl = names != NULL ? strlen(names) : 0;
        size_t off = HMC_OPT_STATE_HEADER + ((nl + 3) & ~(size_t)3);
        CHECK(len == off + 4 * (n + ns));
        CHECK(memcmp(blob, "HMOPTST1", 8) == 0);
        CHECK(nl == 0 || memcmp(blob + HMC_OPT_STATE_HEADER, names, nl) == 0);
        uint64_t he, hn, hs;
        memcpy(&hn, blob + 16, 8);
        memcpy(&hs, blob + 24, 8);
        memcpy(&he, blob + 32, 8);
        CHECK(hn == n && hs == ns && he == epoch);
        for (size_t i = 0; i < n + ns; i++) {
            float x;
            memcpy(&x, blob + off + 4 * i, 4);
            CHECK(isfinite(x));
        }
    } else {
        CHECK(epoch == 12345);
    }
    free(blob);
    return 0;
}

/*
 * fuzz_diloco_state: the DiLoCo state check (hmc_diloco_state_check), the
 * one reader of a state blob that other peers serve, on arbitrary bytes.
 * The first byte picks n_params (0..255, so both the right and wrong sizes
 * come up); the rest is the blob. Besides memory safety it checks the
 * check's promises: it answers 0, -EPROTO or -EDOM; 0 only for a blob of
 * exactly 32 + 8 n bytes that opens with the magic, whose values are all
 * finite, with the round and the momentum flag of its header.
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
            fprintf(stderr, "fuzz_diloco_state: check failed at line %d: %s\n", __LINE__,    \
                    #cond);                                                                   \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    size_t n = data[0];
    /* A copy of its own size, so that a read past the end trips ASan. */
    size_t len = size - 1;
    uint8_t *blob = malloc(len ? len : 1);
    CHECK(blob != NULL);
    memcpy(blob, data + 1, len);
    uint64_t round = 12345;
    int mom = -1;
    int r = hmc_diloco_state_check(blob, len, n, &round, &mom);
    CHECK(r == 0 || r == -EPROTO || r == -EDOM);
    if (r == 0) {
        CHECK(n > 0 && len == HMC_DILOCO_STATE_HEADER + 8 * n);
        CHECK(memcmp(blob, "HMDILOCO", 8) == 0);
        uint64_t hr;
        uint32_t flags;
        memcpy(&flags, blob + 12, 4);
        memcpy(&hr, blob + 24, 8);
        CHECK(hr == round);
        CHECK(mom == (int)(flags & 1));
        for (size_t i = 0; i < 2 * n; i++) {
            float x;
            memcpy(&x, blob + HMC_DILOCO_STATE_HEADER + 4 * i, 4);
            CHECK(isfinite(x));
        }
    } else {
        CHECK(round == 12345 && mom == -1);
    }
    free(blob);
    return 0;
}

/*
 * fuzz_progress: the swarm-progress record decoder (src/daemon/progress.h)
 * against arbitrary bytes. Whatever decodes must be within the record's
 * bounds, must encode again to bytes that decode to the same record (an
 * oracle: a mismatch aborts), and must aggregate to finite numbers. The
 * seed corpus holds valid records (a trainer, a client).
 */
#include "config.h"

#include "src/daemon/progress.h"

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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    hm_progress_rec a, b;
    uint8_t buf[HM_PROGRESS_VALUE_MAX];
    size_t len;
    int rc = hm_progress_decode(data, size, &a);
    CHECK(rc == 0 || rc == -EINVAL || rc == -EMSGSIZE || rc == -EPROTO || rc == -ERANGE ||
          rc == -ENOMEM);
    if (rc != 0)
        return 0;
    CHECK(hm_progress_check(&a, NULL) == 0);
    CHECK(hm_progress_encode(&a, buf, sizeof(buf), &len) == 0);
    CHECK(hm_progress_decode(buf, len, &b) == 0);
    CHECK(a.epoch == b.epoch && a.samples == b.samples && a.client == b.client);
    CHECK(memcmp(&a.sps, &b.sps, sizeof(a.sps)) == 0 && memcmp(&a.time, &b.time, sizeof(a.time)) == 0);
    CHECK(strcmp(a.addr, b.addr) == 0);
    hm_progress_peer peers[3] = {{.r = a, .verified = 1}, {.r = b, .verified = 1, .unique = 1},
                                 {.r = a, .verified = 0}};
    hm_progress_rules rules = {.epoch_origins = 2, .origin_factor = 4};
    hm_progress_agg agg;
    hm_progress_aggregate(peers, 3, a.time + 1, 1000, &rules, &agg, NULL);
    CHECK(isfinite(agg.samples) && isfinite(agg.sps) && agg.global_epoch == a.epoch);
    CHECK(agg.n_origins == 2 && agg.unverified == 1);
    return 0;
}

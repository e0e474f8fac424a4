/*
 * fuzz_status_rec: the reader of the node summaries in the DHT
 * (src/daemon/status_rec.h) against arbitrary bytes. The first byte
 * chooses the shape: odd, the rest is the record's value under a valid
 * owner subkey (what a hostile member controls); even, the rest is a
 * whole record as JSON (what a broken reply could hold). Whatever is kept
 * must be within the reader's bounds: a peer id of its length, plain
 * strings within their limits, finite and non-negative numbers.
 */
#include "config.h"

#include "src/daemon/status_rec.h"
#include "src/base/crypto.h"

#include <jansson.h>
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

static int plain(const char *v, size_t max)
{
    if (v == NULL || strlen(v) > max)
        return 0;
    for (; *v; v++)
        if (!((*v >= 'a' && *v <= 'z') || (*v >= 'A' && *v <= 'Z') || (*v >= '0' && *v <= '9') ||
              strchr("._:@[]-", *v) != NULL))
            return 0;
    return 1;
}

static void check_nonneg(const json_t *o, const char *k)
{
    const json_t *v = json_object_get(o, k);
    CHECK(json_is_number(v));
    CHECK(isfinite(json_number_value(v)) && json_number_value(v) >= 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    json_t *rec = NULL;
    if (data[0] & 1) {
        char *val = malloc(size);
        if (val == NULL)
            return 0;
        memcpy(val, data + 1, size - 1);
        val[size - 1] = '\0';
        rec = json_pack("{s:s, s:s, s:f}", "subkey",
                        "[owner:abcdefghijklmnopqrstuvwxyz234567abcdefghijklmnopqrst]", "value",
                        val, "expiration", 1e9);
        free(val);
    } else {
        rec = json_loadb((const char *)data + 1, size - 1, 0, NULL);
    }
    if (rec == NULL)
        return 0;
    json_t *n = hm_status_node_of_record(rec, 1e9 - 10);
    if (n != NULL) {
        CHECK(strlen(json_string_value(json_object_get(n, "peer_id"))) == HM_PEER_ID_LEN);
        CHECK(plain(json_string_value(json_object_get(n, "address")), 95));
        CHECK(plain(json_string_value(json_object_get(n, "version")), 32));
        static const char *const nums[] = {"uptime_s", "peers", "rounds_ok", "rounds_failed",
                                           "n_experts", "expires_in_s", "age_s"};
        for (size_t i = 0; i < sizeof(nums) / sizeof(nums[0]); i++)
            check_nonneg(n, nums[i]);
        const json_t *x = json_object_get(n, "experts");
        CHECK(json_is_array(x));
        size_t i;
        const json_t *e;
        json_array_foreach(x, i, e)
        {
            CHECK(plain(json_string_value(json_object_get(e, "uid")), 64));
            check_nonneg(e, "requests");
            check_nonneg(e, "latency_p50_ms");
            check_nonneg(e, "latency_p99_ms");
            CHECK(json_number_value(json_object_get(e, "latency_p99_ms")) <= 3.6e6);
            CHECK(json_integer_value(json_object_get(e, "requests")) <= ((json_int_t)1 << 53));
        }
        json_decref(n);
    }
    json_decref(rec);
    return 0;
}

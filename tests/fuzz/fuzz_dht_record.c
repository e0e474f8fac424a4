/*
 * fuzz_dht_record: the DHT record decoder, and the store behind it. Every
 * input is parsed as a record's wire form; whatever parses must re-encode
 * to a form that parses to the same record, verify without crashing, and go
 * through a store's put and paged get with the store's accounting intact.
 * The seed corpus holds valid plain, dictionary and owned (signed) records.
 */
#include "config.h"

#include "dht/record.h"
#include "dht/store.h"

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

/* The corpus's records were made at this time, in a swarm named "fuzz". */
#define NOW 1700000000.0

static int same_record(const hm_dht_record *a, const hm_dht_record *b)
{
    return a->key_len == b->key_len && memcmp(a->key, b->key, a->key_len) == 0 &&
           a->has_subkey == b->has_subkey &&
           (!a->has_subkey ||
            (a->subkey_len == b->subkey_len &&
             (a->subkey_len == 0 || memcmp(a->subkey, b->subkey, a->subkey_len) == 0))) &&
           a->value_len == b->value_len &&
           (a->value_len == 0 || memcmp(a->value, b->value, a->value_len) == 0) &&
           memcmp(&a->expiration, &b->expiration, sizeof(double)) == 0 && a->seq == b->seq &&
           (a->sig == NULL) == (b->sig == NULL) &&
           (a->sig == NULL || memcmp(a->sig, b->sig, HM_DHT_SIG_BYTES) == 0);
}

static int inside(const uint8_t *data, size_t size, const uint8_t *p, size_t n)
{
    return n == 0 || (p >= data && p + n <= data + size);
}

static void exercise_store(const hm_dht_record *r, const uint8_t swarm[HM_SWARM_ID_BYTES])
{
    hm_dht_store_config cfg;
    hm_dht_store *st;
    hm_dht_store_stats s;
    hm_dht_get_result res;
    hm_dht_record out[4];
    uint8_t key_id[HM_DHT_KEY_ID_BYTES], storer[HM_NODE_ID_BYTES] = {1};
    int rc;

    hm_dht_store_config_default(&cfg);
    memcpy(cfg.swarm_id, swarm, HM_SWARM_ID_BYTES);
    CHECK(hm_dht_store_new(&cfg, &st) == 0);
    rc = hm_dht_store_put(st, r, storer, NOW);
    CHECK(rc == 0 || rc == -EMSGSIZE || rc == -EINVAL || rc == -EPERM || rc == -EBADMSG ||
          rc == -ETIME || rc == -ERANGE);
    hm_dht_key_id(r->key, r->key_len, key_id);
    CHECK(hm_dht_store_get(st, key_id, NOW, NULL, 0, HM_DHT_RECORD_MAX_WIRE, out, 4, &res) == 0);
    CHECK(res.n == (rc == 0 ? 1u : 0u));
    if (rc == 0) {
        /* What the store serves is what was put (expiration clamped), and it still verifies. */
        CHECK(out[0].value_len == r->value_len);
        CHECK(out[0].expiration <= r->expiration);
        CHECK(hm_dht_record_verify(&out[0], swarm, NULL) >= 0);
        /* The same record again is not newer. */
        CHECK(hm_dht_store_put(st, r, storer, NOW) == -ESTALE);
        hm_dht_store_stats_get(st, &s);
        CHECK(s.entries == 1 && s.bytes == hm_dht_store_peer_bytes(st, storer));
    }
    hm_dht_store_sweep(st, NOW + 2 * 86400.0 + 3600);
    hm_dht_store_stats_get(st, &s);
    CHECK(s.entries == 0 && s.bytes == 0 && s.peers == 0);
    hm_dht_store_free(st);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t swarm[HM_SWARM_ID_BYTES];
    uint8_t buf[HM_DHT_RECORD_MAX_WIRE];
    hm_dht_record r, again;
    hm_wire_wr w;
    int rc;

    hm_swarm_id("fuzz", NULL, 0, swarm);
    rc = hm_dht_record_parse(data, size, &r);
    CHECK(rc == 0 || rc == -EINVAL || rc == -EMSGSIZE || rc == -EPROTO || rc == -ENOMEM);
    if (rc != 0)
        goto out;

    CHECK(r.key_len >= 1 && r.key_len <= HM_DHT_KEY_MAX && inside(data, size, r.key, r.key_len));
    CHECK(!r.has_subkey || (r.subkey_len <= HM_DHT_SUBKEY_MAX &&
                            inside(data, size, r.subkey, r.subkey_len)));
    CHECK(r.value_len <= HM_DHT_VALUE_MAX && inside(data, size, r.value, r.value_len));
    CHECK(r.sig == NULL || inside(data, size, r.sig, HM_DHT_SIG_BYTES));

    /* Re-encoding fits the cap, has the predicted size and decodes to the same record. */
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_dht_record_encode(&w, &r);
    CHECK(hm_wire_wr_error(&w) == 0);
    CHECK(w.len == hm_dht_record_encoded_size(&r));
    CHECK(hm_dht_record_parse(buf, w.len, &again) == 0);
    CHECK(same_record(&r, &again));

    rc = hm_dht_record_verify(&r, swarm, NULL);
    CHECK(rc == 0 || rc == 1 || rc == -EINVAL || rc == -EPERM || rc == -EBADMSG);
    exercise_store(&r, swarm);
out:
    return 0;
}

/*
 * Tests for dht/store and dht/record: Hivemind's expiration rules (later
 * wins, subkeys merge, expiry, TTL clamp), owned records (forged
 * signatures, replays and non-owner overwrites refused, owner updates
 * accepted), quotas per peer and in total, paging of large dictionaries,
 * and the record's wire form. Real keys and real signatures throughout.
 */
#include "config.h"

#include "dht/record.h"
#include "dht/store.h"
#include "src/base/util.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NOW 1700000000.0

static uint8_t swarm[HM_SWARM_ID_BYTES];
static hm_identity alice, bob;
static const uint8_t peer_a[HM_NODE_ID_BYTES] = {0xa};
static const uint8_t peer_b[HM_NODE_ID_BYTES] = {0xb};
static const uint8_t peer_c[HM_NODE_ID_BYTES] = {0xc};

static void seeded(uint8_t tag, hm_identity *id)
{
    uint8_t seed[32];
    memset(seed, tag, sizeof(seed));
    cr_assert_eq(hm_identity_from_seed(seed, id), 0);
}

static void setup(void)
{
    cr_assert_eq(hm_crypto_init(), 0);
    hm_swarm_id("test-swarm", NULL, 0, swarm);
    seeded(1, &alice);
    seeded(2, &bob);
}

TestSuite(store, .init = setup);
TestSuite(record, .init = setup);

static hm_dht_store *new_store(void (*tweak)(hm_dht_store_config *))
{
    hm_dht_store_config cfg;
    hm_dht_store *st;
    hm_dht_store_config_default(&cfg);
    memcpy(cfg.swarm_id, swarm, sizeof(swarm));
    if (tweak != NULL)
        tweak(&cfg);
    cr_assert_eq(hm_dht_store_new(&cfg, &st), 0);
    return st;
}

static hm_dht_record rec(const char *key, const char *sub, const char *val, double exp)
{
    hm_dht_record r;
    memset(&r, 0, sizeof(r));
    r.key = (const uint8_t *)key;
    r.key_len = strlen(key);
    if (sub != NULL) {
        r.has_subkey = 1;
        r.subkey = (const uint8_t *)sub;
        r.subkey_len = strlen(sub);
    }
    r.value = (const uint8_t *)val;
    r.value_len = strlen(val);
    r.expiration = exp;
    return r;
}

static int put(hm_dht_store *st, const char *key, const char *sub, const char *val, double exp,
               const uint8_t *storer, double now)
{
    hm_dht_record r = rec(key, sub, val, exp);
    return hm_dht_store_put(st, &r, storer, now);
}

/* Gets one page of key; returns the count and fills out. */
static size_t get(hm_dht_store *st, const char *key, double now, hm_dht_record *out, size_t cap,
                  hm_dht_get_result *res)
{
    uint8_t id[HM_DHT_KEY_ID_BYTES];
    hm_dht_get_result local;
    hm_dht_key_id((const uint8_t *)key, strlen(key), id);
    if (res == NULL)
        res = &local;
    cr_assert_eq(hm_dht_store_get(st, id, now, NULL, 0, 4096, out, cap, res), 0);
    return res->n;
}

static int value_is(const hm_dht_record *r, const char *v)
{
    return r->value_len == strlen(v) && memcmp(r->value, v, r->value_len) == 0;
}

/* ---- Hivemind's semantics ---- */

Test(store, later_expiration_wins_earlier_is_refused)
{
    hm_dht_store *st = new_store(NULL);
    hm_dht_record out[4];

    cr_assert_eq(put(st, "k", NULL, "v1", NOW + 100, peer_a, NOW), 0);
    cr_assert_eq(put(st, "k", NULL, "v2", NOW + 200, peer_b, NOW), 0);
    cr_assert_eq(put(st, "k", NULL, "v3", NOW + 150, peer_a, NOW), -ESTALE);
    cr_assert_eq(put(st, "k", NULL, "v4", NOW + 200, peer_a, NOW), -ESTALE, "equal is not later");
    cr_assert_eq(get(st, "k", NOW, out, 4, NULL), 1);
    cr_assert(value_is(&out[0], "v2"));
    cr_assert_eq(out[0].expiration, NOW + 200);
    cr_assert_eq(out[0].has_subkey, 0);
    /* The replaced value's charge went away with it. */
    cr_assert_eq(hm_dht_store_peer_bytes(st, peer_a), 0);
    cr_assert_gt(hm_dht_store_peer_bytes(st, peer_b), 0);
    hm_dht_store_free(st);
}

Test(store, expired_records_refused_and_ttl_clamped)
{
    hm_dht_store *st = new_store(NULL);
    hm_dht_record out[2];

    cr_assert_eq(put(st, "k", NULL, "v", NOW, peer_a, NOW), -ETIME);
    cr_assert_eq(put(st, "k", NULL, "v", NOW - 5, peer_a, NOW), -ETIME);
    cr_assert_eq(put(st, "k", NULL, "v", NOW + 10 * 86400.0, peer_a, NOW), 0);
    cr_assert_eq(get(st, "k", NOW, out, 2, NULL), 1);
    cr_assert_eq(out[0].expiration, NOW + 86400.0, "expiration not clamped to max_ttl");
    cr_assert_eq(get(st, "k", NOW + 86399.0, out, 2, NULL), 1);
    cr_assert_eq(get(st, "k", NOW + 86400.0, out, 2, NULL), 0);
    hm_dht_record r = rec("k", NULL, "v", INFINITY);
    cr_assert_eq(hm_dht_store_put(st, &r, peer_a, NOW), -EINVAL);
    r.expiration = NAN;
    cr_assert_eq(hm_dht_store_put(st, &r, peer_a, NOW), -EINVAL);
    hm_dht_store_free(st);
}

Test(store, subkeys_merge_into_a_dictionary)
{
    hm_dht_store *st = new_store(NULL);
    hm_dht_record out[8];
    hm_dht_get_result res;

    cr_assert_eq(put(st, "d", "b", "vb", NOW + 100, peer_a, NOW), 0);
    cr_assert_eq(put(st, "d", "a", "va", NOW + 50, peer_b, NOW), 0);
    cr_assert_eq(put(st, "d", "c", "vc", NOW + 200, peer_a, NOW), 0);
    cr_assert_eq(put(st, "d", "a", "va2", NOW + 40, peer_a, NOW), -ESTALE);
    cr_assert_eq(put(st, "d", "a", "va3", NOW + 60, peer_a, NOW), 0);
    cr_assert_eq(get(st, "d", NOW, out, 8, &res), 3);
    cr_assert(res.is_dict);
    cr_assert_eq(res.expiration, NOW + 200);
    cr_assert(out[0].has_subkey && out[0].subkey_len == 1 && out[0].subkey[0] == 'a');
    cr_assert(value_is(&out[0], "va3"));
    cr_assert(value_is(&out[1], "vb"));
    cr_assert(value_is(&out[2], "vc"));
    /* Each subkey expires on its own. */
    cr_assert_eq(get(st, "d", NOW + 100, out, 8, NULL), 1);
    cr_assert(value_is(&out[0], "vc"));
    hm_dht_store_free(st);
}

Test(store, plain_and_dictionary_replace_each_other_by_expiration)
{
    hm_dht_store *st = new_store(NULL);
    hm_dht_record out[4];
    hm_dht_get_result res;

    cr_assert_eq(put(st, "x", NULL, "plain", NOW + 100, peer_a, NOW), 0);
    cr_assert_eq(put(st, "x", "s", "sub", NOW + 50, peer_a, NOW), -ESTALE);
    cr_assert_eq(put(st, "x", "s", "sub", NOW + 150, peer_a, NOW), 0);
    cr_assert_eq(get(st, "x", NOW, out, 4, &res), 1);
    cr_assert(res.is_dict && value_is(&out[0], "sub"));
    cr_assert_eq(put(st, "x", "t", "sub2", NOW + 120, peer_a, NOW), 0);
    cr_assert_eq(put(st, "x", NULL, "plain2", NOW + 140, peer_a, NOW), -ESTALE,
                 "a plain value must outlive every subkey");
    cr_assert_eq(put(st, "x", NULL, "plain3", NOW + 160, peer_b, NOW), 0);
    cr_assert_eq(get(st, "x", NOW, out, 4, &res), 1);
    cr_assert(!res.is_dict && value_is(&out[0], "plain3"));
    hm_dht_store_stats s;
    hm_dht_store_stats_get(st, &s);
    cr_assert_eq(s.entries, 1);
    cr_assert_eq(hm_dht_store_peer_bytes(st, peer_a), 0);
    hm_dht_store_free(st);
}

Test(store, sweep_frees_expired_entries)
{
    hm_dht_store *st = new_store(NULL);
    hm_dht_store_stats s;
    hm_dht_record out[2];
    char key[32];

    for (int i = 0; i < 100; i++) {
        snprintf(key, sizeof(key), "key%d", i);
        cr_assert_eq(put(st, key, i % 2 ? "s" : NULL, "v", NOW + 10 + (i % 2) * 100, peer_a, NOW),
                     0);
    }
    /* Lazily hidden before the sweep... */
    cr_assert_eq(get(st, "key0", NOW + 20, out, 2, NULL), 0);
    hm_dht_store_stats_get(st, &s);
    cr_assert_eq(s.entries, 100);
    /* ...and freed by it, with their charge. */
    cr_assert_eq(hm_dht_store_sweep(st, NOW + 20), 50);
    hm_dht_store_stats_get(st, &s);
    cr_assert_eq(s.entries, 50);
    cr_assert_eq(s.keys, 50);
    cr_assert_eq(hm_dht_store_sweep(st, NOW + 200), 50);
    hm_dht_store_stats_get(st, &s);
    cr_assert_eq(s.entries, 0);
    cr_assert_eq(s.keys, 0);
    cr_assert_eq(s.bytes, 0);
    cr_assert_eq(s.peers, 0);
    hm_dht_store_free(st);
}

/* ---- owned records ---- */

static char owned_key[128];
static char owned_sub[128];
static uint8_t sigbuf[8][HM_DHT_SIG_BYTES];

/* A record of key with alice's marker, signed by signer (NULL = unsigned). */
static hm_dht_record owned(const char *key, const char *sub, const char *val, double exp,
                           uint64_t seq, const hm_identity *signer, int slot)
{
    hm_dht_record r = rec(key, sub, val, exp);
    r.seq = seq;
    if (signer != NULL) {
        int rc = hm_dht_record_sign(&r, signer, swarm, NOW, 86400.0, sigbuf[slot]);
        cr_assert_eq(rc, 0, "sign: %d", rc);
        r.sig = sigbuf[slot];
    }
    return r;
}

static void make_owned_names(void)
{
    char marker[HM_DHT_OWNER_MARKER_LEN + 1];
    hm_dht_owner_marker(alice.pk, marker);
    snprintf(owned_key, sizeof(owned_key), "model%s", marker);
    snprintf(owned_sub, sizeof(owned_sub), "expert.3%s", marker);
}

Test(store, owned_record_signature_checked)
{
    hm_dht_store *st = new_store(NULL);
    hm_dht_record r, out[2];
    uint8_t forged[HM_DHT_SIG_BYTES];

    make_owned_names();
    r = owned(owned_key, NULL, "weights-v1", NOW + 100, 1, &alice, 0);
    cr_assert_eq(hm_dht_record_verify(&r, swarm, NULL), 1);

    /* Forged: a flipped bit, no signature, a signature for another value or swarm. */
    memcpy(forged, r.sig, sizeof(forged));
    forged[10] ^= 4;
    r.sig = forged;
    cr_assert_eq(hm_dht_store_put(st, &r, peer_b, NOW), -EBADMSG);
    r.sig = NULL;
    cr_assert_eq(hm_dht_store_put(st, &r, peer_b, NOW), -EBADMSG);
    r = owned(owned_key, NULL, "weights-v1", NOW + 100, 1, &alice, 0);
    r.value = (const uint8_t *)"weights-EVIL";
    r.value_len = 12;
    cr_assert_eq(hm_dht_store_put(st, &r, peer_b, NOW), -EBADMSG);
    r = owned(owned_key, NULL, "weights-v1", NOW + 100, 1, &alice, 0);
    r.seq = 9;
    cr_assert_eq(hm_dht_store_put(st, &r, peer_b, NOW), -EBADMSG, "seq is signed");
    uint8_t other_swarm[HM_SWARM_ID_BYTES];
    hm_swarm_id("other-swarm", NULL, 0, other_swarm);
    r = owned(owned_key, NULL, "weights-v1", NOW + 100, 1, NULL, 0);
    cr_assert_eq(hm_dht_record_sign(&r, &alice, other_swarm, NOW, 86400.0, sigbuf[0]), 0);
    r.sig = sigbuf[0];
    cr_assert_eq(hm_dht_store_put(st, &r, peer_b, NOW), -EBADMSG, "signed for another swarm");

    /* Bob cannot sign for alice's key. */
    r = owned(owned_key, NULL, "bob", NOW + 100, 1, NULL, 0);
    cr_assert_eq(hm_dht_record_sign(&r, &bob, swarm, NOW, 86400.0, sigbuf[0]), -EPERM);
    cr_assert_eq(hm_dht_store_get(st, (uint8_t[32]){0}, NOW, NULL, 0, 4096, out, 2,
                                  &(hm_dht_get_result){0}),
                 0);

    r = owned(owned_key, NULL, "weights-v1", NOW + 100, 1, &alice, 0);
    cr_assert_eq(hm_dht_store_put(st, &r, peer_b, NOW), 0, "anyone may carry a signed record");
    cr_assert_eq(get(st, owned_key, NOW, out, 2, NULL), 1);
    cr_assert(value_is(&out[0], "weights-v1"));
    cr_assert_not_null(out[0].sig);
    cr_assert_eq(out[0].seq, 1);
    /* What a get returns verifies at the next node. */
    cr_assert_eq(hm_dht_record_verify(&out[0], swarm, NULL), 1);
    hm_dht_store_free(st);
}

Test(store, owned_record_replay_and_overwrite_refused_owner_update_accepted)
{
    hm_dht_store *st = new_store(NULL);
    hm_dht_record r1, r2, r3, out[2];

    make_owned_names();
    r1 = owned(owned_key, NULL, "v1", NOW + 1000, 1, &alice, 0);
    r2 = owned(owned_key, NULL, "v2", NOW + 2000, 2, &alice, 1);
    cr_assert_eq(hm_dht_store_put(st, &r1, peer_a, NOW), 0);
    cr_assert_eq(hm_dht_store_put(st, &r2, peer_a, NOW + 1), 0);
    /* Replays of a lower or equal seq, even with a later expiration, are refused. */
    cr_assert_eq(hm_dht_store_put(st, &r1, peer_b, NOW + 2), -ESTALE);
    cr_assert_eq(hm_dht_store_put(st, &r2, peer_b, NOW + 2), -ESTALE);
    hm_dht_record r1b = owned(owned_key, NULL, "v1b", NOW + 5000, 1, &alice, 2);
    cr_assert_eq(hm_dht_store_put(st, &r1b, peer_b, NOW + 2), -ESTALE);
    /* Non-owners cannot overwrite: unsigned, or with a later expiration. */
    hm_dht_record evil = rec(owned_key, NULL, "evil", NOW + 3000);
    evil.seq = 100;
    cr_assert_eq(hm_dht_store_put(st, &evil, peer_b, NOW + 2), -EBADMSG);

    /* The owner may update with a higher seq, even shortening the expiration. */
    r3 = owned(owned_key, NULL, "v3", NOW + 50, 3, &alice, 3);
    cr_assert_eq(hm_dht_store_put(st, &r3, peer_a, NOW + 3), 0);
    cr_assert_eq(get(st, owned_key, NOW + 3, out, 2, NULL), 1);
    cr_assert(value_is(&out[0], "v3"));

    /* After v3 expires, its tombstone still refuses replays of v1 and v2. */
    cr_assert_eq(get(st, owned_key, NOW + 60, out, 2, NULL), 0);
    hm_dht_store_sweep(st, NOW + 60);
    hm_dht_store_stats s;
    hm_dht_store_stats_get(st, &s);
    cr_assert_eq(s.entries, 0);
    cr_assert_eq(s.tombstones, 1);
    cr_assert_eq(hm_dht_store_put(st, &r2, peer_b, NOW + 61), -ESTALE, "replay after expiry");
    cr_assert_eq(hm_dht_store_put(st, &r1, peer_b, NOW + 61), -ESTALE);
    /* The tombstone ends once every older version must have expired. */
    hm_dht_store_sweep(st, NOW + 3 + 86400 + 61);
    hm_dht_store_stats_get(st, &s);
    cr_assert_eq(s.tombstones, 0);
    hm_dht_store_free(st);
}

Test(store, owned_expiration_not_clamped_but_bounded)
{
    hm_dht_store *st = new_store(NULL);
    hm_dht_record r;

    make_owned_names();
    r = owned(owned_key, NULL, "v", NOW + 1000, 1, NULL, 0);
    r.expiration = NOW + 2 * 86400.0;
    /* The signer refuses to promise more than max_ttl... */
    cr_assert_eq(hm_dht_record_sign(&r, &alice, swarm, NOW, 86400.0, sigbuf[0]), -ERANGE);
    /* ...and the store refuses such a record rather than break its signature by clamping. */
    cr_assert_eq(hm_dht_record_sign(&r, &alice, swarm, NOW, 3 * 86400.0, sigbuf[0]), 0);
    r.sig = sigbuf[0];
    cr_assert_eq(hm_dht_store_put(st, &r, peer_a, NOW), -ERANGE);
    hm_dht_store_free(st);
}

Test(store, owned_subkey_in_a_public_dictionary)
{
    hm_dht_store *st = new_store(NULL);
    hm_dht_record r, out[4];

    make_owned_names();
    r = owned("experts", owned_sub, "alice's expert", NOW + 100, 5, &alice, 0);
    cr_assert_eq(hm_dht_store_put(st, &r, peer_a, NOW), 0);
    /* Others add their own subkeys to the same dictionary. */
    cr_assert_eq(put(st, "experts", "expert.4", "bob's expert", NOW + 100, peer_b, NOW), 0);
    /* Nobody else may overwrite alice's subkey... */
    cr_assert_eq(put(st, "experts", owned_sub, "hijack", NOW + 500, peer_b, NOW), -EBADMSG);
    /* ...or delete it by replacing the dictionary with a plain value. */
    cr_assert_eq(put(st, "experts", NULL, "wipe", NOW + 500, peer_b, NOW), -EPERM);
    cr_assert_eq(get(st, "experts", NOW, out, 4, NULL), 2);
    /* Once alice's subkey has expired, the dictionary may be replaced. */
    cr_assert_eq(put(st, "experts", NULL, "plain", NOW + 500, peer_b, NOW + 101), 0);
    hm_dht_store_free(st);
}

Test(store, malformed_markers_refused)
{
    hm_dht_store *st = new_store(NULL);
    char key[200], mk_a[HM_DHT_OWNER_MARKER_LEN + 1], mk_b[HM_DHT_OWNER_MARKER_LEN + 1];
    hm_dht_record r;

    hm_dht_owner_marker(alice.pk, mk_a);
    hm_dht_owner_marker(bob.pk, mk_b);
    /* A marker that is not at the end, or not a valid key, would mislead users. */
    snprintf(key, sizeof(key), "model%s.tail", mk_a);
    cr_assert_eq(put(st, key, NULL, "v", NOW + 10, peer_a, NOW), -EINVAL);
    cr_assert_eq(put(st, "model[owner:short]", NULL, "v", NOW + 10, peer_a, NOW), -EINVAL);
    snprintf(key, sizeof(key), "model%s", mk_a);
    key[strlen(key) - 2] = '1'; /* not in the base32 alphabet */
    cr_assert_eq(put(st, key, NULL, "v", NOW + 10, peer_a, NOW), -EINVAL);
    snprintf(key, sizeof(key), "[owner:%s", mk_a);
    cr_assert_eq(put(st, key, NULL, "v", NOW + 10, peer_a, NOW), -EINVAL, "two openers");
    /* Key and subkey naming different owners. */
    snprintf(key, sizeof(key), "model%s", mk_a);
    r = rec(key, mk_b, "v", NOW + 10);
    cr_assert_eq(hm_dht_store_put(st, &r, peer_a, NOW), -EPERM);
    hm_dht_store_free(st);
}

/* ---- quotas ---- */

/* These two test the per-identity quota and the totals with every put from
 * one origin, so the origin's share is the whole store. */
static void small_quotas(hm_dht_store_config *c)
{
    c->max_peer_bytes = 20000;
    c->max_bytes = 50000;
    c->max_origin_share = 1.0;
}

Test(store, flood_from_one_peer_refused_others_still_store)
{
    hm_dht_store *st = new_store(small_quotas);
    char key[32], val[600];
    int stored = 0, rc = 0;

    memset(val, 'x', sizeof(val) - 1);
    val[sizeof(val) - 1] = '\0';
    for (int i = 0; i < 1000; i++) {
        snprintf(key, sizeof(key), "flood%d", i);
        rc = put(st, key, NULL, val, NOW + 100, peer_a, NOW);
        if (rc != 0)
            break;
        stored++;
    }
    cr_assert_eq(rc, -EDQUOT);
    cr_assert_leq(hm_dht_store_peer_bytes(st, peer_a), 20000);
    cr_assert_gt(stored, 20);
    /* The flooder stays refused while another peer's store succeeds. */
    cr_assert_eq(put(st, "flood-more", NULL, val, NOW + 100, peer_a, NOW), -EDQUOT);
    cr_assert_eq(put(st, "honest", NULL, "hello", NOW + 100, peer_b, NOW), 0);
    /* A flooder's own updates that do not grow its charge still go through. */
    cr_assert_eq(put(st, "flood0", NULL, val, NOW + 200, peer_a, NOW), 0);

    /* The total: b and c fill what is left, then even a newcomer is refused. */
    for (int i = 0; i < 1000; i++) {
        snprintf(key, sizeof(key), "b%d", i);
        if (put(st, key, NULL, val, NOW + 100, peer_b, NOW) != 0)
            break;
    }
    for (int i = 0; i < 1000; i++) {
        snprintf(key, sizeof(key), "c%d", i);
        if ((rc = put(st, key, NULL, val, NOW + 100, peer_c, NOW)) != 0)
            break;
    }
    cr_assert_eq(rc, -ENOSPC);
    const uint8_t peer_d[HM_NODE_ID_BYTES] = {0xd};
    cr_assert_eq(put(st, "d", NULL, val, NOW + 100, peer_d, NOW), -ENOSPC);
    hm_dht_store_stats s;
    hm_dht_store_stats_get(st, &s);
    cr_assert_leq(s.bytes, 50000);

    /* Once the flood expires, its room is reclaimed on demand. */
    cr_assert_eq(put(st, "d", NULL, val, NOW + 300, peer_d, NOW + 150), 0);
    hm_dht_store_free(st);
}

static void few_entries(hm_dht_store_config *c)
{
    c->max_entries = 3;
    c->max_origin_share = 1.0;
}

Test(store, owned_records_are_never_evicted_for_room)
{
    hm_dht_store *st = new_store(few_entries);
    hm_dht_record r, out[2];

    make_owned_names();
    r = owned(owned_key, NULL, "keep me", NOW + 100, 1, &alice, 0);
    cr_assert_eq(hm_dht_store_put(st, &r, peer_a, NOW), 0);
    cr_assert_eq(put(st, "a", NULL, "v", NOW + 100, peer_b, NOW), 0);
    cr_assert_eq(put(st, "b", NULL, "v", NOW + 100, peer_b, NOW), 0);
    cr_assert_eq(put(st, "c", NULL, "v", NOW + 100, peer_b, NOW), -ENOSPC);
    cr_assert_eq(get(st, owned_key, NOW, out, 2, NULL), 1);
    cr_assert(value_is(&out[0], "keep me"));
    hm_dht_store_free(st);
}

/* ---- origins ---- */

static hm_origin origin_n(int last_octet)
{
    struct sockaddr_in a;
    hm_origin o;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons(4000);
    a.sin_addr.s_addr = htonl(0x7f000000u | (uint32_t)last_octet);
    hm_origin_of((const struct sockaddr *)&a, &o);
    return o;
}

/* A fresh identity for every put: identities are free. */
static int put_from(hm_dht_store *st, const char *key, const char *val, const hm_origin *o,
                    unsigned ident, double now)
{
    uint8_t storer[HM_NODE_ID_BYTES] = {0};
    memcpy(storer, &ident, sizeof(ident));
    storer[31] = o->b[4];
    hm_dht_record r = rec(key, NULL, val, NOW + 3600);
    return hm_dht_store_put_from(st, &r, storer, o, now);
}

static void thousand(hm_dht_store_config *c) { c->max_entries = 1000; }

Test(store, origin_share_bounds_a_flood_of_identities)
{
    hm_dht_store *st = new_store(thousand);
    hm_origin a = origin_n(2), b = origin_n(3);
    char key[32];
    int stored = 0, rc = 0;

    for (unsigned i = 0; i < 400; i++) {
        snprintf(key, sizeof(key), "flood%u", i);
        if ((rc = put_from(st, key, "v", &a, i, NOW)) != 0)
            break;
        stored++;
    }
    /* 12% of 1000 entries, whatever the number of identities. */
    cr_assert_eq(rc, -EDQUOT);
    cr_assert_eq(stored, 120);
    size_t bytes, entries;
    hm_dht_store_origin_usage(st, &a, &bytes, &entries);
    cr_assert_eq(entries, 120);
    /* Another origin still stores; the flooder's own updates still go through. */
    cr_assert_eq(put_from(st, "honest", "hello", &b, 1, NOW), 0);
    hm_dht_record r = rec("flood0", NULL, "v", NOW + 7200);
    uint8_t storer0[HM_NODE_ID_BYTES] = {0};
    storer0[31] = a.b[4];
    cr_assert_eq(hm_dht_store_put_from(st, &r, storer0, &a, NOW), 0);
    hm_dht_store_stats s;
    hm_dht_store_stats_get(st, &s);
    cr_assert_eq(s.refused_origin, 1);
    cr_assert_eq(s.origins, 2);
    hm_dht_store_free(st);
}

static void hundred_half(hm_dht_store_config *c)
{
    c->max_entries = 100;
    c->max_origin_share = 0.6;
}

Test(store, full_store_evicts_the_oldest_of_the_heaviest_origin)
{
    hm_dht_store *st = new_store(hundred_half);
    hm_origin a = origin_n(2), b = origin_n(3), h = origin_n(1);
    hm_dht_record out[2];
    char key[32];

    for (unsigned i = 0; i < 60; i++) {
        snprintf(key, sizeof(key), "a%u", i);
        cr_assert_eq(put_from(st, key, "v", &a, i, NOW + i * 0.001), 0);
    }
    for (unsigned i = 0; i < 40; i++) {
        snprintf(key, sizeof(key), "b%u", i);
        cr_assert_eq(put_from(st, key, "v", &b, i, NOW), 0);
    }
    /* Full. The next origin's put ends a's oldest entry, not b's. */
    cr_assert_eq(put_from(st, "honest0", "hello", &h, 7, NOW), 0);
    cr_assert_eq(get(st, "a0", NOW, out, 2, NULL), 0);
    cr_assert_eq(get(st, "a1", NOW, out, 2, NULL), 1);
    cr_assert_eq(get(st, "b0", NOW, out, 2, NULL), 1);
    cr_assert_eq(get(st, "honest0", NOW, out, 2, NULL), 1);

    /* Fair shares when full: h goes on until it is among the heaviest. */
    int rc = 0;
    unsigned n_h = 1;
    for (unsigned i = 1; i < 100; i++) {
        snprintf(key, sizeof(key), "honest%u", i);
        if ((rc = put_from(st, key, "hello", &h, 7, NOW)) != 0)
            break;
        n_h++;
    }
    cr_assert_eq(rc, -ENOSPC);
    size_t ba, ea, bb, eb, bh, eh;
    hm_dht_store_origin_usage(st, &a, &ba, &ea);
    hm_dht_store_origin_usage(st, &b, &bb, &eb);
    hm_dht_store_origin_usage(st, &h, &bh, &eh);
    cr_assert_eq(eh, n_h);
    cr_assert_eq(ea + eb + eh, 100);
    cr_assert_geq(eh, 33, "h holds %zu, a %zu, b %zu", eh, ea, eb);
    cr_assert_leq(ea, 34);
    cr_assert_leq(eb, 34);
    /* Every honest entry is still there. */
    for (unsigned i = 0; i < n_h; i++) {
        snprintf(key, sizeof(key), "honest%u", i);
        cr_assert_eq(get(st, key, NOW, out, 2, NULL), 1, "%s", key);
    }
    /* The flooders are refused from now on: they are the heaviest. */
    cr_assert_eq(put_from(st, "a-more", "v", &a, 999, NOW), -ENOSPC);
    hm_dht_store_stats s;
    hm_dht_store_stats_get(st, &s);
    cr_assert_eq(s.entries, 100);
    cr_assert_eq(s.evicted, n_h);
    cr_assert_geq(s.refused_full, 2);
    hm_dht_store_free(st);
}

Test(store, eviction_ends_an_owned_entry_with_its_tombstone)
{
    hm_dht_store *st = new_store(few_entries);
    hm_origin a = origin_n(2), h = origin_n(1);
    hm_dht_record r, out[2];
    uint8_t sa[HM_NODE_ID_BYTES] = {0x2a};

    make_owned_names();
    r = owned(owned_key, NULL, "v1", NOW + 100, 5, &alice, 0);
    cr_assert_eq(hm_dht_store_put_from(st, &r, sa, &a, NOW), 0);
    cr_assert_eq(put_from(st, "a1", "v", &a, 1, NOW), 0);
    cr_assert_eq(put_from(st, "a2", "v", &a, 2, NOW), 0);
    /* a holds all 3 entries; an honest put ends the oldest, the owned one. */
    cr_assert_eq(put_from(st, "h", "v", &h, 1, NOW), 0);
    cr_assert_eq(get(st, owned_key, NOW, out, 2, NULL), 0);
    hm_dht_store_stats s;
    hm_dht_store_stats_get(st, &s);
    cr_assert_eq(s.tombstones, 1);
    /* Its old version cannot come back. */
    r = owned(owned_key, NULL, "v1", NOW + 100, 5, &alice, 0);
    cr_assert_eq(hm_dht_store_put_from(st, &r, sa, &h, NOW), -ESTALE);
    hm_dht_store_free(st);
}

/* ---- paging ---- */

Test(store, large_dictionary_pages_by_bytes)
{
    hm_dht_store *st = new_store(NULL);
    uint8_t id[HM_DHT_KEY_ID_BYTES];
    uint8_t cursor[HM_DHT_SUBKEY_MAX];
    size_t cursor_len = 0, total = 0, pages = 0;
    char sub[32], val[400];
    int seen[300] = {0};
    hm_dht_record out[64];
    hm_dht_get_result res;

    memset(val, 'v', sizeof(val) - 1);
    val[sizeof(val) - 1] = '\0';
    for (int i = 0; i < 300; i++) {
        snprintf(sub, sizeof(sub), "s%03d", i);
        cr_assert_eq(put(st, "big", sub, val, NOW + 100, (uint8_t[32]){(uint8_t)(i % 50)}, NOW), 0);
    }
    hm_dht_key_id((const uint8_t *)"big", 3, id);
    do {
        size_t bytes = 0;
        cr_assert_eq(hm_dht_store_get(st, id, NOW, pages ? cursor : NULL, cursor_len, 1199, out,
                                      64, &res),
                     0);
        cr_assert_gt(res.n, 0);
        cr_assert(res.is_dict);
        for (size_t i = 0; i < res.n; i++) {
            int k;
            bytes += hm_dht_record_encoded_size(&out[i]);
            cr_assert_eq(sscanf((const char *)out[i].subkey, "s%3d", &k), 1);
            cr_assert_eq(seen[k], 0, "subkey %d returned twice", k);
            cr_assert_eq(k, (int)total, "out of order");
            seen[k] = 1;
            total++;
        }
        cr_assert_leq(bytes, 1199, "page over its byte budget");
        memcpy(cursor, out[res.n - 1].subkey, out[res.n - 1].subkey_len);
        cursor_len = out[res.n - 1].subkey_len;
        pages++;
        /* A subkey added behind the cursor does not disturb the walk. */
        if (pages == 3)
            cr_assert_eq(put(st, "big", "a-new", val, NOW + 100, peer_c, NOW), 0);
    } while (res.more);
    cr_assert_eq(total, 300);
    cr_assert_geq(pages, 100, "%zu pages", pages);
    /* A page too small for the next record says so instead of returning nothing forever. */
    cr_assert_eq(hm_dht_store_get(st, id, NOW, NULL, 0, 100, out, 64, &res), -EMSGSIZE);
    hm_dht_store_free(st);
}

/* ---- record wire form ---- */

Test(record, round_trip_and_size)
{
    hm_wire_wr w;
    hm_dht_record r, back;
    uint8_t buf[HM_DHT_RECORD_MAX_WIRE];

    make_owned_names();
    r = owned(owned_key, owned_sub, "value", NOW + 100, 42, &alice, 0);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_dht_record_encode(&w, &r);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    cr_assert_eq(w.len, hm_dht_record_encoded_size(&r));
    cr_assert_eq(hm_dht_record_parse(buf, w.len, &back), 0);
    cr_assert_eq(back.key_len, r.key_len);
    cr_assert_eq(memcmp(back.key, r.key, r.key_len), 0);
    cr_assert(back.has_subkey && back.subkey_len == r.subkey_len);
    cr_assert_eq(back.expiration, r.expiration);
    cr_assert_eq(back.seq, 42);
    cr_assert_eq(memcmp(back.sig, r.sig, HM_DHT_SIG_BYTES), 0);
    cr_assert_eq(hm_dht_record_verify(&back, swarm, NULL), 1);
    /* Truncated or trailing bytes are refused. */
    cr_assert_lt(hm_dht_record_parse(buf, w.len - 1, &back), 0);

    /* An unowned record without subkey or signature. */
    r = rec("k", NULL, "", NOW);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_dht_record_encode(&w, &r);
    cr_assert_eq(w.len, hm_dht_record_encoded_size(&r));
    cr_assert_eq(hm_dht_record_parse(buf, w.len, &back), 0);
    cr_assert(!back.has_subkey && back.sig == NULL && back.value_len == 0);
    cr_assert_eq(hm_dht_record_verify(&back, swarm, NULL), 0);
}

static int parse_packed(void (*build)(hm_wire_wr *w))
{
    uint8_t buf[4096];
    hm_wire_wr w;
    hm_dht_record r;
    int rc;

    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    build(&w);
    cr_assert_eq(hm_wire_wr_error(&w), 0);
    rc = hm_dht_record_parse(buf, w.len, &r);
    return rc;
}

static void b_str_key(hm_wire_wr *w)
{
    hm_wire_wr_array(w, 6);
    hm_wire_wr_cstr(w, "k");
    hm_wire_wr_nil(w);
    hm_wire_wr_bin(w, "v", 1);
    hm_wire_wr_double(w, NOW);
    hm_wire_wr_uint(w, 0);
    hm_wire_wr_nil(w);
}
static void b_five(hm_wire_wr *w)
{
    hm_wire_wr_array(w, 5);
    hm_wire_wr_bin(w, "k", 1);
    hm_wire_wr_nil(w);
    hm_wire_wr_bin(w, "v", 1);
    hm_wire_wr_double(w, NOW);
    hm_wire_wr_uint(w, 0);
}
static void b_short_sig(hm_wire_wr *w)
{
    static const uint8_t sig[63];
    hm_wire_wr_array(w, 6);
    hm_wire_wr_bin(w, "k", 1);
    hm_wire_wr_nil(w);
    hm_wire_wr_bin(w, "v", 1);
    hm_wire_wr_double(w, NOW);
    hm_wire_wr_uint(w, 0);
    hm_wire_wr_bin(w, sig, sizeof(sig));
}
static void b_big_value(hm_wire_wr *w)
{
    static const uint8_t v[HM_DHT_VALUE_MAX + 1];
    hm_wire_wr_array(w, 6);
    hm_wire_wr_bin(w, "k", 1);
    hm_wire_wr_nil(w);
    hm_wire_wr_bin(w, v, sizeof(v));
    hm_wire_wr_double(w, NOW);
    hm_wire_wr_uint(w, 0);
    hm_wire_wr_nil(w);
}
/* Each field under its cap, the whole over HM_DHT_RECORD_MAX_WIRE. */
static void b_big_total(hm_wire_wr *w)
{
    static const uint8_t v[HM_DHT_VALUE_MAX], k[HM_DHT_KEY_MAX];
    hm_wire_wr_array(w, 6);
    hm_wire_wr_bin(w, k, sizeof(k));
    hm_wire_wr_nil(w);
    hm_wire_wr_bin(w, v, sizeof(v));
    hm_wire_wr_double(w, NOW);
    hm_wire_wr_uint(w, 0);
    hm_wire_wr_nil(w);
}
static void b_nan(hm_wire_wr *w)
{
    hm_wire_wr_array(w, 6);
    hm_wire_wr_bin(w, "k", 1);
    hm_wire_wr_nil(w);
    hm_wire_wr_bin(w, "v", 1);
    hm_wire_wr_double(w, NAN);
    hm_wire_wr_uint(w, 0);
    hm_wire_wr_nil(w);
}
static void b_neg_seq(hm_wire_wr *w)
{
    hm_wire_wr_array(w, 6);
    hm_wire_wr_bin(w, "k", 1);
    hm_wire_wr_nil(w);
    hm_wire_wr_bin(w, "v", 1);
    hm_wire_wr_int(w, 1700000000);
    hm_wire_wr_int(w, -1);
    hm_wire_wr_nil(w);
}
static void b_int_exp(hm_wire_wr *w)
{
    hm_wire_wr_array(w, 6);
    hm_wire_wr_bin(w, "k", 1);
    hm_wire_wr_bin(w, "", 0);
    hm_wire_wr_bin(w, "v", 1);
    hm_wire_wr_uint(w, 1700000000);
    hm_wire_wr_uint(w, 3);
    hm_wire_wr_nil(w);
}

Test(record, malformed_wire_forms_refused)
{
    cr_assert_eq(parse_packed(b_str_key), -EPROTO);
    cr_assert_eq(parse_packed(b_five), -EPROTO);
    cr_assert_eq(parse_packed(b_short_sig), -EPROTO);
    cr_assert_lt(parse_packed(b_big_value), 0);
    cr_assert_eq(parse_packed(b_big_total), -EMSGSIZE);
    cr_assert_eq(parse_packed(b_nan), -EPROTO);
    cr_assert_eq(parse_packed(b_neg_seq), -EPROTO);
    /* An integer expiration and an empty subkey are fine. */
    cr_assert_eq(parse_packed(b_int_exp), 0);
}

Test(record, largest_owned_record_fits_a_datagram)
{
    char key[HM_DHT_KEY_MAX + 1], sub[HM_DHT_SUBKEY_MAX + 1], mk[HM_DHT_OWNER_MARKER_LEN + 1];
    static char val[HM_DHT_VALUE_MAX + 1];
    hm_dht_record r;
    size_t vlen;

    hm_dht_owner_marker(alice.pk, mk);
    snprintf(key, sizeof(key), "grid.0.0%s", mk);
    snprintf(sub, sizeof(sub), "expert%s", mk);
    /* The longest value that still fits the whole-record cap. */
    for (vlen = HM_DHT_VALUE_MAX; vlen > 0; vlen--) {
        memset(val, 'x', vlen);
        val[vlen] = '\0';
        r = rec(key, sub, val, NOW + 10);
        r.sig = sigbuf[0];
        r.seq = UINT64_MAX;
        if (hm_dht_record_encoded_size(&r) != 0)
            break;
    }
    cr_assert_geq(vlen, 800, "an owned record holds only %zu value bytes", vlen);
    cr_assert_leq(hm_dht_record_encoded_size(&r), HM_DGRAM_MAX_PAYLOAD - 99);
}

/* -- held since test -- */
/* The held times of key's live entries at now, in subkey order. */
static size_t get_held(hm_dht_store *st, const char *key, double now, hm_dht_record *out,
                       uint32_t *held, size_t cap)
{
    uint8_t id[HM_DHT_KEY_ID_BYTES];
    hm_dht_get_result res;
    hm_dht_key_id((const uint8_t *)key, strlen(key), id);
    cr_assert_eq(hm_dht_store_get_held(st, id, now, NULL, 0, 4096, out, held, cap, &res), 0);
    return res.n;
}

/* The held time of the entry whose subkey is sub, or -1. */
static long held_for(hm_dht_store *st, const char *key, const char *sub, double now)
{
    hm_dht_record out[8];
    uint32_t held[8];
    size_t n = get_held(st, key, now, out, held, 8);
    for (size_t i = 0; i < n; i++)
        if (out[i].has_subkey && out[i].subkey_len == strlen(sub) &&
            memcmp(out[i].subkey, sub, out[i].subkey_len) == 0)
            return (long)held[i];
    return -1;
}

Test(store, held_times_run_while_the_owner_refreshes_the_same_value)
{
    hm_dht_store *st = new_store(NULL);
    char ma[HM_DHT_OWNER_MARKER_LEN + 1], mb[HM_DHT_OWNER_MARKER_LEN + 1];
    hm_dht_owner_marker(alice.pk, ma);
    hm_dht_owner_marker(bob.pk, mb);
    hm_dht_record r;

    r = owned("ffn.1", ma, "A:1", NOW + 60, 1, &alice, 0);
    cr_assert_eq(hm_dht_store_put(st, &r, peer_a, NOW), 0);
    cr_assert_eq(held_for(st, "ffn.1", ma, NOW), 0);
    /* A refresh (higher seq, same value) keeps the time, from any storer. */
    r = owned("ffn.1", ma, "A:1", NOW + 80, 2, &alice, 1);
    cr_assert_eq(hm_dht_store_put(st, &r, peer_c, NOW + 20), 0);
    cr_assert_eq(held_for(st, "ffn.1", ma, NOW + 30), 30);
    /* Another owner, later and fresher, holds the name for less. */
    r = owned("ffn.1", mb, "B:1", NOW + 300, 1, &bob, 2);
    cr_assert_eq(hm_dht_store_put(st, &r, peer_b, NOW + 25), 0);
    cr_assert_eq(held_for(st, "ffn.1", mb, NOW + 30), 5);
    cr_assert_eq(held_for(st, "ffn.1", ma, NOW + 30), 30);
    /* A refused put (a replay) changes nothing. */
    r = owned("ffn.1", mb, "B:1", NOW + 300, 1, &bob, 2);
    cr_assert_eq(hm_dht_store_put(st, &r, peer_b, NOW + 31), -ESTALE);
    cr_assert_eq(held_for(st, "ffn.1", mb, NOW + 31), 6);
    /* Another value starts the time again. */
    r = owned("ffn.1", ma, "A:2", NOW + 100, 3, &alice, 3);
    cr_assert_eq(hm_dht_store_put(st, &r, peer_a, NOW + 40), 0);
    cr_assert_eq(held_for(st, "ffn.1", ma, NOW + 41), 1);
    /* So does a gap: the entry expired before its owner came back. */
    r = owned("ffn.1", ma, "A:2", NOW + 250, 4, &alice, 4);
    cr_assert_eq(hm_dht_store_put(st, &r, peer_a, NOW + 200), 0);
    cr_assert_eq(held_for(st, "ffn.1", ma, NOW + 205), 5);
    cr_assert_eq(held_for(st, "ffn.1", mb, NOW + 205), 180);
    /* The plain get returns the same records. */
    hm_dht_record out[4];
    cr_assert_eq(get(st, "ffn.1", NOW + 205, out, 4, NULL), 2);
    hm_dht_store_free(st);
}

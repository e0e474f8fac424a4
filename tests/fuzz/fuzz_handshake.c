/*
 * fuzz_handshake: the stream handshake and record parsers against arbitrary
 * bytes. The first input byte selects what the rest is fed to (its low two
 * bits) and, for records, the cipher (bit 2: 0 ChaCha20-Poly1305, 1
 * AES-256-GCM):
 *   0: a server handshake, as msg1 (and whatever follows);
 *   1: a client handshake that has sent msg1, as msg2 (and what follows);
 *   2: the record opener of a session from a real completed handshake;
 *   3: damage XORed into two valid records, which must then fail to open
 *      unless the XOR changed nothing.
 * Oracles abort: no fuzzed bytes may complete a handshake (that needs a
 * signature over fresh ephemeral keys) or open as a record in mode 2; a
 * msg1 of another version is refused as such (-EPROTONOSUPPORT); the
 * sessions in modes 2 and 3 rekey every 2 records, so the rekey path is
 * fuzzed too.
 * The client in mode 1 uses a fixed ephemeral key, so that the seed msg2
 * (a real server's answer to that client) passes the signature check and
 * mutations of it reach the session set-up.
 */
#include "config.h"

#include "src/base/crypto.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_SEED_CLIENT 0xc1
#define FUZZ_SEED_SERVER 0x5e
#define FUZZ_SEED_EPH 0xe9

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/*
 * Built once: identities, a client that has sent msg1, and the two sessions
 * of a completed handshake. Every input starts from copies of these plain
 * structs, so inputs do not affect each other and no key work is repeated.
 */
struct fixture {
    int ready;
    hm_identity client, server;
    uint8_t swarm[HM_SWARM_ID_BYTES];
    hm_handshake client_sent_msg1;
    hm_session cs[2], ss[2]; /* ChaCha20-Poly1305, AES-256-GCM */
};
static struct fixture fx;

/* A client handshake whose ephemeral key comes from a fixed seed. */
static void client_with_fixed_eph(hm_handshake *hs)
{
    uint8_t seed[crypto_kx_SEEDBYTES];
    /* A fixed cipher list too: the seed msg2 signs msg1, list included. */
    static const uint8_t list[] = {HM_CIPHER_AES_256_GCM, HM_CIPHER_CHACHA20_POLY1305};
    hm_hs_init_client(hs, &fx.client, fx.swarm, fx.server.pk);
    if (hm_hs_set_ciphers(hs, list, sizeof(list)) != 0)
        abort();
    memset(seed, FUZZ_SEED_EPH, sizeof(seed));
    crypto_kx_seed_keypair(hs->eph_pk, hs->eph_sk, seed);
    memcpy(hs->msg1 + 33, hs->eph_pk, 32);
    memcpy(hs->out, hs->msg1, HM_HS_MSG1_LEN);
}

static void fixture_init(void)
{
    uint8_t seed[32];
    hm_handshake c, s;
    size_t used;

    if (fx.ready)
        return;
    if (hm_crypto_init() < 0)
        abort();
    memset(seed, FUZZ_SEED_CLIENT, sizeof(seed));
    if (hm_identity_from_seed(seed, &fx.client) < 0)
        abort();
    memset(seed, FUZZ_SEED_SERVER, sizeof(seed));
    if (hm_identity_from_seed(seed, &fx.server) < 0)
        abort();
    hm_swarm_id("fuzz", NULL, 0, fx.swarm);

    client_with_fixed_eph(&fx.client_sent_msg1);
    fx.client_sent_msg1.out_len = 0;

    for (int i = 0; i < 2; i++) {
        uint8_t only = i ? HM_CIPHER_AES_256_GCM : HM_CIPHER_CHACHA20_POLY1305;
        hm_hs_init_client(&c, &fx.client, fx.swarm, fx.server.pk);
        hm_hs_init_server(&s, &fx.server, fx.swarm);
        if (hm_hs_set_ciphers(&c, &only, 1) != 0 || hm_hs_set_ciphers(&s, &only, 1) != 0)
            abort();
        if (hm_hs_input(&s, c.out, c.out_len, &used) != 0)
            abort();
        c.out_len = 0;
        if (hm_hs_input(&c, s.out, s.out_len, &used) != 1)
            abort();
        s.out_len = 0;
        if (hm_hs_input(&s, c.out, c.out_len, &used) != 1)
            abort();
        hm_hs_finish(&c, &fx.cs[i]);
        hm_hs_finish(&s, &fx.ss[i]);
        if (hm_session_set_rekey_records(&fx.cs[i], 2) != 0 ||
            hm_session_set_rekey_records(&fx.ss[i], 2) != 0)
            abort();
    }
    fx.ready = 1;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fixture_init();
    return 0;
}

static void fuzz_server(const uint8_t *data, size_t size)
{
    hm_handshake hs;
    size_t used = 0;
    hm_hs_init_server(&hs, &fx.server, fx.swarm);
    int rc = hm_hs_input(&hs, data, size, &used);
    if (rc == 1 || used > size || hs.out_len > sizeof(hs.out))
        abort();
    if (size > 0 && data[0] != HM_HS_VERSION &&
        (rc != -EPROTONOSUPPORT || hm_hs_peer_version(&hs) != data[0]))
        abort();
    hm_hs_wipe(&hs);
}

static void fuzz_client(const uint8_t *data, size_t size)
{
    hm_handshake hs = fx.client_sent_msg1;
    size_t used = 0;
    int rc = hm_hs_input(&hs, data, size, &used);
    if (used > size || hs.out_len > sizeof(hs.out))
        abort();
    /* Only the exact seed msg2 (a real server's signature) completes. */
    if (rc == 1 && (used != HM_HS_MSG2_LEN || hs.out_len != HM_HS_MSG3_LEN ||
                    memcmp(hs.session.peer_pk, fx.server.pk, HM_PK_BYTES) != 0))
        abort();
    hm_hs_wipe(&hs);
}

static void fuzz_records(int k, const uint8_t *data, size_t size)
{
    static uint8_t pt[HM_REC_MAX_PLAIN], buf[70000];
    hm_session ss;
    size_t used = 0, pt_len = 0;
    if (hm_session_dup(&fx.ss[k], &ss) != 0)
        abort();
    int rc = hm_session_open(&ss, data, size, &used, pt, &pt_len);
    if (rc == 1 || (rc == 0 && used != 0))
        abort();
    hm_session_wipe(&ss);
    /* The in-place opener, which the transport uses, on the same bytes. */
    if (size > sizeof(buf))
        return;
    memcpy(buf, data, size);
    uint8_t *p = NULL;
    if (hm_session_dup(&fx.ss[k], &ss) != 0)
        abort();
    rc = hm_session_open_inplace(&ss, buf, size, &used, &p, &pt_len);
    if (rc == 1 || (rc == 0 && used != 0))
        abort();
    hm_session_wipe(&ss);
    /* And the two-step opener, the rest going elsewhere, as the transport's reassembly. */
    memcpy(buf, data, size);
    hm_rec_open op;
    if (hm_session_dup(&fx.ss[k], &ss) != 0)
        abort();
    rc = hm_session_open_begin(&ss, buf, size, 5, &op);
    if (rc == 1) {
        if (op.consumed > size || op.head_len > 5 || op.pt_len > HM_REC_MAX_PLAIN)
            abort();
        if (hm_session_open_end(&ss, &op, pt) == 1)
            abort();
    }
    hm_session_wipe(&ss);
}

static void fuzz_damage(int k, const uint8_t *data, size_t size)
{
    static uint8_t pt[HM_REC_MAX_PLAIN];
    static const char m1[] = "first record", m2[] = "second, longer record";
    uint8_t buf[2 * (64 + HM_REC_OVERHEAD)];
    hm_session cs, ss;
    size_t len = 0, l, used, pt_len, off = 0;
    int changed = 0, opened = 0;

    if (hm_session_dup(&fx.cs[k], &cs) != 0 || hm_session_dup(&fx.ss[k], &ss) != 0)
        abort();
    if (hm_session_seal(&cs, m1, sizeof(m1), buf, &l) != 0)
        abort();
    len += l;
    if (hm_session_seal(&cs, m2, sizeof(m2), buf + len, &l) != 0)
        abort();
    len += l;
    for (size_t i = 0; i < size && i < len; i++) {
        buf[i] ^= data[i];
        changed |= data[i] != 0;
    }
    for (;;) {
        int rc = hm_session_open(&ss, buf + off, len - off, &used, pt, &pt_len);
        if (rc != 1)
            break;
        if (used == 0 || used > len - off)
            abort();
        off += used;
        opened++;
    }
    /* Untouched: both open. Touched: the first damaged record and all after it fail. */
    if (!changed && opened != 2)
        abort();
    if (changed) {
        size_t first = 0;
        while (first < size && first < len && data[first] == 0)
            first++;
        size_t first_rec_end = HM_REC_OVERHEAD + sizeof(m1);
        if (opened > (first < first_rec_end ? 0 : 1))
            abort();
    }
    hm_session_wipe(&cs);
    hm_session_wipe(&ss);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fixture_init();
    if (size == 0)
        return 0;
    const uint8_t *rest = data + 1;
    size_t n = size - 1;
    switch (data[0] % 4) {
    case 0:
        fuzz_server(rest, n);
        break;
    case 1:
        fuzz_client(rest, n);
        break;
    case 2:
        fuzz_records((data[0] >> 2) & 1, rest, n);
        break;
    default:
        fuzz_damage((data[0] >> 2) & 1, rest, n);
        break;
    }
    return 0;
}

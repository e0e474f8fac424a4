/*
 * Tests for crypto: identity files, peer ids, swarm binding, authenticated
 * datagrams with replay protection, the stream handshake and the record
 * layer. Everything runs on real keys and the real wire formats.
 */
#include "config.h"

#include "src/base/crypto.h"
#include "src/base/util.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

#define NOW (UINT64_C(1700000000) * 1000000u)

static char tmpdir[64];

static void setup(void)
{
    cr_assert_eq(hm_crypto_init(), 0);
}

/* Each test removes its files; the directory goes with the test's process. */
static void teardown(void)
{
    if (tmpdir[0] != '\0')
        rmdir(tmpdir);
}

TestSuite(crypto, .init = setup, .fini = teardown);

static void seeded(uint8_t tag, hm_identity *id)
{
    uint8_t seed[32];
    memset(seed, tag, sizeof(seed));
    cr_assert_eq(hm_identity_from_seed(seed, id), 0);
}

static const uint8_t *swarm_main(void)
{
    static uint8_t sid[HM_SWARM_ID_BYTES];
    hm_swarm_id("test-swarm", NULL, 0, sid);
    return sid;
}

/* ---- identity ---- */

static const char *tmp_path(const char *name)
{
    static char path[128];
    if (tmpdir[0] == '\0') {
        strcpy(tmpdir, "/tmp/hm-test-crypto-XXXXXX");
        cr_assert_not_null(mkdtemp(tmpdir));
    }
    snprintf(path, sizeof(path), "%s/%s", tmpdir, name);
    return path;
}

static void write_file(const char *path, const void *data, size_t len, mode_t mode)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, data, len), (ssize_t)len);
    cr_assert_eq(fchmod(fd, mode), 0);
    close(fd);
}

static size_t read_file(const char *path, uint8_t *buf, size_t cap)
{
    int fd = open(path, O_RDONLY);
    cr_assert_geq(fd, 0);
    ssize_t n = read(fd, buf, cap);
    cr_assert_geq(n, 0);
    close(fd);
    return (size_t)n;
}

Test(crypto, identity_create_then_reload)
{
    const char *p = tmp_path("id.key");
    char path[128];
    strcpy(path, p);
    hm_identity a, b;
    char err[256];

    cr_assert_eq(hm_identity_load_or_create(path, &a, err, sizeof(err)), 0, "%s", err);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_mode & 07777, 0600, "mode is %o", st.st_mode & 07777);
    cr_assert_eq(st.st_size, 64);

    uint8_t raw[128];
    cr_assert_eq(read_file(path, raw, sizeof(raw)), 64);
    cr_assert_arr_eq(raw, a.sk, 64);
    cr_assert_arr_eq(raw + 32, a.pk, 32);

    cr_assert_eq(hm_identity_load_or_create(path, &b, err, sizeof(err)), 0, "%s", err);
    cr_assert_arr_eq(a.pk, b.pk, 32);
    cr_assert_arr_eq(a.sk, b.sk, 64);
    cr_assert_str_eq(a.peer_id, b.peer_id);
    cr_assert_eq(strlen(a.peer_id), HM_PEER_ID_LEN);

    uint8_t nid[32];
    crypto_generichash(nid, 32, a.pk, 32, NULL, 0);
    cr_assert_arr_eq(a.node_id, nid, 32);

    /* The key actually signs, and the X25519 half matches the public key. */
    uint8_t sig[64], x[32];
    crypto_sign_detached(sig, NULL, (const uint8_t *)"m", 1, b.sk);
    cr_assert_eq(crypto_sign_verify_detached(sig, (const uint8_t *)"m", 1, a.pk), 0);
    crypto_scalarmult_base(x, b.x_sk);
    cr_assert_arr_eq(x, b.x_pk, 32);
    unlink(path);
}

Test(crypto, identity_refuses_group_or_world_access)
{
    char path[128];
    strcpy(path, tmp_path("open.key"));
    hm_identity a, b;
    char err[256];
    cr_assert_eq(hm_identity_load_or_create(path, &a, err, sizeof(err)), 0, "%s", err);

    const mode_t modes[] = {0640, 0604, 0660, 0606, 0700 | 0020};
    for (size_t i = 0; i < HM_ARRAY_LEN(modes); i++) {
        cr_assert_eq(chmod(path, modes[i]), 0);
        err[0] = '\0';
        int rc = hm_identity_load_or_create(path, &b, err, sizeof(err));
        cr_assert_eq(rc, -EACCES, "mode %o: rc %d", modes[i], rc);
        cr_assert_not_null(strstr(err, "group or others"), "err: %s", err);
        cr_assert_not_null(strstr(err, path), "err names the file: %s", err);
    }
    /* Refusing must not have replaced the key. */
    cr_assert_eq(chmod(path, 0600), 0);
    cr_assert_eq(hm_identity_load_or_create(path, &b, err, sizeof(err)), 0, "%s", err);
    cr_assert_arr_eq(a.pk, b.pk, 32);
    unlink(path);
}

Test(crypto, identity_refuses_truncated_long_and_corrupt_files)
{
    char path[128];
    strcpy(path, tmp_path("bad.key"));
    hm_identity a, b;
    char err[256];
    cr_assert_eq(hm_identity_load_or_create(path, &a, err, sizeof(err)), 0, "%s", err);
    uint8_t raw[65];
    memcpy(raw, a.sk, 64);
    raw[64] = '\n';

    write_file(path, raw, 63, 0600);
    cr_assert_eq(hm_identity_load_or_create(path, &b, err, sizeof(err)), -EINVAL);
    cr_assert_not_null(strstr(err, "63 bytes"), "err: %s", err);

    write_file(path, raw, 0, 0600);
    cr_assert_eq(hm_identity_load_or_create(path, &b, err, sizeof(err)), -EINVAL);

    write_file(path, raw, 65, 0600);
    cr_assert_eq(hm_identity_load_or_create(path, &b, err, sizeof(err)), -EINVAL);
    cr_assert_not_null(strstr(err, "65 bytes"), "err: %s", err);

    /* A public half that does not belong to the seed. */
    raw[40] ^= 1;
    write_file(path, raw, 64, 0600);
    cr_assert_eq(hm_identity_load_or_create(path, &b, err, sizeof(err)), -EINVAL);
    cr_assert_not_null(strstr(err, "does not match"), "err: %s", err);

    /* None of these refusals overwrote the file with a fresh key. */
    uint8_t back[128];
    cr_assert_eq(read_file(path, back, sizeof(back)), 64);
    cr_assert_arr_eq(back, raw, 64);
    unlink(path);
}

Test(crypto, identity_missing_directory_is_a_clear_error)
{
    char path[160];
    snprintf(path, sizeof(path), "%s/no-such-dir/id.key", tmp_path(""));
    hm_identity a;
    char err[256] = "";
    cr_assert_eq(hm_identity_load_or_create(path, &a, err, sizeof(err)), -ENOENT);
    cr_assert_not_null(strstr(err, "does not exist"), "err: %s", err);
    cr_assert_not_null(strstr(err, "no-such-dir"), "err: %s", err);
}

Test(crypto, identity_refuses_a_directory)
{
    char path[128];
    strcpy(path, tmp_path("dir.key"));
    cr_assert_eq(mkdir(path, 0700), 0);
    hm_identity a;
    char err[256] = "";
    cr_assert_lt(hm_identity_load_or_create(path, &a, err, sizeof(err)), 0);
    cr_assert_neq(err[0], '\0');
    rmdir(path);
}

Test(crypto, identity_seeded_is_deterministic_generated_is_not)
{
    hm_identity a, b, c, d;
    seeded(7, &a);
    seeded(7, &b);
    seeded(8, &c);
    cr_assert_arr_eq(a.sk, b.sk, 64);
    cr_assert_arr_neq(a.pk, c.pk, 32);
    cr_assert_eq(hm_identity_generate(&c), 0);
    cr_assert_eq(hm_identity_generate(&d), 0);
    cr_assert_arr_neq(c.pk, d.pk, 32);
    hm_identity_wipe(&d);
    uint8_t zero[sizeof(d)];
    memset(zero, 0, sizeof(zero));
    cr_assert_arr_eq(&d, zero, sizeof(d));
}

/* ---- peer ids ---- */

Test(crypto, peer_id_round_trip)
{
    for (int i = 0; i < 50; i++) {
        hm_identity id;
        seeded((uint8_t)i, &id);
        char s[HM_PEER_ID_LEN + 1];
        hm_peer_id_encode(id.pk, s);
        cr_assert_eq(strlen(s), HM_PEER_ID_LEN);
        cr_assert_str_eq(s, id.peer_id);
        for (size_t j = 0; j < HM_PEER_ID_LEN; j++)
            cr_assert((s[j] >= 'a' && s[j] <= 'z') || (s[j] >= '2' && s[j] <= '7'));
        uint8_t pk[32];
        cr_assert_eq(hm_peer_id_decode(s, strlen(s), pk), 0);
        cr_assert_arr_eq(pk, id.pk, 32);
    }
}

static void encode_raw(const uint8_t pk[32], char out[HM_PEER_ID_LEN + 1])
{
    cr_assert_eq(hm_base32_encode(pk, 32, out, HM_PEER_ID_LEN + 1), HM_PEER_ID_LEN);
}

Test(crypto, peer_id_rejections)
{
    hm_identity id;
    seeded(1, &id);
    char s[HM_PEER_ID_LEN + 2];
    uint8_t pk[32];

    strcpy(s, id.peer_id);
    cr_assert_eq(hm_peer_id_decode(s, HM_PEER_ID_LEN - 1, pk), -EINVAL);
    strcat(s, "a");
    cr_assert_eq(hm_peer_id_decode(s, HM_PEER_ID_LEN + 1, pk), -EINVAL);
    cr_assert_eq(hm_peer_id_decode("", 0, pk), -EINVAL);

    const char bad[] = {'1', '0', '8', '9', '=', '-', ' ', 'A', 'Z', '\0', (char)0xc3};
    for (size_t i = 0; i < sizeof(bad); i++) {
        strcpy(s, id.peer_id);
        s[10] = bad[i];
        cr_assert_eq(hm_peer_id_decode(s, HM_PEER_ID_LEN, pk), -EINVAL, "char %02x",
                     (unsigned char)bad[i]);
    }

    /*
     * 256 bits in 52 characters leave 4 padding bits in the last one; any
     * of them set is a second spelling of the same key and is refused.
     */
    static const char alpha[] = "abcdefghijklmnopqrstuvwxyz234567";
    strcpy(s, id.peer_id);
    int v = (int)(strchr(alpha, s[51]) - alpha);
    for (int bit = 0; bit < 4; bit++) {
        s[51] = alpha[v ^ (1 << bit)];
        cr_assert_eq(hm_peer_id_decode(s, HM_PEER_ID_LEN, pk), -EINVAL, "padding bit %d", bit);
    }

    /* Encodings that are not usable ed25519 keys. */
    uint8_t raw[32];
    memset(raw, 0, 32); /* a point of order 4 */
    encode_raw(raw, s);
    cr_assert_eq(hm_peer_id_decode(s, HM_PEER_ID_LEN, pk), -EINVAL);
    raw[0] = 1; /* the neutral element */
    encode_raw(raw, s);
    cr_assert_eq(hm_peer_id_decode(s, HM_PEER_ID_LEN, pk), -EINVAL);
    memset(raw, 0xff, 32); /* not canonical */
    raw[31] = 0x7f;
    encode_raw(raw, s);
    cr_assert_eq(hm_peer_id_decode(s, HM_PEER_ID_LEN, pk), -EINVAL);
    /* A valid key plus the order-8 torsion point is not in the main subgroup. */
    uint8_t torsion[32] = {0xc7, 0x17, 0x6a, 0x70, 0x3d, 0x4d, 0xd8, 0x4f, 0xba, 0x3c, 0x0b,
                           0x76, 0x0d, 0x10, 0x67, 0x0f, 0x2a, 0x20, 0x53, 0xfa, 0x2c, 0x39,
                           0xcc, 0xc6, 0x4e, 0xc7, 0xfd, 0x77, 0x92, 0xac, 0x03, 0x7a};
    cr_assert_eq(crypto_core_ed25519_add(raw, id.pk, torsion), 0);
    encode_raw(raw, s);
    cr_assert_eq(hm_peer_id_decode(s, HM_PEER_ID_LEN, pk), -EINVAL);
}

Test(crypto, peer_addr_parse)
{
    hm_identity id;
    seeded(2, &id);
    char s[128];
    uint8_t pk[32];
    struct sockaddr_storage ss;

    snprintf(s, sizeof(s), "%s@127.0.0.1:4242", id.peer_id);
    cr_assert_eq(hm_peer_addr_parse(s, pk, &ss), 0);
    cr_assert_arr_eq(pk, id.pk, 32);
    cr_assert_eq(ss.ss_family, AF_INET);
    cr_assert_eq(ntohs(((struct sockaddr_in *)&ss)->sin_port), 4242);

    snprintf(s, sizeof(s), "%s@[::1]:7", id.peer_id);
    cr_assert_eq(hm_peer_addr_parse(s, pk, &ss), 0);
    cr_assert_eq(ss.ss_family, AF_INET6);

    cr_assert_eq(hm_peer_addr_parse("127.0.0.1:4242", pk, &ss), -EINVAL);
    snprintf(s, sizeof(s), "%s127.0.0.1:4242", id.peer_id);
    cr_assert_eq(hm_peer_addr_parse(s, pk, &ss), -EINVAL);
    snprintf(s, sizeof(s), "%s@127.0.0.1", id.peer_id);
    cr_assert_eq(hm_peer_addr_parse(s, pk, &ss), -EINVAL);
    snprintf(s, sizeof(s), "%s@127.0.0.1:70000", id.peer_id);
    cr_assert_eq(hm_peer_addr_parse(s, pk, &ss), -EINVAL);
    snprintf(s, sizeof(s), "x%s@127.0.0.1:1", id.peer_id);
    cr_assert_eq(hm_peer_addr_parse(s, pk, &ss), -EINVAL);
}

/* ---- swarm binding ---- */

Test(crypto, swarm_id_depends_on_name_and_key)
{
    uint8_t a[32], a2[32], b[32], k1[32], k2[32], ka[32], kb[32], long_key[100];
    memset(long_key, 3, sizeof(long_key));
    hm_swarm_id("alpha", NULL, 0, a);
    hm_swarm_id("alpha", NULL, 0, a2);
    hm_swarm_id("beta", NULL, 0, b);
    cr_assert_arr_eq(a, a2, 32);
    cr_assert_arr_neq(a, b, 32);

    uint8_t key1[32], key2[32];
    memset(key1, 1, 32);
    memset(key2, 2, 32);
    hm_swarm_id("alpha", key1, 32, k1);
    hm_swarm_id("alpha", key2, 32, k2);
    cr_assert_arr_neq(a, k1, 32);
    cr_assert_arr_neq(k1, k2, 32);

    /* Keys of lengths BLAKE2b cannot take directly still bind. */
    hm_swarm_id("alpha", long_key, 8, ka);
    hm_swarm_id("alpha", long_key, 100, kb);
    cr_assert_arr_neq(ka, a, 32);
    cr_assert_arr_neq(kb, a, 32);
    cr_assert_arr_neq(ka, kb, 32);

    /* Name and key are not interchangeable: the empty name is its own swarm. */
    hm_swarm_id("", NULL, 0, ka);
    cr_assert_arr_neq(ka, a, 32);
}

Test(crypto, hex_codec)
{
    const uint8_t bytes[] = {0x00, 0x01, 0x7f, 0x80, 0xab, 0xcd, 0xef, 0xff};
    char hex[2 * sizeof(bytes) + 1];
    uint8_t back[sizeof(bytes)];

    hm_hex_encode(bytes, sizeof(bytes), hex);
    cr_assert_str_eq(hex, "00017f80abcdefff");
    hm_hex_encode(bytes, 0, hex);
    cr_assert_str_eq(hex, "");
    cr_assert_eq(hm_hex_decode("00017f80ABCDEFff", 16, back, sizeof(back)), 0);
    cr_assert_arr_eq(back, bytes, sizeof(bytes));
    cr_assert_eq(hm_hex_decode("", 0, back, 0), 0);
    /* Exactly 2 * out_len digits, nothing else. */
    cr_assert_eq(hm_hex_decode("00017f80abcdefff", 15, back, sizeof(back)), -EINVAL);
    cr_assert_eq(hm_hex_decode("00017f80abcdefff00", 18, back, sizeof(back)), -EINVAL);
    cr_assert_eq(hm_hex_decode("00017f80abcdefgf", 16, back, sizeof(back)), -EINVAL);
    cr_assert_eq(hm_hex_decode("00017f80abcd:fff", 16, back, sizeof(back)), -EINVAL);
    cr_assert_eq(hm_hex_decode("00017f80abcd efff", 16, back, sizeof(back)), -EINVAL);
    cr_assert_eq(hm_hex_decode("0001\0f80abcdefff", 16, back, sizeof(back)), -EINVAL);
}

Test(crypto, swarm_key_file)
{
    char path[128];
    strcpy(path, tmp_path("swarm.key"));
    const char hex[] = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF\n";
    uint8_t key[32], want[32];
    char err[256];
    cr_assert_eq(hm_hex_decode(hex, 64, want, 32), 0);

    write_file(path, hex, 65, 0600);
    cr_assert_eq(hm_swarm_key_load(path, key, err, sizeof(err)), 0, "%s", err);
    cr_assert_arr_eq(key, want, 32);
    write_file(path, hex, 64, 0600);
    cr_assert_eq(hm_swarm_key_load(path, key, err, sizeof(err)), 0, "%s", err);

    write_file(path, hex, 64, 0644);
    cr_assert_eq(hm_swarm_key_load(path, key, err, sizeof(err)), -EACCES);
    cr_assert_not_null(strstr(err, "group or others"), "err: %s", err);

    write_file(path, hex, 63, 0600);
    cr_assert_eq(hm_swarm_key_load(path, key, err, sizeof(err)), -EINVAL);
    cr_assert_not_null(strstr(err, "64 hex digits"), "err: %s", err);

    char bad[66];
    memcpy(bad, hex, 65);
    bad[5] = 'g';
    write_file(path, bad, 65, 0600);
    cr_assert_eq(hm_swarm_key_load(path, key, err, sizeof(err)), -EINVAL);

    char big[200];
    memset(big, 'a', sizeof(big));
    write_file(path, big, sizeof(big), 0600);
    cr_assert_eq(hm_swarm_key_load(path, key, err, sizeof(err)), -EINVAL);

    unlink(path);
    cr_assert_eq(hm_swarm_key_load(path, key, err, sizeof(err)), -ENOENT);
    cr_assert_not_null(strstr(err, path), "err: %s", err);
}

/* ---- datagrams ---- */

struct node {
    hm_identity id;
    hm_dgram_ctx *ctx;
};

static void node_init(struct node *n, uint8_t tag, const uint8_t *swarm, size_t max_peers)
{
    seeded(tag, &n->id);
    cr_assert_eq(hm_dgram_ctx_new(&n->id, swarm, max_peers, &n->ctx), 0);
    cr_assert_not_null(n->ctx);
}

static void node_free(struct node *n)
{
    hm_dgram_ctx_free(n->ctx);
    hm_identity_wipe(&n->id);
}

static size_t seal(struct node *from, const struct node *to, uint64_t now, const char *msg,
                   uint8_t *out)
{
    size_t len = 0;
    int rc = hm_dgram_seal(from->ctx, to->id.pk, now, msg, strlen(msg), out, HM_DGRAM_MAX, &len);
    cr_assert_eq(rc, 0, "seal: %d", rc);
    cr_assert_eq(len, strlen(msg) + HM_DGRAM_OVERHEAD);
    return len;
}

static int open_dg(struct node *at, const uint8_t *d, size_t len, uint64_t now,
                   uint8_t sender[32], uint8_t *pt, size_t *pt_len)
{
    uint8_t s[32], p[HM_DGRAM_MAX];
    size_t pl = 0;
    return hm_dgram_open(at->ctx, d, len, now, sender ? sender : s, pt ? pt : p, HM_DGRAM_MAX,
                         pt_len ? pt_len : &pl);
}

Test(crypto, dgram_round_trip_both_ways)
{
    struct node a, b;
    node_init(&a, 1, swarm_main(), 16);
    node_init(&b, 2, swarm_main(), 16);
    uint8_t d[HM_DGRAM_MAX], pt[HM_DGRAM_MAX], sender[32];
    size_t pl = 0;

    size_t len = seal(&a, &b, NOW, "hello b", d);
    cr_assert_eq(d[0], 1);
    cr_assert_arr_eq(d + 1, a.id.pk, 32);
    cr_assert_arr_eq(d + 33, b.id.pk, 8);
    cr_assert_eq(open_dg(&b, d, len, NOW + 5, sender, pt, &pl), 0);
    cr_assert_arr_eq(sender, a.id.pk, 32);
    cr_assert_eq(pl, 7);
    cr_assert_arr_eq(pt, "hello b", 7);

    len = seal(&b, &a, NOW + 10, "hello a", d);
    cr_assert_eq(open_dg(&a, d, len, NOW + 10, sender, pt, &pl), 0);
    cr_assert_arr_eq(sender, b.id.pk, 32);
    cr_assert_arr_eq(pt, "hello a", 7);

    /* Empty and maximal payloads. */
    size_t dl = 0;
    cr_assert_eq(hm_dgram_seal(a.ctx, b.id.pk, NOW, "", 0, d, sizeof(d), &dl), 0);
    cr_assert_eq(dl, HM_DGRAM_OVERHEAD);
    cr_assert_eq(open_dg(&b, d, dl, NOW, sender, pt, &pl), 0);
    cr_assert_eq(pl, 0);
    uint8_t big[HM_DGRAM_MAX_PAYLOAD + 1];
    randombytes_buf(big, sizeof(big));
    cr_assert_eq(hm_dgram_seal(a.ctx, b.id.pk, NOW, big, HM_DGRAM_MAX_PAYLOAD, d, sizeof(d), &dl),
                 0);
    cr_assert_eq(dl, HM_DGRAM_MAX);
    cr_assert_eq(open_dg(&b, d, dl, NOW, sender, pt, &pl), 0);
    cr_assert_arr_eq(pt, big, HM_DGRAM_MAX_PAYLOAD);
    node_free(&a);
    node_free(&b);
}

Test(crypto, dgram_size_checks)
{
    struct node a, b;
    node_init(&a, 1, swarm_main(), 16);
    node_init(&b, 2, swarm_main(), 16);
    uint8_t d[HM_DGRAM_MAX + 64], pt[HM_DGRAM_MAX], sender[32];
    size_t dl = 0, pl = 0;

    cr_assert_eq(hm_dgram_seal(a.ctx, b.id.pk, NOW, d, HM_DGRAM_MAX_PAYLOAD + 1, d + 0, sizeof(d),
                               &dl),
                 -EMSGSIZE);
    cr_assert_eq(hm_dgram_seal(a.ctx, b.id.pk, NOW, "abc", 3, d, 3 + HM_DGRAM_OVERHEAD - 1, &dl),
                 -EMSGSIZE);
    cr_assert_eq(hm_dgram_seal(a.ctx, a.id.pk, NOW, "abc", 3, d, sizeof(d), &dl), -EINVAL);

    size_t len = seal(&a, &b, NOW, "abcdef", d);
    /* Too long to be a datagram, too short to hold a tag, output too small. */
    cr_assert_eq(open_dg(&b, d, HM_DGRAM_MAX + 1, NOW, NULL, NULL, NULL), -EMSGSIZE);
    for (size_t n = 0; n < HM_DGRAM_OVERHEAD; n++)
        cr_assert_eq(open_dg(&b, d, n, NOW, NULL, NULL, NULL), -EINVAL, "len %zu", n);
    cr_assert_eq(hm_dgram_open(b.ctx, d, len, NOW, sender, pt, 5, &pl), -EMSGSIZE);
    cr_assert_eq(hm_dgram_open(b.ctx, d, len, NOW, sender, pt, 6, &pl), 0);
    node_free(&a);
    node_free(&b);
}

Test(crypto, dgram_every_flipped_bit_is_rejected)
{
    struct node a, b;
    node_init(&a, 1, swarm_main(), 64);
    node_init(&b, 2, swarm_main(), 64);
    uint8_t d[HM_DGRAM_MAX], t[HM_DGRAM_MAX];
    size_t len = seal(&a, &b, NOW, "a flipped bit anywhere must be caught", d);

    for (size_t i = 0; i < len; i++) {
        for (int bit = 0; bit < 8; bit++) {
            memcpy(t, d, len);
            t[i] ^= (uint8_t)(1u << bit);
            int rc = open_dg(&b, t, len, NOW, NULL, NULL, NULL);
            cr_assert_lt(rc, 0, "byte %zu bit %d accepted", i, bit);
            if (i == 0 || (i >= 33 && i < 41))
                cr_assert_eq(rc, -EINVAL, "header byte %zu: %d", i, rc);
        }
    }
    /* The failures left no state behind: the original is still accepted once. */
    cr_assert_eq(open_dg(&b, d, len, NOW, NULL, NULL, NULL), 0);
    node_free(&a);
    node_free(&b);
}

Test(crypto, dgram_replay_rejected_new_accepted)
{
    struct node a, b;
    node_init(&a, 1, swarm_main(), 16);
    node_init(&b, 2, swarm_main(), 16);
    uint8_t d1[HM_DGRAM_MAX], d2[HM_DGRAM_MAX];
    size_t l1 = seal(&a, &b, NOW, "one", d1);
    size_t l2 = seal(&a, &b, NOW, "two", d2);
    /* Sealed at the same clock reading, the timestamps still differ. */
    cr_assert_arr_neq(d1 + 41, d2 + 41, 8);
    cr_assert_eq(open_dg(&b, d1, l1, NOW, NULL, NULL, NULL), 0);
    cr_assert_eq(open_dg(&b, d1, l1, NOW, NULL, NULL, NULL), -EALREADY);
    cr_assert_eq(open_dg(&b, d1, l1, NOW + 1000000, NULL, NULL, NULL), -EALREADY);
    cr_assert_eq(open_dg(&b, d2, l2, NOW, NULL, NULL, NULL), 0);
    cr_assert_eq(open_dg(&b, d2, l2, NOW, NULL, NULL, NULL), -EALREADY);
    cr_assert_eq(open_dg(&b, d1, l1, NOW, NULL, NULL, NULL), -EALREADY);
    node_free(&a);
    node_free(&b);
}

Test(crypto, dgram_timestamp_window)
{
    struct node a, b, c;
    node_init(&a, 1, swarm_main(), 16);
    node_init(&b, 2, swarm_main(), 16);
    node_init(&c, 3, swarm_main(), 16);
    uint8_t d[HM_DGRAM_MAX];
    const uint64_t w = HM_DGRAM_WINDOW_US;

    /* Timestamps from the sender's clock: too old, then at the edges, then too new. */
    size_t len = seal(&a, &b, NOW - w - 1, "old", d);
    cr_assert_eq(open_dg(&b, d, len, NOW, NULL, NULL, NULL), -ESTALE);
    len = seal(&a, &b, NOW - w + 10, "just in time", d);
    cr_assert_eq(open_dg(&b, d, len, NOW + 10, NULL, NULL, NULL), 0);
    len = seal(&a, &b, NOW + w, "early but fine", d);
    cr_assert_eq(open_dg(&b, d, len, NOW, NULL, NULL, NULL), 0);
    len = seal(&c, &b, NOW + w + 1, "from the future", d);
    cr_assert_eq(open_dg(&b, d, len, NOW, NULL, NULL, NULL), -ESTALE);
    /* A datagram delayed past the window is refused even if never seen. */
    len = seal(&c, &b, NOW + w + 2, "late", d);
    cr_assert_eq(open_dg(&b, d, len, NOW + 3 * w, NULL, NULL, NULL), -ESTALE);
    node_free(&a);
    node_free(&b);
    node_free(&c);
}

Test(crypto, dgram_out_of_order_accepted_once_each)
{
    struct node a, b;
    node_init(&a, 1, swarm_main(), 16);
    node_init(&b, 2, swarm_main(), 16);
    enum { N = 8 };
    /* Offsets that cross bitmap words and reach the last bit of the window. */
    const uint64_t off[N] = {0, 1, 2, 63, 64, 65, 700, 1023};
    uint8_t d[N][HM_DGRAM_MAX];
    size_t len[N];
    for (int i = 0; i < N; i++)
        len[i] = seal(&a, &b, NOW + off[i], "x", d[i]);
    const int order[N] = {7, 0, 3, 1, 6, 2, 5, 4};
    for (int k = 0; k < N; k++) {
        int i = order[k];
        cr_assert_eq(open_dg(&b, d[i], len[i], NOW, NULL, NULL, NULL), 0, "datagram %d", i);
        for (int j = 0; j <= k; j++)
            cr_assert_eq(open_dg(&b, d[order[j]], len[order[j]], NOW, NULL, NULL, NULL),
                         -EALREADY, "replay of %d after %d", order[j], i);
    }

    /* Older than the window reaches below the highest seen: refused. */
    uint8_t e[2][HM_DGRAM_MAX];
    size_t el0 = seal(&a, &b, NOW + 5000, "older", e[0]);
    size_t el1 = seal(&a, &b, NOW + 5000 + 1024, "newer", e[1]);
    cr_assert_eq(open_dg(&b, e[1], el1, NOW, NULL, NULL, NULL), 0);
    cr_assert_lt(open_dg(&b, e[0], el0, NOW, NULL, NULL, NULL), 0);

    /* A long jump forward clears the window; later ones keep working. */
    size_t l = seal(&a, &b, NOW + 100000, "jump", d[0]);
    size_t l2 = seal(&a, &b, NOW + 100000, "next", d[1]);
    cr_assert_eq(open_dg(&b, d[1], l2, NOW, NULL, NULL, NULL), 0);
    cr_assert_eq(open_dg(&b, d[0], l, NOW, NULL, NULL, NULL), 0);
    cr_assert_eq(open_dg(&b, d[0], l, NOW, NULL, NULL, NULL), -EALREADY);
    node_free(&a);
    node_free(&b);
}

Test(crypto, dgram_other_swarm_rejected)
{
    uint8_t other[32], keyed[32], psk[32];
    hm_swarm_id("other-swarm", NULL, 0, other);
    memset(psk, 9, sizeof(psk));
    hm_swarm_id("test-swarm", psk, sizeof(psk), keyed);
    struct node a, x, y, b;
    node_init(&a, 1, other, 16);
    node_init(&x, 1, keyed, 16);
    node_init(&y, 1, swarm_main(), 16);
    node_init(&b, 2, swarm_main(), 16);
    uint8_t d[HM_DGRAM_MAX];

    size_t len = seal(&a, &b, NOW, "wrong swarm name", d);
    cr_assert_eq(open_dg(&b, d, len, NOW, NULL, NULL, NULL), -EBADMSG);
    len = seal(&x, &b, NOW, "has a swarm key b lacks", d);
    cr_assert_eq(open_dg(&b, d, len, NOW, NULL, NULL, NULL), -EBADMSG);
    /* The same key in the right swarm is accepted. */
    len = seal(&y, &b, NOW, "right swarm", d);
    cr_assert_eq(open_dg(&b, d, len, NOW, NULL, NULL, NULL), 0);
    node_free(&a);
    node_free(&x);
    node_free(&y);
    node_free(&b);
}

Test(crypto, dgram_impostor_and_wrong_recipient_rejected)
{
    struct node a, b, c;
    node_init(&a, 1, swarm_main(), 16);
    node_init(&b, 2, swarm_main(), 16);
    node_init(&c, 3, swarm_main(), 16);
    uint8_t d[HM_DGRAM_MAX], sender[32];

    /* C seals with its own key but claims to be A. */
    size_t len = seal(&c, &b, NOW, "i am a", d);
    memcpy(d + 1, a.id.pk, 32);
    cr_assert_eq(open_dg(&b, d, len, NOW, sender, NULL, NULL), -EBADMSG);
    /* A datagram for B is refused by C before any crypto. */
    len = seal(&a, &b, NOW, "for b", d);
    cr_assert_eq(open_dg(&c, d, len, NOW, NULL, NULL, NULL), -EINVAL);
    /* Even with the recipient prefix rewritten, C lacks the A-B pair key. */
    memcpy(d + 33, c.id.pk, 8);
    cr_assert_eq(open_dg(&c, d, len, NOW, NULL, NULL, NULL), -EBADMSG);
    /* A datagram claiming to come from ourselves is refused. */
    len = seal(&a, &b, NOW, "self", d);
    memcpy(d + 1, b.id.pk, 32);
    cr_assert_eq(open_dg(&b, d, len, NOW, NULL, NULL, NULL), -EINVAL);
    /* A sender key that is a low-order point never yields a pair key. */
    len = seal(&a, &b, NOW, "low order", d);
    memset(d + 1, 0, 32);
    cr_assert_eq(open_dg(&b, d, len, NOW, NULL, NULL, NULL), -EBADMSG);
    d[1] = 1;
    cr_assert_eq(open_dg(&b, d, len, NOW, NULL, NULL, NULL), -EBADMSG);
    uint8_t zero[32] = {0};
    size_t dl;
    cr_assert_eq(hm_dgram_seal(a.ctx, zero, NOW, "x", 1, d, sizeof(d), &dl), -EINVAL);
    node_free(&a);
    node_free(&b);
    node_free(&c);
}

Test(crypto, dgram_replay_table_is_bounded)
{
    struct node b, s[4];
    node_init(&b, 2, swarm_main(), 2);
    for (int i = 0; i < 4; i++)
        node_init(&s[i], (uint8_t)(10 + i), swarm_main(), 4);
    uint8_t d[HM_DGRAM_MAX], old2[HM_DGRAM_MAX];
    const uint64_t w = HM_DGRAM_WINDOW_US;

    size_t len = seal(&s[0], &b, NOW, "s0", d);
    cr_assert_eq(open_dg(&b, d, len, NOW, NULL, NULL, NULL), 0);
    size_t old2_len = seal(&s[1], &b, NOW, "s1", old2);
    cr_assert_eq(open_dg(&b, old2, old2_len, NOW, NULL, NULL, NULL), 0);
    /* Full of live entries: a third sender is refused, known ones still pass. */
    len = seal(&s[2], &b, NOW, "s2", d);
    cr_assert_eq(open_dg(&b, d, len, NOW + 1, NULL, NULL, NULL), -ENOBUFS);
    /* Idle for exactly twice the window is not yet enough to be recycled. */
    len = seal(&s[2], &b, NOW + 2 * w, "s2 at the edge", d);
    cr_assert_eq(open_dg(&b, d, len, NOW + 2 * w, NULL, NULL, NULL), -ENOBUFS);
    len = seal(&s[0], &b, NOW + 1, "s0 again", d);
    cr_assert_eq(open_dg(&b, d, len, NOW + 1, NULL, NULL, NULL), 0);
    /* Sending never needs a slot. */
    len = seal(&b, &s[3], NOW + 2, "b to s3", d);
    cr_assert_eq(open_dg(&s[3], d, len, NOW + 2, NULL, NULL, NULL), 0);

    /* Once idle for twice the window, the least recently used entry is recycled. */
    const uint64_t later = NOW + 2 * w + 10;
    len = seal(&s[2], &b, later, "s2 later", d);
    cr_assert_eq(open_dg(&b, d, len, later, NULL, NULL, NULL), 0);
    /* s1 lost its entry, but its old datagram is out of the window by now. */
    cr_assert_eq(open_dg(&b, old2, old2_len, later, NULL, NULL, NULL), -ESTALE);
    len = seal(&s[1], &b, later, "s1 later", d);
    cr_assert_eq(open_dg(&b, d, len, later, NULL, NULL, NULL), 0);
    len = seal(&s[3], &b, later, "s3", d);
    cr_assert_eq(open_dg(&b, d, len, later, NULL, NULL, NULL), -ENOBUFS);

    hm_dgram_ctx *none = b.ctx;
    cr_assert_eq(hm_dgram_ctx_new(&b.id, swarm_main(), 0, &none), -EINVAL);
    cr_assert_null(none);
    node_free(&b);
    for (int i = 0; i < 4; i++)
        node_free(&s[i]);
}

Test(crypto, dgram_many_senders_in_a_large_table)
{
    struct node b;
    node_init(&b, 2, swarm_main(), 300);
    uint8_t d[HM_DGRAM_MAX], sender[32];
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < 300; i++) {
            struct node s;
            uint8_t seed[32] = {0};
            seed[0] = (uint8_t)i;
            seed[1] = (uint8_t)(i >> 8);
            seed[2] = 0x55;
            cr_assert_eq(hm_identity_from_seed(seed, &s.id), 0);
            cr_assert_eq(hm_dgram_ctx_new(&s.id, swarm_main(), 1, &s.ctx), 0);
            size_t len = seal(&s, &b, NOW + (uint64_t)round, "m", d);
            cr_assert_eq(open_dg(&b, d, len, NOW, sender, NULL, NULL), 0, "sender %d", i);
            cr_assert_arr_eq(sender, s.id.pk, 32);
            cr_assert_eq(open_dg(&b, d, len, NOW, NULL, NULL, NULL), -EALREADY);
            node_free(&s);
        }
    }
    node_free(&b);
}

/* ---- handshake ---- */

/* Feeds buf whole or one byte at a time; returns the last result. */
static int feed(hm_handshake *hs, const uint8_t *buf, size_t len, int trickle, size_t *consumed)
{
    if (!trickle)
        return hm_hs_input(hs, buf, len, consumed);
    size_t total = 0;
    int rc = 0;
    for (size_t i = 0; i < len; i++) {
        size_t c = 0;
        rc = hm_hs_input(hs, buf + i, 1, &c);
        total += c;
        if (rc != 0)
            break;
        cr_assert_eq(c, 1);
        if (i + 1 < len)
            cr_assert_eq(hs->out_len, 0, "no reply before the whole message");
    }
    *consumed = total;
    return rc;
}

struct hs_result {
    int client_rc, server_rc;
    hm_session cs, ss;
};

static void run_handshake(const hm_identity *a, const uint8_t *swarm_a, const hm_identity *b,
                          const uint8_t *swarm_b, const uint8_t *expect_pk, int trickle,
                          const hm_identity *impostor_claims, struct hs_result *r)
{
    hm_handshake c, s;
    uint8_t buf[256];
    size_t len, used;

    memset(r, 0, sizeof(*r));
    hm_hs_init_client(&c, a, swarm_a, expect_pk);
    hm_hs_init_server(&s, b, swarm_b);
    cr_assert_eq(c.out_len, HM_HS_MSG1_LEN);
    cr_assert_eq(s.out_len, 0);
    if (impostor_claims != NULL) {
        /* Rewrite the claimed static key in both the message and the transcript. */
        memcpy(c.out + 1, impostor_claims->pk, 32);
        memcpy(c.msg1 + 1, impostor_claims->pk, 32);
    }

    len = c.out_len;
    memcpy(buf, c.out, len);
    c.out_len = 0;
    r->server_rc = feed(&s, buf, len, trickle, &used);
    if (r->server_rc < 0)
        goto out;
    cr_assert_eq(r->server_rc, 0);
    cr_assert_eq(used, HM_HS_MSG1_LEN);
    cr_assert_eq(s.out_len, HM_HS_MSG2_LEN);

    len = s.out_len;
    memcpy(buf, s.out, len);
    s.out_len = 0;
    r->client_rc = feed(&c, buf, len, trickle, &used);
    if (r->client_rc < 0)
        goto out;
    cr_assert_eq(r->client_rc, 1);
    cr_assert_eq(used, HM_HS_MSG2_LEN);
    cr_assert_eq(c.out_len, HM_HS_MSG3_LEN);

    len = c.out_len;
    memcpy(buf, c.out, len);
    c.out_len = 0;
    r->server_rc = feed(&s, buf, len, trickle, &used);
    if (r->server_rc < 0)
        goto out;
    cr_assert_eq(r->server_rc, 1);
    cr_assert_eq(used, HM_HS_MSG3_LEN);
    cr_assert_eq(s.out_len, 0);
    /* A finished handshake takes no more bytes. */
    cr_assert_eq(hm_hs_input(&s, buf, 5, &used), 1);
    cr_assert_eq(used, 0);
    hm_hs_finish(&c, &r->cs);
    hm_hs_finish(&s, &r->ss);
    uint8_t zero[sizeof(c)];
    memset(zero, 0, sizeof(zero));
    cr_assert_arr_eq(&c, zero, sizeof(c), "finish wipes the handshake");
out:
    hm_hs_wipe(&c);
    hm_hs_wipe(&s);
}

static void exchange_records(hm_session *tx, hm_session *rx, int n)
{
    static uint8_t pt[HM_REC_MAX_PLAIN], rec[HM_REC_MAX_PLAIN + HM_REC_OVERHEAD],
        back[HM_REC_MAX_PLAIN];
    for (int i = 0; i < n; i++) {
        size_t len = (size_t)(i * 997) % (HM_REC_MAX_PLAIN + 1), rl = 0, used = 0, bl = 0;
        if (i == n - 1)
            len = HM_REC_MAX_PLAIN;
        randombytes_buf(pt, len);
        cr_assert_eq(hm_session_seal(tx, pt, len, rec, &rl), 0);
        cr_assert_eq(rl, len + HM_REC_OVERHEAD);
        cr_assert_eq(hm_session_open(rx, rec, rl, &used, back, &bl), 1);
        cr_assert_eq(used, rl);
        cr_assert_eq(bl, len);
        cr_assert_arr_eq(back, pt, len);
    }
}

static void check_handshake(int trickle)
{
    hm_identity a, b;
    seeded(1, &a);
    seeded(2, &b);
    struct hs_result r;
    run_handshake(&a, swarm_main(), &b, swarm_main(), b.pk, trickle, NULL, &r);
    cr_assert_eq(r.client_rc, 1);
    cr_assert_eq(r.server_rc, 1);
    cr_assert_arr_eq(r.cs.peer_pk, b.pk, 32, "client learns the server's key");
    cr_assert_arr_eq(r.ss.peer_pk, a.pk, 32, "server learns the client's key");
    exchange_records(&r.cs, &r.ss, 20);
    exchange_records(&r.ss, &r.cs, 20);
    exchange_records(&r.cs, &r.ss, 3);
    hm_session_wipe(&r.cs);
    hm_session_wipe(&r.ss);
}

Test(crypto, handshake_whole_messages)
{
    check_handshake(0);
}

Test(crypto, handshake_one_byte_at_a_time)
{
    check_handshake(1);
}

Test(crypto, handshake_sessions_are_fresh_and_independent)
{
    hm_identity a, b;
    seeded(1, &a);
    seeded(2, &b);
    struct hs_result r1, r2;
    run_handshake(&a, swarm_main(), &b, swarm_main(), b.pk, 0, NULL, &r1);
    run_handshake(&a, swarm_main(), &b, swarm_main(), b.pk, 0, NULL, &r2);
    uint8_t rec[64], pt[HM_REC_MAX_PLAIN];
    size_t rl, used, pl;
    cr_assert_eq(hm_session_seal(&r1.cs, "abc", 3, rec, &rl), 0);
    /* A record of one session means nothing in another between the same peers. */
    cr_assert_eq(hm_session_open(&r2.ss, rec, rl, &used, pt, &pl), -EBADMSG);
    cr_assert_eq(hm_session_open(&r1.ss, rec, rl, &used, pt, &pl), 1);
    hm_session_wipe(&r1.cs);
    hm_session_wipe(&r1.ss);
    hm_session_wipe(&r2.cs);
    hm_session_wipe(&r2.ss);
}

Test(crypto, handshake_extra_bytes_left_for_records)
{
    hm_identity a, b;
    seeded(1, &a);
    seeded(2, &b);
    hm_handshake c, s;
    hm_session cs, ss;
    uint8_t buf[512], pt[HM_REC_MAX_PLAIN];
    size_t used, rl, pl;

    hm_hs_init_client(&c, &a, swarm_main(), b.pk);
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_input(&s, c.out, c.out_len, &used), 0);
    c.out_len = 0;
    /* msg2 followed by garbage: the client takes exactly msg2. */
    memcpy(buf, s.out, HM_HS_MSG2_LEN);
    memset(buf + HM_HS_MSG2_LEN, 0xee, 10);
    s.out_len = 0;
    cr_assert_eq(hm_hs_input(&c, buf, HM_HS_MSG2_LEN + 10, &used), 1);
    cr_assert_eq(used, HM_HS_MSG2_LEN);
    /* The client sends msg3 and its first record in one write. */
    memcpy(buf, c.out, c.out_len);
    size_t n = c.out_len;
    c.out_len = 0;
    hm_hs_finish(&c, &cs);
    cr_assert_eq(hm_session_seal(&cs, "first", 5, buf + n, &rl), 0);
    n += rl;
    cr_assert_eq(hm_session_seal(&cs, "second", 6, buf + n, &rl), 0);
    n += rl;
    cr_assert_eq(hm_hs_input(&s, buf, n, &used), 1);
    cr_assert_eq(used, HM_HS_MSG3_LEN);
    hm_hs_finish(&s, &ss);
    size_t off = used;
    cr_assert_eq(hm_session_open(&ss, buf + off, n - off, &used, pt, &pl), 1);
    cr_assert_eq(pl, 5);
    cr_assert_arr_eq(pt, "first", 5);
    off += used;
    cr_assert_eq(hm_session_open(&ss, buf + off, n - off, &used, pt, &pl), 1);
    cr_assert_arr_eq(pt, "second", 6);
    cr_assert_eq(off + used, n);
    hm_session_wipe(&cs);
    hm_session_wipe(&ss);
}

Test(crypto, handshake_undrained_output_is_not_overrun)
{
    hm_identity a, b;
    seeded(1, &a);
    seeded(2, &b);
    hm_handshake c, s;
    size_t used;
    hm_hs_init_client(&c, &a, swarm_main(), b.pk);
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_input(&s, c.out, c.out_len, &used), 0);
    /* The client has not sent msg1 yet; msg3 would not fit behind it. */
    cr_assert_eq(hm_hs_input(&c, s.out, s.out_len, &used), -ENOBUFS);
    cr_assert_eq(used, HM_HS_MSG2_LEN);
    c.out_len = 0;
    cr_assert_eq(hm_hs_input(&c, NULL, 0, &used), 1);
    cr_assert_eq(c.out_len, HM_HS_MSG3_LEN);
    cr_assert_eq(hm_hs_input(&s, c.out, c.out_len, &used), 1);
}

Test(crypto, handshake_other_swarm_fails)
{
    hm_identity a, b;
    seeded(1, &a);
    seeded(2, &b);
    uint8_t other[32];
    hm_swarm_id("other-swarm", NULL, 0, other);
    struct hs_result r;
    run_handshake(&a, other, &b, swarm_main(), b.pk, 0, NULL, &r);
    cr_assert_eq(r.client_rc, -EBADMSG);
    run_handshake(&a, swarm_main(), &b, other, b.pk, 1, NULL, &r);
    cr_assert_eq(r.client_rc, -EBADMSG);
}

Test(crypto, handshake_wrong_server_refuses)
{
    hm_identity a, b, c;
    seeded(1, &a);
    seeded(2, &b);
    seeded(3, &c);
    struct hs_result r;
    /* A dials B's address but C answers. */
    run_handshake(&a, swarm_main(), &c, swarm_main(), b.pk, 0, NULL, &r);
    cr_assert_eq(r.server_rc, -EPERM);
    run_handshake(&a, swarm_main(), &c, swarm_main(), b.pk, 1, NULL, &r);
    cr_assert_eq(r.server_rc, -EPERM);
}

Test(crypto, handshake_server_impostor_fails_at_client)
{
    hm_identity a, b, c;
    seeded(1, &a);
    seeded(2, &b);
    seeded(3, &c);
    hm_handshake hc, hs;
    size_t used;
    /* C pretends to be B: it accepts msg1 naming B, then signs with its own key. */
    hm_hs_init_client(&hc, &a, swarm_main(), b.pk);
    uint8_t m1[HM_HS_MSG1_LEN];
    memcpy(m1, hc.out, sizeof(m1));
    memcpy(m1 + 65, c.pk, 32);
    hm_hs_init_server(&hs, &c, swarm_main());
    cr_assert_eq(hm_hs_input(&hs, m1, sizeof(m1), &used), 0);
    hc.out_len = 0;
    cr_assert_eq(hm_hs_input(&hc, hs.out, hs.out_len, &used), -EBADMSG);
    /* A failed handshake stays failed. */
    cr_assert_lt(hm_hs_input(&hc, hs.out, hs.out_len, &used), 0);
}

Test(crypto, handshake_client_impostor_fails_at_server)
{
    hm_identity a, b, c;
    seeded(1, &a);
    seeded(2, &b);
    seeded(3, &c);
    struct hs_result r;
    /* C claims A's key in msg1 and signs the transcript with its own key. */
    run_handshake(&c, swarm_main(), &b, swarm_main(), b.pk, 0, &a, &r);
    cr_assert_eq(r.client_rc, 1, "the server part is genuine");
    cr_assert_eq(r.server_rc, -EBADMSG);
    run_handshake(&c, swarm_main(), &b, swarm_main(), b.pk, 1, &a, &r);
    cr_assert_eq(r.server_rc, -EBADMSG);
}

Test(crypto, handshake_tampered_messages_fail)
{
    hm_identity a, b;
    seeded(1, &a);
    seeded(2, &b);
    hm_handshake c, s;
    size_t used;

    /* Every bit of msg2's key and signature, and of msg3's signature, matters. */
    for (size_t i = 0; i < HM_HS_MSG2_LEN; i += 4) {
        hm_hs_init_client(&c, &a, swarm_main(), b.pk);
        hm_hs_init_server(&s, &b, swarm_main());
        cr_assert_eq(hm_hs_input(&s, c.out, c.out_len, &used), 0);
        c.out_len = 0;
        s.out[i] ^= 0x10;
        cr_assert_lt(hm_hs_input(&c, s.out, s.out_len, &used), 0, "msg2 byte %zu", i);
    }
    for (size_t i = 0; i < 64; i += 3) {
        hm_hs_init_client(&c, &a, swarm_main(), b.pk);
        hm_hs_init_server(&s, &b, swarm_main());
        cr_assert_eq(hm_hs_input(&s, c.out, c.out_len, &used), 0);
        c.out_len = 0;
        cr_assert_eq(hm_hs_input(&c, s.out, s.out_len, &used), 1);
        c.out[i] ^= 0x01;
        cr_assert_eq(hm_hs_input(&s, c.out, c.out_len, &used), -EBADMSG, "msg3 byte %zu", i);
    }
    /* Changing the client's ephemeral key in flight breaks the server's signature. */
    hm_hs_init_client(&c, &a, swarm_main(), b.pk);
    hm_hs_init_server(&s, &b, swarm_main());
    c.out[40] ^= 0x02;
    cr_assert_eq(hm_hs_input(&s, c.out, c.out_len, &used), 0);
    c.out_len = 0;
    cr_assert_eq(hm_hs_input(&c, s.out, s.out_len, &used), -EBADMSG);

    /* The chosen cipher (msg2 byte 32) is under the server's signature. */
    hm_hs_init_client(&c, &a, swarm_main(), b.pk);
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_input(&s, c.out, c.out_len, &used), 0);
    c.out_len = 0;
    s.out[32] = s.out[32] == HM_CIPHER_AES_256_GCM ? HM_CIPHER_CHACHA20_POLY1305
                                                   : HM_CIPHER_AES_256_GCM;
    cr_assert_eq(hm_hs_input(&c, s.out, s.out_len, &used), -EBADMSG);
    hm_hs_wipe(&c);
    hm_hs_wipe(&s);
}

Test(crypto, handshake_malformed_msg1)
{
    hm_identity a, b;
    seeded(1, &a);
    seeded(2, &b);
    hm_handshake c, s;
    size_t used;
    uint8_t m1[HM_HS_MSG1_LEN];

    hm_hs_init_client(&c, &a, swarm_main(), b.pk);
    memcpy(m1, c.out, sizeof(m1));
    m1[0] = HM_HS_VERSION + 1;
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_input(&s, m1, sizeof(m1), &used), -EPROTONOSUPPORT);
    cr_assert_eq(s.out_len, 0);
    cr_assert_eq(hm_hs_peer_version(&s), HM_HS_VERSION + 1);

    /* A cipher list with a repeat, or with a hole before an id, is malformed. */
    memcpy(m1, c.out, sizeof(m1));
    m1[98] = m1[97];
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_input(&s, m1, sizeof(m1), &used), -EPROTO);
    memcpy(m1, c.out, sizeof(m1));
    m1[97] = 0;
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_input(&s, m1, sizeof(m1), &used), -EPROTO);
    /* Only unknown ids (a later version's ciphers): nothing in common. */
    memcpy(m1, c.out, sizeof(m1));
    m1[97] = 200;
    m1[98] = 201;
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_input(&s, m1, sizeof(m1), &used), -ENOPROTOOPT);

    /* A client static key that is not a valid point. */
    memcpy(m1, c.out, sizeof(m1));
    memset(m1 + 1, 0, 32);
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_input(&s, m1, sizeof(m1), &used), -EPROTO);

    /* A low-order ephemeral key would make the shared secret predictable. */
    memcpy(m1, c.out, sizeof(m1));
    memset(m1 + 33, 0, 32);
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_input(&s, m1, sizeof(m1), &used), -EPROTO);
    cr_assert_lt(hm_hs_input(&s, m1, sizeof(m1), &used), 0);
}

/* ---- records ---- */

static void session_pair(hm_session *cs, hm_session *ss)
{
    hm_identity a, b;
    seeded(1, &a);
    seeded(2, &b);
    struct hs_result r;
    run_handshake(&a, swarm_main(), &b, swarm_main(), b.pk, 0, NULL, &r);
    cr_assert_eq(r.server_rc, 1);
    *cs = r.cs;
    *ss = r.ss;
}

/* A finished handshake whose both sides allow only cipher. */
static void session_pair_cipher(int cipher, hm_session *cs, hm_session *ss)
{
    hm_identity a, b;
    seeded(1, &a);
    seeded(2, &b);
    hm_handshake c, s;
    size_t used;
    uint8_t only = (uint8_t)cipher;
    hm_hs_init_client(&c, &a, swarm_main(), b.pk);
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_set_ciphers(&c, &only, 1), 0);
    cr_assert_eq(hm_hs_set_ciphers(&s, &only, 1), 0);
    cr_assert_eq(hm_hs_input(&s, c.out, c.out_len, &used), 0);
    c.out_len = 0;
    cr_assert_eq(hm_hs_input(&c, s.out, s.out_len, &used), 1);
    s.out_len = 0;
    cr_assert_eq(hm_hs_input(&s, c.out, c.out_len, &used), 1);
    cr_assert_eq(hm_hs_cipher(&c), cipher);
    cr_assert_eq(hm_hs_cipher(&s), cipher);
    hm_hs_finish(&c, cs);
    hm_hs_finish(&s, ss);
    cr_assert_eq(cs->cipher, cipher);
}

/* Opens in a throwaway copy of s, so that s itself moves on only when asked. */
static int try_open(const hm_session *s, const uint8_t *in, size_t len, size_t *used,
                    uint8_t *pt, size_t *pl)
{
    hm_session t;
    cr_assert_eq(hm_session_dup(s, &t), 0);
    int rc = hm_session_open(&t, in, len, used, pt, pl);
    hm_session_wipe(&t);
    return rc;
}

static void check_records_rejected(int cipher)
{
    hm_session cs, ss;
    session_pair_cipher(cipher, &cs, &ss);
    uint8_t r1[128], r2[128], x[128], pt[HM_REC_MAX_PLAIN];
    size_t l1, l2, used, pl;
    cr_assert_eq(hm_session_seal(&cs, "record number one", 17, r1, &l1), 0);
    cr_assert_eq(hm_session_seal(&cs, "record number two", 17, r2, &l2), 0);

    /* Every flipped bit, including in the length, keeps the record from opening. */
    for (size_t i = 0; i < l1; i++) {
        for (int bit = 0; bit < 8; bit++) {
            memcpy(x, r1, l1);
            x[i] ^= (uint8_t)(1u << bit);
            int rc = try_open(&ss, x, l1, &used, pt, &pl);
            cr_assert_neq(rc, 1, "byte %zu bit %d accepted", i, bit);
        }
    }
    /* Truncated: incomplete until the last byte arrives. */
    for (size_t n = 0; n < l1; n++) {
        used = 99;
        cr_assert_eq(try_open(&ss, r1, n, &used, pt, &pl), 0, "prefix %zu", n);
        cr_assert_eq(used, 0);
    }
    /* Truncated with a length field to match: authentication fails. */
    memcpy(x, r1, l1);
    x[1] = (uint8_t)(x[1] - 1);
    cr_assert_eq(try_open(&ss, x, l1 - 1, &used, pt, &pl), -EBADMSG);
    /* A length below the tag size. */
    x[0] = 0;
    x[1] = 3;
    cr_assert_eq(try_open(&ss, x, l1, &used, pt, &pl), -EBADMSG);
    /* Reordered. */
    cr_assert_eq(try_open(&ss, r2, l2, &used, pt, &pl), -EBADMSG);
    /* In order, each opens once; a replay does not. */
    cr_assert_eq(hm_session_open(&ss, r1, l1, &used, pt, &pl), 1);
    cr_assert_arr_eq(pt, "record number one", 17);
    cr_assert_eq(try_open(&ss, r1, l1, &used, pt, &pl), -EBADMSG);
    cr_assert_eq(hm_session_open(&ss, r2, l2, &used, pt, &pl), 1);
    cr_assert_arr_eq(pt, "record number two", 17);
    /* Records go one way only: the sender cannot open its own record. */
    cr_assert_eq(hm_session_seal(&cs, "echo", 4, r1, &l1), 0);
    cr_assert_eq(hm_session_open(&cs, r1, l1, &used, pt, &pl), -EBADMSG);
    /* Dropped: the record after a lost one does not open either. */
    cr_assert_eq(hm_session_seal(&cs, "lost", 4, r1, &l1), 0);
    cr_assert_eq(hm_session_seal(&cs, "after", 5, r2, &l2), 0);
    cr_assert_eq(try_open(&ss, r2, l2, &used, pt, &pl), -EBADMSG);
    /* A record of the other cipher under the same secrets does not open. */
    hm_session other;
    cr_assert_eq(hm_session_dup(&ss, &other), 0);
    other.cipher = cipher == HM_CIPHER_AES_256_GCM ? HM_CIPHER_CHACHA20_POLY1305
                                                   : HM_CIPHER_AES_256_GCM;
    other.rx.keyed = 0;
    EVP_CIPHER_CTX_free(other.rx.ctx);
    other.rx.ctx = NULL;
    cr_assert_eq(hm_session_open(&other, r1, l1, &used, pt, &pl), -EBADMSG);
    hm_session_wipe(&other);
    hm_session_wipe(&cs);
    hm_session_wipe(&ss);
}

Test(crypto, records_tampered_truncated_reordered_rejected_chacha20_poly1305)
{
    check_records_rejected(HM_CIPHER_CHACHA20_POLY1305);
}

Test(crypto, records_tampered_truncated_reordered_rejected_aes_256_gcm)
{
    check_records_rejected(HM_CIPHER_AES_256_GCM);
}

Test(crypto, records_size_limits)
{
    hm_session cs, ss;
    session_pair(&cs, &ss);
    static uint8_t big[HM_REC_MAX_PLAIN + 1], rec[HM_REC_MAX_PLAIN + 64], pt[HM_REC_MAX_PLAIN];
    size_t rl, used, pl;
    cr_assert_eq(hm_session_seal(&cs, big, HM_REC_MAX_PLAIN + 1, rec, &rl), -EMSGSIZE);
    size_t limit = HM_REC_MAX_PLAIN + HM_REC_TAG;
    rec[0] = (uint8_t)((limit + 1) >> 8);
    rec[1] = (uint8_t)(limit + 1);
    cr_assert_eq(hm_session_open(&ss, rec, 2, &used, pt, &pl), -EMSGSIZE);
    rec[0] = 0xff;
    rec[1] = 0xff;
    cr_assert_eq(hm_session_open(&ss, rec, sizeof(rec), &used, pt, &pl), -EMSGSIZE);
    /* Nothing was consumed by the refusals: the stream still works. */
    cr_assert_eq(hm_session_seal(&cs, big, HM_REC_MAX_PLAIN, rec, &rl), 0);
    cr_assert_eq(rl, limit + 2);
    cr_assert_eq(hm_session_open(&ss, rec, rl, &used, pt, &pl), 1);
    cr_assert_eq(pl, HM_REC_MAX_PLAIN);
    hm_session_wipe(&cs);
    hm_session_wipe(&ss);
}

/* ---- record ciphers: known answers, negotiation, rekeying ---- */

static void unhex(const char *h, uint8_t *out, size_t len)
{
    cr_assert_eq(strlen(h), 2 * len, "vector length");
    cr_assert_eq(hm_hex_decode(h, 2 * len, out, len), 0);
}

/* Seals and opens one vector with hm_aead_crypt, in place and not, and checks every tag bit. */
static void check_vector(int cipher, const char *key_h, const char *nonce_h, const char *aad_h,
                         size_t aad_len, const char *pt_h, size_t len, const char *ct_h,
                         const char *tag_h)
{
    uint8_t key[32], nonce[12], aad[32], pt[128], ct[128], tag[16], out[128], got_tag[16];
    cr_assert(len <= sizeof(pt) && aad_len <= sizeof(aad));
    unhex(key_h, key, 32);
    unhex(nonce_h, nonce, 12);
    unhex(aad_h, aad, aad_len);
    unhex(pt_h, pt, len);
    unhex(ct_h, ct, len);
    unhex(tag_h, tag, 16);
    cr_assert_eq(hm_aead_crypt(cipher, 1, key, nonce, aad, aad_len, pt, len, out, got_tag), 0);
    cr_assert_arr_eq(out, ct, len, "%s ciphertext", hm_rec_cipher_name(cipher));
    cr_assert_arr_eq(got_tag, tag, 16, "%s tag", hm_rec_cipher_name(cipher));
    memcpy(out, ct, len);
    cr_assert_eq(hm_aead_crypt(cipher, 0, key, nonce, aad, aad_len, out, len, out, tag), 0);
    cr_assert_arr_eq(out, pt, len, "%s opens in place", hm_rec_cipher_name(cipher));
    for (int bit = 0; bit < 128; bit += 7) {
        uint8_t bad[16];
        memcpy(bad, tag, 16);
        bad[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        cr_assert_eq(hm_aead_crypt(cipher, 0, key, nonce, aad, aad_len, ct, len, out, bad),
                     -EBADMSG);
    }
    aad[0] ^= 1;
    cr_assert_eq(hm_aead_crypt(cipher, 0, key, nonce, aad, aad_len, ct, len, out, tag), -EBADMSG);
}

Test(crypto, chacha20_poly1305_rfc8439_2_8_2)
{
    const char *pt_text = "Ladies and Gentlemen of the class of '99: If I could offer you only "
                          "one tip for the future, sunscreen would be it.";
    char pt_h[2 * 114 + 1];
    cr_assert_eq(strlen(pt_text), 114);
    for (size_t i = 0; i < 114; i++)
        snprintf(pt_h + 2 * i, 3, "%02x", (unsigned char)pt_text[i]);
    check_vector(HM_CIPHER_CHACHA20_POLY1305,
                 "808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f",
                 "070000004041424344454647", "50515253c0c1c2c3c4c5c6c7", 12, pt_h, 114,
                 "d31a8d34648e60db7b86afbc53ef7ec2a4aded51296e08fea9e2b5a736ee62d6"
                 "3dbea45e8ca9671282fafb69da92728b1a71de0a9e060b2905d6a5b67ecd3b36"
                 "92ddbd7f2d778b8c9803aee328091b58fab324e4fad675945585808b4831d7bc"
                 "3ff4def08e4b7a9de576d26586cec64b6116",
                 "1ae10b594f09e26a7e902ecbd0600691");
}

Test(crypto, aes_256_gcm_mcgrew_viega_test_case_16)
{
    check_vector(HM_CIPHER_AES_256_GCM,
                 "feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308",
                 "cafebabefacedbaddecaf888", "feedfacedeadbeeffeedfacedeadbeefabaddad2", 20,
                 "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72"
                 "1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b39",
                 60,
                 "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa"
                 "8cb08e48590dbb3da7b08b1056828838c5f61e6393ba7a0abcc9f662",
                 "76fc6ece0f4e1768cddf8853bb2d551b");
}

/* crypto.h's derivation, written out again here with libsodium and EVP directly. */
static void ref_kdf(uint8_t *out, size_t outlen, const uint8_t secret[32], const char *label,
                    int cipher)
{
    crypto_generichash_state st;
    uint8_t c = (uint8_t)cipher;
    crypto_generichash_init(&st, secret, 32, outlen);
    crypto_generichash_update(&st, (const uint8_t *)label, strlen(label));
    if (cipher != 0)
        crypto_generichash_update(&st, &c, 1);
    crypto_generichash_final(&st, out, outlen);
}

static void ref_record(int cipher, const uint8_t secret[32], uint64_t seq, const uint8_t *pt,
                       size_t len, uint8_t *rec)
{
    uint8_t key[32], iv[12];
    ref_kdf(key, 32, secret, "hivemindd/rec/key/v2", cipher);
    ref_kdf(iv, 12, secret, "hivemindd/rec/iv/v2", cipher);
    for (int i = 0; i < 8; i++)
        iv[4 + i] ^= (uint8_t)(seq >> (56 - 8 * i));
    rec[0] = (uint8_t)((len + 16) >> 8);
    rec[1] = (uint8_t)(len + 16);
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    int n = 0;
    cr_assert(EVP_EncryptInit_ex(ctx, cipher == HM_CIPHER_AES_256_GCM ? EVP_aes_256_gcm()
                                                                      : EVP_chacha20_poly1305(),
                                 NULL, key, iv) == 1);
    cr_assert(EVP_EncryptUpdate(ctx, NULL, &n, rec, 2) == 1);
    cr_assert(EVP_EncryptUpdate(ctx, rec + 2, &n, pt, (int)len) == 1);
    cr_assert(EVP_EncryptFinal_ex(ctx, rec + 2 + len, &n) == 1);
    cr_assert(EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_GET_TAG, 16, rec + 2 + len) == 1);
    EVP_CIPHER_CTX_free(ctx);
}

/*
 * The record bytes are exactly what crypto.h documents: key, IV and
 * counter nonce from the direction secret, the next epoch's secret after
 * rekey_records records, the length as associated data.
 */
static void check_wire_format(int cipher)
{
    hm_session cs, ss;
    session_pair_cipher(cipher, &cs, &ss);
    cr_assert_eq(hm_session_set_rekey_records(&cs, 3), 0);
    cr_assert_eq(hm_session_set_rekey_records(&ss, 3), 0);
    uint8_t secret[32], next[32];
    memcpy(secret, cs.tx.secret, 32);
    uint8_t pt[100], rec[200], want[200], back[HM_REC_MAX_PLAIN];
    for (uint64_t i = 0; i < 8; i++) {
        size_t len = 10 + (size_t)i * 11, rl = 0, used = 0, pl = 0;
        randombytes_buf(pt, len);
        if (i > 0 && i % 3 == 0) {
            ref_kdf(next, 32, secret, "hivemindd/rec/next/v2", 0);
            memcpy(secret, next, 32);
        }
        ref_record(cipher, secret, i % 3, pt, len, want);
        cr_assert_eq(hm_session_seal(&cs, pt, len, rec, &rl), 0);
        cr_assert_eq(rl, len + HM_REC_OVERHEAD);
        cr_assert_arr_eq(rec, want, rl, "%s record %llu", hm_rec_cipher_name(cipher),
                         (unsigned long long)i);
        cr_assert_eq(hm_session_open(&ss, rec, rl, &used, back, &pl), 1);
        cr_assert_arr_eq(back, pt, len);
    }
    cr_assert_eq(cs.tx.epoch, 2);
    cr_assert_eq(ss.rx.epoch, 2);
    hm_session_wipe(&cs);
    hm_session_wipe(&ss);
}

Test(crypto, record_wire_format_chacha20_poly1305)
{
    check_wire_format(HM_CIPHER_CHACHA20_POLY1305);
}

Test(crypto, record_wire_format_aes_256_gcm)
{
    check_wire_format(HM_CIPHER_AES_256_GCM);
}

/*
 * Crossing the rekey limit: both ends move to the next key together and
 * the stream goes on; an end that did not rekey cannot open what follows,
 * so the key really changed; and a session whose epochs are spent refuses
 * to seal rather than reuse a nonce.
 */
static void check_rekey(int cipher)
{
    hm_session cs, ss, stale;
    session_pair_cipher(cipher, &cs, &ss);
    const uint64_t limit = 5;
    cr_assert_eq(hm_session_set_rekey_records(&cs, 0), -EINVAL);
    cr_assert_eq(hm_session_set_rekey_records(&cs, HM_REC_REKEY_RECORDS + 1), -EINVAL);
    cr_assert_eq(hm_session_set_rekey_records(&cs, limit), 0);
    cr_assert_eq(hm_session_set_rekey_records(&ss, limit), 0);
    cr_assert_eq(hm_session_dup(&ss, &stale), 0);
    cr_assert_eq(hm_session_set_rekey_records(&stale, HM_REC_REKEY_RECORDS), 0);
    static uint8_t pt[HM_REC_MAX_PLAIN], rec[HM_REC_MAX_PLAIN + HM_REC_OVERHEAD],
        back[HM_REC_MAX_PLAIN];
    for (uint64_t i = 0; i < 4 * limit + 2; i++) {
        size_t len = i % 2 ? HM_REC_MAX_PLAIN : (size_t)i, rl = 0, used = 0, pl = 0;
        randombytes_buf(pt, len);
        cr_assert_eq(hm_session_seal(&cs, pt, len, rec, &rl), 0);
        int stale_rc = hm_session_open(&stale, rec, rl, &used, back, &pl);
        if (i < limit)
            cr_assert_eq(stale_rc, 1, "record %llu, first key", (unsigned long long)i);
        else if (i == limit)
            cr_assert_eq(stale_rc, -EBADMSG, "the key changed after %llu records",
                         (unsigned long long)limit);
        cr_assert_eq(hm_session_open(&ss, rec, rl, &used, back, &pl), 1, "record %llu",
                     (unsigned long long)i);
        cr_assert_eq(pl, len);
        cr_assert_arr_eq(back, pt, len);
        cr_assert_eq(cs.tx.epoch, (uint32_t)(i / limit));
        cr_assert(cs.tx.seq <= limit);
    }
    /* The other direction keeps its own keys and counter. */
    exchange_records(&ss, &cs, 3);
    cr_assert_eq(ss.tx.epoch, 0);
    /* Spent epochs: sealing stops instead of wrapping to an old key. */
    cs.tx.epoch = UINT32_MAX;
    cs.tx.seq = limit;
    size_t rl = 0;
    cr_assert_eq(hm_session_seal(&cs, pt, 1, rec, &rl), -EOVERFLOW);
    hm_session_wipe(&stale);
    hm_session_wipe(&cs);
    hm_session_wipe(&ss);
}

Test(crypto, rekey_crosses_the_limit_chacha20_poly1305)
{
    check_rekey(HM_CIPHER_CHACHA20_POLY1305);
}

Test(crypto, rekey_crosses_the_limit_aes_256_gcm)
{
    check_rekey(HM_CIPHER_AES_256_GCM);
}

Test(crypto, records_seal_and_open_in_place)
{
    hm_session cs, ss;
    session_pair(&cs, &ss);
    static uint8_t buf[2 * (HM_REC_MAX_PLAIN + HM_REC_OVERHEAD)], want[HM_REC_MAX_PLAIN];
    size_t n1 = 1000, n2 = HM_REC_MAX_PLAIN, l1 = 0, l2 = 0, used = 0, pl = 0;
    randombytes_buf(buf + HM_REC_HEADER, n1);
    memcpy(want, buf + HM_REC_HEADER, n1);
    cr_assert_eq(hm_session_seal(&cs, buf + HM_REC_HEADER, n1, buf, &l1), 0);
    cr_assert(memcmp(buf + HM_REC_HEADER, want, n1) != 0, "sealed in place");
    randombytes_buf(buf + l1 + HM_REC_HEADER, n2);
    cr_assert_eq(hm_session_seal(&cs, buf + l1 + HM_REC_HEADER, n2, buf + l1, &l2), 0);
    uint8_t *pt = NULL;
    cr_assert_eq(hm_session_open_inplace(&ss, buf, l1 + l2, &used, &pt, &pl), 1);
    cr_assert_eq(used, l1);
    cr_assert_eq(pt, buf + HM_REC_HEADER);
    cr_assert_eq(pl, n1);
    cr_assert_arr_eq(pt, want, n1);
    cr_assert_eq(hm_session_open_inplace(&ss, buf + l1, l2 - 1, &used, &pt, &pl), 0);
    cr_assert_eq(hm_session_open_inplace(&ss, buf + l1, l2, &used, &pt, &pl), 1);
    cr_assert_eq(pl, n2);
    hm_session_wipe(&cs);
    hm_session_wipe(&ss);
}

/* Runs a handshake with the given lists (n 0: the default); returns the server's result. */
static int negotiate(const uint8_t *cl, size_t cn, const uint8_t *sl, size_t sn, int *cipher_out)
{
    hm_identity a, b;
    seeded(1, &a);
    seeded(2, &b);
    hm_handshake c, s;
    size_t used;
    int rc;
    hm_hs_init_client(&c, &a, swarm_main(), b.pk);
    hm_hs_init_server(&s, &b, swarm_main());
    if (cn > 0)
        cr_assert_eq(hm_hs_set_ciphers(&c, cl, cn), 0);
    if (sn > 0)
        cr_assert_eq(hm_hs_set_ciphers(&s, sl, sn), 0);
    *cipher_out = 0;
    rc = hm_hs_input(&s, c.out, c.out_len, &used);
    if (rc < 0)
        goto out;
    c.out_len = 0;
    cr_assert_eq(hm_hs_input(&c, s.out, s.out_len, &used), 1);
    rc = hm_hs_input(&s, c.out, c.out_len, &used);
    cr_assert_eq(rc, 1);
    cr_assert_eq(hm_hs_cipher(&c), hm_hs_cipher(&s));
    *cipher_out = hm_hs_cipher(&s);
out:
    hm_hs_wipe(&c);
    hm_hs_wipe(&s);
    return rc;
}

Test(crypto, cipher_negotiation)
{
    const uint8_t aes = HM_CIPHER_AES_256_GCM, cha = HM_CIPHER_CHACHA20_POLY1305;
    const uint8_t aes_cha[] = {aes, cha}, cha_aes[] = {cha, aes};
    int got = 0;
    uint8_t def[HM_HS_CIPHERS_MAX];
    size_t ndef = hm_rec_cipher_auto(def);
    cr_assert_eq(ndef, 2);
    /* Defaults on both sides: the client's first choice. */
    cr_assert_eq(negotiate(NULL, 0, NULL, 0, &got), 1);
    cr_assert_eq(got, def[0]);
    /* The client's order decides among what the server has. */
    cr_assert_eq(negotiate(cha_aes, 2, aes_cha, 2, &got), 1);
    cr_assert_eq(got, cha);
    cr_assert_eq(negotiate(aes_cha, 2, cha_aes, 2, &got), 1);
    cr_assert_eq(got, aes);
    cr_assert_eq(negotiate(aes_cha, 2, &cha, 1, &got), 1);
    cr_assert_eq(got, cha);
    cr_assert_eq(negotiate(&cha, 1, NULL, 0, &got), 1);
    cr_assert_eq(got, cha);
    /* Nothing in common: refused. */
    cr_assert_eq(negotiate(&aes, 1, &cha, 1, &got), -ENOPROTOOPT);
    cr_assert_eq(got, 0);
    /* Bad lists and late calls. */
    hm_identity a, b;
    seeded(1, &a);
    seeded(2, &b);
    hm_handshake c, s;
    size_t used;
    const uint8_t dup[] = {aes, aes}, unknown[] = {7}, many[] = {aes, cha, aes, cha, aes};
    hm_hs_init_client(&c, &a, swarm_main(), b.pk);
    cr_assert_eq(hm_hs_set_ciphers(&c, dup, 2), -EINVAL);
    cr_assert_eq(hm_hs_set_ciphers(&c, unknown, 1), -EINVAL);
    cr_assert_eq(hm_hs_set_ciphers(&c, many, 5), -EINVAL);
    cr_assert_eq(hm_hs_set_ciphers(&c, aes_cha, 0), -EINVAL);
    c.out_len = 0; /* msg1 sent: too late to change the list it carried */
    cr_assert_eq(hm_hs_set_ciphers(&c, &cha, 1), -EALREADY);
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_input(&s, c.msg1, 10, &used), 0);
    cr_assert_eq(hm_hs_set_ciphers(&s, &cha, 1), -EALREADY);
    hm_hs_wipe(&c);
    hm_hs_wipe(&s);
}

/*
 * A man in the middle who strips the client's preferred cipher from msg1
 * gets the server to choose another, but the server's signature covers the
 * msg1 it saw, so the client refuses: no downgrade.
 */
Test(crypto, cipher_downgrade_is_refused)
{
    hm_identity a, b;
    seeded(1, &a);
    seeded(2, &b);
    hm_handshake c, s;
    size_t used;
    const uint8_t aes_cha[] = {HM_CIPHER_AES_256_GCM, HM_CIPHER_CHACHA20_POLY1305};
    hm_hs_init_client(&c, &a, swarm_main(), b.pk);
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_set_ciphers(&c, aes_cha, 2), 0);
    uint8_t m1[HM_HS_MSG1_LEN];
    memcpy(m1, c.out, sizeof(m1));
    cr_assert_eq(m1[97], HM_CIPHER_AES_256_GCM);
    m1[97] = HM_CIPHER_CHACHA20_POLY1305;
    m1[98] = 0;
    cr_assert_eq(hm_hs_input(&s, m1, sizeof(m1), &used), 0);
    cr_assert_eq(s.out[32], HM_CIPHER_CHACHA20_POLY1305);
    c.out_len = 0;
    cr_assert_eq(hm_hs_input(&c, s.out, s.out_len, &used), -EBADMSG);
    hm_hs_wipe(&c);
    hm_hs_wipe(&s);
}

/* A version 1 hello is refused at its first byte, and the version is kept for the log. */
Test(crypto, old_version_hello_is_refused_at_once)
{
    hm_identity b;
    seeded(2, &b);
    hm_handshake s;
    size_t used = 0;
    uint8_t v1[97];
    memset(v1, 0, sizeof(v1));
    v1[0] = 1;
    hm_hs_init_server(&s, &b, swarm_main());
    cr_assert_eq(hm_hs_peer_version(&s), 0);
    cr_assert_eq(hm_hs_input(&s, v1, 1, &used), -EPROTONOSUPPORT);
    cr_assert_eq(used, 1);
    cr_assert_eq(hm_hs_peer_version(&s), 1);
    cr_assert_eq(s.out_len, 0);
    cr_assert_lt(hm_hs_input(&s, v1 + 1, sizeof(v1) - 1, &used), 0);
    cr_assert_eq(hm_hs_peer_version(&s), 1);
    hm_hs_wipe(&s);
}

Test(crypto, cipher_names)
{
    cr_assert_eq(hm_rec_cipher_parse("aes-256-gcm"), HM_CIPHER_AES_256_GCM);
    cr_assert_eq(hm_rec_cipher_parse("chacha20-poly1305"), HM_CIPHER_CHACHA20_POLY1305);
    cr_assert_eq(hm_rec_cipher_parse("auto"), -EINVAL);
    cr_assert_eq(hm_rec_cipher_parse("aes-128-gcm"), -EINVAL);
    cr_assert_str_eq(hm_rec_cipher_name(HM_CIPHER_AES_256_GCM), "aes-256-gcm");
    cr_assert_null(hm_rec_cipher_name(0));
}

/* A record sealed from two parts is the record of the joined plaintext. */
Test(crypto, records_sealed_from_two_parts)
{
    for (int k = 0; k < 2; k++) {
        int cipher = k ? HM_CIPHER_AES_256_GCM : HM_CIPHER_CHACHA20_POLY1305;
        hm_session cs, ss, cs2;
        session_pair_cipher(cipher, &cs, &ss);
        cr_assert_eq(hm_session_dup(&cs, &cs2), 0);
        static uint8_t joined[HM_REC_MAX_PLAIN], r1[HM_REC_MAX_PLAIN + HM_REC_OVERHEAD],
            r2[HM_REC_MAX_PLAIN + HM_REC_OVERHEAD], back[HM_REC_MAX_PLAIN];
        const size_t heads[] = {0, 5, 9, 16, 17, 100};
        for (size_t i = 0; i < 6; i++) {
            size_t head = heads[i], body = HM_REC_MAX_PLAIN - head - (i * 13) % 50, l1 = 0,
                   l2 = 0, used = 0, pl = 0;
            randombytes_buf(joined, head + body);
            cr_assert_eq(hm_session_seal(&cs, joined, head + body, r1, &l1), 0);
            /* The head in place, the body from elsewhere, as the transport seals. */
            memcpy(r2 + HM_REC_HEADER, joined, head);
            cr_assert_eq(hm_session_seal2(&cs2, r2 + HM_REC_HEADER, head, joined + head, body,
                                          r2, &l2), 0);
            cr_assert_eq(l1, l2);
            cr_assert_arr_eq(r1, r2, l1, "%s head %zu", hm_rec_cipher_name(cipher), head);
            cr_assert_eq(hm_session_open(&ss, r2, l2, &used, back, &pl), 1);
            cr_assert_arr_eq(back, joined, head + body);
        }
        size_t l = 0;
        cr_assert_eq(hm_session_seal2(&cs, joined, 10, joined, HM_REC_MAX_PLAIN - 9, r1, &l),
                     -EMSGSIZE);
        hm_session_wipe(&cs);
        hm_session_wipe(&cs2);
        hm_session_wipe(&ss);
    }
}

/* The two-step opener: the head in place, the rest where the caller says, the tag last. */
Test(crypto, records_open_in_two_steps)
{
    hm_session cs, ss;
    session_pair(&cs, &ss);
    static uint8_t pt[HM_REC_MAX_PLAIN], rec[HM_REC_MAX_PLAIN + HM_REC_OVERHEAD],
        dest[HM_REC_MAX_PLAIN];
    size_t len = 12000, rl = 0;
    hm_rec_open op;
    randombytes_buf(pt, len);
    cr_assert_eq(hm_session_seal(&cs, pt, len, rec, &rl), 0);
    cr_assert_eq(hm_session_open_begin(&ss, rec, rl - 1, 5, &op), 0, "incomplete");
    cr_assert_eq(hm_session_open_begin(&ss, rec, rl, 5, &op), 1);
    cr_assert_eq(op.pt_len, len);
    cr_assert_eq(op.head_len, 5);
    cr_assert_eq(op.consumed, rl);
    cr_assert_arr_eq(rec + HM_REC_HEADER, pt, 5, "the head is decrypted in place");
    cr_assert_eq(hm_session_open_end(&ss, &op, dest), 1);
    cr_assert_arr_eq(dest, pt + 5, len - 5, "the rest went to dest");
    /* A short record: the head is all of it. */
    cr_assert_eq(hm_session_seal(&cs, pt, 3, rec, &rl), 0);
    cr_assert_eq(hm_session_open_begin(&ss, rec, rl, 5, &op), 1);
    cr_assert_eq(op.head_len, 3);
    cr_assert_eq(hm_session_open_end(&ss, &op, NULL), 1);
    cr_assert_arr_eq(rec + HM_REC_HEADER, pt, 3);
    /* A bad tag is found at the end, whatever was written before. */
    cr_assert_eq(hm_session_seal(&cs, pt, len, rec, &rl), 0);
    rec[rl - 1] ^= 0x20;
    cr_assert_eq(hm_session_open_begin(&ss, rec, rl, 5, &op), 1);
    cr_assert_eq(hm_session_open_end(&ss, &op, dest), -EBADMSG);
    hm_session_wipe(&cs);
    hm_session_wipe(&ss);
}

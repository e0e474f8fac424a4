/*
 * crypto: node identity (key file, peer ids, node ids), swarm binding,
 * authenticated datagrams with replay protection, the stream handshake and
 * the stream record layer; the wire formats are in crypto.h. Everything is
 * sans-I/O except the two key-file readers. A datagram context owns its
 * bounded table of per-sender state (pair keys and replay windows); a
 * handshake owns its ephemeral secrets until hm_hs_finish moves the session
 * out. Secrets are wiped when the object holding them is freed or wiped.
 */
#include "config.h"

#include "src/base/crypto.h"
#include "src/base/util.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

#define DGRAM_VERSION 1
#define REPLAY_BITS 1024
#define REPLAY_WORDS (REPLAY_BITS / 64)
/* A bound on max_peers keeps the table's index type and allocation sane. */
#define DGRAM_MAX_PEERS_LIMIT (1u << 22)
#define NIL UINT32_MAX

static const char swarm_label[] = "hivemindd/swarm/v1"; /* hashed with its NUL */
static const char hs_server_label[] = "hivemindd/hs/server/v2";
static const char hs_client_label[] = "hivemindd/hs/client/v2";
#define HS_LABEL_LEN (sizeof(hs_server_label) - 1)

int hm_crypto_init(void)
{
    /* sodium_init returns 1 when already initialised, which is fine. */
    return sodium_init() < 0 ? -EIO : 0;
}

/* ---- identity ---- */

void hm_node_id_from_pk(const uint8_t pk[HM_PK_BYTES], uint8_t out[HM_NODE_ID_BYTES])
{
    crypto_generichash(out, HM_NODE_ID_BYTES, pk, HM_PK_BYTES, NULL, 0);
}

void hm_peer_id_encode(const uint8_t pk[HM_PK_BYTES], char out[HM_PEER_ID_LEN + 1])
{
    int n = hm_base32_encode(pk, HM_PK_BYTES, out, HM_PEER_ID_LEN + 1);
    (void)n; /* 32 bytes always encode to exactly 52 characters. */
}

int hm_identity_from_seed(const uint8_t seed[32], hm_identity *out)
{
    int result = 0;

    memset(out, 0, sizeof(*out));
    if (crypto_sign_seed_keypair(out->pk, out->sk, seed) != 0 ||
        crypto_sign_ed25519_pk_to_curve25519(out->x_pk, out->pk) != 0 ||
        crypto_sign_ed25519_sk_to_curve25519(out->x_sk, out->sk) != 0) {
        result = -EINVAL;
        goto out;
    }
    hm_node_id_from_pk(out->pk, out->node_id);
    hm_peer_id_encode(out->pk, out->peer_id);
out:
    if (result < 0)
        sodium_memzero(out, sizeof(*out));
    return result;
}

int hm_identity_generate(hm_identity *out)
{
    uint8_t seed[32];
    randombytes_buf(seed, sizeof(seed));
    int result = hm_identity_from_seed(seed, out);
    sodium_memzero(seed, sizeof(seed));
    return result;
}

void hm_identity_wipe(hm_identity *id)
{
    sodium_memzero(id, sizeof(*id));
}

static int read_full(int fd, uint8_t *buf, size_t len, size_t *got_out)
{
    size_t got = 0;
    while (got < len) {
        ssize_t n = read(fd, buf + got, len - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -errno;
        if (n == 0)
            break;
        got += (size_t)n;
    }
    *got_out = got;
    return 0;
}

/*
 * Opens a secret file for reading and checks that it is a regular file
 * that nobody but its owner can read or write. Returns the fd or negative.
 */
static int open_secret_file(const char *path, const char *what, struct stat *st, char *err,
                            size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    if (fstat(fd, st) != 0) {
        int e = -errno;
        hm_errf(err, errlen, "cannot stat %s %s: %s", what, path, strerror(-e));
        close(fd);
        return e;
    }
    if (!S_ISREG(st->st_mode)) {
        hm_errf(err, errlen, "%s %s is not a regular file", what, path);
        close(fd);
        return -EINVAL;
    }
    if (st->st_mode & 077) {
        hm_errf(err, errlen,
               "%s %s is accessible by group or others (mode %04o); "
               "run 'chmod 600 %s' if it has not leaked, or replace it",
               what, path, (unsigned)(st->st_mode & 07777), path);
        close(fd);
        return -EACCES;
    }
    return fd;
}

static int identity_load(const char *path, hm_identity *out, char *err, size_t errlen)
{
    uint8_t sk[HM_SK_BYTES + 1];
    struct stat st;
    size_t got = 0;
    int result = 0;
    int fd = open_secret_file(path, "identity file", &st, err, errlen);

    if (fd < 0) {
        if (fd != -ENOENT && err != NULL && errlen > 0 && err[0] == '\0')
            hm_errf(err, errlen, "cannot open identity file %s: %s", path, strerror(-fd));
        return fd;
    }
    if (st.st_size != HM_SK_BYTES) {
        hm_errf(err, errlen, "identity file %s has %lld bytes, expected %d (truncated or not a key)",
               path, (long long)st.st_size, HM_SK_BYTES);
        result = -EINVAL;
        goto out;
    }
    /* Reading one byte more than expected catches a file that grew since fstat. */
    result = read_full(fd, sk, sizeof(sk), &got);
    if (result < 0) {
        hm_errf(err, errlen, "cannot read identity file %s: %s", path, strerror(-result));
        goto out;
    }
    if (got != HM_SK_BYTES) {
        hm_errf(err, errlen, "identity file %s changed size while being read", path);
        result = -EINVAL;
        goto out;
    }
    /* The secret key is seed || public key; the public half must match the seed. */
    result = hm_identity_from_seed(sk, out);
    if (result < 0 || sodium_memcmp(out->pk, sk + 32, HM_PK_BYTES) != 0) {
        hm_errf(err, errlen, "identity file %s is corrupt: its public half does not match", path);
        hm_identity_wipe(out);
        result = -EINVAL;
        goto out;
    }
out:
    sodium_memzero(sk, sizeof(sk));
    close(fd);
    return result;
}

static int identity_create(const char *path, hm_identity *out, char *err, size_t errlen)
{
    int result = 0;
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);

    if (fd < 0) {
        result = -errno;
        if (result == -ENOENT)
            hm_errf(err, errlen, "cannot create identity file %s: its directory does not exist",
                   path);
        else if (result != -EEXIST)
            hm_errf(err, errlen, "cannot create identity file %s: %s", path, strerror(-result));
        return result;
    }
    /* The umask can only narrow 0600; make the mode exact anyway. */
    if (fchmod(fd, 0600) != 0) {
        result = -errno;
        hm_errf(err, errlen, "cannot set mode of identity file %s: %s", path, strerror(-result));
        goto out;
    }
    result = hm_identity_generate(out);
    if (result < 0) {
        hm_errf(err, errlen, "cannot generate a key for %s", path);
        goto out;
    }
    result = hm_write_all(fd, out->sk, HM_SK_BYTES);
    if (result == 0 && fsync(fd) != 0)
        result = -errno;
    if (result < 0) {
        hm_errf(err, errlen, "cannot write identity file %s: %s", path, strerror(-result));
        hm_identity_wipe(out);
        goto out;
    }
out:
    close(fd);
    if (result < 0)
        unlink(path); /* A half-written key would only block the next start. */
    else
        (void)hm_fsync_parent(path); /* the key is synced; the entry is best effort */
    return result;
}

int hm_identity_load_or_create(const char *path, hm_identity *out, char *err, size_t errlen)
{
    int result = -ENOENT;

    if (err != NULL && errlen > 0)
        err[0] = '\0';
    memset(out, 0, sizeof(*out));
    /*
     * Two tries: if another process creates the file between our failed
     * open and our O_EXCL create, the second pass loads its key.
     */
    for (int attempt = 0; attempt < 2; attempt++) {
        result = identity_load(path, out, err, errlen);
        if (result != -ENOENT)
            break;
        result = identity_create(path, out, err, errlen);
        if (result != -EEXIST)
            break;
    }
    if (result == -EEXIST)
        hm_errf(err, errlen, "identity file %s keeps appearing and disappearing", path);
    return result;
}

int hm_peer_id_decode(const char *s, size_t len, uint8_t pk_out[HM_PK_BYTES])
{
    uint8_t pk[HM_PK_BYTES];

    if (s == NULL || len != HM_PEER_ID_LEN)
        return -EINVAL;
    /* Only the lowercase alphabet, so that each key has exactly one spelling. */
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '2' && c <= '7')))
            return -EINVAL;
    }
    if (hm_base32_decode(s, len, pk, sizeof(pk)) != HM_PK_BYTES)
        return -EINVAL;
    /*
     * Canonical, on the curve, in the main subgroup, not of small order:
     * a key that fails this could never sign or agree on a pair key.
     */
    if (!crypto_core_ed25519_is_valid_point(pk))
        return -EINVAL;
    uint8_t x[32];
    int rc = crypto_sign_ed25519_pk_to_curve25519(x, pk);
    if (rc != 0)
        return -EINVAL;
    memcpy(pk_out, pk, HM_PK_BYTES);
    return 0;
}

int hm_peer_addr_parse(const char *s, uint8_t pk_out[HM_PK_BYTES], struct sockaddr_storage *addr_out)
{
    if (s == NULL)
        return -EINVAL;
    const char *at = strchr(s, '@');
    if (at == NULL)
        return -EINVAL;
    uint8_t pk[HM_PK_BYTES];
    if (hm_peer_id_decode(s, (size_t)(at - s), pk) < 0)
        return -EINVAL;
    if (hm_parse_hostport(at + 1, addr_out) < 0)
        return -EINVAL;
    memcpy(pk_out, pk, HM_PK_BYTES);
    return 0;
}

void hm_swarm_id(const char *name, const uint8_t *psk, size_t psk_len,
                 uint8_t out[HM_SWARM_ID_BYTES])
{
    crypto_generichash_state st;
    uint8_t key[crypto_generichash_KEYBYTES_MAX];
    size_t key_len = 0;

    /*
     * BLAKE2b takes keys of 16..64 bytes; a key outside that range is first
     * hashed to 32 bytes so that every key length still closes the swarm.
     */
    if (psk != NULL && psk_len > 0) {
        if (psk_len >= crypto_generichash_KEYBYTES_MIN && psk_len <= crypto_generichash_KEYBYTES_MAX) {
            memcpy(key, psk, psk_len);
            key_len = psk_len;
        } else {
            crypto_generichash(key, 32, psk, psk_len, NULL, 0);
            key_len = 32;
        }
    }
    crypto_generichash_init(&st, key_len ? key : NULL, key_len, HM_SWARM_ID_BYTES);
    crypto_generichash_update(&st, (const uint8_t *)swarm_label, sizeof(swarm_label));
    if (name != NULL)
        crypto_generichash_update(&st, (const uint8_t *)name, strlen(name));
    crypto_generichash_final(&st, out, HM_SWARM_ID_BYTES);
    sodium_memzero(key, sizeof(key));
    sodium_memzero(&st, sizeof(st));
}

int hm_swarm_key_load(const char *path, uint8_t out[32], char *err, size_t errlen)
{
    char buf[68];
    struct stat st;
    size_t got = 0;
    int result = 0;

    if (err != NULL && errlen > 0)
        err[0] = '\0';
    int fd = open_secret_file(path, "swarm key file", &st, err, errlen);
    if (fd < 0) {
        if (err != NULL && errlen > 0 && err[0] == '\0')
            hm_errf(err, errlen, "cannot open swarm key file %s: %s", path, strerror(-fd));
        return fd;
    }
    result = read_full(fd, (uint8_t *)buf, sizeof(buf), &got);
    if (result < 0) {
        hm_errf(err, errlen, "cannot read swarm key file %s: %s", path, strerror(-result));
        goto out;
    }
    if (got == 65 && buf[64] == '\n')
        got = 64;
    if (got != 64 || hm_hex_decode(buf, 64, out, 32) < 0) {
        hm_errf(err, errlen, "swarm key file %s must hold exactly 64 hex digits", path);
        result = -EINVAL;
        goto out;
    }
out:
    sodium_memzero(buf, sizeof(buf));
    close(fd);
    return result;
}

/* ---- datagrams ---- */

/* Per-sender state; also caches the pair key for peers we only send to. */
struct dgram_peer {
    uint8_t pk[HM_PK_BYTES];
    uint8_t key[32];
    uint64_t highest; /* highest accepted timestamp, valid when have_rx */
    uint64_t bitmap[REPLAY_WORDS]; /* bit d set: timestamp highest - d was accepted */
    uint64_t last_used_us;
    uint32_t hnext;              /* next in hash bucket */
    uint32_t lru_prev, lru_next; /* most recently used first */
    uint8_t in_use, have_rx;
};

struct hm_dgram_ctx {
    uint8_t pk[HM_PK_BYTES];
    uint8_t x_sk[32];
    uint8_t swarm_id[HM_SWARM_ID_BYTES];
    uint8_t hash_key[crypto_shorthash_KEYBYTES];
    uint64_t last_ts;
    uint32_t max_peers, nbuckets, used;
    uint32_t lru_head, lru_tail;
    uint32_t *buckets;
    struct dgram_peer *peers;
};

int hm_dgram_ctx_new(const hm_identity *id, const uint8_t swarm_id[HM_SWARM_ID_BYTES],
                     size_t max_peers, hm_dgram_ctx **out)
{
    hm_dgram_ctx *ctx = NULL;
    uint32_t nb = 1;
    int result;

    *out = NULL;
    if (max_peers == 0 || max_peers > DGRAM_MAX_PEERS_LIMIT)
        return -EINVAL;
    if ((ctx = calloc(1, sizeof(*ctx))) == NULL) {
        result = -ENOMEM;
        goto out;
    }
    while (nb < max_peers)
        nb <<= 1;
    ctx->max_peers = (uint32_t)max_peers;
    ctx->nbuckets = nb;
    ctx->buckets = malloc(nb * sizeof(*ctx->buckets));
    ctx->peers = calloc(max_peers, sizeof(*ctx->peers));
    if (ctx->buckets == NULL || ctx->peers == NULL) {
        result = -ENOMEM;
        goto out;
    }
    for (uint32_t i = 0; i < nb; i++)
        ctx->buckets[i] = NIL;
    ctx->lru_head = ctx->lru_tail = NIL;
    memcpy(ctx->pk, id->pk, HM_PK_BYTES);
    memcpy(ctx->x_sk, id->x_sk, 32);
    memcpy(ctx->swarm_id, swarm_id, HM_SWARM_ID_BYTES);
    /* A secret hash key keeps senders from choosing keys that share a bucket. */
    randombytes_buf(ctx->hash_key, sizeof(ctx->hash_key));
    *out = ctx;
    ctx = NULL;
    result = 0;
out:
    hm_dgram_ctx_free(ctx);
    return result;
}

void hm_dgram_ctx_free(hm_dgram_ctx *ctx)
{
    if (ctx == NULL)
        return;
    if (ctx->peers != NULL) {
        sodium_memzero(ctx->peers, ctx->max_peers * sizeof(*ctx->peers));
        free(ctx->peers);
    }
    free(ctx->buckets);
    sodium_memzero(ctx, sizeof(*ctx));
    free(ctx);
}

static uint32_t peer_bucket(const hm_dgram_ctx *ctx, const uint8_t pk[HM_PK_BYTES])
{
    uint8_t h[crypto_shorthash_BYTES];
    crypto_shorthash(h, pk, HM_PK_BYTES, ctx->hash_key);
    uint32_t v = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
    return v & (ctx->nbuckets - 1);
}

static struct dgram_peer *peer_find(hm_dgram_ctx *ctx, const uint8_t pk[HM_PK_BYTES])
{
    for (uint32_t i = ctx->buckets[peer_bucket(ctx, pk)]; i != NIL; i = ctx->peers[i].hnext)
        if (memcmp(ctx->peers[i].pk, pk, HM_PK_BYTES) == 0)
            return &ctx->peers[i];
    return NULL;
}

static void lru_unlink(hm_dgram_ctx *ctx, uint32_t i)
{
    struct dgram_peer *p = &ctx->peers[i];
    if (p->lru_prev != NIL)
        ctx->peers[p->lru_prev].lru_next = p->lru_next;
    else
        ctx->lru_head = p->lru_next;
    if (p->lru_next != NIL)
        ctx->peers[p->lru_next].lru_prev = p->lru_prev;
    else
        ctx->lru_tail = p->lru_prev;
    p->lru_prev = p->lru_next = NIL;
}

static void lru_push_front(hm_dgram_ctx *ctx, uint32_t i)
{
    struct dgram_peer *p = &ctx->peers[i];
    p->lru_prev = NIL;
    p->lru_next = ctx->lru_head;
    if (ctx->lru_head != NIL)
        ctx->peers[ctx->lru_head].lru_prev = i;
    ctx->lru_head = i;
    if (ctx->lru_tail == NIL)
        ctx->lru_tail = i;
}

static void peer_touch(hm_dgram_ctx *ctx, struct dgram_peer *p, uint64_t now_us)
{
    uint32_t i = (uint32_t)(p - ctx->peers);
    p->last_used_us = now_us;
    if (ctx->lru_head != i) {
        lru_unlink(ctx, i);
        lru_push_front(ctx, i);
    }
}

/*
 * An entry idle for twice the window can be forgotten safely: every
 * datagram it accepted carries a timestamp at most one window ahead of the
 * last use, so a replay of it is now outside the window and fails on time.
 */
static int peer_recyclable(const hm_dgram_ctx *ctx, uint64_t now_us)
{
    if (ctx->used < ctx->max_peers)
        return 1;
    const struct dgram_peer *t = &ctx->peers[ctx->lru_tail];
    return now_us > t->last_used_us && now_us - t->last_used_us > 2 * HM_DGRAM_WINDOW_US;
}

/* Takes a free or recyclable slot; call only after peer_recyclable said yes. */
static struct dgram_peer *peer_insert(hm_dgram_ctx *ctx, const uint8_t pk[HM_PK_BYTES],
                                      const uint8_t key[32], uint64_t now_us)
{
    uint32_t i;
    if (ctx->used < ctx->max_peers) {
        i = ctx->used++;
    } else {
        i = ctx->lru_tail;
        struct dgram_peer *old = &ctx->peers[i];
        uint32_t *link = &ctx->buckets[peer_bucket(ctx, old->pk)];
        while (*link != i)
            link = &ctx->peers[*link].hnext;
        *link = old->hnext;
        lru_unlink(ctx, i);
        sodium_memzero(old, sizeof(*old));
    }
    struct dgram_peer *p = &ctx->peers[i];
    memset(p, 0, sizeof(*p));
    memcpy(p->pk, pk, HM_PK_BYTES);
    memcpy(p->key, key, 32);
    p->in_use = 1;
    p->last_used_us = now_us;
    uint32_t b = peer_bucket(ctx, pk);
    p->hnext = ctx->buckets[b];
    ctx->buckets[b] = i;
    lru_push_front(ctx, i);
    return p;
}

/* key = BLAKE2b-256(key = swarm_id, X25519(my_sk, peer) || lower pk || higher pk) */
static int pair_key(const hm_dgram_ctx *ctx, const uint8_t peer_pk[HM_PK_BYTES], uint8_t key[32])
{
    uint8_t x_peer[32], shared[32];
    int result = 0;

    if (crypto_sign_ed25519_pk_to_curve25519(x_peer, peer_pk) != 0 ||
        crypto_scalarmult(shared, ctx->x_sk, x_peer) != 0) {
        /* Not a usable key: invalid point, or of low order (all-zero result). */
        result = -EBADMSG;
        goto out;
    }
    int lower = memcmp(ctx->pk, peer_pk, HM_PK_BYTES) < 0;
    crypto_generichash_state st;
    crypto_generichash_init(&st, ctx->swarm_id, HM_SWARM_ID_BYTES, 32);
    crypto_generichash_update(&st, shared, sizeof(shared));
    crypto_generichash_update(&st, lower ? ctx->pk : peer_pk, HM_PK_BYTES);
    crypto_generichash_update(&st, lower ? peer_pk : ctx->pk, HM_PK_BYTES);
    crypto_generichash_final(&st, key, 32);
    sodium_memzero(&st, sizeof(st));
out:
    sodium_memzero(shared, sizeof(shared));
    return result;
}

static int replay_check(const struct dgram_peer *p, uint64_t ts)
{
    if (!p->have_rx || ts > p->highest)
        return 0;
    uint64_t d = p->highest - ts;
    /* Older than the bitmap reaches: it cannot be told apart from a replay. */
    if (d >= REPLAY_BITS)
        return -ESTALE;
    return (p->bitmap[d / 64] >> (d % 64)) & 1 ? -EALREADY : 0;
}

static void replay_mark(struct dgram_peer *p, uint64_t ts)
{
    if (!p->have_rx || (ts > p->highest && ts - p->highest >= REPLAY_BITS)) {
        memset(p->bitmap, 0, sizeof(p->bitmap));
        p->highest = ts;
        p->have_rx = 1;
        p->bitmap[0] = 1;
        return;
    }
    if (ts > p->highest) {
        uint64_t s = ts - p->highest;
        unsigned w = (unsigned)(s / 64), b = (unsigned)(s % 64);
        for (int i = REPLAY_WORDS - 1; i >= 0; i--) {
            int src = i - (int)w;
            uint64_t v = 0;
            if (src >= 0)
                v = p->bitmap[src] << b;
            if (b != 0 && src - 1 >= 0)
                v |= p->bitmap[src - 1] >> (64 - b);
            p->bitmap[i] = v;
        }
        p->highest = ts;
        p->bitmap[0] |= 1;
    } else {
        uint64_t d = p->highest - ts;
        p->bitmap[d / 64] |= (uint64_t)1 << (d % 64);
    }
}

int hm_dgram_seal(hm_dgram_ctx *ctx, const uint8_t peer_pk[HM_PK_BYTES], uint64_t now_us,
                  const void *payload, size_t len, uint8_t *out, size_t cap, size_t *out_len)
{
    uint8_t key[32];
    int result = 0;

    if (len > HM_DGRAM_MAX_PAYLOAD || cap < len + HM_DGRAM_OVERHEAD)
        return -EMSGSIZE;
    if (memcmp(peer_pk, ctx->pk, HM_PK_BYTES) == 0)
        return -EINVAL;
    struct dgram_peer *p = peer_find(ctx, peer_pk);
    if (p != NULL) {
        memcpy(key, p->key, 32);
        peer_touch(ctx, p, now_us);
    } else {
        if (pair_key(ctx, peer_pk, key) < 0) {
            result = -EINVAL;
            goto out;
        }
        /* Cache the key if there is room; sending never needs a slot. */
        if (peer_recyclable(ctx, now_us))
            peer_insert(ctx, peer_pk, key, now_us);
    }
    uint64_t ts = now_us > ctx->last_ts ? now_us : ctx->last_ts + 1;
    ctx->last_ts = ts;
    out[0] = DGRAM_VERSION;
    memcpy(out + 1, ctx->pk, HM_PK_BYTES);
    memcpy(out + 33, peer_pk, 8);
    hm_put_be64(out + 41, ts);
    randombytes_buf(out + 49, 16);
    unsigned long long clen = 0;
    /* The nonce is timestamp || random, i.e. the last 24 header bytes. */
    crypto_aead_xchacha20poly1305_ietf_encrypt(out + HM_DGRAM_HEADER, &clen, payload, len,
                                               out, HM_DGRAM_HEADER, NULL, out + 41, key);
    *out_len = HM_DGRAM_HEADER + (size_t)clen;
out:
    sodium_memzero(key, sizeof(key));
    return result;
}

int hm_dgram_open(hm_dgram_ctx *ctx, const uint8_t *in, size_t len, uint64_t now_us,
                  uint8_t sender_pk_out[HM_PK_BYTES], uint8_t *pt_out, size_t pt_cap,
                  size_t *pt_len_out)
{
    uint8_t key[32];
    int result = 0;

    /* Cheap checks first: size, version, recipient, clock, replay; crypto last. */
    if (len > HM_DGRAM_MAX)
        return -EMSGSIZE;
    if (len < HM_DGRAM_OVERHEAD || in[0] != DGRAM_VERSION)
        return -EINVAL;
    const uint8_t *sender = in + 1;
    if (memcmp(in + 33, ctx->pk, 8) != 0 || memcmp(sender, ctx->pk, HM_PK_BYTES) == 0)
        return -EINVAL;
    size_t pt_len = len - HM_DGRAM_OVERHEAD;
    if (pt_cap < pt_len)
        return -EMSGSIZE;
    uint64_t ts = hm_get_be64(in + 41);
    if ((ts < now_us && now_us - ts > HM_DGRAM_WINDOW_US) ||
        (ts > now_us && ts - now_us > HM_DGRAM_WINDOW_US))
        return -ESTALE;
    struct dgram_peer *p = peer_find(ctx, sender);
    if (p != NULL) {
        result = replay_check(p, ts);
        if (result < 0)
            return result;
        memcpy(key, p->key, 32);
    } else {
        if (!peer_recyclable(ctx, now_us))
            return -ENOBUFS;
        result = pair_key(ctx, sender, key);
        if (result < 0)
            goto out;
    }
    unsigned long long mlen = 0;
    if (crypto_aead_xchacha20poly1305_ietf_decrypt(pt_out, &mlen, NULL, in + HM_DGRAM_HEADER,
                                                   len - HM_DGRAM_HEADER, in, HM_DGRAM_HEADER,
                                                   in + 41, key) != 0) {
        result = -EBADMSG;
        goto out;
    }
    /* Only authentic datagrams create or change sender state. */
    if (p == NULL)
        p = peer_insert(ctx, sender, key, now_us);
    else
        peer_touch(ctx, p, now_us);
    replay_mark(p, ts);
    memcpy(sender_pk_out, sender, HM_PK_BYTES);
    *pt_len_out = (size_t)mlen;
out:
    sodium_memzero(key, sizeof(key));
    return result;
}

int hm_dgram_sender_cached(hm_dgram_ctx *ctx, const uint8_t *in, size_t len)
{
    if (len < HM_DGRAM_HEADER || in[0] != DGRAM_VERSION)
        return 0;
    return peer_find(ctx, in + 1) != NULL;
}

/* ---- stream handshake ---- */

enum hs_state {
    HS_CLIENT_WAIT_MSG2 = 1,
    HS_SERVER_WAIT_MSG1,
    HS_SERVER_WAIT_MSG3,
    HS_DONE,
    HS_FAILED,
};

const char *hm_rec_cipher_name(int cipher)
{
    switch (cipher) {
    case HM_CIPHER_CHACHA20_POLY1305:
        return "chacha20-poly1305";
    case HM_CIPHER_AES_256_GCM:
        return "aes-256-gcm";
    default:
        return NULL;
    }
}

int hm_rec_cipher_parse(const char *name)
{
    if (name == NULL)
        return -EINVAL;
    if (strcmp(name, "chacha20-poly1305") == 0)
        return HM_CIPHER_CHACHA20_POLY1305;
    if (strcmp(name, "aes-256-gcm") == 0)
        return HM_CIPHER_AES_256_GCM;
    return -EINVAL;
}

size_t hm_rec_cipher_auto(uint8_t out[HM_HS_CIPHERS_MAX])
{
    int aes_first = 0;
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    /*
     * AES-GCM is fast only with AES-NI and PCLMULQDQ (OpenSSL adds VAES and
     * VPCLMULQDQ on AVX-512 parts); without them it is a table-driven,
     * slower and cache-timing-exposed cipher, and ChaCha20 wins.
     */
    __builtin_cpu_init();
    aes_first = __builtin_cpu_supports("aes") && __builtin_cpu_supports("pclmul");
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRYPTO)
    aes_first = 1;
#endif
    memset(out, 0, HM_HS_CIPHERS_MAX);
    out[0] = aes_first ? HM_CIPHER_AES_256_GCM : HM_CIPHER_CHACHA20_POLY1305;
    out[1] = aes_first ? HM_CIPHER_CHACHA20_POLY1305 : HM_CIPHER_AES_256_GCM;
    return 2;
}

static size_t hs_expected(const hm_handshake *hs)
{
    switch (hs->state) {
    case HS_CLIENT_WAIT_MSG2:
        return HM_HS_MSG2_LEN;
    case HS_SERVER_WAIT_MSG1:
        return HM_HS_MSG1_LEN;
    case HS_SERVER_WAIT_MSG3:
        return HM_HS_MSG3_LEN;
    default:
        return 0;
    }
}

static void hs_hash(uint8_t out[32], const uint8_t *a, size_t alen, const uint8_t *b, size_t blen)
{
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, 32);
    crypto_generichash_update(&st, a, alen);
    crypto_generichash_update(&st, b, blen);
    crypto_generichash_final(&st, out, 32);
}

/* The signed message: label || swarm_id || transcript hash. */
static void hs_sig_msg(uint8_t msg[HS_LABEL_LEN + 64], const char *label,
                       const uint8_t swarm_id[32], const uint8_t h[32])
{
    memcpy(msg, label, HS_LABEL_LEN);
    memcpy(msg + HS_LABEL_LEN, swarm_id, 32);
    memcpy(msg + HS_LABEL_LEN + 32, h, 32);
}

/* Each direction's secret = BLAKE2b-256(key = swarm_id, kx key || H1). */
static void hs_session_key(uint8_t key[32], const uint8_t swarm_id[32], const uint8_t kx[32],
                           const uint8_t h1[32])
{
    crypto_generichash_state st;
    crypto_generichash_init(&st, swarm_id, 32, 32);
    crypto_generichash_update(&st, kx, 32);
    crypto_generichash_update(&st, h1, 32);
    crypto_generichash_final(&st, key, 32);
    sodium_memzero(&st, sizeof(st));
}

static int cipher_known(int id)
{
    return hm_rec_cipher_name(id) != NULL;
}

/* Checks a cipher list: 1..max known ids, no repeats. */
static int ciphers_valid(const uint8_t *ids, size_t n)
{
    if (ids == NULL || n == 0 || n > HM_HS_CIPHERS_MAX)
        return 0;
    for (size_t i = 0; i < n; i++) {
        if (!cipher_known(ids[i]))
            return 0;
        for (size_t j = 0; j < i; j++)
            if (ids[j] == ids[i])
                return 0;
    }
    return 1;
}

static void hs_base_init(hm_handshake *hs, int role, const hm_identity *id,
                         const uint8_t swarm_id[HM_SWARM_ID_BYTES])
{
    memset(hs, 0, sizeof(*hs));
    hs->role = role;
    hs->id = id;
    memcpy(hs->swarm_id, swarm_id, HM_SWARM_ID_BYTES);
    (void)hm_rec_cipher_auto(hs->ciphers);
}

void hm_hs_init_client(hm_handshake *hs, const hm_identity *id,
                       const uint8_t swarm_id[HM_SWARM_ID_BYTES],
                       const uint8_t server_pk[HM_PK_BYTES])
{
    hs_base_init(hs, HM_HS_CLIENT, id, swarm_id);
    memcpy(hs->peer_pk, server_pk, HM_PK_BYTES);
    crypto_kx_keypair(hs->eph_pk, hs->eph_sk);
    hs->msg1[0] = HM_HS_VERSION;
    memcpy(hs->msg1 + 1, id->pk, HM_PK_BYTES);
    memcpy(hs->msg1 + 33, hs->eph_pk, 32);
    memcpy(hs->msg1 + 65, server_pk, HM_PK_BYTES);
    memcpy(hs->msg1 + 97, hs->ciphers, HM_HS_CIPHERS_MAX);
    memcpy(hs->out, hs->msg1, HM_HS_MSG1_LEN);
    hs->out_len = HM_HS_MSG1_LEN;
    hs->state = HS_CLIENT_WAIT_MSG2;
}

void hm_hs_init_server(hm_handshake *hs, const hm_identity *id,
                       const uint8_t swarm_id[HM_SWARM_ID_BYTES])
{
    hs_base_init(hs, HM_HS_SERVER, id, swarm_id);
    hs->state = HS_SERVER_WAIT_MSG1;
}

int hm_hs_set_ciphers(hm_handshake *hs, const uint8_t *ids, size_t n)
{
    if (!ciphers_valid(ids, n))
        return -EINVAL;
    /* A client's list is in msg1, which must still be unsent and whole. */
    if (hs->role == HM_HS_CLIENT &&
        (hs->state != HS_CLIENT_WAIT_MSG2 || hs->out_len != HM_HS_MSG1_LEN ||
         memcmp(hs->out, hs->msg1, HM_HS_MSG1_LEN) != 0))
        return -EALREADY;
    if (hs->role == HM_HS_SERVER && (hs->state != HS_SERVER_WAIT_MSG1 || hs->in_len != 0))
        return -EALREADY;
    memset(hs->ciphers, 0, sizeof(hs->ciphers));
    memcpy(hs->ciphers, ids, n);
    if (hs->role == HM_HS_CLIENT) {
        memcpy(hs->msg1 + 97, hs->ciphers, HM_HS_CIPHERS_MAX);
        memcpy(hs->out, hs->msg1, HM_HS_MSG1_LEN);
    }
    return 0;
}

static int ciphers_have(const uint8_t list[HM_HS_CIPHERS_MAX], int id)
{
    for (size_t i = 0; i < HM_HS_CIPHERS_MAX; i++)
        if (list[i] != 0 && list[i] == id)
            return 1;
    return 0;
}

/* Server: msg1 in, msg2 out. */
static int hs_server_msg1(hm_handshake *hs, const uint8_t *m)
{
    uint8_t kx_rx[32], kx_tx[32], sig_msg[HS_LABEL_LEN + 64];
    int result = 0;

    if (m[0] != HM_HS_VERSION)
        return -EPROTONOSUPPORT;
    if (sodium_memcmp(m + 65, hs->id->pk, HM_PK_BYTES) != 0)
        return -EPERM;
    if (!crypto_core_ed25519_is_valid_point(m + 1))
        return -EPROTO;
    /*
     * The client's list: known ids, packed to the front, no repeats. The
     * first of them that we support too is the one; unknown ids are skipped,
     * so that a later version may offer ciphers we do not have.
     */
    int chosen = 0;
    for (size_t i = 0; i < HM_HS_CIPHERS_MAX; i++) {
        uint8_t id = m[97 + i];
        if (id == 0) {
            for (size_t j = i + 1; j < HM_HS_CIPHERS_MAX; j++)
                if (m[97 + j] != 0)
                    return -EPROTO;
            break;
        }
        for (size_t j = 0; j < i; j++)
            if (m[97 + j] == id)
                return -EPROTO;
        if (chosen == 0 && cipher_known(id) && ciphers_have(hs->ciphers, id))
            chosen = id;
    }
    if (chosen == 0)
        return -ENOPROTOOPT;
    memcpy(hs->msg1, m, HM_HS_MSG1_LEN);
    memcpy(hs->peer_pk, m + 1, HM_PK_BYTES);
    crypto_kx_keypair(hs->eph_pk, hs->eph_sk);
    /* Fails on a low-order client ephemeral key, which would fix the secret. */
    if (crypto_kx_server_session_keys(kx_rx, kx_tx, hs->eph_pk, hs->eph_sk, m + 33) != 0) {
        result = -EPROTO;
        goto out;
    }
    uint8_t *msg2 = hs->out + hs->out_len;
    memcpy(msg2, hs->eph_pk, 32);
    msg2[32] = (uint8_t)chosen;
    hs_hash(hs->h1, hs->msg1, HM_HS_MSG1_LEN, msg2, 33);
    hs_session_key(hs->rx_key, hs->swarm_id, kx_rx, hs->h1);
    hs_session_key(hs->tx_key, hs->swarm_id, kx_tx, hs->h1);
    hs_sig_msg(sig_msg, hs_server_label, hs->swarm_id, hs->h1);
    crypto_sign_detached(msg2 + 33, NULL, sig_msg, sizeof(sig_msg), hs->id->sk);
    hs->out_len += HM_HS_MSG2_LEN;
    hs->cipher = chosen;
    /*
     * H1 has served its purpose (session keys); from here the field holds
     * H2, the transcript hash the client's signature must cover.
     */
    hs_hash(hs->h1, hs->msg1, HM_HS_MSG1_LEN, msg2, HM_HS_MSG2_LEN);
    sodium_memzero(hs->eph_sk, sizeof(hs->eph_sk));
    hs->state = HS_SERVER_WAIT_MSG3;
out:
    sodium_memzero(kx_rx, sizeof(kx_rx));
    sodium_memzero(kx_tx, sizeof(kx_tx));
    return result;
}

/* The session the finished handshake hands out. */
static void hs_make_session(hm_handshake *hs)
{
    hm_session *s = &hs->session;
    memset(s, 0, sizeof(*s));
    memcpy(s->tx.secret, hs->tx_key, 32);
    memcpy(s->rx.secret, hs->rx_key, 32);
    s->cipher = hs->cipher;
    s->rekey_records = HM_REC_REKEY_RECORDS;
    memcpy(s->peer_pk, hs->peer_pk, HM_PK_BYTES);
    sodium_memzero(hs->tx_key, sizeof(hs->tx_key));
    sodium_memzero(hs->rx_key, sizeof(hs->rx_key));
}

/* Server: msg3 in, session ready. */
static int hs_server_msg3(hm_handshake *hs, const uint8_t *m)
{
    uint8_t sig_msg[HS_LABEL_LEN + 64];

    hs_sig_msg(sig_msg, hs_client_label, hs->swarm_id, hs->h1);
    if (crypto_sign_verify_detached(m, sig_msg, sizeof(sig_msg), hs->peer_pk) != 0)
        return -EBADMSG;
    hs_make_session(hs);
    hs->state = HS_DONE;
    return 0;
}

/* Client: msg2 in, msg3 out, session ready. */
static int hs_client_msg2(hm_handshake *hs, const uint8_t *m)
{
    uint8_t kx_rx[32], kx_tx[32], sig_msg[HS_LABEL_LEN + 64], h2[32];
    int result = 0;

    hs_hash(hs->h1, hs->msg1, HM_HS_MSG1_LEN, m, 33);
    hs_sig_msg(sig_msg, hs_server_label, hs->swarm_id, hs->h1);
    if (crypto_sign_verify_detached(m + 33, sig_msg, sizeof(sig_msg), hs->peer_pk) != 0) {
        result = -EBADMSG;
        goto out;
    }
    /* A signed choice we did not offer is a broken server, never a downgrade. */
    if (!cipher_known(m[32]) || !ciphers_have(hs->ciphers, m[32])) {
        result = -EPROTO;
        goto out;
    }
    if (crypto_kx_client_session_keys(kx_rx, kx_tx, hs->eph_pk, hs->eph_sk, m) != 0) {
        result = -EPROTO;
        goto out;
    }
    hs->cipher = m[32];
    hs_session_key(hs->rx_key, hs->swarm_id, kx_rx, hs->h1);
    hs_session_key(hs->tx_key, hs->swarm_id, kx_tx, hs->h1);
    hs_hash(h2, hs->msg1, HM_HS_MSG1_LEN, m, HM_HS_MSG2_LEN);
    uint8_t *msg3 = hs->out + hs->out_len;
    hs_sig_msg(sig_msg, hs_client_label, hs->swarm_id, h2);
    crypto_sign_detached(msg3, NULL, sig_msg, sizeof(sig_msg), hs->id->sk);
    hs->out_len += HM_HS_MSG3_LEN;
    hs_make_session(hs);
    hs->state = HS_DONE;
out:
    sodium_memzero(kx_rx, sizeof(kx_rx));
    sodium_memzero(kx_tx, sizeof(kx_tx));
    sodium_memzero(hs->rx_key, sizeof(hs->rx_key));
    sodium_memzero(hs->tx_key, sizeof(hs->tx_key));
    sodium_memzero(hs->eph_sk, sizeof(hs->eph_sk));
    return result;
}

int hm_hs_input(hm_handshake *hs, const uint8_t *in, size_t len, size_t *consumed_out)
{
    size_t used = 0;
    int result = 0;

    while (hs->state != HS_DONE && hs->state != HS_FAILED) {
        size_t need = hs_expected(hs);
        if (need == 0 || need > sizeof(hs->in)) {
            result = -EINVAL; /* Not initialised. */
            goto out;
        }
        size_t take = HM_MIN(need - hs->in_len, len - used);
        if (take > 0)
            memcpy(hs->in + hs->in_len, in + used, take);
        hs->in_len += take;
        used += take;
        /*
         * The version byte comes first and decides how long msg1 is, so a
         * peer of another version is refused at once rather than left
         * waiting for bytes it will never send.
         */
        if (hs->state == HS_SERVER_WAIT_MSG1 && hs->in_len > 0) {
            hs->peer_version = hs->in[0];
            if (hs->in[0] != HM_HS_VERSION) {
                result = -EPROTONOSUPPORT;
                goto fail;
            }
        }
        if (hs->in_len < need)
            goto out;
        /*
         * The reply goes into out after what the caller has not sent yet.
         * If it does not fit, the message stays buffered for the next call.
         */
        size_t reply = hs->state == HS_CLIENT_WAIT_MSG2   ? HM_HS_MSG3_LEN
                       : hs->state == HS_SERVER_WAIT_MSG1 ? HM_HS_MSG2_LEN
                                                          : 0;
        if (hs->out_len + reply > sizeof(hs->out)) {
            result = -ENOBUFS;
            goto out;
        }
        switch (hs->state) {
        case HS_CLIENT_WAIT_MSG2:
            result = hs_client_msg2(hs, hs->in);
            break;
        case HS_SERVER_WAIT_MSG1:
            result = hs_server_msg1(hs, hs->in);
            break;
        default:
            result = hs_server_msg3(hs, hs->in);
            break;
        }
        sodium_memzero(hs->in, sizeof(hs->in));
        hs->in_len = 0;
        if (result < 0)
            goto fail;
    }
    if (hs->state == HS_FAILED && result == 0)
        result = -EPROTO; /* Input after a failure is refused again. */
    goto out;
fail: {
    int pv = hs->peer_version;
    hm_hs_wipe(hs);
    hs->state = HS_FAILED;
    hs->peer_version = pv; /* for the caller's log line */
}
out:
    if (consumed_out != NULL)
        *consumed_out = used;
    if (result < 0)
        return result;
    return hs->state == HS_DONE ? 1 : 0;
}

int hm_hs_peer_version(const hm_handshake *hs)
{
    return hs->peer_version;
}

int hm_hs_cipher(const hm_handshake *hs)
{
    return hs->state == HS_DONE ? hs->cipher : 0;
}

void hm_hs_finish(hm_handshake *hs, hm_session *out)
{
    if (hs->state == HS_DONE)
        memcpy(out, &hs->session, sizeof(*out));
    else
        memset(out, 0, sizeof(*out));
    hm_hs_wipe(hs);
}

void hm_hs_wipe(hm_handshake *hs)
{
    /* The handshake's session never holds cipher contexts (they are made at first use). */
    sodium_memzero(hs, sizeof(*hs));
}

/* ---- stream records ---- */

static const char rec_next_label[] = "hivemindd/rec/next/v2";
static const char rec_key_label[] = "hivemindd/rec/key/v2";
static const char rec_iv_label[] = "hivemindd/rec/iv/v2";

static void rec_kdf(uint8_t *out, size_t outlen, const uint8_t secret[32], const char *label,
                    int cipher, int with_cipher)
{
    crypto_generichash_state st;
    uint8_t c = (uint8_t)cipher;
    crypto_generichash_init(&st, secret, 32, outlen);
    crypto_generichash_update(&st, (const uint8_t *)label, strlen(label));
    if (with_cipher)
        crypto_generichash_update(&st, &c, 1);
    crypto_generichash_final(&st, out, outlen);
    sodium_memzero(&st, sizeof(st));
}

static const EVP_CIPHER *rec_evp(int cipher)
{
    switch (cipher) {
    case HM_CIPHER_CHACHA20_POLY1305:
        return EVP_chacha20_poly1305();
    case HM_CIPHER_AES_256_GCM:
        return EVP_aes_256_gcm();
    default:
        return NULL;
    }
}

/*
 * Makes the direction ready for its next record: the context exists and
 * holds this epoch's key, and the counter has room. The key is set once per
 * epoch; each record then sets only its nonce.
 */
static int rec_ready(hm_session *s, hm_rec_dir *d, int enc)
{
    uint8_t key[32];
    int result = 0;

    if (d->seq >= s->rekey_records) {
        if (d->epoch == UINT32_MAX)
            return -EOVERFLOW;
        uint8_t next[32];
        rec_kdf(next, 32, d->secret, rec_next_label, 0, 0);
        memcpy(d->secret, next, 32);
        sodium_memzero(next, sizeof(next));
        d->epoch++;
        d->seq = 0;
        d->keyed = 0;
    }
    if (d->keyed)
        return 0;
    const EVP_CIPHER *evp = rec_evp(s->cipher);
    if (evp == NULL)
        return -EINVAL;
    int fresh = d->ctx == NULL;
    if (fresh && (d->ctx = EVP_CIPHER_CTX_new()) == NULL)
        return -ENOMEM;
    rec_kdf(key, 32, d->secret, rec_key_label, s->cipher, 1);
    rec_kdf(d->iv, 12, d->secret, rec_iv_label, s->cipher, 1);
    if (EVP_CipherInit_ex(d->ctx, fresh ? evp : NULL, NULL, key, NULL, enc) != 1)
        result = -EIO;
    else
        d->keyed = 1;
    sodium_memzero(key, sizeof(key));
    return result;
}

static void rec_nonce(const hm_rec_dir *d, uint8_t nonce[12])
{
    memcpy(nonce, d->iv, 12);
    for (int i = 0; i < 8; i++)
        nonce[4 + i] ^= (uint8_t)(d->seq >> (56 - 8 * i));
}

/*
 * One AEAD operation on a keyed context: sets the nonce only (the key
 * schedule stays), authenticates aad, and encrypts or decrypts the len
 * bytes of in, then the len2 bytes of in2, into out (out may equal in;
 * in2 must not overlap out); the tag is written to, or checked against,
 * tag. Taking the input in two parts lets the transport seal a chunk
 * header and the message bytes where they lie, without copying them
 * together first. Returns 0, -EBADMSG (not authentic) or -EIO.
 */
static int aead_op2(EVP_CIPHER_CTX *ctx, int enc, const uint8_t nonce[12], const uint8_t *aad,
                    size_t aad_len, const uint8_t *in, size_t len, const uint8_t *in2,
                    size_t len2, uint8_t *out, uint8_t tag[HM_REC_TAG])
{
    int n = 0;
    if (len > INT_MAX || len2 > INT_MAX - len || aad_len > INT_MAX)
        return -EIO;
    if (EVP_CipherInit_ex(ctx, NULL, NULL, NULL, nonce, enc) != 1 ||
        (aad_len > 0 && EVP_CipherUpdate(ctx, NULL, &n, aad, (int)aad_len) != 1) ||
        (len > 0 && EVP_CipherUpdate(ctx, out, &n, in, (int)len) != 1) ||
        (len2 > 0 && EVP_CipherUpdate(ctx, out + len, &n, in2, (int)len2) != 1))
        return -EIO;
    len += len2;
    if (!enc && EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_SET_TAG, HM_REC_TAG, tag) != 1)
        return -EIO;
    /* An AEAD's final step writes no bytes; out + len is only a valid place. */
    if (EVP_CipherFinal_ex(ctx, out + len, &n) != 1)
        return enc ? -EIO : -EBADMSG;
    if (enc && EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_GET_TAG, HM_REC_TAG, tag) != 1)
        return -EIO;
    return 0;
}

static int aead_op(EVP_CIPHER_CTX *ctx, int enc, const uint8_t nonce[12], const uint8_t *aad,
                   size_t aad_len, const uint8_t *in, size_t len, uint8_t *out,
                   uint8_t tag[HM_REC_TAG])
{
    return aead_op2(ctx, enc, nonce, aad, aad_len, in, len, NULL, 0, out, tag);
}

int hm_aead_crypt(int cipher, int enc, const uint8_t key[32], const uint8_t nonce[12],
                  const uint8_t *aad, size_t aad_len, const uint8_t *in, size_t len,
                  uint8_t *out, uint8_t tag[HM_REC_TAG])
{
    const EVP_CIPHER *evp = rec_evp(cipher);
    if (evp == NULL)
        return -EINVAL;
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    if (ctx == NULL)
        return -ENOMEM;
    int result = -EIO;
    if (EVP_CipherInit_ex(ctx, evp, NULL, key, NULL, enc ? 1 : 0) == 1)
        result = aead_op(ctx, enc ? 1 : 0, nonce, aad, aad_len, in, len, out, tag);
    EVP_CIPHER_CTX_free(ctx);
    return result;
}

/* One record in direction d (plaintext buf || buf2), with the record header as associated data. */
static int rec_crypt(hm_session *s, hm_rec_dir *d, int enc, const uint8_t hdr[HM_REC_HEADER],
                     const uint8_t *buf, size_t len, const uint8_t *buf2, size_t len2,
                     uint8_t *out, uint8_t tag[HM_REC_TAG])
{
    uint8_t nonce[12];
    int result = rec_ready(s, d, enc);
    if (result < 0)
        return result;
    rec_nonce(d, nonce);
    result = aead_op2(d->ctx, enc, nonce, hdr, HM_REC_HEADER, buf, len, buf2, len2, out, tag);
    if (result < 0)
        return result;
    /* Only a record that passed moves the counter; a failure closes the stream anyway. */
    d->seq++;
    return 0;
}

int hm_session_seal2(hm_session *s, const void *head, size_t head_len, const void *body,
                     size_t body_len, uint8_t *out, size_t *out_len)
{
    if (head_len > HM_REC_MAX_PLAIN || body_len > HM_REC_MAX_PLAIN - head_len)
        return -EMSGSIZE;
    size_t len = head_len + body_len, clen = len + HM_REC_TAG;
    out[0] = (uint8_t)(clen >> 8);
    out[1] = (uint8_t)clen;
    int r = rec_crypt(s, &s->tx, 1, out, head, head_len, body, body_len, out + HM_REC_HEADER,
                      out + HM_REC_HEADER + len);
    if (r < 0)
        return r;
    *out_len = HM_REC_HEADER + clen;
    return 0;
}

int hm_session_seal(hm_session *s, const void *pt, size_t len, uint8_t *out, size_t *out_len)
{
    return hm_session_seal2(s, pt, len, NULL, 0, out, out_len);
}

/* Reads the header: 0 incomplete, 1 whole record of *clen_out, or negative. */
static int rec_header(const uint8_t *in, size_t len, size_t *clen_out)
{
    if (len < HM_REC_HEADER)
        return 0;
    size_t clen = (size_t)in[0] << 8 | in[1];
    if (clen > HM_REC_MAX_PLAIN + HM_REC_TAG)
        return -EMSGSIZE;
    if (clen < HM_REC_TAG)
        return -EBADMSG;
    if (len - HM_REC_HEADER < clen)
        return 0;
    *clen_out = clen;
    return 1;
}

int hm_session_open_inplace(hm_session *s, uint8_t *buf, size_t len, size_t *consumed_out,
                            uint8_t **pt_out, size_t *pt_len_out)
{
    size_t clen = 0;
    *consumed_out = 0;
    int r = rec_header(buf, len, &clen);
    if (r <= 0)
        return r;
    size_t ptlen = clen - HM_REC_TAG;
    uint8_t *body = buf + HM_REC_HEADER;
    r = rec_crypt(s, &s->rx, 0, buf, body, ptlen, NULL, 0, body, body + ptlen);
    if (r < 0)
        return r;
    *consumed_out = HM_REC_HEADER + clen;
    *pt_out = body;
    *pt_len_out = ptlen;
    return 1;
}

int hm_session_open_begin(hm_session *s, uint8_t *buf, size_t len, size_t head,
                          hm_rec_open *op)
{
    uint8_t nonce[12];
    size_t clen = 0;
    int n = 0;
    memset(op, 0, sizeof(*op));
    int r = rec_header(buf, len, &clen);
    if (r <= 0)
        return r;
    r = rec_ready(s, &s->rx, 0);
    if (r < 0)
        return r;
    op->rec = buf;
    op->pt_len = clen - HM_REC_TAG;
    op->head_len = HM_MIN(head, op->pt_len);
    op->consumed = HM_REC_HEADER + clen;
    rec_nonce(&s->rx, nonce);
    uint8_t *body = buf + HM_REC_HEADER;
    if (EVP_CipherInit_ex(s->rx.ctx, NULL, NULL, NULL, nonce, 0) != 1 ||
        EVP_CipherUpdate(s->rx.ctx, NULL, &n, buf, HM_REC_HEADER) != 1 ||
        (op->head_len > 0 && EVP_CipherUpdate(s->rx.ctx, body, &n, body, (int)op->head_len) != 1))
        return -EIO;
    return 1;
}

int hm_session_open_end(hm_session *s, hm_rec_open *op, uint8_t *dest)
{
    int n = 0;
    uint8_t *body = op->rec + HM_REC_HEADER;
    size_t rest = op->pt_len - op->head_len;
    uint8_t *out = dest != NULL ? dest : body + op->head_len;
    if (rest > 0 && EVP_CipherUpdate(s->rx.ctx, out, &n, body + op->head_len, (int)rest) != 1)
        return -EIO;
    if (EVP_CIPHER_CTX_ctrl(s->rx.ctx, EVP_CTRL_AEAD_SET_TAG, HM_REC_TAG, body + op->pt_len) != 1)
        return -EIO;
    if (EVP_CipherFinal_ex(s->rx.ctx, out + rest, &n) != 1)
        return -EBADMSG;
    s->rx.seq++;
    return 1;
}

int hm_session_open(hm_session *s, const uint8_t *in, size_t len, size_t *consumed_out,
                    uint8_t *pt_out, size_t *pt_len_out)
{
    size_t clen = 0;
    uint8_t tag[HM_REC_TAG];
    *consumed_out = 0;
    int r = rec_header(in, len, &clen);
    if (r <= 0)
        return r;
    size_t ptlen = clen - HM_REC_TAG;
    memcpy(tag, in + HM_REC_HEADER + ptlen, HM_REC_TAG);
    r = rec_crypt(s, &s->rx, 0, in, in + HM_REC_HEADER, ptlen, NULL, 0, pt_out, tag);
    if (r < 0) {
        /* Nothing unauthenticated reaches the caller. */
        sodium_memzero(pt_out, ptlen);
        return r;
    }
    *consumed_out = HM_REC_HEADER + clen;
    *pt_len_out = ptlen;
    return 1;
}

int hm_session_set_rekey_records(hm_session *s, uint64_t n)
{
    if (n == 0 || n > HM_REC_REKEY_RECORDS)
        return -EINVAL;
    s->rekey_records = n;
    return 0;
}

int hm_session_dup(const hm_session *s, hm_session *out)
{
    memcpy(out, s, sizeof(*out));
    out->tx.ctx = out->rx.ctx = NULL;
    const hm_rec_dir *src[2] = {&s->tx, &s->rx};
    hm_rec_dir *dst[2] = {&out->tx, &out->rx};
    for (int i = 0; i < 2; i++) {
        if (src[i]->ctx == NULL)
            continue;
        if ((dst[i]->ctx = EVP_CIPHER_CTX_new()) == NULL ||
            EVP_CIPHER_CTX_copy(dst[i]->ctx, src[i]->ctx) != 1) {
            hm_session_wipe(out);
            return -ENOMEM;
        }
    }
    return 0;
}

void hm_session_wipe(hm_session *s)
{
    /* EVP_CIPHER_CTX_free cleans the key schedule before freeing it. */
    EVP_CIPHER_CTX_free(s->tx.ctx);
    EVP_CIPHER_CTX_free(s->rx.ctx);
    sodium_memzero(s, sizeof(*s));
}

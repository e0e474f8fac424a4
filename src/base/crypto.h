/*
 * crypto: node identity, swarm binding, authenticated datagrams, the stream
 * handshake and the stream record layer. All of it is sans-I/O (bytes in,
 * bytes out) so that the parsers can be fuzzed and the transport stays thin.
 * Built on libsodium, except the stream records, which use OpenSSL's
 * libcrypto EVP AEAD for its speed (docs/benchmarks.md).
 *
 * Identity. An ed25519 key pair per node, stored as a 64-byte secret key in
 * a file of mode 0600. Peer id = base32 (lowercase, unpadded, 52 characters)
 * of the 32-byte public key; DHT node id = BLAKE2b-256 of the public key, so
 * nobody chooses where they sit in the DHT. A peer's address is
 * PEERID@HOST:PORT.
 *
 * Swarm binding. swarm_id = BLAKE2b-256(key = pre-shared swarm key or none,
 * message = "hivemindd/swarm/v1\0" || swarm name). Every datagram key and
 * every handshake signature covers swarm_id, so peers of another swarm, or
 * without the swarm key, fail authentication.
 *
 * Datagrams. Both sides' ed25519 keys are converted to X25519; the pair key
 * is BLAKE2b-256(key = swarm_id, X25519(my_sk, peer_pk) || lower pk || higher
 * pk) and is cached per peer. Layout (big-endian integers):
 *
 *   u8  version (1)
 *   32  sender ed25519 public key
 *   8   first 8 bytes of the recipient's public key
 *   8   sender timestamp, microseconds since the epoch, strictly increasing
 *   16  random
 *   ... XChaCha20-Poly1305 ciphertext with the 65-byte header as AD
 *       (nonce = timestamp || random), 16-byte tag
 *
 * A datagram is accepted only if it decrypts under the pair key (so it was
 * made by the holder of the sender's or our secret key), its timestamp lies
 * within HM_DGRAM_WINDOW_US of our clock, and it is not a replay: per sender
 * we keep the highest timestamp and a 1024-entry bitmap below it. Since
 * timestamps are in microseconds, a datagram overtaken by one its sender
 * made more than 1024 us later is refused (-ESTALE) like a lost one; such
 * reordering is rare, and the DHT above retries lost datagrams anyway.
 * Sender entries idle for twice the window are recycled (a replay of
 * anything they accepted is then outside the window); when the table is
 * full of live entries, datagrams from new senders are dropped (bounded
 * memory). Sealing never needs a free entry.
 *
 * Stream handshake, protocol version 2 (client knows the server's public
 * key from its address):
 *   msg1 C->S: u8 version (2) | C static pk (32) | C ephemeral X25519 pk (32)
 *              | S static pk as the client expects it (32)
 *              | the client's record ciphers, most preferred first (4;
 *                cipher ids, unused places 0)                          = 101
 *   msg2 S->C: S ephemeral X25519 pk (32) | u8 chosen cipher
 *              | sig_S(ed25519 over "hivemindd/hs/server/v2" || swarm_id || H1) (64) = 97
 *   msg3 C->S: sig_C(ed25519 over "hivemindd/hs/client/v2" || swarm_id || H2) (64) = 64
 *   H1 = BLAKE2b-256(msg1 || S eph pk || chosen cipher), H2 = BLAKE2b-256(msg1 || msg2).
 * The server chooses the first cipher in the client's list that it supports
 * itself, and refuses the handshake (-ENOPROTOOPT) when there is none. Both
 * lists and the choice are under both signatures, so a man in the middle
 * cannot downgrade the cipher without breaking the handshake. A server reads
 * the version byte first and refuses another version (-EPROTONOSUPPORT) at
 * once; hm_hs_peer_version tells the caller which version the peer spoke.
 *
 * Session secrets: crypto_kx on the ephemeral keys, each direction's key then
 * hashed as BLAKE2b-256(key = swarm_id, kx_key || H1). Forward secrecy comes
 * from the ephemeral keys; authentication from the static signatures over
 * the transcript. A server whose key differs from the one in msg1 refuses.
 *
 * Record layer (OpenSSL libcrypto EVP AEAD: ChaCha20-Poly1305, RFC 8439, or
 * AES-256-GCM). Each record is u16 ciphertext length (big-endian, plaintext
 * length + 16) || ciphertext || 16-byte tag, with the 2 length bytes as the
 * AEAD's associated data. Per direction and key epoch e:
 *   secret_0  = the direction's session secret above
 *   secret_e+1 = BLAKE2b-256(key = secret_e, "hivemindd/rec/next/v2")
 *   key_e      = BLAKE2b-256(key = secret_e, "hivemindd/rec/key/v2" || cipher id)
 *   iv_e       = BLAKE2b-96 (key = secret_e, "hivemindd/rec/iv/v2" || cipher id)
 *   nonce      = iv_e XOR (0^32 || be64 record counter), as in TLS 1.3.
 * The counter starts at 0 under each key. After HM_REC_REKEY_RECORDS records
 * under one key both sides move to the next epoch by themselves (TCP keeps
 * records in order, so no message is needed) and the counter restarts; so a
 * (key, nonce) pair is never used twice. The bound is AES-GCM's: RFC 8446
 * 5.5 and the AEAD limits draft allow 2^24.5 full-size (16 KiB) records per
 * AES-GCM key for an attacker advantage of 2^-57; we rekey at 2^24 records
 * (at most 256 GiB per key) for both ciphers, far inside ChaCha20-Poly1305's
 * bounds. Forgery: any record that fails to authenticate closes the stream,
 * so an attacker gets one forgery attempt per key. After 2^32 - 1 epochs
 * (2^56 records) a session refuses to seal (-EOVERFLOW) and the stream
 * closes; nothing reaches that. Replayed, reordered, dropped, truncated or
 * tampered records all fail to authenticate, since the nonce is implicit.
 */
#ifndef HM_CRYPTO_H
#define HM_CRYPTO_H

#include <sodium.h>
#include <stddef.h>
#include <stdint.h>

#define HM_PK_BYTES 32
#define HM_SK_BYTES 64
#define HM_NODE_ID_BYTES 32
#define HM_PEER_ID_LEN 52
#define HM_SWARM_ID_BYTES 32

typedef struct hm_identity {
    uint8_t pk[HM_PK_BYTES];
    uint8_t sk[HM_SK_BYTES];
    uint8_t node_id[HM_NODE_ID_BYTES];
    uint8_t x_pk[32]; /* X25519 forms of the key, for datagram pair keys */
    uint8_t x_sk[32];
    char peer_id[HM_PEER_ID_LEN + 1];
} hm_identity;

/* Requires sodium_init() to have been called (hm_crypto_init does it). */
int hm_crypto_init(void);

int hm_identity_generate(hm_identity *out);
/* Derives everything from a 32-byte seed (tests and simulations). */
int hm_identity_from_seed(const uint8_t seed[32], hm_identity *out);
/*
 * Loads the key at path, or creates it (mode 0600, directory must exist)
 * when missing. Refuses a file readable or writable by group or others,
 * and a file of the wrong size. On failure writes a sentence into err.
 */
int hm_identity_load_or_create(const char *path, hm_identity *out, char *err, size_t errlen);
void hm_identity_wipe(hm_identity *id);

void hm_peer_id_encode(const uint8_t pk[HM_PK_BYTES], char out[HM_PEER_ID_LEN + 1]);
/* Returns 0 or -EINVAL (wrong length, bad character, not a valid ed25519 key). */
int hm_peer_id_decode(const char *s, size_t len, uint8_t pk_out[HM_PK_BYTES]);
/*
 * The DHT position of a key: BLAKE2b-256(pk), so that nobody chooses where
 * they sit. It is a DHT notion, but it stays here in the base rather than in
 * dht/: every identity carries its node_id, filled when the identity is made
 * (hm_identity_from_seed, below the DHT's floor), so that the DHT, the node
 * and the tests all read the same id from the identity they hold; dht/ uses
 * this function to check the id a contact claims.
 */
void hm_node_id_from_pk(const uint8_t pk[HM_PK_BYTES], uint8_t out[HM_NODE_ID_BYTES]);

/*
 * Parses "PEERID@HOST:PORT". Returns 0 or -EINVAL.
 */
struct sockaddr_storage;
int hm_peer_addr_parse(const char *s, uint8_t pk_out[HM_PK_BYTES], struct sockaddr_storage *addr_out);

void hm_swarm_id(const char *name, const uint8_t *psk, size_t psk_len,
                 uint8_t out[HM_SWARM_ID_BYTES]);
/*
 * Reads a swarm key file: 64 hex digits (optionally followed by a newline).
 * Refuses files readable by group or others. Returns 0 or negative with err.
 */
int hm_swarm_key_load(const char *path, uint8_t out[32], char *err, size_t errlen);

/* ---- datagrams ---- */

#define HM_DGRAM_MAX 1280
#define HM_DGRAM_HEADER 65
#define HM_DGRAM_OVERHEAD (HM_DGRAM_HEADER + 16)
#define HM_DGRAM_MAX_PAYLOAD (HM_DGRAM_MAX - HM_DGRAM_OVERHEAD)
#define HM_DGRAM_WINDOW_US (120ull * 1000000ull)

typedef struct hm_dgram_ctx hm_dgram_ctx;

/*
 * max_peers bounds the pair-key cache and the replay table. Returns 0 with
 * *out set, -EINVAL (max_peers 0 or over 4194304) or -ENOMEM.
 */
int hm_dgram_ctx_new(const hm_identity *id, const uint8_t swarm_id[HM_SWARM_ID_BYTES],
                     size_t max_peers, hm_dgram_ctx **out);
void hm_dgram_ctx_free(hm_dgram_ctx *ctx);

/*
 * Seals payload for peer_pk into out (cap >= len + HM_DGRAM_OVERHEAD).
 * now_us is the wall clock; the context makes timestamps strictly increasing.
 */
int hm_dgram_seal(hm_dgram_ctx *ctx, const uint8_t peer_pk[HM_PK_BYTES], uint64_t now_us,
                  const void *payload, size_t len, uint8_t *out, size_t cap, size_t *out_len);
/*
 * Opens a received datagram. On success the plaintext is in pt_out and the
 * authenticated sender in sender_pk_out. Errors: -EINVAL (malformed, not for
 * us), -EMSGSIZE, -EBADMSG, -ESTALE, -EALREADY, -ENOBUFS (replay table full).
 */
int hm_dgram_open(hm_dgram_ctx *ctx, const uint8_t *in, size_t len, uint64_t now_us,
                  uint8_t sender_pk_out[HM_PK_BYTES], uint8_t *pt_out, size_t pt_cap,
                  size_t *pt_len_out);

/*
 * Whether opening the datagram in would find its sender's pair key cached
 * (1) or would first compute an X25519 (0; also 0 for bytes too short to
 * name a sender). It reads only the header, so the transport can rate the
 * expensive opens per origin before paying for them (docs/security.md).
 */
int hm_dgram_sender_cached(hm_dgram_ctx *ctx, const uint8_t *in, size_t len);

/* ---- stream handshake ---- */

/* The stream protocol version msg1 carries; 1 was the libsodium secretstream one. */
#define HM_HS_VERSION 2
#define HM_HS_MSG1_LEN 101
#define HM_HS_MSG2_LEN 97
#define HM_HS_MSG3_LEN 64
/* Room for the cipher preference list in msg1. */
#define HM_HS_CIPHERS_MAX 4

/* Record cipher ids, as they travel in the handshake. */
enum hm_rec_cipher {
    HM_CIPHER_CHACHA20_POLY1305 = 1,
    HM_CIPHER_AES_256_GCM = 2,
};

/* The cipher's name in config and logs ("aes-256-gcm"), or NULL for an unknown id. */
const char *hm_rec_cipher_name(int cipher);
/* The id for a name, or -EINVAL. */
int hm_rec_cipher_parse(const char *name);
/*
 * This machine's preference order for StreamCipher auto: AES-256-GCM first
 * where the CPU has AES and carry-less multiply instructions (measured here:
 * OpenSSL 3.0 seals 16 KiB records ~1.45x faster with AES-256-GCM than with
 * ChaCha20-Poly1305 on an AVX-512/VAES CPU), else ChaCha20-Poly1305 first.
 * Writes up to HM_HS_CIPHERS_MAX ids into out and returns how many.
 */
size_t hm_rec_cipher_auto(uint8_t out[HM_HS_CIPHERS_MAX]);

/* Records sealed under one key before both sides move to the next (see above). */
#define HM_REC_REKEY_RECORDS (1ull << 24)

enum hm_hs_role { HM_HS_CLIENT = 1, HM_HS_SERVER = 2 };

struct evp_cipher_ctx_st; /* OpenSSL's EVP_CIPHER_CTX */

/* One direction of the record layer. */
typedef struct hm_rec_dir {
    struct evp_cipher_ctx_st *ctx; /* made and keyed at first use, then only the IV changes */
    uint8_t secret[32];            /* this epoch's secret, from which key and IV come */
    uint8_t iv[12];
    uint64_t seq;   /* records under the current key */
    uint32_t epoch; /* rekeys so far */
    int keyed;      /* ctx holds this epoch's key */
} hm_rec_dir;

/*
 * A session owns two cipher contexts once it has sealed or opened a record:
 * free it with hm_session_wipe, and copy it only with hm_session_dup.
 */
typedef struct hm_session {
    hm_rec_dir tx, rx;
    int cipher;
    uint64_t rekey_records; /* HM_REC_REKEY_RECORDS unless lowered for a test */
    uint8_t peer_pk[HM_PK_BYTES];
} hm_session;

typedef struct hm_handshake {
    int role;
    int state;
    const hm_identity *id;
    uint8_t swarm_id[HM_SWARM_ID_BYTES];
    uint8_t peer_pk[HM_PK_BYTES];
    uint8_t eph_pk[32], eph_sk[32];
    uint8_t msg1[HM_HS_MSG1_LEN];
    uint8_t h1[32];
    uint8_t rx_key[32], tx_key[32];
    uint8_t ciphers[HM_HS_CIPHERS_MAX]; /* ours, most preferred first, 0-padded */
    int cipher;                         /* the chosen one */
    int peer_version;                   /* msg1's version byte as a server read it, or 0 */
    uint8_t in[128];
    size_t in_len;
    uint8_t out[128];
    size_t out_len;
    hm_session session;
} hm_handshake;

/*
 * The client's first message is ready in the output buffer after init. Both
 * sides start with hm_rec_cipher_auto's list; hm_hs_set_ciphers narrows it.
 */
void hm_hs_init_client(hm_handshake *hs, const hm_identity *id,
                       const uint8_t swarm_id[HM_SWARM_ID_BYTES],
                       const uint8_t server_pk[HM_PK_BYTES]);
void hm_hs_init_server(hm_handshake *hs, const hm_identity *id,
                       const uint8_t swarm_id[HM_SWARM_ID_BYTES]);
/*
 * Replaces the cipher list (n ids, 1..HM_HS_CIPHERS_MAX, known, no repeats,
 * most preferred first). A client must call it right after init, before
 * sending hs->out, since msg1 carries the list. Returns 0, -EINVAL or
 * -EALREADY (the handshake has moved on).
 */
int hm_hs_set_ciphers(hm_handshake *hs, const uint8_t *ids, size_t n);
/*
 * Feeds received bytes. Returns 0 while more input is needed, 1 once the
 * handshake is complete, negative on failure (-EPROTO malformed,
 * -EPROTONOSUPPORT the peer speaks another protocol version, -ENOPROTOOPT no
 * record cipher in common, -EBADMSG bad signature: wrong swarm, wrong key or
 * impostor, -EPERM the client expects a different server). *consumed_out
 * counts the bytes taken; bytes after a completed handshake belong to the
 * record layer. Bytes to send accumulate in hs->out / hs->out_len; the
 * caller sends them and sets out_len = 0. If the caller has not, and the
 * reply would not fit, -ENOBUFS is returned with the message kept; a later
 * call (len may be 0) proceeds. Any other failure wipes the handshake and
 * every later call fails too.
 */
int hm_hs_input(hm_handshake *hs, const uint8_t *in, size_t len, size_t *consumed_out);
/* What a server read as the client's version byte (0 before it arrived); kept after failure. */
int hm_hs_peer_version(const hm_handshake *hs);
/* The chosen record cipher once the handshake is complete, else 0. */
int hm_hs_cipher(const hm_handshake *hs);
/* After completion: moves the session out and wipes the handshake secrets. */
void hm_hs_finish(hm_handshake *hs, hm_session *out);
void hm_hs_wipe(hm_handshake *hs);

/* ---- stream records ---- */

#define HM_REC_MAX_PLAIN 16384
#define HM_REC_HEADER 2
#define HM_REC_TAG 16
#define HM_REC_OVERHEAD (HM_REC_HEADER + HM_REC_TAG)

/*
 * Seals len bytes into out, which must hold len + HM_REC_OVERHEAD; len <=
 * HM_REC_MAX_PLAIN. pt may be out + HM_REC_HEADER (sealing in place, which
 * the transport does); otherwise the two must not overlap. Returns 0,
 * -EMSGSIZE, -ENOMEM (first use: no cipher context), -EOVERFLOW (the key
 * epochs are spent: close the stream) or -EIO.
 */
int hm_session_seal(hm_session *s, const void *pt, size_t len, uint8_t *out, size_t *out_len);
/*
 * The same for the plaintext head || body, read where each lies: head may
 * be out + HM_REC_HEADER (in place); body must not overlap out. The record
 * is byte for byte the one hm_session_seal makes of the joined plaintext.
 */
int hm_session_seal2(hm_session *s, const void *head, size_t head_len, const void *body,
                     size_t body_len, uint8_t *out, size_t *out_len);
/*
 * Opens the record at the start of in. Returns 0 when in holds less than a
 * whole record (*consumed_out = 0), 1 with the plaintext in pt_out (which
 * must hold HM_REC_MAX_PLAIN), or negative (-EMSGSIZE, -EBADMSG, -ENOMEM,
 * -EOVERFLOW). Any failure is fatal to the stream.
 */
int hm_session_open(hm_session *s, const uint8_t *in, size_t len, size_t *consumed_out,
                    uint8_t *pt_out, size_t *pt_len_out);
/*
 * The same, decrypting in place: on 1, *pt_out points into buf (at buf +
 * HM_REC_HEADER). On failure the record's bytes in buf are garbage.
 */
int hm_session_open_inplace(hm_session *s, uint8_t *buf, size_t len, size_t *consumed_out,
                            uint8_t **pt_out, size_t *pt_len_out);
/*
 * The in-place opener in two steps, so that the transport can read a
 * chunk's header before it decides where the rest goes. begin: when buf
 * holds a whole record (else 0, or negative as above), decrypts the first
 * min(head, plaintext length) bytes in place at buf + HM_REC_HEADER and
 * returns 1; those bytes are NOT authenticated yet, and nothing may be done
 * on them that end could not undo. end: decrypts the rest of the plaintext
 * to dest (NULL: in place, after the head), checks the tag and returns 1,
 * or -EBADMSG (fatal to the stream; what was written to dest is garbage).
 * Between the two, the session's receive side must not be used.
 */
typedef struct hm_rec_open {
    uint8_t *rec;    /* the record */
    size_t pt_len;   /* its plaintext length */
    size_t head_len; /* bytes begin decrypted in place */
    size_t consumed; /* the record's length in the stream */
} hm_rec_open;
int hm_session_open_begin(hm_session *s, uint8_t *buf, size_t len, size_t head,
                          hm_rec_open *op);
int hm_session_open_end(hm_session *s, hm_rec_open *op, uint8_t *dest);
/*
 * Records per key before the next epoch, 1..HM_REC_REKEY_RECORDS; both ends
 * must use the same value, so only tests lower it. Returns 0 or -EINVAL.
 */
int hm_session_set_rekey_records(hm_session *s, uint64_t n);
/* An independent copy, with its own cipher contexts (tests, fuzzing). 0 or -ENOMEM. */
int hm_session_dup(const hm_session *s, hm_session *out);
/* Frees the cipher contexts and wipes the secrets. */
void hm_session_wipe(hm_session *s);
/*
 * One AEAD operation through the record layer's own code path (a fresh
 * context, then the per-record step), for known-answer tests: enc 1 seals
 * in into out and writes tag, enc 0 opens and checks tag. out may equal in.
 * Returns 0, -EBADMSG (open: not authentic), -EINVAL (unknown cipher),
 * -ENOMEM or -EIO.
 */
int hm_aead_crypt(int cipher, int enc, const uint8_t key[32], const uint8_t nonce[12],
                  const uint8_t *aad, size_t aad_len, const uint8_t *in, size_t len,
                  uint8_t *out, uint8_t tag[HM_REC_TAG]);

#endif

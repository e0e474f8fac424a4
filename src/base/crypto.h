/*
 * crypto: node identity, swarm binding, authenticated datagrams, the stream
 * handshake and the stream record layer. All of it is sans-I/O (bytes in,
 * bytes out) so that the parsers can be fuzzed and the transport stays thin.
 * Built on libsodium only.
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
 * Stream handshake (client knows the server's public key from its address):
 *   msg1 C->S: u8 version | C static pk (32) | C ephemeral X25519 pk (32)
 *              | S static pk as the client expects it (32)            = 97
 *   msg2 S->C: S ephemeral X25519 pk (32)
 *              | sig_S(ed25519 over "hivemindd/hs/server/v1" || swarm_id || H1) (64)
 *              | S secretstream header (24)                          = 120
 *   msg3 C->S: sig_C(ed25519 over "hivemindd/hs/client/v1" || swarm_id || H2) (64)
 *              | C secretstream header (24)                          = 88
 *   H1 = BLAKE2b-256(msg1 || S eph pk), H2 = BLAKE2b-256(msg1 || msg2).
 * Session keys: crypto_kx on the ephemeral keys, each then hashed as
 * BLAKE2b-256(key = swarm_id, kx_key || H1). Forward secrecy comes from the
 * ephemeral keys; authentication from the static signatures over the
 * transcript. A server whose key differs from the one in msg1 refuses.
 *
 * Record layer: each record is u16 ciphertext length (big-endian) followed by
 * one crypto_secretstream_xchacha20poly1305 message. A tampered length only
 * makes the next message fail to authenticate, which closes the stream.
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

#define HM_HS_MSG1_LEN 97
#define HM_HS_MSG2_LEN 120
#define HM_HS_MSG3_LEN 88

enum hm_hs_role { HM_HS_CLIENT = 1, HM_HS_SERVER = 2 };

typedef struct hm_session {
    crypto_secretstream_xchacha20poly1305_state tx;
    crypto_secretstream_xchacha20poly1305_state rx;
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
    uint8_t in[128];
    size_t in_len;
    uint8_t out[128];
    size_t out_len;
    hm_session session;
} hm_handshake;

/* The client's first message is ready in the output buffer after init. */
void hm_hs_init_client(hm_handshake *hs, const hm_identity *id,
                       const uint8_t swarm_id[HM_SWARM_ID_BYTES],
                       const uint8_t server_pk[HM_PK_BYTES]);
void hm_hs_init_server(hm_handshake *hs, const hm_identity *id,
                       const uint8_t swarm_id[HM_SWARM_ID_BYTES]);
/*
 * Feeds received bytes. Returns 0 while more input is needed, 1 once the
 * handshake is complete, negative on failure (-EPROTO malformed, -EBADMSG bad
 * signature: wrong swarm, wrong key or impostor, -EPERM the client expects a
 * different server). *consumed_out counts the bytes taken; bytes after a
 * completed handshake belong to the record layer. Bytes to send accumulate
 * in hs->out / hs->out_len; the caller sends them and sets out_len = 0.
 * If the caller has not, and the reply would not fit, -ENOBUFS is returned
 * with the message kept; a later call (len may be 0) proceeds. Any other
 * failure wipes the handshake and every later call fails too.
 */
int hm_hs_input(hm_handshake *hs, const uint8_t *in, size_t len, size_t *consumed_out);
/* After completion: moves the session out and wipes the handshake secrets. */
void hm_hs_finish(hm_handshake *hs, hm_session *out);
void hm_hs_wipe(hm_handshake *hs);

/* ---- stream records ---- */

#define HM_REC_MAX_PLAIN 16384
#define HM_REC_OVERHEAD (2 + crypto_secretstream_xchacha20poly1305_ABYTES)

/* out must hold len + HM_REC_OVERHEAD; len <= HM_REC_MAX_PLAIN. */
int hm_session_seal(hm_session *s, const void *pt, size_t len, uint8_t *out, size_t *out_len);
/*
 * Opens the record at the start of in. Returns 0 when in holds less than a
 * whole record (*consumed_out = 0), 1 with the plaintext in pt_out (which
 * must hold HM_REC_MAX_PLAIN), or negative (-EMSGSIZE, -EBADMSG, -EPROTO
 * for a rekey or final tag, which hivemindd never sends). Any failure is
 * fatal to the stream.
 */
int hm_session_open(hm_session *s, const uint8_t *in, size_t len, size_t *consumed_out,
                    uint8_t *pt_out, size_t *pt_len_out);
void hm_session_wipe(hm_session *s);

#endif

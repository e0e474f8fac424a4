/*
 * record: the DHT record, its wire form, owner markers and signatures. Pure
 * functions over caller memory; it owns nothing.
 *
 * A record is (key, optional subkey, value, expiration, seq, signature):
 *   key         1..HM_DHT_KEY_MAX bytes chosen by the user; the DHT position
 *               of the record is key_id = BLAKE2b-256(key) (hm_dht_key_id).
 *   subkey      absent, or 0..HM_DHT_SUBKEY_MAX bytes; records with subkeys
 *               under one key merge into a dictionary.
 *   value       0..HM_DHT_VALUE_MAX bytes, opaque.
 *   expiration  absolute UNIX time in seconds (a finite double).
 *   seq         unsigned sequence number; only owned records use it.
 *   signature   absent, or 64 bytes of ed25519 (owned records only).
 *
 * Wire form: a msgpack array of exactly six elements
 *   [key bin, subkey bin | nil, value bin, expiration float | int,
 *    seq uint, signature bin(64) | nil]
 * of at most HM_DHT_RECORD_MAX_WIRE bytes in all. Decoding goes through
 * hm_wire's bounded validator; nothing else is accepted (str instead of
 * bin, extra elements, a 63-byte signature).
 *
 * Owner markers. A key or subkey whose bytes end in "[owner:PEERID]", where
 * PEERID is the 52-character base32 public key of hm_peer_id_encode, names
 * an owner. The bytes "[owner:" anywhere else, or a marker that does not
 * decode to a valid ed25519 key, make the record malformed (-EINVAL), so a
 * key that looks owned to a user always is. When both key and subkey name
 * an owner they must name the same one (-EPERM otherwise). An owned record
 * is valid only with the owner's signature over
 *   "hivemindd/dht/record/v1\0" || swarm_id (32)
 *   || u16 key_len || key || u8 has_subkey || u16 subkey_len || subkey
 *   || u16 value_len || value || u64 bits of the IEEE-754 expiration || u64 seq
 * (integers big-endian). The swarm id keeps a record signed in one swarm
 * from being replayed into another. Unowned records carry no signature; one
 * that does is not malformed, but the signature means nothing and the store
 * drops it.
 *
 * Signers promise that an owned record's expiration is at most their clock
 * plus the store's max TTL (hm_dht_record_sign refuses otherwise); the
 * store's replay tombstones (see store.h) rely on that promise.
 */
#ifndef HM_DHT_RECORD_H
#define HM_DHT_RECORD_H

#include "src/base/crypto.h"
#include "src/base/wire.h"

#include <stddef.h>
#include <stdint.h>

#define HM_DHT_KEY_MAX 256
#define HM_DHT_SUBKEY_MAX 128
#define HM_DHT_VALUE_MAX 1024
#define HM_DHT_SIG_BYTES 64
#define HM_DHT_KEY_ID_BYTES 32
/*
 * Cap on a whole record's wire form, which binds before the field caps do
 * when several fields are long: a record must fit one datagram
 * (HM_DGRAM_MAX_PAYLOAD = 1199 bytes) with about 100 bytes left for the RPC
 * envelope and the reply around it. So a 1024-byte value goes with a short
 * key and no subkey; an owned record's value (two markers and a signature)
 * can still be about 850 bytes.
 */
#define HM_DHT_RECORD_MAX_WIRE 1100
/* "[owner:" + 52-character peer id + "]" */
#define HM_DHT_OWNER_MARKER_LEN (7 + HM_PEER_ID_LEN + 1)

/*
 * A record view: every pointer refers to memory the caller (or the store,
 * or the decoded frame) owns. subkey is meaningful only when has_subkey;
 * sig is NULL when there is no signature, else HM_DHT_SIG_BYTES long.
 */
typedef struct hm_dht_record {
    const uint8_t *key;
    size_t key_len;
    const uint8_t *subkey;
    size_t subkey_len;
    int has_subkey;
    const uint8_t *value;
    size_t value_len;
    double expiration;
    uint64_t seq;
    const uint8_t *sig;
} hm_dht_record;

/* key_id = BLAKE2b-256(key). */
void hm_dht_key_id(const uint8_t *key, size_t key_len, uint8_t out[HM_DHT_KEY_ID_BYTES]);

/*
 * Writes the owner marker "[owner:PEERID]" for pk into out (which must hold
 * HM_DHT_OWNER_MARKER_LEN + 1 bytes; the result is NUL-terminated), so that
 * a user can make key = name || marker.
 */
void hm_dht_owner_marker(const uint8_t pk[HM_PK_BYTES], char out[HM_DHT_OWNER_MARKER_LEN + 1]);

/*
 * Checks field sizes (each field's cap and the whole wire form's), the
 * expiration's finiteness and the owner markers.
 * Returns 1 with the owner's key in owner_pk_out (may be NULL) for an owned
 * record, 0 for an unowned one, -EMSGSIZE (a field over its cap), -EINVAL
 * (empty key, non-finite expiration, malformed marker) or -EPERM (key and
 * subkey name different owners).
 */
int hm_dht_record_owner(const hm_dht_record *r, uint8_t owner_pk_out[HM_PK_BYTES]);

/*
 * Signs an owned record with the owner's identity: id must be the owner the
 * markers name. now and max_ttl (seconds) enforce the signer's promise
 * above. Writes the signature into sig_out; the caller points r->sig at it.
 * Returns 0, -EPERM (not owned, or owned by someone else), -ERANGE
 * (expiration beyond now + max_ttl) or the errors of hm_dht_record_owner.
 */
int hm_dht_record_sign(const hm_dht_record *r, const hm_identity *id,
                       const uint8_t swarm_id[HM_SWARM_ID_BYTES], double now, double max_ttl,
                       uint8_t sig_out[HM_DHT_SIG_BYTES]);

/*
 * Checks a record as a storing node must: sizes and markers as in
 * hm_dht_record_owner, and for an owned record the owner's signature.
 * Returns 1 for a valid owned record (owner in owner_pk_out, may be NULL),
 * 0 for a valid unowned record, -EBADMSG (owned, and the signature is
 * missing or wrong) or the errors of hm_dht_record_owner.
 */
int hm_dht_record_verify(const hm_dht_record *r, const uint8_t swarm_id[HM_SWARM_ID_BYTES],
                         uint8_t owner_pk_out[HM_PK_BYTES]);

/* Appends the wire form; errors land in the writer (hm_wire_wr_error). */
void hm_dht_record_encode(hm_wire_wr *w, const hm_dht_record *r);
/* Exact size of the wire form, or 0 for a record over the caps. */
size_t hm_dht_record_encoded_size(const hm_dht_record *r);

/*
 * Decodes a record from an object already unpacked by hm_wire (for
 * records inside larger messages). Pointers in out refer into the frame.
 * Returns 0, -EPROTO (wrong shape or types) or -EMSGSIZE (a field over its
 * cap). It checks the shape only: call hm_dht_record_verify before trusting
 * the record.
 */
int hm_dht_record_decode(const msgpack_object *o, hm_dht_record *out);

/*
 * Validates and unpacks buf (exactly one record, at most
 * HM_DHT_RECORD_MAX_WIRE bytes), then decodes it. The record's pointers
 * refer into buf only, so the unpacked objects are freed before it returns.
 * Returns 0 or the errors of hm_wire_decode_open and hm_dht_record_decode.
 */
int hm_dht_record_parse(const void *buf, size_t len, hm_dht_record *out);

#endif

/*
 * proto: the wire form of every DHT message, and its bounded codec. Pure
 * functions over caller memory; it owns nothing. The DHT core (dht.c) and
 * the simulator (which builds misbehaving nodes out of these functions) are
 * its users.
 *
 * Every message is one datagram body: a msgpack array whose first four
 * elements are the same for all messages
 *
 *   [type uint, tid uint32, flags uint32, token bin(8..16) | nil, ...]
 *
 * tid is the transaction id the requester chose; a reply repeats it.
 * flags bit 0 (HM_DHT_FLAG_CLIENT) says the sender is in client mode: it
 * answers no requests and must not enter the receiver's routing table.
 * Unknown flag bits are ignored, so later versions can add some.
 * flags bit 1 (HM_DHT_FLAG_HELD) in a GET asks for held times: a responder
 * that knows the bit answers with a VALUE of eight elements, whose last is
 * held, one uint per record (at most 2^32 - 1): the whole seconds the
 * responder has held that record's value without a gap (store.h,
 * hm_dht_store_get_held). A responder that does not know the bit ignores
 * it and answers the seven elements as before, and a requester that does
 * not set it never gets the eighth, so older nodes keep working.
 *
 * In a request the token is the one the receiver gave this requester in an
 * earlier reply (nil when it has none yet); a valid token proves that the
 * requester can receive at its address, so the receiver may answer in full.
 * A request without one is answered with a reply no larger than the
 * request (anti-amplification), so a requester that has no token for a
 * peer pads its request (the trailing pad bin) up to the size of the reply
 * it hopes for. STORE requires a valid token. In a reply the token is a
 * fresh one for the requester (HM_DHT_TOKEN_BYTES long).
 *
 * Requests:
 *   PING       [0, tid, flags, token|nil, (pad bin)]
 *   FIND_NODE  [1, tid, flags, token|nil, target bin32, (pad bin)]
 *   GET        [2, tid, flags, token|nil, key_id bin32, cursor bin|nil, (pad bin)]
 *   STORE      [3, tid, flags, token, record, (pad bin)]
 * Replies:
 *   PONG       [16, tid, flags, token]
 *   NODES      [17, tid, flags, token, contacts]
 *   VALUE      [18, tid, flags, token, records, more bool, contacts, (held)]
 *   STORED     [19, tid, flags, token, status int]
 *
 * contacts is [[pk bin32, addr bin6 | bin18], ...] with at most
 * HM_DHT_PROTO_MAX_CONTACTS entries; addr is an IPv4 address and port
 * (4 + 2 bytes) or an IPv6 address and port (16 + 2 bytes), big-endian;
 * port 0 is malformed. records is an array of at most
 * HM_DHT_PROTO_MAX_RECORDS records in record.h's wire form. A VALUE reply
 * pages a dictionary: more = 1 says further subkeys follow the last record
 * returned, whose subkey is the cursor of the next GET. A VALUE with no
 * records (the responder holds nothing for the key) carries the responder's
 * closest contacts instead; one whose records leave room carries some too.
 * STORED's status is 0 or the store's negative error (store.h).
 *
 * Decoding validates the datagram with hm_wire_decode_open under tight limits
 * (HM_DHT_PROTO_MAX_SIZE bytes, depth 3, HM_DHT_PROTO_MAX_ELEMENTS
 * elements) and then checks every field: type, counts, lengths and record
 * shapes (hm_dht_record_decode). Anything else is refused as a whole.
 * Decoding does not verify record signatures: callers that trust a record
 * call hm_dht_record_verify.
 */
#ifndef HM_DHT_PROTO_H
#define HM_DHT_PROTO_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "src/base/crypto.h"
#include "dht/record.h"
#include "dht/routing.h"

enum hm_dht_msg_type {
    HM_DHT_MSG_PING = 0,
    HM_DHT_MSG_FIND_NODE = 1,
    HM_DHT_MSG_GET = 2,
    HM_DHT_MSG_STORE = 3,
    HM_DHT_MSG_PONG = 16,
    HM_DHT_MSG_NODES = 17,
    HM_DHT_MSG_VALUE = 18,
    HM_DHT_MSG_STORED = 19,
};

/* A reply's type is its request's type plus this. */
#define HM_DHT_MSG_REPLY 16

#define HM_DHT_FLAG_CLIENT 1u
#define HM_DHT_FLAG_HELD 2u /* -- held since -- */

/* Tokens we issue are this long; we accept presented tokens of MIN..MAX bytes. */
#define HM_DHT_TOKEN_BYTES 8
#define HM_DHT_TOKEN_MIN 8
#define HM_DHT_TOKEN_MAX 16

#define HM_DHT_PROTO_MAX_CONTACTS 32
#define HM_DHT_PROTO_MAX_RECORDS 32
/* Largest datagram body accepted. */
#define HM_DHT_PROTO_MAX_SIZE HM_DGRAM_MAX_PAYLOAD
#define HM_DHT_PROTO_MAX_DEPTH 3
#define HM_DHT_PROTO_MAX_ELEMENTS 512

/*
 * One message, decoded or to be encoded. Which fields mean something
 * depends on type (see the table above); the rest are ignored by the
 * encoder and zeroed by the decoder. After decoding, every pointer (token,
 * cursor, the records' fields) points into the decoded buffer, which must
 * outlive the message. Contacts are decoded with id = BLAKE2b(pk) filled
 * in and last_seen_ms, failures and rtt_ms zero; the encoder uses only
 * their pk and addr.
 */
typedef struct hm_dht_msg {
    int type;
    uint32_t tid;
    uint32_t flags;
    const uint8_t *token; /* NULL: nil (requests other than STORE only) */
    size_t token_len;
    /* FIND_NODE target, GET key_id. */
    uint8_t target[HM_RT_ID_BYTES];
    /* GET: cursor subkey, meaningful when has_cursor (may be empty). */
    const uint8_t *cursor;
    size_t cursor_len;
    int has_cursor;
    /* STORE. */
    hm_dht_record record;
    /* Requests: length of the trailing pad bin as decoded (0 when absent). */
    size_t pad_len;
    /* STORED. */
    int status;
    /* VALUE. */
    int more;
    int has_held; /* -- held since -- the held array is present (n_records entries) */
    size_t n_records;
    hm_dht_record records[HM_DHT_PROTO_MAX_RECORDS];
    /* NODES, VALUE. */
    size_t n_contacts;
    hm_rt_contact contacts[HM_DHT_PROTO_MAX_CONTACTS];
    /* VALUE with has_held: seconds each record's value was held (filled up to n_records). */
    uint32_t held[HM_DHT_PROTO_MAX_RECORDS];
} hm_dht_msg;

/* 1 for the four request types, 0 otherwise. */
int hm_dht_msg_is_request(int type);

/*
 * Encodes m into buf (cap bytes). A request is padded with a trailing pad
 * bin so that the result is at least pad_to bytes long (0: no pad; the pad
 * may overshoot pad_to by one byte); pad_to is ignored for replies.
 * Returns 0 with the length in *len_out, -EMSGSIZE (does not fit cap, or
 * more than HM_DHT_PROTO_MAX_CONTACTS / _RECORDS, or a record over its
 * caps) or -EINVAL (unknown type, wrong token length, an address that is
 * neither IPv4 nor IPv6).
 */
int hm_dht_msg_encode(const hm_dht_msg *m, size_t pad_to, uint8_t *buf, size_t cap,
                      size_t *len_out);

/*
 * Decodes one datagram body. Returns 0, -EMSGSIZE (over a size, count or
 * depth cap), -EINVAL (not one valid msgpack object), -EPROTO (wrong shape,
 * type or field) or -ENOMEM. On failure *out is unspecified.
 */
int hm_dht_msg_decode(const uint8_t *buf, size_t len, hm_dht_msg *out);

/* Wire size of one contact in a contacts array (0 for an unsupported address). */
size_t hm_dht_contact_encoded_size(const struct sockaddr *addr);

/*
 * The 6- or 18-byte address form: returns its length (6 or 18), or 0 when
 * the family is neither AF_INET nor AF_INET6.
 */
size_t hm_dht_addr_encode(const struct sockaddr *addr, uint8_t out[18]);
/* Returns 0 or -EPROTO (length neither 6 nor 18, or port 0). */
int hm_dht_addr_decode(const uint8_t *p, size_t len, struct sockaddr_storage *out);

#endif

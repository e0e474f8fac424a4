/*
 * record: wire form, owner markers and signatures of DHT records (see
 * record.h for the contract). Pure functions; owns nothing.
 */
#include "config.h"

#include "dht/record.h"

#include "src/base/util.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#define SIGN_DOMAIN "hivemindd/dht/record/v1"
/* The domain string with its NUL, the swarm id, and every field at its cap. */
#define SIGN_MSG_MAX                                                                            \
    (sizeof(SIGN_DOMAIN) + HM_SWARM_ID_BYTES + 2 + HM_DHT_KEY_MAX + 1 + 2 + HM_DHT_SUBKEY_MAX + \
     2 + HM_DHT_VALUE_MAX + 8 + 8)

static const char marker_open[] = "[owner:";
#define MARKER_OPEN_LEN (sizeof(marker_open) - 1)

static const hm_wire_limits record_limits = {
    .max_size = HM_DHT_RECORD_MAX_WIRE,
    .max_depth = 1,
    .max_elements = 7,
};

void hm_dht_key_id(const uint8_t *key, size_t key_len, uint8_t out[HM_DHT_KEY_ID_BYTES])
{
    crypto_generichash(out, HM_DHT_KEY_ID_BYTES, key, key_len, NULL, 0);
}

void hm_dht_owner_marker(const uint8_t pk[HM_PK_BYTES], char out[HM_DHT_OWNER_MARKER_LEN + 1])
{
    memcpy(out, marker_open, MARKER_OPEN_LEN);
    hm_peer_id_encode(pk, out + MARKER_OPEN_LEN);
    out[HM_DHT_OWNER_MARKER_LEN - 1] = ']';
    out[HM_DHT_OWNER_MARKER_LEN] = '\0';
}

static const uint8_t *find_bytes(const uint8_t *hay, size_t len, const char *needle, size_t nlen)
{
    if (nlen == 0 || len < nlen)
        return NULL;
    for (size_t i = 0; i + nlen <= len; i++)
        if (hay[i] == (uint8_t)needle[0] && memcmp(hay + i, needle, nlen) == 0)
            return hay + i;
    return NULL;
}

/*
 * Returns 1 with the owner's key when p ends in a valid marker, 0 when p
 * has no "[owner:" at all, -EINVAL when "[owner:" appears anywhere but as
 * the start of a valid trailing marker.
 */
static int parse_marker(const uint8_t *p, size_t len, uint8_t pk_out[HM_PK_BYTES])
{
    const uint8_t *at = find_bytes(p, len, marker_open, MARKER_OPEN_LEN);
    const uint8_t *tail;

    if (at == NULL)
        return 0;
    if (len < HM_DHT_OWNER_MARKER_LEN)
        return -EINVAL;
    tail = p + len - HM_DHT_OWNER_MARKER_LEN;
    /* The first occurrence must be the trailing marker, so there is only one. */
    if (at != tail || tail[HM_DHT_OWNER_MARKER_LEN - 1] != ']')
        return -EINVAL;
    if (hm_peer_id_decode((const char *)tail + MARKER_OPEN_LEN, HM_PEER_ID_LEN, pk_out) < 0)
        return -EINVAL;
    return 1;
}

static size_t bin_size(size_t n)
{
    if (n <= 0xff)
        return 2 + n;
    if (n <= 0xffff)
        return 3 + n;
    return 5 + n;
}

static size_t uint_size(uint64_t v)
{
    if (v < 128)
        return 1;
    if (v <= 0xff)
        return 2;
    if (v <= 0xffff)
        return 3;
    if (v <= 0xffffffffu)
        return 5;
    return 9;
}

/* Size of the wire form without checking caps (field lengths may be anything). */
static size_t raw_size(const hm_dht_record *r)
{
    return 1 + bin_size(r->key_len) + (r->has_subkey ? bin_size(r->subkey_len) : 1) +
           bin_size(r->value_len) + 9 + uint_size(r->seq) +
           (r->sig != NULL ? bin_size(HM_DHT_SIG_BYTES) : 1);
}

static int check_shape(const hm_dht_record *r)
{
    if (r->key_len > HM_DHT_KEY_MAX || (r->has_subkey && r->subkey_len > HM_DHT_SUBKEY_MAX) ||
        r->value_len > HM_DHT_VALUE_MAX)
        return -EMSGSIZE;
    if (raw_size(r) > HM_DHT_RECORD_MAX_WIRE)
        return -EMSGSIZE;
    if (r->key_len == 0 || r->key == NULL || (r->has_subkey && r->subkey == NULL && r->subkey_len) ||
        (r->value == NULL && r->value_len > 0) || !isfinite(r->expiration))
        return -EINVAL;
    return 0;
}

size_t hm_dht_record_encoded_size(const hm_dht_record *r)
{
    return check_shape(r) == -EMSGSIZE ? 0 : raw_size(r);
}

int hm_dht_record_owner(const hm_dht_record *r, uint8_t owner_pk_out[HM_PK_BYTES])
{
    uint8_t key_pk[HM_PK_BYTES], sub_pk[HM_PK_BYTES];
    int result, kr, sr = 0;

    if ((result = check_shape(r)) < 0)
        return result;
    if ((kr = parse_marker(r->key, r->key_len, key_pk)) < 0)
        return kr;
    if (r->has_subkey && (sr = parse_marker(r->subkey, r->subkey_len, sub_pk)) < 0)
        return sr;
    if (kr && sr && sodium_memcmp(key_pk, sub_pk, HM_PK_BYTES) != 0)
        return -EPERM;
    if (!kr && !sr)
        return 0;
    if (owner_pk_out != NULL)
        memcpy(owner_pk_out, kr ? key_pk : sub_pk, HM_PK_BYTES);
    return 1;
}

static void put_u16(uint8_t *p, size_t v)
{
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (56 - 8 * i));
}

/* Builds the signed message; the caller has checked the shape. Returns its length. */
static size_t sign_message(const hm_dht_record *r, const uint8_t swarm_id[HM_SWARM_ID_BYTES],
                           uint8_t buf[SIGN_MSG_MAX])
{
    size_t n = 0;
    uint64_t bits;

    memcpy(buf, SIGN_DOMAIN, sizeof(SIGN_DOMAIN));
    n += sizeof(SIGN_DOMAIN);
    memcpy(buf + n, swarm_id, HM_SWARM_ID_BYTES);
    n += HM_SWARM_ID_BYTES;
    put_u16(buf + n, r->key_len);
    n += 2;
    memcpy(buf + n, r->key, r->key_len);
    n += r->key_len;
    buf[n++] = r->has_subkey ? 1 : 0;
    put_u16(buf + n, r->has_subkey ? r->subkey_len : 0);
    n += 2;
    if (r->has_subkey && r->subkey_len > 0) {
        memcpy(buf + n, r->subkey, r->subkey_len);
        n += r->subkey_len;
    }
    put_u16(buf + n, r->value_len);
    n += 2;
    if (r->value_len > 0) {
        memcpy(buf + n, r->value, r->value_len);
        n += r->value_len;
    }
    memcpy(&bits, &r->expiration, sizeof(bits));
    put_u64(buf + n, bits);
    n += 8;
    put_u64(buf + n, r->seq);
    n += 8;
    return n;
}

int hm_dht_record_sign(const hm_dht_record *r, const hm_identity *id,
                       const uint8_t swarm_id[HM_SWARM_ID_BYTES], double now, double max_ttl,
                       uint8_t sig_out[HM_DHT_SIG_BYTES])
{
    uint8_t owner[HM_PK_BYTES];
    uint8_t msg[SIGN_MSG_MAX];
    size_t n;
    int result;

    if ((result = hm_dht_record_owner(r, owner)) < 0)
        return result;
    if (result == 0 || sodium_memcmp(owner, id->pk, HM_PK_BYTES) != 0)
        return -EPERM;
    if (!(r->expiration <= now + max_ttl))
        return -ERANGE;
    n = sign_message(r, swarm_id, msg);
    crypto_sign_detached(sig_out, NULL, msg, n, id->sk);
    return 0;
}

int hm_dht_record_verify(const hm_dht_record *r, const uint8_t swarm_id[HM_SWARM_ID_BYTES],
                         uint8_t owner_pk_out[HM_PK_BYTES])
{
    uint8_t owner[HM_PK_BYTES];
    uint8_t msg[SIGN_MSG_MAX];
    size_t n;
    int result;

    if ((result = hm_dht_record_owner(r, owner)) <= 0)
        return result;
    if (r->sig == NULL)
        return -EBADMSG;
    n = sign_message(r, swarm_id, msg);
    if (crypto_sign_verify_detached(r->sig, msg, n, owner) != 0)
        return -EBADMSG;
    if (owner_pk_out != NULL)
        memcpy(owner_pk_out, owner, HM_PK_BYTES);
    return 1;
}

/* An empty field may come as NULL; the packer's memcpy must not see NULL. */
static const void *nonnull(const void *p) { return p != NULL ? p : ""; }

void hm_dht_record_encode(hm_wire_wr *w, const hm_dht_record *r)
{
    hm_wire_wr_array(w, 6);
    hm_wire_wr_bin(w, nonnull(r->key), r->key_len);
    if (r->has_subkey)
        hm_wire_wr_bin(w, nonnull(r->subkey), r->subkey_len);
    else
        hm_wire_wr_nil(w);
    hm_wire_wr_bin(w, nonnull(r->value), r->value_len);
    hm_wire_wr_double(w, r->expiration);
    hm_wire_wr_uint(w, r->seq);
    if (r->sig != NULL)
        hm_wire_wr_bin(w, r->sig, HM_DHT_SIG_BYTES);
    else
        hm_wire_wr_nil(w);
}

int hm_dht_record_decode(const msgpack_object *o, hm_dht_record *out)
{
    const msgpack_object *f;
    const uint8_t *p;
    uint32_t n;

    memset(out, 0, sizeof(*out));
    if (hm_wire_get_array(o, 6, 6, &f, NULL) < 0)
        return -EPROTO;
    if (hm_wire_get_bin(&f[0], &p, &n) < 0)
        return -EPROTO;
    if (n > HM_DHT_KEY_MAX)
        return -EMSGSIZE;
    if (n == 0)
        return -EPROTO;
    out->key = p;
    out->key_len = n;
    if (f[1].type != MSGPACK_OBJECT_NIL) {
        if (hm_wire_get_bin(&f[1], &p, &n) < 0)
            return -EPROTO;
        if (n > HM_DHT_SUBKEY_MAX)
            return -EMSGSIZE;
        out->subkey = p;
        out->subkey_len = n;
        out->has_subkey = 1;
    }
    if (hm_wire_get_bin(&f[2], &p, &n) < 0)
        return -EPROTO;
    if (n > HM_DHT_VALUE_MAX)
        return -EMSGSIZE;
    out->value = p;
    out->value_len = n;
    if (hm_wire_get_double(&f[3], &out->expiration) < 0 || !isfinite(out->expiration))
        return -EPROTO;
    if (hm_wire_get_uint(&f[4], &out->seq) < 0)
        return -EPROTO;
    if (f[5].type != MSGPACK_OBJECT_NIL) {
        if (hm_wire_get_bin(&f[5], &p, &n) < 0 || n != HM_DHT_SIG_BYTES)
            return -EPROTO;
        out->sig = p;
    }
    if (raw_size(out) > HM_DHT_RECORD_MAX_WIRE)
        return -EMSGSIZE;
    return 0;
}

int hm_dht_record_parse(const void *buf, size_t len, hm_dht_record *out)
{
    hm_wire_msg m;
    int result;

    memset(out, 0, sizeof(*out));
    if ((result = hm_wire_decode_open(&m, buf, len, &record_limits)) < 0)
        goto out;
    result = hm_dht_record_decode(&m.root, out);
out:
    hm_wire_decode_close(&m);
    return result;
}

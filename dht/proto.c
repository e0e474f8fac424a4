/*
 * proto: encoder and bounded decoder of the DHT messages (see proto.h for
 * the wire forms). Pure functions over caller memory; owns nothing.
 */
#include "config.h"

#include "dht/proto.h"

#include "src/base/util.h"
#include "src/base/wire.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>

static const hm_wire_limits proto_limits = {
    .max_size = HM_DHT_PROTO_MAX_SIZE,
    .max_depth = HM_DHT_PROTO_MAX_DEPTH,
    .max_elements = HM_DHT_PROTO_MAX_ELEMENTS,
};

int hm_dht_msg_is_request(int type)
{
    return type == HM_DHT_MSG_PING || type == HM_DHT_MSG_FIND_NODE || type == HM_DHT_MSG_GET ||
           type == HM_DHT_MSG_STORE;
}

static int is_reply(int type)
{
    return type == HM_DHT_MSG_PONG || type == HM_DHT_MSG_NODES || type == HM_DHT_MSG_VALUE ||
           type == HM_DHT_MSG_STORED;
}

size_t hm_dht_addr_encode(const struct sockaddr *addr, uint8_t out[18])
{
    if (addr->sa_family == AF_INET) {
        const struct sockaddr_in *a4 = (const struct sockaddr_in *)addr;
        memcpy(out, &a4->sin_addr, 4);
        memcpy(out + 4, &a4->sin_port, 2);
        return 6;
    }
    if (addr->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a6 = (const struct sockaddr_in6 *)addr;
        memcpy(out, &a6->sin6_addr, 16);
        memcpy(out + 16, &a6->sin6_port, 2);
        return 18;
    }
    return 0;
}

int hm_dht_addr_decode(const uint8_t *p, size_t len, struct sockaddr_storage *out)
{
    memset(out, 0, sizeof(*out));
    if (len == 6) {
        struct sockaddr_in *a4 = (struct sockaddr_in *)out;
        a4->sin_family = AF_INET;
        memcpy(&a4->sin_addr, p, 4);
        memcpy(&a4->sin_port, p + 4, 2);
        if (a4->sin_port == 0)
            return -EPROTO;
        return 0;
    }
    if (len == 18) {
        struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)out;
        a6->sin6_family = AF_INET6;
        memcpy(&a6->sin6_addr, p, 16);
        memcpy(&a6->sin6_port, p + 16, 2);
        if (a6->sin6_port == 0)
            return -EPROTO;
        return 0;
    }
    return -EPROTO;
}

size_t hm_dht_contact_encoded_size(const struct sockaddr *addr)
{
    /* fixarray(2), bin8 header + 32-byte key, bin8 header + address. */
    if (addr->sa_family == AF_INET)
        return 1 + 2 + HM_PK_BYTES + 2 + 6;
    if (addr->sa_family == AF_INET6)
        return 1 + 2 + HM_PK_BYTES + 2 + 18;
    return 0;
}

/* ---- encoding ---- */

static int write_contacts(hm_wire_wr *w, const hm_rt_contact *c, size_t n)
{
    uint8_t a[18];

    if (n > HM_DHT_PROTO_MAX_CONTACTS)
        return -EMSGSIZE;
    hm_wire_wr_array(w, (uint32_t)n);
    for (size_t i = 0; i < n; i++) {
        size_t alen = hm_dht_addr_encode((const struct sockaddr *)&c[i].addr, a);
        if (alen == 0)
            return -EINVAL;
        hm_wire_wr_array(w, 2);
        hm_wire_wr_bin(w, c[i].pk, HM_PK_BYTES);
        hm_wire_wr_bin(w, a, alen);
    }
    return 0;
}

/* Number of elements of the message array, not counting the pad. */
static uint32_t base_count(int type)
{
    switch (type) {
    case HM_DHT_MSG_PING:
    case HM_DHT_MSG_PONG:
        return 4;
    case HM_DHT_MSG_FIND_NODE:
    case HM_DHT_MSG_STORE:
    case HM_DHT_MSG_NODES:
    case HM_DHT_MSG_STORED:
        return 5;
    case HM_DHT_MSG_GET:
        return 6;
    case HM_DHT_MSG_VALUE:
        return 7;
    default:
        return 0;
    }
}

/* Everything but the array header and the pad. */
static int write_body(hm_wire_wr *w, const hm_dht_msg *m)
{
    int result = 0;

    hm_wire_wr_uint(w, (uint64_t)m->type);
    hm_wire_wr_uint(w, m->tid);
    hm_wire_wr_uint(w, m->flags);
    if (m->token != NULL) {
        if (m->token_len < HM_DHT_TOKEN_MIN || m->token_len > HM_DHT_TOKEN_MAX)
            return -EINVAL;
        hm_wire_wr_bin(w, m->token, m->token_len);
    } else {
        /* Replies and STOREs always carry a token. */
        if (is_reply(m->type) || m->type == HM_DHT_MSG_STORE)
            return -EINVAL;
        hm_wire_wr_nil(w);
    }

    switch (m->type) {
    case HM_DHT_MSG_PING:
    case HM_DHT_MSG_PONG:
        break;
    case HM_DHT_MSG_FIND_NODE:
        hm_wire_wr_bin(w, m->target, HM_RT_ID_BYTES);
        break;
    case HM_DHT_MSG_GET:
        hm_wire_wr_bin(w, m->target, HM_RT_ID_BYTES);
        if (m->has_cursor) {
            if (m->cursor_len > HM_DHT_SUBKEY_MAX)
                return -EMSGSIZE;
            hm_wire_wr_bin(w, m->cursor, m->cursor_len);
        } else {
            hm_wire_wr_nil(w);
        }
        break;
    case HM_DHT_MSG_STORE:
        if (hm_dht_record_encoded_size(&m->record) == 0)
            return -EMSGSIZE;
        hm_dht_record_encode(w, &m->record);
        break;
    case HM_DHT_MSG_NODES:
        result = write_contacts(w, m->contacts, m->n_contacts);
        break;
    case HM_DHT_MSG_VALUE:
        if (m->n_records > HM_DHT_PROTO_MAX_RECORDS)
            return -EMSGSIZE;
        hm_wire_wr_array(w, (uint32_t)m->n_records);
        for (size_t i = 0; i < m->n_records; i++) {
            if (hm_dht_record_encoded_size(&m->records[i]) == 0)
                return -EMSGSIZE;
            hm_dht_record_encode(w, &m->records[i]);
        }
        hm_wire_wr_bool(w, m->more != 0);
        result = write_contacts(w, m->contacts, m->n_contacts);
        if (result == 0 && m->has_held) {
            hm_wire_wr_array(w, (uint32_t)m->n_records);
            for (size_t i = 0; i < m->n_records; i++)
                hm_wire_wr_uint(w, m->held[i]);
        }
        break;
    case HM_DHT_MSG_STORED:
        hm_wire_wr_int(w, m->status);
        break;
    default:
        return -EINVAL;
    }
    return result;
}

/* Length of the pad bin's payload that brings a message of size len to at least pad_to. */
static size_t pad_payload(size_t len, size_t pad_to)
{
    size_t need = pad_to - len;

    if (need <= 2)
        return 0;
    if (need - 2 <= 0xff)
        return need - 2; /* bin8: 2-byte header */
    /* bin16: 3-byte header; at least 256 bytes so that the header really is bin16. */
    return need - 3 < 0x100 ? 0x100 : need - 3;
}

int hm_dht_msg_encode(const hm_dht_msg *m, size_t pad_to, uint8_t *buf, size_t cap,
                      size_t *len_out)
{
    hm_wire_wr w;
    uint32_t n = base_count(m->type);
    int result;

    if (n == 0)
        return -EINVAL;
    if (m->type == HM_DHT_MSG_VALUE && m->has_held)
        n++; /* -- held since -- */
    if (!hm_dht_msg_is_request(m->type))
        pad_to = 0;
    hm_wire_wr_init_fixed(&w, buf, cap);
    hm_wire_wr_array(&w, n);
    if ((result = write_body(&w, m)) < 0)
        goto out;
    if ((result = hm_wire_wr_error(&w)) < 0)
        goto out;
    if (pad_to > w.len) {
        /*
         * The array header is a fixarray with or without the pad (at most
         * 8 elements), so rewriting it keeps every offset.
         */
        size_t pl = pad_payload(w.len, pad_to);
        if (pl > HM_DHT_PROTO_MAX_SIZE) {
            result = -EMSGSIZE;
            goto out;
        }
        buf[0] = (uint8_t)(0x90 | (n + 1));
        /* The pad's bytes are zero; they carry nothing. */
        if (pl <= 0xff) {
            uint8_t h[2] = {0xc4, (uint8_t)pl};
            hm_wire_wr_raw(&w, h, 2);
        } else {
            uint8_t h[3] = {0xc5, (uint8_t)(pl >> 8), (uint8_t)pl};
            hm_wire_wr_raw(&w, h, 3);
        }
        if (w.err == 0 && w.len + pl <= w.cap) {
            memset(buf + w.len, 0, pl);
            w.len += pl;
        } else if (w.err == 0) {
            w.err = -EMSGSIZE;
        }
        if ((result = hm_wire_wr_error(&w)) < 0)
            goto out;
    }
    *len_out = w.len;
    result = 0;
out:
    return result;
}

/* ---- decoding ---- */

static int get_u32(const msgpack_object *o, uint32_t *out)
{
    uint64_t v;

    if (hm_wire_get_uint(o, &v) < 0 || v > UINT32_MAX)
        return -EPROTO;
    *out = (uint32_t)v;
    return 0;
}

static int get_bin_exact(const msgpack_object *o, size_t want, uint8_t *out)
{
    const uint8_t *p;
    uint32_t n;

    if (hm_wire_get_bin(o, &p, &n) < 0 || n != want)
        return -EPROTO;
    memcpy(out, p, want);
    return 0;
}

static int read_contacts(const msgpack_object *o, hm_dht_msg *out)
{
    const msgpack_object *items;
    uint32_t n;

    if (hm_wire_get_array(o, 0, 0, &items, &n) < 0)
        return -EPROTO;
    if (n > HM_DHT_PROTO_MAX_CONTACTS)
        return -EMSGSIZE;
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *f;
        const uint8_t *p;
        uint32_t plen;
        hm_rt_contact *c = &out->contacts[i];

        memset(c, 0, sizeof(*c));
        if (hm_wire_get_array(&items[i], 2, 2, &f, NULL) < 0)
            return -EPROTO;
        if (get_bin_exact(&f[0], HM_PK_BYTES, c->pk) < 0)
            return -EPROTO;
        if (hm_wire_get_bin(&f[1], &p, &plen) < 0)
            return -EPROTO;
        if (hm_dht_addr_decode(p, plen, &c->addr) < 0)
            return -EPROTO;
        hm_node_id_from_pk(c->pk, c->id);
    }
    out->n_contacts = n;
    return 0;
}

static int decode_obj(const msgpack_object *root, hm_dht_msg *out)
{
    const msgpack_object *f;
    uint32_t n, want;
    uint64_t type;
    const uint8_t *p;
    uint32_t plen;
    int result;

    if (hm_wire_get_array(root, 4, 8, &f, &n) < 0)
        return -EPROTO;
    if (hm_wire_get_uint(&f[0], &type) < 0 || type > 255)
        return -EPROTO;
    out->type = (int)type;
    want = base_count(out->type);
    if (want == 0)
        return -EPROTO;
    /* Requests may end with one pad bin; replies have exactly their fields,
     * a VALUE with or without its held array. */
    if (n != want && !(hm_dht_msg_is_request(out->type) && n == want + 1) &&
        !(out->type == HM_DHT_MSG_VALUE && n == want + 1))
        return -EPROTO;
    if (get_u32(&f[1], &out->tid) < 0 || get_u32(&f[2], &out->flags) < 0)
        return -EPROTO;
    if (f[3].type == MSGPACK_OBJECT_NIL) {
        if (is_reply(out->type) || out->type == HM_DHT_MSG_STORE)
            return -EPROTO;
    } else {
        if (hm_wire_get_bin(&f[3], &p, &plen) < 0 || plen < HM_DHT_TOKEN_MIN ||
            plen > HM_DHT_TOKEN_MAX)
            return -EPROTO;
        out->token = p;
        out->token_len = plen;
    }
    if (n == want + 1 && hm_dht_msg_is_request(out->type)) {
        if (hm_wire_get_bin(&f[want], &p, &plen) < 0)
            return -EPROTO;
        out->pad_len = plen;
    }

    switch (out->type) {
    case HM_DHT_MSG_PING:
    case HM_DHT_MSG_PONG:
        return 0;
    case HM_DHT_MSG_FIND_NODE:
        return get_bin_exact(&f[4], HM_RT_ID_BYTES, out->target);
    case HM_DHT_MSG_GET:
        if (get_bin_exact(&f[4], HM_RT_ID_BYTES, out->target) < 0)
            return -EPROTO;
        if (f[5].type != MSGPACK_OBJECT_NIL) {
            if (hm_wire_get_bin(&f[5], &p, &plen) < 0)
                return -EPROTO;
            if (plen > HM_DHT_SUBKEY_MAX)
                return -EMSGSIZE;
            out->cursor = p;
            out->cursor_len = plen;
            out->has_cursor = 1;
        }
        return 0;
    case HM_DHT_MSG_STORE:
        return hm_dht_record_decode(&f[4], &out->record);
    case HM_DHT_MSG_NODES:
        return read_contacts(&f[4], out);
    case HM_DHT_MSG_VALUE: {
        const msgpack_object *items;
        uint32_t nr;

        if (hm_wire_get_array(&f[4], 0, 0, &items, &nr) < 0)
            return -EPROTO;
        if (nr > HM_DHT_PROTO_MAX_RECORDS)
            return -EMSGSIZE;
        for (uint32_t i = 0; i < nr; i++)
            if ((result = hm_dht_record_decode(&items[i], &out->records[i])) < 0)
                return result;
        out->n_records = nr;
        if (hm_wire_get_bool(&f[5], &out->more) < 0)
            return -EPROTO;
        /* More to come only makes sense after at least one record. */
        if (out->more && nr == 0)
            return -EPROTO;
        if ((result = read_contacts(&f[6], out)) < 0)
            return result;
        if (n == want + 1) {
            /* -- held since -- one uint32 per record, nothing else */
            const msgpack_object *hv;
            uint32_t nh;
            if (hm_wire_get_array(&f[7], 0, 0, &hv, &nh) < 0 || nh != nr)
                return -EPROTO;
            for (uint32_t i = 0; i < nh; i++)
                if (get_u32(&hv[i], &out->held[i]) < 0)
                    return -EPROTO;
            out->has_held = 1;
        }
        return 0;
    }
    case HM_DHT_MSG_STORED: {
        int64_t st;

        if (hm_wire_get_int(&f[4], &st) < 0 || st > 0 || st < -4095)
            return -EPROTO;
        out->status = (int)st;
        return 0;
    }
    default:
        return -EPROTO;
    }
}

int hm_dht_msg_decode(const uint8_t *buf, size_t len, hm_dht_msg *out)
{
    hm_wire_msg m;
    int result;

    /*
     * Only the scalar fields are cleared: the record and contact arrays are
     * filled up to their counts, and clearing 9 KiB per datagram would cost
     * more than the decode itself.
     */
    memset(out, 0, offsetof(hm_dht_msg, records));
    out->n_contacts = 0;
    if (len > HM_DHT_PROTO_MAX_SIZE)
        return -EMSGSIZE;
    if ((result = hm_wire_decode_open(&m, buf, len, &proto_limits)) < 0)
        goto out;
    result = decode_obj(&m.root, out);
out:
    hm_wire_decode_close(&m);
    return result;
}

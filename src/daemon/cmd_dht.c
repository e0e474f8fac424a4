/*
 * cmd_dht: the DHT's control commands (daemon.h): "dht.get" (a lookup,
 * optionally filtered to one subkey), "dht.put" (a store with a TTL) and
 * "dht.info" (routing-table and storage statistics). Values that are
 * UTF-8 text without NUL are shown as strings, others as hex. It owns
 * only the context of lookups in flight, which the node's DHT answers
 * exactly once (also with an error when the node closes).
 */
#include "config.h"

#include "src/daemon/daemon.h"
#include "src/base/crypto.h"
#include "src/base/util.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DHT_CMD_TIMEOUT_MS 8000
#define DHT_MAX_TTL_S 86400.0

/* Text when the bytes are valid UTF-8 without NUL, hex otherwise. */
static int set_bytes(json_t *obj, const char *name, const uint8_t *p, size_t len)
{
    json_t *v = memchr(p, 0, len) == NULL ? json_stringn((const char *)p, len) : NULL;
    if (v != NULL)
        return json_object_set_new(obj, name, v);
    char hexname[32];
    char *hex = malloc(2 * len + 1);
    if (hex == NULL)
        return -1;
    hm_hex_encode(p, len, hex);
    snprintf(hexname, sizeof(hexname), "%s_hex", name);
    int r = json_object_set_new(obj, hexname, json_string(hex));
    free(hex);
    return r;
}

/* DHT errors in the words of the DHT (util's hm_strerror speaks transport). */
static const char *dht_strerror(int err)
{
    switch (-err) {
    case ETIMEDOUT:
        return "no answer before the deadline";
    case EHOSTUNREACH:
        return "no DHT peer reachable (is the node connected to a swarm?)";
    case ESTALE:
        return "the replicas hold a newer version of this record";
    case EPERM:
        return "the key or subkey is owned by another node";
    case EBADMSG:
        return "owned record without a valid signature";
    case ETIME:
        return "the record has already expired";
    case ERANGE:
        return "expiration too far ahead";
    case EDQUOT:
        return "this node's storage quota at the replicas is used up";
    case ENOSPC:
        return "the replicas are full";
    case EACCES:
        return "the replicas refused the store token";
    case EMSGSIZE:
        return "record too large for one datagram";
    case ENOBUFS:
        return "too many DHT lookups in progress";
    default:
        return hm_strerror(err);
    }
}

typedef struct dht_get_ctx {
    hm_control_req *req;
    char *subkey; /* filter, or NULL */
} dht_get_ctx;

static void on_dht_get(void *ud, int status, const hm_dht_value *values, size_t n,
                       const hm_dht_lookup_info *info)
{
    dht_get_ctx *c = ud;
    json_t *list = NULL;
    if (status < 0) {
        hm_control_reply_error(c->req, status == -ETIMEDOUT ? "timeout" : "dht_error",
                               dht_strerror(status));
        goto out;
    }
    list = json_array();
    if (list == NULL)
        goto oom;
    for (size_t i = 0; i < n; i++) {
        const hm_dht_record *r = &values[i].rec;
        if (c->subkey != NULL &&
            (!r->has_subkey || r->subkey_len != strlen(c->subkey) ||
             memcmp(r->subkey, c->subkey, r->subkey_len) != 0))
            continue;
        char src[HM_PEER_ID_LEN + 1];
        hm_peer_id_encode(values[i].source_pk, src);
        /* -- held since -- held_s: how long the replicas have held it, or null */
        json_t *e = json_pack("{s:f, s:I, s:s, s:o}", "expiration", r->expiration, "seq",
                              (json_int_t)r->seq, "source", src, "held_s",
                              values[i].held_s >= 0 ? json_integer(values[i].held_s)
                                                    : json_null());
        if (e == NULL || set_bytes(e, "value", r->value, r->value_len) != 0 ||
            (r->has_subkey && set_bytes(e, "subkey", r->subkey, r->subkey_len) != 0) ||
            json_array_append_new(list, e) != 0) {
            json_decref(e);
            goto oom;
        }
    }
    hm_daemon_reply(c->req, json_pack("{s:b, s:o, s:i, s:i}", "found", json_array_size(list) > 0,
                                    "values", list, "hops", (int)info->hops, "requests",
                                    (int)info->requests));
    list = NULL;
    goto out;
oom:
    json_decref(list);
    hm_control_reply_error(c->req, "internal", "out of memory");
out:
    free(c->subkey);
    free(c);
}

static int dht_args_key(const json_t *args, const char *name, const char **s_out, size_t *len_out,
                        hm_control_req *req, int required)
{
    const json_t *v = json_object_get(args, name);
    char msg[96];
    if (v == NULL && !required) {
        *s_out = NULL;
        *len_out = 0;
        return 0;
    }
    if (!json_is_string(v)) {
        snprintf(msg, sizeof(msg), "args.%s must be a string", name);
        hm_control_reply_error(req, "bad_args", msg);
        return -EINVAL;
    }
    *s_out = json_string_value(v);
    *len_out = json_string_length(v);
    return 0;
}

/* Configured, or switched on by the node because nobody can reach it. */
static int dht_client_mode(hm_daemon *d)
{
    hm_node_reach_info ri;
    return hm_node_reach(d->node, &ri) == 0 ? ri.client_mode : d->cfg->client_mode;
}

static void cmd_dht_get(void *ud, hm_control_req *req, const json_t *args)
{
    hm_daemon *d = ud;
    const char *key, *subkey;
    size_t klen, slen;
    if (d->node == NULL) {
        hm_daemon_reply_stopping(req);
        return;
    }
    if (dht_args_key(args, "key", &key, &klen, req, 1) < 0 ||
        dht_args_key(args, "subkey", &subkey, &slen, req, 0) < 0)
        return;
    if (klen == 0 || klen > HM_DHT_KEY_MAX || slen > HM_DHT_SUBKEY_MAX) {
        hm_control_reply_error(req, "bad_args", "key must be 1 to 256 bytes, subkey at most 128");
        return;
    }
    dht_get_ctx *c = calloc(1, sizeof(*c));
    if (c == NULL || (subkey != NULL && (c->subkey = strdup(subkey)) == NULL)) {
        free(c);
        hm_control_reply_error(req, "internal", "out of memory");
        return;
    }
    c->req = req;
    int r = hm_node_dht_get(d->node, (const uint8_t *)key, klen, DHT_CMD_TIMEOUT_MS, on_dht_get, c);
    if (r < 0) {
        free(c->subkey);
        free(c);
        hm_control_reply_error(req, "dht_error", dht_strerror(r));
    }
}

static void on_dht_put(void *ud, int status, unsigned stored, const hm_dht_lookup_info *info)
{
    hm_control_req *req = ud;
    if (status < 0) {
        hm_control_reply_error(req, status == -ETIMEDOUT ? "timeout" : "dht_error",
                               dht_strerror(status));
        return;
    }
    hm_daemon_reply(req, json_pack("{s:i, s:i, s:i}", "stored", (int)stored, "hops", (int)info->hops,
                                 "requests", (int)info->requests));
}

static void cmd_dht_put(void *ud, hm_control_req *req, const json_t *args)
{
    hm_daemon *d = ud;
    const char *key, *subkey, *value;
    size_t klen, slen, vlen;
    if (d->node == NULL) {
        hm_daemon_reply_stopping(req);
        return;
    }
    if (dht_args_key(args, "key", &key, &klen, req, 1) < 0 ||
        dht_args_key(args, "subkey", &subkey, &slen, req, 0) < 0 ||
        dht_args_key(args, "value", &value, &vlen, req, 1) < 0)
        return;
    double ttl;
    if (hm_daemon_arg_seconds(req, args, "ttl", 3600, DHT_MAX_TTL_S, &ttl) != 0)
        return;
    if (klen == 0 || klen > HM_DHT_KEY_MAX || slen > HM_DHT_SUBKEY_MAX || vlen > HM_DHT_VALUE_MAX) {
        hm_control_reply_error(req, "bad_args",
                               "key must be 1 to 256 bytes, subkey at most 128, value at most 1024");
        return;
    }
    int r = hm_node_dht_put(d->node, (const uint8_t *)key, klen, (const uint8_t *)subkey, slen,
                            subkey != NULL, (const uint8_t *)value, vlen, ttl, DHT_CMD_TIMEOUT_MS,
                            on_dht_put, req);
    if (r < 0)
        hm_control_reply_error(req, r == -EMSGSIZE ? "bad_args" : "dht_error",
                               dht_strerror(r));
}

static void cmd_dht_info(void *ud, hm_control_req *req, const json_t *args)
{
    hm_daemon *d = ud;
    (void)args;
    if (d->node == NULL) {
        hm_daemon_reply_stopping(req);
        return;
    }
    hm_dht_stats st;
    hm_dht_get_stats(hm_node_dht(d->node), &st);
    hm_daemon_reply(req, json_pack("{s:{s:I, s:I, s:I, s:I}, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:b}",
                                 "routing_table", "size", (json_int_t)st.rt_size, "depth",
                                 (json_int_t)st.rt_depth, "buckets", (json_int_t)st.rt_buckets,
                                 "cached", (json_int_t)st.rt_cached, "records",
                                 (json_int_t)st.records, "record_bytes",
                                 (json_int_t)st.record_bytes, "lookups_active",
                                 (json_int_t)st.lookups_active, "requests_sent",
                                 (json_int_t)st.requests_sent, "requests_received",
                                 (json_int_t)st.requests_received, "timeouts",
                                 (json_int_t)st.timeouts, "rate_limited",
                                 (json_int_t)st.rate_limited, "client_mode", dht_client_mode(d)));
}

int hm_cmd_dht_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen)
{
    int r;
    if ((r = hm_control_register(ctl, "dht.get", cmd_dht_get, d)) != 0 ||
        (r = hm_control_register(ctl, "dht.put", cmd_dht_put, d)) != 0 ||
        (r = hm_control_register(ctl, "dht.info", cmd_dht_info, d)) != 0)
        snprintf(err, errlen, "cannot register the DHT commands: %s", hm_strerror(r));
    return r;
}

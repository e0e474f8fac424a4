/*
 * status_rec: the reader of the node summaries in the DHT (cmd_status.h,
 * HM_STATUS_KEY), pure functions over jansson values; it owns nothing.
 * Any member of the swarm writes its own summary, so the reader trusts
 * none of it: the value is parsed within HM_STATUS_VALUE_MAX bytes, only
 * the known fields of the right type are kept, numbers are clamped, and
 * strings the page shows (addresses, versions, uids) must be of
 * [A-Za-z0-9._:@[]-] and within their lengths or are dropped. The fuzz
 * target tests/fuzz/fuzz_status_rec.c drives it.
 */
#include "config.h"

#include "src/daemon/status_rec.h"
#include "src/base/crypto.h"
#include "src/base/util.h"

#include <math.h>
#include <string.h>

#define LATENCY_MAX_MS 3.6e6
#define COUNT_MAX ((json_int_t)1 << 53)

static const char *str_field(const json_t *o, const char *k, size_t max, char *buf)
{
    const char *v = json_string_value(json_object_get(o, k));
    buf[0] = '\0';
    if (v != NULL)
        hm_strlcpy(buf, v, max + 1);
    return buf;
}

static double num_field(const json_t *o, const char *k, double lo, double hi)
{
    const json_t *v = json_object_get(o, k);
    if (!json_is_number(v))
        return 0;
    double x = json_number_value(v);
    if (!isfinite(x))
        return 0;
    return x < lo ? lo : x > hi ? hi : x;
}

/* Whether a string holds only [A-Za-z0-9._:@[]-] (uids, addresses, versions):
 * what the page shows of a stranger's record is plain text. */
static int plain(const char *v)
{
    for (; *v; v++)
        if (!((*v >= 'a' && *v <= 'z') || (*v >= 'A' && *v <= 'Z') || (*v >= '0' && *v <= '9') ||
              strchr("._:@[]-", *v) != NULL))
            return 0;
    return 1;
}

json_t *hm_status_node_of_record(const json_t *rec, double now)
{
    const char *sub = json_string_value(json_object_get(rec, "subkey"));
    const char *val = json_string_value(json_object_get(rec, "value"));
    static const char pre[] = "[owner:";
    if (sub == NULL || val == NULL || strncmp(sub, pre, sizeof(pre) - 1) != 0)
        return NULL;
    size_t id_len = strlen(sub) - (sizeof(pre) - 1);
    if (id_len != HM_PEER_ID_LEN + 1 || sub[strlen(sub) - 1] != ']')
        return NULL;
    char peer[HM_PEER_ID_LEN + 1];
    memcpy(peer, sub + sizeof(pre) - 1, HM_PEER_ID_LEN);
    peer[HM_PEER_ID_LEN] = '\0';
    if (!plain(peer))
        return NULL;
    size_t vlen = strlen(val);
    if (vlen > HM_STATUS_VALUE_MAX)
        return NULL;
    json_error_t jerr;
    json_t *v = json_loadb(val, vlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!json_is_object(v)) {
        json_decref(v);
        return NULL;
    }
    char addr[96], ver[33];
    str_field(v, "addr", 95, addr);
    str_field(v, "ver", 32, ver);
    if (!plain(addr))
        addr[0] = '\0';
    if (!plain(ver))
        ver[0] = '\0';
    json_t *experts = json_array();
    const json_t *x = json_object_get(v, "x");
    size_t i;
    const json_t *e;
    json_array_foreach(x, i, e)
    {
        const char *uid = json_string_value(json_array_get(e, 0));
        if (uid == NULL || strlen(uid) > 64 || !plain(uid) || json_array_size(e) != 4)
            continue;
        const json_t *r = json_array_get(e, 1), *p50 = json_array_get(e, 2),
                     *p99 = json_array_get(e, 3);
        if (!json_is_integer(r) || !json_is_number(p50) || !json_is_number(p99))
            continue;
        /* Latencies within an hour, counts within 2^53: a figure past
         * those is a lie, not a measurement. */
        double l50 = json_number_value(p50), l99 = json_number_value(p99);
        l50 = isfinite(l50) && l50 >= 0 ? HM_MIN(l50, LATENCY_MAX_MS) : 0.0;
        l99 = isfinite(l99) && l99 >= 0 ? HM_MIN(l99, LATENCY_MAX_MS) : 0.0;
        json_int_t req = json_integer_value(r);
        req = req < 0 ? 0 : req > COUNT_MAX ? COUNT_MAX : req;
        json_array_append_new(
            experts, json_pack("{s:s, s:I, s:f, s:f}", "uid", uid, "requests",
                               req, "latency_p50_ms", l50, "latency_p99_ms", l99));
    }
    double exp = num_field(rec, "expiration", 0, 1e12);
    /* The figures are as of the record's time; uptime goes on from there
     * (an age of at most two minutes is believed: a record lives 45 s). */
    double t = num_field(v, "t", 0, 1e12);
    double age = t > 0 ? now - t : 0;
    age = age < 0 ? 0 : age > 120 ? 120 : age;
    json_t *n = json_pack(
        "{s:s, s:s, s:s, s:I, s:I, s:I, s:I, s:b, s:o, s:I, s:f, s:b}", "peer_id", peer,
        "address", addr, "version", ver, "uptime_s", (json_int_t)(num_field(v, "up", 0, 1e10) + age),
        "peers", (json_int_t)num_field(v, "peers", 0, 1e9), "rounds_ok",
        (json_int_t)num_field(v, "ok", 0, 1e15), "rounds_failed",
        (json_int_t)num_field(v, "fail", 0, 1e15), "client_mode",
        json_is_true(json_object_get(v, "cm")), "experts", experts, "n_experts",
        (json_int_t)num_field(v, "nx", 0, 1e9), "expires_in_s", HM_MAX(exp - now, 0.0),
        "self", 0);
    if (n != NULL)
        json_object_set_new(n, "age_s", json_real(age));
    json_decref(v);
    return n;
}


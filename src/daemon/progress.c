/*
 * progress: the swarm-progress record's codec and the aggregate over the
 * records of a run (progress.h). Pure: no clock, no I/O, no allocation
 * beyond the wire decoder's bounded zone.
 */
#include "config.h"

#include "src/daemon/progress.h"

#include "src/base/wire.h"

#include <errno.h>
#include <math.h>
#include <string.h>

static const char *const keys[] = {"epoch", "samples", "samples_per_second", "time", "client"};
#define N_KEYS 5

int hm_progress_check(const hm_progress_rec *r, const char **field_out)
{
    const char *bad = NULL;
    if (r->epoch > HM_PROGRESS_MAX_EPOCH)
        bad = "epoch";
    else if (r->samples > HM_PROGRESS_MAX_SAMPLES)
        bad = "samples";
    else if (!isfinite(r->sps) || r->sps < 0 || r->sps > HM_PROGRESS_MAX_SPS)
        bad = "samples_per_second";
    else if (!isfinite(r->time) || !(r->time > 0))
        bad = "time";
    if (field_out != NULL)
        *field_out = bad;
    return bad != NULL ? -ERANGE : 0;
}

int hm_progress_encode(const hm_progress_rec *r, uint8_t *buf, size_t cap, size_t *len_out)
{
    hm_wire_wr w;
    if (hm_progress_check(r, NULL) < 0)
        return -ERANGE;
    hm_wire_wr_init_fixed(&w, buf, cap < HM_PROGRESS_VALUE_MAX ? cap : HM_PROGRESS_VALUE_MAX);
    hm_wire_wr_map(&w, N_KEYS);
    hm_wire_wr_cstr(&w, "epoch");
    hm_wire_wr_uint(&w, r->epoch);
    hm_wire_wr_cstr(&w, "samples");
    hm_wire_wr_uint(&w, r->samples);
    hm_wire_wr_cstr(&w, "samples_per_second");
    hm_wire_wr_double(&w, r->sps);
    hm_wire_wr_cstr(&w, "time");
    hm_wire_wr_double(&w, r->time);
    hm_wire_wr_cstr(&w, "client");
    hm_wire_wr_bool(&w, r->client != 0);
    if (hm_wire_wr_error(&w) < 0)
        return -EMSGSIZE;
    *len_out = w.len;
    return 0;
}

/* Small frames only: a value is a handful of scalars. */
static const hm_wire_limits value_limits = {
    .max_size = HM_PROGRESS_VALUE_MAX, .max_depth = 1, .max_elements = 1 + 2 * N_KEYS};

int hm_progress_decode(const uint8_t *buf, size_t len, hm_progress_rec *out)
{
    hm_wire_msg m;
    hm_progress_rec r;
    int seen[N_KEYS] = {0};
    int result;

    memset(&r, 0, sizeof(r));
    if (len > HM_PROGRESS_VALUE_MAX)
        return -EMSGSIZE;
    if ((result = hm_wire_decode_open_map(&m, buf, len, &value_limits, NULL, 0)) < 0)
        goto out;
    result = -EPROTO;
    if (m.root.via.map.size != N_KEYS)
        goto out;
    for (uint32_t i = 0; i < m.root.via.map.size; i++) {
        const msgpack_object_kv *kv = &m.root.via.map.ptr[i];
        const char *k;
        uint32_t klen;
        int which = -1;
        if (hm_wire_get_str(&kv->key, &k, &klen) < 0)
            goto out;
        for (int j = 0; j < N_KEYS; j++)
            if (klen == strlen(keys[j]) && memcmp(k, keys[j], klen) == 0)
                which = j;
        if (which < 0 || seen[which]++)
            goto out; /* an unknown or repeated key */
        int ok;
        switch (which) {
        case 0:
            ok = hm_wire_get_uint(&kv->val, &r.epoch);
            break;
        case 1:
            ok = hm_wire_get_uint(&kv->val, &r.samples);
            break;
        case 2:
            ok = hm_wire_get_double(&kv->val, &r.sps);
            break;
        case 3:
            ok = hm_wire_get_double(&kv->val, &r.time);
            break;
        default:
            ok = hm_wire_get_bool(&kv->val, &r.client);
            break;
        }
        if (ok < 0)
            goto out;
    }
    if ((result = hm_progress_check(&r, NULL)) < 0)
        goto out;
    *out = r;
    result = 0;
out:
    hm_wire_decode_close(&m);
    return result;
}

double hm_progress_elapsed(const hm_progress_rec *r, double now)
{
    double dt = now - r->time;
    if (!(dt > 0))
        return 0;
    return dt < HM_PROGRESS_TTL_MAX ? dt : HM_PROGRESS_TTL_MAX;
}

static int usable(const hm_progress_rec *r, double now)
{
    return hm_progress_check(r, NULL) == 0 && !(r->time > now + HM_PROGRESS_SKEW_S);
}

void hm_progress_aggregate(const hm_progress_peer *peers, size_t n, double now, uint64_t target,
                           hm_progress_agg *out, int *used_out)
{
    uint64_t top_trainer = 0, top_client = 0;
    size_t trainers = 0, clients = 0, ignored = 0;
    double sps = 0, samples = 0;

    for (size_t i = 0; i < n; i++) {
        const hm_progress_rec *r = &peers[i].r;
        if (!usable(r, now)) {
            ignored++;
            continue;
        }
        if (r->client) {
            clients++;
            top_client = r->epoch > top_client ? r->epoch : top_client;
        } else {
            trainers++;
            top_trainer = r->epoch > top_trainer ? r->epoch : top_trainer;
        }
    }
    uint64_t global = trainers > 0 ? top_trainer : top_client;
    for (size_t i = 0; i < n; i++) {
        const hm_progress_rec *r = &peers[i].r;
        int used = usable(r, now);
        if (used_out != NULL)
            used_out[i] = used;
        if (!used)
            continue;
        sps += r->sps;
        if (r->epoch == global)
            samples += (double)r->samples + r->sps * hm_progress_elapsed(r, now);
    }
    out->global_epoch = global;
    out->samples = samples;
    out->sps = sps;
    out->n_peers = trainers;
    out->n_clients = clients;
    out->ignored = ignored;
    out->eta_s = -1;
    if (target > 0 && samples >= (double)target)
        out->eta_s = 0;
    else if (target > 0 && sps > 0)
        out->eta_s = ((double)target - samples) / sps;
}

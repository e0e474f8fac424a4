/*
 * progress: the swarm-progress record's codec and the aggregate over the
 * records of a run (progress.h). Pure: no clock, no I/O, no allocation
 * beyond the wire decoder's bounded zone (the aggregate works on the stack).
 */
#include "config.h"

#include "src/daemon/progress.h"

#include "src/base/util.h"
#include "src/base/wire.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const keys[] = {"epoch", "samples", "samples_per_second", "time", "client",
                                   "addr"};
#define N_KEYS 6
/* The five every record has; "addr" is optional (records of older daemons lack it). */
#define N_REQUIRED 5

/* A HOST:PORT of at most HM_PROGRESS_ADDR_MAX bytes that parses; "" is none. */
static int addr_ok(const char *a)
{
    struct sockaddr_storage ss;
    size_t len = strnlen(a, HM_PROGRESS_ADDR_MAX + 1);
    return len == 0 || (len <= HM_PROGRESS_ADDR_MAX && hm_parse_hostport(a, &ss) == 0);
}

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
    else if (!addr_ok(r->addr))
        bad = "addr";
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
    hm_wire_wr_map(&w, r->addr[0] != '\0' ? N_KEYS : N_REQUIRED);
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
    if (r->addr[0] != '\0') {
        hm_wire_wr_cstr(&w, "addr");
        hm_wire_wr_cstr(&w, r->addr);
    }
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
    if (m.root.via.map.size != N_REQUIRED && m.root.via.map.size != N_KEYS)
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
        case 4:
            ok = hm_wire_get_bool(&kv->val, &r.client);
            break;
        default: {
            const char *a;
            uint32_t alen;
            ok = hm_wire_get_str(&kv->val, &a, &alen);
            if (ok == 0 && (alen == 0 || alen > HM_PROGRESS_ADDR_MAX || memchr(a, 0, alen) != NULL))
                ok = -EPROTO;
            if (ok == 0) {
                memcpy(r.addr, a, alen);
                r.addr[alen] = '\0';
                ok = addr_ok(r.addr) ? 0 : -EPROTO;
            }
            break;
        }
        }
        if (ok < 0)
            goto out;
    }
    for (int j = 0; j < N_REQUIRED; j++)
        if (!seen[j])
            goto out; /* "addr" in place of a required entry */
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

/* A dead or stopped trainer's last record (progress.h). */
static int stale(const hm_progress_peer *x, double now, uint64_t target)
{
    double age = now - x->r.time;
    return !x->live && target > 0 && x->r.sps > 0 && age >= HM_PROGRESS_STALE_S &&
           x->r.sps * age >= 2.0 * (double)target;
}

/* One origin's part of the aggregate. */
typedef struct org_acc {
    const hm_progress_peer *first; /* its first counted record: the origin */
    int trainer;                   /* it has a non-client record */
    uint64_t trainer_epoch;        /* its vote (over its clients' records if it has no other) */
    uint64_t client_epoch;
    double samples, sps;           /* at the global epoch; over all its records */
    int at_global;                 /* it has a record at the global epoch */
} org_acc;

static int same_origin(const hm_progress_peer *a, const hm_progress_peer *b)
{
    return !a->unique && !b->unique && memcmp(a->origin.b, b->origin.b, HM_ORIGIN_BYTES) == 0;
}

static int cmp_u64_desc(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y ? 1 : 0;
}

/* The lower median of v[0..n) (sorted in place); n > 0. */
static double lower_median(double *v, size_t n)
{
    qsort(v, n, sizeof(*v), cmp_double);
    return v[(n - 1) / 2];
}

void hm_progress_aggregate(const hm_progress_peer *peers, size_t n, double now, uint64_t target,
                           const hm_progress_rules *rules, hm_progress_agg *out, int *used_out)
{
    /* On the stack: a read holds at most HM_PROGRESS_MAX_READ records. */
    org_acc orgs[HM_PROGRESS_MAX_READ];
    size_t org_of[HM_PROGRESS_MAX_READ];
    uint64_t votes[HM_PROGRESS_MAX_READ];
    double vals[HM_PROGRESS_MAX_READ];
    size_t n_orgs = 0, trainers = 0, clients = 0, ignored = 0, unverified = 0, n_stale = 0;
    int counted[HM_PROGRESS_MAX_READ];
    size_t held = 0, clamped = 0, nv = 0;
    unsigned quorum = rules != NULL && rules->epoch_origins > 0 ? rules->epoch_origins : 1;
    unsigned factor = rules != NULL ? rules->origin_factor : 0;
    int any_trainer = 0;
    double sps = 0, samples = 0;

    memset(out, 0, sizeof(*out));
    for (size_t i = 0; i < n; i++) {
        const hm_progress_peer *x = &peers[i];
        if (used_out != NULL)
            used_out[i] = 0;
        if (i < HM_PROGRESS_MAX_READ)
            counted[i] = 0;
        if (i >= HM_PROGRESS_MAX_READ || !usable(&x->r, now)) {
            ignored++;
            continue;
        }
        if (!x->verified) {
            unverified++;
            continue;
        }
        if (stale(x, now, target)) {
            n_stale++;
            continue;
        }
        counted[i] = 1;
        if (used_out != NULL)
            used_out[i] = 1;
        size_t o = 0;
        while (o < n_orgs && !same_origin(orgs[o].first, x))
            o++;
        if (o == n_orgs)
            memset(&orgs[n_orgs++], 0, sizeof(orgs[0])), orgs[o].first = x;
        org_of[i] = o;
        if (x->r.client) {
            clients++;
            orgs[o].client_epoch = HM_MAX(orgs[o].client_epoch, x->r.epoch);
        } else {
            trainers++;
            any_trainer = 1;
            orgs[o].trainer = 1;
            orgs[o].trainer_epoch = HM_MAX(orgs[o].trainer_epoch, x->r.epoch);
        }
        orgs[o].sps += x->r.sps;
    }
    /* The largest epoch `quorum` origins have reached (all, when fewer count). */
    for (size_t o = 0; o < n_orgs; o++)
        if (orgs[o].trainer == any_trainer)
            votes[nv++] = any_trainer ? orgs[o].trainer_epoch : orgs[o].client_epoch;
    uint64_t global = 0;
    if (nv > 0) {
        qsort(votes, nv, sizeof(*votes), cmp_u64_desc);
        /* -- progress majority -- A fixed count of origins is what an
         * attacker on that many origins has; more than half of the origins
         * that vote is what it must outnumber the honest hosts to reach. */
        if (rules != NULL && rules->majority && quorum < nv / 2 + 1)
            quorum = (unsigned)(nv / 2 + 1);
        global = votes[(quorum < nv ? quorum : nv) - 1];
        for (size_t k = 0; k < nv; k++)
            held += votes[k] > global;
    }
    for (size_t i = 0; i < n && i < HM_PROGRESS_MAX_READ; i++) {
        const hm_progress_rec *r = &peers[i].r;
        if (!counted[i] || r->epoch != global)
            continue;
        orgs[org_of[i]].samples += (double)r->samples + r->sps * hm_progress_elapsed(r, now);
        orgs[org_of[i]].at_global = 1;
    }
    /* One origin counts at most `factor` times what the median origin does. */
    double cap_samples = INFINITY, cap_sps = INFINITY;
    if (factor > 0 && n_orgs > 0) {
        nv = 0;
        for (size_t o = 0; o < n_orgs; o++)
            if (orgs[o].at_global)
                vals[nv++] = orgs[o].samples;
        if (nv > 0)
            cap_samples = (double)factor * lower_median(vals, nv);
        for (size_t o = 0; o < n_orgs; o++)
            vals[o] = orgs[o].sps;
        cap_sps = (double)factor * lower_median(vals, n_orgs);
    }
    for (size_t o = 0; o < n_orgs; o++) {
        int c = 0;
        if (orgs[o].samples > cap_samples)
            orgs[o].samples = cap_samples, c = 1;
        if (orgs[o].sps > cap_sps)
            orgs[o].sps = cap_sps, c = 1;
        clamped += c;
        samples += orgs[o].samples;
        sps += orgs[o].sps;
    }
    out->global_epoch = global;
    out->samples = samples;
    out->sps = sps;
    out->n_peers = trainers;
    out->n_clients = clients;
    out->n_origins = n_orgs;
    out->ignored = ignored;
    out->stale = n_stale;
    out->unverified = unverified;
    out->held_back = held;
    out->clamped = clamped;
    out->eta_s = -1;
    if (target > 0 && samples >= (double)target)
        out->eta_s = 0;
    else if (target > 0 && sps > 0)
        out->eta_s = ((double)target - samples) / sps;
}

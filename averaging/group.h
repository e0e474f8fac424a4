/*
 * group: what matchmaking hands to the all-reduce, shared by both. A group
 * is an ordered list of members that agreed to average together in one
 * round. The order is the same on every member (the leader decides it and
 * sends it to all), so that every member computes the same span layout
 * without further messages.
 */
#ifndef HM_AVG_GROUP_H
#define HM_AVG_GROUP_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "src/base/crypto.h"

#define HM_AVG_MAX_GROUP 64
#define HM_AVG_GROUP_ID_BYTES 32

typedef struct hm_avg_member {
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr; /* listen address (datagrams and streams) */
    /*
     * Declared bandwidth in bytes per second: spans are sized in proportion.
     * 0 for a client-mode member, which sends and receives but reduces
     * nothing.
     */
    double bandwidth;
} hm_avg_member;

typedef struct hm_avg_group {
    uint8_t group_id[HM_AVG_GROUP_ID_BYTES]; /* random, chosen by the leader */
    size_t n;                                /* 1..HM_AVG_MAX_GROUP */
    hm_avg_member members[HM_AVG_MAX_GROUP];
    size_t self;                             /* our index in members */
    /*
     * Moshpit group bits for the next round (a string of '0'/'1'), derived
     * from this group so that members meet different partners next time.
     */
    char next_bits[33];
} hm_avg_group;

/* The lower median of the positive finite values of v[0..n), n <= HM_AVG_MAX_GROUP; 0 if none. */
static inline double hm_avg_lower_median_positive(const double *v, size_t n)
{
    double s[HM_AVG_MAX_GROUP];
    size_t k = 0;
    for (size_t i = 0; i < n && i < HM_AVG_MAX_GROUP; i++) {
        double x = v[i];
        if (!(x > 0) || !isfinite(x))
            continue;
        size_t j = k++;
        while (j > 0 && s[j - 1] > x) { /* insertion sort: at most 64 values */
            s[j] = s[j - 1];
            j--;
        }
        s[j] = x;
    }
    return k == 0 ? 0.0 : s[(k - 1) / 2];
}

/*
 * The bandwidth bound (docs/security.md, AverageBandwidthFactor), applied
 * to a group before it begins. The leader clamps every member's bandwidth
 * to factor x the group's lower median positive bandwidth (a non-finite or
 * negative one to 0) and announces the clamped values, so every member
 * splits the vector from the same numbers; each member checks the announced
 * group against its own factor and refuses one that exceeds it. Members with
 * different factors therefore never split differently: at worst a strict
 * member declines a looser leader's group. Clamping with factor >= 1 leaves
 * the median where it was, so a clamped group is bounded under its factor.
 * A factor under 1 or not finite counts as 1.
 */
static inline double hm_avg_bandwidth_cap(const hm_avg_group *g, double factor)
{
    double bw[HM_AVG_MAX_GROUP];
    size_t n = g->n < HM_AVG_MAX_GROUP ? g->n : HM_AVG_MAX_GROUP;
    if (!(isfinite(factor) && factor >= 1.0))
        factor = 1.0;
    for (size_t i = 0; i < n; i++)
        bw[i] = g->members[i].bandwidth;
    return hm_avg_lower_median_positive(bw, n) * factor;
}

/* Clamps g's bandwidths as the leader does; returns how many changed. */
static inline size_t hm_avg_clamp_bandwidths(hm_avg_group *g, double factor)
{
    double cap = hm_avg_bandwidth_cap(g, factor);
    size_t n = g->n < HM_AVG_MAX_GROUP ? g->n : HM_AVG_MAX_GROUP, changed = 0;
    for (size_t i = 0; i < n; i++) {
        double b = g->members[i].bandwidth;
        double c = !(isfinite(b) && b >= 0) ? 0 : b > cap ? cap : b;
        if (c != b) {
            g->members[i].bandwidth = c;
            changed++;
        }
    }
    return changed;
}

/* 1 when every bandwidth of g is within the bound under factor, else 0. */
static inline int hm_avg_bandwidths_bounded(const hm_avg_group *g, double factor)
{
    double cap = hm_avg_bandwidth_cap(g, factor);
    size_t n = g->n < HM_AVG_MAX_GROUP ? g->n : HM_AVG_MAX_GROUP;
    for (size_t i = 0; i < n; i++) {
        double b = g->members[i].bandwidth;
        if (!(isfinite(b) && b >= 0) || b > cap)
            return 0;
    }
    return 1;
}

#endif

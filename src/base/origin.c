/*
 * origin: see origin.h.
 */
#include "config.h"

#include "src/base/origin.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int v4_is_local(const uint8_t a[4])
{
    return a[0] == 127 || a[0] == 10 || (a[0] == 172 && (a[1] & 0xf0) == 16) ||
           (a[0] == 192 && a[1] == 168) || (a[0] == 100 && (a[1] & 0xc0) == 64) ||
           (a[0] == 169 && a[1] == 254);
}

static int v6_is_local(const uint8_t a[16])
{
    static const uint8_t lo[16] = {[15] = 1};
    return memcmp(a, lo, 16) == 0 || (a[0] & 0xfe) == 0xfc || (a[0] == 0xfe && (a[1] & 0xc0) == 0x80);
}

/* The IPv4 address of sa (also when IPv4-mapped): 1, or 0 when it has none. */
static int as_v4(const struct sockaddr *sa, uint8_t out[4])
{
    if (sa->sa_family == AF_INET) {
        memcpy(out, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, 4);
        return 1;
    }
    const struct sockaddr_in6 *a6 = (const struct sockaddr_in6 *)(const void *)sa;
    if (IN6_IS_ADDR_V4MAPPED(&a6->sin6_addr)) {
        memcpy(out, a6->sin6_addr.s6_addr + 12, 4);
        return 1;
    }
    return 0;
}

int hm_origin_addr_is_local(const struct sockaddr *sa)
{
    uint8_t a4[4];
    if (sa == NULL || (sa->sa_family != AF_INET && sa->sa_family != AF_INET6))
        return 0;
    if (as_v4(sa, a4))
        return v4_is_local(a4);
    return v6_is_local(((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr.s6_addr);
}

void hm_origin_of(const struct sockaddr *sa, hm_origin *out)
{
    memset(out, 0, sizeof(*out));
    if (sa == NULL || (sa->sa_family != AF_INET && sa->sa_family != AF_INET6))
        return;
    uint8_t a4[4];
    if (as_v4(sa, a4)) {
        out->b[0] = 4;
        memcpy(out->b + 1, a4, v4_is_local(a4) ? 4 : 3);
        return;
    }
    const uint8_t *a6 = ((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr.s6_addr;
    out->b[0] = 6;
    memcpy(out->b + 1, a6, v6_is_local(a6) ? 16 : 6);
}

int hm_origin_eq(const hm_origin *a, const hm_origin *b)
{
    return memcmp(a->b, b->b, HM_ORIGIN_BYTES) == 0;
}

int hm_origin_is_loopback(const hm_origin *o)
{
    static const uint8_t lo6[16] = {[15] = 1};
    return (o->b[0] == 4 && o->b[1] == 127) || (o->b[0] == 6 && memcmp(o->b + 1, lo6, 16) == 0);
}

const char *hm_origin_str(const hm_origin *o, char buf[HM_ORIGIN_STR])
{
    char a[INET6_ADDRSTRLEN];
    if (o->b[0] == 4) {
        inet_ntop(AF_INET, o->b + 1, a, sizeof(a));
        snprintf(buf, HM_ORIGIN_STR, "%s%s", a, v4_is_local(o->b + 1) ? "" : "/24");
    } else if (o->b[0] == 6) {
        inet_ntop(AF_INET6, o->b + 1, a, sizeof(a));
        snprintf(buf, HM_ORIGIN_STR, "%s%s", a, v6_is_local(o->b + 1) ? "" : "/48");
    } else {
        snprintf(buf, HM_ORIGIN_STR, "none");
    }
    return buf;
}

int hm_origin_tab_init(hm_origin_tab *t, size_t max_origins)
{
    t->max_origins = max_origins == 0 ? 65536 : max_origins;
    return hm_hmap_init(&t->map, 16, t->max_origins < 16 ? 16 : t->max_origins);
}

void hm_origin_tab_free(hm_origin_tab *t)
{
    hm_hmap_node *n = hm_hmap_next(&t->map, NULL);
    while (n != NULL) {
        hm_hmap_node *next = hm_hmap_next(&t->map, n);
        hm_hmap_remove(&t->map, n);
        free(hm_hmap_entry(n, hm_origin_ent, node));
        n = next;
    }
    hm_hmap_free(&t->map);
}

hm_origin_ent *hm_origin_tab_get(hm_origin_tab *t, const hm_origin *o, int create)
{
    hm_origin_ent *e = hm_hmap_entry(hm_hmap_find(&t->map, o->b, HM_ORIGIN_BYTES), hm_origin_ent, node);
    if (e != NULL || !create)
        return e;
    if (hm_hmap_count(&t->map) >= t->max_origins)
        return NULL;
    e = calloc(1, sizeof(*e));
    if (e == NULL)
        return NULL;
    e->o = *o;
    hm_hmap_insert(&t->map, &e->node, e->o.b, HM_ORIGIN_BYTES);
    return e;
}

void hm_origin_tab_release(hm_origin_tab *t, hm_origin_ent *e)
{
    if (e == NULL)
        return;
    for (unsigned i = 0; i < HM_ORIGIN_VALS; i++)
        if (e->v[i] != 0)
            return;
    hm_hmap_remove(&t->map, &e->node);
    free(e);
}

hm_origin_ent *hm_origin_tab_next(const hm_origin_tab *t, const hm_origin_ent *e)
{
    return hm_hmap_entry(hm_hmap_next(&t->map, e == NULL ? NULL : &e->node), hm_origin_ent, node);
}

hm_origin_ent *hm_origin_tab_heaviest(const hm_origin_tab *t, unsigned idx)
{
    hm_origin_ent *best = NULL;
    if (idx >= HM_ORIGIN_VALS)
        return NULL;
    for (hm_origin_ent *e = hm_origin_tab_next(t, NULL); e != NULL; e = hm_origin_tab_next(t, e))
        if (best == NULL || e->v[idx] > best->v[idx])
            best = e;
    return best;
}

/*
 * origin: the network origin of a peer, the unit every limit, quota, fair
 * share and vote counts besides identities (docs/security.md).
 *
 * Identities are free: one process can mint thousands of keys a second and
 * present them all from one host. Addresses are not free, so a peer is also
 * charged to its origin:
 *   - a public IPv4 address is widened to its /24, a public IPv6 address to
 *     its /48 (what one customer of one provider usually holds);
 *   - loopback (127.0.0.0/8, ::1), private (10/8, 172.16/12, 192.168/16,
 *     100.64/10, fc00::/7) and link-local (169.254/16, fe80::/10) addresses
 *     are kept whole: on a LAN each machine is its own host, and on one
 *     machine every 127.x.y.z is its own origin, so tests put attackers on
 *     127.0.0.2 and up and the honest nodes on 127.0.0.1;
 *   - an IPv4-mapped IPv6 address is read as the IPv4 address;
 *   - the port never counts: one host has 65,535 of them.
 *
 * An hm_origin is a fixed-size byte string (zero padded), so it can key an
 * hmap or be compared with memcmp. hm_origin_tab counts a few values per
 * origin in a bounded table.
 */
#ifndef HM_ORIGIN_H
#define HM_ORIGIN_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "src/base/hmap.h"

#define HM_ORIGIN_BYTES 17 /* family (4, 6, or 0 for none), then up to 16 address bytes */
#define HM_ORIGIN_STR 64   /* "203.0.113.0/24", "2001:db8:1::/48", "127.0.0.2" */

typedef struct hm_origin {
    uint8_t b[HM_ORIGIN_BYTES];
} hm_origin;

/* The origin of sa (AF_INET or AF_INET6; any other family, or NULL, gives the
 * "none" origin, which all such peers share). */
void hm_origin_of(const struct sockaddr *sa, hm_origin *out);
int hm_origin_eq(const hm_origin *a, const hm_origin *b);
/* Whether the address is loopback, private or link-local (kept whole). */
int hm_origin_addr_is_local(const struct sockaddr *sa);
/* Whether o is a loopback address (127.0.0.0/8 or ::1): one machine. */
int hm_origin_is_loopback(const hm_origin *o);
/* Human-readable form, always NUL-terminated; returns buf. */
const char *hm_origin_str(const hm_origin *o, char buf[HM_ORIGIN_STR]);

/*
 * A table of per-origin counters: each entry holds HM_ORIGIN_VALS values
 * that its user defines (connections, bytes, queued items). Entries are
 * created on demand and freed by hm_origin_tab_release once every value is
 * zero. At most max_origins entries exist; get with create fails (NULL)
 * past that, so a caller counting a new origin when the table is full must
 * refuse what it was asked for, which is the conservative answer.
 */
#define HM_ORIGIN_VALS 4

typedef struct hm_origin_ent {
    hm_hmap_node node;
    hm_origin o;
    uint64_t v[HM_ORIGIN_VALS];
} hm_origin_ent;

typedef struct hm_origin_tab {
    hm_hmap map;
    size_t max_origins;
} hm_origin_tab;

/* 0 for max_origins means 65536. Returns 0 or -ENOMEM. */
int hm_origin_tab_init(hm_origin_tab *t, size_t max_origins);
void hm_origin_tab_free(hm_origin_tab *t);
/* The entry of o; with create, made (all values 0) if missing. NULL when
 * missing and not created, or when the table is full or memory is short. */
hm_origin_ent *hm_origin_tab_get(hm_origin_tab *t, const hm_origin *o, int create);
/* Frees e if all its values are zero. */
void hm_origin_tab_release(hm_origin_tab *t, hm_origin_ent *e);
/* The entry with the largest v[idx] (ties: any), or NULL when empty. O(origins). */
hm_origin_ent *hm_origin_tab_heaviest(const hm_origin_tab *t, unsigned idx);
static inline size_t hm_origin_tab_count(const hm_origin_tab *t) { return hm_hmap_count(&t->map); }
/* Iteration in no particular order: next(t, NULL) is the first entry. */
hm_origin_ent *hm_origin_tab_next(const hm_origin_tab *t, const hm_origin_ent *e);

/*
 * Every limit reports what it refused under its config keyword, and the
 * daemon prints the counts as hivemindd_limit_refused_total{limit="KEYWORD"}
 * (docs/security.md). A module with limits offers a function that calls
 * emit once per limit it enforces.
 */
typedef void (*hm_limit_emit_fn)(void *ud, const char *keyword, uint64_t refused);

#endif

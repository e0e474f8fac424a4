/*
 * Tests for network origins: public addresses widen to /24 and /48, local
 * ones stay whole, ports never count, IPv4-mapped IPv6 reads as IPv4, and
 * the per-origin table is bounded and frees entries that count nothing.
 */
#include "config.h"

#include "src/base/origin.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>

static hm_origin of(const char *ip, int port)
{
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof(ss));
    if (strchr(ip, ':') != NULL) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)port);
        cr_assert_eq(inet_pton(AF_INET6, ip, &a->sin6_addr), 1);
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        a->sin_family = AF_INET;
        a->sin_port = htons((uint16_t)port);
        cr_assert_eq(inet_pton(AF_INET, ip, &a->sin_addr), 1);
    }
    hm_origin o;
    hm_origin_of((struct sockaddr *)&ss, &o);
    return o;
}

static void same(const char *a, const char *b, int want)
{
    hm_origin x = of(a, 1000), y = of(b, 2000);
    cr_assert_eq(hm_origin_eq(&x, &y), want, "%s vs %s", a, b);
}

static void str_is(const char *ip, const char *want)
{
    char buf[HM_ORIGIN_STR];
    hm_origin o = of(ip, 9);
    cr_assert_str_eq(hm_origin_str(&o, buf), want);
}

Test(origin, public_ipv4_widens_to_24)
{
    same("203.0.113.5", "203.0.113.250", 1);
    same("203.0.113.5", "203.0.114.5", 0);
    str_is("203.0.113.77", "203.0.113.0/24");
}

Test(origin, loopback_and_private_stay_whole)
{
    same("127.0.0.1", "127.0.0.1", 1);
    same("127.0.0.1", "127.0.0.2", 0);
    same("10.1.2.3", "10.1.2.4", 0);
    same("192.168.1.2", "192.168.1.3", 0);
    same("172.20.0.1", "172.20.0.2", 0);
    same("172.32.0.1", "172.32.0.2", 1); /* outside 172.16/12: public */
    str_is("127.0.0.2", "127.0.0.2");
}

Test(origin, ipv6_widens_to_48_and_mapped_reads_as_ipv4)
{
    same("2001:db8:1:2::1", "2001:db8:1:ffff::9", 1);
    same("2001:db8:1::1", "2001:db8:2::1", 0);
    same("::1", "::1", 1);
    same("fd00::1", "fd00::2", 0);
    same("::ffff:203.0.113.5", "203.0.113.9", 1);
    same("::ffff:127.0.0.2", "127.0.0.2", 1);
    str_is("2001:db8:1:2::1", "2001:db8:1::/48");
}

Test(origin, no_address_is_one_origin)
{
    hm_origin a, b;
    hm_origin_of(NULL, &a);
    hm_origin_of(NULL, &b);
    cr_assert(hm_origin_eq(&a, &b));
    char buf[HM_ORIGIN_STR];
    cr_assert_str_eq(hm_origin_str(&a, buf), "none");
}

Test(origin, table_is_bounded_and_frees_empty_entries)
{
    hm_origin_tab t;
    cr_assert_eq(hm_origin_tab_init(&t, 3), 0);
    hm_origin a = of("127.0.0.1", 0), b = of("127.0.0.2", 0), c = of("127.0.0.3", 0),
              d = of("127.0.0.4", 0);
    hm_origin_ent *ea = hm_origin_tab_get(&t, &a, 1), *eb = hm_origin_tab_get(&t, &b, 1),
                  *ec = hm_origin_tab_get(&t, &c, 1);
    cr_assert(ea && eb && ec);
    cr_assert_null(hm_origin_tab_get(&t, &d, 1), "a fourth origin past the bound");
    cr_assert_eq(hm_origin_tab_get(&t, &a, 1), ea, "the same origin finds its entry");
    ea->v[1] = 5;
    eb->v[1] = 9;
    cr_assert_eq(hm_origin_tab_heaviest(&t, 1), eb);
    hm_origin_tab_release(&t, ec); /* all zero: freed */
    cr_assert_eq(hm_origin_tab_count(&t), 2);
    hm_origin_tab_release(&t, ea); /* still counts: kept */
    cr_assert_eq(hm_origin_tab_count(&t), 2);
    cr_assert_not_null(hm_origin_tab_get(&t, &d, 1), "room again");
    hm_origin_tab_free(&t);
}

/*
 * delay_rules: TestDelay's parser (delay_rules.h). The value comes from the
 * config file or the command line: bounded in rules, lengths and numbers,
 * with a reason for every refusal (tests/fuzz/fuzz_delay_rules.c).
 */
#include "config.h"

#include "src/net/delay_rules.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>

#include "src/base/util.h"

int hm_transport_delay_parse(const char *spec, hm_transport_delay_rule *out, size_t max,
                             char *why, size_t whylen)
{
    size_t n = 0;
    const char *p = spec;
    if (*p == '\0') {
        hm_errf(why, whylen, "expected ADDR[/BITS]=MS[,...]");
        return -EINVAL;
    }
    while (*p != '\0') {
        char one[INET6_ADDRSTRLEN + 32];
        size_t len = strcspn(p, ",");
        if (len == 0 || len >= sizeof(one)) {
            hm_errf(why, whylen, "expected ADDR[/BITS]=MS, comma-separated");
            return -EINVAL;
        }
        if (n == max) {
            hm_errf(why, whylen, "more than %zu rules", max);
            return -EINVAL;
        }
        memcpy(one, p, len);
        one[len] = '\0';
        p += len;
        if (*p == ',' && *++p == '\0') {
            hm_errf(why, whylen, "a trailing comma");
            return -EINVAL;
        }
        char *eq = strchr(one, '=');
        if (eq == NULL) {
            hm_errf(why, whylen, "'%s': expected ADDR[/BITS]=MS", one);
            return -EINVAL;
        }
        *eq = '\0';
        const char *ms = eq + 1;
        size_t digits = strspn(ms, "0123456789");
        if (digits == 0 || ms[digits] != '\0' || digits > 5 ||
            strtoul(ms, NULL, 10) > HM_TRANSPORT_DELAY_MS_MAX) {
            hm_errf(why, whylen, "'%s': the delay must be 0 to %d ms", ms,
                    HM_TRANSPORT_DELAY_MS_MAX);
            return -EINVAL;
        }
        unsigned long delay = strtoul(ms, NULL, 10);
        long bits = -1;
        char *slash = strchr(one, '/');
        if (slash != NULL) {
            *slash = '\0';
            const char *b = slash + 1;
            size_t bd = strspn(b, "0123456789");
            if (bd == 0 || bd > 3 || b[bd] != '\0') {
                hm_errf(why, whylen, "'%s': expected a prefix length in bits", b);
                return -EINVAL;
            }
            bits = strtol(b, NULL, 10);
        }
        hm_transport_delay_rule r;
        memset(&r, 0, sizeof(r));
        struct sockaddr_in *a4 = (struct sockaddr_in *)&r.addr;
        struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&r.addr;
        unsigned width;
        if (inet_pton(AF_INET, one, &a4->sin_addr) == 1) {
            a4->sin_family = AF_INET;
            width = 32;
        } else if (inet_pton(AF_INET6, one, &a6->sin6_addr) == 1) {
            a6->sin6_family = AF_INET6;
            width = 128;
        } else {
            hm_errf(why, whylen, "'%.64s' is not an IPv4 or IPv6 address", one);
            return -EINVAL;
        }
        if (bits > (long)width) {
            hm_errf(why, whylen, "a prefix of %ld bits is longer than the address", bits);
            return -EINVAL;
        }
        r.prefix = bits < 0 ? width : (unsigned)bits;
        r.delay_ms = delay;
        if (out != NULL)
            out[n] = r;
        n++;
    }
    return (int)n;
}

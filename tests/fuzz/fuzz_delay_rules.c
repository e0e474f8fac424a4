/*
 * fuzz_delay_rules: TestDelay's parser (src/net/delay_rules.h) against
 * arbitrary text. A value parses into at most the rules asked for, each
 * with a known family, a prefix no longer than its address and a delay in
 * range, or is refused with a reason; checking alone (no output array)
 * gives the same answer (an oracle: a mismatch aborts). The seed corpus
 * holds valid and invalid values.
 */
#include "config.h"

#include "src/net/delay_rules.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                            \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);           \
            abort();                                                                           \
        }                                                                                      \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    hm_transport_delay_rule rules[HM_TRANSPORT_DELAY_RULES_MAX];
    char why[256];
    char *s = malloc(size + 1);
    if (s == NULL)
        return 0;
    memcpy(s, data, size);
    s[size] = '\0';
    size_t max = size > 0 ? data[0] % (HM_TRANSPORT_DELAY_RULES_MAX + 1) : 4;
    why[0] = '\0';
    int n = hm_transport_delay_parse(s, rules, max, why, sizeof(why));
    CHECK(n == -EINVAL || (n >= 1 && (size_t)n <= max));
    if (n < 0)
        CHECK(why[0] != '\0');
    for (int i = 0; i < n; i++) {
        int fam = rules[i].addr.ss_family;
        CHECK(fam == AF_INET || fam == AF_INET6);
        CHECK(rules[i].prefix <= (fam == AF_INET ? 32u : 128u));
        CHECK(rules[i].delay_ms <= HM_TRANSPORT_DELAY_MS_MAX);
    }
    CHECK(hm_transport_delay_parse(s, NULL, max, why, sizeof(why)) == n);
    free(s);
    return 0;
}

/*
 * fuzz_reach: the reachability parsers (src/node/reach.h) against arbitrary
 * bytes: a dial-back request, its reply and the "observed" field of a ping
 * reply. Each input goes to all three. Whatever parses must hold what the
 * parser promises (an IPv4 or IPv6 address; a reply's error a small
 * non-positive code) and, for addresses, encode again to bytes that parse
 * to the same address (an oracle: a mismatch aborts). The seed corpus holds
 * one valid message of every kind.
 */
#include "config.h"

#include "src/node/reach.h"
#include "src/base/util.h"
#include "src/base/wire.h"

#include <errno.h>
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

static void addr_roundtrip(const struct sockaddr_storage *a, const char *key,
                           int (*parse)(const uint8_t *, size_t, struct sockaddr_storage *))
{
    uint8_t buf[128];
    hm_wire_wr w;
    struct sockaddr_storage b;
    CHECK(a->ss_family == AF_INET || a->ss_family == AF_INET6);
    hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
    hm_wire_wr_map(&w, 1);
    hm_wire_wr_cstr(&w, key);
    hm_wire_wr_addr(&w, a);
    CHECK(hm_wire_wr_error(&w) == 0);
    CHECK(parse(w.buf, w.len, &b) == 0);
    CHECK(hm_addr_equal((const struct sockaddr *)a, (const struct sockaddr *)&b));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct sockaddr_storage a;
    int reached = -1, error = 1;

    int r = hm_reach_parse_request(data, size, &a);
    CHECK(r == 0 || r == -EPROTO);
    if (r == 0)
        addr_roundtrip(&a, "addr", hm_reach_parse_request);
    r = hm_reach_parse_ping_reply(data, size, &a);
    CHECK(r == 0 || r == -EPROTO);
    if (r == 0)
        addr_roundtrip(&a, "observed", hm_reach_parse_ping_reply);
    r = hm_reach_parse_reply(data, size, &reached, &error);
    CHECK(r == 0 || r == -EPROTO);
    if (r == 0)
        CHECK((reached == 0 || reached == 1) && error <= 0 && error > -4096);
    return 0;
}

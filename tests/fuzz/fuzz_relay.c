/*
 * fuzz_relay: the relay's parsers (src/net/relay.h) against arbitrary
 * bytes: the ACCEPT preamble a connection opens with, the relay.connect
 * body, the relay.reserve reply, and RelayVia's value (the input as text).
 * What parses must hold what the parser promises, and a parsed preamble
 * or connect body must encode again to the same token (an oracle: a
 * mismatch aborts). The seed corpus holds one valid message of each kind.
 */
#include "config.h"

#include "src/net/relay.h"
#include "src/net/transport.h"
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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t tok[HM_RELAY_TOKEN_BYTES], tok2[HM_RELAY_TOKEN_BYTES];
    uint8_t pre[HM_TRANSPORT_RELAY_PREAMBLE];

    int r = hm_relay_parse_preamble(data, size, tok);
    CHECK(r == 0 || r == -EPROTO);
    if (r == 0) {
        hm_relay_make_preamble(tok, pre);
        CHECK(memcmp(pre, data, sizeof(pre)) == 0);
    }
    struct sockaddr_storage from, from2;
    r = hm_relay_parse_connect(data, size, tok, &from);
    CHECK(r == 0 || r == -EPROTO);
    if (r == 0) {
        /* What parses writes back to the same token and address. */
        CHECK(from.ss_family == AF_UNSPEC || from.ss_family == AF_INET ||
              from.ss_family == AF_INET6);
        uint8_t buf[64 + HM_ADDRSTRLEN];
        hm_wire_wr w;
        hm_wire_wr_init_fixed(&w, buf, sizeof(buf));
        hm_relay_write_connect(&w, tok, &from);
        CHECK(hm_wire_wr_error(&w) == 0);
        CHECK(hm_relay_parse_connect(w.buf, w.len, tok2, &from2) == 0);
        CHECK(memcmp(tok, tok2, sizeof(tok)) == 0);
        CHECK(from2.ss_family == from.ss_family);
        if (from.ss_family != AF_UNSPEC)
            CHECK(hm_addr_equal((const struct sockaddr *)&from, (const struct sockaddr *)&from2));
    }
    uint64_t ttl = 0;
    r = hm_relay_parse_reserve_reply(data, size, &ttl);
    CHECK(r == 0 || r == -EPROTO);
    if (r == 0)
        CHECK(ttl >= 1000 && ttl <= 86400000u);

    /* The same bytes as a config value. */
    char *s = malloc(size + 1);
    CHECK(s != NULL);
    memcpy(s, data, size);
    s[size] = '\0';
    hm_relay_via v[HM_RELAY_MAX_VIA];
    size_t n = 99;
    char err[200];
    r = hm_relay_parse_via(s, v, &n, err, sizeof(err));
    CHECK(r == 0 || r == -EINVAL);
    if (r == 0) {
        CHECK(n <= HM_RELAY_MAX_VIA);
        for (size_t i = 0; i < n; i++)
            CHECK(v[i].addr.ss_family == AF_INET || v[i].addr.ss_family == AF_INET6);
    }
    free(s);
    return 0;
}

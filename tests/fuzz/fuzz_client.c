/*
 * fuzz_client: the client library's reply-line parser (hmc_parse_reply)
 * on arbitrary bytes, cut into lines at '\n' as the library reads them.
 * Besides memory safety it checks the parser's promises: it answers 0,
 * -EREMOTEIO or -EPROTO; an ok reply yields a result that is a JSON object;
 * an error reply yields a non-empty code; the sentence is always
 * NUL-terminated.
 */
#include "config.h"

#include "lib/hivemind.h"

#include <errno.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                           \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "fuzz_client: check failed at line %d: %s\n", __LINE__, #cond);   \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void one_line(const char *line, size_t len)
{
    char code[64], err[256], *res = NULL;
    memset(code, 'x', sizeof(code));
    memset(err, 'x', sizeof(err));
    /* Any id, and the id the library would have sent first. */
    for (int64_t expect = -1; expect <= 1; expect += 2) {
        int r = hmc_parse_reply(line, len, expect, &res, code, sizeof(code), err, sizeof(err));
        CHECK(r == 0 || r == -EREMOTEIO || r == -EPROTO || r == -ENOMEM);
        CHECK(memchr(err, '\0', sizeof(err)) != NULL);
        CHECK(memchr(code, '\0', sizeof(code)) != NULL);
        if (r == 0) {
            CHECK(res != NULL);
            json_t *back = json_loads(res, 0, NULL);
            CHECK(json_is_object(back));
            json_decref(back);
        } else {
            CHECK(res == NULL);
        }
        if (r == -EREMOTEIO)
            CHECK(code[0] != '\0');
        hmc_free_string(res);
        res = NULL;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *p = (const char *)data, *end = p + size;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t len = nl != NULL ? (size_t)(nl - p) : (size_t)(end - p);
        one_line(p, len);
        p += len + (nl != NULL);
    }
    return 0;
}

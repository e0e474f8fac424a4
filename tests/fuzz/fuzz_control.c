/*
 * fuzz_control: the control socket's request parser against arbitrary
 * bytes, the way the server meets them: the input is cut into lines at
 * '\n' (each at most HM_CONTROL_MAX_LINE bytes, as the server caps them)
 * and each line is parsed. Besides memory safety it checks the parser's
 * promises: an accepted request has a valid command name and an args
 * object; a failure has one of the documented codes; and every reply built
 * from the outcome (echoing the id, with the args as a result) is a single
 * line of JSON that parses back as an object.
 */
#include "config.h"

#include "src/daemon/control.h"

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                           \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "fuzz_control: check failed at line %d: %s\n", __LINE__, #cond);  \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_reply(const json_t *id, int ok, const json_t *result, const char *code,
                        const char *msg)
{
    size_t len = 0;
    char *line = hm_control_format_reply(id, ok, result, code, msg, &len);
    if (line == NULL)
        return; /* allocation failure, or a value jansson cannot render */
    CHECK(len > 0 && line[len - 1] == '\n');
    CHECK(memchr(line, '\n', len - 1) == NULL);
    json_t *back = json_loadb(line, len - 1, 0, NULL);
    CHECK(json_is_object(back));
    CHECK(json_is_boolean(json_object_get(back, "ok")));
    CHECK(json_is_true(json_object_get(back, "ok")) == !!ok);
    if (id != NULL)
        CHECK(json_equal(json_object_get(back, "id"), (json_t *)id));
    json_decref(back);
    free(line);
}

static void one_line(const char *line, size_t len)
{
    hm_control_request r;
    const char *code = NULL;
    char msg[256];
    int rc = hm_control_parse_request(line, len, &r, &code, msg, sizeof(msg));
    if (rc == 0) {
        size_t n = strlen(r.cmd);
        CHECK(n >= 1 && n <= HM_CONTROL_MAX_CMD);
        for (size_t i = 0; i < n; i++)
            CHECK((r.cmd[i] >= 'a' && r.cmd[i] <= 'z') || (r.cmd[i] >= '0' && r.cmd[i] <= '9') ||
                  r.cmd[i] == '_' || r.cmd[i] == '-' || r.cmd[i] == '.');
        CHECK(json_is_object(r.args));
        check_reply(r.id, 1, r.args, NULL, NULL);
    } else {
        CHECK(code != NULL);
        CHECK(strcmp(code, "parse_error") == 0 || strcmp(code, "invalid_request") == 0 ||
              strcmp(code, "internal") == 0);
        CHECK(memchr(msg, '\0', sizeof(msg)) != NULL);
        check_reply(r.id, 0, NULL, code, msg);
    }
    hm_control_request_clear(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *p = (const char *)data;
    size_t left = size;
    /* The whole input once, as one (possibly overlong) line: the parser
     * itself must cope with any length. */
    if (size <= HM_CONTROL_MAX_LINE)
        one_line(p, size);
    while (left > 0) {
        const char *nl = memchr(p, '\n', left);
        size_t n = nl ? (size_t)(nl - p) : left;
        if (n <= HM_CONTROL_MAX_LINE && nl != NULL)
            one_line(p, n);
        if (nl == NULL)
            break;
        left -= n + 1;
        p += n + 1;
    }
    return 0;
}

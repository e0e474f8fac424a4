/*
 * fuzz_config: the config-file parser (src/daemon/hm_config.h) and the
 * HOST:PORT splitter it uses against arbitrary bytes. A file that loads
 * must print (hivemindd -t) to a text that loads again to the same
 * configuration (an oracle: a mismatch aborts); a HOST:PORT that splits
 * must name a host within bounds and a port below 65536, and a numeric one
 * must also parse as an address. Nothing here resolves a name.
 */
#include "config.h"

#include "src/base/util.h"
#include "src/daemon/hm_config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#define CHECK(cond)                                                                            \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);           \
            abort();                                                                           \
        }                                                                                      \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fuzz_hostport(const uint8_t *data, size_t size)
{
    char s[512], host[HM_HOSTNAME_MAX + 2];
    unsigned port = 70000;
    if (size >= sizeof(s))
        size = sizeof(s) - 1;
    memcpy(s, data, size);
    s[size] = '\0';
    struct sockaddr_storage ss;
    int numeric = hm_parse_hostport(s, &ss) == 0;
    int split = hm_split_hostport(s, host, sizeof(host), &port) == 0;
    CHECK(!numeric || split);
    if (split) {
        CHECK(port <= 65535);
        CHECK(strlen(host) > 0 && strlen(host) <= HM_HOSTNAME_MAX + 1);
        CHECK(strchr(host, ':') == NULL || strchr(s, '[') != NULL);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static hm_config a, b;
    char err[1024];

    fuzz_hostport(data, size);
    if (size > HM_CONFIG_MAX_FILE + 1)
        return 0;
    hm_config_defaults(&a);
    int rc = hm_config_load_buffer(&a, "fuzz.conf", (const char *)data, size, err, sizeof(err));
    CHECK(rc == 0 || rc == -EINVAL || rc == -EFBIG || rc == -ENOMEM);
    if (rc != 0)
        return 0;
    char *text = hm_config_format(&a);
    if (text == NULL)
        return 0;
    hm_config_defaults(&b);
    rc = hm_config_load_buffer(&b, "printed.conf", text, strlen(text), err, sizeof(err));
    if (rc != 0)
        fprintf(stderr, "the printed configuration does not load: %s\n%s", err, text);
    CHECK(rc == 0);
    CHECK(hm_config_equal(&a, &b));
    free(text);
    return 0;
}

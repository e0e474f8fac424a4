/*
 * progress: the swarm-progress calls of libhivemind (hivemind.h), thin
 * wrappers over the "progress.report" and "progress" control commands.
 */
#include "config.h"

#include "lib/hivemind.h"

#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

/* Sends cmd with args (taken over) and parses the result object. */
static int call(hmc *h, const char *cmd, json_t *args, json_t **result_out)
{
    char *text = NULL, *res = NULL;
    int r;
    *result_out = NULL;
    if (args == NULL)
        return -ENOMEM;
    text = json_dumps(args, JSON_COMPACT);
    json_decref(args);
    if (text == NULL)
        return -ENOMEM;
    r = hmc_request(h, cmd, text, &res);
    free(text);
    if (r == 0) {
        *result_out = json_loads(res, 0, NULL);
        if (*result_out == NULL)
            r = -EPROTO;
    }
    hmc_free_string(res);
    return r;
}

int hmc_progress_report(hmc *h, const char *run, uint64_t epoch, uint64_t samples,
                        double samples_per_second, int client)
{
    json_t *res;
    if (h == NULL || run == NULL || epoch > (uint64_t)INT64_MAX || samples > (uint64_t)INT64_MAX)
        return -EINVAL;
    int r = call(h, "progress.report",
                 json_pack("{s:s, s:I, s:I, s:f, s:b}", "run", run, "epoch", (json_int_t)epoch,
                           "samples", (json_int_t)samples, "samples_per_second",
                           samples_per_second, "client", client != 0),
                 &res);
    json_decref(res);
    return r;
}

static uint64_t get_u64(const json_t *o, const char *k)
{
    const json_t *v = json_object_get(o, k);
    return json_is_integer(v) && json_integer_value(v) > 0 ? (uint64_t)json_integer_value(v) : 0;
}

int hmc_progress_get(hmc *h, const char *run, uint64_t target_batch_size, hmc_progress *out,
                     char **json_out)
{
    json_t *res;
    if (json_out != NULL)
        *json_out = NULL;
    if (h == NULL || run == NULL || target_batch_size > (uint64_t)INT64_MAX)
        return -EINVAL;
    json_t *args = json_pack("{s:s}", "run", run);
    if (args != NULL && target_batch_size > 0)
        json_object_set_new(args, "target_batch_size", json_integer((json_int_t)target_batch_size));
    int r = call(h, "progress", args, &res);
    if (r != 0)
        return r;
    if (out != NULL) {
        const json_t *eta = json_object_get(res, "eta_s");
        memset(out, 0, sizeof(*out));
        out->global_epoch = get_u64(res, "global_epoch");
        out->samples = get_u64(res, "samples");
        out->target_batch_size = get_u64(res, "target_batch_size");
        out->samples_per_second = json_number_value(json_object_get(res, "samples_per_second"));
        out->eta_s = json_is_number(eta) ? json_number_value(eta) : -1;
        out->n_peers = (size_t)get_u64(res, "n_peers");
        out->n_clients = (size_t)get_u64(res, "n_clients");
    }
    if (json_out != NULL && (*json_out = json_dumps(res, JSON_COMPACT)) == NULL)
        r = -ENOMEM;
    json_decref(res);
    return r;
}

/*
 * daemon_args: the checks of control-command arguments that every command
 * file of hivemindd shares (daemon.h). Each one either returns the value
 * or answers the request with a "bad_args" error that names the argument
 * and says what was expected, so that a command stops at the first bad
 * argument and the client learns exactly why.
 */
#include "config.h"

#include "src/daemon/daemon.h"
#include "src/base/util.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

void hm_daemon_reply(hm_control_req *req, json_t *result)
{
    if (result == NULL)
        hm_control_reply_error(req, "internal", "out of memory");
    else
        hm_control_reply(req, result);
}

double hm_daemon_arg_seconds(hm_control_req *req, const json_t *args, const char *name,
                             double def, double max)
{
    const json_t *v = json_object_get(args, name);
    char msg[160];
    if (v == NULL)
        return def;
    if (!json_is_number(v) || !(json_number_value(v) > 0) || json_number_value(v) > max) {
        snprintf(msg, sizeof(msg), "args.%s must be seconds, above 0 and at most %g", name, max);
        hm_control_reply_error(req, "bad_args", msg);
        return -1;
    }
    return json_number_value(v);
}

long long hm_daemon_arg_int(hm_control_req *req, const json_t *args, const char *name,
                            long long def, long long lo, long long hi)
{
    const json_t *v = json_object_get(args, name);
    char msg[160];
    if (v == NULL && def >= 0)
        return def;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        snprintf(msg, sizeof(msg), "args.%s must be an integer from %lld to %lld", name, lo, hi);
        hm_control_reply_error(req, "bad_args", msg);
        return -1;
    }
    return (long long)json_integer_value(v);
}

int hm_daemon_arg_path(hm_control_req *req, const json_t *args, const char *name, char *out)
{
    const json_t *v = json_object_get(args, name);
    char msg[160];
    if (!json_is_string(v) || json_string_length(v) == 0 || json_string_length(v) >= PATH_MAX ||
        json_string_value(v)[0] != '/' || strlen(json_string_value(v)) != json_string_length(v)) {
        snprintf(msg, sizeof(msg), "args.%s must be an absolute path", name);
        hm_control_reply_error(req, "bad_args", msg);
        return -1;
    }
    hm_strlcpy(out, json_string_value(v), PATH_MAX);
    return 0;
}

/*
 * args: what every command file of hivemindd shares (daemon.h): replies,
 * the lifetime of a group with work in flight, and the checks of
 * control-command arguments. Each one either fills its *out and
 * returns 0, or answers the request with a "bad_args" error that names the
 * argument and says what was expected and returns -EINVAL, so that a
 * command stops at the first bad argument and the client learns exactly
 * why.
 */
#include "config.h"

#include "src/daemon/daemon.h"
#include "src/base/util.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void hm_daemon_reply(hm_control_req *req, json_t *result)
{
    if (result == NULL)
        hm_control_reply_error(req, "internal", "out of memory");
    else
        hm_control_reply(req, result);
}

void hm_daemon_reply_stopping(hm_control_req *req)
{
    hm_control_reply_error(req, "stopping", "the daemon is shutting down");
}

void hm_daemon_life_close(hm_daemon_life *l, void (*cb)(void *ud), void *ud)
{
    l->closing = 1;
    l->close_cb = cb;
    l->close_ud = ud;
}

int hm_daemon_life_refuse(const hm_daemon_life *l, hm_control_req *req)
{
    if (!l->closing)
        return 0;
    hm_daemon_reply_stopping(req);
    return 1;
}

int hm_daemon_life_settle(hm_daemon_life *l, void *group)
{
    if (!l->closing || l->jobs > 0 || l->parts > 0)
        return 0;
    void (*cb)(void *) = l->close_cb;
    void *ud = l->close_ud;
    free(group);
    if (cb != NULL)
        cb(ud);
    return 1;
}

/* Answers req "bad_args" with the formatted sentence; always -EINVAL. */
static int bad_arg(hm_control_req *req, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static int bad_arg(hm_control_req *req, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    hm_control_reply_error(req, "bad_args", msg);
    return -EINVAL;
}

int hm_daemon_arg_seconds(hm_control_req *req, const json_t *args, const char *name, double def,
                          double max, double *out)
{
    const json_t *v = json_object_get(args, name);
    if (v == NULL) {
        *out = def;
        return 0;
    }
    if (!json_is_number(v) || !(json_number_value(v) > 0) || json_number_value(v) > max)
        return bad_arg(req, "args.%s must be seconds, above 0 and at most %g", name, max);
    *out = json_number_value(v);
    return 0;
}

int hm_daemon_arg_int(hm_control_req *req, const json_t *args, const char *name, long long def,
                      long long lo, long long hi, long long *out)
{
    const json_t *v = json_object_get(args, name);
    if (v == NULL && def >= 0) {
        *out = def;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return bad_arg(req, "args.%s must be an integer from %lld to %lld", name, lo, hi);
    *out = (long long)json_integer_value(v);
    return 0;
}

int hm_daemon_arg_real(hm_control_req *req, const json_t *args, const char *name, double def,
                       double lo, int lo_open, double hi, const char *expect, double *out)
{
    const json_t *v = json_object_get(args, name);
    if (v == NULL) {
        *out = def;
        return 0;
    }
    double x = json_is_number(v) ? json_number_value(v) : NAN;
    if (!isfinite(x) || x < lo || (lo_open && x == lo) || x > hi)
        return bad_arg(req, "args.%s must be %s", name, expect);
    *out = x;
    return 0;
}

int hm_daemon_arg_bool(hm_control_req *req, const json_t *args, const char *name, int def,
                       int *out)
{
    const json_t *v = json_object_get(args, name);
    if (v == NULL) {
        *out = def;
        return 0;
    }
    if (!json_is_boolean(v))
        return bad_arg(req, "args.%s must be true or false", name);
    *out = json_is_true(v);
    return 0;
}

int hm_daemon_arg_choice(hm_control_req *req, const json_t *args, const char *name,
                         const char *const *names, int n, int def, int *out)
{
    const json_t *v = json_object_get(args, name);
    char list[160];
    size_t len = 0;
    if (v == NULL && def >= 0) {
        *out = def;
        return 0;
    }
    for (int i = 0; i < n && json_is_string(v); i++) {
        if (strcmp(json_string_value(v), names[i]) == 0) {
            *out = i;
            return 0;
        }
    }
    /* "a, b or c" */
    list[0] = '\0';
    for (int i = 0; i < n && len < sizeof(list); i++) {
        int w = snprintf(list + len, sizeof(list) - len, "%s%s",
                         i == 0 ? "" : i == n - 1 ? " or " : ", ", names[i]);
        if (w < 0)
            break;
        len += (size_t)w;
    }
    return bad_arg(req, "args.%s must be %s", name, list);
}

int hm_daemon_arg_string(hm_control_req *req, const json_t *args, const char *name, size_t max,
                         int optional, const char **out)
{
    const json_t *v = json_object_get(args, name);
    *out = NULL;
    if (v == NULL && optional)
        return 0;
    if (!json_is_string(v) || json_string_length(v) == 0 || json_string_length(v) > max ||
        strlen(json_string_value(v)) != json_string_length(v))
        return bad_arg(req, "args.%s must be a string of 1 to %zu bytes", name, max);
    *out = json_string_value(v);
    return 0;
}

int hm_daemon_arg_bits(hm_control_req *req, const json_t *args, const char *name, size_t max,
                       const char **out)
{
    const json_t *v = json_object_get(args, name);
    const char *b = json_string_value(v);
    *out = NULL;
    if (v == NULL)
        return 0;
    if (b == NULL || strlen(b) != json_string_length(v) || strlen(b) > max ||
        strspn(b, "01") != strlen(b))
        return bad_arg(req, "args.%s must be up to %zu of 0 and 1", name, max);
    *out = b;
    return 0;
}

int hm_daemon_arg_path(hm_control_req *req, const json_t *args, const char *name, char *out)
{
    const json_t *v = json_object_get(args, name);
    if (!json_is_string(v) || json_string_length(v) == 0 || json_string_length(v) >= PATH_MAX ||
        json_string_value(v)[0] != '/' || strlen(json_string_value(v)) != json_string_length(v))
        return bad_arg(req, "args.%s must be an absolute path", name);
    hm_strlcpy(out, json_string_value(v), PATH_MAX);
    return 0;
}

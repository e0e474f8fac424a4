/* paths: the default state directory and control socket (paths.h). */
#include "config.h"

#include "src/base/paths.h"

#include <errno.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* snprintf into buf; -ENAMETOOLONG (and "") when it does not fit. */
static int put(char *buf, size_t len, int n)
{
    if (n < 0 || (size_t)n >= len) {
        if (len > 0)
            buf[0] = '\0';
        return -ENAMETOOLONG;
    }
    return 0;
}

static const char *absolute_env(const char *name)
{
    const char *v = getenv(name);
    return v != NULL && v[0] == '/' ? v : NULL;
}

int hm_paths_default_state_dir(char *buf, size_t len)
{
    if (geteuid() == 0)
        return put(buf, len, snprintf(buf, len, "/var/lib/hivemindd"));
    const char *xdg = absolute_env("XDG_STATE_HOME");
    if (xdg != NULL)
        return put(buf, len, snprintf(buf, len, "%s/hivemindd", xdg));
    const char *home = absolute_env("HOME");
    struct passwd pw, *res = NULL;
    char tmp[4096];
    if (home == NULL) {
        if (getpwuid_r(geteuid(), &pw, tmp, sizeof(tmp), &res) != 0 || res == NULL ||
            pw.pw_dir == NULL || pw.pw_dir[0] != '/') {
            if (len > 0)
                buf[0] = '\0';
            return -ENOENT;
        }
        home = pw.pw_dir;
    }
    return put(buf, len, snprintf(buf, len, "%s/.local/state/hivemindd", home));
}

int hm_paths_default_control_socket(const char *state_dir, char *buf, size_t len)
{
    if (geteuid() == 0)
        return put(buf, len, snprintf(buf, len, "/run/hivemindd/control.sock"));
    const char *xdg = absolute_env("XDG_RUNTIME_DIR");
    if (xdg != NULL)
        return put(buf, len, snprintf(buf, len, "%s/hivemindd/control.sock", xdg));
    return put(buf, len, snprintf(buf, len, "%s/control.sock", state_dir));
}

int hm_paths_client_control_socket(char *buf, size_t len)
{
    const char *env = getenv("HIVEMINDD_CONTROL_SOCKET");
    if (env != NULL && env[0] != '\0')
        return put(buf, len, snprintf(buf, len, "%s", env));
    char state[4096];
    /* Root's socket does not depend on a state directory. */
    int r = geteuid() == 0 ? 0 : hm_paths_default_state_dir(state, sizeof(state));
    if (r != 0) {
        if (len > 0)
            buf[0] = '\0';
        return r;
    }
    return hm_paths_default_control_socket(geteuid() == 0 ? "" : state, buf, len);
}

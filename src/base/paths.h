/*
 * paths: where hivemindd keeps its state and its control socket by default.
 * One set of rules for the daemon (config.c), hivemindctl and the trainer
 * library (lib/), which links this file alone, so it uses nothing but libc.
 *
 *   state directory: /var/lib/hivemindd for root; else $XDG_STATE_HOME/hivemindd
 *                    (when absolute), else ~/.local/state/hivemindd
 *   control socket:  /run/hivemindd/control.sock for root; else
 *                    $XDG_RUNTIME_DIR/hivemindd/control.sock (when absolute),
 *                    else STATE_DIR/control.sock
 *
 * Each function returns 0, -ENAMETOOLONG when len is too small, or -ENOENT
 * when the home directory cannot be told; on error buf holds "".
 */
#ifndef HM_PATHS_H
#define HM_PATHS_H

#include <stddef.h>

/* The documented exit codes of hivemindd and hivemindctl (sysexits.h). */
enum {
    HM_EXIT_OK = 0,
    HM_EXIT_FAILURE = 1,
    HM_EXIT_USAGE = 64,
    HM_EXIT_NOHOST = 68,      /* a host name in the configuration does not resolve */
    HM_EXIT_UNAVAILABLE = 69, /* hivemindctl: the daemon cannot be reached */
    HM_EXIT_TEMPFAIL = 75,    /* no reply in time; the state directory is in use */
    HM_EXIT_PROTOCOL = 76,    /* hivemindctl: the daemon's reply was malformed */
    HM_EXIT_NOPERM = 77,      /* permission denied (a file, a directory, a socket) */
    HM_EXIT_CONFIG = 78,
};

/* sizeof(sun_path), including the NUL: the longest control socket path. */
#define HM_PATHS_SOCKET_LEN 108

int hm_paths_default_state_dir(char *buf, size_t len);
/* The socket of a daemon whose state directory is state_dir. */
int hm_paths_default_control_socket(const char *state_dir, char *buf, size_t len);
/*
 * The socket a client should connect to when none is named:
 * $HIVEMINDD_CONTROL_SOCKET when set, else the default of a daemon that
 * runs with the default state directory.
 */
int hm_paths_client_control_socket(char *buf, size_t len);

#endif

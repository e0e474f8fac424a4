/*
 * proc: helpers for tests that run hivemindd and hivemindctl as real
 * processes. Each test binary includes it once; its state is per process,
 * and Criterion runs each test in a process of its own. Every child gets
 * PR_SET_PDEATHSIG and is also killed by hm_proc_teardown, so a failed
 * assertion leaves nothing running.
 */
#ifndef HM_TEST_PROC_H
#define HM_TEST_PROC_H

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/helpers.h"

#define MAX_CHILDREN 24

/* Per-test state; each Criterion test runs in a process of its own. */
static pid_t children[MAX_CHILDREN];
static size_t n_children;
static char tmpdir[64];
static char bin_daemon[512], bin_ctl[512];

/* Starts prog with argv (NULL-terminated), stdout and stderr to files.
 * env_set holds "NAME=value" strings to add, or NULL. */
static inline pid_t spawn(const char *prog, char *const argv[], const char *out, const char *err,
                   const char *env_set)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    cr_assert(pid >= 0, "fork: %s", strerror(errno));
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        int o = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int e = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int in = open("/dev/null", O_RDONLY);
        if (o < 0 || e < 0 || in < 0)
            _exit(127);
        dup2(in, 0);
        dup2(o, 1);
        dup2(e, 2);
        unsetenv("NOTIFY_SOCKET");
        unsetenv("HIVEMINDD_CONTROL_SOCKET");
        if (env_set != NULL)
            putenv((char *)env_set);
        signal(SIGPIPE, SIG_DFL);
        execv(prog, argv);
        _exit(127);
    }
    /* Slots of children that were waited for are reused. */
    for (size_t i = 0; i < n_children; i++) {
        if (children[i] == 0) {
            children[i] = pid;
            return pid;
        }
    }
    cr_assert(n_children < MAX_CHILDREN);
    children[n_children++] = pid;
    return pid;
}

static inline void forget_child(pid_t pid)
{
    for (size_t i = 0; i < n_children; i++)
        if (children[i] == pid)
            children[i] = 0;
}

/* Waits for pid to exit; returns its wait status, or -1 on timeout. */
static inline int wait_exit(pid_t pid, int timeout_ms)
{
    long deadline = hm_test_now_ms() + timeout_ms;
    int status;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) {
            forget_child(pid);
            return status;
        }
        if (hm_test_now_ms() > deadline)
            return -1;
        usleep(10000);
    }
}

static inline char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return strdup("");
    char *buf = malloc(1 << 20);
    cr_assert_not_null(buf);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* Runs a program to completion (at most 15 s) with one more environment
 * variable (or NULL); returns the exit code and its stdout and stderr
 * (caller frees). */
static inline int run_prog_env(const char *prog, char *const argv[], const char *env, char **out,
                        char **err)
{
    char o[128], e[128];
    static int seq;
    snprintf(o, sizeof(o), "%s/run%d.out", tmpdir, seq);
    snprintf(e, sizeof(e), "%s/run%d.err", tmpdir, seq++);
    pid_t pid = spawn(prog, argv, o, e, env);
    int st = wait_exit(pid, 15000);
    cr_assert(st != -1, "%s did not finish", prog);
    *out = slurp(o);
    *err = slurp(e);
    cr_assert(WIFEXITED(st), "%s died by signal %d", prog, WTERMSIG(st));
    return WEXITSTATUS(st);
}

static inline int run_prog(const char *prog, char *const argv[], char **out, char **err)
{
    return run_prog_env(prog, argv, NULL, out, err);
}

static inline int ctl(const char *sock, const char *cmd, int json, char **out, char **err)
{
    char *argv[] = {bin_ctl, "-s", (char *)sock, "--timeout", "5", json ? "--json" : (char *)cmd,
                    json ? (char *)cmd : NULL, NULL};
    return run_prog(bin_ctl, argv, out, err);
}

struct node {
    pid_t pid;
    char dir[128];
    char sock[160];
    char out[160], err[160];
    char addr[256];
    char id[64];
};

/* Reads the first stdout line (the address) within timeout_ms. */
static inline int read_address(struct node *n, int timeout_ms)
{
    long deadline = hm_test_now_ms() + timeout_ms;
    while (hm_test_now_ms() < deadline) {
        char *text = slurp(n->out);
        char *nl = strchr(text, '\n');
        if (nl != NULL) {
            *nl = '\0';
            snprintf(n->addr, sizeof(n->addr), "%s", text);
            free(text);
            char *at = strchr(n->addr, '@');
            if (at == NULL)
                return -EINVAL;
            snprintf(n->id, sizeof(n->id), "%.*s", (int)(at - n->addr), n->addr);
            return 0;
        }
        free(text);
        int st;
        if (waitpid(n->pid, &st, WNOHANG) == n->pid) {
            forget_child(n->pid);
            return -ECHILD;
        }
        usleep(20000);
    }
    return -ETIMEDOUT;
}

/* Starts a daemon in tmpdir/name with the usual test flags plus extra ones. */
static inline void start_node(struct node *n, const char *name, const char *env_set, ...)
{
    char *argv[32];
    int argc = 0;
    va_list ap;

    memset(n, 0, sizeof(*n));
    snprintf(n->dir, sizeof(n->dir), "%s/%s", tmpdir, name);
    snprintf(n->sock, sizeof(n->sock), "%s/ctl.sock", n->dir);
    /* Fresh log files per start, so that a restart never reads old output. */
    static int starts;
    snprintf(n->out, sizeof(n->out), "%s/%s.%d.out", tmpdir, name, starts);
    snprintf(n->err, sizeof(n->err), "%s/%s.%d.err", tmpdir, name, starts++);
    mkdir(n->dir, 0700);
    argv[argc++] = bin_daemon;
    argv[argc++] = "--listen";
    argv[argc++] = "127.0.0.1:0";
    argv[argc++] = "--state-dir";
    argv[argc++] = n->dir;
    argv[argc++] = "--control-socket";
    argv[argc++] = n->sock;
    argv[argc++] = "--ping-interval";
    argv[argc++] = "1";
    va_start(ap, env_set);
    for (char *a = va_arg(ap, char *); a != NULL && argc < 30; a = va_arg(ap, char *))
        argv[argc++] = a;
    va_end(ap);
    argv[argc] = NULL;
    n->pid = spawn(bin_daemon, argv, n->out, n->err, env_set);
    int r = read_address(n, 10000);
    if (r != 0) {
        char *e = slurp(n->err);
        cr_assert_fail("%s did not print its address (%d); stderr:\n%s", name, r, e);
    }
}

static inline int peers_show(struct node *n, const char *id)
{
    char *out, *err;
    int rc = ctl(n->sock, "peers", 0, &out, &err);
    int found = rc == 0 && strstr(out, id) != NULL;
    free(out);
    free(err);
    return found;
}

/* Runs `hivemindctl --json ARGS...` (NULL-terminated) against n; returns
 * the parsed reply (NULL if there was none) and the exit code in *rc. */
static inline json_t *ctl_json(struct node *n, int *rc, ...)
{
    char *argv[16];
    int argc = 0;
    va_list ap;
    argv[argc++] = bin_ctl;
    argv[argc++] = "-s";
    argv[argc++] = n->sock;
    argv[argc++] = "--timeout";
    argv[argc++] = "15";
    argv[argc++] = "--json";
    va_start(ap, rc);
    for (char *a = va_arg(ap, char *); a != NULL && argc < 15; a = va_arg(ap, char *))
        argv[argc++] = a;
    va_end(ap);
    argv[argc] = NULL;
    char *out, *err;
    *rc = run_prog(bin_ctl, argv, &out, &err);
    json_t *j = json_loads(out, 0, NULL);
    free(out);
    free(err);
    return j;
}

/* Contacts in n's DHT routing table, or -1. */
static inline long node_rt_size(struct node *n)
{
    int rc;
    json_t *j = ctl_json(n, &rc, "dht", "info", NULL);
    long size = -1;
    if (j != NULL)
        size = (long)json_integer_value(json_object_get(
            json_object_get(json_object_get(j, "result"), "routing_table"), "size"));
    json_decref(j);
    return size;
}

static inline void stop_node(struct node *n)
{
    cr_assert_eq(kill(n->pid, SIGTERM), 0);
    int st = wait_exit(n->pid, 10000);
    cr_assert(st != -1, "no exit within 10 s of SIGTERM");
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d", st);
    struct stat sb;
    cr_assert_eq(lstat(n->sock, &sb), -1, "control socket left behind");
}

static inline void hm_proc_setup(const char *tag)
{
    const char *b = getenv("HM_BUILDDIR");
    if (b == NULL || b[0] == '\0')
        b = ".";
    snprintf(bin_daemon, sizeof(bin_daemon), "%s/src/hivemindd", b);
    snprintf(bin_ctl, sizeof(bin_ctl), "%s/src/hivemindctl", b);
    cr_assert_eq(access(bin_daemon, X_OK), 0, "%s not built", bin_daemon);
    cr_assert_eq(access(bin_ctl, X_OK), 0, "%s not built", bin_ctl);
    cr_assert_eq(hm_test_mkdtemp(tmpdir, sizeof(tmpdir), tag), 0);
    signal(SIGPIPE, SIG_IGN);
}

static inline void hm_proc_teardown(void)
{
    for (size_t i = 0; i < n_children; i++) {
        if (children[i] > 0) {
            kill(children[i], SIGKILL);
            waitpid(children[i], NULL, 0);
        }
    }
    n_children = 0;
    hm_test_rmtree(tmpdir);
}



#endif

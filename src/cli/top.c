/*
 * top: `hivemindctl top`, a live terminal view of the swarm from the
 * daemon's "status" snapshot (the same data as the HTTP swarm page), and
 * the text that `hivemindctl status` prints once.
 *
 * The screen is drawn with plain ANSI escapes (home, clear to the end of
 * the line and of the screen) in at most 80 columns, or the terminal's
 * width when narrower, and as many rows as the terminal has. On a
 * terminal, standard input is put in raw mode (no echo, no line
 * buffering) so that `q` quits at once; the saved mode is restored on
 * every way out: q, end of input, SIGINT, SIGTERM, SIGHUP (the handler
 * restores it and re-raises the signal with the default action), and
 * after an error. The cursor is hidden while running and shown again.
 */
#include "config.h"

#include "src/cli/top.h"
#include "lib/hivemind.h"

#include <errno.h>
#include <stdarg.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

static const char *jstr(const json_t *o, const char *k)
{
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "";
}

static long long jint(const json_t *o, const char *k)
{
    const json_t *v = json_object_get(o, k);
    return json_is_integer(v) ? (long long)json_integer_value(v)
                              : json_is_number(v) ? (long long)json_number_value(v) : 0;
}

static double jnum(const json_t *o, const char *k)
{
    return json_number_value(json_object_get(o, k));
}

/* A peer id as 8 characters, an ellipsis and the last 4: unique enough to tell apart. */
static void short_id(const char *id, char out[16])
{
    size_t n = strlen(id);
    if (n <= 13)
        snprintf(out, 16, "%s", id);
    else
        snprintf(out, 16, "%.8s..%s", id, id + n - 4);
}

static void dur(double s, char out[16])
{
    /* Up to about 30 years, so that the text always fits. */
    unsigned v = s > 0 ? (s < 1e9 ? (unsigned)s : 1000000000u) : 0;
    if (v < 120)
        snprintf(out, 16, "%us", v);
    else if (v < 7200)
        snprintf(out, 16, "%um", v / 60);
    else if (v < 172800)
        snprintf(out, 16, "%uh", v / 3600);
    else
        snprintf(out, 16, "%ud", v / 86400);
}

/* The snapshot says whether a node is up (cmd_status.c). */
static int node_up(const json_t *st, const json_t *n)
{
    (void)st;
    return json_is_true(json_object_get(n, "up"));
}

/* Whether the screen is drawn live (escapes) or printed once (plain lines). */
static int live;

/* Prints one line cut to width columns (the text is ASCII), then clears the rest. */
static void line(FILE *f, int width, int *rows_left, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void line(FILE *f, int width, int *rows_left, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    if (*rows_left <= 0)
        return;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (width > 0 && width < (int)sizeof(buf))
        buf[width] = '\0';
    /* Live, each line also clears what the last screen left on it; raw
     * mode does not turn \n into \r\n. */
    if (live)
        fprintf(f, "%s\033[K\r\n", buf);
    else
        fprintf(f, "%s\n", buf);
    (*rows_left)--;
}

void hm_top_render(FILE *f, const json_t *st, int width, int rows, const char *footer)
{
    const json_t *node = json_object_get(st, "node");
    const json_t *nodes = json_object_get(st, "nodes");
    const json_t *rounds = json_object_get(st, "rounds");
    int left = rows > 0 ? rows : 1 << 20;
    char id[16], up[16];
    short_id(jstr(node, "peer_id"), id);
    dur(jnum(node, "uptime_s"), up);
    time_t t = (time_t)jnum(st, "time");
    struct tm tm;
    char clock[16] = "";
    if (localtime_r(&t, &tm) != NULL)
        strftime(clock, sizeof(clock), "%H:%M:%S", &tm);
    line(f, width, &left, "hivemindd top  swarm %s  node %s  v%s  up %s  %s", jstr(node, "swarm"),
         id, jstr(node, "version"), up, clock);
    size_t i, n_up = 0;
    const json_t *n;
    json_array_foreach(nodes, i, n) n_up += node_up(st, n);
    const json_t *dht = json_object_get(st, "dht");
    line(f, width, &left, "nodes %zu up of %zu  peers %zu  rounds %lld ok %lld failed  dht %lld "
         "records", n_up, json_array_size(nodes), json_array_size(json_object_get(st, "peers")),
         jint(rounds, "ok"), jint(rounds, "failed"), jint(dht, "records"));
    line(f, width, &left, "%s", "");
    line(f, width, &left, "%-14s %-21s %-5s %6s %5s %7s %6s %6s", "NODE", "ADDRESS", "STATE",
         "UPTIME", "PEERS", "EXPERTS", "OK", "FAILED");
    json_array_foreach(nodes, i, n)
    {
        short_id(jstr(n, "peer_id"), id);
        dur(jnum(n, "uptime_s"), up);
        line(f, width, &left, "%-14s %-21.21s %-5s %6s %5lld %7lld %6lld %6lld", id,
             jstr(n, "address"), node_up(st, n) ? "up" : "DOWN", up, jint(n, "peers"),
             jint(n, "n_experts"), jint(n, "rounds_ok"), jint(n, "rounds_failed"));
    }
    const json_t *swarm = json_object_get(json_object_get(st, "experts"), "swarm");
    json_t *from_nodes = NULL;
    if (json_array_size(swarm) == 0) {
        /* No grid walked (a node that hosts none, without StatusGrids):
         * the experts the nodes' summaries name. */
        from_nodes = json_array();
        json_array_foreach(nodes, i, n)
        {
            size_t k;
            const json_t *x;
            json_array_foreach(json_object_get(n, "experts"), k, x)
            {
                json_array_append_new(from_nodes, json_pack("{s:s, s:s}", "uid", jstr(x, "uid"),
                                                            "host", jstr(n, "peer_id")));
            }
        }
        swarm = from_nodes;
    }
    if (json_array_size(swarm) > 0) {
        line(f, width, &left, "%s", "");
        line(f, width, &left, "%-24s %-14s %9s %8s %8s", "EXPERT", "HOST", "REQUESTS", "P50 MS",
             "P99 MS");
    }
    const json_t *e;
    json_array_foreach(swarm, i, e)
    {
        char host[96];
        snprintf(host, sizeof(host), "%s", jstr(e, "host"));
        char *at = strchr(host, '@');
        if (at != NULL)
            *at = '\0';
        /* What the host says of the expert in its summary, when it says it. */
        const json_t *x = NULL;
        size_t j, k;
        const json_t *nn, *xx;
        json_array_foreach(nodes, j, nn)
        {
            if (strcmp(jstr(nn, "peer_id"), host) != 0)
                continue;
            json_array_foreach(json_object_get(nn, "experts"), k, xx)
            {
                if (strcmp(jstr(xx, "uid"), jstr(e, "uid")) == 0)
                    x = xx;
            }
        }
        short_id(host, id);
        if (x != NULL)
            line(f, width, &left, "%-24.24s %-14s %9lld %8.2f %8.2f", jstr(e, "uid"), id,
                 jint(x, "requests"), jnum(x, "latency_p50_ms"), jnum(x, "latency_p99_ms"));
        else
            line(f, width, &left, "%-24.24s %-14s %9s %8s %8s", jstr(e, "uid"), id, "-", "-", "-");
    }
    json_decref(from_nodes);
    const json_t *recent = json_object_get(rounds, "recent");
    if (json_array_size(recent) > 0) {
        line(f, width, &left, "%s", "");
        line(f, width, &left, "%-7s %-16s %-24s %5s %9s", "ROUND", "PREFIX", "RESULT", "GROUP",
             "SECONDS");
    }
    json_array_foreach(recent, i, e)
    {
        if (i >= 5)
            break;
        line(f, width, &left, "%-7lld %-16.16s %-24.24s %5lld %9.3f", jint(e, "round"),
             jstr(e, "prefix"), json_is_true(json_object_get(e, "ok")) ? "ok" : jstr(e, "status"),
             jint(e, "group_size"), jnum(e, "duration_s"));
    }
    const json_t *progress = json_object_get(st, "progress");
    if (json_array_size(progress) > 0) {
        line(f, width, &left, "%s", "");
        line(f, width, &left, "%-20s %8s %12s %10s %6s %8s", "RUN", "EPOCH", "SAMPLES",
             "SAMPLES/S", "PEERS", "ETA S");
    }
    json_array_foreach(progress, i, e)
    {
        const json_t *eta = json_object_get(e, "eta_s");
        char etas[24] = "-";
        if (json_is_number(eta))
            snprintf(etas, sizeof(etas), "%.1f", json_number_value(eta));
        line(f, width, &left, "%-20.20s %8lld %12lld %10.1f %6lld %8s", jstr(e, "run"),
             jint(e, "global_epoch"), jint(e, "samples"), jnum(e, "samples_per_second"),
             jint(e, "n_peers"), etas);
    }
    if (footer != NULL) {
        /* The footer keeps the last row, even when the tables were cut. */
        if (left <= 0)
            left = 1;
        line(f, width, &left, "%s", "");
        if (left <= 0)
            left = 1;
        line(f, width, &left, "%s", footer);
    }
}

/* ---- the live view ---- */

static struct termios saved;
static int raw_on, cursor_hidden;
static volatile sig_atomic_t resized;

static void restore_terminal(void)
{
    if (raw_on) {
        tcsetattr(STDIN_FILENO, TCSAFLUSH, &saved);
        raw_on = 0;
    }
    static const char show[] = "\033[?25h";
    if (cursor_hidden && write(STDOUT_FILENO, show, sizeof(show) - 1) == (ssize_t)sizeof(show) - 1)
        cursor_hidden = 0;
}

static void on_fatal_signal(int sig)
{
    restore_terminal();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void on_winch(int sig)
{
    (void)sig;
    resized = 1;
}

static void term_size(int *w, int *h)
{
    struct winsize ws;
    *w = 80;
    *h = 24;
    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 && ws.ws_row > 0) {
        *w = ws.ws_col < 80 ? ws.ws_col : 80;
        *h = ws.ws_row;
    }
}

int hm_top_run(const char *sock, double interval_s, int once)
{
    char err[HMC_ERROR_MAX];
    hmc *h = NULL;
    int result = 1;
    int r = hmc_connect_timeout(sock, 15000, &h, err, sizeof(err));
    if (r != 0) {
        fprintf(stderr, "hivemindctl: cannot connect to %s: %s (is hivemindd running?)\n", sock,
                strerror(-r));
        return 1;
    }
    int tty = isatty(STDIN_FILENO) && !once;
    if (tty && tcgetattr(STDIN_FILENO, &saved) == 0) {
        struct termios raw = saved;
        raw.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
        raw.c_cc[VMIN] = 0;
        raw.c_cc[VTIME] = 0;
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = on_fatal_signal;
        sigaction(SIGINT, &sa, NULL);
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGHUP, &sa, NULL);
        sa.sa_handler = on_winch;
        sigaction(SIGWINCH, &sa, NULL);
        if (tcsetattr(STDIN_FILENO, TCSAFLUSH, &raw) == 0)
            raw_on = 1;
        fputs("\033[?25l\033[2J", stdout);
        fflush(stdout);
        cursor_hidden = 1;
    }
    char footer[96];
    snprintf(footer, sizeof(footer), "q quits  refreshes every %g s", interval_s);
    for (;;) {
        char *res = NULL;
        r = hmc_call(h, "status", NULL, 15000, &res, NULL);
        if (r != 0) {
            restore_terminal();
            fprintf(stderr, "\nhivemindctl: status: %s\n", hmc_last_error(h));
            goto out;
        }
        json_t *st = json_loads(res, 0, NULL);
        hmc_free_string(res);
        int w, rows;
        term_size(&w, &rows);
        if (once) {
            hm_top_render(stdout, st, 80, 0, NULL);
            json_decref(st);
            result = fflush(stdout) == 0 ? 0 : 1;
            goto out;
        }
        fputs("\033[H", stdout);
        live = 1;
        hm_top_render(stdout, st, w, rows - 1, footer);
        live = 0;
        fputs("\033[J", stdout);
        fflush(stdout);
        json_decref(st);
        /* Wait for the next refresh, or a key. */
        long long deadline_ms = (long long)(interval_s * 1000);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (;;) {
            clock_gettime(CLOCK_MONOTONIC, &t1);
            long long spent = (t1.tv_sec - t0.tv_sec) * 1000LL + (t1.tv_nsec - t0.tv_nsec) / 1000000;
            if (spent >= deadline_ms || resized)
                break;
            struct pollfd p = {.fd = STDIN_FILENO, .events = POLLIN};
            int pr = poll(&p, 1, (int)(deadline_ms - spent));
            if (pr < 0 && errno == EINTR)
                continue;
            if (pr <= 0)
                break;
            char c;
            ssize_t n = read(STDIN_FILENO, &c, 1);
            if (n == 0 && !tty) {
                /* End of a piped input: nothing more will come, keep refreshing. */
                usleep((useconds_t)((deadline_ms - spent) * 1000));
                break;
            }
            if (n == 1 && (c == 'q' || c == 'Q' || c == 3 /* ^C in raw mode */)) {
                result = 0;
                restore_terminal();
                fputs("\n", stdout);
                goto out;
            }
        }
        if (resized) {
            resized = 0;
            fputs("\033[2J", stdout);
        }
    }
out:
    restore_terminal();
    hmc_close(h);
    return result;
}

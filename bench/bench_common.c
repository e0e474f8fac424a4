/*
 * bench_common: helpers shared by the benchmark programs (bench_common.h).
 */
#include "config.h"

#include "bench/bench_common.h"

#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "src/base/util.h"

/* As many as the largest benchmark starts (bench_dht: up to 128 daemons,
 * its load workers and the control commands it runs). */
#define MAX_CHILDREN 160

static const char *prog = "bench";

/*
 * The processes and the directory this run created. Cleanup must be
 * reachable from atexit and from a signal handler, which take no
 * argument, so this one registry is file-scope; owner_pid keeps forked
 * children (which inherit it) from cleaning up the parent's children.
 */
static struct {
    pid_t owner_pid;
    pid_t pids[MAX_CHILDREN];
    size_t n;
    char tmpdir[64];
} reg;

void hm_bench_set_name(const char *name)
{
    prog = name;
}

void hm_bench_die(const char *what, int err)
{
    fprintf(stderr, "%s: %s: %s\n", prog, what, hm_strerror(err));
    exit(1);
}

void hm_bench_dief(const char *what)
{
    fprintf(stderr, "%s: %s\n", prog, what);
    exit(1);
}

/* ------------------------------------------------------------ statistics */

int hm_bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* A sorted copy of v, so that the callers' arrays keep their order. */
static double *sorted_copy(const double *v, size_t n)
{
    double *c = malloc((n > 0 ? n : 1) * sizeof(*c));
    if (c == NULL)
        hm_bench_die("statistics", -ENOMEM);
    if (n > 0)
        memcpy(c, v, n * sizeof(*c));
    qsort(c, n, sizeof(*c), hm_bench_cmp_double);
    return c;
}

double hm_bench_median(const double *v, size_t n)
{
    double *c = sorted_copy(v, n);
    double m = n % 2 ? c[n / 2] : (c[n / 2 - 1] + c[n / 2]) / 2;
    free(c);
    return m;
}

double hm_bench_percentile(const double *v, size_t n, double q)
{
    if (n == 0)
        return NAN;
    double *c = sorted_copy(v, n);
    size_t rank = (size_t)ceil(q * (double)n);
    double p = c[rank == 0 ? 0 : rank - 1];
    free(c);
    return p;
}

/* ------------------------------------------------------------ lines over pipes */

void hm_bench_put_line(int fd, const char *fmt, ...)
{
    char line[HM_BENCH_LINE_MAX];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n <= 0 || n >= (int)sizeof(line))
        hm_bench_die("line too long", -EMSGSIZE);
    ssize_t off = 0;
    while (off < n) {
        ssize_t w = write(fd, line + off, (size_t)(n - off));
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            hm_bench_die("pipe write", -errno);
        off += w;
    }
}

int hm_bench_lb_pop(hm_bench_linebuf *lb, char *out, size_t cap)
{
    char *nl = memchr(lb->buf, '\n', lb->len);
    if (nl == NULL)
        return lb->len == sizeof(lb->buf) ? -EMSGSIZE : 0;
    size_t l = (size_t)(nl - lb->buf);
    if (l >= cap)
        return -EMSGSIZE;
    memcpy(out, lb->buf, l);
    out[l] = '\0';
    lb->len -= l + 1;
    memmove(lb->buf, nl + 1, lb->len);
    return 1;
}

/* ------------------------------------------------------------ command lines */

size_t hm_bench_parse_size(const char *s, size_t lo, size_t hi, void (*usage)(void))
{
    char *end;
    unsigned long long v;

    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) {
        usage();
        exit(64); /* usage exits; this only keeps a returning one from going on */
    }
    return (size_t)v;
}

/* ------------------------------------------------------------ children */

pid_t hm_bench_fork(void)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0)
        hm_bench_die("fork", -errno);
    return pid;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    HM_UNUSED(st);
    HM_UNUSED(flag);
    HM_UNUSED(ftw);
    remove(path);
    return 0;
}

void hm_bench_children_kill(void)
{
    if (reg.owner_pid != getpid())
        return;
    for (size_t i = 0; i < reg.n; i++)
        if (reg.pids[i] > 0)
            kill(reg.pids[i], SIGKILL);
    for (size_t i = 0; i < reg.n; i++)
        if (reg.pids[i] > 0)
            waitpid(reg.pids[i], NULL, 0);
    reg.n = 0;
    if (reg.tmpdir[0] != '\0')
        nftw(reg.tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    reg.tmpdir[0] = '\0';
}

static void on_fatal_signal(int sig)
{
    /* Best effort: children that set PR_SET_PDEATHSIG die with us anyway;
     * this also reaps them and removes the temp directory. */
    hm_bench_children_kill();
    signal(sig, SIG_DFL);
    raise(sig);
}

void hm_bench_children_guard(void)
{
    reg.owner_pid = getpid();
    atexit(hm_bench_children_kill);
    signal(SIGINT, on_fatal_signal);
    signal(SIGTERM, on_fatal_signal);
}

pid_t hm_bench_owner_pid(void)
{
    return reg.owner_pid;
}

void hm_bench_child_add(pid_t pid)
{
    if (reg.n >= MAX_CHILDREN)
        hm_bench_dief("too many child processes");
    reg.pids[reg.n++] = pid;
}

void hm_bench_child_forget(pid_t pid)
{
    for (size_t i = 0; i < reg.n; i++)
        if (reg.pids[i] == pid)
            reg.pids[i] = 0;
}

const char *hm_bench_tmpdir_make(const char *tmpl)
{
    if (hm_strlcpy(reg.tmpdir, tmpl, sizeof(reg.tmpdir)) < 0) {
        reg.tmpdir[0] = '\0';
        errno = ENAMETOOLONG;
        return NULL;
    }
    if (mkdtemp(reg.tmpdir) == NULL) {
        reg.tmpdir[0] = '\0';
        return NULL;
    }
    return reg.tmpdir;
}

const char *hm_bench_tmpdir(void)
{
    return reg.tmpdir;
}

/* ------------------------------------------------------------ /proc */

long hm_bench_proc_status_kb(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = 0;
    size_t fl = strlen(field);
    if (f == NULL)
        return 0;
    while (fgets(line, sizeof(line), f) != NULL)
        if (strncmp(line, field, fl) == 0) {
            kb = strtol(line + fl, NULL, 10);
            break;
        }
    fclose(f);
    return kb;
}

double hm_bench_proc_cpu_s(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* The command name may hold spaces and parentheses: fields count from
     * the last ')'. utime and stime are fields 14 and 15. */
    char *p = strrchr(buf, ')');
    if (p == NULL)
        return -1;
    unsigned long ut, st;
    if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

uint64_t hm_bench_cpu_us(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) < 0)
        return 0;
    return (uint64_t)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000u +
           (uint64_t)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

/* ------------------------------------------------------------ data */

void hm_bench_fill(float *v, size_t n, uint64_t seed)
{
    uint64_t s = seed;
    for (size_t k = 0; k < n; k++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        v[k] = (float)((double)(s >> 40) / (double)(1 << 24) * 2.0 - 1.0);
    }
}

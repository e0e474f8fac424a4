/*
 * bench_common: the small helpers every benchmark program in bench/ needs
 * and that used to be copied into each: fatal errors that name the
 * program, medians and percentiles of samples, whole-line writes to a pipe
 * and the buffer that splits a pipe back into lines, a strict size parser,
 * a registry of child processes that are killed on every way out, readers
 * of /proc and a deterministic fill. It measures nothing itself; what a
 * benchmark measures and prints stays in its own file.
 *
 * The program name and the child registry are file-scope in
 * bench_common.c: they must be reachable from atexit and from a signal
 * handler, which take no argument, and a benchmark is one program per
 * process, unlike the daemon's code, which keeps no global state.
 *
 * bench/mpi_allreduce.c does not use this module: allreduce_vs_mpi.sh
 * compiles it alone with mpicc, without the tree's headers, config.h or
 * libraries (this file needs src/base/util.c), so it keeps its own copy
 * of the /proc/self/status reader and of bench_allreduce's fill pattern.
 */
#ifndef HM_BENCH_COMMON_H
#define HM_BENCH_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Names the program in every message the fatal helpers print ("bench"
 * until it is set). The string must outlive the program. */
void hm_bench_set_name(const char *name);

/* Prints "NAME: what: <error>" for a negative errno err, and exits 1. */
__attribute__((noreturn)) void hm_bench_die(const char *what, int err);

/* Prints "NAME: what" and exits 1. */
__attribute__((noreturn)) void hm_bench_dief(const char *what);

/* Ascending order of doubles, for qsort. */
int hm_bench_cmp_double(const void *a, const void *b);

/* The median of n samples (n >= 1); v is left as it was. */
double hm_bench_median(const double *v, size_t n);

/* The nearest-rank percentile q in (0, 1] of n samples, NAN when n is 0;
 * v is left as it was. */
double hm_bench_percentile(const double *v, size_t n, double q);

/* The longest line hm_bench_put_line writes, newline included: under
 * PIPE_BUF, so that lines several processes write to one pipe never
 * interleave. */
#define HM_BENCH_LINE_MAX 512

/* Writes one short line to a pipe, whole; dies if it does not fit in
 * HM_BENCH_LINE_MAX or the write fails. */
void hm_bench_put_line(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Splits a byte stream into lines: read into buf + len, up to the end of
 * buf, add what was read to len, then pop lines. */
typedef struct hm_bench_linebuf {
    char buf[8192];
    size_t len;
} hm_bench_linebuf;

/* Pops one complete line (without its newline) into out: 1 if there was
 * one, 0 if none is complete yet, -EMSGSIZE if the line does not fit in
 * out or fills the whole buffer without a newline. */
int hm_bench_lb_pop(hm_bench_linebuf *lb, char *out, size_t cap);

/* Flushes stdout and stderr, so that what they hold is not written a
 * second time by the child, then forks; dies when fork fails. */
pid_t hm_bench_fork(void);

/* Parses a decimal size in [lo, hi]; anything else calls usage, which
 * must not return. */
size_t hm_bench_parse_size(const char *s, size_t lo, size_t hi, void (*usage)(void));

/*
 * The child registry. hm_bench_children_guard makes this process the
 * owner and kills and reaps every registered child at exit and on SIGINT
 * or SIGTERM (then dies of that signal); a forked child inherits the
 * registry but, not being the owner, never acts on it. When a temporary
 * directory was made with hm_bench_tmpdir_make, it is removed with the
 * children.
 */
void hm_bench_children_guard(void);
pid_t hm_bench_owner_pid(void);
void hm_bench_child_add(pid_t pid);    /* dies when the registry is full */
void hm_bench_child_forget(pid_t pid); /* once the child is reaped */
void hm_bench_children_kill(void);

/* Makes a fresh directory from a mkdtemp template ("/tmp/NAME-XXXXXX");
 * its path, or NULL with errno set. */
const char *hm_bench_tmpdir_make(const char *tmpl);
/* The directory hm_bench_tmpdir_make made, or "" */
const char *hm_bench_tmpdir(void);

/* A "VmHWM:" or "VmRSS:" line of /proc/self/status, in KiB; 0 if absent. */
long hm_bench_proc_status_kb(const char *field);

/* utime + stime of process pid in seconds from /proc/PID/stat, or -1. */
double hm_bench_proc_cpu_s(pid_t pid);

/* CPU time this process used so far, user and system, in microseconds. */
uint64_t hm_bench_cpu_us(void);

/* Fills v with a deterministic pattern in [-1, 1) drawn from seed. */
void hm_bench_fill(float *v, size_t n, uint64_t seed);

#endif

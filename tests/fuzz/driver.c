/*
 * driver: a main() for fuzz targets built without libFuzzer (plain gcc, and
 * the `make check` build). It replays every file it is given, then runs a
 * number of inputs mutated from them with a seeded, deterministic generator,
 * calling the target's LLVMFuzzerTestOneInput on each:
 *
 *   fuzz_x [-runs=N] [-seed=S] [-max_len=N] [-timeout=SECS]
 *          [-artifact_prefix=PATH] [FILE|DIR ...]
 *
 * Directories contribute every regular file inside them (not recursively),
 * in name order. Other libFuzzer-style -flag=value options are accepted and
 * ignored, so one command line serves both builds. The same seed and files
 * always produce the same inputs, so a failure reproduces exactly.
 *
 * When an input crashes the target (a signal, a sanitizer report, or the
 * per-input timeout), the input is written to <artifact_prefix>crash-<name>
 * and its path printed, as libFuzzer does.
 */
#include "config.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* Optional in a target; weak so that targets without one still link. */
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));
/* Present only in sanitizer builds; lets a sanitizer report save the input too. */
void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

/*
 * gcc links UBSan as a runtime of its own, whose reports do not reach the
 * death callback above; making them abort lets the SIGABRT handler save the
 * input instead. The runtime reads these defaults at start (UBSAN_OPTIONS
 * still overrides them); without UBSan nothing calls this.
 */
const char *__ubsan_default_options(void);
const char *__ubsan_default_options(void) { return "abort_on_error=1:print_stacktrace=1"; }

#define DEFAULT_MAX_LEN (64 * 1024)
#define MAX_FILE_LEN (16u << 20) /* replayed files longer than this are refused */
#define MAX_MUTATIONS 8          /* stacked mutations per generated input */

struct input {
    uint8_t *data;
    size_t len;
    char *name;
};

struct corpus {
    struct input *items;
    size_t n;
    size_t cap;
};

/*
 * What the crash handlers need: the input being run and where to save it.
 * A signal handler can reach nothing but a file-scope variable, so this one
 * pointer is the driver's only global; it is set once in main.
 */
struct crash_ctx {
    const uint8_t *volatile data;
    volatile size_t len;
    volatile unsigned long run; /* 0 while replaying files */
    const char *volatile file;  /* the replayed file, if any */
    char path[4096];
};
static struct crash_ctx *crash_ctx;

/* ---- crash reporting (async-signal-safe: write(2) only) ---- */

static void say(const char *s) { (void)!write(STDERR_FILENO, s, strlen(s)); }

static void say_ulong(unsigned long v)
{
    char buf[24];
    size_t i = sizeof(buf);

    buf[--i] = '\0';
    do {
        buf[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v != 0 && i > 0);
    say(buf + i);
}

static void save_crash_input(void)
{
    struct crash_ctx *c = crash_ctx;
    int fd;

    if (c == NULL || c->data == NULL)
        return;
    say("driver: crashing input");
    if (c->file != NULL) {
        say(" (file ");
        say(c->file);
        say(")");
    } else {
        say(" (mutated run #");
        say_ulong(c->run);
        say(")");
    }
    fd = open(c->path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        size_t off = 0;
        while (off < c->len) {
            ssize_t n = write(fd, c->data + off, c->len - off);
            if (n <= 0)
                break;
            off += (size_t)n;
        }
        close(fd);
        say(" written to ");
        say(c->path);
    }
    say("\n");
    c->data = NULL;
}

static void on_fatal_signal(int sig)
{
    if (sig == SIGALRM)
        say("driver: input timed out\n");
    save_crash_input();
    signal(sig == SIGALRM ? SIGABRT : sig, SIG_DFL);
    raise(sig == SIGALRM ? SIGABRT : sig);
}

static void install_crash_handlers(void)
{
    static const int with_sanitizer[] = {SIGABRT, SIGALRM};
    static const int without[] = {SIGABRT, SIGALRM, SIGSEGV, SIGBUS, SIGFPE, SIGILL};
    const int *sigs = without;
    size_t n = sizeof(without) / sizeof(without[0]);
    struct sigaction sa;

    /*
     * Under a sanitizer, its own SIGSEGV report is worth more than ours; it
     * calls the death callback, which saves the input, before exiting.
     */
    if (__sanitizer_set_death_callback != NULL) {
        __sanitizer_set_death_callback(save_crash_input);
        sigs = with_sanitizer;
        n = sizeof(with_sanitizer) / sizeof(with_sanitizer[0]);
    }
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_fatal_signal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < n; i++)
        sigaction(sigs[i], &sa, NULL);
}

/* ---- deterministic random numbers (splitmix64) ---- */

struct rng {
    uint64_t s;
};

static uint64_t rng_next(struct rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform-enough integer in [0, n); n must be nonzero. */
static size_t rng_below(struct rng *r, size_t n) { return (size_t)(rng_next(r) % n); }

/* ---- corpus loading ---- */

static int corpus_add(struct corpus *c, uint8_t *data, size_t len, const char *name)
{
    if (c->n == c->cap) {
        size_t ncap = c->cap ? 2 * c->cap : 16;
        struct input *ni = realloc(c->items, ncap * sizeof(*ni));
        if (ni == NULL)
            return -ENOMEM;
        c->items = ni;
        c->cap = ncap;
    }
    c->items[c->n].data = data;
    c->items[c->n].len = len;
    c->items[c->n].name = strdup(name);
    if (c->items[c->n].name == NULL)
        return -ENOMEM;
    c->n++;
    return 0;
}

static int load_file(struct corpus *c, const char *path)
{
    FILE *f = fopen(path, "rb");
    uint8_t *data = NULL;
    size_t len = 0, cap = 0;
    int result = 0;

    if (f == NULL) {
        fprintf(stderr, "driver: %s: %s\n", path, strerror(errno));
        return -errno;
    }
    for (;;) {
        size_t n;
        if (len == cap) {
            uint8_t *nd;
            cap = cap ? 2 * cap : 4096;
            if (cap > MAX_FILE_LEN + 1)
                cap = MAX_FILE_LEN + 1;
            if (len == cap) {
                fprintf(stderr, "driver: %s: longer than %u bytes\n", path, MAX_FILE_LEN);
                result = -EMSGSIZE;
                goto out;
            }
            nd = realloc(data, cap);
            if (nd == NULL) {
                result = -ENOMEM;
                goto out;
            }
            data = nd;
        }
        n = fread(data + len, 1, cap - len, f);
        if (n == 0)
            break;
        len += n;
    }
    if (ferror(f)) {
        fprintf(stderr, "driver: %s: read error\n", path);
        result = -EIO;
        goto out;
    }
    if ((result = corpus_add(c, data, len, path)) < 0)
        goto out;
    data = NULL;
out:
    free(data);
    fclose(f);
    return result;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int load_path(struct corpus *c, const char *path)
{
    struct stat st;
    DIR *d;
    struct dirent *de;
    char **names = NULL;
    size_t n = 0, cap = 0;
    int result = 0;

    if (stat(path, &st) < 0) {
        fprintf(stderr, "driver: %s: %s\n", path, strerror(errno));
        return -errno;
    }
    if (!S_ISDIR(st.st_mode))
        return load_file(c, path);
    if ((d = opendir(path)) == NULL) {
        fprintf(stderr, "driver: %s: %s\n", path, strerror(errno));
        return -errno;
    }
    while ((de = readdir(d)) != NULL) {
        char full[4096];
        struct stat fst;

        if (de->d_name[0] == '.')
            continue;
        if ((size_t)snprintf(full, sizeof(full), "%s/%s", path, de->d_name) >= sizeof(full))
            continue;
        if (stat(full, &fst) < 0 || !S_ISREG(fst.st_mode))
            continue;
        if (n == cap) {
            size_t ncap = cap ? 2 * cap : 16;
            char **nn = realloc(names, ncap * sizeof(*nn));
            if (nn == NULL) {
                result = -ENOMEM;
                goto out;
            }
            names = nn;
            cap = ncap;
        }
        if ((names[n] = strdup(full)) == NULL) {
            result = -ENOMEM;
            goto out;
        }
        n++;
    }
    /* Name order, so that a run does not depend on the file system's order. */
    if (n > 0)
        qsort(names, n, sizeof(*names), cmp_str);
    for (size_t i = 0; i < n && result == 0; i++)
        result = load_file(c, names[i]);
out:
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    closedir(d);
    return result;
}

/* ---- mutation ---- */

/* Bytes that mean something to the parsers under test (msgpack type bytes, edges). */
static const uint8_t interesting8[] = {0x00, 0x01, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf,
                                       0xc0, 0xc1, 0xc2, 0xc3, 0xc4, 0xc5, 0xc6, 0xc7, 0xca,
                                       0xcb, 0xcc, 0xcf, 0xd0, 0xd3, 0xd4, 0xd8, 0xd9, 0xda,
                                       0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0xe0, 0xfe, 0xff};
static const uint32_t interesting32[] = {0,          1,          0x7f,       0x80,
                                         0xff,       0x100,      0x7fff,     0x8000,
                                         0xffff,     0x10000,    0x7fffffff, 0x80000000,
                                         0xfffffffe, 0xffffffff, 0x00100000, 0x01000000};

/*
 * One generated input: start from a corpus entry (or random bytes) and
 * apply a few stacked mutations. buf holds max_len bytes; returns the length.
 */
static size_t mutate(struct rng *r, const struct corpus *c, uint8_t *buf, size_t max_len)
{
    size_t len;
    size_t rounds;

    if (c->n > 0 && rng_below(r, 16) != 0) {
        const struct input *in = &c->items[rng_below(r, c->n)];
        len = in->len < max_len ? in->len : max_len;
        memcpy(buf, in->data, len);
    } else {
        len = rng_below(r, (max_len < 64 ? max_len : 64) + 1);
        for (size_t i = 0; i < len; i++)
            buf[i] = (uint8_t)rng_next(r);
    }

    /* Half the inputs get a single mutation: they stay close to valid and reach deeper code. */
    rounds = rng_below(r, 2) ? 1 : 1 + rng_below(r, MAX_MUTATIONS);
    for (size_t k = 0; k < rounds; k++) {
        switch (rng_below(r, 11)) {
        case 0: /* flip one bit */
            if (len > 0)
                buf[rng_below(r, len)] ^= (uint8_t)(1u << rng_below(r, 8));
            break;
        case 1: /* set a random byte */
            if (len > 0)
                buf[rng_below(r, len)] = (uint8_t)rng_next(r);
            break;
        case 2: /* set an interesting byte */
            if (len > 0)
                buf[rng_below(r, len)] = interesting8[rng_below(r, sizeof(interesting8))];
            break;
        case 3: { /* overwrite 1, 2 or 4 bytes with an interesting big-endian value */
            size_t w = (size_t)1 << rng_below(r, 3);
            uint32_t v = interesting32[rng_below(r, sizeof(interesting32) / 4)];
            if (len >= w) {
                size_t at = rng_below(r, len - w + 1);
                for (size_t i = 0; i < w; i++)
                    buf[at + i] = (uint8_t)(v >> (8 * (w - 1 - i)));
            }
            break;
        }
        case 4: { /* insert random bytes */
            size_t n = 1 + rng_below(r, 16);
            size_t at = rng_below(r, len + 1);
            if (n > max_len - len)
                n = max_len - len;
            memmove(buf + at + n, buf + at, len - at);
            for (size_t i = 0; i < n; i++)
                buf[at + i] = (uint8_t)rng_next(r);
            len += n;
            break;
        }
        case 5: { /* delete a range */
            if (len > 0) {
                size_t at = rng_below(r, len);
                size_t n = 1 + rng_below(r, len - at < 32 ? len - at : 32);
                memmove(buf + at, buf + at + n, len - at - n);
                len -= n;
            }
            break;
        }
        case 6: { /* duplicate a range elsewhere */
            if (len > 0 && len < max_len) {
                size_t from = rng_below(r, len);
                size_t n = 1 + rng_below(r, len - from);
                size_t at = rng_below(r, len + 1);
                uint8_t tmp[256];
                if (n > sizeof(tmp))
                    n = sizeof(tmp);
                if (n > max_len - len)
                    n = max_len - len;
                memcpy(tmp, buf + from, n);
                memmove(buf + at + n, buf + at, len - at);
                memcpy(buf + at, tmp, n);
                len += n;
            }
            break;
        }
        case 7: /* truncate */
            if (len > 0)
                len = rng_below(r, len);
            break;
        case 8: { /* splice: our prefix, another entry's suffix */
            if (c->n > 0) {
                const struct input *o = &c->items[rng_below(r, c->n)];
                size_t at = rng_below(r, len + 1);
                size_t from = rng_below(r, o->len + 1);
                size_t n = o->len - from;
                if (n > max_len - at)
                    n = max_len - at;
                memcpy(buf + at, o->data + from, n);
                len = at + n;
            }
            break;
        }
        case 9: { /* append random bytes */
            size_t n = 1 + rng_below(r, 64);
            if (n > max_len - len)
                n = max_len - len;
            for (size_t i = 0; i < n; i++)
                buf[len + i] = (uint8_t)rng_next(r);
            len += n;
            break;
        }
        default: { /* replace the whole input with random bytes */
            len = rng_below(r, (max_len < 256 ? max_len : 256) + 1);
            for (size_t i = 0; i < len; i++)
                buf[i] = (uint8_t)rng_next(r);
            break;
        }
        }
    }
    return len;
}

/*
 * Runs one input from an exactly sized heap copy, so that a sanitizer sees
 * any read past its end.
 */
static void run_one(struct crash_ctx *cc, const uint8_t *data, size_t len, unsigned timeout)
{
    uint8_t *copy = malloc(len > 0 ? len : 1);

    if (copy == NULL) {
        fprintf(stderr, "driver: out of memory\n");
        exit(1);
    }
    if (len > 0)
        memcpy(copy, data, len);
    cc->data = copy;
    cc->len = len;
    alarm(timeout);
    (void)LLVMFuzzerTestOneInput(copy, len);
    alarm(0);
    cc->data = NULL;
    free(copy);
}

static int parse_num(const char *arg, const char *flag, unsigned long long *out)
{
    size_t fl = strlen(flag);
    char *end;

    if (strncmp(arg, flag, fl) != 0)
        return 0;
    errno = 0;
    *out = strtoull(arg + fl, &end, 0);
    if (errno != 0 || end == arg + fl || *end != '\0') {
        fprintf(stderr, "driver: bad number in %s\n", arg);
        exit(64);
    }
    return 1;
}

int main(int argc, char **argv)
{
    unsigned long long runs = 0, seed = 1, max_len = DEFAULT_MAX_LEN, timeout = 25, v;
    const char *prefix = "./";
    const char *prog;
    struct corpus corpus = {0};
    struct crash_ctx cc;
    struct rng rng;
    uint8_t *buf;
    struct timespec t0, t1;

    if (LLVMFuzzerInitialize != NULL)
        LLVMFuzzerInitialize(&argc, &argv);

    prog = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (parse_num(a, "-runs=", &v))
            runs = v;
        else if (parse_num(a, "-seed=", &v))
            seed = v;
        else if (parse_num(a, "-max_len=", &v))
            max_len = v;
        else if (parse_num(a, "-timeout=", &v))
            timeout = v;
        else if (strncmp(a, "-artifact_prefix=", 17) == 0)
            prefix = a + 17;
        else if (a[0] == '-')
            fprintf(stderr, "driver: ignoring %s\n", a);
    }
    if (max_len == 0 || max_len > MAX_FILE_LEN)
        max_len = DEFAULT_MAX_LEN;
    if (timeout > 3600)
        timeout = 3600;

    for (int i = 1; i < argc; i++)
        if (argv[i][0] != '-' && load_path(&corpus, argv[i]) < 0)
            return 1;

    memset(&cc, 0, sizeof(cc));
    if ((size_t)snprintf(cc.path, sizeof(cc.path), "%scrash-%s", prefix, prog) >= sizeof(cc.path)) {
        fprintf(stderr, "driver: artifact prefix too long\n");
        return 64;
    }
    crash_ctx = &cc;
    install_crash_handlers();
    clock_gettime(CLOCK_MONOTONIC, &t0);

    for (size_t i = 0; i < corpus.n; i++) {
        cc.file = corpus.items[i].name;
        run_one(&cc, corpus.items[i].data, corpus.items[i].len, (unsigned)timeout);
    }
    cc.file = NULL;

    buf = malloc(max_len);
    if (buf == NULL) {
        fprintf(stderr, "driver: out of memory\n");
        return 1;
    }
    rng.s = seed;
    for (unsigned long long n = 1; n <= runs; n++) {
        size_t len = mutate(&rng, &corpus, buf, max_len);
        cc.run = (unsigned long)n;
        run_one(&cc, buf, len, (unsigned)timeout);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);

    printf("%s: replayed %zu files, ran %llu mutated inputs (seed %llu, max_len %llu) in %.1f s\n",
           prog, corpus.n, runs, seed, max_len,
           (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);

    crash_ctx = NULL;
    free(buf);
    for (size_t i = 0; i < corpus.n; i++) {
        free(corpus.items[i].data);
        free(corpus.items[i].name);
    }
    free(corpus.items);
    return 0;
}

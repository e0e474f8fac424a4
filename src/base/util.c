/* util: see util.h. */
#include "config.h"

#include "src/base/util.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/*
 * The log level is process configuration, set once by the main programs;
 * the nodes of one process share the stderr sink anyway.
 */
static int log_level = HM_LOG_INFO;

static const char *const level_names[] = {"error", "warn", "info", "debug"};

/*
 * Under systemd, stderr is a stream into the journal (JOURNAL_STREAM names
 * its device and inode). Lines then carry sd-daemon's "<N>" priority prefix
 * and no timestamp of their own (the journal stamps them), so that
 * `journalctl -p err` finds the errors.
 */
static int log_journal;
static const char level_prio[] = {'3', '4', '6', '7'};

int hm_log_detect_journal(void)
{
    const char *js = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;
    char tail;
    log_journal = 0;
    if (js != NULL && sscanf(js, "%llu:%llu%c", &dev, &ino, &tail) == 2 &&
        fstat(STDERR_FILENO, &st) == 0 && (unsigned long long)st.st_dev == dev &&
        (unsigned long long)st.st_ino == ino)
        log_journal = 1;
    return log_journal;
}

void hm_log_set_level(int level)
{
    if (level < HM_LOG_ERROR)
        level = HM_LOG_ERROR;
    if (level > HM_LOG_DEBUG)
        level = HM_LOG_DEBUG;
    log_level = level;
}

int hm_log_get_level(void) { return log_level; }

int hm_log_parse_level(const char *name)
{
    for (size_t i = 0; i < HM_ARRAY_LEN(level_names); i++)
        if (strcmp(name, level_names[i]) == 0)
            return (int)i;
    return -EINVAL;
}

const char *hm_log_level_name(int level)
{
    if (level < 0 || (size_t)level >= HM_ARRAY_LEN(level_names))
        return "?";
    return level_names[level];
}

void hm_log(int level, const char *module, const char *fmt, ...)
{
    if (level > log_level)
        return;
    if (level < HM_LOG_ERROR)
        level = HM_LOG_ERROR;
    char line[1024];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n = log_journal
                ? snprintf(line, sizeof(line), "<%c>%s %s: ", level_prio[level],
                           hm_log_level_name(level), module)
                : snprintf(line, sizeof(line), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s: ",
                           tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                           tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
                           hm_log_level_name(level), module);
    if (n < 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof(line) - 2)
        len = sizeof(line) - 2;
    line[len++] = '\n';
    /* One write per line so that lines of concurrent processes do not mix. */
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}

static uint64_t clock_us(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

uint64_t hm_now_us(void) { return clock_us(CLOCK_MONOTONIC); }
uint64_t hm_now_ms(void) { return clock_us(CLOCK_MONOTONIC) / 1000u; }
uint64_t hm_wall_us(void) { return clock_us(CLOCK_REALTIME); }

const char *hm_strerror(int err)
{
    switch (-err) {
    case EBADMSG:
        return "authentication failed";
    case EALREADY:
        return "replayed message";
    case ESTALE:
        return "timestamp outside the accepted window";
    case EPERM:
        return "peer identity or swarm mismatch";
    case ENOBUFS:
        return "queue limit reached";
    default:
        return strerror(err < 0 ? -err : err);
    }
}

int hm_addr_dialable(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        return a->sin_addr.s_addr == htonl(INADDR_ANY) || a->sin_port == 0 ? -EINVAL : 0;
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        return IN6_IS_ADDR_UNSPECIFIED(&a->sin6_addr) || a->sin6_port == 0 ? -EINVAL : 0;
    }
    return -EINVAL;
}

int hm_parse_hostport(const char *s, struct sockaddr_storage *out)
{
    char host[INET6_ADDRSTRLEN + 1];
    const char *port_s;
    size_t hlen;
    int v6 = 0;

    memset(out, 0, sizeof(*out));
    if (s == NULL || *s == '\0')
        return -EINVAL;
    if (s[0] == '[') {
        const char *end = strchr(s, ']');
        if (end == NULL || end[1] != ':')
            return -EINVAL;
        hlen = (size_t)(end - s - 1);
        if (hlen == 0 || hlen >= sizeof(host))
            return -EINVAL;
        memcpy(host, s + 1, hlen);
        port_s = end + 2;
        v6 = 1;
    } else {
        const char *colon = strrchr(s, ':');
        if (colon == NULL)
            return -EINVAL;
        hlen = (size_t)(colon - s);
        if (hlen == 0 || hlen >= sizeof(host))
            return -EINVAL;
        memcpy(host, s, hlen);
        port_s = colon + 1;
    }
    host[hlen] = '\0';
    if (*port_s == '\0' || strlen(port_s) > 5)
        return -EINVAL;
    unsigned long port = 0;
    for (const char *p = port_s; *p; p++) {
        if (*p < '0' || *p > '9')
            return -EINVAL;
        port = port * 10 + (unsigned long)(*p - '0');
    }
    if (port > 65535)
        return -EINVAL;
    if (v6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)out;
        if (inet_pton(AF_INET6, host, &a->sin6_addr) != 1)
            return -EINVAL;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)port);
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)out;
        if (inet_pton(AF_INET, host, &a->sin_addr) != 1)
            return -EINVAL;
        a->sin_family = AF_INET;
        a->sin_port = htons((uint16_t)port);
    }
    return 0;
}

/* A DNS name as RFC 1123 allows it: dot-separated labels of 1 to 63
 * letters, digits and hyphens, not starting or ending with a hyphen. */
static int hostname_ok(const char *h, size_t n)
{
    if (n > 0 && h[n - 1] == '.')
        n--;
    if (n == 0 || n > HM_HOSTNAME_MAX)
        return 0;
    size_t label = 0;
    for (size_t i = 0; i <= n; i++) {
        char c = i < n ? h[i] : '.';
        if (c == '.') {
            if (label == 0 || label > 63 || h[i - 1] == '-')
                return 0;
            label = 0;
            continue;
        }
        int alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
        if (!alnum && !(c == '-' && label > 0))
            return 0;
        label++;
    }
    return 1;
}

int hm_split_hostport(const char *s, char *host, size_t hostlen, unsigned *port_out)
{
    const char *hs, *port_s;
    size_t hlen;
    int v6 = 0;

    if (s == NULL || host == NULL || hostlen == 0)
        return -EINVAL;
    if (s[0] == '[') {
        const char *end = strchr(s, ']');
        if (end == NULL || end[1] != ':')
            return -EINVAL;
        hs = s + 1;
        hlen = (size_t)(end - hs);
        port_s = end + 2;
        v6 = 1;
    } else {
        const char *colon = strrchr(s, ':');
        if (colon == NULL)
            return -EINVAL;
        hs = s;
        hlen = (size_t)(colon - s);
        port_s = colon + 1;
    }
    if (hlen == 0 || hlen >= hostlen)
        return -EINVAL;
    memcpy(host, hs, hlen);
    host[hlen] = '\0';
    if (*port_s == '\0' || strlen(port_s) > 5 || strspn(port_s, "0123456789") != strlen(port_s))
        return -EINVAL;
    unsigned long port = strtoul(port_s, NULL, 10);
    if (port > 65535)
        return -EINVAL;
    struct in6_addr a6;
    struct in_addr a4;
    if (v6 ? inet_pton(AF_INET6, host, &a6) != 1
           : inet_pton(AF_INET, host, &a4) != 1 && !hostname_ok(host, hlen))
        return -EINVAL;
    *port_out = (unsigned)port;
    return 0;
}

int hm_resolve_hostport(const char *s, struct sockaddr_storage *out, char *why, size_t whylen)
{
    char host[HM_HOSTNAME_MAX + 2];
    unsigned port;

    if (hm_parse_hostport(s, out) == 0)
        return 0;
    if (hm_split_hostport(s, host, sizeof(host), &port) != 0) {
        hm_errf(why, whylen, "'%s' is not HOST:PORT", s);
        return -EINVAL;
    }
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    int r = getaddrinfo(host, NULL, &hints, &res);
    if (r != 0 || res == NULL) {
        hm_errf(why, whylen, "cannot resolve '%s': %s", host,
                r == EAI_SYSTEM ? strerror(errno) : gai_strerror(r));
        if (res != NULL)
            freeaddrinfo(res);
        return -EHOSTUNREACH;
    }
    const struct addrinfo *pick = NULL;
    for (const struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
        if (ai->ai_family == AF_INET) {
            pick = ai;
            break;
        }
        if (ai->ai_family == AF_INET6 && pick == NULL)
            pick = ai;
    }
    int result = -EHOSTUNREACH;
    memset(out, 0, sizeof(*out));
    if (pick == NULL) {
        hm_errf(why, whylen, "cannot resolve '%s': no IPv4 or IPv6 address", host);
    } else {
        memcpy(out, pick->ai_addr, pick->ai_addrlen);
        if (pick->ai_family == AF_INET)
            ((struct sockaddr_in *)out)->sin_port = htons((uint16_t)port);
        else
            ((struct sockaddr_in6 *)out)->sin6_port = htons((uint16_t)port);
        result = 0;
    }
    freeaddrinfo(res);
    return result;
}

int hm_format_addr(const struct sockaddr *sa, char *buf, size_t len)
{
    char host[INET6_ADDRSTRLEN];
    int n;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
        n = snprintf(buf, len, "%s:%u", host, ntohs(a->sin_port));
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
        n = snprintf(buf, len, "[%s]:%u", host, ntohs(a->sin6_port));
    } else {
        n = snprintf(buf, len, "?");
    }
    return (n < 0 || (size_t)n >= len) ? -EMSGSIZE : 0;
}

int hm_addr_equal(const struct sockaddr *a, const struct sockaddr *b)
{
    if (a->sa_family != b->sa_family)
        return 0;
    if (a->sa_family == AF_INET) {
        const struct sockaddr_in *x = (const void *)a, *y = (const void *)b;
        return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
    }
    if (a->sa_family == AF_INET6) {
        const struct sockaddr_in6 *x = (const void *)a, *y = (const void *)b;
        return x->sin6_port == y->sin6_port &&
               memcmp(&x->sin6_addr, &y->sin6_addr, sizeof(x->sin6_addr)) == 0;
    }
    return 0;
}

socklen_t hm_addr_len(const struct sockaddr *sa)
{
    return sa->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
}

static const char b32_alphabet[] = "abcdefghijklmnopqrstuvwxyz234567";

int hm_base32_encode(const uint8_t *in, size_t len, char *out, size_t out_cap)
{
    size_t need = (len * 8 + 4) / 5;
    if (out_cap < need + 1)
        return -EMSGSIZE;
    size_t o = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < len; i++) {
        acc = (acc << 8) | in[i];
        bits += 8;
        while (bits >= 5) {
            out[o++] = b32_alphabet[(acc >> (bits - 5)) & 31];
            bits -= 5;
        }
    }
    if (bits > 0)
        out[o++] = b32_alphabet[(acc << (5 - bits)) & 31];
    out[o] = '\0';
    return (int)o;
}

int hm_base32_decode(const char *in, size_t len, uint8_t *out, size_t out_cap)
{
    size_t o = 0;
    uint32_t acc = 0;
    int bits = 0;
    /* Lengths that leave 1, 3 or 6 characters in the last group are invalid. */
    size_t rem = len % 8;
    if (rem == 1 || rem == 3 || rem == 6)
        return -EINVAL;
    for (size_t i = 0; i < len; i++) {
        char c = in[i];
        uint32_t v;
        if (c >= 'a' && c <= 'z')
            v = (uint32_t)(c - 'a');
        else if (c >= 'A' && c <= 'Z')
            v = (uint32_t)(c - 'A');
        else if (c >= '2' && c <= '7')
            v = (uint32_t)(c - '2' + 26);
        else
            return -EINVAL;
        acc = (acc << 5) | v;
        bits += 5;
        if (bits >= 8) {
            if (o >= out_cap)
                return -EMSGSIZE;
            out[o++] = (uint8_t)(acc >> (bits - 8));
            bits -= 8;
        }
    }
    /* Leftover bits must be zero so that every id has one spelling. */
    if (bits > 0 && (acc & ((1u << bits) - 1)) != 0)
        return -EINVAL;
    return (int)o;
}

/*
 * Hex goes through libsodium's constant-time codec because swarm keys and
 * other secrets pass through it: a table lookup indexed by secret nibbles
 * leaks them through the cache.
 */
void hm_hex_encode(const uint8_t *in, size_t len, char *out)
{
    sodium_bin2hex(out, 2 * len + 1, in, len);
}

int hm_hex_decode(const char *in, size_t in_len, uint8_t *out, size_t out_len)
{
    size_t got = 0;

    if (in_len != 2 * out_len)
        return -EINVAL;
    /* No characters are ignored and the whole input must be digits (hex_end NULL). */
    if (sodium_hex2bin(out, out_len, in, in_len, NULL, &got, NULL) != 0 || got != out_len)
        return -EINVAL;
    return 0;
}

int hm_write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -errno;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int hm_fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int result = fsync(fd) != 0 && errno != EINVAL ? -errno : 0;
    close(fd);
    return result;
}

int hm_fsync_parent(const char *path)
{
    char dir[PATH_MAX];
    if (hm_strlcpy(dir, path, sizeof(dir)) < 0)
        return -ENAMETOOLONG;
    char *slash = strrchr(dir, '/');
    if (slash == NULL)
        hm_strlcpy(dir, ".", sizeof(dir));
    else if (slash == dir)
        dir[1] = '\0';
    else
        *slash = '\0';
    return hm_fsync_dir(dir);
}

void hm_errf(char *err, size_t errlen, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

int hm_strlcpy(char *dst, const char *src, size_t cap)
{
    if (cap == 0)
        return -EMSGSIZE;
    size_t n = strlen(src);
    if (n >= cap) {
        memcpy(dst, src, cap - 1);
        dst[cap - 1] = '\0';
        return -EMSGSIZE;
    }
    memcpy(dst, src, n + 1);
    return 0;
}

void hm_strbuf_printf(hm_strbuf *b, const char *fmt, ...)
{
    if (b->err)
        return;
    for (;;) {
        size_t avail = b->cap - b->len;
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? avail : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->err = -EINVAL;
            return;
        }
        if (b->p != NULL && (size_t)n < avail) {
            b->len += (size_t)n;
            return;
        }
        size_t ncap = b->cap ? b->cap : 256;
        while (ncap < b->len + (size_t)n + 1)
            ncap *= 2;
        char *np = realloc(b->p, ncap);
        if (np == NULL) {
            b->err = -ENOMEM;
            return;
        }
        b->p = np;
        b->cap = ncap;
    }
}

char *hm_strbuf_finish(hm_strbuf *b)
{
    if (b->err) {
        free(b->p);
        b->p = NULL;
        return NULL;
    }
    if (b->p == NULL) {
        b->p = malloc(1);
        if (b->p == NULL)
            return NULL;
        b->p[0] = '\0';
    }
    char *r = b->p;
    b->p = NULL;
    b->len = b->cap = 0;
    return r;
}

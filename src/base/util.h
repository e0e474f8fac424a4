/*
 * util: logging, clocks, address parsing and small encodings shared by every
 * module. It owns nothing but the process-wide log level and log sink, which
 * are configuration of the process rather than state of any node.
 *
 * Error convention for the whole project: functions return 0 (or a
 * non-negative count) on success and a negative errno value on failure.
 * Codes with a project-specific meaning:
 *   -EINVAL    bad argument or malformed input
 *   -EMSGSIZE  input or output over a size cap
 *   -EBADMSG   authentication failed (bad MAC or signature)
 *   -EPROTO    well-formed but violates the protocol
 *   -EALREADY  replayed datagram
 *   -ESTALE    datagram timestamp outside the accepted window
 *   -EPERM     peer is not who it claims, or is of another swarm
 *   -ETIMEDOUT deadline passed
 *   -ECANCELED call cancelled by the caller or by shutdown
 *   -ENOBUFS   a queue or in-flight bound was hit (backpressure)
 */
#ifndef HM_UTIL_H
#define HM_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdarg.h>
#include <sys/queue.h>
#include <sys/socket.h>

/*
 * Lists are <sys/queue.h> (LIST, SLIST, STAILQ, TAILQ). glibc's copy lacks
 * the _SAFE walks, which let the body unlink and free the element it stands
 * on; they are defined here, once, as the BSDs define them.
 */
#ifndef LIST_FOREACH_SAFE
#define LIST_FOREACH_SAFE(var, head, field, tvar)                              \
    for ((var) = LIST_FIRST(head); (var) != NULL && ((tvar) = LIST_NEXT(var, field), 1); \
         (var) = (tvar))
#endif
#ifndef SLIST_FOREACH_SAFE
#define SLIST_FOREACH_SAFE(var, head, field, tvar)                             \
    for ((var) = SLIST_FIRST(head); (var) != NULL && ((tvar) = SLIST_NEXT(var, field), 1); \
         (var) = (tvar))
#endif
#ifndef STAILQ_FOREACH_SAFE
#define STAILQ_FOREACH_SAFE(var, head, field, tvar)                            \
    for ((var) = STAILQ_FIRST(head); (var) != NULL && ((tvar) = STAILQ_NEXT(var, field), 1); \
         (var) = (tvar))
#endif
#ifndef TAILQ_FOREACH_SAFE
#define TAILQ_FOREACH_SAFE(var, head, field, tvar)                             \
    for ((var) = TAILQ_FIRST(head); (var) != NULL && ((tvar) = TAILQ_NEXT(var, field), 1); \
         (var) = (tvar))
#endif

#define HM_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define HM_MIN(a, b) ((a) < (b) ? (a) : (b))
#define HM_MAX(a, b) ((a) > (b) ? (a) : (b))
#define HM_UNUSED(x) ((void)(x))

enum hm_log_level {
    HM_LOG_ERROR = 0,
    HM_LOG_WARN = 1,
    HM_LOG_INFO = 2,
    HM_LOG_DEBUG = 3,
};

/*
 * Switches the log lines to the journal's form ("<N>" priority, no
 * timestamp) when stderr is the stream JOURNAL_STREAM names; returns 1 if
 * so. Main programs call it once at start.
 */
int hm_log_detect_journal(void);

/* Sets the level below which messages are dropped; default HM_LOG_INFO. */
void hm_log_set_level(int level);
int hm_log_get_level(void);
/* Parses "error", "warn", "info", "debug"; returns the level or -EINVAL. */
int hm_log_parse_level(const char *name);
const char *hm_log_level_name(int level);
void hm_log(int level, const char *module, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define hm_error(mod, ...) hm_log(HM_LOG_ERROR, mod, __VA_ARGS__)
#define hm_warn(mod, ...) hm_log(HM_LOG_WARN, mod, __VA_ARGS__)
#define hm_info(mod, ...) hm_log(HM_LOG_INFO, mod, __VA_ARGS__)
#define hm_debug(mod, ...)                                                     \
    do {                                                                       \
        if (hm_log_get_level() >= HM_LOG_DEBUG)                                \
            hm_log(HM_LOG_DEBUG, mod, __VA_ARGS__);                            \
    } while (0)

/* Monotonic clock in milliseconds / microseconds. */
uint64_t hm_now_ms(void);
uint64_t hm_now_us(void);
/* Wall clock (UNIX epoch) in microseconds. */
uint64_t hm_wall_us(void);

/* strerror for our negative codes. */
const char *hm_strerror(int err);

/*
 * Parses "HOST:PORT" or "[V6HOST]:PORT" (numeric hosts only: no DNS on the
 * loop thread). Returns 0 or -EINVAL.
 */
int hm_parse_hostport(const char *s, struct sockaddr_storage *out);

/* The longest host name hm_split_hostport takes (RFC 1035's 253 octets). */
#define HM_HOSTNAME_MAX 253
/*
 * Splits "HOST:PORT" or "[V6HOST]:PORT" where HOST may also be a DNS name
 * (labels of letters, digits and '-', 1 to 63 octets each, at most
 * HM_HOSTNAME_MAX in all, an optional final dot). host gets the host
 * without brackets (hostlen >= HM_HOSTNAME_MAX + 1), port_out the port.
 * Returns 0, or -EINVAL naming nothing (callers say which half is wrong).
 * Resolves nothing.
 */
int hm_split_hostport(const char *s, char *host, size_t hostlen, unsigned *port_out);
/*
 * Resolves s (as hm_split_hostport takes it) to one address: a numeric host
 * at once, a name with getaddrinfo, which blocks; so call it before the loop
 * runs or on a worker, never on the loop thread. IPv4 answers come before
 * IPv6 ones, so a name with both gives the address most peers can dial.
 * Returns 0, -EINVAL (bad syntax) or -EHOSTUNREACH (the name does not
 * resolve; why gets getaddrinfo's reason).
 */
int hm_resolve_hostport(const char *s, struct sockaddr_storage *out, char *why, size_t whylen);
/* Formats an address as HOST:PORT ([v6]:port for IPv6). */
int hm_format_addr(const struct sockaddr *sa, char *buf, size_t len);
#define HM_ADDRSTRLEN 64
/* Compares address family, host and port. */
int hm_addr_equal(const struct sockaddr *a, const struct sockaddr *b);
socklen_t hm_addr_len(const struct sockaddr *sa);
/* Whether ss could be dialled by a peer at all: IPv4 or IPv6, not 0.0.0.0
 * or ::, not port 0. 0 or -EINVAL. */
int hm_addr_dialable(const struct sockaddr_storage *ss);

/*
 * RFC 4648 base32, lowercase, no padding. Returns the number of characters
 * written (not counting the NUL) or -EMSGSIZE.
 */
int hm_base32_encode(const uint8_t *in, size_t len, char *out, size_t out_cap);
/* Returns bytes written, -EINVAL on a bad character or length. */
int hm_base32_decode(const char *in, size_t len, uint8_t *out, size_t out_cap);

/* Lowercase hex, in constant time (libsodium); out must hold 2*len+1. */
void hm_hex_encode(const uint8_t *in, size_t len, char *out);
/* Returns 0 or -EINVAL; accepts exactly 2*out_len hex digits of either case, in constant time. */
int hm_hex_decode(const char *in, size_t in_len, uint8_t *out, size_t out_len);

/*
 * Growing string buffer for text output (metrics, tables). An allocation
 * failure sets err and later appends are ignored; check it once at the end.
 */
typedef struct hm_strbuf {
    char *p;
    size_t len, cap;
    int err;
} hm_strbuf;
void hm_strbuf_printf(hm_strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Returns the string (caller frees) or NULL after an allocation failure. */
char *hm_strbuf_finish(hm_strbuf *b);

/* Bounded string copy that always terminates; returns -EMSGSIZE if cut. */
int hm_strlcpy(char *dst, const char *src, size_t cap);

/*
 * Formats a sentence into err (errlen bytes, truncated; nothing when err is
 * NULL or errlen 0): the one way modules fill an "err, errlen" pair.
 */
void hm_errf(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Writes all len bytes to fd, retrying short writes and EINTR; 0 or -errno. */
int hm_write_all(int fd, const void *buf, size_t len);

/*
 * fsync of a directory, which makes the creation or rename of an entry in it
 * durable: 0 or -errno. A filesystem that cannot sync a directory (EINVAL)
 * counts as done, since there is nothing more to ask of it.
 */
int hm_fsync_dir(const char *dir);
/* The same for the directory that holds path. */
int hm_fsync_parent(const char *path);

/* Big-endian integers in byte buffers (wire and file headers). */
static inline void hm_put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static inline uint32_t hm_get_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static inline void hm_put_be64(uint8_t *p, uint64_t v)
{
    hm_put_be32(p, (uint32_t)(v >> 32));
    hm_put_be32(p + 4, (uint32_t)v);
}

static inline uint64_t hm_get_be64(const uint8_t *p)
{
    return (uint64_t)hm_get_be32(p) << 32 | hm_get_be32(p + 4);
}

#endif

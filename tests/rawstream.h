/*
 * rawstream: an authenticated stream peer that writes the transport's
 * framing by hand (src/net/transport.c: u32 message id, u8 flags, u32 total
 * on a first chunk, then data), so a test can send what the transport
 * itself never would: first chunks that declare 80 MiB and never continue,
 * messages left halfway. It does the real handshake (crypto.h) under its
 * own identity from a chosen source address (each 127.x.y.z is its own
 * origin) and never reads what the other side sends.
 *
 * While it waits (connect, handshake, a full socket) it calls spin(ud), so
 * a test can keep its in-process victim's loop turning; spin NULL sleeps.
 */
#ifndef HM_TEST_RAWSTREAM_H
#define HM_TEST_RAWSTREAM_H

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "src/base/crypto.h"
#include "src/base/util.h"

typedef struct hm_raw {
    int fd;
    hm_identity id;
    hm_session sess;
    void (*spin)(void *ud);
    void *ud;
} hm_raw;

static inline void hm_raw_wait(hm_raw *r)
{
    if (r->spin != NULL)
        r->spin(r->ud);
    else
        usleep(1000);
}

/* Writes all of p, waiting while the socket is full. 0 or -errno. */
static inline int hm_raw_write(hm_raw *r, const uint8_t *p, size_t n, uint64_t timeout_ms)
{
    uint64_t end = hm_now_ms() + timeout_ms;
    while (n > 0) {
        ssize_t w = send(r->fd, p, n, MSG_NOSIGNAL);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            return -errno;
        if (hm_now_ms() > end)
            return -ETIMEDOUT;
        hm_raw_wait(r);
    }
    return 0;
}

/*
 * Connects from src_ip to `to` (a server with key server_pk in swarm) and
 * completes the handshake. rcvbuf, when not 0, shrinks our receive buffer
 * (SO_RCVBUF) before connecting, as a reader that wants the other side to
 * keep its replies in its own memory rather than in the kernel would.
 * Returns 0 or a negative code.
 */
static inline int hm_raw_connect_as(hm_raw *r, const hm_identity *id, const char *src_ip,
                                    const struct sockaddr *to,
                                    const uint8_t server_pk[HM_PK_BYTES],
                                    const uint8_t swarm[HM_SWARM_ID_BYTES], int rcvbuf,
                                    void (*spin)(void *), void *ud);

static inline int hm_raw_connect(hm_raw *r, const char *src_ip, const struct sockaddr *to,
                                 const uint8_t server_pk[HM_PK_BYTES],
                                 const uint8_t swarm[HM_SWARM_ID_BYTES], int rcvbuf,
                                 void (*spin)(void *), void *ud)
{
    return hm_raw_connect_as(r, NULL, src_ip, to, server_pk, swarm, rcvbuf, spin, ud);
}

/*
 * The same under a given identity (NULL: a fresh one), such as a node's own
 * key, as that node's second connection (a reachability probe's, say) would.
 */
static inline int hm_raw_connect_as(hm_raw *r, const hm_identity *id, const char *src_ip,
                                    const struct sockaddr *to,
                                    const uint8_t server_pk[HM_PK_BYTES],
                                    const uint8_t swarm[HM_SWARM_ID_BYTES], int rcvbuf,
                                    void (*spin)(void *), void *ud)
{
    int rc = 0;
    memset(r, 0, sizeof(*r));
    r->spin = spin;
    r->ud = ud;
    if (id != NULL)
        r->id = *id;
    else
        rc = hm_identity_generate(&r->id);
    if (rc < 0)
        return rc;
    r->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (r->fd < 0)
        return -errno;
    struct sockaddr_in src = {.sin_family = AF_INET};
    inet_pton(AF_INET, src_ip, &src.sin_addr);
    if (rcvbuf > 0)
        setsockopt(r->fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    if (bind(r->fd, (struct sockaddr *)&src, sizeof(src)) < 0)
        return -errno;
    if (connect(r->fd, to, hm_addr_len(to)) < 0 && errno != EINPROGRESS)
        return -errno;
    uint64_t end = hm_now_ms() + 5000;
    for (;;) {
        struct pollfd pf = {.fd = r->fd, .events = POLLOUT};
        if (poll(&pf, 1, 0) == 1)
            break;
        if (hm_now_ms() > end)
            return -ETIMEDOUT;
        hm_raw_wait(r);
    }
    int err = 0;
    socklen_t el = sizeof(err);
    getsockopt(r->fd, SOL_SOCKET, SO_ERROR, &err, &el);
    if (err != 0)
        return -err;

    hm_handshake hs;
    hm_hs_init_client(&hs, &r->id, swarm, server_pk);
    uint8_t in[512];
    size_t have = 0;
    for (;;) {
        if (hs.out_len > 0) {
            rc = hm_raw_write(r, hs.out, hs.out_len, 5000);
            hs.out_len = 0;
            if (rc < 0)
                return rc;
        }
        ssize_t n = recv(r->fd, in + have, sizeof(in) - have, 0);
        if (n == 0)
            return -ECONNRESET;
        if (n < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                return -errno;
            if (hm_now_ms() > end)
                return -ETIMEDOUT;
            hm_raw_wait(r);
            continue;
        }
        have += (size_t)n;
        size_t used = 0;
        rc = hm_hs_input(&hs, in, have, &used);
        memmove(in, in + used, have - used);
        have -= used;
        if (rc < 0)
            return rc;
        if (rc == 1) {
            if (hs.out_len > 0) {
                rc = hm_raw_write(r, hs.out, hs.out_len, 5000);
                if (rc < 0)
                    return rc;
            }
            hm_hs_finish(&hs, &r->sess);
            return 0;
        }
    }
}

/*
 * Sends one chunk: message id, flags (1 first, 2 last), the declared total
 * (first chunks only) and n bytes of data (n <= 16000). 0 or -errno.
 */
static inline int hm_raw_chunk(hm_raw *r, uint32_t id, uint8_t flags, uint32_t total,
                               const void *data, size_t n)
{
    uint8_t pt[HM_REC_MAX_PLAIN], rec[HM_REC_MAX_PLAIN + HM_REC_OVERHEAD];
    size_t hdr = 5;
    hm_put_be32(pt, id);
    pt[4] = flags;
    if (flags & 1u) {
        hm_put_be32(pt + 5, total);
        hdr = 9;
    }
    if (n > 0)
        memcpy(pt + hdr, data, n);
    size_t len = 0;
    int rc = hm_session_seal(&r->sess, pt, hdr + n, rec, &len);
    if (rc < 0)
        return rc;
    return hm_raw_write(r, rec, len, 10000);
}

/* Sends `bytes` of message id (declared total) from offset off, in chunks, first if off is 0. */
static inline int hm_raw_part(hm_raw *r, uint32_t id, uint32_t total, size_t off, size_t bytes)
{
    static const uint8_t zeros[16000];
    while (bytes > 0) {
        size_t n = bytes < sizeof(zeros) ? bytes : sizeof(zeros);
        uint8_t flags = (uint8_t)((off == 0 ? 1u : 0u) | (off + n == total ? 2u : 0u));
        int rc = hm_raw_chunk(r, id, flags, total, zeros, n);
        if (rc < 0)
            return rc;
        off += n;
        bytes -= n;
    }
    return 0;
}

static inline void hm_raw_close(hm_raw *r)
{
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
    hm_session_wipe(&r->sess);
    hm_identity_wipe(&r->id);
}

#endif

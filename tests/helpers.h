/*
 * helpers: small things the Criterion tests share: temporary directories
 * that clean up after themselves, writing a file in one call, and a
 * blocking Unix-socket client with a deadline for talking to control
 * sockets. Everything is static so each test binary takes what it uses.
 */
#ifndef HM_TEST_HELPERS_H
#define HM_TEST_HELPERS_H

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static inline long hm_test_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Makes a fresh directory under /tmp; buf must hold 64 bytes. */
static inline int hm_test_mkdtemp(char *buf, size_t len, const char *tag)
{
    snprintf(buf, len, "/tmp/hm-%s-XXXXXX", tag);
    return mkdtemp(buf) ? 0 : -errno;
}

static inline int hm_test_rm_entry(const char *path, const struct stat *st, int flag,
                                   struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

static inline void hm_test_rmtree(const char *dir)
{
    if (dir != NULL && dir[0] != '\0')
        nftw(dir, hm_test_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static inline int hm_test_write_file(const char *path, const void *data, size_t len, int mode)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    if (fd < 0)
        return -errno;
    const char *p = data;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            int e = errno;
            close(fd);
            return -e;
        }
        p += w;
        len -= (size_t)w;
    }
    close(fd);
    return 0;
}

/* Connects a blocking client to a Unix socket; returns the fd or -errno. */
static inline int hm_test_unix_connect(const char *path)
{
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof(sa.sun_path))
        return -ENAMETOOLONG;
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        int e = errno;
        close(fd);
        return -e;
    }
    return fd;
}

static inline int hm_test_send_all(int fd, const void *data, size_t len)
{
    const char *p = data;
    while (len > 0) {
        ssize_t w = send(fd, p, len, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

/*
 * Reads one line (without the newline) into buf, waiting at most
 * timeout_ms. Returns the length, 0 with buf "" on EOF before any byte,
 * -ETIMEDOUT, -EMSGSIZE or -errno. Reads one byte at a time so that nothing
 * after the newline is consumed (tests are small).
 */
static inline int hm_test_read_line(int fd, char *buf, size_t cap, int timeout_ms)
{
    size_t n = 0;
    long deadline = hm_test_now_ms() + timeout_ms;
    buf[0] = '\0';
    for (;;) {
        long left = deadline - hm_test_now_ms();
        if (left <= 0)
            return -ETIMEDOUT;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int pr = poll(&pfd, 1, (int)left);
        if (pr < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (pr == 0)
            return -ETIMEDOUT;
        char ch;
        ssize_t r = recv(fd, &ch, 1, 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0) {
            buf[n] = '\0';
            return n == 0 ? 0 : -EPIPE;
        }
        if (ch == '\n') {
            buf[n] = '\0';
            return (int)n;
        }
        if (n + 1 >= cap)
            return -EMSGSIZE;
        buf[n++] = ch;
    }
}

/* Waits until the peer closes the connection; 0, -ETIMEDOUT or -errno. */
static inline int hm_test_wait_eof(int fd, int timeout_ms)
{
    long deadline = hm_test_now_ms() + timeout_ms;
    char tmp[4096];
    for (;;) {
        long left = deadline - hm_test_now_ms();
        if (left <= 0)
            return -ETIMEDOUT;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int pr = poll(&pfd, 1, (int)left);
        if (pr < 0 && errno != EINTR)
            return -errno;
        if (pr <= 0)
            continue;
        ssize_t r = recv(fd, tmp, sizeof(tmp), 0);
        if (r == 0)
            return 0;
        if (r < 0 && errno == ECONNRESET)
            return 0;
        if (r < 0 && errno != EINTR)
            return -errno;
    }
}

#endif

/*
 * tensor_file: reading and writing the raw float32 files of control
 * commands off the loop thread, with atomic writes (tensor_file.h).
 */
#include "config.h"

#include "src/daemon/tensor_file.h"
#include "src/base/util.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MOD "tensor_file"
/* Big-endian hosts swap through a bounce buffer of this many floats, so
 * that a write never changes the caller's data. */
#define SWAP_CHUNK 16384

typedef struct tf_req {
    uv_work_t work;
    char path[PATH_MAX];
    hm_tensor_file_read_opts ro;
    hm_tensor_file_read_cb read_cb;
    hm_tensor_file_write_cb write_cb;
    void *ud;
    float *data;       /* read: what the worker read; write: the caller's */
    size_t n;
    char expect[256];  /* a copy of ro.expect: the caller's text may be gone */
    int status;        /* set by the worker */
    char msg[HM_TENSOR_FILE_MSG_MAX];
} tf_req;

static int is_big_endian(void)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return 1;
#else
    return 0;
#endif
}

static void swap32(float *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &p[i], 4);
        u = __builtin_bswap32(u);
        memcpy(&p[i], &u, 4);
    }
}

/* ---- reading ---- */

int hm_tensor_file_load(const char *path, const hm_tensor_file_read_opts *o, float **data_out,
                        size_t *n_out, char *msg, size_t msglen)
{
    struct stat st;
    float *data = NULL;
    size_t got = 0, row = o->row > 1 ? o->row : 1;
    int result = 0;
    if (o->max_bytes == 0) {
        snprintf(msg, msglen, "reading %s: no bound on its size was given", path);
        return -EINVAL;
    }
    /* O_NONBLOCK: opening a FIFO must not hang the worker; it is refused below. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) {
        result = -errno;
        snprintf(msg, msglen, "cannot open %s: %s", path, strerror(errno));
        return result;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        result = -EINVAL;
        snprintf(msg, msglen, "%s is not a regular file", path);
        goto out;
    }
    uint64_t size = (uint64_t)st.st_size;
    int over = size > o->max_bytes || size > SIZE_MAX / 2;
    if (st.st_size <= 0 || over || size % (row * sizeof(float)) != 0) {
        result = over ? -EFBIG : -EINVAL;
        if (o->expect != NULL)
            snprintf(msg, msglen, "%s holds %lld bytes: expected %s", path,
                     (long long)st.st_size, o->expect);
        else
            snprintf(msg, msglen, "%s holds %lld bytes: expected a positive whole number of "
                     "rows of %zu float32, at most %zu bytes", path, (long long)st.st_size, row,
                     o->max_bytes);
        goto out;
    }
    data = malloc((size_t)size);
    if (data == NULL) {
        result = -ENOMEM;
        snprintf(msg, msglen, "out of memory for %lld bytes", (long long)st.st_size);
        goto out;
    }
    while (got < (size_t)size) {
        ssize_t r = read(fd, (char *)data + got, (size_t)size - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            result = r < 0 ? -errno : -EIO;
            snprintf(msg, msglen, "reading %s: %s", path,
                     r < 0 ? strerror(errno) : "the file shrank while being read");
            goto out;
        }
        got += (size_t)r;
    }
    size_t n = (size_t)size / sizeof(float);
    if (is_big_endian())
        swap32(data, n);
    for (size_t i = 0; o->finite && i < n; i++) {
        if (!isfinite(data[i])) {
            result = -EDOM;
            snprintf(msg, msglen, "%s: element %zu is not a finite number", path, i);
            goto out;
        }
    }
    *data_out = data;
    *n_out = n;
    data = NULL;
out:
    free(data);
    close(fd);
    return result;
}

static void read_work(uv_work_t *w)
{
    tf_req *q = w->data;
    q->status = hm_tensor_file_load(q->path, &q->ro, &q->data, &q->n, q->msg, sizeof(q->msg));
}

static void after_read(uv_work_t *w, int status)
{
    tf_req *q = w->data;
    /* libuv reports a failure of its own only for cancelled work, which this
     * module never asks for; it is still an answer the caller must get. */
    if (status != 0 && q->status == 0) {
        free(q->data);
        q->data = NULL;
        q->status = status;
        snprintf(q->msg, sizeof(q->msg), "reading %s: %s", q->path, uv_strerror(status));
    }
    q->read_cb(q->ud, q->status, q->status == 0 ? q->data : NULL, q->status == 0 ? q->n : 0,
               q->msg);
    free(q);
}

/* ---- writing ---- */

static int write_floats(int fd, const float *data, size_t n)
{
    if (!is_big_endian())
        return hm_write_all(fd, data, n * sizeof(float));
    float *bounce = malloc(SWAP_CHUNK * sizeof(float));
    int result = bounce == NULL ? -ENOMEM : 0;
    for (size_t i = 0; result == 0 && i < n; i += SWAP_CHUNK) {
        size_t k = HM_MIN((size_t)SWAP_CHUNK, n - i);
        memcpy(bounce, data + i, k * sizeof(float));
        swap32(bounce, k);
        result = hm_write_all(fd, bounce, k * sizeof(float));
    }
    free(bounce);
    return result;
}

int hm_tensor_file_store(const char *path, const float *data, size_t n, char *msg,
                         size_t msglen)
{
    char tmp[PATH_MAX + 16];
    int result = 0;

    if (snprintf(tmp, sizeof(tmp), "%s.XXXXXX", path) >= (int)sizeof(tmp)) {
        snprintf(msg, msglen, "output path too long");
        return -ENAMETOOLONG;
    }
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        result = -errno;
        snprintf(msg, msglen, "cannot create a file next to %s: %s", path, strerror(errno));
        return result;
    }
    result = write_floats(fd, data, n);
    if (result == 0 && (fchmod(fd, 0644) != 0 || fsync(fd) != 0))
        result = -errno;
    if (close(fd) != 0 && result == 0)
        result = -errno;
    if (result == 0 && rename(tmp, path) != 0)
        result = -errno;
    if (result != 0) {
        unlink(tmp);
        snprintf(msg, msglen, "writing %s: %s", path, strerror(-result));
        return result;
    }
    /* The file is in place: from here on the write has happened, so the
     * directory's fsync (which makes the rename itself survive a crash) is
     * best effort. A directory the daemon may write but not read cannot be
     * opened for it, and reporting an error for a file that was written
     * would have the caller think the old one is still there. */
    result = hm_fsync_parent(path);
    if (result != 0)
        hm_warn(MOD, "wrote %s, but cannot sync its directory: %s", path, strerror(-result));
    return 0;
}

static void write_work(uv_work_t *w)
{
    tf_req *q = w->data;
    q->status = hm_tensor_file_store(q->path, q->data, q->n, q->msg, sizeof(q->msg));
}

static void after_write(uv_work_t *w, int status)
{
    tf_req *q = w->data;
    if (status != 0 && q->status == 0) {
        q->status = status;
        snprintf(q->msg, sizeof(q->msg), "writing %s: %s", q->path, uv_strerror(status));
    }
    q->write_cb(q->ud, q->status, q->msg);
    free(q);
}

/* ---- requests ---- */

static int new_req(const char *path, void *ud, tf_req **q_out)
{
    if (strlen(path) >= PATH_MAX)
        return -ENAMETOOLONG;
    tf_req *q = calloc(1, sizeof(*q));
    if (q == NULL)
        return -ENOMEM;
    hm_strlcpy(q->path, path, sizeof(q->path));
    q->work.data = q;
    q->ud = ud;
    *q_out = q;
    return 0;
}

/* Queues q; on failure q is freed and its callback never fires. */
static int submit(uv_loop_t *loop, tf_req *q, uv_work_cb work, uv_after_work_cb after)
{
    int result = uv_queue_work(loop, &q->work, work, after);
    if (result != 0)
        free(q);
    return result;
}

int hm_tensor_file_read(uv_loop_t *loop, const char *path, const hm_tensor_file_read_opts *o,
                        hm_tensor_file_read_cb cb, void *ud)
{
    tf_req *q = NULL;
    if (o == NULL || o->max_bytes == 0 || cb == NULL)
        return -EINVAL;
    int result = new_req(path, ud, &q);
    if (result != 0)
        return result;
    q->ro = *o;
    q->ro.expect = NULL;
    if (o->expect != NULL) {
        hm_strlcpy(q->expect, o->expect, sizeof(q->expect));
        q->ro.expect = q->expect;
    }
    q->read_cb = cb;
    return submit(loop, q, read_work, after_read);
}

int hm_tensor_file_write(uv_loop_t *loop, const char *path, const float *data, size_t n,
                         hm_tensor_file_write_cb cb, void *ud)
{
    tf_req *q = NULL;
    if (data == NULL || n == 0 || n > SIZE_MAX / sizeof(float) || cb == NULL)
        return -EINVAL;
    int result = new_req(path, ud, &q);
    if (result != 0)
        return result;
    q->data = (float *)data;
    q->n = n;
    q->write_cb = cb;
    return submit(loop, q, write_work, after_write);
}

/*
 * tensor_file: the one reader and writer of the tensor files that control
 * commands take (average, experts.call). A tensor file is raw
 * little-endian float32 with no header; its size says how many values it
 * holds. It owns nothing but the requests in flight, each of which it
 * frees after its callback.
 *
 * Reads and writes run on libuv's threadpool (uv_queue_work), never on the
 * loop thread, because a file can be hundreds of MiB on a slow disk. A read
 * refuses anything but a regular file (a FIFO is opened non-blocking, so it
 * cannot hang a worker), a size outside the caller's bound or not a whole
 * number of rows, and, when asked, NaN and infinity. A write is atomic: the
 * data goes to a temporary file with a unique name (mkostemp) in the target
 * directory, which is fsynced and renamed over the target, and then the
 * directory is fsynced so that the rename survives a crash too (best effort:
 * once the rename is done the write has happened, and a directory that cannot
 * be synced, say one the daemon may write but not read, is logged, not an
 * error); on any failure before the rename the temporary file is removed and
 * an old file at the target stays as it was. The file gets mode 0644 (readable by the trainer that asked for
 * it even when the daemon runs as another user of its group).
 *
 * Callbacks run on the loop thread. If hm_tensor_file_read or _write
 * returns 0 its callback fires exactly once, also while the daemon shuts
 * down: libuv keeps the loop running until queued work is over, so a
 * command whose file is being read or written when the shutdown begins
 * sees its callback and can answer "stopping" (or deliver the file) then.
 * A request cannot be cancelled once queued; callers check their own
 * "closing" state in the callback.
 */
#ifndef HM_DAEMON_TENSOR_FILE_H
#define HM_DAEMON_TENSOR_FILE_H

#include <limits.h>
#include <stddef.h>
#include <uv.h>

/* Room for any error message of this module (a path and a sentence). */
#define HM_TENSOR_FILE_MSG_MAX (PATH_MAX + 160)

typedef struct hm_tensor_file_read_opts {
    size_t row;          /* the file holds a positive whole number of rows of this many
                          * floats (0 or 1: any positive number of floats) */
    size_t max_bytes;    /* the largest file accepted; required (above 0), so
                          * that no command reads a file of any size */
    int finite;          /* refuse NaN and infinity */
    const char *expect;  /* the size the command expects, in words, for the error
                          * "PATH holds N bytes: expected EXPECT" (NULL: generic) */
} hm_tensor_file_read_opts;

/*
 * status 0: data holds n floats (n > 0), in host byte order; the callback
 * owns data (free()). Otherwise data is NULL and msg says why, naming the
 * path: -ENOENT and other -errno values (cannot open or read), -EINVAL (not
 * a regular file, or a size that is not rows), -EFBIG (over max_bytes),
 * -EDOM (a value is not finite), -EIO (the file shrank while being read),
 * -ENOMEM.
 */
typedef void (*hm_tensor_file_read_cb)(void *ud, int status, float *data, size_t n,
                                       const char *msg);

/* status 0, or a negative code with msg naming the path and the reason. */
typedef void (*hm_tensor_file_write_cb)(void *ud, int status, const char *msg);

/*
 * Reads path (absolute, less than PATH_MAX bytes) on the threadpool of
 * loop. 0, or -ENAMETOOLONG, -EINVAL (no callback, or max_bytes 0),
 * -ENOMEM, or libuv's code; the callback then never fires.
 */
int hm_tensor_file_read(uv_loop_t *loop, const char *path, const hm_tensor_file_read_opts *o,
                        hm_tensor_file_read_cb cb, void *ud);

/*
 * Writes the n floats at data (n > 0) to path atomically, on the
 * threadpool of loop. data must stay valid and unchanged until the
 * callback. Returns as hm_tensor_file_read.
 */
int hm_tensor_file_write(uv_loop_t *loop, const char *path, const float *data, size_t n,
                         hm_tensor_file_write_cb cb, void *ud);

/*
 * The same work on the calling thread, which is what the workers run;
 * for tests and for callers that are already off the loop. msg (msglen
 * bytes, HM_TENSOR_FILE_MSG_MAX is enough) gets the sentence on failure.
 */
int hm_tensor_file_load(const char *path, const hm_tensor_file_read_opts *o, float **data_out,
                        size_t *n_out, char *msg, size_t msglen);
int hm_tensor_file_store(const char *path, const float *data, size_t n, char *msg,
                         size_t msglen);

#endif

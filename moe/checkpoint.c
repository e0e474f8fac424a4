/*
 * checkpoint: atomic, verified files for state that must survive a crash
 * (expert parameters and optimizer moments). A write goes to PATH.tmp, is
 * fsync'd, rotates the current PATH to PATH.prev (when PATH verifies),
 * renames PATH.tmp over PATH and fsyncs the directory; a read verifies the header and BLAKE2b-256 hash
 * and falls back to PATH.prev. Owns nothing between calls.
 */
#include "config.h"

#include "moe/checkpoint.h"
#include "src/base/util.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CKPT_MAGIC "HMCK"
#define CKPT_VERSION 1
#define CKPT_HASH_BYTES 32
/* read() and write() move at most this much per call, whatever they are asked for. */
#define IO_CHUNK ((size_t)1 << 30)
/* Verifying a file before it is rotated reads it through a buffer of this size. */
#define VERIFY_CHUNK ((size_t)1 << 20)

static void hash_payload(uint8_t out[CKPT_HASH_BYTES], const void *payload, size_t len)
{
    /* BLAKE2b needs no key and no sodium_init: the portable code path is always there. */
    crypto_generichash(out, CKPT_HASH_BYTES, payload, (unsigned long long)len, NULL, 0);
}

static void make_header(uint8_t hdr[HM_CKPT_HEADER_BYTES], const void *payload, size_t len)
{
    memcpy(hdr, CKPT_MAGIC, 4);
    hm_put_be32(hdr + 4, CKPT_VERSION);
    hm_put_be64(hdr + 8, (uint64_t)len);
    hash_payload(hdr + 16, payload, len);
}

/*
 * Checks a header against the file's length; the hash is checked by the
 * caller once the payload is at hand. *plen_out gets the declared payload
 * length. 0, -EBADMSG or -EMSGSIZE.
 */
static int check_header(const uint8_t *hdr, uint64_t file_len, size_t max_len, size_t *plen_out)
{
    uint64_t plen;

    if (file_len < HM_CKPT_HEADER_BYTES)
        return -EBADMSG;
    if (memcmp(hdr, CKPT_MAGIC, 4) != 0 || hm_get_be32(hdr + 4) != CKPT_VERSION)
        return -EBADMSG;
    plen = hm_get_be64(hdr + 8);
    /*
     * A length that disagrees with the file is corruption, whatever its
     * value; only a consistent file that is too large is -EMSGSIZE (a
     * checkpoint of a larger expert, say).
     */
    if (plen != file_len - HM_CKPT_HEADER_BYTES)
        return -EBADMSG;
    if (plen > max_len)
        return -EMSGSIZE;
    *plen_out = (size_t)plen;
    return 0;
}

int hm_ckpt_parse(const uint8_t *file, size_t len, size_t max_len, const uint8_t **payload_out,
                  size_t *payload_len_out)
{
    uint8_t hash[CKPT_HASH_BYTES];
    size_t plen;
    int result;

    if (file == NULL || len < HM_CKPT_HEADER_BYTES)
        return -EBADMSG;
    if ((result = check_header(file, len, max_len, &plen)) < 0)
        return result;
    hash_payload(hash, file + HM_CKPT_HEADER_BYTES, plen);
    if (sodium_memcmp(hash, file + 16, CKPT_HASH_BYTES) != 0)
        return -EBADMSG;
    if (payload_out != NULL)
        *payload_out = file + HM_CKPT_HEADER_BYTES;
    if (payload_len_out != NULL)
        *payload_len_out = plen;
    return 0;
}

/* path + suffix in a malloc'd string, or NULL. */
static char *with_suffix(const char *path, const char *suffix)
{
    size_t a = strlen(path), b = strlen(suffix);
    char *s = malloc(a + b + 1);

    if (s == NULL)
        return NULL;
    memcpy(s, path, a);
    memcpy(s + a, suffix, b + 1);
    return s;
}

/* Reads exactly len bytes; a file that ends early is corrupt (it shrank under us). */
static int read_all(int fd, uint8_t *p, size_t len)
{
    while (len > 0) {
        ssize_t n = read(fd, p, HM_MIN(len, IO_CHUNK));
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (n == 0)
            return -EBADMSG;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/*
 * Whether the file at path is a whole, verified checkpoint: header, size
 * and the hash of the payload, read back a chunk at a time. Only such a
 * file is rotated to PATH.prev; one with a good header but a bad payload
 * would otherwise push out a good PATH.prev. This reads the current file
 * once more on every write (an expert's state is tens of MiB at typical
 * sizes, a few GiB at the largest dim and hidden), which the periodic
 * checkpoints on worker threads can afford.
 */
static int looks_whole(const char *path)
{
    uint8_t hdr[HM_CKPT_HEADER_BYTES], hash[CKPT_HASH_BYTES];
    crypto_generichash_state hs;
    struct stat st;
    uint8_t *chunk = NULL;
    size_t plen, left;
    int fd, ok = 0;

    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size < HM_CKPT_HEADER_BYTES ||
        read_all(fd, hdr, sizeof(hdr)) < 0 ||
        check_header(hdr, (uint64_t)st.st_size, SIZE_MAX, &plen) < 0)
        goto out;
    if ((chunk = malloc(VERIFY_CHUNK)) == NULL)
        goto out;
    crypto_generichash_init(&hs, NULL, 0, CKPT_HASH_BYTES);
    for (left = plen; left > 0;) {
        size_t n = HM_MIN(left, VERIFY_CHUNK);
        if (read_all(fd, chunk, n) < 0)
            goto out;
        crypto_generichash_update(&hs, chunk, (unsigned long long)n);
        left -= n;
    }
    crypto_generichash_final(&hs, hash, CKPT_HASH_BYTES);
    ok = sodium_memcmp(hash, hdr + 16, CKPT_HASH_BYTES) == 0;
out:
    free(chunk);
    close(fd);
    return ok;
}

int hm_ckpt_write(const char *path, const void *payload, size_t len)
{
    uint8_t hdr[HM_CKPT_HEADER_BYTES];
    char *tmp = NULL, *prev = NULL;
    int fd = -1, tmp_made = 0, result;

    if (path == NULL || (payload == NULL && len > 0))
        return -EINVAL;
    tmp = with_suffix(path, ".tmp");
    prev = with_suffix(path, ".prev");
    if (tmp == NULL || prev == NULL) {
        result = -ENOMEM;
        goto out;
    }
    make_header(hdr, payload, len);
    /* O_TRUNC: a PATH.tmp left by an earlier crash is simply overwritten. */
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        result = -errno;
        goto out;
    }
    tmp_made = 1;
    if ((result = hm_write_all(fd, hdr, sizeof(hdr))) < 0 ||
        (result = hm_write_all(fd, payload, len)) < 0)
        goto out;
    if (fsync(fd) < 0) {
        result = -errno;
        goto out;
    }
    /* close() can report a delayed write error (NFS); it must not be lost. */
    result = close(fd) < 0 ? -errno : 0;
    fd = -1;
    if (result < 0)
        goto out;
    /*
     * A current PATH that is visibly broken is not rotated: it would
     * displace a good PATH.prev, and the rename below replaces it anyway.
     */
    if (looks_whole(path) && rename(path, prev) < 0 && errno != ENOENT) {
        result = -errno;
        goto out;
    }
    if (rename(tmp, path) < 0) {
        result = -errno;
        goto out;
    }
    tmp_made = 0;
    result = hm_fsync_parent(path);
out:
    if (fd >= 0)
        close(fd);
    if (tmp_made)
        unlink(tmp);
    free(tmp);
    free(prev);
    return result;
}

/* Reads and verifies one file. 0, -ENOENT, -EBADMSG, -EMSGSIZE, -ENOMEM or -errno. */
static int read_one(const char *path, size_t max_len, uint8_t **payload_out, size_t *len_out)
{
    uint8_t hdr[HM_CKPT_HEADER_BYTES], hash[CKPT_HASH_BYTES];
    uint8_t *buf = NULL;
    struct stat st;
    size_t plen = 0;
    int fd, result;

    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    if (fstat(fd, &st) < 0) {
        result = -errno;
        goto out;
    }
    /* Anything but a regular file (a directory, a FIFO) cannot be a checkpoint. */
    if (!S_ISREG(st.st_mode) || st.st_size < HM_CKPT_HEADER_BYTES) {
        result = -EBADMSG;
        goto out;
    }
    if ((result = read_all(fd, hdr, sizeof(hdr))) < 0)
        goto out;
    /* The declared length is checked against max_len and the file size before any allocation. */
    if ((result = check_header(hdr, (uint64_t)st.st_size, max_len, &plen)) < 0)
        goto out;
    if ((buf = malloc(plen > 0 ? plen : 1)) == NULL) {
        result = -ENOMEM;
        goto out;
    }
    if ((result = read_all(fd, buf, plen)) < 0)
        goto out;
    hash_payload(hash, buf, plen);
    if (sodium_memcmp(hash, hdr + 16, CKPT_HASH_BYTES) != 0) {
        result = -EBADMSG;
        goto out;
    }
    *payload_out = buf;
    *len_out = plen;
    buf = NULL;
    result = 0;
out:
    free(buf);
    close(fd);
    return result;
}

int hm_ckpt_read_file(const char *path, size_t max_len, uint8_t **payload_out, size_t *len_out)
{
    if (path == NULL || payload_out == NULL || len_out == NULL)
        return -EINVAL;
    *payload_out = NULL;
    *len_out = 0;
    return read_one(path, max_len, payload_out, len_out);
}

int hm_ckpt_read(const char *path, size_t max_len, uint8_t **payload_out, size_t *len_out,
                 int *used_prev_out)
{
    char *prev = NULL;
    int r_path, r_prev, result;

    if (path == NULL || payload_out == NULL || len_out == NULL)
        return -EINVAL;
    *payload_out = NULL;
    *len_out = 0;
    if (used_prev_out != NULL)
        *used_prev_out = 0;
    r_path = read_one(path, max_len, payload_out, len_out);
    if (r_path == 0)
        return 0;
    if ((prev = with_suffix(path, ".prev")) == NULL)
        return -ENOMEM;
    r_prev = read_one(prev, max_len, payload_out, len_out);
    if (r_prev == 0) {
        if (used_prev_out != NULL)
            *used_prev_out = 1;
        result = 0;
        goto out;
    }
    /* PATH's own failure says most about what is wrong, unless PATH is simply absent. */
    result = r_path != -ENOENT ? r_path : r_prev;
out:
    free(prev);
    return result;
}

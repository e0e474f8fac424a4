/*
 * idx: the bounded IDX loader (idx.h). One reader serves three sources: a
 * file through zlib's gzFile (which reads gzip and plain files alike), plain
 * bytes in memory, and gzip bytes in memory through inflate. The parser
 * above it checks the header against the caps before it allocates, reads
 * exactly the announced payload in fixed-size chunks, and converts as it
 * goes, so memory use is the output arrays plus one chunk.
 */
#include "config.h"

#include "contrib/examples/idx.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#define CHUNK (64u * 1024u)

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

enum src_kind { SRC_FILE, SRC_MEM, SRC_MEM_GZ };

struct src {
    enum src_kind kind;
    const char *name;
    gzFile gz;
    const uint8_t *buf;
    size_t len, pos;
    z_stream zs;
    int zs_ready, zs_end;
};

static void set_err(char *err, size_t errlen, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void set_err(char *err, size_t errlen, const char *name, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return;
    int n = snprintf(err, errlen, "%s: ", name != NULL ? name : "(idx)");
    if (n < 0 || (size_t)n >= errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
    va_end(ap);
}

/*
 * Reads up to n bytes; *got < n means the source ended. Returns 0 or a
 * negative code with err set (a read error or a corrupt gzip stream).
 */
static int src_read(struct src *s, uint8_t *dst, size_t n, size_t *got, char *err, size_t errlen)
{
    *got = 0;
    switch (s->kind) {
    case SRC_FILE:
        while (*got < n) {
            size_t want = min_sz(n - *got, (size_t)1 << 30);
            int r = gzread(s->gz, dst + *got, (unsigned)want);
            if (r < 0) {
                int zerr = 0;
                const char *msg = gzerror(s->gz, &zerr);
                set_err(err, errlen, s->name, "read failed: %s",
                        zerr == Z_ERRNO ? strerror(errno) : msg);
                return zerr == Z_ERRNO && errno != 0 ? -errno : -EINVAL;
            }
            if (r == 0)
                break;
            *got += (size_t)r;
        }
        return 0;
    case SRC_MEM: {
        size_t left = s->len - s->pos;
        size_t k = n < left ? n : left;
        if (k > 0)
            memcpy(dst, s->buf + s->pos, k);
        s->pos += k;
        *got = k;
        return 0;
    }
    case SRC_MEM_GZ:
        while (*got < n && !s->zs_end) {
            size_t want = min_sz(n - *got, (size_t)1 << 30);
            s->zs.next_out = dst + *got;
            s->zs.avail_out = (uInt)want;
            int r = inflate(&s->zs, Z_NO_FLUSH);
            *got += want - s->zs.avail_out;
            if (r == Z_STREAM_END) {
                s->zs_end = 1;
            } else if (r == Z_BUF_ERROR && s->zs.avail_in == 0) {
                set_err(err, errlen, s->name, "truncated gzip stream");
                return -EINVAL;
            } else if (r != Z_OK && r != Z_BUF_ERROR) {
                set_err(err, errlen, s->name, "corrupt gzip stream: %s",
                        s->zs.msg != NULL ? s->zs.msg : "inflate failed");
                return r == Z_MEM_ERROR ? -ENOMEM : -EINVAL;
            }
        }
        return 0;
    }
    return -EINVAL;
}

static int src_open_file(struct src *s, const char *path, char *err, size_t errlen)
{
    memset(s, 0, sizeof(*s));
    s->kind = SRC_FILE;
    s->name = path;
    errno = 0;
    s->gz = gzopen(path, "rb");
    if (s->gz == NULL) {
        int e = errno != 0 ? errno : ENOMEM;
        set_err(err, errlen, path, "cannot open: %s", strerror(e));
        return -e;
    }
    /* A larger buffer than zlib's 8 KiB default makes the 30 MB image file
     * decompress in far fewer calls. */
    gzbuffer(s->gz, 128u * 1024u);
    return 0;
}

static int src_open_mem(struct src *s, const uint8_t *buf, size_t len, const char *name,
                        char *err, size_t errlen)
{
    memset(s, 0, sizeof(*s));
    s->name = name;
    s->buf = buf;
    s->len = len;
    if (len >= 2 && buf[0] == 0x1f && buf[1] == 0x8b) {
        if (len > UINT_MAX) {
            set_err(err, errlen, name, "compressed input of %zu bytes is too large", len);
            return -EMSGSIZE;
        }
        s->kind = SRC_MEM_GZ;
        s->zs.next_in = (Bytef *)(uintptr_t)buf;
        s->zs.avail_in = (uInt)len;
        /* 15 + 16: a gzip wrapper, the largest window. */
        int r = inflateInit2(&s->zs, 15 + 16);
        if (r != Z_OK) {
            set_err(err, errlen, name, "inflateInit failed");
            return r == Z_MEM_ERROR ? -ENOMEM : -EINVAL;
        }
        s->zs_ready = 1;
    } else {
        s->kind = SRC_MEM;
    }
    return 0;
}

static void src_close(struct src *s)
{
    if (s->kind == SRC_FILE && s->gz != NULL)
        gzclose(s->gz);
    if (s->kind == SRC_MEM_GZ && s->zs_ready)
        inflateEnd(&s->zs);
    s->gz = NULL;
    s->zs_ready = 0;
}

/*
 * Reads and checks the header: magic, dtype 0x08, the expected number of
 * dimensions, and each dimension against the caps. dims_out gets them.
 */
static int read_header(struct src *s, unsigned want_dims, uint32_t *dims_out, char *err,
                       size_t errlen)
{
    uint8_t h[4 + 4 * 3];
    size_t got;
    int result = src_read(s, h, 4, &got, err, errlen);
    if (result < 0)
        return result;
    if (got < 4) {
        set_err(err, errlen, s->name, "truncated header (%zu of 4 magic bytes)", got);
        return -EINVAL;
    }
    if (h[0] != 0 || h[1] != 0) {
        set_err(err, errlen, s->name, "bad magic %02x %02x %02x %02x: not an IDX file", h[0],
                h[1], h[2], h[3]);
        return -EINVAL;
    }
    if (h[2] != 0x08) {
        set_err(err, errlen, s->name, "dtype 0x%02x: only 0x08 (unsigned byte) is supported",
                h[2]);
        return -EINVAL;
    }
    if (h[3] != want_dims) {
        set_err(err, errlen, s->name, "%u dimensions where %s file has %u", h[3],
                want_dims == 3 ? "an image" : "a label", want_dims);
        return -EINVAL;
    }
    result = src_read(s, h + 4, 4 * want_dims, &got, err, errlen);
    if (result < 0)
        return result;
    if (got < 4 * want_dims) {
        set_err(err, errlen, s->name, "truncated header (%zu of %u dimension bytes)", got,
                4 * want_dims);
        return -EINVAL;
    }
    for (unsigned d = 0; d < want_dims; d++) {
        const uint8_t *p = h + 4 + 4 * d;
        dims_out[d] = (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
    }
    if (dims_out[0] == 0) {
        set_err(err, errlen, s->name, "holds no items");
        return -EINVAL;
    }
    if (dims_out[0] > HM_IDX_MAX_ITEMS) {
        set_err(err, errlen, s->name, "%" PRIu32 " items is over the cap of %u", dims_out[0],
                HM_IDX_MAX_ITEMS);
        return -EMSGSIZE;
    }
    if (want_dims == 3) {
        uint32_t r = dims_out[1], c = dims_out[2];
        if (r == 0 || c == 0) {
            set_err(err, errlen, s->name, "empty images (%" PRIu32 "x%" PRIu32 ")", r, c);
            return -EINVAL;
        }
        if (r > HM_IDX_MAX_SIDE || c > HM_IDX_MAX_SIDE ||
            (uint64_t)r * c > HM_IDX_MAX_PIXELS) {
            set_err(err, errlen, s->name, "images of %" PRIu32 "x%" PRIu32
                    " are over the cap of %u pixels", r, c, HM_IDX_MAX_PIXELS);
            return -EMSGSIZE;
        }
        if ((uint64_t)dims_out[0] * r * c > HM_IDX_MAX_BYTES) {
            set_err(err, errlen, s->name, "%" PRIu32 " images of %" PRIu32 "x%" PRIu32
                    " are over the cap of %u bytes", dims_out[0], r, c, HM_IDX_MAX_BYTES);
            return -EMSGSIZE;
        }
    }
    return 0;
}

/*
 * After the announced payload the source must end; one byte more means the
 * header's count is smaller than what the file holds.
 */
static int check_end(struct src *s, char *err, size_t errlen)
{
    uint8_t extra;
    size_t got;
    int result = src_read(s, &extra, 1, &got, err, errlen);
    if (result < 0)
        return result;
    if (got != 0) {
        set_err(err, errlen, s->name, "trailing bytes after the items the header announces");
        return -EINVAL;
    }
    return 0;
}

static int parse_images(struct src *s, size_t limit, hm_idx_images *out, char *err,
                        size_t errlen)
{
    uint32_t dims[3];
    uint8_t *chunk = NULL;
    float *data = NULL;
    int result = read_header(s, 3, dims, err, errlen);
    if (result < 0)
        goto out;
    size_t count = dims[0], pix = (size_t)dims[1] * dims[2];
    size_t n = limit != 0 && limit < count ? limit : count;
    size_t total = n * pix;
    /* The array grows as bytes arrive, so a header that lies about a short
     * file costs at most twice what the file really holds. */
    size_t cap = min_sz(total, (size_t)1 << 20);
    data = malloc(cap * sizeof(float));
    chunk = malloc(CHUNK);
    if (data == NULL || chunk == NULL) {
        set_err(err, errlen, s->name, "out of memory for %zu images", n);
        result = -ENOMEM;
        goto out;
    }
    for (size_t done = 0; done < total;) {
        size_t want = min_sz(total - done, (size_t)CHUNK), got;
        if (done + want > cap) {
            size_t ncap = min_sz(total, 2 * cap);
            float *nd = realloc(data, ncap * sizeof(float));
            if (nd == NULL) {
                set_err(err, errlen, s->name, "out of memory for %zu images", n);
                result = -ENOMEM;
                goto out;
            }
            data = nd;
            cap = ncap;
        }
        result = src_read(s, chunk, want, &got, err, errlen);
        if (result < 0)
            goto out;
        for (size_t i = 0; i < got; i++)
            data[done + i] = (float)chunk[i] * (1.0f / 255.0f);
        done += got;
        if (got < want) {
            set_err(err, errlen, s->name,
                    "truncated: the header announces %zu images of %" PRIu32 "x%" PRIu32
                    " but the file ends after %zu of them", count, dims[1], dims[2],
                    done / pix);
            result = -EINVAL;
            goto out;
        }
    }
    if (n == count) {
        result = check_end(s, err, errlen);
        if (result < 0)
            goto out;
    }
    out->n = n;
    out->rows = dims[1];
    out->cols = dims[2];
    out->data = data;
    data = NULL;
    result = 0;
out:
    free(chunk);
    free(data);
    return result;
}

static int parse_labels(struct src *s, size_t limit, hm_idx_labels *out, char *err,
                        size_t errlen)
{
    uint32_t dims[1];
    uint8_t *data = NULL;
    int result = read_header(s, 1, dims, err, errlen);
    if (result < 0)
        goto out;
    size_t count = dims[0];
    size_t n = limit != 0 && limit < count ? limit : count;
    data = malloc(n);
    if (data == NULL) {
        set_err(err, errlen, s->name, "out of memory for %zu labels", n);
        result = -ENOMEM;
        goto out;
    }
    size_t got;
    result = src_read(s, data, n, &got, err, errlen);
    if (result < 0)
        goto out;
    if (got < n) {
        set_err(err, errlen, s->name,
                "truncated: the header announces %zu labels but the file holds %zu", count,
                got);
        result = -EINVAL;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        if (data[i] >= HM_IDX_MAX_CLASSES) {
            set_err(err, errlen, s->name, "label %u of item %zu is out of range (0..%u)",
                    data[i], i, HM_IDX_MAX_CLASSES - 1);
            result = -EINVAL;
            goto out;
        }
    }
    if (n == count) {
        result = check_end(s, err, errlen);
        if (result < 0)
            goto out;
    }
    out->n = n;
    out->data = data;
    data = NULL;
    result = 0;
out:
    free(data);
    return result;
}

int hm_idx_load_images(const char *path, size_t limit, hm_idx_images *out, char *err,
                       size_t errlen)
{
    struct src s;
    if (out == NULL || path == NULL)
        return -EINVAL;
    memset(out, 0, sizeof(*out));
    int result = src_open_file(&s, path, err, errlen);
    if (result < 0)
        return result;
    result = parse_images(&s, limit, out, err, errlen);
    src_close(&s);
    return result;
}

int hm_idx_load_labels(const char *path, size_t limit, hm_idx_labels *out, char *err,
                       size_t errlen)
{
    struct src s;
    if (out == NULL || path == NULL)
        return -EINVAL;
    memset(out, 0, sizeof(*out));
    int result = src_open_file(&s, path, err, errlen);
    if (result < 0)
        return result;
    result = parse_labels(&s, limit, out, err, errlen);
    src_close(&s);
    return result;
}

int hm_idx_parse_images(const uint8_t *buf, size_t len, const char *name, size_t limit,
                        hm_idx_images *out, char *err, size_t errlen)
{
    struct src s;
    if (out == NULL || (buf == NULL && len > 0))
        return -EINVAL;
    memset(out, 0, sizeof(*out));
    int result = src_open_mem(&s, buf, len, name, err, errlen);
    if (result < 0)
        return result;
    result = parse_images(&s, limit, out, err, errlen);
    src_close(&s);
    return result;
}

int hm_idx_parse_labels(const uint8_t *buf, size_t len, const char *name, size_t limit,
                        hm_idx_labels *out, char *err, size_t errlen)
{
    struct src s;
    if (out == NULL || (buf == NULL && len > 0))
        return -EINVAL;
    memset(out, 0, sizeof(*out));
    int result = src_open_mem(&s, buf, len, name, err, errlen);
    if (result < 0)
        return result;
    result = parse_labels(&s, limit, out, err, errlen);
    src_close(&s);
    return result;
}

/* DIR/PREFIX-KIND-ubyte.gz when it exists, else DIR/PREFIX-KIND-ubyte. */
static int pick_path(const char *dir, const char *prefix, const char *kind, char *path,
                     size_t len)
{
    int n = snprintf(path, len, "%s/%s-%s-ubyte.gz", dir, prefix, kind);
    if (n < 0 || (size_t)n >= len)
        return -ENAMETOOLONG;
    FILE *f = fopen(path, "rb");
    if (f != NULL) {
        fclose(f);
        return 0;
    }
    path[n - 3] = '\0';
    return 0;
}

int hm_idx_load_pair(const char *dir, const char *prefix, size_t limit, hm_idx_images *im_out,
                     hm_idx_labels *lb_out, char *err, size_t errlen)
{
    char ipath[4096], lpath[4096];
    if (dir == NULL || prefix == NULL || im_out == NULL || lb_out == NULL)
        return -EINVAL;
    memset(im_out, 0, sizeof(*im_out));
    memset(lb_out, 0, sizeof(*lb_out));
    int result = pick_path(dir, prefix, "images-idx3", ipath, sizeof(ipath));
    if (result == 0)
        result = pick_path(dir, prefix, "labels-idx1", lpath, sizeof(lpath));
    if (result < 0) {
        set_err(err, errlen, dir, "path too long");
        return result;
    }
    result = hm_idx_load_images(ipath, limit, im_out, err, errlen);
    if (result < 0)
        goto out;
    result = hm_idx_load_labels(lpath, limit, lb_out, err, errlen);
    if (result < 0)
        goto out;
    if (im_out->n != lb_out->n) {
        set_err(err, errlen, lpath, "holds %zu labels but %s holds %zu images", lb_out->n,
                ipath, im_out->n);
        result = -EINVAL;
        goto out;
    }
    result = 0;
out:
    if (result < 0) {
        hm_idx_images_free(im_out);
        hm_idx_labels_free(lb_out);
    }
    return result;
}

void hm_idx_stats(const hm_idx_images *im, float *mean_out, float *std_out)
{
    double sum = 0, sq = 0;
    size_t total = im->n * im->rows * im->cols;
    for (size_t i = 0; i < total; i++) {
        sum += im->data[i];
        sq += (double)im->data[i] * im->data[i];
    }
    double mean = total > 0 ? sum / (double)total : 0.0;
    double var = total > 0 ? sq / (double)total - mean * mean : 0.0;
    *mean_out = (float)mean;
    *std_out = var > 1e-12 ? (float)sqrt(var) : 1.0f;
}

int hm_idx_normalize(hm_idx_images *im, float mean, float std)
{
    if (im == NULL || !(std > 0.0f) || !isfinite(std) || !isfinite(mean))
        return -EINVAL;
    size_t total = im->n * im->rows * im->cols;
    float inv = 1.0f / std;
    for (size_t i = 0; i < total; i++)
        im->data[i] = (im->data[i] - mean) * inv;
    return 0;
}

void hm_idx_images_free(hm_idx_images *im)
{
    if (im == NULL)
        return;
    free(im->data);
    memset(im, 0, sizeof(*im));
}

void hm_idx_labels_free(hm_idx_labels *lb)
{
    if (lb == NULL)
        return;
    free(lb->data);
    memset(lb, 0, sizeof(*lb));
}

/*
 * idx: a bounded loader for IDX files (the MNIST / Fashion-MNIST format),
 * gzip-compressed or plain, from a file or from bytes in memory. It owns the
 * arrays it returns; the caller frees them with hm_idx_images_free /
 * hm_idx_labels_free.
 *
 * Format: two zero bytes, a dtype byte, a byte with the number of
 * dimensions, then one big-endian u32 per dimension, then the items, row
 * major. Only dtype 0x08 (unsigned byte) is read: images are 3-D
 * (count, rows, cols) and labels 1-D (count).
 *
 * Every count comes from an untrusted file, so nothing is allocated from it
 * before it passes the caps below; the loader then reads exactly the bytes
 * the header announces and fails when the file holds fewer ("truncated") or
 * more ("trailing bytes"). Decompression is bounded the same way: at most
 * the announced bytes plus one are ever inflated, so a small gzip bomb
 * cannot make it allocate or spin; the image array grows with the bytes
 * that really arrive, so a header that lies about a short file costs at
 * most twice what the file holds. Labels must be < HM_IDX_MAX_CLASSES.
 *
 * Errors: a negative errno code and, when err is not NULL, a message that
 * names the file (or the name given for bytes in memory) and what is wrong:
 *   -EINVAL   malformed: bad magic, dtype, dimensions, truncated, trailing
 *             bytes, corrupt gzip, a label out of range, counts that differ
 *             between an image file and its label file
 *   -EMSGSIZE a count or size over the caps
 *   -ENOMEM   out of memory
 *   -errno    the file could not be opened or read
 */
#ifndef HM_EXAMPLES_IDX_H
#define HM_EXAMPLES_IDX_H

#include <stddef.h>
#include <stdint.h>

#define HM_IDX_MAX_ITEMS (1u << 20)      /* items in one file */
#define HM_IDX_MAX_SIDE 4096u            /* rows or cols of one image */
#define HM_IDX_MAX_PIXELS (1u << 16)     /* rows * cols */
#define HM_IDX_MAX_BYTES (256u << 20)    /* payload bytes of one file */
#define HM_IDX_MAX_CLASSES 10u           /* labels are 0..9 */
#define HM_IDX_ERR_LEN 512               /* a buffer that holds any message */

typedef struct hm_idx_images {
    size_t n;       /* items loaded */
    size_t rows, cols;
    float *data;    /* [n, rows * cols], each pixel / 255, so in [0, 1] */
} hm_idx_images;

typedef struct hm_idx_labels {
    size_t n;
    uint8_t *data;  /* [n], each < HM_IDX_MAX_CLASSES */
} hm_idx_labels;

/*
 * Loads an image file (gzip'd or plain: zlib reads both). limit 0 loads
 * every item; otherwise only the first min(count, limit) items are read
 * and the rest of the file is not checked. out is zeroed on failure.
 */
int hm_idx_load_images(const char *path, size_t limit, hm_idx_images *out, char *err,
                       size_t errlen);
int hm_idx_load_labels(const char *path, size_t limit, hm_idx_labels *out, char *err,
                       size_t errlen);

/*
 * The same on bytes in memory; gzip is recognised by its magic (1f 8b).
 * name appears in error messages.
 */
int hm_idx_parse_images(const uint8_t *buf, size_t len, const char *name, size_t limit,
                        hm_idx_images *out, char *err, size_t errlen);
int hm_idx_parse_labels(const uint8_t *buf, size_t len, const char *name, size_t limit,
                        hm_idx_labels *out, char *err, size_t errlen);

/*
 * Loads DIR/PREFIX-images-idx3-ubyte[.gz] and DIR/PREFIX-labels-idx1-ubyte[.gz]
 * (the .gz name first) and checks that they hold the same number of items.
 */
int hm_idx_load_pair(const char *dir, const char *prefix, size_t limit, hm_idx_images *im_out,
                     hm_idx_labels *lb_out, char *err, size_t errlen);

/* Mean and standard deviation over every pixel (std 1 when all are equal). */
void hm_idx_stats(const hm_idx_images *im, float *mean_out, float *std_out);
/* pixel = (pixel - mean) / std; -EINVAL when std is not > 0 and finite. */
int hm_idx_normalize(hm_idx_images *im, float mean, float std);

void hm_idx_images_free(hm_idx_images *im);
void hm_idx_labels_free(hm_idx_labels *lb);

#endif

/*
 * Tests for the IDX loader (contrib/examples/idx.h): well-formed files,
 * plain and gzip'd, in memory and on disk, load with the right shapes and
 * values; malformed ones (bad magic, dtype, dimensions, counts over the
 * caps, truncated or trailing payloads, corrupt gzip, labels out of range,
 * image and label files that disagree) fail with the documented code and a
 * message that names the file; a gzip bomb is cut off after the announced
 * bytes. The real Fashion-MNIST files load with 60000 / 10000 items of
 * 28x28 and ten balanced classes; they are looked for in
 * $HM_FASHION_MNIST_DIR, default /usr/share/datasets/fashion-mnist
 * (Debian's dataset-fashion-mnist), and that test skips without them.
 */
#include "config.h"

#include "contrib/examples/idx.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

/* ---- helpers ---- */

struct buf {
    uint8_t *p;
    size_t len;
};

static void put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* An IDX file: header with the given dtype and dims, then `payload` bytes
 * of value i % mod. */
static struct buf make_idx(uint8_t dtype, unsigned ndims, const uint32_t *dims, size_t payload,
                           unsigned mod)
{
    struct buf b;
    b.len = 4 + 4 * (size_t)ndims + payload;
    b.p = malloc(b.len);
    cr_assert_not_null(b.p);
    b.p[0] = 0;
    b.p[1] = 0;
    b.p[2] = dtype;
    b.p[3] = (uint8_t)ndims;
    for (unsigned d = 0; d < ndims; d++)
        put_u32(b.p + 4 + 4 * d, dims[d]);
    for (size_t i = 0; i < payload; i++)
        b.p[4 + 4 * ndims + i] = (uint8_t)(i % mod);
    return b;
}

static struct buf images(uint32_t n, uint32_t r, uint32_t c, long extra)
{
    uint32_t dims[3] = {n, r, c};
    return make_idx(0x08, 3, dims, (size_t)((long)n * r * c + extra), 256);
}

static struct buf labels(uint32_t n, long extra)
{
    uint32_t dims[1] = {n};
    return make_idx(0x08, 1, dims, (size_t)((long)n + extra), 10);
}

static struct buf gzip_of(const uint8_t *p, size_t len)
{
    z_stream zs;
    memset(&zs, 0, sizeof(zs));
    cr_assert_eq(deflateInit2(&zs, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY), Z_OK);
    struct buf out;
    out.len = deflateBound(&zs, len);
    out.p = malloc(out.len);
    cr_assert_not_null(out.p);
    zs.next_in = (Bytef *)(uintptr_t)p;
    zs.avail_in = (uInt)len;
    zs.next_out = out.p;
    zs.avail_out = (uInt)out.len;
    cr_assert_eq(deflate(&zs, Z_FINISH), Z_STREAM_END);
    out.len = zs.total_out;
    deflateEnd(&zs);
    return out;
}

static void write_file(const char *path, const struct buf *b)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(b->p, 1, b->len, f), b->len);
    cr_assert_eq(fclose(f), 0);
}

static char tmpdir[256];

static void setup(void)
{
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/test_idx.XXXXXX");
    cr_assert_not_null(mkdtemp(tmpdir));
}

static void teardown(void)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    cr_assert_eq(system(cmd), 0);
}

/* Parses b as images (kind 0) or labels (kind 1) and expects code `want`
 * and, on failure, a message with the name and `phrase`. */
static void expect_parse(const struct buf *b, int kind, int want, const char *phrase)
{
    char err[HM_IDX_ERR_LEN] = "";
    hm_idx_images im;
    hm_idx_labels lb;
    int rc = kind == 0 ? hm_idx_parse_images(b->p, b->len, "case.idx", 0, &im, err, sizeof(err))
                       : hm_idx_parse_labels(b->p, b->len, "case.idx", 0, &lb, err, sizeof(err));
    cr_assert_eq(rc, want, "got %d (%s), want %d", rc, err, want);
    if (want < 0) {
        cr_assert(strncmp(err, "case.idx: ", 10) == 0, "message does not name the file: %s",
                  err);
        cr_assert_not_null(strstr(err, phrase), "message '%s' lacks '%s'", err, phrase);
        if (kind == 0)
            cr_assert(im.data == NULL && im.n == 0);
        else
            cr_assert(lb.data == NULL && lb.n == 0);
    } else if (kind == 0) {
        hm_idx_images_free(&im);
    } else {
        hm_idx_labels_free(&lb);
    }
}

/* Both plain and gzip'd. */
static void expect_both(const struct buf *b, int kind, int want, const char *phrase,
                        const char *gz_phrase)
{
    expect_parse(b, kind, want, phrase);
    struct buf g = gzip_of(b->p, b->len);
    expect_parse(&g, kind, want, gz_phrase != NULL ? gz_phrase : phrase);
    free(g.p);
}

/* ---- well-formed input ---- */

Test(idx, images_parse_plain_and_gzip)
{
    struct buf b = images(5, 3, 4, 0);
    struct buf g = gzip_of(b.p, b.len);
    const struct buf *cases[2] = {&b, &g};
    for (int c = 0; c < 2; c++) {
        char err[HM_IDX_ERR_LEN];
        hm_idx_images im;
        cr_assert_eq(hm_idx_parse_images(cases[c]->p, cases[c]->len, "m", 0, &im, err,
                                         sizeof(err)), 0, "%s", err);
        cr_assert_eq(im.n, 5);
        cr_assert_eq(im.rows, 3);
        cr_assert_eq(im.cols, 4);
        for (size_t i = 0; i < 60; i++)
            cr_assert_float_eq(im.data[i], (float)(i % 256) / 255.0f, 1e-7);
        hm_idx_images_free(&im);
        /* A limit reads only the first items. */
        cr_assert_eq(hm_idx_parse_images(cases[c]->p, cases[c]->len, "m", 2, &im, err,
                                         sizeof(err)), 0, "%s", err);
        cr_assert_eq(im.n, 2);
        cr_assert_float_eq(im.data[23], 23.0f / 255.0f, 1e-7);
        hm_idx_images_free(&im);
    }
    free(b.p);
    free(g.p);
}

Test(idx, labels_parse_and_pixels_normalize)
{
    struct buf b = labels(25, 0);
    char err[HM_IDX_ERR_LEN];
    hm_idx_labels lb;
    cr_assert_eq(hm_idx_parse_labels(b.p, b.len, "l", 0, &lb, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(lb.n, 25);
    for (size_t i = 0; i < 25; i++)
        cr_assert_eq(lb.data[i], i % 10);
    hm_idx_labels_free(&lb);
    free(b.p);

    struct buf ib = images(10, 8, 8, 0);
    hm_idx_images im;
    cr_assert_eq(hm_idx_parse_images(ib.p, ib.len, "i", 0, &im, err, sizeof(err)), 0);
    float mean, std;
    hm_idx_stats(&im, &mean, &std);
    cr_assert_eq(hm_idx_normalize(&im, mean, std), 0);
    hm_idx_stats(&im, &mean, &std);
    cr_assert_float_eq(mean, 0.0f, 1e-5);
    cr_assert_float_eq(std, 1.0f, 1e-4);
    cr_assert_eq(hm_idx_normalize(&im, 0.0f, 0.0f), -EINVAL);
    hm_idx_images_free(&im);
    free(ib.p);
}

/* ---- malformed headers ---- */

Test(idx, malformed_headers)
{
    struct buf b = images(2, 2, 2, 0);
    b.p[1] = 3;
    expect_both(&b, 0, -EINVAL, "bad magic", NULL);
    b.p[1] = 0;
    b.p[2] = 0x0D; /* float32: not supported */
    expect_both(&b, 0, -EINVAL, "dtype 0x0d", NULL);
    b.p[2] = 0x08;
    expect_parse(&b, 1, -EINVAL, "3 dimensions where a label file has 1");
    free(b.p);

    struct buf l = labels(3, 0);
    expect_parse(&l, 0, -EINVAL, "1 dimensions where an image file has 3");
    free(l.p);

    /* Short headers: empty, magic only, part of the dimensions. */
    uint8_t raw[10] = {0, 0, 8, 3, 0, 0, 0, 1, 0, 0};
    for (size_t len = 0; len < sizeof(raw); len++) {
        struct buf t = {raw, len};
        expect_parse(&t, 0, -EINVAL, "truncated header");
    }

    uint32_t zero_n[3] = {0, 28, 28}, zero_r[3] = {4, 0, 28};
    struct buf z = make_idx(8, 3, zero_n, 0, 1);
    expect_both(&z, 0, -EINVAL, "no items", NULL);
    free(z.p);
    z = make_idx(8, 3, zero_r, 0, 1);
    expect_both(&z, 0, -EINVAL, "empty images", NULL);
    free(z.p);
}

Test(idx, counts_over_the_caps)
{
    /* Every one of these would need gigabytes if trusted. */
    uint32_t many[3] = {0xffffffffu, 28, 28};
    uint32_t wide[3] = {10, 5000, 1};
    uint32_t big[3] = {10, 1000, 1000};
    uint32_t bytes[3] = {HM_IDX_MAX_ITEMS, 256, 256};
    uint32_t lmany[1] = {HM_IDX_MAX_ITEMS + 1};
    struct buf b = make_idx(8, 3, many, 16, 1);
    expect_both(&b, 0, -EMSGSIZE, "over the cap", NULL);
    free(b.p);
    b = make_idx(8, 3, wide, 16, 1);
    expect_both(&b, 0, -EMSGSIZE, "over the cap", NULL);
    free(b.p);
    b = make_idx(8, 3, big, 16, 1);
    expect_both(&b, 0, -EMSGSIZE, "over the cap", NULL);
    free(b.p);
    b = make_idx(8, 3, bytes, 16, 1);
    expect_both(&b, 0, -EMSGSIZE, "over the cap", NULL);
    free(b.p);
    b = make_idx(8, 1, lmany, 16, 1);
    expect_both(&b, 1, -EMSGSIZE, "over the cap", NULL);
    free(b.p);
}

/* ---- payloads that disagree with the header ---- */

Test(idx, truncated_and_trailing_payloads)
{
    struct buf b = images(6, 5, 5, -30); /* 4 whole images and part of one */
    expect_parse(&b, 0, -EINVAL, "ends after 4 of them");
    struct buf g = gzip_of(b.p, b.len);
    expect_parse(&g, 0, -EINVAL, "truncated");
    free(g.p);
    free(b.p);

    b = images(6, 5, 5, 1);
    expect_both(&b, 0, -EINVAL, "trailing bytes", NULL);
    free(b.p);
    b = labels(6, -1);
    expect_both(&b, 1, -EINVAL, "announces 6 labels but the file holds 5", NULL);
    free(b.p);
    b = labels(6, 7);
    expect_both(&b, 1, -EINVAL, "trailing bytes", NULL);
    free(b.p);

    /* With a limit, only the announced part that is read must be there. */
    b = images(6, 5, 5, -30);
    char err[HM_IDX_ERR_LEN];
    hm_idx_images im;
    cr_assert_eq(hm_idx_parse_images(b.p, b.len, "x", 4, &im, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(im.n, 4);
    hm_idx_images_free(&im);
    free(b.p);
}

Test(idx, corrupt_and_cut_gzip)
{
    struct buf b = images(20, 10, 10, 0);
    struct buf g = gzip_of(b.p, b.len);
    /* Cut inside the deflate stream. */
    struct buf cut = {g.p, g.len / 2};
    expect_parse(&cut, 0, -EINVAL, "truncated");
    /* A wrong checksum in the gzip trailer: the data decodes, but the
     * loader reads to the end of the stream, where inflate checks it. */
    g.p[g.len - 6] ^= 0x01;
    expect_parse(&g, 0, -EINVAL, "corrupt gzip stream: incorrect data check");
    g.p[g.len - 6] ^= 0x01;
    /* Garbage in the deflate stream: decodes to something malformed. */
    for (size_t i = g.len / 3; i < g.len - 8; i += 3)
        g.p[i] ^= 0x5a;
    expect_parse(&g, 0, -EINVAL, "");
    free(g.p);
    free(b.p);
}

Test(idx, labels_out_of_range)
{
    struct buf b = labels(30, 0);
    b.p[4 + 4 + 17] = 10;
    expect_both(&b, 1, -EINVAL, "label 10 of item 17 is out of range", NULL);
    b.p[4 + 4 + 17] = 255;
    expect_both(&b, 1, -EINVAL, "label 255 of item 17", NULL);
    free(b.p);
}

Test(idx, gzip_bomb_is_cut_off)
{
    /* 64 MiB of zeros compress to ~64 KiB; the header announces 1000
     * images of 28x28, so the loader must stop after 784,001 bytes. */
    size_t len = 64u << 20;
    uint8_t *p = calloc(1, len);
    cr_assert_not_null(p);
    p[2] = 8;
    p[3] = 3;
    put_u32(p + 4, 1000);
    put_u32(p + 8, 28);
    put_u32(p + 12, 28);
    struct buf g = gzip_of(p, len);
    free(p);
    cr_assert_lt(g.len, 1u << 20);
    expect_parse(&g, 0, -EINVAL, "trailing bytes");
    free(g.p);
}

/* ---- files ---- */

Test(idx, files_and_pairs, .init = setup, .fini = teardown)
{
    char ip[512], lp[512], err[HM_IDX_ERR_LEN];
    hm_idx_images im;
    hm_idx_labels lb;

    /* A missing file is -ENOENT, named. */
    snprintf(ip, sizeof(ip), "%s/none-images-idx3-ubyte", tmpdir);
    cr_assert_eq(hm_idx_load_images(ip, 0, &im, err, sizeof(err)), -ENOENT);
    cr_assert_not_null(strstr(err, ip), "%s", err);

    /* A gzip'd image file and a plain label file make a pair. */
    struct buf b = images(7, 4, 4, 0);
    struct buf g = gzip_of(b.p, b.len);
    snprintf(ip, sizeof(ip), "%s/a-images-idx3-ubyte.gz", tmpdir);
    write_file(ip, &g);
    struct buf l = labels(7, 0);
    snprintf(lp, sizeof(lp), "%s/a-labels-idx1-ubyte", tmpdir);
    write_file(lp, &l);
    cr_assert_eq(hm_idx_load_pair(tmpdir, "a", 0, &im, &lb, err, sizeof(err)), 0, "%s", err);
    cr_assert_eq(im.n, 7);
    cr_assert_eq(lb.n, 7);
    cr_assert_eq(im.rows, 4);
    cr_assert_float_eq(im.data[17], 17.0f / 255.0f, 1e-7);
    hm_idx_images_free(&im);
    hm_idx_labels_free(&lb);

    /* Counts that differ between the two files. */
    free(l.p);
    l = labels(6, 0);
    write_file(lp, &l);
    cr_assert_eq(hm_idx_load_pair(tmpdir, "a", 0, &im, &lb, err, sizeof(err)), -EINVAL);
    cr_assert_not_null(strstr(err, "holds 6 labels but"), "%s", err);
    cr_assert_not_null(strstr(err, lp), "%s", err);
    cr_assert_null(im.data);
    cr_assert_null(lb.data);

    /* A truncated file on disk, gzip'd: named in the message. */
    struct buf cut = {g.p, g.len - 20};
    write_file(ip, &cut);
    cr_assert_eq(hm_idx_load_images(ip, 0, &im, err, sizeof(err)), -EINVAL);
    cr_assert(strncmp(err, ip, strlen(ip)) == 0, "%s", err);
    free(b.p);
    free(g.p);
    free(l.p);
}

Test(idx, real_fashion_mnist, .timeout = 60)
{
    const char *dir = getenv("HM_FASHION_MNIST_DIR");
    if (dir == NULL || dir[0] == '\0')
        dir = "/usr/share/datasets/fashion-mnist";
    char probe[4096];
    snprintf(probe, sizeof(probe), "%s/t10k-labels-idx1-ubyte.gz", dir);
    if (access(probe, R_OK) != 0)
        cr_skip_test("Fashion-MNIST not found in %s", dir);

    const char *prefixes[2] = {"train", "t10k"};
    const size_t want[2] = {60000, 10000};
    for (int s = 0; s < 2; s++) {
        char err[HM_IDX_ERR_LEN];
        hm_idx_images im;
        hm_idx_labels lb;
        cr_assert_eq(hm_idx_load_pair(dir, prefixes[s], 0, &im, &lb, err, sizeof(err)), 0,
                     "%s", err);
        cr_assert_eq(im.n, want[s]);
        cr_assert_eq(lb.n, want[s]);
        cr_assert_eq(im.rows, 28);
        cr_assert_eq(im.cols, 28);
        size_t count[10] = {0};
        for (size_t i = 0; i < lb.n; i++)
            count[lb.data[i]]++;
        for (int c = 0; c < 10; c++)
            cr_assert_eq(count[c], want[s] / 10, "class %d has %zu items", c, count[c]);
        float mn = 1, mx = 0, mean, std;
        for (size_t i = 0; i < im.n * 784; i++) {
            mn = im.data[i] < mn ? im.data[i] : mn;
            mx = im.data[i] > mx ? im.data[i] : mx;
        }
        cr_assert_float_eq(mn, 0.0f, 1e-7);
        cr_assert_float_eq(mx, 1.0f, 1e-7);
        hm_idx_stats(&im, &mean, &std);
        /* Fashion-MNIST's well-known pixel statistics. */
        cr_assert_float_eq(mean, 0.286f, 0.01);
        cr_assert_float_eq(std, 0.353f, 0.01);
        hm_idx_images_free(&im);
        hm_idx_labels_free(&lb);
    }
}

/*
 * fuzz_idx: the IDX loader (contrib/examples/idx.h) on bytes in memory,
 * plain and gzip'd. Every input is parsed as an image file and as a label
 * file, whole and with an item limit; whatever parses must satisfy the
 * loader's promises (a shape within the caps, pixels in [0, 1], labels
 * below 10), and whatever fails must say why in a message that names the
 * input. The seed corpus holds small valid image and label files, plain
 * and gzip'd.
 */
#include "config.h"

#include "contrib/examples/idx.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                            \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);           \
            abort();                                                                           \
        }                                                                                      \
    } while (0)

static void check_images(const uint8_t *data, size_t size, size_t limit)
{
    char err[HM_IDX_ERR_LEN] = "";
    hm_idx_images im;
    int rc = hm_idx_parse_images(data, size, "fuzz", limit, &im, err, sizeof(err));
    if (rc < 0) {
        CHECK(strncmp(err, "fuzz: ", 6) == 0 && strlen(err) > 6);
        CHECK(im.data == NULL && im.n == 0);
        return;
    }
    CHECK(rc == 0);
    CHECK(im.n >= 1 && im.n <= HM_IDX_MAX_ITEMS);
    CHECK(limit == 0 || im.n <= limit);
    CHECK(im.rows >= 1 && im.cols >= 1 && im.rows * im.cols <= HM_IDX_MAX_PIXELS);
    CHECK(im.n * im.rows * im.cols <= HM_IDX_MAX_BYTES);
    for (size_t i = 0; i < im.n * im.rows * im.cols; i++)
        CHECK(im.data[i] >= 0.0f && im.data[i] <= 1.0f);
    hm_idx_images_free(&im);
    CHECK(im.data == NULL);
}

static void check_labels(const uint8_t *data, size_t size, size_t limit)
{
    char err[HM_IDX_ERR_LEN] = "";
    hm_idx_labels lb;
    int rc = hm_idx_parse_labels(data, size, "fuzz", limit, &lb, err, sizeof(err));
    if (rc < 0) {
        CHECK(strncmp(err, "fuzz: ", 6) == 0 && strlen(err) > 6);
        CHECK(lb.data == NULL && lb.n == 0);
        return;
    }
    CHECK(rc == 0);
    CHECK(lb.n >= 1 && lb.n <= HM_IDX_MAX_ITEMS);
    CHECK(limit == 0 || lb.n <= limit);
    for (size_t i = 0; i < lb.n; i++)
        CHECK(lb.data[i] < HM_IDX_MAX_CLASSES);
    hm_idx_labels_free(&lb);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    check_images(data, size, 0);
    check_images(data, size, 3);
    check_labels(data, size, 0);
    check_labels(data, size, 3);
    return 0;
}

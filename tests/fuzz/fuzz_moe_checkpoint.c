/*
 * fuzz_moe_checkpoint: fuzz target for what an expert server reads back
 * from disk. Each input is checked as a whole checkpoint file image
 * (hm_ckpt_parse) and, whether or not that passes, parsed as a saved expert
 * state (hm_ffn_load), with and without an expected shape; a payload that
 * passes the checkpoint check is parsed as a state too. Besides memory
 * safety it checks the contracts' promises: only the documented errors come
 * back; a payload handed out lies inside the image; a state that loads
 * matches its expected shape, saves, and reloads to the same bytes (a fixed
 * point); and a loaded expert runs forward on a small batch. The seed
 * corpus holds a valid checkpoint image wrapping a small state and a valid
 * small state on its own.
 */
#include "config.h"

#include "moe/checkpoint.h"
#include "moe/ffn.h"
#include "moe/transformer.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                           \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "fuzz_moe_checkpoint: check failed at line %d: %s\n", __LINE__,  \
                    #cond);                                                                   \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

/* The largest payload the target accepts as a checkpoint: far above any fuzz input. */
#define MAX_PAYLOAD (1u << 20)

static void check_state(const uint8_t *buf, size_t len, const hm_ffn_config *expect)
{
    hm_ffn *f = NULL, *g = NULL;
    uint8_t *s1 = NULL, *s2 = NULL;
    size_t l1 = 0, l2 = 0;
    int rc;

    rc = hm_ffn_load(buf, len, expect, &f);
    CHECK(rc == 0 || rc == -EINVAL || rc == -EPROTO || rc == -EBADMSG || rc == -EMSGSIZE ||
          rc == -ENOMEM);
    if (rc != 0) {
        CHECK(f == NULL);
        return;
    }
    if (expect != NULL) {
        CHECK(hm_ffn_config_of(f)->dim == expect->dim);
        CHECK(hm_ffn_config_of(f)->optimizer == expect->optimizer);
    }
    /* What loads saves, and what it saves loads to the same bytes again. */
    CHECK(hm_ffn_save(f, &s1, &l1) == 0);
    CHECK(hm_ffn_load(s1, l1, NULL, &g) == 0);
    CHECK(hm_ffn_steps(g) == hm_ffn_steps(f));
    CHECK(memcmp(hm_ffn_params(f), hm_ffn_params(g), hm_ffn_nparams(f) * sizeof(float)) == 0);
    CHECK(hm_ffn_save(g, &s2, &l2) == 0);
    CHECK(l1 == l2 && memcmp(s1, s2, l1) == 0);

    /* Parameters from a file are finite, so forward runs; an output that overflows is
     * -EDOM, never inf handed back as a success. */
    {
        size_t d = hm_ffn_dim(f);
        float *x = calloc(2 * d, sizeof(float)), *y = malloc(2 * d * sizeof(float));
        CHECK(x != NULL && y != NULL);
        for (size_t i = 0; i < 2 * d; i++)
            x[i] = (float)(i % 7) - 3.0f;
        int frc = hm_ffn_forward(f, x, 2, y);
        CHECK(frc == 0 || frc == -EDOM);
        if (frc == 0)
            for (size_t i = 0; i < 2 * d; i++)
                CHECK(isfinite(y[i]));
        free(x);
        free(y);
    }
    free(s1);
    free(s2);
    hm_ffn_free(f);
    hm_ffn_free(g);
}

/* The transformer expert's state (moe/transformer.h): the same promises. */
static void check_xf_state(const uint8_t *buf, size_t len, const hm_xf_config *expect)
{
    hm_xf *t = NULL, *u = NULL;
    uint8_t *s1 = NULL, *s2 = NULL;
    size_t l1 = 0, l2 = 0;
    int rc = hm_xf_load(buf, len, expect, &t);

    CHECK(rc == 0 || rc == -EINVAL || rc == -EPROTO || rc == -EBADMSG || rc == -EMSGSIZE ||
          rc == -ENOMEM);
    if (rc != 0) {
        CHECK(t == NULL);
        return;
    }
    CHECK(hm_xf_is_state(buf, len));
    if (expect != NULL)
        CHECK(hm_xf_dim(t) == expect->ffn.dim && hm_xf_config_of(t)->heads == expect->heads);
    CHECK(hm_xf_save(t, &s1, &l1) == 0);
    CHECK(hm_xf_load(s1, l1, NULL, &u) == 0);
    CHECK(hm_xf_save(u, &s2, &l2) == 0);
    CHECK(l1 == l2 && memcmp(s1, s2, l1) == 0);
    {
        size_t d = hm_xf_dim(t);
        float *x = calloc(2 * d, sizeof(float)), *y = malloc(2 * d * sizeof(float));
        CHECK(x != NULL && y != NULL);
        for (size_t i = 0; i < 2 * d; i++)
            x[i] = (float)(i % 5) - 2.0f;
        rc = hm_xf_forward(t, x, 1, 2, y);
        /* Finite but huge weights may overflow inside the layer: -EDOM, never a
         * non-finite output handed back as a success. */
        CHECK(rc == 0 || rc == -EDOM || (rc == -EINVAL && hm_xf_config_of(t)->max_seq < 2));
        if (rc == 0)
            for (size_t i = 0; i < 2 * d; i++)
                CHECK(isfinite(y[i]));
        free(x);
        free(y);
    }
    free(s1);
    free(s2);
    hm_xf_free(t);
    hm_xf_free(u);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const hm_xf_config expect_xf = {.ffn = {.dim = 4, .hidden = 3,
                                                   .optimizer = HM_FFN_ADAM},
                                           .heads = 2, .max_seq = 4};
    static const hm_ffn_config expect_adam = {.dim = 2, .hidden = 3, .optimizer = HM_FFN_ADAM};
    const uint8_t *payload = NULL;
    size_t plen = 0;
    int rc;

    rc = hm_ckpt_parse(data, size, MAX_PAYLOAD, &payload, &plen);
    CHECK(rc == 0 || rc == -EBADMSG || rc == -EMSGSIZE);
    if (rc == 0) {
        CHECK(payload == data + HM_CKPT_HEADER_BYTES);
        CHECK(plen == size - HM_CKPT_HEADER_BYTES);
        check_state(payload, plen, NULL);
        check_state(payload, plen, &expect_adam);
        check_xf_state(payload, plen, NULL);
        check_xf_state(payload, plen, &expect_xf);
        /* A tighter cap refuses the same image with -EMSGSIZE, never anything else. */
        if (plen > 0)
            CHECK(hm_ckpt_parse(data, size, plen - 1, NULL, NULL) == -EMSGSIZE);
    }
    check_state(data, size, NULL);
    check_state(data, size, &expect_adam);
    check_xf_state(data, size, NULL);
    check_xf_state(data, size, &expect_xf);
    return 0;
}

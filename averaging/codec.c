/*
 * codec: dtype conversion, chunk compression, weighted accumulation and
 * CenteredClip for averaging (contracts and error bounds in codec.h). It
 * owns no state, does no I/O and allocates nothing: scratch space is a
 * fixed block on the stack.
 *
 * The element loops avoid branches that depend on the data (special cases
 * are computed and then selected with bit masks, since gcc will not
 * if-convert a select next to float arithmetic that might trap), so that
 * the compiler can vectorize them; checks for non-finite values fold into
 * the same passes as flags. Hot loops run in fixed runs of LANES elements
 * and then a scalar tail: gcc's -O2 cost model vectorizes only loops whose
 * trip count is a multiple of the vector width. Bit patterns move between
 * float and integer through memcpy, which compiles to a register move.
 */
#include "config.h"

#include "averaging/codec.h"
#include "src/base/util.h"

#include <cblas.h>
#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <string.h>

/* Elements per stack block in conversions and CenteredClip (4 KiB of floats). */
/*
 * The hot loops also get an AVX2 clone, chosen once at load time where the
 * CPU has AVX2 (gcc's target_clones, an ifunc, which needs glibc);
 * elsewhere the baseline code runs. AVX2 alone, without FMA, and the build
 * passes -ffp-contract=off (Makefile.am), so that no a * b + c is fused
 * into one rounding: both clones compute the same bits. About 1.7x for
 * 8-bit encoding on the machine of docs/benchmarks.md. HM_CODEC_BASELINE
 * leaves the clones out (tests/test_avg_codec_baseline, which a CPU with
 * AVX2 would otherwise never run).
 */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__) && \
    !defined(HM_CODEC_BASELINE)
#define HOT __attribute__((target_clones("avx2", "default")))
#else
#define HOT
#endif

#define BLOCK 1024
/* Elements per fixed-length inner loop (a multiple of every vector width). */
#define LANES 16
/* Largest run handed to one BLAS call, well inside a 32-bit blasint. */
#define BLAS_RUN ((size_t)1 << 30)

#define F16_MAX_BITS 0x477fe000u /* 65504.0f, the largest finite half */
#define F32_EXP_MASK 0x7f800000u
#define F32_ABS_MASK 0x7fffffffu

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define HOST_LE 1
#else
#define HOST_LE 0
#endif

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* All ones when c is nonzero, else zero. */
static inline uint32_t mask(int c) { return -(uint32_t)(c != 0); }

/* ---- dtype conversion ---- */

/*
 * fp32 -> fp16, round to nearest even, without branches (the method of
 * F. Giesen's float_to_half_fast3_rtne). Three candidates are computed and
 * one selected:
 *  - a magnitude of 2^16 or more (or inf/NaN) gives inf, or a quiet NaN;
 *  - below 2^-14 the half is subnormal: adding 0.5f leaves the value's
 *    multiples of 2^-24 (the subnormal step) in the low mantissa bits, and
 *    the FPU's own round-to-nearest-even does the rounding;
 *  - otherwise the exponent is rebiased and the 13 dropped mantissa bits
 *    are rounded by adding 0xfff plus the kept mantissa's lowest bit (ties
 *    to even); a carry ripples into the exponent, up to infinity for
 *    values from 65520 on.
 */
static inline uint16_t f16_from_f32(float f)
{
    const uint32_t w = f32_bits(f);
    const uint32_t sign = w & 0x80000000u;
    const uint32_t a = w ^ sign;
    const uint32_t half_bits = 126u << 23; /* 0.5f */
    const uint32_t sub = f32_bits(bits_f32(a) + bits_f32(half_bits)) - half_bits;
    const uint32_t norm = (a + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
    const uint32_t big = 0x7c00u | ((uint32_t)(a > F32_EXP_MASK) << 9); /* inf or quiet NaN */
    const uint32_t m_big = mask(a >= (143u << 23));
    const uint32_t m_sub = mask(a < (113u << 23));
    const uint32_t h = (big & m_big) | (sub & m_sub) | (norm & ~(m_big | m_sub));

    return (uint16_t)((sign >> 16) | h);
}

/*
 * fp16 -> fp32, exact (F. Giesen's half_to_float): the exponent is rebiased;
 * inf/NaN get the rest of fp32's exponent; a subnormal is renormalized by
 * one float subtraction, which is exact.
 */
static inline float f16_to_f32(uint16_t h)
{
    const uint32_t shifted_exp = 0x7c00u << 13;
    const uint32_t o = ((uint32_t)(h & 0x7fffu) << 13) + ((uint32_t)(127 - 15) << 23);
    const uint32_t e = ((uint32_t)h << 13) & shifted_exp;
    const uint32_t special = o + ((uint32_t)(128 - 16) << 23);
    const uint32_t sub = f32_bits(bits_f32(o + (1u << 23)) - bits_f32(113u << 23));
    const uint32_t m_special = mask(e == shifted_exp);
    const uint32_t m_sub = mask(e == 0);
    const uint32_t r = (special & m_special) | (sub & m_sub) | (o & ~(m_special | m_sub));

    return bits_f32(r | ((uint32_t)(h & 0x8000u) << 16));
}

/* fp32 -> bf16: keep the top 16 bits, rounding the rest to nearest even. */
static inline uint16_t bf16_from_f32(float f)
{
    const uint32_t w = f32_bits(f);
    const uint32_t rounded = (w + 0x7fffu + ((w >> 16) & 1u)) >> 16;
    const uint32_t nan = (w >> 16) | 0x40u;

    const uint32_t m_nan = mask((w & F32_ABS_MASK) > F32_EXP_MASK);

    return (uint16_t)((nan & m_nan) | (rounded & ~m_nan));
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t hm_avg_f16_from_f32(float x) { return f16_from_f32(x); }
float hm_avg_f16_to_f32(uint16_t h) { return f16_to_f32(h); }
uint16_t hm_avg_bf16_from_f32(float x) { return bf16_from_f32(x); }
float hm_avg_bf16_to_f32(uint16_t h) { return bf16_to_f32(h); }

HOT static void f16_to_f32_n(float *restrict d, const uint16_t *restrict s, size_t n)
{
    size_t i = 0;

    for (; i + LANES <= n; i += LANES)
        for (size_t k = 0; k < LANES; k++)
            d[i + k] = f16_to_f32(s[i + k]);
    for (; i < n; i++)
        d[i] = f16_to_f32(s[i]);
}

static void bf16_to_f32_n(float *restrict d, const uint16_t *restrict s, size_t n)
{
    size_t i = 0;

    for (; i + LANES <= n; i += LANES)
        for (size_t k = 0; k < LANES; k++)
            d[i + k] = bf16_to_f32(s[i + k]);
    for (; i < n; i++)
        d[i] = bf16_to_f32(s[i]);
}

HOT static void f32_to_f16_n(uint16_t *restrict d, const float *restrict s, size_t n)
{
    size_t i = 0;

    for (; i + LANES <= n; i += LANES)
        for (size_t k = 0; k < LANES; k++)
            d[i + k] = f16_from_f32(s[i + k]);
    for (; i < n; i++)
        d[i] = f16_from_f32(s[i]);
}

static void f32_to_bf16_n(uint16_t *restrict d, const float *restrict s, size_t n)
{
    size_t i = 0;

    for (; i + LANES <= n; i += LANES)
        for (size_t k = 0; k < LANES; k++)
            d[i + k] = bf16_from_f32(s[i + k]);
    for (; i < n; i++)
        d[i] = bf16_from_f32(s[i]);
}

int hm_avg_to_f32(float *dst, int dtype, const void *src, size_t n)
{
    switch (dtype) {
    case HM_DTYPE_F32:
        if (n > 0 && (const void *)dst != src)
            memmove(dst, src, n * sizeof(float));
        return 0;
    case HM_DTYPE_F16:
        f16_to_f32_n(dst, src, n);
        return 0;
    case HM_DTYPE_BF16:
        bf16_to_f32_n(dst, src, n);
        return 0;
    default:
        return -EINVAL;
    }
}

int hm_avg_from_f32(void *dst, int dtype, const float *src, size_t n)
{
    switch (dtype) {
    case HM_DTYPE_F32:
        if (n > 0 && dst != (const void *)src)
            memmove(dst, src, n * sizeof(float));
        return 0;
    case HM_DTYPE_F16:
        f32_to_f16_n(dst, src, n);
        return 0;
    case HM_DTYPE_BF16:
        f32_to_bf16_n(dst, src, n);
        return 0;
    default:
        return -EINVAL;
    }
}

/* ---- little-endian helpers ---- */

static inline uint32_t get_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint16_t get_le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static inline void put_le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

/* ---- finiteness ---- */

static inline uint32_t not_finite(float f) { return (f32_bits(f) & F32_EXP_MASK) == F32_EXP_MASK; }

HOT int hm_avg_all_finite(const float *x, size_t n)
{
    uint32_t bad = 0;
    size_t i = 0;

    /* An early exit per block, none inside one, so that the inner loop vectorizes. */
    for (; i + BLOCK <= n; i += BLOCK) {
        for (size_t k = 0; k < BLOCK; k++)
            bad |= not_finite(x[i + k]);
        if (bad)
            return 0;
    }
    for (; i < n; i++)
        bad |= not_finite(x[i]);
    return !bad;
}

HOT void hm_avg_weighted_mean(const float *const *xs, const double *w, size_t m, size_t n,
                              double total, float *out)
{
    double acc[BLOCK];
    size_t i = 0;

    /* Whole blocks (a constant trip count, which -O2 vectorizes), then the tail. */
    for (; i + BLOCK <= n; i += BLOCK) {
        for (size_t k = 0; k < BLOCK; k++)
            acc[k] = 0.0;
        for (size_t j = 0; j < m; j++) {
            const float *x = xs[j] + i;
            double wj = w[j];
            for (size_t k = 0; k < BLOCK; k++)
                acc[k] += wj * (double)x[k];
        }
        for (size_t k = 0; k < BLOCK; k++)
            out[i + k] = (float)(acc[k] / total);
    }
    for (; i < n; i++) {
        double a = 0.0;
        for (size_t j = 0; j < m; j++)
            a += w[j] * (double)xs[j][i];
        out[i] = (float)(a / total);
    }
}

/* ---- chunk compression ---- */

static size_t elem_bytes(int comp)
{
    switch (comp) {
    case HM_AVG_COMP_NONE:
        return 4;
    case HM_AVG_COMP_FP16:
        return 2;
    case HM_AVG_COMP_UINT8:
        return 1;
    default:
        return 0;
    }
}

size_t hm_avg_chunk_size(int comp, size_t n)
{
    size_t eb = elem_bytes(comp);

    if (eb == 0 || n > HM_AVG_CHUNK_MAX_ELEMS)
        return 0;
    return HM_AVG_CHUNK_HEADER + (comp == HM_AVG_COMP_UINT8 ? HM_AVG_CHUNK_UINT8_PARAMS : 0) +
           n * eb;
}

/*
 * Order-preserving map from finite floats to signed integers (negative
 * floats have their magnitude bits flipped), so that the min/max search of
 * an 8-bit chunk is an integer reduction, which vectorizes where a float
 * one (with its NaN and signed-zero rules) does not.
 */
static inline int32_t order_key(uint32_t bits)
{
    int32_t s = (int32_t)bits;
    return s ^ (int32_t)((uint32_t)(s >> 31) & F32_ABS_MASK);
}

static inline float key_to_f32(int32_t k)
{
    return bits_f32((uint32_t)(k ^ (int32_t)((uint32_t)(k >> 31) & F32_ABS_MASK)));
}

static int encode_none(const float *x, size_t n, uint8_t *p)
{
    if (!hm_avg_all_finite(x, n))
        return -EDOM;
    if (HOST_LE) {
        if (n > 0)
            memcpy(p, x, n * 4);
    } else {
        for (size_t i = 0; i < n; i++)
            put_le32(p + 4 * i, f32_bits(x[i]));
    }
    return 0;
}

/* Whether x fits fp16: 0, -EDOM (NaN or infinity) or -ERANGE (over 65504). */
HOT static int fp16_check(const float *x, size_t n)
{
    uint32_t max_abs = 0;
    size_t i = 0;

    /* One scan decides the error: a NaN or infinity beats a value out of range. */
    for (; i + LANES <= n; i += LANES)
        for (size_t k = 0; k < LANES; k++)
            max_abs = HM_MAX(max_abs, f32_bits(x[i + k]) & F32_ABS_MASK);
    for (; i < n; i++)
        max_abs = HM_MAX(max_abs, f32_bits(x[i]) & F32_ABS_MASK);
    if (max_abs >= F32_EXP_MASK)
        return -EDOM;
    if (max_abs > F16_MAX_BITS)
        return -ERANGE;
    return 0;
}

static int encode_fp16(const float *x, size_t n, uint8_t *p)
{
    uint16_t h[BLOCK];
    size_t i;
    int rc;

    if ((rc = fp16_check(x, n)) < 0)
        return rc;
    for (i = 0; i < n; i += BLOCK) {
        size_t len = HM_MIN(BLOCK, n - i);
        f32_to_f16_n(h, x + i, len);
        if (HOST_LE) {
            memcpy(p + 2 * i, h, 2 * len);
        } else {
            for (size_t k = 0; k < len; k++) {
                p[2 * (i + k)] = (uint8_t)h[k];
                p[2 * (i + k) + 1] = (uint8_t)(h[k] >> 8);
            }
        }
    }
    return 0;
}

/*
 * 8 bits: q = round((x - min) * 255 / (max - min)), in double. Rounding to
 * nearest keeps every element within half a step; the clamp only guards
 * against the last ulp of the multiplication.
 */
static inline uint8_t quantize(float x, float mn, double inv)
{
    double t = ((double)x - (double)mn) * inv + 0.5;

    return (uint8_t)(int32_t)HM_MIN(t, 255.0);
}

HOT static void quantize_n(uint8_t *restrict q, const float *restrict x, size_t n, float mn,
                       double inv)
{
    size_t i = 0;

    for (; i + LANES <= n; i += LANES)
        for (size_t k = 0; k < LANES; k++)
            q[i + k] = quantize(x[i + k], mn, inv);
    for (; i < n; i++)
        q[i] = quantize(x[i], mn, inv);
}

/* The chunk's extremes (0 and 0 when empty); -EDOM when some value is not finite. */
HOT static int u8_range(const float *restrict x, size_t n, float *mn_out, float *mx_out)
{
    uint32_t max_abs = 0;
    int32_t kmin = INT32_MAX, kmax = INT32_MIN;
    size_t i = 0;

    for (; i + LANES <= n; i += LANES) {
        for (size_t k = 0; k < LANES; k++) {
            uint32_t b = f32_bits(x[i + k]);
            max_abs = HM_MAX(max_abs, b & F32_ABS_MASK);
            kmin = HM_MIN(kmin, order_key(b));
            kmax = HM_MAX(kmax, order_key(b));
        }
    }
    for (; i < n; i++) {
        uint32_t b = f32_bits(x[i]);
        max_abs = HM_MAX(max_abs, b & F32_ABS_MASK);
        kmin = HM_MIN(kmin, order_key(b));
        kmax = HM_MAX(kmax, order_key(b));
    }
    if (max_abs >= F32_EXP_MASK)
        return -EDOM;
    *mn_out = n > 0 ? key_to_f32(kmin) : 0.0f;
    *mx_out = n > 0 ? key_to_f32(kmax) : 0.0f;
    return 0;
}

int hm_avg_coding_cost(int comp, const float *v, size_t n, double *cost)
{
    if (comp == HM_AVG_COMP_FP16) {
        if (!hm_avg_all_finite(v, n))
            return -EDOM;
        double acc = 0;
        for (size_t i = 0; i < n; i++)
            acc += (double)v[i] * (double)v[i];
        *cost = acc;
        return 0;
    }
    float mn, mx;
    if (u8_range(v, n, &mn, &mx) < 0)
        return -EDOM;
    *cost = (double)mx - (double)mn;
    return 0;
}

HOT int hm_avg_diff_cost(int comp, const float *restrict ans, const float *restrict part,
                         float *restrict diff, size_t n, double *cost)
{
    for (size_t i = 0; i < n; i++)
        diff[i] = (float)((double)ans[i] - (double)part[i]);
    return hm_avg_coding_cost(comp, diff, n, cost);
}

static int encode_uint8(const float *restrict x, size_t n, uint8_t *restrict p)
{
    float mn, mx;
    double spread, inv;
    int rc;

    if ((rc = u8_range(x, n, &mn, &mx)) < 0)
        return rc;
    put_le32(p, f32_bits(mn));
    put_le32(p + 4, f32_bits(mx));
    spread = (double)mx - (double)mn;
    /* A constant chunk has every q at 0 and decodes to min exactly. */
    inv = spread > 0.0 ? 255.0 / spread : 0.0;
    quantize_n(p + HM_AVG_CHUNK_UINT8_PARAMS, x, n, mn, inv);
    return 0;
}

int hm_avg_chunk_encode(int comp, const float *x, size_t n, uint8_t *out, size_t out_cap,
                        size_t *out_len)
{
    size_t need;
    int result;

    *out_len = 0;
    if (elem_bytes(comp) == 0)
        return -EINVAL;
    need = hm_avg_chunk_size(comp, n);
    if (need == 0 || out_cap < need)
        return -EMSGSIZE;
    out[0] = (uint8_t)comp;
    out[1] = out[2] = out[3] = 0;
    put_le32(out + 4, (uint32_t)n);
    switch (comp) {
    case HM_AVG_COMP_NONE:
        result = encode_none(x, n, out + HM_AVG_CHUNK_HEADER);
        break;
    case HM_AVG_COMP_FP16:
        result = encode_fp16(x, n, out + HM_AVG_CHUNK_HEADER);
        break;
    default:
        result = encode_uint8(x, n, out + HM_AVG_CHUNK_HEADER);
        break;
    }
    if (result == 0)
        *out_len = need;
    return result;
}

int hm_avg_chunk_none_view(const float *x, size_t n, uint8_t hdr[HM_AVG_CHUNK_HEADER])
{
    if (!HOST_LE)
        return -ENOTSUP;
    if (n > HM_AVG_CHUNK_MAX_ELEMS)
        return -EMSGSIZE;
    if (!hm_avg_all_finite(x, n))
        return -EDOM;
    hdr[0] = HM_AVG_COMP_NONE;
    hdr[1] = hdr[2] = hdr[3] = 0;
    put_le32(hdr + 4, (uint32_t)n);
    return 0;
}

int hm_avg_chunk_peek(const uint8_t *buf, size_t len, int *comp, size_t *n)
{
    size_t count, need;
    int c;

    if (len < HM_AVG_CHUNK_HEADER)
        return -EPROTO;
    c = buf[0];
    if (elem_bytes(c) == 0 || buf[1] != 0 || buf[2] != 0 || buf[3] != 0)
        return -EPROTO;
    count = get_le32(buf + 4);
    if (count > HM_AVG_CHUNK_MAX_ELEMS)
        return -EMSGSIZE;
    need = hm_avg_chunk_size(c, count);
    if (len != need)
        return -EPROTO;
    if (comp != NULL)
        *comp = c;
    if (n != NULL)
        *n = count;
    return 0;
}

static int decode_none(const uint8_t *p, size_t n, float *out)
{
    if (HOST_LE) {
        if (n > 0)
            memcpy(out, p, n * 4);
    } else {
        for (size_t i = 0; i < n; i++)
            out[i] = bits_f32(get_le32(p + 4 * i));
    }
    return hm_avg_all_finite(out, n) ? 0 : -EDOM;
}

/* Nonzero when some h[k] is an fp16 infinity or NaN (exponent all ones). */
HOT static uint32_t f16_special_n(const uint16_t *h, size_t n)
{
    uint32_t bad = 0;
    size_t i = 0;

    for (; i + LANES <= n; i += LANES)
        for (size_t k = 0; k < LANES; k++)
            bad |= (h[i + k] & 0x7c00u) == 0x7c00u;
    for (; i < n; i++)
        bad |= (h[i] & 0x7c00u) == 0x7c00u;
    return bad;
}

static int decode_fp16(const uint8_t *restrict p, size_t n, float *restrict out)
{
    uint16_t h[BLOCK];
    uint32_t bad = 0;

    for (size_t i = 0; i < n; i += BLOCK) {
        size_t len = HM_MIN(BLOCK, n - i);
        if (HOST_LE) {
            memcpy(h, p + 2 * i, 2 * len);
        } else {
            for (size_t k = 0; k < len; k++)
                h[k] = get_le16(p + 2 * (i + k));
        }
        bad |= f16_special_n(h, len);
        f16_to_f32_n(out + i, h, len);
    }
    return bad ? -EDOM : 0;
}

static inline float dequantize(uint8_t q, float mn, float mx)
{
    return (float)(((double)(255 - q) * (double)mn + (double)q * (double)mx) / 255.0);
}

/*
 * The 256 values a chunk's q can stand for, each computed as dequantize
 * does: a chunk is then decoded by table lookups, with the same results
 * as 256 divisions instead of one per element (about 3x faster here).
 */
static void dequantize_table(float lut[256], float mn, float mx)
{
    for (unsigned k = 0; k < 256; k++)
        lut[k] = dequantize((uint8_t)k, mn, mx);
}

static int decode_uint8(const uint8_t *restrict p, size_t n, float *restrict out)
{
    const uint8_t *restrict q = p + HM_AVG_CHUNK_UINT8_PARAMS;
    float mn = bits_f32(get_le32(p));
    float mx = bits_f32(get_le32(p + 4));
    size_t i;

    /* isfinite is false for NaN, and NaN fails min <= max too. */
    if (!isfinite(mn) || !isfinite(mx) || !(mn <= mx))
        return -EPROTO;
    /*
     * min + q * (max - min) / 255, written as a weighted mean of the two ends
     * so that it stays within [min, max] and q = 0 and q = 255 give them back
     * exactly; the products are exact in double.
     */
    float lut[256];
    dequantize_table(lut, mn, mx);
    /*
     * Every value lies in [min, max], so this cannot fail; it stays as the
     * same last line of defence as the other formats have. Every element
     * is one of the table's values, so the table is what is checked.
     */
    if (!hm_avg_all_finite(lut, 256))
        return -EDOM;
    for (i = 0; i < n; i++)
        out[i] = lut[q[i]];
    return 0;
}

int hm_avg_chunk_decode(const uint8_t *buf, size_t len, float *out, size_t out_cap,
                        size_t *n_out)
{
    size_t n;
    int comp, result;

    *n_out = 0;
    if ((result = hm_avg_chunk_peek(buf, len, &comp, &n)) < 0)
        return result;
    if (n > out_cap)
        return -EMSGSIZE;
    switch (comp) {
    case HM_AVG_COMP_NONE:
        result = decode_none(buf + HM_AVG_CHUNK_HEADER, n, out);
        break;
    case HM_AVG_COMP_FP16:
        result = decode_fp16(buf + HM_AVG_CHUNK_HEADER, n, out);
        break;
    default:
        result = decode_uint8(buf + HM_AVG_CHUNK_HEADER, n, out);
        break;
    }
    if (result == 0)
        *n_out = n;
    return result;
}

/*
 * The values a receiver decodes from hm_avg_chunk_encode(comp, x, n), bit
 * for bit, computed without the bytes: the same conversions and the same
 * quantization run block by block through the stack.
 */
int hm_avg_chunk_roundtrip(int comp, const float *x, size_t n, float *out)
{
    uint16_t h[BLOCK];
    uint8_t q[BLOCK];
    float lut[256];
    float mn, mx;
    double spread, inv;
    int rc;

    if (elem_bytes(comp) == 0)
        return -EINVAL;
    if (n > HM_AVG_CHUNK_MAX_ELEMS)
        return -EMSGSIZE;
    switch (comp) {
    case HM_AVG_COMP_NONE:
        if (!hm_avg_all_finite(x, n))
            return -EDOM;
        if (n > 0 && out != x)
            memmove(out, x, n * sizeof(float));
        return 0;
    case HM_AVG_COMP_FP16:
        if ((rc = fp16_check(x, n)) < 0)
            return rc;
        for (size_t i = 0; i < n; i += BLOCK) {
            size_t len = HM_MIN(BLOCK, n - i);
            f32_to_f16_n(h, x + i, len);
            f16_to_f32_n(out + i, h, len);
        }
        return 0;
    default:
        if ((rc = u8_range(x, n, &mn, &mx)) < 0)
            return rc;
        spread = (double)mx - (double)mn;
        inv = spread > 0.0 ? 255.0 / spread : 0.0;
        dequantize_table(lut, mn, mx);
        for (size_t i = 0; i < n; i += BLOCK) {
            size_t len = HM_MIN(BLOCK, n - i);
            quantize_n(q, x + i, len, mn, inv);
            for (size_t k = 0; k < len; k++)
                out[i + k] = lut[q[k]];
        }
        return 0;
    }
}

HOT void hm_avg_answer_apply(float *out, const float *x, const float *qx, const float *ans, size_t n,
                         int is_delta, double share)
{
    /* 0 or 1 times the part: one loop for both forms, still branch-free inside. */
    double part = is_delta ? 1.0 : 0.0;
    size_t i = 0;

    /* Each element is read before it is written, so out may be x or ans. */
    for (; i + LANES <= n; i += LANES)
        for (size_t k = 0; k < LANES; k++) {
            double v = (double)qx[i + k];
            out[i + k] = (float)(part * v + (double)ans[i + k] + share * ((double)x[i + k] - v));
        }
    for (; i < n; i++) {
        double v = (double)qx[i];
        out[i] = (float)(part * v + (double)ans[i] + share * ((double)x[i] - v));
    }
}

/* ---- weighted accumulation ---- */

/* A weight must become a finite, non-negative float for saxpy. */
static int weight_ok(double w) { return w >= 0.0 && w <= FLT_MAX; }

static void saxpy(float *acc, const float *x, size_t n, float w)
{
    for (size_t i = 0; i < n; i += BLAS_RUN) {
        size_t len = HM_MIN(BLAS_RUN, n - i);
        cblas_saxpy((blasint)len, w, x + i, 1, acc + i, 1);
    }
}

int hm_avg_accumulate(float *acc, const float *x, size_t n, double w)
{
    if (!weight_ok(w))
        return -EDOM;
    if (w > 0.0)
        saxpy(acc, x, n, (float)w);
    return 0;
}

int hm_avg_accumulate_dtype(float *acc, int dtype, const void *x, size_t n, double w)
{
    float block[BLOCK];
    const uint16_t *h = x;

    if (dtype == HM_DTYPE_F32)
        return hm_avg_accumulate(acc, x, n, w);
    if (dtype != HM_DTYPE_F16 && dtype != HM_DTYPE_BF16)
        return -EINVAL;
    if (!weight_ok(w))
        return -EDOM;
    if (w == 0.0)
        return 0;
    for (size_t i = 0; i < n; i += BLOCK) {
        size_t len = HM_MIN(BLOCK, n - i);
        hm_avg_to_f32(block, dtype, h + i, len);
        saxpy(acc + i, block, len, (float)w);
    }
    return 0;
}

/*
 * Not cblas_sscal: multiplying by a rounded 1/total rounds twice, and a
 * plain loop divides in double (one rounding per element) and checks for
 * overflow in the same pass over memory.
 */
int hm_avg_finalize(float *acc, size_t n, double total_weight)
{
    uint32_t bad = 0;
    size_t i = 0;

    if (!(total_weight > 0.0) || !isfinite(total_weight))
        return -EDOM;
    for (; i + LANES <= n; i += LANES) {
        for (size_t k = 0; k < LANES; k++) {
            acc[i + k] = (float)((double)acc[i + k] / total_weight);
            bad |= not_finite(acc[i + k]);
        }
    }
    for (; i < n; i++) {
        acc[i] = (float)((double)acc[i] / total_weight);
        bad |= not_finite(acc[i]);
    }
    return bad ? -EDOM : 0;
}

/* ---- CenteredClip ---- */

/* t[k] += c * x[k] for k < len, in double (vectorized, see the top). */
static void axpy_d(double *restrict t, double c, const float *restrict x, size_t len)
{
    size_t k = 0;

    for (; k + LANES <= len; k += LANES)
        for (size_t l = 0; l < LANES; l++)
            t[k + l] += c * (double)x[k + l];
    for (; k < len; k++)
        t[k] += c * (double)x[k];
}

/*
 * The smallest of val[0..n) whose cumulative weight (over values not above
 * it) reaches half: quickselect with a three-way partition, expected O(n).
 * The answer always has positive weight, since half is positive. val and
 * wt are reordered.
 */
static float weighted_median(float *val, double *wt, size_t n, double half)
{
    size_t lo = 0, hi = n;
    double below = 0.0; /* weight of the values known to lie below [lo, hi) */

    while (hi - lo > 1) {
        float a = val[lo], b = val[lo + (hi - lo) / 2], c = val[hi - 1];
        /* Median of three as the pivot. */
        float p = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        size_t lt = lo, i = lo, gt = hi;
        double wl = 0.0, we = 0.0;

        /* [lo, lt) < p, [lt, i) == p, [gt, hi) > p. */
        while (i < gt) {
            if (val[i] < p) {
                float tv = val[i];
                double tw = wt[i];
                wl += tw;
                val[i] = val[lt];
                wt[i] = wt[lt];
                val[lt] = tv;
                wt[lt] = tw;
                lt++;
                i++;
            } else if (val[i] > p) {
                float tv = val[i];
                double tw = wt[i];
                gt--;
                val[i] = val[gt];
                wt[i] = wt[gt];
                val[gt] = tv;
                wt[gt] = tw;
            } else {
                we += wt[i];
                i++;
            }
        }
        if (below + wl >= half) {
            hi = lt;
        } else if (below + wl + we >= half) {
            return p;
        } else {
            below += wl + we;
            lo = gt;
        }
    }
    return val[lo];
}

static void weighted_median_n(const float *const *xs, const double *share, size_t n, size_t m,
                              float *v)
{
    float val[HM_AVG_CLIP_MAX_INPUTS];
    double wt[HM_AVG_CLIP_MAX_INPUTS];
    double half = 0.0;

    for (size_t j = 0; j < n; j++)
        half += share[j];
    half /= 2.0;
    for (size_t i = 0; i < m; i++) {
        for (size_t j = 0; j < n; j++) {
            val[j] = xs[j][i];
            wt[j] = share[j];
        }
        v[i] = weighted_median(val, wt, n, half);
    }
}

static double distance(const float *x, const float *v, size_t m)
{
    double s = 0.0;

    for (size_t i = 0; i < m; i++) {
        double d = (double)x[i] - (double)v[i];
        s += d * d;
    }
    return sqrt(s);
}

/*
 * One step v += sum_j c[j] * (xs[j] - v), in blocks, as
 * v += sum_j c[j] * xs[j] - (sum_j c[j]) * v with the sums in double;
 * returns the step's L2 norm (of what was actually applied, after rounding
 * v to float).
 */
static double clip_step(const float *const *xs, const double *c, size_t n, size_t m, float *v)
{
    double t[BLOCK];
    double moved = 0.0, csum = 0.0;

    for (size_t j = 0; j < n; j++)
        csum += c[j];
    for (size_t i = 0; i < m; i += BLOCK) {
        size_t len = HM_MIN(BLOCK, m - i);
        for (size_t k = 0; k < len; k++)
            t[k] = -csum * (double)v[i + k];
        for (size_t j = 0; j < n; j++)
            axpy_d(t, c[j], xs[j] + i, len);
        for (size_t k = 0; k < len; k++) {
            float nv = (float)((double)v[i + k] + t[k]);
            double d = (double)nv - (double)v[i + k];
            moved += d * d;
            v[i + k] = nv;
        }
    }
    return sqrt(moved);
}

int hm_avg_centered_clip(const float *const *xs, const double *w, size_t n, size_t m,
                         double tau, unsigned iters, float *v)
{
    double share[HM_AVG_CLIP_MAX_INPUTS];
    double c[HM_AVG_CLIP_MAX_INPUTS];
    double total = 0.0;
    unsigned it;

    if (n == 0 || n > HM_AVG_CLIP_MAX_INPUTS || !(tau > 0.0) || !isfinite(tau) ||
        iters > HM_AVG_CLIP_MAX_ITERS)
        return -EINVAL;
    for (size_t j = 0; j < n; j++) {
        if (!(w[j] >= 0.0) || !isfinite(w[j]) || xs[j] == v)
            return -EINVAL;
        total += w[j];
    }
    if (!(total > 0.0) || !isfinite(total))
        return -EINVAL;
    for (size_t j = 0; j < n; j++)
        if (!hm_avg_all_finite(xs[j], m))
            return -EDOM;

    for (size_t j = 0; j < n; j++)
        share[j] = w[j] / total;
    weighted_median_n(xs, share, n, m, v);
    for (it = 0; it < iters;) {
        for (size_t j = 0; j < n; j++) {
            double dist = distance(xs[j], v, m);
            /* An input within tau of v (or at v) pulls with its full weight. */
            c[j] = dist > tau ? share[j] * (tau / dist) : share[j];
        }
        it++;
        if (clip_step(xs, c, n, m, v) <= 1e-6 * tau)
            break;
    }
    return (int)it;
}

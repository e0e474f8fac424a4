/*
 * Tests for the averaging codec: fp16 and bf16 conversions agree with
 * independent references (every half value, every rounding midpoint,
 * random floats across all exponents), chunk compression round-trips within
 * the error bounds codec.h documents, malformed or non-finite chunks from a
 * peer are refused with the documented error, weighted accumulation matches
 * a double-precision reference, and CenteredClip resists an outlier that
 * drags the plain mean away.
 */
#include "config.h"

#include "averaging/codec.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ---- */

/* splitmix64: deterministic, so that a failure reproduces. */
struct rng {
    uint64_t s;
};

static uint64_t rng_next(struct rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1). */
static double rng_unit(struct rng *r) { return (double)(rng_next(r) >> 11) * 0x1p-53; }

static double rng_range(struct rng *r, double lo, double hi) { return lo + (hi - lo) * rng_unit(r); }

/* Standard normal (Box-Muller). */
static double rng_normal(struct rng *r)
{
    double u = rng_unit(r), v = rng_unit(r);
    return sqrt(-2.0 * log(1.0 - u)) * cos(2.0 * M_PI * v);
}

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float *alloc_floats(size_t n)
{
    float *p = malloc((n ? n : 1) * sizeof(float));
    cr_assert_not_null(p);
    return p;
}

/*
 * Reference fp16 decoder by definition: (-1)^s * 2^(e-15) * (1 + m/1024)
 * for normals, 2^-24 * m for subnormals.
 */
static double ref_f16_value(uint16_t h)
{
    int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v;

    if (e == 31)
        return m ? NAN : (s ? -INFINITY : INFINITY);
    v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return s ? -v : v;
}

/*
 * Reference fp32 -> fp16 by definition, in double: scale to an integer
 * count of the target's steps and let nearbyint (round to nearest even, the
 * default mode) round it.
 */
static uint16_t ref_f16_from(float x)
{
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    double a = fabs((double)x);
    int ex, e;
    double m;

    if (isnan(x))
        return sign | 0x7e00;
    if (a < 0x1p-14)
        return sign | (uint16_t)nearbyint(a * 0x1p24); /* 1024 becomes 0x400, the least normal */
    frexp(a, &ex);
    e = ex - 1; /* a in [2^e, 2^(e+1)) */
    m = nearbyint(ldexp(a, 10 - e));
    if (m == 2048.0) {
        m = 1024.0;
        e++;
    }
    if (e + 15 >= 31)
        return sign | 0x7c00;
    return sign | (uint16_t)((e + 15) << 10 | ((int)m - 1024));
}

/* Reference fp32 -> bf16: nearest of the two truncations, ties to even. */
static uint16_t ref_bf16_from(float x)
{
    uint32_t b = bits_of(x);
    uint16_t lo = (uint16_t)(b >> 16), hi = (uint16_t)(lo + 1);
    double dlo, dhi, dx = x;

    if (isnan(x))
        return (uint16_t)(lo | 0x40);
    if ((b & 0xffff) == 0)
        return lo;
    dlo = from_bits((uint32_t)lo << 16);
    /* hi may be infinity (rounding FLT_MAX up): its distance is then by 2^128. */
    dhi = (hi & 0x7f80) == 0x7f80 ? copysign(0x1p128, dx) : from_bits((uint32_t)hi << 16);
    if (fabs(dx - dlo) < fabs(dhi - dx))
        return lo;
    if (fabs(dx - dlo) > fabs(dhi - dx))
        return hi;
    return (lo & 1) ? hi : lo;
}

static int is_nan16(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

/* ---- fp16 ---- */

Test(avg_codec, f16_every_half_decodes_exactly_and_round_trips)
{
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float f = hm_avg_f16_to_f32(h);
        double ref = ref_f16_value(h);

        if (is_nan16(h)) {
            cr_assert(isnan(f), "half 0x%04x", h);
            cr_assert_eq(!!signbit(f), h >> 15);
            /* Back to a quiet NaN of the same sign. */
            cr_assert(is_nan16(hm_avg_f16_from_f32(f)) &&
                      (hm_avg_f16_from_f32(f) & 0x8200) == (h & 0x8000) + 0x200);
            continue;
        }
        cr_assert((double)f == ref, "half 0x%04x: %a != %a", h, f, ref);
        cr_assert_eq(!!signbit(f), h >> 15, "sign of 0x%04x", h);
        cr_assert_eq(hm_avg_f16_from_f32(f), h, "0x%04x did not round-trip", h);
    }
}

Test(avg_codec, f16_rounds_every_midpoint_to_even)
{
    /* Between every pair of adjacent positive halfs, up to infinity. */
    for (uint32_t h = 0; h < 0x7c00; h++) {
        double lo = ref_f16_value((uint16_t)h);
        /* Above 65504 the next "half" is where the exponent would continue: 65536. */
        double hi = h + 1 == 0x7c00 ? 65536.0 : ref_f16_value((uint16_t)(h + 1));
        float mid = (float)((lo + hi) / 2); /* exact: one more bit than a half */
        uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;

        cr_assert_eq((double)mid, (lo + hi) / 2);
        cr_assert_eq(hm_avg_f16_from_f32(mid), even, "midpoint above 0x%04x", h);
        cr_assert_eq(hm_avg_f16_from_f32(nextafterf(mid, 0.0f)), h, "below mid 0x%04x", h);
        cr_assert_eq(hm_avg_f16_from_f32(nextafterf(mid, INFINITY)), h + 1, "above mid 0x%04x", h);
        cr_assert_eq(hm_avg_f16_from_f32(-mid), even | 0x8000);
    }
}

Test(avg_codec, f16_special_values)
{
    static const struct {
        float x;
        uint16_t h;
    } cases[] = {
        {0.0f, 0x0000},          {-0.0f, 0x8000},         {1.0f, 0x3c00},
        {-2.0f, 0xc000},         {65504.0f, 0x7bff},      {65519.996f, 0x7bff},
        {65520.0f, 0x7c00},      {1e9f, 0x7c00},          {-FLT_MAX, 0xfc00},
        {INFINITY, 0x7c00},      {-INFINITY, 0xfc00},     {0x1p-14f, 0x0400},
        {0x1p-24f, 0x0001},      {0x1p-25f, 0x0000},      {0x1.8p-25f, 0x0001},
        {0x1.8p-24f, 0x0002},    {-0x1p-26f, 0x8000},     {0x1.ff8p-15f, 0x03ff},
        {FLT_MIN, 0x0000},       {1.0f / 3.0f, 0x3555},   {0x1.ffcp-15f, 0x0400},
        {0x1.002p0f, 0x3c00},    {0x1.002002p0f, 0x3c01}, {0x1.006p0f, 0x3c02},
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        cr_assert_eq(hm_avg_f16_from_f32(cases[i].x), cases[i].h, "case %zu (%a): 0x%04x", i,
                     cases[i].x, hm_avg_f16_from_f32(cases[i].x));
    cr_assert(isnan(hm_avg_f16_to_f32(hm_avg_f16_from_f32(NAN))));
    cr_assert(isnan(hm_avg_f16_to_f32(hm_avg_f16_from_f32(-NAN))));
    cr_assert(hm_avg_f16_to_f32(0x7c00) == INFINITY);
    cr_assert(hm_avg_f16_to_f32(0xfc00) == -INFINITY);
    cr_assert(hm_avg_f16_to_f32(0x0001) == 0x1p-24f);
    cr_assert(hm_avg_f16_to_f32(0x03ff) == 0x1.ff8p-15f);
}

Test(avg_codec, f16_random_floats_match_references)
{
    struct rng r = {1};

    for (int i = 0; i < 2000000; i++) {
        /* Half of them anywhere in fp32, half within fp16's range and just past it. */
        uint32_t b = (uint32_t)rng_next(&r);
        float x = (i & 1) ? from_bits(b) : (float)ldexp(rng_range(&r, -1, 1), (int)(b % 46) - 28);
        uint16_t got = hm_avg_f16_from_f32(x);

        if (isnan(x)) {
            cr_assert(is_nan16(got));
            continue;
        }
        cr_assert_eq(got, ref_f16_from(x), "%a: 0x%04x != 0x%04x", x, got, ref_f16_from(x));
#ifdef __FLT16_MANT_DIG__
        {
            /* The compiler's own conversion, where it has one. */
            _Float16 c = (_Float16)x;
            uint16_t cb;
            memcpy(&cb, &c, 2);
            cr_assert_eq(got, cb, "%a: 0x%04x != compiler's 0x%04x", x, got, cb);
        }
#endif
    }
}

/* ---- bf16 ---- */

Test(avg_codec, bf16_round_trips_and_rounds_to_nearest_even)
{
    struct rng r = {2};

    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float f = hm_avg_bf16_to_f32(h);
        cr_assert_eq(bits_of(f), (uint32_t)h << 16);
        if (isnan(f))
            cr_assert_eq(hm_avg_bf16_from_f32(f), h | 0x40);
        else
            cr_assert_eq(hm_avg_bf16_from_f32(f), h);
    }
    /* Ties: 1 + 2^-8 is halfway between 1 and 1 + 2^-7. */
    cr_assert_eq(hm_avg_bf16_from_f32(0x1.01p0f), 0x3f80);
    cr_assert_eq(hm_avg_bf16_from_f32(0x1.03p0f), 0x3f82);
    cr_assert_eq(hm_avg_bf16_from_f32(0x1.010002p0f), 0x3f81);
    cr_assert_eq(hm_avg_bf16_from_f32(FLT_MAX), 0x7f80); /* past bf16's largest finite */
    cr_assert_eq(hm_avg_bf16_from_f32(-INFINITY), 0xff80);
    cr_assert(isnan(hm_avg_bf16_to_f32(hm_avg_bf16_from_f32(NAN))));
    for (int i = 0; i < 2000000; i++) {
        float x = from_bits((uint32_t)rng_next(&r));
        uint16_t got = hm_avg_bf16_from_f32(x);
        if (isnan(x))
            cr_assert(isnan(hm_avg_bf16_to_f32(got)));
        else
            cr_assert_eq(got, ref_bf16_from(x), "%a", x);
    }
}

Test(avg_codec, bulk_conversions_equal_scalar_ones)
{
    struct rng r = {3};
    /* Lengths around the vectorized runs' edges. */
    static const size_t lens[] = {0, 1, 15, 16, 17, 1023, 1024, 1025, 3001};
    float *src = alloc_floats(3001), *back = alloc_floats(3001);
    uint16_t *h = malloc(3001 * 2);

    cr_assert_not_null(h);
    for (size_t i = 0; i < 3001; i++)
        src[i] = (float)(rng_normal(&r) * ldexp(1.0, (int)(rng_next(&r) % 40) - 20));
    for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
        size_t n = lens[li];

        cr_assert_eq(hm_avg_from_f32(h, HM_DTYPE_F16, src, n), 0);
        cr_assert_eq(hm_avg_to_f32(back, HM_DTYPE_F16, h, n), 0);
        for (size_t i = 0; i < n; i++) {
            cr_assert_eq(h[i], hm_avg_f16_from_f32(src[i]));
            cr_assert_eq(bits_of(back[i]), bits_of(hm_avg_f16_to_f32(h[i])));
        }
        cr_assert_eq(hm_avg_from_f32(h, HM_DTYPE_BF16, src, n), 0);
        cr_assert_eq(hm_avg_to_f32(back, HM_DTYPE_BF16, h, n), 0);
        for (size_t i = 0; i < n; i++) {
            cr_assert_eq(h[i], hm_avg_bf16_from_f32(src[i]));
            cr_assert_eq(bits_of(back[i]), (uint32_t)h[i] << 16);
        }
        cr_assert_eq(hm_avg_to_f32(back, HM_DTYPE_F32, src, n), 0);
        cr_assert(n == 0 || memcmp(back, src, n * 4) == 0);
    }
    /* In place for fp32 is allowed. */
    cr_assert_eq(hm_avg_to_f32(src, HM_DTYPE_F32, src, 3001), 0);
    cr_assert_eq(hm_avg_to_f32(back, HM_DTYPE_U8, h, 4), -EINVAL);
    cr_assert_eq(hm_avg_from_f32(h, 99, src, 4), -EINVAL);
    free(src);
    free(back);
    free(h);
}

/* ---- chunk compression ---- */

/* The bound codec.h documents for one element. */
static double documented_bound(int comp, float x, float mn, float mx)
{
    switch (comp) {
    case HM_AVG_COMP_NONE:
        return 0.0;
    case HM_AVG_COMP_FP16:
        return fabsf(x) >= 0x1p-14f ? 0x1p-11 * fabs((double)x) : 0x1p-25;
    default:
        return ((double)mx - (double)mn) / 510.0 +
               0x1p-23 * fmax(fabs((double)mn), fabs((double)mx)) + 0x1p-149;
    }
}

/*
 * Encodes x, decodes it, checks sizes and returns the largest error as a
 * fraction of the element's documented bound (0 when exact).
 */
static double round_trip(int comp, const float *x, size_t n)
{
    size_t cap = hm_avg_chunk_size(comp, n), len = 0, got = 0;
    uint8_t *buf = malloc(cap);
    float *out = alloc_floats(n);
    float mn = INFINITY, mx = -INFINITY;
    double worst = 0.0;
    int c = -1;
    size_t pn = 0;

    cr_assert_not_null(buf);
    cr_assert_gt(cap, 0);
    for (size_t i = 0; i < n; i++) {
        mn = fminf(mn, x[i]);
        mx = fmaxf(mx, x[i]);
    }
    cr_assert_eq(hm_avg_chunk_encode(comp, x, n, buf, cap, &len), 0, "comp %d n %zu", comp, n);
    cr_assert_eq(len, cap);
    cr_assert_eq(hm_avg_chunk_peek(buf, len, &c, &pn), 0);
    cr_assert_eq(c, comp);
    cr_assert_eq(pn, n);
    cr_assert_eq(hm_avg_chunk_decode(buf, len, out, n, &got), 0);
    cr_assert_eq(got, n);
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)x[i] - (double)out[i]);
        double bound = documented_bound(comp, x[i], mn, mx);
        cr_assert(err <= bound, "comp %d element %zu: %a decoded as %a, error %g over bound %g",
                  comp, i, x[i], out[i], err, bound);
        if (bound > 0)
            worst = fmax(worst, err / bound);
        else
            cr_assert_eq(bits_of(x[i]), bits_of(out[i]));
    }
    free(buf);
    free(out);
    return worst;
}

Test(avg_codec, round_trips_stay_within_documented_error)
{
    static const size_t lens[] = {0, 1, 2, 17, 1000, 4099};
    static const double scales[] = {1e-42, 1e-7, 1e-4, 1e-2, 1.0, 3e2, 6e4, 1e20};
    struct rng r = {4};
    float *x = alloc_floats(4099);

    for (int comp = 0; comp < HM_AVG_COMP_COUNT; comp++) {
        double worst = 0.0;
        for (size_t si = 0; si < sizeof(scales) / sizeof(scales[0]); si++) {
            double s = scales[si];
            if (comp == HM_AVG_COMP_FP16 && s > 6e4)
                continue; /* out of fp16's range: refused, tested below */
            for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
                size_t n = lens[li];
                /* Centred data, then data on an offset (the 8-bit range is narrow). */
                for (size_t i = 0; i < n; i++)
                    x[i] = (float)(s * rng_range(&r, -1, 1));
                worst = fmax(worst, round_trip(comp, x, n));
                for (size_t i = 0; i < n; i++)
                    x[i] = (float)(s * (0.5 + 0.01 * rng_normal(&r)));
                worst = fmax(worst, round_trip(comp, x, n));
            }
        }
        /* The bounds are tight, not vacuous: random data comes close to them. */
        if (comp != HM_AVG_COMP_NONE)
            cr_assert_gt(worst, 0.4, "comp %d: worst error only %g of the bound", comp, worst);
        cr_log_info("comp %d: largest error %.6f of the documented bound", comp, worst);
    }
    free(x);
}

/*
 * A sender computes its part as the reducer decodes it without the bytes
 * (allreduce.h, "Compressed rounds"): that must be what the decoder gives,
 * bit for bit, or the sender's correction would be off.
 */
Test(avg_codec, roundtrip_equals_encode_then_decode_bit_for_bit)
{
    static const size_t lens[] = {0, 1, 2, 15, 16, 17, 1023, 1024, 1025, 5000};
    static const double scales[] = {1e-42, 1e-6, 1.0, 3e2, 6e4};
    struct rng r = {11};
    float *x = alloc_floats(5000), *a = alloc_floats(5000), *b = alloc_floats(5000);
    uint8_t *buf = malloc(hm_avg_chunk_size(HM_AVG_COMP_NONE, 5000));
    cr_assert_not_null(buf);

    for (int comp = 0; comp < HM_AVG_COMP_COUNT; comp++)
        for (size_t si = 0; si < sizeof(scales) / sizeof(scales[0]); si++)
            for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
                size_t n = lens[li], len = 0, got = 0;
                if (comp == HM_AVG_COMP_FP16 && scales[si] > 1e4)
                    continue; /* out of fp16's range: the refusal is checked below */
                for (size_t i = 0; i < n; i++)
                    x[i] = (float)(scales[si] * (rng_unit(&r) < 0.5 ? rng_normal(&r)
                                                                     : 3.0 + rng_unit(&r)));
                cr_assert_eq(hm_avg_chunk_encode(comp, x, n, buf, hm_avg_chunk_size(comp, n),
                                                 &len), 0);
                cr_assert_eq(hm_avg_chunk_decode(buf, len, a, 5000, &got), 0);
                cr_assert_eq(got, n);
                cr_assert_eq(hm_avg_chunk_roundtrip(comp, x, n, b), 0);
                cr_assert(n == 0 || memcmp(a, b, n * sizeof(float)) == 0,
                          "comp %d scale %g n %zu: the roundtrip differs from the decoder", comp,
                          scales[si], n);
                /* In place too. */
                memcpy(b, x, n * sizeof(float));
                cr_assert_eq(hm_avg_chunk_roundtrip(comp, b, n, b), 0);
                cr_assert(n == 0 || memcmp(a, b, n * sizeof(float)) == 0);
            }
    /* The encoder's refusals, the same way. */
    x[0] = 70000.0f;
    cr_assert_eq(hm_avg_chunk_roundtrip(HM_AVG_COMP_FP16, x, 3, b), -ERANGE);
    cr_assert_eq(hm_avg_chunk_roundtrip(HM_AVG_COMP_UINT8, x, 3, b), 0);
    x[1] = NAN;
    for (int comp = 0; comp < HM_AVG_COMP_COUNT; comp++)
        cr_assert_eq(hm_avg_chunk_roundtrip(comp, x, 3, b), -EDOM);
    cr_assert_eq(hm_avg_chunk_roundtrip(7, x, 3, b), -EINVAL);
    free(buf);
    free(x);
    free(a);
    free(b);
}

/*
 * 8-bit encoding against the formula of codec.h computed here one element
 * at a time: the chunk's extremes (a -0.0 below a +0.0), then
 * q = round((x - min) * 255 / (max - min)) in double, byte for byte, over
 * lengths around the vector widths and ranges from subnormal to huge.
 * This binary runs the codec as this CPU picks it (its AVX2 clones where
 * the CPU has AVX2); test_avg_codec_baseline runs the same tests on the
 * baseline code, so both give these very bytes.
 */
Test(avg_codec, uint8_encoding_equals_the_scalar_formula)
{
    static const size_t lens[] = {1, 7, 15, 16, 17, 31, 33, 1000, 4099};
    static const double scales[] = {1e-44, 1e-30, 1e-3, 1.0, 1e30, 3e38};
    struct rng r = {29};
    float *x = alloc_floats(4099);
    uint8_t *buf = malloc(hm_avg_chunk_size(HM_AVG_COMP_UINT8, 4099));
    cr_assert_not_null(buf);
    for (size_t si = 0; si < sizeof(scales) / sizeof(scales[0]); si++)
        for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
            size_t n = lens[li], len = 0;
            for (size_t i = 0; i < n; i++) {
                double v = scales[si] * rng_normal(&r) / 4.0;
                x[i] = (float)(v > 3e38 ? 3e38 : v < -3e38 ? -3e38 : v);
            }
            if (n > 2) {
                x[n / 2] = -0.0f;
                x[n / 3] = 0.0f;
            }
            float mn = x[0], mx = x[0];
            for (size_t i = 1; i < n; i++) {
                if (x[i] < mn || (x[i] == mn && signbit(x[i])))
                    mn = x[i];
                if (x[i] > mx || (x[i] == mx && !signbit(x[i])))
                    mx = x[i];
            }
            cr_assert_eq(hm_avg_chunk_encode(HM_AVG_COMP_UINT8, x, n, buf,
                                             hm_avg_chunk_size(HM_AVG_COMP_UINT8, n), &len),
                         0);
            float gmn, gmx;
            memcpy(&gmn, buf + HM_AVG_CHUNK_HEADER, 4);
            memcpy(&gmx, buf + HM_AVG_CHUNK_HEADER + 4, 4);
            cr_assert(memcmp(&gmn, &mn, 4) == 0 && memcmp(&gmx, &mx, 4) == 0,
                      "scale %g n %zu: range [%a, %a], want [%a, %a]", scales[si], n, gmn, gmx,
                      mn, mx);
            double spread = (double)mx - (double)mn;
            double inv = spread > 0.0 ? 255.0 / spread : 0.0;
            const uint8_t *q = buf + HM_AVG_CHUNK_HEADER + HM_AVG_CHUNK_UINT8_PARAMS;
            for (size_t i = 0; i < n; i++) {
                double t = ((double)x[i] - (double)mn) * inv + 0.5;
                uint8_t want = (uint8_t)(int32_t)(t < 255.0 ? t : 255.0);
                cr_assert_eq(q[i], want, "scale %g n %zu element %zu (%a): q %u, want %u",
                             scales[si], n, i, x[i], q[i], want);
            }
        }
    free(buf);
    free(x);
}

/* The all-reduce's chunk mean: the same bits as the element-by-element loop. */
Test(avg_codec, weighted_mean_equals_the_element_loop)
{
    static const size_t lens[] = {0, 1, 15, 1023, 1024, 1025, 3000};
    struct rng r = {31};
    const float *xs[HM_AVG_CLIP_MAX_INPUTS];
    double w[HM_AVG_CLIP_MAX_INPUTS];
    float *store = alloc_floats(16 * 3000), *got = alloc_floats(3000);
    for (size_t j = 0; j < 16; j++)
        xs[j] = store + j * 3000;
    for (size_t i = 0; i < 16 * 3000; i++)
        store[i] = (float)(rng_normal(&r) * (i % 7 == 0 ? 1e30 : 1.0));
    for (size_t m = 1; m <= 16; m += 5)
        for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
            size_t n = lens[li];
            double total = 0;
            for (size_t j = 0; j < m; j++)
                total += (w[j] = rng_range(&r, 0.1, 3.0));
            hm_avg_weighted_mean(xs, w, m, n, total, got);
            for (size_t i = 0; i < n; i++) {
                double a = 0;
                for (size_t j = 0; j < m; j++)
                    a += w[j] * (double)xs[j][i];
                float want = (float)(a / total);
                cr_assert(memcmp(&got[i], &want, sizeof(float)) == 0,
                          "m %zu n %zu element %zu: %a, want %a", m, n, i, got[i], want);
            }
        }
    free(store);
    free(got);
}

/*
 * The all-reduce picks a sender's difference or the average by this cost:
 * the difference and the cost are the element formula's, bit for bit, on
 * either code path, and a difference that overflows is refused.
 */
Test(avg_codec, diff_cost_equals_the_element_loop)
{
    static const size_t lens[] = {0, 1, 15, 1023, 1024, 1025, 3000};
    static const int comps[] = {HM_AVG_COMP_FP16, HM_AVG_COMP_UINT8};
    struct rng r = {47};
    float *ans = alloc_floats(3000), *part = alloc_floats(3000), *diff = alloc_floats(3000);
    for (size_t i = 0; i < 3000; i++) {
        ans[i] = (float)(rng_normal(&r) * (i % 11 == 0 ? 1e3 : 1.0));
        part[i] = (float)(rng_normal(&r) * (i % 13 == 0 ? 1e-3 : 1.0));
    }
    for (size_t ci = 0; ci < 2; ci++)
        for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
            size_t n = lens[li];
            double cost = -1, want = 0;
            cr_assert_eq(hm_avg_diff_cost(comps[ci], ans, part, diff, n, &cost), 0);
            float mn = 0, mx = 0;
            for (size_t i = 0; i < n; i++) {
                float d = (float)((double)ans[i] - (double)part[i]);
                cr_assert(memcmp(&diff[i], &d, sizeof(float)) == 0, "n %zu element %zu", n, i);
                want += (double)d * (double)d;
                mn = i == 0 || d < mn ? d : mn;
                mx = i == 0 || d > mx ? d : mx;
            }
            if (comps[ci] == HM_AVG_COMP_UINT8)
                want = (double)mx - (double)mn;
            cr_assert(memcmp(&cost, &want, sizeof(double)) == 0, "comp %d n %zu: %a, want %a",
                      comps[ci], n, cost, want);
            double again = -1;
            cr_assert_eq(hm_avg_coding_cost(comps[ci], diff, n, &again), 0);
            cr_assert(memcmp(&again, &want, sizeof(double)) == 0);
        }
    ans[1500] = FLT_MAX;
    part[1500] = -FLT_MAX;
    for (size_t ci = 0; ci < 2; ci++) {
        double cost;
        cr_assert_eq(hm_avg_diff_cost(comps[ci], ans, part, diff, 3000, &cost), -EDOM,
                     "an overflowing difference is refused");
        cr_assert_eq(hm_avg_coding_cost(comps[ci], diff, 3000, &cost), -EDOM);
    }
    free(ans);
    free(part);
    free(diff);
}

/* The sender's side of a compressed answer, against the formula in double. */
Test(avg_codec, answer_apply_takes_out_the_senders_share_of_its_rounding)
{
    struct rng r = {12};
    const size_t n = 37;
    float x[37], qx[37], ans[37], out[37];
    for (size_t i = 0; i < n; i++) {
        x[i] = (float)rng_normal(&r);
        cr_assert_eq(hm_avg_chunk_roundtrip(HM_AVG_COMP_FP16, &x[i], 1, &qx[i]), 0);
        ans[i] = (float)rng_normal(&r);
    }
    for (int is_delta = 0; is_delta <= 1; is_delta++) {
        hm_avg_answer_apply(out, x, qx, ans, n, is_delta, 0.25);
        for (size_t i = 0; i < n; i++) {
            double want = (is_delta ? (double)qx[i] : 0.0) + (double)ans[i] +
                          0.25 * ((double)x[i] - (double)qx[i]);
            cr_assert_eq(out[i], (float)want, "element %zu (delta %d)", i, is_delta);
        }
    }
    /*
     * Two members, equal weights, member 1 reduces exactly: member 0's
     * result from the difference is the exact mean but for the
     * difference's own rounding, here none (difference sent uncompressed).
     */
    float x1[37], d[37];
    for (size_t i = 0; i < n; i++) {
        x1[i] = (float)rng_normal(&r);
        float a = (float)(((double)qx[i] + (double)x1[i]) / 2);
        d[i] = (float)((double)a - (double)qx[i]);
    }
    hm_avg_answer_apply(out, x, qx, d, n, 1, 0.5);
    for (size_t i = 0; i < n; i++) {
        double m = ((double)x[i] + (double)x1[i]) / 2;
        cr_assert_leq(fabs(out[i] - m), 4e-7 * (fabs(m) + fabs(x[i]) + 1), "element %zu", i);
    }
}

Test(avg_codec, uint8_constant_chunk_and_extremes_are_exact)
{
    static const float values[] = {0.0f, 3.14159265f, -2.5e-30f, 1.7e38f, -FLT_MAX, 0x1p-149f};
    float x[300], out[300];
    uint8_t buf[HM_AVG_CHUNK_HEADER + HM_AVG_CHUNK_UINT8_PARAMS + 300];
    size_t len, n;

    for (size_t v = 0; v < sizeof(values) / sizeof(values[0]); v++) {
        for (size_t i = 0; i < 300; i++)
            x[i] = values[v];
        cr_assert_eq(hm_avg_chunk_encode(HM_AVG_COMP_UINT8, x, 300, buf, sizeof(buf), &len), 0);
        cr_assert_eq(hm_avg_chunk_decode(buf, len, out, 300, &n), 0);
        for (size_t i = 0; i < 300; i++)
            cr_assert(out[i] == values[v], "%a decoded as %a", values[v], out[i]);
    }
    /* The extremes of a chunk decode exactly, even over fp32's whole range. */
    for (size_t i = 0; i < 300; i++)
        x[i] = (float)((double)FLT_MAX * (2.0 * i / 299.0 - 1.0));
    x[0] = -FLT_MAX;
    x[299] = FLT_MAX;
    cr_assert_eq(hm_avg_chunk_encode(HM_AVG_COMP_UINT8, x, 300, buf, sizeof(buf), &len), 0);
    cr_assert_eq(hm_avg_chunk_decode(buf, len, out, 300, &n), 0);
    cr_assert(out[0] == -FLT_MAX && out[299] == FLT_MAX);
    cr_assert_lt(round_trip(HM_AVG_COMP_UINT8, x, 300), 1.0);
}

Test(avg_codec, wire_layout_is_little_endian_and_self_describing)
{
    const float x[2] = {1.0f, -2.0f};
    uint8_t buf[32];
    size_t len;
    static const uint8_t none[] = {0, 0, 0, 0, 2, 0, 0, 0, 0x00, 0x00, 0x80, 0x3f,
                                   0x00, 0x00, 0x00, 0xc0};
    static const uint8_t fp16[] = {1, 0, 0, 0, 2, 0, 0, 0, 0x00, 0x3c, 0x00, 0xc0};
    static const uint8_t u8[] = {2,    0,    0,    0,    2, 0, 0, 0, 0x00, 0x00,
                                 0x00, 0xc0, 0x00, 0x00, 0x80, 0x3f, 0xff, 0x00};

    cr_assert_eq(hm_avg_chunk_encode(HM_AVG_COMP_NONE, x, 2, buf, sizeof(buf), &len), 0);
    cr_assert_eq(len, sizeof(none));
    cr_assert_arr_eq(buf, none, len);
    cr_assert_eq(hm_avg_chunk_encode(HM_AVG_COMP_FP16, x, 2, buf, sizeof(buf), &len), 0);
    cr_assert_eq(len, sizeof(fp16));
    cr_assert_arr_eq(buf, fp16, len);
    cr_assert_eq(hm_avg_chunk_encode(HM_AVG_COMP_UINT8, x, 2, buf, sizeof(buf), &len), 0);
    cr_assert_eq(len, sizeof(u8));
    cr_assert_arr_eq(buf, u8, len);

    cr_assert_eq(hm_avg_chunk_size(HM_AVG_COMP_NONE, 10), 48);
    cr_assert_eq(hm_avg_chunk_size(HM_AVG_COMP_FP16, 10), 28);
    cr_assert_eq(hm_avg_chunk_size(HM_AVG_COMP_UINT8, 10), 26);
    cr_assert_eq(hm_avg_chunk_size(3, 10), 0);
    cr_assert_eq(hm_avg_chunk_size(HM_AVG_COMP_NONE, HM_AVG_CHUNK_MAX_ELEMS + (size_t)1), 0);
    cr_assert_eq(hm_avg_chunk_size(HM_AVG_COMP_NONE, 0), HM_AVG_CHUNK_HEADER);
}

Test(avg_codec, encoder_refuses_bad_input_and_small_buffers)
{
    float x[40];
    uint8_t buf[256];
    size_t len = 123;

    for (int i = 0; i < 40; i++)
        x[i] = (float)i;
    for (int comp = 0; comp < HM_AVG_COMP_COUNT; comp++) {
        size_t need = hm_avg_chunk_size(comp, 40);
        cr_assert_eq(hm_avg_chunk_encode(comp, x, 40, buf, need - 1, &len), -EMSGSIZE);
        cr_assert_eq(len, 0);
        /* Checked before reading x, so no 2^26-element array is needed. */
        cr_assert_eq(hm_avg_chunk_encode(comp, x, HM_AVG_CHUNK_MAX_ELEMS + (size_t)1, buf,
                                         sizeof(buf), &len),
                     -EMSGSIZE);
        x[33] = NAN;
        cr_assert_eq(hm_avg_chunk_encode(comp, x, 40, buf, sizeof(buf), &len), -EDOM);
        x[33] = -INFINITY;
        cr_assert_eq(hm_avg_chunk_encode(comp, x, 40, buf, sizeof(buf), &len), -EDOM);
        cr_assert_eq(len, 0);
        x[33] = 33.0f;
        cr_assert_eq(hm_avg_chunk_encode(comp, x, 40, buf, sizeof(buf), &len), 0);
    }
    cr_assert_eq(hm_avg_chunk_encode(7, x, 40, buf, sizeof(buf), &len), -EINVAL);
    cr_assert_eq(hm_avg_chunk_encode(-1, x, 40, buf, sizeof(buf), &len), -EINVAL);
    /* fp16 refuses what it cannot carry instead of saturating it. */
    x[5] = 65505.0f;
    cr_assert_eq(hm_avg_chunk_encode(HM_AVG_COMP_FP16, x, 40, buf, sizeof(buf), &len), -ERANGE);
    x[5] = -1e30f;
    cr_assert_eq(hm_avg_chunk_encode(HM_AVG_COMP_FP16, x, 40, buf, sizeof(buf), &len), -ERANGE);
    x[6] = NAN; /* a non-finite value is the worse news */
    cr_assert_eq(hm_avg_chunk_encode(HM_AVG_COMP_FP16, x, 40, buf, sizeof(buf), &len), -EDOM);
    x[6] = 6.0f;
    x[5] = 65504.0f;
    cr_assert_eq(hm_avg_chunk_encode(HM_AVG_COMP_FP16, x, 40, buf, sizeof(buf), &len), 0);
}

/* Builds a chunk by hand: header, then raw payload. */
static size_t hand_chunk(uint8_t *buf, uint8_t comp, uint32_t count, const void *payload,
                         size_t plen)
{
    buf[0] = comp;
    buf[1] = buf[2] = buf[3] = 0;
    buf[4] = (uint8_t)count;
    buf[5] = (uint8_t)(count >> 8);
    buf[6] = (uint8_t)(count >> 16);
    buf[7] = (uint8_t)(count >> 24);
    memcpy(buf + 8, payload, plen);
    return 8 + plen;
}

Test(avg_codec, decoder_rejects_malformed_chunks)
{
    float x[64], out[64];
    uint8_t buf[512], bad[512];
    size_t n = 77;

    for (int i = 0; i < 64; i++)
        x[i] = (float)(i - 20) * 0.25f;
    for (int comp = 0; comp < HM_AVG_COMP_COUNT; comp++) {
        size_t len;
        cr_assert_eq(hm_avg_chunk_encode(comp, x, 64, buf, sizeof(buf), &len), 0);
        /* Every truncation, including inside the header, and one extra byte. */
        for (size_t cut = 0; cut < len; cut++) {
            cr_assert_eq(hm_avg_chunk_decode(buf, cut, out, 64, &n), -EPROTO, "cut %zu", cut);
            cr_assert_eq(n, 0);
        }
        memcpy(bad, buf, len);
        bad[len] = 0;
        cr_assert_eq(hm_avg_chunk_decode(bad, len + 1, out, 64, &n), -EPROTO);
        /* A count that disagrees with the length, either way. */
        bad[4] = 63;
        cr_assert_eq(hm_avg_chunk_decode(bad, len, out, 64, &n), -EPROTO);
        bad[4] = 65;
        cr_assert_eq(hm_avg_chunk_decode(bad, len, out, 64, &n), -EPROTO);
        /* A count over the cap is refused before anything else about it. */
        bad[4] = 64;
        bad[7] = 0x10;
        cr_assert_eq(hm_avg_chunk_decode(bad, len, out, 64, &n), -EMSGSIZE);
        cr_assert_eq(hm_avg_chunk_peek(bad, len, NULL, NULL), -EMSGSIZE);
        bad[7] = 0;
        /* Reserved bytes, and compressions that do not exist. */
        bad[2] = 1;
        cr_assert_eq(hm_avg_chunk_decode(bad, len, out, 64, &n), -EPROTO);
        bad[2] = 0;
        for (int c = 3; c < 256; c++) {
            bad[0] = (uint8_t)c;
            cr_assert_eq(hm_avg_chunk_decode(bad, len, out, 64, &n), -EPROTO);
        }
        bad[0] = (uint8_t)comp;
        /* The output is too small for the declared count. */
        cr_assert_eq(hm_avg_chunk_decode(bad, len, out, 63, &n), -EMSGSIZE);
        cr_assert_eq(hm_avg_chunk_decode(bad, len, out, 64, &n), 0);
        cr_assert_eq(n, 64);
    }
}

Test(avg_codec, uint8_parameters_must_be_finite_and_ordered)
{
    static const float params[][2] = {
        {NAN, 1.0f}, {0.0f, NAN}, {-INFINITY, 1.0f}, {0.0f, INFINITY}, {2.0f, 1.0f},
    };
    uint8_t payload[8 + 4] = {0}, buf[64];
    float out[4];
    size_t n, len;

    for (size_t i = 0; i < sizeof(params) / sizeof(params[0]); i++) {
        uint32_t lo = bits_of(params[i][0]), hi = bits_of(params[i][1]);
        for (int b = 0; b < 4; b++) {
            payload[b] = (uint8_t)(lo >> (8 * b));
            payload[4 + b] = (uint8_t)(hi >> (8 * b));
        }
        len = hand_chunk(buf, HM_AVG_COMP_UINT8, 4, payload, sizeof(payload));
        cr_assert_eq(hm_avg_chunk_decode(buf, len, out, 4, &n), -EPROTO, "params %zu", i);
    }
    /* The widest legal range still decodes to finite values. */
    {
        uint32_t lo = bits_of(-FLT_MAX), hi = bits_of(FLT_MAX);
        for (int b = 0; b < 4; b++) {
            payload[b] = (uint8_t)(lo >> (8 * b));
            payload[4 + b] = (uint8_t)(hi >> (8 * b));
        }
    }
    payload[8] = 255;
    payload[9] = 128;
    payload[10] = 0;
    payload[11] = 127;
    len = hand_chunk(buf, HM_AVG_COMP_UINT8, 4, payload, sizeof(payload));
    cr_assert_eq(hm_avg_chunk_decode(buf, len, out, 4, &n), 0);
    cr_assert_eq(n, 4);
    cr_assert(out[0] == FLT_MAX && out[2] == -FLT_MAX);
    cr_assert(fabs((double)out[1] - (double)FLT_MAX / 255) <= 1e31);
    cr_assert(fabs((double)out[3] + (double)FLT_MAX / 255) <= 1e31);
}

Test(avg_codec, decoder_reports_non_finite_values_from_a_peer)
{
    uint8_t buf[256];
    float out[40], vals[40];
    uint16_t halfs[40];
    size_t n = 5, len;

    for (int i = 0; i < 40; i++)
        vals[i] = (float)i;
    /* NaN or infinity anywhere, first and last included. */
    for (int pos = 0; pos < 40; pos += 13) {
        const float specials[3] = {NAN, INFINITY, -INFINITY};
        for (int s = 0; s < 3; s++) {
            float v[40];
            memcpy(v, vals, sizeof(v));
            v[pos] = specials[s];
            len = hand_chunk(buf, HM_AVG_COMP_NONE, 40, v, sizeof(v));
            cr_assert_eq(hm_avg_chunk_decode(buf, len, out, 40, &n), -EDOM);
            cr_assert_eq(n, 0);
        }
    }
    for (int i = 0; i < 40; i++)
        halfs[i] = hm_avg_f16_from_f32(vals[i]);
    for (int pos = 0; pos < 40; pos += 13) {
        static const uint16_t specials[4] = {0x7c00, 0xfc00, 0x7e00, 0x7c01};
        for (int s = 0; s < 4; s++) {
            uint16_t h[40];
            memcpy(h, halfs, sizeof(h));
            h[pos] = specials[s];
            len = hand_chunk(buf, HM_AVG_COMP_FP16, 40, h, sizeof(h));
            cr_assert_eq(hm_avg_chunk_decode(buf, len, out, 40, &n), -EDOM);
        }
    }
    len = hand_chunk(buf, HM_AVG_COMP_FP16, 40, halfs, sizeof(halfs));
    cr_assert_eq(hm_avg_chunk_decode(buf, len, out, 40, &n), 0);
    cr_assert_arr_eq(out, vals, sizeof(vals));
}

Test(avg_codec, all_finite_finds_one_bad_value_anywhere)
{
    size_t n = 5000;
    float *x = alloc_floats(n);
    static const size_t positions[] = {0, 1, 1023, 1024, 1500, 4095, 4999};

    for (size_t i = 0; i < n; i++)
        x[i] = (i & 1) ? FLT_MAX : -0x1p-149f;
    cr_assert_eq(hm_avg_all_finite(x, n), 1);
    cr_assert_eq(hm_avg_all_finite(x, 0), 1);
    for (size_t p = 0; p < sizeof(positions) / sizeof(positions[0]); p++) {
        float keep = x[positions[p]];
        x[positions[p]] = NAN;
        cr_assert_eq(hm_avg_all_finite(x, n), 0, "NaN at %zu", positions[p]);
        cr_assert_eq(hm_avg_all_finite(x, positions[p]), 1);
        x[positions[p]] = -INFINITY;
        cr_assert_eq(hm_avg_all_finite(x, n), 0, "-inf at %zu", positions[p]);
        x[positions[p]] = keep;
    }
    free(x);
}

/* ---- weighted accumulation ---- */

/*
 * Accumulates k peers' vectors (fp32) and compares with a double reference,
 * within the bound codec.h documents, (k + 3) * 2^-24 of the mean magnitude,
 * and within 1e-6 of it as the issue asks for up to 8 peers.
 */
static void check_accumulation(struct rng *r, size_t k, size_t m, int mixed_sign)
{
    float **xs = malloc(k * sizeof(*xs));
    double *w = malloc(k * sizeof(*w));
    float *acc = alloc_floats(m);
    double total = 0.0;

    cr_assert(xs && w);
    for (size_t j = 0; j < k; j++) {
        xs[j] = alloc_floats(m);
        w[j] = rng_range(r, 0.1, 1000.0);
        for (size_t i = 0; i < m; i++)
            xs[j][i] = mixed_sign ? (float)rng_normal(r) : (float)rng_range(r, 0.5, 2.0);
    }
    memset(acc, 0, m * sizeof(float));
    for (size_t j = 0; j < k; j++) {
        cr_assert_eq(hm_avg_accumulate(acc, xs[j], m, w[j]), 0);
        total += w[j];
    }
    cr_assert_eq(hm_avg_finalize(acc, m, total), 0);
    for (size_t i = 0; i < m; i++) {
        double ref = 0.0, mag = 0.0;
        for (size_t j = 0; j < k; j++) {
            ref += w[j] * (double)xs[j][i];
            mag += w[j] * fabs((double)xs[j][i]);
        }
        ref /= total;
        mag /= total;
        /*
         * Relative to the result itself for same-sign data; with mixed signs,
         * relative to the mean magnitude (cancellation can make the result
         * itself arbitrarily small, in any floating-point sum).
         */
        cr_assert(fabs(acc[i] - ref) <= (double)(k + 3) * 0x1p-24 * mag,
                  "k %zu element %zu: %.9g vs %.9g", k, i, acc[i], ref);
        if (k <= 8)
            cr_assert(fabs(acc[i] - ref) <= 1e-6 * (mixed_sign ? mag : fabs(ref)),
                      "k %zu element %zu: %.9g vs %.9g", k, i, acc[i], ref);
    }
    for (size_t j = 0; j < k; j++)
        free(xs[j]);
    free(xs);
    free(w);
    free(acc);
}

Test(avg_codec, accumulation_matches_double_reference)
{
    struct rng r = {5};

    for (size_t k = 2; k <= 8; k++) {
        check_accumulation(&r, k, 10007, 0);
        check_accumulation(&r, k, 10007, 1);
    }
    check_accumulation(&r, 64, 3001, 0);
    check_accumulation(&r, 64, 3001, 1);
}

Test(avg_codec, accumulation_accepts_half_precision_inputs)
{
    struct rng r = {6};
    const size_t m = 2500;
    float *x = alloc_floats(m), *want = alloc_floats(m), *acc = alloc_floats(m);
    uint16_t *h = malloc(m * 2);

    cr_assert_not_null(h);
    for (int dtype = HM_DTYPE_F16; dtype <= HM_DTYPE_BF16; dtype++) {
        for (size_t i = 0; i < m; i++)
            x[i] = (float)rng_normal(&r);
        hm_avg_from_f32(h, dtype, x, m);
        hm_avg_to_f32(x, dtype, h, m); /* x now holds the values the tensor really has */
        for (size_t i = 0; i < m; i++) {
            acc[i] = 1.0f;
            want[i] = (float)((1.0 + 0.75 * (double)x[i]) / 1.75);
        }
        cr_assert_eq(hm_avg_accumulate_dtype(acc, dtype, h, m, 0.75), 0);
        cr_assert_eq(hm_avg_finalize(acc, m, 1.75), 0);
        for (size_t i = 0; i < m; i++)
            cr_assert(fabsf(acc[i] - want[i]) <= 1e-6f * fmaxf(1.0f, fabsf(want[i])),
                      "dtype %d element %zu", dtype, i);
    }
    cr_assert_eq(hm_avg_accumulate_dtype(acc, HM_DTYPE_U8, h, m, 1.0), -EINVAL);
    cr_assert_eq(hm_avg_accumulate_dtype(acc, HM_DTYPE_F32, x, m, 1.0), 0);
    free(x);
    free(want);
    free(acc);
    free(h);
}

Test(avg_codec, accumulation_refuses_bad_weights_and_reports_overflow)
{
    float acc[20], x[20];
    static const double bad_weights[] = {-1.0, -0.0001, NAN, INFINITY, 1e39};

    for (int i = 0; i < 20; i++) {
        acc[i] = 1.0f;
        x[i] = (float)i;
    }
    for (size_t i = 0; i < sizeof(bad_weights) / sizeof(bad_weights[0]); i++) {
        cr_assert_eq(hm_avg_accumulate(acc, x, 20, bad_weights[i]), -EDOM);
        cr_assert_eq(hm_avg_accumulate_dtype(acc, HM_DTYPE_F16, x, 10, bad_weights[i]), -EDOM);
    }
    /* Weight 0 is a member that contributes nothing. */
    cr_assert_eq(hm_avg_accumulate(acc, x, 20, 0.0), 0);
    for (int i = 0; i < 20; i++)
        cr_assert(acc[i] == 1.0f);
    cr_assert_eq(hm_avg_finalize(acc, 20, 0.0), -EDOM);
    cr_assert_eq(hm_avg_finalize(acc, 20, -1.0), -EDOM);
    cr_assert_eq(hm_avg_finalize(acc, 20, NAN), -EDOM);
    cr_assert_eq(hm_avg_finalize(acc, 20, INFINITY), -EDOM);
    /* Two huge contributions overflow fp32; finalize says so. */
    for (int i = 0; i < 20; i++)
        x[i] = FLT_MAX;
    cr_assert_eq(hm_avg_accumulate(acc, x, 20, 1.0), 0);
    cr_assert_eq(hm_avg_accumulate(acc, x, 20, 1.0), 0);
    cr_assert_eq(hm_avg_finalize(acc, 20, 2.0), -EDOM);
}

/* ---- CenteredClip ---- */

static double dist(const float *a, const double *b, size_t m)
{
    double s = 0.0;
    for (size_t i = 0; i < m; i++)
        s += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    return sqrt(s);
}

Test(avg_codec, centered_clip_resists_a_far_outlier)
{
    enum { HONEST = 8, M = 256 };
    const double tau = 50.0;
    struct rng r = {7};
    float *x[HONEST + 1];
    double w[HONEST + 1], honest[M], plain[M];
    float v[M];
    int iters;

    for (int j = 0; j <= HONEST; j++) {
        x[j] = alloc_floats(M);
        w[j] = 1.0;
    }
    for (int i = 0; i < M; i++) {
        double mu = 10.0 * rng_normal(&r);
        honest[i] = 0.0;
        for (int j = 0; j < HONEST; j++) {
            x[j][i] = (float)(mu + rng_normal(&r)); /* about 16 from the honest mean */
            honest[i] += x[j][i] / (double)HONEST;
        }
        x[HONEST][i] = (float)(mu + 1000.0);
        plain[i] = (honest[i] * HONEST + x[HONEST][i]) / (HONEST + 1);
    }
    iters = hm_avg_centered_clip((const float *const *)x, w, HONEST + 1, M, tau, 200, v);
    cr_assert_gt(iters, 1);
    /*
     * At the fixed point the honest inputs (within tau) pull with 8/9 of the
     * weight and the clipped outlier with 1/9 * tau, so v sits tau/8 from
     * the honest mean, while the plain mean is 16000/9 away.
     */
    {
        double d_cc = 0.0, d_plain = 0.0;
        for (int i = 0; i < M; i++) {
            d_cc += (v[i] - honest[i]) * (v[i] - honest[i]);
            d_plain += (plain[i] - honest[i]) * (plain[i] - honest[i]);
        }
        d_cc = sqrt(d_cc);
        d_plain = sqrt(d_plain);
        cr_log_info("centered clip: %d iterations, %.3f from the honest mean; plain mean %.1f",
                    iters, d_cc, d_plain);
        cr_assert_gt(d_plain, 1700.0);
        cr_assert_leq(d_cc, tau / HONEST * 1.05);
    }
    /* An outlier at 1e30 moves it no further: its pull is clipped to tau. */
    for (int i = 0; i < M; i++)
        x[HONEST][i] = 1e30f;
    iters = hm_avg_centered_clip((const float *const *)x, w, HONEST + 1, M, tau, 200, v);
    cr_assert_gt(iters, 0);
    cr_assert_leq(dist(v, honest, M), tau / HONEST * 1.05);
    /* The same outlier with weight 0 changes nothing. */
    w[HONEST] = 0.0;
    iters = hm_avg_centered_clip((const float *const *)x, w, HONEST + 1, M, tau, 200, v);
    cr_assert_geq(iters, 0);
    cr_assert_leq(dist(v, honest, M), 1e-4);
    for (int j = 0; j <= HONEST; j++)
        free(x[j]);
}

Test(avg_codec, centered_clip_is_the_weighted_mean_when_nothing_is_clipped)
{
    enum { N = 5, M = 3000 };
    struct rng r = {8};
    float *x[N];
    double w[N] = {1.0, 2.0, 0.5, 7.0, 3.0}, mean[M], total = 13.5;
    float v[M];
    int iters;

    for (int j = 0; j < N; j++) {
        x[j] = alloc_floats(M);
        for (int i = 0; i < M; i++)
            x[j][i] = (float)rng_range(&r, 1.0, 2.0);
    }
    for (int i = 0; i < M; i++) {
        mean[i] = 0.0;
        for (int j = 0; j < N; j++)
            mean[i] += w[j] * x[j][i] / total;
    }
    /* From the median, one step reaches the mean and the next does not move. */
    iters = hm_avg_centered_clip((const float *const *)x, w, N, M, 1e6, 50, v);
    cr_assert_eq(iters, 2);
    for (int i = 0; i < M; i++)
        cr_assert(fabs(v[i] - mean[i]) <= 1e-6 * mean[i], "element %d", i);
    /* Identical inputs come back exactly, however small tau is. */
    for (int j = 1; j < N; j++)
        memcpy(x[j], x[0], M * sizeof(float));
    cr_assert_geq(hm_avg_centered_clip((const float *const *)x, w, N, M, 1e-3, 50, v), 0);
    cr_assert_arr_eq(v, x[0], M * sizeof(float));
    for (int j = 0; j < N; j++)
        free(x[j]);
}

Test(avg_codec, centered_clip_starts_from_the_weighted_median)
{
    enum { N = 7, M = 2000 };
    struct rng r = {9};
    float *x[N];
    double w[N];
    float v[M];

    /* Even weights split at a value: the lower of the two middle ones. */
    {
        float a[1] = {5.0f}, b[1] = {-3.0f}, c[1] = {8.0f}, d[1] = {1.0f}, out[1];
        const float *two[2] = {a, b}, *four[4] = {a, b, c, d};
        double ones[4] = {1.0, 1.0, 1.0, 1.0}, heavy[4] = {1.0, 1.0, 4.0, 1.0};
        cr_assert_eq(hm_avg_centered_clip(two, ones, 2, 1, 1.0, 0, out), 0);
        cr_assert(out[0] == -3.0f);
        cr_assert_eq(hm_avg_centered_clip(four, ones, 4, 1, 1.0, 0, out), 0);
        cr_assert(out[0] == 1.0f);
        cr_assert_eq(hm_avg_centered_clip(four, heavy, 4, 1, 1.0, 0, out), 0);
        cr_assert(out[0] == 8.0f);
    }
    for (int round = 0; round < 20; round++) {
        for (int j = 0; j < N; j++) {
            x[j] = alloc_floats(M);
            /* Some zero weights, and few distinct values so that ties abound. */
            w[j] = (rng_next(&r) % 4 == 0) ? 0.0 : rng_range(&r, 0.1, 3.0);
            for (int i = 0; i < M; i++)
                x[j][i] = (float)(rng_next(&r) % 5) - 2.0f;
        }
        w[round % N] = 1.0; /* at least one positive weight */
        cr_assert_eq(hm_avg_centered_clip((const float *const *)x, w, N, M, 1.0, 0, v), 0);
        for (int i = 0; i < M; i++) {
            /* Brute force: the smallest value whose cumulative weight reaches half. */
            double total = 0.0, best = INFINITY;
            for (int j = 0; j < N; j++)
                total += w[j];
            for (int j = 0; j < N; j++) {
                double cum = 0.0;
                for (int l = 0; l < N; l++)
                    if (x[l][i] <= x[j][i])
                        cum += w[l] / total;
                if (cum >= 0.5 * (1.0 - 1e-12) && x[j][i] < best)
                    best = x[j][i];
            }
            cr_assert(v[i] == best, "round %d element %d: %g != %g", round, i, v[i], best);
        }
        for (int j = 0; j < N; j++)
            free(x[j]);
    }
}

Test(avg_codec, centered_clip_refuses_bad_arguments)
{
    float a[4] = {1, 2, 3, 4}, b[4] = {4, 3, 2, 1}, v[4];
    const float *xs[HM_AVG_CLIP_MAX_INPUTS + 1];
    double w[HM_AVG_CLIP_MAX_INPUTS + 1];

    for (int j = 0; j <= HM_AVG_CLIP_MAX_INPUTS; j++) {
        xs[j] = (j & 1) ? b : a;
        w[j] = 1.0;
    }
    cr_assert_eq(hm_avg_centered_clip(xs, w, HM_AVG_CLIP_MAX_INPUTS, 4, 1.0, 10, v) >= 0, 1);
    cr_assert_eq(hm_avg_centered_clip(xs, w, 0, 4, 1.0, 10, v), -EINVAL);
    cr_assert_eq(hm_avg_centered_clip(xs, w, HM_AVG_CLIP_MAX_INPUTS + 1, 4, 1.0, 10, v), -EINVAL);
    cr_assert_eq(hm_avg_centered_clip(xs, w, 2, 4, 0.0, 10, v), -EINVAL);
    cr_assert_eq(hm_avg_centered_clip(xs, w, 2, 4, -1.0, 10, v), -EINVAL);
    cr_assert_eq(hm_avg_centered_clip(xs, w, 2, 4, NAN, 10, v), -EINVAL);
    cr_assert_eq(hm_avg_centered_clip(xs, w, 2, 4, INFINITY, 10, v), -EINVAL);
    cr_assert_eq(hm_avg_centered_clip(xs, w, 2, 4, 1.0, HM_AVG_CLIP_MAX_ITERS + 1, v), -EINVAL);
    w[1] = -1.0;
    cr_assert_eq(hm_avg_centered_clip(xs, w, 2, 4, 1.0, 10, v), -EINVAL);
    w[1] = NAN;
    cr_assert_eq(hm_avg_centered_clip(xs, w, 2, 4, 1.0, 10, v), -EINVAL);
    w[0] = w[1] = 0.0;
    cr_assert_eq(hm_avg_centered_clip(xs, w, 2, 4, 1.0, 10, v), -EINVAL);
    w[0] = w[1] = 1.0;
    xs[1] = v;
    cr_assert_eq(hm_avg_centered_clip(xs, w, 2, 4, 1.0, 10, v), -EINVAL);
    xs[1] = b;
    b[2] = NAN;
    cr_assert_eq(hm_avg_centered_clip(xs, w, 2, 4, 1.0, 10, v), -EDOM);
    b[2] = INFINITY;
    cr_assert_eq(hm_avg_centered_clip(xs, w, 2, 4, 1.0, 10, v), -EDOM);
}

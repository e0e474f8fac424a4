/*
 * codec: the numeric layer of averaging, shared by the all-reduce and by the
 * trainer-facing averager. It owns no state and does no I/O: dtype
 * conversion (fp32 <-> fp16 and bf16), the wire compression of one chunk of
 * float32 values (none, fp16, 8-bit uniform), weighted accumulation of
 * contributions in fp32, and CenteredClip, the Byzantine-tolerant
 * aggregation of Karimireddy et al.
 *
 * Everything a peer sends is checked here before it touches an average: a
 * chunk whose declared element count disagrees with its length, whose
 * quantization parameters are not finite, or which decodes to NaN or
 * infinity is refused, so that the all-reduce can leave that peer out.
 * Nothing here allocates; every output goes to a buffer the caller sized.
 *
 * Arithmetic assumes the default floating-point environment (round to
 * nearest even, no flush-to-zero), which the daemon never changes.
 */
#ifndef HM_AVG_CODEC_H
#define HM_AVG_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "src/base/wire.h" /* enum hm_dtype */

/* ---- dtype conversion ---- */

/*
 * IEEE 754 binary16 and bfloat16 conversions, all rounding to nearest even.
 * fp32 -> fp16: values of magnitude 65520 or more become infinity, values
 * below 2^-14 become fp16 subnormals (rounded to multiples of 2^-24, so
 * anything up to 2^-25 becomes a signed zero), infinities stay infinities,
 * and every NaN becomes a quiet NaN with the same sign. fp32 -> bf16 keeps
 * fp32's exponent range: it rounds the mantissa to 8 bits, overflowing to
 * infinity only past bf16's largest finite value; NaNs stay NaNs (quiet).
 * fp16 -> fp32 and bf16 -> fp32 are exact.
 */
uint16_t hm_avg_f16_from_f32(float x);
float hm_avg_f16_to_f32(uint16_t h);
uint16_t hm_avg_bf16_from_f32(float x);
float hm_avg_bf16_to_f32(uint16_t h);

/*
 * Converts n elements of a tensor in host byte order, of dtype HM_DTYPE_F32,
 * HM_DTYPE_F16 or HM_DTYPE_BF16, to or from float32, with the rounding
 * above. The loops are branch-free, so the compiler vectorizes them. src and
 * dst must not overlap, except that they may be the same buffer for
 * HM_DTYPE_F32. Returns 0, or -EINVAL for any other dtype.
 */
int hm_avg_to_f32(float *dst, int dtype, const void *src, size_t n);
int hm_avg_from_f32(void *dst, int dtype, const float *src, size_t n);

/* ---- wire compression of one chunk of float32 values ---- */

enum hm_avg_comp {
    HM_AVG_COMP_NONE = 0,  /* raw little-endian float32, exact */
    HM_AVG_COMP_FP16 = 1,  /* little-endian IEEE half */
    HM_AVG_COMP_UINT8 = 2, /* 8-bit uniform, with the range of each chunk */
};
#define HM_AVG_COMP_COUNT 3

/*
 * An encoded chunk is self-describing:
 *
 *   byte 0     compression (enum hm_avg_comp)
 *   bytes 1-3  zero
 *   bytes 4-7  element count n, uint32 little-endian
 *   then, for HM_AVG_COMP_NONE:  n float32, little-endian     (4n bytes)
 *         for HM_AVG_COMP_FP16:  n binary16, little-endian    (2n bytes)
 *         for HM_AVG_COMP_UINT8: float32 min, float32 max (both
 *                                little-endian), then n bytes q[i]
 *
 * An 8-bit chunk carries its offset (min) and, instead of the scale, the
 * chunk's max: scale = (max - min) / 255 (255 steps between 256 levels) is
 * implied, and never loses precision to float32 rounding or underflow. The
 * encoder picks q[i] = round((x[i] - min) / scale); the decoder computes
 * x'[i] = min + q[i] * scale as ((255 - q[i]) * min + q[i] * max) / 255 in
 * double, which always lies in [min, max] and gives min and max exactly.
 *
 * Error bounds of a round trip, per element x of a chunk (q(x) is what
 * the receiver decodes):
 *
 *   NONE:  q(x) == x exactly.
 *   FP16:  |x - q(x)| <= 2^-11 * |x| for 2^-14 <= |x| <= 65504 (half an
 *          fp16 ulp, relative 4.9e-4), and |x - q(x)| <= 2^-25 (half the
 *          smallest subnormal step) for |x| < 2^-14. A chunk holding a value
 *          of magnitude over 65504 is refused, never silently saturated.
 *   UINT8: with min and max the chunk's extremes,
 *          |x - q(x)| <= (max - min) / 510 + 2^-23 * max(|min|, |max|)
 *                        + 2^-149.
 *          The first term is half a quantization step; the others cover
 *          the rounding of the decoded value to float32 (relative, and
 *          absolute for subnormal values), negligible unless the chunk's
 *          spread is tiny against its magnitude. A constant chunk
 *          (max == min) decodes exactly, and so do min and max.
 *
 * The sender may choose the compression per chunk; a receiver that requires
 * the group's agreed compression checks it with hm_avg_chunk_peek.
 */
#define HM_AVG_CHUNK_HEADER 8
#define HM_AVG_CHUNK_UINT8_PARAMS 8
/* Largest element count in one chunk; keeps every size far below 2^31. */
#define HM_AVG_CHUNK_MAX_ELEMS (1u << 26)

/*
 * Bytes that hm_avg_chunk_encode writes for n elements under comp; 0 for an
 * unknown comp or n over HM_AVG_CHUNK_MAX_ELEMS.
 */
size_t hm_avg_chunk_size(int comp, size_t n);

/*
 * Encodes x[0..n) into out (out_cap bytes) and stores the length written in
 * *out_len. Returns 0; -EINVAL for an unknown comp; -EMSGSIZE when n is over
 * HM_AVG_CHUNK_MAX_ELEMS or out_cap is under hm_avg_chunk_size(comp, n);
 * -EDOM when some x[i] is NaN or infinite; -ERANGE for HM_AVG_COMP_FP16 when
 * some |x[i]| is over 65504 (the caller may send that chunk uncompressed,
 * or with 8 bits). On error out holds nothing useful and *out_len is 0.
 * n == 0 is a valid, empty chunk.
 */
int hm_avg_chunk_encode(int comp, const float *x, size_t n, uint8_t *out, size_t out_cap,
                        size_t *out_len);

/*
 * Checks an encoded chunk's header and length without decoding values: on
 * success stores its compression and element count (either pointer may be
 * NULL). Returns 0; -EPROTO when the chunk is shorter than its header, has
 * an unknown compression, nonzero reserved bytes, or a length that is not
 * exactly the one its element count implies; -EMSGSIZE when the count is
 * over HM_AVG_CHUNK_MAX_ELEMS.
 */
int hm_avg_chunk_peek(const uint8_t *buf, size_t len, int *comp, size_t *n);

/*
 * An uncompressed chunk of x[0..n) without copying x: writes the chunk's
 * header into hdr, and the chunk is hdr followed by x's own bytes. Returns
 * 0; -EDOM when some x[i] is NaN or infinite; -EMSGSIZE when n is over
 * HM_AVG_CHUNK_MAX_ELEMS; -ENOTSUP on a big-endian host, where the wire's
 * little-endian floats are not x's bytes (hm_avg_chunk_encode then).
 */
int hm_avg_chunk_none_view(const float *x, size_t n, uint8_t hdr[HM_AVG_CHUNK_HEADER]);

/*
 * Decodes a chunk into out (room for out_cap floats) and stores the element
 * count in *n_out. Returns 0; whatever hm_avg_chunk_peek refuses; -EMSGSIZE
 * when the count is over out_cap; -EPROTO for an 8-bit chunk whose min or
 * max is not finite, or whose min is over its max; -EDOM when a decoded
 * value is NaN or infinite (a peer sending non-finite values). out may have been written to when it fails, and
 * *n_out is then 0.
 */
int hm_avg_chunk_decode(const uint8_t *buf, size_t len, float *out, size_t out_cap,
                        size_t *n_out);

/*
 * Stores in out[0..n) exactly what a receiver decodes from the chunk that
 * hm_avg_chunk_encode(comp, x, n, ...) writes, without writing the chunk:
 * the sender's view of its own part at the reducer (allreduce.h,
 * "Compressed rounds"). Returns 0 or encode's errors (-EINVAL, -EMSGSIZE,
 * -EDOM, -ERANGE). out may be x.
 */
int hm_avg_chunk_roundtrip(int comp, const float *x, size_t n, float *out);

/*
 * A sender's result from a reducer's answer (allreduce.h, "Compressed
 * rounds" has the derivation), element by element in double, rounded once:
 *   is_delta:  out[i] = qx[i] + ans[i] + share * (x[i] - qx[i])
 *   otherwise: out[i] =         ans[i] + share * (x[i] - qx[i])
 * with ans the decoded answer (the average minus the sender's part, or the
 * average), x the sender's exact values, qx its part as the reducer
 * decoded it, and share its weight's share of the average in [0, 1].
 * out may be x or ans.
 */
void hm_avg_answer_apply(float *out, const float *x, const float *qx, const float *ans, size_t n,
                         int is_delta, double share);

/* ---- weighted accumulation ---- */

/*
 * acc[i] += w * x[i] for i < n, in float32 (cblas_saxpy). The caller keeps
 * the total weight in a double, so that many small weights add up without
 * loss, and divides once with hm_avg_finalize. With k contributions the
 * average is within (k + 3) * 2^-24 * sum_j w_j |x_j[i]| / W of the exact
 * one (under 1e-6 of that for up to 13 contributions); with contributions
 * of one sign that is relative to the result. Returns 0, or -EDOM when w
 * is negative, NaN or over FLT_MAX. x is not checked: a contribution from a
 * peer has passed hm_avg_chunk_decode or hm_avg_all_finite first.
 */
int hm_avg_accumulate(float *acc, const float *x, size_t n, double w);

/*
 * The same for a tensor of dtype HM_DTYPE_F32, HM_DTYPE_F16 or
 * HM_DTYPE_BF16 in host byte order, converted to float32 in blocks on the
 * stack. Returns 0, -EDOM as above, or -EINVAL for another dtype.
 */
int hm_avg_accumulate_dtype(float *acc, int dtype, const void *x, size_t n, double w);

/*
 * acc[i] /= total_weight, each quotient rounded once. Returns 0; -EDOM when
 * total_weight is not positive and finite, or when some acc[i] is NaN or
 * infinite (the accumulation overflowed); acc is divided in either case.
 */
int hm_avg_finalize(float *acc, size_t n, double total_weight);

/*
 * out[i] = (float)((sum over j < m of w[j] * (double)xs[j][i]) / total), the
 * sum in double in the order of j, the quotient rounded once to float32:
 * the all-reduce's mean of one chunk, exact to float32 rounding for any m
 * a group has. Done in blocks so that it vectorizes; the same bits as the
 * element-by-element loop. The caller checks the inputs and the weights.
 */
void hm_avg_weighted_mean(const float *const *xs, const double *w, size_t m, size_t n,
                          double total, float *out);

/* 1 when every x[i] is finite (n == 0 included), else 0. */
int hm_avg_all_finite(const float *x, size_t n);

/*
 * What coding v[0..n) as comp costs in precision, up to a factor common to
 * the values one chunk may carry (the all-reduce's choice between a
 * sender's difference and the average, allreduce.h "Compressed rounds"):
 * fp16 rounds each value relative to itself, so the sum of squares (in
 * order, in double); 8 bits round to a step of the chunk's range, so
 * max - min. Returns 0 with *cost set, or -EDOM when a value is not
 * finite. For fp16 *cost itself may overflow to infinity.
 */
int hm_avg_coding_cost(int comp, const float *v, size_t n, double *cost);

/*
 * diff[i] = ans[i] - part[i], each taken in double and rounded once, then
 * hm_avg_coding_cost of diff: one pass for the difference and, for 8 bits,
 * its range and finiteness.
 */
int hm_avg_diff_cost(int comp, const float *ans, const float *part, float *diff, size_t n,
                     double *cost);

/* ---- CenteredClip ---- */

#define HM_AVG_CLIP_MAX_INPUTS 64
#define HM_AVG_CLIP_MAX_ITERS 1000

/*
 * CenteredClip (Karimireddy, He and Jaggi, "Learning from History for
 * Byzantine Robust Optimization", 2021), weighted: with W = sum_j w_j, each
 * iteration sets
 *
 *   v <- v + sum_j w_j * (x_j - v) * min(1, tau / ||x_j - v||) / W
 *
 * (||.|| the L2 norm over all m elements). Each input moves v by at most
 * w_j * tau / W per iteration, so inputs holding less than half the weight,
 * however far away, shift the fixed point by an amount bounded by tau and
 * their share of the weight; with every input within tau of v, one
 * iteration gives the weighted mean.
 *
 * v starts at the coordinate-wise weighted median (the smallest value whose
 * cumulative weight reaches W/2), as Hivemind's implementation does, not at
 * the weighted mean: since v moves by at most tau per iteration, a start
 * dragged a distance D away by one huge input would need D / tau
 * iterations to recover, and an input of 1e30 would win outright.
 * Iteration stops after iters steps, or earlier once a step moves v by no
 * more than 1e-6 * tau.
 *
 * xs holds n pointers (1 <= n <= HM_AVG_CLIP_MAX_INPUTS) to vectors of m
 * floats, w their weights; the result goes to v (m floats, not one of the
 * inputs). Norms and the update are computed in double; each iteration
 * costs O(n * m), the median O(n * m) expected. Returns the number of
 * iterations run (0..iters); -EINVAL for n out of range, iters over
 * HM_AVG_CLIP_MAX_ITERS, tau not positive and finite, a weight negative or
 * not finite, no positive weight, or v the same buffer as an input; -EDOM
 * when an input holds NaN or infinity.
 */
int hm_avg_centered_clip(const float *const *xs, const double *w, size_t n, size_t m,
                         double tau, unsigned iters, float *v);

#endif

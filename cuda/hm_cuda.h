/*
 * hm_cuda: the optional CUDA compute backend, built as libhm_cuda.so with
 * nvcc when the tree is configured --with-cuda and loaded at run time with
 * dlopen, so that hivemindd itself never links against the CUDA runtime and
 * runs unchanged on machines without a GPU or driver.
 *
 * The ABI is plain C. Every function works on arrays in host memory: it
 * copies its inputs to the device, runs one kernel and copies the results
 * back, in slices of at most HM_CUDA_SLICE_ELEMS elements so that the device
 * memory it takes is bounded whatever n is. Each call uses the calling
 * thread's current CUDA device (device 0 unless the caller chose another)
 * and keeps no state between calls.
 *
 * Every function returns 0 on success or a negative errno value, and none of
 * them aborts the process:
 *   -ENODEV  no usable GPU (no device, no driver, or a driver too old)
 *   -EINVAL  a NULL pointer with n > 0, or n too large to address in bytes
 *   -ENOMEM  device memory could not be allocated
 *   -EIO     a copy or a kernel failed
 * A call with n == 0 does nothing and returns 0.
 *
 * Half precision is IEEE 754 binary16 carried as uint16_t bit patterns;
 * fp32 -> fp16 rounds to nearest even, overflows to infinity and keeps NaN,
 * which is what the CPU path does, so both backends put the same bits on
 * the wire.
 *
 * A caller resolves the symbols with dlsym and checks hm_cuda_abi_version()
 * against HM_CUDA_ABI_VERSION before using the others.
 */
#ifndef HM_CUDA_H
#define HM_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HM_CUDA_ABI_VERSION 1

/* Elements moved to the device per slice: 16 Mi elements, 64 MiB of fp32. */
#define HM_CUDA_SLICE_ELEMS ((size_t)1 << 24)

/* The ABI version this library implements (HM_CUDA_ABI_VERSION). */
int hm_cuda_abi_version(void);

/* Number of usable CUDA devices; 0 when there is no GPU or no driver. */
int hm_cuda_device_count(void);

/*
 * Writes the name of the current device into buf (always terminated).
 * Returns 0, -ENODEV or -EINVAL.
 */
int hm_cuda_device_name(char *buf, size_t len);

/* y[i] += a * x[i] for i < n: the weighted accumulate of averaging. */
int hm_cuda_axpy(float a, const float *x, float *y, size_t n);

/* x[i] *= a for i < n. */
int hm_cuda_scale(float a, float *x, size_t n);

/* out[i] = fp16(in[i]) for i < n (round to nearest even). */
int hm_cuda_f32_to_f16(const float *in, uint16_t *out, size_t n);

/* out[i] = fp32(in[i]) for i < n (exact). */
int hm_cuda_f16_to_f32(const uint16_t *in, float *out, size_t n);

#ifdef __cplusplus
}
#endif

#endif

/*
 * hm_cuda.cu: the CUDA compute backend behind cuda/hm_cuda.h. It owns no
 * state between calls: each call checks for a device, allocates device
 * buffers for one slice, streams the host arrays through them slice by slice
 * and frees them again, so a failure in one call never leaks into the next
 * and the device memory taken is bounded by HM_CUDA_SLICE_ELEMS.
 *
 * CUDA runtime errors are turned into negative errno values here; nothing in
 * this file aborts or prints, because the library is loaded into a daemon
 * that must keep running (and fall back to the CPU) when the GPU misbehaves.
 */
#include "cuda/hm_cuda.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#define THREADS_PER_BLOCK 256
/* Grid-stride loops let a capped grid cover any slice length. */
#define MAX_BLOCKS 4096

enum slice_op {
    OP_AXPY = 1,
    OP_SCALE = 2,
    OP_F32_TO_F16 = 3,
    OP_F16_TO_F32 = 4,
};

static __global__ void axpy_kernel(float a, const float *x, float *y, size_t n)
{
    size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] += a * x[i];
}

static __global__ void scale_kernel(float a, float *x, size_t n)
{
    size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] *= a;
}

static __global__ void f32_to_f16_kernel(const float *in, unsigned short *out, size_t n)
{
    size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = __half_as_ushort(__float2half_rn(in[i]));
}

static __global__ void f16_to_f32_kernel(const unsigned short *in, float *out, size_t n)
{
    size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = __half2float(__ushort_as_half(in[i]));
}

/*
 * Maps a runtime error to our codes and clears it, so that a failed
 * allocation is not reported again by the next, unrelated call. Sticky
 * errors (a faulted context) stay sticky and keep mapping to -EIO.
 */
static int map_error(cudaError_t e)
{
    if (e == cudaSuccess)
        return 0;
    (void)cudaGetLastError();
    switch (e) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInvalidDevice:
        return -ENODEV;
    case cudaErrorMemoryAllocation:
        return -ENOMEM;
    default:
        return -EIO;
    }
}

static int have_device(void)
{
    int count = 0;
    int result = map_error(cudaGetDeviceCount(&count));

    if (result != 0)
        return -ENODEV;
    return count > 0 ? 0 : -ENODEV;
}

static unsigned blocks_for(size_t n)
{
    size_t blocks = (n + THREADS_PER_BLOCK - 1) / THREADS_PER_BLOCK;

    return (unsigned)(blocks < MAX_BLOCKS ? blocks : MAX_BLOCKS);
}

static void launch(int op, float a, const void *d_in, void *d_out, size_t len)
{
    unsigned blocks = blocks_for(len);

    switch (op) {
    case OP_AXPY:
        axpy_kernel<<<blocks, THREADS_PER_BLOCK>>>(a, (const float *)d_in, (float *)d_out, len);
        break;
    case OP_SCALE:
        scale_kernel<<<blocks, THREADS_PER_BLOCK>>>(a, (float *)d_out, len);
        break;
    case OP_F32_TO_F16:
        f32_to_f16_kernel<<<blocks, THREADS_PER_BLOCK>>>((const float *)d_in,
                                                         (unsigned short *)d_out, len);
        break;
    case OP_F16_TO_F32:
        f16_to_f32_kernel<<<blocks, THREADS_PER_BLOCK>>>((const unsigned short *)d_in,
                                                         (float *)d_out, len);
        break;
    }
}

/*
 * Runs op over n elements in slices. in (in_size bytes per element) is only
 * read; out (out_size bytes per element) is written, and also read first
 * when out_is_input is set (axpy's y, scale's x). in may be NULL for ops
 * that have no separate input.
 */
static int run_sliced(int op, float a, const void *in, size_t in_size, void *out,
                      size_t out_size, int out_is_input, size_t n)
{
    const uint8_t *src = (const uint8_t *)in;
    uint8_t *dst = (uint8_t *)out;
    void *d_in = NULL, *d_out = NULL;
    size_t slice, off, len;
    int result;

    if (n == 0)
        return 0;
    if ((in_size != 0 && in == NULL) || out == NULL)
        return -EINVAL;
    if (n > SIZE_MAX / 4)
        return -EINVAL;
    result = have_device();
    if (result != 0)
        return result;

    slice = n < HM_CUDA_SLICE_ELEMS ? n : HM_CUDA_SLICE_ELEMS;
    if (in_size != 0) {
        result = map_error(cudaMalloc(&d_in, slice * in_size));
        if (result != 0)
            goto out;
    }
    result = map_error(cudaMalloc(&d_out, slice * out_size));
    if (result != 0)
        goto out;

    for (off = 0; off < n; off += len) {
        len = n - off < slice ? n - off : slice;
        if (in_size != 0) {
            result = map_error(
                cudaMemcpy(d_in, src + off * in_size, len * in_size, cudaMemcpyHostToDevice));
            if (result != 0)
                goto out;
        }
        if (out_is_input) {
            result = map_error(cudaMemcpy(d_out, dst + off * out_size, len * out_size,
                                          cudaMemcpyHostToDevice));
            if (result != 0)
                goto out;
        }
        launch(op, a, d_in, d_out, len);
        /* A bad launch configuration shows here; a fault while the kernel
         * runs shows in the synchronous copy below. */
        result = map_error(cudaGetLastError());
        if (result != 0)
            goto out;
        result = map_error(
            cudaMemcpy(dst + off * out_size, d_out, len * out_size, cudaMemcpyDeviceToHost));
        if (result != 0)
            goto out;
    }

out:
    if (d_in != NULL)
        cudaFree(d_in);
    if (d_out != NULL)
        cudaFree(d_out);
    return result;
}

extern "C" int hm_cuda_abi_version(void)
{
    return HM_CUDA_ABI_VERSION;
}

extern "C" int hm_cuda_device_count(void)
{
    int count = 0;

    if (map_error(cudaGetDeviceCount(&count)) != 0)
        return 0;
    return count > 0 ? count : 0;
}

extern "C" int hm_cuda_device_name(char *buf, size_t len)
{
    cudaDeviceProp prop;
    int dev = 0;
    int result;

    if (buf == NULL || len == 0)
        return -EINVAL;
    buf[0] = '\0';
    result = have_device();
    if (result != 0)
        return result;
    result = map_error(cudaGetDevice(&dev));
    if (result != 0)
        return result;
    result = map_error(cudaGetDeviceProperties(&prop, dev));
    if (result != 0)
        return result;
    prop.name[sizeof(prop.name) - 1] = '\0';
    strncpy(buf, prop.name, len - 1);
    buf[len - 1] = '\0';
    return 0;
}

extern "C" int hm_cuda_axpy(float a, const float *x, float *y, size_t n)
{
    return run_sliced(OP_AXPY, a, x, sizeof(float), y, sizeof(float), 1, n);
}

extern "C" int hm_cuda_scale(float a, float *x, size_t n)
{
    return run_sliced(OP_SCALE, a, NULL, 0, x, sizeof(float), 1, n);
}

extern "C" int hm_cuda_f32_to_f16(const float *in, uint16_t *out, size_t n)
{
    return run_sliced(OP_F32_TO_F16, 0.0f, in, sizeof(float), out, sizeof(uint16_t), 0, n);
}

extern "C" int hm_cuda_f16_to_f32(const uint16_t *in, float *out, size_t n)
{
    return run_sliced(OP_F16_TO_F32, 0.0f, in, sizeof(uint16_t), out, sizeof(float), 0, n);
}

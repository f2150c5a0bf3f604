/*
** Device helpers shared by the kernel families: dtype-converting loads and stores that round exactly as
** the CPU backend does (bf16/f16 round to nearest even through f32; i32/u8 truncate and saturate, NaN -> 0),
** correctly rounded arithmetic where the CPU's order must be kept (no FMA contraction), Philox, launch sizing
** and the launch-error check.
*/
#ifndef MS_KERNELS_COMMON_CUH
#define MS_KERNELS_COMMON_CUH

#include "msk.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

/* --- element access ------------------------------------------------------------------------------ */

/* A 16-byte (or N * sizeof(T)) aligned group of N elements, loaded and stored as one access. */
template <class T, int N>
struct alignas(sizeof(T) * N) msk_pack {
    T v[N];
};

__device__ __forceinline__ float msk_f(float x) { return x; }
__device__ __forceinline__ double msk_f(double x) { return x; }
__device__ __forceinline__ float msk_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float msk_f(__half x) { return __half2float(x); }
__device__ __forceinline__ double msk_f(int32_t x) { return (double)x; }
__device__ __forceinline__ float msk_f(uint8_t x) { return (float)x; }

__device__ __forceinline__ int32_t msk_sat_i32(double x)
{
    if (x != x) return 0;
    if (x >= 2147483647.0) return INT32_MAX;
    if (x <= -2147483648.0) return INT32_MIN;
    return (int32_t)x;
}

__device__ __forceinline__ uint8_t msk_sat_u8(double x)
{
    if (x != x || x <= 0) return 0;
    if (x >= 255.0) return 255;
    return (uint8_t)x;
}

/* Value of compute type C stored as T (16-bit formats round once, from f32, as the CPU does). */
template <class T> struct msk_store_of;
template <> struct msk_store_of<float> {
    template <class C> __device__ static float cvt(C v) { return (float)v; }
};
template <> struct msk_store_of<double> {
    template <class C> __device__ static double cvt(C v) { return (double)v; }
};
template <> struct msk_store_of<__nv_bfloat16> {
    template <class C> __device__ static __nv_bfloat16 cvt(C v) { return __float2bfloat16_rn((float)v); }
};
template <> struct msk_store_of<__half> {
    template <class C> __device__ static __half cvt(C v) { return __float2half_rn((float)v); }
};
template <> struct msk_store_of<int32_t> {
    template <class C> __device__ static int32_t cvt(C v) { return msk_sat_i32((double)v); }
};
template <> struct msk_store_of<uint8_t> {
    template <class C> __device__ static uint8_t cvt(C v) { return msk_sat_u8((double)v); }
};

/* Element i of a runtime-typed buffer, as C. */
template <class C>
__device__ __forceinline__ C msk_load(const void *p, int64_t i, int dt)
{
    switch (dt) {
    case MS_DTYPE_F32:  return (C)((const float *)p)[i];
    case MS_DTYPE_F64:  return (C)((const double *)p)[i];
    case MS_DTYPE_BF16: return (C)__bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case MS_DTYPE_F16:  return (C)__half2float(((const __half *)p)[i]);
    case MS_DTYPE_I32:  return (C)((const int32_t *)p)[i];
    case MS_DTYPE_U8:   return (C)((const uint8_t *)p)[i];
    default:            return (C)0;
    }
}

template <class C>
__device__ __forceinline__ void msk_store(void *p, int64_t i, int dt, C v)
{
    switch (dt) {
    case MS_DTYPE_F32:  ((float *)p)[i] = msk_store_of<float>::cvt(v); break;
    case MS_DTYPE_F64:  ((double *)p)[i] = msk_store_of<double>::cvt(v); break;
    case MS_DTYPE_BF16: ((__nv_bfloat16 *)p)[i] = msk_store_of<__nv_bfloat16>::cvt(v); break;
    case MS_DTYPE_F16:  ((__half *)p)[i] = msk_store_of<__half>::cvt(v); break;
    case MS_DTYPE_I32:  ((int32_t *)p)[i] = msk_store_of<int32_t>::cvt(v); break;
    case MS_DTYPE_U8:   ((uint8_t *)p)[i] = msk_store_of<uint8_t>::cvt(v); break;
    default: break;
    }
}

/* A scalar operand's value (the device scalar is read here, at execution time). */
__device__ __forceinline__ double msk_scalar_value(const msk_scalar &s)
{
    return s.ptr ? msk_load<double>(s.ptr, 0, s.dtype) : s.value;
}

/* The last k in [lo, hi] with first(k) <= x, for first(k) ascending in k and first(lo) <= x: the member of a
** launch table that a tile, a quantization block or a row group belongs to. */
template <class F>
__device__ __forceinline__ int msk_last_at_most(int lo, int hi, int64_t x, const F &first)
{
    while (lo < hi) {
        const int mid = lo + (hi - lo + 1) / 2;
        if (first(mid) <= x) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* --- correctly rounded arithmetic (the CPU evaluates these without FMA) --------------------------- */

__device__ __forceinline__ float msk_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double msk_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float msk_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double msk_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float msk_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double msk_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float msk_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double msk_div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float msk_sqrt(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double msk_sqrt(double a) { return __dsqrt_rn(a); }

/* --- counter-based random bits -------------------------------------------------------------------- */

/* Element e's number in the stochastic rounding's Philox counter: a slice's in its whole (msk_rng, as
** ms_rng_element of engine/core/internal.h numbers it on the CPU). */
__device__ __forceinline__ uint64_t msk_rng_number(const msk_rng &r, int64_t e)
{
    return (uint64_t)(e + r.base + (r.div > 0 ? e / r.div * r.gap : 0));
}

/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; the constants of
** Random123): w <- the bijection of counter (c0..c3) under key (k0, k1), exactly as engine/cpu/random.c's
** ms_cpu_philox, so the CPU and the GPU draw the same bits. */
__device__ __forceinline__ void msk_philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                           uint32_t k1, uint32_t w[4])
{
#pragma unroll
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    w[0] = c0; w[1] = c1; w[2] = c2; w[3] = c3;
}

/* --- launches ------------------------------------------------------------------------------------- */

/* Blocks for a grid-stride loop over `work` items of MSK_THREADS threads each: enough to fill the device
** (8 resident blocks per multiprocessor), no more than the work needs. */
static inline unsigned msk_blocks(int64_t work)
{
    static int sms[64];
    int dev = 0;
    cudaGetDevice(&dev);
    int slot = dev >= 0 && dev < 64 ? dev : 0;
    if (sms[slot] == 0) {
        int n = 0;
        if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 132;
        sms[slot] = n;
    }
    int64_t want = (work + MSK_THREADS - 1) / MSK_THREADS, cap = (int64_t)sms[slot] * 8;
    if (want < 1) want = 1;
    return (unsigned)(want < cap ? want : cap);
}

/* Blocks for one pass over `work` items of MSK_THREADS threads each (no grid-stride repetition). */
static inline unsigned msk_blocks_all(int64_t work)
{
    int64_t want = (work + MSK_THREADS - 1) / MSK_THREADS;
    return (unsigned)(want < 1 ? 1 : want < 0x7fffffff ? want : 0x7fffffff);
}

/* MS_OK, or MS_E_BACKEND naming the launch when it failed. */
#define MSK_CHECK_LAUNCH(ctx, what)                                                                    \
    do {                                                                                               \
        cudaError_t e_ = cudaGetLastError();                                                           \
        if (e_ != cudaSuccess)                                                                         \
            return ms_error_at((ctx), MS_E_BACKEND, __FILE__, __LINE__, "cuda %s: kernel launch failed: " \
                               "%s (%s)", (what), cudaGetErrorName(e_), cudaGetErrorString(e_));      \
    } while (0)

#endif /* MS_KERNELS_COMMON_CUH */

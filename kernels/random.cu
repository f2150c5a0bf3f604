/*
** Counter-based random numbers on the GPU: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy
** as 1, 2, 3", SC'11; the constants of Random123) exactly as moonstep.h documents ms_rand, so element i of dst
** (row-major) gets the same uniform bits as on the CPU (engine/cpu/random.c) and normals equal to ~1e-6.
** Values are formed in f64 with correctly rounded operations (no FMA contraction) and rounded once to dst.
*/
#include "common.cuh"

#define TWO_PI 6.283185307179586476925286766559

/* 24-bit and 53-bit uniforms on [0, 1) (exact: integers times powers of two) */
__device__ __forceinline__ double u24(uint32_t w) { return (double)(w >> 8) * 0x1p-24; }
__device__ __forceinline__ double u53(uint32_t hi, uint32_t lo)
{
    return __dmul_rn(__dadd_rn(__dmul_rn((double)(hi >> 5), 0x1p26), (double)(lo >> 6)), 0x1p-53);
}

/* x rounded to dt, as a store keeps it */
__device__ __forceinline__ double round_to(int dt, double x)
{
    switch (dt) {
    case MS_DTYPE_F32:  return (double)(float)x;
    case MS_DTYPE_BF16: return (double)__bfloat162float(__float2bfloat16_rn((float)x));
    case MS_DTYPE_F16:  return (double)__half2float(__float2half_rn((float)x));
    default:            return x;
    }
}

__global__ void __launch_bounds__(MSK_THREADS) rand_kernel(msk_rand r)
{
    const uint32_t k0 = (uint32_t)r.seed, k1 = (uint32_t)(r.seed >> 32);
    const uint32_t o0 = (uint32_t)r.offset, o1 = (uint32_t)(r.offset >> 32);
    const bool wide = r.dtype == MS_DTYPE_F64;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = tid; i < r.numel; i += nth) {
        uint32_t w[4];
        msk_philox((uint32_t)i, (uint32_t)((uint64_t)i >> 32), o0, o1, k0, k1, w);
        double x;
        if (r.normal) {
            const double u1 = wide ? __dadd_rn(u53(w[0], w[1]), 0x1p-53) : __dadd_rn(u24(w[0]), 0x1p-24);
            const double u2 = wide ? u53(w[2], w[3]) : u24(w[2]);
            const double z = __dmul_rn(sqrt(__dmul_rn(-2.0, log(u1))), cos(__dmul_rn(TWO_PI, u2)));
            x = __dadd_rn(r.a, __dmul_rn(r.b, z));
        } else {
            x = __dadd_rn(r.a, __dmul_rn(r.b - r.a, wide ? u53(w[0], w[1]) : u24(w[0])));
            x = round_to(r.dtype, x);
            if (r.b > r.a && x >= r.b) x = r.top;
            else if (r.b > r.a && x < r.a) x = r.bot;
        }
        /* offset of element i in dst's (possibly strided) layout */
        int64_t off = 0, rest = i;
#pragma unroll
        for (int d = MSK_MAX_DIMS - 1; d >= 0; d--) {
            if (d >= r.ndim) continue;
            int64_t idx;
            if (d == 0) idx = rest;
            else {
                const int64_t q = rest / r.shape[d];
                idx = rest - q * r.shape[d];
                rest = q;
            }
            off += idx * r.strides[d];
        }
        msk_store<double>(r.dst, off, r.dtype, x);
    }
}

/* Contract: a float dtype, numel >= 1, a dst without stride-0 dims of size > 1 (checked by the core). */
extern "C" ms_status msk_rand_run(ms_ctx *ctx, cudaStream_t s, const msk_rand *r)
{
    if (r->numel < 1) return MS_OK;
    rand_kernel<<<msk_blocks(r->numel), MSK_THREADS, 0, s>>>(*r);
    MSK_CHECK_LAUNCH(ctx, "rand");
    return MS_OK;
}

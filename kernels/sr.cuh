/*
** Stochastic rounding of f32 results into bf16/f16 params, for the kernels of kernels/sinkgd.cu and
** kernels/adamw8.cu: the definition of engine/cpu/optim.c (sr_bf16, sr_f16, the Philox counter (element, step,
** member) under the key `seed`), so a GPU step rounds the same f32 value exactly as the CPU does.  kernels/optim.cu
** carries the same three functions for its own steps; the CPU-parity specs pin all of them to engine/cpu/optim.c
** bit for bit (tests/cuda_optim_spec.lua, tests/cuda_sinkgd_spec.lua).
*/
#ifndef MS_KERNELS_SR_CUH
#define MS_KERNELS_SR_CUH

#include "common.cuh"

#include <math.h>

/* bf16: truncate toward zero, then one ulp away from zero when the 24 random bits fall below the dropped 16 bits
** (scaled to 24): probability = the dropped fraction.  Inf and NaN round to nearest. */
__device__ __forceinline__ uint16_t msk_sr_bf16(float x, uint32_t u24)
{
    const uint32_t b = __float_as_uint(x);
    if ((b & 0x7fffffffu) >= 0x7f800000u) return __bfloat16_as_ushort(__float2bfloat16_rn(x));
    const uint32_t lo = b >> 16, dropped = b & 0xffffu;
    return (uint16_t)(u24 < (dropped << 8) ? lo + 1 : lo);
}

/* f16: the same rule on the f16 grid (normal: 13 dropped bits; subnormal: multiples of 2^-24, exact in f64). */
__device__ __forceinline__ uint16_t msk_sr_f16(float x, uint32_t u24)
{
    const uint32_t b = __float_as_uint(x), sign = (b >> 16) & 0x8000u, a = b & 0x7fffffffu;
    uint32_t q;
    bool up;
    if (a >= 0x7f800000u) return __half_as_ushort(__float2half_rn(x));
    if (a >= 0x47800000u) return (uint16_t)(sign | 0x7c00u);   /* |x| >= 2^16: even the truncation is infinite */
    if (a >= 0x38800000u) {
        q = (a >> 13) - (112u << 10);
        up = u24 < ((a & 0x1fffu) << 11);
    } else {
        const double s = __dmul_rn((double)__uint_as_float(a), 0x1p24), whole = floor(s);
        q = (uint32_t)whole;
        up = (double)u24 < __dmul_rn(__dsub_rn(s, whole), 0x1p24);
    }
    return (uint16_t)(sign | (q + (up ? 1u : 0u)));
}

/* The step's counter word: the rounded step, 0 when negative or not finite (as a step_t may hold). */
__device__ __forceinline__ uint32_t msk_step_word(double step)
{
    return step >= 0 && step < 0x1p64 ? (uint32_t)(uint64_t)step : 0;
}

/* x stored into element e of member `member`'s 16-bit param (bf16 when bf16, else f16), stochastically. */
__device__ __forceinline__ uint16_t msk_sr_16(float x, bool bf16, uint64_t e, uint32_t step, uint32_t member,
                                              uint32_t k0, uint32_t k1)
{
    uint32_t w[4];
    msk_philox((uint32_t)e, (uint32_t)(e >> 32), step, member, k0, k1, w);
    return bf16 ? msk_sr_bf16(x, w[0] >> 8) : msk_sr_f16(x, w[0] >> 8);
}

#endif /* MS_KERNELS_SR_CUH */

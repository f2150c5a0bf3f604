/*
** AdamW with 8-bit block-quantized moments on the GPU (ms_adamw8_step): the twin of engine/cpu/adamw8.c, whose
** arithmetic it does in the same order with correctly rounded f32 operations (never contracted into FMAs), so
** params, codes and scales equal the CPU's bit for bit (with a device step_t the bias corrections come from
** CUDA's pow, which may differ from glibc's in the last bit).  The state layout is torchao's OptimState8bit:
** u8 codes into the dynamic-tree map (Dettmers et al., arXiv 2110.02861), signed for exp_avg and unsigned for
** exp_avg_sq, and one f32 absmax scale per block.
**
** One warp per quantization block: its lanes take the block's elements lane, lane + 32, ... (coalesced).
** Pass 1 decodes the moments, updates them and p (stored right away) and finds the new absmaxes (a NaN-sticky
** shuffle reduction, order-free); pass 2 recomputes the same moments from the same old codes and encodes them
** with the new scales (each lane reads an old code before it writes the new one at the same place), so nothing
** block-sized is held in registers or shared memory whatever block_size is.  The two maps sit in shared memory.
** Members come as a table in the kernel parameters, as in kernels/optim.cu.
*/
#include "common.cuh"
#include "sr.cuh"

#include <math.h>
#include <new>

#define A8_THREADS 256
#define A8_WARPS   (A8_THREADS / 32)
#define PARAM_LIMIT 32764
#define SMALL_CAP 16
#define SCALE_MIN 1e-12f   /* torchao's clip of a block's absmax (an all-zero block) */

template <int CAP> struct a8args {
    msk_adamw8 o;
    int        n;
    int64_t    nblocks;
    int64_t    blk0[CAP];   /* each member's first quantization block (ascending) */
    msk_adamw8_member m[CAP];
};

static_assert(sizeof(a8args<MSK_ADAMW8_CAP>) <= PARAM_LIMIT, "the AdamW8 table exceeds the parameter space");

template <int CAP>
__device__ __forceinline__ int a8_member_of(const a8args<CAP> &A, int from, int64_t b)
{
    return msk_last_at_most(from, A.n - 1, b, [&](int k) { return A.blk0[k]; });
}

/* Element e (row-major) of a member's grad, in any layout, as f32 (as ms_cpu_load_f32 converts it). */
__device__ __forceinline__ float a8_grad(const msk_member &t, int64_t e)
{
    if (t.dense) return msk_load<float>(t.g, e, t.gdt);
    const int64_t r = e / t.cols, c = e - r * t.cols;
    return msk_load<float>(t.g, r * t.rs + c * t.cs, t.gdt);
}

/* The code of y in the ascending map q (engine/cpu/adamw8.c, encode: torchao's quantize_8bit_with_qmap): the
** largest c with q[c] <= y by an 8-step binary search (0 below q[0]), then c + 1 when y is at least half way. */
__device__ __forceinline__ uint8_t a8_encode(float y, const float *q)
{
    int c = y >= q[128] ? 128 : 0;
#pragma unroll
    for (int step = 64; step >= 1; step >>= 1)
        if (y >= q[c + step]) c += step;
    const int up = c < 255 ? c + 1 : 255;
    const float lo = q[c];
    if (__fsub_rn(y, lo) >= __fmul_rn(__fsub_rn(q[up], lo), 0.5f)) c = up;
    return (uint8_t)c;
}

/* NaN-sticky max of |x| (the CPU: a > amax || a != a), in any order */
__device__ __forceinline__ float a8_amax(float a, float b)
{
    if (a != a) return a;
    if (b != b) return b;
    return a > b ? a : b;
}

struct a8consts {
    float b1, omb1, b2, omb2, eps, bc2s;
};

/* m' and v' of element e from the old codes and scales (the CPU's order, each operation rounded) */
__device__ __forceinline__ void a8_moments(const a8consts &k, const float *qs, const float *qu, uint8_t cm, uint8_t cv,
                                           float ms, float vs, float g, float &m, float &v)
{
    m = __fadd_rn(__fmul_rn(k.b1, __fmul_rn(qs[cm], ms)), __fmul_rn(k.omb1, g));
    v = __fadd_rn(__fmul_rn(k.b2, __fmul_rn(qu[cv], vs)), __fmul_rn(__fmul_rn(k.omb2, g), g));
}

template <int CAP>
__global__ void __launch_bounds__(A8_THREADS) adamw8_kernel(const __grid_constant__ a8args<CAP> A)
{
    __shared__ float qs[256], qu[256];
    const msk_adamw &o = A.o.a;
    if (o.skip.ptr && msk_scalar_value(o.skip) != 0) return;   /* NaN skips too, as on the CPU */
    for (int i = threadIdx.x; i < 256; i += A8_THREADS) {
        qs[i] = A.o.qmap[0][i];
        qu[i] = A.o.qmap[1][i];
    }
    __syncthreads();
    const double lr = msk_scalar_value(o.lr), step = rint(msk_scalar_value(o.step));
    double bc1 = 1.0, bc2_sqrt = 1.0;
    if (o.bias_correction) {
        if (o.step.ptr) {
            bc1 = __dsub_rn(1.0, pow(o.beta1, step));
            bc2_sqrt = __dsqrt_rn(__dsub_rn(1.0, pow(o.beta2, step)));
        } else {
            bc1 = o.bc1;
            bc2_sqrt = o.bc2_sqrt;
        }
    }
    const a8consts k = { (float)o.beta1, (float)o.omb1, (float)o.beta2, (float)o.omb2, (float)o.eps, (float)bc2_sqrt };
    const bool stochastic = o.stochastic != 0;
    const uint32_t k0 = (uint32_t)o.seed, k1 = (uint32_t)(o.seed >> 32), sw = msk_step_word(step);
    const int B = A.o.block_size, lane = threadIdx.x & 31;
    const int64_t nwarps = (int64_t)gridDim.x * A8_WARPS;
    int i = 0;
    for (int64_t b = (int64_t)blockIdx.x * A8_WARPS + (threadIdx.x >> 5); b < A.nblocks; b += nwarps) {
        i = a8_member_of(A, i, b);
        const msk_adamw8_member &mb = A.m[i];
        const msk_member &t = mb.t;
        const int64_t qb = b - A.blk0[i], e0 = qb * B;
        const double lr_i = __dmul_rn(lr, t.scale);
        const float dec = (float)__dsub_rn(1.0, __dmul_rn(lr_i, o.weight_decay)), ss = (float)__ddiv_rn(lr_i, bc1);
        const float ms = mb.m_scale[qb], vs = mb.v_scale[qb];
        const uint8_t *cm = (const uint8_t *)t.s0, *cv = (const uint8_t *)t.s1;
        float am = 0, av = 0;
        for (int j = lane; j < B; j += 32) {
            const int64_t e = e0 + j;
            const float g = a8_grad(t, e);
            float m, v;
            a8_moments(k, qs, qu, cm[e], cv[e], ms, vs, g, m, v);
            const float p = msk_load<float>(t.x, e, t.xdt);
            const float pn = __fsub_rn(__fmul_rn(p, dec),
                                       __fmul_rn(ss, __fdiv_rn(m, __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bc2s), k.eps))));
            if (stochastic && t.xdt != MS_DTYPE_F32)
                ((uint16_t *)t.x)[e] = msk_sr_16(pn, t.xdt == MS_DTYPE_BF16, msk_rng_number(mb.rng, e), sw, (uint32_t)t.index,
                                                 k0, k1);
            else
                msk_store<float>(t.x, e, t.xdt, pn);
            am = a8_amax(am, fabsf(m));
            av = a8_amax(av, fabsf(v));
        }
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) {
            am = a8_amax(am, __shfl_xor_sync(0xffffffffu, am, off));
            av = a8_amax(av, __shfl_xor_sync(0xffffffffu, av, off));
        }
        const float sm = am > SCALE_MIN || am != am ? am : SCALE_MIN;
        const float sv = av > SCALE_MIN || av != av ? av : SCALE_MIN;
        for (int j = lane; j < B; j += 32) {
            const int64_t e = e0 + j;
            const float g = a8_grad(t, e);
            float m, v;
            a8_moments(k, qs, qu, cm[e], cv[e], ms, vs, g, m, v);   /* the old codes, read before they change */
            ((uint8_t *)t.s0)[e] = a8_encode(__fdiv_rn(m, sm), qs);
            ((uint8_t *)t.s1)[e] = a8_encode(__fdiv_rn(v, sv), qu);
        }
        __syncwarp();   /* every lane has read the old scales before lane 0 replaces them */
        if (lane == 0) {
            mb.m_scale[qb] = sm;
            mb.v_scale[qb] = sv;
        }
    }
}

template <int CAP>
static ms_status a8_launch(ms_ctx *ctx, cudaStream_t s, const msk_adamw8 *o, int n, const msk_adamw8_member *m)
{
    a8args<CAP> *a = new (std::nothrow) a8args<CAP>;
    if (a == NULL)
        return ms_error_at(ctx, MS_E_OOM, __FILE__, __LINE__, "cuda adamw8 step: no host memory for the launch table");
    a->o = *o;
    a->n = n;
    int64_t b = 0;
    for (int k = 0; k < n; k++) {
        a->m[k] = m[k];
        a->blk0[k] = b;
        b += m[k].t.numel / o->block_size;
    }
    a->nblocks = b;
    const int64_t ctas = (b + A8_WARPS - 1) / A8_WARPS;
    const unsigned grid = msk_blocks(ctas * MSK_THREADS);   /* at most 8 CTAs per SM, grid-stride beyond */
    if (b > 0) adamw8_kernel<CAP><<<grid, A8_THREADS, 0, s>>>(*a);
    delete a;
    MSK_CHECK_LAUNCH(ctx, "adamw8 step");
    return MS_OK;
}

extern "C" ms_status msk_adamw8_run(ms_ctx *ctx, cudaStream_t s, const msk_adamw8 *o, int n,
                                    const msk_adamw8_member *m, int *launches)
{
    *launches = 0;
    for (int first = 0; first < n; first += MSK_ADAMW8_CAP) {
        const int cnt = n - first < MSK_ADAMW8_CAP ? n - first : MSK_ADAMW8_CAP;
        ms_status st = cnt <= SMALL_CAP ? a8_launch<SMALL_CAP>(ctx, s, o, cnt, m + first)
                                        : a8_launch<MSK_ADAMW8_CAP>(ctx, s, o, cnt, m + first);
        if (st != MS_OK) return st;
        ++*launches;
    }
    return MS_OK;
}

/*
** DASH on the GPU (moonstep.h, "Shampoo on stacked blocks"; the reference: engine/cpu/dash.c): the fused
** elementwise work around the batched GEMMs of engine/cuda/dash.c.
**
**   gather / apply   parameter blocks <-> [N, r, c] f32 stacks, a table of blocks in the kernel parameters,
**                    one launch per MSK_DASH_CAP blocks; apply decays, scales and rounds (stochastically for
**                    16-bit params when asked) in one pass, with engine/cpu/dash.c's f32 arithmetic.
**   graft            DASH's Adam grafting state and per-block norms in one pass (f64 partials folded in order).
**   finish           what a symmetric product needs after cuBLAS: the lower panel blocks mirrored from the
**                    upper ones, a constant on the diagonal, the per-block distance to I (early exit), a
**                    16-bit copy (16-bit operands) -- one pass over half the matrix or less.
**   init kernels     each solver's first iterate from the input in one pass (scales folded in).
**   early exit       freeze / save / count on the device; compact fills the frozen positions below the live
**                    count with the live ones above it (in place, nothing else moves).
**   thin products    M V for the power iteration (f32) and the residual sketches (f64), one warp per rows,
**                    V staged in shared memory; column normalisation and Rayleigh quotients.
**   EVD helpers      the damped copy cuSOLVER factorises, and the eigenvector column scaling.
** Reductions run in a fixed order (no float atomics except a max, which is order-free): results are bitwise
** reproducible.  Arithmetic that engine/cpu/dash.c rounds step by step uses msk_mul / msk_add (no FMA).
*/
#include "common.cuh"
#include "sr.cuh"

#include <math.h>
#include <new>
#include <string.h>

#define T_ELEM 256          /* threads of the elementwise kernels */
#define PER_THREAD 4        /* elements per thread in gather / apply */
#define ELEMS_PER_CTA 1024  /* elements of a matrix per CTA in the per-position kernels */
#define MAX_GRID_Y 65535    /* positions beyond it run in further launches (y0 = the first position) */
#define SCALE_MIN 0x1p-126  /* engine/cpu/dash.c: the smallest scale */

__host__ __device__ __forceinline__ int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* position p's original position, and the block id of original position q (-1: none) */
__device__ __forceinline__ int64_t orig_of(const msk_dash_pos &P, int64_t p) { return P.map ? P.map[p] : p; }
__device__ __forceinline__ int64_t id_of(const msk_dash_pos &P, int64_t q) { return P.index ? P.index[q] : q; }

/* e / n for an element of an n x n matrix: 32-bit, as n * n < 2^31 (engine/cuda/dash.c refuses n > 46340); a 64-bit
** division per element cost the per-position passes more than their memory traffic */
__device__ __forceinline__ int64_t row_of(int64_t e, int64_t n) { return (int64_t)((uint32_t)e / (uint32_t)n); }
/* e / c for an element of an r x c block of rc elements (gather, apply): row_of's 32-bit division where rc < 2^32
** (e and c are then below it too), else a 64-bit one (a branch uniform across the grid) */
__device__ __forceinline__ int64_t block_row(int64_t e, int64_t c, int64_t rc)
{
    return rc <= (int64_t)UINT32_MAX ? row_of(e, c) : e / c;
}

__device__ __forceinline__ float load_f(const void *p, int64_t i, int dt) { return msk_load<float>(p, i, dt); }
__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

/* warp and block sums in a fixed order */
template <class V> __device__ __forceinline__ V warp_sum(V v)
{
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
/* sum over the CTA (blockDim a multiple of 32); every thread gets the same bits */
template <class V> __device__ __forceinline__ V block_sum(V v, V *red)
{
    const int t = threadIdx.x + threadIdx.y * blockDim.x, nw = (blockDim.x * blockDim.y) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if ((t & 31) == 0) red[t >> 5] = v;
    __syncthreads();
    V s = 0;
    for (int w = 0; w < nw; w++) s += red[w];
    return s;
}

#define LAUNCH_CHECK(what) MSK_CHECK_LAUNCH(ctx, what)

/* the per-position launches: grid.x over the n * n elements, grid.y over positions (in slices of MAX_GRID_Y) */
#define FOR_POSITIONS(launch)                                                                          \
    for (int64_t y0 = 0; y0 < pos->batch; y0 += MAX_GRID_Y) {                                         \
        const int64_t cnt_ = pos->batch - y0 < MAX_GRID_Y ? pos->batch - y0 : MAX_GRID_Y;               \
        dim3 grid((unsigned)cdiv(pos->n * pos->n, ELEMS_PER_CTA), (unsigned)cnt_);                      \
        launch;                                                                                        \
    }
#define FOR_ELEMS(e, nn)                                                                               \
    for (int64_t e = (int64_t)blockIdx.x * ELEMS_PER_CTA + threadIdx.x,                                \
                 e##_end = (int64_t)(blockIdx.x + 1) * ELEMS_PER_CTA < (nn) ? (int64_t)(blockIdx.x + 1) * ELEMS_PER_CTA : (nn); \
         e < e##_end; e += T_ELEM)

/* =====================================================================================================
** gather / apply
** ===================================================================================================== */

template <int CAP> struct blk_args {
    float       *stack;
    const float *scale;
    int64_t      c, rc;
    int          first;          /* index of b[0] in the call (its stack position) */
    msk_dash_apply o;
    msk_dash_block b[CAP];
};
static_assert(sizeof(blk_args<MSK_DASH_CAP>) <= 32764, "the DASH block table exceeds the parameter space");

template <int CAP>
__global__ void __launch_bounds__(T_ELEM) gather_kernel(const __grid_constant__ blk_args<CAP> A)
{
    const msk_dash_block &B = A.b[blockIdx.y];
    float *dst = A.stack + (int64_t)(A.first + blockIdx.y) * A.rc;
    const int64_t e0 = (int64_t)blockIdx.x * T_ELEM * PER_THREAD + threadIdx.x;
#pragma unroll
    for (int u = 0; u < PER_THREAD; u++) {
        const int64_t e = e0 + u * T_ELEM;
        if (e >= A.rc) break;
        const int64_t i = block_row(e, A.c, A.rc), j = e - i * A.c;
        dst[e] = load_f(B.p, i * B.rs + j * B.cs, B.dt);
    }
}

template <int CAP>
__global__ void __launch_bounds__(T_ELEM) apply_kernel(const __grid_constant__ blk_args<CAP> A)
{
    const msk_dash_apply &o = A.o;
    if (o.skip.ptr && msk_scalar_value(o.skip) != 0) return;   /* NaN skips too, as on the CPU */
    const msk_dash_block &B = A.b[blockIdx.y];
    const int64_t k = A.first + blockIdx.y;
    const float *src = A.stack + k * A.rc;
    const double sk = A.scale ? (double)A.scale[k] : 1.0;
    float dec = 1.0f, f;
    uint32_t stepw = 0;
    if (o.update) {
        const double lr = msk_scalar_value(o.lr);
        /* rounded as the CPU rounds it, product then difference: nvcc would contract 1 - lr wd into one FMA, whose
        ** f64 result may round to the next f32 (e.g. lr 0.0012550690257394218, wd 0.10004006285267383) */
        dec = (float)__dsub_rn(1.0, __dmul_rn(lr, o.weight_decay));
        f = (float)(lr * sk);
        if (o.stochastic) stepw = msk_step_word(rint(msk_scalar_value(o.step)));
    } else {
        f = (float)sk;
    }
    const bool sr = o.update && o.stochastic && (B.dt == MS_DTYPE_BF16 || B.dt == MS_DTYPE_F16);
    const uint32_t k0 = (uint32_t)o.seed, k1 = (uint32_t)(o.seed >> 32);
    const uint32_t member = sr ? (uint32_t)(o.ids ? o.ids[k] : B.tag) : 0u;
    const int64_t e0 = (int64_t)blockIdx.x * T_ELEM * PER_THREAD + threadIdx.x;
#pragma unroll
    for (int u = 0; u < PER_THREAD; u++) {
        const int64_t e = e0 + u * T_ELEM;
        if (e >= A.rc) break;
        const int64_t i = block_row(e, A.c, A.rc), j = e - i * A.c, off = i * B.rs + j * B.cs;
        const float s = src[e];
        const float x = o.update ? msk_sub(msk_mul(load_f(B.p, off, B.dt), dec), msk_mul(f, s)) : msk_mul(f, s);
        if (sr) ((uint16_t *)B.p)[off] = msk_sr_16(x, B.dt == MS_DTYPE_BF16, (uint64_t)(B.e0 + off), stepw, member,
                                                   k0, k1);
        else msk_store<float>(B.p, off, B.dt, x);
    }
}

template <bool APPLY>
static ms_status blocks_run(ms_ctx *ctx, cudaStream_t s, const msk_dash_apply *o, float *stack, const float *scale,
                            int64_t r, int64_t c, int n, const msk_dash_block *b, int *launches)
{
    blk_args<MSK_DASH_CAP> *a = new (std::nothrow) blk_args<MSK_DASH_CAP>;
    if (a == NULL) return ms_error_at(ctx, MS_E_OOM, __FILE__, __LINE__, "cuda dash: no host memory for a launch table");
    a->stack = stack;
    a->scale = scale;
    a->c = c;
    a->rc = r * c;
    if (o) a->o = *o;
    else memset(&a->o, 0, sizeof a->o);
    const int64_t gx = cdiv(r * c, (int64_t)T_ELEM * PER_THREAD);
    ms_status st = MS_OK;
    if (gx > 0x7fffffff) st = ms_error_at(ctx, MS_E_UNSUPPORTED, __FILE__, __LINE__, "cuda dash: blocks of %lld elements",
                                          (long long)(r * c));
    for (int first = 0; first < n && st == MS_OK; first += MSK_DASH_CAP) {
        const int cnt = n - first < MSK_DASH_CAP ? n - first : MSK_DASH_CAP;
        a->first = first;
        memcpy(a->b, b + first, sizeof *b * (size_t)cnt);
        dim3 grid((unsigned)gx, (unsigned)cnt);
        if (APPLY) apply_kernel<MSK_DASH_CAP><<<grid, T_ELEM, 0, s>>>(*a);
        else gather_kernel<MSK_DASH_CAP><<<grid, T_ELEM, 0, s>>>(*a);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            st = ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda %s: kernel launch failed: %s (%s)",
                             APPLY ? "ms_blocks_apply" : "ms_blocks_gather", cudaGetErrorName(e), cudaGetErrorString(e));
        ++*launches;
    }
    delete a;
    return st;
}

/* gather with the transposes and the grafting update: tiles of TT x TT elements, so that the stack and its
** transpose are both written in rows (coalesced) through shared memory; with GRAFT each element also updates
** m and v (and P_graft) as graft_kernel does, and each strip of tiles writes its f64 sum of P_graft^2 (folded
** in strip order by graft_fold_kernel) -- the grafting pass without reading the stack back */
#define TT 32
#define TT_ROWS 8

struct graft_pass {
    msk_dash_graft o;
    float  *m, *v, *pg;
    double *partials;   /* [n, strips] */
};

/* graft_kernel's per-element arithmetic (engine/cpu/dash.c's order, no FMA) */
struct graft_coef {
    bool  ema;
    float b1, omb1, b2, omb2, eps, cm, cv;
};
__device__ __forceinline__ graft_coef graft_coef_of(const msk_dash_graft &o)
{
    const double t = rint(msk_scalar_value(o.step));
    graft_coef g;
    g.ema = o.beta_grad > 0;
    g.b1 = (float)o.beta_grad;
    g.omb1 = (float)(1.0 - o.beta_grad);
    g.b2 = (float)o.beta_graft;
    g.omb2 = (float)(1.0 - o.beta_graft);
    g.eps = (float)o.eps;
    g.cm = o.bias_correction && g.ema ? (float)(1.0 - pow(o.beta_grad, t)) : 1.0f;
    g.cv = o.bias_correction ? (float)(1.0 - pow(o.beta_graft, t)) : 1.0f;
    return g;
}
__device__ __forceinline__ float graft_elem(const graft_coef &g, float gj, float *m, float *v, int64_t i)
{
    const float mj = g.ema ? msk_add(msk_mul(g.b1, m[i]), msk_mul(g.omb1, gj)) : gj;
    const float vj = msk_add(msk_mul(g.b2, v[i]), msk_mul(msk_mul(g.omb2, gj), gj));
    m[i] = mj;
    v[i] = vj;
    return msk_div(msk_div(mj, g.cm), msk_add(g.eps, msk_sqrt(msk_div(vj, g.cv))));
}

/* One CTA per strip of TT rows x TT_STRIP tiles: the grafting coefficients (two pow) and the f64 block sum
** are paid once per 32 elements a thread handles, as in graft_kernel (a CTA per tile paid them per 4). */
#define TT_STRIP 8

template <int CAP, bool TRANS, bool GRAFT>
__global__ void __launch_bounds__(TT * TT_ROWS) gather_t_kernel(const __grid_constant__ blk_args<CAP> A, float *stack_t,
                                                                int64_t r, int64_t strips_c, const graft_pass P)
{
    __shared__ float tile[TRANS ? TT : 1][TT + 1];
    __shared__ double red[TT * TT_ROWS / 32];
    const msk_dash_block &B = A.b[blockIdx.y];
    const int64_t k = A.first + blockIdx.y, c = A.c;
    const int64_t ti = blockIdx.x / (unsigned)strips_c, ts = blockIdx.x - ti * strips_c, i0 = ti * TT;
    float *dst = A.stack + k * A.rc, *dst_t = TRANS ? stack_t + k * A.rc : NULL;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const bool graft = GRAFT && !(P.o.skip.ptr && msk_scalar_value(P.o.skip) != 0);   /* NaN skips, as on the CPU */
    graft_coef gc;
    if (graft) gc = graft_coef_of(P.o);
    double acc = 0;
    for (int s = 0; s < TT_STRIP; s++) {
        const int64_t j0 = (ts * TT_STRIP + s) * TT;
        if (j0 >= c) break;   /* the same for the whole CTA */
#pragma unroll
        for (int u = ty; u < TT; u += TT_ROWS) {
            const int64_t i = i0 + u, j = j0 + tx;
            if (i < r && j < c) {
                const float x = load_f(B.p, i * B.rs + j * B.cs, B.dt);
                dst[i * c + j] = x;
                if (TRANS) tile[u][tx] = x;
                if (graft) {
                    const int64_t e = k * A.rc + i * c + j;
                    const float pj = graft_elem(gc, x, P.m, P.v, e);
                    if (P.pg) P.pg[e] = pj;
                    acc += (double)pj * pj;
                }
            }
        }
        if (TRANS) {
            __syncthreads();
#pragma unroll
            for (int u = ty; u < TT; u += TT_ROWS) {
                const int64_t j = j0 + u, i = i0 + tx;
                if (j < c && i < r) dst_t[j * r + i] = tile[tx][u];
            }
            __syncthreads();
        }
    }
    if (graft) {
        acc = block_sum<double>(acc, red);
        if (tx == 0 && ty == 0) P.partials[k * (int64_t)gridDim.x + blockIdx.x] = acc;
    }
}

__global__ void graft_fold_kernel(const msk_dash_graft o, float *norm, int64_t N, int64_t chunks,
                                  const double *partials);

extern "C" size_t msk_dash_gather_graft_scratch(int64_t n, int64_t r, int64_t c)
{
    return (size_t)(n * cdiv(r, TT) * cdiv(c, (int64_t)TT * TT_STRIP)) * sizeof(double);
}

/* Contract: as msk_dash_gather; stack_t (NULL: none) dense [n, c, r] f32; g (NULL: no grafting) as
** msk_dash_graft_run's stacks, its partials msk_dash_gather_graft_scratch bytes; nothing overlaps. */
extern "C" ms_status msk_dash_gather_t(ms_ctx *ctx, cudaStream_t s, float *stack, float *stack_t, int64_t r, int64_t c,
                                       int n, const msk_dash_block *b, const msk_dash_gather_graft *g, int *launches)
{
    blk_args<MSK_DASH_CAP> *a = new (std::nothrow) blk_args<MSK_DASH_CAP>;
    if (a == NULL) return ms_error_at(ctx, MS_E_OOM, __FILE__, __LINE__, "cuda dash: no host memory for a launch table");
    memset(&a->o, 0, sizeof a->o);
    a->stack = stack;
    a->scale = NULL;
    a->c = c;
    a->rc = r * c;
    graft_pass P;
    memset(&P, 0, sizeof P);
    if (g) P = graft_pass{ g->o, g->m, g->v, g->pgraft, g->partials };
    const int64_t tiles_c = cdiv(c, (int64_t)TT * TT_STRIP), tiles = cdiv(r, TT) * tiles_c;   /* strips */
    ms_status st = MS_OK;
    if (tiles > 0x7fffffff) st = ms_error_at(ctx, MS_E_UNSUPPORTED, __FILE__, __LINE__, "cuda dash: blocks of %lld elements",
                                             (long long)(r * c));
    for (int first = 0; first < n && st == MS_OK; first += MSK_DASH_CAP) {
        const int cnt = n - first < MSK_DASH_CAP ? n - first : MSK_DASH_CAP;
        a->first = first;
        memcpy(a->b, b + first, sizeof *b * (size_t)cnt);
        const dim3 grid((unsigned)tiles, (unsigned)cnt), block(TT, TT_ROWS);
        if (stack_t && g) gather_t_kernel<MSK_DASH_CAP, true, true><<<grid, block, 0, s>>>(*a, stack_t, r, tiles_c, P);
        else if (stack_t) gather_t_kernel<MSK_DASH_CAP, true, false><<<grid, block, 0, s>>>(*a, stack_t, r, tiles_c, P);
        else if (g) gather_t_kernel<MSK_DASH_CAP, false, true><<<grid, block, 0, s>>>(*a, NULL, r, tiles_c, P);
        else gather_t_kernel<MSK_DASH_CAP, false, false><<<grid, block, 0, s>>>(*a, NULL, r, tiles_c, P);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            st = ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda ms_blocks_gather_factors: kernel launch failed: "
                             "%s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
        ++*launches;
    }
    delete a;
    if (st == MS_OK && g) {
        graft_fold_kernel<<<(unsigned)cdiv(n, 128), 128, 0, s>>>(g->o, g->norm, n, tiles, g->partials);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            st = ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda ms_blocks_gather_factors (fold): kernel launch "
                             "failed: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
        ++*launches;
    }
    return st;
}

/* Contract: n >= 1 blocks of r x c (r, c >= 1), every element inside its tensor; for stochastic rounding the
** 16-bit tensors are contiguous (element (i, j) at e0 + i * c + j of the row-major index). */
extern "C" ms_status msk_dash_gather(ms_ctx *ctx, cudaStream_t s, float *stack, int64_t r, int64_t c, int n,
                                     const msk_dash_block *b, int *launches)
{
    return blocks_run<false>(ctx, s, NULL, stack, NULL, r, c, n, b, launches);
}

extern "C" ms_status msk_dash_apply_run(ms_ctx *ctx, cudaStream_t s, const msk_dash_apply *o, const float *stack,
                                        int64_t r, int64_t c, const float *scale, int n, const msk_dash_block *b,
                                        int *launches)
{
    return blocks_run<true>(ctx, s, o, (float *)stack, scale, r, c, n, b, launches);
}

/* =====================================================================================================
** graft: m, v, P_graft and the per-block norms; each block in fixed chunks of GRAFT_CHUNK elements, one CTA per
** chunk writing its f64 partial sum, then one thread per block adding its partials in order
** ===================================================================================================== */

#define GRAFT_CHUNK (T_ELEM * 32)

extern "C" size_t msk_dash_graft_scratch(int64_t N, int64_t rc)
{
    return (size_t)(N * cdiv(rc, GRAFT_CHUNK)) * sizeof(double);
}

__global__ void __launch_bounds__(T_ELEM) graft_kernel(const msk_dash_graft o, float *m, float *v, float *pg,
                                                       const float *g, int64_t rc, int64_t chunks, double *partials,
                                                       int64_t y0)
{
    __shared__ double red[T_ELEM / 32];
    if (o.skip.ptr && msk_scalar_value(o.skip) != 0) return;
    const int64_t k = y0 + blockIdx.y, c = blockIdx.x;
    const graft_coef gc = graft_coef_of(o);
    double acc = 0;
    const int64_t base = k * rc, lo = c * GRAFT_CHUNK, hi = lo + GRAFT_CHUNK < rc ? lo + GRAFT_CHUNK : rc;
    for (int64_t e = lo + threadIdx.x; e < hi; e += T_ELEM) {
        const int64_t i = base + e;
        const float pj = graft_elem(gc, g[i], m, v, i);
        if (pg) pg[i] = pj;
        acc += (double)pj * pj;
    }
    acc = block_sum<double>(acc, red);
    if (threadIdx.x == 0) partials[k * chunks + c] = acc;
}

__global__ void graft_fold_kernel(const msk_dash_graft o, float *norm, int64_t N, int64_t chunks,
                                  const double *partials)
{
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= N) return;
    if (o.skip.ptr && msk_scalar_value(o.skip) != 0) return;
    double s = 0;
    for (int64_t c = 0; c < chunks; c++) s += partials[k * chunks + c];
    norm[k] = (float)sqrt(s);
}

/* Contract: N >= 1, rc >= 0, all stacks dense [N, rc] f32 (pgraft may be NULL), partials msk_dash_graft_scratch.
** rc == 0: the fold alone (norm <- 0 unless skipped). */
extern "C" ms_status msk_dash_graft_run(ms_ctx *ctx, cudaStream_t s, const msk_dash_graft *o, float *m, float *v,
                                        float *norm, float *pgraft, const float *g, int64_t N, int64_t rc,
                                        double *partials)
{
    const int64_t chunks = cdiv(rc, GRAFT_CHUNK);
    for (int64_t y0 = 0; y0 < N && chunks > 0; y0 += MAX_GRID_Y) {
        const int64_t cnt = N - y0 < MAX_GRID_Y ? N - y0 : MAX_GRID_Y;
        graft_kernel<<<dim3((unsigned)chunks, (unsigned)cnt), T_ELEM, 0, s>>>(*o, m, v, pgraft, g, rc, chunks,
                                                                              partials, y0);
        LAUNCH_CHECK("ms_dash_graft");
    }
    graft_fold_kernel<<<(unsigned)cdiv(N, 128), 128, 0, s>>>(*o, norm, N, chunks, partials);
    LAUNCH_CHECK("ms_dash_graft (fold)");
    return MS_OK;
}

/* =====================================================================================================
** index check, finish, diagonal
** ===================================================================================================== */

__global__ void index_kernel(int64_t K, const int *index, int64_t nblocks, int *out)
{
    const int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= K) return;
    const int k = index[q];
    out[q] = k >= 0 && k < nblocks ? k : -1;
}

extern "C" ms_status msk_dash_index(ms_ctx *ctx, cudaStream_t s, int64_t K, const int *index, int64_t nblocks,
                                    int *index_out)
{
    if (K <= 0) return MS_OK;
    index_kernel<<<(unsigned)cdiv(K, 256), 256, 0, s>>>(K, index, nblocks, index_out);
    LAUNCH_CHECK("inv_root (index)");
    return MS_OK;
}

#define TILE 32
#define TROWS 8

/* the 32 x 32 tile a CTA owns: kind 0 = mirror target (r0, c0) from the source tile (c0, r0); kind 1 = a tile
** of a diagonal panel block */
struct tile_job { int kind; int64_t r0, c0; };

__device__ __forceinline__ int64_t rows_tiles(const msk_dash_sym &S, int j) { return cdiv(S.cut[j + 1] - S.cut[j], TILE); }

/* CTA t: first the mirror targets of the panel rows I = 1..split-1 (rows of panel I x columns [0, cut[I])), then
** the diagonal blocks (all their tiles when `full`, else the tiles on the diagonal only). */
__device__ __forceinline__ bool decode_tile(const msk_dash_sym &S, bool full, int64_t t, tile_job *job)
{
    for (int I = 1; I < S.split; I++) {
        const int64_t rt = rows_tiles(S, I), ct = S.cut[I] / TILE, cnt = rt * ct;
        if (t < cnt) {
            job->kind = 0;
            job->r0 = S.cut[I] + (t / ct) * TILE;
            job->c0 = (t % ct) * TILE;
            return true;
        }
        t -= cnt;
    }
    for (int I = 0; I < S.split; I++) {
        const int64_t rt = rows_tiles(S, I), cnt = full ? rt * rt : rt;
        if (t < cnt) {
            job->kind = 1;
            if (full) {
                job->r0 = S.cut[I] + (t / rt) * TILE;
                job->c0 = S.cut[I] + (t % rt) * TILE;
            } else {
                job->r0 = job->c0 = S.cut[I] + t * TILE;
            }
            return true;
        }
        t -= cnt;
    }
    return false;
}

static int64_t finish_tiles(const msk_dash_sym &S, int diag_mode)
{
    int64_t t = 0;
    for (int I = 1; I < S.split; I++) t += cdiv(S.cut[I + 1] - S.cut[I], TILE) * (S.cut[I] / TILE);
    for (int I = 0; I < S.split && diag_mode; I++) {
        const int64_t rt = cdiv(S.cut[I + 1] - S.cut[I], TILE);
        t += diag_mode == 2 ? rt * rt : rt;
    }
    return t;
}

/* |x| with NaN as +inf (fmaxf would drop a NaN; an infinite distance is never below a tolerance) */
__device__ __forceinline__ float absnan(float x) { return x != x ? INFINITY : fabsf(x); }

/* CN's N = ((p + 1) I - M) / p at element e of position p (msk_dash_finish's cn_p) */
__device__ __forceinline__ void cn_next(const msk_dash_finish &F, int64_t at, bool diag, float m)
{
    if (F.cn_p <= 0) return;
    const float ip = 1.0f / (float)F.cn_p, pp1 = (float)(F.cn_p + 1);
    const float nv = diag ? msk_mul(msk_sub(pp1, m), ip) : msk_mul(-m, ip);
    F.cn_n32[at] = nv;
    if (F.cn_n16) msk_store<float>(F.cn_n16, at, F.x16dt, nv);
}

template <class T>
__global__ void __launch_bounds__(TILE * TROWS) finish_kernel(const msk_dash_sym S, const msk_dash_finish F,
                                                               int diag_mode, int64_t y0)
{
    __shared__ float tile[TILE][TILE + 1];
    __shared__ float red[TROWS];
    const int64_t n = S.n, p = y0 + blockIdx.y, nn = n * n;
    tile_job job;
    if (!decode_tile(S, diag_mode == 2, blockIdx.x, &job)) return;
    T *x = (T *)F.x + p * nn;
    const int tx = threadIdx.x, ty = threadIdx.y;
    float dmax = 0;
    if (job.kind == 0) {
#pragma unroll
        for (int k = 0; k < TILE / TROWS; k++) {
            const int64_t row = job.c0 + ty + k * TROWS, col = job.r0 + tx;
            float val = 0;
            if (row < n && col < n) {
                val = msk_f(x[row * n + col]);
                dmax = fmaxf(dmax, absnan(val));
                if (F.x16) msk_store<float>(F.x16, p * nn + row * n + col, F.x16dt, val);
                cn_next(F, p * nn + row * n + col, false, val);
            }
            tile[ty + k * TROWS][tx] = val;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE / TROWS; k++) {
            const int64_t row = job.r0 + ty + k * TROWS, col = job.c0 + tx;
            if (row < n && col < n) {
                const float val = tile[tx][ty + k * TROWS];
                x[row * n + col] = msk_store_of<T>::cvt(val);
                if (F.x16) msk_store<float>(F.x16, p * nn + row * n + col, F.x16dt, val);
                cn_next(F, p * nn + row * n + col, false, val);
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < TILE / TROWS; k++) {
            const int64_t row = job.r0 + ty + k * TROWS, col = job.c0 + tx;
            if (row >= n || col >= n) continue;
            float val = msk_f(x[row * n + col]);
            if (row == col && F.diag != 0) {
                x[row * n + col] = msk_store_of<T>::cvt(msk_add(val, F.diag));
                val = msk_f(x[row * n + col]);   /* what is stored (16-bit targets round) */
            }
            dmax = fmaxf(dmax, absnan(row == col ? msk_sub(val, 1.0f) : val));
            if (F.x16) msk_store<float>(F.x16, p * nn + row * n + col, F.x16dt, val);
            cn_next(F, p * nn + row * n + col, row == col, val);
        }
    }
    if (F.dev) {
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) dmax = fmaxf(dmax, __shfl_xor_sync(0xffffffffu, dmax, o));
        if (tx == 0) red[ty] = dmax;
        __syncthreads();
        if (tx == 0 && ty == 0) {
            float mx = 0;
            for (int w = 0; w < TROWS; w++) mx = fmaxf(mx, red[w]);
            atomicMax(F.dev + p, __float_as_uint(mx));
        }
    }
}

/* Four values as 16-bit dt, packed into 8 bytes (the round of msk_store_of) */
__device__ __forceinline__ uint2 pack16(const float v[4], int dt)
{
    unsigned short h[4];
#pragma unroll
    for (int k = 0; k < 4; k++)
        h[k] = dt == MS_DTYPE_F16 ? __half_as_ushort(msk_store_of<__half>::cvt(v[k]))
                                  : __bfloat16_as_ushort(msk_store_of<__nv_bfloat16>::cvt(v[k]));
    return make_uint2((unsigned)h[0] | ((unsigned)h[1] << 16), (unsigned)h[2] | ((unsigned)h[3] << 16));
}

/* Four 16-bit dt values from 8 bytes, as floats (pack16 reversed: exact) */
__device__ __forceinline__ void unpack16(uint2 w, int dt, float v[4])
{
    const unsigned short h[4] = { (unsigned short)(w.x & 0xffffu), (unsigned short)(w.x >> 16),
                                  (unsigned short)(w.y & 0xffffu), (unsigned short)(w.y >> 16) };
#pragma unroll
    for (int k = 0; k < 4; k++)
        v[k] = dt == MS_DTYPE_F16 ? __half2float(__ushort_as_half(h[k])) : __bfloat162float(__ushort_as_bfloat16(h[k]));
}

/* The finish of a plain product (split 1) into f32 x with n % 4 == 0: the whole matrix is the one diagonal
** block, so the pass is elementwise -- float4 loads and stores, no tile decoding, no shared-memory transpose.
** The tile kernel ran this pass at a fraction of the memory bandwidth (~1 ms per check of a 228 x 1024 stack on
** the H200, against ~0.25 ms to read it), which made early exit cost more than it saved.  Same values, same
** order-free max, as finish_kernel's diagonal blocks. */
#define FLAT_CHUNK 4096   /* elements of one position per CTA */

__global__ void __launch_bounds__(T_ELEM) finish_flat_kernel(const msk_dash_finish F, int64_t n, int64_t y0)
{
    const int64_t p = y0 + blockIdx.y, nn = n * n, lo = (int64_t)blockIdx.x * FLAT_CHUNK;
    const int64_t hi = lo + FLAT_CHUNK < nn ? lo + FLAT_CHUNK : nn;
    /* x is f32, or 16-bit (CN's M written by its product in 16 bits: read only, diag 0, no x16) */
    const bool x32 = F.xdt == MS_DTYPE_F32;
    float4 *x4 = (float4 *)((float *)F.x + p * nn);
    const uint2 *x2 = (const uint2 *)((const unsigned short *)F.x + p * nn);
    float dmax = 0;
    for (int64_t e0 = lo + 4 * (int64_t)threadIdx.x; e0 < hi; e0 += 4 * T_ELEM) {
        float v[4];
        if (x32) {
            const float4 t = x4[e0 / 4];
            v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
        } else {
            unpack16(x2[e0 / 4], F.xdt, v);
        }
        const int64_t row = row_of(e0, n), dk = row - (e0 - row * n);   /* the diagonal is element dk of the four */
        if (dk >= 0 && dk < 4 && F.diag != 0) {
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (k == dk) v[k] = msk_add(v[k], F.diag);
            x4[e0 / 4] = make_float4(v[0], v[1], v[2], v[3]);
        }
#pragma unroll
        for (int k = 0; k < 4; k++) dmax = fmaxf(dmax, absnan(k == dk ? msk_sub(v[k], 1.0f) : v[k]));
        const int64_t at = p * nn + e0;
        if (F.x16) *(uint2 *)((unsigned short *)F.x16 + at) = pack16(v, F.x16dt);
        if (F.cn_p > 0) {
            const float ip = 1.0f / (float)F.cn_p, pp1 = (float)(F.cn_p + 1);
            float nv[4];
#pragma unroll
            for (int k = 0; k < 4; k++) nv[k] = k == dk ? msk_mul(msk_sub(pp1, v[k]), ip) : msk_mul(-v[k], ip);
            *(float4 *)(F.cn_n32 + at) = make_float4(nv[0], nv[1], nv[2], nv[3]);
            if (F.cn_n16) *(uint2 *)((unsigned short *)F.cn_n16 + at) = pack16(nv, F.x16dt);
        }
    }
    if (F.dev) {
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) dmax = fmaxf(dmax, __shfl_xor_sync(0xffffffffu, dmax, o));
        if ((threadIdx.x & 31) == 0) atomicMax(F.dev + p, __float_as_uint(dmax));
    }
}

/* Contract: sym's cuts as msk.h says (split 1: the whole matrix is one diagonal block). */
extern "C" ms_status msk_dash_finish_run(ms_ctx *ctx, cudaStream_t s, const msk_dash_sym *sym, const msk_dash_finish *f)
{
    if (f->batch <= 0) return MS_OK;
    const int diag_mode = (f->dev || f->x16 || f->cn_p > 0) ? 2 : f->diag != 0 ? 1 : 0;
    msk_dash_sym S = *sym;
    if (S.split <= 1) { S.split = 1; S.cut[0] = 0; S.cut[1] = (int)S.n; }
    /* the flat pass: every pointer is 16-byte aligned for float4 (slots are 256-byte aligned, positions
    ** n * n * 4 bytes apart) and 8-byte aligned for the packed 16-bit stores */
    const bool aligned = (((uintptr_t)f->x | (uintptr_t)f->cn_n32) & 15) == 0 &&
                         (((uintptr_t)f->x16 | (uintptr_t)f->cn_n16) & 7) == 0;
    /* 16-bit x only as CN's M (read, not written): diag 0 and no 16-bit copy */
    const bool flat_x = f->xdt == MS_DTYPE_F32 || (f->cn_p > 0 && f->diag == 0 && f->x16 == NULL);
    if (S.split == 1 && diag_mode == 2 && flat_x && S.n % 4 == 0 && aligned) {
        const int64_t nn = S.n * S.n;
        for (int64_t y0 = 0; y0 < f->batch; y0 += MAX_GRID_Y) {
            const int64_t cnt = f->batch - y0 < MAX_GRID_Y ? f->batch - y0 : MAX_GRID_Y;
            finish_flat_kernel<<<dim3((unsigned)cdiv(nn, FLAT_CHUNK), (unsigned)cnt), T_ELEM, 0, s>>>(*f, S.n, y0);
            LAUNCH_CHECK("inv_root (finish)");
        }
        return MS_OK;
    }
    const int64_t tiles = finish_tiles(S, diag_mode);
    if (tiles == 0) return MS_OK;
    dim3 block(TILE, TROWS);
    for (int64_t y0 = 0; y0 < f->batch; y0 += MAX_GRID_Y) {
        const int64_t cnt = f->batch - y0 < MAX_GRID_Y ? f->batch - y0 : MAX_GRID_Y;
        dim3 grid((unsigned)tiles, (unsigned)cnt);
        switch (f->xdt) {
        case MS_DTYPE_F32:  finish_kernel<float><<<grid, block, 0, s>>>(S, *f, diag_mode, y0); break;
        case MS_DTYPE_F16:  finish_kernel<__half><<<grid, block, 0, s>>>(S, *f, diag_mode, y0); break;
        case MS_DTYPE_BF16: finish_kernel<__nv_bfloat16><<<grid, block, 0, s>>>(S, *f, diag_mode, y0); break;
        default: return ms_error_at(ctx, MS_E_DTYPE, __FILE__, __LINE__, "cuda dash finish: dtype %d", f->xdt);
        }
        LAUNCH_CHECK("inv_root (finish)");
    }
    return MS_OK;
}

template <class T>
__global__ void diag_kernel(T *x, int64_t n, int64_t work, float v)
{
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= work) return;
    const int64_t p = t / n, i = t - p * n;
    T *e = x + p * n * n + i * n + i;
    *e = msk_store_of<T>::cvt(msk_add(msk_f(*e), v));
}

extern "C" ms_status msk_dash_diag(ms_ctx *ctx, cudaStream_t s, void *x, int dt, const msk_dash_pos *pos, float v)
{
    const int64_t work = pos->batch * pos->n;
    if (work <= 0) return MS_OK;
    const unsigned grid = (unsigned)cdiv(work, 256);
    switch (dt) {
    case MS_DTYPE_F32:  diag_kernel<float><<<grid, 256, 0, s>>>((float *)x, pos->n, work, v); break;
    case MS_DTYPE_F16:  diag_kernel<__half><<<grid, 256, 0, s>>>((__half *)x, pos->n, work, v); break;
    case MS_DTYPE_BF16: diag_kernel<__nv_bfloat16><<<grid, 256, 0, s>>>((__nv_bfloat16 *)x, pos->n, work, v); break;
    default: return ms_error_at(ctx, MS_E_DTYPE, __FILE__, __LINE__, "cuda dash diag: dtype %d", dt);
    }
    LAUNCH_CHECK("inv_root (diagonal)");
    return MS_OK;
}

/* =====================================================================================================
** init kernels
** ===================================================================================================== */

/* element (i, j) of position p's source as A_reg: the f32 entry plus (float)eps on the diagonal; a position
** without a block (invalid index) reads zeros */
__device__ __forceinline__ float src_at(const msk_dash_pos &P, const msk_dash_src &S, int64_t p, int64_t i, int64_t j)
{
    const int64_t blk = S.by_id ? id_of(P, orig_of(P, p)) : p;
    float v = blk >= 0 ? S.a[blk * P.n * P.n + i * P.n + j] : 0.0f;
    if (i == j) v = msk_add(v, (float)S.eps);
    return v;
}

__device__ __forceinline__ double spow(const double *scale, int64_t q, double e)
{
    return scale == NULL || e == 0 ? 1.0 : pow(scale[q], e);
}

__global__ void __launch_bounds__(T_ELEM) ndb_init_kernel(msk_dash_pos P, msk_dash_src S, const double *scale,
                                                           double se, double we, float *bs, float *z, void *bs16,
                                                           void *z16, int dt16, int64_t y0)
{
    const int64_t p = y0 + blockIdx.y, nn = P.n * P.n, q = orig_of(P, p);
    const double w = spow(scale, q, we);
    const float sig = (float)spow(scale, q, se), wf = (float)w, iw2 = (float)(1.0 / (w * w));
    FOR_ELEMS(e, nn) {
        const int64_t i = row_of(e, P.n), j = e - i * P.n;
        const float b = msk_mul(src_at(P, S, p, i, j), sig);
        float zv = msk_mul(-0.5f, b);
        if (i == j) zv = msk_add(zv, 1.5f);
        zv = msk_mul(wf, zv);
        const float bv = msk_mul(b, iw2);
        bs[p * nn + e] = bv;
        z[p * nn + e] = zv;
        if (bs16) msk_store<float>(bs16, p * nn + e, dt16, bv);
        if (z16) msk_store<float>(z16, p * nn + e, dt16, zv);
    }
}

extern "C" ms_status msk_dash_ndb_init(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, msk_dash_src src,
                                       const double *scale, double se, double we, float *bs, float *z, void *bs16,
                                       void *z16, int dt16)
{
    FOR_POSITIONS((ndb_init_kernel<<<grid, T_ELEM, 0, s>>>(*pos, src, scale, se, we, bs, z, bs16, z16, dt16, y0)));
    LAUNCH_CHECK("inv_root (NDB start)");
    return MS_OK;
}

__global__ void __launch_bounds__(T_ELEM) cn_init_kernel(msk_dash_pos P, msk_dash_src S, const double *scale, int root,
                                                          float *n32, void *n16, int dt16, float *x1, int x1_by_id,
                                                          void *m16, int64_t y0)
{
    const int64_t p = y0 + blockIdx.y, nn = P.n * P.n, q = orig_of(P, p);
    const double z = (root + 1) / (2.0 * scale[q]);
    const float zf = (float)z, x0 = (float)pow(z, 1.0 / root), ip = 1.0f / (float)root, pp1 = (float)(root + 1);
    const int64_t xo = x1_by_id ? id_of(P, q) : p;
    FOR_ELEMS(e, nn) {
        const int64_t i = row_of(e, P.n), j = e - i * P.n;
        const float mv = msk_mul(zf, src_at(P, S, p, i, j));
        const float nv = i == j ? msk_mul(msk_sub(pp1, mv), ip) : msk_mul(-mv, ip);
        n32[p * nn + e] = nv;
        if (n16) msk_store<float>(n16, p * nn + e, dt16, nv);
        if (m16) msk_store<float>(m16, p * nn + e, dt16, mv);
        if (xo >= 0) x1[xo * nn + e] = msk_mul(x0, nv);
    }
}

extern "C" ms_status msk_dash_cn_init(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, msk_dash_src src,
                                      const double *scale, int root, float *n32, void *n16, int dt16, float *x1,
                                      int x1_by_id, void *m16)
{
    FOR_POSITIONS((cn_init_kernel<<<grid, T_ELEM, 0, s>>>(*pos, src, scale, root, n32, n16, dt16, x1, x1_by_id, m16,
                                                          y0)));
    LAUNCH_CHECK("inv_root (CN start)");
    return MS_OK;
}

__global__ void __launch_bounds__(T_ELEM) cheb_init_kernel(msk_dash_pos P, msk_dash_src S, const double *scale,
                                                            double lo, float cd, float cd1, float *tm, float *b1,
                                                            float *b2, void *tm16, void *b116, int dt16, int64_t y0)
{
    const int64_t p = y0 + blockIdx.y, nn = P.n * P.n, q = orig_of(P, p);
    const double sq = scale[q];
    const float a2 = (float)(2.0 / (sq * (1.0 - lo))), sh = (float)((1.0 + lo) / (1.0 - lo)), c2 = 2.0f * cd;
    FOR_ELEMS(e, nn) {
        const int64_t i = row_of(e, P.n), j = e - i * P.n;
        float t = msk_mul(a2, src_at(P, S, p, i, j));
        if (i == j) t = msk_sub(t, sh);
        float bv = msk_mul(c2, t);
        if (i == j) bv = msk_add(bv, cd1);
        tm[p * nn + e] = t;
        b1[p * nn + e] = bv;
        b2[p * nn + e] = i == j ? cd : 0.0f;
        if (tm16) msk_store<float>(tm16, p * nn + e, dt16, t);
        if (b116) msk_store<float>(b116, p * nn + e, dt16, bv);
    }
}

extern "C" ms_status msk_dash_cheb_init(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, msk_dash_src src,
                                        const double *scale, double lo, float cd, float cd1, float *tm, float *b1,
                                        float *b2, void *tm16, void *b116, int dt16)
{
    FOR_POSITIONS((cheb_init_kernel<<<grid, T_ELEM, 0, s>>>(*pos, src, scale, lo, cd, cd1, tm, b1, b2, tm16, b116, dt16,
                                                            y0)));
    LAUNCH_CHECK("inv_root (Chebyshev start)");
    return MS_OK;
}

/* =====================================================================================================
** early exit
** ===================================================================================================== */

__global__ void freeze_kernel(msk_dash_pos P, int *live, unsigned *dev, float factor, float tol, float limit, int *iters,
                              int k)
{
    const int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= P.batch) return;
    int l = live[p];
    if (l < 0) l = 0;
    /* converged, or left the region of convergence (engine/cpu/dash.c's !(dev <= limit); NaN, kept as +inf, too):
    ** a diverging block iterated on overflows to Inf and NaN within a few steps */
    const float d = factor * __uint_as_float(dev[p]);
    if (l > 0 && (d < tol || !(d <= limit))) {
        l = -1;
        iters[orig_of(P, p)] += k;
    }
    live[p] = l;
    dev[p] = 0;
}

extern "C" ms_status msk_dash_freeze(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int *live, unsigned *dev,
                                     float factor, float tol, float limit, int *iters, int k)
{
    if (pos->batch <= 0) return MS_OK;
    freeze_kernel<<<(unsigned)cdiv(pos->batch, 256), 256, 0, s>>>(*pos, live, dev, factor, tol, limit, iters, k);
    LAUNCH_CHECK("inv_root (freeze)");
    return MS_OK;
}

#define SAVE_CTAS 32   /* CTAs per position of a save (most positions are skipped at once) */

__global__ void __launch_bounds__(T_ELEM) save_kernel(msk_dash_pos P, const int *live, int final, const float *src,
                                                       float *dst, int by_id, const double *scale, double fexp,
                                                       float c0, int64_t y0)
{
    const int64_t p = y0 + blockIdx.y, nn = P.n * P.n;
    if (live) {
        const int l = live[p];
        if (final ? l <= 0 : l != -1) return;
    }
    const int64_t q = orig_of(P, p), d = by_id ? id_of(P, q) : q;
    if (d < 0) return;
    const float *a = src + p * nn;
    float *b = dst + d * nn;
    const int64_t stride = (int64_t)gridDim.x * T_ELEM;
    if (scale) {
        const float f = (float)pow(scale[q], fexp), cf = msk_mul(c0, f);
        for (int64_t e = (int64_t)blockIdx.x * T_ELEM + threadIdx.x; e < nn; e += stride) {
            float v = msk_mul(a[e], f);
            if (cf != 0 && e / P.n == e % P.n) v = msk_add(v, cf);
            b[e] = v;
        }
    } else if (nn % 4 == 0 && (((uintptr_t)a | (uintptr_t)b) & 15) == 0) {
        for (int64_t e = (int64_t)blockIdx.x * T_ELEM + threadIdx.x; e < nn / 4; e += stride)
            ((float4 *)b)[e] = ((const float4 *)a)[e];
    } else {
        for (int64_t e = (int64_t)blockIdx.x * T_ELEM + threadIdx.x; e < nn; e += stride) b[e] = a[e];
    }
}

extern "C" ms_status msk_dash_save(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const int *live, int final,
                                   const float *src, float *dst, int dst_by_id, const double *scale, double fexp,
                                   float c0)
{
    const int64_t nn = pos->n * pos->n, gx = cdiv(nn, T_ELEM) < SAVE_CTAS ? cdiv(nn, T_ELEM) : SAVE_CTAS;
    for (int64_t y0 = 0; y0 < pos->batch; y0 += MAX_GRID_Y) {
        const int64_t cnt = pos->batch - y0 < MAX_GRID_Y ? pos->batch - y0 : MAX_GRID_Y;
        save_kernel<<<dim3((unsigned)gx, (unsigned)cnt), T_ELEM, 0, s>>>(*pos, live, final, src, dst, dst_by_id, scale,
                                                                         fexp, c0, y0);
        LAUNCH_CHECK("inv_root (save)");
    }
    return MS_OK;
}

__global__ void count_kernel(msk_dash_pos P, const int *live, int *iters, int T)
{
    const int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= P.batch) return;
    if (live == NULL || live[p] > 0) iters[orig_of(P, p)] += T;
}

extern "C" ms_status msk_dash_count(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const int *live, int *iters,
                                    int T)
{
    if (pos->batch <= 0) return MS_OK;
    count_kernel<<<(unsigned)cdiv(pos->batch, 256), 256, 0, s>>>(*pos, live, iters, T);
    LAUNCH_CHECK("inv_root (count)");
    return MS_OK;
}

/* one CTA of 1024 threads; flags counted 1024 positions at a time with ballots (a fixed order) */
__device__ __forceinline__ int cta_exclusive(int f, int *wsum, int *total)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned bal = __ballot_sync(0xffffffffu, f);
    if (lane == 0) wsum[warp] = __popc(bal);
    __syncthreads();
    int off = 0, t = 0;
    for (int w = 0; w < 32; w++) {
        if (w < warp) off += wsum[w];
        t += wsum[w];
    }
    __syncthreads();
    *total = t;
    return off + __popc(bal & ((1u << lane) - 1u));
}

__global__ void __launch_bounds__(1024) compact_kernel(msk_dash_pos P, int *live, int *map, int *from, int *to,
                                                        int *counts)
{
    __shared__ int wsum[32];
    /* the live bound the previous compaction published (0: none yet this pass; the host's batch may lag it) */
    int prev = counts[0];
    if (prev <= 0 || prev > P.batch) prev = (int)P.batch;
    int cnt = 0, total;
    for (int64_t p0 = 0; p0 < P.batch; p0 += 1024) {
        const int64_t p = p0 + threadIdx.x;
        cta_exclusive(p < P.batch && live[p] > 0, wsum, &total);
        cnt += total;
    }
    /* Worth it only when the batch shrinks by at least 1/16: until then the frozen positions ride along (their
    ** roots are saved; the GEMMs of a few extra positions cost less than the moves and the shorter batches' lower
    ** GEMM efficiency) */
    if ((int64_t)(prev - cnt) * 16 < (int64_t)prev) {
        if (threadIdx.x == 0) {
            counts[0] = prev;
            counts[1] = 0;
        }
        return;
    }
    /* holes: non-live positions below cnt; tails: live positions at or above cnt; paired in order */
    int nh = 0, nt = 0;
    for (int64_t p0 = 0; p0 < P.batch; p0 += 1024) {
        const int64_t p = p0 + threadIdx.x;
        const bool in = p < P.batch;
        const int l = in ? live[p] : 0;
        const int hole = in && p < cnt && l <= 0, tail = in && p >= cnt && l > 0;
        const int hi = cta_exclusive(hole, wsum, &total);
        if (hole) to[nh + hi] = (int)p;
        nh += total;
        const int ti = cta_exclusive(tail, wsum, &total);
        if (tail) from[nt + ti] = (int)p;
        nt += total;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nt; i += 1024) {
        map[to[i]] = map[from[i]];
        live[to[i]] = 1;
    }
    __syncthreads();
    for (int64_t p = cnt + threadIdx.x; p < P.batch; p += 1024) live[p] = 0;
    if (threadIdx.x == 0) {
        counts[0] = cnt;
        counts[1] = nt;
    }
}

extern "C" ms_status msk_dash_compact(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int *live, int *map,
                                      int *from, int *to, int *counts)
{
    compact_kernel<<<1, 1024, 0, s>>>(*pos, live, map, from, to, counts);
    LAUNCH_CHECK("inv_root (compact)");
    return MS_OK;
}

template <class W>
__global__ void __launch_bounds__(T_ELEM) move_kernel(const int *from, const int *to, const int *counts,
                                                       msk_dash_slot sl, int64_t words, int64_t y0)
{
    const int64_t i = y0 + blockIdx.y;
    if (i >= counts[1]) return;
    const W *a = (const W *)sl.base + (int64_t)from[i] * words;
    W *b = (W *)sl.base + (int64_t)to[i] * words;
    for (int64_t e = (int64_t)blockIdx.x * T_ELEM + threadIdx.x; e < words; e += (int64_t)gridDim.x * T_ELEM) b[e] = a[e];
}

extern "C" ms_status msk_dash_move(ms_ctx *ctx, cudaStream_t s, int64_t max_pairs, const int *from, const int *to,
                                   const int *counts, int nslots, const msk_dash_slot *slots)
{
    for (int j = 0; j < nslots; j++) {
        const msk_dash_slot &sl = slots[j];
        const bool v16 = sl.bytes % 16 == 0 && ((uintptr_t)sl.base % 16) == 0;
        const bool v4 = sl.bytes % 4 == 0 && ((uintptr_t)sl.base % 4) == 0;
        const int64_t unit = v16 ? 16 : v4 ? 4 : 2, words = sl.bytes / unit;
        const unsigned gx = (unsigned)(cdiv(words, T_ELEM) < 64 ? cdiv(words, T_ELEM) : 64);
        for (int64_t y0 = 0; y0 < max_pairs; y0 += MAX_GRID_Y) {
            const int64_t cnt = max_pairs - y0 < MAX_GRID_Y ? max_pairs - y0 : MAX_GRID_Y;
            dim3 grid(gx, (unsigned)cnt);
            if (v16) move_kernel<int4><<<grid, T_ELEM, 0, s>>>(from, to, counts, sl, words, y0);
            else if (v4) move_kernel<int><<<grid, T_ELEM, 0, s>>>(from, to, counts, sl, words, y0);
            else move_kernel<short><<<grid, T_ELEM, 0, s>>>(from, to, counts, sl, words, y0);
            LAUNCH_CHECK("inv_root (compaction move)");
        }
    }
    return MS_OK;
}

__global__ void iota_kernel(int64_t K, int *map)
{
    const int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (p < K) map[p] = (int)p;
}

extern "C" ms_status msk_dash_iota(ms_ctx *ctx, cudaStream_t s, int64_t K, int *map)
{
    if (K <= 0) return MS_OK;
    iota_kernel<<<(unsigned)cdiv(K, 256), 256, 0, s>>>(K, map);
    LAUNCH_CHECK("inv_root (positions)");
    return MS_OK;
}

__global__ void iters_out_kernel(msk_dash_pos P, const int *acc, int *out)
{
    const int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= P.batch) return;
    const int64_t d = id_of(P, q);
    if (d >= 0) out[d] = acc[q];
}

extern "C" ms_status msk_dash_iters_out(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const int *acc, int *out)
{
    if (pos->batch <= 0) return MS_OK;
    iters_out_kernel<<<(unsigned)cdiv(pos->batch, 256), 256, 0, s>>>(*pos, acc, out);
    LAUNCH_CHECK("inv_root (iterations)");
    return MS_OK;
}

/* =====================================================================================================
** random vectors, thin products, power iteration, norms
** ===================================================================================================== */

/* ms_rand's f32 normal at element i with offset `off`, key seed (kernels/random.cu's formula) */
__device__ __forceinline__ float normal_at(uint64_t seed, uint64_t off, uint64_t i)
{
    uint32_t w[4];
    msk_philox((uint32_t)i, (uint32_t)(i >> 32), (uint32_t)off, (uint32_t)(off >> 32), (uint32_t)seed,
               (uint32_t)(seed >> 32), w);
    const double u1 = __dadd_rn((double)(w[0] >> 8) * 0x1p-24, 0x1p-24);
    const double u2 = (double)(w[2] >> 8) * 0x1p-24;
    return (float)__dmul_rn(sqrt(__dmul_rn(-2.0, log(u1))), cos(__dmul_rn(6.283185307179586476925286766559, u2)));
}

/* block b's stream (moonstep.h, "Random vectors"): base + b, or base + its id read on the device */
template <class V>
__global__ void __launch_bounds__(T_ELEM) randn_kernel(msk_dash_pos P, int64_t m, V *v, uint64_t seed, uint64_t base,
                                                        const int *rng_ids, int64_t y0)
{
    const int64_t per = P.n * m, t = (int64_t)blockIdx.x * T_ELEM + threadIdx.x;
    if (t >= per) return;
    const int64_t p = y0 + blockIdx.y, b = id_of(P, orig_of(P, p));
    if (b < 0) {
        v[p * per + t] = (V)0;
        return;
    }
    const uint64_t slot = rng_ids ? (uint64_t)(uint32_t)rng_ids[b] : (uint64_t)b;
    v[p * per + t] = (V)normal_at(seed, base + slot, (uint64_t)t);
}

template <class V>
static ms_status randn_run(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int64_t m, V *v, uint64_t seed,
                           uint64_t base, const int *rng_ids)
{
    for (int64_t y0 = 0; y0 < pos->batch; y0 += MAX_GRID_Y) {
        const int64_t cnt = pos->batch - y0 < MAX_GRID_Y ? pos->batch - y0 : MAX_GRID_Y;
        randn_kernel<V><<<dim3((unsigned)cdiv(pos->n * m, T_ELEM), (unsigned)cnt), T_ELEM, 0, s>>>(*pos, m, v, seed,
                                                                                                  base, rng_ids, y0);
        LAUNCH_CHECK("inv_root (random vectors)");
    }
    return MS_OK;
}

extern "C" ms_status msk_dash_randn(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int64_t m, float *v,
                                    uint64_t seed, uint64_t base, const int *rng_ids)
{
    return randn_run<float>(ctx, s, pos, m, v, seed, base, rng_ids);
}

extern "C" ms_status msk_dash_randn64(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int64_t m, double *v,
                                      uint64_t seed, uint64_t base, const int *rng_ids)
{
    return randn_run<double>(ctx, s, pos, m, v, seed, base, rng_ids);
}

/* W = M V per position.  A CTA of THIN_WARPS warps owns THIN_WARPS * R consecutive rows; V goes through
** shared memory in chunks of THIN_KC rows (padded against bank conflicts); lane l takes k = l, l + 32, ... of
** every row, so a warp reads each row of M coalesced; the warp's sums are butterflies (a fixed order). */
#define THIN_WARPS 8
#define THIN_KC 128

template <class A> struct thin_elem;
template <> struct thin_elem<float> {
    __device__ static float get(const msk_dash_thin &t, float x, bool diag)
    {
        if (diag) x = msk_add(msk_add(x, t.d1), t.d2);
        return t.bf16 ? bf16_round(x) : x;
    }
};
template <> struct thin_elem<double> {
    __device__ static double get(const msk_dash_thin &t, float x, bool diag) { return diag ? (double)x + t.dd : (double)x; }
};

template <class A, int R, int MAXM>
__global__ void __launch_bounds__(THIN_WARPS * 32) thin_kernel(msk_dash_pos P, msk_dash_thin t, const A *v, A *w,
                                                                int64_t y0)
{
    extern __shared__ unsigned char thin_smem[];
    A *vs = (A *)thin_smem;   /* [THIN_KC][m + 1] */
    const int64_t n = P.n, m = t.vecs, p = y0 + blockIdx.y, ld = m + 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row0 = ((int64_t)blockIdx.x * THIN_WARPS + warp) * R;
    const int64_t blk = t.by_id ? id_of(P, orig_of(P, p)) : p;
    const float *M = blk >= 0 ? t.m + blk * n * n : NULL;
    const A *V = v + p * n * m;
    A acc[R][MAXM];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < MAXM; j++) acc[r][j] = 0;
    for (int64_t k0 = 0; k0 < n; k0 += THIN_KC) {
        const int64_t kc = n - k0 < THIN_KC ? n - k0 : THIN_KC;
        __syncthreads();
        for (int64_t e = threadIdx.x; e < kc * m; e += THIN_WARPS * 32) {
            const int64_t kk = e / m, j = e - kk * m;
            vs[kk * ld + j] = V[(k0 + kk) * m + j];
        }
        __syncthreads();
        if (M == NULL) continue;
        for (int64_t kk = lane; kk < kc; kk += 32) {
            const int64_t k = k0 + kk;
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int64_t i = row0 + r;
                if (i >= n) break;
                const A a = thin_elem<A>::get(t, M[i * n + k], i == k);
#pragma unroll
                for (int j = 0; j < MAXM; j++)
                    if (j < m) acc[r][j] += a * vs[kk * ld + j];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int64_t i = row0 + r;
#pragma unroll
        for (int j = 0; j < MAXM; j++) {
            const A s = warp_sum(acc[r][j]);
            if (lane == (j & 31) && i < n && j < m) w[p * n * m + i * m + j] = s;
        }
    }
}

template <class A, int R, int MAXM>
static ms_status thin_launch(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const msk_dash_thin *t, const A *v,
                             A *w)
{
    const size_t smem = (size_t)THIN_KC * (size_t)(t->vecs + 1) * sizeof(A);
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(thin_kernel<A, R, MAXM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)smem);
        if (e != cudaSuccess)
            return ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda dash thin product: cudaFuncSetAttribute "
                               "failed: %s", cudaGetErrorString(e));
    }
    const unsigned gx = (unsigned)cdiv(pos->n, THIN_WARPS * R);
    for (int64_t y0 = 0; y0 < pos->batch; y0 += MAX_GRID_Y) {
        const int64_t cnt = pos->batch - y0 < MAX_GRID_Y ? pos->batch - y0 : MAX_GRID_Y;
        thin_kernel<A, R, MAXM><<<dim3(gx, (unsigned)cnt), THIN_WARPS * 32, smem, s>>>(*pos, *t, v, w, y0);
        LAUNCH_CHECK("inv_root (thin product)");
    }
    return MS_OK;
}

/* Contract: 1 <= vecs <= 64; f64 form: vecs <= 4. */
extern "C" ms_status msk_dash_thin_f32(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const msk_dash_thin *t,
                                       const float *v, float *w)
{
    if (t->vecs <= 1) return thin_launch<float, 8, 1>(ctx, s, pos, t, v, w);
    if (t->vecs <= 4) return thin_launch<float, 4, 4>(ctx, s, pos, t, v, w);
    if (t->vecs <= 16) return thin_launch<float, 4, 16>(ctx, s, pos, t, v, w);
    return thin_launch<float, 1, 64>(ctx, s, pos, t, v, w);
}

extern "C" ms_status msk_dash_thin_f64(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const msk_dash_thin *t,
                                       const double *v, double *w)
{
    if (t->vecs > 4)
        return ms_error_at(ctx, MS_E_ARG, __FILE__, __LINE__, "cuda dash: %lld sketch vectors (at most 4)",
                           (long long)t->vecs);
    return thin_launch<double, 4, 4>(ctx, s, pos, t, v, w);
}

/* The power iteration's matrix for cuBLAS: position p's block (by id; a position without one: zeros) with
** d1 then d2 added to the diagonal as f32 adds, stored as f32 or rounded to bf16 (thin_elem<float>'s values). */
__global__ void __launch_bounds__(T_ELEM) pi_matrix_kernel(msk_dash_pos P, msk_dash_thin t, void *out, int64_t y0)
{
    const int64_t p = y0 + blockIdx.y, nn = P.n * P.n;
    const int64_t blk = t.by_id ? id_of(P, orig_of(P, p)) : p;
    const float *M = blk >= 0 ? t.m + blk * nn : NULL;
    FOR_ELEMS(e, nn) {
        const int64_t i = row_of(e, P.n), j = e - i * P.n;
        const float x = M ? thin_elem<float>::get(t, M[e], i == j) : 0.0f;
        if (t.bf16) ((__nv_bfloat16 *)out)[p * nn + e] = __float2bfloat16_rn(x);
        else ((float *)out)[p * nn + e] = x;
    }
}

/* Contract: out holds batch * n * n elements (bf16 when t->bf16, else f32). */
extern "C" ms_status msk_dash_pi_matrix(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const msk_dash_thin *t,
                                        void *out)
{
    FOR_POSITIONS((pi_matrix_kernel<<<grid, T_ELEM, 0, s>>>(*pos, *t, out, y0)));
    LAUNCH_CHECK("power iteration (matrix copy)");
    return MS_OK;
}

/* One CTA per position: each thread sums rows t, t + T, ... of PI_COLS columns at a time in f64; the CTA adds the
** warps' sums in a fixed order. */
#define PI_COLS 8

__global__ void __launch_bounds__(T_ELEM) pi_norm_kernel(msk_dash_pos P, int64_t m, const float *w, const float *vin,
                                                          float damp, int bf16, float *vout, __nv_bfloat16 *v16,
                                                          int64_t y0)
{
    __shared__ double red[PI_COLS][T_ELEM / 32];
    __shared__ float inv[PI_COLS];
    const int64_t p = y0 + blockIdx.y, per = P.n * m;
    const float *W = w + p * per;
    const float *Vin = vin ? vin + p * per : NULL;
    float *Vo = vout + p * per;
    for (int64_t j0 = 0; j0 < m; j0 += PI_COLS) {
        double acc[PI_COLS];
#pragma unroll
        for (int c = 0; c < PI_COLS; c++) acc[c] = 0;
        for (int64_t i = threadIdx.x; i < P.n; i += T_ELEM) {
#pragma unroll
            for (int c = 0; c < PI_COLS; c++) {
                if (j0 + c >= m) break;
                float x = W[i * m + j0 + c];
                if (Vin && damp != 0) x = msk_add(x, msk_mul(damp, Vin[i * m + j0 + c]));
                acc[c] += (double)x * x;
            }
        }
#pragma unroll
        for (int c = 0; c < PI_COLS; c++) {
            const double v = warp_sum(acc[c]);
            if ((threadIdx.x & 31) == 0) red[c][threadIdx.x >> 5] = v;
        }
        __syncthreads();
        if (threadIdx.x < PI_COLS) {
            double s = 0;
            for (int k = 0; k < T_ELEM / 32; k++) s += red[threadIdx.x][k];
            inv[threadIdx.x] = s > 0 ? (float)(1.0 / sqrt(s)) : 0.0f;
        }
        __syncthreads();
        for (int64_t i = threadIdx.x; i < P.n; i += T_ELEM) {
#pragma unroll
            for (int c = 0; c < PI_COLS; c++) {
                if (j0 + c >= m) break;
                float x = W[i * m + j0 + c];
                if (Vin && damp != 0) x = msk_add(x, msk_mul(damp, Vin[i * m + j0 + c]));
                x = msk_mul(x, inv[c]);
                Vo[i * m + j0 + c] = bf16 ? bf16_round(x) : x;
                if (v16) v16[p * per + i * m + j0 + c] = __float2bfloat16_rn(x);   /* the GEMM operand */
            }
        }
        __syncthreads();
    }
}

extern "C" ms_status msk_dash_pi_norm(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int64_t m, const float *w,
                                      const float *vin, float damp, int bf16, float *v, void *v16)
{
    for (int64_t y0 = 0; y0 < pos->batch; y0 += MAX_GRID_Y) {
        const int64_t cnt = pos->batch - y0 < MAX_GRID_Y ? pos->batch - y0 : MAX_GRID_Y;
        pi_norm_kernel<<<dim3(1, (unsigned)cnt), T_ELEM, 0, s>>>(*pos, m, w, vin, damp, bf16, v, (__nv_bfloat16 *)v16,
                                                                 y0);
        LAUNCH_CHECK("power iteration (normalise)");
    }
    return MS_OK;
}

__global__ void __launch_bounds__(T_ELEM) pi_rq_kernel(msk_dash_pos P, int64_t m, const float *v, const float *w,
                                                        float damp, int mode, double mult, double sub, double power,
                                                        void *dst, int64_t y0)
{
    __shared__ double red[PI_COLS][T_ELEM / 32];
    __shared__ double best;
    const int64_t p = y0 + blockIdx.y, per = P.n * m;
    if (threadIdx.x == 0) best = -INFINITY;
    for (int64_t j0 = 0; j0 < m; j0 += PI_COLS) {
        double acc[PI_COLS];
#pragma unroll
        for (int c = 0; c < PI_COLS; c++) acc[c] = 0;
        for (int64_t i = threadIdx.x; i < P.n; i += T_ELEM) {
#pragma unroll
            for (int c = 0; c < PI_COLS; c++) {
                if (j0 + c >= m) break;
                const float vi = v[p * per + i * m + j0 + c];
                float x = w[p * per + i * m + j0 + c];
                if (damp != 0) x = msk_add(x, msk_mul(damp, vi));
                acc[c] += (double)vi * x;
            }
        }
#pragma unroll
        for (int c = 0; c < PI_COLS; c++) {
            const double x = warp_sum(acc[c]);
            if ((threadIdx.x & 31) == 0) red[c][threadIdx.x >> 5] = x;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int c = 0; c < PI_COLS && j0 + c < m; c++) {
                double q = 0;
                for (int k = 0; k < T_ELEM / 32; k++) q += red[c][k];
                if (q != q || best != best) best = NAN;
                else if (q > best) best = q;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const int64_t q = orig_of(P, p), id = id_of(P, q);
        const double x = best;
        if (mode == 0) {
            double sc = mult * x;
            if (sc < SCALE_MIN) sc = SCALE_MIN;   /* NaN stays NaN */
            ((double *)dst)[q] = sc;
        } else if (id >= 0 && mode == 1) {
            ((float *)dst)[id] = (float)(x - sub);
        } else if (id >= 0) {
            ((float *)dst)[id] = x != x ? (float)x : x > 0 ? (float)pow(x, -power) : INFINITY;
        }
    }
}

extern "C" ms_status msk_dash_pi_rq(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int64_t m, const float *v,
                                    const float *w, float damp, int mode, double mult, double sub, double power,
                                    void *dst)
{
    for (int64_t y0 = 0; y0 < pos->batch; y0 += MAX_GRID_Y) {
        const int64_t cnt = pos->batch - y0 < MAX_GRID_Y ? pos->batch - y0 : MAX_GRID_Y;
        pi_rq_kernel<<<dim3(1, (unsigned)cnt), T_ELEM, 0, s>>>(*pos, m, v, w, damp, mode, mult, sub, power, dst, y0);
        LAUNCH_CHECK("power iteration (Rayleigh quotients)");
    }
    return MS_OK;
}

#define FRO_CHUNK (ELEMS_PER_CTA * 16)

extern "C" size_t msk_dash_fro_scratch(const msk_dash_pos *pos)
{
    return (size_t)(pos->batch * cdiv(pos->n * pos->n, FRO_CHUNK));
}

__global__ void __launch_bounds__(T_ELEM) fro_kernel(msk_dash_pos P, msk_dash_src S, double *partials, int64_t chunks,
                                                      int64_t y0)
{
    __shared__ double red[T_ELEM / 32];
    const int64_t p = y0 + blockIdx.y, nn = P.n * P.n, lo = (int64_t)blockIdx.x * FRO_CHUNK;
    double acc = 0;
    for (int64_t e = lo + threadIdx.x; e < lo + FRO_CHUNK && e < nn; e += T_ELEM) {
        const int64_t i = row_of(e, P.n), j = e - i * P.n;
        const double v = src_at(P, S, p, i, j);
        acc += v * v;
    }
    acc = block_sum<double>(acc, red);
    if (threadIdx.x == 0) partials[p * chunks + blockIdx.x] = acc;
}

__global__ void fro_fold_kernel(msk_dash_pos P, const double *partials, int64_t chunks, double *out)
{
    const int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= P.batch) return;
    double s = 0;
    for (int64_t c = 0; c < chunks; c++) s += partials[p * chunks + c];
    double x = sqrt(s);
    if (x < SCALE_MIN) x = SCALE_MIN;   /* NaN stays NaN */
    out[orig_of(P, p)] = x;
}

extern "C" ms_status msk_dash_fro(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, msk_dash_src src,
                                  double *partials, double *scale)
{
    if (pos->batch <= 0) return MS_OK;
    const int64_t chunks = cdiv(pos->n * pos->n, FRO_CHUNK);
    for (int64_t y0 = 0; y0 < pos->batch; y0 += MAX_GRID_Y) {
        const int64_t cnt = pos->batch - y0 < MAX_GRID_Y ? pos->batch - y0 : MAX_GRID_Y;
        fro_kernel<<<dim3((unsigned)chunks, (unsigned)cnt), T_ELEM, 0, s>>>(*pos, src, partials, chunks, y0);
        LAUNCH_CHECK("inv_root (Frobenius norms)");
    }
    fro_fold_kernel<<<(unsigned)cdiv(pos->batch, 128), 128, 0, s>>>(*pos, partials, chunks, scale);
    LAUNCH_CHECK("inv_root (Frobenius fold)");
    return MS_OK;
}

__global__ void __launch_bounds__(T_ELEM) residual_kernel(msk_dash_pos P, int64_t m, const double *v, const double *w,
                                                           float *res, int64_t y0)
{
    __shared__ double red[T_ELEM / 32];
    const int64_t p = y0 + blockIdx.y, per = P.n * m;
    double dd = 0, vv = 0;
    for (int64_t e = threadIdx.x; e < per; e += T_ELEM) {
        const double a = v[p * per + e], b = w[p * per + e];
        dd += (b - a) * (b - a);
        vv += a * a;
    }
    dd = block_sum<double>(dd, red);
    vv = block_sum<double>(vv, red);
    const int64_t id = id_of(P, orig_of(P, p));
    if (threadIdx.x == 0 && id >= 0) res[id] = vv > 0 ? (float)sqrt(dd / vv) : 0.0f;
}

extern "C" ms_status msk_dash_residual(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int64_t m, const double *v,
                                       const double *w, float *residual)
{
    for (int64_t y0 = 0; y0 < pos->batch; y0 += MAX_GRID_Y) {
        const int64_t cnt = pos->batch - y0 < MAX_GRID_Y ? pos->batch - y0 : MAX_GRID_Y;
        residual_kernel<<<dim3(1, (unsigned)cnt), T_ELEM, 0, s>>>(*pos, m, v, w, residual, y0);
        LAUNCH_CHECK("inv_root (residual)");
    }
    return MS_OK;
}

/* =====================================================================================================
** EVD helpers
** ===================================================================================================== */

__global__ void __launch_bounds__(T_ELEM) evd_prep_kernel(msk_dash_pos P, msk_dash_src S, float *work, int *bad, int64_t y0)
{
    const int64_t p = y0 + blockIdx.y, nn = P.n * P.n;
    FOR_ELEMS(e, nn) {
        const int64_t i = row_of(e, P.n), j = e - i * P.n;
        const float v = src_at(P, S, p, i, j);
        if (!isfinite(v)) atomicCAS(bad + p, 0, (int)(e + 1));   /* some non-finite entry's flat index + 1 */
        work[p * nn + e] = v;
    }
}

extern "C" ms_status msk_dash_evd_prep(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, msk_dash_src src,
                                       float *work, int *bad)
{
    cudaError_t e = cudaMemsetAsync(bad, 0, (size_t)pos->batch * sizeof(int), s);
    if (e != cudaSuccess)
        return ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda dash evd: cudaMemsetAsync failed: %s",
                           cudaGetErrorString(e));
    FOR_POSITIONS((evd_prep_kernel<<<grid, T_ELEM, 0, s>>>(*pos, src, work, bad, y0)));
    LAUNCH_CHECK("inv_root (EVD copy)");
    return MS_OK;
}

__global__ void __launch_bounds__(T_ELEM) evd_scale_kernel(msk_dash_pos P, float *q, const float *w, int root, double eps,
                                                            int shift, int64_t y0)
{
    const int64_t p = y0 + blockIdx.y, nn = P.n * P.n;
    const float *lam = w + p * P.n;
    const double add = shift ? eps - fmin((double)lam[0], 0.0) : 0.0;   /* ascending: lam[0] = lambda_min */
    FOR_ELEMS(e, nn) {
        const int64_t j = row_of(e, P.n);   /* column-major: element e is in column j */
        const double l = (double)lam[j] + add;
        const float f = l > 0 ? (float)pow(l, -0.5 / root) : 0.0f;
        q[p * nn + e] = msk_mul(q[p * nn + e], f);
    }
}

extern "C" ms_status msk_dash_evd_scale(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, float *q, const float *w,
                                        int root, double eps, int shift)
{
    FOR_POSITIONS((evd_scale_kernel<<<grid, T_ELEM, 0, s>>>(*pos, q, w, root, eps, shift, y0)));
    LAUNCH_CHECK("inv_root (EVD scaling)");
    return MS_OK;
}

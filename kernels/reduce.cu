/*
** Deterministic reductions (sum, mean, max, min, norm2, sumsq, amax) over one index of a strided source:
** no atomics, every partial combined in an order fixed by the shape alone, so a result is bitwise the same
** run after run.  Three kernels by geometry: a warp per output (short rows), blocks over fixed 16384-element
** chunks of one output (long rows; a second pass combines the chunk partials), and a thread per 1 or 4
** adjacent outputs walking their columns (the reduced index is not the fastest-varying one; chunks of rows,
** combined in order).
** Semantics follow engine/cpu/reduce.c: f32 accumulation (f64 for f64, i32 and u8), NaN sticks in max/min.
*/
#include "common.cuh"

#include <math.h>

#define ROW_SMALL  4096                    /* up to this many elements per output: a warp per output */
#define GROUP      4                       /* consecutive elements a thread takes at a time */
#define CHUNK      (MSK_THREADS * GROUP * 16) /* elements of one output per block in the long-row kernel */
#define COL_ROWS   256                     /* rows per chunk in the column kernel (at least) */
#define WARPS      (MSK_THREADS / 32)

/* --- the ops -------------------------------------------------------------------------------------- */

template <class A> __device__ __forceinline__ A r_init(int op)
{
    return op == MS_REDUCE_MAX ? (A)-INFINITY : op == MS_REDUCE_MIN ? (A)INFINITY : (A)0;
}

template <class A> __device__ __forceinline__ A r_max(A a, A x) { return x > a || x != x ? x : a; }
template <class A> __device__ __forceinline__ A r_min(A a, A x) { return x < a || x != x ? x : a; }

/* one element into an accumulator */
template <class A> __device__ __forceinline__ A r_upd(int op, A a, A x)
{
    switch (op) {
    case MS_REDUCE_MAX:   return r_max(a, x);
    case MS_REDUCE_MIN:   return r_min(a, x);
    case MS_REDUCE_AMAX:  return r_max(a, x < 0 ? -x : x);
    case MS_REDUCE_NORM2:
    case MS_REDUCE_SUMSQ: return a + x * x;
    default:              return a + x;
    }
}

/* two partials of the same op */
template <class A> __device__ __forceinline__ A r_comb(int op, A p, A q)
{
    switch (op) {
    case MS_REDUCE_MAX:
    case MS_REDUCE_AMAX: return r_max(p, q);
    case MS_REDUCE_MIN:  return r_min(p, q);
    default:             return p + q;
    }
}

template <class A> __device__ __forceinline__ A r_finish(int op, A acc, int64_t len)
{
    if (op == MS_REDUCE_MEAN) return acc / (A)len;
    if (op == MS_REDUCE_NORM2) return sqrt(acc);
    return acc;
}

/* Butterfly over the warp: a fixed pattern, so lane 0 always combines the same partials the same way. */
template <class A> __device__ __forceinline__ A warp_comb(int op, A v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = r_comb(op, v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* The block's partials combined (warps in order); the result is valid in thread 0. */
template <class A> __device__ __forceinline__ A block_comb(int op, A v, A *smem)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_comb(op, v);
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < WARPS ? smem[lane] : r_init<A>(op);
        v = warp_comb(op, v);
    }
    __syncthreads();   /* smem is reused by the next output */
    return v;
}

/* First element of output j. */
__device__ __forceinline__ int64_t out_base(const msk_reduce &r, int64_t j)
{
    int64_t off = 0;
#pragma unroll
    for (int d = MSK_MAX_DIMS - 1; d >= 0; d--) {
        if (d >= r.ondim) continue;
        int64_t idx;
        if (d == 0) idx = j;
        else {
            const int64_t q = j / r.oshape[d];
            idx = j - q * r.oshape[d];
            j = q;
        }
        off += idx * r.ostrides[d];
    }
    return off;
}

/* Elements k .. k+GROUP-1 of a row (all in range), as A.  vec: unit stride and the group aligned, so it is
** one GROUP * sizeof(T)-byte load. */
template <class T, class A>
__device__ __forceinline__ void load_group(const T *row, int64_t k, int64_t ks, bool vec, A *x)
{
    if (vec) {
        const msk_pack<T, GROUP> p = *reinterpret_cast<const msk_pack<T, GROUP> *>(row + k);
#pragma unroll
        for (int e = 0; e < GROUP; e++) x[e] = (A)msk_f(p.v[e]);
    } else {
#pragma unroll
        for (int e = 0; e < GROUP; e++) x[e] = (A)msk_f(row[(k + e) * ks]);
    }
}

/* Elements [k0, k1) of a row: thread t takes groups t, t + nthreads, ... in that order (four groups' loads
** in flight; the last, partial group element by element).  The order depends on the shape alone. */
template <class T, class A>
__device__ __forceinline__ A fold_range(int op, A acc, const T *row, int64_t k0, int64_t k1, int64_t ks,
                                        bool vec, int t, int nthreads)
{
    const int64_t stride = (int64_t)nthreads * GROUP;
    int64_t k = k0 + (int64_t)t * GROUP;
    for (; k + 3 * stride + GROUP <= k1; k += 4 * stride) {
        A x[4][GROUP];
#pragma unroll
        for (int u = 0; u < 4; u++) load_group<T, A>(row, k + u * stride, ks, vec, x[u]);
#pragma unroll
        for (int u = 0; u < 4; u++)
#pragma unroll
            for (int e = 0; e < GROUP; e++) acc = r_upd(op, acc, x[u][e]);
    }
    for (; k < k1; k += stride) {
        if (k + GROUP <= k1) {
            A x[GROUP];
            load_group<T, A>(row, k, ks, vec, x);
#pragma unroll
            for (int e = 0; e < GROUP; e++) acc = r_upd(op, acc, x[e]);
        } else {
            for (int64_t e = k; e < k1; e++) acc = r_upd(op, acc, (A)msk_f(row[e * ks]));
        }
    }
    return acc;
}

/* --- kernels -------------------------------------------------------------------------------------- */

/* A warp per output, rows of at most ROW_SMALL elements. */
template <class T, class A>
__global__ void __launch_bounds__(MSK_THREADS) red_row_warp(msk_reduce r, int vec)
{
    const int lane = threadIdx.x & 31;
    const T *src = (const T *)r.src;
    for (int64_t j = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5); j < r.nout; j += (int64_t)gridDim.x * WARPS) {
        A acc = fold_range<T, A>(r.op, r_init<A>(r.op), src + out_base(r, j), 0, r.len, r.kstride, vec, lane, 32);
        acc = warp_comb(r.op, acc);
        if (lane == 0) msk_store<A>(r.dst, j, r.dst_dtype, r_finish(r.op, acc, r.len));
    }
}

/* A block per (output, chunk of CHUNK elements); with one chunk the block finishes the output itself. */
template <class T, class A>
__global__ void __launch_bounds__(MSK_THREADS) red_row_block(msk_reduce r, int vec, int64_t nchunk, A *partial)
{
    __shared__ A smem[WARPS];
    const T *src = (const T *)r.src;
    for (int64_t t = blockIdx.x; t < r.nout * nchunk; t += gridDim.x) {
        const int64_t j = t / nchunk, c = t - j * nchunk;
        const int64_t k0 = c * CHUNK, k1 = r.len - k0 < CHUNK ? r.len : k0 + CHUNK;
        A acc = fold_range<T, A>(r.op, r_init<A>(r.op), src + out_base(r, j), k0, k1, r.kstride, vec,
                                 threadIdx.x, MSK_THREADS);
        acc = block_comb(r.op, acc, smem);
        if (threadIdx.x == 0) {
            if (nchunk == 1) msk_store<A>(r.dst, j, r.dst_dtype, r_finish(r.op, acc, r.len));
            else partial[t] = acc;
        }
    }
}

/* Second pass of the long-row kernel: a block per output over its nchunk partials (thread t combines t,
** t + 256, ... in order, four loads in flight), then the threads' partials in the block's fixed tree. */
template <class A>
__global__ void __launch_bounds__(MSK_THREADS) red_row_final(msk_reduce r, int64_t nchunk, const A *partial)
{
    __shared__ A smem[WARPS];
    for (int64_t j = blockIdx.x; j < r.nout; j += gridDim.x) {
        const A *p = partial + j * nchunk;
        A acc = r_init<A>(r.op);
        int64_t c = threadIdx.x;
        for (; c + 3 * MSK_THREADS < nchunk; c += 4 * MSK_THREADS) {
            const A v0 = p[c], v1 = p[c + MSK_THREADS], v2 = p[c + 2 * MSK_THREADS], v3 = p[c + 3 * MSK_THREADS];
            acc = r_comb(r.op, r_comb(r.op, r_comb(r.op, r_comb(r.op, acc, v0), v1), v2), v3);
        }
        for (; c < nchunk; c += MSK_THREADS) acc = r_comb(r.op, acc, p[c]);
        acc = block_comb(r.op, acc, smem);
        if (threadIdx.x == 0) msk_store<A>(r.dst, j, r.dst_dtype, r_finish(r.op, acc, r.len));
    }
}

/* A thread per W adjacent outputs (consecutive threads, consecutive outputs: coalesced when the outputs'
** innermost stride is 1; W = 4 loads the four as one access), blockIdx.y the chunk of `rows` rows, four rows'
** loads in flight.  Each output still takes its rows one by one in order, so W does not change results.
** With one chunk the thread finishes its outputs; otherwise partials [nchunk, nout] go to a second pass. */
template <class T, class A, int W>
__global__ void __launch_bounds__(MSK_THREADS) red_col(msk_reduce r, int64_t rows, int64_t nchunk, A *partial)
{
    typedef msk_pack<T, W> pack;
    const T *src = (const T *)r.src;
    const int64_t c = blockIdx.y;
    const int64_t k0 = c * rows, k1 = r.len - k0 < rows ? r.len : k0 + rows, ks = r.kstride;
    const int64_t ngroups = r.nout / W;
    for (int64_t g = (int64_t)blockIdx.x * MSK_THREADS + threadIdx.x; g < ngroups;
         g += (int64_t)gridDim.x * MSK_THREADS) {
        const int64_t j = g * W;
        const T *p = src + out_base(r, j);
        A acc[W];
#pragma unroll
        for (int e = 0; e < W; e++) acc[e] = r_init<A>(r.op);
        int64_t k = k0;
        for (; k + 4 <= k1; k += 4) {
            pack q[4];
#pragma unroll
            for (int u = 0; u < 4; u++) q[u] = *reinterpret_cast<const pack *>(p + (k + u) * ks);
#pragma unroll
            for (int u = 0; u < 4; u++)
#pragma unroll
                for (int e = 0; e < W; e++) acc[e] = r_upd(r.op, acc[e], (A)msk_f(q[u].v[e]));
        }
        for (; k < k1; k++) {
            const pack q = *reinterpret_cast<const pack *>(p + k * ks);
#pragma unroll
            for (int e = 0; e < W; e++) acc[e] = r_upd(r.op, acc[e], (A)msk_f(q.v[e]));
        }
#pragma unroll
        for (int e = 0; e < W; e++) {
            if (nchunk == 1) msk_store<A>(r.dst, j + e, r.dst_dtype, r_finish(r.op, acc[e], r.len));
            else partial[c * r.nout + j + e] = acc[e];
        }
    }
}

/* Second pass of the column kernel: a thread per output combines its chunks in order. */
template <class A>
__global__ void __launch_bounds__(MSK_THREADS) red_col_final(msk_reduce r, int64_t nchunk, const A *partial)
{
    for (int64_t j = (int64_t)blockIdx.x * MSK_THREADS + threadIdx.x; j < r.nout;
         j += (int64_t)gridDim.x * MSK_THREADS) {
        A acc = partial[j];
        for (int64_t c = 1; c < nchunk; c++) acc = r_comb(r.op, acc, partial[c * r.nout + j]);
        msk_store<A>(r.dst, j, r.dst_dtype, r_finish(r.op, acc, r.len));
    }
}

/* --- planning ------------------------------------------------------------------------------------- */

typedef struct plan {
    bool    column, wide, vec;   /* vec: GROUP consecutive elements (rows) or outputs (columns) per access */
    int64_t nchunk, rows;
    size_t  acc_size;
} plan;

static int64_t abs64(int64_t x) { return x < 0 ? -x : x; }

static plan make_plan(const msk_reduce *r)
{
    static const size_t esz[MS_DTYPE_COUNT] = { 4, 8, 2, 2, 4, 1 };
    plan p = { false, false, false, 1, 0, 4 };
    p.wide = !(r->src_dtype == MS_DTYPE_F32 || r->src_dtype == MS_DTYPE_BF16 || r->src_dtype == MS_DTYPE_F16);
    p.acc_size = p.wide ? sizeof(double) : sizeof(float);
    const size_t gb = GROUP * esz[r->src_dtype];
    const bool aligned = ((uintptr_t)r->src % gb) == 0;
    /* the column form when neighbouring outputs are closer in memory than neighbouring elements */
    p.column = r->ondim > 0 && r->len > 1 && abs64(r->ostrides[r->ondim - 1]) < abs64(r->kstride);
    if (p.column) {
        p.rows = COL_ROWS;
        if ((r->len + p.rows - 1) / p.rows > 65535) p.rows = (r->len + 65534) / 65535;
        p.nchunk = (r->len + p.rows - 1) / p.rows;
        /* GROUP adjacent outputs in one access: unit innermost stride, whole groups per innermost run, every
        ** group's first element aligned */
        const int last = r->ondim - 1;
        p.vec = aligned && r->ostrides[last] == 1 && r->oshape[last] % GROUP == 0 && r->kstride % GROUP == 0;
        for (int d = 0; d < last && p.vec; d++) p.vec = r->oshape[d] == 1 || r->ostrides[d] % GROUP == 0;
        return p;
    }
    if (r->len > ROW_SMALL) p.nchunk = (r->len + CHUNK - 1) / CHUNK;
    p.vec = r->kstride == 1 && aligned;
    for (int d = 0; d < r->ondim && p.vec; d++) p.vec = r->oshape[d] == 1 || r->ostrides[d] % GROUP == 0;
    return p;
}

extern "C" size_t msk_reduce_scratch(const msk_reduce *r)
{
    plan p = make_plan(r);
    return p.nchunk > 1 ? (size_t)(r->nout * p.nchunk) * p.acc_size : 0;
}

template <class T, class A>
static void launch(const msk_reduce *r, const plan &p, void *scratch, cudaStream_t s, int *launches)
{
    A *partial = (A *)scratch;
    if (p.column) {
        const int64_t groups = p.vec ? r->nout / GROUP : r->nout;
        const int64_t tiles = (groups + MSK_THREADS - 1) / MSK_THREADS;
        dim3 grid((unsigned)(tiles < 65535 * 32 ? tiles : 65535 * 32), (unsigned)p.nchunk);
        if (p.vec) red_col<T, A, GROUP><<<grid, MSK_THREADS, 0, s>>>(*r, p.rows, p.nchunk, partial);
        else red_col<T, A, 1><<<grid, MSK_THREADS, 0, s>>>(*r, p.rows, p.nchunk, partial);
        *launches = 1;
        if (p.nchunk > 1) {
            red_col_final<A><<<msk_blocks(r->nout), MSK_THREADS, 0, s>>>(*r, p.nchunk, partial);
            *launches = 2;
        }
        return;
    }
    if (p.nchunk == 1 && r->len <= ROW_SMALL) {
        red_row_warp<T, A><<<msk_blocks(r->nout * 32), MSK_THREADS, 0, s>>>(*r, p.vec ? 1 : 0);
        *launches = 1;
        return;
    }
    const int64_t blocks = r->nout * p.nchunk;
    red_row_block<T, A><<<(unsigned)(blocks < (1 << 30) ? blocks : (1 << 30)), MSK_THREADS, 0, s>>>(
        *r, p.vec ? 1 : 0, p.nchunk, partial);
    *launches = 1;
    if (p.nchunk > 1) {
        red_row_final<A><<<(unsigned)(r->nout < (1 << 30) ? r->nout : (1 << 30)), MSK_THREADS, 0, s>>>(*r, p.nchunk,
                                                                                                   partial);
        *launches = 2;
    }
}

/* Contract: len >= 1, nout >= 1, dst nout contiguous elements of a float dtype not overlapping src,
** scratch of msk_reduce_scratch(r) bytes (device memory, stream-ordered with s). */
extern "C" ms_status msk_reduce_run(ms_ctx *ctx, cudaStream_t s, const msk_reduce *r, void *scratch, int *launches)
{
    *launches = 0;
    if (r->len < 1 || r->nout < 1 || (unsigned)r->src_dtype >= MS_DTYPE_COUNT)
        return ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda reduce: empty or invalid reduction "
                           "(nout %lld, len %lld)", (long long)r->nout, (long long)r->len);
    plan p = make_plan(r);
    if (p.nchunk > 1 && scratch == NULL)
        return ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda reduce: scratch missing");
    switch (r->src_dtype) {
    case MS_DTYPE_F32:  launch<float, float>(r, p, scratch, s, launches); break;
    case MS_DTYPE_BF16: launch<__nv_bfloat16, float>(r, p, scratch, s, launches); break;
    case MS_DTYPE_F16:  launch<__half, float>(r, p, scratch, s, launches); break;
    case MS_DTYPE_F64:  launch<double, double>(r, p, scratch, s, launches); break;
    case MS_DTYPE_I32:  launch<int32_t, double>(r, p, scratch, s, launches); break;
    case MS_DTYPE_U8:   launch<uint8_t, double>(r, p, scratch, s, launches); break;
    default: break;
    }
    MSK_CHECK_LAUNCH(ctx, "reduce");
    return MS_OK;
}

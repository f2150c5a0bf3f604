/*
** Fused optimizer steps (AdamW, SGD) and multi-tensor helpers (sum of squares, scale) on the GPU: the twins of
** engine/cpu/optim.c, with its arithmetic in its order, correctly rounded and never contracted into FMAs, so
** f32 results, sums and stochastic-rounding decisions equal the CPU's bit for bit.  (With a device step_t the
** bias corrections come from CUDA's f64 pow, which may differ from glibc's in the last bit.)
** Semantics: torch.optim.AdamW and torch.optim.SGD.  The multi-tensor launch over a table of members follows
** NVIDIA apex's multi_tensor_apply (csrc/multi_tensor_apply.cuh), with the table in the kernel parameters.
*/
#include "common.cuh"

#include <math.h>
#include <new>

#define GROUP       8                          /* consecutive elements a thread takes: 16-byte accesses */
#define TILE        (MSK_THREADS * GROUP)      /* elements of a member per block iteration (steps, scale) */
#define SUMSQ_CHUNK 4096                       /* engine/cpu/optim.c's summation order (SUMSQ_CHUNK, */
#define SUMSQ_LANES 8                          /* SUMSQ_LANES there) */
#define SUMSQ_TILE  (MSK_THREADS / SUMSQ_LANES) /* chunks per block iteration: 8 threads per chunk */
#define SMALL_CAP   16                         /* a second table size, so small groups pass ~2 KB, not ~30 */
#define PARAM_LIMIT 32764                      /* bytes of kernel parameters (CUDA 12.1+, compute 7.0+) */

/* --- the launch table ------------------------------------------------------------------------------- */

/* The members of one launch and where each one's tiles start (ascending; a block finds its member by binary
** search).  Passed as a __grid_constant__ parameter: read in place from the parameter bank, never copied. */
template <int CAP> struct table {
    int        n;
    int64_t    ntiles;
    int64_t    tile0[CAP];
    msk_member m[CAP];
};

/* the members' stochastic-rounding element numbers (msk_rng), in the tables of calls that give them */
template <int CAP, bool RNG> struct rng_table { msk_rng r[CAP]; };
template <int CAP> struct rng_table<CAP, false> {};

template <int CAP, bool RNG = false> struct adamw_args { msk_adamw o; table<CAP> t; rng_table<CAP, RNG> g; };
template <int CAP, bool RNG = false> struct sgd_args { msk_sgd o; table<CAP> t; rng_table<CAP, RNG> g; };
template <int CAP> using adamw_plain_args = adamw_args<CAP, false>;
template <int CAP> using sgd_plain_args = sgd_args<CAP, false>;
template <int CAP> using adamw_rng_args = adamw_args<CAP, true>;
template <int CAP> using sgd_rng_args = sgd_args<CAP, true>;
template <int CAP> struct scale_args { msk_scalar v; table<CAP> t; };
template <int CAP> struct sumsq_args {
    void     *dst;
    int       dst_dtype;
    double   *partials;
    unsigned *tickets;
    int64_t   part0[CAP];   /* each member's first chunk partial in `partials` */
    table<CAP> t;
};

static_assert(sizeof(adamw_plain_args<MSK_OPTIM_CAP>) <= PARAM_LIMIT, "the AdamW table exceeds the parameter space");
static_assert(sizeof(sgd_plain_args<MSK_OPTIM_CAP>) <= PARAM_LIMIT, "the SGD table exceeds the parameter space");
static_assert(sizeof(sumsq_args<MSK_OPTIM_CAP>) <= PARAM_LIMIT, "the sumsq table exceeds the parameter space");
static_assert(sizeof(adamw_rng_args<MSK_OPTIM_RNG_CAP>) <= PARAM_LIMIT, "the AdamW table exceeds the parameter space");
static_assert(sizeof(sgd_rng_args<MSK_OPTIM_RNG_CAP>) <= PARAM_LIMIT, "the SGD table exceeds the parameter space");

/* The member of tile t: the last k with tile0[k] <= t, searched from `from` (a block's tiles only grow). */
template <int CAP>
__device__ __forceinline__ int member_of(const table<CAP> &tb, int from, int64_t t)
{
    return msk_last_at_most(from, tb.n - 1, t, [&](int k) { return tb.tile0[k]; });
}

/* The table's tiles on this block's grid stride: f(member, e, cnt) for this thread's GROUP elements (cnt fewer at a
** member's end) from element e of each tile's member; threads past a member's end take none. */
template <int CAP, class F>
__device__ __forceinline__ void for_tiles(const table<CAP> &tb, const F &f)
{
    int i = 0;
    for (int64_t t = blockIdx.x; t < tb.ntiles; t += gridDim.x) {
        i = member_of(tb, i, t);
        const msk_member &m = tb.m[i];
        const int64_t e = (t - tb.tile0[i]) * TILE + (int64_t)threadIdx.x * GROUP;
        if (e >= m.numel) continue;
        f(m, e, m.numel - e < GROUP ? (int)(m.numel - e) : GROUP);
    }
}

/* --- element runs ---------------------------------------------------------------------------------
** A thread takes GROUP consecutive elements, in runs of NE elements [e, e + cnt) (cnt < NE only at a member's
** end).  Dense operands are read and written as packs of up to 16 bytes when vec (aligned base, a whole run):
** e is a multiple of NE, so every pack of every dtype is aligned then. */

template <int NE, class T, class C>
__device__ __forceinline__ void load_dense_t(const T *p, int64_t e, int cnt, bool vec, C *x)
{
    constexpr int N = 16 / sizeof(T) < NE ? 16 / sizeof(T) : NE;
    if (vec) {
#pragma unroll
        for (int k = 0; k < NE; k += N) {
            const msk_pack<T, N> q = *reinterpret_cast<const msk_pack<T, N> *>(p + e + k);
#pragma unroll
            for (int j = 0; j < N; j++) x[k + j] = (C)msk_f(q.v[j]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < NE; j++) x[j] = j < cnt ? (C)msk_f(p[e + j]) : (C)0;
    }
}

template <int NE, class T, class C>
__device__ __forceinline__ void store_dense_t(T *p, int64_t e, int cnt, bool vec, const C *x)
{
    constexpr int N = 16 / sizeof(T) < NE ? 16 / sizeof(T) : NE;
    if (vec) {
#pragma unroll
        for (int k = 0; k < NE; k += N) {
            msk_pack<T, N> q;
#pragma unroll
            for (int j = 0; j < N; j++) q.v[j] = msk_store_of<T>::cvt(x[k + j]);
            *reinterpret_cast<msk_pack<T, N> *>(p + e + k) = q;
        }
    } else {
#pragma unroll
        for (int j = 0; j < NE; j++)
            if (j < cnt) p[e + j] = msk_store_of<T>::cvt(x[j]);
    }
}

/* A dense float operand of runtime dtype dt (uniform over a block's tile, so the switch never diverges). */
template <int NE, class C>
__device__ __forceinline__ void load_dense(const void *p, int dt, int64_t e, int cnt, bool vec, C *x)
{
    switch (dt) {
    case MS_DTYPE_F32:  load_dense_t<NE>((const float *)p, e, cnt, vec, x); break;
    case MS_DTYPE_F64:  load_dense_t<NE>((const double *)p, e, cnt, vec, x); break;
    case MS_DTYPE_BF16: load_dense_t<NE>((const __nv_bfloat16 *)p, e, cnt, vec, x); break;
    case MS_DTYPE_F16:  load_dense_t<NE>((const __half *)p, e, cnt, vec, x); break;
    default: break;
    }
}

template <int NE, class C>
__device__ __forceinline__ void store_dense(void *p, int dt, int64_t e, int cnt, bool vec, const C *x)
{
    switch (dt) {
    case MS_DTYPE_F32:  store_dense_t<NE>((float *)p, e, cnt, vec, x); break;
    case MS_DTYPE_F64:  store_dense_t<NE>((double *)p, e, cnt, vec, x); break;
    case MS_DTYPE_BF16: store_dense_t<NE>((__nv_bfloat16 *)p, e, cnt, vec, x); break;
    case MS_DTYPE_F16:  store_dense_t<NE>((__half *)p, e, cnt, vec, x); break;
    default: break;
    }
}

/* Elements [e, e + cnt) of a member's strided operand at p (the member's layout, p's dtype dt). */
template <int NE, class C>
__device__ __forceinline__ void load_strided(const void *p, int dt, const msk_member &m, int64_t e, int cnt, C *x)
{
    int64_t r = e / m.cols, c = e - r * m.cols;
#pragma unroll
    for (int j = 0; j < NE; j++) {
        x[j] = (C)0;
        if (j < cnt) {
            x[j] = msk_load<C>(p, r * m.rs + c * m.cs, dt);
            if (++c == m.cols) { c = 0; r++; }
        }
    }
}

template <int NE, class C>
__device__ __forceinline__ void store_strided(void *p, int dt, const msk_member &m, int64_t e, int cnt, const C *x)
{
    int64_t r = e / m.cols, c = e - r * m.cols;
#pragma unroll
    for (int j = 0; j < NE; j++) {
        if (j < cnt) {
            msk_store<C>(p, r * m.rs + c * m.cs, dt, x[j]);
            if (++c == m.cols) { c = 0; r++; }
        }
    }
}

template <int NE, class C>
__device__ __forceinline__ void load_grad(const msk_member &m, int64_t e, int cnt, C *x)
{
    if (m.dense) load_dense<NE>(m.g, m.gdt, e, cnt, (m.vec & MSK_VEC_G) && cnt == NE, x);
    else load_strided<NE>(m.g, m.gdt, m, e, cnt, x);
}

/* A thread's GROUP elements as runs of NE: 8 at once in f32, two halves of 4 in f64 (four arrays of eight
** doubles would hold 128 registers and starve the f32 path of occupancy).  fn(e, cnt) per run. */
template <class C> struct run_of { static constexpr int n = sizeof(C) == 8 ? GROUP / 2 : GROUP; };

template <class C, class Fn>
__device__ __forceinline__ void in_runs(int64_t e, int cnt, Fn fn)
{
    constexpr int NE = run_of<C>::n;
#pragma unroll
    for (int k = 0; k < GROUP; k += NE)
        if (k < cnt) fn(e + k, cnt - k < NE ? cnt - k : NE);
}

/* --- stochastic rounding: the definition of engine/cpu/optim.c, on the same Philox bits ---------------- */

__device__ __forceinline__ uint16_t sr_bf16(float x, uint32_t u24)
{
    const uint32_t b = __float_as_uint(x);
    if ((b & 0x7fffffffu) >= 0x7f800000u) return __bfloat16_as_ushort(__float2bfloat16_rn(x));
    const uint32_t lo = b >> 16, dropped = b & 0xffffu;
    return (uint16_t)(u24 < (dropped << 8) ? lo + 1 : lo);   /* +1 on the sign-magnitude pattern: away from 0 */
}

__device__ __forceinline__ uint16_t sr_f16(float x, uint32_t u24)
{
    const uint32_t b = __float_as_uint(x), sign = (b >> 16) & 0x8000u, a = b & 0x7fffffffu;
    uint32_t q;
    bool up;
    if (a >= 0x7f800000u) return __half_as_ushort(__float2half_rn(x));
    if (a >= 0x47800000u) return (uint16_t)(sign | 0x7c00u);   /* |x| >= 2^16: even the truncation is infinite */
    if (a >= 0x38800000u) {                                     /* a normal f16: 13 bits dropped */
        q = (a >> 13) - (112u << 10);
        up = u24 < ((a & 0x1fffu) << 11);
    } else {                                                    /* subnormal f16: multiples of 2^-24, exact in f64 */
        const double s = __dmul_rn((double)__uint_as_float(a), 0x1p24), whole = floor(s);
        q = (uint32_t)whole;
        up = (double)u24 < __dmul_rn(__dsub_rn(s, whole), 0x1p24);
    }
    return (uint16_t)(sign | (q + (up ? 1u : 0u)));
}

/* The step's counter word: the rounded step, 0 when negative or not finite (as a step_t may hold). */
__device__ __forceinline__ uint32_t step_word(double step)
{
    return step >= 0 && step < 0x1p64 ? (uint32_t)(uint64_t)step : 0;
}

/* Rounding of a step's stored params: the Philox key and counter words, and whether it is stochastic. */
struct rounding {
    bool     stochastic;
    uint32_t k0, k1, step;
};

/* A run of f32 results into the member's param: bf16/f16 stochastically when asked, else as a store does; rg
** (NULL: none) numbers the elements for the rounding. */
__device__ __forceinline__ void store_param(const msk_member &m, const rounding &r, const msk_rng *rg, int64_t e,
                                            int cnt, bool vec, const float *x)
{
    if (!r.stochastic || (m.xdt != MS_DTYPE_BF16 && m.xdt != MS_DTYPE_F16)) {
        store_dense<GROUP>(m.x, m.xdt, e, cnt, vec, x);
        return;
    }
    const bool bf16 = m.xdt == MS_DTYPE_BF16;
    msk_pack<uint16_t, GROUP> h;
#pragma unroll
    for (int j = 0; j < GROUP; j++) {
        const uint64_t el = rg == nullptr ? (uint64_t)(e + j) : msk_rng_number(*rg, e + j);
        uint32_t w[4];
        msk_philox((uint32_t)el, (uint32_t)(el >> 32), r.step, (uint32_t)m.index, r.k0, r.k1, w);
        h.v[j] = bf16 ? sr_bf16(x[j], w[0] >> 8) : sr_f16(x[j], w[0] >> 8);
    }
    uint16_t *p = (uint16_t *)m.x + e;
    if (vec) {
        *reinterpret_cast<msk_pack<uint16_t, GROUP> *>(p) = h;
    } else {
#pragma unroll
        for (int j = 0; j < GROUP; j++)
            if (j < cnt) p[j] = h.v[j];
    }
}

/* f64 results: only f64 params take the f64 path */
__device__ __forceinline__ void store_param(const msk_member &m, const rounding &, const msk_rng *, int64_t e,
                                            int cnt, bool vec, const double *x)
{
    store_dense<GROUP / 2>(m.x, MS_DTYPE_F64, e, cnt, vec, x);
}

/* --- AdamW -----------------------------------------------------------------------------------------------
** Per element in C = f32 (f64 for f64 params), scalars computed once in f64 and rounded to C:
**   m' = b1 * m + (1 - b1) * g        v' = b2 * v + ((1 - b2) * g) * g
**   p' = p * (1 - lr_i * wd) - (lr_i / bc1) * (m' / (sqrt(v') / sqrt(bc2) + eps)) */

template <class C>
__device__ __forceinline__ void adamw_run(const msk_adamw &o, const msk_member &m, const rounding &r,
                                          const msk_rng *rg, int64_t e, int cnt, double decay, double step_size,
                                          double bc2_sqrt)
{
    constexpr int NE = run_of<C>::n;
    const bool vec = (m.vec & MSK_VEC_X) && cnt == NE;
    C g[NE], p[NE], a[NE], v[NE];
    load_grad<NE>(m, e, cnt, g);
    load_dense<NE>(m.x, m.xdt, e, cnt, vec, p);
    load_dense<NE>(m.s0, o.state_dtype, e, cnt, vec, a);
    load_dense<NE>(m.s1, o.state_dtype, e, cnt, vec, v);
    const C b1 = (C)o.beta1, omb1 = (C)o.omb1, b2 = (C)o.beta2, omb2 = (C)o.omb2, eps = (C)o.eps;
    const C dec = (C)decay, ss = (C)step_size, bc2s = (C)bc2_sqrt;
#pragma unroll
    for (int j = 0; j < NE; j++) {
        const C mj = msk_add(msk_mul(b1, a[j]), msk_mul(omb1, g[j]));
        const C vj = msk_add(msk_mul(b2, v[j]), msk_mul(msk_mul(omb2, g[j]), g[j]));
        a[j] = mj;
        v[j] = vj;
        p[j] = msk_sub(msk_mul(p[j], dec), msk_mul(ss, msk_div(mj, msk_add(msk_div(msk_sqrt(vj), bc2s), eps))));
    }
    store_dense<NE>(m.s0, o.state_dtype, e, cnt, vec, a);
    store_dense<NE>(m.s1, o.state_dtype, e, cnt, vec, v);
    store_param(m, r, rg, e, cnt, vec, p);
}

/* the element numbers of member m of table A (NULL without them) */
template <int CAP, bool RNG, class Args>
__device__ __forceinline__ const msk_rng *rng_of(const Args &A, const msk_member &m)
{
    if constexpr (RNG) return &A.g.r[&m - A.t.m];
    else return nullptr;
}

template <int CAP, bool RNG>
__global__ void __launch_bounds__(MSK_THREADS) adamw_kernel(const __grid_constant__ adamw_args<CAP, RNG> A)
{
    const msk_adamw &o = A.o;
    if (o.skip.ptr && msk_scalar_value(o.skip) != 0) return;   /* NaN skips too, as on the CPU */
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
    const rounding r = { o.stochastic != 0, (uint32_t)o.seed, (uint32_t)(o.seed >> 32), step_word(step) };
    for_tiles(A.t, [&](const msk_member &m, int64_t e, int cnt) {
        const double lr_i = __dmul_rn(lr, m.scale);
        const double decay = __dsub_rn(1.0, __dmul_rn(lr_i, o.weight_decay)), step_size = __ddiv_rn(lr_i, bc1);
        const msk_rng *rg = rng_of<CAP, RNG>(A, m);
        if (m.xdt == MS_DTYPE_F64)
            in_runs<double>(e, cnt, [&](int64_t e1, int c1) {
                adamw_run<double>(o, m, r, rg, e1, c1, decay, step_size, bc2_sqrt);
            });
        else
            adamw_run<float>(o, m, r, rg, e, cnt, decay, step_size, bc2_sqrt);
    });
}

/* --- SGD ---------------------------------------------------------------------------------------------------
** As torch.optim.SGD, per element in C as for AdamW:
**   d = g + wd * p (d = g when wd == 0, so an infinite p stays out of it)
**   with momentum: buf' = d on the first step (step <= 1), else momentum * buf + (1 - dampening) * d;
**                  d = d + momentum * buf' (nesterov) or buf'
**   p' = p - lr_i * d */

template <class C>
__device__ __forceinline__ void sgd_run(const msk_sgd &o, const msk_member &m, const rounding &r, const msk_rng *rg,
                                        int64_t e, int cnt, double lr_i, bool first)
{
    constexpr int NE = run_of<C>::n;
    const bool vec = (m.vec & MSK_VEC_X) && cnt == NE;
    C g[NE], p[NE], b[NE];
    load_grad<NE>(m, e, cnt, g);
    load_dense<NE>(m.x, m.xdt, e, cnt, vec, p);
    if (o.has_buf) load_dense<NE>(m.s0, o.state_dtype, e, cnt, vec, b);
    const C wd = (C)o.weight_decay, mom = (C)o.momentum, omd = (C)o.omd, lr = (C)lr_i;
#pragma unroll
    for (int j = 0; j < NE; j++) {
        C d = g[j];
        if (o.weight_decay != 0) d = msk_add(d, msk_mul(wd, p[j]));
        if (o.has_buf) {
            const C bj = first ? d : msk_add(msk_mul(mom, b[j]), msk_mul(omd, d));
            b[j] = bj;
            d = o.nesterov ? msk_add(d, msk_mul(mom, bj)) : bj;
        }
        p[j] = msk_sub(p[j], msk_mul(lr, d));
    }
    if (o.has_buf) store_dense<NE>(m.s0, o.state_dtype, e, cnt, vec, b);
    store_param(m, r, rg, e, cnt, vec, p);
}

template <int CAP, bool RNG>
__global__ void __launch_bounds__(MSK_THREADS) sgd_kernel(const __grid_constant__ sgd_args<CAP, RNG> A)
{
    const msk_sgd &o = A.o;
    if (o.skip.ptr && msk_scalar_value(o.skip) != 0) return;
    const double lr = msk_scalar_value(o.lr), step = rint(msk_scalar_value(o.step));
    const bool first = step <= 1;
    const rounding r = { o.stochastic != 0, (uint32_t)o.seed, (uint32_t)(o.seed >> 32), step_word(step) };
    for_tiles(A.t, [&](const msk_member &m, int64_t e, int cnt) {
        const double lr_i = __dmul_rn(lr, m.scale);
        const msk_rng *rg = rng_of<CAP, RNG>(A, m);
        if (m.xdt == MS_DTYPE_F64)
            in_runs<double>(e, cnt, [&](int64_t e1, int c1) { sgd_run<double>(o, m, r, rg, e1, c1, lr_i, first); });
        else
            sgd_run<float>(o, m, r, rg, e, cnt, lr_i, first);
    });
}

/* --- scale: x <- x * v in place (f32 arithmetic, f64 for f64 members) -------------------------------------- */

template <class C>
__device__ __forceinline__ void scale_run(const msk_member &m, int64_t e, int cnt, C v)
{
    constexpr int NE = run_of<C>::n;
    const bool vec = (m.vec & MSK_VEC_X) && cnt == NE;
    C x[NE];
    if (m.dense) load_dense<NE>(m.x, m.xdt, e, cnt, vec, x);
    else load_strided<NE>(m.x, m.xdt, m, e, cnt, x);
#pragma unroll
    for (int j = 0; j < NE; j++) x[j] = msk_mul(x[j], v);
    if (m.dense) store_dense<NE>(m.x, m.xdt, e, cnt, vec, x);
    else store_strided<NE>(m.x, m.xdt, m, e, cnt, x);
}

template <int CAP>
__global__ void __launch_bounds__(MSK_THREADS) scale_kernel(const __grid_constant__ scale_args<CAP> A)
{
    const double v = msk_scalar_value(A.v);
    for_tiles(A.t, [&](const msk_member &m, int64_t e, int cnt) {
        if (m.xdt == MS_DTYPE_F64) in_runs<double>(e, cnt, [&](int64_t e1, int c1) { scale_run<double>(m, e1, c1, v); });
        else scale_run<float>(m, e, cnt, (float)v);
    });
}

/* --- sum of squares -------------------------------------------------------------------------------------
** The CPU's order exactly: chunk c of a member is elements [4096 c, 4096 c + 4096); its lane l sums the squares
** of the chunk's elements l, l + 8, l + 16, ... one after the other (8 threads per chunk, 32 chunks per block
** iteration); the lanes fold as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), which the butterfly over
** xor 1, 2, 4 reproduces (IEEE addition commutes); chunk partials are added in chunk order, in f32 (f64 for f64
** sources).  Partials go to global scratch; the block that finishes a member's last tile (an atomicInc ticket
** that wraps back to 0, leaving the counter ready for the next call) adds them. */

template <class T, class A>
__device__ __forceinline__ A lane_dense(const T *x, int64_t cnt, int lane)
{
    A acc = 0;
    int64_t j = lane;
    for (; j + 7 * SUMSQ_LANES < cnt; j += GROUP * SUMSQ_LANES) {   /* eight loads in flight, then the adds in order */
        A v[GROUP];
#pragma unroll
        for (int u = 0; u < GROUP; u++) v[u] = (A)msk_f(x[j + u * SUMSQ_LANES]);
#pragma unroll
        for (int u = 0; u < GROUP; u++) acc = msk_add(acc, msk_mul(v[u], v[u]));
    }
    for (; j < cnt; j += SUMSQ_LANES) {
        const A v = (A)msk_f(x[j]);
        acc = msk_add(acc, msk_mul(v, v));
    }
    return acc;
}

/* Lane `lane` of the chunk [e0, e0 + cnt) of member m (any layout). */
template <class A>
__device__ __forceinline__ A lane_sum(const msk_member &m, int64_t e0, int64_t cnt, int lane)
{
    if (m.dense) {
        switch (m.xdt) {
        case MS_DTYPE_F32:  return lane_dense<float, A>((const float *)m.x + e0, cnt, lane);
        case MS_DTYPE_F64:  return lane_dense<double, A>((const double *)m.x + e0, cnt, lane);
        case MS_DTYPE_BF16: return lane_dense<__nv_bfloat16, A>((const __nv_bfloat16 *)m.x + e0, cnt, lane);
        case MS_DTYPE_F16:  return lane_dense<__half, A>((const __half *)m.x + e0, cnt, lane);
        default:            return 0;
        }
    }
    A acc = 0;
    int64_t e = e0 + lane, r = e / m.cols, c = e - r * m.cols;
    for (int64_t j = lane; j < cnt; j += SUMSQ_LANES) {
        const A v = msk_load<A>(m.x, r * m.rs + c * m.cs, m.xdt);
        acc = msk_add(acc, msk_mul(v, v));
        for (c += SUMSQ_LANES; c >= m.cols; c -= m.cols) r++;
    }
    return acc;
}

template <class A> __device__ __forceinline__ A lanes_fold(A v)
{
    v = msk_add(v, __shfl_xor_sync(0xffffffffu, v, 1));
    v = msk_add(v, __shfl_xor_sync(0xffffffffu, v, 2));
    return msk_add(v, __shfl_xor_sync(0xffffffffu, v, 4));
}

/* The chunk partials [p, p + n) added in order, in A. */
template <class A>
__device__ __forceinline__ A ordered_sum(const double *p, int64_t n)
{
    if (n == 0) return 0;
    A acc = (A)__ldcg(p);
    int64_t c = 1;
    for (; c + GROUP <= n; c += GROUP) {   /* loads in flight ahead of the dependent adds */
        A v[GROUP];
#pragma unroll
        for (int u = 0; u < GROUP; u++) v[u] = (A)__ldcg(p + c + u);
#pragma unroll
        for (int u = 0; u < GROUP; u++) acc = msk_add(acc, v[u]);
    }
    for (; c < n; c++) acc = msk_add(acc, (A)__ldcg(p + c));
    return acc;
}

template <int CAP>
__global__ void __launch_bounds__(MSK_THREADS) sumsq_kernel(const __grid_constant__ sumsq_args<CAP> A)
{
    const int lane = threadIdx.x % SUMSQ_LANES, k = threadIdx.x / SUMSQ_LANES;
    int i = 0;
    for (int64_t t = blockIdx.x; t < A.t.ntiles; t += gridDim.x) {
        i = member_of(A.t, i, t);
        const msk_member &m = A.t.m[i];
        const bool wide = m.xdt == MS_DTYPE_F64;
        const int64_t nchunk = (m.numel + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
        const int64_t ntile = nchunk > SUMSQ_TILE ? (nchunk + SUMSQ_TILE - 1) / SUMSQ_TILE : 1;
        const int64_t c = (t - A.t.tile0[i]) * SUMSQ_TILE + k;
        const int64_t e0 = c * SUMSQ_CHUNK;
        const int64_t cnt = c < nchunk ? (m.numel - e0 < SUMSQ_CHUNK ? m.numel - e0 : SUMSQ_CHUNK) : 0;
        double part;   /* an f32 partial is exact in f64 */
        if (wide) part = lanes_fold(lane_sum<double>(m, e0, cnt, lane));
        else part = (double)lanes_fold(lane_sum<float>(m, e0, cnt, lane));
        if (lane == 0 && c < nchunk) {
            A.partials[A.part0[i] + c] = part;
            __threadfence();   /* the partial is visible device-wide before this block's ticket is taken */
        }
        __syncthreads();   /* every partial of this tile is written before its ticket */
        if (threadIdx.x == 0) {
            const bool last = ntile == 1 || atomicInc(&A.tickets[i], (unsigned)(ntile - 1)) == (unsigned)(ntile - 1);
            if (last) {
                __threadfence();
                const double *p = A.partials + A.part0[i];
                const double s = wide ? ordered_sum<double>(p, nchunk) : (double)ordered_sum<float>(p, nchunk);
                msk_store<double>(A.dst, m.index, A.dst_dtype, s);
            }
        }
    }
}

/* --- launchers ------------------------------------------------------------------------------------------- */

static int64_t step_tiles(const msk_member &m) { return (m.numel + TILE - 1) / TILE; }

static int64_t sumsq_chunks(const msk_member &m) { return (m.numel + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK; }

/* Every member has one tile at least, so a member of 0 elements still gets its dst element written (0). */
static int64_t sumsq_tiles(const msk_member &m)
{
    const int64_t n = sumsq_chunks(m);
    return n > SUMSQ_TILE ? (n + SUMSQ_TILE - 1) / SUMSQ_TILE : 1;
}

/* Fills tb with members [0, n) of m (n <= CAP) and their first tiles. */
template <int CAP>
static void fill_table(table<CAP> &tb, int n, const msk_member *m, int64_t (*tiles)(const msk_member &))
{
    tb.n = n;
    int64_t t = 0;
    for (int k = 0; k < n; k++) {
        tb.m[k] = m[k];
        tb.tile0[k] = t;
        t += tiles(m[k]);
    }
    tb.ntiles = t;
}

/* One launch of kernel `K` over members [0, n): the arguments (up to ~32 KB) are built on the heap, since the
** calling thread's stack may be small; the launch copies them, so they are freed right after. */
template <class Args, class Setup>
static ms_status launch_one(ms_ctx *ctx, cudaStream_t s, void (*K)(const Args), int first, int n, const msk_member *m,
                            int64_t (*tiles)(const msk_member &), Setup setup, const char *what)
{
    Args *a = new (std::nothrow) Args;
    if (a == NULL)
        return ms_error_at(ctx, MS_E_OOM, __FILE__, __LINE__, "cuda %s: no host memory for the launch table", what);
    fill_table(a->t, n, m + first, tiles);
    setup(*a, first);
    if (a->t.ntiles > 0) K<<<msk_blocks(a->t.ntiles * MSK_THREADS), MSK_THREADS, 0, s>>>(*a);
    delete a;
    MSK_CHECK_LAUNCH(ctx, what);
    return MS_OK;
}

/* Members [0, n) in launches of at most BIG (the small table when they fit it); setup(args, first) fills the
** rest of a launch's arguments for its members [first, first + args.t.n). */
template <int BIG, template <int> class Args, class Setup>
static ms_status launch_all(ms_ctx *ctx, cudaStream_t s, void (*Ksmall)(const Args<SMALL_CAP>),
                            void (*Kbig)(const Args<BIG>), int n, const msk_member *m,
                            int64_t (*tiles)(const msk_member &), Setup setup, const char *what, int *launches)
{
    *launches = 0;
    for (int first = 0; first < n; first += BIG) {
        const int cnt = n - first < BIG ? n - first : BIG;
        ms_status st = cnt <= SMALL_CAP
            ? launch_one(ctx, s, Ksmall, first, cnt, m, tiles, setup, what)
            : launch_one(ctx, s, Kbig, first, cnt, m, tiles, setup, what);
        if (st != MS_OK) return st;
        ++*launches;
    }
    return MS_OK;
}

/* a step's launches: the plain tables, or with rng those that carry the element numbers */
template <template <int> class Plain, template <int> class WithRng, class Opts>
static ms_status step_launches(ms_ctx *ctx, cudaStream_t s, void (*Ksmall)(const Plain<SMALL_CAP>),
                               void (*Kbig)(const Plain<MSK_OPTIM_CAP>), void (*Rsmall)(const WithRng<SMALL_CAP>),
                               void (*Rbig)(const WithRng<MSK_OPTIM_RNG_CAP>), const Opts &opts, int n,
                               const msk_member *m, const msk_rng *rng, const char *what, int *launches)
{
    if (rng == NULL)
        return launch_all<MSK_OPTIM_CAP, Plain>(ctx, s, Ksmall, Kbig, n, m, step_tiles,
                                                [&](auto &a, int) { a.o = opts; }, what, launches);
    return launch_all<MSK_OPTIM_RNG_CAP, WithRng>(ctx, s, Rsmall, Rbig, n, m, step_tiles,
                                                  [&](auto &a, int first) {
                                                      a.o = opts;
                                                      for (int k = 0; k < a.t.n; k++) a.g.r[k] = rng[first + k];
                                                  },
                                                  what, launches);
}

extern "C" ms_status msk_adamw_run(ms_ctx *ctx, cudaStream_t s, const msk_adamw *o, int n, const msk_member *m,
                                   const msk_rng *rng, int *launches)
{
    return step_launches<adamw_plain_args, adamw_rng_args>(ctx, s, adamw_kernel<SMALL_CAP, false>,
                                                     adamw_kernel<MSK_OPTIM_CAP, false>, adamw_kernel<SMALL_CAP, true>,
                                                     adamw_kernel<MSK_OPTIM_RNG_CAP, true>, *o, n, m, rng, "adamw step",
                                                     launches);
}

extern "C" ms_status msk_sgd_run(ms_ctx *ctx, cudaStream_t s, const msk_sgd *o, int n, const msk_member *m,
                                 const msk_rng *rng, int *launches)
{
    return step_launches<sgd_plain_args, sgd_rng_args>(ctx, s, sgd_kernel<SMALL_CAP, false>, sgd_kernel<MSK_OPTIM_CAP, false>,
                                                 sgd_kernel<SMALL_CAP, true>, sgd_kernel<MSK_OPTIM_RNG_CAP, true>, *o, n,
                                                 m, rng, "sgd step", launches);
}

extern "C" ms_status msk_scale_run(ms_ctx *ctx, cudaStream_t s, msk_scalar v, int n, const msk_member *m,
                                   int *launches)
{
    return launch_all<MSK_OPTIM_CAP, scale_args>(ctx, s, scale_kernel<SMALL_CAP>, scale_kernel<MSK_OPTIM_CAP>, n, m,
                                                 step_tiles, [&](auto &a, int) { a.v = v; }, "foreach scale", launches);
}

extern "C" size_t msk_sumsq_scratch(int n, const msk_member *m)
{
    int64_t chunks = 0;
    for (int k = 0; k < n; k++) chunks += sumsq_chunks(m[k]);
    return (size_t)chunks * sizeof(double);
}

extern "C" ms_status msk_sumsq_run(ms_ctx *ctx, cudaStream_t s, void *dst, int dst_dtype, int n, const msk_member *m,
                                   double *partials, unsigned *tickets, int *launches)
{
    int64_t base = 0;   /* the partials of launch after launch follow each other in `partials` */
    return launch_all<MSK_OPTIM_CAP, sumsq_args>(ctx, s, sumsq_kernel<SMALL_CAP>, sumsq_kernel<MSK_OPTIM_CAP>, n, m,
                                  sumsq_tiles, [&](auto &a, int) {
                                      a.dst = dst;
                                      a.dst_dtype = dst_dtype;
                                      a.partials = partials;
                                      a.tickets = tickets;
                                      for (int k = 0; k < a.t.n; k++) {
                                          a.part0[k] = base;
                                          base += sumsq_chunks(a.t.m[k]);
                                      }
                                  },
                                  "foreach sumsq", launches);
}

/*
** Fused elementwise kernels: copy/cast, fill, unary, binary, binary-with-scalar, clamp, lerp, addcmul and
** addcdiv, with the CPU backend's semantics (engine/cpu/elementwise.c is the reference: same formulas, same
** evaluation order, same rounding of bf16/f16 results, device scalars read when the kernel runs).
** Two shapes of launch: dense (every operand the same float dtype, contiguous: 16-byte vector loads and
** stores, a grid-stride loop) and strided (any dtypes, any strides, broadcast: per-element index walk).
*/
#include "common.cuh"

/* --- the op families, as functors over the compute type C (float, or double when wide) ------------ */

__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_sin(float x) { return sinf(x); }
__device__ __forceinline__ double m_sin(double x) { return sin(x); }
__device__ __forceinline__ float m_cos(float x) { return cosf(x); }
__device__ __forceinline__ double m_cos(double x) { return cos(x); }
__device__ __forceinline__ float m_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double m_pow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ float m_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_abs(double x) { return fabs(x); }

/* sign keeps zeros (with their sign) and NaN; relu keeps NaN; sigmoid never overflows exp. */
template <class C>
__device__ __forceinline__ C unary_apply(int op, C x)
{
    switch (op) {
    case MS_UNARY_NEG:        return -x;
    case MS_UNARY_ABS:        return m_abs(x);
    case MS_UNARY_SQRT:       return m_sqrt(x);
    case MS_UNARY_RSQRT:      return (C)1 / m_sqrt(x);
    case MS_UNARY_EXP:        return m_exp(x);
    case MS_UNARY_LOG:        return m_log(x);
    case MS_UNARY_SIGN:       return x > 0 ? (C)1 : x < 0 ? (C)-1 : x;
    case MS_UNARY_SQUARE:     return msk_mul(x, x);
    case MS_UNARY_RECIPROCAL: return (C)1 / x;
    case MS_UNARY_TANH:       return m_tanh(x);
    case MS_UNARY_SIGMOID: {
        C e = m_exp(-m_abs(x));
        return x >= 0 ? (C)1 / msk_add((C)1, e) : e / msk_add((C)1, e);
    }
    case MS_UNARY_RELU:       return x > 0 || x != x ? x : (C)0;
    case MS_UNARY_SIN:        return m_sin(x);
    case MS_UNARY_COS:        return m_cos(x);
    default:                  return x;
    }
}

/* maximum/minimum: NaN in either operand gives NaN (x + y is that NaN); comparisons give 1 or 0. */
template <class C>
__device__ __forceinline__ C binary_apply(int op, C x, C y)
{
    switch (op) {
    case MS_BINARY_ADD:     return msk_add(x, y);
    case MS_BINARY_SUB:     return msk_sub(x, y);
    case MS_BINARY_MUL:     return msk_mul(x, y);
    case MS_BINARY_DIV:     return x / y;
    case MS_BINARY_POW:     return m_pow(x, y);
    case MS_BINARY_MAXIMUM: return x != x || y != y ? x + y : x > y ? x : y;
    case MS_BINARY_MINIMUM: return x != x || y != y ? x + y : x < y ? x : y;
    case MS_BINARY_EQ:      return (C)(x == y);
    case MS_BINARY_NE:      return (C)(x != y);
    case MS_BINARY_LT:      return (C)(x < y);
    case MS_BINARY_LE:      return (C)(x <= y);
    case MS_BINARY_GT:      return (C)(x > y);
    case MS_BINARY_GE:      return (C)(x >= y);
    default:                return x;
    }
}

struct f_copy {
    static constexpr int NSRC = 1;
    __device__ void prepare() {}
    template <class C> __device__ C operator()(const C *x) const { return x[0]; }
};

struct f_fill {
    static constexpr int NSRC = 0;
    msk_scalar v;
    double val;
    __device__ void prepare() { val = msk_scalar_value(v); }
    template <class C> __device__ C operator()(const C *) const { return (C)val; }
};

struct f_unary {
    static constexpr int NSRC = 1;
    int op;
    __device__ void prepare() {}
    template <class C> __device__ C operator()(const C *x) const { return unary_apply(op, x[0]); }
};

struct f_binary {
    static constexpr int NSRC = 2;
    int op;
    __device__ void prepare() {}
    template <class C> __device__ C operator()(const C *x) const { return binary_apply(op, x[0], x[1]); }
};

struct f_binary_scalar {
    static constexpr int NSRC = 1;
    int op, first;
    msk_scalar v;
    double val;
    __device__ void prepare() { val = msk_scalar_value(v); }
    template <class C> __device__ C operator()(const C *x) const
    {
        const C c = (C)val;
        return first ? binary_apply(op, c, x[0]) : binary_apply(op, x[0], c);
    }
};

/* lo first, then hi: lo > hi gives hi everywhere (as min(max(x, lo), hi)); NaN fails both tests. */
struct f_clamp {
    static constexpr int NSRC = 1;
    double lo, hi;
    __device__ void prepare() {}
    template <class C> __device__ C operator()(const C *x) const
    {
        const C l = (C)lo, h = (C)hi;
        return x[0] < l ? (l > h ? h : l) : x[0] > h ? h : x[0];
    }
};

struct f_lerp {
    static constexpr int NSRC = 2;
    msk_scalar w;
    double val;
    __device__ void prepare() { val = msk_scalar_value(w); }
    template <class C> __device__ C operator()(const C *x) const
    {
        return msk_add(x[0], msk_mul((C)val, msk_sub(x[1], x[0])));
    }
};

/* a + v * b * c  or  a + v * b / c, evaluated left to right as the CPU does */
struct f_addc {
    static constexpr int NSRC = 3;
    msk_scalar v;
    double val;
    int divide;
    __device__ void prepare() { val = msk_scalar_value(v); }
    template <class C> __device__ C operator()(const C *x) const
    {
        const C vb = msk_mul((C)val, x[1]);
        return msk_add(x[0], divide ? vb / x[2] : msk_mul(vb, x[2]));
    }
};

/* --- kernels -------------------------------------------------------------------------------------- */

/* Every operand of storage type T, dense: element i of each.  vec: every pointer is 16-byte aligned, so
** groups of 16 / sizeof(T) elements move as single 16-byte accesses; the tail goes element by element. */
template <class T, class C, class F>
__global__ void __launch_bounds__(MSK_THREADS)
ew_dense(F f, int64_t n, T *d, const T *s0, const T *s1, const T *s2, int vec)
{
    constexpr int V = 16 / sizeof(T);
    constexpr int NS = F::NSRC > 0 ? F::NSRC : 1;
    typedef msk_pack<T, V> pack;
    f.prepare();
    const T *src[3] = { s0, s1, s2 };
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
    int64_t done = 0;
    if (vec) {
        /* two groups per operand in flight: groups i and i + nth */
        const int64_t nv = n / V;
        for (int64_t i = tid; i < nv; i += 2 * nth) {
            const bool second = i + nth < nv;
            pack in[2][NS], out[2];
#pragma unroll
            for (int k = 0; k < F::NSRC; k++) {
                in[0][k] = reinterpret_cast<const pack *>(src[k])[i];
                if (second) in[1][k] = reinterpret_cast<const pack *>(src[k])[i + nth];
            }
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < V; e++) {
                    if (h == 1 && !second) break;
                    C x[NS];
#pragma unroll
                    for (int k = 0; k < F::NSRC; k++) x[k] = (C)msk_f(in[h][k].v[e]);
                    out[h].v[e] = msk_store_of<T>::cvt(f(x));
                }
            reinterpret_cast<pack *>(d)[i] = out[0];
            if (second) reinterpret_cast<pack *>(d)[i + nth] = out[1];
        }
        done = nv * V;
    }
    for (int64_t i = done + tid; i < n; i += nth) {
        C x[NS];
#pragma unroll
        for (int k = 0; k < F::NSRC; k++) x[k] = (C)msk_f(src[k][i]);
        d[i] = msk_store_of<T>::cvt(f(x));
    }
}

/* Any dtypes and strides: element i of dst's row-major order, its offset in every operand found by
** walking the dims from the last (the outermost dim needs no division: what is left is its index). */
template <class C, class F>
__global__ void __launch_bounds__(MSK_THREADS)
ew_strided(F f, msk_iter it)
{
    constexpr int NS = F::NSRC > 0 ? F::NSRC : 1;
    f.prepare();
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = tid; i < it.numel; i += nth) {
        int64_t off[F::NSRC + 1];
#pragma unroll
        for (int k = 0; k <= F::NSRC; k++) off[k] = 0;
        int64_t r = i;
#pragma unroll
        for (int d = MSK_MAX_DIMS - 1; d >= 0; d--) {
            if (d >= it.ndim) continue;
            int64_t idx;
            if (d == 0) {
                idx = r;
            } else {
                const int64_t sz = it.shape[d];
                int64_t q;
                if (((uint64_t)r | (uint64_t)sz) <= 0xffffffffu) q = (int64_t)((uint32_t)r / (uint32_t)sz);
                else q = r / sz;
                idx = r - q * sz;
                r = q;
            }
#pragma unroll
            for (int k = 0; k <= F::NSRC; k++) off[k] += idx * it.strides[k][d];
        }
        C x[NS];
#pragma unroll
        for (int k = 0; k < F::NSRC; k++) x[k] = msk_load<C>(it.data[k + 1], off[k + 1], it.dtype[k + 1]);
        msk_store<C>(it.data[0], off[0], it.dtype[0], f(x));
    }
}

/* --- launchers ------------------------------------------------------------------------------------ */

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

template <class T, class C, class F>
static void launch_dense(F f, const msk_iter *it, cudaStream_t s)
{
    constexpr int V = 16 / sizeof(T);
    bool vec = true;
    for (int k = 0; k < it->nops; k++) vec = vec && aligned16(it->data[k]);
    const int64_t work = vec ? (it->numel / V + 1) / 2 + it->numel % V : it->numel;
    const T *src[3] = { NULL, NULL, NULL };
    for (int k = 1; k < it->nops && k <= 3; k++) src[k - 1] = (const T *)it->data[k];
    ew_dense<T, C, F><<<msk_blocks_all(work), MSK_THREADS, 0, s>>>(f, it->numel, (T *)it->data[0], src[0], src[1],
                                                                   src[2], vec ? 1 : 0);
}

/* The one dispatcher: dense when every operand has dst's float dtype and the iteration is contiguous,
** strided otherwise (computing in f64 when the iteration is wide). */
template <class F>
static ms_status ew_launch(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, F f, const char *what)
{
    if (it->numel == 0) return MS_OK;
    if (it->nops != F::NSRC + 1)
        return ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda %s: %d operands for a %d-source op", what,
                           it->nops, F::NSRC);
    const int dt = it->dtype[0];
    bool same = true;
    for (int k = 1; k < it->nops; k++) same = same && it->dtype[k] == dt;
    if (same && (it->contiguous || it->ndim == 0)) {
        switch (dt) {
        case MS_DTYPE_F32:  launch_dense<float, float>(f, it, s); MSK_CHECK_LAUNCH(ctx, what); return MS_OK;
        case MS_DTYPE_F64:  launch_dense<double, double>(f, it, s); MSK_CHECK_LAUNCH(ctx, what); return MS_OK;
        case MS_DTYPE_BF16: launch_dense<__nv_bfloat16, float>(f, it, s); MSK_CHECK_LAUNCH(ctx, what); return MS_OK;
        case MS_DTYPE_F16:  launch_dense<__half, float>(f, it, s); MSK_CHECK_LAUNCH(ctx, what); return MS_OK;
        default: break;   /* integer dtypes: the strided path converts them */
        }
    }
    if (it->wide) ew_strided<double, F><<<msk_blocks(it->numel), MSK_THREADS, 0, s>>>(f, *it);
    else ew_strided<float, F><<<msk_blocks(it->numel), MSK_THREADS, 0, s>>>(f, *it);
    MSK_CHECK_LAUNCH(ctx, what);
    return MS_OK;
}

/* --- entries: the contract is ms_nary's (shapes, devices and overlap checked by the core) ---------- */

/* dst <- src converted (any dtype pair; same-dtype dense copies are cudaMemcpyAsync in the glue). */
extern "C" ms_status msk_copy(ms_ctx *ctx, cudaStream_t s, const msk_iter *it)
{
    return ew_launch(ctx, s, it, f_copy{}, "copy");
}

extern "C" ms_status msk_fill(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, msk_scalar v)
{
    f_fill f = { v, 0.0 };
    return ew_launch(ctx, s, it, f, "fill");
}

extern "C" ms_status msk_unary(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, int op)
{
    f_unary f = { op };
    return ew_launch(ctx, s, it, f, "unary");
}

extern "C" ms_status msk_binary(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, int op)
{
    f_binary f = { op };
    return ew_launch(ctx, s, it, f, "binary");
}

extern "C" ms_status msk_binary_scalar(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, msk_scalar v, int op,
                                       int first)
{
    f_binary_scalar f = { op, first, v, 0.0 };
    return ew_launch(ctx, s, it, f, "binary_scalar");
}

extern "C" ms_status msk_clamp(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, double lo, double hi)
{
    f_clamp f = { lo, hi };
    return ew_launch(ctx, s, it, f, "clamp");
}

extern "C" ms_status msk_lerp(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, msk_scalar w)
{
    f_lerp f = { w, 0.0 };
    return ew_launch(ctx, s, it, f, "lerp");
}

extern "C" ms_status msk_addc(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, msk_scalar v, int divide)
{
    f_addc f = { v, 0.0, divide };
    return ew_launch(ctx, s, it, f, "addc");
}

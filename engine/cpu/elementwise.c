/*
** CPU elementwise ops (copy, fill, unary, binary, clamp, lerp, addcmul/addcdiv) over an ms_nary, and the
** strided dtype-converting loads and stores every CPU op uses.  Dense all-f32 (all-f64) operands run the
** kernels on the tensors' memory; anything else goes through blocks converted to f32 (f64) and back.
*/
#include "cpu.h"

#include <omp.h>
#include <string.h>
#include <tgmath.h>   /* exp, sqrt, pow ... pick the float or double version from the argument's type */

#define BLOCK 1024          /* elements per converted block in the strided path (stack buffers) */
#define DENSE_BLOCK 16384   /* elements per task in the dense path */

/* --- views, loads and stores ------------------------------------------------------------------- */

static void view_normalise(ms_cpu_view *v)
{
    if (v->ndim == 0) {   /* one element: a 1-dim view of size 1 spares every walker a special case */
        v->ndim = 1;
        v->shape[0] = 1;
        v->strides[0] = 0;
    }
}

void ms_cpu_view_of(ms_cpu_view *v, const ms_tensor *t)
{
    v->ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++) {
        v->shape[d] = t->shape[d];
        v->strides[d] = t->strides[d];
    }
    v->dtype = t->dtype;
    v->base = ms_tensor_ptr(t);
    view_normalise(v);
}

void ms_cpu_view_of_nary(ms_cpu_view *v, const ms_nary *it, int k)
{
    v->ndim = it->ndim;
    for (int d = 0; d < it->ndim; d++) {
        v->shape[d] = it->shape[d];
        v->strides[d] = it->strides[k][d];
    }
    v->dtype = it->dtype[k];
    v->base = it->data[k];
    view_normalise(v);
}

int64_t ms_cpu_view_numel(const ms_cpu_view *v)
{
    int64_t n = 1;
    for (int d = 0; d < v->ndim; d++) n *= v->shape[d];
    return n;
}

/* Position of one logical element, advanced run by run along the last dim. */
typedef struct cursor {
    int64_t idx[MS_MAX_DIMS];
    int64_t off;   /* elements from base */
} cursor;

static void cursor_init(cursor *c, const ms_cpu_view *v, int64_t start)
{
    c->off = 0;
    for (int d = v->ndim - 1; d >= 0; d--) {
        c->idx[d] = v->shape[d] ? start % v->shape[d] : 0;
        start = v->shape[d] ? start / v->shape[d] : 0;
        c->off += c->idx[d] * v->strides[d];
    }
}

/* Elements left in the current last-dim run, at most `left`. */
static int64_t cursor_run(const cursor *c, const ms_cpu_view *v, int64_t left)
{
    int64_t rest = v->shape[v->ndim - 1] - c->idx[v->ndim - 1];
    return rest < left ? rest : left;
}

static void cursor_advance(cursor *c, const ms_cpu_view *v, int64_t run)
{
    int d = v->ndim - 1;
    c->idx[d] += run;
    c->off += run * v->strides[d];
    for (; d > 0 && c->idx[d] >= v->shape[d]; d--) {
        c->off += v->strides[d - 1] - c->idx[d] * v->strides[d];
        c->idx[d] = 0;
        c->idx[d - 1]++;
    }
}

static int32_t saturate_i32(double x)
{
    if (x != x) return 0;
    if (x >= 2147483647.0) return INT32_MAX;
    if (x <= -2147483648.0) return INT32_MIN;
    return (int32_t)x;   /* truncates toward zero */
}

static uint8_t saturate_u8(double x)
{
    if (x != x || x <= 0) return 0;
    if (x >= 255.0) return 255;
    return (uint8_t)x;
}

/* A loop over a run of n elements `st` apart: i indexes the buffer, j the memory.  Unit strides get a loop
** of their own, which the compiler can vectorise. */
#define RUN_LOOP(...)                                                                                  \
    do {                                                                                               \
        if (st == 1) for (int64_t i = 0; i < n; i++) { const int64_t j = i; __VA_ARGS__; }             \
        else for (int64_t i = 0; i < n; i++) { const int64_t j = i * st; __VA_ARGS__; }                \
    } while (0)

/* One run converted in or out.  Defined for T = float and double. */
#define DEFINE_RUN_IO(T, SUF)                                                                          \
    static void load_run_##SUF(T *out, ms_dtype dt, const char *p, int64_t st, int64_t n)              \
    {                                                                                                  \
        switch (dt) {                                                                                  \
        case MS_DTYPE_F32:  RUN_LOOP(out[i] = (T)((const float *)p)[j]); break;                        \
        case MS_DTYPE_F64:  RUN_LOOP(out[i] = (T)((const double *)p)[j]); break;                       \
        case MS_DTYPE_BF16: RUN_LOOP(out[i] = (T)ms_bf16_to_f32(((const uint16_t *)p)[j])); break;     \
        case MS_DTYPE_F16:  RUN_LOOP(out[i] = (T)ms_f16_to_f32(((const uint16_t *)p)[j])); break;      \
        case MS_DTYPE_I32:  RUN_LOOP(out[i] = (T)((const int32_t *)p)[j]); break;                      \
        case MS_DTYPE_U8:   RUN_LOOP(out[i] = (T)((const uint8_t *)p)[j]); break;                      \
        default: break;                                                                                \
        }                                                                                              \
    }                                                                                                  \
    static void store_run_##SUF(char *p, ms_dtype dt, int64_t st, int64_t n, const T *in)              \
    {                                                                                                  \
        switch (dt) {                                                                                  \
        case MS_DTYPE_F32:  RUN_LOOP(((float *)p)[j] = (float)in[i]); break;                           \
        case MS_DTYPE_F64:  RUN_LOOP(((double *)p)[j] = (double)in[i]); break;                         \
        case MS_DTYPE_BF16: RUN_LOOP(((uint16_t *)p)[j] = ms_f32_to_bf16((float)in[i])); break;        \
        case MS_DTYPE_F16:  RUN_LOOP(((uint16_t *)p)[j] = ms_f32_to_f16((float)in[i])); break;         \
        case MS_DTYPE_I32:  RUN_LOOP(((int32_t *)p)[j] = saturate_i32(in[i])); break;                  \
        case MS_DTYPE_U8:   RUN_LOOP(((uint8_t *)p)[j] = saturate_u8(in[i])); break;                   \
        default: break;                                                                                \
        }                                                                                              \
    }                                                                                                  \
    T *ms_cpu_span_##SUF(const ms_cpu_view *v, int64_t start, int64_t n)                              \
    {                                                                                                  \
        if (v->dtype != (sizeof(T) == 4 ? MS_DTYPE_F32 : MS_DTYPE_F64)) return NULL;                  \
        cursor c;                                                                                      \
        cursor_init(&c, v, start);                                                                     \
        int last = v->ndim - 1;                                                                        \
        if (n > 1 && (v->strides[last] != 1 || c.idx[last] + n > v->shape[last])) return NULL;        \
        return (T *)v->base + c.off;                                                                   \
    }                                                                                                  \
    const T *ms_cpu_load_##SUF(const ms_cpu_view *v, int64_t start, int64_t n, T *buf)                \
    {                                                                                                  \
        const T *direct = ms_cpu_span_##SUF(v, start, n);                                             \
        if (direct) return direct;                                                                     \
        size_t esz = ms_dtype_size(v->dtype);                                                          \
        cursor c;                                                                                      \
        cursor_init(&c, v, start);                                                                     \
        for (int64_t done = 0; done < n;) {                                                            \
            int64_t run = cursor_run(&c, v, n - done);                                                 \
            load_run_##SUF(buf + done, v->dtype, v->base + c.off * (int64_t)esz, v->strides[v->ndim - 1], run); \
            done += run;                                                                               \
            cursor_advance(&c, v, run);                                                                \
        }                                                                                              \
        return buf;                                                                                    \
    }                                                                                                  \
    void ms_cpu_store_##SUF(const ms_cpu_view *v, int64_t start, int64_t n, const T *src)             \
    {                                                                                                  \
        size_t esz = ms_dtype_size(v->dtype);                                                          \
        cursor c;                                                                                      \
        cursor_init(&c, v, start);                                                                     \
        for (int64_t done = 0; done < n;) {                                                            \
            int64_t run = cursor_run(&c, v, n - done);                                                 \
            store_run_##SUF(v->base + c.off * (int64_t)esz, v->dtype, v->strides[v->ndim - 1], run, src + done); \
            done += run;                                                                               \
            cursor_advance(&c, v, run);                                                                \
        }                                                                                              \
    }

DEFINE_RUN_IO(float, f32)
DEFINE_RUN_IO(double, f64)

double ms_cpu_read_scalar(const ms_scalar *s)
{
    if (!s->t) return s->v;
    double buf;
    ms_cpu_view view;
    ms_cpu_view_of(&view, s->t);
    return *ms_cpu_load_f64(&view, 0, 1, &buf);
}

int ms_cpu_threads(const ms_ctx *ctx)
{
    return ctx->num_threads > 0 ? ctx->num_threads : omp_get_max_threads();
}

static int threads_for(const ms_ctx *ctx, int64_t numel)
{
    return numel >= MS_CPU_PAR_MIN ? ms_cpu_threads(ctx) : 1;
}

void ms_cpu_copy_view(const ms_ctx *ctx, const ms_cpu_view *dst, const ms_cpu_view *src)
{
    int64_t numel = ms_cpu_view_numel(dst), nblk = (numel + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads_for(ctx, numel))
    for (int64_t b = 0; b < nblk; b++) {
        double buf[BLOCK];
        int64_t i0 = b * BLOCK, m = numel - i0 < BLOCK ? numel - i0 : BLOCK;
        ms_cpu_store_f64(dst, i0, m, ms_cpu_load_f64(src, i0, m, buf));
    }
}

void ms_cpu_fill_view(const ms_ctx *ctx, const ms_cpu_view *dst, double value)
{
    int64_t numel = ms_cpu_view_numel(dst), nblk = (numel + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(threads_for(ctx, numel))
    for (int64_t b = 0; b < nblk; b++) {
        double buf[BLOCK];
        int64_t i0 = b * BLOCK, m = numel - i0 < BLOCK ? numel - i0 : BLOCK;
        for (int64_t i = 0; i < m; i++) buf[i] = value;
        ms_cpu_store_f64(dst, i0, m, buf);
    }
}

/* --- kernels -------------------------------------------------------------------------------------
** A kernel computes n elements of d from sources s[0..] (all dense, of the compute type T); its
** arguments: op code, flag (scalar_first / divide) and scalars a, b.  Each family is written once as a
** body over T and instantiated for float and double. */

typedef struct kargs {
    int    op, flag;
    double a, b;
} kargs;

typedef void (*kernel_f32)(int64_t n, float *d, const float *const *s, const kargs *k);
typedef void (*kernel_f64)(int64_t n, double *d, const double *const *s, const kargs *k);

#define EACH(...)                                                                                      \
    do {                                                                                               \
        _Pragma("omp simd")                                                                            \
        for (int64_t i = 0; i < n; i++) d[i] = (T)(__VA_ARGS__);                                       \
    } while (0)

#define DEFINE_KERNEL(name, BODY)                                                                      \
    static void name##_f32(int64_t n, float *d, const float *const *s, const kargs *k)                 \
    {                                                                                                  \
        typedef float T;                                                                               \
        (void)s; (void)k;                                                                              \
        BODY                                                                                           \
    }                                                                                                  \
    static void name##_f64(int64_t n, double *d, const double *const *s, const kargs *k)               \
    {                                                                                                  \
        typedef double T;                                                                              \
        (void)s; (void)k;                                                                              \
        BODY                                                                                           \
    }

#define COPY_BODY EACH(s[0][i]);
#define FILL_BODY { const T v = (T)k->a; EACH(v); }

/* sign keeps zeros (and their sign) and NaN; relu keeps NaN; sigmoid never overflows exp. */
#define UNARY_BODY                                                                                     \
    const T *x = s[0];                                                                                 \
    switch ((ms_unary_op)k->op) {                                                                      \
    case MS_UNARY_NEG:        EACH(-x[i]); break;                                                      \
    case MS_UNARY_ABS:        EACH(fabs(x[i])); break;                                                 \
    case MS_UNARY_SQRT:       EACH(sqrt(x[i])); break;                                                 \
    case MS_UNARY_RSQRT:      EACH(1 / sqrt(x[i])); break;                                             \
    case MS_UNARY_EXP:        EACH(exp(x[i])); break;                                                  \
    case MS_UNARY_LOG:        EACH(log(x[i])); break;                                                  \
    case MS_UNARY_SIGN:       EACH(x[i] > 0 ? 1 : x[i] < 0 ? -1 : x[i]); break;                        \
    case MS_UNARY_SQUARE:     EACH(x[i] * x[i]); break;                                                \
    case MS_UNARY_RECIPROCAL: EACH(1 / x[i]); break;                                                   \
    case MS_UNARY_TANH:       EACH(tanh(x[i])); break;                                                 \
    case MS_UNARY_SIGMOID:                                                                             \
        for (int64_t i = 0; i < n; i++) {                                                              \
            T e = exp(-fabs(x[i]));                                                                    \
            d[i] = x[i] >= 0 ? 1 / (1 + e) : e / (1 + e);                                              \
        }                                                                                              \
        break;                                                                                         \
    case MS_UNARY_RELU:       EACH(x[i] > 0 || x[i] != x[i] ? x[i] : 0); break;                        \
    case MS_UNARY_SIN:        EACH(sin(x[i])); break;                                                  \
    case MS_UNARY_COS:        EACH(cos(x[i])); break;                                                  \
    default: break;                                                                                    \
    }

/* maximum/minimum: NaN in either operand gives NaN (x + y is that NaN). */
#define BINARY_SWITCH(X, Y)                                                                            \
    switch ((ms_binary_op)k->op) {                                                                     \
    case MS_BINARY_ADD:     EACH((X) + (Y)); break;                                                    \
    case MS_BINARY_SUB:     EACH((X) - (Y)); break;                                                    \
    case MS_BINARY_MUL:     EACH((X) * (Y)); break;                                                    \
    case MS_BINARY_DIV:     EACH((X) / (Y)); break;                                                    \
    case MS_BINARY_POW:     EACH(pow((X), (Y))); break;                                                \
    case MS_BINARY_MAXIMUM: EACH((X) != (X) || (Y) != (Y) ? (X) + (Y) : (X) > (Y) ? (X) : (Y)); break; \
    case MS_BINARY_MINIMUM: EACH((X) != (X) || (Y) != (Y) ? (X) + (Y) : (X) < (Y) ? (X) : (Y)); break; \
    case MS_BINARY_EQ:      EACH((X) == (Y)); break;                                                   \
    case MS_BINARY_NE:      EACH((X) != (Y)); break;                                                   \
    case MS_BINARY_LT:      EACH((X) < (Y)); break;                                                    \
    case MS_BINARY_LE:      EACH((X) <= (Y)); break;                                                   \
    case MS_BINARY_GT:      EACH((X) > (Y)); break;                                                    \
    case MS_BINARY_GE:      EACH((X) >= (Y)); break;                                                   \
    default: break;                                                                                    \
    }

#define BINARY_BODY { const T *x = s[0], *y = s[1]; BINARY_SWITCH(x[i], y[i]) }
#define BINARY_SCALAR_BODY                                                                             \
    {                                                                                                  \
        const T *x = s[0], c = (T)k->a;                                                                \
        if (k->flag) { BINARY_SWITCH(c, x[i]) } else { BINARY_SWITCH(x[i], c) }                                \
    }
/* lo first, then hi: lo > hi gives hi everywhere (as min(max(x, lo), hi)); NaN fails both tests. */
#define CLAMP_BODY                                                                                     \
    {                                                                                                  \
        const T *x = s[0], lo = (T)k->a, hi = (T)k->b;                                                 \
        EACH(x[i] < lo ? (lo > hi ? hi : lo) : x[i] > hi ? hi : x[i]);                               \
    }
#define LERP_BODY { const T *a = s[0], *b = s[1], w = (T)k->a; EACH(a[i] + w * (b[i] - a[i])); }
#define ADDC_BODY                                                                                      \
    {                                                                                                  \
        const T *a = s[0], *b = s[1], *c = s[2], v = (T)k->a;                                          \
        if (k->flag) EACH(a[i] + v * b[i] / c[i]); else EACH(a[i] + v * b[i] * c[i]);                  \
    }

DEFINE_KERNEL(copy, COPY_BODY)
DEFINE_KERNEL(fill, FILL_BODY)
DEFINE_KERNEL(unary, UNARY_BODY)
DEFINE_KERNEL(binary, BINARY_BODY)
DEFINE_KERNEL(binary_scalar, BINARY_SCALAR_BODY)
DEFINE_KERNEL(clamp, CLAMP_BODY)
DEFINE_KERNEL(lerp, LERP_BODY)
DEFINE_KERNEL(addc, ADDC_BODY)

/* --- the iteration ------------------------------------------------------------------------------ */

/* Every operand of the compute dtype and dense in the same order: index i is element i of each. */
static bool nary_dense(const ms_nary *it, ms_dtype ct)
{
    for (int k = 0; k < it->nops; k++)
        if (it->dtype[k] != ct) return false;
    if (it->contiguous || it->ndim == 0) return true;
    if (it->ndim != 1) return false;
    for (int k = 0; k < it->nops; k++)
        if (it->strides[k][0] != 1) return false;
    return true;
}

static ms_status run_nary(ms_ctx *ctx, const ms_nary *it, bool wide, kernel_f32 k32, kernel_f64 k64,
                          const kargs *k)
{
    int64_t numel = it->numel;
    int nsrc = it->nops - 1;
    if (numel == 0) return MS_OK;
    int nt = threads_for(ctx, numel);

    if (nary_dense(it, wide ? MS_DTYPE_F64 : MS_DTYPE_F32)) {
        int64_t nblk = (numel + DENSE_BLOCK - 1) / DENSE_BLOCK;
        #pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t b = 0; b < nblk; b++) {
            int64_t i0 = b * DENSE_BLOCK, m = numel - i0 < DENSE_BLOCK ? numel - i0 : DENSE_BLOCK;
            if (wide) {
                const double *src[MS_NARY_MAX];
                for (int j = 0; j < nsrc; j++) src[j] = (const double *)it->data[j + 1] + i0;
                k64(m, (double *)it->data[0] + i0, src, k);
            } else {
                const float *src[MS_NARY_MAX];
                for (int j = 0; j < nsrc; j++) src[j] = (const float *)it->data[j + 1] + i0;
                k32(m, (float *)it->data[0] + i0, src, k);
            }
        }
        return MS_OK;
    }

    /* Strided, broadcast or mixed dtypes: each block's sources are loaded (converted) first and dst is
    ** written after, so an in-place op (dst the same view as a source) reads before it writes. */
    ms_cpu_view v[MS_NARY_MAX];
    for (int j = 0; j < it->nops; j++) ms_cpu_view_of_nary(&v[j], it, j);
    int64_t nblk = (numel + BLOCK - 1) / BLOCK;
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t b = 0; b < nblk; b++) {
        int64_t i0 = b * BLOCK, m = numel - i0 < BLOCK ? numel - i0 : BLOCK;
        if (wide) {
            double buf[MS_NARY_MAX][BLOCK];
            const double *src[MS_NARY_MAX];
            for (int j = 0; j < nsrc; j++) src[j] = ms_cpu_load_f64(&v[j + 1], i0, m, buf[j + 1]);
            double *d = ms_cpu_span_f64(&v[0], i0, m);
            k64(m, d ? d : buf[0], src, k);
            if (!d) ms_cpu_store_f64(&v[0], i0, m, buf[0]);
        } else {
            float buf[MS_NARY_MAX][BLOCK];
            const float *src[MS_NARY_MAX];
            for (int j = 0; j < nsrc; j++) src[j] = ms_cpu_load_f32(&v[j + 1], i0, m, buf[j + 1]);
            float *d = ms_cpu_span_f32(&v[0], i0, m);
            k32(m, d ? d : buf[0], src, k);
            if (!d) ms_cpu_store_f32(&v[0], i0, m, buf[0]);
        }
    }
    return MS_OK;
}

/* --- members -------------------------------------------------------------------------------------- */

static bool needs_f64(ms_dtype dt) { return dt == MS_DTYPE_F64 || dt == MS_DTYPE_I32; }

/* Casts: same dtype copies values exactly; f64 and i32 travel through f64 (exact), the others through
** f32 (exact).  Conversions to i32/u8 truncate toward zero and saturate (NaN -> 0). */
ms_status ms_cpu_copy(ms_ctx *ctx, const ms_nary *it)
{
    ms_dtype dd = it->dtype[0], sd = it->dtype[1];
    if (dd == sd && nary_dense(it, dd) && it->numel > 0) {
        size_t esz = ms_dtype_size(dd);
        int64_t nblk = (it->numel + DENSE_BLOCK - 1) / DENSE_BLOCK;
        #pragma omp parallel for schedule(static) num_threads(threads_for(ctx, it->numel))
        for (int64_t b = 0; b < nblk; b++) {
            int64_t i0 = b * DENSE_BLOCK, m = it->numel - i0 < DENSE_BLOCK ? it->numel - i0 : DENSE_BLOCK;
            memmove(it->data[0] + i0 * (int64_t)esz, it->data[1] + i0 * (int64_t)esz, (size_t)m * esz);
        }
        return MS_OK;
    }
    kargs k = {0};
    return run_nary(ctx, it, needs_f64(dd) || needs_f64(sd), copy_f32, copy_f64, &k);
}

ms_status ms_cpu_fill(ms_ctx *ctx, const ms_nary *it, ms_scalar v)
{
    kargs k = { .a = ms_cpu_read_scalar(&v) };
    return run_nary(ctx, it, needs_f64(it->dtype[0]), fill_f32, fill_f64, &k);
}

ms_status ms_cpu_unary(ms_ctx *ctx, const ms_nary *it, ms_unary_op op)
{
    kargs k = { .op = op };
    return run_nary(ctx, it, it->wide, unary_f32, unary_f64, &k);
}

ms_status ms_cpu_binary(ms_ctx *ctx, const ms_nary *it, ms_binary_op op)
{
    kargs k = { .op = op };
    return run_nary(ctx, it, it->wide, binary_f32, binary_f64, &k);
}

ms_status ms_cpu_binary_scalar(ms_ctx *ctx, const ms_nary *it, ms_scalar s, ms_binary_op op, int scalar_first)
{
    kargs k = { .op = op, .flag = scalar_first != 0, .a = ms_cpu_read_scalar(&s) };
    return run_nary(ctx, it, it->wide, binary_scalar_f32, binary_scalar_f64, &k);
}

ms_status ms_cpu_clamp(ms_ctx *ctx, const ms_nary *it, double lo, double hi)
{
    kargs k = { .a = lo, .b = hi };
    return run_nary(ctx, it, it->wide, clamp_f32, clamp_f64, &k);
}

ms_status ms_cpu_lerp(ms_ctx *ctx, const ms_nary *it, ms_scalar w)
{
    kargs k = { .a = ms_cpu_read_scalar(&w) };
    return run_nary(ctx, it, it->wide, lerp_f32, lerp_f64, &k);
}

ms_status ms_cpu_addc(ms_ctx *ctx, const ms_nary *it, ms_scalar v, int divide)
{
    kargs k = { .flag = divide != 0, .a = ms_cpu_read_scalar(&v) };
    return run_nary(ctx, it, it->wide, addc_f32, addc_f64, &k);
}

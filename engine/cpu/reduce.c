/*
** CPU reductions (sum, mean, max, min, norm2, sumsq, amax along a dim or over everything) and dot.
** The summation order is fixed by the shape alone -- 4096-element chunks, each summed in 8 interleaved
** lanes, chunk partials combined in order -- so results are bitwise the same for any thread count.
*/
#include "cpu.h"

#include <tgmath.h>

#define CHUNK 4096          /* elements of one output summed by one task */
#define LANES 8             /* interleaved accumulators inside a chunk (element k goes to lane k % 8) */
#define INNER_BLOCK 256     /* outputs advanced together, row by row, when the reduced dim is not innermost */
#define INNER_ROWS_MIN 16   /* from this many inner outputs on, rows are read contiguously */
#define STACK_SCRATCH 512   /* partials kept on the stack up to this many (f64) values */

/* One accumulation step of each op (NaN sticks in max/min/amax: neither comparison replaces it). */
#define UPD_SUM(a, x)  ((a) + (x))
#define UPD_SQ(a, x)   ((a) + (x) * (x))
#define UPD_MAX(a, x)  ((x) > (a) || (x) != (x) ? (x) : (a))
#define UPD_MIN(a, x)  ((x) < (a) || (x) != (x) ? (x) : (a))
#define UPD_AMAX(a, x) UPD_MAX((a), fabs(x))

#define LANE_LOOP(UPD)                                                                                 \
    for (; i + LANES <= n; i += LANES)                                                                 \
        for (int l = 0; l < LANES; l++) acc[l] = UPD(acc[l], x[i + l]);                                \
    for (; i < n; i++) acc[i % LANES] = UPD(acc[i % LANES], x[i]);

#define ROW_LOOP(UPD) for (int64_t j = 0; j < m; j++) part[j] = UPD(part[j], row[j]);

#define DEFINE_LEAVES(T, SUF)                                                                          \
    static T init_##SUF(ms_reduce_op op)                                                               \
    {                                                                                                  \
        return op == MS_REDUCE_MAX ? (T)-INFINITY : op == MS_REDUCE_MIN ? (T)INFINITY : (T)0;         \
    }                                                                                                  \
    /* partials of the same op: sums add, the others keep the extreme (and NaN) */                    \
    static T combine_##SUF(ms_reduce_op op, T p, T q)                                                  \
    {                                                                                                  \
        switch (op) {                                                                                  \
        case MS_REDUCE_MAX: case MS_REDUCE_AMAX: return UPD_MAX(p, q);                                 \
        case MS_REDUCE_MIN: return UPD_MIN(p, q);                                                      \
        default: return p + q;                                                                         \
        }                                                                                              \
    }                                                                                                  \
    static T lanes_fold_##SUF(ms_reduce_op op, const T *acc)                                           \
    {                                                                                                  \
        T p01 = combine_##SUF(op, acc[0], acc[1]), p23 = combine_##SUF(op, acc[2], acc[3]);            \
        T p45 = combine_##SUF(op, acc[4], acc[5]), p67 = combine_##SUF(op, acc[6], acc[7]);            \
        return combine_##SUF(op, combine_##SUF(op, p01, p23), combine_##SUF(op, p45, p67));            \
    }                                                                                                  \
    /* one chunk of n dense elements */                                                                \
    static T chunk_##SUF(ms_reduce_op op, const T *x, int64_t n)                                       \
    {                                                                                                  \
        T acc[LANES];                                                                                  \
        for (int l = 0; l < LANES; l++) acc[l] = init_##SUF(op);                                       \
        int64_t i = 0;                                                                                 \
        switch (op) {                                                                                  \
        case MS_REDUCE_MAX:  LANE_LOOP(UPD_MAX) break;                                                 \
        case MS_REDUCE_MIN:  LANE_LOOP(UPD_MIN) break;                                                 \
        case MS_REDUCE_AMAX: LANE_LOOP(UPD_AMAX) break;                                                \
        case MS_REDUCE_NORM2: case MS_REDUCE_SUMSQ: LANE_LOOP(UPD_SQ) break;                           \
        default: LANE_LOOP(UPD_SUM) break;                                                             \
        }                                                                                              \
        return lanes_fold_##SUF(op, acc);                                                              \
    }                                                                                                  \
    /* part[j] <- part[j] op row[j] for m outputs */                                                  \
    static void rows_##SUF(ms_reduce_op op, T *part, const T *row, int64_t m)                          \
    {                                                                                                  \
        switch (op) {                                                                                  \
        case MS_REDUCE_MAX:  ROW_LOOP(UPD_MAX) break;                                                  \
        case MS_REDUCE_MIN:  ROW_LOOP(UPD_MIN) break;                                                  \
        case MS_REDUCE_AMAX: ROW_LOOP(UPD_AMAX) break;                                                 \
        case MS_REDUCE_NORM2: case MS_REDUCE_SUMSQ: ROW_LOOP(UPD_SQ) break;                            \
        default: ROW_LOOP(UPD_SUM) break;                                                              \
        }                                                                                              \
    }                                                                                                  \
    static T finish_##SUF(ms_reduce_op op, T acc, int64_t len)                                         \
    {                                                                                                  \
        if (op == MS_REDUCE_MEAN) return acc / (T)len;                                                 \
        if (op == MS_REDUCE_NORM2) return sqrt(acc);                                                   \
        return acc;                                                                                    \
    }                                                                                                  \
    static T dot_chunk_##SUF(const T *x, const T *y, int64_t n)                                        \
    {                                                                                                  \
        T acc[LANES] = {0};                                                                            \
        int64_t i = 0;                                                                                 \
        for (; i + LANES <= n; i += LANES)                                                             \
            for (int l = 0; l < LANES; l++) acc[l] += x[i + l] * y[i + l];                             \
        for (; i < n; i++) acc[i % LANES] += x[i] * y[i];                                              \
        return lanes_fold_##SUF(MS_REDUCE_SUM, acc);                                                   \
    }

DEFINE_LEAVES(float, f32)
DEFINE_LEAVES(double, f64)

/* f32 accumulation for the float dtypes narrower than f64, f64 for f64 and the integers */
static bool wide_acc(ms_dtype dt)
{
    return !(dt == MS_DTYPE_F32 || dt == MS_DTYPE_BF16 || dt == MS_DTYPE_F16);
}

/* Element offset of row-major index i over dims [d0, d1) of t. */
static int64_t offset_of(const ms_tensor *t, int d0, int d1, int64_t i)
{
    int64_t off = 0;
    for (int d = d1 - 1; d >= d0; d--) {
        off += (i % t->shape[d]) * t->strides[d];
        i /= t->shape[d];
    }
    return off;
}

static ms_status scratch(ms_ctx *ctx, size_t nbytes, double *stack, void **out)
{
    if (nbytes <= STACK_SCRATCH * sizeof(double)) {
        *out = stack;
        return MS_OK;
    }
    return ms_ctx_alloc(ctx, nbytes, out);
}

static void scratch_free(ms_ctx *ctx, void *p, size_t nbytes, double *stack)
{
    if (p != stack) ms_ctx_dealloc(ctx, p, nbytes);
}

/* The geometry of one reduction: src as [outer, len, inner] with per-output partials of nchunk chunks. */
typedef struct reduction {
    const ms_tensor *src;
    ms_reduce_op op;
    int      dim;            /* MS_DIM_ALL: outer = inner = 1, len = numel in row-major order */
    bool     wide, by_rows;
    int64_t  outer, len, inner, nchunk;
    size_t   esz;
} reduction;

/* Partial of output j (= o * inner + i) over chunk c.
** by_rows: partials laid out [outer, nchunk, inner]; else [outputs, nchunk]. */
static int64_t partial_index(const reduction *r, int64_t j, int64_t c)
{
    if (!r->by_rows) return j * r->nchunk + c;
    return ((j / r->inner) * r->nchunk + c) * r->inner + j % r->inner;
}

/* Task t of the run-per-output form: output t / nchunk, chunk t % nchunk, read as one strided run. */
static void task_runs(const reduction *r, int64_t t, void *partials)
{
    const ms_tensor *s = r->src;
    int64_t j = t / r->nchunk, c = t % r->nchunk;
    ms_cpu_view v;
    if (r->dim == MS_DIM_ALL) {
        ms_cpu_view_of(&v, s);
    } else {
        int64_t o = j / r->inner, i = j % r->inner;
        int64_t off = offset_of(s, 0, r->dim, o) + offset_of(s, r->dim + 1, s->ndim, i);
        v = (ms_cpu_view){ .ndim = 1, .shape = { r->len }, .strides = { s->strides[r->dim] },
                           .dtype = s->dtype, .base = (char *)ms_tensor_ptr(s) + off * (int64_t)r->esz };
    }
    int64_t k0 = c * CHUNK, m = r->len - k0 < CHUNK ? r->len - k0 : CHUNK;
    if (r->wide) {
        double buf[CHUNK];
        ((double *)partials)[t] = chunk_f64(r->op, ms_cpu_load_f64(&v, k0, m, buf), m);
    } else {
        float buf[CHUNK];
        ((float *)partials)[t] = chunk_f32(r->op, ms_cpu_load_f32(&v, k0, m, buf), m);
    }
}

/* Task t of the by-rows form: (outer o, chunk c, block ib of inner outputs), rows k of the chunk read as
** [inner] vectors.  Each output still sees its elements one at a time in order k. */
static void task_rows(const reduction *r, int64_t t, void *partials)
{
    const ms_tensor *s = r->src;
    int64_t nib = (r->inner + INNER_BLOCK - 1) / INNER_BLOCK;
    int64_t ib = t % nib, c = (t / nib) % r->nchunk, o = t / (nib * r->nchunk);
    int64_t j0 = ib * INNER_BLOCK, m = r->inner - j0 < INNER_BLOCK ? r->inner - j0 : INNER_BLOCK;
    int64_t k0 = c * CHUNK, k1 = r->len - k0 < CHUNK ? r->len : k0 + CHUNK;
    ms_cpu_view v = { .ndim = s->ndim - r->dim - 1, .dtype = s->dtype };
    for (int d = 0; d < v.ndim; d++) {
        v.shape[d] = s->shape[r->dim + 1 + d];
        v.strides[d] = s->strides[r->dim + 1 + d];
    }
    char *base = (char *)ms_tensor_ptr(s) + offset_of(s, 0, r->dim, o) * (int64_t)r->esz;
    int64_t step = s->strides[r->dim] * (int64_t)r->esz, out0 = (o * r->nchunk + c) * r->inner + j0;
    if (r->wide) {
        double part[INNER_BLOCK], buf[INNER_BLOCK];
        for (int64_t j = 0; j < m; j++) part[j] = init_f64(r->op);
        for (int64_t k = k0; k < k1; k++) {
            v.base = base + k * step;
            rows_f64(r->op, part, ms_cpu_load_f64(&v, j0, m, buf), m);
        }
        for (int64_t j = 0; j < m; j++) ((double *)partials)[out0 + j] = part[j];
    } else {
        float part[INNER_BLOCK], buf[INNER_BLOCK];
        for (int64_t j = 0; j < m; j++) part[j] = init_f32(r->op);
        for (int64_t k = k0; k < k1; k++) {
            v.base = base + k * step;
            rows_f32(r->op, part, ms_cpu_load_f32(&v, j0, m, buf), m);
        }
        for (int64_t j = 0; j < m; j++) ((float *)partials)[out0 + j] = part[j];
    }
}

ms_status ms_cpu_reduce(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, ms_reduce_op op, int dim)
{
    reduction r = { .src = src, .op = op, .dim = dim, .wide = wide_acc(src->dtype), .outer = 1, .inner = 1,
                    .esz = ms_dtype_size(src->dtype) };
    if (dim == MS_DIM_ALL) {
        r.len = ms_tensor_numel(src);
    } else {
        for (int d = 0; d < dim; d++) r.outer *= src->shape[d];
        r.len = src->shape[dim];
        for (int d = dim + 1; d < src->ndim; d++) r.inner *= src->shape[d];
    }
    int64_t nout = r.outer * r.inner;
    ms_cpu_view dv;
    ms_cpu_view_of(&dv, dst);
    if (nout == 0) return MS_OK;
    if (r.len == 0) {
        if (op == MS_REDUCE_MAX || op == MS_REDUCE_MIN || op == MS_REDUCE_AMAX)
            return MS_FAIL(ctx, MS_E_SHAPE, "reduce: max/min/amax over zero elements (src %s)", ms_tshape(src));
        ms_cpu_fill_view(ctx, &dv, op == MS_REDUCE_MEAN ? NAN : 0.0);
        return MS_OK;
    }
    r.nchunk = (r.len + CHUNK - 1) / CHUNK;
    r.by_rows = dim != MS_DIM_ALL && r.inner >= INNER_ROWS_MIN;

    size_t asz = r.wide ? sizeof(double) : sizeof(float);
    size_t nbytes = (size_t)(nout * r.nchunk + nout) * asz;
    double stack[STACK_SCRATCH];
    void *mem;
    MS_TRY(scratch(ctx, nbytes, stack, &mem));
    void *out = (char *)mem + (size_t)(nout * r.nchunk) * asz;

    int64_t ntask = r.by_rows ? r.outer * r.nchunk * ((r.inner + INNER_BLOCK - 1) / INNER_BLOCK)
                              : nout * r.nchunk;
    int nt = ntask > 1 && nout * r.len >= MS_CPU_PAR_MIN ? ms_cpu_threads(ctx) : 1;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t t = 0; t < ntask; t++) {
        if (r.by_rows) task_rows(&r, t, mem);
        else task_runs(&r, t, mem);
    }

    #pragma omp parallel for schedule(static) num_threads(nout >= MS_CPU_PAR_MIN ? nt : 1)
    for (int64_t j = 0; j < nout; j++) {
        if (r.wide) {
            const double *p = mem;
            double acc = p[partial_index(&r, j, 0)];
            for (int64_t c = 1; c < r.nchunk; c++) acc = combine_f64(op, acc, p[partial_index(&r, j, c)]);
            ((double *)out)[j] = finish_f64(op, acc, r.len);
        } else {
            const float *p = mem;
            float acc = p[partial_index(&r, j, 0)];
            for (int64_t c = 1; c < r.nchunk; c++) acc = combine_f32(op, acc, p[partial_index(&r, j, c)]);
            ((float *)out)[j] = finish_f32(op, acc, r.len);
        }
    }
    if (r.wide) ms_cpu_store_f64(&dv, 0, nout, out);
    else ms_cpu_store_f32(&dv, 0, nout, out);
    scratch_free(ctx, mem, nbytes, stack);
    return MS_OK;
}

ms_status ms_cpu_dot(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b)
{
    bool wide = wide_acc(a->dtype) || wide_acc(b->dtype);
    ms_cpu_view va, vb, dv;
    ms_cpu_view_of(&va, a);
    ms_cpu_view_of(&vb, b);
    ms_cpu_view_of(&dv, dst);
    int64_t numel = ms_cpu_view_numel(&va), nchunk = (numel + CHUNK - 1) / CHUNK;
    size_t nbytes = (size_t)(nchunk > 0 ? nchunk : 1) * sizeof(double);
    double stack[STACK_SCRATCH];
    void *mem;
    MS_TRY(scratch(ctx, nbytes, stack, &mem));
    double *part = mem;   /* f32 partials are kept exactly in f64 and combined in f32 below */

    #pragma omp parallel for schedule(static) num_threads(numel >= MS_CPU_PAR_MIN ? ms_cpu_threads(ctx) : 1)
    for (int64_t c = 0; c < nchunk; c++) {
        int64_t k0 = c * CHUNK, m = numel - k0 < CHUNK ? numel - k0 : CHUNK;
        if (wide) {
            double bx[CHUNK], by[CHUNK];
            part[c] = dot_chunk_f64(ms_cpu_load_f64(&va, k0, m, bx), ms_cpu_load_f64(&vb, k0, m, by), m);
        } else {
            float bx[CHUNK], by[CHUNK];
            part[c] = dot_chunk_f32(ms_cpu_load_f32(&va, k0, m, bx), ms_cpu_load_f32(&vb, k0, m, by), m);
        }
    }
    double sum = 0;
    float sumf = 0;
    for (int64_t c = 0; c < nchunk; c++) {
        if (wide) sum += part[c];
        else sumf += (float)part[c];
    }
    if (!wide) sum = sumf;
    ms_cpu_store_f64(&dv, 0, 1, &sum);
    scratch_free(ctx, mem, nbytes, stack);
    return MS_OK;
}

/*
** CPU fused optimizer steps (AdamW, SGD) and multi-tensor helpers (sum of squares, scale) over groups of members.
** A call is cut into (member, block) tasks run by one OpenMP loop: a few large members spread over the threads by
** elements, many small ones by members.  Stochastic rounding is defined here bit for bit, for the CUDA twin.
*/
#include "cpu.h"

#include <string.h>
#include <tgmath.h>   /* sqrt, floor, pow pick the float or double version from the argument's type */

#define BLOCK 2048                          /* elements of one member updated by one task (stack buffers) */
#define STEP_PAR_MIN (MS_CPU_PAR_MIN / 4)   /* a step element costs several ns (sqrt, divide, Philox) */
#define PLAN_STACK 256                      /* members planned without allocating */
/* The fixed summation order of engine/cpu/reduce.c (ms_reduce SUMSQ over all elements): 4096-element chunks,
** each summed in 8 interleaved lanes folded pairwise, chunk partials added in order.  The same numbers here
** make ms_foreach_sumsq equal ms_reduce bit for bit (a spec checks it). */
#define SUMSQ_CHUNK 4096
#define SUMSQ_LANES 8

/* --- tasks ------------------------------------------------------------------------------------------ */

/* first[i] = index of member i's first task, first[n] = the number of tasks; members of 0 elements have none. */
typedef struct plan {
    int      n;
    int64_t *first;
    int64_t  numel;      /* elements of all members */
    int64_t  stack[PLAN_STACK + 1];
} plan;

static ms_status plan_new(ms_ctx *ctx, int n, const ms_tensor *const *ts, int64_t per_task, plan *pl)
{
    pl->n = n;
    pl->first = pl->stack;
    if (n > PLAN_STACK) {
        void *mem;
        MS_TRY(ms_ctx_alloc(ctx, (size_t)(n + 1) * sizeof(int64_t), &mem));
        pl->first = mem;
    }
    pl->numel = 0;
    int64_t t = 0;
    for (int i = 0; i < n; i++) {
        int64_t numel = ms_tensor_numel(ts[i]);
        pl->first[i] = t;
        t += (numel + per_task - 1) / per_task;
        pl->numel += numel;
    }
    pl->first[n] = t;
    return MS_OK;
}

static void plan_free(ms_ctx *ctx, plan *pl)
{
    if (pl->first != pl->stack) ms_ctx_dealloc(ctx, pl->first, (size_t)(pl->n + 1) * sizeof(int64_t));
}

/* The member task t belongs to: the last i with first[i] <= t (members without tasks share their successor's
** first, and the search passes over them). */
static int plan_member(const plan *pl, int64_t t)
{
    int lo = 0, hi = pl->n - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        if (pl->first[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static int plan_threads(const ms_ctx *ctx, const plan *pl, int64_t par_min)
{
    int64_t ntask = pl->first[pl->n];
    if (pl->numel < par_min || ntask < 2) return 1;
    int nt = ms_cpu_threads(ctx);
    return ntask < nt ? (int)ntask : nt;
}

/* Runs block(call, i, e0, len) on every task of BLOCK elements [e0, e0 + len) of member i of ts, spread over the
** context's threads when the members hold par_min elements or more. */
typedef void (*block_fn)(const void *call, int i, int64_t e0, int64_t len);
static ms_status for_blocks(ms_ctx *ctx, int n, const ms_tensor *const *ts, int64_t par_min, block_fn block,
                            const void *call)
{
    plan pl;
    MS_TRY(plan_new(ctx, n, ts, BLOCK, &pl));
    int64_t ntask = pl.first[n];
    #pragma omp parallel for schedule(dynamic, 4) num_threads(plan_threads(ctx, &pl, par_min))
    for (int64_t t = 0; t < ntask; t++) {
        int i = plan_member(&pl, t);
        int64_t e0 = (t - pl.first[i]) * BLOCK, numel = ms_tensor_numel(ts[i]);
        block(call, i, e0, numel - e0 < BLOCK ? numel - e0 : BLOCK);
    }
    plan_free(ctx, &pl);
    return MS_OK;
}

/* [e0, e0 + n) of v as a writable run of T: v's own memory when it is a dense run of T, else converted into buf
** (and then the caller stores buf back). */
static float *inplace_f32(const ms_cpu_view *v, int64_t e0, int64_t n, float *buf)
{
    float *d = ms_cpu_span_f32(v, e0, n);
    if (d) return d;
    ms_cpu_load_f32(v, e0, n, buf);
    return buf;
}

static double *inplace_f64(const ms_cpu_view *v, int64_t e0, int64_t n, double *buf)
{
    double *d = ms_cpu_span_f64(v, e0, n);
    if (d) return d;
    ms_cpu_load_f64(v, e0, n, buf);
    return buf;
}

/* --- stochastic rounding ---------------------------------------------------------------------------
** A bf16/f16 param x (the f32 result of the step, finite) has two neighbours in the target format: lo, x
** truncated toward zero (its magnitude's bit pattern cut), and hi, the next bit pattern up in magnitude (one
** unit in the last place away from zero; past the largest finite value that is infinity).  With
**   f = (|x| - |lo|) / ulp                    (ulp: the spacing at lo, = |hi| - |lo| when hi is finite;
**                                              f in [0, 1), exact; 0 when x is representable)
**   w0..w3 = Philox4x32-10(counter = {lo32(e), hi32(e), lo32(step), member}, key = {lo32(seed), hi32(seed)})
** where e is the element's row-major index in its member, step the rounded step number (0 if negative or not
** finite, as a step_t may hold) and member the index in the call (or the numbers of the param's origin:
** ms_tensor_set_rng_origin), the stored value is hi iff
** (w0 >> 8) < f * 2^24 (compared exactly), else lo.  So P(hi) = f
** (up to 2^-24 for f16 subnormals) and the expected stored value is x.  In integers: bf16 drops 16 bits,
** f * 2^24 = dropped << 8; f16 normals drop 13, f * 2^24 = dropped << 11; f16 subnormals (|x| < 2^-14) have
** spacing 2^-24, lo = floor(|x| 2^24) 2^-24 and f * 2^24 = (|x| 2^24 - floor(|x| 2^24)) 2^24, exact in f64.
** NaN and infinity are stored as round-to-nearest-even stores them. */

typedef ms_cpu_rounding rounding;   /* cpu.h: shared with the other fused steps */

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static uint16_t sr_bf16(float x, uint32_t u24)
{
    uint32_t b = f32_bits(x);
    if ((b & 0x7fffffffu) >= 0x7f800000u) return ms_f32_to_bf16(x);
    uint32_t lo = b >> 16, dropped = b & 0xffffu;
    return (uint16_t)(u24 < (dropped << 8) ? lo + 1 : lo);   /* +1 on the sign-magnitude pattern: away from 0 */
}

static uint16_t sr_f16(float x, uint32_t u24)
{
    uint32_t b = f32_bits(x), sign = (b >> 16) & 0x8000u, a = b & 0x7fffffffu, q;
    bool up;
    if (a >= 0x7f800000u) return ms_f32_to_f16(x);
    if (a >= 0x47800000u) return (uint16_t)(sign | 0x7c00u);   /* |x| >= 2^16: even the truncation is infinite */
    if (a >= 0x38800000u) {                                     /* |x| >= 2^-14: a normal f16, 13 bits dropped */
        q = (a >> 13) - (112u << 10);                           /* rebias 127 -> 15 */
        up = u24 < ((a & 0x1fffu) << 11);
    } else {                                                    /* subnormal f16: multiples of 2^-24 */
        double s = (double)bits_f32(a) * 0x1p24, whole = floor(s);
        q = (uint32_t)whole;
        up = (double)u24 < (s - whole) * 0x1p24;
    }
    return (uint16_t)(sign | (q + (up ? 1u : 0u)));             /* q + 1 may carry into the exponent: right */
}

static uint32_t step_word(double step)
{
    return step >= 0 && step < 0x1p64 ? (uint32_t)(uint64_t)step : 0;
}

static rounding rounding_of(bool stochastic, uint64_t seed, double step)
{
    return (rounding){ stochastic, { (uint32_t)seed, (uint32_t)(seed >> 32) }, step_word(step) };
}

/* Elements [e0, e0 + n) of a contiguous bf16/f16 param <- x: round to nearest even, or stochastically as
** defined above, with the element and member numbers of `map` (ms_rng_map_of: the param's origin, else its
** own).  Other dtypes are stored as ms_cpu_store_f32 stores them. */
static void store_param_f32(const ms_cpu_view *pv, const rounding *r, const ms_rng_map *map, int64_t e0, int64_t n,
                            const float *x)
{
    if (!r->stochastic || (pv->dtype != MS_DTYPE_BF16 && pv->dtype != MS_DTYPE_F16)) {
        ms_cpu_store_f32(pv, e0, n, x);
        return;
    }
    uint16_t *dst = (uint16_t *)pv->base + e0;
    bool bf16 = pv->dtype == MS_DTYPE_BF16;
    for (int64_t j = 0; j < n; j++) {
        uint64_t e = ms_rng_element(map, e0 + j);
        uint32_t ctr[4] = { (uint32_t)e, (uint32_t)(e >> 32), r->step, map->member }, w[4];
        ms_cpu_philox(ctr, r->key, w);
        dst[j] = bf16 ? sr_bf16(x[j], w[0] >> 8) : sr_f16(x[j], w[0] >> 8);
    }
}

/* The step number of a call: the option or the device scalar, rounded to the nearest integer. */
static double read_step(double step, const ms_tensor *step_t)
{
    return rint(ms_cpu_read_scalar(&(ms_scalar){ step, step_t }));
}

static bool skipped(const ms_tensor *skip_t)
{
    return skip_t != NULL && ms_cpu_read_scalar(&(ms_scalar){ 0, skip_t }) != 0;   /* NaN skips too */
}

/* --- AdamW -----------------------------------------------------------------------------------------
** Per element, in T = f32 (f64 for f64 params), with the scalars computed once in f64 and rounded to T:
**   m' = b1 * m + (1 - b1) * g
**   v' = b2 * v + ((1 - b2) * g) * g
**   p' = p * (1 - lr_i * wd) - (lr_i / bc1) * (m' / (sqrt(v') / sqrt(bc2) + eps))
** bc = 1 - beta^step (f64 pow) with bias correction, else 1.  The update uses m' and v' as computed; bf16
** states store them rounded to nearest even afterwards. */

typedef struct adamw_call {
    ms_tensor *const       *params;
    const ms_tensor *const *grads;
    ms_tensor *const       *m, *const *v;
    const double           *scales;
    double                  lr, b1, b2, eps, wd, bc1, bc2_sqrt;
    rounding                round;
} adamw_call;

#define ADAMW_ELEMENTS(T)                                                                              \
    do {                                                                                               \
        const T b1 = (T)c->b1, omb1 = (T)(1.0 - c->b1), b2 = (T)c->b2, omb2 = (T)(1.0 - c->b2);       \
        const T eps = (T)c->eps, bc2s = (T)c->bc2_sqrt, dec = (T)decay, ss = (T)step_size;            \
        for (int64_t j = 0; j < len; j++) {                                                            \
            const T gj = g[j];                                                                         \
            const T mj = b1 * m[j] + omb1 * gj;                                                        \
            const T vj = b2 * v[j] + omb2 * gj * gj;                                                   \
            m[j] = mj;                                                                                 \
            v[j] = vj;                                                                                 \
            p[j] = p[j] * dec - ss * (mj / (sqrt(vj) / bc2s + eps));                                   \
        }                                                                                              \
    } while (0)

static void adamw_block(const void *call, int i, int64_t e0, int64_t len)
{
    const adamw_call *c = call;
    double lr_i = c->lr * (c->scales ? c->scales[i] : 1.0);
    double decay = 1.0 - lr_i * c->wd, step_size = lr_i / c->bc1;
    ms_cpu_view pv, gv, mv, vv;
    ms_cpu_view_of(&pv, c->params[i]);
    ms_cpu_view_of(&gv, c->grads[i]);
    ms_cpu_view_of(&mv, c->m[i]);
    ms_cpu_view_of(&vv, c->v[i]);
    if (pv.dtype == MS_DTYPE_F64) {
        double gb[BLOCK], pb[BLOCK], mb[BLOCK], vb[BLOCK];
        const double *g = ms_cpu_load_f64(&gv, e0, len, gb);
        double *p = inplace_f64(&pv, e0, len, pb), *m = inplace_f64(&mv, e0, len, mb);
        double *v = inplace_f64(&vv, e0, len, vb);
        ADAMW_ELEMENTS(double);
        if (p == pb) ms_cpu_store_f64(&pv, e0, len, pb);
        if (m == mb) ms_cpu_store_f64(&mv, e0, len, mb);
        if (v == vb) ms_cpu_store_f64(&vv, e0, len, vb);
    } else {
        float gb[BLOCK], pb[BLOCK], mb[BLOCK], vb[BLOCK];
        const float *g = ms_cpu_load_f32(&gv, e0, len, gb);
        float *p = inplace_f32(&pv, e0, len, pb), *m = inplace_f32(&mv, e0, len, mb);
        float *v = inplace_f32(&vv, e0, len, vb);
        ADAMW_ELEMENTS(float);
        if (p == pb) {
            const ms_rng_map map = ms_rng_map_of(c->params[i], i);
            store_param_f32(&pv, &c->round, &map, e0, len, pb);
        }
        if (m == mb) ms_cpu_store_f32(&mv, e0, len, mb);
        if (v == vb) ms_cpu_store_f32(&vv, e0, len, vb);
    }
}

ms_status ms_cpu_adamw_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                            ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_sq, const double *scales,
                            const ms_adamw_options *o)
{
    if (skipped(o->skip_t)) return MS_OK;
    double step = read_step(o->step, o->step_t);
    adamw_call c = {
        .params = params, .grads = grads, .m = exp_avg, .v = exp_avg_sq, .scales = scales,
        .lr = ms_cpu_read_scalar(&(ms_scalar){ o->lr, o->lr_t }), .b1 = o->beta1, .b2 = o->beta2, .eps = o->eps,
        .wd = o->weight_decay, .bc1 = 1.0, .bc2_sqrt = 1.0,
        .round = rounding_of(o->stochastic_round != 0, o->seed, step),
    };
    if (o->bias_correction) {
        c.bc1 = 1.0 - pow(o->beta1, step);
        c.bc2_sqrt = sqrt(1.0 - pow(o->beta2, step));
    }
    return for_blocks(ctx, n, (const ms_tensor *const *)params, STEP_PAR_MIN, adamw_block, &c);
}

/* --- SGD -------------------------------------------------------------------------------------------
** Per element, in T as for AdamW, as torch.optim.SGD:
**   d = g + wd * p                                (d = g when wd == 0, so that an infinite p stays out of it)
**   with momentum: buf' = d on the first step (step <= 1), else momentum * buf + (1 - dampening) * d;
**                  d = d + momentum * buf' (nesterov) or buf'
**   p' = p - lr_i * d */

typedef struct sgd_call {
    ms_tensor *const       *params;
    const ms_tensor *const *grads;
    ms_tensor *const       *buf;   /* NULL without momentum */
    const double           *scales;
    double                  lr, momentum, dampening, wd;
    bool                    nesterov, first;
    rounding                round;
} sgd_call;

#define SGD_ELEMENTS(T)                                                                                \
    do {                                                                                               \
        const T wd = (T)c->wd, mom = (T)c->momentum, omd = (T)(1.0 - c->dampening), lr = (T)lr_i;      \
        for (int64_t j = 0; j < len; j++) {                                                            \
            T d = g[j];                                                                                \
            if (c->wd != 0) d = d + wd * p[j];                                                         \
            if (b) {                                                                                   \
                const T bj = c->first ? d : mom * b[j] + omd * d;                                      \
                b[j] = bj;                                                                             \
                d = c->nesterov ? d + mom * bj : bj;                                                   \
            }                                                                                          \
            p[j] = p[j] - lr * d;                                                                      \
        }                                                                                              \
    } while (0)

static void sgd_block(const void *call, int i, int64_t e0, int64_t len)
{
    const sgd_call *c = call;
    double lr_i = c->lr * (c->scales ? c->scales[i] : 1.0);
    ms_cpu_view pv, gv, bv;
    ms_cpu_view_of(&pv, c->params[i]);
    ms_cpu_view_of(&gv, c->grads[i]);
    if (c->buf) ms_cpu_view_of(&bv, c->buf[i]);
    if (pv.dtype == MS_DTYPE_F64) {
        double gb[BLOCK], pb[BLOCK], bb[BLOCK];
        const double *g = ms_cpu_load_f64(&gv, e0, len, gb);
        double *p = inplace_f64(&pv, e0, len, pb), *b = c->buf ? inplace_f64(&bv, e0, len, bb) : NULL;
        SGD_ELEMENTS(double);
        if (p == pb) ms_cpu_store_f64(&pv, e0, len, pb);
        if (b == bb) ms_cpu_store_f64(&bv, e0, len, bb);
    } else {
        float gb[BLOCK], pb[BLOCK], bb[BLOCK];
        const float *g = ms_cpu_load_f32(&gv, e0, len, gb);
        float *p = inplace_f32(&pv, e0, len, pb), *b = c->buf ? inplace_f32(&bv, e0, len, bb) : NULL;
        SGD_ELEMENTS(float);
        if (p == pb) {
            const ms_rng_map map = ms_rng_map_of(c->params[i], i);
            store_param_f32(&pv, &c->round, &map, e0, len, pb);
        }
        if (b == bb) ms_cpu_store_f32(&bv, e0, len, bb);
    }
}

ms_status ms_cpu_sgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                          ms_tensor *const *momentum_buf, const double *scales, const ms_sgd_options *o)
{
    if (skipped(o->skip_t)) return MS_OK;
    double step = read_step(o->step, o->step_t);
    sgd_call c = {
        .params = params, .grads = grads, .buf = o->momentum != 0 ? momentum_buf : NULL, .scales = scales,
        .lr = ms_cpu_read_scalar(&(ms_scalar){ o->lr, o->lr_t }), .momentum = o->momentum,
        .dampening = o->dampening, .wd = o->weight_decay, .nesterov = o->nesterov != 0, .first = step <= 1,
        .round = rounding_of(o->stochastic_round != 0, o->seed, step),
    };
    return for_blocks(ctx, n, (const ms_tensor *const *)params, STEP_PAR_MIN, sgd_block, &c);
}

/* --- foreach ---------------------------------------------------------------------------------------- */

#define DEFINE_SUMSQ_CHUNK(T, SUF)                                                                     \
    static T sumsq_chunk_##SUF(const T *x, int64_t n)                                                  \
    {                                                                                                  \
        T acc[SUMSQ_LANES] = { 0 };                                                                    \
        int64_t i = 0;                                                                                 \
        for (; i + SUMSQ_LANES <= n; i += SUMSQ_LANES)                                                 \
            for (int l = 0; l < SUMSQ_LANES; l++) acc[l] = acc[l] + x[i + l] * x[i + l];               \
        for (; i < n; i++) acc[i % SUMSQ_LANES] = acc[i % SUMSQ_LANES] + x[i] * x[i];                  \
        return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));      \
    }

DEFINE_SUMSQ_CHUNK(float, f32)
DEFINE_SUMSQ_CHUNK(double, f64)

ms_status ms_cpu_foreach_sumsq(ms_ctx *ctx, ms_tensor *dst, int n, const ms_tensor *const *srcs)
{
    plan pl;
    MS_TRY(plan_new(ctx, n, srcs, SUMSQ_CHUNK, &pl));
    int64_t ntask = pl.first[n];
    /* chunk partials, then the n results; f32 partials are kept exactly in f64 and added in f32 */
    size_t nbytes = (size_t)(ntask + n) * sizeof(double);
    void *mem;
    ms_status st = ms_ctx_alloc(ctx, nbytes, &mem);
    if (st != MS_OK) {
        plan_free(ctx, &pl);
        return st;
    }
    double *part = mem, *res = part + ntask;

    #pragma omp parallel for schedule(dynamic, 1) num_threads(plan_threads(ctx, &pl, MS_CPU_PAR_MIN))
    for (int64_t t = 0; t < ntask; t++) {
        int i = plan_member(&pl, t);
        int64_t k0 = (t - pl.first[i]) * SUMSQ_CHUNK, numel = ms_tensor_numel(srcs[i]);
        int64_t m = numel - k0 < SUMSQ_CHUNK ? numel - k0 : SUMSQ_CHUNK;
        ms_cpu_view v;
        ms_cpu_view_of(&v, srcs[i]);
        if (v.dtype == MS_DTYPE_F64) {
            double buf[SUMSQ_CHUNK];
            part[t] = sumsq_chunk_f64(ms_cpu_load_f64(&v, k0, m, buf), m);
        } else {
            float buf[SUMSQ_CHUNK];
            part[t] = sumsq_chunk_f32(ms_cpu_load_f32(&v, k0, m, buf), m);
        }
    }
    for (int i = 0; i < n; i++) {
        int64_t c0 = pl.first[i], c1 = pl.first[i + 1];
        if (c0 == c1) {
            res[i] = 0;
        } else if (srcs[i]->dtype == MS_DTYPE_F64) {
            double acc = part[c0];
            for (int64_t c = c0 + 1; c < c1; c++) acc = acc + part[c];
            res[i] = acc;
        } else {
            float acc = (float)part[c0];
            for (int64_t c = c0 + 1; c < c1; c++) acc = acc + (float)part[c];
            res[i] = acc;
        }
    }
    ms_cpu_view dv;
    ms_cpu_view_of(&dv, dst);
    ms_cpu_store_f64(&dv, 0, n, res);
    ms_ctx_dealloc(ctx, part, nbytes);
    plan_free(ctx, &pl);
    return MS_OK;
}

typedef struct scale_call {
    ms_tensor *const *tensors;
    double            s;
} scale_call;

static void scale_block(const void *call, int i, int64_t e0, int64_t len)
{
    const scale_call *c = call;
    ms_cpu_view v;
    ms_cpu_view_of(&v, c->tensors[i]);
    if (v.dtype == MS_DTYPE_F64) {
        double buf[BLOCK], *d = inplace_f64(&v, e0, len, buf);
        for (int64_t j = 0; j < len; j++) d[j] = d[j] * c->s;
        if (d == buf) ms_cpu_store_f64(&v, e0, len, buf);
    } else {
        float buf[BLOCK], *d = inplace_f32(&v, e0, len, buf), fs = (float)c->s;
        for (int64_t j = 0; j < len; j++) d[j] = d[j] * fs;
        if (d == buf) ms_cpu_store_f32(&v, e0, len, buf);
    }
}

ms_status ms_cpu_foreach_scale(ms_ctx *ctx, int n, ms_tensor *const *tensors, ms_scalar s)
{
    scale_call c = { .tensors = tensors, .s = ms_cpu_read_scalar(&s) };
    return for_blocks(ctx, n, (const ms_tensor *const *)tensors, MS_CPU_PAR_MIN, scale_block, &c);
}

/* --- the rounding of params, for the fused steps of other files (cpu.h) ------------------------------ */

ms_cpu_rounding ms_cpu_rounding_of(bool stochastic, uint64_t seed, double step)
{
    return rounding_of(stochastic, seed, step);
}

void ms_cpu_store_param_f32(const ms_cpu_view *pv, const ms_cpu_rounding *r, const ms_rng_map *map, int64_t e0,
                            int64_t n, const float *x)
{
    store_param_f32(pv, r, map, e0, n, x);
}

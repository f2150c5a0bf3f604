/*
** CPU reference of Shampoo on stacked blocks (moonstep.h, "Shampoo on stacked blocks (DASH)"; research/dash.md):
** gather / apply between parameters and [N, r, c] stacks, DASH's grafting state, inverse p-th roots (EVD on
** LAPACKE ssyevd, coupled Newton, Newton-Denman-Beavers, Chebyshev by Clenshaw) and spectrum estimates.
** Blocks run in parallel on OpenMP threads, each product of a block is one single-threaded OpenBLAS sgemm
** (a lone block keeps OpenBLAS's own threads).  16-bit matmul_dtype is emulated by rounding the operands.
**
** Resolution floors (moonstep.h points here), measured with tests/dash_floors.lua on this implementation (f32,
** b = 64, A = Q diag(l) Q^T with 63 eigenvalues log-uniform in [0.1, 1] and one, y s, swept down in steps of
** 10^(1/16), s = ||A||_F): the smallest normalized eigenvalue y at which X / ||X||_F stays within 1e-4 of the
** exact normalized root (f64 eigendecomposition), with DASH's defaults (10 Newton steps, degree 60):
**     method      p = 2     p = 4     scalar iteration in f64 (p = 2 / p = 4)
**     NDB         3.2e-3    2.4e-3    3.1e-3 / 2.9e-3; each further step lowers it ~2.25x
**     CN          2.1e-3    4.9e-4    2.1e-3 / 5.7e-4
**     Chebyshev   6.5e-3    5.6e-3    lo = 25 / d^2 = 6.9e-3, the interval's lower end
**     EVD         6.5e-5    6.5e-5    f32 eigenvalues are accurate to ~1e-7 lambda_max (ssyevd)
** (within 1e-3 instead: NDB 2.1e-3 / 1.5e-3, CN 1.3e-3 / 3.2e-4, Chebyshev 5.6e-3 / 4.2e-3, EVD 1.2e-6 / 4.9e-6.)
** Below its floor CN, Chebyshev and NDB's root 2 under-invert: their root of y is smaller than y^(-1/p), never
** larger, never NaN (the Newton maps rise monotonically towards y^(-1/p); Chebyshev's polynomial extrapolates
** below lo monotonically, to about 1.6 lo^(-1/p) at y = 0).  NDB's root 4 chains the first square root, too
** small there, into the second chain's inverse square root, which resolves it: the root is too large, by up to
** 2.2x near y = 1e-5 (scalar: 1.01x at 1e-3, 1.37x at 1e-4, 2.15x at 1e-5, 1.73x at 1e-6, 0.58x at 1e-8).  EVD below its floor works on eigenvalues that are noise
** of ~1e-7 lambda_max, so its root there can be too large as well as too small; evd_shift keeps every
** eigenvalue >= eps, so X stays <= eps^(-1/p).
**
** EVD runs ssyevd from several OpenMP threads at once.  A block whose eigendecomposition failed or whose root
** came out non-finite there is done again alone after the parallel part, before anything is written or
** refused: once on a 16-core host the CPU root of a well-conditioned block came out NaN and was never seen again
** (OpenBLAS has had races between concurrent LAPACK and BLAS calls), and a block that is really at fault fails
** or comes out the same the second time.  MOONSTEP_TEST_EVD_REDO=k makes block k take that path (the specs).
*/
#include "cpu.h"

#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define TWO_PI 6.283185307179586476925286766559
#define SCALE_MIN 0x1p-126           /* the smallest scale s (an all-zero block stays finite) */
#define SKETCH_VECTORS 4
#define PI_MAX_VECTORS 64
#define OFFSET_ROOT_PI ((uint64_t)1 << 32)   /* Philox offsets of moonstep.h ("Random vectors") */
#define OFFSET_SKETCH ((uint64_t)1 << 62)
/* An NDB iterate Z Y has eigenvalues in (0, 1] while it converges (CN's M: in (0, (p + 1) / 2]); a negative
** eigenvalue of A_reg (rounding noise of a singular factor with eps = 0) sends one below 0, from where it grows
** ~2.25x per step until it overflows: such a block stops (moonstep.h) once max |Z Y - I| > 2 (|M - I| > p + 1). */
#define NDB_DIVERGED 2.0f

/* --- small helpers ----------------------------------------------------------------------------------- */

static double read_step(double step, const ms_tensor *step_t)
{
    return rint(ms_cpu_read_scalar(&(ms_scalar){ step, step_t }));
}

static bool skipped(const ms_tensor *skip_t)
{
    return skip_t != NULL && ms_cpu_read_scalar(&(ms_scalar){ 0, skip_t }) != 0;   /* NaN skips too */
}

static void matrix_dims(const ms_tensor *t, int64_t *rows, int64_t *cols)
{
    if (t->ndim == 0) { *rows = 1; *cols = 1; return; }
    *rows = t->shape[0];
    int64_t c = 1;
    for (int d = 1; d < t->ndim; d++) c *= t->shape[d];
    *cols = c;
}

/* Stack operations move a few bytes per element: below this many a single thread is faster than waking a team
** (and a team woken between OpenBLAS calls competes with OpenBLAS's spinning threads for the cores). */
#define STACK_PAR_MIN ((int64_t)1 << 20)

static int threads_for(const ms_ctx *ctx, int64_t work, int64_t units)
{
    if (work < STACK_PAR_MIN || units < 2) return 1;
    int nt = ms_cpu_threads(ctx);
    return units < nt ? (int)units : nt;
}

/* Whether a stack is solved block by block, each block's products and LAPACK calls on one OpenBLAS thread (several
** blocks and enough work: threads_for's test without the context's count), and then OpenBLAS put on one thread;
** returns the count to restore after the region (0: none).  Otherwise OpenBLAS keeps its threads (a lone block,
** little work: threads_for gives 1 then, whatever the context runs).  OpenBLAS splits its work differently on
** more threads and rounds differently (ssyevd, the solvers' GEMMs), so this choice must not follow the
** context's thread count: it did (a context of 1 thread left OpenBLAS its threads), and a DASH run resumed under
** another --threads did not continue the same run.  Now a stack gives the same bits under any count. */
static int blas_one_thread(int64_t work, int64_t units)
{
    if (work < STACK_PAR_MIN || units < 2) return 0;
    int saved = openblas_get_num_threads();
    if (saved > 1) openblas_set_num_threads(1);
    return saved > 1 ? saved : 0;
}

/* The f32 normals of ms_rand (MS_RAND_NORMAL, a = 0, b = 1) for a [rows, cols] tensor with key seed and
** offset `offset` (moonstep.h, "Random vectors"). */
static void philox_normals(float *out, int64_t count, uint64_t seed, uint64_t offset)
{
    const uint32_t key[2] = { (uint32_t)seed, (uint32_t)(seed >> 32) };
    for (int64_t i = 0; i < count; i++) {
        uint64_t e = (uint64_t)i;
        uint32_t ctr[4] = { (uint32_t)e, (uint32_t)(e >> 32), (uint32_t)offset, (uint32_t)(offset >> 32) }, w[4];
        ms_cpu_philox(ctr, key, w);
        double u1 = (double)(w[0] >> 8) * 0x1p-24 + 0x1p-24, u2 = (double)(w[2] >> 8) * 0x1p-24;
        out[i] = (float)(sqrt(-2.0 * log(u1)) * cos(TWO_PI * u2));
    }
}

/* Block k's part of a Philox offset (moonstep.h, "Random vectors"): its id when the call gives rng_ids, else k. */
static uint64_t rng_slot(const ms_tensor *rng_ids, int64_t k)
{
    if (rng_ids == NULL) return (uint64_t)k;
    return (uint32_t)((const int32_t *)ms_tensor_ptr(rng_ids))[k];
}

static float round16(float x, ms_dtype dt)
{
    return dt == MS_DTYPE_BF16 ? ms_bf16_to_f32(ms_f32_to_bf16(x)) : ms_f16_to_f32(ms_f32_to_f16(x));
}

/* src rounded to dt's precision in dst (n values); f32: src itself. */
static const float *rounded(float *dst, const float *src, int64_t n, ms_dtype dt)
{
    if (dt == MS_DTYPE_F32) return src;
    for (int64_t i = 0; i < n; i++) dst[i] = round16(src[i], dt);
    return dst;
}

/* --- gather and apply --------------------------------------------------------------------------------- */

ms_status ms_cpu_blocks_gather(ms_ctx *ctx, ms_tensor *stack, int n, const ms_block *blocks)
{
    const int64_t r = stack->shape[1], c = stack->shape[2], rows_total = (int64_t)n * r;
    float *dst = ms_tensor_ptr(stack);
    #pragma omp parallel for schedule(static) num_threads(threads_for(ctx, rows_total * c, rows_total))
    for (int64_t q = 0; q < rows_total; q++) {
        int k = (int)(q / r);
        int64_t i = q % r, rows, cols;
        const ms_block *b = &blocks[k];
        matrix_dims(b->tensor, &rows, &cols);
        ms_cpu_view v;
        ms_cpu_view_of(&v, b->tensor);
        float *row = dst + q * c;
        const float *src = ms_cpu_load_f32(&v, (b->row0 + i) * cols + b->col0, c, row);
        if (src != row) memcpy(row, src, (size_t)c * sizeof(float));
    }
    return MS_OK;
}

/* The gather, the grafting update, then the factor products exactly as the ms_matmul calls DASH made before
** this op existed (G G^T with trans_b, G^T G with trans_a): the CPU's results are those calls' to the bit. */
ms_status ms_cpu_blocks_gather_factors(ms_ctx *ctx, ms_tensor *stack, ms_tensor *left, ms_tensor *right, int n,
                                       const ms_block *blocks, const ms_dash_factor_options *o)
{
    MS_TRY(ms_cpu_blocks_gather(ctx, stack, n, blocks));
    if (o->graft) MS_TRY(ms_cpu_dash_graft(ctx, o->grad_ema, o->adam_v, o->norm, o->pgraft, stack, o->graft));
    ms_matmul_options mo = { .trans_b = 1, .alpha = o->alpha, .beta = o->beta, .allow_tf32 = o->allow_tf32 };
    MS_TRY(ms_cpu_matmul(ctx, left, stack, stack, &mo));
    if (right == NULL) return MS_OK;
    mo.trans_a = 1;
    mo.trans_b = 0;
    return ms_cpu_matmul(ctx, right, stack, stack, &mo);
}

ms_status ms_cpu_blocks_apply(ms_ctx *ctx, int n, const ms_block *blocks, const ms_tensor *stack,
                              const ms_tensor *scale, const ms_blocks_apply_options *o)
{
    if (o && skipped(o->skip_t)) return MS_OK;
    const int64_t r = stack->shape[1], c = stack->shape[2], rows_total = (int64_t)n * r;
    const float *src = ms_tensor_ptr(stack), *sc = scale ? ms_tensor_ptr(scale) : NULL;
    const int32_t *ids = o && o->rng_ids ? ms_tensor_ptr(o->rng_ids) : NULL;   /* the rounding's member words */
    double lr = 0, decay = 1;
    ms_cpu_rounding round = ms_cpu_rounding_of(false, 0, 0);
    if (o) {
        lr = ms_cpu_read_scalar(&(ms_scalar){ o->lr, o->lr_t });
        decay = 1.0 - lr * o->weight_decay;
        if (o->stochastic_round) round = ms_cpu_rounding_of(true, o->seed, read_step(o->step, o->step_t));
    }
    const float dec = (float)decay;
    #pragma omp parallel num_threads(threads_for(ctx, rows_total * c, rows_total))
    {
        float *buf = malloc((size_t)(c > 0 ? c : 1) * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < rows_total; q++) {
            if (buf == NULL) continue;
            int k = (int)(q / r);
            int64_t i = q % r, rows, cols;
            const ms_block *b = &blocks[k];
            matrix_dims(b->tensor, &rows, &cols);
            ms_cpu_view v;
            ms_cpu_view_of(&v, b->tensor);
            const float *s = src + q * c;
            double sk = sc ? sc[k] : 1.0;
            int64_t e0 = (b->row0 + i) * cols + b->col0;
            if (o) {
                const float f = (float)(lr * sk);
                const float *p = ms_cpu_load_f32(&v, e0, c, buf);
                for (int64_t j = 0; j < c; j++) buf[j] = p[j] * dec - f * s[j];
            } else {
                const float f = (float)sk;
                for (int64_t j = 0; j < c; j++) buf[j] = f * s[j];
            }
            ms_cpu_store_param_f32(&v, &round, &(ms_rng_map){ .member = (uint32_t)(ids ? ids[k] : k) }, e0, c, buf);
        }
        free(buf);
    }
    return MS_OK;
}

/* --- grafting ------------------------------------------------------------------------------------------ */

ms_status ms_cpu_dash_graft(ms_ctx *ctx, ms_tensor *grad_ema, ms_tensor *adam_v, ms_tensor *norm, ms_tensor *pgraft,
                            const ms_tensor *grad, const ms_dash_graft_options *o)
{
    if (skipped(o->skip_t)) return MS_OK;
    const int64_t n = grad->shape[0], len = grad->shape[1] * grad->shape[2];
    const double t = read_step(o->step, o->step_t);
    const bool ema = o->beta_grad > 0;
    const float b1 = (float)o->beta_grad, omb1 = (float)(1.0 - o->beta_grad);
    const float b2 = (float)o->beta_graft, omb2 = (float)(1.0 - o->beta_graft), eps = (float)o->eps;
    const float cm = o->bias_correction && ema ? (float)(1.0 - pow(o->beta_grad, t)) : 1.0f;
    const float cv = o->bias_correction ? (float)(1.0 - pow(o->beta_graft, t)) : 1.0f;
    const float *g = ms_tensor_ptr(grad);
    float *m = ms_tensor_ptr(grad_ema), *v = ms_tensor_ptr(adam_v), *nrm = ms_tensor_ptr(norm);
    float *pg = pgraft ? ms_tensor_ptr(pgraft) : NULL;
    #pragma omp parallel for schedule(static) num_threads(threads_for(ctx, n * len, n))
    for (int64_t k = 0; k < n; k++) {
        double acc = 0;
        for (int64_t e = k * len; e < (k + 1) * len; e++) {
            const float gj = g[e];
            const float mj = ema ? b1 * m[e] + omb1 * gj : gj;
            const float vj = b2 * v[e] + omb2 * gj * gj;
            m[e] = mj;
            v[e] = vj;
            const float pj = (mj / cm) / (eps + sqrtf(vj / cv));
            if (pg) pg[e] = pj;
            acc += (double)pj * pj;
        }
        nrm[k] = (float)sqrt(acc);
    }
    return MS_OK;
}

/* --- per-thread workspace of the solvers ---------------------------------------------------------------
** MATS matrices of b x b floats, the power iteration's vectors and the f64 residual's operands. */

#define MATS 10   /* m[MATS - 1] holds A_reg through a block's solve */
typedef struct work {
    int64_t b;
    float  *m[MATS];
    float  *v, *w;                /* [b, 64] */
    double *xd, *ad, *vd, *wd;    /* b x b, b x b, [b, 4], [b, 4] */
    float  *lw;                   /* LAPACK work */
    int    *liw;
    int     lwork, liwork;
} work;

static size_t work_floats(int64_t b, int lwork)
{
    return (size_t)(MATS * b * b + 2 * b * PI_MAX_VECTORS + lwork);
}

static size_t work_doubles(int64_t b) { return (size_t)(2 * b * b + 2 * b * SKETCH_VECTORS); }

static void work_bind(work *w, int64_t b, float *f, double *d, int *iw, int lwork, int liwork)
{
    w->b = b;
    for (int i = 0; i < MATS; i++) w->m[i] = f + (size_t)i * b * b;
    w->v = f + (size_t)MATS * b * b;
    w->w = w->v + b * PI_MAX_VECTORS;
    w->lw = w->w + b * PI_MAX_VECTORS;
    w->xd = d;
    w->ad = d + b * b;
    w->vd = d + 2 * b * b;
    w->wd = w->vd + b * SKETCH_VECTORS;
    w->liw = iw;
    w->lwork = lwork;
    w->liwork = liwork;
}

/* C = A B for b x b row-major matrices, operands rounded to dt (using ra / rb as room). */
static void gemm(int64_t b, const float *A, const float *B, float *C, ms_dtype dt, float *ra, float *rb)
{
    const float *a = rounded(ra, A, b * b, dt), *bb = rounded(rb, B, b * b, dt);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)b, (int)b, (int)b, 1.0f, a, (int)b, bb, (int)b,
                0.0f, C, (int)b);
}

static void set_identity(float *x, int64_t b, float d)
{
    memset(x, 0, (size_t)(b * b) * sizeof(float));
    for (int64_t i = 0; i < b; i++) x[i * b + i] = d;
}

static float max_dev_identity(const float *x, int64_t b)
{
    float worst = 0;
    for (int64_t i = 0; i < b; i++)
        for (int64_t j = 0; j < b; j++) {
            float d = fabsf(x[i * b + j] - (i == j ? 1.0f : 0.0f));
            if (!(d <= worst)) worst = d;   /* NaN wins */
        }
    return worst;
}

/* --- power iteration (moonstep.h, "Power iteration") ---------------------------------------------------
** On S + eps I with m start vectors; `room` holds a bf16 copy of the damped S when bf16 is set. */
static double power_iteration(work *w, const float *S, int m, int steps, double eps, bool bf16, uint64_t seed,
                              uint64_t offset, float *room)
{
    const int64_t b = w->b;
    float *v = w->v, *x = w->w;
    const float *s = S;
    if (bf16) {
        for (int64_t i = 0; i < b * b; i++) room[i] = S[i];
        for (int64_t i = 0; i < b; i++) room[i * b + i] = room[i * b + i] + (float)eps;
        for (int64_t i = 0; i < b * b; i++) room[i] = round16(room[i], MS_DTYPE_BF16);
        s = room;
    }
    philox_normals(v, b * m, seed, offset);
    for (int it = 0; it <= steps; it++) {
        /* normalise the columns (the start vectors, then each product) */
        for (int j = 0; j < m; j++) {
            double nn = 0;
            for (int64_t i = 0; i < b; i++) nn += (double)v[i * m + j] * v[i * m + j];
            float inv = nn > 0 ? (float)(1.0 / sqrt(nn)) : 0.0f;
            for (int64_t i = 0; i < b; i++) v[i * m + j] *= inv;
        }
        if (bf16)
            for (int64_t i = 0; i < b * m; i++) v[i] = round16(v[i], MS_DTYPE_BF16);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)b, m, (int)b, 1.0f, s, (int)b, v, m, 0.0f, x, m);
        if (!bf16 && eps != 0)
            for (int64_t i = 0; i < b * m; i++) x[i] += (float)eps * v[i];
        if (it == steps) break;
        memcpy(v, x, (size_t)(b * m) * sizeof(float));
    }
    double best = -INFINITY;
    for (int j = 0; j < m; j++) {
        double q = 0;
        for (int64_t i = 0; i < b; i++) q += (double)v[i * m + j] * x[i * m + j];
        if (q != q) return q;
        if (q > best) best = q;
    }
    return best;
}

/* --- the solvers ------------------------------------------------------------------------------------------ */

typedef struct root_call {
    const ms_root_options *o;
    int64_t b;
    int     p;
    ms_dtype mm;           /* operand precision of the products that may be 16-bit */
    const float *cheb;     /* Chebyshev coefficients c_0..c_d (f32) */
    double  cheb_lo;
} root_call;

/* s of A_reg (moonstep.h): Frobenius norm or pi_const times the power-iteration estimate, at least 2^-126. */
static double block_scale(const root_call *rc, work *w, const float *areg, int64_t k)
{
    const ms_root_options *o = rc->o;
    const int64_t b = rc->b;
    double s;
    if (o->scaling == MS_SCALING_FRO) {
        double acc = 0;
        for (int64_t i = 0; i < b * b; i++) acc += (double)areg[i] * areg[i];
        s = sqrt(acc);
    } else {
        int m = o->scaling == MS_SCALING_PIM ? o->pi_vectors : 1;
        s = o->pi_const * power_iteration(w, areg, m, o->pi_steps, o->eps_power_iter, o->pi_bf16 != 0, o->seed,
                                          rng_slot(o->rng_ids, k), w->m[0]);
    }
    if (s < SCALE_MIN) s = SCALE_MIN;   /* NaN stays NaN */
    return s;
}

/* One Newton-Denman-Beavers square-root chain on C with scale c (moonstep.h): out <- factor * (Y_T or Z_T).
** Uses m[1..8] (m[7], m[8]: 16-bit operands); returns the steps run. */
static int ndb_chain(const root_call *rc, work *w, const float *C, double c, bool want_y, double factor, float *out)
{
    const int64_t b = rc->b, bb = b * b;
    const int T = rc->o->steps;
    const double tol = rc->o->tolerance;
    float *Y = w->m[1], *Z = w->m[2], *E = w->m[3], *P = w->m[4], *Y2 = w->m[5], *Z2 = w->m[6];
    float *ra = w->m[7], *rb = w->m[8];
    const float ic = (float)(1.0 / c);
    for (int64_t i = 0; i < bb; i++) Y[i] = C[i] * ic;
    /* step 1: Z = I, so E = 1.5 I - 0.5 Y costs no product */
    for (int64_t i = 0; i < bb; i++) E[i] = -0.5f * Y[i];
    for (int64_t i = 0; i < b; i++) E[i * b + i] += 1.5f;
    int steps = 1;
    if (T == 1) {
        if (want_y) {
            gemm(b, Y, E, Y2, rc->mm, ra, rb);
            memcpy(Y, Y2, (size_t)bb * sizeof(float));
        } else {
            memcpy(Z, E, (size_t)bb * sizeof(float));
        }
    } else {
        gemm(b, Y, E, Y2, rc->mm, ra, rb);
        float *t = Y; Y = Y2; Y2 = t;
        memcpy(Z, E, (size_t)bb * sizeof(float));
        for (int k = 2; k <= T; k++) {
            gemm(b, Z, Y, P, rc->mm, ra, rb);
            float dev = max_dev_identity(P, b);
            if ((tol > 0 && dev < tol) || !(dev <= NDB_DIVERGED)) break;
            for (int64_t i = 0; i < bb; i++) E[i] = -0.5f * P[i];
            for (int64_t i = 0; i < b; i++) E[i * b + i] += 1.5f;
            bool last = k == T;
            if (!last || want_y) {
                gemm(b, Y, E, Y2, rc->mm, ra, rb);
                t = Y; Y = Y2; Y2 = t;
            }
            if (!last || !want_y) {
                gemm(b, E, Z, Z2, rc->mm, ra, rb);
                t = Z; Z = Z2; Z2 = t;
            }
            steps = k;
        }
    }
    const float *res = want_y ? Y : Z;
    const float f = (float)factor;
    for (int64_t i = 0; i < bb; i++) out[i] = res[i] * f;
    return steps;
}

/* The pointers of ndb_chain swap among m[1], m[2], m[5], m[6]: the caller's `out` must be another matrix. */
static int root_ndb(const root_call *rc, work *w, const float *areg, double s, float *x)
{
    if (rc->p == 2) return ndb_chain(rc, w, areg, s, false, 1.0 / sqrt(s), x);
    float *S = w->m[0];   /* areg lives elsewhere; m[0] is free here */
    int n1 = ndb_chain(rc, w, areg, s, true, sqrt(s), S);
    int n2 = ndb_chain(rc, w, S, sqrt(s), false, 1.0 / sqrt(sqrt(s)), x);
    return n1 + n2;
}

static int root_cn(const root_call *rc, work *w, const float *areg, double s, float *x)
{
    const int64_t b = rc->b, bb = b * b;
    const int p = rc->p, T = rc->o->steps;
    const double tol = rc->o->tolerance, z = (p + 1) / (2.0 * s);
    float *X = w->m[0], *M = w->m[1], *N = w->m[2], *N2 = w->m[3], *T1 = w->m[4], *T2 = w->m[5];
    float *ra = w->m[6], *rb = w->m[7];
    set_identity(X, b, (float)pow(z, 1.0 / p));
    const float zf = (float)z, ip = 1.0f / (float)p, pp1 = (float)(p + 1);
    for (int64_t i = 0; i < bb; i++) M[i] = zf * areg[i];
    int it = 0;
    while (it < T) {
        for (int64_t i = 0; i < bb; i++) N[i] = -M[i] * ip;
        for (int64_t i = 0; i < b; i++) N[i * b + i] = (pp1 - M[i * b + i]) * ip;
        gemm(b, X, N, T2, MS_DTYPE_F32, ra, rb);
        float *t = X; X = T2; T2 = t;
        if (p == 2) {
            gemm(b, N, M, T1, rc->mm, ra, rb);
            gemm(b, N, T1, M, rc->mm, ra, rb);
        } else {
            gemm(b, N, N, N2, rc->mm, ra, rb);
            gemm(b, N2, M, T1, rc->mm, ra, rb);
            gemm(b, N2, T1, M, rc->mm, ra, rb);
        }
        /* 16-bit: M is kept in 16 bits (the next products' operand), and N and the distance come from it */
        if (rc->mm != MS_DTYPE_F32)
            for (int64_t i = 0; i < bb; i++) M[i] = round16(M[i], rc->mm);
        it++;
        float dev = max_dev_identity(M, b);
        if ((tol > 0 && dev < tol) || !(dev <= (float)(p + 1))) break;
    }
    memcpy(x, X, (size_t)bb * sizeof(float));
    return it;
}

static int root_chebyshev(const root_call *rc, work *w, const float *areg, double s, float *x)
{
    const int64_t b = rc->b, bb = b * b;
    const int d = rc->o->steps;
    const double lo = rc->cheb_lo;
    const float *c = rc->cheb;
    float *Tm = w->m[0], *B1 = w->m[1], *B2 = w->m[2], *P = w->m[3], *ra = w->m[4], *rb = w->m[5];
    /* T = (2 A_reg / s - (1 + lo) I) / (1 - lo): eigenvalues y in [lo, 1] map to [-1, 1] */
    const float a2 = (float)(2.0 / (s * (1.0 - lo))), sh = (float)((1.0 + lo) / (1.0 - lo));
    for (int64_t i = 0; i < bb; i++) Tm[i] = a2 * areg[i];
    for (int64_t i = 0; i < b; i++) Tm[i * b + i] -= sh;
    /* b_d = c_d I, b_(d+1) = 0; b_(d-1) = 2 c_d T + c_(d-1) I needs no product */
    for (int64_t i = 0; i < bb; i++) B1[i] = 2.0f * c[d] * Tm[i];
    for (int64_t i = 0; i < b; i++) B1[i * b + i] += c[d - 1];
    set_identity(B2, b, c[d]);
    for (int k = d - 2; k >= 1; k--) {
        gemm(b, Tm, B1, P, rc->mm, ra, rb);
        for (int64_t i = 0; i < bb; i++) B2[i] = 2.0f * P[i] - B2[i];   /* b_k into b_(k+2)'s room */
        for (int64_t i = 0; i < b; i++) B2[i * b + i] += c[k];
        float *t = B1; B1 = B2; B2 = t;
    }
    gemm(b, Tm, B1, P, rc->mm, ra, rb);
    const float f = (float)pow(s, -1.0 / rc->p);
    for (int64_t i = 0; i < bb; i++) x[i] = (P[i] - B2[i]) * f;
    for (int64_t i = 0; i < b; i++) x[i * b + i] += c[0] * f;
    return d;
}

static bool all_finite(const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}

/* X = Q diag(l^(-1/p)) Q^T from ssyevd on A_reg (moonstep.h); LAPACK's info when it fails. */
static int root_evd(const root_call *rc, work *w, const float *areg, float *x)
{
    const int64_t b = rc->b, bb = b * b;
    float *q = w->m[1], *scaled = w->m[2], *l = w->v;
    memcpy(q, areg, (size_t)bb * sizeof(float));   /* symmetric: row- and column-major alike */
    int info = LAPACKE_ssyevd_work(LAPACK_COL_MAJOR, 'V', 'L', (int)b, q, (int)b, l, w->lw, w->lwork, w->liw,
                                   w->liwork);
    if (info != 0) return info;
    const double eps = rc->o->eps, shift = rc->o->evd_shift ? eps - fmin((double)l[0], 0.0) : 0.0;
    /* q read row-major is Q^T: row j is eigenvector j */
    for (int64_t j = 0; j < b; j++) {
        double lj = (double)l[j] + shift;
        float f = lj > 0 ? (float)pow(lj, -1.0 / rc->p) : 0.0f;
        for (int64_t i = 0; i < b; i++) scaled[j * b + i] = q[j * b + i] * f;
    }
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)b, (int)b, (int)b, 1.0f, q, (int)b, scaled, (int)b,
                0.0f, x, (int)b);
    return 0;
}

/* ||X^p A_reg V - V||_F / ||V||_F in f64 for the [b, 4] sketch of block k. */
static float block_residual(const root_call *rc, work *w, const float *a, const float *x, int64_t k)
{
    const int64_t b = rc->b, bb = b * b, m = SKETCH_VECTORS;
    const double eps = rc->o->eps;
    for (int64_t i = 0; i < bb; i++) w->ad[i] = a[i], w->xd[i] = x[i];
    for (int64_t i = 0; i < b; i++) w->ad[i * b + i] += eps;
    float *vf = w->v;
    philox_normals(vf, b * m, rc->o->seed, OFFSET_SKETCH + rng_slot(rc->o->rng_ids, k));
    double *v = w->vd, *t = w->wd, vv = 0;
    for (int64_t i = 0; i < b * m; i++) v[i] = vf[i], vv += v[i] * v[i];
    double *cur = t, *nxt = w->vd;   /* after the first product the two sketch buffers ping-pong (vf keeps V) */
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)b, (int)m, (int)b, 1.0, w->ad, (int)b, v, (int)m, 0.0,
                cur, (int)m);
    for (int r = 0; r < rc->p; r++) {
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)b, (int)m, (int)b, 1.0, w->xd, (int)b, cur,
                    (int)m, 0.0, nxt, (int)m);
        double *s = cur; cur = nxt; nxt = s;
    }
    double rr = 0;
    for (int64_t i = 0; i < b * m; i++) {
        double d = cur[i] - (double)vf[i];
        rr += d * d;
    }
    return vv > 0 ? (float)sqrt(rr / vv) : 0.0f;
}

/* The Chebyshev coefficients of moonstep.h: interpolation of y^(-1/p) at d + 1 Chebyshev points of [lo, 1]. */
static void chebyshev_coefficients(float *c, int d, int p, double lo)
{
    const int K = d + 1;
    double *f = malloc((size_t)K * sizeof(double));
    if (f == NULL) {   /* a degree <= 10000 needs 80 kB: compute the values on the fly instead */
        for (int k = 0; k <= d; k++) {
            double acc = 0;
            for (int j = 0; j < K; j++) {
                double th = M_PI * (j + 0.5) / K;
                acc += pow(lo + (cos(th) + 1) / 2 * (1 - lo), -1.0 / p) * cos(k * th);
            }
            c[k] = (float)(acc * 2.0 / K / (k == 0 ? 2 : 1));
        }
        return;
    }
    for (int j = 0; j < K; j++) f[j] = pow(lo + (cos(M_PI * (j + 0.5) / K) + 1) / 2 * (1 - lo), -1.0 / p);
    for (int k = 0; k <= d; k++) {
        double acc = 0;
        for (int j = 0; j < K; j++) acc += f[j] * cos(k * M_PI * (j + 0.5) / K);
        c[k] = (float)(acc * 2.0 / K / (k == 0 ? 2 : 1));
    }
    free(f);
}

/* --- ms_inv_root ------------------------------------------------------------------------------------------ */

/* The blocks to work on: `index` (checked: distinct, in range) or all of them. */
static ms_status block_list(ms_ctx *ctx, const ms_tensor *index, int64_t n, int64_t **out, int64_t *count)
{
    int64_t kc = index ? index->shape[0] : n;
    int64_t *list = malloc((size_t)(kc > 0 ? kc : 1) * sizeof *list);
    unsigned char *seen = index ? calloc((size_t)(n > 0 ? n : 1), 1) : NULL;
    if (list == NULL || (index && seen == NULL)) {
        free(list);
        free(seen);
        return MS_FAIL(ctx, MS_E_OOM, "ms_inv_root: no host memory for a list of %lld blocks", (long long)kc);
    }
    if (index) {
        const int32_t *ix = ms_tensor_ptr(index);
        for (int64_t q = 0; q < kc; q++) {
            int64_t k = ix[q];
            if (k < 0 || k >= n) {
                free(list);
                free(seen);
                return MS_FAIL(ctx, MS_E_ARG, "ms_inv_root: index[%lld] = %lld is outside [0, %lld)", (long long)q,
                               (long long)k, (long long)n);
            }
            if (seen[k]) {
                free(list);
                free(seen);
                return MS_FAIL(ctx, MS_E_ARG, "ms_inv_root: index holds block %lld twice (entry %lld)", (long long)k,
                               (long long)q);
            }
            seen[k] = 1;
            list[q] = k;
        }
    } else {
        for (int64_t q = 0; q < kc; q++) list[q] = q;
    }
    free(seen);
    *out = list;
    *count = kc;
    return MS_OK;
}

ms_status ms_cpu_inv_root(ms_ctx *ctx, ms_tensor *x, ms_tensor *residual, ms_tensor *iters, const ms_tensor *a,
                          const ms_root_options *o)
{
    const int64_t n = a->shape[0], b = a->shape[1], bb = b * b;
    if (b > 32000) return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_inv_root: blocks of %lld exceed LAPACK's int", (long long)b);
    int64_t *list, kc;
    MS_TRY(block_list(ctx, o->index, n, &list, &kc));
    const float *A = ms_tensor_ptr(a);
    float *X = ms_tensor_ptr(x), *R = residual ? ms_tensor_ptr(residual) : NULL;
    int32_t *its_out = iters ? ms_tensor_ptr(iters) : NULL;
    const bool evd = o->method == MS_ROOT_EVD;

    /* EVD refuses what LAPACK cannot take before anything runs, and writes x only once every block succeeded */
    if (evd) {
        for (int64_t q = 0; q < kc; q++)
            for (int64_t i = 0; i < bb; i++)
                if (!isfinite(A[list[q] * bb + i])) {
                    int64_t k = list[q];
                    free(list);
                    return MS_FAIL(ctx, MS_E_NUMERIC, "ms_inv_root: block %lld has a non-finite entry (%g) at [%lld,%lld]; "
                                   "EVD cannot take it", (long long)k, A[k * bb + i], (long long)(i / b),
                                   (long long)(i % b));
                }
    }
    int lwork = 0, liwork = 0;
    if (evd) {
        float wq = 0, dummy = 0;
        int st = LAPACKE_ssyevd_work(LAPACK_COL_MAJOR, 'V', 'L', (int)b, &dummy, (int)b, &dummy, &wq, -1, &liwork, -1);
        if (st != 0) {
            free(list);
            return MS_FAIL(ctx, MS_E_BACKEND, "ms_inv_root: LAPACK ssyevd workspace query failed (info=%d)", st);
        }
        int64_t min_lwork = 1 + 6 * b + 2 * bb, min_liwork = 3 + 5 * b;
        lwork = (int)((double)wq > (double)min_lwork ? (double)wq : (double)min_lwork);
        if (liwork < min_liwork) liwork = (int)min_liwork;
    }
    root_call rc = { .o = o, .b = b, .p = o->root, .mm = o->matmul_dtype };
    float *coef = NULL;
    if (o->method == MS_ROOT_CHEBYSHEV) {
        coef = malloc((size_t)(o->steps + 1) * sizeof *coef);
        if (coef == NULL) {
            free(list);
            return MS_FAIL(ctx, MS_E_OOM, "ms_inv_root: no host memory for %d Chebyshev coefficients", o->steps + 1);
        }
        rc.cheb_lo = 25.0 / ((double)o->steps * o->steps);
        chebyshev_coefficients(coef, o->steps, o->root, rc.cheb_lo);
        rc.cheb = coef;
    }

    const int nt = threads_for(ctx, kc * bb * (b > 64 ? 64 : b), kc);
    const size_t nf = work_floats(b, lwork), nd = work_doubles(b), ni = (size_t)(liwork > 0 ? liwork : 1);
    const size_t per_thread = nf * sizeof(float) + nd * sizeof(double) + ni * sizeof(int);
    const size_t held = evd ? (size_t)(kc * bb) * sizeof(float) + (size_t)kc * (sizeof(float) + sizeof(int32_t)) : 0;
    const size_t total = (size_t)nt * per_thread + held;
    char *mem;
    ms_status st = ms_ctx_alloc(ctx, total, (void **)&mem);
    if (st != MS_OK) {
        free(list);
        free(coef);
        return st;
    }
    double *dbase = (double *)mem;                                   /* doubles first: alignment */
    float *fbase = (float *)(dbase + (size_t)nt * nd);
    float *held_x = fbase + (size_t)nt * nf, *held_r = held_x + (size_t)(kc * bb);
    int32_t *held_i = (int32_t *)(held_r + kc);
    int *ibase = (int *)(evd ? (char *)(held_i + kc) : (char *)held_x);

    /* EVD blocks to do again alone, after the parallel part (see the comment at the top) */
    unsigned char *redo = NULL;
    int64_t force_redo = -1;
    if (evd) {
        redo = calloc((size_t)kc, 1);
        if (redo == NULL) {
            ms_ctx_dealloc(ctx, mem, total);
            free(list);
            free(coef);
            return MS_FAIL(ctx, MS_E_OOM, "ms_inv_root: out of host memory");
        }
        const char *f = getenv("MOONSTEP_TEST_EVD_REDO");
        if (f != NULL && *f != '\0') force_redo = strtoll(f, NULL, 10);
    }

    /* blocks in parallel, each on one OpenBLAS thread whatever nt is; a lone block keeps OpenBLAS's threads
    ** (blas_one_thread: the same bits under any thread count) */
    const int saved_blas = blas_one_thread(kc * bb * (b > 64 ? 64 : b), kc);
    int64_t fail_q = -1;
    int fail_info = 0;
    #pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num();
        work w;
        work_bind(&w, b, fbase + (size_t)tid * nf, dbase + (size_t)tid * nd, ibase + (size_t)tid * ni, lwork, liwork);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t q = 0; q < kc; q++) {
            const int64_t k = list[q];
            const float *ak = A + k * bb;
            float *areg = w.m[MATS - 1];
            memcpy(areg, ak, (size_t)bb * sizeof(float));
            for (int64_t i = 0; i < b; i++) areg[i * b + i] += (float)o->eps;
            float *xk = evd ? held_x + q * bb : X + k * bb;
            int its = 0;
            if (evd) {
                if (root_evd(&rc, &w, areg, xk) != 0 || !all_finite(xk, bb) || k == force_redo) {
                    redo[q] = 1;
                    continue;
                }
            } else {
                double s = block_scale(&rc, &w, areg, k);
                if (o->method == MS_ROOT_NDB) its = root_ndb(&rc, &w, areg, s, xk);
                else if (o->method == MS_ROOT_CN) its = root_cn(&rc, &w, areg, s, xk);
                else its = root_chebyshev(&rc, &w, areg, s, xk);
            }
            float res = R ? block_residual(&rc, &w, ak, xk, k) : 0.0f;
            if (evd) {
                held_r[q] = res;
                held_i[q] = 0;
            } else {
                if (R) R[k] = res;
                if (its_out) its_out[k] = its;
            }
        }
    }
    /* the EVD blocks to do again, one at a time in this thread (OpenBLAS still on one thread, as the blocks beside
    ** them were: the same bits where the parallel run went right): what LAPACK says now stands */
    if (evd) {
        work w;
        work_bind(&w, b, fbase, dbase, ibase, lwork, liwork);
        for (int64_t q = 0; q < kc; q++) {
            if (!redo[q]) continue;
            const int64_t k = list[q];
            const float *ak = A + k * bb;
            float *areg = w.m[MATS - 1], *xk = held_x + q * bb;
            memcpy(areg, ak, (size_t)bb * sizeof(float));
            for (int64_t i = 0; i < b; i++) areg[i * b + i] += (float)o->eps;
            int info = root_evd(&rc, &w, areg, xk);
            if (info != 0) {
                fail_q = q;
                fail_info = info;
                break;
            }
            held_r[q] = R ? block_residual(&rc, &w, ak, xk, k) : 0.0f;
            held_i[q] = 0;
        }
    }
    free(redo);
    if (saved_blas > 0) openblas_set_num_threads(saved_blas);

    if (fail_q >= 0) {
        st = MS_FAIL(ctx, MS_E_NUMERIC, "ms_inv_root: EVD of block %lld failed (LAPACK ssyevd info=%d); nothing was "
                     "written", (long long)list[fail_q], fail_info);
    } else if (evd) {
        for (int64_t q = 0; q < kc; q++) {
            const int64_t k = list[q];
            memcpy(X + k * bb, held_x + q * bb, (size_t)bb * sizeof(float));
            if (R) R[k] = held_r[q];
            if (its_out) its_out[k] = held_i[q];
        }
    }
    ms_ctx_dealloc(ctx, mem, total);
    free(list);
    free(coef);
    return st;
}

/* --- ms_spectrum_estimate ------------------------------------------------------------------------------ */

ms_status ms_cpu_spectrum_estimate(ms_ctx *ctx, ms_tensor *lam_max, ms_tensor *lam_min, const ms_tensor *a,
                                   const ms_tensor *x_root, const ms_spectrum_options *o)
{
    const int64_t n = a->shape[0], b = a->shape[1], bb = b * b;
    const int nt = threads_for(ctx, n * bb * o->vectors, n);
    const size_t per_thread = (size_t)(bb + 2 * b * PI_MAX_VECTORS);
    const size_t total = (size_t)nt * per_thread * sizeof(float);
    float *mem;
    MS_TRY(ms_ctx_alloc(ctx, total, (void **)&mem));
    const float *A = ms_tensor_ptr(a), *XR = x_root ? ms_tensor_ptr(x_root) : NULL;
    float *lmax = ms_tensor_ptr(lam_max), *lmin = lam_min ? ms_tensor_ptr(lam_min) : NULL;
    const bool bf16 = o->bf16 != 0;
    const int saved_blas = blas_one_thread(n * bb * o->vectors, n);   /* as ms_cpu_inv_root */
    #pragma omp parallel num_threads(nt)
    {
        float *room = mem + (size_t)omp_get_thread_num() * per_thread;
        work w = { .b = b, .v = room + bb, .w = room + bb + b * PI_MAX_VECTORS };
        #pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < n; k++) {
            double q = power_iteration(&w, A + k * bb, o->vectors, o->steps, o->eps, bf16, o->seed,
                                       rng_slot(o->rng_ids, k), room);
            lmax[k] = (float)(q - o->eps);
            if (lmin) {
                double mu = power_iteration(&w, XR + k * bb, o->vectors, o->steps, 0.0, bf16, o->seed,
                                            OFFSET_ROOT_PI + rng_slot(o->rng_ids, k), room);
                lmin[k] = mu != mu ? (float)mu : mu > 0 ? (float)pow(mu, -(double)o->root) : INFINITY;
            }
        }
    }
    if (saved_blas > 0) openblas_set_num_threads(saved_blas);
    ms_ctx_dealloc(ctx, mem, total);
    return MS_OK;
}

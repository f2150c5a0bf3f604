/*
** CPU SinkGD step (ms_sinkgd_step): SR-Sinkhorn (Scetbon et al., arXiv 2502.06742, Algorithm 3) carried as the
** two scale vectors of X = diag(r) G diag(c) -- the matrix X is never written -- then the base, spectral and
** sphere updates of axolotl's SinkGD / SinkGDMD (research/sinkgd.md §2.5, §8), all in f64 and rounded once
** when p is stored.  This is the reference the CUDA kernel is tested against.
**
** Every sum has a fixed order that depends on the shape alone (a row's elements in 4 interleaved lanes, a
** column's rows in order, per-row partials added in order), so results do not depend on the thread count.
** Matrices of at least BIG elements are done one at a time with every thread (rows, or blocks of columns,
** split between threads); smaller ones are spread over threads one matrix each.  Scratch: 6m + 4n doubles
** per matrix being worked on, nothing grad-sized.  The sharded step (ms_sinkgd_step_sharded, at the end)
** runs the same pieces on a slice, with the sums that cross ranks completed by the core's exchange.
*/
#include "cpu.h"

#include <math.h>
#include <omp.h>

#define ROW_CHUNK 1024     /* elements of a row loaded and converted at once (stack buffers) */
#define COL_BLOCK 256      /* columns one task of a column pass owns */
#define BIG 32768          /* a matrix of at least this many elements gets every thread */

/* One matrix of a member: G is a 2-D strided view of the grad; p and its state are contiguous. */
typedef struct mat {
    int         member;
    uint32_t    rng_member; /* the stochastic rounding's member word: the param's origin's, else `member` */
    int64_t     b;          /* index among the member's leading dims */
    int64_t     m, n;
    ms_cpu_view g;          /* [m, n] */
    ms_cpu_view p;          /* the member's whole param; this matrix is elements [e0, e0 + m n) */
    int64_t     e0;
    float      *u;          /* [n] (spectral, sphere) or NULL */
    float      *t;          /* one radius (sphere) or NULL */
    double      eta;        /* lr * scales[member] */
} mat;

typedef struct call {
    ms_sinkgd_mode  mode;
    int             iters, sn_iters;
    ms_sinkgd_target target;
    double          eps, wd;
    uint32_t        key[2];
    ms_cpu_rounding round;
} call;

/* Scratch of one matrix: 6m + 4n doubles. */
typedef struct work {
    double *r, *c;          /* the scale vectors [m], [n] */
    double *v, *w, *u;      /* power iteration: v [m], w [n], u [n] */
    double *cn, *rm;        /* c * u [n]; rows' sums of squares of X, then r * v [m] */
    double *part;           /* per-row partial sums of the sphere projection [3m] */
} work;

static int64_t work_doubles(int64_t m, int64_t n) { return 6 * m + 4 * n; }

static work work_at(double *s, int64_t m, int64_t n)
{
    work k;
    k.r = s;
    k.c = k.r + m;
    k.v = k.c + n;
    k.w = k.v + m;
    k.u = k.w + n;
    k.cn = k.u + n;
    k.rm = k.cn + n;
    k.part = k.rm + m;
    return k;
}

/* max(x, eps) that keeps a NaN (torch's clamp_min does) */
static double clamp_min(double x, double eps) { return x < eps ? eps : x; }

/* sum_j (G_ij y_j)^2 (square) or sum_j G_ij y_j, over row i, in 4 lanes by j mod 4 */
static double row_sum(const mat *x, int64_t i, const double *y, bool square)
{
    double acc[4] = { 0, 0, 0, 0 }, buf[ROW_CHUNK];
    for (int64_t j0 = 0; j0 < x->n; j0 += ROW_CHUNK) {
        int64_t len = x->n - j0 < ROW_CHUNK ? x->n - j0 : ROW_CHUNK;
        const double *g = ms_cpu_load_f64(&x->g, i * x->n + j0, len, buf);
        const double *yy = y + j0;
        if (square)
            for (int64_t j = 0; j < len; j++) { double t = g[j] * yy[j]; acc[j & 3] += t * t; }
        else
            for (int64_t j = 0; j < len; j++) acc[j & 3] += g[j] * yy[j];
    }
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

/* out[j] = sum_i (y_i G_ij)^2 (square) or sum_i y_i G_ij for columns [j0, j0 + len), rows in order */
static void col_sums(const mat *x, int64_t j0, int64_t len, const double *y, bool square, double *out)
{
    double buf[COL_BLOCK];
    for (int64_t j = 0; j < len; j++) out[j] = 0;
    for (int64_t i = 0; i < x->m; i++) {
        const double *g = ms_cpu_load_f64(&x->g, i * x->n + j0, len, buf);
        double yi = y[i];
        if (square)
            for (int64_t j = 0; j < len; j++) { double t = yi * g[j]; out[j] += t * t; }
        else
            for (int64_t j = 0; j < len; j++) out[j] += yi * g[j];
    }
}

/* Row half-step: S_i = ||row i of G diag(c)||, r_i <- sqrt(n) r_i / max(r_i S_i, eps); S_i = 0 keeps r_i. */
static void row_step(const mat *x, work *k, double eps, int nt)
{
    const double sn = sqrt((double)x->n);
    #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t i = 0; i < x->m; i++) {
        double s2 = row_sum(x, i, k->c, true);
        if (s2 == 0) continue;
        k->r[i] = sn * k->r[i] / clamp_min(k->r[i] * sqrt(s2), eps);
    }
}

/* Column half-step: T_j = ||col j of diag(r) G||, c_j <- sqrt(m) c_j / max(c_j T_j, eps); T_j = 0 keeps c_j. */
static void col_step(const mat *x, work *k, double eps, int nt)
{
    const double sm = sqrt((double)x->m);
    int64_t nb = (x->n + COL_BLOCK - 1) / COL_BLOCK;
    #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t jb = 0; jb < nb; jb++) {
        int64_t j0 = jb * COL_BLOCK, len = x->n - j0 < COL_BLOCK ? x->n - j0 : COL_BLOCK;
        double t2[COL_BLOCK];
        col_sums(x, j0, len, k->r, true, t2);
        for (int64_t j = 0; j < len; j++) {
            if (t2[j] == 0) continue;
            double *c = &k->c[j0 + j];
            *c = sm * *c / clamp_min(*c * sqrt(t2[j]), eps);
        }
    }
}

/* v = X u = diag(r) G (c * u); returns ||X||_F^2 (rows' sums of squares, added in row order) */
static double matvec(const mat *x, work *k, int nt)
{
    for (int64_t j = 0; j < x->n; j++) k->cn[j] = k->c[j] * k->u[j];
    #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t i = 0; i < x->m; i++) {
        double ri = k->r[i];
        k->v[i] = ri * row_sum(x, i, k->cn, false);
        k->rm[i] = ri * ri * row_sum(x, i, k->c, true);
    }
    double f2 = 0;
    for (int64_t i = 0; i < x->m; i++) f2 += k->rm[i];
    return f2;
}

/* w = X^T v = diag(c) G^T (r * v) */
static void matvec_t(const mat *x, work *k, int nt)
{
    for (int64_t i = 0; i < x->m; i++) k->rm[i] = k->r[i] * k->v[i];
    int64_t nb = (x->n + COL_BLOCK - 1) / COL_BLOCK;
    #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t jb = 0; jb < nb; jb++) {
        int64_t j0 = jb * COL_BLOCK, len = x->n - j0 < COL_BLOCK ? x->n - j0 : COL_BLOCK;
        col_sums(x, j0, len, k->rm, false, k->w + j0);
        for (int64_t j = 0; j < len; j++) k->w[j0 + j] *= k->c[j0 + j];
    }
}

static double sumsq(const double *a, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += a[i] * a[i];
    return s;
}

/* u's first value when the stored one is all zeros: 2 U - 1 with U the f32 uniform of ms_rand (element j, key
** seed, offset 2^63 + b), exact in f32 and f64 */
static void u_start_at(const call *cl, int64_t b, int64_t j0, int64_t n, double *u)
{
    for (int64_t j = 0; j < n; j++) {
        uint64_t e = (uint64_t)(j0 + j);
        uint32_t ctr[4] = { (uint32_t)e, (uint32_t)(e >> 32), (uint32_t)b, 0x80000000u + (uint32_t)((uint64_t)b >> 32) },
                 w[4];
        ms_cpu_philox(ctr, cl->key, w);
        u[j] = (double)(w[0] >> 8) * 0x1p-23 - 1.0;
    }
}

static void u_start(const call *cl, const mat *x, double *u) { u_start_at(cl, x->b, 0, x->n, u); }

/* sn_iters power steps from the stored u; returns sigma and stores u.  A u (numerically) orthogonal to every
** row of X -- ||X u|| <= U_DEGENERATE ||X||_F ||u||, which a 1-row matrix meets whenever half its signs flip --
** would make sigma eps and the update 1/eps times too large: the step restarts from the start vector (once). */
#define U_DEGENERATE 1e-4
static double power_iteration(const call *cl, const mat *x, work *k, int nt)
{
    bool zero = true;
    for (int64_t j = 0; j < x->n; j++) {
        k->u[j] = x->u[j];
        zero = zero && x->u[j] == 0;
    }
    if (zero) u_start(cl, x, k->u);
    bool restarted = zero;
    double sigma = cl->eps;
    for (int s = 0; s < cl->sn_iters; s++) {
        double f2 = matvec(x, k, nt), nv = sqrt(sumsq(k->v, x->m));
        if (!restarted && f2 > 0 && nv <= U_DEGENERATE * sqrt(f2) * sqrt(sumsq(k->u, x->n))) {
            u_start(cl, x, k->u);
            restarted = true;
            matvec(x, k, nt);
            nv = sqrt(sumsq(k->v, x->m));
        }
        nv = clamp_min(nv, cl->eps);
        for (int64_t i = 0; i < x->m; i++) k->v[i] /= nv;
        matvec_t(x, k, nt);
        double nw = sqrt(sumsq(k->w, x->n));
        sigma = clamp_min(nw, cl->eps);
        if (nw == 0) continue;   /* X^T v = 0: keep u, so no later step starts from a zero vector */
        for (int64_t j = 0; j < x->n; j++) k->u[j] = k->w[j] / sigma;
    }
    for (int64_t j = 0; j < x->n; j++) x->u[j] = (float)k->u[j];
    return sigma;
}

/* The sphere projection's sums over the matrix: s0 = sum W^2, s1 = sum W X, s2 = sum X^2 (per row, then in
** row order). */
static void sphere_sums(const mat *x, work *k, int nt, double s[3])
{
    #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t i = 0; i < x->m; i++) {
        double gb[ROW_CHUNK], pb[ROW_CHUNK], a0 = 0, a1 = 0, a2 = 0, ri = k->r[i];
        for (int64_t j0 = 0; j0 < x->n; j0 += ROW_CHUNK) {
            int64_t len = x->n - j0 < ROW_CHUNK ? x->n - j0 : ROW_CHUNK;
            const double *g = ms_cpu_load_f64(&x->g, i * x->n + j0, len, gb);
            const double *w = ms_cpu_load_f64(&x->p, x->e0 + i * x->n + j0, len, pb);
            for (int64_t j = 0; j < len; j++) {
                double u = ri * g[j] * k->c[j0 + j];
                a0 += w[j] * w[j];
                a1 += w[j] * u;
                a2 += u * u;
            }
        }
        k->part[3 * i] = a0;
        k->part[3 * i + 1] = a1;
        k->part[3 * i + 2] = a2;
    }
    s[0] = s[1] = s[2] = 0;
    for (int64_t i = 0; i < x->m; i++) {
        s[0] += k->part[3 * i];
        s[1] += k->part[3 * i + 1];
        s[2] += k->part[3 * i + 2];
    }
}

/* p <- (p * dec - coef * X) * fac, rounded once (through f32, as every f64 -> bf16/f16 store) */
static void apply(const call *cl, const mat *x, const work *k, double dec, double coef, double fac, int nt)
{
    #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t i = 0; i < x->m; i++) {
        double gb[ROW_CHUNK], pb[ROW_CHUNK], ri = k->r[i];
        float out[ROW_CHUNK];
        for (int64_t j0 = 0; j0 < x->n; j0 += ROW_CHUNK) {
            int64_t len = x->n - j0 < ROW_CHUNK ? x->n - j0 : ROW_CHUNK, e = x->e0 + i * x->n + j0;
            const double *g = ms_cpu_load_f64(&x->g, i * x->n + j0, len, gb);
            const double *w = ms_cpu_load_f64(&x->p, e, len, pb);
            for (int64_t j = 0; j < len; j++) out[j] = (float)((w[j] * dec - coef * (ri * g[j] * k->c[j0 + j])) * fac);
            ms_cpu_store_param_f32(&x->p, &cl->round, &(ms_rng_map){ .member = x->rng_member }, e, len, out);
        }
    }
}

static void run_matrix(const call *cl, const mat *x, double *scratch, int nt)
{
    work k = work_at(scratch, x->m, x->n);
    for (int64_t i = 0; i < x->m; i++) k.r[i] = 1;
    for (int64_t j = 0; j < x->n; j++) k.c[j] = 1;
    for (int l = 0; l < cl->iters; l++) {
        row_step(x, &k, cl->eps, nt);
        col_step(x, &k, cl->eps, nt);
    }
    if (cl->mode == MS_SINKGD_BASE) {
        apply(cl, x, &k, 1.0 - x->eta * cl->wd, x->eta, 1.0, nt);
        return;
    }
    double sigma = power_iteration(cl, x, &k, nt);
    if (cl->mode == MS_SINKGD_SPECTRAL) {
        double tau = cl->target == MS_SINKGD_TARGET_MUON ? sqrt((double)x->m / (double)x->n) : 1.0;
        apply(cl, x, &k, 1.0 - x->eta * cl->wd, x->eta * tau / sigma, 1.0, nt);
        return;
    }
    double s[3];
    sphere_sums(x, &k, nt, s);
    double t = *x->t;
    if (t < 0) {   /* not captured yet */
        *x->t = (float)sqrt(s[0]);
        t = *x->t;
    }
    double a = x->eta * t / sigma;
    double f = sqrt(clamp_min(s[0] - 2 * a * s[1] + a * a * s[2], cl->eps));
    apply(cl, x, &k, 1.0, a, t / f, nt);
}

/* The call's settings from the options, with the step read from its scalar (lr: *lr). */
static call call_of(const ms_sinkgd_options *o, double *lr)
{
    *lr = ms_cpu_read_scalar(&(ms_scalar){ o->lr, o->lr_t });
    double step = rint(ms_cpu_read_scalar(&(ms_scalar){ o->step, o->step_t }));
    return (call){
        .mode = o->mode, .iters = o->iters, .sn_iters = o->sn_iters, .target = o->target, .eps = o->eps,
        .wd = o->weight_decay, .key = { (uint32_t)o->seed, (uint32_t)(o->seed >> 32) },
        .round = ms_cpu_rounding_of(o->stochastic_round != 0, o->seed, step),
    };
}

ms_status ms_cpu_sinkgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                             ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                             const double *scales, const ms_sinkgd_options *o)
{
    if (o->skip_t != NULL && ms_cpu_read_scalar(&(ms_scalar){ 0, o->skip_t }) != 0) return MS_OK;   /* NaN skips */
    double lr;
    call cl = call_of(o, &lr);

    /* the matrices, the big ones first (in call order), and the scratch they need */
    int64_t count = 0;
    for (int i = 0; i < n; i++) {
        const ms_tensor *p = params[i];
        if (ms_tensor_numel(p) > 0) count += ms_tensor_numel(p) / (p->shape[p->ndim - 2] * p->shape[p->ndim - 1]);
    }
    if (count == 0) return MS_OK;
    int nt = ms_cpu_threads(ctx);
    size_t mats_bytes = (size_t)count * sizeof(mat);
    mat *mats;
    MS_TRY(ms_ctx_alloc(ctx, mats_bytes, (void **)&mats));
    int64_t nbig = 0, nsmall = 0, big_need = 0, small_need = 0;
    for (int pass = 0; pass < 2; pass++) {   /* pass 0 places the big matrices, pass 1 the small ones after them */
        for (int i = 0; i < n; i++) {
            const ms_tensor *p = params[i], *g = grads[i];
            int nd = p->ndim;
            int64_t m = p->shape[nd - 2], nn = p->shape[nd - 1];
            if (m * nn == 0) continue;
            bool big = m * nn >= BIG && nt > 1;
            if (big != (pass == 0)) continue;
            int64_t B = ms_tensor_numel(p) / (m * nn), need = work_doubles(m, nn);
            for (int64_t b = 0; b < B; b++) {
                mat *x = &mats[big ? nbig++ : nbig + nsmall++];   /* every big one is placed before */
                x->member = i;
                x->rng_member = ms_rng_map_of(p, i).member;
                x->b = b;
                x->m = m;
                x->n = nn;
                x->eta = lr * (scales ? scales[i] : 1.0);
                int64_t goff = 0, rest = b;   /* the grad's element offset of matrix b (row-major lead index) */
                for (int d = nd - 3; d >= 0; d--) {
                    goff += (rest % g->shape[d]) * g->strides[d];
                    rest /= g->shape[d];
                }
                x->g = (ms_cpu_view){ .ndim = 2, .shape = { m, nn }, .strides = { g->strides[nd - 2], g->strides[nd - 1] },
                                      .dtype = g->dtype,
                                      .base = (char *)ms_tensor_ptr(g) + goff * (int64_t)ms_dtype_size(g->dtype) };
                ms_cpu_view_of(&x->p, p);
                x->e0 = b * m * nn;
                x->u = specnorm_u ? (float *)ms_tensor_ptr(specnorm_u[i]) + b * nn : NULL;
                x->t = md_target_norm ? (float *)ms_tensor_ptr(md_target_norm[i]) + b : NULL;
            }
            if (big) big_need = need > big_need ? need : big_need;
            else small_need = need > small_need ? need : small_need;
        }
    }
    int small_threads = nsmall < nt ? (int)(nsmall > 0 ? nsmall : 1) : nt;
    size_t scratch_bytes = (size_t)(big_need + small_threads * small_need) * sizeof(double);
    double *scratch;
    ms_status st = ms_ctx_alloc(ctx, scratch_bytes, (void **)&scratch);
    if (st != MS_OK) {
        ms_ctx_dealloc(ctx, mats, mats_bytes);
        return st;
    }

    for (int64_t q = 0; q < nbig; q++) run_matrix(&cl, &mats[q], scratch, nt);
    double *small_scratch = scratch + big_need;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(small_threads) if (small_threads > 1)
    for (int64_t q = nbig; q < count; q++) {
        run_matrix(&cl, &mats[q], small_scratch + (int64_t)omp_get_thread_num() * small_need, 1);
    }
    ms_ctx_dealloc(ctx, scratch, scratch_bytes);
    ms_ctx_dealloc(ctx, mats, mats_bytes);
    return MS_OK;
}

/* --- the sharded step (ms_sinkgd_step_sharded) ------------------------------------------------------
** The same arithmetic on this rank's slice of each matrix, run in phases over all matrices of the call; between
** phases x->sum completes the sums that cross the sharded dim, one buffer (all matrices) per exchange point:
**   rows-sharded (r, v local; c, u, w the same on every rank): per Sinkhorn iteration the columns' sums of
**     squares [n]; per power step X^T v [n] with ||v||^2 and ||X||_F^2, v being normalised after the sum
**     (X^T (v / |v|) = (X^T v) / |v|, so one exchange a step); sphere s0, s1, s2.
**   cols-sharded (c, u, w local; r, v the same on every rank): per iteration the rows' sums of squares [m]; per
**     power step X u [m] with ||X||_F^2 and ||u||^2, then ||w||^2; sphere as rows.
** The half-step along the dim a rank holds whole is the plain one (row_step on a rows-sharded slice sees every
** column, so its n is the global n; likewise col_step and m).  A power step whose u restarts (or, cols-sharded,
** turns out to be all zeros) redoes its first exchange for the matrices concerned: the decision comes from
** summed values, so every rank takes it alike.  Params and state are written after the last exchange, so a
** failed exchange changes nothing; unsharded members run whole (run_matrix) at that point and exchange
** nothing.  Stochastic rounding draws with the global element index, as the unsharded step does.  Scratch:
** 6m + 4n doubles per matrix of the call (the slice's dims), all kept until the end, plus the exchange buffers. */

typedef struct smat {
    mat          x;            /* the slice: x.m, x.n local; x.u [n] (rows) or this rank's [n_local] (cols) */
    ms_shard_dim dim;
    int64_t      gm, gn;       /* the global matrix's dims */
    int64_t      off;          /* the slice's first global row (rows) or column (cols) */
    int64_t      slot_sq;      /* in sq_rows (cols-sharded) or sq_cols (rows-sharded) */
    int64_t      slot_p, slot_w, slot_s;
    double      *scratch;      /* work_doubles(x.m, x.n), kept across the phases */
    work         k;
    double       sigma;
    bool         restarted, redo;
} smat;

typedef struct sharded {
    const call        *cl;
    const ms_exchange *x;
    smat              *mats;
    int64_t            count, nbig;
    int                nt, small_threads;
    bool               redo_round;
    /* the exchange buffers and their lengths */
    double            *sq_rows, *sq_cols, *pw, *wsq, *sph;
    int64_t            n_rows, n_cols, n_pw, n_wsq, n_sph;
} sharded;

typedef void (*phase)(const sharded *S, smat *s, int nt);

/* fn on every matrix: the big ones one at a time with every thread, the small ones spread over threads */
static void each(const sharded *S, phase fn)
{
    for (int64_t q = 0; q < S->nbig; q++) fn(S, &S->mats[q], S->nt);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(S->small_threads) if (S->small_threads > 1)
    for (int64_t q = S->nbig; q < S->count; q++) fn(S, &S->mats[q], 1);
}

static ms_status exchange(const sharded *S, double *buf, int64_t len)
{
    return len > 0 ? S->x->sum(S->x->user, buf, len, MS_DTYPE_F64) : MS_OK;
}

/* scale_i <- target scale_i / max(scale_i sqrt(sq_i), eps), a zero sum keeping its scale (as row_step) */
static void rescale(double *scale, const double *sq, int64_t len, double target, double eps)
{
    for (int64_t i = 0; i < len; i++)
        if (sq[i] != 0) scale[i] = target * scale[i] / clamp_min(scale[i] * sqrt(sq[i]), eps);
}

/* Sinkhorn, rows: rows-sharded slices hold whole rows; cols-sharded ones send their partial sums */
static void ph_rows(const sharded *S, smat *s, int nt)
{
    const mat *x = &s->x;
    if (s->dim == MS_SHARD_ROWS) {
        row_step(x, &s->k, S->cl->eps, nt);
    } else if (s->dim == MS_SHARD_COLS) {
        double *out = S->sq_rows + s->slot_sq;
        #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
        for (int64_t i = 0; i < x->m; i++) out[i] = row_sum(x, i, s->k.c, true);
    }
}

/* Sinkhorn, columns: cols-sharded slices finish their rows and hold whole columns; rows-sharded ones send */
static void ph_cols(const sharded *S, smat *s, int nt)
{
    const mat *x = &s->x;
    if (s->dim == MS_SHARD_COLS) {
        rescale(s->k.r, S->sq_rows + s->slot_sq, x->m, sqrt((double)s->gn), S->cl->eps);
        col_step(x, &s->k, S->cl->eps, nt);
    } else if (s->dim == MS_SHARD_ROWS) {
        double *out = S->sq_cols + s->slot_sq;
        int64_t nb = (x->n + COL_BLOCK - 1) / COL_BLOCK;
        #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
        for (int64_t jb = 0; jb < nb; jb++) {
            int64_t j0 = jb * COL_BLOCK, len = x->n - j0 < COL_BLOCK ? x->n - j0 : COL_BLOCK;
            col_sums(x, j0, len, s->k.r, true, out + j0);
        }
    }
}

static void ph_cols_done(const sharded *S, smat *s, int nt)
{
    (void)nt;
    if (s->dim == MS_SHARD_ROWS) rescale(s->k.c, S->sq_cols + s->slot_sq, s->x.n, sqrt((double)s->gm), S->cl->eps);
}

/* u from the stored value; a rows-sharded u is whole here, so an all-zero one is seen (and restarted) now */
static void ph_u_load(const sharded *S, smat *s, int nt)
{
    (void)nt;
    if (s->dim == MS_SHARD_NONE) return;
    bool zero = true;
    for (int64_t j = 0; j < s->x.n; j++) {
        s->k.u[j] = s->x.u[j];
        zero = zero && s->x.u[j] == 0;
    }
    s->restarted = false;
    if (zero && s->dim == MS_SHARD_ROWS) {
        u_start_at(S->cl, s->x.b, 0, s->x.n, s->k.u);
        s->restarted = true;
    }
}

/* A power step's first half: v = X u and the partials.  rows: [X^T v (n), ||v||^2, ||X||_F^2];
** cols: [X u (m), ||X||_F^2, ||u||^2].  In a redo round the matrices not redone send zeros. */
static void ph_power_send(const sharded *S, smat *s, int nt)
{
    if (s->dim == MS_SHARD_NONE) return;
    const mat *x = &s->x;
    work *k = &s->k;
    double *out = S->pw + s->slot_p;
    int64_t len = (s->dim == MS_SHARD_ROWS ? s->gn : s->gm) + 2;
    if (S->redo_round && !s->redo) {
        for (int64_t q = 0; q < len; q++) out[q] = 0;
        return;
    }
    double f2 = matvec(x, k, nt);
    if (s->dim == MS_SHARD_ROWS) {
        matvec_t(x, k, nt);   /* with the raw v: divided by the summed |v| on arrival */
        for (int64_t j = 0; j < x->n; j++) out[j] = k->w[j];
        out[x->n] = sumsq(k->v, x->m);
        out[x->n + 1] = f2;
    } else {
        for (int64_t i = 0; i < x->m; i++) out[i] = k->v[i];
        out[x->m] = f2;
        out[x->m + 1] = sumsq(k->u, x->n);
    }
}

/* The sums have come: decide a restart (once per step, as power_iteration does), else finish the step --
** rows: w, sigma and u; cols: v normalised, w = X^T v on this rank's columns and its ||w||^2 partial. */
static void ph_power_recv(const sharded *S, smat *s, int nt)
{
    if (s->dim == MS_SHARD_NONE || (S->redo_round && !s->redo)) return;
    const call *cl = S->cl;
    const mat *x = &s->x;
    work *k = &s->k;
    const double *in = S->pw + s->slot_p;
    double nv, f2, u2;
    if (s->dim == MS_SHARD_ROWS) {
        nv = sqrt(in[x->n]);
        f2 = in[x->n + 1];
        u2 = sumsq(k->u, x->n);
    } else {
        for (int64_t i = 0; i < x->m; i++) k->v[i] = in[i];
        nv = sqrt(sumsq(k->v, x->m));
        f2 = in[x->m];
        u2 = in[x->m + 1];
    }
    if (!S->redo_round && !s->restarted &&
        (u2 == 0 || (f2 > 0 && nv <= U_DEGENERATE * sqrt(f2) * sqrt(u2)))) {
        /* (u2 == 0 reaches here only cols-sharded, where the zero u shows in the sum) */
        u_start_at(cl, x->b, s->dim == MS_SHARD_COLS ? s->off : 0, x->n, k->u);
        s->restarted = s->redo = true;
        return;
    }
    s->redo = false;
    nv = clamp_min(nv, cl->eps);
    if (s->dim == MS_SHARD_ROWS) {
        for (int64_t j = 0; j < x->n; j++) k->w[j] = in[j] / nv;
        double nw = sqrt(sumsq(k->w, x->n));
        s->sigma = clamp_min(nw, cl->eps);
        if (nw != 0)   /* X^T v = 0: keep u */
            for (int64_t j = 0; j < x->n; j++) k->u[j] = k->w[j] / s->sigma;
    } else {
        for (int64_t i = 0; i < x->m; i++) k->v[i] /= nv;
        matvec_t(x, k, nt);
        S->wsq[s->slot_w] = sumsq(k->w, x->n);
    }
}

static void ph_power_done(const sharded *S, smat *s, int nt)
{
    (void)nt;
    if (s->dim != MS_SHARD_COLS) return;
    double nw = sqrt(S->wsq[s->slot_w]);
    s->sigma = clamp_min(nw, S->cl->eps);
    if (nw != 0)
        for (int64_t j = 0; j < s->x.n; j++) s->k.u[j] = s->k.w[j] / s->sigma;
}

static void ph_sphere_send(const sharded *S, smat *s, int nt)
{
    if (s->dim != MS_SHARD_NONE) sphere_sums(&s->x, &s->k, nt, S->sph + s->slot_s);
}

/* Elements [e, e + len) of the slice's param <- out, the stochastic rounding drawn with the global index ge: the
** view is re-based so that index ge lands on local element e (its base may point before the tensor; only
** elements of the tensor are written). */
static void store_global(const call *cl, const mat *x, int64_t e, int64_t ge, int64_t len, const float *out)
{
    if (e == ge || !cl->round.stochastic) {
        ms_cpu_store_param_f32(&x->p, &cl->round, &(ms_rng_map){ .member = x->rng_member }, e, len, out);
        return;
    }
    int64_t esz = (int64_t)ms_dtype_size(x->p.dtype);
    ms_cpu_view v = { .ndim = 1, .shape = { ge + len }, .strides = { 1 }, .dtype = x->p.dtype,
                      .base = (char *)((uintptr_t)x->p.base + (uintptr_t)(e * esz) - (uintptr_t)(ge * esz)) };
    ms_cpu_store_param_f32(&v, &cl->round, &(ms_rng_map){ .member = x->rng_member }, ge, len, out);
}

/* p <- (p * dec - coef * X) * fac on the slice, as apply() */
static void apply_slice(const call *cl, const smat *s, double dec, double coef, double fac, int nt)
{
    const mat *x = &s->x;
    const work *k = &s->k;
    #pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t i = 0; i < x->m; i++) {
        double gb[ROW_CHUNK], pb[ROW_CHUNK], ri = k->r[i];
        float out[ROW_CHUNK];
        int64_t grow = s->dim == MS_SHARD_ROWS ? s->off + i : i, gcol = s->dim == MS_SHARD_COLS ? s->off : 0;
        for (int64_t j0 = 0; j0 < x->n; j0 += ROW_CHUNK) {
            int64_t len = x->n - j0 < ROW_CHUNK ? x->n - j0 : ROW_CHUNK, e = x->e0 + i * x->n + j0;
            const double *g = ms_cpu_load_f64(&x->g, i * x->n + j0, len, gb);
            const double *w = ms_cpu_load_f64(&x->p, e, len, pb);
            for (int64_t j = 0; j < len; j++) out[j] = (float)((w[j] * dec - coef * (ri * g[j] * k->c[j0 + j])) * fac);
            store_global(cl, x, e, (x->b * s->gm + grow) * s->gn + gcol + j0, len, out);
        }
    }
}

/* After the last exchange: the updates, u and t stored; unsharded matrices run whole */
static void ph_apply(const sharded *S, smat *s, int nt)
{
    const call *cl = S->cl;
    mat *x = &s->x;
    if (s->dim == MS_SHARD_NONE) {
        run_matrix(cl, x, s->scratch, nt);
        return;
    }
    if (cl->mode == MS_SINKGD_BASE) {
        apply_slice(cl, s, 1.0 - x->eta * cl->wd, x->eta, 1.0, nt);
        return;
    }
    for (int64_t j = 0; j < x->n; j++) x->u[j] = (float)s->k.u[j];
    if (cl->mode == MS_SINKGD_SPECTRAL) {
        double tau = cl->target == MS_SINKGD_TARGET_MUON ? sqrt((double)s->gm / (double)s->gn) : 1.0;
        apply_slice(cl, s, 1.0 - x->eta * cl->wd, x->eta * tau / s->sigma, 1.0, nt);
        return;
    }
    const double *sums = S->sph + s->slot_s;
    double t = *x->t;
    if (t < 0) {   /* not captured yet: the global ||p||_F */
        *x->t = (float)sqrt(sums[0]);
        t = *x->t;
    }
    double a = x->eta * t / s->sigma;
    double f = sqrt(clamp_min(sums[0] - 2 * a * sums[1] + a * a * sums[2], cl->eps));
    apply_slice(cl, s, 1.0, a, t / f, nt);
}

static bool any_redo(const sharded *S)
{
    for (int64_t q = 0; q < S->count; q++)
        if (S->mats[q].redo) return true;
    return false;
}

static ms_status run_sharded(sharded *S)
{
    const call *cl = S->cl;
    for (int l = 0; l < cl->iters; l++) {
        each(S, ph_rows);
        MS_TRY(exchange(S, S->sq_rows, S->n_rows));
        each(S, ph_cols);
        MS_TRY(exchange(S, S->sq_cols, S->n_cols));
        each(S, ph_cols_done);
    }
    if (cl->mode != MS_SINKGD_BASE) {
        each(S, ph_u_load);
        for (int step = 0; step < cl->sn_iters; step++) {
            each(S, ph_power_send);
            MS_TRY(exchange(S, S->pw, S->n_pw));
            each(S, ph_power_recv);
            if (any_redo(S)) {
                S->redo_round = true;
                each(S, ph_power_send);
                MS_TRY(exchange(S, S->pw, S->n_pw));
                each(S, ph_power_recv);
                S->redo_round = false;
            }
            MS_TRY(exchange(S, S->wsq, S->n_wsq));
            each(S, ph_power_done);
        }
    }
    if (cl->mode == MS_SINKGD_SPHERE) {
        each(S, ph_sphere_send);
        MS_TRY(exchange(S, S->sph, S->n_sph));
    }
    each(S, ph_apply);
    return MS_OK;
}

/* A member's global dims and its number of matrices (0 when the global matrix is empty) */
static int64_t member_dims(const ms_tensor *p, const ms_shard *sh, int64_t *gm, int64_t *gn)
{
    int nd = p->ndim;
    *gm = sh->dim == MS_SHARD_ROWS ? sh->global : p->shape[nd - 2];
    *gn = sh->dim == MS_SHARD_COLS ? sh->global : p->shape[nd - 1];
    if (*gm * *gn == 0) return 0;
    int64_t B = 1;
    for (int d = 0; d < nd - 2; d++) B *= p->shape[d];
    return B;
}

ms_status ms_cpu_sinkgd_step_sharded(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                                     ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                                     const double *scales, const ms_shard *shards, const ms_sinkgd_options *o,
                                     const ms_exchange *xch)
{
    if (o->skip_t != NULL && ms_cpu_read_scalar(&(ms_scalar){ 0, o->skip_t }) != 0) return MS_OK;   /* NaN skips */
    double lr;
    call cl = call_of(o, &lr);
    int nt = ms_cpu_threads(ctx);
    sharded S = { .cl = &cl, .x = xch, .nt = nt };

    /* the matrices (counted by global dims: an empty slice of a nonempty matrix still exchanges) and the
    ** exchange buffers' lengths, which depend only on the sharded members' global dims */
    int64_t scratch_doubles = 0;
    for (int i = 0; i < n; i++) {
        int64_t gm, gn, B = member_dims(params[i], &shards[i], &gm, &gn);
        const ms_tensor *p = params[i];
        S.count += B;
        scratch_doubles += B * work_doubles(p->shape[p->ndim - 2], p->shape[p->ndim - 1]);
        if (B == 0 || shards[i].dim == MS_SHARD_NONE) continue;
        if (shards[i].dim == MS_SHARD_COLS) {
            S.n_rows += B * gm;
            S.n_pw += B * (gm + 2);
            S.n_wsq += B;
        } else {
            S.n_cols += B * gn;
            S.n_pw += B * (gn + 2);
        }
        S.n_sph += 3 * B;
    }
    if (S.count == 0) return MS_OK;
    size_t mats_bytes = (size_t)S.count * sizeof(smat);
    size_t dbl_bytes = (size_t)(scratch_doubles + S.n_rows + S.n_cols + S.n_pw + S.n_wsq + S.n_sph) * sizeof(double);
    MS_TRY(ms_ctx_alloc(ctx, mats_bytes, (void **)&S.mats));
    double *dbl;
    ms_status st = ms_ctx_alloc(ctx, dbl_bytes, (void **)&dbl);
    if (st != MS_OK) {
        ms_ctx_dealloc(ctx, S.mats, mats_bytes);
        return st;
    }
    S.sq_rows = dbl + scratch_doubles;
    S.sq_cols = S.sq_rows + S.n_rows;
    S.pw = S.sq_cols + S.n_cols;
    S.wsq = S.pw + S.n_pw;
    S.sph = S.wsq + S.n_wsq;

    /* pass 0 places the big matrices, pass 1 the small ones after them; the slots go in member order whatever
    ** the pass (bigness depends on the slice, which differs between ranks; the slots must not) */
    int64_t nsmall = 0;
    double *next = dbl;
    for (int pass = 0; pass < 2; pass++) {
        int64_t at_rows = 0, at_cols = 0, at_pw = 0, at_w = 0, at_s = 0;
        for (int i = 0; i < n; i++) {
            const ms_tensor *p = params[i], *g = grads[i];
            int nd = p->ndim;
            ms_shard_dim dim = shards[i].dim;
            int64_t m = p->shape[nd - 2], nn = p->shape[nd - 1], gm, gn, B = member_dims(p, &shards[i], &gm, &gn);
            bool big = m * nn >= BIG && nt > 1;
            for (int64_t b = 0; b < B; b++) {
                int64_t slot_sq = dim == MS_SHARD_COLS ? at_rows : at_cols, slot_p = at_pw, slot_w = at_w, slot_s = at_s;
                if (dim == MS_SHARD_COLS) {
                    at_rows += gm;
                    at_pw += gm + 2;
                    at_w += 1;
                } else if (dim == MS_SHARD_ROWS) {
                    at_cols += gn;
                    at_pw += gn + 2;
                }
                if (dim != MS_SHARD_NONE) at_s += 3;
                if (big != (pass == 0)) continue;

                mat x = { .member = i, .rng_member = ms_rng_map_of(p, i).member, .b = b, .m = m, .n = nn,
                          .eta = lr * (scales ? scales[i] : 1.0), .e0 = b * m * nn };
                int64_t goff = 0, rest = b;   /* the grad's element offset of matrix b (row-major lead index) */
                for (int d = nd - 3; d >= 0 && m * nn > 0; d--) {
                    goff += (rest % g->shape[d]) * g->strides[d];
                    rest /= g->shape[d];
                }
                x.g = (ms_cpu_view){ .ndim = 2, .shape = { m, nn }, .strides = { g->strides[nd - 2], g->strides[nd - 1] },
                                     .dtype = g->dtype,
                                     .base = (char *)ms_tensor_ptr(g) + goff * (int64_t)ms_dtype_size(g->dtype) };
                ms_cpu_view_of(&x.p, p);
                x.u = specnorm_u ? (float *)ms_tensor_ptr(specnorm_u[i]) + b * nn : NULL;
                x.t = md_target_norm ? (float *)ms_tensor_ptr(md_target_norm[i]) + b : NULL;
                smat *s = &S.mats[big ? S.nbig++ : S.nbig + nsmall++];   /* every big one is placed before */
                *s = (smat){ .x = x, .dim = dim, .gm = gm, .gn = gn, .off = dim == MS_SHARD_NONE ? 0 : shards[i].offset,
                             .slot_sq = slot_sq, .slot_p = slot_p, .slot_w = slot_w, .slot_s = slot_s,
                             .scratch = next, .sigma = cl.eps };
                next += work_doubles(m, nn);
                s->k = work_at(s->scratch, m, nn);
                for (int64_t q = 0; q < m; q++) s->k.r[q] = 1;
                for (int64_t q = 0; q < nn; q++) s->k.c[q] = 1;
            }
        }
    }
    S.small_threads = nsmall < nt ? (int)(nsmall > 0 ? nsmall : 1) : nt;

    st = run_sharded(&S);
    ms_ctx_dealloc(ctx, dbl, dbl_bytes);
    ms_ctx_dealloc(ctx, S.mats, mats_bytes);
    return st;
}

/*
** CPU linear algebra: batched matmul on OpenBLAS (operands passed in place whenever their layout is one BLAS
** can read, else gathered into f32/f64 temporaries), eye, diag, and batched symmetric eigh on LAPACKE.
*/
#include "cpu.h"

#include <cblas.h>
#include <lapacke.h>
#include <limits.h>
#include <math.h>
#include <string.h>

/* --- layouts -------------------------------------------------------------------------------------- */

/* The leading dimension with which a [r, c] matrix of strides (rs, cs) reads as row-major, or -1. */
static int64_t rowmajor_ld(int64_t r, int64_t c, int64_t rs, int64_t cs)
{
    int64_t need = c > 1 ? c : 1;
    if (c > 1 && cs != 1) return -1;
    if (r <= 1) return need;
    return rs >= need ? rs : -1;
}

static int64_t colmajor_ld(int64_t r, int64_t c, int64_t rs, int64_t cs)
{
    return rowmajor_ld(c, r, cs, rs);
}

/* One matrix of a batch: logical [r, c] (after any transpose) at base. */
typedef struct matrix {
    const ms_tensor *t;
    int64_t r, c, rs, cs;
} matrix;

static matrix matrix_of(const ms_tensor *t, int trans)
{
    int nd = t->ndim;
    matrix m = { .t = t, .r = t->shape[nd - 2], .c = t->shape[nd - 1],
                 .rs = t->strides[nd - 2], .cs = t->strides[nd - 1] };
    if (trans) {
        int64_t x = m.r; m.r = m.c; m.c = x;
        x = m.rs; m.rs = m.cs; m.cs = x;
    }
    return m;
}

/* The matrix at element offset `off` of its tensor as a 2-dim view. */
static ms_cpu_view matrix_view(const matrix *m, int64_t off)
{
    ms_cpu_view v = { .ndim = 2, .shape = { m->r, m->c }, .strides = { m->rs, m->cs }, .dtype = m->t->dtype,
                      .base = (char *)ms_tensor_ptr(m->t) + off * (int64_t)ms_dtype_size(m->t->dtype) };
    return v;
}

/* Element offset of batch q of t, with t's batch dims broadcast against dst's (aligned from the right). */
static int64_t batch_offset(const ms_tensor *t, const ms_tensor *dst, int64_t q)
{
    int64_t off = 0;
    for (int d = dst->ndim - 3; d >= 0; d--) {
        int64_t idx = q % dst->shape[d];
        q /= dst->shape[d];
        int td = d - (dst->ndim - t->ndim);
        if (td >= 0 && t->shape[td] != 1) off += idx * t->strides[td];
    }
    return off;
}

/* A row-major dense copy of the matrix, converted to f32 or f64. */
static void gather(const matrix *m, int64_t off, bool dbl, void *tmp)
{
    ms_cpu_view v = matrix_view(m, off);
    int64_t n = m->r * m->c;
    const void *p = dbl ? (const void *)ms_cpu_load_f64(&v, 0, n, tmp) : (const void *)ms_cpu_load_f32(&v, 0, n, tmp);
    if (p != tmp) memcpy(tmp, p, (size_t)n * (dbl ? 8 : 4));
}

/* How one operand reaches BLAS in a given storage order: in place (ld, transposed or not) or gathered. */
typedef struct operand {
    bool direct;
    CBLAS_TRANSPOSE trans;
    int64_t ld;
} operand;

static operand plan_operand(const matrix *m, ms_dtype ct, CBLAS_ORDER order)
{
    operand p = { .direct = false, .trans = order == CblasRowMajor ? CblasNoTrans : CblasTrans,
                  .ld = m->c > 1 ? m->c : 1 };   /* gathered: dense row-major [r, c] */
    if (m->t->dtype != ct) return p;
    int64_t same = order == CblasRowMajor ? rowmajor_ld(m->r, m->c, m->rs, m->cs)
                                          : colmajor_ld(m->r, m->c, m->rs, m->cs);
    int64_t other = order == CblasRowMajor ? colmajor_ld(m->r, m->c, m->rs, m->cs)
                                           : rowmajor_ld(m->r, m->c, m->rs, m->cs);
    if (same >= 0 && same <= INT_MAX) return (operand){ true, CblasNoTrans, same };
    if (other >= 0 && other <= INT_MAX) return (operand){ true, CblasTrans, other };
    return p;
}

/* --- matmul --------------------------------------------------------------------------------------- */

ms_status ms_cpu_matmul(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                        const ms_matmul_options *o)
{
    const ms_matmul_options defaults = { .alpha = 1, .beta = 0 };
    if (!o) o = &defaults;
    const bool dbl = a->dtype == MS_DTYPE_F64;
    const ms_dtype ct = dbl ? MS_DTYPE_F64 : MS_DTYPE_F32;
    const size_t esz = dbl ? 8 : 4;
    matrix ma = matrix_of(a, o->trans_a), mb = matrix_of(b, o->trans_b), mc = matrix_of(dst, 0);
    const int64_t m = mc.r, n = mc.c, k = ma.c;
    if (m > INT_MAX || n > INT_MAX || k > INT_MAX)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "matmul: dims m=%lld n=%lld k=%lld exceed BLAS's int",
                       (long long)m, (long long)n, (long long)k);
    int64_t nbatch = 1;
    for (int d = 0; d < dst->ndim - 2; d++) nbatch *= dst->shape[d];
    if (nbatch == 0 || m == 0 || n == 0) return MS_OK;

    /* dst in place when BLAS can write it (row- or column-major), else through a dense temporary */
    CBLAS_ORDER order = CblasRowMajor;
    int64_t ldc = -1;
    if (dst->dtype == ct) {
        if ((ldc = rowmajor_ld(m, n, mc.rs, mc.cs)) < 0 && (ldc = colmajor_ld(m, n, mc.rs, mc.cs)) >= 0)
            order = CblasColMajor;
        if (ldc > INT_MAX) {   /* through the dense temporary, which is row-major */
            ldc = -1;
            order = CblasRowMajor;
        }
    }
    const bool c_direct = ldc >= 0;
    if (!c_direct) ldc = n;
    operand pa = plan_operand(&ma, ct, order), pb = plan_operand(&mb, ct, order);

    /* (m, n, k < 2^31, but the products of expanded operands' dims times 8 bytes can pass size_t) */
    size_t sa = 0, sb = 0, sc = 0, total = 0;
    if ((!pa.direct && k != 0 && __builtin_mul_overflow((size_t)(m * k), esz, &sa)) ||
        (!pb.direct && k != 0 && __builtin_mul_overflow((size_t)(k * n), esz, &sb)) ||
        (!c_direct && __builtin_mul_overflow((size_t)(m * n), esz, &sc)) ||
        __builtin_add_overflow(sa, sb, &total) || __builtin_add_overflow(total, sc, &total) || total > SIZE_MAX / 2)
        return MS_FAIL(ctx, MS_E_OOM, "matmul: the dense copies of [%lld x %lld] @ [%lld x %lld] do not fit memory",
                       (long long)m, (long long)k, (long long)k, (long long)n);
    char *mem = NULL;
    if (total) MS_TRY(ms_ctx_alloc(ctx, total, (void **)&mem));
    void *ta = mem, *tb = mem + sa, *tc = mem + sa + sb;

    int64_t last_a = -1, last_b = -1;   /* a broadcast operand is gathered once, not per batch */
    for (int64_t q = 0; q < nbatch; q++) {
        int64_t oa = batch_offset(a, dst, q), ob = batch_offset(b, dst, q), oc = batch_offset(dst, dst, q);
        ms_cpu_view cv = matrix_view(&mc, oc);
        if (k == 0) {   /* empty product: dst <- beta * dst (beta 0 ignores the old contents) */
            double buf[1024];
            for (int64_t i0 = 0; i0 < m * n; i0 += 1024) {
                int64_t len = m * n - i0 < 1024 ? m * n - i0 : 1024;
                const double *x = ms_cpu_load_f64(&cv, i0, len, buf);
                double y[1024];
                for (int64_t i = 0; i < len; i++) y[i] = o->beta == 0 ? 0 : o->beta * x[i];
                ms_cpu_store_f64(&cv, i0, len, y);
            }
            continue;
        }
        const char *pa_ptr, *pb_ptr;
        if (pa.direct) pa_ptr = (const char *)ms_tensor_ptr(a) + oa * (int64_t)esz;
        else {
            if (oa != last_a) gather(&ma, oa, dbl, ta);
            pa_ptr = ta;
            last_a = oa;
        }
        if (pb.direct) pb_ptr = (const char *)ms_tensor_ptr(b) + ob * (int64_t)esz;
        else {
            if (ob != last_b) gather(&mb, ob, dbl, tb);
            pb_ptr = tb;
            last_b = ob;
        }
        char *pc = c_direct ? cv.base : tc;
        if (!c_direct && o->beta != 0) gather(&mc, oc, dbl, tc);
        if (dbl)
            cblas_dgemm(order, pa.trans, pb.trans, (int)m, (int)n, (int)k, o->alpha, (const double *)pa_ptr,
                        (int)pa.ld, (const double *)pb_ptr, (int)pb.ld, o->beta, (double *)pc, (int)ldc);
        else
            cblas_sgemm(order, pa.trans, pb.trans, (int)m, (int)n, (int)k, (float)o->alpha, (const float *)pa_ptr,
                        (int)pa.ld, (const float *)pb_ptr, (int)pb.ld, (float)o->beta, (float *)pc, (int)ldc);
        if (!c_direct) {
            if (dbl) ms_cpu_store_f64(&cv, 0, m * n, (const double *)tc);
            else ms_cpu_store_f32(&cv, 0, m * n, (const float *)tc);
        }
    }
    if (total) ms_ctx_dealloc(ctx, mem, total);
    return MS_OK;
}

/* --- eye, diag ------------------------------------------------------------------------------------ */

/* The main diagonals of t's last two dims: a view [..., min(r, c)] stepping by both strides at once. */
static ms_cpu_view diagonal_view(const ms_tensor *t)
{
    ms_cpu_view v;
    ms_cpu_view_of(&v, t);
    int nd = t->ndim;
    v.ndim = nd - 1;
    v.shape[nd - 2] = t->shape[nd - 2] < t->shape[nd - 1] ? t->shape[nd - 2] : t->shape[nd - 1];
    v.strides[nd - 2] = t->strides[nd - 2] + t->strides[nd - 1];
    return v;
}

ms_status ms_cpu_eye(ms_ctx *ctx, ms_tensor *dst)
{
    ms_cpu_view all, diagonal = diagonal_view(dst);
    ms_cpu_view_of(&all, dst);
    ms_cpu_fill_view(ctx, &all, 0.0);
    ms_cpu_fill_view(ctx, &diagonal, 1.0);
    return MS_OK;
}

/* dst [..., n, n] <- diag(src [..., n]) when dst has one dim more, else dst [..., n] <- diagonal of src. */
ms_status ms_cpu_diag(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src)
{
    ms_cpu_view s, d;
    if (dst->ndim == src->ndim + 1) {
        ms_cpu_view_of(&d, dst);
        ms_cpu_fill_view(ctx, &d, 0.0);
        d = diagonal_view(dst);
        ms_cpu_view_of(&s, src);
    } else {
        ms_cpu_view_of(&d, dst);
        s = diagonal_view(src);
    }
    ms_cpu_copy_view(ctx, &d, &s);
    return MS_OK;
}

/* --- eigh ----------------------------------------------------------------------------------------- */

/* t's last two dims swapped: its row-major order is each matrix's column-major order (LAPACK's). */
static ms_cpu_view transposed_view(const ms_tensor *t)
{
    ms_cpu_view v;
    ms_cpu_view_of(&v, t);
    int nd = t->ndim;
    int64_t x = v.strides[nd - 1];
    v.strides[nd - 1] = v.strides[nd - 2];
    v.strides[nd - 2] = x;
    return v;
}

/* All members are solved into temporaries first, so a failure leaves w and v untouched.  Non-finite
** entries of the lower triangles are refused before LAPACK runs (its result on them is undefined); *info
** is then -5, what LAPACKE's own NaN check reports (argument 5, the matrix). */
ms_status ms_cpu_eigh(ms_ctx *ctx, ms_tensor *w, ms_tensor *v, const ms_tensor *a, int *info)
{
    if (info) *info = 0;
    const bool dbl = a->dtype == MS_DTYPE_F64;
    if (!dbl && a->dtype != MS_DTYPE_F32)
        return MS_FAIL(ctx, MS_E_DTYPE, "eigh: dtype %s (f32 or f64 only)", ms_dtype_name(a->dtype));
    const int nd = a->ndim;
    const int64_t n = a->shape[nd - 1];
    int64_t nbatch = 1;
    for (int d = 0; d < nd - 2; d++) nbatch *= a->shape[d];
    if (nbatch == 0 || n == 0) return MS_OK;
    if (n > 32000)   /* the workspace, 1 + 6n + 2n^2 elements, must fit LAPACK's int */
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "eigh: n=%lld is too large for LAPACK's int", (long long)n);
    const size_t esz = dbl ? 8 : 4;
    const char jobz = v ? 'V' : 'N';
    const int ni = (int)n;

    int lwork, liwork, st;
    {
        double wq = 0, dummy = 0;
        float wqf = 0, dummyf = 0;
        st = dbl ? LAPACKE_dsyevd_work(LAPACK_COL_MAJOR, jobz, 'L', ni, &dummy, ni, &dummy, &wq, -1, &liwork, -1)
                 : LAPACKE_ssyevd_work(LAPACK_COL_MAJOR, jobz, 'L', ni, &dummyf, ni, &dummyf, &wqf, -1, &liwork, -1);
        if (st != 0) return MS_FAIL(ctx, MS_E_BACKEND, "eigh: LAPACK ?syevd workspace query failed (info=%d)", st);
        /* an f32 query can round a large size down: never go below LAPACK's documented minimum */
        int64_t min_lwork = v ? 1 + 6 * n + 2 * n * n : 2 * n + 1, min_liwork = v ? 3 + 5 * n : 1;
        double q = dbl ? wq : (double)wqf;
        lwork = (int)(q > (double)min_lwork ? q : (double)min_lwork);
        if (liwork < min_liwork) liwork = (int)min_liwork;
    }
    size_t s_mats, s_vals, s_work = (size_t)lwork * esz, s_iwork = (size_t)liwork * sizeof(int), total;
    int64_t nmat;
    if (__builtin_mul_overflow(nbatch, n * n, &nmat) || __builtin_mul_overflow((size_t)nmat, esz, &s_mats) ||
        __builtin_mul_overflow((size_t)(nbatch * n), esz, &s_vals) || __builtin_add_overflow(s_mats, s_vals, &total) ||
        __builtin_add_overflow(total, s_work + s_iwork, &total) || total > SIZE_MAX / 2)
        return MS_FAIL(ctx, MS_E_OOM, "eigh: the copies of %lld matrices of %lld x %lld do not fit memory",
                       (long long)nbatch, (long long)n, (long long)n);
    char *mem;
    MS_TRY(ms_ctx_alloc(ctx, total, (void **)&mem));
    char *mats = mem, *vals = mem + s_mats, *work = vals + s_vals;
    int *iwork = (int *)(work + s_work);

    ms_cpu_view av = transposed_view(a);
    const void *p = dbl ? (const void *)ms_cpu_load_f64(&av, 0, nbatch * n * n, (double *)mats)
                        : (const void *)ms_cpu_load_f32(&av, 0, nbatch * n * n, (float *)mats);
    if (p != mats) memcpy(mats, p, s_mats);

    ms_status status = MS_OK;
    for (int64_t q = 0; q < nbatch && status == MS_OK; q++) {
        for (int64_t j = 0; j < n && status == MS_OK; j++)
            for (int64_t i = j; i < n; i++) {
                int64_t e = q * n * n + j * n + i;
                double x = dbl ? ((double *)mats)[e] : ((float *)mats)[e];
                if (!isfinite(x)) {
                    if (info) *info = -5;
                    status = MS_FAIL(ctx, MS_E_NUMERIC, "eigh: batch member %lld has a non-finite entry (%g) "
                                     "at [%lld,%lld]", (long long)q, x, (long long)i, (long long)j);
                    break;
                }
            }
    }
    for (int64_t q = 0; q < nbatch && status == MS_OK; q++) {
        st = dbl ? LAPACKE_dsyevd_work(LAPACK_COL_MAJOR, jobz, 'L', ni, (double *)mats + q * n * n, ni,
                                       (double *)vals + q * n, (double *)work, lwork, iwork, liwork)
                 : LAPACKE_ssyevd_work(LAPACK_COL_MAJOR, jobz, 'L', ni, (float *)mats + q * n * n, ni,
                                       (float *)vals + q * n, (float *)work, lwork, iwork, liwork);
        if (st > 0) {
            if (info) *info = st;
            status = MS_FAIL(ctx, MS_E_NUMERIC, "eigh: batch member %lld did not converge (LAPACK %csyevd info=%d)",
                             (long long)q, dbl ? 'd' : 's', st);
        } else if (st < 0) {
            if (info) *info = st;
            status = MS_FAIL(ctx, MS_E_BACKEND, "eigh: LAPACK %csyevd rejected argument %d (batch member %lld)",
                             dbl ? 'd' : 's', -st, (long long)q);
        }
    }
    if (status == MS_OK) {
        ms_cpu_view wv;
        ms_cpu_view_of(&wv, w);
        if (dbl) ms_cpu_store_f64(&wv, 0, nbatch * n, (const double *)vals);
        else ms_cpu_store_f32(&wv, 0, nbatch * n, (const float *)vals);
        if (v) {
            ms_cpu_view vv = transposed_view(v);
            if (dbl) ms_cpu_store_f64(&vv, 0, nbatch * n * n, (const double *)mats);
            else ms_cpu_store_f32(&vv, 0, nbatch * n * n, (const float *)mats);
        }
    }
    ms_ctx_dealloc(ctx, mem, total);
    return status;
}

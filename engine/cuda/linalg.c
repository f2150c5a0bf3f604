/*
** CUDA linear algebra: batched matmul through cuBLAS (cublasGemmStridedBatchedEx; f32, TF32 on request,
** f64, bf16/f16 inputs with f32 accumulation) with operands passed in place whenever cuBLAS can read them,
** and batched symmetric eigh through cuSOLVER (syevjBatched for many small matrices, syevd otherwise).
** Semantics follow engine/cpu/linalg.c (batch broadcasting, beta = 0 ignoring dst, eigh's lower triangle).
*/
#include "cuda.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* --- layouts -------------------------------------------------------------------------------------- */

static int64_t max1(int64_t x) { return x > 1 ? x : 1; }

/* X [r, c] (element (i, j) at i * rs + j * cs) stored column-major: its leading dimension, or -1. */
static int64_t colmajor_ld(int64_t r, int64_t c, int64_t rs, int64_t cs)
{
    if (!(rs == 1 || r == 1)) return -1;
    int64_t ld = c == 1 ? max1(r) : cs;
    return ld >= max1(r) && ld <= INT_MAX ? ld : -1;
}

/* X [r, c] as cuBLAS reads an operand: op(S) with S column-major (N: S = X; T: S = X^T). */
static bool present(int64_t r, int64_t c, int64_t rs, int64_t cs, cublasOperation_t *op, int64_t *ld)
{
    if ((*ld = colmajor_ld(r, c, rs, cs)) >= 0) { *op = CUBLAS_OP_N; return true; }
    if ((*ld = colmajor_ld(c, r, cs, rs)) >= 0) { *op = CUBLAS_OP_T; return true; }
    return false;
}

/* Whether the matrices of t, over dst's batch dims (t's aligned from the right, broadcast with stride 0),
** sit at q * stride for batch q; the stride. */
static bool batch_stride(const ms_tensor *t, const ms_tensor *dst, long long *stride)
{
    int nb = dst->ndim - 2, tb = t->ndim - 2;
    int64_t size[MS_MAX_DIMS], st[MS_MAX_DIMS];
    int n = 0;
    for (int d = 0; d < nb; d++) {
        if (dst->shape[d] == 1) continue;
        int td = d - (nb - tb);
        size[n] = dst->shape[d];
        st[n] = td >= 0 && t->shape[td] != 1 ? t->strides[td] : 0;
        n++;
    }
    for (int i = 0; i + 1 < n; i++)
        if (st[i] != st[i + 1] * size[i + 1]) return false;
    *stride = n > 0 ? st[n - 1] : 0;
    return true;
}

/* t's matrices in a layout cuBLAS reads, batched at a uniform stride: t itself, or a contiguous copy (of t,
** or of t expanded to dst's batch dims when its batch offsets are not uniform). */
static ms_status prepare_operand(ms_ctx *ctx, const ms_tensor *t, const ms_tensor *dst, ms_tensor **tmp)
{
    *tmp = NULL;
    int nd = t->ndim;
    cublasOperation_t op;
    int64_t ld;
    long long bs;
    bool layout = present(t->shape[nd - 2], t->shape[nd - 1], t->strides[nd - 2], t->strides[nd - 1], &op, &ld);
    bool batch = batch_stride(t, dst, &bs);
    if (layout && batch) return MS_OK;
    ms_tensor view = *t;
    if (!batch) {   /* t expanded to dst's batch dims */
        int64_t shape[MS_MAX_DIMS], strides[MS_MAX_DIMS];
        int nb = dst->ndim - 2, tb = nd - 2;
        for (int d = 0; d < nb; d++) {
            int td = d - (nb - tb);
            shape[d] = dst->shape[d];
            strides[d] = td >= 0 && t->shape[td] == dst->shape[d] ? t->strides[td] : 0;
        }
        shape[nb] = t->shape[nd - 2];
        shape[nb + 1] = t->shape[nd - 1];
        strides[nb] = t->strides[nd - 2];
        strides[nb + 1] = t->strides[nd - 1];
        ms_cuda_view(&view, t, dst->ndim, shape, strides, t->offset);
    }
    MS_TRY(ms_tensor_alloc(ctx, t->dtype, view.ndim, view.shape, tmp));
    ms_status st = ms_cuda_copy_tensor(ctx, *tmp, &view);
    if (st != MS_OK) {
        ms_tensor_free(*tmp);
        *tmp = NULL;
        return st;
    }
    ctx->launches++;
    return MS_OK;
}

/* --- matmul --------------------------------------------------------------------------------------- */

typedef struct mat {   /* the logical matrix a cuBLAS operand stands for: [r, c] at strides (rs, cs) */
    const ms_tensor *t;
    int64_t r, c, rs, cs;
} mat;

static mat mat_of(const ms_tensor *t, bool trans)
{
    int nd = t->ndim;
    mat m = { t, t->shape[nd - 2], t->shape[nd - 1], t->strides[nd - 2], t->strides[nd - 1] };
    if (trans) {
        int64_t x = m.r; m.r = m.c; m.c = x;
        x = m.rs; m.rs = m.cs; m.cs = x;
    }
    return m;
}

static mat transposed(mat m)
{
    int64_t x = m.r; m.r = m.c; m.c = x;
    x = m.rs; m.rs = m.cs; m.cs = x;
    return m;
}

ms_status ms_cuda_matmul(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                         const ms_matmul_options *o)
{
    MS_NVTX_RANGE("ms_matmul");
    const ms_matmul_options defaults = { .alpha = 1, .beta = 0 };
    if (!o) o = &defaults;
    MS_TRY(ms_cuda_enter(ctx));
    const int nd = dst->ndim;
    const int64_t m = dst->shape[nd - 2], n = dst->shape[nd - 1];
    const int64_t k = a->shape[a->ndim - (o->trans_a ? 2 : 1)];
    int64_t nbatch = 1;
    for (int d = 0; d < nd - 2; d++) nbatch *= dst->shape[d];
    if (nbatch == 0 || m == 0 || n == 0) return MS_OK;
    if (k == 0) {   /* empty product: dst <- beta * dst (beta 0 ignores the old contents) */
        if (o->beta == 0) return ms_cuda_fill_tensor(ctx, dst, 0.0);
        ms_nary it;
        MS_TRY(ms_nary_build(ctx, "ms_matmul", &it, dst, 1, (const ms_tensor *[]){ dst }));
        return ms_cuda_binary_scalar(ctx, &it, (ms_scalar){ o->beta, NULL }, MS_BINARY_MUL, 0);
    }
    if (m > INT_MAX || n > INT_MAX || k > INT_MAX || nbatch > INT_MAX)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "matmul: m=%lld n=%lld k=%lld batch=%lld exceed cuBLAS's int",
                       (long long)m, (long long)n, (long long)k, (long long)nbatch);

    /* types: what cuBLAS reads, accumulates in and writes */
    cudaDataType_t in_type, out_type;
    cublasComputeType_t compute;
    ms_dtype out_dtype;
    switch (a->dtype) {
    case MS_DTYPE_F64:
        in_type = CUDA_R_64F; compute = CUBLAS_COMPUTE_64F; out_dtype = MS_DTYPE_F64;
        break;
    case MS_DTYPE_BF16:
        in_type = CUDA_R_16BF; compute = CUBLAS_COMPUTE_32F;
        out_dtype = dst->dtype == MS_DTYPE_BF16 ? MS_DTYPE_BF16 : MS_DTYPE_F32;
        break;
    case MS_DTYPE_F16:
        in_type = CUDA_R_16F; compute = CUBLAS_COMPUTE_32F;
        out_dtype = dst->dtype == MS_DTYPE_F16 ? MS_DTYPE_F16 : MS_DTYPE_F32;
        break;
    default:
        in_type = CUDA_R_32F; compute = o->allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
        out_dtype = MS_DTYPE_F32;
        break;
    }
    out_type = out_dtype == MS_DTYPE_F64 ? CUDA_R_64F : out_dtype == MS_DTYPE_BF16 ? CUDA_R_16BF
             : out_dtype == MS_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;

    cublasHandle_t h;
    MS_TRY(ms_cuda_blas(ctx, &h));
    ms_tensor *ta = NULL, *tb = NULL, *tc = NULL;
    ms_status st = prepare_operand(ctx, a, dst, &ta);
    if (st == MS_OK) st = prepare_operand(ctx, b, dst, &tb);
    const ms_tensor *A = ta ? ta : a, *B = tb ? tb : b;

    /* dst: written in place when cuBLAS can write it (row- or column-major matrices at a uniform batch
    ** stride, the dtype cuBLAS writes), else through a contiguous temporary */
    long long sc = 0;
    mat C = mat_of(dst, false);
    bool row = false, col = false;
    if (st == MS_OK && dst->dtype == out_dtype && batch_stride(dst, dst, &sc)) {
        row = colmajor_ld(C.c, C.r, C.cs, C.rs) >= 0;
        col = !row && colmajor_ld(C.r, C.c, C.rs, C.cs) >= 0;
    }
    if (st == MS_OK && !row && !col) {
        st = ms_tensor_alloc(ctx, out_dtype, nd, dst->shape, &tc);
        if (st == MS_OK && o->beta != 0) {
            st = ms_cuda_copy_tensor(ctx, tc, dst);
            ctx->launches++;
        }
        if (st == MS_OK) {
            C = mat_of(tc, false);
            sc = (long long)(m * n);
            row = true;
        }
    }
    if (st == MS_OK) {
        long long sa = 0, sb = 0;
        batch_stride(A, dst, &sa);
        batch_stride(B, dst, &sb);
        mat ma = mat_of(A, o->trans_a), mb = mat_of(B, o->trans_b);
        /* row-major C: cuBLAS computes C^T = B'^T A'^T; column-major C: C = A' B' */
        mat first = row ? transposed(mb) : ma, second = row ? transposed(ma) : mb;
        const void *p1 = ms_tensor_ptr(row ? B : A), *p2 = ms_tensor_ptr(row ? A : B);
        long long s1 = row ? sb : sa, s2 = row ? sa : sb;
        cublasOperation_t op1, op2;
        int64_t ld1, ld2, ldc = row ? colmajor_ld(C.c, C.r, C.cs, C.rs) : colmajor_ld(C.r, C.c, C.rs, C.cs);
        present(first.r, first.c, first.rs, first.cs, &op1, &ld1);
        present(second.r, second.c, second.rs, second.cs, &op2, &ld2);
        const int M = (int)(row ? n : m), N = (int)(row ? m : n);
        const double alpha_d = o->alpha, beta_d = o->beta;
        const float alpha_f = (float)o->alpha, beta_f = (float)o->beta;
        const void *alpha = compute == CUBLAS_COMPUTE_64F ? (const void *)&alpha_d : (const void *)&alpha_f;
        const void *beta = compute == CUBLAS_COMPUTE_64F ? (const void *)&beta_d : (const void *)&beta_f;
        cublasStatus_t s = cublasGemmStridedBatchedEx(h, op1, op2, M, N, (int)k, alpha, p1, in_type, (int)ld1, s1,
                                                      p2, in_type, (int)ld2, s2, beta, ms_tensor_ptr(C.t), out_type,
                                                      (int)ldc, sc, (int)nbatch, compute, CUBLAS_GEMM_DEFAULT);
        if (s != CUBLAS_STATUS_SUCCESS) st = ms_cublas_fail(ctx, s, "cublasGemmStridedBatchedEx", __FILE__, __LINE__);
    }
    if (st == MS_OK) {
        ms_cuda_track_tensor(ctx, A);
        ms_cuda_track_tensor(ctx, B);
        ms_cuda_track_tensor(ctx, C.t);
    }
    if (st == MS_OK && tc) {
        st = ms_cuda_copy_tensor(ctx, dst, tc);
        ctx->launches++;
    }
    ms_tensor_free(ta);
    ms_tensor_free(tb);
    ms_tensor_free(tc);
    return st;
}

/* --- eigh ----------------------------------------------------------------------------------------- */

/* The matrices are copied (row-major) into a workspace and made symmetric from their lower triangles;
** cuSOLVER reads the workspace column-major (the transpose: the same symmetric matrix) and is told to use
** its upper triangle, i.e. A's lower one.  Eigenvectors come back in the workspace's columns, i.e. its rows
** read row-major: v is the workspace transposed.  Values and vectors reach w and v only after the
** convergence check (none under graph capture), so a failure leaves them untouched, as on the CPU. */
ms_status ms_cuda_eigh(ms_ctx *ctx, ms_tensor *w, ms_tensor *v, const ms_tensor *a, int *info)
{
    MS_NVTX_RANGE("ms_eigh");
    if (info) *info = 0;
    MS_TRY(ms_cuda_enter(ctx));
    const bool dbl = a->dtype == MS_DTYPE_F64;
    const int nd = a->ndim;
    const int64_t n = a->shape[nd - 1];
    int64_t nbatch = 1;
    for (int d = 0; d < nd - 2; d++) nbatch *= a->shape[d];
    if (nbatch == 0 || n == 0) return MS_OK;
    /* syevd's workspace, ~2n^2 elements with the vectors, is counted in an int: the CPU's bound (LAPACK's) */
    if (n > 32000 || nbatch > INT_MAX)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "eigh: n=%lld (batch %lld) is too large for cuSOLVER's int",
                       (long long)n, (long long)nbatch);
    cusolverDnHandle_t h;
    MS_TRY(ms_cuda_solver(ctx, &h));
    const bool capturing = ms_cuda_capturing(ctx);
    const size_t esz = dbl ? 8 : 4;
    const cusolverEigMode_t jobz = v ? CUSOLVER_EIG_MODE_VECTOR : CUSOLVER_EIG_MODE_NOVECTOR;
    const cublasFillMode_t uplo = CUBLAS_FILL_MODE_UPPER;
    const int ni = (int)n, nb = (int)nbatch;
    const bool jacobi = n >= 2 && n <= 32 && nbatch > 1;   /* syevjBatched: many small matrices */

    ms_tensor *mats = NULL, *vals = NULL;
    int *flags = NULL, *host = NULL;
    void *work = NULL;
    size_t flag_bytes = (size_t)nbatch * 2 * sizeof(int), work_bytes = 0;
    syevjInfo_t params = NULL;
    int launches = 0;
    ms_status st = ms_tensor_alloc(ctx, a->dtype, nd, a->shape, &mats);
    if (st == MS_OK) st = ms_tensor_alloc(ctx, a->dtype, w->ndim, w->shape, &vals);
    if (st == MS_OK) st = ms_cuda_scratch(ctx, flag_bytes, (void **)&flags);
    if (st == MS_OK) { st = ms_cuda_copy_tensor(ctx, mats, a); launches++; }
    if (st == MS_OK) {
        st = ms_cuda_note_failure(ctx, msk_eigh_prepare(ctx, ms_cuda(ctx)->stream, ms_tensor_ptr(mats), a->dtype,
                                                        n, nbatch, flags + nbatch));
        launches++;
    }
    char *A = mats ? ms_tensor_ptr(mats) : NULL, *W = vals ? ms_tensor_ptr(vals) : NULL;
    int lwork = 0;
    cusolverStatus_t s = CUSOLVER_STATUS_SUCCESS;
    const char *call = "";
    if (st == MS_OK && jacobi) {
        call = "cusolverDnCreateSyevjInfo";
        s = cusolverDnCreateSyevjInfo(&params);
        if (s == CUSOLVER_STATUS_SUCCESS) { call = "cusolverDnXsyevjSetSortEig"; s = cusolverDnXsyevjSetSortEig(params, 1); }
        if (s == CUSOLVER_STATUS_SUCCESS) {
            call = "cusolverDn?syevjBatched_bufferSize";
            s = dbl ? cusolverDnDsyevjBatched_bufferSize(h, jobz, uplo, ni, (const double *)A, ni, (const double *)W,
                                                         &lwork, params, nb)
                    : cusolverDnSsyevjBatched_bufferSize(h, jobz, uplo, ni, (const float *)A, ni, (const float *)W,
                                                         &lwork, params, nb);
        }
    } else if (st == MS_OK) {
        call = "cusolverDn?syevd_bufferSize";
        s = dbl ? cusolverDnDsyevd_bufferSize(h, jobz, uplo, ni, (const double *)A, ni, (const double *)W, &lwork)
                : cusolverDnSsyevd_bufferSize(h, jobz, uplo, ni, (const float *)A, ni, (const float *)W, &lwork);
    }
    if (st == MS_OK && s != CUSOLVER_STATUS_SUCCESS) st = ms_cusolver_fail(ctx, s, call, __FILE__, __LINE__);
    if (st == MS_OK) {
        work_bytes = (size_t)(lwork > 0 ? lwork : 1) * esz;
        st = ms_cuda_scratch(ctx, work_bytes, &work);
    }
    if (st == MS_OK && jacobi) {
        s = dbl ? cusolverDnDsyevjBatched(h, jobz, uplo, ni, (double *)A, ni, (double *)W, work, lwork, flags, params, nb)
                : cusolverDnSsyevjBatched(h, jobz, uplo, ni, (float *)A, ni, (float *)W, work, lwork, flags, params, nb);
        if (s != CUSOLVER_STATUS_SUCCESS) st = ms_cusolver_fail(ctx, s, "cusolverDn?syevjBatched", __FILE__, __LINE__);
        launches++;
    } else if (st == MS_OK) {
        for (int64_t q = 0; q < nbatch && st == MS_OK; q++) {
            s = dbl ? cusolverDnDsyevd(h, jobz, uplo, ni, (double *)A + q * n * n, ni, (double *)W + q * n, work,
                                       lwork, flags + q)
                    : cusolverDnSsyevd(h, jobz, uplo, ni, (float *)A + q * n * n, ni, (float *)W + q * n, work, lwork,
                                       flags + q);
            if (s != CUSOLVER_STATUS_SUCCESS) st = ms_cusolver_fail(ctx, s, "cusolverDn?syevd", __FILE__, __LINE__);
            launches++;
        }
    }
    if (params) cusolverDnDestroySyevjInfo(params);

    /* the solver's infos and the finiteness flags, read back unless capturing */
    if (st == MS_OK && !capturing) {
        host = malloc(flag_bytes);
        if (host == NULL) st = MS_FAIL(ctx, MS_E_OOM, "eigh: out of host memory");
        cudaError_t e = cudaSuccess;
        if (st == MS_OK) e = cudaMemcpyAsync(host, flags, flag_bytes, cudaMemcpyDeviceToHost, ms_cuda(ctx)->stream);
        if (st == MS_OK && e == cudaSuccess) e = cudaStreamSynchronize(ms_cuda(ctx)->stream);
        if (st == MS_OK && e != cudaSuccess) st = ms_cuda_fail(ctx, e, "cudaMemcpyAsync (eigh info)", __FILE__, __LINE__);
        for (int64_t q = 0; q < nbatch && st == MS_OK; q++) {
            if (host[nbatch + q]) {
                if (info) *info = -5;
                st = MS_FAIL(ctx, MS_E_NUMERIC, "eigh: batch member %lld has a non-finite entry in its lower "
                             "triangle", (long long)q);
            }
        }
        for (int64_t q = 0; q < nbatch && st == MS_OK; q++) {
            int i = host[q];
            if (info && i) *info = i;
            if (i > 0)
                st = MS_FAIL(ctx, MS_E_NUMERIC, "eigh: batch member %lld did not converge (cuSOLVER %c%s info=%d)",
                             (long long)q, dbl ? 'D' : 'S', jacobi ? "syevjBatched" : "syevd", i);
            else if (i < 0)
                st = MS_FAIL(ctx, MS_E_BACKEND, "eigh: cuSOLVER %c%s rejected argument %d (batch member %lld)",
                             dbl ? 'D' : 'S', jacobi ? "syevjBatched" : "syevd", -i, (long long)q);
        }
    }
    if (st == MS_OK) { st = ms_cuda_copy_tensor(ctx, w, vals); launches++; }
    if (st == MS_OK && v) {
        int64_t strides[MS_MAX_DIMS];
        memcpy(strides, mats->strides, sizeof strides);
        strides[nd - 2] = 1;
        strides[nd - 1] = n;
        ms_tensor vt;
        ms_cuda_view(&vt, mats, nd, mats->shape, strides, 0);
        st = ms_cuda_copy_tensor(ctx, v, &vt);
        launches++;
    }
    if (st == MS_OK) {
        ctx->launches += launches > 1 ? launches - 1 : 0;
        ms_cuda_track_tensor(ctx, a);
        ms_cuda_track_tensor(ctx, w);
        if (v) ms_cuda_track_tensor(ctx, v);
    }
    free(host);
    if (work) ms_cuda_scratch_free(ctx, work, work_bytes);
    if (flags) ms_cuda_scratch_free(ctx, flags, flag_bytes);
    ms_tensor_free(mats);
    ms_tensor_free(vals);
    return st;
}

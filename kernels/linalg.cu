/*
** Small kernels around the cuSOLVER eigensolver (engine/cuda/linalg.c): the workspace is made exactly the
** symmetric matrix of a's lower triangle (so the solver never sees the other triangle, whatever it reads),
** and members with non-finite entries there are flagged, as the CPU backend's LAPACKE path refuses them.
*/
#include "common.cuh"

template <class T>
__global__ void __launch_bounds__(MSK_THREADS) eigh_prepare(T *mats, int64_t n, int64_t total, int *flags)
{
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
    const int64_t nn = n * n;
    for (int64_t e = tid; e < total; e += nth) {
        const int64_t q = e / nn, rc = e - q * nn, i = rc / n, j = rc - i * n;
        if (i < j) continue;                  /* threads read only the lower triangle ... */
        const T x = mats[e];
        if (!isfinite(x)) flags[q] = 1;       /* (every writer stores the same 1) */
        if (i > j) mats[q * nn + j * n + i] = x;   /* ... and write only its mirror in the upper one */
    }
}

/* Contract: mats holds nbatch dense row-major n x n matrices of dtype f32 or f64, flags nbatch ints. */
extern "C" ms_status msk_eigh_prepare(ms_ctx *ctx, cudaStream_t s, void *mats, int dtype, int64_t n, int64_t nbatch,
                                      int *flags)
{
    cudaError_t e = cudaMemsetAsync(flags, 0, (size_t)nbatch * sizeof(int), s);
    if (e != cudaSuccess)
        return ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda eigh: cudaMemsetAsync failed: %s (%s)",
                           cudaGetErrorName(e), cudaGetErrorString(e));
    const int64_t total = nbatch * n * n;
    if (total == 0) return MS_OK;
    if (dtype == MS_DTYPE_F64)
        eigh_prepare<double><<<msk_blocks(total), MSK_THREADS, 0, s>>>((double *)mats, n, total, flags);
    else
        eigh_prepare<float><<<msk_blocks(total), MSK_THREADS, 0, s>>>((float *)mats, n, total, flags);
    MSK_CHECK_LAUNCH(ctx, "eigh (prepare)");
    return MS_OK;
}

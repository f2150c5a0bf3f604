/*
** The seam between the CUDA backend's glue (engine/cuda, C) and the kernels (the .cu files of kernels/, C++): plain
** descriptors of the work and one launcher per op family.  Launchers queue work on the stream they are
** given, never synchronise, and return MS_OK or MS_E_BACKEND naming the CUDA error and the launch.
*/
#ifndef MS_KERNELS_H
#define MS_KERNELS_H

#include "moonstep.h"

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { MSK_MAX_DIMS = MS_MAX_DIMS, MSK_MAX_OPS = 4 };

/* Threads per block of every elementwise, random and reduction launch. */
enum { MSK_THREADS = 256 };

/* An elementwise iteration (the core's ms_nary, C++-safe): operand 0 is dst, 1.. the sources, each with
** its own strides (elements, 0 on broadcast dims) and dtype.  contiguous: every operand is dense in the
** same order (ndim <= 1, unit strides); wide: compute in f64 (else f32). */
typedef struct msk_iter {
    int      nops, ndim;
    int64_t  numel;
    int64_t  shape[MSK_MAX_DIMS];
    int64_t  strides[MSK_MAX_OPS][MSK_MAX_DIMS];
    void    *data[MSK_MAX_OPS];
    int      dtype[MSK_MAX_OPS];
    int      contiguous, wide;
} msk_iter;

/* A scalar operand: when ptr != NULL the element *ptr of `dtype` is read on the device when the kernel
** runs (a device scalar; a captured graph replays with its new value), otherwise `value`. */
typedef struct msk_scalar {
    double      value;
    const void *ptr;
    int         dtype;
} msk_scalar;

/* --- kernels/elementwise.cu: every operand any dtype, any strides (contract of ms_nary) ------------ */

ms_status msk_copy(ms_ctx *ctx, cudaStream_t s, const msk_iter *it);
ms_status msk_fill(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, msk_scalar v);
ms_status msk_unary(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, int op);
ms_status msk_binary(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, int op);
ms_status msk_binary_scalar(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, msk_scalar v, int op, int first);
ms_status msk_clamp(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, double lo, double hi);
ms_status msk_lerp(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, msk_scalar w);
ms_status msk_addc(ms_ctx *ctx, cudaStream_t s, const msk_iter *it, msk_scalar v, int divide);

/* --- kernels/reduce.cu ----------------------------------------------------------------------------
** nout outputs, each reducing len elements: output j's elements are at
**   src + base(j) + k * kstride,  k in [0, len),
** base(j) = sum of the digits of j (row-major over oshape[0..ondim)) times ostrides.  dst holds nout
** contiguous elements of dst_dtype (a float dtype).  Accumulation is f32, or f64 for f64/i32/u8 sources, in
** an order fixed by (nout, len, kstride, ostrides) alone: results are bitwise reproducible. */
typedef struct msk_reduce {
    const void *src;
    int         src_dtype;
    void       *dst;
    int         dst_dtype;
    int         op;                       /* ms_reduce_op */
    int64_t     nout, len, kstride;
    int         ondim;
    int64_t     oshape[MSK_MAX_DIMS], ostrides[MSK_MAX_DIMS];
} msk_reduce;

/* Bytes of device scratch msk_reduce_run needs for r (0 when none). */
size_t msk_reduce_scratch(const msk_reduce *r);
/* Queues the reduction (len >= 1, nout >= 1); *launches gets the number of kernels queued. */
ms_status msk_reduce_run(ms_ctx *ctx, cudaStream_t s, const msk_reduce *r, void *scratch, int *launches);

/* --- kernels/random.cu ----------------------------------------------------------------------------
** dst (any float dtype, any strides) <- Philox4x32-10 numbers exactly as moonstep.h documents ms_rand;
** `top` is the largest value of dtype below b (uniform results that round up to b become top). */
typedef struct msk_rand {
    void    *dst;
    int      dtype, ndim;
    int64_t  numel;
    int64_t  shape[MSK_MAX_DIMS], strides[MSK_MAX_DIMS];
    int      normal;
    double   a, b, top;
    uint64_t seed, offset;
} msk_rand;

ms_status msk_rand_run(ms_ctx *ctx, cudaStream_t s, const msk_rand *r);

/* --- kernels/linalg.cu ----------------------------------------------------------------------------
** For each of nbatch dense row-major n x n matrices (f32 or f64): the lower triangle is mirrored into the
** upper one (the matrix becomes the symmetric one eigh means), and flags[q] <- 1 when matrix q has a
** non-finite entry on or below its diagonal, else 0. */
ms_status msk_eigh_prepare(ms_ctx *ctx, cudaStream_t s, void *mats, int dtype, int64_t n, int64_t nbatch,
                           int *flags);

/* --- shared --------------------------------------------------------------------------------------- */

/* The engine's error recorder (engine/core/error.c), for the launchers' messages. */
ms_status ms_error_at(ms_ctx *ctx, ms_status st, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

#ifdef __cplusplus
}
#endif

#endif /* MS_KERNELS_H */

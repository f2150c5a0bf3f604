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

/* --- kernels/optim.cu: fused optimizer steps and multi-tensor helpers ------------------------------
** A call's members reach the kernels as a table passed by value in the kernel parameters (CUDA 12.1+ takes
** up to 32 KB of them): one launch updates up to MSK_OPTIM_CAP members, a captured graph keeps its own copy
** of the table, and nothing is staged in device memory or allocated per step.  A larger group takes
** ceil(n / MSK_OPTIM_CAP) launches.  Each block works on (member, tile) pairs.  *launches gets the number
** of kernels queued.  Arithmetic is that of engine/cpu/optim.c, in its order, correctly rounded. */

enum { MSK_OPTIM_CAP = 320 };

/* One member of a call.  The strided operand (the grad of a step, the tensor of scale and sumsq) has element
** e (row-major) at (e / cols) * rs + (e % cols) * cs elements from its base; dense means cols = numel,
** cs = 1.  x and the states are contiguous. */
typedef struct msk_member {
    void       *x;            /* the param (steps), the tensor (scale), the source (sumsq) */
    const void *g;            /* the grad (steps) */
    void       *s0, *s1;      /* the states (NULL when the step keeps none) */
    int64_t     numel;
    int64_t     cols, rs, cs;
    double      scale;        /* learning-rate multiplier (steps) */
    int32_t     index;        /* position in the call: Philox counter word (steps), dst element (sumsq) */
    int8_t      xdt, gdt;     /* dtypes of x and g */
    uint8_t     dense;        /* the strided operand is dense */
    uint8_t     vec;          /* MSK_VEC_X: x and the states 16-byte aligned; MSK_VEC_G: g (dense) 16-byte aligned */
} msk_member;

enum { MSK_VEC_X = 1, MSK_VEC_G = 2 };

/* Scalars of an AdamW call.  lr, step and skip may be device scalars (skip.ptr NULL: never skip).  omb1/omb2
** are 1 - beta in f64.  With bias correction and a host step, bc1 = 1 - beta1^step and bc2_sqrt =
** sqrt(1 - beta2^step) come from the host (the CPU's libm, so the CPU's values); with a device step they are
** computed on the device. */
typedef struct msk_adamw {
    msk_scalar lr, step, skip;
    double     beta1, beta2, omb1, omb2, eps, weight_decay, bc1, bc2_sqrt;
    int        bias_correction, stochastic, state_dtype;
    uint64_t   seed;
} msk_adamw;

/* Scalars of an SGD call; omd = 1 - dampening in f64; has_buf: the members carry a momentum buffer (s0). */
typedef struct msk_sgd {
    msk_scalar lr, step, skip;
    double     momentum, omd, weight_decay;
    int        nesterov, has_buf, stochastic, state_dtype;
    uint64_t   seed;
} msk_sgd;

/* Every member's numel >= 1. */
ms_status msk_adamw_run(ms_ctx *ctx, cudaStream_t s, const msk_adamw *o, int n, const msk_member *m, int *launches);
ms_status msk_sgd_run(ms_ctx *ctx, cudaStream_t s, const msk_sgd *o, int n, const msk_member *m, int *launches);
/* Each member's x <- x * v, in place (f32 arithmetic, f64 for f64 members). */
ms_status msk_scale_run(ms_ctx *ctx, cudaStream_t s, msk_scalar v, int n, const msk_member *m, int *launches);

/* Sums of squares: dst[m.index] (dst_dtype f32 or f64) <- the sum over member m, in engine/cpu/optim.c's order
** (4096-element chunks summed in 8 interleaved lanes, chunk partials added in order), so the result equals
** the CPU's bit for bit.  One launch per MSK_OPTIM_CAP members: the last block to finish a member's chunks
** (told by an integer counter, never a float atomic) adds its partials in order.  `partials` holds
** msk_sumsq_scratch bytes of device scratch; `tickets` MSK_OPTIM_CAP counters that are zero before the call
** and are zero again after it (each member's last block resets its own), kept by the caller across calls. */
size_t msk_sumsq_scratch(int n, const msk_member *m);
ms_status msk_sumsq_run(ms_ctx *ctx, cudaStream_t s, void *dst, int dst_dtype, int n, const msk_member *m,
                        double *partials, unsigned *tickets, int *launches);

/* --- kernels/sinkgd.cu: the SinkGD step (ms_sinkgd_step) --------------------------------------------
** One entry per matrix of the call (a member [..., m, n] gives one per leading index), in call order.  The
** step runs as a fixed sequence of launches over all matrices at once (a table of up to MSK_SINKGD_CAP
** matrices in the kernel parameters; more take further sequences): per SR-Sinkhorn iteration one sweep over G
** and one fold of column partials, then (spectral, sphere) the power steps, the sphere sums, and the apply.
** *launches gets the number of kernels queued.  No device memory is allocated (the scratch is the caller's) and
** nothing synchronises. */

enum { MSK_SINKGD_CAP = 224 };

typedef struct msk_sinkgd_mat {
    const void *g;            /* G(i, j) at g + i * rs + j * cs elements */
    void       *p;            /* the matrix's first param element (rows of n, contiguous) */
    float      *u;            /* its specnorm_u row [n] (spectral, sphere), else NULL */
    float      *t;            /* its md_target_norm element (sphere), else NULL */
    int64_t     m, n, rs, cs;
    int64_t     e0;           /* index of p[0] in the member's param (the stochastic rounding's counter) */
    int64_t     b;            /* index of the matrix among the member's leading dims (u's first value) */
    double      scale;        /* learning-rate multiplier of the member */
    int32_t     member;       /* the member's index in the call */
    int8_t      gdt, pdt;
} msk_sinkgd_mat;

/* Scalars of a call (moonstep.h, ms_sinkgd_options); lr, step and skip may be device scalars. */
typedef struct msk_sinkgd {
    msk_scalar lr, step, skip;
    int        mode, iters, sn_iters, target, stochastic;
    double     eps, weight_decay;
    uint64_t   seed;
} msk_sinkgd;

/* Bytes of device scratch msk_sinkgd_run needs (every m, n >= 1): the scale vectors, a row of column partials
** per CTA band and a few scalars per matrix, O(#SMs (m + n)) floats for a matrix alone. */
size_t msk_sinkgd_scratch(int n, const msk_sinkgd_mat *m);
/* `tickets`: MSK_SINKGD_CAP counters that are zero before the call and zero again after it (kept by the
** caller across calls, as msk_sumsq_run's). */
ms_status msk_sinkgd_run(ms_ctx *ctx, cudaStream_t s, const msk_sinkgd *o, int n, const msk_sinkgd_mat *m,
                         void *scratch, unsigned *tickets, int *launches);

/* --- kernels/adamw8.cu: AdamW with 8-bit block-quantized moments (ms_adamw8_step) --------------------
** A member is a msk_member of the step (x = param, g = grad, s0 = exp_avg codes, s1 = exp_avg_sq codes) and its
** two block-scale arrays.  One warp per block of block_size elements; up to MSK_ADAMW8_CAP members a launch. */

enum { MSK_ADAMW8_CAP = 224 };

typedef struct msk_adamw8_member {
    msk_member t;
    float     *m_scale, *v_scale;
} msk_adamw8_member;

typedef struct msk_adamw8 {
    msk_adamw a;                   /* state_dtype unused */
    int       block_size;
    float     qmap[2][256];        /* signed (exp_avg), unsigned (exp_avg_sq): ms_adamw8_qmap */
} msk_adamw8;

/* Every member's numel >= 1 and a multiple of block_size. */
ms_status msk_adamw8_run(ms_ctx *ctx, cudaStream_t s, const msk_adamw8 *o, int n, const msk_adamw8_member *m,
                         int *launches);

/* --- shared --------------------------------------------------------------------------------------- */

/* The engine's error recorder (engine/core/error.c), for the launchers' messages. */
ms_status ms_error_at(ms_ctx *ctx, ms_status st, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

#ifdef __cplusplus
}
#endif

#endif /* MS_KERNELS_H */

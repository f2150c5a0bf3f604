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
** `top` is the largest value of dtype below b (uniform results that round up to b become top), `bot` the
** smallest value of dtype at or above a (uniform results that round below a become bot). */
typedef struct msk_rand {
    void    *dst;
    int      dtype, ndim;
    int64_t  numel;
    int64_t  shape[MSK_MAX_DIMS], strides[MSK_MAX_DIMS];
    int      normal;
    double   a, b, top, bot;
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
    int32_t     index;        /* the Philox counter's member word (steps: ms_rng_map's), dst element (sumsq) */
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

/* Stochastic rounding's element numbers of a param that is a slice of a whole (ms_rng_map, engine/core/internal.h):
** element e is numbered e + base + (e / div) gap (div 0: e + base). */
typedef struct msk_rng {
    int64_t base, div, gap;
} msk_rng;

/* Every member's numel >= 1.  rng (NULL: every element numbered as it is) has n entries; a call with one
** launches kernels whose tables carry them (MSK_OPTIM_RNG_CAP members a launch). */
enum { MSK_OPTIM_RNG_CAP = 256 };
ms_status msk_adamw_run(ms_ctx *ctx, cudaStream_t s, const msk_adamw *o, int n, const msk_member *m,
                        const msk_rng *rng, int *launches);
ms_status msk_sgd_run(ms_ctx *ctx, cudaStream_t s, const msk_sgd *o, int n, const msk_member *m, const msk_rng *rng,
                      int *launches);
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
** matrices in the kernel parameters; more take further sequences, and so does each class of one row width
** with 1 GiB of G or more, whose sweeps run at their own pace): per SR-Sinkhorn iteration one sweep over G and
** one fold of column partials, then (spectral, sphere) the power steps, the sphere sums, and the apply.
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
    int32_t     member;       /* the stochastic rounding's member word: the member's index in the call, or its param's
                              ** origin's (ms_rng_map_of) */
    int8_t      gdt, pdt;
    /* sharded runs (msk_sinkgd_run_sharded; 0 otherwise): the global matrix's dims, and the first row (rows) or
    ** column (cols) of this slice in it.  e0 is then the slice's first element's index in the global member, and
    ** for cols the counter of element (i, j) is e0 + i * ng + j. */
    int64_t     mg, ng, off;
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

/* The sharded step (ms_sinkgd_step_sharded's CUDA member): every matrix of a run is the slice of a global matrix
** along the same dim (MSK_SHARD_ROWS or MSK_SHARD_COLS), a rank with an empty slice included (m or n 0), the
** matrices in the same order on every rank.  x->sum adds a buffer of the scratch over the ranks in place; it is
** called between launches (enqueued on the stream, no synchronisation), with sizes that depend on the global
** dims alone, one buffer per exchange point for all matrices of a chunk.  Rows: the fused passes, each fold split
** around its exchange.  Cols: simpler passes (row partials, exchange, whole columns). */
enum { MSK_SHARD_ROWS = 1, MSK_SHARD_COLS = 2 };
typedef struct msk_exchange {
    ms_status (*sum)(void *user, void *buf, int64_t count, ms_dtype dt);
    void *user;
} msk_exchange;
size_t msk_sinkgd_sharded_scratch(int dim, int n, const msk_sinkgd_mat *m);
ms_status msk_sinkgd_run_sharded(ms_ctx *ctx, cudaStream_t s, const msk_sinkgd *o, int dim, int n,
                                 const msk_sinkgd_mat *m, const msk_exchange *x, void *scratch, unsigned *tickets,
                                 int *launches);

/* --- kernels/adamw8.cu: AdamW with 8-bit block-quantized moments (ms_adamw8_step) --------------------
** A member is a msk_member of the step (x = param, g = grad, s0 = exp_avg codes, s1 = exp_avg_sq codes) and its
** two block-scale arrays.  One warp per block of block_size elements; up to MSK_ADAMW8_CAP members a launch. */

enum { MSK_ADAMW8_CAP = 224 };

typedef struct msk_adamw8_member {
    msk_member t;
    float     *m_scale, *v_scale;
    msk_rng    rng;            /* the stochastic rounding's element numbers */
} msk_adamw8_member;

typedef struct msk_adamw8 {
    msk_adamw a;                   /* state_dtype unused */
    int       block_size;
    float     qmap[2][256];        /* signed (exp_avg), unsigned (exp_avg_sq): ms_adamw8_qmap */
} msk_adamw8;

/* Every member's numel >= 1 and a multiple of block_size. */
ms_status msk_adamw8_run(ms_ctx *ctx, cudaStream_t s, const msk_adamw8 *o, int n, const msk_adamw8_member *m,
                         int *launches);

/* --- kernels/dash.cu: Shampoo on stacked blocks (ms_blocks_gather / ms_blocks_apply / ms_dash_graft, and
** the parts of ms_inv_root and ms_spectrum_estimate that are not cuBLAS / cuSOLVER calls) ------------------
** Stacks are dense [N, r, c] f32.  A solver works on `batch` positions of n x n matrices: position p's matrix
** sits at p * n * n elements of each scratch "slot"; map[p] (NULL: p) is its original position q, and
** index[q] (NULL: q) the block id in the caller's stacks (-1: an invalid index entry, whose block is neither
** read nor written).  Per-block scalars (scales) are indexed by q, so compacting the working set moves only
** the slots and the map. */

enum { MSK_DASH_CAP = 800 };        /* blocks per gather / apply launch (the table rides in the parameters) */
enum { MSK_DASH_SPLIT_MAX = 4 };    /* panels of a symmetric product */

/* One block of a parameter: element (i, j) of the block at p + i * rs + j * cs elements of dtype dt. */
typedef struct msk_dash_block {
    void    *p;
    int64_t  rs, cs;
    int64_t  e0;       /* row-major index of element (0, 0) in its tensor: the stochastic rounding's counter */
    int32_t  tag;      /* the counter's member word: the block's index in the call */
    int8_t   dt;
} msk_dash_block;

/* blocks_apply (engine/cpu/dash.c's arithmetic): p <- p * dec - f * s with dec = (float)(1 - lr wd) and
** f = (float)(lr * scale[k]) (update), or p <- (float)scale[k] * s. */
typedef struct msk_dash_apply {
    msk_scalar lr, step, skip;
    double     weight_decay;
    int        update, stochastic;
    uint64_t   seed;
    const int *ids;        /* the rounding's member word of block k (device, [n]); NULL: the block's tag */
} msk_dash_apply;

/* Every block r x c with r, c >= 1; scale may be NULL (1).  Launches: ceil(n / MSK_DASH_CAP). */
ms_status msk_dash_gather(ms_ctx *ctx, cudaStream_t s, float *stack, int64_t r, int64_t c, int n,
                          const msk_dash_block *b, int *launches);
ms_status msk_dash_apply_run(ms_ctx *ctx, cudaStream_t s, const msk_dash_apply *o, const float *stack, int64_t r,
                             int64_t c, const float *scale, int n, const msk_dash_block *b, int *launches);


/* ms_dash_graft on N blocks of rc elements (f32 stacks, pgraft may be NULL); `partials` holds
** msk_dash_graft_scratch bytes.  Two launches: the pass over the stacks (none when rc is 0) and the fold of the
** norms. */
typedef struct msk_dash_graft {
    msk_scalar step, skip;
    double     beta_grad, beta_graft, eps;
    int        bias_correction;
} msk_dash_graft;
size_t msk_dash_graft_scratch(int64_t N, int64_t rc);
ms_status msk_dash_graft_run(ms_ctx *ctx, cudaStream_t s, const msk_dash_graft *o, float *m, float *v, float *norm,
                             float *pgraft, const float *g, int64_t N, int64_t rc, double *partials);

/* The gather of ms_blocks_gather_factors in one tiled pass: the stack, its transposes stack_t [n, c, r] (NULL:
** none) and, with g, ms_dash_graft's update of the stack (m, v, pgraft, norm; partials holding
** msk_dash_gather_graft_scratch bytes).  Launches: ceil(n / MSK_DASH_CAP), and the fold with g. */
typedef struct msk_dash_gather_graft {
    msk_dash_graft o;
    float  *m, *v, *norm, *pgraft;
    double *partials;
} msk_dash_gather_graft;
size_t msk_dash_gather_graft_scratch(int64_t n, int64_t r, int64_t c);
ms_status msk_dash_gather_t(ms_ctx *ctx, cudaStream_t s, float *stack, float *stack_t, int64_t r, int64_t c, int n,
                            const msk_dash_block *b, const msk_dash_gather_graft *g, int *launches);

/* --- the solvers' pieces ---------------------------------------------------------------------------- */

typedef struct msk_dash_pos {
    int64_t    n, batch;
    const int *map;        /* position -> original position q (NULL: identity) */
    const int *index;      /* q -> block id, -1 for none (NULL: identity) */
} msk_dash_pos;

/* index_out[q] <- index[q] when it lies in [0, nblocks), else -1 (K entries). */
ms_status msk_dash_index(ms_ctx *ctx, cudaStream_t s, int64_t K, const int *index, int64_t nblocks, int *index_out);

/* A source of n x n matrices: the caller's stack (addressed by block id) or a slot (by position), read as
** src + (float)eps on the diagonal (an f32 add, as engine/cpu/dash.c forms A_reg). */
typedef struct msk_dash_src {
    const float *a;
    int          by_id;
    double       eps;
} msk_dash_src;

/* The panels of a symmetric product: column panels [cut[j], cut[j+1]) of the n x n result, the product
** computed only for rows >= cut[j] (column-major; the row-major upper block triangle), the rest mirrored.
** cut[0] = 0 < ... < cut[split] = n, inner cuts multiples of 32. */
typedef struct msk_dash_sym {
    int64_t n;
    int     split;
    int     cut[MSK_DASH_SPLIT_MAX + 1];
} msk_dash_sym;

/* After a product into x (batch positions, dtype xdt): mirror the upper panel blocks onto the lower ones
** (split > 1), add diag to the diagonal, then optionally dev[p] <- max(dev[p], max |x - I|) (as f32 bits;
** non-negative floats order as their bits; NaN counts as +inf) and x16 <- x in x16dt.  cn_p > 0 (x is CN's M,
** f32): also CN's next N = ((p + 1) I - M) / p into cn_n32 and, rounded to x16dt, cn_n16 (engine/cpu/dash.c's
** arithmetic: -M * (1/p) off the diagonal, ((p + 1) - M) * (1/p) on it). */
typedef struct msk_dash_finish {
    void        *x;
    int          xdt;
    void        *x16;
    int          x16dt;
    float        diag;
    unsigned    *dev;
    int64_t      batch;
    int          cn_p;
    float       *cn_n32;
    void        *cn_n16;
} msk_dash_finish;
ms_status msk_dash_finish_run(ms_ctx *ctx, cudaStream_t s, const msk_dash_sym *sym, const msk_dash_finish *f);

/* x (dtype dt, pos->batch n x n matrices) <- x + v I. */
ms_status msk_dash_diag(ms_ctx *ctx, cudaStream_t s, void *x, int dt, const msk_dash_pos *pos, float v);

/* NDB chain start on positions (the identity here): B = (src + eps I) * (float)scale[q]^se; bs <- B / w^2 and
** z <- w (-0.5 B + 1.5 I), w = scale[q]^we (scale NULL: 1), in f32; 16-bit copies into bs16 / z16 (dt16)
** when not NULL. */
ms_status msk_dash_ndb_init(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, msk_dash_src src,
                            const double *scale, double se, double we, float *bs, float *z, void *bs16, void *z16,
                            int dt16);
/* CN start (root p), engine/cpu/dash.c's arithmetic: z = (p + 1) / (2 scale[q]), M = (float)z A_reg,
** N0 = -M / p off the diagonal and ((p + 1) - M) / p on it, into n32 (and n16 in dt16 when not NULL);
** x1 <- (float)z^(1/p) N0, at block ids when x1_by_id (the result of a one-iteration solve); M itself rounded
** to dt16 into m16 when not NULL (the 16-bit M recursion's operand). */
ms_status msk_dash_cn_init(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, msk_dash_src src,
                           const double *scale, int root, float *n32, void *n16, int dt16, float *x1, int x1_by_id,
                           void *m16);
/* Chebyshev start (degree d >= 2, coefficients c): T = a2 A_reg - sh I with a2 = (float)(2 / (s (1 - lo))),
** sh = (float)((1 + lo) / (1 - lo)) into tm; b1 <- (2 c_d) T + c_(d-1) I, b2 <- c_d I; 16-bit copies of T and
** b1 into tm16 / b116 (dt16) when not NULL. */
ms_status msk_dash_cheb_init(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, msk_dash_src src,
                             const double *scale, double lo, float cd, float cd1, float *tm, float *b1, float *b2,
                             void *tm16, void *b116, int dt16);

/* Early exit.  live[p] > 0: iterating; -1: frozen at this check; 0: frozen before.  freeze: -1 becomes 0; a live
** position with d = factor * dev[p] < tol (converged) or not <= limit (diverged, NaN included: moonstep.h's
** divergence stop) becomes -1 and iters[q] += k; dev[p] <- 0. */
ms_status msk_dash_freeze(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int *live, unsigned *dev,
                          float factor, float tol, float limit, int *iters, int k);
/* dst <- src * f + c0 f I for each position with live[p] == -1 (final: live NULL or live[p] > 0), f =
** (float)pow(scale[q], fexp) (scale NULL: f = 1, no multiply); dst addressed by block id (dst_by_id) or q. */
ms_status msk_dash_save(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const int *live, int final,
                        const float *src, float *dst, int dst_by_id, const double *scale, double fexp, float c0);
/* iters[q] += T for positions still live (live NULL: all). */
ms_status msk_dash_count(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const int *live, int *iters, int T);
/* One CTA, in place: the live positions below cnt = (number live) stay, the live positions at or above cnt
** move into the frozen positions below cnt (pairs: from[i] -> to[i], i < npairs, both ascending), map and live
** follow; live[p] <- 0 for p >= cnt.  counts[0] <- cnt, counts[1] <- npairs.  Skipped (counts[0] <- prev,
** counts[1] <- 0, nothing moves) while cnt > prev - prev / 16, prev = counts[0] as the last call left it (0 at
** the start of a pass: pos->batch). */
ms_status msk_dash_compact(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int *live, int *map, int *from,
                           int *to, int *counts);
/* For each slot (base, bytes per position): base[to[i]] <- base[from[i]], i < counts[1] (read on the device;
** the grid covers max_pairs). */
typedef struct msk_dash_slot { void *base; int64_t bytes; } msk_dash_slot;
ms_status msk_dash_move(ms_ctx *ctx, cudaStream_t s, int64_t max_pairs, const int *from, const int *to,
                        const int *counts, int nslots, const msk_dash_slot *slots);
/* map[p] <- p for p < K. */
ms_status msk_dash_iota(ms_ctx *ctx, cudaStream_t s, int64_t K, int *map);
/* out[id(q)] <- acc[q] for q < pos->batch (i32). */
ms_status msk_dash_iters_out(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const int *acc, int *out);

/* --- power iteration and sketches (moonstep.h, "Random vectors" and "Power iteration") ---------------------
** v [batch, n, m] f32 <- the normals of block id(q) with key seed and offset base + id(q), or base +
** (uint32_t)rng_ids[id(q)] when rng_ids (device, [N]) is not NULL. */
ms_status msk_dash_randn(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int64_t m, float *v, uint64_t seed,
                         uint64_t base, const int *rng_ids);
ms_status msk_dash_randn64(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int64_t m, double *v,
                           uint64_t seed, uint64_t base, const int *rng_ids);

/* A thin product W = M V per position: M n x n (f32, by block id or position; M_ii + d1 + d2 as f32 adds, then
** rounded to bf16 when bf16; the f64 form: (double)M_ii + dd), V and W [n, m] row-major.  f32 accumulation
** (f64 in the f64 form). */
typedef struct msk_dash_thin {
    const float *m;
    int          by_id;
    float        d1, d2;
    double       dd;
    int          bf16;
    int64_t      vecs;
} msk_dash_thin;
ms_status msk_dash_thin_f32(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const msk_dash_thin *t,
                            const float *v, float *w);
ms_status msk_dash_thin_f64(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const msk_dash_thin *t,
                            const double *v, double *w);

/* v [batch, n, m] <- the columns of x = w + damp * vin (vin NULL: x = w), each times (float)(1 / ||x||) from an f64
** sum (0 for a zero column), then rounded to bf16 when bf16 (stored as f32), and also stored as bf16 into v16
** when it is not NULL (the operand of a bf16 GEMM).  May run in place (v == w). */
ms_status msk_dash_pi_norm(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int64_t m, const float *w,
                           const float *vin, float damp, int bf16, float *v, void *v16);
/* out [batch, n, n] <- the matrix msk_dash_thin_f32 multiplies by (t: M by id or position, d1 and d2 on the
** diagonal), as bf16 when t->bf16, else f32: the operand of the power iteration's batched GEMMs. */
ms_status msk_dash_pi_matrix(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, const msk_dash_thin *t, void *out);
/* q = max_j sum_i v_ij (w_ij + damp v_ij) (f64 sums; NaN wins), then per mode: 0 (scale, by q): dst = max(mult q,
** 2^-126); 1 (lam_max, by id): dst = (float)(q - sub); 2 (lam_min, by id): dst = q^(-power), +inf where q <= 0. */
ms_status msk_dash_pi_rq(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int64_t m, const float *v,
                         const float *w, float damp, int mode, double mult, double sub, double power, void *dst);
/* scale[q] <- max(sqrt(sum of (src + eps I)^2), 2^-126) in f64 (positions the identity); `partials` holds
** msk_dash_fro_scratch doubles. */
size_t msk_dash_fro_scratch(const msk_dash_pos *pos);
ms_status msk_dash_fro(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, msk_dash_src src, double *partials,
                       double *scale);
/* residual[id] <- ||w - v||_F / ||v||_F (0 when v = 0) for the [n, m] f64 sketches of each position. */
ms_status msk_dash_residual(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, int64_t m, const double *v,
                            const double *w, float *residual);

/* EVD: work (positions) <- src + eps I as is (cuSOLVER reads its column-major lower triangle, as LAPACK 'L'
** does on the CPU); bad[p] <- 1 when the block holds a non-finite value (first flat index in bad_at[p]). */
ms_status msk_dash_evd_prep(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, msk_dash_src src, float *work,
                            int *bad);
/* After the eigensolver: column j of position p's eigenvector matrix q (column-major) *= (float)l'^(-1/(2 root)),
** l' = l_j + (shift ? eps - min(l_1, 0) : 0); 0 where l' <= 0. */
ms_status msk_dash_evd_scale(ms_ctx *ctx, cudaStream_t s, const msk_dash_pos *pos, float *q, const float *w,
                             int root, double eps, int shift);

/* --- shared --------------------------------------------------------------------------------------- */

/* The engine's error recorder (engine/core/error.c), for the launchers' messages. */
ms_status ms_error_at(ms_ctx *ctx, ms_status st, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

#ifdef __cplusplus
}
#endif

#endif /* MS_KERNELS_H */

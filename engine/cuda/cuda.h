/*
** Private to the CUDA backend: the per-context state (stream, library handles, pool, capture), the
** stream-ordered caching pool's interface, error helpers that turn CUDA/cuBLAS/cuSOLVER codes into
** MS_E_BACKEND messages, and the backend members the engine/cuda files collect into ms_cuda_backend.
*/
#ifndef MS_CUDA_H
#define MS_CUDA_H

#include "internal.h"
#include "msk.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

typedef struct ms_cuda_pool ms_cuda_pool;
typedef struct ms_cuda_graph ms_cuda_graph;

/* Bytes of the cuBLAS workspace each context gives its handle (NVIDIA's recommendation for Hopper). */
#define MS_CUDA_BLAS_WORKSPACE (32u << 20)

typedef struct ms_cuda_ctx {
    int                device;
    cudaStream_t       stream;
    bool               own_stream;
    cublasHandle_t     blas;           /* created on first use (or at ms_graph_begin) */
    void              *blas_workspace;
    cusolverDnHandle_t solver;         /* likewise */
    ms_cuda_pool      *pool;
    unsigned          *tickets;        /* counters of ms_foreach_sumsq and ms_sinkgd_step (ms_cuda_tickets) */
    ms_cuda_graph     *capture;        /* the graph being captured on `stream`, NULL otherwise */
    ms_status          capture_status; /* the first failure while capturing */
    char               capture_error[MS_ERRMSG_SIZE];
    bool               joined;         /* between ms_graph_join and ms_graph_leave (engine/cuda/capture.c) */
    struct ms_cuda_join_marker *joins; /* one per join, freed with the context (capture.c) */
    struct ms_cuda_dash *dash;         /* DASH's eigensolver streams and handles (engine/cuda/dash.c), lazily */
} ms_cuda_ctx;

/* A captured sequence: the core's header, the instantiated graph, and the pool blocks it keeps. */
struct ms_cuda_graph {
    struct ms_graph  base;
    cudaGraph_t      graph;
    cudaGraphExec_t  exec;
    int64_t          nodes;
};

static inline ms_cuda_ctx *ms_cuda(const ms_ctx *ctx) { return (ms_cuda_ctx *)ctx->impl; }
/* Whether ctx's ops are being recorded into a graph, its own (ms_graph_begin) or a caller's it joined
** (ms_graph_join): ops that would read results back to the host (convergence checks) must not. */
static inline bool ms_cuda_capturing(const ms_ctx *ctx)
{
    const ms_cuda_ctx *c = ms_cuda(ctx);
    return c->capture != NULL || c->joined;
}

/* A scalar argument for the kernels: the double v, or the 1-element device tensor t when given (read when the
** kernel runs, so a captured graph replays with new values). */
static inline msk_scalar ms_cuda_scalar(double v, const ms_tensor *t)
{
    msk_scalar k = { v, NULL, 0 };
    if (t) {
        k.ptr = ms_tensor_ptr(t);
        k.dtype = t->dtype;
    }
    return k;
}

/* --- errors --------------------------------------------------------------------------------------- */

/* MS_E_BACKEND (MS_E_OOM for out-of-memory codes) naming the call and the library's error; while the
** context captures, the first failure is also kept for ms_graph_end. */
ms_status ms_cuda_fail(ms_ctx *ctx, cudaError_t e, const char *call, const char *file, int line);
ms_status ms_cublas_fail(ms_ctx *ctx, cublasStatus_t st, const char *call, const char *file, int line);
ms_status ms_cusolver_fail(ms_ctx *ctx, cusolverStatus_t st, const char *call, const char *file, int line);
/* Records st (already reported) as the capture's failure when ctx is capturing; returns st. */
ms_status ms_cuda_note_failure(ms_ctx *ctx, ms_status st);

#define MS_CUDA_TRY(ctx, call)                                                                         \
    do {                                                                                               \
        cudaError_t ms_e_ = (call);                                                                    \
        if (ms_e_ != cudaSuccess) return ms_cuda_fail((ctx), ms_e_, #call, __FILE__, __LINE__);       \
    } while (0)
#define MS_CUBLAS_TRY(ctx, call)                                                                       \
    do {                                                                                               \
        cublasStatus_t ms_s_ = (call);                                                                 \
        if (ms_s_ != CUBLAS_STATUS_SUCCESS) return ms_cublas_fail((ctx), ms_s_, #call, __FILE__, __LINE__); \
    } while (0)
#define MS_CUSOLVER_TRY(ctx, call)                                                                     \
    do {                                                                                               \
        cusolverStatus_t ms_s_ = (call);                                                               \
        if (ms_s_ != CUSOLVER_STATUS_SUCCESS) return ms_cusolver_fail((ctx), ms_s_, #call, __FILE__, __LINE__); \
    } while (0)
/* A launcher's status, noted for the capture when it failed. */
#define MS_CUDA_LAUNCH(ctx, call)                                                                      \
    do {                                                                                               \
        ms_status ms_l_ = (call);                                                                      \
        if (ms_l_ != MS_OK) return ms_cuda_note_failure((ctx), ms_l_);                                 \
    } while (0)

/* --- profiler ranges (NVTX v3, header-only, from the CUDA toolkit) --------------------------------------- */

#ifdef MS_WITH_NVTX
#include <nvtx3/nvToolsExt.h>
static inline void ms_nvtx_end_(const int *unused) { (void)unused; nvtxRangePop(); }
/* An NVTX range named `name` from this line to the end of the enclosing block: one line at the top of a
** backend member shows its kernel family in Nsight Systems (a few ns when no profiler is attached). */
#define MS_NVTX_RANGE(name) \
    __attribute__((cleanup(ms_nvtx_end_), unused)) const int ms_nvtx_range_ = (nvtxRangePushA(name), 0)
#else
#define MS_NVTX_RANGE(name) ((void)0)
#endif

/* --- context (engine/cuda/context.c) -------------------------------------------------------------- */

/* Makes ctx's device current on the calling thread. */
ms_status ms_cuda_enter(ms_ctx *ctx);
/* The cuBLAS / cuSOLVER handle of ctx, created (on ctx's stream) when first needed; refused while
** capturing if it does not exist yet. */
ms_status ms_cuda_blas(ms_ctx *ctx, cublasHandle_t *out);
ms_status ms_cuda_solver(ms_ctx *ctx, cusolverDnHandle_t *out);
/* A temporary device buffer from ctx's pool (freed with ms_cuda_scratch_free; stream-ordered, so freeing
** right after queuing the work that uses it is safe). */
ms_status ms_cuda_scratch(ms_ctx *ctx, size_t nbytes, void **out);
void ms_cuda_scratch_free(ms_ctx *ctx, void *p, size_t nbytes);

/* --- pool (engine/cuda/pool.c) -------------------------------------------------------------------- */

ms_status ms_cuda_pool_new(ms_ctx *ctx, ms_cuda_pool **out);
void ms_cuda_pool_destroy(ms_ctx *ctx, ms_cuda_pool *pool);
ms_status ms_cuda_pool_alloc(ms_ctx *ctx, size_t nbytes, void **out);
void ms_cuda_pool_free(ms_ctx *ctx, void *ptr);
/* Returns the cached free blocks (and the pending ones whose streams have passed them) to the driver. */
ms_status ms_cuda_pool_trim(ms_ctx *ctx);
/* Marks that work queued on ctx's stream uses memory at p: when p lies in another context's pool, the
** block is not reused there before ctx's stream has passed this point (an event is recorded). */
void ms_cuda_pool_track(ms_ctx *ctx, const void *p);
/* Capture bookkeeping: blocks allocated or freed while `g` captures are kept for it until it is freed. */
void ms_cuda_pool_capture_begin(ms_ctx *ctx, ms_cuda_graph *g);
void ms_cuda_pool_capture_end(ms_ctx *ctx);
void ms_cuda_pool_graph_release(ms_ctx *ctx, ms_cuda_graph *g);

/* --- backend members ------------------------------------------------------------------------------ */

/* engine/cuda/capture.c: the capture state, joining a caller's capture, profiler ranges */
ms_capture ms_cuda_capture_state(const ms_ctx *ctx);
ms_status ms_cuda_graph_join(ms_ctx *ctx);
void ms_cuda_join_markers_free(ms_cuda_ctx *c);   /* with the context: the joins' pool markers */
ms_status ms_cuda_graph_leave(ms_ctx *ctx);
void ms_cuda_profile_push(ms_ctx *ctx, const char *name);
void ms_cuda_profile_pop(ms_ctx *ctx);

ms_status ms_cuda_copy(ms_ctx *ctx, const ms_nary *it);
ms_status ms_cuda_fill(ms_ctx *ctx, const ms_nary *it, ms_scalar v);
ms_status ms_cuda_rand(ms_ctx *ctx, ms_tensor *dst, const ms_rand_options *o);
ms_status ms_cuda_unary(ms_ctx *ctx, const ms_nary *it, ms_unary_op op);
ms_status ms_cuda_binary(ms_ctx *ctx, const ms_nary *it, ms_binary_op op);
ms_status ms_cuda_binary_scalar(ms_ctx *ctx, const ms_nary *it, ms_scalar s, ms_binary_op op, int scalar_first);
ms_status ms_cuda_clamp(ms_ctx *ctx, const ms_nary *it, double lo, double hi);
ms_status ms_cuda_lerp(ms_ctx *ctx, const ms_nary *it, ms_scalar w);
ms_status ms_cuda_addc(ms_ctx *ctx, const ms_nary *it, ms_scalar v, int divide);
ms_status ms_cuda_reduce(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, ms_reduce_op op, int dim);
ms_status ms_cuda_dot(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b);
ms_status ms_cuda_matmul(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                         const ms_matmul_options *o);
ms_status ms_cuda_eye(ms_ctx *ctx, ms_tensor *dst);
ms_status ms_cuda_diag(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src);
ms_status ms_cuda_eigh(ms_ctx *ctx, ms_tensor *w, ms_tensor *v, const ms_tensor *a, int *info);
/* engine/cuda/optim.c */
ms_status ms_cuda_foreach_sumsq(ms_ctx *ctx, ms_tensor *dst, int n, const ms_tensor *const *srcs);
ms_status ms_cuda_foreach_scale(ms_ctx *ctx, int n, ms_tensor *const *tensors, ms_scalar s);
ms_status ms_cuda_adamw_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                             ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_sq, const double *scales,
                             const ms_adamw_options *o);
ms_status ms_cuda_sgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                           ms_tensor *const *momentum_buf, const double *scales, const ms_sgd_options *o);
ms_status ms_cuda_adamw8_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                              ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_scale,
                              ms_tensor *const *exp_avg_sq, ms_tensor *const *exp_avg_sq_scale,
                              const double *scales, const ms_adamw8_options *o);
/* The context's MSK_OPTIM_CAP integer counters for "last block" reductions, zero between calls (made on first
** use, which cannot be captured: `op` names the caller in that error). */
ms_status ms_cuda_tickets(ms_ctx *ctx, const char *op, unsigned **out);
/* engine/cuda/sinkgd.c */
ms_status ms_cuda_sinkgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                              ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                              const double *scales, const ms_sinkgd_options *o);
ms_status ms_cuda_sinkgd_step_sharded(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                                      ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                                      const double *scales, const ms_shard *shards, const ms_sinkgd_options *o,
                                      const ms_exchange *x);
/* engine/cuda/dash.c: Shampoo on stacked blocks; ms_cuda_dash_release frees c->dash (context teardown) */
ms_status ms_cuda_blocks_gather(ms_ctx *ctx, ms_tensor *stack, int n, const ms_block *blocks);
ms_status ms_cuda_blocks_apply(ms_ctx *ctx, int n, const ms_block *blocks, const ms_tensor *stack,
                               const ms_tensor *scale, const ms_blocks_apply_options *o);
ms_status ms_cuda_dash_graft(ms_ctx *ctx, ms_tensor *grad_ema, ms_tensor *adam_v, ms_tensor *norm,
                             ms_tensor *pgraft, const ms_tensor *grad, const ms_dash_graft_options *o);
ms_status ms_cuda_inv_root(ms_ctx *ctx, ms_tensor *x, ms_tensor *residual, ms_tensor *iters, const ms_tensor *a,
                           const ms_root_options *o);
ms_status ms_cuda_spectrum_estimate(ms_ctx *ctx, ms_tensor *lam_max, ms_tensor *lam_min, const ms_tensor *a,
                                    const ms_tensor *x_root, const ms_spectrum_options *o);
ms_status ms_cuda_blocks_gather_factors(ms_ctx *ctx, ms_tensor *stack, ms_tensor *left, ms_tensor *right, int n,
                                        const ms_block *blocks, const ms_dash_factor_options *o);
void ms_cuda_dash_release(ms_cuda_ctx *c);

/* --- shared by the op files (engine/cuda/ops.c) --------------------------------------------------- */

/* dst <- src for tensors of ctx's device of the same shape (any dtypes and layouts). */
ms_status ms_cuda_copy_tensor(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src);
/* Every element of t <- value. */
ms_status ms_cuda_fill_tensor(ms_ctx *ctx, ms_tensor *t, double value);
/* A tensor header describing memory that no tensor owns yet: `like`'s storage, shape and strides given. */
void ms_cuda_view(ms_tensor *out, const ms_tensor *like, int ndim, const int64_t *shape, const int64_t *strides,
                  int64_t offset);
/* Notes every tensor's memory for cross-context reuse (see ms_cuda_pool_track). */
void ms_cuda_track_tensor(ms_ctx *ctx, const ms_tensor *t);

#endif /* MS_CUDA_H */

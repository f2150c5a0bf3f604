/*
** The CUDA backend table: device discovery (0 devices, silently, where there is no GPU or driver),
** contexts (stream, lazily created cuBLAS/cuSOLVER handles, the pool), host transfers, events, graph
** capture and replay, and the conversion of CUDA / cuBLAS / cuSOLVER errors into statuses and messages.
*/
#include "cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --- errors --------------------------------------------------------------------------------------- */

ms_status ms_cuda_note_failure(ms_ctx *ctx, ms_status st)
{
    ms_cuda_ctx *c = ctx ? ms_cuda(ctx) : NULL;
    if (st != MS_OK && c && c->capture && c->capture_status == MS_OK) {
        c->capture_status = st;
        memcpy(c->capture_error, ctx->last_error, sizeof c->capture_error);
    }
    return st;
}

ms_status ms_cuda_fail(ms_ctx *ctx, cudaError_t e, const char *call, const char *file, int line)
{
    (void)cudaGetLastError();   /* a non-sticky error must not be reported again by the next launch */
    ms_status st = e == cudaErrorMemoryAllocation ? MS_E_OOM : MS_E_BACKEND;
    ms_error_at(ctx, st, file, line, "cuda%s%s: %s failed: %s (%s)", ctx ? " on " : "", ctx ? ctx->name : "", call,
                cudaGetErrorName(e), cudaGetErrorString(e));
    return ms_cuda_note_failure(ctx, st);
}

ms_status ms_cublas_fail(ms_ctx *ctx, cublasStatus_t s, const char *call, const char *file, int line)
{
    ms_status st = s == CUBLAS_STATUS_ALLOC_FAILED ? MS_E_OOM : MS_E_BACKEND;
    ms_error_at(ctx, st, file, line, "cuBLAS on %s: %s failed: %s (%s)", ctx->name, call, cublasGetStatusName(s),
                cublasGetStatusString(s));
    return ms_cuda_note_failure(ctx, st);
}

static const char *cusolver_status_name(cusolverStatus_t s)
{
    switch (s) {
    case CUSOLVER_STATUS_SUCCESS:                   return "CUSOLVER_STATUS_SUCCESS";
    case CUSOLVER_STATUS_NOT_INITIALIZED:           return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED:              return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE:             return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH:             return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_MAPPING_ERROR:             return "CUSOLVER_STATUS_MAPPING_ERROR";
    case CUSOLVER_STATUS_EXECUTION_FAILED:          return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR:            return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED: return "CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED";
    case CUSOLVER_STATUS_NOT_SUPPORTED:             return "CUSOLVER_STATUS_NOT_SUPPORTED";
    case CUSOLVER_STATUS_INVALID_WORKSPACE:         return "CUSOLVER_STATUS_INVALID_WORKSPACE";
    default:                                        return "CUSOLVER_STATUS_(other)";
    }
}

ms_status ms_cusolver_fail(ms_ctx *ctx, cusolverStatus_t s, const char *call, const char *file, int line)
{
    ms_status st = s == CUSOLVER_STATUS_ALLOC_FAILED ? MS_E_OOM : MS_E_BACKEND;
    ms_error_at(ctx, st, file, line, "cuSOLVER on %s: %s failed: %s (%d)", ctx->name, call, cusolver_status_name(s),
                (int)s);
    return ms_cuda_note_failure(ctx, st);
}

/* --- devices -------------------------------------------------------------------------------------- */

static cudaError_t probe_error = cudaSuccess;

int ms_cuda_device_count(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        probe_error = e;
        return 0;
    }
    return n;
}

const char *ms_cuda_probe_error(void)
{
    return probe_error == cudaSuccess ? "no GPU found" : cudaGetErrorString(probe_error);
}

ms_status ms_cuda_enter(ms_ctx *ctx)
{
    /* the runtime's last error may be another caller's (a trainer's failed call it never read): left there, it
    ** was taken for the failure of this op's launch (MSK_CHECK_LAUNCH reads it); sticky errors stay anyway */
    (void)cudaGetLastError();
    int dev = ms_cuda(ctx)->device, cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != dev) MS_CUDA_TRY(ctx, cudaSetDevice(dev));
    return MS_OK;
}

/* --- contexts ------------------------------------------------------------------------------------- */

static void release_handles(ms_cuda_ctx *c)
{
    if (c->blas) cublasDestroy(c->blas);
    if (c->blas_workspace) cudaFree(c->blas_workspace);
    if (c->solver) cusolverDnDestroy(c->solver);
    if (c->tickets) cudaFree(c->tickets);
    ms_cuda_dash_release(c);
    c->tickets = NULL;
    c->blas = NULL;
    c->blas_workspace = NULL;
    c->solver = NULL;
}

static ms_status cuda_ctx_init(ms_ctx *ctx, const ms_ctx_options *opts)
{
    ms_cuda_ctx *c = calloc(1, sizeof *c);
    if (c == NULL) return MS_FAIL(NULL, MS_E_OOM, "ms_ctx_new: out of host memory");
    c->device = ctx->index;
    ctx->impl = c;
    ms_status st = ms_cuda_enter(ctx);
    if (st == MS_OK && opts && opts->stream) {
        int dev = -1;
        cudaError_t e = cudaStreamGetDevice((cudaStream_t)opts->stream, &dev);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            st = MS_FAIL(NULL, MS_E_ARG, "ms_ctx_new: the stream given is not a valid CUDA stream (%s)",
                         cudaGetErrorName(e));
        } else if (dev != c->device) {
            st = MS_FAIL(NULL, MS_E_DEVICE, "ms_ctx_new: the stream given belongs to cuda:%d, not %s", dev,
                         ctx->name);
        } else {
            c->stream = (cudaStream_t)opts->stream;
        }
    } else if (st == MS_OK) {
        cudaError_t e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
        if (e == cudaSuccess) c->own_stream = true;
        else st = ms_cuda_fail(NULL, e, "cudaStreamCreateWithFlags", __FILE__, __LINE__);
    }
    if (st == MS_OK) st = ms_cuda_pool_new(ctx, &c->pool);
    if (st != MS_OK) {
        if (c->own_stream) cudaStreamDestroy(c->stream);
        free(c);
        ctx->impl = NULL;
        return st;
    }
    return MS_OK;
}

/* The last tensor, event and graph of the context are gone: wait for its stream, then free everything. */
static void cuda_ctx_release(ms_ctx *ctx)
{
    ms_cuda_ctx *c = ms_cuda(ctx);
    if (c == NULL) return;
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != c->device) cudaSetDevice(c->device);
    if (c->capture) {   /* abandoned capture: end it so the stream is usable again */
        cudaGraph_t g = NULL;
        if (cudaStreamEndCapture(c->stream, &g) == cudaSuccess && g) cudaGraphDestroy(g);
        ms_cuda_pool_capture_end(ctx);
        free(c->capture);
        c->capture = NULL;
    }
    cudaStreamSynchronize(c->stream);
    release_handles(c);
    ms_cuda_pool_destroy(ctx, c->pool);
    ms_cuda_join_markers_free(c);
    if (c->own_stream) cudaStreamDestroy(c->stream);
    (void)cudaGetLastError();
    free(c);
    ctx->impl = NULL;
}

static ms_status cuda_alloc(ms_ctx *ctx, size_t nbytes, void **out)
{
    MS_TRY(ms_cuda_enter(ctx));
    return ms_cuda_pool_alloc(ctx, nbytes, out);
}

static void cuda_free(ms_ctx *ctx, void *ptr, size_t nbytes)
{
    (void)nbytes;
    ms_cuda_pool_free(ctx, ptr);
}

static ms_status refuse_in_capture(ms_ctx *ctx, const char *what)
{
    if (ms_cuda(ctx)->capture == NULL) return MS_OK;
    return ms_cuda_note_failure(ctx, MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s on %s: not possible while the context "
                                             "captures a graph (it waits for the device)", what, ctx->name));
}

/* As refuse_in_capture, for a capture of the stream by its owner (a trainer's graph, joined or not). */
static ms_status refuse_in_owner_capture(ms_ctx *ctx, const char *what, const char *why)
{
    if (!ms_cuda(ctx)->joined && ms_cuda_capture_state(ctx) == MS_CAPTURE_NONE) return MS_OK;
    return MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s on %s: not possible while the stream's owner captures it (%s)", what,
                   ctx->name, why);
}

static ms_status cuda_sync(ms_ctx *ctx)
{
    MS_TRY(refuse_in_capture(ctx, "ms_ctx_sync"));
    MS_TRY(ms_cuda_enter(ctx));
    MS_CUDA_TRY(ctx, cudaStreamSynchronize(ms_cuda(ctx)->stream));
    return MS_OK;
}

static ms_status cuda_memcpy_to_host(ms_ctx *ctx, void *dst, const void *src, size_t nbytes)
{
    MS_TRY(refuse_in_capture(ctx, "copy to the host"));
    MS_TRY(ms_cuda_enter(ctx));
    cudaStream_t s = ms_cuda(ctx)->stream;
    if (nbytes) MS_CUDA_TRY(ctx, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, s));
    MS_CUDA_TRY(ctx, cudaStreamSynchronize(s));
    return MS_OK;
}

static ms_status cuda_memcpy_from_host(ms_ctx *ctx, void *dst, const void *src, size_t nbytes)
{
    MS_TRY(refuse_in_capture(ctx, "copy from the host"));
    MS_TRY(ms_cuda_enter(ctx));
    cudaStream_t s = ms_cuda(ctx)->stream;
    if (nbytes) MS_CUDA_TRY(ctx, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, s));
    MS_CUDA_TRY(ctx, cudaStreamSynchronize(s));   /* the host buffer is the caller's again on return */
    return MS_OK;
}

ms_status ms_cuda_blas(ms_ctx *ctx, cublasHandle_t *out)
{
    ms_cuda_ctx *c = ms_cuda(ctx);
    if (c->blas == NULL) {
        if (ms_cuda_capturing(ctx))   /* (a joined capture too: the driver cannot allocate there either) */
            return ms_cuda_note_failure(ctx, MS_FAIL(ctx, MS_E_UNSUPPORTED, "cuBLAS on %s: the handle cannot be "
                                                     "created while capturing", ctx->name));
        cublasHandle_t h;
        MS_CUBLAS_TRY(ctx, cublasCreate(&h));
        void *ws = NULL;
        cudaError_t e = cudaMalloc(&ws, MS_CUDA_BLAS_WORKSPACE);
        cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
        if (e == cudaSuccess) s = cublasSetStream(h, c->stream);
        if (e == cudaSuccess && s == CUBLAS_STATUS_SUCCESS) s = cublasSetWorkspace(h, ws, MS_CUDA_BLAS_WORKSPACE);
        if (e != cudaSuccess || s != CUBLAS_STATUS_SUCCESS) {
            if (ws) cudaFree(ws);
            cublasDestroy(h);
            return e != cudaSuccess ? ms_cuda_fail(ctx, e, "cudaMalloc (cuBLAS workspace)", __FILE__, __LINE__)
                                    : ms_cublas_fail(ctx, s, "cublasSetStream/cublasSetWorkspace", __FILE__, __LINE__);
        }
        c->blas = h;
        c->blas_workspace = ws;
    }
    *out = c->blas;
    return MS_OK;
}

ms_status ms_cuda_solver(ms_ctx *ctx, cusolverDnHandle_t *out)
{
    ms_cuda_ctx *c = ms_cuda(ctx);
    if (c->solver == NULL) {
        if (ms_cuda_capturing(ctx))
            return ms_cuda_note_failure(ctx, MS_FAIL(ctx, MS_E_UNSUPPORTED, "cuSOLVER on %s: the handle cannot be "
                                                     "created while capturing", ctx->name));
        cusolverDnHandle_t h;
        MS_CUSOLVER_TRY(ctx, cusolverDnCreate(&h));
        cusolverStatus_t s = cusolverDnSetStream(h, c->stream);
        if (s != CUSOLVER_STATUS_SUCCESS) {
            cusolverDnDestroy(h);
            return ms_cusolver_fail(ctx, s, "cusolverDnSetStream", __FILE__, __LINE__);
        }
        c->solver = h;
    }
    *out = c->solver;
    return MS_OK;
}

ms_status ms_cuda_scratch(ms_ctx *ctx, size_t nbytes, void **out)
{
    return ms_ctx_alloc(ctx, nbytes, out);
}

void ms_cuda_scratch_free(ms_ctx *ctx, void *p, size_t nbytes)
{
    ms_ctx_dealloc(ctx, p, nbytes);
}

/* --- runtime members ------------------------------------------------------------------------------ */

static void *cuda_stream(const ms_ctx *ctx) { return ms_cuda(ctx)->stream; }

static ms_status cuda_empty_cache(ms_ctx *ctx)
{
    MS_TRY(refuse_in_capture(ctx, "ms_ctx_empty_cache"));
    /* the owner's capture forbids the wait and the cudaFree calls as much: the wait invalidates it, and a cudaFree
    ** refused there loses its block (the pool forgets it, the driver keeps it) */
    MS_TRY(refuse_in_owner_capture(ctx, "ms_ctx_empty_cache", "it waits for the device and frees memory"));
    MS_TRY(ms_cuda_enter(ctx));
    return ms_cuda_pool_trim(ctx);
}

static ms_status cuda_event_create(ms_ctx *ctx, void **ev)
{
    MS_TRY(ms_cuda_enter(ctx));
    cudaEvent_t e;
    MS_CUDA_TRY(ctx, cudaEventCreate(&e));
    *ev = e;
    return MS_OK;
}

static void cuda_event_destroy(ms_ctx *ctx, void *ev)
{
    (void)ctx;
    cudaEventDestroy((cudaEvent_t)ev);
}

static ms_status cuda_event_record(ms_ctx *ctx, void *ev)
{
    MS_TRY(refuse_in_capture(ctx, "ms_event_record"));
    /* recorded into the owner's capture, the event would mark no point of the stream: ms_event_elapsed failed on it
    ** later (the runtime refuses to wait for an event last recorded in a capture) */
    MS_TRY(refuse_in_owner_capture(ctx, "ms_event_record", "the event would mark no point of the stream"));
    MS_TRY(ms_cuda_enter(ctx));
    MS_CUDA_TRY(ctx, cudaEventRecord((cudaEvent_t)ev, ms_cuda(ctx)->stream));
    return MS_OK;
}

static ms_status cuda_event_elapsed(ms_ctx *ctx, void *start, void *end, double *ms)
{
    MS_TRY(ms_cuda_enter(ctx));
    float f = 0;
    MS_CUDA_TRY(ctx, cudaEventSynchronize((cudaEvent_t)end));
    MS_CUDA_TRY(ctx, cudaEventElapsedTime(&f, (cudaEvent_t)start, (cudaEvent_t)end));
    *ms = f;
    return MS_OK;
}

static ms_status cuda_graph_begin(ms_ctx *ctx)
{
    ms_cuda_ctx *c = ms_cuda(ctx);
    if (c->capture)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_graph_begin: %s is already capturing a graph", ctx->name);
    /* the stream's owner captures it (joined or not): cudaStreamBeginCapture would fail there, and making the
    ** handles below would call the driver inside the owner's capture and invalidate it */
    if (c->joined || ms_cuda_capture_state(ctx) != MS_CAPTURE_NONE)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_graph_begin: the stream of %s is being captured by its owner%s "
                       "(captures do not nest)", ctx->name, c->joined ? " (joined)" : "");
    MS_TRY(ms_cuda_enter(ctx));
    cublasHandle_t blas;
    cusolverDnHandle_t solver;
    MS_TRY(ms_cuda_blas(ctx, &blas));     /* the handles cannot be made during the capture */
    MS_TRY(ms_cuda_solver(ctx, &solver));
    ms_cuda_graph *g = calloc(1, sizeof *g);
    if (g == NULL) return MS_FAIL(ctx, MS_E_OOM, "ms_graph_begin: out of host memory");
    cudaError_t e = cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        free(g);
        return ms_cuda_fail(ctx, e, "cudaStreamBeginCapture", __FILE__, __LINE__);
    }
    c->capture = g;
    c->capture_status = MS_OK;
    c->capture_error[0] = '\0';
    ms_cuda_pool_capture_begin(ctx, g);
    return MS_OK;
}

static ms_status cuda_graph_end(ms_ctx *ctx, ms_graph **out)
{
    ms_cuda_ctx *c = ms_cuda(ctx);
    if (c->capture == NULL) return MS_FAIL(ctx, MS_E_ARG, "ms_graph_end: %s is not capturing", ctx->name);
    MS_TRY(ms_cuda_enter(ctx));
    ms_cuda_graph *g = c->capture;
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &graph);
    ms_status failed = c->capture_status;
    c->capture = NULL;
    c->capture_status = MS_OK;
    ms_cuda_pool_capture_end(ctx);
    ms_status st = MS_OK;
    if (failed != MS_OK) {
        (void)cudaGetLastError();
        st = MS_FAIL(ctx, failed, "ms_graph_end: an op failed during the capture, the graph would be incomplete: %s",
                     c->capture_error);
    } else if (e != cudaSuccess) {
        st = ms_cuda_fail(ctx, e, "cudaStreamEndCapture", __FILE__, __LINE__);
    } else {
        e = cudaGraphInstantiate(&g->exec, graph, 0);
        if (e != cudaSuccess) st = ms_cuda_fail(ctx, e, "cudaGraphInstantiate", __FILE__, __LINE__);
    }
    if (st != MS_OK) {
        if (graph) cudaGraphDestroy(graph);
        ms_cuda_pool_graph_release(ctx, g);
        free(g);
        return st;
    }
    size_t nodes = 0;
    if (cudaGraphGetNodes(graph, NULL, &nodes) != cudaSuccess) (void)cudaGetLastError();
    g->graph = graph;
    g->nodes = (int64_t)nodes;
    ms_ctx_retain(ctx);
    g->base.ctx = ctx;
    *out = &g->base;
    return MS_OK;
}

static ms_status cuda_graph_launch(ms_ctx *ctx, ms_graph *base)
{
    ms_cuda_graph *g = (ms_cuda_graph *)base;
    if (ms_cuda(ctx)->capture)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_graph_launch: %s is capturing (graphs do not nest here)", ctx->name);
    MS_TRY(ms_cuda_enter(ctx));
    MS_CUDA_TRY(ctx, cudaGraphLaunch(g->exec, ms_cuda(ctx)->stream));
    ms_ctx_count_launch(ctx);
    return MS_OK;
}

static int64_t cuda_graph_num_nodes(const ms_graph *base) { return ((const ms_cuda_graph *)base)->nodes; }

static void cuda_graph_free(ms_graph *base)
{
    ms_cuda_graph *g = (ms_cuda_graph *)base;
    ms_ctx *ctx = base->ctx;
    ms_cuda_enter(ctx);
    cudaGraphExecDestroy(g->exec);   /* an in-flight replay finishes first; the driver defers the release */
    cudaGraphDestroy(g->graph);
    ms_cuda_pool_graph_release(ctx, g);
    free(g);
    ms_ctx_release(ctx);
}

#ifdef MS_WITH_NCCL
/* communicators (engine/cuda/comm.c) */
ms_status ms_cuda_comm_init(ms_ctx *ctx, const unsigned char id[MS_COMM_ID_BYTES], int rank, int world_size,
                            int timeout_ms, void **out);
void ms_cuda_comm_destroy(ms_ctx *ctx, void *comm);
ms_status ms_cuda_comm_all_reduce(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op);
ms_status ms_cuda_comm_broadcast(ms_ctx *ctx, void *comm, ms_tensor *t, int root);
ms_status ms_cuda_comm_all_gather(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src);
ms_status ms_cuda_comm_reduce_scatter(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src,
                                      ms_comm_op op);
ms_status ms_cuda_comm_group_begin(ms_ctx *ctx, void *comm);
ms_status ms_cuda_comm_group_end(ms_ctx *ctx, void *comm);
#endif

const ms_backend ms_cuda_backend = {
    .name             = "cuda",
    .ctx_init         = cuda_ctx_init,
    .ctx_release      = cuda_ctx_release,
    .alloc            = cuda_alloc,
    .free             = cuda_free,
    .sync             = cuda_sync,
    .memcpy_to_host   = cuda_memcpy_to_host,
    .memcpy_from_host = cuda_memcpy_from_host,
    .copy             = ms_cuda_copy,
    .fill             = ms_cuda_fill,
    .rand             = ms_cuda_rand,
    .unary            = ms_cuda_unary,
    .binary           = ms_cuda_binary,
    .binary_scalar    = ms_cuda_binary_scalar,
    .clamp            = ms_cuda_clamp,
    .lerp             = ms_cuda_lerp,
    .addc             = ms_cuda_addc,
    .reduce           = ms_cuda_reduce,
    .dot              = ms_cuda_dot,
    .matmul           = ms_cuda_matmul,
    .eye              = ms_cuda_eye,
    .diag             = ms_cuda_diag,
    .eigh             = ms_cuda_eigh,
    .stream           = cuda_stream,
    .empty_cache      = cuda_empty_cache,
    .event_create     = cuda_event_create,
    .event_destroy    = cuda_event_destroy,
    .event_record     = cuda_event_record,
    .event_elapsed    = cuda_event_elapsed,
    .graph_begin      = cuda_graph_begin,
    .graph_end        = cuda_graph_end,
    .graph_launch     = cuda_graph_launch,
    .graph_num_nodes  = cuda_graph_num_nodes,
    .graph_free       = cuda_graph_free,
    .foreach_sumsq    = ms_cuda_foreach_sumsq,
    .foreach_scale    = ms_cuda_foreach_scale,
    .adamw_step       = ms_cuda_adamw_step,
    .sgd_step         = ms_cuda_sgd_step,
    .sinkgd_step      = ms_cuda_sinkgd_step,
    .sinkgd_step_sharded = ms_cuda_sinkgd_step_sharded,
    .adamw8_step      = ms_cuda_adamw8_step,
    .capture_state    = ms_cuda_capture_state,
    .graph_join       = ms_cuda_graph_join,
    .graph_leave      = ms_cuda_graph_leave,
    .profile_push     = ms_cuda_profile_push,
    .profile_pop      = ms_cuda_profile_pop,
    .blocks_gather    = ms_cuda_blocks_gather,
    .blocks_apply     = ms_cuda_blocks_apply,
    .dash_graft       = ms_cuda_dash_graft,
    .inv_root         = ms_cuda_inv_root,
    .spectrum_estimate = ms_cuda_spectrum_estimate,
#ifdef MS_WITH_NCCL
    .comm_init        = ms_cuda_comm_init,
    .comm_destroy     = ms_cuda_comm_destroy,
    .comm_all_reduce  = ms_cuda_comm_all_reduce,
    .comm_broadcast   = ms_cuda_comm_broadcast,
    .comm_all_gather  = ms_cuda_comm_all_gather,
    .comm_reduce_scatter = ms_cuda_comm_reduce_scatter,
    .comm_group_begin = ms_cuda_comm_group_begin,
    .comm_group_end   = ms_cuda_comm_group_end,
#endif
    .blocks_gather_factors = ms_cuda_blocks_gather_factors,
};

/*
** Who captures a CUDA context's stream, working inside a capture someone else began on it (a trainer's own
** graph: ms_graph_join / ms_graph_leave), and NVTX profiler ranges.
*/
#include "cuda.h"

/* The pool keeps every block allocated or freed during a join "for" the join's marker, which lives as long as
** the context: the caller's graph may replay until then.  Only its address is used.  One marker per join: with
** one for all joins, a tensor made in one join and dropped in a later one went to the later capture's reuse
** list, and that graph's replays wrote memory the earlier graph's replays still write. */
struct ms_cuda_join_marker {
    ms_cuda_graph               keeper;
    struct ms_cuda_join_marker *next;
};

void ms_cuda_join_markers_free(ms_cuda_ctx *c)
{
    while (c->joins) {
        struct ms_cuda_join_marker *next = c->joins->next;
        free(c->joins);
        c->joins = next;
    }
}

/* The stream's capture status; cudaStreamCaptureStatusNone when the query fails. */
static enum cudaStreamCaptureStatus stream_status(const ms_ctx *ctx)
{
    enum cudaStreamCaptureStatus s = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(ms_cuda(ctx)->stream, &s) != cudaSuccess) {
        (void)cudaGetLastError();
        return cudaStreamCaptureStatusNone;
    }
    return s;
}

ms_capture ms_cuda_capture_state(const ms_ctx *ctx)
{
    if (ms_cuda(ctx)->capture) return MS_CAPTURE_GRAPH;
    return stream_status(ctx) == cudaStreamCaptureStatusNone ? MS_CAPTURE_NONE : MS_CAPTURE_FOREIGN;
}

ms_status ms_cuda_graph_join(ms_ctx *ctx)
{
    ms_cuda_ctx *c = ms_cuda(ctx);
    if (c->joined) return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_graph_join: %s has joined a capture already", ctx->name);
    if (c->capture)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_graph_join: %s is capturing its own graph (ms_graph_begin): its "
                       "ops are recorded already", ctx->name);
    switch (stream_status(ctx)) {
    case cudaStreamCaptureStatusActive:
        break;
    case cudaStreamCaptureStatusInvalidated:
        return MS_FAIL(ctx, MS_E_BACKEND, "ms_graph_join: the capture on the stream of %s was invalidated by an "
                       "earlier error (its owner must end it)", ctx->name);
    default:
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_graph_join: the stream of %s is not being captured (join "
                       "inside a capture begun on that stream)", ctx->name);
    }
    struct ms_cuda_join_marker *m = calloc(1, sizeof *m);
    if (m == NULL) return MS_FAIL(ctx, MS_E_OOM, "ms_graph_join: out of host memory");
    m->next = c->joins;
    c->joins = m;
    ms_cuda_pool_capture_begin(ctx, &m->keeper);
    c->joined = true;
    return MS_OK;
}

ms_status ms_cuda_graph_leave(ms_ctx *ctx)
{
    ms_cuda_ctx *c = ms_cuda(ctx);
    if (!c->joined) return MS_FAIL(ctx, MS_E_ARG, "ms_graph_leave: %s has not joined a capture", ctx->name);
    ms_cuda_pool_capture_end(ctx);
    c->joined = false;
    return MS_OK;
}

void ms_cuda_profile_push(ms_ctx *ctx, const char *name)
{
    (void)ctx;
#ifdef MS_WITH_NVTX
    nvtxRangePushA(name);
#else
    (void)name;
#endif
}

void ms_cuda_profile_pop(ms_ctx *ctx)
{
    (void)ctx;
#ifdef MS_WITH_NVTX
    nvtxRangePop();
#endif
}

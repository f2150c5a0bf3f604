/*
** The runtime entry points of the public ABI: the context's native stream, emptying its cache, events
** (device timestamps, or the host's monotonic clock where the backend has none), graph capture/replay, the
** capture state and joining a caller's capture, and profiler ranges, dispatched to the backend's optional
** members.
*/
#include "internal.h"

#include <stdlib.h>
#include <time.h>

struct ms_event {
    ms_ctx *ctx;        /* retained */
    void   *dev;        /* the backend's event, NULL on the host clock */
    double  host_ms;
    bool    recorded;
};

static bool same_device(const ms_ctx *a, const ms_ctx *b) { return a->type == b->type && a->index == b->index; }

MS_API void *ms_ctx_stream(const ms_ctx *ctx)
{
    return ctx && ctx->backend->stream ? ctx->backend->stream(ctx) : NULL;
}

MS_API ms_status ms_ctx_empty_cache(ms_ctx *ctx)
{
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "ms_ctx_empty_cache: ctx is NULL");
    return ctx->backend->empty_cache ? ctx->backend->empty_cache(ctx) : MS_OK;
}

/* --- events -------------------------------------------------------------------------------------- */

MS_API ms_status ms_event_new(ms_ctx *ctx, ms_event **out)
{
    if (out == NULL) return MS_FAIL(ctx, MS_E_ARG, "ms_event_new: out is NULL");
    *out = NULL;
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "ms_event_new: ctx is NULL");
    ms_event *ev = calloc(1, sizeof *ev);
    if (ev == NULL) return MS_FAIL(ctx, MS_E_OOM, "ms_event_new: out of host memory");
    if (ctx->backend->event_create) {
        ms_status st = ctx->backend->event_create(ctx, &ev->dev);
        if (st != MS_OK) { free(ev); return st; }
    }
    ms_ctx_retain(ctx);
    ev->ctx = ctx;
    *out = ev;
    return MS_OK;
}

MS_API void ms_event_free(ms_event *ev)
{
    if (ev == NULL) return;
    if (ev->dev) ev->ctx->backend->event_destroy(ev->ctx, ev->dev);
    ms_ctx_release(ev->ctx);
    free(ev);
}

MS_API ms_status ms_event_record(ms_ctx *ctx, ms_event *ev)
{
    if (ctx == NULL || ev == NULL) return MS_FAIL(ctx, MS_E_ARG, "ms_event_record: ctx or ev is NULL");
    if (!same_device(ctx, ev->ctx))
        return MS_FAIL(ctx, MS_E_DEVICE, "ms_event_record: the event belongs to %s, the context is on %s",
                       ev->ctx->name, ctx->name);
    if (ev->dev) {
        MS_TRY(ctx->backend->event_record(ctx, ev->dev));
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ev->host_ms = (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
    }
    ev->recorded = true;
    return MS_OK;
}

MS_API ms_status ms_event_elapsed(const ms_event *start, const ms_event *end, double *ms)
{
    if (start == NULL || end == NULL || ms == NULL)
        return MS_FAIL(NULL, MS_E_ARG, "ms_event_elapsed: start, end or ms is NULL");
    if (!same_device(start->ctx, end->ctx))
        return MS_FAIL(end->ctx, MS_E_DEVICE, "ms_event_elapsed: events of %s and %s", start->ctx->name,
                       end->ctx->name);
    if (!start->recorded || !end->recorded)
        return MS_FAIL(end->ctx, MS_E_ARG, "ms_event_elapsed: the %s event was never recorded",
                       start->recorded ? "end" : "start");
    if (start->dev) return end->ctx->backend->event_elapsed(end->ctx, start->dev, end->dev, ms);
    *ms = end->host_ms - start->host_ms;
    return MS_OK;
}

/* --- graphs ---------------------------------------------------------------------------------------- */

MS_API ms_status ms_graph_begin(ms_ctx *ctx)
{
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "ms_graph_begin: ctx is NULL");
    if (ctx->backend->graph_begin == NULL)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_graph_begin: %s has no graph capture (CUDA contexts only)",
                       ctx->name);
    return ctx->backend->graph_begin(ctx);
}

MS_API ms_status ms_graph_end(ms_ctx *ctx, ms_graph **out)
{
    if (out == NULL) return MS_FAIL(ctx, MS_E_ARG, "ms_graph_end: out is NULL");
    *out = NULL;
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "ms_graph_end: ctx is NULL");
    if (ctx->backend->graph_end == NULL)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_graph_end: %s has no graph capture (CUDA contexts only)",
                       ctx->name);
    return ctx->backend->graph_end(ctx, out);
}

MS_API ms_status ms_graph_launch(ms_ctx *ctx, ms_graph *g)
{
    if (ctx == NULL || g == NULL) return MS_FAIL(ctx, MS_E_ARG, "ms_graph_launch: ctx or graph is NULL");
    if (g->ctx != ctx)
        return MS_FAIL(ctx, MS_E_ARG, "ms_graph_launch: the graph was captured on another context (%s)",
                       g->ctx->name);
    return ctx->backend->graph_launch(ctx, g);
}

MS_API int64_t ms_graph_num_nodes(const ms_graph *g)
{
    return g ? g->ctx->backend->graph_num_nodes(g) : -1;
}

MS_API void ms_graph_free(ms_graph *g)
{
    if (g) g->ctx->backend->graph_free(g);
}

/* --- capture state, joining a caller's capture, profiler ranges ------------------------------------- */

MS_API ms_capture ms_ctx_is_capturing(const ms_ctx *ctx)
{
    if (ctx == NULL || ctx->backend->capture_state == NULL) return MS_CAPTURE_NONE;
    return ctx->backend->capture_state(ctx);
}

MS_API ms_status ms_graph_join(ms_ctx *ctx)
{
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "ms_graph_join: ctx is NULL");
    if (ctx->backend->graph_join == NULL)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_graph_join: %s has no graph capture (CUDA contexts only)",
                       ctx->name);
    return ctx->backend->graph_join(ctx);
}

MS_API ms_status ms_graph_leave(ms_ctx *ctx)
{
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "ms_graph_leave: ctx is NULL");
    if (ctx->backend->graph_leave == NULL)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_graph_leave: %s has no graph capture (CUDA contexts only)",
                       ctx->name);
    return ctx->backend->graph_leave(ctx);
}

MS_API void ms_profile_push(ms_ctx *ctx, const char *name)
{
    if (ctx && name && ctx->backend->profile_push) ctx->backend->profile_push(ctx, name);
}

MS_API void ms_profile_pop(ms_ctx *ctx)
{
    if (ctx && ctx->backend->profile_pop) ctx->backend->profile_pop(ctx);
}

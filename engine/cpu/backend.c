/*
** The CPU backend table: host memory (64-byte aligned, for SIMD loads), a no-op sync, and the ops of
** the other engine/cpu files.  It is the reference implementation every other backend is tested against.
*/
#include "cpu.h"

#include <stdlib.h>
#include <string.h>

#define ALIGNMENT 64

static ms_status cpu_ctx_init(ms_ctx *ctx, const ms_ctx_options *opts)
{
    int threads = opts ? opts->num_threads : 0;
    if (threads < 0) return MS_FAIL(ctx, MS_E_ARG, "ctx_new: num_threads %d < 0", threads);
    ctx->num_threads = threads;   /* 0: the OpenMP default, decided at each op */
    ctx->impl = NULL;             /* the CPU keeps no per-context state */
    return MS_OK;
}

static void cpu_ctx_release(ms_ctx *ctx)
{
    (void)ctx;
}

static ms_status cpu_alloc(ms_ctx *ctx, size_t nbytes, void **out)
{
    /* aligned_alloc wants a multiple of the alignment; a 0-byte tensor still gets a unique pointer */
    size_t rounded = nbytes ? (nbytes + ALIGNMENT - 1) / ALIGNMENT * ALIGNMENT : ALIGNMENT;
    void *p = rounded >= nbytes ? aligned_alloc(ALIGNMENT, rounded) : NULL;
    if (!p) return MS_FAIL(ctx, MS_E_OOM, "alloc: %zu bytes of host memory not available", nbytes);
    *out = p;
    return MS_OK;
}

static void cpu_free(ms_ctx *ctx, void *ptr, size_t nbytes)
{
    (void)ctx;
    (void)nbytes;
    free(ptr);
}

static ms_status cpu_sync(ms_ctx *ctx)
{
    (void)ctx;   /* every CPU op has finished when it returns */
    return MS_OK;
}

static ms_status cpu_memcpy(ms_ctx *ctx, void *dst, const void *src, size_t nbytes)
{
    (void)ctx;
    if (nbytes) memcpy(dst, src, nbytes);
    return MS_OK;
}

/* communicators over TCP (engine/cpu/comm.c) */
ms_status ms_cpu_comm_connect(ms_ctx *ctx, const char *addr, int port, int rank, int world_size, int timeout_ms,
                              void **out);
void ms_cpu_comm_destroy(ms_ctx *ctx, void *comm);
void ms_cpu_comm_abort(ms_ctx *ctx, void *comm, const char *why);
ms_status ms_cpu_comm_all_reduce(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op);
ms_status ms_cpu_comm_broadcast(ms_ctx *ctx, void *comm, ms_tensor *t, int root);
ms_status ms_cpu_comm_all_gather(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src);
ms_status ms_cpu_comm_reduce_scatter(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op);

const ms_backend ms_cpu_backend = {
    /* .name             = */ "cpu",
    /* .ctx_init         = */ cpu_ctx_init,
    /* .ctx_release      = */ cpu_ctx_release,
    /* .alloc            = */ cpu_alloc,
    /* .free             = */ cpu_free,
    /* .sync             = */ cpu_sync,
    /* .memcpy_to_host   = */ cpu_memcpy,
    /* .memcpy_from_host = */ cpu_memcpy,
    /* .copy             = */ ms_cpu_copy,
    /* .fill             = */ ms_cpu_fill,
    /* .rand             = */ ms_cpu_rand,
    /* .unary            = */ ms_cpu_unary,
    /* .binary           = */ ms_cpu_binary,
    /* .binary_scalar    = */ ms_cpu_binary_scalar,
    /* .clamp            = */ ms_cpu_clamp,
    /* .lerp             = */ ms_cpu_lerp,
    /* .addc             = */ ms_cpu_addc,
    /* .reduce           = */ ms_cpu_reduce,
    /* .dot              = */ ms_cpu_dot,
    /* .matmul           = */ ms_cpu_matmul,
    /* .eye              = */ ms_cpu_eye,
    /* .diag             = */ ms_cpu_diag,
    /* .eigh             = */ ms_cpu_eigh,
    /* the runtime members: the CPU has no stream, cache, device events or graphs (the core's defaults) */
    /* .stream           = */ NULL,
    /* .empty_cache      = */ NULL,
    /* .event_create     = */ NULL,
    /* .event_destroy    = */ NULL,
    /* .event_record     = */ NULL,
    /* .event_elapsed    = */ NULL,
    /* .graph_begin      = */ NULL,
    /* .graph_end        = */ NULL,
    /* .graph_launch     = */ NULL,
    /* .graph_num_nodes  = */ NULL,
    /* .graph_free       = */ NULL,
    /* .foreach_sumsq    = */ ms_cpu_foreach_sumsq,
    /* .foreach_scale    = */ ms_cpu_foreach_scale,
    /* .adamw_step       = */ ms_cpu_adamw_step,
    /* .sgd_step         = */ ms_cpu_sgd_step,
    /* .sinkgd_step      = */ ms_cpu_sinkgd_step,
    /* .adamw8_step      = */ ms_cpu_adamw8_step,
    /* .blocks_gather    = */ ms_cpu_blocks_gather,
    /* .blocks_apply     = */ ms_cpu_blocks_apply,
    /* .dash_graft       = */ ms_cpu_dash_graft,
    /* .inv_root         = */ ms_cpu_inv_root,
    /* .spectrum_estimate = */ ms_cpu_spectrum_estimate,
    /* .capture_state    = */ NULL,   /* never capturing; no joins, no profiler ranges */
    /* .graph_join       = */ NULL,
    /* .graph_leave      = */ NULL,
    /* .profile_push     = */ NULL,
    /* .profile_pop      = */ NULL,
    /* .comm_init        = */ NULL,   /* no NCCL id: the ranks connect over TCP (comm_connect) */
    /* .comm_destroy     = */ ms_cpu_comm_destroy,
    /* .comm_all_reduce  = */ ms_cpu_comm_all_reduce,
    /* .comm_broadcast   = */ ms_cpu_comm_broadcast,
    /* .comm_all_gather  = */ ms_cpu_comm_all_gather,
    /* .comm_reduce_scatter = */ ms_cpu_comm_reduce_scatter,
    /* .sinkgd_step_sharded = */ ms_cpu_sinkgd_step_sharded,
    /* .comm_connect     = */ ms_cpu_comm_connect,
    /* .comm_group_begin = */ NULL,   /* collectives run at once: the core's nesting count is all a group is */
    /* .comm_group_end   = */ NULL,
    /* .blocks_gather_factors = */ ms_cpu_blocks_gather_factors,
    /* .comm_abort       = */ ms_cpu_comm_abort,
};

/*
** Communicators: the public calls of moonstep.h's "Communicators" section.  The core checks the arguments
** (ranks, shapes, dtypes, layouts, devices), keeps the group nesting, agrees on NCCL's id through the
** rendezvous (engine/core/rendezvous.c) for a backend that joins through comm_init (CUDA:
** engine/cuda/comm.c), lets one that connects its ranks itself do so (comm_connect; CPU: engine/cpu/comm.c,
** TCP), and hands the collectives to the backend's comm_* members.
*/
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct ms_comm {
    ms_ctx *ctx;          /* retained */
    int     rank;
    int     world_size;
    void   *impl;         /* the backend's communicator (ncclComm_t; engine/cpu/comm.c's cpu_comm) */
    int     group_depth;  /* ms_comm_group_begin calls not yet ended */
};

#ifdef MS_WITH_NCCL
#define DEFAULT_TIMEOUT_MS 300000

#else
static ms_status no_nccl(ms_ctx *ctx, const char *fn)
{
    return MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s: this moonstep was built without NCCL (no NCCL ids; rebuild with "
                   "NCCL=1 where nccl.h and libnccl are found)", fn);
}
#endif

/* MS_E_UNSUPPORTED for a context whose backend has no communicators (CUDA in a build without NCCL). */
static ms_status check_backend(ms_ctx *ctx, const char *fn)
{
    if (ctx->backend->comm_connect != NULL || ctx->backend->comm_init != NULL) return MS_OK;
#ifdef MS_WITH_NCCL
    return MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s: a %s context has no communicator (NCCL runs on CUDA devices, TCP "
                   "between CPU contexts)", fn, ctx->name);
#else
    return MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s: this moonstep was built without NCCL, so a %s context has no "
                   "communicator (CPU contexts communicate over TCP; rebuild with NCCL=1 where nccl.h and libnccl "
                   "are found)", fn, ctx->name);
#endif
}

MS_API ms_status ms_comm_unique_id(unsigned char out[MS_COMM_ID_BYTES])
{
#ifndef MS_WITH_NCCL
    (void)out;
    return no_nccl(NULL, "ms_comm_unique_id");
#else
    if (out == NULL) return MS_FAIL(NULL, MS_E_ARG, "ms_comm_unique_id: out is NULL");
    return ms_nccl_unique_id(out);
#endif
}

/* impl <- NCCL's communicator for the id agreed on through the rendezvous (or given). */
static ms_status join_by_id(ms_ctx *ctx, const ms_comm_options *o, void **impl)
{
#ifndef MS_WITH_NCCL
    (void)o; (void)impl;
    return no_nccl(ctx, "ms_comm_new");   /* not reached: no backend has comm_init without NCCL */
#else
    int timeout_ms = o->timeout_ms ? o->timeout_ms : DEFAULT_TIMEOUT_MS;
    int64_t start = ms_now_ms();
    unsigned char id[MS_COMM_ID_BYTES] = { 0 };
    if (o->unique_id != NULL) {
        memcpy(id, o->unique_id, sizeof id);
    } else {
        if (o->rank == 0) MS_TRY(ms_nccl_unique_id(id));
        ms_status st = ms_rendezvous(o->addr, o->port, o->rank, o->world_size, timeout_ms, id);
        if (st != MS_OK) {   /* the rendezvous's own message, kept on the context too */
            snprintf(ctx->last_error, sizeof ctx->last_error, "%s", ms_last_error());
            return st;
        }
    }
    int64_t left = timeout_ms - (ms_now_ms() - start);
    if (left < 1000) left = 1000;   /* NCCL's set-up needs a moment even when the rendezvous took it all */
    return ctx->backend->comm_init(ctx, id, o->rank, o->world_size, (int)left, impl);
#endif
}

MS_API ms_status ms_comm_new(ms_ctx *ctx, const ms_comm_options *opts, ms_comm **out)
{
    static const char *fn = "ms_comm_new";
    if (out) *out = NULL;   /* on every error, NULL ctx included (as every constructor) */
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (out == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: out is NULL", fn);
    MS_TRY(check_backend(ctx, fn));
    ms_comm_options o = opts ? *opts : (ms_comm_options){ .rank = 0, .world_size = 1 };
    if (o.world_size < 1) return MS_FAIL(ctx, MS_E_ARG, "%s: world_size %d is below 1", fn, o.world_size);
    if (o.world_size > 1 << 20)
        return MS_FAIL(ctx, MS_E_ARG, "%s: world_size %d is above %d", fn, o.world_size, 1 << 20);
    if (o.rank < 0 || o.rank >= o.world_size)
        return MS_FAIL(ctx, MS_E_ARG, "%s: rank %d is outside [0, %d) (world_size %d)", fn, o.rank, o.world_size,
                       o.world_size);
    if (o.timeout_ms < 0) return MS_FAIL(ctx, MS_E_ARG, "%s: timeout_ms %d is negative", fn, o.timeout_ms);
    if (o.port < 0 || o.port > 65535) return MS_FAIL(ctx, MS_E_ARG, "%s: port %d is outside [1, 65535]", fn, o.port);
    /* the CPU's ranks meet at addr:port whatever the caller knows: an id would only mislead */
    if (ctx->backend->comm_connect != NULL && o.unique_id != NULL)
        return MS_FAIL(ctx, MS_E_ARG, "%s: unique_id is NCCL's, and a %s communicator connects its ranks through "
                       "the TCP rendezvous at addr:port (MASTER_ADDR:MASTER_PORT) instead: pass unique_id NULL", fn,
                       ctx->name);

    ms_comm *c = calloc(1, sizeof *c);
    if (c == NULL) return MS_FAIL(ctx, MS_E_OOM, "%s: no host memory", fn);
    ms_status st = ctx->backend->comm_connect
        ? ctx->backend->comm_connect(ctx, o.addr, o.port, o.rank, o.world_size, o.timeout_ms, &c->impl)
        : join_by_id(ctx, &o, &c->impl);
    if (st != MS_OK) {
        free(c);
        return ms_error_name(ctx, st, fn);   /* the rendezvous's message names ms_rendezvous: name this call */
    }
    ms_ctx_retain(ctx);
    c->ctx = ctx;
    c->rank = o.rank;
    c->world_size = o.world_size;
    *out = c;
    return MS_OK;
}

/* *v <- the environment variable `name` as an integer >= lo; MS_E_ARG naming it when missing or malformed. */
static ms_status env_int(ms_ctx *ctx, const char *fn, const char *name, bool required, int lo, int *v)
{
    const char *s = getenv(name);
    if (s == NULL || *s == '\0') {
        if (!required) return MS_OK;
        return MS_FAIL(ctx, MS_E_ARG, "%s: %s is not set (a launcher such as `moonstep launch` or torchrun sets "
                       "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)", fn, name);
    }
    char *end;
    long x = strtol(s, &end, 10);
    if (*end != '\0' || x < lo || x > 1 << 24)
        return MS_FAIL(ctx, MS_E_ARG, "%s: %s='%s' is not an integer >= %d", fn, name, s, lo);
    *v = (int)x;
    return MS_OK;
}

MS_API ms_status ms_comm_new_from_env(ms_ctx *ctx, int timeout_ms, ms_comm **out)
{
    static const char *fn = "ms_comm_new_from_env";
    if (out) *out = NULL;   /* the environment's errors too, before ms_comm_new would clear it */
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    MS_TRY(check_backend(ctx, fn));   /* before the environment: the context is the first mistake */
    ms_comm_options o = { .timeout_ms = timeout_ms };
    int local_rank = -1;
    MS_TRY(env_int(ctx, fn, "RANK", true, 0, &o.rank));
    MS_TRY(env_int(ctx, fn, "WORLD_SIZE", true, 1, &o.world_size));
    MS_TRY(env_int(ctx, fn, "LOCAL_RANK", false, 0, &local_rank));   /* checked only: the device is ctx's */
    return ms_error_name(ctx, ms_comm_new(ctx, &o, out), fn);        /* ms_comm_new's messages name it: name this call */
}

MS_API void ms_comm_free(ms_comm *comm)
{
    if (comm == NULL) return;
    /* groups left open would leave NCCL's (per-thread) group state open after the communicator */
    for (; comm->group_depth > 0; comm->group_depth--)
        if (comm->ctx->backend->comm_group_end) comm->ctx->backend->comm_group_end(comm->ctx, comm->impl);
    if (comm->ctx->backend->comm_destroy) comm->ctx->backend->comm_destroy(comm->ctx, comm->impl);
    ms_ctx_release(comm->ctx);
    free(comm);
}

MS_API ms_status ms_comm_abort(ms_comm *comm, const char *why)
{
    static const char *fn = "ms_comm_abort";
    if (comm == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: comm is NULL", fn);
    if (comm->ctx->backend->comm_abort == NULL)
        return MS_FAIL(comm->ctx, MS_E_UNSUPPORTED, "%s: a %s communicator cannot tell the other ranks (NCCL's wait "
                       "for the missing rank until its own timeout): end the process instead", fn, comm->ctx->name);
    comm->ctx->backend->comm_abort(comm->ctx, comm->impl, why ? why : "no reason given");
    return MS_OK;
}

MS_API int ms_comm_rank(const ms_comm *comm) { return comm ? comm->rank : -1; }
ms_ctx *ms_comm_context(const ms_comm *comm) { return comm ? comm->ctx : NULL; }
MS_API int ms_comm_size(const ms_comm *comm) { return comm ? comm->world_size : -1; }

/* --- collectives ------------------------------------------------------------------------------------ */

static ms_status check_comm(ms_comm *comm, const char *fn)
{
    if (comm == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: comm is NULL", fn);
    return MS_OK;
}

MS_API ms_status ms_comm_group_begin(ms_comm *comm)
{
    MS_TRY(check_comm(comm, "ms_comm_group_begin"));
    if (comm->ctx->backend->comm_group_begin)
        MS_TRY(comm->ctx->backend->comm_group_begin(comm->ctx, comm->impl));
    comm->group_depth++;
    return MS_OK;
}

MS_API ms_status ms_comm_group_end(ms_comm *comm)
{
    MS_TRY(check_comm(comm, "ms_comm_group_end"));
    if (comm->group_depth == 0)
        return MS_FAIL(comm->ctx, MS_E_ARG, "ms_comm_group_end: no group is open on this communicator (every "
                       "ms_comm_group_end needs an ms_comm_group_begin before it)");
    comm->group_depth--;   /* closed even when the backend fails: the caller must not end it twice */
    if (comm->ctx->backend->comm_group_end) return comm->ctx->backend->comm_group_end(comm->ctx, comm->impl);
    return MS_OK;
}

static ms_status check_tensor(ms_comm *comm, const char *fn, const char *who, const ms_tensor *t)
{
    ms_ctx *ctx = comm->ctx;
    MS_TRY(ms_check_on_device(ctx, fn, who, t));
    if (!ms_dtype_valid(t->dtype))
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: %s has an invalid dtype", fn, who);
    if (!ms_tensor_contiguous_p(t)) {
        char strides[16 * MS_MAX_DIMS + 4];
        return MS_FAIL(ctx, MS_E_LAYOUT, "%s: %s is not contiguous (shape %s, strides %s); collectives send "
                       "dense buffers (make a contiguous copy first)", fn, who, ms_tshape(t),
                       ms_shape_str(strides, sizeof strides, t->ndim, t->strides));
    }
    return MS_OK;
}

static ms_status check_op(ms_comm *comm, const char *fn, ms_comm_op op, ms_dtype dt)
{
    if ((unsigned)op > MS_COMM_AVG) return MS_FAIL(comm->ctx, MS_E_ARG, "%s: op %d is not an ms_comm_op", fn, (int)op);
    if (op == MS_COMM_AVG && !ms_dtype_is_float(dt))
        return MS_FAIL(comm->ctx, MS_E_DTYPE, "%s: MS_COMM_AVG needs a float dtype (f32, f64, bf16, f16), not %s "
                       "(sum, then divide)", fn, ms_dtype_name(dt));
    return MS_OK;
}

static ms_status check_same_dtype(ms_comm *comm, const char *fn, const ms_tensor *dst, const ms_tensor *src)
{
    if (dst->dtype == src->dtype) return MS_OK;
    return MS_FAIL(comm->ctx, MS_E_DTYPE, "%s: dst is %s but src is %s (the same dtype is needed)", fn,
                   ms_dtype_name(dst->dtype), ms_dtype_name(src->dtype));
}

static bool same_shape(const ms_tensor *a, const ms_tensor *b)
{
    if (a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

/* big is world_size pieces of small: [world_size, ...small] or small with dim 0 times world_size. */
static bool pieces_shape(const ms_tensor *big, const ms_tensor *small, int world_size)
{
    if (big->ndim == small->ndim + 1 && big->shape[0] == world_size) {
        for (int i = 0; i < small->ndim; i++)
            if (big->shape[i + 1] != small->shape[i]) return false;
        return true;
    }
    if (big->ndim == small->ndim && big->ndim >= 1 && big->shape[0] == (int64_t)world_size * small->shape[0]) {
        for (int i = 1; i < small->ndim; i++)
            if (big->shape[i] != small->shape[i]) return false;
        return true;
    }
    return false;
}

/* Whether a collective of no elements ends here.  NCCL's would do nothing; the CPU backend sends even an empty
** call to rank 0, where the ranks' calls are compared: a rank whose tensor is empty where another's is not is
** caught at once, on every rank, instead of returning here while the others wait for it until the timeout. */
static bool skip_empty(const ms_comm *comm, int64_t numel)
{
    return numel == 0 && comm->ctx->backend->comm_connect == NULL;
}

static bool overlap(const ms_tensor *a, const ms_tensor *b)
{
    const char *pa = ms_tensor_ptr(a), *pb = ms_tensor_ptr(b);
    size_t na = (size_t)ms_tensor_numel(a) * ms_dtype_size(a->dtype);
    size_t nb = (size_t)ms_tensor_numel(b) * ms_dtype_size(b->dtype);
    return na > 0 && nb > 0 && pa < pb + nb && pb < pa + na;
}

/* Checks the big/small pair of all_gather and reduce_scatter; *in_place when small is rank's slice of big. */
static ms_status check_pieces(ms_comm *comm, const char *fn, const char *big_name, const ms_tensor *big,
                              const char *small_name, const ms_tensor *small)
{
    if (!pieces_shape(big, small, comm->world_size))
        return MS_FAIL(comm->ctx, MS_E_SHAPE, "%s: %s has shape %s and %s %s; with world size %d, %s must be "
                       "[%d, ...%s's shape] or %s's shape with dim 0 times %d", fn, big_name, ms_tshape(big),
                       small_name, ms_tshape(small), comm->world_size, big_name, comm->world_size, small_name,
                       small_name, comm->world_size);
    size_t piece = (size_t)ms_tensor_numel(small) * ms_dtype_size(small->dtype);
    bool in_place = (const char *)ms_tensor_ptr(small) == (const char *)ms_tensor_ptr(big) + piece * (size_t)comm->rank;
    if (!in_place && overlap(big, small))
        return MS_FAIL(comm->ctx, MS_E_LAYOUT, "%s: %s and %s share memory; they must be disjoint, or %s must be "
                       "exactly slice %d (this rank's) of %s", fn, big_name, small_name, small_name, comm->rank,
                       big_name);
    return MS_OK;
}

MS_API ms_status ms_comm_all_reduce(ms_comm *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op)
{
    static const char *fn = "ms_comm_all_reduce";
    MS_TRY(check_comm(comm, fn));
    MS_TRY(check_tensor(comm, fn, "dst", dst));
    MS_TRY(check_tensor(comm, fn, "src", src));
    MS_TRY(check_same_dtype(comm, fn, dst, src));
    MS_TRY(check_op(comm, fn, op, dst->dtype));
    if (!same_shape(dst, src))
        return MS_FAIL(comm->ctx, MS_E_SHAPE, "%s: dst has shape %s but src %s (the same shape is needed)", fn,
                       ms_tshape(dst), ms_tshape(src));
    if (ms_tensor_ptr(dst) != ms_tensor_ptr(src) && overlap(dst, src))
        return MS_FAIL(comm->ctx, MS_E_LAYOUT, "%s: dst and src partially overlap (pass the same tensor for in "
                       "place, or disjoint ones)", fn);
    if (skip_empty(comm, ms_tensor_numel(dst))) return MS_OK;
    return comm->ctx->backend->comm_all_reduce(comm->ctx, comm->impl, dst, src, op);
}

MS_API ms_status ms_comm_broadcast(ms_comm *comm, ms_tensor *t, int root)
{
    static const char *fn = "ms_comm_broadcast";
    MS_TRY(check_comm(comm, fn));
    MS_TRY(check_tensor(comm, fn, "t", t));
    if (root < 0 || root >= comm->world_size)
        return MS_FAIL(comm->ctx, MS_E_ARG, "%s: root %d is outside [0, %d)", fn, root, comm->world_size);
    if (skip_empty(comm, ms_tensor_numel(t))) return MS_OK;
    return comm->ctx->backend->comm_broadcast(comm->ctx, comm->impl, t, root);
}

MS_API ms_status ms_comm_all_gather(ms_comm *comm, ms_tensor *dst, const ms_tensor *src)
{
    static const char *fn = "ms_comm_all_gather";
    MS_TRY(check_comm(comm, fn));
    MS_TRY(check_tensor(comm, fn, "dst", dst));
    MS_TRY(check_tensor(comm, fn, "src", src));
    MS_TRY(check_same_dtype(comm, fn, dst, src));
    MS_TRY(check_pieces(comm, fn, "dst", dst, "src", src));
    if (skip_empty(comm, ms_tensor_numel(src))) return MS_OK;
    return comm->ctx->backend->comm_all_gather(comm->ctx, comm->impl, dst, src);
}

MS_API ms_status ms_comm_reduce_scatter(ms_comm *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op)
{
    static const char *fn = "ms_comm_reduce_scatter";
    MS_TRY(check_comm(comm, fn));
    MS_TRY(check_tensor(comm, fn, "dst", dst));
    MS_TRY(check_tensor(comm, fn, "src", src));
    MS_TRY(check_same_dtype(comm, fn, dst, src));
    MS_TRY(check_op(comm, fn, op, dst->dtype));
    MS_TRY(check_pieces(comm, fn, "src", src, "dst", dst));
    if (skip_empty(comm, ms_tensor_numel(dst))) return MS_OK;
    return comm->ctx->backend->comm_reduce_scatter(comm->ctx, comm->impl, dst, src, op);
}

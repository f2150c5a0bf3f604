/*
** The CUDA backend's communicators: NCCL bound to the context's device and stream.  The core
** (engine/core/comm.c) has checked every argument; here ops and dtypes map to NCCL's and the collectives
** are queued on the context's stream.
**
** Communicators are created non-blocking (ncclConfig_t.blocking = 0) so that a set-up that never completes
** (a rank gone after the rendezvous) ends in an error at the timeout instead of a hang; NCCL calls may then
** answer ncclInProgress, and each is waited for (host side only: the enqueue, never the device's work).
** Nothing here touches NVLink multicast: NCCL_NVLS_ENABLE in the environment decides.
** The members are listed in ms_cuda_backend (engine/cuda/context.c).
*/
#ifdef MS_WITH_NCCL
#include "cuda.h"

#include <nccl.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The backend's communicator: NCCL's, and the data pointers of the collectives issued while a group is open.
** Like every op, a collective marks the memory it uses for the pool (ms_cuda_pool_track: another context's block
** is not reused before this stream has passed the use); NCCL queues a group's work only at its ncclGroupEnd, so
** the marks of grouped collectives are recorded there. */
typedef struct cuda_comm {
    ncclComm_t   nc;
    int          depth;       /* groups open (ms_comm_group_begin / _end, counted as the core does) */
    const void **pending;     /* data of the collectives issued inside the open groups */
    int          npending, cap;
} cuda_comm;

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static ms_status nccl_fail(ms_ctx *ctx, ncclResult_t r, ncclComm_t comm, const char *call, const char *file, int line)
{
    const char *detail = ncclGetLastError(comm);
    return ms_cuda_note_failure(ctx, ms_error_at(ctx, MS_E_BACKEND, file, line, "%s failed: %s%s%s", call,
                                                 ncclGetErrorString(r), detail && *detail ? ": " : "",
                                                 detail ? detail : ""));
}

/* r, or the final state of an operation that answered ncclInProgress, waited for until deadline_ms
** (0: no deadline); MS_E_IO at the deadline. */
static ms_status nccl_settle(ms_ctx *ctx, ncclComm_t comm, ncclResult_t r, int64_t deadline_ms, const char *call,
                             const char *file, int line)
{
    while (r == ncclInProgress) {
        if (deadline_ms && now_ms() > deadline_ms)
            return ms_error_at(ctx, MS_E_IO, file, line, "%s did not complete in time", call);
        struct timespec pause = { 0, 200000 };
        nanosleep(&pause, NULL);
        ncclResult_t q = ncclCommGetAsyncError(comm, &r);
        if (q != ncclSuccess) r = q;
    }
    if (r != ncclSuccess) return nccl_fail(ctx, r, comm, call, file, line);
    return MS_OK;
}
#define NCCL_TRY(ctx, comm, call) MS_TRY(nccl_settle((ctx), (comm), (call), 0, #call, __FILE__, __LINE__))

ms_status ms_nccl_unique_id(unsigned char out[MS_COMM_ID_BYTES])
{
    _Static_assert(sizeof(ncclUniqueId) == MS_COMM_ID_BYTES, "NCCL's unique id is 128 bytes");
    ncclUniqueId uid;
    ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess)
        return MS_FAIL(NULL, MS_E_BACKEND, "ms_comm_unique_id: ncclGetUniqueId failed: %s", ncclGetErrorString(r));
    memcpy(out, uid.internal, MS_COMM_ID_BYTES);
    return MS_OK;
}

ms_status ms_cuda_comm_init(ms_ctx *ctx, const unsigned char id[MS_COMM_ID_BYTES], int rank, int world_size,
                           int timeout_ms, void **out)
{
    if (ms_cuda_capturing(ctx))
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_comm_new: %s is capturing a graph (create communicators before)",
                       ctx->name);
    MS_TRY(ms_cuda_enter(ctx));   /* NCCL binds the communicator to the current device */
    ncclUniqueId uid;
    memcpy(uid.internal, id, MS_COMM_ID_BYTES);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = NULL;
    int64_t deadline = now_ms() + timeout_ms;
    ncclResult_t r = ncclCommInitRankConfig(&comm, world_size, uid, rank, &config);
    ms_status st = comm ? nccl_settle(ctx, comm, r, deadline, "ncclCommInitRankConfig", __FILE__, __LINE__)
                        : nccl_fail(ctx, r, NULL, "ncclCommInitRankConfig", __FILE__, __LINE__);
    if (st == MS_E_IO)
        MS_FAIL(ctx, MS_E_IO, "ms_comm_new: NCCL's set-up of rank %d of %d on %s did not finish within %d ms "
                "(a rank is missing, stuck, or holds another id)", rank, world_size, ctx->name, timeout_ms);
    cuda_comm *cc = st == MS_OK ? calloc(1, sizeof *cc) : NULL;
    if (st == MS_OK && cc == NULL) st = MS_FAIL(ctx, MS_E_OOM, "ms_comm_new: out of host memory");
    if (st != MS_OK) {
        if (comm) ncclCommAbort(comm);
        return st;
    }
    cc->nc = comm;
    *out = cc;
    return MS_OK;
}

void ms_cuda_comm_destroy(ms_ctx *ctx, void *impl)
{
    cuda_comm *cc = impl;
    ncclComm_t comm = cc->nc;
    if (ms_cuda_enter(ctx) == MS_OK &&
        nccl_settle(ctx, comm, ncclCommFinalize(comm), now_ms() + 60000, "ncclCommFinalize", __FILE__, __LINE__) == MS_OK)
        ncclCommDestroy(comm);
    else
        ncclCommAbort(comm);   /* a peer gone: do not wait for it */
    free(cc->pending);
    free(cc);
}

/* Marks the memory of t for the pool: now, or at the end of the open groups (when NCCL queues their work). */
static void mark_use(ms_ctx *ctx, cuda_comm *cc, const ms_tensor *t)
{
    if (cc->depth > 0 && cc->npending == cc->cap) {
        int cap = cc->cap ? 2 * cc->cap : 16;
        const void **grown = realloc(cc->pending, sizeof *grown * (size_t)cap);
        if (grown) {
            cc->pending = grown;
            cc->cap = cap;
        }
    }
    if (cc->depth > 0 && cc->npending < cc->cap) cc->pending[cc->npending++] = ms_tensor_ptr(t);
    else ms_cuda_track_tensor(ctx, t);   /* (no room: an early mark beats none) */
}

static ncclDataType_t nccl_dtype(ms_dtype dt)
{
    switch (dt) {
    case MS_DTYPE_F32:  return ncclFloat32;
    case MS_DTYPE_F64:  return ncclFloat64;
    case MS_DTYPE_BF16: return ncclBfloat16;
    case MS_DTYPE_F16:  return ncclFloat16;
    case MS_DTYPE_I32:  return ncclInt32;
    default:            return ncclUint8;   /* MS_DTYPE_U8: the core admits nothing else */
    }
}

static ncclRedOp_t nccl_op(ms_comm_op op)
{
    switch (op) {
    case MS_COMM_MAX: return ncclMax;
    case MS_COMM_MIN: return ncclMin;
    case MS_COMM_AVG: return ncclAvg;
    default:          return ncclSum;
    }
}

ms_status ms_cuda_comm_all_reduce(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op)
{
    MS_NVTX_RANGE("ms_comm_all_reduce");
    MS_TRY(ms_cuda_enter(ctx));
    ms_ctx_count_launch(ctx);
    cuda_comm *cc = comm;
    NCCL_TRY(ctx, cc->nc, ncclAllReduce(ms_tensor_ptr(src), ms_tensor_ptr(dst), (size_t)ms_tensor_numel(dst),
                                        nccl_dtype(dst->dtype), nccl_op(op), cc->nc, ms_cuda(ctx)->stream));
    mark_use(ctx, cc, src);
    mark_use(ctx, cc, dst);
    return MS_OK;
}

ms_status ms_cuda_comm_broadcast(ms_ctx *ctx, void *comm, ms_tensor *t, int root)
{
    MS_NVTX_RANGE("ms_comm_broadcast");
    MS_TRY(ms_cuda_enter(ctx));
    ms_ctx_count_launch(ctx);
    cuda_comm *cc = comm;
    NCCL_TRY(ctx, cc->nc, ncclBroadcast(ms_tensor_ptr(t), ms_tensor_ptr(t), (size_t)ms_tensor_numel(t),
                                        nccl_dtype(t->dtype), root, cc->nc, ms_cuda(ctx)->stream));
    mark_use(ctx, cc, t);
    return MS_OK;
}

ms_status ms_cuda_comm_all_gather(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src)
{
    MS_NVTX_RANGE("ms_comm_all_gather");
    MS_TRY(ms_cuda_enter(ctx));
    ms_ctx_count_launch(ctx);
    cuda_comm *cc = comm;
    NCCL_TRY(ctx, cc->nc, ncclAllGather(ms_tensor_ptr(src), ms_tensor_ptr(dst), (size_t)ms_tensor_numel(src),
                                        nccl_dtype(src->dtype), cc->nc, ms_cuda(ctx)->stream));
    mark_use(ctx, cc, src);
    mark_use(ctx, cc, dst);
    return MS_OK;
}

ms_status ms_cuda_comm_reduce_scatter(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op)
{
    MS_NVTX_RANGE("ms_comm_reduce_scatter");
    MS_TRY(ms_cuda_enter(ctx));
    ms_ctx_count_launch(ctx);
    cuda_comm *cc = comm;
    NCCL_TRY(ctx, cc->nc, ncclReduceScatter(ms_tensor_ptr(src), ms_tensor_ptr(dst), (size_t)ms_tensor_numel(dst),
                                            nccl_dtype(dst->dtype), nccl_op(op), cc->nc, ms_cuda(ctx)->stream));
    mark_use(ctx, cc, src);
    mark_use(ctx, cc, dst);
    return MS_OK;
}

/* Groups: NCCL's group state is the calling thread's, not the communicator's; the core has counted the
** nesting.  A non-blocking communicator's ncclGroupEnd may answer ncclInProgress while the group's
** collectives are being issued: waited for like every other call. */
ms_status ms_cuda_comm_group_begin(ms_ctx *ctx, void *comm)
{
    cuda_comm *cc = comm;
    NCCL_TRY(ctx, cc->nc, ncclGroupStart());
    cc->depth++;
    return MS_OK;
}

ms_status ms_cuda_comm_group_end(ms_ctx *ctx, void *comm)
{
    MS_NVTX_RANGE("ms_comm_group_end");
    cuda_comm *cc = comm;
    if (cc->depth > 0) cc->depth--;   /* closed even when NCCL fails, as the core counts it */
    ms_status st = ms_cuda_enter(ctx);
    if (st == MS_OK) st = nccl_settle(ctx, cc->nc, ncclGroupEnd(), 0, "ncclGroupEnd()", __FILE__, __LINE__);
    if (cc->depth == 0) {   /* the groups' work is queued now (or failed): their marks go after it */
        for (int i = 0; st == MS_OK && i < cc->npending; i++) ms_cuda_pool_track(ctx, cc->pending[i]);
        cc->npending = 0;
    }
    return st;
}

#endif /* MS_WITH_NCCL */

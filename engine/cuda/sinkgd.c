/*
** The CUDA backend's SinkGD steps (ms_sinkgd_step, ms_sinkgd_step_sharded): the core's validated group turned
** into one table entry per matrix (a member [..., m, n] gives one per leading index, its grad addressed through
** its own strides, so no layout is ever copied) for kernels/sinkgd.cu, with scratch from the context's pool (the
** same size every step of a group, so the pool serves it from its cache) and the context's ticket counters.
** A sharded call runs its unsharded members as the plain step does (each rank's own, no exchange), then its
** rows-sharded members, then its cols-sharded ones, each kind a run of its own with the core's exchange: every
** rank makes the same runs in the same order, so their collectives meet.
*/
#include "cuda.h"

#include <stdlib.h>

_Static_assert((int)MSK_SINKGD_CAP <= (int)MSK_OPTIM_CAP, "the SinkGD launches use the context's MSK_OPTIM_CAP tickets");

static ms_shard_dim dim_of(const ms_shard *shards, int i) { return shards ? shards[i].dim : MS_SHARD_NONE; }

/* The matrices of member i: the product of its leading dims (a slice may have no elements while the global
** matrix has). */
static int64_t lead_count(const ms_tensor *p)
{
    int64_t B = 1;
    for (int d = 0; d < p->ndim - 2; d++) B *= p->shape[d];
    return B;
}

/* The global dims of member i's matrices (its own dims unless sharded). */
static void global_dims(const ms_tensor *p, const ms_shard *shards, int i, int64_t *mg, int64_t *ng)
{
    ms_shard_dim dim = dim_of(shards, i);
    *mg = dim == MS_SHARD_ROWS ? shards[i].global : p->shape[p->ndim - 2];
    *ng = dim == MS_SHARD_COLS ? shards[i].global : p->shape[p->ndim - 1];
}

/* Table entries for the members whose shard dim is `dim` (shards NULL: every member, unsharded), in call order;
** *count gets how many (*out NULL when none).  A member enters when its global matrix has elements: a sharded
** member's matrices enter even where this rank's slice is empty, so every rank's table is the same.  Sharded
** entries carry the global dims and the slice's offset, and e0 indexes the global member (the stochastic
** rounding's counter). */
static ms_status make_mats(ms_ctx *ctx, const char *fn, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                           ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm, const double *scales,
                           const ms_shard *shards, ms_shard_dim dim, msk_sinkgd_mat **out, int64_t *count)
{
    *out = NULL;
    *count = 0;
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        int64_t mg, ng;
        if (dim_of(shards, i) != dim) continue;
        global_dims(params[i], shards, i, &mg, &ng);
        if (mg * ng > 0) total += lead_count(params[i]);
    }
    if (total == 0) return MS_OK;
    if (total > 0x7fffffff)
        return MS_FAIL(ctx, MS_E_ARG, "%s on %s: %lld matrices in one call", fn, ctx->name, (long long)total);
    msk_sinkgd_mat *mats = calloc((size_t)total, sizeof *mats);
    if (mats == NULL) return MS_FAIL(ctx, MS_E_OOM, "cuda sinkgd: no host memory for %lld matrices", (long long)total);

    int64_t k = 0;
    for (int i = 0; i < n; i++) {
        if (dim_of(shards, i) != dim) continue;
        const ms_tensor *p = params[i], *g = grads[i];
        int nd = p->ndim;
        int64_t m = p->shape[nd - 2], nn = p->shape[nd - 1], mg, ng;
        global_dims(p, shards, i, &mg, &ng);
        if (mg * ng == 0) continue;
        int64_t B = lead_count(p), off = dim == MS_SHARD_NONE ? 0 : shards[i].offset;
        size_t gsz = ms_dtype_size(g->dtype), psz = ms_dtype_size(p->dtype);
        for (int64_t b = 0; b < B; b++) {
            int64_t goff = 0, rest = b;   /* the grad's element offset of matrix b (row-major lead index) */
            for (int d = nd - 3; d >= 0; d--) {
                goff += (rest % g->shape[d]) * g->strides[d];
                rest /= g->shape[d];
            }
            msk_sinkgd_mat *x = &mats[k++];
            x->g = (const char *)ms_tensor_ptr(g) + goff * (int64_t)gsz;
            x->p = (char *)ms_tensor_ptr(p) + b * m * nn * (int64_t)psz;
            x->u = specnorm_u ? (float *)ms_tensor_ptr(specnorm_u[i]) + b * nn : NULL;
            x->t = md_target_norm ? (float *)ms_tensor_ptr(md_target_norm[i]) + b : NULL;
            x->m = m;
            x->n = nn;
            x->rs = g->strides[nd - 2];
            x->cs = g->strides[nd - 1];
            x->e0 = dim == MS_SHARD_ROWS ? (b * mg + off) * nn : dim == MS_SHARD_COLS ? b * m * ng + off : b * m * nn;
            x->b = b;
            x->scale = scales ? scales[i] : 1.0;
            x->member = (int32_t)ms_rng_map_of(p, i).member;
            x->gdt = (int8_t)g->dtype;
            x->pdt = (int8_t)p->dtype;
            if (dim != MS_SHARD_NONE) {
                x->mg = mg;
                x->ng = ng;
                x->off = off;
            }
        }
    }
    *out = mats;
    *count = total;
    return MS_OK;
}

/* One run of the kernels over `count` entries: the plain step's (x NULL) or a sharded one's; adds the kernels it
** queued to *launches. */
static ms_status run_mats(ms_ctx *ctx, const char *fn, const ms_sinkgd_options *o, ms_shard_dim dim, int64_t count,
                          const msk_sinkgd_mat *mats, const ms_exchange *x, int *launches)
{
    unsigned *tickets = NULL;
    MS_TRY(ms_cuda_tickets(ctx, fn, &tickets));
    msk_sinkgd k_o = {
        .lr = ms_cuda_scalar(o->lr, o->lr_t), .step = ms_cuda_scalar(o->step, o->step_t), .skip = ms_cuda_scalar(0, o->skip_t),
        .mode = (int)o->mode, .iters = o->iters, .sn_iters = o->sn_iters, .target = (int)o->target,
        .stochastic = o->stochastic_round != 0, .eps = o->eps, .weight_decay = o->weight_decay, .seed = o->seed,
    };
    int kdim = dim == MS_SHARD_ROWS ? MSK_SHARD_ROWS : MSK_SHARD_COLS;
    size_t bytes = dim == MS_SHARD_NONE ? msk_sinkgd_scratch((int)count, mats)
                                        : msk_sinkgd_sharded_scratch(kdim, (int)count, mats);
    void *scratch = NULL;
    ms_status st = bytes == (size_t)-1 ? MS_FAIL(ctx, MS_E_OOM, "cuda sinkgd: no host memory to plan the step")
                                       : ms_cuda_scratch(ctx, bytes, &scratch);
    int queued = 0;
    if (st == MS_OK) {
        cudaStream_t s = ms_cuda(ctx)->stream;
        if (dim == MS_SHARD_NONE) {
            st = msk_sinkgd_run(ctx, s, &k_o, (int)count, mats, scratch, tickets, &queued);
        } else {
            msk_exchange kx = { x->sum, x->user };
            st = msk_sinkgd_run_sharded(ctx, s, &k_o, kdim, (int)count, mats, &kx, scratch, tickets, &queued);
        }
        st = ms_cuda_note_failure(ctx, st);
    }
    *launches += queued;
    if (scratch) ms_cuda_scratch_free(ctx, scratch, bytes);   /* stream-ordered: safe right away */
    return st;
}

/* The kernels counted and the tensors noted for cross-context reuse after a successful call. */
static void finish_call(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                        ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm, const ms_sinkgd_options *o,
                        int launches)
{
    for (int i = 0; i < n; i++) {
        ms_cuda_track_tensor(ctx, params[i]);
        ms_cuda_track_tensor(ctx, grads[i]);
        if (specnorm_u) ms_cuda_track_tensor(ctx, specnorm_u[i]);
        if (md_target_norm) ms_cuda_track_tensor(ctx, md_target_norm[i]);
    }
    ms_cuda_track_tensor(ctx, o->lr_t);
    ms_cuda_track_tensor(ctx, o->step_t);
    ms_cuda_track_tensor(ctx, o->skip_t);
    ctx->launches += launches > 1 ? launches - 1 : 0;   /* the core counted one */
}

ms_status ms_cuda_sinkgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                              ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                              const double *scales, const ms_sinkgd_options *o)
{
    MS_NVTX_RANGE("ms_sinkgd_step");
    MS_TRY(ms_cuda_enter(ctx));
    msk_sinkgd_mat *mats;
    int64_t count;
    MS_TRY(make_mats(ctx, "ms_sinkgd_step", n, params, grads, specnorm_u, md_target_norm, scales, NULL, MS_SHARD_NONE,
                     &mats, &count));
    if (count == 0) return MS_OK;
    int launches = 0;
    ms_status st = run_mats(ctx, "ms_sinkgd_step", o, MS_SHARD_NONE, count, mats, NULL, &launches);
    if (st == MS_OK) finish_call(ctx, n, params, grads, specnorm_u, md_target_norm, o, launches);
    free(mats);
    return st;
}

ms_status ms_cuda_sinkgd_step_sharded(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                                      ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                                      const double *scales, const ms_shard *shards, const ms_sinkgd_options *o,
                                      const ms_exchange *x)
{
    static const char fn[] = "ms_sinkgd_step_sharded";
    MS_NVTX_RANGE("ms_sinkgd_step_sharded");
    MS_TRY(ms_cuda_enter(ctx));
    static const ms_shard_dim order[3] = { MS_SHARD_NONE, MS_SHARD_ROWS, MS_SHARD_COLS };
    int launches = 0;
    ms_status st = MS_OK;
    /* every table before the first run: a table that cannot be made (host memory, size) fails the call before it
    ** changed a parameter, and before this rank's collectives, which the other ranks would wait for */
    msk_sinkgd_mat *mats[3] = { NULL, NULL, NULL };
    int64_t count[3] = { 0, 0, 0 };
    for (int k = 0; k < 3 && st == MS_OK; k++)
        st = make_mats(ctx, fn, n, params, grads, specnorm_u, md_target_norm, scales, shards, order[k], &mats[k],
                       &count[k]);
    for (int k = 0; k < 3 && st == MS_OK; k++)
        if (count[k] > 0) st = run_mats(ctx, fn, o, order[k], count[k], mats[k], x, &launches);
    for (int k = 0; k < 3; k++) free(mats[k]);
    if (st == MS_OK) finish_call(ctx, n, params, grads, specnorm_u, md_target_norm, o, launches);
    return st;
}

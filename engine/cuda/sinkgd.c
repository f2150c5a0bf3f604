/*
** The CUDA backend's SinkGD step (ms_sinkgd_step): the core's validated group turned into one table entry per
** matrix (a member [..., m, n] gives one per leading index, its grad addressed through its own strides, so no
** layout is ever copied) for kernels/sinkgd.cu, with scratch from the context's pool (the same size every step
** of a group, so the pool serves it from its cache) and the context's ticket counters.
*/
#include "cuda.h"

#include <stdlib.h>

_Static_assert((int)MSK_SINKGD_CAP <= (int)MSK_OPTIM_CAP, "the SinkGD launches use the context's MSK_OPTIM_CAP tickets");

ms_status ms_cuda_sinkgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                              ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                              const double *scales, const ms_sinkgd_options *o)
{
    MS_NVTX_RANGE("ms_sinkgd_step");
    MS_TRY(ms_cuda_enter(ctx));
    int64_t count = 0;
    for (int i = 0; i < n; i++) {
        const ms_tensor *p = params[i];
        int64_t mn = p->shape[p->ndim - 2] * p->shape[p->ndim - 1];
        if (mn > 0) count += ms_tensor_numel(p) / mn;
    }
    if (count == 0) return MS_OK;
    if (count > 0x7fffffff)
        return MS_FAIL(ctx, MS_E_ARG, "ms_sinkgd_step on %s: %lld matrices in one call", ctx->name, (long long)count);
    unsigned *tickets = NULL;
    MS_TRY(ms_cuda_tickets(ctx, "ms_sinkgd_step", &tickets));
    msk_sinkgd_mat *mats = calloc((size_t)count, sizeof *mats);
    if (mats == NULL) return MS_FAIL(ctx, MS_E_OOM, "cuda sinkgd: no host memory for %lld matrices", (long long)count);

    int64_t k = 0;
    for (int i = 0; i < n; i++) {
        const ms_tensor *p = params[i], *g = grads[i];
        int nd = p->ndim;
        int64_t m = p->shape[nd - 2], nn = p->shape[nd - 1];
        if (m * nn == 0) continue;
        int64_t B = ms_tensor_numel(p) / (m * nn);
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
            x->e0 = b * m * nn;
            x->b = b;
            x->scale = scales ? scales[i] : 1.0;
            x->member = i;
            x->gdt = (int8_t)g->dtype;
            x->pdt = (int8_t)p->dtype;
        }
    }

    msk_sinkgd k_o = {
        .lr = ms_cuda_scalar(o->lr, o->lr_t), .step = ms_cuda_scalar(o->step, o->step_t), .skip = ms_cuda_scalar(0, o->skip_t),
        .mode = (int)o->mode, .iters = o->iters, .sn_iters = o->sn_iters, .target = (int)o->target,
        .stochastic = o->stochastic_round != 0, .eps = o->eps, .weight_decay = o->weight_decay, .seed = o->seed,
    };
    size_t bytes = msk_sinkgd_scratch((int)count, mats);
    void *scratch = NULL;
    ms_status st = bytes == (size_t)-1 ? MS_FAIL(ctx, MS_E_OOM, "cuda sinkgd: no host memory to plan the step")
                                       : ms_cuda_scratch(ctx, bytes, &scratch);
    int launches = 0;
    if (st == MS_OK)
        st = ms_cuda_note_failure(ctx, msk_sinkgd_run(ctx, ms_cuda(ctx)->stream, &k_o, (int)count, mats, scratch,
                                                      tickets, &launches));
    if (st == MS_OK) {
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
    if (scratch) ms_cuda_scratch_free(ctx, scratch, bytes);   /* stream-ordered: safe right away */
    free(mats);
    return st;
}

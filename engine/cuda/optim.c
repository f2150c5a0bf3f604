/*
** The CUDA backend's fused optimizer steps and multi-tensor helpers: the core's validated groups turned into
** member tables for the multi-tensor kernels of kernels/optim.cu (kernels/msk.h), queued on the context's stream.
** A layout the kernels do not take directly (more than two strided dims after merging) goes through a
** contiguous temporary, each copy counted as a launch.
*/
#include "cuda.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define STREAM(ctx) (ms_cuda(ctx)->stream)

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* t's layout as at most two dims (size-1 dims dropped, mergeable neighbours merged): element e (row-major) at
** (e / cols) * rs + (e % cols) * cs.  False when t needs more dims than that. */
static bool layout2(const ms_tensor *t, int64_t *cols, int64_t *rs, int64_t *cs, bool *dense)
{
    int64_t shape[MS_MAX_DIMS], strides[MS_MAX_DIMS];
    int n = 0;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] == 1) continue;
        if (n > 0 && strides[n - 1] == t->strides[d] * t->shape[d]) {
            shape[n - 1] *= t->shape[d];
            strides[n - 1] = t->strides[d];
        } else {
            shape[n] = t->shape[d];
            strides[n] = t->strides[d];
            n++;
        }
    }
    if (n > 2) return false;
    int64_t numel = ms_tensor_numel(t);
    *dense = n == 0 || (n == 1 && strides[0] == 1);
    if (*dense || n == 0) {
        *cols = numel > 0 ? numel : 1;
        *rs = *cols;
        *cs = 1;
    } else if (n == 1) {
        *cols = shape[0];
        *rs = 0;
        *cs = strides[0];
    } else {
        *cols = shape[1];
        *rs = strides[0];
        *cs = strides[1];
    }
    return true;
}

/* --- the members of a call -----------------------------------------------------------------------------
** The table of a call, and the contiguous temporaries some members' strided operands were copied into (freed,
** stream-ordered, when the call is done). */
typedef struct call {
    ms_ctx     *ctx;
    msk_member *m;
    int         n;
    ms_tensor **tmp;        /* [n], NULL entries for members without a temporary */
    int        *pos;        /* [n]: member k's position in the call (steps) */
    msk_rng    *rng;        /* [n] or NULL: the stochastic rounding's element numbers (steps; NULL when none is
                            ** a slice of a whole) */
    int         extra;      /* launches beyond the kernels (copies) */
} call;

static ms_status call_new(ms_ctx *ctx, int n, call *c)
{
    memset(c, 0, sizeof *c);
    c->ctx = ctx;
    c->m = calloc((size_t)(n > 0 ? n : 1), sizeof *c->m);
    c->tmp = calloc((size_t)(n > 0 ? n : 1), sizeof *c->tmp);
    c->pos = calloc((size_t)(n > 0 ? n : 1), sizeof *c->pos);
    if (c->m == NULL || c->tmp == NULL || c->pos == NULL) {
        free(c->m);
        free(c->tmp);
        free(c->pos);
        return MS_FAIL(ctx, MS_E_OOM, "cuda: no host memory for the table of %d members", n);
    }
    return MS_OK;
}

static void call_free(call *c)
{
    for (int i = 0; c->tmp && i < c->n; i++) ms_tensor_free(c->tmp[i]);
    free(c->m);
    free(c->tmp);
    free(c->pos);
    free(c->rng);
}

/* The strided operand of member k: t itself when its layout fits two dims, else a contiguous copy (slot k's
** temporary).  Sets the member's layout fields and returns the data pointer the kernel uses. */
static ms_status strided_operand(call *c, int k, const ms_tensor *t, const void **data)
{
    msk_member *m = &c->m[k];
    bool dense;
    if (layout2(t, &m->cols, &m->rs, &m->cs, &dense)) {
        m->dense = dense;
        *data = ms_tensor_ptr(t);
        return MS_OK;
    }
    MS_TRY(ms_tensor_alloc(c->ctx, t->dtype, t->ndim, t->shape, &c->tmp[k]));
    MS_TRY(ms_cuda_copy_tensor(c->ctx, c->tmp[k], t));
    c->extra++;
    m->dense = 1;
    m->cols = m->rs = ms_tensor_numel(t);
    m->cs = 1;
    *data = ms_tensor_ptr(c->tmp[k]);
    return MS_OK;
}

/* Members of a step: param, grad, up to two states; members of 0 elements are left out (nothing to do).  The
** member word of the stochastic rounding and its element numbers come from each param's origin
** (ms_rng_map_of). */
static ms_status step_members(call *c, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                              ms_tensor *const *s0, ms_tensor *const *s1, const double *scales)
{
    for (int i = 0; i < n; i++) {
        if (ms_tensor_numel(params[i]) == 0) continue;
        int k = c->n++;
        msk_member *m = &c->m[k];
        const ms_rng_map map = ms_rng_map_of(params[i], i);
        if (map.base != 0 || map.div != 0) {
            if (c->rng == NULL && (c->rng = calloc((size_t)n, sizeof *c->rng)) == NULL)
                return MS_FAIL(c->ctx, MS_E_OOM, "cuda: no host memory for the table of %d members", n);
            c->rng[k] = (msk_rng){ map.base, map.div, map.gap };
        }
        c->pos[k] = i;
        m->x = ms_tensor_ptr(params[i]);
        m->s0 = s0 ? ms_tensor_ptr(s0[i]) : NULL;
        m->s1 = s1 ? ms_tensor_ptr(s1[i]) : NULL;
        m->numel = ms_tensor_numel(params[i]);
        m->scale = scales ? scales[i] : 1.0;
        m->index = (int32_t)map.member;
        m->xdt = (int8_t)params[i]->dtype;
        m->gdt = (int8_t)grads[i]->dtype;
        MS_TRY(strided_operand(c, k, grads[i], &m->g));
        bool vx = aligned16(m->x) && (!m->s0 || aligned16(m->s0)) && (!m->s1 || aligned16(m->s1));
        m->vec = (uint8_t)((vx ? MSK_VEC_X : 0) | (m->dense && aligned16(m->g) ? MSK_VEC_G : 0));
    }
    return MS_OK;
}

static void track_all(ms_ctx *ctx, int n, const ms_tensor *const *a, const ms_tensor *const *b,
                      ms_tensor *const *s0, ms_tensor *const *s1)
{
    for (int i = 0; i < n; i++) {
        if (a) ms_cuda_track_tensor(ctx, a[i]);
        if (b) ms_cuda_track_tensor(ctx, b[i]);
        if (s0) ms_cuda_track_tensor(ctx, s0[i]);
        if (s1) ms_cuda_track_tensor(ctx, s1[i]);
    }
}

/* The kernels and copies of a call queued: the core counted one launch, the others are added here. */
static ms_status finish(call *c, ms_status st, int launches)
{
    if (st == MS_OK) c->ctx->launches += (launches > 1 ? launches - 1 : 0) + c->extra;
    call_free(c);
    return st;
}

/* --- the steps ------------------------------------------------------------------------------------------- */

ms_status ms_cuda_adamw_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                             ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_sq, const double *scales,
                             const ms_adamw_options *o)
{
    MS_NVTX_RANGE("ms_adamw_step");
    MS_TRY(ms_cuda_enter(ctx));
    call c;
    MS_TRY(call_new(ctx, n, &c));
    ms_status st = step_members(&c, n, params, grads, exp_avg, exp_avg_sq, scales);
    msk_adamw k = {
        .lr = ms_cuda_scalar(o->lr, o->lr_t), .step = ms_cuda_scalar(o->step, o->step_t), .skip = ms_cuda_scalar(0, o->skip_t),
        .beta1 = o->beta1, .beta2 = o->beta2, .omb1 = 1.0 - o->beta1, .omb2 = 1.0 - o->beta2, .eps = o->eps,
        .weight_decay = o->weight_decay, .bc1 = 1.0, .bc2_sqrt = 1.0, .bias_correction = o->bias_correction != 0,
        .stochastic = o->stochastic_round != 0, .state_dtype = n > 0 ? exp_avg[0]->dtype : MS_DTYPE_F32,
        .seed = o->seed,
    };
    if (o->bias_correction && o->step_t == NULL) {   /* the host's libm, as the CPU backend computes them */
        double step = rint(o->step);
        k.bc1 = 1.0 - pow(o->beta1, step);
        k.bc2_sqrt = sqrt(1.0 - pow(o->beta2, step));
    }
    int launches = 0;
    const msk_rng *rng = o->stochastic_round ? c.rng : NULL;
    if (st == MS_OK) st = ms_cuda_note_failure(ctx, msk_adamw_run(ctx, STREAM(ctx), &k, c.n, c.m, rng, &launches));
    if (st == MS_OK) {
        track_all(ctx, n, (const ms_tensor *const *)params, grads, exp_avg, exp_avg_sq);
        ms_cuda_track_tensor(ctx, o->lr_t);
        ms_cuda_track_tensor(ctx, o->step_t);
        ms_cuda_track_tensor(ctx, o->skip_t);
    }
    return finish(&c, st, launches);
}

ms_status ms_cuda_sgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                           ms_tensor *const *momentum_buf, const double *scales, const ms_sgd_options *o)
{
    MS_NVTX_RANGE("ms_sgd_step");
    MS_TRY(ms_cuda_enter(ctx));
    call c;
    MS_TRY(call_new(ctx, n, &c));
    ms_status st = step_members(&c, n, params, grads, momentum_buf, NULL, scales);
    msk_sgd k = {
        .lr = ms_cuda_scalar(o->lr, o->lr_t), .step = ms_cuda_scalar(o->step, o->step_t), .skip = ms_cuda_scalar(0, o->skip_t),
        .momentum = o->momentum, .omd = 1.0 - o->dampening, .weight_decay = o->weight_decay,
        .nesterov = o->nesterov != 0, .has_buf = momentum_buf != NULL, .stochastic = o->stochastic_round != 0,
        .state_dtype = momentum_buf && n > 0 ? momentum_buf[0]->dtype : MS_DTYPE_F32, .seed = o->seed,
    };
    int launches = 0;
    const msk_rng *rng = o->stochastic_round ? c.rng : NULL;
    if (st == MS_OK) st = ms_cuda_note_failure(ctx, msk_sgd_run(ctx, STREAM(ctx), &k, c.n, c.m, rng, &launches));
    if (st == MS_OK) {
        track_all(ctx, n, (const ms_tensor *const *)params, grads, momentum_buf, NULL);
        ms_cuda_track_tensor(ctx, o->lr_t);
        ms_cuda_track_tensor(ctx, o->step_t);
        ms_cuda_track_tensor(ctx, o->skip_t);
    }
    return finish(&c, st, launches);
}

/* --- foreach ----------------------------------------------------------------------------------------------- */

ms_status ms_cuda_foreach_scale(ms_ctx *ctx, int n, ms_tensor *const *tensors, ms_scalar s)
{
    MS_NVTX_RANGE("ms_foreach_scale");
    MS_TRY(ms_cuda_enter(ctx));
    call c;
    MS_TRY(call_new(ctx, n, &c));
    ms_status st = MS_OK;
    for (int i = 0; i < n && st == MS_OK; i++) {
        if (ms_tensor_numel(tensors[i]) == 0) continue;
        int k = c.n++;
        msk_member *m = &c.m[k];
        m->numel = ms_tensor_numel(tensors[i]);
        m->index = i;
        m->xdt = (int8_t)tensors[i]->dtype;
        const void *data = NULL;
        st = strided_operand(&c, k, tensors[i], &data);
        m->x = (void *)data;
        m->vec = m->dense && aligned16(m->x) ? MSK_VEC_X : 0;
    }
    int launches = 0;
    if (st == MS_OK)
        st = ms_cuda_note_failure(ctx, msk_scale_run(ctx, STREAM(ctx), ms_cuda_scalar(s.v, s.t), c.n, c.m, &launches));
    /* members scaled in a temporary: their results go back where they belong */
    for (int k = 0; k < c.n && st == MS_OK; k++) {
        if (c.tmp[k] == NULL) continue;
        st = ms_cuda_copy_tensor(ctx, tensors[c.m[k].index], c.tmp[k]);
        c.extra++;
    }
    if (st == MS_OK) {
        track_all(ctx, n, (const ms_tensor *const *)tensors, NULL, NULL, NULL);
        ms_cuda_track_tensor(ctx, s.t);
    }
    return finish(&c, st, launches);
}

/* The context's tickets (kernels/msk.h: msk_sumsq_run, msk_sinkgd_run): made and zeroed once, like the cuBLAS
** handle, and never while capturing (the driver cannot allocate then).  They stay zero between calls because
** every call leaves them so; calls on the context's stream never overlap, so the ops share them. */
ms_status ms_cuda_tickets(ms_ctx *ctx, const char *op, unsigned **out)
{
    ms_cuda_ctx *cc = ms_cuda(ctx);
    if (cc->tickets == NULL) {
        if (ms_cuda_capturing(ctx))   /* its own graph, or a trainer's capture it joined: no cudaMalloc there */
            return ms_cuda_note_failure(ctx, MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s on %s: the first call sets up the "
                                                     "context's counters and cannot be captured; run it once "
                                                     "before capturing", op, ctx->name));
        void *p = NULL;
        size_t nbytes = MSK_OPTIM_CAP * sizeof(unsigned);
        MS_CUDA_TRY(ctx, cudaMalloc(&p, nbytes));
        cudaError_t e = cudaMemsetAsync(p, 0, nbytes, cc->stream);
        if (e != cudaSuccess) {
            cudaFree(p);
            return ms_cuda_fail(ctx, e, "cudaMemsetAsync (sumsq tickets)", __FILE__, __LINE__);
        }
        cc->tickets = p;
    }
    *out = cc->tickets;
    return MS_OK;
}

ms_status ms_cuda_foreach_sumsq(ms_ctx *ctx, ms_tensor *dst, int n, const ms_tensor *const *srcs)
{
    MS_NVTX_RANGE("ms_foreach_sumsq");
    MS_TRY(ms_cuda_enter(ctx));
    unsigned *tickets = NULL;
    MS_TRY(ms_cuda_tickets(ctx, "ms_foreach_sumsq", &tickets));
    call c;
    MS_TRY(call_new(ctx, n, &c));
    ms_status st = MS_OK;
    for (int i = 0; i < n && st == MS_OK; i++) {   /* every member, empty ones too: their dst element is 0 */
        int k = c.n++;
        msk_member *m = &c.m[k];
        m->numel = ms_tensor_numel(srcs[i]);
        m->index = i;
        m->xdt = (int8_t)srcs[i]->dtype;
        const void *data = NULL;
        st = strided_operand(&c, k, srcs[i], &data);
        m->x = (void *)data;
    }
    size_t scratch_bytes = st == MS_OK ? msk_sumsq_scratch(c.n, c.m) : 0;
    void *scratch = NULL;
    if (st == MS_OK && scratch_bytes) st = ms_cuda_scratch(ctx, scratch_bytes, &scratch);
    int launches = 0;
    if (st == MS_OK)
        st = ms_cuda_note_failure(ctx, msk_sumsq_run(ctx, STREAM(ctx), ms_tensor_ptr(dst), dst->dtype, c.n, c.m,
                                                     scratch, tickets, &launches));
    if (st == MS_OK) {
        track_all(ctx, n, srcs, NULL, NULL, NULL);
        ms_cuda_track_tensor(ctx, dst);
    }
    if (scratch) ms_cuda_scratch_free(ctx, scratch, scratch_bytes);   /* stream-ordered: safe right away */
    return finish(&c, st, launches);
}

/* --- AdamW with 8-bit state (kernels/adamw8.cu) -------------------------------------------------------------
** The members are those of a step (x = param, g = grad in any layout, s0/s1 = the u8 codes) plus the two scale
** arrays; the maps are ms_adamw8_qmap's, passed in the kernel parameters. */

ms_status ms_cuda_adamw8_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                              ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_scale,
                              ms_tensor *const *exp_avg_sq, ms_tensor *const *exp_avg_sq_scale,
                              const double *scales, const ms_adamw8_options *o8)
{
    MS_NVTX_RANGE("ms_adamw8_step");
    MS_TRY(ms_cuda_enter(ctx));
    const ms_adamw_options *o = &o8->adamw;
    call c;
    MS_TRY(call_new(ctx, n, &c));
    ms_status st = step_members(&c, n, params, grads, exp_avg, exp_avg_sq, scales);
    msk_adamw8_member *mm = NULL;
    msk_adamw8 *k = NULL;
    if (st == MS_OK) {
        mm = calloc((size_t)(c.n > 0 ? c.n : 1), sizeof *mm);
        k = calloc(1, sizeof *k);
        if (mm == NULL || k == NULL) st = MS_FAIL(ctx, MS_E_OOM, "cuda adamw8: no host memory for %d members", n);
    }
    if (st == MS_OK) {
        for (int j = 0; j < c.n; j++) {
            int i = c.pos[j];
            mm[j].t = c.m[j];
            mm[j].m_scale = ms_tensor_ptr(exp_avg_scale[i]);
            mm[j].v_scale = ms_tensor_ptr(exp_avg_sq_scale[i]);
            if (c.rng) mm[j].rng = c.rng[j];
        }
        k->a = (msk_adamw){
            .lr = ms_cuda_scalar(o->lr, o->lr_t), .step = ms_cuda_scalar(o->step, o->step_t), .skip = ms_cuda_scalar(0, o->skip_t),
            .beta1 = o->beta1, .beta2 = o->beta2, .omb1 = 1.0 - o->beta1, .omb2 = 1.0 - o->beta2, .eps = o->eps,
            .weight_decay = o->weight_decay, .bc1 = 1.0, .bc2_sqrt = 1.0, .bias_correction = o->bias_correction != 0,
            .stochastic = o->stochastic_round != 0, .state_dtype = MS_DTYPE_U8, .seed = o->seed,
        };
        if (o->bias_correction && o->step_t == NULL) {   /* the host's libm, as the CPU backend computes them */
            double step = rint(o->step);
            k->a.bc1 = 1.0 - pow(o->beta1, step);
            k->a.bc2_sqrt = sqrt(1.0 - pow(o->beta2, step));
        }
        k->block_size = o8->block_size;
        ms_adamw8_qmap(1, k->qmap[0]);
        ms_adamw8_qmap(0, k->qmap[1]);
    }
    int launches = 0;
    if (st == MS_OK) st = ms_cuda_note_failure(ctx, msk_adamw8_run(ctx, STREAM(ctx), k, c.n, mm, &launches));
    if (st == MS_OK) {
        track_all(ctx, n, (const ms_tensor *const *)params, grads, exp_avg, exp_avg_sq);
        track_all(ctx, n, (const ms_tensor *const *)exp_avg_scale, NULL, exp_avg_sq_scale, NULL);
        ms_cuda_track_tensor(ctx, o->lr_t);
        ms_cuda_track_tensor(ctx, o->step_t);
        ms_cuda_track_tensor(ctx, o->skip_t);
    }
    free(mm);
    free(k);
    return finish(&c, st, launches);
}

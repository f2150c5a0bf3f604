/*
** The public entry point of the SinkGD step (ms_sinkgd_step; semantics in moonstep.h, from research/sinkgd.md
** §2.5 and §8): every option, member, state tensor and device scalar is checked before the backend runs, so a
** call that fails changes nothing; then one backend call (one counted launch) updates the whole group.
*/
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static const char FN[] = "ms_sinkgd_step";

static const char *who(char *buf, size_t n, int i, const char *role)
{
    snprintf(buf, n, "member %d (%s)", i, role);
    return buf;
}

static bool sinkgd_dtype(ms_dtype dt) { return dt == MS_DTYPE_F32 || dt == MS_DTYPE_BF16 || dt == MS_DTYPE_F16; }

static ms_status check_options(ms_ctx *ctx, const ms_sinkgd_options *o)
{
    if (o->lr_t == NULL && !(isfinite(o->lr) && o->lr >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: lr = %g must be finite and >= 0", FN, o->lr);
    if (o->step_t == NULL && !(isfinite(o->step) && rint(o->step) >= 1))
        return MS_FAIL(ctx, MS_E_ARG, "%s: step = %g must be a finite number >= 1 (steps count from 1)", FN, o->step);
    if ((unsigned)o->mode > MS_SINKGD_SPHERE)
        return MS_FAIL(ctx, MS_E_ARG, "%s: mode = %d is not one of MS_SINKGD_BASE, _SPECTRAL, _SPHERE", FN, (int)o->mode);
    if ((unsigned)o->target > MS_SINKGD_TARGET_MUON)
        return MS_FAIL(ctx, MS_E_ARG, "%s: target = %d is not one of MS_SINKGD_TARGET_UNIT, _MUON", FN, (int)o->target);
    if (o->iters < 0) return MS_FAIL(ctx, MS_E_ARG, "%s: iters = %d must be >= 0", FN, o->iters);
    if (o->mode != MS_SINKGD_BASE && o->sn_iters < 1)
        return MS_FAIL(ctx, MS_E_ARG, "%s: sn_iters = %d must be >= 1 in spectral and sphere modes (the power "
                       "iteration gives sigma)", FN, o->sn_iters);
    if (!(isfinite(o->eps) && o->eps > 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: eps = %g must be finite and > 0", FN, o->eps);
    if (!(isfinite(o->weight_decay) && o->weight_decay >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: weight_decay = %g must be finite and >= 0", FN, o->weight_decay);
    /* the sphere step keeps ||p||_F fixed, so a decay would be undone by the projection: refuse rather than
    ** pretend to apply it */
    if (o->mode == MS_SINKGD_SPHERE && o->weight_decay != 0)
        return MS_FAIL(ctx, MS_E_ARG, "%s: weight_decay = %g must be 0 in sphere mode (the projection keeps "
                       "||p||_F)", FN, o->weight_decay);
    MS_TRY(ms_check_device_scalar(ctx, FN, "lr_t", o->lr_t));
    MS_TRY(ms_check_device_scalar(ctx, FN, "step_t", o->step_t));
    MS_TRY(ms_check_device_scalar(ctx, FN, "skip_t", o->skip_t));
    return MS_OK;
}

/* `t` has exactly the leading dims of p ([..., m, n] -> [...]); a 2-D param's scalar may also be [1]. */
static bool lead_shape(const ms_tensor *t, const ms_tensor *p)
{
    int lead = p->ndim - 2;
    if (lead == 0 && t->ndim == 1 && t->shape[0] == 1) return true;
    if (t->ndim != lead) return false;
    for (int d = 0; d < lead; d++)
        if (t->shape[d] != p->shape[d]) return false;
    return true;
}

static ms_status check_member(ms_ctx *ctx, int i, const ms_tensor *p, const ms_tensor *g, const ms_tensor *u,
                              const ms_tensor *t, const double *scales, ms_sinkgd_mode mode)
{
    char w[64];
    MS_TRY(ms_check_on_device(ctx, FN, who(w, sizeof w, i, "param"), p));
    MS_TRY(ms_check_on_device(ctx, FN, who(w, sizeof w, i, "grad"), g));
    if (mode != MS_SINKGD_BASE) MS_TRY(ms_check_on_device(ctx, FN, who(w, sizeof w, i, "specnorm_u"), u));
    if (mode == MS_SINKGD_SPHERE) MS_TRY(ms_check_on_device(ctx, FN, who(w, sizeof w, i, "md_target_norm"), t));

    if (!sinkgd_dtype(p->dtype))
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (param) has dtype %s; params must be f32, bf16 or f16", FN, i,
                       ms_dtype_name(p->dtype));
    if (!sinkgd_dtype(g->dtype))
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (grad) has dtype %s; grads must be f32, bf16 or f16", FN, i,
                       ms_dtype_name(g->dtype));
    if (p->ndim < 2)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (param) has shape %s; SinkGD needs [..., m, n] (ndim >= 2)",
                       FN, i, ms_tshape(p));
    bool same = g->ndim == p->ndim;
    for (int d = 0; same && d < p->ndim; d++) same = g->shape[d] == p->shape[d];
    if (!same)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (grad): shape %s != param shape %s", FN, i, ms_tshape(g),
                       ms_tshape(p));
    MS_TRY(ms_check_contiguous(ctx, FN, who(w, sizeof w, i, "param"), p));

    if (mode != MS_SINKGD_BASE) {
        if (u->dtype != MS_DTYPE_F32)
            return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (specnorm_u) has dtype %s; it must be f32", FN, i,
                           ms_dtype_name(u->dtype));
        bool ok = u->ndim == p->ndim - 1 && u->shape[u->ndim - 1] == p->shape[p->ndim - 1];
        for (int d = 0; ok && d < p->ndim - 2; d++) ok = u->shape[d] == p->shape[d];
        if (!ok)
            return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (specnorm_u): shape %s, but param %s needs [..., n] = "
                           "its leading dims and its last", FN, i, ms_tshape(u), ms_tshape(p));
        MS_TRY(ms_check_contiguous(ctx, FN, who(w, sizeof w, i, "specnorm_u"), u));
    }
    if (mode == MS_SINKGD_SPHERE) {
        if (t->dtype != MS_DTYPE_F32)
            return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (md_target_norm) has dtype %s; it must be f32", FN, i,
                           ms_dtype_name(t->dtype));
        if (!lead_shape(t, p))
            return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (md_target_norm): shape %s, but param %s needs its "
                           "leading dims (one radius per matrix)", FN, i, ms_tshape(t), ms_tshape(p));
        MS_TRY(ms_check_contiguous(ctx, FN, who(w, sizeof w, i, "md_target_norm"), t));
    }
    if (scales && !(isfinite(scales[i]) && scales[i] >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: scales[%d] = %g must be finite and >= 0", FN, i, scales[i]);
    return MS_OK;
}

MS_API ms_status ms_sinkgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                                ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                                const double *scales, const ms_sinkgd_options *opts)
{
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", FN);
    if (opts == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: opts is NULL (lr, step, mode and eps have no defaults)", FN);
    const ms_sinkgd_options *o = opts;
    MS_TRY(check_options(ctx, o));
    if (n < 0) return MS_FAIL(ctx, MS_E_ARG, "%s: n = %d is negative", FN, n);
    if (n == 0) return MS_OK;
    if (params == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: params is NULL (n = %d)", FN, n);
    if (grads == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: grads is NULL (n = %d)", FN, n);
    bool with_u = o->mode != MS_SINKGD_BASE, with_t = o->mode == MS_SINKGD_SPHERE;
    if (with_u && specnorm_u == NULL)
        return MS_FAIL(ctx, MS_E_ARG, "%s: specnorm_u is NULL; spectral and sphere modes keep u per matrix", FN);
    if (with_t && md_target_norm == NULL)
        return MS_FAIL(ctx, MS_E_ARG, "%s: md_target_norm is NULL; sphere mode keeps a radius per matrix", FN);
    for (int i = 0; i < n; i++)
        MS_TRY(check_member(ctx, i, params[i], grads[i], with_u ? specnorm_u[i] : NULL,
                            with_t ? md_target_norm[i] : NULL, scales, o->mode));

    /* written: params and the state; read: grads (which may share memory with each other) and scalars */
    int64_t count = (int64_t)n * 4 + 3, k = 0;
    ms_arg_use stack[64], *uses = stack;
    if (count > 64) {
        uses = malloc((size_t)count * sizeof *uses);
        if (uses == NULL) return MS_FAIL(ctx, MS_E_OOM, "%s: no host memory to check %d members", FN, n);
    }
    for (int i = 0; i < n; i++) {
        uses[k++] = (ms_arg_use){ params[i], i, "param", true };
        uses[k++] = (ms_arg_use){ grads[i], i, "grad", false };
        if (with_u) uses[k++] = (ms_arg_use){ specnorm_u[i], i, "specnorm_u", true };
        if (with_t) uses[k++] = (ms_arg_use){ md_target_norm[i], i, "md_target_norm", true };
    }
    uses[k++] = (ms_arg_use){ o->lr_t, -1, "lr_t", false };
    uses[k++] = (ms_arg_use){ o->step_t, -1, "step_t", false };
    uses[k++] = (ms_arg_use){ o->skip_t, -1, "skip_t", false };
    ms_status st = ms_check_overlaps(ctx, FN, uses, k);
    if (uses != stack) free(uses);
    if (st != MS_OK) return st;

    if (ctx->backend->sinkgd_step == NULL)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s is not implemented on %s", FN, ctx->name);
    st = ctx->backend->sinkgd_step(ctx, n, params, grads, with_u ? specnorm_u : NULL, with_t ? md_target_norm : NULL,
                                   scales, o);
    if (st == MS_OK) ms_ctx_count_launch(ctx);
    return st;
}

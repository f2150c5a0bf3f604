/*
** AdamW with 8-bit block-quantized moments: the dynamic-tree quantization map (ms_adamw8_qmap; Dettmers,
** "8-Bit Approximations for Parallelism in Deep Learning", arXiv 1511.04561, as torchao's create_dynamic_map
** lays it out) and the public entry point ms_adamw8_step, which checks every option, member and state tensor
** before one backend call updates the group (so a call that fails changes nothing).
*/
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static const char FN[] = "ms_adamw8_step";

/* --- the quantization map ------------------------------------------------------------------------------
** 7 decades of "fraction" values: decade k (0..6) holds the midpoints of an even grid on [0.1, 1] scaled by
** 10^(k-6), with 2^k cells (signed: one sign bit, so half as many per sign) or 2^(k+1) (unsigned); 0 and 1
** complete the 256 codes.  Decades do not overlap, so the sorted map interleaves nothing: it is negatives
** (largest magnitude first), 0, positives, 1. */

MS_API void ms_adamw8_qmap(int is_signed, float *out)
{
    if (out == NULL) return;
    static const double pow10[7] = { 1, 10, 100, 1000, 10000, 100000, 1000000 };
    double v[256];
    int k = 0;
    for (int dec = 0; dec < 7; dec++) {
        int cells = is_signed ? 1 << dec : 1 << (dec + 1);
        double scale = 1.0 / pow10[6 - dec];   /* 10^(dec-6), rounded once like the literal */
        for (int i = 0; i < cells; i++) {
            double mid = 0.1 + 0.45 * (2 * i + 1) / cells;   /* midpoint of cell i of [0.1, 1] */
            v[k++] = scale * mid;
            if (is_signed) v[k++] = -scale * mid;
        }
    }
    v[k++] = 0;
    v[k++] = 1;
    /* 256 values: insertion sort is plenty */
    for (int i = 1; i < 256; i++) {
        double x = v[i];
        int j = i - 1;
        for (; j >= 0 && v[j] > x; j--) v[j + 1] = v[j];
        v[j + 1] = x;
    }
    for (int i = 0; i < 256; i++) out[i] = (float)v[i];
}

/* --- the entry point ------------------------------------------------------------------------------------ */

static const char *who(char *buf, size_t n, int i, const char *role)
{
    snprintf(buf, n, "member %d (%s)", i, role);
    return buf;
}

static bool same_shape(const ms_tensor *a, const ms_tensor *b)
{
    if (a->ndim != b->ndim) return false;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return false;
    return true;
}

static ms_status check_options(ms_ctx *ctx, const ms_adamw8_options *o8)
{
    const ms_adamw_options *o = &o8->adamw;
    if (o->lr_t == NULL && !(isfinite(o->lr) && o->lr >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: lr = %g must be finite and >= 0", FN, o->lr);
    if (o->step_t == NULL && !(isfinite(o->step) && rint(o->step) >= 1))
        return MS_FAIL(ctx, MS_E_ARG, "%s: step = %g must be a finite number >= 1 (steps count from 1)", FN, o->step);
    if (!(o->beta1 >= 0 && o->beta1 < 1)) return MS_FAIL(ctx, MS_E_ARG, "%s: beta1 = %g is outside [0, 1)", FN, o->beta1);
    if (!(o->beta2 >= 0 && o->beta2 < 1)) return MS_FAIL(ctx, MS_E_ARG, "%s: beta2 = %g is outside [0, 1)", FN, o->beta2);
    if (!(isfinite(o->eps) && o->eps > 0)) return MS_FAIL(ctx, MS_E_ARG, "%s: eps = %g must be finite and > 0", FN, o->eps);
    if (!(isfinite(o->weight_decay) && o->weight_decay >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: weight_decay = %g must be finite and >= 0", FN, o->weight_decay);
    if (o8->block_size < 1 || o8->block_size > MS_ADAMW8_BLOCK_MAX)
        return MS_FAIL(ctx, MS_E_ARG, "%s: block_size = %d is outside [1, %d]", FN, o8->block_size, MS_ADAMW8_BLOCK_MAX);
    MS_TRY(ms_check_device_scalar(ctx, FN, "lr_t", o->lr_t));
    MS_TRY(ms_check_device_scalar(ctx, FN, "step_t", o->step_t));
    MS_TRY(ms_check_device_scalar(ctx, FN, "skip_t", o->skip_t));
    return MS_OK;
}

static ms_status check_codes(ms_ctx *ctx, int i, const char *role, const ms_tensor *c, const ms_tensor *p)
{
    char w[64];
    MS_TRY(ms_check_on_device(ctx, FN, who(w, sizeof w, i, role), c));
    if (c->dtype != MS_DTYPE_U8)
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (%s) has dtype %s; the codes must be u8", FN, i, role,
                       ms_dtype_name(c->dtype));
    if (!same_shape(c, p))
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (%s): shape %s != param shape %s", FN, i, role, ms_tshape(c),
                       ms_tshape(p));
    return ms_check_contiguous(ctx, FN, who(w, sizeof w, i, role), c);
}

static ms_status check_scale(ms_ctx *ctx, int i, const char *role, const ms_tensor *s, int64_t blocks)
{
    char w[64];
    MS_TRY(ms_check_on_device(ctx, FN, who(w, sizeof w, i, role), s));
    if (s->dtype != MS_DTYPE_F32)
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (%s) has dtype %s; the block scales must be f32", FN, i, role,
                       ms_dtype_name(s->dtype));
    if (s->ndim != 1 || s->shape[0] != blocks)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (%s): shape %s, [%lld] needed (one scale per block)", FN, i,
                       role, ms_tshape(s), (long long)blocks);
    return ms_check_contiguous(ctx, FN, who(w, sizeof w, i, role), s);
}

static ms_status check_member(ms_ctx *ctx, int i, const ms_tensor *p, const ms_tensor *g, const ms_tensor *const st[4],
                              const double *scales, int block)
{
    static const char *const roles[4] = { "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale" };
    char w[64];
    MS_TRY(ms_check_on_device(ctx, FN, who(w, sizeof w, i, "param"), p));
    MS_TRY(ms_check_on_device(ctx, FN, who(w, sizeof w, i, "grad"), g));
    if (p->dtype != MS_DTYPE_F32 && p->dtype != MS_DTYPE_BF16 && p->dtype != MS_DTYPE_F16)
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (param) has dtype %s; params must be f32, bf16 or f16", FN, i,
                       ms_dtype_name(p->dtype));
    if (!ms_dtype_is_float(g->dtype))
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (grad) has dtype %s; a float dtype is needed", FN, i,
                       ms_dtype_name(g->dtype));
    if (!same_shape(g, p))
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (grad): shape %s != param shape %s", FN, i, ms_tshape(g),
                       ms_tshape(p));
    MS_TRY(ms_check_contiguous(ctx, FN, who(w, sizeof w, i, "param"), p));
    int64_t numel = ms_tensor_numel(p);
    if (numel % block != 0)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (param) has %lld elements, not a multiple of block_size %d "
                       "(keep such tensors' state in f32: ms_adamw_step)", FN, i, (long long)numel, block);
    MS_TRY(check_codes(ctx, i, roles[0], st[0], p));
    MS_TRY(check_scale(ctx, i, roles[1], st[1], numel / block));
    MS_TRY(check_codes(ctx, i, roles[2], st[2], p));
    MS_TRY(check_scale(ctx, i, roles[3], st[3], numel / block));
    if (scales && !(isfinite(scales[i]) && scales[i] >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: scales[%d] = %g must be finite and >= 0", FN, i, scales[i]);
    return MS_OK;
}

MS_API ms_status ms_adamw8_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                                ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_scale,
                                ms_tensor *const *exp_avg_sq, ms_tensor *const *exp_avg_sq_scale,
                                const double *scales, const ms_adamw8_options *opts)
{
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", FN);
    if (opts == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: opts is NULL (lr, betas, eps, step and block_size have no "
                                     "defaults)", FN);
    MS_TRY(check_options(ctx, opts));
    if (n < 0) return MS_FAIL(ctx, MS_E_ARG, "%s: n = %d is negative", FN, n);
    if (n == 0) return MS_OK;
    ms_tensor *const *st[4] = { exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale };
    static const char *const roles[4] = { "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale" };
    if (params == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: params is NULL (n = %d)", FN, n);
    if (grads == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: grads is NULL (n = %d)", FN, n);
    for (int s = 0; s < 4; s++)
        if (st[s] == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: %s is NULL (n = %d)", FN, roles[s], n);
    for (int i = 0; i < n; i++) {
        const ms_tensor *mst[4] = { st[0][i], st[1][i], st[2][i], st[3][i] };
        MS_TRY(check_member(ctx, i, params[i], grads[i], mst, scales, opts->block_size));
    }

    int64_t count = (int64_t)n * 6 + 3, k = 0;
    ms_arg_use stack[64], *uses = stack;
    if (count > 64) {
        uses = malloc((size_t)count * sizeof *uses);
        if (uses == NULL) return MS_FAIL(ctx, MS_E_OOM, "%s: no host memory to check %d members", FN, n);
    }
    for (int i = 0; i < n; i++) {
        uses[k++] = (ms_arg_use){ params[i], i, "param", true };
        uses[k++] = (ms_arg_use){ grads[i], i, "grad", false };
        for (int s = 0; s < 4; s++) uses[k++] = (ms_arg_use){ st[s][i], i, roles[s], true };
    }
    const ms_adamw_options *o = &opts->adamw;
    uses[k++] = (ms_arg_use){ o->lr_t, -1, "lr_t", false };
    uses[k++] = (ms_arg_use){ o->step_t, -1, "step_t", false };
    uses[k++] = (ms_arg_use){ o->skip_t, -1, "skip_t", false };
    ms_status status = ms_check_overlaps(ctx, FN, uses, k);
    if (uses != stack) free(uses);
    if (status != MS_OK) return status;

    if (ctx->backend->adamw8_step == NULL)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s is not implemented on %s", FN, ctx->name);
    status = ctx->backend->adamw8_step(ctx, n, params, grads, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale,
                                       scales, opts);
    if (status == MS_OK) ms_ctx_count_launch(ctx);
    return ms_error_name(ctx, status, FN);
}

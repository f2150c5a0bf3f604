/*
** The public entry points of the multi-tensor helpers and fused optimizer steps (ms_foreach_sumsq,
** ms_foreach_scale, ms_adamw_step, ms_sgd_step): every member, option and device scalar is checked before the
** backend runs, so a call that fails changes nothing; then one backend call (one counted launch) does the group.
*/
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool same_device(const ms_ctx *a, const ms_ctx *b) { return a->type == b->type && a->index == b->index; }

/* --- checks of single tensors ---------------------------------------------------------------------
** `who` names the tensor in messages: "member 3 (exp_avg)", "dst", "lr_t". */

static ms_status check_on_device(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t)
{
    if (t == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: %s is NULL", fn, who);
    if (!same_device(ctx, t->ctx))
        return MS_FAIL(ctx, MS_E_DEVICE, "%s: %s is on %s but the context is on %s", fn, who, t->ctx->name,
                       ctx->name);
    return MS_OK;
}

static ms_status check_float_dtype(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t)
{
    if (ms_dtype_is_float(t->dtype)) return MS_OK;
    return MS_FAIL(ctx, MS_E_DTYPE, "%s: %s has dtype %s; a float dtype (f32, f64, bf16, f16) is needed", fn, who,
                   ms_dtype_name(t->dtype));
}

static ms_status check_contiguous(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t)
{
    if (ms_tensor_contiguous_p(t)) return MS_OK;
    char strides[16 * MS_MAX_DIMS + 4];
    return MS_FAIL(ctx, MS_E_LAYOUT, "%s: %s is not contiguous (shape %s, strides %s); it is updated in place "
                   "and must be contiguous", fn, who, ms_tshape(t),
                   ms_shape_str(strides, sizeof strides, t->ndim, t->strides));
}

static bool same_shape(const ms_tensor *a, const ms_tensor *b)
{
    if (a->ndim != b->ndim) return false;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return false;
    return true;
}

/* A device scalar (optional): one element of a float dtype on ctx's device. */
static ms_status check_device_scalar(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t)
{
    if (t == NULL) return MS_OK;
    MS_TRY(check_on_device(ctx, fn, who, t));
    MS_TRY(check_float_dtype(ctx, fn, who, t));
    if (ms_tensor_numel(t) != 1)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: %s must hold exactly one element, it has shape %s", fn, who,
                       ms_tshape(t));
    return MS_OK;
}

static const char *member_name(char *buf, size_t n, int i, const char *role)
{
    snprintf(buf, n, "member %d (%s)", i, role);
    return buf;
}

/* --- overlap of the tensors of one call -----------------------------------------------------------
** Tensors that are written (params, states, scaled tensors, dst) must not share memory with any other tensor
** of the call; read-only ones (grads, sources, device scalars) may share memory with each other.  Overlap is
** that of ms_tensor_overlaps: the byte ranges the tensors can touch intersect.  The ranges are sorted and swept
** once (n log n), so a 10 000-member group costs no more than its sort. */

typedef struct span {
    uintptr_t   lo, hi;      /* bytes [lo, hi) */
    int64_t     order;       /* position in the order the call lists its tensors (for messages) */
    int         member;      /* -1 for tensors that belong to no member (dst, device scalars) */
    const char *role;
    bool        written;
} span;

static int span_by_address(const void *a, const void *b)
{
    const span *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

static int span_by_order(const void *a, const void *b)
{
    const span *x = a, *y = b;
    return x->order < y->order ? -1 : x->order > y->order;
}

static void span_add(span *s, int64_t *k, const ms_tensor *t, int member, const char *role, bool written)
{
    if (t == NULL || ms_tensor_numel(t) == 0) return;
    int64_t last = 0;   /* element offset of the farthest element (strides are never negative) */
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] > 1) last += t->strides[d] * (t->shape[d] - 1);
    uintptr_t lo = (uintptr_t)ms_tensor_ptr(t);
    s[*k] = (span){ lo, lo + (uintptr_t)((last + 1) * (int64_t)ms_dtype_size(t->dtype)), *k, member, role, written };
    (*k)++;
}

static bool span_conflict(const span *a, const span *b)
{
    return (a->written || b->written) && a->lo < b->hi && b->lo < a->hi;
}

static const char *span_name(char *buf, size_t n, const span *s)
{
    if (s->member < 0) return s->role;
    return member_name(buf, n, s->member, s->role);
}

/* Above this many spans a conflict is named as the sweep found it, not searched for in call order. */
#define CANONICAL_SEARCH_MAX 4096

/* Finds a written span overlapping another span.  After sorting by start, a span overlaps an earlier one
** exactly when it starts before the largest end seen so far (of any span if it is written, else of the
** written spans), and the span with that end overlaps it.  Which conflict the sweep meets first depends on
** where the allocator put the tensors, so for the message the first conflict in call order is searched for
** (quadratic, on the error path only, up to CANONICAL_SEARCH_MAX spans): the same call always names the same
** pair. */
static ms_status check_spans(ms_ctx *ctx, const char *fn, span *s, int64_t k)
{
    qsort(s, (size_t)k, sizeof *s, span_by_address);
    const span *far_any = NULL, *far_written = NULL, *a = NULL, *b = NULL;
    for (int64_t j = 0; j < k && !a; j++) {
        const span *e = &s[j];
        if (e->written && far_any && e->lo < far_any->hi) a = far_any, b = e;
        else if (!e->written && far_written && e->lo < far_written->hi) a = far_written, b = e;
        if (!far_any || e->hi > far_any->hi) far_any = e;
        if (e->written && (!far_written || e->hi > far_written->hi)) far_written = e;
    }
    if (!a) return MS_OK;
    span first = *a, second = *b;
    if (k <= CANONICAL_SEARCH_MAX) {
        qsort(s, (size_t)k, sizeof *s, span_by_order);
        bool found = false;
        for (int64_t j = 1; j < k && !found; j++)
            for (int64_t i = 0; i < j && !found; i++)
                if (span_conflict(&s[i], &s[j])) first = s[i], second = s[j], found = true;
    } else if (first.order > second.order) {
        span t = first;
        first = second;
        second = t;
    }
    char na[64], nb[64];
    return MS_FAIL(ctx, MS_E_LAYOUT, "%s: %s and %s share memory (tensors updated in place may not overlap any "
                   "other tensor of the call)", fn, span_name(na, sizeof na, &first), span_name(nb, sizeof nb, &second));
}

/* Room for `count` spans: the caller's stack array when it is large enough, else the heap (*heap set). */
#define STACK_SPANS 64
static ms_status spans_get(ms_ctx *ctx, const char *fn, int64_t count, span *stack, span **out, span **heap)
{
    *heap = NULL;
    if (count <= STACK_SPANS) {
        *out = stack;
        return MS_OK;
    }
    *heap = malloc((size_t)count * sizeof(span));
    if (*heap == NULL)
        return MS_FAIL(ctx, MS_E_OOM, "%s: no host memory to check %lld tensors for overlap", fn, (long long)count);
    *out = *heap;
    return MS_OK;
}

/* --- the members of a fused step ------------------------------------------------------------------- */

/* What ms_adamw_step and ms_sgd_step share: n members of (param, grad, up to two states), per-member scales,
** and device scalars. */
typedef struct group {
    const char             *fn;
    int                     n;
    ms_tensor *const       *params;
    const ms_tensor *const *grads;
    int                     nstate;
    const char             *state_role[2];
    ms_tensor *const       *states[2];
    const double           *scales;
    const char             *scalar_name[3];
    const ms_tensor        *scalar[3];
} group;

static ms_status check_member(ms_ctx *ctx, const group *g, int i)
{
    const char *fn = g->fn;
    char who[64];
    const ms_tensor *p = g->params[i], *gr = g->grads[i];
    MS_TRY(check_on_device(ctx, fn, member_name(who, sizeof who, i, "param"), p));
    MS_TRY(check_on_device(ctx, fn, member_name(who, sizeof who, i, "grad"), gr));
    for (int s = 0; s < g->nstate; s++)
        MS_TRY(check_on_device(ctx, fn, member_name(who, sizeof who, i, g->state_role[s]), g->states[s][i]));

    if (!ms_dtype_is_float(p->dtype))
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (param) has dtype %s; params must be f32, f64, bf16 or f16",
                       fn, i, ms_dtype_name(p->dtype));
    MS_TRY(check_float_dtype(ctx, fn, member_name(who, sizeof who, i, "grad"), gr));
    for (int s = 0; s < g->nstate; s++) {
        const ms_tensor *st = g->states[s][i];
        if (st->dtype != MS_DTYPE_F32 && st->dtype != MS_DTYPE_BF16)
            return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (%s) has dtype %s; states must be f32 or bf16", fn, i,
                           g->state_role[s], ms_dtype_name(st->dtype));
        const ms_tensor *first = g->states[0][0];
        if (st->dtype != first->dtype)
            return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (%s) has dtype %s but member 0 (%s) has %s; every state "
                           "of a call must have the same dtype", fn, i, g->state_role[s], ms_dtype_name(st->dtype),
                           g->state_role[0], ms_dtype_name(first->dtype));
    }

    if (!same_shape(gr, p))
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (grad): shape %s != param shape %s", fn, i, ms_tshape(gr),
                       ms_tshape(p));
    for (int s = 0; s < g->nstate; s++)
        if (!same_shape(g->states[s][i], p))
            return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (%s): shape %s != param shape %s", fn, i,
                           g->state_role[s], ms_tshape(g->states[s][i]), ms_tshape(p));

    MS_TRY(check_contiguous(ctx, fn, member_name(who, sizeof who, i, "param"), p));
    for (int s = 0; s < g->nstate; s++)
        MS_TRY(check_contiguous(ctx, fn, member_name(who, sizeof who, i, g->state_role[s]), g->states[s][i]));

    if (g->scales && !(isfinite(g->scales[i]) && g->scales[i] >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: scales[%d] = %g must be finite and >= 0", fn, i, g->scales[i]);
    return MS_OK;
}

static ms_status check_group(ms_ctx *ctx, const group *g)
{
    const char *fn = g->fn;
    if (g->n < 0) return MS_FAIL(ctx, MS_E_ARG, "%s: n = %d is negative", fn, g->n);
    for (int k = 0; k < 3; k++) MS_TRY(check_device_scalar(ctx, fn, g->scalar_name[k], g->scalar[k]));
    if (g->n == 0) return MS_OK;
    if (g->params == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: params is NULL (n = %d)", fn, g->n);
    if (g->grads == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: grads is NULL (n = %d)", fn, g->n);
    for (int s = 0; s < g->nstate; s++)
        if (g->states[s] == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: %s is NULL (n = %d)", fn, g->state_role[s], g->n);
    for (int i = 0; i < g->n; i++) MS_TRY(check_member(ctx, g, i));

    span stack[STACK_SPANS], *s = NULL, *heap = NULL;
    MS_TRY(spans_get(ctx, fn, (int64_t)g->n * (2 + g->nstate) + 3, stack, &s, &heap));
    int64_t k = 0;
    for (int i = 0; i < g->n; i++) {
        span_add(s, &k, g->params[i], i, "param", true);
        span_add(s, &k, g->grads[i], i, "grad", false);
        for (int j = 0; j < g->nstate; j++) span_add(s, &k, g->states[j][i], i, g->state_role[j], true);
    }
    for (int j = 0; j < 3; j++) span_add(s, &k, g->scalar[j], -1, g->scalar_name[j], false);
    ms_status st = check_spans(ctx, fn, s, k);
    free(heap);
    return st;
}

/* The options every step shares: a learning rate (ignored when lr_t is given) and a 1-based step. */
static ms_status check_lr_step(ms_ctx *ctx, const char *fn, double lr, const ms_tensor *lr_t, double step,
                               const ms_tensor *step_t)
{
    if (lr_t == NULL && !(isfinite(lr) && lr >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: lr = %g must be finite and >= 0", fn, lr);
    if (step_t == NULL && !(isfinite(step) && rint(step) >= 1))
        return MS_FAIL(ctx, MS_E_ARG, "%s: step = %g must be a finite number >= 1 (steps count from 1)", fn, step);
    return MS_OK;
}

static ms_status check_beta(ms_ctx *ctx, const char *fn, const char *name, double b)
{
    if (b >= 0 && b < 1) return MS_OK;
    return MS_FAIL(ctx, MS_E_ARG, "%s: %s = %g is outside [0, 1)", fn, name, b);
}

static ms_status check_nonneg(ms_ctx *ctx, const char *fn, const char *name, double x)
{
    if (isfinite(x) && x >= 0) return MS_OK;
    return MS_FAIL(ctx, MS_E_ARG, "%s: %s = %g must be finite and >= 0", fn, name, x);
}

static ms_status unsupported(ms_ctx *ctx, const char *fn)
{
    return MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s is not implemented on %s", fn, ctx->name);
}

/* (every caller has its public name in `fn`: a helper's message that lacks it gets it) */
#define DISPATCH(ctx, call) do { ms_status st_ = (call); if (st_ == MS_OK) ms_ctx_count_launch(ctx); \
                                 return ms_error_name((ctx), st_, fn); } while (0)

/* --- the entry points ------------------------------------------------------------------------------ */

MS_API ms_status ms_foreach_sumsq(ms_ctx *ctx, ms_tensor *dst, int n, const ms_tensor *const *srcs)
{
    static const char fn[] = "ms_foreach_sumsq";
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (n < 0) return MS_FAIL(ctx, MS_E_ARG, "%s: n = %d is negative", fn, n);
    MS_TRY(check_on_device(ctx, fn, "dst", dst));
    if (dst->dtype != MS_DTYPE_F32 && dst->dtype != MS_DTYPE_F64)
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: dst has dtype %s; f32 or f64 is needed", fn, ms_dtype_name(dst->dtype));
    if (ms_tensor_numel(dst) != n)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: dst has shape %s; it needs one element per source ([%d])", fn,
                       ms_tshape(dst), n);
    MS_TRY(check_contiguous(ctx, fn, "dst", dst));
    if (n > 0 && srcs == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: srcs is NULL (n = %d)", fn, n);
    char who[64];
    for (int i = 0; i < n; i++) {
        MS_TRY(check_on_device(ctx, fn, member_name(who, sizeof who, i, "src"), srcs[i]));
        MS_TRY(check_float_dtype(ctx, fn, member_name(who, sizeof who, i, "src"), srcs[i]));
    }
    span stack[STACK_SPANS], *s = NULL, *heap = NULL;
    MS_TRY(spans_get(ctx, fn, (int64_t)n + 1, stack, &s, &heap));
    int64_t k = 0;
    span_add(s, &k, dst, -1, "dst", true);
    for (int i = 0; i < n; i++) span_add(s, &k, srcs[i], i, "src", false);
    ms_status st = check_spans(ctx, fn, s, k);
    free(heap);
    if (st != MS_OK) return st;
    if (n == 0) return MS_OK;
    if (ctx->backend->foreach_sumsq == NULL) return unsupported(ctx, fn);
    DISPATCH(ctx, ctx->backend->foreach_sumsq(ctx, dst, n, srcs));
}

MS_API ms_status ms_foreach_scale(ms_ctx *ctx, int n, ms_tensor *const *tensors, double s, const ms_tensor *s_t)
{
    static const char fn[] = "ms_foreach_scale";
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (n < 0) return MS_FAIL(ctx, MS_E_ARG, "%s: n = %d is negative", fn, n);
    MS_TRY(check_device_scalar(ctx, fn, "s_t", s_t));
    if (n > 0 && tensors == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: tensors is NULL (n = %d)", fn, n);
    char who[64];
    for (int i = 0; i < n; i++) {
        member_name(who, sizeof who, i, "tensor");
        MS_TRY(check_on_device(ctx, fn, who, tensors[i]));
        MS_TRY(check_float_dtype(ctx, fn, who, tensors[i]));
        MS_TRY(ms_check_writable(ctx, fn, who, tensors[i]));
    }
    span stack[STACK_SPANS], *sp = NULL, *heap = NULL;
    MS_TRY(spans_get(ctx, fn, (int64_t)n + 1, stack, &sp, &heap));
    int64_t k = 0;
    for (int i = 0; i < n; i++) span_add(sp, &k, tensors[i], i, "tensor", true);
    span_add(sp, &k, s_t, -1, "s_t", false);
    ms_status st = check_spans(ctx, fn, sp, k);
    free(heap);
    if (st != MS_OK) return st;
    if (n == 0) return MS_OK;
    if (ctx->backend->foreach_scale == NULL) return unsupported(ctx, fn);
    DISPATCH(ctx, ctx->backend->foreach_scale(ctx, n, tensors, (ms_scalar){ s, s_t }));
}

MS_API ms_status ms_adamw_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                               ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_sq, const double *scales,
                               const ms_adamw_options *opts)
{
    static const char fn[] = "ms_adamw_step";
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (opts == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: opts is NULL (lr, betas, eps and step have no defaults)", fn);
    const ms_adamw_options *o = opts;
    MS_TRY(check_lr_step(ctx, fn, o->lr, o->lr_t, o->step, o->step_t));
    MS_TRY(check_beta(ctx, fn, "beta1", o->beta1));
    MS_TRY(check_beta(ctx, fn, "beta2", o->beta2));
    if (!(isfinite(o->eps) && o->eps > 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: eps = %g must be finite and > 0", fn, o->eps);
    MS_TRY(check_nonneg(ctx, fn, "weight_decay", o->weight_decay));
    group g = {
        .fn = fn, .n = n, .params = params, .grads = grads, .nstate = 2,
        .state_role = { "exp_avg", "exp_avg_sq" }, .states = { exp_avg, exp_avg_sq }, .scales = scales,
        .scalar_name = { "lr_t", "step_t", "skip_t" }, .scalar = { o->lr_t, o->step_t, o->skip_t },
    };
    MS_TRY(check_group(ctx, &g));
    if (n == 0) return MS_OK;
    if (ctx->backend->adamw_step == NULL) return unsupported(ctx, fn);
    DISPATCH(ctx, ctx->backend->adamw_step(ctx, n, params, grads, exp_avg, exp_avg_sq, scales, o));
}

MS_API ms_status ms_sgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                             ms_tensor *const *momentum_buf, const double *scales, const ms_sgd_options *opts)
{
    static const char fn[] = "ms_sgd_step";
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (opts == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: opts is NULL (lr and step have no defaults)", fn);
    const ms_sgd_options *o = opts;
    MS_TRY(check_lr_step(ctx, fn, o->lr, o->lr_t, o->step, o->step_t));
    MS_TRY(check_nonneg(ctx, fn, "momentum", o->momentum));
    if (!isfinite(o->dampening)) return MS_FAIL(ctx, MS_E_ARG, "%s: dampening = %g must be finite", fn, o->dampening);
    MS_TRY(check_nonneg(ctx, fn, "weight_decay", o->weight_decay));
    if (o->nesterov && (o->momentum <= 0 || o->dampening != 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: nesterov needs momentum > 0 and dampening == 0 (got momentum %g, "
                       "dampening %g)", fn, o->momentum, o->dampening);
    /* without momentum there is no buffer to keep: whatever momentum_buf holds is neither checked nor used */
    bool with_buf = o->momentum != 0;
    group g = {
        .fn = fn, .n = n, .params = params, .grads = grads, .nstate = with_buf ? 1 : 0,
        .state_role = { "momentum_buf", NULL }, .states = { momentum_buf, NULL }, .scales = scales,
        .scalar_name = { "lr_t", "step_t", "skip_t" }, .scalar = { o->lr_t, o->step_t, o->skip_t },
    };
    MS_TRY(check_group(ctx, &g));
    if (n == 0) return MS_OK;
    if (ctx->backend->sgd_step == NULL) return unsupported(ctx, fn);
    DISPATCH(ctx, ctx->backend->sgd_step(ctx, n, params, grads, with_buf ? momentum_buf : NULL, scales, o));
}

/* --- the checks other fused-step entry points share (declared in internal.h) ------------------------ */

ms_status ms_check_on_device(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t)
{
    return check_on_device(ctx, fn, who, t);
}

ms_status ms_check_contiguous(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t)
{
    return check_contiguous(ctx, fn, who, t);
}

ms_status ms_check_device_scalar(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t)
{
    return check_device_scalar(ctx, fn, who, t);
}

ms_status ms_check_overlaps(ms_ctx *ctx, const char *fn, const ms_arg_use *uses, int64_t count)
{
    span stack[STACK_SPANS], *s = NULL, *heap = NULL;
    MS_TRY(spans_get(ctx, fn, count, stack, &s, &heap));
    int64_t k = 0;
    for (int64_t j = 0; j < count; j++) span_add(s, &k, uses[j].t, uses[j].member, uses[j].role, uses[j].written);
    ms_status st = check_spans(ctx, fn, s, k);
    free(heap);
    return st;
}

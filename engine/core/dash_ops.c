/*
** The public entry points of Shampoo on stacked blocks (ms_blocks_gather, ms_blocks_apply, ms_dash_graft,
** ms_inv_root, ms_spectrum_estimate; semantics in moonstep.h, from research/dash.md): every option, block,
** stack and device scalar is checked before the backend runs, so a call that fails changes nothing; then one
** backend call (one counted launch) does the whole stack.
*/
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* --- checks of single tensors ------------------------------------------------------------------------ */

static ms_status check_dtype(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t, ms_dtype want)
{
    if (t->dtype == want) return MS_OK;
    return MS_FAIL(ctx, MS_E_DTYPE, "%s: %s has dtype %s; it must be %s", fn, who, ms_dtype_name(t->dtype),
                   ms_dtype_name(want));
}

/* A stack: f32 [N, r, c], contiguous, on ctx's device (r == c when square). */
static ms_status check_stack(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t, bool square)
{
    MS_TRY(ms_check_on_device(ctx, fn, who, t));
    MS_TRY(check_dtype(ctx, fn, who, t, MS_DTYPE_F32));
    if (t->ndim != 3)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: %s has shape %s; a stack is [N, r, c] (3 dims)", fn, who, ms_tshape(t));
    if (square && t->shape[1] != t->shape[2])
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: %s has shape %s; its blocks must be square ([N, b, b])", fn, who,
                       ms_tshape(t));
    return ms_check_contiguous(ctx, fn, who, t);
}

/* A stack of exactly `like`'s shape (NULL `t` passes when optional). */
static ms_status check_like(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t, const ms_tensor *like,
                            bool optional)
{
    if (t == NULL && optional) return MS_OK;
    MS_TRY(check_stack(ctx, fn, who, t, false));
    for (int d = 0; d < 3; d++)
        if (t->shape[d] != like->shape[d])
            return MS_FAIL(ctx, MS_E_SHAPE, "%s: %s has shape %s but the stack is %s", fn, who, ms_tshape(t),
                           ms_tshape(like));
    return MS_OK;
}

/* A per-block vector: `dt` [n], contiguous (NULL passes when optional). */
static ms_status check_vector(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t, ms_dtype dt,
                              int64_t n, bool optional)
{
    if (t == NULL) {
        if (optional) return MS_OK;
        return MS_FAIL(ctx, MS_E_ARG, "%s: %s is NULL", fn, who);
    }
    MS_TRY(ms_check_on_device(ctx, fn, who, t));
    MS_TRY(check_dtype(ctx, fn, who, t, dt));
    if (t->ndim != 1 || t->shape[0] != n)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: %s has shape %s; it needs one entry per block ([%lld])", fn, who,
                       ms_tshape(t), (long long)n);
    return ms_check_contiguous(ctx, fn, who, t);
}

/* The options' rng_ids (moonstep.h, "Random vectors"): NULL, or i32 [n], contiguous, on ctx's device. */
static ms_status check_rng_ids(ms_ctx *ctx, const char *fn, const ms_tensor *ids, int64_t n)
{
    if (ids == NULL) return MS_OK;
    MS_TRY(ms_check_on_device(ctx, fn, "rng_ids", ids));
    MS_TRY(check_dtype(ctx, fn, "rng_ids", ids, MS_DTYPE_I32));
    if (ids->ndim != 1 || ids->shape[0] != n)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: rng_ids has shape %s; it needs one id per block of the stack ([%lld])", fn,
                       ms_tshape(ids), (long long)n);
    return ms_check_contiguous(ctx, fn, "rng_ids", ids);
}

static ms_status check_range(ms_ctx *ctx, const char *fn, const char *name, double x, double lo, bool lo_open,
                             double hi, bool hi_open)
{
    bool ok = isfinite(x) && (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi);
    if (ok) return MS_OK;
    return MS_FAIL(ctx, MS_E_ARG, "%s: %s = %g is outside %c%g, %g%c", fn, name, x, lo_open ? '(' : '[', lo, hi,
                   hi_open ? ')' : ']');
}

static ms_status check_step(ms_ctx *ctx, const char *fn, double step, const ms_tensor *step_t)
{
    if (step_t == NULL && !(isfinite(step) && rint(step) >= 1))
        return MS_FAIL(ctx, MS_E_ARG, "%s: step = %g must be a finite number >= 1 (steps count from 1)", fn, step);
    return ms_check_device_scalar(ctx, fn, "step_t", step_t);
}

static ms_status unsupported(ms_ctx *ctx, const char *fn)
{
    return MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s is not implemented on %s", fn, ctx->name);
}

/* (every caller has its public name in `fn`: a helper's message that lacks it gets it) */
#define DISPATCH(ctx, call) do { ms_status st_ = (call); if (st_ == MS_OK) ms_ctx_count_launch(ctx); \
                                 return ms_error_name((ctx), st_, fn); } while (0)

/* --- blocks ------------------------------------------------------------------------------------------ */

/* The matrix view of a block's tensor: [d0, d1 * ... * dk]; [n, 1] for 1 dim, [1, 1] for 0. */
static void matrix_dims(const ms_tensor *t, int64_t *rows, int64_t *cols)
{
    if (t->ndim == 0) { *rows = 1; *cols = 1; return; }
    *rows = t->shape[0];
    int64_t c = 1;
    for (int d = 1; d < t->ndim; d++) c *= t->shape[d];
    *cols = c;
}

static bool block_dtype(ms_dtype dt) { return dt == MS_DTYPE_F32 || dt == MS_DTYPE_BF16 || dt == MS_DTYPE_F16; }

/* Block k of a call on stacks of r x c blocks; `written` adds the checks of ms_blocks_apply (no stride-0
** dims; contiguous when stochastically rounded). */
static ms_status check_block(ms_ctx *ctx, const char *fn, int k, const ms_block *b, int64_t r, int64_t c,
                             bool written, bool stochastic)
{
    char who[64];
    snprintf(who, sizeof who, "block %d", k);
    const ms_tensor *t = b->tensor;
    MS_TRY(ms_check_on_device(ctx, fn, who, t));
    if (!block_dtype(t->dtype))
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: block %d's tensor has dtype %s; blocks come from f32, bf16 or f16 "
                       "tensors", fn, k, ms_dtype_name(t->dtype));
    if (t->ndim > 2 && !ms_tensor_contiguous_p(t))
        return MS_FAIL(ctx, MS_E_LAYOUT, "%s: block %d's tensor %s has %d dims and is not contiguous; it is viewed "
                       "as [d0, d1 * ... * dk], which needs a contiguous tensor", fn, k, ms_tshape(t), t->ndim);
    if (written) {
        char tw[64];
        snprintf(tw, sizeof tw, "block %d's tensor", k);
        MS_TRY(ms_check_writable(ctx, fn, tw, t));
        if (stochastic && t->dtype != MS_DTYPE_F32 && !ms_tensor_contiguous_p(t))
            return MS_FAIL(ctx, MS_E_LAYOUT, "%s: block %d's tensor %s (%s) is not contiguous; stochastic rounding "
                           "keys on the element's index and needs a contiguous tensor", fn, k, ms_tshape(t),
                           ms_dtype_name(t->dtype));
    }
    int64_t rows, cols;
    matrix_dims(t, &rows, &cols);
    if (b->row0 < 0 || b->col0 < 0 || b->row0 > rows - r || b->col0 > cols - c)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: block %d at (%lld, %lld) of size %lldx%lld does not lie inside its "
                       "tensor %s viewed as [%lld, %lld]", fn, k, (long long)b->row0, (long long)b->col0,
                       (long long)r, (long long)c, ms_tshape(t), (long long)rows, (long long)cols);
    return MS_OK;
}

typedef struct block_ref {
    const ms_tensor *t;
    int64_t row0, col0;
    int k;
} block_ref;

static int by_tensor_then_corner(const void *x, const void *y)
{
    const block_ref *a = x, *b = y;
    if (a->t != b->t) return (uintptr_t)a->t < (uintptr_t)b->t ? -1 : 1;
    if (a->row0 != b->row0) return a->row0 < b->row0 ? -1 : 1;
    if (a->col0 != b->col0) return a->col0 < b->col0 ? -1 : 1;
    return a->k - b->k;
}

/* The tensors of a call's blocks, each once (sorted by address), and -- for a call that writes them -- no
** two blocks of one tensor overlapping: blocks have one size r x c, so after sorting by (tensor, row0, col0)
** a block can only overlap the following blocks that start less than r rows below it. */
static ms_status check_block_set(ms_ctx *ctx, const char *fn, int n, const ms_block *blocks, int64_t r, int64_t c,
                                 bool written, block_ref **out_refs, int *out_unique)
{
    block_ref *refs = malloc((size_t)n * sizeof *refs);
    if (refs == NULL) return MS_FAIL(ctx, MS_E_OOM, "%s: no host memory to check %d blocks", fn, n);
    for (int k = 0; k < n; k++) refs[k] = (block_ref){ blocks[k].tensor, blocks[k].row0, blocks[k].col0, k };
    qsort(refs, (size_t)n, sizeof *refs, by_tensor_then_corner);
    if (written) {
        for (int i = 0; i < n; i++)
            for (int j = i + 1; j < n && refs[j].t == refs[i].t && refs[j].row0 < refs[i].row0 + r; j++)
                if (llabs(refs[j].col0 - refs[i].col0) < c) {
                    int a = refs[i].k < refs[j].k ? refs[i].k : refs[j].k, b = refs[i].k ^ refs[j].k ^ a;
                    free(refs);
                    return MS_FAIL(ctx, MS_E_LAYOUT, "%s: blocks %d and %d overlap in the same tensor (blocks "
                                   "that are updated must partition their tensors)", fn, a, b);
                }
    }
    int u = 0;
    for (int i = 0; i < n; i++)
        if (u == 0 || refs[u - 1].t != refs[i].t) refs[u++] = refs[i];
    *out_refs = refs;
    *out_unique = u;
    return MS_OK;
}

/* The blocks' tensors, the stack and the other tensors of the call must not share memory where one of them
** is written. */
static ms_status check_block_overlaps(ms_ctx *ctx, const char *fn, const block_ref *refs, int u, bool blocks_written,
                                      const ms_arg_use *others, int nothers)
{
    typedef char role_name[40];
    ms_arg_use *uses = malloc((size_t)(u + nothers) * sizeof *uses);
    role_name *roles = malloc((size_t)(u > 0 ? u : 1) * sizeof *roles);
    if (uses == NULL || roles == NULL) {
        free(uses);
        free(roles);
        return MS_FAIL(ctx, MS_E_OOM, "%s: no host memory to check %d tensors", fn, u + nothers);
    }
    for (int i = 0; i < nothers; i++) uses[i] = others[i];
    for (int i = 0; i < u; i++) {
        snprintf(roles[i], sizeof roles[i], "block %d's tensor", refs[i].k);
        uses[nothers + i] = (ms_arg_use){ refs[i].t, -1, roles[i], blocks_written };
    }
    ms_status st = ms_check_overlaps(ctx, fn, uses, u + nothers);
    free(uses);
    free(roles);
    return st;
}

static ms_status check_blocks_stack(ms_ctx *ctx, const char *fn, const ms_tensor *stack, int n, const ms_block *blocks)
{
    MS_TRY(check_stack(ctx, fn, "stack", stack, false));
    if (n < 0) return MS_FAIL(ctx, MS_E_ARG, "%s: n = %d is negative", fn, n);
    if (stack->shape[0] != n)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: stack %s holds %lld blocks but n = %d", fn, ms_tshape(stack),
                       (long long)stack->shape[0], n);
    if (n > 0 && blocks == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: blocks is NULL (n = %d)", fn, n);
    return MS_OK;
}

MS_API ms_status ms_blocks_gather(ms_ctx *ctx, ms_tensor *stack, int n, const ms_block *blocks)
{
    static const char fn[] = "ms_blocks_gather";
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (stack == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: stack is NULL", fn);
    MS_TRY(check_blocks_stack(ctx, fn, stack, n, blocks));
    int64_t r = stack->shape[1], c = stack->shape[2];
    for (int k = 0; k < n; k++) MS_TRY(check_block(ctx, fn, k, &blocks[k], r, c, false, false));
    if (n == 0) return MS_OK;
    block_ref *refs;
    int u;
    MS_TRY(check_block_set(ctx, fn, n, blocks, r, c, false, &refs, &u));
    ms_arg_use others[1] = { { stack, -1, "stack", true } };
    ms_status st = check_block_overlaps(ctx, fn, refs, u, false, others, 1);
    free(refs);
    if (st != MS_OK) return st;
    if (ctx->backend->blocks_gather == NULL) return unsupported(ctx, fn);
    DISPATCH(ctx, ctx->backend->blocks_gather(ctx, stack, n, blocks));
}

MS_API ms_status ms_blocks_apply(ms_ctx *ctx, int n, const ms_block *blocks, const ms_tensor *stack,
                                 const ms_tensor *scale, const ms_blocks_apply_options *opts)
{
    static const char fn[] = "ms_blocks_apply";
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (stack == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: stack is NULL", fn);
    MS_TRY(check_blocks_stack(ctx, fn, stack, n, blocks));
    MS_TRY(check_vector(ctx, fn, "scale", scale, MS_DTYPE_F32, n, true));
    const ms_blocks_apply_options *o = opts;
    bool stochastic = false;
    if (o) {
        if (o->lr_t == NULL && !(isfinite(o->lr) && o->lr >= 0))
            return MS_FAIL(ctx, MS_E_ARG, "%s: lr = %g must be finite and >= 0", fn, o->lr);
        MS_TRY(ms_check_device_scalar(ctx, fn, "lr_t", o->lr_t));
        if (!(isfinite(o->weight_decay) && o->weight_decay >= 0))
            return MS_FAIL(ctx, MS_E_ARG, "%s: weight_decay = %g must be finite and >= 0", fn, o->weight_decay);
        stochastic = o->stochastic_round != 0;
        if (stochastic) MS_TRY(check_step(ctx, fn, o->step, o->step_t));
        else MS_TRY(ms_check_device_scalar(ctx, fn, "step_t", o->step_t));
        MS_TRY(ms_check_device_scalar(ctx, fn, "skip_t", o->skip_t));
        MS_TRY(check_rng_ids(ctx, fn, o->rng_ids, n));
    }
    int64_t r = stack->shape[1], c = stack->shape[2];
    for (int k = 0; k < n; k++) MS_TRY(check_block(ctx, fn, k, &blocks[k], r, c, true, stochastic));
    if (n == 0) return MS_OK;
    block_ref *refs;
    int u;
    MS_TRY(check_block_set(ctx, fn, n, blocks, r, c, true, &refs, &u));
    ms_arg_use others[6] = {
        { stack, -1, "stack", false }, { scale, -1, "scale", false },
        { o ? o->lr_t : NULL, -1, "lr_t", false }, { o ? o->step_t : NULL, -1, "step_t", false },
        { o ? o->skip_t : NULL, -1, "skip_t", false }, { o ? o->rng_ids : NULL, -1, "rng_ids", false },
    };
    ms_status st = check_block_overlaps(ctx, fn, refs, u, true, others, 6);
    free(refs);
    if (st != MS_OK) return st;
    if (ctx->backend->blocks_apply == NULL) return unsupported(ctx, fn);
    DISPATCH(ctx, ctx->backend->blocks_apply(ctx, n, blocks, stack, scale, o));
}

/* --- grafting ------------------------------------------------------------------------------------------ */

/* ms_dash_graft's options and tensors (grad: the stack they update from) */
static ms_status check_graft(ms_ctx *ctx, const char *fn, const ms_tensor *grad_ema, const ms_tensor *adam_v,
                             const ms_tensor *norm, const ms_tensor *pgraft, const ms_tensor *grad,
                             const ms_dash_graft_options *o)
{
    MS_TRY(check_range(ctx, fn, "beta_grad", o->beta_grad, 0, false, 1, true));
    MS_TRY(check_range(ctx, fn, "beta_graft", o->beta_graft, 0, false, 1, true));
    if (!(isfinite(o->eps) && o->eps > 0)) return MS_FAIL(ctx, MS_E_ARG, "%s: eps = %g must be finite and > 0", fn, o->eps);
    MS_TRY(check_step(ctx, fn, o->step, o->step_t));
    MS_TRY(ms_check_device_scalar(ctx, fn, "skip_t", o->skip_t));
    if (grad == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: grad is NULL", fn);
    if (grad_ema == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: grad_ema is NULL", fn);
    if (adam_v == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: adam_v is NULL", fn);
    MS_TRY(check_stack(ctx, fn, "grad", grad, false));
    MS_TRY(check_like(ctx, fn, "grad_ema", grad_ema, grad, false));
    MS_TRY(check_like(ctx, fn, "adam_v", adam_v, grad, false));
    MS_TRY(check_like(ctx, fn, "pgraft", pgraft, grad, true));
    return check_vector(ctx, fn, "norm", norm, MS_DTYPE_F32, grad->shape[0], false);
}

MS_API ms_status ms_dash_graft(ms_ctx *ctx, ms_tensor *grad_ema, ms_tensor *adam_v, ms_tensor *norm,
                               ms_tensor *pgraft, const ms_tensor *grad, const ms_dash_graft_options *opts)
{
    static const char fn[] = "ms_dash_graft";
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (opts == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: opts is NULL (betas, eps and step have no defaults)", fn);
    const ms_dash_graft_options *o = opts;
    MS_TRY(check_graft(ctx, fn, grad_ema, adam_v, norm, pgraft, grad, o));
    ms_arg_use uses[7] = {
        { grad_ema, -1, "grad_ema", true }, { adam_v, -1, "adam_v", true }, { norm, -1, "norm", true },
        { pgraft, -1, "pgraft", true }, { grad, -1, "grad", false }, { o->step_t, -1, "step_t", false },
        { o->skip_t, -1, "skip_t", false },
    };
    MS_TRY(ms_check_overlaps(ctx, fn, uses, 7));
    if (grad->shape[0] == 0) return MS_OK;
    if (ctx->backend->dash_graft == NULL) return unsupported(ctx, fn);
    DISPATCH(ctx, ctx->backend->dash_graft(ctx, grad_ema, adam_v, norm, pgraft, grad, o));
}

/* --- gather with the factor products (and grafting) ------------------------------------------------- */

/* A factor stack of a gather_factors call: f32 [N, b, b], contiguous (NULL passes when optional). */
static ms_status check_factor(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t, int64_t N, int64_t b,
                              bool optional)
{
    if (t == NULL) {
        if (optional) return MS_OK;
        return MS_FAIL(ctx, MS_E_ARG, "%s: %s is NULL", fn, who);
    }
    MS_TRY(check_stack(ctx, fn, who, t, true));
    if (t->shape[0] != N || t->shape[1] != b)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: %s has shape %s; it must be [%lld, %lld, %lld] for the stack's blocks",
                       fn, who, ms_tshape(t), (long long)N, (long long)b, (long long)b);
    return MS_OK;
}

MS_API ms_status ms_blocks_gather_factors(ms_ctx *ctx, ms_tensor *stack, ms_tensor *left, ms_tensor *right, int n,
                                          const ms_block *blocks, const ms_dash_factor_options *opts)
{
    static const char fn[] = "ms_blocks_gather_factors";
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (opts == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: opts is NULL (alpha and beta have no defaults)", fn);
    if (!isfinite(opts->alpha)) return MS_FAIL(ctx, MS_E_ARG, "%s: alpha = %g must be finite", fn, opts->alpha);
    if (!isfinite(opts->beta)) return MS_FAIL(ctx, MS_E_ARG, "%s: beta = %g must be finite", fn, opts->beta);
    if (stack == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: stack is NULL", fn);
    MS_TRY(check_blocks_stack(ctx, fn, stack, n, blocks));
    int64_t r = stack->shape[1], c = stack->shape[2];
    MS_TRY(check_factor(ctx, fn, "left", left, n, r, false));
    MS_TRY(check_factor(ctx, fn, "right", right, n, c, true));
    const ms_dash_graft_options *g = opts->graft;
    if (g) MS_TRY(check_graft(ctx, fn, opts->grad_ema, opts->adam_v, opts->norm, opts->pgraft, stack, g));
    for (int k = 0; k < n; k++) MS_TRY(check_block(ctx, fn, k, &blocks[k], r, c, false, false));
    if (n == 0) return MS_OK;
    block_ref *refs;
    int u;
    MS_TRY(check_block_set(ctx, fn, n, blocks, r, c, false, &refs, &u));
    ms_arg_use others[9] = {
        { stack, -1, "stack", true }, { left, -1, "left", true }, { right, -1, "right", true },
        { g ? opts->grad_ema : NULL, -1, "grad_ema", true }, { g ? opts->adam_v : NULL, -1, "adam_v", true },
        { g ? opts->norm : NULL, -1, "norm", true }, { g ? opts->pgraft : NULL, -1, "pgraft", true },
        { g ? g->step_t : NULL, -1, "step_t", false }, { g ? g->skip_t : NULL, -1, "skip_t", false },
    };
    ms_status st = check_block_overlaps(ctx, fn, refs, u, false, others, 9);
    free(refs);
    if (st != MS_OK) return st;
    if (ctx->backend->blocks_gather_factors == NULL) return unsupported(ctx, fn);
    DISPATCH(ctx, ctx->backend->blocks_gather_factors(ctx, stack, left, right, n, blocks, opts));
}

/* --- inverse roots ------------------------------------------------------------------------------------- */

enum { PI_VECTORS_MAX = 64, CHEBYSHEV_MIN = 8, CHEBYSHEV_MAX = 10000 };

static ms_status check_power_iteration(ms_ctx *ctx, const char *fn, const char *prefix, int steps, int vectors,
                                       double eps)
{
    if (steps < 1) return MS_FAIL(ctx, MS_E_ARG, "%s: %ssteps = %d must be >= 1", fn, prefix, steps);
    if (vectors < 1 || vectors > PI_VECTORS_MAX)
        return MS_FAIL(ctx, MS_E_ARG, "%s: %svectors = %d must be in [1, %d]", fn, prefix, vectors, PI_VECTORS_MAX);
    if (!(isfinite(eps) && eps >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: %s = %g must be finite and >= 0", fn,
                       prefix[0] ? "eps_power_iter" : "eps", eps);
    return MS_OK;
}

static ms_status check_root_options(ms_ctx *ctx, const char *fn, const ms_root_options *o)
{
    if ((unsigned)o->method > MS_ROOT_CHEBYSHEV)
        return MS_FAIL(ctx, MS_E_ARG, "%s: method = %d is not one of MS_ROOT_EVD, _CN, _NDB, _CHEBYSHEV", fn,
                       (int)o->method);
    if (o->root != 2 && o->root != 4) return MS_FAIL(ctx, MS_E_ARG, "%s: root = %d must be 2 or 4", fn, o->root);
    if (!(isfinite(o->eps) && o->eps >= 0)) return MS_FAIL(ctx, MS_E_ARG, "%s: eps = %g must be finite and >= 0", fn, o->eps);
    if (o->matmul_dtype != MS_DTYPE_F32 && o->matmul_dtype != MS_DTYPE_BF16 && o->matmul_dtype != MS_DTYPE_F16)
        return MS_FAIL(ctx, MS_E_ARG, "%s: matmul_dtype = %s must be f32, bf16 or f16", fn,
                       ms_dtype_name(o->matmul_dtype));
    if (o->method == MS_ROOT_EVD) {
        if (o->matmul_dtype != MS_DTYPE_F32)
            return MS_FAIL(ctx, MS_E_ARG, "%s: matmul_dtype = %s, but EVD computes in f32 only", fn,
                           ms_dtype_name(o->matmul_dtype));
        return MS_OK;
    }
    if (o->method == MS_ROOT_CHEBYSHEV) {
        if (o->steps < CHEBYSHEV_MIN || o->steps > CHEBYSHEV_MAX)
            return MS_FAIL(ctx, MS_E_ARG, "%s: steps = %d is the Chebyshev degree and must be in [%d, %d] (the "
                           "interval [25 / d^2, 1] must be proper)", fn, o->steps, CHEBYSHEV_MIN, CHEBYSHEV_MAX);
    } else if (o->steps < 1) {
        return MS_FAIL(ctx, MS_E_ARG, "%s: steps = %d must be >= 1", fn, o->steps);
    }
    if ((unsigned)o->scaling > MS_SCALING_PIM)
        return MS_FAIL(ctx, MS_E_ARG, "%s: scaling = %d is not one of MS_SCALING_FRO, _PI, _PIM", fn, (int)o->scaling);
    if (o->scaling != MS_SCALING_FRO) {
        MS_TRY(check_power_iteration(ctx, fn, "pi_", o->pi_steps, o->scaling == MS_SCALING_PIM ? o->pi_vectors : 1,
                                     o->eps_power_iter));
        if (!(isfinite(o->pi_const) && o->pi_const >= 1))
            return MS_FAIL(ctx, MS_E_ARG, "%s: pi_const = %g must be finite and >= 1", fn, o->pi_const);
    }
    if (!(isfinite(o->tolerance) && o->tolerance >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: tolerance = %g must be finite and >= 0", fn, o->tolerance);
    return MS_OK;
}

MS_API ms_status ms_inv_root(ms_ctx *ctx, ms_tensor *x, ms_tensor *residual, ms_tensor *iters, const ms_tensor *a,
                             const ms_root_options *opts)
{
    static const char fn[] = "ms_inv_root";
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (opts == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: opts is NULL (method and root have no defaults)", fn);
    MS_TRY(check_root_options(ctx, fn, opts));
    if (a == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: a is NULL", fn);
    if (x == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: x is NULL", fn);
    MS_TRY(check_stack(ctx, fn, "a", a, true));
    MS_TRY(check_like(ctx, fn, "x", x, a, false));
    int64_t n = a->shape[0];
    MS_TRY(check_vector(ctx, fn, "residual", residual, MS_DTYPE_F32, n, true));
    MS_TRY(check_vector(ctx, fn, "iters", iters, MS_DTYPE_I32, n, true));
    const ms_tensor *index = opts->index;
    if (index != NULL) {
        MS_TRY(ms_check_on_device(ctx, fn, "index", index));
        MS_TRY(check_dtype(ctx, fn, "index", index, MS_DTYPE_I32));
        if (index->ndim != 1 || index->shape[0] > n)
            return MS_FAIL(ctx, MS_E_SHAPE, "%s: index has shape %s; it must be [K] with K <= N = %lld", fn,
                           ms_tshape(index), (long long)n);
        MS_TRY(ms_check_contiguous(ctx, fn, "index", index));
    }
    MS_TRY(check_rng_ids(ctx, fn, opts->rng_ids, n));
    ms_arg_use uses[6] = {
        { x, -1, "x", true }, { residual, -1, "residual", true }, { iters, -1, "iters", true },
        { a, -1, "a", false }, { index, -1, "index", false }, { opts->rng_ids, -1, "rng_ids", false },
    };
    MS_TRY(ms_check_overlaps(ctx, fn, uses, 6));
    /* blocks of size 0 have no root to compute (their per-block outputs are left as they are) */
    if (n == 0 || a->shape[1] == 0 || (index != NULL && index->shape[0] == 0)) return MS_OK;
    if (ctx->backend->inv_root == NULL) return unsupported(ctx, fn);
    DISPATCH(ctx, ctx->backend->inv_root(ctx, x, residual, iters, a, opts));
}

MS_API ms_status ms_spectrum_estimate(ms_ctx *ctx, ms_tensor *lam_max, ms_tensor *lam_min, const ms_tensor *a,
                                      const ms_tensor *x_root, const ms_spectrum_options *opts)
{
    static const char fn[] = "ms_spectrum_estimate";
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (opts == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: opts is NULL (vectors and steps have no defaults)", fn);
    const ms_spectrum_options *o = opts;
    MS_TRY(check_power_iteration(ctx, fn, "", o->steps, o->vectors, o->eps));
    if (a == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: a is NULL", fn);
    MS_TRY(check_stack(ctx, fn, "a", a, true));
    int64_t n = a->shape[0];
    MS_TRY(check_vector(ctx, fn, "lam_max", lam_max, MS_DTYPE_F32, n, false));
    MS_TRY(check_vector(ctx, fn, "lam_min", lam_min, MS_DTYPE_F32, n, true));
    if (lam_min != NULL) {
        if (o->root != 2 && o->root != 4)
            return MS_FAIL(ctx, MS_E_ARG, "%s: root = %d must be 2 or 4 (the p of x_root)", fn, o->root);
        if (x_root == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: lam_min needs x_root (an inverse root of a)", fn);
        MS_TRY(check_like(ctx, fn, "x_root", x_root, a, false));
    }
    MS_TRY(check_rng_ids(ctx, fn, o->rng_ids, n));
    ms_arg_use uses[5] = {
        { lam_max, -1, "lam_max", true }, { lam_min, -1, "lam_min", true }, { a, -1, "a", false },
        { lam_min ? x_root : NULL, -1, "x_root", false }, { o->rng_ids, -1, "rng_ids", false },
    };
    MS_TRY(ms_check_overlaps(ctx, fn, uses, 5));
    if (n == 0 || a->shape[1] == 0) return MS_OK;
    if (ctx->backend->spectrum_estimate == NULL) return unsupported(ctx, fn);
    DISPATCH(ctx, ctx->backend->spectrum_estimate(ctx, lam_max, lam_min, a, lam_min ? x_root : NULL, o));
}

/*
** The public entry points of the SinkGD step (ms_sinkgd_step and ms_sinkgd_step_sharded; semantics in
** moonstep.h, from research/sinkgd.md §2.5, §2.8 and §8): every option, member, shard, state tensor and device
** scalar is checked before the backend runs, so a call that fails changes nothing; then one backend call (one
** counted launch) updates the whole group.  The sharded step's exchanges are the communicator's all-reduce on
** the backend's scratch, which the core wraps as a tensor for the duration of the call.
*/
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static const char *who(char *buf, size_t n, int i, const char *role)
{
    snprintf(buf, n, "member %d (%s)", i, role);
    return buf;
}

static bool sinkgd_dtype(ms_dtype dt) { return dt == MS_DTYPE_F32 || dt == MS_DTYPE_BF16 || dt == MS_DTYPE_F16; }

static ms_status check_options(ms_ctx *ctx, const char *fn, const ms_sinkgd_options *o)
{
    if (o->lr_t == NULL && !(isfinite(o->lr) && o->lr >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: lr = %g must be finite and >= 0", fn, o->lr);
    if (o->step_t == NULL && !(isfinite(o->step) && rint(o->step) >= 1))
        return MS_FAIL(ctx, MS_E_ARG, "%s: step = %g must be a finite number >= 1 (steps count from 1)", fn, o->step);
    if ((unsigned)o->mode > MS_SINKGD_SPHERE)
        return MS_FAIL(ctx, MS_E_ARG, "%s: mode = %d is not one of MS_SINKGD_BASE, _SPECTRAL, _SPHERE", fn, (int)o->mode);
    if ((unsigned)o->target > MS_SINKGD_TARGET_MUON)
        return MS_FAIL(ctx, MS_E_ARG, "%s: target = %d is not one of MS_SINKGD_TARGET_UNIT, _MUON", fn, (int)o->target);
    if (o->iters < 0) return MS_FAIL(ctx, MS_E_ARG, "%s: iters = %d must be >= 0", fn, o->iters);
    if (o->mode != MS_SINKGD_BASE && o->sn_iters < 1)
        return MS_FAIL(ctx, MS_E_ARG, "%s: sn_iters = %d must be >= 1 in spectral and sphere modes (the power "
                       "iteration gives sigma)", fn, o->sn_iters);
    if (!(isfinite(o->eps) && o->eps > 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: eps = %g must be finite and > 0", fn, o->eps);
    if (!(isfinite(o->weight_decay) && o->weight_decay >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: weight_decay = %g must be finite and >= 0", fn, o->weight_decay);
    /* the sphere step keeps ||p||_F fixed, so a decay would be undone by the projection: refuse rather than
    ** pretend to apply it */
    if (o->mode == MS_SINKGD_SPHERE && o->weight_decay != 0)
        return MS_FAIL(ctx, MS_E_ARG, "%s: weight_decay = %g must be 0 in sphere mode (the projection keeps "
                       "||p||_F)", fn, o->weight_decay);
    MS_TRY(ms_check_device_scalar(ctx, fn, "lr_t", o->lr_t));
    MS_TRY(ms_check_device_scalar(ctx, fn, "step_t", o->step_t));
    MS_TRY(ms_check_device_scalar(ctx, fn, "skip_t", o->skip_t));
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

static ms_status check_member(ms_ctx *ctx, const char *fn, int i, const ms_tensor *p, const ms_tensor *g,
                              const ms_tensor *u, const ms_tensor *t, const double *scales, ms_sinkgd_mode mode)
{
    char w[64];
    MS_TRY(ms_check_on_device(ctx, fn, who(w, sizeof w, i, "param"), p));
    MS_TRY(ms_check_on_device(ctx, fn, who(w, sizeof w, i, "grad"), g));
    if (mode != MS_SINKGD_BASE) MS_TRY(ms_check_on_device(ctx, fn, who(w, sizeof w, i, "specnorm_u"), u));
    if (mode == MS_SINKGD_SPHERE) MS_TRY(ms_check_on_device(ctx, fn, who(w, sizeof w, i, "md_target_norm"), t));

    if (!sinkgd_dtype(p->dtype))
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (param) has dtype %s; params must be f32, bf16 or f16", fn, i,
                       ms_dtype_name(p->dtype));
    if (!sinkgd_dtype(g->dtype))
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (grad) has dtype %s; grads must be f32, bf16 or f16", fn, i,
                       ms_dtype_name(g->dtype));
    if (p->ndim < 2)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (param) has shape %s; SinkGD needs [..., m, n] (ndim >= 2)",
                       fn, i, ms_tshape(p));
    bool same = g->ndim == p->ndim;
    for (int d = 0; same && d < p->ndim; d++) same = g->shape[d] == p->shape[d];
    if (!same)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (grad): shape %s != param shape %s", fn, i, ms_tshape(g),
                       ms_tshape(p));
    MS_TRY(ms_check_contiguous(ctx, fn, who(w, sizeof w, i, "param"), p));

    if (mode != MS_SINKGD_BASE) {
        if (u->dtype != MS_DTYPE_F32)
            return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (specnorm_u) has dtype %s; it must be f32", fn, i,
                           ms_dtype_name(u->dtype));
        bool ok = u->ndim == p->ndim - 1 && u->shape[u->ndim - 1] == p->shape[p->ndim - 1];
        for (int d = 0; ok && d < p->ndim - 2; d++) ok = u->shape[d] == p->shape[d];
        if (!ok)
            return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (specnorm_u): shape %s, but param %s needs [..., n] = "
                           "its leading dims and its last", fn, i, ms_tshape(u), ms_tshape(p));
        MS_TRY(ms_check_contiguous(ctx, fn, who(w, sizeof w, i, "specnorm_u"), u));
    }
    if (mode == MS_SINKGD_SPHERE) {
        if (t->dtype != MS_DTYPE_F32)
            return MS_FAIL(ctx, MS_E_DTYPE, "%s: member %d (md_target_norm) has dtype %s; it must be f32", fn, i,
                           ms_dtype_name(t->dtype));
        if (!lead_shape(t, p))
            return MS_FAIL(ctx, MS_E_SHAPE, "%s: member %d (md_target_norm): shape %s, but param %s needs its "
                           "leading dims (one radius per matrix)", fn, i, ms_tshape(t), ms_tshape(p));
        MS_TRY(ms_check_contiguous(ctx, fn, who(w, sizeof w, i, "md_target_norm"), t));
    }
    if (scales && !(isfinite(scales[i]) && scales[i] >= 0))
        return MS_FAIL(ctx, MS_E_ARG, "%s: scales[%d] = %g must be finite and >= 0", fn, i, scales[i]);
    return MS_OK;
}

/* Everything both entry points check: options, members (their local shapes), state, overlaps. */
static ms_status check_call(ms_ctx *ctx, const char *fn, int n, ms_tensor *const *params,
                            const ms_tensor *const *grads, ms_tensor *const *specnorm_u,
                            ms_tensor *const *md_target_norm, const double *scales, const ms_sinkgd_options *o)
{
    MS_TRY(check_options(ctx, fn, o));
    if (n < 0) return MS_FAIL(ctx, MS_E_ARG, "%s: n = %d is negative", fn, n);
    if (n == 0) return MS_OK;
    if (params == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: params is NULL (n = %d)", fn, n);
    if (grads == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: grads is NULL (n = %d)", fn, n);
    bool with_u = o->mode != MS_SINKGD_BASE, with_t = o->mode == MS_SINKGD_SPHERE;
    if (with_u && specnorm_u == NULL)
        return MS_FAIL(ctx, MS_E_ARG, "%s: specnorm_u is NULL; spectral and sphere modes keep u per matrix", fn);
    if (with_t && md_target_norm == NULL)
        return MS_FAIL(ctx, MS_E_ARG, "%s: md_target_norm is NULL; sphere mode keeps a radius per matrix", fn);
    for (int i = 0; i < n; i++)
        MS_TRY(check_member(ctx, fn, i, params[i], grads[i], with_u ? specnorm_u[i] : NULL,
                            with_t ? md_target_norm[i] : NULL, scales, o->mode));

    /* written: params and the state; read: grads (which may share memory with each other) and scalars */
    int64_t count = (int64_t)n * 4 + 3, k = 0;
    ms_arg_use stack[64], *uses = stack;
    if (count > 64) {
        uses = malloc((size_t)count * sizeof *uses);
        if (uses == NULL) return MS_FAIL(ctx, MS_E_OOM, "%s: no host memory to check %d members", fn, n);
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
    ms_status st = ms_check_overlaps(ctx, fn, uses, k);
    if (uses != stack) free(uses);
    return st;
}

static ms_status plain_step(ms_ctx *ctx, const char *fn, int n, ms_tensor *const *params,
                            const ms_tensor *const *grads, ms_tensor *const *specnorm_u,
                            ms_tensor *const *md_target_norm, const double *scales, const ms_sinkgd_options *o)
{
    if (ctx->backend->sinkgd_step == NULL)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s is not implemented on %s", fn, ctx->name);
    bool with_u = o->mode != MS_SINKGD_BASE, with_t = o->mode == MS_SINKGD_SPHERE;
    ms_status st = ctx->backend->sinkgd_step(ctx, n, params, grads, with_u ? specnorm_u : NULL,
                                             with_t ? md_target_norm : NULL, scales, o);
    if (st == MS_OK) ms_ctx_count_launch(ctx);
    return ms_error_name(ctx, st, fn);
}

MS_API ms_status ms_sinkgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                                ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                                const double *scales, const ms_sinkgd_options *opts)
{
    static const char fn[] = "ms_sinkgd_step";
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (opts == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: opts is NULL (lr, step, mode and eps have no defaults)", fn);
    MS_TRY(check_call(ctx, fn, n, params, grads, specnorm_u, md_target_norm, scales, opts));
    if (n == 0) return MS_OK;
    return plain_step(ctx, fn, n, params, grads, specnorm_u, md_target_norm, scales, opts);
}

/* --- sharded ------------------------------------------------------------------------------------ */

static const char SHARDED[] = "ms_sinkgd_step_sharded";

/* The local size of p along the shard's dim (rows: dim -2, cols: dim -1). */
static int64_t shard_local(const ms_tensor *p, ms_shard_dim dim)
{
    return p->shape[p->ndim - (dim == MS_SHARD_ROWS ? 2 : 1)];
}

static ms_status check_shard(ms_ctx *ctx, int i, const ms_tensor *p, const ms_shard *s, int world)
{
    if ((unsigned)s->dim > MS_SHARD_COLS)
        return MS_FAIL(ctx, MS_E_ARG, "%s: shards[%d].dim = %d is not one of MS_SHARD_NONE, _ROWS, _COLS", SHARDED, i,
                       (int)s->dim);
    if (s->dim == MS_SHARD_NONE) return MS_OK;
    const char *what = s->dim == MS_SHARD_ROWS ? "rows" : "columns";
    int64_t local = shard_local(p, s->dim);
    if (s->offset < 0 || s->global < 0 || s->offset > s->global || local > s->global - s->offset)
        return MS_FAIL(ctx, MS_E_ARG, "%s: member %d (param %s) holds %lld %s from offset %lld, which is not inside "
                       "[0, %lld) (shards[%d].global, the global size of the sharded dim)", SHARDED, i, ms_tshape(p),
                       (long long)local, what, (long long)s->offset, (long long)s->global, i);
    if (world <= 1 && (s->offset != 0 || local != s->global))
        return MS_FAIL(ctx, MS_E_ARG, "%s: member %d (param %s) holds %s [%lld, %lld) of %lld, but %s: with one "
                       "rank the shard must be the whole dim", SHARDED, i, ms_tshape(p), what, (long long)s->offset,
                       (long long)(s->offset + local), (long long)s->global,
                       world < 0 ? "comm is NULL" : "comm has one rank");
    return MS_OK;
}

/* The exchange: the communicator's sum over a tensor view of the backend's scratch (no copy). */
typedef struct exchange_user {
    ms_ctx  *ctx;
    ms_comm *comm;
} exchange_user;

static ms_status exchange_sum(void *user, void *buf, int64_t count, ms_dtype dt)
{
    exchange_user *x = user;
    if (x->comm == NULL || count == 0) return MS_OK;   /* one rank: its sum is its own */
    ms_storage storage = { .ctx = x->ctx, .data = buf, .nbytes = (size_t)count * ms_dtype_size(dt), .owned = false };
    atomic_init(&storage.refcount, 1);
    ms_tensor view = { .storage = &storage, .ctx = x->ctx, .dtype = dt, .ndim = 1, .shape = { count },
                       .strides = { 1 } };
    return ms_comm_all_reduce(x->comm, &view, &view, MS_COMM_SUM);
}

MS_API ms_status ms_sinkgd_step_sharded(ms_ctx *ctx, ms_comm *comm, int n, ms_tensor *const *params,
                                        const ms_tensor *const *grads, ms_tensor *const *specnorm_u,
                                        ms_tensor *const *md_target_norm, const double *scales,
                                        const ms_shard *shards, const ms_sinkgd_options *opts)
{
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", SHARDED);
    if (opts == NULL)
        return MS_FAIL(ctx, MS_E_ARG, "%s: opts is NULL (lr, step, mode and eps have no defaults)", SHARDED);
    MS_TRY(check_call(ctx, SHARDED, n, params, grads, specnorm_u, md_target_norm, scales, opts));

    int world = comm ? ms_comm_size(comm) : -1;
    ms_ctx *comm_ctx = ms_comm_context(comm);
    if (comm && comm_ctx != ctx)   /* its collectives would not be ordered with this context's work */
        return MS_FAIL(ctx, MS_E_ARG, "%s: comm was made on another context (%s) than the step's (%s)", SHARDED,
                       comm_ctx->name, ctx->name);
    bool sharded = false;
    for (int i = 0; i < n; i++) {
        if (shards == NULL) break;
        MS_TRY(check_shard(ctx, i, params[i], &shards[i], world));
        sharded = sharded || shards[i].dim != MS_SHARD_NONE;
    }
    if (n == 0) return MS_OK;
    /* nothing crosses ranks: every rank's step is its own */
    if (!sharded) return plain_step(ctx, SHARDED, n, params, grads, specnorm_u, md_target_norm, scales, opts);

    if (ctx->backend->sinkgd_step_sharded == NULL)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s is not implemented on %s", SHARDED, ctx->name);
    exchange_user user = { ctx, world > 1 ? comm : NULL };
    ms_exchange x = { exchange_sum, &user };
    bool with_u = opts->mode != MS_SINKGD_BASE, with_t = opts->mode == MS_SINKGD_SPHERE;
    ms_status st = ctx->backend->sinkgd_step_sharded(ctx, n, params, grads, with_u ? specnorm_u : NULL,
                                                     with_t ? md_target_norm : NULL, scales, shards, opts, &x);
    if (st == MS_OK) ms_ctx_count_launch(ctx);
    return ms_error_name(ctx, st, SHARDED);
}

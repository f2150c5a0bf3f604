/*
** The public op entry points: each states its contract (non-NULL, devices, dtypes, shapes, layouts),
** builds the elementwise iteration where there is one, and dispatches to the context's backend.
** Nothing is changed when a check fails.
*/
#include "internal.h"

#include <math.h>
#include <string.h>

static bool same_device(const ms_ctx *a, const ms_ctx *b) { return a->type == b->type && a->index == b->index; }

static ms_status check_ctx(ms_ctx *ctx, const char *fn)
{
    return ctx ? MS_OK : MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
}

static ms_status check_tensor(ms_ctx *ctx, const char *fn, const char *what, const ms_tensor *t)
{
    if (t == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: %s is NULL", fn, what);
    if (!same_device(ctx, t->ctx))
        return MS_FAIL(ctx, MS_E_DEVICE, "%s: %s is on %s but the context is on %s", fn, what, t->ctx->name,
                       ctx->name);
    return MS_OK;
}

static ms_status check_float(ms_ctx *ctx, const char *fn, const char *what, const ms_tensor *t)
{
    if (ms_dtype_is_float(t->dtype)) return MS_OK;
    return MS_FAIL(ctx, MS_E_DTYPE, "%s: %s has dtype %s, a float dtype (f32, f64, bf16, f16) is needed", fn,
                   what, ms_dtype_name(t->dtype));
}

/* A device scalar: one element, a float dtype, on ctx's device. */
static ms_status check_scalar(ms_ctx *ctx, const char *fn, const char *what, const ms_tensor *t)
{
    if (t == NULL) return MS_OK;
    MS_TRY(check_tensor(ctx, fn, what, t));
    MS_TRY(check_float(ctx, fn, what, t));
    if (ms_tensor_numel(t) != 1)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: %s must hold exactly one element, it has shape %s", fn, what,
                       ms_tshape(t));
    return MS_OK;
}

static bool same_view(const ms_tensor *a, const ms_tensor *b)
{
    if (ms_tensor_ptr(a) != ms_tensor_ptr(b) || a->dtype != b->dtype || a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i] || (a->shape[i] > 1 && a->strides[i] != b->strides[i])) return false;
    return true;
}

/* A device scalar of an elementwise op, which is read while dst is written: it must not share memory with dst
** (backends may read it after part of dst was stored), unless dst is its own one-element view (in place). */
static ms_status check_scalar_dst(ms_ctx *ctx, const char *fn, const char *what, const ms_tensor *t,
                                  const ms_tensor *dst)
{
    MS_TRY(check_scalar(ctx, fn, what, t));
    if (t && ms_tensor_overlaps(dst, t) && !same_view(dst, t))
        return MS_FAIL(ctx, MS_E_LAYOUT, "%s: %s shares memory with dst %s (the scalar is read while dst is written)",
                       fn, what, ms_tshape(dst));
    return MS_OK;
}

ms_status ms_nary_build(ms_ctx *ctx, const char *fn, ms_nary *it, ms_tensor *dst, int nsrc,
                        const ms_tensor *const *srcs)
{
    static const char *names[] = { "dst", "a", "b", "c" };
    MS_TRY(check_ctx(ctx, fn));
    MS_TRY(check_tensor(ctx, fn, "dst", dst));
    for (int k = 0; k < nsrc; k++) MS_TRY(check_tensor(ctx, fn, nsrc == 1 ? "src" : names[k + 1], srcs[k]));
    MS_TRY(ms_check_writable(ctx, fn, "dst", dst));
    memset(it, 0, sizeof *it);
    it->nops = nsrc + 1;
    const ms_tensor *ops[MS_NARY_MAX] = { dst };
    for (int k = 0; k < nsrc; k++) ops[k + 1] = srcs[k];

    int nd = dst->ndim;
    int64_t str[MS_NARY_MAX][MS_MAX_DIMS];
    for (int k = 0; k < it->nops; k++) {
        const ms_tensor *t = ops[k];
        if (t->ndim > nd) goto nobroadcast;
        int lead = nd - t->ndim;
        for (int i = 0; i < nd; i++) {
            if (i < lead) { str[k][i] = 0; continue; }
            int64_t s = t->shape[i - lead];
            if (s == dst->shape[i]) str[k][i] = s == 1 ? 0 : t->strides[i - lead];
            else if (s == 1) str[k][i] = 0;
            else goto nobroadcast;
        }
        it->data[k] = ms_tensor_ptr(t);
        it->dtype[k] = t->dtype;
        if (t->dtype == MS_DTYPE_F64 || t->dtype == MS_DTYPE_I32) it->wide = true;
        if (k > 0 && ms_tensor_overlaps(dst, t) && !same_view(dst, t))
            return MS_FAIL(ctx, MS_E_LAYOUT, "%s: dst %s partially overlaps %s %s (in-place needs the same view)",
                           fn, ms_tshape(dst), nsrc == 1 ? "src" : names[k], ms_tshape(t));
        continue;
    nobroadcast:
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: %s shape %s does not broadcast to dst shape %s", fn,
                       nsrc == 1 ? "src" : names[k], ms_tshape(t), ms_tshape(dst));
    }
    /* drop size-1 dims, then merge dims that are contiguous across every operand */
    int n = 0;
    it->numel = 1;
    for (int i = 0; i < nd; i++) {
        it->numel *= dst->shape[i];
        if (dst->shape[i] == 1) continue;
        bool merge = n > 0;
        for (int k = 0; k < it->nops && merge; k++)
            merge = it->strides[k][n - 1] == str[k][i] * dst->shape[i];
        if (merge) {
            it->shape[n - 1] *= dst->shape[i];
            for (int k = 0; k < it->nops; k++) it->strides[k][n - 1] = str[k][i];
        } else {
            it->shape[n] = dst->shape[i];
            for (int k = 0; k < it->nops; k++) it->strides[k][n] = str[k][i];
            n++;
        }
    }
    it->ndim = n;
    it->contiguous = true;
    if (n > 1) it->contiguous = false;
    for (int k = 0; k < it->nops && n == 1; k++)
        if (it->strides[k][0] != 1) it->contiguous = false;
    return MS_OK;
}

/* (every caller has its public name in `fn`: a helper's message that lacks it gets it) */
#define DISPATCH(ctx, call) do { ms_status st_ = (call); if (st_ == MS_OK) ms_ctx_count_launch(ctx); \
                                 return ms_error_name((ctx), st_, fn); } while (0)

/* --- copy / fill / random ------------------------------------------------------------------------ */

static ms_status copy_across_devices(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src)
{
    static const char fn[] = "ms_copy";
    ms_ctx *host = dst->ctx->type == MS_DEVICE_CPU ? dst->ctx : src->ctx->type == MS_DEVICE_CPU ? src->ctx : NULL;
    if (host == NULL)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "%s: copies between %s and %s go through the host (copy to a cpu "
                       "tensor first)", fn, src->ctx->name, dst->ctx->name);
    ms_status st;
    ms_tensor *stage = NULL, *dev = NULL;
    if (dst->ctx == host || dst->ctx->type == MS_DEVICE_CPU) {
        /* device -> host: contiguous on the device in src's dtype, bytes to a host stage, cast on the host */
        MS_TRY(ms_tensor_contiguous(src->ctx, src, &dev));
        st = ms_tensor_alloc(dst->ctx, src->dtype, src->ndim, src->shape, &stage);
        if (st == MS_OK)
            st = src->ctx->backend->memcpy_to_host(src->ctx, ms_tensor_ptr(stage), ms_tensor_ptr(dev),
                                                   (size_t)ms_tensor_numel(src) * ms_dtype_size(src->dtype));
        if (st == MS_OK) st = ms_copy(dst->ctx, dst, stage);
    } else {
        /* host -> device: cast and broadcast on the host into dst's dtype and shape, then bytes over */
        MS_TRY(ms_tensor_alloc(src->ctx, dst->dtype, dst->ndim, dst->shape, &stage));
        st = ms_copy(src->ctx, stage, src);
        if (st == MS_OK && ms_tensor_contiguous_p(dst)) {
            st = dst->ctx->backend->memcpy_from_host(dst->ctx, ms_tensor_ptr(dst), ms_tensor_ptr(stage),
                                                     (size_t)ms_tensor_numel(dst) * ms_dtype_size(dst->dtype));
        } else if (st == MS_OK) {
            st = ms_tensor_alloc(dst->ctx, dst->dtype, dst->ndim, dst->shape, &dev);
            if (st == MS_OK)
                st = dst->ctx->backend->memcpy_from_host(dst->ctx, ms_tensor_ptr(dev), ms_tensor_ptr(stage),
                                                         (size_t)ms_tensor_numel(dst) * ms_dtype_size(dst->dtype));
            if (st == MS_OK) st = ms_copy(dst->ctx, dst, dev);
        }
    }
    ms_tensor_free(stage);
    ms_tensor_free(dev);
    return st;
}

MS_API ms_status ms_copy(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src)
{
    static const char fn[] = "ms_copy";
    MS_TRY(check_ctx(ctx, fn));
    if (dst == NULL || src == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: %s is NULL", fn, dst ? "src" : "dst");
    if (!same_device(dst->ctx, src->ctx)) {
        /* validate the shapes first, so that a bad cross-device copy fails before any transfer */
        ms_nary probe;
        ms_tensor shadow = *src;
        shadow.ctx = dst->ctx;
        MS_TRY(ms_nary_build(dst->ctx, fn, &probe, dst, 1, (const ms_tensor *[]){ &shadow }));
        return copy_across_devices(ctx, dst, src);
    }
    if (!same_device(ctx, dst->ctx)) ctx = dst->ctx;
    ms_nary it;
    MS_TRY(ms_nary_build(ctx, fn, &it, dst, 1, &src));
    if (it.numel == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->copy(ctx, &it));
}

MS_API ms_status ms_fill(ms_ctx *ctx, ms_tensor *dst, double value, const ms_tensor *value_t)
{
    static const char fn[] = "ms_fill";
    ms_nary it;
    MS_TRY(ms_nary_build(ctx, fn, &it, dst, 0, NULL));
    MS_TRY(check_scalar_dst(ctx, fn, "value_t", value_t, dst));
    if (it.numel == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->fill(ctx, &it, (ms_scalar){ value, value_t }));
}

MS_API ms_status ms_rand(ms_ctx *ctx, ms_tensor *dst, const ms_rand_options *opts)
{
    static const char fn[] = "ms_rand";
    MS_TRY(check_ctx(ctx, fn));
    MS_TRY(check_tensor(ctx, fn, "dst", dst));
    MS_TRY(check_float(ctx, fn, "dst", dst));
    MS_TRY(ms_check_writable(ctx, fn, "dst", dst));
    ms_rand_options o = { MS_RAND_UNIFORM, 0.0, 1.0, 0, 0 };
    if (opts) o = *opts;
    if (o.dist != MS_RAND_UNIFORM && o.dist != MS_RAND_NORMAL)
        return MS_FAIL(ctx, MS_E_ARG, "%s: unknown distribution %d", fn, (int)o.dist);
    if (!isfinite(o.a) || !isfinite(o.b))
        return MS_FAIL(ctx, MS_E_ARG, "%s: parameters must be finite (got %g, %g)", fn, o.a, o.b);
    if (o.dist == MS_RAND_UNIFORM && o.a > o.b)
        return MS_FAIL(ctx, MS_E_ARG, "%s: uniform range [%g, %g) is empty", fn, o.a, o.b);
    if (o.dist == MS_RAND_UNIFORM && !isfinite(o.b - o.a))   /* a + (b - a) u would be inf or NaN */
        return MS_FAIL(ctx, MS_E_ARG, "%s: uniform range [%g, %g) is wider than the largest double", fn, o.a, o.b);
    if (o.dist == MS_RAND_UNIFORM && o.a < o.b) {
        /* [a, b) may lie between two neighbours of dst's dtype (bf16 [0.1001, 0.1002)): no value could be drawn */
        const double ra = ms_round_to_dtype(dst->dtype, o.a);
        const double bot = ra >= o.a ? ra : -ms_dtype_step_down(dst->dtype, -ra);
        if (!(bot < o.b))
            return MS_FAIL(ctx, MS_E_ARG, "%s: uniform range [%.17g, %.17g) holds no %s value", fn, o.a, o.b,
                           ms_dtype_name(dst->dtype));
    }
    if (o.dist == MS_RAND_NORMAL && o.b < 0)
        return MS_FAIL(ctx, MS_E_ARG, "%s: normal std %g is negative", fn, o.b);
    if (ms_tensor_numel(dst) == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->rand(ctx, dst, &o));
}

/* --- elementwise ----------------------------------------------------------------------------------- */

MS_API ms_status ms_unary(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, ms_unary_op op)
{
    static const char fn[] = "ms_unary";
    if ((unsigned)op >= MS_UNARY_COUNT) return MS_FAIL(ctx, MS_E_ARG, "%s: unknown op %d", fn, (int)op);
    ms_nary it;
    MS_TRY(ms_nary_build(ctx, fn, &it, dst, 1, &src));
    if (it.numel == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->unary(ctx, &it, op));
}

MS_API ms_status ms_binary(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b, ms_binary_op op)
{
    static const char fn[] = "ms_binary";
    if ((unsigned)op >= MS_BINARY_COUNT) return MS_FAIL(ctx, MS_E_ARG, "%s: unknown op %d", fn, (int)op);
    ms_nary it;
    MS_TRY(ms_nary_build(ctx, fn, &it, dst, 2, (const ms_tensor *[]){ a, b }));
    if (it.numel == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->binary(ctx, &it, op));
}

MS_API ms_status ms_binary_scalar(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, double s,
                                  const ms_tensor *s_t, ms_binary_op op, int scalar_first)
{
    static const char fn[] = "ms_binary_scalar";
    if ((unsigned)op >= MS_BINARY_COUNT) return MS_FAIL(ctx, MS_E_ARG, "%s: unknown op %d", fn, (int)op);
    ms_nary it;
    MS_TRY(ms_nary_build(ctx, fn, &it, dst, 1, &a));
    MS_TRY(check_scalar_dst(ctx, fn, "s_t", s_t, dst));
    if (it.numel == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->binary_scalar(ctx, &it, (ms_scalar){ s, s_t }, op, scalar_first != 0));
}

MS_API ms_status ms_clamp(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, double lo, double hi)
{
    static const char fn[] = "ms_clamp";
    ms_nary it;
    MS_TRY(ms_nary_build(ctx, fn, &it, dst, 1, &src));
    if (isnan(lo) || isnan(hi) || lo > hi)
        return MS_FAIL(ctx, MS_E_ARG, "%s: bounds [%g, %g] are not an interval", fn, lo, hi);
    if (it.numel == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->clamp(ctx, &it, lo, hi));
}

MS_API ms_status ms_lerp(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b, double w,
                         const ms_tensor *w_t)
{
    static const char fn[] = "ms_lerp";
    ms_nary it;
    MS_TRY(ms_nary_build(ctx, fn, &it, dst, 2, (const ms_tensor *[]){ a, b }));
    MS_TRY(check_scalar_dst(ctx, fn, "w_t", w_t, dst));
    if (it.numel == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->lerp(ctx, &it, (ms_scalar){ w, w_t }));
}

static ms_status addc(ms_ctx *ctx, const char *fn, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                      const ms_tensor *c, double v, const ms_tensor *v_t, int divide)
{
    ms_nary it;
    MS_TRY(ms_nary_build(ctx, fn, &it, dst, 3, (const ms_tensor *[]){ a, b, c }));
    MS_TRY(check_scalar_dst(ctx, fn, "v_t", v_t, dst));
    if (it.numel == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->addc(ctx, &it, (ms_scalar){ v, v_t }, divide));
}

MS_API ms_status ms_addcmul(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                            const ms_tensor *c, double v, const ms_tensor *v_t)
{
    return addc(ctx, "ms_addcmul", dst, a, b, c, v, v_t, 0);
}

MS_API ms_status ms_addcdiv(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                            const ms_tensor *c, double v, const ms_tensor *v_t)
{
    return addc(ctx, "ms_addcdiv", dst, a, b, c, v, v_t, 1);
}

/* --- reductions ------------------------------------------------------------------------------------ */

/* Runs a backend reduction into dst, through a contiguous temporary when dst is strided. */
static ms_status reduce_into(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, ms_reduce_op op, int dim,
                             const ms_tensor *b)
{
    ms_tensor *out = dst;
    if (!ms_tensor_contiguous_p(dst)) MS_TRY(ms_tensor_alloc(ctx, dst->dtype, dst->ndim, dst->shape, &out));
    ms_status st = b ? ctx->backend->dot(ctx, out, src, b) : ctx->backend->reduce(ctx, out, src, op, dim);
    if (st == MS_OK) ms_ctx_count_launch(ctx);
    if (out != dst) {
        if (st == MS_OK) st = ms_copy(ctx, dst, out);
        ms_tensor_free(out);
    }
    return st;
}

MS_API ms_status ms_reduce(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, ms_reduce_op op, int dim)
{
    static const char fn[] = "ms_reduce";
    MS_TRY(check_ctx(ctx, fn));
    MS_TRY(check_tensor(ctx, fn, "dst", dst));
    MS_TRY(check_tensor(ctx, fn, "src", src));
    if ((unsigned)op >= MS_REDUCE_COUNT) return MS_FAIL(ctx, MS_E_ARG, "%s: unknown op %d", fn, (int)op);
    MS_TRY(check_float(ctx, fn, "dst", dst));
    MS_TRY(ms_check_writable(ctx, fn, "dst", dst));
    if (ms_tensor_overlaps(dst, src)) return MS_FAIL(ctx, MS_E_LAYOUT, "%s: dst overlaps src", fn);
    int64_t len;
    if (dim == MS_DIM_ALL) {
        if (ms_tensor_numel(dst) != 1)
            return MS_FAIL(ctx, MS_E_SHAPE, "%s: dst %s must have one element for a whole reduction", fn,
                           ms_tshape(dst));
        len = ms_tensor_numel(src);
    } else {
        int d = dim < 0 ? dim + src->ndim : dim;
        if (d < 0 || d >= src->ndim)
            return MS_FAIL(ctx, MS_E_ARG, "%s: dim %d out of range for src %s", fn, dim, ms_tshape(src));
        /* dst: src's shape without dim, or with dim kept as 1 */
        bool ok_removed = dst->ndim == src->ndim - 1, ok_kept = dst->ndim == src->ndim;
        for (int i = 0, j = 0; i < src->ndim; i++) {
            if (i == d) { if (ok_kept && dst->shape[i] != 1) ok_kept = false; continue; }
            if (ok_removed && dst->shape[j] != src->shape[i]) ok_removed = false;
            if (ok_kept && dst->shape[i] != src->shape[i]) ok_kept = false;
            j++;
        }
        if (!ok_removed && !ok_kept)
            return MS_FAIL(ctx, MS_E_SHAPE, "%s: dst %s does not match src %s reduced along dim %d", fn,
                           ms_tshape(dst), ms_tshape(src), d);
        dim = d;
        len = src->shape[d];
    }
    if (len == 0 && (op == MS_REDUCE_MAX || op == MS_REDUCE_MIN || op == MS_REDUCE_AMAX))
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: max/min of zero elements (src %s) is undefined", fn, ms_tshape(src));
    if (ms_tensor_numel(dst) == 0) return MS_OK;
    return ms_error_name(ctx, reduce_into(ctx, dst, src, op, dim, NULL), fn);
}

MS_API ms_status ms_dot(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b)
{
    static const char fn[] = "ms_dot";
    MS_TRY(check_ctx(ctx, fn));
    MS_TRY(check_tensor(ctx, fn, "dst", dst));
    MS_TRY(check_tensor(ctx, fn, "a", a));
    MS_TRY(check_tensor(ctx, fn, "b", b));
    MS_TRY(check_float(ctx, fn, "dst", dst));
    if (ms_tensor_numel(dst) != 1)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: dst %s must have one element", fn, ms_tshape(dst));
    bool same = a->ndim == b->ndim;
    for (int i = 0; same && i < a->ndim; i++) same = a->shape[i] == b->shape[i];
    if (!same) return MS_FAIL(ctx, MS_E_SHAPE, "%s: a %s and b %s differ in shape", fn, ms_tshape(a), ms_tshape(b));
    if (ms_tensor_overlaps(dst, a) || ms_tensor_overlaps(dst, b))
        return MS_FAIL(ctx, MS_E_LAYOUT, "%s: dst overlaps a source", fn);
    return ms_error_name(ctx, reduce_into(ctx, dst, a, MS_REDUCE_SUM, MS_DIM_ALL, b), fn);
}

/* --- linear algebra -------------------------------------------------------------------------------- */

MS_API ms_status ms_matmul(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                           const ms_matmul_options *opts)
{
    static const char fn[] = "ms_matmul";
    MS_TRY(check_ctx(ctx, fn));
    MS_TRY(check_tensor(ctx, fn, "dst", dst));
    MS_TRY(check_tensor(ctx, fn, "a", a));
    MS_TRY(check_tensor(ctx, fn, "b", b));
    MS_TRY(check_float(ctx, fn, "a", a));
    MS_TRY(check_float(ctx, fn, "dst", dst));
    if (a->dtype != b->dtype)
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: a is %s but b is %s (they must match)", fn, ms_dtype_name(a->dtype),
                       ms_dtype_name(b->dtype));
    ms_matmul_options o = { 0, 0, 1.0, 0.0, 0 };
    if (opts) o = *opts;
    /* refused before anything runs: a NaN or infinite coefficient would silently turn dst into NaN or inf */
    if (!isfinite(o.alpha)) return MS_FAIL(ctx, MS_E_ARG, "%s: alpha = %g must be finite", fn, o.alpha);
    if (!isfinite(o.beta)) return MS_FAIL(ctx, MS_E_ARG, "%s: beta = %g must be finite", fn, o.beta);
    if (a->ndim < 2 || b->ndim < 2 || dst->ndim < 2)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: a %s, b %s and dst %s need at least 2 dims", fn, ms_tshape(a),
                       ms_tshape(b), ms_tshape(dst));
    int64_t m = a->shape[a->ndim - (o.trans_a ? 1 : 2)], k = a->shape[a->ndim - (o.trans_a ? 2 : 1)];
    int64_t kb = b->shape[b->ndim - (o.trans_b ? 1 : 2)], n = b->shape[b->ndim - (o.trans_b ? 2 : 1)];
    if (k != kb)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: inner dims differ: a %s%s and b %s%s (%lld != %lld)", fn, ms_tshape(a),
                       o.trans_a ? "^T" : "", ms_tshape(b), o.trans_b ? "^T" : "", (long long)k, (long long)kb);
    if (dst->shape[dst->ndim - 2] != m || dst->shape[dst->ndim - 1] != n)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: dst %s should end in [%lld,%lld]", fn, ms_tshape(dst), (long long)m,
                       (long long)n);
    /* batch dims of a and b broadcast to dst's */
    int nb = dst->ndim - 2;
    for (int s = 0; s < 2; s++) {
        const ms_tensor *t = s ? b : a;
        int tb = t->ndim - 2;
        if (tb > nb) goto badbatch;
        for (int i = 0; i < tb; i++) {
            int64_t ts = t->shape[i], ds = dst->shape[nb - tb + i];
            if (ts != ds && ts != 1) goto badbatch;
        }
    }
    MS_TRY(ms_check_writable(ctx, fn, "dst", dst));
    if (ms_tensor_overlaps(dst, a) || ms_tensor_overlaps(dst, b))
        return MS_FAIL(ctx, MS_E_LAYOUT, "%s: dst overlaps a or b", fn);
    if (ms_tensor_numel(dst) == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->matmul(ctx, dst, a, b, &o));
badbatch:
    return MS_FAIL(ctx, MS_E_SHAPE, "%s: batch dims of a %s and b %s do not broadcast to dst %s", fn, ms_tshape(a),
                   ms_tshape(b), ms_tshape(dst));
}

MS_API ms_status ms_eye(ms_ctx *ctx, ms_tensor *dst)
{
    static const char fn[] = "ms_eye";
    MS_TRY(check_ctx(ctx, fn));
    MS_TRY(check_tensor(ctx, fn, "dst", dst));
    MS_TRY(ms_check_writable(ctx, fn, "dst", dst));
    if (dst->ndim < 2) return MS_FAIL(ctx, MS_E_SHAPE, "%s: dst %s needs at least 2 dims", fn, ms_tshape(dst));
    if (ms_tensor_numel(dst) == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->eye(ctx, dst));
}

MS_API ms_status ms_diag(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src)
{
    static const char fn[] = "ms_diag";
    MS_TRY(check_ctx(ctx, fn));
    MS_TRY(check_tensor(ctx, fn, "dst", dst));
    MS_TRY(check_tensor(ctx, fn, "src", src));
    MS_TRY(ms_check_writable(ctx, fn, "dst", dst));
    if (ms_tensor_overlaps(dst, src)) return MS_FAIL(ctx, MS_E_LAYOUT, "%s: dst overlaps src", fn);
    bool embed = dst->ndim == src->ndim + 1, extract = src->ndim == dst->ndim + 1;
    const ms_tensor *vec = embed ? src : dst, *mat = embed ? dst : src;
    bool ok = (embed || extract) && vec->ndim >= 1;
    for (int i = 0; ok && i < vec->ndim - 1; i++) ok = vec->shape[i] == mat->shape[i];
    if (ok) {
        int64_t n = vec->shape[vec->ndim - 1];
        ok = mat->shape[mat->ndim - 1] == n && mat->shape[mat->ndim - 2] == n;
    }
    if (!ok)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: dst %s and src %s are not [..., n, n] and [..., n] (either way)", fn,
                       ms_tshape(dst), ms_tshape(src));
    if (ms_tensor_numel(dst) == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->diag(ctx, dst, src));
}

MS_API ms_status ms_eigh(ms_ctx *ctx, ms_tensor *w, ms_tensor *v, const ms_tensor *a, int *info)
{
    static const char fn[] = "ms_eigh";
    if (info) *info = 0;
    MS_TRY(check_ctx(ctx, fn));
    MS_TRY(check_tensor(ctx, fn, "w", w));
    MS_TRY(check_tensor(ctx, fn, "a", a));
    if (v) MS_TRY(check_tensor(ctx, fn, "v", v));
    if (a->dtype != MS_DTYPE_F32 && a->dtype != MS_DTYPE_F64)
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: a is %s; f32 or f64 is needed", fn, ms_dtype_name(a->dtype));
    if (w->dtype != a->dtype || (v && v->dtype != a->dtype))
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: w%s must have a's dtype %s", fn, v ? " and v" : "", ms_dtype_name(a->dtype));
    bool ok = a->ndim >= 2 && a->shape[a->ndim - 1] == a->shape[a->ndim - 2] && w->ndim == a->ndim - 1;
    for (int i = 0; ok && i < w->ndim; i++) ok = w->shape[i] == a->shape[i];
    for (int i = 0; ok && v && i < a->ndim; i++) ok = v->ndim == a->ndim && v->shape[i] == a->shape[i];
    if (!ok)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: a %s must be [..., n, n] with w [..., n]%s (got w %s%s%s)", fn,
                       ms_tshape(a), v ? " and v like a" : "", ms_tshape(w), v ? ", v " : "", v ? ms_tshape(v) : "");
    if (!ms_tensor_contiguous_p(w) || (v && !ms_tensor_contiguous_p(v)))
        return MS_FAIL(ctx, MS_E_LAYOUT, "%s: w and v must be contiguous", fn);
    if ((v && (ms_tensor_overlaps(v, a) || ms_tensor_overlaps(v, w))) || ms_tensor_overlaps(w, a))
        return MS_FAIL(ctx, MS_E_LAYOUT, "%s: outputs overlap each other or a", fn);
    if (ms_tensor_numel(a) == 0) return MS_OK;
    DISPATCH(ctx, ctx->backend->eigh(ctx, w, v, a, info));
}

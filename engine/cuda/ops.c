/*
** The CUDA backend's tensor ops other than the cuBLAS/cuSOLVER ones: the core's validated descriptions
** (ms_nary, tensors) turned into kernel descriptors (kernels/msk.h) and queued on the context's stream;
** the memory every op touches is noted for cross-context reuse.
*/
#include "cuda.h"

#include <math.h>
#include <string.h>

/* --- descriptors ---------------------------------------------------------------------------------- */

static void iter_of(msk_iter *k, const ms_nary *it)
{
    memset(k, 0, sizeof *k);
    k->nops = it->nops;
    k->numel = it->numel;
    k->contiguous = it->contiguous;
    k->wide = it->wide;
    if (it->ndim == 0) {   /* one element */
        k->ndim = 1;
        k->shape[0] = 1;
    } else {
        k->ndim = it->ndim;
        for (int d = 0; d < it->ndim; d++) k->shape[d] = it->shape[d];
        for (int o = 0; o < it->nops; o++)
            for (int d = 0; d < it->ndim; d++) k->strides[o][d] = it->strides[o][d];
    }
    for (int o = 0; o < it->nops; o++) {
        k->data[o] = it->data[o];
        k->dtype[o] = it->dtype[o];
    }
}

static msk_scalar scalar_of(ms_scalar s) { return ms_cuda_scalar(s.v, s.t); }

static void track_nary(ms_ctx *ctx, const ms_nary *it, const ms_scalar *s)
{
    for (int o = 0; o < it->nops; o++) ms_cuda_pool_track(ctx, it->data[o]);
    if (s && s->t) ms_cuda_pool_track(ctx, ms_tensor_ptr(s->t));
}

void ms_cuda_track_tensor(ms_ctx *ctx, const ms_tensor *t)
{
    if (t && ms_tensor_numel(t) > 0) ms_cuda_pool_track(ctx, ms_tensor_ptr(t));
}

void ms_cuda_view(ms_tensor *out, const ms_tensor *like, int ndim, const int64_t *shape, const int64_t *strides,
                  int64_t offset)
{
    memset(out, 0, sizeof *out);
    out->storage = like->storage;
    out->ctx = like->ctx;
    out->dtype = like->dtype;
    out->ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        out->shape[d] = shape[d];
        out->strides[d] = strides[d];
    }
    out->offset = offset;
}

/* --- elementwise members ---------------------------------------------------------------------------- */

#define STREAM(ctx) (ms_cuda(ctx)->stream)

ms_status ms_cuda_copy(ms_ctx *ctx, const ms_nary *it)
{
    MS_NVTX_RANGE("ms_copy");
    MS_TRY(ms_cuda_enter(ctx));
    if (it->dtype[0] == it->dtype[1] && (it->contiguous || it->ndim == 0)) {
        if (it->data[0] != it->data[1])
            MS_CUDA_TRY(ctx, cudaMemcpyAsync(it->data[0], it->data[1], (size_t)it->numel * ms_dtype_size(it->dtype[0]),
                                             cudaMemcpyDeviceToDevice, STREAM(ctx)));
    } else {
        msk_iter k;
        iter_of(&k, it);
        MS_CUDA_LAUNCH(ctx, msk_copy(ctx, STREAM(ctx), &k));
    }
    track_nary(ctx, it, NULL);
    return MS_OK;
}

ms_status ms_cuda_fill(ms_ctx *ctx, const ms_nary *it, ms_scalar v)
{
    MS_NVTX_RANGE("ms_fill");
    MS_TRY(ms_cuda_enter(ctx));
    msk_iter k;
    iter_of(&k, it);
    /* as the CPU: the value travels in f64 when dst is f64 or i32, else in f32 */
    k.wide = it->dtype[0] == MS_DTYPE_F64 || it->dtype[0] == MS_DTYPE_I32;
    MS_CUDA_LAUNCH(ctx, msk_fill(ctx, STREAM(ctx), &k, scalar_of(v)));
    track_nary(ctx, it, &v);
    return MS_OK;
}

ms_status ms_cuda_unary(ms_ctx *ctx, const ms_nary *it, ms_unary_op op)
{
    MS_NVTX_RANGE("ms_unary");
    MS_TRY(ms_cuda_enter(ctx));
    msk_iter k;
    iter_of(&k, it);
    MS_CUDA_LAUNCH(ctx, msk_unary(ctx, STREAM(ctx), &k, (int)op));
    track_nary(ctx, it, NULL);
    return MS_OK;
}

ms_status ms_cuda_binary(ms_ctx *ctx, const ms_nary *it, ms_binary_op op)
{
    MS_NVTX_RANGE("ms_binary");
    MS_TRY(ms_cuda_enter(ctx));
    msk_iter k;
    iter_of(&k, it);
    MS_CUDA_LAUNCH(ctx, msk_binary(ctx, STREAM(ctx), &k, (int)op));
    track_nary(ctx, it, NULL);
    return MS_OK;
}

ms_status ms_cuda_binary_scalar(ms_ctx *ctx, const ms_nary *it, ms_scalar s, ms_binary_op op, int scalar_first)
{
    MS_NVTX_RANGE("ms_binary_scalar");
    MS_TRY(ms_cuda_enter(ctx));
    msk_iter k;
    iter_of(&k, it);
    MS_CUDA_LAUNCH(ctx, msk_binary_scalar(ctx, STREAM(ctx), &k, scalar_of(s), (int)op, scalar_first != 0));
    track_nary(ctx, it, &s);
    return MS_OK;
}

ms_status ms_cuda_clamp(ms_ctx *ctx, const ms_nary *it, double lo, double hi)
{
    MS_NVTX_RANGE("ms_clamp");
    MS_TRY(ms_cuda_enter(ctx));
    msk_iter k;
    iter_of(&k, it);
    MS_CUDA_LAUNCH(ctx, msk_clamp(ctx, STREAM(ctx), &k, lo, hi));
    track_nary(ctx, it, NULL);
    return MS_OK;
}

ms_status ms_cuda_lerp(ms_ctx *ctx, const ms_nary *it, ms_scalar w)
{
    MS_NVTX_RANGE("ms_lerp");
    MS_TRY(ms_cuda_enter(ctx));
    msk_iter k;
    iter_of(&k, it);
    MS_CUDA_LAUNCH(ctx, msk_lerp(ctx, STREAM(ctx), &k, scalar_of(w)));
    track_nary(ctx, it, &w);
    return MS_OK;
}

ms_status ms_cuda_addc(ms_ctx *ctx, const ms_nary *it, ms_scalar v, int divide)
{
    MS_NVTX_RANGE("ms_addcmul/ms_addcdiv");
    MS_TRY(ms_cuda_enter(ctx));
    msk_iter k;
    iter_of(&k, it);
    MS_CUDA_LAUNCH(ctx, msk_addc(ctx, STREAM(ctx), &k, scalar_of(v), divide != 0));
    track_nary(ctx, it, &v);
    return MS_OK;
}

/* --- helpers for the other members (each counts its extra launch) ----------------------------------- */

ms_status ms_cuda_copy_tensor(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src)
{
    ms_nary it;
    MS_TRY(ms_nary_build(ctx, "cuda copy", &it, dst, 1, &src));
    if (it.numel == 0) return MS_OK;
    return ms_cuda_copy(ctx, &it);
}

ms_status ms_cuda_fill_tensor(ms_ctx *ctx, ms_tensor *t, double value)
{
    ms_nary it;
    MS_TRY(ms_nary_build(ctx, "cuda fill", &it, t, 0, NULL));
    if (it.numel == 0) return MS_OK;
    return ms_cuda_fill(ctx, &it, (ms_scalar){ value, NULL });
}

/* --- random ----------------------------------------------------------------------------------------- */

ms_status ms_cuda_rand(ms_ctx *ctx, ms_tensor *dst, const ms_rand_options *o)
{
    MS_NVTX_RANGE("ms_rand");
    MS_TRY(ms_cuda_enter(ctx));
    msk_rand r;
    memset(&r, 0, sizeof r);
    r.dst = ms_tensor_ptr(dst);
    r.dtype = dst->dtype;
    r.numel = ms_tensor_numel(dst);
    r.ndim = dst->ndim > 0 ? dst->ndim : 1;
    r.shape[0] = 1;
    for (int d = 0; d < dst->ndim; d++) {
        r.shape[d] = dst->shape[d];
        r.strides[d] = dst->strides[d];
    }
    r.normal = o->dist == MS_RAND_NORMAL;
    r.a = o->a;
    r.b = o->b;
    double rb = ms_round_to_dtype(dst->dtype, o->b);
    r.top = rb < o->b ? rb : ms_dtype_step_down(dst->dtype, rb);
    double ra = ms_round_to_dtype(dst->dtype, o->a);
    r.bot = ra >= o->a ? ra : -ms_dtype_step_down(dst->dtype, -ra);
    r.seed = o->seed;
    r.offset = o->offset;
    MS_CUDA_LAUNCH(ctx, msk_rand_run(ctx, STREAM(ctx), &r));
    ms_cuda_track_tensor(ctx, dst);
    return MS_OK;
}

/* --- reductions --------------------------------------------------------------------------------------- */

/* dims of t other than `skip` (-1: none), without size-1 dims, adjacent ones merged where their strides
** allow it (row-major order kept); returns the count */
static int coalesce(const ms_tensor *t, int skip, int64_t *shape, int64_t *strides)
{
    int n = 0;
    for (int d = 0; d < t->ndim; d++) {
        if (d == skip || t->shape[d] == 1) continue;
        if (n > 0 && strides[n - 1] == t->strides[d] * t->shape[d]) {
            shape[n - 1] *= t->shape[d];
            strides[n - 1] = t->strides[d];
        } else {
            shape[n] = t->shape[d];
            strides[n] = t->strides[d];
            n++;
        }
    }
    return n;
}

/* dst (contiguous, float dtype, nout elements) <- op over len elements of src per output. */
static ms_status reduce_run(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, ms_reduce_op op, int dim)
{
    msk_reduce r;
    memset(&r, 0, sizeof r);
    r.dst = ms_tensor_ptr(dst);
    r.dst_dtype = dst->dtype;
    r.op = op;
    r.nout = ms_tensor_numel(dst);
    ms_tensor *tmp = NULL;
    int64_t shape[MS_MAX_DIMS], strides[MS_MAX_DIMS];
    if (dim == MS_DIM_ALL) {
        r.len = ms_tensor_numel(src);
        int n = coalesce(src, -1, shape, strides);
        if (n > 1) {   /* not one strided run: reduce a contiguous copy */
            MS_TRY(ms_tensor_alloc(ctx, src->dtype, src->ndim, src->shape, &tmp));
            ms_status st = ms_cuda_copy_tensor(ctx, tmp, src);
            if (st != MS_OK) { ms_tensor_free(tmp); return st; }
            ctx->launches++;
            src = tmp;
            n = 0;
            strides[0] = 1;
        }
        r.kstride = n == 1 ? strides[0] : 1;
    } else {
        r.len = src->shape[dim];
        r.kstride = src->strides[dim];
        r.ondim = coalesce(src, dim, r.oshape, r.ostrides);
    }
    r.src = ms_tensor_ptr(src);
    r.src_dtype = src->dtype;
    ms_status st = MS_OK;
    size_t scratch_bytes = msk_reduce_scratch(&r);
    void *scratch = NULL;
    if (scratch_bytes) st = ms_cuda_scratch(ctx, scratch_bytes, &scratch);
    int launches = 0;
    if (st == MS_OK) st = ms_cuda_note_failure(ctx, msk_reduce_run(ctx, STREAM(ctx), &r, scratch, &launches));
    if (st == MS_OK) {
        ctx->launches += launches > 1 ? launches - 1 : 0;
        ms_cuda_track_tensor(ctx, src);
        ms_cuda_track_tensor(ctx, dst);
    }
    if (scratch) ms_cuda_scratch_free(ctx, scratch, scratch_bytes);   /* stream-ordered: safe right away */
    ms_tensor_free(tmp);
    return st;
}

ms_status ms_cuda_reduce(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, ms_reduce_op op, int dim)
{
    MS_NVTX_RANGE("ms_reduce");
    MS_TRY(ms_cuda_enter(ctx));
    int64_t len = dim == MS_DIM_ALL ? ms_tensor_numel(src) : src->shape[dim];
    if (ms_tensor_numel(dst) == 0) return MS_OK;
    if (len == 0) {
        if (op == MS_REDUCE_MAX || op == MS_REDUCE_MIN || op == MS_REDUCE_AMAX)
            return MS_FAIL(ctx, MS_E_SHAPE, "reduce: max/min/amax over zero elements (src %s)", ms_tshape(src));
        return ms_cuda_fill_tensor(ctx, dst, op == MS_REDUCE_MEAN ? NAN : 0.0);
    }
    return reduce_run(ctx, dst, src, op, dim);
}

/* sum(a * b): the products (in f64 when either source accumulates in f64, as the CPU) into a contiguous
** temporary, then its sum. */
ms_status ms_cuda_dot(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b)
{
    MS_NVTX_RANGE("ms_dot");
    MS_TRY(ms_cuda_enter(ctx));
    if (ms_tensor_numel(a) == 0) return ms_cuda_fill_tensor(ctx, dst, 0.0);
    bool wide = !(a->dtype == MS_DTYPE_F32 || a->dtype == MS_DTYPE_BF16 || a->dtype == MS_DTYPE_F16) ||
                !(b->dtype == MS_DTYPE_F32 || b->dtype == MS_DTYPE_BF16 || b->dtype == MS_DTYPE_F16);
    ms_tensor *prod;
    MS_TRY(ms_tensor_alloc(ctx, wide ? MS_DTYPE_F64 : MS_DTYPE_F32, a->ndim, a->shape, &prod));
    ms_nary it;
    ms_status st = ms_nary_build(ctx, "ms_dot", &it, prod, 2, (const ms_tensor *[]){ a, b });
    if (st == MS_OK) {
        it.wide = wide;
        st = ms_cuda_binary(ctx, &it, MS_BINARY_MUL);
    }
    if (st == MS_OK) {
        ctx->launches++;
        st = reduce_run(ctx, dst, prod, MS_REDUCE_SUM, MS_DIM_ALL);
    }
    ms_tensor_free(prod);
    return st;
}

/* --- eye, diag ---------------------------------------------------------------------------------------- */

/* The main diagonals of t's last two dims as a view [..., min(r, c)]. */
static void diagonal_view(ms_tensor *out, const ms_tensor *t)
{
    int nd = t->ndim;
    int64_t shape[MS_MAX_DIMS], strides[MS_MAX_DIMS];
    for (int d = 0; d < nd - 2; d++) {
        shape[d] = t->shape[d];
        strides[d] = t->strides[d];
    }
    shape[nd - 2] = t->shape[nd - 2] < t->shape[nd - 1] ? t->shape[nd - 2] : t->shape[nd - 1];
    strides[nd - 2] = t->strides[nd - 2] + t->strides[nd - 1];
    ms_cuda_view(out, t, nd - 1, shape, strides, t->offset);
}

ms_status ms_cuda_eye(ms_ctx *ctx, ms_tensor *dst)
{
    MS_NVTX_RANGE("ms_eye");
    MS_TRY(ms_cuda_enter(ctx));
    ms_tensor diagonal;
    diagonal_view(&diagonal, dst);
    MS_TRY(ms_cuda_fill_tensor(ctx, dst, 0.0));
    MS_TRY(ms_cuda_fill_tensor(ctx, &diagonal, 1.0));
    ctx->launches++;
    return MS_OK;
}

ms_status ms_cuda_diag(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src)
{
    MS_NVTX_RANGE("ms_diag");
    MS_TRY(ms_cuda_enter(ctx));
    ms_tensor diagonal;
    if (dst->ndim == src->ndim + 1) {   /* embed: zeros, then the vector on the diagonal */
        diagonal_view(&diagonal, dst);
        MS_TRY(ms_cuda_fill_tensor(ctx, dst, 0.0));
        MS_TRY(ms_cuda_copy_tensor(ctx, &diagonal, src));
        ctx->launches++;
        return MS_OK;
    }
    diagonal_view(&diagonal, src);
    return ms_cuda_copy_tensor(ctx, dst, &diagonal);
}

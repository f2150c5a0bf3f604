/*
** Tensors: creation (owning or wrapping foreign memory), reference-counted storage shared by views,
** accessors, the view operations (reshape, slice, select, transpose, permute, expand) and host transfer.
*/
#include "internal.h"

#include <stdlib.h>
#include <string.h>

MS_API size_t ms_dtype_size(ms_dtype dt)
{
    static const size_t sizes[MS_DTYPE_COUNT] = { 4, 8, 2, 2, 4, 1 };
    return ms_dtype_valid(dt) ? sizes[dt] : 0;
}

MS_API const char *ms_dtype_name(ms_dtype dt)
{
    static const char *names[MS_DTYPE_COUNT] = { "f32", "f64", "bf16", "f16", "i32", "u8" };
    return ms_dtype_valid(dt) ? names[dt] : "invalid";
}

/* numel of a shape, or -1 for a negative size or a shape past int64.  The sizes other than 0 must multiply
** within int64 even when a size is 0: they are the contiguous strides (contiguous_strides), which an empty
** tensor has too ([0, 2^62, 2^62] has numel 0 but a stride of 2^124). */
static int64_t shape_numel(int ndim, const int64_t *shape)
{
    int64_t extent = 1;
    bool empty = false;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return -1;
        if (shape[i] == 0) { empty = true; continue; }
        if (extent > INT64_MAX / shape[i]) return -1;
        extent *= shape[i];
    }
    return empty ? 0 : extent;
}

static void contiguous_strides(int ndim, const int64_t *shape, int64_t *strides)
{
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) { strides[i] = s; s *= shape[i] > 1 ? shape[i] : 1; }
}

static ms_status check_shape(ms_ctx *ctx, const char *fn, int ndim, const int64_t *shape, int64_t *numel)
{
    if (ndim < 0 || ndim > MS_MAX_DIMS)
        return MS_FAIL(ctx, MS_E_ARG, "%s: ndim %d out of range [0, %d]", fn, ndim, MS_MAX_DIMS);
    if (ndim > 0 && shape == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: shape is NULL", fn);
    *numel = shape_numel(ndim, shape);
    if (*numel < 0) {
        char buf[160];
        bool negative = false;
        for (int i = 0; i < ndim; i++) negative |= shape[i] < 0;
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: invalid shape %s (%s)", fn, ms_shape_str(buf, sizeof buf, ndim, shape),
                       negative ? "negative size" : "too many elements: its sizes other than 0 multiply past int64");
    }
    return MS_OK;
}

static ms_tensor *tensor_shell(ms_ctx *ctx, ms_storage *storage, ms_dtype dt, int ndim)
{
    ms_tensor *t = calloc(1, sizeof *t);
    if (t == NULL) return NULL;
    t->storage = storage;
    t->ctx = ctx;
    t->dtype = dt;
    t->ndim = ndim;
    ms_ctx_retain(ctx);
    return t;
}

ms_status ms_tensor_alloc(ms_ctx *ctx, ms_dtype dt, int ndim, const int64_t *shape, ms_tensor **out)
{
    int64_t numel;
    *out = NULL;
    MS_TRY(check_shape(ctx, "ms_tensor_new", ndim, shape, &numel));
    size_t esz = ms_dtype_size(dt);
    if ((uint64_t)numel > SIZE_MAX / 2 / esz)
        return MS_FAIL(ctx, MS_E_OOM, "ms_tensor_new: %lld elements of %s do not fit in memory",
                       (long long)numel, ms_dtype_name(dt));
    ms_storage *s = calloc(1, sizeof *s);
    if (s == NULL) return MS_FAIL(ctx, MS_E_OOM, "ms_tensor_new: out of host memory");
    atomic_init(&s->refcount, 1);
    s->ctx = ctx;
    s->owned = true;
    s->nbytes = (size_t)numel * esz;
    ms_status st = ms_ctx_alloc(ctx, s->nbytes, &s->data);
    if (st != MS_OK) { free(s); return st; }
    ms_ctx_retain(ctx);
    ms_tensor *t = tensor_shell(ctx, s, dt, ndim);
    if (t == NULL) {
        ms_ctx_dealloc(ctx, s->data, s->nbytes);
        ms_ctx_release(ctx);
        free(s);
        return MS_FAIL(ctx, MS_E_OOM, "ms_tensor_new: out of host memory");
    }
    if (ndim > 0) memcpy(t->shape, shape, sizeof(int64_t) * (size_t)ndim);
    contiguous_strides(ndim, t->shape, t->strides);
    *out = t;
    return MS_OK;
}

MS_API ms_status ms_tensor_new(ms_ctx *ctx, ms_dtype dt, int ndim, const int64_t *shape, ms_tensor **out)
{
    if (out == NULL) return MS_FAIL(ctx, MS_E_ARG, "ms_tensor_new: out is NULL");
    *out = NULL;
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "ms_tensor_new: ctx is NULL");
    if (!ms_dtype_valid(dt)) return MS_FAIL(ctx, MS_E_DTYPE, "ms_tensor_new: invalid dtype %d", (int)dt);
    const ms_status st = ms_tensor_alloc(ctx, dt, ndim, shape, out);
    /* the allocator's message names the device, not the call (ms_tensor_alloc serves many calls: named here,
    ** its source location kept as the one) */
    if (st == MS_E_OOM) return ms_error_name(ctx, st, "ms_tensor_new");
    return st;
}

MS_API ms_status ms_tensor_wrap(ms_ctx *ctx, void *ptr, ms_dtype dt, int ndim, const int64_t *shape,
                                const int64_t *strides, ms_tensor **out)
{
    if (out == NULL) return MS_FAIL(ctx, MS_E_ARG, "ms_tensor_wrap: out is NULL");
    *out = NULL;
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "ms_tensor_wrap: ctx is NULL");
    if (!ms_dtype_valid(dt)) return MS_FAIL(ctx, MS_E_DTYPE, "ms_tensor_wrap: invalid dtype %d", (int)dt);
    int64_t numel;
    MS_TRY(check_shape(ctx, "ms_tensor_wrap", ndim, shape, &numel));
    if (ptr == NULL && numel > 0) return MS_FAIL(ctx, MS_E_ARG, "ms_tensor_wrap: ptr is NULL");
    if (((uintptr_t)ptr % ms_dtype_size(dt)) != 0)
        return MS_FAIL(ctx, MS_E_LAYOUT, "ms_tensor_wrap: pointer %p is not aligned to its %s elements (%zu "
                       "bytes)", ptr, ms_dtype_name(dt), ms_dtype_size(dt));
    int64_t span = 1;    /* elements from ptr to one past the last reachable element */
    if (strides) {
        for (int i = 0; i < ndim; i++) {
            if (strides[i] < 0)
                return MS_FAIL(ctx, MS_E_LAYOUT, "ms_tensor_wrap: negative stride %lld in dim %d",
                               (long long)strides[i], i);
            /* a span past the address space (or past int64) would make every later bounds and overlap test
            ** wrap: refuse it here, where the strides come in */
            int64_t reach;
            if (shape[i] > 1 && (__builtin_mul_overflow(strides[i], shape[i] - 1, &reach) ||
                                 __builtin_add_overflow(span, reach, &span)))
                return MS_FAIL(ctx, MS_E_LAYOUT, "ms_tensor_wrap: stride %lld in dim %d reaches past int64 elements",
                               (long long)strides[i], i);
        }
    } else span = numel;
    if (numel > 0 && ((uint64_t)span > (SIZE_MAX / 2) / ms_dtype_size(dt) ||
                      (uintptr_t)ptr > UINTPTR_MAX - (uintptr_t)span * ms_dtype_size(dt)))
        return MS_FAIL(ctx, MS_E_LAYOUT, "ms_tensor_wrap: the view's %lld elements of %s from %p reach past the "
                       "address space", (long long)span, ms_dtype_name(dt), ptr);
    ms_storage *s = calloc(1, sizeof *s);
    if (s == NULL) return MS_FAIL(ctx, MS_E_OOM, "ms_tensor_wrap: out of host memory");
    atomic_init(&s->refcount, 1);
    s->ctx = ctx;
    s->owned = false;
    s->data = ptr;
    s->nbytes = numel == 0 ? 0 : (size_t)span * ms_dtype_size(dt);
    ms_ctx_retain(ctx);
    ms_tensor *t = tensor_shell(ctx, s, dt, ndim);
    if (t == NULL) { ms_ctx_release(ctx); free(s); return MS_FAIL(ctx, MS_E_OOM, "ms_tensor_wrap: out of host memory"); }
    if (ndim > 0) memcpy(t->shape, shape, sizeof(int64_t) * (size_t)ndim);
    if (strides) memcpy(t->strides, strides, sizeof(int64_t) * (size_t)ndim);
    else contiguous_strides(ndim, t->shape, t->strides);
    *out = t;
    return MS_OK;
}

static void storage_release(ms_storage *s)
{
    if (atomic_fetch_sub(&s->refcount, 1) != 1) return;
    if (s->owned) ms_ctx_dealloc(s->ctx, s->data, s->nbytes);
    if (s->release) s->release(s->release_arg);
    ms_ctx_release(s->ctx);
    free(s);
}

MS_API void ms_tensor_free(ms_tensor *t)
{
    if (t == NULL) return;
    ms_ctx *ctx = t->ctx;
    storage_release(t->storage);
    free(t);
    ms_ctx_release(ctx);
}

MS_API ms_dtype ms_tensor_dtype(const ms_tensor *t) { return t ? t->dtype : MS_DTYPE_COUNT; }
MS_API int ms_tensor_ndim(const ms_tensor *t) { return t ? t->ndim : -1; }

MS_API int64_t ms_tensor_size(const ms_tensor *t, int dim)
{
    if (t == NULL) return -1;
    if (dim < 0) dim += t->ndim;
    return dim >= 0 && dim < t->ndim ? t->shape[dim] : -1;
}

MS_API int64_t ms_tensor_stride(const ms_tensor *t, int dim)
{
    if (t == NULL) return 0;
    if (dim < 0) dim += t->ndim;
    return dim >= 0 && dim < t->ndim ? t->strides[dim] : 0;
}

MS_API int64_t ms_tensor_numel(const ms_tensor *t) { return t ? shape_numel(t->ndim, t->shape) : 0; }

bool ms_tensor_contiguous_p(const ms_tensor *t)
{
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] == 0) return true;   /* no element to be out of place ([5, 0] has strides [1, 1]) */
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] == 1) continue;
        if (t->strides[i] != expect) return t->shape[i] == 0;
        expect *= t->shape[i];
    }
    return true;
}

/* A tensor that is written element by element must not reach one address from two elements.  The dims of
** size > 1, taken by increasing stride, must nest: each stride beyond the span of the dims before it.  That
** is exact for stride 0 (an expanded view), for equal strides, and for every view that slicing, transposing
** or permuting a dense tensor makes; strides that only interleave (shape [2,3], strides [4,3]) are refused
** too, as a layout no moonstep op writes.  Returns 0 when t is writable; else 1 (dim *dim has stride 0) or 2
** (dim *dim's stride lies within the span of the dims of smaller stride). */
static int write_fault(const ms_tensor *t, int *dim)
{
    if (ms_tensor_numel(t) == 0) return 0;
    int dims[MS_MAX_DIMS], n = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 1) continue;
        if (t->strides[i] == 0) { *dim = i; return 1; }
        int k = n++;   /* insertion by stride, the earlier dim first among equals */
        while (k > 0 && t->strides[dims[k - 1]] > t->strides[i]) {
            dims[k] = dims[k - 1];
            k--;
        }
        dims[k] = i;
    }
    int64_t span = 0;   /* the largest offset the dims so far reach (fits: ms_tensor_wrap checked the extent) */
    for (int k = 0; k < n; k++) {
        const int d = dims[k];
        if (t->strides[d] <= span) { *dim = d; return 2; }
        span += (t->shape[d] - 1) * t->strides[d];
    }
    return 0;
}

ms_status ms_check_writable(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t)
{
    int d = 0;
    switch (write_fault(t, &d)) {
    case 1:
        return MS_FAIL(ctx, MS_E_LAYOUT, "%s: %s %s is an expanded view (stride 0 in dim %d); writing it would "
                       "race", fn, who, ms_tshape(t), d);
    case 2: {
        char strides[16 * MS_MAX_DIMS + 4];
        return MS_FAIL(ctx, MS_E_LAYOUT, "%s: %s %s has strides %s, under which two elements can share an "
                       "address (dim %d's stride %lld lies within the span of the dims of smaller stride); "
                       "writing it would race", fn, who, ms_tshape(t),
                       ms_shape_str(strides, sizeof strides, t->ndim, t->strides), d, (long long)t->strides[d]);
    }
    default:
        return MS_OK;
    }
}

MS_API int ms_tensor_is_writable(const ms_tensor *t)
{
    int d;
    return t ? write_fault(t, &d) == 0 : 0;
}

MS_API ms_status ms_tensor_set_rng_origin(ms_tensor *t, const ms_rng_origin *o)
{
    const char *FN = "ms_tensor_set_rng_origin";
    if (t == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: t is NULL", FN);
    if (o == NULL) {
        t->has_rng = false;
        return MS_OK;
    }
    if (o->rows != 0 || o->cols != 0) {
        if (t->ndim < 2)
            return MS_FAIL(t->ctx, MS_E_ARG, "%s: rows and cols number a matrix's elements, and the tensor has %d dims",
                           FN, t->ndim);
        const int64_t m = t->shape[t->ndim - 2], n = t->shape[t->ndim - 1];
        /* (each bound written so that no sum can overflow) */
        if (o->rows < 0 || o->cols < 0 || o->row0 < 0 || o->col0 < 0 || o->row0 > o->rows - m || o->col0 > o->cols - n)
            return MS_FAIL(t->ctx, MS_E_ARG,
                           "%s: a [%lld, %lld] matrix at row %lld, column %lld does not fit in [%lld, %lld]", FN,
                           (long long)m, (long long)n, (long long)o->row0, (long long)o->col0, (long long)o->rows,
                           (long long)o->cols);
        if (o->rows != m && o->cols != n)
            return MS_FAIL(t->ctx, MS_E_ARG,
                           "%s: a [%lld, %lld] matrix is a slice of [%lld, %lld] along one dim (rows %lld or cols %lld)",
                           FN, (long long)m, (long long)n, (long long)o->rows, (long long)o->cols, (long long)m,
                           (long long)n);
        /* the numbers of the whole: (leading dims) x rows x cols within int64 */
        int64_t whole = o->rows, lead = 1;
        for (int d = 0; d < t->ndim - 2; d++) lead = t->shape[d] > 0 && lead > INT64_MAX / t->shape[d] ? -1 : lead * t->shape[d];
        if (lead < 0 || (o->cols > 0 && whole > INT64_MAX / o->cols) ||
            (whole * o->cols > 0 && lead > INT64_MAX / (whole * o->cols)))
            return MS_FAIL(t->ctx, MS_E_ARG, "%s: the whole's elements (%lld x %lld a matrix) overflow int64", FN,
                           (long long)o->rows, (long long)o->cols);
    } else if (o->row0 != 0 || o->col0 != 0) {
        return MS_FAIL(t->ctx, MS_E_ARG, "%s: row0 and col0 need the whole's rows and cols", FN);
    }
    t->rng = *o;
    t->has_rng = true;
    return MS_OK;
}

MS_API int ms_tensor_is_contiguous(const ms_tensor *t) { return t ? ms_tensor_contiguous_p(t) : 0; }
MS_API int ms_tensor_owns_memory(const ms_tensor *t) { return t ? t->storage->owned : 0; }
MS_API ms_ctx *ms_tensor_ctx(const ms_tensor *t) { return t ? t->ctx : NULL; }
MS_API void *ms_tensor_data_ptr(const ms_tensor *t) { return t ? ms_tensor_ptr(t) : NULL; }

/* Element range [lo, hi] a tensor can touch (offsets from its storage), for overlap checks. */
static void element_range(const ms_tensor *t, int64_t *lo, int64_t *hi)
{
    *lo = *hi = t->offset;
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] > 1) *hi += t->strides[i] * (t->shape[i] - 1);
}

MS_API int ms_tensor_overlaps(const ms_tensor *a, const ms_tensor *b)
{
    if (a == NULL || b == NULL) return 0;
    if (ms_tensor_numel(a) == 0 || ms_tensor_numel(b) == 0) return 0;
    char *pa0, *pa1, *pb0, *pb1;
    int64_t lo, hi;
    element_range(a, &lo, &hi);
    size_t ea = ms_dtype_size(a->dtype), eb = ms_dtype_size(b->dtype);
    pa0 = (char *)a->storage->data + lo * (int64_t)ea;
    pa1 = (char *)a->storage->data + (hi + 1) * (int64_t)ea;
    element_range(b, &lo, &hi);
    pb0 = (char *)b->storage->data + lo * (int64_t)eb;
    pb1 = (char *)b->storage->data + (hi + 1) * (int64_t)eb;
    if (a->ctx->type != b->ctx->type || a->ctx->index != b->ctx->index) return 0;
    return pa0 < pb1 && pb0 < pa1;
}

/* --- views --------------------------------------------------------------------------------------- */

static ms_status view_of(ms_ctx *ctx, const char *fn, const ms_tensor *src, ms_tensor **out)
{
    *out = NULL;
    ms_tensor *t = tensor_shell(src->ctx, src->storage, src->dtype, src->ndim);
    if (t == NULL) return MS_FAIL(ctx, MS_E_OOM, "%s: out of host memory", fn);
    atomic_fetch_add(&src->storage->refcount, 1);
    memcpy(t->shape, src->shape, sizeof t->shape);
    memcpy(t->strides, src->strides, sizeof t->strides);
    t->offset = src->offset;
    *out = t;
    return MS_OK;
}

static ms_status check_view_args(ms_ctx *ctx, const char *fn, const ms_tensor *src, ms_tensor **out)
{
    if (out == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (src == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: src is NULL", fn);
    return MS_OK;
}

static ms_status norm_dim(ms_ctx *ctx, const char *fn, int *dim, int ndim)
{
    int d = *dim < 0 ? *dim + ndim : *dim;
    if (d < 0 || d >= ndim)
        return MS_FAIL(ctx, MS_E_ARG, "%s: dim %d out of range for a %d-dim tensor", fn, *dim, ndim);
    *dim = d;
    return MS_OK;
}

MS_API ms_status ms_tensor_reshape(ms_ctx *ctx, const ms_tensor *src, int ndim, const int64_t *shape,
                                   ms_tensor **out)
{
    static const char fn[] = "ms_tensor_reshape";
    MS_TRY(check_view_args(ctx, fn, src, out));
    if (ndim < 0 || ndim > MS_MAX_DIMS)
        return MS_FAIL(ctx, MS_E_ARG, "%s: ndim %d out of range [0, %d]", fn, ndim, MS_MAX_DIMS);
    if (ndim > 0 && shape == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: shape is NULL", fn);
    int64_t want[MS_MAX_DIMS];
    int infer = -1;
    int64_t known = 1, extent = 1, numel = ms_tensor_numel(src);   /* extent: the sizes other than 0 (shape_numel) */
    char b1[160], b2[160];
    for (int i = 0; i < ndim; i++) {
        want[i] = shape[i];
        if (shape[i] == -1) {
            if (infer >= 0) return MS_FAIL(ctx, MS_E_SHAPE, "%s: more than one -1 in %s", fn,
                                           ms_shape_str(b1, sizeof b1, ndim, shape));
            infer = i;
        } else if (shape[i] < 0) {
            return MS_FAIL(ctx, MS_E_SHAPE, "%s: negative size in %s", fn, ms_shape_str(b1, sizeof b1, ndim, shape));
        } else if (shape[i] != 0 && extent > INT64_MAX / shape[i]) {
            /* a product that wraps could equal numel (2^64 wraps to 0): the view would reach past the storage;
            ** and the strides of an empty view ([0, 2^62, 2^62]) are the product of the other sizes */
            return MS_FAIL(ctx, MS_E_SHAPE, "%s: shape %s has too many elements", fn,
                           ms_shape_str(b1, sizeof b1, ndim, shape));
        } else {
            known *= shape[i];
            if (shape[i] != 0) extent *= shape[i];
        }
    }
    if (infer >= 0) {
        if (known == 0 || numel % known != 0)
            return MS_FAIL(ctx, MS_E_SHAPE, "%s: cannot infer -1 in %s from %lld elements", fn,
                           ms_shape_str(b1, sizeof b1, ndim, shape), (long long)numel);
        want[infer] = numel / known;
        known = numel;
    }
    if (known != numel)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: shape %s (%lld elements) does not fit %s (%lld elements)", fn,
                       ms_shape_str(b1, sizeof b1, ndim, want), (long long)known, ms_shape_str(b2, sizeof b2,
                       src->ndim, src->shape), (long long)numel);
    /* Strides for the new shape: walk the old dims from the last, in chunks that are contiguous within
    ** themselves; each chunk must be covered exactly by a run of new dims (as torch's computeStride). */
    int64_t nstr[MS_MAX_DIMS];
    if (numel == 0 || src->ndim == 0) contiguous_strides(ndim, want, nstr);
    else {
        int vd = ndim - 1;
        int64_t base = src->strides[src->ndim - 1], tnum = 1, vnum = 1;
        for (int td = src->ndim - 1; td >= 0; td--) {
            tnum *= src->shape[td];
            if (td == 0 || (src->shape[td - 1] != 1 && src->strides[td - 1] != tnum * base)) {
                while (vd >= 0 && (vnum < tnum || want[vd] == 1)) {
                    nstr[vd] = vnum * base;
                    vnum *= want[vd];
                    vd--;
                }
                if (vnum != tnum)
                    return MS_FAIL(ctx, MS_E_LAYOUT, "%s: a view of shape %s cannot be made from a tensor of "
                                   "shape %s with its strides (call contiguous first)", fn,
                                   ms_shape_str(b1, sizeof b1, ndim, want), ms_tshape(src));
                if (td > 0) { base = src->strides[td - 1]; tnum = 1; vnum = 1; }
            }
        }
        for (; vd >= 0; vd--) nstr[vd] = 1;   /* leading size-1 dims */
    }
    ms_tensor *t;
    MS_TRY(view_of(ctx, fn, src, &t));
    t->ndim = ndim;
    memset(t->shape, 0, sizeof t->shape);
    memset(t->strides, 0, sizeof t->strides);
    for (int i = 0; i < ndim; i++) { t->shape[i] = want[i]; t->strides[i] = nstr[i]; }
    *out = t;
    return MS_OK;
}

static int64_t clamp_index(int64_t v, int64_t n)
{
    if (v < 0) v += n;
    return v < 0 ? 0 : v > n ? n : v;
}

MS_API ms_status ms_tensor_slice(ms_ctx *ctx, const ms_tensor *src, int dim, int64_t start, int64_t stop,
                                 int64_t step, ms_tensor **out)
{
    static const char fn[] = "ms_tensor_slice";
    MS_TRY(check_view_args(ctx, fn, src, out));
    MS_TRY(norm_dim(ctx, fn, &dim, src->ndim));
    if (step < 1) return MS_FAIL(ctx, MS_E_ARG, "%s: step %lld must be >= 1", fn, (long long)step);
    int64_t n = src->shape[dim];
    start = clamp_index(start, n);
    stop = clamp_index(stop, n);
    int64_t len = stop > start ? (stop - start - 1) / step + 1 : 0;   /* ceil without overflow for any step */
    ms_tensor *t;
    MS_TRY(view_of(ctx, fn, src, &t));
    if (len > 0) t->offset += start * src->strides[dim];
    t->shape[dim] = len;
    /* with two elements or more, step < n bounds stride * step by the source's reach; one element keeps the
    ** source's stride (stride * a huge step would overflow) */
    if (len > 1) t->strides[dim] = src->strides[dim] * step;
    *out = t;
    return MS_OK;
}

MS_API ms_status ms_tensor_select(ms_ctx *ctx, const ms_tensor *src, int dim, int64_t index, ms_tensor **out)
{
    static const char fn[] = "ms_tensor_select";
    MS_TRY(check_view_args(ctx, fn, src, out));
    MS_TRY(norm_dim(ctx, fn, &dim, src->ndim));
    int64_t n = src->shape[dim];
    int64_t i = index < 0 ? index + n : index;
    if (i < 0 || i >= n)
        return MS_FAIL(ctx, MS_E_ARG, "%s: index %lld out of range for dim %d of size %lld", fn,
                       (long long)index, dim, (long long)n);
    ms_tensor *t;
    MS_TRY(view_of(ctx, fn, src, &t));
    t->offset += i * src->strides[dim];
    for (int k = dim; k < src->ndim - 1; k++) { t->shape[k] = src->shape[k + 1]; t->strides[k] = src->strides[k + 1]; }
    t->ndim--;
    t->shape[t->ndim] = 0;
    t->strides[t->ndim] = 0;
    *out = t;
    return MS_OK;
}

MS_API ms_status ms_tensor_permute(ms_ctx *ctx, const ms_tensor *src, int ndim, const int *perm, ms_tensor **out)
{
    static const char fn[] = "ms_tensor_permute";
    MS_TRY(check_view_args(ctx, fn, src, out));
    if (ndim != src->ndim || (ndim > 0 && perm == NULL))
        return MS_FAIL(ctx, MS_E_ARG, "%s: %d dims given for a %d-dim tensor", fn, ndim, src->ndim);
    bool seen[MS_MAX_DIMS] = { false };
    int p[MS_MAX_DIMS];
    for (int i = 0; i < ndim; i++) {
        p[i] = perm[i];
        MS_TRY(norm_dim(ctx, fn, &p[i], ndim));
        if (seen[p[i]]) return MS_FAIL(ctx, MS_E_ARG, "%s: dim %d repeated in the permutation", fn, perm[i]);
        seen[p[i]] = true;
    }
    ms_tensor *t;
    MS_TRY(view_of(ctx, fn, src, &t));
    for (int i = 0; i < ndim; i++) { t->shape[i] = src->shape[p[i]]; t->strides[i] = src->strides[p[i]]; }
    *out = t;
    return MS_OK;
}

MS_API ms_status ms_tensor_transpose(ms_ctx *ctx, const ms_tensor *src, int dim0, int dim1, ms_tensor **out)
{
    static const char fn[] = "ms_tensor_transpose";
    MS_TRY(check_view_args(ctx, fn, src, out));
    MS_TRY(norm_dim(ctx, fn, &dim0, src->ndim));
    MS_TRY(norm_dim(ctx, fn, &dim1, src->ndim));
    ms_tensor *t;
    MS_TRY(view_of(ctx, fn, src, &t));
    t->shape[dim0] = src->shape[dim1]; t->strides[dim0] = src->strides[dim1];
    t->shape[dim1] = src->shape[dim0]; t->strides[dim1] = src->strides[dim0];
    *out = t;
    return MS_OK;
}

MS_API ms_status ms_tensor_expand(ms_ctx *ctx, const ms_tensor *src, int ndim, const int64_t *shape,
                                  ms_tensor **out)
{
    static const char fn[] = "ms_tensor_expand";
    MS_TRY(check_view_args(ctx, fn, src, out));
    char b1[160];
    /* as reshape: ndim and shape wrong in themselves are MS_E_ARG, a shape that src does not fit MS_E_SHAPE */
    if (ndim < 0 || ndim > MS_MAX_DIMS)
        return MS_FAIL(ctx, MS_E_ARG, "%s: ndim %d out of range [0, %d]", fn, ndim, MS_MAX_DIMS);
    if (ndim > 0 && shape == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: shape is NULL", fn);
    if (ndim < src->ndim)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: cannot expand %s to %d dims", fn, ms_tshape(src), ndim);
    int64_t nshape[MS_MAX_DIMS], nstr[MS_MAX_DIMS];
    int lead = ndim - src->ndim;
    for (int i = 0; i < ndim; i++) {
        int64_t want = shape[i];
        if (i < lead) {
            if (want < 0) goto bad;
            nshape[i] = want; nstr[i] = 0;
            continue;
        }
        int64_t have = src->shape[i - lead];
        if (want == -1) want = have;
        if (want == have) { nshape[i] = have; nstr[i] = src->strides[i - lead]; }
        else if (have == 1 && want >= 0) { nshape[i] = want; nstr[i] = 0; }
        else goto bad;
    }
    if (shape_numel(ndim, nshape) < 0)   /* stride 0 needs no memory, but numel must still be an int64 */
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: cannot expand %s to %s: too many elements", fn, ms_tshape(src),
                       ms_shape_str(b1, sizeof b1, ndim, shape));
    ms_tensor *t;
    MS_TRY(view_of(ctx, fn, src, &t));
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) { t->shape[i] = nshape[i]; t->strides[i] = nstr[i]; }
    *out = t;
    return MS_OK;
bad:
    return MS_FAIL(ctx, MS_E_SHAPE, "%s: cannot expand %s to %s", fn, ms_tshape(src),
                   ms_shape_str(b1, sizeof b1, ndim, shape));
}

MS_API ms_status ms_tensor_contiguous(ms_ctx *ctx, const ms_tensor *src, ms_tensor **out)
{
    static const char fn[] = "ms_tensor_contiguous";
    MS_TRY(check_view_args(ctx, fn, src, out));
    if (ctx == NULL) ctx = src->ctx;
    if (ms_tensor_contiguous_p(src)) return view_of(ctx, fn, src, out);
    ms_tensor *t;
    ms_status st = ms_tensor_alloc(src->ctx, src->dtype, src->ndim, src->shape, &t);
    /* the allocator's message names the device, not the call */
    if (st != MS_OK) return ms_error_name(ctx, st, fn);
    st = ms_copy(src->ctx, t, src);
    if (st != MS_OK) { ms_tensor_free(t); return st; }
    *out = t;
    return MS_OK;
}

/* --- host transfer ------------------------------------------------------------------------------- */

static ms_status check_transfer(ms_ctx *ctx, const char *fn, const ms_tensor *t, const void *host, size_t nbytes)
{
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (t == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: tensor is NULL", fn);
    /* an expanded view can hold more elements than any buffer: a byte count that wraps could match nbytes */
    if ((uint64_t)ms_tensor_numel(t) > SIZE_MAX / ms_dtype_size(t->dtype))
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: a %s %s tensor has more bytes than a host buffer can hold", fn,
                       ms_dtype_name(t->dtype), ms_tshape(t));
    size_t want = (size_t)ms_tensor_numel(t) * ms_dtype_size(t->dtype);
    if (nbytes != want)
        return MS_FAIL(ctx, MS_E_SHAPE, "%s: %zu bytes given for a %s %s tensor of %zu bytes", fn, nbytes,
                       ms_dtype_name(t->dtype), ms_tshape(t), want);
    if (host == NULL && nbytes > 0) return MS_FAIL(ctx, MS_E_ARG, "%s: host buffer is NULL", fn);
    return MS_OK;
}

MS_API ms_status ms_tensor_read(ms_ctx *ctx, const ms_tensor *src, void *host_dst, size_t nbytes)
{
    MS_TRY(check_transfer(ctx, "ms_tensor_read", src, host_dst, nbytes));
    if (nbytes == 0) return MS_OK;
    ms_tensor *c;
    ms_status st = ms_tensor_contiguous(src->ctx, src, &c);   /* a strided src is staged contiguously first */
    if (st != MS_OK) return ms_error_name(ctx, st, "ms_tensor_read");
    st = c->ctx->backend->memcpy_to_host(c->ctx, host_dst, ms_tensor_ptr(c), nbytes);
    ms_tensor_free(c);
    return st;
}

MS_API ms_status ms_tensor_write(ms_ctx *ctx, ms_tensor *dst, const void *host_src, size_t nbytes)
{
    MS_TRY(check_transfer(ctx, "ms_tensor_write", dst, host_src, nbytes));
    if (nbytes == 0) return MS_OK;
    /* refused here, not by the scatter below, so the message names this call */
    MS_TRY(ms_check_writable(ctx, "ms_tensor_write", "dst", dst));
    if (ms_tensor_contiguous_p(dst))
        return dst->ctx->backend->memcpy_from_host(dst->ctx, ms_tensor_ptr(dst), host_src, nbytes);
    /* strided destination: stage contiguously on the device, then scatter with a copy */
    ms_tensor *c;
    ms_status st = ms_tensor_alloc(dst->ctx, dst->dtype, dst->ndim, dst->shape, &c);
    if (st != MS_OK) return ms_error_name(ctx, st, "ms_tensor_write");
    st = dst->ctx->backend->memcpy_from_host(dst->ctx, ms_tensor_ptr(c), host_src, nbytes);
    if (st == MS_OK) st = ms_copy(dst->ctx, dst, c);
    ms_tensor_free(c);
    return st;
}

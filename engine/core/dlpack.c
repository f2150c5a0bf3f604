/*
** DLPack import and export (dlpack.h's DLManagedTensor): tensors cross to and from PyTorch, JAX, CuPy ...
** without copies.  An import wraps the producer's memory and calls its deleter once, when the last view goes;
** an export hands out a view that keeps moonstep's storage alive until the consumer calls our deleter.
*/
#include "internal.h"

#include <dlpack/dlpack.h>
#include <stdlib.h>
#include <string.h>

/* --- dtypes and devices ---------------------------------------------------------------------------- */

static bool dtype_from_dl(DLDataType t, ms_dtype *out)
{
    if (t.lanes != 1) return false;
    switch (t.code) {
    case kDLFloat:
        if (t.bits == 32) { *out = MS_DTYPE_F32; return true; }
        if (t.bits == 64) { *out = MS_DTYPE_F64; return true; }
        if (t.bits == 16) { *out = MS_DTYPE_F16; return true; }
        return false;
    case kDLBfloat:
        if (t.bits == 16) { *out = MS_DTYPE_BF16; return true; }
        return false;
    case kDLInt:
        if (t.bits == 32) { *out = MS_DTYPE_I32; return true; }
        return false;
    case kDLUInt:
        if (t.bits == 8) { *out = MS_DTYPE_U8; return true; }
        return false;
    default:
        return false;
    }
}

static DLDataType dtype_to_dl(ms_dtype dt)
{
    static const DLDataType map[MS_DTYPE_COUNT] = {
        [MS_DTYPE_F32] = { kDLFloat, 32, 1 }, [MS_DTYPE_F64] = { kDLFloat, 64, 1 },
        [MS_DTYPE_BF16] = { kDLBfloat, 16, 1 }, [MS_DTYPE_F16] = { kDLFloat, 16, 1 },
        [MS_DTYPE_I32] = { kDLInt, 32, 1 }, [MS_DTYPE_U8] = { kDLUInt, 8, 1 },
    };
    return map[dt];
}

static DLDevice device_of(const ms_ctx *ctx)
{
    DLDevice d = { ctx->type == MS_DEVICE_CUDA ? kDLCUDA : kDLCPU, ctx->type == MS_DEVICE_CUDA ? ctx->index : 0 };
    return d;
}

static const char *device_name(DLDeviceType t)
{
    switch (t) {
    case kDLCPU:         return "cpu";
    case kDLCUDA:        return "cuda";
    case kDLCUDAHost:    return "cuda_host";
    case kDLCUDAManaged: return "cuda_managed";
    case kDLROCM:        return "rocm";
    case kDLVulkan:      return "vulkan";
    case kDLMetal:       return "metal";
    case kDLOpenCL:      return "opencl";
    default:             return "another device";
    }
}

/* --- import ---------------------------------------------------------------------------------------- */

static void call_deleter(void *arg)
{
    DLManagedTensor *m = arg;
    if (m->deleter) m->deleter(m);
}

MS_API ms_status ms_tensor_from_dlpack(ms_ctx *ctx, void *managed, ms_tensor **out)
{
    static const char fn[] = "ms_tensor_from_dlpack";
    if (out == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (managed == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: managed is NULL", fn);
    DLManagedTensor *m = managed;
    const DLTensor *t = &m->dl_tensor;
    /* every refusal below names `managed`: the caller's tensor is at fault, not the call */
    DLDevice want = device_of(ctx);
    if (t->device.device_type != want.device_type || t->device.device_id != want.device_id)
        return MS_FAIL(ctx, MS_E_DEVICE, "%s: managed is on %s:%d but the context is on %s", fn,
                       device_name(t->device.device_type), t->device.device_id, ctx->name);
    ms_dtype dt;
    if (!dtype_from_dl(t->dtype, &dt))
        return MS_FAIL(ctx, MS_E_DTYPE, "%s: managed's DLPack dtype (code %u, %u bits, %u lanes) is not one of f32 "
                       "f64 bf16 f16 i32 u8", fn, t->dtype.code, t->dtype.bits, t->dtype.lanes);
    if (t->ndim < 0 || t->ndim > MS_MAX_DIMS)
        return MS_FAIL(ctx, MS_E_ARG, "%s: managed has %d dims (0 to %d are taken)", fn, t->ndim, MS_MAX_DIMS);
    if (t->ndim > 0 && t->shape == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: managed's shape is NULL", fn);
    if (t->data && t->byte_offset > UINTPTR_MAX - (uintptr_t)t->data)   /* the sum would wrap to another address */
        return MS_FAIL(ctx, MS_E_LAYOUT, "%s: managed's data %p + byte_offset %llu runs past the address space", fn,
                       t->data, (unsigned long long)t->byte_offset);
    char *data = t->data ? (char *)t->data + t->byte_offset : NULL;
    ms_tensor *x;
    const ms_status st = ms_tensor_wrap(ctx, data, dt, t->ndim, t->shape, t->strides, &x);
    if (st != MS_OK) {
        /* the wrap's message names ms_tensor_wrap, which the caller did not call: this call and its argument */
        static const char wrap[] = "ms_tensor_wrap: ";
        const char *why = ms_last_error();
        if (strncmp(why, wrap, sizeof wrap - 1) == 0) why += sizeof wrap - 1;
        return MS_FAIL(ctx, st, "%s: managed: %s", fn, why);
    }
    x->storage->release = call_deleter;
    x->storage->release_arg = m;
    *out = x;
    return MS_OK;
}

/* --- export ---------------------------------------------------------------------------------------- */

typedef struct exported {
    DLManagedTensor managed;      /* first: the consumer's pointer is ours */
    int64_t         shape[MS_MAX_DIMS];
    int64_t         strides[MS_MAX_DIMS];
    ms_tensor      *view;         /* holds the storage (and its context) */
} exported;

static void exported_deleter(DLManagedTensor *m)
{
    exported *e = (exported *)m;
    ms_tensor_free(e->view);
    free(e);
}

MS_API ms_status ms_tensor_to_dlpack(ms_ctx *ctx, const ms_tensor *t, void **out_managed)
{
    static const char fn[] = "ms_tensor_to_dlpack";
    if (out_managed == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: out_managed is NULL", fn);
    *out_managed = NULL;
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "%s: ctx is NULL", fn);
    if (t == NULL) return MS_FAIL(ctx, MS_E_ARG, "%s: t is NULL", fn);
    if (!(ctx->type == t->ctx->type && ctx->index == t->ctx->index))
        return MS_FAIL(ctx, MS_E_DEVICE, "%s: t is on %s but the context is on %s", fn, t->ctx->name, ctx->name);
    exported *e = calloc(1, sizeof *e);
    ms_tensor *view = calloc(1, sizeof *view);
    if (e == NULL || view == NULL) {
        free(e);
        free(view);
        return MS_FAIL(ctx, MS_E_OOM, "%s: out of host memory", fn);
    }
    *view = *t;   /* the same view: one more reference to its storage and context */
    atomic_fetch_add(&view->storage->refcount, 1);
    ms_ctx_retain(view->ctx);
    e->view = view;
    memcpy(e->shape, t->shape, sizeof e->shape);
    memcpy(e->strides, t->strides, sizeof e->strides);
    DLTensor *d = &e->managed.dl_tensor;
    d->data = ms_tensor_numel(t) > 0 ? ms_tensor_ptr(t) : t->storage->data;
    d->device = device_of(t->ctx);
    d->ndim = t->ndim;
    d->dtype = dtype_to_dl(t->dtype);
    d->shape = e->shape;
    d->strides = e->strides;
    d->byte_offset = 0;
    e->managed.manager_ctx = e;
    e->managed.deleter = exported_deleter;
    *out_managed = &e->managed;
    return MS_OK;
}

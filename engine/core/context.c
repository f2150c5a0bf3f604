/*
** Contexts: device selection, the backend they dispatch to, reference counting and the memory
** accounting every backend allocation goes through (limit, statistics).
*/
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

/* "cpu", "cuda", "cuda:N", "auto" -> type and index; index -1 means "the default one". */
static ms_status parse_device(const char *device, ms_device_type *type, int *index, bool *is_auto)
{
    *is_auto = false;
    *index = 0;
    if (strcmp(device, "cpu") == 0) { *type = MS_DEVICE_CPU; return MS_OK; }
    if (strcmp(device, "auto") == 0) { *is_auto = true; return MS_OK; }
    if (strncmp(device, "cuda", 4) == 0) {
        *type = MS_DEVICE_CUDA;
        if (device[4] == '\0') return MS_OK;
        if (device[4] == ':' && device[5] >= '0' && device[5] <= '9') {
            char *end;
            errno = 0;
            long v = strtol(device + 5, &end, 10);
            if (*end == '\0' && errno == 0 && v >= 0 && v < 1024) { *index = (int)v; return MS_OK; }
        }
    }
    return MS_FAIL(NULL, MS_E_ARG, "ms_ctx_new: unknown device \"%s\" (expected \"cpu\", \"cuda\", "
                   "\"cuda:N\" or \"auto\")", device);
}

MS_API int ms_device_count(ms_device_type type)
{
    switch (type) {
    case MS_DEVICE_CPU: return 1;
    case MS_DEVICE_CUDA:
#ifdef MS_WITH_CUDA
        return ms_cuda_device_count();
#else
        return 0;
#endif
    }
    return 0;
}

MS_API ms_status ms_ctx_new(const char *device, const ms_ctx_options *opts, ms_ctx **out)
{
    if (out == NULL) return MS_FAIL(NULL, MS_E_ARG, "ms_ctx_new: out is NULL");
    *out = NULL;
    if (device == NULL) device = "auto";
    ms_device_type type = MS_DEVICE_CPU;
    int index;
    bool is_auto;
    MS_TRY(parse_device(device, &type, &index, &is_auto));
    if (is_auto) type = ms_device_count(MS_DEVICE_CUDA) > 0 ? MS_DEVICE_CUDA : MS_DEVICE_CPU;
    if (opts && opts->mem_limit < 0)
        return MS_FAIL(NULL, MS_E_ARG, "ms_ctx_new: mem_limit %lld is negative", (long long)opts->mem_limit);
    if (opts && opts->num_threads < 0)
        return MS_FAIL(NULL, MS_E_ARG, "ms_ctx_new: num_threads %d is negative", opts->num_threads);
    /* (OpenMP fails to create tens of thousands, or crashes: a value past any machine's cores is a mistake) */
    if (opts && opts->num_threads > MS_MAX_THREADS)
        return MS_FAIL(NULL, MS_E_ARG, "ms_ctx_new: num_threads %d is above %d", opts->num_threads, MS_MAX_THREADS);

    const ms_backend *backend = &ms_cpu_backend;
    if (type == MS_DEVICE_CUDA) {
#ifdef MS_WITH_CUDA
        int count = ms_cuda_device_count();
        if (count == 0)
            return MS_FAIL(NULL, MS_E_DEVICE, "ms_ctx_new: \"%s\": no CUDA device is usable (no GPU or no "
                           "driver: %s)", device, ms_cuda_probe_error());
        if (index >= count)
            return MS_FAIL(NULL, MS_E_DEVICE, "ms_ctx_new: \"%s\": device index %d out of range (%d CUDA "
                           "device%s)", device, index, count, count == 1 ? "" : "s");
        backend = &ms_cuda_backend;
#else
        return MS_FAIL(NULL, MS_E_UNSUPPORTED, "ms_ctx_new: \"%s\": this build has no CUDA backend "
                       "(rebuild with CUDA=1 where nvcc is found)", device);
#endif
    } else if (opts && opts->stream)
        return MS_FAIL(NULL, MS_E_ARG, "ms_ctx_new: a stream was given for device \"%s\", which has none", device);

    ms_ctx *ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_OOM, "ms_ctx_new: out of host memory");
    atomic_init(&ctx->refcount, 1);
    ctx->type = type;
    ctx->index = type == MS_DEVICE_CPU ? 0 : index;
    ctx->backend = backend;
    ctx->mem_limit = opts ? opts->mem_limit : 0;
    ctx->num_threads = opts ? opts->num_threads : 0;
    if (type == MS_DEVICE_CPU) snprintf(ctx->name, sizeof ctx->name, "cpu");
    else snprintf(ctx->name, sizeof ctx->name, "cuda:%d", ctx->index);
    ms_status st = backend->ctx_init(ctx, opts);
    if (st != MS_OK) { free(ctx); return st; }
    *out = ctx;
    return MS_OK;
}

void ms_ctx_retain(ms_ctx *ctx) { atomic_fetch_add(&ctx->refcount, 1); }

void ms_ctx_release(ms_ctx *ctx)
{
    if (ctx == NULL || atomic_fetch_sub(&ctx->refcount, 1) != 1) return;
    ctx->backend->ctx_release(ctx);
    free(ctx);
}

MS_API void ms_ctx_free(ms_ctx *ctx) { ms_ctx_release(ctx); }

MS_API ms_device_type ms_ctx_device_type(const ms_ctx *ctx) { return ctx ? ctx->type : MS_DEVICE_CPU; }
MS_API int ms_ctx_device_index(const ms_ctx *ctx) { return ctx ? ctx->index : 0; }
MS_API const char *ms_ctx_device_name(const ms_ctx *ctx) { return ctx ? ctx->name : "(null)"; }

MS_API ms_status ms_ctx_sync(ms_ctx *ctx)
{
    if (ctx == NULL) return MS_FAIL(NULL, MS_E_ARG, "ms_ctx_sync: ctx is NULL");
    return ctx->backend->sync(ctx);
}

MS_API ms_status ms_ctx_mem_stats(const ms_ctx *ctx, ms_mem_stats *out)
{
    if (ctx == NULL || out == NULL) return MS_FAIL(NULL, MS_E_ARG, "ms_ctx_mem_stats: ctx or out is NULL");
    memset(out, 0, sizeof *out);
    out->bytes_in_use = __atomic_load_n(&ctx->bytes_in_use, __ATOMIC_RELAXED);
    out->peak_bytes = __atomic_load_n(&ctx->peak_bytes, __ATOMIC_RELAXED);
    out->limit = ctx->mem_limit;
    out->num_allocs = __atomic_load_n(&ctx->num_allocs, __ATOMIC_RELAXED);
    out->num_frees = __atomic_load_n(&ctx->num_frees, __ATOMIC_RELAXED);
    out->num_device_allocs = ctx->num_device_allocs;
    out->bytes_cached = ctx->bytes_cached;
    out->launches = ctx->launches;
    return MS_OK;
}

/* The accounting is atomic: tensors may be freed from any thread (moonstep.h) while the context's own thread
** allocates, and a lost update would drift bytes_in_use, and with it the mem_limit check, for good.  The bytes
** are reserved (against the limit) before the backend allocates, and given back when it fails. */
ms_status ms_ctx_alloc(ms_ctx *ctx, size_t nbytes, void **out)
{
    *out = NULL;
    if (nbytes == 0) {   /* empty tensors hold no memory */
        __atomic_fetch_add(&ctx->num_allocs, 1, __ATOMIC_RELAXED);
        return MS_OK;
    }
    const int64_t n = (int64_t)nbytes;
    int64_t used = __atomic_load_n(&ctx->bytes_in_use, __ATOMIC_RELAXED);
    do {
        if (ctx->mem_limit > 0 && n > ctx->mem_limit - used)
            return MS_FAIL(ctx, MS_E_OOM, "out of memory on %s: %zu bytes requested, %lld in use, limit %lld",
                           ctx->name, nbytes, (long long)used, (long long)ctx->mem_limit);
    } while (!__atomic_compare_exchange_n(&ctx->bytes_in_use, &used, used + n, true, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED));
    ms_status st = ctx->backend->alloc(ctx, nbytes, out);
    if (st != MS_OK) {
        __atomic_fetch_sub(&ctx->bytes_in_use, n, __ATOMIC_RELAXED);
        return st;
    }
    int64_t peak = __atomic_load_n(&ctx->peak_bytes, __ATOMIC_RELAXED);
    while (used + n > peak && !__atomic_compare_exchange_n(&ctx->peak_bytes, &peak, used + n, true,
                                                           __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    __atomic_fetch_add(&ctx->num_allocs, 1, __ATOMIC_RELAXED);
    return MS_OK;
}

void ms_ctx_dealloc(ms_ctx *ctx, void *ptr, size_t nbytes)
{
    if (ptr != NULL) ctx->backend->free(ctx, ptr, nbytes);
    __atomic_fetch_sub(&ctx->bytes_in_use, (int64_t)nbytes, __ATOMIC_RELAXED);
    __atomic_fetch_add(&ctx->num_frees, 1, __ATOMIC_RELAXED);
}

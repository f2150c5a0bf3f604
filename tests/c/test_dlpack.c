/*
** DLPack import and export through the C ABI: field mapping (device, dtype, shape, strides), zero-copy
** round trips, ownership (the producer's deleter runs exactly once, after the last view; exported memory
** outlives its tensors), and the refusals (device, dtype, lanes, strides, dims).  CPU tensors always; CUDA
** tensors too where a GPU is present.
*/
#include <dlpack/dlpack.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "moonstep.h"

static int contains(const char *s, const char *sub) { return s && strstr(s, sub) != NULL; }

/* --- a producer with a counting deleter ------------------------------------------------------------ */

typedef struct producer {
    DLManagedTensor m;
    int64_t shape[8], strides[8];
    int *deleted;
} producer;

static void producer_deleter(DLManagedTensor *m)
{
    producer *p = (producer *)m;
    (*p->deleted)++;
}

/* p is filled in place: its DLTensor points into it */
static void make_producer(producer *pp, void *data, DLDeviceType dev, int id, DLDataType dt, int ndim,
                          const int64_t *shape, const int64_t *strides, uint64_t byte_offset, int *deleted)
{
    memset(pp, 0, sizeof *pp);
    pp->m.dl_tensor.data = data;
    pp->m.dl_tensor.device = (DLDevice){ dev, id };
    pp->m.dl_tensor.ndim = ndim;
    pp->m.dl_tensor.dtype = dt;
    memcpy(pp->shape, shape, sizeof(int64_t) * (size_t)ndim);
    pp->m.dl_tensor.shape = pp->shape;
    if (strides) {
        memcpy(pp->strides, strides, sizeof(int64_t) * (size_t)ndim);
        pp->m.dl_tensor.strides = pp->strides;
    }
    pp->m.dl_tensor.byte_offset = byte_offset;
    pp->m.manager_ctx = NULL;   /* the deleter finds the producer from m itself */
    pp->m.deleter = producer_deleter;
    pp->deleted = deleted;
}

/* --- tests ----------------------------------------------------------------------------------------- */

static void test_import_cpu(void)
{
    ms_ctx *ctx;
    CHECK(ms_ctx_new("cpu", NULL, &ctx) == MS_OK, "cpu context");
    double buf[8];
    for (int i = 0; i < 8; i++) buf[i] = 10.0 + i;
    int deleted = 0;
    /* [2, 3] f64 starting at element 1 (byte_offset 8), row-major with NULL strides */
    producer p;
    make_producer(&p, buf, kDLCPU, 0, (DLDataType){ kDLFloat, 64, 1 }, 2, (int64_t[]){ 2, 3 }, NULL, 8,
                               &deleted);
    ms_tensor *t = NULL;
    CHECK(ms_tensor_from_dlpack(ctx, &p.m, &t) == MS_OK, "import: %s", ms_last_error());
    CHECK(ms_tensor_data_ptr(t) == (void *)(buf + 1), "no copy: the data pointer is the producer's");
    CHECK(ms_tensor_dtype(t) == MS_DTYPE_F64 && ms_tensor_ndim(t) == 2 && ms_tensor_size(t, 0) == 2 &&
          ms_tensor_size(t, 1) == 3 && ms_tensor_stride(t, 0) == 3 && ms_tensor_stride(t, 1) == 1, "shape, strides");
    CHECK(!ms_tensor_owns_memory(t), "foreign memory");
    double out[6];
    CHECK(ms_tensor_read(ctx, t, out, sizeof out) == MS_OK && out[0] == 11.0 && out[5] == 16.0, "values");

    /* views keep the producer's memory: the deleter runs once, after the last of them */
    ms_tensor *tr = NULL, *row = NULL;
    CHECK(ms_tensor_transpose(ctx, t, 0, 1, &tr) == MS_OK, "transpose");
    CHECK(ms_tensor_select(ctx, t, 0, 1, &row) == MS_OK, "select");
    ms_tensor_free(t);
    CHECK(deleted == 0, "deleter not called while views live (%d)", deleted);
    CHECK(ms_fill(ctx, row, -1.0, NULL) == MS_OK && buf[4] == -1.0 && buf[6] == -1.0 && buf[3] == 13.0,
          "writes through a view reach the producer's memory");
    ms_tensor_free(row);
    CHECK(deleted == 0, "deleter not called while a view lives");
    ms_tensor_free(tr);
    CHECK(deleted == 1, "deleter called exactly once after the last view (%d)", deleted);

    /* explicit strides (a transposed producer) */
    deleted = 0;
    float fb[6] = { 0, 1, 2, 3, 4, 5 };
    producer q;
    make_producer(&q, fb, kDLCPU, 0, (DLDataType){ kDLFloat, 32, 1 }, 2, (int64_t[]){ 3, 2 },
                               (int64_t[]){ 1, 3 }, 0, &deleted);
    CHECK(ms_tensor_from_dlpack(ctx, &q.m, &t) == MS_OK, "strided import: %s", ms_last_error());
    float fo[6];
    CHECK(ms_tensor_read(ctx, t, fo, sizeof fo) == MS_OK && fo[0] == 0 && fo[1] == 3 && fo[2] == 1 && fo[5] == 5,
          "strided values %g %g %g %g", fo[0], fo[1], fo[2], fo[5]);
    CHECK(!ms_tensor_is_contiguous(t), "strides honoured");
    ms_tensor_free(t);
    CHECK(deleted == 1, "deleter once");

    /* refusals: nothing taken, the deleter not called */
    deleted = 0;
    producer bad;
    make_producer(&bad, buf, kDLCUDA, 0, (DLDataType){ kDLFloat, 32, 1 }, 1, (int64_t[]){ 2 }, NULL, 0,
                                 &deleted);
    t = (ms_tensor *)0x1;
    CHECK(ms_tensor_from_dlpack(ctx, &bad.m, &t) == MS_E_DEVICE && t == NULL, "cuda tensor into a cpu context");
    CHECK(contains(ms_last_error(), "managed is on cuda:0") && contains(ms_last_error(), "cpu"), "message: %s",
          ms_last_error());
    make_producer(&bad, buf, kDLCPU, 0, (DLDataType){ kDLComplex, 64, 1 }, 1, (int64_t[]){ 2 }, NULL, 0, &deleted);
    CHECK(ms_tensor_from_dlpack(ctx, &bad.m, &t) == MS_E_DTYPE, "complex refused");
    CHECK(contains(ms_last_error(), "managed's DLPack dtype"), "message: %s", ms_last_error());
    make_producer(&bad, buf, kDLCPU, 0, (DLDataType){ kDLFloat, 32, 4 }, 1, (int64_t[]){ 2 }, NULL, 0, &deleted);
    CHECK(ms_tensor_from_dlpack(ctx, &bad.m, &t) == MS_E_DTYPE, "lanes refused");
    CHECK(contains(ms_last_error(), "4 lanes"), "message: %s", ms_last_error());
    make_producer(&bad, buf, kDLCPU, 0, (DLDataType){ kDLInt, 64, 1 }, 1, (int64_t[]){ 2 }, NULL, 0, &deleted);
    CHECK(ms_tensor_from_dlpack(ctx, &bad.m, &t) == MS_E_DTYPE, "i64 refused");
    make_producer(&bad, buf + 7, kDLCPU, 0, (DLDataType){ kDLFloat, 64, 1 }, 1, (int64_t[]){ 3 }, (int64_t[]){ -1 }, 0,
                        &deleted);
    CHECK(ms_tensor_from_dlpack(ctx, &bad.m, &t) == MS_E_LAYOUT, "negative stride refused");
    /* the message names the call made (it named ms_tensor_wrap, which the caller never called) */
    CHECK(contains(ms_last_error(), "ms_tensor_from_dlpack: managed: negative stride") &&
          contains(ms_ctx_last_error(ctx), "ms_tensor_from_dlpack: managed:") &&
          !contains(ms_last_error(), "ms_tensor_wrap"), "message: %s", ms_last_error());
    make_producer(&bad, buf, kDLCPU, 0, (DLDataType){ kDLFloat, 64, 1 }, 1, (int64_t[]){ 2 }, NULL, 3, &deleted);
    CHECK(ms_tensor_from_dlpack(ctx, &bad.m, &t) == MS_E_LAYOUT, "misaligned byte_offset refused");
    CHECK(contains(ms_last_error(), "ms_tensor_from_dlpack:"), "message: %s", ms_last_error());
    /* a byte_offset that carries data + byte_offset past the end of the address space (here to address 8): the
    ** pointer sum wrapped and the tensor viewed memory that is not the producer's */
    make_producer(&bad, buf, kDLCPU, 0, (DLDataType){ kDLFloat, 64, 1 }, 1, (int64_t[]){ 2 }, NULL,
                  (uint64_t)0 - (uint64_t)(uintptr_t)buf + 8, &deleted);
    t = (ms_tensor *)0x1;
    CHECK(ms_tensor_from_dlpack(ctx, &bad.m, &t) == MS_E_LAYOUT && t == NULL, "byte_offset past the address space");
    CHECK(contains(ms_last_error(), "managed's data") && contains(ms_last_error(), "byte_offset"), "message: %s",
          ms_last_error());
    if (t && t != (ms_tensor *)0x1) { ms_tensor_free(t); deleted = 0; }
    make_producer(&bad, buf, kDLCPU, 0, (DLDataType){ kDLFloat, 64, 1 }, 1, (int64_t[]){ 2 }, NULL, 0, &deleted);
    bad.m.dl_tensor.ndim = 9;
    CHECK(ms_tensor_from_dlpack(ctx, &bad.m, &t) == MS_E_ARG, "9 dims refused");
    CHECK(contains(ms_last_error(), "managed has 9 dims"), "message: %s", ms_last_error());
    bad.m.dl_tensor.ndim = 1;
    bad.m.dl_tensor.shape = NULL;
    CHECK(ms_tensor_from_dlpack(ctx, &bad.m, &t) == MS_E_ARG, "NULL shape refused");
    CHECK(contains(ms_last_error(), "managed's shape is NULL"), "message: %s", ms_last_error());
    CHECK(ms_tensor_from_dlpack(ctx, NULL, &t) == MS_E_ARG, "NULL managed");
    CHECK(ms_tensor_from_dlpack(ctx, &bad.m, NULL) == MS_E_ARG, "NULL out");
    CHECK(deleted == 0, "no deleter on refusal (%d)", deleted);

    /* an empty tensor with no data */
    make_producer(&bad, NULL, kDLCPU, 0, (DLDataType){ kDLFloat, 32, 1 }, 2, (int64_t[]){ 0, 4 }, NULL, 0, &deleted);
    CHECK(ms_tensor_from_dlpack(ctx, &bad.m, &t) == MS_OK && ms_tensor_numel(t) == 0, "empty import");
    ms_tensor_free(t);
    CHECK(deleted == 1, "empty: deleter once");
    ms_ctx_free(ctx);
}

static void test_export(const char *device)
{
    ms_ctx *ctx;
    CHECK(ms_ctx_new(device, NULL, &ctx) == MS_OK, "%s context", device);
    ms_tensor *t = NULL, *tr = NULL;
    int64_t shape[2] = { 3, 4 };
    CHECK(ms_tensor_new(ctx, MS_DTYPE_F32, 2, shape, &t) == MS_OK, "new");
    float vals[12];
    for (int i = 0; i < 12; i++) vals[i] = (float)(i * i) - 7.5f;
    CHECK(ms_tensor_write(ctx, t, vals, sizeof vals) == MS_OK, "write");
    CHECK(ms_tensor_transpose(ctx, t, 0, 1, &tr) == MS_OK, "transpose");
    ms_mem_stats before;
    ms_ctx_mem_stats(ctx, &before);

    void *out = NULL;
    CHECK(ms_tensor_to_dlpack(ctx, tr, &out) == MS_OK && out != NULL, "export: %s", ms_last_error());
    DLManagedTensor *m = out;
    const DLTensor *d = &m->dl_tensor;
    int cuda = strncmp(device, "cuda", 4) == 0;
    CHECK(d->device.device_type == (cuda ? kDLCUDA : kDLCPU) && d->device.device_id == 0, "device %d:%d",
          (int)d->device.device_type, d->device.device_id);
    CHECK(d->dtype.code == kDLFloat && d->dtype.bits == 32 && d->dtype.lanes == 1, "dtype");
    CHECK(d->ndim == 2 && d->shape[0] == 4 && d->shape[1] == 3 && d->strides && d->strides[0] == 1 &&
          d->strides[1] == 4 && d->byte_offset == 0, "shape and strides of the transposed view");
    CHECK(d->data == ms_tensor_data_ptr(tr), "same memory");
    CHECK(m->deleter != NULL, "a deleter for the consumer");

    /* the memory outlives the tensors until the consumer's deleter */
    ms_tensor_free(tr);
    ms_tensor_free(t);
    ms_mem_stats mid;
    ms_ctx_mem_stats(ctx, &mid);
    CHECK(mid.bytes_in_use == before.bytes_in_use, "storage kept alive by the export (%lld, %lld)",
          (long long)mid.bytes_in_use, (long long)before.bytes_in_use);

    /* importing our own export: zero-copy, and its deleter runs when the import goes */
    ms_tensor *back = NULL;
    CHECK(ms_tensor_from_dlpack(ctx, m, &back) == MS_OK, "import of an export: %s", ms_last_error());
    CHECK(ms_tensor_data_ptr(back) == d->data && ms_tensor_stride(back, 0) == 1 && ms_tensor_stride(back, 1) == 4,
          "round trip is zero-copy");
    float got[12];
    CHECK(ms_tensor_read(ctx, back, got, sizeof got) == MS_OK, "read back");
    int ok = 1;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) ok = ok && got[i * 3 + j] == vals[j * 4 + i];
    CHECK(ok, "values of the transposed round trip");
    ms_tensor_free(back);   /* calls our exported deleter: the storage goes */
    ms_mem_stats after;
    ms_ctx_mem_stats(ctx, &after);
    CHECK(after.bytes_in_use == before.bytes_in_use - 48, "storage freed after the deleter (%lld)",
          (long long)after.bytes_in_use);

    /* every dtype maps both ways */
    static const struct { ms_dtype dt; uint8_t code, bits; } map[] = {
        { MS_DTYPE_F32, kDLFloat, 32 }, { MS_DTYPE_F64, kDLFloat, 64 }, { MS_DTYPE_BF16, kDLBfloat, 16 },
        { MS_DTYPE_F16, kDLFloat, 16 }, { MS_DTYPE_I32, kDLInt, 32 }, { MS_DTYPE_U8, kDLUInt, 8 },
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        ms_tensor *x = NULL, *y = NULL;
        int64_t s1[1] = { 5 };
        CHECK(ms_tensor_new(ctx, map[i].dt, 1, s1, &x) == MS_OK, "new %s", ms_dtype_name(map[i].dt));
        CHECK(ms_tensor_to_dlpack(ctx, x, &out) == MS_OK, "export %s", ms_dtype_name(map[i].dt));
        m = out;
        CHECK(m->dl_tensor.dtype.code == map[i].code && m->dl_tensor.dtype.bits == map[i].bits, "dtype %s",
              ms_dtype_name(map[i].dt));
        CHECK(ms_tensor_from_dlpack(ctx, m, &y) == MS_OK && ms_tensor_dtype(y) == map[i].dt, "import %s",
              ms_dtype_name(map[i].dt));
        ms_tensor_free(x);
        ms_tensor_free(y);
    }
    ms_mem_stats end;
    ms_ctx_mem_stats(ctx, &end);
    CHECK(end.bytes_in_use == after.bytes_in_use, "every round trip released its memory");

    CHECK(ms_tensor_to_dlpack(ctx, NULL, &out) == MS_E_ARG, "NULL tensor");
    CHECK(ms_tensor_to_dlpack(ctx, NULL, NULL) == MS_E_ARG, "NULL out");
    ms_ctx_free(ctx);
}

static void test_cross_device(void)
{
    ms_ctx *cpu, *gpu;
    CHECK(ms_ctx_new("cpu", NULL, &cpu) == MS_OK && ms_ctx_new("cuda:0", NULL, &gpu) == MS_OK, "contexts");
    ms_tensor *t = NULL, *u = NULL;
    int64_t s1[1] = { 4 };
    CHECK(ms_tensor_new(gpu, MS_DTYPE_F32, 1, s1, &t) == MS_OK, "cuda tensor");
    void *out = NULL;
    CHECK(ms_tensor_to_dlpack(cpu, t, &out) == MS_E_DEVICE, "export through a context of another device");
    CHECK(ms_tensor_to_dlpack(gpu, t, &out) == MS_OK, "export");
    CHECK(ms_tensor_from_dlpack(cpu, out, &u) == MS_E_DEVICE, "a cuda tensor is refused by a cpu context");
    ((DLManagedTensor *)out)->deleter(out);
    ms_tensor_free(t);
    ms_ctx_free(gpu);
    ms_ctx_free(cpu);
}

int main(void)
{
    test_import_cpu();
    test_export("cpu");
    if (ms_device_count(MS_DEVICE_CUDA) > 0) {
        test_export("cuda:0");
        test_cross_device();
    } else {
        printf("note: no CUDA device, the CUDA DLPack checks run on a GPU host\n");
    }
    return CHECK_REPORT();
}

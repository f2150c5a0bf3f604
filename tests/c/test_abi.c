/*
** The C ABI as a C trainer uses it: contexts, owning and wrapped tensors, views, reference counting,
** memory statistics, and the error protocol (status + last-error message; nothing changed on failure).
*/
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "moonstep.h"

static int contains(const char *s, const char *sub) { return s && strstr(s, sub) != NULL; }

static void test_status_names(void)
{
    const ms_status all[] = { MS_OK, MS_E_ARG, MS_E_SHAPE, MS_E_DTYPE, MS_E_DEVICE, MS_E_OOM, MS_E_NUMERIC,
                              MS_E_IO, MS_E_FORMAT, MS_E_UNSUPPORTED, MS_E_LAYOUT, MS_E_BACKEND };
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        const char *n = ms_status_name(all[i]);
        CHECK(n && strncmp(n, "MS_", 3) == 0 && strcmp(n, "MS_E_UNKNOWN") != 0, "name of status %d: %s", all[i], n);
    }
    CHECK(strcmp(ms_status_name((ms_status)-99), "MS_E_UNKNOWN") == 0, "unknown status name");
    CHECK(ms_abi_version() == MS_ABI_VERSION, "abi %d", ms_abi_version());
    CHECK(strcmp(ms_version(), MS_VERSION_STRING) == 0, "version %s", ms_version());
    CHECK(contains(ms_cdef(), "ms_status ms_tensor_new("), "cdef carries the declarations");
    CHECK(contains(ms_build_info(), "cpu"), "build info: %s", ms_build_info());
}

static void test_contexts(void)
{
    ms_ctx *ctx = (ms_ctx *)0x1;
    CHECK(ms_ctx_new("gpu", NULL, &ctx) == MS_E_ARG && ctx == NULL, "bad device name");
    CHECK(contains(ms_last_error(), "unknown device \"gpu\""), "message: %s", ms_last_error());
    CHECK(ms_ctx_new("cpu", NULL, NULL) == MS_E_ARG, "NULL out");
    ms_status st = ms_ctx_new("cuda:0", NULL, &ctx);
    if (ms_device_count(MS_DEVICE_CUDA) == 0) {
        CHECK(st == MS_E_DEVICE || st == MS_E_UNSUPPORTED, "cuda without a GPU: %s", ms_status_name(st));
        CHECK(contains(ms_last_error(), "cuda:0"), "message names the device: %s", ms_last_error());
    } else {
        CHECK(st == MS_OK, "cuda:0 on a GPU machine");
        ms_ctx_free(ctx);
    }
    ms_ctx_options bad = { .mem_limit = -1 };
    CHECK(ms_ctx_new("cpu", &bad, &ctx) == MS_E_ARG, "negative limit");
    CHECK(ms_ctx_new("cpu", NULL, &ctx) == MS_OK, "cpu context");
    CHECK(ms_ctx_device_type(ctx) == MS_DEVICE_CPU && strcmp(ms_ctx_device_name(ctx), "cpu") == 0, "cpu name");
    CHECK(ms_ctx_sync(ctx) == MS_OK, "sync");
    CHECK(ms_device_count(MS_DEVICE_CPU) == 1, "one cpu");
    ms_ctx_free(ctx);
    ms_ctx_free(NULL);
    ms_tensor_free(NULL);
    ms_tensor_set_free(NULL);
}

static void test_tensors_and_lifetimes(void)
{
    ms_ctx *ctx;
    ms_ctx_options o = { .mem_limit = 1 << 20 };
    CHECK(ms_ctx_new("cpu", &o, &ctx) == MS_OK, "ctx");
    ms_tensor *t = NULL;
    int64_t shape[2] = { 3, 4 };
    CHECK(ms_tensor_new(ctx, MS_DTYPE_F32, 2, shape, &t) == MS_OK, "new");
    CHECK(ms_tensor_ndim(t) == 2 && ms_tensor_size(t, 0) == 3 && ms_tensor_size(t, -1) == 4, "shape");
    CHECK(ms_tensor_stride(t, 0) == 4 && ms_tensor_stride(t, 1) == 1, "strides");
    CHECK(ms_tensor_numel(t) == 12 && ms_tensor_is_contiguous(t) && ms_tensor_owns_memory(t), "props");
    ms_mem_stats st;
    CHECK(ms_ctx_mem_stats(ctx, &st) == MS_OK && st.bytes_in_use == 48 && st.limit == 1 << 20, "stats %lld",
          (long long)st.bytes_in_use);

    /* the context lives on while a tensor uses it */
    ms_ctx_free(ctx);
    CHECK(ms_fill(ms_tensor_ctx(t), t, 2.0, NULL) == MS_OK, "fill after ctx_free");
    float host[12];
    CHECK(ms_tensor_read(ms_tensor_ctx(t), t, host, sizeof host) == MS_OK && host[11] == 2.0f, "read");
    CHECK(ms_tensor_read(ms_tensor_ctx(t), t, host, 4) == MS_E_SHAPE, "read with a wrong size");
    CHECK(contains(ms_last_error(), "4 bytes given") && contains(ms_last_error(), "48 bytes"), "%s", ms_last_error());

    /* a view outlives its source */
    ms_tensor *v = NULL;
    CHECK(ms_tensor_transpose(ms_tensor_ctx(t), t, 0, 1, &v) == MS_OK, "transpose");
    ms_tensor_free(t);
    CHECK(ms_tensor_size(v, 0) == 4 && ms_tensor_stride(v, 0) == 1 && !ms_tensor_is_contiguous(v), "view");
    CHECK(ms_tensor_read(ms_tensor_ctx(v), v, host, sizeof host) == MS_OK && host[0] == 2.0f, "read view");
    ms_tensor_free(v);   /* frees the storage and then the context */
}

static void test_wrap(void)
{
    ms_ctx *ctx;
    CHECK(ms_ctx_new("cpu", NULL, &ctx) == MS_OK, "ctx");
    double *buf = malloc(sizeof(double) * 6);
    for (int i = 0; i < 6; i++) buf[i] = i;
    int64_t shape[2] = { 2, 3 }, strides[2] = { 1, 2 };   /* column-major view of the buffer */
    ms_tensor *w = NULL;
    CHECK(ms_tensor_wrap(ctx, buf, MS_DTYPE_F64, 2, shape, strides, &w) == MS_OK, "wrap");
    CHECK(!ms_tensor_owns_memory(w) && ms_tensor_data_ptr(w) == buf, "foreign");
    double out[6];
    CHECK(ms_tensor_read(ctx, w, out, sizeof out) == MS_OK, "read");
    CHECK(out[0] == 0 && out[1] == 2 && out[2] == 4 && out[3] == 1, "column-major read %g %g %g %g", out[0], out[1],
          out[2], out[3]);
    CHECK(ms_fill(ctx, w, 7, NULL) == MS_OK && buf[5] == 7, "writes go to the caller's memory");
    ms_mem_stats st;
    ms_ctx_mem_stats(ctx, &st);
    CHECK(st.bytes_in_use == 0, "wrapped memory is not accounted: %lld", (long long)st.bytes_in_use);
    ms_tensor_free(w);
    buf[0] = 1;           /* still ours: moonstep did not free it (ASan would report a double free) */
    free(buf);
    int64_t neg[2] = { -1, 1 };
    CHECK(ms_tensor_wrap(ctx, out, MS_DTYPE_F64, 2, shape, neg, &w) == MS_E_LAYOUT && w == NULL, "negative stride");
    CHECK(ms_tensor_wrap(ctx, (char *)out + 1, MS_DTYPE_F64, 2, shape, NULL, &w) == MS_E_LAYOUT, "misaligned");
    CHECK(ms_tensor_wrap(ctx, NULL, MS_DTYPE_F64, 2, shape, NULL, &w) == MS_E_ARG, "NULL pointer");
    CHECK(ms_tensor_wrap(ctx, out, (ms_dtype)42, 2, shape, NULL, &w) == MS_E_DTYPE, "bad dtype");
    /* strides whose reach overflows int64, or whose bytes run past the address space, would make every later
    ** bounds test wrap */
    int64_t wide[2] = { INT64_MAX, 1 }, far[2] = { (int64_t)1 << 60, 1 };
    CHECK(ms_tensor_wrap(ctx, out, MS_DTYPE_F64, 2, shape, wide, &w) == MS_E_LAYOUT && w == NULL &&
          contains(ms_last_error(), "past int64"), "stride past int64: %s", ms_last_error());
    CHECK(ms_tensor_wrap(ctx, out, MS_DTYPE_F64, 2, shape, far, &w) == MS_E_LAYOUT && w == NULL &&
          contains(ms_last_error(), "past the address space"), "stride past the address space: %s", ms_last_error());
    ms_ctx_free(ctx);
}

static void test_errors_change_nothing(void)
{
    ms_ctx *ctx;
    ms_ctx_options o = { .mem_limit = 1000 };
    CHECK(ms_ctx_new("cpu", &o, &ctx) == MS_OK, "ctx");
    int64_t s4[1] = { 4 }, s5[1] = { 5 }, big[1] = { 1000 };
    ms_tensor *a, *b, *c = NULL;
    ms_tensor_new(ctx, MS_DTYPE_F32, 1, s4, &a);
    ms_tensor_new(ctx, MS_DTYPE_F32, 1, s5, &b);
    ms_fill(ctx, a, 1, NULL);
    ms_fill(ctx, b, 2, NULL);
    CHECK(ms_binary(ctx, a, a, b, MS_BINARY_ADD) == MS_E_SHAPE, "shape mismatch");
    CHECK(contains(ms_ctx_last_error(ctx), "does not broadcast") && contains(ms_ctx_last_error(ctx), "[5]"),
          "ctx message: %s", ms_ctx_last_error(ctx));
    float host[4];
    ms_tensor_read(ctx, a, host, sizeof host);
    CHECK(host[0] == 1 && host[3] == 1, "a unchanged");
    CHECK(ms_binary(ctx, a, a, a, (ms_binary_op)99) == MS_E_ARG, "bad op");
    CHECK(ms_tensor_new(ctx, MS_DTYPE_F32, 1, big, &c) == MS_E_OOM && c == NULL, "limit");
    CHECK(contains(ms_last_error(), "out of memory") && contains(ms_last_error(), "limit 1000"), "%s", ms_last_error());
    /* the contract: a message naming the function, on the thread and on the context */
    CHECK(contains(ms_last_error(), "ms_tensor_new:") && contains(ms_ctx_last_error(ctx), "ms_tensor_new:"),
          "OOM message names the function: %s", ms_last_error());
    ms_mem_stats st;
    ms_ctx_mem_stats(ctx, &st);
    CHECK(st.bytes_in_use == 36, "failed allocation left no trace: %lld", (long long)st.bytes_in_use);
    CHECK(ms_binary(NULL, a, a, a, MS_BINARY_ADD) == MS_E_ARG, "NULL ctx");
    CHECK(ms_binary(ctx, a, a, NULL, MS_BINARY_ADD) == MS_E_ARG && contains(ms_last_error(), "b is NULL"), "NULL b");
    ms_tensor *i32;
    ms_tensor_new(ctx, MS_DTYPE_I32, 1, s4, &i32);
    CHECK(ms_rand(ctx, i32, NULL) == MS_E_DTYPE && contains(ms_last_error(), "i32"), "rand needs a float dtype");
    CHECK(ms_matmul(ctx, a, a, i32, NULL) == MS_E_DTYPE, "matmul dtypes");
    ms_tensor_free(i32);
    ms_tensor_free(a);
    ms_tensor_free(b);
    ms_ctx_free(ctx);
}

static void test_huge_allocation(void)
{
    ms_ctx *ctx;
    ms_ctx_new("cpu", NULL, &ctx);
    int64_t huge[2] = { (int64_t)1 << 31, (int64_t)1 << 31 };
    ms_tensor *t = NULL;
    ms_status st = ms_tensor_new(ctx, MS_DTYPE_F64, 2, huge, &t);
    CHECK(st == MS_E_OOM && t == NULL, "2^62 elements: %s", ms_status_name(st));
    int64_t overflow[3] = { (int64_t)1 << 40, (int64_t)1 << 40, 4 };
    CHECK(ms_tensor_new(ctx, MS_DTYPE_F32, 3, overflow, &t) == MS_E_SHAPE, "element count overflow");
    ms_ctx_free(ctx);
}


/* An expanded view may hold more elements than any host buffer: its byte count must not wrap (2^62 f32
** elements are 2^64 bytes, which wrapped to 0, so a read of 0 bytes "succeeded"). */
static void test_transfer_size_overflow(void)
{
    ms_ctx *ctx;
    ms_ctx_new("cpu", NULL, &ctx);
    int64_t one[1] = { 1 }, huge[1] = { (int64_t)1 << 62 };
    ms_tensor *t, *e = NULL;
    ms_tensor_new(ctx, MS_DTYPE_F32, 1, one, &t);
    CHECK(ms_tensor_expand(ctx, t, 1, huge, &e) == MS_OK, "expand to 2^62 elements");
    float x = 0;
    CHECK(ms_tensor_read(ctx, e, &x, 0) == MS_E_SHAPE && contains(ms_last_error(), "ms_tensor_read:"),
          "read of 0 bytes from 2^62 f32 elements: %s", ms_last_error());
    CHECK(ms_tensor_write(ctx, e, &x, 0) != MS_OK && contains(ms_last_error(), "ms_tensor_write:"),
          "write of 0 bytes into 2^62 f32 elements: %s", ms_last_error());
    ms_tensor_free(e);
    ms_tensor_free(t);
    ms_ctx_free(ctx);
}

/* A slice with a huge step keeps one element; its stride was stride * step, which overflowed int64 (UB) and
** came out negative: a stride no tensor may have (ms_tensor_wrap refuses them; DLPack exports it). */
static void test_slice_huge_step(void)
{
    ms_ctx *ctx;
    ms_ctx_new("cpu", NULL, &ctx);
    int64_t shape[2] = { 3, 4 };
    ms_tensor *t, *s = NULL;
    ms_tensor_new(ctx, MS_DTYPE_F32, 2, shape, &t);
    CHECK(ms_tensor_slice(ctx, t, 0, 0, 3, INT64_MAX, &s) == MS_OK && ms_tensor_size(s, 0) == 1, "slice");
    CHECK(ms_tensor_stride(s, 0) >= 0, "stride of the one-element dim: %lld", (long long)ms_tensor_stride(s, 0));
    ms_tensor_free(s);
    CHECK(ms_tensor_slice(ctx, t, 0, 1, 3, INT64_MAX / 2, &s) == MS_OK && ms_tensor_size(s, 0) == 1, "slice from 1");
    CHECK(ms_tensor_stride(s, 0) >= 0, "stride: %lld", (long long)ms_tensor_stride(s, 0));
    ms_tensor_free(s);
    ms_tensor_free(t);
    ms_ctx_free(ctx);
}

/* A uniform range wider than the largest double: b - a is inf, so a + (b - a) u was inf or NaN and every value
** was clamped to the largest value below b -- a call that "succeeded" with no spread at all. */
static void test_rand_range_overflow(void)
{
    ms_ctx *ctx;
    ms_ctx_new("cpu", NULL, &ctx);
    int64_t shape[1] = { 8 };
    ms_tensor *t;
    ms_tensor_new(ctx, MS_DTYPE_F64, 1, shape, &t);
    double before[8] = { 1, 2, 3, 4, 5, 6, 7, 8 }, after[8];
    ms_tensor_write(ctx, t, before, sizeof before);
    ms_rand_options o = { MS_RAND_UNIFORM, -1e308, 1e308, 1, 0 };
    CHECK(ms_rand(ctx, t, &o) == MS_E_ARG && contains(ms_last_error(), "ms_rand:"), "[-1e308, 1e308): %s",
          ms_last_error());
    ms_tensor_read(ctx, t, after, sizeof after);
    CHECK(memcmp(before, after, sizeof before) == 0, "dst unchanged");
    ms_rand_options ok = { MS_RAND_UNIFORM, -1e307, 1e307, 1, 0 };
    CHECK(ms_rand(ctx, t, &ok) == MS_OK, "[-1e307, 1e307)");
    ms_tensor_read(ctx, t, after, sizeof after);
    int spread = 0;
    for (int i = 1; i < 8; i++) spread += after[i] != after[0];
    CHECK(spread > 0, "values spread over the range");
    ms_tensor_free(t);
    ms_ctx_free(ctx);
}

/* Writing an expanded (stride-0) view is refused; the message named ms_copy, the call's internal scatter. */
static void test_write_expanded(void)
{
    ms_ctx *ctx;
    ms_ctx_new("cpu", NULL, &ctx);
    int64_t one[1] = { 1 }, three[1] = { 3 };
    ms_tensor *t, *e;
    ms_tensor_new(ctx, MS_DTYPE_F32, 1, one, &t);
    ms_fill(ctx, t, 5, NULL);
    ms_tensor_expand(ctx, t, 1, three, &e);
    float w[3] = { 1, 2, 3 }, r = 0;
    CHECK(ms_tensor_write(ctx, e, w, sizeof w) == MS_E_LAYOUT && contains(ms_last_error(), "ms_tensor_write:") &&
          contains(ms_ctx_last_error(ctx), "ms_tensor_write:"), "write into an expanded view: %s", ms_last_error());
    ms_tensor_read(ctx, t, &r, sizeof r);
    CHECK(r == 5, "unchanged: %g", r);
    ms_tensor_free(e);
    ms_tensor_free(t);
    ms_ctx_free(ctx);
}

/* A strided transfer stages through a temporary; when that cannot be allocated the message named no call at all
** ("out of memory on cpu: ..."), against the header's rule. */
static void test_staging_oom_names_the_call(void)
{
    ms_ctx *ctx;
    ms_ctx_options o = { .mem_limit = 64 };
    ms_ctx_new("cpu", &o, &ctx);
    int64_t shape[2] = { 4, 4 };
    ms_tensor *t, *tr, *c = NULL;
    ms_tensor_new(ctx, MS_DTYPE_F32, 2, shape, &t);
    ms_tensor_transpose(ctx, t, 0, 1, &tr);
    float host[16] = { 0 };
    CHECK(ms_tensor_read(ctx, tr, host, sizeof host) == MS_E_OOM && contains(ms_last_error(), "ms_tensor_read:") &&
          contains(ms_ctx_last_error(ctx), "ms_tensor_read:"), "read: %s", ms_last_error());
    CHECK(ms_tensor_write(ctx, tr, host, sizeof host) == MS_E_OOM && contains(ms_last_error(), "ms_tensor_write:"),
          "write: %s", ms_last_error());
    CHECK(ms_tensor_contiguous(ctx, tr, &c) == MS_E_OOM && c == NULL && contains(ms_last_error(),
          "ms_tensor_contiguous:"), "contiguous: %s", ms_last_error());
    ms_tensor_free(tr);
    ms_tensor_free(t);
    ms_ctx_free(ctx);
}

/* Ops whose backend allocates scratch (or reports from the backend) recorded the allocator's or the backend's
** message as it was ("out of memory on cpu: ...", "eigh: batch member 0 ..."): no public call named, against the
** header's rule.  Checked on the thread's and the context's message, on ops of each core file. */
static void test_op_errors_name_the_call(void)
{
    ms_ctx *ctx;
    ms_ctx_options o = { .mem_limit = 3 * 64 * 64 * 4 + 64 * 4 };
    CHECK(ms_ctx_new("cpu", &o, &ctx) == MS_OK, "context");
    int64_t sq[2] = { 64, 64 }, vec[1] = { 64 }, s3[3] = { 1, 64, 64 };
    ms_tensor *a, *b, *x, *w, *a3, *x3, *at, *bs;
    ms_tensor_new(ctx, MS_DTYPE_F32, 2, sq, &a);
    ms_tensor_new(ctx, MS_DTYPE_F32, 2, sq, &b);
    ms_tensor_new(ctx, MS_DTYPE_F32, 2, sq, &x);
    ms_tensor_new(ctx, MS_DTYPE_F32, 1, vec, &w);
    ms_eye(ctx, a);
    ms_eye(ctx, b);
    ms_fill(ctx, w, 0, NULL);
    ms_tensor_reshape(ctx, a, 3, s3, &a3);
    ms_tensor_reshape(ctx, x, 3, s3, &x3);
    ms_tensor_slice(ctx, a, 1, 0, 64, 2, &at);   /* [64, 32], column stride 2: BLAS needs a dense copy */
    ms_tensor_slice(ctx, b, 0, 0, 64, 2, &bs);   /* [32, 64], row stride 128 */

    CHECK(ms_eigh(ctx, w, x, a, NULL) == MS_E_OOM && strncmp(ms_last_error(), "ms_eigh: out of memory", 22) == 0 &&
          strncmp(ms_ctx_last_error(ctx), "ms_eigh: ", 9) == 0, "eigh scratch: %s", ms_last_error());
    ms_root_options ro = { .method = MS_ROOT_NDB, .root = 2, .steps = 3, .eps = 1e-3 };
    CHECK(ms_inv_root(ctx, x3, NULL, NULL, a3, &ro) == MS_E_OOM && strncmp(ms_last_error(), "ms_inv_root: ", 13) == 0,
          "inv_root scratch: %s", ms_last_error());
    ms_sinkgd_options so = { .lr = 0.1, .step = 1, .mode = MS_SINKGD_SPECTRAL, .iters = 2, .sn_iters = 1, .eps = 1e-8 };
    const ms_tensor *g = b;
    CHECK(ms_sinkgd_step(ctx, 1, &x, &g, &w, NULL, NULL, &so) == MS_E_OOM &&
          strncmp(ms_last_error(), "ms_sinkgd_step: ", 16) == 0, "sinkgd scratch: %s", ms_last_error());
    ms_matmul_options mo = { .alpha = 1 };
    CHECK(ms_matmul(ctx, x, at, bs, &mo) == MS_E_OOM && strncmp(ms_last_error(), "ms_matmul: ", 11) == 0,
          "matmul copies: %s", ms_last_error());

    ms_tensor *ts[] = { a, b, x, w, a3, x3, at, bs };
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) ms_tensor_free(ts[i]);
    ms_ctx_free(ctx);

    /* a backend's own short name gives way to the public one (not "ms_eigh: eigh: ...") */
    CHECK(ms_ctx_new("cpu", NULL, &ctx) == MS_OK, "context");
    int64_t one[1] = { 1 }, oo[2] = { 1, 1 };
    ms_tensor *w1, *a1;
    ms_tensor_new(ctx, MS_DTYPE_F32, 1, one, &w1);
    ms_tensor_new(ctx, MS_DTYPE_F32, 2, oo, &a1);
    ms_fill(ctx, a1, NAN, NULL);
    int info = 0;
    CHECK(ms_eigh(ctx, w1, NULL, a1, &info) == MS_E_NUMERIC && info == -5 &&
          strncmp(ms_last_error(), "ms_eigh: batch member 0", 23) == 0 &&
          strcmp(ms_last_error(), ms_ctx_last_error(ctx)) == 0, "eigh non-finite: %s", ms_last_error());
    ms_tensor_free(w1);
    ms_tensor_free(a1);
    ms_ctx_free(ctx);
}

/* moonstep.h: tensors may be freed from any thread (garbage-collector finalizers, a trainer's other threads)
** while the context's own thread allocates.  The memory accounting behind mem_limit and ms_ctx_mem_stats must
** not lose updates then: afterwards nothing is in use and every allocation has its free. */
enum { RACE_N = 100000 };

static void *free_all(void *arg)
{
    ms_tensor **ts = arg;
    for (int i = 0; i < RACE_N; i++) ms_tensor_free(ts[i]);
    return NULL;
}

static void test_free_from_another_thread(void)
{
    ms_ctx *ctx = NULL;
    ms_ctx_options o = { .mem_limit = (int64_t)1 << 40 };
    CHECK(ms_ctx_new("cpu", &o, &ctx) == MS_OK, "ctx");
    ms_tensor **ts = calloc(RACE_N, sizeof *ts);
    int made = 0;
    for (int i = 0; i < RACE_N && ts; i++) made += ms_tensor_new(ctx, MS_DTYPE_F32, 1, (int64_t[]){ 4 }, &ts[i]) == MS_OK;
    CHECK(made == RACE_N, "%d tensors made", made);
    pthread_t th;
    int started = made == RACE_N && pthread_create(&th, NULL, free_all, ts) == 0;
    CHECK(started, "thread started");
    int ok = 1;
    for (int i = 0; i < RACE_N && started; i++) {   /* meanwhile this thread allocates and frees */
        ms_tensor *t = NULL;
        ok &= ms_tensor_new(ctx, MS_DTYPE_F32, 1, (int64_t[]){ 4 }, &t) == MS_OK;
        ms_tensor_free(t);
    }
    if (started) pthread_join(th, NULL);
    CHECK(ok, "allocations while another thread frees");
    ms_mem_stats st;
    CHECK(ms_ctx_mem_stats(ctx, &st) == MS_OK, "stats");
    CHECK(st.bytes_in_use == 0, "bytes_in_use %lld after every tensor was freed (lost updates)",
          (long long)st.bytes_in_use);
    CHECK(st.num_allocs == st.num_frees && st.num_allocs == 2 * RACE_N, "num_allocs %lld, num_frees %lld, want %d",
          (long long)st.num_allocs, (long long)st.num_frees, 2 * RACE_N);
    free(ts);
    ms_ctx_free(ctx);
}

/* A failed constructor leaves NULL in *out, whatever was there (ms_comm_new and ms_comm_new_from_env left it as
** it was: a caller freeing *out after a failure freed whatever it held). */
static void test_comm_new_clears_out(void)
{
    ms_ctx *ctx;
    CHECK(ms_ctx_new("cpu", NULL, &ctx) == MS_OK, "ctx");
    ms_comm *stale = (ms_comm *)&ctx;   /* never dereferenced: only compared */
    ms_comm *c = stale;
    CHECK(ms_comm_new(NULL, NULL, &c) == MS_E_ARG && c == NULL, "NULL ctx: %p", (void *)c);
    c = stale;
    ms_comm_options zero_world = { .rank = 0, .world_size = 0 };
    CHECK(ms_comm_new(ctx, &zero_world, &c) == MS_E_ARG && c == NULL, "world_size 0: %p", (void *)c);
    c = stale;
    ms_comm_options bad_rank = { .rank = 3, .world_size = 2 };
    CHECK(ms_comm_new(ctx, &bad_rank, &c) == MS_E_ARG && c == NULL, "rank 3 of 2: %p", (void *)c);
    c = stale;
    CHECK(ms_comm_new_from_env(NULL, 0, &c) == MS_E_ARG && c == NULL, "from_env, NULL ctx: %p", (void *)c);
    const char *rank = getenv("RANK");
    char *saved = rank ? strdup(rank) : NULL;
    unsetenv("RANK");
    c = stale;
    CHECK(ms_comm_new_from_env(ctx, 0, &c) == MS_E_ARG && c == NULL && contains(ms_last_error(), "RANK"),
          "from_env, RANK unset: %p %s", (void *)c, ms_last_error());
    setenv("RANK", "x", 1);
    c = stale;
    CHECK(ms_comm_new_from_env(ctx, 0, &c) == MS_E_ARG && c == NULL, "from_env, RANK=x: %p", (void *)c);
    if (saved) setenv("RANK", saved, 1); else unsetenv("RANK");
    free(saved);
    /* and a success still hands one back */
    ms_comm_options one = { .rank = 0, .world_size = 1 };
    c = NULL;
    CHECK(ms_comm_new(ctx, &one, &c) == MS_OK && c != NULL, "world of one: %s", ms_last_error());
    ms_comm_free(c);
    ms_ctx_free(ctx);
}

/* ms_matmul's host coefficients: a NaN or infinite alpha or beta is refused, named with its value, and dst is
** left as it was (they were taken, and dst came back NaN or inf). */
static void test_matmul_nonfinite_coefficients(void)
{
    ms_ctx *ctx;
    CHECK(ms_ctx_new("cpu", NULL, &ctx) == MS_OK, "ctx");
    int64_t s22[2] = { 2, 2 };
    ms_tensor *a, *dst;
    ms_tensor_new(ctx, MS_DTYPE_F32, 2, s22, &a);
    ms_tensor_new(ctx, MS_DTYPE_F32, 2, s22, &dst);
    ms_fill(ctx, a, 1, NULL);
    const struct { const char *name, *value; double alpha, beta; } cases[] = {
        { "alpha", "nan", NAN, 0 }, { "alpha", "inf", INFINITY, 1 }, { "alpha", "-inf", -INFINITY, 0 },
        { "beta", "nan", 1, NAN }, { "beta", "inf", 1, INFINITY }, { "beta", "-inf", 2, -INFINITY },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ms_fill(ctx, dst, 7, NULL);
        ms_matmul_options o = { .alpha = cases[i].alpha, .beta = cases[i].beta };
        ms_status st = ms_matmul(ctx, dst, a, a, &o);
        char want[64];
        snprintf(want, sizeof want, "ms_matmul: %s = %s", cases[i].name, cases[i].value);
        CHECK(st == MS_E_ARG && contains(ms_last_error(), want) && contains(ms_last_error(), "finite"),
              "%s = %s: %s %s", cases[i].name, cases[i].value, ms_status_name(st), ms_last_error());
        float host[4];
        ms_tensor_read(ctx, dst, host, sizeof host);
        CHECK(host[0] == 7 && host[3] == 7, "%s = %s: dst unchanged (%g)", cases[i].name, cases[i].value, host[0]);
    }
    /* finite ones still run: 3 * (1 1; 1 1)^2 + 0.5 * 7 = 9.5 */
    ms_fill(ctx, dst, 7, NULL);
    ms_matmul_options ok = { .alpha = 3, .beta = 0.5 };
    float host[4];
    CHECK(ms_matmul(ctx, dst, a, a, &ok) == MS_OK && ms_tensor_read(ctx, dst, host, sizeof host) == MS_OK &&
          host[0] == 9.5f, "alpha 3, beta 0.5: %g %s", host[0], ms_last_error());
    ms_tensor_free(a);
    ms_tensor_free(dst);
    ms_ctx_free(ctx);
}

/* The views' and constructors' codes follow moonstep.h's definitions: a dim, index, step or ndim out of range is
** MS_E_ARG; a shape (sizes) that is malformed or that the tensor does not fit is MS_E_SHAPE (ms_tensor_new took a
** negative size as MS_E_ARG where reshape said MS_E_SHAPE, and expand an ndim past MS_MAX_DIMS as MS_E_SHAPE where
** reshape said MS_E_ARG). */
static void test_view_error_codes(void)
{
    ms_ctx *ctx;
    CHECK(ms_ctx_new("cpu", NULL, &ctx) == MS_OK, "ctx");
    int64_t s23[2] = { 2, 3 }, neg[2] = { 2, -3 }, two_infer[2] = { -1, -1 }, s5[1] = { 5 }, s9[9] = { 1 };
    float buf[6];
    ms_tensor *t = NULL, *v = NULL;
    CHECK(ms_tensor_new(ctx, MS_DTYPE_F32, 2, neg, &v) == MS_E_SHAPE && v == NULL, "new: negative size: %s",
          ms_last_error());
    CHECK(ms_tensor_wrap(ctx, buf, MS_DTYPE_F32, 2, neg, NULL, &v) == MS_E_SHAPE, "wrap: negative size: %s",
          ms_last_error());
    CHECK(ms_tensor_new(ctx, MS_DTYPE_F32, 9, s9, &v) == MS_E_ARG, "new: 9 dims");
    CHECK(ms_tensor_new(ctx, MS_DTYPE_F32, 2, s23, &t) == MS_OK, "t");
    /* shapes */
    CHECK(ms_tensor_reshape(ctx, t, 2, neg, &v) == MS_E_SHAPE, "reshape: negative size");
    CHECK(ms_tensor_reshape(ctx, t, 2, two_infer, &v) == MS_E_SHAPE, "reshape: two -1");
    CHECK(ms_tensor_reshape(ctx, t, 1, s5, &v) == MS_E_SHAPE, "reshape: 5 elements for 6");
    CHECK(ms_tensor_expand(ctx, t, 1, s5, &v) == MS_E_SHAPE, "expand: fewer dims");
    CHECK(ms_tensor_expand(ctx, t, 2, neg, &v) == MS_E_SHAPE, "expand: a size changed");
    /* dims, indices, steps, ndim */
    CHECK(ms_tensor_reshape(ctx, t, 9, s9, &v) == MS_E_ARG, "reshape: 9 dims");
    ms_status st = ms_tensor_expand(ctx, t, 9, s9, &v);
    CHECK(st == MS_E_ARG && contains(ms_last_error(), "ndim 9 out of range"), "expand: 9 dims: %s %s",
          ms_status_name(st), ms_last_error());
    st = ms_tensor_expand(ctx, t, 2, NULL, &v);
    CHECK(st == MS_E_ARG && contains(ms_last_error(), "shape is NULL"), "expand: NULL shape: %s %s", ms_status_name(st),
          ms_last_error());
    CHECK(ms_tensor_select(ctx, t, 0, 2, &v) == MS_E_ARG && v == NULL, "select: index 2 of 2");
    CHECK(ms_tensor_select(ctx, t, 2, 0, &v) == MS_E_ARG, "select: dim 2 of a 2-dim tensor");
    CHECK(ms_tensor_slice(ctx, t, -3, 0, 1, 1, &v) == MS_E_ARG, "slice: dim -3 of a 2-dim tensor");
    CHECK(ms_tensor_slice(ctx, t, 0, 0, 1, 0, &v) == MS_E_ARG, "slice: step 0");
    CHECK(ms_tensor_transpose(ctx, t, 0, 2, &v) == MS_E_ARG, "transpose: dim 2");
    ms_tensor_free(t);
    ms_ctx_free(ctx);
}

int main(void)
{
    test_status_names();
    test_contexts();
    test_tensors_and_lifetimes();
    test_wrap();
    test_errors_change_nothing();
    test_huge_allocation();
    test_transfer_size_overflow();
    test_slice_huge_step();
    test_rand_range_overflow();
    test_write_expanded();
    test_staging_oom_names_the_call();
    test_op_errors_name_the_call();
    test_free_from_another_thread();
    test_comm_new_clears_out();
    test_matmul_nonfinite_coefficients();
    test_view_error_codes();
    return CHECK_REPORT();
}

/*
** moonstep.h -- the whole public C ABI of the moonstep optimizer engine.
**
** moonstep is an embeddable optimizer engine: a C engine owns tensors, fused kernels and solver
** primitives; LuaJIT drives it through FFI (the Lua cdef is generated from this header at build time);
** optimizer policies are Lua "recipes".  Everything a trainer or the Lua side may call is declared here,
** and nothing else is exported from libmoonstep.
**
** Conventions (every call follows them):
**  - Names are ms_<class>_<action>[_<noun>]; constructors ms_X_new, destructors ms_X_free (NULL is fine).
**    Freeing a handle twice, or using it after its ms_X_free (ms_string_free for strings), is undefined
**    behaviour: a freed handle's memory may already hold another object, so a double free cannot be detected
**    and is not reported.  ms_ctx_free drops one reference: a second call drops one the caller does not hold.
**  - Every fallible call returns ms_status: MS_OK (0) or a negative error class.  On error nothing was
**    changed, and a message naming the function, the problem and the values is kept per context
**    (ms_ctx_last_error) and per thread (ms_last_error).  The engine never exits, aborts or prints.
**  - A call that hands an object or a string back through an out-parameter (ms_X_new, views, ms_graph_end,
**    ms_optimizer_info, ...) sets it to NULL on every error, a NULL context or handle included (unless the
**    out-parameter itself is NULL).
**  - Argument order: context, destination(s), sources, options struct, out-parameters (last).
**  - Objects are opaque handles.  The only structs that cross the boundary are plain option structs,
**    passed by pointer; a NULL options pointer means "all defaults" (documented per struct).
**  - Shapes and strides are int64_t, strides count elements (not bytes), dims are row-major
**    (the last dim varies fastest).  Negative dim arguments count from the end (-1 = last).
**  - Scalars that may change every step (learning rate, step count, weights) are taken both as a double
**    and as an optional 1-element f32 tensor on the context's device (the "_t" argument): when the tensor
**    is given its value is read on the device at execution time and the double is ignored, so a captured
**    sequence replays with new values.  Pass NULL to use the double.
**  - A context is not thread-safe: use one context per thread, or serialise calls on it.
*/
#ifndef MOONSTEP_H
#define MOONSTEP_H

#ifndef MS_CDEF_GEN          /* the Lua cdef generator preprocesses this header without system headers */
#include <stddef.h>
#include <stdint.h>
#endif

#if defined(MS_CDEF_GEN)
#define MS_API
#elif defined(MS_BUILDING_LIBRARY)
#define MS_API __attribute__((visibility("default")))
#else
#define MS_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Incremented on every incompatible change of this header; the Lua side refuses a library whose
** ms_abi_version() differs from the MS_ABI_VERSION its cdef was generated from. */
#define MS_ABI_VERSION 2
#define MS_VERSION_STRING "0.1.0"
enum { MS_ABI = MS_ABI_VERSION };    /* the same number as an enum, so that the generated cdef carries it */

/* ---------------------------------------------------------------------------------------------------
** Status codes and errors
** ------------------------------------------------------------------------------------------------- */

typedef enum ms_status {
    MS_OK            =  0,
    MS_E_ARG         = -1,   /* invalid argument: NULL where an object is needed, bad enum value, a value out of
                             ** its range, an index out of range: a dim or an element index outside the tensor
                             ** (select, slice, transpose, ms_reduce's dim), an ndim outside [0, MS_MAX_DIMS] */
    MS_E_SHAPE       = -2,   /* a shape (a list of sizes) that is malformed or does not fit: a negative size, more
                             ** elements than int64 holds, sizes that do not hold the tensor's elements (reshape)
                             ** or cannot be broadcast to or from (expand, ops), tensors whose shapes differ */
    MS_E_DTYPE       = -3,   /* a dtype the call does not accept, or dtypes that must match and do not */
    MS_E_DEVICE      = -4,   /* a device that does not exist, or tensors on devices that cannot be mixed */
    MS_E_OOM         = -5,   /* allocation failed, or the context's memory limit would be exceeded */
    MS_E_NUMERIC     = -6,   /* a numerical failure (solver did not converge, ...); see the message */
    MS_E_IO          = -7,   /* the operating system refused a file operation */
    MS_E_FORMAT      = -8,   /* corrupt, truncated or malformed input data (files, JSON) */
    MS_E_UNSUPPORTED = -9,   /* valid request this build or backend does not implement */
    MS_E_LAYOUT      = -10,  /* a tensor's memory layout does not allow the operation (non-contiguous ...) */
    MS_E_BACKEND     = -11   /* a device library (CUDA driver, cuBLAS, cuSOLVER) reported an error */
} ms_status;

/* The status code's name, e.g. "MS_E_SHAPE".  Never NULL. */
MS_API const char *ms_status_name(ms_status s);

/* The last error message raised on this thread, or "" when none.  Valid until the next failing call. */
MS_API const char *ms_last_error(void);

/* ---------------------------------------------------------------------------------------------------
** Version
** ------------------------------------------------------------------------------------------------- */

MS_API int ms_abi_version(void);            /* MS_ABI_VERSION of the library that was loaded */
MS_API const char *ms_version(void);        /* "0.1.0" */
/* The generated LuaJIT cdef of this header (what the Lua binding feeds to ffi.cdef). */
MS_API const char *ms_cdef(void);
/* A short description of the build: backends compiled in, BLAS, compiler.  Never NULL. */
MS_API const char *ms_build_info(void);
/* Seconds on the host's monotonic clock, from an arbitrary start: the Lua side's timer (a double, so that a
** call from LuaJIT allocates nothing, and no libc declaration of its own that a user's script could clash with). */
MS_API double ms_clock(void);

/* ---------------------------------------------------------------------------------------------------
** Data types
** ------------------------------------------------------------------------------------------------- */

typedef enum ms_dtype {
    MS_DTYPE_F32  = 0,
    MS_DTYPE_F64  = 1,
    MS_DTYPE_BF16 = 2,   /* bfloat16 storage; computed in f32, rounded to nearest even when stored */
    MS_DTYPE_F16  = 3,   /* IEEE half storage; computed in f32, rounded to nearest even when stored */
    MS_DTYPE_I32  = 4,
    MS_DTYPE_U8   = 5,
    MS_DTYPE_COUNT
} ms_dtype;

MS_API size_t ms_dtype_size(ms_dtype dt);        /* bytes per element; 0 for an invalid dtype */
MS_API const char *ms_dtype_name(ms_dtype dt);   /* "f32", "bf16", ...; "invalid" otherwise */

/* ---------------------------------------------------------------------------------------------------
** Contexts
**
** A context owns a device, a stream (CUDA), library handles and the memory accounting of the tensors
** allocated through it.  Tensors keep their context alive: ms_ctx_free only drops the caller's
** reference, the context is destroyed with its last tensor.
** ------------------------------------------------------------------------------------------------- */

typedef struct ms_ctx ms_ctx;

typedef enum ms_device_type {
    MS_DEVICE_CPU  = 0,
    MS_DEVICE_CUDA = 1
} ms_device_type;

enum { MS_MAX_THREADS = 4096 };   /* the most OpenMP threads a context takes */

typedef struct ms_ctx_options {
    int64_t mem_limit;     /* bytes the context may hold allocated at once; 0 = no limit */
    void   *stream;        /* CUDA: a cudaStream_t owned by the caller to run on; NULL = the context's own */
    int     num_threads;   /* CPU: OpenMP threads for this context's ops; 0 = the OpenMP default; at most
                           ** MS_MAX_THREADS */
} ms_ctx_options;

/* Creates a context on `device`: "cpu", "cuda", "cuda:N", or "auto" (the first GPU when one is present and
** the build has CUDA, else the CPU; NULL means "auto").  opts may be NULL.
** Errors: MS_E_ARG (unparsable device string, out NULL, a negative mem_limit or num_threads (or one past
** MS_MAX_THREADS), a stream for a
** CPU context), MS_E_UNSUPPORTED (backend not compiled in),
** MS_E_DEVICE (no such device, or no usable driver). */
MS_API ms_status ms_ctx_new(const char *device, const ms_ctx_options *opts, ms_ctx **out);
MS_API void ms_ctx_free(ms_ctx *ctx);

MS_API ms_device_type ms_ctx_device_type(const ms_ctx *ctx);
MS_API int ms_ctx_device_index(const ms_ctx *ctx);          /* 0 for the CPU */
MS_API const char *ms_ctx_device_name(const ms_ctx *ctx);   /* "cpu", "cuda:0", ... */

/* The last error raised through this context, or "" when none. */
MS_API const char *ms_ctx_last_error(const ms_ctx *ctx);

/* Waits until all work queued on the context has finished (a no-op on the CPU). */
MS_API ms_status ms_ctx_sync(ms_ctx *ctx);

/* Number of devices of a type usable by this build and machine (CPU: 1; CUDA: 0 without GPU or driver). */
MS_API int ms_device_count(ms_device_type type);

typedef struct ms_mem_stats {
    int64_t bytes_in_use;    /* bytes held by live tensors of this context */
    int64_t peak_bytes;      /* highest bytes_in_use so far */
    int64_t bytes_cached;    /* bytes kept by the context's pool for reuse (CUDA) */
    int64_t limit;           /* the mem_limit option, 0 = none */
    int64_t num_allocs;      /* allocations served, since creation */
    int64_t num_frees;       /* frees, since creation */
    int64_t num_device_allocs; /* allocations that reached the system or driver allocator */
    int64_t launches;        /* kernels or backend operations launched on this context, since creation */
} ms_mem_stats;

MS_API ms_status ms_ctx_mem_stats(const ms_ctx *ctx, ms_mem_stats *out);

/* ---------------------------------------------------------------------------------------------------
** Tensors
**
** A tensor is a dtype, a shape of up to MS_MAX_DIMS dims, strides (in elements) and a pointer into a
** storage.  Storage is either owned (allocated through the context, freed with its last tensor) or
** foreign (wrapped; never freed by moonstep; the caller keeps it alive while tensors use it).
** Views share storage with their source; each view is its own handle and must be freed.
** A 0-dim tensor (ndim 0) holds one element.
** ------------------------------------------------------------------------------------------------- */

enum { MS_MAX_DIMS = 8 };

typedef struct ms_tensor ms_tensor;

/* A new contiguous tensor with uninitialised contents on ctx's device.
** Errors: MS_E_ARG (ndim out of [0, MS_MAX_DIMS], shape NULL), MS_E_SHAPE (a negative size, more elements than
** int64 holds), MS_E_DTYPE, MS_E_OOM. */
MS_API ms_status ms_tensor_new(ms_ctx *ctx, ms_dtype dt, int ndim, const int64_t *shape, ms_tensor **out);

/* Wraps foreign memory on ctx's device without copying; moonstep never frees it.  strides may be NULL
** (contiguous).  Negative strides are refused (MS_E_LAYOUT). */
MS_API ms_status ms_tensor_wrap(ms_ctx *ctx, void *ptr, ms_dtype dt, int ndim, const int64_t *shape,
                                const int64_t *strides, ms_tensor **out);

MS_API void ms_tensor_free(ms_tensor *t);

MS_API ms_dtype ms_tensor_dtype(const ms_tensor *t);
MS_API int ms_tensor_ndim(const ms_tensor *t);
MS_API int64_t ms_tensor_size(const ms_tensor *t, int dim);    /* -1 when dim is out of range */
MS_API int64_t ms_tensor_stride(const ms_tensor *t, int dim);  /* 0 when dim is out of range */
MS_API int64_t ms_tensor_numel(const ms_tensor *t);
MS_API int ms_tensor_is_contiguous(const ms_tensor *t);
MS_API int ms_tensor_owns_memory(const ms_tensor *t);          /* 0 for wrapped foreign memory */
/* The context the tensor was created in (not a new reference). */
MS_API ms_ctx *ms_tensor_ctx(const ms_tensor *t);
/* Address of the first element (device memory for CUDA tensors).  For C hosts; never given to recipes. */
MS_API void *ms_tensor_data_ptr(const ms_tensor *t);
/* Nonzero when a and b may share memory (same storage with overlapping element ranges). */
MS_API int ms_tensor_overlaps(const ms_tensor *a, const ms_tensor *b);
/* Nonzero when no two of t's elements share an address, as every op that writes t requires (an expanded view,
** stride 0, is not writable; 0 for NULL). */
MS_API int ms_tensor_is_writable(const ms_tensor *t);

/* Views (no copy).  reshape needs a layout the new shape can be viewed in (MS_E_LAYOUT otherwise: call
** ms_tensor_contiguous first); one size may be -1 (inferred).  slice keeps [start, stop) with step >= 1
** (start/stop are clamped like Python slices; negative values count from the end).  select removes dim.
** expand broadcasts dims of size 1 to larger sizes with stride 0 (and may add leading dims).
** Errors (as MS_E_ARG and MS_E_SHAPE are defined above): a dim or index outside src, a step below 1, an ndim
** outside [0, MS_MAX_DIMS] or a NULL shape is MS_E_ARG; a shape that is malformed (negative sizes, two -1) or
** that src does not fit (reshape: other element count; expand: fewer dims, or a size other than 1 changed) is
** MS_E_SHAPE. */
MS_API ms_status ms_tensor_reshape(ms_ctx *ctx, const ms_tensor *src, int ndim, const int64_t *shape,
                                   ms_tensor **out);
MS_API ms_status ms_tensor_slice(ms_ctx *ctx, const ms_tensor *src, int dim, int64_t start, int64_t stop,
                                 int64_t step, ms_tensor **out);
MS_API ms_status ms_tensor_select(ms_ctx *ctx, const ms_tensor *src, int dim, int64_t index, ms_tensor **out);
MS_API ms_status ms_tensor_transpose(ms_ctx *ctx, const ms_tensor *src, int dim0, int dim1, ms_tensor **out);
MS_API ms_status ms_tensor_permute(ms_ctx *ctx, const ms_tensor *src, int ndim, const int *perm,
                                   ms_tensor **out);
MS_API ms_status ms_tensor_expand(ms_ctx *ctx, const ms_tensor *src, int ndim, const int64_t *shape,
                                  ms_tensor **out);
/* A contiguous tensor with src's contents: a new view of src itself when it is already contiguous,
** otherwise a new owning copy. */
MS_API ms_status ms_tensor_contiguous(ms_ctx *ctx, const ms_tensor *src, ms_tensor **out);

/* Host transfer: nbytes must equal numel * dtype size; host memory is row-major contiguous in the tensor's
** dtype.  Works for any layout and device (synchronous). */
MS_API ms_status ms_tensor_read(ms_ctx *ctx, const ms_tensor *src, void *host_dst, size_t nbytes);
MS_API ms_status ms_tensor_write(ms_ctx *ctx, ms_tensor *dst, const void *host_src, size_t nbytes);

/* ---------------------------------------------------------------------------------------------------
** Ops
**
** Every op writes into a caller-provided destination of the right shape and returns MS_E_SHAPE
** otherwise.  Elementwise ops broadcast their sources to dst's shape (NumPy rules), accept any dtype for
** dst and sources, i32 and u8 included (computed in f64 when any of them is f64 or i32, otherwise in f32;
** bf16/f16 stored with round-to-nearest-even, i32/u8 stored as ms_copy casts), and may run in place (dst
** the same view as a source).  Scalars (value, s, w, v, or the device scalars value_t, s_t, w_t, v_t,
** whatever their float dtype; one element, else MS_E_SHAPE; an i32/u8 one is MS_E_DTYPE) take the
** computation's precision: with f32 tensors an f64 scalar is rounded to f32 first.  A dst that partially
** overlaps a source, shares memory with a device scalar (unless dst is that scalar's own one-element view),
** or could reach one address from two elements (stride-0 dims of an expanded view, or strides that do not
** nest: taken by increasing stride, each must pass the span of the dims before it) is refused (MS_E_LAYOUT);
** so is such a tensor wherever a call writes one (ms_tensor_write, the multi-tensor steps, blocks_apply).
** All tensors of one call must live on ctx's device (MS_E_DEVICE), except in ms_copy.
** ------------------------------------------------------------------------------------------------- */

/* dst <- src, converting dtype (cast) and broadcasting src to dst's shape; src and dst may be on
** different devices (host <-> device copies go through ms_copy too).  Casts: f64 -> bf16/f16 rounds through
** f32 (as torch does); float -> i32/u8 truncates toward zero and saturates at the type's range, NaN -> 0. */
MS_API ms_status ms_copy(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src);

/* dst <- value (or *value_t). */
MS_API ms_status ms_fill(ms_ctx *ctx, ms_tensor *dst, double value, const ms_tensor *value_t);

typedef enum ms_rand_dist {
    MS_RAND_UNIFORM = 0,   /* uniform on [a, b) */
    MS_RAND_NORMAL  = 1    /* normal with mean a and standard deviation b */
} ms_rand_dist;

typedef struct ms_rand_options {
    ms_rand_dist dist;
    double   a, b;         /* uniform: [a, b); normal: mean, std.  NULL options: uniform [0, 1) */
    uint64_t seed;         /* Philox key */
    uint64_t offset;       /* Philox stream: calls with distinct offsets give independent numbers */
} ms_rand_options;

/* Counter-based random numbers (Philox-4x32-10).  Element i (in row-major order of dst) is computed from
** counter (i, offset) and key seed alone, so results do not depend on the backend, thread count or layout:
**   words w0..w3 = philox(counter = {lo(i), hi(i), lo(offset), hi(offset)}, key = {lo(seed), hi(seed)})
**   uniform f32/bf16/f16: u = (w0 >> 8) * 2^-24;  f64: u = ((w0 >> 5) * 2^26 + (w1 >> 6)) * 2^-53
**   normal: Box-Muller, u1 = ((w0 >> 8) + 1) * 2^-24, u2 = (w2 >> 8) * 2^-24 (f64: 53-bit forms of
**   w0,w1 and w2,w3), z = sqrt(-2 ln u1) cos(2 pi u2).
** The value a + (b - a) u (uniform) or a + b z (normal) is computed in f64 and rounded once to dst's dtype;
** a uniform value that rounds up to b is stored as the largest value below b, and one that rounds below a as
** the smallest value at or above a, so [a, b) holds in bf16 too; a == b fills a (as b = 0 does for normal).
** Float dtypes only (MS_E_DTYPE).  MS_E_ARG: an unknown dist, a non-finite a or b, a > b (uniform), a range
** wider than the largest double or holding no value of dst's dtype, a negative std. */
MS_API ms_status ms_rand(ms_ctx *ctx, ms_tensor *dst, const ms_rand_options *opts);

typedef enum ms_unary_op {
    MS_UNARY_NEG = 0, MS_UNARY_ABS, MS_UNARY_SQRT, MS_UNARY_RSQRT, MS_UNARY_EXP, MS_UNARY_LOG,
    MS_UNARY_SIGN, MS_UNARY_SQUARE, MS_UNARY_RECIPROCAL, MS_UNARY_TANH, MS_UNARY_SIGMOID, MS_UNARY_RELU,
    MS_UNARY_SIN, MS_UNARY_COS,
    MS_UNARY_COUNT
} ms_unary_op;

/* dst <- op(src).  sign(+-0) = +-0 and sign(NaN) = NaN; relu(NaN) = NaN; sigmoid is computed stably. */
MS_API ms_status ms_unary(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, ms_unary_op op);

typedef enum ms_binary_op {
    MS_BINARY_ADD = 0, MS_BINARY_SUB, MS_BINARY_MUL, MS_BINARY_DIV, MS_BINARY_POW,
    MS_BINARY_MAXIMUM, MS_BINARY_MINIMUM,
    MS_BINARY_EQ, MS_BINARY_NE, MS_BINARY_LT, MS_BINARY_LE, MS_BINARY_GT, MS_BINARY_GE, /* 1 or 0 */
    MS_BINARY_COUNT
} ms_binary_op;

/* dst <- a op b (broadcasting).  maximum/minimum propagate NaN. */
MS_API ms_status ms_binary(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                           ms_binary_op op);

/* dst <- a op s, or s op a when scalar_first is nonzero; s is `s` or *s_t. */
MS_API ms_status ms_binary_scalar(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, double s,
                                  const ms_tensor *s_t, ms_binary_op op, int scalar_first);

/* dst <- min(max(src, lo), hi); use -inf / +inf for an open side.  NaN stays NaN.  A NaN bound or lo > hi is
** refused (MS_E_ARG). */
MS_API ms_status ms_clamp(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, double lo, double hi);

/* dst <- a + w * (b - a). */
MS_API ms_status ms_lerp(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b, double w,
                         const ms_tensor *w_t);

/* dst <- a + v * b * c   and   dst <- a + v * b / c. */
MS_API ms_status ms_addcmul(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                            const ms_tensor *c, double v, const ms_tensor *v_t);
MS_API ms_status ms_addcdiv(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                            const ms_tensor *c, double v, const ms_tensor *v_t);

typedef enum ms_reduce_op {
    MS_REDUCE_SUM = 0, MS_REDUCE_MEAN, MS_REDUCE_MAX, MS_REDUCE_MIN,
    MS_REDUCE_NORM2,     /* sqrt(sum x^2) */
    MS_REDUCE_SUMSQ,     /* sum x^2 */
    MS_REDUCE_AMAX,      /* max |x| */
    MS_REDUCE_COUNT
} ms_reduce_op;

enum { MS_DIM_ALL = -1000 };     /* the `dim` that reduces over every element */

/* Reduces src along `dim` (or over all elements with MS_DIM_ALL).  dst has src's shape with `dim` removed
** or kept as size 1 (one element for MS_DIM_ALL).  src may have any dtype, dst a float one (MS_E_DTYPE);
** dst must not overlap src (MS_E_LAYOUT).  Accumulates in f32 (f64 for f64, i32 and u8 sources) in a
** fixed order: results do not depend on the thread count.  max/min propagate NaN; a reduction over zero
** elements gives 0 for sum/sumsq/norm2, NaN for mean and MS_E_SHAPE for max/min/amax. */
MS_API ms_status ms_reduce(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, ms_reduce_op op, int dim);

/* dst (one element) <- sum(a * b) over all elements; a and b have the same shape (any dtypes; accumulated
** in f64 when either is f64, i32 or u8, else in f32), dst a float dtype that overlaps neither (MS_E_LAYOUT). */
MS_API ms_status ms_dot(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b);

typedef struct ms_matmul_options {
    int    trans_a, trans_b;  /* use the transpose of the last two dims of a / b */
    double alpha, beta;       /* dst <- alpha * op(a) op(b) + beta * dst; NULL options: 1, 0 */
    int    allow_tf32;        /* CUDA f32: TF32 tensor cores allowed (inputs rounded to 10 bits) */
} ms_matmul_options;

/* Batched matrix product.  a: [..., m, k] (or [..., k, m] with trans_a), b: [..., k, n] (or [..., n, k]),
** dst: [..., m, n].  Batch dims broadcast (a 2-D operand is shared by every batch).  dtypes: f32, f64, or
** bf16/f16 inputs (f32 accumulation) with dst of any float dtype; a and b must have the same dtype.
** dst must not overlap a or b.  beta = 0 ignores dst's previous contents (NaN included).  alpha and beta must
** be finite: a NaN or infinite one is refused (MS_E_ARG, naming it and its value) before anything is written. */
MS_API ms_status ms_matmul(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                           const ms_matmul_options *opts);

/* dst [..., n, n] <- identity in every batch (dst may be non-square: ones on the main diagonal). */
MS_API ms_status ms_eye(ms_ctx *ctx, ms_tensor *dst);

/* dst [..., n, n] <- diagonal matrix of src [..., n], or dst [..., n] <- diagonal of src [..., n, n]. */
MS_API ms_status ms_diag(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src);

/* Symmetric eigendecomposition (batched over leading dims) of a [..., n, n] (the lower triangle is used):
** w [..., n] eigenvalues in ascending order, v [..., n, n] eigenvectors in columns (may be NULL for values
** only).  f32 or f64 (all three the same dtype).  A non-converged batch member gives MS_E_NUMERIC, with
** *info (may be NULL) set to the LAPACK/cuSOLVER info of the first failing member, and a message naming it;
** a non-finite entry in the lower triangle is MS_E_NUMERIC with *info = -5 (as LAPACKE's NaN check reports).
** w and v must be contiguous (MS_E_LAYOUT otherwise; a is read in any layout).  w and v are left unchanged on
** any failure. */
MS_API ms_status ms_eigh(ms_ctx *ctx, ms_tensor *w, ms_tensor *v, const ms_tensor *a, int *info);

/* ---------------------------------------------------------------------------------------------------
** Streams and the memory pool (CUDA)
**
** A CUDA context queues all its work, in call order, on one stream: its own (created with the context) or
** the caller's (ms_ctx_options.stream; moonstep never destroys it).  Ops return as soon as their work is
** queued; only calls that hand values to the host wait for it (ms_tensor_read / ms_tensor_write, copies to
** or from CPU tensors, ms_eigh's convergence check, ms_event_elapsed, ms_ctx_sync).  Work of different
** contexts is not ordered: synchronise (ms_ctx_sync) before one context reads what another one wrote.
**
** Device memory comes from the context's stream-ordered caching pool: freed blocks are kept, by size class,
** and handed to later allocations of the same context without calling the driver; the stream's order makes
** that safe.  A block that another context's stream used is reused only after that stream has passed the
** use (an event is recorded at the use).  Freeing a tensor never calls the driver, so tensors may be freed
** from any thread and from garbage-collector finalizers (only a context's own destruction, when its last
** tensor, event or graph goes, waits for its stream and returns its memory to the driver).  When the driver
** is out of memory (or the mem_limit of the context would be passed) the pool first returns its cached
** blocks to the driver and tries again.
** Statistics: ms_ctx_mem_stats (bytes_cached = bytes kept for reuse; num_device_allocs = driver allocations).
** Memory of the cuBLAS / cuSOLVER handles (a 32 MiB workspace) is not counted.
** ------------------------------------------------------------------------------------------------- */

/* The stream ctx's work runs on (a cudaStream_t), NULL for a CPU context. */
MS_API void *ms_ctx_stream(const ms_ctx *ctx);

/* Waits for the context's stream, then returns every cached block to the driver (bytes_cached drops to the
** blocks still kept for live graphs or awaiting another stream).  A no-op on the CPU.
** Errors: MS_E_UNSUPPORTED while the context's stream is captured (ms_graph_begin, or its owner's capture,
** joined or not), MS_E_BACKEND. */
MS_API ms_status ms_ctx_empty_cache(ms_ctx *ctx);

/* ---------------------------------------------------------------------------------------------------
** Events: timestamps in a context's stream order (CPU: the host's monotonic clock when recorded)
** ------------------------------------------------------------------------------------------------- */

typedef struct ms_event ms_event;

MS_API ms_status ms_event_new(ms_ctx *ctx, ms_event **out);
MS_API void ms_event_free(ms_event *ev);
/* Marks the point the context's queued work has reached (re-recording moves the mark).
** Errors: MS_E_UNSUPPORTED while the context's stream is captured (ms_graph_begin, or its owner's capture,
** joined or not: a capture has no such point), MS_E_BACKEND. */
MS_API ms_status ms_event_record(ms_ctx *ctx, ms_event *ev);
/* Milliseconds between two recorded events of the same device, waiting until `end` has been reached.
** Errors: MS_E_ARG (NULL, never recorded), MS_E_DEVICE (events of different devices). */
MS_API ms_status ms_event_elapsed(const ms_event *start, const ms_event *end, double *ms);

/* ---------------------------------------------------------------------------------------------------
** Graphs: capture a sequence of ops on a context and replay it (CUDA)
**
** ms_graph_begin starts capturing the context's stream: the ops called on that context until ms_graph_end
** are recorded, not run; ms_graph_launch queues a replay of the whole sequence on the context's stream.
** Device scalars (the "_t" arguments) are read when a replay runs, so writing new values into them
** (ms_fill, ms_tensor_write, ms_copy) between replays changes the results without re-capturing.
** While a context captures:
**  - Allocations are served only from its pool's cache, never by the driver: run the sequence once before
**    capturing so that its temporaries are cached.  A request the cache cannot serve fails (MS_E_OOM, with
**    a message saying so) instead of being allocated.
**  - Memory freed during the capture, and memory allocated during it (whenever it is freed), is kept for
**    the graph until ms_graph_free, because replays write it.  Tensors created before the capture that the
**    sequence uses must stay alive as long as the graph is launched.
**  - Calls that wait for the device are refused (MS_E_UNSUPPORTED): ms_ctx_sync, ms_ctx_empty_cache, host
**    transfers (ms_tensor_read / ms_tensor_write, copies to or from CPU tensors).  ms_eigh does not check
**    convergence under capture (its results are written whatever the solver's info).
**  - An op that fails poisons the capture: ms_graph_end then fails with that op's message.
** CPU contexts: MS_E_UNSUPPORTED.
** ------------------------------------------------------------------------------------------------- */

typedef struct ms_graph ms_graph;

/* Errors: MS_E_UNSUPPORTED (CPU, already capturing, or the stream is being captured by its owner: joined or not,
** MS_CAPTURE_FOREIGN), MS_E_BACKEND. */
MS_API ms_status ms_graph_begin(ms_ctx *ctx);
/* Ends the capture begun on ctx and hands back the replayable graph (the capture ends even on error). */
MS_API ms_status ms_graph_end(ms_ctx *ctx, ms_graph **out);
/* Queues one replay of g on ctx's stream; ctx must be the context g was captured on (MS_E_ARG). */
MS_API ms_status ms_graph_launch(ms_ctx *ctx, ms_graph *g);
/* Number of operations (graph nodes) captured in g; -1 for NULL. */
MS_API int64_t ms_graph_num_nodes(const ms_graph *g);
/* Frees g; the memory it kept returns to its context's pool (stream-ordered after its replays). */
MS_API void ms_graph_free(ms_graph *g);

/* Who is capturing a context's stream now. */
typedef enum ms_capture {
    MS_CAPTURE_NONE    = 0,   /* nobody (always so on the CPU) */
    MS_CAPTURE_GRAPH   = 1,   /* this context, between ms_graph_begin and ms_graph_end */
    MS_CAPTURE_FOREIGN = 2    /* someone else: the stream's owner captures it into a graph of its own (a
                              ** trainer's torch.cuda.graph on the stream given in ms_ctx_options), or such
                              ** a capture was invalidated by an error and not ended yet */
} ms_capture;

/* Whether ctx's stream is being captured, and by whom (cudaStreamIsCapturing).  Never fails: NULL, a CPU
** context or a failed query give MS_CAPTURE_NONE.  Cheap enough to ask before every step. */
MS_API ms_capture ms_ctx_is_capturing(const ms_ctx *ctx);

/* Working inside someone else's capture (MS_CAPTURE_FOREIGN).  Between ms_graph_join and ms_graph_leave the
** ops called on ctx are recorded into the caller's graph, and the context's memory behaves as during
** ms_graph_begin: allocations come only from the pool's cache, never from the driver (a request the cache
** cannot serve fails with MS_E_OOM: run the same ops once uncaptured first, which also creates the cuBLAS /
** cuSOLVER handles and the counters the fused steps use), and every block allocated or freed meanwhile is
** kept until the context is destroyed, because the caller's graph may replay at any time: capture once, not
** every step, and create no tensor meant to outlive the capture inside it.  ms_eigh skips its convergence
** check, as under ms_graph_begin; ms_ctx_empty_cache is refused (MS_E_UNSUPPORTED); other calls that wait for
** the device are refused by the CUDA runtime (MS_E_BACKEND), which also invalidates the caller's capture.
** Errors: MS_E_UNSUPPORTED (CPU; the stream is not being captured, or captured by this context; already
** joined), MS_E_BACKEND (the caller's capture was invalidated). */
MS_API ms_status ms_graph_join(ms_ctx *ctx);
/* Ends ms_graph_join (the ops called on ctx are no longer the caller's).  Errors: MS_E_ARG (not joined),
** MS_E_UNSUPPORTED (CPU). */
MS_API ms_status ms_graph_leave(ms_ctx *ctx);

/* ---------------------------------------------------------------------------------------------------
** DLPack (https://dmlc.github.io/dlpack/latest/): exchanging tensors with PyTorch, JAX, CuPy, ... without
** copies.  `managed` is a DLManagedTensor * (the unversioned struct of dlpack.h 0.6 and later, which is what
** `__dlpack__()` capsules named "dltensor" hold), passed as void * so this header needs no DLPack header.
** ------------------------------------------------------------------------------------------------- */

/* A tensor on ctx's device viewing the DLPack tensor's memory (data + byte_offset, its shape and strides;
** NULL strides = row-major contiguous).  moonstep takes ownership: the producer's deleter is called exactly
** once, when the last moonstep tensor viewing the memory is freed.  On error nothing is taken (the caller
** still owns `managed`).  Work queued by the producer on other streams must be finished or ordered before
** ctx's (synchronise first).
** Errors: MS_E_ARG (NULL, ndim > MS_MAX_DIMS), MS_E_DEVICE (kDLCPU for a CPU context, kDLCUDA with ctx's
** device index for a CUDA one; anything else is refused), MS_E_DTYPE (not one of f32 f64 bf16 f16 i32 u8, or
** lanes != 1), MS_E_LAYOUT (negative strides, misaligned data). */
MS_API ms_status ms_tensor_from_dlpack(ms_ctx *ctx, void *managed, ms_tensor **out);

/* A DLManagedTensor * viewing t (same memory, shape and strides; byte_offset 0) for a consumer, which must
** call its deleter once when done; t's memory stays alive until then, even after t is freed.  The device is
** kDLCPU or kDLCUDA with the context's index.  The consumer must order its work after t's context's stream
** (ms_ctx_sync, or a wait on ms_ctx_stream).  Errors: MS_E_ARG, MS_E_DEVICE (t not on ctx's device). */
MS_API ms_status ms_tensor_to_dlpack(ms_ctx *ctx, const ms_tensor *t, void **out_managed);

/* ---------------------------------------------------------------------------------------------------
** safetensors files
**
** The format: 8-byte little-endian header length N, N bytes of JSON header {name: {"dtype", "shape",
** "data_offsets": [begin, end]}, "__metadata__": {string: string}}, then the data.  Every size, offset,
** dtype and shape is validated on load; a corrupt or truncated file is MS_E_FORMAT naming the problem.
** ------------------------------------------------------------------------------------------------- */

/* Writes n named tensors (any device, any layout; names unique, non-empty, not "__metadata__") and an
** optional metadata JSON object whose values are all strings (NULL or "" for none).  The file is written
** atomically: a temporary file in the same folder, fsync, rename, fsync of the folder.
** Errors: MS_E_ARG (NULL ctx, NULL or empty path or one naming a folder, n < 0, NULL arrays or entries, names
** empty, duplicate, "__metadata__" or not UTF-8, a metadata value that is not a string), MS_E_FORMAT
** (metadata_json malformed, not an object, or with a key given twice), MS_E_DTYPE, MS_E_OOM, MS_E_IO; the file
** is then untouched. */
MS_API ms_status ms_safetensors_save(ms_ctx *ctx, const char *path, int n, const char *const *names,
                                     const ms_tensor *const *tensors, const char *metadata_json);

typedef struct ms_tensor_set ms_tensor_set;

/* Reads a safetensors file into tensors on ctx's device (dtypes F32 F64 BF16 F16 I32 U8).
** Errors: MS_E_ARG (NULL ctx, path or out), MS_E_IO, MS_E_FORMAT (as above), MS_E_UNSUPPORTED (another dtype,
** more than MS_MAX_DIMS dims), MS_E_OOM (including the context's mem_limit); *out is then NULL. */
MS_API ms_status ms_safetensors_load(ms_ctx *ctx, const char *path, ms_tensor_set **out);

MS_API int ms_tensor_set_count(const ms_tensor_set *set);
/* Name of entry i (in file order), NULL when i is out of range. */
MS_API const char *ms_tensor_set_name(const ms_tensor_set *set, int i);
/* A new handle to entry i's tensor (free it with ms_tensor_free). */
MS_API ms_status ms_tensor_set_get(const ms_tensor_set *set, int i, ms_tensor **out);
/* The file's __metadata__ as a JSON object string ("{}" when the file has none). */
MS_API const char *ms_tensor_set_metadata(const ms_tensor_set *set);
MS_API void ms_tensor_set_free(ms_tensor_set *set);

/* ---------------------------------------------------------------------------------------------------
** Multi-tensor ("foreach") helpers and fused optimizer steps
**
** These work on groups: n members given as arrays of n entries, members of any shapes, updated in few
** launches (CUDA: many tensors per launch).  Scalars that change every step come as a double and an
** optional 1-element f32 device tensor (the _t field wins when given), so a captured step replays with new
** values.  A device value is read as it is when the kernel runs (checking it would need a host
** synchronisation): its caller keeps it valid, a finite lr >= 0 and a step >= 1, as ms.optim's runtime does; a
** host value is checked (MS_E_ARG).  `skip_t` (optional, 1 element) is read at execution time: nonzero means
** the call changes nothing, which lets a trainer skip a step on non-finite gradients without a host
** synchronisation.
** `scales` (optional, n entries) multiplies the learning rate per member (e.g. width transfer).
** ------------------------------------------------------------------------------------------------- */

/* Stochastic rounding's numbering of a param.  The fused steps that round bf16/f16 params stochastically
** (ms_adamw_step, ms_sgd_step, ms_adamw8_step, ms_sinkgd_step) draw element e's random number from the Philox
** counter (element, step, member), by default element = e (row-major in the param) and member = the param's
** index in the call.  A param that is a part of a larger whole -- one parameter of a list a rank steps only
** some of (owner mode), a slice of a matrix split across ranks -- can be given the numbers it has in that whole,
** so that every split of the whole rounds as one call over it does, bit for bit.  With an origin set on a
** param [..., m, n]:
**   member  = origin.member
**   element = (b * rows + row0 + i) * cols + col0 + j     for element e = (b, i, j) of the param's matrices
** (b the index over the leading dims; the param is a slice along one dim: rows = m or cols = n); rows = cols =
** 0 numbers the elements as they are (e).  ms_sinkgd_step takes the member only: its sharded slices number
** their elements in their whole matrix already. */
typedef struct ms_rng_origin {
    uint32_t member;
    int64_t  rows, cols;   /* the whole's matrix dims (both 0: the param's own numbering) */
    int64_t  row0, col0;   /* where the param's [m, n] lies in each [rows, cols] */
} ms_rng_origin;

/* Sets (origin NULL: clears) the numbering of t's stochastic rounding.  It belongs to the handle t, not to its
** views or its storage.  MS_E_ARG: rows or cols given (either nonzero) for a tensor of fewer than 2 dims, a
** [row0, row0 + m) x [col0, col0 + n) that does not fit in [0, rows) x [0, cols) or is not a slice along one
** dim, row0 or col0 without rows and cols, or a whole whose elements overflow int64. */
MS_API ms_status ms_tensor_set_rng_origin(ms_tensor *t, const ms_rng_origin *origin);

/* dst [n] (f32 or f64) <- sum of squares of each src, accumulated in f32 (f64 for f64 sources) in a fixed
** order; a NaN or Inf anywhere in src i makes dst[i] non-finite.  Sources: any float dtype and layout. */
MS_API ms_status ms_foreach_sumsq(ms_ctx *ctx, ms_tensor *dst, int n, const ms_tensor *const *srcs);

/* tensors[i] <- tensors[i] * s (or * *s_t), in place; float dtypes, any layout without stride-0 dims. */
MS_API ms_status ms_foreach_scale(ms_ctx *ctx, int n, ms_tensor *const *tensors, double s,
                                  const ms_tensor *s_t);

typedef struct ms_adamw_options {
    double lr;                  const ms_tensor *lr_t;
    double beta1, beta2, eps, weight_decay;
    double step;                const ms_tensor *step_t;   /* 1-based number of this step */
    int    bias_correction;     /* nonzero: divide the moments by 1 - beta^step */
    int    stochastic_round;    /* bf16/f16 params: stochastic rounding when storing them */
    uint64_t seed;              /* Philox key of the stochastic rounding */
    const ms_tensor *skip_t;
} ms_adamw_options;

/* AdamW (decoupled weight decay; Loshchilov & Hutter 2019, as torch.optim.AdamW).  For member i, with
** lr_i = lr * scales[i] (scales NULL: 1), g = grads[i] in f32:
**   p <- p * (1 - lr_i * weight_decay)
**   m <- beta1 * m + (1 - beta1) * g            v <- beta2 * v + (1 - beta2) * g * g
**   p <- p - lr_i * (m / bc1) / (sqrt(v / bc2) + eps),   bc = 1 - beta^step (1 without bias_correction)
** Computed in f32 (f64 for f64 params).  params: f32, f64, bf16 or f16, contiguous; grads: any float dtype,
** same shape, any layout; exp_avg / exp_avg_sq: f32 or bf16 (the same dtype for all), same shape,
** contiguous.  With stochastic_round, a bf16/f16 param is stored rounded up with probability equal to the
** position between its two neighbours, from Philox keyed by seed with counter (element, step, member)
** (ms_tensor_set_rng_origin: by default the element's index and the member's position in the call).
** Errors: MS_E_SHAPE, MS_E_DTYPE, MS_E_LAYOUT, MS_E_ARG (NULL arrays or members, lr/betas out of range). */
MS_API ms_status ms_adamw_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                               ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_sq, const double *scales,
                               const ms_adamw_options *opts);

typedef struct ms_sgd_options {
    double lr;                  const ms_tensor *lr_t;
    double momentum, dampening, weight_decay;
    int    nesterov;
    double step;                const ms_tensor *step_t;   /* 1-based; step 1 initialises the momentum */
    int    stochastic_round;
    uint64_t seed;
    const ms_tensor *skip_t;
} ms_sgd_options;

/* SGD with momentum, as torch.optim.SGD: d = g + weight_decay * p; with momentum, buf <- d on step 1 and
** buf <- momentum * buf + (1 - dampening) * d afterwards, then d = d + momentum * buf (nesterov) or d = buf;
** p <- p - lr_i * d.  momentum_buf may be NULL when momentum == 0 (else f32 or bf16, contiguous).  Dtypes and
** layouts as ms_adamw_step. */
MS_API ms_status ms_sgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                             ms_tensor *const *momentum_buf, const double *scales, const ms_sgd_options *opts);

/* ---------------------------------------------------------------------------------------------------
** SinkGD and AdamW with 8-bit state
**
** SinkGD: Scetbon, Ma, Gong, Meeds, "Gradient Multi-Normalization for Efficient LLM Training" (arXiv
** 2502.06742), with the modes and knobs of axolotl's implementation (spectral target, weight sphere).
** 8-bit AdamW state: block-wise absmax scaling with a dynamic-tree quantization map (Dettmers et al.,
** arXiv 2110.02861 and 1511.04561), as torchao's AdamW8bit keeps it.  Both are group calls like the steps
** above: n members, lr and step as a double or a device scalar, skip_t, per-member scales.
** ------------------------------------------------------------------------------------------------- */

typedef enum ms_sinkgd_mode {
    MS_SINKGD_BASE     = 0,   /* p <- p (1 - eta wd) - eta X */
    MS_SINKGD_SPECTRAL = 1,   /* p <- p (1 - eta wd) - eta (tau / sigma) X: ||update||_2 ~ eta tau */
    MS_SINKGD_SPHERE   = 2    /* the MD variant: a step that keeps ||p||_F at its first value, no decay */
} ms_sinkgd_mode;

typedef enum ms_sinkgd_target {
    MS_SINKGD_TARGET_UNIT = 0,   /* tau = 1 */
    MS_SINKGD_TARGET_MUON = 1    /* tau = sqrt(m / n) */
} ms_sinkgd_target;

typedef struct ms_sinkgd_options {
    double lr;                  const ms_tensor *lr_t;
    double step;                const ms_tensor *step_t;   /* 1-based; keys the stochastic rounding */
    ms_sinkgd_mode   mode;
    int    iters;               /* SR-Sinkhorn iterations L >= 0 (0: X = G) */
    int    sn_iters;            /* power-iteration steps per update, >= 1 (spectral and sphere modes) */
    ms_sinkgd_target target;    /* the spectral mode's operator-norm target */
    double eps;                 /* > 0: every norm is clamped from below at eps */
    double weight_decay;        /* >= 0; must be 0 in sphere mode */
    int    stochastic_round;    /* bf16/f16 params: stochastic rounding when storing them (as ms_adamw_step) */
    uint64_t seed;              /* Philox key of the stochastic rounding and of u's first value */
    const ms_tensor *skip_t;
} ms_sinkgd_options;

/* One SinkGD step on each member.  A member is a param p and its grad of shape [..., m, n]: the leading
** dims index independent matrices (e.g. the experts of a fused MoE weight); for an nn.Linear weight
** m = d_out and n = d_in.  For each matrix G, with eta = lr * scales[i] (scales NULL: 1; the recipe's
** width-transfer factor alpha_eff), in exact arithmetic (the CPU computes in f64), rounded once when p is
** stored:
**
**   SR-Sinkhorn, carried as the scale vectors of X = diag(r) G diag(c), r = 1 [m], c = 1 [n]; `iters` times:
**     S_i = ||row i of G diag(c)||,  r_i <- sqrt(n) r_i / max(r_i S_i, eps)     (rows of X to norm sqrt(n))
**     T_j = ||col j of diag(r) G||,  c_j <- sqrt(m) c_j / max(c_j T_j, eps)     (then columns to sqrt(m))
**   which is the iterate of X <- sqrt(n) X / max(||X_i,:||, eps); X <- sqrt(m) X / max(||X_:,j||, eps)
**   without rounding X in between.  A zero S_i (T_j) leaves r_i (c_j) as it is: that row (column) of X is
**   zero whatever its scale, and the scale would otherwise grow by sqrt(n) / eps every iteration.
**
**   base:      p <- p (1 - eta wd) - eta X
**   spectral:  sn_iters power-iteration steps from the persisted u = specnorm_u ([..., n], f32):
**                v = X u,  v <- v / max(||v||, eps),  w = X^T v,  sigma = max(||w||, eps),  u <- w / sigma
**              then p <- p (1 - eta wd) - eta (tau / sigma) X,  tau = 1 (unit) or sqrt(m / n) (muon).
**   sphere:    t = md_target_norm ([...], f32).  A negative stored t means "not captured yet": t becomes
**              ||p||_F of this step's p, stored rounded to f32, and that f32 value is used.  sigma as in
**              spectral; a = eta t / sigma; s0 = ||W||_F^2, s1 = <W, X>, s2 = ||X||_F^2 (W = p);
**              F = sqrt(max(s0 - 2 a s1 + a^2 s2, eps));  p <- (W - a X) t / F   (so ||p||_F stays t).
**
** u is stored as the unit vector of the last power step; on entry it need not be a unit vector (the power
** step normalises v first).  A u that is all zeros (a fresh state) starts as u_j = 2 U_j - 1, U_j the f32
** uniform that ms_rand draws for element j with key `seed` and offset 2^63 + b, b the matrix's index among
** the member's leading dims (ms_rand with a = -1, b = 1 gives the same vector).  A power step whose u is
** (numerically) orthogonal to every row of X, ||X u|| <= 1e-4 ||X||_F ||u|| (a 1-row matrix meets this
** whenever half its signs flip), restarts from that vector, once per step: sigma would otherwise collapse to
** eps and the update grow 1/eps times.  When X^T v is zero (a zero gradient, an expert that received no
** tokens) u keeps its value, so a later step never starts from zero.
**
** params: f32, bf16 or f16, ndim >= 2, contiguous (updated in place: a non-contiguous param is refused, never
** copied).  grads: f32, bf16 or f16, the param's shape, any layout.  specnorm_u (spectral and sphere; may be
** NULL in base mode): f32 [..., n], contiguous.  md_target_norm (sphere; may be NULL otherwise): f32 [...]
** (for a 2-D param [] or [1]), contiguous.  With skip_t nonzero nothing changes, state included.  Results
** do not depend on the thread count or on the grads' layout.  On CUDA they are bitwise reproducible; the
** thread map (2 or 4 16-byte chunks of a row per thread, chosen by whether the call's gradients fit in L2, by
** their number and by their dtype) may change the last bits: MOONSTEP_SINKGD_K = 2 or 4 forces it (for tests and measurements).  Dense bf16/f16 rows
** of 16385-32768 elements are swept by pairs of CTAs; MOONSTEP_SINKGD_PAIR = 0 gives them two passes an
** iteration instead (results that may differ in the last bits).  Calls of many matrices with few CTA bands each
** fold their column sums a warp a block of 32 columns; MOONSTEP_SINKGD_WARP_FOLD = 0 folds them a CTA a block
** instead (the same bits).  Base and spectral calls of at most 16 dense matrices of one dtype pair apply the
** update in one flat pass of short blocks; MOONSTEP_SINKGD_FLAT_APPLY = 0 applies it with the CTAs of the sweeps
** instead (the same bits).  CUDA sums the squares in f32: a matrix some row of whose G diag(c) has a sum of
** squares past the f32 range (|g| of ~1.8e19 / sqrt(n) and beyond) is updated with NaN, as for a NaN gradient,
** where the CPU's f64 sums give the finite update (ms.optim's non-finite check, whose f32 sums of squares
** overflow alike, skips such a step on both backends).  At the other end, a row (column) all of whose |G c| are below
** ~2.6e-23 has f32 squares that sum to 0 and keeps its scale, as a zero row does, where the CPU clamps its norm to eps.
** Errors: MS_E_ARG (NULL arrays or members, options out of range), MS_E_SHAPE, MS_E_DTYPE, MS_E_LAYOUT,
** MS_E_DEVICE, MS_E_OOM (scratch: O(m + n) per matrix), MS_E_UNSUPPORTED (a backend without the op). */
MS_API ms_status ms_sinkgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                                ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                                const double *scales, const ms_sinkgd_options *opts);

/* Sharded SinkGD: a matrix split across the ranks of a communicator, by rows or by columns. */
typedef enum ms_shard_dim {
    MS_SHARD_NONE = 0,   /* this rank holds the whole matrix */
    MS_SHARD_ROWS = 1,   /* rows [offset, offset + m_local) of each matrix (dim -2) */
    MS_SHARD_COLS = 2    /* columns [offset, offset + n_local) of each matrix (dim -1) */
} ms_shard_dim;

typedef struct ms_shard {
    ms_shard_dim dim;
    int64_t offset;      /* the first row (column) held here */
    int64_t global;      /* the matrix's full size along the sharded dim (the global m or n) */
} ms_shard;

typedef struct ms_comm ms_comm;   /* (the communicators' section below) */

/* ms_sinkgd_step on matrices split across the ranks of comm: each rank passes its slice of every sharded
** member (params[i], grads[i] of shape [..., m_local, n] for MS_SHARD_ROWS, [..., m, n_local] for
** MS_SHARD_COLS) and updates it in place; the result is ms_sinkgd_step's on the global matrix (global m and n
** drive sqrt(m), sqrt(n) and the muon target), up to the order in which partial sums are added (f64 on the
** CPU).  Every rank makes the call with the same options and the same sharded members in the same order with
** the same global shapes; their slices tile [0, global), which is the caller's to guarantee (a rank cannot
** see the others' offsets).  MS_SHARD_NONE members are each rank's own (the whole matrix, no exchange) and may
** differ between ranks.  lr_t, step_t and skip_t must hold the same values on every rank.
**
** Only vectors of length m or n and a few scalars per matrix cross ranks, all matrices of the call in one
** sum (all-reduce) per exchange point:
**   rows-sharded (r and v local): per Sinkhorn iteration the columns' sums of squares [n]; per power step
**     X^T v [n] of the unnormalised v, with ||v||^2 and ||X||_F^2 (v is normalised after the sum).
**   cols-sharded (c, u and w local): per Sinkhorn iteration the rows' sums of squares [m]; per power step X u
**     [m] with ||X||_F^2 and ||u||^2, then ||w||^2.
**   sphere: s0, s1, s2 (s0 = ||p||_F^2 is also the radius a capture stores).
** So a step is iters (2 iters when a call has both kinds) + sn_iters (rows) or 2 sn_iters (cols) + 1 (sphere)
** collectives, one more when a u restarts (a degenerate one, or a fresh cols-sharded one, whose zeros show
** only in the sum).  A rank whose slice is empty (m_local or n_local 0) takes part in every exchange.
** specnorm_u: rows-sharded [..., n] (the whole u, the same on every rank); cols-sharded [..., n_local], this
** rank's slice of the global u (elements [offset, offset + n_local)).  A fresh u's values u_j = 2 U_j - 1 and
** the stochastic rounding of bf16/f16 params use global indices, so they are the unsharded step's.
** md_target_norm: [...] as in ms_sinkgd_step, the same on every rank.
**
** shards: n entries (NULL: every member MS_SHARD_NONE; offset and global are not read for NONE).  comm: a
** communicator made on ctx.  comm NULL, or a one-rank comm, needs every shard to cover its whole dim (offset
** 0, global = the local size).  A call whose members are all MS_SHARD_NONE is ms_sinkgd_step.  Dtypes,
** layouts and options as ms_sinkgd_step, with the shapes above.
** Errors: those of ms_sinkgd_step; MS_E_ARG (a shard's dim unknown, offset < 0, offset + local size > global,
** comm made on another context, a partial shard without a comm of several ranks), MS_E_UNSUPPORTED (a backend
** without the op); the communicator's errors (a failed exchange: the CPU has changed nothing, a device may
** have; the communicator refuses further collectives). */
MS_API ms_status ms_sinkgd_step_sharded(ms_ctx *ctx, ms_comm *comm, int n, ms_tensor *const *params,
                                        const ms_tensor *const *grads, ms_tensor *const *specnorm_u,
                                        ms_tensor *const *md_target_norm, const double *scales,
                                        const ms_shard *shards, const ms_sinkgd_options *opts);

enum { MS_ADAMW8_BLOCK_MAX = 4096 };   /* the largest block_size of ms_adamw8_step */

typedef struct ms_adamw8_options {
    ms_adamw_options adamw;     /* as for ms_adamw_step */
    int block_size;             /* elements per quantization block, 1..MS_ADAMW8_BLOCK_MAX (torchao: 256) */
} ms_adamw8_options;

/* out[0..255] <- the dynamic-tree quantization map, ascending (torchao's create_dynamic_map(signed, 7, 8)):
** for k = 0..6 the midpoints of K + 1 evenly spaced points from 0.1 to 1, K = 2^k (signed) or 2^(k+1)
** (unsigned), times 10^(k-6), and when signed their negatives; then 0 and 1.  Each value is computed in f64
** and rounded once to f32 (torch computes them in f32: its values can differ in the last one or two bits).
** Signed: 127 negatives down to -0.99297, 0 at index 127, 1 at 255; unsigned: 0 at index 0, 1 at 255. */
MS_API void ms_adamw8_qmap(int is_signed, float *out);

/* AdamW whose moments are kept in 8 bits: the math of ms_adamw_step in f32, with exp_avg and exp_avg_sq held
** as u8 codes (the param's shape) and one f32 scale per block of block_size consecutive elements (row-major;
** scale tensors [numel / block_size]).  Per element: m = qmap_signed[code] * scale, v = qmap_unsigned[code]
** * scale; then the update of ms_adamw_step (p uses the new m' and v' before they are quantized); then per
** block scale' = max(max |m'| over the block, 1e-12f), y = m' / scale', and the code is the index c of the
** largest map value <= y (0 when y is below every value), moved to c + 1 when c < 255 and
** y - map[c] >= (map[c + 1] - map[c]) * 0.5.  All in f32, as torchao's OptimState8bit.  A fresh state is
** codes 0 and scales 0 (both moments then decode to 0).
** params: f32, bf16 or f16, contiguous, numel a multiple of block_size; grads: any float dtype, the param's
** shape, any layout; codes: u8, the param's shape, contiguous; scales: f32 [numel / block_size], contiguous.
** Stochastic rounding, skip_t and scales as ms_adamw_step (the same Philox counters).
** Errors: MS_E_ARG, MS_E_SHAPE, MS_E_DTYPE, MS_E_LAYOUT, MS_E_DEVICE, MS_E_UNSUPPORTED. */
MS_API ms_status ms_adamw8_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                                ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_scale,
                                ms_tensor *const *exp_avg_sq, ms_tensor *const *exp_avg_sq_scale,
                                const double *scales, const ms_adamw8_options *opts);

/* ---------------------------------------------------------------------------------------------------
** Shampoo on stacked blocks (DASH)
**
** Modoranu, Zmushko, Schultheis, Safaryan, Alistarh, "DASH: Faster Shampoo via Batched Block
** Preconditioning and Efficient Inverse-Root Solvers" (arXiv 2602.02016).  A parameter is viewed as a
** matrix and cut into blocks of at most B x B; blocks of equal size are stacked into [N, r, c] f32 tensors
** so that each per-block operation is one batched call.  The block plan (which block of which parameter goes
** where) is the caller's (lua/moonstep/blocks.lua); these calls move data between parameters and stacks,
** update the grafting state, and compute inverse p-th roots of the stacked factors.
**
** Stacks (stack, grad, grad_ema, adam_v, pgraft, a, x) are f32 and contiguous (MS_E_LAYOUT otherwise);
** per-block vectors (scale, norm, residual, lam_max, lam_min: f32; iters, index: i32) are contiguous 1-D
** tensors.  Every tensor of a call lives on the context's device (MS_E_DEVICE), and a tensor that is written
** may not share memory with another tensor of the call (MS_E_LAYOUT).
**
** Random vectors (power-iteration starts, residual sketches) are Philox normals defined like ms_rand's:
** "the normals of a [b, m] f32 tensor with key `seed` and offset OFF" means that element (i, j) is the f32
** value ms_rand (MS_RAND_NORMAL, a = 0, b = 1) stores at row-major index i * m + j with that key and
** offset, so every backend starts from the same vectors.  OFF is k (the block's index in its stack, not in
** `index`) for a power iteration on A, 2^32 + k for one on a root (lam_min) and 2^62 + k for a sketch.  With
** the options' rng_ids (i32 [N]), k is replaced by rng_ids[k] read as an unsigned 32-bit value (ids[k] below):
** a block then draws the same vectors whatever stack it is in and at whatever position, so a rank that stacks
** only the parameters it owns gives each block what one rank gives it (lua/moonstep/optim.lua's owner mode).
** Ids need not be distinct (equal ids share start vectors); `index` still names positions k, whose id is ids[k].
**
** Power iteration (ms_inv_root's PI/PIM scaling and ms_spectrum_estimate), on a symmetric matrix S with m
** start vectors V (the normals above, each column scaled to unit norm): `steps` times W = S V, then every
** column v_j <- w_j / ||w_j|| (a zero column stays zero); then q_j = v_j^T S v_j and the estimate is
** max_j q_j.  In bf16 mode S and V are rounded to bf16 before each product (f32 accumulation), as DASH does.
** ------------------------------------------------------------------------------------------------- */

/* One block of a tensor viewed as a matrix: a tensor of shape [d0, d1, ..., dk] is viewed as
** [d0, d1 * ... * dk] (a 1-D tensor of n elements as [n, 1], a 0-dim one as [1, 1]); the block starts at
** (row0, col0) of that view and has the stack's r x c size. */
typedef struct ms_block {
    ms_tensor *tensor;
    int64_t row0, col0;
} ms_block;

/* stack [N, r, c] f32 <- the n = N blocks, block k into stack[k] (values converted to f32 exactly).
** Tensors: f32, bf16 or f16; a tensor of 0, 1 or 2 dims may have any layout, one of more dims must be
** contiguous (MS_E_LAYOUT).  Blocks must lie inside their tensor (MS_E_SHAPE) and may overlap (they are only read).
** One launch per call on CUDA.  Errors: MS_E_ARG (NULL, n < 0), MS_E_SHAPE (n != N, ...), MS_E_DTYPE, MS_E_LAYOUT,
** MS_E_DEVICE. */
MS_API ms_status ms_blocks_gather(ms_ctx *ctx, ms_tensor *stack, int n, const ms_block *blocks);

typedef struct ms_blocks_apply_options {
    double lr;                  const ms_tensor *lr_t;
    double weight_decay;        /* >= 0; decoupled: p <- p (1 - lr wd) before the update */
    double step;                const ms_tensor *step_t;   /* 1-based; keys the stochastic rounding */
    int    stochastic_round;    /* bf16/f16 tensors: stochastic rounding when storing (as ms_adamw_step) */
    uint64_t seed;
    const ms_tensor *skip_t;    /* nonzero at execution time: nothing changes */
    const ms_tensor *rng_ids;   /* i32 [N] on the context's device, or NULL: block k's stochastic rounding uses
                                ** member rng_ids[k] (as an unsigned 32-bit value) in place of k, so a block rounds
                                ** the same whatever stack or position it has (distributed DASH) */
} ms_blocks_apply_options;

/* For each block k: p_k <- p_k (1 - lr wd) - lr * scale[k] * stack[k] (scale: f32 [N], or NULL for 1),
** computed in f32 as  p * (1 - lr wd) - (lr * scale[k]) * s  (the two factors rounded to f32 once per block)
** and rounded once when stored.  With opts NULL it is the plain scatter p_k <- scale[k] * stack[k].
** Blocks must not overlap one another (MS_E_LAYOUT; the plan partitions each tensor, so weight decay reaches
** every element of a block exactly once).  Tensors as ms_blocks_gather (never with stride-0 dims), but
** contiguous when stochastic rounding applies: the Philox counter of ms_adamw_step with e = the element's
** row-major index in its tensor and `member` = k, the block's index in the call (or rng_ids[k]), rounded to
** bf16/f16 as ms_adamw_step rounds.
** Errors: MS_E_ARG (NULL, n < 0, lr or weight_decay out of range), MS_E_SHAPE (n != N, ...), MS_E_DTYPE, MS_E_LAYOUT,
** MS_E_DEVICE. */
MS_API ms_status ms_blocks_apply(ms_ctx *ctx, int n, const ms_block *blocks, const ms_tensor *stack,
                                 const ms_tensor *scale, const ms_blocks_apply_options *opts);

typedef struct ms_dash_graft_options {
    double beta_grad;           /* gradient EMA: m <- beta_grad m + (1 - beta_grad) g (0: m = g); [0, 1) */
    double beta_graft;          /* Adam second moment: v <- beta_graft v + (1 - beta_graft) g^2; [0, 1) */
    double eps;                 /* eps_grafting, > 0 */
    double step;                const ms_tensor *step_t;   /* 1-based, for the bias corrections */
    int    bias_correction;
    const ms_tensor *skip_t;    /* nonzero at execution time: nothing changes */
} ms_dash_graft_options;

/* DASH's grafting state on stacks [N, r, c] (all f32): updates grad_ema (m) and adam_v (v) from grad (g),
** then P_graft = mh / (eps + sqrt(vh)) with, when bias_correction is set, mh = m / (1 - beta_grad^t) (m itself
** when beta_grad = 0) and vh = v / (1 - beta_graft^t) (t = the step rounded to an integer), else mh = m and
** vh = v; norm[k] = ||P_graft of block k||_F (f32 [N]; the sum of squares accumulated in at least f32 in a
** fixed order).  P_graft itself is written to pgraft when it is not NULL (DASH's pure-Adam direction before
** start_prec_step).  All per element in f32; one pass over the stacks on CUDA.
** Errors: MS_E_ARG (options out of range), MS_E_SHAPE, MS_E_DTYPE, MS_E_LAYOUT, MS_E_DEVICE. */
MS_API ms_status ms_dash_graft(ms_ctx *ctx, ms_tensor *grad_ema, ms_tensor *adam_v, ms_tensor *norm,
                               ms_tensor *pgraft, const ms_tensor *grad, const ms_dash_graft_options *opts);

typedef struct ms_dash_factor_options {
    double alpha;               /* weight of the new products (DASH: 1 - beta_LR, or 1 for plain sums) */
    double beta;                /* weight of the old factors (0: their old contents are not read, NaN included) */
    int    allow_tf32;          /* CUDA: TF32 tensor cores for the products (as ms_matmul's allow_tf32) */
    /* DASH's grafting update of the gathered stack in the same pass (graft not NULL): exactly
    ** ms_dash_graft(grad_ema, adam_v, norm, pgraft, stack, graft) after the gather, tensors as there (pgraft may
    ** be NULL), none sharing memory with stack, left, right or a block's tensor.  graft NULL: no grafting. */
    const ms_dash_graft_options *graft;
    ms_tensor *grad_ema, *adam_v, *norm, *pgraft;
} ms_dash_factor_options;

/* DASH's factor accumulation (and grafting, opts->graft) with the gather it needs: stack [N, r, c] <- the
** n = N blocks (exactly as
** ms_blocks_gather), then with G = stack[k]:  left[k] <- beta left[k] + alpha G G^T  (left f32 [N, r, r]) and,
** unless right is NULL,  right[k] <- beta right[k] + alpha G^T G  (right f32 [N, c, c]); the products as
** ms_matmul computes them (f32 accumulation; TF32 operands on CUDA with allow_tf32).  The CPU backend runs
** exactly those ms_matmul calls.  CUDA: the gather also writes G^T to scratch in the same pass, so both
** products read K-major operands (TF32 on Hopper has no transposed-operand path at full rate), the grafting
** update follows as ms_dash_graft's pass, and the products are cuBLASLt matmuls with the first algorithm the heuristic gives for the call's shapes (split-K
** reductions excluded): fixed per shape, never chosen by timing, so results are reproducible run to run.
** Under capture before any uncaptured call (no cuBLASLt handle yet), cublasGemmStridedBatchedEx runs them.
** Knob for measurements: MOONSTEP_DASH_FACTOR_GEMM = lt (default) | ex (the same K-major products through
** cublasGemmStridedBatchedEx) | nt (no G^T: the right product reads G transposed, as ms_matmul's trans_a);
** MOONSTEP_DASH_GATHER_GRAFT = 0 (default) | 1 (the grafting update inside the gather's pass, the stack not read
** back, norms summed per 32 x 256 strip in f64 in a fixed order; measured slower on the H200).
** Errors: as ms_blocks_gather and ms_dash_graft, and MS_E_ARG (opts NULL, alpha or beta not finite), MS_E_SHAPE
** (left, right), MS_E_LAYOUT (written tensors sharing memory with each other or with a block's tensor). */
MS_API ms_status ms_blocks_gather_factors(ms_ctx *ctx, ms_tensor *stack, ms_tensor *left, ms_tensor *right, int n,
                                          const ms_block *blocks, const ms_dash_factor_options *opts);

typedef enum ms_root_method {
    MS_ROOT_EVD       = 0,   /* eigendecomposition; eigenvalues shifted as DistributedShampoo (evd_shift) */
    MS_ROOT_CN        = 1,   /* coupled Newton (research/dash.md 2.2), per-block stopping */
    MS_ROOT_NDB       = 2,   /* Newton-Denman-Beavers; root 4 as two chained square roots */
    MS_ROOT_CHEBYSHEV = 3    /* Chebyshev polynomial of x^(-1/p) evaluated by Clenshaw's recurrence */
} ms_root_method;

typedef enum ms_root_scaling {
    MS_SCALING_FRO = 0,      /* s = ||A||_F */
    MS_SCALING_PI  = 1,      /* s = pi_const * lambda_max estimate, one power-iteration vector */
    MS_SCALING_PIM = 2       /* the same with pi_vectors vectors, the largest Rayleigh quotient */
} ms_root_scaling;

typedef struct ms_root_options {
    ms_root_method  method;
    int    root;             /* p: 2 or 4 */
    int    steps;            /* NDB: Newton steps per square root (>= 1); CN: most iterations (>= 1);
                             ** Chebyshev: degree (8..10000); EVD: unused */
    double eps;              /* >= 0: the root of A + eps I */
    ms_root_scaling scaling; /* NDB, CN, Chebyshev */
    int    pi_steps;         /* power-iteration steps (DASH: 10), >= 1 with PI/PIM scaling */
    int    pi_vectors;       /* PIM vectors (DASH: 16), 1..64 */
    double pi_const;         /* safety factor (DASH: 2), >= 1 */
    double eps_power_iter;   /* >= 0, damping of the power iteration's matrix (DASH: 1e-6): no NaN on a zero block */
    int    pi_bf16;          /* the power iteration in bf16 (DASH) instead of f32 */
    double tolerance;        /* >= 0. CN and NDB: a block stops iterating once its iterate is this close to
                             ** convergence (CN: max |M - I|; NDB: max |Z Y - I|); 0: every block runs all steps */
    ms_dtype matmul_dtype;   /* MS_DTYPE_F32 (TF32 when allow_tf32), or MS_DTYPE_BF16 / MS_DTYPE_F16: 16-bit GEMM
                             ** operands with f32 accumulation and f32 results, in the products listed below
                             ** (EVD: f32 only, MS_E_ARG otherwise) */
    int    allow_tf32;       /* CUDA f32 GEMMs on TF32 tensor cores; the CPU computes f32 exactly */
    int    evd_shift;        /* EVD: nonzero = DASH's SHAMPOO heuristic (lambda <- lambda + eps - min(lambda_min, 0)) */
    uint64_t seed;           /* Philox key of the power-iteration start vectors and residual sketches */
    const ms_tensor *index;  /* i32 [K] on the context's device, or NULL: work only on these blocks of a and
                             ** x (the others are left as they are), e.g. one class of the `auto` policy.
                             ** Entries distinct and in [0, N): checked where the backend can read them
                             ** without synchronising (the CPU: MS_E_ARG) */
    const ms_tensor *rng_ids;  /* i32 [N] on the context's device, or NULL: block k's vectors use offset rng_ids[k]
                             ** (as an unsigned 32-bit value) in place of k, so a block draws the same vectors
                             ** whatever stack or position it has (distributed DASH: lua/moonstep/optim.lua's
                             ** owner mode) */
} ms_root_options;

/* x [N, b, b] f32 <- (A + eps I)^(-1/p) for each symmetric block A of a [N, b, b] f32 (x must not overlap a).
** Every method returns the root itself (scales undone), so methods can be mixed across blocks.  With
** A_reg = A + eps I and s its scale (FRO: ||A_reg||_F; PI / PIM: pi_const times the power-iteration estimate
** of A_reg + eps_power_iter I with 1 / pi_vectors vectors, pi_steps steps; s is raised to at least 2^-126
** so that an all-zero block gives finite numbers, never NaN):
**   EVD:  A_reg = Q diag(l) Q^T (LAPACK / cuSOLVER syevd in f32); with evd_shift l <- l + eps - min(l_1, 0);
**         X = Q diag(l^(-1/p)) Q^T, where an l <= 0 contributes 0 (pseudo-inverse; only with eps = 0).
**   CN:   z = (p + 1) / (2 s), X = z^(1/p) I, M = z A_reg; per iteration N = ((p + 1) I - M) / p,
**         X <- X N, M <- N^p M (p = 4: N2 = N N, M <- N2 (N2 M)).  16-bit: the products of the M recursion,
**         and M kept in 16 bits (rounded once after each update; N and the distance are formed from it).
**   NDB:  one square-root chain on C with scale c: Y = C / c, Z = I; step 1 is E = 1.5 I - 0.5 Y, Y <- Y E,
**         Z <- E (one product); steps 2..T: E = 1.5 I - 0.5 Z Y, Y <- Y E, Z <- E Z; the last step skips the
**         product that is not returned.  p = 2: X = Z_T / sqrt(s) from the chain on A_reg with c = s.
**         p = 4: S = Y_T sqrt(s) from the chain on A_reg with c = s, then X = Z_T / s^(1/4) from the chain on
**         S with c = sqrt(s) (one scale estimate).  16-bit: every product.
**   Chebyshev: the degree-d interpolant q of y^(-1/p) at d + 1 Chebyshev points of [lo, 1], lo = 25 / d^2,
**         coefficients computed in f64 and rounded to f32 (the same on every backend); with T = (2 A_reg / s
**         - (1 + lo) I) / (1 - lo), Clenshaw's recurrence b_k = 2 T b_(k+1) - b_(k+2) + c_k I (d - 1 products;
**         16-bit: T and b_(k+1) rounded), X = s^(-1/p) q(A_reg / s).  Not DASH's Chebyshev, which fits
**         y^(-1/p) on [eps, 1 + eps] by least squares without the s^(-1/p) rescale: that fit misses the root
**         by ~0.1-1 (normalized) already at condition 10, where this interpolant is within ~1e-6.
** Per-block stopping (tolerance > 0): CN tests max |M - I| after each iteration, NDB max |Z Y - I| (the
** product every step forms) before each step; a block that meets it keeps its iterate and stops.  Whatever the
** tolerance, a block whose iterate leaves the region of convergence stops the same way: NDB when
** max |Z Y - I| > 2, CN when max |M - I| > p + 1 (healthy iterates stay below 1 and (p - 1) / 2).  That happens
** when A_reg has a negative eigenvalue (rounding noise of a singular factor with eps = 0), which the iteration
** would otherwise amplify ~2.25x per step into Inf and NaN; the root stays finite and its residual large.
** (CUDA backend: this divergence stop runs only when tolerance > 0, where the per-block test is computed anyway;
** with tolerance 0 every block runs every step, as DASH does -- give a small eps or a tolerance for singular
** factors.  A check pass per step would cost ~4.5 ms on 228 blocks of 1024.)
** Resolution floors: an iterative method does not resolve, by design, the eigenvalues y = lambda / s (of A_reg)
** below its floor; above the floor the normalized root X / ||X||_F is within ~1e-4 of the exact one (f32).
** Below it CN, Chebyshev and NDB's root 2 under-invert (their root of y is too small, never too large), while
** NDB's root 4 feeds the first chain's too small square root into the second and over-inverts, by up to 2.2x
** for y in [1e-6, 1e-3] (under-inverting only below ~1e-7).  Measured floors for the DASH settings are listed in
** the comment "Resolution floors" of engine/cpu/dash.c (p = 2 / p = 4): NDB 10 steps 3.2e-3 / 2.4e-3 (each
** further step lowers it ~2.25x), CN 10 iterations 2.1e-3 / 4.9e-4, Chebyshev degree 60 6.5e-3 / 5.6e-3 (about
** lo = 25 / d^2), EVD 6.5e-5 (f32 eigenvalues; below it EVD's root can be too large as well as too small).
** Optional per-block outputs (f32 / i32 [N], entries of blocks not in `index` untouched): residual[k] =
** ||X^p A_reg V - V||_F / ||V||_F for the [b, 4] sketch V (the normals above; computed with at least f32
** accumulation): how well block k was inverted, large where an iterative solver under-inverts by design (even
** an exact root stored in f32 leaves about 1e-7 times the condition number of A_reg);
** iters[k] = the iterations block k ran (NDB: Newton steps of both square roots; CN: iterations; Chebyshev:
** d; EVD: 0).  No host synchronisation except EVD's convergence check.  CPU: the bits do not depend on the
** context's num_threads (a stack of several large blocks is solved block by block, each on one OpenBLAS thread;
** a lone or small one on OpenBLAS's threads), so ms_spectrum_estimate's neither; OpenBLAS's own thread count,
** a setting of the process, can change them.
** Errors: MS_E_ARG (options out of range, bad index entries), MS_E_SHAPE, MS_E_DTYPE, MS_E_LAYOUT,
** MS_E_DEVICE, MS_E_NUMERIC (EVD did not converge or met a non-finite entry, with the block named; x is then
** unchanged), MS_E_UNSUPPORTED. */
MS_API ms_status ms_inv_root(ms_ctx *ctx, ms_tensor *x, ms_tensor *residual, ms_tensor *iters,
                             const ms_tensor *a, const ms_root_options *opts);

typedef struct ms_spectrum_options {
    int    vectors;          /* power-iteration vectors (16), 1..64 */
    int    steps;            /* power-iteration steps (10), >= 1 */
    double eps;              /* >= 0, damping added to A's diagonal during the iteration (1e-6) */
    int    bf16;             /* the products in bf16 (f32 accumulation) */
    int    root;             /* p of x_root (lam_min): 2 or 4 */
    uint64_t seed;
    const ms_tensor *rng_ids;  /* i32 [N] on the context's device, or NULL: block k's vectors use offset rng_ids[k]
                             ** (as an unsigned 32-bit value) in place of k, so a block draws the same vectors
                             ** whatever stack or position it has (distributed DASH: lua/moonstep/optim.lua's
                             ** owner mode) */
} ms_spectrum_options;

/* Per-block spectrum estimates of a [N, b, b] f32 symmetric positive semi-definite: lam_max (f32 [N]) <- q - eps,
** q the power-iteration estimate (above) of A + eps I: a lower bound of lambda_max(A), close to it;
** lam_min (f32 [N] or NULL; then x_root may be NULL) <- mu^(-p), mu the power-iteration estimate (no damping)
** of x_root [N, b, b], an inverse p-th root of the same blocks (lambda_max(X) = lambda_min(A)^(-1/p));
** +inf where mu <= 0.  lam_min is exact to the extent that x_root resolved the small eigenvalues (its
** residual from ms_inv_root says); an under-inverted root overestimates it.
** Errors: MS_E_ARG, MS_E_SHAPE, MS_E_DTYPE, MS_E_LAYOUT, MS_E_DEVICE. */
MS_API ms_status ms_spectrum_estimate(ms_ctx *ctx, ms_tensor *lam_max, ms_tensor *lam_min, const ms_tensor *a,
                                      const ms_tensor *x_root, const ms_spectrum_options *opts);

/* ---------------------------------------------------------------------------------------------------
** Embedding: an optimizer for a trainer written in C (or anything that calls C: Python's ctypes, ...)
**
** An ms_optimizer runs a recipe on the trainer's own tensors, as ms.optim.new(recipe, params, options,
** settings) does in Lua (lua/moonstep/optim.lua): it owns a LuaJIT state running the moonstep Lua modules,
** found through MOONSTEP_LUA_DIR, else beside the library that holds this code (<dir>/../lua in a build
** tree, <dir>/../share/lua/5.1 when installed).  Use it through libmoonstep.so (the Lua side loads that
** same library).
**  - No copies: the optimizer keeps its own handles to the parameters and gradients, sharing their
**    storage, so the caller may free its handles once they are added.  Parameters are updated in place;
**    wrapped foreign memory must stay valid as long as the optimizer may use it.
**  - Parameters are added after ms_optimizer_new and are fixed once the optimizer starts: the first
**    ms_optimizer_step, _save, _load, _info, _stats or _capture routes them and creates the recipe's state.
**  - A gradient may be given with its parameter, later, or replaced at any time (ms_optimizer_set_grad, for
**    a trainer whose gradient buffers move); a step leaves a parameter without a gradient alone.
**  - Errors: a Lua error inside the recipe or the runtime never escapes; it becomes a status, and its text
**    (with a short Lua traceback for errors raised while running Lua code) is the last-error message of the
**    thread and of the optimizer's context.  The status is the engine's when an engine call failed,
**    MS_E_FORMAT for malformed JSON and for checkpoints that do not fit, MS_E_IO for files that cannot be
**    read, and MS_E_ARG otherwise: invalid options, settings or parameters, and errors raised by the
**    recipe's own code.  The optimizer stays usable after an error (a step that failed part way may have
**    updated some of the parameters).
**  - Threads: an optimizer may be used from any thread, one thread at a time, and its context must not be
**    used by another thread during its calls.  Distinct optimizers are independent.
** ------------------------------------------------------------------------------------------------- */

typedef struct ms_optimizer ms_optimizer;

/* A new optimizer running `recipe` on ctx's device (it keeps its own reference to ctx).
** recipe: a built-in name ("adamw", "sinkgd": no '/' and no ".lua"; the installed recipes, then the folders
** of MOONSTEP_RECIPE_PATH) or the path of a recipe file, which runs sandboxed unless the settings say
** "trusted": true.
** options_json: the recipe's options as a JSON object, e.g. {"lr": 3e-4, "betas": [0.9, 0.95]}, checked
** against the recipe's specs (unknown names, types, ranges, the recipe's own rules); null = the default.
** settings_json: the runtime's settings as a JSON object: "schedule" ({"kind": "cosine", "warmup_steps":
** 100, "total_steps": 10000}; kinds constant, linear_warmup, cosine, wsd), "clip_grad_norm",
** "nonfinite" ("skip": a step with NaN/Inf gradients changes nothing, "raise", "apply"), "master_weights",
** "trusted", "sandbox" ({"instructions", "memory", "quota"}), "stats", and the others lua/moonstep/optim.lua
** documents ("timings", "device_checks", ...).  The device is ctx's ("ctx" and "device" are refused).  NULL
** or "" for either JSON argument: none given.
** Errors: MS_E_ARG (NULL ctx, recipe or out; an unknown recipe or one that does not load; an unknown,
** mistyped or out-of-range option or setting), MS_E_FORMAT (malformed JSON, not an object, a key given
** twice), MS_E_IO (a recipe file or the Lua modules cannot be read), MS_E_OOM. */
MS_API ms_status ms_optimizer_new(ms_ctx *ctx, const char *recipe, const char *options_json,
                                  const char *settings_json, ms_optimizer **out);

/* Frees the optimizer, its state and its Lua state (NULL is fine); parameters and gradients stay. */
MS_API void ms_optimizer_free(ms_optimizer *opt);

/* Registers a parameter under a unique, non-empty name (checkpoints find its state by name).  param: a
** float tensor on the optimizer's device; grad: NULL (none yet) or a float tensor of param's shape on the
** same device, in any layout that can be written (steps rescale gradients in place: grad_scale, clipping; an
** expanded view, stride 0, cannot).  tags: NULL or a comma-separated list ("no_decay,adamw") that the recipe's
** route() sees.  A parameter whose memory is that of an earlier one (tied weights: an embedding and its
** lm_head) is one parameter under several names, updated once, with one gradient: given through any of the
** names (or the same memory through several), and replaced by ms_optimizer_set_grad through any of them;
** routed by the first name's tags (a later name may repeat them or give none).
** Errors: MS_E_ARG (NULL, empty or duplicate name, the optimizer has started, a grad sharing param's
** memory, a tied parameter given another gradient or other tags than the tie has), MS_E_LAYOUT (param not
** contiguous, grad not writable), MS_E_SHAPE, MS_E_DTYPE, MS_E_DEVICE. */
MS_API ms_status ms_optimizer_add_param(ms_optimizer *opt, const char *name, ms_tensor *param, ms_tensor *grad,
                                        const char *tags);

/* Gives parameter `name` another gradient tensor (NULL: none; steps then leave the parameter alone); for a tied
** parameter, the gradient of the tie (every name of it).
** Errors: as ms_optimizer_add_param, and MS_E_ARG for a name that was never added. */
MS_API ms_status ms_optimizer_set_grad(ms_optimizer *opt, const char *name, ms_tensor *grad);

/* Several ranks (README, "Multi-GPU").  The optimizer becomes one rank of comm's world: every rank creates
** its optimizer with the same recipe, options and settings, calls this, and adds the same parameters under
** the same names in the same order (each rank its own slice of a sharded one).  comm must be made on the
** optimizer's context (the one given to ms_optimizer_new): the step's collectives are queued there, in order
** with the rest of the step.  The optimizer keeps the pointer only: comm must outlive the optimizer (free
** the optimizer first).  NULL: one rank again.  Call it before the optimizer starts.
** The runtime then takes each step's decisions on all ranks together (the non-finite check, clip_grad_norm's
** global norm), and updates the parameters that are not sharded as the setting "distribute" says: "owner"
** (the default with more than one rank: each parameter is updated by one rank, then broadcast from it) or
** "replicate" (every rank updates every parameter: the trainer keeps their gradients identical).  A step that
** fails on one rank while the recipe updates gives comm up there (ms_comm_abort), so that the other ranks fail
** at once rather than at the timeout.
** Errors: MS_E_ARG (NULL opt, the optimizer has started), MS_E_DEVICE (comm made on another context). */
MS_API ms_status ms_optimizer_set_comm(ms_optimizer *opt, ms_comm *comm);

/* ms_optimizer_add_param for a parameter of which this rank holds a slice (ms_shard: MS_SHARD_ROWS, rows
** [offset, offset + m_local) of each matrix (dim -2); MS_SHARD_COLS, columns (dim -1); shard->global, the
** full size of that dim).  The recipe sees the global shape (its routing, SinkGD's width transfer and
** muon target); elementwise updates (AdamW) apply to the slice as they are, SinkGD exchanges only its norm
** vectors across the ranks (ms_sinkgd_step_sharded).  The ranks' slices of a parameter must tile
** [0, global) without gap or overlap: the optimizer checks it (across the ranks of ms_optimizer_set_comm's
** communicator) when it starts, and names the parameter.  grad: the gradient of the slice (param's shape).
** shard NULL or MS_SHARD_NONE: ms_optimizer_add_param.
** Errors: as ms_optimizer_add_param, and MS_E_ARG (an unknown shard->dim; a param of fewer than 2 dims;
** offset < 0, or offset + the slice's size > global, a global size past 2^53). */
MS_API ms_status ms_optimizer_add_param_sharded(ms_optimizer *opt, const char *name, ms_tensor *param,
                                                ms_tensor *grad, const char *tags, const ms_shard *shard);

typedef struct ms_step_options {
    double grad_scale;   /* > 0: the gradients are this many times too large (a scaled loss) and are divided
                         ** by it, in place, before clipping and the update; 0 means 1 */
} ms_step_options;

/* One step: this step's learning rate (the schedule's, or the last ms_optimizer_set_lr), the settings'
** non-finite check and gradient clipping, then every route of the recipe on its parameters that have a
** gradient.  Clipping (and grad_scale) rescale the gradient tensors in place.  The work is queued on the
** context's stream; the step waits for the device only for the non-finite check and clipping (not with
** "nonfinite": "apply", no clipping and no grad_scale).  While the trainer captures the context's stream
** into a graph of its own, the step is recorded into that graph: see "Inside a trainer's CUDA graph" below. */
MS_API ms_status ms_optimizer_step(ms_optimizer *opt);

/* ms_optimizer_step with options (NULL: none).  *applied (may be NULL) <- 1 when the step was applied, 0 when
** it was skipped (non-finite gradients under "nonfinite": "skip"), -1 when the device decides it (captured
** steps, "device_checks": ms_optimizer_stats tells afterwards).  Errors: MS_E_ARG (grad_scale < 0, NaN or
** infinite), and those of the step. */
MS_API ms_status ms_optimizer_step_with(ms_optimizer *opt, const ms_step_options *opts, int *applied);

/* The learning rate of the following steps, replacing the schedule (a trainer that owns its schedule calls
** it before each step).  Errors: MS_E_ARG (lr negative, NaN or infinite). */
MS_API ms_status ms_optimizer_set_lr(ms_optimizer *opt, double lr);
/* *lr <- the learning rate the next step will use. */
MS_API ms_status ms_optimizer_get_lr(ms_optimizer *opt, double *lr);

/* Writes the optimizer's state (its tensors by name, the step count, the options, the recipe's name and
** content hash) to a safetensors file, atomically.  Errors: MS_E_IO. */
MS_API ms_status ms_optimizer_save(ms_optimizer *opt, const char *path);
/* Restores a checkpoint written by ms_optimizer_save for the same recipe (same content hash) and
** parameters.  Everything is checked before anything changes.  Errors: MS_E_IO (the file cannot be read),
** MS_E_FORMAT (corrupt, or not fitting this optimizer: another recipe, missing state, other shapes). */
MS_API ms_status ms_optimizer_load(ms_optimizer *opt, const char *path);

/* *json_out <- a new NUL-terminated JSON text, to be freed with ms_string_free.
**  info:  {"recipe", "params": [{"name", "route", "group", "shape", "dtype", "state_bytes", ...}],
**          "groups": [{"id", "route", "params", "overrides", "state_bytes"}], "total_state_bytes"}
**  stats: {"step", "skipped_steps", "lr", "last": the last step's numbers ("skipped", "grad_norm",
**          "launches", "reports": what the recipe reported, ...)}
** Numbers that JSON cannot hold (NaN, infinities) are written as the strings "nan", "inf", "-inf". */
MS_API ms_status ms_optimizer_info(ms_optimizer *opt, char **json_out);
MS_API ms_status ms_optimizer_stats(ms_optimizer *opt, char **json_out);
/* Frees a string returned by moonstep (NULL is fine). */
MS_API void ms_string_free(char *s);

/* Captures the step into CUDA graphs (one per plan key) that later steps replay: the Lua optimizer's
** opt:capture().  Errors: MS_E_UNSUPPORTED (a CPU context, or a runtime without graph capture), and
** those of the capture. */
MS_API ms_status ms_optimizer_capture(ms_optimizer *opt);

/* Inside a trainer's CUDA graph.  A trainer that captures its training step into a graph of its own, in a
** capture that holds the context's stream (begun on it with cudaStreamBeginCapture or ms_graph_begin, or
** joined to it by an event wait, as the Python bridge does inside torch.cuda.graph), may call
** ms_optimizer_step / _step_with during that capture: the step is then recorded into the trainer's graph
** (ms_graph_join), with no host sync and no allocation from the driver, and nothing runs until a replay.
** Conditions:
**  - Warm-up: create the optimizer with the setting "device_checks": true (or call ms_optimizer_capture), and
**    run one uncaptured ms_optimizer_step first (the gradients may live elsewhere then): it creates the
**    recipe's state, the context's handles and the cached memory that a capture cannot allocate.  A step
**    captured before that, or without device checks, fails with MS_E_UNSUPPORTED and records nothing (a
**    recipe plan that has not run uncaptured yet, such as DASH's refresh step, fails with MS_E_ARG).
**  - The recorded step reads the gradients' and parameters' memory of the capture on every replay
**    (ms_optimizer_set_grad afterwards does not change the graph), and checks and skips non-finite
**    gradients on the device ("nonfinite": "raise" and "stats" cannot be captured); *applied is -1.
**  - Recording counts no step and writes no learning rate: call ms_optimizer_prepare_replay before each
**    replay of the graph.
**  - While the stream is captured, ms_optimizer_save, _load and _capture, and _info or _stats before the
**    first step, fail with MS_E_UNSUPPORTED (they would read the device or allocate).
** CPU contexts have no graphs. */

/* Before each replay of a graph holding a step recorded as above (outside the capture, on the context's
** stream or ordered after its work): writes this replay's learning rate (the schedule's, or the last
** ms_optimizer_set_lr) and step number into the device scalars that the recorded step reads, and counts
** the step, exactly as an uncaptured ms_optimizer_step advances the step count and the schedule.  Call it
** once per replay, in the replays' order.  A skipped replay (non-finite gradients) still counts, as the
** host cannot know; ms_optimizer_stats reads the device's skip count.
** Errors: MS_E_UNSUPPORTED (a CPU context; the context's stream is being captured), MS_E_ARG (no step has
** been recorded into a graph yet), and those of the device. */
MS_API ms_status ms_optimizer_prepare_replay(ms_optimizer *opt);
/* ms_optimizer_prepare_replay with options (NULL: none): opts->grad_scale is this replay's loss scale, given
** exactly when the recorded step was given one (its gradients are then unscaled by 1 / grad_scale on the
** device).  Errors: as ms_optimizer_prepare_replay, and MS_E_ARG (grad_scale < 0, NaN or infinite; given
** for a step recorded without one, or missing for a step recorded with one). */
MS_API ms_status ms_optimizer_prepare_replay_with(ms_optimizer *opt, const ms_step_options *opts);

/* ---------------------------------------------------------------------------------------------------
** Profiling
**
** Named ranges for profilers (NVTX: Nsight Systems shows them on the timeline of the thread that opened
** them).  The CUDA backend also opens one around each op it queues, named after the public call
** ("ms_adamw_step", "ms_binary", ...), and the Lua optimizer one around each recipe route's step
** ("moonstep:<route>").  Ranges mark host time: inside a captured graph they show where ops were recorded,
** not the replays.  Ranges nest; push and pop on the same thread.
** ------------------------------------------------------------------------------------------------- */

/* Opens a range called `name` (copied).  A no-op for a CPU context, NULL arguments, or a build without NVTX. */
MS_API void ms_profile_push(ms_ctx *ctx, const char *name);
/* Closes the innermost range opened on this thread (a no-op where ms_profile_push is one). */
MS_API void ms_profile_pop(ms_ctx *ctx);

/* ---------------------------------------------------------------------------------------------------
** A cap on a Lua state's heap (the recipe sandbox)
**
** The sandbox's instruction hook looks at the Lua heap only every so many instructions, and one concatenation
** can build a string of gigabytes in between.  moonstep.recipe therefore puts this allocator in front of the
** state's own (lua_setallocf, cap->alloc and cap->ud holding the previous pair) while an untrusted recipe
** runs: it forwards every request, and refuses (NULL, so Lua raises "not enough memory") one that would make
** `grown` (bytes allocated less bytes freed since the cap was armed) exceed `limit`, setting `refused`.
** Shrinks and frees are never refused.  Having refused one, it puts the wrapped allocator back
** (setallocf(L, alloc, ud), when setallocf is set): the error's unwinding, and whatever the sandbox does about
** it, must not meet a second refusal.  `allocated` adds up the growth it granted (bytes, frees not taken
** off): all the heap the recipe's calls can have added to what it keeps, which the sandbox's retained-memory
** check uses to decide when to measure that again.
** ------------------------------------------------------------------------------------------------- */

typedef struct ms_lua_heap_cap {
    void   *(*alloc)(void *ud, void *ptr, size_t osize, size_t nsize);   /* the allocator wrapped */
    void    *ud;
    int64_t  grown;
    int64_t  allocated;                                                /* growth granted, frees not taken off */
    int64_t  limit;
    int32_t  refused;
    void    *L;                                                        /* the Lua state, for setallocf */
    void    (*setallocf)(void *L, void *f, void *ud);                  /* lua_setallocf, or NULL */
    struct ms_lua_heap_cap *next;                                      /* (the library's list of caps) */
} ms_lua_heap_cap;

/* A zeroed cap that lives as long as the process (NULL when out of memory): a Lua state closed while its cap is
** armed frees its objects through it, so it is never freed; the library keeps it on a list, where leak checkers
** see it reachable.  One per Lua state. */
MS_API ms_lua_heap_cap *ms_lua_heap_cap_new(void);

/* A lua_Alloc whose ud is an ms_lua_heap_cap. */
MS_API void *ms_lua_heap_cap_alloc(void *ud, void *ptr, size_t osize, size_t nsize);
/* Puts the wrapped allocator back: setallocf(L, alloc, ud) (a no-op without setallocf).  From C, so that
** disarming allocates nothing while the cap is still armed. */
MS_API void ms_lua_heap_cap_disarm(ms_lua_heap_cap *cap);

/* ---------------------------------------------------------------------------------------------------
** Communicators (NCCL on CUDA, TCP on the CPU)
**
** A communicator joins one context per process (rank) of a job of world_size ranks, and runs collectives
** over their tensors.  On CUDA contexts through NCCL, queued on the context's stream (no host sync: the
** results are there when the stream reaches them).  On CPU contexts over TCP: every rank keeps a socket to
** rank 0 (opened by the rendezvous below), each collective goes through rank 0, which combines the ranks'
** data in rank order 0 .. N-1 (the result does not depend on timing; bf16 and f16 are summed in f32 and
** rounded once, i32 and u8 sums wrap) and sends the results back; it is done when the call returns.  A CPU
** collective waits at most the communicator's timeout for the other ranks: a rank that is gone, stuck or
** making other calls (named when rank 0 can tell) ends it with MS_E_IO (MS_E_ARG: the ranks' calls differ),
** on every rank, and the communicator then refuses every later collective.  Every rank makes the same calls
** in the same order, with tensors of the same shapes and dtypes (on the CPU a collective of no elements is
** still a call, compared with the others': NCCL's does nothing).  Tensors are contiguous (MS_E_LAYOUT), of
** f32, bf16, f16, f64, i32 or u8 (MS_E_DTYPE), on the communicator's context's device (MS_E_DEVICE); shapes
** that do not fit are MS_E_SHAPE.  A CUDA context in a build without NCCL gets MS_E_UNSUPPORTED, and so does
** ms_comm_unique_id there.
**
** The CUDA ranks agree on NCCL's unique id (128 bytes, made by rank 0) either through the caller (a PyTorch
** trainer broadcasts it with torch.distributed and passes it to every rank), or through moonstep's TCP
** rendezvous (the CPU ranks always meet there, and keep its connections): rank 0 listens on addr:port,
** the other ranks connect to it (retrying until the timeout) and receive the id; the world size is checked
** on both sides.  A rank that never arrives makes rank 0 fail
** with MS_E_IO naming the missing ranks once the timeout has passed (and the waiting ranks with it).
** NVLink multicast (NVLS) is left to NCCL's environment: moonstep never enables it (`moonstep launch` sets
** NCCL_NVLS_ENABLE=0 in its ranks' environment).
** ------------------------------------------------------------------------------------------------- */

#define MS_COMM_ID_BYTES 128
enum { MS_COMM_ID_SIZE = MS_COMM_ID_BYTES };   /* the same number for the generated cdef */

typedef struct ms_comm ms_comm;

typedef enum ms_comm_op {
    MS_COMM_SUM = 0,
    MS_COMM_MAX = 1,
    MS_COMM_MIN = 2,
    MS_COMM_AVG = 3      /* floating dtypes only (MS_E_DTYPE for i32 and u8) */
} ms_comm_op;

typedef struct ms_comm_options {
    int                  rank;         /* this process's rank, in [0, world_size) */
    int                  world_size;   /* >= 1 */
    const unsigned char *unique_id;    /* MS_COMM_ID_BYTES bytes from rank 0's ms_comm_unique_id, the same on
                                       ** every rank; NULL = exchange it through the rendezvous.  CUDA only:
                                       ** a CPU context needs NULL (MS_E_ARG), its ranks meet at addr:port */
    const char          *addr;         /* rendezvous address (rank 0's host); NULL = $MASTER_ADDR */
    int                  port;         /* rendezvous TCP port; 0 = $MASTER_PORT */
    int                  timeout_ms;   /* for the rendezvous and NCCL's set-up together, and (CPU) for each
                                       ** collective; 0 = 300000 (5 min) */
} ms_comm_options;

/* out <- a new NCCL unique id (on rank 0, to be handed to every rank).
** Errors: MS_E_UNSUPPORTED (built without NCCL), MS_E_BACKEND. */
MS_API ms_status ms_comm_unique_id(unsigned char out[MS_COMM_ID_BYTES]);

/* The rendezvous alone: rank 0 listens on addr:port and sends `id` (MS_COMM_ID_BYTES, read on rank 0) to
** ranks 1 .. world_size-1, which connect to it and receive it into `id`.  addr NULL means $MASTER_ADDR,
** port 0 $MASTER_PORT; timeout_ms 0 means 300000; world_size 1 returns at once.  Rank 0 binds the address
** given (so 127.0.0.1 stays local).
** Errors: MS_E_ARG (rank out of [0, world_size), port out of [1, 65535], no address, an address that does
** not resolve, a rank reporting another world size or making a CPU communicator, or a rank claimed twice),
** MS_E_IO (rank 0 cannot listen,
** a rank cannot reach rank 0 in time, ranks missing at the timeout: named), MS_E_FORMAT (the peer speaks
** something other than this rendezvous).  Connections to rank 0 that send anything else are dropped (and
** counted in the timeout's message). */
MS_API ms_status ms_rendezvous(const char *addr, int port, int rank, int world_size, int timeout_ms,
                               unsigned char id[MS_COMM_ID_BYTES]);

/* Creates this rank's communicator on ctx (a CUDA context: its device and stream; a CPU context: TCP).
** opts NULL means {rank 0, world_size 1}.  Blocks until every rank has joined, or the timeout (MS_E_IO, and
** nothing made).  Every rank's context is of the same kind (the rendezvous refuses a mix: MS_E_ARG).
** Errors (*out NULL): MS_E_ARG (NULL ctx or out, options out of range, a unique_id for a CPU context),
** MS_E_UNSUPPORTED (CUDA context, built without NCCL), those of ms_rendezvous, MS_E_BACKEND (NCCL). */
MS_API ms_status ms_comm_new(ms_ctx *ctx, const ms_comm_options *opts, ms_comm **out);
/* ms_comm_new with rank and world size from the launcher's environment (torchrun, `moonstep launch`):
** RANK and WORLD_SIZE (required), MASTER_ADDR and MASTER_PORT (the rendezvous, when WORLD_SIZE > 1).
** LOCAL_RANK is checked to be a number when set, but the device is the caller's choice: create ctx on
** "cuda:" .. LOCAL_RANK (as the launchers expect, one GPU per rank), or "cpu".  Errors: MS_E_ARG (a
** variable missing or malformed, named), and those of ms_comm_new. */
MS_API ms_status ms_comm_new_from_env(ms_ctx *ctx, int timeout_ms, ms_comm **out);
/* Destroys the communicator (NULL is fine); call it on every rank. */
MS_API void ms_comm_free(ms_comm *comm);
/* Gives the communicator up after an error on this rank that the others cannot see (one between the
** collectives of a step: the optimizer runtime calls it when a recipe fails there): every later collective
** here is refused, and the other ranks' current or next collective fails at once with MS_E_IO naming this
** rank and `why` (NULL: no reason), instead of waiting for this rank until the timeout.  On the CPU a rank
** tells rank 0, which tells the others (rank 0 tells them itself).  A communicator that failed already is
** left as it is.  Free it on every rank afterwards.
** Errors: MS_E_ARG (NULL comm), MS_E_UNSUPPORTED (NCCL's communicators: their ranks wait for the missing
** one until NCCL's own timeout; end the process instead). */
MS_API ms_status ms_comm_abort(ms_comm *comm, const char *why);

MS_API int ms_comm_rank(const ms_comm *comm);   /* -1 for NULL */
MS_API int ms_comm_size(const ms_comm *comm);   /* the world size; -1 for NULL */

/* dst <- op over the ranks of src (elementwise); dst == src works in place.  dst and src: the same shape
** and dtype, and otherwise disjoint (MS_E_LAYOUT). */
MS_API ms_status ms_comm_all_reduce(ms_comm *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op);
/* t <- root's t on every rank.  Errors: MS_E_ARG (root out of range). */
MS_API ms_status ms_comm_broadcast(ms_comm *comm, ms_tensor *t, int root);
/* dst <- the ranks' src concatenated in rank order: dst has world_size times src's elements, as the shape
** [world_size, ...src's shape] or src's shape with dim 0 multiplied by world_size.  src may be rank's own
** slice of dst (in place); otherwise they must not overlap (MS_E_LAYOUT). */
MS_API ms_status ms_comm_all_gather(ms_comm *comm, ms_tensor *dst, const ms_tensor *src);
/* dst <- slice `rank` of op over the ranks of src: src has world_size times dst's elements (shapes as in
** ms_comm_all_gather, reversed); dst may be rank's own slice of src (in place), otherwise disjoint. */
MS_API ms_status ms_comm_reduce_scatter(ms_comm *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op);

/* Groups: the collectives between ms_comm_group_begin and the matching ms_comm_group_end are issued as one
** group (CUDA: ncclGroupStart / ncclGroupEnd, so many small broadcasts cost one launch; NCCL may start them
** only at the end).  On the CPU they run at once, in order, and the calls just count.  Groups nest; every
** rank makes the same group calls.  ms_comm_free ends the groups left open.  Errors: MS_E_ARG (NULL comm, an
** end without a begin), MS_E_BACKEND (NCCL). */
MS_API ms_status ms_comm_group_begin(ms_comm *comm);
MS_API ms_status ms_comm_group_end(ms_comm *comm);

#ifdef __cplusplus
}
#endif

#endif /* MOONSTEP_H */

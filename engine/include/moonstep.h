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
**  - Every fallible call returns ms_status: MS_OK (0) or a negative error class.  On error nothing was
**    changed, and a message naming the function, the problem and the values is kept per context
**    (ms_ctx_last_error) and per thread (ms_last_error).  The engine never exits, aborts or prints.
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
#define MS_ABI_VERSION 1
#define MS_VERSION_STRING "0.1.0"
enum { MS_ABI = MS_ABI_VERSION };    /* the same number as an enum, so that the generated cdef carries it */

/* ---------------------------------------------------------------------------------------------------
** Status codes and errors
** ------------------------------------------------------------------------------------------------- */

typedef enum ms_status {
    MS_OK            =  0,
    MS_E_ARG         = -1,   /* invalid argument: NULL where an object is needed, bad index, bad enum value */
    MS_E_SHAPE       = -2,   /* shapes or dims that do not fit together */
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

typedef struct ms_ctx_options {
    int64_t mem_limit;     /* bytes the context may hold allocated at once; 0 = no limit */
    void   *stream;        /* CUDA: a cudaStream_t owned by the caller to run on; NULL = the context's own */
    int     num_threads;   /* CPU: OpenMP threads for this context's ops; 0 = the OpenMP default */
} ms_ctx_options;

/* Creates a context on `device`: "cpu", "cuda", "cuda:N", or "auto" (the first GPU when one is present and
** the build has CUDA, else the CPU).  opts may be NULL.
** Errors: MS_E_ARG (unparsable device string), MS_E_UNSUPPORTED (backend not compiled in),
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
** Errors: MS_E_ARG (ndim out of [0, MS_MAX_DIMS], negative size), MS_E_DTYPE, MS_E_OOM. */
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

/* Views (no copy).  reshape needs a layout the new shape can be viewed in (MS_E_LAYOUT otherwise: call
** ms_tensor_contiguous first); one size may be -1 (inferred).  slice keeps [start, stop) with step >= 1
** (start/stop are clamped like Python slices; negative values count from the end).  select removes dim.
** expand broadcasts dims of size 1 to larger sizes with stride 0 (and may add leading dims). */
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
** otherwise.  Elementwise ops broadcast their sources to dst's shape (NumPy rules), accept any float
** dtype for dst and sources (computed in f64 when any of them is f64 or i32, otherwise in f32; bf16/f16
** stored with round-to-nearest-even), and may run in place (dst the same view as a source).  A dst that
** partially overlaps a source, or has stride-0 (expanded) dims, is refused (MS_E_LAYOUT).
** All tensors of one call must live on ctx's device (MS_E_DEVICE), except in ms_copy.
** ------------------------------------------------------------------------------------------------- */

/* dst <- src, converting dtype (cast) and broadcasting src to dst's shape; src and dst may be on
** different devices (host <-> device copies go through ms_copy too). */
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
** Float dtypes only. */
MS_API ms_status ms_rand(ms_ctx *ctx, ms_tensor *dst, const ms_rand_options *opts);

typedef enum ms_unary_op {
    MS_UNARY_NEG = 0, MS_UNARY_ABS, MS_UNARY_SQRT, MS_UNARY_RSQRT, MS_UNARY_EXP, MS_UNARY_LOG,
    MS_UNARY_SIGN, MS_UNARY_SQUARE, MS_UNARY_RECIPROCAL, MS_UNARY_TANH, MS_UNARY_SIGMOID, MS_UNARY_RELU,
    MS_UNARY_SIN, MS_UNARY_COS,
    MS_UNARY_COUNT
} ms_unary_op;

/* dst <- op(src). */
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

/* dst <- min(max(src, lo), hi); use -inf / +inf for an open side.  NaN stays NaN. */
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
** or kept as size 1 (one element for MS_DIM_ALL).  Accumulates in f32 (f64 for f64 and i32 sources) in a
** fixed order: results do not depend on the thread count.  max/min propagate NaN; a reduction over zero
** elements gives 0 for sum/sumsq/norm2, NaN for mean and MS_E_SHAPE for max/min/amax. */
MS_API ms_status ms_reduce(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, ms_reduce_op op, int dim);

/* dst (one element) <- sum(a * b) over all elements; a and b have the same shape. */
MS_API ms_status ms_dot(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b);

typedef struct ms_matmul_options {
    int    trans_a, trans_b;  /* use the transpose of the last two dims of a / b */
    double alpha, beta;       /* dst <- alpha * op(a) op(b) + beta * dst; NULL options: 1, 0 */
    int    allow_tf32;        /* CUDA f32: TF32 tensor cores allowed (inputs rounded to 10 bits) */
} ms_matmul_options;

/* Batched matrix product.  a: [..., m, k] (or [..., k, m] with trans_a), b: [..., k, n] (or [..., n, k]),
** dst: [..., m, n].  Batch dims broadcast (a 2-D operand is shared by every batch).  dtypes: f32, f64, or
** bf16/f16 inputs (f32 accumulation) with dst of any float dtype; a and b must have the same dtype.
** dst must not overlap a or b.  beta = 0 ignores dst's previous contents (NaN included). */
MS_API ms_status ms_matmul(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                           const ms_matmul_options *opts);

/* dst [..., n, n] <- identity in every batch (dst may be non-square: ones on the main diagonal). */
MS_API ms_status ms_eye(ms_ctx *ctx, ms_tensor *dst);

/* dst [..., n, n] <- diagonal matrix of src [..., n], or dst [..., n] <- diagonal of src [..., n, n]. */
MS_API ms_status ms_diag(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src);

/* Symmetric eigendecomposition (batched over leading dims) of a [..., n, n] (the lower triangle is used):
** w [..., n] eigenvalues in ascending order, v [..., n, n] eigenvectors in columns (may be NULL for values
** only).  f32 or f64 (all three the same dtype).  A non-converged batch member gives MS_E_NUMERIC, with
** *info (may be NULL) set to the LAPACK/cuSOLVER info of the first failing member, and a message naming it. */
MS_API ms_status ms_eigh(ms_ctx *ctx, ms_tensor *w, ms_tensor *v, const ms_tensor *a, int *info);

/* ---------------------------------------------------------------------------------------------------
** safetensors files
**
** The format: 8-byte little-endian header length N, N bytes of JSON header {name: {"dtype", "shape",
** "data_offsets": [begin, end]}, "__metadata__": {string: string}}, then the data.  Every size, offset,
** dtype and shape is validated on load; a corrupt or truncated file is MS_E_FORMAT naming the problem.
** ------------------------------------------------------------------------------------------------- */

/* Writes n named tensors (any device, any layout; names unique, non-empty, not "__metadata__") and an
** optional metadata JSON object whose values are all strings (NULL or "" for none).  The file is written
** atomically: a temporary file in the same folder, fsync, rename, fsync of the folder. */
MS_API ms_status ms_safetensors_save(ms_ctx *ctx, const char *path, int n, const char *const *names,
                                     const ms_tensor *const *tensors, const char *metadata_json);

typedef struct ms_tensor_set ms_tensor_set;

/* Reads a safetensors file into tensors on ctx's device (dtypes F32 F64 BF16 F16 I32 U8). */
MS_API ms_status ms_safetensors_load(ms_ctx *ctx, const char *path, ms_tensor_set **out);

MS_API int ms_tensor_set_count(const ms_tensor_set *set);
/* Name of entry i (in file order), NULL when i is out of range. */
MS_API const char *ms_tensor_set_name(const ms_tensor_set *set, int i);
/* A new handle to entry i's tensor (free it with ms_tensor_free). */
MS_API ms_status ms_tensor_set_get(const ms_tensor_set *set, int i, ms_tensor **out);
/* The file's __metadata__ as a JSON object string ("{}" when the file has none). */
MS_API const char *ms_tensor_set_metadata(const ms_tensor_set *set);
MS_API void ms_tensor_set_free(ms_tensor_set *set);

#ifdef __cplusplus
}
#endif

#endif /* MOONSTEP_H */

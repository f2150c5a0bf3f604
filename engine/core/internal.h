/*
** Engine internals shared by the core and the backends: the context and tensor structs, the backend
** table every device implements, error helpers and the elementwise iteration descriptor.
** Nothing here is exported (the library is built with -fvisibility=hidden).
*/
#ifndef MS_INTERNAL_H
#define MS_INTERNAL_H

#include "moonstep.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stddef.h>
#include <time.h>

#define MS_ERRMSG_SIZE 1024
#define MS_STRINGIFY_(x) #x
#define MS_STRINGIFY(x) MS_STRINGIFY_(x)

typedef struct ms_backend ms_backend;

/* One collective sum over the ranks, in place, of `count` elements of dtype dt at `buf` (memory of the
** backend's device); the core implements it with the comm (sharded SinkGD's exchanges). */
typedef struct ms_exchange {
    ms_status (*sum)(void *user, void *buf, int64_t count, ms_dtype dt);
    void *user;
} ms_exchange;

/* Memory owned by one or more tensors (views share it).  Foreign storage is never freed. */
typedef struct ms_storage {
    atomic_int refcount;
    ms_ctx    *ctx;        /* the context whose allocator owns the memory (retained) */
    void      *data;
    size_t     nbytes;
    bool       owned;
    /* (optional) called once when the storage goes: foreign memory's owner (a DLPack producer) */
    void     (*release)(void *arg);
    void      *release_arg;
} ms_storage;

struct ms_tensor {
    ms_storage *storage;
    ms_ctx     *ctx;       /* retained */
    ms_dtype    dtype;
    int         ndim;
    int64_t     shape[MS_MAX_DIMS];
    int64_t     strides[MS_MAX_DIMS];
    int64_t     offset;    /* in elements from storage->data */
    bool        has_rng;   /* ms_tensor_set_rng_origin */
    ms_rng_origin rng;
};

struct ms_ctx {
    atomic_int         refcount;
    ms_device_type     type;
    int                index;
    char               name[32];
    const ms_backend  *backend;
    void              *impl;          /* backend-specific state (CUDA: stream, handles, pool) */
    int                num_threads;
    /* memory accounting (every backend's alloc/free goes through the core, which keeps these; bytes_in_use,
    ** peak_bytes, num_allocs and num_frees only through __atomic builtins: frees come from any thread) */
    int64_t            mem_limit;
    int64_t            bytes_in_use, peak_bytes, num_allocs, num_frees, num_device_allocs;
    int64_t            launches;
    int64_t            bytes_cached;  /* kept by the backend's pool for reuse (CUDA), maintained by the backend */
    char               last_error[MS_ERRMSG_SIZE];
};

/* A captured op sequence (engine/core/runtime.c); backends extend it (the CUDA one: engine/cuda/cuda.h). */
struct ms_graph {
    ms_ctx *ctx;          /* retained */
};

/* A device-resident or host scalar: the value of `t` when t != NULL, else v. */
typedef struct ms_scalar {
    double           v;
    const ms_tensor *t;
} ms_scalar;

/* Elementwise iteration over dst's shape with broadcast sources: operand 0 is dst, 1.. the sources.
** Dims of size 1 are dropped and adjacent dims merged where every operand allows it, so a fully
** contiguous op has ndim 1. */
#define MS_NARY_MAX 4
typedef struct ms_nary {
    int      nops;                       /* dst + sources */
    int      ndim;
    int64_t  numel;
    int64_t  shape[MS_MAX_DIMS];
    int64_t  strides[MS_NARY_MAX][MS_MAX_DIMS];   /* elements; 0 on broadcast dims */
    char    *data[MS_NARY_MAX];                   /* first element */
    ms_dtype dtype[MS_NARY_MAX];
    bool     contiguous;                 /* every operand dense in the same row-major order, no broadcast */
    bool     wide;                       /* compute in f64 */
} ms_nary;

/* The one backend table: every device implements every member (CPU first, it is the reference).
** Arguments have been validated by the core (shapes, dtypes, devices, layouts) before a member is called;
** members check only what is specific to them and report MS_E_UNSUPPORTED for what they cannot do. */
struct ms_backend {
    const char *name;
    /* device memory: the core does the accounting and the limit */
    ms_status (*ctx_init)(ms_ctx *ctx, const ms_ctx_options *opts);
    void      (*ctx_release)(ms_ctx *ctx);
    ms_status (*alloc)(ms_ctx *ctx, size_t nbytes, void **out);
    void      (*free)(ms_ctx *ctx, void *ptr, size_t nbytes);   /* (optional) deferred on devices */
    ms_status (*sync)(ms_ctx *ctx);
    /* host <-> device of a contiguous byte range */
    ms_status (*memcpy_to_host)(ms_ctx *ctx, void *dst, const void *src, size_t nbytes);
    ms_status (*memcpy_from_host)(ms_ctx *ctx, void *dst, const void *src, size_t nbytes);
    /* ops on tensors of this backend's device */
    ms_status (*copy)(ms_ctx *ctx, const ms_nary *it);                    /* dst <- cast(src) */
    ms_status (*fill)(ms_ctx *ctx, const ms_nary *it, ms_scalar v);
    ms_status (*rand)(ms_ctx *ctx, ms_tensor *dst, const ms_rand_options *o);
    ms_status (*unary)(ms_ctx *ctx, const ms_nary *it, ms_unary_op op);
    ms_status (*binary)(ms_ctx *ctx, const ms_nary *it, ms_binary_op op);
    ms_status (*binary_scalar)(ms_ctx *ctx, const ms_nary *it, ms_scalar s, ms_binary_op op, int scalar_first);
    ms_status (*clamp)(ms_ctx *ctx, const ms_nary *it, double lo, double hi);
    /* ternary family: lerp (a, b; w), addcmul / addcdiv (a, b, c; v) */
    ms_status (*lerp)(ms_ctx *ctx, const ms_nary *it, ms_scalar w);
    ms_status (*addc)(ms_ctx *ctx, const ms_nary *it, ms_scalar v, int divide);
    /* reductions: src viewed as [outer, len, inner] (dim reduced = len); dst has outer*inner elements */
    ms_status (*reduce)(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, ms_reduce_op op, int dim);
    ms_status (*dot)(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b);
    ms_status (*matmul)(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                        const ms_matmul_options *o);
    ms_status (*eye)(ms_ctx *ctx, ms_tensor *dst);
    ms_status (*diag)(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src);
    ms_status (*eigh)(ms_ctx *ctx, ms_tensor *w, ms_tensor *v, const ms_tensor *a, int *info);
    /* runtime, all (optional): NULL where the device has no such thing.  The core then answers
    ** MS_E_UNSUPPORTED (graphs), does nothing (empty_cache), returns NULL (stream) or uses the host's
    ** monotonic clock (events). */
    void     *(*stream)(const ms_ctx *ctx);
    ms_status (*empty_cache)(ms_ctx *ctx);
    ms_status (*event_create)(ms_ctx *ctx, void **ev);
    void      (*event_destroy)(ms_ctx *ctx, void *ev);
    ms_status (*event_record)(ms_ctx *ctx, void *ev);
    ms_status (*event_elapsed)(ms_ctx *ctx, void *start, void *end, double *ms);   /* waits for end */
    ms_status (*graph_begin)(ms_ctx *ctx);
    ms_status (*graph_end)(ms_ctx *ctx, ms_graph **out);   /* the backend's graph, base.ctx retained */
    ms_status (*graph_launch)(ms_ctx *ctx, ms_graph *g);
    int64_t   (*graph_num_nodes)(const ms_graph *g);
    void      (*graph_free)(ms_graph *g);                   /* releases base.ctx too */
    /* multi-tensor ("foreach") ops and fused optimizer steps, as in moonstep.h after engine/core/optim_ops.c
    ** has validated them (sgd_step gets momentum_buf NULL when momentum == 0).  Last in the table, so a
    ** backend that does not list them has NULL here and the core answers MS_E_UNSUPPORTED. */
    ms_status (*foreach_sumsq)(ms_ctx *ctx, ms_tensor *dst, int n, const ms_tensor *const *srcs);
    ms_status (*foreach_scale)(ms_ctx *ctx, int n, ms_tensor *const *tensors, ms_scalar s);
    ms_status (*adamw_step)(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                            ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_sq, const double *scales,
                            const ms_adamw_options *o);
    ms_status (*sgd_step)(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                          ms_tensor *const *momentum_buf, const double *scales, const ms_sgd_options *o);
    /* SinkGD and 8-bit AdamW (engine/core/sinkgd_ops.c, engine/core/adamw8_ops.c); NULL: MS_E_UNSUPPORTED.
    ** sinkgd_step gets specnorm_u NULL in base mode and md_target_norm NULL outside sphere mode. */
    ms_status (*sinkgd_step)(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                             ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                             const double *scales, const ms_sinkgd_options *o);
    ms_status (*adamw8_step)(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                             ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_scale,
                             ms_tensor *const *exp_avg_sq, ms_tensor *const *exp_avg_sq_scale,
                             const double *scales, const ms_adamw8_options *o);
    /* Shampoo on stacked blocks (engine/core/dash_ops.c), as in moonstep.h after validation; NULL:
    ** MS_E_UNSUPPORTED.  blocks_apply gets opts NULL for the plain scatter. */
    ms_status (*blocks_gather)(ms_ctx *ctx, ms_tensor *stack, int n, const ms_block *blocks);
    ms_status (*blocks_apply)(ms_ctx *ctx, int n, const ms_block *blocks, const ms_tensor *stack,
                              const ms_tensor *scale, const ms_blocks_apply_options *o);
    ms_status (*dash_graft)(ms_ctx *ctx, ms_tensor *grad_ema, ms_tensor *adam_v, ms_tensor *norm,
                            ms_tensor *pgraft, const ms_tensor *grad, const ms_dash_graft_options *o);
    ms_status (*inv_root)(ms_ctx *ctx, ms_tensor *x, ms_tensor *residual, ms_tensor *iters,
                          const ms_tensor *a, const ms_root_options *o);
    ms_status (*spectrum_estimate)(ms_ctx *ctx, ms_tensor *lam_max, ms_tensor *lam_min, const ms_tensor *a,
                                   const ms_tensor *x_root, const ms_spectrum_options *o);
    /* Capture state and joining a caller's capture (engine/core/runtime.c checks the arguments); NULL:
    ** MS_CAPTURE_NONE and MS_E_UNSUPPORTED.  Profiler ranges; NULL: no-ops. */
    ms_capture (*capture_state)(const ms_ctx *ctx);
    ms_status (*graph_join)(ms_ctx *ctx);
    ms_status (*graph_leave)(ms_ctx *ctx);
    void      (*profile_push)(ms_ctx *ctx, const char *name);
    void      (*profile_pop)(ms_ctx *ctx);
    /* Communicators (engine/core/comm.c validates; engine/cuda/comm.c binds NCCL, engine/cpu/comm.c is TCP);
    ** NULL comm_init and comm_connect: MS_E_UNSUPPORTED.  comm_init blocks until the world has joined or
    ** timeout_ms has passed; the collectives queue on ctx's stream (CUDA) or are done on return (CPU).
    ** Counts are elements of dst (all_reduce, reduce_scatter), of src (all_gather), of t. */
    ms_status (*comm_init)(ms_ctx *ctx, const unsigned char id[MS_COMM_ID_BYTES], int rank, int world_size,
                           int timeout_ms, void **out);
    void      (*comm_destroy)(ms_ctx *ctx, void *comm);
    ms_status (*comm_all_reduce)(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op);
    ms_status (*comm_broadcast)(ms_ctx *ctx, void *comm, ms_tensor *t, int root);
    ms_status (*comm_all_gather)(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src);
    ms_status (*comm_reduce_scatter)(ms_ctx *ctx, void *comm, ms_tensor *dst, const ms_tensor *src, ms_comm_op op);
    /* Sharded SinkGD (engine/core/sinkgd_ops.c validates), as in moonstep.h; NULL: MS_E_UNSUPPORTED.
    ** Gets specnorm_u / md_target_norm as sinkgd_step does, shards never NULL, and x: the ranks' sum. */
    ms_status (*sinkgd_step_sharded)(ms_ctx *ctx, int n, ms_tensor *const *params,
                                     const ms_tensor *const *grads, ms_tensor *const *specnorm_u,
                                     ms_tensor *const *md_target_norm, const double *scales,
                                     const ms_shard *shards, const ms_sinkgd_options *o, const ms_exchange *x);
    /* Communicators whose backend connects the ranks itself (the CPU: TCP sockets to rank 0 through
    ** ms_rendezvous_connect) instead of through NCCL's id and comm_init; NULL: comm_init's way.  Blocks as
    ** comm_init does; addr NULL and port 0 mean MASTER_ADDR and MASTER_PORT. */
    ms_status (*comm_connect)(ms_ctx *ctx, const char *addr, int port, int rank, int world_size, int timeout_ms,
                              void **out);
    /* ms_comm_group_begin / _end (the core keeps the nesting depth and refuses an unbalanced end); NULL:
    ** nothing to do, the collectives run at once. */
    ms_status (*comm_group_begin)(ms_ctx *ctx, void *comm);
    ms_status (*comm_group_end)(ms_ctx *ctx, void *comm);
    /* ms_blocks_gather_factors (engine/core/dash_ops.c validates), as in moonstep.h; right may be NULL;
    ** NULL: MS_E_UNSUPPORTED. */
    ms_status (*blocks_gather_factors)(ms_ctx *ctx, ms_tensor *stack, ms_tensor *left, ms_tensor *right, int n,
                                       const ms_block *blocks, const ms_dash_factor_options *o);
    /* ms_comm_abort (why never NULL): the communicator is failed here and the other ranks are told;
    ** NULL: MS_E_UNSUPPORTED. */
    void      (*comm_abort)(ms_ctx *ctx, void *comm, const char *why);
};

/* Backends compiled into this build (the CUDA one only with MS_WITH_CUDA). */
extern const ms_backend ms_cpu_backend;
#ifdef MS_WITH_CUDA
extern const ms_backend ms_cuda_backend;
int ms_cuda_device_count(void);
/* Why ms_cuda_device_count() found no device (the CUDA runtime's words), for messages. */
const char *ms_cuda_probe_error(void);
#endif
#ifdef MS_WITH_NCCL
/* out <- a new NCCL unique id (engine/cuda/comm.c). */
ms_status ms_nccl_unique_id(unsigned char out[MS_COMM_ID_BYTES]);
#endif
/* The rendezvous of ms_rendezvous with the connections kept (engine/core/rendezvous.c): rank 0 gets
** fds[r] = rank r's socket (fds[0] = -1), rank r > 0 fds[0] = its socket to rank 0 (the others -1); the
** sockets are non-blocking.  fds has world_size entries; arguments checked by the caller. */
ms_status ms_rendezvous_connect(const char *addr, int port, int rank, int world_size, int timeout_ms, int *fds);
/* The context a communicator was made on (not retained); NULL for NULL (engine/core/comm.c). */
ms_ctx *ms_comm_context(const ms_comm *comm);

/* --- errors ------------------------------------------------------------------------------------- */

/* Records an error on ctx (may be NULL) and on the thread, and returns st.  The message is prefixed with
** the public function's name and suffixed with the source location. */
ms_status ms_error_at(ms_ctx *ctx, ms_status st, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
#define MS_FAIL(ctx, st, ...) ms_error_at((ctx), (st), __FILE__, __LINE__, __VA_ARGS__)
#define MS_TRY(expr) do { ms_status ms_try_st_ = (expr); if (ms_try_st_ != MS_OK) return ms_try_st_; } while (0)
/* Names the public call fn in the message of a failure st that a helper recorded without it (the allocator's
** "out of memory on cpu: ...", a backend's "eigh: ..."): "fn: " is put in front, in place of a leading
** "<fn without ms_>: ".  A message that already starts with "fn:" is kept.  Returns st (MS_OK untouched). */
ms_status ms_error_name(ms_ctx *ctx, ms_status st, const char *fn);

/* Formats a shape as "[2,3,4]" into buf (returns buf). */
const char *ms_shape_str(char *buf, size_t n, int ndim, const int64_t *shape);
/* The shape of a tensor as "[2,3,4]" in a rotating thread-local buffer (for messages; 4 live at once). */
const char *ms_tshape(const ms_tensor *t);

/* --- contexts and memory ------------------------------------------------------------------------ */

void ms_ctx_retain(ms_ctx *ctx);
void ms_ctx_release(ms_ctx *ctx);
/* Allocates nbytes on ctx's device, enforcing the limit and keeping statistics. */
ms_status ms_ctx_alloc(ms_ctx *ctx, size_t nbytes, void **out);
void ms_ctx_dealloc(ms_ctx *ctx, void *ptr, size_t nbytes);
static inline void ms_ctx_count_launch(ms_ctx *ctx) { ctx->launches++; }

/* --- tensors ------------------------------------------------------------------------------------ */

/* A new owning contiguous tensor (internal form of ms_tensor_new, no argument checks beyond size). */
ms_status ms_tensor_alloc(ms_ctx *ctx, ms_dtype dt, int ndim, const int64_t *shape, ms_tensor **out);
static inline void *ms_tensor_ptr(const ms_tensor *t)
{
    /* an empty tensor's storage may have no memory at all (NULL), and arithmetic on a null pointer is undefined
    ** even by 0 (UBSan: "applying zero offset to null pointer", ms.zeros({0}) under fuzz_recipe) */
    char *data = t->storage->data;
    return data ? data + t->offset * (int64_t)ms_dtype_size(t->dtype) : NULL;
}
bool ms_tensor_contiguous_p(const ms_tensor *t);
/* MS_E_LAYOUT when t cannot be written element by element: two of its elements may share an address (stride
** 0 or strides that do not nest); who names t in the message ("dst"). */
ms_status ms_check_writable(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t);
/* Stochastic rounding's numbering of param p at position `index` of a call (ms_tensor_set_rng_origin),
** resolved against p's shape.  The param is its whole's matrices sliced along one dim (rows = m or cols = n,
** checked by the setter), so element e = (b, i, j) is numbered (b rows + row0 + i) cols + col0 + j =
** e + base + (e / div) gap: div = n and gap = cols - n for a slice of columns, div = m n and gap = (rows - m)
** cols for a slice of rows (div = 0: e itself). */
typedef struct ms_rng_map {
    uint32_t member;
    int64_t  base, div, gap;
} ms_rng_map;

static inline ms_rng_map ms_rng_map_of(const ms_tensor *p, int index)
{
    ms_rng_map r = { (uint32_t)index, 0, 0, 0 };
    if (p == NULL || !p->has_rng) return r;
    r.member = p->rng.member;
    if ((p->rng.rows != 0 || p->rng.cols != 0) && p->ndim >= 2) {
        const int64_t m = p->shape[p->ndim - 2], n = p->shape[p->ndim - 1];
        r.base = p->rng.row0 * p->rng.cols + p->rng.col0;
        if (p->rng.cols != n) {
            r.div = n;
            r.gap = p->rng.cols - n;
        } else if (p->rng.rows != m) {
            r.div = m * n;
            r.gap = (p->rng.rows - m) * p->rng.cols;
        }
    }
    return r;
}

static inline uint64_t ms_rng_element(const ms_rng_map *r, int64_t e)
{
    return (uint64_t)(e + r->base + (r->div > 0 ? e / r->div * r->gap : 0));
}

static inline bool ms_dtype_is_float(ms_dtype dt)
{
    return dt == MS_DTYPE_F32 || dt == MS_DTYPE_F64 || dt == MS_DTYPE_BF16 || dt == MS_DTYPE_F16;
}
static inline bool ms_dtype_valid(ms_dtype dt) { return (unsigned)dt < MS_DTYPE_COUNT; }

/* Builds the iteration over dst with sources broadcast to it (checks shapes, devices, overlap). */
ms_status ms_nary_build(ms_ctx *ctx, const char *fn, ms_nary *it, ms_tensor *dst, int nsrc,
                        const ms_tensor *const *srcs);

/* --- bf16 / f16 conversions (round to nearest even; NaN stays NaN) ------------------------------ */

static inline float ms_bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}
static inline uint16_t ms_f32_to_bf16(float f)
{
    union { float f; uint32_t u; } v = { .f = f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* quiet NaN */
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + rounding) >> 16);
}
float ms_f16_to_f32(uint16_t h);
uint16_t ms_f32_to_f16(float f);
/* x rounded to dt's precision (bf16/f16 through f32), as a double. */
double ms_round_to_dtype(ms_dtype dt, double x);
/* The next value of dt below x (x a value of dt): keeps ms_rand's uniform range half-open after rounding. */
double ms_dtype_step_down(ms_dtype dt, double x);

/* --- argument checks of the fused group steps (engine/core/optim_ops.c) -------------------------------
** `fn` is the public function's name and `who` names the tensor in messages ("member 3 (exp_avg)"). */

ms_status ms_check_on_device(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t);
ms_status ms_check_contiguous(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t);
/* NULL passes; else one element of a float dtype on ctx's device. */
ms_status ms_check_device_scalar(ms_ctx *ctx, const char *fn, const char *who, const ms_tensor *t);
/* One tensor of a call for the overlap check (t NULL or empty: ignored; member -1: not a member's). */
typedef struct ms_arg_use {
    const ms_tensor *t;
    int              member;
    const char      *role;
    bool             written;
} ms_arg_use;
/* MS_E_LAYOUT naming the first pair (in the order given) where a written tensor shares memory with another
** tensor of the call; MS_E_OOM when the check itself cannot get host memory. */
ms_status ms_check_overlaps(ms_ctx *ctx, const char *fn, const ms_arg_use *uses, int64_t count);

/* A monotonic clock in milliseconds: the deadlines of the rendezvous and of the CPU communicator. */
static inline int64_t ms_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Big-endian words of the rendezvous's and the CPU communicator's messages. */
static inline void ms_put_be32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24); p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);  p[3] = (unsigned char)v;
}
static inline uint32_t ms_get_be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

#endif /* MS_INTERNAL_H */

/*
** Private to the CPU backend: strided views with dtype-converting loads and stores (the one way every
** CPU op reads and writes tensors of any layout and dtype), thread counts, scratch memory, and the
** backend members that engine/cpu/backend.c collects into ms_cpu_backend.
*/
#ifndef MS_CPU_H
#define MS_CPU_H

#include "internal.h"

/* Elements below which an op runs on one thread (forking costs more than it saves). */
#define MS_CPU_PAR_MIN 32768

/* A tensor-like window on memory: logical elements in row-major order of `shape`, element (i0..in) at
** base + sum(ik * strides[k]) elements of `dtype`.  ndim 0 is one element. */
typedef struct ms_cpu_view {
    int      ndim;
    int64_t  shape[MS_MAX_DIMS];
    int64_t  strides[MS_MAX_DIMS];
    ms_dtype dtype;
    char    *base;
} ms_cpu_view;

void ms_cpu_view_of(ms_cpu_view *v, const ms_tensor *t);
/* Operand k of an elementwise iteration. */
void ms_cpu_view_of_nary(ms_cpu_view *v, const ms_nary *it, int k);
int64_t ms_cpu_view_numel(const ms_cpu_view *v);

/* Logical elements [start, start + n) of v as f32 / f64: a pointer into v itself when they are one
** unit-stride run of that dtype already, otherwise converted into buf (n elements) and buf returned. */
const float *ms_cpu_load_f32(const ms_cpu_view *v, int64_t start, int64_t n, float *buf);
const double *ms_cpu_load_f64(const ms_cpu_view *v, int64_t start, int64_t n, double *buf);
/* Logical elements [start, start + n) of v <- src, converted to v's dtype (bf16/f16 round to nearest
** even; i32/u8 truncate toward zero and saturate, NaN -> 0). */
void ms_cpu_store_f32(const ms_cpu_view *v, int64_t start, int64_t n, const float *src);
void ms_cpu_store_f64(const ms_cpu_view *v, int64_t start, int64_t n, const double *src);
/* Where [start, start + n) of v can be written in place as T, or NULL when it is not one such run. */
float *ms_cpu_span_f32(const ms_cpu_view *v, int64_t start, int64_t n);
double *ms_cpu_span_f64(const ms_cpu_view *v, int64_t start, int64_t n);

/* Single values (1-element tensors, scalars read at execution time). */
double ms_cpu_read_scalar(const ms_scalar *s);

/* OpenMP threads the context's ops may use. */
int ms_cpu_threads(const ms_ctx *ctx);

/* Every logical element of dst <- src (same shape), both converted through f64 (exact for every dtype
** pair but f64 -> narrower ones, which round once). */
void ms_cpu_copy_view(const ms_ctx *ctx, const ms_cpu_view *dst, const ms_cpu_view *src);
void ms_cpu_fill_view(const ms_ctx *ctx, const ms_cpu_view *dst, double value);

/* Philox4x32-10 (Random123's philox4x32 with 10 rounds): out <- bijection of ctr under key. */
void ms_cpu_philox(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* --- the members of ms_cpu_backend (engine/cpu/backend.c) -------------------------------------- */

ms_status ms_cpu_copy(ms_ctx *ctx, const ms_nary *it);
ms_status ms_cpu_fill(ms_ctx *ctx, const ms_nary *it, ms_scalar v);
ms_status ms_cpu_rand(ms_ctx *ctx, ms_tensor *dst, const ms_rand_options *o);
ms_status ms_cpu_unary(ms_ctx *ctx, const ms_nary *it, ms_unary_op op);
ms_status ms_cpu_binary(ms_ctx *ctx, const ms_nary *it, ms_binary_op op);
ms_status ms_cpu_binary_scalar(ms_ctx *ctx, const ms_nary *it, ms_scalar s, ms_binary_op op, int scalar_first);
ms_status ms_cpu_clamp(ms_ctx *ctx, const ms_nary *it, double lo, double hi);
ms_status ms_cpu_lerp(ms_ctx *ctx, const ms_nary *it, ms_scalar w);
ms_status ms_cpu_addc(ms_ctx *ctx, const ms_nary *it, ms_scalar v, int divide);
ms_status ms_cpu_reduce(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src, ms_reduce_op op, int dim);
ms_status ms_cpu_dot(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b);
ms_status ms_cpu_matmul(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *a, const ms_tensor *b,
                        const ms_matmul_options *o);
ms_status ms_cpu_eye(ms_ctx *ctx, ms_tensor *dst);
ms_status ms_cpu_diag(ms_ctx *ctx, ms_tensor *dst, const ms_tensor *src);
ms_status ms_cpu_eigh(ms_ctx *ctx, ms_tensor *w, ms_tensor *v, const ms_tensor *a, int *info);
/* engine/cpu/optim.c: the multi-tensor helpers and fused optimizer steps */
ms_status ms_cpu_foreach_sumsq(ms_ctx *ctx, ms_tensor *dst, int n, const ms_tensor *const *srcs);
ms_status ms_cpu_foreach_scale(ms_ctx *ctx, int n, ms_tensor *const *tensors, ms_scalar s);
ms_status ms_cpu_adamw_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                            ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_sq, const double *scales,
                            const ms_adamw_options *o);
ms_status ms_cpu_sgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                          ms_tensor *const *momentum_buf, const double *scales, const ms_sgd_options *o);

/* engine/cpu/optim.c: how every fused step stores bf16/f16 params -- round to nearest even, or the stochastic
** rounding defined there (Philox counter: element, step, member) -- shared so that all steps round alike. */
typedef struct ms_cpu_rounding {
    bool     stochastic;
    uint32_t key[2];
    uint32_t step;       /* lo32 of the step number */
} ms_cpu_rounding;
ms_cpu_rounding ms_cpu_rounding_of(bool stochastic, uint64_t seed, double step);
/* Elements [e0, e0 + n) of a contiguous param <- x, numbered for stochastic rounding as `map` says
** (ms_rng_map_of; f32 params: stored as they are). */
void ms_cpu_store_param_f32(const ms_cpu_view *pv, const ms_cpu_rounding *r, const ms_rng_map *map, int64_t e0,
                            int64_t n, const float *x);
/* engine/cpu/sinkgd.c and engine/cpu/adamw8.c */
ms_status ms_cpu_sinkgd_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                             ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                             const double *scales, const ms_sinkgd_options *o);
ms_status ms_cpu_sinkgd_step_sharded(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                                     ms_tensor *const *specnorm_u, ms_tensor *const *md_target_norm,
                                     const double *scales, const ms_shard *shards, const ms_sinkgd_options *o,
                                     const ms_exchange *x);
ms_status ms_cpu_adamw8_step(ms_ctx *ctx, int n, ms_tensor *const *params, const ms_tensor *const *grads,
                             ms_tensor *const *exp_avg, ms_tensor *const *exp_avg_scale,
                             ms_tensor *const *exp_avg_sq, ms_tensor *const *exp_avg_sq_scale,
                             const double *scales, const ms_adamw8_options *o);

/* engine/cpu/dash.c: Shampoo on stacked blocks */
ms_status ms_cpu_blocks_gather(ms_ctx *ctx, ms_tensor *stack, int n, const ms_block *blocks);
ms_status ms_cpu_blocks_apply(ms_ctx *ctx, int n, const ms_block *blocks, const ms_tensor *stack,
                              const ms_tensor *scale, const ms_blocks_apply_options *o);
ms_status ms_cpu_dash_graft(ms_ctx *ctx, ms_tensor *grad_ema, ms_tensor *adam_v, ms_tensor *norm, ms_tensor *pgraft,
                            const ms_tensor *grad, const ms_dash_graft_options *o);
ms_status ms_cpu_inv_root(ms_ctx *ctx, ms_tensor *x, ms_tensor *residual, ms_tensor *iters, const ms_tensor *a,
                          const ms_root_options *o);
ms_status ms_cpu_spectrum_estimate(ms_ctx *ctx, ms_tensor *lam_max, ms_tensor *lam_min, const ms_tensor *a,
                                   const ms_tensor *x_root, const ms_spectrum_options *o);
ms_status ms_cpu_blocks_gather_factors(ms_ctx *ctx, ms_tensor *stack, ms_tensor *left, ms_tensor *right, int n,
                                       const ms_block *blocks, const ms_dash_factor_options *o);

#endif /* MS_CPU_H */

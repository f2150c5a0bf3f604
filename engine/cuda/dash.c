/*
** The CUDA backend's Shampoo on stacked blocks (moonstep.h, "Shampoo on stacked blocks (DASH)"; the reference is
** engine/cpu/dash.c, the kernels kernels/dash.cu): gather / apply / graft as one pass each, and the inverse-root
** solvers as batched cuBLAS GEMMs around small fused kernels.
**
** Fewer flops than DASH's own code, same mathematics:
**  - Every square product of a solver multiplies commuting symmetric matrices, so its result is symmetric: with
**    MOONSTEP_DASH_SPLIT = 2..4 the product is computed only on column panels below the diagonal (split 4: 10 of
**    16 tiles, 62.5% of the flops) and the finish pass mirrors the rest.  Off by default: on the H200 the panel
**    GEMMs ran at half the efficiency of full ones (see choose_split).  The default is one full batched GEMM per
**    product, with alpha carrying the constant factors (E = 1.5 I - 0.5 Z Y: alpha = -0.5, and +1.5 on the n
**    diagonal entries in a tiny kernel); a full finish pass runs only where a product must be measured (early
**    exit) or rounded to 16 bits.
**  - NDB skips the product its last step does not return (Z in the square-root chain, Y in the inverse one);
**    CN's first iteration X_1 = z^(1/p) N_0 is elementwise, its last skips the M recursion (4T - 4 products for
**    T iterations instead of 4T), and the recursion runs on N alone: N' = N^p (N - c I) + c I with
**    c = (p + 1) / p (the same polynomial as N' = ((p + 1) I - N^p M) / p with M = (p + 1) I - p N).
**  - Scales are folded into the first iterate (NDB's Z carries s^(-1/4), CN's X_0 carries z^(1/p)), so the last
**    product writes the root straight into x when no block list or early exit asks for a copy.
**  - Early exit (tolerance > 0): each check freezes the converged blocks on the device and saves their roots
**    (moonstep.h's per-block stopping, exactly); every iteration a one-CTA kernel moves the live blocks above the
**    live count into the frozen positions below it -- once at least 1/16 of the batch has frozen since the last
**    move (fewer ride along) -- and the host shrinks the batch of the GEMMs it queues next to the counts the
**    device has published (pinned memory, polled).  The check itself is one flat read of the product it tests
**    (kernels/dash.cu, finish_flat_kernel).  Every third iteration the host waits for
**    the count of two iterations ago -- an event wait, not a stream sync: the device keeps working on the
**    iterations queued since.  That wait is the only host synchronisation outside EVD; none under capture
**    (no compaction there: frozen blocks ride along, their results already saved).
**  - EVD: cusolverDnXsyevBatched (syevjBatched for n <= 32), falling back to per-block cusolverDnXsyevd on
**    several streams with their own handles where the batched call is refused; then Q diag(l^(-1/2p)) and one
**    symmetric product.
** Accuracy under TF32 (allow_tf32): NDB's root 4 feeds the first chain's square root, rounded to 2^-11 of its
** largest eigenvalue, into the second chain's inverse root, which amplifies that noise: blocks of condition
** beyond ~1e3 get roots far from the f32 ones (normalized error 0.1 at 1e4, ~1 at 1e5-1e7, in a numpy emulation
** of these chains and on the H200 alike; DASH's own TF32 NDB shows the same, research/anchors-h200.md).  The code
** is right (tests/cuda_dash_spec.lua: f32 within 1e-3 of the f64 map); TF32 NDB-4 is for well-conditioned blocks.
** Knobs for measurements (environment, read per call): MOONSTEP_DASH_SPLIT (1 plain GEMMs, the default; 2-4 panels),
** MOONSTEP_DASH_TILE (CN's TF32 products' cuBLASLt tile, solver_tile; 0: cublasGemmStridedBatchedEx),
** MOONSTEP_DASH_EVD (auto: batched, jacobi for n <= 32; streams; batched; jacobi), MOONSTEP_DASH_EVD_STREAMS (1..16, default 8),
** MOONSTEP_DASH_EVD_THREADS (1: one host thread per stream, the default; 0: one thread issues every block),
** MOONSTEP_DASH_LAG (iterations the host runs ahead of a compaction before it waits for its count, 1..4, default
** 2; 0: no compaction, no waits), MOONSTEP_DASH_SYNC_EVERY (iterations between those waits, default 3).
*/
#include "cuda.h"

#include <cublasLt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SKETCH_VECTORS 4
#define OFFSET_ROOT_PI ((uint64_t)1 << 32)   /* Philox offsets of moonstep.h ("Random vectors") */
#define OFFSET_SKETCH ((uint64_t)1 << 62)
#define EVD_STREAMS_MAX 16
#define PIN_RING 8                          /* compaction counts in flight (> the largest lag) */
#define NSLOTS_MAX 8
#define LT_CACHE 16                         /* product shapes whose cuBLASLt algorithm is kept */
#define LT_CANDIDATES 16                    /* the heuristic's candidates looked through for a preferred tile */
#define NDB_DIVERGED 2.0f                   /* engine/cpu/dash.c: max |Z Y - I| past it, an NDB block stops */

/* the options' rng_ids as the kernels read them (on the device: no host copy, so captures replay new ids) */
static const int *rng_ids_of(const ms_tensor *rng_ids) { return rng_ids ? (const int *)ms_tensor_ptr(rng_ids) : NULL; }

/* --- knobs ------------------------------------------------------------------------------------------- */

static int env_int(const char *name, int def, int lo, int hi)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') return def;
    char *end;
    long x = strtol(v, &end, 10);
    if (*end != '\0' || x < lo || x > hi) return def;
    return (int)x;
}

typedef enum evd_path { EVD_STREAMS, EVD_BATCHED, EVD_JACOBI } evd_path;

/* The default: Jacobi for n <= 32, else cusolverDnXsyevBatched -- on the H200 2.6 ms per 1024 block and 2.0 ms
** per 512 block, against 10.5 and 4.6 for per-block Xsyevd on 1-16 streams (a refresh of the subset 0.6 s instead
** of 1.7 s).  The streams path stays: selectable, and the fallback where the batched call is refused. */
static evd_path evd_path_for(int64_t n)
{
    const char *v = getenv("MOONSTEP_DASH_EVD");
    if (v && strcmp(v, "streams") == 0) return EVD_STREAMS;
    if (v && strcmp(v, "batched") == 0) return EVD_BATCHED;
    if (v && strcmp(v, "jacobi") == 0 && n >= 2 && n <= 32) return EVD_JACOBI;
    return n >= 2 && n <= 32 ? EVD_JACOBI : EVD_BATCHED;
}

/* --- per-context state: the eigensolver's side streams and handles, the pinned compaction counts ------ */

struct ms_cuda_dash {
    int                nstreams;
    cudaStream_t       stream[EVD_STREAMS_MAX];
    cusolverDnHandle_t solver[EVD_STREAMS_MAX];
    cudaEvent_t        fork, join[EVD_STREAMS_MAX];
    void              *host_ws[EVD_STREAMS_MAX];
    size_t             host_ws_bytes[EVD_STREAMS_MAX];
    cusolverDnParams_t params;
    int               *pinned;              /* [PIN_RING][2] */
    cudaEvent_t        pin_ev[PIN_RING];
    int                pin_next;
    int64_t            batched_refused;     /* a size cusolverDnXsyevBatched refused (0: none): streams for it */
    /* the factor products (ms_blocks_gather_factors): a cuBLASLt handle and the heuristic's first algorithm
    ** per shape and operand alignment, asked once (the heuristic is deterministic for fixed descriptors; kept so
    ** that no call depends on anything but its shapes and alignment) */
    cublasLtHandle_t   lt;
    int                nlt;
    struct lt_entry {
        int64_t m, k, batch;
        bool tf32;
        int tile;
        uint32_t align;
        cublasLtMatmulAlgo_t algo;
    } lt_algo[LT_CACHE];
};

void ms_cuda_dash_release(ms_cuda_ctx *c)
{
    struct ms_cuda_dash *d = c->dash;
    if (d == NULL) return;
    for (int i = 0; i < d->nstreams; i++) {
        if (d->solver[i]) cusolverDnDestroy(d->solver[i]);
        if (d->stream[i]) cudaStreamDestroy(d->stream[i]);
        if (d->join[i]) cudaEventDestroy(d->join[i]);
        free(d->host_ws[i]);
    }
    if (d->fork) cudaEventDestroy(d->fork);
    if (d->params) cusolverDnDestroyParams(d->params);
    for (int i = 0; i < PIN_RING; i++)
        if (d->pin_ev[i]) cudaEventDestroy(d->pin_ev[i]);
    if (d->pinned) cudaFreeHost(d->pinned);
    if (d->lt) cublasLtDestroy(d->lt);
    free(d);
    c->dash = NULL;
}

static bool stream_capturing(ms_ctx *ctx)
{
    if (ms_cuda_capturing(ctx)) return true;   /* moonstep's own graph or a trainer's it joined */
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(ms_cuda(ctx)->stream, &cs) != cudaSuccess) {
        (void)cudaGetLastError();
        return true;   /* be safe: no host reads, no new resources */
    }
    return cs != cudaStreamCaptureStatusNone;
}

static ms_status refuse_setup(ms_ctx *ctx, const char *what)
{
    return ms_cuda_note_failure(ctx, MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_inv_root on %s: %s is set up on the first "
                                             "call, which cannot be captured; run the call once before capturing",
                                             ctx->name, what));
}

/* The context's DASH state with the pinned compaction ring (made on first use, never while capturing). */
static ms_status dash_state(ms_ctx *ctx, bool capturing, struct ms_cuda_dash **out)
{
    ms_cuda_ctx *c = ms_cuda(ctx);
    if (c->dash == NULL) {
        if (capturing) return refuse_setup(ctx, "the solvers' state");
        struct ms_cuda_dash *d = calloc(1, sizeof *d);
        if (d == NULL) return MS_FAIL(ctx, MS_E_OOM, "ms_inv_root: out of host memory");
        c->dash = d;
        cudaError_t e = cudaHostAlloc((void **)&d->pinned, PIN_RING * 2 * sizeof(int), cudaHostAllocDefault);
        for (int i = 0; i < PIN_RING && e == cudaSuccess; i++)
            e = cudaEventCreateWithFlags(&d->pin_ev[i], cudaEventDisableTiming);
        if (e != cudaSuccess) {   /* all or nothing: the next call would take half a state for a whole one */
            ms_cuda_dash_release(c);
            return ms_cuda_fail(ctx, e, "cudaHostAlloc/cudaEventCreateWithFlags (DASH state)", __FILE__, __LINE__);
        }
    }
    *out = c->dash;
    return MS_OK;
}

/* The DASH state with its cuBLASLt handle (the Lt factor and solver paths; made on first use, never while
** capturing). */
static ms_status dash_lt(ms_ctx *ctx, struct ms_cuda_dash **out)
{
    MS_TRY(dash_state(ctx, false, out));
    if ((*out)->lt == NULL) MS_CUBLAS_TRY(ctx, cublasLtCreate(&(*out)->lt));
    return MS_OK;
}

/* The eigensolver's side streams and handles (count from MOONSTEP_DASH_EVD_STREAMS, fixed once made). */
static ms_status evd_streams(ms_ctx *ctx, struct ms_cuda_dash *d, bool capturing)
{
    if (d->params == NULL) {
        if (capturing) return refuse_setup(ctx, "the eigensolver");
        MS_CUSOLVER_TRY(ctx, cusolverDnCreateParams(&d->params));
    }
    if (d->nstreams > 0) return MS_OK;
    if (capturing) return refuse_setup(ctx, "the eigensolver's streams");
    const int want = env_int("MOONSTEP_DASH_EVD_STREAMS", 8, 1, EVD_STREAMS_MAX);
    /* all or nothing: with nstreams > 0 the next call takes the set as made, and would queue on a NULL stream
    ** (the legacy one) with a NULL handle; a fork event made by a failed attempt is reused */
    if (d->fork == NULL) MS_CUDA_TRY(ctx, cudaEventCreateWithFlags(&d->fork, cudaEventDisableTiming));
    ms_status st = MS_OK;
    for (int i = 0; i < want && st == MS_OK; i++) {
        d->nstreams = i + 1;
        cudaError_t e = cudaStreamCreateWithFlags(&d->stream[i], cudaStreamNonBlocking);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&d->join[i], cudaEventDisableTiming);
        if (e != cudaSuccess) {
            st = ms_cuda_fail(ctx, e, "cudaStreamCreateWithFlags/cudaEventCreateWithFlags (EVD streams)", __FILE__,
                              __LINE__);
            break;
        }
        cusolverStatus_t s = cusolverDnCreate(&d->solver[i]);
        if (s == CUSOLVER_STATUS_SUCCESS) s = cusolverDnSetStream(d->solver[i], d->stream[i]);
        if (s != CUSOLVER_STATUS_SUCCESS)
            st = ms_cusolver_fail(ctx, s, "cusolverDnCreate/cusolverDnSetStream (EVD streams)", __FILE__, __LINE__);
    }
    if (st != MS_OK) {
        for (int i = 0; i < d->nstreams; i++) {
            if (d->solver[i]) cusolverDnDestroy(d->solver[i]);
            if (d->stream[i]) cudaStreamDestroy(d->stream[i]);
            if (d->join[i]) cudaEventDestroy(d->join[i]);
            d->solver[i] = NULL;
            d->stream[i] = NULL;
            d->join[i] = NULL;
        }
        d->nstreams = 0;
    }
    return st;
}

/* --- gather, apply, graft ------------------------------------------------------------------------------ */

/* The kernel's view of block k: its first element and strides in the tensor's [rows, cols] matrix view. */
static msk_dash_block block_of(const ms_block *b, int k)
{
    const ms_tensor *t = b->tensor;
    int64_t rs, cs, cols;
    if (t->ndim == 0) {
        rs = cs = 1;
        cols = 1;
    } else if (t->ndim == 1) {
        rs = t->strides[0];
        cs = 1;
        cols = 1;
    } else if (t->ndim == 2) {
        rs = t->strides[0];
        cs = t->strides[1];
        cols = t->shape[1];
    } else {   /* contiguous (checked by the core) */
        cols = 1;
        for (int d = 1; d < t->ndim; d++) cols *= t->shape[d];
        rs = cols;
        cs = 1;
    }
    msk_dash_block k_b = {
        .p = (char *)ms_tensor_ptr(t) + (b->row0 * rs + b->col0 * cs) * (int64_t)ms_dtype_size(t->dtype),
        .rs = rs, .cs = cs, .e0 = b->row0 * cols + b->col0, .tag = k, .dt = (int8_t)t->dtype,
    };
    return k_b;
}

static ms_status blocks_table(ms_ctx *ctx, const char *fn, int n, const ms_block *blocks, msk_dash_block **out)
{
    msk_dash_block *b = malloc((size_t)(n > 0 ? n : 1) * sizeof *b);
    if (b == NULL) return MS_FAIL(ctx, MS_E_OOM, "%s on %s: no host memory for %d blocks", fn, ctx->name, n);
    for (int k = 0; k < n; k++) b[k] = block_of(&blocks[k], k);
    *out = b;
    return MS_OK;
}

static void track_blocks(ms_ctx *ctx, int n, const ms_block *blocks)
{
    for (int k = 0; k < n; k++) ms_cuda_track_tensor(ctx, blocks[k].tensor);
}

ms_status ms_cuda_blocks_gather(ms_ctx *ctx, ms_tensor *stack, int n, const ms_block *blocks)
{
    MS_NVTX_RANGE("ms_blocks_gather");
    MS_TRY(ms_cuda_enter(ctx));
    const int64_t r = stack->shape[1], c = stack->shape[2];
    if (n == 0 || r * c == 0) return MS_OK;
    msk_dash_block *b;
    MS_TRY(blocks_table(ctx, "ms_blocks_gather", n, blocks, &b));
    int launches = 0;
    ms_status st = ms_cuda_note_failure(ctx, msk_dash_gather(ctx, ms_cuda(ctx)->stream, ms_tensor_ptr(stack), r, c, n,
                                                             b, &launches));
    free(b);
    if (st != MS_OK) return st;
    track_blocks(ctx, n, blocks);
    ms_cuda_track_tensor(ctx, stack);
    ctx->launches += launches > 1 ? launches - 1 : 0;
    return MS_OK;
}

ms_status ms_cuda_blocks_apply(ms_ctx *ctx, int n, const ms_block *blocks, const ms_tensor *stack,
                               const ms_tensor *scale, const ms_blocks_apply_options *o)
{
    MS_NVTX_RANGE("ms_blocks_apply");
    MS_TRY(ms_cuda_enter(ctx));
    const int64_t r = stack->shape[1], c = stack->shape[2];
    if (n == 0 || r * c == 0) return MS_OK;
    msk_dash_apply k_o;
    memset(&k_o, 0, sizeof k_o);
    if (o) {
        k_o.lr = ms_cuda_scalar(o->lr, o->lr_t);
        k_o.step = ms_cuda_scalar(o->step, o->step_t);
        k_o.skip = ms_cuda_scalar(0, o->skip_t);
        k_o.weight_decay = o->weight_decay;
        k_o.update = 1;
        k_o.stochastic = o->stochastic_round != 0;
        k_o.seed = o->seed;
        k_o.ids = o->rng_ids ? ms_tensor_ptr(o->rng_ids) : NULL;
    }
    msk_dash_block *b;
    MS_TRY(blocks_table(ctx, "ms_blocks_apply", n, blocks, &b));
    int launches = 0;
    ms_status st = ms_cuda_note_failure(ctx, msk_dash_apply_run(ctx, ms_cuda(ctx)->stream, &k_o, ms_tensor_ptr(stack), r,
                                                                c, scale ? ms_tensor_ptr(scale) : NULL, n, b,
                                                                &launches));
    free(b);
    if (st != MS_OK) return st;
    track_blocks(ctx, n, blocks);
    ms_cuda_track_tensor(ctx, stack);
    ms_cuda_track_tensor(ctx, scale);
    if (o) {
        ms_cuda_track_tensor(ctx, o->lr_t);
        ms_cuda_track_tensor(ctx, o->step_t);
        ms_cuda_track_tensor(ctx, o->skip_t);
        ms_cuda_track_tensor(ctx, o->rng_ids);
    }
    ctx->launches += launches > 1 ? launches - 1 : 0;
    return MS_OK;
}

ms_status ms_cuda_dash_graft(ms_ctx *ctx, ms_tensor *grad_ema, ms_tensor *adam_v, ms_tensor *norm,
                             ms_tensor *pgraft, const ms_tensor *grad, const ms_dash_graft_options *o)
{
    MS_NVTX_RANGE("ms_dash_graft");
    MS_TRY(ms_cuda_enter(ctx));
    const int64_t N = grad->shape[0], rc = grad->shape[1] * grad->shape[2];
    if (N == 0) return MS_OK;
    /* rc == 0 still runs the fold (norm <- 0): it honours skip_t, read on the device, as the CPU does */
    msk_dash_graft k_o = {
        .step = ms_cuda_scalar(o->step, o->step_t), .skip = ms_cuda_scalar(0, o->skip_t), .beta_grad = o->beta_grad,
        .beta_graft = o->beta_graft, .eps = o->eps, .bias_correction = o->bias_correction != 0,
    };
    const size_t bytes = msk_dash_graft_scratch(N, rc);
    double *partials = NULL;
    MS_TRY(ms_cuda_scratch(ctx, bytes, (void **)&partials));
    ms_status st = ms_cuda_note_failure(ctx, msk_dash_graft_run(ctx, ms_cuda(ctx)->stream, &k_o, ms_tensor_ptr(grad_ema),
                                                                ms_tensor_ptr(adam_v), ms_tensor_ptr(norm),
                                                                pgraft ? ms_tensor_ptr(pgraft) : NULL,
                                                                ms_tensor_ptr(grad), N, rc, partials));
    ms_cuda_scratch_free(ctx, partials, bytes);
    if (st != MS_OK) return st;
    ms_cuda_track_tensor(ctx, grad_ema);
    ms_cuda_track_tensor(ctx, adam_v);
    ms_cuda_track_tensor(ctx, norm);
    ms_cuda_track_tensor(ctx, pgraft);
    ms_cuda_track_tensor(ctx, grad);
    ms_cuda_track_tensor(ctx, o->step_t);
    ms_cuda_track_tensor(ctx, o->skip_t);
    ctx->launches += rc > 0 ? 1 : 0;   /* the fold */
    return MS_OK;
}

/* --- gather with the factor products ------------------------------------------------------------------ */

typedef enum factor_path { FACTOR_LT, FACTOR_EX, FACTOR_NT } factor_path;

/* MOONSTEP_DASH_FACTOR_GEMM (moonstep.h): lt (default), ex, nt */
static factor_path factor_path_of(void)
{
    const char *v = getenv("MOONSTEP_DASH_FACTOR_GEMM");
    if (v && strcmp(v, "ex") == 0) return FACTOR_EX;
    if (v && strcmp(v, "nt") == 0) return FACTOR_NT;
    return FACTOR_LT;
}

/* The largest power of two up to 256 dividing every address: the operands' alignment, which cuBLASLt's heuristic
** takes to be 256 bytes unless told.  On the H200 the TF32 algorithm it picks for aligned 64 x 64 operands answers
** CUBLAS_STATUS_NOT_SUPPORTED for an A 4, 8 or 12 bytes off (a stack or factor at an element offset in its buffer). */
static uint32_t lt_alignment(const void *a, const void *b, const void *c)
{
    const uintptr_t x = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c | 256;
    return (uint32_t)(x & (~x + 1));
}

/* The heuristic's first algorithm for C [m, m] = alpha A B^T + beta C over `batch` row-major A, B [m, k] whose
** addresses are `align`-byte aligned -- or, with tile set (a cublasLtMatmulTile_t), the first of its candidates with
** that tile, else its first -- asked once per shape and alignment and kept; NULL: none (the caller falls back to
** cublasGemmStridedBatchedEx). */
static ms_status lt_algo(ms_ctx *ctx, struct ms_cuda_dash *d, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                         cublasLtMatrixLayout_t lc, int64_t m, int64_t k, int64_t batch, bool tf32, int tile,
                         uint32_t align, const cublasLtMatmulAlgo_t **out)
{
    *out = NULL;
    for (int i = 0; i < d->nlt; i++) {
        const struct lt_entry *e = &d->lt_algo[i];
        if (e->m == m && e->k == k && e->batch == batch && e->tf32 == tf32 && e->tile == tile && e->align == align) {
            *out = &e->algo;
            return MS_OK;
        }
    }
    cublasLtMatmulPreference_t pref;
    MS_CUBLAS_TRY(ctx, cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = MS_CUDA_BLAS_WORKSPACE;
    const uint32_t no_split_k = CUBLASLT_REDUCTION_SCHEME_NONE;   /* no split-K reductions of any kind */
    cublasLtMatmulHeuristicResult_t res[LT_CANDIDATES];
    int found = 0;
    cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &no_split_k,
                                                 sizeof no_split_k);
    const cublasLtMatmulPreferenceAttributes_t aligns[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
    };
    for (int i = 0; i < 4 && s == CUBLAS_STATUS_SUCCESS; i++)
        s = cublasLtMatmulPreferenceSetAttribute(pref, aligns[i], &align, sizeof align);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulAlgoGetHeuristic(d->lt, desc, la, la, lc, lc, pref, tile ? LT_CANDIDATES : 1, res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    int pick = -1;
    for (int i = 0; s == CUBLAS_STATUS_SUCCESS && i < found; i++) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
        int t = -1;
        size_t sz = 0;
        if (pick < 0) pick = i;
        if (tile && cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &t, sizeof t, &sz) ==
                        CUBLAS_STATUS_SUCCESS && t == tile) {
            pick = i;
            break;
        }
    }
    if (s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && pick < 0)) return MS_OK;
    if (s != CUBLAS_STATUS_SUCCESS) return ms_cublas_fail(ctx, s, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
    if (d->nlt == LT_CACHE) d->nlt = 0;   /* more shapes than kept: start over (each is asked again, same answer) */
    d->lt_algo[d->nlt] = (struct lt_entry){ m, k, batch, tf32, tile, align, res[pick].algo };
    *out = &d->lt_algo[d->nlt++].algo;
    return MS_OK;
}

/* C [batch][m][m] = alpha op_T(A) op_N(B) + beta C through cuBLASLt, A and B column-major [k, m] (the same
** layout), with the heuristic's algorithm (lt_algo; `tile` as there).  *ran false: no algorithm for the shape,
** nothing done (the caller takes cublasGemmStridedBatchedEx). */
static ms_status lt_tn(ms_ctx *ctx, struct ms_cuda_dash *d, cudaStream_t stream, int64_t m, int64_t k, int64_t batch,
                       bool tf32, int tile, float alpha, const void *A, const void *B, float beta, void *C, bool *ran)
{
    *ran = false;
    cublasLtMatmulDesc_t desc = NULL;
    cublasLtMatrixLayout_t la = NULL, lc = NULL;
    const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
    const int32_t nb = (int32_t)batch;
    const int64_t sa = m * k, sc = m * m;
    cublasStatus_t s = cublasLtMatmulDescCreate(&desc, tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof opT);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof opN);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, (uint64_t)k, (uint64_t)m, k);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, (uint64_t)m, (uint64_t)m, m);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutSetAttribute(la, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof nb);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutSetAttribute(lc, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof nb);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutSetAttribute(la, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sa, sizeof sa);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutSetAttribute(lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sc, sizeof sc);
    const cublasLtMatmulAlgo_t *algo = NULL;
    ms_status st = MS_OK;
    if (s == CUBLAS_STATUS_SUCCESS)
        st = lt_algo(ctx, d, desc, la, lc, m, k, batch, tf32, tile, lt_alignment(A, B, C), &algo);
    if (s == CUBLAS_STATUS_SUCCESS && st == MS_OK && algo != NULL)
        s = cublasLtMatmul(d->lt, desc, &alpha, A, la, B, la, &beta, C, lc, C, lc, algo, ms_cuda(ctx)->blas_workspace,
                           MS_CUDA_BLAS_WORKSPACE, stream);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (st != MS_OK) return st;
    if (s != CUBLAS_STATUS_SUCCESS) return ms_cublas_fail(ctx, s, "cublasLtMatmul", __FILE__, __LINE__);
    *ran = algo != NULL;
    return MS_OK;
}

/* c [batch][m][m] <- alpha a a^T + beta c for row-major a [batch][m][k] (stacks, dense).  cuBLAS sees a as
** column-major [k, m]: C = op_T(a) op_N(a), both operands K-major, as ms_matmul runs G G^T.  Through cuBLASLt
** when the context has its handle (made on the first uncaptured call), else cublasGemmStridedBatchedEx. */
static ms_status syrk_like(ms_ctx *ctx, struct ms_cuda_dash *d, bool use_lt, const float *a, float *c, int64_t m,
                           int64_t k, int64_t batch, float alpha, float beta, bool tf32)
{
    cublasHandle_t h;
    MS_TRY(ms_cuda_blas(ctx, &h));
    const cublasComputeType_t comp = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const long long sa = (long long)(m * k), sc = (long long)(m * m);
    if (use_lt && d != NULL && d->lt != NULL) {
        bool ran;
        MS_TRY(lt_tn(ctx, d, ms_cuda(ctx)->stream, m, k, batch, tf32, 0, alpha, a, a, beta, c, &ran));
        if (ran) return MS_OK;
    }
    MS_CUBLAS_TRY(ctx, cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, (int)m, (int)k, &alpha, a, CUDA_R_32F,
                                                  (int)k, sa, a, CUDA_R_32F, (int)k, sa, &beta, c, CUDA_R_32F, (int)m, sc,
                                                  (int)batch, comp, CUBLAS_GEMM_DEFAULT));
    return MS_OK;
}

ms_status ms_cuda_blocks_gather_factors(ms_ctx *ctx, ms_tensor *stack, ms_tensor *left, ms_tensor *right, int n,
                                        const ms_block *blocks, const ms_dash_factor_options *o)
{
    MS_NVTX_RANGE("ms_blocks_gather_factors");
    MS_TRY(ms_cuda_enter(ctx));
    const int64_t r = stack->shape[1], c = stack->shape[2];
    if (n == 0) return MS_OK;
    const factor_path path = factor_path_of();
    const bool capturing = stream_capturing(ctx);
    struct ms_cuda_dash *d = ms_cuda(ctx)->dash;
    if (path == FACTOR_LT && !capturing) MS_TRY(dash_lt(ctx, &d));
    cublasHandle_t h;
    MS_TRY(ms_cuda_blas(ctx, &h));   /* the workspace the cuBLASLt calls share (same stream, in order) */
    const bool tf32 = o->allow_tf32 != 0, lt = path == FACTOR_LT;
    const float alpha = (float)o->alpha, beta = (float)o->beta;
    if (r * c == 0) {   /* empty blocks: nothing to gather; ms_dash_graft's and ms_matmul's empty cases */
        if (o->graft) MS_TRY(ms_cuda_dash_graft(ctx, o->grad_ema, o->adam_v, o->norm, o->pgraft, stack, o->graft));
        ms_matmul_options mo = { .trans_b = 1, .alpha = o->alpha, .beta = o->beta, .allow_tf32 = o->allow_tf32 };
        MS_TRY(ms_cuda_matmul(ctx, left, stack, stack, &mo));
        if (right == NULL) return MS_OK;
        mo.trans_a = 1;
        mo.trans_b = 0;
        return ms_cuda_matmul(ctx, right, stack, stack, &mo);
    }
    float *g = ms_tensor_ptr(stack), *gt = NULL;
    const size_t gt_bytes = (size_t)n * (size_t)(r * c) * sizeof(float);
    const bool transposed = right != NULL && path != FACTOR_NT;
    /* grafting in the gather's pass: off by default -- on the H200 (108 blocks of 1024^2) gather + graft + factors
    ** took 3.32 ms fused against 3.05 ms with ms_dash_graft's own pass after the gather */
    const ms_dash_graft_options *go = env_int("MOONSTEP_DASH_GATHER_GRAFT", 0, 0, 1) ? o->graft : NULL;
    msk_dash_gather_graft k_g = { 0 };
    const size_t part_bytes = go ? msk_dash_gather_graft_scratch(n, r, c) : 0;
    msk_dash_block *b;
    MS_TRY(blocks_table(ctx, "ms_blocks_gather_factors", n, blocks, &b));
    ms_status st = transposed ? ms_cuda_scratch(ctx, gt_bytes, (void **)&gt) : MS_OK;
    if (st == MS_OK && go) {
        k_g.o = (msk_dash_graft){ .step = ms_cuda_scalar(go->step, go->step_t), .skip = ms_cuda_scalar(0, go->skip_t),
                                  .beta_grad = go->beta_grad, .beta_graft = go->beta_graft, .eps = go->eps,
                                  .bias_correction = go->bias_correction != 0 };
        k_g.m = ms_tensor_ptr(o->grad_ema);
        k_g.v = ms_tensor_ptr(o->adam_v);
        k_g.norm = ms_tensor_ptr(o->norm);
        k_g.pgraft = o->pgraft ? ms_tensor_ptr(o->pgraft) : NULL;
        st = ms_cuda_scratch(ctx, part_bytes, (void **)&k_g.partials);
    }
    int launches = 0;
    if (st == MS_OK)
        st = ms_cuda_note_failure(ctx, transposed || go ? msk_dash_gather_t(ctx, ms_cuda(ctx)->stream, g, gt, r, c, n, b,
                                                                            go ? &k_g : NULL, &launches)
                                                        : msk_dash_gather(ctx, ms_cuda(ctx)->stream, g, r, c, n, b, &launches));
    free(b);
    if (k_g.partials) ms_cuda_scratch_free(ctx, k_g.partials, part_bytes);
    if (st == MS_OK && o->graft && go == NULL)   /* ms_dash_graft's own pass (the default) */
        st = ms_cuda_dash_graft(ctx, o->grad_ema, o->adam_v, o->norm, o->pgraft, stack, o->graft);
    if (st == MS_OK) {
        st = syrk_like(ctx, d, lt, g, ms_tensor_ptr(left), r, c, n, alpha, beta, tf32);
        launches++;
    }
    if (st == MS_OK && right != NULL) {
        if (transposed) {
            st = syrk_like(ctx, d, lt, gt, ms_tensor_ptr(right), c, r, n, alpha, beta, tf32);
        } else {   /* G^T G reading G as stored: ms_matmul's trans_a call */
            const long long s = (long long)(r * c), sc = (long long)(c * c);
            const cublasComputeType_t comp = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
            cublasStatus_t bs = cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, (int)c, (int)c, (int)r, &alpha, g,
                                                           CUDA_R_32F, (int)c, s, g, CUDA_R_32F, (int)c, s, &beta,
                                                           ms_tensor_ptr(right), CUDA_R_32F, (int)c, sc, n, comp,
                                                           CUBLAS_GEMM_DEFAULT);
            if (bs != CUBLAS_STATUS_SUCCESS) st = ms_cublas_fail(ctx, bs, "cublasGemmStridedBatchedEx", __FILE__, __LINE__);
        }
        launches++;
    }
    if (gt) ms_cuda_scratch_free(ctx, gt, gt_bytes);
    if (st != MS_OK) return ms_cuda_note_failure(ctx, st);
    track_blocks(ctx, n, blocks);
    ms_cuda_track_tensor(ctx, stack);
    ms_cuda_track_tensor(ctx, left);
    ms_cuda_track_tensor(ctx, right);
    if (go) {
        ms_cuda_track_tensor(ctx, o->grad_ema);
        ms_cuda_track_tensor(ctx, o->adam_v);
        ms_cuda_track_tensor(ctx, o->norm);
        ms_cuda_track_tensor(ctx, o->pgraft);
        ms_cuda_track_tensor(ctx, go->step_t);
        ms_cuda_track_tensor(ctx, go->skip_t);
    }
    ctx->launches += launches > 1 ? launches - 1 : 0;
    return MS_OK;
}

/* --- the solvers' call state ------------------------------------------------------------------------------ */

typedef struct solver {
    ms_ctx            *ctx;
    cudaStream_t       st;
    cublasHandle_t     blas;
    struct ms_cuda_dash *dash;
    const ms_root_options *o;
    int64_t            N, n, K, nn;
    bool               tf32, capturing, early;
    ms_dtype           mm;              /* operand dtype of the products that may be 16-bit */
    int                lt_tile;         /* CN: TF32 square products through cuBLASLt with this tile (solver_tile) */
    msk_dash_sym       sym;
    msk_dash_pos       pos;             /* the working set: batch, map, index */
    const int         *index;           /* the checked index (device), NULL: all blocks */
    float             *a, *x;           /* the caller's stacks */
    /* small device arrays */
    double            *scale, *partials;
    unsigned          *dev;
    int               *live, *map, *from, *to, *counts, *acc, *idx, *info, *bad;
    float             *pv, *pw, *evals;
    void              *pv16;            /* bf16 power-iteration vectors (the GEMM operand) */
    double            *sv, *sw1, *sw2;
    /* slots: f32 [K, n, n] each, and 16-bit shadows */
    char              *slots, *shadows;
    size_t             slot_bytes, shadow_bytes;
    /* the compaction ring */
    int                lag, every, pend_slot[PIN_RING], pend_step[PIN_RING], npend;
    int                launches;
} solver;

static float *slot(const solver *S, int i) { return (float *)(S->slots + (size_t)i * S->slot_bytes); }
static void *shadow(const solver *S, int i)
{
    return S->mm == MS_DTYPE_F32 ? NULL : (void *)(S->shadows + (size_t)i * S->shadow_bytes);
}

static cudaDataType cuda_type(ms_dtype dt)
{
    return dt == MS_DTYPE_BF16 ? CUDA_R_16BF : dt == MS_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* The tile of CN's TF32 products on K blocks of n (gemm_sym, through cuBLASLt with A transposed, the operands being
** symmetric): MOONSTEP_DASH_TILE (a cublasLtMatmulTile_t; 0: cublasGemmStridedBatchedEx's own choice), else
** 128 x 128 on Hopper when a product fills at least 32 waves of such tiles.  Measured on the H200 (bench/RESULTS.md,
** dash, eleventh session): 36 batched 1024^3 TF32 products back to back -- a refresh, with the GPU at its power
** limit -- take 3-6% less time with the heuristic's 128 x 128 candidate than with its first (256 x 64), although
** one product alone is slower; CN f32's step went from 64.8-65.1 to 62.0-63.0 ms, its errors unchanged to three
** digits.  A stack of 12 blocks of 512 (1.5 waves) was 10% slower with it, so small batches keep the default; so
** does NDB, whose TF32 roots moved further from the f64 ones through this path (normalized error 1.1 -> 1.4 at
** kappa up to 1e7, and past the spec's bound at kappa 100).  The choice depends on the shapes, the GPU and the
** library alone, so every run rounds alike -- except a call captured before any uncaptured one: no cuBLASLt
** handle can be made while capturing, so that graph keeps the default GEMM. */
static int solver_tile(ms_ctx *ctx, int64_t K, int64_t n)
{
    int major = 0, sms = 0;
    const int dev = ms_cuda(ctx)->device;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        major = sms = 0;
    }
    const int64_t tiles = K * ((n + 127) / 128) * ((n + 127) / 128);
    const bool prefer = major == 9 && sms > 0 && tiles >= 32 * (int64_t)sms;
    return env_int("MOONSTEP_DASH_TILE", prefer ? CUBLASLT_MATMUL_TILE_128x128 : 0, 0, CUBLASLT_MATMUL_TILE_END - 1);
}

/* The panels of the symmetric products: MOONSTEP_DASH_SPLIT (2..4 panels), else plain products.  Measured on the
** H200 (subset, NDB-PIM): the 10 panel GEMMs of split 4 ran at about half the efficiency of one full batched
** GEMM (floor 100.8 ms against 78.4 ms for the full products), so the 37.5% of flops they save cost more than
** they save; panels stay selectable for other shapes and GPUs.  Inner cuts are multiples of 32 (the finish
** kernel's tiles). */
static void choose_split(solver *S)
{
    const int64_t n = S->n;
    int split = env_int("MOONSTEP_DASH_SPLIT", 1, 1, MSK_DASH_SPLIT_MAX);
    msk_dash_sym *y = &S->sym;
    memset(y, 0, sizeof *y);
    y->n = n;
    y->split = 1;
    y->cut[0] = 0;
    y->cut[1] = (int)n;
    if (split < 2 || n < 64 * split) return;
    int prev = 0;
    for (int j = 1; j < split; j++) {
        int c = (int)((int64_t)j * n / split) / 32 * 32;
        if (c <= prev) return;   /* too small to cut: plain products */
        y->cut[j] = c;
        prev = c;
    }
    y->cut[split] = (int)n;
    y->split = split;
}

/* C = alpha op(A) op(B) + beta C for every position of the working set, on sym's panels.  Buffers are row-major
** n x n; cuBLAS reads them column-major, i.e. transposed, which changes nothing for the symmetric operands of
** the solvers (and makes EVD's Q Q^T come out right, see evd_solve). */
static ms_status gemm_sym(solver *S, void *C, ms_dtype ct, const void *A, const void *B, ms_dtype it, bool transB,
                          float alpha, float beta)
{
    const int64_t batch = S->pos.batch, n = S->n, nn = S->nn;
    if (batch <= 0) return MS_OK;
    const cublasComputeType_t comp = it == MS_DTYPE_F32 && S->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const size_t ei = ms_dtype_size(it), ec = ms_dtype_size(ct);
    const cudaDataType ti = cuda_type(it), tc = cuda_type(ct);
    const msk_dash_sym *y = &S->sym;
    struct ms_cuda_dash *d = S->dash;
    if (S->lt_tile && y->split == 1 && it == MS_DTYPE_F32 && ct == MS_DTYPE_F32 && !transB && d != NULL && d->lt != NULL) {
        /* op(A) = A^T: the operands are symmetric (solver_tile) */
        bool ran;
        MS_TRY(lt_tn(S->ctx, d, S->st, n, n, batch, S->tf32, S->lt_tile, alpha, A, B, beta, C, &ran));
        if (ran) {
            S->launches++;
            return MS_OK;
        }
    }
    for (int j = 0; j < y->split; j++) {
        const int64_t c0 = y->cut[j], c1 = y->cut[j + 1];
        const int m = (int)(y->split == 1 ? n : n - c0), nc = (int)(y->split == 1 ? n : c1 - c0);
        const int64_t off = y->split == 1 ? 0 : c0;
        const char *pa = (const char *)A + off * ei;
        const char *pb = (const char *)B + (transB ? off : off * n) * ei;
        char *pc = (char *)C + (off + off * n) * ec;
        MS_CUBLAS_TRY(S->ctx, cublasGemmStridedBatchedEx(S->blas, CUBLAS_OP_N, transB ? CUBLAS_OP_T : CUBLAS_OP_N, m, nc,
                                                         (int)n, &alpha, pa, ti, (int)n, (long long)nn, pb, ti, (int)n,
                                                         (long long)nn, &beta, pc, tc, (int)n, (long long)nn,
                                                         (int)batch, comp, CUBLAS_GEMM_DEFAULT));
        S->launches++;
    }
    return MS_OK;
}

/* The finish pass of a product into dst (dtype dt): mirror, diag, the distance check, the 16-bit copy. */
static ms_status finish(solver *S, void *dst, ms_dtype dt, float diag, bool check, void *x16)
{
    msk_dash_finish f = {
        .x = dst, .xdt = dt, .x16 = x16, .x16dt = S->mm, .diag = diag, .dev = check ? S->dev : NULL,
        .batch = S->pos.batch,
    };
    if (S->sym.split <= 1 && diag == 0 && !check && x16 == NULL) return MS_OK;
    if (S->sym.split <= 1 && diag != 0 && !check && x16 == NULL) {
        MS_CUDA_LAUNCH(S->ctx, msk_dash_diag(S->ctx, S->st, dst, dt, &S->pos, diag));
    } else {
        MS_CUDA_LAUNCH(S->ctx, msk_dash_finish_run(S->ctx, S->st, &S->sym, &f));
    }
    S->launches++;
    return MS_OK;
}

/* dst = alpha A B + beta dst (f32 result, or 16-bit when dst_dt says so), then finish. */
static ms_status product(solver *S, void *dst, ms_dtype dst_dt, const void *A, const void *B, ms_dtype in_dt,
                         float alpha, float beta, float diag, bool check, void *x16)
{
    MS_TRY(gemm_sym(S, dst, dst_dt, A, B, in_dt, false, alpha, beta));
    return finish(S, dst, dst_dt, diag, check, x16);
}

/* --- early exit: the working set ------------------------------------------------------------------------- */

/* A pass starts with every position live, in order. */
static ms_status pass_begin(solver *S)
{
    S->pos.batch = S->K;
    S->pos.map = NULL;
    S->npend = 0;
    if (!S->early) return MS_OK;
    MS_CUDA_TRY(S->ctx, cudaMemsetAsync(S->live, 0x01, (size_t)S->K * sizeof(int), S->st));   /* positive: live */
    MS_CUDA_TRY(S->ctx, cudaMemsetAsync(S->dev, 0, (size_t)S->K * sizeof(unsigned), S->st));
    MS_CUDA_TRY(S->ctx, cudaMemsetAsync(S->counts, 0, 2 * sizeof(int), S->st));   /* no compaction yet */
    MS_CUDA_LAUNCH(S->ctx, msk_dash_iota(S->ctx, S->st, S->K, S->map));
    S->pos.map = S->map;
    S->launches += 4;
    return MS_OK;
}

/* After the check of iteration k (distance factor * dev): freeze the converged positions, and those past `limit`
** (moonstep.h's divergence stop: NDB 2, CN p + 1), and save their roots (src slot) into out. */
static ms_status freeze_and_save(solver *S, float factor, float limit, int k, const float *src, float *out,
                                 bool out_by_id)
{
    MS_CUDA_LAUNCH(S->ctx, msk_dash_freeze(S->ctx, S->st, &S->pos, S->live, S->dev, factor, (float)S->o->tolerance,
                                           limit, S->acc, k));
    MS_CUDA_LAUNCH(S->ctx, msk_dash_save(S->ctx, S->st, &S->pos, S->live, 0, src, out, out_by_id, NULL, 0, 0));
    S->launches += 2;
    return MS_OK;
}

static ms_status catch_up(solver *S, int k);

/* Compacts the working set on the device (the state slots move with their positions) and queues the count's
** copy to pinned memory; the host reads it `lag` iterations later. */
static ms_status compact(solver *S, int k, int nstate, const msk_dash_slot *state)
{
    if (!S->early || S->capturing || S->lag == 0) return MS_OK;
    struct ms_cuda_dash *d = S->dash;
    if (S->npend >= PIN_RING - 1) {   /* the ring is full: the oldest count is due anyway */
        MS_CUDA_TRY(S->ctx, cudaEventSynchronize(d->pin_ev[S->pend_slot[0]]));
        MS_TRY(catch_up(S, INT_MAX - 1));
    }
    MS_CUDA_LAUNCH(S->ctx, msk_dash_compact(S->ctx, S->st, &S->pos, S->live, S->map, S->from, S->to, S->counts));
    MS_CUDA_LAUNCH(S->ctx, msk_dash_move(S->ctx, S->st, S->pos.batch / 2 + 1, S->from, S->to, S->counts, nstate, state));
    const int r = d->pin_next;
    d->pin_next = (r + 1) % PIN_RING;
    MS_CUDA_TRY(S->ctx, cudaMemcpyAsync(d->pinned + 2 * r, S->counts, 2 * sizeof(int), cudaMemcpyDeviceToHost, S->st));
    MS_CUDA_TRY(S->ctx, cudaEventRecord(d->pin_ev[r], S->st));
    S->pend_slot[S->npend] = r;
    S->pend_step[S->npend] = k;
    S->npend++;
    S->launches += 2 + nstate;
    return MS_OK;
}

/* Before queuing iteration k: the counts of the compactions the device has finished (polled, in order); every
** `every` iterations the host also waits for the oldest one at least `lag` iterations old, while the device still
** works on the iterations queued since.  The batch shrinks to the latest count. */
static ms_status catch_up(solver *S, int k)
{
    while (S->npend > 0) {
        const int r = S->pend_slot[0];
        if (S->pend_step[0] <= k - S->lag && k % S->every == 0) {
            MS_CUDA_TRY(S->ctx, cudaEventSynchronize(S->dash->pin_ev[r]));
        } else {
            cudaError_t e = cudaEventQuery(S->dash->pin_ev[r]);
            if (e == cudaErrorNotReady) {
                (void)cudaGetLastError();
                break;
            }
            if (e != cudaSuccess) return ms_cuda_fail(S->ctx, e, "cudaEventQuery (compaction count)", __FILE__, __LINE__);
        }
        const int cnt = S->dash->pinned[2 * r];
        if (cnt >= 0 && cnt < S->pos.batch) S->pos.batch = cnt;
        S->npend--;
        memmove(S->pend_slot, S->pend_slot + 1, (size_t)S->npend * sizeof(int));
        memmove(S->pend_step, S->pend_step + 1, (size_t)S->npend * sizeof(int));
    }
    return MS_OK;
}

/* The end of a pass: the roots of the positions still live into out, and their iteration counts. */
static ms_status pass_end(solver *S, int T, const float *src, float *out, bool out_by_id, bool written)
{
    if (!written) {
        MS_CUDA_LAUNCH(S->ctx, msk_dash_save(S->ctx, S->st, &S->pos, S->early ? S->live : NULL, 1, src, out, out_by_id,
                                             NULL, 0, 0));
        S->launches++;
    }
    MS_CUDA_LAUNCH(S->ctx, msk_dash_count(S->ctx, S->st, &S->pos, S->early ? S->live : NULL, S->acc, T));
    S->launches++;
    return MS_OK;
}

/* --- scale -------------------------------------------------------------------------------------------------- */

static msk_dash_src input_src(const solver *S) { return (msk_dash_src){ S->a, 1, S->o->eps }; }

/* The power iteration's products W = S V (moonstep.h, "Power iteration") run as batched cuBLAS GEMMs on a copy of
** S made once: bf16 (DASH's precision; f32 accumulation) or f32 (TF32 only when tf32).  V and W are [n, m]
** row-major, i.e. m x n column-major, so W^T = V^T S^T: cuBLAS's (m x n)(n x n) with S read column-major as S^T
** -- exactly S V even for a non-symmetric S.  Replaces a hand-written thin product that took ~30 ms on the subset. */
typedef struct pi_gemm {
    cublasHandle_t blas;
    void          *mat;      /* [batch, n, n]: bf16 or f32 */
    void          *v16;      /* [batch, n, m] bf16 (bf16 mode) */
    bool           tf32;
} pi_gemm;

static ms_status pi_product(ms_ctx *ctx, const msk_dash_pos *pos, const pi_gemm *g, bool bf16, int m, const float *v,
                            float *w)
{
    const int64_t n = pos->n;
    const float one = 1.0f, zero = 0.0f;
    const cudaDataType ti = bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t comp = !bf16 && g->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const void *V = bf16 ? g->v16 : (const void *)v;
    MS_CUBLAS_TRY(ctx, cublasGemmStridedBatchedEx(g->blas, CUBLAS_OP_N, CUBLAS_OP_N, m, (int)n, (int)n, &one, V, ti, m,
                                                  (long long)(n * m), g->mat, ti, (int)n, (long long)(n * n), &zero, w,
                                                  CUDA_R_32F, m, (long long)(n * m), (int)pos->batch, comp,
                                                  CUBLAS_GEMM_DEFAULT));
    return MS_OK;
}

/* A power iteration per block (moonstep.h, "Power iteration") on S = M + d_mat I (an f32 add: A_reg) with the
** damping d_pi: in bf16 added to S's diagonal before S is rounded (engine/cpu/dash.c), in f32 added as d_pi v after
** each product; m vectors from offset base + id (or base + rng_ids[id], device ids); the result by msk_dash_pi_rq's
** mode.  g NULL: the thin-product kernel instead of cuBLAS. */
static ms_status power_iteration(ms_ctx *ctx, cudaStream_t st, const msk_dash_pos *pos, const pi_gemm *g,
                                 const float *M, float d_mat, float d_pi, bool bf16, int m, int steps, uint64_t seed,
                                 uint64_t base, const int *rng_ids, float *v, float *w, int mode, double mult,
                                 double sub, double power, void *dst, int *launches)
{
    msk_dash_thin t = { .m = M, .by_id = 1, .d1 = d_mat, .d2 = bf16 ? d_pi : 0.0f, .bf16 = bf16, .vecs = m };
    const float dmp = bf16 ? 0.0f : d_pi;
    void *v16 = g && bf16 ? g->v16 : NULL;
    if (g) MS_CUDA_LAUNCH(ctx, msk_dash_pi_matrix(ctx, st, pos, &t, g->mat));
    MS_CUDA_LAUNCH(ctx, msk_dash_randn(ctx, st, pos, m, w, seed, base, rng_ids));
    MS_CUDA_LAUNCH(ctx, msk_dash_pi_norm(ctx, st, pos, m, w, NULL, 0.0f, bf16, v, v16));
    for (int it = 0; it <= steps; it++) {
        if (g) MS_TRY(pi_product(ctx, pos, g, bf16, m, v, w));
        else MS_CUDA_LAUNCH(ctx, msk_dash_thin_f32(ctx, st, pos, &t, v, w));
        if (it == steps) break;
        MS_CUDA_LAUNCH(ctx, msk_dash_pi_norm(ctx, st, pos, m, w, v, dmp, bf16, v, v16));
    }
    MS_CUDA_LAUNCH(ctx, msk_dash_pi_rq(ctx, st, pos, m, v, w, dmp, mode, mult, sub, power, dst));
    *launches += 2 * steps + 4 + (g ? 1 : 0);
    return MS_OK;
}

/* scale[q] of A_reg: Frobenius, or pi_const times the power-iteration estimate of A_reg + eps_power_iter I. */
static ms_status compute_scale(solver *S)
{
    const ms_root_options *o = S->o;
    msk_dash_pos pos = { S->n, S->K, NULL, S->index };
    if (o->scaling == MS_SCALING_FRO) {
        MS_CUDA_LAUNCH(S->ctx, msk_dash_fro(S->ctx, S->st, &pos, input_src(S), S->partials, S->scale));
        S->launches += 2;
        return MS_OK;
    }
    const int m = o->scaling == MS_SCALING_PIM ? o->pi_vectors : 1;
    /* slot 0 (f32, K n n) holds the matrix copy: the solvers overwrite it only after the scale is known */
    const pi_gemm g = { S->blas, slot(S, 0), S->pv16, S->tf32 };
    return power_iteration(S->ctx, S->st, &pos, &g, S->a, (float)o->eps, (float)o->eps_power_iter, o->pi_bf16 != 0, m,
                           o->pi_steps, o->seed, 0, rng_ids_of(o->rng_ids), S->pv, S->pw, 0, o->pi_const, 0, 0,
                           S->scale, &S->launches);
}

/* --- NDB --------------------------------------------------------------------------------------------------- */

/* One square-root chain (moonstep.h) on B = (src + eps I) scale^se: out <- Y_T (want_y) or w Z_T, w = scale^we
** (folded into the first iterate).  Slots 0..4 (and their shadows).  out is a slot (by q) or x (by id). */
static ms_status ndb_chain(solver *S, msk_dash_src src, double se, double we, bool want_y, float *out, bool out_by_id)
{
    const int T = S->o->steps;
    const bool mm16 = S->mm != MS_DTYPE_F32;
    const ms_dtype it = S->mm;
    const bool direct = !S->early && (!out_by_id || S->index == NULL);
    MS_TRY(pass_begin(S));
    /* y, z: the current iterates' slots; f[]: free slots */
    int y = 2, z = 1, f[3] = { 0, 3, 4 };
    const void *op_bs, *op_z;
    MS_CUDA_LAUNCH(S->ctx, msk_dash_ndb_init(S->ctx, S->st, &S->pos, src, S->scale, se, we, slot(S, 0), slot(S, 1),
                                             shadow(S, 0), shadow(S, 1), S->mm));
    S->launches++;
    op_bs = mm16 ? shadow(S, 0) : (const void *)slot(S, 0);
    op_z = mm16 ? shadow(S, 1) : (const void *)slot(S, 1);
    if (T == 1) {
        if (!want_y) return pass_end(S, 1, slot(S, 1), out, out_by_id, false);
        float *dst = direct ? out : slot(S, 2);
        MS_TRY(product(S, dst, MS_DTYPE_F32, op_bs, op_z, it, 1.0f, 0.0f, 0.0f, false, NULL));
        return pass_end(S, 1, dst, out, out_by_id, direct);
    }
    /* step 1: Y = B E_0 (Z = E_0 came with the start) */
    MS_TRY(product(S, slot(S, 2), MS_DTYPE_F32, op_bs, op_z, it, 1.0f, 0.0f, 0.0f, false, shadow(S, 2)));
    bool written = false;
    for (int k = 1; k < T && S->pos.batch > 0; k++) {
        const bool last = k == T - 1;
        const int e = f[0];
        const void *Y = mm16 ? shadow(S, y) : (const void *)slot(S, y), *Z = mm16 ? shadow(S, z) : (const void *)slot(S, z);
        /* E = 1.5 I - 0.5 Z Y; the check is on Z Y (= 3 I - 2 E: distance 2 |E - I|) */
        MS_TRY(product(S, slot(S, e), MS_DTYPE_F32, Z, Y, it, -0.5f, 0.0f, 1.5f, S->early, shadow(S, e)));
        if (S->early) MS_TRY(freeze_and_save(S, 2.0f, NDB_DIVERGED, k, slot(S, want_y ? y : z), out, out_by_id));
        const void *E = mm16 ? shadow(S, e) : (const void *)slot(S, e);
        if (!last || want_y) {
            float *dst = last && direct ? out : slot(S, f[1]);
            MS_TRY(product(S, dst, MS_DTYPE_F32, Y, E, it, 1.0f, 0.0f, 0.0f, false, last ? NULL : shadow(S, f[1])));
            written = last && direct;
            if (!written) { int t = y; y = f[1]; f[1] = t; }
        }
        if (!last || !want_y) {
            float *dst = last && direct ? out : slot(S, f[2]);
            MS_TRY(product(S, dst, MS_DTYPE_F32, E, Z, it, 1.0f, 0.0f, 0.0f, false, last ? NULL : shadow(S, f[2])));
            written = last && direct;
            if (!written) { int t = z; z = f[2]; f[2] = t; }
        }
        if (!last) {
            msk_dash_slot state[4] = {
                { slot(S, y), S->nn * 4 }, { slot(S, z), S->nn * 4 }, { shadow(S, y), S->nn * 2 }, { shadow(S, z), S->nn * 2 },
            };
            MS_TRY(compact(S, k, mm16 ? 4 : 2, state));
            MS_TRY(catch_up(S, k + 1));
        }
    }
    return pass_end(S, T, slot(S, want_y ? y : z), out, out_by_id, written);
}

static ms_status ndb_solve(solver *S)
{
    msk_dash_src a = input_src(S);
    if (S->o->root == 2) return ndb_chain(S, a, -1.0, -0.5, false, S->x, true);
    /* S = A_reg^(1/2) / sqrt(s) is the second chain's B as it is (its scale sqrt(s) cancels the first's) */
    MS_TRY(ndb_chain(S, a, -1.0, 0.0, true, slot(S, 5), false));
    msk_dash_src r = { slot(S, 5), 0, 0.0 };
    return ndb_chain(S, r, 0.0, -0.25, false, S->x, true);
}

/* --- CN ------------------------------------------------------------------------------------------------------ */

/* Coupled Newton.  f32 runs the N recursion: X_1 = z^(1/p) N_0; per iteration i = 1..T-1: N_i = N^p (N - c I) + c I
** from N_(i-1) (the check: |M_i - I| = p |N_i - I|), then X_(i+1) = X_i N_i.  f32 slots: X 0 / 1, N 2, temporaries
** 3, 4.  16-bit runs the CPU's M recursion (moonstep.h): M_i = N^p M with 16-bit operands, N_i = ((p + 1) I - M_i)
** / p formed in the finish pass of M's product.  The N recursion rounds N ~ 1 to 16 bits every iteration (absolute
** error 2^-11 in every factor of X, 6x the CPU's error in f16), while M's early small entries keep their relative
** precision.  In f32 the N recursion's price is the same in kind, smaller: rounding N ~ (p + 1) / p I perturbs
** the M it stands for by ~(p + 1) u against ~u / 4 for a stored M, so below the floor (kappa >= 1e5) the root
** carries ~10x the CPU's f32 noise (numpy emulation, b = 32: 4.5e-3 against 3.5e-4 from the f64 iteration at
** kappa 1e6; above the floor both are within 1e-4) -- accepted for the pass over M per iteration it saves
** (tests/cuda_dash_spec.lua holds it to 1e-2).  16-bit: X 0 / 1, N 2, M 3 (f32); shadows: M 0, N 2, N^2 3, the inner product 4. */
static ms_status cn_solve(solver *S)
{
    const int T = S->o->steps, p = S->o->root;
    const bool mm16 = S->mm != MS_DTYPE_F32;
    const float c = (float)(p + 1) / (float)p;
    const bool direct = !S->early && S->index == NULL;
    MS_TRY(pass_begin(S));
    int xs = 0, x2 = 1, ns = 2, t1 = 3, t2 = 4;
    MS_CUDA_LAUNCH(S->ctx, msk_dash_cn_init(S->ctx, S->st, &S->pos, input_src(S), S->scale, p, slot(S, ns),
                                            mm16 ? shadow(S, 2) : NULL, S->mm, T == 1 ? S->x : slot(S, xs), T == 1,
                                            mm16 && T > 1 ? shadow(S, 0) : NULL));
    S->launches++;
    if (T == 1) return pass_end(S, 1, NULL, NULL, true, true);
    bool written = false;
    for (int i = 1; i < T && S->pos.batch > 0; i++) {
        const bool last = i == T - 1;
        if (!mm16) {
            /* N2 into t1, N4 into t2 (p = 4); N' = N^p (N - c I) + c I into the temporary that is free */
            MS_TRY(product(S, slot(S, t1), MS_DTYPE_F32, slot(S, ns), slot(S, ns), MS_DTYPE_F32, 1, 0, 0, false, NULL));
            const int pw = p == 4 ? t2 : t1, fr = p == 4 ? t1 : t2;
            if (p == 4)
                MS_TRY(product(S, slot(S, t2), MS_DTYPE_F32, slot(S, t1), slot(S, t1), MS_DTYPE_F32, 1, 0, 0, false, NULL));
            MS_CUDA_LAUNCH(S->ctx, msk_dash_diag(S->ctx, S->st, slot(S, ns), MS_DTYPE_F32, &S->pos, -c));
            S->launches++;
            MS_TRY(product(S, slot(S, fr), MS_DTYPE_F32, slot(S, pw), slot(S, ns), MS_DTYPE_F32, 1, 0, c, S->early, NULL));
            t1 = ns;   /* the old N and N^p are the next temporaries */
            t2 = pw;
            ns = fr;
        } else {
            const ms_dtype h = S->mm;
            const void *np = shadow(S, 2);   /* N, or N^2 for p = 4 */
            if (p == 4) {
                MS_TRY(product(S, shadow(S, 3), h, shadow(S, 2), shadow(S, 2), h, 1, 0, 0, false, NULL));
                np = shadow(S, 3);
            }
            MS_TRY(product(S, shadow(S, 4), h, np, shadow(S, 0), h, 1, 0, 0, false, NULL));
            /* M <- np (np M), rounded once into 16 bits by the product itself (shadow 0: the next products' operand);
            ** the finish forms N from it (slot ns, shadow 2): a 16-bit read where an f32 M would be written and
            ** read back (engine/cpu/dash.c's root_cn rounds M alike) */
            MS_TRY(gemm_sym(S, shadow(S, 0), h, np, shadow(S, 4), h, false, 1.0f, 0.0f));
            msk_dash_finish f = {
                .x = shadow(S, 0), .xdt = h, .x16 = NULL, .x16dt = h, .diag = 0, .dev = S->early ? S->dev : NULL,
                .batch = S->pos.batch, .cn_p = p, .cn_n32 = slot(S, ns), .cn_n16 = shadow(S, 2),
            };
            MS_CUDA_LAUNCH(S->ctx, msk_dash_finish_run(S->ctx, S->st, &S->sym, &f));
            S->launches++;
        }
        if (S->early) MS_TRY(freeze_and_save(S, mm16 ? 1.0f : (float)p, (float)(p + 1), i, slot(S, xs), S->x, true));
        float *dst = last && direct ? S->x : slot(S, x2);
        MS_TRY(product(S, dst, MS_DTYPE_F32, slot(S, xs), slot(S, ns), MS_DTYPE_F32, 1, 0, 0, false, NULL));
        written = last && direct;
        if (!written) { int t = xs; xs = x2; x2 = t; }
        if (!last) {
            msk_dash_slot state[4] = {
                { slot(S, xs), S->nn * 4 }, { slot(S, ns), S->nn * 4 }, { shadow(S, 2), S->nn * 2 },
                { shadow(S, 0), S->nn * 2 },
            };
            MS_TRY(compact(S, i, mm16 ? 4 : 2, state));
            MS_TRY(catch_up(S, i + 1));
        }
    }
    return pass_end(S, T, slot(S, xs), S->x, true, written);
}

/* --- Chebyshev --------------------------------------------------------------------------------------------- */

/* moonstep.h's coefficients: the interpolant of y^(-1/p) at d + 1 Chebyshev points of [lo, 1], in f64 with the
** reference's operation order (engine/cpu/dash.c), rounded to f32. */
static void chebyshev_coefficients(float *c, int d, int p, double lo)
{
    const int K = d + 1;
    for (int k = 0; k <= d; k++) {
        double acc = 0;
        for (int j = 0; j < K; j++) {
            double th = M_PI * (j + 0.5) / K;
            acc += pow(lo + (cos(th) + 1) / 2 * (1 - lo), -1.0 / p) * cos(k * M_PI * (j + 0.5) / K);
        }
        c[k] = (float)(acc * 2.0 / K / (k == 0 ? 2 : 1));
    }
}

/* Clenshaw: slots 0 (T), 1 and 2 (b_(k+1), b_(k+2)); shadows 0 (T) and 1, 2. */
static ms_status cheb_solve(solver *S)
{
    const int d = S->o->steps, p = S->o->root;
    const bool mm16 = S->mm != MS_DTYPE_F32;
    const ms_dtype it = S->mm;
    const double lo = 25.0 / ((double)d * d);
    float *c = malloc((size_t)(d + 1) * sizeof *c);
    if (c == NULL) return MS_FAIL(S->ctx, MS_E_OOM, "ms_inv_root: no host memory for %d Chebyshev coefficients", d + 1);
    chebyshev_coefficients(c, d, p, lo);
    ms_status st = pass_begin(S);
    int b1 = 1, b2 = 2;
    if (st == MS_OK) {
        st = ms_cuda_note_failure(S->ctx, msk_dash_cheb_init(S->ctx, S->st, &S->pos, input_src(S), S->scale, lo, c[d],
                                                             c[d - 1], slot(S, 0), slot(S, b1), slot(S, b2),
                                                             shadow(S, 0), shadow(S, b1), S->mm));
        S->launches++;
    }
    const void *Tm = mm16 ? shadow(S, 0) : (const void *)slot(S, 0);
    for (int k = d - 2; k >= 1 && st == MS_OK; k--) {
        const void *B1 = mm16 ? shadow(S, b1) : (const void *)slot(S, b1);
        st = product(S, slot(S, b2), MS_DTYPE_F32, Tm, B1, it, 2.0f, -1.0f, c[k], false, shadow(S, b2));
        int t = b1; b1 = b2; b2 = t;
    }
    if (st == MS_OK) {
        const void *B1 = mm16 ? shadow(S, b1) : (const void *)slot(S, b1);
        st = product(S, slot(S, b2), MS_DTYPE_F32, Tm, B1, it, 1.0f, -1.0f, 0.0f, false, NULL);
    }
    if (st == MS_OK) {
        st = ms_cuda_note_failure(S->ctx, msk_dash_save(S->ctx, S->st, &S->pos, NULL, 1, slot(S, b2), S->x, 1, S->scale,
                                                        -1.0 / p, c[0]));
        S->launches++;
    }
    if (st == MS_OK) {
        st = ms_cuda_note_failure(S->ctx, msk_dash_count(S->ctx, S->st, &S->pos, NULL, S->acc, d));
        S->launches++;
    }
    free(c);
    return st;
}

/* --- EVD ---------------------------------------------------------------------------------------------------- */

static const char *evd_name(evd_path path)
{
    return path == EVD_STREAMS ? "Xsyevd" : path == EVD_BATCHED ? "XsyevBatched" : "SsyevjBatched";
}

/* cuSOLVER's host workspace i, at least `bytes`, kept by the context: its uses are ordered by the streams (a
** workspace serves one side stream, or the context's stream, whose work the side streams wait for), and it
** lives until the context goes, after its streams have finished. */
static ms_status host_workspace(ms_ctx *ctx, struct ms_cuda_dash *d, int i, size_t bytes, bool capturing)
{
    if (bytes <= d->host_ws_bytes[i]) return MS_OK;
    if (capturing) return refuse_setup(ctx, "cuSOLVER's host workspace");
    void *grown = realloc(d->host_ws[i], bytes);
    if (grown == NULL) return MS_FAIL(ctx, MS_E_OOM, "ms_inv_root: no host memory for cuSOLVER's workspace (%zu bytes)", bytes);
    d->host_ws[i] = grown;
    d->host_ws_bytes[i] = bytes;
    return MS_OK;
}

/* The eigenvalues (S->evals) and vectors (in slot 0, column-major) of every position; infos in S->info. */
static ms_status eigensolve(solver *S, evd_path path, bool *refused)
{
    ms_ctx *ctx = S->ctx;
    const int64_t n = S->n, K = S->K, nn = S->nn;
    float *work = slot(S, 0);
    const cusolverEigMode_t jobz = CUSOLVER_EIG_MODE_VECTOR;
    const cublasFillMode_t uplo = CUBLAS_FILL_MODE_LOWER;   /* column-major lower: LAPACK's 'L' on the CPU */
    ms_status st = MS_OK;
    if (path == EVD_JACOBI) {
        cusolverDnHandle_t h;
        MS_TRY(ms_cuda_solver(ctx, &h));
        syevjInfo_t params = NULL;
        int lwork = 0;
        float *ws = NULL;
        size_t wbytes = 0;
        MS_CUSOLVER_TRY(ctx, cusolverDnCreateSyevjInfo(&params));
        cusolverStatus_t s = cusolverDnXsyevjSetSortEig(params, 1);
        if (s == CUSOLVER_STATUS_SUCCESS)
            s = cusolverDnSsyevjBatched_bufferSize(h, jobz, uplo, (int)n, work, (int)n, S->evals, &lwork, params, (int)K);
        if (s != CUSOLVER_STATUS_SUCCESS) st = ms_cusolver_fail(ctx, s, "cusolverDnSsyevjBatched_bufferSize", __FILE__, __LINE__);
        if (st == MS_OK) {
            wbytes = (size_t)(lwork > 0 ? lwork : 1) * sizeof(float);
            st = ms_cuda_scratch(ctx, wbytes, (void **)&ws);
        }
        if (st == MS_OK) {
            s = cusolverDnSsyevjBatched(h, jobz, uplo, (int)n, work, (int)n, S->evals, ws, lwork, S->info, params, (int)K);
            if (s != CUSOLVER_STATUS_SUCCESS) st = ms_cusolver_fail(ctx, s, "cusolverDnSsyevjBatched", __FILE__, __LINE__);
            S->launches++;
        }
        if (ws) ms_cuda_scratch_free(ctx, ws, wbytes);
        cusolverDnDestroySyevjInfo(params);
        return st;
    }
    MS_TRY(evd_streams(ctx, S->dash, S->capturing));
    struct ms_cuda_dash *d = S->dash;
    if (path == EVD_BATCHED) {
        /* A status other than success (this cuSOLVER refuses the size, or the call) is not an error here: *refused
        ** is set and the caller redoes the blocks on the streams path (the batched call may have overwritten some
        ** of `work`).  Convergence and bad arguments per block come back in info, checked like the streams path's. */
        cusolverDnHandle_t h;
        MS_TRY(ms_cuda_solver(ctx, &h));
        const int64_t chunk_max = (int64_t)INT_MAX / (nn > 0 ? nn : 1);
        const int64_t chunk = K < chunk_max ? K : chunk_max;
        size_t dbytes = 0, hbytes = 0;
        cusolverStatus_t s = cusolverDnXsyevBatched_bufferSize(h, d->params, jobz, uplo, n, CUDA_R_32F, work, n, CUDA_R_32F,
                                                               S->evals, CUDA_R_32F, &dbytes, &hbytes, chunk);
        if (s != CUSOLVER_STATUS_SUCCESS) {
            *refused = true;
            return MS_OK;
        }
        MS_TRY(host_workspace(ctx, d, 0, hbytes, S->capturing));
        void *dws = NULL;
        st = ms_cuda_scratch(ctx, dbytes > 0 ? dbytes : 1, &dws);
        for (int64_t q0 = 0; q0 < K && st == MS_OK && !*refused; q0 += chunk) {
            const int64_t cnt = K - q0 < chunk ? K - q0 : chunk;
            s = cusolverDnXsyevBatched(h, d->params, jobz, uplo, n, CUDA_R_32F, work + q0 * nn, n, CUDA_R_32F,
                                       S->evals + q0 * n, CUDA_R_32F, dws, dbytes, d->host_ws[0], hbytes, S->info + q0, cnt);
            if (s != CUSOLVER_STATUS_SUCCESS) *refused = true;
            S->launches++;
        }
        if (dws) ms_cuda_scratch_free(ctx, dws, dbytes > 0 ? dbytes : 1);
        if (*refused) (void)cudaGetLastError();   /* a launch error of the refused call is not sticky */
        return st;
    }
    /* per-block Xsyevd on the side streams, forked from and joined to the context's stream */
    size_t dbytes = 0, hbytes = 0;
    MS_CUSOLVER_TRY(ctx, cusolverDnXsyevd_bufferSize(d->solver[0], d->params, jobz, uplo, n, CUDA_R_32F, work, n,
                                                     CUDA_R_32F, S->evals, CUDA_R_32F, &dbytes, &hbytes));
    const int ns = (int)(K < d->nstreams ? K : d->nstreams);
    for (int i = 0; i < ns; i++) MS_TRY(host_workspace(ctx, d, i, hbytes, S->capturing));
    const size_t per = align256(dbytes > 0 ? dbytes : 1);
    char *dws = NULL;
    MS_TRY(ms_cuda_scratch(ctx, per * (size_t)ns, (void **)&dws));
    cudaError_t e = cudaEventRecord(d->fork, S->st);
    for (int i = 0; i < ns && e == cudaSuccess; i++) e = cudaStreamWaitEvent(d->stream[i], d->fork, 0);
    if (e != cudaSuccess) st = ms_cuda_fail(ctx, e, "cudaEventRecord/cudaStreamWaitEvent (EVD fork)", __FILE__, __LINE__);
    /* one host thread per side stream (outside capture): should cuSOLVER wait for its stream inside a call (the
    ** host part of syevd), the other streams still get their work */
    const bool threaded = st == MS_OK && !S->capturing && ns > 1 && env_int("MOONSTEP_DASH_EVD_THREADS", 1, 0, 1);
    const int device = ms_cuda(ctx)->device;
    int64_t fail_q = -1;
    cusolverStatus_t fail_s = CUSOLVER_STATUS_SUCCESS;
    cudaError_t fail_e = cudaSuccess;
    if (st == MS_OK) {
        #pragma omp parallel for num_threads(threaded ? ns : 1) schedule(static, 1)
        for (int i = 0; i < ns; i++) {
            cudaError_t de = threaded ? cudaSetDevice(device) : cudaSuccess;
            for (int64_t q = i; q < K; q += ns) {
                cusolverStatus_t s = de == cudaSuccess
                    ? cusolverDnXsyevd(d->solver[i], d->params, jobz, uplo, n, CUDA_R_32F, work + q * nn, n, CUDA_R_32F,
                                       S->evals + q * n, CUDA_R_32F, dws + per * (size_t)i, dbytes, d->host_ws[i], hbytes,
                                       S->info + q)
                    : CUSOLVER_STATUS_SUCCESS;
                if (de != cudaSuccess || s != CUSOLVER_STATUS_SUCCESS) {
                    #pragma omp critical(ms_dash_evd_fail)
                    if (fail_q < 0 || q < fail_q) fail_q = q, fail_s = s, fail_e = de;
                    break;
                }
            }
        }
        S->launches += (int)K;
    }
    if (fail_q >= 0) {
        char what[96];
        snprintf(what, sizeof what, "cusolverDnXsyevd (block position %lld)", (long long)fail_q);
        st = fail_e != cudaSuccess ? ms_cuda_fail(ctx, fail_e, "cudaSetDevice (EVD thread)", __FILE__, __LINE__)
                                   : ms_cusolver_fail(ctx, fail_s, what, __FILE__, __LINE__);
    }
    /* join even after a failure: the context's stream must not run ahead of the side streams' work */
    for (int i = 0; i < ns; i++) {
        e = cudaEventRecord(d->join[i], d->stream[i]);
        if (e == cudaSuccess) e = cudaStreamWaitEvent(S->st, d->join[i], 0);
        if (e != cudaSuccess && st == MS_OK) st = ms_cuda_fail(ctx, e, "cudaEventRecord/cudaStreamWaitEvent (EVD join)",
                                                               __FILE__, __LINE__);
    }
    ms_cuda_scratch_free(ctx, dws, per * (size_t)ns);
    return st;
}

/* Reads the solver's infos and the non-finite flags (not under capture) and names the first failing block. */
static ms_status evd_check(solver *S, evd_path path)
{
    if (S->capturing) return MS_OK;
    ms_ctx *ctx = S->ctx;
    const int64_t K = S->K;
    int *host = malloc((size_t)K * 3 * sizeof(int));
    if (host == NULL) return MS_FAIL(ctx, MS_E_OOM, "ms_inv_root: out of host memory");
    ms_status st = MS_OK;
    cudaError_t e = cudaMemcpyAsync(host, S->info, (size_t)K * sizeof(int), cudaMemcpyDeviceToHost, S->st);
    if (e == cudaSuccess) e = cudaMemcpyAsync(host + K, S->bad, (size_t)K * sizeof(int), cudaMemcpyDeviceToHost, S->st);
    if (e == cudaSuccess && S->index)
        e = cudaMemcpyAsync(host + 2 * K, S->index, (size_t)K * sizeof(int), cudaMemcpyDeviceToHost, S->st);
    if (e == cudaSuccess) e = cudaStreamSynchronize(S->st);
    if (e != cudaSuccess) st = ms_cuda_fail(ctx, e, "cudaMemcpyAsync (EVD info)", __FILE__, __LINE__);
    for (int64_t q = 0; q < K && st == MS_OK; q++) {
        const long long k = S->index ? host[2 * K + q] : q;
        const int bad = host[K + q], info = host[q];
        if (bad) {
            const long long at = bad - 1;
            st = MS_FAIL(ctx, MS_E_NUMERIC, "ms_inv_root: block %lld has a non-finite entry at [%lld,%lld]; EVD cannot "
                         "take it; nothing was written", k, at / S->n, at % S->n);
        } else if (info > 0) {
            st = MS_FAIL(ctx, MS_E_NUMERIC, "ms_inv_root: EVD of block %lld did not converge (cuSOLVER %s info=%d); "
                         "nothing was written", k, evd_name(path), info);
        } else if (info < 0) {
            st = MS_FAIL(ctx, MS_E_BACKEND, "ms_inv_root: cuSOLVER %s rejected argument %d (block %lld)", evd_name(path),
                         -info, k);
        }
    }
    free(host);
    return st;
}

static ms_status evd_solve(solver *S)
{
    evd_path path = evd_path_for(S->n);
    if (path == EVD_BATCHED && S->dash->batched_refused == S->n) path = EVD_STREAMS;
    MS_TRY(pass_begin(S));
    bool refused = false;
    MS_CUDA_LAUNCH(S->ctx, msk_dash_evd_prep(S->ctx, S->st, &S->pos, input_src(S), slot(S, 0), S->bad));
    S->launches++;
    MS_TRY(eigensolve(S, path, &refused));
    if (refused) {   /* the fallback, remembered for this size (no failed call per refresh) */
        S->dash->batched_refused = S->n;
        path = EVD_STREAMS;
        MS_CUDA_LAUNCH(S->ctx, msk_dash_evd_prep(S->ctx, S->st, &S->pos, input_src(S), slot(S, 0), S->bad));
        S->launches++;
        MS_TRY(eigensolve(S, path, &refused));
    }
    MS_TRY(evd_check(S, path));
    MS_CUDA_LAUNCH(S->ctx, msk_dash_evd_scale(S->ctx, S->st, &S->pos, slot(S, 0), S->evals, S->o->root, S->o->eps,
                                              S->o->evd_shift != 0));
    S->launches++;
    /* X = Q' Q'^T with Q' = Q diag(l^(-1/2p)) column-major in slot 0: cuBLAS's Q' (op N) times Q'^T (op T) */
    const bool direct = S->index == NULL;
    float *dst = direct ? S->x : slot(S, 1);
    MS_TRY(gemm_sym(S, dst, MS_DTYPE_F32, slot(S, 0), slot(S, 0), MS_DTYPE_F32, true, 1.0f, 0.0f));
    MS_TRY(finish(S, dst, MS_DTYPE_F32, 0.0f, false, NULL));
    if (!direct) {
        MS_CUDA_LAUNCH(S->ctx, msk_dash_save(S->ctx, S->st, &S->pos, NULL, 1, dst, S->x, 1, NULL, 0, 0));
        S->launches++;
    }
    return MS_OK;
}

/* --- residual ------------------------------------------------------------------------------------------------- */

/* residual[k] = ||X^p A_reg V - V||_F / ||V||_F with the [b, 4] sketch V, in f64 (engine/cpu/dash.c). */
static ms_status residual_run(solver *S, float *residual)
{
    msk_dash_pos pos = { S->n, S->K, NULL, S->index };
    const int64_t m = SKETCH_VECTORS;
    MS_CUDA_LAUNCH(S->ctx, msk_dash_randn64(S->ctx, S->st, &pos, m, S->sv, S->o->seed, OFFSET_SKETCH,
                                            rng_ids_of(S->o->rng_ids)));
    msk_dash_thin ta = { .m = S->a, .by_id = 1, .dd = S->o->eps, .vecs = m };
    msk_dash_thin tx = { .m = S->x, .by_id = 1, .dd = 0.0, .vecs = m };
    MS_CUDA_LAUNCH(S->ctx, msk_dash_thin_f64(S->ctx, S->st, &pos, &ta, S->sv, S->sw1));
    double *cur = S->sw1, *nxt = S->sw2;
    for (int r = 0; r < S->o->root; r++) {
        MS_CUDA_LAUNCH(S->ctx, msk_dash_thin_f64(S->ctx, S->st, &pos, &tx, cur, nxt));
        double *t = cur; cur = nxt; nxt = t;
    }
    MS_CUDA_LAUNCH(S->ctx, msk_dash_residual(S->ctx, S->st, &pos, m, S->sv, cur, residual));
    S->launches += 3 + S->o->root;
    return MS_OK;
}

/* --- ms_inv_root ----------------------------------------------------------------------------------------------- */

static int slots_for(const ms_root_options *o)
{
    switch (o->method) {
    case MS_ROOT_NDB:       return o->root == 4 ? 6 : 5;
    case MS_ROOT_CN:        return 5;
    case MS_ROOT_CHEBYSHEV: return 3;
    default:                return 2;
    }
}

/* The small device arrays, laid out one after another (256-byte aligned); returns the bytes. */
static size_t small_layout(solver *S, char *base, int pi_m)
{
    const int64_t K = S->K, n = S->n;
    size_t off = 0;
#define CARVE(field, type, count)                                                                      \
    do {                                                                                               \
        if (base) S->field = (type *)(base + off);                                                     \
        off += align256((size_t)(count) * sizeof(type));                                               \
    } while (0)
    msk_dash_pos pos = { n, K, NULL, NULL };
    CARVE(scale, double, K);
    CARVE(partials, double, msk_dash_fro_scratch(&pos));
    CARVE(dev, unsigned, K);
    CARVE(live, int, K);
    CARVE(map, int, K);
    CARVE(from, int, K);
    CARVE(to, int, K);
    CARVE(counts, int, 2);
    CARVE(acc, int, K);
    CARVE(idx, int, K);
    CARVE(info, int, K);
    CARVE(bad, int, K);
    CARVE(pv, float, K * n * pi_m);
    CARVE(pw, float, K * n * pi_m);
    CARVE(pv16, uint16_t, K * n * pi_m);
    CARVE(evals, float, K * n);
    CARVE(sv, double, K * n * SKETCH_VECTORS);
    CARVE(sw1, double, K * n * SKETCH_VECTORS);
    CARVE(sw2, double, K * n * SKETCH_VECTORS);
#undef CARVE
    return off;
}

ms_status ms_cuda_inv_root(ms_ctx *ctx, ms_tensor *x, ms_tensor *residual, ms_tensor *iters, const ms_tensor *a,
                           const ms_root_options *o)
{
    MS_NVTX_RANGE("ms_inv_root");
    MS_TRY(ms_cuda_enter(ctx));
    solver S;
    memset(&S, 0, sizeof S);
    S.ctx = ctx;
    S.st = ms_cuda(ctx)->stream;
    S.o = o;
    S.N = a->shape[0];
    S.n = a->shape[1];
    S.nn = S.n * S.n;
    S.K = o->index ? o->index->shape[0] : S.N;
    if (S.K == 0 || S.n == 0) return MS_OK;
    if (S.n > 46340 || S.K > INT_MAX / 2)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_inv_root on %s: %lld blocks of %lld exceed cuBLAS's int", ctx->name,
                       (long long)S.K, (long long)S.n);
    S.tf32 = o->allow_tf32 != 0;
    S.mm = o->method == MS_ROOT_EVD ? MS_DTYPE_F32 : o->matmul_dtype;
    S.capturing = stream_capturing(ctx);
    S.early = o->tolerance > 0 && (o->method == MS_ROOT_NDB || o->method == MS_ROOT_CN);
    S.lag = env_int("MOONSTEP_DASH_LAG", 2, 0, PIN_RING / 2);
    S.every = env_int("MOONSTEP_DASH_SYNC_EVERY", 3, 1, 64);
    S.a = ms_tensor_ptr(a);
    S.x = ms_tensor_ptr(x);
    choose_split(&S);
    MS_TRY(ms_cuda_blas(ctx, &S.blas));
    S.lt_tile = S.tf32 && o->method == MS_ROOT_CN ? solver_tile(ctx, S.K, S.n) : 0;
    if (S.lt_tile && !S.capturing) MS_TRY(dash_lt(ctx, &S.dash));
    else if (o->method == MS_ROOT_EVD || (S.early && !S.capturing && S.lag > 0))
        MS_TRY(dash_state(ctx, S.capturing, &S.dash));
    if (S.lt_tile && S.capturing && S.dash == NULL) S.dash = ms_cuda(ctx)->dash;

    const int pi_m = o->method != MS_ROOT_EVD && o->scaling == MS_SCALING_PIM ? o->pi_vectors : 1;
    const size_t small_bytes = small_layout(&S, NULL, pi_m);
    const int nslots = slots_for(o);
    S.slot_bytes = align256((size_t)S.K * (size_t)S.nn * sizeof(float));
    S.shadow_bytes = S.mm == MS_DTYPE_F32 ? 0 : align256((size_t)S.K * (size_t)S.nn * 2);
    const size_t slots_bytes = S.slot_bytes * (size_t)nslots, shadows_bytes = S.shadow_bytes * 5;
    char *small = NULL;
    MS_TRY(ms_cuda_scratch(ctx, small_bytes, (void **)&small));
    ms_status st = ms_cuda_scratch(ctx, slots_bytes, (void **)&S.slots);
    if (st == MS_OK && shadows_bytes) st = ms_cuda_scratch(ctx, shadows_bytes, (void **)&S.shadows);
    if (st == MS_OK) {
        small_layout(&S, small, pi_m);
        S.pos = (msk_dash_pos){ S.n, S.K, NULL, NULL };
        if (o->index) {
            st = ms_cuda_note_failure(ctx, msk_dash_index(ctx, S.st, S.K, ms_tensor_ptr(o->index), S.N, S.idx));
            S.index = S.idx;
            S.pos.index = S.idx;
            S.launches++;
        }
    }
    if (st == MS_OK) {
        cudaError_t e = cudaMemsetAsync(S.acc, 0, (size_t)S.K * sizeof(int), S.st);
        if (e != cudaSuccess) st = ms_cuda_fail(ctx, e, "cudaMemsetAsync (iteration counts)", __FILE__, __LINE__);
        S.launches++;
    }
    if (st == MS_OK && o->method != MS_ROOT_EVD) st = compute_scale(&S);
    if (st == MS_OK) {
        switch (o->method) {
        case MS_ROOT_NDB:       st = ndb_solve(&S); break;
        case MS_ROOT_CN:        st = cn_solve(&S); break;
        case MS_ROOT_CHEBYSHEV: st = cheb_solve(&S); break;
        default:                st = evd_solve(&S); break;
        }
    }
    S.pos = (msk_dash_pos){ S.n, S.K, NULL, S.index };
    if (st == MS_OK && iters) {
        st = ms_cuda_note_failure(ctx, msk_dash_iters_out(ctx, S.st, &S.pos, S.acc, ms_tensor_ptr(iters)));
        S.launches++;
    }
    if (st == MS_OK && residual) st = residual_run(&S, ms_tensor_ptr(residual));
    if (st == MS_OK) {
        ms_cuda_track_tensor(ctx, x);
        ms_cuda_track_tensor(ctx, a);
        ms_cuda_track_tensor(ctx, residual);
        ms_cuda_track_tensor(ctx, iters);
        ms_cuda_track_tensor(ctx, o->index);
        ms_cuda_track_tensor(ctx, o->rng_ids);
        ctx->launches += S.launches > 1 ? S.launches - 1 : 0;
    }
    if (S.shadows) ms_cuda_scratch_free(ctx, S.shadows, shadows_bytes);
    if (S.slots) ms_cuda_scratch_free(ctx, S.slots, slots_bytes);
    ms_cuda_scratch_free(ctx, small, small_bytes);
    return st;
}

/* --- ms_spectrum_estimate ----------------------------------------------------------------------------------------- */

ms_status ms_cuda_spectrum_estimate(ms_ctx *ctx, ms_tensor *lam_max, ms_tensor *lam_min, const ms_tensor *a,
                                    const ms_tensor *x_root, const ms_spectrum_options *o)
{
    MS_NVTX_RANGE("ms_spectrum_estimate");
    MS_TRY(ms_cuda_enter(ctx));
    const int64_t N = a->shape[0], n = a->shape[1];
    if (N == 0) return MS_OK;
    if (n == 0) {
        MS_TRY(ms_cuda_fill_tensor(ctx, lam_max, -o->eps));
        return lam_min ? ms_cuda_fill_tensor(ctx, lam_min, INFINITY) : MS_OK;
    }
    cudaStream_t st = ms_cuda(ctx)->stream;
    if (n > 46340 || N > INT_MAX)
        return MS_FAIL(ctx, MS_E_UNSUPPORTED, "ms_spectrum_estimate on %s: %lld blocks of %lld exceed cuBLAS's int",
                       ctx->name, (long long)N, (long long)n);
    const int m = o->vectors;
    const bool bf16 = o->bf16 != 0;
    const size_t vbytes = align256((size_t)(N * n * m) * sizeof(float));
    const size_t v16bytes = align256((size_t)(N * n * m) * 2);
    const size_t mbytes = align256((size_t)(N * n * n) * (bf16 ? 2 : 4));
    const size_t total = 2 * vbytes + v16bytes + mbytes;
    char *mem = NULL;
    pi_gemm g = { NULL, NULL, NULL, false };   /* exact f32 unless bf16: the options have no TF32 switch */
    MS_TRY(ms_cuda_blas(ctx, &g.blas));
    MS_TRY(ms_cuda_scratch(ctx, total, (void **)&mem));
    float *v = (float *)mem, *w = (float *)(mem + vbytes);
    g.v16 = mem + 2 * vbytes;
    g.mat = mem + 2 * vbytes + v16bytes;
    msk_dash_pos pos = { n, N, NULL, NULL };
    int launches = 0;
    /* on A damped by eps (lam_max = q - eps), then on the root undamped (lam_min = mu^-p) */
    const int *ids = rng_ids_of(o->rng_ids);
    ms_status s1 = power_iteration(ctx, st, &pos, &g, ms_tensor_ptr(a), 0.0f, (float)o->eps, bf16, m, o->steps,
                                   o->seed, 0, ids, v, w, 1, 1.0, o->eps, 0.0, ms_tensor_ptr(lam_max), &launches);
    if (s1 == MS_OK && lam_min)
        s1 = power_iteration(ctx, st, &pos, &g, ms_tensor_ptr(x_root), 0.0f, 0.0f, bf16, m, o->steps, o->seed,
                             OFFSET_ROOT_PI, ids, v, w, 2, 1.0, 0.0, (double)o->root, ms_tensor_ptr(lam_min),
                             &launches);
    ms_cuda_scratch_free(ctx, mem, total);
    if (s1 != MS_OK) return s1;
    ms_cuda_track_tensor(ctx, lam_max);
    ms_cuda_track_tensor(ctx, lam_min);
    ms_cuda_track_tensor(ctx, a);
    ms_cuda_track_tensor(ctx, x_root);
    ms_cuda_track_tensor(ctx, o->rng_ids);
    ctx->launches += launches > 1 ? launches - 1 : 0;
    return MS_OK;
}

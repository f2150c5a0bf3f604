/*
** bench/gemm_survey.cu -- the batched GEMMs of DASH's solvers under every operand layout and every cuBLASLt
** candidate the heuristic offers (no split-K), timed on the GPU host.  The solvers' operands are symmetric (every
** iterate is a polynomial in the factor), so op(A) = A either way and the layout is free to choose; this
** measures which one the tensor cores run fastest, and how far the heuristic's first candidate is from the best,
** and what computing only the lower tiles of a product (run_tiles) costs against the full one.
**
**   make bench-c                        (builds build/bench/gemm_survey with the CUDA toolkit)
**   build/bench/gemm_survey [n batch]...   (default: 1024 228  512 12, the subset's two factor stacks)
**   MOONSTEP_SURVEY_SUSTAINED=1 ...        also each NN / TN candidate 36 times back to back (the power limit)
**   MOONSTEP_SURVEY_AB=2,2 ...             candidate 2 of layout 2 (TN) and the default, 36 each, alternated 6 times
*/
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d cublas %d\n", __FILE__, __LINE__, (int)s_); exit(1); } } while (0)

__global__ void fill_sym(float *a, int n, long long nn, long long total, unsigned seed)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long b = i / nn, r = (i % nn) / n, c = i % n;
        long long lo = r < c ? r : c, hi = r < c ? c : r;
        unsigned h = (unsigned)(b * 2654435761u) ^ (unsigned)(lo * 40503u + hi * 9973u) ^ seed;
        h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
        a[i] = (float)(h & 0xffffff) / 16777216.0f - 0.5f + (r == c ? 2.0f : 0.0f);
    }
}

static float median(float *t, int n)
{
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            if (t[j] < t[i]) { float x = t[i]; t[i] = t[j]; t[j] = x; }
    return t[n / 2];
}

/* the median of `reps` timed calls of fn after two warm-ups */
static float time_it(cudaStream_t st, int reps, void (*fn)(void *), void *arg)
{
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    fn(arg);
    fn(arg);
    CK(cudaStreamSynchronize(st));
    float t[64];
    for (int r = 0; r < reps && r < 64; r++) {
        CK(cudaEventRecord(e0, st));
        fn(arg);
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&t[r], e0, e1));
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return median(t, reps < 64 ? reps : 64);
}

struct ex_arg { cublasHandle_t h; cublasOperation_t ta, tb; int n, batch; float *a, *b, *c; };
static void run_ex(void *p)
{
    struct ex_arg *x = (struct ex_arg *)p;
    const float one = 1, zero = 0;
    long long nn = (long long)x->n * x->n;
    CB(cublasGemmStridedBatchedEx(x->h, x->ta, x->tb, x->n, x->n, x->n, &one, x->a, CUDA_R_32F, x->n, nn, x->b, CUDA_R_32F,
                                  x->n, nn, &zero, x->c, CUDA_R_32F, x->n, nn, x->batch, CUBLAS_COMPUTE_32F_FAST_TF32,
                                  CUBLAS_GEMM_DEFAULT));
}

/* A product of symmetric matrices kept as their lower 2 x 2 tiles (h = n / 2; the upper tile is never read or
** written): C00 = A00 B00 + A10^T B10, C10 = A10 B00 + A11 B10, C11 = A10 B10^T + A11 B11, six strided-batched
** h^3 products (three with a transposed operand, three accumulating), 75% of the full product's flops and no
** mirror pass.  x->ta carries the compute type's choice: N for TF32, T for plain f32 (the check below). */
static void run_tiles(void *p)
{
    struct ex_arg *x = (struct ex_arg *)p;
    const float one = 1, zero = 0;
    const int n = x->n, q = n / 2;
    const long long nn = (long long)n * n;
    const cublasComputeType_t ct = x->ta == CUBLAS_OP_N ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F_PEDANTIC;
    const cublasOperation_t N = CUBLAS_OP_N, T = CUBLAS_OP_T;
#define TILE(m, i, j) ((m) + (long long)(i) * q + (long long)(j) * q * n)
    const struct { cublasOperation_t oa, ob; float *a, *b, *c; const float *beta; } g[6] = {
        { N, N, TILE(x->a, 0, 0), TILE(x->b, 0, 0), TILE(x->c, 0, 0), &zero },
        { N, N, TILE(x->a, 1, 0), TILE(x->b, 0, 0), TILE(x->c, 1, 0), &zero },
        { N, N, TILE(x->a, 1, 1), TILE(x->b, 1, 1), TILE(x->c, 1, 1), &zero },
        { T, N, TILE(x->a, 1, 0), TILE(x->b, 1, 0), TILE(x->c, 0, 0), &one },
        { N, N, TILE(x->a, 1, 1), TILE(x->b, 1, 0), TILE(x->c, 1, 0), &one },
        { N, T, TILE(x->a, 1, 0), TILE(x->b, 1, 0), TILE(x->c, 1, 1), &one },
    };
#undef TILE
    for (int k = 0; k < 6; k++)
        CB(cublasGemmStridedBatchedEx(x->h, g[k].oa, g[k].ob, q, q, q, &one, g[k].a, CUDA_R_32F, n, nn, g[k].b, CUDA_R_32F, n,
                                      nn, g[k].beta, g[k].c, CUDA_R_32F, n, nn, x->batch, ct, CUBLAS_GEMM_DEFAULT));
}

static void run_36(void *p)   /* 36 products back to back: CN's count, long enough to meet the power limit */
{
    struct ex_arg *x = (struct ex_arg *)p;
    for (int i = 0; i < 36; i++) (x->tb == CUBLAS_OP_T ? run_tiles : run_ex)(x);
}

struct lt_arg { cublasLtHandle_t lt; cublasLtMatmulDesc_t d; cublasLtMatrixLayout_t l; const cublasLtMatmulAlgo_t *algo;
                float *a, *b, *c; void *ws; size_t wsb; cudaStream_t st; };
static void run_lt(void *p)
{
    struct lt_arg *x = (struct lt_arg *)p;
    const float one = 1, zero = 0;
    CB(cublasLtMatmul(x->lt, x->d, &one, x->a, x->l, x->b, x->l, &zero, x->c, x->l, x->c, x->l, x->algo, x->ws, x->wsb, x->st));
}

static void run_lt36(void *p)   /* sustained, as run_36 */
{
    for (int i = 0; i < 36; i++) run_lt(p);
}

int main(int argc, char **argv)
{
    int shapes[8][2] = { { 1024, 228 }, { 512, 12 } }, ns = 2;
    /* MOONSTEP_SURVEY_SUSTAINED=1: each NN and TN candidate also timed 36 products back to back, after the default's 36 */
    const bool sustained = getenv("MOONSTEP_SURVEY_SUSTAINED") != NULL && atoi(getenv("MOONSTEP_SURVEY_SUSTAINED")) != 0;
    /* MOONSTEP_SURVEY_AB=layout,index (layout 0 NN .. 3 TT): that candidate and the default alternated, 36 each */
    int ab_layout = -1, ab_index = -1;
    if (getenv("MOONSTEP_SURVEY_AB") != NULL) sscanf(getenv("MOONSTEP_SURVEY_AB"), "%d,%d", &ab_layout, &ab_index);
    if (argc > 2) {
        ns = 0;
        for (int i = 1; i + 1 < argc && ns < 8; i += 2, ns++) { shapes[ns][0] = atoi(argv[i]); shapes[ns][1] = atoi(argv[i + 1]); }
    }
    cublasHandle_t h;
    cublasLtHandle_t lt;
    CB(cublasCreate(&h));
    CB(cublasLtCreate(&lt));
    cudaStream_t st = 0;
    const size_t wsb = 32u << 20;
    void *ws;
    CK(cudaMalloc(&ws, wsb));
    CB(cublasSetWorkspace(h, ws, wsb));
    for (int s = 0; s < ns; s++) {
        const int n = shapes[s][0], batch = shapes[s][1];
        const long long nn = (long long)n * n, total = nn * batch;
        float *a, *b, *c;
        CK(cudaMalloc(&a, total * 4));
        CK(cudaMalloc(&b, total * 4));
        CK(cudaMalloc(&c, total * 4));
        fill_sym<<<1024, 256>>>(a, n, nn, total, 1u);
        fill_sym<<<1024, 256>>>(b, n, nn, total, 7u);
        CK(cudaDeviceSynchronize());
        const double flop = 2.0 * n * (double)n * n * batch;
        printf("n = %d, batch = %d (TF32, f32 in and out)\n", n, batch);
        const char *nm[4] = { "NN", "NT", "TN", "TT" };
        for (int o = 0; o < 4; o++) {
            struct ex_arg x = { h, (o & 2) ? CUBLAS_OP_T : CUBLAS_OP_N, (o & 1) ? CUBLAS_OP_T : CUBLAS_OP_N, n, batch, a, b, c };
            float ms = time_it(st, 15, run_ex, &x);
            printf("  GemmStridedBatchedEx %s: %8.4f ms  %6.1f TFLOPS\n", nm[o], ms, flop / ms / 1e9);
        }
        for (int o = 0; o < 4; o++) {
            cublasOperation_t ta = (o & 2) ? CUBLAS_OP_T : CUBLAS_OP_N, tb = (o & 1) ? CUBLAS_OP_T : CUBLAS_OP_N;
            cublasLtMatmulDesc_t d;
            cublasLtMatrixLayout_t l;
            CB(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F));
            CB(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
            CB(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
            CB(cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, n, n, n));
            int32_t nb = batch;
            int64_t sb = nn;
            CB(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &nb, sizeof nb));
            CB(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sb, sizeof sb));
            cublasLtMatmulPreference_t pref;
            CB(cublasLtMatmulPreferenceCreate(&pref));
            uint64_t w = wsb;
            uint32_t nosplit = CUBLASLT_REDUCTION_SCHEME_NONE;
            CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, sizeof w));
            CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &nosplit, sizeof nosplit));
            cublasLtMatmulHeuristicResult_t res[16];
            int found = 0;
            CB(cublasLtMatmulAlgoGetHeuristic(lt, d, l, l, l, l, pref, 16, res, &found));
            for (int i = 0; i < found; i++) {
                if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
                int tile = -1, stages = -1, cluster = -1, swz = -1, id = -1;
                size_t sz;
                cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &sz);
                cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &sz);
                cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &sz);
                cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster, &sz);
                cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof swz, &sz);
                struct lt_arg x = { lt, d, l, &res[i].algo, a, b, c, ws, wsb, st };
                float ms = time_it(st, 15, run_lt, &x);
                if (ab_layout == o && ab_index == i) {   /* the default's 36 and this candidate's, alternated */
                    struct ex_arg xd = { h, CUBLAS_OP_N, CUBLAS_OP_N, n, batch, a, b, c };
                    for (int r = 0; r < 6; r++) {
                        const float t0 = time_it(st, 3, run_36, &xd) / 36, t1 = time_it(st, 3, run_lt36, &x) / 36;
                        printf("  A/B round %d: default NN %8.4f ms, Lt %s #%d %8.4f ms a product (%+.1f%%)\n", r, t0, nm[o], i, t1,
                               100.0 * (t1 / t0 - 1));
                    }
                }
                /* sustained: 36 back to back (the GPU at its power limit), right after the default's 36 */
                float ms36 = -1, def36 = -1;
                if (sustained && (o == 0 || o == 2)) {
                    struct ex_arg xd = { h, CUBLAS_OP_N, CUBLAS_OP_N, n, batch, a, b, c };
                    def36 = time_it(st, 3, run_36, &xd) / 36;
                    ms36 = time_it(st, 3, run_lt36, &x) / 36;
                }
                printf("  Lt %s #%2d: %8.4f ms  %6.1f TFLOPS  (algo %d tile %d stages %d cluster %d swizzle %d ws %zu)"
                       "  36 back to back: %8.4f ms a product (default %8.4f)\n", nm[o], i, ms,
                       flop / ms / 1e9, id, tile, stages, cluster, swz, res[i].workspaceSize, ms36, def36);
            }
            cublasLtMatmulPreferenceDestroy(pref);
            cublasLtMatrixLayoutDestroy(l);
            cublasLtMatmulDescDestroy(d);
        }
        if (n % 2 == 0) {
            /* lower tiles against the full product: checked in plain f32 (the upper tiles of the inputs poisoned
            ** with NaN, the output's lower tiles compared), then 36 of each back to back in TF32 */
            const long long q = n / 2;
            float *ap, *bp;
            CK(cudaMalloc(&ap, total * 4));
            CK(cudaMalloc(&bp, total * 4));
            CK(cudaMemcpy(ap, a, total * 4, cudaMemcpyDeviceToDevice));
            CK(cudaMemcpy(bp, b, total * 4, cudaMemcpyDeviceToDevice));
            for (long long j = q; j < n; j++) {   /* column j's upper half, every block */
                CK(cudaMemset2D(ap + j * n, (size_t)nn * 4, 0xff, (size_t)q * 4, (size_t)batch));
                CK(cudaMemset2D(bp + j * n, (size_t)nn * 4, 0xff, (size_t)q * 4, (size_t)batch));
            }
            const float one = 1, zero = 0;
            CB(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_32F, n, nn, b, CUDA_R_32F, n,
                                          nn, &zero, c, CUDA_R_32F, n, nn, batch, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
            float *ct;
            CK(cudaMalloc(&ct, total * 4));
            CK(cudaMemset(ct, 0xff, total * 4));
            struct ex_arg chk = { h, CUBLAS_OP_T, CUBLAS_OP_T, n, batch, ap, bp, ct };
            run_tiles(&chk);
            float *h1 = (float *)malloc(nn * 4), *h2 = (float *)malloc(nn * 4);
            CK(cudaMemcpy(h1, c, nn * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(h2, ct, nn * 4, cudaMemcpyDeviceToHost));
            double worst = 0, big = 0;
            for (long long i = 0; i < nn; i++) {
                const long long r = i % n, col = i / n;
                if (r < q && col >= q) continue;
                const double d = fabs((double)h1[i] - h2[i]);
                worst = d == d && worst == worst ? (d > worst ? d : worst) : NAN;
                big = fabs(h1[i]) > big ? fabs(h1[i]) : big;
            }
            printf("  lower tiles (6 products of n/2, f32): max |full - tiles| = %.3g of max |C| %.3g\n", worst, big);
            free(h1);
            free(h2);
            struct ex_arg full = { h, CUBLAS_OP_N, CUBLAS_OP_N, n, batch, a, b, c }, tiles = full;
            tiles.tb = CUBLAS_OP_T;
            tiles.c = ct;
            for (int r = 0; r < 2; r++) {
                const float tf = time_it(st, 3, run_36, &full) / 36, tt = time_it(st, 3, run_36, &tiles) / 36;
                printf("  TF32, 36 back to back: full %8.4f ms, lower tiles %8.4f ms a product (%.2fx)\n", tf, tt, tt / tf);
            }
            cudaFree(ap);
            cudaFree(bp);
            cudaFree(ct);
        }
        cudaFree(a);
        cudaFree(b);
        cudaFree(c);
    }
    if (ns >= 2) {
        /* CN's 36 products of the two first shapes: the big stack alone, the small alone, both interleaved on one
        ** stream, and the small on a second stream (its own handle and workspace) beside the big */
        const int n0 = shapes[0][0], b0 = shapes[0][1], n1 = shapes[1][0], b1 = shapes[1][1];
        float *a0, *c0, *a1, *c1;
        CK(cudaMalloc(&a0, (size_t)n0 * n0 * b0 * 4));
        CK(cudaMalloc(&c0, (size_t)n0 * n0 * b0 * 4));
        CK(cudaMalloc(&a1, (size_t)n1 * n1 * b1 * 4));
        CK(cudaMalloc(&c1, (size_t)n1 * n1 * b1 * 4));
        fill_sym<<<1024, 256>>>(a0, n0, (long long)n0 * n0, (long long)n0 * n0 * b0, 3u);
        fill_sym<<<1024, 256>>>(a1, n1, (long long)n1 * n1, (long long)n1 * n1 * b1, 5u);
        cublasHandle_t h2;
        CB(cublasCreate(&h2));
        void *ws2;
        CK(cudaMalloc(&ws2, wsb));
        CB(cublasSetWorkspace(h2, ws2, wsb));
        cudaStream_t s2;
        CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
        CB(cublasSetStream(h2, s2));
        cudaEvent_t e0, e1, fork, join;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
        CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
        struct ex_arg big = { h, CUBLAS_OP_N, CUBLAS_OP_N, n0, b0, a0, a0, c0 };
        struct ex_arg small = { h, CUBLAS_OP_N, CUBLAS_OP_N, n1, b1, a1, a1, c1 };
        struct ex_arg side = { h2, CUBLAS_OP_N, CUBLAS_OP_N, n1, b1, a1, a1, c1 };
        const char *what[4] = { "big alone", "small alone", "both, one stream", "both, side by side" };
        for (int mode = 0; mode < 4; mode++) {
            float t[5];
            for (int r = 0; r < 5; r++) {
                CK(cudaDeviceSynchronize());
                CK(cudaEventRecord(e0, st));
                if (mode == 3) {
                    CK(cudaEventRecord(fork, st));
                    CK(cudaStreamWaitEvent(s2, fork, 0));
                }
                for (int i = 0; i < 36; i++) {
                    if (mode != 1) run_ex(&big);
                    if (mode == 1 || mode == 2) run_ex(&small);
                    if (mode == 3) run_ex(&side);
                }
                if (mode == 3) {
                    CK(cudaEventRecord(join, s2));
                    CK(cudaStreamWaitEvent(st, join, 0));
                }
                CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&t[r], e0, e1));
            }
            printf("36 products: %-20s %8.3f ms (median of 5)\n", what[mode], median(t, 5));
        }
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        cudaEventDestroy(fork);
        cudaEventDestroy(join);
        cublasDestroy(h2);
        cudaStreamDestroy(s2);
        cudaFree(ws2);
        cudaFree(a0);
        cudaFree(c0);
        cudaFree(a1);
        cudaFree(c1);
    }
    cudaFree(ws);
    cublasLtDestroy(lt);
    cublasDestroy(h);
    return 0;
}

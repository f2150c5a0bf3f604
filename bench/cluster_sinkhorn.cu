/* bench/cluster_sinkhorn.cu -- experiment, stand-alone: a whole SinkGD base step of a call of a few small matrices
** in one kernel, G held on chip for every iteration (GPU host).
**
** kernels/sinkgd.cu runs a step as passes over G (a sweep and a fold per SR-Sinkhorn iteration, then the apply),
** each reading G from L2 or DRAM.  A 1408 x 2048 bf16 matrix is 5.8 MB: 16 CTAs hold it in shared memory and
** registers (88 rows a CTA; of a thread's 44 rows, 27 in shared memory and 17 in registers), so after one read
** from DRAM the iterations read no memory at all.  The 16 CTAs of a matrix form H clusters of CS = 16 / H.  Column
** sums cross a cluster through distributed shared memory (two cluster barriers an iteration; each column's owner
** CTA adds the cluster's sums in rank order and writes c back into every CTA); with H > 1 the owners of the same
** columns in the H clusters also exchange their clusters' sums through global memory (flags, no grid barrier; the
** launch is cooperative, so every partner is resident).  Row sums stay inside a CTA.  The apply reads p and writes
** it once.  Thread t owns the 8 columns of chunk t mod (n / 8) and every (512 / (n / 8))-th row of its CTA's band.
**
** Checked against an f64 SR-Sinkhorn and apply on the CPU (r, c, p); then timed with sinkhorn_iters L = 0..5
** against 4 buffer sets, so that each step reads its G and p from DRAM.
** Result (bench/RESULTS.md, eleventh session): an iteration costs 10.6-11.8 us whether the call has 1 or 7
** matrices (the engine: 18-19), bound by each CTA's own work, not by memory.  But an H200 runs at most 7 clusters
** of 16, 15 of 8 or 30 of 4 at once (112-120 SMs), so 8 x 1408 x 2048 (128 CTAs) never fits one wave: 0.171 ms
** against the engine's 0.156.  Not built into the engine.
**
**   build/bench/cluster_sinkhorn [count] [iters]       (count matrices of 1408 x 2048, default 8; 5 iterations)
**   (built with CS_ = 16; -DCS_=8 or 4 for 2 or 4 clusters a matrix)
*/
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "standalone.cuh"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace cg = cooperative_groups;

#define T 512

/* the compiler must assume w changed: nothing derived from it (unpacked values, squares) stays alive across */
__device__ __forceinline__ void launder(uint4 &w) { asm volatile("" : "+r"(w.x), "+r"(w.y), "+r"(w.z), "+r"(w.w)); }

__device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ uint32_t pack2(float a, float b)
{
    const __nv_bfloat16 lo = __float2bfloat16_rn(a), hi = __float2bfloat16_rn(b);
    return (uint32_t)*reinterpret_cast<const uint16_t *>(&lo) | ((uint32_t)*reinterpret_cast<const uint16_t *>(&hi) << 16);
}

/* N columns, CS CTAs a cluster (one matrix), RB rows a CTA, NREG of a thread's rows in registers */
/* H clusters of CS CTAs a matrix; with H = 2 the two clusters' column sums meet in global memory (xb, double
** buffered by iteration parity), each owner CTA waiting only for its partner's flag (the launch is cooperative,
** so the partner is resident); flags count up across launches from base */
template <int N, int CS, int H, int RB, int NREG>
__global__ void __launch_bounds__(T, 1) step_kernel(const __nv_bfloat16 *__restrict__ G, __nv_bfloat16 *__restrict__ Pm,
                                                    float *rout, float *cout, int m, int L, float eps, float dec,
                                                    float coef, float *xb, unsigned *flags, unsigned base)
{
    constexpr int CPR = N / 8, P = T / CPR, ROWS = RB / P, NSM = ROWS - NREG, WPR = CPR / 32;
    static_assert(T % CPR == 0 && RB % P == 0 && NSM >= 0 && N % CS == 0, "shape");
    cg::cluster_group cl = cg::this_cluster();
    const int rank = (int)cl.block_rank();
    const int mat = blockIdx.x / (CS * H), half = (blockIdx.x / CS) % H;
    extern __shared__ __align__(16) uint4 sm[];
    /* N: this CTA's column sums; then c, written there by the column's owner CTA, which alone reads that column */
    float *part = reinterpret_cast<float *>(sm + NSM * T);
    float *rowp = part + N;   /* RB x WPR: warp sums of the row sums; then each row's r^2 (0 past m) in its first */
    float rown = 1.f;   /* thread t < RB: r of its row t (written to rowp[t WPR + 1] for the apply) */
    const int t = threadIdx.x, k = t % CPR, q = t / CPR, lane = t & 31, wr = k / 32;
    const int row0 = (half * CS + rank) * RB;
    const __nv_bfloat16 *g = G + (size_t)mat * m * N;

    uint4 greg[NREG > 0 ? NREG : 1];
#pragma unroll
    for (int j = 0; j < NREG; j++) {
        const int row = row0 + q + P * j;
        greg[j] = row < m ? __ldg(reinterpret_cast<const uint4 *>(g + (size_t)row * N) + k) : make_uint4(0, 0, 0, 0);
    }
    for (int j = 0; j < NSM; j++) {
        const int row = row0 + q + P * (NREG + j);
        sm[j * T + t] = row < m ? __ldg(reinterpret_cast<const uint4 *>(g + (size_t)row * N) + k) : make_uint4(0, 0, 0, 0);
    }
    constexpr int OWN = N / CS;
    static_assert(OWN <= T, "a column owner per thread");
    float cown = 1.f;   /* thread t < OWN: c of column rank OWN + t */
    static_assert(RB <= T && WPR >= 2, "a row owner per thread");
    float c1[8];
#pragma unroll
    for (int e = 0; e < 8; e++) c1[e] = 1.f;
    __syncthreads();
    const float sqn = sqrtf((float)N), sqm = sqrtf((float)m);

    for (int it = 0; it < L; it++) {
        /* row sums of G^2 c^2 */
#pragma unroll
        for (int j = 0; j < ROWS; j++) {
            float x[8];
            unpack8(j < NREG ? greg[j < NREG ? j : 0] : sm[(j - NREG) * T + t], x);
            float s = 0;
#pragma unroll
            for (int e = 0; e < 8; e++) {   /* (x c)^2, not x^2 c^2: no x^2 kept alive for the column pass */
                const float y = x[e] * c1[e];
                s = fmaf(y, y, s);
            }
            s = warp_sum(s);
            if (lane == 0) rowp[(q + P * j) * WPR + wr] = s;
        }
#pragma unroll
        for (int j = 0; j < NREG; j++) launder(greg[j]);
        __syncthreads();
        if (t < RB) {
            const int i = t;
            float ps = 0;
            for (int w = 0; w < WPR; w++) ps += rowp[i * WPR + w];
            const float ro = rown;
            const float q2 = ro * ro * ps;
            const float rn = ps == 0 ? ro : q2 >= eps * eps ? sqn * rsqrtf(ps) : sqn * ro / fmaxf(ro * sqrtf(ps), eps);
            const bool valid = row0 + i < m;
            rown = rn;
            rowp[i * WPR] = valid ? rn * rn : 0.f;
        }
        __syncthreads();
        /* column sums of r^2 G^2 */
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] = 0;
#pragma unroll
        for (int j = 0; j < NREG; j++) {
            float x[8];
            unpack8(greg[j], x);
            const float r2 = rowp[(q + P * j) * WPR];
#pragma unroll
            for (int e = 0; e < 8; e++) acc[e] = fmaf(x[e] * x[e], r2, acc[e]);
        }
#pragma unroll 2
        for (int j = NREG; j < ROWS; j++) {
            float x[8];
            unpack8(sm[(j - NREG) * T + t], x);
            const float r2 = rowp[(q + P * j) * WPR];
#pragma unroll
            for (int e = 0; e < 8; e++) acc[e] = fmaf(x[e] * x[e], r2, acc[e]);
        }
#pragma unroll
        for (int j = 0; j < NREG; j++) launder(greg[j]);
        for (int pp = 0; pp < P; pp++) {
            if (q == pp) {
                float4 *d = reinterpret_cast<float4 *>(part + 8 * k);
                if (pp == 0) {
                    d[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                    d[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
                } else {
                    const float4 a = d[0], b = d[1];
                    d[0] = make_float4(a.x + acc[0], a.y + acc[1], a.z + acc[2], a.w + acc[3]);
                    d[1] = make_float4(b.x + acc[4], b.y + acc[5], b.z + acc[6], b.w + acc[7]);
                }
            }
            if (P > 1) __syncthreads();
        }
        cl.sync();   /* every CTA's column sums are in place */
        if (t < OWN) {
            const int col = rank * OWN + t;
            float tj = 0;
#pragma unroll
            for (int r = 0; r < CS; r++) tj += cl.map_shared_rank(part, r)[col];
            if (H > 1) {
                float *xs = xb + ((size_t)(it & 1) * gridDim.x / CS + mat * H) * N;   /* [H][N] of this matrix */
                __stcg(xs + (size_t)half * N + col, tj);
                __threadfence();
                asm volatile("bar.sync 1, %0;\n" ::"r"(OWN) : "memory");
                unsigned *fl = flags + (size_t)mat * H * CS;
                if (t == 0) {
                    asm volatile("st.release.gpu.u32 [%0], %1;\n" ::"l"(fl + half * CS + rank), "r"(base + it + 1) : "memory");
                    for (int h = 0; h < H; h++) {
                        if (h == half) continue;
                        unsigned v;
                        do {
                            asm volatile("ld.acquire.gpu.u32 %0, [%1];\n" : "=r"(v) : "l"(fl + h * CS + rank) : "memory");
                        } while ((int)(v - (base + it + 1)) < 0);
                    }
                }
                asm volatile("bar.sync 1, %0;\n" ::"r"(OWN) : "memory");
                float sum = 0;   /* the clusters' sums in cluster order, the same bits in every cluster */
#pragma unroll
                for (int h = 0; h < H; h++) sum += h == half ? tj : __ldcg(xs + (size_t)h * N + col);
                tj = sum;
            }
            const float co = cown;
            const float cn = tj == 0 ? co : sqm * co / fmaxf(co * sqrtf(tj), eps);
            cown = cn;
#pragma unroll
            for (int r = 0; r < CS; r++) cl.map_shared_rank(part, r)[col] = cn;
        }
        cl.sync();   /* c is everywhere; every read of the column sums is done */
        const float4 ca = reinterpret_cast<const float4 *>(part + 8 * k)[0], cb = reinterpret_cast<const float4 *>(part + 8 * k)[1];
        c1[0] = ca.x; c1[1] = ca.y; c1[2] = ca.z; c1[3] = ca.w; c1[4] = cb.x; c1[5] = cb.y; c1[6] = cb.z; c1[7] = cb.w;
    }
    if (t < RB) rowp[t * WPR + 1] = rown;
    __syncthreads();
    if (rout != nullptr) {
        if (t < RB && row0 + t < m) rout[(size_t)mat * m + row0 + t] = rown;
        if (rank == 0 && q == 0)
            for (int e = 0; e < 8; e++) cout[(size_t)mat * N + 8 * k + e] = c1[e];
    }
    /* the apply: p <- p dec - coef r G c */
    float cc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) cc[e] = c1[e];
    __nv_bfloat16 *p = Pm + (size_t)mat * m * N;
    auto apply_row = [&](int j, const uint4 &gw, const uint4 &pw) {
        const int row = row0 + q + P * j;
        if (row >= m) return;
        float x[8], pv[8];
        unpack8(gw, x);
        unpack8(pw, pv);
        const float ri = rowp[(q + P * j) * WPR + 1];
        float o[8];
#pragma unroll
        for (int e = 0; e < 8; e++) o[e] = fmaf(pv[e], dec, -(coef * (ri * x[e] * cc[e])));
        __stcs(reinterpret_cast<uint4 *>(p + (size_t)row * N) + k,
               make_uint4(pack2(o[0], o[1]), pack2(o[2], o[3]), pack2(o[4], o[5]), pack2(o[6], o[7])));
    };
    auto load_p = [&](int j) -> uint4 {
        const int row = row0 + q + P * j;
        return j < ROWS && row < m ? __ldcs(reinterpret_cast<const uint4 *>(p + (size_t)row * N) + k) : make_uint4(0, 0, 0, 0);
    };
    constexpr int B = 6, BR = 2;   /* rows whose p is in flight at once (smem rows, register rows) */
#pragma unroll
    for (int j0 = 0; j0 < NREG; j0 += BR) {
        uint4 pw[BR];
#pragma unroll
        for (int u = 0; u < BR; u++)
            if (j0 + u < NREG) pw[u] = load_p(j0 + u);
#pragma unroll
        for (int u = 0; u < BR; u++)
            if (j0 + u < NREG) apply_row(j0 + u, greg[j0 + u], pw[u]);
    }
    for (int j0 = NREG; j0 < ROWS; j0 += B) {
        uint4 pw[B];
#pragma unroll
        for (int u = 0; u < B; u++) pw[u] = load_p(j0 + u);
#pragma unroll
        for (int u = 0; u < B; u++)
            if (j0 + u < ROWS) apply_row(j0 + u, sm[(j0 + u - NREG) * T + t], pw[u]);
    }
    cl.sync();   /* no CTA leaves while another may still read its shared memory */
}

static float bf(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t tobf(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

int main(int argc, char **argv)
{
#ifndef NREG_
#define NREG_ 17
#endif
#ifndef CS_
#define CS_ 16
#endif
    constexpr int M = 1408, N = 2048, CS = CS_, H = 16 / CS_, RB = 88, NREG = NREG_;
    const int cnt = argc > 1 ? atoi(argv[1]) : 8, L = argc > 2 ? atoi(argv[2]) : 5;
    auto kern = step_kernel<N, CS, H, RB, NREG>;
    constexpr int CPR = N / 8, P = T / CPR, ROWS = RB / P, NSM = ROWS - NREG;
    const size_t smem = (size_t)NSM * T * 16 + (N + RB * (CPR / 32)) * 4;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, kern));
    cudaLaunchConfig_t lc = {};
    cudaLaunchAttribute at[2];
    cluster_attr(at[0], CS);
    at[1].id = cudaLaunchAttributeCooperative;
    at[1].val.cooperative = H > 1;
    lc.gridDim = dim3(cnt * CS * H);
    lc.blockDim = dim3(T);
    lc.dynamicSmemBytes = smem;
    lc.attrs = at;
    lc.numAttrs = 2;
    int ncl = 0;
    CK(cudaOccupancyMaxActiveClusters(&ncl, kern, &lc));
    printf("cluster_sinkhorn: %d x %dx%d bf16, L = %d, %d clusters of %d a matrix, regs %d, spill %d, smem %zu, max active clusters %d\n",
           cnt, M, N, L, H, CS, fa.numRegs, (int)fa.localSizeBytes, smem, ncl);

    const size_t mn = (size_t)cnt * M * N;
    std::vector<uint16_t> hg(mn), hp(mn);
    uint64_t s = 12345;
    auto rnd = [&]() {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        return ((double)(s >> 11) / 9007199254740992.0) * 2 - 1;
    };
    for (size_t i = 0; i < mn; i++) {
        const int row = (int)((i / N) % M), col = (int)(i % N);
        hg[i] = tobf((float)(rnd() * (1 + (row % 7)) * (1 + 0.5 * (col % 5))));
        hp[i] = tobf((float)(rnd() * 0.05));
    }
    const float eps = 1e-8f, dec = 1.f - 1e-3f * 0.1f, coef = 1e-3f;
    const int sets = 4;   /* 4 x 2 x 46 MB: each timed step reads its G and p from DRAM */
    std::vector<__nv_bfloat16 *> dg(sets), dp(sets);
    for (int k = 0; k < sets; k++) {
        CK(cudaMalloc(&dg[k], mn * 2));
        CK(cudaMalloc(&dp[k], mn * 2));
        CK(cudaMemcpy(dg[k], hg.data(), mn * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dp[k], hp.data(), mn * 2, cudaMemcpyHostToDevice));
    }
    float *dr, *dc, *dxb;
    unsigned *dfl;
    CK(cudaMalloc(&dxb, (size_t)2 * cnt * H * N * 4));
    CK(cudaMalloc(&dfl, (size_t)cnt * H * CS * 4));
    CK(cudaMemset(dfl, 0, (size_t)cnt * H * CS * 4));
    unsigned base = 0;
    CK(cudaMalloc(&dr, (size_t)cnt * M * 4));
    CK(cudaMalloc(&dc, (size_t)cnt * N * 4));
    CK(cudaLaunchKernelEx(&lc, kern, (const __nv_bfloat16 *)dg[0], dp[0], dr, dc, M, L, eps, dec, coef, dxb, dfl, base));
    base += L + 1;
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<float> gr((size_t)cnt * M), gc((size_t)cnt * N);
    std::vector<uint16_t> gp(mn);
    CK(cudaMemcpy(gr.data(), dr, gr.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gc.data(), dc, gc.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gp.data(), dp[0], mn * 2, cudaMemcpyDeviceToHost));
    /* f64 reference: L iterations of row then column normalisation, then the apply */
    double er = 0, ec = 0, ep = 0, pmax = 0;
    for (int b = 0; b < cnt; b++) {
        std::vector<double> r(M, 1.0), c(N, 1.0), gd((size_t)M * N);
        for (size_t i = 0; i < (size_t)M * N; i++) gd[i] = bf(hg[(size_t)b * M * N + i]);
        for (int l = 0; l < L; l++) {
            for (int i = 0; i < M; i++) {
                double a = 0;
                for (int j = 0; j < N; j++) { double y = gd[(size_t)i * N + j] * c[j]; a += y * y; }
                const double nrm = r[i] * sqrt(a);
                if (a > 0) r[i] = sqrt((double)N) * r[i] / (nrm > eps ? nrm : eps);
            }
            std::vector<double> tc(N, 0.0);
            for (int i = 0; i < M; i++)
                for (int j = 0; j < N; j++) { double y = gd[(size_t)i * N + j] * r[i]; tc[j] += y * y; }
            for (int j = 0; j < N; j++) {
                const double nrm = c[j] * sqrt(tc[j]);
                if (tc[j] > 0) c[j] = sqrt((double)M) * c[j] / (nrm > eps ? nrm : eps);
            }
        }
        for (int i = 0; i < M; i++) {
            double d = fabs(gr[(size_t)b * M + i] - r[i]) / r[i];
            er = d > er || d != d ? d : er;
        }
        for (int j = 0; j < N; j++) {
            double d = fabs(gc[(size_t)b * N + j] - c[j]) / c[j];
            ec = d > ec || d != d ? d : ec;
        }
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                const size_t e = (size_t)b * M * N + (size_t)i * N + j;
                const double want = bf(hp[e]) * (double)dec - coef * r[i] * gd[(size_t)i * N + j] * c[j];
                const double d = fabs(bf(gp[e]) - want);
                ep = d > ep || d != d ? d : ep;
                pmax = fabs(want) > pmax ? fabs(want) : pmax;
            }
    }
    const bool ok = er < 2e-5 && ec < 2e-5 && ep <= pmax * 1.0 / 128;   /* one bf16 ulp of the largest p */
    printf("  r err %.1e  c err %.1e  p err %.2e of max %.2e  %s\n", er, ec, ep, pmax, ok ? "ok" : "FAILED");
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const int reps = 40;
    for (int Lt = 0; Lt <= L; Lt++) {
        float best = 1e30f;
        for (int trial = 0; trial < 7; trial++) {
            CK(cudaEventRecord(e0));
            for (int i = 0; i < reps; i++)
            {
                CK(cudaLaunchKernelEx(&lc, kern, (const __nv_bfloat16 *)dg[i % sets], dp[i % sets], (float *)nullptr,
                                      (float *)nullptr, M, Lt, eps, dec, coef, dxb, dfl, base));
                base += Lt + 1;
            }
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            best = fminf(best, ms / reps);
        }
        printf("  L = %d: step %.4f ms\n", Lt, best);
    }
    CK(cudaGetLastError());
    printf("%s\n", ok ? "all checks passed" : "FAILED");
    return ok ? 0 : 1;
}

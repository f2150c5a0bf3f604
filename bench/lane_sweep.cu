/* bench/lane_sweep.cu -- experiment, stand-alone: what a SR-Sinkhorn sweep of 14336 x 4096 bf16 spends its time on
** (GPU host).
**
** kernels/sinkgd.cu's sweep (fast_segment, K = 4) runs 512 threads an SM: a row of n = 4096 bf16 is a lane of 128
** threads, 4 chunks of 8 elements a thread, copied by cp.async into a ring of 3 stages; a thread keeps its group's
** G^2 (32 registers) from the row sums (shuffles, then a named barrier across the lane's 4 warps) to the column
** accumulators.  lane_sweep is that sweep, stand-alone, with these choices:
**   KEEP   G^2 held in registers (as the engine), or the chunks read again from the ring and squared again;
**   T      threads a CTA (one CTA an SM): 512, 768 or 1024, i.e. 4, 6 or 8 row lanes; STG ring stages;
**   ABL    timing ablations (their results are wrong): 1 no exchange across the lane's warps, 2 no column work, 3 no
**          row work, 4 only the ring, the unpacking and the row sums' shuffles, 5 only the ring.
** lane_reg loads the chunks NP groups ahead into registers with plain 16-byte loads instead of the ring, and
** band_read is a bare read of G in the sweep's bands (a CTA an SM, NF 16-byte loads in flight a thread).
** One sweep (c^2 given): S_i = sum_j G_ij^2 c_j^2, r_i = sqrt(n) / sqrt(S_i), the band's column partials
** sum_i r_i^2 G_ij^2, checked against f64; then timed back to back with the walk reversed every sweep, as the
** engine's sweeps run (the rows a sweep ends on are in L2 for the next).
** Result (bench/RESULTS.md, nineteenth session), us a sweep: the bare read 25; the ring alone 30.6; + unpacking,
** shuffles and r 32.5-32.9; the whole sweep 35.1-35.6 (the engine's iteration, sweep and fold, is 38-40), without
** the exchange 34.3, without the column work 35; G^2 read again 37; 768 threads 34.5, with 2 stages 33.4-34.3; 1024
** threads 37; plain loads 2 groups ahead 34.6-35.1.  No part costs more than ~4 us: the sweep runs at ~70% of the
** bare read's rate, spread over its pieces.  Twentieth session: more stages are slower, not faster (2 stages 34.7,
** 3 35.2, 4 35.4, 5 35.7; 768 threads with 4 stages 34.6), so bytes in flight do not bound the sweep.
**
**   build/bench/lane_sweep [M]     (n = 4096 bf16; M rows, default 14336)
*/
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "standalone.cuh"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

constexpr int N = 4096, K = 4, CP = N / 8 / K;   /* a row: 512 chunks, a lane of 128 threads */

__device__ __forceinline__ void cp16(unsigned dst, const void *src, int bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int W> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(W) : "memory"); }

/* c^2 into shared memory as float4 planes [k][h][kap] (shared by the lanes: the same columns) */
template <int T> __device__ __forceinline__ void c2_planes(const float *__restrict__ c2, float4 *c2s)
{
    for (int j = threadIdx.x; j < K * 2 * CP; j += T) {
        const int k = j / (2 * CP), h = (j / CP) & 1, kp = j % CP;
        c2s[j] = *reinterpret_cast<const float4 *>(c2 + (kp + CP * k) * 8 + 4 * h);
    }
    __syncthreads();
}

/* a row's sum over its lane's 4 warps (each warp's already reduced): through rd at the lane's named barrier */
template <int T> __device__ __forceinline__ float lane_sum(float ps, float *rd)
{
    const int rho = threadIdx.x / CP;
    if ((threadIdx.x & 31) == 0) rd[threadIdx.x >> 5] = ps;
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + rho), "r"(CP) : "memory");
    return (rd[rho * 4] + rd[rho * 4 + 1]) + (rd[rho * 4 + 2] + rd[rho * 4 + 3]);
}

/* the band's column partials: the lanes' accumulators as planes [lane][k][h][kap] in smem, summed in lane order */
template <int T> __device__ __forceinline__ void band_partials(const float (&acc)[K][8], char *smem, float *part)
{
    constexpr int P = T / CP;
    const int rho = threadIdx.x / CP, kap = threadIdx.x % CP;
    float4 *cb = reinterpret_cast<float4 *>(smem);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < K; k++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            cb[((rho * K + k) * 2 + h) * CP + kap] =
                make_float4(acc[k][4 * h], acc[k][4 * h + 1], acc[k][4 * h + 2], acc[k][4 * h + 3]);
    __syncthreads();
    for (int j = threadIdx.x; j < K * 2 * CP; j += T) {
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int l = 0; l < P; l++) {
            const float4 a = cb[l * K * 2 * CP + j];
            sum.x += a.x;
            sum.y += a.y;
            sum.z += a.z;
            sum.w += a.w;
        }
        const int k = j / (2 * CP), h = (j / CP) & 1, kp = j % CP;
        *reinterpret_cast<float4 *>(part + (int64_t)blockIdx.x * N + (kp + CP * k) * 8 + 4 * h) = sum;
    }
}

/* a group's row partial of this thread's K chunks, sum (G^2 c^2), reduced over the warp; KEEP keeps G^2 in z;
** ablations (ABL 3-5) leave the row work out, 5 the shuffles too */
template <bool KEEP, int ABL>
__device__ __forceinline__ float warp_row_sum(const uint4 (&w)[K], const float4 *c2s, int kap, float (&z)[KEEP ? K : 1][8])
{
    float pk[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        float x[8];
        unpack8(w[k], x);
        const float4 ca = c2s[(2 * k) * CP + kap], cb = c2s[(2 * k + 1) * CP + kap];
        const float cv[8] = { ca.x, ca.y, ca.z, ca.w, cb.x, cb.y, cb.z, cb.w };
        pk[k] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float sq = x[e] * x[e];
            if (KEEP) z[KEEP ? k : 0][e] = sq;
            if (ABL != 3 && ABL != 4 && ABL != 5) pk[k] = fmaf(sq, cv[e], pk[k]);
            else if (e == 0) pk[k] = sq;
        }
    }
    float ps = (pk[0] + pk[1]) + (pk[2] + pk[3]);
    if (ABL != 5)
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    return ps;
}

/* the column accumulators += co G^2 of the group's words, squared again */
__device__ __forceinline__ void add_columns(float (&acc)[K][8], float co, const uint4 (&w)[K])
{
#pragma unroll
    for (int k = 0; k < K; k++) {
        float x[8];
        unpack8(w[k], x);
#pragma unroll
        for (int e = 0; e < 8; e++) acc[k][e] = fmaf(co * x[e], x[e], acc[k][e]);
    }
}

template <int T, int STG> constexpr int smem_of() { return STG * T * K * 16 + K * 2 * CP * 16 + 2 * (T / 32) * 4; }

template <int T, bool KEEP, int STG, int ABL = 0>
__global__ void __launch_bounds__(T, 1)
lane_sweep(const __nv_bfloat16 *__restrict__ g, int m, const float *__restrict__ c2, const float *__restrict__ rold,
           float *__restrict__ rnew, float *__restrict__ part, int rev)
{
    constexpr int P = T / CP, STAGEB = T * K * 16;
    extern __shared__ __align__(16) char smem[];
    float4 *c2s = reinterpret_cast<float4 *>(smem + STG * STAGEB);   /* [k][h][kap]: shared by the lanes */
    float *red = reinterpret_cast<float *>(smem + STG * STAGEB + K * 2 * CP * 16);
    const int t = threadIdx.x, rho = t / CP, kap = t - rho * CP;
    const int nb = gridDim.x, b = blockIdx.x;
    const int r0 = (int)((int64_t)m * b / nb), r1 = (int)((int64_t)m * (b + 1) / nb);
    const int ng = (r1 - r0 + P - 1) / P;
    const unsigned sbase = (unsigned)__cvta_generic_to_shared(smem) + (unsigned)t * 16u;
    auto row_of = [&](int q) { return r0 + P * (rev ? ng - 1 - q : q) + rho; };
    auto issue = [&](int q, int s) {
        const int row = row_of(q);
        const bool ok = row < r1;
        const __nv_bfloat16 *src = g + (int64_t)(ok ? row : r0) * N + kap * 8;
#pragma unroll
        for (int k = 0; k < K; k++) cp16(sbase + (unsigned)(s * STAGEB + k * T * 16), src + CP * 8 * k, ok ? 16 : 0);
    };
#pragma unroll
    for (int s = 0; s < STG - 1; s++) {
        if (s < ng) issue(s, s);
        cp_commit();
    }
    c2_planes<T>(c2, c2s);
    const float sqn = sqrtf((float)N);
    float acc[K][8] = {};
#pragma unroll 1
    for (int q = 0; q < ng; q++) {
        const int s = q % STG;
        if (q + STG - 1 < ng) issue(q + STG - 1, (q + STG - 1) % STG);
        cp_commit();
        cp_wait<STG - 1>();
        const int row = row_of(q);
        const bool rv = row < r1;
        const float rcur = ABL == 5 ? 1.f : rv ? __ldcg(rold + row) : 1.f;
        const char *st = smem + s * STAGEB + t * 16;
        uint4 w[K];
#pragma unroll
        for (int k = 0; k < K; k++) w[k] = *reinterpret_cast<const uint4 *>(st + k * T * 16);
        float z[KEEP ? K : 1][8];
        float ps = warp_row_sum<KEEP, ABL>(w, c2s, kap, z);
        if (ABL != 1 && ABL != 4 && ABL != 5) ps = lane_sum<T>(ps, red + (q & 1) * (T / 32));
        const float rn = ABL == 5 ? ps : ps == 0.f ? rcur : sqn * rsqrtf(ps);
        if (rv && kap == 0) rnew[row] = rn;
        const float co = rv ? rn * rn : 0.f;
#pragma unroll
        for (int k = 0; k < K; k++) {
            if (ABL == 2 || ABL == 4 || ABL == 5) {
                acc[k][0] += co * z[KEEP ? k : 0][0];
            } else if (KEEP) {
#pragma unroll
                for (int e = 0; e < 8; e++) acc[k][e] = fmaf(co, z[KEEP ? k : 0][e], acc[k][e]);
            } else {   /* the chunk read from the ring again */
                const uint4 wk = *reinterpret_cast<const uint4 *>(st + k * T * 16);
                float x[8];
                unpack8(wk, x);
#pragma unroll
                for (int e = 0; e < 8; e++) acc[k][e] = fmaf(co * x[e], x[e], acc[k][e]);
            }
        }
    }
    cp_wait<0>();
    band_partials<T>(acc, smem, part);
}

/* plain 16-byte loads into registers, NP groups ahead (no ring); the column work re-unpacks the group's words */
template <int T, int NP>
__global__ void __launch_bounds__(T, 1)
lane_reg(const __nv_bfloat16 *__restrict__ g, int m, const float *__restrict__ c2, const float *__restrict__ rold,
         float *__restrict__ rnew, float *__restrict__ part, int rev)
{
    constexpr int P = T / CP;
    extern __shared__ __align__(16) char smem[];
    float4 *c2s = reinterpret_cast<float4 *>(smem + 3 * T * K * 16);
    float *red = reinterpret_cast<float *>(smem + 3 * T * K * 16 + K * 2 * CP * 16);
    const int t = threadIdx.x, rho = t / CP, kap = t - rho * CP;
    const int nb = gridDim.x, b = blockIdx.x;
    const int r0 = (int)((int64_t)m * b / nb), r1 = (int)((int64_t)m * (b + 1) / nb);
    const int ng = (r1 - r0 + P - 1) / P;
    auto row_of = [&](int q) { return r0 + P * (rev ? ng - 1 - q : q) + rho; };
    auto load = [&](int q, uint4 (&w)[K], float &rr) {
        const int row = row_of(q);
        const bool ok = q < ng && row < r1;
        const uint4 *src = reinterpret_cast<const uint4 *>(g + (int64_t)(ok ? row : r0) * N + kap * 8);
#pragma unroll
        for (int k = 0; k < K; k++) w[k] = ok ? __ldcs(src + CP * k) : make_uint4(0, 0, 0, 0);
        rr = ok ? __ldcg(rold + row) : 1.f;
    };
    uint4 buf[NP][K];
    float rb[NP];
#pragma unroll
    for (int p = 0; p < NP; p++) load(p, buf[p], rb[p]);
    c2_planes<T>(c2, c2s);
    const float sqn = sqrtf((float)N);
    float acc[K][8] = {};
#pragma unroll 1
    for (int q0 = 0; q0 < ng; q0 += NP) {
#pragma unroll
        for (int p = 0; p < NP; p++) {
            const int q = q0 + p;
            if (q >= ng) break;
            uint4 w[K];
#pragma unroll
            for (int k = 0; k < K; k++) w[k] = buf[p][k];
            const float rcur = rb[p];
            load(q + NP, buf[p], rb[p]);
            const int row = row_of(q);
            const bool rv = row < r1;
            float z[1][8];
            float ps = warp_row_sum<false, 0>(w, c2s, kap, z);
            ps = lane_sum<T>(ps, red + (q & 1) * (T / 32));
            const float rn = ps == 0.f ? rcur : sqn * rsqrtf(ps);
            if (rv && kap == 0) rnew[row] = rn;
            add_columns(acc, rv ? rn * rn : 0.f, w);
        }
    }
    band_partials<T>(acc, smem, part);
}

/* the reference: a bare read of G in the sweep's bands, NF 16-byte loads in flight a thread (the walk reversed
** with rev); same signature as the sweeps, nothing but a never-true store written */
template <int T, int NF>
__global__ void __launch_bounds__(T, 1)
band_read(const __nv_bfloat16 *__restrict__ g, int m, const float *__restrict__ c2, const float *__restrict__ rold,
          float *__restrict__ rnew, float *__restrict__ part, int rev)
{
    const int64_t len = (int64_t)m * N / 8, nb = gridDim.x, b = blockIdx.x;
    const int64_t a0 = len * b / nb, cnt = len * (b + 1) / nb - a0;
    const uint4 *x = reinterpret_cast<const uint4 *>(g) + a0;
    unsigned acc = 0;
    for (int64_t base = 0; base < cnt; base += (int64_t)T * NF) {
        uint4 v[NF];
#pragma unroll
        for (int f = 0; f < NF; f++) {
            const int64_t i = base + (int64_t)f * T + threadIdx.x;
            v[f] = i < cnt ? __ldcg(x + (rev ? cnt - 1 - i : i)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int f = 0; f < NF; f++) acc ^= v[f].x ^ v[f].y ^ v[f].z ^ v[f].w;
    }
    if (acc == 0x9e3779b9u) part[0] = 1.f;
}

struct config {
    const char *name;
    void (*kernel)(const __nv_bfloat16 *, int, const float *, const float *, float *, float *, int);
    int threads, smem;
    bool checked;   /* a real sweep: its results must match */
};
template <int T, bool KEEP, int STG, int ABL = 0> config make(const char *name)
{
    return { name, lane_sweep<T, KEEP, STG, ABL>, T, smem_of<T, STG>(), ABL == 0 };
}

int main(int argc, char **argv)
{
    const int m = argc > 1 ? atoi(argv[1]) : 14336;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int nb = prop.multiProcessorCount;
    printf("lane_sweep on %s: %d x %d bf16, %d CTAs a sweep\n", prop.name, m, N, nb);
    const int64_t mn = (int64_t)m * N;
    const sweep_problem pb(m, N);
    __nv_bfloat16 *dg;
    float *dc2, *dr, *dr2, *dpart;
    CK(cudaMalloc(&dg, mn * 2));
    CK(cudaMalloc(&dc2, N * 4));
    CK(cudaMalloc(&dr, m * 4));
    CK(cudaMalloc(&dr2, m * 4));
    CK(cudaMalloc(&dpart, (int64_t)nb * N * 4));
    CK(cudaMemcpy(dg, pb.g.data(), mn * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dc2, pb.c2.data(), N * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dr, pb.r.data(), m * 4, cudaMemcpyHostToDevice));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const config configs[] = {
        { "bare read NF4", band_read<512, 4>, 512, 0, false },
        { "bare read NF4 x1024", band_read<1024, 4>, 1024, 0, false },
        make<512, true, 3, 5>("the ring alone"),
        make<512, true, 3, 4>("+ unpack, shuffles, r"),
        make<512, true, 3>("sweep (the engine's)"),
        make<512, true, 2>("sweep, 2 stages"),
        make<512, true, 4>("sweep, 4 stages"),
        make<512, true, 5>("sweep, 5 stages"),
        make<768, false, 4>("768 threads, 4 stages"),
        make<512, true, 3, 1>("no exchange"),
        make<512, true, 3, 2>("no column work"),
        make<512, true, 3, 3>("no row work"),
        make<512, false, 3>("G^2 read again"),
        make<768, false, 3>("768 threads"),
        make<768, false, 2>("768 threads, 2 stages"),
        make<1024, false, 3>("1024 threads"),
        { "plain loads, 2 ahead", lane_reg<512, 2>, 512, smem_of<512, 3>(), true },
    };
    int failures = 0;
    for (int round = 0; round < 2; round++)
        for (const config &cf : configs) {
            CK(cudaFuncSetAttribute(cf.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, cf.smem));
            cudaFuncAttributes fa;
            CK(cudaFuncGetAttributes(&fa, cf.kernel));
            CK(cudaMemset(dr2, 0xff, m * 4));
            cf.kernel<<<nb, cf.threads, cf.smem>>>(dg, m, dc2, dr, dr2, dpart, 0);
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            std::vector<float> gr(m), gp((int64_t)nb * N);
            CK(cudaMemcpy(gr.data(), dr2, m * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(gp.data(), dpart, (int64_t)nb * N * 4, cudaMemcpyDeviceToHost));
            double er, et;
            const bool ok = pb.check(gr, gp, nb, er, et) || !cf.checked;
            failures += !ok;
            const int iters = 50;
            float best = 1e30f;
            for (int trial = 0; trial < 5; trial++) {
                CK(cudaEventRecord(e0));
                for (int it = 0; it < iters; it++)
                    cf.kernel<<<nb, cf.threads, cf.smem>>>(dg, m, dc2, dr, dr2, dpart, it & 1);
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                best = fminf(best, ms * 1000 / iters);
            }
            CK(cudaGetLastError());
            printf("  %-24s regs %3d spill %4d smem %6d  %-11s sweep %6.1f us (%.0f GB/s)\n", cf.name, fa.numRegs,
                   (int)fa.localSizeBytes, cf.smem, !cf.checked ? "(timing)" : ok ? "matches" : "FAIL", best,
                   mn * 2 / best / 1e3);
        }
    return failures ? 1 : 0;
}

/* bench/sm_balance.cu -- experiment, stand-alone: is a streaming pass's spread across CTAs a property of the SM
** that runs it (GPU host)?
**
** The sixth session's per-CTA traces of the SinkGD sweeps found each CTA's time systematic across iterations
** (35.3 to 39.9 us on 14336 x 4096, a pass waiting for the slowest).  If that spread follows the SM -- for
** example the number of SMs sharing its GPC's path to L2 -- a partition weighted by the SM's class would balance
** the pass; if it follows the band of memory, it would not.
**
** 1. GPC membership: clusters of CL CTAs (one CTA an SM, forced by shared memory) are always placed inside one
**    GPC, so SMs seen in one cluster over many launches are joined (union-find); the classes are the GPCs.
** 2. A bare read of a buffer (16-byte loads, 4 in flight a thread, 512 threads, one CTA an SM), CTA b reading band
**    (b + rot) mod nb: each CTA records %smid and %globaltimer at start and end.  Rotating the bands separates the
**    SM's effect from the band's.
**
** Result on one H200 (bench/RESULTS.md, thirteenth session): over 117 MB the per-SM means are stable from launch
** to launch (correlation 0.997 between two halves of 80 launches) and lie between 26.5 and 31.8 us: 11 SMs are
** ~14% faster, the rest within 29-31.8 -- the slowest, which a pass waits for, are close together, so weighting
** the partition by SM would gain ~1 us.  The cluster probe finds the clusters' GPC pairs only in part (clusters of
** 4 and more reach 120 of the 132 SMs).  Traces of the engine's own passes (per CTA, %globaltimer into a device
** buffer, ~1.5% slower than the plain build) agree: a 117 MB sweep's last CTA ends 2.9 us after its median one.
**
**   build/bench/sm_balance [MB] [launches a rotation]
*/
#include <cuda_runtime.h>

#include "standalone.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

__device__ __forceinline__ unsigned smid()
{
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}
__device__ __forceinline__ uint64_t gtimer()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void where_kernel(int *sm_of_block, int spin_ns)
{
    extern __shared__ char pad[];
    if (threadIdx.x == 0) {
        sm_of_block[blockIdx.x] = (int)smid();
        const uint64_t t0 = gtimer();
        while (gtimer() - t0 < (uint64_t)spin_ns) pad[0] = 0;
    }
}

__global__ void __launch_bounds__(512, 1)
stream_kernel(const uint4 *__restrict__ buf, int64_t n16, int rot, uint4 *sink, uint64_t *trace)
{
    extern __shared__ char pad[];
    const int nb = gridDim.x, band = (blockIdx.x + rot) % nb;
    const int64_t b0 = n16 * band / nb, b1 = n16 * (band + 1) / nb;
    __syncthreads();
    const uint64_t t0 = gtimer();
    uint4 acc = make_uint4(0, 0, 0, 0);
    int64_t i = b0 + threadIdx.x;
    for (; i + 3 * 512 < b1; i += 4 * 512) {
        uint4 v[4];
#pragma unroll
        for (int k = 0; k < 4; k++) v[k] = __ldg(buf + i + k * 512);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            acc.x ^= v[k].x;
            acc.y ^= v[k].y;
            acc.z ^= v[k].z;
            acc.w ^= v[k].w;
        }
    }
    for (; i < b1; i += 512) {
        uint4 v = __ldg(buf + i);
        acc.x ^= v.x;
        acc.y ^= v.y;
        acc.z ^= v.z;
        acc.w ^= v.w;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        trace[3 * blockIdx.x] = smid();
        trace[3 * blockIdx.x + 1] = t0;
        trace[3 * blockIdx.x + 2] = gtimer();
    }
    if (acc.x == 0x12345678u && acc.y == 1u) sink[0] = acc; /* keeps the loads */
    (void)pad;
}

static int find(std::vector<int> &p, int x) { return p[x] == x ? x : p[x] = find(p, p[x]); }

int main(int argc, char **argv)
{
    const int64_t mb = argc > 1 ? atoll(argv[1]) : 117;
    const int reps = argc > 2 ? atoi(argv[2]) : 10;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int nsm = prop.multiProcessorCount;
    const int smem = (int)prop.sharedMemPerMultiprocessor - 8 * 1024; /* one CTA an SM */
    printf("device %s, %d SMs, L2 %d MB\n", prop.name, nsm, prop.l2CacheSize >> 20);

    /* 1. GPCs by clusters */
    std::vector<int> par(4096);
    std::iota(par.begin(), par.end(), 0);
    int maxsm = 0;
    CK(cudaFuncSetAttribute(where_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaFuncSetAttribute(where_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    int *d_sm;
    CK(cudaMalloc(&d_sm, 4096 * sizeof(int)));
    for (int cl : { 2, 4, 8, 16 }) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute at[1];
        cluster_attr(at[0], cl);
        cfg.blockDim = dim3(32);
        cfg.dynamicSmemBytes = smem;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        cfg.gridDim = dim3(cl);
        int nclusters = 0;
        CK(cudaOccupancyMaxActiveClusters(&nclusters, where_kernel, &cfg));
        printf("clusters of %2d: at most %d at once (%d SMs)\n", cl, nclusters, nclusters * cl);
        if (nclusters == 0) continue;
        cfg.gridDim = dim3(nclusters * cl);
        std::vector<int> h(nclusters * cl);
        for (int it = 0; it < 200; it++) {
            CK(cudaLaunchKernelEx(&cfg, where_kernel, d_sm, 20000));
            CK(cudaMemcpy(h.data(), d_sm, h.size() * sizeof(int), cudaMemcpyDeviceToHost));
            for (int c = 0; c < nclusters; c++)
                for (int k = 1; k < cl; k++) par[find(par, h[c * cl + k])] = find(par, h[c * cl]);
            for (int s : h) maxsm = std::max(maxsm, s + 1);
        }
    }
    std::vector<int> gpc(nsm, -1), gsize;
    {
        std::vector<int> root_id(4096, -1);
        for (int s = 0; s < nsm; s++) {
            const int r = find(par, s);
            if (root_id[r] < 0) {
                root_id[r] = (int)gsize.size();
                gsize.push_back(0);
            }
            gpc[s] = root_id[r];
            gsize[gpc[s]]++;
        }
    }
    printf("GPC classes (SMs seen together in a cluster): %zu\n", gsize.size());
    for (size_t g = 0; g < gsize.size(); g++) {
        printf("  class %zu (%d SMs):", g, gsize[g]);
        for (int s = 0; s < nsm; s++)
            if (gpc[s] == (int)g) printf(" %d", s);
        printf("\n");
    }

    /* 2. per-CTA times of a bare read */
    const int64_t bytes = mb << 20, n16 = bytes / 16;
    uint4 *buf, *sink;
    uint64_t *d_tr;
    CK(cudaMalloc(&buf, bytes));
    CK(cudaMemset(buf, 0x5a, bytes));
    CK(cudaMalloc(&sink, 16));
    CK(cudaMalloc(&d_tr, 3 * nsm * sizeof(uint64_t)));
    CK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    std::vector<uint64_t> tr(3 * nsm);
    std::vector<double> sm_sum(nsm, 0), band_sum(nsm, 0), sm_sum_half[2] = { std::vector<double>(nsm, 0), std::vector<double>(nsm, 0) };
    std::vector<int> sm_cnt(nsm, 0), sm_cnt_half[2] = { std::vector<int>(nsm, 0), std::vector<int>(nsm, 0) };
    double span_sum = 0, mean_sum = 0;
    int nl = 0;
    const int rots[4] = { 0, nsm / 4, nsm / 2, 3 * nsm / 4 };
    for (int pass = 0; pass < 2; pass++)
        for (int rot : rots)
            for (int it = 0; it < reps + 1; it++) {
                stream_kernel<<<nsm, 512, smem>>>(buf, n16, rot, sink, d_tr);
                CK(cudaGetLastError());
                CK(cudaMemcpy(tr.data(), d_tr, tr.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
                if (it == 0) continue;
                uint64_t lo = ~0ull, hi = 0;
                double m = 0;
                for (int b = 0; b < nsm; b++) {
                    const int s = (int)tr[3 * b];
                    const double d = (double)(tr[3 * b + 2] - tr[3 * b + 1]) * 1e-3;
                    lo = std::min(lo, tr[3 * b + 1]);
                    hi = std::max(hi, tr[3 * b + 2]);
                    sm_sum[s] += d;
                    sm_cnt[s]++;
                    sm_sum_half[pass][s] += d;
                    sm_cnt_half[pass][s]++;
                    band_sum[(b + rot) % nsm] += d;
                    m += d / nsm;
                }
                span_sum += (double)(hi - lo) * 1e-3;
                mean_sum += m;
                nl++;
            }
    std::vector<double> sm_mean(nsm), band_mean(nsm);
    for (int s = 0; s < nsm; s++) sm_mean[s] = sm_cnt[s] ? sm_sum[s] / sm_cnt[s] : 0;
    for (int b = 0; b < nsm; b++) band_mean[b] = band_sum[b] / nl;
    auto spread = [](std::vector<double> v, const char *what) {
        std::sort(v.begin(), v.end());
        printf("%s: min %.2f  p10 %.2f  median %.2f  p90 %.2f  max %.2f us\n", what, v.front(), v[v.size() / 10],
               v[v.size() / 2], v[v.size() * 9 / 10], v.back());
    };
    printf("bare read of %lld MB, %d launches: span %.2f us (%.2f TB/s), mean CTA %.2f us\n", (long long)mb, nl,
           span_sum / nl, bytes / (span_sum / nl * 1e-6) / 1e12, mean_sum / nl);
    spread(sm_mean, "per-SM mean time ");
    spread(band_mean, "per-band mean time");
    /* stability: the two halves' per-SM means, correlated */
    {
        std::vector<double> a(nsm), b(nsm);
        double ma = 0, mb2 = 0;
        for (int s = 0; s < nsm; s++) {
            a[s] = sm_sum_half[0][s] / std::max(1, sm_cnt_half[0][s]);
            b[s] = sm_sum_half[1][s] / std::max(1, sm_cnt_half[1][s]);
            ma += a[s] / nsm;
            mb2 += b[s] / nsm;
        }
        double sab = 0, saa = 0, sbb = 0;
        for (int s = 0; s < nsm; s++) {
            sab += (a[s] - ma) * (b[s] - mb2);
            saa += (a[s] - ma) * (a[s] - ma);
            sbb += (b[s] - mb2) * (b[s] - mb2);
        }
        printf("per-SM means, first half against second: correlation %.3f\n", sab / sqrt(saa * sbb));
    }
    for (size_t g = 0; g < gsize.size(); g++) {
        double t = 0;
        for (int s = 0; s < nsm; s++)
            if (gpc[s] == (int)g) t += sm_mean[s] / gsize[g];
        printf("  class %zu (%2d SMs): mean %.2f us\n", g, gsize[g], t);
    }
    printf("per SM (smid: us):");
    for (int s = 0; s < nsm; s++) printf("%s%d:%.1f", s % 12 ? " " : "\n  ", s, sm_mean[s]);
    printf("\n");
    return 0;
}

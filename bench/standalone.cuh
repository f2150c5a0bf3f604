/* bench/standalone.cuh -- what the stand-alone CUDA experiments in bench/ share (rowwarp_sweep.cu, lane_sweep.cu,
** cluster_sinkhorn.cu, sm_balance.cu): a checked runtime call, a cluster launch attribute, the bf16 unpacking of
** kernels/sinkgd.cu's sweeps, and the sweep experiments' inputs with their f64 reference. */
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

/* the launch attribute of clusters of cs CTAs along x */
inline void cluster_attr(cudaLaunchAttribute &a, int cs)
{
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = cs;
    a.val.clusterDim.y = 1;
    a.val.clusterDim.z = 1;
}

/* the 8 bf16 of a 16-byte word as floats (a bf16 is the high half of its float) */
__device__ __forceinline__ void unpack8(const uint4 &w, float *x)
{
    const uint32_t v[4] = { w.x, w.y, w.z, w.w };
#pragma unroll
    for (int h = 0; h < 4; h++) {
        x[2 * h] = __uint_as_float(v[h] << 16);
        x[2 * h + 1] = __uint_as_float(v[h] & 0xffff0000u);
    }
}

/* --- the sweep experiments' problem (rowwarp_sweep.cu, lane_sweep.cu): G, c^2 and r on the host, and one SR-Sinkhorn
** sweep of it in f64 --------------------------------------------------------------------------------------------- */
#include <cmath>
#include <cstring>
#include <vector>

/* uniform in [0, 1) (xorshift64, a fixed start: every run the same inputs) */
inline double host_urand()
{
    static uint64_t state = 0x9e3779b97f4a7c15ull;
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (double)(state >> 11) / 9007199254740992.0;
}

inline float bf16_to_float(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

struct sweep_problem {
    int m, n;
    std::vector<uint16_t> g;     /* bf16 bits, row-major */
    std::vector<float> c2, r;    /* the sweep's c^2 and the r it starts from */
    std::vector<double> rr, tt;  /* f64: the new r and the column sums of r^2 G^2 */

    sweep_problem(int m_, int n_) : m(m_), n(n_), g((int64_t)m_ * n_), c2(n_), r(m_), rr(m_), tt(n_, 0.0)
    {
        for (int64_t i = 0; i < (int64_t)m * n; i++) {
            const float f = (float)((host_urand() * 2 - 1) * (0.5 + 2 * host_urand()));
            uint32_t u;
            memcpy(&u, &f, 4);
            g[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);   /* rounded to nearest even */
        }
        for (int j = 0; j < n; j++) c2[j] = (float)(0.25 + host_urand());
        for (int i = 0; i < m; i++) r[i] = (float)(0.5 + host_urand());
        for (int i = 0; i < m; i++) {
            double s = 0;
            for (int j = 0; j < n; j++) {
                const double x = bf16_to_float(g[(int64_t)i * n + j]);
                s += x * x * c2[j];
            }
            rr[i] = s == 0 ? r[i] : sqrt((double)n) / sqrt(s);
            for (int j = 0; j < n; j++) {
                const double x = bf16_to_float(g[(int64_t)i * n + j]);
                tt[j] += rr[i] * rr[i] * x * x;
            }
        }
    }

    /* the largest relative errors of a GPU sweep's r and of its nb bands' partials summed; NaN fails both */
    bool check(const std::vector<float> &gr, const std::vector<float> &gp, int nb, double &er, double &et) const
    {
        er = et = 0;
        for (int i = 0; i < m; i++) {
            const double d = fabs(gr[i] - rr[i]) / rr[i];
            er = d > er || d != d ? d : er;
        }
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int b = 0; b < nb; b++) s += gp[(int64_t)b * n + j];
            const double d = fabs(s - tt[j]) / tt[j];
            et = d > et || d != d ? d : et;
        }
        return er < 2e-5 && et < 2e-5;
    }
};

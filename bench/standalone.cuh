/* bench/standalone.cuh -- what the stand-alone CUDA experiments in bench/ share (rowwarp_sweep.cu,
** cluster_sinkhorn.cu, sm_balance.cu): a checked runtime call, a cluster launch attribute and the bf16 unpacking
** of kernels/sinkgd.cu's sweeps. */
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

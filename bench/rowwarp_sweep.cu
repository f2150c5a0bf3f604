/* bench/rowwarp_sweep.cu -- experiment, stand-alone: a SR-Sinkhorn sweep with one warp per row (GPU host).
**
** kernels/sinkgd.cu's sweep splits a row of n = 4096 bf16 over a lane of 4 warps (128 threads, 32 elements a
** thread a group) and meets the lane's warps at a named barrier for every group's row sums.  Here a warp owns
** whole rows: lane l holds chunks l + 32 k (k < NCH, 8 bf16 each), so a row's sum is 5 shuffles, the column
** accumulators (8 NCH a lane) stay in registers for the whole band, and each warp streams its rows through its
** own cp.async ring -- no barrier inside the loop.  The cost is registers: 8 NCH accumulators and 4 NCH packed
** words a lane, so n = 4096 runs 8 warps a CTA (255 registers a thread).
**
** One sweep (c^2 given): S_i = sum_j G_ij^2 c_j^2, r_i = sqrt(n) / sqrt(S_i) (r_i kept when S_i = 0), the band's
** column partials sum_i r_i^2 G_ij^2; the fold sums the bands in order and sets c_j^2 = m / T_j.  Checked against
** an f64 evaluation of one sweep on the CPU; then timed: back-to-back iterations (sweep + fold) on one G, as
** the iterations inside a step run.  Compare with `build/moonstep bench/sinkgd_iters.lua` in the same command.
** Result (bench/RESULTS.md, tenth session): 34 against the engine's 40 us an iteration of 14336 x 4096 here, but
** built into kernels/sinkgd.cu (row_segment, commit 3823dd5 on branch rw-sweep) within +-3% of the engine's sweep
** and 4% slower on 8 x 1408 x 2048; not merged.  The stand-alone fold does less than the engine's.
**
**   build/bench/rowwarp_sweep [MxN,MxN,...]     (n a multiple of 256, at most 4096)
*/
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "standalone.cuh"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

__device__ __forceinline__ void cp16(unsigned dst, const void *src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

/* float4 index j of a lane-major plane <-> columns: j = (2 k + h) 32 + l holds columns (l + 32 k) 8 + 4 h .. + 3 */
__host__ __device__ __forceinline__ int plane_col(int j) { return ((j & 31) + 32 * (j >> 6)) * 8 + 4 * ((j >> 5) & 1); }

template <int NCH, int W, int STG>
__global__ void __launch_bounds__(W * 32, 1)
rw_sweep(const __nv_bfloat16 *__restrict__ g, int m, int n, const float *__restrict__ c2, const float *__restrict__ rold,
         float *__restrict__ rnew, float *__restrict__ part, float eps, int rev)
{
    extern __shared__ __align__(16) char smem[];
    constexpr int ROWB = NCH * 32 * 16;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nb = gridDim.x, b = blockIdx.x;
    const int r0 = (int)((int64_t)m * b / nb), r1 = (int)((int64_t)m * (b + 1) / nb);
    float4 *c2s = reinterpret_cast<float4 *>(smem + W * STG * ROWB);
    const int nrows = r1 - r0 > warp ? (r1 - r0 - warp + W - 1) / W : 0;
    const unsigned rbase = (unsigned)__cvta_generic_to_shared(smem + warp * STG * ROWB) + lane * 16u;
    /* rev: the walk runs backwards, so a sweep starts on the rows the previous one ended on (found in L2) */
    auto row_of = [&](int i) { return r0 + warp + W * (rev ? nrows - 1 - i : i); };
    auto issue = [&](int i, int s) {
        const __nv_bfloat16 *src = g + (int64_t)row_of(i) * n + lane * 8;
#pragma unroll
        for (int k = 0; k < NCH; k++) cp16(rbase + (unsigned)(s * ROWB + k * 512), src + 256 * k);
    };
#pragma unroll
    for (int s = 0; s < STG - 1; s++) {
        if (s < nrows) issue(s, s);
        cp_commit();
    }
    /* G is never written: its first rows were copied before the previous grid is waited for (programmatic
    ** dependent launch; a no-op without the attribute) */
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    for (int j = threadIdx.x; j < NCH * 64; j += W * 32) c2s[j] = *reinterpret_cast<const float4 *>(c2 + plane_col(j));
    __syncthreads();

    const float sqn = sqrtf((float)n);
    float acc[NCH][8];
#pragma unroll
    for (int k = 0; k < NCH; k++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[k][e] = 0.f;
    float rcur = nrows > 0 ? __ldcg(rold + row_of(0)) : 0.f;
#pragma unroll 1
    for (int i = 0; i < nrows; i++) {
        if (i + STG - 1 < nrows) issue(i + STG - 1, (i + STG - 1) % STG);
        cp_commit();
        cp_wait<STG - 1>();   /* this lane's own copies of row i have landed */
        const float rnext = i + 1 < nrows ? __ldcg(rold + row_of(i + 1)) : 0.f;
        const char *st = smem + warp * STG * ROWB + (i % STG) * ROWB + lane * 16;
        uint4 w[NCH];
#pragma unroll
        for (int k = 0; k < NCH; k++) w[k] = *reinterpret_cast<const uint4 *>(st + k * 512);
        float pk[4] = { 0.f, 0.f, 0.f, 0.f };
#pragma unroll
        for (int k = 0; k < NCH; k++) {
            float x[8];
            unpack8(w[k], x);
            const float4 ca = c2s[(2 * k) * 32 + lane], cb = c2s[(2 * k + 1) * 32 + lane];
            const float cv[8] = { ca.x, ca.y, ca.z, ca.w, cb.x, cb.y, cb.z, cb.w };
#pragma unroll
            for (int e = 0; e < 8; e++) pk[k & 3] = fmaf(x[e] * x[e], cv[e], pk[k & 3]);
        }
        float ps = (pk[0] + pk[1]) + (pk[2] + pk[3]);
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
        const int row = row_of(i);
        const float q2 = rcur * rcur * ps;
        const float rn = ps == 0.f ? rcur : q2 >= eps * eps ? sqn * rsqrtf(ps) : sqn * rcur / fmaxf(rcur * sqrtf(ps), eps);
        if (lane == 0) rnew[row] = rn;
        const float co = rn * rn;
#pragma unroll
        for (int k = 0; k < NCH; k++) {
            float x[8];
            unpack8(w[k], x);
#pragma unroll
            for (int e = 0; e < 8; e++) acc[k][e] = fmaf(co * x[e], x[e], acc[k][e]);
        }
        rcur = rnext;
    }
    cp_wait<0>();
    __syncthreads();
    /* the warps' accumulators as planes [warp][j] (a warp stores 32 consecutive float4: no bank conflict), summed
    ** in warp order */
    float4 *cb = reinterpret_cast<float4 *>(smem);
#pragma unroll
    for (int k = 0; k < NCH; k++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            cb[warp * NCH * 64 + (2 * k + h) * 32 + lane] =
                make_float4(acc[k][4 * h], acc[k][4 * h + 1], acc[k][4 * h + 2], acc[k][4 * h + 3]);
    __syncthreads();
    for (int j = threadIdx.x; j < NCH * 64; j += W * 32) {
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int v = 0; v < W; v++) {
            const float4 a = cb[v * NCH * 64 + j];
            s.x += a.x;
            s.y += a.y;
            s.z += a.z;
            s.w += a.w;
        }
        *reinterpret_cast<float4 *>(part + (int64_t)b * n + plane_col(j)) = s;
    }
}

/* c_j^2 = m / T_j from the bands' partials, summed in band order: 32 columns a block, 8 warps split the bands */
__global__ void __launch_bounds__(256) rw_fold(const float *__restrict__ part, int nb, int n, int m, float *__restrict__ c2)
{
    __shared__ float red[8][33];
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, col = blockIdx.x * 32 + lane;
    float s = 0.f;
    for (int b = warp; b < nb; b += 8) s += __ldcg(part + (int64_t)b * n + col);
    red[warp][lane] = s;
    __syncthreads();
    if (warp == 0) {
        float t = 0.f;
        for (int v = 0; v < 8; v++) t += red[v][lane];
        c2[col] = t > 0.f ? (float)m / t : 1.f;
    }
}

struct config {
    const char *name;
    void (*kernel)(const __nv_bfloat16 *, int, int, const float *, const float *, float *, float *, float, int);
    int nch, warps, stages;
};

template <int NCH, int W, int STG> config make(const char *name) { return { name, rw_sweep<NCH, W, STG>, NCH, W, STG }; }

template <class... P, class... A> static void launch_pdl(void (*k)(P...), int grid, int block, int smem, A... args)
{
    cudaLaunchConfig_t lc = {};
    lc.gridDim = dim3(grid);
    lc.blockDim = dim3(block);
    lc.dynamicSmemBytes = smem;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    lc.attrs = at;
    lc.numAttrs = 1;
    CK(cudaLaunchKernelEx(&lc, k, args...));
}

int main(int argc, char **argv)
{
    const char *shapes = argc > 1 ? argv[1] : "14336x4096,4096x4096,11264x2048,2048x2048";
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int nb = prop.multiProcessorCount;
    printf("rowwarp_sweep on %s, %d CTAs a sweep\n", prop.name, nb);
    const config configs[] = {
        make<16, 8, 3>("n4096 w8 s3"), make<16, 8, 2>("n4096 w8 s2"),  make<16, 6, 4>("n4096 w6 s4"),
        make<8, 16, 3>("n2048 w16 s3"), make<8, 8, 4>("n2048 w8 s4"),  make<8, 12, 4>("n2048 w12 s4"),
    };
    char buf[256];
    snprintf(buf, sizeof buf, "%s", shapes);
    int failures = 0;
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        int m = 0, n = 0;
        if (sscanf(tok, "%dx%d", &m, &n) != 2 || n % 256 || n > 4096 || m < nb) {
            fprintf(stderr, "rowwarp_sweep: bad shape %s\n", tok);
            return 2;
        }
        const int64_t mn = (int64_t)m * n;
        const sweep_problem pb(m, n);
        __nv_bfloat16 *dg;
        float *dc2, *dc2b, *dr, *dr2, *dpart;
        CK(cudaMalloc(&dg, mn * 2));
        CK(cudaMalloc(&dc2, n * 4));
        CK(cudaMalloc(&dc2b, n * 4));
        CK(cudaMalloc(&dr, m * 4));
        CK(cudaMalloc(&dr2, m * 4));
        CK(cudaMalloc(&dpart, (int64_t)nb * n * 4));
        CK(cudaMemcpy(dg, pb.g.data(), mn * 2, cudaMemcpyHostToDevice));
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        for (const config &cf : configs) {
            if (cf.nch * 256 != n) continue;
            const int smem = cf.warps * cf.stages * cf.nch * 512 + cf.nch * 1024;
            CK(cudaFuncSetAttribute(cf.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
            cudaFuncAttributes fa;
            CK(cudaFuncGetAttributes(&fa, cf.kernel));
            CK(cudaMemcpy(dc2, pb.c2.data(), n * 4, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(dr, pb.r.data(), m * 4, cudaMemcpyHostToDevice));
            CK(cudaMemset(dr2, 0xff, m * 4));
            cf.kernel<<<nb, cf.warps * 32, smem>>>(dg, m, n, dc2, dr, dr2, dpart, 1e-8f, 0);
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            std::vector<float> gr(m), gp((int64_t)nb * n);
            CK(cudaMemcpy(gr.data(), dr2, m * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(gp.data(), dpart, (int64_t)nb * n * 4, cudaMemcpyDeviceToHost));
            double er, et;
            const bool ok = pb.check(gr, gp, nb, er, et);
            failures += !ok;
            /* timed: iterations of sweep + fold, ping-ponging r, and sweeps alone */
            const int iters = 50;
            float *ra = dr, *rb = dr2;
            for (int w = 0; w < 5; w++) {
                cf.kernel<<<nb, cf.warps * 32, smem>>>(dg, m, n, dc2b, ra, rb, dpart, 1e-8f, 0);
                rw_fold<<<n / 32, 256>>>(dpart, nb, n, m, dc2b);
            }
            CK(cudaMemcpy(dc2b, dc2, n * 4, cudaMemcpyDeviceToDevice));
            float best_it = 1e30f, best_sw = 1e30f, best_pdl = 1e30f;
            for (int trial = 0; trial < 5; trial++) {
                CK(cudaEventRecord(e0));
                for (int it = 0; it < iters; it++) {
                    cf.kernel<<<nb, cf.warps * 32, smem>>>(dg, m, n, dc2b, ra, rb, dpart, 1e-8f, 0);
                    rw_fold<<<n / 32, 256>>>(dpart, nb, n, m, dc2b);
                    float *t = ra;
                    ra = rb;
                    rb = t;
                }
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                best_it = fminf(best_it, ms * 1000 / iters);
                CK(cudaEventRecord(e0));
                for (int it = 0; it < iters; it++) cf.kernel<<<nb, cf.warps * 32, smem>>>(dg, m, n, dc2, dr, dr2, dpart, 1e-8f, 0);
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&ms, e0, e1));
                best_sw = fminf(best_sw, ms * 1000 / iters);
                /* as moonstep's passes run: programmatic dependent launches, the walk reversed every sweep */
                CK(cudaEventRecord(e0));
                for (int it = 0; it < iters; it++) {
                    launch_pdl(cf.kernel, nb, cf.warps * 32, smem, dg, m, n, (const float *)dc2b, (const float *)ra, rb,
                               dpart, 1e-8f, it & 1);
                    launch_pdl(rw_fold, n / 32, 256, 0, (const float *)dpart, nb, n, m, dc2b);
                    float *t = ra;
                    ra = rb;
                    rb = t;
                }
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&ms, e0, e1));
                best_pdl = fminf(best_pdl, ms * 1000 / iters);
            }
            CK(cudaGetLastError());
            printf("  %6dx%-5d %-14s regs %3d spill %3d smem %6d  r err %.1e  T err %.1e %s  sweep+fold %6.1f us, with PDL and the walk"
                   " reversed %6.1f us  sweep %6.1f us  (%.0f GB/s)\n",
                   m, n, cf.name, fa.numRegs, (int)fa.localSizeBytes, smem, er, et, ok ? "ok" : "FAILED", best_it, best_pdl, best_sw,
                   mn * 2 / (best_sw * 1e3));
        }
        CK(cudaFree(dg));
        CK(cudaFree(dc2));
        CK(cudaFree(dc2b));
        CK(cudaFree(dr));
        CK(cudaFree(dr2));
        CK(cudaFree(dpart));
    }
    printf("%s\n", failures ? "FAILED" : "all checks passed");
    return failures ? 1 : 0;
}

/*
** The SinkGD step on the GPU (ms_sinkgd_step; the semantics and the f64 reference: engine/cpu/sinkgd.c and
** moonstep.h).  SR-Sinkhorn (Scetbon et al., arXiv 2502.06742, Algorithm 3) returns X = diag(r) G diag(c), so
** only the two f32 scale vectors are iterated and no matrix is ever written but p (research/sinkgd.md §9):
**
**   sweep   one pass over G per SR-Sinkhorn iteration.  Each CTA owns a band of whole rows; for each group of
**           rows it computes the rows' sums of (G c)^2 (c of the previous iteration), the new r, and adds
**           (r G)^2 into per-thread column accumulators, all from one read of the rows (staged in shared memory
**           by cp.async, 2 groups ahead); at the end of its band it writes one row of column partials.
**   fold    sums each column's band partials in a fixed order and updates c (a CTA a block of 32 columns; a warp
**           a block when a chunk of many matrices has few bands each: fold_warp_kernel, the same bits).
**   power   (spectral, sphere) one pass per power step: v = diag(r) G (c u) per row, and the column partials of
**           G^T (r v) from the same rows; the fold makes w, sigma and the next u (the last CTA of a matrix, told
**           by an integer ticket, does the O(n) vector work); a degenerate u restarts the step, which that
**           last block redoes alone (power_redo: a rare step's slow path, not two launches in every step).
**   pairs   dense bf16/f16 rows of 16385-32768 elements, too long for one CTA's registers: the sweep on
**           clusters of two CTAs, each half of every row, the row sums exchanged between them (pair_kernel).
**   wide    longer dense rows (bf16/f16 n > 32768, f32 n > 16384) take two passes an iteration instead of
**           the sweep: the rows' sums, then the column partials (wide_kernel); the fold and the rest are the same.
**   sums    (sphere) ||W||^2, <W, X>, ||X||^2 in f64, one pass over G and p.
**   apply   p <- (p dec - coef X) fac, one pass over G and p, stochastic rounding as engine/cpu/optim.c.
**
** All matrices of a call go through each pass in one launch (a table of them in device memory; a class of one
** row width with 1 GiB of G or more gets launches of its own: for_chunks), and the passes
** of a step are programmatic dependent launches (pdl_enter): a pass's CTAs start as the previous pass's leave.  The
** sweeps and the apply run one CTA per SM; the row groups of all the call's matrices are split into equal,
** contiguous ranges, one per CTA, so a CTA's band of a matrix is as large as possible (few partial rows) and
** every CTA has the same work.  Consecutive passes walk each range in opposite directions, so a pass starts on
** the rows the previous one left in L2.  Sums are f32 (the sphere sums f64) in an order fixed by the shapes and
** the SM count alone, with no float atomics: a step is bitwise reproducible.
**
** Sharded (ms_sinkgd_step_sharded, msk_sinkgd_run_sharded).  Rows: the same passes on this rank's rows, each fold
** split in two around the exchange -- PART sums the bands into one buffer for all matrices of the chunk, the ranks
** add it, FINISH makes c (or w, sigma, u and the restart decision) from the sums, so every rank takes the same
** branch; the sphere sums are exchanged before the apply, and every rank captures t from their global s0.  Cols:
** a row's sums cross ranks, so each SR-Sinkhorn iteration is a pass of row partials (crow), their exchange, the
** row scales, and a pass over whole columns (ccol) for c; the power step likewise.  A rank without rows (columns)
** of a matrix keeps it in the table and adds zeros.
*/
#include "common.cuh"
#include "sr.cuh"

#include <algorithm>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <new>

#define T_SWEEP     512                                   /* threads of the sweep and elementwise kernels */
#define WARPS       (T_SWEEP / 32)
#define SLOTS       4                                     /* 16-byte chunks of G per thread per group */
#ifndef STAGES
#define STAGES      3                                     /* groups in the cp.async ring (4 leave no room for c) */
#endif
#define STAGE_DATA  (SLOTS * T_SWEEP * 16)                /* 32 KiB of G */
#define RSLOT       (SLOTS * T_SWEEP * 4)                 /* a group's row scales (at most one per slot row) */
/* The row scales have their own ring, one slot longer than the stages': a row's scale is copied by the row's
** first lane and read by all of its lanes after the row-sum barrier, so a slot may be refilled only after the
** next group's barrier has passed every reader. */
#define STAGE_BYTES STAGE_DATA
#define RRING       ((STAGES + 1) * RSLOT)
#define RED_FLOATS  (2 * 2 * SLOTS * WARPS)               /* row sums: 2 parities x 2 kinds */
/* a thread's columns' c (or c u) live in shared memory, in its own slots: its registers hold the group's G */
#define CVS_OFF     (STAGES * STAGE_BYTES + RRING + RED_FLOATS * 4 + WARPS * 8)
#define SWEEP_SMEM  (CVS_OFF + SLOTS * T_SWEEP * 32)
#define GROUP_BYTES 32768                                 /* rows per group of the generic path: ~this many */
#define FOLD_THREADS 256
#define FOLD_COLS   32                                    /* a lane's column; 8 warps split the bands */
#define PREP_THREADS 256
#define ESTAGES     3                                     /* stages of the elementwise ring (64 KiB each) */
#define ESTAGE_BYTES (8 * T_SWEEP * 16)                  /* 8 words of G and p a thread */
#define ELEM_SMEM   (ESTAGES * ESTAGE_BYTES)
#define ESPLIT      1                                     /* CTAs of an elementwise pass per sweep range */
#define SMALL_CAP   16                                    /* a second table size: small groups pass ~2 KB */
#define PARAM_LIMIT 32764                                 /* bytes of kernel parameters (CUDA 12.1+) */
#define U_DEGENERATE 1e-4                                 /* engine/cpu/sinkgd.c's restart threshold */

#define BSC 8   /* band scalars a band: the sphere sums (3 per CTA of ESPLIT); the power passes' 2 (band_vv) */
enum { FL_FIRST = 1, FL_UNIT = 2, FL_LAST = 4, FL_REDO = 8, FL_REV = 16 };
enum { K_SINK = 0, K_POWER = 1 };       /* sweeps */
enum { E_SUMS = 0, E_APPLY = 1 };       /* elementwise passes */
/* the per-matrix scalars (f64) */
enum { SC_F2 = 0, SC_UU, SC_SIGMA, SC_S0, SC_S1, SC_S2, SC_RESTARTED, SC_REDO, SC_N = 8 };
/* the scalars' second half -- cols-sharded: ||v|| of the power step, this rank's part of ||u||^2; unsharded: the
** last power fold's w was 0 (u kept), for the apply that stores u */
enum { SC_NV = SC_N, SC_UUL, SC_WZERO };

/* --- the launch table ------------------------------------------------------------------------------- */

struct skmat {
    const void *g;
    void       *p;
    float      *u, *t;
    char       *scr;          /* this matrix's scratch (scr_layout) */
    int64_t     m, n, rs, cs, e0, b;
    int64_t     g0;           /* its first row group in the launch (ascending) */
    double      scale;
    double      tau;          /* the muon target sqrt(m / n) of the global matrix */
    int32_t     f0;           /* its first fold block (ascending) */
    int32_t     member, band0, nbands;
    int16_t     Cp, P, GR;    /* the fast path's thread map (below); GR: rows per group */
    int8_t      K;
    uint8_t     wide;         /* rows too long for the fast path: WIDE_PASSES or WIDE_PAIR (below) */
    int8_t      gdt, pdt;
    uint8_t     fast, pvec;
    float       root;         /* sharded: sqrt of the global size of the sharded dim (rows: m, cols: n) */
};

/* how a matrix's rows too long for one CTA's registers are swept: wide_kernel's two passes an iteration, or
** pair_kernel's one (16-bit rows of up to 2 * 4 T_SWEEP chunks) */
enum { WIDE_NO = 0, WIDE_PASSES = 1, WIDE_PAIR = 2 };

/* cols-sharded: where the slice lies in the global matrix */
struct skcol {
    int64_t ng, off;          /* global n; the slice's first column */
};
template <int CAP> struct alignas(16) skcols { skcol c[CAP]; };

template <int CAP> struct alignas(16) skargs {
    msk_sinkgd o;
    int        flags, nmat, grid, nfold;
    int64_t    gtot;          /* row groups in all */
    unsigned  *tickets;
    void      *xch;           /* sharded: the exchange buffer of the chunk (NULL otherwise) */
    float     *rvb;           /* cols-sharded: r v of the power step, one value a row */
    const skcol *cols;        /* cols-sharded: per matrix */
    skmat      m[CAP];
};

static_assert(sizeof(skargs<MSK_SINKGD_CAP>) <= PARAM_LIMIT, "the SinkGD table exceeds the parameter space");

/* --- scratch of one matrix ----------------------------------------------------------------------------- */

struct skscr {
    float  *r, *c, *uv, *wv, *part;   /* r [m], c [n], u [n], w [n], part [nbands][n] */
    double *bsc, *fsc, *scal;         /* band scalars [BSC nbands], fold-block scalars [nfold], SC_* */
                                      /* (bsc: the sphere sums [nbands][BSC]; the power passes' band_vv, band_ff) */
};

__host__ __device__ __forceinline__ int64_t up4(int64_t x) { return (x + 3) / 4 * 4; }
__host__ __device__ __forceinline__ int64_t nfold_of(int64_t n) { return (n + FOLD_COLS - 1) / FOLD_COLS; }

/* Lays the scratch out from base (16-byte aligned) and returns its bytes (a multiple of 16). */
__host__ __device__ __forceinline__ int64_t scr_layout(char *base, int64_t m, int64_t n, int64_t nb, skscr *s)
{
    float *f = (float *)base;
    skscr k;
    k.r = f;    f += up4(m);
    k.c = f;    f += up4(n);
    k.uv = f;   f += up4(n);
    k.wv = f;   f += up4(n);
    k.part = f; f += up4(nb * n);
    double *d = (double *)f;
    k.bsc = d;  d += BSC * nb;
    k.fsc = d;  d += (nfold_of(n) + 1) / 2 * 2;
    k.scal = d; d += 2 * SC_N;
    /* then, not in skscr (whose size the fast path's register budget feels): r v [m] of the wide path's power rows
    ** (rv_of), and the last SINK fold's blocks' sums of u^2 [nfold] (fuu_of) */
    f = (float *)d + up4(m);
    f += 2 * ((nfold_of(n) + 1) / 2 * 2);
    if (s) *s = k;
    return (int64_t)((char *)f - base);
}
__host__ __device__ __forceinline__ float *rv_of(const skscr &s) { return (float *)(s.scal + 2 * SC_N); }
__host__ __device__ __forceinline__ double *fuu_of(const skscr &s, int64_t m) { return (double *)(rv_of(s) + up4(m)); }

/* --- small device helpers ------------------------------------------------------------------------------ */

/* max(x, eps) that keeps a NaN, as the CPU's clamp_min */
__device__ __forceinline__ float clampf(float x, float eps) { return x < eps ? eps : x; }
__device__ __forceinline__ double clampd(double x, double eps) { return x < eps ? eps : x; }

/* An SR-Sinkhorn scale, a row's (or a column's): sqrt(n) r / max(r sqrt(S), eps) from the sum S of its (G c)^2
** (of its (G r)^2: sqrt(m), c) and its previous scale r; a zero row keeps r.  A sum past f32 (|G c| beyond ~1.8e19 /
** sqrt(n); the CPU's f64 sums have no such limit) gives NaN, so that the matrix's update is NaN, as a NaN
** gradient's -- not a finite update that leaves that row out (its scale would be 0). */
__device__ __forceinline__ float sinkhorn_scale(float ps, float rold, float sqn, float eps)
{
    if (ps > FLT_MAX) return __int_as_float(0x7fffffff);
    return ps == 0 ? rold : sqn * rold / clampf(rold * sqrtf(ps), eps);
}

/* First row group of CTA b when gtot groups are split into `grid` equal contiguous ranges. */
__host__ __device__ __forceinline__ int64_t range_start(int64_t b, int64_t gtot, int64_t grid)
{
    return b * gtot / grid;
}

/* The last matrix whose first (row group, fold block) -- the member `first`, ascending -- is at most x. */
template <int CAP, class F>
__device__ __forceinline__ int mat_at(const skargs<CAP> &A, int64_t x, F first)
{
    return msk_last_at_most(0, A.nmat - 1, x, [&](int k) { return A.m[k].*first; });
}
template <int CAP>
__device__ __forceinline__ int mat_of_group(const skargs<CAP> &A, int64_t g) { return mat_at(A, g, &skmat::g0); }
template <int CAP>
__device__ __forceinline__ int mat_of_fold(const skargs<CAP> &A, int64_t blk) { return mat_at(A, blk, &skmat::f0); }

/* Matrix i's row groups within the launch's range [ga, gb), counted from its first group: [sa, sb); false when
** there are none (a sharded rank's matrix without rows here). */
template <int CAP>
__device__ __forceinline__ bool groups_in(const skargs<CAP> &A, int i, int64_t ga, int64_t gb, int64_t &sa,
                                          int64_t &sb)
{
    const int64_t g0 = A.m[i].g0, end = i + 1 < A.nmat ? A.m[i + 1].g0 : A.gtot;
    sa = (ga > g0 ? ga : g0) - g0;
    sb = (gb < end ? gb : end) - g0;
    return sb > sa;
}

/* Deterministic block sums: butterfly within warps, then every thread adds the warps' sums in warp order
** (so every thread holds the same bits).  red holds NT / 32 values of shared memory. */
template <class V> __device__ __forceinline__ V warp_sum(V v)
{
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int NT, class V> __device__ __forceinline__ V block_sum(V v, V *red)
{
    v = warp_sum(v);
    __syncthreads();   /* red may still be read from the previous call */
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    V s = 0;
#pragma unroll
    for (int w = 0; w < NT / 32; w++) s += red[w];
    return s;
}

/* A single CTA's walk over an n-vector in the order j = t, t + NT, ... per thread (so sums keep their order), with
** VB loads in flight a thread: load(j) for VB elements, then use(j, value) for each.  The vector work of the
** power step is one CTA's (prep, the fold's last block); one load at a time, its L2 latency was paid n / NT
** times: 33 us for n = 14336. */
template <int NT, int VB = 16, class L, class U>
__device__ __forceinline__ void vec_walk_from(int64_t first, int64_t n, const L &load, const U &use)
{
    for (int64_t j0 = first; j0 < n; j0 += (int64_t)VB * NT) {
        float v[VB];
#pragma unroll
        for (int u = 0; u < VB; u++) {
            const int64_t j = j0 + (int64_t)u * NT;
            v[u] = j < n ? load(j) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < VB; u++) {
            const int64_t j = j0 + (int64_t)u * NT;
            if (j < n) use(j, v[u]);
        }
    }
}
template <int NT, int VB = 16, class L, class U>
__device__ __forceinline__ void vec_walk(int64_t n, const L &load, const U &use)
{
    vec_walk_from<NT, VB>(threadIdx.x, n, load, use);
}

/* u's first value for element j of matrix b (engine/cpu/sinkgd.c, u_start): 2 U - 1, U the f32 uniform of
** ms_rand with key `seed` and offset 2^63 + b; exact in f32. */
__device__ __forceinline__ float u_start(uint64_t seed, int64_t b, int64_t j)
{
    uint32_t w[4];
    msk_philox((uint32_t)j, (uint32_t)((uint64_t)j >> 32), (uint32_t)b, 0x80000000u + (uint32_t)((uint64_t)b >> 32),
               (uint32_t)seed, (uint32_t)(seed >> 32), w);
    return (float)(w[0] >> 8) * 0x1p-23f - 1.0f;
}

/* --- cp.async (sm_80+): global -> shared without registers; `bytes` < size zero-fills the rest ----------- */

__device__ __forceinline__ void cp16(void *dst, const void *src, int bytes)
{
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp4(void *dst, const void *src, int bytes)
{
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

/* --- programmatic dependent launch (sm_90): run_chunk launches each pass with the attribute, so its CTAs are
** scheduled as the previous pass's leave their SMs instead of after a full launch round trip.  Every kernel of
** the sequence waits for the previous grid (its completion and memory) before it reads what that grid wrote -- a
** no-op when launched without the attribute -- and lets the next one launch at once.
** What was written two launches back or earlier may be read before the wait: a pass starts only once the pass
** before it has passed its own wait, i.e. once the one before that has completed (the table kernel, launched
** without the attribute, triggers nothing early: the first pass starts after it completes).  So the folds, the
** elementwise passes and the sweeps of small calls read the launch table, find their matrices and issue their
** first copies of G (and p) while the previous pass drains, and wait only before they read its results (c, u,
** sigma, partials). */
__device__ __forceinline__ void pdl_enter()
{
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

/* --- 16 bytes of a dtype as floats -------------------------------------------------------------------------- */

template <class T> struct elems16 { static constexpr int n = 16 / (int)sizeof(T); };

__device__ __forceinline__ void unpack(const uint4 &q, float *x, const __nv_bfloat16 *)
{
    const uint32_t w[4] = { q.x, q.y, q.z, q.w };
#pragma unroll
    for (int k = 0; k < 4; k++) {
        x[2 * k] = __uint_as_float(w[k] << 16);
        x[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}

__device__ __forceinline__ void unpack(const uint4 &q, float *x, const __half *)
{
    const uint32_t w[4] = { q.x, q.y, q.z, q.w };
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&w[k]));
        x[2 * k] = f.x;
        x[2 * k + 1] = f.y;
    }
}

__device__ __forceinline__ void unpack(const uint4 &q, float *x, const float *)
{
    x[0] = __uint_as_float(q.x);
    x[1] = __uint_as_float(q.y);
    x[2] = __uint_as_float(q.z);
    x[3] = __uint_as_float(q.w);
}

/* 8 consecutive elements at p (16-byte aligned) as floats */
template <class T> __device__ __forceinline__ void load8(const T *p, float *x)
{
    if constexpr (sizeof(T) == 4) {
        unpack(*reinterpret_cast<const uint4 *>(p), x, p);
        unpack(*reinterpret_cast<const uint4 *>(p + 4), x + 4, p);
    } else {
        unpack(*reinterpret_cast<const uint4 *>(p), x, p);
    }
}

/* A power pass's band scalars: the CTA's sums of v^2 and (iters = 0) ||G||^2 over its band's rows, in a fixed
** order, for the power fold.  Every block of the fold reads every band's v^2, so they lie side by side (then the
** bands' ||G||^2): 8 bytes apart instead of 64, a block's reads touch 8 times fewer L2 sectors of lines that the
** whole grid reads (a 128-block power fold 11.0 -> 8.4 us under ncu). */
__device__ __forceinline__ double *band_vv(const skscr &S) { return S.bsc; }
__device__ __forceinline__ double *band_ff(const skscr &S, int nb) { return S.bsc + nb; }

__device__ __forceinline__ void store_band_scalars(double vv, double ff, double *dred, const skscr &S, int band, int nb)
{
    vv = block_sum<T_SWEEP>(vv, dred);
    ff = block_sum<T_SWEEP>(ff, dred);
    if (threadIdx.x == 0) {
        band_vv(S)[band] = vv;
        band_ff(S, nb)[band] = ff;
    }
}

/* --- the sweep: one CTA's band of a matrix ---------------------------------------------------------------
** The fast path (G dense, 16-byte aligned, n a multiple of E = 16 / sizeof(T), at most 4 * T_SWEEP chunks of E
** per row, 8 * T_SWEEP for f32).  A row is C = n / E chunks.  The threads form P = T_SWEEP / Cp row lanes of Cp
** threads (Cp a power of two up to 32, else a multiple of 32); thread kap of a lane takes chunks kap + Cp k, k < K,
** of R = 4 / K rows: K = 4 (Cp >= C / 4) whenever C >= 4, so a row's sum across its lane and its scale update are
** paid once per 4 chunks; K = 2 (2 rows) instead when C <= 2 T_SWEEP and the call's G fits in L2 or it has at
** most SMALL_CAP matrices of 16-bit G (plan_chunk says why); K = 1 with R = 4 rows a lane for rows of fewer than 4 chunks;
** K = 8 (one row, one lane, in two stages) for f32 rows of more than 4 T_SWEEP chunks, whose 32 elements a thread
** cost the registers bf16's K = 4 does.
** A group is P R rows (about 32 KiB); lane rho takes rows rho + P r.  Each thread copies exactly the chunks it later reads (its 4 slots of a stage), so
** the ring needs no barrier; the only one per group is the row sums' exchange across warps.
** SINK:  S_i = sum_j (G_ij c_j)^2, r_i <- sqrt(n) r_i / max(r_i sqrt(S_i), eps) (S_i = 0: r_i kept); column
**        partials of (r_i G_ij)^2.  Each factor scales G before the square, as the CPU and the generic path do:
**        G^2 c^2 and r^2 G^2 overflowed f32 (r or c past 1.8e19, a row or column of G ~1e-19 of the rest, which
**        the eps clamp lets r and c reach) and made the whole matrix NaN.  That costs one multiply an element
**        (2-5% of a step); one square for both while r and c stay in [2^-60, 2^60], scaling only past it, was
**        no faster (bench/RESULTS.md, twenty-fourth session).
** POWER: v_i = r_i sum_j G_ij c_j u_j; column partials of r_i v_i G_ij; band scalars sum v_i^2 and (iters = 0:
**        r = c = 1) sum G_ij^2. */

template <int R>
__device__ __forceinline__ void row_sums(float (&ps)[R], float (&pf)[R], bool ff, int Cp, int P, int rho, bool on,
                                         float *red)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (Cp <= 32) {   /* the row's lanes are an aligned power-of-two part of a warp */
        for (int o = Cp >> 1; o >= 1; o >>= 1) {
#pragma unroll
            for (int r = 0; r < R; r++) {
                ps[r] += __shfl_xor_sync(0xffffffffu, ps[r], o);
                if (ff) pf[r] += __shfl_xor_sync(0xffffffffu, pf[r], o);
            }
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        ps[r] = warp_sum(ps[r]);
        if (ff) pf[r] = warp_sum(pf[r]);
        if (lane == 0) {
            red[r * WARPS + warp] = ps[r];
            if (ff) red[(SLOTS + r) * WARPS + warp] = pf[r];
        }
    }
    /* only the warps of one row lane meet here (a named barrier each), so the lanes run decoupled; threads past
    ** the last whole lane (when Cp does not divide T_SWEEP) form a lane of their own.  A 448-thread lane (n =
    ** 14336 bf16) pays ~5 us an iteration here; finishing groups a group late behind mbarriers spilled G^2 and
    ** was twice as slow (bench/RESULTS.md, seventh session) */
    {
        const int count = rho < P ? Cp : T_SWEEP - P * Cp;
        asm volatile("bar.sync %0, %1;\n" ::"r"(1 + rho), "r"(count) : "memory");
    }
    /* the lane's wpr <= 16 warp sums: lane l of each 16 takes warp l's, then a fixed butterfly over 16 lanes
    ** (zeros past wpr) -- every thread gets the same bits, in 1 load and 4 shuffles a row */
    const int wpr = Cp >> 5, w0 = rho * wpr, l16 = lane & 15;
    const bool take = on && l16 < wpr;
#pragma unroll
    for (int r = 0; r < R; r++) {
        float a = take ? red[r * WARPS + w0 + l16] : 0.f, b = 0.f;
        if (ff) b = take ? red[(SLOTS + r) * WARPS + w0 + l16] : 0.f;
#pragma unroll
        for (int o = 8; o >= 1; o >>= 1) {
            a += __shfl_xor_sync(0xffffffffu, a, o);
            if (ff) b += __shfl_xor_sync(0xffffffffu, b, o);
        }
        ps[r] = a;
        pf[r] = b;
    }
}

/* --- row pairs: a cluster of two CTAs splits each row (pair_kernel) ----------------------------------------
** 16-bit rows of 2049-4096 chunks (n 16385-32768: a Llama-3-70B down projection's 28672) hold too many
** columns for one CTA's registers.  A pair of CTAs takes the same rows, each half of their chunks with the
** K = 4 map, and after each group's row sums a CTA stores its (S, |G|^2) into the partner's shared memory with
** st.async, which completes the transaction of the partner's barrier for that group's parity: one pass an
** iteration, not the wide path's two. */
#define PAIR_OFF  SWEEP_SMEM                              /* the pair's words, after the sweep's shared memory */
#define PAIR_SMEM (SWEEP_SMEM + 64)

struct pairw {
    unsigned long long mbar[2];   /* the partner's sums of a group have come: one barrier a parity of the group */
    float2 sums[2];               /* ... and here they are */
    int xq;                       /* groups exchanged before this segment (the barriers' phases) */
    int zband;                    /* fast_segment's epilogue */
};
static_assert(sizeof(pairw) <= PAIR_SMEM - PAIR_OFF, "the pair's words");

__device__ __forceinline__ pairw *pair_words(char *smem) { return reinterpret_cast<pairw *>(smem + PAIR_OFF); }

__device__ __forceinline__ unsigned cluster_rank()
{
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_sync()
{
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

/* Exchange x of the segment's groups: this CTA's row sums to the partner (thread 0), the partner's added on the
** threads of the row (a + b = b + a: both CTAs get the same bits).  A slot is written again two exchanges later,
** which the partner starts only after this CTA's next post, itself after every thread of the row has passed the
** next group's row-sum barrier. */
__device__ __forceinline__ void pair_exchange(float &ps, float &pf, int side, bool on, char *smem, int x)
{
    pairw *w = pair_words(smem);
    const int slot = x & 1;
    const unsigned mb = (unsigned)__cvta_generic_to_shared(&w->mbar[slot]);
    const unsigned sb = (unsigned)__cvta_generic_to_shared(&w->sums[slot]);
    if (threadIdx.x == 0) {
        unsigned rmb, rsb;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(rsb) : "r"(sb), "r"(side ^ 1));
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(rmb) : "r"(mb), "r"(side ^ 1));
        /* this barrier's arrival for the exchange (the partner's 8 bytes may land before it: the transaction
        ** count goes negative), then the sums into the partner's slot, completing its barrier's transaction */
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 8;\n" ::"r"(mb) : "memory");
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n" ::"r"(rsb),
                     "f"(ps), "f"(pf), "r"(rmb)
                     : "memory");
    }
    if (!on) return;
    asm volatile("{\n\t.reg .pred done;\n"
                 "PAIR_WAIT%=:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
                 "@!done bra PAIR_WAIT%=;\n}\n" ::"r"(mb), "r"((x >> 1) & 1)
                 : "memory");
    float a, b;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(a), "=f"(b) : "r"(sb) : "memory");
    ps += a;
    pf += b;
}

template <class T, int K, int KIND, int CAP, bool PAIR = false, bool FF = false>
__device__ __noinline__ void fast_segment(const skargs<CAP> &A, const skmat &M, const skscr &S, int band, int64_t la,
                                          int64_t lb, bool rev, char *smem, bool wait)
{
    /* PAIR (pair_kernel): this CTA takes half of each row's chunks, its cluster partner the other half, and the
    ** two add their row sums through distributed shared memory (pair_exchange) */
    /* K = 8 (f32 rows of 2049-4096 chunks): a group is one row a lane in H = 2 stages of 4 chunks a thread, its
    ** row sum finished after the second; G of the first stays in registers, since its slot is refilled
    ** while the second is worked on */
    constexpr int E = elems16<T>::n, H = K > SLOTS ? K / SLOTS : 1, KS = K / H, R = K > SLOTS ? 1 : SLOTS / K;
    const int t = threadIdx.x;
    const int Cp = M.Cp, P = M.P, GR = M.GR;
    const int rho = t / Cp, kap = t - rho * Cp;
    const int64_t m = M.m, n = M.n;
    const int C = (int)(n / E);
    const int side = PAIR ? (int)cluster_rank() : 0;               /* PAIR: which half of the row */
    const int coff = side * ((C + 1) / 2), Cm = PAIR ? (side ? C / 2 : (C + 1) / 2) : C;   /* its chunks: coff, + Cm */
    const int xq = PAIR ? pair_words(smem)->xq : 0;
    const bool on = rho < P;
    const bool unit = (A.flags & FL_UNIT) != 0;
    const bool first = KIND == K_SINK && (A.flags & FL_FIRST);
    const bool need_rs = KIND == K_SINK ? !first : !unit;
    /* FF: the unit power sweep's |G|^2 (iters = 0), its own instance -- as a run-time flag its predicated FMAs and
    ** shuffles were issued on every power sweep */
    constexpr bool want_ff = KIND == K_POWER && FF;
    const float eps = (float)A.o.eps, sqn = sqrtf((float)n);
    float *red = (float *)(smem + STAGES * STAGE_BYTES + RRING);
    const T *const g = (const T *)M.g;
    float *const rvec = S.r;

    unsigned kmask = 0;   /* bit k: the thread's chunk k lies in the row */
#pragma unroll
    for (int k = 0; k < K; k++) kmask |= on && kap + Cp * k < Cm ? 1u << k : 0u;

    /* Groups are issued and consumed in walk order (ascending, or descending when rev); the addresses, rows and
    ** ring slots advance by constant steps, so an issue is a few additions and the copies themselves.  A copy
    ** whose chunk lies outside the matrix reads nothing (src-size 0) and zero-fills its slot. */
    /* 32-bit rows and group counts (the host sends matrices of 2^31 rows or more to the generic path): fewer
    ** registers, and this loop is bound by them */
    const int ng = (int)(lb - la), mi = (int)m, ni = (int)n;
    const int rstep = rev ? -GR : GR;                              /* rows between consecutive groups of the walk */
    const int row0 = (int)(rev ? lb - 1 : la) * GR + rho;          /* the thread's first row in the walk's first group */
    const int kofs = (coff + kap) * E;
    int irow = row0;                                               /* ... in the group issued next */
    /* ... and its first chunk there, a pointer stepped by a constant (rebuilt from irow each group, the addresses
    ** cost ~60 of the K = 4 loop's ~300 instructions).  A copy that reads nothing still gets an address inside G:
    ** its row's first chunk, or the matrix's first for a row past the end (or a thread without chunks). */
    const T *gp = g + (int64_t)row0 * ni + kofs;
    const int64_t gstep = (int64_t)rstep * ni, rowp = (int64_t)P * ni;
    const int cpe = Cp * E;
    const bool has = on && (kmask & 1u);
    int64_t koff[KS];   /* (H = 1) chunk k's offset from the first, 0 for a chunk past the row */
#pragma unroll
    for (int k = 0; k < KS; k++) koff[k] = (kmask >> k) & 1u ? (int64_t)k * cpe : 0;
    const unsigned sbase = (unsigned)__cvta_generic_to_shared(smem) + (unsigned)t * 16u;
    const unsigned rbase = (unsigned)__cvta_generic_to_shared(smem + STAGES * STAGE_BYTES) + (unsigned)rho * 4u;
    /* stage h of a group (its chunks h KS .. h KS + KS - 1); the row scales with the first */
    auto issue = [&](int istage, int irslot, int h) {
        const unsigned sd = sbase + (unsigned)(istage * STAGE_BYTES);
#pragma unroll
        for (int r = 0; r < R; r++) {
            const bool rv = has && irow + P * r < mi;
            const T *src = rv ? gp + rowp * r : g;
            if (H > 1) {   /* the half's chunks from one base: ptxas kept all 8 offsets live across the loop */
                src += rv && ((kmask >> (h * KS)) & 1u) ? h * KS * cpe : 0;
                asm volatile("" : "+l"(src));
            }
#pragma unroll
            for (int k = 0; k < KS; k++) {
                const int kk = h * KS + k;
                const bool ok = rv && ((kmask >> kk) & 1u);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sd + (unsigned)((r * KS + k) * T_SWEEP * 16)),
                             "l"(src + (H > 1 ? (ok ? k * cpe : 0) : koff[k])), "r"(ok ? 16 : 0)
                             : "memory");
            }
            if (need_rs && on && kap == 0 && h == 0)   /* one copy a row, by its first lane (not by the idle threads
                                                        ** past the last lane: their slot is lane 0's next row's) */
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(rbase + (unsigned)(irslot * RSLOT + r * P * 4)),
                             "l"(rvec + (rv ? irow + P * r : 0)), "r"(rv ? 4 : 0)
                             : "memory");
        }
        if (h == H - 1) {
            irow += rstep;
            gp += gstep;
        }
    };

    double vv = 0, ff = 0;
#pragma unroll 1
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < H * ng) issue(s, s / H, s % H);
        cp_commit();
    }
    if (wait) pdl_enter();   /* (the first groups and their r were written before the previous pass; c and u by it) */
    /* the thread's columns: c (SINK) or c u (POWER), and their accumulators (loaded while the first groups are
    ** on their way: at a pass's start the copies wait on nothing but the table) */
    float acc[K][E];
    /* 16-byte loads, all issued before the first use (one at a time, waiting for each, they cost a few us), by
    ** the read-only path: the P row lanes of a CTA read the same columns, and through L1 the lanes after the
    ** first do not queue in L2 with the other CTAs' reads of the same lines (1-2.5 us a 14336x4096 sweep under
    ** ncu).  c and u were written by the grids this pass waited for (pdl_enter), as the apply's c and r are. */
    const float4 one4 = make_float4(1.f, 1.f, 1.f, 1.f), zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
    float4 cl[K][E / 4], ul[K][E / 4];
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int ch = coff + kap + Cp * k;
        const bool ok = (kmask >> k) & 1u;
        const float4 *c4 = reinterpret_cast<const float4 *>(S.c + (ok ? (int64_t)ch * E : 0));
        const float4 *u4 = reinterpret_cast<const float4 *>(S.uv + (ok ? (int64_t)ch * E : 0));
#pragma unroll
        for (int f = 0; f < E / 4; f++) {
            const bool need_c = KIND == K_SINK ? !first : !unit;
            cl[k][f] = !ok ? zero4 : need_c ? __ldg(c4 + f) : one4;
            ul[k][f] = KIND == K_POWER && ok ? __ldg(u4 + f) : one4;
        }
    }
    float4 *cvs = reinterpret_cast<float4 *>(smem + CVS_OFF);
#pragma unroll
    for (int k = 0; k < K; k++) {
#pragma unroll
        for (int f = 0; f < E / 4; f++) {
            const float4 c = cl[k][f], u = ul[k][f];
            cvs[(k * (E / 4) + f) * T_SWEEP + t] = KIND == K_SINK ? c : make_float4(c.x * u.x, c.y * u.y, c.z * u.z, c.w * u.w);
        }
#pragma unroll
        for (int e = 0; e < E; e++) acc[k][e] = 0;
    }

    int crow = row0;   /* the thread's first row in the group consumed */
    int cstage = 0, crslot = 0;
    /* Between the row sums and the column accumulators the group's G stays in registers; c or c u comes from
    ** shared memory to make room for it.  (POWER re-read its chunks
    ** from shared memory until ptxas fit G without spills: -1% at most; bench/RESULTS.md, fifteenth session) */
#pragma unroll 1
    for (int q = 0; q < ng; q++) {
        float z[R][K][E];
        float rs[R], ps[R], pf[R];
        float pk[R][K], fk[R][K];   /* one chain per chunk: K independent FMA chains, added as a fixed tree */
        const char *st = smem;
        auto chunk = [&](int r, int k) { return *(const uint4 *)(st + ((r * KS + k) * T_SWEEP + t) * 16); };
#pragma unroll
        for (int h = 0; h < H; h++) {
            /* stage H q + h + STAGES - 1 (half a = (h + STAGES - 1) mod H of group q + d, d = (h + STAGES - 1) / H)
            ** goes to the slot consumed just before this one, its row scales d slots on */
            const int a = (h + STAGES - 1) % H, d = (h + STAGES - 1) / H;
            const int hs = h == 0 ? cstage : cstage + h >= STAGES ? cstage + h - STAGES : cstage + h;   /* its slot */
            if (H * q + h + STAGES - 1 < H * ng)
                issue(hs == 0 ? STAGES - 1 : hs - 1, crslot + d >= STAGES + 1 ? crslot + d - (STAGES + 1) : crslot + d, a);
            cp_commit();
            cp_wait<STAGES - 1>();   /* this thread's copies of the half have landed (zeros where out of range) */
            st = smem + hs * STAGE_BYTES;
#pragma unroll
            for (int r = 0; r < R; r++) {
#pragma unroll
                for (int k0 = 0; k0 < KS; k0++) {
                    const int k = h * KS + k0;
                    float x[E], cv[E];
#pragma unroll
                    for (int f = 0; f < E / 4; f++) {
                        const float4 c = cvs[(k * (E / 4) + f) * T_SWEEP + t];
                        cv[4 * f] = c.x;
                        cv[4 * f + 1] = c.y;
                        cv[4 * f + 2] = c.z;
                        cv[4 * f + 3] = c.w;
                    }
                    const uint4 w = chunk(r, k0);
                    unpack(w, x, (const T *)0);
                    pk[r][k] = 0;
                    fk[r][k] = 0;
#pragma unroll
                    for (int e = 0; e < E; e++) {
                        z[r][k][e] = x[e];
                        if constexpr (KIND == K_SINK) {   /* (G c)^2: scaled, then squared (the SINK comment) */
                            const float y = x[e] * cv[e];
                            pk[r][k] = fmaf(y, y, pk[r][k]);
                        } else {
                            pk[r][k] = fmaf(x[e], cv[e], pk[r][k]);
                            if (want_ff) fk[r][k] = fmaf(x[e], x[e], fk[r][k]);
                        }
                    }
                }
                if (h == H - 1) {   /* the row's chains, added as a fixed tree */
                    if constexpr (K == 8) {
                        ps[r] = ((pk[r][0] + pk[r][1 % K]) + (pk[r][2 % K] + pk[r][3 % K])) +
                                ((pk[r][4 % K] + pk[r][5 % K]) + (pk[r][6 % K] + pk[r][7 % K]));
                        pf[r] = ((fk[r][0] + fk[r][1 % K]) + (fk[r][2 % K] + fk[r][3 % K])) +
                                ((fk[r][4 % K] + fk[r][5 % K]) + (fk[r][6 % K] + fk[r][7 % K]));
                    } else if constexpr (K == 4) {
                        ps[r] = (pk[r][0] + pk[r][1 % K]) + (pk[r][2 % K] + pk[r][3 % K]);
                        pf[r] = (fk[r][0] + fk[r][1 % K]) + (fk[r][2 % K] + fk[r][3 % K]);
                    } else if constexpr (K == 2) {
                        ps[r] = pk[r][0] + pk[r][1 % K];
                        pf[r] = fk[r][0] + fk[r][1 % K];
                    } else {
                        ps[r] = pk[r][0];
                        pf[r] = fk[r][0];
                    }
                }
            }
        }
        row_sums<R>(ps, pf, want_ff, Cp, P, rho, on, red + (int)(q & 1) * 2 * SLOTS * WARPS);
        if constexpr (PAIR) pair_exchange(ps[0], pf[0], side, on, smem, xq + q);
        if (Cp <= 32) __syncwarp();   /* the row's first lane's scale copy is visible to its other lanes */
        const char *rsl = smem + STAGES * STAGE_BYTES + crslot * RSLOT;
#pragma unroll
        for (int r = 0; r < R; r++) rs[r] = need_rs ? *(const float *)(rsl + (r * P + rho) * 4) : 1.f;
        float co[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int row = crow + P * r;
            const bool rv = on && row < mi;
            if (KIND == K_SINK) {
                /* sqrt(n) r / max(r sqrt(S), eps) = sqrt(n) / sqrt(S) when r^2 S >= eps^2: one rsqrt; sinkhorn_scale
                ** where eps clamps, for NaN (which fails the comparison) and for a sum past f32 */
                const float q2 = rs[r] * rs[r] * ps[r];
                const float rn = ps[r] != 0 && q2 >= eps * eps && ps[r] <= FLT_MAX ? sqn * rsqrtf(ps[r])
                                                                                   : sinkhorn_scale(ps[r], rs[r], sqn, eps);
                if (rv && kap == 0 && side == 0) rvec[row] = rn;
                co[r] = rv ? rn : 0.f;
            } else {
                const float v = rs[r] * ps[r];
                co[r] = rv ? rs[r] * v : 0.f;
                if (rv && kap == 0 && side == 0) {
                    vv += (double)v * v;
                    if (want_ff) ff += (double)pf[r];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int k = 0; k < K; k++)
#pragma unroll
                for (int e = 0; e < E; e++) {
                    if constexpr (KIND == K_SINK) {   /* (r G)^2 */
                        const float y = co[r] * z[r][k][e];
                        acc[k][e] = fmaf(y, y, acc[k][e]);
                    } else {                          /* (r v) G */
                        acc[k][e] = fmaf(co[r], z[r][k][e], acc[k][e]);
                    }
                }
        crow += rstep;
        cstage = H == 1 ? (cstage + 1 == STAGES ? 0 : cstage + 1) : cstage + H >= STAGES ? cstage + H - STAGES : cstage + H;
        crslot = crslot + 1 == STAGES + 1 ? 0 : crslot + 1;
    }
    cp_wait<0>();

    /* the band's row of column partials: chunk ch is thread kap = ch mod Cp's k = ch / Cp in every row lane; the
    ** row lanes' sums are added in lane order through the (drained) stage buffers */
    float *prow = S.part + (int64_t)band * n;
    /* PAIR: the pair's rows span its two CTAs' ranges, so its partials go to the first band of the matrix among
    ** them, and the other one's (zb >= 0) are zeros */
    const int zb = PAIR ? pair_words(smem)->zband : -1;
    float *zrow = S.part + (int64_t)zb * n;
    if (PAIR || P == 1) {   /* (threads past the one lane, when Cp does not divide T_SWEEP, hold no columns) */
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int ch = coff + kap + Cp * k;
            if (on && kap + Cp * k < Cm)
#pragma unroll
                for (int e = 0; e < E; e += 4) {
                    *reinterpret_cast<float4 *>(prow + (int64_t)ch * E + e) =
                        make_float4(acc[k][e], acc[k][e + 1], acc[k][e + 2], acc[k][e + 3]);
                    if (PAIR && zb >= 0) *reinterpret_cast<float4 *>(zrow + (int64_t)ch * E + e) = zero4;
                }
        }
    } else {
        /* T_SWEEP * K * E floats (<= 64 KiB, inside the stages) as float4 planes [k][f][thread]: the stores and the
        ** loads below are both a warp's 32 consecutive float4, free of bank conflicts (a thread's 32 floats side
        ** by side made both 8-way conflicts, ~5 us at the end of every 117 MB sweep) */
        float4 *cb = reinterpret_cast<float4 *>(smem);
        __syncthreads();   /* every thread is done with the stages */
#pragma unroll
        for (int k = 0; k < K; k++)
#pragma unroll
            for (int f = 0; f < E / 4; f++)
                cb[(k * (E / 4) + f) * T_SWEEP + t] =
                    on ? make_float4(acc[k][4 * f], acc[k][4 * f + 1], acc[k][4 * f + 2], acc[k][4 * f + 3]) : zero4;
        __syncthreads();
        for (int ch = t; ch < C; ch += T_SWEEP) {
            const int kp = ch % Cp, k = ch / Cp;
            float sum[E];
#pragma unroll
            for (int e = 0; e < E; e++) sum[e] = 0;
            for (int r2 = 0; r2 < P; r2++)
#pragma unroll
                for (int f = 0; f < E / 4; f++) {
                    const float4 v = cb[(k * (E / 4) + f) * T_SWEEP + r2 * Cp + kp];
                    sum[4 * f] += v.x;
                    sum[4 * f + 1] += v.y;
                    sum[4 * f + 2] += v.z;
                    sum[4 * f + 3] += v.w;
                }
#pragma unroll
            for (int e = 0; e < E; e += 4)
                *reinterpret_cast<float4 *>(prow + (int64_t)ch * E + e) =
                    make_float4(sum[e], sum[e + 1], sum[e + 2], sum[e + 3]);
        }
    }
    if (KIND == K_POWER && side == 0) {   /* (PAIR: the first half's CTA; vv and ff are its) */
        store_band_scalars(vv, ff, (double *)(red + RED_FLOATS), S, band, M.nbands);
        if (PAIR && zb >= 0 && t == 0) band_vv(S)[zb] = band_ff(S, M.nbands)[zb] = 0;
    }
    __syncthreads();   /* the last group's row sums are read before the next segment writes that buffer */
}

/* Any layout, any n: one row at a time, G read from global memory twice (the second time from L1/L2), the
** column accumulators in the band's partial row (each column always the same thread's). */
template <class T, int KIND, int CAP>
__device__ __noinline__ void generic_segment(const skargs<CAP> &A, const skmat &M, const skscr &S, int band, int64_t la,
                                             int64_t lb, bool rev, char *smem, bool wait)
{
    if (wait) pdl_enter();
    const int t = threadIdx.x;
    const int64_t m = M.m, n = M.n, rs = M.rs, cs = M.cs;
    const bool unit = (A.flags & FL_UNIT) != 0;
    const bool first = KIND == K_SINK && (A.flags & FL_FIRST);
    const bool want_ff = KIND == K_POWER && unit;
    const float eps = (float)A.o.eps, sqn = sqrtf((float)n);
    float *red = (float *)(smem + STAGES * STAGE_BYTES + RRING);
    double *dred = (double *)(red + RED_FLOATS);
    float *prow = S.part + (int64_t)band * n;
    for (int64_t j = t; j < n; j += T_SWEEP) prow[j] = 0;
    const T *g = (const T *)M.g;
    auto colv = [&](int64_t j) -> float {
        if (KIND == K_SINK) return first ? 1.f : __ldcg(S.c + j);
        return (unit ? 1.f : __ldcg(S.c + j)) * __ldcg(S.uv + j);
    };
    const int64_t r0 = la * M.GR, r1 = lb * M.GR < m ? lb * M.GR : m;
    double vv = 0, ff = 0;
#pragma unroll 1
    for (int64_t q = 0; q < r1 - r0; q++) {
        const int64_t i = rev ? r1 - 1 - q : r0 + q;
        const T *gi = g + i * rs;
        /* read before the reduction's barrier; thread 0 writes the new value after it */
        const float rold = (KIND == K_SINK ? first : unit) ? 1.f : S.r[i];
        float ps = 0, pf = 0;
        for (int64_t j = t; j < n; j += T_SWEEP) {
            const float x = msk_f(gi[j * cs]);
            if (KIND == K_SINK) {
                const float y = x * colv(j);
                ps = fmaf(y, y, ps);
            } else {
                ps = fmaf(x, colv(j), ps);
                if (want_ff) pf = fmaf(x, x, pf);
            }
        }
        ps = block_sum<T_SWEEP>(ps, red);
        if (want_ff) pf = block_sum<T_SWEEP>(pf, red);
        float co;
        if (KIND == K_SINK) {
            co = sinkhorn_scale(ps, rold, sqn, eps);
            if (t == 0) S.r[i] = co;
        } else {
            const float v = rold * ps;
            co = rold * v;
            if (t == 0) {
                vv += (double)v * v;
                ff += (double)pf;
            }
        }
        for (int64_t j = t; j < n; j += T_SWEEP) {
            const float x = msk_f(gi[j * cs]);
            if (KIND == K_SINK) {
                const float y = co * x;
                prow[j] = fmaf(y, y, prow[j]);
            } else {
                prow[j] = fmaf(co, x, prow[j]);
            }
        }
    }
    if (KIND == K_POWER) store_band_scalars(vv, ff, dred, S, band, M.nbands);
    __syncthreads();   /* the reductions' shared memory is free for the next segment */
}

/* --- the wide path: dense rows longer than the fast path's (32 elements a thread) ----------------------------
** (bf16 and f16 rows of more than 32768 elements, f32 of more than 16384; the 16-bit ones of 16385-32768 take
** row pairs, below, unless MOONSTEP_SINKGD_PAIR = 0.)  The fast path keeps a
** row's column accumulators in registers, 32 elements a thread, and so cannot hold these rows; the generic path
** read-modify-writes the partials in global memory a row at a time (~0.6 TB/s: a 2048 x 28672 bf16 step took 1.53 ms, 0.54 here; bench/RESULTS.md, thirteenth session).  Here
** an iteration is two passes over G, each streamed at full width:
**   rows (wide_rows_segment): a warp takes a row's sum, with the column factors (c, or c u) cached in shared
**        memory -- rows of more than WIDE_RED / 4 columns in blocks, the CTA's 16 rows at a time -- and sets r
**        (SINK) or v, r v and the band scalars (POWER), as the fast path does for its rows;
**   columns (wide_cols_segment, the pass after the rows): every thread owns WIDE_KC chunks of a tile of
**        WIDE_KC T_SWEEP chunks and adds (r G)^2 (SINK) or (r v) G (POWER) over the band's rows into registers,
**        WIDE_NR rows a step, then stores the band's partials for the fold.  It walks the band against the rows
**        pass, so it starts on the rows that pass read last (still in L2).
** Sums keep a fixed order (deterministic); the fold and everything after it are the fast path's.  The cache of
** column factors is what makes the rows pass stream: with the factors read from L1/L2 instead, a 2048 x 28672
** bf16 step took 0.67 ms against 0.54, and 1024 x 57344 0.92 against 0.64 in blocks. */
#define WIDE_UNROLL 8                                     /* a lane's loads in flight in the rows pass */
#define WIDE_RED   (SWEEP_SMEM - 256)                     /* the rows pass's band sums (f64); below, the cache */
#define WIDE_KC    4                                      /* chunks a thread a column tile */
#define WIDE_NR    4                                      /* rows a step of the columns pass (its loads in flight) */

template <class T, int KIND, int CAP>
__device__ __noinline__ void wide_rows_segment(const skargs<CAP> &A, const skmat &M, const skscr &S, int band,
                                               int64_t la, int64_t lb, bool rev, char *smem)
{
    constexpr int E = elems16<T>::n, U = WIDE_UNROLL;
    constexpr int64_t CB = WIDE_RED / 4;   /* columns a block of the cache (a multiple of 8) */
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int64_t n = M.n, nblk = (n + CB - 1) / CB;
    const bool unit = (A.flags & FL_UNIT) != 0;
    const bool first = KIND == K_SINK && (A.flags & FL_FIRST);
    const bool want_ff = KIND == K_POWER && unit;
    const float eps = (float)A.o.eps, sqn = sqrtf((float)n);
    float *cvs = (float *)smem;
    double *dred = (double *)(smem + WIDE_RED);
    const T *g = (const T *)M.g;
    /* the column factors of block b into the cache: c (SINK; 1 on the first sweep) or (iters = 0 ? 1 : c) u */
    auto fill = [&](int64_t b) {
        const int64_t j0 = b * CB, j1 = j0 + CB < n ? j0 + CB : n;
        for (int64_t j = j0 + t; j < j1; j += T_SWEEP) {
            float f;
            if (KIND == K_SINK) {
                f = first ? 1.f : __ldcg(S.c + j);
            } else {
                f = (unit ? 1.f : __ldcg(S.c + j)) * __ldcg(S.uv + j);
            }
            cvs[j - j0] = f;
        }
    };
    if (nblk == 1) {
        __syncthreads();     /* the previous segment's readers of the cache are done */
        fill(0);
        __syncthreads();
    }
    const int64_t r0 = la * M.GR, r1 = lb * M.GR < M.m ? lb * M.GR : M.m;
    double vv = 0, ff = 0;
    /* a warp a row: lane l adds chunks cb0 + l, cb0 + l + 32, ... < cb1 (cached from column cb0 E on) with U loads
    ** in flight; then the warp's butterfly, and lane 0 sets the row's results */
    auto add_chunks = [&](const T *gi, int64_t cb0, int64_t cb1, float &ps, float &pf) {
#pragma unroll 1
        for (int64_t c0 = cb0 + lane; c0 < cb1; c0 += 32 * U) {
            uint4 w[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t ch = c0 + 32 * u;
                w[u] = ch < cb1 ? __ldg(reinterpret_cast<const uint4 *>(gi + ch * E)) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t ch = c0 + 32 * u;
                if (ch >= cb1) break;
                float x[E], cf[E];
                unpack(w[u], x, (const T *)0);
#pragma unroll
                for (int f = 0; f < E / 4; f++) {
                    const float4 v = reinterpret_cast<const float4 *>(cvs + (ch - cb0) * E)[f];
                    cf[4 * f] = v.x;
                    cf[4 * f + 1] = v.y;
                    cf[4 * f + 2] = v.z;
                    cf[4 * f + 3] = v.w;
                }
#pragma unroll
                for (int e = 0; e < E; e++) {
                    if (KIND == K_SINK) {
                        const float y = x[e] * cf[e];   /* (G c)^2, scaled before the square (fast_segment) */
                        ps = fmaf(y, y, ps);
                    } else {
                        ps = fmaf(x[e], cf[e], ps);
                        if (want_ff) pf = fmaf(x[e], x[e], pf);
                    }
                }
            }
        }
    };
    auto finish_row = [&](int64_t row, float rold, float ps, float pf) {
        ps = warp_sum(ps);
        if (want_ff) pf = warp_sum(pf);
        if (lane != 0) return;
        if (KIND == K_SINK) {
            S.r[row] = sinkhorn_scale(ps, rold, sqn, eps);
        } else {
            const float v = rold * ps;
            rv_of(S)[row] = rold * v;
            vv += (double)v * v;
            ff += (double)pf;
        }
    };
    auto row_of = [&](int64_t q) { return rev ? r1 - 1 - q : r0 + q; };
    /* (rold is read before the row's sum; only lane 0 of the row's own warp writes it after) */
    auto rold_of = [&](int64_t row) { return (KIND == K_SINK ? first : unit) ? 1.f : S.r[row]; };
    if (nblk == 1) {   /* each warp on its own rows, no barrier */
#pragma unroll 1
        for (int64_t q = warp; q < r1 - r0; q += WARPS) {
            const int64_t row = row_of(q);
            const float rold = rold_of(row);
            float ps = 0, pf = 0;
            add_chunks(g + row * n, 0, n / E, ps, pf);
            finish_row(row, rold, ps, pf);
        }
    } else {           /* 16 rows at a time, the CTA's warps together over the blocks, the cache refilled between */
#pragma unroll 1
        for (int64_t q0 = 0; q0 < r1 - r0; q0 += WARPS) {
            const bool on = q0 + warp < r1 - r0;
            const int64_t row = on ? row_of(q0 + warp) : r0;
            const float rold = on ? rold_of(row) : 1.f;   /* (an idle warp reads no r: r0's warp may be writing it) */
            float ps = 0, pf = 0;
#pragma unroll 1
            for (int64_t b = 0; b < nblk; b++) {
                __syncthreads();
                fill(b);
                __syncthreads();
                const int64_t cb0 = b * (CB / E), cb1 = cb0 + CB / E < n / E ? cb0 + CB / E : n / E;
                if (on) add_chunks(g + row * n, cb0, cb1, ps, pf);
            }
            if (on) finish_row(row, rold, ps, pf);
        }
    }
    if (KIND == K_POWER) store_band_scalars(vv, ff, dred, S, band, M.nbands);
    __syncthreads();   /* the cache and the reductions' shared memory are free for the next segment */
}

template <class T, int KIND>
__device__ __noinline__ void wide_cols_segment(const skmat &M, const skscr &S, int band, int64_t la, int64_t lb,
                                               bool rev)
{
    constexpr int E = elems16<T>::n, KC = WIDE_KC, NR = WIDE_NR;
    const int t = threadIdx.x;
    const int64_t n = M.n, C = n / E;
    const int64_t r0 = la * M.GR, r1 = lb * M.GR < M.m ? lb * M.GR : M.m;
    const T *g = (const T *)M.g;
    const float *rf = KIND == K_SINK ? S.r : rv_of(S);
    float *prow = S.part + (int64_t)band * n;
#pragma unroll 1
    for (int64_t c0 = 0; c0 < C; c0 += (int64_t)KC * T_SWEEP) {
        float acc[KC][E];
        int64_t ch[KC];
        bool okc[KC];
#pragma unroll
        for (int k = 0; k < KC; k++) {
            ch[k] = c0 + t + (int64_t)k * T_SWEEP;
            okc[k] = ch[k] < C;
#pragma unroll
            for (int e = 0; e < E; e++) acc[k][e] = 0;
        }
#pragma unroll 1
        for (int64_t q = 0; q < r1 - r0; q += NR) {
            uint4 w[NR][KC];
            float co[NR];
#pragma unroll
            for (int u = 0; u < NR; u++) {
                const bool ok = q + u < r1 - r0;
                const int64_t row = rev ? r1 - 1 - (q + u) : r0 + q + u;
                const float f = ok ? __ldcg(rf + row) : 0.f;
                co[u] = f;
#pragma unroll
                for (int k = 0; k < KC; k++)
                    w[u][k] = ok && okc[k] ? __ldg(reinterpret_cast<const uint4 *>(g + row * n + ch[k] * E))
                                           : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < NR; u++)
#pragma unroll
                for (int k = 0; k < KC; k++) {
                    float x[E];
                    unpack(w[u][k], x, (const T *)0);
#pragma unroll
                    for (int e = 0; e < E; e++) {
                        if (KIND == K_SINK) {   /* (r G)^2 */
                            const float y = co[u] * x[e];
                            acc[k][e] = fmaf(y, y, acc[k][e]);
                        } else {                /* (r v) G */
                            acc[k][e] = fmaf(co[u], x[e], acc[k][e]);
                        }
                    }
                }
        }
#pragma unroll
        for (int k = 0; k < KC; k++)
            if (okc[k])
#pragma unroll
                for (int e = 0; e < E; e += 4)
                    *reinterpret_cast<float4 *>(prow + ch[k] * E + e) =
                        make_float4(acc[k][e], acc[k][e + 1], acc[k][e + 2], acc[k][e + 3]);
    }
}

/* the fast path's map of M (its K chunks a thread), the unit power sweep's |G|^2 in it or not (FF) */
template <class T, int KIND, bool K8, bool FF, int CAP>
__device__ __forceinline__ void fast_typed(const skargs<CAP> &A, const skmat &M, const skscr &S, int band, int64_t la,
                                           int64_t lb, bool rev, char *smem, bool wait)
{
    if (M.K == 1) fast_segment<T, 1, KIND, CAP, false, FF>(A, M, S, band, la, lb, rev, smem, wait);
    else if (M.K == 2) fast_segment<T, 2, KIND, CAP, false, FF>(A, M, S, band, la, lb, rev, smem, wait);
    else if (K8 && sizeof(T) == 4 && M.K == 8) fast_segment<float, 8, KIND, CAP, false, FF>(A, M, S, band, la, lb, rev, smem, wait);
    else fast_segment<T, 4, KIND, CAP, false, FF>(A, M, S, band, la, lb, rev, smem, wait);
}

template <class T, int KIND, bool K8, int CAP>
__device__ __forceinline__ void sweep_typed(const skargs<CAP> &A, const skmat &M, const skscr &S, int band, int64_t la,
                                            int64_t lb, bool rev, char *smem, bool wait)
{
    if (!M.fast) generic_segment<T, KIND>(A, M, S, band, la, lb, rev, smem, wait);
    else if constexpr (KIND == K_POWER) {
        if (A.flags & FL_UNIT) fast_typed<T, KIND, K8, true>(A, M, S, band, la, lb, rev, smem, wait);
        else fast_typed<T, KIND, K8, false>(A, M, S, band, la, lb, rev, smem, wait);
    } else fast_typed<T, KIND, K8, false>(A, M, S, band, la, lb, rev, smem, wait);
}

/* K8: the call has f32 rows of K = 8 (plan_chunk).  Their map lives in a kernel of its own: in the same kernel,
** ptxas allocated the other maps differently (the bf16 POWER K = 4 segment +17 instructions). */
template <int CAP, int KIND, bool K8 = false>
__global__ void __launch_bounds__(T_SWEEP, 1) sweep_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    /* Early (pdl_enter's comment) in calls of up to SMALL_CAP matrices; a restart pass reads the previous fold's
    ** decision first (flags is the table's slot, known without the table).  On the Llama-3-8B set (224 matrices)
    ** reading the table before the wait cost the step 1.5% -- as much when the first copies still waited -- for a
    ** reason not found, while calls of one to eight matrices gained 1.5-8% (bench/RESULTS.md, eighth session). */
    bool wait = CAP <= SMALL_CAP && (flags & FL_REDO) == 0;
    if (!wait) pdl_enter();
    const skargs<CAP> &A = tables[flags];
    extern __shared__ __align__(16) char smem[];
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;   /* NaN skips too, as on the CPU */
    const int64_t ga = range_start(blockIdx.x, A.gtot, A.grid), gb = range_start(blockIdx.x + 1, A.gtot, A.grid);
    const bool rev = (A.flags & FL_REV) != 0;
    const int i0 = mat_of_group(A, ga), i1 = mat_of_group(A, gb - 1);
    for (int s = 0; s <= i1 - i0; s++) {
        const int i = rev ? i1 - s : i0 + s;
        const skmat &M = A.m[i];
        skscr S;
        scr_layout(M.scr, M.m, M.n, M.nbands, &S);
        if ((A.flags & FL_REDO) && __ldcg(S.scal + SC_REDO) == 0) continue;   /* no restart pending */
        if (M.wide) continue;   /* wide_kernel's or pair_kernel's */
        int64_t sa, sb;
        if (!groups_in(A, i, ga, gb, sa, sb)) continue;
        const int band = (int)blockIdx.x - M.band0;
        switch (M.gdt) {
        case MS_DTYPE_BF16: sweep_typed<__nv_bfloat16, KIND, K8>(A, M, S, band, sa, sb, rev, smem, wait); break;
        case MS_DTYPE_F16:  sweep_typed<__half, KIND, K8>(A, M, S, band, sa, sb, rev, smem, wait); break;
        default:            sweep_typed<float, KIND, K8>(A, M, S, band, sa, sb, rev, smem, wait); break;
        }
        wait = false;
    }
    if (wait) pdl_enter();
}

/* Row pairs (pair_exchange): clusters of 2 CTAs, pair matrices only.  A pair takes the rows of its two CTAs'
** ranges (launched on the sweep's grid rounded up to even), so the other passes keep theirs. */
template <int CAP, int KIND>
__global__ void __launch_bounds__(T_SWEEP, 1) pair_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    bool wait = CAP <= SMALL_CAP && (flags & FL_REDO) == 0;   /* (sweep_kernel's) */
    if (!wait) pdl_enter();
    const skargs<CAP> &A = tables[flags];
    extern __shared__ __align__(16) char smem[];
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;   /* (both CTAs of a pair alike) */
    pairw *w = pair_words(smem);
    if (threadIdx.x == 0) {
        const unsigned mb = (unsigned)__cvta_generic_to_shared(w->mbar);
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n\tmbarrier.init.shared::cta.b64 [%1], 1;\n" ::"r"(mb),
                     "r"(mb + 8u) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        w->xq = 0;
    }
    cluster_sync();   /* the partner's barriers are ready before the first post */
    const int c2 = (int)blockIdx.x & ~1;
    const int64_t ga = range_start(c2, A.gtot, A.grid);
    const int64_t gb = range_start(c2 + 2 < A.grid ? c2 + 2 : A.grid, A.gtot, A.grid);
    const bool rev = (A.flags & FL_REV) != 0;
    const int i0 = ga < gb ? mat_of_group(A, ga) : 0, i1 = ga < gb ? mat_of_group(A, gb - 1) : -1;
    for (int s = 0; s <= i1 - i0; s++) {
        const int i = rev ? i1 - s : i0 + s;
        const skmat &M = A.m[i];
        if (M.wide != WIDE_PAIR) continue;
        skscr S;
        scr_layout(M.scr, M.m, M.n, M.nbands, &S);
        if ((A.flags & FL_REDO) && __ldcg(S.scal + SC_REDO) == 0) continue;   /* no restart pending */
        int64_t sa, sb;
        if (!groups_in(A, i, ga, gb, sa, sb)) continue;
        /* the partials go to the matrix's first band among the pair's two; the other, when it has one, gets zeros */
        const int band = (c2 > M.band0 ? c2 : M.band0) - M.band0;
        if (threadIdx.x == 0) w->zband = c2 >= M.band0 && c2 + 1 < M.band0 + M.nbands ? c2 + 1 - M.band0 : -1;
        __syncthreads();
        auto segment = [&](auto ff) {   /* (ff: the unit power sweep's instance, fast_segment's FF) */
            if (M.gdt == MS_DTYPE_BF16)
                fast_segment<__nv_bfloat16, 4, KIND, CAP, true, decltype(ff)::value>(A, M, S, band, sa, sb, rev, smem, wait);
            else
                fast_segment<__half, 4, KIND, CAP, true, decltype(ff)::value>(A, M, S, band, sa, sb, rev, smem, wait);
        };
        if constexpr (KIND == K_POWER) {
            if (A.flags & FL_UNIT) segment(std::true_type());
            else segment(std::false_type());
        } else {
            segment(std::false_type());
        }
        if (threadIdx.x == 0) w->xq += (int)(sb - sa);   /* (read after the next segment's barrier above) */
        wait = false;
    }
    if (wait) pdl_enter();
    cluster_sync();   /* neither CTA leaves while its partner may still post to it */
}

/* The wide path's passes (above), on the sweep's CTAs and ranges, wide matrices only: WIDE_PASS_ROWS right
** after the sweep (which skips them), WIDE_PASS_COLS after that. */
enum { WIDE_PASS_ROWS = 0, WIDE_PASS_COLS = 1 };

template <int CAP, int KIND, int PASS>
__global__ void __launch_bounds__(T_SWEEP, 1) wide_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    pdl_enter();   /* c and u (rows), r and r v (columns) come from the passes just before */
    const skargs<CAP> &A = tables[flags];
    extern __shared__ __align__(16) char smem[];
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;
    const int64_t ga = range_start(blockIdx.x, A.gtot, A.grid), gb = range_start(blockIdx.x + 1, A.gtot, A.grid);
    /* the columns pass walks against the rows pass */
    const bool rev = ((A.flags & FL_REV) != 0) != (PASS == WIDE_PASS_COLS);
    const int i0 = mat_of_group(A, ga), i1 = mat_of_group(A, gb - 1);
    for (int i = i0; i <= i1; i++) {
        const skmat &M = A.m[i];
        if (M.wide != WIDE_PASSES) continue;
        skscr S;
        scr_layout(M.scr, M.m, M.n, M.nbands, &S);
        if ((A.flags & FL_REDO) && __ldcg(S.scal + SC_REDO) == 0) continue;   /* no restart pending */
        int64_t sa, sb;
        if (!groups_in(A, i, ga, gb, sa, sb)) continue;
        const int band = (int)blockIdx.x - M.band0;
        if (PASS == WIDE_PASS_ROWS) {
            switch (M.gdt) {
            case MS_DTYPE_BF16: wide_rows_segment<__nv_bfloat16, KIND>(A, M, S, band, sa, sb, rev, smem); break;
            case MS_DTYPE_F16:  wide_rows_segment<__half, KIND>(A, M, S, band, sa, sb, rev, smem); break;
            default:            wide_rows_segment<float, KIND>(A, M, S, band, sa, sb, rev, smem); break;
            }
        } else {
            switch (M.gdt) {
            case MS_DTYPE_BF16: wide_cols_segment<__nv_bfloat16, KIND>(M, S, band, sa, sb, rev); break;
            case MS_DTYPE_F16:  wide_cols_segment<__half, KIND>(M, S, band, sa, sb, rev); break;
            default:            wide_cols_segment<float, KIND>(M, S, band, sa, sb, rev); break;
            }
        }
    }
}

/* u = w / sigma (rs = 1 / sigma) as a reciprocal and one corrected product: the correctly rounded f64 quotient save
** in rare cases, then rounded to f32.  (A division an element, each behind its slow-path branch, kept the walks'
** elements from overlapping.) */
__device__ __forceinline__ float u_of(float w, double sigma, double rs)
{
    const double q0 = (double)w * rs, q = fma(fma(-q0, sigma, (double)w), rs, q0);
    return (float)q;
}

/* --- the power step's start: u from the state in S.uv with uu = ||u||^2 and f2 = ||X||_F^2 summed (the last SINK
** fold's blocks, or prep_kernel when there is no SINK fold); one block of the matrix then replaces an all-zero u
** (the first step; uu is 0 exactly then, a NaN counting as nonzero) by the start vector and sets the scalars. */
template <int NT>
__device__ __forceinline__ void power_start(const msk_sinkgd &o, const skmat &M, const skscr &S, double uu, double f2,
                                            double *dred)
{
    const bool zero = uu == 0;
    if (zero) {
        float *const uv = S.uv;
        const uint64_t seed = o.seed;
        const int64_t mb = M.b;
        uu = 0;
#pragma unroll 1
        for (int64_t j = threadIdx.x; j < M.n; j += NT) {   /* (vec_walk's order; nothing to load) */
            const float u = u_start(seed, mb, j);
            uv[j] = u;
            uu += (double)u * u;
        }
        uu = block_sum<NT>(uu, dred);
    }
    if (threadIdx.x == 0) {
        S.scal[SC_F2] = f2;
        S.scal[SC_UU] = uu;
        S.scal[SC_SIGMA] = o.eps;
        S.scal[SC_RESTARTED] = zero ? 1 : 0;
        S.scal[SC_REDO] = 0;
    }
}

/* The fold's column j of a matrix: SINK's c_j from its partials' sum T2 (T2 = 0 keeps it); POWER's restart test
** (engine/cpu/sinkgd.c's) and w_j = c_j T_j / max(||v||, eps) into wv, returning w_j^2, or u's start into uv
** when the matrix restarts.  (fold_pass and fold_warp_kernel.) */
__device__ __forceinline__ float sink_column(float c_old, float T2, float sqm, float eps)
{
    return sinkhorn_scale(T2, c_old, sqm, eps);
}
__device__ __forceinline__ bool power_restarts(double restarted, double f2, double nv, double uu)
{
    return restarted == 0 && f2 > 0 && nv <= U_DEGENERATE * sqrt(f2) * sqrt(uu);
}
__device__ __forceinline__ double power_column(const msk_sinkgd &o, const skmat &M, const skscr &S, int64_t j, float T2,
                                               double nv, bool unit, bool restart)
{
    if (restart) {
        S.uv[j] = u_start(o.seed, M.b, j);
        return 0;
    }
    const float w = (float)((double)(unit ? 1.f : S.c[j]) * T2 / clampd(nv, o.eps));
    S.wv[j] = w;
    return (double)w * w;
}

/* The end of a power fold's last block or warp, once sigma = max(||w||, eps) is known.  power_defers_u: the
** step's last power fold, unsharded and not a restart's, stores sigma only -- nothing in the step reads u again,
** so the apply stores it (store_deferred_u: each of its CTAs of the matrix a slice) instead of this block
** walking all n on the step's path; true when it did (the scalars by `writer`).  power_done: the scalars after u
** = w / sigma (uu = ||u||^2; w = 0 keeps u and its uu). */
template <int CAP>
__device__ __forceinline__ bool power_defers_u(const skargs<CAP> &A, const skscr &S, double sigma, double nw, bool writer)
{
    if ((A.flags & (FL_LAST | FL_REDO)) == FL_LAST && A.xch == NULL) {
        if (writer) {
            S.scal[SC_SIGMA] = sigma;
            S.scal[SC_WZERO] = nw == 0 ? 1 : 0;
            S.scal[SC_REDO] = 0;
        }
        return true;
    }
    return false;
}
__device__ __forceinline__ void power_done(const skscr &S, double sigma, double nw, double uu)
{
    S.scal[SC_SIGMA] = sigma;
    if (nw != 0) S.scal[SC_UU] = uu;
    S.scal[SC_REDO] = 0;
}

/* block_sum<FOLD_THREADS> of the values v(t) of the threads t = 0..255 of a block, on one warp: lane l holds
** t = l + 32 w for w = 0..7 (every lane gets the same bits) */
template <class V>
__device__ __forceinline__ double sum256(const V &v)
{
    double s = 0;
#pragma unroll 1
    for (int w = 0; w < FOLD_THREADS / 32; w++) s += warp_sum(v((int)(threadIdx.x & 31) + 32 * w));
    return s;
}

/* --- the restarted power step of an unsharded matrix -----------------------------------------------------
** A degenerate u (power_restarts: u orthogonal to every row of X to 1e-4, as a 1-row matrix half of whose signs
** flip) is rare, so the power fold's last block (or warp) redoes that matrix's power step alone from the start
** vector the fold's blocks wrote to S.uv: v = X u (r v into rv_of), then w = X^T v / max(||v||, eps) into S.wv,
** engine/cpu/sinkgd.c's restart.  Before, a restart pass and fold followed every power fold and did nothing
** almost always: two launches, 6.3 us of a 14336x4096 spectral step and 8.4 of a 4096x14336 one.  The work is
** 256 virtual threads' in a fixed order -- thread t the rows t, t + 256, ..., then the columns t, t + 256, ...,
** each a sequential f64 sum -- added as block_sum (a block) or sum256 (a warp) add them, so both give the same
** bits.  One CTA reads G twice: milliseconds for a large matrix, on the rare step that needs it.
** redo_rows returns thread t's sum of v_i^2, redo_cols its sum of w_j^2. */
template <class T>
__device__ __noinline__ double redo_rows(const skmat &M, const skscr &S, bool unit, int t)
{
    const T *g = (const T *)M.g;
    float *const rv = rv_of(S);
    double vv = 0;
    for (int64_t i = t; i < M.m; i += FOLD_THREADS) {
        const T *gi = g + i * M.rs;
        double s = 0;
        for (int64_t j = 0; j < M.n; j++) {
            const double cu = unit ? (double)__ldcg(S.uv + j) : (double)__ldcg(S.c + j) * (double)__ldcg(S.uv + j);
            s += (double)msk_f(gi[j * M.cs]) * cu;
        }
        const double ri = unit ? 1.0 : (double)__ldcg(S.r + i), v = ri * s;
        rv[i] = (float)(ri * v);
        vv += v * v;
    }
    return vv;
}
template <class T>
__device__ __noinline__ double redo_cols(const msk_sinkgd &o, const skmat &M, const skscr &S, bool unit, double nv, int t)
{
    const T *g = (const T *)M.g;
    const float *const rv = rv_of(S);
    double w2 = 0;
    for (int64_t j = t; j < M.n; j += FOLD_THREADS) {
        double s = 0;
        for (int64_t i = 0; i < M.m; i++) s += (double)msk_f(g[i * M.rs + j * M.cs]) * (double)__ldcg(rv + i);
        const float w = (float)((unit ? 1.0 : (double)__ldcg(S.c + j)) * s / clampd(nv, o.eps));
        S.wv[j] = w;
        w2 += (double)w * w;
    }
    return w2;
}
template <bool COLS>
__device__ __noinline__ double redo_part(const msk_sinkgd &o, const skmat &M, const skscr &S, bool unit, double nv, int t)
{
    switch (M.gdt) {
    case MS_DTYPE_BF16: return COLS ? redo_cols<__nv_bfloat16>(o, M, S, unit, nv, t) : redo_rows<__nv_bfloat16>(M, S, unit, t);
    case MS_DTYPE_F16:  return COLS ? redo_cols<__half>(o, M, S, unit, nv, t) : redo_rows<__half>(M, S, unit, t);
    default:            return COLS ? redo_cols<float>(o, M, S, unit, nv, t) : redo_rows<float>(M, S, unit, t);
    }
}
/* The redo by a whole fold block (WARP false: dred is block_sum's) or by one warp; returns ||w||^2 and marks the
** matrix restarted (once a step, as the CPU). */
template <bool WARP>
__device__ double power_redo(const msk_sinkgd &o, const skmat &M, const skscr &S, bool unit, double *dred)
{
    double vv, w2;
    if (WARP) {
        vv = sum256([&](int t) { return redo_part<false>(o, M, S, unit, 0, t); });
        __syncwarp();   /* r v, written by every lane, is read by every lane */
        const double nv = sqrt(vv);
        w2 = sum256([&](int t) { return redo_part<true>(o, M, S, unit, nv, t); });
    } else {
        /* (block_sum's barriers make every thread's r v visible to the block) */
        vv = block_sum<FOLD_THREADS>(redo_part<false>(o, M, S, unit, 0, threadIdx.x), dred);
        const double nv = sqrt(vv);
        w2 = block_sum<FOLD_THREADS>(redo_part<true>(o, M, S, unit, nv, threadIdx.x), dred);
    }
    if ((WARP ? threadIdx.x & 31 : threadIdx.x) == 0) S.scal[SC_RESTARTED] = 1;
    return w2;
}

/* --- the folds: column partials summed in band order ------------------------------------------------------
** A block takes FOLD_COLS = 32 columns of one matrix: warp w adds the bands w, w + 8, ... of its lane's column,
** then the 8 warp sums are added in warp order.  A matrix of more than FOLD_QUAD_BANDS bands (n a multiple of 4)
** is added in the quad order instead: thread (w, l) adds the bands p, p + 32, ... (p = 4 w + l / 8) of 4 columns
** with 16-byte loads, all in flight at once (one round of L2 latency, not three for 132 bands: 14336x4096 -0.5%
** a step, 4096x4096 -3.7%; with few bands most threads would idle: 8x1408x2048 +1.5%), then each column adds
** its 32 sums in p order.  (fold_warp_kernel takes matrices of at most WARP_FOLD_BANDS bands: the band order.)
** SINK:  T_j = sum of the bands; c_j <- sqrt(m) c_j / max(c_j sqrt(T_j), eps) (T_j = 0: kept); with FL_LAST
**        (START) the power step's start: ||X||_F^2 by columns (the sum of c_j^2 T_j, for the restart test), u
**        from the state and ||u||^2 (power_start).
** POWER: w_j = c_j (G^T r v)_j / max(||v||, eps); the restart test of engine/cpu/sinkgd.c (a restart: the
**        last block's power_redo; sharded, the restart passes and folds); the matrix's last block (ticket) makes
**        sigma = max(||w||, eps) and u = w / sigma (kept when w = 0), and with FL_LAST stores u -- save in an
**        unsharded step, whose apply stores it (power_defers_u).
** Rows-sharded, a fold is two launches around the exchange: FOLD_PART stores T_j at A.xch[block * 32 + lane]
** (f32 for SINK; f64 for POWER, followed by |v|^2 and ||G||^2, two per matrix: exact for one rank, so its step
** is the single-GPU one bit for bit), FOLD_FINISH reads the ranks' sums back and goes on as a whole fold, with
** the global m's root for c. */
enum { FOLD_WHOLE = 0, FOLD_PART = 1, FOLD_FINISH = 2 };
enum { FOLD_QUAD_BANDS = 32, FOLD_QUAD_LOADS = 5 };   /* (5 loads: the 132 bands of an H200 pass in one round) */
static_assert(FOLD_THREADS == 256, "the quad order's 32 sums a column are 8 warps x 4 band lanes");

__device__ __forceinline__ void add4(float4 &a, const float4 &v)
{
    a.x += v.x;
    a.y += v.y;
    a.z += v.z;
    a.w += v.w;
}

/* fold_packed_kernel: the whole fold at FOLD_PACKED blocks an SM.  The START and POWER folds take 52-62
** registers, 4 blocks an SM, and a block's time is a chain of latencies (loads, barriers, the ticket), so a grid
** of many waves (a chunk of many matrices: 14336 blocks for 32 x 4096 x 14336) is paced by residency: held to 32
** registers (the last block's vector work spills) they took 71 and 96 us there instead of 123 and 146.  Within
** one wave the spills only lengthen the step's path (4096 x 4096 spectral +2%): run_chunk picks by the grid
** (many_folds).  (A second launch bound of 1 is not the default: ptxas then gave the folds 40-128 registers.) */
enum { FOLD_PACKED = 8 };

template <int CAP, int KIND, int STAGE, bool START>
__device__ __forceinline__ void fold_pass(const skargs<CAP> *__restrict__ tables, int flags)
{
    const skargs<CAP> &A = tables[flags];
    __shared__ float sm[FOLD_THREADS / 32][FOLD_COLS];
    __shared__ float sq[32][FOLD_COLS + 1];   /* the quad order's 32 sums a column (+1: no bank conflicts) */
    __shared__ double dred[FOLD_THREADS / 32];
    __shared__ double scal_sh[4];   /* POWER: SC_REDO, SC_F2, SC_UU, SC_RESTARTED (thread 0's reads, below) */
    __shared__ int is_last;
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;
    const int blk = blockIdx.x;
    const int i = mat_of_fold(A, blk);
    const skmat &M = A.m[i];
    skscr S;
    scr_layout(M.scr, M.m, M.n, M.nbands, &S);
    pdl_enter();   /* (the table and the lookups above before it: pdl_enter says why) */
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int64_t n = M.n, m = M.m;
    const int lbk = blk - M.f0, nf = (int)nfold_of(n);
    /* POWER: the matrix's scalars that every thread needs are thread 0's reads, shared -- the same words read by
    ** every warp of the grid queue in L2 (below: a 448-block power fold took 17.2 us with them, 9.0 without) */
    if (KIND == K_POWER && (A.flags & FL_REDO)) {
        if (t == 0) scal_sh[0] = __ldcg(S.scal + SC_REDO);
        __syncthreads();
    }
    if (KIND == K_POWER && (A.flags & FL_REDO) && scal_sh[0] == 0) return;   /* no restart pending (sharded) */
    const int64_t j0 = (int64_t)lbk * FOLD_COLS, jl = j0 + lane;
    const bool unit = (A.flags & FL_UNIT) != 0;
    const float eps = (float)A.o.eps;
    const int64_t j = j0 + t;
    const bool jv = t < FOLD_COLS && j < n;
    /* sharded: this block's column sums, and the matrix's two scalars after every column (A.nfold blocks) */
    float *const xs = (float *)A.xch;
    double *const xd = (double *)A.xch;
    const int64_t xcol = (int64_t)blk * FOLD_COLS + t, xsc = (int64_t)A.nfold * FOLD_COLS + 2 * (int64_t)i;

    float T2 = 0;
    if (STAGE == FOLD_FINISH) {
        if (jv) T2 = KIND == K_SINK ? __ldcg(xs + xcol) : (float)__ldcg(xd + xcol);
    } else {
        if (M.nbands > FOLD_QUAD_BANDS && (n & 3) == 0) {
            /* (the quad order, above) */
            const int bl = lane >> 3, cq = lane & 7, p0 = 4 * warp + bl;
            const int64_t jq = j0 + 4 * cq;
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
            if (jq < n) {
                const float *col = S.part + jq;
                float4 v[FOLD_QUAD_LOADS];
#pragma unroll
                for (int u = 0; u < FOLD_QUAD_LOADS; u++) {
                    const int bb = p0 + 32 * u;
                    v[u] = bb < M.nbands ? __ldcg(reinterpret_cast<const float4 *>(col + (int64_t)bb * n))
                                         : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll
                for (int u = 0; u < FOLD_QUAD_LOADS; u++) add4(acc, v[u]);
                for (int bb = p0 + 32 * FOLD_QUAD_LOADS; bb < M.nbands; bb += 32)
                    add4(acc, __ldcg(reinterpret_cast<const float4 *>(col + (int64_t)bb * n)));
            }
            sq[p0][4 * cq] = acc.x;
            sq[p0][4 * cq + 1] = acc.y;
            sq[p0][4 * cq + 2] = acc.z;
            sq[p0][4 * cq + 3] = acc.w;
            __syncthreads();
            if (jv)
                for (int q = 0; q < 32; q++) T2 += sq[q][t];
        } else {
            /* warp w adds the bands w, w + 8, ... of its lane's column (a warp reads 128 contiguous bytes a band) */
            float s1 = 0;
            if (jl < n) {
                const float *col = S.part + jl;
                int bb = warp;
                /* 8 loads in flight (132 bands, n not a multiple of 4, are ~17 a warp: 3 rounds of L2 latency, not
                ** 5), added in band order as one at a time would */
                for (; bb + 7 * (FOLD_THREADS / 32) < M.nbands; bb += 8 * (FOLD_THREADS / 32)) {
                    float v[8];
#pragma unroll
                    for (int u = 0; u < 8; u++) v[u] = __ldcg(col + (int64_t)(bb + u * (FOLD_THREADS / 32)) * n);
#pragma unroll
                    for (int u = 0; u < 8; u++) s1 += v[u];
                }
                for (; bb + 3 * (FOLD_THREADS / 32) < M.nbands; bb += 4 * (FOLD_THREADS / 32)) {
                    float v[4];
#pragma unroll
                    for (int u = 0; u < 4; u++) v[u] = __ldcg(col + (int64_t)(bb + u * (FOLD_THREADS / 32)) * n);
#pragma unroll
                    for (int u = 0; u < 4; u++) s1 += v[u];
                }
                for (; bb < M.nbands; bb += FOLD_THREADS / 32) s1 += __ldcg(col + (int64_t)bb * n);
            }
            sm[warp][lane] = s1;
            __syncthreads();
            if (jv)
#pragma unroll
                for (int w = 0; w < FOLD_THREADS / 32; w++) T2 += sm[w][t];
        }
        if (STAGE == FOLD_PART && t < FOLD_COLS) {   /* (zeros past n: the buffer is dense) */
            if (KIND == K_SINK) xs[xcol] = T2;
            else xd[xcol] = T2;
        }
        if (STAGE == FOLD_PART && KIND == K_SINK) return;
    }

    if (KIND == K_SINK) {
        double q = 0;
        if (jv) {
            const float c_old = (A.flags & FL_FIRST) ? 1.f : S.c[j];
            const float sqm = STAGE == FOLD_FINISH ? M.root : sqrtf((float)m);
            const float cn = sink_column(c_old, T2, sqm, eps);
            S.c[j] = cn;
            q = (double)cn * cn * T2;
        }
        if (!START) return;
        /* the last fold before the power step (FL_LAST): this block's c^2 T sums (||X||_F^2 by columns) and its
        ** columns of u from the state, with their u^2; the matrix's last block (ticket) adds them and starts the
        ** power step (prep_kernel's work, without a launch and a one-block walk of n on the step's path).  An
        ** instance of its own: this code took the other folds from 26 to 62 registers, the Llama set's base
        ** step +0.9% */
        q = block_sum<FOLD_THREADS>(q, dred);
        double uu = 0;
        if (jv) {
            const float u = M.u[j];
            S.uv[j] = u;
            uu = (double)u * u;
        }
        uu = block_sum<FOLD_THREADS>(uu, dred);
        double *const fuu = fuu_of(S, m);
        if (t == 0) {
            S.fsc[lbk] = q;
            fuu[lbk] = uu;
        }
        __threadfence();   /* this block's writes are visible device-wide before its ticket */
        __syncthreads();
        if (t == 0) is_last = nf == 1 || atomicInc(&A.tickets[i], (unsigned)(nf - 1)) == (unsigned)(nf - 1);
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        double f2 = 0, u2 = 0;
        for (int k = t; k < nf; k += FOLD_THREADS) {
            f2 += __ldcg(S.fsc + k);
            u2 += __ldcg(fuu + k);
        }
        f2 = block_sum<FOLD_THREADS>(f2, dred);
        u2 = block_sum<FOLD_THREADS>(u2, dred);
        power_start<FOLD_THREADS>(A.o, M, S, u2, f2, dred);
        return;
    }

    /* POWER: the matrix's scalars, the same bits in every block.  (Thread 0's reads are issued here: before the
    ** column sums the 448-block fold took 15.1 us, not 9.0 -- warp 0 waits for them before its own sums, likely) */
    if (STAGE != FOLD_PART && t == 0) {
        scal_sh[1] = __ldcg(S.scal + SC_F2);
        scal_sh[2] = __ldcg(S.scal + SC_UU);
        scal_sh[3] = __ldcg(S.scal + SC_RESTARTED);
    }
    double nv2 = 0, ffs = 0;
    if (STAGE == FOLD_FINISH) {
        nv2 = __ldcg(xd + xsc);
        ffs = __ldcg(xd + xsc + 1);
    } else {
        if (STAGE == FOLD_PART && lbk != 0) return;   /* the matrix's first block stores them */
        const double *bvv = band_vv(S), *bff = band_ff(S, M.nbands);
        for (int bb = t; bb < M.nbands; bb += FOLD_THREADS) {
            nv2 += __ldcg(bvv + bb);
            if (unit) ffs += __ldcg(bff + bb);   /* (used only when iters = 0) */
        }
        nv2 = block_sum<FOLD_THREADS>(nv2, dred);
        if (unit) ffs = block_sum<FOLD_THREADS>(ffs, dred);
        if (STAGE == FOLD_PART) {
            if (t == 0) {
                xd[xsc] = nv2;
                xd[xsc + 1] = ffs;
            }
            return;
        }
    }
    __syncthreads();   /* scal_sh */
    const double nv = sqrt(nv2), f2 = unit ? ffs : scal_sh[1];
    const bool restart = power_restarts(scal_sh[3], f2, nv, scal_sh[2]);
    double q = jv ? power_column(A.o, M, S, j, T2, nv, unit, restart) : 0;
    if (!restart) {
        q = block_sum<FOLD_THREADS>(q, dred);
        if (t == 0) S.fsc[lbk] = q;
    }
    __threadfence();   /* this block's writes are visible device-wide before its ticket */
    __syncthreads();
    if (t == 0) is_last = nf == 1 || atomicInc(&A.tickets[i], (unsigned)(nf - 1)) == (unsigned)(nf - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    double w2 = 0;
    if (restart && A.xch != NULL) {   /* sharded: u is the start vector now; the redo passes and folds go on */
        if (t == 0) {
            S.scal[SC_RESTARTED] = 1;
            S.scal[SC_REDO] = 1;
        }
        return;
    } else if (restart) {
        w2 = power_redo<false>(A.o, M, S, unit, dred);
    } else {
        for (int k = t; k < nf; k += FOLD_THREADS) w2 += __ldcg(S.fsc + k);
        w2 = block_sum<FOLD_THREADS>(w2, dred);
    }
    const double nw = sqrt(w2), sigma = clampd(nw, A.o.eps);
    if (power_defers_u(A, S, sigma, nw, t == 0)) return;
    double uu = 0;
    float *const keep = (A.flags & FL_LAST) ? M.u : NULL;   /* the persisted u, stored as it is made */
    if (nw != 0) {   /* X^T v = 0 keeps u, so no later step starts from a zero vector */
        const double rs = __drcp_rn(sigma);
        vec_walk<FOLD_THREADS>(n, [&](int64_t jj) { return __ldcg(S.wv + jj); }, [&](int64_t jj, float w) {
            const float u = u_of(w, sigma, rs);
            S.uv[jj] = u;
            if (keep != NULL) keep[jj] = u;
            uu += (double)u * u;
        });
    } else if (keep != NULL) {
        vec_walk<FOLD_THREADS>(n, [&](int64_t jj) { return __ldcg(S.uv + jj); }, [&](int64_t jj, float u) { keep[jj] = u; });
    }
    uu = block_sum<FOLD_THREADS>(uu, dred);
    if (t == 0) power_done(S, sigma, nw, uu);
}

template <int CAP, int KIND, int STAGE = FOLD_WHOLE, bool START = false>
__global__ void __launch_bounds__(FOLD_THREADS) fold_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    fold_pass<CAP, KIND, STAGE, START>(tables, flags);
}

template <int CAP, int KIND, bool START>
__global__ void __launch_bounds__(FOLD_THREADS, FOLD_PACKED)
    fold_packed_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    fold_pass<CAP, KIND, FOLD_WHOLE, START>(tables, flags);
}

/* The folds of a chunk of many fold blocks whose matrices have at most WARP_FOLD_BANDS bands each, a warp a fold
** block: SINK, START, POWER and the restart's, and the rows-sharded SINK PART and FINISH and POWER PART.  With few
** bands most of a fold_kernel block's 8 warps have nothing to add, and a grid of many blocks (the Llama-3-8B set's
** 4096-wide chunk: 24576) is paced by running them through the SMs.  The bits are fold_pass's: a lane adds its
** column's bands w, w + 8, ... for w = 0..7 and then those 8 sums in w order, as fold_pass's warps and its sm[]
** sum do; a block's sums (START's, POWER's, the bands' |v|^2) are warp 0's (the other warps of a fold_pass block
** hold zeros), and the matrix's last warp sums the blocks' scalars and walks u (its start, or w / sigma) as
** fold_pass's 256 threads would (sum256).  That walk is slower than a block's, so a power fold that walks u in
** every step (one before the last of sn_iters > 1; a sharded FINISH) keeps fold_pass.  MOONSTEP_SINKGD_WARP_FOLD = 0
** turns them off (tests and measurements). */
enum { WARP_FOLD_BANDS = 16 };
static_assert((int)WARP_FOLD_BANDS <= (int)FOLD_QUAD_BANDS, "a warp fold adds in the band order: fold_pass's for its matrices");

/* sum256 of the fold blocks' scalars x[0..nf): thread t's part is x[t], x[t + 256], ..., as fold_pass's last
** block adds them */
__device__ __forceinline__ double sum256_blocks(const double *x, int nf)
{
    return sum256([&](int t) {
        double a = 0;
        for (int k = t; k < nf; k += FOLD_THREADS) a += __ldcg(x + k);
        return a;
    });
}

/* A fold warp's ticket for its matrix's nf fold blocks: the warp's writes are made visible device-wide first; true
** in the last warp to take one, which then sees the others' writes */
__device__ __forceinline__ bool last_warp(unsigned *ticket, int nf)
{
    __threadfence();
    __syncwarp();
    unsigned last = 0;
    if ((threadIdx.x & 31) == 0) last = nf == 1 || atomicInc(ticket, (unsigned)(nf - 1)) == (unsigned)(nf - 1);
    last = __shfl_sync(0xffffffffu, last, 0);
    if (last) __threadfence();
    return last != 0;
}

template <int CAP, int KIND, bool START, int STAGE = FOLD_WHOLE>
__global__ void __launch_bounds__(FOLD_THREADS) fold_warp_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    static_assert(KIND == K_SINK || !START, "START is a SINK fold");
    static_assert(KIND == K_SINK || STAGE != FOLD_FINISH, "a sharded POWER FINISH walks u: fold_pass's");
    constexpr int W = FOLD_THREADS / 32;
    const skargs<CAP> &A = tables[flags];
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;
    const int blk = (int)blockIdx.x * W + (int)(threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (blk >= A.nfold) {   /* (a whole warp: blk is the warp's) */
        pdl_enter();
        return;
    }
    const int i = mat_of_fold(A, blk);
    const skmat &M = A.m[i];
    skscr S;
    scr_layout(M.scr, M.m, M.n, M.nbands, &S);
    pdl_enter();   /* (fold_pass's order) */
    const int64_t n = M.n, m = M.m;
    const int lbk = blk - M.f0;
    const int64_t j = (int64_t)lbk * FOLD_COLS + lane;
    const bool jv = j < n;
    if (KIND == K_POWER && (A.flags & FL_REDO) && __ldcg(S.scal + SC_REDO) == 0) return;   /* no restart pending */
    const int nf = (int)nfold_of(n);
    /* sharded: this block's column sums, and the matrix's two scalars after every column (fold_pass) */
    float *const xs = (float *)A.xch;
    double *const xd = (double *)A.xch;
    const int64_t xcol = (int64_t)blk * FOLD_COLS + lane, xsc = (int64_t)A.nfold * FOLD_COLS + 2 * (int64_t)i;
    float T2 = 0;
    if (STAGE == FOLD_FINISH) {
        if (jv) T2 = __ldcg(xs + xcol);
    } else if (jv) {
        const float *col = S.part + j;
        const int nb = M.nbands;
        float sw[W];
#pragma unroll
        for (int w = 0; w < W; w++) sw[w] = 0.f;
        for (int b0 = 0; b0 < nb; b0 += W) {
            float v[W];
#pragma unroll
            for (int w = 0; w < W; w++) v[w] = b0 + w < nb ? __ldcg(col + (int64_t)(b0 + w) * n) : 0.f;
#pragma unroll
            for (int w = 0; w < W; w++)
                if (b0 + w < nb) sw[w] += v[w];
        }
#pragma unroll
        for (int w = 0; w < W; w++) T2 += sw[w];
    }
    if (STAGE == FOLD_PART) {   /* (zeros past n: the buffer is dense) */
        if (KIND == K_SINK) {
            xs[xcol] = T2;
            return;
        }
        xd[xcol] = T2;
        if (lbk != 0) return;   /* the matrix's first block stores |v|^2 and ||G||^2 */
        const int nb = M.nbands;
        const double nv2 = warp_sum(lane < nb ? __ldcg(band_vv(S) + lane) : 0.0);
        const double ffs = (A.flags & FL_UNIT) ? warp_sum(lane < nb ? __ldcg(band_ff(S, nb) + lane) : 0.0) : 0.0;
        if (lane == 0) {
            xd[xsc] = nv2;
            xd[xsc + 1] = ffs;
        }
        return;
    }
    if (KIND == K_POWER) {
        const bool unit = (A.flags & FL_UNIT) != 0;
        const double f2s = __ldcg(S.scal + SC_F2), uus = __ldcg(S.scal + SC_UU), rst = __ldcg(S.scal + SC_RESTARTED);
        const int nb = M.nbands;
        double nv2 = lane < nb ? __ldcg(band_vv(S) + lane) : 0, ffs = 0;
        nv2 = warp_sum(nv2);
        if (unit) ffs = warp_sum(lane < nb ? __ldcg(band_ff(S, nb) + lane) : 0.0);
        const double nv = sqrt(nv2), f2 = unit ? ffs : f2s;
        const bool restart = power_restarts(rst, f2, nv, uus);
        double q = jv ? power_column(A.o, M, S, j, T2, nv, unit, restart) : 0;
        if (!restart) {
            q = warp_sum(q);
            if (lane == 0) S.fsc[lbk] = q;
        }
        if (!last_warp(&A.tickets[i], nf)) return;
        /* (a whole POWER fold here is unsharded: a sharded one is PART, above, then fold_pass's FINISH) */
        const double nw = sqrt(restart ? power_redo<true>(A.o, M, S, unit, NULL) : sum256_blocks(S.fsc, nf));
        const double sigma = clampd(nw, A.o.eps);
        if (power_defers_u(A, S, sigma, nw, lane == 0)) return;
        double uu = 0;
        float *const keep = (A.flags & FL_LAST) ? M.u : NULL;   /* the persisted u, stored as it is made */
        if (nw != 0) {   /* X^T v = 0 keeps u */
            const double rs = __drcp_rn(sigma);
            uu = sum256([&](int t) {
                double a = 0;
                vec_walk_from<FOLD_THREADS, 4>(t, n, [&](int64_t jj) { return __ldcg(S.wv + jj); }, [&](int64_t jj, float w) {
                    const float u = u_of(w, sigma, rs);
                    S.uv[jj] = u;
                    if (keep != NULL) keep[jj] = u;
                    a += (double)u * u;
                });
                return a;
            });
        } else if (keep != NULL) {
            for (int64_t jj = lane; jj < n; jj += 32) keep[jj] = __ldcg(S.uv + jj);
        }
        if (lane == 0) power_done(S, sigma, nw, uu);
        return;
    }
    double q = 0, uu = 0;
    if (jv) {
        const float c_old = (A.flags & FL_FIRST) ? 1.f : S.c[j];
        const float sqm = STAGE == FOLD_FINISH ? M.root : sqrtf((float)m);
        const float cn = sink_column(c_old, T2, sqm, (float)A.o.eps);
        S.c[j] = cn;
        if (START) {
            q = (double)cn * cn * T2;
            const float u = M.u[j];
            S.uv[j] = u;
            uu = (double)u * u;
        }
    }
    if (!START) return;
    q = warp_sum(q);
    uu = warp_sum(uu);
    double *const fuu = fuu_of(S, m);
    if (lane == 0) {
        S.fsc[lbk] = q;
        fuu[lbk] = uu;
    }
    if (!last_warp(&A.tickets[i], nf)) return;
    /* the last warp: fold_pass's last block's sums and power_start, each thread t's part walked by lane t % 32 */
    const double f2 = sum256_blocks(S.fsc, nf);
    double u2 = sum256_blocks(fuu, nf);
    const bool zero = u2 == 0;
    if (zero) {
        float *const uv = S.uv;
        const uint64_t seed = A.o.seed;
        const int64_t mb = M.b;
        u2 = sum256([&](int t) {
            double a = 0;
            for (int64_t jj = t; jj < n; jj += FOLD_THREADS) {
                const float u = u_start(seed, mb, jj);
                uv[jj] = u;
                a += (double)u * u;
            }
            return a;
        });
    }
    if (lane == 0) {
        S.scal[SC_F2] = f2;
        S.scal[SC_UU] = u2;
        S.scal[SC_SIGMA] = A.o.eps;
        S.scal[SC_RESTARTED] = zero ? 1 : 0;
        S.scal[SC_REDO] = 0;
    }
}

/* --- the power step's start when there is no SINK fold (iters = 0; the last SINK fold does it otherwise): u from
** the state and ||u||^2; one block per matrix. */
template <int CAP>
__global__ void __launch_bounds__(PREP_THREADS) prep_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    pdl_enter();
    const skargs<CAP> &A = tables[flags];
    __shared__ double dred[PREP_THREADS / 32];
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;
    const skmat &M = A.m[blockIdx.x];
    skscr S;
    scr_layout(M.scr, M.m, M.n, M.nbands, &S);
    /* (the table's fields in registers: read through M in the loops, they were reloaded for every element) */
    const float *const uin = M.u;
    float *const uv = S.uv;
    double uu = 0;
    vec_walk<PREP_THREADS>(M.n, [&](int64_t j) { return uin[j]; }, [&](int64_t j, float u) {
        uv[j] = u;
        uu += (double)u * u;
    });
    uu = block_sum<PREP_THREADS>(uu, dred);
    power_start<PREP_THREADS>(A.o, M, S, uu, 0.0, dred);   /* (r = c = 1: the power fold takes ||G||^2 itself) */
}

/* --- the elementwise passes over a CTA's band: rows [r0, r1) of G and p ---------------------------------
** x = r_i G_ij c_j (f32).  SUMS: s0 += p^2, s1 += p x, s2 += x^2 (f64).  APPLY: p <- (p dec - coef x) fac,
** with dec split in two floats so that p dec - coef x is rounded once (as the CPU's f64 result is), then
** stored (stochastic rounding as engine/cpu/optim.c when asked). */

struct coefs {
    float dhi, dlo, co, fa;
    bool  scaled;   /* fa != 1 */
    bool  stochastic;
    uint32_t k0, k1, step;
};

template <class TP>
__device__ __forceinline__ void store_p(TP *p, int64_t idx, float v, const coefs &cf, const skmat &M)
{
    if (sizeof(TP) == 2 && cf.stochastic) {
        const uint16_t h = msk_sr_16(v, M.pdt == MS_DTYPE_BF16, (uint64_t)(M.e0 + idx), cf.step, (uint32_t)M.member,
                                     cf.k0, cf.k1);
        reinterpret_cast<uint16_t *>(p)[idx] = h;
    } else {
        p[idx] = msk_store_of<TP>::cvt(v);
    }
}

template <int KIND>
__device__ __forceinline__ float elem_op(float p, float x, const coefs &cf, double (&a)[3])
{
    if (KIND == E_SUMS) {
        a[0] += (double)p * p;
        a[1] += (double)p * x;
        a[2] += (double)x * x;
        return p;
    }
    float v = fmaf(p, cf.dhi, fmaf(p, cf.dlo, -(cf.co * x)));
    if (cf.scaled) v *= cf.fa;
    return v;
}

/* 8 consecutive elements of T at p (16-byte aligned), kept packed until used: one or two 16-byte words */
template <class T> struct raw8 { uint4 w[sizeof(T) == 4 ? 2 : 1]; };

template <class T> __device__ __forceinline__ raw8<T> ld8(const T *p)
{
    raw8<T> r;
    r.w[0] = *reinterpret_cast<const uint4 *>(p);
    if constexpr (sizeof(T) == 4) r.w[1] = *reinterpret_cast<const uint4 *>(p + 4);
    return r;
}

template <class T> __device__ __forceinline__ void unpack8(const raw8<T> &r, float *x)
{
    unpack(r.w[0], x, (const T *)0);
    if constexpr (sizeof(T) == 4) unpack(r.w[1], x + 4, (const T *)0);
}

/* the 8 column scales of a chunk from c (two 16-byte loads through L1) */
__device__ __forceinline__ void load_c8(const float *c, float (&cc)[8])
{
    const float4 c0 = __ldg(reinterpret_cast<const float4 *>(c));
    const float4 c1 = __ldg(reinterpret_cast<const float4 *>(c + 4));
    cc[0] = c0.x; cc[1] = c0.y; cc[2] = c0.z; cc[3] = c0.w;
    cc[4] = c1.x; cc[5] = c1.y; cc[6] = c1.z; cc[7] = c1.w;
}

/* One chunk of 8 elements of p at e, from its G words gw and p words pw, the row's scale rr and the columns' cc:
** with E_APPLY the new values stored, with E_SUMS the sphere's sums taken into a (the ring's arithmetic, and
** flat_apply_kernel's, so both give the same bits) */
template <class TG, class TP, int KIND>
__device__ __forceinline__ void elem_chunk(const raw8<TG> &gw, const raw8<TP> &pw, float rr, const float (&cc)[8],
                                           const coefs &cf, const skmat &M, TP *p, int64_t e, double (&a)[3])
{
    float gx[8], px[8], out[8];
    unpack8(gw, gx);
    unpack8(pw, px);
#pragma unroll
    for (int k = 0; k < 8; k++) out[k] = elem_op<KIND>(px[k], rr * gx[k] * cc[k], cf, a);
    if constexpr (KIND == E_APPLY) {
        if constexpr (sizeof(TP) == 4) {
            *reinterpret_cast<float4 *>(p + e) = make_float4(out[0], out[1], out[2], out[3]);
            *reinterpret_cast<float4 *>(p + e + 4) = make_float4(out[4], out[5], out[6], out[7]);
        } else {
            /* the 8 results packed in four registers and stored as one 16-byte word; no array is indexed by a
            ** loop variable here (it would live in local memory, read back every chunk) */
            if (cf.stochastic) {
#pragma unroll 1
                for (int k = 0; k < 8; k += 2) {   /* two at a time, each pair stored: few registers */
                    float o0 = out[0], o1 = out[1];
#pragma unroll
                    for (int q = 2; q < 8; q += 2)
                        if (k == q) { o0 = out[q]; o1 = out[q + 1]; }
                    const uint16_t lo = msk_sr_16(o0, M.pdt == MS_DTYPE_BF16, (uint64_t)(M.e0 + e + k), cf.step,
                                                  (uint32_t)M.member, cf.k0, cf.k1);
                    const uint16_t hi = msk_sr_16(o1, M.pdt == MS_DTYPE_BF16, (uint64_t)(M.e0 + e + k + 1), cf.step,
                                                  (uint32_t)M.member, cf.k0, cf.k1);
                    reinterpret_cast<uint32_t *>(p + e)[k / 2] = (uint32_t)lo | ((uint32_t)hi << 16);
                }
            } else {
                uint32_t hw[4];
#pragma unroll
                for (int k = 0; k < 8; k += 2) {
                    const TP lo = msk_store_of<TP>::cvt(out[k]), hi = msk_store_of<TP>::cvt(out[k + 1]);
                    hw[k / 2] = (uint32_t)*reinterpret_cast<const uint16_t *>(&lo) |
                                ((uint32_t)*reinterpret_cast<const uint16_t *>(&hi) << 16);
                }
                *reinterpret_cast<uint4 *>(p + e) = make_uint4(hw[0], hw[1], hw[2], hw[3]);
            }
        }
    }
}

/* A CTA's band is worked on by ESPLIT CTAs at once (virtual thread vt = sub * T_SWEEP + t); chunk q of the
** segment goes to vt = q mod (ESPLIT T_SWEEP).  The fast path stages CPS chunks of G and p per thread and stage
** in a ring of ESTAGES (each thread reads back only what it copied: no barrier). */
/* make_cf() returns the step's coefficients (coefs_of); the pass calls it once its first copies are issued */
template <class TG, class TP, int KIND, int CAP, class CF>
__device__ __forceinline__ void elem_segment(const skargs<CAP> &A, const skmat &M, const skscr &S, int64_t r0,
                                             int64_t r1, bool rev, int sub, const CF &make_cf, double (&a)[3], char *smem)
{
    const int64_t vt = (int64_t)sub * T_SWEEP + threadIdx.x, VT = (int64_t)ESPLIT * T_SWEEP;
    const int64_t n = M.n;
    const bool unit = (A.flags & FL_UNIT) != 0;
    const TG *g = (const TG *)M.g;
    TP *p = (TP *)M.p;
    if (M.pvec) {   /* dense, aligned, n % 8 == 0: chunks of 8 elements of one row, staged by cp.async */
        constexpr int GW = sizeof(TG) == 4 ? 2 : 1, PW = sizeof(TP) == 4 ? 2 : 1;   /* 16-byte words a chunk */
        constexpr int CPS = (GW == 1 && PW == 1) ? 4 : 2;                             /* chunks a thread a stage */
        /* 32-bit chunk arithmetic (the host leaves pvec off for a matrix of 2^31 chunks or more) */
        const uint32_t cpr = (uint32_t)(n / 8), nch = (uint32_t)((r1 - r0) * cpr);
        const uint32_t per = (uint32_t)(CPS * VT), nst = (nch + per - 1) / per;
        const int64_t e_base = r0 * n;
        /* word w of stage s: slots + s * ESTAGE_BYTES + w * T_SWEEP * 16 */
        char *slots = smem + threadIdx.x * 16;
        /* A thread's chunks in walk order are q = vt, vt + VT, ... (stage st holds CPS of them); the work's walker
        ** follows the chunk ch (q, or nch - 1 - q when rev), its row, column and first element by additions */
        struct walker { int64_t e; int32_t row, col; uint32_t q; };
        const int32_t dr = (int32_t)((uint32_t)VT / cpr), dc = (int32_t)((uint32_t)VT % cpr);
        auto walk_start = [&]() {
            walker w;
            w.q = (uint32_t)vt;
            const uint32_t ch = rev ? nch - 1 - w.q : w.q;   /* (out of range when q >= nch: then never used) */
            w.row = (int32_t)(ch / cpr);
            w.col = (int32_t)(ch - (uint32_t)w.row * cpr);
            w.e = e_base + (int64_t)ch * 8;
            return w;
        };
        auto walk_next = [&](walker &w) {
            w.q += (uint32_t)VT;
            if (!rev) {
                w.col += dc;
                w.row += dr;
                if (w.col >= (int32_t)cpr) { w.col -= (int32_t)cpr; w.row++; }
                w.e += VT * 8;
            } else {
                w.col -= dc;
                w.row -= dr;
                if (w.col < 0) { w.col += (int32_t)cpr; w.row--; }
                w.e -= VT * 8;
            }
        };
        walker wc = walk_start();
        /* The copies of a stage: its chunk u lies u VT chunks past (before, when rev) its first one, so a copy's
        ** address is a stage base and a constant, with no walker or select per copy (the apply 0.5-1% faster,
        ** bench/RESULTS.md, twentieth session).  A copy of src-size 0 reads nothing, so its address may lie outside
        ** the matrix (compute-sanitizer's memcheck agrees). */
        int64_t ei = wc.e;
        uint32_t qi = wc.q;
        int istage = 0;
        auto issue = [&]() {
            char *sb = slots + istage * ESTAGE_BYTES;
            const TG *gs = g + ei;
            TP *ps = p + ei;
            auto stage_copies = [&](auto du) {
#pragma unroll
                for (int u = 0; u < CPS; u++) {
                    const int ok = qi + (uint32_t)(u * VT) < nch ? 16 : 0;
                    const int64_t d = decltype(du)::value * u * VT * 8;
#pragma unroll
                    for (int w = 0; w < GW; w++) cp16(sb + (u * (GW + PW) + w) * T_SWEEP * 16, gs + d + 4 * w, ok);
#pragma unroll
                    for (int w = 0; w < PW; w++) cp16(sb + (u * (GW + PW) + GW + w) * T_SWEEP * 16, ps + d + 4 * w, ok);
                }
            };
            if (rev) stage_copies(std::integral_constant<int, -1>());
            else stage_copies(std::integral_constant<int, 1>());
            ei += rev ? -(int64_t)CPS * VT * 8 : (int64_t)CPS * VT * 8;
            qi += (uint32_t)(CPS * VT);
            istage = istage + 1 == ESTAGES ? 0 : istage + 1;
        };
#pragma unroll 1
        for (int s = 0; s < ESTAGES - 1; s++) {
            if ((uint32_t)s < nst) issue();
            cp_commit();
        }
        /* the coefficients and column scales are loaded while the first stages are on their way */
        const coefs cf = make_cf();
        /* when a row's chunks divide the threads evenly, a thread's chunks are always the same columns: its 8
        ** column scales are loaded once */
        const bool ccol = !unit && VT % cpr == 0;
        float cfix[8];
#pragma unroll
        for (int k = 0; k < 8; k++) cfix[k] = 1.f;
        if (ccol) {
            const uint32_t vc = (uint32_t)(vt % cpr), jc = (rev ? cpr - 1 - vc : vc) * 8;
            load_c8(S.c + jc, cfix);
        }
        int cstage = 0;
#pragma unroll 1
        for (uint32_t st = 0; st < nst; st++) {
            if (st + ESTAGES - 1 < nst) issue();
            cp_commit();
            /* the chunks' row scales: loads from L1/L2 (a warp's lanes mostly share a row), issued before the wait
            ** so that they land with the stage (copied through the ring, they cost an LDGSTS and an LDS a chunk) */
            walker wu[CPS];
            float rrv[CPS];
#pragma unroll
            for (int u = 0; u < CPS; u++) {
                wu[u] = wc;
                rrv[u] = !unit && wc.q < nch ? __ldg(S.r + r0 + wc.row) : 1.f;
                walk_next(wc);
            }
            cp_wait<ESTAGES - 1>();
            const char *sb = slots + cstage * ESTAGE_BYTES;
            cstage = cstage + 1 == ESTAGES ? 0 : cstage + 1;
#pragma unroll
            for (int u = 0; u < CPS; u++) {
                const walker w0 = wu[u];
                if (w0.q >= nch) continue;
                const int64_t j = (int64_t)w0.col * 8;
                float cc[8], rr = 1.f;
                raw8<TG> gw;
                raw8<TP> pw;
#pragma unroll
                for (int w = 0; w < GW; w++) gw.w[w] = *(const uint4 *)(sb + (u * (GW + PW) + w) * T_SWEEP * 16);
#pragma unroll
                for (int w = 0; w < PW; w++) pw.w[w] = *(const uint4 *)(sb + (u * (GW + PW) + GW + w) * T_SWEEP * 16);
#pragma unroll
                for (int k = 0; k < 8; k++) cc[k] = cfix[k];
                if (!unit) {
                    rr = rrv[u];
                    if (!ccol) load_c8(S.c + j, cc);
                }
                elem_chunk<TG, TP, KIND>(gw, pw, rr, cc, cf, M, p, w0.e, a);
            }
        }
        cp_wait<0>();
        return;
    }
    /* any layout: element by element */
    const coefs cf = make_cf();
    const int64_t ne = (r1 - r0) * n, e_base = r0 * n;
#pragma unroll 1
    for (int64_t q = vt; q < ne; q += VT) {
        const int64_t el = rev ? ne - 1 - q : q, i = r0 + el / n, j = el - (i - r0) * n, e = e_base + el;
        const float gv = msk_f(g[i * M.rs + j * M.cs]);
        const float x = unit ? gv : __ldcg(S.r + i) * gv * __ldcg(S.c + j);
        const float v = elem_op<KIND>(msk_f(p[e]), x, cf, a);
        if (KIND == E_APPLY) store_p(p, e, v, cf, M);
    }
}

template <class TG, int KIND, int CAP, class CF>
__device__ __forceinline__ void elem_typed(const skargs<CAP> &A, const skmat &M, const skscr &S, int64_t r0, int64_t r1,
                                           bool rev, int sub, const CF &make_cf, double (&a)[3], char *smem)
{
    switch (M.pdt) {
    case MS_DTYPE_BF16: elem_segment<TG, __nv_bfloat16, KIND>(A, M, S, r0, r1, rev, sub, make_cf, a, smem); break;
    case MS_DTYPE_F16:  elem_segment<TG, __half, KIND>(A, M, S, r0, r1, rev, sub, make_cf, a, smem); break;
    default:            elem_segment<TG, float, KIND>(A, M, S, r0, r1, rev, sub, make_cf, a, smem); break;
    }
}

/* The step's coefficients for matrix M (moonstep.h, ms_sinkgd_step), in f64 as engine/cpu/sinkgd.c computes
** them; the sphere's radius is captured here (by the matrix's first CTA) when the stored one is negative. */
template <int CAP>
__device__ __forceinline__ coefs coefs_of(const skargs<CAP> &A, const skmat &M, const skscr &S, bool first_cta,
                                          float *t_sh)
{
    const double lr = msk_scalar_value(A.o.lr), eta = lr * M.scale;
    double dec = 1.0 - eta * A.o.weight_decay, coef = eta, fac = 1.0;
    if (A.o.mode == MS_SINKGD_SPECTRAL) {
        const double tau = A.o.target == MS_SINKGD_TARGET_MUON ? M.tau : 1.0;   /* the global matrix's */
        /* through L1 (written by the passes this one waited for, as r and c): every warp of every block of the
        ** flat apply reads it, and from L2 (ld.cg) they queued on one line -- a 14336 x 4096 apply 8 us longer
        ** than a base step's */
        coef = eta * tau / __ldg(S.scal + SC_SIGMA);
    } else if (A.o.mode == MS_SINKGD_SPHERE) {
        const double s0 = __ldcg(S.scal + SC_S0), s1 = __ldcg(S.scal + SC_S1), s2 = __ldcg(S.scal + SC_S2);
        /* one read per CTA (thread 0's), so the whole CTA takes the same branch */
        __syncthreads();
        if (threadIdx.x == 0) *t_sh = *(volatile float *)M.t;
        __syncthreads();
        double tt = *t_sh;
        if (tt < 0) {   /* not captured yet: every CTA computes the same f32 value; the first one stores it */
            const float tf = (float)sqrt(s0);
            if (first_cta && threadIdx.x == 0) *M.t = tf;
            tt = tf;
        }
        const double a = eta * tt / __ldcg(S.scal + SC_SIGMA);
        const double f = sqrt(clampd(s0 - 2 * a * s1 + a * a * s2, A.o.eps));
        dec = 1.0;
        coef = a;
        fac = tt / f;
    }
    coefs cf;
    cf.dhi = (float)dec;
    cf.dlo = (float)(dec - (double)cf.dhi);
    cf.co = (float)coef;
    cf.fa = (float)fac;
    cf.scaled = fac != 1.0;
    const double step = rint(msk_scalar_value(A.o.step));
    cf.stochastic = A.o.stochastic != 0;
    cf.k0 = (uint32_t)A.o.seed;
    cf.k1 = (uint32_t)(A.o.seed >> 32);
    cf.step = msk_step_word(step);
    return cf;
}

/* The persisted u of an unsharded spectral or sphere step, which its last power fold left to the apply
** (power_defers_u): the apply's CTA of band k of the matrix's nb stores the columns [k n / nb, (k + 1) n / nb),
** with NT threads -- u = w / sigma, or the kept u when w was 0, the bits fold_pass's walk would store. */
template <int NT>
__device__ __forceinline__ void store_deferred_u(const skmat &M, const skscr &S, int band)
{
    const int64_t j0 = band * M.n / M.nbands, j1 = (band + 1) * M.n / M.nbands;
    if (j0 >= j1) return;
    const double sigma = __ldcg(S.scal + SC_SIGMA), rs = __drcp_rn(sigma);
    const bool kept = __ldcg(S.scal + SC_WZERO) != 0;
    for (int64_t j = j0 + threadIdx.x; j < j1; j += NT)
        M.u[j] = kept ? __ldcg(S.uv + j) : u_of(__ldcg(S.wv + j), sigma, rs);
}
template <int CAP> __device__ __forceinline__ bool u_deferred(const skargs<CAP> &A)
{
    return A.o.mode != MS_SINKGD_BASE && A.xch == NULL;
}

template <int CAP, int KIND>
__global__ void __launch_bounds__(T_SWEEP, 1) elem_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    const skargs<CAP> &A = tables[flags];
    extern __shared__ __align__(16) char smem[];
    __shared__ double dred[WARPS];
    __shared__ int is_last;
    __shared__ float t_sh;
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;
    const int b = blockIdx.x / ESPLIT, sub = blockIdx.x % ESPLIT;
    const int64_t ga = range_start(b, A.gtot, A.grid), gb = range_start(b + 1, A.gtot, A.grid);
    const bool rev = (A.flags & FL_REV) != 0;
    const int i0 = mat_of_group(A, ga), i1 = mat_of_group(A, gb - 1);
    const int t = threadIdx.x;
    bool wait = true;
    for (int s = 0; s <= i1 - i0; s++) {
        const int i = rev ? i1 - s : i0 + s;
        const skmat &M = A.m[i];
        skscr S;
        scr_layout(M.scr, M.m, M.n, M.nbands, &S);
        int64_t sa, sb;
        if (!groups_in(A, i, ga, gb, sa, sb)) continue;
        const int64_t r0 = sa * M.GR, r1 = sb * M.GR < M.m ? sb * M.GR : M.m;
        const int band = b - M.band0;
        /* called once the segment's first copies of G and p are issued: the wait, then what the previous passes
        ** made (the coefficients; c and r right after) */
        auto make_cf = [&]() {
            if (wait) pdl_enter();
            wait = false;
            return KIND == E_APPLY ? coefs_of(A, M, S, band == 0 && sub == 0, &t_sh) : coefs{};
        };
        double a[3] = { 0, 0, 0 };
        switch (M.gdt) {
        case MS_DTYPE_BF16: elem_typed<__nv_bfloat16, KIND>(A, M, S, r0, r1, rev, sub, make_cf, a, smem); break;
        case MS_DTYPE_F16:  elem_typed<__half, KIND>(A, M, S, r0, r1, rev, sub, make_cf, a, smem); break;
        default:            elem_typed<float, KIND>(A, M, S, r0, r1, rev, sub, make_cf, a, smem); break;
        }
        if (KIND == E_SUMS) {   /* the band's sums; the matrix's last CTA (ticket) adds them in band order */
            for (int k = 0; k < 3; k++) {
                const double v = block_sum<T_SWEEP>(a[k], dred);
                if (t == 0) S.bsc[band * BSC + sub * 3 + k] = v;
            }
            __threadfence();
            __syncthreads();
            const unsigned nt = (unsigned)(M.nbands * ESPLIT);
            if (t == 0) is_last = nt == 1 || atomicInc(&A.tickets[i], nt - 1) == nt - 1;
            __syncthreads();
            if (is_last) {
                __threadfence();
                for (int k = 0; k < 3; k++) {
                    double v = 0;
                    for (int bb = t; bb < M.nbands; bb += T_SWEEP)
                        for (int u = 0; u < ESPLIT; u++) v += __ldcg(S.bsc + bb * BSC + u * 3 + k);
                    v = block_sum<T_SWEEP>(v, dred);
                    if (t == 0) S.scal[SC_S0 + k] = v;
                }
            }
            __syncthreads();
        }
    }
    if (wait) pdl_enter();
    /* the deferred u's slices, the call's matrices walked again: inside the loop above the store spilled the
    ** apply's registers */
    if (KIND == E_APPLY && sub == 0 && u_deferred(A))
        for (int i = i0; i <= i1; i++) {
            const skmat &M = A.m[i];
            int64_t sa, sb;
            if (!groups_in(A, i, ga, gb, sa, sb)) continue;
            skscr S;
            scr_layout(M.scr, M.m, M.n, M.nbands, &S);
            store_deferred_u<T_SWEEP>(M, S, b - M.band0);
        }
}

/* --- the flat apply ---------------------------------------------------------------------------------------
** flat_apply_kernel: the base and spectral apply of a chunk of at most SMALL_CAP matrices, all dense and aligned
** (pvec) and of one dtype pair, as a one-pass grid of FLAT_THREADS-thread blocks, each one batch of FLAT_CPT chunks
** a thread of a row group.  The launch table is the kernel's parameter (the constant bank): its short blocks start
** their loads without the chain of dependent table loads the ring's long-lived CTAs pay once each (with the table
** in global memory the same blocks were 2-7% slower than the ring; as a parameter the apply is 9-13% faster:
** bench/RESULTS.md, twenty-first session).  Block (s, b, k) takes part s of the k-th row group of sweep range b,
** k counted from the end the last sweep finished at, so the first blocks meet the rows it left in L2.
** The arithmetic is the ring's (elem_chunk): the same bits.  MOONSTEP_SINKGD_FLAT_APPLY = 0 keeps the ring. */
#define FLAT_THREADS 256
#define FLAT_CPT     2
#define FLAT_RANGES  1024   /* the most sweep ranges (CTAs of a pass) it takes */

/* the sweep ranges' first row groups, range_start's (its 64-bit divisions were ~100 of the ~250 instructions a
** block ran before its first load) */
struct flatranges { int32_t start[FLAT_RANGES + 1]; };

template <class TG, class TP>
__global__ void __launch_bounds__(FLAT_THREADS, 4) flat_apply_kernel(const __grid_constant__ skargs<SMALL_CAP> A,
                                                                     const __grid_constant__ flatranges R)
{
    const skargs<SMALL_CAP> &T = A;   /* (read in place: a reference keeps it in the parameter space) */
    if (T.o.skip.ptr && msk_scalar_value(T.o.skip) != 0) return;
    /* (blocks start in x, then y, then z order) */
    const unsigned part = blockIdx.x, b = blockIdx.y;
    const int k = (int)blockIdx.z, ga = R.start[b], gb = R.start[b + 1];
    if (k >= gb - ga) {
        pdl_enter();
        return;
    }
    const int64_t grp = (T.flags & FL_REV) ? gb - 1 - k : ga + k;
    const skmat &M = T.m[mat_of_group(T, grp)];
    const int64_t r0 = (grp - M.g0) * M.GR, r1 = r0 + M.GR < M.m ? r0 + M.GR : M.m;
    const uint32_t cpr = (uint32_t)(M.n / 8), q = part * (FLAT_CPT * FLAT_THREADS) + threadIdx.x;
    const uint32_t nch = (uint32_t)((r1 - r0) * cpr);
    const int64_t e0 = r0 * M.n;
    TP *const p = (TP *)M.p;
    raw8<TG> gw[FLAT_CPT];
    raw8<TP> pw[FLAT_CPT];
#pragma unroll
    for (int u = 0; u < FLAT_CPT; u++)
        if (q + u * FLAT_THREADS < nch) {
            gw[u] = ld8((const TG *)M.g + e0 + (int64_t)(q + u * FLAT_THREADS) * 8);
            pw[u] = ld8(p + e0 + (int64_t)(q + u * FLAT_THREADS) * 8);
        }
    /* G and p are the step's inputs; r, c and the coefficients are the earlier passes' */
    pdl_enter();
    skscr S;
    scr_layout(M.scr, M.m, M.n, M.nbands, &S);
    const coefs cf = coefs_of(T, M, S, false, NULL);
    /* the matrix's first row group in this sweep range, part 0, stores the range's slice of the deferred u (here,
    ** while the chunks' loads are in flight: at the end it lengthened the pass's tail by ~2 us) */
    if (part == 0 && u_deferred(T) && grp == (ga > M.g0 ? (int64_t)ga : M.g0)) store_deferred_u<FLAT_THREADS>(M, S, (int)b - M.band0);
    const bool unit = (T.flags & FL_UNIT) != 0;
    double none[3] = { 0, 0, 0 };
#pragma unroll
    for (int u = 0; u < FLAT_CPT; u++) {
        const uint32_t qu = q + u * FLAT_THREADS;
        if (qu >= nch) continue;
        const uint32_t row = qu / cpr, col = qu - row * cpr;
        float cc[8], rr = 1.f;
        if (unit) {
#pragma unroll
            for (int j = 0; j < 8; j++) cc[j] = 1.f;
        } else {
            rr = __ldg(S.r + r0 + row);
            load_c8(S.c + (int64_t)col * 8, cc);
        }
        elem_chunk<TG, TP, E_APPLY>(gw[u], pw[u], rr, cc, cf, M, p, e0 + (int64_t)qu * 8, none);
    }
}

/* --- sharded: the sphere sums' exchange -------------------------------------------------------------------
** X_PACK: each matrix's s0, s1, s2 (the E_SUMS pass's; zeros where this rank holds none of its rows) to
** A.xch[3 i + k].  X_UNPACK, after the ranks' sum: back into the matrix's scalars, and t captured from the global
** ||p||^2 as the apply would (the f32 sqrt(s0)), here, so that a rank without rows of the matrix stores it too. */
enum { X_PACK = 0, X_UNPACK = 1 };

template <int CAP, int OP>
__global__ void __launch_bounds__(256) sphere_xch_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    const skargs<CAP> &A = tables[flags];
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;
    double *xd = (double *)A.xch;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < A.nmat; i += gridDim.x * blockDim.x) {
        const skmat &M = A.m[i];
        skscr S;
        scr_layout(M.scr, M.m, M.n, M.nbands, &S);
        if (OP == X_PACK) {
            for (int k = 0; k < 3; k++) xd[3 * i + k] = M.nbands > 0 ? __ldcg(S.scal + SC_S0 + k) : 0.0;
        } else {
            for (int k = 0; k < 3; k++) S.scal[SC_S0 + k] = __ldcg(xd + 3 * i + k);
            if (*M.t < 0) *M.t = (float)sqrt(__ldcg(xd + 3 * i));
        }
    }
}

/* --- columns sharded ----------------------------------------------------------------------------------------
** A rank holds columns [off, off + n) of all m rows: a row's sums are split across the ranks, a column's are
** whole.  A group is one row (GR = 1), so a matrix's g0 is its first row among the chunk's, and the exchanges of
** row sums hold one value a row at A.xch[g0 + i]:
**   crow      a warp per row: S_i = sum_j (G_ij c_j)^2 (SINK, f32), or sum_j G_ij c_j u_j (POWER, f64; FL_UNIT:
**             also sum_j G_ij^2 at [gtot + g]; then per matrix this rank's part of ||u||^2, uu_at)
**   crow_fin  r_i <- sqrt(n) r_i / max(r_i sqrt(S_i), eps) from the ranks' sums (S_i = 0 keeps r_i)
**   ccol      a block per 32 columns of a matrix, its 8 warps splitting the rows: T_j = sum_i (r_i G_ij)^2 and c
**             as the fold makes it (SINK), or w_j = c_j sum_i (r v)_i G_ij / max(||v||, eps) and the block's part
**             of ||w||^2 (POWER)
**   cvec      one block a matrix, the power step's vector work around its exchanges (below)
**   capply    the apply over a CTA's rows; the stochastic rounding keyed by the element's global index */

#define CROW_WARPS 8

/* the POWER row exchange's per-matrix ||u||^2 parts, after the rows' sums (and ||G||^2's when FL_UNIT) */
template <int CAP> __device__ __forceinline__ int64_t uu_at(const skargs<CAP> &A, bool unit)
{
    return A.gtot * (unit ? 2 : 1);
}

template <class T, int KIND>
__device__ __forceinline__ float2 crow_sums(const skmat &M, const skscr &S, int64_t row, bool first, bool unit)
{
    const T *g = (const T *)M.g + row * M.rs;
    float s = 0, f = 0;
    for (int64_t j = threadIdx.x & 31; j < M.n; j += 32) {
        const float x = msk_f(g[j * M.cs]);
        if (KIND == K_SINK) {
            const float y = x * (first ? 1.f : __ldcg(S.c + j));
            s = fmaf(y, y, s);
        } else {
            s = fmaf(x, (unit ? 1.f : __ldcg(S.c + j)) * __ldcg(S.uv + j), s);
            if (unit) f = fmaf(x, x, f);
        }
    }
    s = warp_sum(s);
    if (KIND == K_POWER && unit) f = warp_sum(f);
    return make_float2(s, f);
}

template <int CAP, int KIND>
__global__ void __launch_bounds__(CROW_WARPS * 32) crow_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    const skargs<CAP> &A = tables[flags];
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;
    const bool first = (A.flags & FL_FIRST) != 0, unit = (A.flags & FL_UNIT) != 0, redo = (A.flags & FL_REDO) != 0;
    const int64_t stride = (int64_t)gridDim.x * CROW_WARPS;
    /* the loop is warp-uniform: every lane of a warp takes the same rows (the butterfly needs all 32) */
    for (int64_t g = (int64_t)blockIdx.x * CROW_WARPS + (threadIdx.x >> 5); g < A.gtot; g += stride) {
        const int i = mat_of_group(A, g);
        const skmat &M = A.m[i];
        skscr S;
        scr_layout(M.scr, M.m, M.n, M.nbands, &S);
        if (KIND == K_POWER && redo && __ldcg(S.scal + SC_REDO) == 0) continue;
        const int64_t row = g - M.g0;
        float2 r;
        switch (M.gdt) {
        case MS_DTYPE_BF16: r = crow_sums<__nv_bfloat16, KIND>(M, S, row, first, unit); break;
        case MS_DTYPE_F16:  r = crow_sums<__half, KIND>(M, S, row, first, unit); break;
        default:            r = crow_sums<float, KIND>(M, S, row, first, unit); break;
        }
        if ((threadIdx.x & 31) != 0) continue;
        if (KIND == K_SINK) {
            ((float *)A.xch)[g] = r.x;
        } else {
            double *xd = (double *)A.xch;
            xd[g] = r.x;
            if (unit) xd[A.gtot + g] = r.y;
            if (row == 0) xd[uu_at(A, unit) + i] = __ldcg(S.scal + SC_UUL);
        }
    }
}

template <int CAP>
__global__ void __launch_bounds__(256) crow_fin_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    const skargs<CAP> &A = tables[flags];
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;
    const bool first = (A.flags & FL_FIRST) != 0;
    const float eps = (float)A.o.eps;
    const float *xs = (const float *)A.xch;
    for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < A.gtot; g += (int64_t)gridDim.x * blockDim.x) {
        const skmat &M = A.m[mat_of_group(A, g)];
        skscr S;
        scr_layout(M.scr, M.m, M.n, M.nbands, &S);
        const int64_t row = g - M.g0;
        const float ps = __ldcg(xs + g), rold = first ? 1.f : S.r[row];
        S.r[row] = sinkhorn_scale(ps, rold, M.root, eps);
    }
}

/* column j's sum over the rows taken by this warp (rows warp, warp + 8, ...) */
template <class T, int KIND>
__device__ __forceinline__ float ccol_sum(const skmat &M, const skscr &S, const float *rv, int64_t j)
{
    const T *g = (const T *)M.g + j * M.cs;
    float s = 0;
    for (int64_t i = threadIdx.x >> 5; i < M.m; i += FOLD_THREADS / 32) {
        const float x = msk_f(g[i * M.rs]);
        if (KIND == K_SINK) {
            const float y = __ldcg(S.r + i) * x;
            s = fmaf(y, y, s);
        } else {
            s = fmaf(__ldcg(rv + i), x, s);
        }
    }
    return s;
}

template <int CAP, int KIND>
__global__ void __launch_bounds__(FOLD_THREADS) ccol_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    const skargs<CAP> &A = tables[flags];
    __shared__ float sm[FOLD_THREADS / 32][FOLD_COLS];
    __shared__ double dred[FOLD_THREADS / 32];
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;
    const int blk = blockIdx.x, i = mat_of_fold(A, blk);
    const skmat &M = A.m[i];
    skscr S;
    scr_layout(M.scr, M.m, M.n, M.nbands, &S);
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int64_t n = M.n;
    const int lbk = blk - M.f0;
    const int64_t j0 = (int64_t)lbk * FOLD_COLS, jl = j0 + lane;
    const bool unit = (A.flags & FL_UNIT) != 0;
    const float eps = (float)A.o.eps;

    float s = 0;
    if (jl < n) {
        const float *rv = A.rvb + M.g0;
        switch (M.gdt) {
        case MS_DTYPE_BF16: s = ccol_sum<__nv_bfloat16, KIND>(M, S, rv, jl); break;
        case MS_DTYPE_F16:  s = ccol_sum<__half, KIND>(M, S, rv, jl); break;
        default:            s = ccol_sum<float, KIND>(M, S, rv, jl); break;
        }
    }
    sm[warp][lane] = s;
    __syncthreads();
    const int64_t j = j0 + t;
    const bool jv = t < FOLD_COLS && j < n;
    float T2 = 0;
    if (jv)
#pragma unroll
        for (int w = 0; w < FOLD_THREADS / 32; w++) T2 += sm[w][t];

    double q = 0;
    if (KIND == K_SINK) {
        if (jv) {
            const float c_old = (A.flags & FL_FIRST) ? 1.f : S.c[j];
            const float cn = sink_column(c_old, T2, sqrtf((float)M.m), eps);
            S.c[j] = cn;
            q = (double)cn * cn * T2;
        }
        if (!(A.flags & FL_LAST)) return;
    } else if (jv) {
        const float w = (float)((double)(unit ? 1.f : S.c[j]) * T2 / clampd(__ldcg(S.scal + SC_NV), A.o.eps));
        S.wv[j] = w;
        q = (double)w * w;
    }
    q = block_sum<FOLD_THREADS>(q, dred);   /* SINK: ||X||_F^2 by columns; POWER: ||w||^2 */
    if (t == 0) S.fsc[lbk] = q;
}

/* The power step's vector work of one matrix (a block each), around the exchanges of the cols-sharded sequence:
**   CV_PREP   before:  is this rank's slice of u nonzero; its part of ||X||_F^2 (the last SINK ccol's sums)
**   CV_START  after:   u (its first value, at global indices, when every rank's slice is zero), as prep_kernel
**   CV_V      after the POWER rows' exchange: v = r (X u partials summed), ||v||, the restart test on the global
**             sums (every rank takes the same branch), r v for ccol
**   CV_W      before:  this rank's part of ||w||^2
**   CV_U      after:   sigma, u = w / sigma (kept when w = 0), this rank's part of ||u||^2; FL_LAST stores u */
enum { CV_PREP = 0, CV_START, CV_V, CV_W, CV_U };

template <int CAP, int OP>
__global__ void __launch_bounds__(PREP_THREADS) cvec_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    const skargs<CAP> &A = tables[flags];
    __shared__ double dred[PREP_THREADS / 32];
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;
    const int i = blockIdx.x, t = threadIdx.x;
    const skmat &M = A.m[i];
    skscr S;
    scr_layout(M.scr, M.m, M.n, M.nbands, &S);
    const int64_t m = M.m, n = M.n, off = A.cols[i].off;
    const int nf = (int)nfold_of(n);
    const bool unit = (A.flags & FL_UNIT) != 0;
    double *xd = (double *)A.xch;

    if (OP == CV_PREP) {
        int nonzero = 0;
        for (int64_t j = t; j < n; j += PREP_THREADS) nonzero |= M.u[j] != 0;   /* NaN counts as nonzero */
        nonzero = __syncthreads_or(nonzero);
        double f2 = 0;
        if (!unit) {
            for (int k = t; k < nf; k += PREP_THREADS) f2 += __ldcg(S.fsc + k);
            f2 = block_sum<PREP_THREADS>(f2, dred);
        }
        if (t == 0) {
            xd[2 * i] = nonzero ? 1 : 0;
            xd[2 * i + 1] = f2;
        }
    } else if (OP == CV_START) {
        const bool zero = __ldcg(xd + 2 * i) == 0;
        double uu = 0;
        for (int64_t j = t; j < n; j += PREP_THREADS) {
            const float u = zero ? u_start(A.o.seed, M.b, off + j) : M.u[j];
            S.uv[j] = u;
            uu += (double)u * u;
        }
        uu = block_sum<PREP_THREADS>(uu, dred);
        if (t == 0) {
            S.scal[SC_F2] = __ldcg(xd + 2 * i + 1);
            S.scal[SC_UUL] = uu;
            S.scal[SC_SIGMA] = A.o.eps;
            S.scal[SC_RESTARTED] = zero ? 1 : 0;
            S.scal[SC_REDO] = 0;
        }
    } else if (OP == CV_V) {
        if ((A.flags & FL_REDO) && __ldcg(S.scal + SC_REDO) == 0) return;   /* no restart pending */
        /* read before the sums' barriers; thread 0 writes after them */
        const double restarted = __ldcg(S.scal + SC_RESTARTED), f2s = __ldcg(S.scal + SC_F2);
        const double *vs = xd + M.g0;
        double nv2 = 0, ff = 0;
        for (int64_t r = t; r < m; r += PREP_THREADS) {
            const float v = (unit ? 1.f : S.r[r]) * (float)__ldcg(vs + r);
            nv2 += (double)v * v;
            if (unit) ff += __ldcg(vs + A.gtot + r);
        }
        nv2 = block_sum<PREP_THREADS>(nv2, dred);
        if (unit) ff = block_sum<PREP_THREADS>(ff, dred);
        const double nv = sqrt(nv2), f2 = unit ? ff : f2s, uu = __ldcg(xd + uu_at(A, unit) + i);
        if (restarted == 0 && f2 > 0 && nv <= U_DEGENERATE * sqrt(f2) * sqrt(uu)) {
            for (int64_t j = t; j < n; j += PREP_THREADS) S.uv[j] = u_start(A.o.seed, M.b, off + j);
            if (t == 0) {
                S.scal[SC_RESTARTED] = 1;
                S.scal[SC_REDO] = 1;
            }
            return;
        }
        float *rv = A.rvb + M.g0;
        for (int64_t r = t; r < m; r += PREP_THREADS) {
            const float rr = unit ? 1.f : S.r[r];
            rv[r] = rr * (rr * (float)__ldcg(vs + r));
        }
        if (t == 0) {
            S.scal[SC_NV] = nv;
            S.scal[SC_REDO] = 0;
        }
    } else if (OP == CV_W) {
        double w2 = 0;
        for (int k = t; k < nf; k += PREP_THREADS) w2 += __ldcg(S.fsc + k);
        w2 = block_sum<PREP_THREADS>(w2, dred);
        if (t == 0) xd[i] = w2;
    } else {
        const double nw = sqrt(__ldcg(xd + i)), sigma = clampd(nw, A.o.eps);
        const bool store = (A.flags & FL_LAST) && M.u;
        double uu = 0;
        for (int64_t j = t; j < n; j += PREP_THREADS) {
            float u = S.uv[j];
            if (nw != 0) {   /* X^T v = 0 keeps u, so no later step starts from a zero vector */
                u = (float)(__ldcg(S.wv + j) / sigma);
                S.uv[j] = u;
            }
            uu += (double)u * u;
            if (store) M.u[j] = u;
        }
        uu = block_sum<PREP_THREADS>(uu, dred);
        if (t == 0) {
            S.scal[SC_SIGMA] = sigma;
            S.scal[SC_UUL] = uu;
        }
    }
}

/* rows [r0, r1) of a cols-sharded matrix: p <- (p dec - coef X) fac, the counter of element (i, j) e0 + i ng + j */
template <class TG, class TP>
__device__ __forceinline__ void capply_rows(const skmat &M, const skscr &S, int64_t ng, int64_t r0, int64_t r1,
                                            bool unit, const coefs &cf)
{
    const TG *g = (const TG *)M.g;
    TP *p = (TP *)M.p;
    const int64_t n = M.n;
    double none[3];
    for (int64_t i = r0; i < r1; i++) {
        const float ri = unit ? 1.f : __ldcg(S.r + i);
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            const float gv = msk_f(g[i * M.rs + j * M.cs]);
            const float x = unit ? gv : ri * gv * __ldcg(S.c + j);
            const int64_t e = i * n + j;
            const float v = elem_op<E_APPLY>(msk_f(p[e]), x, cf, none);
            if (sizeof(TP) == 2 && cf.stochastic)
                reinterpret_cast<uint16_t *>(p)[e] = msk_sr_16(v, M.pdt == MS_DTYPE_BF16, (uint64_t)(M.e0 + i * ng + j),
                                                               cf.step, (uint32_t)M.member, cf.k0, cf.k1);
            else
                p[e] = msk_store_of<TP>::cvt(v);
        }
    }
}

template <class TG>
__device__ __forceinline__ void capply_typed(const skmat &M, const skscr &S, int64_t ng, int64_t r0, int64_t r1,
                                             bool unit, const coefs &cf)
{
    switch (M.pdt) {
    case MS_DTYPE_BF16: capply_rows<TG, __nv_bfloat16>(M, S, ng, r0, r1, unit, cf); break;
    case MS_DTYPE_F16:  capply_rows<TG, __half>(M, S, ng, r0, r1, unit, cf); break;
    default:            capply_rows<TG, float>(M, S, ng, r0, r1, unit, cf); break;
    }
}

template <int CAP>
__global__ void __launch_bounds__(T_SWEEP) capply_kernel(const skargs<CAP> *__restrict__ tables, int flags)
{
    const skargs<CAP> &A = tables[flags];
    __shared__ float t_sh;
    if (A.o.skip.ptr && msk_scalar_value(A.o.skip) != 0) return;
    const int64_t ga = range_start(blockIdx.x, A.gtot, A.grid), gb = range_start(blockIdx.x + 1, A.gtot, A.grid);
    const int i0 = mat_of_group(A, ga), i1 = mat_of_group(A, gb - 1);
    const bool unit = (A.flags & FL_UNIT) != 0;
    for (int i = i0; i <= i1; i++) {
        const skmat &M = A.m[i];
        skscr S;
        scr_layout(M.scr, M.m, M.n, M.nbands, &S);
        int64_t r0, r1;   /* (GR = 1: groups are rows) */
        if (!groups_in(A, i, ga, gb, r0, r1)) continue;
        const coefs cf = coefs_of(A, M, S, false, &t_sh);   /* (t was captured by the sphere's unpack) */
        const int64_t ng = A.cols[i].ng;
        switch (M.gdt) {
        case MS_DTYPE_BF16: capply_typed<__nv_bfloat16>(M, S, ng, r0, r1, unit, cf); break;
        case MS_DTYPE_F16:  capply_typed<__half>(M, S, ng, r0, r1, unit, cf); break;
        default:            capply_typed<float>(M, S, ng, r0, r1, unit, cf); break;
        }
    }
}

/* A plain struct of 16-byte words copied to device memory (the cols-sharded side table). */
template <class T>
__global__ void __launch_bounds__(256) blob_kernel(const __grid_constant__ T src, T *dst)
{
    const uint4 *s = reinterpret_cast<const uint4 *>(&src);
    uint4 *d = reinterpret_cast<uint4 *>(dst);
    for (size_t w = threadIdx.x; w < sizeof(T) / 16; w += blockDim.x) d[w] = s[w];
}

/* --- planning and launching (host) ---------------------------------------------------------------------- */

static int dtype_size(int dt) { return dt == MS_DTYPE_F32 ? 4 : 2; }

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* The current device and its slot in the per-device caches below (a device past the 64th shares slot 0). */
static int device_slot(int *dev)
{
    *dev = 0;
    cudaGetDevice(dev);
    return *dev >= 0 && *dev < 64 ? *dev : 0;
}

/* The shared-memory limit raised once for each sweep kernel, and the CTAs a pass launches: one per SM times
** the sweep's occupancy (1), cached per device. */
template <int CAP, int KIND> static cudaError_t sweep_setup()
{
    static bool done[64];
    int dev;
    const int slot = device_slot(&dev);
    if (done[slot]) return cudaSuccess;
    cudaError_t e = cudaFuncSetAttribute(sweep_kernel<CAP, KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize, SWEEP_SMEM);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(sweep_kernel<CAP, KIND, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, SWEEP_SMEM);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(wide_kernel<CAP, KIND, WIDE_PASS_ROWS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 SWEEP_SMEM);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(pair_kernel<CAP, KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize, PAIR_SMEM);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(elem_kernel<CAP, KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize, ELEM_SMEM);
    if (e == cudaSuccess) done[slot] = true;
    return e;
}

static int ctas_per_pass()
{
    static int cache[64];
    int dev;
    const int slot = device_slot(&dev);
    if (cache[slot] == 0) {
        int sms = 0, occ = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) sms = 132;
        if (sweep_setup<MSK_SINKGD_CAP, K_SINK>() != cudaSuccess ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, sweep_kernel<MSK_SINKGD_CAP, K_SINK>, T_SWEEP,
                                                          SWEEP_SMEM) != cudaSuccess || occ <= 0)
            occ = 1;
        (void)cudaGetLastError();
        cache[slot] = sms * occ;
    }
    return cache[slot];
}

/* The device's L2 bytes (cached per device; 50 MB when the query fails). */
static int64_t l2_bytes()
{
    static int64_t cache[64];
    int dev;
    const int slot = device_slot(&dev);
    if (cache[slot] == 0) {
        int l2 = 0;
        if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) != cudaSuccess || l2 <= 0) l2 = 50 << 20;
        (void)cudaGetLastError();
        cache[slot] = l2;
    }
    return cache[slot];
}

/* A pass ends with its slowest CTA, and the sweeps of different row widths stream at different speeds (on an
** H200 a 4096 x 14336 step takes ~9% longer than a 14336 x 4096 one: its row lanes are 14 warps, one row a
** group).  So in a call that mixes them, the CTAs whose ranges hold the slower rows held every pass back: the
** Llama-3-8B set ran 30.9-31.2 ms as one launch sequence, 29.1-29.9 with its 32 down projections (n = 14336) in
** a sequence of their own, and 29.2-29.3 with every shape in its own (bench/RESULTS.md, tenth session).  A class
** is the matrices of one row width and grad dtype; one with SPLIT_BYTES of G or more runs in launch sequences of
** its own (a sequence adds a table write and a dozen pass boundaries: small classes stay together).
** MOONSTEP_SINKGD_SPLIT = bytes sets the threshold (tests; read per call). */
#define SPLIT_BYTES ((int64_t)1 << 30)

static int64_t split_bytes()
{
    const char *v = getenv("MOONSTEP_SINKGD_SPLIT");
    const long long b = v ? atoll(v) : 0;
    return b > 0 ? (int64_t)b : SPLIT_BYTES;
}

/* Calls f(cnt, matrices) for the launch chunks of an unsharded call: each class of SPLIT_BYTES or more (above),
** in the order of their first matrices, then the rest, each in the call's order, in chunks of at most
** MSK_SINKGD_CAP.  false when there was no host memory to reorder them. */
template <class F> static bool for_chunks(int n, const msk_sinkgd_mat *m, F f)
{
    /* rank[k]: the index of the first matrix of k's class when that class runs on its own, else n (the rest) */
    int *rank = new (std::nothrow) int[n], *idx = new (std::nothrow) int[n];
    int64_t *bytes = new (std::nothrow) int64_t[n];
    msk_sinkgd_mat *order = new (std::nothrow) msk_sinkgd_mat[n];
    const bool ok = rank && idx && bytes && order;
    if (ok) {
        for (int k = 0; k < n; k++) {
            rank[k] = k;
            for (int j = 0; j < k; j++)
                if (m[j].n == m[k].n && m[j].gdt == m[k].gdt) {
                    rank[k] = rank[j];
                    break;
                }
            bytes[k] = 0;
            idx[k] = k;
        }
        for (int k = 0; k < n; k++) bytes[rank[k]] += m[k].m * m[k].n * dtype_size(m[k].gdt);
        const int64_t limit = split_bytes();
        for (int k = 0; k < n; k++)
            if (bytes[rank[k]] < limit) rank[k] = n;
        std::stable_sort(idx, idx + n, [&](int a, int b) { return rank[a] < rank[b]; });
        for (int k = 0; k < n; k++) order[k] = m[idx[k]];
        for (int first = 0; first < n;) {
            int cnt = 1;
            while (first + cnt < n && cnt < MSK_SINKGD_CAP && rank[idx[first + cnt]] == rank[idx[first]]) cnt++;
            f(cnt, order + first);
            first += cnt;
        }
    }
    delete[] rank;
    delete[] idx;
    delete[] bytes;
    delete[] order;
    return ok;
}

static int pow2ceil(int x)
{
    int p = 1;
    while (p < x) p <<= 1;
    return p;
}

/* The thread map, groups and bands of matrices [0, cnt) of mm for one launch sequence on `maxgrid` CTAs;
** scratch laid out from `base` (NULL: sizes only).  Returns the scratch bytes.  dim: a sharded run's
** (MSK_SHARD_ROWS: a slice may have no rows, and then no groups or bands; MSK_SHARD_COLS: a group is a row and
** nothing is swept), 0 otherwise. */
static int64_t plan_chunk(int cnt, const msk_sinkgd_mat *mm, int maxgrid, char *base, skmat *out, int64_t *gtot_out,
                          int *grid_out, int *nfold_out, int dim = 0)
{
    /* Measured on an H200: when the chunk's G fits in L2, its passes after the first read it from there and are
    ** bound by latency, and K = 2 (2 rows a group) was 7-20% faster; streamed from DRAM, K = 4 (fewer row
    ** reductions) won on the Llama-3-8B set by ~2% (31.2 against 31.8 ms), though K = 2 won on one 14336 x 4096
    ** (5%).  (Measured when K = 4 kept packed words; both keep G^2 now.)  Re-measured (twenty-second session): K = 2
    ** still loses on the set (+3.7%) and wins in base steps of calls of a few streamed matrices (14336 x 4096 -1.4%,
    ** 4 x 14336 x 4096 -1.0%, 16 x 1024 x 4096 -1.5%; their spectral steps within +-1.5%), so a chunk of at most
    ** SMALL_CAP matrices of 16-bit G takes K = 2 too (f32 G, not measured, keeps K = 4). */
    int64_t gbytes = 0;
    for (int k = 0; k < cnt; k++) gbytes += mm[k].m * mm[k].n * dtype_size(mm[k].gdt);
    const bool in_l2 = gbytes <= l2_bytes();
    /* MOONSTEP_SINKGD_K = 2 or 4 forces the choice (tests and measurements; read per plan) */
    const char *kv = getenv("MOONSTEP_SINKGD_K");
    const int kforce = kv && (kv[0] == '2' || kv[0] == '4') && kv[1] == 0 ? kv[0] - '0' : 0;
    /* MOONSTEP_SINKGD_PAIR = 0 sends the pair path's rows to the wide path's passes (tests and measurements) */
    const char *pv = getenv("MOONSTEP_SINKGD_PAIR");
    const bool pairs = !(pv && pv[0] == '0' && pv[1] == 0);
    int64_t g0 = 0;
    for (int k = 0; k < cnt; k++) {
        const msk_sinkgd_mat &a = mm[k];
        skmat &x = out[k];
        x = skmat();
        x.g = a.g;
        x.p = a.p;
        x.u = a.u;
        x.t = a.t;
        x.m = a.m;
        x.n = a.n;
        x.rs = a.rs;
        x.cs = a.cs;
        x.e0 = a.e0;
        x.b = a.b;
        x.scale = a.scale;
        /* the global matrix's dims: a sharded slice's, else this matrix's (host sqrt and division are IEEE, as
        ** the device's: the same bits the kernels computed from m and n) */
        const int64_t gm = a.mg > 0 ? a.mg : a.m, gn = a.ng > 0 ? a.ng : a.n;
        x.tau = sqrt((double)gm / (double)gn);
        x.root = dim == MSK_SHARD_ROWS ? sqrtf((float)gm) : dim == MSK_SHARD_COLS ? sqrtf((float)gn) : 0.f;
        x.member = a.member;
        x.gdt = a.gdt;
        x.pdt = a.pdt;
        const int es = dtype_size(a.gdt), E = 16 / es;
        const bool dense = a.cs == 1 && (a.rs == a.n || a.m == 1);
        const bool streamable = dim != MSK_SHARD_COLS && dense && aligned16(a.g) && a.n % E == 0;
        /* the fast path's rows: 4 chunks a thread a row (32 elements of 16 bits), 8 for f32 (32 elements too) */
        const int64_t fast_chunks = (es == 4 ? 8 : 4) * (int64_t)T_SWEEP;
        /* 32-bit rows: the walk's row indices reach m + GR - 2 (GR <= 4 T_SWEEP rows a group) */
        const bool rows32 = a.m < INT32_MAX - 4 * T_SWEEP;
        x.fast = streamable && a.n / E <= fast_chunks && rows32;
        x.wide = !streamable || a.n / E <= fast_chunks ? WIDE_NO
                 : pairs && es == 2 && a.n / E <= 2 * fast_chunks && rows32 ? WIDE_PAIR
                                                                                    : WIDE_PASSES;
        x.pvec = dense && aligned16(a.g) && aligned16(a.p) && a.n > 0 && a.n % 8 == 0 &&
                 a.m * a.n / 8 < ((int64_t)1 << 31);
        if (dim == MSK_SHARD_COLS) {
            x.GR = 1;   /* the cols passes' exchanges hold a value a row */
        } else if (x.wide == WIDE_PAIR) {   /* a half row's K = 4 map: one lane, a row a group */
            const int half = (int)((a.n / E + 1) / 2), cp = (half + 3) / 4;
            x.K = 4;
            x.Cp = (int16_t)((cp + 31) / 32 * 32);
            x.P = 1;
            x.GR = 1;
        } else if (x.fast) {
            /* 4 chunks (32 bf16 or 16 f32 elements) of a thread per group whenever the row has 4 chunks: the row's
            ** reduction and scale update are paid once per 32 elements, not per 8.  When G fits in L2 or the chunk
            ** is small and 16-bit (above), rows of at most 2 T_SWEEP chunks take them as 2 chunks of 2 rows (K = 2). */
            const int C = (int)(a.n / E);
            if (C > 4 * T_SWEEP) {   /* f32 rows of 2049-4096 chunks: 8 a thread, over two stages */
                const int cp = (C + 7) / 8;
                x.K = 8;
                x.Cp = (int16_t)((cp + 31) / 32 * 32);
            } else if (C >= 4) {
                const bool k2 = in_l2 || (cnt <= SMALL_CAP && es == 2);
                const int k = (kforce ? kforce == 2 : k2) && C <= 2 * T_SWEEP ? 2 : 4, cp = (C + k - 1) / k;
                x.K = (int8_t)k;
                x.Cp = (int16_t)(cp <= 32 ? pow2ceil(cp) : (cp + 31) / 32 * 32);
            } else {
                x.K = 1;
                x.Cp = (int16_t)pow2ceil(C);
            }
            x.P = (int16_t)(T_SWEEP / x.Cp);
            x.GR = (int16_t)(x.P * (x.K > SLOTS ? 1 : SLOTS / x.K));
        } else {
            int64_t rows = GROUP_BYTES / (a.n * es);
            x.GR = (int16_t)(rows < 1 ? 1 : rows > 1024 ? 1024 : rows);
        }
        x.g0 = g0;
        g0 += (a.m + x.GR - 1) / x.GR;
    }
    const int64_t gtot = g0;
    int grid = (int)(gtot < maxgrid ? gtot : maxgrid);
    /* Matrices of equal group counts (experts, a stack of layers): cnt * q CTAs with q = maxgrid / cnt give every
    ** matrix q whole ranges, so no CTA's range crosses from one matrix into the next (a CTA that does pays a
    ** second ring start and a second epilogue, and the pass waits for it), whenever that costs no CTA a group
    ** more than the even split does.  8 x 1408 x 2048: 128 CTAs of 11 groups, not 132 of 10 or 11 and 8 of
    ** them crossing. */
    if (cnt > 1 && dim != MSK_SHARD_COLS && grid == maxgrid) {
        const int64_t gm = out[1].g0 - out[0].g0;
        bool equal = gm > 0;
        for (int k = 1; k < cnt && equal; k++) equal = (k + 1 < cnt ? out[k + 1].g0 : gtot) - out[k].g0 == gm;
        const int q = maxgrid / cnt;
        if (equal && q >= 1 && (gm + q - 1) / q <= (gtot + maxgrid - 1) / maxgrid) grid = cnt * q;
    }
    /* the CTA whose range holds group x: the last b with range_start(b) <= x */
    auto cta_of = [&](int64_t x) {
        int64_t b = ((x + 1) * grid - 1) / gtot;
        while (b + 1 < grid && range_start(b + 1, gtot, grid) <= x) b++;
        while (b > 0 && range_start(b, gtot, grid) > x) b--;
        return (int)b;
    };
    int64_t bytes = 0;
    int nfold = 0;
    for (int k = 0; k < cnt; k++) {
        skmat &x = out[k];
        const int64_t last = (k + 1 < cnt ? out[k + 1].g0 : gtot) - 1;
        if (last < x.g0) {   /* a sharded rank's slice without rows: no CTA visits it */
            x.band0 = 0;
            x.nbands = 0;
        } else {
            x.band0 = cta_of(x.g0);
            x.nbands = cta_of(last) - x.band0 + 1;
        }
        x.f0 = nfold;
        nfold += (int)nfold_of(x.n);
        x.scr = base ? base + bytes : NULL;
        bytes += scr_layout(NULL, x.m, x.n, x.nbands, NULL);
    }
    *gtot_out = gtot;
    *grid_out = grid;
    *nfold_out = nfold;
    return bytes;
}

/* The launch tables live in the scratch, one per flags value a launch uses (FL_* < 32), written by one kernel
** a step: a table of many matrices is ~30 KB, and as a kernel parameter it would be copied again for each of a
** step's ~12 launches -- in a captured graph, on every replay (~10 us each). */
enum { TABLE_SLOTS = 32 };

template <int CAP>
__global__ void __launch_bounds__(256) table_kernel(const __grid_constant__ skargs<CAP> A, skargs<CAP> *tables,
                                                    unsigned used)
{
    const int slot = blockIdx.x;
    if (!((used >> slot) & 1u)) return;
    const uint4 *src = reinterpret_cast<const uint4 *>(&A);
    uint4 *dst = reinterpret_cast<uint4 *>(tables + slot);
    for (size_t w = threadIdx.x; w < sizeof(skargs<CAP>) / 16; w += blockDim.x) dst[w] = src[w];
    __syncthreads();
    if (threadIdx.x == 0) tables[slot].flags = slot;
}

static_assert(sizeof(skargs<MSK_SINKGD_CAP>) % 16 == 0 && sizeof(skargs<SMALL_CAP>) % 16 == 0,
              "launch tables are copied in 16-byte words");

static size_t table_bytes() { return TABLE_SLOTS * sizeof(skargs<MSK_SINKGD_CAP>); }


/* One launch of kernel K with the table of the given flags. */
/* a launch of K(args...) on s; with pdl, a programmatic dependent launch (pdl_enter): it overlaps the previous
** pass's tail; with pairs, clusters of 2 CTAs (pair_kernel) */
template <class... P, class... Args>
static ms_status launch(ms_ctx *ctx, cudaStream_t s, void (*K)(P...), dim3 grid, unsigned threads, size_t smem,
                        const char *what, int *launches, bool pdl, bool pairs, Args... args)
{
    if (pdl || pairs) {
        cudaLaunchAttribute at[2];
        unsigned na = 0;
        if (pdl) {
            at[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[na++].val.programmaticStreamSerializationAllowed = 1;
        }
        if (pairs) {
            at[na].id = cudaLaunchAttributeClusterDimension;
            at[na].val.clusterDim.x = 2;
            at[na].val.clusterDim.y = 1;
            at[na++].val.clusterDim.z = 1;
        }
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid;
        cfg.blockDim = dim3(threads);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = s;
        cfg.attrs = at;
        cfg.numAttrs = na;
        const cudaError_t e = cudaLaunchKernelEx(&cfg, K, args...);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            return ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda %s: kernel launch failed: %s (%s)", what,
                               cudaGetErrorName(e), cudaGetErrorString(e));
        }
    } else {
        K<<<grid, threads, smem, s>>>(args...);
    }
    MSK_CHECK_LAUNCH(ctx, what);
    ++*launches;
    return MS_OK;
}

/* whether some matrix of the chunk is swept as `wide` says (WIDE_NO: by sweep_kernel) */
template <int CAP> static bool any_wide(const skargs<CAP> &a, int wide)
{
    for (int k = 0; k < a.nmat; k++)
        if (a.m[k].wide == wide) return true;
    return false;
}

/* the sweep kernel for the chunk: the one with the K = 8 map when a matrix takes it */
template <int CAP, int KIND> static void (*sweep_for(const skargs<CAP> &a))(const skargs<CAP> *, int)
{
    for (int k = 0; k < a.nmat; k++)
        if (a.m[k].fast && a.m[k].K == 8) return sweep_kernel<CAP, KIND, true>;
    return sweep_kernel<CAP, KIND>;
}

/* More fold blocks than one wave of the START and POWER folds at 4 an SM (ctas_per_pass: the SMs, one sweep CTA
** each): such a chunk's folds run a warp a fold block (warp_folds_for), or else those two folds' FOLD_PACKED
** instances.  (The sharded FINISH of a POWER fold keeps one instance: not measured.) */
template <int CAP> static bool many_folds_in(const skargs<CAP> &a)
{
    return (unsigned)a.nfold > 4u * (unsigned)ctas_per_pass();
}

/* Whether a chunk's folds run a warp a fold block (fold_warp_kernel): many fold blocks, none of its matrices with
** more than WARP_FOLD_BANDS bands, and MOONSTEP_SINKGD_WARP_FOLD not 0. */
template <int CAP> static bool warp_folds_for(const skargs<CAP> &a)
{
    if (!many_folds_in(a)) return false;
    for (int k = 0; k < a.nmat; k++)
        if (a.m[k].nbands > WARP_FOLD_BANDS) return false;
    const char *v = getenv("MOONSTEP_SINKGD_WARP_FOLD");
    return !(v && v[0] == '0' && v[1] == 0);
}

/* flat_apply_kernel's instance for a chunk, or NULL where the ring applies: sphere mode (its apply is the ring's
** with the sums' pass), a chunk past SMALL_CAP (its table does not fit the parameter space), a matrix not dense
** and aligned, dtypes that differ between the matrices, or MOONSTEP_SINKGD_FLAT_APPLY = 0 (tests and
** measurements) */
typedef void (*flat_kernel_t)(skargs<SMALL_CAP>, flatranges);
template <int CAP> static flat_kernel_t flat_apply_for(const skargs<CAP> &a)
{
    if constexpr (CAP != SMALL_CAP) return NULL;
    if (a.o.mode == MS_SINKGD_SPHERE) return NULL;
    if (a.grid > FLAT_RANGES || a.gtot >= INT32_MAX || (a.gtot + a.grid - 1) / a.grid > 65535) return NULL;   /* (grid z) */
    for (int k = 0; k < a.nmat; k++)
        if (!a.m[k].pvec || a.m[k].gdt != a.m[0].gdt || a.m[k].pdt != a.m[0].pdt) return NULL;
    const char *v = getenv("MOONSTEP_SINKGD_FLAT_APPLY");
    if (v && v[0] == '0' && v[1] == 0) return NULL;
    switch (a.m[0].gdt * 16 + a.m[0].pdt) {
#define FLAT_CASE(GD, TG, PD, TP) \
    case GD * 16 + PD: return flat_apply_kernel<TG, TP>;
    FLAT_CASE(MS_DTYPE_BF16, __nv_bfloat16, MS_DTYPE_BF16, __nv_bfloat16)
    FLAT_CASE(MS_DTYPE_BF16, __nv_bfloat16, MS_DTYPE_F16, __half)
    FLAT_CASE(MS_DTYPE_BF16, __nv_bfloat16, MS_DTYPE_F32, float)
    FLAT_CASE(MS_DTYPE_F16, __half, MS_DTYPE_BF16, __nv_bfloat16)
    FLAT_CASE(MS_DTYPE_F16, __half, MS_DTYPE_F16, __half)
    FLAT_CASE(MS_DTYPE_F16, __half, MS_DTYPE_F32, float)
    FLAT_CASE(MS_DTYPE_F32, float, MS_DTYPE_BF16, __nv_bfloat16)
    FLAT_CASE(MS_DTYPE_F32, float, MS_DTYPE_F16, __half)
    FLAT_CASE(MS_DTYPE_F32, float, MS_DTYPE_F32, float)
#undef FLAT_CASE
    default: return NULL;
    }
}

/* launches flat_apply_kernel K on a copy of the chunk's table with these flags (programmatic, as the passes are) */
template <int CAP>
static ms_status launch_flat(ms_ctx *ctx, cudaStream_t s, flat_kernel_t K, const skargs<CAP> &a, int flags,
                             int *launches)
{
    if constexpr (CAP != SMALL_CAP) {
        return ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda sinkgd: a flat apply past %d matrices", SMALL_CAP);
    } else {
        skargs<SMALL_CAP> t = a;
        t.flags = flags;
        int64_t most = 1;   /* the most chunks of a row group */
        for (int k = 0; k < t.nmat; k++) {
            const int64_t c = (int64_t)t.m[k].GR * (t.m[k].n / 8);
            most = c > most ? c : most;
        }
        const unsigned bpg = (unsigned)((most + FLAT_CPT * FLAT_THREADS - 1) / (FLAT_CPT * FLAT_THREADS));
        const int64_t kmax = (t.gtot + t.grid - 1) / t.grid;   /* the most row groups of a sweep range */
        flatranges r;
        for (int b = 0; b <= t.grid; b++) r.start[b] = (int32_t)range_start(b, t.gtot, t.grid);
        return launch(ctx, s, K, dim3(bpg, (unsigned)t.grid, (unsigned)kmax), FLAT_THREADS, 0, "sinkgd apply",
                      launches, true, false, t, r);
    }
}

/* fold_warp_kernel's grid for F fold blocks, a warp each */
static unsigned warp_fold_grid(unsigned F) { return (F + FOLD_THREADS / 32 - 1) / (FOLD_THREADS / 32); }

/* The launch sequence of one chunk (moonstep.h's step, pass by pass). */
template <int CAP>
static ms_status run_chunk(ms_ctx *ctx, cudaStream_t s, const msk_sinkgd *o, int cnt, const msk_sinkgd_mat *mm,
                           char *scratch, unsigned *tickets, int *launches)
{
    cudaError_t e = sweep_setup<CAP, K_SINK>();
    if (e == cudaSuccess) e = sweep_setup<CAP, K_POWER>();
    if (e != cudaSuccess)
        return ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda sinkgd: cudaFuncSetAttribute failed: %s",
                           cudaGetErrorString(e));
    skargs<CAP> *a = new (std::nothrow) skargs<CAP>;
    if (a == NULL)
        return ms_error_at(ctx, MS_E_OOM, __FILE__, __LINE__, "cuda sinkgd: no host memory for the launch table");
    a->o = *o;
    a->nmat = cnt;
    a->tickets = tickets;
    a->xch = NULL;   /* unsharded (the folds test it) */
    a->rvb = NULL;
    a->cols = NULL;
    skargs<CAP> *tables = reinterpret_cast<skargs<CAP> *>(scratch);
    plan_chunk(cnt, mm, ctas_per_pass(), scratch + table_bytes(), a->m, &a->gtot, &a->grid, &a->nfold);
    a->flags = 0;
    const unsigned G = (unsigned)a->grid, F = (unsigned)a->nfold;
    const int unit = o->iters == 0 ? FL_UNIT : 0;
    const bool wide = any_wide(*a, WIDE_PASSES), pair = any_wide(*a, WIDE_PAIR), narrow = any_wide(*a, WIDE_NO);
    const bool many_folds = many_folds_in(*a);
    const bool warp_folds = warp_folds_for(*a);
    const flat_kernel_t flat_apply = flat_apply_for(*a);
    bool rev = false;
    ms_status st = MS_OK;
    typedef void (*kernel_t)(const skargs<CAP> *, int);
    const kernel_t power_fold = many_folds ? fold_packed_kernel<CAP, K_POWER, false>
                                           : fold_kernel<CAP, K_POWER>;
    /* two walks over the launch sequence: the first collects the flags values (the tables to write), the second
    ** launches */
    unsigned used = 0;
    bool collect = true;
    auto go = [&](kernel_t K, int flags, unsigned grid, unsigned threads, size_t smem, const char *what,
                  bool pairs = false) {
        if (collect) used |= 1u << flags;
        else if (st == MS_OK) st = launch(ctx, s, K, grid, threads, smem, what, launches, true, pairs, tables, flags);
    };
    /* With warp folds, a power fold whose last warp walks u in every step (one not the step's last: sn_iters > 1)
    ** keeps fold_pass's 256 threads for the walk (the step's last leaves u to the apply). */
    auto power_fold_go = [&](int flags, const char *what) {
        if (warp_folds && (flags & FL_LAST))
            go(fold_warp_kernel<CAP, K_POWER, false>, flags, warp_fold_grid(F), FOLD_THREADS, 0, what);
        else
            go(power_fold, flags, F, FOLD_THREADS, 0, what);
    };
    /* a sweep of the fast and generic matrices, then the pairs', then the wide ones' two passes */
    auto sweep = [&](int kind, int flags, const char *what, const char *wide_what) {
        const bool sink = kind == K_SINK;
        if (narrow) go(sink ? sweep_for<CAP, K_SINK>(*a) : sweep_for<CAP, K_POWER>(*a), flags, G, T_SWEEP, SWEEP_SMEM, what);
        if (pair)
            go(sink ? pair_kernel<CAP, K_SINK> : pair_kernel<CAP, K_POWER>, flags, (G + 1) & ~1u, T_SWEEP, PAIR_SMEM,
               wide_what, true);
        if (wide) {
            go(sink ? wide_kernel<CAP, K_SINK, WIDE_PASS_ROWS> : wide_kernel<CAP, K_POWER, WIDE_PASS_ROWS>, flags, G,
               T_SWEEP, SWEEP_SMEM, wide_what);
            go(sink ? wide_kernel<CAP, K_SINK, WIDE_PASS_COLS> : wide_kernel<CAP, K_POWER, WIDE_PASS_COLS>, flags, G,
               T_SWEEP, 0, wide_what);
        }
    };
    auto sequence = [&]() {
        for (int k = 1; k <= o->iters; k++) {
            const int fl = (k == 1 ? FL_FIRST : 0) | (k == o->iters && o->mode != MS_SINKGD_BASE ? FL_LAST : 0);
            sweep(K_SINK, fl | (rev ? FL_REV : 0), "sinkgd sweep", "sinkgd wide passes");
            if (warp_folds)
                go(!(fl & FL_LAST) ? fold_warp_kernel<CAP, K_SINK, false> : fold_warp_kernel<CAP, K_SINK, true>, fl,
                   warp_fold_grid(F), FOLD_THREADS, 0, "sinkgd fold");
            else
                go(!(fl & FL_LAST) ? fold_kernel<CAP, K_SINK>
                   : many_folds ? fold_packed_kernel<CAP, K_SINK, true>
                                : fold_kernel<CAP, K_SINK, FOLD_WHOLE, true>,
                   fl, F, FOLD_THREADS, 0, "sinkgd fold");
            rev = !rev;
        }
        if (o->mode != MS_SINKGD_BASE) {
            if (unit) go(prep_kernel<CAP>, unit, (unsigned)cnt, PREP_THREADS, 0, "sinkgd power prep");
            for (int k = 0; k < o->sn_iters; k++) {
                const int fl = unit | (k == o->sn_iters - 1 ? FL_LAST : 0);
                /* (a restart is the fold's: power_redo) */
                sweep(K_POWER, fl | (rev ? FL_REV : 0), "sinkgd power", "sinkgd power wide passes");
                power_fold_go(fl, "sinkgd power fold");
                rev = !rev;
            }
        }
        if (o->mode == MS_SINKGD_SPHERE) {
            go(elem_kernel<CAP, E_SUMS>, unit | (rev ? FL_REV : 0), G * ESPLIT, T_SWEEP, ELEM_SMEM, "sinkgd sphere sums");
            rev = !rev;
        }
        if (flat_apply == NULL)
            go(elem_kernel<CAP, E_APPLY>, unit | (rev ? FL_REV : 0), G * ESPLIT, T_SWEEP, ELEM_SMEM, "sinkgd apply");
        else if (!collect && st == MS_OK)
            st = launch_flat<CAP>(ctx, s, flat_apply, *a, unit | (rev ? FL_REV : 0), launches);
    };
    sequence();
    table_kernel<CAP><<<TABLE_SLOTS, 256, 0, s>>>(*a, tables, used);
    const cudaError_t te = cudaGetLastError();
    if (te != cudaSuccess) {   /* (not MSK_CHECK_LAUNCH: its return would leak the table) */
        delete a;
        return ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda sinkgd launch tables: kernel launch failed: "
                           "%s (%s)", cudaGetErrorName(te), cudaGetErrorString(te));
    }
    ++*launches;
    collect = false;
    rev = false;
    sequence();
    delete a;
    return st;
}

extern "C" ms_status msk_sinkgd_run(ms_ctx *ctx, cudaStream_t s, const msk_sinkgd *o, int n, const msk_sinkgd_mat *m,
                                    void *scratch, unsigned *tickets, int *launches)
{
    *launches = 0;
    ms_status st = MS_OK;
    const bool ok = for_chunks(n, m, [&](int cnt, const msk_sinkgd_mat *mm) {
        if (st == MS_OK)
            st = cnt <= SMALL_CAP ? run_chunk<SMALL_CAP>(ctx, s, o, cnt, mm, (char *)scratch, tickets, launches)
                                  : run_chunk<MSK_SINKGD_CAP>(ctx, s, o, cnt, mm, (char *)scratch, tickets, launches);
    });
    if (!ok) return ms_error_at(ctx, MS_E_OOM, __FILE__, __LINE__, "cuda sinkgd: no host memory to order the matrices");
    return st;
}

/* --- sharded runs (msk_sinkgd_run_sharded) ------------------------------------------------------------------
** The scratch of a chunk: the launch tables, the cols side table, the matrices' scratch, then the exchange
** region: rows: the fold's column sums (f32, or f64 with two scalars a matrix after them) and the sphere sums
** (f64, three a matrix); cols: one f64 a row twice plus three a matrix (the largest of its exchanges), then r v. */

static size_t side_bytes() { return sizeof(skcols<MSK_SINKGD_CAP>); }

static int64_t xch_bytes(int dim, int cnt, int64_t gtot, int nfold)
{
    if (dim == 0) return 0;   /* unsharded: no exchange buffer */
    if (dim == MSK_SHARD_ROWS) return ((int64_t)nfold * FOLD_COLS + 3 * (int64_t)cnt) * 8;
    return (2 * gtot + 3 * (int64_t)cnt) * 8 + up4(gtot) * 4;
}

extern "C" size_t msk_sinkgd_sharded_scratch(int dim, int n, const msk_sinkgd_mat *m)
{
    skmat *tmp = new (std::nothrow) skmat[MSK_SINKGD_CAP];
    if (tmp == NULL) return (size_t)-1;
    const int G = ctas_per_pass();
    int64_t most = 0, gtot;
    int grid, nfold;
    auto size = [&](int cnt, const msk_sinkgd_mat *mm) {
        const int64_t b = plan_chunk(cnt, mm, G, NULL, tmp, &gtot, &grid, &nfold, dim);
        const int64_t total = b + xch_bytes(dim, cnt, gtot, nfold);
        most = total > most ? total : most;
    };
    bool ok = true;
    if (dim == 0) {
        ok = for_chunks(n, m, size);
    } else {   /* (sharded runs keep the call's order: the ranks' exchanges follow it) */
        for (int first = 0; first < n; first += MSK_SINKGD_CAP)
            size(n - first < MSK_SINKGD_CAP ? n - first : MSK_SINKGD_CAP, m + first);
    }
    delete[] tmp;
    if (!ok) return (size_t)-1;
    return (size_t)most + table_bytes() + side_bytes();
}

extern "C" size_t msk_sinkgd_scratch(int n, const msk_sinkgd_mat *m) { return msk_sinkgd_sharded_scratch(0, n, m); }

template <int CAP>
static ms_status write_tables(ms_ctx *ctx, cudaStream_t s, const skargs<CAP> &a, skargs<CAP> *tables, unsigned used,
                              const skcols<CAP> *side, skcols<CAP> *side_dev, int *launches)
{
    table_kernel<CAP><<<TABLE_SLOTS, 256, 0, s>>>(a, tables, used);
    MSK_CHECK_LAUNCH(ctx, "sinkgd launch tables");
    ++*launches;
    if (side) {
        blob_kernel<skcols<CAP>><<<1, 256, 0, s>>>(*side, side_dev);
        MSK_CHECK_LAUNCH(ctx, "sinkgd cols table");
        ++*launches;
    }
    return MS_OK;
}

/* The launch sequence of one sharded chunk: run_chunk's with the exchanges (x->sum on the chunk's exchange
** region, in stream order between launches).  Every rank issues the same exchanges with the same sizes: they
** depend on the options, the matrix count and the global dims alone; passes with no work here (a grid of 0) are
** left out, exchanges never. */
template <int CAP>
static ms_status run_sharded(ms_ctx *ctx, cudaStream_t s, const msk_sinkgd *o, int dim, int cnt,
                             const msk_sinkgd_mat *mm, const msk_exchange *x, char *scratch, unsigned *tickets,
                             int *launches)
{
    cudaError_t e = sweep_setup<CAP, K_SINK>();
    if (e == cudaSuccess) e = sweep_setup<CAP, K_POWER>();
    if (e != cudaSuccess)
        return ms_error_at(ctx, MS_E_BACKEND, __FILE__, __LINE__, "cuda sinkgd: cudaFuncSetAttribute failed: %s",
                           cudaGetErrorString(e));
    skargs<CAP> *a = new (std::nothrow) skargs<CAP>;
    skcols<CAP> *side = dim == MSK_SHARD_COLS ? new (std::nothrow) skcols<CAP>() : NULL;
    if (a == NULL || (dim == MSK_SHARD_COLS && side == NULL)) {
        delete a;
        delete side;
        return ms_error_at(ctx, MS_E_OOM, __FILE__, __LINE__, "cuda sinkgd: no host memory for the launch table");
    }
    a->o = *o;
    a->nmat = cnt;
    a->tickets = tickets;
    a->flags = 0;
    skargs<CAP> *tables = reinterpret_cast<skargs<CAP> *>(scratch);
    char *side_dev = scratch + table_bytes(), *base = side_dev + side_bytes();
    const int64_t bytes = plan_chunk(cnt, mm, ctas_per_pass(), base, a->m, &a->gtot, &a->grid, &a->nfold, dim);
    char *xr = base + bytes;
    const int64_t gtot = a->gtot;
    a->xch = xr;
    a->rvb = dim == MSK_SHARD_COLS ? reinterpret_cast<float *>(xr + (2 * gtot + 3 * (int64_t)cnt) * 8) : NULL;
    a->cols = dim == MSK_SHARD_COLS ? reinterpret_cast<const skcol *>(side_dev) : NULL;
    if (side)
        for (int k = 0; k < cnt; k++) side->c[k] = skcol{ mm[k].ng, mm[k].off };

    const int P = ctas_per_pass();
    const unsigned G = (unsigned)a->grid, F = (unsigned)a->nfold, NM = (unsigned)cnt;
    const int64_t rw = (gtot + CROW_WARPS - 1) / CROW_WARPS, rt = (gtot + 255) / 256;
    const unsigned RG = (unsigned)(rw < 16 * P ? rw : 16 * P), RT = (unsigned)(rt < 16 * P ? rt : 16 * P);
    const int64_t cols32 = (int64_t)a->nfold * FOLD_COLS;
    const int unit = o->iters == 0 ? FL_UNIT : 0;
    const bool spectral = o->mode != MS_SINKGD_BASE, sphere = o->mode == MS_SINKGD_SPHERE;
    const bool wide = any_wide(*a, WIDE_PASSES), pair = any_wide(*a, WIDE_PAIR);
    const bool warp_folds = dim == MSK_SHARD_ROWS && warp_folds_for(*a);
    const unsigned FW = warp_folds ? warp_fold_grid(F) : F;   /* their grid */
    bool rev = false;
    ms_status st = MS_OK;
    typedef void (*kernel_t)(const skargs<CAP> *, int);
    /* two walks, as run_chunk's: the first collects the flags values, the second launches and exchanges */
    unsigned used = 0;
    bool collect = true;
    auto go = [&](kernel_t K, int flags, unsigned grid, unsigned threads, size_t smem, const char *what,
                  bool pairs = false) {
        if (grid == 0) return;
        if (collect) used |= 1u << flags;
        else if (st == MS_OK) st = launch(ctx, s, K, grid, threads, smem, what, launches, false, pairs, tables, flags);
    };
    auto xch = [&](int64_t count, ms_dtype dt) {
        if (!collect && st == MS_OK) st = x->sum(x->user, xr, count, dt);
    };
    auto sphere_sums = [&](int flags) {
        go(elem_kernel<CAP, E_SUMS>, flags, G * ESPLIT, T_SWEEP, ELEM_SMEM, "sinkgd sphere sums");
        go(sphere_xch_kernel<CAP, X_PACK>, unit, 1, 256, 0, "sinkgd sphere sums (pack)");
        xch(3 * (int64_t)cnt, MS_DTYPE_F64);
        go(sphere_xch_kernel<CAP, X_UNPACK>, unit, 1, 256, 0, "sinkgd sphere sums (unpack)");
    };
    auto rows = [&]() {
        for (int k = 1; k <= o->iters; k++) {
            const int fl = (k == 1 ? FL_FIRST : 0) | (k == o->iters && spectral ? FL_LAST : 0);
            go(sweep_for<CAP, K_SINK>(*a), fl | (rev ? FL_REV : 0), G, T_SWEEP, SWEEP_SMEM, "sinkgd sweep");
            if (pair)
                go(pair_kernel<CAP, K_SINK>, fl | (rev ? FL_REV : 0), (G + 1) & ~1u, T_SWEEP, PAIR_SMEM, "sinkgd pairs",
                   true);
            if (wide) {
                go(wide_kernel<CAP, K_SINK, WIDE_PASS_ROWS>, fl | (rev ? FL_REV : 0), G, T_SWEEP, SWEEP_SMEM,
                   "sinkgd wide rows");
                go(wide_kernel<CAP, K_SINK, WIDE_PASS_COLS>, fl | (rev ? FL_REV : 0), G, T_SWEEP, 0, "sinkgd wide columns");
            }
            go(warp_folds ? fold_warp_kernel<CAP, K_SINK, false, FOLD_PART> : fold_kernel<CAP, K_SINK, FOLD_PART>, fl, FW,
               FOLD_THREADS, 0, "sinkgd fold (part)");
            xch(cols32, MS_DTYPE_F32);
            if (warp_folds)
                go(fl & FL_LAST ? fold_warp_kernel<CAP, K_SINK, true, FOLD_FINISH>
                                : fold_warp_kernel<CAP, K_SINK, false, FOLD_FINISH>,
                   fl, FW, FOLD_THREADS, 0, "sinkgd fold (finish)");
            else
                go(fl & FL_LAST ? fold_kernel<CAP, K_SINK, FOLD_FINISH, true> : fold_kernel<CAP, K_SINK, FOLD_FINISH>, fl,
                   F, FOLD_THREADS, 0, "sinkgd fold (finish)");
            rev = !rev;
        }
        if (spectral) {
            if (unit) go(prep_kernel<CAP>, unit, NM, PREP_THREADS, 0, "sinkgd power prep");
            for (int k = 0; k < o->sn_iters; k++) {
                const int fl = unit | (k == o->sn_iters - 1 ? FL_LAST : 0);
                for (int redo = 0; redo < 2; redo++) {   /* the step, then its restart (every other matrix skips) */
                    const int f = fl | (redo ? FL_REDO : 0);
                    go(sweep_for<CAP, K_POWER>(*a), f | (rev != (redo == 1) ? FL_REV : 0), G, T_SWEEP, SWEEP_SMEM,
                       redo ? "sinkgd power restart" : "sinkgd power");
                    if (pair)
                        go(pair_kernel<CAP, K_POWER>, f | (rev != (redo == 1) ? FL_REV : 0), (G + 1) & ~1u, T_SWEEP,
                           PAIR_SMEM, "sinkgd power pairs", true);
                    if (wide) {
                        const int fw = f | (rev != (redo == 1) ? FL_REV : 0);
                        go(wide_kernel<CAP, K_POWER, WIDE_PASS_ROWS>, fw, G, T_SWEEP, SWEEP_SMEM, "sinkgd power wide rows");
                        go(wide_kernel<CAP, K_POWER, WIDE_PASS_COLS>, fw, G, T_SWEEP, 0, "sinkgd power wide columns");
                    }
                    go(warp_folds ? fold_warp_kernel<CAP, K_POWER, false, FOLD_PART> : fold_kernel<CAP, K_POWER, FOLD_PART>, f,
                       FW, FOLD_THREADS, 0, "sinkgd power fold (part)");
                    xch(cols32 + 2 * (int64_t)cnt, MS_DTYPE_F64);
                    go(fold_kernel<CAP, K_POWER, FOLD_FINISH>, f, F, FOLD_THREADS, 0, "sinkgd power fold (finish)");
                }
                rev = !rev;
            }
        }
        if (sphere) {
            sphere_sums(unit | (rev ? FL_REV : 0));
            rev = !rev;
        }
        go(elem_kernel<CAP, E_APPLY>, unit | (rev ? FL_REV : 0), G * ESPLIT, T_SWEEP, ELEM_SMEM, "sinkgd apply");
    };
    auto cols = [&]() {
        for (int k = 1; k <= o->iters; k++) {
            const int fl = (k == 1 ? FL_FIRST : 0) | (k == o->iters && spectral ? FL_LAST : 0);
            go(crow_kernel<CAP, K_SINK>, fl, RG, CROW_WARPS * 32, 0, "sinkgd row sums (cols)");
            xch(gtot, MS_DTYPE_F32);
            go(crow_fin_kernel<CAP>, fl, RT, 256, 0, "sinkgd row scales (cols)");
            go(ccol_kernel<CAP, K_SINK>, fl, F, FOLD_THREADS, 0, "sinkgd columns (cols)");
        }
        if (spectral) {
            go(cvec_kernel<CAP, CV_PREP>, unit, NM, PREP_THREADS, 0, "sinkgd power prep (cols)");
            xch(2 * (int64_t)cnt, MS_DTYPE_F64);
            go(cvec_kernel<CAP, CV_START>, unit, NM, PREP_THREADS, 0, "sinkgd power start (cols)");
            for (int k = 0; k < o->sn_iters; k++) {
                const int fl = unit | (k == o->sn_iters - 1 ? FL_LAST : 0);
                for (int redo = 0; redo < 2; redo++) {
                    const int f = fl | (redo ? FL_REDO : 0);
                    go(crow_kernel<CAP, K_POWER>, f, RG, CROW_WARPS * 32, 0, "sinkgd power rows (cols)");
                    xch(gtot * (unit ? 2 : 1) + cnt, MS_DTYPE_F64);
                    go(cvec_kernel<CAP, CV_V>, f, NM, PREP_THREADS, 0, "sinkgd power v (cols)");
                }
                go(ccol_kernel<CAP, K_POWER>, fl, F, FOLD_THREADS, 0, "sinkgd power columns (cols)");
                go(cvec_kernel<CAP, CV_W>, fl, NM, PREP_THREADS, 0, "sinkgd power w (cols)");
                xch(cnt, MS_DTYPE_F64);
                go(cvec_kernel<CAP, CV_U>, fl, NM, PREP_THREADS, 0, "sinkgd power u (cols)");
            }
        }
        if (sphere) sphere_sums(unit);
        go(capply_kernel<CAP>, unit, G, T_SWEEP, 0, "sinkgd apply (cols)");
    };
    auto sequence = [&]() {
        if (dim == MSK_SHARD_ROWS) rows();
        else cols();
    };
    sequence();
    st = write_tables<CAP>(ctx, s, *a, tables, used, side, reinterpret_cast<skcols<CAP> *>(side_dev), launches);
    collect = false;
    rev = false;
    if (st == MS_OK) sequence();
    delete a;
    delete side;
    return st;
}

extern "C" ms_status msk_sinkgd_run_sharded(ms_ctx *ctx, cudaStream_t s, const msk_sinkgd *o, int dim, int n,
                                            const msk_sinkgd_mat *m, const msk_exchange *x, void *scratch,
                                            unsigned *tickets, int *launches)
{
    *launches = 0;
    if (dim != MSK_SHARD_ROWS && dim != MSK_SHARD_COLS)
        return ms_error_at(ctx, MS_E_ARG, __FILE__, __LINE__, "cuda sinkgd: shard dim %d is not rows or columns", dim);
    for (int first = 0; first < n; first += MSK_SINKGD_CAP) {
        const int cnt = n - first < MSK_SINKGD_CAP ? n - first : MSK_SINKGD_CAP;
        ms_status st = cnt <= SMALL_CAP
            ? run_sharded<SMALL_CAP>(ctx, s, o, dim, cnt, m + first, x, (char *)scratch, tickets, launches)
            : run_sharded<MSK_SINKGD_CAP>(ctx, s, o, dim, cnt, m + first, x, (char *)scratch, tickets, launches);
        if (st != MS_OK) return st;
    }
    return MS_OK;
}

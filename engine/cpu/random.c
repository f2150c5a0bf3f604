/*
** CPU counter-based random numbers: Philox4x32-10 exactly as moonstep.h documents, so element i of dst
** (row-major) depends only on (seed, offset, i): not on the thread count, the layout or the backend.
*/
#include "cpu.h"

#include <math.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u   /* golden ratio */
#define PHILOX_W1 0xBB67AE85u   /* sqrt(3) - 1 */
#define BLOCK 1024
#define TWO_PI 6.283185307179586476925286766559

void ms_cpu_philox(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4])
{
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3], k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0, p1 = (uint64_t)PHILOX_M1 * c2;
        c0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        c1 = (uint32_t)p1;
        c2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c3 = (uint32_t)p0;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

/* 24-bit and 53-bit uniforms on [0, 1) from one or two words. */
static double u24(uint32_t w) { return (double)(w >> 8) * 0x1p-24; }
static double u53(uint32_t hi, uint32_t lo) { return ((double)(hi >> 5) * 0x1p26 + (double)(lo >> 6)) * 0x1p-53; }

/* x rounded to dt (what a store keeps), and the next value of dt below a stored x. */
/* Values are computed in f64 from the documented formulas, then stored in dst's dtype like any f64 value
** (bf16/f16 through f32).  A backend using the same f64 formulas agrees bit for bit on uniforms, and on
** normals up to its libm's last f64 bit (what survives rounding to f32 about once in 10^8).
** Uniform: v = a + (b - a) * u.  Rounding can carry v up to b (bf16 [0,1): u >= 1 - 2^-9); such a value
** becomes the largest value of dst's dtype below b.  Likewise rounding can carry v below an a that dst's dtype
** cannot hold (bf16 [-0.1, 0.1): u < 7e-4 gives -0.10009765625); such a value becomes the smallest value of
** the dtype at or above a.  Both keep the documented [a, b). */
ms_status ms_cpu_rand(ms_ctx *ctx, ms_tensor *dst, const ms_rand_options *o)
{
    ms_rand_options def = { .dist = MS_RAND_UNIFORM, .a = 0, .b = 1 };
    if (!o) o = &def;
    if (o->dist != MS_RAND_UNIFORM && o->dist != MS_RAND_NORMAL)
        return MS_FAIL(ctx, MS_E_ARG, "rand: unknown distribution %d", (int)o->dist);
    if (!ms_dtype_is_float(dst->dtype))
        return MS_FAIL(ctx, MS_E_DTYPE, "rand: dst dtype %s is not a float dtype", ms_dtype_name(dst->dtype));

    ms_cpu_view v;
    ms_cpu_view_of(&v, dst);
    int64_t numel = ms_cpu_view_numel(&v), nblk = (numel + BLOCK - 1) / BLOCK;
    const ms_dtype dt = dst->dtype;
    const bool wide = dt == MS_DTYPE_F64, normal = o->dist == MS_RAND_NORMAL;
    const double a = o->a, b = o->b;
    const double rb = ms_round_to_dtype(dt, b), top = rb < b ? rb : ms_dtype_step_down(dt, rb);   /* largest value < b */
    const double ra = ms_round_to_dtype(dt, a), bot = ra >= a ? ra : -ms_dtype_step_down(dt, -ra); /* least value >= a */
    const uint32_t key[2] = { (uint32_t)o->seed, (uint32_t)(o->seed >> 32) };
    const uint32_t off_lo = (uint32_t)o->offset, off_hi = (uint32_t)(o->offset >> 32);

    /* an element costs tens of ns (10 Philox rounds, log and cos): threads pay off on smaller tensors */
    #pragma omp parallel for schedule(static) num_threads(numel >= MS_CPU_PAR_MIN / 8 ? ms_cpu_threads(ctx) : 1)
    for (int64_t blk = 0; blk < nblk; blk++) {
        double buf[BLOCK];
        int64_t i0 = blk * BLOCK, m = numel - i0 < BLOCK ? numel - i0 : BLOCK;
        for (int64_t j = 0; j < m; j++) {
            uint64_t i = (uint64_t)(i0 + j);
            uint32_t ctr[4] = { (uint32_t)i, (uint32_t)(i >> 32), off_lo, off_hi }, w[4];
            ms_cpu_philox(ctr, key, w);
            double x;
            if (normal) {
                double u1 = wide ? u53(w[0], w[1]) + 0x1p-53 : u24(w[0]) + 0x1p-24;   /* (0, 1]: log finite */
                double u2 = wide ? u53(w[2], w[3]) : u24(w[2]);
                x = a + b * (sqrt(-2.0 * log(u1)) * cos(TWO_PI * u2));
            } else {
                x = a + (b - a) * (wide ? u53(w[0], w[1]) : u24(w[0]));
                x = ms_round_to_dtype(dt, x);
                if (b > a && x >= b) x = top;
                else if (b > a && x < a) x = bot;
            }
            buf[j] = x;
        }
        ms_cpu_store_f64(&v, i0, m, buf);
    }
    return MS_OK;
}

/*
** CPU backend checks that are hard to reach from Lua: f16 conversions over every bit pattern and at every
** rounding boundary, Philox4x32-10 against Random123's known-answer vectors, and saturating casts.
*/
#include "check.h"
#include "../../engine/cpu/cpu.h"   /* the backend's private header (philox) */

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* The value of an f16 bit pattern from its definition (NaN for NaNs). */
static double f16_value(uint16_t h)
{
    int sign = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v;
    if (e == 0x1f) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp(m, -24);
    else v = ldexp(1024 + m, e - 25);
    return sign ? -v : v;
}

static void test_f16_all_patterns(void)
{
    int bad_value = 0, bad_trip = 0, bad_nan = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = ms_f16_to_f32((uint16_t)h);
        double want = f16_value((uint16_t)h);
        if (want != want) {
            if (f == f) bad_nan++;
        } else if ((double)f != want || !signbit(f) != !signbit(want)) {
            bad_value++;
        }
        if (ms_f32_to_f16(f) != h) bad_trip++;
    }
    CHECK(bad_value == 0, "f16->f32 gave the wrong value for %d patterns", bad_value);
    CHECK(bad_nan == 0, "f16->f32 lost NaN for %d patterns", bad_nan);
    CHECK(bad_trip == 0, "f16->f32->f16 changed %d patterns", bad_trip);
}

/* Between every two neighbouring finite f16 values: the midpoint ties to the even one, one f32 ulp either
** side goes to the nearer one. */
static void test_f16_rounding_boundaries(void)
{
    int bad = 0;
    for (uint32_t h = 0; h < 0x7bff; h++) {
        for (int neg = 0; neg < 2; neg++) {
            uint16_t lo = (uint16_t)(h | (neg ? 0x8000 : 0)), hi = (uint16_t)((h + 1) | (neg ? 0x8000 : 0));
            float mid = (float)((f16_value(lo) + f16_value(hi)) / 2);   /* exact: 12 significant bits */
            uint16_t even = (lo & 1) ? hi : lo;
            float below = nextafterf(mid, 0.0f), above = nextafterf(mid, neg ? -INFINITY : INFINITY);
            if (ms_f32_to_f16(mid) != even) bad++;
            if (ms_f32_to_f16(below) != lo) bad++;
            if (ms_f32_to_f16(above) != hi) bad++;
        }
    }
    CHECK(bad == 0, "%d f32->f16 roundings at midpoints were wrong", bad);
    CHECK(ms_f32_to_f16(65504.0f) == 0x7bff, "65504 is the largest f16");
    CHECK(ms_f32_to_f16(nextafterf(65520.0f, 0)) == 0x7bff, "just below 65520 rounds down to 65504");
    CHECK(ms_f32_to_f16(65520.0f) == 0x7c00, "65520 (the tie past the largest) rounds to inf");
    CHECK(ms_f32_to_f16(-1e30f) == 0xfc00, "-1e30 overflows to -inf");
    CHECK(ms_f32_to_f16(INFINITY) == 0x7c00 && ms_f32_to_f16(-INFINITY) == 0xfc00, "infinities stay");
    CHECK(ms_f32_to_f16(0x1p-25f) == 0x0000, "2^-25 ties to even zero");
    CHECK(ms_f32_to_f16(nextafterf(0x1p-25f, 1)) == 0x0001, "just above 2^-25 rounds up to the smallest subnormal");
    CHECK(ms_f32_to_f16(0x1p-26f) == 0x0000, "2^-26 underflows");
    CHECK(ms_f32_to_f16(-0x1p-30f) == 0x8000, "negative underflow keeps the sign");
    CHECK(ms_f32_to_f16(0x3p-25f) == 0x0002, "3 * 2^-25 ties to even 2 * 2^-24");
    CHECK(ms_f32_to_f16(0x1p-14f) == 0x0400, "2^-14 is the smallest normal");
    CHECK(ms_f32_to_f16(0x1p-14f - 0x1p-25f) == 0x0400, "the top subnormal's tie rounds to the even normal");
    CHECK(ms_f32_to_f16(-0.0f) == 0x8000 && ms_f32_to_f16(0.0f) == 0, "signed zeros");
    uint16_t qn = ms_f32_to_f16(NAN), sn = ms_f32_to_f16(bits_f32(0x7f800001u));
    CHECK((qn & 0x7c00) == 0x7c00 && (qn & 0x3ff), "NaN stays NaN (0x%04x)", qn);
    CHECK((sn & 0x7c00) == 0x7c00 && (sn & 0x3ff), "a NaN with only low payload bits stays NaN (0x%04x)", sn);
}

/* Random f32 bit patterns against the compiler's own (correctly rounded) conversion where it has one. */
static void test_f16_random_vs_compiler(void)
{
#ifdef __FLT16_MAX__
    uint64_t s = 0x9E3779B97F4A7C15ull;
    int bad = 0;
    for (int i = 0; i < 2000000; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        float f = bits_f32((uint32_t)s);
        if (f != f) continue;
        _Float16 ref = (_Float16)f;
        uint16_t rb;
        memcpy(&rb, &ref, 2);
        if (ms_f32_to_f16(f) != rb) bad++;
    }
    CHECK(bad == 0, "%d of 2M random f32 values rounded differently from the compiler's _Float16", bad);
#else
    CHECK(1, "no _Float16 in this compiler");
#endif
}

static void test_philox_kat(void)
{
    /* Random123 kat_vectors: philox4x32 R=10 */
    static const struct { uint32_t ctr[4], key[2], out[4]; } kat[] = {
        { { 0, 0, 0, 0 }, { 0, 0 }, { 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u } },
        { { 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu }, { 0xffffffffu, 0xffffffffu },
          { 0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu } },
        { { 0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u }, { 0xa4093822u, 0x299f31d0u },
          { 0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u } },
    };
    for (size_t i = 0; i < sizeof kat / sizeof kat[0]; i++) {
        uint32_t out[4];
        ms_cpu_philox(kat[i].ctr, kat[i].key, out);
        CHECK(memcmp(out, kat[i].out, sizeof out) == 0, "philox KAT %zu: %08x %08x %08x %08x", i, out[0], out[1],
              out[2], out[3]);
    }
}

/* ms_rand element i == the documented formula on philox(counter {i, 0, offset}, key seed). */
static void test_rand_formula(ms_ctx *ctx)
{
    enum { N = 1000 };
    float f[N];
    double d[N];
    ms_tensor *tf = NULL, *td = NULL;
    int64_t shape[1] = { N };
    CHECK(ms_tensor_wrap(ctx, f, MS_DTYPE_F32, 1, shape, NULL, &tf) == MS_OK, "wrap f32");
    CHECK(ms_tensor_wrap(ctx, d, MS_DTYPE_F64, 1, shape, NULL, &td) == MS_OK, "wrap f64");
    ms_rand_options o = { .dist = MS_RAND_UNIFORM, .a = 0, .b = 1, .seed = 0x299f31d0a4093822ull, .offset = 77 };
    CHECK(ms_rand(ctx, tf, &o) == MS_OK && ms_rand(ctx, td, &o) == MS_OK, "rand");
    int bad = 0;
    for (uint32_t i = 0; i < N; i++) {
        uint32_t ctr[4] = { i, 0, 77, 0 }, key[2] = { 0xa4093822u, 0x299f31d0u }, w[4];
        ms_cpu_philox(ctr, key, w);
        if (f[i] != (float)((w[0] >> 8) * 0x1p-24)) bad++;
        if (d[i] != ((double)(w[0] >> 5) * 0x1p26 + (w[1] >> 6)) * 0x1p-53) bad++;
    }
    CHECK(bad == 0, "%d uniform values differ from the documented formula", bad);
    ms_tensor_free(tf);
    ms_tensor_free(td);
}

static void test_casts(ms_ctx *ctx)
{
    double src[] = { 1.9, -1.9, 3e9, -3e9, NAN, 255.5, 256, -0.5, INFINITY, -INFINITY, 2147483647.0, -2147483648.0 };
    enum { N = sizeof src / sizeof src[0] };
    int32_t i32[N];
    uint8_t u8[N];
    int32_t want_i[N] = { 1, -1, INT32_MAX, INT32_MIN, 0, 255, 256, 0, INT32_MAX, INT32_MIN, INT32_MAX, INT32_MIN };
    uint8_t want_u[N] = { 1, 0, 255, 0, 0, 255, 255, 0, 255, 0, 255, 0 };
    int64_t shape[1] = { N };
    ms_tensor *ts = NULL, *ti = NULL, *tu = NULL;
    ms_tensor_wrap(ctx, src, MS_DTYPE_F64, 1, shape, NULL, &ts);
    ms_tensor_wrap(ctx, i32, MS_DTYPE_I32, 1, shape, NULL, &ti);
    ms_tensor_wrap(ctx, u8, MS_DTYPE_U8, 1, shape, NULL, &tu);
    CHECK(ms_copy(ctx, ti, ts) == MS_OK && ms_copy(ctx, tu, ts) == MS_OK, "casts run: %s", ms_last_error());
    for (int i = 0; i < N; i++) {
        CHECK(i32[i] == want_i[i], "f64 %g -> i32 gave %d, expected %d", src[i], i32[i], want_i[i]);
        CHECK(u8[i] == want_u[i], "f64 %g -> u8 gave %d, expected %d", src[i], u8[i], want_u[i]);
    }
    /* the same through f32 (a different compute path) */
    float srcf[N];
    for (int i = 0; i < N; i++) srcf[i] = (float)src[i];
    ms_tensor *tf = NULL;
    ms_tensor_wrap(ctx, srcf, MS_DTYPE_F32, 1, shape, NULL, &tf);
    CHECK(ms_copy(ctx, tu, tf) == MS_OK, "f32 -> u8 runs");
    for (int i = 0; i < N; i++) CHECK(u8[i] == want_u[i], "f32 %g -> u8 gave %d", srcf[i], u8[i]);
    ms_tensor_free(ts);
    ms_tensor_free(ti);
    ms_tensor_free(tu);
    ms_tensor_free(tf);
}

/* matmul gathers operands that BLAS cannot read in place (expanded ones) into dense copies: with m = 2^30 + 1 and
** k = 2^31 - 1 an f64 copy of A is 2^64 + 2^33 - 8 bytes, which wrapped to an 8 GB allocation that the gather then
** overran.  It is refused before anything is allocated or written (dst is a wrapped one-element buffer: the call
** must not touch it). */
static void test_matmul_scratch_overflow(ms_ctx *ctx)
{
    static double mem[2] = { 1, 7 };   /* A and B read mem[0]; dst starts at mem[1], past them */
    const int64_t m = ((int64_t)1 << 30) + 1, k = INT32_MAX;
    int64_t sa[2] = { m, k }, sb[2] = { k, 1 }, sc[2] = { m, 1 }, zero[2] = { 0, 0 }, dense[2] = { 1, 1 };
    ms_tensor *a = NULL, *b = NULL, *c = NULL;
    CHECK(ms_tensor_wrap(ctx, &mem[0], MS_DTYPE_F64, 2, sa, zero, &a) == MS_OK &&
          ms_tensor_wrap(ctx, &mem[0], MS_DTYPE_F64, 2, sb, zero, &b) == MS_OK &&
          ms_tensor_wrap(ctx, &mem[1], MS_DTYPE_F64, 2, sc, dense, &c) == MS_OK, "wraps: %s", ms_last_error());
    if (a && b && c) {
        ms_status st = ms_matmul(ctx, c, a, b, NULL);
        CHECK(st == MS_E_OOM && strstr(ms_last_error(), "do not fit memory") != NULL && mem[1] == 7,
              "a copy past size_t: %s %s", ms_status_name(st), ms_last_error());
    }
    ms_tensor_free(a);
    ms_tensor_free(b);
    ms_tensor_free(c);
}

/* A dst that BLAS could write column-major but whose leading dimension passes int (strides {1, 2^31}) goes
** through a dense temporary, which is row-major: the product must be computed row-major too, not in the
** column-major order chosen before the leading dimension was found too large (that stored C transposed).
** The 8 GiB span is a sparse anonymous mapping; only the four elements' pages are touched. */
static void test_matmul_dst_huge_column_stride(ms_ctx *ctx)
{
    const int64_t ld = (int64_t)1 << 31;
    size_t bytes = (size_t)(ld + 2) * sizeof(float);
    float *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) {
        printf("skip test_matmul_dst_huge_column_stride: no 8 GiB mapping\n");
        return;
    }
    static float av[4] = { 1, 2, 3, 4 }, bv[4] = { 5, 6, 7, 8 };
    int64_t shape[2] = { 2, 2 }, dense[2] = { 2, 1 }, cstr[2] = { 1, ld };
    ms_tensor *a = NULL, *b = NULL, *c = NULL;
    CHECK(ms_tensor_wrap(ctx, av, MS_DTYPE_F32, 2, shape, dense, &a) == MS_OK &&
          ms_tensor_wrap(ctx, bv, MS_DTYPE_F32, 2, shape, dense, &b) == MS_OK &&
          ms_tensor_wrap(ctx, mem, MS_DTYPE_F32, 2, shape, cstr, &c) == MS_OK, "wraps: %s", ms_last_error());
    if (a && b && c) {
        ms_status st = ms_matmul(ctx, c, a, b, NULL);
        float c00 = mem[0], c10 = mem[1], c01 = mem[ld], c11 = mem[ld + 1];
        CHECK(st == MS_OK && c00 == 19 && c01 == 22 && c10 == 43 && c11 == 50,
              "dst column stride 2^31: %s, got [[%g, %g], [%g, %g]], want [[19, 22], [43, 50]]", ms_status_name(st),
              c00, c01, c10, c11);
    }
    ms_tensor_free(a);
    ms_tensor_free(b);
    ms_tensor_free(c);
    munmap(mem, bytes);
}

/* A device scalar (value_t, s_t, w_t, v_t) is read by the op while dst is written: one that shares memory with dst
** is refused (MS_E_LAYOUT), as the optimizer steps refuse a scalar that shares memory with a written tensor.  On
** the CPU the scalar was read once before the loop; the CUDA kernels read it in every block, after earlier blocks
** may have written it.  Nothing is written on the refusal.  A one-element dst that is the scalar's own view is
** the in-place case, and stays allowed. */
static void test_scalar_tensor_overlapping_dst(ms_ctx *ctx)
{
    float x[4] = { 2, 3, 4, 5 }, y[4] = { 1, 1, 1, 1 }, z[4] = { 1, 1, 1, 1 };
    int64_t s4[1] = { 4 }, s1[1] = { 1 };
    ms_tensor *tx = NULL, *x0 = NULL, *x3 = NULL, *ty = NULL, *tz = NULL;
    CHECK(ms_tensor_wrap(ctx, x, MS_DTYPE_F32, 1, s4, NULL, &tx) == MS_OK &&
          ms_tensor_wrap(ctx, x, MS_DTYPE_F32, 1, s1, NULL, &x0) == MS_OK &&
          ms_tensor_wrap(ctx, x + 3, MS_DTYPE_F32, 1, s1, NULL, &x3) == MS_OK &&
          ms_tensor_wrap(ctx, y, MS_DTYPE_F32, 1, s4, NULL, &ty) == MS_OK &&
          ms_tensor_wrap(ctx, z, MS_DTYPE_F32, 1, s4, NULL, &tz) == MS_OK, "wraps: %s", ms_last_error());
    if (!(tx && x0 && x3 && ty && tz)) return;
    struct call { const char *fn; ms_status st; } got[5];
    got[0] = (struct call){ "ms_fill", ms_fill(ctx, tx, 0, x3) };
    got[1] = (struct call){ "ms_binary_scalar", ms_binary_scalar(ctx, tx, tx, 0, x0, MS_BINARY_MUL, 0) };
    got[2] = (struct call){ "ms_lerp", ms_lerp(ctx, tx, ty, tz, 0, x0) };
    got[3] = (struct call){ "ms_addcmul", ms_addcmul(ctx, tx, tx, ty, tz, 0, x3) };
    got[4] = (struct call){ "ms_addcdiv", ms_addcdiv(ctx, tx, tx, ty, tz, 0, x0) };
    for (int i = 0; i < 5; i++) {
        CHECK(got[i].st == MS_E_LAYOUT, "%s with its scalar inside dst: %s", got[i].fn, ms_status_name(got[i].st));
    }
    CHECK(x[0] == 2 && x[1] == 3 && x[2] == 4 && x[3] == 5, "refused calls left dst alone: %g %g %g %g", x[0], x[1],
          x[2], x[3]);
    /* the scalar's own one-element view as dst: in place */
    ms_status st = ms_binary_scalar(ctx, x0, x0, 0, x0, MS_BINARY_MUL, 0);
    CHECK(st == MS_OK && x[0] == 4, "x0 <- x0 * x0 in place: %s %g", ms_status_name(st), x[0]);
    /* a scalar elsewhere in the same memory as a source (not dst) is still fine */
    st = ms_binary_scalar(ctx, ty, tx, 0, x3, MS_BINARY_MUL, 0);
    CHECK(st == MS_OK && y[0] == 20 && y[3] == 25, "y <- x * x[3]: %s %g %g", ms_status_name(st), y[0], y[3]);
    ms_tensor_free(tx);
    ms_tensor_free(x0);
    ms_tensor_free(x3);
    ms_tensor_free(ty);
    ms_tensor_free(tz);
}

/* Ops on empty tensors: their storage may hold no memory (a NULL pointer), which the data pointer of a view must
** not be computed from (UBSan under fuzz_recipe: "applying zero offset to null pointer" in ms_tensor_ptr, from
** ms.zeros({0})).  Only a sanitized build (-fsanitize=undefined) tells the old code from the new here. */
static void test_empty_tensor_ops(ms_ctx *ctx)
{
    int64_t s0[1] = { 0 }, s03[2] = { 0, 3 };
    ms_tensor *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    CHECK(ms_tensor_new(ctx, MS_DTYPE_F32, 1, s0, &a) == MS_OK && ms_tensor_new(ctx, MS_DTYPE_F32, 1, s0, &b) == MS_OK
          && ms_tensor_new(ctx, MS_DTYPE_F64, 2, s03, &c) == MS_OK && ms_tensor_new(ctx, MS_DTYPE_F64, 2, s03, &d) == MS_OK,
          "empty tensors: %s", ms_last_error());
    if (a && b && c && d) {
        CHECK(ms_fill(ctx, a, 1, NULL) == MS_OK, "fill of [0]: %s", ms_ctx_last_error(ctx));
        CHECK(ms_fill(ctx, c, 1, NULL) == MS_OK, "fill of [0,3]: %s", ms_ctx_last_error(ctx));
        CHECK(ms_copy(ctx, b, a) == MS_OK, "copy of [0]: %s", ms_ctx_last_error(ctx));
        CHECK(ms_copy(ctx, d, c) == MS_OK, "copy of [0,3]: %s", ms_ctx_last_error(ctx));
        CHECK(ms_binary_scalar(ctx, b, a, 2, NULL, MS_BINARY_MUL, 0) == MS_OK, "b <- a * 2: %s", ms_ctx_last_error(ctx));
        CHECK(ms_lerp(ctx, a, a, b, 0.5, NULL) == MS_OK, "lerp: %s", ms_ctx_last_error(ctx));
    }
    ms_tensor_free(a);
    ms_tensor_free(b);
    ms_tensor_free(c);
    ms_tensor_free(d);
}

int main(void)
{
    test_f16_all_patterns();
    test_f16_rounding_boundaries();
    test_f16_random_vs_compiler();
    test_philox_kat();
    ms_ctx *ctx = NULL;
    CHECK(ms_ctx_new("cpu", NULL, &ctx) == MS_OK, "cpu context: %s", ms_last_error());
    if (ctx) {
        test_rand_formula(ctx);
        test_casts(ctx);
        test_matmul_scratch_overflow(ctx);
        test_matmul_dst_huge_column_stride(ctx);
        test_scalar_tensor_overlapping_dst(ctx);
        test_empty_tensor_ops(ctx);
        ms_ctx_free(ctx);
    }
    CHECK(f32_bits(ms_f16_to_f32(0x3c00)) == 0x3f800000u, "f16 1.0 is f32 1.0");
    return CHECK_REPORT();
}

/*
** IEEE binary16 <-> binary32 conversions used wherever f16 is stored or read on the host: round to
** nearest even, subnormals and infinities exact, NaN payloads kept (so every f16 survives f16->f32->f16);
** and the rounding helpers the random-number backends share.
*/
#include "internal.h"

#include <math.h>
#include <string.h>

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float ms_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));           /* inf, NaN */
    if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));   /* rebias 15 -> 127 */
    float mag = (float)man * 0x1p-24f;                                         /* zero, subnormal: exact */
    return sign ? -mag : mag;
}

uint16_t ms_f32_to_f16(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) {                       /* NaN: keep the top payload bits, stay a NaN */
        uint16_t man = (uint16_t)((x >> 13) & 0x3ffu);
        return (uint16_t)(sign | 0x7c00u | (man ? man : 0x200u));
    }
    if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);   /* >= 65520 (halfway past 65504): inf */
    uint32_t e = x >> 23;
    if (e < 102) return sign;                                   /* below 2^-25: rounds to zero */
    uint32_t q, rem, half;
    if (e < 113) {                                              /* subnormal result: q * 2^-24 */
        uint32_t m = (x & 0x7fffffu) | 0x800000u, shift = 126 - e;
        q = m >> shift;
        rem = m & ((1u << shift) - 1);
        half = 1u << (shift - 1);
    } else {                                                    /* normal: rebias, drop 13 bits */
        q = (x >> 13) - (112u << 10);
        rem = x & 0x1fffu;
        half = 0x1000u;
    }
    if (rem > half || (rem == half && (q & 1u))) q++;          /* a carry may step into the exponent: right */
    return (uint16_t)(sign | q);
}

double ms_round_to_dtype(ms_dtype dt, double x)
{
    switch (dt) {
    case MS_DTYPE_F32:  return (float)x;
    case MS_DTYPE_BF16: return ms_bf16_to_f32(ms_f32_to_bf16((float)x));
    case MS_DTYPE_F16:  return ms_f16_to_f32(ms_f32_to_f16((float)x));
    default:            return x;
    }
}

double ms_dtype_step_down(ms_dtype dt, double x)
{
    if (dt == MS_DTYPE_F64) return nextafter(x, -INFINITY);
    if (dt == MS_DTYPE_F32) return nextafterf((float)x, -INFINITY);
    /* 16-bit formats: sign-magnitude bit patterns, one unit of the last place down */
    uint16_t h = dt == MS_DTYPE_BF16 ? ms_f32_to_bf16((float)x) : ms_f32_to_f16((float)x);
    if (x > 0) h--;
    else if (x == 0) h = 0x8001;
    else h++;
    return dt == MS_DTYPE_BF16 ? ms_bf16_to_f32(h) : ms_f16_to_f32(h);
}

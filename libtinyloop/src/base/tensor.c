/* tensor.c — dtype facts (names, byte sizes) and half / bfloat16 conversions. */
#include "base/tensor.h"

#include <string.h>

/* Element counts beyond this are rejected as hostile; it keeps every byte count below
 * 2^63 without further overflow checks. */
#define TL_MAX_ELEMENTS (UINT64_C(1) << 60)

const char *tl_dtype_name(tl_dtype dtype)
{
    static const char *const names[TL_DTYPE_COUNT] = {"f32", "f16", "bf16", "q8", "q4", "q2"};
    if ((unsigned)dtype >= TL_DTYPE_COUNT)
        return "unknown";
    return names[dtype];
}

int tl_dtype_is_quantized(tl_dtype dtype)
{
    return dtype == TL_DTYPE_Q8 || dtype == TL_DTYPE_Q4 || dtype == TL_DTYPE_Q2;
}

uint64_t tl_dtype_values_bytes(tl_dtype dtype, uint64_t n)
{
    switch (dtype) {
    case TL_DTYPE_F32: return 4 * n;
    case TL_DTYPE_F16:
    case TL_DTYPE_BF16: return 2 * n;
    case TL_DTYPE_Q8: return n;
    case TL_DTYPE_Q4: return n / 2;
    case TL_DTYPE_Q2: return n / 4;
    default: return 0;
    }
}

uint64_t tl_dtype_nbytes(tl_dtype dtype, int64_t rows, int64_t cols, int32_t group)
{
    if (rows < 1 || cols < 1)
        return 0;
    uint64_t n;
    if (__builtin_mul_overflow((uint64_t)rows, (uint64_t)cols, &n) || n > TL_MAX_ELEMENTS)
        return 0;
    if (!tl_dtype_is_quantized(dtype))   /* an unknown dtype has 0 value bytes: invalid */
        return group == 0 ? tl_dtype_values_bytes(dtype, n) : 0;
    if ((group != 32 && group != 64 && group != 128) || cols % group != 0)
        return 0;
    /* f16 scales per group, and f16 mins too but for q8 */
    uint64_t groups = n / (uint64_t)group;
    return tl_dtype_values_bytes(dtype, n) + (dtype == TL_DTYPE_Q8 ? 2 : 4) * groups;
}

static uint32_t float_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float tl_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) /* inf / nan, payload kept */
        return bits_float(sign | 0x7f800000u | (mant << 13));
    if (exp != 0)
        return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
    if (mant == 0)
        return bits_float(sign);
    /* subnormal: mant * 2^-24; shift the leading one up to the implicit bit */
    uint32_t e = 113;
    while (!(mant & 0x400u)) {
        mant <<= 1;
        e--;
    }
    return bits_float(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

uint16_t tl_f32_to_f16(float f)
{
    uint32_t x = float_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) /* nan: keep it quiet and keep the top payload bits */
        return (uint16_t)(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
    if (x >= 0x477ff000u) /* >= 65520 rounds to infinity (also inf itself) */
        return (uint16_t)(sign | 0x7c00u);
    if (x >= 0x38800000u) { /* normal half: rebias, round to nearest even at bit 13 */
        uint32_t r = x - (112u << 23);
        r += 0xfffu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (x <= 0x33000000u) /* <= 2^-25 rounds (ties to even) to zero */
        return sign;
    /* subnormal half: value / 2^-24 = mant >> shift, rounded to nearest even */
    uint32_t exp = x >> 23;
    uint32_t mant = (x & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - exp; /* 14..24 */
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u)))
        q++; /* may carry into the smallest normal, which is the right encoding */
    return (uint16_t)(sign | q);
}

float tl_bf16_to_f32(uint16_t h)
{
    return bits_float((uint32_t)h << 16);
}

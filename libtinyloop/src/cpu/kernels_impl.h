/* cpu/kernels_impl.h — the per-path kernels behind cpu/kernels.h.
 *
 * dispatch.c owns the public entry points: it splits work over the thread pool and
 * calls one of the tables of inner kernels, the portable one (kernels_generic.c), the
 * AVX2/FMA/F16C one (kernels_avx2.c) or that file built with AVX-512 VNNI, chosen once
 * at run time. The tables compute the same thing; only the instruction set differs
 * (and the two vector tables give the same floats). */
#ifndef TL_CPU_KERNELS_IMPL_H
#define TL_CPU_KERNELS_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "base/tensor.h"

/* Activations are quantized to int16 in blocks of this many values (docs/cpu-backend.md). */
#define TL_QBLOCK 32
/* Largest activation code: q = round(x * TL_QACT_MAX / max|x|) per block. Products with
 * any weight code (|w| <= 128) summed over one block stay far inside int32. */
#define TL_QACT_MAX 32767

/* n activation rows quantized for a quantized matmul; row i of each plane starts at
 * i * cols (qs) or i * (cols / TL_QBLOCK) (d, s). */
typedef struct tl_qact {
    const int16_t *qs; /* int16 codes, x ~= d * q */
    const float *d;    /* per block: scale, max|x| / TL_QACT_MAX */
    const float *s;    /* per block: d * sum(q), the factor of a weight group's min */
    int64_t cols;
} tl_qact;

typedef struct tl_cpu_ops {
    /* One activation row of `cols` (a multiple of TL_QBLOCK) into its planes. */
    void (*quantize_row)(const float *x, int64_t cols, int16_t *qs, float *d, float *s);
    /* y[i, r] for rows [r0, r1), i < n, f32/f16/bf16 weights. */
    void (*matmul_float_rows)(const tl_tensor *w, const float *x, int n, size_t ldx, float *y,
                              size_t ldy, int64_t r0, int64_t r1);
    /* y[i, r] for rows [r0, r1), i < n, q8/q4/q2 weights against quantized activations. */
    void (*matmul_quant_rows)(const tl_tensor *w, const tl_qact *a, int n, float *y,
                              size_t ldy, int64_t r0, int64_t r1);
    /* Attention over rows `stride` floats apart (K or V cache rows):
     * scores[j] = scale * (q . rows[j][0..n)) for j < len; */
    void (*dot_rows)(const float *q, const float *rows, size_t stride, int len, int n,
                     float scale, float *scores);
    /* y[c] += p[j] * rows[j][c] for c < n, each y[c] accumulated in order j = 0..len-1
     * (one fused multiply-add per term on AVX2). */
    void (*axpy_rows)(float *y, const float *p, const float *rows, size_t stride, int len,
                      int n);
    void (*scale)(float *y, float a, int n);                /* y *= a */
    /* out[j] = exp(x[j] - shift) (out may be NULL or x); returns the sum of those. */
    float (*exp_sum)(float *out, const float *x, int n, float shift);
    float (*sum_squares)(const float *x, int n);
    void (*gated_act)(const float *gate, const float *up, size_t count, int act, float *out);
    void (*add)(float *y, const float *x, size_t count);
} tl_cpu_ops;

extern const tl_cpu_ops tl_cpu_ops_generic;
extern const tl_cpu_ops tl_cpu_ops_avx2;
extern const tl_cpu_ops tl_cpu_ops_avx512vnni; /* built when TL_HAVE_AVX512VNNI_KERNELS */

/* IEEE half -> float without F16C (the portable path and tests use it). */
static inline float tl_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        float f = (float)mant * 5.9604644775390625e-8f; /* zero or subnormal: mant * 2^-24 */
        return sign ? -f : f;
    }
    if (exp == 31)
        bits = sign | 0x7f800000u | (mant << 13);
    else
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float tl_bfloat_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Portable helpers shared by both paths (defined in kernels_generic.c). */
/* Integer weights of block b (32 values) of row r of a q8/q4/q2 tensor. */
void tl_unpack_qblock(const tl_tensor *w, int64_t r, int64_t b, int8_t q[TL_QBLOCK]);
/* Weights [c0, c0 + len) of row r of an f32/f16/bf16 tensor as floats. */
void tl_convert_float_row(const tl_tensor *w, int64_t r, int64_t c0, int len, float *out);
float tl_act_silu(float x);
float tl_act_gelu_tanh(float x);

#endif

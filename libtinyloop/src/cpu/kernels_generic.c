/* cpu/kernels_generic.c — the portable C inner kernels (any CPU, any compiler flags).
 * The reference for what kernels_avx2.c computes; see cpu/kernels_impl.h. */
#include <math.h>

#include "cpu/kernels_impl.h"

/* Input rows handled together: each weight block is decoded once per this many. */
#define GENERIC_INPUT_TILE 16
/* Float weights are converted this many columns at a time. */
#define GENERIC_COL_CHUNK 64

float tl_act_silu(float x) { return x / (1.0f + expf(-x)); }

float tl_act_gelu_tanh(float x) {
    const float k = 0.7978845608028654f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

static void quantize_row(const float *x, int64_t cols, int16_t *qs, float *d, float *s) {
    for (int64_t b = 0; b < cols / TL_QBLOCK; b++) {
        const float *xb = x + b * TL_QBLOCK;
        float amax = 0.0f;
        for (int j = 0; j < TL_QBLOCK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float inv = amax > 0.0f ? (float)TL_QACT_MAX / amax : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < TL_QBLOCK; j++) {
            int q = (int)nearbyintf(xb[j] * inv); /* round half to even, as AVX2 does */
            qs[b * TL_QBLOCK + j] = (int16_t)q;
            sum += q;
        }
        d[b] = amax / (float)TL_QACT_MAX;
        s[b] = d[b] * (float)sum; /* |sum| <= 32 * 32767: exact in float */
    }
}

/* q4/q2 give 0..15 / 0..3 (docs/format.md packing). */
void tl_unpack_qblock(const tl_tensor *w, int64_t r, int64_t b, int8_t q[TL_QBLOCK]) {
    int64_t first = r * w->cols + b * TL_QBLOCK; /* element index of the block */
    const uint8_t *qs = (const uint8_t *)w->data;
    switch (w->dtype) {
    case TL_DTYPE_Q8:
        memcpy(q, qs + first, TL_QBLOCK);
        break;
    case TL_DTYPE_Q4:
        for (int j = 0; j < 16; j++) {
            uint8_t v = qs[first / 2 + j];
            q[j] = (int8_t)(v & 15);
            q[j + 16] = (int8_t)(v >> 4);
        }
        break;
    default: /* TL_DTYPE_Q2 */
        for (int j = 0; j < 8; j++) {
            uint8_t v = qs[first / 4 + j];
            for (int k = 0; k < 4; k++) q[j + 8 * k] = (int8_t)((v >> (2 * k)) & 3);
        }
        break;
    }
}

static void matmul_quant_rows(const tl_tensor *w, const tl_qact *a, int n, float *y, size_t ldy,
                              int64_t r0, int64_t r1) {
    const int64_t cols = w->cols, nb = cols / TL_QBLOCK, ng = cols / w->group;
    const int64_t blocks_per_group = w->group / TL_QBLOCK;
    for (int64_t r = r0; r < r1; r++) {
        for (int i0 = 0; i0 < n; i0 += GENERIC_INPUT_TILE) {
            int ni = n - i0 < GENERIC_INPUT_TILE ? n - i0 : GENERIC_INPUT_TILE;
            float acc[GENERIC_INPUT_TILE] = {0};
            for (int64_t b = 0; b < nb; b++) {
                int8_t wq[TL_QBLOCK];
                tl_unpack_qblock(w, r, b, wq);
                int64_t g = r * ng + b / blocks_per_group;
                float scale = tl_half_to_float(w->scales[g]);
                float min = w->mins ? tl_half_to_float(w->mins[g]) : 0.0f;
                for (int i = 0; i < ni; i++) {
                    const int16_t *aq = a->qs + (int64_t)(i0 + i) * cols + b * TL_QBLOCK;
                    int32_t dot = 0; /* |dot| <= 32 * 128 * 32767 < 2^31 */
                    for (int j = 0; j < TL_QBLOCK; j++) dot += (int32_t)wq[j] * aq[j];
                    int64_t ab = (int64_t)(i0 + i) * nb + b;
                    acc[i] += scale * (a->d[ab] * (float)dot) + min * a->s[ab];
                }
            }
            for (int i = 0; i < ni; i++) y[(size_t)(i0 + i) * ldy + r] = acc[i];
        }
    }
}

void tl_convert_float_row(const tl_tensor *w, int64_t r, int64_t c0, int len, float *out) {
    int64_t first = r * w->cols + c0;
    switch (w->dtype) {
    case TL_DTYPE_F32:
        memcpy(out, (const float *)w->data + first, (size_t)len * sizeof *out);
        break;
    case TL_DTYPE_F16:
        for (int k = 0; k < len; k++) out[k] = tl_half_to_float(((const uint16_t *)w->data)[first + k]);
        break;
    default: /* TL_DTYPE_BF16 */
        for (int k = 0; k < len; k++) out[k] = tl_bfloat_to_float(((const uint16_t *)w->data)[first + k]);
        break;
    }
}

static void matmul_float_rows(const tl_tensor *w, const float *x, int n, size_t ldx, float *y,
                              size_t ldy, int64_t r0, int64_t r1) {
    const int64_t cols = w->cols;
    for (int64_t r = r0; r < r1; r++) {
        for (int i0 = 0; i0 < n; i0 += GENERIC_INPUT_TILE) {
            int ni = n - i0 < GENERIC_INPUT_TILE ? n - i0 : GENERIC_INPUT_TILE;
            float acc[GENERIC_INPUT_TILE] = {0};
            for (int64_t c0 = 0; c0 < cols; c0 += GENERIC_COL_CHUNK) {
                int len = cols - c0 < GENERIC_COL_CHUNK ? (int)(cols - c0) : GENERIC_COL_CHUNK;
                float wt[GENERIC_COL_CHUNK];
                tl_convert_float_row(w, r, c0, len, wt);
                for (int i = 0; i < ni; i++) {
                    const float *xi = x + (size_t)(i0 + i) * ldx + c0;
                    float sum = 0.0f;
                    for (int k = 0; k < len; k++) sum += wt[k] * xi[k];
                    acc[i] += sum;
                }
            }
            for (int i = 0; i < ni; i++) y[(size_t)(i0 + i) * ldy + r] = acc[i];
        }
    }
}

static void dot_rows(const float *q, const float *rows, size_t stride, int len, int n,
                     float scale, float *scores) {
    for (int j = 0; j < len; j++) {
        const float *r = rows + (size_t)j * stride;
        float sum = 0.0f;
        for (int c = 0; c < n; c++) sum += q[c] * r[c];
        scores[j] = scale * sum;
    }
}

static void axpy_rows(float *y, const float *p, const float *rows, size_t stride, int len,
                      int n) {
    for (int j = 0; j < len; j++)
        for (int c = 0; c < n; c++) y[c] += p[j] * rows[(size_t)j * stride + c];
}

static void scale(float *y, float a, int n) {
    for (int j = 0; j < n; j++) y[j] *= a;
}

static float exp_sum(float *out, const float *x, int n, float shift) {
    float sum = 0.0f;
    for (int j = 0; j < n; j++) {
        float e = expf(x[j] - shift);
        if (out) out[j] = e;
        sum += e;
    }
    return sum;
}

static float sum_squares(const float *x, int n) {
    float sum = 0.0f;
    for (int j = 0; j < n; j++) sum += x[j] * x[j];
    return sum;
}

static void gated_act(const float *gate, const float *up, size_t count, int act, float *out) {
    for (size_t j = 0; j < count; j++)
        out[j] = (act ? tl_act_gelu_tanh(gate[j]) : tl_act_silu(gate[j])) * up[j];
}

static void add(float *y, const float *x, size_t count) {
    for (size_t j = 0; j < count; j++) y[j] += x[j];
}

const tl_cpu_ops tl_cpu_ops_generic = {
    .quantize_row = quantize_row,
    .matmul_float_rows = matmul_float_rows,
    .matmul_quant_rows = matmul_quant_rows,
    .dot_rows = dot_rows,
    .axpy_rows = axpy_rows,
    .scale = scale,
    .exp_sum = exp_sum,
    .sum_squares = sum_squares,
    .gated_act = gated_act,
    .add = add,
};

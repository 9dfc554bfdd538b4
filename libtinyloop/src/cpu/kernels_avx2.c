/* cpu/kernels_avx2.c — AVX2/FMA/F16C inner kernels (built with -mavx2 -mfma -mf16c and
 * only called after dispatch.c has checked the CPU). Computes what kernels_generic.c
 * computes; docs/cpu-backend.md explains the tiling and the quantized dot products.
 * Built a second time with AVX-512 VL/BW/VNNI as tl_cpu_ops_avx512vnni (meson.build):
 * the same results bit for bit, block_dot in fewer instructions. */
#include <immintrin.h>
#include <math.h>

#include "cpu/kernels_impl.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Weight rows kept hot in L1 while the input rows stream past them. */
#define ROW_TILE 16
/* Register tile for n > 1: ROWS weight rows x INPUTS input rows of accumulators. */
#define TILE_ROWS 2
#define TILE_INPUTS 4
/* Register tile for n == 1: more rows share each activation load. */
#define DECODE_ROWS 4
/* Decode prefetches the weight rows this far ahead: the hardware prefetcher alone left
 * the q8 head at ~60% of the read bandwidth. */
#define PREFETCH_ROWS 8
/* Blocks whose scale products are computed together (one vector). */
#define SCALE_CHUNK 8
/* Array bounds of any register tile; fixed sizes (not VLAs) let the compiler keep the
 * accumulators in registers once RB and NI are constants. */
#define MAX_RB 4
#define MAX_NI 4

ALWAYS_INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

ALWAYS_INLINE int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

ALWAYS_INLINE float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* ---- activation quantization ------------------------------------------------ */

static void quantize_row(const float *x, int64_t cols, int16_t *qs, float *d, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t b = 0; b < cols / TL_QBLOCK; b++) {
        const float *xb = x + b * TL_QBLOCK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        __m256 inv = _mm256_set1_ps(amax > 0.0f ? (float)TL_QACT_MAX / amax : 0.0f);
        __m256i q0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, inv), mode));
        __m256i q1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, inv), mode));
        __m256i q2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, inv), mode));
        __m256i q3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, inv), mode));
        int sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3)));
        /* packs interleaves the 128-bit lanes; the 64-bit permute restores element order */
        __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), _MM_SHUFFLE(3, 1, 2, 0));
        __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q2, q3), _MM_SHUFFLE(3, 1, 2, 0));
        _mm256_storeu_si256((__m256i *)(qs + b * TL_QBLOCK), lo);
        _mm256_storeu_si256((__m256i *)(qs + b * TL_QBLOCK + 16), hi);
        d[b] = amax / (float)TL_QACT_MAX;
        s[b] = d[b] * (float)sum;
    }
}

/* ---- quantized matmul ---------------------------------------------------------- */

/* Packed bytes per block of 32 weights. */
ALWAYS_INLINE int64_t qblock_bytes(tl_dtype dt) {
    return dt == TL_DTYPE_Q8 ? 32 : dt == TL_DTYPE_Q4 ? 16 : 8;
}

/* The 32 weight codes of the block at p widened to int16: elements 0..15 in *lo,
 * 16..31 in *hi (signed for q8, 0..15 / 0..3 for q4 / q2). */
ALWAYS_INLINE void load_qblock(const uint8_t *p, tl_dtype dt, __m256i *lo, __m256i *hi) {
    if (dt == TL_DTYPE_Q8) {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
        return;
    }
    if (dt == TL_DTYPE_Q4) {
        /* byte j holds element j (low nibble) and j + 16 (high nibble) */
        __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
        *lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0f));
        *hi = _mm256_srli_epi16(v, 4);
        return;
    }
    /* q2: byte j holds elements j, j+8, j+16, j+24 in bits 2k. Both 128-bit halves get the
     * 8 bytes; each half shifts by its own count (bits that cross into the neighbouring
     * int16 lane land above bit 1 and are masked off). */
    int64_t bits;
    memcpy(&bits, p, sizeof bits);
    const __m256i v = _mm256_cvtepu8_epi16(_mm_set1_epi64x(bits)), three = _mm256_set1_epi16(3);
    *lo = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), three);
    *hi = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6)), three);
}

/* Eight int32 partial sums of w . a over a block: int16 x int16 products summed in pairs
 * by madd. Bounds: |w| <= 128, |a| <= 32767, so a block's sum stays below
 * 32 * 128 * 32767 < 2^27 (docs/cpu-backend.md). */
ALWAYS_INLINE __m256i block_dot(__m256i w_lo, __m256i w_hi, const int16_t *a) {
    const __m256i a_lo = _mm256_loadu_si256((const __m256i *)a);
    const __m256i a_hi = _mm256_loadu_si256((const __m256i *)(a + 16));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* vpdpwssd adds the pair sums to the accumulator without saturation: the same int32
     * sums as madd + add (they never overflow, see above), one instruction fewer */
    return _mm256_dpwssd_epi32(_mm256_madd_epi16(w_lo, a_lo), w_hi, a_hi);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(w_lo, a_lo), _mm256_madd_epi16(w_hi, a_hi));
#endif
}

/* Per-group f16 values (scales or mins) of row r spread over blocks [b0, b0 + count),
 * zero-padded to SCALE_CHUNK. */
ALWAYS_INLINE void block_values(const tl_tensor *w, const uint16_t *plane, int64_t r, int64_t b0, int count,
                                float *out) {
    const int64_t ng = w->cols / w->group;
    const int shift = __builtin_ctz((unsigned)(w->group / TL_QBLOCK)); /* blocks per group: 1, 2, 4 */
    const uint16_t *row = plane + r * ng;
    if (count == SCALE_CHUNK) {
        /* b0 is a multiple of SCALE_CHUNK, so the chunk covers whole groups: load their
         * 8 >> shift values and give each to its 1 << shift blocks (lane k = group k >> shift).
         * A scalar loop here cost groups 64/128 a quarter of the decode speed. */
        const uint16_t *g = row + (b0 >> shift);
        __m128i h;
        if (shift == 0) h = _mm_loadu_si128((const __m128i *)g);
        else if (shift == 1) h = _mm_loadl_epi64((const __m128i *)g);
        else {
            int32_t two;
            memcpy(&two, g, sizeof two);
            h = _mm_cvtsi32_si128(two);
        }
        __m256 v = _mm256_cvtph_ps(h);
        if (shift == 1) v = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
        else if (shift == 2) v = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
        _mm256_storeu_ps(out, v);
        return;
    }
    _mm256_storeu_ps(out, _mm256_setzero_ps());
    for (int k = 0; k < count; k++) out[k] = half_to_float(row[(b0 + k) >> shift]);
}

/* Eight per-block activation values from `src`; lanes past `count` read as zero. */
ALWAYS_INLINE __m256 load_blocks(const float *src, int count) {
    if (count == SCALE_CHUNK) return _mm256_loadu_ps(src);
    __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_ps(src, mask);
}

/* Decode streams each weight byte once: ask for the codes, scales and mins of rows
 * [r, r + count) (contiguous in each plane) one cache line at a time, well before they are
 * used. Rows past the end are skipped. */
ALWAYS_INLINE void prefetch_rows(const tl_tensor *w, int64_t r, int count, int64_t row_bytes) {
    if (r + count > w->rows) return;
    const char *codes = (const char *)w->data + r * row_bytes;
    for (int64_t o = 0; o < count * row_bytes; o += 64) _mm_prefetch(codes + o, _MM_HINT_T0);
    const int64_t plane_bytes = (w->cols / w->group) * (int64_t)sizeof(uint16_t) * count;
    const int64_t first = r * (w->cols / w->group);
    for (int64_t o = 0; o < plane_bytes; o += 64) {
        _mm_prefetch((const char *)(w->scales + first) + o, _MM_HINT_T0);
        if (w->mins) _mm_prefetch((const char *)(w->mins + first) + o, _MM_HINT_T0);
    }
}

/* A register tile: rows r..r+RB-1 against activation rows i0..i0+NI-1, over all blocks. */
ALWAYS_INLINE void quant_tile(const tl_tensor *w, const tl_qact *a, int64_t r, int i0, float *y,
                              size_t ldy, tl_dtype dt, const int RB, const int NI) {
    const int64_t cols = w->cols, nb = cols / TL_QBLOCK, row_bytes = nb * qblock_bytes(dt);
    const uint8_t *wrow = (const uint8_t *)w->data + r * row_bytes;
    __m256 acc[MAX_RB][MAX_NI];
#pragma GCC unroll 4
    for (int ri = 0; ri < RB; ri++)
#pragma GCC unroll 4
        for (int ii = 0; ii < NI; ii++) acc[ri][ii] = _mm256_setzero_ps();

    if (NI == 1) prefetch_rows(w, r + PREFETCH_ROWS, RB, row_bytes);
    for (int64_t b0 = 0; b0 < nb; b0 += SCALE_CHUNK) {
        const int count = nb - b0 < SCALE_CHUNK ? (int)(nb - b0) : SCALE_CHUNK;
        /* products of weight scale and activation scale for each (row, input, block);
         * the min term sum_b min_b * s_b goes straight into the accumulator lanes */
        float prod[MAX_RB][MAX_NI][SCALE_CHUNK];
#pragma GCC unroll 4
        for (int ri = 0; ri < RB; ri++) {
            float sc[SCALE_CHUNK], mn[SCALE_CHUNK];
            block_values(w, w->scales, r + ri, b0, count, sc);
            if (dt != TL_DTYPE_Q8) block_values(w, w->mins, r + ri, b0, count, mn);
#pragma GCC unroll 4
            for (int ii = 0; ii < NI; ii++) {
                const int64_t first = (int64_t)(i0 + ii) * nb + b0;
                _mm256_storeu_ps(prod[ri][ii], _mm256_mul_ps(_mm256_loadu_ps(sc), load_blocks(a->d + first, count)));
                if (dt != TL_DTYPE_Q8)
                    acc[ri][ii] = _mm256_fmadd_ps(_mm256_loadu_ps(mn), load_blocks(a->s + first, count), acc[ri][ii]);
            }
        }
        for (int k = 0; k < count; k++) {
            const int64_t b = b0 + k;
            __m256i w_lo[MAX_RB], w_hi[MAX_RB];
#pragma GCC unroll 4
            for (int ri = 0; ri < RB; ri++) {
                const uint8_t *p = wrow + ri * row_bytes + b * qblock_bytes(dt);
                load_qblock(p, dt, &w_lo[ri], &w_hi[ri]);
            }
#pragma GCC unroll 4
            for (int ii = 0; ii < NI; ii++) {
                const int16_t *av = a->qs + (int64_t)(i0 + ii) * cols + b * TL_QBLOCK;
#pragma GCC unroll 4
                for (int ri = 0; ri < RB; ri++) {
                    __m256 p = _mm256_cvtepi32_ps(block_dot(w_lo[ri], w_hi[ri], av));
                    acc[ri][ii] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&prod[ri][ii][k]), acc[ri][ii]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int ri = 0; ri < RB; ri++)
#pragma GCC unroll 4
        for (int ii = 0; ii < NI; ii++) y[(size_t)(i0 + ii) * ldy + r + ri] = hsum_ps(acc[ri][ii]);
}

/* The tiling both matmul kernels share: rows [r0, r1) in blocks of ROW_TILE (the block's
 * weights stay in L1 while every input row passes); one input row (decode) in tiles of
 * DECODE_ROWS rows, more in TILE_ROWS x TILE_INPUTS tiles. Every TILE(r, i0, rows, inputs)
 * call has constant sizes, so each is inlined with its loops unrolled. */
#define FOR_EACH_TILE(n, r0, r1, TILE)                                                   \
    for (int64_t rt = (r0); rt < (r1); rt += ROW_TILE) {                                 \
        const int64_t re = rt + ROW_TILE < (r1) ? rt + ROW_TILE : (r1);                  \
        if ((n) == 1) {                                                                  \
            int64_t r = rt;                                                              \
            for (; r + DECODE_ROWS <= re; r += DECODE_ROWS) TILE(r, 0, DECODE_ROWS, 1);  \
            for (; r < re; r++) TILE(r, 0, 1, 1);                                        \
            continue;                                                                    \
        }                                                                                \
        for (int i0 = 0; i0 < (n); i0 += TILE_INPUTS) {                                  \
            const int ni = (n) - i0 < TILE_INPUTS ? (n) - i0 : TILE_INPUTS;              \
            for (int64_t r = rt; r < re; r += TILE_ROWS) {                               \
                const int rb = re - r < TILE_ROWS ? (int)(re - r) : TILE_ROWS;           \
                switch (rb * 8 + ni) {                                                   \
                case 2 * 8 + 4: TILE(r, i0, 2, 4); break;                                \
                case 2 * 8 + 3: TILE(r, i0, 2, 3); break;                                \
                case 2 * 8 + 2: TILE(r, i0, 2, 2); break;                                \
                case 2 * 8 + 1: TILE(r, i0, 2, 1); break;                                \
                case 1 * 8 + 4: TILE(r, i0, 1, 4); break;                                \
                case 1 * 8 + 3: TILE(r, i0, 1, 3); break;                                \
                case 1 * 8 + 2: TILE(r, i0, 1, 2); break;                                \
                default: TILE(r, i0, 1, 1); break;                                       \
                }                                                                        \
            }                                                                            \
        }                                                                                \
    }

ALWAYS_INLINE void quant_rows(const tl_tensor *w, const tl_qact *a, int n, float *y, size_t ldy,
                              int64_t r0, int64_t r1, tl_dtype dt) {
#define QUANT_TILE(r, i0, rows, inputs) quant_tile(w, a, r, i0, y, ldy, dt, rows, inputs)
    FOR_EACH_TILE(n, r0, r1, QUANT_TILE)
#undef QUANT_TILE
}

static void quant_rows_q8(const tl_tensor *w, const tl_qact *a, int n, float *y, size_t ldy, int64_t r0, int64_t r1) {
    quant_rows(w, a, n, y, ldy, r0, r1, TL_DTYPE_Q8);
}
static void quant_rows_q4(const tl_tensor *w, const tl_qact *a, int n, float *y, size_t ldy, int64_t r0, int64_t r1) {
    quant_rows(w, a, n, y, ldy, r0, r1, TL_DTYPE_Q4);
}
static void quant_rows_q2(const tl_tensor *w, const tl_qact *a, int n, float *y, size_t ldy, int64_t r0, int64_t r1) {
    quant_rows(w, a, n, y, ldy, r0, r1, TL_DTYPE_Q2);
}

static void matmul_quant_rows(const tl_tensor *w, const tl_qact *a, int n, float *y, size_t ldy,
                              int64_t r0, int64_t r1) {
    switch (w->dtype) {
    case TL_DTYPE_Q8: quant_rows_q8(w, a, n, y, ldy, r0, r1); break;
    case TL_DTYPE_Q4: quant_rows_q4(w, a, n, y, ldy, r0, r1); break;
    default: quant_rows_q2(w, a, n, y, ldy, r0, r1); break;
    }
}

/* ---- float-weight matmul --------------------------------------------------------- */

/* Eight weights starting at element `first` as floats. */
ALWAYS_INLINE __m256 load_float8(const void *data, int64_t first, tl_dtype dt) {
    if (dt == TL_DTYPE_F32) return _mm256_loadu_ps((const float *)data + first);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)data + first));
    if (dt == TL_DTYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); /* bf16 */
}

ALWAYS_INLINE float load_float1(const void *data, int64_t first, tl_dtype dt) {
    if (dt == TL_DTYPE_F32) return ((const float *)data)[first];
    if (dt == TL_DTYPE_F16) return half_to_float(((const uint16_t *)data)[first]);
    return tl_bfloat_to_float(((const uint16_t *)data)[first]);
}

ALWAYS_INLINE void float_tile(const tl_tensor *w, const float *x, size_t ldx, int64_t r, int i0,
                              float *y, size_t ldy, tl_dtype dt, const int RB, const int NI) {
    const int64_t cols = w->cols, c8 = cols & ~(int64_t)7;
    __m256 acc[MAX_RB][MAX_NI];
#pragma GCC unroll 4
    for (int ri = 0; ri < RB; ri++)
#pragma GCC unroll 4
        for (int ii = 0; ii < NI; ii++) acc[ri][ii] = _mm256_setzero_ps();
    for (int64_t c = 0; c < c8; c += 8) {
        __m256 wv[MAX_RB];
#pragma GCC unroll 4
        for (int ri = 0; ri < RB; ri++) wv[ri] = load_float8(w->data, (r + ri) * cols + c, dt);
#pragma GCC unroll 4
        for (int ii = 0; ii < NI; ii++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)(i0 + ii) * ldx + c);
#pragma GCC unroll 4
            for (int ri = 0; ri < RB; ri++) acc[ri][ii] = _mm256_fmadd_ps(wv[ri], xv, acc[ri][ii]);
        }
    }
#pragma GCC unroll 4
    for (int ri = 0; ri < RB; ri++)
#pragma GCC unroll 4
        for (int ii = 0; ii < NI; ii++) {
            float v = hsum_ps(acc[ri][ii]);
            const float *xi = x + (size_t)(i0 + ii) * ldx;
            for (int64_t c = c8; c < cols; c++) v += load_float1(w->data, (r + ri) * cols + c, dt) * xi[c];
            y[(size_t)(i0 + ii) * ldy + r + ri] = v;
        }
}

ALWAYS_INLINE void float_rows(const tl_tensor *w, const float *x, int n, size_t ldx, float *y,
                              size_t ldy, int64_t r0, int64_t r1, tl_dtype dt) {
#define FLOAT_TILE(r, i0, rows, inputs) float_tile(w, x, ldx, r, i0, y, ldy, dt, rows, inputs)
    FOR_EACH_TILE(n, r0, r1, FLOAT_TILE)
#undef FLOAT_TILE
}

static void float_rows_f32(const tl_tensor *w, const float *x, int n, size_t ldx, float *y, size_t ldy, int64_t r0, int64_t r1) {
    float_rows(w, x, n, ldx, y, ldy, r0, r1, TL_DTYPE_F32);
}
static void float_rows_f16(const tl_tensor *w, const float *x, int n, size_t ldx, float *y, size_t ldy, int64_t r0, int64_t r1) {
    float_rows(w, x, n, ldx, y, ldy, r0, r1, TL_DTYPE_F16);
}
static void float_rows_bf16(const tl_tensor *w, const float *x, int n, size_t ldx, float *y, size_t ldy, int64_t r0, int64_t r1) {
    float_rows(w, x, n, ldx, y, ldy, r0, r1, TL_DTYPE_BF16);
}

static void matmul_float_rows(const tl_tensor *w, const float *x, int n, size_t ldx, float *y,
                              size_t ldy, int64_t r0, int64_t r1) {
    switch (w->dtype) {
    case TL_DTYPE_F32: float_rows_f32(w, x, n, ldx, y, ldy, r0, r1); break;
    case TL_DTYPE_F16: float_rows_f16(w, x, n, ldx, y, ldy, r0, r1); break;
    default: float_rows_bf16(w, x, n, ldx, y, ldy, r0, r1); break;
    }
}

/* ---- vector helpers --------------------------------------------------------------- */

/* exp(x), Cephes-style: 2^n * p(r) with r = x - n ln2; relative error ~2e-7. */
ALWAYS_INLINE __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* n may be 128 at the upper clamp: split 2^n into two factors that stay normal */
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i half = _mm256_srai_epi32(ni, 1);
    __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

static float dot(const float *a, const float *b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), acc1);
    }
    for (; j + 8 <= n; j += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
    float sum = hsum_ps(_mm256_add_ps(acc0, acc1));
    for (; j < n; j++) sum += a[j] * b[j];
    return sum;
}

/* Attention reads K/V cache rows with a stride; the prefetcher alone left the loops
 * waiting on memory. */
#define ATTN_PREFETCH_ROWS 4

static void dot_rows(const float *q, const float *rows, size_t stride, int len, int n,
                     float scale, float *scores) {
    for (int j = 0; j < len; j++) {
        const float *r = rows + (size_t)j * stride;
        if (j + ATTN_PREFETCH_ROWS < len)
            for (int c = 0; c < n; c += 16)
                _mm_prefetch((const char *)(r + ATTN_PREFETCH_ROWS * stride + c), _MM_HINT_T0);
        scores[j] = scale * dot(q, r, n);
    }
}

/* NV vectors of y kept in registers over all rows. */
ALWAYS_INLINE void axpy_rows_vectors(float *y, const float *p, const float *rows, size_t stride,
                                     int len, int nv) {
    __m256 acc[8];
    for (int v = 0; v < nv; v++) acc[v] = _mm256_loadu_ps(y + 8 * v);
    for (int j = 0; j < len; j++) {
        const float *r = rows + (size_t)j * stride;
        if (j + ATTN_PREFETCH_ROWS < len)
            for (int v = 0; v < nv; v += 2)
                _mm_prefetch((const char *)(r + ATTN_PREFETCH_ROWS * stride + 8 * v), _MM_HINT_T0);
        __m256 a = _mm256_set1_ps(p[j]);
        for (int v = 0; v < nv; v++) acc[v] = _mm256_fmadd_ps(a, _mm256_loadu_ps(r + 8 * v), acc[v]);
    }
    for (int v = 0; v < nv; v++) _mm256_storeu_ps(y + 8 * v, acc[v]);
}

static void axpy_rows(float *y, const float *p, const float *rows, size_t stride, int len,
                      int n) {
    int c = 0;
    for (; c + 64 <= n; c += 64) axpy_rows_vectors(y + c, p, rows + c, stride, len, 8);
    if (c + 32 <= n) {
        axpy_rows_vectors(y + c, p, rows + c, stride, len, 4);
        c += 32;
    }
    if (c + 16 <= n) {
        axpy_rows_vectors(y + c, p, rows + c, stride, len, 2);
        c += 16;
    }
    if (c + 8 <= n) {
        axpy_rows_vectors(y + c, p, rows + c, stride, len, 1);
        c += 8;
    }
    for (; c < n; c++)
        for (int j = 0; j < len; j++) y[c] += p[j] * rows[(size_t)j * stride + c];
}

static void scale(float *y, float a, int n) {
    __m256 av = _mm256_set1_ps(a);
    int j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(y + j, _mm256_mul_ps(av, _mm256_loadu_ps(y + j)));
    for (; j < n; j++) y[j] *= a;
}

static float exp_sum(float *out, const float *x, int n, float shift) {
    __m256 acc = _mm256_setzero_ps(), sv = _mm256_set1_ps(shift);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), sv));
        if (out) _mm256_storeu_ps(out + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum_ps(acc);
    for (; j < n; j++) {
        float e = expf(x[j] - shift);
        if (out) out[j] = e;
        sum += e;
    }
    return sum;
}

static float sum_squares(const float *x, int n) { return dot(x, x, n); }

/* silu(g) = g / (1 + e^-g); gelu_tanh(g) = g / (1 + e^(-2u)), u = sqrt(2/pi)(g + 0.044715 g^3) */
static void gated_act(const float *gate, const float *up, size_t count, int act, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 k2 = _mm256_set1_ps(-2.0f * 0.7978845608028654f), c3 = _mm256_set1_ps(0.044715f);
    size_t j = 0;
    for (; j + 8 <= count; j += 8) {
        __m256 g = _mm256_loadu_ps(gate + j);
        __m256 arg = act ? _mm256_mul_ps(k2, _mm256_fmadd_ps(_mm256_mul_ps(c3, g), _mm256_mul_ps(g, g), g))
                         : _mm256_sub_ps(_mm256_setzero_ps(), g);
        __m256 a = _mm256_div_ps(g, _mm256_add_ps(one, exp_ps(arg)));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(a, _mm256_loadu_ps(up + j)));
    }
    for (; j < count; j++) out[j] = (act ? tl_act_gelu_tanh(gate[j]) : tl_act_silu(gate[j])) * up[j];
}

static void add(float *y, const float *x, size_t count) {
    size_t j = 0;
    for (; j + 8 <= count; j += 8)
        _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_loadu_ps(y + j), _mm256_loadu_ps(x + j)));
    for (; j < count; j++) y[j] += x[j];
}

#ifndef TL_CPU_OPS_TABLE
#define TL_CPU_OPS_TABLE tl_cpu_ops_avx2
#endif
const tl_cpu_ops TL_CPU_OPS_TABLE = {
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

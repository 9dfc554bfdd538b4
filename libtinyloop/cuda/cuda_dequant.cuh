// cuda_dequant.cuh — decoding weights in registers. Every kernel that reads a matrix
// does it one "chunk" at a time: 32 consecutive elements of a row, which is the unit
// of the q4/q2 packing in docs/format.md and a divisor of every group size, so one
// chunk has one scale and one min. Weights stay in the file's layout on the device.
//
// A chunk is loaded as raw bits (chunk_bits: one 16-byte load for q4, two for q8,
// one 8-byte load for q2, four / eight for f16-bf16 / f32) and decoded four elements
// at a time (chunk_piece). Quantized pieces come out as the integer codes, converted
// without I2F instructions (their throughput is an eighth of FMA's): the code's byte
// is spliced into the mantissa of 2^23 and 2^23 is subtracted, which is exact.
// Scale and min are applied by the caller, per element (load_chunk) or once per chunk
// on a dot product (the GEMV). chunk_codes gives four packed codes as they are, for
// the GEMV's integer dot products.
#ifndef TL_CUDA_DEQUANT_CUH
#define TL_CUDA_DEQUANT_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_common.cuh"

__device__ __forceinline__ float bf16_bits_to_float(unsigned short h) {
    return __uint_as_float((unsigned)h << 16);
}
__device__ __forceinline__ float f16_bits_to_float(unsigned short h) {
    return __half2float(__ushort_as_half(h));
}

// Weights are read once per call: keep them out of L1 (L2 policy, and with it the
// access-policy window over the loop body, is unchanged).
__device__ __forceinline__ uint4 load_weight16(const void *p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ uint2 load_weight8(const void *p) {
    uint2 r;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

template <int DT>
struct dtype_traits {
    static constexpr bool quantized = DT == TL_DTYPE_Q8 || DT == TL_DTYPE_Q4 || DT == TL_DTYPE_Q2;
    static constexpr bool has_min = DT == TL_DTYPE_Q4 || DT == TL_DTYPE_Q2;
    // 32-bit words of one chunk
    static constexpr int words = DT == TL_DTYPE_F32 ? 32
                               : (DT == TL_DTYPE_F16 || DT == TL_DTYPE_BF16) ? 16
                               : DT == TL_DTYPE_Q8 ? 8 : DT == TL_DTYPE_Q4 ? 4 : 2;
};

template <int DT>
struct chunk_bits {
    unsigned w[dtype_traits<DT>::words];
};

// Scale and min of chunk `chunk` of row `row` (quantized dtypes; min 0 for q8).
template <int DT>
__device__ __forceinline__ void chunk_scale_min(const dev_weight &w, int row, int chunk, float *scale,
                                                float *min) {
    size_t groups_per_row = (size_t)(w.cols >> 5) >> w.group_shift;
    size_t g = (size_t)row * groups_per_row + (size_t)(chunk >> w.group_shift);
    *scale = __half2float(w.scales[g]);
    *min = dtype_traits<DT>::has_min ? __half2float(w.mins[g]) : 0.0f;
}

// The same pair as stored, scale in the low half and min (0 for q8) in the high half:
// one register instead of two where many chunks are held at once (the GEMV).
template <int DT>
__device__ __forceinline__ __half2 chunk_scale_min_half2(const dev_weight &w, int row, int chunk) {
    size_t groups_per_row = (size_t)(w.cols >> 5) >> w.group_shift;
    size_t g = (size_t)row * groups_per_row + (size_t)(chunk >> w.group_shift);
    return __halves2half2(w.scales[g], dtype_traits<DT>::has_min ? w.mins[g] : __float2half_rn(0.0f));
}

// The raw bits of chunk `chunk` of row `row`. Only float dtypes can have a partial
// last chunk or unaligned rows (w.vec == 0); their missing tail reads as 0.
template <int DT>
__device__ __forceinline__ chunk_bits<DT> load_bits(const dev_weight &w, int row, int chunk) {
    constexpr int WORDS = dtype_traits<DT>::words;
    chunk_bits<DT> b;
    const size_t e0 = (size_t)row * (size_t)w.cols + (size_t)chunk * 32;   // first element
    const unsigned char *base = static_cast<const unsigned char *>(w.qs);
    if (DT == TL_DTYPE_Q2) {
        uint2 u = load_weight8(base + e0 / 4);
        b.w[0] = u.x;
        b.w[1] = u.y;
        return b;
    }
    if (dtype_traits<DT>::quantized || w.vec) {
        const unsigned char *p = base + e0 * WORDS / 8;   // WORDS * 4 bytes per 32 elements
#pragma unroll
        for (int k = 0; k < WORDS / 4; k++) {
            uint4 u = load_weight16(p + 16 * k);
            b.w[4 * k] = u.x; b.w[4 * k + 1] = u.y; b.w[4 * k + 2] = u.z; b.w[4 * k + 3] = u.w;
        }
        return b;
    }
    const int count = w.cols - chunk * 32;
    if (DT == TL_DTYPE_F32) {
        const unsigned *p = reinterpret_cast<const unsigned *>(base) + e0;
#pragma unroll
        for (int j = 0; j < 32; j++) b.w[j] = j < count ? p[j] : 0u;
    } else {
        const unsigned short *p = reinterpret_cast<const unsigned short *>(base) + e0;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            unsigned lo = 2 * j < count ? p[2 * j] : 0u;
            unsigned hi = 2 * j + 1 < count ? p[2 * j + 1] : 0u;
            b.w[j] = lo | (hi << 16);
        }
    }
    return b;
}

// Byte `b` of `word` minus `bias` as a float, exactly: 0x4B0000bb is 2^23 + bb.
__device__ __forceinline__ float byte_code(unsigned word, int b, float bias) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | (unsigned)b)) - (8388608.0f + bias);
}

// Elements 4k .. 4k+3 of a quantized chunk as the four bytes of one word, in element
// order: unsigned codes (q4 0..15, q2 0..3) or q8's signed bytes. Word k of the
// GEMV's activation records holds the same four elements (its integer dot products).
// They come from word code_word(k) of the chunk's bits (codes_in_word).
template <int DT>
__device__ __forceinline__ constexpr int code_word(int k) {
    return DT == TL_DTYPE_Q4 ? k & 3 : DT == TL_DTYPE_Q2 ? k & 1 : k;
}
template <int DT>
__device__ __forceinline__ unsigned codes_in_word(unsigned word, int k) {
    if constexpr (DT == TL_DTYPE_Q4) {
        // byte j: element j in the low nibble, element j + 16 in the high nibble
        return (k < 4 ? word : word >> 4) & 0x0F0F0F0Fu;
    } else if constexpr (DT == TL_DTYPE_Q2) {
        // byte j: elements j, j + 8, j + 16, j + 24 in bits 0-1, 2-3, 4-5, 6-7
        return (word >> (2 * (k >> 1))) & 0x03030303u;
    } else {
        return word;
    }
}
template <int DT>
__device__ __forceinline__ unsigned chunk_codes(const chunk_bits<DT> &b, int k) {
    return codes_in_word<DT>(b.w[code_word<DT>(k)], k);
}

// q[0..4) = elements 4k .. 4k+3 of the chunk: the integer codes of quantized dtypes
// (scale and min not applied), the values of float dtypes.
template <int DT>
__device__ __forceinline__ void chunk_piece(const chunk_bits<DT> &b, int k, float *q) {
    if (DT == TL_DTYPE_Q4 || DT == TL_DTYPE_Q2) {
        const unsigned codes = chunk_codes<DT>(b, k);
#pragma unroll
        for (int j = 0; j < 4; j++) q[j] = byte_code(codes, j, 0.0f);
    } else if (DT == TL_DTYPE_Q8) {
        // signed bytes, biased to 0..255 and unbiased after the conversion
        const unsigned codes = chunk_codes<DT>(b, k) ^ 0x80808080u;
#pragma unroll
        for (int j = 0; j < 4; j++) q[j] = byte_code(codes, j, 128.0f);
    } else if (DT == TL_DTYPE_F32) {
#pragma unroll
        for (int j = 0; j < 4; j++) q[j] = __uint_as_float(b.w[4 * k + j]);
    } else {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const unsigned word = b.w[2 * k + j];
            const unsigned short lo = (unsigned short)(word & 0xFFFFu), hi = (unsigned short)(word >> 16);
            q[2 * j] = DT == TL_DTYPE_F16 ? f16_bits_to_float(lo) : bf16_bits_to_float(lo);
            q[2 * j + 1] = DT == TL_DTYPE_F16 ? f16_bits_to_float(hi) : bf16_bits_to_float(hi);
        }
    }
}

// v[0..32) = elements chunk*32 .. chunk*32+31 of row `row` as floats (scale and min
// applied); a partial last chunk reads as 0 past the row's end.
template <int DT>
__device__ __forceinline__ void load_chunk(const dev_weight &w, int row, int chunk, float *v) {
    const chunk_bits<DT> b = load_bits<DT>(w, row, chunk);
    float scale = 1.0f, min = 0.0f;
    if (dtype_traits<DT>::quantized) chunk_scale_min<DT>(w, row, chunk, &scale, &min);
#pragma unroll
    for (int k = 0; k < 8; k++) {
        float q[4];
        chunk_piece<DT>(b, k, q);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (dtype_traits<DT>::has_min) v[4 * k + j] = fmaf(scale, q[j], min);
            else if (dtype_traits<DT>::quantized) v[4 * k + j] = scale * q[j];
            else v[4 * k + j] = q[j];
        }
    }
}

// Element i of a 1-D float tensor (norm weights, biases).
__device__ __forceinline__ float load_vector_elem(const dev_weight &w, int i) {
    switch (w.dtype) {
    case TL_DTYPE_F16: return f16_bits_to_float(static_cast<const unsigned short *>(w.qs)[i]);
    case TL_DTYPE_BF16: return bf16_bits_to_float(static_cast<const unsigned short *>(w.qs)[i]);
    default: return static_cast<const float *>(w.qs)[i];
    }
}

#endif

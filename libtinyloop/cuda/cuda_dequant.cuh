// cuda_dequant.cuh — decoding weights in registers. Every kernel that reads a matrix
// does it one "chunk" at a time: 32 consecutive elements of a row, which is the unit
// of the q4/q2 packing in docs/format.md and a divisor of every group size, so one
// chunk has one scale and one min. Weights stay in the file's layout on the device.
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

// Scale and min of chunk `chunk` of row `row` (quantized dtypes).
__device__ __forceinline__ void chunk_scale_min(const dev_weight &w, int row, int chunk,
                                                float *scale, float *min, bool has_min) {
    size_t groups_per_row = (size_t)(w.cols >> 5) >> w.group_shift;
    size_t g = (size_t)row * groups_per_row + (size_t)(chunk >> w.group_shift);
    *scale = __half2float(w.scales[g]);
    *min = has_min ? __half2float(w.mins[g]) : 0.0f;
}

// Eight halves / bfloats packed in a uint4 to floats.
template <int DT>
__device__ __forceinline__ void unpack8_16bit(uint4 u, float *v) {
    const unsigned words[4] = { u.x, u.y, u.z, u.w };
#pragma unroll
    for (int k = 0; k < 4; k++) {
        unsigned short lo = (unsigned short)(words[k] & 0xFFFFu);
        unsigned short hi = (unsigned short)(words[k] >> 16);
        v[2 * k] = DT == TL_DTYPE_F16 ? f16_bits_to_float(lo) : bf16_bits_to_float(lo);
        v[2 * k + 1] = DT == TL_DTYPE_F16 ? f16_bits_to_float(hi) : bf16_bits_to_float(hi);
    }
}

// v[0..32) = elements chunk*32 .. chunk*32+31 of row `row` as floats. Only float
// dtypes can have a partial last chunk (cols % 32 != 0); its missing tail reads as 0.
template <int DT>
__device__ __forceinline__ void load_chunk(const dev_weight &w, int row, int chunk, float *v) {
    const size_t e0 = (size_t)row * (size_t)w.cols + (size_t)chunk * 32;
    if (DT == TL_DTYPE_F32 || DT == TL_DTYPE_F16 || DT == TL_DTYPE_BF16) {
        if (w.vec) {
            if (DT == TL_DTYPE_F32) {
                const float4 *p = reinterpret_cast<const float4 *>(static_cast<const float *>(w.qs) + e0);
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    float4 f = __ldg(p + k);
                    v[4 * k] = f.x; v[4 * k + 1] = f.y; v[4 * k + 2] = f.z; v[4 * k + 3] = f.w;
                }
            } else {
                const uint4 *p = reinterpret_cast<const uint4 *>(static_cast<const unsigned short *>(w.qs) + e0);
#pragma unroll
                for (int k = 0; k < 4; k++) unpack8_16bit<DT>(__ldg(p + k), v + 8 * k);
            }
            return;
        }
        int count = w.cols - chunk * 32;
#pragma unroll
        for (int j = 0; j < 32; j++) {
            float f = 0.0f;
            if (j < count) {
                if (DT == TL_DTYPE_F32) f = static_cast<const float *>(w.qs)[e0 + j];
                else if (DT == TL_DTYPE_F16) f = f16_bits_to_float(static_cast<const unsigned short *>(w.qs)[e0 + j]);
                else f = bf16_bits_to_float(static_cast<const unsigned short *>(w.qs)[e0 + j]);
            }
            v[j] = f;
        }
        return;
    }
    float scale, min;
    chunk_scale_min(w, row, chunk, &scale, &min, DT != TL_DTYPE_Q8);
    if (DT == TL_DTYPE_Q8) {
        const uint4 *p = reinterpret_cast<const uint4 *>(static_cast<const int8_t *>(w.qs) + e0);
#pragma unroll
        for (int k = 0; k < 2; k++) {
            uint4 u = __ldg(p + k);
            const unsigned words[4] = { u.x, u.y, u.z, u.w };
#pragma unroll
            for (int b = 0; b < 16; b++)
                v[16 * k + b] = scale * (float)(int8_t)((words[b >> 2] >> (8 * (b & 3))) & 0xFF);
        }
    } else if (DT == TL_DTYPE_Q4) {
        // byte j: element j in the low nibble, element j + 16 in the high nibble
        uint4 u = __ldg(reinterpret_cast<const uint4 *>(static_cast<const uint8_t *>(w.qs) + e0 / 2));
        const unsigned words[4] = { u.x, u.y, u.z, u.w };
#pragma unroll
        for (int j = 0; j < 16; j++) {
            unsigned byte = (words[j >> 2] >> (8 * (j & 3))) & 0xFF;
            v[j] = fmaf(scale, (float)(byte & 0xF), min);
            v[j + 16] = fmaf(scale, (float)(byte >> 4), min);
        }
    } else {
        // q2, byte j: elements j, j + 8, j + 16, j + 24 in bits 0-1, 2-3, 4-5, 6-7
        uint2 u = __ldg(reinterpret_cast<const uint2 *>(static_cast<const uint8_t *>(w.qs) + e0 / 4));
        const unsigned words[2] = { u.x, u.y };
#pragma unroll
        for (int j = 0; j < 8; j++) {
            unsigned byte = (words[j >> 2] >> (8 * (j & 3))) & 0xFF;
#pragma unroll
            for (int s = 0; s < 4; s++) v[j + 8 * s] = fmaf(scale, (float)((byte >> (2 * s)) & 3), min);
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

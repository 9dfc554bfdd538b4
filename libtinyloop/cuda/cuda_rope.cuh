// cuda_rope.cuh — RoPE's frequencies and rotation, shared by the RoPE kernels
// (cuda_elementwise.cu) and the q/k/v GEMV that rotates in its epilogue (cuda_matmul.cu).
// The angle is the CPU's, in double (positions reach thousands of radians); reduced to
// [-pi, pi] in double it loses nothing, and sincosf of that float is within a few 1e-8
// of the CPU's (float)cos / sin.
#ifndef TL_CUDA_ROPE_CUH
#define TL_CUDA_ROPE_CUH

#include <cmath>

#include "cuda_common.cuh"

constexpr int ROPE_MAX_PAIRS = 128;   // rope_dims <= 256, as head_dim for attention

// theta^(-2p / rope_dims) (divided by the model's factor of pair p, if any) for every
// pair, computed on the host with the CPU's formula.
struct rope_freqs {
    double f[ROPE_MAX_PAIRS];
};

static inline rope_freqs rope_frequencies(const tl_rope_params &p) {
    rope_freqs freqs;
    for (int q = 0; q < p.rope_dims / 2; q++) {
        freqs.f[q] = pow((double)p.theta, -2.0 * q / p.rope_dims);
        if (p.factors) freqs.f[q] /= (double)p.factors[q];
    }
    return freqs;
}

// cos / sin of the RoPE angle of pair p at position pos.
__device__ __forceinline__ void rope_angle(int pos, const rope_freqs &freqs, int p, float *s, float *c) {
    const double two_pi = 6.283185307179586476925286766559;
    const double angle = (double)pos * freqs.f[p];
    const double reduced = angle - rint(angle * (1.0 / two_pi)) * two_pi;
    sincosf((float)reduced, s, c);
}

// The rotated value of a pair's member: a, b are the pair's two values (dims p and
// p + pairs in the half style, 2p and 2p + 1 interleaved), second picks b's result.
__device__ __forceinline__ float rope_member(float a, float b, float s, float c, bool second) {
    return second ? a * s + b * c : a * c - b * s;
}

// Rotates pair p of one head's vector in place.
__device__ __forceinline__ void rope_rotate(float *head, int p, int pairs, int style, float s, float c) {
    const int ia = style ? 2 * p : p;
    const int ib = style ? ia + 1 : ia + pairs;
    const float a = head[ia], b = head[ib];
    head[ia] = rope_member(a, b, s, c, false);
    head[ib] = rope_member(a, b, s, c, true);
}

// Rows at consecutive positions from base (a chunk of a sequence).
struct rope_consecutive {
    int base;
    __device__ __forceinline__ int operator()(int row) const { return base + row; }
};

// Rows at positions of their own (the nodes of a speculation tree).
struct rope_listed {
    const int32_t *pos;
    __device__ __forceinline__ int operator()(int row) const { return pos[row]; }
};

// The body of a RoPE kernel with one thread per (row, head, pair) of n rows, row i at
// position row_pos(i).
template <class RowPos>
__device__ __forceinline__ void rope_rows(float *x, int n, int n_heads, int head_dim, int pairs, int style,
                                          const rope_freqs &freqs, RowPos row_pos) {
    const int total = n * n_heads * pairs;
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= total) return;
    const int p = e % pairs, rest = e / pairs;
    const int h = rest % n_heads, i = rest / n_heads;
    float s, c;
    rope_angle(row_pos(i), freqs, p, &s, &c);
    rope_rotate(x + ((size_t)i * n_heads + h) * head_dim, p, pairs, style, s, c);
}

#endif

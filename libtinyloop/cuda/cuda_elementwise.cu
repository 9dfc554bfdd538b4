// cuda_elementwise.cu — the row-wise and element-wise ops: copies, fills, the seeded
// noise of docs/model.md, residual add, RMS/Layer norm, RoPE, gated activation and
// log-probabilities. Each mirrors the CPU kernel's formula (cpu/kernels.h); norms and
// reductions accumulate in fp32 like the CPU, RoPE angles and the noise are computed
// in double like the CPU.
#include "cuda_dequant.cuh"

#include <cmath>

namespace {

constexpr int ROW_THREADS = 256;   // one block per row for norms and log-softmax

// Blocks for a grid-stride loop over `count` elements.
int stride_blocks(size_t count) {
    size_t b = (count + 255) / 256;
    return (int)(b < 8192 ? (b ? b : 1) : 8192);
}

__global__ void fill_kernel(float *dst, size_t count, float value) {
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < count;
         e += (size_t)gridDim.x * blockDim.x)
        dst[e] = value;
}

__global__ void add_kernel(float *y, const float *x, size_t count) {
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < count;
         e += (size_t)gridDim.x * blockDim.x)
        y[e] += x[e];
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// dst[i, j] = sigma * Box-Muller(splitmix64 stream of (seed, pos0 + i), j)
__global__ void noise_kernel(float *dst, int n, int d, uint64_t seed_key, int pos0, float sigma) {
    const double two_pi = 6.283185307179586476925286766559;
    const double inv53 = 1.0 / 9007199254740992.0;  // 2^-53
    size_t total = (size_t)n * d;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(e / d), j = (int)(e % d);
        uint64_t key = splitmix64(seed_key + (uint64_t)(pos0 + i));
        uint64_t a = splitmix64(key + 2 * (uint64_t)j);
        uint64_t b = splitmix64(key + 2 * (uint64_t)j + 1);
        double u1 = (double)((a >> 11) + 1) * inv53;
        double u2 = (double)(b >> 11) * inv53;
        dst[e] = (float)(sigma * sqrt(-2.0 * log(u1)) * cos(two_pi * u2));
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum (or max) over the block; every thread gets the result. `red` holds 32 floats.
template <bool MAX>
__device__ float block_reduce(float v, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();   // red may still be read by a previous reduction
    if (lane == 0) red[warp] = v;
    __syncthreads();
    const int n_warps = (blockDim.x + 31) >> 5;
    v = lane < n_warps ? red[lane] : (MAX ? -INFINITY : 0.0f);
    return MAX ? warp_max(v) : warp_sum(v);
}

__global__ void __launch_bounds__(ROW_THREADS)
rmsnorm_kernel(const float *x, int d, dev_weight w, int unit_offset, float eps, float *out) {
    __shared__ float red[32];
    const float *xr = x + (size_t)blockIdx.x * d;
    float *orow = out + (size_t)blockIdx.x * d;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) ss = fmaf(xr[c], xr[c], ss);
    ss = block_reduce<false>(ss, red);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float g = load_vector_elem(w, c);
        orow[c] = xr[c] * r * (unit_offset ? 1.0f + g : g);
    }
}

__global__ void __launch_bounds__(ROW_THREADS)
layernorm_kernel(const float *x, int d, dev_weight w, dev_weight b, int has_bias, float eps,
                 float *out) {
    __shared__ float red[32];
    const float *xr = x + (size_t)blockIdx.x * d;
    float *orow = out + (size_t)blockIdx.x * d;
    float s = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) s += xr[c];
    const float mean = block_reduce<false>(s, red) / (float)d;
    float v = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float t = xr[c] - mean;
        v = fmaf(t, t, v);
    }
    const float r = 1.0f / sqrtf(block_reduce<false>(v, red) / (float)d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float o = (xr[c] - mean) * r * load_vector_elem(w, c);
        orow[c] = has_bias ? o + load_vector_elem(b, c) : o;
    }
}

// One thread per (row, rotary pair): the angle once, then every head.
__global__ void rope_kernel(float *x, int n, int n_heads, int head_dim, int pos0, int rope_dims,
                            int style, double theta) {
    const int pairs = rope_dims / 2;
    size_t total = (size_t)n * pairs;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(e / pairs), p = (int)(e % pairs);
        // angles in double: positions reach thousands of radians
        double angle = (double)(pos0 + i) * pow(theta, -2.0 * p / rope_dims);
        float c = (float)cos(angle), s = (float)sin(angle);
        int ia = style ? 2 * p : p;
        int ib = style ? ia + 1 : ia + pairs;
        for (int h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)i * n_heads + h) * head_dim;
            float a = v[ia], b = v[ib];
            v[ia] = a * c - b * s;
            v[ib] = a * s + b * c;
        }
    }
}

__global__ void gated_act_kernel(float *gate, const float *up, size_t count, int gelu) {
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < count;
         e += (size_t)gridDim.x * blockDim.x) {
        float g = gate[e];
        float a = gelu ? 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)))
                       : g / (1.0f + expf(-g));
        gate[e] = a * up[e];
    }
}

// out[i] = logits[i, targets[i]] - logsumexp(logits row i)
__global__ void __launch_bounds__(ROW_THREADS)
logprobs_kernel(const float *logits, int vocab, const int32_t *targets, float *out) {
    __shared__ float red[32];
    const float *row = logits + (size_t)blockIdx.x * vocab;
    float m = -INFINITY;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) m = fmaxf(m, row[c]);
    m = block_reduce<true>(m, red);
    float s = 0.0f;
    if (isfinite(m))
        for (int c = threadIdx.x; c < vocab; c += blockDim.x) s += expf(row[c] - m);
    s = block_reduce<false>(s, red);
    if (threadIdx.x == 0) {
        float lse = isfinite(m) ? m + logf(s) : m;
        out[blockIdx.x] = row[targets[blockIdx.x]] - lse;
    }
}

uint64_t host_splitmix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

}  // namespace

void launch_copy_rows(tl_exec *ex, float *dst, size_t ld_dst, const float *src, size_t ld_src,
                      int n, int width) {
    if (n <= 0 || width <= 0) return;
    cudaError_t err;
    if (n == 1 || (ld_dst == (size_t)width && ld_src == (size_t)width))
        err = cudaMemcpyAsync(dst, src, (size_t)n * width * sizeof(float), cudaMemcpyDeviceToDevice,
                              ex->stream);
    else
        err = cudaMemcpy2DAsync(dst, ld_dst * sizeof(float), src, ld_src * sizeof(float),
                                (size_t)width * sizeof(float), (size_t)n, cudaMemcpyDeviceToDevice,
                                ex->stream);
    exec_check(ex, err, "copy_rows");
}

void launch_fill(tl_exec *ex, float *dst, size_t count, float value) {
    if (count == 0) return;
    fill_kernel<<<stride_blocks(count), 256, 0, ex->stream>>>(dst, count, value);
    EXEC_LAUNCHED(ex, "fill");
}

void launch_fill_noise(tl_exec *ex, float *dst, int n, int d, uint64_t seed, int pos0,
                       float sigma) {
    size_t count = (size_t)n * d;
    if (count == 0) return;
    noise_kernel<<<stride_blocks(count), 256, 0, ex->stream>>>(dst, n, d, host_splitmix64(seed),
                                                               pos0, sigma);
    EXEC_LAUNCHED(ex, "fill_noise");
}

void launch_add(tl_exec *ex, float *y, const float *x, size_t count) {
    if (count == 0) return;
    add_kernel<<<stride_blocks(count), 256, 0, ex->stream>>>(y, x, count);
    EXEC_LAUNCHED(ex, "add");
}

void launch_norm(tl_exec *ex, const dev_weight &w, const dev_weight *bias,
                 const tl_norm_params &p, const float *x, int n, int d, float *out) {
    if (n <= 0) return;
    if (p.type == TL_NORMTYPE_LAYER) {
        dev_weight none = {};
        layernorm_kernel<<<n, ROW_THREADS, 0, ex->stream>>>(x, d, w, bias ? *bias : none,
                                                            bias ? 1 : 0, p.eps, out);
    } else {
        rmsnorm_kernel<<<n, ROW_THREADS, 0, ex->stream>>>(x, d, w, p.unit_offset, p.eps, out);
    }
    EXEC_LAUNCHED(ex, "norm");
}

void launch_rope(tl_exec *ex, float *x, int n, int n_heads, int head_dim, int pos0,
                 const tl_rope_params &p) {
    size_t count = (size_t)n * (p.rope_dims / 2);
    if (count == 0) return;
    rope_kernel<<<stride_blocks(count), 256, 0, ex->stream>>>(x, n, n_heads, head_dim, pos0,
                                                              p.rope_dims, p.style, (double)p.theta);
    EXEC_LAUNCHED(ex, "rope");
}

void launch_gated_act(tl_exec *ex, float *gate, const float *up, size_t count, int gelu) {
    if (count == 0) return;
    gated_act_kernel<<<stride_blocks(count), 256, 0, ex->stream>>>(gate, up, count, gelu);
    EXEC_LAUNCHED(ex, "gated_act");
}

void launch_logprobs(tl_exec *ex, const float *logits, int n, int vocab,
                     const int32_t *d_targets, float *d_out) {
    if (n <= 0) return;
    logprobs_kernel<<<n, ROW_THREADS, 0, ex->stream>>>(logits, vocab, d_targets, d_out);
    EXEC_LAUNCHED(ex, "logprobs");
}

// cuda_elementwise.cu — the row-wise and element-wise ops: copies, fills, the seeded
// noise of docs/model.md, residual add, RMS/Layer norm, RoPE, KV stores, gated
// activation, log-probabilities and argmax. Kernels that depend on the position read
// it through a pos_arg, so a recorded decode step replays at any position. Each
// mirrors the CPU kernel's formula (cpu/kernels.h); norms and reductions accumulate in
// fp32 like the CPU, the noise is computed in double like the CPU, and RoPE takes the
// CPU's double-precision angle (reduced to [-pi, pi] before the float sine/cosine).
//
// At decode sizes (a row of 2048 floats) these kernels are bound by memory latency,
// not bandwidth: each thread issues all of its loads before it uses any, so a kernel
// costs about one round trip to memory per pass instead of one per loop iteration.
#include "cuda_dequant.cuh"
#include "cuda_rope.cuh"

#include <algorithm>
#include <climits>
#include <cmath>

namespace {

constexpr int ROW_THREADS = 256;   // one block per row for norms and log-softmax
constexpr int ROW_BATCH = 4;       // accesses in flight per thread in a row pass
constexpr int ARGMAX_THREADS = 256;
constexpr int ARGMAX_PER_THREAD = 4;  // loads in flight per thread
constexpr int ARGMAX_MAX_BLOCKS = 256;   // first-pass blocks (winners kept for the second)

// Blocks for a grid-stride loop over `count` elements.
int stride_blocks(size_t count) {
    size_t b = (count + 255) / 256;
    return (int)(b < 8192 ? (b ? b : 1) : 8192);
}

__global__ void fill_kernel(float *dst, size_t count, float value) {
    pdl_wait();
    pdl_trigger();
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < count;
         e += (size_t)gridDim.x * blockDim.x)
        dst[e] = value;
}

__global__ void add_kernel(float *y, const float *x, size_t count) {
    pdl_wait();
    pdl_trigger();
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
// n(seed, pos, j), or with truncation > 0 n_T: redrawn at counters 2j + k 2^33 while
// |z| > truncation, 0 after 64 draws (docs/model.md).
__device__ double seeded_normal(uint64_t key, int j, double truncation) {
    const double two_pi = 6.283185307179586476925286766559;
    const double inv53 = 1.0 / 9007199254740992.0;  // 2^-53
    for (uint64_t k = 0; k < 64; k++) {
        uint64_t c = 2 * (uint64_t)j + (k << 33);
        uint64_t a = splitmix64(key + c), b = splitmix64(key + c + 1);
        double u1 = (double)((a >> 11) + 1) * inv53;
        double u2 = (double)(b >> 11) * inv53;
        double z = sqrt(-2.0 * log(u1)) * cos(two_pi * u2);
        if (truncation <= 0.0 || fabs(z) <= truncation) return z;
    }
    return 0.0;
}

__global__ void noise_kernel(float *dst, int n, int d, uint64_t seed_key, pos_arg pos, float sigma,
                             float truncation) {
    pdl_wait();
    pdl_trigger();
    const int pos0 = pos_value(pos);
    size_t total = (size_t)n * d;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(e / d), j = (int)(e % d);
        uint64_t key = splitmix64(seed_key + (uint64_t)(pos0 + i));
        dst[e] = (float)(sigma * seeded_normal(key, j, truncation));
    }
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

// V consecutive floats of a row: float4 accesses where the row allows them.
template <int V>
struct row_vec {
    float v[V];
};
template <int V>
__device__ __forceinline__ row_vec<V> row_load(const float *row, int unit) {
    row_vec<V> r;
    if (V == 4) {
        const float4 f = reinterpret_cast<const float4 *>(row)[unit];
        r.v[0] = f.x; r.v[1] = f.y; r.v[2] = f.z; r.v[3] = f.w;
    } else {
#pragma unroll
        for (int e = 0; e < V; e++) r.v[e] = row[unit * V + e];
    }
    return r;
}
template <int V>
__device__ __forceinline__ void row_store(float *row, int unit, const row_vec<V> &r) {
    if (V == 4) reinterpret_cast<float4 *>(row)[unit] = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
    else
#pragma unroll
        for (int e = 0; e < V; e++) row[unit * V + e] = r.v[e];
}

// This thread's share of sum(term(x[c])) over a row of units * V floats.
template <int V, typename F>
__device__ __forceinline__ float row_accumulate(const float *row, int units, F term) {
    float s = 0.0f;
    for (int u0 = threadIdx.x; u0 < units; u0 += ROW_BATCH * ROW_THREADS) {
        row_vec<V> xv[ROW_BATCH];
#pragma unroll
        for (int b = 0; b < ROW_BATCH; b++)
            if (u0 + b * ROW_THREADS < units) xv[b] = row_load<V>(row, u0 + b * ROW_THREADS);
#pragma unroll
        for (int b = 0; b < ROW_BATCH; b++)
            if (u0 + b * ROW_THREADS < units)
#pragma unroll
                for (int e = 0; e < V; e++) s += term(xv[b].v[e]);
    }
    return s;
}

// out[c] = fn(x[c], c) over the row; out may be the row itself (each batch is read
// before any of it is written).
template <int V, typename F>
__device__ __forceinline__ void row_transform(const float *row, float *out, int units, F fn) {
    for (int u0 = threadIdx.x; u0 < units; u0 += ROW_BATCH * ROW_THREADS) {
        row_vec<V> xv[ROW_BATCH];
#pragma unroll
        for (int b = 0; b < ROW_BATCH; b++)
            if (u0 + b * ROW_THREADS < units) xv[b] = row_load<V>(row, u0 + b * ROW_THREADS);
#pragma unroll
        for (int b = 0; b < ROW_BATCH; b++) {
            const int u = u0 + b * ROW_THREADS;
            if (u >= units) continue;
#pragma unroll
            for (int e = 0; e < V; e++) xv[b].v[e] = fn(xv[b].v[e], u * V + e);
            row_store<V>(out, u, xv[b]);
        }
    }
}

// One block per row; V = 4 where rows are float4-aligned and d % 4 == 0, else 1.
template <int V>
__global__ void __launch_bounds__(ROW_THREADS)
rmsnorm_kernel(const float *x, int d, dev_weight w, int unit_offset, float eps, float *out) {
    pdl_wait();
    pdl_trigger();
    __shared__ float red[32];
    const float *xr = x + (size_t)blockIdx.x * d;
    float *orow = out + (size_t)blockIdx.x * d;
    const int units = d / V;
    float ss = row_accumulate<V>(xr, units, [](float v) { return v * v; });
    ss = block_reduce<false>(ss, red);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    row_transform<V>(xr, orow, units, [&](float v, int c) {
        const float g = load_vector_elem(w, c);
        return v * r * (unit_offset ? 1.0f + g : g);
    });
}

template <int V>
__global__ void __launch_bounds__(ROW_THREADS)
layernorm_kernel(const float *x, int d, dev_weight w, dev_weight b, int has_bias, float eps, float *out) {
    pdl_wait();
    pdl_trigger();
    __shared__ float red[32];
    const float *xr = x + (size_t)blockIdx.x * d;
    float *orow = out + (size_t)blockIdx.x * d;
    const int units = d / V;
    const float mean = block_reduce<false>(row_accumulate<V>(xr, units, [](float v) { return v; }), red) / (float)d;
    const float var = block_reduce<false>(row_accumulate<V>(xr, units, [&](float v) {
        const float t = v - mean;
        return t * t;
    }), red) / (float)d;
    const float r = 1.0f / sqrtf(var + eps);
    row_transform<V>(xr, orow, units, [&](float v, int c) {
        const float o = (v - mean) * r * load_vector_elem(w, c);
        return has_bias ? o + load_vector_elem(b, c) : o;
    });
}

// One thread per (row, head, pair); angles as cuda_rope.cuh says.
__global__ void rope_kernel(float *x, int n, int n_heads, int head_dim, pos_arg pos, int pairs, int style,
                            rope_freqs freqs) {
    pdl_wait();
    pdl_trigger();
    rope_rows(x, n, n_heads, head_dim, pairs, style, freqs, rope_consecutive{ pos_value(pos) });
}

// Where a RoPE + store kernel's rows go: n rows at consecutive positions of one slot (a
// chunk of a sequence), or each row at its own position into its own slot (a batched
// step's rows; position -1: padding, nothing stored).
struct store_consecutive {
    int pos0;
    void *k, *v;
    kv_pages pg;
    __device__ __forceinline__ int pos(int i) const { return pos0 + i; }
    template <typename T>
    __device__ __forceinline__ T *row(int plane, int i, int kvd) const {
        return kv_row(static_cast<T *>(plane ? v : k), pg, plane, pos0 + i, (size_t)kvd);
    }
};
struct store_rows {
    const int32_t *positions;
    const row_slot *slots;
    __device__ __forceinline__ int pos(int i) const { return positions[i]; }
    template <typename T>
    __device__ __forceinline__ T *row(int plane, int i, int kvd) const {
        const row_slot &s = slots[i];
        return kv_row(static_cast<T *>(const_cast<void *>(plane ? s.v : s.k)), s.pg, plane, positions[i],
                      (size_t)kvd);
    }
};

// One launch for what follows the q/k/v projections: q rotated in place (a thread per
// row, head and pair, as rope_kernel), then a thread per element of k (rotated from its
// pair, read-only) and of v, written to the rows' cache rows (kv_row: contiguous or
// through the page table; T: the cache's element type).
template <typename T, class Dest>
__device__ __forceinline__ void rope_store_body(float *q, const float *k, const float *v, int n, int pairs,
                                                int style, const rope_freqs &freqs, int n_head, int n_kv_head,
                                                int head_dim, const Dest &dest) {
    const int q_items = n * n_head * pairs, kvd = n_kv_head * head_dim, kv_items = n * kvd;
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < q_items) {
        const int p = e % pairs, rest = e / pairs;
        const int h = rest % n_head, i = rest / n_head;
        const int pos = dest.pos(i);
        if (pos < 0) return;
        float s, c;
        rope_angle(pos, freqs, p, &s, &c);
        rope_rotate(q + ((size_t)i * n_head + h) * head_dim, p, pairs, style, s, c);
        return;
    }
    e -= q_items;
    if (e < kv_items) {
        const int i = e / kvd, within = e - i * kvd, dim = within % head_dim;
        const int pos = dest.pos(i);
        if (pos < 0) return;
        const float *row = k + (size_t)i * kvd + (within - dim);
        float out = row[dim];
        if (dim < 2 * pairs) {
            // the pair this element belongs to, and whether it is the pair's first member
            const int p = style ? dim >> 1 : (dim < pairs ? dim : dim - pairs);
            const int ia = style ? 2 * p : p;
            const int ib = style ? ia + 1 : ia + pairs;
            float s, c;
            rope_angle(pos, freqs, p, &s, &c);
            const float a = row[ia], b = row[ib];
            out = rope_member(a, b, s, c, dim != ia);
        }
        kv_put(dest.template row<T>(0, i, kvd) + within, out);
        return;
    }
    e -= kv_items;
    if (e < kv_items) {
        const int i = e / kvd, within = e - i * kvd;
        if (dest.pos(i) < 0) return;
        kv_put(dest.template row<T>(1, i, kvd) + within, v[e]);
    }
}

template <typename T>
__global__ void rope_store_kernel(float *q, const float *k, const float *v, int n, pos_arg pos, int pairs,
                                  int style, rope_freqs freqs, int n_head, int n_kv_head, int head_dim,
                                  void *k_cache, void *v_cache, kv_pages pg) {
    pdl_wait();
    pdl_trigger();
    rope_store_body<T>(q, k, v, n, pairs, style, freqs, n_head, n_kv_head, head_dim,
                       store_consecutive{ pos_value(pos), k_cache, v_cache, pg });
}

template <typename T>
__global__ void rope_store_rows_kernel(float *q, const float *k, const float *v, int n, const int32_t *pos,
                                       const row_slot *slots, int pairs, int style, rope_freqs freqs, int n_head,
                                       int n_kv_head, int head_dim) {
    pdl_wait();
    pdl_trigger();
    rope_store_body<T>(q, k, v, n, pairs, style, freqs, n_head, n_kv_head, head_dim, store_rows{ pos, slots });
}

// Rows k[i], v[i] to cache rows pos0 + i (both caches in one launch; kv_row: contiguous
// or each row to its page through the table). Also the kept loop states (f32 buffers).
template <typename T>
__global__ void kv_store_kernel(void *k_cache, void *v_cache, kv_pages pg, const float *k, const float *v,
                                int n, pos_arg pos, int width) {
    pdl_wait();
    pdl_trigger();
    const size_t per = (size_t)n * width;
    const int pos0 = pos_value(pos);
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < 2 * per;
         e += (size_t)gridDim.x * blockDim.x) {
        const int plane = e >= per;
        const size_t at = plane ? e - per : e;
        const int row = (int)(at / width), col = (int)(at % width);
        T *cache = static_cast<T *>(plane ? v_cache : k_cache);
        kv_put(kv_row(cache, pg, plane, pos0 + row, (size_t)width) + col, plane ? v[at] : k[at]);
    }
}

// Row `pos` of a slot's keys and values copied into another slot's (an exited token's
// last iteration standing in for those it skipped; either slot paged or contiguous).
template <typename T>
__global__ void kv_copy_kernel(void *k_dst, void *v_dst, kv_pages dst_pg, const void *k_src,
                               const void *v_src, kv_pages src_pg, int pos, int width) {
    pdl_wait();
    pdl_trigger();
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < 2 * width; e += gridDim.x * blockDim.x) {
        const int plane = e >= width, col = plane ? e - width : e;
        const T *src = kv_row(static_cast<const T *>(plane ? v_src : k_src), src_pg, plane, pos, (size_t)width);
        kv_row(static_cast<T *>(plane ? v_dst : k_dst), dst_pg, plane, pos, (size_t)width)[col] = src[col];
    }
}

__global__ void page_table_set_kernel(const float **table, int index, const float *page) {
    pdl_wait();
    pdl_trigger();
    table[index] = page;
}

__global__ void gated_act_kernel(float *gate, const float *up, size_t count, int gelu) {
    pdl_wait();
    pdl_trigger();
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
    pdl_wait();
    pdl_trigger();
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

// The first index of the largest value, as sample_row.c's argmax: a NaN never wins, except
// at index 0, where the sequential scan would keep it. (value, index) pairs are ranked
// by value, then by smaller index, a total order, so any reduction tree gives the
// sequential scan's answer; bi < 0 means no candidate yet.
struct argmax_pair {
    float v;
    int i;
};

__device__ __forceinline__ void argmax_offer(argmax_pair &best, float v, int i) {
    if (i >= 0 && !isnan(v) && (best.i < 0 || v > best.v || (v == best.v && i < best.i))) best = { v, i };
}

// The block's best pair, valid in thread 0.
__device__ argmax_pair block_argmax(argmax_pair best) {
    __shared__ argmax_pair red[ARGMAX_THREADS / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_offer(best, __shfl_xor_sync(0xffffffffu, best.v, o), __shfl_xor_sync(0xffffffffu, best.i, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) red[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < ARGMAX_THREADS / 32; w++) argmax_offer(best, red[w].v, red[w].i);
    return best;
}

// The block's best pair of x[first + k * step ...] for k >= 0, four loads in flight per
// thread (valid in thread 0).
__device__ argmax_pair argmax_slices(const float *x, int count, int first, int step) {
    argmax_pair best = { 0.0f, -1 };
    for (int e0 = first + threadIdx.x; e0 < count; e0 += step) {
        float v[ARGMAX_PER_THREAD];
#pragma unroll
        for (int k = 0; k < ARGMAX_PER_THREAD; k++) {
            const int e = e0 + k * ARGMAX_THREADS;
            v[k] = e < count ? x[e] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < ARGMAX_PER_THREAD; k++) {
            const int e = e0 + k * ARGMAX_THREADS;
            argmax_offer(best, v[k], e < count ? e : -1);
        }
    }
    return block_argmax(best);
}

// Pass 1: each block's best pair of its slices of x. (One launch whose last block
// merged the pairs, behind a fence and an arrival counter, was slower than this pass
// and the next.)
__global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_blocks_kernel(const float *x, int count, argmax_pair *partial) {
    pdl_wait();
    pdl_trigger();
    const argmax_pair best = argmax_slices(x, count, blockIdx.x * ARGMAX_THREADS * ARGMAX_PER_THREAD,
                                           gridDim.x * ARGMAX_THREADS * ARGMAX_PER_THREAD);
    if (threadIdx.x == 0) partial[blockIdx.x] = best;
}

// Pass 2: one block over the n_partial winners. A chained argmax (chain.ring set) also
// writes the index to the host's ring (mapped memory, slot pos % CHAIN_SLOTS) and the
// next step's position to the step parameters: every kernel before this one has
// finished (each waited for its predecessor), so none still reads them.
__global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_final_kernel(const float *x, const argmax_pair *partial, int n_partial, int32_t *out, argmax_chain chain) {
    pdl_wait();
    pdl_trigger();
    argmax_pair best = { 0.0f, -1 };
    for (int b = threadIdx.x; b < n_partial; b += ARGMAX_THREADS) argmax_offer(best, partial[b].v, partial[b].i);
    best = block_argmax(best);
    if (threadIdx.x != 0) return;
    const int token = (isnan(x[0]) || best.i < 0) ? 0 : best.i;
    *out = token;
    if (chain.ring) {
        const int pos = pos_value(chain.pos);
        chain.ring[pos % tl_exec::CHAIN_SLOTS] = token;
        *chain.next_pos = pos + 1;
    }
}

// One block per row: row i's first maximum (as argmax_final_kernel's token).
__global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_rows_kernel(const float *x, int count, size_t ld, int32_t *out) {
    pdl_wait();
    pdl_trigger();
    const float *row = x + (size_t)blockIdx.x * ld;
    const argmax_pair best = argmax_slices(row, count, 0, ARGMAX_THREADS * ARGMAX_PER_THREAD);
    if (threadIdx.x == 0) out[blockIdx.x] = (isnan(row[0]) || best.i < 0) ? 0 : best.i;
}

uint64_t host_splitmix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

}  // namespace

void launch_copy_rows(tl_exec *ex, void *dst, size_t ld_dst, const void *src, size_t ld_src, int n, int width,
                      size_t elem) {
    if (n <= 0 || width <= 0) return;
    enqueue(ex, [=](cudaStream_t s) {
        cudaError_t err;
        if (n == 1 || (ld_dst == (size_t)width && ld_src == (size_t)width))
            err = cudaMemcpyAsync(dst, src, (size_t)n * width * elem, cudaMemcpyDeviceToDevice, s);
        else
            err = cudaMemcpy2DAsync(dst, ld_dst * elem, src, ld_src * elem, (size_t)width * elem, (size_t)n,
                                    cudaMemcpyDeviceToDevice, s);
        exec_check(ex, err, "copy_rows");
    });
}

void launch_fill(tl_exec *ex, float *dst, size_t count, float value) {
    if (count == 0) return;
    launch(ex, "fill", fill_kernel, stride_blocks(count), 256, 0, dst, count, value);
}

void launch_fill_noise(tl_exec *ex, float *dst, int n, int d, uint64_t seed, pos_arg pos0,
                       float sigma, float truncation) {
    size_t count = (size_t)n * d;
    if (count == 0) return;
    launch(ex, "fill_noise", noise_kernel, stride_blocks(count), 256, 0, dst, n, d, host_splitmix64(seed),
           pos0, sigma, truncation);
}

void launch_kv_store(tl_exec *ex, void *k_cache, void *v_cache, const float *k, const float *v, int n,
                     pos_arg pos0, int width, const kv_pages &pg, bool half) {
    size_t count = 2 * (size_t)n * width;
    if (count == 0) return;
    launch(ex, "kv_store", half ? kv_store_kernel<__half> : kv_store_kernel<float>, stride_blocks(count), 256, 0,
           k_cache, v_cache, pg, k, v, n, pos0, width);
}

// Threads for RoPE on n rows of q and the store of their k and v; 0 (an error recorded)
// when the shape is out of range.
static int rope_store_threads(tl_exec *ex, int n, int pairs, int n_head, int n_kv_head, int head_dim) {
    const size_t count = (size_t)n * n_head * pairs + 2 * (size_t)n * n_kv_head * head_dim;
    if (pairs > ROPE_MAX_PAIRS || count > INT32_MAX) {
        exec_check(ex, cudaErrorInvalidValue, "rope: rope_dims above 256 or too many rows");
        return 0;
    }
    return (int)count;
}

void launch_rope_store(tl_exec *ex, float *q, const float *k, const float *v, int n, pos_arg pos0,
                       const tl_rope_params &p, int n_head, int n_kv_head, int head_dim, void *k_cache,
                       void *v_cache, const kv_pages &pg, bool half) {
    const int pairs = p.rope_dims / 2;
    const int count = n > 0 ? rope_store_threads(ex, n, pairs, n_head, n_kv_head, head_dim) : 0;
    if (count <= 0) return;
    launch(ex, "rope + kv store", half ? rope_store_kernel<__half> : rope_store_kernel<float>, (count + 255) / 256,
           256, 0, q, k, v, n, pos0, pairs, p.style, rope_frequencies(p), n_head, n_kv_head, head_dim, k_cache,
           v_cache, pg);
}

void launch_rope_store_rows(tl_exec *ex, float *q, const float *k, const float *v, int n, const int32_t *pos,
                            const row_slot *slots, const tl_rope_params &p, int n_head, int n_kv_head,
                            int head_dim, bool half) {
    const int pairs = p.rope_dims / 2;
    const int count = n > 0 ? rope_store_threads(ex, n, pairs, n_head, n_kv_head, head_dim) : 0;
    if (count <= 0) return;
    launch(ex, "rope + kv store (rows)", half ? rope_store_rows_kernel<__half> : rope_store_rows_kernel<float>,
           (count + 255) / 256, 256, 0, q, k, v, n, pos, slots, pairs, p.style, rope_frequencies(p), n_head,
           n_kv_head, head_dim);
}

void launch_argmax_rows(tl_exec *ex, const float *x, int n, int count, size_t ld, int32_t *d_out) {
    if (n <= 0 || count <= 0) return;
    launch(ex, "argmax (rows)", argmax_rows_kernel, n, ARGMAX_THREADS, 0, x, count, ld, d_out);
}

void launch_kv_copy(tl_exec *ex, void *k_dst, void *v_dst, const kv_pages &dst_pg, const void *k_src,
                    const void *v_src, const kv_pages &src_pg, int pos, int width, bool half) {
    if (width <= 0) return;
    launch(ex, "kv_copy", half ? kv_copy_kernel<__half> : kv_copy_kernel<float>, (2 * width + 255) / 256, 256, 0,
           k_dst, v_dst, dst_pg, k_src, v_src, src_pg, pos, width);
}

void launch_page_table_set(tl_exec *ex, const float **table, int index, const float *page) {
    launch(ex, "page table", page_table_set_kernel, 1, 1, 0, table, index, page);
}

void launch_add(tl_exec *ex, float *y, const float *x, size_t count) {
    if (count == 0) return;
    launch(ex, "add", add_kernel, stride_blocks(count), 256, 0, y, x, count);
}

template <int V>
void norm_v(tl_exec *ex, const dev_weight &w, const dev_weight *bias, const tl_norm_params &p,
            const float *x, int n, int d, float *out) {
    if (p.type == TL_NORMTYPE_LAYER) {
        dev_weight none = {};
        launch(ex, "norm", layernorm_kernel<V>, n, ROW_THREADS, 0, x, d, w, bias ? *bias : none,
               bias ? 1 : 0, p.eps, out);
    } else {
        launch(ex, "norm", rmsnorm_kernel<V>, n, ROW_THREADS, 0, x, d, w, p.unit_offset, p.eps, out);
    }
}

void launch_norm(tl_exec *ex, const dev_weight &w, const dev_weight *bias,
                 const tl_norm_params &p, const float *x, int n, int d, float *out) {
    if (n <= 0 || d <= 0) return;
    if ((uintptr_t)x % 16 == 0 && (uintptr_t)out % 16 == 0 && d % 4 == 0) norm_v<4>(ex, w, bias, p, x, n, d, out);
    else norm_v<1>(ex, w, bias, p, x, n, d, out);
}

void launch_rope(tl_exec *ex, float *x, int n, int n_heads, int head_dim, pos_arg pos0,
                 const tl_rope_params &p) {
    const int pairs = p.rope_dims / 2;
    const size_t count = (size_t)n * n_heads * pairs;
    if (count == 0) return;
    if (pairs > ROPE_MAX_PAIRS || count > INT32_MAX) {
        exec_check(ex, cudaErrorInvalidValue, "rope: rope_dims above 256 or too many rows");
        return;
    }
    launch(ex, "rope", rope_kernel, (int)((count + 255) / 256), 256, 0, x, n, n_heads, head_dim, pos0, pairs,
           p.style, rope_frequencies(p));
}

void launch_gated_act(tl_exec *ex, float *gate, const float *up, size_t count, int gelu) {
    if (count == 0) return;
    launch(ex, "gated_act", gated_act_kernel, stride_blocks(count), 256, 0, gate, up, count, gelu);
}

void launch_logprobs(tl_exec *ex, const float *logits, int n, int vocab,
                     const int32_t *d_targets, float *d_out) {
    if (n <= 0) return;
    launch(ex, "logprobs", logprobs_kernel, n, ROW_THREADS, 0, logits, vocab, d_targets, d_out);
}

size_t argmax_partial_bytes() { return ARGMAX_MAX_BLOCKS * sizeof(argmax_pair); }

void launch_argmax(tl_exec *ex, const float *x, int count, int32_t *d_out, const argmax_chain &chain) {
    const int per_block = ARGMAX_THREADS * ARGMAX_PER_THREAD;
    const int blocks = std::max(1, std::min(ARGMAX_MAX_BLOCKS, (count + per_block - 1) / per_block));
    argmax_pair *partial = static_cast<argmax_pair *>(ex->argmax_partial);
    launch(ex, "argmax", argmax_blocks_kernel, blocks, ARGMAX_THREADS, 0, x, count, partial);
    launch(ex, "argmax (final)", argmax_final_kernel, 1, ARGMAX_THREADS, 0, x, (const argmax_pair *)partial,
           blocks, d_out, chain);
}

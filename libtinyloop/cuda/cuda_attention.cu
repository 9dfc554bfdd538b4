// cuda_attention.cu — causal attention with GQA and sliding window over the fp32 KV
// cache, flash style: scores never leave the chip, softmax is online in fp32.
//
// One block serves one KV head and a tile of 8 "items" (an item = one query row x one
// query head of that KV head's group), one warp per item, so the K/V tiles it stages
// in shared memory are shared by the whole GQA group and, in prefill, by neighbouring
// rows. For decode (n <= 8 rows) the key range is also split over blocks
// (split-sequence) so a single query row still fills the GPU; the partial softmax
// states are merged by a second kernel.
#include "cuda_common.cuh"

#include <algorithm>
#include <cmath>

namespace {

constexpr int ATT_WARPS = 8;        // items per block
constexpr int ATT_KT = 32;          // keys per shared-memory tile (one per lane)
constexpr int ATT_MAX_DPL = 8;      // head_dim <= 256: dims per lane
constexpr int SPLIT_MIN_KEYS = 64;  // smallest key range worth a block of its own
constexpr int SPLIT_MAX_ROWS = 8;   // split-sequence only for decode-sized calls

struct attn_args {
    const float *q, *k, *v;
    float *out;
    float *partial;     // NULL: write out directly
    int n, pos0, n_head, n_kv_head, head_dim, window;
    float scale;
    int keys_per_split, n_splits;
};

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

__device__ __forceinline__ int first_key(int pos, int window) {
    return window > 0 ? max(0, pos - window + 1) : 0;
}

template <int DPL>
__global__ void __launch_bounds__(ATT_WARPS * 32) attention_kernel(attn_args a) {
    extern __shared__ float smem[];
    const int hd = a.head_dim, ld = hd + 1;   // +1: lanes reading different keys hit different banks
    float *ks = smem, *vs = ks + ATT_KT * ld, *qs = vs + ATT_KT * ld;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = a.n_head / a.n_kv_head, kvh = blockIdx.y, split = blockIdx.z;
    const int kvd = a.n_kv_head * hd, qd = a.n_head * hd;
    const int n_items = a.n * group;
    const int item0 = blockIdx.x * ATT_WARPS;
    const int item = item0 + warp;
    const bool active = item < n_items;
    const int row = active ? item / group : 0;
    const int head = kvh * group + (active ? item % group : 0);
    const int pos = a.pos0 + row;

    // the block's key range: from the first row's window start to the last row
    const int last_item = min(n_items - 1, item0 + ATT_WARPS - 1);
    const int block_lo = first_key(a.pos0 + item0 / group, a.window);
    const int block_hi = a.pos0 + last_item / group;
    const int start = block_lo + split * a.keys_per_split;
    const int end = min(block_hi, start + a.keys_per_split - 1);
    const int my_lo = max(first_key(pos, a.window), start), my_hi = min(pos, end);

    float *qw = qs + warp * hd;
    if (active)
        for (int d = lane; d < hd; d += 32) qw[d] = a.q[(size_t)row * qd + (size_t)head * hd + d] * a.scale;
    float m = -INFINITY, l = 0.0f, acc[DPL];
#pragma unroll
    for (int k = 0; k < DPL; k++) acc[k] = 0.0f;

    for (int t0 = start; t0 <= end; t0 += ATT_KT) {
        const int tile = min(ATT_KT, end - t0 + 1);
        __syncthreads();   // previous tile fully consumed (and qw written)
        for (int e = threadIdx.x; e < tile * hd; e += blockDim.x) {
            int j = e / hd, d = e % hd;
            size_t src = (size_t)(t0 + j) * kvd + (size_t)kvh * hd + d;
            ks[j * ld + d] = a.k[src];
            vs[j * ld + d] = a.v[src];
        }
        __syncthreads();
        if (!active || my_lo > my_hi || t0 > my_hi || t0 + tile - 1 < my_lo) continue;
        const int key = t0 + lane;
        const bool valid = lane < tile && key >= my_lo && key <= my_hi;
        float s = -INFINITY;
        if (valid) {
            const float *kr = ks + lane * ld;
            s = 0.0f;
            for (int d = 0; d < hd; d++) s = fmaf(qw[d], kr[d], s);
        }
        const float m_new = fmaxf(m, warp_max(s));
        const float corr = expf(m - m_new);   // m = -inf the first time: 0
        const float p = valid ? expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int k = 0; k < DPL; k++) acc[k] *= corr;
        for (int j = 0; j < tile; j++) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            const float *vr = vs + j * ld;
#pragma unroll
            for (int k = 0; k < DPL; k++) {
                int d = lane + 32 * k;
                if (d < hd) acc[k] = fmaf(pj, vr[d], acc[k]);
            }
        }
        m = m_new;
    }
    if (!active) return;
    if (!a.partial) {
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float *o = a.out + (size_t)row * qd + (size_t)head * hd;
#pragma unroll
        for (int k = 0; k < DPL; k++) {
            int d = lane + 32 * k;
            if (d < hd) o[d] = acc[k] * inv;
        }
        return;
    }
    float *part = a.partial + (((size_t)row * a.n_head + head) * a.n_splits + split) * (hd + 2);
    if (lane == 0) {
        part[0] = m;
        part[1] = l;
    }
#pragma unroll
    for (int k = 0; k < DPL; k++) {
        int d = lane + 32 * k;
        if (d < hd) part[2 + d] = acc[k];
    }
}

// Merge the split partial states of one (row, head): out = sum acc_s e^(m_s - M) / L.
__global__ void attention_merge_kernel(const float *partial, int n_head, int head_dim,
                                       int n_splits, float *out) {
    const int row = blockIdx.x / n_head, head = blockIdx.x % n_head;
    const float *base = partial + (size_t)blockIdx.x * n_splits * (head_dim + 2);
    float m = -INFINITY;
    for (int s = 0; s < n_splits; s++) m = fmaxf(m, base[s * (head_dim + 2)]);
    float l = 0.0f;
    for (int s = 0; s < n_splits; s++) {
        const float *p = base + s * (head_dim + 2);
        if (p[1] > 0.0f) l += p[1] * expf(p[0] - m);
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    float *o = out + (size_t)row * n_head * head_dim + (size_t)head * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            const float *p = base + s * (head_dim + 2);
            if (p[1] > 0.0f) sum += p[2 + d] * expf(p[0] - m);
        }
        o[d] = sum * inv;
    }
}

template <int DPL>
void launch_dpl(tl_exec *ex, const attn_args &a, dim3 grid, size_t smem) {
    if (smem > 48 * 1024) {
        cudaError_t err = cudaFuncSetAttribute(attention_kernel<DPL>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (exec_check(ex, err, "attention (shared memory size)")) return;
    }
    attention_kernel<DPL><<<grid, ATT_WARPS * 32, smem, ex->stream>>>(a);
    EXEC_LAUNCHED(ex, "attention");
}

int max_splits(int max_seq) { return (max_seq + SPLIT_MIN_KEYS - 1) / SPLIT_MIN_KEYS + 1; }

}  // namespace

size_t attention_partial_floats(int n_head, int head_dim, int max_seq) {
    return (size_t)SPLIT_MAX_ROWS * n_head * max_splits(max_seq) * (head_dim + 2);
}

void launch_attention(tl_exec *ex, const float *q, int n, int pos0, const float *k_cache,
                      const float *v_cache, const tl_attn_geom &g, float *out) {
    if (n <= 0) return;
    if (g.head_dim > 32 * ATT_MAX_DPL || g.n_kv_head <= 0 || g.n_head % g.n_kv_head) {
        exec_check(ex, cudaErrorInvalidValue, "attention: head_dim above 256 or bad GQA grouping");
        return;
    }
    attn_args a = {};
    a.q = q; a.k = k_cache; a.v = v_cache; a.out = out;
    a.n = n; a.pos0 = pos0; a.n_head = g.n_head; a.n_kv_head = g.n_kv_head;
    a.head_dim = g.head_dim; a.window = g.window; a.scale = g.scale;
    const int group = g.n_head / g.n_kv_head;
    const int tiles = (n * group + ATT_WARPS - 1) / ATT_WARPS;
    // keys one block may have to visit (its rows' union range)
    const int keys = pos0 + n - (g.window > 0 ? std::max(0, pos0 - g.window + 1) : 0);
    int n_splits = 1;
    if (n <= SPLIT_MAX_ROWS && ex->attn_partial) {
        int want = (2 * ex->sm_count + tiles * g.n_kv_head - 1) / (tiles * g.n_kv_head);
        int most = (keys + SPLIT_MIN_KEYS - 1) / SPLIT_MIN_KEYS;
        n_splits = std::max(1, std::min(want, most));
    }
    a.keys_per_split = (keys + n_splits - 1) / n_splits;
    a.keys_per_split = (a.keys_per_split + ATT_KT - 1) / ATT_KT * ATT_KT;
    n_splits = (keys + a.keys_per_split - 1) / a.keys_per_split;
    a.n_splits = n_splits;
    if (n_splits > 1) {
        size_t need = (size_t)n * g.n_head * n_splits * (g.head_dim + 2);
        if (need > ex->attn_partial_floats) {   // cannot happen with the sizes of exec_create
            exec_check(ex, cudaErrorInvalidValue, "attention: split scratch too small");
            return;
        }
        a.partial = ex->attn_partial;
    }
    const size_t smem = (size_t)(2 * ATT_KT * (g.head_dim + 1) + ATT_WARPS * g.head_dim) * sizeof(float);
    dim3 grid(tiles, g.n_kv_head, n_splits);
    const int dpl = (g.head_dim + 31) / 32;
    if (dpl <= 1) launch_dpl<1>(ex, a, grid, smem);
    else if (dpl <= 2) launch_dpl<2>(ex, a, grid, smem);
    else if (dpl <= 4) launch_dpl<4>(ex, a, grid, smem);
    else launch_dpl<8>(ex, a, grid, smem);
    if (n_splits > 1) {
        attention_merge_kernel<<<n * g.n_head, 128, 0, ex->stream>>>(a.partial, g.n_head,
                                                                      g.head_dim, n_splits, out);
        EXEC_LAUNCHED(ex, "attention (merge)");
    }
}

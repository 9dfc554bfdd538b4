// cuda_tree_attention.cu — tree speculation's ops (backend.h, tl_tree): RoPE at the tree
// nodes' positions and attention along each node's path. Simple kernels, for the few rows
// of one verification: the tree (positions and ancestor masks, under 1 KB) travels as a
// kernel argument, so nothing is uploaded; one warp per (query row, head) walks the
// visible keys in cache-row order with an online softmax, each lane holding head_dim / 32
// of the output. Correct before fast: no splitting of long prefixes over blocks.
#include "cuda_common.cuh"
#include "cuda_rope.cuh"

namespace {

constexpr int TREE_WARPS = 4;        // (row, head) items per block
constexpr int TREE_MAX_DPL = 8;      // head_dim <= 256

// One thread per (row, head, pair), as rope_kernel, at the tree's positions.
__global__ void rope_tree_kernel(float *x, int n, int n_heads, int head_dim, tl_tree tree, int first, int pairs,
                                 int style, rope_freqs freqs) {
    pdl_wait();
    pdl_trigger();
    rope_rows(x, n, n_heads, head_dim, pairs, style, freqs, rope_listed{ tree.pos + first });
}

struct tree_attn_args {
    const float *q;
    const void *k, *v;   // the cache's elements (the kernel's T)
    float *out;
    int n, first, n_head, n_kv_head, head_dim, window;
    float scale;
    kv_pages pg;
};

// Whether key `j` (a cache row) is visible to tree node `node` at position pos.
__device__ __forceinline__ bool tree_key_visible(const tl_tree &t, int node, int pos, int j, int window) {
    if (j < t.n_prefix) return window <= 0 || pos - j < window;
    const int m = j - t.n_prefix;
    return (t.visible[node] >> m & 1) && (window <= 0 || pos - t.pos[m] < window);
}

template <typename T>
__global__ void __launch_bounds__(TREE_WARPS * 32) tree_attention_kernel(tree_attn_args a, tl_tree t) {
    pdl_wait();
    pdl_trigger();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int item = blockIdx.x * TREE_WARPS + warp;
    if (item >= a.n * a.n_head) return;
    const int i = item / a.n_head, h = item % a.n_head, node = a.first + i;
    const int pos = t.pos[node], kvh = h / (a.n_head / a.n_kv_head), hd = a.head_dim;
    const size_t kv_stride = (size_t)a.n_kv_head * hd;
    const float *q = a.q + ((size_t)i * a.n_head + h) * hd;
    float qv[TREE_MAX_DPL], acc[TREE_MAX_DPL];
    for (int r = 0; r < TREE_MAX_DPL; r++) {
        const int dim = lane + 32 * r;
        qv[r] = dim < hd ? q[dim] : 0.0f;
        acc[r] = 0.0f;
    }
    float max = -INFINITY, sum = 0.0f;
    const int first_key = a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
    for (int j = first_key; j < t.n_prefix + t.n_nodes; j++) {
        if (!tree_key_visible(t, node, pos, j, a.window)) continue;
        const T *key = kv_row(static_cast<const T *>(a.k), a.pg, 0, j, kv_stride) + (size_t)kvh * hd;
        const T *val = kv_row(static_cast<const T *>(a.v), a.pg, 1, j, kv_stride) + (size_t)kvh * hd;
        float dot = 0.0f;
        for (int r = 0; r < TREE_MAX_DPL; r++) {
            const int dim = lane + 32 * r;
            if (dim < hd) dot += qv[r] * kv_get(key[dim]);
        }
        for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        const float score = dot * a.scale;
        const float new_max = fmaxf(max, score);
        const float keep = expf(max - new_max), w = expf(score - new_max);
        sum = sum * keep + w;
        for (int r = 0; r < TREE_MAX_DPL; r++) {
            const int dim = lane + 32 * r;
            acc[r] = acc[r] * keep + (dim < hd ? w * kv_get(val[dim]) : 0.0f);
        }
        max = new_max;
    }
    float *o = a.out + ((size_t)i * a.n_head + h) * hd;
    for (int r = 0; r < TREE_MAX_DPL; r++) {
        const int dim = lane + 32 * r;
        if (dim < hd) o[dim] = acc[r] / sum;
    }
}

}  // namespace

void launch_rope_tree(tl_exec *ex, float *x, int n, int n_heads, int head_dim, const tl_tree &tree, int first,
                      const tl_rope_params &p) {
    const int pairs = p.rope_dims / 2;
    const size_t count = (size_t)n * n_heads * pairs;
    if (count == 0) return;
    if (pairs > ROPE_MAX_PAIRS || first < 0 || first + n > tree.n_nodes || tree.n_nodes > TL_TREE_MAX_NODES) {
        exec_check(ex, cudaErrorInvalidValue, "rope (tree): rope_dims above 256 or rows outside the tree");
        return;
    }
    launch(ex, "rope (tree)", rope_tree_kernel, (int)((count + 255) / 256), 256, 0, x, n, n_heads, head_dim, tree,
           first, pairs, p.style, rope_frequencies(p));
}

void launch_tree_attention(tl_exec *ex, const float *q, int n, const tl_tree &tree, int first, const void *k_cache,
                           const void *v_cache, const tl_attn_geom &g, float *out, const kv_pages &pg, bool half) {
    if (n <= 0) return;
    if (g.head_dim <= 0 || g.head_dim > 32 * TREE_MAX_DPL || g.n_kv_head <= 0 || g.n_head % g.n_kv_head ||
        first < 0 || first + n > tree.n_nodes || tree.n_nodes > TL_TREE_MAX_NODES) {
        exec_check(ex, cudaErrorInvalidValue, "attention (tree): head_dim above 256, bad GQA grouping or rows "
                                              "outside the tree");
        return;
    }
    tree_attn_args a = { q, k_cache, v_cache, out, n, first, g.n_head, g.n_kv_head, g.head_dim, g.window, g.scale, pg };
    const int items = n * g.n_head;
    launch(ex, "attention (tree)", half ? tree_attention_kernel<__half> : tree_attention_kernel<float>,
           (items + TREE_WARPS - 1) / TREE_WARPS, TREE_WARPS * 32, 0, a, tree);
}

// cuda_attention.cu — causal attention with GQA and sliding window over the fp32 KV
// cache, flash style: scores never leave the chip, softmax is online in fp32.
//
// Prefill (n > 8 query rows): one block serves one KV head and a tile of 8 "items"
// (an item = one query row x one query head of that KV head's group), one warp per
// item, staging 32 keys and values at a time in shared memory, shared by the GQA
// group and neighbouring rows.
//
// Decode (n <= 8): the key range is split over blocks (split-sequence), 32 keys or more
// per split, so that a single query row spreads its few hundred keys over the whole GPU
// instead of walking them in one block. A block serves one KV head, up to 4 items and
// one split; its 8 warps take 4 keys each per step, so every lane has 8 independent
// 16-byte loads (4 key rows, 4 value rows, 4 dims each for head_dim 128) in flight.
// Lanes own consecutive dims; a score is a warp sum. The warps' partial softmax
// states meet in shared memory; each split block writes its state, and the last block
// of a (KV head, item tile) to finish (an atomic counter) merges the splits' states in
// split order, so decode attention is one launch. The split geometry is derived on the device from the position and the number of splits
// (gridDim.z), so a recorded decode step launches a grid sized for max_seq and
// replays at any position: splits past the last key exit at once, and the merge reads
// only the splits in use.
#include "cuda_common.cuh"

#include <algorithm>
#include <cmath>

namespace {

constexpr int ATT_WARPS = 8;        // prefill: items per block
constexpr int ATT_KT = 32;          // prefill: keys per shared-memory tile (one per lane)
constexpr int ATT_MAX_DPL = 8;      // head_dim <= 256: dims per lane

constexpr int DEC_WARPS = 8;        // decode: warps per block
constexpr int DEC_KEYS = 4;         // decode: keys per warp per step
constexpr int DEC_ITEMS = 4;        // decode: items per block (query heads sharing K/V loads)
constexpr int SPLIT_KEYS = DEC_WARPS * DEC_KEYS;   // one step of a block: the split granularity
constexpr int SPLIT_MAX_ROWS = 8;   // decode-sized calls
constexpr int MAX_SPLITS = 128;     // bounds the scratch; longer sequences get longer splits

struct attn_args {
    const float *q, *k, *v;
    float *out;
    pos_arg pos0;
    int n, n_head, n_kv_head, head_dim, window;
    float scale;
    kv_pages pg;   // table nullptr: k / v are the slot's contiguous rows
};

// Decode: partial states of split s of item (row, head) at index (row * n_head + head)
// * gridDim.z + s: part_acc holds head_dim floats each, part_ml (max, sum) pairs.
struct decode_args {
    attn_args a;
    float *part_acc;   // NULL: one split, the block writes the output
    float *part_ml;
    int *arrivals;     // per (item tile, KV head): split blocks done; the last resets it to 0
    int vec;           // head_dim, strides and pointers allow vector accesses of DPL floats
};

__device__ __host__ __forceinline__ int first_key(int pos, int window) {
    return window > 0 ? (pos - window + 1 > 0 ? pos - window + 1 : 0) : 0;
}

// Keys per split for `keys` keys over at most `splits` splits: whole steps of a block,
// at least one. Host and device agree on it; the splits in use are ceil(keys / it).
__device__ __host__ __forceinline__ int split_keys(int keys, int splits) {
    int per = (keys + splits - 1) / splits;
    per = (per + SPLIT_KEYS - 1) / SPLIT_KEYS * SPLIT_KEYS;
    return per > 0 ? per : SPLIT_KEYS;
}

// ---- prefill ---------------------------------------------------------------------------

template <int DPL>
__global__ void __launch_bounds__(ATT_WARPS * 32) attention_kernel(attn_args a) {
    pdl_wait();
    pdl_trigger();
    extern __shared__ float smem[];
    const int hd = a.head_dim, ld = hd + 1;   // +1: lanes reading different keys hit different banks
    float *ks = smem, *vs = ks + ATT_KT * ld, *qs = vs + ATT_KT * ld;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = a.n_head / a.n_kv_head, kvh = blockIdx.y;
    const int kvd = a.n_kv_head * hd, qd = a.n_head * hd;
    const int n_items = a.n * group;
    const int item0 = blockIdx.x * ATT_WARPS;
    const int item = item0 + warp;
    const bool active = item < n_items;
    const int row = active ? item / group : 0;
    const int head = kvh * group + (active ? item % group : 0);
    const int pos0 = pos_value(a.pos0);
    const int pos = pos0 + row;

    // the block's key range: from the first row's window start to the last row
    const int last_item = min(n_items - 1, item0 + ATT_WARPS - 1);
    const int start = first_key(pos0 + item0 / group, a.window);
    const int end = pos0 + last_item / group;
    const int my_lo = first_key(pos, a.window), my_hi = pos;

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
            size_t col = (size_t)kvh * hd + d;
            ks[j * ld + d] = kv_row(a.k, a.pg, 0, t0 + j, kvd)[col];
            vs[j * ld + d] = kv_row(a.v, a.pg, 1, t0 + j, kvd)[col];
        }
        __syncthreads();
        if (!active || t0 > my_hi || t0 + tile - 1 < my_lo) continue;
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
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    float *o = a.out + (size_t)row * qd + (size_t)head * hd;
#pragma unroll
    for (int k = 0; k < DPL; k++) {
        int d = lane + 32 * k;
        if (d < hd) o[d] = acc[k] * inv;
    }
}

// ---- decode ------------------------------------------------------------------------------

// Dims lane*DPL .. lane*DPL+DPL-1 of a head-sized vector; 0 past head_dim.
template <int DPL>
__device__ __forceinline__ void load_dims(const float *p, int lane, int hd, int vec, float (&v)[DPL]) {
    const int d0 = lane * DPL;
    if (vec && DPL >= 2) {
        // vec: hd % DPL == 0, so a lane's dims are all in or all out
        if (d0 < hd) {
            if (DPL == 2) {
                const float2 f = *reinterpret_cast<const float2 *>(p + d0);
                v[0] = f.x; v[1] = f.y;
            } else {
#pragma unroll
                for (int h = 0; h < DPL / 4; h++) {
                    const float4 f = *reinterpret_cast<const float4 *>(p + d0 + 4 * h);
                    v[4 * h] = f.x; v[4 * h + 1] = f.y; v[4 * h + 2] = f.z; v[4 * h + 3] = f.w;
                }
            }
        } else {
#pragma unroll
            for (int k = 0; k < DPL; k++) v[k] = 0.0f;
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < DPL; k++) v[k] = d0 + k < hd ? p[d0 + k] : 0.0f;
}

template <int DPL>
__device__ __forceinline__ void store_dims(float *p, int lane, int hd, const float (&v)[DPL]) {
    const int d0 = lane * DPL;
#pragma unroll
    for (int k = 0; k < DPL; k++)
        if (d0 + k < hd) p[d0 + k] = v[k];
}

// load_dims for states other blocks of the same launch wrote: read from L2 (never a
// stale L1 line).
template <int DPL>
__device__ __forceinline__ void load_dims_l2(const float *p, int lane, int hd, float (&v)[DPL]) {
    const int d0 = lane * DPL;
#pragma unroll
    for (int k = 0; k < DPL; k++) v[k] = d0 + k < hd ? __ldcg(p + d0 + k) : 0.0f;
}

// Fold the softmax state (mb, lb, accb) into (m, l, acc); an empty state (lb == 0)
// changes nothing.
template <int DPL>
__device__ __forceinline__ void merge_state(float &m, float &l, float (&acc)[DPL], float mb, float lb,
                                            const float (&accb)[DPL]) {
    if (!(lb > 0.0f)) return;
    const float mn = fmaxf(m, mb);
    const float fa = expf(m - mn), fb = expf(mb - mn);   // m = -inf: fa = 0
    l = l * fa + lb * fb;
#pragma unroll
    for (int k = 0; k < DPL; k++) acc[k] = acc[k] * fa + accb[k] * fb;
    m = mn;
}

// The states of `items` items kept by `warps` warps in shared memory at st[(warp *
// items + t) * (hd + 2)] as (m, l, acc[hd]), merged in warp order for item t.
template <int DPL>
__device__ __forceinline__ void combine_warps(const float *st, int items, int t, int lane, int hd, float &m,
                                              float &l, float (&acc)[DPL], int warps = DEC_WARPS) {
    m = -INFINITY;
    l = 0.0f;
#pragma unroll
    for (int k = 0; k < DPL; k++) acc[k] = 0.0f;
    for (int w = 0; w < warps; w++) {
        const float *s = st + (size_t)(w * items + t) * (hd + 2);
        float accb[DPL];
        load_dims<DPL>(s + 2, lane, hd, 0, accb);
        merge_state<DPL>(m, l, acc, s[0], s[1], accb);
    }
}

template <int DPL>
__device__ __forceinline__ void keep_warp_state(float *st, int items, int t, int warp, int lane, int hd, float m,
                                                float l, const float (&acc)[DPL]) {
    float *s = st + (size_t)(warp * items + t) * (hd + 2);
    if (lane == 0) {
        s[0] = m;
        s[1] = l;
    }
    store_dims<DPL>(s + 2, lane, hd, acc);
}

// Decode: the states of the `used` splits of the block's items folded in a fixed
// order, then out = acc / l. Warp w folds splits w / DEC_ITEMS, + 2, + 4, ... of item
// w % DEC_ITEMS; the two halves meet in shared memory (st, as the decode kernel's).
template <int DPL>
__device__ void merge_splits(const decode_args &d, float *st, int used, int item0, int n_items, int group,
                             int kvh) {
    constexpr int HALVES = DEC_WARPS / DEC_ITEMS;
    const attn_args &a = d.a;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, hd = a.head_dim;
    const int t = warp % DEC_ITEMS, half = warp / DEC_ITEMS, item = item0 + t;
    const int row = item / group, head = kvh * group + item % group;
    float m = -INFINITY, l = 0.0f, acc[DPL];
#pragma unroll
    for (int k = 0; k < DPL; k++) acc[k] = 0.0f;
    if (item < n_items) {
        const size_t idx0 = ((size_t)row * a.n_head + head) * gridDim.z;
        for (int s = half; s < used; s += HALVES) {
            float accb[DPL];
            load_dims_l2<DPL>(d.part_acc + (idx0 + s) * hd, lane, hd, accb);
            merge_state<DPL>(m, l, acc, __ldcg(d.part_ml + 2 * (idx0 + s)), __ldcg(d.part_ml + 2 * (idx0 + s) + 1),
                             accb);
        }
    }
    __syncthreads();   // st is free again
    keep_warp_state<DPL>(st, DEC_ITEMS, t, half, lane, hd, m, l, acc);
    __syncthreads();
    if (half != 0 || item >= n_items) return;
    combine_warps<DPL>(st, DEC_ITEMS, t, lane, hd, m, l, acc, HALVES);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int k = 0; k < DPL; k++) acc[k] *= inv;
    store_dims<DPL>(a.out + ((size_t)row * a.n_head + head) * hd, lane, hd, acc);
}

template <int DPL>
__global__ void __launch_bounds__(DEC_WARPS * 32) attention_decode_kernel(decode_args d) {
    extern __shared__ float st[];   // DEC_WARPS x DEC_ITEMS states of hd + 2 floats
    const attn_args &a = d.a;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hd = a.head_dim, group = a.n_head / a.n_kv_head, kvh = blockIdx.x;
    const int kvd = a.n_kv_head * hd, qd = a.n_head * hd;
    const int n_items = a.n * group;
    // The position is a step parameter, set before the step (uploaded, or advanced by
    // the previous step's chained argmax, its last kernel) and not changed during it:
    // read before the wait, so that splits past the last key (most of a grid sized for
    // max_seq) leave without waiting for the previous kernel.
    const int pos0 = pos_value(a.pos0);
    const int lo_all = first_key(pos0, a.window);
    const int keys = pos0 + a.n - lo_all;
    const int per = split_keys(keys, gridDim.z);
    if ((int)blockIdx.z * per >= keys) return;   // a split past the last key (the whole block)
    const int s_lo = lo_all + (int)blockIdx.z * per;
    const int s_hi = min(pos0 + a.n - 1, s_lo + per - 1);
    const size_t col = (size_t)kvh * hd;
    // The warp's first keys: rows before pos0 were written by earlier steps, so they are
    // requested before the wait (their latency overlaps the previous kernel); rows from
    // pos0 on come from the previous kernel and are read after it.
    float kr[DEC_KEYS][DPL], vr[DEC_KEYS][DPL];
    const int first0 = s_lo + warp * DEC_KEYS;
#pragma unroll
    for (int j = 0; j < DEC_KEYS; j++) {
        const int key = min(first0 + j, s_hi);   // past the split: a valid row, scored -inf below
        if (key >= pos0) continue;
        load_dims<DPL>(kv_row(a.k, a.pg, 0, key, kvd) + col, lane, hd, d.vec, kr[j]);
        load_dims<DPL>(kv_row(a.v, a.pg, 1, key, kvd) + col, lane, hd, d.vec, vr[j]);
    }
    pdl_wait();
    pdl_trigger();
#pragma unroll
    for (int j = 0; j < DEC_KEYS; j++) {
        const int key = min(first0 + j, s_hi);
        if (key < pos0) continue;
        load_dims<DPL>(kv_row(a.k, a.pg, 0, key, kvd) + col, lane, hd, d.vec, kr[j]);
        load_dims<DPL>(kv_row(a.v, a.pg, 1, key, kvd) + col, lane, hd, d.vec, vr[j]);
    }

    float q[DEC_ITEMS][DPL], acc[DEC_ITEMS][DPL], m[DEC_ITEMS], l[DEC_ITEMS];
    int lo[DEC_ITEMS], hi[DEC_ITEMS];
#pragma unroll
    for (int t = 0; t < DEC_ITEMS; t++) {
        const int item = blockIdx.y * DEC_ITEMS + t;
        m[t] = -INFINITY;
        l[t] = 0.0f;
#pragma unroll
        for (int k = 0; k < DPL; k++) acc[t][k] = 0.0f;
        lo[t] = 1;
        hi[t] = 0;   // empty
#pragma unroll
        for (int k = 0; k < DPL; k++) q[t][k] = 0.0f;
        if (item < n_items) {
            const int row = item / group, head = kvh * group + item % group;
            load_dims<DPL>(a.q + (size_t)row * qd + (size_t)head * hd, lane, hd, d.vec, q[t]);
#pragma unroll
            for (int k = 0; k < DPL; k++) q[t][k] *= a.scale;
            lo[t] = max(first_key(pos0 + row, a.window), s_lo);
            hi[t] = min(pos0 + row, s_hi);
        }
    }

    for (int key0 = first0; key0 <= s_hi; key0 += DEC_WARPS * DEC_KEYS) {
        if (key0 != first0) {
#pragma unroll
            for (int j = 0; j < DEC_KEYS; j++) {
                const int key = min(key0 + j, s_hi);
                load_dims<DPL>(kv_row(a.k, a.pg, 0, key, kvd) + col, lane, hd, d.vec, kr[j]);
                load_dims<DPL>(kv_row(a.v, a.pg, 1, key, kvd) + col, lane, hd, d.vec, vr[j]);
            }
        }
#pragma unroll
        for (int t = 0; t < DEC_ITEMS; t++) {
            float s[DEC_KEYS], smax = -INFINITY;
#pragma unroll
            for (int j = 0; j < DEC_KEYS; j++) {
                float dot = 0.0f;
#pragma unroll
                for (int k = 0; k < DPL; k++) dot = fmaf(q[t][k], kr[j][k], dot);
                dot = warp_sum(dot);
                const int key = key0 + j;
                s[j] = key >= lo[t] && key <= hi[t] ? dot : -INFINITY;
                smax = fmaxf(smax, s[j]);
            }
            const float m_new = fmaxf(m[t], smax);
            if (m_new == -INFINITY) continue;   // no key of this step for the item (warp-uniform)
            const float corr = expf(m[t] - m_new);
            float psum = 0.0f;
#pragma unroll
            for (int k = 0; k < DPL; k++) acc[t][k] *= corr;
#pragma unroll
            for (int j = 0; j < DEC_KEYS; j++) {
                const float p = expf(s[j] - m_new);   // -inf: 0
                psum += p;
#pragma unroll
                for (int k = 0; k < DPL; k++) acc[t][k] = fmaf(p, vr[j][k], acc[t][k]);
            }
            l[t] = l[t] * corr + psum;
            m[t] = m_new;
        }
    }

#pragma unroll
    for (int t = 0; t < DEC_ITEMS; t++) keep_warp_state<DPL>(st, DEC_ITEMS, t, warp, lane, hd, m[t], l[t], acc[t]);
    __syncthreads();
    const int item = blockIdx.y * DEC_ITEMS + warp;
    const bool own = warp < DEC_ITEMS && item < n_items;   // warp t finishes item t
    const int row = item / group, head = kvh * group + item % group;
    if (own) {
        float mb, lb, accb[DPL];
        combine_warps<DPL>(st, DEC_ITEMS, warp, lane, hd, mb, lb, accb);
        if (!d.part_acc) {
            const float inv = lb > 0.0f ? 1.0f / lb : 0.0f;
#pragma unroll
            for (int k = 0; k < DPL; k++) accb[k] *= inv;
            store_dims<DPL>(a.out + (size_t)row * qd + (size_t)head * hd, lane, hd, accb);
        } else {
            const size_t idx = ((size_t)row * a.n_head + head) * gridDim.z + blockIdx.z;
            if (lane == 0) {
                d.part_ml[2 * idx] = mb;
                d.part_ml[2 * idx + 1] = lb;
            }
            store_dims<DPL>(d.part_acc + idx * hd, lane, hd, accb);
        }
    }
    if (!d.part_acc) return;

    // The last split block of this (tile, KV head) to arrive merges every split's state.
    __shared__ int last;
    __threadfence();   // this block's state is visible before it counts itself
    __syncthreads();
    if (threadIdx.x == 0) {
        int *count = d.arrivals + blockIdx.y * gridDim.x + blockIdx.x;
        const int used = (keys + per - 1) / per;
        last = atomicAdd(count, 1) == used - 1;
        if (last) *count = 0;   // for the next launch (stream order)
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    merge_splits<DPL>(d, st, (keys + per - 1) / per, blockIdx.y * DEC_ITEMS, n_items, group, kvh);
}

// ---- launch ------------------------------------------------------------------------------

template <int DPL>
void prefill_dpl(tl_exec *ex, const attn_args &a) {
    const int tiles = (a.n * (a.n_head / a.n_kv_head) + ATT_WARPS - 1) / ATT_WARPS;
    const size_t smem = (size_t)(2 * ATT_KT * (a.head_dim + 1) + ATT_WARPS * a.head_dim) * sizeof(float);
    if (smem > 48 * 1024) {
        cudaError_t err = cudaFuncSetAttribute(attention_kernel<DPL>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (exec_check(ex, err, "attention (shared memory size)")) return;
    }
    launch(ex, "attention", attention_kernel<DPL>, dim3(tiles, a.n_kv_head), ATT_WARPS * 32, smem, a);
}

template <int DPL>
void decode_dpl(tl_exec *ex, const decode_args &d, int n_splits) {
    const attn_args &a = d.a;
    const int tiles = (a.n * (a.n_head / a.n_kv_head) + DEC_ITEMS - 1) / DEC_ITEMS;
    // at most 8 x 4 x 258 floats (33 KB): no opt-in needed
    const size_t smem = (size_t)DEC_WARPS * DEC_ITEMS * (a.head_dim + 2) * sizeof(float);
    launch(ex, "attention (decode)", attention_decode_kernel<DPL>, dim3(a.n_kv_head, tiles, n_splits),
           DEC_WARPS * 32, smem, d);
}

int max_splits(int max_seq) {
    const int by_keys = (std::max(max_seq, 1) + SPLIT_KEYS - 1) / SPLIT_KEYS;
    return std::min(MAX_SPLITS, by_keys);
}

bool aligned16(const void *p) { return (uintptr_t)p % 16 == 0; }

}  // namespace

// Split states, then the arrival counters (one int per item tile and KV head: at most
// SPLIT_MAX_ROWS * n_head), which start at zero (exec_create clears the scratch).
static size_t attention_state_floats(int n_head, int head_dim, int max_seq) {
    return (size_t)SPLIT_MAX_ROWS * n_head * max_splits(max_seq) * (head_dim + 2);
}

size_t attention_partial_floats(int n_head, int head_dim, int max_seq) {
    return attention_state_floats(n_head, head_dim, max_seq) + (size_t)SPLIT_MAX_ROWS * n_head;
}

void launch_attention(tl_exec *ex, const float *q, int n, int pos0, const float *k_cache,
                      const float *v_cache, const tl_attn_geom &g, float *out, const kv_pages &pg) {
    if (n <= 0) return;
    if (g.head_dim <= 0 || g.head_dim > 32 * ATT_MAX_DPL || g.n_kv_head <= 0 || g.n_head % g.n_kv_head) {
        exec_check(ex, cudaErrorInvalidValue, "attention: head_dim above 256 or bad GQA grouping");
        return;
    }
    attn_args a = {};
    a.q = q; a.k = k_cache; a.v = v_cache; a.out = out;
    a.n = n; a.pos0 = step_pos(ex, pos0); a.n_head = g.n_head; a.n_kv_head = g.n_kv_head;
    a.head_dim = g.head_dim; a.window = g.window; a.scale = g.scale; a.pg = pg;
    const int dpl = g.head_dim <= 32 ? 1 : g.head_dim <= 64 ? 2 : g.head_dim <= 128 ? 4 : 8;

    if (n > SPLIT_MAX_ROWS) {
        if (dpl == 1) prefill_dpl<1>(ex, a);
        else if (dpl == 2) prefill_dpl<2>(ex, a);
        else if (dpl == 4) prefill_dpl<4>(ex, a);
        else prefill_dpl<8>(ex, a);
        return;
    }

    decode_args d = {};
    d.a = a;
    d.vec = dpl >= 2 && g.head_dim % 4 == 0 && g.head_dim % dpl == 0 && aligned16(q) && aligned16(out) &&
            // pages: cudaMalloc'd, their rows n_kv_head * head_dim floats apart (head_dim % 4 == 0)
            (pg.table || (aligned16(k_cache) && aligned16(v_cache)));
    const int group = g.n_head / g.n_kv_head;
    const int tiles = (n * group + DEC_ITEMS - 1) / DEC_ITEMS;
    // keys of the rows' union range: now, or at most (a recorded step replays anywhere)
    int keys = pos0 + n - first_key(pos0, g.window);
    int splits;
    if (a.pos0.dev) {
        keys = ex->max_seq;
        if (g.window > 0) keys = std::min(keys, g.window + n - 1);
        splits = max_splits(keys);   // the device uses those the position needs
    } else {
        // about two blocks per multiprocessor
        const int want = std::min(MAX_SPLITS, std::max(1, 2 * ex->sm_count / (tiles * g.n_kv_head)));
        const int per = split_keys(keys, want);
        splits = (keys + per - 1) / per;
    }
    if (!ex->attn_partial) splits = 1;
    if (splits > 1) {
        const size_t states = (size_t)n * g.n_head * splits;
        if (states * (g.head_dim + 2) > attention_state_floats(g.n_head, g.head_dim, ex->max_seq)) {   // cannot happen with exec_create's sizes
            exec_check(ex, cudaErrorInvalidValue, "attention: split scratch too small");
            return;
        }
        d.part_acc = ex->attn_partial;
        d.part_ml = ex->attn_partial + states * g.head_dim;
        d.arrivals = reinterpret_cast<int *>(ex->attn_partial + attention_state_floats(g.n_head, g.head_dim, ex->max_seq));
    }
    if (dpl == 1) decode_dpl<1>(ex, d, splits);
    else if (dpl == 2) decode_dpl<2>(ex, d, splits);
    else if (dpl == 4) decode_dpl<4>(ex, d, splits);
    else decode_dpl<8>(ex, d, splits);
}

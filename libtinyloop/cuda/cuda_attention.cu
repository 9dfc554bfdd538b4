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
#include <cstring>
#include <type_traits>

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
    const float *q;
    const void *k, *v;   // the cache's elements: float, or __half (the kernels' T)
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

template <int DPL, typename T>
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
            ks[j * ld + d] = kv_get(kv_row(static_cast<const T *>(a.k), a.pg, 0, t0 + j, kvd)[col]);
            vs[j * ld + d] = kv_get(kv_row(static_cast<const T *>(a.v), a.pg, 1, t0 + j, kvd)[col]);
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

// load_dims of a cache row: floats, or fp16 elements widened to floats (vec: DPL halves
// in one load).
template <int DPL>
__device__ __forceinline__ void load_kv(const float *p, int lane, int hd, int vec, float (&v)[DPL]) {
    load_dims<DPL>(p, lane, hd, vec, v);
}
template <int DPL>
__device__ __forceinline__ void load_kv(const __half *p, int lane, int hd, int vec, float (&v)[DPL]) {
    const int d0 = lane * DPL;
    if constexpr (DPL >= 2) {
        if (vec) {   // hd % DPL == 0: a lane's dims are all in or all out
            __half2 h[DPL / 2];
            if (d0 >= hd) {
#pragma unroll
                for (int k = 0; k < DPL / 2; k++) h[k] = __float2half2_rn(0.0f);
            } else if constexpr (DPL == 2) {
                h[0] = *reinterpret_cast<const __half2 *>(p + d0);
            } else if constexpr (DPL == 4) {
                const uint2 u = *reinterpret_cast<const uint2 *>(p + d0);
                memcpy(h, &u, sizeof u);
            } else {
                const uint4 u = *reinterpret_cast<const uint4 *>(p + d0);
                memcpy(h, &u, sizeof u);
            }
#pragma unroll
            for (int k = 0; k < DPL / 2; k++) {
                const float2 f = __half22float2(h[k]);
                v[2 * k] = f.x;
                v[2 * k + 1] = f.y;
            }
            return;
        }
    }
#pragma unroll
    for (int k = 0; k < DPL; k++) v[k] = d0 + k < hd ? __half2float(p[d0 + k]) : 0.0f;
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

// The keys and items one decode block serves: query rows of one sequence whose cache is
// k / v (pg: its page table), the union of their key ranges [key_lo, key_hi], items
// item0 .. item0 + DEC_ITEMS - 1 (those below n_items), the row of item i being i / group
// at position row_pos0 + i / group, and keys from new_from on written by the previous
// kernel (the earlier ones are requested before the wait).
template <typename T>
struct decode_block {
    const T *k, *v;
    kv_pages pg;
    int key_lo, key_hi, new_from;
    int item0, n_items, row_pos0;
};

// One split of a decode block (blockIdx.x: the KV head, blockIdx.z: the split of gridDim.z):
// its keys' online softmax for the block's items, combined over the warps, then written
// as the split's state (or, with one split, as the output), the last split block of the
// (tile, KV head) merging every split's state. Returns at once for a split past the
// block's last key.
template <int DPL, typename T>
__device__ __forceinline__ void decode_split(const decode_args &d, const decode_block<T> &b, float *st) {
    const attn_args &a = d.a;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hd = a.head_dim, group = a.n_head / a.n_kv_head, kvh = blockIdx.x;
    const int kvd = a.n_kv_head * hd, qd = a.n_head * hd;
    const int keys = b.key_hi + 1 - b.key_lo;
    const int per = split_keys(keys, gridDim.z);
    if ((int)blockIdx.z * per >= keys) return;   // a split past the last key (the whole block)
    const int s_lo = b.key_lo + (int)blockIdx.z * per;
    const int s_hi = min(b.key_hi, s_lo + per - 1);
    const size_t col = (size_t)kvh * hd;
    // The warp's first keys: rows before new_from were written by earlier steps, so they
    // are requested before the wait (their latency overlaps the previous kernel); rows
    // from new_from on come from the previous kernel and are read after it.
    float kr[DEC_KEYS][DPL], vr[DEC_KEYS][DPL];
    const int first0 = s_lo + warp * DEC_KEYS;
#pragma unroll
    for (int j = 0; j < DEC_KEYS; j++) {
        const int key = min(first0 + j, s_hi);   // past the split: a valid row, scored -inf below
        if (key >= b.new_from) continue;
        load_kv<DPL>(kv_row(b.k, b.pg, 0, key, kvd) + col, lane, hd, d.vec, kr[j]);
        load_kv<DPL>(kv_row(b.v, b.pg, 1, key, kvd) + col, lane, hd, d.vec, vr[j]);
    }
    pdl_wait();
    pdl_trigger();
#pragma unroll
    for (int j = 0; j < DEC_KEYS; j++) {
        const int key = min(first0 + j, s_hi);
        if (key < b.new_from) continue;
        load_kv<DPL>(kv_row(b.k, b.pg, 0, key, kvd) + col, lane, hd, d.vec, kr[j]);
        load_kv<DPL>(kv_row(b.v, b.pg, 1, key, kvd) + col, lane, hd, d.vec, vr[j]);
    }

    float q[DEC_ITEMS][DPL], acc[DEC_ITEMS][DPL], m[DEC_ITEMS], l[DEC_ITEMS];
    int lo[DEC_ITEMS], hi[DEC_ITEMS];
#pragma unroll
    for (int t = 0; t < DEC_ITEMS; t++) {
        const int item = b.item0 + t;
        m[t] = -INFINITY;
        l[t] = 0.0f;
#pragma unroll
        for (int k = 0; k < DPL; k++) acc[t][k] = 0.0f;
        lo[t] = 1;
        hi[t] = 0;   // empty
#pragma unroll
        for (int k = 0; k < DPL; k++) q[t][k] = 0.0f;
        if (item < b.n_items) {
            const int row = item / group, head = kvh * group + item % group;
            load_dims<DPL>(a.q + (size_t)row * qd + (size_t)head * hd, lane, hd, d.vec, q[t]);
#pragma unroll
            for (int k = 0; k < DPL; k++) q[t][k] *= a.scale;
            lo[t] = max(first_key(b.row_pos0 + row, a.window), s_lo);
            hi[t] = min(b.row_pos0 + row, s_hi);
        }
    }

    for (int key0 = first0; key0 <= s_hi; key0 += DEC_WARPS * DEC_KEYS) {
        if (key0 != first0) {
#pragma unroll
            for (int j = 0; j < DEC_KEYS; j++) {
                const int key = min(key0 + j, s_hi);
                load_kv<DPL>(kv_row(b.k, b.pg, 0, key, kvd) + col, lane, hd, d.vec, kr[j]);
                load_kv<DPL>(kv_row(b.v, b.pg, 1, key, kvd) + col, lane, hd, d.vec, vr[j]);
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
    const int item = b.item0 + warp;
    const bool own = warp < DEC_ITEMS && item < b.n_items;   // warp t finishes item t
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
    merge_splits<DPL>(d, st, (keys + per - 1) / per, b.item0, b.n_items, group, kvh);
}

// n query rows at consecutive positions of one sequence; a block serves DEC_ITEMS items
// (blockIdx.y: the item tile) of any of them.
template <int DPL, typename T>
__global__ void __launch_bounds__(DEC_WARPS * 32) attention_decode_kernel(decode_args d) {
    extern __shared__ float st[];   // DEC_WARPS x DEC_ITEMS states of hd + 2 floats
    const attn_args &a = d.a;
    const int group = a.n_head / a.n_kv_head;
    // The position is a step parameter, set before the step (uploaded, or advanced by
    // the previous step's chained argmax, its last kernel) and not changed during it:
    // read before the wait, so that splits past the last key (most of a grid sized for
    // max_seq) leave without waiting for the previous kernel.
    const int pos0 = pos_value(a.pos0);
    const decode_block<T> b = { static_cast<const T *>(a.k), static_cast<const T *>(a.v), a.pg,
                                first_key(pos0, a.window), pos0 + a.n - 1, pos0,
                                (int)blockIdx.y * DEC_ITEMS, a.n * group, pos0 };
    decode_split<DPL, T>(d, b, st);
}

// A batched step's rows (the *_rows ops), each of its own sequence: blockIdx.y is row
// y / tiles and item tile y % tiles of that row's query heads. A row's position and slot
// come from the step's row table, uploaded before the step (read before the wait, like a
// step parameter); a padding row (position -1) writes zeros.
struct rows_args {
    const int32_t *pos;
    const row_slot *slots;
    int tiles;   // item tiles per row
};

template <int DPL, typename T>
__global__ void __launch_bounds__(DEC_WARPS * 32) attention_rows_kernel(decode_args d, rows_args r) {
    extern __shared__ float st[];
    const attn_args &a = d.a;
    const int group = a.n_head / a.n_kv_head;
    const int row = (int)blockIdx.y / r.tiles, tile = (int)blockIdx.y % r.tiles;
    const int pos = r.pos[row];
    const int item0 = row * group + tile * DEC_ITEMS, n_items = (row + 1) * group;
    if (pos < 0) {
        if (blockIdx.z != 0) return;
        pdl_wait();
        pdl_trigger();
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, item = item0 + warp;
        if (warp < DEC_ITEMS && item < n_items) {
            float zero[DPL] = {};
            const int head = blockIdx.x * group + item % group;
            store_dims<DPL>(a.out + ((size_t)row * a.n_head + head) * a.head_dim, lane, a.head_dim, zero);
        }
        return;
    }
    const row_slot &slot = r.slots[row];
    const decode_block<T> b = { static_cast<const T *>(slot.k), static_cast<const T *>(slot.v), slot.pg,
                                first_key(pos, a.window), pos, pos, item0, n_items, pos - row };
    decode_split<DPL, T>(d, b, st);
}

// ---- launch ------------------------------------------------------------------------------

template <int DPL, typename T>
void prefill_dpl(tl_exec *ex, const attn_args &a) {
    const int tiles = (a.n * (a.n_head / a.n_kv_head) + ATT_WARPS - 1) / ATT_WARPS;
    const size_t smem = (size_t)(2 * ATT_KT * (a.head_dim + 1) + ATT_WARPS * a.head_dim) * sizeof(float);
    if (smem > 48 * 1024) {
        cudaError_t err = cudaFuncSetAttribute(attention_kernel<DPL, T>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (exec_check(ex, err, "attention (shared memory size)")) return;
    }
    launch(ex, "attention", attention_kernel<DPL, T>, dim3(tiles, a.n_kv_head), ATT_WARPS * 32, smem, a);
}

// at most 8 x 4 x 258 floats (33 KB): no opt-in needed
size_t decode_smem(int head_dim) { return (size_t)DEC_WARPS * DEC_ITEMS * (head_dim + 2) * sizeof(float); }

template <int DPL, typename T>
void decode_dpl(tl_exec *ex, const decode_args &d, int n_splits) {
    const attn_args &a = d.a;
    const int tiles = (a.n * (a.n_head / a.n_kv_head) + DEC_ITEMS - 1) / DEC_ITEMS;
    launch(ex, "attention (decode)", attention_decode_kernel<DPL, T>, dim3(a.n_kv_head, tiles, n_splits),
           DEC_WARPS * 32, decode_smem(a.head_dim), d);
}

template <int DPL, typename T>
void rows_dpl(tl_exec *ex, const decode_args &d, const rows_args &r, int n_splits) {
    launch(ex, "attention (rows)", attention_rows_kernel<DPL, T>, dim3(d.a.n_kv_head, d.a.n * r.tiles, n_splits),
           DEC_WARPS * 32, decode_smem(d.a.head_dim), d, r);
}

// f(integral_constant DPL, T{}) for the head size's dims per lane and the cache's type.
template <class F>
void dispatch_dpl(int head_dim, bool half, F &&f) {
    const int dpl = head_dim <= 32 ? 1 : head_dim <= 64 ? 2 : head_dim <= 128 ? 4 : 8;
    auto by_type = [&](auto d) {
        if (half) f(d, __half{});
        else f(d, float{});
    };
    if (dpl == 1) by_type(std::integral_constant<int, 1>{});
    else if (dpl == 2) by_type(std::integral_constant<int, 2>{});
    else if (dpl == 4) by_type(std::integral_constant<int, 4>{});
    else by_type(std::integral_constant<int, 8>{});
}

int max_splits(int max_seq) {
    const int by_keys = (std::max(max_seq, 1) + SPLIT_KEYS - 1) / SPLIT_KEYS;
    return std::min(MAX_SPLITS, by_keys);
}

bool aligned16(const void *p) { return (uintptr_t)p % 16 == 0; }

bool bad_geometry(tl_exec *ex, const tl_attn_geom &g) {
    if (g.head_dim > 0 && g.head_dim <= 32 * ATT_MAX_DPL && g.n_kv_head > 0 && g.n_head % g.n_kv_head == 0)
        return false;
    exec_check(ex, cudaErrorInvalidValue, "attention: head_dim above 256 or bad GQA grouping");
    return true;
}

// Vector accesses of a lane's dims: head sizes of whole vectors, q and out aligned, and
// the cache rows (contiguous slots aligned; pages cudaMalloc'd, their rows n_kv_head *
// head_dim elements apart).
int vector_dims(const tl_attn_geom &g, const float *q, const float *out, bool caches_aligned) {
    const int dpl = g.head_dim <= 32 ? 1 : g.head_dim <= 64 ? 2 : g.head_dim <= 128 ? 4 : 8;
    return dpl >= 2 && g.head_dim % 4 == 0 && g.head_dim % dpl == 0 && aligned16(q) && aligned16(out) &&
           caches_aligned;
}

}  // namespace

// Split states, then the arrival counters (one int per item tile and KV head: at most
// SPLIT_MAX_ROWS * n_head), which start at zero (exec_create clears the scratch).
static size_t attention_state_floats(int n_head, int head_dim, int max_seq) {
    return (size_t)SPLIT_MAX_ROWS * n_head * max_splits(max_seq) * (head_dim + 2);
}

size_t attention_partial_floats(int n_head, int head_dim, int max_seq) {
    return attention_state_floats(n_head, head_dim, max_seq) + (size_t)SPLIT_MAX_ROWS * n_head;
}

void launch_attention(tl_exec *ex, const float *q, int n, int pos0, const void *k_cache, const void *v_cache,
                      const tl_attn_geom &g, float *out, const kv_pages &pg, bool half) {
    if (n <= 0 || bad_geometry(ex, g)) return;
    attn_args a = {};
    a.q = q; a.k = k_cache; a.v = v_cache; a.out = out;
    a.n = n; a.pos0 = step_pos(ex, pos0); a.n_head = g.n_head; a.n_kv_head = g.n_kv_head;
    a.head_dim = g.head_dim; a.window = g.window; a.scale = g.scale; a.pg = pg;

    if (n > SPLIT_MAX_ROWS) {
        dispatch_dpl(g.head_dim, half, [&](auto d, auto t) { prefill_dpl<decltype(d)::value, decltype(t)>(ex, a); });
        return;
    }

    decode_args d = {};
    d.a = a;
    d.vec = vector_dims(g, q, out, pg.table || (aligned16(k_cache) && aligned16(v_cache)));
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
    dispatch_dpl(g.head_dim, half, [&](auto dd, auto t) { decode_dpl<decltype(dd)::value, decltype(t)>(ex, d, splits); });
}

// A batched step's rows: one launch, a block per (KV head, row and item tile, split). The
// splits are fixed by the row count and max_seq (a recorded step replays at any
// positions; each row's blocks use the splits its keys need): about two blocks per
// multiprocessor, within the split scratch (the states of SPLIT_MAX_ROWS rows at
// max_seq's splits), so many rows get one split each.
void launch_attention_rows(tl_exec *ex, const float *q, int n, const int32_t *pos, const row_slot *slots,
                           const tl_attn_geom &g, float *out, bool half) {
    if (n <= 0 || bad_geometry(ex, g)) return;
    decode_args d = {};
    d.a.q = q; d.a.out = out; d.a.n = n; d.a.n_head = g.n_head; d.a.n_kv_head = g.n_kv_head;
    d.a.head_dim = g.head_dim; d.a.window = g.window; d.a.scale = g.scale;
    // every row's slot is a KV buffer of the model: aligned as contiguous slots are (their
    // row 0 lies a whole number of rows into a cudaMalloc'd buffer) or paged
    d.vec = vector_dims(g, q, out, true);
    const int group = g.n_head / g.n_kv_head;
    const rows_args r = { pos, slots, (group + DEC_ITEMS - 1) / DEC_ITEMS };
    const int keys = g.window > 0 ? std::min(ex->max_seq, g.window) : ex->max_seq;
    const int blocks = g.n_kv_head * n * r.tiles;
    int splits = std::min(max_splits(keys), std::max(1, (2 * ex->sm_count + blocks - 1) / blocks));
    splits = std::min(splits, SPLIT_MAX_ROWS * max_splits(ex->max_seq) / n);
    if (!ex->attn_partial || !ex->step.rows.arrivals || splits < 1) splits = 1;
    if (splits > 1) {
        d.part_acc = ex->attn_partial;
        d.part_ml = ex->attn_partial + (size_t)n * g.n_head * splits * g.head_dim;
        d.arrivals = ex->step.rows.arrivals;
    }
    dispatch_dpl(g.head_dim, half, [&](auto dd, auto t) { rows_dpl<decltype(dd)::value, decltype(t)>(ex, d, r, splits); });
}

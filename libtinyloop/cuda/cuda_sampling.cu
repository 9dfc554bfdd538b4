// cuda_sampling.cu — a sampling step (sampling.h, docs/sampling.md) on the device, so
// that a decode step with any sampler settings copies back one token id. The host
// prepares the step (the penalty's tokens, the random number from sampling.c's
// generator); the scalar math is sample_math.h's, shared with the host, and the
// thresholds and the draw are computed here to the same definition as sample_row.c's
// tl_sample_row: the same token for the same logits, bit for bit.
//
// One block of 1024 threads serves the row, reading it from global memory (it stays
// in L1/L2) once per pass, so any vocabulary size works:
//   1. penalty (in place) and, in one pass, the row's max and greedy choice;
//   2. top-k: radix select of the k-th largest rank key by counts, 8 key bits a pass;
//   3. one pass for the total weight of the candidates (keys >= the top-k bound,
//      weights >= the min-p bound); none: the greedy choice;
//   4. top-p: radix select by weights, from the largest key down;
//   5. the draw: each thread sums the weights of its slice of ids, a block scan finds
//      the slice the point falls in, and that thread walks it.
// The selects stop at the first pass whose chosen bucket holds one candidate or is
// the last one needed, typically after two or three passes.
#include "cuda_common.cuh"

#include "base/sample_math.h"

#include <cmath>

namespace {

constexpr int SAMPLE_THREADS = 1024;
constexpr int SAMPLE_WARPS = SAMPLE_THREADS / 32;
constexpr int SAMPLE_BATCH = 4;            // loads in flight per thread in a pass
constexpr int PENALTY_BATCH = 256;         // penalised tokens per launch (kernel arguments)
constexpr int RADIX_BUCKETS = 256;         // 8 key bits per select pass

typedef unsigned long long u64;            // the type of CUDA's 64-bit atomics and shuffles

// Distinct tokens whose logits the penalty changes, passed by value.
struct penalty_list {
    float penalty;
    int n;
    int32_t tokens[PENALTY_BATCH];
};

struct sample_args {
    int vocab;
    int greedy;               // temperature <= 0: the argmax after the penalty
    float inv_temperature;
    int top_k;                // 0 = off (also when >= vocab)
    float top_p;              // >= 1 = off
    uint64_t min_weight;      // tl_sample_min_weight(min_p)
    uint64_t random;          // the step's output of the host's generator
    penalty_list penalty;     // the last (or only) batch of penalised tokens
};

// Which tokens a pass counts and with what mass: keys >= lower, and when weighted,
// weights >= min_weight (sample_row.c's candidates); mass 1 when only counting.
struct token_set {
    uint64_t lower;
    int weighted;
    float max, inv_temperature;
    uint64_t min_weight;

    __device__ uint64_t mass(float logit, uint64_t key) const {
        if (key < lower) return 0;
        if (!weighted) return 1;
        const uint64_t w = tl_sample_weight(logit, max, inv_temperature);
        return w >= min_weight ? w : 0;
    }
};

struct sample_shared {
    u64 bucket_mass[RADIX_BUCKETS];
    unsigned bucket_count[RADIX_BUCKETS];
    u64 warp_u64[SAMPLE_WARPS];
    float warp_f[SAMPLE_WARPS];
    int warp_i[SAMPLE_WARPS];
    int chosen_bucket;        // select: the bucket the walk ends in, -1 = none
    unsigned chosen_count;
    u64 chosen_above, chosen_kept;
    int token;
};

__device__ void apply_penalty(float *logits, int vocab, const penalty_list &p) {
    for (int i = threadIdx.x; i < p.n; i += blockDim.x) {
        const int32_t t = p.tokens[i];
        if (t >= 0 && t < vocab) logits[t] = tl_sample_penalize(logits[t], p.penalty);
    }
}

// Earlier batches of a long penalty list (tokens are distinct: no two threads write one logit).
__global__ void __launch_bounds__(PENALTY_BATCH) penalty_kernel(float *logits, int vocab, penalty_list p) {
    pdl_wait();
    pdl_trigger();
    apply_penalty(logits, vocab, p);
}

// fn(logit, id) for every logit of the row, SAMPLE_BATCH loads in flight per thread.
template <class Fn>
__device__ __forceinline__ void for_each_logit(const float *logits, int vocab, Fn fn) {
    for (int e0 = threadIdx.x; e0 < vocab; e0 += SAMPLE_THREADS * SAMPLE_BATCH) {
        float v[SAMPLE_BATCH];
#pragma unroll
        for (int k = 0; k < SAMPLE_BATCH; k++) {
            const int e = e0 + k * SAMPLE_THREADS;
            v[k] = e < vocab ? logits[e] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < SAMPLE_BATCH; k++) {
            const int e = e0 + k * SAMPLE_THREADS;
            if (e < vocab) fn(v[k], e);
        }
    }
}

// ---- block-wide reductions (every thread calls them and gets the result) -------------

__device__ u64 block_sum(u64 v, sample_shared &sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();   // warp_u64 may still be read by a previous reduction
    if ((threadIdx.x & 31) == 0) sh.warp_u64[threadIdx.x >> 5] = v;
    __syncthreads();
    u64 total = 0;
    for (int w = 0; w < SAMPLE_WARPS; w++) total += sh.warp_u64[w];
    return total;
}

// The sum of v over the threads before this one.
__device__ u64 block_exclusive_sum(u64 v, sample_shared &sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
    }
    __syncthreads();
    if (lane == 31) sh.warp_u64[warp] = incl;
    __syncthreads();
    u64 base = 0;
    for (int w = 0; w < warp; w++) base += sh.warp_u64[w];
    return base + incl - v;
}

__device__ float block_max(float v, sample_shared &sh) {
    v = warp_max(v);   // fmaxf: a NaN never wins
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh.warp_f[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = -INFINITY;
    for (int w = 0; w < SAMPLE_WARPS; w++) m = fmaxf(m, sh.warp_f[w]);
    return m;
}

// sample_row.c's argmax: (value, index) ranked by value, then smaller index, NaN never a
// candidate, so any reduction order gives the sequential scan's first maximum.
__device__ __forceinline__ void offer(float &best_v, int &best_i, float v, int i) {
    if (i >= 0 && !isnan(v) && (best_i < 0 || v > best_v || (v == best_v && i < best_i))) {
        best_v = v;
        best_i = i;
    }
}

__device__ int block_argmax(float v, int i, sample_shared &sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        offer(v, i, ov, oi);
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) {
        sh.warp_f[threadIdx.x >> 5] = v;
        sh.warp_i[threadIdx.x >> 5] = i;
    }
    __syncthreads();
    float bv = 0.0f;
    int bi = -1;
    for (int w = 0; w < SAMPLE_WARPS; w++) offer(bv, bi, sh.warp_f[w], sh.warp_i[w]);
    return bi;
}

// ---- selection ------------------------------------------------------------------------

// Adds each active lane's mass (and a count of 1) to its bucket. Lanes of a warp that
// share a bucket are combined first, so the shared-memory atomics do not serialise
// when most keys fall into a few buckets (the first pass: sign and exponent bits).
// Called by all 32 lanes of the warp together.
__device__ __forceinline__ void bucket_add(sample_shared &sh, bool active, int b, u64 m) {
    const unsigned lanes = __ballot_sync(0xffffffffu, active);
    if (!active) return;
    const unsigned peers = __match_any_sync(lanes, b);
    u64 sum = 0;
    for (unsigned rest = peers; rest; rest &= rest - 1) sum += __shfl_sync(peers, m, __ffs(rest) - 1);
    if ((int)(threadIdx.x & 31) == __ffs(peers) - 1) {
        atomicAdd(&sh.bucket_mass[b], sum);
        atomicAdd(&sh.bucket_count[b], (unsigned)__popc(peers));
    }
}

// One pass of a select: the members whose key has `prefix` in the bits under `mask`,
// counted and summed by the 8 key bits at `shift`. The loop bounds are the same for
// the lanes of a warp, so bucket_add runs converged.
__device__ void histogram_pass(const float *logits, int vocab, const token_set &set, uint64_t prefix,
                               uint64_t mask, int shift, sample_shared &sh) {
    const int lane = threadIdx.x & 31;
    for (int w0 = (int)threadIdx.x - lane; w0 < vocab; w0 += SAMPLE_THREADS * SAMPLE_BATCH) {
        float v[SAMPLE_BATCH];
#pragma unroll
        for (int k = 0; k < SAMPLE_BATCH; k++) {
            const int e = w0 + lane + k * SAMPLE_THREADS;
            v[k] = e < vocab ? logits[e] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < SAMPLE_BATCH; k++) {
            const int e = w0 + lane + k * SAMPLE_THREADS;
            u64 m = 0;
            int b = 0;
            if (e < vocab) {
                const uint64_t key = tl_sample_rank_key(v[k], e);
                if ((key & mask) == prefix) {
                    m = set.mass(v[k], key);
                    b = (int)(key >> shift) & (RADIX_BUCKETS - 1);
                }
            }
            bucket_add(sh, m != 0, b, m);
        }
    }
}

// sample_row.c's select_threshold, over the set's members as the row gives them:
// walking them from the largest rank key down, the key where the running sum of their
// masses first reaches need, 8 key bits per pass. Returns T with the members of key
// >= T exactly those walked, and their mass in *kept (0 if need exceeded the set's
// total, which the callers rule out).
__device__ uint64_t select_threshold(const float *logits, int vocab, const token_set &set, uint64_t need,
                                     sample_shared &sh, uint64_t *kept) {
    uint64_t prefix = 0;
    u64 above = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        const uint64_t mask = shift == 56 ? 0 : ~0ull << (shift + 8);
        __syncthreads();   // the previous pass's choice has been read
        for (int b = threadIdx.x; b < RADIX_BUCKETS; b += SAMPLE_THREADS) {
            sh.bucket_mass[b] = 0;
            sh.bucket_count[b] = 0;
        }
        if (threadIdx.x == 0) sh.chosen_bucket = -1;
        __syncthreads();
        histogram_pass(logits, vocab, set, prefix, mask, shift, sh);
        __syncthreads();
        // the first RADIX_BUCKETS threads (whole warps) scan the buckets from the top
        u64 incl = 0, m = 0;
        int b = 0;
        if (threadIdx.x < RADIX_BUCKETS) {
            b = RADIX_BUCKETS - 1 - threadIdx.x;
            m = sh.bucket_mass[b];
            incl = m;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u64 up = __shfl_up_sync(0xffffffffu, incl, o);
                if ((threadIdx.x & 31) >= o) incl += up;
            }
            if ((threadIdx.x & 31) == 31) sh.warp_u64[threadIdx.x >> 5] = incl;
        }
        __syncthreads();
        if (threadIdx.x < RADIX_BUCKETS) {
            u64 base = above;
            for (int w = 0; w < (int)(threadIdx.x >> 5); w++) base += sh.warp_u64[w];
            const u64 before = base + incl - m, through = base + incl;
            if (before < need && need <= through) {   // exactly one bucket
                sh.chosen_bucket = b;
                sh.chosen_count = sh.bucket_count[b];
                sh.chosen_above = before;
                sh.chosen_kept = through;
            }
        }
        __syncthreads();
        if (sh.chosen_bucket < 0) {
            *kept = 0;
            return prefix;
        }
        prefix |= (uint64_t)sh.chosen_bucket << shift;
        above = sh.chosen_above;
        // done once the walk ends at this bucket's last member
        if (sh.chosen_count == 1 || sh.chosen_kept == need || shift == 0) {
            *kept = sh.chosen_kept;
            return prefix;
        }
    }
    *kept = 0;
    return prefix;
}

// The draw: the member of the set, in id order, where the running sum of masses first
// exceeds r (< the set's total). Each thread holds a contiguous slice of ids.
__device__ int draw_member(const float *logits, int vocab, const token_set &set, uint64_t r,
                           int fallback, sample_shared &sh) {
    const int slice = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int lo = (int)threadIdx.x * slice;
    const int hi = lo + slice < vocab ? lo + slice : vocab;
    u64 mine = 0;
    for (int e = lo; e < hi; e++) mine += set.mass(logits[e], tl_sample_rank_key(logits[e], e));
    const u64 before = block_exclusive_sum(mine, sh);
    if (threadIdx.x == 0) sh.token = fallback;
    __syncthreads();
    if (before <= r && r < before + mine) {   // one thread: r falls in its slice
        u64 acc = before;
        for (int e = lo; e < hi; e++) {
            acc += set.mass(logits[e], tl_sample_rank_key(logits[e], e));
            if (r < acc) {
                sh.token = e;
                break;
            }
        }
    }
    __syncthreads();
    return sh.token;
}

__global__ void __launch_bounds__(SAMPLE_THREADS) sample_kernel(float *logits, sample_args a, int32_t *out) {
    pdl_wait();
    pdl_trigger();
    __shared__ sample_shared sh;
    const int vocab = a.vocab;
    apply_penalty(logits, vocab, a.penalty);
    __syncthreads();   // the block's penalised logits are visible to all its threads

    float max = -INFINITY, best_v = 0.0f;
    int best_i = -1;
    for_each_logit(logits, vocab, [&](float logit, int e) {
        max = fmaxf(max, logit);
        offer(best_v, best_i, logit, e);
    });
    max = block_max(max, sh);
    best_i = block_argmax(best_v, best_i, sh);
    // the sequential scan keeps index 0 when it is NaN
    const int greedy = (isnan(logits[0]) || best_i < 0) ? 0 : best_i;
    if (a.greedy) {
        if (threadIdx.x == 0) *out = greedy;
        return;
    }

    token_set set = { 0, 0, max, a.inv_temperature, a.min_weight };
    uint64_t total = 0;
    if (a.top_k > 0) set.lower = select_threshold(logits, vocab, set, (uint64_t)a.top_k, sh, &total);
    set.weighted = 1;
    u64 mine = 0;
    for_each_logit(logits, vocab, [&](float logit, int e) { mine += set.mass(logit, tl_sample_rank_key(logit, e)); });
    total = block_sum(mine, sh);
    if (total > 0 && a.top_p < 1.0f)
        set.lower = select_threshold(logits, vocab, set, tl_sample_top_p_need(total, a.top_p), sh, &total);
    // no weight left (infinities, NaN, a tiny temperature): the greedy choice
    const int token = total > 0 ? draw_member(logits, vocab, set, tl_sample_draw(a.random, total), greedy, sh)
                                : greedy;
    if (threadIdx.x == 0) *out = token;
}

penalty_list make_penalty_list(const int32_t *tokens, int n, float penalty) {
    penalty_list p = {};
    p.penalty = penalty;
    p.n = n;
    for (int i = 0; i < n; i++) p.tokens[i] = tokens[i];
    return p;
}

}  // namespace

void launch_sample(tl_exec *ex, float *logits, int vocab, const tl_sample_step *step, int32_t *d_out) {
    sample_args a = {};
    a.vocab = vocab;
    a.greedy = !(step->temperature > 0.0f);
    a.inv_temperature = step->inv_temperature;
    a.top_k = step->top_k > 0 && step->top_k < vocab ? step->top_k : 0;
    a.top_p = step->top_p;
    a.min_weight = tl_sample_min_weight(step->min_p);
    a.random = step->random;
    // every batch of the penalty but the last in a launch of its own, the last with the step
    const int32_t *tokens = step->penalized;
    int n = step->n_penalized > 0 ? step->n_penalized : 0;
    for (; n > PENALTY_BATCH; n -= PENALTY_BATCH, tokens += PENALTY_BATCH)
        launch(ex, "sample (penalty)", penalty_kernel, dim3(1), dim3(PENALTY_BATCH), 0, logits, vocab,
               make_penalty_list(tokens, PENALTY_BATCH, step->repetition_penalty));
    a.penalty = make_penalty_list(tokens, n, step->repetition_penalty);
    launch(ex, "sample", sample_kernel, dim3(1), dim3(SAMPLE_THREADS), 0, logits, a, d_out);
}

// cuda_matmul.cu — y = x W^T for every weight dtype, the embedding lookup and bias add.
//
// Decode (n <= 8 rows): a GEMV built to keep many weight bytes in flight per SM. A
// block of 8 warps first copies the n activation rows into shared memory (cp.async
// when aligned; each row is read by every output row of the block); then each "row
// group" of `split` warps
// computes gemv_tile::rows output rows: its lanes walk the row in 32-element chunks,
// a lane loading the raw chunks of all its rows for gemv_tile::unroll chunks at once
// (eight independent 16-byte loads for q4) before decoding any. Quantized chunks are
// reduced as scale * sum(code * x) + min * sum(x). The sum over codes is an integer
// dot product: each staged chunk of x is turned into 24-bit integers on a power-of-two
// grid of its own (act_records below), so the per-element work is two dp2a and one
// dp4a per four elements and input row, with no code conversion; float
// weights, and quantized ones with TINYLOOP_CUDA_DP4A=0, take the fp32 FMA path. Rows
// longer than one pass of a warp are split over several warps (`split`), whose
// partial sums meet in shared memory. Up to three matrices of one dtype applied to
// the same input (q/k/v, gate/up) share one launch: each block belongs to one of them,
// except in the paired epilogues (gemv_epilogue), where a row group's rows are a gated
// pair (gate, up: it writes act(gate) * up) or a rotary pair of q or k (it writes them
// rotated, k and v to the KV cache).
// Accumulation is fp32 and activations keep 24 significant bits: results track the
// float64 oracle tightly (docs/cuda-backend.md, GEMV).
// Prefill (n > 8): the tensor-core GEMM of cuda_gemm_tc.cu for q8/q4/q2/f16 weights;
// for f32/bf16 weights (or with TINYLOOP_CUDA_TC=0) a tiled fp32 GEMM whose weight
// tiles are decoded into shared memory one chunk per row. Both also serve decode rows
// too wide for the GEMV's shared memory.
#include "cuda_dequant.cuh"
#include "cuda_rope.cuh"

#include <algorithm>

namespace {

constexpr int GEMV_WARPS = 8;
constexpr int GEMV_THREADS = GEMV_WARPS * 32;
constexpr int GEMV_MAX_ROWS = 8;      // the largest n served by the GEMV
constexpr int GEMV_STAGE_BATCH = 2;   // activation loads in flight per thread while staging
constexpr size_t SMEM_DEFAULT = 48 * 1024;   // static + dynamic shared memory without opting in
// Set aside for a GEMV block's static shared memory (per-warp sums, residuals, norm
// statistics: ~2.7 KB for eight input rows) when sizing its dynamic part.
constexpr size_t GEMV_STATIC_SMEM = 4096;
// Blocks per SM the GEMV's register bound asks for, by input rows and epilogue (its
// launch bounds; the host sizes grids with the same number). Gated pairs have the
// largest grid (both matrices' rows) and keep it one wave with three blocks; the
// others' grids fit two, whose 128 registers a thread hold a round without spilling.
__host__ __device__ constexpr int gemv_blocks_per_sm(int rows, bool gated) {
    return rows <= 2 ? (gated ? 3 : 2) : rows <= 4 ? 2 : 1;
}

constexpr int GEMM_BM = 64;         // input rows per block
constexpr int GEMM_BN = 64;         // output features (weight rows) per block
constexpr int GEMM_BK = 32;         // one chunk
constexpr int GEMM_THREADS = 256;   // 16 x 16 threads, 4 x 4 outputs each

// Output rows per row group and chunks per lane per round: a lane holds 32 words of
// raw weights in flight (q4: 4 rows x 2 chunks x 16 bytes; f32: 1 row x 1 chunk).
template <int DT>
struct gemv_tile {
    static constexpr int rows = DT == TL_DTYPE_F32 ? 1 : (DT == TL_DTYPE_F16 || DT == TL_DTYPE_BF16) ? 2 : 4;
    static constexpr int unroll = (DT == TL_DTYPE_Q4 || DT == TL_DTYPE_Q2) ? 2 : 1;
};

// What the GEMV multiplies: rows of x as they are, their RMS/Layer norm, or the gated
// activation act(x) * up (tl_matmul_in_kind); computed while x is staged.
struct gemv_input {
    int kind;
    const float *x;
    size_t ldx;
    const float *up;
    size_t ld_up;
    int vec;            // x (and up) rows float4-aligned
    int stage_async;    // vec, and the staged rows (gated: x and up) fit shared memory
    int gelu;
    dev_weight norm_w, norm_b;
    int layer_norm, has_bias, unit_offset;
    float eps;
};

// What a row group does with its sums (the GEMV's epilogue).
enum gemv_epilogue {
    EPI_STORE = 0,   // y = W x, or y += W x (set.accumulate)
    EPI_GATED = 1,   // set.gated_pairs: y = act(W[0] x) * (W[1] x)
    EPI_ROPE = 2,    // q/k/v: RoPE on q and k, q to y[0], k and v to the cache rows (gemv_rope)
};

// EPI_ROPE: q, k, v = set.w[0..2]; y[1], y[2] are the caches' row 0, ld their row width,
// and pg their page table when the slot is paged (kv_row). Rows of q and k are computed
// in rotary pairs: logical row 2m + e of a head is member e of pair m (half style: dims
// m and m + pairs; interleaved: 2m, 2m + 1; past the rotary dims, itself), so a row
// group holds both members of its pairs.
struct gemv_rope {
    pos_arg pos;       // position of input row 0
    int pairs;         // rope_dims / 2
    int interleaved;   // tl_rope_params.style
    int head_dim;
    rope_freqs freqs;
    kv_pages pg;       // table nullptr: contiguous caches
    int kv_half;       // the caches hold fp16 elements (y[1], y[2] point to halves)
};

// The weight row (and output dim) of logical row `row` of member j.
__device__ __forceinline__ int rope_row(const gemv_rope &rope, int j, int row) {
    if (j == 2 || rope.interleaved) return row;
    const int t = row % rope.head_dim;
    return t < 2 * rope.pairs ? row - t + (t >> 1) + (t & 1) * rope.pairs : row;
}

// Where output `out_row` of input row out_i of member j goes: row out_i of y[j], or
// with EPI_ROPE k and v (j > 0) to the cache rows of their positions, found by kv_row:
// one epilogue for contiguous and paged slots, the page read from the device table
// (a recorded step replays against the pages current then). An fp16 cache's element is
// returned as its address cast to float * (out_store writes it).
template <int EPI>
__device__ __forceinline__ float *out_elem(const matrix_set &set, const gemv_rope &rope, int j, int pos, int out_i,
                                           int out_row) {
    float *const y = set_out(set, j);
    const size_t ld = set_ld(set, j);
    if (EPI == EPI_ROPE && j > 0 && rope.kv_half)
        return reinterpret_cast<float *>(kv_row(reinterpret_cast<__half *>(y), rope.pg, j - 1, pos + out_i, ld) +
                                         out_row);
    if (EPI == EPI_ROPE && j > 0) return kv_row(y, rope.pg, j - 1, pos + out_i, ld) + out_row;
    return y + (size_t)out_i * ld + out_row;
}

template <int EPI>
__device__ __forceinline__ void out_store(const gemv_rope &rope, int j, float *dst, float s) {
    if (EPI == EPI_ROPE && j > 0 && rope.kv_half) kv_put(reinterpret_cast<__half *>(dst), s);
    else *dst = s;
}

// Where float4 k (0..7) of chunk c of an activation row sits in shared memory. The
// XOR spreads the 8 lanes of a quarter-warp, which read the same k of 8 consecutive
// chunks, over 8 different 16-byte bank groups (no conflicts).
__device__ __forceinline__ int x_slot(int c, int k) { return c * 8 + (k ^ (c & 7)); }
// The first element of the float4 at slot s of a row (x_slot inverted).
__device__ __forceinline__ int slot_elem(int s) {
    const int c = s >> 3;
    return c * 32 + ((s & 7) ^ (c & 7)) * 4;
}

// The integer path's form of one staged chunk of 32 activations (its record): x ~= s * v
// with v a 24-bit integer and s = 2^e the chunk's grid step (its largest magnitude
// lands in [2^22, 2^23) steps). Words 0-15 hold v & 0xFFFF, two elements per word
// (word m = elements 2m, 2m+1), words 16-23 the signed byte v >> 16, four per word (word
// k = elements 4k .. 4k+3, like chunk_codes); word 24 is s, 25 the fp32 sum of the
// chunk's x (for the min term). Read as 13 uint2: lanes reading consecutive chunks are
// 26 words apart (26 / 2 odd), which puts the 16 lanes of a half-warp on 16 different
// bank pairs. Records are written over the fp32 rows they come from (104 <= 128 bytes
// per chunk), so they need no shared memory of their own.
constexpr int ACT_REC_WORDS = 26;
constexpr int ACT_REC_PAIRS = ACT_REC_WORDS / 2;  // uint2 per record
constexpr int ACT_V_MAX = 8388607;                // 2^23 - 1, the largest v
constexpr int ACT_SMALL_EXP = 23;                 // chunks below 2^(23-127) read as 0
constexpr int ACT_THREADS_PER_CHUNK = 4;          // two float4 each
constexpr int ACT_CHUNKS_PER_WAVE = GEMV_THREADS / ACT_THREADS_PER_CHUNK;
static_assert(ACT_REC_WORDS * 4 <= 32 * sizeof(float) && ACT_REC_PAIRS % 2 == 1, "records fit in place");

// The staged row of flat index v (per_row entries a row). The kernel passes n = 1 as a
// constant when it has one input row, which folds the division away.
__device__ __forceinline__ int row_of(int v, int n, int per_row) { return n == 1 ? 0 : v / per_row; }

// act(g) * u, the formula of the gated_act kernel.
__device__ __forceinline__ float gated(float g, float u, int gelu) {
    const float a = gelu ? 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)))
                         : g / (1.0f + expf(-g));
    return a * u;
}

// n input rows into shared memory, zero-padded to whole chunks (gated: act(x) * up),
// through registers: rows that are not 16-byte aligned.
__device__ __forceinline__ void stage_x_regs(float4 *xs, const gemv_input &in, int n, int cols, int chunks) {
    const int per_row = chunks * 8, total = n * per_row;
    const bool gate = in.kind == TL_MATMUL_IN_GATED;
    for (int v0 = threadIdx.x; v0 < total; v0 += GEMV_STAGE_BATCH * GEMV_THREADS) {
        float4 val[GEMV_STAGE_BATCH], up[GEMV_STAGE_BATCH];
#pragma unroll
        for (int b = 0; b < GEMV_STAGE_BATCH; b++) {
            const int v = v0 + b * GEMV_THREADS;
            val[b] = up[b] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (v >= total) continue;
            const int i = row_of(v, n, per_row), e = (v - i * per_row) * 4;
            val[b] = load_x4(in.x + (size_t)i * in.ldx, e, cols, in.vec);
            if (gate) up[b] = load_x4(in.up + (size_t)i * in.ld_up, e, cols, in.vec);
        }
#pragma unroll
        for (int b = 0; b < GEMV_STAGE_BATCH; b++) {
            const int v = v0 + b * GEMV_THREADS;
            if (v >= total) continue;
            const int i = row_of(v, n, per_row), s = v - i * per_row;
            float4 x = val[b];
            if (gate) {
                const int e = s * 4;
                x.x = e < cols ? gated(x.x, up[b].x, in.gelu) : 0.0f;
                x.y = e + 1 < cols ? gated(x.y, up[b].y, in.gelu) : 0.0f;
                x.z = e + 2 < cols ? gated(x.z, up[b].z, in.gelu) : 0.0f;
                x.w = e + 3 < cols ? gated(x.w, up[b].w, in.gelu) : 0.0f;
            }
            xs[i * per_row + x_slot(s >> 3, s & 7)] = x;
        }
    }
}

// 16 bytes global -> shared without registers; src_ok = 0 writes zeros (no read).
__device__ __forceinline__ void copy16_async(float4 *dst, const float *src, bool src_ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_ok ? 16 : 0)
                 : "memory");
}

// 4 bytes global -> shared without a register (completed by the next cp.async wait).
__device__ __forceinline__ void copy4_async(float *dst, const float *src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}

// The same for 16-byte aligned rows (in.vec): every load of the rows (and of `up`,
// staged in ups) is in flight at once, so staging costs one round trip whatever the
// width, and no registers; the gated activation is then applied in shared memory.
__device__ __forceinline__ void stage_x_async(float4 *xs, float4 *ups, const gemv_input &in, int n, int cols,
                                              int chunks) {
    const int per_row = chunks * 8, total = n * per_row;
    const bool gate = in.kind == TL_MATMUL_IN_GATED;
    for (int v = threadIdx.x; v < total; v += GEMV_THREADS) {
        const int i = row_of(v, n, per_row), s = v - i * per_row, e = s * 4;
        const int slot = i * per_row + x_slot(s >> 3, s & 7);
        copy16_async(xs + slot, in.x + (size_t)i * in.ldx + (e < cols ? e : 0), e < cols);
        if (gate) copy16_async(ups + slot, in.up + (size_t)i * in.ld_up + (e < cols ? e : 0), e < cols);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    if (!gate) return;
    __syncthreads();
    for (int v = threadIdx.x; v < total; v += GEMV_THREADS) {
        float4 x = xs[v];
        const float4 u = ups[v];
        x.x = gated(x.x, u.x, in.gelu);   // padding: gated(0, 0) = 0
        x.y = gated(x.y, u.y, in.gelu);
        x.z = gated(x.z, u.z, in.gelu);
        x.w = gated(x.w, u.w, in.gelu);
        xs[v] = x;
    }
}

// Requests the lines of a norm's vector into L1 before the kernel waits for its input,
// so that normalising reads them from L1 rather than L2 or HBM.
__device__ __forceinline__ void prefetch_vector_l1(const dev_weight &w, int count) {
    if (!w.qs) return;
    const int bytes = count * (w.dtype == TL_DTYPE_F16 || w.dtype == TL_DTYPE_BF16 ? 2 : 4);
    for (int o = threadIdx.x * 128; o < bytes; o += GEMV_THREADS * 128)
        asm volatile("prefetch.global.L1 [%0];" ::"l"(static_cast<const char *>(w.qs) + o));
}

// Per staged row, the sum over its elements of term(value) (zero padding included,
// so term(0) must be 0), into out[i]; `red` holds GEMV_WARPS x GEMV_MAX_ROWS floats.
template <typename F>
__device__ __forceinline__ void staged_row_sums(const float4 *xs, int n, int per_row, F term,
                                                float (*red)[GEMV_MAX_ROWS], float *out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = 0; i < n; i++) {
        float sum = 0.0f;
        for (int s = threadIdx.x; s < per_row; s += GEMV_THREADS) {
            const float4 v = xs[i * per_row + s];
            sum += (term(v.x) + term(v.y)) + (term(v.z) + term(v.w));
        }
        sum = warp_sum(sum);
        if (lane == 0) red[warp][i] = sum;
    }
    __syncthreads();
    if (threadIdx.x < n) {
        float t = 0.0f;
        for (int w = 0; w < GEMV_WARPS; w++) t += red[w][threadIdx.x];
        out[threadIdx.x] = t;
    }
    __syncthreads();
}

// The staged rows replaced by their norm (the formulas of the norm kernels).
__device__ __forceinline__ void norm_staged(float4 *xs, const gemv_input &in, int n, int cols, int chunks) {
    __shared__ float red[GEMV_WARPS][GEMV_MAX_ROWS];
    __shared__ float mean[GEMV_MAX_ROWS], rstd[GEMV_MAX_ROWS];
    const int per_row = chunks * 8;
    if (in.layer_norm) {
        staged_row_sums(xs, n, per_row, [](float v) { return v; }, red, mean);
        if (threadIdx.x < n) mean[threadIdx.x] /= (float)cols;
        __syncthreads();
        // every row's mean is read by all threads below: one row at a time
        for (int i = 0; i < n; i++) {
            const float m = mean[i];
            float sum = 0.0f;
            for (int s = threadIdx.x; s < per_row; s += GEMV_THREADS) {
                const float4 v = xs[i * per_row + s];
                const int e = slot_elem(s);
                if (e < cols) sum += (v.x - m) * (v.x - m);
                if (e + 1 < cols) sum += (v.y - m) * (v.y - m);
                if (e + 2 < cols) sum += (v.z - m) * (v.z - m);
                if (e + 3 < cols) sum += (v.w - m) * (v.w - m);
            }
            sum = warp_sum(sum);
            if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5][i] = sum;
        }
        __syncthreads();
        if (threadIdx.x < n) {
            float t = 0.0f;
            for (int w = 0; w < GEMV_WARPS; w++) t += red[w][threadIdx.x];
            rstd[threadIdx.x] = 1.0f / sqrtf(t / (float)cols + in.eps);
        }
    } else {
        staged_row_sums(xs, n, per_row, [](float v) { return v * v; }, red, rstd);
        if (threadIdx.x < n) {
            mean[threadIdx.x] = 0.0f;
            rstd[threadIdx.x] = 1.0f / sqrtf(rstd[threadIdx.x] / (float)cols + in.eps);
        }
    }
    __syncthreads();
    for (int v = threadIdx.x; v < n * per_row; v += GEMV_THREADS) {
        const int i = row_of(v, n, per_row), e = slot_elem(v - i * per_row);
        float4 x = xs[v];
        float *c = &x.x;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (e + j >= cols) {
                c[j] = 0.0f;
                continue;
            }
            const float g = load_vector_elem(in.norm_w, e + j);
            if (in.layer_norm) {
                const float o = (c[j] - mean[i]) * rstd[i] * g;
                c[j] = in.has_bias ? o + load_vector_elem(in.norm_b, e + j) : o;
            } else {
                c[j] = c[j] * rstd[i] * (in.unit_offset ? 1.0f + g : g);
            }
        }
        xs[v] = x;
    }
}

// The n staged rows (fp32, swizzled) replaced by their records, chunk g = row *
// chunks + c at record g. Four threads share a chunk, eight elements each (largest
// magnitude and sum by shuffles); a wave of 64 chunks reads its fp32 values, waits for
// the block, then writes records, which only overlap fp32 chunks of this wave or
// earlier ones.
// RMS: the rows are an RMS norm's input x: the records are those of x * gain, and
// row_scale[i] gets row i's 1 / rms (from the same reads), which the kernel applies to
// its sums: the norm costs no pass of its own. NR: the kernel's input rows (n <= NR).
template <int NR, bool RMS>
__device__ __forceinline__ void act_records(float4 *xs, int n, int chunks, const gemv_input &in, int cols,
                                            float *row_scale) {
    unsigned *rec_words = reinterpret_cast<unsigned *>(xs);
    const int total = n * chunks, t = threadIdx.x % ACT_THREADS_PER_CHUNK;
    float sq[NR] = {};   // RMS: this thread's sum of x^2 of each row
    for (int g0 = 0; g0 < total; g0 += ACT_CHUNKS_PER_WAVE) {
        const int g = g0 + threadIdx.x / ACT_THREADS_PER_CHUNK;
        const int c = n == 1 ? g : g % chunks;
        const int swz = c & 7;
        float x[8] = {};
        if (g < total) {
            const float4 a = xs[g * 8 + ((2 * t) ^ swz)], b = xs[g * 8 + ((2 * t + 1) ^ swz)];
            x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
            x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
            if constexpr (RMS) {
                const int row = n == 1 ? 0 : g / chunks, e0 = c * 32 + 8 * t;
                float part = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    part = fmaf(x[j], x[j], part);
                    if (e0 + j < cols) {
                        const float gain = load_vector_elem(in.norm_w, e0 + j);
                        x[j] *= in.unit_offset ? 1.0f + gain : gain;
                    }
                }
#pragma unroll
                for (int i = 0; i < NR; i++)
                    if (i == row) sq[i] += part;
            }
        }
        // magnitudes compared as bits: finite < inf < NaN
        unsigned amax = 0;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) amax = max(amax, __float_as_uint(x[j]) & 0x7FFFFFFFu);
#pragma unroll
        for (int j = 0; j < 8; j += 2) sum += x[j] + x[j + 1];
#pragma unroll
        for (int o = 1; o < ACT_THREADS_PER_CHUNK; o <<= 1) {
            amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        }
        // s = 2^(e - 149) for the biased exponent e of the largest magnitude, so x / s
        // is exact and rounding it to v is the only error (<= s / 2). A chunk with inf
        // or NaN gets a NaN step (its dot products become NaN); a tiny one reads as 0.
        const int e = (int)(amax >> 23);
        float step = 0.0f, inv_step = 0.0f;
        if (e == 255) step = __uint_as_float(0x7FC00000u);
        else if (e >= ACT_SMALL_EXP) {
            step = __uint_as_float((unsigned)(e - 22) << 23);
            inv_step = __uint_as_float((unsigned)(276 - e) << 23);
        }
        // |x / s| < 2^23, but 2^23 - 0.5 rounds (to even) to 2^23: clamp
        unsigned v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = (unsigned)min(__float2int_rn(x[j] * inv_step), ACT_V_MAX);
        __syncthreads();   // the whole wave has read its fp32 values
        if (g < total) {
            // elements 8t .. 8t+7: low-half words 4t .. 4t+3, high-byte words 2t, 2t+1
            uint2 *rec = reinterpret_cast<uint2 *>(rec_words + g * ACT_REC_WORDS);
            rec[2 * t] = make_uint2(__byte_perm(v[0], v[1], 0x5410), __byte_perm(v[2], v[3], 0x5410));
            rec[2 * t + 1] = make_uint2(__byte_perm(v[4], v[5], 0x5410), __byte_perm(v[6], v[7], 0x5410));
            rec[8 + t] = make_uint2(
                __byte_perm(__byte_perm(v[0], v[1], 0x0062), __byte_perm(v[2], v[3], 0x0062), 0x5410),
                __byte_perm(__byte_perm(v[4], v[5], 0x0062), __byte_perm(v[6], v[7], 0x0062), 0x5410));
            if (t == 0) rec[12] = make_uint2(__float_as_uint(step), __float_as_uint(sum));
        }
    }
    if constexpr (RMS) {
        // per row: lanes, then warps in order (deterministic), as norm_staged's formula
        __shared__ float red[GEMV_WARPS][NR];
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
        for (int i = 0; i < NR; i++) {
            const float s = warp_sum(sq[i]);
            if (lane == 0) red[warp][i] = s;
        }
        __syncthreads();
        if (threadIdx.x < n) {
            float s = 0.0f;
            for (int w = 0; w < GEMV_WARPS; w++) s += red[w][threadIdx.x];
            row_scale[threadIdx.x] = 1.0f / sqrtf(s / (float)cols + in.eps);
        }
    }
}

// c + the dot product of the four signed bytes of a with the four bytes of b (signed
// or not).
template <bool B_SIGNED>
__device__ __forceinline__ int dot4(unsigned a, unsigned b, int c) {
    int d;
    if constexpr (B_SIGNED) asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else asm("dp4a.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// c + the dot product of the two unsigned 16-bit halves of a with bytes 0-1 (HIGH:
// bytes 2-3) of b (signed or not).
template <bool HIGH, bool B_SIGNED>
__device__ __forceinline__ int dot2(unsigned a, unsigned b, int c) {
    int d;
    if constexpr (HIGH && B_SIGNED) asm("dp2a.hi.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else if constexpr (HIGH) asm("dp2a.hi.u32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else if constexpr (B_SIGNED) asm("dp2a.lo.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else asm("dp2a.lo.u32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// One round of a lane: the raw chunks base + lane + stride * u of its rows (weights
// only, so it may run before the previous kernel has finished). Row r of the group is
// row rows[r] of w, or with EPI_GATED and r >= RT / 2 of w_b (a gated pair).
// Every load of the round is issued before any value is used: a chunk past the row or
// a row past the matrix is clamped onto the last one instead of branched around (its
// values are never used: the dot skips chunks past the row and rows past the matrix
// are not written). Branches here made each row's loads wait for the previous row's.
template <int DT, int RT, int U, int EPI>
__device__ __forceinline__ void load_round(const dev_weight &w, const dev_weight &w_b, const int (&rows)[RT],
                                           int base, int lane, int stride, int chunks,
                                           chunk_bits<DT> (&bits)[RT][U], __half2 (&scale_min)[RT][U]) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int c = min(base + lane + stride * u, chunks - 1);
#pragma unroll
        for (int r = 0; r < RT; r++) {
            const dev_weight &wr = EPI == EPI_GATED && r >= RT / 2 ? w_b : w;
            const int row = min(rows[r], wr.rows - 1);
            bits[r][u] = load_bits<DT>(wr, row, c);
            if (dtype_traits<DT>::quantized) scale_min[r][u] = chunk_scale_min_half2<DT>(wr, row, c);
            else scale_min[r][u] = __float2half2_rn(0.0f);
        }
    }
}

// acc[r][i] += the products of chunk u of the lane's rows with chunk c of the staged
// fp32 rows: each code converted to float, one FMA per element and input row.
template <int DT, int RT, int U, int NR>
__device__ __forceinline__ void float_dot_chunk(const float4 *xs, int n, int chunks, int c, int u,
                                                const chunk_bits<DT> (&bits)[RT][U],
                                                const __half2 (&scale_min)[RT][U], float (&acc)[RT][NR]) {
    using traits = dtype_traits<DT>;
    float dot[RT][NR], xsum[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) {
        xsum[i] = 0.0f;
#pragma unroll
        for (int r = 0; r < RT; r++) dot[r][i] = 0.0f;
    }
#pragma unroll
    for (int k = 0; k < 8; k++) {
        float4 xv[NR];
#pragma unroll
        for (int i = 0; i < NR; i++) {
            xv[i] = i < n ? xs[i * chunks * 8 + x_slot(c, k)] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (traits::has_min) xsum[i] += (xv[i].x + xv[i].y) + (xv[i].z + xv[i].w);
        }
#pragma unroll
        for (int r = 0; r < RT; r++) {
            float q[4];
            chunk_piece<DT>(bits[r][u], k, q);
#pragma unroll
            for (int i = 0; i < NR; i++) {
                if (i >= n) break;
                dot[r][i] = fmaf(q[0], xv[i].x, dot[r][i]);
                dot[r][i] = fmaf(q[1], xv[i].y, dot[r][i]);
                dot[r][i] = fmaf(q[2], xv[i].z, dot[r][i]);
                dot[r][i] = fmaf(q[3], xv[i].w, dot[r][i]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int i = 0; i < NR; i++) {
            if (traits::has_min)
                acc[r][i] += fmaf(__low2float(scale_min[r][u]), dot[r][i], __high2float(scale_min[r][u]) * xsum[i]);
            else if (traits::quantized) acc[r][i] += __low2float(scale_min[r][u]) * dot[r][i];
            else acc[r][i] += dot[r][i];
        }
}

// acc[r][i] += the products of chunk u of the lane's rows (raw bits, scale, min) with
// the record of chunk c of each input row: per four elements two dp2a (low halves of v)
// and one dp4a (high bytes) against the packed codes, exact int32 sums (|sum| < 2^28),
// then fp32.
template <int DT, int RT, int U, int NR>
__device__ __forceinline__ void int_dot_chunk(const uint2 *recs, int n, int chunks, int c, int u,
                                              const chunk_bits<DT> (&bits)[RT][U],
                                              const __half2 (&scale_min)[RT][U], float (&acc)[RT][NR]) {
    constexpr bool CODES_SIGNED = DT == TL_DTYPE_Q8;
#pragma unroll
    for (int i = 0; i < NR; i++) {
        if (i >= n) break;
        const uint2 *rec = recs + (i * chunks + c) * ACT_REC_PAIRS;
        int low[RT], high[RT];   // sum(code * (v & 0xFFFF)), sum(code * (v >> 16))
#pragma unroll
        for (int r = 0; r < RT; r++) low[r] = high[r] = 0;
#pragma unroll
        for (int q = 0; q < 4; q++) {   // elements 8q .. 8q+7: low words 4q .. 4q+3, high words 2q, 2q+1
            const uint2 l0 = rec[2 * q], l1 = rec[2 * q + 1], h = rec[8 + q];
            const unsigned lw[4] = { l0.x, l0.y, l1.x, l1.y }, hw[2] = { h.x, h.y };
#pragma unroll
            for (int r = 0; r < RT; r++)
#pragma unroll
                for (int k = 0; k < 2; k++) {
                    const unsigned codes = chunk_codes<DT>(bits[r][u], 2 * q + k);
                    low[r] = dot2<false, CODES_SIGNED>(lw[2 * k], codes, low[r]);
                    low[r] = dot2<true, CODES_SIGNED>(lw[2 * k + 1], codes, low[r]);
                    high[r] = dot4<CODES_SIGNED>(hw[k], codes, high[r]);
                }
        }
        const uint2 tail = rec[12];
        const float step = __uint_as_float(tail.x), xsum = __uint_as_float(tail.y);
#pragma unroll
        for (int r = 0; r < RT; r++) {
            const float dot = fmaf((float)high[r], 65536.0f, (float)low[r]);
            const float scale = __low2float(scale_min[r][u]);
            if (dtype_traits<DT>::has_min) acc[r][i] += fmaf(scale * step, dot, __high2float(scale_min[r][u]) * xsum);
            else acc[r][i] = fmaf(scale * step, dot, acc[r][i]);
        }
    }
}

// The first output row of row group `group` in tile t (a block's share of one member
// of the set when the grid is one wave), and the weight row of each row of the group.
template <int RT, int EPI>
__device__ __forceinline__ int tile_rows(const matrix_set &set, const gemv_rope &rope, int t, int j, int group,
                                         int split, int (&rows)[RT]) {
    constexpr int OUT_ROWS = EPI == EPI_GATED ? RT / 2 : RT;
    const int row0 = (set_local(set, j, t) * (GEMV_WARPS / split) + group) * OUT_ROWS;
#pragma unroll
    for (int r = 0; r < RT; r++)
        rows[r] = EPI == EPI_GATED ? row0 + r % OUT_ROWS : EPI == EPI_ROPE ? rope_row(rope, j, row0 + r) : row0 + r;
    return row0;
}

// INT_DOT: quantized weights against the activation records (integer dot products)
// instead of fp32 activations. EPI (gemv_epilogue): EPI_GATED: a row group's first
// RT / 2 rows are rows of set.w[0], the others the same rows of set.w[1], and the group
// writes act(first) * second; EPI_ROPE: q/k/v rows in rotary pairs (gemv_rope).
// The set's rows come in tiles (set.first), one a block. WALK: a grid smaller than the
// tiles (a matrix larger than one wave, the head) walks them, block b taking tiles b,
// b + gridDim.x, ..., so the input is staged, normalised and turned into records once
// per block, and the next tile's first weights are requested before this tile's sums
// are reduced. (Kernels of one tile a block leave that out: it costs them time.)
template <int DT, int NR, bool INT_DOT, int EPI, bool WALK>
__global__ void __launch_bounds__(GEMV_THREADS, gemv_blocks_per_sm(NR, EPI == EPI_GATED))
gemv_kernel(matrix_set set, gemv_input in, int n, int split, gemv_rope rope) {
    constexpr int RT = gemv_tile<DT>::rows, U = gemv_tile<DT>::unroll;
    constexpr int OUT_ROWS = EPI == EPI_GATED ? RT / 2 : RT;   // output rows of a row group
    static_assert(EPI == EPI_STORE || RT % 2 == 0, "pairs need an even number of rows per group");
    using traits = dtype_traits<DT>;
    static_assert(!INT_DOT || traits::quantized, "integer dot products need integer codes");
    extern __shared__ float4 xs[];                 // n rows x chunks x 8 float4 (INT_DOT: records);
                                                   // gated and in.vec: as many for `up` after them
    __shared__ float red[GEMV_WARPS][RT * NR];     // per-warp sums
    __shared__ float resid[GEMV_WARPS][32];        // set.accumulate: what each writer adds to
    __shared__ float row_scale[GEMV_MAX_ROWS];     // rms_in_records: 1 / rms of each input row
    // with the reduction arrays of norm_staged (red, mean, rstd) and act_records (red),
    // the static shared memory the host sizes and opts in with (GEMV_STATIC_SMEM)
    static_assert(sizeof(red) + sizeof(resid) + sizeof(row_scale) +
                      sizeof(float) * (GEMV_WARPS * GEMV_MAX_ROWS + 2 * GEMV_MAX_ROWS + GEMV_WARPS * NR) <=
                      GEMV_STATIC_SMEM,
                  "GEMV static shared memory exceeds GEMV_STATIC_SMEM");
    // An RMS norm of the input is folded into the integer records (act_records): the
    // sums are scaled by 1 / rms at the end instead of x before the records.
    const bool rms_in_records = INT_DOT && in.kind == TL_MATMUL_IN_NORM && !in.layer_norm;
    const int tiles = set.first[set.n_mats];
    const int chunks = (set.w[0].cols + 31) >> 5;  // every member is as wide as x

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = warp / split, sub = warp - group * split;
    const int stride = 32 * split;   // chunks between a lane's consecutive chunks
    int t = blockIdx.x, j = set_member(set, t);
    int rows[RT];   // the weight row of each row of the group
    int row0 = tile_rows<RT, EPI>(set, rope, t, j, group, split, rows);

    // The first round's weights are requested before the wait for the previous
    // kernel: their latency overlaps its tail and this kernel's staging.
    chunk_bits<DT> bits[RT][U];
    __half2 scale_min[RT][U];   // as stored (f16): half the registers of floats
    load_round<DT, RT, U, EPI>(set_weight(set, j), set.w[1], rows, sub * 32, lane, stride, chunks, bits, scale_min);
    if (in.kind == TL_MATMUL_IN_NORM) {
        prefetch_vector_l1(in.norm_w, set.w[0].cols);
        if (in.has_bias) prefetch_vector_l1(in.norm_b, set.w[0].cols);
    }

    pdl_wait();
    pdl_trigger();
    const int out_r = lane / NR, out_i = lane % NR;
    const int pos = EPI == EPI_ROPE ? pos_value(rope.pos) : 0;
    const int rows_in = NR == 1 ? 1 : n;   // a constant where it can be
    bool staged = false;
    for (;;) {
        const dev_weight &w = set_weight(set, j);
        const bool writer = sub == 0 && lane < OUT_ROWS * NR && out_i < n && row0 + out_r < w.rows;
        // EPI_ROPE: writers only (other lanes' positions may lie past a paged slot's table)
        const int out_row = EPI == EPI_ROPE ? rope_row(rope, j, row0 + out_r) : row0 + out_r;
        float *dst = EPI != EPI_ROPE || writer ? out_elem<EPI>(set, rope, j, pos, out_i, out_row) : nullptr;
        // the residual this tile adds to, requested now (into shared memory: a register
        // would be spilled, and the spill would wait for the load) and used at the end
        if (writer && set.accumulate) copy4_async(&resid[warp][lane], dst);
        if (!staged) {
            if (in.stage_async) stage_x_async(xs, xs + rows_in * chunks * 8, in, rows_in, w.cols, chunks);
            else stage_x_regs(xs, in, rows_in, w.cols, chunks);
            __syncthreads();
            if (in.kind == TL_MATMUL_IN_NORM && !rms_in_records) {
                norm_staged(xs, in, rows_in, w.cols, chunks);
                __syncthreads();
            }
            if (INT_DOT) {
                if (rms_in_records) act_records<NR, true>(xs, rows_in, chunks, in, w.cols, row_scale);
                else act_records<NR, false>(xs, rows_in, chunks, in, w.cols, row_scale);
                __syncthreads();
            }
            staged = true;
        }

        float acc[RT][NR];
#pragma unroll
        for (int r = 0; r < RT; r++)
#pragma unroll
            for (int i = 0; i < NR; i++) acc[r][i] = 0.0f;

        for (int base = sub * 32; base < chunks; base += stride * U) {
            if (base != sub * 32)
                load_round<DT, RT, U, EPI>(w, set.w[1], rows, base, lane, stride, chunks, bits, scale_min);
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int c = base + lane + stride * u;
                if (c >= chunks) continue;
                if constexpr (INT_DOT)
                    int_dot_chunk<DT, RT, U, NR>(reinterpret_cast<const uint2 *>(xs), n, chunks, c, u, bits,
                                                 scale_min, acc);
                else
                    float_dot_chunk<DT, RT, U, NR>(xs, n, chunks, c, u, bits, scale_min, acc);
            }
        }

        // the next tile's first round, in flight while this one is reduced and written
        const int next = WALK ? t + (int)gridDim.x : tiles;
        int next_j = j, next_row0 = row0;
        if (WALK && next < tiles) {
            next_j = set_member(set, next);
            next_row0 = tile_rows<RT, EPI>(set, rope, next, next_j, group, split, rows);
            load_round<DT, RT, U, EPI>(set_weight(set, next_j), set.w[1], rows, sub * 32, lane, stride, chunks,
                                       bits, scale_min);
        }

        // lanes, then the warps of a row group (in warp order: deterministic)
#pragma unroll
        for (int r = 0; r < RT; r++)
#pragma unroll
            for (int i = 0; i < NR; i++) {
                const float s = warp_sum(acc[r][i]);
                if (lane == 0) red[warp][r * NR + i] = s;
            }
        __syncthreads();
        if (writer) {
            const float in_scale = rms_in_records ? row_scale[out_i] : 1.0f;
            float s = 0.0f;
            for (int k = 0; k < split; k++) s += red[warp + k][lane];
            s *= in_scale;
            if (EPI == EPI_GATED) {
                float up = 0.0f;   // the same output of the second matrix
                for (int k = 0; k < split; k++) up += red[warp + k][lane + OUT_ROWS * NR];
                s = gated(s, up * in_scale, set.gated_pairs == 2);
            }
            const int t_dim = EPI == EPI_ROPE ? (row0 + out_r) % rope.head_dim : 0;
            if (EPI == EPI_ROPE && j < 2 && t_dim < 2 * rope.pairs) {
                float other = 0.0f;   // the pair's other member: the neighbouring row of the group
                for (int k = 0; k < split; k++) other += red[warp + k][(out_r ^ 1) * NR + out_i];
                other *= in_scale;
                const bool second = t_dim & 1;
                float sn, cs;
                rope_angle(pos + out_i, rope.freqs, t_dim >> 1, &sn, &cs);
                s = second ? rope_member(other, s, sn, cs, true) : rope_member(s, other, sn, cs, false);
            }
            if (set.accumulate) {
                asm volatile("cp.async.wait_all;" ::: "memory");   // resid (the regs path has not waited)
                s += resid[warp][lane];
            }
            out_store<EPI>(rope, j, dst, s);
        }
        if (next >= tiles) break;
        __syncthreads();   // red and resid are the next tile's
        t = next;
        j = next_j;
        row0 = next_row0;
    }
}

template <int DT>
__global__ void __launch_bounds__(GEMM_THREADS)
gemm_kernel(dev_weight w, const float *__restrict__ x, size_t ldx, int n, float *__restrict__ y,
            size_t ldy) {
    pdl_wait();
    pdl_trigger();
    __shared__ float xs[GEMM_BK][GEMM_BM + 1];
    __shared__ float ws[GEMM_BK][GEMM_BN + 1];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int row0 = blockIdx.y * GEMM_BM;   // input rows
    const int col0 = blockIdx.x * GEMM_BN;   // weight rows = output features
    const int n_chunks = (w.cols + 31) >> 5;
    float acc[4][4] = {};

    for (int c = 0; c < n_chunks; c++) {
        const int k0 = c * GEMM_BK;
        // input tile: 64 rows x 32 columns, 8 floats per thread
        for (int e = tid; e < GEMM_BM * GEMM_BK; e += GEMM_THREADS) {
            int r = e / GEMM_BK, k = e % GEMM_BK;
            int gr = row0 + r, gk = k0 + k;
            xs[k][r] = (gr < n && gk < w.cols) ? x[(size_t)gr * ldx + gk] : 0.0f;
        }
        // weight tile: one decoded chunk per weight row
        if (tid < GEMM_BN) {
            float v[32];
            int wr = col0 + tid;
            if (wr < w.rows) {
                load_chunk<DT>(w, wr, c, v);
            } else {
#pragma unroll
                for (int j = 0; j < 32; j++) v[j] = 0.0f;
            }
#pragma unroll
            for (int j = 0; j < 32; j++) ws[j][tid] = v[j];
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < GEMM_BK; k++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = xs[k][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = ws[k][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int gr = row0 + ty + 16 * i;
        if (gr >= n) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int gc = col0 + tx + 16 * j;
            if (gc < w.rows) y[(size_t)gr * ldy + gc] = acc[i][j];
        }
    }
}

template <int DT>
__global__ void embed_kernel(dev_weight table, const int32_t *__restrict__ tokens, float scale,
                             float *__restrict__ out) {
    pdl_wait();
    pdl_trigger();
    const int i = blockIdx.x, d = table.cols;
    const int token = tokens[i];
    const int n_chunks = (d + 31) >> 5;
    for (int c = threadIdx.x; c < n_chunks; c += blockDim.x) {
        float v[32];
        load_chunk<DT>(table, token, c, v);
        const int count = min(32, d - c * 32);
        float *o = out + (size_t)i * d + (size_t)c * 32;
        for (int j = 0; j < count; j++) o[j] = v[j] * scale;
    }
}

__global__ void add_bias_kernel(float *y, int n, int d, dev_weight bias) {
    pdl_wait();
    pdl_trigger();
    size_t total = (size_t)n * d;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x)
        y[e] += load_vector_elem(bias, (int)(e % d));
}

template <int DT>
void gemm_dt(tl_exec *ex, const dev_weight &w, const float *x, size_t ldx, int n, float *y,
             size_t ldy) {
    dim3 grid((w.rows + GEMM_BN - 1) / GEMM_BN, (n + GEMM_BM - 1) / GEMM_BM);
    launch(ex, "matmul (gemm)", gemm_kernel<DT>, grid, GEMM_THREADS, 0, w, x, ldx, n, y, ldy);
}

// Shared memory one GEMV block may use for activation rows (its static shared memory,
// the per-warp sums and norm statistics, comes on top). The integer path's records
// replace the fp32 rows in place (ACT_REC_WORDS <= 32 words per chunk): no more.
size_t gemv_smem_max(const tl_exec *ex) { return std::max(SMEM_DEFAULT, ex->smem_optin) - GEMV_STATIC_SMEM; }

template <int DT, int NR, bool INT_DOT, int EPI, bool WALK = false>
void gemv_launch_kernel(tl_exec *ex, const matrix_set &set, const gemv_input &in, int n, int split, int grid,
                        size_t smem, const gemv_rope &rope) {
    // Without the opt-in a block gets 48 KB of static and dynamic shared memory together:
    // eight 1536-wide rows (48 KB of activations) plus the static sums failed to launch.
    // The opt-in is the kernel's, not the launch's, and a recorded step launches when it
    // ends: one kernel kept for rows of 2048 and 5632 floats must find the larger size
    // allowed, so the opt-in is the most any launch may take.
    if (smem + GEMV_STATIC_SMEM > SMEM_DEFAULT &&
        exec_check(ex, cudaFuncSetAttribute(gemv_kernel<DT, NR, INT_DOT, EPI, WALK>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)gemv_smem_max(ex)),
                   "matmul (gemv shared memory size)"))
        return;
    launch(ex, "matmul (gemv)", gemv_kernel<DT, NR, INT_DOT, EPI, WALK>, WALK ? grid : set.first[set.n_mats],
           GEMV_THREADS, smem, set, in, n, split, rope);
}

// The epilogue's kernel: pairs (gated, RoPE) exist for dtypes with an even number of
// rows per group (all but f32, whose calls are declined before they get here). A plain
// one-row GEMV with more tiles than the grid (the head) walks them; other sets larger
// than one wave run a block per tile.
template <int DT, int NR, bool INT_DOT>
void gemv_launch_epilogue(tl_exec *ex, const matrix_set &set, const gemv_input &in, int n, int split, int grid,
                          size_t smem, const gemv_rope *rope) {
    static const gemv_rope no_rope = {};
    if constexpr (gemv_tile<DT>::rows % 2 == 0) {
        if (rope) {
            gemv_launch_kernel<DT, NR, INT_DOT, EPI_ROPE>(ex, set, in, n, split, grid, smem, *rope);
            return;
        }
        if (set.gated_pairs) {
            gemv_launch_kernel<DT, NR, INT_DOT, EPI_GATED>(ex, set, in, n, split, grid, smem, no_rope);
            return;
        }
    }
    if (NR == 1 && grid < set.first[set.n_mats])
        gemv_launch_kernel<DT, NR, INT_DOT, EPI_STORE, NR == 1>(ex, set, in, n, split, grid, smem, no_rope);
    else
        gemv_launch_kernel<DT, NR, INT_DOT, EPI_STORE>(ex, set, in, n, split, grid, smem, no_rope);
}

// Quantized weights use integer dot products unless the context turned them off.
template <int DT, int NR>
void gemv_launch(tl_exec *ex, const matrix_set &set, const gemv_input &in, int n, int split, int grid, size_t smem,
                 const gemv_rope *rope) {
    if constexpr (dtype_traits<DT>::quantized) {
        if (ex->gemv_int_dot) {
            gemv_launch_epilogue<DT, NR, true>(ex, set, in, n, split, grid, smem, rope);
            return;
        }
    }
    gemv_launch_epilogue<DT, NR, false>(ex, set, in, n, split, grid, smem, rope);
}

// Whether the GEMV takes these matrices: n <= GEMV_MAX_ROWS rows whose activations fit
// one block's shared memory (one row at least).
int gemv_fits(const tl_exec *ex, const dev_weight *const *ws, int n_w, int n) {
    if (n < 1 || n > GEMV_MAX_ROWS) return 0;
    int cols = 0;
    for (int k = 0; k < n_w; k++) cols = std::max(cols, ws[k]->cols);
    return (size_t)((cols + 31) / 32) * 32 * sizeof(float) <= gemv_smem_max(ex);
}

// n <= GEMV_MAX_ROWS input rows against every matrix of the set (all of dtype DT and
// as wide as x; gemv_fits). Picks how many warps share a row and sizes the grid;
// input rows whose activations do not fit in one block's shared memory together go
// in several launches.
template <int DT>
void gemv_dt(tl_exec *ex, matrix_set set, gemv_input in, int n, const gemv_rope *rope = nullptr) {
    constexpr int RT = gemv_tile<DT>::rows;
    int cols = 0, cols_vec = 1;
    for (int k = 0; k < set.n_mats; k++) {
        cols = std::max(cols, set.w[k].cols);
        cols_vec = cols_vec && set.w[k].cols % 4 == 0;
    }
    const int chunks = (cols + 31) / 32;
    const size_t row_bytes = (size_t)chunks * 32 * sizeof(float);
    in.vec = cols_vec && (uintptr_t)in.x % 16 == 0 && in.ldx % 4 == 0 &&
             (in.kind != TL_MATMUL_IN_GATED || ((uintptr_t)in.up % 16 == 0 && in.ld_up % 4 == 0));
    // aligned gated rows stage `up` beside x (stage_x_async) when one row of each fits
    const bool gated = in.kind == TL_MATMUL_IN_GATED;
    in.stage_async = in.vec && (!gated || 2 * row_bytes <= gemv_smem_max(ex));
    const size_t staged_bytes = in.stage_async && gated ? 2 * row_bytes : row_bytes;
    const int per_launch = (int)std::min<size_t>((size_t)n, gemv_smem_max(ex) / staged_bytes);

    // A row group's warps split its rows' chunks (`split` warps per group) while every
    // lane still gets more than one chunk and the grid stays one wave: a small matrix
    // (o, q/k/v, down) then spreads over twice or four times the blocks, so each warp's
    // serial chain of decode work is shorter and more warps per SM hide its latency.
    // Gated pairs: every block serves rows of both matrices (the first one's grid).
    const int out_rows = set.gated_pairs ? RT / 2 : RT, grid_mats = set.gated_pairs ? 1 : set.n_mats;
    auto blocks_for = [&](int split) {
        const int rows_per_block = GEMV_WARPS / split * out_rows;
        int blocks = 0;
        for (int k = 0; k < grid_mats; k++) blocks += (set.w[k].rows + rows_per_block - 1) / rows_per_block;
        return blocks;
    };
    const int by_regs = gemv_blocks_per_sm(per_launch, set.gated_pairs != 0);
    const size_t block_smem = (size_t)per_launch * staged_bytes + GEMV_STATIC_SMEM;
    const int per_sm = (int)std::max<size_t>(1, std::min<size_t>(by_regs, ex->smem_per_sm / block_smem));
    int split = 1;
    while (split < GEMV_WARPS && 32 * split < chunks && blocks_for(2 * split) <= per_sm * ex->sm_count) split *= 2;
    const int rows_per_block = GEMV_WARPS / split * out_rows;
    set.first[0] = 0;
    for (int k = 0; k < set.n_mats; k++)
        set.first[k + 1] = set.first[k] + (k < grid_mats ? (set.w[k].rows + rows_per_block - 1) / rows_per_block : 0);
    if (set.first[set.n_mats] == 0) return;
    // one wave (a set larger than that may walk its tiles: gemv_launch_epilogue)
    const int grid = std::min(set.first[set.n_mats], per_sm * ex->sm_count);

    for (int i0 = 0; i0 < n; i0 += per_launch) {
        const int m = std::min(per_launch, n - i0);
        matrix_set part = set;
        gemv_rope part_rope = rope ? *rope : gemv_rope{};
        part_rope.pos.base += i0;   // the caches' rows follow the position, not y
        for (int k = 0; k < set.n_mats; k++)
            if (!rope || k == 0) part.y[k] += (size_t)i0 * part.ldy[k];
        gemv_input pin = in;
        pin.x += (size_t)i0 * in.ldx;
        if (in.kind == TL_MATMUL_IN_GATED) pin.up += (size_t)i0 * in.ld_up;
        const size_t smem = (size_t)m * staged_bytes;
        const gemv_rope *r = rope ? &part_rope : nullptr;
        if (m == 1) gemv_launch<DT, 1>(ex, part, pin, m, split, grid, smem, r);
        else if (m == 2) gemv_launch<DT, 2>(ex, part, pin, m, split, grid, smem, r);
        else if (m <= 4) gemv_launch<DT, 4>(ex, part, pin, m, split, grid, smem, r);
        else gemv_launch<DT, 8>(ex, part, pin, m, split, grid, smem, r);
    }
}

template <int DT>
void embed_dt(tl_exec *ex, const dev_weight &t, const int32_t *tokens, int n, float scale,
              float *out) {
    launch(ex, "embed", embed_kernel<DT>, n, 128, 0, t, tokens, scale, out);
}

// Calls fn<dtype>(args...) for the tensor's dtype.
#define DISPATCH_DTYPE(dtype, fn, ...)                                         \
    switch (dtype) {                                                           \
    case TL_DTYPE_F32: fn<TL_DTYPE_F32>(__VA_ARGS__); break;                   \
    case TL_DTYPE_F16: fn<TL_DTYPE_F16>(__VA_ARGS__); break;                   \
    case TL_DTYPE_BF16: fn<TL_DTYPE_BF16>(__VA_ARGS__); break;                 \
    case TL_DTYPE_Q8: fn<TL_DTYPE_Q8>(__VA_ARGS__); break;                     \
    case TL_DTYPE_Q4: fn<TL_DTYPE_Q4>(__VA_ARGS__); break;                     \
    case TL_DTYPE_Q2: fn<TL_DTYPE_Q2>(__VA_ARGS__); break;                     \
    default: exec_check(ex, cudaErrorInvalidValue, "unknown weight dtype"); \
    }

}  // namespace

void launch_matmul(tl_exec *ex, const dev_weight &w, const float *x, size_t ldx, int n,
                   float *y, size_t ldy) {
    const dev_weight *ws[1] = { &w };
    launch_matmul_multi(ex, ws, 1, x, ldx, n, &y, &ldy);
}

// Consecutive matrices of one dtype share a GEMV launch.
static void matrix_sets(tl_exec *ex, const dev_weight *const *ws, int n_w, const gemv_input &in, int n,
                      float *const *ys, const size_t *ldys, int accumulate) {
    for (int j0 = 0; j0 < n_w;) {
        matrix_set set = {};
        set.accumulate = accumulate;
        while (j0 < n_w && set.n_mats < SET_MAX_MATS &&
               (set.n_mats == 0 || ws[j0]->dtype == set.w[0].dtype)) {
            int k = set.n_mats++;
            set.w[k] = *ws[j0];
            set.y[k] = ys[j0];
            set.ldy[k] = ldys[j0];
            j0++;
        }
        DISPATCH_DTYPE(set.w[0].dtype, gemv_dt, ex, set, in, n);
    }
}

void launch_matmul_multi(tl_exec *ex, const dev_weight *const *ws, int n_w, const float *x,
                         size_t ldx, int n, float *const *ys, const size_t *ldys) {
    if (n <= 0) return;
    if (!gemv_fits(ex, ws, n_w, n)) {
        if (launch_gemm_tc(ex, ws, n_w, x, ldx, n, ys, ldys)) return;
        for (int j = 0; j < n_w; j++)
            if (ws[j]->rows > 0) DISPATCH_DTYPE(ws[j]->dtype, gemm_dt, ex, *ws[j], x, ldx, n, ys[j], ldys[j]);
        return;
    }
    gemv_input in = {};
    in.kind = TL_MATMUL_IN_ROWS;
    in.x = x;
    in.ldx = ldx;
    matrix_sets(ex, ws, n_w, in, n, ys, ldys, 0);
}

static gemv_input gemv_input_of(const matmul_in_args &a) {
    gemv_input in = {};
    in.kind = a.kind;
    in.x = a.x;
    in.ldx = a.ldx;
    in.up = a.up;
    in.ld_up = a.ld_up;
    in.gelu = a.gelu;
    if (a.kind == TL_MATMUL_IN_NORM) {
        in.norm_w = *a.norm_w;
        if (a.norm_b) in.norm_b = *a.norm_b;
        in.has_bias = a.norm_b != nullptr;
        in.layer_norm = a.norm_params.type == TL_NORMTYPE_LAYER;
        in.unit_offset = a.norm_params.unit_offset;
        in.eps = a.norm_params.eps;
    }
    return in;
}

int launch_matmul_in(tl_exec *ex, const dev_weight *const *ws, int n_w, const matmul_in_args &a, int n,
                     float *const *ys, const size_t *ldys, int accumulate) {
    if (n <= 0) return 1;
    if (!gemv_fits(ex, ws, n_w, n)) return 0;
    matrix_sets(ex, ws, n_w, gemv_input_of(a), n, ys, ldys, accumulate);
    return 1;
}

int launch_matmul_gated(tl_exec *ex, const dev_weight &w_gate, const dev_weight &w_up, const matmul_in_args &a,
                        int n, int gelu, float *y, size_t ldy) {
    if (n <= 0) return 1;
    const dev_weight *ws[2] = { &w_gate, &w_up };
    if (!gemv_fits(ex, ws, 2, n) || w_gate.dtype == TL_DTYPE_F32 || w_gate.dtype != w_up.dtype ||
        w_gate.rows != w_up.rows || w_gate.cols != w_up.cols)
        return 0;
    matrix_set set = {};
    set.n_mats = 2;
    set.w[0] = w_gate;
    set.w[1] = w_up;
    set.y[0] = set.y[1] = y;
    set.ldy[0] = set.ldy[1] = ldy;
    set.gated_pairs = gelu ? 2 : 1;
    DISPATCH_DTYPE(w_gate.dtype, gemv_dt, ex, set, gemv_input_of(a), n);
    return 1;
}

int launch_matmul_rope_store(tl_exec *ex, const dev_weight *const *ws, const matmul_in_args &a, int n, float *q,
                             size_t ldq, pos_arg pos0, const tl_rope_params &p, int head_dim, void *k_cache,
                             void *v_cache, const kv_pages &pg, bool half) {
    if (n <= 0) return 1;
    const int dt = ws[0]->dtype, pairs = p.rope_dims / 2;
    if (!gemv_fits(ex, ws, 3, n) || dt == TL_DTYPE_F32 || ws[1]->dtype != dt || ws[2]->dtype != dt ||
        head_dim % 4 != 0 || pairs > ROPE_MAX_PAIRS || 2 * pairs > head_dim || ws[0]->rows % head_dim ||
        ws[1]->rows != ws[2]->rows || ws[1]->rows % head_dim)
        return 0;   // f32 has one row per group; 4 divides every other dtype's rows per group
    matrix_set set = {};
    set.n_mats = 3;
    // an fp16 cache's address travels as a float * (out_elem casts it back)
    float *ys[3] = { q, static_cast<float *>(k_cache), static_cast<float *>(v_cache) };
    for (int j = 0; j < 3; j++) {
        set.w[j] = *ws[j];
        set.y[j] = ys[j];
        set.ldy[j] = j == 0 ? ldq : (size_t)ws[1]->rows;
    }
    gemv_rope rope = {};
    rope.pos = pos0;
    rope.pairs = pairs;
    rope.interleaved = p.style;
    rope.head_dim = head_dim;
    rope.freqs = rope_frequencies(p);
    rope.pg = pg;
    rope.kv_half = half;
    DISPATCH_DTYPE(dt, gemv_dt, ex, set, gemv_input_of(a), n, &rope);
    return 1;
}

void launch_embed(tl_exec *ex, const dev_weight &table, const int32_t *d_tokens, int n,
                  float scale, float *out) {
    if (n <= 0) return;
    DISPATCH_DTYPE(table.dtype, embed_dt, ex, table, d_tokens, n, scale, out);
}

void launch_add_bias(tl_exec *ex, float *y, int n, int d, const dev_weight &bias) {
    size_t total = (size_t)n * d;
    if (total == 0) return;
    int blocks = (int)((total + 255) / 256 < 4096 ? (total + 255) / 256 : 4096);
    launch(ex, "add_bias", add_bias_kernel, blocks, 256, 0, y, n, d, bias);
}

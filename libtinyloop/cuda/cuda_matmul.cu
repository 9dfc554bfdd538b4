// cuda_matmul.cu — y = x W^T for every weight dtype, the embedding lookup and bias add.
//
// Decode (n <= 8 rows): a GEMV built to keep many weight bytes in flight per SM. A
// block of 8 warps first copies the n activation rows into shared memory (each is
// read by every output row of the block); then each "row group" of `split` warps
// computes gemv_tile::rows output rows: its lanes walk the row in 32-element chunks,
// a lane loading the raw chunks of all its rows for gemv_tile::unroll chunks at once
// (eight independent 16-byte loads for q4) before decoding any. Quantized chunks are
// reduced as scale * sum(code * x) + min * sum(x), so the per-element work is one
// code conversion and one FMA per input row. Rows longer than one pass of a warp are
// split over several warps (`split`), whose partial sums meet in shared memory. Up to
// three matrices of one dtype applied to the same input (q/k/v, gate/up) share one
// launch: each block belongs to one of them. Activations stay fp32 and accumulation
// is fp32: results track the float64 oracle tightly.
// Prefill (n > 8): a tiled fp32 GEMM whose weight tiles are decoded into shared memory
// one chunk per row; correct and simple, not tensor-core fast (docs/cuda-backend.md).
// It also serves decode rows too wide for the GEMV's shared memory.
#include "cuda_dequant.cuh"

#include <algorithm>

namespace {

constexpr int GEMV_WARPS = 8;
constexpr int GEMV_THREADS = GEMV_WARPS * 32;
constexpr int GEMV_MAX_ROWS = 8;      // the largest n served by the GEMV
constexpr int GEMV_MAX_MATS = 3;
constexpr int GEMV_STAGE_BATCH = 4;   // activation loads in flight per thread while staging
constexpr size_t SMEM_DEFAULT = 48 * 1024;   // dynamic shared memory without opting in

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

// The matrices of one GEMV launch; blocks [block0[j], block0[j + 1]) serve matrix j.
struct gemv_set {
    dev_weight w[GEMV_MAX_MATS];
    float *y[GEMV_MAX_MATS];
    size_t ldy[GEMV_MAX_MATS];
    int block0[GEMV_MAX_MATS + 1];
    int n_mats;
};

// Where float4 k (0..7) of chunk c of an activation row sits in shared memory. The
// XOR spreads the 8 lanes of a quarter-warp, which read the same k of 8 consecutive
// chunks, over 8 different 16-byte bank groups (no conflicts).
__device__ __forceinline__ int x_slot(int c, int k) { return c * 8 + (k ^ (c & 7)); }

// n activation rows into shared memory, zero-padded to whole chunks.
__device__ __forceinline__ void stage_x(float4 *xs, const float *__restrict__ x, size_t ldx, int n,
                                        int cols, int chunks, int x_vec) {
    const int per_row = chunks * 8, total = n * per_row;
    for (int v0 = threadIdx.x; v0 < total; v0 += GEMV_STAGE_BATCH * GEMV_THREADS) {
        float4 val[GEMV_STAGE_BATCH];
#pragma unroll
        for (int b = 0; b < GEMV_STAGE_BATCH; b++) {
            const int v = v0 + b * GEMV_THREADS;
            val[b] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (v >= total) continue;
            const int i = v / per_row, e = (v - i * per_row) * 4;
            const float *src = x + (size_t)i * ldx + e;
            if (x_vec) {
                if (e < cols) val[b] = *reinterpret_cast<const float4 *>(src);
            } else {
                val[b].x = e < cols ? src[0] : 0.0f;
                val[b].y = e + 1 < cols ? src[1] : 0.0f;
                val[b].z = e + 2 < cols ? src[2] : 0.0f;
                val[b].w = e + 3 < cols ? src[3] : 0.0f;
            }
        }
#pragma unroll
        for (int b = 0; b < GEMV_STAGE_BATCH; b++) {
            const int v = v0 + b * GEMV_THREADS;
            if (v >= total) continue;
            const int i = v / per_row, s = v - i * per_row;
            xs[i * per_row + x_slot(s >> 3, s & 7)] = val[b];
        }
    }
}

template <int DT, int NR>
__global__ void __launch_bounds__(GEMV_THREADS)
gemv_kernel(gemv_set set, const float *__restrict__ x, size_t ldx, int n, int x_vec, int split) {
    constexpr int RT = gemv_tile<DT>::rows, U = gemv_tile<DT>::unroll;
    using traits = dtype_traits<DT>;
    extern __shared__ float4 xs[];                 // n rows x chunks x 8 float4
    __shared__ float red[GEMV_WARPS][RT * NR];     // per-warp sums
    const int b = blockIdx.x;
    // constant indices only, so the set stays in parameter space
    const int j = (set.n_mats > 1 && b >= set.block0[1]) + (set.n_mats > 2 && b >= set.block0[2]);
    const dev_weight &w = j == 0 ? set.w[0] : j == 1 ? set.w[1] : set.w[2];
    float *__restrict__ y = j == 0 ? set.y[0] : j == 1 ? set.y[1] : set.y[2];
    const size_t ldy = j == 0 ? set.ldy[0] : j == 1 ? set.ldy[1] : set.ldy[2];
    const int block_in_mat = b - (j == 0 ? 0 : j == 1 ? set.block0[1] : set.block0[2]);
    const int chunks = (w.cols + 31) >> 5;

    stage_x(xs, x, ldx, n, w.cols, chunks, x_vec);
    __syncthreads();

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = warp / split, sub = warp - group * split;
    const int row0 = (block_in_mat * (GEMV_WARPS / split) + group) * RT;
    const int stride = 32 * split;   // chunks between a lane's consecutive chunks
    float acc[RT][NR];
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int i = 0; i < NR; i++) acc[r][i] = 0.0f;

    for (int base = sub * 32; base < chunks; base += stride * U) {
        // every load of the round first, then the arithmetic
        chunk_bits<DT> bits[RT][U];
        float scale[RT][U], mins[RT][U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = base + lane + stride * u;
#pragma unroll
            for (int r = 0; r < RT; r++) {
                bits[r][u] = chunk_bits<DT>{};
                scale[r][u] = 0.0f;
                mins[r][u] = 0.0f;
                if (c < chunks && row0 + r < w.rows) {
                    bits[r][u] = load_bits<DT>(w, row0 + r, c);
                    if (traits::quantized) chunk_scale_min<DT>(w, row0 + r, c, &scale[r][u], &mins[r][u]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = base + lane + stride * u;
            if (c >= chunks) continue;
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
                    if (traits::has_min) acc[r][i] += fmaf(scale[r][u], dot[r][i], mins[r][u] * xsum[i]);
                    else if (traits::quantized) acc[r][i] += scale[r][u] * dot[r][i];
                    else acc[r][i] += dot[r][i];
                }
        }
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
    if (sub == 0 && lane < RT * NR) {
        const int r = lane / NR, i = lane % NR;
        float s = 0.0f;
        for (int t = 0; t < split; t++) s += red[warp + t][lane];
        if (i < n && row0 + r < w.rows) y[(size_t)i * ldy + row0 + r] = s;
    }
}

template <int DT>
__global__ void __launch_bounds__(GEMM_THREADS)
gemm_kernel(dev_weight w, const float *__restrict__ x, size_t ldx, int n, float *__restrict__ y,
            size_t ldy) {
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

template <int DT, int NR>
void gemv_launch(tl_exec *ex, const gemv_set &set, const float *x, size_t ldx, int n, int split,
                 size_t smem, int cols_vec) {
    const int x_vec = cols_vec && (uintptr_t)x % 16 == 0 && ldx % 4 == 0;
    if (smem > SMEM_DEFAULT &&
        exec_check(ex, cudaFuncSetAttribute(gemv_kernel<DT, NR>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)smem), "matmul (gemv shared memory size)"))
        return;
    launch(ex, "matmul (gemv)", gemv_kernel<DT, NR>, set.block0[set.n_mats], GEMV_THREADS, smem, set, x, ldx,
           n, x_vec, split);
}

// n <= GEMV_MAX_ROWS input rows against every matrix of the set (all of dtype DT and
// as wide as x). Picks how many warps share a row and sizes the grid; input rows
// whose activations do not fit in one block's shared memory together go in several
// launches, and rows too wide for even one go to the GEMM.
template <int DT>
void gemv_dt(tl_exec *ex, gemv_set set, const float *x, size_t ldx, int n) {
    constexpr int RT = gemv_tile<DT>::rows, U = gemv_tile<DT>::unroll;
    int cols = 0, cols_vec = 1;
    for (int k = 0; k < set.n_mats; k++) {
        cols = std::max(cols, set.w[k].cols);
        cols_vec = cols_vec && set.w[k].cols % 4 == 0;
    }
    const int chunks = (cols + 31) / 32;
    const size_t row_bytes = (size_t)chunks * 32 * sizeof(float);
    // room for the kernel's static shared memory (the per-warp sums) besides x
    const size_t smem_max = std::max(SMEM_DEFAULT, ex->smem_optin) - 2048;
    if (row_bytes > smem_max) {
        for (int k = 0; k < set.n_mats; k++) gemm_dt<DT>(ex, set.w[k], x, ldx, n, set.y[k], set.ldy[k]);
        return;
    }
    // Rows split over more warps while lanes would otherwise take several rounds and
    // the grid is small: more loads in flight, at the price of staging x more often.
    auto blocks_for = [&](int split) {
        const int rows_per_block = GEMV_WARPS / split * RT;
        int blocks = 0;
        for (int k = 0; k < set.n_mats; k++) blocks += (set.w[k].rows + rows_per_block - 1) / rows_per_block;
        return blocks;
    };
    int split = 1;
    while (split < GEMV_WARPS && 32 * split * U < chunks && blocks_for(split) < ex->sm_count / 2) split *= 2;
    const int rows_per_block = GEMV_WARPS / split * RT;
    set.block0[0] = 0;
    for (int k = 0; k < set.n_mats; k++)
        set.block0[k + 1] = set.block0[k] + (set.w[k].rows + rows_per_block - 1) / rows_per_block;
    if (set.block0[set.n_mats] == 0) return;

    const int per_launch = (int)std::min<size_t>((size_t)n, smem_max / row_bytes);
    for (int i0 = 0; i0 < n; i0 += per_launch) {
        const int m = std::min(per_launch, n - i0);
        gemv_set part = set;
        for (int k = 0; k < set.n_mats; k++) part.y[k] += (size_t)i0 * part.ldy[k];
        const float *xp = x + (size_t)i0 * ldx;
        const size_t smem = (size_t)m * row_bytes;
        if (m == 1) gemv_launch<DT, 1>(ex, part, xp, ldx, m, split, smem, cols_vec);
        else if (m == 2) gemv_launch<DT, 2>(ex, part, xp, ldx, m, split, smem, cols_vec);
        else if (m <= 4) gemv_launch<DT, 4>(ex, part, xp, ldx, m, split, smem, cols_vec);
        else gemv_launch<DT, 8>(ex, part, xp, ldx, m, split, smem, cols_vec);
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

void launch_matmul_multi(tl_exec *ex, const dev_weight *const *ws, int n_w, const float *x,
                         size_t ldx, int n, float *const *ys, const size_t *ldys) {
    if (n <= 0) return;
    if (n > GEMV_MAX_ROWS) {
        for (int j = 0; j < n_w; j++)
            if (ws[j]->rows > 0) DISPATCH_DTYPE(ws[j]->dtype, gemm_dt, ex, *ws[j], x, ldx, n, ys[j], ldys[j]);
        return;
    }
    // consecutive matrices of one dtype share a launch
    for (int j0 = 0; j0 < n_w;) {
        gemv_set set = {};
        while (j0 < n_w && set.n_mats < GEMV_MAX_MATS &&
               (set.n_mats == 0 || ws[j0]->dtype == set.w[0].dtype)) {
            int k = set.n_mats++;
            set.w[k] = *ws[j0];
            set.y[k] = ys[j0];
            set.ldy[k] = ldys[j0];
            j0++;
        }
        DISPATCH_DTYPE(set.w[0].dtype, gemv_dt, ex, set, x, ldx, n);
    }
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

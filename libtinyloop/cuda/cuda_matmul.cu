// cuda_matmul.cu — y = x W^T for every weight dtype, the embedding lookup and bias add.
//
// Decode (n <= 8 rows): a GEMV with one warp per output row; each lane decodes whole
// 32-element chunks of the row in registers (one 16-byte load for q4) and multiplies
// them with all n input rows, so the weights are read once per call. Activations stay
// fp32 and accumulation is fp32: results track the float64 oracle tightly.
// Prefill (n > 8): a tiled fp32 GEMM whose weight tiles are decoded into shared memory
// one chunk per row; correct and simple, not tensor-core fast (docs/cuda-backend.md).
#include "cuda_dequant.cuh"

namespace {

constexpr int GEMV_WARPS = 4;       // output rows per block
constexpr int GEMV_MAX_ROWS = 8;    // the largest n served by the GEMV

constexpr int GEMM_BM = 64;         // input rows per block
constexpr int GEMM_BN = 64;         // output features (weight rows) per block
constexpr int GEMM_BK = 32;         // one chunk
constexpr int GEMM_THREADS = 256;   // 16 x 16 threads, 4 x 4 outputs each

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int DT, int NR>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_kernel(dev_weight w, const float *__restrict__ x, size_t ldx, int n, int x_vec,
            float *__restrict__ y, size_t ldy) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= w.rows) return;
    const int n_chunks = (w.cols + 31) >> 5;
    float acc[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) acc[i] = 0.0f;

    for (int c = lane; c < n_chunks; c += 32) {
        float v[32];
        load_chunk<DT>(w, row, c, v);
        const int count = min(32, w.cols - c * 32);
#pragma unroll
        for (int i = 0; i < NR; i++) {
            if (i >= n) break;
            const float *xi = x + (size_t)i * ldx + (size_t)c * 32;
            float s = 0.0f;
            if (x_vec && count == 32) {
                const float4 *x4 = reinterpret_cast<const float4 *>(xi);
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    float4 f = x4[k];
                    s = fmaf(v[4 * k], f.x, s);
                    s = fmaf(v[4 * k + 1], f.y, s);
                    s = fmaf(v[4 * k + 2], f.z, s);
                    s = fmaf(v[4 * k + 3], f.w, s);
                }
            } else {
                for (int j = 0; j < count; j++) s = fmaf(v[j], xi[j], s);
            }
            acc[i] += s;
        }
    }
#pragma unroll
    for (int i = 0; i < NR; i++) {
        if (i >= n) break;
        float s = warp_sum(acc[i]);
        if (lane == 0) y[(size_t)i * ldy + row] = s;
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
void matmul_dt(tl_exec *ex, const dev_weight &w, const float *x, size_t ldx, int n, float *y,
               size_t ldy) {
    if (n <= GEMV_MAX_ROWS) {
        int x_vec = ((uintptr_t)x % 16 == 0) && (ldx % 4 == 0);
        dim3 grid((w.rows + GEMV_WARPS - 1) / GEMV_WARPS);
        dim3 block(GEMV_WARPS * 32);
        if (n == 1)
            gemv_kernel<DT, 1><<<grid, block, 0, ex->stream>>>(w, x, ldx, n, x_vec, y, ldy);
        else if (n == 2)
            gemv_kernel<DT, 2><<<grid, block, 0, ex->stream>>>(w, x, ldx, n, x_vec, y, ldy);
        else if (n <= 4)
            gemv_kernel<DT, 4><<<grid, block, 0, ex->stream>>>(w, x, ldx, n, x_vec, y, ldy);
        else
            gemv_kernel<DT, 8><<<grid, block, 0, ex->stream>>>(w, x, ldx, n, x_vec, y, ldy);
        EXEC_LAUNCHED(ex, "matmul (gemv)");
        return;
    }
    dim3 grid((w.rows + GEMM_BN - 1) / GEMM_BN, (n + GEMM_BM - 1) / GEMM_BM);
    gemm_kernel<DT><<<grid, GEMM_THREADS, 0, ex->stream>>>(w, x, ldx, n, y, ldy);
    EXEC_LAUNCHED(ex, "matmul (gemm)");
}

template <int DT>
void embed_dt(tl_exec *ex, const dev_weight &t, const int32_t *tokens, int n, float scale,
              float *out) {
    embed_kernel<DT><<<n, 128, 0, ex->stream>>>(t, tokens, scale, out);
    EXEC_LAUNCHED(ex, "embed");
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
    if (n <= 0 || w.rows <= 0) return;
    DISPATCH_DTYPE(w.dtype, matmul_dt, ex, w, x, ldx, n, y, ldy);
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
    add_bias_kernel<<<blocks, 256, 0, ex->stream>>>(y, n, d, bias);
    EXEC_LAUNCHED(ex, "add_bias");
}

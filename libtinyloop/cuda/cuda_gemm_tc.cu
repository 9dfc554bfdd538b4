// cuda_gemm_tc.cu — y = x W^T for many input rows (prefill, scoring) on tensor cores,
// for q8/q4/q2/f16 weights, at close to fp32 accuracy.
//
// The weights enter the tensor cores exactly: the integer codes of a quantized chunk
// (0..15, 0..3, -128..127) and f16 values are all f16 numbers. Scale and min are applied
// per group outside the MMA, as the GEMV does:
//     y[i, r] = sum_g  wscale[r, g] * sum_k code * x  +  wmin[r, g] * sum_k x
// The activations are fp32. A first kernel (split) scales each input row's 64-element
// k-step by a power of two so its largest magnitude is below 1 (exact, and no f16
// overflow) and splits every value into two f16 numbers hi + lo, which carry about 22
// significant bits; it also writes the per-chunk sums of x for the min term. Both
// halves go through the MMA (m16n8k16, f32 accumulation) into a per-group accumulator
// that is folded into the result with the scales. The error is then of the order of
// fp32 rounding of the k-step's largest activation, far inside the parity tolerance,
// for twice the MMA work, which tensor cores have to spare at these sizes. The split
// is done once per input for all the matrices that read it (q/k/v, gate/up), and those
// matrices share one launch, so the grid fills the device.
//
// Tiles: a block of 8 warps computes 64 input rows x 128 weight rows, each warp 32 x 32
// (2 x 4 MMA tiles), 64 k at a time: the activations' hi and lo planes are copied to
// shared memory as they are, the 128 weight rows' two chunks decoded to f16 codes, and
// fragments are read with ldmatrix. The next k-step's global loads are issued into
// registers before the current k-step's MMAs, so their latency overlaps the math. The
// fold costs three FMAs per output per group (per chunk for q* with group 32).
//
// Split over k: a batched decode step has at most 64 input rows, so a matrix of 2048
// output rows is 16 tiles, and 16 blocks leave most of the device idle while each walks
// all of k. When the tiles are fewer than the device holds, the k-steps are split among
// ksplit blocks per tile (grid z); each writes its partial tile to the scratch after the
// split activations, and a second kernel sums the partials in a fixed order (the result
// does not depend on scheduling) into the outputs.
#include "cuda_dequant.cuh"

#include <cuda_fp16.h>

#include <algorithm>

namespace {

constexpr int TC_BM = 64;          // input rows per block
constexpr int TC_BN = 128;         // weight rows (output features) per block
constexpr int TC_BK = 64;          // k per step: two chunks
constexpr int TC_THREADS = 256;    // 8 warps, 2 (rows) x 4 (weight rows) over the tile
constexpr int TC_LD = TC_BK + 8;   // halves per staged row: ldmatrix rows hit distinct banks
constexpr int TC_X_PIECES = 2 * TC_BM * TC_BK / 8 / TC_THREADS;   // uint4 of x planes per thread
constexpr int SPLIT_THREADS = 256;

// What the split kernel writes for n rows of k-padded width kp (a multiple of TC_BK).
struct tc_acts {
    const __half *hi, *lo;   // [n][kp]
    const float *scale;      // [n][kp / TC_BK]: the power of two each k-step was divided by
    const float *sum;        // [n][kp / 32]: sum of x over each chunk
    int kp;
};

__device__ __forceinline__ unsigned pack_half2(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);   // a in the low half: the lower k index
    return *reinterpret_cast<const unsigned *>(&h);
}
__device__ __forceinline__ uint2 pack_half4(float a, float b, float c, float d) {
    return make_uint2(pack_half2(a, b), pack_half2(c, d));
}

// hi/lo planes, per-k-step scales and per-chunk sums of x (see the file comment). A
// thread takes 4 elements; the 16 lanes of one k-step (and the 8 of one chunk) are
// consecutive lanes of a warp, since kp is a multiple of 64.
__global__ void __launch_bounds__(SPLIT_THREADS)
tc_split_kernel(const float *__restrict__ x, size_t ldx, int n, int cols, int x_vec, int kp, __half *hi,
                __half *lo, float *scale, float *sum) {
    pdl_wait();
    pdl_trigger();
    const int quads = kp / 4;
    const size_t idx = blockIdx.x * (size_t)SPLIT_THREADS + threadIdx.x;
    const bool valid = idx < (size_t)n * quads;
    const int i = valid ? (int)(idx / quads) : 0, q = valid ? (int)(idx % quads) : 0;
    const float4 v = valid ? load_x4(x + (size_t)i * ldx, q * 4, cols, x_vec) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float m = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    float s = (v.x + v.y) + (v.z + v.w);
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        s += __shfl_xor_sync(0xffffffffu, s, o);
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
    if (!valid) return;
    int e = 0;
    if (m > 0.0f && isfinite(m)) frexpf(m, &e);
    e = max(-100, min(100, e));
    const float inv = ldexpf(1.0f, -e);
    const float in[4] = { v.x * inv, v.y * inv, v.z * inv, v.w * inv };
    float h[4], l[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        h[j] = __half2float(__float2half_rn(in[j]));
        l[j] = in[j] - h[j];
    }
    const size_t at = (size_t)i * kp + (size_t)q * 4;
    *reinterpret_cast<uint2 *>(hi + at) = pack_half4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint2 *>(lo + at) = pack_half4(l[0], l[1], l[2], l[3]);
    if ((q & 15) == 0) scale[(size_t)i * (kp / TC_BK) + q / 16] = ldexpf(1.0f, e);
    if ((q & 7) == 0) sum[(size_t)i * (kp / 32) + q / 8] = s;
}

// c += a (16 x 16, row major) . b (16 x 8, column major), f16 in, f32 accumulate.
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], const unsigned *b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Four 8 x 8 f16 matrices from shared memory; lane l gives the address of row l % 8 of
// matrix l / 8 and receives row l / 4, columns 2 (l % 4) .. +1 of each.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const __half *p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
#endif
}

// fn(mt, nt, e, i, col) for every accumulator element of a warp's 32 x 32 tile: element
// e of MMA tile (mt, nt) sits at row i = wm + 16 mt + g (+8 for e >= 2) and column
// col = wn + 8 nt + 2t (+1 for odd e).
template <typename F>
__device__ __forceinline__ void for_each_acc(int wm, int wn, int g, int t, F fn) {
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                fn(mt, nt, e, wm + mt * 16 + g + (e >> 1) * 8, wn + nt * 8 + 2 * t + (e & 1));
}

struct tc_stage {
    __half x[2][TC_BM][TC_LD];      // hi, lo
    __half w[TC_BN][TC_LD];         // codes
    float wscale[TC_BN][2], wmin[TC_BN][2];   // per chunk of the step
    float xscale[TC_BM], xsum[TC_BM][2];
};

// FOLD: chunks per fold, 2 when both chunks of a k-step share their weight scale
// (group >= 64, or f16), else 1.
template <int DT, int FOLD>
__global__ void __launch_bounds__(TC_THREADS, 2)
gemm_tc_kernel(matrix_set set, tc_acts a, int n, float *part) {
    __shared__ __align__(16) tc_stage st;
    const int b = blockIdx.x;
    const int j = set_member(set, b);   // q/k/v or gate/up share the launch
    const dev_weight &w = set_weight(set, j);
    float *__restrict__ y = set_out(set, j);
    const size_t ldy = set_ld(set, j);
    const int tile = set_local(set, j, b);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.y * TC_BM, col0 = tile * TC_BN;
    const int wm = (warp >> 2) * 32, wn = (warp & 3) * 32;   // the warp's 32 x 32 sub-tile
    const int chunks = (w.cols + 31) >> 5, steps = a.kp / TC_BK;
    const int ks0 = (int)((long)blockIdx.z * steps / gridDim.z), ks1 = (int)((long)(blockIdx.z + 1) * steps / gridDim.z);
    const int w_row = tid >> 1, w_half = tid & 1;            // the row-chunk this thread stages

    uint4 xr[TC_X_PIECES];
    chunk_bits<DT> wb;
    float wsc, wmn, xsc = 0.0f, xs0 = 0.0f, xs1 = 0.0f;

    auto load_w = [&](int ks) {
        const int r = col0 + w_row, c = ks * 2 + w_half;
        wb = chunk_bits<DT>{};
        wsc = 0.0f;
        wmn = 0.0f;
        if (r >= w.rows || c >= chunks) return;
        wb = load_bits<DT>(w, r, c);
        if (dtype_traits<DT>::quantized) chunk_scale_min<DT>(w, r, c, &wsc, &wmn);
        else wsc = 1.0f;
    };
    auto load_x = [&](int ks) {
#pragma unroll
        for (int j = 0; j < TC_X_PIECES; j++) {
            const int p = tid + TC_THREADS * j, plane = p / (TC_BM * 8), r = (p / 8) % TC_BM, u = p % 8;
            const __half *src = (plane ? a.lo : a.hi) + (size_t)(row0 + r) * a.kp + ks * TC_BK + u * 8;
            xr[j] = row0 + r < n ? *reinterpret_cast<const uint4 *>(src) : make_uint4(0, 0, 0, 0);
        }
        if (tid < TC_BM && row0 + tid < n) {
            xsc = a.scale[(size_t)(row0 + tid) * steps + ks];
            xs0 = a.sum[(size_t)(row0 + tid) * (2 * steps) + 2 * ks];
            xs1 = a.sum[(size_t)(row0 + tid) * (2 * steps) + 2 * ks + 1];
        }
    };
    auto stage = [&]() {
#pragma unroll
        for (int j = 0; j < TC_X_PIECES; j++) {
            const int p = tid + TC_THREADS * j, plane = p / (TC_BM * 8), r = (p / 8) % TC_BM, u = p % 8;
            *reinterpret_cast<uint4 *>(&st.x[plane][r][u * 8]) = xr[j];
        }
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            float q[8];
            chunk_piece<DT>(wb, k, q);
            chunk_piece<DT>(wb, k + 1, q + 4);
            *reinterpret_cast<uint4 *>(&st.w[w_row][w_half * 32 + 4 * k]) =
                make_uint4(pack_half2(q[0], q[1]), pack_half2(q[2], q[3]), pack_half2(q[4], q[5]),
                           pack_half2(q[6], q[7]));
        }
        st.wscale[w_row][w_half] = wsc;
        st.wmin[w_row][w_half] = wmn;
        if (tid < TC_BM) {
            st.xscale[tid] = xsc;
            st.xsum[tid][0] = xs0;
            st.xsum[tid][1] = xs1;
        }
    };

    float acc[2][4][4], cacc[2][4][4];
    for_each_acc(wm, wn, g, t, [&](int mt, int nt, int e, int, int) { acc[mt][nt][e] = cacc[mt][nt][e] = 0.0f; });

    // acc += cacc * (x scale * weight scale) + weight min * sum(x) over chunks c0..c0+FOLD-1
    // of the step
    auto fold = [&](int c0) {
        for_each_acc(wm, wn, g, t, [&](int mt, int nt, int e, int i, int col) {
            const float xsum = FOLD == 2 ? st.xsum[i][0] + st.xsum[i][1] : st.xsum[i][c0];
            acc[mt][nt][e] = fmaf(cacc[mt][nt][e], st.xscale[i] * st.wscale[col][c0],
                                  fmaf(st.wmin[col][c0], xsum, acc[mt][nt][e]));
            cacc[mt][nt][e] = 0.0f;
        });
    };

    load_w(ks0);   // weights only, before the previous kernel has finished
    pdl_wait();
    pdl_trigger();
    load_x(ks0);

    for (int ks = ks0; ks < ks1; ks++) {
        stage();
        __syncthreads();
        if (ks + 1 < ks1) {
            load_w(ks + 1);
            load_x(ks + 1);
        }
#pragma unroll
        for (int kk = 0; kk < TC_BK; kk += 16) {
            unsigned bf[4][2];
#pragma unroll
            for (int pair = 0; pair < 2; pair++) {
                unsigned r[4];
                ldmatrix_x4(r, &st.w[wn + pair * 16 + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]);
                bf[2 * pair][0] = r[0];
                bf[2 * pair][1] = r[1];
                bf[2 * pair + 1][0] = r[2];
                bf[2 * pair + 1][1] = r[3];
            }
#pragma unroll
            for (int plane = 0; plane < 2; plane++)
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    unsigned af[4];
                    ldmatrix_x4(af, &st.x[plane][wm + mt * 16 + (lane & 15)][kk + (lane >> 4) * 8]);
#pragma unroll
                    for (int nt = 0; nt < 4; nt++) mma_16816(cacc[mt][nt], af, bf[nt]);
                }
            if (FOLD == 1 && kk == 16) fold(0);
        }
        fold(FOLD == 1 ? 1 : 0);
        __syncthreads();
    }

    if (part) {   // split over k: this block's partial tile, [z][row][set column]
        const size_t width = (size_t)gridDim.x * TC_BN;
        float *p = part + (size_t)blockIdx.z * n * width + (size_t)b * TC_BN;
        for_each_acc(wm, wn, g, t, [&](int mt, int nt, int e, int i, int col) {
            if (row0 + i < n) p[(size_t)(row0 + i) * width + col] = acc[mt][nt][e];
        });
        return;
    }
    for_each_acc(wm, wn, g, t, [&](int mt, int nt, int e, int i, int col) {
        if (row0 + i < n && col0 + col < w.rows) y[(size_t)(row0 + i) * ldy + col0 + col] = acc[mt][nt][e];
    });
}

// The partial tiles of a k-split launch summed, z in order, into each member's output.
__global__ void __launch_bounds__(256)
gemm_tc_sum_kernel(matrix_set set, const float *__restrict__ part, int n, int ksplit, int tiles) {
    pdl_wait();
    pdl_trigger();
    const size_t width = (size_t)tiles * TC_BN, idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (idx >= (size_t)n * width) return;
    const int i = (int)(idx / width), c = (int)(idx % width), tile = c / TC_BN;
    const int j = set_member(set, tile);
    const int col = set_local(set, j, tile) * TC_BN + c % TC_BN;
    if (col >= set_weight(set, j).rows) return;
    float s = 0.0f;
    for (int z = 0; z < ksplit; z++) s += part[((size_t)z * n + i) * width + c];
    set_out(set, j)[(size_t)i * set_ld(set, j) + col] = s;
}

constexpr int TC_MAX_SPLIT = 8;      // k-splits of one tile at most
constexpr int TC_MIN_SPLIT_STEPS = 4;   // k-steps a split block walks at least

// Blocks per tile over k (1: no split): enough for two blocks per SM, when the input
// rows are one tile high and the partials fit in the `room` bytes of scratch.
int split_count(const tl_exec *ex, int tiles, int n, int steps, size_t room) {
    if (!ex->split_k || n > TC_BM || tiles <= 0) return 1;
    int k = (2 * ex->sm_count + tiles - 1) / tiles;
    k = std::min(k, std::min(TC_MAX_SPLIT, steps / TC_MIN_SPLIT_STEPS));
    while (k > 1 && (size_t)k * n * tiles * TC_BN * sizeof(float) > room) k--;
    return k > 1 ? k : 1;
}

template <int DT>
void gemm_tc(tl_exec *ex, matrix_set set, const tc_acts &a, int n, float *part, size_t room) {
    set.first[0] = 0;
    for (int k = 0; k < set.n_mats; k++) set.first[k + 1] = set.first[k] + (set.w[k].rows + TC_BN - 1) / TC_BN;
    const int tiles = set.first[set.n_mats], ksplit = split_count(ex, tiles, n, a.kp / TC_BK, room);
    dim3 grid(tiles, (n + TC_BM - 1) / TC_BM, ksplit);
    float *partials = ksplit > 1 ? part : nullptr;
    // both chunks of a k-step share one scale unless groups are single chunks
    if (dtype_traits<DT>::quantized && set.w[0].group_shift == 0)
        launch(ex, "matmul (tensor-core gemm)", gemm_tc_kernel<DT, 1>, grid, TC_THREADS, 0, set, a, n, partials);
    else
        launch(ex, "matmul (tensor-core gemm)", gemm_tc_kernel<DT, 2>, grid, TC_THREADS, 0, set, a, n, partials);
    if (!partials) return;
    const size_t outputs = (size_t)n * tiles * TC_BN;
    launch(ex, "matmul (tensor-core gemm, k-split sum)", gemm_tc_sum_kernel, (int)((outputs + 255) / 256), 256, 0,
           set, (const float *)partials, n, ksplit, tiles);
}

bool tc_dtype(int dtype) {
    return dtype == TL_DTYPE_F16 || dtype == TL_DTYPE_Q8 || dtype == TL_DTYPE_Q4 || dtype == TL_DTYPE_Q2;
}

}  // namespace

size_t gemm_tc_scratch_bytes(int max_rows, int max_cols) {
    const size_t kp = ((size_t)max_cols + TC_BK - 1) / TC_BK * TC_BK, rows = max_rows > 0 ? (size_t)max_rows : 1;
    return rows * kp * 2 * sizeof(__half) + rows * (kp / TC_BK + kp / 32) * sizeof(float) + 4 * 256;
}

int launch_gemm_tc(tl_exec *ex, const dev_weight *const *ws, int n_w, const float *x, size_t ldx, int n,
                   float *const *ys, const size_t *ldys) {
    if (!ex->tensor_cores || !ex->tc_scratch || n <= 0 || n > ex->max_rows || n_w <= 0) return 0;
    const int cols = ws[0]->cols;
    for (int j = 0; j < n_w; j++)
        if (!tc_dtype(ws[j]->dtype) || ws[j]->cols != cols) return 0;
    const int kp = (cols + TC_BK - 1) / TC_BK * TC_BK;
    if (gemm_tc_scratch_bytes(n, cols) > ex->tc_scratch_bytes) return 0;

    // scratch: hi, lo, scales, sums, each 256-byte aligned
    auto align = [](size_t b) { return (b + 255) / 256 * 256; };
    char *base = static_cast<char *>(ex->tc_scratch);
    const size_t plane = align((size_t)n * kp * sizeof(__half));
    __half *hi = reinterpret_cast<__half *>(base), *lo = reinterpret_cast<__half *>(base + plane);
    float *scale = reinterpret_cast<float *>(base + 2 * plane);
    float *sum = reinterpret_cast<float *>(base + 2 * plane + align((size_t)n * (kp / TC_BK) * sizeof(float)));
    const int x_vec = cols % 4 == 0 && (uintptr_t)x % 16 == 0 && ldx % 4 == 0;
    const size_t threads = (size_t)n * (kp / 4);
    launch(ex, "matmul (tensor-core split)", tc_split_kernel, (int)((threads + SPLIT_THREADS - 1) / SPLIT_THREADS),
           SPLIT_THREADS, 0, x, ldx, n, cols, x_vec, kp, hi, lo, scale, sum);

    const tc_acts a = { hi, lo, scale, sum, kp };
    // what the split activations leave of the scratch holds a k-split's partial tiles
    const size_t used = 2 * plane + align((size_t)n * (kp / TC_BK) * sizeof(float)) +
                        align((size_t)n * (kp / 32) * sizeof(float));
    float *part = reinterpret_cast<float *>(base + used);
    const size_t room = ex->tc_scratch_bytes > used ? ex->tc_scratch_bytes - used : 0;
    // consecutive matrices of one dtype and group share a launch
    for (int j0 = 0; j0 < n_w;) {
        matrix_set set = {};
        while (j0 < n_w && set.n_mats < SET_MAX_MATS &&
               (set.n_mats == 0 || (ws[j0]->dtype == set.w[0].dtype && ws[j0]->group_shift == set.w[0].group_shift))) {
            if (ws[j0]->rows > 0) {
                const int k = set.n_mats++;
                set.w[k] = *ws[j0];
                set.y[k] = ys[j0];
                set.ldy[k] = ldys[j0];
            }
            j0++;
        }
        if (!set.n_mats) continue;
        switch (set.w[0].dtype) {
        case TL_DTYPE_F16: gemm_tc<TL_DTYPE_F16>(ex, set, a, n, part, room); break;
        case TL_DTYPE_Q8: gemm_tc<TL_DTYPE_Q8>(ex, set, a, n, part, room); break;
        case TL_DTYPE_Q4: gemm_tc<TL_DTYPE_Q4>(ex, set, a, n, part, room); break;
        default: gemm_tc<TL_DTYPE_Q2>(ex, set, a, n, part, room); break;
        }
    }
    return 1;
}

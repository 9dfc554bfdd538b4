// cuda_common.cuh — what the files of the CUDA backend share: the backend's private
// structs (behind backend.h's opaque tl_buf / tl_exec), the device view of a weight
// tensor, error recording, and the kernel launchers each .cu file provides.
//
// Errors: this library cannot call the core's tl_fail(). Functions that return a
// tl_status leave their message in a thread-local buffer (tl_cuda_last_error(),
// read by the core's loader); void ops record the first error of an execution state
// in the tl_exec, and ops->status() hands it over the same way.
#ifndef TL_CUDA_COMMON_CUH
#define TL_CUDA_COMMON_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

extern "C" {
#include "backend/backend.h"
}

#define TL_CUDA_API extern "C" __attribute__((visibility("default")))

// Device view of one weight tensor in the canonical layout of docs/format.md. Passed
// to kernels by value.
struct dev_weight {
    int dtype;             // tl_dtype
    int rows, cols;
    int group_shift;       // log2(group / 32): chunk index >> group_shift = group index
    int vec;               // rows start 16-byte aligned and cols % 32 == 0: vector loads
    const void *qs;        // values (f32/f16/bf16) or the packed qs plane
    const __half *scales;  // quantized only
    const __half *mins;    // q4/q2 only
};

// The backend's state (tl_backend.impl).
struct cuda_backend {
    int device;
    const struct tl_model *model;
    void *weight_arena;              // one cudaMalloc holding every weight
    uint64_t weight_bytes;           // file bytes uploaded
    dev_weight *weights;             // host array, one per uploaded tensor (backend_data)
    size_t n_weights;
    std::atomic<uint64_t> device_bytes;  // everything this backend holds from cudaMalloc
    // The loop body's weights (every core block, contiguous in the arena): the L2
    // access-policy window of every context (cuda_graph.cu).
    const void *core_base;
    size_t core_bytes;
};

// Where a kernel finds a position: base, plus the position the device holds for the
// decode step being replayed (dev = NULL outside recorded steps).
struct pos_arg {
    int base;
    const int *dev;
};
__device__ __forceinline__ int pos_value(pos_arg p) { return p.dev ? p.base + *p.dev : p.base; }

// Sum / max over a warp; every lane gets the same value (the butterfly combines the
// same two operands in both lanes of each pair).
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

// Up to three matrices that read the same input (q/k/v, gate/up), served by one launch:
// grid blocks (GEMV) or column tiles (GEMM) [first[j], first[j + 1]) are matrix j's.
constexpr int SET_MAX_MATS = 3;
struct matrix_set {
    dev_weight w[SET_MAX_MATS];
    float *y[SET_MAX_MATS];
    size_t ldy[SET_MAX_MATS];
    int first[SET_MAX_MATS + 1];
    int n_mats;
    int accumulate;   // y += W x instead of y = W x (GEMV)
    // GEMV only: 0, or y[0] = act(W[0] x) * (W[1] x) with act = SiLU (1) or GELU-tanh (2):
    // each block computes rows of both matrices and writes the gated product
    int gated_pairs;
};
// The member that block b serves, and its parts. Constant indices only, so a kernel's
// set stays in parameter space.
__device__ __forceinline__ int set_member(const matrix_set &s, int b) {
    return (s.n_mats > 1 && b >= s.first[1]) + (s.n_mats > 2 && b >= s.first[2]);
}
__device__ __forceinline__ const dev_weight &set_weight(const matrix_set &s, int j) {
    return j == 0 ? s.w[0] : j == 1 ? s.w[1] : s.w[2];
}
__device__ __forceinline__ float *set_out(const matrix_set &s, int j) {
    return j == 0 ? s.y[0] : j == 1 ? s.y[1] : s.y[2];
}
__device__ __forceinline__ size_t set_ld(const matrix_set &s, int j) {
    return j == 0 ? s.ldy[0] : j == 1 ? s.ldy[1] : s.ldy[2];
}
// b's place among the blocks of member j
__device__ __forceinline__ int set_local(const matrix_set &s, int j, int b) {
    return b - (j == 0 ? 0 : j == 1 ? s.first[1] : s.first[2]);
}

// Programmatic dependent launch (sm_90+): every kernel is launched so that the next
// one may start while it drains (launch() in cuda_graph.cu). So a kernel calls
// pdl_wait() before it reads or writes any activation, buffer or cache: only weights,
// which never change, may be read before. pdl_wait() returns once the previous kernel
// has completed and its writes are visible; pdl_trigger() lets the next kernel launch.
// Every kernel waits before it triggers, and none lets all its blocks leave before
// waiting, so a kernel that has started finds every kernel but its predecessor
// complete: data those wrote and its predecessor does not touch may be read before the
// wait too (decode attention's cached keys before the step's position). The step
// parameters (`pos_arg`) are set before a step and not changed during it.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Elements e .. e+3 of a row of `cols` activations, zero past the end; vec: the row
// is 16-byte aligned and cols % 4 == 0.
__device__ __forceinline__ float4 load_x4(const float *row, int e, int cols, int vec) {
    if (vec) return e < cols ? *reinterpret_cast<const float4 *>(row + e) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    return make_float4(e < cols ? row[e] : 0.0f, e + 1 < cols ? row[e + 1] : 0.0f,
                       e + 2 < cols ? row[e + 2] : 0.0f, e + 3 < cols ? row[e + 3] : 0.0f);
}

// What changes from one decode step to the next, uploaded before a step runs.
struct step_params {
    int pos;
    int token;
};

// Decode-step recording and replay (cuda_graph.cu). Between step_begin and step_end
// launches are kept as closures instead of running; step_end replays the graph
// captured for the same sequence of ops (the key), or captures one.
struct step_graph {
    uint64_t key;
    cudaGraphExec_t exec;
    int replays;
};
constexpr int STEP_GRAPHS = 4;     // one-row steps: graphs kept per context (one per depth in use, ...)
constexpr int BATCH_GRAPHS = 16;   // batched steps: one per batch-size bucket (and depth mix) in use

// The graphs of one kind of step, and whether that kind still records.
struct graph_cache {
    step_graph graphs[BATCH_GRAPHS];   // the first `limit` are used
    int limit;
    int next;                      // slot the next capture replaces
    int unused;                    // captures in a row that were never replayed
    int off;                       // graphs disabled for this kind of step (reason below)
    char reason[256];
};

// A batched step's per-row data (the rows' tokens, positions and cache slots; backend.h,
// batch_step_begin): appended to a pinned host table while the step's ops are called and
// uploaded in one copy to `dev` before the step runs (a replayed graph reads it there),
// or entry by entry when the step runs as it comes. Entries with the same bytes as an
// earlier one of the step are shared (every layer's positions, a layer's slots for its
// store and its attention).
struct row_table {
    char *host[2];                 // pinned, `cap` bytes each: steps alternate
    char *dev;
    size_t cap, used;
    int slot;
    std::vector<std::pair<size_t, size_t>> entries;   // (offset, bytes) of this step's
    int32_t *h_argmax, *d_argmax;  // argmax_rows: pinned results and their device copy
    struct pending {
        int32_t *out;
        int first, n;
    };
    std::vector<pending> results;  // argmax_rows of a recorded step, delivered at step_end
    int *arrivals;                 // attention_rows' split counters (zero between launches)
    int rows;                      // rows (max_rows) these were sized for; 0 = not yet
    size_t bytes;                  // device bytes of the above
};

struct step_state {
    int recording;                 // inside step_begin/step_end, launches deferred
    int batch;                     // a batched step (batch_step_begin) is open
    int pos;                       // the step's position
    uint64_t key;                  // hash of the step's ops and arguments
    std::vector<std::function<void(cudaStream_t)>> work;
    step_params host;              // uploaded to dev at step_end
    step_params *dev;
    step_params *upload_slots;     // pinned, two: uploads are copied from them in turn, so
                                   // the host may fill the next while one is in flight
    int next_slot;
    int device_token;              // the step's token is the last chained argmax, already
                                   // in dev->token: only the position is uploaded, and
                                   // nothing when dev->pos already holds it
    int dev_pos;                   // dev->pos once the queued work has run (-1: unknown)
    cudaEvent_t *chain_event;      // a chained argmax recorded in the step: its event,
                                   // recorded once the step's work is in the stream
    graph_cache one;               // one-row steps
    graph_cache batched;           // batched steps
    row_table rows;                // batched steps' rows
};

struct cuda_page_table;

struct tl_buf {
    float *data;
    size_t n;                 // elements
    cuda_backend *owner;
    cuda_page_table *table;   // a page table's view (data nullptr), else nullptr
    int elem;                 // bytes of an element: 4, or 2 for fp16 KV (buf_alloc_f16)
};

// A slot of a paged KV cache as kernels read and write it (kv_cache.h): row r of its
// keys at table[r >> shift] + k_off + (r & (2^shift - 1)) * row width, its values at
// v_off. The table lives in device memory and is updated in stream order
// (page_table_set), so a recorded step that holds its address reads the entries current
// at each replay. table == nullptr: a contiguous cache (the kernels' k / v pointers).
struct kv_pages {
    const float *const *table;
    int shift;
    size_t k_off, v_off;
};

// Row `row` of a slot's keys (plane 0) or values (plane 1): `flat` + row * width when
// contiguous, else its page's row, the page read from the table on the device (after
// pdl_wait: page_table_set is a kernel of the stream). Every kernel that reads or
// writes cache rows (attention, the KV stores, the fused RoPE + store epilogues) finds
// them here, so one kernel serves both layouts; T = float for the writers.
// T is the cache's element type (float, or __half for fp16 KV; offsets are in elements).
template <typename T>
__device__ __forceinline__ T *kv_row(T *flat, const kv_pages &pg, int plane, int row, size_t width) {
    if (!pg.table) return flat + (size_t)row * width;
    T *page = (T *)pg.table[row >> pg.shift];
    return page + (plane ? pg.v_off : pg.k_off) + (size_t)(row & ((1 << pg.shift) - 1)) * width;
}

// A cache element to and from fp32: fp16 rounds to nearest even and saturates at
// +-65504 (NaN stays NaN), so a large value stays large rather than infinite.
__device__ __forceinline__ float kv_get(float v) { return v; }
__device__ __forceinline__ float kv_get(__half v) { return __half2float(v); }
__device__ __forceinline__ void kv_put(float *p, float v) { *p = v; }
__device__ __forceinline__ void kv_put(__half *p, float v) {
    *p = __float2half_rn(v != v ? v : fminf(fmaxf(v, -65504.0f), 65504.0f));
}

// Host side: the kernels' view of a slot (k_cache / v_cache: a table's views at the slot's offset).
kv_pages kv_pages_of(tl_act k_cache, tl_act v_cache);

// One row's cache slot in a batched step (the *_rows ops), uploaded with the step's rows:
// k / v as a contiguous slot's row 0, pg its table when paged (kv_row).
struct row_slot {
    const void *k, *v;
    kv_pages pg;
};

struct tl_exec {
    cuda_backend *be;
    cudaStream_t stream;
    int max_rows, max_seq;
    int sm_count;             // multiprocessors, for sizing GEMV and attention grids
    size_t smem_optin;        // shared memory one block may opt into (GEMV activation rows)
    size_t smem_per_sm;       // shared memory of a multiprocessor (GEMV blocks per SM)
    int pdl;                  // kernels launched with programmatic dependent launch (sm_90+)
    int tensor_cores;         // prefill GEMM on tensor cores (sm_80+, TINYLOOP_CUDA_TC != 0)
    int gemv_int_dot;         // quantized GEMV on integer dot products (TINYLOOP_CUDA_DP4A != 0)
    int split_k;              // the tensor-core GEMM split over k for few tiles (TINYLOOP_CUDA_SPLIT_K != 0)
    void *tc_scratch;         // its split activations (gemm_tc_scratch_bytes)
    size_t tc_scratch_bytes;
    int32_t *d_ints;          // max_rows token ids / targets
    float *d_floats;          // max_rows results (log-probs)
    float *attn_partial;      // split-sequence attention states, then their arrival counters
    size_t attn_partial_floats;
    void *argmax_partial;     // the first argmax pass's per-block winners
    int32_t *h_result;        // pinned: argmax comes back through it
    // Chained greedy steps (backend.h): argmax results queued to the host, oldest at
    // chain_head; queue entry i is the argmax of the row at chain_pos[i % CHAIN_SLOTS],
    // which the kernel writes to h_chain[that position % CHAIN_SLOTS] (two queued
    // entries are consecutive positions), ready once chain_ready[i % CHAIN_SLOTS].
    static constexpr int CHAIN_SLOTS = 2;
    int chain;                // chaining offered (TINYLOOP_CUDA_CHAIN != 0)
    int32_t *h_chain;         // pinned and mapped, CHAIN_SLOTS
    int32_t *h_chain_dev;     // its device address
    int chain_pos[CHAIN_SLOTS];
    cudaEvent_t chain_ready[CHAIN_SLOTS];
    unsigned chain_head, chain_tail;
    size_t l2_persist_bytes;  // persisting L2 set aside for the loop body (0 = none)
    size_t l2_window_max;     // the device's largest access-policy window
    size_t bytes;             // device bytes of the above
    tl_status error;          // first asynchronous error since the last status()
    char message[512];
    step_state step;
};

// ---- errors ------------------------------------------------------------------------

// Record a message for the calling thread and return st.
tl_status cuda_fail(tl_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Thread-local message of the last failure (tl_cuda_last_error()).
const char *cuda_error_text();
// The core's services, handed over when it opens this library (tl_backend_host): this
// library writes nothing to stderr and reads no environment variable itself.
void cuda_log(tl_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// A switch of debug_flags.h (1 = on), as the core reads it now.
int cuda_switch(tl_debug_flag flag);
// Record err (if any) as the execution state's first error; returns 1 when err != success.
int exec_check(tl_exec *ex, cudaError_t err, const char *what);
// After a kernel launch: record a launch error.
#define EXEC_LAUNCHED(ex, what) exec_check((ex), cudaGetLastError(), (what))

static inline const dev_weight *W(const tl_tensor *t) {
    return static_cast<const dev_weight *>(t->backend_data);
}
static inline float *P(tl_act a) { return a.buf->data + a.off; }
// A position in a KV buffer (f32 or fp16 elements; a page table's view: its offset alone).
static inline void *KVP(tl_act a) { return (char *)a.buf->data + a.off * (size_t)a.buf->elem; }
static inline bool kv_half(tl_act a) { return a.buf && a.buf->elem == 2; }

// ---- decode steps (cuda_graph.cu) -------------------------------------------------

// Run fn on the context's stream now, or keep it for step_end while a step is recorded.
void enqueue(tl_exec *ex, std::function<void(cudaStream_t)> fn);
// kernel<<<grid, block, smem>>>(args...) through enqueue, recording launch errors;
// with programmatic dependent launch where the context uses it (ex->pdl).
template <typename... KArgs, typename... Args>
void launch(tl_exec *ex, const char *what, void (*kernel)(KArgs...), dim3 grid, dim3 block,
            size_t smem, Args... args) {
    const int pdl = ex->pdl;
    enqueue(ex, [=](cudaStream_t s) {
        cudaLaunchAttribute attr[1] = {};
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid;
        cfg.blockDim = block;
        cfg.dynamicSmemBytes = smem;
        cfg.stream = s;
        cfg.attrs = attr;
        cfg.numAttrs = pdl ? 1 : 0;
        exec_check(ex, cudaLaunchKernelEx(&cfg, kernel, args...), what);
    });
}
// pos0 as a kernel argument: itself, or relative to the recorded step's position.
pos_arg step_pos(tl_exec *ex, int pos0);
// Fold an op's identity and arguments into the step's key (positions relative).
void step_note(tl_exec *ex, std::initializer_list<uint64_t> values);
// Inside a recorded step, ops that need the host (transfers) first run what was
// recorded and leave the rest of the step eager.
void step_flush(tl_exec *ex);
void step_begin(tl_exec *ex, int pos);
void step_end(tl_exec *ex);
// A batched step of n rows (backend.h, batch_step_begin): returns the rows it runs.
int batch_begin(tl_exec *ex, int n, int max_rows, int record);
// `bytes` of host data for a batched step's kernels (row_table): their device address,
// valid while the step's work runs. nullptr (and an error recorded) when it does not fit.
const void *row_upload(tl_exec *ex, const void *data, size_t bytes);
// Once a chained argmax's work is in the stream (step.chain_event set): record its
// event, or after an error take its queue entry back (step_end does this for a
// recorded step).
void settle_chain_entry(tl_exec *ex);
tl_status step_init(tl_exec *ex);
void step_free(tl_exec *ex);

// ---- weights (cuda_weights.cu) -----------------------------------------------------

tl_status cuda_upload_model(cuda_backend *be, const struct tl_model *model);
void cuda_free_model(cuda_backend *be);

// ---- kernel launchers (each enqueues on ex->stream and records launch errors) ------

// cuda_matmul.cu
void launch_matmul(tl_exec *ex, const dev_weight &w, const float *x, size_t ldx, int n,
                   float *y, size_t ldy);
// Several weights applied to the same x (q/k/v, gate/up): one launch for decode rows.
void launch_matmul_multi(tl_exec *ex, const dev_weight *const *ws, int n_w, const float *x,
                         size_t ldx, int n, float *const *ys, const size_t *ldys);
// The input of a fused matmul (backend.h's tl_matmul_in on device pointers).
struct matmul_in_args {
    int kind;                      // tl_matmul_in_kind
    const float *x;
    size_t ldx;
    const float *up;               // GATED
    size_t ld_up;
    int gelu;                      // GATED
    const dev_weight *norm_w;      // NORM
    const dev_weight *norm_b;      // NORM, LayerNorm bias or NULL
    tl_norm_params norm_params;    // NORM
};
// ys[j] (+)= W_j . input for n decode rows; 0 (nothing launched) when the shape has no
// fused kernel (more than 8 rows, rows too wide for shared memory).
int launch_matmul_in(tl_exec *ex, const dev_weight *const *ws, int n_w, const matmul_in_args &a, int n,
                     float *const *ys, const size_t *ldys, int accumulate);
// y = act(W_gate . input) * (W_up . input) for n decode rows in one GEMV launch; 0
// (nothing launched) for shapes launch_matmul_in declines, f32 weights or matrices that
// differ in dtype or shape.
int launch_matmul_gated(tl_exec *ex, const dev_weight &w_gate, const dev_weight &w_up, const matmul_in_args &a,
                        int n, int gelu, float *y, size_t ldy);
// q/k/v (ws[0..2]) of n decode rows in one GEMV launch whose epilogue rotates q and k
// (RoPE at pos0..) and writes q to `q` and k, v to the caches' rows pos0.. (through pg's
// table when paged); 0 (nothing launched) for shapes launch_matmul_in declines, f32
// weights, mixed dtypes, or head sizes a row group cannot pair.
int launch_matmul_rope_store(tl_exec *ex, const dev_weight *const *ws, const matmul_in_args &a, int n, float *q,
                             size_t ldq, pos_arg pos0, const tl_rope_params &p, int head_dim, void *k_cache,
                             void *v_cache, const kv_pages &pg, bool half);
// cuda_gemm_tc.cu: ys[j] = x W_j^T on tensor cores for matrices of q8/q4/q2/f16 weights
// and one width; 0 (nothing launched) for other dtypes, or when the context has tensor
// cores off or too little scratch (ex->tc_scratch, gemm_tc_scratch_bytes()).
int launch_gemm_tc(tl_exec *ex, const dev_weight *const *ws, int n_w, const float *x, size_t ldx, int n,
                   float *const *ys, const size_t *ldys);
size_t gemm_tc_scratch_bytes(int max_rows, int max_cols);
void launch_embed(tl_exec *ex, const dev_weight &table, const int32_t *d_tokens, int n,
                  float scale, float *out);
void launch_add_bias(tl_exec *ex, float *y, int n, int d, const dev_weight &bias);

// cuda_elementwise.cu
// Strides and widths in elements of `elem` bytes.
void launch_copy_rows(tl_exec *ex, void *dst, size_t ld_dst, const void *src, size_t ld_src, int n, int width,
                      size_t elem = sizeof(float));
void launch_fill(tl_exec *ex, float *dst, size_t count, float value);
void launch_fill_noise(tl_exec *ex, float *dst, int n, int d, uint64_t seed, pos_arg pos0,
                       float sigma, float truncation);
// Cache arguments are void *: fp16 elements when half, else floats.
void launch_kv_store(tl_exec *ex, void *k_cache, void *v_cache, const float *k, const float *v, int n,
                     pos_arg pos0, int width, const kv_pages &pg, bool half);
void launch_kv_copy(tl_exec *ex, void *k_dst, void *v_dst, const kv_pages &dst_pg, const void *k_src,
                    const void *v_src, const kv_pages &src_pg, int pos, int width, bool half);
// RoPE on q (in place) and k, then k and v rows into the caches at pos0 (through pg's
// table when paged): one launch.
void launch_rope_store(tl_exec *ex, float *q, const float *k, const float *v, int n, pos_arg pos0,
                       const tl_rope_params &p, int n_head, int n_kv_head, int head_dim, void *k_cache,
                       void *v_cache, const kv_pages &pg, bool half);
// The batched form (backend.h, rope_store_rows): row r at pos[r] (device, -1: padding)
// into its slot slots[r] (device).
void launch_rope_store_rows(tl_exec *ex, float *q, const float *k, const float *v, int n, const int32_t *pos,
                            const row_slot *slots, const tl_rope_params &p, int n_head, int n_kv_head,
                            int head_dim, bool half);
// out[i] = argmax of row i of n rows of count floats, ld apart (device).
void launch_argmax_rows(tl_exec *ex, const float *x, int n, int count, size_t ld, int32_t *d_out);
void launch_add(tl_exec *ex, float *y, const float *x, size_t count);
void launch_norm(tl_exec *ex, const dev_weight &w, const dev_weight *bias,
                 const tl_norm_params &p, const float *x, int n, int d, float *out);
void launch_rope(tl_exec *ex, float *x, int n, int n_heads, int head_dim, pos_arg pos0,
                 const tl_rope_params &p);
void launch_gated_act(tl_exec *ex, float *gate, const float *up, size_t count, int gelu);
void launch_logprobs(tl_exec *ex, const float *logits, int n, int vocab,
                     const int32_t *d_targets, float *d_out);
// *d_out = the first index of the largest of count floats (sample_row.c's argmax), in
// two passes through ex->argmax_partial (argmax_partial_bytes() of device memory)
size_t argmax_partial_bytes();
// A chained argmax's extra outputs (cuda_argmax_chained); ring = nullptr: none.
struct argmax_chain {
    int32_t *ring;   // device address of the host's pinned ring (tl_exec::h_chain)
    pos_arg pos;     // position of the row the index is taken from
    int *next_pos;   // step_params::pos, set to pos + 1
};
void launch_argmax(tl_exec *ex, const float *x, int count, int32_t *d_out, const argmax_chain &chain = {});

// cuda_attention.cu
// Floats of split-sequence scratch attention needs for this geometry (decode rows).
size_t attention_partial_floats(int n_head, int head_dim, int max_seq);
// cuda_tree_attention.cu: tree speculation's RoPE and attention (backend.h, tl_tree)
void launch_rope_tree(tl_exec *ex, float *x, int n, int n_heads, int head_dim, const tl_tree &tree, int first,
                      const tl_rope_params &p);
void launch_tree_attention(tl_exec *ex, const float *q, int n, const tl_tree &tree, int first, const void *k_cache,
                           const void *v_cache, const tl_attn_geom &g, float *out, const kv_pages &pg, bool half);
void launch_attention(tl_exec *ex, const float *q, int n, int pos0, const void *k_cache, const void *v_cache,
                      const tl_attn_geom &g, float *out, const kv_pages &pg, bool half);
// The batched form (backend.h, attention_rows): row r at pos[r] (device, -1: padding,
// output 0) against its slot slots[r] (device); split over the keys when the rows are
// few (ex->step.rows.arrivals: counters for up to max_rows rows).
void launch_attention_rows(tl_exec *ex, const float *q, int n, const int32_t *pos, const row_slot *slots,
                           const tl_attn_geom &g, float *out, bool half);
// Entry `index` of a device page table := page (nullptr: none), in stream order.
void launch_page_table_set(tl_exec *ex, const float **table, int index, const float *page);

// cuda_weights.cu: the core blocks' byte range in the arena
void cuda_core_range(cuda_backend *be, const struct tl_model *model);

// cuda_sampling.cu
// *d_out = the token of a sampling step prepared on the host (sampling.h) from the
// vocab logits at `logits`, which the penalty modifies in place: tl_sample_row's token.
void launch_sample(tl_exec *ex, float *logits, int vocab, const tl_sample_step *step, int32_t *d_out);

#endif

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

extern "C" {
#include "backend.h"
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
};

struct tl_buf {
    float *data;
    size_t n;
    cuda_backend *owner;
};

struct tl_exec {
    cuda_backend *be;
    cudaStream_t stream;
    int max_rows, max_seq;
    int sm_count;             // multiprocessors, for sizing split-sequence attention
    int32_t *d_ints;          // max_rows token ids / targets
    float *d_floats;          // max_rows results (log-probs)
    float *attn_partial;      // split-sequence attention partials
    size_t attn_partial_floats;
    size_t bytes;             // device bytes of the above
    tl_status error;          // first asynchronous error since the last status()
    char message[512];
};

// ---- errors ------------------------------------------------------------------------

// Record a message for the calling thread and return st.
tl_status cuda_fail(tl_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Thread-local message of the last failure (tl_cuda_last_error()).
const char *cuda_error_text();
// Record err (if any) as the execution state's first error; returns 1 when err != success.
int exec_check(tl_exec *ex, cudaError_t err, const char *what);
// After a kernel launch: record a launch error.
#define EXEC_LAUNCHED(ex, what) exec_check((ex), cudaGetLastError(), (what))

static inline const dev_weight *W(const tl_tensor *t) {
    return static_cast<const dev_weight *>(t->backend_data);
}
static inline float *P(tl_act a) { return a.buf->data + a.off; }

// ---- weights (cuda_weights.cu) -----------------------------------------------------

tl_status cuda_upload_model(cuda_backend *be, const struct tl_model *model);
void cuda_free_model(cuda_backend *be);

// ---- kernel launchers (each enqueues on ex->stream and records launch errors) ------

// cuda_matmul.cu
void launch_matmul(tl_exec *ex, const dev_weight &w, const float *x, size_t ldx, int n,
                   float *y, size_t ldy);
void launch_embed(tl_exec *ex, const dev_weight &table, const int32_t *d_tokens, int n,
                  float scale, float *out);
void launch_add_bias(tl_exec *ex, float *y, int n, int d, const dev_weight &bias);

// cuda_elementwise.cu
void launch_copy_rows(tl_exec *ex, float *dst, size_t ld_dst, const float *src, size_t ld_src,
                      int n, int width);
void launch_fill(tl_exec *ex, float *dst, size_t count, float value);
void launch_fill_noise(tl_exec *ex, float *dst, int n, int d, uint64_t seed, int pos0,
                       float sigma);
void launch_add(tl_exec *ex, float *y, const float *x, size_t count);
void launch_norm(tl_exec *ex, const dev_weight &w, const dev_weight *bias,
                 const tl_norm_params &p, const float *x, int n, int d, float *out);
void launch_rope(tl_exec *ex, float *x, int n, int n_heads, int head_dim, int pos0,
                 const tl_rope_params &p);
void launch_gated_act(tl_exec *ex, float *gate, const float *up, size_t count, int gelu);
void launch_logprobs(tl_exec *ex, const float *logits, int n, int vocab,
                     const int32_t *d_targets, float *d_out);

// cuda_attention.cu
// Floats of split-sequence scratch attention needs for this geometry (decode rows).
size_t attention_partial_floats(int n_head, int head_dim, int max_seq);
void launch_attention(tl_exec *ex, const float *q, int n, int pos0, const float *k_cache,
                      const float *v_cache, const tl_attn_geom &g, float *out);

#endif

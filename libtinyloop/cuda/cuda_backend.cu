// cuda_backend.cu — entry points of libtinyloop_cuda.so and its tl_backend_ops table.
// The core dlopen()s this library only when a CUDA device is requested
// (src/backend/backend_loader.c). Nothing here aborts: synchronous failures return a
// tl_status with the message in a thread-local buffer (tl_cuda_last_error()), and
// failures of the asynchronous ops are recorded in the tl_exec and reported by
// ops->status(). All ops of one context run in order on that context's stream;
// download(), logprobs() and argmax() synchronise it. Decode steps may be recorded
// and replayed as CUDA graphs (cuda_graph.cu); every op here folds its arguments into
// the step's key with step_note, positions relative (step_pos), so that a replayed
// graph is only ever one recorded from the very same ops.
#include "cuda_common.cuh"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

// ---- errors --------------------------------------------------------------------------

namespace {
thread_local char error_text[1024];
}

tl_status cuda_fail(tl_status st, const char *fmt, ...) {
    char scratch[sizeof error_text];
    va_list args;
    va_start(args, fmt);
    vsnprintf(scratch, sizeof scratch, fmt, args);
    va_end(args);
    memcpy(error_text, scratch, sizeof scratch);
    return st;
}

const char *cuda_error_text() { return error_text; }

// ---- the core's services ------------------------------------------------------------------

namespace {
// Set by tl_cuda_backend_open before it creates a backend; the core's table is static.
std::atomic<const tl_backend_host *> host_services{nullptr};
}

void cuda_log(tl_log_level level, const char *fmt, ...) {
    const tl_backend_host *host = host_services.load();
    if (!host) return;
    char text[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(text, sizeof text, fmt, args);
    va_end(args);
    host->log(level, "%s", text);
}

int cuda_switch(tl_debug_flag flag) {
    const tl_backend_host *host = host_services.load();
    return host ? host->debug_switch(flag) : 1;
}

int exec_check(tl_exec *ex, cudaError_t err, const char *what) {
    if (err == cudaSuccess) return 0;
    if (ex->error == TL_OK) {
        ex->error = TL_ERR_BACKEND;
        snprintf(ex->message, sizeof ex->message, "CUDA error in %s: %s (%s)", what,
                 cudaGetErrorString(err), cudaGetErrorName(err));
    }
    return 1;
}

namespace {

// Ops may be called from any host thread: make the backend's device current.
int bind(tl_exec *ex) { return exec_check(ex, cudaSetDevice(ex->be->device), "cudaSetDevice"); }

// Where an op's arguments are out of what this execution state was sized for.
int exec_reject(tl_exec *ex, const char *what) {
    if (ex->error == TL_OK) {
        ex->error = TL_ERR_INTERNAL;
        snprintf(ex->message, sizeof ex->message, "CUDA backend: %s", what);
    }
    return 1;
}

cuda_backend *impl_of(const tl_backend *be) { return static_cast<cuda_backend *>(be->impl); }

__global__ void probe_kernel(int *out) {
    if (out) *out = 1;
}

// ---- model -----------------------------------------------------------------------------

tl_status cuda_prepare_model(tl_backend *be, const struct tl_model *model) {
    cuda_backend *impl = impl_of(be);
    impl->model = model;
    cudaError_t err = cudaSetDevice(impl->device);
    if (err != cudaSuccess)
        return cuda_fail(TL_ERR_BACKEND, "cudaSetDevice(%d): %s", impl->device, cudaGetErrorString(err));
    return cuda_upload_model(impl, model);
}

void cuda_destroy(tl_backend *be) {
    if (!be) return;
    cuda_backend *impl = impl_of(be);
    if (impl) {
        cudaSetDevice(impl->device);
        if (impl->core_bytes) cudaCtxResetPersistingL2Cache();
        cuda_free_model(impl);
        delete impl;
    }
    free(be);
}

void cuda_memory(const tl_backend *be, uint64_t *weights, uint64_t *repacked, uint64_t *device) {
    const cuda_backend *impl = impl_of(be);
    // the kernels read the file's layout; only the draft vocabulary's rows are a copy
    const uint64_t draft = impl->model ? impl->model->draft.head_bytes : 0;
    *weights = impl->weight_bytes - draft;
    *repacked = draft;
    *device = impl->device_bytes.load();
}

// ---- execution state -------------------------------------------------------------------

void cuda_exec_destroy(tl_exec *ex) {
    if (!ex) return;
    cudaSetDevice(ex->be->device);
    if (ex->stream) {
        cudaStreamSynchronize(ex->stream);
        cudaStreamDestroy(ex->stream);
    }
    step_free(ex);
    cudaFree(ex->d_ints);
    cudaFree(ex->d_floats);
    cudaFree(ex->attn_partial);
    cudaFree(ex->argmax_partial);
    cudaFree(ex->tc_scratch);
    cudaFreeHost(ex->h_result);
    for (cudaEvent_t ev : ex->chain_ready)
        if (ev) cudaEventDestroy(ev);
    ex->be->device_bytes -= ex->bytes;
    delete ex;
}

// n_threads is a CPU notion: the device needs no host workers.
tl_status cuda_exec_create(tl_backend *be, int /*n_threads*/, int max_rows, int max_seq, tl_exec **out) {
    cuda_backend *impl = impl_of(be);
    const tl_hparams &hp = impl->model->hp;
    tl_exec *ex = new (std::nothrow) tl_exec();
    if (!ex) return cuda_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a CUDA execution state");
    ex->be = impl;
    ex->max_rows = max_rows;
    ex->max_seq = max_seq;
    size_t rows = max_rows > 0 ? (size_t)max_rows : 1;
    ex->attn_partial_floats = attention_partial_floats(hp.n_head, hp.head_dim, max_seq);
    cudaError_t err = cudaSetDevice(impl->device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&ex->sm_count, cudaDevAttrMultiProcessorCount, impl->device);
    int smem_optin = 0;
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, impl->device);
    ex->smem_optin = smem_optin > 0 ? (size_t)smem_optin : 0;
    int smem_sm = 0;
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, impl->device);
    ex->smem_per_sm = smem_sm > 0 ? (size_t)smem_sm : 48 * 1024;
    int cc_major = 0;
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, impl->device);
    // Features a context uses unless their switch (debug_flags.h) is "0", read per
    // context: programmatic dependent launch, tensor cores, integer dot products in the
    // quantized GEMV, greedy decode steps chained on the device (generate.c's one step
    // ahead).
    ex->pdl = cc_major >= 9 && cuda_switch(TL_FLAG_CUDA_PDL);
    ex->tensor_cores = cc_major >= 8 && cuda_switch(TL_FLAG_CUDA_TC);
    ex->gemv_int_dot = cuda_switch(TL_FLAG_CUDA_DP4A);
    ex->chain = cuda_switch(TL_FLAG_CUDA_CHAIN);
    ex->split_k = cuda_switch(TL_FLAG_CUDA_SPLIT_K);
    if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&ex->stream, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaMalloc(&ex->d_ints, rows * sizeof(int32_t));
    if (err == cudaSuccess) err = cudaMalloc(&ex->d_floats, rows * sizeof(float));
    if (err == cudaSuccess) err = cudaMalloc(&ex->attn_partial, ex->attn_partial_floats * sizeof(float));
    // attention's arrival counters live in this scratch and must start at zero
    if (err == cudaSuccess)
        err = cudaMemsetAsync(ex->attn_partial, 0, ex->attn_partial_floats * sizeof(float), ex->stream);
    if (err == cudaSuccess) err = cudaMalloc(&ex->argmax_partial, argmax_partial_bytes());
    // h_result, then the chained argmax slots
    if (err == cudaSuccess)
        err = cudaHostAlloc((void **)&ex->h_result, (1 + tl_exec::CHAIN_SLOTS) * sizeof(int32_t), cudaHostAllocMapped);
    if (err == cudaSuccess) ex->h_chain = ex->h_result + 1;
    if (err == cudaSuccess) err = cudaHostGetDevicePointer((void **)&ex->h_chain_dev, ex->h_chain, 0);
    for (cudaEvent_t &ev : ex->chain_ready)
        if (err == cudaSuccess) err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    // the tensor-core GEMM's split activations, for chunks of more rows than the GEMV takes
    if (err == cudaSuccess && ex->tensor_cores && rows > 8) {
        const int widest = std::max({ 2 * hp.d, hp.n_head * hp.head_dim, hp.ffn });
        ex->tc_scratch_bytes = gemm_tc_scratch_bytes((int)rows, widest);
        err = cudaMalloc(&ex->tc_scratch, ex->tc_scratch_bytes);
    }
    if (err != cudaSuccess) {
        cudaGetLastError();
        ex->bytes = 0;
        cuda_exec_destroy(ex);
        return cuda_fail(TL_ERR_BACKEND, "cannot create a CUDA execution state: %s", cudaGetErrorString(err));
    }
    tl_status st = step_init(ex);
    if (st != TL_OK) {
        cuda_exec_destroy(ex);
        return st;
    }
    ex->bytes = rows * (sizeof(int32_t) + sizeof(float)) + ex->attn_partial_floats * sizeof(float) +
                argmax_partial_bytes() + sizeof(step_params) + ex->tc_scratch_bytes;
    impl->device_bytes += ex->bytes;
    *out = ex;
    return TL_OK;
}

size_t cuda_exec_bytes(const tl_exec *ex) { return ex->bytes; }

// Waits for the context's queued work, so kernel faults surface here, and returns the
// first error since the last call (message via tl_cuda_last_error()). While chained
// argmax results are queued it does not wait: the host is meant to run ahead, and
// faults surface when the results are read (cuda_chained_token).
tl_status cuda_status(tl_exec *ex) {
    if (!bind(ex) && ex->chain_head == ex->chain_tail)
        exec_check(ex, cudaStreamSynchronize(ex->stream), "a queued kernel");
    tl_status st = ex->error;
    if (st != TL_OK) {
        cuda_fail(st, "%s", ex->message);
        ex->error = TL_OK;
        ex->message[0] = '\0';
    }
    return st;
}

// ---- buffers and transfers --------------------------------------------------------------

// n elements of `elem` bytes (floats, or fp16 for KV caches).
tl_status buf_alloc_of(tl_backend *be, size_t n, int elem, tl_buf **out) {
    cuda_backend *impl = impl_of(be);
    tl_buf *b = static_cast<tl_buf *>(malloc(sizeof *b));
    if (!b) return cuda_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a buffer descriptor");
    size_t bytes = (n ? n : 1) * (size_t)elem;
    cudaError_t err = cudaSetDevice(impl->device);
    if (err == cudaSuccess) err = cudaMalloc(&b->data, bytes);
    if (err != cudaSuccess) {
        cudaGetLastError();
        free(b);
        return cuda_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate %.1f MiB of device memory: %s",
                         bytes / 1048576.0, cudaGetErrorString(err));
    }
    b->n = n;
    b->owner = impl;
    b->table = nullptr;
    b->elem = elem;
    impl->device_bytes += bytes;
    *out = b;
    return TL_OK;
}

tl_status cuda_buf_alloc(tl_backend *be, size_t n_floats, tl_buf **out) {
    return buf_alloc_of(be, n_floats, (int)sizeof(float), out);
}

tl_status cuda_buf_alloc_f16(tl_backend *be, size_t n, tl_buf **out) {
    return buf_alloc_of(be, n, (int)sizeof(__half), out);
}

void cuda_buf_free(tl_buf *b) {
    if (!b) return;
    cudaSetDevice(b->owner->device);
    cudaFree(b->data);
    b->owner->device_bytes -= (b->n ? b->n : 1) * (size_t)b->elem;
    free(b);
}

// From pageable host memory, cudaMemcpyAsync returns once the source has been staged,
// so callers may reuse `src` immediately.
void cuda_upload(tl_exec *ex, tl_act dst, const float *src, size_t count) {
    if (bind(ex) || count == 0) return;
    step_flush(ex);
    exec_check(ex, cudaMemcpyAsync(P(dst), src, count * sizeof(float), cudaMemcpyHostToDevice, ex->stream),
               "upload");
}

void cuda_download(tl_exec *ex, float *dst, tl_act src, size_t count) {
    if (bind(ex) || count == 0) return;
    step_flush(ex);
    if (!exec_check(ex, cudaMemcpyAsync(dst, P(src), count * sizeof(float), cudaMemcpyDeviceToHost, ex->stream),
                    "download"))
        exec_check(ex, cudaStreamSynchronize(ex->stream), "download (or a kernel before it)");
}

// A pointer, a size or a float as one value of a step's key.
uint64_t K(const void *p) { return (uint64_t)(uintptr_t)p; }
uint64_t K(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

// Rows of elements of the buffers' own type (floats, or fp16 between two KV buffers).
void cuda_copy_rows(tl_exec *ex, tl_act dst, size_t ld_dst, tl_act src, size_t ld_src, int n, int width) {
    if (bind(ex)) return;
    if (dst.buf->elem != src.buf->elem) {
        exec_reject(ex, "copy_rows between buffers of different element types");
        return;
    }
    step_note(ex, { 1, K(KVP(dst)), ld_dst, K(KVP(src)), ld_src, (uint64_t)n, (uint64_t)width });
    launch_copy_rows(ex, KVP(dst), ld_dst, KVP(src), ld_src, n, width, (size_t)dst.buf->elem);
}

void cuda_fill(tl_exec *ex, tl_act dst, size_t count, float value) {
    if (bind(ex)) return;
    step_note(ex, { 2, K(P(dst)), count, K(value) });
    launch_fill(ex, P(dst), count, value);
}

void cuda_fill_noise(tl_exec *ex, tl_act dst, int n, int d, uint64_t seed, int pos0, float sigma,
                     float truncation) {
    if (bind(ex)) return;
    pos_arg pos = step_pos(ex, pos0);
    step_note(ex, { 3, K(P(dst)), (uint64_t)n, (uint64_t)d, seed, (uint64_t)pos.base, K(sigma), K(truncation) });
    launch_fill_noise(ex, P(dst), n, d, seed, pos, sigma, truncation);
}

// Host ints (token ids, targets) into the execution state's device array.
int upload_ints(tl_exec *ex, const int32_t *values, int n, const char *what) {
    if (n > ex->max_rows) return exec_reject(ex, "more rows than the context was sized for");
    step_flush(ex);
    return exec_check(ex, cudaMemcpyAsync(ex->d_ints, values, (size_t)n * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, ex->stream), what);
}

// ---- math -------------------------------------------------------------------------------

// In a recorded step the token travels with the step's parameters (not in the key); in
// a chained step it is already on the device (tokens[0] is a placeholder).
void cuda_embed(tl_exec *ex, const tl_tensor *table, const int32_t *tokens, int n, float scale, tl_act out) {
    if (bind(ex) || n <= 0) return;
    if (ex->step.batch) {   // a batched step's tokens travel with its rows
        const void *d_tokens = row_upload(ex, tokens, (size_t)n * sizeof(int32_t));
        if (!d_tokens) return;
        step_note(ex, { 4, K(table), K(scale), K(P(out)), K(d_tokens), (uint64_t)n });
        launch_embed(ex, *W(table), static_cast<const int32_t *>(d_tokens), n, scale, P(out));
        return;
    }
    if ((ex->step.recording || ex->step.device_token) && n == 1) {
        step_note(ex, { 4, K(table), K(scale), K(P(out)) });
        if (!ex->step.device_token) ex->step.host.token = tokens[0];
        launch_embed(ex, *W(table), &ex->step.dev->token, 1, scale, P(out));
        return;
    }
    if (upload_ints(ex, tokens, n, "embed (token upload)")) return;
    launch_embed(ex, *W(table), ex->d_ints, n, scale, P(out));
}

void cuda_matmul(tl_exec *ex, const tl_tensor *w, tl_act x, size_t ldx, int n, tl_act y, size_t ldy) {
    if (bind(ex)) return;
    step_note(ex, { 5, K(w), K(P(x)), ldx, (uint64_t)n, K(P(y)), ldy });
    launch_matmul(ex, *W(w), P(x), ldx, n, P(y), ldy);
}

void cuda_matmul_multi(tl_exec *ex, const tl_tensor *const *ws, int n_w, tl_act x, size_t ldx, int n,
                       const tl_act *ys, const size_t *ldys) {
    if (bind(ex)) return;
    const dev_weight *dws[8];
    float *dys[8];
    step_note(ex, { 6, (uint64_t)n_w, K(P(x)), ldx, (uint64_t)n });
    for (int j0 = 0; j0 < n_w; j0 += 8) {
        int count = n_w - j0 < 8 ? n_w - j0 : 8;
        for (int j = 0; j < count; j++) {
            dws[j] = W(ws[j0 + j]);
            dys[j] = P(ys[j0 + j]);
            step_note(ex, { K(ws[j0 + j]), K(dys[j]), ldys[j0 + j] });
        }
        launch_matmul_multi(ex, dws, count, P(x), ldx, n, dys, ldys + j0);
    }
}

void cuda_add_bias(tl_exec *ex, tl_act y, int n, int d, const tl_tensor *bias) {
    if (bind(ex)) return;
    step_note(ex, { 7, K(P(y)), (uint64_t)n, (uint64_t)d, K(bias) });
    launch_add_bias(ex, P(y), n, d, *W(bias));
}

void cuda_add(tl_exec *ex, tl_act y, tl_act x, size_t count) {
    if (bind(ex)) return;
    step_note(ex, { 8, K(P(y)), K(P(x)), count });
    launch_add(ex, P(y), P(x), count);
}

void cuda_norm(tl_exec *ex, const tl_norm_weights *w, const tl_norm_params *p, tl_act x, int n, int d,
               tl_act out) {
    if (bind(ex)) return;
    step_note(ex, { 9, K(w), (uint64_t)p->type, (uint64_t)p->unit_offset, K(p->eps), K(P(x)), (uint64_t)n,
                    (uint64_t)d, K(P(out)) });
    const dev_weight *bias = (p->type == TL_NORMTYPE_LAYER && w->bias.data) ? W(&w->bias) : nullptr;
    launch_norm(ex, *W(&w->weight), bias, *p, P(x), n, d, P(out));
}

void cuda_rope(tl_exec *ex, tl_act x, int n, int n_heads, int head_dim, int pos0, const tl_rope_params *p) {
    if (bind(ex)) return;
    pos_arg pos = step_pos(ex, pos0);
    step_note(ex, { 10, K(P(x)), (uint64_t)n, (uint64_t)n_heads, (uint64_t)head_dim, (uint64_t)pos.base,
                    (uint64_t)p->rope_dims, (uint64_t)p->style, K(p->theta) });
    launch_rope(ex, P(x), n, n_heads, head_dim, pos, *p);
}

void cuda_gated_act(tl_exec *ex, tl_act gate, tl_act up, size_t count, tl_activation act) {
    if (bind(ex)) return;
    step_note(ex, { 11, K(P(gate)), K(P(up)), count, (uint64_t)act });
    launch_gated_act(ex, P(gate), P(up), count, act == TL_ACT_GELU_TANH ? 1 : 0);
}

void cuda_attention(tl_exec *ex, tl_act q, int n, int pos0, tl_act k_cache, tl_act v_cache,
                    const tl_attn_geom *g, tl_act out) {
    if (bind(ex)) return;
    const kv_pages pg = kv_pages_of(k_cache, v_cache);
    step_note(ex, { 12, K(P(q)), (uint64_t)n, (uint64_t)step_pos(ex, pos0).base, K(P(k_cache)), K(P(v_cache)),
                    (uint64_t)g->n_head, (uint64_t)g->n_kv_head, (uint64_t)g->head_dim, K(g->scale),
                    (uint64_t)g->window, K(P(out)) });
    launch_attention(ex, P(q), n, pos0, KVP(k_cache), KVP(v_cache), *g, P(out), pg, kv_half(k_cache));
}

// Tree speculation's passes are never inside a recorded step (forward.c brackets only
// one-row chunks), so these take their positions as they are.
void cuda_rope_tree(tl_exec *ex, tl_act x, int n, int n_heads, int head_dim, const tl_tree *tree, int first,
                    const tl_rope_params *p) {
    if (bind(ex)) return;
    launch_rope_tree(ex, P(x), n, n_heads, head_dim, *tree, first, *p);
}

void cuda_tree_attention(tl_exec *ex, tl_act q, int n, const tl_tree *tree, int first, tl_act k_cache,
                         tl_act v_cache, const tl_attn_geom *g, tl_act out) {
    if (bind(ex)) return;
    launch_tree_attention(ex, P(q), n, *tree, first, KVP(k_cache), KVP(v_cache), *g, P(out),
                          kv_pages_of(k_cache, v_cache), kv_half(k_cache));
}

void cuda_kv_store(tl_exec *ex, tl_act k_cache, tl_act v_cache, tl_act k, tl_act v, int n, int pos0,
                   int width) {
    if (bind(ex)) return;
    pos_arg pos = step_pos(ex, pos0);
    step_note(ex, { 13, K(KVP(k_cache)), K(KVP(v_cache)), K(P(k)), K(P(v)), (uint64_t)n, (uint64_t)pos.base,
                    (uint64_t)width });
    launch_kv_store(ex, KVP(k_cache), KVP(v_cache), P(k), P(v), n, pos, width, kv_pages_of(k_cache, v_cache),
                    kv_half(k_cache));
}

void cuda_kv_copy(tl_exec *ex, tl_act k_dst, tl_act v_dst, tl_act k_src, tl_act v_src, int pos, int width) {
    if (bind(ex)) return;
    launch_kv_copy(ex, KVP(k_dst), KVP(v_dst), kv_pages_of(k_dst, v_dst), KVP(k_src), KVP(v_src),
                   kv_pages_of(k_src, v_src), pos, width, kv_half(k_dst));
}

// The device form of a fused matmul's input.
static matmul_in_args matmul_in_of(const tl_matmul_in *in) {
    matmul_in_args a = {};
    a.kind = in->kind;
    a.x = P(in->x);
    a.ldx = in->ldx;
    if (in->kind == TL_MATMUL_IN_GATED) {
        a.up = P(in->up);
        a.ld_up = in->ld_up;
        a.gelu = in->act == TL_ACT_GELU_TANH;
    }
    if (in->kind == TL_MATMUL_IN_NORM) {
        a.norm_w = W(&in->norm->weight);
        a.norm_b = (in->norm_params->type == TL_NORMTYPE_LAYER && in->norm->bias.data) ? W(&in->norm->bias) : nullptr;
        a.norm_params = *in->norm_params;
    }
    return a;
}

static void note_matmul_in(tl_exec *ex, uint64_t op, const tl_matmul_in *in, const matmul_in_args &a, int n,
                           uint64_t extra) {
    step_note(ex, { op, (uint64_t)a.kind, K(a.x), a.ldx, K(a.up), a.ld_up, (uint64_t)a.gelu, K(in->norm),
                    (uint64_t)a.norm_params.type, (uint64_t)a.norm_params.unit_offset, K(a.norm_params.eps),
                    (uint64_t)n, extra });
}

// Decode rows through the GEMV with the norm or gated activation computed while the
// input is staged, and the residual added in its epilogue.
int cuda_matmul_in(tl_exec *ex, const tl_tensor *const *ws, int n_w, const tl_matmul_in *in, int n,
                   const tl_act *ys, const size_t *ldys, int accumulate) {
    if (n_w > 8) return 0;
    const dev_weight *dws[8];
    float *dys[8];
    for (int j = 0; j < n_w; j++) {
        dws[j] = W(ws[j]);
        dys[j] = P(ys[j]);
    }
    const matmul_in_args a = matmul_in_of(in);
    if (bind(ex)) return 1;
    if (!launch_matmul_in(ex, dws, n_w, a, n, dys, ldys, accumulate)) return 0;
    note_matmul_in(ex, 14, in, a, n, ((uint64_t)n_w << 1) | (uint64_t)accumulate);
    for (int j = 0; j < n_w; j++) step_note(ex, { K(ws[j]), K(dys[j]), ldys[j] });
    return 1;
}

// q/k/v projections of decode rows with RoPE and the KV store in the GEMV's epilogue;
// a paged slot's rows through its device page table (kv_row), like kv_store.
int cuda_matmul_rope_store(tl_exec *ex, const tl_tensor *const *ws, const tl_matmul_in *in, int n, tl_act q,
                           int pos0, const tl_rope_params *p, const tl_attn_geom *g, tl_act k_cache,
                           tl_act v_cache) {
    const matmul_in_args a = matmul_in_of(in);
    if (bind(ex)) return 1;
    const dev_weight *dws[3] = { W(ws[0]), W(ws[1]), W(ws[2]) };
    const size_t ldq = (size_t)g->n_head * g->head_dim;
    const pos_arg pos = step_pos(ex, pos0);
    if (!launch_matmul_rope_store(ex, dws, a, n, P(q), ldq, pos, *p, g->head_dim, KVP(k_cache), KVP(v_cache),
                                  kv_pages_of(k_cache, v_cache), kv_half(k_cache)))
        return 0;
    note_matmul_in(ex, 18, in, a, n, (uint64_t)pos.base);
    step_note(ex, { K(ws[0]), K(ws[1]), K(ws[2]), K(P(q)), K(KVP(k_cache)), K(KVP(v_cache)), (uint64_t)p->rope_dims,
                    (uint64_t)p->style, K(p->theta), (uint64_t)g->head_dim });
    return 1;
}

// act(W_gate . in) * (W_up . in) for decode rows: one GEMV launch whose blocks compute
// rows of both matrices and write their gated product.
int cuda_matmul_gated(tl_exec *ex, const tl_tensor *w_gate, const tl_tensor *w_up, const tl_matmul_in *in, int n,
                      tl_activation act, tl_act y, size_t ldy) {
    const matmul_in_args a = matmul_in_of(in);
    if (bind(ex)) return 1;
    const int gelu = act == TL_ACT_GELU_TANH;
    if (!launch_matmul_gated(ex, *W(w_gate), *W(w_up), a, n, gelu, P(y), ldy)) return 0;
    note_matmul_in(ex, 17, in, a, n, (uint64_t)gelu);
    step_note(ex, { K(w_gate), K(w_up), K(P(y)), ldy });
    return 1;
}

// RoPE on q and k, then the KV store (a paged slot's rows through its table): one launch.
int cuda_rope_store(tl_exec *ex, tl_act q, tl_act k, tl_act v, int n, int pos0, const tl_rope_params *p,
                    const tl_attn_geom *g, tl_act k_cache, tl_act v_cache) {
    if (bind(ex)) return 1;
    pos_arg pos = step_pos(ex, pos0);
    step_note(ex, { 15, K(P(q)), K(P(k)), K(P(v)), (uint64_t)n, (uint64_t)pos.base, (uint64_t)p->rope_dims,
                    (uint64_t)p->style, K(p->theta), (uint64_t)g->n_head, (uint64_t)g->n_kv_head,
                    (uint64_t)g->head_dim, K(KVP(k_cache)), K(KVP(v_cache)) });
    launch_rope_store(ex, P(q), P(k), P(v), n, pos, *p, g->n_head, g->n_kv_head, g->head_dim, KVP(k_cache),
                      KVP(v_cache), kv_pages_of(k_cache, v_cache), kv_half(k_cache));
    return 1;
}

// ---- batched steps (backend.h, batch_step_begin and the *_rows ops) ----------------------

// The rows' positions and their slots of this layer into the step's row table (shared
// by the layer's store and attention, the positions by every layer). Padding rows have
// no cache (buf NULL). False after an error (recorded).
bool upload_rows_of(tl_exec *ex, int n, const int32_t *pos, const tl_act *k_caches, const tl_act *v_caches,
                    const int32_t **d_pos, const row_slot **d_slots, bool *half) {
    // Field by field into zeroed entries: row_upload shares equal tables by their bytes
    // (the layer's store and attention), and a copied struct's padding is not defined.
    std::vector<row_slot> slots((size_t)n);
    *half = false;
    for (int r = 0; r < n; r++) {
        if (!k_caches[r].buf) continue;
        row_slot &s = slots[(size_t)r];
        const kv_pages pg = kv_pages_of(k_caches[r], v_caches[r]);
        s.k = KVP(k_caches[r]);
        s.v = KVP(v_caches[r]);
        s.pg.table = pg.table;
        s.pg.shift = pg.shift;
        s.pg.k_off = pg.k_off;
        s.pg.v_off = pg.v_off;
        *half = kv_half(k_caches[r]);
    }
    *d_pos = static_cast<const int32_t *>(row_upload(ex, pos, (size_t)n * sizeof(int32_t)));
    *d_slots = static_cast<const row_slot *>(row_upload(ex, slots.data(), slots.size() * sizeof(row_slot)));
    return *d_pos && *d_slots;
}

void cuda_rope_store_rows(tl_exec *ex, tl_act q, tl_act k, tl_act v, int n, const int32_t *pos,
                          const tl_rope_params *p, const tl_attn_geom *g, const tl_act *k_caches,
                          const tl_act *v_caches) {
    const int32_t *d_pos;
    const row_slot *d_slots;
    bool half;
    if (bind(ex) || n <= 0 || !upload_rows_of(ex, n, pos, k_caches, v_caches, &d_pos, &d_slots, &half)) return;
    step_note(ex, { 21, K(P(q)), K(P(k)), K(P(v)), (uint64_t)n, K(d_pos), K(d_slots), (uint64_t)p->rope_dims,
                    (uint64_t)p->style, K(p->theta), (uint64_t)g->n_head, (uint64_t)g->n_kv_head,
                    (uint64_t)g->head_dim, (uint64_t)half });
    launch_rope_store_rows(ex, P(q), P(k), P(v), n, d_pos, d_slots, *p, g->n_head, g->n_kv_head, g->head_dim, half);
}

void cuda_attention_rows(tl_exec *ex, tl_act q, int n, const int32_t *pos, const tl_act *k_caches,
                         const tl_act *v_caches, const tl_attn_geom *g, tl_act out) {
    const int32_t *d_pos;
    const row_slot *d_slots;
    bool half;
    if (bind(ex) || n <= 0 || !upload_rows_of(ex, n, pos, k_caches, v_caches, &d_pos, &d_slots, &half)) return;
    step_note(ex, { 22, K(P(q)), (uint64_t)n, K(d_pos), K(d_slots), (uint64_t)g->n_head, (uint64_t)g->n_kv_head,
                    (uint64_t)g->head_dim, K(g->scale), (uint64_t)g->window, K(P(out)), (uint64_t)half });
    launch_attention_rows(ex, P(q), n, d_pos, d_slots, *g, P(out), half);
}

int cuda_batch_step_begin(tl_exec *ex, int n, int max_rows, int record) {
    if (bind(ex)) return n;
    return batch_begin(ex, n, max_rows, record);
}

// One kernel for the rows; their indices come back in one copy (inside a recorded step,
// recorded with it and handed out at step_end).
void cuda_argmax_rows(tl_exec *ex, tl_act x, int n, int count, size_t ld, int32_t *out) {
    if (bind(ex) || n <= 0 || count <= 0) return;
    row_table &t = ex->step.rows;
    int first = 0;   // after the results still to be handed out
    for (const row_table::pending &r : t.results) first = std::max(first, r.first + r.n);
    if (!t.rows || first + n > t.rows) {
        exec_reject(ex, "argmax of more rows than the batched step holds");
        return;
    }
    step_note(ex, { 20, K(P(x)), (uint64_t)n, (uint64_t)count, ld, (uint64_t)first });
    int32_t *d_out = t.d_argmax + first, *h_out = t.h_argmax + first;
    launch_argmax_rows(ex, P(x), n, count, ld, d_out);
    enqueue(ex, [=](cudaStream_t s) {
        exec_check(ex, cudaMemcpyAsync(h_out, d_out, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost, s),
                   "argmax (rows, download)");
    });
    if (ex->step.recording) {
        t.results.push_back(row_table::pending{ out, first, n });
        return;
    }
    if (!exec_check(ex, cudaStreamSynchronize(ex->stream), "argmax (rows, or a kernel before it)"))
        memcpy(out, h_out, (size_t)n * sizeof(int32_t));
}

// ---- paged KV (backend.h, page_table_create) ---------------------------------------------

}  // namespace

// The table of a paged KV cache: n_entries page addresses in device memory (read by the
// kernels, so that recorded steps replay against the current pages), and its two views.
struct cuda_page_table {
    tl_buf k_view, v_view;   // their elem: the pages' (fp16 when the cache is)
    const float **d_table;
    int n_entries, shift;
    size_t plane;   // floats of a page's keys: n_slots * page_size * width
};

kv_pages kv_pages_of(tl_act k_cache, tl_act v_cache) {
    kv_pages pg = {};
    const cuda_page_table *t = k_cache.buf->table;
    if (!t) return pg;
    pg.table = t->d_table;
    pg.shift = t->shift;
    pg.k_off = k_cache.off;
    pg.v_off = t->plane + v_cache.off;
    return pg;
}

namespace {

tl_status cuda_page_table_create(tl_backend *be, int n_entries, int page_size, int n_slots, int width, int f16,
                                 tl_buf **k_view, tl_buf **v_view) {
    cuda_backend *impl = impl_of(be);
    cuda_page_table *t = static_cast<cuda_page_table *>(calloc(1, sizeof *t));
    if (!t) return cuda_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a KV page table");
    const size_t bytes = (size_t)n_entries * sizeof *t->d_table;
    cudaError_t err = cudaSetDevice(impl->device);
    if (err == cudaSuccess) err = cudaMalloc(reinterpret_cast<void **>(&t->d_table), bytes);
    if (err == cudaSuccess) err = cudaMemset(t->d_table, 0, bytes);
    if (err != cudaSuccess) {
        cudaGetLastError();
        if (t->d_table) cudaFree(t->d_table);
        free(t);
        return cuda_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a KV page table of %d entries: %s", n_entries,
                         cudaGetErrorString(err));
    }
    t->n_entries = n_entries;
    while ((1 << t->shift) < page_size) t->shift++;
    t->plane = (size_t)n_slots * (size_t)page_size * (size_t)width;
    const int elem = f16 ? (int)sizeof(__half) : (int)sizeof(float);
    t->k_view = tl_buf{ nullptr, 0, impl, t, elem };
    t->v_view = tl_buf{ nullptr, 0, impl, t, elem };
    impl->device_bytes += bytes;
    *k_view = &t->k_view;
    *v_view = &t->v_view;
    return TL_OK;
}

void cuda_page_table_set(tl_exec *ex, tl_buf *k_view, int index, tl_buf *page) {
    if (bind(ex)) return;
    step_flush(ex);
    launch_page_table_set(ex, k_view->table->d_table, index, page ? page->data : nullptr);
}

void cuda_page_table_free(tl_buf *k_view) {
    if (!k_view) return;
    cuda_page_table *t = k_view->table;
    cudaSetDevice(k_view->owner->device);
    cudaFree(t->d_table);   // waits for the device: no kernel reads it any more
    k_view->owner->device_bytes -= (size_t)t->n_entries * sizeof *t->d_table;
    free(t);
}

// Two kernels find the index on the device; four bytes come back through pinned memory.
int32_t cuda_argmax(tl_exec *ex, tl_act x, int count) {
    if (bind(ex) || count <= 0) return 0;
    step_flush(ex);
    launch_argmax(ex, P(x), count, ex->d_ints);
    if (exec_check(ex, cudaMemcpyAsync(ex->h_result, ex->d_ints, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                       ex->stream), "argmax (download)") ||
        exec_check(ex, cudaStreamSynchronize(ex->stream), "argmax (or a kernel before it)"))
        return 0;
    return *ex->h_result;
}

// Chained greedy steps (backend.h): the index goes to the step parameters' token, which
// the next chained step's embed reads, and to the host's pinned ring, behind an event.
// Inside a recorded step the argmax is part of the step's graph and its event is
// recorded after the graph (step_end); between two steps the stream holds the event,
// the position's upload and the graph launch. The argmax also leaves the next position
// in the parameters, which spares the step after an eager (prompt) argmax its upload.
int cuda_chain_available(tl_exec *ex) { return !bind(ex) && ex->chain; }

void cuda_argmax_chained(tl_exec *ex, tl_act x, int count, int pos) {
    // queue nothing after an error: the forward pass then fails (status() reports it), so
    // the caller does not count this result, and a queued one would be read by the next
    if (bind(ex) || count <= 0 || ex->error != TL_OK) return;
    const unsigned queued = ex->chain_tail - ex->chain_head;
    if (queued >= (unsigned)tl_exec::CHAIN_SLOTS) {
        exec_reject(ex, "more chained decode steps queued than the host has read");
        return;
    }
    const unsigned slot = ex->chain_tail % tl_exec::CHAIN_SLOTS;
    if (queued > 0 && ex->chain_pos[(ex->chain_tail - 1) % tl_exec::CHAIN_SLOTS] != pos - 1) {
        exec_reject(ex, "queued chained decode steps must be at consecutive positions");
        return;
    }
    step_state &s = ex->step;
    step_note(ex, { 19, K(P(x)), (uint64_t)count });
    const argmax_chain chain = { ex->h_chain_dev, step_pos(ex, pos), &s.dev->pos };
    launch_argmax(ex, P(x), count, &s.dev->token, chain);
    if (!s.recording && ex->error != TL_OK) return;   // not queued: nothing to count
    s.dev_pos = pos + 1;
    ex->chain_pos[slot] = pos;
    ex->chain_tail++;
    s.chain_event = &ex->chain_ready[slot];
    if (!s.recording) settle_chain_entry(ex);   // else at step_end, after the step's launch
}

int32_t cuda_chained_token(tl_exec *ex) {
    if (bind(ex)) return -1;
    if (ex->chain_head == ex->chain_tail) {
        exec_reject(ex, "no chained decode step is queued");
        return -1;
    }
    const unsigned slot = ex->chain_head++ % tl_exec::CHAIN_SLOTS;
    if (exec_check(ex, cudaEventSynchronize(ex->chain_ready[slot]), "chained argmax (or a kernel before it)") ||
        ex->error != TL_OK)
        return -1;
    return ex->h_chain[ex->chain_pos[slot] % tl_exec::CHAIN_SLOTS];
}

void cuda_step_token_on_device(tl_exec *ex) { ex->step.device_token = 1; }

// A sampling step on the device (cuda_sampling.cu); four bytes come back as for argmax.
int32_t cuda_sample(tl_exec *ex, tl_act logits, int vocab, const tl_sample_step *step) {
    if (bind(ex) || vocab <= 0) return 0;
    step_flush(ex);
    launch_sample(ex, P(logits), vocab, step, ex->d_ints);
    if (exec_check(ex, cudaMemcpyAsync(ex->h_result, ex->d_ints, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                       ex->stream), "sample (download)") ||
        exec_check(ex, cudaStreamSynchronize(ex->stream), "sample (or a kernel before it)"))
        return 0;
    return *ex->h_result;
}

void cuda_step_begin(tl_exec *ex, int pos) {
    if (!bind(ex)) step_begin(ex, pos);
}

void cuda_step_end(tl_exec *ex) {
    if (!bind(ex)) step_end(ex);
    // the chained token was this step's: a one-row pass outside a step (the logit lens)
    // embeds the token it is given
    ex->step.device_token = 0;
}

void cuda_logprobs(tl_exec *ex, tl_act logits, int n, int vocab, const int32_t *targets, float *out) {
    if (bind(ex) || n <= 0 || upload_ints(ex, targets, n, "logprobs (target upload)")) return;
    launch_logprobs(ex, P(logits), n, vocab, ex->d_ints, ex->d_floats);
    if (!exec_check(ex, cudaMemcpyAsync(out, ex->d_floats, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost,
                                        ex->stream), "logprobs (download)"))
        exec_check(ex, cudaStreamSynchronize(ex->stream), "logprobs (or a kernel before it)");
}

// Designated initializers: C++20's, accepted as an extension in this C++17 build (nvcc
// and g++ alike); in C++ they must follow the order of the fields.
const tl_backend_ops cuda_ops = {
    .version = TL_BACKEND_INTERFACE_VERSION,
    .struct_size = sizeof(tl_backend_ops),
    .prepare_model = cuda_prepare_model,
    .destroy = cuda_destroy,
    .memory = cuda_memory,
    .exec_create = cuda_exec_create,
    .exec_destroy = cuda_exec_destroy,
    .exec_bytes = cuda_exec_bytes,
    .status = cuda_status,
    .buf_alloc = cuda_buf_alloc,
    .buf_free = cuda_buf_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .copy_rows = cuda_copy_rows,
    .fill = cuda_fill,
    .fill_noise = cuda_fill_noise,
    .embed = cuda_embed,
    .matmul = cuda_matmul,
    .matmul_multi = cuda_matmul_multi,
    .add_bias = cuda_add_bias,
    .add = cuda_add,
    .norm = cuda_norm,
    .rope = cuda_rope,
    .gated_act = cuda_gated_act,
    .attention = cuda_attention,
    .logprobs = cuda_logprobs,
    .argmax = cuda_argmax,
    .kv_store = cuda_kv_store,
    .kv_copy = cuda_kv_copy,
    .matmul_in = cuda_matmul_in,
    .rope_store = cuda_rope_store,
    .step_begin = cuda_step_begin,
    .step_end = cuda_step_end,
    .sample = cuda_sample,
    .matmul_gated = cuda_matmul_gated,
    .matmul_rope_store = cuda_matmul_rope_store,
    .chain_available = cuda_chain_available,
    .argmax_chained = cuda_argmax_chained,
    .chained_token = cuda_chained_token,
    .step_token_on_device = cuda_step_token_on_device,
    .rope_tree = cuda_rope_tree,
    .tree_attention = cuda_tree_attention,
    .page_table_create = cuda_page_table_create,
    .page_table_set = cuda_page_table_set,
    .page_table_free = cuda_page_table_free,
    .buf_alloc_f16 = cuda_buf_alloc_f16,
    .rope_store_rows = cuda_rope_store_rows,
    .attention_rows = cuda_attention_rows,
    .batch_step_begin = cuda_batch_step_begin,
    .argmax_rows = cuda_argmax_rows,
};

int write_msg(char *msg, size_t msg_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int write_msg(char *msg, size_t msg_len, const char *fmt, ...) {
    if (msg && msg_len) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(msg, msg_len, fmt, args);
        va_end(args);
    }
    return 1;
}

}  // namespace

// ---- exported entry points ----------------------------------------------------------------

// Fills *device_count and a human-readable description of device 0 (or the error).
// Returns 0 when at least one device is usable, non-zero otherwise.
TL_CUDA_API int tl_cuda_probe(int *device_count, char *msg, size_t msg_len) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (device_count) *device_count = (err == cudaSuccess) ? count : 0;
    if (err != cudaSuccess) return write_msg(msg, msg_len, "CUDA unavailable: %s", cudaGetErrorString(err));
    if (count == 0) return write_msg(msg, msg_len, "no CUDA device found");
    cudaDeviceProp prop;
    err = cudaGetDeviceProperties(&prop, 0);
    if (err != cudaSuccess) return write_msg(msg, msg_len, "cudaGetDeviceProperties: %s", cudaGetErrorString(err));
    write_msg(msg, msg_len, "%d device(s); device 0: %s (sm_%d%d, %.1f GiB)", count, prop.name, prop.major,
              prop.minor, prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    return 0;
}

// This library's side of the handshake: the core reads the version and size of the
// table before it calls anything else here (backend_loader.c).
TL_CUDA_API const tl_backend_ops *tl_cuda_backend_ops(void) { return &cuda_ops; }

// The entry point of the cores before the handshake: they get a reason, not a backend.
TL_CUDA_API int tl_cuda_backend_create(int, tl_backend **out, char *msg, size_t msg_len) {
    *out = nullptr;
    return write_msg(msg, msg_len, "this libtinyloop_cuda.so needs the libtinyloop.so of its own build "
                     "(the one here predates the backend interface check); rebuild them together");
}

// Creates the backend on device `device_index` (-1 = device 0) for the core whose
// services `host` are. Returns 0 and *out; 2 when host comes from another build, 1
// when no device serves, with the reason in msg.
TL_CUDA_API int tl_cuda_backend_open(const tl_backend_host *host, int device_index, tl_backend **out,
                                     char *msg, size_t msg_len) {
    *out = nullptr;
    const char *core = "libtinyloop.so", *self = "libtinyloop_cuda.so";
    if (!host) {
        write_msg(msg, msg_len, "tl_cuda_backend_open: no host interface");
        return 2;
    }
    // version and struct_size first: the other fields mean something only when they match
    if (tl_backend_interface_mismatch(core, self, "tl_backend_host", host->version, host->struct_size,
                                      sizeof(tl_backend_host), msg, msg_len) ||
        tl_backend_interface_mismatch(core, self, "tl_backend_ops", host->version, host->ops_size,
                                      sizeof(tl_backend_ops), msg, msg_len) ||
        tl_backend_interface_mismatch(core, self, "tl_model", host->version, host->model_size,
                                      sizeof(struct tl_model), msg, msg_len))
        return 2;
    host_services.store(host);
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) return write_msg(msg, msg_len, "CUDA unavailable: %s", cudaGetErrorString(err));
    int device = device_index < 0 ? 0 : device_index;
    if (device >= count)
        return write_msg(msg, msg_len, "CUDA device %d requested but %d device(s) found", device, count);
    cudaDeviceProp prop;
    err = cudaSetDevice(device);
    if (err == cudaSuccess) err = cudaGetDeviceProperties(&prop, device);
    if (err != cudaSuccess) return write_msg(msg, msg_len, "CUDA device %d: %s", device, cudaGetErrorString(err));
    // Fails when the library holds no code this GPU can run (built for other archs).
    cudaFuncAttributes attr;
    err = cudaFuncGetAttributes(&attr, probe_kernel);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return write_msg(msg, msg_len, "CUDA device %d (%s, sm_%d%d) cannot run this build's kernels: %s; "
                         "rebuild with -Dgpu_archs=%d%d", device, prop.name, prop.major, prop.minor,
                         cudaGetErrorString(err), prop.major, prop.minor);
    }
    tl_backend *be = static_cast<tl_backend *>(calloc(1, sizeof *be));
    cuda_backend *impl = new (std::nothrow) cuda_backend();
    if (!be || !impl) {
        free(be);
        delete impl;
        return write_msg(msg, msg_len, "cannot allocate the CUDA backend");
    }
    impl->device = device;
    be->ops = &cuda_ops;
    be->impl = impl;
    be->device_index = device;
    be->prefill_rows = 512;   // more rows per launch fill the device (tensor-core GEMM tiles)
    be->kv_dtype = TL_KV_DTYPE_F16;   // half the cache and the bytes decode attention reads
    snprintf(be->name, sizeof be->name, "cuda:%d (%.40s)", device, prop.name);
    *out = be;
    return 0;
}

// This thread's message of the last failed op that returned a tl_status.
TL_CUDA_API const char *tl_cuda_last_error(void) { return cuda_error_text(); }

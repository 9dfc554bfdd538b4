// cuda_weights.cu — prepare_model: every weight tensor of the model goes to the device
// in one allocation (the "arena"), streamed from the mmapped file through two pinned
// staging halves (copy into one while the other is in flight), so the host never
// holds a second copy of the model. Tensors keep the file's layout (the kernels decode
// it directly, cuda_dequant.cuh); each gets a dev_weight through backend_data.
#include "cuda_common.cuh"

#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr size_t STAGE_BYTES = 8u << 20;   // per staging half
constexpr size_t PLANE_ALIGN = 256;        // every plane starts 16-byte (and cache-line) aligned

bool is_quantized(tl_dtype d) { return d == TL_DTYPE_Q8 || d == TL_DTYPE_Q4 || d == TL_DTYPE_Q2; }

size_t align_up(size_t v) { return (v + PLANE_ALIGN - 1) & ~(PLANE_ALIGN - 1); }

// The three planes of a tensor in the file: values / qs, scales, mins.
struct planes {
    const void *src[3];
    size_t bytes[3];
};

planes tensor_planes(const tl_tensor *t) {
    planes p = {};
    const size_t n = (size_t)t->rows * (size_t)t->cols;
    const size_t groups = t->group > 0 ? n / (size_t)t->group : 0;
    p.src[0] = t->data;
    switch (t->dtype) {
    case TL_DTYPE_F32: p.bytes[0] = 4 * n; break;
    case TL_DTYPE_F16:
    case TL_DTYPE_BF16: p.bytes[0] = 2 * n; break;
    case TL_DTYPE_Q8: p.bytes[0] = n; break;
    case TL_DTYPE_Q4: p.bytes[0] = n / 2; break;
    case TL_DTYPE_Q2: p.bytes[0] = n / 4; break;
    default: break;
    }
    if (is_quantized(t->dtype)) {
        p.src[1] = t->scales;
        p.bytes[1] = 2 * groups;
        if (t->dtype != TL_DTYPE_Q8) {
            p.src[2] = t->mins;
            p.bytes[2] = 2 * groups;
        }
    }
    return p;
}

int group_shift(int32_t group) {
    return group == 128 ? 2 : group == 64 ? 1 : 0;
}

void add_norm(std::vector<tl_tensor *> &list, const tl_norm_weights *n) {
    list.push_back(const_cast<tl_tensor *>(&n->weight));
    list.push_back(const_cast<tl_tensor *>(&n->bias));
}

void add_block(std::vector<tl_tensor *> &list, const tl_block_weights *b) {
    const tl_tensor *ts[] = { &b->wq, &b->wk, &b->wv, &b->wo, &b->bq, &b->bk, &b->bv,
                              &b->w_gate, &b->w_up, &b->w_down };
    for (const tl_tensor *t : ts) list.push_back(const_cast<tl_tensor *>(t));
    add_norm(list, &b->attn_norm);
    add_norm(list, &b->attn_post_norm);
    add_norm(list, &b->mlp_norm);
    add_norm(list, &b->mlp_post_norm);
}

// Every tensor view of the model that holds data (absent ones have data == NULL).
std::vector<tl_tensor *> model_tensors(const struct tl_model *m) {
    std::vector<tl_tensor *> all, present;
    all.push_back(const_cast<tl_tensor *>(&m->embed));
    all.push_back(const_cast<tl_tensor *>(&m->output));
    all.push_back(const_cast<tl_tensor *>(&m->draft.head));   // the drafts' rows of it (draft_vocab.h)
    add_norm(all, &m->final_norm);
    add_norm(all, &m->loop_norm);
    add_norm(all, &m->post_loop_norm);
    all.push_back(const_cast<tl_tensor *>(&m->exit_gate_w));
    all.push_back(const_cast<tl_tensor *>(&m->exit_gate_b));
    all.push_back(const_cast<tl_tensor *>(&m->inject_w));
    all.push_back(const_cast<tl_tensor *>(&m->inject_b));
    for (int i = 0; i < m->hp.n_pre; i++) add_block(all, &m->pre[i]);
    for (int i = 0; i < m->hp.n_core; i++) add_block(all, &m->core[i]);
    for (int i = 0; i < m->hp.n_post; i++) add_block(all, &m->post[i]);
    for (tl_tensor *t : all)
        if (t->data) present.push_back(t);
    return present;
}

// Streams host ranges to the device through the two pinned halves.
struct stager {
    unsigned char *pinned = nullptr;
    cudaStream_t stream = nullptr;
    cudaEvent_t done[2] = { nullptr, nullptr };
    int half = 0;

    tl_status open() {
        cudaError_t err = cudaHostAlloc((void **)&pinned, 2 * STAGE_BYTES, cudaHostAllocDefault);
        if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        for (int i = 0; i < 2 && err == cudaSuccess; i++)
            err = cudaEventCreateWithFlags(&done[i], cudaEventDisableTiming);
        if (err != cudaSuccess)
            return cuda_fail(TL_ERR_BACKEND, "cannot set up the weight upload (pinned staging of %zu MiB): %s",
                             2 * STAGE_BYTES >> 20, cudaGetErrorString(err));
        return TL_OK;
    }

    tl_status copy(unsigned char *dst, const unsigned char *src, size_t bytes, const char *name) {
        for (size_t off = 0; off < bytes; off += STAGE_BYTES) {
            size_t len = bytes - off < STAGE_BYTES ? bytes - off : STAGE_BYTES;
            unsigned char *buf = pinned + (size_t)half * STAGE_BYTES;
            cudaError_t err = cudaEventSynchronize(done[half]);   // this half's last copy is done
            if (err == cudaSuccess) {
                memcpy(buf, src + off, len);
                err = cudaMemcpyAsync(dst + off, buf, len, cudaMemcpyHostToDevice, stream);
            }
            if (err == cudaSuccess) err = cudaEventRecord(done[half], stream);
            if (err != cudaSuccess)
                return cuda_fail(TL_ERR_BACKEND, "uploading tensor %s: %s", name, cudaGetErrorString(err));
            half ^= 1;
        }
        return TL_OK;
    }

    tl_status finish() {
        cudaError_t err = cudaStreamSynchronize(stream);
        if (err != cudaSuccess)
            return cuda_fail(TL_ERR_BACKEND, "uploading the weights: %s", cudaGetErrorString(err));
        return TL_OK;
    }

    ~stager() {
        if (stream) cudaStreamSynchronize(stream);
        for (cudaEvent_t e : done)
            if (e) cudaEventDestroy(e);
        if (stream) cudaStreamDestroy(stream);
        if (pinned) cudaFreeHost(pinned);
    }
};

}  // namespace

tl_status cuda_upload_model(cuda_backend *be, const struct tl_model *m) {
    std::vector<tl_tensor *> tensors = model_tensors(m);
    // A tied head is a copy of the embedding's view: upload the data once.
    std::vector<tl_tensor *> unique;
    size_t arena = 0;
    for (tl_tensor *t : tensors) {
        bool seen = false;
        for (tl_tensor *u : unique) seen = seen || u->data == t->data;
        if (seen) continue;
        unique.push_back(t);
        planes p = tensor_planes(t);
        for (size_t b : p.bytes) arena += align_up(b);
    }
    be->weights = static_cast<dev_weight *>(calloc(unique.size() ? unique.size() : 1, sizeof(dev_weight)));
    if (!be->weights) return cuda_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate the weight table");
    be->n_weights = unique.size();

    cudaError_t err = cudaMalloc(&be->weight_arena, arena ? arena : PLANE_ALIGN);
    if (err != cudaSuccess) {
        be->weight_arena = nullptr;
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        cudaGetLastError();   // clear a non-sticky allocation error
        return cuda_fail(TL_ERR_OUT_OF_MEMORY,
                         "cannot allocate %.1f MiB of device memory for the weights (%.1f MiB free): %s",
                         arena / 1048576.0, free_b / 1048576.0, cudaGetErrorString(err));
    }
    be->device_bytes += arena ? arena : PLANE_ALIGN;

    stager st;
    tl_status status = st.open();
    unsigned char *cursor = static_cast<unsigned char *>(be->weight_arena);
    uint64_t file_bytes = 0;
    for (size_t i = 0; i < unique.size() && status == TL_OK; i++) {
        tl_tensor *t = unique[i];
        planes p = tensor_planes(t);
        unsigned char *dst[3];
        for (int k = 0; k < 3 && status == TL_OK; k++) {
            dst[k] = cursor;
            if (p.bytes[k])
                status = st.copy(cursor, static_cast<const unsigned char *>(p.src[k]), p.bytes[k], t->name);
            cursor += align_up(p.bytes[k]);
            file_bytes += p.bytes[k];
        }
        dev_weight &w = be->weights[i];
        w.dtype = t->dtype;
        w.rows = (int)t->rows;
        w.cols = (int)t->cols;
        w.group_shift = group_shift(t->group);
        w.vec = is_quantized(t->dtype) || t->cols % 32 == 0;
        w.qs = dst[0];
        w.scales = reinterpret_cast<const __half *>(dst[1]);
        w.mins = reinterpret_cast<const __half *>(dst[2]);
    }
    if (status == TL_OK) status = st.finish();
    if (status != TL_OK) return status;
    be->weight_bytes = file_bytes;
    // Point every view (the tied head included) at its device copy.
    for (tl_tensor *t : tensors)
        for (size_t i = 0; i < unique.size(); i++)
            if (unique[i]->data == t->data) t->backend_data = &be->weights[i];
    cuda_core_range(be, m);
    return TL_OK;
}

// The core blocks' tensors were uploaded one after the other, so the span from the
// lowest to the highest byte of their planes is the loop body (and nothing else).
void cuda_core_range(cuda_backend *be, const struct tl_model *m) {
    std::vector<tl_tensor *> core;
    for (int i = 0; i < m->hp.n_core; i++) add_block(core, &m->core[i]);
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (tl_tensor *t : core) {
        if (!t->data || !t->backend_data) continue;
        const dev_weight *w = static_cast<const dev_weight *>(t->backend_data);
        planes p = tensor_planes(t);
        const void *starts[3] = { w->qs, w->scales, w->mins };
        for (int k = 0; k < 3; k++) {
            if (!p.bytes[k]) continue;
            uintptr_t a = (uintptr_t)starts[k];
            lo = a < lo ? a : lo;
            hi = a + p.bytes[k] > hi ? a + p.bytes[k] : hi;
        }
    }
    be->core_base = hi > lo ? reinterpret_cast<const void *>(lo) : nullptr;
    be->core_bytes = hi > lo ? (size_t)(hi - lo) : 0;
}

void cuda_free_model(cuda_backend *be) {
    if (be->weight_arena) {
        cudaFree(be->weight_arena);
        be->weight_arena = nullptr;
    }
    free(be->weights);
    be->weights = nullptr;
    be->n_weights = 0;
}

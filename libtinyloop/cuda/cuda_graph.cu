// cuda_graph.cu — decode steps as CUDA graphs, and the L2 window over the loop body.
//
// A one-row forward pass is about fifteen launches per block and virtual layer; at
// batch 1, once the kernels are fast, the launch gaps set the speed. forward.c
// brackets such a step with step_begin/step_end (backend.h). While a step is recorded
// every launch is kept as a closure, and every op folds its arguments into a key, with
// positions relative to the step's position; kernels read the position and the token
// from `step.dev`, uploaded before the step runs. At step_end the graph captured
// earlier for the same key is replayed; a new key is captured (stream capture of the
// kept closures) and instantiated. Whatever fails there, the step runs eagerly and
// graphs stay off for the context, with the reason logged once (a warning).
//
// The loop body's weights are read `depth` times per token: an access-policy window
// over them (persisting hits, streaming misses) keeps them in L2 when they fit; when
// they are larger than the persisting L2, hitRatio shrinks to the part that fits, so
// that part persists and the rest streams from HBM every iteration.
#include "cuda_common.cuh"

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr uint64_t KEY_SEED = 0xcbf29ce484222325ull;
constexpr int MAX_UNUSED_CAPTURES = 3;   // steps that never repeat: stop capturing

uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h * 0x100000001B3ull;
}

void graphs_off(tl_exec *ex, const char *why, cudaError_t err) {
    step_state &s = ex->step;
    s.off = 1;
    snprintf(s.reason, sizeof s.reason, "%s%s%s", why, err != cudaSuccess ? ": " : "",
             err != cudaSuccess ? cudaGetErrorString(err) : "");
    cuda_log(TL_LOG_WARN, "cuda: decode steps run without CUDA graphs (%s)", s.reason);
}

void run_work(tl_exec *ex) {
    for (auto &fn : ex->step.work) fn(ex->stream);
    ex->step.work.clear();
}

// The window over the core blocks' weights for kernels of this context.
cudaAccessPolicyWindow l2_window(const tl_exec *ex) {
    cudaAccessPolicyWindow w = {};
    if (!ex->l2_persist_bytes || !ex->be->core_bytes) return w;
    w.base_ptr = const_cast<void *>(ex->be->core_base);
    w.num_bytes = ex->be->core_bytes < ex->l2_window_max ? ex->be->core_bytes : ex->l2_window_max;
    float ratio = (float)ex->l2_persist_bytes / (float)w.num_bytes;
    w.hitRatio = ratio < 1.0f ? ratio : 1.0f;
    w.hitProp = cudaAccessPropertyPersisting;
    w.missProp = cudaAccessPropertyStreaming;
    return w;
}

// Kernel nodes do not reliably inherit the stream's window: set it on each.
cudaError_t apply_l2_window(tl_exec *ex, cudaGraph_t graph) {
    cudaAccessPolicyWindow w = l2_window(ex);
    if (!w.num_bytes) return cudaSuccess;
    size_t count = 0;
    cudaError_t err = cudaGraphGetNodes(graph, nullptr, &count);
    if (err != cudaSuccess || count == 0) return err;
    std::vector<cudaGraphNode_t> nodes(count);
    err = cudaGraphGetNodes(graph, nodes.data(), &count);
    for (size_t i = 0; i < count && err == cudaSuccess; i++) {
        cudaGraphNodeType type;
        err = cudaGraphNodeGetType(nodes[i], &type);
        if (err != cudaSuccess || type != cudaGraphNodeTypeKernel) continue;
        cudaKernelNodeAttrValue value = {};
        value.accessPolicyWindow = w;
        err = cudaGraphKernelNodeSetAttribute(nodes[i], cudaKernelNodeAttributeAccessPolicyWindow, &value);
    }
    return err;
}

// Capture the kept closures into a graph and instantiate it. On failure nothing ran.
cudaError_t capture(tl_exec *ex, cudaGraphExec_t *out) {
    *out = nullptr;
    tl_status saved = ex->error;
    cudaGraph_t graph = nullptr;
    cudaError_t err = cudaStreamBeginCapture(ex->stream, cudaStreamCaptureModeThreadLocal);
    if (err != cudaSuccess) return err;
    for (auto &fn : ex->step.work) fn(ex->stream);
    err = cudaStreamEndCapture(ex->stream, &graph);
    if (err == cudaSuccess && ex->error != saved) err = cudaErrorStreamCaptureInvalidated;
    // the window is an optimisation: a graph without it is still the step
    if (err == cudaSuccess && apply_l2_window(ex, graph) != cudaSuccess) cudaGetLastError();
    if (err == cudaSuccess) err = cudaGraphInstantiate(out, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (err != cudaSuccess) {
        *out = nullptr;
        cudaGetLastError();   // the failed capture's error is not the step's
        if (saved == TL_OK) {
            ex->error = TL_OK;
            ex->message[0] = '\0';
        }
    }
    return err;
}

step_graph *find_graph(step_state &s, uint64_t key) {
    for (step_graph &g : s.graphs)
        if (g.exec && g.key == key) return &g;
    return nullptr;
}

}  // namespace

tl_status step_init(tl_exec *ex) {
    step_state &s = ex->step;
    cudaError_t err = cudaMalloc(&s.dev, sizeof(step_params));
    if (err == cudaSuccess) err = cudaHostAlloc((void **)&s.upload_slots, 2 * sizeof(step_params), cudaHostAllocDefault);
    if (err != cudaSuccess) {
        cudaGetLastError();
        cudaFree(s.dev);
        s.dev = nullptr;
        s.upload_slots = nullptr;
        return cuda_fail(TL_ERR_BACKEND, "cannot allocate the decode-step parameters: %s",
                         cudaGetErrorString(err));
    }
    s.dev_pos = -1;
    if (!cuda_switch(TL_FLAG_CUDA_GRAPHS)) {
        s.off = 1;
        snprintf(s.reason, sizeof s.reason, "TINYLOOP_CUDA_GRAPHS=0");
    }
    // L2 persistence: best effort, a device or a MIG slice without it just streams.
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, ex->be->device) == cudaSuccess && prop.persistingL2CacheMaxSize > 0 &&
        ex->be->core_bytes > 0) {
        size_t want = ex->be->core_bytes < (size_t)prop.persistingL2CacheMaxSize
                          ? ex->be->core_bytes : (size_t)prop.persistingL2CacheMaxSize;
        size_t have = 0;
        if (cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, want) == cudaSuccess &&
            cudaDeviceGetLimit(&have, cudaLimitPersistingL2CacheSize) == cudaSuccess && have > 0) {
            ex->l2_persist_bytes = have;
            ex->l2_window_max = (size_t)prop.accessPolicyMaxWindowSize;
            cudaStreamAttrValue attr = {};
            attr.accessPolicyWindow = l2_window(ex);
            if (cudaStreamSetAttribute(ex->stream, cudaStreamAttributeAccessPolicyWindow, &attr) != cudaSuccess)
                ex->l2_persist_bytes = 0;
        }
        cudaGetLastError();
    }
    return TL_OK;
}

void step_free(tl_exec *ex) {
    step_state &s = ex->step;
    for (step_graph &g : s.graphs)
        if (g.exec) cudaGraphExecDestroy(g.exec);
    memset(s.graphs, 0, sizeof s.graphs);
    cudaFree(s.dev);
    cudaFreeHost(s.upload_slots);
    s.dev = nullptr;
    s.upload_slots = nullptr;
    s.work.clear();
}

void enqueue(tl_exec *ex, std::function<void(cudaStream_t)> fn) {
    if (ex->step.recording) ex->step.work.push_back(std::move(fn));
    else fn(ex->stream);
}

pos_arg step_pos(tl_exec *ex, int pos0) {
    if (!ex->step.recording) return pos_arg{ pos0, nullptr };
    return pos_arg{ pos0 - ex->step.pos, &ex->step.dev->pos };
}

void step_note(tl_exec *ex, std::initializer_list<uint64_t> values) {
    if (!ex->step.recording) return;
    for (uint64_t v : values) ex->step.key = mix(ex->step.key, v);
}

void step_begin(tl_exec *ex, int pos) {
    step_state &s = ex->step;
    s.work.clear();
    s.device_token = 0;
    s.recording = !s.off && ex->error == TL_OK;
    s.pos = pos;
    s.key = KEY_SEED;
    s.host.pos = pos;
    s.host.token = 0;
}

// The step's parameters to the device, in stream order (a chained step keeps the token
// its predecessor's argmax left there, and the position when the host knows that the
// argmax advanced it to this step's: after an eager chained argmax, a prompt's). In a
// recorded step the chained argmax is recorded before this upload, whose position then
// replaces the one it noted, so recorded chained steps still upload their position.
// Copied from pinned memory, so that the copy never waits for the stream: the host may
// record the next step while this one runs.
static int upload_step_params(tl_exec *ex) {
    step_state &s = ex->step;
    if (s.device_token && s.dev_pos == s.host.pos) return 0;
    step_params *slot = &s.upload_slots[s.next_slot];
    s.next_slot ^= 1;
    *slot = s.host;
    const size_t bytes = s.device_token ? sizeof slot->pos : sizeof *slot;
    static_assert(offsetof(step_params, pos) == 0, "the position leads the parameters");
    const int failed = exec_check(ex, cudaMemcpyAsync(s.dev, slot, bytes, cudaMemcpyHostToDevice, ex->stream),
                                  "decode step (parameters)");
    s.dev_pos = failed ? -1 : s.host.pos;
    return failed;
}

// After the step's work is in the stream: the event of the chained argmax it holds. If
// the step failed (its work not, or not all, queued), the entry is taken back instead:
// the host's queue holds only results that will arrive, and the forward pass reports
// the error, so the caller does not count the entry either.
void settle_chain_entry(tl_exec *ex) {
    step_state &s = ex->step;
    if (!s.chain_event) return;
    if (ex->error == TL_OK)
        exec_check(ex, cudaEventRecord(*s.chain_event, ex->stream), "chained argmax (event)");
    if (ex->error != TL_OK) {
        ex->chain_tail--;
        s.dev_pos = -1;
    }
    s.chain_event = nullptr;
}

// Runs the kept closures now (after the step parameters they read) and records no more.
void step_flush(tl_exec *ex) {
    step_state &s = ex->step;
    if (!s.recording) return;
    s.recording = 0;
    if (!upload_step_params(ex)) run_work(ex);
    s.work.clear();
    settle_chain_entry(ex);
}

static void replay_or_capture(tl_exec *ex) {
    step_state &s = ex->step;
    if (upload_step_params(ex)) {
        s.work.clear();
        return;
    }
    step_graph *g = find_graph(s, s.key);
    if (!g) {
        cudaGraphExec_t exec = nullptr;
        cudaError_t err = capture(ex, &exec);
        if (err != cudaSuccess) {
            graphs_off(ex, "capture failed", err);
            run_work(ex);
            return;
        }
        g = &s.graphs[s.next_graph];
        s.next_graph = (s.next_graph + 1) % STEP_GRAPHS;
        if (g->exec) cudaGraphExecDestroy(g->exec);
        *g = step_graph{ s.key, exec, 0 };
        if (++s.unused_captures > MAX_UNUSED_CAPTURES) {
            // e.g. warm-start state rows addressed by position: every step is new
            graphs_off(ex, "decode steps differ from position to position", cudaSuccess);
        }
    } else {
        g->replays++;
        s.unused_captures = 0;
    }
    s.work.clear();
    exec_check(ex, cudaGraphLaunch(g->exec, ex->stream), "decode step (graph launch)");
}

void step_end(tl_exec *ex) {
    step_state &s = ex->step;
    if (!s.recording) return;
    s.recording = 0;
    replay_or_capture(ex);
    settle_chain_entry(ex);
}

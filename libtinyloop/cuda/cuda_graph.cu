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
#include <algorithm>

namespace {

constexpr uint64_t KEY_SEED = 0xcbf29ce484222325ull;
constexpr int MAX_UNUSED_CAPTURES = 3;   // steps that never repeat: stop capturing

uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h * 0x100000001B3ull;
}

void graphs_off(tl_exec *ex, graph_cache &c, const char *why, cudaError_t err) {
    c.off = 1;
    snprintf(c.reason, sizeof c.reason, "%s%s%s", why, err != cudaSuccess ? ": " : "",
             err != cudaSuccess ? cudaGetErrorString(err) : "");
    cuda_log(TL_LOG_WARN, "cuda: %s run without CUDA graphs (%s)",
             &c == &ex->step.batched ? "batched decode steps" : "decode steps", c.reason);
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

step_graph *find_graph(graph_cache &c, uint64_t key) {
    for (int i = 0; i < c.limit; i++)
        if (c.graphs[i].exec && c.graphs[i].key == key) return &c.graphs[i];
    return nullptr;
}

void free_graphs(graph_cache &c) {
    for (step_graph &g : c.graphs)
        if (g.exec) cudaGraphExecDestroy(g.exec);
    memset(c.graphs, 0, sizeof c.graphs);
}

// The rows a batched step runs: its size rounded up to the next bucket (a power of two),
// so that batches of nearby sizes replay one graph.
int batch_bucket(int n, int max_rows) {
    int b = 1;
    while (b < n) b <<= 1;
    return b < max_rows ? b : (n > max_rows ? n : max_rows);
}

// (also what a failed rows_alloc took: every pointer not taken is null)
void rows_free(tl_exec *ex) {
    row_table &t = ex->step.rows;
    cudaFreeHost(t.host[0]);
    cudaFree(t.dev);
    cudaFreeHost(t.h_argmax);
    cudaFree(t.d_argmax);
    cudaFree(t.arrivals);
    t = row_table{};
}

// The row table and argmax_rows' results for steps of up to ex->max_rows rows, taken at
// the first batched step (only contexts that lead batches hold them): the tokens, and per
// virtual layer room for two tables of its rows' positions and two of their slots (equal
// entries are shared, so a step uses about half: the margin keeps a step whose layers
// upload more than one table, e.g. rows leaving the loop, from running out), each entry
// 16-byte aligned.
int rows_alloc(tl_exec *ex) {
    row_table &t = ex->step.rows;
    if (t.rows) return 0;
    const tl_hparams &hp = ex->be->model->hp;
    const size_t rows = ex->max_rows > 0 ? (size_t)ex->max_rows : 1;
    const size_t layers = (size_t)hp.n_pre + (size_t)hp.n_core * (size_t)(hp.max_depth > 0 ? hp.max_depth : 1) +
                          (size_t)hp.n_post;
    const size_t entries = 4 * layers + 1;
    t.cap = rows * sizeof(int32_t) + 2 * layers * rows * (sizeof(int32_t) + sizeof(row_slot)) + entries * 16;
    const size_t counters = rows * (size_t)(hp.n_head > 0 ? hp.n_head : 1) * sizeof(int);
    cudaError_t err = cudaHostAlloc((void **)&t.host[0], 2 * t.cap, cudaHostAllocDefault);
    if (err == cudaSuccess) t.host[1] = t.host[0] + t.cap;
    if (err == cudaSuccess) err = cudaMalloc((void **)&t.dev, t.cap);
    if (err == cudaSuccess) err = cudaHostAlloc((void **)&t.h_argmax, rows * sizeof(int32_t), cudaHostAllocDefault);
    if (err == cudaSuccess) err = cudaMalloc((void **)&t.d_argmax, rows * sizeof(int32_t));
    if (err == cudaSuccess) err = cudaMalloc((void **)&t.arrivals, counters);
    if (err == cudaSuccess) err = cudaMemsetAsync(t.arrivals, 0, counters, ex->stream);
    if (err != cudaSuccess) {
        rows_free(ex);
        return exec_check(ex, err, "batched step (row table)");
    }
    t.rows = (int)rows;
    t.bytes = t.cap + rows * sizeof(int32_t) + counters;
    ex->be->device_bytes += t.bytes;
    ex->bytes += t.bytes;
    return 0;
}

// The step's row table to the device, before the kernels that read it.
int upload_rows(tl_exec *ex) {
    row_table &t = ex->step.rows;
    if (!t.used) return 0;
    return exec_check(ex, cudaMemcpyAsync(t.dev, t.host[t.slot], t.used, cudaMemcpyHostToDevice, ex->stream),
                      "batched step (rows)");
}

// argmax_rows' results of the step to their callers, once the stream has run them.
void deliver_results(tl_exec *ex) {
    row_table &t = ex->step.rows;
    if (t.results.empty()) return;
    if (ex->error == TL_OK) exec_check(ex, cudaStreamSynchronize(ex->stream), "argmax (rows, or a kernel before it)");
    for (const row_table::pending &r : t.results)
        if (ex->error == TL_OK) memcpy(r.out, t.h_argmax + r.first, (size_t)r.n * sizeof(int32_t));
        else memset(r.out, 0, (size_t)r.n * sizeof(int32_t));
    t.results.clear();
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
    s.one.limit = STEP_GRAPHS;
    s.batched.limit = BATCH_GRAPHS;
    if (!cuda_switch(TL_FLAG_CUDA_GRAPHS))
        for (graph_cache *c : { &s.one, &s.batched }) {
            c->off = 1;
            snprintf(c->reason, sizeof c->reason, "TINYLOOP_CUDA_GRAPHS=0");
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
    free_graphs(s.one);
    free_graphs(s.batched);
    rows_free(ex);
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

// A batched step's rows have positions of their own (the *_rows ops): an op that takes
// one position there keeps it as it is (and in the key, so such a step never replays).
pos_arg step_pos(tl_exec *ex, int pos0) {
    if (!ex->step.recording || ex->step.batch) return pos_arg{ pos0, nullptr };
    return pos_arg{ pos0 - ex->step.pos, &ex->step.dev->pos };
}

void step_note(tl_exec *ex, std::initializer_list<uint64_t> values) {
    if (!ex->step.recording) return;
    for (uint64_t v : values) ex->step.key = mix(ex->step.key, v);
}

void step_begin(tl_exec *ex, int pos) {
    step_state &s = ex->step;
    s.work.clear();
    s.batch = 0;
    s.device_token = 0;
    s.recording = !s.one.off && ex->error == TL_OK;
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

int batch_begin(tl_exec *ex, int n, int max_rows, int record) {
    step_state &s = ex->step;
    s.work.clear();
    s.device_token = 0;
    s.pos = 0;
    s.key = KEY_SEED;
    s.batch = 1;
    row_table &t = s.rows;
    s.recording = 0;
    if (rows_alloc(ex)) return n;
    t.slot ^= 1;
    t.used = 0;
    t.entries.clear();
    t.results.clear();
    s.recording = record && !s.batched.off && ex->error == TL_OK;
    const int rows = s.recording ? batch_bucket(n, std::min(max_rows, t.rows)) : n;
    step_note(ex, { 0xBA7C4, (uint64_t)rows });
    return rows;
}

const void *row_upload(tl_exec *ex, const void *data, size_t bytes) {
    row_table &t = ex->step.rows;
    if (!ex->step.batch || !t.rows) {
        exec_check(ex, cudaErrorInvalidValue, "batched row op outside a batched step");
        return nullptr;
    }
    char *host = t.host[t.slot];
    for (const auto &e : t.entries)
        if (e.second == bytes && memcmp(host + e.first, data, bytes) == 0) return t.dev + e.first;
    const size_t at = (t.used + 15) & ~(size_t)15;
    if (at + bytes > t.cap) {
        if (ex->error == TL_OK) {
            ex->error = TL_ERR_INTERNAL;
            snprintf(ex->message, sizeof ex->message,
                     "CUDA backend: batched step: %zu bytes of row data at %zu pass its table's %zu "
                     "(%d rows, %zu entries)", bytes, at, t.cap, t.rows, t.entries.size());
        }
        return nullptr;
    }
    memcpy(host + at, data, bytes);
    t.used = at + bytes;
    t.entries.emplace_back(at, bytes);
    // a step run as it comes: this entry now, in stream order before its kernel
    if (!ex->step.recording)
        exec_check(ex, cudaMemcpyAsync(t.dev + at, host + at, bytes, cudaMemcpyHostToDevice, ex->stream),
                   "batched step (rows)");
    return t.dev + at;
}

// Runs the kept closures now (after the step parameters they read) and records no more.
void step_flush(tl_exec *ex) {
    step_state &s = ex->step;
    if (!s.recording) return;
    s.recording = 0;
    if (s.batch) {   // the rows' table, then the kept work; the rest of the step runs as it comes
        if (!upload_rows(ex)) run_work(ex);
        s.work.clear();
        return;
    }
    if (!upload_step_params(ex)) run_work(ex);
    s.work.clear();
    settle_chain_entry(ex);
}

// After the step's parameters are uploaded: the graph of the step's key, captured first
// when new (into c, replacing its oldest).
static void replay_or_capture(tl_exec *ex, graph_cache &c) {
    step_state &s = ex->step;
    step_graph *g = find_graph(c, s.key);
    if (!g) {
        cudaGraphExec_t exec = nullptr;
        cudaError_t err = capture(ex, &exec);
        if (err != cudaSuccess) {
            graphs_off(ex, c, "capture failed", err);
            run_work(ex);
            return;
        }
        g = &c.graphs[c.next];
        c.next = (c.next + 1) % c.limit;
        if (g->exec) cudaGraphExecDestroy(g->exec);
        *g = step_graph{ s.key, exec, 0 };
        if (++c.unused > MAX_UNUSED_CAPTURES) {
            // e.g. warm-start state rows addressed by position: every step is new
            graphs_off(ex, c, "decode steps differ from position to position", cudaSuccess);
        }
    } else {
        g->replays++;
        c.unused = 0;
    }
    s.work.clear();
    exec_check(ex, cudaGraphLaunch(g->exec, ex->stream), "decode step (graph launch)");
}

void step_end(tl_exec *ex) {
    step_state &s = ex->step;
    if (s.batch) {
        if (s.recording) {
            s.recording = 0;
            if (!upload_rows(ex)) replay_or_capture(ex, s.batched);
            s.work.clear();
        }
        deliver_results(ex);
        s.batch = 0;
        return;
    }
    if (!s.recording) return;
    s.recording = 0;
    if (upload_step_params(ex)) s.work.clear();
    else replay_or_capture(ex, s.one);
    settle_chain_entry(ex);
}

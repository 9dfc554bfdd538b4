/* backend.h — the ops interface between orchestration (forward.c, context.c,
 * kv_cache.c) and a compute backend. Orchestration never looks inside a buffer or
 * branches on the backend: activations live in opaque backend buffers, and every
 * piece of math is one call through tl_backend_ops. The CPU backend (backend_cpu.c)
 * implements it on host memory; a CUDA backend implements the same table on device
 * memory.
 *
 * Ops are void: a backend that can fail asynchronously (a device) records the first
 * error and reports it from ops->status(), which orchestration checks once per chunk. */
#ifndef TL_BACKEND_H
#define TL_BACKEND_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/tensor.h"
#include "model/model.h"
#include "tinyloop/tinyloop.h"
#include "base/debug_flags.h"

/* The core and libtinyloop_cuda.so are built apart but share the structs of this header
 * and of those a backend reads (model.h, tensor.h, sample_math.h). Bump this with every
 * change to any of them: each side checks the other's version and struct sizes at load
 * and refuses a mismatch (tl_backend_check_ops, tl_backend_interface_mismatch). */
#define TL_BACKEND_INTERFACE_VERSION 4

typedef struct tl_buf tl_buf;     /* backend-owned float storage (host or device) */
typedef struct tl_exec tl_exec;   /* per-context execution state: threads, scratch */

/* A position inside a buffer, in floats from its start. */
typedef struct tl_act {
    tl_buf *buf;
    size_t off;
} tl_act;

static inline tl_act tl_act_at(tl_buf *buf, size_t off) {
    tl_act a = { buf, off };
    return a;
}
static inline tl_act tl_act_add(tl_act a, size_t off) {
    a.off += off;
    return a;
}

/* What one attention call needs to know about the model's geometry. */
typedef struct tl_attn_geom {
    int n_head, n_kv_head, head_dim;
    float scale;
    int window;        /* 0 = full causal */
} tl_attn_geom;

typedef struct tl_rope_params {
    int rope_dims, style;
    float theta;
    /* [rope_dims/2] or NULL: pair p's frequency is theta^(-2p/rope_dims) / factors[p]
     * (host memory, fixed for the model's life) */
    const float *factors;
} tl_rope_params;

typedef struct tl_norm_params {
    tl_norm_type type;
    int unit_offset;
    float eps;
} tl_norm_params;

/* The input of a fused matmul (matmul_in): the rows x themselves, their norm, or the
 * gated activation act(gate) * up of two row sets. */
typedef enum { TL_MATMUL_IN_ROWS = 0, TL_MATMUL_IN_NORM = 1, TL_MATMUL_IN_GATED = 2 } tl_matmul_in_kind;

typedef struct tl_matmul_in {
    tl_matmul_in_kind kind;
    tl_act x;                          /* ROWS / NORM: the rows; GATED: the gate rows */
    size_t ldx;
    const tl_norm_weights *norm;       /* NORM */
    const tl_norm_params *norm_params; /* NORM */
    tl_act up;                         /* GATED */
    size_t ld_up;
    tl_activation act;                 /* GATED */
} tl_matmul_in;

/* A token tree after a committed prefix (tree speculation, tree_speculative.c): node i
 * (0 = the root) keeps its K/V at cache row n_prefix + i, takes its RoPE position pos[i]
 * (n_prefix + its depth in the tree), and sees the prefix (within the sliding window of
 * its position) and the nodes whose bits are set in visible[i]: its ancestors and itself. */
#define TL_TREE_MAX_NODES 64
typedef struct tl_tree {
    int n_prefix, n_nodes;
    int32_t pos[TL_TREE_MAX_NODES];
    uint64_t visible[TL_TREE_MAX_NODES];
} tl_tree;

typedef struct tl_backend tl_backend;
struct tl_sample_step;   /* sample_math.h */

/* Fill it with designated initializers (.matmul = ...): an op added in the middle must
 * not shift the others. */
typedef struct tl_backend_ops {
    /* The handshake: TL_BACKEND_INTERFACE_VERSION and sizeof(tl_backend_ops) as the
     * backend was built. First, so that a table of any version can be checked. */
    uint32_t version;
    uint32_t struct_size;

    /* Called once after the model is built: repack weights into the backend's layout
     * (tl_tensor.backend_data) or upload them. */
    tl_status (*prepare_model)(tl_backend *be, const struct tl_model *model);
    void (*destroy)(tl_backend *be);
    /* Bytes of weights resident for this backend, repacked copies, device memory. */
    void (*memory)(const tl_backend *be, uint64_t *weights, uint64_t *repacked,
                   uint64_t *device);

    /* Execution state of one context: n_threads workers, scratch for up to max_rows
     * rows per call and attention over max_seq positions. */
    tl_status (*exec_create)(tl_backend *be, int n_threads, int max_rows, int max_seq,
                             tl_exec **out);
    void (*exec_destroy)(tl_exec *ex);
    size_t (*exec_bytes)(const tl_exec *ex);
    /* First error recorded since the last call (and clears it); TL_OK on CPU. */
    tl_status (*status)(tl_exec *ex);

    /* Buffers; contents are uninitialised. */
    tl_status (*buf_alloc)(tl_backend *be, size_t n_floats, tl_buf **out);
    void (*buf_free)(tl_buf *buf);

    /* Transfers and copies (counts in floats). */
    void (*upload)(tl_exec *ex, tl_act dst, const float *src, size_t count);
    void (*download)(tl_exec *ex, float *dst, tl_act src, size_t count);
    /* n rows of `width` floats with their own row strides. */
    void (*copy_rows)(tl_exec *ex, tl_act dst, size_t ld_dst, tl_act src, size_t ld_src,
                      int n, int width);
    void (*fill)(tl_exec *ex, tl_act dst, size_t count, float value);
    /* dst[i, j] = sigma * n(seed, pos0 + i, j), the seeded normal of docs/model.md, or its
     * truncated variant n_T with T = truncation when truncation > 0. */
    void (*fill_noise)(tl_exec *ex, tl_act dst, int n, int d, uint64_t seed, int pos0,
                       float sigma, float truncation);

    /* out[i] = E[tokens[i]] * scale; tokens are host ints already validated. */
    void (*embed)(tl_exec *ex, const tl_tensor *table, const int32_t *tokens, int n,
                  float scale, tl_act out);
    /* y[i, r] = sum_c x[i, c] W[r, c], rows of x/y with strides ldx/ldy. */
    void (*matmul)(tl_exec *ex, const tl_tensor *w, tl_act x, size_t ldx, int n, tl_act y,
                   size_t ldy);
    /* Several matrices applied to the same input (e.g. q, k, v): backends may share
     * the activation quantization between them. ys[j] has row stride ldys[j]. */
    void (*matmul_multi)(tl_exec *ex, const tl_tensor *const *ws, int n_w, tl_act x,
                         size_t ldx, int n, const tl_act *ys, const size_t *ldys);
    void (*add_bias)(tl_exec *ex, tl_act y, int n, int d, const tl_tensor *bias);
    void (*add)(tl_exec *ex, tl_act y, tl_act x, size_t count);          /* y += x */
    void (*norm)(tl_exec *ex, const tl_norm_weights *w, const tl_norm_params *p, tl_act x,
                 int n, int d, tl_act out);                              /* out may be x */
    void (*rope)(tl_exec *ex, tl_act x, int n, int n_heads, int head_dim, int pos0,
                 const tl_rope_params *p);
    /* gate[i] = act(gate[i]) * up[i] */
    void (*gated_act)(tl_exec *ex, tl_act gate, tl_act up, size_t count, tl_activation act);
    /* Causal attention of n query rows at positions pos0.. against cached K/V rows
     * 0..pos0+n-1 (row width n_kv_head * head_dim). */
    void (*attention)(tl_exec *ex, tl_act q, int n, int pos0, tl_act k_cache,
                      tl_act v_cache, const tl_attn_geom *g, tl_act out);
    /* out[i] = log_softmax(logits row i)[targets[i]] (host targets and out). */
    void (*logprobs)(tl_exec *ex, tl_act logits, int n, int vocab, const int32_t *targets,
                     float *out);

    /* Index of the largest of `count` floats at x, the first one on ties: the greedy
     * token of a row of logits, so that only the index comes back to the host. */
    int32_t (*argmax)(tl_exec *ex, tl_act x, int count);
    /* Store n new key and value rows (contiguous, `width` floats each) as rows
     * pos0.. of a cache slot whose row 0 is k_cache / v_cache. */
    void (*kv_store)(tl_exec *ex, tl_act k_cache, tl_act v_cache, tl_act k, tl_act v, int n,
                     int pos0, int width);
    /* Optional (NULL: no adaptive depth, TL_ERR_UNSUPPORTED): copy the key and value rows
     * at `pos` of one cache slot (k_src / v_src, row 0 as kv_store takes it) into another
     * slot: an exited token's last iteration serving the iterations it skipped. */
    void (*kv_copy)(tl_exec *ex, tl_act k_dst, tl_act v_dst, tl_act k_src, tl_act v_src, int pos, int width);

    /* Optional fused forms (NULL = not offered). forward.c composes them from the ops
     * above when a backend does not offer them or returns 0 for a call (e.g. a shape
     * it has no fused kernel for); results agree up to fp32 rounding order.
     * matmul_in: ys[j] = W_j . in (accumulate: ys[j] += W_j . in) for n rows of the
     * input described by `in`, which no y may overlap. Returns 1 when done. */
    int (*matmul_in)(tl_exec *ex, const tl_tensor *const *ws, int n_w, const tl_matmul_in *in, int n,
                     const tl_act *ys, const size_t *ldys, int accumulate);
    /* rope_store: RoPE on n rows of q (n_head heads) and k (n_kv_head heads) at pos0,
     * then kv_store of the rotated k and of v (contiguous rows); q is rotated in
     * place, k may be left unrotated. Returns 1 when done. */
    int (*rope_store)(tl_exec *ex, tl_act q, tl_act k, tl_act v, int n, int pos0,
                      const tl_rope_params *p, const tl_attn_geom *g, tl_act k_cache,
                      tl_act v_cache);

    /* Optional (NULL = not offered). forward.c brackets the layers of a one-row chunk
     * with step_begin(pos) / step_end(). Between them the ops and their arguments are
     * the same at every position except the pos0 arguments (pos plus a constant) and
     * the token given to embed, so a backend may record a step once and replay it
     * (CUDA graphs); the ops in between may run only when step_end() is called. */
    void (*step_begin)(tl_exec *ex, int pos);
    void (*step_end)(tl_exec *ex);

    /* Optional (NULL = not offered: the caller downloads the logits and samples on the
     * host). The token of a sampling step prepared on the host (sampling.h) from the
     * `vocab` logits at `logits`, which the penalty may modify: the same token as
     * tl_sample_row on the same logits, so that only the index comes back. */
    int32_t (*sample)(tl_exec *ex, tl_act logits, int vocab, const struct tl_sample_step *step);

    /* Optional fused forms (NULL = not offered; composed from the ops above as for the
     * fused forms above). matmul_gated: y = act(W_gate . in) * (W_up . in) for n rows of the
     * input `in` (an MLP's gated activation, so the down projection reads one row, not
     * two). Returns 1 when done. */
    int (*matmul_gated)(tl_exec *ex, const tl_tensor *w_gate, const tl_tensor *w_up, const tl_matmul_in *in,
                        int n, tl_activation act, tl_act y, size_t ldy);
    /* matmul_rope_store: the q/k/v projections of n rows of `in` (ws = wq, wk, wv, no
     * bias) followed by rope_store, in one op: q (row stride n_head * head_dim) is
     * written rotated, k rotated and v to the cache rows pos0.. (the kv_new buffers are
     * not written). Returns 1 when done. */
    int (*matmul_rope_store)(tl_exec *ex, const tl_tensor *const *ws, const tl_matmul_in *in, int n, tl_act q,
                             int pos0, const tl_rope_params *p, const tl_attn_geom *g, tl_act k_cache,
                             tl_act v_cache);

    /* Optional (NULL = not offered): greedy steps chained on the device, so that the
     * host may enqueue the step that feeds token t before t reaches it (generate.c
     * runs one step ahead). chain_available: whether the three below may be used now.
     * argmax_chained: argmax (of the row at position pos) whose index stays on the
     * device, as the token of the next step that asks for it, and is queued to the host
     * without waiting (at most two are queued, at consecutive positions); it may be
     * the last op of a recorded step (forward.c records head and argmax with the step
     * when nothing else comes back); chained_token: the oldest queued index once it has
     * arrived (-1 on an error, reported by status()); step_token_on_device: the next
     * step's token is the last chained index, not the one given to embed (one-row steps
     * only). */
    int (*chain_available)(tl_exec *ex);
    void (*argmax_chained)(tl_exec *ex, tl_act x, int count, int pos);
    int32_t (*chained_token)(tl_exec *ex);
    void (*step_token_on_device)(tl_exec *ex);

    /* Optional (NULL = no tree speculation: TL_ERR_UNSUPPORTED). rope_tree: RoPE on n rows
     * of x at positions tree->pos[first + i]. tree_attention: n query rows, nodes
     * first..first+n-1 of `tree` whose K/V are stored already, each against the prefix
     * rows and the nodes it sees (tl_tree), keys in cache-row order as `attention`. */
    void (*rope_tree)(tl_exec *ex, tl_act x, int n, int n_heads, int head_dim, const tl_tree *tree,
                      int first, const tl_rope_params *p);
    void (*tree_attention)(tl_exec *ex, tl_act q, int n, const tl_tree *tree, int first, tl_act k_cache,
                           tl_act v_cache, const tl_attn_geom *g, tl_act out);

    /* Optional (NULL = no paged KV: kv_page_size is refused at load). A page table of
     * n_entries pages, each a buffer of [2][n_slots][page_size][width] floats (every slot's
     * keys, then every slot's values, of page_size consecutive positions): k_view / v_view
     * stand for the keys and values through the table, and are given to kv_store,
     * attention and tree_attention as k_cache / v_cache at the offset slot * page_size *
     * width (the slot's row 0), so that orchestration addresses a slot as it does a
     * contiguous cache. Fused ops (rope_store, matmul_rope_store) may decline views.
     * page_table_set points entry `index` at a page (NULL: none), ordered with the ops of
     * ex; the table is the backend's (device memory on a device), so a recorded step
     * replayed later reads the entries current then. page_table_free frees both views.
     * f16: the pages are buf_alloc_f16 buffers (their elements are fp16). */
    tl_status (*page_table_create)(tl_backend *be, int n_entries, int page_size, int n_slots, int width,
                                   int f16, tl_buf **k_view, tl_buf **v_view);
    void (*page_table_set)(tl_exec *ex, tl_buf *k_view, int index, tl_buf *page);
    void (*page_table_free)(tl_buf *k_view);

    /* Optional (NULL = no fp16 KV: kv_dtype f16 is refused at load). A buffer of n fp16
     * elements for a KV cache (kv_cache.h, tl_kv_buf_alloc): offsets and counts into it
     * are in its elements, for the ops that take caches (kv_store, attention, the fused
     * and batched stores, tree_attention) and copy_rows between two such buffers, which
     * read and write fp16 there and compute in fp32. */
    tl_status (*buf_alloc_f16)(tl_backend *be, size_t n, tl_buf **out);

    /* Optional (NULL = not offered: forward.c runs a batched step's RoPE, K/V store and
     * attention row by row through rope_store / kv_store and attention, as it does for a
     * backend that does not offer batch_step_begin). The rows of a batched decode step
     * (TL_ROWS_BATCH): row r at position pos[r] of its own sequence, whose cache slot of
     * the layer is k_caches[r] / v_caches[r] (each row 0 of a slot, as kv_store takes
     * them: contiguous or a page table's views); rows with pos[r] < 0 are padding, for
     * which nothing is stored and whose attention output is 0. The host arrays are read
     * when the op is called.
     * rope_store_rows: RoPE of row r of q (n_head heads, in place) and of k (n_kv_head)
     * at pos[r], then k and v (contiguous rows of n_kv_head * head_dim) into cache row
     * pos[r] of row r's slot. attention_rows: decode attention of n query rows, row r at
     * pos[r] against rows 0..pos[r] of its slot (as attention of one row at pos[r]). */
    void (*rope_store_rows)(tl_exec *ex, tl_act q, tl_act k, tl_act v, int n, const int32_t *pos,
                            const tl_rope_params *p, const tl_attn_geom *g, const tl_act *k_caches,
                            const tl_act *v_caches);
    void (*attention_rows)(tl_exec *ex, tl_act q, int n, const int32_t *pos, const tl_act *k_caches,
                           const tl_act *v_caches, const tl_attn_geom *g, tl_act out);
    /* Optional (NULL = not offered). A batched decode step of n rows whose RoPE, stores and
     * attention go through the *_rows ops starts; it ends with step_end(). Returns the rows
     * the step runs, n_pad in [n, max_rows]: rows n.. are padding (forward.c gives them
     * token 0, position -1 and the last row's depth; their results are ignored), so that
     * steps of nearby sizes are the same step. With record, the ops up to step_end may be
     * kept and replayed as for step_begin, the rows' tokens (embed), positions and caches
     * (the *_rows ops) being what changes; record 0: they run as they come (a pass with
     * other per-row ops), and n_pad is n. */
    int (*batch_step_begin)(tl_exec *ex, int n, int max_rows, int record);
    /* Optional (NULL = argmax row by row): out[i] = argmax of row i of n rows of `count`
     * floats, ld floats apart (as argmax gives it); out holds them when the op returns or,
     * inside a recorded batched step, when step_end() returns. */
    void (*argmax_rows)(tl_exec *ex, tl_act x, int n, int count, size_t ld, int32_t *out);

    /* Optional (NULL = no cache window: cache_window is refused at load). The KV buffer
     * `cache` (a contiguous cache's key or value plane, or a page table's key view, for
     * both of its views) holds each slot as a ring of `rows` rows: every op that takes a
     * cache slot (kv_store, kv_copy, attention, tree_attention, the fused and batched
     * stores, attention_rows) then finds position p at row p mod rows, so positions go on
     * past the rows (attention is given a window no wider than rows). rows 0: row = p.
     * copy_rows between buffers is not affected. */
    void (*kv_ring)(tl_buf *cache, int rows);
} tl_backend_ops;

struct tl_backend {
    const tl_backend_ops *ops;
    char name[64];       /* "cpu (avx512vnni)", "cpu (avx2)", ... */
    int device_index;    /* -1 for CPU */
    int prefill_rows;    /* rows per prefill chunk when a context asks for the default */
    int kv_dtype;        /* the KV dtype when a load asks for the default (tl_kv_dtype) */
    void *impl;          /* backend-private */
};

/* What the core hands a backend library when it opens it (tl_cuda_backend_open): its
 * side of the handshake and the services the library may not reach otherwise. */
typedef struct tl_backend_host {
    uint32_t version;        /* TL_BACKEND_INTERFACE_VERSION of the core */
    uint32_t struct_size;    /* sizeof(tl_backend_host) */
    uint32_t ops_size;       /* sizeof(tl_backend_ops) */
    uint32_t model_size;     /* sizeof(struct tl_model) */
    /* tl_log (log.h): the library writes nothing to stderr itself */
    void (*log)(tl_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
    /* tl_debug_switch (debug_flags.h): the library reads no environment variable */
    int (*debug_switch)(tl_debug_flag flag);
} tl_backend_host;

/* 0 when the interface version and the size of struct `what` that `peer` was built with
 * equal this side's (`self`, the expected size want_size); else 1 with a message naming
 * both in msg. The core and the CUDA library each check the other with it. */
static inline int tl_backend_interface_mismatch(const char *peer, const char *self, const char *what,
                                                uint32_t version, uint32_t size, uint32_t want_size,
                                                char *msg, size_t cap) {
    if (version == TL_BACKEND_INTERFACE_VERSION && size == want_size) return 0;
    snprintf(msg, cap,
             "%s has backend interface version %u (%s of %u bytes), %s has version %u (%u bytes): "
             "they come from different builds; rebuild both from one source tree",
             peer, (unsigned)version, what, (unsigned)size, self, (unsigned)TL_BACKEND_INTERFACE_VERSION,
             (unsigned)want_size);
    return 1;
}

/* backend_loader.c: TL_OK when a backend library's ops table matches this core
 * (TL_ERR_UNSUPPORTED naming `library` otherwise). */
tl_status tl_backend_check_ops(const tl_backend_ops *ops, const char *library);

/* A built-in backend's constructor. */
typedef tl_status (*tl_backend_create_fn)(tl_backend **out);

/* backend_loader.c: parse a device string ("cpu", "auto", "cuda", "cuda:N"; NULL =
 * "cpu") and open the backend that serves it. The CPU backend, which "cpu" and a
 * fallback of "auto" get, is built on this interface (cpu/backend_cpu.h): the caller
 * hands in its constructor. */
tl_status tl_backend_open(const char *device, tl_backend_create_fn cpu_create, tl_backend **out);
void tl_backend_close(tl_backend *be);

#endif

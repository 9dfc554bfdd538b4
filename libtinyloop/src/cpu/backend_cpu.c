/* backend_cpu.c — the CPU implementation of backend.h on top of cpu/kernels.h.
 * Buffers are 64-byte aligned host arrays; weights are used in place from the
 * mapped file (no repacking); each context's tl_exec owns its thread pool and the
 * scratch the matmul and attention kernels need. */
#define _GNU_SOURCE
#include "cpu/backend_cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "cpu/kernels.h"
#include "cpu/threadpool.h"
#include "base/sample_row.h"

struct cpu_page_table;

struct tl_buf {
    float *data;
    size_t n;
    struct cpu_page_table *table;   /* a page table's view (data NULL), else NULL */
    int plane;                      /* the view's: 0 keys, 1 values */
    int ring;                       /* a KV plane held as rings of this many rows per
                                       slot (backend.h, kv_ring); 0 = row = position */
};

/* A paged KV cache's table (backend.h, page_table_create) and its two views. */
typedef struct cpu_page_table {
    tl_buf k_view, v_view;
    float **pages;      /* entry i: page i's first float, or NULL */
    int n_entries, shift, width;
    size_t plane;       /* floats of one plane of a page: n_slots * page_size * width */
    int ring;           /* rows of each slot's ring (kv_ring); 0 = row = position */
} cpu_page_table;

struct tl_exec {
    tl_threadpool *pool;
    void *matmul_scratch;
    size_t matmul_scratch_bytes;
    void *attn_scratch;
    size_t attn_scratch_bytes;
    int max_rows;
    int32_t *positions;   /* pos0 + i for the RoPE kernel */
    /* cos/sin of the rows last rotated: every layer's q and k of a chunk reuse them
     * (recomputing them per call cost ~1% of a decode step) */
    float *rope_table;    /* max_rows x rope_dims */
    size_t rope_table_bytes;
    int rope_pos0, rope_rows, rope_dims;
    float rope_theta;
    const float *rope_factors;
};

typedef struct cpu_impl {
    const struct tl_model *model;
    uint64_t weight_bytes;
} cpu_impl;

static inline float *P(tl_act a) { return a.buf->data + a.off; }

static void *alloc_aligned(size_t bytes) {
    void *p = NULL;
    if (bytes == 0) bytes = 64;
    /* round up so the kernels may read whole 64-byte lines at the end */
    bytes = (bytes + 63) & ~(size_t)63;
    if (posix_memalign(&p, 64, bytes) != 0) return NULL;
    return p;
}

/* ---- model ------------------------------------------------------------------ */

static void add_matrix_bytes(uint64_t *sum, const tl_tensor *t) {
    if (t->data) *sum += t->nbytes;
}

static void add_norm_bytes(uint64_t *sum, const tl_norm_weights *n) {
    add_matrix_bytes(sum, &n->weight);
    add_matrix_bytes(sum, &n->bias);
}

static void add_block_bytes(uint64_t *sum, const tl_block_weights *b) {
    const tl_tensor *ts[] = { &b->wq, &b->wk, &b->wv, &b->wo, &b->bq, &b->bk, &b->bv,
                              &b->w_gate, &b->w_up, &b->w_down };
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) add_matrix_bytes(sum, ts[i]);
    add_norm_bytes(sum, &b->attn_norm);
    add_norm_bytes(sum, &b->attn_post_norm);
    add_norm_bytes(sum, &b->mlp_norm);
    add_norm_bytes(sum, &b->mlp_post_norm);
}

static tl_status cpu_prepare_model(tl_backend *be, const struct tl_model *m) {
    cpu_impl *impl = be->impl;
    uint64_t sum = 0;
    impl->model = m;
    add_matrix_bytes(&sum, &m->embed);
    if (!m->hp.tied_embeddings) add_matrix_bytes(&sum, &m->output);
    add_norm_bytes(&sum, &m->final_norm);
    add_norm_bytes(&sum, &m->loop_norm);
    add_norm_bytes(&sum, &m->post_loop_norm);
    add_matrix_bytes(&sum, &m->exit_gate_w);
    add_matrix_bytes(&sum, &m->exit_gate_b);
    add_matrix_bytes(&sum, &m->inject_w);
    add_matrix_bytes(&sum, &m->inject_b);
    for (int i = 0; i < m->hp.n_pre; i++) add_block_bytes(&sum, &m->pre[i]);
    for (int i = 0; i < m->hp.n_core; i++) add_block_bytes(&sum, &m->core[i]);
    for (int i = 0; i < m->hp.n_post; i++) add_block_bytes(&sum, &m->post[i]);
    impl->weight_bytes = sum;
    return TL_OK;
}

static void cpu_destroy(tl_backend *be) {
    if (!be) return;
    free(be->impl);
    free(be);
}

static void cpu_memory(const tl_backend *be, uint64_t *weights, uint64_t *repacked,
                       uint64_t *device) {
    const cpu_impl *impl = be->impl;
    *weights = impl->weight_bytes;
    *repacked = impl->model->draft.head_bytes;   /* the draft vocabulary's copy of its rows */
    *device = 0;
}

/* ---- execution state ------------------------------------------------------- */

static size_t max_size(size_t a, size_t b) { return a > b ? a : b; }

static size_t block_scratch(const tl_block_weights *b, int n) {
    const tl_tensor *ts[] = { &b->wq, &b->wk, &b->wv, &b->wo, &b->w_gate, &b->w_up,
                              &b->w_down };
    size_t s = 0;
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
        s = max_size(s, tl_cpu_matmul_scratch_bytes(ts[i], n));
    return s;
}

/* The largest scratch any matrix of the model needs for n rows. */
static size_t model_matmul_scratch(const struct tl_model *m, int n) {
    size_t s = tl_cpu_matmul_scratch_bytes(&m->output, n);
    if (m->inject_w.data) s = max_size(s, tl_cpu_matmul_scratch_bytes(&m->inject_w, n));
    for (int i = 0; i < m->hp.n_pre; i++) s = max_size(s, block_scratch(&m->pre[i], n));
    for (int i = 0; i < m->hp.n_core; i++) s = max_size(s, block_scratch(&m->core[i], n));
    for (int i = 0; i < m->hp.n_post; i++) s = max_size(s, block_scratch(&m->post[i], n));
    return s;
}

static size_t rope_table_bytes(const struct tl_model *m, int max_rows) {
    size_t dims = m->hp.rope_dims > 0 ? (size_t)m->hp.rope_dims : 1;
    return (size_t)max_rows * dims * sizeof(float);
}

static void cpu_exec_destroy(tl_exec *ex) {
    if (!ex) return;
    tl_threadpool_destroy(ex->pool);
    free(ex->matmul_scratch);
    free(ex->attn_scratch);
    free(ex->positions);
    free(ex->rope_table);
    free(ex);
}

static tl_status cpu_exec_create(tl_backend *be, int n_threads, int max_rows, int max_seq,
                                 tl_exec **out) {
    const cpu_impl *impl = be->impl;
    tl_exec *ex = calloc(1, sizeof *ex);
    if (!ex) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate CPU execution state");
    ex->max_rows = max_rows;
    ex->pool = n_threads > 1 ? tl_threadpool_create(n_threads) : NULL;
    if (n_threads > 1 && !ex->pool) {
        cpu_exec_destroy(ex);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot start a pool of %d threads", n_threads);
    }
    ex->matmul_scratch_bytes = model_matmul_scratch(impl->model, max_rows);
    ex->attn_scratch_bytes = tl_cpu_attention_scratch_bytes(n_threads, impl->model->hp.n_head, max_seq);
    ex->matmul_scratch = alloc_aligned(ex->matmul_scratch_bytes);
    ex->attn_scratch = alloc_aligned(ex->attn_scratch_bytes);
    ex->positions = malloc((size_t)max_rows * sizeof *ex->positions);
    ex->rope_table_bytes = rope_table_bytes(impl->model, max_rows);
    ex->rope_table = malloc(ex->rope_table_bytes);
    if (!ex->matmul_scratch || !ex->attn_scratch || !ex->positions || !ex->rope_table) {
        size_t bytes = ex->matmul_scratch_bytes + ex->attn_scratch_bytes;
        cpu_exec_destroy(ex);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes of CPU scratch", bytes);
    }
    *out = ex;
    return TL_OK;
}

static size_t cpu_exec_bytes(const tl_exec *ex) {
    return ex->matmul_scratch_bytes + ex->attn_scratch_bytes +
           (size_t)ex->max_rows * sizeof *ex->positions + ex->rope_table_bytes;
}

static tl_status cpu_status(tl_exec *ex) { return TL_OK; }

/* ---- buffers and copies ------------------------------------------------------ */

static tl_status cpu_buf_alloc(tl_backend *be, size_t n_floats, tl_buf **out) {
    tl_buf *b = malloc(sizeof *b);
    float *data = alloc_aligned(n_floats * sizeof(float));
    if (!b || !data) {
        free(b);
        free(data);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a buffer of %zu floats", n_floats);
    }
    b->data = data;
    b->n = n_floats;
    b->table = NULL;
    b->plane = 0;
    b->ring = 0;
    *out = b;
    return TL_OK;
}

static void cpu_buf_free(tl_buf *b) {
    if (!b) return;
    free(b->data);
    free(b);
}

static void cpu_upload(tl_exec *ex, tl_act dst, const float *src, size_t count) {
    memcpy(P(dst), src, count * sizeof(float));
}

static void cpu_download(tl_exec *ex, float *dst, tl_act src, size_t count) {
    memcpy(dst, P(src), count * sizeof(float));
}

static void cpu_copy_rows(tl_exec *ex, tl_act dst, size_t ld_dst, tl_act src, size_t ld_src,
                          int n, int width) {
    float *d = P(dst);
    const float *s = P(src);
    if (ld_dst == (size_t)width && ld_src == (size_t)width) {
        memmove(d, s, (size_t)n * (size_t)width * sizeof(float));
        return;
    }
    for (int i = 0; i < n; i++)
        memmove(d + (size_t)i * ld_dst, s + (size_t)i * ld_src, (size_t)width * sizeof(float));
}

static void cpu_fill(tl_exec *ex, tl_act dst, size_t count, float value) {
    float *d = P(dst);
    for (size_t i = 0; i < count; i++) d[i] = value;
}

static uint64_t splitmix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Box-Muller on the two draws at counters c and c + 1 of key. */
static double normal_at(uint64_t key, uint64_t c) {
    const double two_pi = 6.283185307179586476925286766559;
    const double inv53 = 1.0 / 9007199254740992.0; /* 2^-53 */
    uint64_t a = splitmix64(key + c), b = splitmix64(key + c + 1);
    double u1 = (double)((a >> 11) + 1) * inv53;
    double u2 = (double)(b >> 11) * inv53;
    return sqrt(-2.0 * log(u1)) * cos(two_pi * u2);
}

/* n(seed, pos, j), or n_T: redrawn at counters 2j + k 2^33 while |z| > T, 0 after 64 draws
 * (docs/model.md). */
static double seeded_normal(uint64_t key, int j, double truncation) {
    for (uint64_t k = 0; k < 64; k++) {
        double z = normal_at(key, 2 * (uint64_t)j + (k << 33));
        if (truncation <= 0.0 || fabs(z) <= truncation) return z;
    }
    return 0.0;
}

static void cpu_fill_noise(tl_exec *ex, tl_act dst, int n, int d, uint64_t seed, int pos0,
                           float sigma, float truncation) {
    float *out = P(dst);
    uint64_t seed_key = splitmix64(seed);
    for (int i = 0; i < n; i++) {
        uint64_t key = splitmix64(seed_key + (uint64_t)(pos0 + i));
        for (int j = 0; j < d; j++)
            out[(size_t)i * d + j] = (float)(sigma * seeded_normal(key, j, truncation));
    }
}

/* ---- math -------------------------------------------------------------------- */

static void cpu_embed(tl_exec *ex, const tl_tensor *table, const int32_t *tokens, int n,
                      float scale, tl_act out) {
    int d = (int)table->cols;
    for (int i = 0; i < n; i++) {
        float *row = P(out) + (size_t)i * d;
        tl_cpu_dequant_row(table, tokens[i], row);
        if (scale != 1.0f)
            for (int j = 0; j < d; j++) row[j] *= scale;
    }
}

static void cpu_matmul(tl_exec *ex, const tl_tensor *w, tl_act x, size_t ldx, int n, tl_act y,
                       size_t ldy) {
    tl_cpu_matmul(w, P(x), n, ldx, P(y), ldy, ex->matmul_scratch, ex->pool);
}

static void cpu_matmul_multi(tl_exec *ex, const tl_tensor *const *ws, int n_w, tl_act x,
                             size_t ldx, int n, const tl_act *ys, const size_t *ldys) {
    float *outs[TL_CPU_MATMUL_MAX_MULTI];
    for (int j = 0; j < n_w; j += TL_CPU_MATMUL_MAX_MULTI) {
        int count = n_w - j < TL_CPU_MATMUL_MAX_MULTI ? n_w - j : TL_CPU_MATMUL_MAX_MULTI;
        for (int t = 0; t < count; t++) outs[t] = P(ys[j + t]);
        tl_cpu_matmul_multi(ws + j, count, P(x), n, ldx, outs, ldys + j, ex->matmul_scratch,
                            ex->pool);
    }
}

static void cpu_add_bias(tl_exec *ex, tl_act y, int n, int d, const tl_tensor *bias) {
    tl_cpu_add_bias(P(y), n, d, bias);
}

static void cpu_add(tl_exec *ex, tl_act y, tl_act x, size_t count) {
    tl_cpu_add(P(y), P(x), count);
}

static void cpu_norm(tl_exec *ex, const tl_norm_weights *w, const tl_norm_params *p, tl_act x,
                     int n, int d, tl_act out) {
    if (p->type == TL_NORMTYPE_LAYER)
        tl_cpu_layernorm(P(x), n, d, &w->weight, w->bias.data ? &w->bias : NULL, p->eps, P(out));
    else
        tl_cpu_rmsnorm(P(x), n, d, &w->weight, p->unit_offset, p->eps, P(out));
}

static void cpu_rope(tl_exec *ex, tl_act x, int n, int n_heads, int head_dim, int pos0,
                     const tl_rope_params *p) {
    if (ex->rope_rows != n || ex->rope_pos0 != pos0 || ex->rope_dims != p->rope_dims ||
        ex->rope_theta != p->theta || ex->rope_factors != p->factors) {
        for (int i = 0; i < n; i++) ex->positions[i] = pos0 + i;
        tl_cpu_rope_table(n, p->rope_dims, p->theta, p->factors, ex->positions, ex->rope_table);
        ex->rope_rows = n;
        ex->rope_pos0 = pos0;
        ex->rope_dims = p->rope_dims;
        ex->rope_theta = p->theta;
        ex->rope_factors = p->factors;
    }
    tl_cpu_rope_apply(P(x), n, n_heads, head_dim, p->rope_dims, p->style, ex->rope_table);
}

/* RoPE at a tree's positions; the next cpu_rope rebuilds its table. */
static void cpu_rope_tree(tl_exec *ex, tl_act x, int n, int n_heads, int head_dim, const tl_tree *tree,
                          int first, const tl_rope_params *p) {
    tl_cpu_rope_table(n, p->rope_dims, p->theta, p->factors, tree->pos + first, ex->rope_table);
    ex->rope_rows = -1;
    tl_cpu_rope_apply(P(x), n, n_heads, head_dim, p->rope_dims, p->style, ex->rope_table);
}

/* The kernels' view of a slot of a paged cache: k_cache / v_cache are its table's views
 * at the slot's offset inside a page's plane. */
static tl_cpu_kv_pages pages_of(tl_act k_cache, tl_act v_cache) {
    const cpu_page_table *t = k_cache.buf->table;
    tl_cpu_kv_pages pg = { (const float *const *)t->pages, t->shift, k_cache.off, t->plane + v_cache.off,
                           t->ring };
    return pg;
}

/* Rows per slot of a cache buffer's ring (0: none). */
static int ring_of(const tl_buf *cache) { return cache->table ? cache->table->ring : cache->ring; }

static void cpu_kv_ring(tl_buf *cache, int rows) {
    if (cache->table) cache->table->ring = rows;
    else cache->ring = rows;
}

static void cpu_tree_attention(tl_exec *ex, tl_act q, int n, const tl_tree *tree, int first, tl_act k_cache,
                               tl_act v_cache, const tl_attn_geom *g, tl_act out) {
    if (k_cache.buf->table) {
        tl_cpu_kv_pages pg = pages_of(k_cache, v_cache);
        tl_cpu_tree_attention_paged(P(q), n, tree, first, NULL, NULL, &pg, g->n_head, g->n_kv_head, g->head_dim,
                                    g->scale, g->window, P(out), ex->attn_scratch, ex->pool);
        return;
    }
    tl_cpu_tree_attention(P(q), n, tree, first, P(k_cache), P(v_cache), g->n_head, g->n_kv_head, g->head_dim,
                          g->scale, g->window, P(out), ex->attn_scratch, ex->pool);
}

static void cpu_gated_act(tl_exec *ex, tl_act gate, tl_act up, size_t count,
                          tl_activation act) {
    tl_cpu_gated_act(P(gate), P(up), count, act == TL_ACT_GELU_TANH ? 1 : 0, P(gate));
}

static void cpu_attention(tl_exec *ex, tl_act q, int n, int pos0, tl_act k_cache,
                          tl_act v_cache, const tl_attn_geom *g, tl_act out) {
    if (k_cache.buf->table) {
        tl_cpu_kv_pages pg = pages_of(k_cache, v_cache);
        tl_cpu_attention_paged(P(q), n, pos0, &pg, g->n_head, g->n_kv_head, g->head_dim, g->scale, g->window,
                               P(out), ex->attn_scratch, ex->pool);
        return;
    }
    tl_cpu_attention_ring(P(q), n, pos0, P(k_cache), P(v_cache), k_cache.buf->ring, g->n_head, g->n_kv_head,
                          g->head_dim, g->scale, g->window, P(out), ex->attn_scratch, ex->pool);
}

static void cpu_logprobs(tl_exec *ex, tl_act logits, int n, int vocab, const int32_t *targets,
                         float *out) {
    for (int i = 0; i < n; i++) {
        const float *row = P(logits) + (size_t)i * vocab;
        out[i] = row[targets[i]] - tl_cpu_logsumexp(row, vocab);
    }
}

/* The host sampler's greedy choice itself (temperature 0, no penalty), on the row in place. */
static int32_t cpu_argmax(tl_exec *ex, tl_act x, int count) {
    (void)ex;
    tl_sample_step greedy = { .temperature = 0.0f, .repetition_penalty = 1.0f };
    return tl_sample_row(P(x), count, &greedy);
}

/* The host sampler's step itself, on the row in place. */
static int32_t cpu_sample(tl_exec *ex, tl_act logits, int vocab, const tl_sample_step *step) {
    (void)ex;
    return tl_sample_row(P(logits), vocab, step);
}

/* Rows pos0..pos0+n of a paged slot, page run by page run (a ring's rows: positions
 * mod its rows, so a run also ends where the ring wraps). */
static void store_paged(tl_act k_cache, tl_act v_cache, tl_act k, tl_act v, int n, int pos0, int width) {
    const cpu_page_table *t = k_cache.buf->table;
    int size = 1 << t->shift;
    for (int i = 0, run = 0; i < n; i += run) {
        int pos = t->ring ? (pos0 + i) % t->ring : pos0 + i, in_page = pos & (size - 1);
        run = n - i < size - in_page ? n - i : size - in_page;
        if (t->ring && run > t->ring - pos) run = t->ring - pos;
        float *page = t->pages[pos >> t->shift];
        size_t row = (size_t)in_page * (size_t)width, count = (size_t)run * (size_t)width;
        memcpy(page + k_cache.off + row, P(k) + (size_t)i * width, count * sizeof(float));
        memcpy(page + t->plane + v_cache.off + row, P(v) + (size_t)i * width, count * sizeof(float));
    }
}

static void cpu_kv_store(tl_exec *ex, tl_act k_cache, tl_act v_cache, tl_act k, tl_act v, int n,
                         int pos0, int width) {
    if (k_cache.buf->table) {
        store_paged(k_cache, v_cache, k, v, n, pos0, width);
        return;
    }
    int ring = k_cache.buf->ring;
    for (int i = 0, run = 0; i < n; i += run) {   /* one run, or two where a ring wraps */
        int row = ring ? (pos0 + i) % ring : pos0 + i;
        run = ring && n - i > ring - row ? ring - row : n - i;
        size_t at = (size_t)row * (size_t)width, src = (size_t)i * (size_t)width;
        cpu_copy_rows(ex, tl_act_add(k_cache, at), (size_t)width, tl_act_add(k, src), (size_t)width, run, width);
        cpu_copy_rows(ex, tl_act_add(v_cache, at), (size_t)width, tl_act_add(v, src), (size_t)width, run, width);
    }
}

/* Row `pos` of the slot whose row 0 is `cache` (in a contiguous cache's plane, or a page
 * table's key or value view at the slot's offset), `width` floats. */
static float *cache_row(tl_act cache, int pos, int width) {
    const cpu_page_table *t = cache.buf->table;
    if (ring_of(cache.buf)) pos %= ring_of(cache.buf);
    if (!t) return P(tl_act_add(cache, (size_t)pos * (size_t)width));
    float *page = t->pages[pos >> t->shift];
    size_t in_page = (size_t)(pos & ((1 << t->shift) - 1));
    return page + (cache.buf->plane ? t->plane : 0) + cache.off + in_page * (size_t)width;
}

static void cpu_kv_copy(tl_exec *ex, tl_act k_dst, tl_act v_dst, tl_act k_src, tl_act v_src, int pos,
                        int width) {
    memcpy(cache_row(k_dst, pos, width), cache_row(k_src, pos, width), (size_t)width * sizeof(float));
    memcpy(cache_row(v_dst, pos, width), cache_row(v_src, pos, width), (size_t)width * sizeof(float));
}

/* f16 never comes: the CPU offers no buf_alloc_f16, so kv_dtype f16 is refused at load. */
static tl_status cpu_page_table_create(tl_backend *be, int n_entries, int page_size, int n_slots, int width,
                                       int f16, tl_buf **k_view, tl_buf **v_view) {
    (void)f16;
    cpu_page_table *t = calloc(1, sizeof *t);
    if (t) t->pages = calloc((size_t)n_entries, sizeof *t->pages);
    if (!t || !t->pages) {
        free(t);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a KV page table of %d entries", n_entries);
    }
    t->n_entries = n_entries;
    t->width = width;
    while ((1 << t->shift) < page_size) t->shift++;
    t->plane = (size_t)n_slots * (size_t)page_size * (size_t)width;
    t->k_view = (tl_buf){ NULL, 0, t, 0, 0 };
    t->v_view = (tl_buf){ NULL, 0, t, 1, 0 };
    *k_view = &t->k_view;
    *v_view = &t->v_view;
    return TL_OK;
}

static void cpu_page_table_set(tl_exec *ex, tl_buf *k_view, int index, tl_buf *page) {
    k_view->table->pages[index] = page ? page->data : NULL;
}

static void cpu_page_table_free(tl_buf *k_view) {
    if (!k_view) return;
    cpu_page_table *t = k_view->table;
    free(t->pages);
    free(t);
}

static const tl_backend_ops cpu_ops = {
    .version = TL_BACKEND_INTERFACE_VERSION,
    .struct_size = sizeof(tl_backend_ops),
    .prepare_model = cpu_prepare_model,
    .destroy = cpu_destroy,
    .memory = cpu_memory,
    .exec_create = cpu_exec_create,
    .exec_destroy = cpu_exec_destroy,
    .exec_bytes = cpu_exec_bytes,
    .status = cpu_status,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .upload = cpu_upload,
    .download = cpu_download,
    .copy_rows = cpu_copy_rows,
    .fill = cpu_fill,
    .fill_noise = cpu_fill_noise,
    .embed = cpu_embed,
    .matmul = cpu_matmul,
    .matmul_multi = cpu_matmul_multi,
    .add_bias = cpu_add_bias,
    .add = cpu_add,
    .norm = cpu_norm,
    .rope = cpu_rope,
    .gated_act = cpu_gated_act,
    .attention = cpu_attention,
    .logprobs = cpu_logprobs,
    .argmax = cpu_argmax,
    .kv_store = cpu_kv_store,
    .kv_copy = cpu_kv_copy,
    .sample = cpu_sample,
    .rope_tree = cpu_rope_tree,
    .tree_attention = cpu_tree_attention,
    .page_table_create = cpu_page_table_create,
    .page_table_set = cpu_page_table_set,
    .page_table_free = cpu_page_table_free,
    .kv_ring = cpu_kv_ring,
};

tl_status tl_backend_cpu_create(tl_backend **out) {
    tl_backend *be = calloc(1, sizeof *be);
    cpu_impl *impl = calloc(1, sizeof *impl);
    if (!be || !impl) {
        free(be);
        free(impl);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate the CPU backend");
    }
    be->ops = &cpu_ops;
    be->impl = impl;
    be->device_index = -1;
    be->prefill_rows = 256;   /* a chunk's activations stay in the caches */
    be->kv_dtype = TL_KV_DTYPE_F32;
    snprintf(be->name, sizeof be->name, "cpu (%s)", tl_cpu_level_name(tl_cpu_features()));
    *out = be;
    return TL_OK;
}

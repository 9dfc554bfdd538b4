/* context.c — tl_context: a buffer pool sized once (from the prefill chunk and
 * max_seq_len), the KV cache, a thread pool of the model's n_threads, and the one
 * sequence it holds (tokens, fixed depth, warm loop states). Appends run in chunks
 * through forward.c; the memory it holds is counted into the model's stats. */
#include "runtime/context.h"

#include <stdlib.h>
#include <string.h>

#include "base/error.h"

/* Rows of logits computed per head matmul while scoring: enough rows to amortise
 * reading the head's weights, few enough that V-wide rows stay small. */
#define TL_LOGIT_ROWS 32

static int imin(int a, int b) { return a < b ? a : b; }

static void stats_add(struct tl_model *m, int64_t buffers, int64_t kv) {
    pthread_mutex_lock(&m->stats_lock);
    m->ctx_buffer_bytes += (uint64_t)buffers;
    m->ctx_kv_bytes += (uint64_t)kv;
    pthread_mutex_unlock(&m->stats_lock);
}

void tl_context_count_buffer(struct tl_context *ctx, int64_t bytes) {
    ctx->buffer_bytes += (uint64_t)bytes;
    stats_add(ctx->model, bytes, 0);
}

/* Allocate one activation buffer (skipped when count is 0) and count its bytes. */
static tl_status alloc_buf(struct tl_context *ctx, size_t count, tl_buf **out) {
    *out = NULL;
    if (count == 0) return TL_OK;
    tl_status st = ctx->be->ops->buf_alloc(ctx->be, count, out);
    if (st == TL_OK) ctx->buffer_bytes += count * sizeof(float);
    return st;
}

static tl_status alloc_buffers(struct tl_context *ctx) {
    const tl_hparams *hp = &ctx->model->hp;
    size_t R = (size_t)ctx->chunk_rows, d = (size_t)hp->d;
    size_t qd = (size_t)hp->n_head * hp->head_dim, f = (size_t)hp->ffn;
    size_t kvd = (size_t)hp->n_kv_head * hp->head_dim;
    struct { size_t count; tl_buf **dst; } plan[] = {
        { R * d, &ctx->h },   { R * d, &ctx->e },    { R * d, &ctx->xn },
        { R * d, &ctx->tmp }, { R * qd, &ctx->q },   { R * qd, &ctx->att },
        { R * f, &ctx->gate }, { R * f, &ctx->up },   { R * 2 * kvd, &ctx->kv_new },
        { hp->injection == TL_INJECT_CONCAT ? R * 2 * d : 0, &ctx->cat },
        { (size_t)ctx->logit_rows * hp->vocab, &ctx->logits },
        { ctx->state_init == TL_INIT_WARM ? (size_t)ctx->max_seq * d : 0, &ctx->warm },
    };
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++) {
        tl_status st = alloc_buf(ctx, plan[i].count, plan[i].dst);
        if (st != TL_OK) return st;
    }
    return TL_OK;
}

void tl_context_close(struct tl_context *ctx) {
    if (!ctx) return;
    tl_buf *bufs[] = { ctx->h, ctx->e, ctx->xn, ctx->tmp, ctx->q, ctx->att, ctx->gate,
                       ctx->up, ctx->kv_new, ctx->cat, ctx->logits, ctx->warm, ctx->loop_e,
                       ctx->loop_s, ctx->block_in };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) ctx->be->ops->buf_free(bufs[i]);
    tl_kv_cache_free(&ctx->kv);
    if (ctx->ex) ctx->be->ops->exec_destroy(ctx->ex);
    if (ctx->buffer_bytes || ctx->kv_bytes)
        stats_add(ctx->model, -(int64_t)ctx->buffer_bytes, -(int64_t)ctx->kv_bytes);
    free(ctx->tokens);
    free(ctx);
}

int tl_model_max_seq(const struct tl_model *m) {
    return m->load_opts.max_seq_len > 0 ? m->load_opts.max_seq_len : m->hp.max_seq_len;
}

/* kv_policy store_h (docs/model.md, "The store_h KV policy"): the core blocks' inputs of
 * every iteration and position (*count floats; 0 without a loop). Its recomputation runs
 * a number of rows that grows with the position, so it needs a backend that runs each
 * step as it comes (not one that replays recorded steps) and a contiguous cache. */
tl_status tl_context_check_store_h(const struct tl_model *model) {
    if (model->kv_pool)
        return tl_fail(TL_ERR_UNSUPPORTED, "kv_policy store_h keeps block inputs in place of the loop's "
                       "K/V, and paged KV (kv_page_size %d) pages K/V only; use one of them",
                       model->kv_pool->page_size);
    const tl_backend *be = model->backend;
    if (be->ops->step_begin || be->ops->batch_step_begin)
        return tl_fail(TL_ERR_UNSUPPORTED, "kv_policy store_h: the %s backend replays recorded decode "
                       "steps, and store_h recomputes a number of K/V rows that grows with the "
                       "position in every step; it runs on the CPU backend", be->name);
    return TL_OK;
}

static tl_status open_block_inputs(struct tl_context *ctx, size_t *count) {
    const tl_hparams *hp = &ctx->model->hp;
    *count = 0;
    if (!tl_kv_stores_h(&ctx->kv_policy) || hp->n_core == 0) return TL_OK;
    tl_status st = tl_context_check_store_h(ctx->model);
    if (st != TL_OK) return st;
    if (ctx->window.size)   /* the inputs are kept by position, which a window does not bound */
        return tl_fail(TL_ERR_UNSUPPORTED, "kv_policy store_h with cache_window %d: store_h keeps every "
                       "position's block inputs, a ring keeps the last positions' K/V; use one of them",
                       ctx->window.size);
    *count = (size_t)hp->n_core * ctx->max_depth * ctx->max_seq * hp->d;
    return ctx->be->ops->buf_alloc(ctx->be, *count, &ctx->block_in);
}

tl_status tl_context_open(struct tl_model *model, int max_seq, int max_depth, int prefill_chunk,
                          struct tl_context **out) {
    return tl_context_open_with(model, max_seq, max_depth, prefill_chunk, NULL, NULL, out);
}

tl_status tl_context_check_no_window(const struct tl_context *ctx, const char *what) {
    if (!ctx->window.size) return TL_OK;
    return tl_fail(TL_ERR_UNSUPPORTED, "%s: the context has cache_window %d, whose ring keeps only the last "
                   "positions' K/V; use a context without one (cache_window = -1)", what, ctx->window.size);
}

/* Room for n tokens in the history (a window's grows with the sequence). */
static tl_status tokens_room(struct tl_context *ctx, size_t n) {
    if (n <= ctx->token_cap) return TL_OK;
    size_t cap = ctx->token_cap * 2 > n ? ctx->token_cap * 2 : n;
    int32_t *t = realloc(ctx->tokens, cap * sizeof *t);
    if (!t) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot grow the token history to %zu tokens", cap);
    tl_context_count_buffer(ctx, (int64_t)((cap - ctx->token_cap) * sizeof *t));
    ctx->tokens = t;
    ctx->token_cap = cap;
    return TL_OK;
}

/* What a cache window needs of the model and backend. */
static tl_status check_window(const struct tl_model *model, const tl_cache_window *w) {
    if (!w->size) return TL_OK;
    if (tl_model_state_init(model, TL_STATE_INIT_DEFAULT) == TL_INIT_WARM)
        return tl_fail(TL_ERR_UNSUPPORTED, "cache_window %d: a warm state init (the file's or state_init "
                       "warm) keeps every position's final state by position, which a window does not "
                       "bound", w->size);
    if (!model->backend->ops->kv_ring)
        return tl_fail(TL_ERR_UNSUPPORTED, "cache_window %d: the %s backend has no ring KV cache", w->size,
                       model->backend->name);
    return TL_OK;
}

tl_status tl_context_open_with(struct tl_model *model, int max_seq, int max_depth, int prefill_chunk,
                               const tl_kv_choice *kv_policy, const tl_cache_window *window,
                               struct tl_context **out) {
    const tl_hparams *hp = &model->hp;
    const tl_cache_window *w = window ? window : &model->cache_window;
    tl_status wst = check_window(model, w);
    if (wst != TL_OK) return wst;
    int model_seq = tl_model_max_seq(model);
    if (max_seq < 0 || max_seq > model_seq)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "context max_seq_len %d is out of range [1, %d] (0 = the model's)",
                       max_seq, model_seq);
    if (hp->n_core > 0 && (max_depth < 0 || max_depth > hp->max_depth))
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "context max_depth %d is out of range [1, %d] (0 = the model's)",
                       max_depth, hp->max_depth);
    if (prefill_chunk < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "prefill_chunk %d is negative", prefill_chunk);

    struct tl_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a context");
    ctx->model = model;
    ctx->be = model->backend;
    ctx->max_seq = max_seq ? max_seq : model_seq;
    ctx->token_cap = (size_t)ctx->max_seq;
    ctx->window = *w;
    if (w->size) ctx->max_seq = TL_CACHE_WINDOW_MAX_POS;
    ctx->max_depth = hp->n_core == 0 ? 0 : (max_depth ? max_depth : hp->max_depth);
    ctx->kv_policy = kv_policy ? *kv_policy : tl_model_kv_policy(model);
    ctx->loop_slots = tl_kv_loop_slots(&ctx->kv_policy, ctx->max_depth);
    ctx->state_init = tl_model_state_init(model, TL_STATE_INIT_DEFAULT);
    if (!prefill_chunk) prefill_chunk = model->load_opts.prefill_chunk;
    if (!prefill_chunk) prefill_chunk = model->backend->prefill_rows > 0 ? model->backend->prefill_rows : 256;
    ctx->chunk_rows = imin(prefill_chunk, w->size ? w->size : ctx->max_seq);
    ctx->logit_rows = imin(TL_LOGIT_ROWS, ctx->chunk_rows);
    /* KV rows per slot: a window's ring (no pass overwrites a position its rows see) */
    int kv_rows = w->size ? tl_cache_window_rows(w, ctx->chunk_rows) : ctx->max_seq;

    int n_threads = model->load_opts.n_threads > 0 ? model->load_opts.n_threads : 1;
    tl_status st = ctx->be->ops->exec_create(ctx->be, n_threads, ctx->chunk_rows, kv_rows, &ctx->ex);
    if (st == TL_OK) {
        ctx->buffer_bytes += ctx->be->ops->exec_bytes(ctx->ex);
        ctx->tokens = malloc(ctx->token_cap * sizeof *ctx->tokens);
        if (!ctx->tokens) st = tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a token history");
        ctx->buffer_bytes += ctx->token_cap * sizeof *ctx->tokens;
    }
    if (st == TL_OK) st = alloc_buffers(ctx);
    if (st == TL_OK)
        st = tl_kv_cache_init(&ctx->kv, ctx->be, model->kv_pool, tl_kv_slot_count(hp, ctx->loop_slots),
                              kv_rows, hp->n_kv_head * hp->head_dim,
                              model->load_opts.kv_dtype == TL_KV_DTYPE_F16, w->size > 0);
    size_t block_in = 0;
    if (st == TL_OK) st = open_block_inputs(ctx, &block_in);
    if (st != TL_OK) {
        ctx->buffer_bytes = 0; /* nothing was added to the stats yet */
        tl_context_close(ctx);
        return st;
    }
    ctx->kv_bytes = tl_kv_cache_bytes(&ctx->kv) + block_in * sizeof(float);
    stats_add(model, (int64_t)ctx->buffer_bytes, (int64_t)ctx->kv_bytes);
    *out = ctx;
    return TL_OK;
}

tl_status tl_context_resolve_depth(const struct tl_context *ctx, int32_t depth, int *resolved) {
    const struct tl_model *m = ctx->model;
    if (m->hp.n_core == 0) {   /* no loop: depth means nothing */
        *resolved = 0;
        return TL_OK;
    }
    if (depth < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "depth %d is negative (0 = default)", depth);
    int d = depth;
    if (d == 0) {
        if (ctx->n_tokens > 0) {
            *resolved = ctx->depth;
            return TL_OK;
        }
        d = tl_model_default_depth(m);
    }
    if (d < 1 || d > ctx->max_depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "depth %d is out of range [1, %d] (the context's max_depth)", d,
                       ctx->max_depth);
    if (ctx->n_tokens > 0 && d != ctx->depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "depth %d differs from the sequence's depth %d; reset the context or "
                       "truncate it to 0 tokens to change depth",
                       d, ctx->depth);
    *resolved = d;
    return TL_OK;
}

tl_status tl_context_check_tokens(const struct tl_context *ctx, const int32_t *tokens,
                                  size_t n) {
    int32_t V = ctx->model->hp.vocab;
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "token %d at index %zu is out of range [0, %d)",
                           tokens[i], i, V);
    return TL_OK;
}

/* The part of `out` (NULL = nothing) for rows [c0, c0 + rows) of a pass over n rows in
 * chunks: the whole request for the last chunk (every field of the last row, whatever
 * fields come later); the per-row fields from row c0 on for every chunk. */
static tl_forward_out chunk_request(const tl_forward_out *out, size_t c0, int rows, size_t n,
                                    int vocab) {
    tl_forward_out chunk_out = { 0 };
    if (!out) return chunk_out;
    if (c0 + (size_t)rows == n) chunk_out = *out;
    chunk_out.targets = NULL;
    chunk_out.logprobs = chunk_out.entropies = chunk_out.host_row = chunk_out.top_logprobs = NULL;
    chunk_out.top_ids = NULL;
    chunk_out.top_k = 0;
    chunk_out.n_targets = 0;
    chunk_out.row_tokens = NULL;
    chunk_out.n_row_tokens = 0;
    chunk_out.row_logits = NULL;
    chunk_out.n_row_logits = 0;
    chunk_out.hidden_sum = out->hidden_sum;   /* every chunk's rows count */
    chunk_out.hidden_row = out->hidden_row;
    if (out->n_targets > c0) {
        chunk_out.targets = out->targets + c0;
        chunk_out.logprobs = out->logprobs + c0;
        chunk_out.n_targets = out->n_targets - c0;
        if (out->entropies) chunk_out.entropies = out->entropies + c0;
        if (out->top_k > 0) {
            chunk_out.top_k = out->top_k;
            chunk_out.top_ids = out->top_ids + c0 * (size_t)out->top_k;
            chunk_out.top_logprobs = out->top_logprobs + c0 * (size_t)out->top_k;
        }
        chunk_out.host_row = out->host_row;
    }
    if (out->n_row_tokens > c0) {
        chunk_out.row_tokens = out->row_tokens + c0;
        chunk_out.n_row_tokens = out->n_row_tokens - c0;
    }
    if (out->n_row_logits > c0) {
        chunk_out.row_logits = out->row_logits + c0 * (size_t)vocab;
        chunk_out.n_row_logits = out->n_row_logits - c0;
    }
    /* adaptive depth: every chunk's rows follow the rule; depths per row */
    chunk_out.exit = out->exit;
    chunk_out.given_depths = out->given_depths ? out->given_depths + c0 : NULL;
    chunk_out.depths = NULL;
    chunk_out.n_depths = 0;
    if (out->n_depths > c0) {
        chunk_out.depths = out->depths + c0;
        chunk_out.n_depths = out->n_depths - c0;
    }
    return chunk_out;
}

/* Run tokens after the sequence at loop depth L in chunks, producing `out`, and append
 * them. On failure the sequence keeps its previous length. */
static tl_status eval_chunks(struct tl_context *ctx, const int32_t *tokens, size_t n, int L,
                             const tl_forward_out *out) {
    tl_status st = tl_context_check_tokens(ctx, tokens, n);
    if (st != TL_OK) return st;
    size_t start = ctx->n_tokens;
    if (n > (size_t)ctx->max_seq - start)
        return tl_fail(TL_ERR_CONTEXT_FULL,
                       "appending %zu tokens to a sequence of %zu would exceed max_seq_len %d",
                       n, start, ctx->max_seq);
    st = tokens_room(ctx, start + n);
    if (st != TL_OK) return st;

    for (size_t c0 = 0; c0 < n; c0 += (size_t)ctx->chunk_rows) {
        int rows = (int)(n - c0 < (size_t)ctx->chunk_rows ? n - c0 : (size_t)ctx->chunk_rows);
        tl_forward_out chunk_out = chunk_request(out, c0, rows, n, ctx->model->hp.vocab);
        tl_forward_req req = { .rows = TL_ROWS_SEQUENCE, .tokens = tokens + c0, .n = rows,
                               .pos0 = (int)(start + c0), .depth = L };
        st = tl_forward(ctx, &req, &chunk_out);
        if (st != TL_OK) {
            tl_context_set_length(ctx, start);
            tl_context_trim(ctx);
            return st;
        }
        memcpy(ctx->tokens + start + c0, tokens + c0, (size_t)rows * sizeof *tokens);
        ctx->n_tokens = start + c0 + (size_t)rows;
    }
    return TL_OK;
}

tl_status tl_context_check_exit(const struct tl_context *ctx, const tl_exit_rule *rule, const int32_t *given,
                                size_t n, int32_t depth, const char *field) {
    const tl_hparams *hp = &ctx->model->hp;
    int active = tl_exit_rule_active(rule);
    if (!active && !given) return TL_OK;
    tl_status st = tl_exit_rule_check(rule, hp->exit_gate, hp->n_core > 0, field);
    if (st != TL_OK) return st;
    if (active && given)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s and given depths together: give one of them", field);
    if (hp->n_core == 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "given depths: the model has no loop (n_core = 0)");
    if (ctx->loop_s)
        return tl_fail(TL_ERR_UNSUPPORTED, "%s: the context keeps its loop states to deepen them, and its "
                                           "positions would be at different depths", field);
    if (!ctx->be->ops->kv_copy)
        return tl_fail(TL_ERR_UNSUPPORTED, "%s: the %s backend cannot copy K/V rows between slots", field,
                       ctx->be->name);
    int L = 0;
    st = tl_context_resolve_depth(ctx, depth, &L);
    if (st != TL_OK) return st;
    for (size_t i = 0; given && i < n; i++)
        if (given[i] < 1 || given[i] > L)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "given depth %d at index %zu is out of range [1, %d]",
                           given[i], i, L);
    return TL_OK;
}

tl_status tl_context_eval(struct tl_context *ctx, const int32_t *tokens, size_t n,
                          int32_t depth, const tl_forward_out *out) {
    int L = 0;
    tl_status st = tl_context_resolve_depth(ctx, depth, &L);
    if (st != TL_OK) return st;
    st = eval_chunks(ctx, tokens, n, L, out);
    if (st == TL_OK && ctx->n_tokens > 0) ctx->depth = L;
    return st;
}

/* The batch's rows through batched forward passes of at most lead's chunk rows each,
 * deepest rows first, so that rows of different depths share the prelude and the
 * iterations they have in common (a row leaves the loop at its depth); then, when every
 * pass succeeded, each context's token appended. */
static tl_status eval_in_groups(struct tl_context *lead, struct tl_context *const *ctxs,
                                const int32_t *tokens, size_t n, const int *depths,
                                const tl_forward_out *outs) {
    size_t cap = (size_t)lead->chunk_rows;
    size_t *order = malloc(n * sizeof *order);
    tl_batch_row *rows = malloc(cap * sizeof *rows);
    int32_t *row_tokens = malloc(cap * sizeof *row_tokens), *row_depths = malloc(cap * sizeof *row_depths);
    tl_forward_out *row_outs = malloc(cap * sizeof *row_outs);
    tl_status st = TL_OK;
    if (!order || !rows || !row_tokens || !row_depths || !row_outs)
        st = tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a batch of %zu", n);
    /* by depth, deepest first, in batch order among equals (insertion sort: batches are
       short) */
    for (size_t i = 0; i < n && st == TL_OK; i++) {
        size_t j = i;
        for (; j > 0 && depths[order[j - 1]] < depths[i]; j--) order[j] = order[j - 1];
        order[j] = i;
    }
    for (size_t g0 = 0; g0 < n && st == TL_OK; g0 += cap) {
        int count = (int)(n - g0 < cap ? n - g0 : cap);
        for (int r = 0; r < count; r++) {
            size_t j = order[g0 + (size_t)r];
            rows[r] = (tl_batch_row){ ctxs[j], (int)ctxs[j]->n_tokens };
            row_tokens[r] = tokens[j];
            row_depths[r] = depths[j];
            row_outs[r] = outs ? outs[j] : (tl_forward_out){ 0 };
        }
        tl_forward_req req = { .rows = TL_ROWS_BATCH, .tokens = row_tokens, .n = count, .batch = rows,
                               .depth = row_depths[0], .row_depths = row_depths };
        st = tl_forward(lead, &req, row_outs);
    }
    for (size_t i = 0; i < n && st == TL_OK; i++) {
        ctxs[i]->tokens[ctxs[i]->n_tokens++] = tokens[i];
        ctxs[i]->depth = depths[i];
    }
    free(order);
    free(rows);
    free(row_tokens);
    free(row_depths);
    free(row_outs);
    return st;
}

tl_status tl_context_eval_batch(struct tl_context *const *ctxs, const int32_t *tokens, size_t n,
                                const tl_forward_out *outs) {
    if (n == 0) return TL_OK;
    struct tl_context *lead = ctxs[0];
    int *depths = malloc(n * sizeof *depths);
    if (!depths) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a batch of %zu", n);
    tl_status st = TL_OK;
    for (size_t i = 0; i < n && st == TL_OK; i++) {
        struct tl_context *ctx = ctxs[i];
        if (ctx->model != lead->model) {
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "batch: context %zu belongs to another model", i);
            break;
        }
        for (size_t j = 0; j < i && st == TL_OK; j++)
            if (ctxs[j] == ctx) st = tl_fail(TL_ERR_INVALID_ARGUMENT, "batch: contexts %zu and %zu are the same", j, i);
        if (st == TL_OK) st = tl_context_resolve_depth(ctx, 0, &depths[i]);
        if (st == TL_OK) st = tl_context_check_tokens(ctx, tokens + i, 1);
        if (st == TL_OK && ctx->n_tokens >= (size_t)ctx->max_seq)
            st = tl_fail(TL_ERR_CONTEXT_FULL, "batch: context %zu is full (max_seq_len %d)", i, ctx->max_seq);
        /* one pass masks every row with the lead's window */
        if (st == TL_OK && (ctx->window.size != lead->window.size || ctx->window.attn != lead->window.attn))
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "batch: context %zu has cache_window %d and context 0 %d: "
                         "a batch's contexts share one", i, ctx->window.size, lead->window.size);
        if (st == TL_OK) st = tokens_room(ctx, ctx->n_tokens + 1);
        if (ctx->max_seq > lead->max_seq) lead = ctx;   /* its attention scratch covers every row */
    }
    /* One row takes the one-row step's path (fused kernels, recorded steps); a warm start
     * chains each position to the previous one's state, so its rows go one by one. */
    int warm = 0;
    for (size_t i = 0; i < n; i++) warm |= ctxs[i]->warm != NULL;
    if (st == TL_OK && (n == 1 || warm)) {
        for (size_t i = 0; i < n && st == TL_OK; i++)
            st = tl_context_eval(ctxs[i], tokens + i, 1, 0, outs ? &outs[i] : NULL);
    } else if (st == TL_OK) {
        st = eval_in_groups(lead, ctxs, tokens, n, depths, outs);
        for (size_t i = 0; i < n && st != TL_OK; i++) tl_context_trim(ctxs[i]);   /* pages taken for it */
    }
    free(depths);
    return st;
}

tl_status tl_context_eval_draft(struct tl_context *ctx, const int32_t *tokens, size_t n,
                                int draft_depth, const tl_forward_out *out) {
    if (ctx->n_tokens == 0 || ctx->depth == 0 || draft_depth < 1 || draft_depth > ctx->depth)
        return tl_fail(TL_ERR_INTERNAL,
                       "a draft at depth %d needs a sequence of a deeper depth (length %zu, depth %d)",
                       draft_depth, ctx->n_tokens, ctx->depth);
    return eval_chunks(ctx, tokens, n, draft_depth, out);
}

tl_status tl_context_eval_resumed(struct tl_context *ctx, const int32_t *tokens, size_t n,
                                 int from, const tl_forward_out *out, tl_act kept_e, tl_act kept_s) {
    size_t start = ctx->n_tokens;
    if (n < 2 || n > (size_t)ctx->chunk_rows || from < 1 || from > ctx->depth ||
        ctx->state_init == TL_INIT_WARM || n > (size_t)ctx->max_seq - start)
        return tl_fail(TL_ERR_INTERNAL, "a resumed verification of %zu rows from iteration %d "
                       "(sequence of %zu at depth %d)", n, from, start, ctx->depth);
    tl_forward_req req = { .rows = TL_ROWS_SEQUENCE, .tokens = tokens, .n = (int)n, .pos0 = (int)start,
                           .depth = ctx->depth, .start = TL_START_RESUMED, .from = from,
                           .n_resumed = (int)n - 1, .resume_e = kept_e, .resume_s = kept_s };
    tl_status st = tl_context_check_tokens(ctx, tokens, n);
    if (st == TL_OK) st = tokens_room(ctx, start + n);
    if (st == TL_OK) st = tl_forward(ctx, &req, out);
    if (st != TL_OK) return st;
    memcpy(ctx->tokens + start, tokens, n * sizeof *tokens);
    ctx->n_tokens = start + n;
    return TL_OK;
}

tl_status tl_context_keep_loop_states(struct tl_context *ctx, int *added) {
    const tl_hparams *hp = &ctx->model->hp;
    if (added) *added = 0;
    if (ctx->loop_s) return TL_OK;
    if (hp->n_core == 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "keeping loop states: this model has no loop (n_core = 0)");
    if (ctx->state_init == TL_INIT_WARM)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "keeping loop states: with a warm state init (state_init warm) each position starts from the "
                       "previous one's final state, which a deeper pass changes; append again at "
                       "the deeper depth instead");
    if (!tl_kv_is_exact(&ctx->kv_policy))
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "keeping loop states: kv_policy %s shares K/V slots between iterations, and "
                       "a deeper pass would rerun iterations whose K/V later ones overwrote; use "
                       "kv_policy exact to deepen", tl_kv_policy_name(ctx->kv_policy.kind));
    tl_status wst = tl_context_check_no_window(ctx, "keeping loop states");
    if (wst != TL_OK) return wst;
    size_t count = (size_t)ctx->max_seq * hp->d;
    int64_t before = (int64_t)ctx->buffer_bytes;
    tl_status st = alloc_buf(ctx, count, &ctx->loop_s);
    if (st == TL_OK && hp->injection != TL_INJECT_NONE) st = alloc_buf(ctx, count, &ctx->loop_e);
    stats_add(ctx->model, (int64_t)ctx->buffer_bytes - before, 0);
    if (st != TL_OK) {
        tl_context_drop_loop_states(ctx);
        return st;
    }
    if (added) *added = 1;
    return TL_OK;
}

void tl_context_drop_loop_states(struct tl_context *ctx) {
    tl_buf **bufs[] = { &ctx->loop_e, &ctx->loop_s };
    for (size_t i = 0; i < 2; i++) {
        if (!*bufs[i]) continue;
        size_t bytes = (size_t)ctx->max_seq * ctx->model->hp.d * sizeof(float);
        ctx->be->ops->buf_free(*bufs[i]);
        *bufs[i] = NULL;
        ctx->buffer_bytes -= bytes;
        stats_add(ctx->model, -(int64_t)bytes, 0);
    }
}

tl_status tl_context_eval_deeper(struct tl_context *ctx, int depth, const tl_forward_out *out) {
    size_t n = ctx->n_tokens;
    int from = ctx->depth;
    if (!ctx->loop_s || n == 0 || depth < from || depth > ctx->max_depth)
        return tl_fail(TL_ERR_INTERNAL, "deepening a sequence of %zu at depth %d to %d (states %s)",
                       n, from, depth, ctx->loop_s ? "kept" : "not kept");
    /* paged: every page the pass rewrites first, so that a full pool leaves the sequence
       as it was instead of half deepened */
    tl_status held = tl_kv_cache_reserve(&ctx->kv, ctx->ex, 0, (int)n);
    if (held != TL_OK) return held;
    for (size_t c0 = 0; c0 < n; c0 += (size_t)ctx->chunk_rows) {
        int rows = (int)(n - c0 < (size_t)ctx->chunk_rows ? n - c0 : (size_t)ctx->chunk_rows);
        tl_forward_out chunk_out = chunk_request(out, c0, rows, n, ctx->model->hp.vocab);
        tl_forward_req req = { .rows = TL_ROWS_SEQUENCE, .n = rows, .pos0 = (int)c0, .depth = depth,
                               .start = TL_START_KEPT, .from = from };
        tl_status st = tl_forward(ctx, &req, &chunk_out);
        if (st != TL_OK) {
            tl_context_set_length(ctx, 0);
            return st;
        }
    }
    ctx->depth = depth;
    return TL_OK;
}

tl_status tl_context_logit_lens(struct tl_context *ctx, const int32_t *tokens, size_t n,
                                int max_depth, float *logits_per_depth) {
    const tl_hparams *hp = &ctx->model->hp;
    if (hp->n_core == 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "the logit lens is per loop depth, and this model has "
                                           "no loop (n_core = 0)");
    if (n == 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "the logit lens needs at least 1 token");
    tl_status st = tl_context_check_tokens(ctx, tokens, n);
    if (st != TL_OK) return st;
    if (n > (size_t)ctx->max_seq)
        return tl_fail(TL_ERR_CONTEXT_FULL, "%zu tokens exceed max_seq_len %d", n, ctx->max_seq);
    if (max_depth < 1 || max_depth > ctx->max_depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_depth %d is out of range [1, %d]", max_depth,
                       ctx->max_depth);
    tl_context_set_length(ctx, 0);
    if (n <= (size_t)ctx->chunk_rows && ctx->state_init != TL_INIT_WARM) {
        tl_buf *saved = NULL;
        st = ctx->be->ops->buf_alloc(ctx->be, n * (size_t)hp->d, &saved);
        tl_forward_req req = { .rows = TL_ROWS_SEQUENCE, .tokens = tokens, .n = (int)n, .depth = max_depth,
                               .lens = 1, .lens_saved = tl_act_at(saved, 0) };
        tl_forward_out out = { .last_logits = logits_per_depth };
        if (st == TL_OK) st = tl_forward(ctx, &req, &out);
        if (saved) ctx->be->ops->buf_free(saved);
        return st;
    }
    /* a warm state init carries each depth's final states from position to position, and
     * a sequence over several chunks would mix depths in the coda's cache: a pass each */
    for (int depth = 1; depth <= max_depth && st == TL_OK; depth++) {
        tl_forward_out out = { .last_logits = logits_per_depth + (size_t)(depth - 1) * hp->vocab };
        tl_context_set_length(ctx, 0);
        st = tl_context_eval(ctx, tokens, n, depth, &out);
    }
    tl_context_set_length(ctx, 0);
    return st;
}

tl_status tl_context_check_free(const struct tl_context *ctx) {
    if (!ctx->stream) return TL_OK;
    return tl_fail(TL_ERR_INVALID_ARGUMENT,
                   "the context is in use by a generation stream that is still open "
                   "(finish or free the stream first)");
}

void tl_context_set_length(struct tl_context *ctx, size_t n_keep) {
    ctx->n_tokens = n_keep;
    if (n_keep == 0) ctx->depth = 0;
}

void tl_context_trim(struct tl_context *ctx) {
    tl_kv_cache_trim(&ctx->kv, ctx->ex, (int)ctx->n_tokens);
}

tl_status tl_context_set_state_init(struct tl_context *ctx, int32_t choice) {
    tl_state_init init = tl_model_state_init(ctx->model, choice);
    if (init == ctx->state_init) return TL_OK;
    if (init == TL_INIT_WARM && ctx->model->hp.n_core == 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "state_init warm: the model has no loop (n_core = 0), so "
                       "there is no loop state to carry from one position to the next");
    if (init == TL_INIT_WARM && ctx->window.size)
        return tl_fail(TL_ERR_UNSUPPORTED, "state_init warm with cache_window %d: the warm state is kept "
                       "by position, which a window does not bound", ctx->window.size);
    if (init == TL_INIT_WARM && ctx->loop_s)
        return tl_fail(TL_ERR_UNSUPPORTED, "state_init warm: the context keeps its loop states to "
                       "deepen them, and a deeper pass would change the state each position starts from");
    size_t bytes = (size_t)ctx->max_seq * ctx->model->hp.d * sizeof(float);
    tl_context_set_length(ctx, 0);
    tl_context_trim(ctx);
    if (ctx->warm) {   /* back to the file's init: no states to carry */
        ctx->be->ops->buf_free(ctx->warm);
        ctx->warm = NULL;
        ctx->buffer_bytes -= bytes;
        stats_add(ctx->model, -(int64_t)bytes, 0);
    } else {
        tl_status st = alloc_buf(ctx, bytes / sizeof(float), &ctx->warm);
        if (st != TL_OK) return st;
        stats_add(ctx->model, (int64_t)bytes, 0);
    }
    ctx->state_init = init;
    return TL_OK;
}

tl_status tl_context_clone(const struct tl_context *src, struct tl_context **out) {
    struct tl_context *dst = NULL;
    tl_status st = tl_context_open_with(src->model, src->window.size ? 0 : src->max_seq, src->max_depth,
                                        src->chunk_rows, &src->kv_policy, &src->window, &dst);
    if (st == TL_OK) st = tl_context_set_state_init(dst, src->state_init == TL_INIT_WARM ? TL_STATE_INIT_WARM
                                                                                         : TL_STATE_INIT_FILE);
    if (st != TL_OK) {
        tl_context_close(dst);
        return st;
    }
    size_t n = src->n_tokens;
    st = tokens_room(dst, n);
    if (st != TL_OK) {
        tl_context_close(dst);
        return st;
    }
    tl_kv_cache_copy(&dst->kv, &src->kv, dst->ex, (int)n);   /* paged: shares src's pages */
    if (src->block_in && n > 0) {   /* each kept input layer's first n rows */
        int d = src->model->hp.d, layers = src->model->hp.n_core * src->max_depth;
        size_t ld = (size_t)src->max_seq * d;
        dst->be->ops->copy_rows(dst->ex, tl_act_at(dst->block_in, 0), ld, tl_act_at(src->block_in, 0), ld,
                                layers, (int)(n * (size_t)d));
    }
    if (src->warm && n > 0)
        dst->be->ops->copy_rows(dst->ex, tl_act_at(dst->warm, 0), 1, tl_act_at(src->warm, 0), 1,
                                1, (int)(n * (size_t)src->model->hp.d));
    if (src->loop_s) {
        st = tl_context_keep_loop_states(dst, NULL);
        tl_buf *from[] = { src->loop_e, src->loop_s }, *to[] = { dst->loop_e, dst->loop_s };
        for (int i = 0; i < 2 && st == TL_OK && n > 0; i++)
            if (from[i])
                dst->be->ops->copy_rows(dst->ex, tl_act_at(to[i], 0), 1, tl_act_at(from[i], 0), 1,
                                        1, (int)(n * (size_t)src->model->hp.d));
        if (st != TL_OK) {
            tl_context_close(dst);
            return st;
        }
    }
    memcpy(dst->tokens, src->tokens, n * sizeof *src->tokens);
    dst->n_tokens = n;
    dst->depth = src->depth;
    st = dst->be->ops->status(dst->ex);
    if (st != TL_OK) {
        tl_context_close(dst);
        return st;
    }
    *out = dst;
    return TL_OK;
}

/* prefix_cache.c — snapshots of a sequence's prefix and their loading into contexts.
 *
 * A snapshot stores only the KV slots its depth uses, in the order prelude, loop
 * iterations 1..depth, coda; a context puts the coda after its own deepest loop slot
 * (kv_cache.h), so loading maps the coda slots to the context's max_depth. The copies run
 * on the context's execution state and end with its status() (which waits for a device),
 * so a finished snapshot may be read by other contexts' streams at once. */
#include "runtime/prefix_cache.h"

#include <stdlib.h>
#include <string.h>

#include "base/error.h"

static void count_bytes(struct tl_model *m, int64_t bytes) {
    pthread_mutex_lock(&m->stats_lock);
    m->prefix_cache_bytes += (uint64_t)bytes;
    pthread_mutex_unlock(&m->stats_lock);
}

/* The context's KV slot of the snapshot's slot s (the context gives each of the
 * snapshot's iterations a slot of its own: fits_policy). */
static int context_slot(const tl_hparams *hp, int depth, int ctx_loop_slots, int s) {
    int looped = hp->n_pre + depth * hp->n_core;
    return s < looped ? s : tl_kv_slot_post(hp, ctx_loop_slots, s - looped);
}

/* A snapshot holds every iteration's K/V apart, as exact caching keeps them: a context
 * whose KV policy shares the slots of iterations up to `depth` (docs/model.md, "KV
 * policies") can neither give nor take one. */
static tl_status fits_policy(const struct tl_context *ctx, int depth) {
    tl_status st = tl_context_check_no_window(ctx, "prefix caches");
    if (st != TL_OK) return st;
    if (ctx->block_in)
        return tl_fail(TL_ERR_UNSUPPORTED, "prefix caches hold every iteration's K/V, and the context's "
                       "kv_policy store_h keeps the loop's block inputs instead; use kv_policy exact");
    if (depth <= ctx->loop_slots) return TL_OK;
    return tl_fail(TL_ERR_UNSUPPORTED, "prefix caches need a K/V slot per loop iteration: the "
                   "context's KV policy %s keeps %d per core block, below the depth %d",
                   tl_kv_policy_name(ctx->kv_policy.kind), ctx->loop_slots, depth);
}

static void free_cache(struct tl_prefix_cache *c) {
    tl_buf *bufs[] = { c->k, c->v, c->warm, c->loop_e, c->loop_s };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) c->model->backend->ops->buf_free(bufs[i]);
    if (c->own_bytes) count_bytes(c->model, -(int64_t)c->own_bytes);
    tl_kv_page_list_release(&c->pages);
    free(c->tokens);
    free(c);
}

/* `count` elements: floats, or the KV cache's elements for `kv` rows (kv_dtype). */
static tl_status alloc_rows(struct tl_prefix_cache *c, size_t count, int kv, tl_buf **out) {
    int f16 = kv && c->model->load_opts.kv_dtype == TL_KV_DTYPE_F16;
    tl_status st = tl_kv_buf_alloc(c->model->backend, f16, count, out);
    if (st != TL_OK)
        return tl_fail(st, "prefix cache of %zu tokens: %s", c->n_tokens, tl_error_message());
    c->bytes += count * tl_kv_elem_bytes(f16);
    c->own_bytes += count * tl_kv_elem_bytes(f16);
    return TL_OK;
}

/* Rows [0, n) of `width` elements, from one buffer to another (either may be the cache's). */
static void copy_prefix_rows(tl_exec *ex, const tl_backend_ops *ops, tl_act dst, tl_act src,
                             size_t n, int width) {
    ops->copy_rows(ex, dst, (size_t)width, src, (size_t)width, (int)n, width);
}

tl_status tl_prefix_cache_snapshot(struct tl_context *ctx, size_t n, struct tl_prefix_cache **out) {
    const tl_hparams *hp = &ctx->model->hp;
    if (n == 0 || n > ctx->n_tokens)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "a prefix of %zu tokens from a sequence of %zu "
                       "(need 1 to its length)", n, ctx->n_tokens);
    tl_status fit = fits_policy(ctx, ctx->depth);
    if (fit != TL_OK) return fit;
    struct tl_prefix_cache *c = calloc(1, sizeof *c);
    if (c) c->tokens = malloc(n * sizeof *c->tokens);
    if (!c || !c->tokens) {
        free(c);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a prefix cache of %zu tokens", n);
    }
    c->model = ctx->model;
    c->refs = 1;
    c->depth = ctx->depth;
    c->n_tokens = n;
    memcpy(c->tokens, ctx->tokens, n * sizeof *c->tokens);
    c->n_slots = tl_kv_slot_count(hp, c->depth);
    int kvd = hp->n_kv_head * hp->head_dim, d = hp->d;
    const tl_backend_ops *ops = ctx->be->ops;
    size_t kv_rows = (size_t)c->n_slots * n;
    tl_status st = TL_OK;
    int paged = ctx->kv.pool != NULL;
    if (paged) {
        st = tl_kv_cache_share(&ctx->kv, ctx->loop_slots, (int)n, &c->pages);
        if (st == TL_OK) c->bytes += tl_kv_page_list_bytes(&c->pages);
    } else if (kv_rows > 0) {
        st = alloc_rows(c, kv_rows * kvd, 1, &c->k);
        if (st == TL_OK) st = alloc_rows(c, kv_rows * kvd, 1, &c->v);
    }
    tl_buf *const from[] = { ctx->warm, ctx->loop_e, ctx->loop_s };
    tl_buf **to[] = { &c->warm, &c->loop_e, &c->loop_s };
    for (int i = 0; i < 3 && st == TL_OK; i++)
        if (from[i]) st = alloc_rows(c, n * d, 0, to[i]);
    if (st == TL_OK) {
        count_bytes(c->model, (int64_t)c->own_bytes);
        for (int s = 0; s < c->n_slots && !paged; s++) {
            int cs = context_slot(hp, c->depth, ctx->loop_slots, s);
            size_t at = (size_t)s * n * kvd;
            copy_prefix_rows(ctx->ex, ops, tl_act_at(c->k, at), tl_kv_keys(&ctx->kv, cs), n, kvd);
            copy_prefix_rows(ctx->ex, ops, tl_act_at(c->v, at), tl_kv_values(&ctx->kv, cs), n, kvd);
        }
        for (int i = 0; i < 3; i++)
            if (from[i]) copy_prefix_rows(ctx->ex, ops, tl_act_at(*to[i], 0), tl_act_at(from[i], 0), n, d);
        st = ops->status(ctx->ex);
    } else {
        c->own_bytes = 0;   /* nothing was counted yet */
    }
    if (st != TL_OK) {
        free_cache(c);
        return st;
    }
    *out = c;
    return TL_OK;
}

/* A paged cache's first n rows into ctx: its pages themselves when ctx lays out its slots
 * alike, else row copies slot by slot into ctx's own pages (the coda's slots move with
 * the loop's count, context_slot). */
static tl_status load_pages(struct tl_context *ctx, const struct tl_prefix_cache *c, size_t n) {
    const tl_kv_page_list *list = &c->pages;
    tl_kv_cache *kv = &ctx->kv;
    if (list->n_slots == kv->n_slots && list->loop_slots == ctx->loop_slots) {
        tl_kv_cache_adopt(kv, ctx->ex, list, (int)n);
        return TL_OK;
    }
    tl_status st = tl_kv_cache_reserve(kv, ctx->ex, 0, (int)n);
    if (st != TL_OK) {
        tl_context_trim(ctx);
        return st;
    }
    const tl_hparams *hp = &ctx->model->hp;
    size_t P = (size_t)kv->page_size, w = (size_t)kv->kv_dim;
    for (int p = 0; (size_t)p * P < n; p++) {
        int rows = (int)(n - (size_t)p * P < P ? n - (size_t)p * P : P);
        tl_buf *from = list->pages[p]->buf, *to = kv->pages[p]->buf;
        for (int s = 0; s < c->n_slots; s++) {
            size_t src = (size_t)context_slot(hp, c->depth, list->loop_slots, s) * P * w;
            size_t dst = (size_t)context_slot(hp, c->depth, ctx->loop_slots, s) * P * w;
            for (int plane = 0; plane < 2; plane++) {
                size_t ps = plane ? (size_t)list->n_slots * P * w : 0, pd = plane ? (size_t)kv->n_slots * P * w : 0;
                ctx->be->ops->copy_rows(ctx->ex, tl_act_at(to, pd + dst), w, tl_act_at(from, ps + src), w, rows,
                                        (int)w);
            }
        }
    }
    return TL_OK;
}

tl_status tl_prefix_cache_load(struct tl_context *ctx, const struct tl_prefix_cache *c, size_t n) {
    const tl_hparams *hp = &ctx->model->hp;
    if (c->model != ctx->model)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the prefix cache belongs to another model");
    if (n > c->n_tokens)
        return tl_fail(TL_ERR_INTERNAL, "loading %zu tokens of a prefix of %zu", n, c->n_tokens);
    if (n > (size_t)ctx->max_seq)
        return tl_fail(TL_ERR_CONTEXT_FULL, "the prefix of %zu tokens is longer than the context "
                       "(max_seq_len %d)", n, ctx->max_seq);
    if (c->depth > ctx->max_depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the prefix was computed at depth %d, deeper than "
                       "the context's max_depth %d", c->depth, ctx->max_depth);
    tl_status fit = fits_policy(ctx, c->depth);
    if (fit != TL_OK) return fit;
    if ((c->warm != NULL) != (ctx->warm != NULL))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the prefix cache was computed %s state_init warm and "
                       "the context runs %s it: its K/V would not be the context's",
                       c->warm ? "with" : "without", ctx->warm ? "with" : "without");
    if (ctx->loop_s && !c->loop_s)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the context keeps loop states and the prefix cache "
                       "holds none: snapshot a context created with keep_loop_states = 1");
    tl_context_set_length(ctx, 0);
    tl_context_trim(ctx);
    if (n == 0) return TL_OK;
    int kvd = hp->n_kv_head * hp->head_dim, d = hp->d;
    const tl_backend_ops *ops = ctx->be->ops;
    if (ctx->kv.pool) {
        tl_status st = load_pages(ctx, c, n);
        if (st != TL_OK) return st;
    }
    for (int s = 0; s < c->n_slots && !ctx->kv.pool; s++) {
        int cs = context_slot(hp, c->depth, ctx->loop_slots, s);
        size_t at = (size_t)s * c->n_tokens * kvd;
        copy_prefix_rows(ctx->ex, ops, tl_kv_keys(&ctx->kv, cs), tl_act_at(c->k, at), n, kvd);
        copy_prefix_rows(ctx->ex, ops, tl_kv_values(&ctx->kv, cs), tl_act_at(c->v, at), n, kvd);
    }
    tl_buf *const from[] = { c->warm, c->loop_e, c->loop_s };
    tl_buf *const to[] = { ctx->warm, ctx->loop_e, ctx->loop_s };
    for (int i = 0; i < 3; i++)
        if (from[i] && to[i]) copy_prefix_rows(ctx->ex, ops, tl_act_at(to[i], 0), tl_act_at(from[i], 0), n, d);
    tl_status st = ops->status(ctx->ex);
    if (st != TL_OK) return st;
    memcpy(ctx->tokens, c->tokens, n * sizeof *c->tokens);
    ctx->n_tokens = n;
    ctx->depth = c->depth;
    return TL_OK;
}

tl_status tl_prefix_cache_compute(struct tl_model *model, const int32_t *tokens, size_t n, int32_t depth,
                                  struct tl_prefix_cache **out) {
    int resolved = 0;
    tl_status st = tl_prefix_cache_resolve_depth(model, depth, &resolved);
    if (st != TL_OK) return st;
    if (n == 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "a prefix needs at least 1 token");
    if (!tokens) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tokens is NULL with n_tokens %zu", n);
    int max_seq = tl_model_max_seq(model);
    if (n > (size_t)max_seq)
        return tl_fail(TL_ERR_CONTEXT_FULL, "a prefix of %zu tokens is longer than the model's "
                       "max_seq_len %d", n, max_seq);
    struct tl_context *ctx = NULL;
    st = tl_context_open(model, (int)n, resolved, 0, &ctx);
    if (st == TL_OK) st = tl_context_eval(ctx, tokens, n, resolved, NULL);
    if (st == TL_OK) st = tl_prefix_cache_snapshot(ctx, n, out);
    tl_context_close(ctx);
    return st;
}

tl_status tl_prefix_cache_resolve_depth(const struct tl_model *m, int32_t depth, int *resolved) {
    if (m->hp.n_core == 0) {   /* no loop: depth means nothing */
        *resolved = 0;
        return TL_OK;
    }
    int d = depth ? depth : tl_model_default_depth(m);
    if (depth < 0 || d > m->hp.max_depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "depth %d is out of range [1, %d] (0 = the model's "
                       "default)", depth, m->hp.max_depth);
    *resolved = d;
    return TL_OK;
}

void tl_prefix_cache_retain(struct tl_prefix_cache *c) { __atomic_add_fetch(&c->refs, 1, __ATOMIC_RELAXED); }

void tl_prefix_cache_release(struct tl_prefix_cache *c) {
    if (c && __atomic_sub_fetch(&c->refs, 1, __ATOMIC_ACQ_REL) == 0) free_cache(c);
}

/* api_prefix.c — the prefix cache and prefix pool calls of tinyloop.h: argument and
 * struct_size checks, then prefix_cache.c / prefix_pool.c. Pool generations run on a
 * context of their own, so threads sharing one pool run at once. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi/api_structs.h"
#include "decode/generate.h"
#include "decode/prefix_pool.h"
#include "runtime/context.h"
#include "runtime/prefix_cache.h"

#define TL_PREFIX_POOL_DEFAULT_BYTES (256ull << 20)

tl_status tl_prefix_cache_create(tl_model *model, const int32_t *tokens, size_t n_tokens,
                                 int32_t depth, tl_prefix_cache **out) {
    NEED(out, "out");
    *out = NULL;
    NEED(model, "model");
    return tl_prefix_cache_compute(model, tokens, n_tokens, depth, out);
}

tl_status tl_prefix_cache_from_context(tl_context *ctx, size_t n_tokens, tl_prefix_cache **out) {
    NEED(out, "out");
    *out = NULL;
    NEED(ctx, "ctx");
    tl_status st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    if (ctx->n_tokens == 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the context's sequence is empty: no prefix to keep");
    if (n_tokens > ctx->n_tokens)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_tokens %zu is longer than the context's sequence "
                       "of %zu", n_tokens, ctx->n_tokens);
    return tl_prefix_cache_snapshot(ctx, n_tokens ? n_tokens : ctx->n_tokens, out);
}

tl_status tl_prefix_cache_free(tl_prefix_cache *cache) {
    tl_prefix_cache_release(cache);
    return TL_OK;
}

tl_status tl_prefix_cache_get_info(const tl_prefix_cache *cache, size_t *n_tokens, int32_t *depth,
                                   uint64_t *bytes) {
    NEED(cache, "cache");
    if (n_tokens) *n_tokens = cache->n_tokens;
    if (depth) *depth = cache->depth;
    if (bytes) *bytes = cache->bytes;
    return TL_OK;
}

tl_status tl_context_load_prefix(tl_context *ctx, const tl_prefix_cache *cache) {
    NEED(ctx, "ctx");
    NEED(cache, "cache");
    tl_status st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    return tl_prefix_cache_load(ctx, cache, cache->n_tokens);
}

void tl_prefix_pool_options_default(tl_prefix_pool_options *o) {
    if (!o) return;
    memset(o, 0, sizeof *o);
    o->struct_size = (uint32_t)sizeof *o;
    o->max_bytes = TL_PREFIX_POOL_DEFAULT_BYTES;
}

void tl_prefix_pool_stats_default(tl_prefix_pool_stats *s) {
    if (!s) return;
    memset(s, 0, sizeof *s);
    s->struct_size = (uint32_t)sizeof *s;
}

tl_status tl_prefix_pool_create(tl_model *model, const tl_prefix_pool_options *opts,
                                tl_prefix_pool **out) {
    NEED(out, "out");
    *out = NULL;
    NEED(model, "model");
    tl_prefix_pool_options o;
    tl_prefix_pool_options_default(&o);
    tl_status st = read_struct(&o, sizeof o, opts, sizeof o, "tl_prefix_pool_options");
    if (st != TL_OK) return st;
    if (o.register_prompts != 0 && o.register_prompts != 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "register_prompts is %d, not 0 or 1", o.register_prompts);
    return tl_pool_open(model, o.max_bytes, o.register_prompts, out);
}

tl_status tl_prefix_pool_free(tl_prefix_pool *pool) {
    tl_pool_close(pool);
    return TL_OK;
}

tl_status tl_prefix_pool_add(tl_prefix_pool *pool, const int32_t *tokens, size_t n_tokens,
                             int32_t depth, tl_prefix_cache **out) {
    if (out) *out = NULL;
    NEED(pool, "pool");
    int resolved = 0;
    tl_status st = tl_prefix_cache_resolve_depth(pool->model, depth, &resolved);
    if (st != TL_OK) return st;
    if (n_tokens > 0 && tokens) {   /* held already: no need to compute it again */
        tl_prefix_cache *held = tl_pool_find(pool, tokens, n_tokens, resolved);
        if (held) {
            if (out) *out = held;
            else tl_prefix_cache_release(held);
            return TL_OK;
        }
    }
    tl_prefix_cache *c = NULL;
    st = tl_prefix_cache_compute(pool->model, tokens, n_tokens, resolved, &c);
    if (st == TL_OK) st = tl_pool_insert(pool, c, out);
    tl_prefix_cache_release(c);
    return st;
}

tl_status tl_prefix_pool_add_cache(tl_prefix_pool *pool, tl_prefix_cache *cache) {
    NEED(pool, "pool");
    NEED(cache, "cache");
    return tl_pool_insert(pool, cache, NULL);
}

tl_status tl_prefix_pool_lookup(tl_prefix_pool *pool, const int32_t *prompt, size_t n_prompt,
                                int32_t depth, tl_prefix_cache **out, size_t *n_matched) {
    NEED(out, "out");
    *out = NULL;
    NEED(n_matched, "n_matched");
    *n_matched = 0;
    NEED(pool, "pool");
    if (n_prompt > 0 && !prompt)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt is NULL with n_prompt %zu", n_prompt);
    int resolved = 0;
    tl_status st = tl_prefix_cache_resolve_depth(pool->model, depth, &resolved);
    if (st != TL_OK) return st;
    *out = tl_pool_match(pool, prompt, n_prompt, resolved);
    *n_matched = *out ? (*out)->n_tokens : 0;
    return TL_OK;
}

tl_status tl_prefix_pool_get_stats(tl_prefix_pool *pool, tl_prefix_pool_stats *stats) {
    NEED(pool, "pool");
    NEED(stats, "stats");
    tl_status st = check_struct_size(stats, sizeof *stats, "tl_prefix_pool_stats");
    if (st != TL_OK) return st;
    tl_prefix_pool_stats full;
    tl_prefix_pool_stats_default(&full);
    tl_pool_stats(pool, &full);
    write_struct(stats, &full, sizeof full);
    return TL_OK;
}

static tl_status check_pool_arg(const tl_model *model, const tl_prefix_pool *pool) {
    NEED(model, "model");
    NEED(pool, "pool");
    if (pool->model != model)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the prefix pool belongs to another model");
    return TL_OK;
}

tl_status tl_generate_with_pool(tl_model *model, tl_prefix_pool *pool, const int32_t *prompt,
                                size_t n_prompt, const tl_generate_options *opts,
                                int32_t *out_tokens, size_t out_capacity,
                                tl_generate_result *result) {
    tl_status st = check_pool_arg(model, pool);
    if (st != TL_OK) return st;
    NEED(out_tokens, "out_tokens");
    tl_generate_options o;
    st = read_generate_options(opts, &o);
    if (st == TL_OK) st = check_result_arg(result);
    if (st != TL_OK) return st;
    tl_context *ctx = NULL;
    st = tl_context_open(model, batch_member_seq(model, n_prompt, &o, out_capacity), 0, 0, &ctx);
    if (st != TL_OK) return st;
    struct tl_stream g;
    st = tl_pool_stream_begin(pool, &g, ctx, prompt, n_prompt, &o, out_capacity, 1);
    if (st == TL_OK) {
        tl_generate_result full;
        tl_generate_result_default(&full);
        st = tl_stream_run(&g, out_tokens, NULL, NULL, &full);
        if (result) write_struct(result, &full, sizeof full);
    }
    tl_context_close(ctx);
    return st;
}

tl_status tl_stream_start_with_pool(tl_model *model, tl_prefix_pool *pool, const int32_t *prompt,
                                    size_t n_prompt, const tl_generate_options *opts, tl_stream **out) {
    NEED(out, "out");
    *out = NULL;
    tl_status st = check_pool_arg(model, pool);
    if (st != TL_OK) return st;
    tl_generate_options o;
    st = read_generate_options(opts, &o);
    if (st != TL_OK) return st;
    tl_stream *s = malloc(sizeof *s);
    if (!s) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a stream");
    tl_context *ctx = NULL;
    st = tl_context_open(model, 0, 0, 0, &ctx);
    if (st == TL_OK) st = tl_pool_stream_begin(pool, s, ctx, prompt, n_prompt, &o, SIZE_MAX, 1);
    if (st != TL_OK) {
        tl_context_close(ctx);
        free(s);
        return st;
    }
    s->owned_ctx = ctx;
    *out = s;
    return TL_OK;
}

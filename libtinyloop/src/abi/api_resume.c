/* api_resume.c — the resume handle calls of tinyloop.h: a snapshot of a sequence with its
 * kept loop states (a prefix cache, prefix_cache.h), and the generation that continues
 * its loop at a deeper depth (generate.h, tl_stream_begin_deeper) instead of a prefill. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi/api_structs.h"
#include "decode/generate.h"
#include "runtime/context.h"
#include "runtime/prefix_cache.h"

struct tl_resume_handle {
    struct tl_prefix_cache *cache;   /* tokens, K/V of every slot at its depth, kept loop states */
};

tl_status tl_resume_create(tl_context *ctx, size_t n_tokens, tl_resume_handle **out) {
    NEED(out, "out");
    *out = NULL;
    NEED(ctx, "ctx");
    tl_status st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    if (ctx->model->hp.n_core == 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "resume: the model has no loop (n_core = 0), so there is "
                                           "no deeper depth to continue at");
    if (!ctx->loop_s)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "resume: the context keeps no loop states to continue "
                       "from: create it with keep_loop_states = 1 (a generation on it then leaves a "
                       "sequence to resume)");
    if (ctx->n_tokens == 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "resume: the context's sequence is empty: nothing to resume");
    if (n_tokens > ctx->n_tokens)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "resume: n_tokens %zu is longer than the context's "
                       "sequence of %zu", n_tokens, ctx->n_tokens);
    tl_resume_handle *h = malloc(sizeof *h);
    if (!h) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a resume handle");
    st = tl_prefix_cache_snapshot(ctx, n_tokens ? n_tokens : ctx->n_tokens, &h->cache);
    if (st != TL_OK) {
        free(h);
        return st;
    }
    *out = h;
    return TL_OK;
}

tl_status tl_resume_get_info(const tl_resume_handle *h, size_t *n_tokens, int32_t *depth, uint64_t *bytes) {
    NEED(h, "handle");
    return tl_prefix_cache_get_info(h->cache, n_tokens, depth, bytes);
}

tl_status tl_resume_free(tl_resume_handle *h) {
    if (!h) return TL_OK;
    tl_prefix_cache_release(h->cache);
    free(h);
    return TL_OK;
}

/* The checks of a resume, and its depth resolved (0 = the model's default). */
static tl_status check_resume(const tl_resume_handle *h, const tl_context *ctx, int32_t depth,
                              const tl_generate_options *o, int *resolved) {
    NEED(h, "handle");
    const struct tl_model *m = h->cache->model;
    if (ctx && ctx->model != m) return tl_fail(TL_ERR_INVALID_ARGUMENT, "ctx belongs to another model than the handle");
    if (ctx && !ctx->loop_s)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "resume: ctx keeps no loop states, which the deeper pass "
                                                "continues from: create it with keep_loop_states = 1");
    int d = depth ? depth : tl_model_default_depth(m), from = h->cache->depth;
    if (depth < 0 || d > m->hp.max_depth || (ctx && d > ctx->max_depth))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "resume: depth %d is out of range [%d, %d] (0 = the model's "
                       "default)", depth, from, ctx ? ctx->max_depth : m->hp.max_depth);
    if (d < from)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "resume: depth %d is shallower than the handle's depth %d: a "
                       "resume continues the loop deeper (or at the same depth)", d, from);
    if (tl_exit_rule_active(&o->exit))
        return tl_fail(TL_ERR_UNSUPPORTED, "resume: an exit rule (opts->exit) is not supported: a resumed "
                                           "sequence runs every position at one depth");
    *resolved = d;
    return TL_OK;
}

/* ctx's sequence becomes the handle's tokens at its depth: kept in place when ctx starts
 * with them at that depth already (rows of the same tokens at the same depth hold the same
 * K/V and states), else loaded from the snapshot. */
static tl_status take_handle(tl_context *ctx, const tl_resume_handle *h) {
    const struct tl_prefix_cache *c = h->cache;
    if (ctx->n_tokens >= c->n_tokens && ctx->depth == c->depth &&
        memcmp(ctx->tokens, c->tokens, c->n_tokens * sizeof *c->tokens) == 0) {
        tl_context_set_length(ctx, c->n_tokens);
        tl_context_trim(ctx);
        return TL_OK;
    }
    return tl_prefix_cache_load(ctx, c, c->n_tokens);
}

/* Begin the resumed stream on ctx, or on a context of its own (*own) sized for it. */
static tl_status resume_begin(tl_resume_handle *h, tl_context *ctx, int32_t depth, const int32_t *prompt,
                              size_t n_prompt, const tl_generate_options *opts, size_t out_capacity,
                              struct tl_stream *g, tl_context **own) {
    *own = NULL;
    tl_generate_options o;
    tl_status st = read_generate_options(opts, &o);
    int d = 0;
    if (st == TL_OK) st = check_resume(h, ctx, depth, &o, &d);
    if (st == TL_OK && n_prompt > 0 && !prompt)
        st = tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt is NULL with n_prompt %zu", n_prompt);
    if (st == TL_OK && ctx) st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    o.depth = d;
    size_t n = h->cache->n_tokens + n_prompt;
    if (!ctx) {
        st = tl_context_open(h->cache->model, batch_member_seq(h->cache->model, n, &o, out_capacity), d, 0, own);
        if (st == TL_OK) st = tl_context_keep_loop_states(*own, NULL);
        if (st != TL_OK) {
            tl_context_close(*own);
            *own = NULL;
            return st;
        }
        ctx = *own;
    }
    st = take_handle(ctx, h);
    if (st == TL_OK) st = tl_stream_begin_deeper(g, ctx, d, prompt, n_prompt, &o, out_capacity, 1);
    if (st != TL_OK) {
        tl_context_close(*own);
        *own = NULL;
        return st;
    }
    /* the prompt of the fresh generation this one equals, of which the handle's came cached */
    g->n_prompt = (uint32_t)n;
    g->n_cached = (uint32_t)h->cache->n_tokens;
    return TL_OK;
}

tl_status tl_resume_generate(tl_resume_handle *h, tl_context *ctx, int32_t depth, const int32_t *prompt,
                             size_t n_prompt, const tl_generate_options *opts, int32_t *out_tokens,
                             size_t out_capacity, tl_generate_result *result) {
    NEED(out_tokens, "out_tokens");
    tl_status st = check_result_arg(result);
    if (st != TL_OK) return st;
    struct tl_stream g;
    tl_context *own = NULL;
    st = resume_begin(h, ctx, depth, prompt, n_prompt, opts, out_capacity, &g, &own);
    if (st != TL_OK) return st;
    tl_generate_result full;
    tl_generate_result_default(&full);
    st = tl_stream_run(&g, out_tokens, NULL, NULL, &full);
    if (result) write_struct(result, &full, sizeof full);
    tl_context_close(own);
    return st;
}

tl_status tl_resume_stream_start(tl_resume_handle *h, tl_context *ctx, int32_t depth, const int32_t *prompt,
                                 size_t n_prompt, const tl_generate_options *opts, tl_stream **out) {
    NEED(out, "out");
    *out = NULL;
    tl_stream *s = malloc(sizeof *s);
    if (!s) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a stream");
    tl_context *own = NULL;
    tl_status st = resume_begin(h, ctx, depth, prompt, n_prompt, opts, SIZE_MAX, s, &own);
    if (st != TL_OK) {
        free(s);
        return st;
    }
    s->owned_ctx = own;
    *out = s;
    return TL_OK;
}

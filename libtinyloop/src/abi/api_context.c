/* api_context.c — the tl_context calls of tinyloop.h: creating, freeing and forking a
 * context and the sequence primitives (append, deepen, batched append, truncate, reset),
 * then context.c; and the model's internal context the model-level calls run on. A
 * tl_context call runs on the caller's context and needs no lock (one context = one
 * thread at a time). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "abi/api_structs.h"
#include "base/error.h"
#include "decode/generate.h"
#include "runtime/context.h"
#include "tinyloop/tinyloop.h"

/* ---- contexts ------------------------------------------------------------------ */

tl_status tl_context_create(tl_model *model, const tl_context_options *opts, tl_context **out) {
    NEED(out, "out");
    *out = NULL;
    NEED(model, "model");
    tl_context_options o;
    tl_context_options_default(&o);
    /* a first-release struct ends before keep_loop_states */
    tl_status st = read_struct(&o, sizeof o, opts, offsetof(tl_context_options, keep_loop_states),
                               "tl_context_options");
    if (st != TL_OK) return st;
    if (o.keep_loop_states != 0 && o.keep_loop_states != 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "keep_loop_states is %d, not 0 or 1",
                       o.keep_loop_states);
    if (o.state_init < TL_STATE_INIT_DEFAULT || o.state_init > TL_STATE_INIT_WARM)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_context_options.state_init %d is not a "
                       "tl_state_init_choice (0 = the model's, 1 = the file's, 2 = warm)", o.state_init);
    tl_kv_choice model_kv = tl_model_kv_policy(model), kv;
    st = tl_kv_choice_resolve(o.kv_policy, o.kv_ring_slots, &model_kv, "tl_context_options", &kv);
    if (st != TL_OK) return st;
    tl_cache_window window = model->cache_window;
    if (o.cache_window < -1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_context_options.cache_window is %d: W >= 1 positions, "
                       "0 = the model's load option, -1 = none", o.cache_window);
    if (o.cache_window == 0 && o.cache_window_approx != 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_context_options.cache_window_approx is %d with "
                       "cache_window 0 (the model's): set cache_window too", o.cache_window_approx);
    if (o.cache_window != 0) {
        int seq = o.max_seq_len ? o.max_seq_len : tl_model_max_seq(model);
        st = tl_cache_window_resolve(o.cache_window < 0 ? 0 : o.cache_window, o.cache_window_approx,
                                     model->hp.sliding_window, seq, "tl_context_options", &window);
        if (st != TL_OK) return st;
    }
    if (window.size && o.keep_loop_states)
        return tl_fail(TL_ERR_UNSUPPORTED, "tl_context_options.keep_loop_states with cache_window %d: "
                       "deepening reruns every position, and the ring keeps only the last %d", window.size,
                       window.size);
    tl_context *ctx = NULL;
    st = tl_context_open_with(model, o.max_seq_len, o.max_depth, o.prefill_chunk, &kv, &window, &ctx);
    if (st == TL_OK) st = tl_context_set_state_init(ctx, o.state_init);
    if (st == TL_OK && o.keep_loop_states) st = tl_context_keep_loop_states(ctx, NULL);
    if (st != TL_OK) {
        tl_context_close(ctx);
        return st;
    }
    *out = ctx;
    return TL_OK;
}

tl_status tl_context_free(tl_context *ctx) {
    if (ctx && ctx->stream) tl_stream_detach(ctx->stream);
    tl_context_close(ctx);
    return TL_OK;
}

tl_status check_tokens_arg(const int32_t *tokens, size_t n, size_t min_n) {
    if (n < min_n)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_tokens is %zu, need at least %zu", n, min_n);
    if (n > 0 && !tokens)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tokens is NULL with n_tokens %zu", n);
    return TL_OK;
}

tl_status tl_context_append(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                            int32_t depth, float *last_logits) {
    NEED(ctx, "ctx");
    tl_status st = tl_context_check_free(ctx);
    if (st == TL_OK) st = check_tokens_arg(tokens, n_tokens, last_logits ? 1 : 0);
    if (st != TL_OK) return st;
    tl_forward_out out = { .last_logits = last_logits };
    return tl_context_eval(ctx, tokens, n_tokens, depth, &out);
}

tl_status tl_context_deepen(tl_context *ctx, int32_t depth, float *logprobs, float *last_logits) {
    NEED(ctx, "ctx");
    tl_status st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    if (!ctx->loop_s)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the context keeps no loop states to continue "
                                                "from: create it with keep_loop_states = 1");
    if (ctx->n_tokens == 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the sequence is empty: nothing to deepen");
    if (depth < ctx->depth || depth > ctx->max_depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "depth %d is out of range [%d, %d] (the sequence's depth, the context's "
                       "max_depth)", depth, ctx->depth, ctx->max_depth);
    tl_forward_out out = { .last_logits = last_logits };
    if (logprobs && ctx->n_tokens > 1) {
        out.targets = ctx->tokens + 1;
        out.logprobs = logprobs;
        out.n_targets = ctx->n_tokens - 1;
    }
    return tl_context_eval_deeper(ctx, depth, &out);
}

tl_status tl_context_append_batch(tl_context *const *contexts, const int32_t *tokens, size_t n,
                                  float *logits) {
    if (n == 0) return TL_OK;
    NEED(contexts, "contexts");
    NEED(tokens, "tokens");
    tl_forward_out *outs = calloc(n, sizeof *outs);
    if (!outs) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a batch of %zu", n);
    tl_status st = TL_OK;
    for (size_t i = 0; i < n && st == TL_OK; i++) {
        if (!contexts[i]) st = tl_fail(TL_ERR_INVALID_ARGUMENT, "contexts[%zu] is NULL", i);
        else st = tl_context_check_free(contexts[i]);
        if (st == TL_OK && logits) outs[i].last_logits = logits + i * (size_t)contexts[0]->model->hp.vocab;
    }
    if (st == TL_OK) st = tl_context_eval_batch(contexts, tokens, n, outs);
    free(outs);
    return st;
}

tl_status tl_context_truncate(tl_context *ctx, size_t n_keep) {
    NEED(ctx, "ctx");
    tl_status st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    if (n_keep > ctx->n_tokens)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "cannot truncate to %zu tokens: the sequence holds %zu", n_keep,
                       ctx->n_tokens);
    if (!tl_kv_cache_keeps(&ctx->kv, ctx->window.attn, n_keep))
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "cannot truncate to %zu tokens: with cache_window %d the ring of %d rows holds "
                       "positions from %d on, and the next token would see positions from %lld (reset "
                       "instead)", n_keep, ctx->window.size, ctx->kv.max_seq,
                       ctx->kv.written - ctx->kv.max_seq, (long long)n_keep - ctx->window.attn + 1);
    tl_context_set_length(ctx, n_keep);
    tl_context_trim(ctx);
    return TL_OK;
}

tl_status tl_context_reset(tl_context *ctx) {
    NEED(ctx, "ctx");
    tl_status st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    tl_context_set_length(ctx, 0);
    tl_context_trim(ctx);
    return TL_OK;
}

tl_status tl_context_length(const tl_context *ctx, size_t *n_tokens) {
    NEED(ctx, "ctx");
    NEED(n_tokens, "n_tokens");
    *n_tokens = ctx->n_tokens;
    return TL_OK;
}

tl_status tl_context_fork(const tl_context *ctx, tl_context **out) {
    NEED(out, "out");
    *out = NULL;
    NEED(ctx, "ctx");
    tl_status st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    return tl_context_clone(ctx, out);
}

/* The model's internal context, created on first use. Call with the lock held. */
tl_status default_context(tl_model *model, tl_context **out) {
    if (!model->default_ctx) {
        tl_status st = tl_context_open(model, 0, 0, 0, &model->default_ctx);
        if (st != TL_OK) return st;
    }
    tl_context_set_length(model->default_ctx, 0);
    tl_context_trim(model->default_ctx);
    *out = model->default_ctx;
    return TL_OK;
}

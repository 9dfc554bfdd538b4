/* api_generate.c — the generation calls of tinyloop.h: one-shot and callback
 * generation, pull streams (tl_stream_*), batched generation and the speculative entry
 * points, then generate.c. Model-level calls run on the model's internal context under
 * its lock. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi/api_structs.h"
#include "base/error.h"
#include "decode/generate.h"
#include "runtime/context.h"
#include "tinyloop/tinyloop.h"

/* ---- generation ------------------------------------------------------------------ */

/* The first release's sizes: the speculative fields came later. */
#define GENERATE_OPTIONS_V1_SIZE offsetof(tl_generate_options, draft_depth)
#define GENERATE_RESULT_V1_SIZE offsetof(tl_generate_result, n_drafted)

tl_status read_generate_options(const tl_generate_options *opts, tl_generate_options *o) {
    tl_generate_options_default(o);
    tl_status st = read_struct(o, sizeof *o, opts, GENERATE_OPTIONS_V1_SIZE, "tl_generate_options");
    /* draft_depth sits where the first release's struct had its tail padding: read the
     * speculative fields only from a struct that holds both */
    uint32_t size = 0;
    if (opts) memcpy(&size, opts, sizeof size);
    if (opts && size < offsetof(tl_generate_options, n_draft) + sizeof o->n_draft)
        o->draft_depth = o->n_draft = 0;
    if (opts && size < offsetof(tl_generate_options, draft_p_min) + sizeof o->draft_p_min)
        o->draft_p_min = 0.0;   /* a struct from before it: its tail padding is no value */
    if (opts && size < offsetof(tl_generate_options, tree_budget) + sizeof o->tree_budget) {
        memset(o->tree_widths, 0, sizeof o->tree_widths);   /* a struct from before trees */
        o->tree_budget = 0;
    }
    return st;
}

tl_status check_result_arg(tl_generate_result *result) {
    return result ? check_struct_size(result, GENERATE_RESULT_V1_SIZE, "tl_generate_result") : TL_OK;
}

/* One generation on ctx with the caller's structs checked and the result written back. */
static tl_status generate_on(tl_context *ctx, const int32_t *prompt, size_t n_prompt,
                             const tl_generate_options *opts, int32_t *out_tokens,
                             size_t out_capacity, tl_token_callback callback, void *user_data,
                             tl_generate_result *result) {
    tl_generate_options o;
    tl_status st = read_generate_options(opts, &o);
    if (st == TL_OK) st = check_result_arg(result);
    if (st != TL_OK) return st;
    if (out_capacity > 0 && !out_tokens && !callback)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "out_tokens is NULL with out_capacity %zu",
                       out_capacity);
    tl_generate_result full;
    tl_generate_result_default(&full);
    st = tl_generate_run(ctx, prompt, n_prompt, &o, out_tokens, out_capacity, callback, user_data,
                         &full);
    if (result) write_struct(result, &full, sizeof full);
    return st;
}

tl_status tl_context_generate(tl_context *ctx, const int32_t *prompt, size_t n_prompt,
                              const tl_generate_options *opts, int32_t *out_tokens,
                              size_t out_capacity, tl_generate_result *result) {
    NEED(ctx, "ctx");
    NEED(out_tokens, "out_tokens");
    return generate_on(ctx, prompt, n_prompt, opts, out_tokens, out_capacity, NULL, NULL, result);
}

tl_status tl_generate(tl_model *model, const int32_t *prompt, size_t n_prompt,
                      const tl_generate_options *opts, int32_t *out_tokens, size_t out_capacity,
                      tl_generate_result *result) {
    NEED(model, "model");
    NEED(out_tokens, "out_tokens");
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    tl_status st = default_context(model, &ctx);
    if (st == TL_OK)
        st = generate_on(ctx, prompt, n_prompt, opts, out_tokens, out_capacity, NULL, NULL, result);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_generate_stream(tl_model *model, const int32_t *prompt, size_t n_prompt,
                             const tl_generate_options *opts, tl_token_callback callback,
                             void *user_data, tl_generate_result *result) {
    NEED(model, "model");
    NEED(callback, "callback");
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    tl_status st = default_context(model, &ctx);
    if (st == TL_OK)
        st = generate_on(ctx, prompt, n_prompt, opts, NULL, 0, callback, user_data, result);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_stream_start(tl_model *model, tl_context *ctx, const int32_t *prompt,
                          size_t n_prompt, const tl_generate_options *opts, tl_stream **out) {
    NEED(out, "out");
    *out = NULL;
    NEED(model, "model");
    if (ctx && ctx->model != model)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "ctx belongs to a different model");
    tl_generate_options o;
    tl_status st = read_generate_options(opts, &o);
    if (st != TL_OK) return st;
    tl_stream *s = malloc(sizeof *s);
    if (!s) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a stream");
    tl_context *own = NULL;
    if (!ctx) {
        st = tl_context_open(model, 0, 0, 0, &own);
        if (st != TL_OK) {
            free(s);
            return st;
        }
    }
    st = tl_stream_begin(s, ctx ? ctx : own, prompt, n_prompt, &o, SIZE_MAX, 1);
    if (st != TL_OK) {
        tl_context_close(own);
        free(s);
        return st;
    }
    s->owned_ctx = own;
    *out = s;
    return TL_OK;
}

tl_status tl_stream_next(tl_stream *stream, int32_t *token, tl_stop_reason *stop_reason) {
    NEED(stream, "stream");
    NEED(token, "token");
    tl_stop_reason reason;
    tl_status st = tl_stream_step(stream, token, &reason);
    if (stop_reason) *stop_reason = reason;
    return st;
}

tl_status tl_stream_next_batch(tl_stream *const *streams, size_t n, int32_t *tokens,
                               tl_stop_reason *stop_reasons, tl_status *statuses) {
    if (n == 0) return TL_OK;
    NEED(streams, "streams");
    NEED(tokens, "tokens");
    NEED(stop_reasons, "stop_reasons");
    NEED(statuses, "statuses");
    struct tl_stream **gs = malloc(n * sizeof *gs);
    if (!gs) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a batch of %zu streams", n);
    tl_status st = TL_OK;
    const struct tl_model *model = NULL;   /* of the first stream that still has a context */
    for (size_t i = 0; i < n && st == TL_OK; i++) {
        if (!streams[i]) {
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "streams[%zu] is NULL", i);
            break;
        }
        gs[i] = streams[i];
        for (size_t j = 0; j < i && st == TL_OK; j++)
            if (streams[j] == streams[i]) st = tl_fail(TL_ERR_INVALID_ARGUMENT, "streams %zu and %zu are the same", j, i);
        if (st != TL_OK || !gs[i]->ctx) continue;   /* a stream whose context was freed has ended */
        if (!model) model = gs[i]->ctx->model;
        else if (gs[i]->ctx->model != model)
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "streams[%zu] belongs to another model", i);
    }
    if (st == TL_OK) tl_streams_step(gs, n, tokens, stop_reasons, statuses);
    free(gs);
    return st;
}

tl_status tl_stream_result(const tl_stream *stream, tl_generate_result *result) {
    NEED(stream, "stream");
    NEED(result, "result");
    tl_status st = check_result_arg(result);
    if (st != TL_OK) return st;
    tl_generate_result full;
    tl_generate_result_default(&full);
    tl_stream_fill_result(stream, &full);
    write_struct(result, &full, sizeof full);
    return TL_OK;
}

tl_status tl_stream_logprobs(const tl_stream *stream, float *token_logprob, int32_t *top_ids,
                             float *top_logprobs) {
    NEED(stream, "stream");
    return tl_stream_token_logprobs(stream, token_logprob, top_ids, top_logprobs);
}

tl_status tl_stream_token_depth(const tl_stream *stream, int32_t *depth) {
    NEED(stream, "stream");
    NEED(depth, "depth");
    return tl_stream_last_depth(stream, depth);
}

tl_status tl_stream_free(tl_stream *stream) {
    if (!stream) return TL_OK;
    tl_stream_end(stream);
    free(stream);
    return TL_OK;
}

/* The positions a batch member needs: its prompt and every token but the last (which
 * is never fed), within the model's limit (0 = the model's whole length). */
int batch_member_seq(const tl_model *model, size_t n_prompt, const tl_generate_options *o,
                     size_t out_capacity) {
    size_t tokens = o->max_tokens > 0 ? (size_t)o->max_tokens : 0;
    if (tokens > out_capacity) tokens = out_capacity;
    size_t need = n_prompt + (tokens > 0 ? tokens - 1 : 0);
    return need == 0 || need >= (size_t)tl_model_max_seq(model) ? 0 : (int)need;
}

/* Each prompt runs as its own sequence in a context owned by this call, sized for it;
 * after the prompts' prefills, their decode steps run together (tl_streams_step: one
 * forward pass for the sequences that step plainly). */
tl_status tl_generate_batch(tl_model *model, const int32_t *const *prompts,
                            const size_t *prompt_lengths, size_t n_prompts,
                            const tl_generate_options *opts, int32_t *const *out_tokens,
                            size_t out_capacity, tl_generate_result *results) {
    NEED(model, "model");
    if (n_prompts == 0) return TL_OK;
    NEED(prompts, "prompts");
    NEED(prompt_lengths, "prompt_lengths");
    NEED(out_tokens, "out_tokens");
    tl_generate_options o;
    tl_status st = read_generate_options(opts, &o);
    if (st == TL_OK) st = check_result_arg(results);
    if (st != TL_OK) return st;
    for (size_t i = 0; i < n_prompts; i++)
        if (!out_tokens[i]) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out_tokens[%zu] is NULL", i);
    /* the caller's array stride is its own struct size */
    uint32_t stride = 0;
    if (results) memcpy(&stride, results, sizeof stride);

    struct tl_stream *streams = calloc(n_prompts, sizeof *streams);
    struct tl_stream **live = calloc(n_prompts, sizeof *live);
    size_t *member = calloc(n_prompts, sizeof *member);
    int32_t *tokens = calloc(n_prompts, sizeof *tokens);
    tl_stop_reason *reasons = calloc(n_prompts, sizeof *reasons);
    tl_status *statuses = calloc(n_prompts, sizeof *statuses);
    if (!streams || !live || !member || !tokens || !reasons || !statuses)
        st = tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a batch of %zu generations", n_prompts);
    size_t begun = 0;
    for (; begun < n_prompts && st == TL_OK; begun++) {
        tl_context *ctx = NULL;
        st = tl_context_open(model, batch_member_seq(model, prompt_lengths[begun], &o, out_capacity), 0, 0, &ctx);
        if (st == TL_OK) {
            /* one prompt keeps a greedy stream's steps chained on the device */
            st = tl_stream_begin(&streams[begun], ctx, prompts[begun], prompt_lengths[begun], &o, out_capacity,
                                 n_prompts == 1);
            if (st == TL_OK) streams[begun].owned_ctx = ctx;
            else tl_context_close(ctx);
        }
        if (st != TL_OK) st = tl_fail(st, "prompt %zu: %s", begun, tl_last_error());
    }
    if (st != TL_OK && begun > 0) begun--;   /* the failed one holds nothing to end */
    size_t n_live = 0;
    for (size_t i = 0; st == TL_OK && i < n_prompts; i++) {
        live[n_live] = &streams[i];
        member[n_live++] = i;
    }
    while (st == TL_OK && n_live > 0) {
        tl_streams_step(live, n_live, tokens, reasons, statuses);
        size_t kept = 0;
        for (size_t j = 0; j < n_live; j++) {
            size_t i = member[j];
            if (statuses[j] != TL_OK && st == TL_OK) st = tl_fail(statuses[j], "prompt %zu: %s", i, tl_last_error());
            if (tokens[j] >= 0) out_tokens[i][streams[i].n_generated - 1] = tokens[j];
            if (!streams[i].finished) {   /* a failed stream has finished too */
                live[kept] = live[j];
                member[kept++] = i;
            }
        }
        n_live = kept;
    }
    for (size_t i = 0; i < begun; i++) {
        if (results) {
            tl_generate_result full;
            tl_generate_result_default(&full);
            tl_stream_fill_result(&streams[i], &full);
            char *r = (char *)results + i * stride;
            memcpy(r, &stride, sizeof stride);
            write_struct(r, &full, sizeof full);
        }
        tl_stream_end(&streams[i]);
    }
    free(streams);
    free(live);
    free(member);
    free(tokens);
    free(reasons);
    free(statuses);
    return st;
}

tl_status tl_generate_speculative(tl_model *model, const int32_t *prompt, size_t n_prompt,
                                  const tl_generate_options *opts, int32_t draft_depth,
                                  int32_t n_draft, int32_t *out_tokens, size_t out_capacity,
                                  tl_generate_result *result) {
    tl_generate_options o;
    tl_status st = read_generate_options(opts, &o);
    if (st != TL_OK) return st;
    if (draft_depth < 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_depth %d is out of range (at least 1)",
                       draft_depth);
    o.draft_depth = draft_depth;
    o.n_draft = n_draft;
    return tl_generate(model, prompt, n_prompt, &o, out_tokens, out_capacity, result);
}

tl_status tl_generate_tree_speculative(tl_model *model, const int32_t *prompt, size_t n_prompt,
                                       const tl_generate_options *opts, int32_t draft_depth,
                                       const int32_t *widths, size_t n_levels, int32_t budget,
                                       int32_t *out_tokens, size_t out_capacity, tl_generate_result *result) {
    tl_generate_options o;
    tl_status st = read_generate_options(opts, &o);
    if (st != TL_OK) return st;
    NEED(widths, "widths");
    if (n_levels < 1 || n_levels > TL_TREE_MAX_LEVELS)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "a token tree has %zu levels, expected 1..%d", n_levels,
                       TL_TREE_MAX_LEVELS);
    for (size_t i = 0; i < n_levels; i++)
        if (widths[i] < 1)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "widths[%zu] is %d: every level of a token tree "
                           "branches at least once", i, widths[i]);
    memset(o.tree_widths, 0, sizeof o.tree_widths);
    memcpy(o.tree_widths, widths, n_levels * sizeof *widths);
    o.draft_depth = draft_depth;
    o.tree_budget = budget;
    return tl_generate(model, prompt, n_prompt, &o, out_tokens, out_capacity, result);
}

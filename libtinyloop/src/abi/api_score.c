/* api_score.c — the scoring calls of tinyloop.h: log-probs, entropies, top log-probs,
 * last-token logits, the logit lens and consistency escalation, on a caller's context or
 * on the model's internal context under its lock. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi/api_structs.h"
#include "base/error.h"
#include "decode/escalation.h"
#include "runtime/context.h"
#include "tinyloop/tinyloop.h"

/* ---- scoring ------------------------------------------------------------------- */

static tl_status read_score_options(const tl_score_options *opts, tl_score_options *o) {
    tl_score_options_default(o);
    return read_struct(o, sizeof *o, opts, sizeof *o, "tl_score_options");
}

/* What a scoring call gives besides the log-probs, from each row's logits on the host. */
typedef struct score_extras {
    float *entropies;          /* each prediction's entropy; NULL = not asked */
    int32_t top_k;             /* each position's top_k most likely tokens; 0 = not asked */
    int32_t *top_ids;
    float *top_logprobs;
} score_extras;

/* tl_context_score and the extras (NULL = none). */
static tl_status score_on_context(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                                  const tl_score_options *opts, float *logprobs, const score_extras *x) {
    NEED(ctx, "ctx");
    static const score_extras none = { 0 };
    if (!x) x = &none;
    tl_score_options o;
    tl_status st = tl_context_check_free(ctx);
    if (st == TL_OK) st = read_score_options(opts, &o);
    if (st == TL_OK) st = check_tokens_arg(tokens, n_tokens, 1);
    if (st != TL_OK) return st;
    int V = ctx->model->hp.vocab;
    int max_k = V < TL_MAX_TOP_LOGPROBS ? V : TL_MAX_TOP_LOGPROBS;
    if (x->top_k != 0 && (x->top_k < 1 || x->top_k > max_k))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_k %d is out of range [1, %d]", x->top_k, max_k);
    if (n_tokens > 1 && !logprobs) return tl_fail(TL_ERR_INVALID_ARGUMENT, "logprobs must not be NULL");
    if (n_tokens > 1 && x->top_k && (!x->top_ids || !x->top_logprobs))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_ids and top_logprobs must not be NULL");
    st = tl_context_check_exit(ctx, &o.exit, o.given_depths, n_tokens, o.depth, "exit");
    if (st != TL_OK) return st;
    tl_forward_out out = { .targets = tokens + 1, .logprobs = logprobs, .n_targets = n_tokens - 1,
                           .entropies = x->entropies, .top_k = x->top_k, .top_ids = x->top_ids,
                           .top_logprobs = x->top_logprobs, .exit = &o.exit, .given_depths = o.given_depths,
                           .depths = o.depths, .n_depths = o.depths ? n_tokens : 0 };
    if (x->entropies || x->top_k) {
        out.host_row = malloc((size_t)V * sizeof *out.host_row);
        if (!out.host_row) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a row of %d logits", V);
    }
    st = tl_context_eval(ctx, tokens, n_tokens, o.depth, &out);
    free(out.host_row);
    return st;
}

tl_status tl_context_score(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                           const tl_score_options *opts, float *logprobs) {
    return score_on_context(ctx, tokens, n_tokens, opts, logprobs, NULL);
}

tl_status tl_context_score_top_logprobs(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                                        const tl_score_options *opts, int32_t top_k, float *logprobs,
                                        int32_t *top_ids, float *top_logprobs) {
    if (top_k == 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_k 0 is out of range [1, %d]", TL_MAX_TOP_LOGPROBS);
    score_extras x = { .top_k = top_k, .top_ids = top_ids, .top_logprobs = top_logprobs };
    return score_on_context(ctx, tokens, n_tokens, opts, logprobs, &x);
}

tl_status tl_context_score_with_uncertainty(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                                            const tl_score_options *opts, float *logprobs,
                                            float *entropies) {
    if (n_tokens > 1 && !entropies) return tl_fail(TL_ERR_INVALID_ARGUMENT, "entropies must not be NULL");
    score_extras x = { .entropies = entropies };
    return score_on_context(ctx, tokens, n_tokens, opts, logprobs, &x);
}

tl_status tl_context_score_last_token(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                                      const tl_score_options *opts, float *logits) {
    NEED(ctx, "ctx");
    NEED(logits, "logits");
    tl_score_options o;
    tl_status st = tl_context_check_free(ctx);
    if (st == TL_OK) st = read_score_options(opts, &o);
    if (st == TL_OK) st = check_tokens_arg(tokens, n_tokens, 1);
    if (st != TL_OK) return st;
    tl_forward_out out = { .last_logits = logits };
    return tl_context_eval(ctx, tokens, n_tokens, o.depth, &out);
}

tl_status tl_score(tl_model *model, const int32_t *tokens, size_t n_tokens,
                   const tl_score_options *opts, float *logprobs) {
    NEED(model, "model");
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    tl_status st = default_context(model, &ctx);
    if (st == TL_OK) st = tl_context_score(ctx, tokens, n_tokens, opts, logprobs);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_score_with_uncertainty(tl_model *model, const int32_t *tokens, size_t n_tokens,
                                    const tl_score_options *opts, float *logprobs, float *entropies) {
    NEED(model, "model");
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    tl_status st = default_context(model, &ctx);
    if (st == TL_OK) st = tl_context_score_with_uncertainty(ctx, tokens, n_tokens, opts, logprobs, entropies);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_score_top_logprobs(tl_model *model, const int32_t *tokens, size_t n_tokens,
                                const tl_score_options *opts, int32_t top_k, float *logprobs,
                                int32_t *top_ids, float *top_logprobs) {
    NEED(model, "model");
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    tl_status st = default_context(model, &ctx);
    if (st == TL_OK)
        st = tl_context_score_top_logprobs(ctx, tokens, n_tokens, opts, top_k, logprobs, top_ids,
                                           top_logprobs);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_score_last_token(tl_model *model, const int32_t *tokens, size_t n_tokens,
                              const tl_score_options *opts, float *logits) {
    NEED(model, "model");
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    tl_status st = default_context(model, &ctx);
    if (st == TL_OK) st = tl_context_score_last_token(ctx, tokens, n_tokens, opts, logits);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_score_logit_lens(tl_model *model, const int32_t *tokens, size_t n_tokens,
                              const tl_score_options *opts, int32_t max_depth,
                              float *logits_per_depth) {
    NEED(model, "model");
    NEED(logits_per_depth, "logits_per_depth");
    tl_score_options o;
    tl_status st = read_score_options(opts, &o);
    if (st == TL_OK) st = check_tokens_arg(tokens, n_tokens, 1);
    if (st != TL_OK) return st;
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    st = default_context(model, &ctx);
    if (st == TL_OK) st = tl_context_logit_lens(ctx, tokens, n_tokens, max_depth, logits_per_depth);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

tl_status tl_embed(tl_model *model, const int32_t *tokens, size_t n_tokens,
                   const tl_score_options *opts, float *embedding) {
    NEED(model, "model");
    NEED(embedding, "embedding");
    tl_score_options o;
    tl_status st = read_score_options(opts, &o);
    if (st == TL_OK) st = check_tokens_arg(tokens, n_tokens, 1);
    if (st != TL_OK) return st;
    int d = model->hp.d;
    float *row = malloc((size_t)d * sizeof *row);
    if (!row) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a row of %d floats", d);
    memset(embedding, 0, (size_t)d * sizeof *embedding);
    tl_forward_out out = { .hidden_sum = embedding, .hidden_row = row };
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    st = default_context(model, &ctx);
    if (st == TL_OK) st = tl_context_eval(ctx, tokens, n_tokens, o.depth, &out);
    pthread_mutex_unlock(&model->default_ctx_lock);
    free(row);
    if (st != TL_OK) return st;
    for (int i = 0; i < d; i++) embedding[i] /= (float)n_tokens;
    return TL_OK;
}

tl_status tl_score_with_consistency_escalation(tl_model *model, const int32_t *tokens,
                                               size_t n_tokens, const tl_escalation_options *opts,
                                               float *logprobs, float *entropies,
                                               int32_t *depth_used) {
    NEED(model, "model");
    NEED(depth_used, "depth_used");
    tl_escalation_options o;
    tl_escalation_options_default(&o);
    tl_status st = read_struct(&o, sizeof o, opts, sizeof o, "tl_escalation_options");
    if (st == TL_OK) st = check_tokens_arg(tokens, n_tokens, 1);
    if (st != TL_OK) return st;
    if (n_tokens > 1 && (!logprobs || !entropies))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "logprobs and entropies must not be NULL");
    const tl_hparams *hp = &model->hp;
    if (hp->n_core == 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "consistency escalation deepens the loop, and this "
                                           "model has no loop (n_core = 0)");
    int32_t max_depth = o.max_depth ? o.max_depth : tl_model_default_depth(model);
    if (o.max_depth < 0 || max_depth > hp->max_depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_depth %d is out of range [1, %d] (0 = the "
                                                "default depth)", o.max_depth, hp->max_depth);
    if (o.min_depth < 1 || o.min_depth > max_depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "min_depth %d is out of range [1, %d] (max_depth)",
                       o.min_depth, max_depth);
    if (!(o.max_changed >= 0.0f && o.max_changed <= 1.0f))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_changed %g is not a share in [0, 1]",
                       (double)o.max_changed);
    pthread_mutex_lock(&model->default_ctx_lock);
    tl_context *ctx = NULL;
    st = default_context(model, &ctx);
    if (st == TL_OK)   /* the tokens are checked by the first pass */
        st = tl_context_escalate(ctx, tokens, n_tokens, o.min_depth, max_depth, o.max_changed,
                                 logprobs, entropies, depth_used);
    pthread_mutex_unlock(&model->default_ctx_lock);
    return st;
}

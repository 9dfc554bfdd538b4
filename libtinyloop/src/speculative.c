/* speculative.c — self-speculative greedy decoding (docs/api.md, "Speculative decoding").
 *
 * A round starts with the context holding every generated token but the last one, p.
 * Drafts: p, then each draft token, is appended at the draft depth and its argmax is the
 * next draft token (k of them). The draft shares the context's cache: the prelude and
 * the first draft_depth loop iterations of a position are the same at any depth (every
 * iteration has its own K/V slot), so only the coda's rows are the draft's own; they
 * attend to the coda rows the full depth wrote for earlier positions. Verification:
 * the drafts' positions are dropped and p with the k drafts is evaluated at the
 * stream's depth in one pass, which overwrites every row the drafts wrote and gives the
 * greedy token after each of the k + 1 positions. The drafts agree up to the first
 * mismatch j; p and the j agreeing drafts stay in the context, and the verified tokens
 * 1..j plus the one after them are returned, the same tokens as plain greedy decoding
 * up to near-ties, which rounding may resolve differently in a many-row pass than in
 * one-row steps (other kernels on CUDA). */
#include "speculative.h"

#include <stdlib.h>

#include "error.h"

tl_status tl_speculative_begin(struct tl_stream *g, const tl_generate_options *o) {
    if (o->draft_depth == 0) return TL_OK;
    const struct tl_context *ctx = g->ctx;
    if (o->draft_depth < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_depth %d is negative (0 = no speculation)",
                       o->draft_depth);
    if (ctx->model->hp.n_core == 0)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "speculative decoding drafts at a shallower loop depth, and this model has "
                       "no loop (n_core = 0)");
    if (!g->greedy)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "speculative decoding verifies greedy tokens only: set temperature 0 and "
                       "repetition_penalty 1 (got temperature %g, repetition_penalty %g)",
                       (double)o->temperature, (double)o->repetition_penalty);
    if (o->draft_depth > g->depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "draft_depth %d is deeper than the generation's depth %d", o->draft_depth,
                       g->depth);
    if (o->n_draft < 0 || o->n_draft > TL_MAX_DRAFT)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_draft %d is out of range [0, %d] (0 = %d)",
                       o->n_draft, TL_MAX_DRAFT, TL_DEFAULT_DRAFT);
    g->draft_depth = o->draft_depth;
    g->n_draft = o->n_draft ? o->n_draft : TL_DEFAULT_DRAFT;
    g->spec_fed = malloc((size_t)(g->n_draft + 1) * sizeof *g->spec_fed);
    g->spec_ready = malloc((size_t)(g->n_draft + 1) * sizeof *g->spec_ready);
    if (!g->spec_fed || !g->spec_ready)
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate speculative decoding buffers");
    return TL_OK;
}

static tl_status round_of_drafts(struct tl_stream *g) {
    struct tl_context *ctx = g->ctx;
    size_t n = ctx->n_tokens;   /* where the pending token goes */
    /* at most as many drafts as tokens may still follow the one the round returns
     * anyway, and as positions are left after the pending token */
    size_t k = (size_t)g->n_draft;
    size_t still = g->max_tokens - g->n_generated;   /* >= 1: else the stream has stopped */
    if (k > still - 1) k = still - 1;
    if (k > (size_t)ctx->max_seq - n - 1) k = (size_t)ctx->max_seq - n - 1;
    int32_t *fed = g->spec_fed, *verified = g->spec_ready;
    fed[0] = g->generated[g->n_generated - 1];
    tl_status st = TL_OK;
    for (size_t i = 0; i < k && st == TL_OK; i++) {
        tl_forward_out out = { .last_token = &fed[i + 1] };
        st = tl_context_eval_draft(ctx, &fed[i], 1, g->draft_depth, &out);
    }
    tl_context_set_length(ctx, n);
    if (st != TL_OK) return st;
    tl_forward_out out = { .row_tokens = verified, .n_row_tokens = k + 1 };
    st = tl_context_eval(ctx, fed, k + 1, g->depth, &out);
    if (st != TL_OK) return st;
    size_t j = 0;
    while (j < k && fed[j + 1] == verified[j]) j++;
    tl_context_set_length(ctx, n + 1 + j);
    g->n_ready = j + 1;
    g->ready_at = 0;
    g->n_drafted += (uint32_t)k;
    g->n_accepted += (uint32_t)j;
    return TL_OK;
}

tl_status tl_speculative_next(struct tl_stream *g, int32_t *token) {
    if (g->ready_at == g->n_ready) {
        tl_status st = round_of_drafts(g);
        if (st != TL_OK) return st;
    }
    *token = g->spec_ready[g->ready_at++];
    return TL_OK;
}

int tl_speculative_pending(const struct tl_stream *g) { return g->ready_at == g->n_ready; }

void tl_speculative_settle(struct tl_stream *g, tl_stop_reason reason) {
    if (!g->draft_depth || !g->ctx) return;
    /* after EOS the last generated token was fed (the EOS came from it); after any
     * other stop the last one never is */
    size_t keep = g->base + g->n_generated;
    if (reason != TL_STOP_EOS && g->n_generated > 0) keep--;
    if (g->ctx->n_tokens > keep) tl_context_set_length(g->ctx, keep);
    g->n_ready = g->ready_at = 0;
}

void tl_speculative_free(struct tl_stream *g) {
    free(g->spec_fed);
    free(g->spec_ready);
    g->spec_fed = NULL;
    g->spec_ready = NULL;
}

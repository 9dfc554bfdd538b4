/* escalation.c — scoring that deepens the loop until its predictions stop changing.
 *
 * A looped model's prediction at a position settles as the loop runs longer; where it
 * has settled, more depth buys little. So a request is scored at a shallow depth and at
 * twice that depth, and goes on doubling (up to the caller's cap) while more than a
 * given share of the positions' greedy predictions still change between the two latest
 * depths. Every pass is an exact, whole-sequence pass at its depth (each loop iteration
 * has its own K/V, so nothing is mixed between depths); the scores returned are the
 * last depth's, the same numbers tl_score_with_uncertainty gives at that depth. A deeper
 * pass continues the previous one's loop states (tl_context_eval_deeper), so the prelude
 * and the loop run once in all, up to the last depth; only a warm state init, whose
 * states depend on the depth of the position before, and an approximate KV policy
 * (kv_policy.h: a pass at each depth is then that policy's), start every pass over. */
#include "decode/escalation.h"

#include <stdlib.h>

#include "base/error.h"

/* One pass at `depth`: the argmax of each of the n - 1 predictions and, when logprobs is
 * not NULL, their log-probs and entropies. `deepen`: the sequence holds the tokens at a
 * shallower depth with its loop states kept, and goes on from there; else it starts
 * from an empty sequence. */
static tl_status score_pass(struct tl_context *ctx, const int32_t *tokens, size_t n, int depth,
                            int deepen, float *logprobs, float *entropies, float *entropy_row,
                            int32_t *argmax) {
    tl_forward_out out = { .row_tokens = argmax, .n_row_tokens = n - 1 };
    if (logprobs) {
        out.targets = tokens + 1;
        out.logprobs = logprobs;
        out.n_targets = n - 1;
        out.entropies = entropies;
        out.host_row = entropy_row;
    }
    if (deepen) return tl_context_eval_deeper(ctx, depth, &out);
    tl_context_set_length(ctx, 0);
    return tl_context_eval(ctx, tokens, n, depth, &out);
}

static double share_changed(const int32_t *a, const int32_t *b, size_t count) {
    size_t changed = 0;
    for (size_t i = 0; i < count; i++) changed += a[i] != b[i];
    return (double)changed / (double)count;
}

tl_status tl_context_escalate(struct tl_context *ctx, const int32_t *tokens, size_t n,
                              int min_depth, int max_depth, float max_changed,
                              float *logprobs, float *entropies, int32_t *depth_used) {
    tl_status st = tl_context_check_tokens(ctx, tokens, n);
    if (st != TL_OK) return st;
    if (n > (size_t)ctx->max_seq)
        return tl_fail(TL_ERR_CONTEXT_FULL, "%zu tokens exceed max_seq_len %d", n, ctx->max_seq);
    if (n == 1) {   /* nothing is predicted, so nothing can change: no pass is needed */
        *depth_used = min_depth;
        return TL_OK;
    }
    size_t count = n - 1;
    float *entropy_row = malloc((size_t)ctx->model->hp.vocab * sizeof *entropy_row);
    int32_t *before = malloc(count * sizeof *before);
    int32_t *now = malloc(count * sizeof *now);
    if (!entropy_row || !before || !now)
        st = tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate escalation buffers (%zu positions)", n);
    int depth = min_depth;
    /* the first depth's scores are the answer only when it is the last one too */
    int first_is_last = min_depth == max_depth;
    /* an approximate KV policy cannot deepen (shared slots): each pass starts over */
    int resumable = !first_is_last && ctx->state_init != TL_INIT_WARM &&
                    tl_kv_is_exact(&ctx->kv_policy), added = 0;
    if (st == TL_OK && resumable) st = tl_context_keep_loop_states(ctx, &added);
    if (st == TL_OK)
        st = score_pass(ctx, tokens, n, depth, 0, first_is_last ? logprobs : NULL, entropies,
                        entropy_row, before);
    while (st == TL_OK && depth < max_depth) {
        depth = depth > max_depth / 2 ? max_depth : 2 * depth;
        st = score_pass(ctx, tokens, n, depth, resumable, logprobs, entropies, entropy_row, now);
        if (st != TL_OK) break;
        int settled = share_changed(before, now, count) <= (double)max_changed;
        int32_t *swap = before;
        before = now;
        now = swap;
        if (settled) break;
    }
    tl_context_set_length(ctx, 0);
    if (added) tl_context_drop_loop_states(ctx);
    if (st == TL_OK) *depth_used = depth;
    free(entropy_row);
    free(before);
    free(now);
    return st;
}

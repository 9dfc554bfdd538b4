/* speculative.c — self-speculative decoding (docs/api.md, "Speculative decoding").
 *
 * A round starts with the context holding every generated token but the last one, p.
 * Drafts: p, then each draft token, is appended at the draft depth and the next draft
 * token is picked from its logits (k of them). The draft shares the context's cache: the
 * prelude and the first draft_depth loop iterations of a position are the same at any
 * depth (every iteration has its own K/V slot), so only the coda's rows are the draft's
 * own; they attend to the coda rows the full depth wrote for earlier positions.
 * Verification: the drafts' positions are dropped and p with the k drafts is evaluated
 * at the stream's depth in one pass, which overwrites every row the drafts wrote from
 * iteration draft_depth + 1 on. The rows of p and of the first k - 1 drafts resume where
 * their drafts left them (each draft keeps its injection source and loop state), so
 * only the last draft runs the prelude and the first draft_depth iterations there.
 * Every row runs from the start instead with a warm state init (a draft's state then
 * follows the previous draft's, not the full depth's), on a backend that records steps,
 * and for more rows than a chunk. The first j drafts are kept; p and those j stay in the
 * context, and the j drafts plus one more token are returned.
 *
 * Greedy: a draft is its argmax, kept while it equals the full pass's argmax at the same
 * position, and the token after the kept ones is that argmax: plain greedy decoding's
 * tokens, up to near-ties, which rounding may resolve differently in a many-row pass than
 * in one-row steps (other kernels on CUDA).
 *
 * Sampling (speculative sampling): draft i is drawn from the draft depth's distribution
 * q_i (the generation's penalty, top-k, temperature, min-p and top-p applied to the
 * draft's logits) and kept with probability min(1, p_i(x) / q_i(x)), p_i the full depth's
 * distribution at the same position; the first draft refused is replaced by a draw from
 * max(0, p_i - q_i), normalised, and when all are kept one more token is drawn from p_k.
 * Every returned token is then distributed as plain sampling's (not the same tokens for
 * a seed: the draws differ). */
#include "decode/speculative.h"

#include <stdlib.h>

#include "backend/backend.h"
#include "base/error.h"
#include "decode/stream.h"
#include "decode/tree_speculative.h"
#include "runtime/context.h"

tl_status tl_speculative_begin(struct tl_stream *g, const tl_generate_options *o) {
    if (o->tree_budget != 0 && o->tree_widths[0] == 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tree_budget %d is set but tree_widths is not: the budget "
                       "bounds a tree's nodes", o->tree_budget);
    if (o->draft_depth == 0)
        return o->tree_widths[0] == 0 ? TL_OK
                                      : tl_fail(TL_ERR_INVALID_ARGUMENT, "tree_widths is set but draft_depth "
                                                "is 0: a tree is drafted at draft_depth (-1 = the model's)");
    const struct tl_context *ctx = g->ctx;
    const tl_hparams *hp = &ctx->model->hp;
    if (o->draft_depth < -1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_depth %d is out of range (-1 = the model's "
                       "draft.depth, 0 = no speculation)", o->draft_depth);
    if (hp->n_core == 0)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "speculative decoding drafts at a shallower loop depth, and this model has "
                       "no loop (n_core = 0)");
    if (!tl_kv_is_exact(&ctx->kv_policy))
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "speculative decoding needs kv_policy exact: its drafts reuse the K/V of "
                       "the first iterations, which kv_policy %s lets later iterations overwrite, "
                       "and its verification sees several new tokens in one call, unlike plain "
                       "decoding", tl_kv_policy_name(ctx->kv_policy.kind));
    int32_t depth = o->draft_depth;
    if (depth == -1) {   /* the file's choice, at most the generation's depth */
        depth = hp->draft_depth ? hp->draft_depth : 1;
        if (depth > g->depth) depth = g->depth;
    }
    if (depth > g->depth)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "draft_depth %d is deeper than the generation's depth %d", depth, g->depth);
    if (o->tree_widths[0] != 0) return tl_tree_speculative_begin(g, o, depth);
    if (o->n_draft < 0 || o->n_draft > TL_MAX_DRAFT)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_draft %d is out of range [0, %d] (0 = the "
                       "model's draft.n_draft, else %d)", o->n_draft, TL_MAX_DRAFT, TL_DEFAULT_DRAFT);
    if (!(o->draft_p_min >= 0.0 && o->draft_p_min <= 1.0))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_p_min %g is outside [0, 1] (0 = draft "
                                                "n_draft tokens every round)", o->draft_p_min);
    g->spec.draft_depth = depth;
    g->spec.n_draft = o->n_draft ? o->n_draft : hp->n_draft ? hp->n_draft : TL_DEFAULT_DRAFT;
    g->spec.draft_p_min = o->draft_p_min;
    g->spec.fed = malloc((size_t)(g->spec.n_draft + 1) * sizeof *g->spec.fed);
    g->spec.ready = malloc((size_t)(g->spec.n_draft + 1) * sizeof *g->spec.ready);
    if (!g->pick.greedy) {   /* the distributions of a round: drafts, verification rows */
        size_t V = (size_t)ctx->model->hp.vocab, k = (size_t)g->spec.n_draft;
        g->spec.q = malloc(k * V * sizeof *g->spec.q);
        g->spec.q_ids = malloc(k * V * sizeof *g->spec.q_ids);
        g->spec.q_n = malloc(k * sizeof *g->spec.q_n);
        g->spec.p = malloc(V * sizeof *g->spec.p);
        g->spec.p_ids = malloc(V * sizeof *g->spec.p_ids);
        g->spec.rows = malloc((k + 1) * V * sizeof *g->spec.rows);
        if (!g->spec.q || !g->spec.q_ids || !g->spec.q_n || !g->spec.p || !g->spec.p_ids || !g->spec.rows)
            return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate speculative sampling buffers "
                                                 "(%zu drafts x %zu tokens)", k, V);
    }
    if (!g->spec.fed || !g->spec.ready)
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate speculative decoding buffers");
    /* Resuming trades the drafted rows' first iterations in the verification for a
     * one-row pass of the last draft. That pays where rows cost compute (the CPU), not
     * where one-row steps are recorded and launch-bound (step_begin: CUDA graphs), whose
     * unrecorded extra pass costs more launches than the rows save (docs/benchmarks.md). */
    if (ctx->state_init == TL_INIT_WARM || ctx->be->ops->step_begin) return TL_OK;
    size_t floats = 2 * (size_t)g->spec.n_draft * (size_t)hp->d;
    tl_status st = ctx->be->ops->buf_alloc(ctx->be, floats, &g->spec.states);
    if (st == TL_OK) tl_context_count_buffer(g->ctx, (int64_t)(floats * sizeof(float)));
    return st;
}

/* Draft i's outputs: `out` and, when verification resumes, where its states go. */
static tl_forward_out draft_out(const struct tl_stream *g, size_t i, tl_forward_out out) {
    out.draft = 1;
    if (g->spec.states) {
        size_t d = (size_t)g->ctx->model->hp.d, k = (size_t)g->spec.n_draft;
        out.keep_e = tl_act_at(g->spec.states, i * d);
        out.keep_s = tl_act_at(g->spec.states, (k + i) * d);
    }
    return out;
}

/* The verification pass over fed[0..k] at the stream's depth. */
static tl_status verify(struct tl_stream *g, const int32_t *fed, size_t k, const tl_forward_out *out) {
    struct tl_context *ctx = g->ctx;
    /* resuming is one pass: more rows than a chunk holds go through the chunked path */
    if (!g->spec.states || k == 0 || k + 1 > (size_t)ctx->chunk_rows)
        return tl_context_eval(ctx, fed, k + 1, g->depth, out);
    size_t d = (size_t)ctx->model->hp.d;
    return tl_context_eval_resumed(ctx, fed, k + 1, g->spec.draft_depth, out,
                                   tl_act_at(g->spec.states, 0),
                                   tl_act_at(g->spec.states, (size_t)g->spec.n_draft * d));
}

/* Drafts this round: at most as many as tokens may still follow the one the round
 * returns anyway, and as positions are left after the pending token (at position n). */
static size_t drafts_this_round(const struct tl_stream *g, size_t n) {
    size_t k = (size_t)g->spec.n_draft;
    size_t still = g->max_tokens - g->n_generated;   /* >= 1: else the stream has stopped */
    if (k > still - 1) k = still - 1;
    if (k > (size_t)g->ctx->max_seq - n - 1) k = (size_t)g->ctx->max_seq - n - 1;
    /* a cache window's ring must still hold what the drafts' rows overwrite */
    if (g->ctx->window.size && k > (size_t)g->ctx->chunk_rows - 1) k = (size_t)g->ctx->chunk_rows - 1;
    return k;
}

/* The round's outcome: p and the j kept drafts stay in the context; n_ready tokens wait. */
static void end_round(struct tl_stream *g, size_t n, size_t k, size_t j) {
    tl_context_set_length(g->ctx, n + 1 + j);
    g->spec.n_ready = j + 1;
    g->spec.ready_at = 0;
    g->spec.n_drafted += (uint32_t)k;
    g->spec.n_accepted += (uint32_t)j;
}

static tl_status round_of_drafts(struct tl_stream *g) {
    struct tl_context *ctx = g->ctx;
    size_t n = ctx->n_tokens, k = drafts_this_round(g, n);
    int32_t *fed = g->spec.fed, *verified = g->spec.ready;
    fed[0] = g->generated[g->n_generated - 1];
    tl_status st = TL_OK;
    for (size_t i = 0; i < k && st == TL_OK; i++) {
        float top = 1.0f;
        tl_forward_out out = draft_out(g, i, (tl_forward_out){ .last_token = &fed[i + 1] });
        if (g->spec.draft_p_min > 0.0) {
            out.last_top_prob = &top;
            out.top_prob_row = g->pick.logits;
        }
        st = tl_context_eval_draft(ctx, &fed[i], 1, g->spec.draft_depth, &out);
        if (st == TL_OK && top < g->spec.draft_p_min) k = i;   /* an unsure draft is not proposed */
    }
    tl_context_set_length(ctx, n);
    if (st != TL_OK) return st;
    tl_forward_out out = { .row_tokens = verified, .n_row_tokens = k + 1 };
    st = verify(g, fed, k, &out);
    if (st != TL_OK) return st;
    size_t j = 0;
    while (j < k && fed[j + 1] == verified[j]) j++;
    end_round(g, n, k, j);
    return TL_OK;
}

/* The largest of a support's n probabilities. */
static double top_weight(const double *q, int n) {
    double top = 0.0;
    for (int i = 0; i < n; i++)
        if (q[i] > top) top = q[i];
    return top;
}

static tl_status round_of_samples(struct tl_stream *g) {
    struct tl_context *ctx = g->ctx;
    const size_t V = (size_t)ctx->model->hp.vocab;
    size_t n = ctx->n_tokens, k = drafts_this_round(g, n);
    int32_t *fed = g->spec.fed, *ready = g->spec.ready;
    fed[0] = g->generated[g->n_generated - 1];
    tl_sample_step step;
    tl_status st = TL_OK;
    /* the penalty's history of the position after fed[i]: the sequence, then fed[0..i] */
    for (size_t i = 0; i < k && st == TL_OK; i++) {
        tl_forward_out out = draft_out(g, i, (tl_forward_out){ .last_logits = g->pick.logits });
        st = tl_context_eval_draft(ctx, &fed[i], 1, g->spec.draft_depth, &out);
        if (st != TL_OK) break;
        double *q = g->spec.q + i * V;
        int32_t *q_ids = g->spec.q_ids + i * V;
        tl_sampler_begin_step(&g->pick.sampler, ctx->tokens, n, fed, i + 1, &step);
        int n_q = g->spec.q_n[i] = tl_sample_distribution(g->pick.logits, (int)V, &step, q_ids, q);
        /* unsure: stop before drawing; a rule on q alone keeps the draws exact */
        if (g->spec.draft_p_min > 0.0 && top_weight(q, n_q) < g->spec.draft_p_min) {
            k = i;
            break;
        }
        fed[i + 1] = tl_sample_from(q_ids, q, n_q, 1.0, step.random);
    }
    tl_context_set_length(ctx, n);
    if (st != TL_OK) return st;
    tl_forward_out out = { .row_logits = g->spec.rows, .n_row_logits = k + 1 };
    st = verify(g, fed, k, &out);
    if (st != TL_OK) return st;
    double *p = g->spec.p;
    int32_t *p_ids = g->spec.p_ids;
    size_t j = 0;
    for (;; j++) {
        tl_sampler_begin_step(&g->pick.sampler, ctx->tokens, n, fed, j + 1, &step);
        int n_p = tl_sample_distribution(g->spec.rows + j * V, (int)V, &step, p_ids, p);
        if (j == k) {   /* every draft kept: one more token from the full depth */
            ready[j] = tl_sample_from(p_ids, p, n_p, 1.0, step.random);
            break;
        }
        const double *q = g->spec.q + j * V;
        const int32_t *q_ids = g->spec.q_ids + j * V;
        int n_q = g->spec.q_n[j];
        int32_t x = fed[j + 1];
        /* kept with probability min(1, p(x) / q(x)) */
        if (tl_sampler_uniform(&g->pick.sampler) * tl_sample_probability(q_ids, q, n_q, x) < tl_sample_probability(p_ids, p, n_p, x)) {
            ready[j] = x;
            continue;
        }
        /* refused: draw from what p has beyond q */
        double total = tl_sample_residual(p, p_ids, n_p, q, q_ids, n_q);
        int32_t t = tl_sample_from(p_ids, p, n_p, total, step.random);
        ready[j] = t >= 0 ? t : x;   /* p <= q everywhere means p == q: x is never refused */
        break;
    }
    end_round(g, n, k, j);
    return TL_OK;
}

tl_status tl_speculative_next(struct tl_stream *g, int32_t *token) {
    if (g->spec.ready_at == g->spec.n_ready) {
        tl_status st = g->spec.tree ? tl_tree_speculative_round(g) : g->pick.greedy ? round_of_drafts(g) : round_of_samples(g);
        if (st != TL_OK) return st;
    }
    *token = g->spec.ready[g->spec.ready_at++];
    return TL_OK;
}

int tl_speculative_pending(const struct tl_stream *g) { return g->spec.ready_at == g->spec.n_ready; }

void tl_speculative_settle(struct tl_stream *g, tl_stop_reason reason) {
    if (!g->spec.draft_depth || !g->ctx) return;
    /* after EOS the last generated token was fed (the EOS came from it); after any
     * other stop the last one never is */
    size_t keep = g->base + g->n_generated;
    if (reason != TL_STOP_EOS && g->n_generated > 0) keep--;
    if (g->ctx->n_tokens > keep) tl_context_set_length(g->ctx, keep);
    /* rounds truncate without giving pages back (the next round writes them again);
     * at the stream's end the pages past the kept tokens go back to the pool */
    tl_context_trim(g->ctx);
    g->spec.n_ready = g->spec.ready_at = 0;
}

void tl_speculative_release_states(struct tl_stream *g) {
    if (g->spec.states && g->ctx) {
        g->ctx->be->ops->buf_free(g->spec.states);
        size_t floats = 2 * (size_t)g->spec.n_draft * (size_t)g->ctx->model->hp.d;
        tl_context_count_buffer(g->ctx, -(int64_t)(floats * sizeof(float)));
    }
    g->spec.states = NULL;
}

void tl_speculative_free(struct tl_stream *g) {
    tl_speculative_release_states(g);
    tl_tree_speculative_free(g);
    free(g->spec.fed);
    free(g->spec.ready);
    free(g->spec.q);
    free(g->spec.q_ids);
    free(g->spec.q_n);
    free(g->spec.p);
    free(g->spec.p_ids);
    free(g->spec.rows);
    g->spec.fed = NULL;
    g->spec.ready = NULL;
    g->spec.q = g->spec.p = NULL;
    g->spec.q_ids = g->spec.p_ids = NULL;
    g->spec.q_n = NULL;
    g->spec.rows = NULL;
}

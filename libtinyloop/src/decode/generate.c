/* generate.c — prompt validation, chunked prefill and the decode loop.
 *
 * A step samples from the logits of the next position, then feeds the token back
 * lazily, at the start of the following step: when generation stops, the last
 * token never costs a forward pass. So after a generation the context holds the
 * prompt and every generated token except the last one.
 *
 * Greedy decoding on a backend that chains steps on the device (backend.h) runs one
 * step ahead instead: the step that feeds token t is enqueued, its input being the
 * argmax left on the device, before t reaches the host, so that the host's
 * turnaround (reading t, recording and launching the next step) overlaps the
 * device's work. A step run ahead of a stop is undone (the context's length is set
 * back; what it wrote past that length is overwritten by later appends), so the
 * context ends as it would without running ahead.
 *
 * With draft_depth set, tokens come from speculative rounds instead (speculative.c),
 * several per forward pass at the stream's depth; the context ends as without them. */
#include "decode/generate.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/error.h"
#include "base/logprobs.h"
#include "decode/speculative.h"

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static tl_status resolve_eos(const struct tl_context *ctx, int32_t requested, int32_t *eos) {
    int32_t V = ctx->model->hp.vocab;
    if (requested == -1) {
        int32_t m = ctx->model->hp.eos_id;
        *eos = (m >= 0 && m < V) ? m : -1;
    } else if (requested == -2) {
        *eos = -1;
    } else if (requested >= 0 && requested < V) {
        *eos = requested;
    } else {
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "eos_token %d is invalid (expected a token in [0, %d), -1 = the model's, "
                       "-2 = none)", requested, V);
    }
    return TL_OK;
}

/* Check the stop sequences and keep copies (the stream may outlive the caller's
 * arrays). */
static tl_status copy_stop_sequences(struct tl_stream *g, const tl_generate_options *o) {
    if (o->n_stop_sequences == 0) return TL_OK;
    if (!o->stop_tokens || !o->stop_lengths)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "n_stop_sequences is %u but stop_tokens or stop_lengths is NULL",
                       o->n_stop_sequences);
    size_t total = 0;
    for (uint32_t j = 0; j < o->n_stop_sequences; j++) {
        if (o->stop_lengths[j] == 0)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "stop sequence %u is empty", j);
        total += o->stop_lengths[j];
    }
    tl_status st = tl_context_check_tokens(g->ctx, o->stop_tokens, total);
    if (st != TL_OK) return tl_fail(st, "stop sequences: %s", tl_error_message());
    g->stop_tokens = malloc(total * sizeof *g->stop_tokens);
    g->stop_lengths = malloc(o->n_stop_sequences * sizeof *g->stop_lengths);
    if (!g->stop_tokens || !g->stop_lengths)
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot copy %zu stop tokens", total);
    memcpy(g->stop_tokens, o->stop_tokens, total * sizeof *g->stop_tokens);
    memcpy(g->stop_lengths, o->stop_lengths, o->n_stop_sequences * sizeof *g->stop_lengths);
    g->n_stop = o->n_stop_sequences;
    return TL_OK;
}

static tl_status validate_prompt(const struct tl_context *ctx, const int32_t *prompt, size_t n) {
    if (n == 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "the prompt is empty (need at least 1 token)");
    if (!prompt) return tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt is NULL with %zu tokens", n);
    tl_status st = tl_context_check_tokens(ctx, prompt, n);
    if (st != TL_OK) return tl_fail(st, "prompt: %s", tl_error_message());
    if (n > (size_t)ctx->max_seq - ctx->n_tokens)
        return tl_fail(TL_ERR_CONTEXT_FULL,
                       "prompt of %zu tokens does not fit: the context holds %zu of max_seq_len %d",
                       n, ctx->n_tokens, ctx->max_seq);
    return TL_OK;
}

/* Check opts->logprobs / top_logprobs and allocate what keeping them needs. */
static tl_status logprobs_begin(struct tl_stream *g, const tl_generate_options *o) {
    int V = g->ctx->model->hp.vocab;
    int max_k = V < TL_MAX_TOP_LOGPROBS ? V : TL_MAX_TOP_LOGPROBS;
    if (o->logprobs != 0 && o->logprobs != 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "logprobs %d must be 0 or 1", o->logprobs);
    if (o->top_logprobs < 0 || o->top_logprobs > max_k)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_logprobs %d is out of range [0, %d]",
                       o->top_logprobs, max_k);
    if (o->top_logprobs > 0 && !o->logprobs)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_logprobs %d needs logprobs = 1", o->top_logprobs);
    if (!o->logprobs) return TL_OK;
    if (o->draft_depth != 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "logprobs with speculative decoding (draft_depth %d) "
                                           "is not supported", o->draft_depth);
    g->lp.row = malloc((size_t)V * sizeof *g->lp.row);
    if (!g->lp.row) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a row of %d logits", V);
    g->lp.on = 1;
    g->lp.top = o->top_logprobs;
    return TL_OK;
}

/* The log-probabilities of token t under the step's logits (kept in logprob_row, their
 * log-sum-exp in log_norm). */
static void keep_logprobs(struct tl_stream *g, int32_t t) {
    int V = g->ctx->model->hp.vocab;
    double lse = g->lp.log_norm;
    g->lp.token = (float)((double)g->lp.row[t] - lse);
    tl_top_logprobs(g->lp.row, V, lse, g->lp.top, g->lp.top_ids, g->lp.top_lps);
    g->lp.has = 1;
}

/* A grammar's matcher for this generation (opts->grammar). */
static tl_status grammar_begin(struct tl_stream *g, const tl_generate_options *o) {
    if (!o->grammar) return TL_OK;
    if (o->draft_depth != 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "a grammar with speculative decoding (draft_depth %d) is not "
                                           "supported", o->draft_depth);
    if (tl_grammar_vocab(o->grammar) != g->ctx->model->hp.vocab)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the grammar was compiled for a vocabulary of %d tokens, "
                       "the model has %d", tl_grammar_vocab(o->grammar), g->ctx->model->hp.vocab);
    return tl_grammar_matcher_new(o->grammar, &g->pick.grammar);
}

static int chain_available(const struct tl_context *ctx) {
    const tl_backend_ops *ops = ctx->be->ops;
    return ops->chain_available && ops->argmax_chained && ops->chained_token && ops->step_token_on_device &&
           ops->chain_available(ctx->ex);
}

/* The oldest chained token (tl_stream.queued > 0). */
static tl_status read_chained(struct tl_stream *g, int32_t *token) {
    g->queued--;
    *token = g->ctx->be->ops->chained_token(g->ctx->ex);
    if (*token >= 0) return TL_OK;
    tl_status st = g->ctx->be->ops->status(g->ctx->ex);
    return st != TL_OK ? st : tl_fail(TL_ERR_INTERNAL, "chained decode step lost its token");
}

/* At the end of a stream: read what is still queued (the backend's queue must be
 * empty for the next stream) and undo a step run ahead (forget the token it fed). */
static void undo_ahead(struct tl_stream *g) {
    int32_t t;
    while (g->queued > 0) (void)read_chained(g, &t);
    if (!g->ahead) return;
    tl_context_set_length(g->ctx, g->ctx->n_tokens - 1);
    g->ahead = 0;
}

/* What a forward pass over `tokens` must produce for the next token. The backend picks
 * it where it can, so that the logits stay where they are: its argmax when sampling is
 * greedy without a penalty, else its sample op on a step prepared here (the history
 * is the sequence including `tokens`). Both give the token tl_sampler_sample would.
 * A backend without a sample op hands back the logits instead. */
static tl_forward_out next_token_out(struct tl_stream *g, const int32_t *tokens, size_t n) {
    tl_forward_out out = { 0 };
    if (g->chained) {
        out.chain_token = 1;
    } else if (g->pick.greedy) {
        out.last_token = &g->pick.next;
    } else if (g->pick.backend_samples) {
        tl_sampler_begin_step(&g->pick.sampler, g->ctx->tokens, g->ctx->n_tokens, tokens, n, &g->pick.step);
        out.last_token = &g->pick.next;
        out.sample = &g->pick.step;
    } else {
        out.last_logits = g->pick.logits;
        if (g->lp.on) out.last_log_norm = &g->lp.log_norm;
    }
    out.exit = tl_exit_rule_active(&g->exit) ? &g->exit : NULL;
    out.last_depth = &g->pass_depth;
    return out;
}

/* tl_stream_begin, or with `deeper` > 0 tl_stream_begin_deeper's: the sequence first
 * continued to that depth from its kept loop states (the prompt may then be empty). */
static tl_status stream_begin(struct tl_stream *g, struct tl_context *ctx, int deeper, const int32_t *prompt,
                              size_t n_prompt, const tl_generate_options *o, size_t max_tokens_cap,
                              int may_chain) {
    memset(g, 0, sizeof *g);
    tl_status st = tl_context_check_free(ctx);
    if (st != TL_OK) return st;
    g->ctx = ctx;
    int depth = deeper;
    st = deeper && n_prompt == 0 ? TL_OK : validate_prompt(ctx, prompt, n_prompt);
    if (st == TL_OK && deeper && (!ctx->loop_s || ctx->n_tokens == 0 || deeper < ctx->depth ||
                                  deeper > ctx->max_depth))
        st = tl_fail(TL_ERR_INTERNAL, "a generation continued at depth %d from a sequence of %zu at depth %d",
                     deeper, ctx->n_tokens, ctx->depth);
    if (st == TL_OK && !deeper) st = tl_context_resolve_depth(ctx, o->depth, &depth);
    if (st == TL_OK && o->max_tokens < 0)
        st = tl_fail(TL_ERR_INVALID_ARGUMENT, "max_tokens %d is negative", o->max_tokens);
    if (st == TL_OK) st = resolve_eos(ctx, o->eos_token, &g->eos);
    if (st == TL_OK) st = copy_stop_sequences(g, o);
    if (st == TL_OK) st = tl_sampler_init(&g->pick.sampler, o, ctx->model->hp.vocab);
    if (st == TL_OK) st = logprobs_begin(g, o);
    if (st == TL_OK) st = tl_logit_adjust_init(&g->pick.adjust, o, ctx->model->hp.vocab);
    if (st == TL_OK && g->pick.adjust.active && o->draft_depth != 0)
        st = tl_fail(TL_ERR_UNSUPPORTED, "logit_bias and presence / frequency penalties with speculative "
                                         "decoding (draft_depth %d) are not supported", o->draft_depth);
    if (st == TL_OK) st = grammar_begin(g, o);
    if (st == TL_OK) st = tl_context_check_exit(ctx, &o->exit, NULL, 0, o->depth, "exit");
    if (st == TL_OK && tl_exit_rule_active(&o->exit) && o->draft_depth != 0)
        st = tl_fail(TL_ERR_UNSUPPORTED, "an exit rule with speculative decoding (draft_depth %d) is not "
                                         "supported: drafts and their verification run fixed depths", o->draft_depth);
    if (st != TL_OK) {
        tl_stream_end(g);
        return st;
    }
    g->depth = depth;
    g->exit = o->exit;
    g->token_depths = o->token_depths;
    /* logprobs and logit adjustments need every step's logits on the host, where the
     * token is then picked (the sampler's argmax and draws are the backend's, token for
     * token) */
    g->pick.host_picks = g->lp.on || g->pick.adjust.active || g->pick.grammar;
    g->pick.greedy = o->temperature <= 0.0f && o->repetition_penalty == 1.0f && !g->pick.host_picks;
    g->pick.backend_samples = !g->pick.greedy && !g->pick.host_picks && ctx->be->ops->sample != NULL;
    st = tl_speculative_begin(g, o);
    if (st != TL_OK) {
        tl_stream_end(g);
        return st;
    }
    /* a speculative round reads its drafts' tokens on the host */
    g->chained = may_chain && g->pick.greedy && !g->spec.draft_depth && !tl_exit_rule_active(&g->exit) &&
                 chain_available(ctx);
    /* at most one token per free position, plus the last one that is never fed */
    size_t room = (size_t)ctx->max_seq - ctx->n_tokens - n_prompt + 1;
    g->max_tokens = (size_t)o->max_tokens;
    if (g->max_tokens > max_tokens_cap) g->max_tokens = max_tokens_cap;
    size_t keep = g->max_tokens < room ? g->max_tokens : room;
    g->pick.logits = malloc((size_t)ctx->model->hp.vocab * sizeof *g->pick.logits);
    g->generated = malloc((keep ? keep : 1) * sizeof *g->generated);
    if (!g->pick.logits || !g->generated) {
        tl_stream_end(g);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate generation buffers");
    }

    double t0 = now_seconds();
    tl_forward_out out = next_token_out(g, prompt, n_prompt);
    if (deeper) {   /* the next token follows the deepened sequence, or the prompt after it */
        st = tl_context_eval_deeper(ctx, depth, n_prompt ? NULL : &out);
        if (st == TL_OK && n_prompt) st = tl_context_eval(ctx, prompt, n_prompt, depth, &out);
    } else {
        st = tl_context_eval(ctx, prompt, n_prompt, depth, &out);
    }
    g->prefill_seconds = now_seconds() - t0;
    if (st != TL_OK) {
        tl_stream_end(g);
        return st;
    }
    g->queued = g->chained;
    ctx->stream = g;
    g->depth = ctx->depth;
    if (g->chained) g->pass_depth = g->depth;   /* chained steps ask for no depth */
    g->n_prompt = (uint32_t)n_prompt;
    g->base = ctx->n_tokens;
    return TL_OK;
}

tl_status tl_stream_begin(struct tl_stream *g, struct tl_context *ctx, const int32_t *prompt,
                          size_t n_prompt, const tl_generate_options *o,
                          size_t max_tokens_cap, int may_chain) {
    return stream_begin(g, ctx, 0, prompt, n_prompt, o, max_tokens_cap, may_chain);
}

tl_status tl_stream_begin_deeper(struct tl_stream *g, struct tl_context *ctx, int depth, const int32_t *prompt,
                                 size_t n_prompt, const tl_generate_options *o, size_t max_tokens_cap,
                                 int may_chain) {
    return stream_begin(g, ctx, depth, prompt, n_prompt, o, max_tokens_cap, may_chain);
}

static void finish(struct tl_stream *g, tl_stop_reason reason) {
    undo_ahead(g);
    tl_speculative_settle(g, reason);
    g->finished = 1;
    g->stop_reason = reason;
}

static int stop_sequence_matched(const struct tl_stream *g) {
    size_t off = 0;
    for (uint32_t j = 0; j < g->n_stop; j++) {
        size_t len = g->stop_lengths[j];
        if (len <= g->n_generated &&
            memcmp(g->generated + g->n_generated - len, g->stop_tokens + off,
                   len * sizeof *g->stop_tokens) == 0)
            return 1;
        off += len;
    }
    return 0;
}

/* The stop conditions checked before a step: 1 (and *reason) when the stream is done. */
static int step_stopped(struct tl_stream *g, tl_stop_reason *reason) {
    if (!g->finished && g->n_generated >= g->max_tokens) finish(g, TL_STOP_MAX_TOKENS);
    if (!g->finished && g->has_pending && g->ctx->n_tokens >= (size_t)g->ctx->max_seq)
        finish(g, TL_STOP_CONTEXT_FULL);
    if (g->finished) *reason = g->stop_reason;
    return g->finished;
}

/* The rest of a step once its forward pass (if any) has run with status st: the token
 * (chained, sampled on the host or already picked), then EOS and the stop sequences. */
static tl_status step_finish(struct tl_stream *g, tl_status st, int verified, double t0, int32_t *token,
                             tl_stop_reason *reason) {
    g->has_pending = 0;
    int32_t t = g->pick.next;
    int host_sampled = 0;
    if (st == TL_OK && g->chained) {
        /* feed the queued token on the device now, unless it is certain to be the last */
        struct tl_context *ctx = g->ctx;
        if (g->n_generated + 1 < g->max_tokens && ctx->n_tokens < (size_t)ctx->max_seq) {
            const int32_t placeholder = 0;
            tl_forward_out out = { .token_on_device = 1, .chain_token = 1 };
            st = tl_context_eval(ctx, &placeholder, 1, g->depth, &out);
            if (st == TL_OK) {
                g->queued++;
                g->ahead = 1;
            }
        }
        tl_status read = read_chained(g, &t);
        if (st == TL_OK) st = read;
        if (g->ahead) ctx->tokens[ctx->n_tokens - 1] = t;
        if (g->n_generated == 0) {
            /* the prompt's token was not waited for in tl_stream_begin: the wait for it
             * is the prefill's, so decode_seconds counts from the first token on, as
             * without chaining */
            double now = now_seconds();
            g->prefill_seconds += now - t0;
            t0 = now;
        }
    } else if (st == TL_OK && !g->pick.greedy && !g->pick.backend_samples && !verified) {
        int V = g->ctx->model->hp.vocab;
        if (g->lp.on) memcpy(g->lp.row, g->pick.logits, (size_t)V * sizeof *g->pick.logits);
        size_t n_allowed = 1;
        if (g->pick.grammar) st = tl_grammar_mask(g->pick.grammar, g->pick.logits, g->eos, &n_allowed);
        if (st == TL_OK && n_allowed == 0) {
            g->decode_seconds += now_seconds() - t0;
            finish(g, TL_STOP_GRAMMAR);   /* no token can go on: a dead end */
            *reason = TL_STOP_GRAMMAR;
            return TL_OK;
        }
        tl_logit_adjust_apply(&g->pick.adjust, g->pick.logits);
        t = tl_sampler_sample(&g->pick.sampler, g->pick.logits, g->ctx->tokens, g->ctx->n_tokens);
        host_sampled = 1;
    }
    g->decode_seconds += now_seconds() - t0;
    if (st != TL_OK) {
        finish(g, TL_STOP_NONE);
        *reason = TL_STOP_NONE;
        return st;
    }
    if (t == g->eos) {
        finish(g, TL_STOP_EOS);
        *reason = TL_STOP_EOS;
        return TL_OK;
    }
    /* after the EOS check: EOS is never returned, so its step's are not kept */
    if (host_sampled && g->lp.on) keep_logprobs(g, t);
    if (g->token_depths) g->token_depths[g->n_generated] = g->spec.draft_depth ? g->depth : g->pass_depth;
    g->last_depth = g->spec.draft_depth ? g->depth : g->pass_depth;
    g->depth_sum += (uint64_t)g->last_depth;
    g->generated[g->n_generated++] = t;
    tl_logit_adjust_count(&g->pick.adjust, t);
    g->has_pending = g->spec.draft_depth ? tl_speculative_pending(g) : !g->ahead;
    if (g->pick.grammar) tl_grammar_accept(g->pick.grammar, t);
    if (stop_sequence_matched(g)) finish(g, TL_STOP_SEQUENCE);
    else if (g->pick.grammar && tl_grammar_complete(g->pick.grammar)) finish(g, TL_STOP_EOS);   /* as at an EOS */
    *token = t;
    *reason = TL_STOP_NONE;
    return TL_OK;
}

tl_status tl_stream_step(struct tl_stream *g, int32_t *token, tl_stop_reason *reason) {
    *token = -1;
    if (step_stopped(g, reason)) return TL_OK;
    double t0 = now_seconds();
    g->ahead = 0;   /* the stream goes on: a token fed ahead would have been fed now */
    tl_status st = TL_OK;
    int verified = 0;   /* a speculative round's token: already drawn, never sampled again */
    if (g->spec.draft_depth && (g->has_pending || g->spec.ready_at < g->spec.n_ready)) {
        st = tl_speculative_next(g, &g->pick.next);
        verified = 1;
    } else if (g->has_pending && !(g->chained && g->queued)) {
        const int32_t *pending = &g->generated[g->n_generated - 1];
        tl_forward_out out = next_token_out(g, pending, 1);
        st = tl_context_eval(g->ctx, pending, 1, g->depth, &out);
        if (st == TL_OK) g->queued += g->chained;
    }
    return step_finish(g, st, verified, t0, token, reason);
}

/* A stream whose next step is one plain forward pass of its pending token (no drafts,
 * nothing chained on the device), which a batched step can share. */
static int plain_step(const struct tl_stream *g) {
    return !g->finished && g->has_pending && !g->spec.draft_depth && !g->chained;
}

void tl_streams_step(struct tl_stream *const *gs, size_t n, int32_t *tokens, tl_stop_reason *reasons,
                     tl_status *statuses) {
    struct tl_context **ctxs = malloc(n * sizeof *ctxs);
    tl_forward_out *outs = malloc(n * sizeof *outs);
    int32_t *fed = malloc(n * sizeof *fed);
    size_t *which = malloc(n * sizeof *which);
    int batch = ctxs && outs && fed && which;   /* else every stream steps on its own */
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        struct tl_stream *g = gs[i];
        tokens[i] = -1;
        statuses[i] = TL_OK;
        if (step_stopped(g, &reasons[i])) continue;
        if (!batch || !plain_step(g)) {
            statuses[i] = tl_stream_step(g, &tokens[i], &reasons[i]);
            continue;
        }
        const int32_t *pending = &g->generated[g->n_generated - 1];
        outs[k] = next_token_out(g, pending, 1);
        ctxs[k] = g->ctx;
        fed[k] = *pending;
        which[k++] = i;
    }
    double t0 = now_seconds();
    tl_status st = tl_context_eval_batch(ctxs, fed, k, outs);
    for (size_t j = 0; j < k; j++) {
        size_t i = which[j];
        gs[i]->ahead = 0;
        statuses[i] = step_finish(gs[i], st, 0, t0, &tokens[i], &reasons[i]);
    }
    free(ctxs);
    free(outs);
    free(fed);
    free(which);
}

void tl_stream_abort(struct tl_stream *g) { finish(g, TL_STOP_ABORTED); }

void tl_stream_detach(struct tl_stream *g) {
    /* what the stream queued or ran ahead goes with the context's execution state */
    g->queued = 0;
    g->ahead = 0;
    if (!g->finished) {
        g->finished = 1;
        g->stop_reason = TL_STOP_ABORTED;
    }
    tl_speculative_release_states(g);
    g->ctx->stream = NULL;
    g->ctx = NULL;
}

void tl_stream_fill_result(const struct tl_stream *g, tl_generate_result *r) {
    r->n_tokens = (uint32_t)g->n_generated;
    r->stop_reason = g->finished ? g->stop_reason : TL_STOP_NONE;
    r->n_prompt_tokens = g->n_prompt;
    r->prefill_seconds = g->prefill_seconds;
    r->decode_seconds = g->decode_seconds;
    r->n_drafted = g->spec.n_drafted;
    r->n_accepted = g->spec.n_accepted;
    r->n_cached_tokens = g->n_cached;
    r->mean_depth = g->n_generated ? (double)g->depth_sum / (double)g->n_generated : 0.0;
}

tl_status tl_stream_last_depth(const struct tl_stream *g, int32_t *depth) {
    if (g->n_generated == 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "the stream has returned no token yet");
    *depth = g->last_depth;
    return TL_OK;
}

tl_status tl_stream_token_logprobs(const struct tl_stream *g, float *token_logprob, int32_t *top_ids,
                                   float *top_logprobs) {
    if (!g->lp.on) return tl_fail(TL_ERR_INVALID_ARGUMENT, "the stream was started without logprobs");
    if (!g->lp.has) return tl_fail(TL_ERR_INVALID_ARGUMENT, "the stream has returned no token yet");
    if (g->lp.top > 0 && (!top_ids || !top_logprobs))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_ids and top_logprobs must not be NULL "
                                                "(the stream keeps %d alternatives)", g->lp.top);
    if (token_logprob) *token_logprob = g->lp.token;
    size_t k = (size_t)g->lp.top;
    if (k > 0) {
        memcpy(top_ids, g->lp.top_ids, k * sizeof *top_ids);
        memcpy(top_logprobs, g->lp.top_lps, k * sizeof *top_logprobs);
    }
    return TL_OK;
}

void tl_stream_end(struct tl_stream *g) {
    if (g->ctx) undo_ahead(g);
    /* freed before it finished: verified tokens it holds were never returned (only a
     * stream that started owns the context; a failed begin must not trim the sequence) */
    if (g->ctx && g->ctx->stream == g && !g->finished) tl_speculative_settle(g, TL_STOP_ABORTED);
    if (g->ctx && g->ctx->stream == g) g->ctx->stream = NULL;
    tl_sampler_free(&g->pick.sampler);
    tl_logit_adjust_free(&g->pick.adjust);
    tl_grammar_matcher_free(g->pick.grammar);
    g->pick.grammar = NULL;
    tl_speculative_free(g);
    free(g->pick.logits);
    free(g->lp.row);
    free(g->generated);
    free(g->stop_tokens);
    free(g->stop_lengths);
    g->pick.logits = NULL;
    g->lp.row = NULL;
    g->generated = NULL;
    g->stop_tokens = NULL;
    g->stop_lengths = NULL;
    if (g->owned_ctx) tl_context_close(g->owned_ctx);
    g->owned_ctx = NULL;
}

tl_status tl_generate_run(struct tl_context *ctx, const int32_t *prompt, size_t n_prompt,
                          const tl_generate_options *opts, int32_t *out_tokens,
                          size_t out_capacity, tl_token_callback callback, void *user_data,
                          tl_generate_result *result) {
    struct tl_stream g;
    tl_status st = tl_stream_begin(&g, ctx, prompt, n_prompt, opts,
                                   out_tokens ? out_capacity : SIZE_MAX, 1);
    if (st != TL_OK) return st;
    return tl_stream_run(&g, out_tokens, callback, user_data, result);
}

tl_status tl_stream_run(struct tl_stream *g, int32_t *out_tokens, tl_token_callback callback,
                        void *user_data, tl_generate_result *result) {
    tl_status st = TL_OK;
    for (;;) {
        int32_t token;
        tl_stop_reason reason;
        st = tl_stream_step(g, &token, &reason);
        if (st != TL_OK || token < 0) break;
        if (out_tokens) out_tokens[g->n_generated - 1] = token;
        if (callback && callback(token, user_data) != 0) {
            tl_stream_abort(g);
            break;
        }
    }
    if (result) tl_stream_fill_result(g, result);
    tl_stream_end(g);
    return st;
}

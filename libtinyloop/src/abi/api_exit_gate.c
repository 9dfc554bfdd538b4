/* api_exit_gate.c — tl_score_exit_gate: the exit gate of a looped model (docs/model.md, "Exit
 * gate"; Ouro's early-exit gate) at every position and loop iteration, through forward
 * chunks that read the gate after each iteration (tl_forward_req.exit_gates). The runtime does
 * not exit early; these values let a caller see, or apply, the checkpoint's exit rule. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "abi/api_structs.h"
#include "runtime/context.h"
#include "runtime/forward.h"

static tl_status check_gate_model(const tl_model *m, tl_state_init init) {
    if (!m->hp.exit_gate)
        return tl_fail(TL_ERR_UNSUPPORTED, "the model has no exit gate (metadata loop.exit_gate; "
                                           "tensors exit_gate.weight / exit_gate.bias)");
    if (init == TL_INIT_WARM)
        return tl_fail(TL_ERR_UNSUPPORTED, "the exit gate is read over whole chunks, and state_init "
                                           "warm runs positions one by one");
    return TL_OK;
}

/* The gates of tokens scored from position 0 of ctx (emptied first and afterwards). */
static tl_status gates_of_sequence(tl_context *ctx, const int32_t *tokens, size_t n, int depth,
                                   float *lambda) {
    float *gates = malloc((size_t)ctx->chunk_rows * (size_t)depth * sizeof *gates);
    if (!gates) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate %d x %d gate values",
                               ctx->chunk_rows, depth);
    tl_status st = TL_OK;
    for (size_t c0 = 0; c0 < n && st == TL_OK; c0 += (size_t)ctx->chunk_rows) {
        int rows = (int)(n - c0 < (size_t)ctx->chunk_rows ? n - c0 : (size_t)ctx->chunk_rows);
        tl_forward_req req = { .rows = TL_ROWS_SEQUENCE, .tokens = tokens + c0, .n = rows, .pos0 = (int)c0,
                               .depth = depth, .start = TL_START_EMBED, .exit_gates = gates };
        st = tl_forward(ctx, &req, NULL);   /* no logits: the coda's K/V for later chunks */
        for (int r = 0; r < rows && st == TL_OK; r++)
            for (int it = 0; it < depth; it++) {
                double g = gates[(size_t)it * rows + r];
                lambda[(c0 + (size_t)r) * depth + it] = (float)(1.0 / (1.0 + exp(-g)));
            }
    }
    free(gates);
    tl_context_set_length(ctx, 0);
    tl_context_trim(ctx);
    return st;
}

tl_status tl_context_score_exit_gate(tl_context *ctx, const int32_t *tokens, size_t n_tokens,
                                     const tl_score_options *opts, float *lambda) {
    NEED(ctx, "ctx");
    NEED(lambda, "lambda");
    tl_score_options o;
    tl_score_options_default(&o);
    tl_status st = tl_context_check_free(ctx);
    if (st == TL_OK) st = read_struct(&o, sizeof o, opts, sizeof o, "tl_score_options");
    if (st == TL_OK) st = check_gate_model(ctx->model, ctx->state_init);
    if (st != TL_OK) return st;
    if (n_tokens == 0 || !tokens)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "the exit gate needs at least 1 token (tokens %s, "
                                                "n_tokens %zu)", tokens ? "given" : "NULL", n_tokens);
    st = tl_context_check_tokens(ctx, tokens, n_tokens);
    if (st != TL_OK) return st;
    if (n_tokens > (size_t)ctx->max_seq)
        return tl_fail(TL_ERR_CONTEXT_FULL, "%zu tokens exceed max_seq_len %d", n_tokens, ctx->max_seq);
    tl_context_set_length(ctx, 0);   /* a fresh sequence, so the depth is the call's */
    tl_context_trim(ctx);
    int depth = 0;
    st = tl_context_resolve_depth(ctx, o.depth, &depth);
    if (st != TL_OK) return st;
    return gates_of_sequence(ctx, tokens, n_tokens, depth, lambda);
}

tl_status tl_score_exit_gate(tl_model *model, const int32_t *tokens, size_t n_tokens,
                             const tl_score_options *opts, float *lambda) {
    NEED(model, "model");
    tl_status st = check_gate_model(model, tl_model_state_init(model, TL_STATE_INIT_DEFAULT));
    if (st != TL_OK) return st;
    if (n_tokens > (size_t)tl_model_max_seq(model))
        return tl_fail(TL_ERR_CONTEXT_FULL, "%zu tokens exceed max_seq_len %d", n_tokens,
                       tl_model_max_seq(model));
    /* a context of the call's length: the model's own one would cache its whole length */
    tl_context *ctx = NULL;
    st = tl_context_open(model, n_tokens ? (int)n_tokens : 1, 0, 0, &ctx);
    if (st == TL_OK) st = tl_context_score_exit_gate(ctx, tokens, n_tokens, opts, lambda);
    tl_context_close(ctx);
    return st;
}

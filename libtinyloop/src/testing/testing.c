/* testing.c — entry points for the test suite (testing.h). */
#include "testing/testing.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "base/error.h"
#include "cpu/kernels.h"
#include "decode/grammar.h"
#include "decode/sampling.h"
#include "runtime/context.h"

tl_status tl_testing_sample_rows(tl_context *ctx, const float *logits, int32_t n_rows,
                                 int32_t vocab, const tl_generate_options *opts,
                                 const int32_t *history, size_t n_history,
                                 uint32_t first_step, int32_t use_op, int32_t *tokens) {
    if (!ctx || !opts || (n_rows > 0 && (!logits || !tokens)) || n_rows < 0 || vocab < 1 ||
        (n_history > 0 && !history))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_testing_sample_rows: bad arguments");
    const tl_backend_ops *ops = ctx->be->ops;
    if (use_op && !ops->sample)
        return tl_fail(TL_ERR_UNSUPPORTED, "backend %s offers no sample op", ctx->be->name);
    tl_sampler s;
    tl_status st = tl_sampler_init(&s, opts, vocab);
    if (st != TL_OK) return st;
    float *row = malloc((size_t)vocab * sizeof *row);
    tl_buf *buf = NULL;
    if (!row) st = tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a row of %d logits", vocab);
    if (st == TL_OK && use_op) st = ops->buf_alloc(ctx->be, (size_t)vocab, &buf);

    tl_sample_step step;
    for (uint32_t k = 0; st == TL_OK && k < first_step; k++)   /* the earlier steps' draws */
        tl_sampler_begin_step(&s, NULL, 0, NULL, 0, &step);
    for (int32_t i = 0; st == TL_OK && i < n_rows; i++) {
        const float *src = logits + (size_t)i * (size_t)vocab;
        if (use_op) {
            tl_sampler_begin_step(&s, history, n_history, NULL, 0, &step);
            ops->upload(ctx->ex, tl_act_at(buf, 0), src, (size_t)vocab);
            tokens[i] = ops->sample(ctx->ex, tl_act_at(buf, 0), vocab, &step);
            st = ops->status(ctx->ex);
        } else {
            memcpy(row, src, (size_t)vocab * sizeof *row);
            tokens[i] = tl_sampler_sample(&s, row, history, n_history);
        }
    }
    if (buf) ops->buf_free(buf);
    free(row);
    tl_sampler_free(&s);
    return st;
}

int32_t tl_testing_cpu_level(int32_t which) {
    return (int32_t)(which ? tl_cpu_built_level() : tl_cpu_best_level());
}

tl_status tl_testing_draft_logits(tl_context *ctx, int32_t token, int32_t draft_depth,
                                  float *logits, int32_t *argmax) {
    if (!ctx || !logits || !argmax)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_testing_draft_logits: bad arguments");
    size_t n = ctx->n_tokens;
    tl_forward_out out = { .last_logits = logits, .last_token = argmax, .draft = 1 };
    tl_status st = tl_context_eval_draft(ctx, &token, 1, draft_depth, &out);
    if (st == TL_OK) st = ctx->be->ops->status(ctx->ex);
    tl_context_set_length(ctx, n);
    return st;
}

tl_status tl_testing_tree_logits(tl_context *ctx, const int32_t *tokens, const int32_t *parents,
                                 int32_t n_nodes, int32_t n_first, int32_t depth, float *logits) {
    if (!ctx || !tokens || !parents || !logits || n_nodes < 1 || n_nodes > TL_TREE_MAX_NODES ||
        n_nodes > ctx->chunk_rows || n_first < 0 || n_first > n_nodes || ctx->n_tokens == 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_testing_tree_logits: bad arguments");
    const tl_backend_ops *ops = ctx->be->ops;
    if (!ops->rope_tree || !ops->tree_attention)
        return tl_fail(TL_ERR_UNSUPPORTED, "backend %s has no tree attention", ctx->be->name);
    if (ctx->state_init == TL_INIT_WARM)
        return tl_fail(TL_ERR_UNSUPPORTED, "a token tree's rows cannot start warm (each branch has its "
                       "own previous state)");
    if (depth < (ctx->max_depth ? 1 : 0) || depth > ctx->max_depth ||
        (size_t)n_nodes > (size_t)ctx->max_seq - ctx->n_tokens)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_testing_tree_logits: depth %d or %d nodes do not fit",
                       depth, n_nodes);
    tl_status st = tl_context_check_tokens(ctx, tokens, (size_t)n_nodes);
    if (st != TL_OK) return st;
    tl_tree tree = { .n_prefix = (int)ctx->n_tokens, .n_nodes = n_nodes };
    for (int i = 0; i < n_nodes; i++) {
        int p = parents[i];
        if (p >= i || p < -1) return tl_fail(TL_ERR_INVALID_ARGUMENT, "parents[%d] = %d is not before it", i, p);
        tree.pos[i] = p < 0 ? tree.n_prefix : tree.pos[p] + 1;
        tree.visible[i] = (p < 0 ? 0 : tree.visible[p]) | (uint64_t)1 << i;
    }
    /* nodes [0, n_first) in one pass, then the rest in another, as drafting's levels go */
    int cuts[3] = { 0, n_first ? n_first : n_nodes, n_nodes };
    size_t V = (size_t)ctx->model->hp.vocab;
    for (int c = 0; c < 2 && st == TL_OK; c++) {
        int n = cuts[c + 1] - cuts[c];
        if (n == 0) continue;
        tl_forward_out out = { .row_logits = logits + (size_t)cuts[c] * V, .n_row_logits = (size_t)n };
        tl_forward_req req = { .rows = TL_ROWS_TREE, .tokens = tokens + cuts[c], .n = n, .tree = &tree,
                               .tree_first = cuts[c], .depth = depth };
        st = tl_forward(ctx, &req, &out);
    }
    return st;
}

tl_status tl_testing_grammar_masks(const tl_grammar *grammar, const int32_t *tokens, size_t n_tokens,
                                   int32_t eos, uint8_t *allowed, uint8_t *complete) {
    if (!grammar || (n_tokens && !tokens) || !allowed || !complete)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_testing_grammar_masks: bad arguments");
    size_t V = (size_t)tl_grammar_vocab(grammar);
    float *logits = malloc(V * sizeof *logits);
    tl_grammar_matcher *m = NULL;
    tl_status st = logits ? tl_grammar_matcher_new(grammar, &m)
                          : tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate %zu logits", V);
    for (size_t k = 0; st == TL_OK && k <= n_tokens; k++) {
        for (size_t t = 0; t < V; t++) logits[t] = 0.0f;
        size_t n_allowed;
        st = tl_grammar_mask(m, logits, eos, &n_allowed);
        for (size_t t = 0; t < V; t++) allowed[k * V + t] = !isinf(logits[t]);
        complete[k] = (uint8_t)tl_grammar_complete(m);
        if (k < n_tokens) tl_grammar_accept(m, tokens[k]);
    }
    tl_grammar_matcher_free(m);
    free(logits);
    return st;
}

/* tree_speculative.c — tree speculation (docs/api.md, "Tree speculation").
 *
 * A round starts as a linear one (speculative.c): the context holds every generated
 * token but the last one, p, at position n. p is the tree's root (node 0). Level by
 * level, the nodes of the newest level are run at the draft depth in one tree-masked
 * pass (forward.c, a TL_ROWS_TREE pass), and each gets as children the top widths[level]
 * tokens of its draft logits (the draft vocabulary's when the model has one), until the
 * levels or the node budget run out; the last level is never drafted from. Nodes are
 * numbered breadth first, so a node's ancestors come before it; node i's K/V sit at cache
 * row n + i, its position is n + its depth, and it attends to the prefix and its own
 * ancestors (backend.h, tl_tree). Then one pass at the stream's depth runs every node
 * (the nodes a draft pass ran resume from their states after the draft depth, whose K/V
 * are the full depth's already, as linear verification does; only the last level runs
 * the prelude and the first draft-depth iterations there):
 * the verification's argmax of node i is the full depth's next token after the path to
 * i, so walking from the root to the child whose token is that argmax, while there is
 * one, gives the longest drafted path greedy decoding agrees with, plus the argmax after
 * it. The accepted nodes' rows (every KV slot, and the kept loop states) are then moved
 * to rows n + 1, n + 2, ..., where appending those tokens one by one would have put
 * them: the verification computed exactly their linear K/V (same prefix, same ancestors,
 * same positions), so decoding goes on as after plain steps. The rows of refused nodes
 * past the kept length are overwritten by later appends.
 *
 * Greedy, the tokens are plain greedy decoding's, up to near-ties that rounding in a
 * many-row pass may resolve differently from one-row steps (as for linear drafts).
 * Sampling: a node's children are drawn independently from its draft distribution q and
 * judged by multi-candidate speculative sampling (sampled_child), so every token is
 * distributed as plain sampling's. */
#include "decode/tree_speculative.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "base/error.h"
#include "decode/stream.h"
#include "runtime/context.h"
#include "runtime/forward.h"

struct tl_tree_spec {
    int n_levels;
    int widths[TL_TREE_MAX_LEVELS];
    int budget;                              /* drafted nodes at most (root excluded) */
    double p_min;                            /* a candidate less likely than this is not drafted */
    tl_tree tree;
    int32_t tokens[TL_TREE_MAX_NODES];       /* node tokens; node 0 = the pending token */
    int parent[TL_TREE_MAX_NODES];
    int32_t verified[TL_TREE_MAX_NODES];     /* full-depth argmax after each node */
    float *rows;                             /* logits of a pass's nodes, host */
    /* sampling: each drafted-from node's draft distribution as a support (q, its ids, its
     * size; tl_sample_distribution), and a verification row's (p) */
    double *q;
    int32_t *q_ids;
    int q_n[TL_TREE_MAX_NODES];
    double *p;
    int32_t *p_ids;
};

/* The shape's full size: w1 + w1 w2 + ..., capped at the most a tree holds. */
static int shape_nodes(const int32_t *widths, int n_levels) {
    long total = 0, level = 1;
    for (int l = 0; l < n_levels; l++) {
        level *= widths[l];
        total += level;
        if (total >= TL_TREE_MAX_NODES - 1) return TL_TREE_MAX_NODES - 1;
    }
    return (int)total;
}

static tl_status check_shape(const tl_generate_options *o, int *n_levels) {
    *n_levels = 0;
    for (int l = 0; l < TL_TREE_MAX_LEVELS; l++) {
        int w = o->tree_widths[l];
        if (w < 0 || w > TL_TREE_MAX_WIDTH)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "tree_widths[%d] is %d, expected 1..%d (0 ends the tree)", l,
                           w, TL_TREE_MAX_WIDTH);
        if (w > 0 && *n_levels < l)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "tree_widths[%d] is %d after a 0 at tree_widths[%d]: "
                           "the levels end at the first 0", l, w, *n_levels);
        if (w > 0) *n_levels = l + 1;
    }
    if (o->tree_budget < 0 || o->tree_budget > TL_TREE_MAX_NODES - 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tree_budget %d is out of range [0, %d] (0 = the shape's "
                       "size)", o->tree_budget, TL_TREE_MAX_NODES - 1);
    return TL_OK;
}

tl_status tl_tree_speculative_begin(struct tl_stream *g, const tl_generate_options *o, int32_t draft_depth) {
    const struct tl_context *ctx = g->ctx;
    const tl_hparams *hp = &ctx->model->hp;
    int n_levels = 0;
    tl_status st = check_shape(o, &n_levels);
    if (st != TL_OK) return st;
    if (o->n_draft != 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_draft %d sets linear drafts; with tree_widths set the "
                       "tree's shape is tree_widths and tree_budget (leave n_draft 0)", o->n_draft);
    if (!(o->draft_p_min >= 0.0 && o->draft_p_min <= 1.0))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_p_min %g is outside [0, 1] (0 = draft every "
                       "candidate of the tree's shape)", o->draft_p_min);
    if (ctx->state_init == TL_INIT_WARM)
        return tl_fail(TL_ERR_UNSUPPORTED, "tree speculation: with state_init warm (the file's "
                       "loop.state_init or the load / context option) each position starts from the "
                       "previous one's final state, which differs per branch; use linear drafts");
    tl_status wst = tl_context_check_no_window(ctx, "tree speculation");
    if (wst != TL_OK) return wst;
    if (tl_kv_stores_h(&ctx->kv_policy))
        return tl_fail(TL_ERR_UNSUPPORTED, "tree speculation: kv_policy store_h keeps the block inputs of "
                       "the sequence's positions only, not of a tree's branches; use linear drafts or "
                       "kv_policy exact");
    const tl_backend_ops *ops = ctx->be->ops;
    if (!ops->rope_tree || !ops->tree_attention)
        return tl_fail(TL_ERR_UNSUPPORTED, "tree speculation: the %s backend has no tree attention",
                       ctx->be->name);
    if (ctx->chunk_rows < 2)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tree speculation verifies a tree in one pass, and the "
                       "context's prefill chunk is %d row", ctx->chunk_rows);
    struct tl_tree_spec *t = calloc(1, sizeof *t);
    g->spec.ready = malloc((TL_TREE_MAX_LEVELS + 1) * sizeof *g->spec.ready);
    int budget = o->tree_budget ? o->tree_budget : shape_nodes(o->tree_widths, n_levels);
    size_t V = (size_t)hp->vocab, nodes = (size_t)budget + 1;   /* a round holds at most these */
    if (t) t->rows = malloc(nodes * V * sizeof *t->rows);
    if (t && !g->pick.greedy) {
        t->q = malloc(nodes * V * sizeof *t->q);
        t->q_ids = malloc(nodes * V * sizeof *t->q_ids);
        t->p = malloc(V * sizeof *t->p);
        t->p_ids = malloc(V * sizeof *t->p_ids);
    }
    g->spec.tree = t;
    if (!t || !t->rows || !g->spec.ready || (!g->pick.greedy && (!t->q || !t->q_ids || !t->p || !t->p_ids)))
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate tree speculation buffers (%zu nodes x %zu "
                       "tokens)", nodes, V);
    t->n_levels = n_levels;
    for (int l = 0; l < n_levels; l++) t->widths[l] = o->tree_widths[l];
    t->budget = budget;
    t->p_min = o->draft_p_min;
    g->spec.draft_depth = draft_depth;
    /* The verification resumes the drafted nodes from their drafts' states (e and s after
     * the draft depth; speculative.c says why not where steps are recorded). They live in
     * g->spec.states as a linear round's, one row per node: n_draft is the node count,
     * which tl_speculative_release_states sizes them by. */
    if (ops->step_begin) return TL_OK;
    g->spec.n_draft = TL_TREE_MAX_NODES;
    size_t floats = 2 * (size_t)TL_TREE_MAX_NODES * (size_t)hp->d;
    st = ops->buf_alloc(ctx->be, floats, &g->spec.states);
    if (st == TL_OK) tl_context_count_buffer(g->ctx, (int64_t)(floats * sizeof(float)));
    return st;
}

/* The w best of `count` logits (largest first, the lower index on ties, as argmax),
 * skipping -inf; returns how many there are. */
static int top_tokens(const float *x, int count, int w, int32_t *ids) {
    int n = 0;
    for (int32_t i = 0; i < count; i++) {
        if (!(x[i] > -INFINITY)) continue;
        if (n == w && !(x[i] > x[ids[n - 1]])) continue;
        int at = n < w ? n++ : n - 1;
        while (at > 0 && x[i] > x[ids[at - 1]]) {
            ids[at] = ids[at - 1];
            at--;
        }
        ids[at] = i;
    }
    return n;
}

/* How many of the k best logits (ids, best first, of x[0..count)) have a softmax
 * probability of at least p_min (as a linear draft's top probability: in double, then
 * float). */
static int sure_candidates(const float *x, int count, const int32_t *ids, int k, double p_min) {
    if (p_min <= 0.0 || k == 0) return k;
    double max = x[ids[0]], sum = 0.0;
    for (int i = 0; i < count; i++)
        if (x[i] > -INFINITY) sum += exp((double)x[i] - max);
    int sure = 0;
    while (sure < k && (float)(exp((double)x[ids[sure]] - max) / sum) >= p_min) sure++;
    return sure;
}

/* Node `child` under `parent`, one level deeper. */
static void add_node(struct tl_tree_spec *t, int child, int parent, int32_t token) {
    tl_tree *tr = &t->tree;
    t->tokens[child] = token;
    t->parent[child] = parent;
    tr->pos[child] = tr->pos[parent] + 1;
    tr->visible[child] = tr->visible[parent] | (uint64_t)1 << child;
}

/* Node i's kept injection source (which 0) or loop state (1) in g->spec.states. */
static tl_act kept_row(const struct tl_stream *g, int which, int i) {
    size_t d = (size_t)g->ctx->model->hp.d;
    return tl_act_at(g->spec.states, ((size_t)which * TL_TREE_MAX_NODES + (size_t)i) * d);
}

/* The tokens of the path from the root to `node` into out; returns how many. */
static int path_tokens(const struct tl_tree_spec *t, int node, int32_t *out) {
    int len = 0;
    for (int at = node; at >= 0; at = t->parent[at]) len++;
    int i = len;
    for (int at = node; at >= 0; at = t->parent[at]) out[--i] = t->tokens[at];
    return len;
}

/* Starts the sampling step of the position after `node` (the penalty's history: the
 * sequence, then the path to it). */
static void begin_step_after(struct tl_stream *g, int node, tl_sample_step *step) {
    int32_t path[TL_TREE_MAX_LEVELS + 1];
    int len = path_tokens(g->spec.tree, node, path);
    tl_sampler_begin_step(&g->pick.sampler, g->ctx->tokens, g->ctx->n_tokens, path, (size_t)len, step);
}

/* Sampled drafting: node p's draft distribution q (its logits in `row`, the draft
 * vocabulary's unscattered when there is one), kept, and up to w children drawn from it
 * independently (a token may come twice: multi-candidate speculative sampling wants
 * independent draws, and the second copy is then judged against the residual). With
 * draft_p_min, no more draws than q has tokens at least that likely (none: the branch
 * ends); the count depends on q alone, so the draws stay independent draws of q. */
static int sample_children(struct tl_stream *g, int p, float *row, int w, int32_t *ids) {
    struct tl_tree_spec *t = g->spec.tree;
    const tl_draft_vocab *dv = g->ctx->model->draft.n > 0 ? &g->ctx->model->draft : NULL;
    int V = g->ctx->model->hp.vocab;
    if (dv) tl_draft_vocab_scatter(dv, row, V);
    tl_sample_step step;
    begin_step_after(g, p, &step);
    double *q = t->q + (size_t)p * V;
    int32_t *q_ids = t->q_ids + (size_t)p * V;
    int n_q = t->q_n[p] = tl_sample_distribution(row, V, &step, q_ids, q);
    if (t->p_min > 0.0) {   /* as many draws as tokens of q at least p_min likely: a rule on q alone */
        int sure = 0;
        for (int i = 0; i < n_q; i++) sure += q[i] >= t->p_min;
        if (w > sure) w = sure;
    }
    for (int c = 0; c < w; c++)
        ids[c] = tl_sample_from(q_ids, q, n_q, 1.0, c == 0 ? step.random : tl_sampler_random(&g->pick.sampler));
    return w;
}

/* Drafts the tree below the root, level by level; returns the nodes (root included) and
 * how many of them, the first ones, a draft pass ran. */
static tl_status draft_tree(struct tl_stream *g, int levels, int budget, int *n_nodes, int *n_ran) {
    struct tl_tree_spec *t = g->spec.tree;
    struct tl_context *ctx = g->ctx;
    const tl_draft_vocab *dv = ctx->model->draft.n > 0 ? &ctx->model->draft : NULL;
    int V = ctx->model->hp.vocab, n_logits = dv ? dv->n : V, count = 1, level0 = 0;
    for (int l = 0; l < levels && count <= budget; l++) {
        int level1 = count;   /* the newest level: nodes [level0, level1) */
        t->tree.n_nodes = count;
        tl_forward_out out = { .draft = 1, .row_logits = t->rows, .n_row_logits = (size_t)(level1 - level0) };
        if (g->spec.states) {
            out.keep_e = kept_row(g, 0, level0);
            out.keep_s = kept_row(g, 1, level0);
        }
        tl_forward_req req = { .rows = TL_ROWS_TREE, .tokens = t->tokens + level0, .n = level1 - level0,
                               .tree = &t->tree, .tree_first = level0, .depth = g->spec.draft_depth };
        tl_status st = tl_forward(ctx, &req, &out);
        if (st != TL_OK) return st;
        for (int p = level0; p < level1 && count <= budget; p++) {
            int32_t ids[TL_TREE_MAX_WIDTH];
            float *row = t->rows + (size_t)(p - level0) * V;
            if (!g->pick.greedy) {
                int k = sample_children(g, p, row, t->widths[l], ids);
                for (int c = 0; c < k && count <= budget; c++) add_node(t, count++, p, ids[c]);
                continue;
            }
            int k = top_tokens(row, n_logits, t->widths[l], ids);
            k = sure_candidates(row, n_logits, ids, k, t->p_min);
            /* a draft vocabulary's ids ascend, so its ties still go to the lower token id */
            for (int c = 0; c < k && count <= budget; c++) add_node(t, count++, p, dv ? dv->ids[ids[c]] : ids[c]);
        }
        level0 = level1;
    }
    *n_nodes = count;
    *n_ran = level0;
    return TL_OK;
}

/* The accepted path's nodes path[1..j] (path[0] = the root) to rows n + 1.. of every KV
 * slot and of the kept loop states; ascending, so no row is overwritten before it moves. */
static void compact_path(struct tl_context *ctx, size_t n, const int *path, int j) {
    for (int m = 1; m <= j; m++) {
        if (path[m] == m) continue;
        tl_kv_cache_move_row(&ctx->kv, ctx->ex, (int)n + path[m], (int)n + m);
        tl_buf *states[] = { ctx->loop_e, ctx->loop_s };
        size_t d = (size_t)ctx->model->hp.d;
        for (int i = 0; i < 2; i++)
            if (states[i])
                ctx->be->ops->copy_rows(ctx->ex, tl_act_at(states[i], (n + (size_t)m) * d), d,
                                        tl_act_at(states[i], (n + (size_t)path[m]) * d), d, 1, (int)d);
    }
}

/* The child of `node` whose token is the verification's argmax after it (that argmax into
 * g->spec.ready at the node's depth), or 0 when none is. */
static int greedy_child(struct tl_stream *g, int node, int n_nodes) {
    const struct tl_tree_spec *t = g->spec.tree;
    int32_t next = t->verified[node];
    g->spec.ready[t->tree.pos[node] - t->tree.n_prefix] = next;
    for (int c = node + 1; c < n_nodes; c++)
        if (t->parent[c] == node && t->tokens[c] == next) return c;
    return 0;
}

/* The child of `node` that multi-candidate speculative sampling keeps (its token into
 * g->spec.ready at the node's depth), or 0 with the token drawn there instead. With p the
 * full depth's distribution after `node` and q the draft's, the children (drawn
 * independently from q) are judged in order: x is kept with probability
 * min(1, p(x) / q(x)); a refusal replaces p by its residual max(p - q, 0), normalised,
 * against which the next child is judged; when none is kept the token is drawn from the
 * last p. Each stage is speculative sampling of its p from q, so the token is distributed
 * as the first p: plain sampling's (SpecInfer's multi-step speculative sampling). */
static int sampled_child(struct tl_stream *g, int node, int n_nodes) {
    struct tl_tree_spec *t = g->spec.tree;
    int V = g->ctx->model->hp.vocab, depth = t->tree.pos[node] - t->tree.n_prefix;
    tl_sample_step step;
    begin_step_after(g, node, &step);
    double *p = t->p;
    int32_t *p_ids = t->p_ids;
    int n_p = tl_sample_distribution(t->rows + (size_t)node * V, V, &step, p_ids, p);
    const double *q = t->q + (size_t)node * V;
    const int32_t *q_ids = t->q_ids + (size_t)node * V;
    for (int c = node + 1; c < n_nodes; c++) {
        if (t->parent[c] != node) continue;
        int32_t x = t->tokens[c];
        int n_q = t->q_n[node];
        if (tl_sampler_uniform(&g->pick.sampler) * tl_sample_probability(q_ids, q, n_q, x) <
            tl_sample_probability(p_ids, p, n_p, x)) {
            g->spec.ready[depth] = x;
            return c;
        }
        double total = tl_sample_residual(p, p_ids, n_p, q, q_ids, n_q);
        if (!(total > 0.0)) {   /* p <= q everywhere means p == q: x is never refused */
            g->spec.ready[depth] = x;
            return c;
        }
        for (int i = 0; i < n_p; i++) p[i] /= total;
    }
    g->spec.ready[depth] = tl_sample_from(p_ids, p, n_p, 1.0, step.random);
    return 0;
}

tl_status tl_tree_speculative_round(struct tl_stream *g) {
    struct tl_tree_spec *t = g->spec.tree;
    struct tl_context *ctx = g->ctx;
    size_t n = ctx->n_tokens;
    /* at most still - 1 kept drafts (the round adds one token), and rows that fit the
     * context and one pass */
    size_t still = g->max_tokens - g->n_generated;
    int levels = t->n_levels < (int)(still - 1) ? t->n_levels : (int)(still - 1);
    int budget = t->budget;
    if ((size_t)budget > (size_t)ctx->max_seq - n - 1) budget = (int)((size_t)ctx->max_seq - n - 1);
    if (budget > ctx->chunk_rows - 1) budget = ctx->chunk_rows - 1;

    t->tree.n_prefix = (int)n;
    t->tokens[0] = g->generated[g->n_generated - 1];
    t->parent[0] = -1;
    t->tree.pos[0] = (int32_t)n;
    t->tree.visible[0] = 1;
    int n_nodes = 1, n_ran = 0;
    tl_status st = draft_tree(g, levels, budget, &n_nodes, &n_ran);
    if (st != TL_OK) return st;
    t->tree.n_nodes = n_nodes;
    tl_forward_out out = { .row_tokens = t->verified, .n_row_tokens = (size_t)n_nodes };
    if (!g->pick.greedy) out = (tl_forward_out){ .row_logits = t->rows, .n_row_logits = (size_t)n_nodes };
    tl_forward_req req = { .rows = TL_ROWS_TREE, .tokens = t->tokens, .n = n_nodes, .tree = &t->tree,
                           .depth = g->depth };
    if (g->spec.states && n_ran > 0 && n_ran < n_nodes) {
        /* the drafted nodes resume where their drafts left them */
        req.start = TL_START_RESUMED;
        req.from = g->spec.draft_depth;
        req.n_resumed = n_ran;
        req.resume_e = kept_row(g, 0, 0);
        req.resume_s = kept_row(g, 1, 0);
    }
    st = tl_forward(ctx, &req, &out);
    if (st != TL_OK) return st;

    int path[TL_TREE_MAX_LEVELS + 1] = { 0 }, j = 0, node = 0, child;
    while ((child = g->pick.greedy ? greedy_child(g, node, n_nodes) : sampled_child(g, node, n_nodes)) != 0)
        path[++j] = node = child;
    compact_path(ctx, n, path, j);
    for (int m = 0; m <= j; m++) ctx->tokens[n + (size_t)m] = t->tokens[path[m]];
    tl_context_set_length(ctx, n + 1 + (size_t)j);
    g->spec.n_ready = (size_t)j + 1;
    g->spec.ready_at = 0;
    g->spec.n_drafted += (uint32_t)(n_nodes - 1);
    g->spec.n_accepted += (uint32_t)j;
    return TL_OK;
}

void tl_tree_speculative_free(struct tl_stream *g) {
    if (g->spec.tree) {
        free(g->spec.tree->rows);
        free(g->spec.tree->q);
        free(g->spec.tree->q_ids);
        free(g->spec.tree->p);
        free(g->spec.tree->p_ids);
    }
    free(g->spec.tree);
    g->spec.tree = NULL;
}

/* forward.c — the forward pass of docs/model.md for a chunk of positions, written
 * once against the backend ops (backend.h): embed, prelude, state init, the core
 * loop with the context's KV slots per iteration (kv_policy.h), coda, final norm and only the logits the
 * caller needs. */
#include "runtime/forward.h"

#include <math.h>
#include <stdlib.h>

#include "backend/backend.h"
#include "base/error.h"
#include "base/logprobs.h"
#include "model/model.h"
#include "runtime/context_state.h"
#include "runtime/exit_rule.h"
#include "runtime/kv_cache.h"

/* A batched step through the backend's row ops (backend.h: rope_store_rows,
 * attention_rows): the rows' tokens, positions and depths, padded to n_pad rows when the
 * backend records the step (padding: token 0, position -1, the last row's depth), the
 * cache slots of the layer at hand, and the greedy tokens of argmax_rows. */
typedef struct row_batch {
    int n_pad;
    int32_t *tokens, *pos, *depths, *argmax;
    tl_act *k, *v;
} row_batch;

/* Everything the helpers below share for one chunk. */
typedef struct fwd {
    struct tl_context *ctx;
    const struct tl_model *m;
    const tl_hparams *hp;
    const tl_backend_ops *ops;
    tl_exec *ex;
    int d, qd, kvd, f;
    tl_norm_params norm;
    tl_rope_params rope;
    tl_attn_geom geom;
    const tl_batch_row *batch;   /* a batched decode step: row r is one position of its own
                                    sequence (TL_ROWS_BATCH); NULL: rows are consecutive
                                    positions of ctx's sequence */
    const tl_tree *tree;         /* a token tree's nodes tree_first.. (TL_ROWS_TREE): rows
                                    at consecutive cache rows, at the tree's positions */
    int tree_first;
    const int32_t *row_depths;   /* a batched step's rows' depths, non-increasing; NULL:
                                    every row runs every iteration */
    row_batch *rows;             /* a batched step through the row ops; NULL: row by row */
    int n_real;                  /* a batched step's rows that are the batch's (the others
                                    pad it to rows->n_pad) */
    float *exit_gates;           /* tl_forward_req.exit_gates: host, depth x n; or NULL */
    tl_exit_tracker *exits;      /* adaptive depth (exit_rule.h): which rows still run; NULL =
                                    every row to the pass's depth */
    int exit_row0;               /* the tracker's row of the rows' row 0 (warm: one at a time) */
    float *exit_host;            /* host scratch of the rules: states, probe logits */
} fwd;

/* A KV slot by what it caches; its index depends on the context (its KV policy maps
 * iterations to loop slots; the coda's slots sit after them). */
typedef enum { SLOT_PRE, SLOT_CORE, SLOT_POST } slot_kind;
typedef struct slot_id {
    slot_kind kind;
    int block, iteration;   /* iteration: SLOT_CORE only (1-based) */
} slot_id;

static int slot_index(const fwd *F, const struct tl_context *ctx, slot_id id) {
    switch (id.kind) {
    case SLOT_PRE: return tl_kv_slot_pre(F->hp, id.block);
    case SLOT_CORE: return tl_kv_slot_core(F->hp, ctx->loop_slots, id.iteration, id.block);
    case SLOT_POST: break;
    }
    return tl_kv_slot_post(F->hp, ctx->loop_slots, id.block);
}

static tl_act buf0(tl_buf *b) { return tl_act_at(b, 0); }

/* ys[j] = W_j . in (accumulate: ys[j] += W_j . in; then n_w is 1 and y is n rows of
 * d floats). The backend's fused form when it offers one, else norm or gated
 * activation into scratch, the matmul, and the residual add from `tmp`. */
static void matmul_in(const fwd *F, const tl_tensor *const *ws, int n_w, const tl_matmul_in *in,
                      int n, const tl_act *ys, const size_t *ldys, int accumulate) {
    if (F->ops->matmul_in && F->ops->matmul_in(F->ex, ws, n_w, in, n, ys, ldys, accumulate)) return;
    tl_act x = in->x;
    size_t ldx = in->ldx;
    if (in->kind == TL_MATMUL_IN_NORM) {
        x = buf0(F->ctx->xn);
        ldx = (size_t)F->d;
        F->ops->norm(F->ex, in->norm, in->norm_params, in->x, n, F->d, x);
    } else if (in->kind == TL_MATMUL_IN_GATED) {
        F->ops->gated_act(F->ex, in->x, in->up, (size_t)n * F->f, in->act);
    }
    if (!accumulate) {
        F->ops->matmul_multi(F->ex, ws, n_w, x, ldx, n, ys, ldys);
        return;
    }
    tl_act tmp = buf0(F->ctx->tmp);
    F->ops->matmul(F->ex, ws[0], x, ldx, n, tmp, F->d);
    F->ops->add(F->ex, ys[0], tmp, (size_t)n * F->d);
}

static tl_matmul_in normed(const fwd *F, const tl_norm_weights *w, tl_act x) {
    tl_matmul_in in = { .kind = TL_MATMUL_IN_NORM, .x = x, .ldx = (size_t)F->d, .norm = w,
                        .norm_params = &F->norm };
    return in;
}

/* The head's input rows: Norm(final_norm, x), or x itself when the model has no final
 * norm (arch.final_norm 0). */
static tl_matmul_in head_in(const fwd *F, tl_act x) {
    if (F->hp->final_norm) return normed(F, &F->m->final_norm, x);
    tl_matmul_in in = { .kind = TL_MATMUL_IN_ROWS, .x = x, .ldx = (size_t)F->d };
    return in;
}

/* q, k_new, v_new = Wq N1 x, Wk N1 x, Wv N1 x (+ biases) for n rows; without q (q.buf
 * NULL) only the keys and values. */
static void qkv_rows(const fwd *F, const tl_block_weights *w, const tl_matmul_in *in, int n, tl_act q,
                     tl_act k_new, tl_act v_new) {
    const tl_tensor *ws[3] = { &w->wq, &w->wk, &w->wv };
    tl_act ys[3] = { q, k_new, v_new };
    size_t lds[3] = { (size_t)F->qd, (size_t)F->kvd, (size_t)F->kvd };
    int skip = q.buf == NULL;
    matmul_in(F, ws + skip, 3 - skip, in, n, ys + skip, lds + skip, 0);
    if (F->hp->qkv_bias) {
        if (!skip) F->ops->add_bias(F->ex, q, n, F->qd, &w->bq);
        F->ops->add_bias(F->ex, k_new, n, F->kvd, &w->bk);
        F->ops->add_bias(F->ex, v_new, n, F->kvd, &w->bv);
    }
}

/* RoPE on n rows of q and k_new at pos0.., then their keys and values into the cache
 * rows pos0.. of the slot whose row 0 is k_cache / v_cache. */
static void rope_and_store(const fwd *F, tl_act q, tl_act k_new, tl_act v_new, int n, int pos0,
                           tl_act k_cache, tl_act v_cache) {
    if (F->ops->rope_store &&
        F->ops->rope_store(F->ex, q, k_new, v_new, n, pos0, &F->rope, &F->geom, k_cache, v_cache))
        return;
    F->ops->rope(F->ex, q, n, F->hp->n_head, F->hp->head_dim, pos0, &F->rope);
    F->ops->rope(F->ex, k_new, n, F->hp->n_kv_head, F->hp->head_dim, pos0, &F->rope);
    F->ops->kv_store(F->ex, k_cache, v_cache, k_new, v_new, n, pos0, F->kvd);
}

/* kv_policy store_h (docs/model.md, "The store_h KV policy"): row 0 of the kept inputs of
 * core block id.block at iteration id.iteration in c's sequence. */
static tl_act block_inputs(const fwd *F, const struct tl_context *c, slot_id id) {
    size_t layer = (size_t)(id.iteration - 1) * F->hp->n_core + id.block;
    return tl_act_add(buf0(c->block_in), layer * c->max_seq * F->d);
}

/* kv_policy store_h, before core block `slot` attends for rows x[0..n) at positions pos0..
 * of c's sequence: keep the rows' inputs, and recompute the keys and values of positions
 * [0, pos0) (those in the window) from theirs into the block's one slot, as their own
 * pass computed them (N1, Wk / Wv, biases, RoPE at their positions); the rows' own K/V go
 * there next. Runs in the executing context's scratch rows (xn, kv_new), chunk_rows at a
 * time. */
static void store_h_prepare(const fwd *F, const struct tl_context *c, const tl_block_weights *w, slot_id slot,
                            tl_act x, int n, int pos0) {
    tl_act kept = block_inputs(F, c, slot);
    F->ops->copy_rows(F->ex, tl_act_add(kept, (size_t)pos0 * F->d), F->d, x, F->d, n, F->d);
    int index = slot_index(F, c, slot), step = F->ctx->chunk_rows;
    tl_act k_cache = tl_kv_keys(&c->kv, index), v_cache = tl_kv_values(&c->kv, index);
    tl_act k_new = buf0(F->ctx->kv_new), v_new = tl_act_add(k_new, (size_t)step * F->kvd), none = { 0 };
    /* a window W: the rows attend to positions > pos0 - W only */
    int window = F->hp->sliding_window, first = window > 0 && pos0 + 1 - window > 0 ? pos0 + 1 - window : 0;
    for (int p0 = first; p0 < pos0; p0 += step) {
        int rows = pos0 - p0 < step ? pos0 - p0 : step;
        tl_matmul_in in = normed(F, &w->attn_norm, tl_act_add(kept, (size_t)p0 * F->d));
        qkv_rows(F, w, &in, rows, none, k_new, v_new);
        F->ops->rope(F->ex, k_new, rows, F->hp->n_kv_head, F->hp->head_dim, p0, &F->rope);
        F->ops->kv_store(F->ex, k_cache, v_cache, k_new, v_new, rows, p0, F->kvd);
    }
}

/* out (+)= Wo . att for n rows. */
static void output_projection(const fwd *F, const tl_block_weights *w, tl_act att, int n, tl_act out,
                              int accumulate) {
    const tl_tensor *wo = &w->wo;
    tl_matmul_in o_in = { .kind = TL_MATMUL_IN_ROWS, .x = att, .ldx = (size_t)F->qd };
    size_t ld_out = (size_t)F->d;
    matmul_in(F, &wo, 1, &o_in, n, &out, &ld_out, accumulate);
}

/* out (+)= Wo . attention(RoPE(Wq N1 x), RoPE(Wk N1 x), Wv N1 x) for n rows at pos0;
 * the new keys and values go to the cache rows of `slot` through kv_store (or the
 * fused rope_store / matmul_rope_store), which take the slot's row 0 and pos0, so no
 * op is given an address that depends on the position (see step_begin). In a batched
 * step the projections run on every row at once, and RoPE, the store and attention
 * through the backend's row ops (each row in its own sequence's cache) or row by row. */
static void attention(const fwd *F, const tl_block_weights *w, slot_id slot, tl_act x, int n, int pos0,
                      tl_act out, int accumulate) {
    tl_act q = buf0(F->ctx->q), att = buf0(F->ctx->att);
    tl_act k_new = buf0(F->ctx->kv_new);
    tl_act v_new = tl_act_add(k_new, (size_t)F->ctx->chunk_rows * F->kvd);
    tl_matmul_in in = normed(F, &w->attn_norm, x);

    if (F->batch) {
        /* before the rows' K/V use kv_new; n: a run of an adaptive step's rows (rows_from) */
        for (int r = 0; slot.kind == SLOT_CORE && r < n && r < F->n_real; r++)
            if (F->batch[r].ctx->block_in)
                store_h_prepare(F, F->batch[r].ctx, w, slot, tl_act_add(x, (size_t)r * F->d), 1, F->batch[r].pos);
        qkv_rows(F, w, &in, n, q, k_new, v_new);
        if (F->rows) {   /* every row's slot of this layer, then one op for all rows */
            for (int r = 0; r < n; r++) {
                tl_act none = { 0 };
                const struct tl_context *row_ctx = r < F->n_real ? F->batch[r].ctx : NULL;
                int index = row_ctx ? slot_index(F, row_ctx, slot) : 0;
                F->rows->k[r] = row_ctx ? tl_kv_keys(&row_ctx->kv, index) : none;
                F->rows->v[r] = row_ctx ? tl_kv_values(&row_ctx->kv, index) : none;
            }
            F->ops->rope_store_rows(F->ex, q, k_new, v_new, n, F->rows->pos, &F->rope, &F->geom, F->rows->k,
                                    F->rows->v);
            F->ops->attention_rows(F->ex, q, n, F->rows->pos, F->rows->k, F->rows->v, &F->geom, att);
            output_projection(F, w, att, n, out, accumulate);
            return;
        }
        for (int r = 0; r < n; r++) {
            const struct tl_context *row_ctx = F->batch[r].ctx;
            int index = slot_index(F, row_ctx, slot), pos = F->batch[r].pos;
            tl_act k_cache = tl_kv_keys(&row_ctx->kv, index), v_cache = tl_kv_values(&row_ctx->kv, index);
            tl_act q_row = tl_act_add(q, (size_t)r * F->qd);
            rope_and_store(F, q_row, tl_act_add(k_new, (size_t)r * F->kvd), tl_act_add(v_new, (size_t)r * F->kvd),
                           1, pos, k_cache, v_cache);
            F->ops->attention(F->ex, q_row, 1, pos, k_cache, v_cache, &F->geom,
                              tl_act_add(att, (size_t)r * F->qd));
        }
        output_projection(F, w, att, n, out, accumulate);
        return;
    }
    if (slot.kind == SLOT_CORE && F->ctx->block_in) store_h_prepare(F, F->ctx, w, slot, x, n, pos0);
    const tl_kv_cache *kv = &F->ctx->kv;
    int index = slot_index(F, F->ctx, slot);
    tl_act k_cache = tl_kv_keys(kv, index), v_cache = tl_kv_values(kv, index);
    if (F->tree) {   /* RoPE at the nodes' positions, attention along their paths */
        qkv_rows(F, w, &in, n, q, k_new, v_new);
        F->ops->rope_tree(F->ex, q, n, F->hp->n_head, F->hp->head_dim, F->tree, F->tree_first, &F->rope);
        F->ops->rope_tree(F->ex, k_new, n, F->hp->n_kv_head, F->hp->head_dim, F->tree, F->tree_first, &F->rope);
        F->ops->kv_store(F->ex, k_cache, v_cache, k_new, v_new, n, pos0, F->kvd);
        F->ops->tree_attention(F->ex, q, n, F->tree, F->tree_first, k_cache, v_cache, &F->geom, att);
        output_projection(F, w, att, n, out, accumulate);
        return;
    }
    const tl_tensor *ws[3] = { &w->wq, &w->wk, &w->wv };
    if (F->hp->qkv_bias || !F->ops->matmul_rope_store ||
        !F->ops->matmul_rope_store(F->ex, ws, &in, n, q, pos0, &F->rope, &F->geom, k_cache, v_cache)) {
        qkv_rows(F, w, &in, n, q, k_new, v_new);
        rope_and_store(F, q, k_new, v_new, n, pos0, k_cache, v_cache);
    }
    F->ops->attention(F->ex, q, n, pos0, k_cache, v_cache, &F->geom, att);
    output_projection(F, w, att, n, out, accumulate);
}

/* out (+)= W_down (act(W_gate N x) * W_up N x), N the block's mlp_norm */
static void mlp(const fwd *F, const tl_block_weights *w, tl_act x, int n, tl_act out, int accumulate) {
    tl_act gate = buf0(F->ctx->gate), up = buf0(F->ctx->up);
    tl_matmul_in in = normed(F, &w->mlp_norm, x);
    const tl_tensor *wd = &w->w_down;
    size_t ld_out = (size_t)F->d;
    if (F->ops->matmul_gated &&
        F->ops->matmul_gated(F->ex, &w->w_gate, &w->w_up, &in, n, F->hp->activation, gate, (size_t)F->f)) {
        tl_matmul_in down_in = { .kind = TL_MATMUL_IN_ROWS, .x = gate, .ldx = (size_t)F->f };
        matmul_in(F, &wd, 1, &down_in, n, &out, &ld_out, accumulate);
        return;
    }
    const tl_tensor *ws[2] = { &w->w_gate, &w->w_up };
    tl_act ys[2] = { gate, up };
    size_t lds[2] = { (size_t)F->f, (size_t)F->f };
    matmul_in(F, ws, 2, &in, n, ys, lds, 0);
    tl_matmul_in down_in = { .kind = TL_MATMUL_IN_GATED, .x = gate, .ldx = (size_t)F->f, .up = up,
                             .ld_up = (size_t)F->f, .act = F->hp->activation };
    matmul_in(F, &wd, 1, &down_in, n, &out, &ld_out, accumulate);
}

/* One block on rows x[0..n). The three placements share their shape:
 *   pre:             x += A(N1 x);        x += M(mlp_norm x)
 *   sandwich_outer:  x = N2(x + A(N1 x)); x = N4(x + M(N3 x))
 *   sandwich_branch: x += N2(A(N1 x));    x += N4(M(N3 x))
 * (N2 of pre and N3 of the sandwiches are both the tensor mlp_norm). With `pre` the
 * branches accumulate into x directly. */
static void block(const fwd *F, const tl_block_weights *w, slot_id slot, tl_act x, int n, int pos0) {
    tl_norm_placement place = F->hp->norm_placement;
    tl_act tmp = buf0(F->ctx->tmp);
    size_t count = (size_t)n * F->d;

    if (place == TL_NORM_PRE) {
        attention(F, w, slot, x, n, pos0, x, 1);
        mlp(F, w, x, n, x, 1);
        return;
    }
    attention(F, w, slot, x, n, pos0, tmp, 0);
    if (place == TL_NORM_SANDWICH_BRANCH) F->ops->norm(F->ex, &w->attn_post_norm, &F->norm, tmp, n, F->d, tmp);
    F->ops->add(F->ex, x, tmp, count);
    if (place == TL_NORM_SANDWICH_OUTER) F->ops->norm(F->ex, &w->attn_post_norm, &F->norm, x, n, F->d, x);

    mlp(F, w, x, n, tmp, 0);
    if (place == TL_NORM_SANDWICH_BRANCH) F->ops->norm(F->ex, &w->mlp_post_norm, &F->norm, tmp, n, F->d, tmp);
    F->ops->add(F->ex, x, tmp, count);
    if (place == TL_NORM_SANDWICH_OUTER) F->ops->norm(F->ex, &w->mlp_post_norm, &F->norm, x, n, F->d, x);
}

/* u = inject(s, e) in place on s. */
static void inject(const fwd *F, tl_act s, tl_act e, int n) {
    const struct tl_model *m = F->m;
    switch (F->hp->injection) {
    case TL_INJECT_NONE:
        break;
    case TL_INJECT_ADD:
        F->ops->add(F->ex, s, e, (size_t)n * F->d);
        break;
    case TL_INJECT_CONCAT: {
        tl_act cat = buf0(F->ctx->cat);
        size_t ld = 2 * (size_t)F->d;
        F->ops->copy_rows(F->ex, cat, ld, s, F->d, n, F->d);
        F->ops->copy_rows(F->ex, tl_act_add(cat, F->d), ld, e, F->d, n, F->d);
        F->ops->matmul(F->ex, &m->inject_w, cat, ld, n, s, F->d);
        if (m->inject_b.data) F->ops->add_bias(F->ex, s, n, F->d, &m->inject_b);
        break;
    }
    }
}

/* Loop iteration `it` (1-based) of the shared core on state rows s[0..n) with sources
 * e[0..n); its K/V go to the iteration's slots (its own when exact). */
static void core_iteration(const fwd *F, tl_act s, tl_act e, int n, int pos0, int it) {
    inject(F, s, e, n);
    for (int c = 0; c < F->hp->n_core; c++)
        block(F, &F->m->core[c], (slot_id){ SLOT_CORE, c, it }, s, n, pos0);
    if (F->hp->loop_norm) F->ops->norm(F->ex, &F->m->loop_norm, &F->norm, s, n, F->d, s);
}

/* Rows [0, n) still in the loop at iteration `it`: those whose depth reaches it. */
static int rows_in_iteration(const fwd *F, int n, int it) {
    if (!F->row_depths) return n;
    while (n > 0 && F->row_depths[n - 1] < it) n--;
    return n;
}

/* The exit gate's logits of state rows s[0..n) to the host at dst (tmp is free between
 * blocks). */
static void exit_gate_logits(const fwd *F, tl_act s, int n, float *dst) {
    tl_act g = buf0(F->ctx->tmp);
    F->ops->matmul(F->ex, &F->m->exit_gate_w, s, F->d, n, g, 1);
    F->ops->add_bias(F->ex, g, n, 1, &F->m->exit_gate_b);
    F->ops->download(F->ex, dst, g, (size_t)n);
}

static void coda_rows(const fwd *F, tl_act x, int n, int pos0);

/* Rows a.. of a pass as a pass of their own (a batch's rows carry their sequences). */
static fwd rows_from(const fwd *F, int a) {
    fwd R = *F;
    if (R.batch) R.batch += a;
    return R;
}

/* The next-token logits of state rows s[a, a + count) at their iteration, for the exit
 * rules that compare distributions: the coda and the head on the rows (the draft head
 * when the model has one), their states put back after. The coda writes its K/V slots at
 * the rows' positions; the pass's own coda rewrites them. host: count x (d + vocab). */
static void probe_logits(const fwd *F, tl_act s, int a, int count, int pos0, float *states, float *logits) {
    const tl_draft_vocab *dv = F->m->draft.n > 0 ? &F->m->draft : NULL;
    const tl_tensor *head = dv ? &dv->head : &F->m->output;
    int V = dv ? dv->n : F->hp->vocab;
    size_t ld = (size_t)V;
    tl_act rows = tl_act_add(s, (size_t)a * F->d), out = buf0(F->ctx->logits);
    fwd R = rows_from(F, a);
    F->ops->download(F->ex, states, rows, (size_t)count * F->d);
    coda_rows(&R, rows, count, pos0 + a);
    for (int r0 = 0; r0 < count; r0 += F->ctx->logit_rows) {
        int k = count - r0 < F->ctx->logit_rows ? count - r0 : F->ctx->logit_rows;
        tl_matmul_in in = head_in(F, tl_act_add(rows, (size_t)r0 * F->d));
        matmul_in(F, &head, 1, &in, k, &out, &ld, 0);
        F->ops->download(F->ex, logits + (size_t)r0 * V, out, (size_t)k * V);
    }
    F->ops->upload(F->ex, rows, states, (size_t)count * F->d);
}

/* Row r (of the pass) stopped after iteration `it`: its K/V of that iteration fills the
 * slots of the iterations up to `limit` that it skips, in every core block. */
static void fill_skipped(const fwd *F, int r, int pos, int it, int limit) {
    struct tl_context *c = F->batch ? F->batch[r].ctx : F->ctx;
    for (int b = 0; c->block_in && b < F->hp->n_core; b++) {   /* store_h: the input stands in */
        tl_act src = tl_act_add(block_inputs(F, c, (slot_id){ SLOT_CORE, b, it }), (size_t)pos * F->d);
        for (int later = it + 1; later <= limit; later++)
            F->ops->copy_rows(F->ex, tl_act_add(block_inputs(F, c, (slot_id){ SLOT_CORE, b, later }),
                                                (size_t)pos * F->d), F->d, src, F->d, 1, F->d);
    }
    for (int b = 0; !c->block_in && b < F->hp->n_core; b++) {
        int src = slot_index(F, c, (slot_id){ SLOT_CORE, b, it });
        for (int later = it + 1; later <= limit; later++) {
            int dst = slot_index(F, c, (slot_id){ SLOT_CORE, b, later });
            if (dst != src)
                F->ops->kv_copy(F->ex, tl_kv_keys(&c->kv, dst), tl_kv_values(&c->kv, dst), tl_kv_keys(&c->kv, src),
                                tl_kv_values(&c->kv, src), pos, F->kvd);
        }
    }
}

/* Rows [lo, hi) of [0, n) that are maximal runs where want(t, row0 + r, it) holds. */
typedef int (*row_test)(const tl_exit_tracker *t, int r, int it);
static int next_run(const tl_exit_tracker *t, int row0, int n, int it, row_test want, int from, int *hi) {
    int lo = from;
    while (lo < n && !want(t, row0 + lo, it)) lo++;
    int end = lo;
    while (end < n && want(t, row0 + end, it)) end++;
    *hi = end;
    return lo;
}

static int is_running(const tl_exit_tracker *t, int r, int it) { (void)it; return t->running[r]; }

/* After iteration `it` (0: the initial states): what each running row's rule reads, then
 * the rule; a row that stops fills the slots it skips. */
static void observe_rows(const fwd *F, tl_act s, int n, int pos0, int it) {
    tl_exit_tracker *t = F->exits;
    int row0 = F->exit_row0, d = F->d, V = t->vocab;
    float *states = F->exit_host, *logits = states + (size_t)n * d;   /* n x d, then rows x V */
    float *gates = logits + (size_t)F->ctx->chunk_rows * V;
    for (int a = 0, b; (a = next_run(t, row0, n, it, tl_exit_needs_state, a, &b)) < n; a = b)
        F->ops->download(F->ex, states + (size_t)a * d, tl_act_add(s, (size_t)a * d), (size_t)(b - a) * d);
    for (int a = 0, b; it > 0 && (a = next_run(t, row0, n, it, tl_exit_needs_gate, a, &b)) < n; a = b)
        exit_gate_logits(F, tl_act_add(s, (size_t)a * d), b - a, gates + a);
    int probing = it > 0 && t->wants_probe;
    for (int a = 0, b; probing && (a = next_run(t, row0, n, it, tl_exit_needs_probe, a, &b)) < n; a = b)
        probe_logits(F, s, a, b - a, pos0, states + (size_t)a * d, logits + (size_t)a * V);
    for (int r = 0; r < n; r++) {
        int tr = row0 + r;
        if (!t->running[tr]) continue;
        int limit = t->limits ? t->limits[tr] : t->depth;
        const float *state = tl_exit_needs_state(t, tr, it) ? states + (size_t)r * d : NULL;
        const float *row_logits = probing && tl_exit_needs_probe(t, tr, it) ? logits + (size_t)r * V : NULL;
        float gate = it > 0 && tl_exit_needs_gate(t, tr, it) ? gates[r] : NAN;
        if (it == 0 && !state) continue;   /* only a state's change is measured from the start */
        if (tl_exit_observe(t, tr, it, state, row_logits, gate))
            fill_skipped(F, r, F->batch ? F->batch[r].pos : pos0 + r, it, limit);
    }
}

/* Iterations from+1..depth of rows whose rules may stop them: each iteration runs the
 * rows still in the loop, in runs of consecutive rows (a run sees the K/V the runs before
 * it wrote at this iteration, as one call over all rows would). */
static void adaptive_iterations(const fwd *F, tl_act s, tl_act e, int n, int pos0, int from, int depth) {
    tl_exit_tracker *t = F->exits;
    int row0 = F->exit_row0;
    if (from == 0) observe_rows(F, s, n, pos0, 0);
    for (int it = from + 1; it <= depth; it++) {
        int ran = 0;
        for (int a = 0, b; (a = next_run(t, row0, n, it, is_running, a, &b)) < n; a = b) {
            fwd R = rows_from(F, a);
            size_t at = (size_t)a * F->d;
            core_iteration(&R, tl_act_add(s, at), tl_act_add(e, at), b - a, pos0 + a, it);
            ran = 1;
        }
        if (!ran) break;
        observe_rows(F, s, n, pos0, it);
    }
}

/* The shared core, iterations from+1..depth; a row leaves when its depth is reached. */
static void iterations(const fwd *F, tl_act s, tl_act e, int n, int pos0, int from, int depth) {
    if (F->exits) {
        adaptive_iterations(F, s, e, n, pos0, from, depth);
        return;
    }
    for (int it = from + 1; it <= depth; it++) {
        int rows = rows_in_iteration(F, n, it);
        if (rows == 0) break;
        core_iteration(F, s, e, rows, pos0, it);
        if (F->exit_gates) exit_gate_logits(F, s, rows, F->exit_gates + (size_t)(it - 1) * rows);
    }
}

static void core_loop(const fwd *F, tl_act s, tl_act e, int n, int pos0, int depth) {
    iterations(F, s, e, n, pos0, 0, depth);
}

/* s = init(e) of kind `init` for rows whose init does not depend on other positions. h
 * holds e. */
static void init_state(const fwd *F, tl_state_init init, tl_act h, int n, int pos0) {
    size_t count = (size_t)n * F->d;
    switch (init) {
    case TL_INIT_PRELUDE:
    case TL_INIT_WARM:     /* handled row by row in run_loop */
        break;
    case TL_INIT_ZEROS:
        F->ops->fill(F->ex, h, count, 0.0f);
        break;
    case TL_INIT_NOISE:
        if (!F->batch && !F->tree) {
            F->ops->fill_noise(F->ex, h, n, F->d, F->hp->noise_seed, pos0, F->hp->noise_sigma,
                               F->hp->noise_truncation);
            break;
        }
        if (F->batch && n > F->n_real) n = F->n_real;   /* padding needs no state */
        for (int r = 0; r < n; r++)   /* each row's noise is its own position's */
            F->ops->fill_noise(F->ex, tl_act_add(h, (size_t)r * F->d), 1, F->d, F->hp->noise_seed,
                               F->batch ? F->batch[r].pos : F->tree->pos[F->tree_first + r],
                               F->hp->noise_sigma, F->hp->noise_truncation);
        break;
    }
}

/* e = h, the prelude's output, for the injection (only it reads e); the state s = e
 * needs no copy since h holds e already. */
static void keep_injection_source(const fwd *F, int n) {
    if (F->hp->injection != TL_INJECT_NONE)
        F->ops->copy_rows(F->ex, buf0(F->ctx->e), F->d, buf0(F->ctx->h), F->d, n, F->d);
}

/* From e (in h and e) to the final loop state in h. A warm start (the file's, or the
 * state_init option's) needs the previous position's final state, so positions then run
 * through the loop one by one; each position's state is kept (ctx->warm) so truncation
 * and forks stay exact. */
static void run_loop(const fwd *F, int n, int pos0, int depth) {
    tl_act h = buf0(F->ctx->h), e = buf0(F->ctx->e);
    if (depth > 0) keep_injection_source(F, n);
    if (F->ctx->state_init != TL_INIT_WARM) {
        init_state(F, F->ctx->state_init, h, n, pos0);
        core_loop(F, h, e, n, pos0, depth);
        return;
    }
    tl_act warm = buf0(F->ctx->warm);
    for (int r = 0; r < n; r++) {
        int pos = pos0 + r;
        tl_act s = tl_act_add(h, (size_t)r * F->d);
        if (pos == 0)   /* no previous state: the file's own init (e is already in s) */
            init_state(F, tl_first_state_init(F->hp), s, 1, 0);
        else
            F->ops->copy_rows(F->ex, s, F->d, tl_act_add(warm, (size_t)(pos - 1) * F->d), F->d,
                              1, F->d);
        fwd R = *F;
        R.exit_row0 = F->exit_row0 + r;
        core_loop(&R, s, tl_act_add(e, (size_t)r * F->d), 1, pos, depth);
        F->ops->copy_rows(F->ex, tl_act_add(warm, (size_t)pos * F->d), F->d, s, F->d, 1, F->d);
    }
}

/* A context that keeps its loop states (context.h) gets rows' injection sources and
 * states at their positions, from e and h after the loop. Every pass that extends the
 * sequence stores them; a draft's, at its shallower depth, is overwritten by the
 * verification of the same positions before the sequence goes on. Stored as a key/value
 * pair is: a backend that replays recorded decode steps (CUDA graphs) addresses those
 * rows from the step's position, so every step stays the same step. Without injection
 * the state is written to both slots of one buffer, the same values twice. */
static void store_states_of(const fwd *F, struct tl_context *ctx, int row0, int n, int pos0) {
    if (!ctx->loop_s) return;
    size_t at = (size_t)row0 * F->d;
    tl_act states = buf0(ctx->loop_s), h = tl_act_add(buf0(F->ctx->h), at), e = tl_act_add(buf0(F->ctx->e), at);
    int inject = F->hp->injection != TL_INJECT_NONE;
    F->ops->kv_store(F->ex, inject ? buf0(ctx->loop_e) : states, states, inject ? e : h, h, n, pos0, F->d);
}

static void store_loop_states(const fwd *F, int n, int pos0) {
    if (!F->batch) {
        store_states_of(F, F->ctx, 0, n, pos0);
        return;
    }
    for (int r = 0; r < n && r < F->n_real; r++) store_states_of(F, F->batch[r].ctx, r, 1, F->batch[r].pos);
}

/* The entropy (nats) of softmax(logits), in double: log S - sum e_i (x_i - max) / S with
 * e_i = exp(x_i - max) and S their sum. Logits of -inf have no mass (and add nothing);
 * NaN logits are skipped like them; NaN when no logit is finite. */
static float softmax_entropy(const float *x, int n) {
    float max = -INFINITY;
    for (int i = 0; i < n; i++) max = fmaxf(max, x[i]);
    if (!isfinite(max)) return NAN;
    double sum = 0.0, weighted = 0.0;
    for (int i = 0; i < n; i++) {
        double d = (double)x[i] - (double)max, e = exp(d);
        if (!(e > 0.0)) continue;   /* -inf (or NaN): no mass */
        sum += e;
        weighted += e * d;
    }
    return (float)(log(sum) - weighted / sum);
}

/* The softmax probability of the largest of n logits, in double; 0 when none is finite. */
static float top_probability(const float *x, int n) {
    float max = -INFINITY;
    for (int i = 0; i < n; i++) max = fmaxf(max, x[i]);
    if (!isfinite(max)) return 0.0f;
    double sum = 0.0;
    for (int i = 0; i < n; i++)
        if (x[i] > -INFINITY) sum += exp((double)x[i] - max);
    return (float)(1.0 / sum);
}

/* log(sum(exp(row))) of a row of logits on the backend, whose copy on the host is `host`:
 * the backend's log-softmax of token 0 is host[0] minus it, so only one float comes back
 * (a pass over the vocabulary on the device, not on the host). */
static float log_norm(const fwd *F, tl_act row, int V, const float *host) {
    const int32_t first = 0;
    float logprob = 0.0f;
    F->ops->logprobs(F->ex, row, 1, V, &first, &logprob);
    return host[0] - logprob;
}

/* Final norm and head for the rows the caller asked for; h holds the coda output (rows
 * at positions pos0 ..). */
static void outputs(const fwd *F, int n, int pos0, const tl_forward_out *out) {
    const struct tl_model *m = F->m;
    struct tl_context *ctx = F->ctx;
    tl_act h = buf0(ctx->h), xn = buf0(ctx->xn), logits = buf0(ctx->logits);
    int V = F->hp->vocab;

    if (out->hidden_sum) {   /* an embedding: the head's input rows, added up on the host */
        tl_act rows = h;
        if (F->hp->final_norm) {
            F->ops->norm(F->ex, &m->final_norm, &F->norm, h, n, F->d, xn);
            rows = xn;
        }
        for (int r = 0; r < n; r++) {
            F->ops->download(F->ex, out->hidden_row, tl_act_add(rows, (size_t)r * F->d), (size_t)F->d);
            for (int i = 0; i < F->d; i++) out->hidden_sum[i] += out->hidden_row[i];
        }
    }
    if (out->last_logits || out->last_token || out->chain_token) {
        /* a draft with a draft vocabulary scores only its tokens */
        const tl_draft_vocab *dv = out->draft && m->draft.n > 0 ? &m->draft : NULL;
        const tl_tensor *head = dv ? &dv->head : &m->output;
        int n_logits = dv ? dv->n : V;
        tl_matmul_in in = head_in(F, tl_act_add(h, (size_t)(n - 1) * F->d));
        size_t ld_logits = (size_t)n_logits;
        matmul_in(F, &head, 1, &in, 1, &logits, &ld_logits, 0);
        if (out->last_top_prob) {
            F->ops->download(F->ex, out->top_prob_row, logits, (size_t)n_logits);
            *out->last_top_prob = top_probability(out->top_prob_row, n_logits);
        }
        if (out->last_logits) {
            F->ops->download(F->ex, out->last_logits, logits, (size_t)n_logits);
            if (dv) tl_draft_vocab_scatter(dv, out->last_logits, V);
            else if (out->last_log_norm) *out->last_log_norm = log_norm(F, logits, V, out->last_logits);
        }
        if (dv && out->last_token)
            *out->last_token = dv->ids[F->ops->argmax(F->ex, logits, n_logits)];
        else if (out->chain_token)
            F->ops->argmax_chained(F->ex, logits, V, pos0 + n - 1);
        else if (out->last_token)
            *out->last_token = out->sample ? F->ops->sample(F->ex, logits, V, out->sample)
                                           : F->ops->argmax(F->ex, logits, V);
    }
    int n_score = (int)(out->n_targets < (size_t)n ? out->n_targets : (size_t)n);
    int n_argmax = (int)(out->n_row_tokens < (size_t)n ? out->n_row_tokens : (size_t)n);
    int n_logit_rows = (int)(out->n_row_logits < (size_t)n ? out->n_row_logits : (size_t)n);
    int n_rows = n_score > n_argmax ? n_score : n_argmax;
    if (n_logit_rows > n_rows) n_rows = n_logit_rows;
    if (n_rows <= 0) return;
    if (F->hp->final_norm) F->ops->norm(F->ex, &m->final_norm, &F->norm, h, n_rows, F->d, xn);
    else xn = h;   /* no final norm: the head reads the states themselves */
    /* logit_rows at a time, so scoring never holds n x V floats */
    for (int r0 = 0; r0 < n_rows; r0 += ctx->logit_rows) {
        int rows = n_rows - r0 < ctx->logit_rows ? n_rows - r0 : ctx->logit_rows;
        F->ops->matmul(F->ex, &m->output, tl_act_add(xn, (size_t)r0 * F->d), F->d, rows, logits, V);
        for (int r = r0; r < r0 + rows && r < n_argmax; r++)
            out->row_tokens[r] = F->ops->argmax(F->ex, tl_act_add(logits, (size_t)(r - r0) * V), V);
        for (int r = r0; r < r0 + rows && r < n_logit_rows; r++)
            F->ops->download(F->ex, out->row_logits + (size_t)r * V, tl_act_add(logits, (size_t)(r - r0) * V),
                             (size_t)V);
        if (r0 < n_score) {
            int scored = n_score - r0 < rows ? n_score - r0 : rows;
            F->ops->logprobs(F->ex, logits, scored, V, out->targets + r0, out->logprobs + r0);
            for (int r = r0; (out->entropies || out->top_k > 0) && r < r0 + scored; r++) {
                F->ops->download(F->ex, out->host_row, tl_act_add(logits, (size_t)(r - r0) * V), (size_t)V);
                if (out->entropies) out->entropies[r] = softmax_entropy(out->host_row, V);
                if (out->top_k > 0) {
                    /* the row's log-sum-exp from its target's log-prob, which the backend gave */
                    double log_norm = (double)out->host_row[out->targets[r]] - out->logprobs[r];
                    tl_top_logprobs(out->host_row, V, log_norm, out->top_k, out->top_ids + (size_t)r * out->top_k,
                                    out->top_logprobs + (size_t)r * out->top_k);
                }
            }
        }
    }
}

/* Embed tokens into h and run the prelude blocks on them. */
static void embed_and_prelude(const fwd *F, const int32_t *tokens, int n, int pos0) {
    tl_act h = buf0(F->ctx->h);
    F->ops->embed(F->ex, &F->m->embed, tokens, n, F->hp->embed_scale, h);
    for (int b = 0; b < F->hp->n_pre; b++) block(F, &F->m->pre[b], (slot_id){ SLOT_PRE, b, 0 }, h, n, pos0);
}

/* The post-loop norm and the coda blocks on the final loop state in h. */
static void coda_rows(const fwd *F, tl_act h, int n, int pos0) {
    if (F->hp->post_norm) F->ops->norm(F->ex, &F->m->post_loop_norm, &F->norm, h, n, F->d, h);
    for (int b = 0; b < F->hp->n_post; b++)
        block(F, &F->m->post[b], (slot_id){ SLOT_POST, b, 0 }, h, n, pos0);
}

static void coda(const fwd *F, int n, int pos0) { coda_rows(F, buf0(F->ctx->h), n, pos0); }

static fwd fwd_for(struct tl_context *ctx) {
    const struct tl_model *m = ctx->model;
    const tl_hparams *hp = &m->hp;
    fwd F = {
        .ctx = ctx, .m = m, .hp = hp, .ops = ctx->be->ops, .ex = ctx->ex,
        .d = hp->d, .qd = hp->n_head * hp->head_dim, .kvd = hp->n_kv_head * hp->head_dim,
        .f = hp->ffn,
        .norm = { hp->norm_type, hp->norm_unit_offset, hp->norm_eps },
        .rope = { hp->rope_dims, hp->rope_style == TL_ROPE_INTERLEAVED ? 1 : 0, hp->rope_theta, m->rope_factors },
        .geom = { hp->n_head, hp->n_kv_head, hp->head_dim, hp->attn_scale,
                  ctx->window.size ? ctx->window.attn : hp->sliding_window },
    };
    return F;
}

/* The pages the pass's rows lack or share in their caches (kv_cache.h), before any op
 * runs, so that a full pool stops the pass with nothing written. A batched step's rows'
 * page tables are updated in order with the pass's ops (ctx's execution state), which
 * read them. */
static tl_status reserve(struct tl_context *ctx, const tl_forward_req *req, int pos0) {
    if (req->rows != TL_ROWS_BATCH) return tl_kv_cache_reserve(&ctx->kv, ctx->ex, pos0, req->n);
    for (int r = 0; r < req->n; r++) {
        struct tl_context *row_ctx = req->batch[r].ctx;
        tl_status st = tl_kv_cache_reserve(&row_ctx->kv, ctx->ex, req->batch[r].pos, 1);
        if (st != TL_OK) return st;
    }
    return TL_OK;
}

/* `count` rows of h (and e) from rows kept elsewhere: loop states and injection sources. */
static void load_loop_states(const fwd *F, tl_act kept_e, tl_act kept_s, int count) {
    F->ops->copy_rows(F->ex, buf0(F->ctx->h), F->d, kept_s, F->d, count, F->d);
    if (F->hp->injection != TL_INJECT_NONE)
        F->ops->copy_rows(F->ex, buf0(F->ctx->e), F->d, kept_e, F->d, count, F->d);
}

/* Rows 0..n_resumed-1 from the states they were kept with, the others run from the
 * embedding to iteration `from` in rows 0.. and then moved up behind the kept ones, one
 * row at a time from the last (a row never lands on one still to move). */
static void resume_rows(fwd *F, const tl_forward_req *req, int pos0) {
    tl_act h = buf0(F->ctx->h), e = buf0(F->ctx->e);
    int kept = req->n_resumed, fresh = req->n - kept;
    F->tree_first = req->tree_first + kept;
    embed_and_prelude(F, req->tokens + kept, fresh, pos0 + kept);
    run_loop(F, fresh, pos0 + kept, req->from);
    for (int r = fresh - 1; r >= 0; r--) {
        size_t src = (size_t)r * F->d, dst = (size_t)(r + kept) * F->d;
        F->ops->copy_rows(F->ex, tl_act_add(h, dst), F->d, tl_act_add(h, src), F->d, 1, F->d);
        if (F->hp->injection != TL_INJECT_NONE)
            F->ops->copy_rows(F->ex, tl_act_add(e, dst), F->d, tl_act_add(e, src), F->d, 1, F->d);
    }
    load_loop_states(F, req->resume_e, req->resume_s, kept);
    F->tree_first = req->tree_first;
}

/* The logit lens: prelude once, then after each iteration the coda and head on a copy of
 * the state, which the next iteration continues. */
static tl_status lens_pass(fwd *F, const tl_forward_req *req, const tl_forward_out *out) {
    tl_act h = buf0(F->ctx->h), e = buf0(F->ctx->e);
    int n = req->n;
    embed_and_prelude(F, req->tokens, n, 0);
    keep_injection_source(F, n);
    init_state(F, F->ctx->state_init, h, n, 0);
    for (int it = 1; it <= req->depth; it++) {
        core_iteration(F, h, e, n, 0, it);
        F->ops->copy_rows(F->ex, req->lens_saved, F->d, h, F->d, n, F->d);
        coda(F, n, 0);
        tl_forward_out at_depth = { .last_logits = out->last_logits + (size_t)(it - 1) * F->hp->vocab };
        outputs(F, n, 0, &at_depth);
        F->ops->copy_rows(F->ex, h, F->d, req->lens_saved, F->d, n, F->d);
    }
    return F->ops->status(F->ex);
}

/* Whether every row of a batched step through the row ops asks for its greedy token
 * only: argmax_rows then gives them all (inside a recorded step, with the step). */
static int greedy_rows(const fwd *F, const tl_forward_out *outs) {
    if (!F->rows || !F->ops->argmax_rows || !outs) return 0;
    for (int r = 0; r < F->n_real; r++)
        if (!outs[r].last_token || outs[r].sample || outs[r].last_logits) return 0;
    return 1;
}

/* A batched step's outputs: per row, its logits and/or its next token (argmax, or the
 * row's sample step), from the same normed head matmul as a one-row step's. `greedy`
 * (greedy_rows): the argmax of all n rows, padding included (the step keeps its shape),
 * into rows->argmax by argmax_rows. */
static void batch_outputs(const fwd *F, int n, const tl_forward_out *outs, int greedy) {
    struct tl_context *ctx = F->ctx;
    tl_act h = buf0(ctx->h), logits = buf0(ctx->logits);
    const tl_tensor *head = &F->m->output;
    int V = F->hp->vocab;
    size_t ld_logits = (size_t)V;
    if (!greedy) n = F->n_real;
    for (int r0 = 0; r0 < n; r0 += ctx->logit_rows) {
        int rows = n - r0 < ctx->logit_rows ? n - r0 : ctx->logit_rows;
        tl_matmul_in in = head_in(F, tl_act_add(h, (size_t)r0 * F->d));
        matmul_in(F, &head, 1, &in, rows, &logits, &ld_logits, 0);
        if (greedy) {
            F->ops->argmax_rows(F->ex, logits, rows, V, ld_logits, F->rows->argmax + r0);
            continue;
        }
        for (int r = r0; r < r0 + rows; r++) {
            const tl_forward_out *o = &outs[r];
            tl_act row = tl_act_add(logits, (size_t)(r - r0) * V);
            if (o->last_logits) F->ops->download(F->ex, o->last_logits, row, (size_t)V);
            if (o->last_logits && o->last_log_norm) *o->last_log_norm = log_norm(F, row, V, o->last_logits);
            if (o->last_token)
                *o->last_token = o->sample ? F->ops->sample(F->ex, row, V, o->sample) : F->ops->argmax(F->ex, row, V);
        }
    }
}

/* A draft's logits of each of n rows (at rows + r * vocab): the draft vocabulary's n
 * logits when the model has one (not scattered: its ids map them), else the whole head's. */
static void draft_row_logits(const fwd *F, int n, float *rows) {
    struct tl_context *ctx = F->ctx;
    const tl_draft_vocab *dv = F->m->draft.n > 0 ? &F->m->draft : NULL;
    const tl_tensor *head = dv ? &dv->head : &F->m->output;
    int V = F->hp->vocab, n_logits = dv ? dv->n : V;
    size_t ld_logits = (size_t)n_logits;
    tl_act h = buf0(ctx->h), logits = buf0(ctx->logits);
    for (int r0 = 0; r0 < n; r0 += ctx->logit_rows) {
        int count = n - r0 < ctx->logit_rows ? n - r0 : ctx->logit_rows;
        tl_matmul_in in = head_in(F, tl_act_add(h, (size_t)r0 * F->d));
        matmul_in(F, &head, 1, &in, count, &logits, &ld_logits, 0);
        for (int r = r0; r < r0 + count; r++) {
            float *row = rows + (size_t)r * V;
            F->ops->download(F->ex, row, tl_act_add(logits, (size_t)(r - r0) * n_logits), (size_t)n_logits);
        }
    }
}

/* The outputs of a pass of n rows whose coda output is in h. */
static void pass_outputs(const fwd *F, const tl_forward_req *req, int n, int pos0, const tl_forward_out *out,
                         int greedy) {
    if (!out) return;
    if (req->rows == TL_ROWS_BATCH) batch_outputs(F, n, out, greedy);
    else if (req->rows == TL_ROWS_TREE && out->draft && out->row_logits) draft_row_logits(F, req->n, out->row_logits);
    else outputs(F, req->n, pos0, out);
}

/* A batched pass through the backend's row ops: its rows' arrays (for up to the context's
 * chunk rows, the most a step may be padded to) in one allocation; NULL without them. */
static row_batch *row_batch_new(const struct tl_context *ctx) {
    size_t cap = (size_t)ctx->chunk_rows;
    row_batch *b = malloc(sizeof *b + cap * (4 * sizeof(int32_t) + 2 * sizeof(tl_act)));
    if (!b) return NULL;
    b->k = (tl_act *)(b + 1);
    b->v = b->k + cap;
    b->tokens = (int32_t *)(b->v + cap);
    b->pos = b->tokens + cap;
    b->depths = b->pos + cap;
    b->argmax = b->depths + cap;
    return b;
}

/* The step's rows padded to n_pad (row_batch). */
static void row_batch_fill(row_batch *b, const tl_forward_req *req, int n_pad) {
    int n = req->n;
    b->n_pad = n_pad;
    for (int r = 0; r < n_pad; r++) {
        b->tokens[r] = r < n ? req->tokens[r] : 0;
        b->pos[r] = r < n ? req->batch[r].pos : -1;
        if (req->row_depths) b->depths[r] = req->row_depths[r < n ? r : n - 1];
    }
}

/* A batched step may be recorded unless a per-row op outside the row ops depends on its
 * rows' positions: the noise init, or a row's context keeping its loop states. */
static int batch_recordable(const fwd *F, const tl_forward_req *req) {
    if (F->hp->state_init == TL_INIT_NOISE) return 0;
    for (int r = 0; r < req->n; r++)
        if (req->batch[r].ctx->loop_s) return 0;
    return 1;
}

/* Whether a row of a batched step keeps block inputs (store_h): its K/V are recomputed
 * into its own slot before the layer's rows attend, one sequence at a time. */
static int batch_stores_h(const tl_forward_req *req) {
    for (int r = 0; r < req->n; r++)
        if (req->batch[r].ctx->block_in) return 1;
    return 0;
}

/* Whether the pass's rows may stop early: an exit rule or given depths in `out`. */
static int adaptive_pass(const tl_forward_req *req, const tl_forward_out *out, int depth) {
    if (!out || depth == 0 || req->start != TL_START_EMBED || req->rows == TL_ROWS_TREE) return 0;
    if (req->rows == TL_ROWS_SEQUENCE) return tl_exit_rule_active(out->exit) || out->given_depths != NULL;
    for (int r = 0; r < req->n; r++)
        if (tl_exit_rule_active(out[r].exit)) return 1;
    return 0;
}

/* The tracker of an adaptive pass and its host scratch (observe_rows). */
static tl_status exits_begin(fwd *F, const tl_forward_req *req, const tl_forward_out *out, int depth,
                             tl_exit_tracker *t, const tl_exit_rule ***rules) {
    int n = req->n, batch = req->rows == TL_ROWS_BATCH;
    int V = F->m->draft.n > 0 ? F->m->draft.n : F->hp->vocab;
    *rules = malloc((size_t)n * sizeof **rules);
    if (!*rules) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate the exit rules of %d rows", n);
    for (int r = 0; r < n; r++) (*rules)[r] = batch ? out[r].exit : out->exit;
    tl_status st = tl_exit_tracker_init(t, n, F->d, V, depth, *rules, batch ? req->row_depths : NULL,
                                        batch ? NULL : out->given_depths);
    if (st != TL_OK) return st;
    size_t floats = (size_t)n * F->d + (size_t)F->ctx->chunk_rows * (t->wants_probe ? V : 0) + (size_t)n;
    F->exit_host = malloc(floats * sizeof(float));
    if (!F->exit_host) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate the exit rules' scratch");
    F->exits = t;
    return TL_OK;
}

/* The depth each row ran, where `out` asks for it. */
static void report_depths(const fwd *F, const tl_forward_req *req, const tl_forward_out *out, int depth) {
    if (!out) return;
    for (int r = 0; r < req->n; r++) {
        int ran = F->exits ? F->exits->ran[r] : req->rows == TL_ROWS_BATCH && req->row_depths ? req->row_depths[r] : depth;
        if (req->rows == TL_ROWS_BATCH) {
            if (out[r].last_depth) *out[r].last_depth = ran;
            continue;
        }
        if ((size_t)r < out->n_depths) out->depths[r] = ran;
        if (r == req->n - 1 && out->last_depth) *out->last_depth = ran;
    }
}

tl_status tl_forward(struct tl_context *ctx, const tl_forward_req *req, const tl_forward_out *out) {
    /* the position of row 0, for ops that take one (a batch's rows carry their own) */
    int pos0 = req->rows == TL_ROWS_SEQUENCE ? req->pos0
             : req->rows == TL_ROWS_TREE     ? req->tree->n_prefix + req->tree_first : 0;
    tl_status st = reserve(ctx, req, pos0);
    if (st != TL_OK) return st;
    fwd F = fwd_for(ctx);
    F.batch = req->rows == TL_ROWS_BATCH ? req->batch : NULL;
    F.tree = req->rows == TL_ROWS_TREE ? req->tree : NULL;
    F.tree_first = req->tree_first;
    F.row_depths = req->rows == TL_ROWS_BATCH ? req->row_depths : NULL;
    F.exit_gates = req->exit_gates;
    F.n_real = req->n;
    if (req->lens) return lens_pass(&F, req, out);
    int n = req->n, depth = F.hp->n_core > 0 ? req->depth : 0;
    tl_exit_tracker tracker;
    const tl_exit_rule **rules = NULL;
    if (adaptive_pass(req, out, depth)) {
        st = exits_begin(&F, req, out, depth, &tracker, &rules);
        if (st == TL_OK && !F.ops->kv_copy)
            st = tl_fail(TL_ERR_UNSUPPORTED, "exit rules: the %s backend cannot copy K/V rows between "
                                             "slots", ctx->be->name);
        if (st != TL_OK) {
            if (F.exits) tl_exit_tracker_free(F.exits);
            free(F.exit_host);
            free(rules);
            return st;
        }
    }
    /* a decode step's layers may be recorded once and replayed (backend.h); an adaptive
     * step's ops depend on its values */
    int step = req->rows == TL_ROWS_SEQUENCE && req->start == TL_START_EMBED && n == 1 &&
               F.ops->step_begin && F.ops->step_end && !F.exits;
    /* a batched step through the row ops, padded and recorded where the backend does so
     * (an adaptive one goes row by row: its runs of rows change from iteration to iteration) */
    const int32_t *tokens = req->tokens;
    if (req->rows == TL_ROWS_BATCH && req->start == TL_START_EMBED && !F.exits && F.ops->rope_store_rows &&
        F.ops->attention_rows && !batch_stores_h(req)) {
        F.rows = row_batch_new(ctx);
        if (!F.rows) return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate a batch of %d rows", n);
    }
    int batch_step = F.rows && F.ops->batch_step_begin && F.ops->step_end;
    if (F.rows) {
        int n_pad = batch_step ? F.ops->batch_step_begin(F.ex, n, ctx->chunk_rows, batch_recordable(&F, req)) : n;
        row_batch_fill(F.rows, req, n_pad);
        n = n_pad;
        tokens = F.rows->tokens;
        if (req->row_depths) F.row_depths = F.rows->depths;
    }

    if (step) F.ops->step_begin(F.ex, pos0);
    if (step && out && out->token_on_device) F.ops->step_token_on_device(F.ex);
    tl_act h = buf0(ctx->h), e = buf0(ctx->e);
    switch (req->start) {
    case TL_START_EMBED:
        embed_and_prelude(&F, tokens, n, pos0);
        run_loop(&F, n, pos0, depth);
        break;
    case TL_START_RESUMED:
        resume_rows(&F, req, pos0);
        iterations(&F, h, e, n, pos0, req->from, depth);
        break;
    case TL_START_KEPT: {
        size_t at = (size_t)pos0 * F.d;
        load_loop_states(&F, ctx->loop_e ? tl_act_add(buf0(ctx->loop_e), at) : (tl_act){ 0 },
                         tl_act_add(buf0(ctx->loop_s), at), n);
        iterations(&F, h, e, n, pos0, req->from, depth);
        break;
    }
    }
    store_loop_states(&F, n, pos0);
    /* a draft's e and s before the coda, for a resumed verification */
    int keep = out && out->keep_s.buf && req->start == TL_START_EMBED &&
               (req->rows == TL_ROWS_TREE || (req->rows == TL_ROWS_SEQUENCE && n == 1));
    if (keep) {
        if (F.hp->injection != TL_INJECT_NONE) F.ops->copy_rows(F.ex, out->keep_e, F.d, e, F.d, n, F.d);
        F.ops->copy_rows(F.ex, out->keep_s, F.d, h, F.d, n, F.d);
    }
    coda(&F, n, pos0);
    /* A chained token is the step's last op: head and argmax are recorded with it, as are
     * a batched step's greedy tokens (argmax_rows). Other outputs come back to the host,
     * which ends a recording, so they follow the step. */
    int greedy = req->rows == TL_ROWS_BATCH && greedy_rows(&F, out);
    int outputs_in_step = (step && out && out->chain_token && !out->last_logits && out->n_targets == 0) ||
                          (batch_step && greedy);
    if ((step || batch_step) && !outputs_in_step) F.ops->step_end(F.ex);
    pass_outputs(&F, req, n, pos0, out, greedy);
    if (outputs_in_step) F.ops->step_end(F.ex);
    for (int r = 0; greedy && r < F.n_real; r++) *out[r].last_token = F.rows->argmax[r];
    free(F.rows);
    report_depths(&F, req, out, depth);
    if (F.exits) tl_exit_tracker_free(F.exits);
    free(F.exit_host);
    free(rules);
    return F.ops->status(F.ex);
}

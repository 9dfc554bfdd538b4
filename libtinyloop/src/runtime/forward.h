/* forward.h — the forward pass of docs/model.md over one chunk of a context's
 * sequence, with the outputs a caller asks for. */
#ifndef TL_FORWARD_H
#define TL_FORWARD_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "tinyloop/tinyloop.h"

struct tl_context;

/* What to produce besides filling the KV cache. Rows are those of the tokens being
 * evaluated (0 = the first of them). */
typedef struct tl_forward_out {
    float *last_logits;        /* host, vocab floats: logits of the last row; or NULL */
    int32_t *last_token;       /* host: argmax of the last row's logits; or NULL     */
    const struct tl_sample_step *sample;  /* last_token: this step's sample instead  */
    const int32_t *targets;    /* scoring: row i's logprob is of token targets[i]   */
    float *logprobs;           /* host: logprobs[i] for rows i < n_targets           */
    size_t n_targets;
    float *entropies;          /* host: entropy (nats) of row i's softmax for rows i <
                                  n_targets; or NULL                                  */
    int top_k;                 /* scoring: the top_k most likely tokens of rows i <
                                  n_targets, top_ids[i * top_k ..] and their logprobs
                                  top_logprobs[i * top_k ..] (logprobs.h); 0 = none   */
    int32_t *top_ids;
    float *top_logprobs;
    float *host_row;           /* host, vocab floats: where a row is read for entropies
                                  or top_k                                            */
    int32_t *row_tokens;       /* host: argmax of row i's logits for rows i < n_row_tokens
                                  (a speculative verification); or NULL                */
    size_t n_row_tokens;
    float *row_logits;         /* host: row i's vocab logits at row_logits[i * vocab] for rows
                                  i < n_row_logits (a sampled speculative verification)  */
    size_t n_row_logits;
    int token_on_device;       /* one row whose token is the last chained argmax (backend.h);
                                  tokens[0] is a placeholder                          */
    int chain_token;           /* argmax of the last row kept on the device (argmax_chained),
                                  read later with chained_token                        */
    int draft;                 /* a speculative draft: last_logits / last_token over the
                                  model's draft vocabulary when it has one (draft_vocab.h;
                                  last_logits then holds -inf at the other tokens); not
                                  with sample or chain_token                          */
    float *last_log_norm;      /* host, with last_logits: log(sum(exp(logits))) of the last
                                  row, through the backend's logprobs op (so on the
                                  device); or NULL. Not for a draft                   */
    float *last_top_prob;      /* host: softmax probability of the last row's largest
                                  logit (over the draft vocabulary for a draft); its
                                  logits pass through `top_prob_row` (vocab floats)   */
    float *top_prob_row;
    tl_act keep_e, keep_s;     /* a one-row draft: where its injection source and its loop
                                  state before the coda go (.buf NULL: not kept), for
                                  tl_forward_resume; not on a backend that records steps
                                  (the destinations move from draft to draft). Every row's,
                                  in tl_forward_tree                                   */
} tl_forward_out;

/* Run tokens[0..n) at positions [pos0, pos0 + n) at loop depth `depth` (already
 * validated; 0 when the model has no core). n is at most the context's chunk rows.
 * Writes K/V of those positions; does not change the context's length. */
tl_status tl_forward_chunk(struct tl_context *ctx, const int32_t *tokens, int n, int pos0,
                           int depth, const tl_forward_out *out);

/* A speculative verification of tokens[0..n) at positions [pos0, pos0 + n), n <= the
 * chunk rows, that resumes rows 0..n-2 from their drafts: rows kept_e / kept_s hold each
 * one's injection source and loop state after iteration `from` (tl_forward_out.keep_e /
 * keep_s), and their K/V up to that iteration is in the cache already. The last row runs
 * from the embedding to iteration `from`; then all n run iterations from+1..depth, the
 * coda and `out`. Not for a warm state init (a draft's state then depends on the previous
 * draft's, not the full depth's). */
tl_status tl_forward_resume(struct tl_context *ctx, const int32_t *tokens, int n, int pos0,
                            int from, int depth, tl_act kept_e, tl_act kept_s,
                            const tl_forward_out *out);

/* Positions [pos0, pos0 + n), n <= the chunk rows, on from loop iteration `from` to
 * `depth`, starting from the context's kept loop states (context.h: loop_e, loop_s), whose
 * K/V up to iteration `from` is in the cache: the new iterations' K/V, the coda's K/V
 * (rewritten), `out`, and the rows' states after `depth` kept in their place. */
tl_status tl_forward_deepen(struct tl_context *ctx, int n, int pos0, int from, int depth,
                            const tl_forward_out *out);

/* The logit lens of a fresh sequence in one chunk (n <= the context's chunk rows, a
 * state init other than warm): prelude once, then after each loop iteration 1..max_depth
 * the coda and head on a copy of the state (kept in `saved`, n x d floats), so that
 * logits_per_depth[(it-1) * vocab ..] are the last position's logits at depth it. Writes
 * K/V at positions [0, n); does not change the context's length. */
tl_status tl_forward_lens(struct tl_context *ctx, const int32_t *tokens, int n, int max_depth,
                          tl_act saved, float *logits_per_depth);

/* Nodes first..first+n-1 of a token tree (backend.h, tl_tree; n <= the chunk rows) at
 * loop depth `depth`, their K/V into the cache rows tree->n_prefix + first.., each node
 * attending to the prefix and its ancestors at its tree position. `out`: per-row fields
 * (row_tokens, row_logits); with `draft` set, row_logits of the draft head: the draft
 * vocabulary's logits when the model has one (in the order of its ids, at a stride of
 * vocab floats), else the whole vocabulary's. Not for a warm state init. Changes no
 * length. */
tl_status tl_forward_tree(struct tl_context *ctx, const int32_t *tokens, int n, const tl_tree *tree,
                          int first, int depth, const tl_forward_out *out);

/* tl_forward_tree over nodes 0..n-1 at `depth` as a verification whose first n_kept
 * nodes (1 <= n_kept < n) resume where their drafts left them: rows kept_e / kept_s hold
 * each one's injection source and loop state after iteration `from` (tl_forward_out.keep_e
 * / keep_s of tl_forward_tree), their K/V up to it is in the cache. The other nodes run
 * from the embedding to iteration `from`; then all n run from+1..depth, the coda, `out`. */
tl_status tl_forward_tree_resumed(struct tl_context *ctx, const int32_t *tokens, int n, const tl_tree *tree, int n_kept,
                                  int from, int depth, tl_act kept_e, tl_act kept_s, const tl_forward_out *out);

/* One row of a batched decode step: a position of its own sequence. */
typedef struct tl_batch_row {
    struct tl_context *ctx;   /* whose KV cache (and kept loop states) the row uses */
    int pos;                  /* the row's position in that sequence */
} tl_batch_row;

/* One decode step of n sequences at once, n <= lead's chunk rows: tokens[r] at position
 * rows[r].pos of rows[r].ctx, all at loop depth `depth`, in lead's buffers and threads
 * (lead holds the largest max_seq of them, its attention scratch bounds every row's).
 * The matmuls run on all rows together, attention row by row in each sequence's cache.
 * outs[r] may ask for last_logits and last_token (with `sample`) only. Not for a warm
 * state init. Writes K/V; changes no sequence's length. */
tl_status tl_forward_batch(struct tl_context *lead, const tl_batch_row *rows, const int32_t *tokens, int n,
                           int depth, const tl_forward_out *outs);

#endif

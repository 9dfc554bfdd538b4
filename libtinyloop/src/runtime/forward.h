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
    float *hidden_sum;         /* host, d floats: every row's head input (final norm's
                                  output) added to it; a SEQUENCE pass. hidden_row: a
                                  host scratch of d floats                            */
    float *hidden_row;
    /* adaptive depth (docs/model.md, "Adaptive depth"; TL_START_EMBED passes, not the logit
     * lens): each row's loop stops after the iteration where `exit` says its token has
     * converged (BATCH: each row's own out's), or at given_depths[i] (SEQUENCE); the
     * iterations it skips get its last K/V. The depth each row ran: depths[i] for rows i <
     * n_depths, *last_depth for the last row (BATCH: each row's)                        */
    const tl_exit_rule *exit;
    const int32_t *given_depths;
    int32_t *depths;
    size_t n_depths;
    int32_t *last_depth;
    tl_act keep_e, keep_s;     /* a one-row draft: where its injection source and its loop
                                  state before the coda go (.buf NULL: not kept), for a
                                  TL_START_RESUMED verification; not on a backend that
                                  records steps (the destinations move from draft to
                                  draft). Every row's, in a TL_ROWS_TREE pass          */
} tl_forward_out;

/* One row of a batched decode step: a position of its own sequence. */
typedef struct tl_batch_row {
    struct tl_context *ctx;   /* whose KV cache (and kept loop states) the row uses */
    int pos;                  /* the row's position in that sequence */
} tl_batch_row;

/* Whose positions a pass's rows are. */
typedef enum tl_forward_rows {
    TL_ROWS_SEQUENCE = 0,  /* rows 0..n-1 at positions pos0.. of the context's sequence */
    TL_ROWS_BATCH = 1,     /* row r at position batch[r].pos of batch[r].ctx's sequence: one
                              decode step of several sequences, run in the context's buffers
                              and threads (it holds the largest max_seq of them: its attention
                              scratch bounds every row's). Not for a warm state init */
    TL_ROWS_TREE = 2,      /* nodes tree_first.. of a token tree after the sequence (backend.h,
                              tl_tree), K/V into the cache rows tree->n_prefix + node, each
                              node attending to the prefix and its ancestors. Not for a warm
                              state init */
} tl_forward_rows;

/* Where the rows' loop starts. */
typedef enum tl_forward_start {
    TL_START_EMBED = 0,    /* every row from its token's embedding: prelude, state init,
                              iterations 1..depth */
    TL_START_RESUMED = 1,  /* rows 0..n_resumed-1 continue after iteration `from` from the
                              injection sources and states in resume_e / resume_s (a draft's
                              tl_forward_out.keep_e / keep_s), their K/V up to `from` already
                              in the cache; the other rows run from the embedding to `from`
                              first. Then all rows run iterations from+1..depth. A speculative
                              verification; not for a warm state init */
    TL_START_KEPT = 2,     /* every row continues after iteration `from` from the context's
                              kept loop states (context.h: loop_e, loop_s) at its position,
                              whose K/V up to `from` is in the cache (deepening); no tokens.
                              The rows' states after `depth` are kept in their place */
} tl_forward_start;

/* What one forward pass runs. Every pass writes the K/V of its rows and changes no
 * sequence's length; n is at most the context's chunk rows. */
typedef struct tl_forward_req {
    tl_forward_rows rows;
    const int32_t *tokens;        /* n tokens (validated); NULL with TL_START_KEPT */
    int n;
    int pos0;                     /* SEQUENCE: the first row's position */
    const tl_batch_row *batch;    /* BATCH: n rows */
    const tl_tree *tree;          /* TREE: the tree, rows are nodes tree_first.. */
    int tree_first;
    int depth;                    /* loop iterations the rows run to (ignored without a core) */
    const int32_t *row_depths;    /* BATCH: row r's depth (non-increasing in r, <= depth: the
                                     rows of one iteration are a prefix, and a row leaves the
                                     loop when its depth is reached); NULL = every row at depth */
    tl_forward_start start;
    int from;                     /* RESUMED / KEPT: the iteration the kept states are after */
    int n_resumed;                /* RESUMED: rows that continue from resume_e / resume_s */
    tl_act resume_e, resume_s;
    int lens;                     /* the logit lens (SEQUENCE, EMBED, position 0, a state init
                                     other than warm): after each iteration 1..depth the coda
                                     and head run on a copy of the state (kept in lens_saved,
                                     n x d floats), out->last_logits[(it-1) * vocab ..] being
                                     the last row's logits at depth it */
    tl_act lens_saved;
    float *exit_gates;            /* SEQUENCE, EMBED, a state init other than warm, a model with
                                     an exit gate (loop.exit_gate): after each iteration it =
                                     1..depth the gate's logits of the n rows to the host, at
                                     exit_gates[(it - 1) * n + r]; NULL = none */
} tl_forward_req;

/* The one forward entry point: the pass `req` describes, producing `out` (NULL =
 * nothing; BATCH: an array of n, row r's asking for last_logits / last_token with
 * `sample` only; TREE: per-row fields, with `draft` set row_logits of the draft head in
 * the order of its ids at a stride of vocab floats). Arguments are validated by the
 * caller (context.c, tree_speculative.c). */
tl_status tl_forward(struct tl_context *ctx, const tl_forward_req *req, const tl_forward_out *out);

#endif

/* context.h — tl_context: the mutable state of one sequence (buffer pool, KV cache,
 * thread pool, depth, warm loop states) and the calls orchestration builds on. */
#ifndef TL_CONTEXT_H
#define TL_CONTEXT_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/context_state.h"
#include "runtime/exit_rule.h"
#include "runtime/forward.h"


/* TL_OK, or a clear error when a generation stream over ctx is still open. */
tl_status tl_context_check_free(const struct tl_context *ctx);

/* The longest sequence a context of the model may hold: the load option, else the file's. */
int tl_model_max_seq(const struct tl_model *m);
/* Create with resolved options (each 0 = the model's value), with the model's KV policy. */
tl_status tl_context_open(struct tl_model *model, int max_seq, int max_depth,
                          int prefill_chunk, struct tl_context **out);
/* tl_context_open with a KV policy and a cache window of its own (resolved; NULL = the
 * model's). With a window the context holds up to TL_CACHE_WINDOW_MAX_POS positions
 * whatever max_seq is, and its prefill chunk is at most the window. */
tl_status tl_context_open_with(struct tl_model *model, int max_seq, int max_depth, int prefill_chunk,
                               const tl_kv_choice *kv_policy, const tl_cache_window *window,
                               struct tl_context **out);
/* TL_OK, or a clear TL_ERR_UNSUPPORTED naming `what` when the context has a cache window
 * (its ring holds only the last positions). */
tl_status tl_context_check_no_window(const struct tl_context *ctx, const char *what);
void tl_context_close(struct tl_context *ctx);
/* Whether the model's contexts can keep kv_policy store_h: a contiguous cache on a
 * backend that runs every step as it comes; else TL_ERR_UNSUPPORTED naming why. */
tl_status tl_context_check_store_h(const struct tl_model *model);

/* The loop depth an append at `depth` (0 = the sequence's, else the model default)
 * would run at; an error when out of range or different from the sequence's. */
tl_status tl_context_resolve_depth(const struct tl_context *ctx, int32_t depth, int *resolved);
/* Adaptive depth for appends to ctx at `depth` (0 = the sequence's or the model's): the
 * rule (NULL or fixed: none) or n given depths (NULL: none; each in 1..the depth), not both;
 * errors name `field`. Not with kept loop states (a deeper pass would continue rows at
 * mixed depths). */
tl_status tl_context_check_exit(const struct tl_context *ctx, const tl_exit_rule *rule, const int32_t *given,
                                size_t n, int32_t depth, const char *field);
/* Check token ids against the vocabulary. */
tl_status tl_context_check_tokens(const struct tl_context *ctx, const int32_t *tokens,
                                  size_t n);
/* Append tokens (validated here) in chunks and produce `out` (NULL = nothing). On
 * failure the sequence keeps its previous length. */
tl_status tl_context_eval(struct tl_context *ctx, const int32_t *tokens, size_t n,
                          int32_t depth, const tl_forward_out *out);
/* One decode step of several sequences at once: tokens[i] is appended to ctxs[i] (n
 * distinct contexts of one model, each with room for it) at its sequence's depth (the
 * model default for an empty one), producing outs[i] (last_logits / last_token with
 * `sample` only; outs may be NULL). The rows share batched forward passes (forward.h,
 * TL_ROWS_BATCH), rows of different depths the iterations they have in common. On failure no sequence's length changes, except with a warm state
 * init, whose rows run one by one (each position starts from the previous one's state). */
tl_status tl_context_eval_batch(struct tl_context *const *ctxs, const int32_t *tokens, size_t n,
                                const tl_forward_out *outs);
/* Append tokens computed at draft_depth, shallower than (or equal to) the sequence's
 * depth, for a speculative draft: the prelude and the first draft_depth loop iterations
 * write what the sequence's depth would, the coda does not, so the caller must truncate
 * these positions (tl_context_set_length) before the sequence goes on at its depth. */
tl_status tl_context_eval_draft(struct tl_context *ctx, const int32_t *tokens, size_t n,
                                int draft_depth, const tl_forward_out *out);
/* Append tokens[0..n) at the sequence's depth as a speculative verification whose first
 * n - 1 rows resume from their drafts at depth `from` (forward.h, TL_START_RESUMED: n <= the chunk
 * rows, no warm state init), and produce `out`. */
tl_status tl_context_eval_resumed(struct tl_context *ctx, const int32_t *tokens, size_t n,
                                 int from, const tl_forward_out *out, tl_act kept_e, tl_act kept_s);
/* The last position's logits of `tokens` (a fresh sequence) at every depth 1..max_depth,
 * out[(depth-1) * vocab ..]; the prelude and the loop iterations are shared between
 * depths when the tokens fit one chunk and the state init is not warm. The context is
 * empty afterwards. */
tl_status tl_context_logit_lens(struct tl_context *ctx, const int32_t *tokens, size_t n,
                                int max_depth, float *logits_per_depth);
/* Keep every position's loop state from the next pass on (a no-op when the context keeps
 * them already): what tl_context_eval_deeper continues from. Sets *added when this call
 * allocated them (added may be NULL). Not for a warm state init, a model without a loop
 * or an approximate KV policy. */
tl_status tl_context_keep_loop_states(struct tl_context *ctx, int *added);
void tl_context_drop_loop_states(struct tl_context *ctx);
/* Run the whole sequence on from its depth to `depth` (from its kept loop states: the
 * prelude and the iterations already run are not repeated), rewrite the coda's K/V and
 * produce `out`, whose per-row fields cover the sequence's positions; the sequence's
 * depth is then `depth`. The caller checks that the context keeps its states, holds
 * tokens and that depth is in [its depth, max_depth]. On failure the context is emptied
 * (positions would be left at two depths). */
tl_status tl_context_eval_deeper(struct tl_context *ctx, int depth, const tl_forward_out *out);
/* (Paged KV: the pages are taken or copied before any chunk, so a full pool's
 * TL_ERR_OUT_OF_MEMORY leaves the sequence as it was.) */
/* Counts `bytes` (negative: frees) of a buffer the context's user holds on its backend
 * (a stream's drafts' states) in the context's share of the memory report. */
void tl_context_count_buffer(struct tl_context *ctx, int64_t bytes);
/* Length counters used by the API calls of the same names. The K/V rows past the length
 * stay (a speculative verification resumes drafts written there) until tl_context_trim. */
void tl_context_set_length(struct tl_context *ctx, size_t n_keep);
/* Give the paged KV cache's pages past the sequence's length back to the pool (a no-op
 * for a contiguous cache). */
void tl_context_trim(struct tl_context *ctx);
tl_status tl_context_clone(const struct tl_context *ctx, struct tl_context **out);
/* The context's state init for a tl_state_init_choice (0 = the model's): allocates or
 * frees the warm states and empties the sequence when it changes. Warm is refused on a
 * model without a loop and on a context that keeps its loop states. */
tl_status tl_context_set_state_init(struct tl_context *ctx, int32_t choice);

#endif

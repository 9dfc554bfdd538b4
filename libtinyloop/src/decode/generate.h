/* generate.h — autoregressive generation on a context: prompt validation, chunked
 * prefill, then one token per step (sample, then feed it back; or, speculatively,
 * several verified at once) until a stop condition. tl_stream is the state machine;
 * the callback and buffer forms of the API are loops over it. */
#ifndef TL_GENERATE_H
#define TL_GENERATE_H

#include <stddef.h>
#include <stdint.h>

#include "decode/stream.h"
#include "runtime/context.h"


/* Validate everything, then prefill the prompt into ctx (continuing its sequence).
 * max_tokens_cap bounds opts->max_tokens (an output buffer's capacity; SIZE_MAX =
 * none). may_chain = 0 keeps greedy steps off the device's chain (a stream stepped in
 * batches). On failure nothing has been appended and g holds nothing to free. */
tl_status tl_stream_begin(struct tl_stream *g, struct tl_context *ctx, const int32_t *prompt,
                          size_t n_prompt, const tl_generate_options *opts,
                          size_t max_tokens_cap, int may_chain);
/* tl_stream_begin on a context that holds a sequence and keeps its loop states: the
 * sequence is first continued to `depth` (>= its depth, <= the context's max_depth; the
 * caller checks) by tl_context_eval_deeper, then the prompt (n_prompt may be 0) appended at
 * it; the first token follows the last of them. On failure the context may hold the
 * deepened sequence (or none, when the deepening failed). */
tl_status tl_stream_begin_deeper(struct tl_stream *g, struct tl_context *ctx, int depth, const int32_t *prompt,
                                 size_t n_prompt, const tl_generate_options *o, size_t max_tokens_cap,
                                 int may_chain);
/* The next token, or -1 with *reason set once generation has stopped. */
tl_status tl_stream_step(struct tl_stream *g, int32_t *token, tl_stop_reason *reason);
/* One step of each of n streams (over distinct contexts of one model): tokens[i],
 * reasons[i] and statuses[i] as tl_stream_step's. The streams whose step is one plain
 * forward pass share a batched one (tl_context_eval_batch); the others (drafts, chained
 * steps, the first token after the prompt) step on their own. */
void tl_streams_step(struct tl_stream *const *gs, size_t n, int32_t *tokens, tl_stop_reason *reasons,
                     tl_status *statuses);
/* Record that the consumer stopped the stream (callback abort). */
void tl_stream_abort(struct tl_stream *g);
/* The stream's context is being freed under it: the stream ends (TL_STOP_ABORTED) and
 * never touches the context again. */
void tl_stream_detach(struct tl_stream *g);
void tl_stream_fill_result(const struct tl_stream *g, tl_generate_result *result);
/* The depth of the pass that chose the last returned token (tl_stream_token_depth). */
tl_status tl_stream_last_depth(const struct tl_stream *g, int32_t *depth);
/* The last returned token's log-probability and alternatives (tl_stream_logprobs). */
tl_status tl_stream_token_logprobs(const struct tl_stream *g, float *token_logprob, int32_t *top_ids,
                                   float *top_logprobs);
/* Free what begin allocated (not ctx, unless owned_ctx). */
void tl_stream_end(struct tl_stream *g);

/* Run a begun stream to its end: tokens go to out_tokens (may be NULL) and/or the
 * callback; fills result (may be NULL) and ends the stream. */
tl_status tl_stream_run(struct tl_stream *g, int32_t *out_tokens, tl_token_callback callback,
                        void *user_data, tl_generate_result *result);
/* Whole generation: tokens go to out_tokens (may be NULL) and/or the callback. */
tl_status tl_generate_run(struct tl_context *ctx, const int32_t *prompt, size_t n_prompt,
                          const tl_generate_options *opts, int32_t *out_tokens,
                          size_t out_capacity, tl_token_callback callback, void *user_data,
                          tl_generate_result *result);

#endif

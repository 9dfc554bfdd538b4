/* generate.h — autoregressive generation on a context: prompt validation, chunked
 * prefill, then one token per step (sample, then feed it back; or, speculatively,
 * several verified at once) until a stop condition. tl_stream is the state machine;
 * the callback and buffer forms of the API are loops over it. */
#ifndef TL_GENERATE_H
#define TL_GENERATE_H

#include <stddef.h>
#include <stdint.h>

#include "decode/grammar.h"
#include "decode/logit_adjust.h"
#include "decode/sampling.h"
#include "decode/speculative.h"
#include "runtime/context.h"

/* How each step's token is chosen (generate.c). */
typedef struct tl_token_pick {
    tl_sampler sampler;
    tl_logit_adjust adjust;        /* logit_bias and presence / frequency penalties     */
    tl_grammar_matcher *grammar;   /* opts->grammar's state; NULL without               */
    float *logits;                 /* vocab floats: logits of the next position (host sampling) */
    int greedy;                    /* plain argmax: the backend picks the token, no logits */
    int backend_samples;           /* the backend's sample op picks the token, no logits */
    tl_sample_step step;           /* backend_samples: the step being evaluated */
    int32_t next;                  /* greedy / backend_samples: the token of the next position */
    int host_picks;                /* logprobs, adjust or grammar: every step's token is picked
                                      from its logits on the host                       */
} tl_token_pick;

/* Log-probabilities of the returned tokens (tl_generate_options.logprobs; generate.c). */
typedef struct tl_stream_lp {
    int on;                        /* kept for every step                               */
    int32_t top;                   /* alternatives kept per step                        */
    float *row;                    /* [vocab]: a step's logits before sampling edits them */
    float log_norm;                /* the step's log(sum(exp(logits)))                  */
    int has;                       /* the fields below are the last returned token's    */
    float token;
    int32_t top_ids[TL_MAX_TOP_LOGPROBS];
    float top_lps[TL_MAX_TOP_LOGPROBS];
} tl_stream_lp;

struct tl_stream {
    struct tl_context *ctx;
    struct tl_context *owned_ctx;  /* freed with the stream (pull iterator without ctx) */
    tl_token_pick pick;
    tl_speculation spec;           /* self-speculative decoding (speculative.h)         */
    tl_stream_lp lp;
    int32_t depth;                 /* the sequence's resolved depth */
    int32_t eos;                   /* -1 = none */
    int32_t *stop_tokens;          /* copies of the stop sequences */
    uint32_t *stop_lengths;
    uint32_t n_stop;
    int32_t *generated;            /* tokens produced so far */
    size_t n_generated, max_tokens;
    int has_pending;               /* generated[n_generated-1] not yet fed to ctx */
    int chained;                   /* greedy steps chained on the device, one step ahead */
    int queued;                    /* chained: argmax results not yet read (0-2) */
    int ahead;                     /* chained: generated[n_generated-1] was fed ahead of need */
    size_t base;                   /* the sequence's length after the prompt            */
    int finished;
    tl_stop_reason stop_reason;
    uint32_t n_prompt;
    uint32_t n_cached;             /* of the prompt, tokens loaded from a prefix cache */
    double prefill_seconds, decode_seconds;
};

/* Validate everything, then prefill the prompt into ctx (continuing its sequence).
 * max_tokens_cap bounds opts->max_tokens (an output buffer's capacity; SIZE_MAX =
 * none). may_chain = 0 keeps greedy steps off the device's chain (a stream stepped in
 * batches). On failure nothing has been appended and g holds nothing to free. */
tl_status tl_stream_begin(struct tl_stream *g, struct tl_context *ctx, const int32_t *prompt,
                          size_t n_prompt, const tl_generate_options *opts,
                          size_t max_tokens_cap, int may_chain);
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

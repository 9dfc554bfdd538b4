/* stream.h — struct tl_stream, the state of one generation: its token picking and
 * log-probabilities (written by generate.c) and its speculative state (written by
 * speculative.c and tree_speculative.c). Data only: the files that step a stream include
 * this, not each other. */
#ifndef TL_STREAM_H
#define TL_STREAM_H

#include <stddef.h>
#include <stdint.h>

#include "decode/grammar.h"
#include "decode/logit_adjust.h"
#include "decode/sampling.h"
#include "tinyloop/tinyloop.h"

struct tl_context;    /* runtime/context.h */

#define TL_MAX_DRAFT 32
#define TL_DEFAULT_DRAFT 4

struct tl_buf;        /* backend.h */
struct tl_tree_spec;  /* tree_speculative.c */

/* A stream's speculative state, written here and by tree rounds (tree_speculative.c). */
typedef struct tl_speculation {
    int32_t draft_depth;           /* loop depth of the drafts (0: no speculation)      */
    int32_t n_draft;               /* tokens drafted per verification at most           */
    double draft_p_min;            /* drafting stops below this top probability         */
    int32_t *fed;                  /* [n_draft + 1]: the pending token, then the drafts */
    int32_t *ready;                /* [n_draft + 1]: verified tokens, returned in order */
    double *q;                     /* sampling: [n_draft][vocab] the drafts' distributions, */
    int32_t *q_ids;                /* as supports: probabilities and their ids in order,   */
    int *q_n;                      /* [n_draft] entries each (tl_sample_distribution)      */
    double *p;                     /* sampling: [vocab] a verification row's distribution */
    int32_t *p_ids;                /* and its ids                                         */
    float *rows;                   /* sampling: [n_draft + 1][vocab] verification logits   */
    struct tl_buf *states;         /* backend rows: the drafts' injection sources [n_draft],
                                      then their loop states [n_draft]; NULL when the
                                      verification does not resume                       */
    struct tl_tree_spec *tree;     /* tree speculation's round state; NULL for linear drafts */
    size_t n_ready, ready_at;      /* ready[ready_at..n_ready) not yet returned          */
    uint32_t n_drafted, n_accepted;
} tl_speculation;

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
    /* adaptive depth (tl_generate_options.exit) */
    tl_exit_rule exit;             /* kind fixed: every pass at depth                   */
    int32_t pass_depth;            /* the depth of the last pass that chose a token     */
    int32_t last_depth;            /* of the last token returned                        */
    int32_t *token_depths;         /* the caller's: each returned token's pass's depth  */
    uint64_t depth_sum;
    double prefill_seconds, decode_seconds;
};

#endif

/* speculative.h — self-speculative decoding inside a generation stream: draft tokens
 * one by one at a shallow loop depth, verify them all in one pass at the stream's depth,
 * keep the drafts the verification accepts plus one token of its own (greedy: the
 * longest agreeing prefix; sampling: speculative sampling's acceptance). */
#ifndef TL_SPECULATIVE_H
#define TL_SPECULATIVE_H

#include <stddef.h>
#include <stdint.h>

#include "tinyloop/tinyloop.h"

#define TL_MAX_DRAFT 32
#define TL_DEFAULT_DRAFT 4

struct tl_stream;     /* generate.h */
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

/* Check o->draft_depth / o->n_draft against the stream (its depth, model) and
 * allocate the round buffers; nothing to do when o->draft_depth is 0. */
tl_status tl_speculative_begin(struct tl_stream *g, const tl_generate_options *o);
/* The next verified token: the oldest one not yet returned, after a draft-and-verify
 * round when none is left (g->generated's last token is then the one fed first). */
tl_status tl_speculative_next(struct tl_stream *g, int32_t *token);
/* Whether the last token returned is not in the context yet (it is fed, first, by the
 * next round). */
int tl_speculative_pending(const struct tl_stream *g);
/* At the end of the stream: drop what a round put in the context past what plain
 * decoding would hold (the generated tokens but the last, or all of them after EOS). */
void tl_speculative_settle(struct tl_stream *g, tl_stop_reason reason);
/* Frees the drafts' states, which live in the context's backend: before the stream
 * loses its context (tl_stream_detach), and from tl_speculative_free. */
void tl_speculative_release_states(struct tl_stream *g);
void tl_speculative_free(struct tl_stream *g);

#endif

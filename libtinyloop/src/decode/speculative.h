/* speculative.h — self-speculative decoding inside a generation stream: draft tokens
 * one by one at a shallow loop depth, verify them all in one pass at the stream's depth,
 * keep the drafts the verification accepts plus one token of its own (greedy: the
 * longest agreeing prefix; sampling: speculative sampling's acceptance). */
#ifndef TL_SPECULATIVE_H
#define TL_SPECULATIVE_H

#include <stddef.h>
#include <stdint.h>

#include "tinyloop/tinyloop.h"

struct tl_stream;     /* decode/stream.h */

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

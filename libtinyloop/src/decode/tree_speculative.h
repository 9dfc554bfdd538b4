/* tree_speculative.h — tree speculation inside a generation stream (docs/api.md, "Tree
 * speculation"): each round drafts a small token tree at the draft depth, verifies every
 * node in one tree-masked pass at the stream's depth, and keeps the longest path the
 * verification agrees with plus its next token (greedy only). */
#ifndef TL_TREE_SPECULATIVE_H
#define TL_TREE_SPECULATIVE_H

#include "tinyloop/tinyloop.h"

struct tl_stream;     /* decode/stream.h */

#define TL_TREE_MAX_WIDTH 8

/* Check o's tree shape (tree_widths, tree_budget) against the stream and the backend, and
 * allocate the round's state; draft_depth is resolved already. */
tl_status tl_tree_speculative_begin(struct tl_stream *g, const tl_generate_options *o, int32_t draft_depth);
/* One round: draft, verify, keep the agreeing path; fills g->spec.ready as a linear round. */
tl_status tl_tree_speculative_round(struct tl_stream *g);
void tl_tree_speculative_free(struct tl_stream *g);

#endif

/* escalation.h — consistency-escalation scoring (tl_score_with_consistency_escalation). */
#ifndef TL_ESCALATION_H
#define TL_ESCALATION_H

#include "runtime/context.h"

/* Scores tokens[0..n) (n >= 1) on ctx (emptied first, and after) at min_depth, then at
 * twice the depth (capped at max_depth), and so on, until the share of the n - 1 greedy
 * predictions that changed from the previous depth is at most max_changed or max_depth
 * is reached; logprobs and entropies (n - 1 each) hold the last depth's, *depth_used that
 * depth. One token predicts nothing: *depth_used = min_depth, no pass runs. The depths
 * are checked by the caller: 1 <= min_depth <= max_depth <= the context's max_depth, on a
 * model with a loop. */
tl_status tl_context_escalate(struct tl_context *ctx, const int32_t *tokens, size_t n,
                              int min_depth, int max_depth, float max_changed,
                              float *logprobs, float *entropies, int32_t *depth_used);

#endif

/* logprobs.h — log-probability summaries of one row of logits on the host: what a
 * scoring call or a generation stream reports besides the token itself (the model's
 * own distribution, log_softmax of the logits, before any sampling transform). */
#ifndef TL_LOGPROBS_H
#define TL_LOGPROBS_H

#include <stdint.h>

/* The k most likely tokens of a row (k <= n): ids[j] and their log-probabilities
 * logprobs[j] = x[ids[j]] - log_sum_exp, most likely first, the lower id first on ties
 * (log_sum_exp: the row's, as the backend's log-softmax gives it). */
void tl_top_logprobs(const float *x, int n, double log_sum_exp, int k, int32_t *ids, float *logprobs);

#endif

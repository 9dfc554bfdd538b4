/* sample_row.h — a sampling step prepared on the host (tl_sampler_begin_step,
 * decode/sampling.h) applied to vocab logits in host memory: the CPU backend's sample op
 * and the host path of every other backend, and the distributions speculative sampling
 * compares (docs/sampling.md). */
#ifndef TL_SAMPLE_ROW_H
#define TL_SAMPLE_ROW_H

#include <stdint.h>

#include "base/sample_math.h"

/* The token of a prepared step from vocab logits in host memory (modified in place
 * by the penalty), with the step's host_scratch. */
int32_t tl_sample_row(float *logits, int vocab, const tl_sample_step *step);

/* The distribution a prepared step draws from (after the penalty, applied to logits in
 * place), as its support: ids[0..n) in increasing order with probs[i] the weight of
 * ids[i] over the kept total; a greedy step (or one where nothing has weight) is its
 * argmax with probability 1. Returns n (>= 1); ids and probs have room for vocab entries.
 * Speculative sampling compares the draft's and the full depth's distributions with it:
 * with top-k a support has k entries, so nothing after the candidates' selection walks
 * the whole vocabulary. */
int tl_sample_distribution(float *logits, int vocab, const tl_sample_step *step, int32_t *ids,
                           double *probs);

/* The probability of token `id` in a support (ids increasing), 0 outside it. */
double tl_sample_probability(const int32_t *ids, const double *probs, int n, int32_t id);

/* A token drawn in proportion to weights[0..n) of ids[0..n) (>= 0, summing to total > 0),
 * walking them in order with the 53-bit uniform of `random`; -1 when no weight is
 * positive. */
int32_t tl_sample_from(const int32_t *ids, const double *weights, int n, double total, uint64_t random);

/* Speculative sampling's residual: p's support becomes what p has beyond q,
 * max(p - q, 0) (the ids only q holds would be 0 there and stay out); returns its total.
 * Both supports have increasing ids. */
double tl_sample_residual(double *p, const int32_t *p_ids, int n_p, const double *q, const int32_t *q_ids,
                          int n_q);

#endif

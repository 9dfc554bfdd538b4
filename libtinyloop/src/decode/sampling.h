/* sampling.h — picking the next token from a row of logits: repetition penalty,
 * then greedy (temperature 0) or top-k -> temperature -> min-p -> top-p -> a draw
 * from a seeded generator (docs/sampling.md). The same seed and inputs give the same
 * tokens, on the host and on every backend's sample op.
 *
 * A step is prepared on the host (tl_sampler_begin_step: the penalty's tokens and the
 * step's random number), then applied to the logits where they are: tl_sample_row
 * (base/sample_row.h) on host memory, or a backend's sample op (backend.h) on its own
 * buffers. */
#ifndef TL_SAMPLING_H
#define TL_SAMPLING_H

#include <stddef.h>
#include <stdint.h>

#include "base/sample_row.h"
#include "tinyloop/tinyloop.h"

typedef struct tl_sampler {
    int vocab;
    float temperature, top_p, min_p, repetition_penalty;
    int top_k, repetition_window;
    uint64_t rng[4];           /* xoshiro256** state */
    /* scratch, sized once per generation */
    uint32_t *seen;            /* penalty bookkeeping: stamp per token */
    uint32_t stamp;
    int32_t *penalized;        /* the distinct tokens of the current window */
    tl_sample_candidate *cand; /* a step's candidates on the host (temperature > 0) */
} tl_sampler;

/* Check the sampling fields of opts (naming a bad one) and size the scratch. */
tl_status tl_sampler_init(tl_sampler *s, const tl_generate_options *opts, int vocab);
void tl_sampler_free(tl_sampler *s);

/* Prepare the next step for the sequence past[0..n_past) followed by
 * next[0..n_next) (the repetition penalty looks at its last window tokens). Draws one
 * number from the generator when temperature > 0. step->penalized points into s and
 * stays valid until the next call. */
void tl_sampler_begin_step(tl_sampler *s, const int32_t *past, size_t n_past, const int32_t *next,
                           size_t n_next, tl_sample_step *step);

/* The generator's next output (a draw outside the steps: speculative acceptance), and
 * a number in [0, 1) made of its top 53 bits. */
uint64_t tl_sampler_random(tl_sampler *s);
double tl_sampler_uniform(tl_sampler *s);

/* Both at once: the next token after `history`. */
int32_t tl_sampler_sample(tl_sampler *s, float *logits, const int32_t *history, size_t n_history);

#endif

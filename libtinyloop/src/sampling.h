/* sampling.h — picking the next token from a row of logits: repetition penalty,
 * then greedy (temperature 0) or top-k -> temperature -> min-p -> top-p -> a draw
 * from a seeded generator. The same seed and inputs give the same tokens. */
#ifndef TL_SAMPLING_H
#define TL_SAMPLING_H

#include <stddef.h>
#include <stdint.h>

#include "tinyloop/tinyloop.h"

typedef struct tl_sampler {
    int vocab;
    float temperature, top_p, min_p, repetition_penalty;
    int top_k, repetition_window;
    uint64_t rng[4];           /* xoshiro256** state */
    /* scratch sized once per generation */
    struct tl_candidate *cand; /* candidate tokens with their logit, then weight */
    uint32_t *seen;            /* penalty bookkeeping: stamp per token */
    uint32_t stamp;
} tl_sampler;

/* Check the sampling fields of opts (naming a bad one) and size the scratch. */
tl_status tl_sampler_init(tl_sampler *s, const tl_generate_options *opts, int vocab);
void tl_sampler_free(tl_sampler *s);
/* The next token. logits (vocab floats) are modified in place; history is the
 * sequence so far (the repetition penalty looks at its last window tokens). */
int32_t tl_sampler_sample(tl_sampler *s, float *logits, const int32_t *history, size_t n_history);

#endif

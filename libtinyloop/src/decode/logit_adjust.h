/* logit_adjust.h — OpenAI-style adjustments of a step's logits before sampling
 * (docs/sampling.md, step 0): a bias per listed token (logit_bias) and the presence and
 * frequency penalties over the tokens generated so far. They run on the host, on the
 * step's logits row, so a generation that uses them samples on the host. */
#ifndef TL_LOGIT_ADJUST_H
#define TL_LOGIT_ADJUST_H

#include <stdint.h>

#include "tinyloop/tinyloop.h"

typedef struct tl_logit_adjust {
    int active;               /* any adjustment at all */
    int vocab;
    int32_t *bias_ids;        /* the caller's logit_bias tokens, in order */
    size_t n_bias;
    float *bias;              /* [vocab]: each token's bias (0 unless listed); NULL without */
    uint8_t *listed;          /* [vocab]: 1 for the logit_bias tokens; NULL without      */
    float presence, frequency;
    uint32_t *counts;         /* [vocab] times each token was generated; NULL without penalties */
    int32_t *generated;       /* the distinct generated tokens, in order of first use */
    int32_t n_generated;
} tl_logit_adjust;

/* Check opts' logit_bias and penalties against the vocabulary and keep copies; a is
 * zeroed first (inactive when nothing is asked). */
tl_status tl_logit_adjust_init(tl_logit_adjust *a, const tl_generate_options *o, int vocab);
/* logits[t] = float(double(logits[t]) + bias[t] - (counts[t] * frequency + [counts[t] > 0]
 * * presence)), for the listed and the generated tokens. */
void tl_logit_adjust_apply(const tl_logit_adjust *a, float *logits);
/* Count a generated token for the penalties. */
void tl_logit_adjust_count(tl_logit_adjust *a, int32_t token);
void tl_logit_adjust_free(tl_logit_adjust *a);

#endif

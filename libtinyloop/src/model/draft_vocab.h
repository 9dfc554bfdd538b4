/* draft_vocab.h — the draft vocabulary of self-speculative decoding (docs/api.md,
 * "Draft vocabulary"): a draft scores only the N most frequent tokens of the model's
 * training text, so its head reads N rows of the output matrix instead of vocab rows.
 * Verification still scores the whole vocabulary, so greedy output is unchanged and
 * sampled output keeps its distribution; only the share of drafts kept can move. */
#ifndef TL_DRAFT_VOCAB_H
#define TL_DRAFT_VOCAB_H

#include <stdint.h>

#include "base/tensor.h"
#include "tinyloop/tinyloop.h"

typedef struct tl_draft_vocab {
    int32_t n;            /* tokens in it; 0 = drafts score the whole vocabulary */
    int32_t *ids;         /* the n token ids, ascending                          */
    tl_tensor head;       /* rows ids[0..n) of the output matrix, the file's layout */
    void *memory;         /* owns ids and head's planes                          */
    uint64_t head_bytes;  /* bytes of head's planes                              */
} tl_draft_vocab;

/* TL_ERR_FORMAT naming `path` unless every frequency is finite and >= 0. */
tl_status tl_draft_vocab_check_frequency(const tl_tensor *frequency, const char *path);
/* The n most frequent tokens by `frequency` (a checked [vocab] vector; ties go to the
 * lower id) and their rows of `output`. n >= the vocabulary leaves out->n = 0. */
tl_status tl_draft_vocab_build(const tl_tensor *output, const tl_tensor *frequency, int32_t n,
                               tl_draft_vocab *out);
void tl_draft_vocab_free(tl_draft_vocab *dv);

/* Spreads a draft's n logits (at the start of `logits`) to their token ids in place,
 * with -inf at every other token of the `vocab` floats. */
void tl_draft_vocab_scatter(const tl_draft_vocab *dv, float *logits, int32_t vocab);

#endif

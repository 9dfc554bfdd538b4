/* logit_adjust.c — see logit_adjust.h. */
#include "decode/logit_adjust.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"

/* OpenAI's ranges: penalties in [-2, 2], biases in [-100, 100]. */
#define MAX_PENALTY 2.0f
#define MAX_BIAS 100.0f

tl_status tl_logit_adjust_init(tl_logit_adjust *a, const tl_generate_options *o, int vocab) {
    memset(a, 0, sizeof *a);
    a->vocab = vocab;
    if (!(fabsf(o->presence_penalty) <= MAX_PENALTY))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "presence_penalty %g is out of range [-2, 2]",
                       (double)o->presence_penalty);
    if (!(fabsf(o->frequency_penalty) <= MAX_PENALTY))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "frequency_penalty %g is out of range [-2, 2]",
                       (double)o->frequency_penalty);
    size_t n = o->n_logit_bias;
    if (n > 0 && (!o->logit_bias_ids || !o->logit_bias_values))
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "n_logit_bias is %zu but logit_bias_ids or logit_bias_values is NULL", n);
    if (n > (size_t)vocab)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_logit_bias %zu exceeds the vocabulary (%d)", n, vocab);
    a->presence = o->presence_penalty;
    a->frequency = o->frequency_penalty;
    int penalties = a->presence != 0.0f || a->frequency != 0.0f;
    a->active = penalties || n > 0;
    if (!a->active) return TL_OK;
    a->counts = penalties ? calloc((size_t)vocab, sizeof *a->counts) : NULL;
    a->generated = penalties ? malloc((size_t)vocab * sizeof *a->generated) : NULL;
    a->bias = n ? calloc((size_t)vocab, sizeof *a->bias) : NULL;
    a->bias_ids = n ? malloc(n * sizeof *a->bias_ids) : NULL;
    a->listed = n ? calloc((size_t)vocab, 1) : NULL;
    if ((penalties && (!a->counts || !a->generated)) || (n && (!a->bias || !a->bias_ids || !a->listed))) {
        tl_logit_adjust_free(a);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate the logit adjustments of %d tokens", vocab);
    }
    tl_status st = TL_OK;
    for (size_t i = 0; i < n && st == TL_OK; i++) {
        int32_t t = o->logit_bias_ids[i];
        float b = o->logit_bias_values[i];
        if (t < 0 || t >= vocab)
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "logit_bias token %d at index %zu is out of range [0, %d)",
                         t, i, vocab);
        else if (!(fabsf(b) <= MAX_BIAS))
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "logit_bias of token %d is %g, out of range [-100, 100]",
                         t, (double)b);
        else if (a->listed[t])
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "token %d appears twice in logit_bias", t);
        else {
            a->listed[t] = 1;
            a->bias_ids[i] = t;
            a->bias[t] = b;
        }
    }
    if (st != TL_OK) {
        tl_logit_adjust_free(a);
        return st;
    }
    a->n_bias = n;
    return TL_OK;
}

/* One token's adjusted logit: c * frequency is exact in double (c is an integer below
 * 2^29, frequency a float), so contracting it into a fused multiply-add changes nothing. */
static float adjusted(const tl_logit_adjust *a, int32_t t, float logit) {
    double bias = a->bias ? (double)a->bias[t] : 0.0;
    uint32_t c = a->counts ? a->counts[t] : 0;
    double penalty = c ? (double)c * (double)a->frequency + (double)a->presence : 0.0;
    return (float)((double)logit + bias - penalty);
}

void tl_logit_adjust_apply(const tl_logit_adjust *a, float *logits) {
    if (!a->active) return;
    for (size_t i = 0; i < a->n_bias; i++) {
        int32_t t = a->bias_ids[i];
        logits[t] = adjusted(a, t, logits[t]);
    }
    for (int32_t i = 0; i < a->n_generated; i++) {   /* the generated ones not listed */
        int32_t t = a->generated[i];
        if (!a->listed || !a->listed[t]) logits[t] = adjusted(a, t, logits[t]);
    }
}

void tl_logit_adjust_count(tl_logit_adjust *a, int32_t token) {
    if (!a->counts || token < 0 || token >= a->vocab) return;
    if (a->counts[token]++ == 0) a->generated[a->n_generated++] = token;
}

void tl_logit_adjust_free(tl_logit_adjust *a) {
    free(a->bias_ids);
    free(a->bias);
    free(a->listed);
    free(a->counts);
    free(a->generated);
    a->bias_ids = NULL;
    a->bias = NULL;
    a->listed = NULL;
    a->counts = NULL;
    a->generated = NULL;
    a->active = 0;
}

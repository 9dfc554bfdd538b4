/* exit_rule.h — adaptive depth (docs/model.md, "Adaptive depth"): which rows of a pass
 * stop their loop after which iteration. The tracker holds each row's rule and what its
 * rule compares from iteration to iteration, on the host; forward.c feeds it the rows'
 * states, next-token logits or gate logits after each iteration and runs only the rows
 * it keeps running. */
#ifndef TL_EXIT_RULE_H
#define TL_EXIT_RULE_H

#include <stddef.h>
#include <stdint.h>

#include "tinyloop/tinyloop.h"

/* TL_OK, or TL_ERR_INVALID_ARGUMENT / TL_ERR_UNSUPPORTED naming `field` (e.g. "exit")
 * for a rule the model cannot run (gate without an exit gate) or out of range. */
tl_status tl_exit_rule_check(const tl_exit_rule *rule, int has_exit_gate, int has_loop, const char *field);
/* Whether a rule may stop rows early (kind != fixed). NULL = fixed. */
static inline int tl_exit_rule_active(const tl_exit_rule *rule) {
    return rule && rule->kind != TL_EXIT_FIXED;
}

typedef struct tl_exit_tracker {
    int n, d, vocab, depth;              /* rows, state width, logits per probe row, the
                                            deepest iteration any row may run */
    const tl_exit_rule *const *rules;    /* row r's rule (entries may be NULL: fixed) */
    const int32_t *given;                /* row r's depth given instead; NULL = none */
    const int32_t *limits;               /* row r's deepest iteration (its sequence's depth);
                                            NULL = depth */
    int32_t *ran;                        /* iterations row r has run */
    unsigned char *running;              /* row r still in the loop */
    float *states;                       /* rows' states after the last observed iteration
                                            (latent_delta), n x d */
    double *dist;                        /* rows' last distributions (kl), n x vocab */
    double *entropy;                     /* rows' last entropies */
    int32_t *top, *stable;               /* rows' last most likely token, iterations unchanged */
    double *survival;                    /* gate: prod (1 - lambda_j) so far */
    int wants_states, wants_probe, wants_gate;
} tl_exit_tracker;

/* A tracker of n rows at most `depth` iterations (row r's rule rules[r], its limit
 * limits[r] <= depth or NULL; given: depths given per row, or NULL). vocab: the probe's
 * logits per row (kl, entropy, argmax). */
tl_status tl_exit_tracker_init(tl_exit_tracker *t, int n, int d, int vocab, int depth,
                               const tl_exit_rule *const *rules, const int32_t *limits,
                               const int32_t *given);
void tl_exit_tracker_free(tl_exit_tracker *t);

/* What row r's rule reads after iteration it (it = 0: the initial state). */
int tl_exit_needs_state(const tl_exit_tracker *t, int r, int it);
int tl_exit_needs_probe(const tl_exit_tracker *t, int r, int it);
int tl_exit_needs_gate(const tl_exit_tracker *t, int r, int it);

/* Row r after iteration it (it = 0: the initial state), with what its rule reads (NULL /
 * NaN where not needed): 1 when its loop stops here (it < t->depth), else 0. A stopped
 * row's ran[r] is its depth. */
int tl_exit_observe(tl_exit_tracker *t, int r, int it, const float *state, const float *logits,
                    float gate_logit);

#endif

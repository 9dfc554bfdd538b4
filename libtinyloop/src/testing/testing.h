/* testing.h — entry points for the test suite only, not part of the public API
 * (tinyloop.h): exported by libtinyloop_testing.so (the core plus testing.c, never
 * installed), not by libtinyloop.so; tests declare them in their own cffi cdef
 * (tests/testing_hooks.py). */
#ifndef TL_TESTING_H
#define TL_TESTING_H

#include <stddef.h>
#include <stdint.h>

#include "tinyloop/tinyloop.h"

/* The tokens generation on ctx's backend would pick from n_rows rows of `vocab`
 * logits, row i as the (first_step + i)-th sampled step of a generation with the
 * sampling fields of opts (seed included), after the sequence history[0..n_history).
 * use_op 1: through the backend's sample op, on the row uploaded to a backend buffer;
 * 0: on the host (tl_sampler_sample on a copy), as a backend without the op does.
 * Vocab need not be the model's. */
TL_API tl_status tl_testing_sample_rows(tl_context *ctx, const float *logits, int32_t n_rows,
                                        int32_t vocab, const tl_generate_options *opts,
                                        const int32_t *history, size_t n_history,
                                        uint32_t first_step, int32_t use_op, int32_t *tokens);

/* The CPU kernel level (0 portable, 1 AVX2, 2 AVX-512 VNNI) this CPU and build run at
 * best, before TINYLOOP_CPU caps it (which 0), or the highest this build has kernels for
 * (which 1). */
TL_API int32_t tl_testing_cpu_level(int32_t which);

/* A speculative draft of `token` at draft_depth after ctx's sequence (which stays as it
 * was): its vocab logits, -inf outside the model's draft vocabulary when it has one, and
 * the token the draft picks. */
TL_API tl_status tl_testing_draft_logits(tl_context *ctx, int32_t token, int32_t draft_depth,
                                         float *logits, int32_t *argmax);

/* Nodes of a token tree after ctx's sequence (node i's parent parents[i] < i, -1 = the
 * sequence's last token), run as tree passes (forward.h) at `depth`: nodes [0, n_first) in one
 * pass, then the rest in a second (n_first 0: all in one); logits[i * vocab ..] = node
 * i's. The sequence's length stays; its rows past it are overwritten. */
TL_API tl_status tl_testing_tree_logits(tl_context *ctx, const int32_t *tokens, const int32_t *parents,
                                        int32_t n_nodes, int32_t n_first, int32_t depth, float *logits);

/* A grammar's masks along a path of tokens: for each step k = 0..n_tokens (before
 * tokens[k], after the ones before it), allowed[k * vocab + t] = 1 where the mask leaves
 * token t (eos too: -1 = none) and complete[k] = whether the grammar is complete. The
 * tokens are accepted whether the mask left them or not. */
TL_API tl_status tl_testing_grammar_masks(const tl_grammar *grammar, const int32_t *tokens, size_t n_tokens,
                                          int32_t eos, uint8_t *allowed, uint8_t *complete);

#endif

"""The library's test-only entry points (libtinyloop/src/testing.h). The public header
does not declare them, so the tests declare them here, in a cffi cdef of their own on
the loaded library."""

import cffi

_CDEF = """
tl_status tl_testing_sample_rows(tl_context *ctx, const float *logits, int32_t n_rows,
                                 int32_t vocab, const tl_generate_options *opts,
                                 const int32_t *history, size_t n_history,
                                 uint32_t first_step, int32_t use_op, int32_t *tokens);
int32_t tl_testing_cpu_level(int32_t which);
tl_status tl_testing_draft_logits(tl_context *ctx, int32_t token, int32_t draft_depth,
                                  float *logits, int32_t *argmax);
tl_status tl_testing_tree_logits(tl_context *ctx, const int32_t *tokens, const int32_t *parents,
                                 int32_t n_nodes, int32_t n_first, int32_t depth, float *logits);
tl_status tl_testing_grammar_masks(const tl_grammar *grammar, const int32_t *tokens, size_t n_tokens,
                                   int32_t eos, uint8_t *allowed, uint8_t *complete);
"""
_opened = {}


def hooks_of(native):
    """(ffi, lib) of the test-only entry points of the library `native` loaded."""
    key = str(native.library_path)
    if key not in _opened:
        ffi = cffi.FFI()
        ffi.include(native.ffi)
        ffi.cdef(_CDEF)
        _opened[key] = (ffi, ffi.dlopen(key))
    return _opened[key]

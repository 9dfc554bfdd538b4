/* api_structs.c — the versioned structs of tinyloop.h: struct_size handling and the
 * tl_*_default() initialisers of every options and result struct. */
#include <stdint.h>
#include <string.h>

#include "abi/api_structs.h"
#include "base/error.h"
#include "tinyloop/tinyloop.h"

/* A struct_size above this is taken for an uninitialised struct, not a newer one. */
#define TL_STRUCT_SIZE_LIMIT 4096u

/* ---- struct_size handling ----------------------------------------------------
 * Callers built against an older header pass a smaller struct: accept any size from
 * the first release's (min_size) upwards, read/write only the bytes both sides know,
 * and keep defaults for the rest. */

tl_status check_struct_size(const void *s, size_t min_size, const char *what) {
    uint32_t size;
    memcpy(&size, s, sizeof size);
    if (size < min_size || size > TL_STRUCT_SIZE_LIMIT)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "%s.struct_size is %u, expected at least %zu: initialise it with %s_default()",
                       what, size, min_size, what);
    return TL_OK;
}

/* dst (full size, already defaulted) <- the caller's src (NULL = keep defaults). */
tl_status read_struct(void *dst, size_t full, const void *src, size_t min_size,
                      const char *what) {
    if (!src) return TL_OK;
    tl_status st = check_struct_size(src, min_size, what);
    if (st != TL_OK) return st;
    uint32_t size;
    memcpy(&size, src, sizeof size);
    size_t n = size < full ? size : full;
    memcpy((char *)dst + sizeof(uint32_t), (const char *)src + sizeof(uint32_t),
           n - sizeof(uint32_t));
    return TL_OK;
}

/* The caller's dst <- src (full size), as much as dst's struct_size holds. */
void write_struct(void *dst, const void *src, size_t full) {
    uint32_t size;
    memcpy(&size, dst, sizeof size);
    size_t n = size < full ? size : full;
    memcpy((char *)dst + sizeof(uint32_t), (const char *)src + sizeof(uint32_t),
           n - sizeof(uint32_t));
}

/* ---- defaults ---------------------------------------------------------------- */

/* Every option/result struct starts with its size (the ABI's versioning): zero the
 * struct and record the size this library was built with. */
#define ZERO_VERSIONED(p)                               \
    do {                                                \
        memset((p), 0, sizeof *(p));                    \
        (p)->struct_size = (uint32_t)sizeof *(p);       \
    } while (0)

void tl_load_options_default(tl_load_options *o) {
    if (!o) return;
    ZERO_VERSIONED(o);
    o->device = "cpu";
    o->draft_vocab = -1;
}

void tl_model_info_default(tl_model_info *info) {
    if (!info) return;
    ZERO_VERSIONED(info);
}

void tl_memory_report_default(tl_memory_report *r) {
    if (!r) return;
    ZERO_VERSIONED(r);
}

void tl_context_options_default(tl_context_options *o) {
    if (!o) return;
    ZERO_VERSIONED(o);
}

void tl_score_options_default(tl_score_options *o) {
    if (!o) return;
    ZERO_VERSIONED(o);
}

void tl_escalation_options_default(tl_escalation_options *o) {
    if (!o) return;
    ZERO_VERSIONED(o);
    o->min_depth = 1;
    o->max_changed = 0.05f;
}

void tl_generate_options_default(tl_generate_options *o) {
    if (!o) return;
    ZERO_VERSIONED(o);
    o->max_tokens = 128;
    o->temperature = 0.8f;
    o->top_k = 40;
    o->top_p = 0.95f;
    o->min_p = 0.05f;
    o->repetition_penalty = 1.0f;
    o->repetition_window = 64;
    o->eos_token = -1;
}

void tl_generate_result_default(tl_generate_result *r) {
    if (!r) return;
    ZERO_VERSIONED(r);
}

/* api_structs.h — the argument checks of the public calls, shared by the files that
 * implement tinyloop.h (abi/api_*.c): struct_size handling of options and results
 * (api_structs.c), NULL and token checks, the model's internal context. */
#ifndef TL_API_STRUCTS_H
#define TL_API_STRUCTS_H

#include <stddef.h>
#include <stdint.h>

#include "base/error.h"
#include "model/model.h"
#include "tinyloop/tinyloop.h"

#define NEED(ptr, name)                                                                 \
    do {                                                                                \
        if (!(ptr)) return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s must not be NULL", name); \
    } while (0)

/* A struct_size from min_size (the first release's) up to a sane limit. */
tl_status check_struct_size(const void *s, size_t min_size, const char *what);
/* dst (full size, already defaulted) <- the caller's src (NULL = keep defaults). */
tl_status read_struct(void *dst, size_t full, const void *src, size_t min_size, const char *what);
/* The caller's dst <- src (full size), as much as dst's struct_size holds. */
void write_struct(void *dst, const void *src, size_t full);
/* n tokens, at least min_n, and a tokens array when n > 0 (api_context.c). */
tl_status check_tokens_arg(const int32_t *tokens, size_t n, size_t min_n);
/* The model's internal context, created on first use and emptied: what model-level calls
 * run on. Call with model->default_ctx_lock held (api_context.c). */
tl_status default_context(tl_model *model, tl_context **out);
/* Generation options with defaults for what an older struct lacks; a result's size
 * (api_generate.c). */
tl_status read_generate_options(const tl_generate_options *opts, tl_generate_options *o);
tl_status check_result_arg(tl_generate_result *result);
/* The positions a generation of its own context needs (0 = the model's whole length). */
int batch_member_seq(const tl_model *model, size_t n_prompt, const tl_generate_options *o,
                     size_t out_capacity);

#endif

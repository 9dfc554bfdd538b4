/* body_dtype.h — the load option body_dtype (tinyloop.h, tl_body_dtype): the loop
 * body's weight matrices decoded once at load and held as f16 or f32. Runs on the
 * built model before any backend repacks or uploads it, so every backend sees plain
 * f16/f32 tensors and orchestration never knows the difference. */
#ifndef TL_BODY_DTYPE_H
#define TL_BODY_DTYPE_H

#include <stdint.h>

#include "tinyloop/tinyloop.h"

struct tl_model;

/* Checks the option's value (before the file is opened). */
tl_status tl_body_dtype_check(int32_t body_dtype);
/* Converts the body of `model` as model->load_opts.body_dtype asks: the core blocks'
 * q/k/v/o, gate/up/down and the concat injection's weight. The copies are owned by the
 * model (model->body_copy, freed by tl_model_destroy, also after a failure here). */
tl_status tl_body_dtype_apply(struct tl_model *model, const char *path);
/* Bytes of the body's matrices as the model holds them (the memory report). */
uint64_t tl_body_bytes(const struct tl_model *model);

#endif

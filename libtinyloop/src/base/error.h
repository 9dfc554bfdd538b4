/* error.h — thread-local last-error message behind tl_last_error(). */
#ifndef TL_ERROR_H
#define TL_ERROR_H

#include "tinyloop/tinyloop.h"

/* Record a printf-style message for this thread and return `status`, so callers can
 * write `return tl_fail(TL_ERR_FORMAT, "%s: tensor %s ...", path, name);`. */
tl_status tl_fail(tl_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void tl_clear_error(void);
/* This thread's last message ("" when none); tl_last_error() (abi/api_model.c) returns it. */
const char *tl_error_message(void);

#endif

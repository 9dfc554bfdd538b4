/* log.h — the library's one way to report what is not an error return: tl_log() hands a
 * message to the callback of tl_log_set() (tinyloop.h). The library never writes to
 * stderr itself; without a callback, warnings and errors are kept for the next one
 * (docs/api.md, "Log messages"). */
#ifndef TL_LOG_H
#define TL_LOG_H

#include "tinyloop/tinyloop.h"

#ifdef __cplusplus
extern "C" {
#endif

/* printf-style; the message is cut at TL_LOG_MESSAGE_MAX - 1 bytes. */
#define TL_LOG_MESSAGE_MAX 1024
void tl_log(tl_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#ifdef __cplusplus
}
#endif

#endif

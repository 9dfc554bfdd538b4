/* error.c — the thread-local last-error message. */
#include "base/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define TL_ERROR_CAPACITY 1024

static _Thread_local char tl_error_buffer[TL_ERROR_CAPACITY];

tl_status tl_fail(tl_status status, const char *fmt, ...)
{
    /* Format into a scratch buffer first: an argument may be the current message
     * (a caller adding context to an inner error), and the two must not overlap. */
    char scratch[TL_ERROR_CAPACITY];
    va_list args;
    va_start(args, fmt);
    vsnprintf(scratch, sizeof scratch, fmt, args); /* truncates, always NUL-terminates */
    va_end(args);
    memcpy(tl_error_buffer, scratch, sizeof scratch);
    return status;
}

void tl_clear_error(void)
{
    tl_error_buffer[0] = '\0';
}

const char *tl_error_message(void)
{
    return tl_error_buffer;
}

/* UTF-8 decoding a byte at a time, shared by the grammar matcher and the file reader's
 * string checks. */
#ifndef TL_UTF8_H
#define TL_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* UTF-8 a byte at a time: the character being read, `have` of its `len` bytes seen so
 * far, their bits in `value` (have == 0: between characters). */
typedef struct tl_utf8_state {
    uint32_t value;
    uint8_t have, len;
} tl_utf8_state;

enum { TL_UTF8_INVALID = 0, TL_UTF8_PENDING = 1, TL_UTF8_DONE = 2 };

/* Feed byte b to *u. TL_UTF8_DONE: a character is complete, code point *lo (== *hi), and
 * *u is between characters again; TL_UTF8_PENDING: more bytes are needed and [*lo, *hi]
 * are the code points that can still complete the character (one interval, overlong
 * forms, surrogates and code points past U+10FFFF left out); TL_UTF8_INVALID: no
 * character begins so (a stray continuation byte, an overlong form, a surrogate, past
 * U+10FFFF, a byte that is never UTF-8), *u unchanged. */
int tl_utf8_feed(tl_utf8_state *u, uint8_t b, uint32_t *lo, uint32_t *hi);
/* Decode one UTF-8 code point of s[0..n): its length in bytes (0 = invalid or cut). */
size_t tl_utf8_decode(const uint8_t *s, size_t n, uint32_t *cp);

#endif

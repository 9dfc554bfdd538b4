#include "base/utf8.h"

int tl_utf8_feed(tl_utf8_state *u, uint8_t b, uint32_t *lo, uint32_t *hi) {
    static const uint8_t lead_bits[5] = { 0, 0x7F, 0x1F, 0x0F, 0x07 };
    static const uint32_t least[5] = { 0, 0, 0x80, 0x800, 0x10000 }, most[5] = { 0, 0x7F, 0x7FF, 0xFFFF, 0x10FFFF };
    tl_utf8_state s = *u;
    if (s.have == 0) {
        s.len = b < 0x80 ? 1 : (b & 0xE0) == 0xC0 ? 2 : (b & 0xF0) == 0xE0 ? 3 : (b & 0xF8) == 0xF0 ? 4 : 0;
        if (s.len == 0) return TL_UTF8_INVALID;
        s.value = b & lead_bits[s.len];
    } else {
        if ((b & 0xC0) != 0x80) return TL_UTF8_INVALID;
        s.value = (s.value << 6) | (b & 0x3Fu);
    }
    s.have++;
    /* the code points whose encoding in s.len bytes begins with these: one interval,
     * less overlong forms, surrogates (only ever at the top of the ED block, so the
     * interval never straddles them) and what lies past U+10FFFF */
    unsigned rest = 6u * (unsigned)(s.len - s.have);
    uint32_t l = s.value << rest, h = l | ((1u << rest) - 1);
    if (l < least[s.len]) l = least[s.len];
    if (h > most[s.len]) h = most[s.len];
    if (l <= 0xDFFF && h >= 0xD800) {
        if (l >= 0xD800) l = 0xE000;
        else h = 0xD7FF;
    }
    if (l > h) return TL_UTF8_INVALID;
    *lo = l;
    *hi = h;
    if (s.have < s.len) {
        *u = s;
        return TL_UTF8_PENDING;
    }
    *u = (tl_utf8_state){ 0, 0, 0 };
    return TL_UTF8_DONE;
}

size_t tl_utf8_decode(const uint8_t *s, size_t n, uint32_t *cp) {
    tl_utf8_state u = { 0, 0, 0 };
    uint32_t hi;
    for (size_t i = 0; i < n && i < 4; i++) {
        int r = tl_utf8_feed(&u, s[i], cp, &hi);
        if (r != TL_UTF8_PENDING) return r == TL_UTF8_DONE ? i + 1 : 0;
    }
    return 0;
}


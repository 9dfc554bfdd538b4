/* kv_policy.h — the named KV-cache policies of tinyloop.h (tl_kv_policy): checking a
 * requested policy, and how many loop slots per core block a context then holds
 * (docs/model.md, "Approximate KV policies"). */
#ifndef TL_KV_POLICY_H
#define TL_KV_POLICY_H

#include <stdint.h>

#include "tinyloop/tinyloop.h"

/* A resolved policy: kind is TL_KV_EXACT, TL_KV_SHARE_LAST, TL_KV_RING (ring_slots
 * >= 1 with TL_KV_RING, else 0) or TL_KV_STORE_H. */
typedef struct tl_kv_choice {
    int32_t kind;
    int32_t ring_slots;
} tl_kv_choice;

/* The policy that kind / ring_slots (as a caller set them in `what`, e.g.
 * "tl_context_options") ask for; TL_KV_DEFAULT takes `inherited` (NULL: exact). A clear
 * TL_ERR_INVALID_ARGUMENT for an unknown kind or a ring_slots that does not fit it. */
tl_status tl_kv_choice_resolve(int32_t kind, int32_t ring_slots, const tl_kv_choice *inherited,
                               const char *what, tl_kv_choice *out);
/* Distinct loop slots per core block for a context caching up to max_depth iterations:
 * max_depth when exact, else at most the policy's slots (store_h: 1, the slot its
 * recomputed K/V go to while a block attends). */
int tl_kv_loop_slots(const tl_kv_choice *policy, int max_depth);
/* Whether every iteration's K/V is what attention sees (exact, store_h), not a shared
 * slot's last write. */
static inline int tl_kv_is_exact(const tl_kv_choice *policy) {
    return policy->kind == TL_KV_EXACT || policy->kind == TL_KV_STORE_H;
}
static inline int tl_kv_stores_h(const tl_kv_choice *policy) { return policy->kind == TL_KV_STORE_H; }
/* "exact", "share_last", "ring" or "store_h". */
const char *tl_kv_policy_name(int32_t kind);

/* A cache window (docs/model.md, "Cache window"): the K/V of the last `size` positions
 * of a sequence kept per virtual layer in a ring; `attn` the window attention masks
 * with (the model's sliding window when size covers it, else size), `approx` 1 when
 * that is narrower than the model's own attention. All 0: no window (a full cache). */
typedef struct tl_cache_window {
    int32_t size, attn, approx;
} tl_cache_window;

/* The window that size / approx_ok (as a caller set them in `what`, e.g.
 * "tl_load_options") ask for on a model whose attention has sliding_window (0 = full)
 * and whose contexts hold max_seq positions without a window. TL_ERR_INVALID_ARGUMENT
 * naming the field for a size out of [0, max_seq], an approx_ok not 0 or 1, or an
 * approximate window that approx_ok does not allow. */
tl_status tl_cache_window_resolve(int32_t size, int32_t approx_ok, int32_t sliding_window, int32_t max_seq,
                                  const char *what, tl_cache_window *out);
/* Positions a context with a cache window may hold: its ring bounds memory, not
 * positions (RoPE positions stay ints, with room for a pass's rows). */
#define TL_CACHE_WINDOW_MAX_POS (1 << 30)
/* Rows per slot of a window's ring for passes of up to `rows` rows (at most size): a
 * pass's new rows must not overwrite a position one of its rows still sees. */
static inline int tl_cache_window_rows(const tl_cache_window *w, int rows) { return w->size + rows - 1; }

#endif

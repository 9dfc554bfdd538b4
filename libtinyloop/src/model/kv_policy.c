/* kv_policy.c — checks and slot counts of the named KV policies. */
#include "model/kv_policy.h"

#include "base/error.h"

const char *tl_kv_policy_name(int32_t kind) {
    switch (kind) {
    case TL_KV_EXACT: return "exact";
    case TL_KV_SHARE_LAST: return "share_last";
    case TL_KV_RING: return "ring";
    case TL_KV_STORE_H: return "store_h";
    }
    return "default";
}

tl_status tl_kv_choice_resolve(int32_t kind, int32_t ring_slots, const tl_kv_choice *inherited,
                               const char *what, tl_kv_choice *out) {
    if (kind < TL_KV_DEFAULT || kind > TL_KV_STORE_H)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "%s.kv_policy is %d, not one of TL_KV_DEFAULT (0), TL_KV_EXACT (1), "
                       "TL_KV_SHARE_LAST (2), TL_KV_RING (3), TL_KV_STORE_H (4)", what, kind);
    if (kind == TL_KV_RING && ring_slots < 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "%s.kv_ring_slots is %d: TL_KV_RING needs at least 1 slot per core block",
                       what, ring_slots);
    if (kind != TL_KV_RING && ring_slots != 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "%s.kv_ring_slots is %d with kv_policy %s: only TL_KV_RING uses it (leave 0)",
                       what, ring_slots, tl_kv_policy_name(kind));
    if (kind == TL_KV_DEFAULT) {
        *out = inherited ? *inherited : (tl_kv_choice){ TL_KV_EXACT, 0 };
        return TL_OK;
    }
    *out = (tl_kv_choice){ kind, ring_slots };
    return TL_OK;
}

int tl_kv_loop_slots(const tl_kv_choice *policy, int max_depth) {
    int slots = policy->kind == TL_KV_SHARE_LAST || policy->kind == TL_KV_STORE_H ? 1
              : policy->kind == TL_KV_RING      ? policy->ring_slots
                                                : max_depth;
    return slots < max_depth ? slots : max_depth;
}

tl_status tl_cache_window_resolve(int32_t size, int32_t approx_ok, int32_t sliding_window, int32_t max_seq,
                                  const char *what, tl_cache_window *out) {
    *out = (tl_cache_window){ 0, 0, 0 };
    if (approx_ok != 0 && approx_ok != 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s.cache_window_approx is %d, not 0 or 1", what, approx_ok);
    if (size < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s.cache_window is %d: a window keeps W >= 1 positions "
                       "(0 = off)", what, size);
    if (size == 0) {
        if (approx_ok)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s.cache_window_approx is 1 without a cache_window: set "
                           "cache_window to the positions to keep", what);
        return TL_OK;
    }
    if (size > max_seq)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s.cache_window %d exceeds max_seq_len %d: a window no "
                       "shorter than the context saves nothing; lower cache_window or leave it 0", what, size,
                       max_seq);
    int exact = sliding_window > 0 && sliding_window <= size;
    if (!exact && !approx_ok) {
        if (sliding_window > 0)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s.cache_window %d is shorter than the model's sliding "
                           "window %d, so attention would lose positions it sees: set cache_window >= %d, "
                           "or cache_window_approx = 1 for the approximate window", what, size,
                           sliding_window, sliding_window);
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s.cache_window %d on a model with full attention (no "
                       "arch.sliding_window) is approximate: attention would see only the last %d "
                       "positions; set cache_window_approx = 1 to ask for that", what, size, size);
    }
    *out = (tl_cache_window){ size, exact ? sliding_window : size, !exact };
    return TL_OK;
}

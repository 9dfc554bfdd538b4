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

"""The KV-cache policies by name (docs/model.md, "Approximate KV policies" and "The
store_h KV policy").

"exact" gives every loop iteration its own K/V slot (the default). "share_last" and
"ring" (kv_ring_slots slots per core block) let iterations share slots: cheaper, and
approximate by design, so they are only ever on when asked for by name. "store_h" is
exact: it keeps each core block's input (d floats) per iteration instead of its K/V and
recomputes the K/V of earlier positions when attended (less memory, more compute).
"""

from __future__ import annotations

from . import _args

#: name -> the tl_kv_policy value of tinyloop.h
POLICIES = {"exact": 1, "share_last": 2, "ring": 3, "store_h": 4}


def kv_policy_values(kv_policy: str | None, kv_ring_slots: int) -> tuple[int, int]:
    """(tl_kv_policy, kv_ring_slots) for the C options; None = TL_KV_DEFAULT (a context:
    the model's policy). The library checks the pair again and names what is wrong."""
    if kv_policy is not None and not isinstance(kv_policy, str):
        raise TypeError(f"kv_policy must be a str, got {type(kv_policy).__name__}")
    if kv_policy is not None and kv_policy not in POLICIES:
        raise ValueError(f"kv_policy must be one of {', '.join(map(repr, POLICIES))}, "
                         f"got {kv_policy!r}")
    slots = _args.max_int32("kv_ring_slots", kv_ring_slots)
    if kv_policy == "ring" and slots < 1:
        raise ValueError("kv_policy 'ring' needs kv_ring_slots >= 1")
    if kv_policy != "ring" and slots != 0:
        raise ValueError(f"kv_ring_slots is {slots}, but only kv_policy 'ring' uses it")
    return (0 if kv_policy is None else POLICIES[kv_policy]), slots


def kv_policy_name(value: int) -> str:
    """The name of a tl_kv_policy value (a memory report's)."""
    return next((name for name, v in POLICIES.items() if v == value), str(value))

"""What the KV cache costs per token (docs/model.md, "KV cache layout"): one slot of keys
and values (kv_dim = n_kv_head * head_dim floats each, float32) per prelude block, per core
block per loop slot, per coda block (float32, or 2 bytes an element with the load option
kv_dtype f16). Exact caching keeps a loop slot per iteration (Huginn at
depth 32: 2 + 32 x 4 + 2 = 132 slots); share_last keeps one per core block, ring N keeps
min(N, depth). store_h keeps one slot per core block (where recomputed K/V go while it
attends) and each core block's input per iteration, d_model float32 values (docs/model.md,
"The store_h KV policy")."""

from __future__ import annotations

FLOAT_BYTES = 4


def loop_slots(depth: int, policy: str = "exact", ring_slots: int = 0) -> int:
    if policy in ("share_last", "store_h"):
        return 1
    if policy == "ring":
        return min(ring_slots, depth)
    return depth


def kv_slots(info, depth: int, policy: str = "exact", ring_slots: int = 0) -> int:
    """Slots a sequence at `depth` occupies (a model without a loop: its blocks)."""
    core = info.n_core * loop_slots(depth, policy, ring_slots) if info.n_core else 0
    return info.n_pre + core + info.n_post


def element_bytes(info) -> int:
    """Bytes of a KV element as the model was loaded (ModelInfo.kv_dtype; f32 without one)."""
    return 2 if getattr(info, "kv_dtype", "f32") == "f16" else FLOAT_BYTES


def kv_bytes_per_token(info, depth: int, policy: str = "exact", ring_slots: int = 0) -> int:
    kv = kv_slots(info, depth, policy, ring_slots) * 2 * info.n_kv_head * info.head_dim * element_bytes(info)
    inputs = info.n_core * depth * info.d_model * FLOAT_BYTES if policy == "store_h" else 0
    return kv + inputs


def kv_cost_rows(info) -> list:
    """One row per depth worth showing (1, the default, the maximum): its slots and bytes
    per token, exact, with share_last and with store_h."""
    depths = sorted({1, info.default_depth, info.max_depth}) if info.n_core else [0]
    return [{"depth": depth, "slots": kv_slots(info, depth),
             "bytes_per_token": kv_bytes_per_token(info, depth),
             "share_last_bytes_per_token": kv_bytes_per_token(info, depth, "share_last"),
             "store_h_bytes_per_token": kv_bytes_per_token(info, depth, "store_h")}
            for depth in depths]

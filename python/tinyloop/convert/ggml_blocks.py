"""ggml block layouts -> TinyLoop tensors.

`import_tensor` turns the raw bytes of one GGUF tensor into what the writer takes:
- F32 / F16 / BF16: the same bytes (a copy is never needed);
- Q8_0, Q4_0, Q4_1: repacked losslessly into our q8 / q4 with group 32 (the block's fp16
  scales become our scales; ggml's nibble order inside a 32-block is already ours: byte j holds
  element j low and element j+16 high);
- Q4_K: re-blocked into q4 with group 32 (one of its 32-value sub-blocks per group): the
  4-bit values are kept, the group's scale `d * sc` and min `-dmin * m` (an fp16 times a
  6-bit integer: up to 17 significant bits) are rounded to our fp16 scale and min; exact
  when every product fits fp16, otherwise `keep_quantized` says how much the weights move;
- Q6_K: into q8 with group 32 only where that is exact (the two 16-value sub-blocks of a
  group have scales whose ratio lets one fp16 scale hold both: see `_q6_k_as_q8`);
- other types (Q5_0, Q5_1, Q5_K, most Q6_K): decoded to float32 (the caller warns that
  the import is not bit-exact in the original bits and says what it stores).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import FormatError
from .gguf_reader import GGML_TYPES

# ggml type codes used below
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K, BF16 = 12, 13, 14, 30

LOSSLESS_TYPES = {F32: "f32", F16: "f16", BF16: "bf16", Q8_0: "q8", Q4_0: "q4", Q4_1: "q4"}


@dataclass
class ImportedTensor:
    """Bytes already in the .tinyloop layout of `dtype` (group_size 0 for float types)."""

    dtype: str
    shape: tuple
    group_size: int
    data: bytes | np.ndarray


def _blocks(raw: np.ndarray, type_code: int) -> np.ndarray:
    """View raw tensor bytes as (n_blocks, bytes_per_block)."""
    return raw.reshape(-1, GGML_TYPES[type_code].type_size)


def _f16(cols: np.ndarray) -> np.ndarray:
    """Two-byte columns of a block array -> float16 values (one per block)."""
    return np.ascontiguousarray(cols).view("<f2").reshape(-1)


def _repack_q8_0(raw, shape) -> ImportedTensor:
    b = _blocks(raw, Q8_0)  # [d f16][qs int8 x 32]
    qs = np.ascontiguousarray(b[:, 2:]).reshape(-1)
    d = np.ascontiguousarray(b[:, :2]).reshape(-1)
    return ImportedTensor("q8", shape, 32, np.concatenate([qs, d]))


def _repack_q4_1(raw, shape) -> ImportedTensor:
    b = _blocks(raw, Q4_1)  # [d f16][m f16][qs u8 x 16]; w = d q + m
    qs = np.ascontiguousarray(b[:, 4:]).reshape(-1)
    d = np.ascontiguousarray(b[:, 0:2]).reshape(-1)
    m = np.ascontiguousarray(b[:, 2:4]).reshape(-1)
    return ImportedTensor("q4", shape, 32, np.concatenate([qs, d, m]))


def _q4_0_mins(d: np.ndarray) -> np.ndarray:
    """Q4_0 is w = d (q - 8) = d q + (-8 d); -8 d is exact in fp16 (a power-of-two multiple)
    unless it overflows."""
    with np.errstate(over="ignore"):
        return (d.astype(np.float32) * np.float32(-8.0)).astype(np.float16)


def _repack_q4_0(raw, shape) -> ImportedTensor:
    b = _blocks(raw, Q4_0)  # [d f16][qs u8 x 16]
    d = _f16(b[:, 0:2])
    qs = np.ascontiguousarray(b[:, 2:]).reshape(-1)
    return ImportedTensor("q4", shape, 32, np.concatenate([qs, d.view(np.uint8), _q4_0_mins(d).view(np.uint8)]))


# ---------------------------------------------------------------- decoding to float32

def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) values: element j low nibble of byte j, j+16 the high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def _decode_q4_0(raw):
    b = _blocks(raw, Q4_0)
    return _f16(b[:, :2]).astype(np.float32)[:, None] * (_nibbles(b[:, 2:]) - 8)


def _decode_q4_1(raw):
    b = _blocks(raw, Q4_1)
    d, m = _f16(b[:, 0:2]).astype(np.float32), _f16(b[:, 2:4]).astype(np.float32)
    return d[:, None] * _nibbles(b[:, 4:]) + m[:, None]


def _decode_q8_0(raw):
    b = _blocks(raw, Q8_0)
    return _f16(b[:, :2]).astype(np.float32)[:, None] * b[:, 2:].view(np.int8).astype(np.float32)


def _fifth_bits(qh_bytes: np.ndarray) -> np.ndarray:
    """(n, 4) little-endian u32 -> (n, 32) bit j = high bit of element j, as 0 or 16."""
    qh = np.ascontiguousarray(qh_bytes).view("<u4").reshape(-1, 1)
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1) * 16).astype(np.float32)


def _decode_q5_0(raw):
    b = _blocks(raw, Q5_0)  # [d][qh u32][qs x 16]; w = d (q - 16)
    q = _nibbles(b[:, 6:]) + _fifth_bits(b[:, 2:6])
    return _f16(b[:, :2]).astype(np.float32)[:, None] * (q - 16)


def _decode_q5_1(raw):
    b = _blocks(raw, Q5_1)  # [d][m][qh u32][qs x 16]; w = d q + m
    q = _nibbles(b[:, 8:]) + _fifth_bits(b[:, 4:8])
    d, m = _f16(b[:, 0:2]).astype(np.float32), _f16(b[:, 2:4]).astype(np.float32)
    return d[:, None] * q + m[:, None]


def _k_scales_mins(sc: np.ndarray):
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins per block."""
    sc = sc.astype(np.uint8)
    scales = np.empty((sc.shape[0], 8), np.float32)
    mins = np.empty((sc.shape[0], 8), np.float32)
    for j in range(4):
        scales[:, j] = sc[:, j] & 63
        mins[:, j] = sc[:, j + 4] & 63
    for j in range(4, 8):
        scales[:, j] = (sc[:, j + 4] & 0x0F) | ((sc[:, j - 4] >> 6) << 4)
        mins[:, j] = (sc[:, j + 4] >> 4) | ((sc[:, j] >> 6) << 4)
    return scales, mins


def _k4_quants(ql: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 8, 32): each 32-byte run gives a sub-block of low nibbles, then
    one of high nibbles."""
    ql = ql.reshape(-1, 4, 32)
    return np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)


def _q4_k_groups(raw):
    """Q4_K as 32-value groups: (q (n*8, 32) uint8, scale (n*8,) float64, min (n*8,)
    float64) with w = scale * q + min exactly (the products are exact in float64)."""
    b = _blocks(raw, Q4_K)  # [d][dmin][scales x 12][qs x 128]
    d, dmin = _f16(b[:, 0:2]).astype(np.float64), _f16(b[:, 2:4]).astype(np.float64)
    scales, mins = _k_scales_mins(b[:, 4:16])
    q = _k4_quants(b[:, 16:]).astype(np.uint8).reshape(-1, 32)
    return q, (d[:, None] * scales).reshape(-1), (-dmin[:, None] * mins).reshape(-1)


def _decode_q4_k(raw):
    q, scale, minimum = _q4_k_groups(raw)
    # ggml's own order: (d sc) q - (dmin m), in float32
    w = scale.astype(np.float32)[:, None] * q.astype(np.float32) + minimum.astype(np.float32)[:, None]
    return w.reshape(-1, 256)


def _fp16_rounding(values: np.ndarray):
    """values (float64) -> (their fp16, the largest |change| the rounding makes, or inf when
    a value does not fit fp16)."""
    with np.errstate(over="ignore"):
        half = values.astype(np.float16)
    if not np.all(np.isfinite(half)):
        return half, np.inf
    return half, float(np.max(np.abs(half.astype(np.float64) - values), initial=0.0))


def _q4_k_change(raw) -> float:
    """The largest |weight change| of rounding Q4_K's group scales and mins to fp16 (0.0:
    the q4 import is exact; inf: some does not fit fp16)."""
    _, scale, minimum = _q4_k_groups(raw)
    return 15.0 * _fp16_rounding(scale)[1] + _fp16_rounding(minimum)[1]   # q <= 15


def _repack_q4_k(raw, shape) -> ImportedTensor:
    q, scale, minimum = _q4_k_groups(raw)
    packed = q[:, :16] | (q[:, 16:] << 4)   # our chunk order: element j low, j+16 high
    return ImportedTensor("q4", shape, 32, np.concatenate([
        packed.reshape(-1), _fp16_rounding(scale)[0].view(np.uint8), _fp16_rounding(minimum)[0].view(np.uint8)]))


def _q6_k_fields(raw):
    """Q6_K as (q - 32 (n, 16, 16) int, sub-block scales (n, 16) int, d (n,) float64): 16
    sub-blocks of 16 values, w = d * sc * (q - 32)."""
    b = _blocks(raw, Q6_K)  # [ql x 128][qh x 64][scales int8 x 16][d]
    ql = b[:, :128].reshape(-1, 2, 64)
    qh = b[:, 128:192].reshape(-1, 2, 32)
    q = np.stack([
        (ql[:, :, :32] & 0x0F) | (((qh >> 0) & 3) << 4),
        (ql[:, :, 32:] & 0x0F) | (((qh >> 2) & 3) << 4),
        (ql[:, :, :32] >> 4) | (((qh >> 4) & 3) << 4),
        (ql[:, :, 32:] >> 4) | (((qh >> 6) & 3) << 4),
    ], axis=2).astype(np.int32) - 32  # (n, half, run, 32): 128 values per half in order
    # sub-block index: half * 8 + run * 2 + (position >= 16)
    q = q.reshape(-1, 16, 16)
    sc = b[:, 192:208].view(np.int8).astype(np.int32)
    return q, sc, _f16(b[:, 208:210]).astype(np.float64)


def _q6_k_as_q8(raw):
    """Q6_K -> our q8 group 32 (qs int8 (n*8, 32), scales fp16 (n*8,)) when exact, else
    None. A group holds sub-blocks with scales a, b: with c = gcd(a, b) the group's scale
    d c is exact if it fits fp16, and each value d a (q - 32) = (d c) (a/c) (q - 32) fits
    int8 if |a/c (q - 32)| <= 127."""
    q, sc, d = _q6_k_fields(raw)
    pairs = sc.reshape(-1, 8, 2)
    c = np.gcd(np.abs(pairs[:, :, 0]), np.abs(pairs[:, :, 1]))
    c = np.where(c == 0, 1, c)                               # both scales 0: any scale
    ratio = (sc.reshape(-1, 8, 2) // c[:, :, None])            # exact division
    values = q.reshape(-1, 8, 2, 16) * ratio[:, :, :, None]
    if np.max(np.abs(values), initial=0) > 127:
        return None
    scale, change = _fp16_rounding(d[:, None] * c)
    if change != 0.0:
        return None
    return values.reshape(-1, 32).astype(np.int8), scale.reshape(-1)


def _repack_q6_k(raw, shape) -> ImportedTensor:
    qs, scales = _q6_k_as_q8(raw)
    return ImportedTensor("q8", shape, 32, np.concatenate([qs.view(np.uint8).reshape(-1), scales.view(np.uint8)]))


def _decode_q5_k(raw):
    b = _blocks(raw, Q5_K)  # [d][dmin][scales x 12][qh x 32][qs x 128]
    d, dmin = _f16(b[:, 0:2]).astype(np.float32), _f16(b[:, 2:4]).astype(np.float32)
    scales, mins = _k_scales_mins(b[:, 4:16])
    q = _k4_quants(b[:, 48:])
    qh = b[:, 16:48]
    high = np.stack([(qh >> i) & 1 for i in range(8)], axis=1).astype(np.float32) * 16  # sub-block i uses bit i
    w = (d[:, None] * scales)[:, :, None] * (q + high) - (dmin[:, None] * mins)[:, :, None]
    return w.reshape(-1, 256)


def _decode_q6_k(raw):
    q, sc, d = _q6_k_fields(raw)
    # ggml's order in float32: (d sc) (q - 32)
    ds = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    return (ds[:, :, None] * q.astype(np.float32)).reshape(-1, 256)


_DECODERS = {
    Q4_0: _decode_q4_0, Q4_1: _decode_q4_1, Q8_0: _decode_q8_0, Q5_0: _decode_q5_0,
    Q5_1: _decode_q5_1, Q4_K: _decode_q4_k, Q5_K: _decode_q5_k, Q6_K: _decode_q6_k,
}


def decode_to_f32(raw: np.ndarray, type_code: int, shape: tuple) -> np.ndarray:
    """Any supported ggml type -> float32 array of `shape`."""
    if type_code == F32:
        return raw.view("<f4").reshape(shape).astype(np.float32)
    if type_code == F16:
        return raw.view("<f2").reshape(shape).astype(np.float32)
    if type_code == BF16:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if type_code not in _DECODERS:
        name = GGML_TYPES[type_code].name if type_code in GGML_TYPES else str(type_code)
        raise FormatError(f"ggml type {name} cannot be imported (supported: F32, F16, BF16, "
                          "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)")
    return _DECODERS[type_code](raw).reshape(shape)


def lossless_dtype(raw: np.ndarray, type_code: int, shape: tuple) -> str | None:
    """The .tinyloop dtype that holds this tensor exactly, or None (it must be decoded)."""
    kept = keep_quantized(raw, type_code, shape)
    return kept[0] if kept is not None and kept[1] == 0.0 else None


def keep_quantized(raw: np.ndarray, type_code: int, shape: tuple) -> tuple[str, float] | None:
    """(the .tinyloop dtype `import_tensor` gives this tensor, the largest |change| of any
    weight on the way: 0.0 = exact), or None: it has no such dtype and must be decoded."""
    if type_code in (F32, F16, BF16):
        return LOSSLESS_TYPES[type_code], 0.0
    if len(shape) != 2:
        return None  # our quantized dtypes are 2-D only
    if type_code == Q4_0:
        d = _f16(_blocks(raw, Q4_0)[:, 0:2])
        if not np.array_equal(np.isfinite(_q4_0_mins(d)), np.isfinite(d)):
            return None
    if type_code in (Q8_0, Q4_0, Q4_1):
        return LOSSLESS_TYPES[type_code], 0.0
    if type_code == Q4_K:
        change = _q4_k_change(raw)
        return ("q4", change) if np.isfinite(change) else None
    if type_code == Q6_K and _q6_k_as_q8(raw) is not None:
        return "q8", 0.0
    return None


def import_tensor(raw: np.ndarray, type_code: int, shape: tuple) -> ImportedTensor:
    """Import into a .tinyloop layout; only for tensors `keep_quantized` accepts."""
    if keep_quantized(raw, type_code, shape) is None:
        raise FormatError(f"ggml type {GGML_TYPES[type_code].name} of shape {shape} has no TinyLoop dtype to keep")
    if type_code in (F32, F16, BF16):
        return ImportedTensor(LOSSLESS_TYPES[type_code], shape, 0, raw)
    repack = {Q8_0: _repack_q8_0, Q4_1: _repack_q4_1, Q4_0: _repack_q4_0, Q4_K: _repack_q4_k,
              Q6_K: _repack_q6_k}[type_code]
    return repack(raw, shape)

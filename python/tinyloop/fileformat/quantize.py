"""Group-wise weight quantization in the layouts of docs/format.md.

q8 is symmetric (`w = scale * q`, q in -127..127); q4 and q2 are asymmetric
(`w = scale * q + min`, q in 0..15 / 0..3). Scale and min are float16, one pair per group
of `group_size` consecutive elements of a row. Everything is vectorised over whole
row blocks so that embedding-sized matrices quantize in about a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import FormatError

QUANT_DTYPES = ("q8", "q4", "q2")
GROUP_SIZES = (32, 64, 128)
METHODS = ("rtn", "search")

# Largest code of each asymmetric type, and the symmetric range of q8.
_QMAX = {"q8": 127, "q4": 15, "q2": 3}
# Packing works in chunks of 32 elements of a row (docs/format.md).
_CHUNK = 32
_F16_MAX = float(np.finfo(np.float16).max)
# Rows are processed in blocks of about this many elements to bound temporary memory.
_BLOCK_ELEMENTS = 1 << 20


def _check_layout(dtype: str, shape, group_size: int) -> tuple[int, int]:
    if dtype not in QUANT_DTYPES:
        raise FormatError(f"not a quantized dtype: {dtype!r} (expected one of {QUANT_DTYPES})")
    if len(shape) != 2:
        raise FormatError(f"{dtype} tensors are 2-D, got shape {tuple(shape)}")
    if group_size not in GROUP_SIZES:
        raise FormatError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    rows, cols = int(shape[0]), int(shape[1])
    if rows <= 0 or cols <= 0 or cols % group_size:
        raise FormatError(f"shape {tuple(shape)}: cols must be a positive multiple of group_size {group_size}")
    return rows, cols


def _packed_qs_bytes(dtype: str, n: int) -> int:
    return {"q8": n, "q4": n // 2, "q2": n // 4}[dtype]


# ---------------------------------------------------------------------------------------
# Packing of the codes (docs/format.md, "Packing of qs")
# ---------------------------------------------------------------------------------------

def pack_codes(dtype: str, q: np.ndarray) -> np.ndarray:
    """Pack a [rows, cols] array of codes into the file's `qs` bytes (flat)."""
    if dtype == "q8":
        return np.ascontiguousarray(q, dtype=np.int8).reshape(-1)
    q = np.asarray(q, dtype=np.uint8)
    if dtype == "q4":
        # chunk of 32 -> 2 halves of 16; byte j = element j | element j+16 << 4
        halves = q.reshape(-1, 2, 16)
        return (halves[:, 0, :] | (halves[:, 1, :] << 4)).reshape(-1)
    if dtype == "q2":
        # chunk of 32 -> 4 quarters of 8; byte j = elements j, j+8, j+16, j+24 in 2-bit fields
        quarters = q.reshape(-1, 4, 8)
        packed = quarters[:, 0, :] | (quarters[:, 1, :] << 2) | (quarters[:, 2, :] << 4) | (quarters[:, 3, :] << 6)
        return packed.reshape(-1)
    raise FormatError(f"not a quantized dtype: {dtype!r}")


def unpack_codes(dtype: str, qs: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Inverse of pack_codes: the [rows, cols] codes (int8 for q8, uint8 otherwise)."""
    if dtype == "q8":
        return np.asarray(qs).view(np.int8).reshape(rows, cols)
    b = np.asarray(qs).view(np.uint8)
    if dtype == "q4":
        chunks = b.reshape(-1, 16)
        return np.stack([chunks & 0x0F, chunks >> 4], axis=1).reshape(rows, cols)
    if dtype == "q2":
        chunks = b.reshape(-1, 8)
        fields = [(chunks >> shift) & 0x03 for shift in (0, 2, 4, 6)]
        return np.stack(fields, axis=1).reshape(rows, cols)
    raise FormatError(f"not a quantized dtype: {dtype!r}")


# ---------------------------------------------------------------------------------------
# QTensor
# ---------------------------------------------------------------------------------------

@dataclass
class QTensor:
    """A quantized matrix in file order: packed codes, f16 scales and (q4/q2) f16 mins."""

    dtype: str
    shape: tuple
    group_size: int
    qs: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None

    def __post_init__(self):
        rows, cols = _check_layout(self.dtype, self.shape, self.group_size)
        self.shape = (rows, cols)
        n_groups = rows * cols // self.group_size
        self.qs = np.ascontiguousarray(self.qs).reshape(-1)
        self.scales = np.ascontiguousarray(self.scales, dtype=np.float16).reshape(-1)
        if self.qs.nbytes != _packed_qs_bytes(self.dtype, rows * cols):
            raise FormatError(f"{self.dtype} {self.shape}: qs has {self.qs.nbytes} bytes, "
                              f"expected {_packed_qs_bytes(self.dtype, rows * cols)}")
        if self.scales.size != n_groups:
            raise FormatError(f"{self.dtype} {self.shape}: {self.scales.size} scales, expected {n_groups}")
        if self.dtype == "q8":
            if self.mins is not None:
                raise FormatError("q8 is symmetric and has no mins")
        else:
            if self.mins is None:
                raise FormatError(f"{self.dtype} needs mins")
            self.mins = np.ascontiguousarray(self.mins, dtype=np.float16).reshape(-1)
            if self.mins.size != n_groups:
                raise FormatError(f"{self.dtype} {self.shape}: {self.mins.size} mins, expected {n_groups}")

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)

    def to_bytes(self) -> bytes:
        parts = [self.qs.tobytes(), self.scales.astype("<f2").tobytes()]
        if self.mins is not None:
            parts.append(self.mins.astype("<f2").tobytes())
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, dtype: str, shape, group_size: int, data) -> "QTensor":
        rows, cols = _check_layout(dtype, shape, group_size)
        buf = memoryview(data).cast("B")
        n_qs = _packed_qs_bytes(dtype, rows * cols)
        n_groups = rows * cols // group_size
        expected = quantized_nbytes(dtype, (rows, cols), group_size)
        if buf.nbytes != expected:
            raise FormatError(f"{dtype} {(rows, cols)} group {group_size}: {buf.nbytes} bytes, expected {expected}")
        qs = np.frombuffer(buf, dtype=np.int8 if dtype == "q8" else np.uint8, count=n_qs)
        scales = np.frombuffer(buf, dtype="<f2", count=n_groups, offset=n_qs)
        mins = None
        if dtype != "q8":
            mins = np.frombuffer(buf, dtype="<f2", count=n_groups, offset=n_qs + 2 * n_groups)
        return cls(dtype, (rows, cols), group_size, qs, scales, mins)

    def codes(self) -> np.ndarray:
        """The unpacked [rows, cols] integer codes."""
        return unpack_codes(self.dtype, self.qs, *self.shape)

    def dequantize(self) -> np.ndarray:
        rows, cols = self.shape
        g = self.group_size
        q = self.codes().astype(np.float64).reshape(rows, cols // g, g)
        scale = self.scales.astype(np.float64).reshape(rows, cols // g, 1)
        w = scale * q
        if self.mins is not None:
            w += self.mins.astype(np.float64).reshape(rows, cols // g, 1)
        return w.reshape(rows, cols)


def quantized_nbytes(dtype: str, shape, group_size: int) -> int:
    rows, cols = _check_layout(dtype, shape, group_size)
    n = rows * cols
    n_params = 1 if dtype == "q8" else 2
    return _packed_qs_bytes(dtype, n) + 2 * n_params * (n // group_size)


# ---------------------------------------------------------------------------------------
# Choosing codes, scales and mins for groups (arrays of shape [n_groups, G])
# ---------------------------------------------------------------------------------------

def _to_f16(x: np.ndarray) -> np.ndarray:
    """Round to float16 without overflowing to inf (huge ranges saturate)."""
    return np.clip(x, -_F16_MAX, _F16_MAX).astype(np.float16)


def _codes_for(w, scale, vmin, qmin, qmax):
    """Nearest codes for given f16 scale/min (as float64 columns); scale 0 maps to code 0."""
    safe = np.where(scale > 0, scale, 1.0)
    q = np.rint((w - vmin) / safe)
    q = np.where(scale > 0, q, 0)
    return np.clip(q, qmin, qmax)


def _sq_error(w, q, scale, vmin):
    return np.sum((w - (scale * q + vmin)) ** 2, axis=1)


def _rtn_asym(w, qmax):
    """Round to nearest on [min, max]: min is rounded to f16 first and the scale is taken
    from the stored min, so the f16 rounding of min does not shift the whole grid."""
    vmin = _to_f16(w.min(axis=1, keepdims=True)).astype(np.float64)
    vmax = w.max(axis=1, keepdims=True)
    scale = _to_f16(np.maximum(vmax - vmin, 0.0) / qmax).astype(np.float64)
    return _codes_for(w, scale, vmin, 0, qmax), scale, vmin


def _rtn_sym(w, qmax):
    amax = np.abs(w).max(axis=1, keepdims=True)
    scale = _to_f16(amax / qmax).astype(np.float64)
    zero = np.zeros_like(scale)
    return _codes_for(w, scale, zero, -qmax, qmax), scale, zero


def _refit_asym(w, q):
    """Least-squares scale and min for fixed codes: minimise sum (w - s q - m)^2."""
    g = w.shape[1]
    sq, sw = q.sum(axis=1, keepdims=True), w.sum(axis=1, keepdims=True)
    sqq, sqw = (q * q).sum(axis=1, keepdims=True), (q * w).sum(axis=1, keepdims=True)
    det = g * sqq - sq * sq
    # det == 0: all codes equal, the best fit is a constant group (scale 0, min = mean).
    scale = np.where(det > 0, (g * sqw - sq * sw) / np.where(det > 0, det, 1.0), 0.0)
    scale = np.maximum(scale, 0.0)
    vmin = (sw - scale * sq) / g
    return scale, vmin


def _refit_sym(w, q):
    sqq, sqw = (q * q).sum(axis=1, keepdims=True), (q * w).sum(axis=1, keepdims=True)
    return np.where(sqq > 0, sqw / np.where(sqq > 0, sqq, 1.0), 0.0), np.zeros((w.shape[0], 1))


# Fractions of the group's range trimmed from each end in the search.
_SHRINK_GRID = (0.0, 0.03, 0.06, 0.1, 0.15, 0.2, 0.3)
_REFIT_ROUNDS = 2


def _search(w, dtype):
    """Start from round-to-nearest, then try shrunken ranges; each candidate's codes get a
    least-squares refit of scale/min (rounded to f16, codes re-chosen) and the per-group
    best is kept. RTN is one of the candidates, so the result is never worse than RTN."""
    qmax = _QMAX[dtype]
    symmetric = dtype == "q8"
    qmin = -qmax if symmetric else 0
    best_q, best_scale, best_min = _rtn_sym(w, qmax) if symmetric else _rtn_asym(w, qmax)
    best_err = _sq_error(w, best_q, best_scale, best_min)

    lo, hi = w.min(axis=1, keepdims=True), w.max(axis=1, keepdims=True)
    amax = np.abs(w).max(axis=1, keepdims=True)
    candidates = []
    for t in _SHRINK_GRID:
        if symmetric:
            candidates.append((amax * (1 - t) / qmax, np.zeros_like(amax)))
        else:
            for t_hi in _SHRINK_GRID:
                r = hi - lo
                c_lo, c_hi = lo + t * r, hi - t_hi * r
                candidates.append((np.maximum(c_hi - c_lo, 0.0) / qmax, c_lo))
    for scale, vmin in candidates:
        q = _codes_for(w, scale, vmin, qmin, qmax)
        for _ in range(_REFIT_ROUNDS):
            scale, vmin = _refit_sym(w, q) if symmetric else _refit_asym(w, q)
            scale = _to_f16(scale).astype(np.float64)
            vmin = _to_f16(vmin).astype(np.float64)
            q = _codes_for(w, scale, vmin, qmin, qmax)
        err = _sq_error(w, q, scale, vmin)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_q = np.where(better[:, None], q, best_q)
        best_scale = np.where(better[:, None], scale, best_scale)
        best_min = np.where(better[:, None], vmin, best_min)
    return best_q, best_scale, best_min


def _quantize_groups(groups: np.ndarray, dtype: str, method: str):
    if method == "search":
        return _search(groups, dtype)
    qmax = _QMAX[dtype]
    return _rtn_sym(groups, qmax) if dtype == "q8" else _rtn_asym(groups, qmax)


def quantize(w, dtype: str, group_size: int = 64, method: str = "rtn") -> QTensor:
    """Quantize a 2-D float matrix to q8, q4 or q2 with groups of `group_size` along cols."""
    w = np.asarray(w)
    rows, cols = _check_layout(dtype, w.shape, group_size)
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r} (expected one of {METHODS})")
    if not np.issubdtype(w.dtype, np.floating):
        raise TypeError(f"quantize expects a float array, got {w.dtype}")
    if not np.all(np.isfinite(w)):
        raise ValueError("cannot quantize a matrix with inf or nan")

    code_dtype = np.int8 if dtype == "q8" else np.uint8
    groups_per_row = cols // group_size
    qs_parts, scale_parts, min_parts = [], [], []
    block_rows = max(1, _BLOCK_ELEMENTS // cols)
    for r0 in range(0, rows, block_rows):
        block = w[r0:r0 + block_rows].astype(np.float64)
        n = block.shape[0]
        q, scale, vmin = _quantize_groups(block.reshape(n * groups_per_row, group_size), dtype, method)
        qs_parts.append(pack_codes(dtype, q.astype(code_dtype).reshape(n, cols)))
        scale_parts.append(scale.reshape(-1).astype(np.float16))
        min_parts.append(vmin.reshape(-1).astype(np.float16))
    mins = None if dtype == "q8" else np.concatenate(min_parts)
    return QTensor(dtype, (rows, cols), group_size, np.concatenate(qs_parts), np.concatenate(scale_parts), mins)


# ---------------------------------------------------------------------------------------
# Decoding raw tensor bytes of any dtype
# ---------------------------------------------------------------------------------------

def dequantize_raw(dtype: str, shape, group_size: int, data) -> np.ndarray:
    """Decode the bytes of a tensor of any file dtype into a float64 array of `shape`."""
    shape = tuple(int(s) for s in shape)
    if dtype in QUANT_DTYPES:
        return QTensor.from_bytes(dtype, shape, group_size, data).dequantize()
    n = int(np.prod(shape, dtype=np.int64))
    itemsize = {"f32": 4, "f16": 2, "bf16": 2}.get(dtype)
    if itemsize is None:
        raise FormatError(f"unknown dtype {dtype!r}")
    buf = memoryview(data).cast("B")
    if buf.nbytes != n * itemsize:
        raise FormatError(f"{dtype} {shape}: {buf.nbytes} bytes, expected {n * itemsize}")
    if dtype == "f32":
        values = np.frombuffer(buf, dtype="<f4")
    elif dtype == "f16":
        values = np.frombuffer(buf, dtype="<f2")
    else:
        # bfloat16 is the top half of an IEEE float32.
        values = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float64).reshape(shape)


def concat_rows(parts: list[QTensor]) -> QTensor:
    """Stack quantized row blocks of the same dtype, cols and group into one matrix
    (each block's codes, scales and mins are contiguous runs of the whole's)."""
    first = parts[0]
    cols = first.shape[1]
    for p in parts:
        if (p.dtype, p.shape[1], p.group_size) != (first.dtype, cols, first.group_size):
            raise ValueError("concat_rows needs blocks of one dtype, column count and group size")
    rows = sum(p.shape[0] for p in parts)
    mins = None if first.mins is None else np.concatenate([p.mins for p in parts])
    return QTensor(first.dtype, (rows, cols), first.group_size,
                   np.concatenate([p.qs for p in parts]),
                   np.concatenate([p.scales for p in parts]), mins)

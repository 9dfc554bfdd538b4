"""Minimal GGUF reader for the training tools: metadata and dequantized float32 tensors.

The training scripts run on a GPU machine where only numpy and torch are available and the
TinyLoop package is not built, so this file stands alone (numpy only). It covers what the
SmolLM2 teacher uses (F32, F16, Q8_0, Q4_0, Q4_1); anything else is a clear error.
"""

from __future__ import annotations

import mmap
import struct

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# ggml type code -> (name, elements per block, bytes per block)
_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
          8: ("Q8_0", 32, 34)}


class GGUFWeights:
    """`metadata` (dict), `shapes` (name -> outermost-first shape), `tensor(name)` -> f32."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        self.metadata: dict = {}
        self._infos: dict = {}
        self._parse()
        self.shapes = {n: i[0] for n, i in self._infos.items()}

    def _take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._buf):
            raise ValueError(f"{self.path}: truncated GGUF at byte {self._pos}")
        (v,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return v

    def _string(self) -> str:
        n = self._take("<Q")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._take(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, count = self._take("<I"), self._take("<Q")
            if item_type in _SCALARS and item_type != 7:
                dt = np.dtype(_SCALARS[item_type])
                arr = np.frombuffer(self._buf, dtype=dt, count=count, offset=self._pos).copy()
                self._pos += count * dt.itemsize
                return arr
            return [self._value(item_type) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (bad magic)")
        self._pos = 4
        version = self._take("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} not supported")
        n_tensors, n_kv = self._take("<Q"), self._take("<Q")
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._take("<I"))
        raw_infos = []
        for _ in range(n_tensors):
            name = self._string()
            ne = [self._take("<Q") for _ in range(self._take("<I"))]
            raw_infos.append((name, ne, self._take("<I"), self._take("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        for name, ne, code, offset in raw_infos:
            shape = tuple(int(n) for n in reversed(ne))
            self._infos[name] = (shape, code, data_start + offset)

    def tensor(self, name: str) -> np.ndarray:
        """Dequantized float32 copy of a tensor, shape outermost-first ([out, in])."""
        shape, code, start = self._infos[name]
        if code not in _TYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has ggml type {code}; "
                             "supported: F32, F16, Q4_0, Q4_1, Q8_0")
        _, per_block, block_bytes = _TYPES[code]
        n = int(np.prod(shape))
        raw = np.frombuffer(self._buf, np.uint8, n // per_block * block_bytes, start)
        if code == 0:
            out = raw.view("<f4").astype(np.float32)
        elif code == 1:
            out = raw.view("<f2").astype(np.float32)
        else:
            out = _dequant_blocks(raw.reshape(-1, block_bytes), code)
        return out.reshape(shape)


def _dequant_blocks(b: np.ndarray, code: int) -> np.ndarray:
    d = np.ascontiguousarray(b[:, 0:2]).view("<f2").astype(np.float32)
    if code == 8:  # Q8_0: w = d * q, q int8
        q = np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)
    # 4-bit blocks: byte j holds element j (low nibble) and element j + 16 (high nibble)
    qs = b[:, 4:] if code == 3 else b[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    if code == 3:  # Q4_1: w = d * q + m
        m = np.ascontiguousarray(b[:, 2:4]).view("<f2").astype(np.float32)
        return (d * q + m).reshape(-1)
    return (d * (q - 8.0)).reshape(-1)  # Q4_0

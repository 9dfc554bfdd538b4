"""A validating reader of GGUF files (versions 2 and 3).

GGUF layout: a header (magic, version, tensor count, metadata count), typed key/value
metadata, tensor infos (name, dims with ne[0] innermost, ggml type, offset), then the tensor
data starting at the next multiple of `general.alignment` (default 32). Tensor data is
exposed through an mmap without copying.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import FormatError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types.
_SCALAR_FORMATS = {
    0: "<B",  # uint8
    1: "<b",  # int8
    2: "<H",  # uint16
    3: "<h",  # int16
    4: "<I",  # uint32
    5: "<i",  # int32
    6: "<f",  # float32
    7: "<?",  # bool
    10: "<Q",  # uint64
    11: "<q",  # int64
    12: "<d",  # float64
}
_TYPE_STRING = 8
_TYPE_ARRAY = 9


@dataclass(frozen=True)
class GGMLType:
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block


# ggml tensor types (code -> layout). Only sizes are needed to validate and slice data;
# decoding lives in from_gguf.py.
GGML_TYPES = {
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 2 + 16),
    3: GGMLType("Q4_1", 32, 2 + 2 + 16),
    6: GGMLType("Q5_0", 32, 2 + 4 + 16),
    7: GGMLType("Q5_1", 32, 2 + 2 + 4 + 16),
    8: GGMLType("Q8_0", 32, 2 + 32),
    9: GGMLType("Q8_1", 32, 4 + 4 + 32),
    10: GGMLType("Q2_K", 256, 256 // 16 + 256 // 4 + 2 + 2),
    11: GGMLType("Q3_K", 256, 256 // 8 + 256 // 4 + 12 + 2),
    12: GGMLType("Q4_K", 256, 2 + 2 + 12 + 256 // 2),
    13: GGMLType("Q5_K", 256, 2 + 2 + 12 + 256 // 8 + 256 // 2),
    14: GGMLType("Q6_K", 256, 256 // 2 + 256 // 4 + 256 // 16 + 2),
    15: GGMLType("Q8_K", 256, 4 + 256 + 256 // 16 * 2),
    24: GGMLType("I8", 1, 1),
    25: GGMLType("I16", 1, 2),
    26: GGMLType("I32", 1, 4),
    27: GGMLType("I64", 1, 8),
    28: GGMLType("F64", 1, 8),
    30: GGMLType("BF16", 1, 2),
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple  # outermost-first (rows, cols), i.e. reversed GGUF ne[]
    ggml_type: int
    offset: int  # absolute offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type].name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.uint64))


class GGUFFile:
    """An opened GGUF file: `.version`, `.metadata` (dict), `.tensors` (dict, file order),
    `.data(name) -> np.ndarray[uint8]` (a view into the mmap)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 24:
                    raise FormatError(f"{self.path}: {size} bytes is too short for a GGUF header")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise FormatError(f"{self.path}: cannot open: {e}") from e
        self._size = size
        self._pos = 0
        self.metadata: dict = {}
        self.tensors: dict[str, GGUFTensor] = {}
        self._parse()

    # -- low-level cursor -----------------------------------------------------------------

    def _need(self, n: int, what: str):
        if n < 0 or self._pos + n > self._size:
            raise FormatError(
                f"{self.path}: truncated while reading {what} at offset {self._pos} "
                f"(needs {n} bytes, file has {self._size})"
            )

    def _unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self._need(n, what)
        (value,) = struct.unpack_from(fmt, self._mmap, self._pos)
        self._pos += n
        return value

    def _string(self, what: str) -> str:
        n = self._unpack("<Q", what + " length")
        self._need(n, what)
        raw = bytes(self._mmap[self._pos : self._pos + n])
        self._pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Some vocabularies hold invalid UTF-8 pieces; keep them losslessly.
            return raw.decode("utf-8", errors="surrogateescape")

    def _value(self, vtype: int, what: str):
        if vtype in _SCALAR_FORMATS:
            return self._unpack(_SCALAR_FORMATS[vtype], what)
        if vtype == _TYPE_STRING:
            return self._string(what)
        if vtype == _TYPE_ARRAY:
            item_type = self._unpack("<I", what + " array type")
            count = self._unpack("<Q", what + " array length")
            if item_type in _SCALAR_FORMATS and item_type != 7:
                fmt = _SCALAR_FORMATS[item_type]
                itemsize = struct.calcsize(fmt)
                self._need(count * itemsize, what)
                arr = np.frombuffer(self._mmap, dtype=np.dtype(fmt), count=count, offset=self._pos)
                self._pos += count * itemsize
                return arr.copy()
            if item_type in (7, _TYPE_STRING, _TYPE_ARRAY):
                # each item takes at least one byte: bound the count before looping
                self._need(count, what)
                return [self._value(item_type, what) for _ in range(count)]
            raise FormatError(f"{self.path}: {what}: unknown array item type {item_type}")
        raise FormatError(f"{self.path}: {what}: unknown metadata value type {vtype}")

    # -- parsing --------------------------------------------------------------------------

    def _parse(self):
        magic = bytes(self._mmap[0:4])
        if magic != GGUF_MAGIC:
            raise FormatError(f"{self.path}: bad magic {magic!r}, expected {GGUF_MAGIC!r} (not a GGUF file)")
        self._pos = 4
        self.version = self._unpack("<I", "version")
        if self.version not in (2, 3):
            raise FormatError(f"{self.path}: GGUF version {self.version} is not supported (expected 2 or 3)")
        n_tensors = self._unpack("<Q", "tensor count")
        n_kv = self._unpack("<Q", "metadata count")
        # every KV and tensor info takes well over 8 bytes: reject absurd counts early
        if (n_tensors + n_kv) * 8 > self._size:
            raise FormatError(f"{self.path}: header claims {n_tensors} tensors and {n_kv} metadata entries, more than the file can hold")

        for i in range(n_kv):
            key = self._string(f"metadata key #{i}")
            vtype = self._unpack("<I", f"type of metadata {key!r}")
            if key in self.metadata:
                raise FormatError(f"{self.path}: duplicate metadata key {key!r}")
            self.metadata[key] = self._value(vtype, f"metadata {key!r}")

        infos = []
        for i in range(n_tensors):
            name = self._string(f"tensor name #{i}")
            n_dims = self._unpack("<I", f"n_dims of tensor {name!r}")
            if not 1 <= n_dims <= 4:
                raise FormatError(f"{self.path}: tensor {name!r}: n_dims {n_dims} out of range 1..4")
            ne = [self._unpack("<Q", f"dims of tensor {name!r}") for _ in range(n_dims)]
            ggml_type = self._unpack("<I", f"type of tensor {name!r}")
            offset = self._unpack("<Q", f"offset of tensor {name!r}")
            infos.append((name, ne, ggml_type, offset))

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise FormatError(f"{self.path}: general.alignment {alignment!r} is not a power of two")
        self.alignment = alignment
        self.data_offset = -(-self._pos // alignment) * alignment

        spans = []
        for name, ne, ggml_type, offset in infos:
            if name in self.tensors:
                raise FormatError(f"{self.path}: duplicate tensor name {name!r}")
            if ggml_type not in GGML_TYPES:
                raise FormatError(f"{self.path}: tensor {name!r}: unknown ggml type {ggml_type}")
            t = GGML_TYPES[ggml_type]
            if any(n == 0 for n in ne):
                raise FormatError(f"{self.path}: tensor {name!r}: zero dimension in {ne}")
            if ne[0] % t.block_size:
                raise FormatError(
                    f"{self.path}: tensor {name!r}: row length {ne[0]} is not a multiple of the "
                    f"{t.name} block size {t.block_size}"
                )
            n_elem = 1
            for n in ne:
                n_elem *= n
            nbytes = n_elem // t.block_size * t.type_size
            if offset % alignment:
                raise FormatError(f"{self.path}: tensor {name!r}: offset {offset} not aligned to {alignment}")
            start = self.data_offset + offset
            if start + nbytes > self._size:
                raise FormatError(
                    f"{self.path}: tensor {name!r}: data [{start}, {start + nbytes}) lies past the "
                    f"end of the file ({self._size} bytes); the file is truncated"
                )
            spans.append((start, start + nbytes, name))
            self.tensors[name] = GGUFTensor(name, tuple(reversed(ne)), ggml_type, start, nbytes)

        spans.sort()
        for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:]):
            if start_b < end_a:
                raise FormatError(f"{self.path}: tensors {name_a!r} and {name_b!r} overlap")

    # -- access ---------------------------------------------------------------------------

    def data(self, name: str) -> np.ndarray:
        """Raw bytes of a tensor as a read-only uint8 view into the mmap."""
        t = self.tensors[name]
        return np.frombuffer(self._mmap, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def require(self, key: str):
        if key not in self.metadata:
            raise FormatError(f"{self.path}: required metadata key {key!r} is missing")
        return self.metadata[key]

    def close(self):
        # numpy views may still reference the buffer; leave the mmap to the GC in that case
        try:
            self._mmap.close()
        except BufferError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

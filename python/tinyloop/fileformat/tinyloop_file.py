"""Writer, validating reader and copier of the ``.tinyloop`` file format, version 1.

The layout is specified in docs/format.md. The writer streams tensors to disk one by
one (in bounded chunks for large float arrays), so a multi-GB model never needs a full
second copy in memory. The reader mmaps the file and applies the same structural checks
as the C loader (libtinyloop/src/model/format.c).
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..errors import FormatError

MAGIC = b"TINYLOOP"
VERSION = 1
HEADER_SIZE = 256
ALIGN = 64

DTYPES = {"f32": 0, "f16": 1, "bf16": 2, "q8": 3, "q4": 4, "q2": 5}
DTYPE_NAMES = {code: name for name, code in DTYPES.items()}
FLOAT_DTYPES = ("f32", "f16", "bf16")
QUANT_DTYPES = ("q8", "q4", "q2")
GROUP_SIZES = (32, 64, 128)

DIM_KEYS = (
    "vocab_size", "d_model", "n_head", "n_kv_head", "head_dim", "ffn_dim",
    "n_pre", "n_core", "n_post", "default_depth", "max_depth", "max_seq_len",
)
# Dims that describe a size and so cannot be zero.
NONZERO_DIMS = ("vocab_size", "d_model", "n_head", "n_kv_head", "head_dim", "ffn_dim",
                "max_seq_len")

META_INT, META_FLOAT, META_STRING = 1, 2, 3

# Fixed header fields up to the dims and CRCs; the reserved area and header CRC follow.
_HEADER_HEAD = struct.Struct("<8sIIQQQQQQQII12III")
_HEADER_CRC_OFFSET = 252
_RESERVED = slice(_HEADER_HEAD.size, _HEADER_CRC_OFFSET)
assert _HEADER_HEAD.size == 136

_U32_MAX = 0xFFFFFFFF
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_SIZE_LIMIT = 1 << 62          # tensor bytes/elements beyond this are certainly hostile
_CHUNK_BYTES = 16 << 20        # float arrays are converted and written in pieces of this size


def align64(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def tensor_nbytes(dtype: str, shape: tuple, group_size: int) -> int:
    """Bytes a tensor takes in the file; raises FormatError when the shape does not fit
    the dtype (quantized: 2-D, group 32/64/128, cols % group == 0)."""
    if dtype not in DTYPES:
        raise FormatError(f"unknown dtype {dtype!r}; expected one of {list(DTYPES)}")
    if not 1 <= len(shape) <= 4:
        raise FormatError(f"ndim must be 1..4, got {len(shape)} (shape {shape})")
    n = 1
    for s in shape:
        if not isinstance(s, (int, np.integer)) or s < 1:
            raise FormatError(f"shape dims must be positive integers, got {shape}")
        n *= int(s)
        if n > _SIZE_LIMIT:
            raise FormatError(f"shape {shape} has too many elements")
    if dtype in FLOAT_DTYPES:
        if group_size != 0:
            raise FormatError(f"group_size must be 0 for {dtype}, got {group_size}")
        return n * (4 if dtype == "f32" else 2)
    if len(shape) != 2:
        raise FormatError(f"{dtype} tensors must be 2-D, got shape {shape}")
    if group_size not in GROUP_SIZES:
        raise FormatError(f"group_size of {dtype} must be one of {GROUP_SIZES}, got {group_size}")
    cols = int(shape[1])
    if cols % group_size:
        raise FormatError(f"{dtype} needs cols % group_size == 0, got cols {cols} "
                          f"and group_size {group_size}")
    groups = n // group_size
    if dtype == "q8":
        return n + 2 * groups
    return (n // 2 if dtype == "q4" else n // 4) + 4 * groups


def check_name(name: Any, what: str = "tensor name") -> bytes:
    """Names are non-empty printable ASCII (space through tilde)."""
    if not isinstance(name, str) or not name:
        raise FormatError(f"{what} must be a non-empty str, got {name!r}")
    if not all(0x20 <= ord(c) <= 0x7E for c in name):
        raise FormatError(f"{what} {name!r} must be printable ASCII")
    return name.encode("ascii")


def check_dims(dims: dict, where: str = "dims") -> dict:
    """Validate the 12 header dims; returns a clean dict of ints."""
    if not isinstance(dims, dict):
        raise FormatError(f"{where}: expected a dict of the dims {DIM_KEYS}, got {type(dims).__name__}")
    unknown = sorted(set(dims) - set(DIM_KEYS))
    if unknown:
        raise FormatError(f"{where}: unknown dims {unknown}; expected keys {list(DIM_KEYS)}")
    missing = [k for k in DIM_KEYS if k not in dims]
    if missing:
        raise FormatError(f"{where}: missing dims {missing}")
    out = {}
    for k in DIM_KEYS:
        v = dims[k]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= _U32_MAX:
            raise FormatError(f"{where}: {k} must be an integer in 0..{_U32_MAX}, got {v!r}")
        out[k] = int(v)
    for k in NONZERO_DIMS:
        if out[k] == 0:
            raise FormatError(f"{where}: {k} must be > 0, got 0")
    if out["n_head"] % out["n_kv_head"]:
        raise FormatError(f"{where}: n_head ({out['n_head']}) must be a multiple of "
                          f"n_kv_head ({out['n_kv_head']})")
    if out["default_depth"] > out["max_depth"]:
        raise FormatError(f"{where}: default_depth ({out['default_depth']}) must be <= "
                          f"max_depth ({out['max_depth']})")
    if out["n_core"] > 0 and out["max_depth"] == 0:
        raise FormatError(f"{where}: max_depth must be >= 1 when n_core > 0, got 0")
    return out


# ---------------------------------------------------------------- float encodings

def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(a)
    if nan.any():
        rounded = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x40), rounded)
    return rounded.astype(np.uint16)


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _encode_float_chunk(chunk: np.ndarray, dtype: str) -> bytes:
    if dtype == "f32":
        return np.ascontiguousarray(chunk, dtype="<f4").tobytes()
    if dtype == "f16":
        return np.ascontiguousarray(chunk, dtype="<f2").tobytes()
    return _to_bf16_bits(np.asarray(chunk, dtype=np.float32)).astype("<u2").tobytes()


# ---------------------------------------------------------------- writer

def _float_chunks(value: np.ndarray, dtype: str) -> Iterator[bytes]:
    flat = value.reshape(-1)
    step = max(1, _CHUNK_BYTES // 4)
    for start in range(0, flat.size, step):
        yield _encode_float_chunk(flat[start:start + step], dtype)


@dataclass
class _PendingTensor:
    name: str
    dtype: str
    shape: tuple
    group_size: int
    size: int
    chunks: Callable[[], Iterator[bytes]]   # produces the tensor's bytes when writing


class TinyLoopWriter:
    """Collects dims, metadata and tensors, then writes one ``.tinyloop`` file.

    Tensor values are kept by reference until ``write`` converts and streams them."""

    def __init__(self, dims: dict):
        self.dims = check_dims(dims)
        self._meta: dict[str, tuple[int, Any]] = {}
        self._tensors: dict[str, _PendingTensor] = {}

    # -- metadata
    def add_metadata(self, key: str, value) -> None:
        if not isinstance(key, str) or not key or "\0" in key:
            raise FormatError(f"metadata key must be a non-empty str without NUL, got {key!r}")
        if key in self._meta:
            raise FormatError(f"metadata key {key!r} added twice")
        if isinstance(value, (bool, np.bool_)):
            entry = (META_INT, int(value))
        elif isinstance(value, (int, np.integer)):
            if not _I64_MIN <= int(value) <= _I64_MAX:
                raise FormatError(f"metadata {key!r}: int {value} does not fit in 64 bits")
            entry = (META_INT, int(value))
        elif isinstance(value, (float, np.floating)):
            entry = (META_FLOAT, float(value))
        elif isinstance(value, str):
            if "\0" in value:
                raise FormatError(f"metadata {key!r}: string must not contain NUL")
            entry = (META_STRING, value)
        else:
            raise FormatError(f"metadata {key!r}: value must be int, float, bool or str, "
                              f"got {type(value).__name__}")
        self._meta[key] = entry

    # -- tensors
    def _add(self, pending: _PendingTensor) -> None:
        check_name(pending.name)
        if pending.name in self._tensors:
            raise FormatError(f"tensor {pending.name!r} added twice")
        self._tensors[pending.name] = pending

    def add_tensor(self, name: str, value, dtype: str | None = None) -> None:
        """Add a float numpy array (stored as dtype f32/f16/bf16, default f32) or a
        quantized tensor (an object with dtype, shape, group_size and to_bytes())."""
        if isinstance(value, np.ndarray):
            self._add_array(name, value, dtype or "f32")
        elif all(hasattr(value, a) for a in ("dtype", "shape", "group_size", "to_bytes")):
            self._add_qtensor(name, value, dtype)
        else:
            raise FormatError(f"tensor {name!r}: value must be a numpy array or a QTensor, "
                              f"got {type(value).__name__}")

    def _add_array(self, name: str, value: np.ndarray, dtype: str) -> None:
        if dtype not in FLOAT_DTYPES:
            raise FormatError(f"tensor {name!r}: a numpy array is stored as one of "
                              f"{FLOAT_DTYPES}, got dtype {dtype!r} (quantize it first)")
        if value.dtype.kind not in "fiu":
            raise FormatError(f"tensor {name!r}: expected a real numeric array, got numpy "
                              f"dtype {value.dtype}")
        shape = tuple(int(s) for s in value.shape)
        try:
            size = tensor_nbytes(dtype, shape, 0)
        except FormatError as e:
            raise FormatError(f"tensor {name!r}: {e}") from None

        self._add(_PendingTensor(name, dtype, shape, 0, size, lambda: _float_chunks(value, dtype)))

    def _add_qtensor(self, name: str, q, dtype: str | None) -> None:
        qdtype = str(q.dtype)
        if dtype is not None and dtype != qdtype:
            raise FormatError(f"tensor {name!r}: dtype {dtype!r} given for a {qdtype} QTensor")
        if qdtype not in QUANT_DTYPES:
            raise FormatError(f"tensor {name!r}: QTensor dtype must be one of {QUANT_DTYPES}, "
                              f"got {qdtype!r}")
        shape = tuple(int(s) for s in q.shape)
        group = int(q.group_size)
        try:
            size = tensor_nbytes(qdtype, shape, group)
        except FormatError as e:
            raise FormatError(f"tensor {name!r}: {e}") from None

        def chunks(q=q, size=size) -> Iterator[bytes]:
            data = q.to_bytes()
            if len(data) != size:
                raise FormatError(f"tensor {name!r}: QTensor.to_bytes() gave {len(data)} bytes, "
                                  f"expected {size} for {qdtype} {shape} group {group}")
            yield data

        self._add(_PendingTensor(name, qdtype, shape, group, size, chunks))

    def add_lazy_tensor(self, name: str, dtype: str, shape: tuple, produce: Callable[[], Any],
                        group_size: int = 0) -> None:
        """Add a tensor whose value ``produce()`` makes only while the file is written, so a
        converter holds one tensor at a time: a float numpy array (stored as float ``dtype``),
        a quantized tensor of ``dtype`` (with to_bytes()), or bytes in the file layout."""
        shape = tuple(int(s) for s in shape)
        try:
            size = tensor_nbytes(dtype, shape, int(group_size))
        except FormatError as e:
            raise FormatError(f"tensor {name!r}: {e}") from None

        def chunks() -> Iterator[bytes]:
            value = produce()
            if isinstance(value, np.ndarray):
                if tuple(value.shape) != shape or dtype not in FLOAT_DTYPES:
                    raise FormatError(f"tensor {name!r}: produced a {value.shape} array for {dtype} {shape}")
                yield from _float_chunks(value, dtype)
            elif hasattr(value, "to_bytes"):
                yield value.to_bytes()
            else:
                yield memoryview(value).cast("B")

        self._add(_PendingTensor(name, dtype, shape, int(group_size), size, chunks))

    def add_raw_tensor(self, name: str, dtype: str, shape: tuple, group_size: int,
                       data: bytes) -> None:
        """Add bytes already in the file layout of ``dtype`` (e.g. imported as is)."""
        shape = tuple(int(s) for s in shape)
        try:
            size = tensor_nbytes(dtype, shape, int(group_size))
        except FormatError as e:
            raise FormatError(f"tensor {name!r}: {e}") from None
        view = memoryview(data).cast("B")
        if len(view) != size:
            raise FormatError(f"tensor {name!r}: {dtype} {shape} group {group_size} needs "
                              f"{size} bytes, got {len(view)}")
        self._add(_PendingTensor(name, dtype, shape, int(group_size), size,
                                 lambda view=view: iter((view,))))

    # -- output
    def _meta_bytes(self) -> bytes:
        out = bytearray()
        for key, (kind, value) in self._meta.items():
            k = key.encode("utf-8")
            out += struct.pack("<I", len(k)) + k + struct.pack("<I", kind)
            if kind == META_INT:
                out += struct.pack("<q", value)
            elif kind == META_FLOAT:
                out += struct.pack("<d", value)
            else:
                s = value.encode("utf-8")
                out += struct.pack("<Q", len(s)) + s
        return bytes(out)

    def _dir_bytes(self, offsets: list[int], crcs: list[int]) -> bytes:
        out = bytearray()
        for t, off, crc in zip(self._tensors.values(), offsets, crcs):
            n = t.name.encode("ascii")
            out += struct.pack("<I", len(n)) + n
            out += struct.pack("<III", DTYPES[t.dtype], len(t.shape), t.group_size)
            out += struct.pack(f"<{len(t.shape)}Q", *t.shape)
            out += struct.pack("<QQI", off, t.size, crc)
        return bytes(out)

    def write(self, path, progress: Callable[[int, int, str], None] | None = None) -> None:
        """Write the file. ``progress(done_bytes, total_bytes, tensor_name)`` is called
        after each tensor. The directory (which holds the tensor CRCs) and the header are
        written last, once every tensor has been streamed."""
        path = os.fspath(path)
        try:
            self._write_file(path, progress)
        except BaseException:
            # never leave a half-written file that looks like a model
            if os.path.exists(path):
                os.unlink(path)
            raise

    def _write_file(self, path: str, progress) -> None:
        tensors = list(self._tensors.values())
        meta = self._meta_bytes()
        offsets, pos = [], 0
        for t in tensors:
            offsets.append(pos)
            pos = align64(pos + t.size)
        data_size = pos
        dir_size = len(self._dir_bytes(offsets, [0] * len(tensors)))
        meta_offset = HEADER_SIZE
        dir_offset = meta_offset + len(meta)
        data_offset = align64(dir_offset + dir_size)
        file_size = data_offset + data_size
        total = sum(t.size for t in tensors)

        crcs, done = [], 0
        with open(path, "wb") as f:
            f.write(b"\0" * HEADER_SIZE)
            f.write(meta)
            f.write(b"\0" * (data_offset - dir_offset))     # directory placeholder + pad
            for t, off in zip(tensors, offsets):
                f.seek(data_offset + off)
                crc, written = 0, 0
                for chunk in t.chunks():
                    crc = zlib.crc32(chunk, crc)
                    written += len(chunk)
                    f.write(chunk)
                if written != t.size:
                    raise FormatError(f"tensor {t.name!r}: produced {written} bytes, expected {t.size}")
                crcs.append(crc)
                done += t.size
                if progress is not None:
                    progress(done, total, t.name)
            f.truncate(file_size)   # zero tail padding after the last tensor
            directory = self._dir_bytes(offsets, crcs)
            head = _HEADER_HEAD.pack(
                MAGIC, VERSION, HEADER_SIZE, file_size, meta_offset, len(meta), dir_offset,
                dir_size, data_offset, data_size, len(self._meta), len(tensors),
                *(self.dims[k] for k in DIM_KEYS), zlib.crc32(meta), zlib.crc32(directory))
            header = head + b"\0" * (_HEADER_CRC_OFFSET - len(head))
            header += struct.pack("<I", zlib.crc32(header))
            f.seek(dir_offset)
            f.write(directory)
            f.seek(0)
            f.write(header)


# ---------------------------------------------------------------- reader

@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple
    group_size: int
    offset: int     # from the start of the data section
    size: int
    crc32: int


class _Cursor:
    """Bounds-checked little-endian reads inside one section."""

    def __init__(self, buf, start: int, end: int, path: str, section: str):
        self.buf, self.pos, self.end = buf, start, end
        self.path, self.section = path, section

    def take(self, n: int, what: str) -> bytes:
        if n > self.end - self.pos:
            raise FormatError(f"{self.path}: {self.section}: {what} needs {n} bytes at offset "
                              f"{self.pos}, only {self.end - self.pos} left in the section")
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str):
        s = struct.Struct("<" + fmt)
        return s.unpack(self.take(s.size, what))


class TinyLoopFile:
    """A validated, mmapped ``.tinyloop`` file. Use as a context manager or call close()."""

    def __init__(self, path: str, buf, closer):
        self.path = path
        self._buf = buf
        self._closer = closer
        self.version = VERSION
        self.dims: dict = {}
        self.metadata: dict = {}
        self.tensors: dict[str, TensorEntry] = {}
        self.data_offset = 0

    def close(self) -> None:
        if self._closer is not None:
            self._buf = None
            closer, self._closer = self._closer, None
            closer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _entry(self, name: str) -> TensorEntry:
        if name not in self.tensors:
            raise FormatError(f"{self.path}: no tensor named {name!r}")
        return self.tensors[name]

    def raw(self, name: str) -> memoryview:
        """The tensor's bytes in file layout (a view into the mapping)."""
        e = self._entry(name)
        start = self.data_offset + e.offset
        return memoryview(self._buf)[start:start + e.size]

    def tensor(self, name: str) -> np.ndarray:
        """The tensor's values as float64 with its shape (quantized ones dequantized)."""
        e = self._entry(name)
        return decode_tensor(e.dtype, e.shape, e.group_size, self.raw(name))

    def verify_checksums(self) -> None:
        for e in self.tensors.values():
            got = zlib.crc32(self.raw(e.name))
            if got != e.crc32:
                raise FormatError(f"{self.path}: tensor {e.name!r}: CRC-32 mismatch, expected "
                                  f"{e.crc32:#010x}, got {got:#010x}")


def decode_tensor(dtype: str, shape: tuple, group_size: int, data) -> np.ndarray:
    """File bytes -> float64 array of `shape`."""
    if dtype == "f32":
        a = np.frombuffer(data, dtype="<f4")
    elif dtype == "f16":
        a = np.frombuffer(data, dtype="<f2")
    elif dtype == "bf16":
        a = _bf16_bits_to_f32(np.frombuffer(data, dtype="<u2"))
    else:
        from . import quantize   # imported lazily: only quantized tensors need it
        return quantize.dequantize_raw(dtype, tuple(shape), group_size, bytes(data))
    return a.astype(np.float64).reshape(shape)


def read_file(path, verify_checksums: bool = False) -> TinyLoopFile:
    """Map and validate a ``.tinyloop`` file (the checks of docs/format.md)."""
    path = os.fspath(path)
    try:
        fd = open(path, "rb")
    except OSError as e:
        raise FormatError(f"{path}: cannot open: {e.strerror}") from None
    with fd:
        size = os.fstat(fd.fileno()).st_size
        if size < HEADER_SIZE:
            raise FormatError(f"{path}: file is {size} bytes, smaller than the "
                              f"{HEADER_SIZE}-byte header")
        buf = mmap.mmap(fd.fileno(), 0, access=mmap.ACCESS_READ)
    f = TinyLoopFile(path, buf, buf.close)
    try:
        _parse(f, buf, size)
        if verify_checksums:
            f.verify_checksums()
    except BaseException:
        f.close()
        raise
    return f


def _parse(f: TinyLoopFile, buf, size: int) -> None:
    path = f.path
    header = bytes(buf[:HEADER_SIZE])
    fields = _HEADER_HEAD.unpack(header[:_HEADER_HEAD.size])
    (magic, version, header_size, file_size, meta_offset, meta_size, dir_offset, dir_size,
     data_offset, data_size, n_meta, n_tensors) = fields[:12]
    dim_values = fields[12:24]
    meta_crc, dir_crc = fields[24:26]
    if magic != MAGIC:
        raise FormatError(f"{path}: bad magic: expected {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise FormatError(f"{path}: unsupported version: expected {VERSION}, got {version}")
    if header_size != HEADER_SIZE:
        raise FormatError(f"{path}: header_size: expected {HEADER_SIZE}, got {header_size}")
    (stored_crc,) = struct.unpack_from("<I", header, _HEADER_CRC_OFFSET)
    got_crc = zlib.crc32(header[:_HEADER_CRC_OFFSET])
    if stored_crc != got_crc:
        raise FormatError(f"{path}: header CRC-32 mismatch: stored {stored_crc:#010x}, "
                          f"computed {got_crc:#010x}")
    if any(header[_RESERVED]):
        raise FormatError(f"{path}: reserved header bytes 136..251 must be zero")
    if file_size != size:
        raise FormatError(f"{path}: file_size field says {file_size} bytes, the file has {size} "
                          f"(truncated or padded?)")
    expect = [("meta_offset", meta_offset, HEADER_SIZE),
              ("dir_offset", dir_offset, meta_offset + meta_size),
              ("data_offset", data_offset, align64(dir_offset + dir_size)),
              ("file_size", file_size, data_offset + data_size)]
    for field, got, want in expect:
        if got != want:
            raise FormatError(f"{path}: {field}: expected {want} (fixed section order), got {got}")
    f.dims = check_dims(dict(zip(DIM_KEYS, dim_values)), where=f"{path}: header dims")
    f.data_offset = data_offset

    meta_bytes = buf[meta_offset:meta_offset + meta_size]
    if zlib.crc32(meta_bytes) != meta_crc:
        raise FormatError(f"{path}: metadata CRC-32 mismatch: stored {meta_crc:#010x}, "
                          f"computed {zlib.crc32(meta_bytes):#010x}")
    dir_bytes = buf[dir_offset:dir_offset + dir_size]
    if zlib.crc32(dir_bytes) != dir_crc:
        raise FormatError(f"{path}: directory CRC-32 mismatch: stored {dir_crc:#010x}, "
                          f"computed {zlib.crc32(dir_bytes):#010x}")
    f.metadata = _parse_meta(buf, meta_offset, meta_size, n_meta, path)
    f.tensors = _parse_dir(buf, dir_offset, dir_size, n_tensors, data_size, path)


def _parse_meta(buf, offset: int, size: int, n: int, path: str) -> dict:
    cur = _Cursor(buf, offset, offset + size, path, "metadata")
    meta = {}
    for i in range(n):
        (klen,) = cur.unpack("I", f"entry {i} key length")
        raw_key = cur.take(klen, f"entry {i} key")
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{path}: metadata entry {i}: key is not UTF-8") from None
        if not key or "\0" in key:
            raise FormatError(f"{path}: metadata entry {i}: key must be non-empty without NUL")
        if key in meta:
            raise FormatError(f"{path}: metadata key {key!r} appears twice")
        (kind,) = cur.unpack("I", f"{key!r} type")
        if kind == META_INT:
            (meta[key],) = cur.unpack("q", f"{key!r} int value")
        elif kind == META_FLOAT:
            (meta[key],) = cur.unpack("d", f"{key!r} float value")
        elif kind == META_STRING:
            (slen,) = cur.unpack("Q", f"{key!r} string length")
            raw = cur.take(slen, f"{key!r} string value")
            if b"\0" in raw:
                raise FormatError(f"{path}: metadata {key!r}: string must not contain NUL")
            try:
                meta[key] = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise FormatError(f"{path}: metadata {key!r}: string is not UTF-8") from None
        else:
            raise FormatError(f"{path}: metadata {key!r}: unknown type {kind}; expected 1, 2 or 3")
    if cur.pos != cur.end:
        raise FormatError(f"{path}: metadata: {cur.end - cur.pos} bytes left after {n} entries")
    return meta


def _parse_dir(buf, offset: int, size: int, n: int, data_size: int, path: str) -> dict:
    cur = _Cursor(buf, offset, offset + size, path, "tensor directory")
    tensors: dict[str, TensorEntry] = {}
    for i in range(n):
        (nlen,) = cur.unpack("I", f"entry {i} name length")
        raw = cur.take(nlen, f"entry {i} name")
        try:
            name = raw.decode("ascii")
            check_name(name)
        except (UnicodeDecodeError, FormatError):
            raise FormatError(f"{path}: tensor entry {i}: name {raw[:64]!r} is not non-empty "
                              f"printable ASCII") from None
        if name in tensors:
            raise FormatError(f"{path}: tensor {name!r} appears twice")
        code, ndim, group = cur.unpack("III", f"tensor {name!r} dtype/ndim/group")
        if code not in DTYPE_NAMES:
            raise FormatError(f"{path}: tensor {name!r}: unknown dtype code {code}; "
                              f"expected 0..{len(DTYPES) - 1}")
        if not 1 <= ndim <= 4:
            raise FormatError(f"{path}: tensor {name!r}: ndim must be 1..4, got {ndim}")
        shape = cur.unpack(f"{ndim}Q", f"tensor {name!r} shape")
        t_off, t_size, crc = cur.unpack("QQI", f"tensor {name!r} offset/size/crc")
        dtype = DTYPE_NAMES[code]
        try:
            want = tensor_nbytes(dtype, shape, group)
        except FormatError as e:
            raise FormatError(f"{path}: tensor {name!r}: {e}") from None
        if t_size != want:
            raise FormatError(f"{path}: tensor {name!r}: size: expected {want} bytes for {dtype} "
                              f"{list(shape)} group {group}, got {t_size}")
        if t_off % ALIGN:
            raise FormatError(f"{path}: tensor {name!r}: offset {t_off} is not a multiple of {ALIGN}")
        if t_off > data_size or t_size > data_size - t_off:
            raise FormatError(f"{path}: tensor {name!r}: bytes {t_off}..{t_off + t_size} lie "
                              f"outside the data section of {data_size} bytes")
        tensors[name] = TensorEntry(name, dtype, tuple(shape), group, t_off, t_size, crc)
    if cur.pos != cur.end:
        raise FormatError(f"{path}: tensor directory: {cur.end - cur.pos} bytes left after "
                          f"{n} entries")
    ordered = sorted(tensors.values(), key=lambda e: e.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.size > b.offset:
            raise FormatError(f"{path}: tensors {a.name!r} (bytes {a.offset}..{a.offset + a.size})"
                              f" and {b.name!r} (from {b.offset}) overlap")
    return tensors


# ---------------------------------------------------------------- copying

def copy_file(src, dst, *, dims: dict | None = None, metadata: dict | None = None,
              tensors: dict | None = None) -> None:
    """Copy a ``.tinyloop`` file, changing parts of it: ``dims`` overrides header dims,
    ``metadata`` sets or replaces keys, ``tensors`` (name -> numpy array, stored as f32, or
    QTensor) adds or replaces tensors. Everything else is copied as it is, so quantized
    weights are never quantized a second time; replaced entries keep their place and new
    ones come last. The source's checksums are verified first: fresh CRCs written over
    corrupt bytes would hide the damage."""
    if Path(src).resolve() == Path(dst).resolve():
        raise FormatError(f"{dst}: the output must differ from the input: the input is read "
                          f"while the output is written")
    tensors = tensors or {}
    with read_file(src, verify_checksums=True) as f:
        writer = TinyLoopWriter({**f.dims, **(dims or {})})
        for key, value in {**f.metadata, **(metadata or {})}.items():
            writer.add_metadata(key, value)
        for name in {**dict.fromkeys(f.tensors), **tensors}:
            if name in tensors:
                writer.add_tensor(name, tensors[name])
            else:
                e = f.tensors[name]
                # a copy: views into the mapping would keep it from closing
                writer.add_raw_tensor(name, e.dtype, e.shape, e.group_size, bytes(f.raw(name)))
        writer.write(dst)

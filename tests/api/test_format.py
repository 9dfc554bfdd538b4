"""Round trips and validation of the Python .tinyloop writer/reader (tinyloop.format)."""

import importlib.util
import struct
import zlib

import numpy as np
import pytest

from tinyloop.errors import FormatError
from tinyloop.fileformat.tinyloop_file import (ALIGN, HEADER_SIZE, TinyLoopWriter, read_file,
                             tensor_nbytes)

HAVE_QUANTIZE = importlib.util.find_spec("tinyloop.fileformat.quantize") is not None
needs_quantize = pytest.mark.skipif(not HAVE_QUANTIZE,
                                    reason="tinyloop.quantize (QTensor) is not available")

DIMS = dict(vocab_size=32, d_model=64, n_head=4, n_kv_head=2, head_dim=16, ffn_dim=128,
            n_pre=1, n_core=1, n_post=1, default_depth=2, max_depth=4, max_seq_len=64)


def build_tiny_model(path, matrix_dtype="f32", seed=0):
    """A complete model for the default architecture (pre-norm, RMSNorm, tied head,
    additive injection). Matrices are stored as `matrix_dtype`; quantized dtypes need
    tinyloop.quantize."""
    rng = np.random.default_rng(seed)
    d, f = DIMS["d_model"], DIMS["ffn_dim"]
    hd, h, hkv = DIMS["head_dim"], DIMS["n_head"], DIMS["n_kv_head"]
    w = TinyLoopWriter(DIMS)
    w.add_metadata("general.name", "tiny")
    w.add_metadata("arch.norm_eps", 1e-5)

    def matrix(name, rows, cols):
        m = rng.standard_normal((rows, cols)) * 0.1
        if matrix_dtype in ("q8", "q4", "q2"):
            from tinyloop.fileformat.quantize import quantize
            w.add_tensor(name, quantize(m, matrix_dtype, group_size=32))
        else:
            w.add_tensor(name, m, matrix_dtype)

    w.add_tensor("embed.weight", rng.standard_normal((DIMS["vocab_size"], d)))
    w.add_tensor("final_norm.weight", np.ones(d))
    for prefix, count in (("pre", DIMS["n_pre"]), ("core", DIMS["n_core"]), ("post", DIMS["n_post"])):
        for i in range(count):
            b = f"{prefix}.{i}."
            w.add_tensor(b + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(d))
            w.add_tensor(b + "mlp_norm.weight", 1 + 0.1 * rng.standard_normal(d), "f16")
            matrix(b + "attn.q.weight", h * hd, d)
            matrix(b + "attn.k.weight", hkv * hd, d)
            matrix(b + "attn.v.weight", hkv * hd, d)
            matrix(b + "attn.o.weight", d, h * hd)
            matrix(b + "mlp.gate.weight", f, d)
            matrix(b + "mlp.up.weight", f, d)
            matrix(b + "mlp.down.weight", d, f)
    w.write(path)
    return path


# ------------------------------------------------------------------ round trips

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2)])
def test_float_round_trip(tmp_path, dtype, shape):
    a = np.random.default_rng(1).standard_normal(shape) * 3
    w = TinyLoopWriter(DIMS)
    w.add_tensor("t", a, dtype)
    w.write(tmp_path / "m.tinyloop")
    with read_file(tmp_path / "m.tinyloop", verify_checksums=True) as f:
        e = f.tensors["t"]
        assert (e.dtype, e.shape, e.group_size) == (dtype, shape, 0)
        got = f.tensor("t")
    assert got.dtype == np.float64 and got.shape == shape
    if dtype == "f32":
        np.testing.assert_array_equal(got, a.astype(np.float32))
    elif dtype == "f16":
        np.testing.assert_array_equal(got, a.astype(np.float16))
    else:
        np.testing.assert_allclose(got, a, rtol=2 ** -8)


def test_bf16_rounds_to_nearest_even_and_keeps_specials(tmp_path):
    one_ulp = 2.0 ** -7                         # bf16 spacing at 1.0
    values = np.array([1.0, 1.0 + one_ulp / 2,  # tie -> even (1.0)
                       1.0 + 1.5 * one_ulp,     # tie -> even (1 + 2 ulp)
                       -2.5, np.inf, -np.inf, np.nan, 0.0, -0.0], dtype=np.float32)
    w = TinyLoopWriter(DIMS)
    w.add_tensor("t", values, "bf16")
    w.write(tmp_path / "m.tinyloop")
    with read_file(tmp_path / "m.tinyloop") as f:
        got = f.tensor("t")
    np.testing.assert_array_equal(got[:6], [1.0, 1.0, 1.0 + 2 * one_ulp, -2.5, np.inf, -np.inf])
    assert np.isnan(got[6])
    assert got[7] == 0 and got[8] == 0 and np.signbit(got[8])


@pytest.mark.parametrize("dtype,group", [("q8", 32), ("q4", 64), ("q2", 128)])
def test_raw_quantized_round_trip(tmp_path, dtype, group):
    shape = (3, 256)
    size = tensor_nbytes(dtype, shape, group)
    data = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8).tobytes()
    w = TinyLoopWriter(DIMS)
    w.add_raw_tensor("q", dtype, shape, group, data)
    w.write(tmp_path / "m.tinyloop")
    with read_file(tmp_path / "m.tinyloop", verify_checksums=True) as f:
        e = f.tensors["q"]
        assert (e.dtype, e.shape, e.group_size, e.size) == (dtype, shape, group, size)
        assert e.crc32 == zlib.crc32(data)
        assert bytes(f.raw("q")) == data


@needs_quantize
@pytest.mark.parametrize("dtype", ["q8", "q4", "q2"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_qtensor_round_trip(tmp_path, dtype, group):
    from tinyloop.fileformat.quantize import quantize
    m = np.random.default_rng(3).standard_normal((5, 256))
    q = quantize(m, dtype, group_size=group)
    w = TinyLoopWriter(DIMS)
    w.add_tensor("q", q)
    w.write(tmp_path / "m.tinyloop")
    with read_file(tmp_path / "m.tinyloop", verify_checksums=True) as f:
        assert f.tensors["q"].dtype == dtype
        assert bytes(f.raw("q")) == q.to_bytes()
        np.testing.assert_array_equal(f.tensor("q"), q.dequantize())


def test_metadata_dims_and_layout(tmp_path):
    w = TinyLoopWriter(DIMS)
    meta = {"general.name": "tiny ✓", "arch.norm_eps": 1e-6, "loop.norm": True,
            "tokenizer.bos_id": -1, "big": 2 ** 62, "empty": ""}
    for k, v in meta.items():
        w.add_metadata(k, v)
    for i in range(3):
        w.add_tensor(f"t{i}", np.ones(i + 1))
    w.write(tmp_path / "m.tinyloop")
    raw = (tmp_path / "m.tinyloop").read_bytes()
    assert len(raw) % ALIGN == 0
    with read_file(tmp_path / "m.tinyloop") as f:
        assert f.version == 1
        assert f.dims == DIMS
        assert f.metadata == {**meta, "loop.norm": 1}
        assert isinstance(f.metadata["loop.norm"], int)
        assert f.data_offset % ALIGN == 0
        assert [e.offset % ALIGN for e in f.tensors.values()] == [0, 0, 0]
        assert list(f.tensors) == ["t0", "t1", "t2"]


def test_progress_reports_every_tensor(tmp_path):
    calls = []
    w = TinyLoopWriter(DIMS)
    w.add_tensor("a", np.zeros(10))
    w.add_tensor("b", np.zeros((4, 4)), "f16")
    w.write(tmp_path / "m.tinyloop", progress=lambda done, total, name: calls.append((done, total, name)))
    assert calls == [(40, 72, "a"), (72, 72, "b")]


def test_tiny_model_builds_and_reads(tmp_path):
    build_tiny_model(tmp_path / "m.tinyloop")
    with read_file(tmp_path / "m.tinyloop", verify_checksums=True) as f:
        assert f.tensors["core.0.attn.k.weight"].shape == (32, 64)
        assert f.tensors["pre.0.mlp_norm.weight"].dtype == "f16"


# ------------------------------------------------------------------ writer validation

@pytest.mark.parametrize("change,message", [
    ({"n_kv_head": 3}, "multiple of n_kv_head"),
    ({"default_depth": 5}, "default_depth (5) must be <= max_depth (4)"),
    ({"max_depth": 0, "default_depth": 0}, "max_depth must be >= 1 when n_core > 0"),
    ({"vocab_size": 0}, "vocab_size must be > 0"),
    ({"d_model": -1}, "d_model must be an integer"),
    ({"d_model": 2 ** 32}, "d_model must be an integer"),
    ({"n_layers": 3}, "unknown dims ['n_layers']"),
])
def test_bad_dims(change, message):
    with pytest.raises(FormatError) as e:
        TinyLoopWriter({**DIMS, **change})
    assert message in str(e.value)


def test_missing_dim():
    dims = dict(DIMS)
    del dims["max_seq_len"]
    with pytest.raises(FormatError, match=r"missing dims \['max_seq_len'\]"):
        TinyLoopWriter(dims)


@pytest.mark.parametrize("add,message", [
    (lambda w: w.add_tensor("", np.ones(2)), "non-empty"),
    (lambda w: w.add_tensor("a\nb", np.ones(2)), "printable ASCII"),
    (lambda w: w.add_tensor("é", np.ones(2)), "printable ASCII"),
    (lambda w: w.add_tensor("x", np.ones(2), "q4"), "quantize it first"),
    (lambda w: w.add_tensor("x", np.ones(2), "f64"), "stored as one of"),
    (lambda w: w.add_tensor("x", np.array(["a"])), "real numeric array"),
    (lambda w: w.add_tensor("x", np.ones((1, 2, 3, 4, 5))), "ndim must be 1..4"),
    (lambda w: w.add_tensor("x", np.ones((0, 3))), "positive integers"),
    (lambda w: w.add_tensor("x", [1.0, 2.0]), "numpy array or a QTensor"),
    (lambda w: w.add_raw_tensor("x", "q4", (64,), 32, b"\0" * 160), "must be 2-D"),
    (lambda w: w.add_raw_tensor("x", "q4", (2, 48), 32, b"\0" * 64), "cols % group_size == 0"),
    (lambda w: w.add_raw_tensor("x", "q8", (2, 64), 16, b"\0" * 136), "group_size of q8 must be one of"),
    (lambda w: w.add_raw_tensor("x", "f16", (4,), 32, b"\0" * 8), "group_size must be 0 for f16"),
    (lambda w: w.add_raw_tensor("x", "q2", (2, 64), 64, b"\0" * 10), "needs 40 bytes, got 10"),
    (lambda w: w.add_raw_tensor("x", "q9", (2, 64), 64, b""), "unknown dtype 'q9'"),
    (lambda w: w.add_metadata("", 1), "non-empty str"),
    (lambda w: w.add_metadata("k", [1]), "must be int, float, bool or str"),
    (lambda w: w.add_metadata("k", 2 ** 63), "does not fit in 64 bits"),
    (lambda w: w.add_metadata("k", "a\0b"), "must not contain NUL"),
])
def test_writer_rejects(add, message):
    w = TinyLoopWriter(DIMS)
    with pytest.raises(FormatError) as e:
        add(w)
    assert message in str(e.value)


def test_duplicates_rejected():
    w = TinyLoopWriter(DIMS)
    w.add_tensor("x", np.ones(2))
    w.add_metadata("k", 1)
    with pytest.raises(FormatError, match="tensor 'x' added twice"):
        w.add_tensor("x", np.ones(2))
    with pytest.raises(FormatError, match="metadata key 'k' added twice"):
        w.add_metadata("k", 2)


class _WrongSizeQTensor:
    dtype, shape, group_size = "q8", (1, 32), 32

    def to_bytes(self):
        return b"\0" * 3


def test_bad_qtensor_bytes_leave_no_file(tmp_path):
    w = TinyLoopWriter(DIMS)
    w.add_tensor("q", _WrongSizeQTensor())
    with pytest.raises(FormatError, match="gave 3 bytes, expected 34"):
        w.write(tmp_path / "m.tinyloop")
    assert not (tmp_path / "m.tinyloop").exists()


# ------------------------------------------------------------------ reader validation

def _valid_file(tmp_path):
    w = TinyLoopWriter(DIMS)
    w.add_metadata("general.name", "x")
    w.add_tensor("a", np.arange(16.0))
    w.add_tensor("b", np.arange(8.0), "f16")
    path = tmp_path / "m.tinyloop"
    w.write(path)
    return path, bytearray(path.read_bytes())


def _reseal_header(buf):
    struct.pack_into("<I", buf, 252, zlib.crc32(bytes(buf[:252])))


def _dir_span(buf):
    dir_offset, dir_size = struct.unpack_from("<QQ", buf, 40)
    return dir_offset, dir_size


def _reseal_dir(buf):
    off, size = _dir_span(buf)
    struct.pack_into("<I", buf, 132, zlib.crc32(bytes(buf[off:off + size])))
    _reseal_header(buf)


def _expect_error(tmp_path, buf, message, verify=False):
    p = tmp_path / "bad.tinyloop"
    p.write_bytes(bytes(buf))
    with pytest.raises(FormatError) as e:
        read_file(p, verify_checksums=verify)
    assert str(p) in str(e.value)
    assert message in str(e.value)


def test_reader_rejects_corruptions(tmp_path):
    path, good = _valid_file(tmp_path)
    read_file(path, verify_checksums=True).close()

    _expect_error(tmp_path, good[:100], "smaller than the 256-byte header")
    _expect_error(tmp_path, good[:-1], "file_size field says")

    bad = bytearray(good); bad[0:8] = b"TINYLOOX"
    _expect_error(tmp_path, bad, "bad magic")

    bad = bytearray(good); struct.pack_into("<I", bad, 8, 2); _reseal_header(bad)
    _expect_error(tmp_path, bad, "unsupported version: expected 1, got 2")

    bad = bytearray(good); bad[140] = 1
    _expect_error(tmp_path, bad, "header CRC-32 mismatch")

    bad = bytearray(good); bad[140] = 1; _reseal_header(bad)
    _expect_error(tmp_path, bad, "reserved header bytes")

    bad = bytearray(good); struct.pack_into("<I", bad, 92, 3); _reseal_header(bad)
    _expect_error(tmp_path, bad, "multiple of n_kv_head")

    bad = bytearray(good); bad[HEADER_SIZE + 5] ^= 0xFF
    _expect_error(tmp_path, bad, "metadata CRC-32 mismatch")

    # directory entry "a": u32 len=1, 'a', dtype, ndim, group, shape[1], offset, size, crc
    off, _ = _dir_span(good)
    bad = bytearray(good); struct.pack_into("<I", bad, off + 5, 9); _reseal_dir(bad)
    _expect_error(tmp_path, bad, "unknown dtype code 9")

    bad = bytearray(good); struct.pack_into("<Q", bad, off + 17, 17); _reseal_dir(bad)
    _expect_error(tmp_path, bad, "size: expected 68 bytes")

    bad = bytearray(good); struct.pack_into("<Q", bad, off + 25, 32); _reseal_dir(bad)
    _expect_error(tmp_path, bad, "not a multiple of 64")

    bad = bytearray(good); struct.pack_into("<Q", bad, off + 25, 1 << 40); _reseal_dir(bad)
    _expect_error(tmp_path, bad, "outside the data section")

    bad = bytearray(good); bad[off + 4] = ord("b"); _reseal_dir(bad)
    _expect_error(tmp_path, bad, "tensor 'b' appears twice")

    bad = bytearray(good); bad[off + 4] = 0x07; _reseal_dir(bad)
    _expect_error(tmp_path, bad, "printable ASCII")

    data_offset = struct.unpack_from("<Q", good, 56)[0]
    bad = bytearray(good); bad[data_offset] ^= 1
    read_file_ok = tmp_path / "flip.tinyloop"
    read_file_ok.write_bytes(bytes(bad))
    read_file(read_file_ok).close()              # tensor CRCs are only checked on request
    _expect_error(tmp_path, bad, "tensor 'a': CRC-32 mismatch", verify=True)


def test_reader_rejects_overlap(tmp_path):
    path, good = _valid_file(tmp_path)
    off, _ = _dir_span(good)
    second = off + 4 + 1 + 12 + 8 + 8 + 8 + 4     # entry "b" starts after entry "a"
    bad = bytearray(good); struct.pack_into("<Q", bad, second + 4 + 1 + 12 + 8, 0); _reseal_dir(bad)
    _expect_error(tmp_path, bad, "overlap")


def test_reader_missing_file(tmp_path):
    with pytest.raises(FormatError, match="cannot open"):
        read_file(tmp_path / "nope.tinyloop")


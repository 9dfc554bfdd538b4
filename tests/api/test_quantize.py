"""tinyloop.quantize: bit layouts of docs/format.md, error bounds, and the scale search."""

import struct
import time

import numpy as np
import pytest

from tinyloop.errors import FormatError
from tinyloop.fileformat.quantize import (QTensor, concat_rows, dequantize_raw, pack_codes,
                                          quantize, quantized_nbytes, unpack_codes)
from tinyloop.fileformat.tinyloop_file import TinyLoopWriter, read_file

QMAX = {"q8": 127, "q4": 15, "q2": 3}


def f16_bytes(*values) -> bytes:
    return struct.pack(f"<{len(values)}e", *values)


# ----------------------------------------------------------------------------- packing

def test_q4_packing_by_hand():
    # element j in the low nibble, element j + 16 in the high nibble of byte j
    q = np.array([list(range(16)) + [15 - j for j in range(16)]], dtype=np.uint8)
    packed = pack_codes("q4", q)
    assert packed.tobytes() == bytes(j | ((15 - j) << 4) for j in range(16))
    np.testing.assert_array_equal(unpack_codes("q4", packed, 1, 32), q)


def test_q2_packing_by_hand():
    # elements j, j+8, j+16, j+24 in bits 0-1, 2-3, 4-5, 6-7 of byte j
    q = np.repeat(np.arange(4, dtype=np.uint8), 8)[None, :]    # 0 x8, 1 x8, 2 x8, 3 x8
    assert pack_codes("q2", q).tobytes() == bytes([0b11100100] * 8)
    q = np.zeros((1, 32), dtype=np.uint8)
    q[0, 3], q[0, 3 + 24] = 1, 2
    assert pack_codes("q2", q).tobytes() == bytes([0, 0, 0, 1 | (2 << 6), 0, 0, 0, 0])


@pytest.mark.parametrize("dtype", ["q8", "q4", "q2"])
def test_pack_unpack_round_trip(dtype):
    rng = np.random.default_rng(1)
    if dtype == "q8":
        q = rng.integers(-127, 128, size=(5, 96)).astype(np.int8)
    else:
        q = rng.integers(0, QMAX[dtype] + 1, size=(5, 96)).astype(np.uint8)
    np.testing.assert_array_equal(unpack_codes(dtype, pack_codes(dtype, q), 5, 96), q)


# ----------------------------------------------------------------------------- file layout

def test_q4_bytes_are_codes_then_scales_then_mins():
    g = 32
    codes = np.array([[j % 16 for j in range(64)]], dtype=np.uint8)
    t = QTensor("q4", (1, 64), g, pack_codes("q4", codes), np.array([0.5, 2.0], np.float16),
                np.array([-1.0, 0.25], np.float16))
    chunk = bytes(j | (j << 4) for j in range(16))            # element j and j+16 share j % 16
    assert t.to_bytes() == chunk + chunk + f16_bytes(0.5, 2.0) + f16_bytes(-1.0, 0.25)
    assert len(t.to_bytes()) == quantized_nbytes("q4", (1, 64), g) == 32 + 8
    w = t.dequantize()
    np.testing.assert_array_equal(w[0, :32], 0.5 * (np.arange(32) % 16) - 1.0)
    np.testing.assert_array_equal(w[0, 32:], 2.0 * (np.arange(32) % 16) + 0.25)


def test_q8_bytes_are_codes_then_scales():
    w = np.zeros((2, 32))
    w[0, 0], w[0, 1], w[1, 5] = 127.0, -63.0, -2.0
    t = quantize(w, "q8", 32)
    codes = [127, -63] + [0] * 30 + [0] * 5 + [-127] + [0] * 26
    assert t.to_bytes() == struct.pack("<64b", *codes) + f16_bytes(1.0, 2.0 / 127)
    np.testing.assert_allclose(t.dequantize()[1, 5], -2.0, rtol=1e-3)


def test_q2_bytes_are_codes_then_scales_then_mins():
    w = np.repeat(np.arange(4.0), 8)[None, :] * 0.5 + 1.0    # exactly 1.0 + 0.5 * code
    t = quantize(w, "q2", 32)
    assert t.to_bytes() == bytes([0b11100100] * 8) + f16_bytes(0.5) + f16_bytes(1.0)
    np.testing.assert_array_equal(t.dequantize(), w)


@pytest.mark.parametrize("dtype", ["q8", "q4", "q2"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_from_bytes_round_trip_and_dequantize_raw(dtype, group_size):
    w = np.random.default_rng(2).standard_normal((3, 256))
    t = quantize(w, dtype, group_size)
    data = t.to_bytes()
    assert len(data) == quantized_nbytes(dtype, (3, 256), group_size) == t.nbytes
    back = QTensor.from_bytes(dtype, (3, 256), group_size, data)
    assert back.to_bytes() == data
    np.testing.assert_array_equal(back.dequantize(), t.dequantize())
    np.testing.assert_array_equal(dequantize_raw(dtype, (3, 256), group_size, data), t.dequantize())


def test_dequantize_raw_float_dtypes():
    values = np.array([[1.5, -2.25], [0.0, 3.0e-3]])
    np.testing.assert_array_equal(dequantize_raw("f32", (2, 2), 0, values.astype("<f4").tobytes()),
                                  values.astype(np.float32))
    np.testing.assert_array_equal(dequantize_raw("f16", (2, 2), 0, values.astype("<f2").tobytes()),
                                  values.astype(np.float16))
    # bf16 1.5 = 0x3FC0, -2.25 = 0xC010
    assert dequantize_raw("bf16", (2,), 0, struct.pack("<2H", 0x3FC0, 0xC010)).tolist() == [1.5, -2.25]


def test_quantized_tensor_through_a_file(tmp_path):
    w = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    t = quantize(w, "q4", 64)
    writer = TinyLoopWriter(dict(vocab_size=4, d_model=64, n_head=1, n_kv_head=1, head_dim=64,
                                 ffn_dim=64, n_pre=0, n_core=0, n_post=0, default_depth=0,
                                 max_depth=0, max_seq_len=8))
    writer.add_tensor("embed.weight", t)
    writer.write(tmp_path / "q.tinyloop")
    with read_file(tmp_path / "q.tinyloop") as f:
        assert (f.tensors["embed.weight"].dtype, f.tensors["embed.weight"].group_size) == ("q4", 64)
        assert bytes(f.raw("embed.weight")) == t.to_bytes()
        np.testing.assert_array_equal(f.tensor("embed.weight"), t.dequantize())


def test_concat_rows_equals_quantizing_the_whole():
    w = np.random.default_rng(4).standard_normal((6, 64))
    whole = quantize(w, "q2", 32)
    parts = concat_rows([quantize(w[:2], "q2", 32), quantize(w[2:], "q2", 32)])
    assert parts.to_bytes() == whole.to_bytes()


# ----------------------------------------------------------------------------- accuracy

def _group_view(a, group_size):
    return a.reshape(-1, group_size)


@pytest.mark.parametrize("dtype", ["q8", "q4", "q2"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_rtn_error_is_within_half_a_step(dtype, group_size):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((16, 256)) * rng.uniform(0.01, 3.0, size=(16, 1)) + rng.normal(0, 0.5, (16, 1))
    t = quantize(w, dtype, group_size)
    err = np.abs(_group_view(t.dequantize() - w, group_size))
    scale = t.scales.astype(np.float64)[:, None]
    groups = _group_view(w, group_size)
    # f16 storage of scale and min moves the grid by at most a relative 2^-11 of the range
    slack = 2.0**-10 * np.abs(groups).max(axis=1, keepdims=True)
    assert np.all(err <= 0.5 * scale + slack)
    # and the step is the group's range spread over the code range, not larger
    spread = groups.max(axis=1) - groups.min(axis=1) if dtype != "q8" else 2 * np.abs(groups).max(axis=1)
    levels = QMAX[dtype] if dtype != "q8" else 2 * QMAX[dtype]
    np.testing.assert_allclose(scale[:, 0], spread / levels, rtol=2.0**-10)


def test_rtn_constant_and_zero_groups():
    w = np.concatenate([np.full((2, 32), 0.75), np.zeros((2, 32))], axis=1)
    for dtype in ("q4", "q2"):       # the f16 min holds the constant exactly
        np.testing.assert_array_equal(quantize(w, dtype, 32).dequantize(), w)
    # symmetric q8 reaches the constant through 127 * f16(0.75 / 127)
    np.testing.assert_allclose(quantize(w, "q8", 32).dequantize(), w, rtol=2.0**-11, atol=0)


@pytest.mark.parametrize("dtype, max_ratio", [("q8", 0.99), ("q4", 0.9), ("q2", 0.75)])
@pytest.mark.parametrize("group_size", [32, 128])
def test_search_beats_rtn(dtype, max_ratio, group_size):
    w = np.random.default_rng(6).standard_normal((32, 256))
    rtn = quantize(w, dtype, group_size, "rtn").dequantize()
    search = quantize(w, dtype, group_size, "search").dequantize()
    rtn_sq = _group_view((rtn - w) ** 2, group_size).sum(axis=1)
    search_sq = _group_view((search - w) ** 2, group_size).sum(axis=1)
    assert search_sq.sum() <= max_ratio * rtn_sq.sum()
    assert np.all(search_sq <= rtn_sq * (1 + 1e-12))       # never worse on any group


def test_rtn_is_fast_on_an_embedding_sized_matrix():
    w = np.random.default_rng(7).standard_normal((49152, 576), dtype=np.float32)
    start = time.perf_counter()
    t = quantize(w, "q4", 32)
    elapsed = time.perf_counter() - start
    assert t.shape == (49152, 576)
    assert elapsed < 5.0, f"q4 rtn of 49152x576 took {elapsed:.2f} s"


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("shape, group_size, match", [
    ((4, 48), 32, "multiple of group_size"),
    ((4, 64), 16, "group_size"),
    ((64,), 32, "2-D"),
])
def test_bad_layouts_are_rejected(shape, group_size, match):
    with pytest.raises(FormatError, match=match):
        quantize(np.zeros(shape), "q4", group_size)


def test_bad_values_and_byte_counts_are_rejected():
    with pytest.raises(ValueError, match="nan"):
        quantize(np.full((1, 32), np.nan), "q8", 32)
    with pytest.raises(ValueError, match="method"):
        quantize(np.zeros((1, 32)), "q8", 32, "best")
    with pytest.raises(FormatError, match="bytes"):
        QTensor.from_bytes("q4", (1, 32), 32, b"\0" * 19)
    with pytest.raises(FormatError, match="dtype"):
        dequantize_raw("q3", (1, 32), 32, b"")

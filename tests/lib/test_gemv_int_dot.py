"""The arithmetic of the CUDA GEMV's integer path, emulated on the CPU bit for bit.

libtinyloop/cuda/cuda_matmul.cu turns each staged chunk of 32 activations into a record
(act_records): a power-of-two grid step s from the exponent of the chunk's largest
magnitude, v = rint(x / s) as 24-bit integers stored as 16-bit low halves (two per word)
and signed high bytes (four per word), the step and the fp32 sum of the chunk. The
quantized codes, taken from the file's packing exactly as chunk_codes reads 32-bit words,
meet the records in dp2a / dp4a integer dot products (int_dot_chunk), which are folded
into fp32 with the chunk's scale and min. This test repeats those steps in numpy on the
same constants (read from the kernel source) and holds the result to a float64 oracle.
"""

import re
from pathlib import Path

import numpy as np
import pytest

from tinyloop.fileformat.quantize import pack_codes

SOURCE = Path(__file__).resolve().parents[2] / "libtinyloop" / "cuda" / "cuda_matmul.cu"


def kernel_constant(name: str) -> int:
    m = re.search(rf"constexpr int {name} = (\d+);", SOURCE.read_text())
    assert m, f"{name} not found in {SOURCE}"
    return int(m.group(1))


REC_WORDS = kernel_constant("ACT_REC_WORDS")      # 16 low words, 8 high words, step, sum
V_MAX = kernel_constant("ACT_V_MAX")
SMALL_EXP = kernel_constant("ACT_SMALL_EXP")
THREADS_PER_CHUNK = kernel_constant("ACT_THREADS_PER_CHUNK")
F32 = np.float32


def test_record_layout_matches_the_kernel():
    assert REC_WORDS == 26 and REC_WORDS * 4 <= 32 * 4       # written over the fp32 chunk
    assert (REC_WORDS // 2) % 2 == 1                          # 64-bit reads: 16 banks pairs apart
    assert V_MAX == 2 ** 23 - 1 and THREADS_PER_CHUNK * 8 == 32    # eight elements a thread


# ---------------------------------------------------------------- act_records, emulated

def chunk_sum(x: np.ndarray) -> F32:
    """The kernel's order: per thread ((x0 + x1) + (x2 + x3)) + ... over its eight
    elements, pair by pair, then an xor butterfly."""
    part = []
    for k in range(THREADS_PER_CHUNK):
        total = F32(0)
        for j in range(8 * k, 8 * k + 8, 2):
            total = F32(total + F32(F32(x[j]) + F32(x[j + 1])))
        part.append(total)
    o = 1
    while o < THREADS_PER_CHUNK:
        part = [F32(part[k] + part[k ^ o]) for k in range(THREADS_PER_CHUNK)]
        o <<= 1
    assert len(set(np.asarray(part).view(np.uint32).tolist())) == 1   # every lane agrees
    return part[0]


def act_record(x: np.ndarray) -> np.ndarray:
    """The 26-word record of one chunk of 32 fp32 activations."""
    x = np.asarray(x, dtype=F32)
    amax = int((x.view(np.uint32) & 0x7FFFFFFF).max())
    e = amax >> 23
    if e == 255:
        step, inv = F32(np.nan), F32(0)
    elif e >= SMALL_EXP:
        step = np.uint32((e - 22) << 23).view(F32)      # 2^(e - 149)
        inv = np.uint32((276 - e) << 23).view(F32)      # 2^(149 - e)
    else:
        step, inv = F32(0), F32(0)
    with np.errstate(invalid="ignore"):
        q = x * inv                                     # exact: a power of two
        v = np.where(np.isfinite(q), np.rint(q), 0).astype(np.int64)   # cvt.rni, NaN -> 0
    v = np.minimum(v, V_MAX)
    assert np.all(v >= -(2 ** 23))
    u = v.astype(np.int64) & 0xFFFFFFFF
    rec = np.zeros(REC_WORDS, dtype=np.uint32)
    for m in range(16):   # low halves, elements 2m, 2m+1
        rec[m] = (u[2 * m] & 0xFFFF) | ((u[2 * m + 1] & 0xFFFF) << 16)
    for w in range(8):    # high bytes (v >> 16 as int8), elements 4w .. 4w+3
        rec[16 + w] = sum(((u[4 * w + j] >> 16) & 0xFF) << (8 * j) for j in range(4))
    rec[24] = np.asarray(step, dtype=F32).view(np.uint32)
    rec[25] = np.asarray(chunk_sum(x), dtype=F32).view(np.uint32)
    return rec


def record_values(rec: np.ndarray) -> np.ndarray:
    """s * v back from a record (what the integer path multiplies)."""
    low = np.array([(rec[m // 2] >> (16 * (m % 2))) & 0xFFFF for m in range(32)], dtype=np.int64)
    high = np.array([(rec[16 + m // 4] >> (8 * (m % 4))) & 0xFF for m in range(32)], dtype=np.int64)
    high = np.where(high >= 128, high - 256, high)
    return (high * 65536 + low).astype(np.float64) * float(rec[24:25].view(F32)[0])


# ---------------------------------------------------------------- int_dot_chunk, emulated

def code_words(dtype: str, qs_chunk: np.ndarray) -> list[int]:
    """chunk_codes(bits, k) for k = 0..7 from the chunk's packed bytes (little endian)."""
    words = np.frombuffer(np.ascontiguousarray(qs_chunk).tobytes(), dtype="<u4").astype(np.uint64)
    out = []
    for k in range(8):
        if dtype == "q4":
            out.append(int((words[k & 3] >> (4 if k >= 4 else 0)) & 0x0F0F0F0F))
        elif dtype == "q2":
            out.append(int((words[k & 1] >> (2 * (k >> 1))) & 0x03030303))
        else:
            out.append(int(words[k]))
    return out


def byte(word: int, j: int, signed: bool) -> int:
    b = (word >> (8 * j)) & 0xFF
    return b - 256 if signed and b >= 128 else b


def half(word: int, j: int) -> int:
    return (word >> (16 * j)) & 0xFFFF


def int32(v: int) -> int:
    assert -(2 ** 31) <= v < 2 ** 31, "int32 overflow"
    return v


def fma32(a, b, c) -> F32:
    # a * b is exact in float64; the sum rounds twice (float64, then float32), which
    # differs from one fused rounding only in ties far below this test's tolerances
    return F32(np.float64(a) * np.float64(b) + np.float64(c))


def int_dot_chunk(dtype: str, qs_chunk, scale: F32, vmin: F32, rec: np.ndarray, acc: F32) -> F32:
    signed = dtype == "q8"
    codes = code_words(dtype, qs_chunk)
    low = high = 0
    for q in range(4):
        for k in range(2):
            c = codes[2 * q + k]
            lw0, lw1, hw = int(rec[4 * q + 2 * k]), int(rec[4 * q + 2 * k + 1]), int(rec[16 + 2 * q + k])
            low = int32(low + half(lw0, 0) * byte(c, 0, signed) + half(lw0, 1) * byte(c, 1, signed))   # dp2a.lo
            low = int32(low + half(lw1, 0) * byte(c, 2, signed) + half(lw1, 1) * byte(c, 3, signed))   # dp2a.hi
            high = int32(high + sum(byte(hw, j, True) * byte(c, j, signed) for j in range(4)))          # dp4a
    step, xsum = rec[24:26].view(F32)
    dot = fma32(F32(high), F32(65536), F32(low))
    if dtype == "q8":
        return fma32(F32(scale * step), dot, acc)
    return F32(acc + fma32(F32(scale * step), dot, F32(vmin * xsum)))


# ---------------------------------------------------------------- the test cases

QMAX = {"q8": 127, "q4": 15, "q2": 3}


def random_row(rng, dtype: str, cols: int):
    if dtype == "q8":
        q = rng.integers(-128, 128, size=(1, cols)).astype(np.int8)   # -128 included (the bound)
    else:
        q = rng.integers(0, QMAX[dtype] + 1, size=(1, cols)).astype(np.uint8)
    chunks = cols // 32
    scale = rng.uniform(0.001, 0.05, size=chunks).astype(np.float16).astype(F32)
    vmin = (None if dtype == "q8" else rng.uniform(-0.3, 0.1, size=chunks).astype(np.float16).astype(F32))
    return q, pack_codes(dtype, q), scale, vmin


def activations(rng, kind: str, cols: int) -> np.ndarray:
    x = rng.standard_normal(cols).astype(F32)
    if kind == "huge":          # one value 1e6 times the rest in every chunk
        x[::32] = F32(3e5)
    elif kind == "zeros":       # whole chunks of zeros between normal ones
        x.reshape(-1, 32)[::2] = 0
    elif kind == "negative":
        x = -np.abs(x) * F32(7.5)
    elif kind == "extremes":    # max / tiny magnitudes, denormals, a chunk at the clamp
        x[:32] = F32(1e-40)
        x[32:64] *= F32(1e-30)
        x[64] = np.uint32(0x7F7FFFFF).view(F32) / F32(2 ** 10)
        x[96] = np.uint32(0x4AFFFFFF).view(F32)   # mantissa all ones: rounds to 2^23
        x[97] = -x[96]
    elif kind == "wide":        # magnitudes spread over many octaves
        x *= (F32(2.0) ** rng.integers(-20, 20, size=cols)).astype(F32)
    return x


@pytest.mark.parametrize("dtype", ["q8", "q4", "q2"])
@pytest.mark.parametrize("kind", ["normal", "huge", "zeros", "negative", "extremes", "wide"])
def test_integer_path_tracks_float64(dtype, kind):
    rng = np.random.default_rng(hash((dtype, kind)) % 2 ** 32)
    cols = 2048
    for _ in range(3):
        q, qs, scale, vmin = random_row(rng, dtype, cols)
        x = activations(rng, kind, cols)
        chunk_bytes = {"q8": 32, "q4": 16, "q2": 8}[dtype]
        acc = F32(0)
        grid_error = 0.0
        for c in range(cols // 32):
            xc = x[32 * c:32 * c + 32]
            rec = act_record(xc)
            step = float(rec[24:25].view(F32)[0])
            # the only error of the records: half a grid step, at most 2^-23 of the chunk
            # max; chunks below 2^(SMALL_EXP - 127) read as 0
            amax = float(np.abs(xc).max())
            bound = step / 2 if step > 0 else amax
            assert step == 0 or step / 2 <= amax * 2.0 ** -23
            assert step > 0 or amax < 2.0 ** (SMALL_EXP - 127)
            assert np.all(np.abs(record_values(rec) - xc.astype(np.float64)) <= bound)
            grid_error += np.abs(scale[c] * q[0, 32 * c:32 * c + 32].astype(np.float64)).sum() * bound
            acc = int_dot_chunk(dtype, qs[chunk_bytes * c:chunk_bytes * (c + 1)], scale[c],
                                F32(0) if vmin is None else vmin[c], rec, acc)
        qf = q[0].astype(np.float64).reshape(-1, 32)
        w = scale.astype(np.float64)[:, None] * qf + (0 if vmin is None else vmin.astype(np.float64)[:, None])
        exact = float((w.reshape(-1) * x.astype(np.float64)).sum())
        magnitude = float(np.abs(w.reshape(-1) * x.astype(np.float64)).sum())
        err = abs(float(acc) - exact)
        # the grid error plus fp32 folding (a few roundings of each chunk's terms)
        assert err <= grid_error + 2.0 ** -20 * magnitude, (err, grid_error, magnitude)
        if kind in ("normal", "negative", "zeros"):
            assert err <= 1e-6 * magnitude, (err, magnitude)


def test_int32_bounds_hold_at_the_extremes():
    # largest |v| against the largest codes: the sums the kernel keeps in int32
    low_max = 32 * 0xFFFF * 128
    high_max = 32 * 128 * 128
    assert low_max < 2 ** 31 and high_max < 2 ** 31
    rec = act_record(np.full(32, -np.uint32(0x4AFFFFFF).view(F32), dtype=F32))
    qs = pack_codes("q8", np.full((1, 32), -128, dtype=np.int8))
    out = int_dot_chunk("q8", qs, F32(1), F32(0), rec, F32(0))
    assert out == F32(32 * 128 * 2 ** 23)   # -(2^23 - 0.5) rounds to -2^23, still representable


@pytest.mark.filterwarnings("ignore:invalid value")
def test_non_finite_chunk_gives_nan():
    x = np.ones(32, dtype=F32)
    x[5] = np.inf
    rec = act_record(x)
    assert np.isnan(rec[24:25].view(F32)[0])
    qs = pack_codes("q4", np.zeros((1, 32), dtype=np.uint8))
    assert np.isnan(int_dot_chunk("q4", qs, F32(0.01), F32(0.0), rec, F32(0)))

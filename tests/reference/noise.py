"""The seeded normal n(seed, pos, j) of docs/model.md, on numpy uint64 arrays.

numpy's uint64 arithmetic wraps modulo 2^64, which is exactly the arithmetic the
specification asks for."""

import numpy as np

_MASK64 = (1 << 64) - 1


def _u64(x):
    return np.asarray(x, dtype=np.uint64)


def splitmix64(x):
    with np.errstate(over="ignore"):
        z = _u64(x) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def seeded_normal(seed: int, pos: int, width: int) -> np.ndarray:
    """n(seed, pos, j) for j = 0..width-1, as float64 (Box-Muller on two splitmix64 draws)."""
    j = np.arange(width, dtype=np.uint64)
    with np.errstate(over="ignore"):
        # the seed is a signed 64-bit metadata int; its two's-complement bits are the u64 seed
        key = splitmix64(splitmix64(_u64(int(seed) & _MASK64)) + _u64(pos))
        a = splitmix64(key + np.uint64(2) * j)
        b = splitmix64(key + np.uint64(2) * j + np.uint64(1))
    return _box_muller(a, b)


def _box_muller(a, b):
    u1 = ((a >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0**-53
    u2 = (b >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


# draws of the truncated normal before it gives up (docs/model.md)
TRUNCATED_DRAWS = 64


def truncated_seeded_normal(seed: int, pos: int, width: int, limit: float) -> np.ndarray:
    """n_T(seed, pos, j): the seeded normal redrawn with the next counter (2j + k * 2^33,
    k = 1, 2, ...) while |n| > limit, 0 after 64 draws outside. `limit` is rounded to float32
    as the file's value is in the library."""
    limit = float(np.float32(limit))
    with np.errstate(over="ignore"):
        key = splitmix64(splitmix64(_u64(int(seed) & _MASK64)) + _u64(pos))
    out = np.zeros(width)
    pending = np.arange(width, dtype=np.uint64)
    for k in range(TRUNCATED_DRAWS):
        with np.errstate(over="ignore"):
            counter = key + np.uint64(2) * pending + (np.uint64(k) << np.uint64(33))
            a, b = splitmix64(counter), splitmix64(counter + np.uint64(1))
        z = _box_muller(a, b)
        inside = np.abs(z) <= limit
        out[pending[inside].astype(np.int64)] = z[inside]
        pending = pending[~inside]
        if pending.size == 0:
            break
    return out

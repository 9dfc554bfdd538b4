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
    u1 = ((a >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0**-53
    u2 = (b >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)

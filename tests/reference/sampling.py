"""Token sampling as docs/sampling.md defines it, written out plainly: the seeded
generator, the penalty, candidates sorted by rank key, exact integer weights, the
top-k / min-p / top-p cuts on that sorted list and the draw over token ids in order.

It never calls libtinyloop; the tests hold the library's host sampler and every
backend's sample op to it, token for token.
"""

import math

import numpy as np

MASK64 = (1 << 64) - 1
WEIGHT_ONE = 1 << 40
EXP2_NEG_Q31 = np.array([round(2.0 ** (31 - j / 64)) for j in range(64)], dtype=np.uint64)
LOG2E_Q31 = 3098164009       # round(log2(e) * 2^31)
LN2_Q32 = 2977044472         # round(ln(2) * 2^32)
SIXTH_Q32 = 715827883        # round(2^32 / 6)
TWENTY_FOURTH_Q32 = 178956971  # round(2^32 / 24)


def _rotl(x: int, k: int) -> int:
    return ((x << k) | (x >> (64 - k))) & MASK64


class Generator:
    """xoshiro256**, its state seeded from the seed through splitmix64."""

    def __init__(self, seed: int):
        x = seed & MASK64
        self.s = []
        for _ in range(4):
            x = (x + 0x9E3779B97F4A7C15) & MASK64
            z = x
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
            self.s.append(z ^ (z >> 31))

    def next(self) -> int:
        s = self.s
        result = (_rotl((s[1] * 5) & MASK64, 7) * 9) & MASK64
        t = (s[1] << 17) & MASK64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = _rotl(s[3], 45)
        return result


def penalized_tokens(history, window: int) -> list:
    """The distinct tokens of the last `window` tokens of history (0 = all)."""
    recent = list(history)[-window:] if window > 0 else list(history)
    return list(dict.fromkeys(int(t) for t in recent))


def rank_keys(logits: np.ndarray) -> np.ndarray:
    """Order-preserving uint64 keys: logit (NaN lowest, -0 as +0), then smaller id."""
    x = np.where(logits == 0, np.float32(0), logits).astype(np.float32)
    bits = x.view(np.uint32)
    order = np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)
    order = np.where(np.isnan(x), np.uint32(0), order)
    ids = np.arange(len(x), dtype=np.uint64)
    return (order.astype(np.uint64) << np.uint64(32)) | (~ids & np.uint64(0xFFFFFFFF))


def weights(logits: np.ndarray, best: np.float32, inv_temperature: np.float32) -> np.ndarray:
    """floor(2^40 exp(-(best - logit) / T)) in the fixed point of docs/sampling.md."""
    with np.errstate(invalid="ignore", over="ignore"):
        m = (np.float32(best) - logits.astype(np.float32)) * np.float32(inv_temperature)
    ok = (m >= 0) & (m < 32)
    m = np.where(ok, m, np.float32(0)).astype(np.float32)
    M = (m * np.float32(2.0 ** 27)).astype(np.uint64)           # truncated, Q27
    z = M * np.uint64(LOG2E_Q31)                                 # Q58 of m log2(e)
    n = (z >> np.uint64(58)).astype(np.int64)
    f = (z >> np.uint64(26)) & np.uint64(0xFFFFFFFF)             # its fraction, Q32
    j = (f >> np.uint64(26)).astype(np.int64)
    r = f & np.uint64(0x3FFFFFF)
    a = (r * np.uint64(LN2_Q32)) >> np.uint64(32)
    a2 = (a * a) >> np.uint64(32)
    a3 = (a2 * a) >> np.uint64(32)
    a4 = (a3 * a) >> np.uint64(32)
    e = (np.uint64(1 << 32) - a + (a2 >> np.uint64(1))
         - ((a3 * np.uint64(SIXTH_Q32)) >> np.uint64(32))
         + ((a4 * np.uint64(TWENTY_FOURTH_Q32)) >> np.uint64(32)))
    p = EXP2_NEG_Q31[j] * (e >> np.uint64(1))                    # Q62
    shift = 22 + n
    q = np.where(shift < 64, p >> np.minimum(shift, 63).astype(np.uint64), np.uint64(0))
    return np.where(ok, q, np.uint64(0)).astype(np.uint64)


def greedy(logits: np.ndarray) -> int:
    """The sequential scan's first maximum: NaN never wins, except at index 0."""
    if np.isnan(logits[0]) or np.all(np.isnan(logits)):
        return 0
    return int(np.nanargmax(logits))


def adjust_logits(logits, *, generated=(), presence_penalty=0.0, frequency_penalty=0.0,
                  logit_bias=None) -> np.ndarray:
    """Step 0 of docs/sampling.md: each logit plus its token's bias, minus count *
    frequency_penalty + presence_penalty for a token generated count > 0 times, summed in
    double and rounded to float32 once."""
    x = np.array(logits, dtype=np.float32)
    counts = {}
    for t in generated:
        counts[int(t)] = counts.get(int(t), 0) + 1
    bias = {int(t): float(np.float32(b)) for t, b in (logit_bias or {}).items()}
    for t in set(counts) | set(bias):
        c = counts.get(t, 0)
        penalty = c * float(np.float32(frequency_penalty)) + float(np.float32(presence_penalty)) if c else 0.0
        x[t] = np.float32(float(x[t]) + bias.get(t, 0.0) - penalty)
    return x


def sample(logits, *, temperature, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
           repetition_window=64, history=(), random=0) -> int:
    """The token of one step; `random` is the step's output of Generator (unused
    when temperature is 0)."""
    x = np.array(logits, dtype=np.float32)
    vocab = len(x)
    penalty = np.float32(repetition_penalty)
    if penalty != 1:
        with np.errstate(over="ignore"):   # float32 overflow to +-inf, as in C
            for t in penalized_tokens(history, repetition_window):
                if 0 <= t < vocab:
                    x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    if not np.float32(temperature) > 0:
        return greedy(x)
    fallback = greedy(x)

    order = np.argsort(rank_keys(x))[::-1]      # best first
    if 0 < top_k < vocab:
        order = order[:top_k]
    finite = x[~np.isnan(x)]
    best = finite.max() if len(finite) else np.float32(-np.inf)
    w = weights(x, best, np.float32(1) / np.float32(temperature))
    min_weight = max(1, math.ceil(float(np.float32(min_p)) * WEIGHT_ONE))
    kept = [int(i) for i in order if int(w[i]) >= min_weight]
    total = sum(int(w[i]) for i in kept)
    if total == 0:
        return fallback
    if np.float32(top_p) < 1:
        need = math.ceil(float(np.float32(top_p)) * float(total))
        need = total if need >= float(total) else max(1, need)
        cum = 0
        for n, i in enumerate(kept):
            cum += int(w[i])
            if cum >= need:
                kept = kept[:n + 1]
                break
        total = cum
    point = ((random >> 11) * total) >> 53
    acc = 0
    for i in sorted(kept):
        acc += int(w[i])
        if point < acc:
            return i
    raise AssertionError("the draw fell past the kept tokens")

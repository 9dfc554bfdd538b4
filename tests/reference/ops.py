"""The math primitives of docs/model.md in float64: norms, RoPE, attention, activations.

Each function is a direct transcription of one formula; nothing here knows about blocks,
tensor names or files."""

import numpy as np


def rmsnorm(x, weight, eps, unit_offset=False):
    """y = x / sqrt(mean(x^2) + eps) * g, with g = w or g = 1 + w."""
    gain = 1.0 + weight if unit_offset else weight
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def layernorm(x, weight, bias, eps):
    """y = (x - mean) / sqrt(var + eps) * w + b, with the biased variance."""
    centred = x - np.mean(x, axis=-1, keepdims=True)
    var = np.mean(centred * centred, axis=-1, keepdims=True)
    return centred / np.sqrt(var + eps) * weight + bias


def rope(x, positions, rot_dims, theta, style, factors=None):
    """Rotate the first rot_dims dims of each head of x [n, heads, hd] by position.

    Pair i (i < rot_dims/2) turns by positions * theta^(-2i/rot_dims) / factors[i]
    (factors: the model's rope.freq_factors, or None for all ones); `half` pairs
    (x_i, x_{i+r/2}), `interleaved` pairs (x_{2i}, x_{2i+1})."""
    half = rot_dims // 2
    freq = theta ** (-2.0 * np.arange(half) / rot_dims)
    if factors is not None:
        freq = freq / np.asarray(factors, dtype=np.float64)
    angle = np.asarray(positions, dtype=np.float64)[:, None] * freq[None, :]   # [n, r/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]           # broadcast over heads
    if style == "half":
        first, second = np.arange(half), np.arange(half) + half
    elif style == "interleaved":
        first, second = 2 * np.arange(half), 2 * np.arange(half) + 1
    else:
        raise ValueError(f"unknown rope style {style!r}")
    a, b = x[..., first], x[..., second]
    out = x.copy()
    out[..., first] = a * cos - b * sin
    out[..., second] = a * sin + b * cos
    return out


def attention(q, k, v, q_positions, k_positions, scale, window=0):
    """Causal (optionally windowed) softmax attention with GQA.

    q [n, h, hd]; k, v [m, h_kv, hd]; query head t reads kv head t // (h / h_kv).
    Returns [n, h * hd] (heads concatenated)."""
    n, n_head, head_dim = q.shape
    group = n_head // k.shape[1]
    k_per_head = np.repeat(k, group, axis=1)      # [m, h, hd]: kv head j serves heads j*group..
    v_per_head = np.repeat(v, group, axis=1)
    scores = np.einsum("nhd,mhd->hnm", q, k_per_head) * scale
    qp, kp = np.asarray(q_positions)[:, None], np.asarray(k_positions)[None, :]
    visible = kp <= qp
    if window:
        visible &= kp > qp - window
    scores = np.where(visible[None, :, :], scores, -np.inf)
    probs = softmax(scores, axis=-1)
    out = np.einsum("hnm,mhd->nhd", probs, v_per_head)
    return out.reshape(n, n_head * head_dim)


def softmax(x, axis=-1):
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


def log_softmax(x, axis=-1):
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def next_token_logprobs(logits, tokens):
    """log_softmax(logits[i])[tokens[i+1]] for i = 0..n-2 (the scoring of docs/model.md)."""
    tokens = np.asarray(tokens)
    lp = log_softmax(logits[:-1], axis=-1)
    return lp[np.arange(len(tokens) - 1), tokens[1:]]


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def int16_blocks(x, block=32):
    """x with each run of `block` values of a row rounded to int16 steps of amax/32767
    (round half to even), the activation quantization of docs/model.md."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    step = amax / 32767.0
    codes = np.rint(blocks / np.where(step > 0, step, 1.0))
    return (codes * step).reshape(x.shape)


def exit_distribution(lam):
    """(p, cdf) of the exit gate's lambda [n, T] (docs/model.md, "Exit gate"): p_i = lambda_i
    prod_{j<i} (1 - lambda_j) for i < T, p_T the remainder, cdf the running sum of p."""
    lam = np.asarray(lam, dtype=np.float64)
    stay = np.cumprod(1.0 - lam, axis=1)                      # prod_{j<=i} (1 - lambda_j)
    before = np.concatenate([np.ones_like(lam[:, :1]), stay[:, :-1]], axis=1)
    p = lam * before
    p[:, -1] = before[:, -1]
    return p, np.cumsum(p, axis=1)

"""A second oracle for the looped-family importers: each family's forward pass in float64,
written from the facts of its reference code (Huginn raven_modeling_minimal.py, Ouro
modeling_ouro.py, Nanbeige modeling_nanbeige.py) on the checkpoint's raw tensors and config,
never through a .tinyloop file or TinyLoop's names. The tests hold the reference oracle on the
converted file (tests/reference) to it, which checks the importers' mapping."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from looped_checkpoints import read_checkpoint


def _rms(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _causal_attention(q, k, v, scale):
    """q [n, h, hd], k / v [n, h_kv, hd]; head t reads kv head t // (h / h_kv)."""
    n, h, hd = q.shape
    rep = h // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("ihd,jhd->hij", q, k) * scale
    s = np.where(np.tril(np.ones((n, n), dtype=bool))[None], s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", s, v).reshape(n, h * hd)


def _rotate_half(x, positions, theta):
    """NeoX RoPE over the whole head: inv_freq = theta^(-arange(0, hd, 2) / hd)."""
    hd = x.shape[-1]
    ang = positions[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
    return x * cos + rotated * sin


def _config(directory) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


# ---------------------------------------------------------------- Huginn

def huginn_logits(directory, tokens, num_steps: int) -> np.ndarray:
    """RavenForCausalLM.forward with input_states = zeros (init_scale 0), num_steps steps."""
    c, w = _config(directory), read_checkpoint(directory)
    d, h = c["n_embd"], c["n_heads"]
    hd, eps = d // h, c["norm_eps"]
    tokens = np.asarray(tokens)
    n = len(tokens)
    table = w["freqs_cis"][0, :n, 0]                     # [n, hd/2, (cos, sin)], as loaded
    cos, sin = table[..., 0][:, None, :], table[..., 1][:, None, :]

    def rope(x):                                         # apply_rotary_emb_complex_like
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return out

    def block(p, x):                                     # SandwichBlock
        y = _rms(x, w[p + "norm_1.weight"], eps) @ w[p + "attn.Wqkv.weight"].T
        q, k, v = (y[:, i * d:(i + 1) * d].reshape(n, h, hd) for i in range(3))
        if c["qk_bias"]:
            q, k = q + w[p + "attn.qk_bias"][0], k + w[p + "attn.qk_bias"][1]
        att = _causal_attention(rope(q), rope(k), v, hd ** -0.5) @ w[p + "attn.proj.weight"].T
        x = _rms(att + x, w[p + "norm_2.weight"], eps)
        fc = _rms(x, w[p + "norm_3.weight"], eps) @ w[p + "mlp.fc.weight"].T
        gate, up = fc[:, :c["intermediate_size"]], fc[:, c["intermediate_size"]:]
        return _rms((_silu(gate) * up) @ w[p + "mlp.proj.weight"].T + x, w[p + "norm_4.weight"], eps)

    e = w["transformer.wte.weight"][tokens] * np.sqrt(d)
    for i in range(c["n_layers_in_prelude"]):
        e = block(f"transformer.prelude.{i}.", e)
    x = np.zeros_like(e)
    for _ in range(num_steps):
        x = np.concatenate([x, e], axis=-1) @ w["transformer.adapter.weight"].T
        if c["bias"]:
            x = x + w["transformer.adapter.bias"]
        for i in range(c["n_layers_in_recurrent_block"]):
            x = block(f"transformer.core_block.{i}.", x)
    x = _rms(x, w["transformer.ln_f.weight"], eps)       # iterate_forward returns ln_f(x)
    for i in range(c["n_layers_in_coda"]):
        x = block(f"transformer.coda.{i}.", x)
    x = _rms(x, w["transformer.ln_f.weight"], eps)
    head = w["transformer.wte.weight"] if c["tie_embeddings"] else w["lm_head.weight"]
    return x @ head.T


# ---------------------------------------------------------------- Ouro and Nanbeige

def _llama_attention(c, w, p, x, positions):
    h, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    n = x.shape[0]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(n, h, hd)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv, hd)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv, hd)
    q, k = _rotate_half(q, positions, c["rope_theta"]), _rotate_half(k, positions, c["rope_theta"])
    return _causal_attention(q, k, v, hd ** -0.5) @ w[p + "self_attn.o_proj.weight"].T


def _llama_mlp(w, p, x):
    return (_silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ \
        w[p + "mlp.down_proj.weight"].T


def _head(c, w, x):
    return x @ (w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]).T


def ouro_forward(directory, tokens, steps: int):
    """(logits of the last step, lambda [n, steps]): every step runs all layers
    (sandwich on the branches) then model.norm, fed to the next step; the gate reads each
    step's normed state; lm_head reads the last one with nothing after."""
    c, w = _config(directory), read_checkpoint(directory)
    eps = c["rms_norm_eps"]
    tokens = np.asarray(tokens)
    positions = np.arange(len(tokens), dtype=np.float64)
    x = w["model.embed_tokens.weight"][tokens]
    gates = []
    for _ in range(steps):
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = x + _rms(_llama_attention(c, w, p, _rms(x, w[p + "input_layernorm.weight"], eps), positions),
                         w[p + "input_layernorm_2.weight"], eps)
            x = x + _rms(_llama_mlp(w, p, _rms(x, w[p + "post_attention_layernorm.weight"], eps)),
                         w[p + "post_attention_layernorm_2.weight"], eps)
        x = _rms(x, w["model.norm.weight"], eps)
        gates.append(x @ w["model.early_exit_gate.weight"][0] + w["model.early_exit_gate.bias"][0])
    return _head(c, w, x), 1.0 / (1.0 + np.exp(-np.stack(gates, axis=1)))


def ouro_exit_cdf(lam):
    """p_t = lambda_t prod_{j<t} (1 - lambda_j) (t < T-1), p_{T-1} the remainder; CDF = cumsum."""
    T = lam.shape[1]
    p = np.zeros_like(lam)
    remaining = np.ones(lam.shape[0])
    for t in range(T - 1):
        p[:, t] = lam[:, t] * remaining
        remaining = remaining * (1.0 - lam[:, t])
    p[:, T - 1] = remaining
    return p, np.cumsum(p, axis=1)


def nanbeige_logits(directory, tokens, loops: int) -> np.ndarray:
    """Plain pre-norm layers, the whole stack `loops` times; model.norm after every loop
    (skip_loop_final_norm false) or once at the end (true)."""
    c, w = _config(directory), read_checkpoint(directory)
    eps = c["rms_norm_eps"]
    tokens = np.asarray(tokens)
    positions = np.arange(len(tokens), dtype=np.float64)
    x = w["model.embed_tokens.weight"][tokens]
    for _ in range(loops):
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = x + _llama_attention(c, w, p, _rms(x, w[p + "input_layernorm.weight"], eps), positions)
            x = x + _llama_mlp(w, p, _rms(x, w[p + "post_attention_layernorm.weight"], eps))
        if not c["skip_loop_final_norm"]:
            x = _rms(x, w["model.norm.weight"], eps)
    if c["skip_loop_final_norm"]:
        x = _rms(x, w["model.norm.weight"], eps)
    return _head(c, w, x)

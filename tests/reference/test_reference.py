"""Checks of the float64 oracle itself (tests/reference/) on cases that can be worked out
by hand or follow from an identity of the model family."""

import dataclasses
import math

import numpy as np
import pytest

from reference import ReferenceModel, ops
from reference.noise import seeded_normal
from tinyloop.fileformat.random_model import make_random_model

BASE = dict(seed=7, vocab_size=64, d_model=32, n_head=4, n_kv_head=2, head_dim=8, ffn_dim=64,
            n_pre=1, n_core=1, n_post=1, default_depth=2, max_depth=4, max_seq_len=32)
TOKENS = [3, 17, 5, 60, 0, 33, 8, 41]


def build(model_dir, **overrides) -> ReferenceModel:
    kwargs = {**BASE, **overrides}
    name = "-".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "base"
    path = model_dir / f"{name}.tinyloop"
    if not path.exists():
        make_random_model(path, **kwargs)
    return ReferenceModel.from_file(path)


def with_changes(model: ReferenceModel, weights=None, **config_changes) -> ReferenceModel:
    return ReferenceModel(dataclasses.replace(model.config, **config_changes),
                          {**model.weights, **(weights or {})})


# ----------------------------------------------------------------------------- primitives

def test_rmsnorm_by_hand():
    x = np.array([[3.0, 4.0]])
    w = np.array([1.0, 2.0])
    rms = math.sqrt((9 + 16) / 2 + 1e-5)
    np.testing.assert_allclose(ops.rmsnorm(x, w, 1e-5), [[3 / rms, 8 / rms]], rtol=1e-15)
    # unit offset: the stored weight is the gain minus one
    np.testing.assert_allclose(ops.rmsnorm(x, w - 1, 1e-5, unit_offset=True), ops.rmsnorm(x, w, 1e-5))


def test_layernorm_by_hand():
    x = np.array([[1.0, 3.0]])    # mean 2, biased variance 1
    y = ops.layernorm(x, np.array([2.0, 3.0]), np.array([0.5, -0.5]), 1e-5)
    inv = 1 / math.sqrt(1 + 1e-5)
    np.testing.assert_allclose(y, [[-2 * inv + 0.5, 3 * inv - 0.5]], rtol=1e-15)


@pytest.mark.parametrize("style, partner", [("half", 2), ("interleaved", 1)])
def test_rope_pairs_by_hand(style, partner):
    # head_dim 4, all dims rotated: pair 0 turns by pos * 1, pair 1 by pos * theta^(-1/2)
    x = np.zeros((1, 1, 4))
    x[0, 0, 0] = 1.0
    y = ops.rope(x, np.array([3]), 4, 100.0, style)
    expected = np.zeros(4)
    expected[0], expected[partner] = math.cos(3), math.sin(3)
    np.testing.assert_allclose(y[0, 0], expected, atol=1e-15)
    # the second element of the pair goes (0, 1) -> (-sin, cos); pair 1 turns by 3 / 10
    x = np.zeros((1, 1, 4))
    x[0, 0, 3] = 1.0
    y = ops.rope(x, np.array([3]), 4, 100.0, style)
    first_of_pair = 1 if style == "half" else 2
    expected = np.zeros(4)
    expected[first_of_pair], expected[3] = -math.sin(0.3), math.cos(0.3)
    np.testing.assert_allclose(y[0, 0], expected, atol=1e-15)


def test_rope_partial_rotary_leaves_tail_and_position_zero_alone():
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    y = ops.rope(x, np.array([0, 5]), 4, 10000.0, "half")
    np.testing.assert_array_equal(y[0], x[0])                  # angle 0 at position 0
    np.testing.assert_array_equal(y[1, :, 4:], x[1, :, 4:])    # dims past rope_dims untouched
    assert not np.allclose(y[1, :, :4], x[1, :, :4])
    # a rotation keeps the length of each pair
    np.testing.assert_allclose(y[1, :, :2] ** 2 + y[1, :, 2:4] ** 2, x[1, :, :2] ** 2 + x[1, :, 2:4] ** 2)


def test_attention_causal_window_and_gqa_mapping():
    n, hd = 3, 2
    q = np.zeros((n, 4, hd))       # equal scores: outputs are plain means of visible values
    k = np.zeros((n, 2, hd))
    v = np.zeros((n, 2, hd))
    v[:, 0, :] = np.arange(n)[:, None] + 1.0          # kv head 0 holds 1, 2, 3 by position
    v[:, 1, :] = 10.0 * (np.arange(n)[:, None] + 1.0)  # kv head 1 holds 10, 20, 30
    pos = np.arange(n)
    out = ops.attention(q, k, v, pos, pos, 1.0).reshape(n, 4, hd)
    means = np.array([1.0, 1.5, 2.0])                  # causal running means
    for head, factor in enumerate([1, 1, 10, 10]):     # heads 0,1 -> kv 0; heads 2,3 -> kv 1
        np.testing.assert_allclose(out[:, head, 0], factor * means)
    windowed = ops.attention(q, k, v, pos, pos, 1.0, window=2).reshape(n, 4, hd)
    np.testing.assert_allclose(windowed[:, 0, 0], [1.0, 1.5, 2.5])  # last two positions only


def test_attention_softmax_weights_by_hand():
    q = np.array([[[1.0, 0.0]], [[0.0, 2.0]]])        # 2 positions, 1 head
    k = np.array([[[1.0, 1.0]], [[3.0, -1.0]]])
    v = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])
    out = ops.attention(q, k, v, np.arange(2), np.arange(2), 0.5)
    s0, s1 = 0.5 * 2.0, 0.5 * -2.0                     # position 1 scores against keys 0, 1
    p0 = math.exp(s0) / (math.exp(s0) + math.exp(s1))
    np.testing.assert_allclose(out, [[1.0, 0.0], [p0, 1 - p0]], rtol=1e-14)


def test_activations_by_hand():
    np.testing.assert_allclose(ops.silu(np.array([0.0, 1.0, -2.0])),
                               [0.0, 1 / (1 + math.exp(-1)), -2 / (1 + math.exp(2))], rtol=1e-15)
    c = math.sqrt(2 / math.pi) * (1 + 0.044715)
    np.testing.assert_allclose(ops.gelu_tanh(np.array([1.0])), [0.5 * (1 + math.tanh(c))], rtol=1e-15)


def _scalar_splitmix64(x: int) -> int:
    mask = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def _scalar_normal(seed: int, pos: int, j: int) -> float:
    mask = (1 << 64) - 1
    key = _scalar_splitmix64((_scalar_splitmix64(seed & mask) + pos) & mask)
    a = _scalar_splitmix64((key + 2 * j) & mask)
    b = _scalar_splitmix64((key + 2 * j + 1) & mask)
    u1 = ((a >> 11) + 1) * 2.0**-53
    u2 = (b >> 11) * 2.0**-53
    return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)


@pytest.mark.parametrize("seed, pos", [(0, 0), (1, 7), (-5, 3), (2**63 - 1, 1000), (123456789, 2**31)])
def test_seeded_normal_matches_scalar_integer_implementation(seed, pos):
    vec = seeded_normal(seed, pos, 40)
    scalar = [_scalar_normal(seed, pos, j) for j in range(40)]
    np.testing.assert_array_equal(vec, scalar)


def test_seeded_normal_known_value_and_statistics():
    # splitmix64 of 0 is the well-known first output of the SplitMix64 sequence seeded with 0
    assert _scalar_splitmix64(0) == 0xE220A8397B1DCDAF
    assert int(seeded_normal(0, 0, 1).size) == 1
    samples = np.concatenate([seeded_normal(3, p, 512) for p in range(16)])
    assert abs(samples.mean()) < 0.05 and abs(samples.std() - 1) < 0.05


# ----------------------------------------------------------------------------- whole model

def test_one_block_model_by_hand(model_dir):
    """One prelude block, one token: attention over a single key returns its value."""
    m = build(model_dir, n_pre=1, n_core=0, n_post=0, default_depth=0, max_depth=0, qkv_bias=1)
    w, eps, tok = m.weights, m.config.norm_eps, 11

    def rms(x, g):
        return x / math.sqrt(float(np.mean(x * x)) + eps) * g

    x = w["embed.weight"][tok]
    n1 = rms(x, w["pre.0.attn_norm.weight"])
    v = w["pre.0.attn.v.weight"] @ n1 + w["pre.0.attn.v.bias"]            # 2 kv heads of 8
    o = np.concatenate([v[0:8], v[0:8], v[8:16], v[8:16]])                 # 4 heads share 2
    x = x + w["pre.0.attn.o.weight"] @ o
    n2 = rms(x, w["pre.0.mlp_norm.weight"])
    gate = w["pre.0.mlp.gate.weight"] @ n2
    x = x + w["pre.0.mlp.down.weight"] @ (gate / (1 + np.exp(-gate)) * (w["pre.0.mlp.up.weight"] @ n2))
    logits = w["embed.weight"] @ rms(x, w["final_norm.weight"])
    np.testing.assert_allclose(m.logits([tok])[0], logits, rtol=1e-12, atol=1e-12)


def test_shared_core_without_injection_is_an_unrolled_plain_model(model_dir):
    """injection none + prelude init: L iterations of one core block = L identical layers."""
    looped = build(model_dir, injection="none", n_post=0)
    plain = with_changes(looped, n_pre=1 + 3, n_core=0, default_depth=0, max_depth=0, weights={
        name.replace("core.0.", f"pre.{i}."): value
        for i in (1, 2, 3) for name, value in looped.weights.items() if name.startswith("core.0.")})
    np.testing.assert_allclose(looped.logits(TOKENS, depth=3), plain.logits(TOKENS), rtol=1e-12, atol=1e-12)


def test_add_injection_equals_concat_with_identity_pair(model_dir):
    m = build(model_dir, injection="add")
    d = m.config.d_model
    concat = with_changes(m, injection="concat", weights={"inject.weight": np.hstack([np.eye(d), np.eye(d)])})
    np.testing.assert_allclose(m.logits(TOKENS, 3), concat.logits(TOKENS, 3), rtol=1e-11, atol=1e-11)


def test_gqa_equals_mha_with_repeated_kv_heads(model_dir):
    m = build(model_dir, n_head=4, n_kv_head=2)
    hd = m.config.head_dim
    repeated = {}
    for name, value in m.weights.items():
        if ".attn.k." in name or ".attn.v." in name:
            heads = value.reshape(2, hd, *value.shape[1:])
            repeated[name] = np.repeat(heads, 2, axis=0).reshape(4 * hd, *value.shape[1:])
    mha = with_changes(m, n_kv_head=4, weights=repeated)
    np.testing.assert_allclose(m.logits(TOKENS), mha.logits(TOKENS), rtol=1e-12, atol=1e-12)


def test_interleaved_rope_equals_half_rope_on_permuted_q_k_rows(model_dir):
    m = build(model_dir, rope_style="interleaved", qkv_bias=1)
    hd = m.config.head_dim
    # half-style dim i pairs with i + hd/2; interleaved pairs 2i with 2i+1
    order = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    permuted = {}
    for name, value in m.weights.items():
        if ".attn.q." in name or ".attn.k." in name:
            heads = value.reshape(-1, hd, *value.shape[1:])
            permuted[name] = heads[:, order].reshape(value.shape)
    half = with_changes(m, rope_style="half", weights=permuted)
    np.testing.assert_allclose(m.logits(TOKENS), half.logits(TOKENS), rtol=1e-11, atol=1e-11)


def test_tied_head_equals_untied_head_holding_the_embedding(model_dir):
    m = build(model_dir)
    untied = with_changes(m, tied_embeddings=0, weights={"output.weight": m.weights["embed.weight"]})
    np.testing.assert_array_equal(m.logits(TOKENS), untied.logits(TOKENS))


def test_embed_scale_scales_only_the_input(model_dir):
    m = build(model_dir, tied_embeddings=0, embed_scale=2.5)
    assert m.config.embed_scale == 2.5
    scaled_table = with_changes(m, embed_scale=1.0, weights={"embed.weight": 2.5 * m.weights["embed.weight"]})
    np.testing.assert_allclose(m.logits(TOKENS), scaled_table.logits(TOKENS), rtol=1e-12, atol=1e-12)


def test_zero_sigma_noise_equals_zeros_init(model_dir):
    m = build(model_dir, state_init="noise", noise_sigma=0.0)
    zeros = with_changes(m, state_init="zeros")
    np.testing.assert_array_equal(m.logits(TOKENS), zeros.logits(TOKENS))
    noisy = with_changes(m, noise_sigma=1.0)
    assert not np.allclose(noisy.logits(TOKENS), zeros.logits(TOKENS))


def test_warm_state_starts_like_prelude_and_carries_over(model_dir):
    warm = build(model_dir, state_init="warm")
    prelude = with_changes(warm, state_init="prelude")
    np.testing.assert_allclose(warm.logits(TOKENS)[0], prelude.logits(TOKENS)[0], rtol=1e-12)
    assert not np.allclose(warm.logits(TOKENS)[1:], prelude.logits(TOKENS)[1:])
    # position 1 at depth 2 starts from position 0's state after 2 iterations
    states = warm.final_states(TOKENS[:2], depth=2)
    assert not np.allclose(states[0], states[1])


def test_wide_sliding_window_equals_full_attention(model_dir):
    m = build(model_dir, sliding_window=len(TOKENS))
    full = with_changes(m, sliding_window=0)
    np.testing.assert_array_equal(m.logits(TOKENS), full.logits(TOKENS))
    narrow = with_changes(m, sliding_window=2)
    np.testing.assert_array_equal(narrow.logits(TOKENS)[:2], full.logits(TOKENS)[:2])
    assert not np.allclose(narrow.logits(TOKENS)[2:], full.logits(TOKENS)[2:])


@pytest.mark.parametrize("state_init", ["prelude", "noise", "warm"])
def test_positions_never_see_later_tokens(model_dir, state_init):
    m = build(model_dir, state_init=state_init)
    changed = list(TOKENS)
    changed[5] = (changed[5] + 1) % m.config.vocab_size
    a, b = m.logits(TOKENS), m.logits(changed)
    np.testing.assert_array_equal(a[:5], b[:5])
    assert not np.allclose(a[5:], b[5:])


def test_logprobs_pick_the_next_token_from_log_softmax(model_dir):
    m = build(model_dir)
    lp = m.logprobs(TOKENS, depth=3)
    logits = m.logits(TOKENS, depth=3)
    assert lp.shape == (len(TOKENS) - 1,)
    for i in range(len(TOKENS) - 1):
        expected = logits[i, TOKENS[i + 1]] - np.log(np.sum(np.exp(logits[i])))
        assert lp[i] == pytest.approx(expected, rel=1e-12)


def test_depth_zero_is_default_and_depth_is_bounded(model_dir):
    m = build(model_dir)
    np.testing.assert_array_equal(m.logits(TOKENS, 0), m.logits(TOKENS, BASE["default_depth"]))
    assert not np.allclose(m.logits(TOKENS, 1), m.logits(TOKENS, 4))
    with pytest.raises(ValueError, match="depth"):
        m.logits(TOKENS, BASE["max_depth"] + 1)
    with pytest.raises(ValueError, match="token"):
        m.logits([BASE["vocab_size"]])


def test_metadata_defaults_apply_when_keys_are_absent(model_dir):
    cfg = build(model_dir).config
    assert (cfg.norm_placement, cfg.norm_type, cfg.rope_style, cfg.activation) == ("pre", "rmsnorm", "half", "silu")
    assert (cfg.injection, cfg.state_init, cfg.tied_embeddings, cfg.loop_norm) == ("add", "prelude", 1, 0)
    assert cfg.rope_dims == cfg.head_dim and cfg.attn_scale == cfg.head_dim ** -0.5
    assert cfg.norm_eps == 1e-5 and cfg.rope_theta == 10000.0

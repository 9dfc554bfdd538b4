"""Huginn (model_type huginn_raven, e.g. tomg-group-umd/huginn-0125) -> .tinyloop.

The recurrent-depth model of raven_modeling_minimal.py: a prelude of sandwich blocks, a
core block run mean_recurrence times on adapter([s ; e]), a coda, ln_f applied after the
loop and again before the head. The mapping (docs/convert.md, "Huginn"):

    transformer.wte                  -> embed (x sqrt(n_embd): arch.embed_scale)
    transformer.{prelude,core_block,coda}.N -> {pre,core,post}.N
        norm_1 / norm_2 / norm_3 / norm_4    -> attn_norm / attn_post_norm / mlp_norm / mlp_post_norm
        attn.Wqkv rows [q | k | v]           -> attn.q / attn.k / attn.v
        attn.qk_bias [2, 1, h, hd]           -> attn.q.bias / attn.k.bias (attn.v.bias = 0)
        attn.proj                            -> attn.o
        mlp.fc rows [gate | up], mlp.proj    -> mlp.gate / mlp.up, mlp.down
    transformer.adapter (.bias)      -> inject (concat, [s ; e])
    transformer.ln_f                 -> post_loop_norm and final_norm (the same weights)
    lm_head                          -> output (untied) or nothing (tie_embeddings)
    freqs_cis                        -> checked against rope_base, not stored (RoPE is computed)
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import FormatError
from ..fileformat.tinyloop_file import TinyLoopWriter
from .hf_checkpoint import (Checkpoint, ImportOptions, TensorEmitter, emit_head, open_checkpoint,
                            provenance, write_model)

CONVERTER = "tinyloop.convert.from_huginn 1"
FAMILY = "huginn"
MODEL_TYPE = "huginn_raven"
STATE_INITS = ("zeros", "noise")
# trunc_normal_(std, a=-3 std, b=3 std) in initialize_state
NOISE_TRUNCATION = 3.0

_USED = ("n_embd", "n_heads", "num_attention_heads", "num_key_value_heads", "head_dim",
         "n_layers", "n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda",
         "intermediate_size", "vocab_size", "padded_vocab_size", "block_size", "rope_base",
         "norm_eps", "qk_bias", "bias", "tie_embeddings", "tie_word_embeddings", "mean_recurrence",
         "init_values", "effective_expected_depth")
# training and initialisation settings, and ones raven_modeling_minimal.py does not read
_HARMLESS = ("mean_backprop_depth", "sampling_scheme", "init_strategy", "init_orthogonal",
             "state_init", "padding_multiple", "hf_config", "activation_checkpoint_impl",
             "recurrent_iteration_method", "lockstep_n", "lockstep_k", "test_time_noise_type",
             "max_position_embeddings")
_NEUTRAL = {
    "injection_type": (lambda v: v == "linear", "only the linear adapter on [s ; e] is implemented"),
    "test_time_noise": (lambda v: v == 0, "noise added at every step cannot be reproduced"),
    "architecture_class_name": (lambda v: v == "RecurrentGPT", "only RecurrentGPT"),
    "block_class_name": (lambda v: v == "SandwichBlock", "only SandwichBlock"),
    "norm_class_name": (lambda v: v in ("RMSNorm_llama", "RMSNorm"), "only RMSNorm"),
    "mlp_class_name": (lambda v: v == "GatedMLP", "only GatedMLP"),
    "nonlin_name": (lambda v: v == "SiLU", "only SiLU"),
    "rope_scaling": (lambda v: v is None, "RoPE scaling is not implemented"),
}


def _block(emit: TensorEmitter, ckpt: Checkpoint, theirs: str, ours: str, d: int, f: int,
           qk_bias: tuple | None) -> None:
    """One SandwichBlock; qk_bias: (heads, head_dim) when the attention has the bias."""
    for k, name in ((1, "attn_norm"), (2, "attn_post_norm"), (3, "mlp_norm"), (4, "mlp_post_norm")):
        emit.vector(f"{ours}{name}.weight", ckpt.tensor(f"{theirs}norm_{k}.weight", (d,)))
    qkv = ckpt.tensor(f"{theirs}attn.Wqkv.weight", (3 * d, d))
    for i, proj in enumerate("qkv"):
        emit.matrix(f"{ours}attn.{proj}.weight", qkv.rows(i * d, (i + 1) * d))
    if qk_bias:
        bias = ckpt.tensor(f"{theirs}attn.qk_bias", (2, 1) + qk_bias).reshaped(2, d)
        emit.vector(f"{ours}attn.q.bias", bias.rows(0, 1).reshaped(d))
        emit.vector(f"{ours}attn.k.bias", bias.rows(1, 2).reshaped(d))
        emit.values(f"{ours}attn.v.bias", np.zeros(d))
    emit.matrix(f"{ours}attn.o.weight", ckpt.tensor(f"{theirs}attn.proj.weight", (d, d)))
    fc = ckpt.tensor(f"{theirs}mlp.fc.weight", (2 * f, d))
    emit.matrix(f"{ours}mlp.gate.weight", fc.rows(0, f))
    emit.matrix(f"{ours}mlp.up.weight", fc.rows(f, 2 * f))
    emit.matrix(f"{ours}mlp.down.weight", ckpt.tensor(f"{theirs}mlp.proj.weight", (d, f)))


def _check_rope_table(ckpt: Checkpoint, head_dim: int, theta: float) -> None:
    """freqs_cis [1, block_size, 1, hd/2, 2] holds (cos, sin) of pos * theta^(-2i/hd): the
    table the reference reads; TinyLoop computes the same angles, so the stored one must be
    them (to the rounding of its dtype and of float32 angles at large positions)."""
    if "freqs_cis" not in ckpt.tensors:
        return
    t = ckpt.tensor("freqs_cis")
    if len(t.shape) != 5 or t.shape[2:] != (1, head_dim // 2, 2):
        raise FormatError(f"{t.path}: tensor 'freqs_cis' has shape {list(t.shape)}, expected "
                          f"[1, block_size, 1, {head_dim // 2}, 2]")
    table = t.values().reshape(t.shape[1], head_dim // 2, 2)
    positions = np.arange(min(t.shape[1], 256))
    angle = positions[:, None] * theta ** (-np.arange(0, head_dim, 2) / head_dim)[None, :]
    err = max(np.abs(table[positions, :, 0] - np.cos(angle)).max(),
              np.abs(table[positions, :, 1] - np.sin(angle)).max())
    if err > (1e-2 if t.dtype != "f32" else 1e-4):
        raise FormatError(f"{t.path}: freqs_cis differs from the RoPE table of rope_base {theta} by "
                          f"{err:.3g}; the checkpoint's rotary table is not the one its config describes")


def convert_huginn(src, dst, options: ImportOptions | None = None, *, state_init: str = "zeros",
                   noise_seed: int = 0) -> dict:
    """Convert a Huginn checkpoint directory. state_init: `zeros` (default: the one
    reproducible state, the reference with init_scale=0) or `noise` (the reference's
    truncated normal, drawn from TinyLoop's seeded counters, so not its torch draws)."""
    options = options or ImportOptions()
    if state_init not in STATE_INITS:
        raise ValueError(f"state_init must be one of {STATE_INITS}, got {state_init!r}")
    ckpt = open_checkpoint(src, MODEL_TYPE, "Huginn", _USED, _HARMLESS, _NEUTRAL, options)

    d = ckpt.require("n_embd")
    heads = ckpt.require("n_heads") if ckpt.has("n_heads") else ckpt.require("num_attention_heads")
    for key in ("n_heads", "num_attention_heads", "num_key_value_heads"):
        if ckpt.has(key) and ckpt.require(key) != heads:
            ckpt.refuse(key, f"the attention has {heads} heads and no grouped-query path, so it must be {heads}")
    if d % heads:
        ckpt.refuse("n_embd", f"not a multiple of the {heads} heads")
    head_dim = d // heads
    if ckpt.has("head_dim") and ckpt.require("head_dim") != head_dim:
        ckpt.refuse("head_dim", f"the attention uses n_embd // n_heads = {head_dim}")
    n_pre, n_core, n_post = (ckpt.require(k) for k in ("n_layers_in_prelude", "n_layers_in_recurrent_block",
                                                        "n_layers_in_coda"))
    if ckpt.has("n_layers") and ckpt.require("n_layers") != n_pre + n_core + n_post:
        ckpt.refuse("n_layers", f"expected prelude + core + coda = {n_pre + n_core + n_post}")
    if n_core < 1:
        ckpt.refuse("n_layers_in_recurrent_block", "a recurrent block needs at least one layer")
    f = ckpt.require("intermediate_size")
    mean_recurrence = ckpt.require("mean_recurrence")
    if mean_recurrence < 1:
        ckpt.refuse("mean_recurrence", "the default depth must be at least 1")
    theta = ckpt.require("rope_base", float)
    eps = ckpt.require("norm_eps", float)
    qk_bias = ckpt.require("qk_bias", bool)
    adapter_bias = ckpt.require("bias", bool)
    tied = ckpt.require("tie_embeddings", bool)
    if ckpt.has("tie_word_embeddings") and ckpt.require("tie_word_embeddings", bool) != tied:
        ckpt.refuse("tie_word_embeddings", f"disagrees with tie_embeddings = {tied}, which the model reads")
    block_size = ckpt.require("block_size")
    embed_scale = math.sqrt(d)
    std = math.sqrt(2.0 / (5.0 * d))
    stored = ckpt.get("init_values", {}, dict)
    for key, want in (("embed_scale", embed_scale), ("std", std)):
        if key in stored and not math.isclose(float(stored[key]), want, rel_tol=1e-6):
            ckpt.refuse("init_values", f"{key} {stored[key]} is not the {want:.9g} of n_embd {d}")

    wte = ckpt.tensor("transformer.wte.weight")
    vocab = wte.shape[0]
    if wte.shape != (vocab, d):
        raise FormatError(f"{wte.path}: tensor 'transformer.wte.weight' has shape {list(wte.shape)}, "
                          f"expected [padded_vocab_size, {d}]")
    if ckpt.has("padded_vocab_size") and ckpt.require("padded_vocab_size") != vocab:
        ckpt.refuse("padded_vocab_size", f"the embedding has {vocab} rows")
    if ckpt.require("vocab_size") > vocab:
        ckpt.refuse("vocab_size", f"larger than the embedding's {vocab} rows")
    _check_rope_table(ckpt, head_dim, theta)

    default_depth, max_depth = options.depths(mean_recurrence)
    writer = TinyLoopWriter({
        "vocab_size": vocab, "d_model": d, "n_head": heads, "n_kv_head": heads, "head_dim": head_dim,
        "ffn_dim": f, "n_pre": n_pre, "n_core": n_core, "n_post": n_post,
        "default_depth": default_depth, "max_depth": max_depth,
        "max_seq_len": options.seq_len(block_size),
    })
    meta = [("arch.norm_placement", "sandwich_outer"), ("arch.norm_type", "rmsnorm"),
            ("arch.norm_eps", eps), ("arch.rope_style", "interleaved"), ("arch.rope_theta", theta),
            ("arch.activation", "silu"), ("arch.qkv_bias", int(qk_bias)), ("arch.embed_scale", embed_scale),
            ("arch.tied_embeddings", int(tied)), ("arch.final_norm", 1),
            ("loop.injection", "concat"), ("loop.injection_bias", int(adapter_bias)),
            ("loop.state_init", state_init), ("loop.post_norm", 1), ("loop.norm", 0)]
    if state_init == "noise":
        # initialize_state: trunc_normal_(std, +-3 std) times embed_scale
        meta += [("loop.noise_sigma", std * embed_scale), ("loop.noise_truncation", NOISE_TRUNCATION),
                 ("loop.noise_seed", int(noise_seed))]
    for key, value in meta:
        writer.add_metadata(key, value)
    provenance(writer, ckpt, FAMILY, CONVERTER, f"config.json mean_recurrence = {mean_recurrence}")

    emit = TensorEmitter(writer, options.dtype, options.group_size, options.method, options.embed_dtype)
    emit.matrix("embed.weight", wte, embedding=True)
    for theirs, ours, count in (("prelude", "pre", n_pre), ("core_block", "core", n_core), ("coda", "post", n_post)):
        for i in range(count):
            _block(emit, ckpt, f"transformer.{theirs}.{i}.", f"{ours}.{i}.", d, f,
                   (heads, head_dim) if qk_bias else None)
    emit.matrix("inject.weight", ckpt.tensor("transformer.adapter.weight", (d, 2 * d)))
    if adapter_bias:
        emit.vector("inject.bias", ckpt.tensor("transformer.adapter.bias", (d,)))
    ln_f = ckpt.tensor("transformer.ln_f.weight", (d,))
    emit.vector("post_loop_norm.weight", ln_f)   # iterate_forward's ln_f, before the coda
    emit.vector("final_norm.weight", ln_f)       # and the same norm before the head
    emit_head(emit, ckpt, tied, vocab, d)
    ckpt.check_all_claimed("Huginn")
    summary = write_model(writer, dst, options.show_progress, emit)
    return {"family": FAMILY, "default_depth": default_depth, "max_depth": max_depth,
            "state_init": state_init, **summary}

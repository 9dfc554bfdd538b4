"""Ouro (model_type ouro: ByteDance Ouro-1.4B / 2.6B and their -Thinking variants) -> .tinyloop.

Every decoder layer is the loop body (n_pre = n_post = 0), run total_ut_steps times with
shared weights, the embedding as the loop input and no injection. Each step ends with
model.norm, whose output the next step reads and the head reads after the last one (no
other final norm). The early-exit gate reads each step's normed state. The mapping
(docs/convert.md, "Ouro"):

    model.embed_tokens                       -> embed
    model.layers.N.input_layernorm           -> core.N.attn_norm       (N1)
    model.layers.N.input_layernorm_2         -> core.N.attn_post_norm  (N2, on the attention output)
    model.layers.N.post_attention_layernorm  -> core.N.mlp_norm        (N3, before the MLP)
    model.layers.N.post_attention_layernorm_2 -> core.N.mlp_post_norm  (N4, on the MLP output)
    model.layers.N.self_attn.{q,k,v,o}_proj  -> core.N.attn.{q,k,v,o}
    model.layers.N.mlp.{gate,up,down}_proj   -> core.N.mlp.{gate,up,down}
    model.norm                               -> loop_norm (loop.norm 1, arch.final_norm 0)
    model.early_exit_gate (.bias)            -> exit_gate (loop.exit_gate 1)
    lm_head                                  -> output (absent: tied)
"""

from __future__ import annotations

from .hf_checkpoint import (ImportOptions, TensorEmitter, emit_head, llama_dims, llama_layer_matrices,
                            open_checkpoint, provenance, skip_rotary_buffers, whole_stack_writer, write_model)
from .progress import note

CONVERTER = "tinyloop.convert.from_ouro 1"
FAMILY = "ouro"
MODEL_TYPE = "ouro"

_USED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
         "max_position_embeddings", "total_ut_steps", "early_exit_threshold")
# the window settings act only with use_sliding_window (checked below)
_HARMLESS = ("sliding_window", "max_window_layers")
_NEUTRAL = {
    "hidden_act": (lambda v: v == "silu", "the MLP is SwiGLU"),
    "use_sliding_window": (lambda v: v is False, "sliding-window attention per layer is not implemented"),
    "rope_scaling": (lambda v: v is None, "RoPE scaling is not implemented"),
    "layer_types": (lambda v: isinstance(v, list) and all(t == "full_attention" for t in v),
                    "only full attention in every layer"),
    "early_exit_step": (lambda v: v is None, "a fixed exit step reads an earlier step's state while "
                                             "later positions attend to all steps' K/V"),
    "use_weighted_exit": (lambda v: not v, "the p-weighted mixture of every step's logits is not implemented"),
    "attention_bias": (lambda v: v is False, "the attention projections have no biases"),
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "input_layernorm_2.weight": "attn_post_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "post_attention_layernorm_2.weight": "mlp_post_norm.weight",
}


def convert_ouro(src, dst, options: ImportOptions | None = None) -> dict:
    options = options or ImportOptions()
    ckpt = open_checkpoint(src, MODEL_TYPE, "Ouro", _USED, _HARMLESS, _NEUTRAL, options)
    dims = llama_dims(ckpt)
    d, layers = dims["d_model"], ckpt.require("num_hidden_layers")
    steps = ckpt.require("total_ut_steps")
    if steps < 1:
        ckpt.refuse("total_ut_steps", "the loop must run at least once")
    threshold = ckpt.get("early_exit_threshold", 1.0, float)
    writer, tied = whole_stack_writer(ckpt, dims, options, steps, "sandwich_branch", [
        ("arch.final_norm", 0), ("loop.norm", 1), ("loop.exit_gate", 1),
        ("loop.exit_rule", "cdf_threshold"), ("loop.exit_threshold", threshold)])
    default_depth, max_depth = dims["default_depth"], dims["max_depth"]
    provenance(writer, ckpt, FAMILY, CONVERTER, f"config.json total_ut_steps = {steps}")
    if threshold < 1.0:
        note(f"{ckpt.config_path}: early_exit_threshold {threshold} is recorded (loop.exit_threshold); "
             f"TinyLoop runs every token to depth {default_depth} and reads the last step, so tokens "
             f"the checkpoint's rule would exit early get other logits than its reference")

    emit = TensorEmitter(writer, options.dtype, options.group_size, options.method, options.embed_dtype)
    emit.matrix("embed.weight", ckpt.tensor("model.embed_tokens.weight", (dims["vocab_size"], d)), embedding=True)
    for i in range(layers):
        theirs, ours = f"model.layers.{i}.", f"core.{i}."
        for name, mapped in _LAYER.items():
            emit.vector(ours + mapped, ckpt.tensor(theirs + name, (d,)))
        llama_layer_matrices(emit, ckpt, theirs, ours, dims)
    emit.vector("loop_norm.weight", ckpt.tensor("model.norm.weight", (d,)))
    emit.vector("exit_gate.weight", ckpt.tensor("model.early_exit_gate.weight", (1, d)))
    emit.vector("exit_gate.bias", ckpt.tensor("model.early_exit_gate.bias", (1,)))
    emit_head(emit, ckpt, tied, dims["vocab_size"], d)
    skip_rotary_buffers(ckpt)
    ckpt.check_all_claimed("Ouro")
    summary = write_model(writer, dst, options.show_progress, emit)
    return {"family": FAMILY, "default_depth": default_depth, "max_depth": max_depth,
            "exit_rule": "cdf_threshold", "exit_threshold": threshold, **summary}

"""Nanbeige4.2 looped (model_type nanbeige, e.g. Nanbeige/Nanbeige4.2-3B) -> .tinyloop.

Plain Llama pre-norm layers (head_dim from the config, GQA), the whole stack run as the loop
body with shared weights, no injection. The loop count is NanbeigeModel._get_num_loops():
len(loop_loss_weights) + 1 when that list is non-empty, else num_loops. With
skip_loop_final_norm false (the release) model.norm follows every loop, the last included,
and nothing follows it; with true it runs once at the end. The mapping (docs/convert.md,
"Nanbeige"):

    model.embed_tokens                      -> embed
    model.layers.N.input_layernorm          -> core.N.attn_norm
    model.layers.N.post_attention_layernorm -> core.N.mlp_norm
    model.layers.N.self_attn.{q,k,v,o}_proj -> core.N.attn.{q,k,v,o}
    model.layers.N.mlp.{gate,up,down}_proj  -> core.N.mlp.{gate,up,down}
    model.norm                              -> loop_norm (arch.final_norm 0), or final_norm
                                               with skip_loop_final_norm
    lm_head                                 -> output (absent: tied)
"""

from __future__ import annotations

from .hf_checkpoint import (Checkpoint, ImportOptions, TensorEmitter, emit_head, llama_dims,
                            llama_layer_matrices, open_checkpoint, provenance, skip_rotary_buffers,
                            whole_stack_writer, write_model)

CONVERTER = "tinyloop.convert.from_nanbeige 1"
FAMILY = "nanbeige"
MODEL_TYPE = "nanbeige"

_USED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
         "max_position_embeddings", "num_loops", "loop_loss_weights", "skip_loop_final_norm")
# pretraining_tp only splits the matmuls; the n-gram sizes and the window act only with the
# feature they size, which the neutral checks keep off
_HARMLESS = ("pretraining_tp", "emb_split_num", "ngram_vocab_size_ratio", "sliding_window",
             "max_window_layers")
_OFF = (lambda v: not v)
_NEUTRAL = {
    "hidden_act": (lambda v: v == "silu", "the MLP is SwiGLU"),
    "attention_bias": (_OFF, "attention biases (o_proj's too) are not implemented"),
    "mlp_bias": (_OFF, "MLP biases are not implemented"),
    "rope_scaling": (lambda v: v is None, "RoPE scaling (linear / dynamic) is not implemented"),
    "qk_layernorm": (_OFF, "norms on q and k are not implemented"),
    "emb_neighbor_num": (lambda v: v is None, "n-gram embeddings are not implemented"),
    "insert_ngram_layer_idx": (_OFF, "n-gram embeddings are not implemented"),
    "ngram_insert_all_layers": (_OFF, "n-gram embeddings are not implemented"),
    "enable_double_loop_split": (_OFF, "LoopSplit runs the layers in another order"),
    "loop_middle_layers": (_OFF, "looping only the middle layers is not implemented"),
    "loop_share_kv": (_OFF, "loops sharing one K/V slot per layer are not implemented exactly "
                            "(kv_policy share_last is the approximate runtime policy)"),
    "enable_hyper_connection": (_OFF, "hyper-connections are not implemented"),
    "enable_mhc": (_OFF, "mHC is not implemented"),
    "enable_h_res_identity": (_OFF, "hyper-connections are not implemented"),
    "enable_depth_attention": (_OFF, "depth attention is not implemented"),
    "use_sliding_window": (_OFF, "sliding-window attention is not implemented"),
    "layer_types": (lambda v: isinstance(v, list) and all(t == "full_attention" for t in v),
                    "only full attention in every layer"),
}


def loop_count(ckpt: Checkpoint) -> tuple[int, str]:
    """(loops, where the number came from), as _get_num_loops() decides it."""
    weights = ckpt.get("loop_loss_weights", [], list)
    if weights:
        return len(weights) + 1, f"config.json len(loop_loss_weights) + 1 = {len(weights) + 1}"
    loops = ckpt.require("num_loops")
    if loops < 1:
        ckpt.refuse("num_loops", "the stack must run at least once")
    return loops, f"config.json num_loops = {loops}"


def convert_nanbeige(src, dst, options: ImportOptions | None = None) -> dict:
    options = options or ImportOptions()
    ckpt = open_checkpoint(src, MODEL_TYPE, "Nanbeige", _USED, _HARMLESS, _NEUTRAL, options)
    dims = llama_dims(ckpt)
    d, layers = dims["d_model"], ckpt.require("num_hidden_layers")
    loops, depth_from = loop_count(ckpt)
    norm_each_loop = not ckpt.get("skip_loop_final_norm", False, bool)
    writer, tied = whole_stack_writer(ckpt, dims, options, loops, "pre", [
        ("arch.final_norm", int(not norm_each_loop)), ("loop.norm", int(norm_each_loop))])
    default_depth, max_depth = dims["default_depth"], dims["max_depth"]
    provenance(writer, ckpt, FAMILY, CONVERTER, depth_from)

    emit = TensorEmitter(writer, options.dtype, options.group_size, options.method, options.embed_dtype)
    emit.matrix("embed.weight", ckpt.tensor("model.embed_tokens.weight", (dims["vocab_size"], d)), embedding=True)
    for i in range(layers):
        theirs, ours = f"model.layers.{i}.", f"core.{i}."
        emit.vector(ours + "attn_norm.weight", ckpt.tensor(theirs + "input_layernorm.weight", (d,)))
        emit.vector(ours + "mlp_norm.weight", ckpt.tensor(theirs + "post_attention_layernorm.weight", (d,)))
        llama_layer_matrices(emit, ckpt, theirs, ours, dims)
    norm = ckpt.tensor("model.norm.weight", (d,))
    emit.vector("loop_norm.weight" if norm_each_loop else "final_norm.weight", norm)
    emit_head(emit, ckpt, tied, dims["vocab_size"], d)
    skip_rotary_buffers(ckpt)
    ckpt.check_all_claimed("Nanbeige")
    summary = write_model(writer, dst, options.show_progress, emit)
    return {"family": FAMILY, "default_depth": default_depth, "max_depth": max_depth,
            "norm_each_loop": norm_each_loop, **summary}

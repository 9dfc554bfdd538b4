"""Hugging Face Llama-family checkpoint directory -> .tinyloop.

Reads config.json, every *.safetensors file (numpy backend of the `safetensors` package) and
tokenizer.json (+ tokenizer_config.json for add_bos). HF stores Q/K for half-split (NeoX)
RoPE, so the file says `arch.rope_style = half`. Tensors keep their dtype (f32/f16/bf16) or
are cast on request; the model is a plain Llama (`n_pre = layers`, `n_core = 0`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..errors import FormatError
from ..fileformat.tinyloop_file import TinyLoopWriter
from .progress import Progress

CONVERTER = "tinyloop.convert.from_safetensors 1"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_SOURCE_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "final_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.o_proj.weight": "attn.o.weight",
    "self_attn.q_proj.bias": "attn.q.bias",
    "self_attn.k_proj.bias": "attn.k.bias",
    "self_attn.v_proj.bias": "attn.v.bias",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}


def map_tensor_name(hf_name: str, n_layers: int) -> str | None:
    """HF name -> .tinyloop name; None for buffers that carry no weights (rotary caches)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        layer, rest = int(parts[2]), parts[3]
        if rest.endswith("rotary_emb.inv_freq"):
            return None
        if rest in _LAYER_NAMES and layer < n_layers:
            return f"pre.{layer}.{_LAYER_NAMES[rest]}"
    raise FormatError(f"tensor {hf_name!r} has no place in a Llama model with {n_layers} layers")


class _SafetensorsSource:
    """Name -> (dtype, shape, loader) over all *.safetensors files of a directory."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FormatError(f"{directory}: no *.safetensors files")
        self.entries = {}
        for path in files:
            with safe_open(str(path), framework="np") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    if name in self.entries:
                        raise FormatError(f"{directory}: tensor {name!r} appears in two files")
                    self.entries[name] = (path, sl.get_dtype(), tuple(sl.get_shape()))

    def dtype(self, name: str) -> str:
        src = self.entries[name][1]
        if src not in _SOURCE_DTYPES:
            raise FormatError(f"tensor {name!r}: safetensors dtype {src} is not supported "
                              f"(expected one of {sorted(_SOURCE_DTYPES)})")
        return _SOURCE_DTYPES[src]

    def shape(self, name: str) -> tuple:
        return self.entries[name][2]

    def array(self, name: str) -> np.ndarray:
        """f32/f16 as numpy arrays; bf16 as float32 (exact: bf16 is float32's top half)."""
        path, src, shape = self.entries[name]
        if src == "BF16":
            return (self.bf16_bits(name).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        from safetensors import safe_open

        with safe_open(str(path), framework="np") as f:
            return f.get_tensor(name)

    def bf16_bits(self, name: str) -> np.ndarray:
        """Raw bf16 tensor bits. numpy has no bfloat16, so the safetensors numpy backend
        cannot return them; we read the bytes at the offsets the file header gives."""
        path, _, shape = self.entries[name]
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            start, end = header[name]["data_offsets"]
            f.seek(8 + header_len + start)
            data = f.read(end - start)
        return np.frombuffer(data, dtype="<u2").reshape(shape)


def _read_json(path: Path, required: bool) -> dict:
    if not path.exists():
        if required:
            raise FormatError(f"{path} is missing")
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _first_id(value) -> int:
    if isinstance(value, list):
        return int(value[0]) if value else -1
    return -1 if value is None else int(value)


def _add_bos(tokenizer_config: dict, tokenizer_json: dict, bos_token: str | None) -> bool:
    """tokenizer_config's add_bos_token wins; else whether the post-processor adds BOS."""
    if "add_bos_token" in tokenizer_config:
        return bool(tokenizer_config["add_bos_token"])
    post = tokenizer_json.get("post_processor") or {}
    single = post.get("single") if post.get("type") == "TemplateProcessing" else None
    if single and bos_token and "SpecialToken" in single[0]:
        return single[0]["SpecialToken"]["id"] == bos_token
    return False


def convert_safetensors(src, dst, *, dtype: str = "keep", show_progress: bool = True) -> dict:
    """Convert the HF checkpoint directory `src` into `dst`. `dtype`: keep | f32 | f16 | bf16."""
    if dtype not in ("keep", "f32", "f16", "bf16"):
        raise ValueError(f"dtype must be keep, f32, f16 or bf16, got {dtype!r}")
    directory = Path(src)
    cfg = _read_json(directory / "config.json", required=True)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise FormatError(f"{directory}/config.json: model_type {model_type!r} is not supported "
                          f"(expected one of {SUPPORTED_MODEL_TYPES})")
    if cfg.get("rope_scaling"):
        raise FormatError(f"{directory}/config.json: rope_scaling {cfg['rope_scaling']!r} is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise FormatError(f"{directory}/config.json: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")

    n_layers = int(cfg["num_hidden_layers"])
    d, n_head = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or d // n_head)
    source = _SafetensorsSource(directory)
    has_head = "lm_head.weight" in source.entries
    tied = bool(cfg.get("tie_word_embeddings", not has_head)) or not has_head
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in source.entries

    writer = TinyLoopWriter({
        "vocab_size": int(cfg["vocab_size"]), "d_model": d, "n_head": n_head,
        "n_kv_head": int(cfg.get("num_key_value_heads") or n_head), "head_dim": head_dim,
        "ffn_dim": int(cfg["intermediate_size"]), "n_pre": n_layers, "n_core": 0, "n_post": 0,
        "default_depth": 0, "max_depth": 0,
        "max_seq_len": int(cfg.get("max_position_embeddings", 2048)),
    })
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
    for key, value in [
        ("arch.norm_placement", "pre"), ("arch.norm_type", "rmsnorm"),
        ("arch.norm_eps", float(cfg.get("rms_norm_eps", 1e-5))), ("arch.rope_style", "half"),
        ("arch.rope_theta", float(cfg.get("rope_theta", 10000.0))), ("arch.activation", "silu"),
        ("arch.qkv_bias", int(qkv_bias)), ("arch.sliding_window", int(window or 0)),
        ("arch.tied_embeddings", int(tied)), ("loop.injection", "none"),
    ]:
        writer.add_metadata(key, value)

    tok_path = directory / "tokenizer.json"
    if tok_path.exists():
        tok_text = tok_path.read_text(encoding="utf-8")
        tok_cfg = _read_json(directory / "tokenizer_config.json", required=False)
        bos = _first_id(cfg.get("bos_token_id"))
        bos_token = tok_cfg.get("bos_token")
        if isinstance(bos_token, dict):
            bos_token = bos_token.get("content")
        writer.add_metadata("tokenizer.json", tok_text)
        writer.add_metadata("tokenizer.bos_id", bos)
        writer.add_metadata("tokenizer.eos_id", _first_id(cfg.get("eos_token_id")))
        writer.add_metadata("tokenizer.add_bos", int(bos >= 0 and _add_bos(tok_cfg, json.loads(tok_text), bos_token)))
        if isinstance(tok_cfg.get("chat_template"), str):
            writer.add_metadata("tokenizer.chat_template", tok_cfg["chat_template"])
    writer.add_metadata("general.name", str(cfg.get("_name_or_path") or directory.name))
    writer.add_metadata("general.source", f"safetensors:{directory.name}")
    writer.add_metadata("general.converter", CONVERTER)

    for name in sorted(source.entries):
        ours = map_tensor_name(name, n_layers)
        if ours is None or (ours == "output.weight" and tied):
            continue  # a tied head is the embedding; its saved copy is redundant
        src_dtype = source.dtype(name)
        out_dtype = src_dtype if dtype == "keep" else dtype
        if src_dtype == "bf16" and out_dtype == "bf16":
            writer.add_raw_tensor(ours, "bf16", source.shape(name), 0, source.bf16_bits(name))
        else:
            writer.add_tensor(ours, source.array(name), out_dtype)

    progress = Progress(f"writing {Path(dst).name}", show_progress)
    writer.write(dst, progress=progress)
    progress.finish()
    return {"tensors": len(source.entries), "tied": tied}

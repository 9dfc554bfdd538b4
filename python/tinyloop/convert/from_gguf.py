"""GGUF (llama architecture) -> .tinyloop.

The model becomes a plain Llama in our family: every GGUF block is a prelude block
(`n_pre = block_count`, `n_core = n_post = 0`, depth 0). GGUF stores Llama's Q and K
rows permuted for interleaved-pair RoPE, so the file says `arch.rope_style = interleaved`
and the weights are taken as they are. f32/f16/bf16/q8_0/q4_0/q4_1 tensors are imported
bit-exactly (see ggml_blocks.py); other types are decoded to float with a warning.
"""

from __future__ import annotations

import os
import re
from collections import Counter


from ..errors import FormatError
from ..fileformat.tinyloop_file import TinyLoopWriter
from . import ggml_blocks
from .gguf_reader import GGUFFile
from .gguf_tokenizer import check_round_trip, tokenizer_json_from_gguf
from .progress import Progress, note

CONVERTER = "tinyloop.convert.from_gguf 1"

_GLOBAL_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "final_norm.weight",
    "output.weight": "output.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "attn_q.weight": "attn.q.weight",
    "attn_k.weight": "attn.k.weight",
    "attn_v.weight": "attn.v.weight",
    "attn_output.weight": "attn.o.weight",
    "attn_q.bias": "attn.q.bias",
    "attn_k.bias": "attn.k.bias",
    "attn_v.bias": "attn.v.bias",
    "ffn_gate.weight": "mlp.gate.weight",
    "ffn_up.weight": "mlp.up.weight",
    "ffn_down.weight": "mlp.down.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")

# Text the converted tokenizer must reproduce exactly (encode -> decode).
ROUND_TRIP_SAMPLES = [
    "Hello, world! It's 2024 and the price is $3.50.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "naïve café — ünïcödé, 日本語, emoji 🙂",
    "<|im_start|>user\nHi<|im_end|>",
]


class _LazyBlocks:
    """A quantized tensor repacked from the GGUF mmap only when the writer asks for it,
    so a conversion never holds all repacked tensors in memory at once."""

    def __init__(self, gguf: GGUFFile, name: str, dtype: str, shape: tuple, group_size: int):
        self._gguf, self._name = gguf, name
        self.dtype, self.shape, self.group_size = dtype, shape, group_size

    def to_bytes(self) -> bytes:
        t = self._gguf.tensors[self._name]
        imported = ggml_blocks.import_tensor(self._gguf.data(self._name), t.ggml_type, t.shape)
        return imported.data.tobytes()


def map_tensor_name(gguf_name: str, n_layers: int) -> str:
    """GGUF tensor name -> .tinyloop name; FormatError for tensors we cannot place."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        layer = int(m.group(1))
        if layer >= n_layers:
            raise FormatError(f"tensor {gguf_name!r}: layer {layer} but block_count is {n_layers}")
        return f"pre.{layer}.{_BLOCK_NAMES[m.group(2)]}"
    if gguf_name == "rope_freqs.weight":
        raise FormatError("tensor 'rope_freqs.weight' (Llama-3.1 style RoPE scaling) is not supported")
    raise FormatError(f"tensor {gguf_name!r} has no place in a Llama model")


def _architecture(g: GGUFFile) -> dict:
    arch = g.require("general.architecture")
    if arch != "llama":
        raise FormatError(f"{g.path}: architecture {arch!r} is not supported (only 'llama')")
    scaling = g.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None) and float(g.get("llama.rope.scaling.factor", 1.0)) != 1.0:
        raise FormatError(f"{g.path}: RoPE scaling {scaling!r} is not supported")
    return {
        "n_layers": int(g.require("llama.block_count")),
        "d_model": int(g.require("llama.embedding_length")),
        "ffn_dim": int(g.require("llama.feed_forward_length")),
        "n_head": int(g.require("llama.attention.head_count")),
        "n_kv_head": int(g.get("llama.attention.head_count_kv", g.require("llama.attention.head_count"))),
        "context": int(g.get("llama.context_length", 2048)),
        "eps": float(g.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "theta": float(g.get("llama.rope.freq_base", 10000.0)),
    }


def tokenizer_metadata(g: GGUFFile, verify: bool = True) -> dict:
    """The .tinyloop tokenizer.* keys built from the GGUF vocabulary; `verify` round-trips
    sample text through the built tokenizer first."""
    tok_json = tokenizer_json_from_gguf(g.metadata, g.path)
    if verify:
        check_round_trip(tok_json, ROUND_TRIP_SAMPLES)
    meta = {
        "tokenizer.json": tok_json,
        "tokenizer.bos_id": int(g.get("tokenizer.ggml.bos_token_id", -1)),
        "tokenizer.eos_id": int(g.get("tokenizer.ggml.eos_token_id", -1)),
        "tokenizer.add_bos": int(bool(g.get("tokenizer.ggml.add_bos_token", False))),
    }
    template = g.get("tokenizer.chat_template")
    if isinstance(template, str):
        meta["tokenizer.chat_template"] = template
    return meta


def decode_tensor(g: GGUFFile, name: str):
    """One tensor of the GGUF decoded to float32, shape outermost-first ([out, in])."""
    t = g.tensors[name]
    return ggml_blocks.decode_to_f32(g.data(name), t.ggml_type, t.shape)


def convert_gguf(src, dst, *, fallback_dtype: str = "f32", verify_tokenizer: bool = True,
                 show_progress: bool = True) -> dict:
    """Convert the GGUF file `src` into the .tinyloop file `dst`.

    Returns a summary: tensor counts per imported dtype and the names decoded lossily."""
    if fallback_dtype not in ("f32", "f16"):
        raise ValueError(f"fallback_dtype must be 'f32' or 'f16', got {fallback_dtype!r}")
    with GGUFFile(src) as g:
        a = _architecture(g)
        if a["d_model"] % a["n_head"]:
            raise FormatError(f"{g.path}: embedding_length {a['d_model']} is not a multiple of head_count {a['n_head']}")
        head_dim = int(g.get("llama.attention.key_length", a["d_model"] // a["n_head"]))
        embed = g.tensors.get("token_embd.weight")
        if embed is None:
            raise FormatError(f"{g.path}: tensor 'token_embd.weight' is missing")
        vocab = embed.shape[0]

        writer = TinyLoopWriter({
            "vocab_size": vocab, "d_model": a["d_model"], "n_head": a["n_head"],
            "n_kv_head": a["n_kv_head"], "head_dim": head_dim, "ffn_dim": a["ffn_dim"],
            "n_pre": a["n_layers"], "n_core": 0, "n_post": 0,
            "default_depth": 0, "max_depth": 0, "max_seq_len": a["context"],
        })
        has_bias = any(n.endswith("attn_q.bias") for n in g.tensors)
        for key, value in [
            ("arch.norm_placement", "pre"), ("arch.norm_type", "rmsnorm"),
            ("arch.norm_eps", a["eps"]), ("arch.rope_style", "interleaved"),
            ("arch.rope_theta", a["theta"]),
            ("arch.rope_dims", int(g.get("llama.rope.dimension_count", head_dim))),
            ("arch.activation", "silu"), ("arch.qkv_bias", int(has_bias)),
            ("arch.tied_embeddings", int("output.weight" not in g.tensors)),
            ("loop.injection", "none"),
        ]:
            writer.add_metadata(key, value)
        for key, value in tokenizer_metadata(g, verify_tokenizer).items():
            writer.add_metadata(key, value)
        for gguf_key, key in [("general.name", "general.name"), ("general.license", "general.license")]:
            if isinstance(g.get(gguf_key), str):
                writer.add_metadata(key, g.get(gguf_key))
        writer.add_metadata("general.source", f"gguf:{os.path.basename(os.fspath(src))}")
        writer.add_metadata("general.converter", CONVERTER)

        counts, lossy = Counter(), []
        for name, t in g.tensors.items():
            ours = map_tensor_name(name, a["n_layers"])
            dtype = ggml_blocks.lossless_dtype(g.data(name), t.ggml_type, t.shape)
            if dtype is not None:
                if dtype in ("f32", "f16", "bf16"):
                    writer.add_raw_tensor(ours, dtype, t.shape, 0, g.data(name))
                else:
                    writer.add_tensor(ours, _LazyBlocks(g, name, dtype, t.shape, 32))
                counts[dtype] += 1
            else:
                values = decode_tensor(g, name)
                # norms and biases stay f32: they are tiny and feed every token
                dtype = fallback_dtype if values.ndim == 2 else "f32"
                writer.add_tensor(ours, values, dtype)
                counts[dtype] += 1
                lossy.append(f"{name} ({t.type_name} -> {dtype})")
        if lossy:
            note(f"warning: {len(lossy)} tensor(s) have no exact TinyLoop dtype and were decoded: "
                 + ", ".join(lossy[:5]) + (" ..." if len(lossy) > 5 else ""))

        progress = Progress(f"writing {os.path.basename(os.fspath(dst))}", show_progress)
        writer.write(dst, progress=progress)
        progress.finish()
    return {"tensors": dict(counts), "lossy": lossy}

"""GGUF (llama and qwen2 architectures) -> .tinyloop.

The model becomes a plain Llama in our family: every GGUF block is a prelude block
(`n_pre = block_count`, `n_core = n_post = 0`, depth 0). GGUF stores Llama's Q and K
rows permuted for interleaved-pair RoPE, so the file says `arch.rope_style = interleaved`
and the weights are taken as they are; Qwen2's rows are HF's (`half`). Which ggml types
stay quantized and what that costs: ggml_blocks.py. RoPE scaling by
per-pair factors (Llama 3.x `rope_freqs`) or linear scaling becomes `rope.freq_factors`.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import numpy as np

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
        return "rope.freq_factors"
    raise FormatError(f"tensor {gguf_name!r} has no place in a Llama model")


# general.architecture -> RoPE pairing. llama.cpp's converter permutes Llama's Q/K rows
# for interleaved pairs; Qwen2 keeps the HF rows and rotates NeoX-style halves.
ARCHITECTURES = {"llama": "interleaved", "qwen2": "half"}


def _architecture(g: GGUFFile) -> dict:
    arch = g.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise FormatError(f"{g.path}: architecture {arch!r} is not supported "
                          f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    head_count = g.require(f"{arch}.attention.head_count")
    return {
        "arch": arch,
        "rope_style": ARCHITECTURES[arch],
        "n_layers": int(g.require(f"{arch}.block_count")),
        "d_model": int(g.require(f"{arch}.embedding_length")),
        "ffn_dim": int(g.require(f"{arch}.feed_forward_length")),
        "n_head": int(head_count),
        "n_kv_head": int(g.get(f"{arch}.attention.head_count_kv", head_count)),
        "context": int(g.get(f"{arch}.context_length", 2048)),
        "eps": float(g.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "theta": float(g.get(f"{arch}.rope.freq_base", 10000.0)),
        "linear_scale": _linear_rope_scale(g, arch),
    }


def _linear_rope_scale(g: GGUFFile, arch: str) -> float:
    """The position divisor of linear RoPE scaling (1.0 = none); FormatError for YaRN and
    other scalings that change more than the frequencies."""
    scaling = g.get(f"{arch}.rope.scaling.type")
    factor = float(g.get(f"{arch}.rope.scaling.factor", 0.0) or 0.0)
    if scaling in (None, "none", ""):
        # files before rope.scaling.type said it this way
        return float(g.get(f"{arch}.rope.scale_linear", 1.0))
    if scaling == "linear":
        return factor if factor > 0 else 1.0
    if factor in (0.0, 1.0):
        return 1.0
    raise FormatError(f"{g.path}: RoPE scaling {scaling!r} (factor {factor}) is not supported; "
                      "supported: none, linear, and per-frequency factors (rope_freqs, Llama 3.x)")


def rope_freq_factors(g: GGUFFile, a: dict, rope_dims: int):
    """rope.freq_factors for the file (float32 [rope_dims/2]), or None when every
    frequency is theta^(-2i/r): GGUF's rope_freqs tensor (Llama 3.x scaling, already the
    per-pair divisors) times linear scaling's factor (a divisor of every frequency)."""
    factors = np.ones(rope_dims // 2, np.float32)
    t = g.tensors.get("rope_freqs.weight")
    if t is not None:
        if t.shape != (rope_dims // 2,):
            raise FormatError(f"{g.path}: tensor 'rope_freqs.weight' has shape {t.shape}; "
                              f"expected ({rope_dims // 2},), one factor per RoPE pair")
        factors = decode_tensor(g, "rope_freqs.weight").astype(np.float32)
        if not (np.all(np.isfinite(factors)) and np.all(factors > 0)):
            raise FormatError(f"{g.path}: tensor 'rope_freqs.weight' has factors that are not finite and > 0")
    if a["linear_scale"] != 1.0:
        factors = factors * np.float32(a["linear_scale"])
    return None if t is None and a["linear_scale"] == 1.0 else factors


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
        # without the key llama.cpp adds BOS for SentencePiece vocabularies only
        "tokenizer.add_bos": int(bool(g.get("tokenizer.ggml.add_bos_token",
                                            g.get("tokenizer.ggml.model") == "llama"))),
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

    Returns a summary: tensor counts per imported dtype, the tensors decoded to float
    (`lossy`) and those kept quantized with rounded scales (`rounded`, Q4_K)."""
    if fallback_dtype not in ("f32", "f16"):
        raise ValueError(f"fallback_dtype must be 'f32' or 'f16', got {fallback_dtype!r}")
    with GGUFFile(src) as g:
        a = _architecture(g)
        if a["d_model"] % a["n_head"]:
            raise FormatError(f"{g.path}: embedding_length {a['d_model']} is not a multiple of head_count {a['n_head']}")
        head_dim = int(g.get(f"{a['arch']}.attention.key_length", a["d_model"] // a["n_head"]))
        rope_dims = int(g.get(f"{a['arch']}.rope.dimension_count", head_dim))
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
            ("arch.norm_eps", a["eps"]), ("arch.rope_style", a["rope_style"]),
            ("arch.rope_theta", a["theta"]), ("arch.rope_dims", rope_dims),
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

        counts, lossy, rounded = Counter(), [], []
        factors = rope_freq_factors(g, a, rope_dims)
        if factors is not None:
            writer.add_tensor("rope.freq_factors", factors, "f32")
            counts["f32"] += 1
        for name, t in g.tensors.items():
            if name == "rope_freqs.weight":
                continue   # written above, with any linear scaling folded in
            ours = map_tensor_name(name, a["n_layers"])
            kept = ggml_blocks.keep_quantized(g.data(name), t.ggml_type, t.shape)
            if kept is not None:
                dtype, change = kept
                if dtype in ("f32", "f16", "bf16"):
                    writer.add_raw_tensor(ours, dtype, t.shape, 0, g.data(name))
                else:
                    writer.add_tensor(ours, _LazyBlocks(g, name, dtype, t.shape, 32))
                counts[dtype] += 1
                if change:
                    rounded.append(f"{name} ({t.type_name} -> {dtype}, max |change| {change:.2g})")
            else:
                values = decode_tensor(g, name)
                # norms and biases stay f32: they are tiny and feed every token
                dtype = fallback_dtype if values.ndim == 2 else "f32"
                writer.add_tensor(ours, values, dtype)
                counts[dtype] += 1
                lossy.append(f"{name} ({t.type_name} -> {dtype})")
        if rounded:
            note(f"note: {len(rounded)} K-quant tensor(s) kept quantized with their 4-bit values, their "
                 "sub-block scales and mins rounded to fp16 (weights move by at most the change shown): "
                 + _first(rounded))
        if lossy:
            note(f"warning: {len(lossy)} tensor(s) have no exact TinyLoop dtype and were decoded "
                 f"(to {fallback_dtype} for matrices, f32 for vectors): " + _first(lossy))

        progress = Progress(f"writing {os.path.basename(os.fspath(dst))}", show_progress)
        writer.write(dst, progress=progress)
        progress.finish()
    return {"tensors": dict(counts), "lossy": lossy, "rounded": rounded}


def _first(names: list, shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (" ..." if len(names) > shown else "")

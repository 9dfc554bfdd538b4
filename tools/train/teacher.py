"""The teacher: a Llama model (SmolLM2-135M) in PyTorch built from dequantized GGUF weights.

Dims, RoPE theta and RMSNorm eps come from the GGUF metadata; Q/K are used as the GGUF
stores them (permuted for interleaved RoPE), so interleaved RoPE reproduces llama.cpp.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from layers import GGUF_BLOCK_NAMES, Block, Dims, RMSNorm, rope_tables

# the package's GGUF reader (numpy only: it needs no built library)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
from tinyloop.convert.from_gguf import decode_tensor  # noqa: E402
from tinyloop.convert.gguf_reader import GGUFFile  # noqa: E402


def dims_from_gguf(meta: dict) -> Dims:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"teacher architecture {arch!r}: only 'llama' is supported")
    d = int(meta["llama.embedding_length"])
    heads = int(meta["llama.attention.head_count"])
    head_dim = d // heads
    if int(meta.get("llama.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("partial rotary dims are not supported by the training tools")
    return Dims(vocab=len(meta["tokenizer.ggml.tokens"]), d=d, heads=heads,
                kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
                head_dim=head_dim, ffn=int(meta["llama.feed_forward_length"]),
                eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
                rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)))


class Teacher(nn.Module):
    def __init__(self, dims: Dims, n_layers: int):
        super().__init__()
        self.dims = dims
        self.embed = nn.Embedding(dims.vocab, dims.d)
        self.layers = nn.ModuleList(Block(dims) for _ in range(n_layers))
        self.final_norm = RMSNorm(dims.d, dims.eps)
        self.output = None  # tied head unless the GGUF has output.weight

    def forward(self, tokens, return_hidden: bool = False):
        """Logits [B, T, V]; with return_hidden also the residual stream after each layer."""
        h = self.embed(tokens)
        cos, sin = rope_tables(tokens.shape[1], self.dims.head_dim, self.dims.rope_theta, tokens.device)
        hidden = []
        for layer in self.layers:
            h = layer(h, cos, sin)
            if return_hidden:
                hidden.append(h)
        logits = self.head(h)
        return (logits, hidden) if return_hidden else logits

    def head(self, h):
        """Logits from the last layer's output: final norm, then the (tied) output matrix."""
        w = self.embed.weight if self.output is None else self.output.weight
        return self.final_norm(h) @ w.t()


def load_teacher(path: str) -> tuple[Teacher, dict]:
    """Teacher with float32 weights (dequantized) and the GGUF metadata."""
    with GGUFFile(path) as g:
        dims = dims_from_gguf(g.metadata)
        n_layers = int(g.metadata["llama.block_count"])
        model = Teacher(dims, n_layers)
        state = {"embed.weight": decode_tensor(g, "token_embd.weight"),
                 "final_norm.weight": decode_tensor(g, "output_norm.weight")}
        for i in range(n_layers):
            for src, dst in GGUF_BLOCK_NAMES.items():
                state[f"layers.{i}.{dst}"] = decode_tensor(g, f"blk.{i}.{src}")
        if "output.weight" in g.tensors:
            model.output = nn.Linear(dims.d, dims.vocab, bias=False)
            state["output.weight"] = decode_tensor(g, "output.weight")
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()})
    model.requires_grad_(False)
    return model.eval(), g.metadata

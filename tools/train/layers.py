"""Llama building blocks in PyTorch, computing docs/model.md with norm placement `pre`:
RMSNorm, attention with interleaved RoPE (GGUF stores Llama Q/K permuted for it) and GQA,
SwiGLU MLP. Parameter names follow the .tinyloop tensor names (attn.q.weight, ...), so
export is a renaming-free walk over the state dict."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Dims:
    vocab: int = 49152
    d: int = 576
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    ffn: int = 1536
    eps: float = 1e-5
    rope_theta: float = 100000.0


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(seq: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [seq, head_dim/2]: angle = pos * theta^(-2i/head_dim)."""
    i = torch.arange(head_dim // 2, device=device, dtype=torch.float64)
    freq = theta ** (-2.0 * i / head_dim)
    ang = torch.arange(seq, device=device, dtype=torch.float64)[:, None] * freq[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope_interleaved(x, cos, sin):
    """x [B, H, T, hd]; rotates pairs (x_2i, x_2i+1) by the angle of pair i."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, dims: Dims):
        super().__init__()
        self.dims = dims
        hd = dims.head_dim
        self.q = nn.Linear(dims.d, dims.heads * hd, bias=False)
        self.k = nn.Linear(dims.d, dims.kv_heads * hd, bias=False)
        self.v = nn.Linear(dims.d, dims.kv_heads * hd, bias=False)
        self.o = nn.Linear(dims.heads * hd, dims.d, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        dm = self.dims
        q = self.q(x).view(B, T, dm.heads, dm.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, dm.kv_heads, dm.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, dm.kv_heads, dm.head_dim).transpose(1, 2)
        q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
        group = dm.heads // dm.kv_heads  # query head t reads kv head t // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(B, T, dm.heads * dm.head_dim))


class MLP(nn.Module):
    def __init__(self, dims: Dims):
        super().__init__()
        self.gate = nn.Linear(dims.d, dims.ffn, bias=False)
        self.up = nn.Linear(dims.d, dims.ffn, bias=False)
        self.down = nn.Linear(dims.ffn, dims.d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm block: x += Attn(N1 x); x += MLP(N2 x)."""

    def __init__(self, dims: Dims):
        super().__init__()
        self.attn_norm = RMSNorm(dims.d, dims.eps)
        self.attn = Attention(dims)
        self.mlp_norm = RMSNorm(dims.d, dims.eps)
        self.mlp = MLP(dims)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


# GGUF llama tensor names of one block -> our parameter names
GGUF_BLOCK_NAMES = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "mlp_norm.weight",
    "attn_q.weight": "attn.q.weight", "attn_k.weight": "attn.k.weight",
    "attn_v.weight": "attn.v.weight", "attn_output.weight": "attn.o.weight",
    "ffn_gate.weight": "mlp.gate.weight", "ffn_up.weight": "mlp.up.weight",
    "ffn_down.weight": "mlp.down.weight",
}

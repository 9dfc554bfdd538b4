"""Quantization-aware training: the forward pass sees the weights export.py will write.

export.py writes every 2-D tensor of the student except the tied embedding as q4 (group 32
by default) and the embedding as q4 group 64. q4 (docs/format.md, python/tinyloop/quantize.py,
method `rtn`): per group of G consecutive elements of a row (rows = output features, groups
along the input dim), min = f16(group min), scale = f16((group max - min) / 15), code =
clip(rint((w - min) / scale), 0, 15) (round half to even; scale 0 -> code 0),
w' = scale * code + min. export.py reads the fp16 shards train.py saves, so the fake
quantizer rounds the weight to fp16 first and computes in float64 like quantize.py: its
output equals the exported rtn weights (checked: tools/train/qat.py --check).

Gradients pass straight through (w + (w' - w).detach()); the master weights stay float.
`--method search` at export picks, per group, the best of shrunken grids; it is not
differentiable in a useful way, so QAT trains against the rtn grid (a proxy for search;
blocks trained this way should be exported with `--method rtn`, see README).

The frozen embedding (not trained by default) is replaced while QAT is on by its exact
export (q4, group 64, rtn or search via tinyloop.quantize), computed once: the blocks learn
to work with the embedding the runtime will use. A trained embedding (--train-embed) gets
the rtn fake quantizer with its group size instead.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

QMAX = 15  # q4 codes 0..15


def fake_quant_q4_values(w: torch.Tensor, group: int) -> torch.Tensor:
    """The dequantized q4 rtn weights of export.py (same dtype/device as w, no gradient)."""
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"{tuple(w.shape)}: cols not a multiple of group {group}")
    with torch.no_grad():
        g = w.detach().to(torch.float16).to(torch.float64).reshape(rows, cols // group, group)
        vmin = g.amin(-1, keepdim=True).to(torch.float16).to(torch.float64)
        vmax = g.amax(-1, keepdim=True)
        scale = ((vmax - vmin).clamp_min(0.0) / QMAX).to(torch.float16).to(torch.float64)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((g - vmin) / safe).clamp_(0, QMAX)
        q = torch.where(scale > 0, q, torch.zeros_like(q))
        return (scale * q + vmin).reshape(rows, cols).to(w.dtype)


def fake_quant_q4(w: torch.Tensor, group: int) -> torch.Tensor:
    """q4 rtn forward, straight-through gradient to w."""
    return w + (fake_quant_q4_values(w, group) - w).detach()


def export_quantized(w: torch.Tensor, group: int, method: str, threads: int = 0) -> torch.Tensor:
    """The exact dequantized q4 tensor export.py writes (tinyloop.quantize), for frozen
    tensors. Rows are quantized independently, so row chunks run in threads (numpy
    releases the GIL); `search` on the embedding takes ~45 s on one core."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
    from tinyloop.quantize import quantize
    arr = w.detach().to("cpu", torch.float16).float().numpy()
    threads = threads or max(1, min(16, len(os.sched_getaffinity(0))))
    chunks = np.array_split(arr, threads, axis=0)
    with ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(lambda c: quantize(c, "q4", group, method).dequantize(), chunks))
    deq = np.concatenate(parts, axis=0)
    return torch.from_numpy(deq.astype(np.float32)).to(w.device, w.dtype)


class QAT:
    """Which parameters are fake-quantized, and a context that swaps them in."""

    def __init__(self, model: nn.Module, group: int = 32, embed_group: int = 64,
                 embed_method: str = "search", quantize_embed: bool = True):
        self.model = model
        self.group, self.embed_group = group, embed_group
        self.embed_method = embed_method
        self.quantize_embed = quantize_embed
        self.names = [n for n, p in model.named_parameters() if p.ndim == 2 and n != "embed.weight"]
        self._embed_const = None

    def embed_tensor(self, p: torch.Tensor) -> torch.Tensor:
        if p.requires_grad:  # trained embedding: rtn fake quant with STE
            return fake_quant_q4(p, self.embed_group)
        if self._embed_const is None or self._embed_const.device != p.device:
            self._embed_const = export_quantized(p, self.embed_group, self.embed_method)
        return self._embed_const

    @contextmanager
    def active(self, enabled: bool = True):
        """Within the context, forward passes use the quantized weights (computed once on
        entry, so the loop's repeated core blocks share them). The autograd graph stays
        valid after exit: call backward() outside is fine."""
        if not enabled:
            yield
            return
        swapped = []
        try:
            for name, p in list(self.model.named_parameters()):
                if name == "embed.weight":
                    if not self.quantize_embed:
                        continue
                    q = self.embed_tensor(p)
                elif name in self.names:
                    q = fake_quant_q4(p, self.group)
                else:
                    continue
                mod_name, _, attr = name.rpartition(".")
                mod = self.model.get_submodule(mod_name)
                del mod._parameters[attr]
                setattr(mod, attr, q)
                swapped.append((mod, attr, p))
            yield
        finally:
            for mod, attr, p in swapped:
                delattr(mod, attr)
                mod._parameters[attr] = p


def _check(argv=None) -> int:
    """Compare fake_quant_q4_values with tinyloop.quantize on trained weights."""
    import argparse
    import json
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", required=True, help="weights folder (student-0N.pt + student.json)")
    ap.add_argument("--group", type=int, default=32)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
    from tinyloop.quantize import quantize
    folder = Path(args.check)
    info = json.loads((folder / "student.json").read_text())
    worst, n_diff, n_total = 0.0, 0, 0
    for shard in info["shards"]:
        for name, t in torch.load(folder / shard, map_location="cpu", weights_only=True).items():
            if t.ndim != 2:
                continue
            ours = fake_quant_q4_values(t.float(), args.group).double()
            ref = torch.from_numpy(quantize(t.float().numpy(), "q4", args.group, "rtn").dequantize())
            d = (ours - ref).abs()
            worst = max(worst, d.max().item())
            n_diff += int((d > 0).sum())
            n_total += d.numel()
    print(f"{n_total} weights: {n_diff} differ from tinyloop.quantize rtn, max |diff| {worst:.3g}")
    return 0 if n_diff == 0 else 1


if __name__ == "__main__":
    sys.exit(_check())

"""Quantization-aware training: the forward pass sees the weights export.py will write.

export.py writes every 2-D tensor of the student except the tied embedding as q4 (group 32
by default) and the embedding as q4 group 64. q4 (docs/format.md,
python/tinyloop/fileformat/quantize.py, method `rtn`): per group of G consecutive elements
of a row (rows = output features, groups along the input dim), min = f16(group min),
scale = f16((group max - min) / 15), code = clip(rint((w - min) / scale), 0, 15) (round
half to even; scale 0 -> code 0), w' = scale * code + min. export.py reads the fp16 shards
train.py saves, so the fake quantizer rounds the weight to fp16 first and computes in
float64 like quantize.py: its output equals the exported rtn weights (checked:
tools/train/qat.py --check).

Gradients pass straight through (w + (w' - w).detach()); the master weights stay float.
`--method search` at export picks, per group, the best of shrunken grids; it is not
differentiable in a useful way, so QAT trains against the rtn grid (a proxy for search;
blocks trained this way should be exported with `--method rtn`, see README).

The frozen embedding (not trained by default) is replaced while QAT is on by its exact
export (q4, group 64, rtn or search via tinyloop.fileformat.quantize), computed once: the
blocks learn to work with the embedding the runtime will use. A trained embedding
(--train-embed) gets the rtn fake quantizer with its group size instead.

With learn_grid=True (train.py --qat-learn-grid) each block matrix's grid is trained too:
per group a scale (as its logarithm, so steps are relative and it stays positive) and a
min, both started from the rtn grid of the weights when QAT switches on. The forward value
is exactly what export.py writes from the saved grid (f16 scale and min, codes
clip(rint((f16(w) - min) / scale), 0, 15) in float64). Gradients: to the scale and the min
the exact ones of the exported weight with its codes held (code and 1: the codes are
piecewise constant in both), to a weight straight through unless its code is clipped
(its position (f16(w) - min) / scale, from the same f16 numbers as the code, outside
[-0.5, 15.5]), else 0. Scales are kept at or above the smallest f16 scale (a scale that
rounds to 0 would freeze its group), and a constant group starts at the matrix's median
scale. LSQ's scale gradient (code - x inside, x = (w - min) / scale) was the other
candidate; on a layer's output error with the weights held it removed 4 % of the rtn
error where the codes-held gradient removed 9 % (tests/tools/test_train_qat.py has the
plain-error version). rtn puts the grid on every group's extremes; a learned grid may clip
an outlier to place the other weights' levels better, which is what the last 0.02 nats of
rtn QAT could not reach.
"""

from __future__ import annotations

import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

QMAX = 15  # q4 codes 0..15
# saved beside NAME in a weights folder: the learned grid of NAME (QAT.exported_grid)
GRID_SUFFIXES = (".q4_scale", ".q4_min")
EMBED = "embed.weight"  # the tied embedding: frozen unless --train-embed, its own group size


def split_grid(state: dict) -> tuple[dict, dict]:
    """(weights, {NAME: (scale, min)}) from a weights folder's tensors. The frozen
    embedding's grid comes without its weights (those are the teacher's)."""
    weights = {k: v for k, v in state.items() if not k.endswith(GRID_SUFFIXES)}
    grid = {}
    for key in state:
        if key.endswith(GRID_SUFFIXES[0]):
            name = key[:-len(GRID_SUFFIXES[0])]
            if name + GRID_SUFFIXES[1] not in state or (name not in weights and name != EMBED):
                raise SystemExit(f"{key}: the learned grid needs {name} and {name}{GRID_SUFFIXES[1]}")
            grid[name] = (state[key], state[name + GRID_SUFFIXES[1]])
    stray = [k for k in state if k.endswith(GRID_SUFFIXES[1]) and k[:-len(GRID_SUFFIXES[1])] not in grid]
    if stray:
        raise SystemExit(f"{stray}: mins without scales")
    return weights, grid


def fake_quant_q4_values(w: torch.Tensor, group: int) -> torch.Tensor:
    """The dequantized q4 rtn weights of export.py (same dtype/device as w, no gradient)."""
    return grid_values(w, *rtn_grid(w, group), group)[0]


def fake_quant_q4(w: torch.Tensor, group: int) -> torch.Tensor:
    """q4 rtn forward, straight-through gradient to w."""
    return w + (fake_quant_q4_values(w, group) - w).detach()


# the smallest f16 scale (a subnormal): a learned log scale stays at or above its log, so
# its f16 scale never rounds to 0 (a group whose scale is 0 has code 0 and no gradient)
MIN_SCALE = 2.0 ** -24


def f16_groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """w rounded to f16 (what the saved shards hold), float64 [rows, cols // group, group]."""
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"{tuple(w.shape)}: cols not a multiple of group {group}")
    return w.detach().to(torch.float16).to(torch.float64).reshape(rows, cols // group, group)


def rtn_grid(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, min) of the rtn grid, [rows, cols // group] float32, as fake_quant_q4_values
    and tinyloop.fileformat.quantize choose them."""
    with torch.no_grad():
        g = f16_groups(w, group)
        vmin = g.amin(-1).to(torch.float16).to(torch.float64)
        scale = ((g.amax(-1) - vmin).clamp_min(0.0) / QMAX).to(torch.float16)
        return scale.float(), vmin.float()


def grid_positions(w: torch.Tensor, scale: torch.Tensor, vmin: torch.Tensor,
                   group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unclipped positions (f16(w) - min) / scale, f16 scale, f16 min), float64, of w on
    the grid (scale, min: [rows, cols // group], rounded to f16 as the file stores them).
    A scale that rounds to 0 puts its group at position 0, as in tinyloop.fileformat.quantize."""
    g = f16_groups(w, group)
    s = scale.detach().to(torch.float16).to(torch.float64)[..., None]
    m = vmin.detach().to(torch.float16).to(torch.float64)[..., None]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.where(s > 0, (g - m) / safe, torch.zeros_like(g)), s, m


def grid_values(w: torch.Tensor, scale: torch.Tensor, vmin: torch.Tensor,
                group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dequantized weights [rows, cols] in w's dtype, codes and unclipped positions
    [rows, cols // group, group] float64) of w on the grid (scale, min), without gradient."""
    with torch.no_grad():
        x, s, m = grid_positions(w, scale, vmin, group)
        codes = torch.round(x).clamp_(0, QMAX)
        return (s * codes + m).reshape(w.shape).to(w.dtype), codes, x


def fake_quant_q4_learned(w: torch.Tensor, log_scale: torch.Tensor, vmin: torch.Tensor,
                          group: int, on_grid=None) -> torch.Tensor:
    """q4 forward on a trained grid (module docstring): the value is the exported weight;
    gradients to the grid with the codes held, to w straight through inside the range.
    on_grid: fake_quant_q4_on_grid or a compiled form of it. exp stays outside it: compiled
    and eager exp may differ by an ulp, which can flip the scale's f16 rounding."""
    return (on_grid or fake_quant_q4_on_grid)(w, log_scale.exp(), vmin, group)


def fake_quant_q4_on_grid(w: torch.Tensor, scale: torch.Tensor, vmin: torch.Tensor,
                          group: int) -> torch.Tensor:
    """fake_quant_q4_learned's body, from the scale itself."""
    rows, cols = w.shape
    values, codes, x = grid_values(w, scale, vmin, group)
    # inside: the weight's code is its rounded position, not clipped (from the same f16
    # numbers as the code, so a group's own min and max are always inside)
    inside = ((x >= -0.5) & (x <= QMAX + 0.5)).to(w.dtype)
    through = w - w.detach()  # zero-valued, gradient 1 to w
    surrogate = (scale[..., None] * codes.to(w.dtype) + vmin[..., None]
                 + through.reshape(rows, cols // group, group) * inside)
    return (surrogate + (values.reshape(rows, cols // group, group) - surrogate).detach()).reshape(rows, cols)


def export_q4(w: torch.Tensor, group: int, method: str,
              threads: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dequantized values, scale, min [rows, cols // group]) of the exact q4 export.py
    writes (tinyloop.fileformat.quantize) of a frozen tensor: what QAT uses for it, and where its
    learned grid starts. Rows are quantized independently, so row chunks run in threads
    (numpy releases the GIL); `search` on the embedding takes ~45 s on one core."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
    from tinyloop.fileformat.quantize import quantize
    arr = w.detach().to("cpu", torch.float16).float().numpy()
    threads = threads or max(1, min(16, len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(lambda c: quantize(c, "q4", group, method), np.array_split(arr, threads, axis=0)))

    def joined(pieces) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(pieces, axis=0).astype(np.float32)).to(w.device)

    return (joined([q.dequantize() for q in parts]).to(w.dtype),
            joined([q.scales.reshape(q.shape[0], -1) for q in parts]),
            joined([q.mins.reshape(q.shape[0], -1) for q in parts]))


def start_log_scale(scale: torch.Tensor) -> torch.Tensor:
    """Log scales to start a learned grid from f16 scales. A constant group (scale 0: its
    weights all equal its min) starts at the matrix's median scale: code 0 stays exact, and
    its weights can spread without leaving the range at once."""
    spread = scale[scale > 0]
    fill = spread.median() if spread.numel() else torch.tensor(MIN_SCALE)
    return torch.where(scale > 0, scale, fill).clamp_min(MIN_SCALE).log()


class QAT:
    """Which parameters are fake-quantized, and a context that swaps them in."""

    def __init__(self, model: nn.Module, group: int = 32, embed_group: int = 64,
                 embed_method: str = "search", quantize_embed: bool = True, learn_grid: bool = False,
                 compile_learned: bool = False, learn_embed_grid: bool = False):
        self.model = model
        # the learned grid's fake quantization, compiled when asked (check_compiled decides)
        self._on_grid = fake_quant_q4_on_grid
        if compile_learned:
            import torch._dynamo as dynamo
            # a graph per matrix shape (4-5 in a student) and grad mode (training, validation)
            dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 32)
            # keep the f16 round trips of weights, scales and mins inside a fused kernel,
            # which inductor may otherwise drop; on an H200 the check below still falls back
            # to eager with it (docs/models.md, "The runs on the GPU machine", 3j), so the check stays the guard
            self._on_grid = torch.compile(fake_quant_q4_on_grid, dynamic=False,
                                          options={"emulate_precision_casts": True})
        self.group, self.embed_group = group, embed_group
        self.embed_method = embed_method
        self.quantize_embed = quantize_embed
        self.names = [n for n, p in model.named_parameters() if p.ndim == 2 and n != EMBED]
        self._embed_export = None
        # name -> (log_scale, min) parameters, [rows, cols // group]; set by init_grid
        self.grid: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        self.grid_ready = False
        self.grid_from_init = False  # set_grid's grids, not yet switched on
        params = dict(model.named_parameters())
        if learn_embed_grid and (not quantize_embed or params[EMBED].requires_grad):
            raise ValueError("a learned embedding grid needs the frozen embedding fake-quantized")
        learned = (self.names if learn_grid else []) + ([EMBED] if learn_embed_grid else [])
        for name in learned:
            rows, cols = params[name].shape
            shape, dev = (rows, cols // self.group_of(name)), params[name].device
            self.grid[name] = (nn.Parameter(torch.zeros(shape, device=dev)),
                               nn.Parameter(torch.zeros(shape, device=dev)))

    def group_of(self, name: str) -> int:
        return self.embed_group if name == EMBED else self.group

    def grid_parameters(self) -> tuple[list, list]:
        """([log scales], [mins]) for the optimizer (empty without a learned grid)."""
        return [ls for ls, _ in self.grid.values()], [m for _, m in self.grid.values()]

    def init_grid(self, keep: tuple = ()) -> None:
        """Start every learned grid but those in `keep` at the rtn grid of the current
        weights, the frozen embedding's at its export (once: a resumed run keeps the trained
        grid, loaded with load_grid_state, and set_grid's are kept)."""
        if not self.grid or self.grid_ready:
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, (log_scale, vmin) in self.grid.items():
                if name in keep:
                    continue
                # the frozen embedding starts where its export is; trained matrices at rtn
                scale, m = (self.embed_export(params[name])[1:] if name == EMBED
                            else rtn_grid(params[name], self.group))
                log_scale.copy_(start_log_scale(scale))
                vmin.copy_(m)
        self.grid_ready = True

    def set_grid(self, grids: dict) -> None:
        """Start from saved grids ({NAME: (scale, min)}, [rows, cols // group], what
        exported_grid writes and import_model.py reads from a file) instead of rtn."""
        if set(grids) != set(self.grid):
            raise SystemExit(f"saved q4 grids cover {len(grids)} matrices, QAT has {len(self.grid)}: "
                             f"missing {sorted(set(self.grid) - set(grids))[:3]}, "
                             f"unexpected {sorted(set(grids) - set(self.grid))[:3]}")
        with torch.no_grad():
            for name, (scale, vmin) in grids.items():
                log_scale, m = self.grid[name]
                if tuple(scale.shape) != tuple(log_scale.shape) or tuple(vmin.shape) != tuple(m.shape):
                    raise SystemExit(f"{name}: saved grid {tuple(scale.shape)} does not fit groups of "
                                     f"{self.group_of(name)} ({tuple(log_scale.shape)}): --qat-group "
                                     f"(--qat-embed-group for the embedding) must match it")
                log_scale.copy_(start_log_scale(scale.float()))
                m.copy_(vmin.float())
        self.grid_ready = self.grid_from_init = True

    def switch_on(self, keep_init: bool) -> bool:
        """At the QAT switch: the grids start from set_grid's if keep_init, else (or
        without them) from the weights' rtn grid (the frozen embedding keeps set_grid's,
        or starts at its export); a grid already trained (resumed) is kept. Returns
        whether set_grid's grids were dropped for rtn."""
        refit = self.grid_from_init and not keep_init
        if refit:
            self.grid_ready = False
        self.grid_from_init = False
        # the frozen embedding has not moved off its saved grid: only trained weights refit
        self.init_grid(keep=(EMBED,) if refit else ())
        return refit

    def learned_values(self, on_grid, name: str, p: torch.Tensor) -> torch.Tensor:
        """fake_quant_q4_learned of matrix `name` through on_grid (compiled or eager) with
        autocast off: the fake quantization is float32/float64 throughout, and the compiled
        graphs are keyed on the autocast state, which then is always the same."""
        log_scale, vmin = self.grid[name]
        with torch.autocast(p.device.type, enabled=False):
            return fake_quant_q4_learned(p, log_scale, vmin, self.group_of(name), on_grid)

    def compiled(self) -> bool:
        return self._on_grid is not fake_quant_q4_on_grid

    def check_compiled(self) -> str:
        """With compile_learned: keep the compiled fake quantization only while its values
        equal the eager ones on every matrix, with and without gradients (training and
        validation run different graphs); exactness is what export.py relies on. Returns
        what runs, for the log. train.py calls it at the switch, at every validation and at
        the end: a difference from then on switches to eager for the rest of the run."""
        if not self.compiled():
            return "eager"
        params = dict(self.model.named_parameters())
        try:
            for name in self.grid:
                with torch.no_grad():
                    eager = self.learned_values(fake_quant_q4_on_grid, name, params[name])
                    inference = self.learned_values(self._on_grid, name, params[name])
                training = self.learned_values(self._on_grid, name, params[name]).detach()
                if not (torch.equal(training, eager) and torch.equal(inference, eager)):
                    raise ValueError(f"{name}: compiled values differ from eager ones")
        except Exception as e:  # a failed compilation or a difference: eager from here on
            self._on_grid = fake_quant_q4_on_grid
            return f"eager ({type(e).__name__}: {str(e)[:120]})"
        return "compiled"

    def clamp_grid(self) -> None:
        """After an optimizer step: keep every scale at or above MIN_SCALE."""
        with torch.no_grad():
            for log_scale, _ in self.grid.values():
                log_scale.clamp_(min=math.log(MIN_SCALE))

    def grid_state(self) -> dict:
        return {"ready": self.grid_ready, "from_init": self.grid_from_init,
                "grid": {n: (ls.detach().cpu(), m.detach().cpu()) for n, (ls, m) in self.grid.items()}}

    def load_grid_state(self, state: dict) -> None:
        if set(state["grid"]) != set(self.grid):
            raise SystemExit("checkpoint's learned q4 grids do not match --qat-learn-grid")
        with torch.no_grad():
            for name, (ls, m) in state["grid"].items():
                if tuple(ls.shape) != tuple(self.grid[name][0].shape):
                    raise SystemExit(f"checkpoint's q4 grid of {name} is {tuple(ls.shape)}, "
                                     f"QAT's {tuple(self.grid[name][0].shape)}: --qat-group or "
                                     f"--qat-embed-group changed")
                self.grid[name][0].copy_(ls)
                self.grid[name][1].copy_(m)
        self.grid_ready = state["ready"]
        self.grid_from_init = state.get("from_init", False)

    def exported_grid(self) -> dict:
        """{NAME.q4_scale, NAME.q4_min: f16 [rows, cols // group]}: the grid export.py writes."""
        out = {}
        for name, (log_scale, vmin) in self.grid.items():
            out[name + GRID_SUFFIXES[0]] = log_scale.detach().exp().to("cpu", torch.float16)
            out[name + GRID_SUFFIXES[1]] = vmin.detach().to("cpu", torch.float16)
        return out

    def embed_tensor(self, p: torch.Tensor, learned: bool = True) -> torch.Tensor:
        if learned and EMBED in self.grid and self.grid_ready:
            return self.learned_values(self._on_grid, EMBED, p)
        if p.requires_grad:  # trained embedding: rtn fake quant with STE
            return fake_quant_q4(p, self.embed_group)
        return self.embed_export(p)[0]

    def embed_export(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """export_q4 of the frozen embedding, computed once (its values and its grid)."""
        if self._embed_export is None or self._embed_export[0].device != p.device:
            self._embed_export = export_q4(p, self.embed_group, self.embed_method)
        return self._embed_export

    def quantized(self, name: str, p: torch.Tensor, learned: bool) -> torch.Tensor:
        if learned and name in self.grid and self.grid_ready:
            return self.learned_values(self._on_grid, name, p)
        return fake_quant_q4(p, self.group)

    @contextmanager
    def active(self, enabled: bool = True, learned: bool = True):
        """Within the context, forward passes use the quantized weights (computed once on
        entry, so the loop's repeated core blocks share them): on the learned grid where
        there is one (learned=False: the rtn grid, for comparison). The autograd graph stays
        valid after exit: call backward() outside is fine."""
        if not enabled:
            yield
            return
        swapped = []
        try:
            for name, p in list(self.model.named_parameters()):
                if name == EMBED:
                    if not self.quantize_embed:
                        continue
                    q = self.embed_tensor(p, learned)
                elif name in self.names:
                    q = self.quantized(name, p, learned)
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
    """Compare fake_quant_q4_values with tinyloop.fileformat.quantize on trained weights."""
    import argparse
    import json
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", required=True, help="weights folder (student-0N.pt + student.json)")
    ap.add_argument("--group", type=int, default=32)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
    from tinyloop.fileformat.quantize import quantize
    folder = Path(args.check)
    info = json.loads((folder / "student.json").read_text())
    state = {}
    for shard in info["shards"]:
        state.update(torch.load(folder / shard, map_location="cpu", weights_only=True))
    state, grids = split_grid(state)
    worst, n_diff, n_total = 0.0, 0, 0
    for name, t in state.items():
        if t.ndim != 2 or name in grids:  # learned grids: tests/tools/test_train_qat.py
            continue
        ours = fake_quant_q4_values(t.float(), args.group).double()
        ref = torch.from_numpy(quantize(t.float().numpy(), "q4", args.group, "rtn").dequantize())
        d = (ours - ref).abs()
        worst = max(worst, d.max().item())
        n_diff += int((d > 0).sum())
        n_total += d.numel()
    print(f"{n_total} weights: {n_diff} differ from tinyloop.fileformat.quantize rtn, "
          f"max |diff| {worst:.3g} ({len(grids)} matrices on learned grids not compared)")
    return 0 if n_diff == 0 else 1


if __name__ == "__main__":
    sys.exit(_check())

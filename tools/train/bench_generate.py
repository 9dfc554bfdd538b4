"""Time generate_text.py's decode step per attention path and sampler, on random weights.

A step at --batch rows with the cache filled to --position (about the middle of a
1025-token record) is what a generation batch repeats; which attention path is faster
depends on the GPU and the PyTorch build, so a run measures it before sampling:

  python3 tools/train/bench_generate.py --batch 2048 --choice /tmp/attention.txt
  python3 tools/train/generate_text.py ... --attention $(cat /tmp/attention.txt)

Prints tokens per second for every attention x sampler pair and the largest difference
between the two attention paths' logits after one step from the same cache, and writes the
fastest attention path (with the race sampler, generate_text.py's default) to --choice.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_text import ATTENTION, SAMPLERS, CachedDecoder, sample_next  # noqa: E402
from layers import Dims  # noqa: E402
from teacher import Teacher  # noqa: E402


def filled_decoder(teacher: Teacher, batch: int, max_len: int, position: int, attention: str, device):
    """A decoder whose cache holds the same random keys and values for every attention path."""
    dec = CachedDecoder(teacher, batch, max_len, teacher.embed.weight.dtype, device, attention)
    gen = torch.Generator(device=device).manual_seed(1)
    for k, v in zip(dec.k, dec.v):
        k.normal_(generator=gen)
        v.normal_(generator=gen)
    dec.pos = position
    return dec


@torch.no_grad()
def path_difference(teacher: Teacher, batch: int, max_len: int, position: int, device) -> float:
    """Largest |sdpa - matmul| logit of one decode step from the same cache, relative to the
    largest |logit|: the two paths must compute the same attention."""
    tokens = torch.arange(batch, device=device)[:, None] % teacher.dims.vocab
    out = [filled_decoder(teacher, batch, max_len, position, a, device).logits(tokens).float() for a in ATTENTION]
    return ((out[0] - out[1]).abs().max() / out[1].abs().max()).item()


@torch.no_grad()
def time_steps(teacher: Teacher, batch: int, max_len: int, position: int, steps: int,
               attention: str, sampler: str, device) -> float:
    """Seconds per decode step (attention over position + 1 keys, head, one sample)."""
    dec = filled_decoder(teacher, batch, max_len, position, attention, device)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.zeros((batch, 1), dtype=torch.long, device=device)
    for rep in range(2):  # the first pass warms up
        dec.pos = position
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens = sample_next(dec.logits(tokens)[:, -1], 1.0, gen, sampler)[:, None]
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / steps
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--length", type=int, default=1025, help="cache length (generate_text.py --length)")
    ap.add_argument("--position", type=int, default=512, help="cache positions already filled")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--layers", type=int, default=30, help="teacher layers (SmolLM2-135M: 30)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--choice", default="", help="write the fastest attention path here")
    ap.add_argument("--json", default="", help="write every timing here")
    args = ap.parse_args(argv)
    if not 0 <= args.position < args.length - args.steps:
        ap.error("--position + --steps must stay inside --length")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(0)
    teacher = Teacher(Dims(), args.layers).to(device).eval()  # SmolLM2-135M's shapes, random weights
    if device.type == "cuda":
        teacher.to(torch.bfloat16)
    rows = []
    for attention in ATTENTION:
        for sampler in SAMPLERS:
            s = time_steps(teacher, args.batch, args.length, args.position, args.steps, attention, sampler, device)
            rows.append({"attention": attention, "sampler": sampler, "step_ms": round(s * 1e3, 3),
                         "tokens_per_s": round(args.batch / s)})
            print(f"[bench] attention={attention} sampler={sampler}: {s * 1e3:.2f} ms/step, "
                  f"{args.batch / s:.0f} tokens/s", flush=True)
    diff = path_difference(teacher, args.batch, args.length, args.position, device)
    print(f"[bench] sdpa vs matmul, one step: max relative logit difference {diff:.2e}")
    best = min((r for r in rows if r["sampler"] == "race"), key=lambda r: r["step_ms"])["attention"]
    print(f"[bench] fastest attention with the race sampler: {best}")
    if args.choice:
        Path(args.choice).write_text(best + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "device": str(device), "rows": rows,
                                               "sdpa_vs_matmul_rel_diff": diff},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Validation NLL per loop depth of student initialisations, before any training.

A variant is a set of train.py student flags; each is built from the teacher exactly as
train.py would build it and scored on the same fixed validation windows at depths
1..max_depth (one pass per window: prelude and loop once, coda + head per depth). Prints a
markdown table (nats/token; the teacher's NLL on the same windows in the last column) and
writes it as JSON with --json.

  python3 tools/train/init_table.py --teacher T.gguf --windows 2 --seq 256 \\
      --variant "loop-norm=0" --variant "core-init=stepwise,core-start=12,n-core=3"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from student import LoopedStudent  # noqa: E402
from teacher import load_teacher  # noqa: E402
from train import fixed_windows, init_student, load_tokens, parse_args, student_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def variant_args(teacher_path: str, spec: str):
    """train.py arguments for a variant "key=value,key=value" (keys = flags without --)."""
    argv = ["--teacher", teacher_path, "--out", "-", "--max-steps", "1"]
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        argv += [f"--{key.strip()}", value.strip()]
    return parse_args(argv)


@torch.no_grad()
def depth_nll(student: LoopedStudent, windows) -> dict:
    totals = {d: 0.0 for d in range(1, student.cfg.max_depth + 1)}
    count = 0
    for w in windows:
        x = torch.from_numpy(w)[None]
        for d, logits in student.logits_by_depth(x[:, :-1], list(totals)):
            totals[d] += F.cross_entropy(logits.float()[0], x[0, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    return {d: t / count for d, t in totals.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--data", default=str(REPO / ".traindata" / "tokens"))
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", action="append", default=[], help='e.g. "core-init=stepwise,loop-norm=0"')
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    teacher, _ = load_teacher(args.teacher)
    windows = fixed_windows(load_tokens(Path(args.data) / "val.u16"), args.windows, args.seq)
    calib = torch.from_numpy(fixed_windows(load_tokens(Path(args.data) / "train.u16"), 2, args.seq)[0][None, :-1])
    with torch.no_grad():
        teacher_nll = float(np.mean([F.cross_entropy(teacher(torch.from_numpy(w)[None, :-1])[0],
                                                     torch.from_numpy(w)[1:]).item() for w in windows]))
    rows = []
    for spec in args.variant or [""]:
        t0 = time.time()
        vargs = variant_args(args.teacher, spec)
        student = LoopedStudent(teacher.dims, student_config(vargs)).eval()
        gain = init_student(student, teacher, calib, vargs)
        nll = depth_nll(student, windows)
        rows.append({"variant": spec or "defaults", "loop_norm_gain": gain, "nll": nll})
        print(f"{spec or 'defaults'}: gain {gain:.2f} " + " ".join(f"{d}:{v:.2f}" for d, v in nll.items())
              + f"  ({time.time() - t0:.0f} s)", flush=True)

    depths = sorted({d for r in rows for d in r["nll"]})
    print(f"\nvalidation NLL (nats/token) at initialisation, {len(windows)} x {args.seq} tokens\n")
    print("| variant | " + " | ".join(str(d) for d in depths) + " | teacher |")
    print("|---|" + "---|" * (len(depths) + 1))
    for r in rows:
        cells = [f"{r['nll'][d]:.2f}" if d in r["nll"] else "" for d in depths]
        print(f"| {r['variant']} | " + " | ".join(cells) + f" | {teacher_nll:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"teacher_nll": teacher_nll, "windows": len(windows),
                                               "seq": args.seq, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

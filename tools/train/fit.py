"""How much of the student's quality is its training text: NLL on seen and unseen text.

Scores, with the TinyLoop runtime at the student's default depth and for the teacher,
evenly spaced windows of the training file (text the student saw many times), of the
validation file (the same sources, unseen documents) and the start of the held-out SOTU
2001+ text, in nats/token. A student that beats its teacher on the training text while
trailing it elsewhere is learning the corpus itself: more passes will not close the gap,
more (or more varied) text might.

  python3 tools/train/fit.py --model student.tinyloop --teacher-model teacher.tinyloop
(needs the built runtime: PYTHONPATH=python, TINYLOOP_LIBRARY=.../libtinyloop.so)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate import heldout_tokens  # noqa: E402
from tinyloop import Model  # noqa: E402

SPLITS = (("training text", "train.u16"), ("validation", "val.u16"), ("held-out SOTU 2001+", "eval_sotu.u16"))


def sample(path: Path, windows: int, ctx: int, spread: bool) -> np.ndarray:
    """`windows` windows of `ctx` tokens: evenly spaced over the file, or its start."""
    tokens = heldout_tokens(path, 0)
    if len(tokens) < windows * ctx:
        raise SystemExit(f"{path}: {len(tokens)} tokens, fewer than {windows} windows of {ctx}")
    if not spread:
        return tokens[:windows * ctx]
    step = (len(tokens) - ctx) // max(1, windows - 1) if windows > 1 else 0
    return np.concatenate([tokens[i * step:i * step + ctx] for i in range(windows)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="student .tinyloop")
    ap.add_argument("--teacher-model", required=True, help="teacher converted to .tinyloop")
    ap.add_argument("--data", default=str(REPO / ".traindata" / "tokens"))
    ap.add_argument("--windows", type=int, default=6, help="windows per text")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.windows < 1 or args.ctx < 2:
        ap.error("--windows must be >= 1 and --ctx >= 2")

    texts = {label: sample(Path(args.data) / name, args.windows, args.ctx, spread=name != "eval_sotu.u16")
             for label, name in SPLITS}
    nll = {}
    for who, path in (("student", args.model), ("teacher", args.teacher_model)):
        with Model(path, threads=args.threads) as model:
            nll[who] = {label: math.log(model.perplexity(tokens, ctx=args.ctx))  # default depth
                        for label, tokens in texts.items()}
            print(f"{who}: " + ", ".join(f"{k} {v:.3f}" for k, v in nll[who].items()), flush=True)
    lines = ["| text | student (default depth) | teacher | student - teacher |", "|---|---|---|---|"]
    for label in texts:
        s, t = nll["student"][label], nll["teacher"][label]
        lines.append(f"| {label} | {s:.3f} | {t:.3f} | {s - t:+.3f} |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        Path(args.json).write_text(json.dumps({"windows": args.windows, "ctx": args.ctx, "nll": nll,
                                               "markdown": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()

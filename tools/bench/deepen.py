#!/usr/bin/env python3
"""Going deeper on a sequence already run: continuing its loop (Context.deepen, the
library's tl_context_deepen) against running it again at the deeper depth, in one run.

Each window of real text (--tokens, uint16 ids as tools/train/data.py writes them; default
the held-out State of the Union text) is timed, in alternating rounds, as:
  - `fresh`: scored at --to from the start (score, the peer of the deepening; and
    score_with_uncertainty, the peer of escalation, which returns entropies too);
  - `deepened`: appended at --from in a context that keeps its loop states, then
    score_deeper(--to), timing the deepening alone and the two together;
  - `escalation`: score_with_consistency_escalation(min_depth=1, max_depth=--to) for each
    --max-changed, which now deepens pass after pass instead of starting over.
Medians over rounds of the summed seconds of all windows are reported, with the depth each
escalation stopped at on average and its perplexity. Every deepened score is checked to
equal the fresh one at --to.

    python tools/bench/deepen.py --threads 2 --windows 24 --repeat 3 --json deepen.json
"""
import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import tinyloop
from tinyloop.default_model import default_model_path

REPO = Path(__file__).resolve().parents[2]


def windows_of(path: Path, count: int, length: int) -> list:
    tokens = np.fromfile(path, dtype=np.uint16).astype(np.int32)
    if len(tokens) < count * length:
        raise SystemExit(f"{path} holds {len(tokens)} tokens, fewer than {count} x {length}")
    return [tokens[i * length:(i + 1) * length] for i in range(count)]


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def one_round(model, windows, args) -> dict:
    seconds = {"fresh": 0.0, "uncertainty": 0.0, "append_from": 0.0, "deepen": 0.0}
    fresh = []
    for w in windows:
        t, logprobs = timed(model.score, w, depth=args.to_depth)
        seconds["fresh"] += t
        fresh.append(logprobs)
        seconds["uncertainty"] += timed(model.score_with_uncertainty, w, depth=args.to_depth)[0]
    for w, expected in zip(windows, fresh if args.deepen else []):
        with model.context(max_seq_len=len(w), keep_loop_states=True) as ctx:
            t, _ = timed(ctx.append, w, depth=args.from_depth)
            seconds["append_from"] += t
            t, logprobs = timed(ctx.score_deeper, args.to_depth)
            seconds["deepen"] += t
        if not np.allclose(logprobs, expected, rtol=0, atol=1e-5):
            raise SystemExit(f"deepened log-probs differ from the fresh ones by "
                             f"{np.abs(logprobs - expected).max():.3g}")
    escalation = {}
    for share in args.max_changed:
        total, depths, nll = 0.0, [], []
        for w in windows:
            t, (logprobs, _, depth) = timed(model.score_with_consistency_escalation, w, min_depth=1,
                                            max_depth=args.to_depth, max_changed=share)
            total += t
            depths.append(depth)
            nll.append(-float(np.mean(logprobs, dtype=np.float64)))
        escalation[str(share)] = {"seconds": total, "mean_depth": statistics.mean(depths),
                                  "perplexity": math.exp(statistics.mean(nll))}
    return {"seconds": seconds, "escalation": escalation,
            "fresh_perplexity": math.exp(statistics.mean(
                -float(np.mean(lp, dtype=np.float64)) for lp in fresh))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the packaged default model")
    ap.add_argument("--tokens", default=str(REPO / ".traindata" / "tokens" / "eval_sotu.u16"))
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--from-depth", type=int, default=2)
    ap.add_argument("--to-depth", type=int, default=0, help="0: the model's default depth")
    ap.add_argument("--max-changed", default="0.1,0.2,0.3")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-deepen", dest="deepen", action="store_false",
                    help="time only the fresh passes and escalation (a library without deepening)")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.max_changed = [float(v) for v in args.max_changed.split(",") if v]
    path = args.model or str(default_model_path())
    windows = windows_of(Path(args.tokens), args.windows, args.length)
    with tinyloop.Model(path, threads=args.threads) as model:
        args.to_depth = args.to_depth or model.info.default_depth
        if not 1 <= args.from_depth < args.to_depth:
            raise SystemExit(f"--from-depth must be in [1, {args.to_depth})")
        rounds = [one_round(model, windows, args) for _ in range(args.repeat)]

    def median(get):
        return statistics.median(get(r) for r in rounds)

    res = {"model": Path(path).name, "machine": platform.processor() or platform.machine(),
           "threads": args.threads, "windows": args.windows, "length": args.length,
           "from_depth": args.from_depth, "to_depth": args.to_depth, "repeat": args.repeat,
           "library": tinyloop.__version__ if hasattr(tinyloop, "__version__") else "",
           "fresh_s": median(lambda r: r["seconds"]["fresh"]),
           "uncertainty_s": median(lambda r: r["seconds"]["uncertainty"]),
           "append_from_s": median(lambda r: r["seconds"]["append_from"]),
           "deepen_s": median(lambda r: r["seconds"]["deepen"]),
           "fresh_perplexity": rounds[0]["fresh_perplexity"],
           "escalation": {s: {"seconds": median(lambda r: r["escalation"][s]["seconds"]),
                              "mean_depth": rounds[0]["escalation"][s]["mean_depth"],
                              "perplexity": rounds[0]["escalation"][s]["perplexity"]}
                          for s in rounds[0]["escalation"]}}
    print(f"{res['windows']} windows of {res['length']} tokens, {res['model']}, threads {args.threads}, "
          f"median of {args.repeat}")
    print(f"  at depth {args.to_depth} from the start: score {res['fresh_s']:.2f} s, "
          f"score_with_uncertainty {res['uncertainty_s']:.2f} s, perplexity {res['fresh_perplexity']:.2f}")
    if args.deepen:
        print(f"  at depth {args.from_depth}, then deepened to {args.to_depth}: {res['append_from_s']:.2f} s + "
              f"{res['deepen_s']:.2f} s (the deepening alone: {res['deepen_s'] / res['fresh_s']:.2f}x score)")
    for share, e in res["escalation"].items():
        print(f"  escalation 1..{args.to_depth}, max_changed {share}: {e['seconds']:.2f} s "
              f"({e['seconds'] / res['uncertainty_s']:.2f}x), mean depth {e['mean_depth']:.2f}, "
              f"perplexity {e['perplexity']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

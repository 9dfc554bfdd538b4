#!/usr/bin/env python3
"""Warm start chosen at run time (state_init="warm") against the file's own state init, by
loop depth: perplexity of a short held-out text, and greedy agreement (the share of
positions whose most likely next token is the same) with the file's init at the same depth
and at the default depth. One pass per depth and init; prints a Markdown table.

    nice -n 10 python tools/bench/warm_start.py --threads 2 --json warm.json
"""
import argparse
import json
import math
import platform
import time
from pathlib import Path

import numpy as np

import tinyloop
from tinyloop.default_model import default_model_path

REPO = Path(__file__).resolve().parents[2]


def scored(model, tokens, depth):
    """(perplexity, each position's most likely next token) of tokens at depth."""
    logprobs, top_ids, _ = model.score_top_logprobs(tokens, top_k=1, depth=depth)
    return math.exp(-float(np.mean(logprobs, dtype=np.float64))), np.asarray(top_ids)[:, 0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the packaged default model")
    ap.add_argument("--text", default=str(REPO / "tests" / "data" / "gettysburg.txt"))
    ap.add_argument("--depths", default="1,2,3,4,5,6,8")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = args.model or str(default_model_path())
    depths = [int(d) for d in args.depths.split(",")]
    rows = {}
    t0 = time.perf_counter()
    with tinyloop.Model(path, threads=args.threads) as file_init, \
            tinyloop.Model(path, threads=args.threads, state_init="warm") as warm:
        tokens = file_init.tokenizer.encode(Path(args.text).read_text())
        default = file_init.info.default_depth
        _, reference_top = scored(file_init, tokens, default)
        for depth in depths:
            ppl, top = scored(file_init, tokens, depth)
            warm_ppl, warm_top = scored(warm, tokens, depth)
            rows[depth] = {"perplexity": ppl, "warm_perplexity": warm_ppl,
                           "warm_agrees_same_depth": float(np.mean(warm_top == top)),
                           "agrees_default": float(np.mean(top == reference_top)),
                           "warm_agrees_default": float(np.mean(warm_top == reference_top))}
        init = file_init.metadata().get("loop.state_init", "prelude")
    result = {"model": Path(path).name, "text": Path(args.text).name, "tokens": len(tokens),
              "file_state_init": init, "default_depth": default, "threads": args.threads,
              "machine": platform.processor() or platform.machine(), "seconds": time.perf_counter() - t0,
              "date": time.strftime("%Y-%m-%d"), "depths": rows}
    print(f"{result['model']} on {result['text']} ({len(tokens)} tokens), file init {init}, "
          f"{result['seconds']:.0f} s")
    print("| depth | " + " | ".join(str(d) for d in depths) + " |")
    print("|---|" + "---|" * len(depths))
    for key, label, fmt in (("perplexity", f"perplexity, {init}", "{:.1f}"),
                            ("warm_perplexity", "perplexity, warm", "{:.1f}"),
                            ("warm_agrees_same_depth", "warm agrees with " + init + " (same depth)", "{:.2f}"),
                            ("agrees_default", f"{init} agrees with depth {default}", "{:.2f}"),
                            ("warm_agrees_default", f"warm agrees with {init} depth {default}", "{:.2f}")):
        print(f"| {label} | " + " | ".join(fmt.format(rows[d][key]) for d in depths) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What the fp16_body mode (load option body_dtype) buys: speed and memory, as stored vs
the loop body held as fp16, on the shipped default model (or --model).

Both models are loaded side by side and measured in alternating rounds (A B A B ...),
so drift on a shared machine hits both alike; each figure is the median of --rounds.
Prefill: one score of --prompt-tokens tokens of real text (tests/data/gettysburg.txt)
at the default depth, in tokens per second. Decode: --decode-tokens one-token appends
after an 8-token prompt, at depth 1 and at the default depth, in tokens per second.
Memory: the memory report's weights_bytes and body_bytes. Also the perplexity of the
text under both (the mode's accuracy cost).

    python tools/bench/fp16_body.py --threads 2 --json fp16_body.json
    python tools/bench/fp16_body.py --device cuda --json fp16_body_cuda.json
"""
import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import tinyloop
from tinyloop.default_model import default_model_path

REPO = Path(__file__).resolve().parents[2]
BODIES = ("as_stored", "f16")


def prefill_rate(model, tokens, depth) -> float:
    start = time.perf_counter()
    model.score(tokens, depth=depth)
    return len(tokens) / (time.perf_counter() - start)


def decode_rate(model, tokens, depth, n) -> float:
    with model.context() as ctx:
        ctx.append(tokens[:8], depth=depth)
        start = time.perf_counter()
        for t in tokens[8:8 + n]:
            ctx.append([int(t)], depth=depth)
        return n / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the shipped default model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--text", default=str(REPO / "tests" / "data" / "gettysburg.txt"))
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    path = args.model or str(default_model_path())
    models = {b: tinyloop.Model(path, device=args.device, threads=args.threads, body_dtype=b)
              for b in BODIES}
    try:
        first = models[BODIES[0]]
        depth = first.info.default_depth
        tokens = np.asarray(first.tokenizer.encode(Path(args.text).read_text()), dtype=np.int32)
        if len(tokens) < max(args.prompt_tokens, 8 + args.decode_tokens):
            raise SystemExit(f"{args.text}: {len(tokens)} tokens, fewer than the run needs")
        prompt = tokens[:args.prompt_tokens]
        runs = {b: {"prefill": [], "decode_depth1": [], "decode_default": []} for b in BODIES}
        for b in BODIES:   # warm-up: page in the weights, build the contexts once
            prefill_rate(models[b], prompt[:32], depth)
            decode_rate(models[b], tokens, depth, 4)
        for _ in range(args.rounds):
            for b in BODIES:
                m = models[b]
                runs[b]["prefill"].append(prefill_rate(m, prompt, depth))
                runs[b]["decode_depth1"].append(decode_rate(m, tokens, 1, args.decode_tokens))
                runs[b]["decode_default"].append(decode_rate(m, tokens, depth, args.decode_tokens))
        rows = []
        for b in BODIES:
            m = models[b]
            report = m.memory_report()
            ppl = float(np.exp(-m.score(tokens, depth=depth).astype(np.float64).mean()))
            rows.append({"body": b, **{k: statistics.median(v) for k, v in runs[b].items()},
                         "weights_bytes": report["weights_bytes"], "body_bytes": report["body_bytes"],
                         "device_bytes": report["device_bytes"], "perplexity": ppl})
        result = {"model": path, "device": first.info.device_name, "threads": first.info.n_threads,
                  "default_depth": depth, "prompt_tokens": len(prompt),
                  "decode_tokens": args.decode_tokens, "rounds": args.rounds, "text_tokens": len(tokens),
                  "machine": platform.processor() or platform.machine(),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    finally:
        for m in models.values():
            m.close()
    mib = 2**20
    print(f"{result['device']}, {result['threads']} threads, default depth {depth}, medians of {args.rounds}")
    print(f"{'body':10s} {'prefill tok/s':>14s} {'decode d1':>10s} {'decode d' + str(depth):>10s} "
          f"{'weights MiB':>12s} {'body MiB':>9s} {'ppl':>8s}")
    for r in rows:
        print(f"{r['body']:10s} {r['prefill']:14.1f} {r['decode_depth1']:10.1f} {r['decode_default']:10.1f} "
              f"{r['weights_bytes'] / mib:12.1f} {r['body_bytes'] / mib:9.1f} {r['perplexity']:8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
